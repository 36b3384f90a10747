//! What people look at: the figures of a run and runs side by side. It reads runs through
//! comera-run and draws; nothing here trains.
//!
//! - [`plot`]: the figures (line panels and bars, PNG written atomically);
//! - [`results`]: runs side by side (`comera report`): tables, plots, the paper's figures.

pub mod plot;
pub mod results;

use plot::PlotError;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a report can fail with: reading the runs, or drawing.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A run, a file or an output directory (comera-run's error).
    #[error(transparent)]
    Run(#[from] comera_run::Error),
    /// A figure that cannot be drawn or written.
    #[error(transparent)]
    Plot(Box<PlotError>),
}

impl From<PlotError> for Error {
    fn from(e: PlotError) -> Error {
        Error::Plot(Box::new(e))
    }
}

/// A page's JSON that cannot be written: comera-run's `Error::Json`, as before the split.
impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Error {
        Error::Run(e.into())
    }
}
