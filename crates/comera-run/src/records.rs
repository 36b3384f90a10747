//! What a run records about itself, typed: the lines of `metrics.jsonl` ([`Record`], read back
//! by [`read_metrics`]), held-out figures ([`EvalStats`], a classifier's [`ClassReport`]) and
//! `report.json` ([`TrainSummary`], the [`Machine`] its times were measured on). The loop
//! writes them, and a resumed run, a plot, a report and a library user read them back by the
//! same types.

use comera_optim::rank::{LayerRanks, TruncatedLayer};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

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
    pub metric: StopMetric,
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

/// The validation figure early stopping watches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopMetric {
    #[default]
    ValidLoss,
    ValidAccuracy,
    ValidAuc,
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
fn f64_or_nan<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// A classifier's held-out figures per class, from its confusion matrix.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClassReport {
    /// The classes' names, in label order (empty where the evaluation did not know them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub labels: Vec<String>,
    /// `confusion[t][p]`: examples of true class t predicted as p.
    pub confusion: Vec<Vec<u64>>,
    /// Per class (in label order): precision, recall, F1 and support (its true examples).
    pub per_class: Vec<ClassScores>,
    /// The unweighted mean of the classes' F1.
    pub macro_f1: f64,
    /// The accuracy of always predicting the most frequent class (the baseline to beat).
    pub majority: f64,
    /// Every prediction is the same class (the model collapsed to one answer).
    pub collapsed: bool,
}

/// One class's precision, recall and F1 (0 where undefined: no prediction of it, or no
/// example of it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClassScores {
    pub precision: f64,
    pub recall: f64,
    pub f1: f64,
    pub support: u64,
}

impl ClassReport {
    /// The report as text for people: per class precision, recall, F1 and support, macro-F1,
    /// the majority baseline, the confusion matrix (rows: true class), and a warning when the
    /// predictions collapsed to one class.
    pub fn table(&self, accuracy: f64) -> String {
        let name = |k: usize| {
            self.labels
                .get(k)
                .cloned()
                .unwrap_or_else(|| format!("class {k}"))
        };
        let w = (0..self.per_class.len())
            .map(|k| name(k).chars().count())
            .max()
            .unwrap_or(5)
            .max(5);
        let mut out = format!("{:<w$}  precision  recall      f1  support\n", "class");
        for (k, s) in self.per_class.iter().enumerate() {
            out += &format!(
                "{:<w$}  {:>9.4}  {:>6.4}  {:>6.4}  {:>7}\n",
                name(k),
                s.precision,
                s.recall,
                s.f1,
                s.support
            );
        }
        out += &format!(
            "macro-F1 {:.4}; accuracy {accuracy:.4} against {:.4} for always the majority class\n",
            self.macro_f1, self.majority
        );
        if self.confusion.is_empty() && !self.per_class.is_empty() {
            out += &format!(
                "confusion matrix not kept: {} classes (it is kept for at most {})",
                self.per_class.len(),
                ClassReport::CONFUSION_MAX_CLASSES
            );
        } else {
            out += &format!(
                "confusion (rows: true class, columns: predicted)\n{:<w$}",
                ""
            );
            for k in 0..self.confusion.len() {
                out += &format!("  {:>8}", name(k));
            }
            for (k, row) in self.confusion.iter().enumerate() {
                out += &format!("\n{:<w$}", name(k));
                for v in row {
                    out += &format!("  {v:>8}");
                }
            }
        }
        if self.collapsed {
            out += "\nwarning: every example is predicted as one class: the model has collapsed to one answer";
        }
        out
    }

    /// The most classes whose confusion matrix is kept (and shown): its c² cells would
    /// outgrow memory and any screen for large label sets, whose per-class figures come from
    /// [`ClassCounts`] alone.
    pub const CONFUSION_MAX_CLASSES: usize = 100;

    /// The report of a confusion matrix (`c × c`, true × predicted).
    pub fn from_confusion(confusion: Vec<Vec<u64>>) -> ClassReport {
        let c = confusion.len();
        let mut counts = ClassCounts::new(c);
        for (t, row) in confusion.iter().enumerate() {
            for (p, &n) in row.iter().enumerate() {
                counts.support[t] += n;
                counts.predicted[p] += n;
            }
            counts.correct[t] = row[t];
        }
        ClassReport::from_counts(&counts, confusion)
    }

    /// The report of per-class counts, with `confusion` (`c × c`, or empty where it was not
    /// kept) as it is.
    pub fn from_counts(counts: &ClassCounts, confusion: Vec<Vec<u64>>) -> ClassReport {
        let c = counts.support.len();
        let total: u64 = counts.support.iter().sum();
        let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        let per_class: Vec<ClassScores> = (0..c)
            .map(|k| {
                let (tp, support) = (counts.correct[k], counts.support[k]);
                let precision = ratio(tp, counts.predicted[k]);
                let recall = ratio(tp, support);
                let f1 = if precision + recall > 0.0 {
                    2.0 * precision * recall / (precision + recall)
                } else {
                    0.0
                };
                ClassScores {
                    precision,
                    recall,
                    f1,
                    support,
                }
            })
            .collect();
        let macro_f1 = per_class.iter().map(|s| s.f1).sum::<f64>() / c.max(1) as f64;
        let majority = ratio(
            per_class.iter().map(|s| s.support).max().unwrap_or(0),
            total,
        );
        let collapsed =
            c > 1 && total > 0 && counts.predicted.iter().filter(|&&n| n > 0).count() == 1;
        ClassReport {
            labels: Vec::new(),
            confusion,
            per_class,
            macro_f1,
            majority,
            collapsed,
        }
    }
}

/// A classifier's predictions counted per class: 3·c counts, whatever the number of classes
/// c (the confusion matrix's c² cells are kept beside them only for a few classes).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClassCounts {
    /// Examples whose true class is k.
    pub support: Vec<u64>,
    /// Examples predicted as k.
    pub predicted: Vec<u64>,
    /// Examples of class k predicted as k.
    pub correct: Vec<u64>,
}

impl ClassCounts {
    pub fn new(classes: usize) -> ClassCounts {
        ClassCounts {
            support: vec![0; classes],
            predicted: vec![0; classes],
            correct: vec![0; classes],
        }
    }
}

/// Held-out figures of a model.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct EvalStats {
    /// Mean loss (cross-entropy, masked-LM cross-entropy or BCE).
    pub loss: f64,
    /// Accuracy (argmax; masked tokens; probability 0.5 for a click).
    pub accuracy: f64,
    /// Predictions counted (examples, or masked tokens).
    pub examples: usize,
    /// ROC AUC of a binary task (CTR).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auc: Option<f64>,
    /// A classifier's per-class figures and confusion matrix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub classes: Option<ClassReport>,
}

/// What a finished (or stopped) run reports; also written to `report.json` (and read back by
/// comera-report's `results`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainSummary {
    pub out_dir: PathBuf,
    pub epochs: usize,
    pub steps: u64,
    /// Examples per step in the last phase.
    pub batch_size: usize,
    /// Examples per step of each phase, in order (one entry without `[[train.phases]]`).
    pub phase_batch_sizes: Vec<usize>,
    /// Sequence positions (or examples, for tabular data) trained on.
    pub tokens: u64,
    /// The last evaluation (for a masked-LM run: held-out MLM loss and masked-token accuracy).
    pub final_valid: EvalStats,
    /// The best validation AUC (binary tasks) or accuracy over the epochs, and its epoch; NaN
    /// (written as null) for a run stopped before its first evaluation.
    #[serde(deserialize_with = "f64_or_nan")]
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
    /// Peak resident set of the process (VmHWM), bytes; 0 where /proc is unavailable. A
    /// resumed run's is its last sitting's (each evaluation record has the peak so far).
    pub peak_rss_bytes: u64,
    /// The machine the run ended on (its figures of time are this machine's).
    #[serde(default)]
    pub machine: Machine,
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
    /// (comera-train's `interrupt`).
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

/// The machine a run's time was measured on.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// The CPU's model name (`model name` in /proc/cpuinfo; empty where unavailable).
    pub cpu: String,
    /// Threads of this process's pool (`--threads`).
    pub threads: usize,
    /// The GPU the steps ran on, as `cuda:N (NAME)`; absent for the CPU (and in reports of
    /// runs from before there was a choice).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
}

impl Machine {
    /// This machine, now.
    pub fn this() -> Machine {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("model name"))
                    .and_then(|v| v.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_default();
        Machine {
            cpu,
            threads: rayon::current_num_threads(),
            gpu: None,
        }
    }
}

/// The median of `v` (0 when empty).
pub fn median(v: &mut [f64]) -> f64 {
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

#[cfg(test)]
mod tests {
    use super::ClassReport;

    #[test]
    fn per_class_scores_macro_f1_majority_and_collapse_from_a_confusion_matrix() {
        // True class 0: 8 examples, 6 right; class 1: 2 examples, 1 right.
        let r = ClassReport::from_confusion(vec![vec![6, 2], vec![1, 1]]);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(r.per_class[0].precision, 6.0 / 7.0));
        assert!(close(r.per_class[0].recall, 6.0 / 8.0));
        assert!(close(r.per_class[1].precision, 1.0 / 3.0));
        assert!(close(r.per_class[1].recall, 0.5));
        let f1 = |p: f64, r: f64| 2.0 * p * r / (p + r);
        assert!(close(r.per_class[1].f1, f1(1.0 / 3.0, 0.5)));
        assert!(close(
            r.macro_f1,
            (f1(6.0 / 7.0, 0.75) + f1(1.0 / 3.0, 0.5)) / 2.0
        ));
        assert!(close(r.majority, 0.8));
        assert!(!r.collapsed);
        // Everything predicted as class 0: flagged, and class 1's scores are 0, not NaN.
        let c = ClassReport::from_confusion(vec![vec![8, 0], vec![2, 0]]);
        assert!(c.collapsed);
        assert_eq!((c.per_class[1].precision, c.per_class[1].f1), (0.0, 0.0));
        assert!(c.table(0.8).contains("collapsed to one answer"));
    }
}
