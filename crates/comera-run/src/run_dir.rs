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
use crate::config::ConfigError;
use crate::error::{Chain, Error, IoContext, Result};
pub use crate::files::sha256_hex;
pub use crate::identity::{Extension, RunIdentity, IDENTITY};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The lock file of a run directory.
pub const LOCK: &str = ".lock";

/// A run directory that cannot be started, continued or replaced.
#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    #[error("{}: changed since the run started (its sha256 does not match the one in {IDENTITY}); restore it, or start a new run", .config.display())]
    ConfigChanged { config: PathBuf },
    #[error("{}: no such run directory", .0.display())]
    NoSuchDir(PathBuf),
    /// A fresh run's directory holds something and `--overwrite` was not given.
    #[error("{}: {what}; continue it with `comera train --resume {0}`, replace it with --overwrite, or choose another --out", .path.display())]
    Occupied { path: PathBuf, what: String },
    #[error("{}: a symbolic link to {}, which is not a directory", .path.display(), .target.display())]
    LinkToNonDirectory { path: PathBuf, target: PathBuf },
    #[error("{}: a symbolic link to {} that cannot be followed ({cause}: dangling or looping); remove it or name another directory", .path.display(), .target.display())]
    BrokenLink {
        path: PathBuf,
        target: PathBuf,
        cause: std::io::Error,
    },
    #[error("{}: is {kind}, not a directory; a run directory is a directory", .path.display())]
    NotADirectory { path: PathBuf, kind: String },
    /// `--overwrite` of a directory that is not a (verified) comera run.
    #[error("{}: --overwrite refused: not a comera run ({}); it would have deleted: {entries}; nothing was removed", .path.display(), Chain(.cause.as_ref()))]
    NotARun {
        path: PathBuf,
        cause: Box<Error>,
        entries: String,
    },
    #[error("{}: --overwrite refused: besides its run, the directory holds files comera did not write ({files}); move them away first; nothing was removed", .path.display())]
    ForeignFiles { path: PathBuf, files: String },
    #[error("{}: no checkpoint to resume from (expected {}/step-*.safetensors)", .0.display(), checkpoint::DIR)]
    NoCheckpoint(PathBuf),
    /// Every checkpoint failed to load: each with its error.
    #[error("{}: no checkpoint verifies:{}", .dir.display(), skipped_list(.skipped))]
    NoneVerifies {
        dir: PathBuf,
        skipped: Vec<(PathBuf, Error)>,
    },
    #[error("{}: written by run {ck_run}, but {} is run {own_run} ({}); refusing a checkpoint of another run", .checkpoint.display(), .dir.display(), .dir.join(IDENTITY).display())]
    OtherRun {
        checkpoint: PathBuf,
        ck_run: String,
        dir: PathBuf,
        own_run: String,
    },
    #[error("{}: written with another config than {} (a checkpoint of another run?); refusing to resume from it", .checkpoint.display(), .dir.join("config.toml").display())]
    OtherConfig { checkpoint: PathBuf, dir: PathBuf },
    #[error("{}: the run directory is in use by another comera process (pid {pid}); one writer at a time", .dir.display())]
    InUse { dir: PathBuf, pid: String },
}

/// `\n  PATH: ERROR` for each skipped checkpoint.
fn skipped_list(skipped: &[(PathBuf, Error)]) -> String {
    skipped
        .iter()
        .map(|(p, e)| format!("\n  {}: {}", p.display(), Chain(e)))
        .collect()
}

impl RunIdentity {
    /// The text of `dir/config.toml`, checked against the sha256 this identity names.
    pub fn verified_config(&self, dir: &Path) -> Result<String> {
        let config = dir.join("config.toml");
        let text = comera_data::read_regular_to_string(&config)
            .io(&config, "cannot read the run's config")?;
        let sha = sha256_hex(&text);
        // The config before the last extension, if that extension was killed before it wrote
        // `config.toml` (see `RunDir::extend`).
        let unextended = self
            .extensions
            .last()
            .is_some_and(|e| e.previous_config_sha256 == sha);
        if sha != self.config_sha256 && !unextended {
            return Err(RunDirError::ConfigChanged { config }.into());
        }
        Ok(text)
    }
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

/// The directory of the best model under early stopping.
pub const BEST_DIR: &str = "best";

/// The names a run directory may hold besides the ones listed here: what `train`, `import` and
/// early stopping write. `--overwrite` replaces a directory only if it holds nothing else.
pub const RUN_FILES: &[&str] = &[
    "config.toml",
    IDENTITY,
    "metrics.jsonl",
    checkpoint::DIR,
    crate::files::MODEL_WEIGHTS,
    crate::files::MODEL_META,
    crate::files::RUN_VOCAB,
    "curves.png",
    "ranks.png",
    "ranks.md",
    "report.json",
    BEST_DIR,
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
    pub fn create(path: &Path, config_toml: &str, overwrite: bool) -> Result<RunDir> {
        if path.as_os_str().is_empty() {
            return Err(ConfigError::new("train.out_dir", "empty; name the run directory").into());
        }
        resolve_symlink(path)?;
        std::fs::create_dir_all(path).io(path, "cannot create run directory")?;
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
            extensions: Vec::new(),
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
    pub fn open(path: &Path) -> Result<RunDir> {
        resolve_symlink(path)?;
        if !path.is_dir() {
            return Err(RunDirError::NoSuchDir(path.to_path_buf()).into());
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

    /// Extends the run: `config_toml` (the run's config with more epochs) becomes its config,
    /// and `run.toml` records the extension. `run.toml` is written first: a process killed
    /// between the two writes leaves the old `config.toml`, which still verifies
    /// ([`RunIdentity::verified_config`]) and resumes the run unextended.
    pub fn extend(&mut self, config_toml: &str, extension: Extension) -> Result<()> {
        let mut identity = self.identity.clone();
        identity.config_sha256 = sha256_hex(config_toml);
        identity.extensions.push(extension);
        crate::files::write_atomic(
            &self.path.join(IDENTITY),
            toml::to_string_pretty(&identity)?.as_bytes(),
        )?;
        crate::files::write_atomic(&self.path.join("config.toml"), config_toml.as_bytes())?;
        self.identity = identity;
        Ok(())
    }

    /// The checkpoint to resume from ([`newest_checkpoint`]).
    pub fn newest_checkpoint(&self) -> Result<Checkpoint> {
        newest_checkpoint(&self.path, &self.identity)
    }

    /// The new run has written a checkpoint (or ended): the run it replaced (`--overwrite`) is
    /// deleted now. Does nothing otherwise.
    pub fn keep_new_run(&self) -> Result<()> {
        if self.replaced.get() {
            let old = self.path.join(REPLACED);
            std::fs::remove_dir_all(&old).io(&old, "cannot remove the replaced run")?;
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
                    "error: {}: the previous run could not be restored from {}: {}",
                    self.path.display(),
                    REPLACED,
                    Chain(&e)
                ),
            }
        }
    }
}

/// Checks that a fresh run (or an import) may be written into `path`: absent or empty, or,
/// with `overwrite`, holding a comera run and nothing else ([`check_replaceable`]). Returns the
/// entries the new run would replace. Nothing is changed: commands call it before long work
/// to fail early, and [`RunDir::create`] calls it again under the lock.
pub fn check_fresh_target(path: &Path, overwrite: bool) -> Result<Vec<PathBuf>> {
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
        return Err(RunDirError::Occupied {
            path: path.to_path_buf(),
            what,
        }
        .into());
    }
    check_replaceable(path, &entries)?;
    Ok(entries)
}

/// A run directory given as a symlink is followed once and said so; a dangling or looping one
/// is an error naming it (not "File exists").
fn resolve_symlink(path: &Path) -> Result<()> {
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
            Ok(real) => {
                return Err(RunDirError::LinkToNonDirectory {
                    path: path.to_path_buf(),
                    target: real,
                }
                .into())
            }
            Err(cause) => {
                return Err(RunDirError::BrokenLink {
                    path: path.to_path_buf(),
                    target,
                    cause,
                }
                .into())
            }
        }
    } else if !meta.is_dir() {
        return Err(RunDirError::NotADirectory {
            path: path.to_path_buf(),
            kind: comera_data::regular::file_kind(&meta).to_string(),
        }
        .into());
    }
    Ok(())
}

/// Refuses `--overwrite` of a directory that is not a comera run: its `run.toml` must verify
/// (parse, and name the sha256 of its `config.toml`) and every entry must be one a run writes.
/// The error lists what would have been deleted.
fn check_replaceable(path: &Path, entries: &[PathBuf]) -> Result<()> {
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
        return Err(RunDirError::NotARun {
            path: path.to_path_buf(),
            cause: Box::new(e),
            entries: names(&all),
        }
        .into());
    }
    let foreign: Vec<&PathBuf> = entries
        .iter()
        .filter(|e| {
            let name = e.file_name().unwrap_or_default().to_string_lossy();
            !RUN_FILES.contains(&name.as_ref())
        })
        .collect();
    if !foreign.is_empty() {
        return Err(RunDirError::ForeignFiles {
            path: path.to_path_buf(),
            files: names(&foreign),
        }
        .into());
    }
    Ok(())
}

/// Moves `entries` of the run directory into its [`REPLACED`] folder.
fn move_aside(path: &Path, entries: &[PathBuf]) -> Result<()> {
    let old = path.join(REPLACED);
    std::fs::create_dir(&old).io(&old, "cannot create")?;
    for e in entries {
        let to = old.join(e.file_name().unwrap_or_default());
        std::fs::rename(e, &to).io(e, "cannot move aside (--overwrite)")?;
    }
    Ok(())
}

/// Removes what the new run wrote and moves the previous run back from [`REPLACED`].
fn restore_replaced(path: &Path) -> Result<()> {
    let old = path.join(REPLACED);
    for e in contents(path)? {
        let r = if e.is_dir() && !e.is_symlink() {
            std::fs::remove_dir_all(&e)
        } else {
            std::fs::remove_file(&e)
        };
        r.io(&e, "cannot remove")?;
    }
    for e in std::fs::read_dir(&old).io(&old, "cannot list")? {
        let e = e.io(&old, "cannot list")?;
        std::fs::rename(e.path(), path.join(e.file_name())).io(&e.path(), "cannot move back")?;
    }
    std::fs::remove_dir(&old).io(&old, "cannot remove")
}

/// An `--overwrite` whose process died: if the new run wrote a checkpoint it stands (the old
/// one is deleted); otherwise the old run is restored.
fn recover_replaced(path: &Path) -> Result<()> {
    let old = path.join(REPLACED);
    if !old.is_dir() {
        return Ok(());
    }
    if checkpoint::list(path).is_ok_and(|c| !c.is_empty()) {
        std::fs::remove_dir_all(&old).io(&old, "cannot remove the replaced run")
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
pub fn newest_checkpoint(dir: &Path, own: &RunIdentity) -> Result<Checkpoint> {
    let candidates = checkpoint::list(dir)?;
    if candidates.is_empty() {
        return Err(RunDirError::NoCheckpoint(dir.to_path_buf()).into());
    }
    let mut skipped = Vec::new();
    for path in candidates.iter().rev() {
        match Checkpoint::load(path) {
            Ok(ck) => {
                check_owner(dir, own, &ck)?;
                return Ok(ck);
            }
            Err(e) => {
                eprintln!("skip  {}: {}", path.display(), Chain(&e));
                skipped.push((path.clone(), e));
            }
        }
    }
    Err(RunDirError::NoneVerifies {
        dir: dir.to_path_buf(),
        skipped,
    }
    .into())
}

/// Refuses a checkpoint written by another run than the one of `dir`.
fn check_owner(dir: &Path, own: &RunIdentity, ck: &Checkpoint) -> Result<()> {
    if ck.run_id != own.id {
        return Err(RunDirError::OtherRun {
            checkpoint: ck.path.clone(),
            ck_run: ck.run_id.clone(),
            dir: dir.to_path_buf(),
            own_run: own.id.clone(),
        }
        .into());
    }
    let text = own.verified_config(dir)?;
    // A checkpoint from before an extension holds the config it was written with.
    let earlier = own
        .extensions
        .iter()
        .any(|e| e.previous_config_sha256 == sha256_hex(&ck.config_toml));
    if ck.config_toml != text && !earlier {
        return Err(RunDirError::OtherConfig {
            checkpoint: ck.path.clone(),
            dir: dir.to_path_buf(),
        }
        .into());
    }
    Ok(())
}

/// The entries of `dir` other than its lock and the run an `--overwrite` moved aside.
fn contents(dir: &Path) -> Result<Vec<PathBuf>> {
    Ok(std::fs::read_dir(dir)
        .io(dir, "cannot list")?
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
    pub fn acquire(dir: &Path) -> Result<RunLock> {
        let path = dir.join(LOCK);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .io(&path, "cannot open the run's lock")?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let holder = comera_data::read_regular_to_string(&path).unwrap_or_default();
                return Err(RunDirError::InUse {
                    dir: dir.to_path_buf(),
                    pid: holder.trim().to_string(),
                }
                .into());
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(Error::io(&path, "cannot lock", e)),
        }
        file.set_len(0)
            .and_then(|_| write!(file, "{}", std::process::id()))
            .io(&path, "cannot write")?;
        Ok(RunLock { _file: file })
    }
}
