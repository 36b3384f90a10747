//! The one training loop over any [`Task`], and its entry points: [`train`] (an encoder run:
//! classification or masked LM), [`train_dlrm`] (a DLRM run) and [`resume`] (either, from the
//! newest checkpoint of a run directory).
//!
//! A run goes through three files, in order:
//!
//! - [`setup`](self::setup): from a config to a [`Setup`]: the data prepared, the model built
//!   (or initialised from another run), memory checked, and only then the run directory opened
//!   (so a failing setup never touches a previous run under `--overwrite`);
//! - [`run`](self::run): the loop itself, read top to bottom: phases of fixed-shape steps, each
//!   step [`Stepper::step`](comera_optim::Stepper), the rank schedule's events, logging
//!   windows, evaluations (early stopping), checkpoints, stops;
//! - [`report`](self::report): what the loop tells the world: records to `metrics.jsonl` and
//!   to the observers ([`crate::observe`]), plots, `ranks.md`.
//!
//! The loop never prints: lines meant for people are [`Event::Message`]s, shown by an observer
//! such as [`crate::console::Console`].

mod report;
mod run;
#[cfg(test)]
mod seam_tests;
mod setup;

use crate::checkpoint::Checkpoint;
use crate::config::{AnyRunConfig, ConfigError, DlrmRunConfig, LoopFields, RunConfig};
use crate::observe::Observer;
use crate::run_dir::RunDir;
use crate::task::Task;
use comera_optim::rank::RankConfig;
use comera_optim::{AdamWConfig, GaLoreConfig};
use report::Reporter;
use std::path::Path;

use comera_run::records::{median, Machine, TrainSummary};
pub use comera_run::run_dir::BEST_DIR;

/// Peak resident set size of this process (`VmHWM` in /proc/self/status), bytes.
pub fn peak_rss_bytes() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Memory this machine can still give (`MemAvailable` in /proc/meminfo), bytes; unbounded
/// where it cannot be read.
pub fn available_memory_bytes() -> f64 {
    let kib = |file: &str, key: &str| {
        std::fs::read_to_string(file).ok().and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
    };
    let free = kib("/proc/meminfo", "MemAvailable:").map_or(f64::INFINITY, |k| k * 1024.0);
    // Under an address-space limit (`ulimit -v`), what is left of it bounds the allocation
    // too: past it an allocation fails (an abort) however much memory the machine has.
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the limit into the struct it is given.
    let limited = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } == 0
        && lim.rlim_cur != libc::RLIM_INFINITY;
    if !limited {
        return free;
    }
    let used = kib("/proc/self/status", "VmSize:").map_or(0.0, |k| k * 1024.0);
    free.min((lim.rlim_cur as f64 - used).max(0.0))
}

/// The loop's settings, the same for every kind of run: the `[train]` fields they share, and
/// the resolved run config saved in every checkpoint.
pub struct LoopSettings {
    pub train: LoopFields,
    pub config_toml: String,
}

impl LoopSettings {
    /// The one way to make them: from a `[train]` table of either kind of run.
    pub fn new(train: LoopFields, config_toml: String) -> LoopSettings {
        LoopSettings {
            train: LoopFields {
                accumulate_steps: train.accumulate_steps.max(1),
                ..train
            },
            config_toml,
        }
    }
}

/// A run ready to start (or to continue from a checkpoint): its task, and the rest.
struct Setup<T: Task> {
    task: T,
    run: RunSetup<T::Model>,
}

/// A run's model and settings, ready for the loop.
struct RunSetup<M: comera_layers::Trainable> {
    model: M,
    /// The optimiser's settings (it is made once the model has its final shape: a resumed
    /// model takes the checkpoint's truncated ranks first).
    optim: AdamWConfig,
    galore: Option<GaLoreConfig>,
    rank_cfg: RankConfig,
    clip_norm: f32,
    gate_threshold: f32,
    settings: LoopSettings,
    resume: Option<Checkpoint>,
    /// The run directory, locked until the run ends (None on the processes of a data-parallel
    /// run other than process 0, which do not write).
    run_dir: Option<RunDir>,
    /// The step engine on `train.device` (None: the CPU's, the stepper over the model).
    device: Option<Box<dyn crate::device::DeviceStep<M>>>,
}

/// How a run starts.
#[derive(Default)]
pub struct RunOptions {
    /// Clear a run directory that holds a previous run instead of refusing it.
    pub overwrite: bool,
    /// Receive the run's events ([`crate::observe`]); any may stop the run. Nothing is
    /// printed unless one of them prints (the CLI adds [`crate::console::Console`]).
    pub observers: Vec<Box<dyn Observer>>,
}

/// Runs a whole encoder training job as configured; writes into `cfg.train.out_dir`.
///
/// The job runs on a worker of the rayon pool, so parallel work inside a step is scheduled
/// through the workers' own queues (no per-call injection, no allocation in the step).
pub fn train(cfg: &RunConfig, opts: RunOptions) -> crate::Result<TrainSummary> {
    let mut rep = Reporter::new(opts.observers);
    rayon::scope(|_| {
        let setup = setup::encoder(cfg, Start::Fresh(opts.overwrite), &mut rep)?;
        run::run(setup, rep)
    })
}

/// Runs a whole DLRM training job as configured; writes into `cfg.train.out_dir`.
pub fn train_dlrm(cfg: &DlrmRunConfig, opts: RunOptions) -> crate::Result<TrainSummary> {
    let mut rep = Reporter::new(opts.observers);
    rayon::scope(|_| {
        let setup = setup::dlrm(cfg, Start::Fresh(opts.overwrite), &mut rep)?;
        run::run(setup, rep)
    })
}

/// Continues the run in `run_dir` from its newest checkpoint that verifies. With the same
/// thread count, the losses are bit for bit those of a run that was never stopped.
pub fn resume(run_dir: &Path) -> crate::Result<TrainSummary> {
    resume_with(run_dir, RunOptions::default())
}

/// [`resume`] with observers (`opts.overwrite` does not apply to a resumed run).
pub fn resume_with(run_dir: &Path, opts: RunOptions) -> crate::Result<TrainSummary> {
    continue_run(run_dir, Continue::default(), opts)
}

/// How [`continue_run`] continues a run.
#[derive(Clone, Copy, Debug, Default)]
pub struct Continue {
    /// Extend the run by this many epochs first ([`extend_with`]).
    pub extend_epochs: Option<usize>,
    /// Stop again (with a checkpoint) once the run has done this many steps in all; `None`:
    /// run to the end.
    pub stop_after_steps: Option<u64>,
    /// Go on on this device (`None`: the run config's `train.device`); the run's config.toml
    /// keeps what it was started with.
    pub device: Option<comera_cuda::DeviceSpec>,
}

/// Extends the run in `run_dir` by `epochs` epochs (added to `train.epochs`, or to the last of
/// its `[[train.phases]]`) and continues it from its newest checkpoint: a finished run trains
/// on, a stopped one runs to its new end. The run's `config.toml` becomes the extended config
/// and `run.toml` records the extension, so the run stays resumable; its learning-rate
/// schedule is stretched over the new length (a linear or cosine decay rises again from
/// where it ended). Stopped and resumed, the extended run is bit for bit the run extended in
/// one go.
pub fn extend_with(run_dir: &Path, epochs: usize, opts: RunOptions) -> crate::Result<TrainSummary> {
    let how = Continue {
        extend_epochs: Some(epochs),
        ..Continue::default()
    };
    continue_run(run_dir, how, opts)
}

/// Resumes the run in `run_dir` ([`resume_with`]), extended first and stopped again as `how`
/// says.
pub fn continue_run(
    run_dir: &Path,
    how: Continue,
    opts: RunOptions,
) -> crate::Result<TrainSummary> {
    if how.extend_epochs == Some(0) {
        return Err(ConfigError::new("--extend-epochs", "expected at least 1 epoch").into());
    }
    if how.extend_epochs.is_some() && crate::distributed::processes().1 > 1 {
        return Err(ConfigError::new(
            "--extend-epochs",
            "extend the run in one process (without mpirun), then resume it data-parallel",
        )
        .into());
    }
    let mut rep = Reporter::new(opts.observers);
    // Process 0 locks the directory; the others of a data-parallel run only read it.
    let (mut dir, ck, identity) = if crate::distributed::is_writer() {
        let dir = RunDir::open(run_dir)?;
        let ck = dir.newest_checkpoint()?;
        let identity = dir.identity.clone();
        (Some(dir), ck, identity)
    } else {
        let identity = crate::run_dir::RunIdentity::read(run_dir)?;
        let ck = crate::run_dir::newest_checkpoint(run_dir, &identity)?;
        (None, ck, identity)
    };
    // The run's config (a checkpoint from before an extension holds an older one).
    let config_path = run_dir.join("config.toml");
    let mut config_toml = identity.verified_config(run_dir)?;
    let mut cfg = AnyRunConfig::from_toml(&config_path, &config_toml)?;
    if let (Some(added), Some(dir)) = (how.extend_epochs, dir.as_mut()) {
        let from = cfg.epochs();
        cfg.add_epochs(added)?;
        let previous_config_sha256 = crate::run_dir::sha256_hex(&config_toml);
        config_toml = cfg.to_toml();
        dir.extend(
            &config_toml,
            crate::run_dir::Extension {
                at_step: ck.progress.step,
                from_epochs: from,
                to_epochs: cfg.epochs(),
                previous_config_sha256,
            },
        )?;
        rep.say(format!(
            "extend {}: {from} → {} epochs (config.toml and run.toml updated)",
            run_dir.display(),
            cfg.epochs()
        ));
    }
    *cfg.out_dir_mut() = run_dir.to_path_buf();
    // A resumed run runs to the configured end (the stop is what interrupted it), or to the
    // stop asked for now.
    *cfg.stop_after_steps_mut() = how.stop_after_steps.unwrap_or(0);
    if let Some(device) = how.device {
        cfg.set_device(device)?;
    }
    rep.say(format!(
        "resume {} (step {})",
        ck.path.display(),
        ck.progress.step
    ));
    let start = Start::Resume(Box::new(ck), dir, config_toml);
    rayon::scope(|_| match &cfg {
        AnyRunConfig::Encoder(c) => run::run(setup::encoder(c, start, &mut rep)?, rep),
        AnyRunConfig::Dlrm(c) => run::run(setup::dlrm(c, start, &mut rep)?, rep),
    })
}

/// How a run starts: fresh (with `--overwrite` or not), or from a checkpoint of its (locked)
/// directory, with the run's config text.
enum Start {
    Fresh(bool),
    Resume(Box<Checkpoint>, Option<RunDir>, String),
}

impl Start {
    /// The run directory, locked, and the checkpoint to resume from: a fresh run creates the
    /// directory with `config_toml`; a resumed one keeps its own.
    fn open(
        self,
        out: &Path,
        config_toml: &str,
    ) -> crate::Result<(Option<RunDir>, Option<Checkpoint>)> {
        match self {
            Start::Fresh(overwrite) => {
                let dir = crate::distributed::is_writer()
                    .then(|| RunDir::create(out, config_toml, overwrite))
                    .transpose()?;
                Ok((dir, None))
            }
            Start::Resume(ck, dir, _) => Ok((dir, Some(*ck))),
        }
    }

    /// A resumed run's config text (what its checkpoints record from now on).
    fn config_toml(&self) -> Option<&str> {
        match self {
            Start::Fresh(_) => None,
            Start::Resume(_, _, text) => Some(text),
        }
    }

    fn checkpoint(&self) -> Option<&Checkpoint> {
        match self {
            Start::Fresh(_) => None,
            Start::Resume(ck, _, _) => Some(ck),
        }
    }
}
