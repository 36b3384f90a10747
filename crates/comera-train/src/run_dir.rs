//! A run directory, opened for writing: one writer at a time, one run per directory.
//!
//! - **Identity.** `run.toml` is written when a run starts: a run id (unique per run, even for
//!   the same config and seed) and the SHA-256 of the run's resolved config. Every checkpoint
//!   and `model.toml` carries the id; resume refuses a checkpoint of another run, and the model
//!   loaders refuse model files of another run.
//! - **One writer.** `.lock` is held with an OS file lock for as long as a process writes the
//!   directory; the lock dies with the process. A second writer is refused with the holder's
//!   pid. Readers (eval, predict, inspect) take no lock: every file is replaced atomically.
//! - **Fresh or continued.** A fresh run needs an empty directory, or `--overwrite` of a
//!   directory that holds a comera run (its `run.toml` verifies) and nothing else. The previous
//!   run is moved aside, not deleted, until the new one has written its first checkpoint: a new
//!   run that fails (bad data, a missing `init_from`, …) or is killed before that gives the
//!   directory back to the old one. A continued run resumes from the newest checkpoint that
//!   verifies, by the step inside the file (not its name).
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
        let text = comera_data::read_regular_to_string(&path)
            .with_context(|| format!("{}: cannot read the run's identity", path.display()))?;
        toml::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()))
    }

    /// The text of `dir/config.toml`, checked against the sha256 this identity names.
    pub fn verified_config(&self, dir: &Path) -> anyhow::Result<String> {
        let config = dir.join("config.toml");
        let text = comera_data::read_regular_to_string(&config)
            .with_context(|| format!("{}: cannot read the run's config", config.display()))?;
        if sha256_hex(&text) != self.config_sha256 {
            bail!(
                "{}: changed since the run started (its sha256 does not match the one in {}); restore it, or start a new run",
                config.display(),
                IDENTITY
            );
        }
        Ok(text)
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

/// The folder inside a run directory that `--overwrite` moves the previous run into: it is
/// deleted once the new run has written its first checkpoint (or ended), and moved back if the
/// new run fails before that (or was killed: the next open of the directory restores it).
pub const REPLACED: &str = ".replaced-run";

/// The names a run directory may hold besides the ones listed here: what `train`, `import` and
/// early stopping write. `--overwrite` replaces a directory only if it holds nothing else.
pub const RUN_FILES: &[&str] = &[
    "config.toml",
    IDENTITY,
    "metrics.jsonl",
    checkpoint::DIR,
    crate::files::MODEL_WEIGHTS,
    crate::files::MODEL_META,
    "vocab.txt",
    "curves.png",
    "ranks.png",
    "ranks.md",
    "report.json",
    crate::trainer::BEST_DIR,
];

/// A run directory locked for writing.
pub struct RunDir {
    pub path: PathBuf,
    /// The run's identity (read from `run.toml`, or made for a fresh run).
    pub identity: RunIdentity,
    /// Under `--overwrite`: the previous run, moved aside into [`REPLACED`] until the new run
    /// has a checkpoint ([`RunDir::keep_new_run`]); restored when the `RunDir` is dropped
    /// before that.
    replaced: std::cell::Cell<bool>,
    _lock: RunLock,
}

impl RunDir {
    /// Opens `path` for a fresh run of `config_toml`: creates and locks it, removes stale
    /// temporaries, refuses a non-empty directory unless `overwrite` and it holds a comera run
    /// (its `run.toml` verifies and it holds nothing but [`RUN_FILES`]), whose files are then
    /// moved aside (not deleted: see [`REPLACED`]); then writes `run.toml` and `config.toml`.
    pub fn create(path: &Path, config_toml: &str, overwrite: bool) -> anyhow::Result<RunDir> {
        if path.as_os_str().is_empty() {
            bail!("train.out_dir: empty; name the run directory");
        }
        resolve_symlink(path)?;
        std::fs::create_dir_all(path)
            .with_context(|| format!("{}: cannot create run directory", path.display()))?;
        let lock = RunLock::acquire(path)?;
        clean_temporaries(path);
        recover_replaced(path)?;
        let entries = check_fresh_target(path, overwrite)?;
        let replaced = !entries.is_empty();
        if replaced {
            move_aside(path, &entries)?;
        }
        let identity = RunIdentity {
            id: new_run_id(config_toml),
            config_sha256: sha256_hex(config_toml),
            created_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            comera_version: env!("CARGO_PKG_VERSION").to_string(),
        };
        // From here the `RunDir` exists: an error restores the previous run when it drops.
        let dir = RunDir {
            path: path.to_path_buf(),
            identity,
            replaced: std::cell::Cell::new(replaced),
            _lock: lock,
        };
        crate::files::write_atomic(&path.join("config.toml"), config_toml.as_bytes())?;
        crate::files::write_atomic(
            &path.join(IDENTITY),
            toml::to_string_pretty(&dir.identity)?.as_bytes(),
        )?;
        Ok(dir)
    }

    /// Opens an existing run directory to continue it: locks it, removes stale temporaries,
    /// finishes an interrupted `--overwrite` and reads its identity.
    pub fn open(path: &Path) -> anyhow::Result<RunDir> {
        resolve_symlink(path)?;
        if !path.is_dir() {
            bail!("{}: no such run directory", path.display());
        }
        let lock = RunLock::acquire(path)?;
        clean_temporaries(path);
        recover_replaced(path)?;
        let identity = RunIdentity::read(path)?;
        Ok(RunDir {
            path: path.to_path_buf(),
            identity,
            replaced: std::cell::Cell::new(false),
            _lock: lock,
        })
    }

    /// The checkpoint to resume from ([`newest_checkpoint`]).
    pub fn newest_checkpoint(&self) -> anyhow::Result<Checkpoint> {
        newest_checkpoint(&self.path, &self.identity)
    }

    /// The new run has written a checkpoint (or ended): the run it replaced (`--overwrite`) is
    /// deleted now. Does nothing otherwise.
    pub fn keep_new_run(&self) -> anyhow::Result<()> {
        if self.replaced.get() {
            let old = self.path.join(REPLACED);
            std::fs::remove_dir_all(&old)
                .with_context(|| format!("{}: cannot remove the replaced run", old.display()))?;
            self.replaced.set(false);
        }
        Ok(())
    }
}

impl Drop for RunDir {
    /// A new run that failed before its first checkpoint gives the directory back to the run it
    /// replaced.
    fn drop(&mut self) {
        if self.replaced.get() {
            match restore_replaced(&self.path) {
                Ok(()) => eprintln!(
                    "note  the new run stopped before its first checkpoint: the previous run in {} was restored",
                    self.path.display()
                ),
                Err(e) => eprintln!(
                    "error: {}: the previous run could not be restored from {}: {e:#}",
                    self.path.display(),
                    REPLACED
                ),
            }
        }
    }
}

/// Checks that a fresh run (or an import) may be written into `path`: absent or empty, or,
/// with `overwrite`, holding a comera run and nothing else ([`check_replaceable`]). Returns the
/// entries the new run would replace. Nothing is changed: commands call it before long work
/// to fail early, and [`RunDir::create`] calls it again under the lock.
pub fn check_fresh_target(path: &Path, overwrite: bool) -> anyhow::Result<Vec<PathBuf>> {
    if !path.exists() {
        return Ok(Vec::new());
    }
    let entries = contents(path)?;
    if entries.is_empty() {
        return Ok(entries);
    }
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
    check_replaceable(path, &entries)?;
    Ok(entries)
}

/// A run directory given as a symlink is followed once and said so; a dangling or looping one
/// is an error naming it (not "File exists").
fn resolve_symlink(path: &Path) -> anyhow::Result<()> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if meta.file_type().is_symlink() {
        let target = std::fs::read_link(path).unwrap_or_default();
        match std::fs::canonicalize(path) {
            Ok(real) if real.is_dir() => eprintln!(
                "note  {} is a symbolic link: the run directory is {}",
                path.display(),
                real.display()
            ),
            Ok(real) => bail!(
                "{}: a symbolic link to {}, which is not a directory",
                path.display(),
                real.display()
            ),
            Err(e) => bail!(
                "{}: a symbolic link to {} that cannot be followed ({e}: dangling or looping); remove it or name another directory",
                path.display(),
                target.display()
            ),
        }
    } else if !meta.is_dir() {
        bail!(
            "{}: is {}, not a directory; a run directory is a directory",
            path.display(),
            comera_data::regular::file_kind(&meta)
        );
    }
    Ok(())
}

/// Refuses `--overwrite` of a directory that is not a comera run: its `run.toml` must verify
/// (parse, and name the sha256 of its `config.toml`) and every entry must be one a run writes.
/// The error lists what would have been deleted.
fn check_replaceable(path: &Path, entries: &[PathBuf]) -> anyhow::Result<()> {
    let names = |list: &[&PathBuf]| {
        list.iter()
            .map(|e| {
                e.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let all: Vec<&PathBuf> = entries.iter().collect();
    let verified = RunIdentity::read(path).and_then(|id| id.verified_config(path));
    if let Err(e) = verified {
        bail!(
            "{}: --overwrite refused: not a comera run ({e:#}); it would have deleted: {}; nothing was removed",
            path.display(),
            names(&all)
        );
    }
    let foreign: Vec<&PathBuf> = entries
        .iter()
        .filter(|e| {
            let name = e.file_name().unwrap_or_default().to_string_lossy();
            !RUN_FILES.contains(&name.as_ref())
        })
        .collect();
    if !foreign.is_empty() {
        bail!(
            "{}: --overwrite refused: besides its run, the directory holds files comera did not write ({}); move them away first; nothing was removed",
            path.display(),
            names(&foreign)
        );
    }
    Ok(())
}

/// Moves `entries` of the run directory into its [`REPLACED`] folder.
fn move_aside(path: &Path, entries: &[PathBuf]) -> anyhow::Result<()> {
    let old = path.join(REPLACED);
    std::fs::create_dir(&old).with_context(|| format!("{}: cannot create", old.display()))?;
    for e in entries {
        let to = old.join(e.file_name().unwrap_or_default());
        std::fs::rename(e, &to)
            .with_context(|| format!("{}: cannot move aside (--overwrite)", e.display()))?;
    }
    Ok(())
}

/// Removes what the new run wrote and moves the previous run back from [`REPLACED`].
fn restore_replaced(path: &Path) -> anyhow::Result<()> {
    let old = path.join(REPLACED);
    for e in contents(path)? {
        let r = if e.is_dir() && !e.is_symlink() {
            std::fs::remove_dir_all(&e)
        } else {
            std::fs::remove_file(&e)
        };
        r.with_context(|| format!("{}: cannot remove", e.display()))?;
    }
    for e in std::fs::read_dir(&old).with_context(|| format!("{}: cannot list", old.display()))? {
        let e = e?;
        std::fs::rename(e.path(), path.join(e.file_name()))
            .with_context(|| format!("{}: cannot move back", e.path().display()))?;
    }
    std::fs::remove_dir(&old).with_context(|| format!("{}: cannot remove", old.display()))
}

/// An `--overwrite` whose process died: if the new run wrote a checkpoint it stands (the old
/// one is deleted); otherwise the old run is restored.
fn recover_replaced(path: &Path) -> anyhow::Result<()> {
    let old = path.join(REPLACED);
    if !old.is_dir() {
        return Ok(());
    }
    if checkpoint::list(path).is_ok_and(|c| !c.is_empty()) {
        std::fs::remove_dir_all(&old)
            .with_context(|| format!("{}: cannot remove the replaced run", old.display()))
    } else {
        restore_replaced(path)?;
        eprintln!(
            "note  {}: an --overwrite was interrupted before the new run's first checkpoint; the previous run was restored",
            path.display()
        );
        Ok(())
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
    let text = own.verified_config(dir)?;
    if ck.config_toml != text {
        bail!(
            "{}: written with another config than {} (a checkpoint of another run?); refusing to resume from it",
            ck.path.display(),
            dir.join("config.toml").display()
        );
    }
    Ok(())
}

/// The entries of `dir` other than its lock and the run an `--overwrite` moved aside.
fn contents(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    Ok(std::fs::read_dir(dir)
        .with_context(|| format!("{}: cannot list", dir.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name() != LOCK && e.file_name() != REPLACED)
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
                let holder = comera_data::read_regular_to_string(&path).unwrap_or_default();
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
