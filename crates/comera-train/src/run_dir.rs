//! A run directory, opened for writing: one writer at a time, one run per directory.
//!
//! - **Identity.** `run.toml` is written when a run starts: a run id (unique per run, even for
//!   the same config and seed) and the SHA-256 of the run's resolved config. Every checkpoint
//!   and `model.toml` carries the id; resume refuses a checkpoint of another run, and the model
//!   loaders refuse model files of another run.
//! - **One writer.** `.lock` is held with an OS file lock for as long as a process writes the
//!   directory; the lock dies with the process. A second writer is refused with the holder's
//!   pid. Readers (eval, predict, inspect) take no lock: every file is replaced atomically.
//! - **Fresh or continued.** A fresh run needs an empty directory (or `--overwrite`, which
//!   clears a directory that holds a comera run, and nothing else); a continued run resumes from
//!   the newest checkpoint that verifies, by the step inside the file (not its name).
//! - **Cleanup.** Temporary files of dead processes are removed when the directory is opened.

use crate::checkpoint::{self, Checkpoint};
use anyhow::{anyhow, bail, Context};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The identity file of a run directory.
pub const IDENTITY: &str = "run.toml";
/// The lock file of a run directory.
pub const LOCK: &str = ".lock";

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
}

impl RunIdentity {
    /// Reads `dir/run.toml`.
    pub fn read(dir: &Path) -> anyhow::Result<RunIdentity> {
        let path = dir.join(IDENTITY);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("{}: cannot read the run's identity", path.display()))?;
        toml::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()))
    }
}

/// SHA-256 of a text, hex.
pub fn sha256_hex(text: &str) -> String {
    crate::files::digest(std::iter::once(("", &[][..], text.as_bytes())))
}

/// A new run id: a hash of the time, the process id and the config, so two runs started at
/// once (or from one config and seed) get different ids. It seeds nothing: training results
/// do not depend on it.
fn new_run_id(config_toml: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let salt = format!(
        "{}:{}:{}",
        now.as_nanos(),
        std::process::id(),
        sha256_hex(config_toml)
    );
    sha256_hex(&salt)[..32].to_string()
}

/// A run directory locked for writing.
pub struct RunDir {
    pub path: PathBuf,
    /// The run's identity (read from `run.toml`, or made for a fresh run).
    pub identity: RunIdentity,
    _lock: RunLock,
}

impl RunDir {
    /// Opens `path` for a fresh run of `config_toml`: creates and locks it, removes stale
    /// temporaries, refuses a non-empty directory (unless `overwrite`, which first removes the
    /// previous run's files), then writes `run.toml` and `config.toml`.
    pub fn create(path: &Path, config_toml: &str, overwrite: bool) -> anyhow::Result<RunDir> {
        if path.as_os_str().is_empty() {
            bail!("train.out_dir: empty; name the run directory");
        }
        std::fs::create_dir_all(path)
            .with_context(|| format!("{}: cannot create run directory", path.display()))?;
        let lock = RunLock::acquire(path)?;
        clean_temporaries(path);
        let entries = contents(path)?;
        if !entries.is_empty() {
            if !overwrite {
                let what = match RunIdentity::read(path) {
                    Ok(r) => format!("holds run {}", r.id),
                    Err(_) => format!("is not empty ({} entries)", entries.len()),
                };
                bail!(
                    "{}: {what}; continue it with `comera train --resume {0}`, replace it with --overwrite, or choose another --out",
                    path.display()
                );
            }
            let is_run = ["config.toml", IDENTITY, checkpoint::DIR, "metrics.jsonl"]
                .iter()
                .any(|n| path.join(n).exists());
            if !is_run {
                bail!(
                    "{}: --overwrite refused: the directory holds files but no comera run (no config.toml, run.toml, checkpoints/ or metrics.jsonl); nothing was removed",
                    path.display()
                );
            }
            for e in &entries {
                let r = if e.is_dir() {
                    std::fs::remove_dir_all(e)
                } else {
                    std::fs::remove_file(e)
                };
                r.with_context(|| format!("{}: cannot remove (--overwrite)", e.display()))?;
            }
        }
        let identity = RunIdentity {
            id: new_run_id(config_toml),
            config_sha256: sha256_hex(config_toml),
            created_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            comera_version: env!("CARGO_PKG_VERSION").to_string(),
        };
        crate::files::write_atomic(&path.join("config.toml"), config_toml.as_bytes())?;
        crate::files::write_atomic(
            &path.join(IDENTITY),
            toml::to_string_pretty(&identity)?.as_bytes(),
        )?;
        Ok(RunDir {
            path: path.to_path_buf(),
            identity,
            _lock: lock,
        })
    }

    /// Opens an existing run directory to continue it: locks it, removes stale temporaries and
    /// reads its identity.
    pub fn open(path: &Path) -> anyhow::Result<RunDir> {
        if !path.is_dir() {
            bail!("{}: no such run directory", path.display());
        }
        let lock = RunLock::acquire(path)?;
        clean_temporaries(path);
        let identity = RunIdentity::read(path)?;
        Ok(RunDir {
            path: path.to_path_buf(),
            identity,
            _lock: lock,
        })
    }

    /// The checkpoint to resume from ([`newest_checkpoint`]).
    pub fn newest_checkpoint(&self) -> anyhow::Result<Checkpoint> {
        newest_checkpoint(&self.path, &self.identity)
    }
}

/// The checkpoint of the run in `dir` (whose identity is `own`) to resume from: the newest by
/// the step inside the file that verifies. Damaged ones are skipped, each reported on stderr
/// with the reason; a checkpoint of another run (id or config) is refused, naming both.
pub fn newest_checkpoint(dir: &Path, own: &RunIdentity) -> anyhow::Result<Checkpoint> {
    let candidates = checkpoint::list(dir)?;
    if candidates.is_empty() {
        bail!(
            "{}: no checkpoint to resume from (expected {}/step-*.safetensors)",
            dir.display(),
            checkpoint::DIR
        );
    }
    let mut skipped = Vec::new();
    for path in candidates.iter().rev() {
        match Checkpoint::load(path) {
            Ok(ck) => {
                check_owner(dir, own, &ck)?;
                return Ok(ck);
            }
            Err(e) => {
                eprintln!("skip  {}: {e:#}", path.display());
                skipped.push(format!("{}: {e:#}", path.display()));
            }
        }
    }
    bail!(
        "{}: no checkpoint verifies:\n  {}",
        dir.display(),
        skipped.join("\n  ")
    )
}

/// Refuses a checkpoint written by another run than the one of `dir`.
fn check_owner(dir: &Path, own: &RunIdentity, ck: &Checkpoint) -> anyhow::Result<()> {
    if ck.run_id != own.id {
        bail!(
            "{}: written by run {}, but {} is run {} ({}); refusing a checkpoint of another run",
            ck.path.display(),
            ck.run_id,
            dir.display(),
            own.id,
            dir.join(IDENTITY).display()
        );
    }
    let config = dir.join("config.toml");
    let text = std::fs::read_to_string(&config)
        .with_context(|| format!("{}: cannot read the run's config", config.display()))?;
    if sha256_hex(&text) != own.config_sha256 {
        bail!(
            "{}: changed since the run started (its sha256 is not the one in {}); restore it, or start a new run",
            config.display(),
            IDENTITY
        );
    }
    if ck.config_toml != text {
        bail!(
            "{}: written with another config than {} (a checkpoint of another run?); refusing to resume from it",
            ck.path.display(),
            config.display()
        );
    }
    Ok(())
}

/// The entries of `dir` other than its lock.
fn contents(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    Ok(std::fs::read_dir(dir)
        .with_context(|| format!("{}: cannot list", dir.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name() != LOCK)
        .map(|e| e.path())
        .collect())
}

/// Removes temporary files of dead processes from the run directory and its checkpoints.
fn clean_temporaries(dir: &Path) {
    for d in [dir.to_path_buf(), dir.join(checkpoint::DIR)] {
        crate::files::remove_stale_temporaries(&d);
    }
}

/// The exclusive lock of a run directory (`.lock`, an OS file lock that dies with the
/// process), held while a process writes the directory.
pub struct RunLock {
    _file: std::fs::File,
}

impl RunLock {
    /// Locks `dir` for writing; refused, naming the holder's pid, when another process has it.
    pub fn acquire(dir: &Path) -> anyhow::Result<RunLock> {
        let path = dir.join(LOCK);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("{}: cannot open the run's lock", path.display()))?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let holder = std::fs::read_to_string(&path).unwrap_or_default();
                bail!(
                    "{}: the run directory is in use by another comera process (pid {}); one writer at a time",
                    dir.display(),
                    holder.trim()
                );
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(anyhow!("{}: cannot lock: {e}", path.display()))
            }
        }
        file.set_len(0)
            .and_then(|_| write!(file, "{}", std::process::id()))
            .with_context(|| format!("{}: cannot write", path.display()))?;
        Ok(RunLock { _file: file })
    }
}
