//! The one training loop ([`run`]) over any [`Task`]: phases of fixed-shape steps, each step
//! [`Stepper::step`]; the rank schedule's stage switch and truncation; evaluation, model files
//! and a checkpoint after every epoch (and every `checkpoint_every` steps); exact resume; the
//! metrics log, progress, plots, `ranks.md` and `report.json`.
//!
//! Entry points: [`train`] (an encoder run: classification or masked LM), [`train_dlrm`] (a
//! DLRM run) and [`resume`] (either, from the newest checkpoint of a run directory).

use crate::checkpoint::{self, Checkpoint, Progress};
use crate::config::{AnyRunConfig, DlrmRunConfig, EarlyStopping, Phase, RunConfig};
use crate::data::{prepare, CorpusData, PreparedData};
use crate::files::{DlrmMeta, MetricsLog};
use crate::observe::{
    Control, EarlyStopRecord, EvalRecord, Event, Observer, RanksRecord, Record, StageRecord,
    TrainRecord, TruncateRecord,
};
use crate::plot::{plot_panels, Panel, Series};
use crate::run_dir::RunDir;
use crate::task::{CtrTask, EncoderData, EncoderTask, EpochBatches, EvalStats, Task};
use anyhow::{bail, Context};
use comera_dlrm::Dlrm;
use comera_layers::{Model, Trainable};
use comera_model::Encoder;
use comera_optim::rank::{self, Branch, LayerRanks, RankConfig, RankController, Stage};
use comera_optim::{AdamWConfig, Decay, GaLoreConfig, Optimizer, Schedule, Stepper};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What a finished (or stopped) run reports; also written to `report.json`.
#[derive(Clone, Debug, Serialize)]
pub struct TrainSummary {
    pub out_dir: PathBuf,
    pub epochs: usize,
    pub steps: u64,
    /// Examples per step in the last phase.
    pub batch_size: usize,
    /// Sequence positions (or examples, for tabular data) trained on.
    pub tokens: u64,
    /// The last evaluation (for a masked-LM run: held-out MLM loss and masked-token accuracy).
    pub final_valid: EvalStats,
    /// The best validation AUC (binary tasks) or accuracy over the epochs, and its epoch.
    pub best_valid: f64,
    pub best_epoch: usize,
    /// Share of the most frequent label (classification runs).
    pub majority_accuracy: Option<f64>,
    /// Trainable parameters at the end (after truncations) and at the start.
    pub params: usize,
    pub initial_params: usize,
    pub dense_params: usize,
    pub seconds: f64,
    /// Median wall time of the steps of this process (ms) and the examples/s it gives.
    pub median_step_ms: f64,
    pub examples_per_s: f64,
    /// Peak resident set of the process (VmHWM), bytes; 0 where /proc is unavailable.
    pub peak_rss_bytes: u64,
    /// The engine's own accounting: parameters + gradients, optimiser state, batch state.
    pub param_bytes: usize,
    pub optimizer_bytes: usize,
    pub state_bytes: usize,
    /// Per-layer ranks of the TT/TTM layers at the start, at the switch to the late stage (if
    /// any) and at the end.
    pub ranks_start: Vec<LayerRanks>,
    pub ranks_switch: Option<Vec<LayerRanks>>,
    pub ranks_end: Vec<LayerRanks>,
    /// Whether the rank schedule was active, and its stage at the end.
    pub rank_active: bool,
    pub rank_stage: String,
    /// Whether the run stopped early at `train.stop_after_steps` or on a signal (resumable).
    pub stopped: bool,
    /// The signal (SIGINT, SIGTERM) that stopped the run after a step, with a checkpoint
    /// ([`crate::interrupt`]).
    pub interrupted: Option<i32>,
    /// Whether early stopping ended the run (the best model is in `best/`).
    #[serde(default)]
    pub early_stopped: bool,
    /// Task-specific figures (a DLRM's table sizes).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl TrainSummary {
    pub fn compression(&self) -> f64 {
        self.dense_params as f64 / self.params as f64
    }
}

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

/// Refuses an encoder config whose training memory in some phase (estimated before anything
/// is allocated, even the data) exceeds what the machine has; warns of ranks no layer can use.
fn check_encoder_fits(cfg: &RunConfig, phases: &[Phase]) -> anyhow::Result<()> {
    let lay = cfg.model.validate()?;
    let available = available_memory_bytes();
    for p in phases {
        cfg.model
            .estimate_memory(&lay, p.batch_size, p.seq_len)
            .check(
                available,
                &format!("training at batch {} × {} tokens", p.batch_size, p.seq_len),
            )?;
    }
    for w in &lay.warnings {
        eprintln!("warning: {w}");
    }
    Ok(())
}

/// The median of `v` (0 when empty).
fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// The loop's settings, from either kind of run config.
pub struct LoopSettings {
    pub out: PathBuf,
    /// The resolved run config (TOML), saved in every checkpoint.
    pub config_toml: String,
    pub warmup_steps: u64,
    pub decay: Decay,
    pub log_every: usize,
    pub checkpoint_every: u64,
    pub keep_checkpoints: usize,
    pub stop_after_steps: u64,
    /// Evaluate every this many steps too (0: epoch ends only).
    pub eval_every: u64,
    /// Micro-batches per step (gradient accumulation; 1: none).
    pub accumulate_steps: usize,
    pub early_stopping: Option<EarlyStopping>,
    pub progress: bool,
}

/// A run ready to start (or to continue from a checkpoint).
struct Setup<T: Task> {
    task: T,
    model: T::Model,
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
}

/// How a run starts.
#[derive(Default)]
pub struct RunOptions {
    /// Show a progress bar (on a terminal).
    pub progress: bool,
    /// Clear a run directory that holds a previous run instead of refusing it.
    pub overwrite: bool,
    /// Receive the run's events ([`crate::observe`]); any may stop the run.
    pub observers: Vec<Box<dyn Observer>>,
}

/// Runs a whole encoder training job as configured; writes into `cfg.train.out_dir`.
///
/// The job runs on a worker of the rayon pool, so parallel work inside a step is scheduled
/// through the workers' own queues (no per-call injection, no allocation in the step).
pub fn train(cfg: &RunConfig, opts: RunOptions) -> anyhow::Result<TrainSummary> {
    rayon::scope(|_| {
        let setup = setup_encoder(cfg, Start::Fresh(opts.overwrite), opts.progress)?;
        run(setup, opts.observers)
    })
}

/// Runs a whole DLRM training job as configured; writes into `cfg.train.out_dir`.
pub fn train_dlrm(cfg: &DlrmRunConfig, opts: RunOptions) -> anyhow::Result<TrainSummary> {
    rayon::scope(|_| {
        let setup = setup_dlrm(cfg, Start::Fresh(opts.overwrite), opts.progress)?;
        run(setup, opts.observers)
    })
}

/// Continues the run in `run_dir` from its newest checkpoint that verifies. With the same
/// thread count, the losses are bit for bit those of a run that was never stopped.
pub fn resume(run_dir: &Path, progress: bool) -> anyhow::Result<TrainSummary> {
    resume_with(
        run_dir,
        RunOptions {
            progress,
            ..RunOptions::default()
        },
    )
}

/// [`resume`] with observers (`opts.overwrite` does not apply to a resumed run).
pub fn resume_with(run_dir: &Path, opts: RunOptions) -> anyhow::Result<TrainSummary> {
    let progress = opts.progress;
    // Process 0 locks the directory; the others of a data-parallel run only read it.
    let (dir, ck) = if crate::distributed::is_writer() {
        let dir = RunDir::open(run_dir)?;
        let ck = dir.newest_checkpoint()?;
        (Some(dir), ck)
    } else {
        let identity = crate::run_dir::RunIdentity::read(run_dir)?;
        (None, crate::run_dir::newest_checkpoint(run_dir, &identity)?)
    };
    let mut cfg = ck.config()?;
    *cfg.out_dir_mut() = run_dir.to_path_buf();
    // A resumed run runs to the configured end (the stop is what interrupted it).
    *cfg.stop_after_steps_mut() = 0;
    eprintln!("resume {} (step {})", ck.path.display(), ck.progress.step);
    let start = Start::Resume(Box::new(ck), dir);
    rayon::scope(|_| match &cfg {
        AnyRunConfig::Encoder(c) => run(setup_encoder(c, start, progress)?, opts.observers),
        AnyRunConfig::Dlrm(c) => run(setup_dlrm(c, start, progress)?, opts.observers),
    })
}

/// How a run starts: fresh (with `--overwrite` or not), or from a checkpoint of its (locked)
/// directory.
enum Start {
    Fresh(bool),
    Resume(Box<Checkpoint>, Option<RunDir>),
}

impl Start {
    /// The run directory, locked, and the checkpoint to resume from: a fresh run creates the
    /// directory with `config_toml`; a resumed one keeps its own.
    fn open(
        self,
        out: &Path,
        config_toml: &str,
    ) -> anyhow::Result<(Option<RunDir>, Option<Checkpoint>)> {
        match self {
            Start::Fresh(overwrite) => {
                let dir = crate::distributed::is_writer()
                    .then(|| RunDir::create(out, config_toml, overwrite))
                    .transpose()?;
                Ok((dir, None))
            }
            Start::Resume(ck, dir) => Ok((dir, Some(*ck))),
        }
    }

    fn checkpoint(&self) -> Option<&Checkpoint> {
        match self {
            Start::Fresh(_) => None,
            Start::Resume(ck, _) => Some(ck),
        }
    }
}

fn setup_encoder(
    cfg: &RunConfig,
    start: Start,
    progress: bool,
) -> anyhow::Result<Setup<EncoderTask>> {
    let phases = cfg.phases();
    check_encoder_fits(cfg, &phases)?;
    let data = if cfg.data.source == "corpus" {
        let mut corpus = CorpusData::new(&cfg.data, cfg.train.seed)?;
        // Every phase's blocks in one pass over the corpus (or from the cache).
        let seq_lens: Vec<usize> = phases.iter().map(|p| p.seq_len).collect();
        corpus.pack(&seq_lens)?;
        EncoderData::Mlm(corpus)
    } else {
        if let Some(p) = phases.iter().find(|p| p.seq_len != cfg.model.seq_len) {
            bail!(
                "train.phases: seq_len {} differs from model.seq_len {}; only corpus (masked-LM) runs change the sequence length",
                p.seq_len,
                cfg.model.seq_len
            );
        }
        let d: PreparedData = prepare(&cfg.data, cfg.model.seq_len, cfg.train.seed)?;
        eprintln!("data  {}", d.summary);
        EncoderData::Classify(d)
    };
    let (vocab_size, vocab) = match &data {
        EncoderData::Classify(d) => (d.tokenizer.vocab_size(), d.vocab.clone()),
        EncoderData::Mlm(d) => (d.tokenizer.vocab_size(), d.vocab.clone()),
    };
    let mut mcfg = cfg.model.clone();
    if mcfg.vocab_size != vocab_size {
        bail!(
            "model.vocab_size: {} but the vocabulary {} has {vocab_size} tokens",
            mcfg.vocab_size,
            vocab.display(),
        );
    }
    if let EncoderData::Classify(d) = &data {
        mcfg.num_labels = d.label_names.len();
    }
    let mut resolved = cfg.clone();
    resolved.model = mcfg.clone();
    // A resumed run keeps writing the config it was created with.
    let config_toml = match start.checkpoint() {
        Some(ck) => ck.config_toml.clone(),
        None => resolved.to_toml(),
    };
    if let Some(ck) = start.checkpoint() {
        match ck.config()? {
            AnyRunConfig::Encoder(c) if c.model == mcfg => {}
            _ => bail!(
                "{}: the checkpoint's [model] differs from what its run's data gives now (labels or vocabulary changed?)",
                ck.path.display()
            ),
        }
    }
    let out = cfg.train.out_dir.clone();
    // Everything that can fail is done before the run directory is opened (which, under
    // --overwrite, moves the previous run aside).
    let mut model = Encoder::new(&mcfg, cfg.train.seed).map_err(|e| anyhow::anyhow!("{e}"))?;
    if let (None, Some(dir)) = (start.checkpoint(), &cfg.train.init_from) {
        let (pre, _) = crate::files::load_model(dir)
            .with_context(|| format!("train.init_from: {}", dir.display()))?;
        model
            .init_body_from(&pre)
            .map_err(|e| anyhow::anyhow!("train.init_from: {}: {e}", dir.display()))?;
        eprintln!(
            "init  encoder from {} ({} parameters)",
            dir.display(),
            pre.num_params()
        );
    }
    eprintln!(
        "model {} layers, d_model {}: {}",
        mcfg.layers,
        mcfg.d_model,
        mcfg.validate()?.describe()
    );
    if cfg.galore.is_some() && cfg.rank.enabled {
        eprintln!("note  GaLore run: rank gates are trained, but pruned slices are not truncated");
    }
    let (run_dir, resume) = start.open(&out, &config_toml)?;
    let t = &cfg.train;
    Ok(Setup {
        task: EncoderTask {
            data,
            phases,
            model_cfg: mcfg.clone(),
            vocab,
            seed: t.seed,
            procs: std::cell::RefCell::new(crate::distributed::Processes::world()),
        },
        model,
        optim: cfg.optim.clone(),
        galore: cfg.galore.clone(),
        rank_cfg: cfg.rank.clone(),
        clip_norm: cfg.optim.clip_norm,
        gate_threshold: mcfg.threshold,
        settings: LoopSettings {
            out,
            config_toml,
            warmup_steps: t.warmup_steps,
            decay: t.decay,
            log_every: t.log_every,
            checkpoint_every: t.checkpoint_every,
            keep_checkpoints: t.keep_checkpoints,
            stop_after_steps: t.stop_after_steps,
            eval_every: t.eval_every,
            accumulate_steps: t.accumulate_steps,
            early_stopping: t.early_stopping.clone(),
            progress,
        },
        resume,
        run_dir,
    })
}

fn setup_dlrm(cfg: &DlrmRunConfig, start: Start, progress: bool) -> anyhow::Result<Setup<CtrTask>> {
    let prepared = comera_dlrm::data::prepare(&cfg.data, cfg.train.seed)?;
    if prepared.valid.is_empty() {
        bail!(
            "data: no validation examples (data.valid_fraction = {}, data.max_valid = {}); the run could not be evaluated",
            cfg.data.valid_fraction,
            cfg.data.max_valid
        );
    }
    eprintln!("data  {}", prepared.summary);
    let config_toml = match start.checkpoint() {
        Some(ck) => ck.config_toml.clone(),
        None => cfg.to_toml(),
    };
    let t = &cfg.train;
    let need =
        cfg.dlrm
            .estimate_memory_bytes(prepared.n_dense, &prepared.table_sizes, t.batch_size);
    let available = available_memory_bytes();
    if need > available {
        const GIB: f64 = (1u64 << 30) as f64;
        bail!(
            "training the DLRM at batch {} needs about {:.1} GiB, but {:.1} GiB are available; reduce dlrm.embedding_dim, dlrm.ttm_rank, the MLP widths or train.batch_size",
            t.batch_size,
            need / GIB,
            available / GIB
        );
    }
    let (run_dir, resume) = start.open(&t.out_dir, &config_toml)?;
    let model = Dlrm::new(
        &cfg.dlrm,
        prepared.n_dense,
        &prepared.field_names,
        &prepared.table_sizes,
        t.seed,
    )
    .map_err(|e| anyhow::anyhow!("dlrm: {e}"))?;
    eprintln!(
        "model DLRM, dim {}, bottom {:?}, top {:?}: {} parameters; tables {} parameters ({} as dense tables, {:.1}x smaller)",
        cfg.dlrm.embedding_dim,
        cfg.dlrm.bottom_mlp,
        cfg.dlrm.top_mlp,
        model.num_params(),
        model.table_params(),
        model.dense_table_params(),
        model.dense_table_params() as f64 / model.table_params() as f64
    );
    for (name, table) in prepared.field_names.iter().zip(&model.tables) {
        eprintln!("      {name}: {}", table.describe());
    }
    let meta = DlrmMeta {
        run_id: None,
        weights_sha256: None,
        meta_sha256: None,
        kind: "dlrm".into(),
        model: cfg.dlrm.clone(),
        n_dense: prepared.n_dense,
        field_names: prepared.field_names.clone(),
        table_sizes: prepared.table_sizes.clone(),
        tables: Vec::new(),
        epoch: 0,
        step: 0,
    };
    Ok(Setup {
        task: CtrTask {
            train: std::cell::RefCell::new(prepared.train),
            valid: prepared.valid,
            phases: vec![Phase {
                seq_len: 1,
                batch_size: t.batch_size,
                epochs: t.epochs,
                max_steps_per_epoch: Some(t.max_steps_per_epoch),
            }],
            meta,
            seed: t.seed,
            save_model: t.save_model,
            procs: std::cell::RefCell::new(crate::distributed::Processes::world()),
        },
        model,
        optim: cfg.optim.clone(),
        galore: None,
        rank_cfg: cfg.rank.clone().unwrap_or(RankConfig {
            enabled: false,
            ..RankConfig::default()
        }),
        clip_norm: cfg.optim.clip_norm,
        gate_threshold: cfg.dlrm.gate_threshold,
        settings: LoopSettings {
            out: t.out_dir.clone(),
            config_toml,
            warmup_steps: t.warmup_steps,
            decay: t.decay,
            log_every: t.log_every,
            checkpoint_every: t.checkpoint_every,
            keep_checkpoints: t.keep_checkpoints,
            stop_after_steps: t.stop_after_steps,
            eval_every: t.eval_every,
            accumulate_steps: t.accumulate_steps,
            early_stopping: t.early_stopping.clone(),
            progress,
        },
        resume,
        run_dir,
    })
}

/// Curves for the plots, built from the metrics log's records (so a resumed run plots its
/// whole history).
#[derive(Default)]
struct Curves {
    train_loss: Vec<(f64, f64)>,
    valid_loss: Vec<(f64, f64)>,
    train_acc: Vec<(f64, f64)>,
    valid_acc: Vec<(f64, f64)>,
    /// Validation AUC of a binary task (empty otherwise).
    valid_auc: Vec<(f64, f64)>,
    /// Compression of the whole model over steps.
    model_ratio: Vec<(f64, f64)>,
    /// Per layer: mean active rank over its bonds, over steps.
    ranks: Vec<(String, Vec<(f64, f64)>)>,
    /// The step at which the rank schedule switched to its late stage.
    late_from: Option<f64>,
}

impl Curves {
    /// Takes in one metrics record.
    fn add(&mut self, r: &Record) {
        match r {
            Record::Train(t) => {
                let step = t.step as f64;
                self.train_loss.push((step, t.loss));
                self.train_acc.push((step, t.accuracy));
                self.model_ratio.push((step, t.compression));
                for (name, &v) in t.mean_ranks.iter().flatten() {
                    match self.ranks.iter_mut().find(|(n, _)| n == name) {
                        Some((_, pts)) => pts.push((step, v)),
                        None => self.ranks.push((name.clone(), vec![(step, v)])),
                    }
                }
            }
            Record::Stage(st) => self.late_from = Some(st.step as f64),
            Record::Eval(e) => {
                let step = e.step as f64;
                self.valid_loss.push((step, e.valid_loss));
                self.valid_acc.push((step, e.valid_accuracy));
                if let Some(a) = e.valid_auc {
                    self.valid_auc.push((step, a));
                }
            }
            _ => {}
        }
    }

    /// Rank evolution, compression and loss over steps.
    fn plot_ranks(&self, path: &Path, loss_name: &str) -> anyhow::Result<()> {
        let s = |name: &str, pts: &Vec<(f64, f64)>| Series {
            name: name.into(),
            points: pts.clone(),
        };
        let marks: Vec<(f64, String)> = self
            .late_from
            .map(|x| (x, "late stage".to_string()))
            .into_iter()
            .collect();
        let panels = [
            Panel {
                title: "mean active rank per layer".into(),
                x_label: "step".into(),
                y_label: "rank".into(),
                series: self.ranks.iter().map(|(n, p)| s(n, p)).collect(),
                log_y: false,
                marks: marks.clone(),
                ..Default::default()
            },
            Panel {
                title: "compression of the whole model".into(),
                x_label: "step".into(),
                y_label: "dense / trainable parameters".into(),
                series: vec![s("whole model", &self.model_ratio)],
                log_y: true,
                marks: marks.clone(),
                ..Default::default()
            },
            Panel {
                title: "loss".into(),
                x_label: "step".into(),
                y_label: loss_name.into(),
                series: vec![s("train", &self.train_loss), s("valid", &self.valid_loss)],
                log_y: false,
                marks: marks.clone(),
                ..Default::default()
            },
        ];
        plot_panels(path, &panels, 1300, 380)?;
        Ok(())
    }

    /// Loss and accuracy (and AUC for a binary task) over steps.
    fn plot(&self, path: &Path, loss_name: &str) -> anyhow::Result<()> {
        let s = |name: &str, pts: &Vec<(f64, f64)>| Series {
            name: name.into(),
            points: pts.clone(),
        };
        let mut panels = vec![
            Panel {
                title: "loss".into(),
                x_label: "step".into(),
                y_label: loss_name.into(),
                series: vec![s("train", &self.train_loss), s("valid", &self.valid_loss)],
                log_y: false,
                ..Default::default()
            },
            Panel {
                title: "accuracy".into(),
                x_label: "step".into(),
                y_label: "accuracy".into(),
                series: vec![s("train", &self.train_acc), s("valid", &self.valid_acc)],
                log_y: false,
                ..Default::default()
            },
        ];
        if !self.valid_auc.is_empty() {
            panels.push(Panel {
                title: "validation AUC".into(),
                x_label: "step".into(),
                y_label: "AUC".into(),
                series: vec![s("valid", &self.valid_auc)],
                log_y: false,
                ..Default::default()
            });
        }
        let width = 450 * panels.len() as u32;
        plot_panels(path, &panels, width, 360)?;
        Ok(())
    }
}

/// Rewrites the metrics log without records after `step` (written after the checkpoint a run
/// resumes from), and without the final `ranks` record (written again when the run ends), and
/// returns the kept records.
fn metrics_up_to(path: &Path, step: u64) -> anyhow::Result<Vec<Record>> {
    let text = match comera_data::read_regular_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(anyhow::anyhow!("{}: cannot read: {e}", path.display())),
    };
    let mut kept = Vec::new();
    let mut out = String::new();
    for line in text.lines() {
        // A line cut short by a kill is dropped like a later one.
        let Ok(v) = serde_json::from_str::<Record>(line) else {
            continue;
        };
        if v.step() <= step && !matches!(v, Record::Ranks(_)) {
            out.push_str(line);
            out.push('\n');
            kept.push(v);
        }
    }
    crate::files::write_atomic(path, out.as_bytes())?;
    Ok(kept)
}

/// Mean active rank per layer (for the metrics log and the rank plot).
fn mean_ranks(layers: &[LayerRanks]) -> std::collections::BTreeMap<String, f64> {
    layers
        .iter()
        .map(|l| {
            let mean = l.ranks.iter().sum::<usize>() as f64 / l.ranks.len().max(1) as f64;
            (l.name.clone(), mean)
        })
        .collect()
}

/// Each epoch's phase index and step count (None: a streamed epoch of unknown length), with
/// `accumulate` micro-batches a step; epochs are numbered across phases.
fn plan_epochs<T: Task>(
    task: &mut T,
    accumulate: usize,
) -> anyhow::Result<Vec<(usize, Option<usize>)>> {
    let phases = task.phases().to_vec();
    let mut epochs = Vec::new();
    for (i, ph) in phases.iter().enumerate() {
        let full = task
            .batches_per_epoch(&micro_phase(ph, accumulate))?
            .map(|n| n / accumulate);
        let per_epoch = match (ph.max_steps_per_epoch.unwrap_or(0), full) {
            (0, f) => f,
            (m, Some(f)) => Some(m.min(f)),
            (m, None) => Some(m),
        };
        epochs.extend(std::iter::repeat_n((i, per_epoch), ph.epochs));
    }
    Ok(epochs)
}

/// The phase as the task sees it under gradient accumulation: batches of the micro-batch size.
fn micro_phase(phase: &Phase, accumulate: usize) -> Phase {
    Phase {
        batch_size: phase.batch_size / accumulate,
        ..phase.clone()
    }
}

/// The running state of the loop that is not in the checkpoint's [`Progress`].
struct Reporter {
    /// None on the processes of a data-parallel run that do not write (all but process 0).
    log: Option<MetricsLog>,
    writer: bool,
    curves: Curves,
    bar: indicatif::ProgressBar,
    dense_params: usize,
    /// The library user's observers ([`RunOptions::observers`]), and whether one asked to stop.
    observers: Vec<Box<dyn Observer>>,
    stop_asked: bool,
}

impl Reporter {
    /// Writes a record to the metrics log and the curves, and tells the observers.
    fn record(&mut self, r: Record) -> anyhow::Result<()> {
        self.curves.add(&r);
        if let Some(log) = &mut self.log {
            log.write(&serde_json::to_value(&r)?)?;
        }
        self.event(&Event::Record(&r));
        Ok(())
    }

    /// Tells every observer; a `Stop` from any is kept for the loop's next stop check.
    fn event(&mut self, e: &Event<'_>) {
        for o in &mut self.observers {
            if o.on_event(e) == Control::Stop {
                self.stop_asked = true;
            }
        }
    }

    /// A line above the progress bar, or on stderr when the bar is hidden (off a terminal);
    /// also an [`Event::Message`].
    fn say(&mut self, msg: String) {
        self.event(&Event::Message(&msg));
        if !self.writer {
            return;
        }
        if self.bar.is_hidden() {
            eprintln!("{msg}");
        } else {
            self.bar.println(msg);
        }
    }

    fn ratio(&self, model: &dyn Model) -> f64 {
        self.dense_params as f64 / model.num_params() as f64
    }

    fn plots(&mut self, out: &Path, rank_active: bool, loss_name: &str) {
        if let Err(e) = self.curves.plot(&out.join("curves.png"), loss_name) {
            self.say(format!("warning: plot not written: {e:#}"));
        }
        if rank_active {
            if let Err(e) = self.curves.plot_ranks(&out.join("ranks.png"), loss_name) {
                self.say(format!("warning: plot not written: {e:#}"));
            }
        }
    }
}

/// The one training loop (module docs).
fn run<T: Task>(
    setup: Setup<T>,
    observers: Vec<Box<dyn Observer>>,
) -> anyhow::Result<TrainSummary> {
    let t0 = Instant::now();
    let Setup {
        mut task,
        mut model,
        optim,
        galore,
        rank_cfg,
        clip_norm,
        gate_threshold,
        settings: cfg,
        resume,
        run_dir,
    } = setup;
    let run_id = run_dir
        .as_ref()
        .map_or_else(String::new, |d| d.identity.id.clone());
    let out = cfg.out.clone();
    let initial_params = model.num_params();
    if let Some(ck) = &resume {
        // The checkpoint's (possibly truncated) ranks first: the optimiser's state follows them.
        ck.load_params(&mut model)?;
    }
    // The learning rate shown in log lines: the TT cores' (the rest scale alike).
    let lr_cores = optim.lr_cores;
    let mut optimizer = Optimizer::new(optim, galore, &mut model);
    let (rank, mut prog) = match &resume {
        Some(ck) => {
            optimizer
                .restore(&ck.optimizer, &mut |n, b| ck.opt_fill(n, b), &mut model)
                .with_context(|| format!("{}", ck.path.display()))?;
            (ck.rank.clone(), ck.progress.clone())
        }
        None => {
            let rank = RankController::new(&rank_cfg, &model);
            let prog = Progress {
                ranks_start: rank::layer_ranks(&model),
                ..Progress::default()
            };
            (rank, prog)
        }
    };
    let dense_params = model.dense_equivalent_params();
    eprintln!(
        "      {} parameters ({dense_params} dense, {:.1}x compression)",
        model.num_params(),
        dense_params as f64 / model.num_params() as f64
    );
    let accumulate = cfg.accumulate_steps.max(1);
    let epochs = plan_epochs(&mut task, accumulate)?;
    // A run whose last checkpoint is its end, killed before its final report, only finishes
    // its report; a run that ended cleanly is not run again.
    let finishing = resume
        .as_ref()
        .is_some_and(|ck| ck.progress.epoch >= epochs.len());
    if finishing {
        let ended = std::fs::read_to_string(out.join("report.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .is_some_and(|r| r["stopped"] == false);
        let ck = resume.as_ref().expect("finishing a resumed run");
        if ended {
            bail!(
                "{}: the run finished ({} epochs, {} steps); nothing to resume. To train further, start a new run from it with --init-from (encoder) or a new directory",
                out.display(),
                epochs.len(),
                ck.progress.step
            );
        }
        eprintln!("the run had finished training; writing its final report");
    }
    let phases = task.phases().to_vec();
    let total = epochs
        .iter()
        .map(|e| e.1.map(|n| n as u64))
        .sum::<Option<u64>>();
    // Sequence positions (or examples) per step of each phase, and seen before step `s`.
    let tokens_per_step: Vec<u64> = phases
        .iter()
        .map(|p| (p.batch_size * task.tokens_per_example(p)) as u64)
        .collect();
    let tokens_at = |s: u64| -> u64 {
        let mut left = s;
        let mut tokens = 0;
        for &(ph, n) in &epochs {
            let k = left.min(n.map_or(u64::MAX, |n| n as u64));
            tokens += k * tokens_per_step[ph];
            left -= k;
        }
        tokens
    };
    let schedule = Schedule {
        warmup: cfg.warmup_steps.min(total.unwrap_or(u64::MAX)),
        total: total.unwrap_or(u64::MAX),
        decay: cfg.decay,
    };
    let mut stepper = Stepper::new(optimizer, rank, schedule, clip_norm, gate_threshold);
    // Data-parallel (several processes): process 0 alone writes the run directory.
    stepper.data_parallel = crate::distributed::collective().map(comera_optim::DataParallel::new);
    let (_, processes) = crate::distributed::processes();
    let writer = crate::distributed::is_writer();
    let rank_active = stepper.rank.active();
    let mut st_phase = epochs.get(prog.epoch).map_or(phases.len() - 1, |e| e.0);
    let mut st = task.state(&model, &micro_phase(&phases[st_phase], accumulate))?;
    let metrics_path = out.join("metrics.jsonl");
    let mut curves = Curves::default();
    let (mut best_valid, mut best_epoch) = (f64::NEG_INFINITY, 0);
    let log = match &resume {
        _ if !writer => None,
        Some(_) => {
            for r in metrics_up_to(&metrics_path, prog.step)? {
                if let Record::Eval(e) = &r {
                    if e.score() > best_valid {
                        (best_valid, best_epoch) = (e.score(), e.epoch);
                    }
                }
                curves.add(&r);
            }
            Some(MetricsLog::append(&metrics_path)?)
        }
        None => Some(MetricsLog::create(&metrics_path)?),
    };
    let bar = match (cfg.progress && writer, total) {
        (false, _) => indicatif::ProgressBar::hidden(),
        (true, Some(t)) => indicatif::ProgressBar::new(t),
        (true, None) => indicatif::ProgressBar::new_spinner(),
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} {msg} [{elapsed_precise}<{eta_precise}]",
        )
        .expect("valid template"),
    );
    bar.set_position(prog.step);
    let mut rep = Reporter {
        log,
        writer,
        curves,
        bar,
        dense_params,
        observers,
        stop_asked: false,
    };
    let base_seconds = prog.seconds;
    let resumed_at = prog.step;
    let mut win_steps = 0usize;
    // Seconds of the window's steps spent in collectives (data-parallel runs).
    let mut win_comm = 0.0f64;
    let mut step_ms: Vec<f64> = Vec::new();
    let mut final_valid = if finishing {
        task.evaluate(&model, &mut st, &micro_phase(&phases[st_phase], accumulate))?
    } else {
        EvalStats::default()
    };
    let mut win_start = Instant::now();
    let mut stopped = false;
    let mut early_stopped = false;
    // A checkpoint holds the model's `model.toml` (its kind and shape; truncated ranks are
    // read from the tensors' shapes when it is loaded).
    let save_checkpoint = |meta: &str,
                           prog: &Progress,
                           stepper: &Stepper,
                           model: &mut T::Model,
                           rep: &mut Reporter|
     -> anyhow::Result<()> {
        if !writer {
            return Ok(());
        }
        let state = stepper.optimizer.state(model);
        let run = checkpoint::RunState {
            run_id: &run_id,
            config_toml: &cfg.config_toml,
            model_toml: meta,
            progress: prog,
            rank: &stepper.rank,
        };
        let path = checkpoint::save(&out, &run, model, &state, cfg.keep_checkpoints)?;
        // The run it replaced (--overwrite) is deleted once this one can be resumed.
        run_dir.as_ref().map_or(Ok(()), RunDir::keep_new_run)?;
        rep.event(&Event::Checkpoint {
            step: prog.step,
            path: &path,
        });
        Ok(())
    };
    // A stop asked for (train.stop_after_steps, or a first SIGINT/SIGTERM) ends the run after
    // the step with a checkpoint at it.
    let stop_due = |step: u64| {
        (cfg.stop_after_steps > 0 && step >= cfg.stop_after_steps)
            || crate::interrupt::requested().is_some()
    };
    let n_epochs = epochs.len();
    'epochs: for (epoch, &(ph, per_epoch)) in epochs.iter().enumerate().skip(prog.epoch) {
        let phase = &phases[ph];
        if ph != st_phase {
            st = task.state(&model, &micro_phase(phase, accumulate))?;
            st_phase = ph;
            rep.say(format!(
                "phase {}: seq_len {}, batch {}",
                ph + 1,
                phase.seq_len,
                phase.batch_size
            ));
        }
        // The bar names the epoch (and phase) from its first step, not the last window's.
        rep.bar.set_message(if phases.len() > 1 {
            format!("epoch {} (phase {})", epoch + 1, ph + 1)
        } else {
            format!("epoch {}", epoch + 1)
        });
        let meta = task.model_meta(&model, epoch, prog.step)?;
        // What the task sees: batches of the micro-batch size (the phase's, without accumulation).
        let micro = micro_phase(phase, accumulate);
        let mut batches = task.epoch(&micro, epoch)?;
        // Resuming inside an epoch: replay its data order up to the checkpoint.
        for _ in 0..prog.batch_in_epoch * accumulate {
            batches.next_into(&mut st)?;
        }
        let mut i = prog.batch_in_epoch;
        while per_epoch.is_none_or(|n| i < n) {
            if !batches.next_into(&mut st)? {
                break;
            }
            i += 1;
            let epoch_end = per_epoch == Some(i);
            let ts = Instant::now();
            let mut load_next = |st: &mut _| batches.next_into(st).map_err(Into::into);
            let r = match stepper.step_accumulated(
                &mut model,
                &mut st,
                prog.step,
                accumulate,
                &mut load_next,
            ) {
                // A streamed epoch that ends inside an accumulated step drops it.
                Err(comera_optim::StepError::EndOfData) => break,
                r => r.with_context(|| format!("epoch {}", epoch + 1))?,
            };
            step_ms.push(ts.elapsed().as_secs_f64() * 1e3);
            win_comm += r.comm.as_secs_f64();
            prog.step += 1;
            prog.batch_in_epoch = i;
            let step = prog.step;
            rank_events(
                &mut stepper,
                &mut model,
                &mut rep,
                &mut prog,
                epoch + 1,
                epoch_end,
            )?;
            if rank_active {
                crate::distributed::check_same_ranks(&mut stepper, &model, prog.step)?;
            }
            let s = r.stats;
            prog.ep_loss += s.loss * s.count as f64;
            prog.ep_correct += s.correct;
            prog.ep_count += s.count;
            prog.win_loss += s.loss * s.count as f64;
            prog.win_correct += s.correct;
            prog.win_count += s.count;
            win_steps += 1;
            if step.is_multiple_of(cfg.log_every as u64) {
                let secs = win_start.elapsed().as_secs_f64();
                let steps_in_window = win_steps.max(1) as f64;
                let (l, a) = (
                    prog.win_loss / prog.win_count as f64,
                    prog.win_correct as f64 / prog.win_count as f64,
                );
                let tps = tokens_per_step[ph] as f64 * steps_in_window / secs;
                let mut rec = TrainRecord {
                    epoch: epoch + 1,
                    step,
                    tokens: tokens_at(step),
                    loss: l,
                    accuracy: a,
                    lr_scale: r.lr_scale,
                    grad_norm: r.grad_norm,
                    tokens_per_s: tps,
                    ms_per_step: secs * 1e3 / steps_in_window,
                    params: model.num_params(),
                    compression: rep.ratio(&model),
                    processes: None,
                    allreduce_bytes_per_step: None,
                    comm_ms_per_step: None,
                    size: None,
                    size_l1: None,
                    branch: None,
                    mean_ranks: None,
                };
                if let Some(dp) = &stepper.data_parallel {
                    rec.processes = Some(processes);
                    rec.allreduce_bytes_per_step = Some(dp.bytes_per_step);
                    rec.comm_ms_per_step = Some(win_comm * 1e3 / steps_in_window);
                }
                if rank_active {
                    let branch = match r.objective.branch {
                        Branch::Early => "early",
                        Branch::Loss => "late-loss",
                        Branch::Size => "late-size",
                    };
                    rec.size = Some(r.objective.size);
                    rec.size_l1 = Some(r.objective.size_l1);
                    rec.branch = Some(branch.into());
                    rec.mean_ranks = Some(mean_ranks(&rank::layer_ranks(&model)));
                }
                rep.record(Record::Train(rec))?;
                let size = if rank_active {
                    format!(" {:.1}x", rep.ratio(&model))
                } else {
                    String::new()
                };
                let phase_note = if phases.len() > 1 {
                    format!(" (phase {})", ph + 1)
                } else {
                    String::new()
                };
                let msg = format!(
                    "epoch {}{phase_note} loss {l:.4} acc {a:.3}{size} {tps:.0}/s",
                    epoch + 1
                );
                rep.bar.set_message(msg);
                if cfg.progress && rep.bar.is_hidden() {
                    // Off a terminal (a log file, a batch job): a line in place of the bar.
                    let done = (prog.step - resumed_at).max(1) as f64;
                    let per_step = t0.elapsed().as_secs_f64() / done;
                    let (of, eta) = match total {
                        Some(n) => (
                            format!("/{n}"),
                            format!(
                                " ETA {}",
                                format_secs(per_step * n.saturating_sub(step) as f64)
                            ),
                        ),
                        None => (String::new(), String::new()),
                    };
                    rep.say(format!(
                        "step {step}{of} epoch {} loss {l:.4} acc {a:.3} lr {:.2e} {tps:.0} tok/s {} params{size}{eta}",
                        epoch + 1,
                        lr_cores * r.lr_scale,
                        model.num_params()
                    ));
                }
                (prog.win_loss, prog.win_correct, prog.win_count) = (0.0, 0, 0);
                win_steps = 0;
                win_comm = 0.0;
                win_start = Instant::now();
            }
            rep.bar.inc(1);
            if epoch_end {
                break;
            }
            // Evaluations come before the step's checkpoint: a checkpoint at step s implies
            // that the evaluation at s is in the log (and in early stopping's state).
            if cfg.eval_every > 0 && step.is_multiple_of(cfg.eval_every) {
                let at = EvalAt {
                    writer,
                    out: &out,
                    run_id: &run_id,
                    config_toml: &cfg.config_toml,
                    early: cfg.early_stopping.as_ref(),
                    epoch: epoch + 1,
                    epoch_end: false,
                    tokens: tokens_at(step),
                    seconds: base_seconds + t0.elapsed().as_secs_f64(),
                };
                let (valid, stop_early) =
                    evaluation(&task, &model, &mut st, &micro, &mut rep, &mut prog, &at)?;
                final_valid = valid;
                let score = valid.auc.unwrap_or(valid.accuracy);
                if score > best_valid {
                    (best_valid, best_epoch) = (score, epoch + 1);
                }
                if stop_early {
                    if task.saves_model() && writer {
                        crate::files::save_model_files(
                            &out,
                            &model.params(),
                            &meta,
                            Some(&run_id),
                        )?;
                    }
                    // The run is over: its checkpoint says so (resume reports it finished).
                    (prog.epoch, prog.batch_in_epoch) = (n_epochs, 0);
                    prog.seconds = at.seconds;
                    save_checkpoint(&meta, &prog, &stepper, &mut model, &mut rep)?;
                    if writer {
                        rep.plots(&out, rank_active, task.loss_name());
                    }
                    early_stopped = true;
                    break 'epochs;
                }
            }
            let stop_now = stop_due(step) || rep.stop_asked;
            if stop_now || (cfg.checkpoint_every > 0 && step.is_multiple_of(cfg.checkpoint_every)) {
                prog.seconds = base_seconds + t0.elapsed().as_secs_f64();
                save_checkpoint(&meta, &prog, &stepper, &mut model, &mut rep)?;
            }
            if stop_now {
                stopped = true;
                break 'epochs;
            }
        }
        drop(batches);
        if per_epoch.is_none() {
            // A streamed epoch ends when its data does: the epoch-end rank events run now.
            rank_events(
                &mut stepper,
                &mut model,
                &mut rep,
                &mut prog,
                epoch + 1,
                true,
            )?;
        }
        if prog.ep_count == 0 {
            bail!(
                "epoch {}: no full batch of {} examples in the training data",
                epoch + 1,
                phase.batch_size
            );
        }
        if let Some(note) = task.epoch_note() {
            rep.say(format!("data  {note}"));
        }
        let secs = base_seconds + t0.elapsed().as_secs_f64();
        let at = EvalAt {
            writer,
            out: &out,
            run_id: &run_id,
            config_toml: &cfg.config_toml,
            early: cfg.early_stopping.as_ref(),
            epoch: epoch + 1,
            epoch_end: true,
            tokens: tokens_at(prog.step),
            seconds: secs,
        };
        let (valid, stop_early) =
            evaluation(&task, &model, &mut st, &micro, &mut rep, &mut prog, &at)?;
        final_valid = valid;
        let score = valid.auc.unwrap_or(valid.accuracy);
        if score > best_valid {
            (best_valid, best_epoch) = (score, epoch + 1);
        }
        let meta = task.model_meta(&model, epoch + 1, prog.step)?;
        if task.saves_model() && writer {
            crate::files::save_model_files(&out, &model.params(), &meta, Some(&run_id))?;
        }
        // The next epoch starts from a clean slate; checkpoint that point (an early stop ends
        // the run there).
        let next = if stop_early { n_epochs } else { epoch + 1 };
        (prog.epoch, prog.batch_in_epoch) = (next, 0);
        (prog.ep_loss, prog.ep_correct, prog.ep_count) = (0.0, 0, 0);
        prog.seconds = secs;
        save_checkpoint(&meta, &prog, &stepper, &mut model, &mut rep)?;
        if writer {
            rep.plots(&out, rank_active, task.loss_name());
        }
        if stop_early {
            early_stopped = true;
            break;
        }
        if (stop_due(prog.step) || rep.stop_asked) && epoch + 1 < n_epochs {
            stopped = true;
            break;
        }
    }
    rep.bar.finish_and_clear();
    let ranks_end = rank::layer_ranks(&model);
    let stage = match stepper.rank.stage {
        Stage::Early => "early",
        Stage::Late => "late",
    };
    if rank_active && !stopped && writer {
        write_rank_report(
            &out,
            &prog,
            &ranks_end,
            stage,
            initial_params,
            &model,
            &mut rep,
        )?;
    }
    let med = median(&mut step_ms);
    let batch_size = phases.last().map_or(0, |p| p.batch_size);
    let params = model.num_params();
    let mut summary = TrainSummary {
        out_dir: out.clone(),
        epochs: n_epochs,
        steps: prog.step,
        batch_size,
        tokens: tokens_at(prog.step),
        final_valid,
        best_valid,
        best_epoch,
        majority_accuracy: task.majority_accuracy(),
        params,
        initial_params,
        dense_params,
        seconds: base_seconds + t0.elapsed().as_secs_f64(),
        median_step_ms: med,
        examples_per_s: if med > 0.0 {
            batch_size as f64 / (med / 1e3)
        } else {
            0.0
        },
        peak_rss_bytes: peak_rss_bytes(),
        param_bytes: model.bytes(&st).params + model.bytes(&st).grads,
        optimizer_bytes: stepper.optimizer.bytes(),
        state_bytes: model.bytes(&st).state,
        ranks_start: prog.ranks_start,
        ranks_switch: prog.ranks_switch,
        ranks_end,
        rank_active,
        rank_stage: stage.into(),
        stopped,
        interrupted: crate::interrupt::requested().filter(|_| stopped),
        early_stopped,
        extra: task.report_extra(&model),
    };
    if let Some(dp) = &stepper.data_parallel {
        crate::distributed::report(&mut summary, dp, &step_ms);
    }
    if writer {
        crate::files::write_atomic(
            &out.join("report.json"),
            serde_json::to_string_pretty(&summary)?.as_bytes(),
        )?;
    }
    run_dir.as_ref().map_or(Ok(()), RunDir::keep_new_run)?;
    rep.event(&Event::Finished(&summary));
    Ok(summary)
}

/// `1h02m03s`, `2m03s` or `3s`.
fn format_secs(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, s) => format!("{h}h{m:02}m{s:02}s"),
    }
}

/// The directory of the best model under early stopping.
pub const BEST_DIR: &str = "best";

/// Where and when an evaluation happens.
struct EvalAt<'a> {
    /// Whether this process writes files (process 0 of a data-parallel run).
    writer: bool,
    out: &'a Path,
    run_id: &'a str,
    config_toml: &'a str,
    early: Option<&'a EarlyStopping>,
    /// The epoch in progress (1-based) and whether this is its end.
    epoch: usize,
    epoch_end: bool,
    tokens: u64,
    seconds: f64,
}

/// One evaluation on the held-out data: its `eval` record and line, and early stopping's
/// bookkeeping: on an improvement of the watched metric the model is written to `best/` (with
/// the run's `config.toml`, so every command reads it as a run directory); after `patience`
/// evaluations without one, an `early_stop` record. Returns the figures and whether to stop.
fn evaluation<T: Task>(
    task: &T,
    model: &T::Model,
    st: &mut <T::Model as Trainable>::State,
    phase: &Phase,
    rep: &mut Reporter,
    prog: &mut Progress,
    at: &EvalAt<'_>,
) -> anyhow::Result<(EvalStats, bool)> {
    let valid = task.evaluate(model, st, phase)?;
    // Training figures over the epoch so far.
    let n = prog.ep_count.max(1) as f64;
    let (tl, ta) = (prog.ep_loss / n, prog.ep_correct as f64 / n);
    rep.record(Record::Eval(EvalRecord {
        epoch: at.epoch,
        step: prog.step,
        tokens: at.tokens,
        train_loss: tl,
        train_accuracy: ta,
        valid_loss: valid.loss,
        valid_accuracy: valid.accuracy,
        valid_perplexity: valid.loss.exp(),
        valid_auc: valid.auc,
        seconds: at.seconds,
    }))?;
    let auc = valid.auc.map_or(String::new(), |a| format!(" AUC {a:.4}"));
    let (vl, va) = (valid.loss, valid.accuracy);
    rep.say(if at.epoch_end {
        format!(
            "epoch {}: train loss {tl:.4} acc {ta:.4} | valid loss {vl:.4}{auc} acc {va:.4}",
            at.epoch
        )
    } else {
        format!(
            "step {} (epoch {}): valid loss {vl:.4}{auc} acc {va:.4}",
            prog.step, at.epoch
        )
    });
    let Some(es) = at.early else {
        return Ok((valid, false));
    };
    let value = es.value(&valid).ok_or_else(|| {
        anyhow::anyhow!(
            "train.early_stopping.metric: valid_auc needs a binary task; this one reports no AUC (use valid_loss or valid_accuracy)"
        )
    })?;
    if es.improves(value, prog.best_metric) {
        (prog.best_metric, prog.evals_since_best) = (Some(value), 0);
        if !at.writer {
            return Ok((valid, false));
        }
        let best = at.out.join(BEST_DIR);
        let epochs_done = if at.epoch_end { at.epoch } else { at.epoch - 1 };
        let meta = task.model_meta(model, epochs_done, prog.step)?;
        crate::files::save_model_files(&best, &model.params(), &meta, Some(at.run_id))?;
        crate::files::write_atomic(&best.join("config.toml"), at.config_toml.as_bytes())?;
        return Ok((valid, false));
    }
    prog.evals_since_best += 1;
    let stop = prog.evals_since_best >= es.patience;
    if stop {
        let best = prog.best_metric.unwrap_or(f64::NAN);
        rep.record(Record::EarlyStop(EarlyStopRecord {
            epoch: at.epoch,
            step: prog.step,
            metric: es.metric,
            best,
            patience: es.patience,
        }))?;
        rep.say(format!(
            "early stop at step {}: {} has not improved on {best:.4} in {} evaluations; the best model is in {}",
            prog.step,
            serde_json::to_value(es.metric)?.as_str().unwrap_or("metric"),
            es.patience,
            at.out.join(BEST_DIR).display()
        ));
    }
    Ok((valid, stop))
}

/// After a step: the rank schedule's switch to the late stage and truncation, each logged.
fn rank_events(
    stepper: &mut Stepper,
    model: &mut dyn Model,
    rep: &mut Reporter,
    prog: &mut Progress,
    epoch: usize,
    epoch_end: bool,
) -> anyhow::Result<()> {
    let step = prog.step;
    let (switched, truncated) = stepper.after_step(model, step, epoch, epoch_end);
    if let Some(now) = switched {
        let (size, _, _) = rank::sizes(model);
        let target = stepper.rank.target_size;
        rep.record(Record::Stage(StageRecord {
            stage: "late".into(),
            epoch,
            step,
            size,
            target_size: target,
            ranks: now.clone(),
        }))?;
        rep.say(format!(
            "step {step}: late stage, size {size:.0} → target {:.0}",
            target.unwrap_or(0.0)
        ));
        prog.ranks_switch = Some(now);
    }
    if truncated {
        let now = rank::layer_ranks(model);
        rep.record(Record::Truncate(TruncateRecord {
            epoch,
            step,
            params: model.num_params(),
            compression: rep.ratio(model),
            ranks: now,
        }))?;
    }
    Ok(())
}

/// `ranks.md` and the final `ranks` record of a rank-adaptive run.
fn write_rank_report(
    out: &Path,
    prog: &Progress,
    ranks_end: &[LayerRanks],
    stage: &str,
    initial_params: usize,
    model: &dyn Model,
    rep: &mut Reporter,
) -> anyhow::Result<()> {
    let mut points: Vec<(&str, &[LayerRanks])> = vec![("start", &prog.ranks_start)];
    if let Some(r) = &prog.ranks_switch {
        points.push(("after early stage", r));
    }
    points.push(("end", ranks_end));
    let table = rank::rank_table(&points);
    let dense = rep.dense_params;
    let text = format!(
        "# Ranks of the TT/TTM layers\n\nStage at the end: {stage}.\n\n{table}Whole model (the TT/TTM layers with every dense layer, embedding, norm and bias): {initial_params} → {} parameters; compression vs its dense equivalent ({dense}) {:.1}× → {:.1}×.\n",
        model.num_params(),
        dense as f64 / initial_params as f64,
        rep.ratio(model)
    );
    crate::files::write_atomic(&out.join("ranks.md"), text.as_bytes())?;
    rep.record(Record::Ranks(RanksRecord {
        step: prog.step,
        start: prog.ranks_start.clone(),
        switch: prog.ranks_switch.clone(),
        end: ranks_end.to_vec(),
    }))
}
