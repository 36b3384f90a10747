//! What a training run tells the world: typed records, events and observers.
//!
//! - [`Record`]: one type per kind of line in `metrics.jsonl` (`train`, `eval`, `early_stop`,
//!   `stage`, `truncate`, `ranks`), written and read back by the same type (`kind` names the
//!   variant), so a resumed run, a plot and a library user read them typed.
//! - [`Event`]: what the loop emits as it goes: each record, each checkpoint written, lines
//!   meant for people, and the end of the run.
//! - [`Observer`]: receives every event and answers [`Control::Continue`] or [`Control::Stop`]
//!   (the run then stops after the step, with a checkpoint, like a first Ctrl-C: resumable).
//!   The loop itself writes the metrics log and the plots; observers are for everything else
//!   (a notebook's progress, a logger, one's own early stopping). An observer must not print
//!   for the library: it is the front end's choice.
//!
//! Training a tiny run from Rust, with an observer that counts events and stops the run after
//! three steps; the run directory is then an ordinary stopped run that `resume` continues:
//!
//! ```
//! use comera_train::observe::{Control, Event, Observer, Record};
//! use comera_train::{AnyRunConfig, RunOptions};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::env::temp_dir().join(format!("comera-doc-observer-{}", std::process::id()));
//! # let _ = std::fs::remove_dir_all(&dir);
//! std::fs::create_dir_all(&dir)?;
//! // A tiny labelled data set and its vocabulary.
//! std::fs::write(dir.join("vocab.txt"), "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\ngood\nbad\nthe\ndress\n")?;
//! let mut tsv = String::from("sentence\tlabel\n");
//! for i in 0..40 {
//!     tsv += if i % 2 == 0 { "the good dress\tpos\n" } else { "the bad dress\tneg\n" };
//! }
//! std::fs::write(dir.join("train.tsv"), tsv)?;
//! let config = format!(
//!     r#"
//! [data]
//! source = "tsv"
//! train = "{d}/train.tsv"
//! text_a = "sentence"
//! label = "label"
//! labels = ["neg", "pos"]
//! vocab = "{d}/vocab.txt"
//! valid_fraction = 0.25
//! [model]
//! vocab_size = 9
//! seq_len = 8
//! d_model = 16
//! heads = 2
//! ffn = 32
//! layers = 1
//! tt_linear = true
//! ttm_embedding = false
//! attn_tt = {{ in_modes = [4, 4], out_modes = [4, 4], rank = 3 }}
//! ffn_up_tt = {{ in_modes = [4, 4], out_modes = [4, 8], rank = 3 }}
//! ffn_down_tt = {{ in_modes = [4, 8], out_modes = [4, 4], rank = 3 }}
//! [train]
//! epochs = 2
//! batch_size = 4
//! log_every = 1
//! out_dir = "{d}/run"
//! "#,
//!     d = dir.display()
//! );
//! std::fs::write(dir.join("run.toml"), config)?;
//! let AnyRunConfig::Encoder(cfg) = AnyRunConfig::from_file(&dir.join("run.toml"))? else {
//!     unreachable!("an encoder config")
//! };
//!
//! /// Counts the events and stops the run at step 3.
//! struct StopAtThree {
//!     events: usize,
//! }
//! impl Observer for StopAtThree {
//!     fn on_event(&mut self, event: &Event<'_>) -> Control {
//!         self.events += 1;
//!         match event {
//!             Event::Record(Record::Train(r)) if r.step >= 3 => Control::Stop,
//!             _ => Control::Continue,
//!         }
//!     }
//! }
//! let counter = std::sync::Arc::new(std::sync::Mutex::new(StopAtThree { events: 0 }));
//! let opts = RunOptions {
//!     observers: vec![Box::new(counter.clone())],
//!     ..RunOptions::default()
//! };
//! let summary = comera_train::train(&cfg, opts)?;
//! assert!(summary.stopped && summary.steps == 3);
//! assert!(counter.lock().unwrap().events >= 4); // three train records and a checkpoint
//! // A valid, resumable run: `resume` continues it to its end.
//! let done = comera_train::resume(&dir.join("run"))?;
//! assert!(!done.stopped && done.steps > 3);
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok(())
//! # }
//! ```

use comera_optim::rank::{LayerRanks, TruncatedLayer};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// A line of `metrics.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    Train(TrainRecord),
    Eval(EvalRecord),
    EarlyStop(EarlyStopRecord),
    Stage(StageRecord),
    Truncate(TruncateRecord),
    Ranks(RanksRecord),
}

impl Record {
    /// The step the record was written at.
    pub fn step(&self) -> u64 {
        match self {
            Record::Train(r) => r.step,
            Record::Eval(r) => r.step,
            Record::EarlyStop(r) => r.step,
            Record::Stage(r) => r.step,
            Record::Truncate(r) => r.step,
            Record::Ranks(r) => r.step,
        }
    }
}

/// A window of training steps (every `train.log_every` steps): means over the window.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainRecord {
    /// The epoch in progress (1-based).
    pub epoch: usize,
    pub step: u64,
    /// Sequence positions (or examples) seen so far.
    pub tokens: u64,
    pub loss: f64,
    pub accuracy: f64,
    /// The learning rate's factor from warm-up and decay.
    pub lr_scale: f32,
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    pub ms_per_step: f64,
    /// Trainable parameters now, and the whole model's compression vs its dense equivalent.
    pub params: usize,
    pub compression: f64,
    /// Data-parallel runs: processes, gradient bytes all-reduced per step, communication time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processes: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allreduce_bytes_per_step: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comm_ms_per_step: Option<f64>,
    /// Rank-adaptive runs: the TT/TTM size S, its L1 surrogate, the objective's branch
    /// (`early`, `late-loss`, `late-size`) and the mean active rank per layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_l1: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_ranks: Option<BTreeMap<String, f64>>,
    /// Distilled runs: the loss's terms (task cross-entropy, logit KL, hidden-state MSE, each
    /// unweighted); `loss` is their weighted sum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_terms: Option<comera_layers::LossTerms>,
}

/// An evaluation on the held-out data (each epoch's end, and every `train.eval_every` steps).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalRecord {
    pub epoch: usize,
    pub step: u64,
    pub tokens: u64,
    /// Training figures over the epoch so far.
    pub train_loss: f64,
    pub train_accuracy: f64,
    pub valid_loss: f64,
    pub valid_accuracy: f64,
    pub valid_perplexity: f64,
    /// Binary tasks (click-through): ROC AUC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub valid_auc: Option<f64>,
    /// Classifiers: the macro-averaged F1 over the classes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub valid_macro_f1: Option<f64>,
    /// Seconds of training so far (across resumes).
    pub seconds: f64,
    /// Peak resident set of this process so far (VmHWM), bytes (a resumed run: of this
    /// sitting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes: Option<u64>,
}

impl EvalRecord {
    /// The score that ranks evaluations: AUC where there is one, else accuracy.
    pub fn score(&self) -> f64 {
        self.valid_auc.unwrap_or(self.valid_accuracy)
    }
}

/// Early stopping ended the run: the watched metric did not improve on `best` in `patience`
/// evaluations.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EarlyStopRecord {
    pub epoch: usize,
    pub step: u64,
    pub metric: crate::config::StopMetric,
    /// NaN (written as null) if no evaluation gave a value.
    #[serde(deserialize_with = "f64_or_nan")]
    pub best: f64,
    pub patience: usize,
}

/// The rank schedule switched to its late stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageRecord {
    /// Always `late`.
    pub stage: String,
    pub epoch: usize,
    pub step: u64,
    /// S at the switch, and the size the late stage aims at.
    pub size: f64,
    pub target_size: Option<f64>,
    pub ranks: Vec<LayerRanks>,
}

/// Pruned rank slices were cut from the cores (and their gates and moments).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TruncateRecord {
    pub epoch: usize,
    pub step: u64,
    pub params: usize,
    pub compression: f64,
    /// Every layer's active ranks after the cut.
    pub ranks: Vec<LayerRanks>,
    /// The layers whose stored ranks changed: before and after (absent in older logs).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<TruncatedLayer>,
}

/// The ranks of every TT/TTM layer at the start, at the switch and at the end of the run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RanksRecord {
    pub step: u64,
    pub start: Vec<LayerRanks>,
    pub switch: Option<Vec<LayerRanks>>,
    pub end: Vec<LayerRanks>,
}

/// The records of a metrics log (`RUN/metrics.jsonl`), typed. A last line cut short (a run
/// killed while writing it) is left out; any other line that is not a record is an error
/// naming its line.
pub fn read_metrics(path: &Path) -> crate::Result<Vec<Record>> {
    let text = comera_data::read_regular_to_string(path)
        .map_err(|e| crate::Error::io(path, "cannot read", e))?;
    let lines: Vec<&str> = text.lines().collect();
    let mut records = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        match serde_json::from_str::<Record>(line) {
            Ok(r) => records.push(r),
            Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => {}
            Err(e) => {
                return Err(crate::Error::Parse {
                    path: path.to_path_buf(),
                    source: format!("line {}: not a metrics record: {e}", i + 1).into(),
                })
            }
        }
    }
    Ok(records)
}

/// `null` (a NaN written by serde_json) as NaN.
pub(crate) fn f64_or_nan<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// What the loop tells its observers.
#[derive(Debug)]
#[non_exhaustive]
pub enum Event<'a> {
    /// Training starts (or resumes) at `step`, of `total` steps (None: a streamed run of
    /// unknown length); `lr` is the TT cores' base learning rate (records carry its scale).
    Started {
        total: Option<u64>,
        step: u64,
        lr: f32,
    },
    /// An epoch (1-based) starts, in phase `phase` (1-based) of `phases`.
    EpochStarted {
        epoch: usize,
        phase: usize,
        phases: usize,
    },
    /// A step was taken (`step`: steps done so far).
    Step { step: u64 },
    /// A record, as written to `metrics.jsonl`.
    Record(&'a Record),
    /// A checkpoint was written after `step` (the run can be resumed from there).
    Checkpoint { step: u64, path: &'a Path },
    /// A line meant for people (a phase change, the late stage, an early stop), as the CLI
    /// shows it above its progress bar.
    Message(&'a str),
    /// No more steps: what follows is the run's final report.
    TrainingEnded,
    /// The run ended (finished, stopped or stopped early); the summary is also what the call
    /// returns.
    Finished(&'a crate::TrainSummary),
}

/// An observer's answer to an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Continue,
    /// Stop after the current step, with a checkpoint (the run is resumable).
    Stop,
}

/// Receives the events of a run ([`crate::RunOptions::observers`]).
pub trait Observer: Send {
    fn on_event(&mut self, event: &Event<'_>) -> Control;
}

/// An observer shared with its owner (to read what it gathered after the run).
impl<O: Observer> Observer for std::sync::Arc<std::sync::Mutex<O>> {
    fn on_event(&mut self, event: &Event<'_>) -> Control {
        match self.lock() {
            Ok(mut o) => o.on_event(event),
            Err(poisoned) => poisoned.into_inner().on_event(event),
        }
    }
}

/// A closure as an observer.
impl<F: FnMut(&Event<'_>) -> Control + Send> Observer for F {
    fn on_event(&mut self, event: &Event<'_>) -> Control {
        self(event)
    }
}
