//! Runs side by side: the results page of `comera report RUN… --out DIR`.
//!
//! Each run directory is read back typed and verified ([`RunResults::read`]: its config against
//! the digest in `run.toml`, `metrics.jsonl` record by record, `report.json` once the run has
//! ended), reduced to the figures the paper's tables compare ([`RunFigures`]), and written as one
//! Markdown page with its plots ([`write_report`]):
//!
//! - the arms: final and best held-out score, parameters, whole-model compression, TT/TTM
//!   compression at the start, at the switch to the late stage and at the end, time per epoch,
//!   peak memory and speed, and time and memory as ratios to a baseline arm;
//! - the held-out score after each epoch of every arm;
//! - each rank-adaptive arm's per-layer ranks (start → switch → end, [`rank_table`]);
//! - the paper's own figures for the table, labelled as the paper's (GPU) figures;
//! - `score.png` (score per epoch), `compression.png` (TT/TTM and whole-model compression over
//!   the steps, each arm's switch to the late stage marked) and `cost.png` (time per epoch and
//!   peak memory per arm).
//!
//! A run that has not ended (stopped, or still running) is reported from its records so far and
//! marked as such, so a table built over several sittings can be looked at on the way.
//!
//! Definitions (the same as the run's own messages):
//! - whole-model compression = dense parameters of the same model / trainable parameters now;
//! - TT/TTM compression = Σ dense parameters of the TT/TTM layers / Σ their size S (SPEC §1);
//! - time per epoch = the difference of the `seconds` of consecutive epoch-end evaluations
//!   (training and evaluation, summed over sittings), reported as the median over epochs;
//! - peak memory = the largest resident set (VmHWM) any sitting of the run reported.

use crate::plot::{plot_panels, Bars, Panel, Series};
use crate::Result;
use comera_model::HeadKind;
use comera_optim::rank::{rank_table, LayerRanks};
use comera_run::config::AnyRunConfig;
use comera_run::records::{
    median, read_metrics, EvalRecord, Machine, Record, TrainRecord, TrainSummary,
};
use comera_run::run_dir::RunIdentity;
use comera_run::Error;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The held-out figure a run is judged by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Score {
    /// Classification accuracy (higher is better).
    Accuracy,
    /// ROC AUC of a binary (click-through) task (higher is better).
    Auc,
    /// Masked-LM loss on held-out text (lower is better).
    MlmLoss,
}

impl Score {
    pub fn label(self) -> &'static str {
        match self {
            Score::Accuracy => "accuracy",
            Score::Auc => "AUC",
            Score::MlmLoss => "held-out MLM loss",
        }
    }

    fn of(self, e: &EvalRecord) -> f64 {
        match self {
            Score::Accuracy => e.valid_accuracy,
            Score::Auc => e.valid_auc.unwrap_or(f64::NAN),
            Score::MlmLoss => e.valid_loss,
        }
    }

    /// The better of two scores.
    fn better(self, a: f64, b: f64) -> f64 {
        match self {
            Score::MlmLoss => a.min(b),
            Score::Accuracy | Score::Auc => a.max(b),
        }
    }
}

/// One run directory, read back and verified.
#[derive(Clone, Debug)]
pub struct RunResults {
    /// The name it has in the tables (the directory's name unless given).
    pub name: String,
    pub dir: PathBuf,
    pub config: AnyRunConfig,
    /// `report.json`: present once the run has ended or was stopped.
    pub summary: Option<TrainSummary>,
    pub records: Vec<Record>,
}

impl RunResults {
    /// Reads the run in `dir`; errors name the file that is missing or damaged.
    pub fn read(dir: &Path, name: Option<&str>) -> Result<RunResults> {
        let identity = RunIdentity::read(dir)?;
        let text = identity.verified_config(dir)?;
        let config = AnyRunConfig::from_toml(&dir.join("config.toml"), &text)?;
        let records = read_metrics(&dir.join("metrics.jsonl"))?;
        let report = dir.join("report.json");
        let summary = match comera_data::read_regular_to_string(&report) {
            Ok(text) => Some(serde_json::from_str(&text).map_err(|e| Error::Parse {
                path: report.clone(),
                source: format!("not a run report: {e}").into(),
            })?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(Error::io(&report, "cannot read", e).into()),
        };
        let name = name.map(str::to_string).unwrap_or_else(|| {
            dir.file_name()
                .map_or(dir.display().to_string(), |n| n.to_string_lossy().into())
        });
        Ok(RunResults {
            name,
            dir: dir.to_path_buf(),
            config,
            summary,
            records,
        })
    }

    /// The figures of the tables.
    pub fn figures(&self) -> RunFigures {
        let score = self.score();
        let (per_epoch, epoch_seconds) = self.epoch_ends(score);
        let trains: Vec<&TrainRecord> = self
            .records
            .iter()
            .filter_map(|r| match r {
                Record::Train(t) => Some(t),
                _ => None,
            })
            .collect();
        let (params, dense_params) = match (&self.summary, trains.last()) {
            (Some(s), _) => (s.params, s.dense_params),
            (None, Some(t)) => (t.params, (t.params as f64 * t.compression).round() as usize),
            (None, None) => (0, 0),
        };
        let RankPoints {
            start,
            switch,
            end,
            switch_step,
        } = self.rank_points();
        // Dense parameters of the TT/TTM layers (the same at every point).
        let tt_dense: f64 = [Some(&start), switch.as_ref(), Some(&end)]
            .into_iter()
            .flatten()
            .find(|r| !r.is_empty())
            .map_or(0.0, |r| r.iter().map(|l| l.dense as f64).sum());
        let size = |ranks: &[LayerRanks]| -> Option<f64> {
            (!ranks.is_empty()).then(|| ranks.iter().map(|l| l.size).sum())
        };
        // The size now of a run without a truncation yet: its last logged S.
        let size_end = size(&end).or_else(|| trains.last().and_then(|t| t.size));
        let has_tt = tt_dense > 0.0 || trains.iter().any(|t| t.size.is_some());
        let tt_compression = |s: Option<f64>| s.map(|s| tt_dense / s.max(1.0));
        RunFigures {
            name: self.name.clone(),
            dir: self.dir.clone(),
            arm: self.arm(has_tt, &trains),
            state: match &self.summary {
                Some(s) if !s.stopped => RunState::Ended,
                Some(_) => RunState::Stopped,
                None => RunState::Running,
            },
            epochs_planned: self.config.epochs(),
            score,
            per_epoch: per_epoch.clone(),
            final_score: per_epoch.last().map(|p| p.1),
            best_score: per_epoch
                .iter()
                .map(|p| p.1)
                .reduce(|a, b| score.better(a, b)),
            steps: trains.last().map_or(0, |t| t.step),
            params,
            dense_params,
            tt_dense,
            tt_compression_start: tt_compression(size(&start)),
            tt_compression_switch: tt_compression(switch.as_deref().and_then(size)),
            tt_compression_end: tt_compression(size_end),
            switch_step,
            phase_seconds: self.phase_seconds(&epoch_seconds),
            epoch_seconds,
            peak_rss_bytes: self.peak_rss_bytes(),
            median_step_ms: self.summary.as_ref().map(|s| s.median_step_ms),
            examples_per_s: self.summary.as_ref().map(|s| s.examples_per_s),
            machine: self.summary.as_ref().map(|s| s.machine.clone()),
            tt_compression_series: trains
                .iter()
                .filter_map(|t| Some((t.step as f64, tt_dense / t.size?.max(1.0))))
                .filter(|_| tt_dense > 0.0)
                .collect(),
            compression_series: trains
                .iter()
                .map(|t| (t.step as f64, t.compression))
                .collect(),
            ranks: [
                ("start", start),
                ("switch", switch.unwrap_or_default()),
                ("end", end),
            ]
            .into_iter()
            .filter(|(_, r)| !r.is_empty())
            .map(|(t, r)| (t.to_string(), r))
            .collect(),
            data: match &self.config {
                AnyRunConfig::Encoder(c) => serde_json::to_string(&c.data),
                AnyRunConfig::Dlrm(c) => serde_json::to_string(&c.data),
            }
            .unwrap_or_default(),
        }
    }

    /// The held-out figure the run is judged by: a masked-LM's loss, a click model's AUC,
    /// else accuracy.
    fn score(&self) -> Score {
        match &self.config {
            AnyRunConfig::Encoder(c) if c.model.head == HeadKind::Mlm => Score::MlmLoss,
            _ if self.evals().any(|e| e.valid_auc.is_some()) => Score::Auc,
            _ => Score::Accuracy,
        }
    }

    /// At the end of each epoch done, the score and the seconds the epoch took (training and
    /// evaluation).
    fn epoch_ends(&self, score: Score) -> (Vec<(usize, f64)>, Vec<f64>) {
        // The last evaluation of each epoch (a run may evaluate inside an epoch too).
        let mut by_epoch: BTreeMap<usize, &EvalRecord> = BTreeMap::new();
        for e in self.evals() {
            by_epoch.insert(e.epoch, e);
        }
        let per_epoch: Vec<(usize, f64)> =
            by_epoch.iter().map(|(&k, e)| (k, score.of(e))).collect();
        let mut epoch_seconds = Vec::new();
        let mut before = 0.0;
        for e in by_epoch.values() {
            epoch_seconds.push(e.seconds - before);
            before = e.seconds;
        }
        (per_epoch, epoch_seconds)
    }

    /// The per-layer ranks at the start, the switch and the end: from `report.json` once the
    /// run has one, else the latest records (a run not ended yet).
    fn rank_points(&self) -> RankPoints {
        let (mut start, mut switch, mut end) = (Vec::new(), None, Vec::new());
        let mut switch_step = None;
        for r in &self.records {
            match r {
                Record::Ranks(k) => {
                    start = k.start.clone();
                    switch = k.switch.clone();
                    end = k.end.clone();
                }
                Record::Stage(s) if s.stage == "late" => {
                    switch_step = Some(s.step);
                    switch = Some(s.ranks.clone());
                }
                Record::Truncate(t) => end = t.ranks.clone(),
                _ => {}
            }
        }
        if let Some(s) = &self.summary {
            start = s.ranks_start.clone();
            switch = s.ranks_switch.clone().or(switch);
            end = s.ranks_end.clone();
        }
        RankPoints {
            start,
            switch,
            end,
            switch_step,
        }
    }

    /// What was trained (`has_tt`: the model has TT/TTM layers).
    fn arm(&self, has_tt: bool, trains: &[&TrainRecord]) -> String {
        let rank_adaptive = self
            .summary
            .as_ref()
            .map_or(trains.iter().any(|t| t.branch.is_some()), |s| s.rank_active);
        let galore = matches!(&self.config, AnyRunConfig::Encoder(c) if c.galore.is_some());
        let distilled = matches!(&self.config, AnyRunConfig::Encoder(c)
            if c.distill.as_ref().is_some_and(|d| d.teacher.is_some()));
        let arm = match (has_tt, rank_adaptive, galore) {
            (true, true, _) => "CoMERA: TT/TTM, rank-adaptive",
            (true, false, _) => "TT/TTM, fixed ranks",
            (false, _, true) => "dense, GaLore",
            (false, _, false) => "dense",
        };
        if distilled {
            format!("{arm}, distilled")
        } else {
            arm.to_string()
        }
    }

    /// The largest resident set any sitting reported.
    fn peak_rss_bytes(&self) -> u64 {
        self.evals()
            .filter_map(|e| e.peak_rss_bytes)
            .chain(self.summary.as_ref().map(|s| s.peak_rss_bytes))
            .max()
            .unwrap_or(0)
    }

    /// Of a run in phases, each phase's time from the seconds of the epochs done.
    fn phase_seconds(&self, epoch_seconds: &[f64]) -> Vec<PhaseTime> {
        match &self.config {
            AnyRunConfig::Encoder(c) if c.train.phases.len() > 1 => {
                let mut done = epoch_seconds.iter();
                c.phases()
                    .iter()
                    .map(|p| {
                        let secs: Vec<f64> = done.by_ref().take(p.epochs).copied().collect();
                        PhaseTime {
                            seq_len: p.seq_len,
                            batch_size: p.batch_size,
                            epochs: secs.len(),
                            seconds: secs.iter().sum(),
                        }
                    })
                    .collect()
            }
            _ => Vec::new(),
        }
    }

    fn evals(&self) -> impl Iterator<Item = &EvalRecord> {
        self.records.iter().filter_map(|r| match r {
            Record::Eval(e) => Some(e),
            _ => None,
        })
    }
}

/// A run's per-layer ranks at the start, at the switch to the late stage (and its step) and at
/// the end, those known.
struct RankPoints {
    start: Vec<LayerRanks>,
    switch: Option<Vec<LayerRanks>>,
    end: Vec<LayerRanks>,
    switch_step: Option<u64>,
}

/// Where a run is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    Ended,
    /// Stopped with a checkpoint (`comera train --resume` continues it).
    Stopped,
    /// No report yet: running, or killed (it resumes from its last checkpoint).
    Running,
}

/// One phase of a run's time.
#[derive(Clone, Debug, Serialize)]
pub struct PhaseTime {
    pub seq_len: usize,
    pub batch_size: usize,
    pub epochs: usize,
    pub seconds: f64,
}

/// A run's figures, as the tables show them (module docs for the definitions).
#[derive(Clone, Debug, Serialize)]
pub struct RunFigures {
    pub name: String,
    pub dir: PathBuf,
    /// What was trained: dense, GaLore, TT/TTM with fixed ranks, or CoMERA (rank-adaptive).
    pub arm: String,
    pub state: RunState,
    pub epochs_planned: usize,
    pub score: Score,
    /// The held-out score at the end of each epoch done.
    pub per_epoch: Vec<(usize, f64)>,
    pub final_score: Option<f64>,
    pub best_score: Option<f64>,
    pub steps: u64,
    pub params: usize,
    pub dense_params: usize,
    /// Dense parameters of the TT/TTM layers (0: a dense model).
    pub tt_dense: f64,
    pub tt_compression_start: Option<f64>,
    pub tt_compression_switch: Option<f64>,
    pub tt_compression_end: Option<f64>,
    /// The step the late stage began at.
    pub switch_step: Option<u64>,
    pub epoch_seconds: Vec<f64>,
    pub peak_rss_bytes: u64,
    pub median_step_ms: Option<f64>,
    pub examples_per_s: Option<f64>,
    pub machine: Option<Machine>,
    /// (step, TT/TTM compression) and (step, whole-model compression) at each logging window.
    pub tt_compression_series: Vec<(f64, f64)>,
    pub compression_series: Vec<(f64, f64)>,
    /// Per-layer ranks at the start, the switch and the end (those known).
    pub ranks: Vec<(String, Vec<LayerRanks>)>,
    /// Of a run in phases (`[[train.phases]]`): per phase its sequence length, batch size,
    /// epochs done and their seconds (training and evaluation).
    pub phase_seconds: Vec<PhaseTime>,
    /// The run's `[data]` section (as JSON): runs are compared with a dense run on the same
    /// data.
    #[serde(skip)]
    pub data: String,
}

impl RunFigures {
    pub fn compression(&self) -> Option<f64> {
        (self.params > 0).then(|| self.dense_params as f64 / self.params as f64)
    }

    /// The median time per epoch, seconds.
    pub fn median_epoch_seconds(&self) -> Option<f64> {
        let mut v = self.epoch_seconds.clone();
        (!v.is_empty()).then(|| median(&mut v))
    }
}

/// The paper's figures a table stands beside (SPEC §5; measured on GPUs, not here).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PaperTable {
    /// The six-encoder transformer on MNLI.
    SixEncoder,
    /// DLRM on Criteo with TTM tables.
    Dlrm,
    /// CodeBERT-large pre-training on CodeSearchNet.
    Pretrain,
}

impl PaperTable {
    pub const NAMES: [&'static str; 3] = ["six-encoder", "dlrm", "pretrain"];

    pub fn parse(name: &str) -> Option<PaperTable> {
        match name {
            "six-encoder" => Some(PaperTable::SixEncoder),
            "dlrm" => Some(PaperTable::Dlrm),
            "pretrain" => Some(PaperTable::Pretrain),
            _ => None,
        }
    }

    /// (figure, the paper's value) rows.
    pub fn rows(self) -> &'static [(&'static str, &'static str)] {
        match self {
            PaperTable::SixEncoder => &[
                ("model", "6 encoders, d_model 768, 12 heads, FFN 3072, seq 128, TT rank 30, TTM rank 32; MNLI, batch 32"),
                ("TT/TTM compression after the early stage", "43×"),
                ("TT/TTM compression after the late stage", "up to 361× (per layer); whole model 256 MB → 3.2 MB, ~80×"),
                ("accuracy", "similar to dense training"),
                ("time per epoch", "dense training 2–3× slower than CoMERA"),
                ("memory", "GaLore 9× more than CoMERA at batch 1, and 2× slower"),
                ("hardware", "RTX 3090 GPU (CUDA graphs)"),
            ],
            PaperTable::Dlrm => &[
                ("model", "DLRM on Criteo, TTM embedding tables"),
                ("whole-model compression", "99×"),
                ("peak memory", "7× lower than dense"),
                ("accuracy", "similar to dense"),
                ("hardware", "GPU"),
            ],
            PaperTable::Pretrain => &[
                ("model", "CodeBERT-large (357M) pre-training on CodeSearchNet"),
                ("compression", "4.23×"),
                ("speed", "1.9–2.3× faster than dense pre-training"),
                ("hardware", "GPU"),
            ],
        }
    }
}

/// What [`write_report`] is asked for.
#[derive(Clone, Debug, Default)]
pub struct ReportOptions {
    /// The page's title.
    pub title: String,
    /// The arm every run's time and memory ratios are taken against (by name); by default
    /// each run's is the first dense arm (without GaLore) trained on the same data, and a run
    /// without one has no ratios.
    pub baseline: Option<String>,
    /// The paper's figures to stand beside the tables.
    pub paper: Option<PaperTable>,
    /// The commands that made the runs (shown on the page as they are given).
    pub commands: Vec<String>,
}

/// The files [`write_report`] wrote.
#[derive(Clone, Debug)]
pub struct ReportFiles {
    pub markdown: PathBuf,
    pub json: PathBuf,
    pub plots: Vec<PathBuf>,
}

/// The files of a report page ([`write_report`] writes these and nothing else).
pub const REPORT_FILES: &[&str] = &[
    "report.md",
    "report.json",
    "score.png",
    "compression.png",
    "cost.png",
];

/// Whether `dir` holds a page [`write_report`] wrote: its files and nothing else, with a
/// `report.json` that is a list of run figures (each with a `name` and an `arm`).
pub fn is_report_dir(dir: &Path) -> bool {
    let names_ok = comera_run::outputs::entry_names(dir)
        .is_ok_and(|names| names.iter().all(|n| REPORT_FILES.contains(&n.as_str())));
    names_ok
        && comera_data::read_regular_to_string(&dir.join("report.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v.as_array().cloned())
            .is_some_and(|runs| {
                runs.iter()
                    .all(|r| r.get("name").is_some() && r.get("arm").is_some())
            })
}

/// Writes the page for `runs` into the directory `out` as one unit: `report.md`,
/// `report.json` (every run's [`RunFigures`]) and the plots are written into a fresh
/// directory beside it, which then takes `out`'s place ([`comera_run::files::replace_dir_atomic`]).
/// `out` must be absent or empty, or with `overwrite` an earlier page; never a run directory
/// or inside one, nor a link ([`comera_run::outputs::check_output_dir`]). The returned paths are
/// under `out`.
pub fn write_report(
    runs: &[RunResults],
    out: &Path,
    overwrite: bool,
    opts: &ReportOptions,
) -> Result<ReportFiles> {
    if runs.is_empty() {
        return Err(Error::run("a report needs at least one run directory").into());
    }
    let figures: Vec<RunFigures> = runs.iter().map(RunResults::figures).collect();
    let baselines = baselines(&figures, opts)?;
    comera_run::outputs::check_output_dir(out, "--out", overwrite, is_report_dir)?;
    let [markdown_name, json_name, plot_names @ ..] = REPORT_FILES else {
        unreachable!("REPORT_FILES names the page, its figures and three plots")
    };
    comera_run::files::replace_dir_atomic(out, |dir: &Path| -> Result<()> {
        let plots: Vec<PathBuf> = plot_names.iter().map(|n| dir.join(n)).collect();
        draw(&figures, &plots)?;
        let md = markdown(&figures, &baselines, opts, &plots);
        comera_run::files::write_atomic(&dir.join(markdown_name), md.as_bytes())?;
        let json = serde_json::to_string_pretty(&figures)?;
        comera_run::files::write_atomic(&dir.join(json_name), json.as_bytes())?;
        Ok(())
    })?;
    Ok(ReportFiles {
        markdown: out.join(markdown_name),
        json: out.join(json_name),
        plots: plot_names.iter().map(|n| out.join(n)).collect(),
    })
}

/// Each run's baseline for the ratios: the run named by `--baseline`, else the first dense
/// run on the same data (none where there is none).
fn baselines(figures: &[RunFigures], opts: &ReportOptions) -> Result<Vec<Option<usize>>> {
    Ok(match &opts.baseline {
        Some(name) => {
            let b = figures
                .iter()
                .position(|f| &f.name == name)
                .ok_or_else(|| {
                    Error::run(format!(
                        "--baseline: no run is named `{name}` (the runs: {})",
                        names(figures)
                    ))
                })?;
            vec![Some(b); figures.len()]
        }
        None => figures
            .iter()
            .map(|f| {
                figures
                    .iter()
                    .position(|g| g.arm == "dense" && g.data == f.data)
            })
            .collect(),
    })
}

fn names(figures: &[RunFigures]) -> String {
    figures
        .iter()
        .map(|f| f.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.filter(|v| v.is_finite()).map_or("–".into(), f)
}

/// The page (module docs for what is on it), one section after the other.
fn markdown(
    figures: &[RunFigures],
    baselines: &[Option<usize>],
    opts: &ReportOptions,
    plots: &[PathBuf],
) -> String {
    let mut s = String::new();
    heading(&mut s, figures, &opts.title);
    arms(&mut s, figures, baselines);
    ratios_note(&mut s, figures, baselines, opts.baseline.is_some());
    phase_times(&mut s, figures);
    scores_per_epoch(&mut s, figures);
    rank_tables(&mut s, figures);
    if let Some(p) = opts.paper {
        paper_figures(&mut s, p);
    }
    plot_links(&mut s, plots);
    commands(&mut s, &opts.commands);
    run_list(&mut s, figures);
    s
}

/// The title, the machines measured on, and the runs not ended.
fn heading(s: &mut String, figures: &[RunFigures], title: &str) {
    let title = if title.is_empty() {
        "Runs side by side"
    } else {
        title
    };
    let _ = writeln!(s, "# {title}\n");
    let mut machines: Vec<String> = figures
        .iter()
        .filter_map(|f| f.machine.as_ref())
        .filter(|m| !m.cpu.is_empty())
        .map(|m| match &m.gpu {
            Some(gpu) => format!("{gpu}, host {} ({} threads)", m.cpu, m.threads),
            None => format!("{} ({} threads)", m.cpu, m.threads),
        })
        .collect();
    machines.dedup();
    if !machines.is_empty() {
        let _ = writeln!(s, "Measured on: {}.\n", machines.join("; "));
    }
    let unfinished: Vec<&str> = figures
        .iter()
        .filter(|f| f.state != RunState::Ended)
        .map(|f| f.name.as_str())
        .collect();
    if !unfinished.is_empty() {
        let _ = writeln!(
            s,
            "**Not ended** (figures so far; `comera train --resume DIR` continues them): {}.\n",
            unfinished.join(", ")
        );
    }
}

/// The arms' table: one row per run.
fn arms(s: &mut String, figures: &[RunFigures], baselines: &[Option<usize>]) {
    let _ = writeln!(
        s,
        "| run | arm | epochs | held-out | final | best | params | whole-model compression | TT/TTM compression: start → switch → end | time per epoch (median) | time vs baseline | peak memory | memory vs baseline | samples/s |",
    );
    let _ = writeln!(s, "|{}", "---|".repeat(14));
    for (f, base) in figures.iter().zip(baselines) {
        arm_row(s, f, base.map(|b| &figures[b]));
    }
}

/// One run's row of the arms' table, its ratios against `base`.
fn arm_row(s: &mut String, f: &RunFigures, base: Option<&RunFigures>) {
    let time = f.median_epoch_seconds();
    let base_time = base.and_then(RunFigures::median_epoch_seconds);
    let tt = if f.tt_dense > 0.0 {
        [
            f.tt_compression_start,
            f.tt_compression_switch,
            f.tt_compression_end,
        ]
        .iter()
        .map(|c| opt(*c, |c| format!("{c:.1}×")))
        .collect::<Vec<_>>()
        .join(" → ")
    } else {
        "–".into()
    };
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let _ = writeln!(
        s,
        "| {}{} | {} | {}/{} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
        f.name,
        match f.state {
            RunState::Ended => "",
            RunState::Stopped => " (stopped)",
            RunState::Running => " (not ended)",
        },
        f.arm,
        f.per_epoch.len(),
        f.epochs_planned,
        f.score.label(),
        opt(f.final_score, |v| format!("{v:.4}")),
        opt(f.best_score, |v| format!("{v:.4}")),
        f.params,
        opt(f.compression(), |c| format!("{c:.1}×")),
        tt,
        opt(time, |t| if t < 10.0 {
            format!("{t:.1} s")
        } else {
            format!("{t:.0} s")
        }),
        opt(time.zip(base_time).map(|(t, b)| t / b), |r| format!(
            "{r:.2}×"
        )),
        if f.peak_rss_bytes > 0 {
            format!("{:.0} MiB", mib(f.peak_rss_bytes))
        } else {
            "–".into()
        },
        match base.map(|b| b.peak_rss_bytes) {
            Some(b) if b > 0 && f.peak_rss_bytes > 0 =>
                format!("{:.2}×", f.peak_rss_bytes as f64 / b as f64),
            _ => "–".into(),
        },
        opt(f.examples_per_s, |v| format!("{v:.1}")),
    );
}

/// What the arms' figures are, and which run each run's ratios are taken against
/// (`given`: named by `--baseline`).
fn ratios_note(s: &mut String, figures: &[RunFigures], baselines: &[Option<usize>], given: bool) {
    let pairs: Vec<String> = figures
        .iter()
        .zip(baselines)
        .filter_map(|(f, b)| Some(format!("{} → {}", f.name, figures[(*b)?].name)))
        .collect();
    let _ = writeln!(
        s,
        "\nTime is training and evaluation per epoch, the median over epochs; memory is the peak resident set of the process; samples/s from the median step. Ratios are each run's figure divided by its baseline's ({}: {}).",
        if given {
            "given"
        } else {
            "the dense run on the same data"
        },
        if pairs.is_empty() {
            "none".to_string()
        } else {
            pairs.join(", ")
        }
    );
}

/// Time per phase, for runs in phases.
fn phase_times(s: &mut String, figures: &[RunFigures]) {
    if figures.iter().all(|f| f.phase_seconds.is_empty()) {
        return;
    }
    let _ = writeln!(
        s,
        "\n## Time per phase\n\nTraining and evaluation, summed over the phase's epochs done.\n\n| run | phase | sequence × batch | epochs | seconds | s per epoch |\n|---|---|---|---|---|---|"
    );
    for f in figures {
        for (i, p) in f.phase_seconds.iter().enumerate() {
            let _ = writeln!(
                s,
                "| {} | {} | {} × {} | {} | {:.0} | {} |",
                f.name,
                i + 1,
                p.seq_len,
                p.batch_size,
                p.epochs,
                p.seconds,
                opt(
                    (p.epochs > 0).then(|| p.seconds / p.epochs as f64),
                    |v| format!("{v:.1}")
                ),
            );
        }
    }
}

/// The held-out score after each epoch, a column per run.
fn scores_per_epoch(s: &mut String, figures: &[RunFigures]) {
    let epochs = figures.iter().map(|f| f.per_epoch.len()).max().unwrap_or(0);
    if epochs == 0 {
        return;
    }
    let _ = writeln!(
        s,
        "\n## Held-out score after each epoch\n\nEach run's own: {}.\n\n| epoch | {} |\n|---|{}",
        figures
            .iter()
            .map(|f| format!("{} {}", f.name, f.score.label()))
            .collect::<Vec<_>>()
            .join(", "),
        figures
            .iter()
            .map(|f| f.name.as_str())
            .collect::<Vec<_>>()
            .join(" | "),
        "---|".repeat(figures.len())
    );
    for e in 1..=epochs {
        let cells: Vec<String> = figures
            .iter()
            .map(|f| {
                f.per_epoch
                    .iter()
                    .find(|p| p.0 == e)
                    .map_or("–".into(), |p| format!("{:.4}", p.1))
            })
            .collect();
        let _ = writeln!(s, "| {e} | {} |", cells.join(" | "));
    }
}

/// Each rank-adaptive run's per-layer ranks at the points known (more than one).
fn rank_tables(s: &mut String, figures: &[RunFigures]) {
    for f in figures.iter().filter(|f| f.ranks.len() > 1) {
        let points: Vec<(&str, &[LayerRanks])> = f
            .ranks
            .iter()
            .map(|(t, r)| (t.as_str(), r.as_slice()))
            .collect();
        let switch = f
            .switch_step
            .map_or(String::new(), |s| format!(" (late stage from step {s})"));
        let _ = writeln!(
            s,
            "\n## Ranks of {}{switch}\n\n{}",
            f.name,
            rank_table(&points)
        );
    }
}

/// The paper's own figures for the table, labelled as such.
fn paper_figures(s: &mut String, paper: PaperTable) {
    let _ = writeln!(
        s,
        "\n## The paper's figures (GPU; not measured here)\n\n| figure | paper |\n|---|---|"
    );
    for (k, v) in paper.rows() {
        let _ = writeln!(s, "| {k} | {v} |");
    }
}

/// The plots, by their file names beside the page.
fn plot_links(s: &mut String, plots: &[PathBuf]) {
    let _ = writeln!(s, "\n## Plots\n");
    for p in plots {
        let name = p.file_name().map_or("".into(), |n| n.to_string_lossy());
        let _ = writeln!(s, "![{name}]({name})");
    }
}

/// The commands that made the runs, as given (nothing without them).
fn commands(s: &mut String, commands: &[String]) {
    if commands.is_empty() {
        return;
    }
    let _ = writeln!(s, "\n## Commands\n\n```sh");
    for c in commands {
        let _ = writeln!(s, "{c}");
    }
    let _ = writeln!(s, "```");
}

/// Each run's directory and steps.
fn run_list(s: &mut String, figures: &[RunFigures]) {
    let _ = writeln!(s, "\n## Runs\n");
    for f in figures {
        let _ = writeln!(s, "- {}: `{}`, {} steps", f.name, f.dir.display(), f.steps);
    }
}

/// The three figures (module docs).
fn draw(figures: &[RunFigures], paths: &[PathBuf]) -> Result<()> {
    // One panel per kind of score (a pre-training table has MLM losses and accuracies).
    let mut scores: Vec<Score> = Vec::new();
    for f in figures {
        if !scores.contains(&f.score) {
            scores.push(f.score);
        }
    }
    let per_epoch: Vec<Panel> = scores
        .iter()
        .map(|&score| Panel {
            title: format!("held-out {} per epoch", score.label()),
            x_label: "epoch".into(),
            y_label: score.label().into(),
            series: figures
                .iter()
                .filter(|f| f.score == score)
                .map(|f| {
                    Series::new(
                        f.name.clone(),
                        f.per_epoch.iter().map(|&(e, v)| (e as f64, v)).collect(),
                    )
                })
                .collect(),
            ..Panel::default()
        })
        .collect();
    plot_panels(&paths[0], &per_epoch, 900, 420)?;
    let marks: Vec<(f64, String)> = figures
        .iter()
        .filter_map(|f| Some((f.switch_step? as f64, format!("late: {}", f.name))))
        .collect();
    let tt = Panel {
        title: "TT/TTM layers: compression vs their dense equivalent".into(),
        x_label: "step".into(),
        y_label: "compression (×)".into(),
        series: figures
            .iter()
            .filter(|f| !f.tt_compression_series.is_empty())
            .map(|f| Series::new(f.name.clone(), f.tt_compression_series.clone()))
            .collect(),
        log_y: true,
        marks: marks.clone(),
        ..Panel::default()
    };
    let whole = Panel {
        title: "whole model: compression vs the dense model".into(),
        x_label: "step".into(),
        y_label: "compression (×)".into(),
        series: figures
            .iter()
            .map(|f| Series::new(f.name.clone(), f.compression_series.clone()))
            .collect(),
        log_y: true,
        marks,
        ..Panel::default()
    };
    plot_panels(&paths[1], &[tt, whole], 900, 420)?;
    let x_names: Vec<String> = figures.iter().map(|f| f.name.clone()).collect();
    let bars = |title: &str, y: &str, v: &dyn Fn(&RunFigures) -> Option<f64>| Panel {
        title: title.into(),
        x_label: "run".into(),
        y_label: y.into(),
        series: vec![Series::new(
            "",
            figures
                .iter()
                .enumerate()
                .filter_map(|(i, f)| Some(((i + 1) as f64, v(f)?)))
                .collect(),
        )],
        bars: Some(Bars {
            width: 0.6,
            x_names: x_names.clone(),
        }),
        ..Panel::default()
    };
    plot_panels(
        &paths[2],
        &[
            bars("time per epoch (median)", "seconds", &|f| {
                f.median_epoch_seconds()
            }),
            bars("peak memory (resident set)", "MiB", &|f| {
                (f.peak_rss_bytes > 0).then(|| f.peak_rss_bytes as f64 / (1024.0 * 1024.0))
            }),
        ],
        900,
        380,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use comera_run::records::{StageRecord, TrainRecord};

    fn eval(epoch: usize, acc: f64, seconds: f64) -> Record {
        Record::Eval(EvalRecord {
            epoch,
            step: epoch as u64 * 10,
            tokens: 0,
            train_loss: 1.0,
            train_accuracy: 0.5,
            valid_loss: 1.0 - acc,
            valid_accuracy: acc,
            valid_perplexity: 1.0,
            valid_auc: None,
            valid_macro_f1: None,
            seconds,
            peak_rss_bytes: Some(1000 * epoch as u64),
        })
    }

    fn train(step: u64, size: f64) -> Record {
        Record::Train(TrainRecord {
            epoch: 1,
            step,
            tokens: 0,
            loss: 1.0,
            accuracy: 0.5,
            lr_scale: 1.0,
            grad_norm: 1.0,
            tokens_per_s: 1.0,
            ms_per_step: 1.0,
            params: 100,
            compression: 4.0,
            processes: None,
            allreduce_bytes_per_step: None,
            comm_ms_per_step: None,
            size: Some(size),
            size_l1: Some(size),
            branch: Some("early".into()),
            mean_ranks: None,
            loss_terms: None,
        })
    }

    fn layer(size: f64) -> LayerRanks {
        LayerRanks {
            name: "l".into(),
            ranks: vec![2],
            size,
            dense: 1000,
            dead: false,
        }
    }

    #[test]
    fn figures_of_a_run_in_progress_come_from_its_records() {
        let run = RunResults {
            name: "a".into(),
            dir: "a".into(),
            config: AnyRunConfig::Encoder(comera_run::config::RunConfig::builtin()),
            summary: None,
            records: vec![
                train(5, 100.0),
                eval(1, 0.6, 30.0),
                Record::Stage(StageRecord {
                    stage: "late".into(),
                    epoch: 1,
                    step: 10,
                    size: 50.0,
                    target_size: Some(10.0),
                    ranks: vec![layer(50.0)],
                }),
                train(15, 20.0),
                eval(2, 0.7, 50.0),
                eval(2, 0.65, 70.0),
            ],
        };
        let f = run.figures();
        assert_eq!(f.state, RunState::Running);
        assert_eq!(f.score, Score::Accuracy);
        // The last evaluation of each epoch.
        assert_eq!(f.per_epoch, vec![(1, 0.6), (2, 0.65)]);
        assert_eq!(f.best_score, Some(0.65));
        assert_eq!(f.epoch_seconds, vec![30.0, 40.0]);
        assert_eq!(f.median_epoch_seconds(), Some(35.0));
        assert_eq!(f.peak_rss_bytes, 2000);
        assert_eq!((f.params, f.dense_params), (100, 400));
        // TT/TTM: dense 1000 over S; the switch from the stage record, the end from the last
        // logged S (no truncation yet).
        assert_eq!(f.switch_step, Some(10));
        assert_eq!(f.tt_compression_switch, Some(20.0));
        assert_eq!(f.tt_compression_end, Some(50.0));
        assert_eq!(f.tt_compression_series, vec![(5.0, 10.0), (15.0, 50.0)]);
        assert_eq!(f.arm, "CoMERA: TT/TTM, rank-adaptive");
    }

    #[test]
    fn a_masked_lm_is_judged_by_its_lowest_loss() {
        let mut cfg = comera_run::config::RunConfig::builtin();
        cfg.model.head = HeadKind::Mlm;
        let run = RunResults {
            name: "m".into(),
            dir: "m".into(),
            config: AnyRunConfig::Encoder(cfg),
            summary: None,
            records: vec![eval(1, 0.2, 1.0), eval(2, 0.5, 2.0), eval(3, 0.4, 3.0)],
        };
        let f = run.figures();
        assert_eq!(f.score, Score::MlmLoss);
        // valid_loss = 1 − acc in `eval`: 0.8, 0.5, 0.6.
        assert_eq!(f.best_score, Some(0.5));
        assert_eq!(f.final_score, Some(0.6));
        assert_eq!(f.arm, "dense");
        assert!(f.phase_seconds.is_empty(), "one phase: no phase table");
    }

    #[test]
    fn a_run_in_phases_has_its_time_per_phase() {
        let mut cfg = comera_run::config::RunConfig::builtin();
        let phase = |seq_len, epochs| comera_run::config::Phase {
            seq_len,
            batch_size: 8,
            epochs,
            max_steps_per_epoch: None,
        };
        cfg.train.phases = vec![phase(32, 2), phase(64, 2)];
        let run = RunResults {
            name: "p".into(),
            dir: "p".into(),
            config: AnyRunConfig::Encoder(cfg),
            summary: None,
            // Three epochs done (10, 20 and 40 s), the second phase's second not yet.
            records: vec![eval(1, 0.2, 10.0), eval(2, 0.3, 30.0), eval(3, 0.4, 70.0)],
        };
        let p = run.figures().phase_seconds;
        let got: Vec<_> = p.iter().map(|p| (p.seq_len, p.epochs, p.seconds)).collect();
        assert_eq!(got, vec![(32, 2, 30.0), (64, 1, 40.0)]);
    }
}
