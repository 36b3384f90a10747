//! The crate's error type: what went wrong reading or writing a run, with the typed error of
//! the layer below as its source (never flattened into the message). A message never repeats
//! its source: the command line prints the chain with `{:#}` (`message: source: source…`).
//! comera-train's `Error` has each of these variants too (it converts one to the other).

use std::path::{Path, PathBuf};

pub use crate::checkpoint::CheckpointError;
pub use crate::config::ConfigError;
pub use crate::files::{TensorError, WriteError};
pub use crate::run_dir::RunDirError;

/// Any error, kept typed as the source of one of ours (a lower crate's error, a parser's).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything reading or writing a run (its config, records, model files, checkpoints,
/// directory) can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A config field or a command-line flag the run cannot use (names the file and field).
    #[error(transparent)]
    Config(Box<ConfigError>),
    /// A file or directory that cannot be read, created, listed, …: `PATH: cannot …`, then
    /// the system's reason.
    #[error("{}: {action}", .path.display())]
    Io {
        path: PathBuf,
        /// What was being done (`cannot read`, `cannot create directory`, …).
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// An atomic write that failed.
    #[error(transparent)]
    Write(Box<WriteError>),
    /// A file (TOML, JSON) that does not parse: the file, then the parser's reason.
    #[error("{}", .path.display())]
    Parse {
        path: PathBuf,
        #[source]
        source: BoxError,
    },
    /// A checkpoint that cannot be read or used.
    #[error(transparent)]
    Checkpoint(Box<CheckpointError>),
    /// A run directory that cannot be created, resumed or locked.
    #[error(transparent)]
    RunDir(Box<RunDirError>),
    /// A model: saved files that cannot be used, a model that cannot be built.
    #[error("{what}")]
    Model {
        what: String,
        #[source]
        source: Option<BoxError>,
    },
    /// The run itself: its outputs.
    #[error("{what}")]
    Run {
        what: String,
        #[source]
        source: Option<BoxError>,
    },
    /// Tensors that cannot be serialised as safetensors.
    #[error(transparent)]
    SafeTensors(Box<safetensors::SafeTensorError>),
    /// A value that cannot be written as TOML.
    #[error(transparent)]
    TomlSer(Box<toml::ser::Error>),
    /// A value that cannot be written or read as JSON.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// `From` for the boxed variants (boxed to keep `Result<T, Error>` small).
macro_rules! boxed_from {
    ($($variant:ident($ty:ty),)*) => {
        $(impl From<$ty> for Error {
            fn from(e: $ty) -> Error {
                Error::$variant(Box::new(e))
            }
        })*
    };
}

boxed_from! {
    Config(ConfigError),
    Write(WriteError),
    Checkpoint(CheckpointError),
    RunDir(RunDirError),
    SafeTensors(safetensors::SafeTensorError),
    TomlSer(toml::ser::Error),
}

impl Error {
    /// [`Error::Model`] without a source.
    pub fn model(what: impl Into<String>) -> Error {
        Error::Model {
            what: what.into(),
            source: None,
        }
    }

    /// [`Error::Model`]: `what`, caused by `source`.
    pub fn model_with(what: impl Into<String>, source: impl Into<BoxError>) -> Error {
        Error::Model {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    /// [`Error::Run`] without a source.
    pub fn run(what: impl Into<String>) -> Error {
        Error::Run {
            what: what.into(),
            source: None,
        }
    }

    /// [`Error::Run`]: `what`, caused by `source`.
    pub fn run_with(what: impl Into<String>, source: impl Into<BoxError>) -> Error {
        Error::Run {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    /// [`Error::Io`].
    pub fn io(path: &Path, action: &'static str, source: std::io::Error) -> Error {
        Error::Io {
            path: path.to_path_buf(),
            action,
            source,
        }
    }

    /// [`Error::Parse`].
    pub fn parse(path: &Path, source: impl Into<BoxError>) -> Error {
        Error::Parse {
            path: path.to_path_buf(),
            source: source.into(),
        }
    }
}

/// An error and its sources, `message: source: source…` (as `{:#}` of the command line prints
/// a chain), for a message that shows an error in the middle of its text. A source whose text
/// the previous message already holds (an I/O error quoted by its wrapper) is said once.
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut said = self.0.to_string();
        f.write_str(&said)?;
        let mut next = self.0.source();
        while let Some(e) = next {
            let text = e.to_string();
            if !text.is_empty() && !said.contains(&text) {
                write!(f, ": {text}")?;
            }
            said = text;
            next = e.source();
        }
        Ok(())
    }
}

/// `.io(path, "cannot read")` on an I/O result: the error names the path and the action.
pub trait IoContext<T> {
    fn io(self, path: &Path, action: &'static str) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn io(self, path: &Path, action: &'static str) -> Result<T> {
        self.map_err(|e| Error::io(path, action, e))
    }
}
