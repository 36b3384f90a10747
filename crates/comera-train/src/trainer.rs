//! The one training loop ([`run`]) over any [`Task`]: phases of fixed-shape steps, each step
//! [`Stepper::step`]; the rank schedule's stage switch and truncation; evaluation, model files
//! and a checkpoint after every epoch (and every `checkpoint_every` steps); exact resume; the
//! metrics log, progress, plots, `ranks.md` and `report.json`.
//!
//! Entry points: [`train`] (an encoder run: classification or masked LM), [`train_dlrm`] (a
//! DLRM run) and [`resume`] (either, from the newest checkpoint of a run directory).

use crate::checkpoint::{self, Checkpoint, Progress};
use crate::config::{AnyRunConfig, DlrmRunConfig, Phase, RunConfig};
use crate::data::{prepare, CorpusData, PreparedData};
use crate::files::{DlrmMeta, MetricsLog, RunLock};
use crate::plot::{plot_panels, Panel, Series};
use crate::task::{CtrTask, EncoderData, EncoderTask, EpochBatches, EvalStats, Task};
use anyhow::{bail, Context};
use comera_dlrm::Dlrm;
use comera_layers::{Model, Trainable};
use comera_model::Encoder;
use comera_optim::rank::{self, Branch, LayerRanks, RankConfig, RankController, Stage};
use comera_optim::{AdamWConfig, Decay, GaLoreConfig, Optimizer, Schedule, Stepper};
use serde::Serialize;
use serde_json::json;
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
    /// Whether the run stopped early at `train.stop_after_steps` (resumable).
    pub stopped: bool,
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
    /// The run directory's lock, held until the run ends.
    _lock: RunLock,
}

/// Runs a whole encoder training job as configured; writes into `cfg.train.out_dir`.
///
/// The job runs on a worker of the rayon pool, so parallel work inside a step is scheduled
/// through the workers' own queues (no per-call injection, no allocation in the step).
pub fn train(cfg: &RunConfig, progress: bool) -> anyhow::Result<TrainSummary> {
    rayon::scope(|_| run(setup_encoder(cfg, None, progress)?))
}

/// Runs a whole DLRM training job as configured; writes into `cfg.train.out_dir`.
pub fn train_dlrm(cfg: &DlrmRunConfig, progress: bool) -> anyhow::Result<TrainSummary> {
    rayon::scope(|_| run(setup_dlrm(cfg, None, progress)?))
}

/// Continues the run in `run_dir` from its newest checkpoint. With the same thread count, the
/// losses are bit for bit those of a run that was never stopped.
pub fn resume(run_dir: &Path, progress: bool) -> anyhow::Result<TrainSummary> {
    let path = checkpoint::list(run_dir)?.pop().ok_or_else(|| {
        anyhow::anyhow!(
            "{}: no checkpoint to resume from (expected {}/step-*.safetensors)",
            run_dir.display(),
            checkpoint::DIR
        )
    })?;
    let ck = Checkpoint::load(&path)?;
    let mut cfg = ck.config()?;
    *cfg.out_dir_mut() = run_dir.to_path_buf();
    // A resumed run runs to the configured end (the stop is what interrupted it).
    *cfg.stop_after_steps_mut() = 0;
    eprintln!("resume {} (step {})", path.display(), ck.progress.step);
    rayon::scope(|_| match &cfg {
        AnyRunConfig::Encoder(c) => run(setup_encoder(c, Some(ck), progress)?),
        AnyRunConfig::Dlrm(c) => run(setup_dlrm(c, Some(ck), progress)?),
    })
}

/// Opens the run directory for writing: creates it, locks it (one writer), removes temporary
/// files of dead processes, and for a fresh run writes its resolved `config.toml`; a resumed
/// run's checkpoint must have been written with the directory's own config.
fn start_run_dir(
    out: &Path,
    config_toml: &str,
    resume: &Option<Checkpoint>,
) -> anyhow::Result<RunLock> {
    if out.as_os_str().is_empty() {
        bail!("train.out_dir: empty; name the run directory");
    }
    std::fs::create_dir_all(out)
        .with_context(|| format!("{}: cannot create run directory", out.display()))?;
    let lock = RunLock::acquire(out)?;
    for d in [out.to_path_buf(), out.join(checkpoint::DIR)] {
        crate::files::remove_stale_temporaries(&d);
    }
    match resume {
        None => crate::files::write_atomic(&out.join("config.toml"), config_toml.as_bytes())?,
        Some(ck) => {
            let path = out.join("config.toml");
            let own = std::fs::read_to_string(&path)
                .with_context(|| format!("{}: cannot read the run's config", path.display()))?;
            if own != ck.config_toml {
                bail!(
                    "{}: written with another config than {} (a checkpoint of another run?); refusing to resume from it",
                    ck.path.display(),
                    path.display()
                );
            }
        }
    }
    Ok(lock)
}

fn setup_encoder(
    cfg: &RunConfig,
    resume: Option<Checkpoint>,
    progress: bool,
) -> anyhow::Result<Setup<EncoderTask>> {
    let phases = cfg.phases();
    let data = if cfg.data.source == "corpus" {
        EncoderData::Mlm(CorpusData::new(&cfg.data, cfg.train.seed)?)
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
    let config_toml = match &resume {
        Some(ck) => ck.config_toml.clone(),
        None => resolved.to_toml(),
    };
    if let Some(ck) = &resume {
        match ck.config()? {
            AnyRunConfig::Encoder(c) if c.model == mcfg => {}
            _ => bail!(
                "{}: the checkpoint's [model] differs from what its run's data gives now (labels or vocabulary changed?)",
                ck.path.display()
            ),
        }
    }
    let out = cfg.train.out_dir.clone();
    let lock = start_run_dir(&out, &config_toml, &resume)?;
    let mut model = Encoder::new(&mcfg, cfg.train.seed).map_err(|e| anyhow::anyhow!("{e}"))?;
    if let (None, Some(dir)) = (&resume, &cfg.train.init_from) {
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
        "model {} layers, d_model {}, {}{}",
        mcfg.layers,
        mcfg.d_model,
        if mcfg.tt_linear {
            "TT linear"
        } else {
            "dense linear"
        },
        if mcfg.ttm_embedding {
            " + TTM embedding"
        } else {
            " + dense embedding"
        },
    );
    if cfg.galore.is_some() && cfg.rank.enabled {
        eprintln!("note  GaLore run: rank gates are trained, but pruned slices are not truncated");
    }
    let t = &cfg.train;
    Ok(Setup {
        task: EncoderTask {
            data,
            phases,
            model_cfg: mcfg.clone(),
            vocab,
            seed: t.seed,
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
            progress,
        },
        resume,
        _lock: lock,
    })
}

fn setup_dlrm(
    cfg: &DlrmRunConfig,
    resume: Option<Checkpoint>,
    progress: bool,
) -> anyhow::Result<Setup<CtrTask>> {
    let prepared = comera_dlrm::data::prepare(&cfg.data, cfg.train.seed)?;
    eprintln!("data  {}", prepared.summary);
    let config_toml = match &resume {
        Some(ck) => ck.config_toml.clone(),
        None => cfg.to_toml(),
    };
    let t = &cfg.train;
    let lock = start_run_dir(&t.out_dir, &config_toml, &resume)?;
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
            train: prepared.train,
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
            progress,
        },
        resume,
        _lock: lock,
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
    fn add(&mut self, r: &serde_json::Value) {
        let num = |k: &str| r.get(k).and_then(serde_json::Value::as_f64);
        let Some(step) = num("step") else { return };
        match r.get("kind").and_then(serde_json::Value::as_str) {
            Some("train") => {
                if let (Some(l), Some(a)) = (num("loss"), num("accuracy")) {
                    self.train_loss.push((step, l));
                    self.train_acc.push((step, a));
                }
                if let Some(c) = num("compression") {
                    self.model_ratio.push((step, c));
                }
                if let Some(layers) = r.get("mean_ranks").and_then(|v| v.as_object()) {
                    for (name, v) in layers {
                        let Some(v) = v.as_f64() else { continue };
                        match self.ranks.iter_mut().find(|(n, _)| n == name) {
                            Some((_, pts)) => pts.push((step, v)),
                            None => self.ranks.push((name.clone(), vec![(step, v)])),
                        }
                    }
                }
            }
            Some("stage") => self.late_from = Some(step),
            Some("eval") => {
                if let (Some(l), Some(a)) = (num("valid_loss"), num("valid_accuracy")) {
                    self.valid_loss.push((step, l));
                    self.valid_acc.push((step, a));
                }
                if let Some(a) = num("valid_auc") {
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
/// resumes from) and returns the kept records.
fn metrics_up_to(path: &Path, step: u64) -> anyhow::Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut kept = Vec::new();
    let mut out = String::new();
    for line in text.lines() {
        // A line cut short by a kill is dropped like a later one.
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v.get("step")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0)
            <= step
        {
            out.push_str(line);
            out.push('\n');
            kept.push(v);
        }
    }
    crate::files::write_atomic(path, out.as_bytes())?;
    Ok(kept)
}

/// Mean active rank per layer, as a JSON object (for the metrics log and the rank plot).
fn mean_ranks(layers: &[LayerRanks]) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for l in layers {
        let mean = l.ranks.iter().sum::<usize>() as f64 / l.ranks.len().max(1) as f64;
        m.insert(l.name.clone(), json!(mean));
    }
    serde_json::Value::Object(m)
}

/// Each epoch's phase index and batch count (None: a streamed epoch of unknown length);
/// epochs are numbered across phases.
fn plan_epochs<T: Task>(task: &mut T) -> anyhow::Result<Vec<(usize, Option<usize>)>> {
    let phases = task.phases().to_vec();
    let mut epochs = Vec::new();
    for (i, ph) in phases.iter().enumerate() {
        let full = task.batches_per_epoch(ph)?;
        let per_epoch = match (ph.max_steps_per_epoch.unwrap_or(0), full) {
            (0, f) => f,
            (m, Some(f)) => Some(m.min(f)),
            (m, None) => Some(m),
        };
        epochs.extend(std::iter::repeat_n((i, per_epoch), ph.epochs));
    }
    Ok(epochs)
}

/// The running state of the loop that is not in the checkpoint's [`Progress`].
struct Reporter {
    log: MetricsLog,
    curves: Curves,
    bar: indicatif::ProgressBar,
    dense_params: usize,
}

impl Reporter {
    /// Writes a record to the metrics log and the curves.
    fn record(&mut self, r: serde_json::Value) -> anyhow::Result<()> {
        self.curves.add(&r);
        self.log.write(&r)
    }

    /// A line above the progress bar, or on stderr when the bar is hidden (off a terminal).
    fn say(&self, msg: String) {
        if self.bar.is_hidden() {
            eprintln!("{msg}");
        } else {
            self.bar.println(msg);
        }
    }

    fn ratio(&self, model: &dyn Model) -> f64 {
        self.dense_params as f64 / model.num_params() as f64
    }

    fn plots(&self, out: &Path, rank_active: bool, loss_name: &str) {
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
fn run<T: Task>(setup: Setup<T>) -> anyhow::Result<TrainSummary> {
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
        _lock,
    } = setup;
    let out = cfg.out.clone();
    let initial_params = model.num_params();
    if let Some(ck) = &resume {
        // The checkpoint's (possibly truncated) ranks first: the optimiser's state follows them.
        ck.load_params(&mut model)?;
    }
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
    let epochs = plan_epochs(&mut task)?;
    if let Some(ck) = &resume {
        if ck.progress.epoch >= epochs.len() {
            bail!(
                "{}: the run finished ({} epochs, {} steps); nothing to resume. To train further, start a new run from it with --init-from (encoder) or a new directory",
                out.display(),
                epochs.len(),
                ck.progress.step
            );
        }
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
    let rank_active = stepper.rank.active();
    let mut st_phase = epochs.get(prog.epoch).map_or(phases.len() - 1, |e| e.0);
    let mut st = task.state(&model, &phases[st_phase])?;
    let metrics_path = out.join("metrics.jsonl");
    let mut curves = Curves::default();
    let log = match &resume {
        Some(_) => {
            for r in metrics_up_to(&metrics_path, prog.step)? {
                curves.add(&r);
            }
            MetricsLog::append(&metrics_path)?
        }
        None => MetricsLog::create(&metrics_path)?,
    };
    let bar = match (cfg.progress, total) {
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
        curves,
        bar,
        dense_params,
    };
    let base_seconds = prog.seconds;
    let mut win_steps = 0usize;
    let mut step_ms: Vec<f64> = Vec::new();
    let mut final_valid = EvalStats::default();
    let (mut best_valid, mut best_epoch) = (f64::NEG_INFINITY, 0);
    let mut win_start = Instant::now();
    let mut stopped = false;
    // A checkpoint holds the model's `model.toml` (its kind and shape; truncated ranks are
    // read from the tensors' shapes when it is loaded).
    let save_checkpoint = |meta: &str,
                           prog: &Progress,
                           stepper: &Stepper,
                           model: &mut T::Model|
     -> anyhow::Result<()> {
        let state = stepper.optimizer.state(model);
        let run = checkpoint::RunState {
            config_toml: &cfg.config_toml,
            model_toml: meta,
            progress: prog,
            rank: &stepper.rank,
        };
        checkpoint::save(&out, &run, model, &state, cfg.keep_checkpoints).map(|_| ())
    };
    let stop_due = |step: u64| cfg.stop_after_steps > 0 && step >= cfg.stop_after_steps;
    let n_epochs = epochs.len();
    'epochs: for (epoch, &(ph, per_epoch)) in epochs.iter().enumerate().skip(prog.epoch) {
        let phase = &phases[ph];
        if ph != st_phase {
            st = task.state(&model, phase)?;
            st_phase = ph;
            rep.say(format!(
                "phase {}: seq_len {}, batch {}",
                ph + 1,
                phase.seq_len,
                phase.batch_size
            ));
        }
        let meta = task.model_meta(&model, epoch, prog.step)?;
        let mut batches = task.epoch(phase, epoch)?;
        // Resuming inside an epoch: replay its data order up to the checkpoint.
        for _ in 0..prog.batch_in_epoch {
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
            let r = stepper
                .step(&mut model, &mut st, prog.step)
                .with_context(|| format!("epoch {}", epoch + 1))?;
            step_ms.push(ts.elapsed().as_secs_f64() * 1e3);
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
                let mut rec = json!({"kind": "train", "epoch": epoch + 1, "step": step, "tokens": tokens_at(step), "loss": l, "accuracy": a, "lr_scale": r.lr_scale, "grad_norm": r.grad_norm, "tokens_per_s": tps, "ms_per_step": secs * 1e3 / steps_in_window, "params": model.num_params(), "compression": rep.ratio(&model)});
                if rank_active {
                    let branch = match r.objective.branch {
                        Branch::Early => "early",
                        Branch::Loss => "late-loss",
                        Branch::Size => "late-size",
                    };
                    rec["size"] = json!(r.objective.size);
                    rec["size_l1"] = json!(r.objective.size_l1);
                    rec["branch"] = json!(branch);
                    rec["mean_ranks"] = mean_ranks(&rank::layer_ranks(&model));
                }
                rep.record(rec)?;
                let size = if rank_active {
                    format!(" {:.1}x", rep.ratio(&model))
                } else {
                    String::new()
                };
                let msg = format!(
                    "epoch {} loss {l:.4} acc {a:.3}{size} {tps:.0}/s",
                    epoch + 1
                );
                rep.bar.set_message(msg);
                (prog.win_loss, prog.win_correct, prog.win_count) = (0.0, 0, 0);
                win_steps = 0;
                win_start = Instant::now();
            }
            rep.bar.inc(1);
            if epoch_end {
                break;
            }
            let stop_now = stop_due(step);
            if stop_now || (cfg.checkpoint_every > 0 && step.is_multiple_of(cfg.checkpoint_every)) {
                prog.seconds = base_seconds + t0.elapsed().as_secs_f64();
                save_checkpoint(&meta, &prog, &stepper, &mut model)?;
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
        let valid = task.evaluate(&model, &mut st)?;
        final_valid = valid;
        let score = valid.auc.unwrap_or(valid.accuracy);
        if score > best_valid {
            (best_valid, best_epoch) = (score, epoch + 1);
        }
        let (tl, ta) = (
            prog.ep_loss / prog.ep_count as f64,
            prog.ep_correct as f64 / prog.ep_count as f64,
        );
        let secs = base_seconds + t0.elapsed().as_secs_f64();
        let mut rec = json!({"kind": "eval", "epoch": epoch + 1, "step": prog.step, "tokens": tokens_at(prog.step), "train_loss": tl, "train_accuracy": ta, "valid_loss": valid.loss, "valid_accuracy": valid.accuracy, "valid_perplexity": valid.loss.exp(), "seconds": secs});
        let auc = match valid.auc {
            Some(a) => {
                rec["valid_auc"] = json!(a);
                format!(" AUC {a:.4}")
            }
            None => String::new(),
        };
        rep.record(rec)?;
        rep.say(format!(
            "epoch {}: train loss {tl:.4} acc {ta:.4} | valid loss {:.4}{auc} acc {:.4}",
            epoch + 1,
            valid.loss,
            valid.accuracy
        ));
        let meta = task.model_meta(&model, epoch + 1, prog.step)?;
        if task.saves_model() {
            crate::files::save_model_files(&out, &model.params(), &meta)?;
        }
        // The next epoch starts from a clean slate; checkpoint that point.
        (prog.epoch, prog.batch_in_epoch) = (epoch + 1, 0);
        (prog.ep_loss, prog.ep_correct, prog.ep_count) = (0.0, 0, 0);
        prog.seconds = secs;
        save_checkpoint(&meta, &prog, &stepper, &mut model)?;
        rep.plots(&out, rank_active, task.loss_name());
        if stop_due(prog.step) && epoch + 1 < n_epochs {
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
    if rank_active && !stopped {
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
    let summary = TrainSummary {
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
        extra: task.report_extra(&model),
    };
    crate::files::write_atomic(
        &out.join("report.json"),
        serde_json::to_string_pretty(&summary)?.as_bytes(),
    )?;
    Ok(summary)
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
        rep.record(json!({"kind": "stage", "stage": "late", "epoch": epoch, "step": step, "size": size, "target_size": target, "ranks": now}))?;
        rep.say(format!(
            "step {step}: late stage, size {size:.0} → target {:.0}",
            target.unwrap_or(0.0)
        ));
        prog.ranks_switch = Some(now);
    }
    if truncated {
        let now = rank::layer_ranks(model);
        let rec = json!({"kind": "truncate", "epoch": epoch, "step": step, "params": model.num_params(), "compression": rep.ratio(model), "ranks": now});
        rep.record(rec)?;
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
        "# Ranks of the TT/TTM layers\n\nStage at the end: {stage}.\n\n{table}Whole model (with the dense embeddings, norms, biases, pooler and head): {initial_params} → {} parameters; compression vs its dense equivalent ({dense}) {:.1}× → {:.1}×.\n",
        model.num_params(),
        dense as f64 / initial_params as f64,
        rep.ratio(model)
    );
    crate::files::write_atomic(&out.join("ranks.md"), text.as_bytes())?;
    rep.record(json!({"kind": "ranks", "step": prog.step, "start": prog.ranks_start, "switch": prog.ranks_switch, "end": ranks_end}))
}
