//! Run storage: what a run directory is and everything that reads one back. A run's config,
//! its records (`metrics.jsonl`, `report.json`), its model files, checkpoints, identity and
//! lock; nothing here trains.
//!
//! - [`config`]: run configs (`RunConfig` for the encoder, `DlrmRunConfig`, either as
//!   `AnyRunConfig`), errors naming the file and field;
//! - [`records`]: the typed lines of `metrics.jsonl`, held-out figures and `report.json`;
//! - [`files`]: atomic writes, model files of every kind;
//! - [`checkpoint`]: checkpoints with exact resume;
//! - [`identity`]: a run's identity (`run.toml`), read;
//! - [`run_dir`]: a run directory's lock, fresh start or resume, its identity written and checked;
//! - [`outputs`]: what comera may write and replace outside a run directory (exports, pages);
//! - [`error`]: the crate's [`Error`] (typed, with the lower crates' errors as sources).

pub mod checkpoint;
pub mod config;
pub mod error;
pub mod files;
pub mod identity;
pub mod outputs;
pub mod records;
pub mod run_dir;

pub use error::{BoxError, Error, Result};
