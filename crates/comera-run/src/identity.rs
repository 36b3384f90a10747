//! A run's identity, `RUN/run.toml`: the run's id (every checkpoint and model file carries it)
//! and the SHA-256 of its config. Read here; written and checked by [`crate::run_dir`].

use crate::error::{Error, IoContext, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The identity file of a run directory.
pub const IDENTITY: &str = "run.toml";

/// What `run.toml` holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunIdentity {
    /// Unique per run (32 hex digits).
    pub id: String,
    /// SHA-256 of the run's resolved config (`config.toml`).
    pub config_sha256: String,
    /// When the run was created (seconds since the Unix epoch).
    pub created_unix: u64,
    /// The comera version that created it.
    pub comera_version: String,
    /// Each time the run was extended (`comera train --resume DIR --extend-epochs N`), oldest
    /// first: its checkpoints from before an extension belong to it too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extensions: Vec<Extension>,
}

/// One extension of a run: its config's epochs raised after step `at_step`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Extension {
    /// The step of the checkpoint the extended run continues from.
    pub at_step: u64,
    /// The run's epochs before and after.
    pub from_epochs: usize,
    pub to_epochs: usize,
    /// SHA-256 of `config.toml` before the extension.
    pub previous_config_sha256: String,
}

impl RunIdentity {
    /// Reads `dir/run.toml`.
    pub fn read(dir: &Path) -> Result<RunIdentity> {
        let path = dir.join(IDENTITY);
        let text = comera_data::read_regular_to_string(&path)
            .io(&path, "cannot read the run's identity")?;
        toml::from_str(&text).map_err(|e| Error::parse(&path, e))
    }
}
