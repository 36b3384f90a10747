//! The run configuration: one TOML file with `[data]`, `[model]`, `[optim]` and `[train]`
//! tables. Every field is documented in `configs/reviews-small.toml`; unknown fields are errors.

use comera_model::Rank;
use comera_model::{EncoderConfig, LayerTt, TtmConfig};
use comera_optim::galore::GaLoreConfig;
use comera_optim::rank::RankConfig;
use comera_optim::{AdamWConfig, Decay};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Where the examples come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// `reviews`, `movie-snippets`, `trec` (fetched data sets), `mnli`, `tsv`, `csv`,
    /// `parquet` (files given in `train`/`valid`), or `corpus` (masked-LM pre-training on the
    /// text files and code directories in `corpus`).
    pub source: String,
    /// Training file (file sources).
    pub train: Option<PathBuf>,
    /// Validation file; without one, `valid_fraction` of the training examples is held out.
    pub valid: Option<PathBuf>,
    /// Column of the (first) text (file sources).
    pub text_a: Option<String>,
    /// Column of the second text of a sentence pair.
    pub text_b: Option<String>,
    /// Label column (file sources), or for `reviews`: `recommended` or `rating`.
    pub label: Option<String>,
    /// The label set of a file source, in label order.
    pub labels: Option<Vec<String>>,
    /// What the labels mean, in label order, as `predict`, `eval` and exports show them
    /// (default: the data set's names, or `labels`).
    pub label_names: Option<Vec<String>>,
    /// BERT `vocab.txt`; default: the fetched `bert-vocab`.
    pub vocab: Option<PathBuf>,
    /// Held-out fraction when there is no validation file.
    pub valid_fraction: f64,
    /// Use at most this many training / validation examples (0 = all).
    pub max_train: usize,
    pub max_valid: usize,
    /// Cache for fetched data (default `$COMERA_DATA` or `~/.cache/comera`).
    pub cache_dir: Option<PathBuf>,
    /// `corpus`: data-set names (`rust-src`, `go-src`, `wikitext-2-train`, …) or paths; a
    /// directory is read as source code (files with one of `extensions`), a file as text.
    pub corpus: Vec<String>,
    /// `corpus`: file extensions (without the dot) of the code files read from directories.
    pub extensions: Vec<String>,
    /// `corpus`: how a text file is cut into documents: `lines`, `paragraphs`, `wiki`
    /// (WikiText articles) or `file`.
    pub text_docs: String,
    /// `corpus`: `wordpiece` (BERT uncased, 30,522 ids) or `bpe` (GPT-2 byte-level).
    pub tokenizer: String,
    /// `corpus`: masking — the fraction of tokens predicted, and of those the fractions
    /// replaced by `[MASK]` and by a random token (the rest are kept).
    pub select_prob: f64,
    pub mask_prob: f64,
    pub random_prob: f64,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            source: "reviews".into(),
            train: None,
            valid: None,
            text_a: None,
            text_b: None,
            label: Some("recommended".into()),
            labels: None,
            label_names: None,
            vocab: None,
            valid_fraction: 0.1,
            max_train: 0,
            max_valid: 0,
            cache_dir: None,
            corpus: Vec::new(),
            extensions: vec!["rs".into()],
            text_docs: "paragraphs".into(),
            tokenizer: "wordpiece".into(),
            select_prob: 0.15,
            mask_prob: 0.8,
            random_prob: 0.1,
        }
    }
}

/// One pre-training phase (BERT practice: most steps at a short sequence length, then a
/// few at the full length): its epochs run with this sequence length and batch size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Phase {
    /// Tokens per sequence (at most `model.seq_len`, the position table's size).
    pub seq_len: usize,
    pub batch_size: usize,
    pub epochs: usize,
    /// Steps per epoch of this phase (0 = the whole training set; default
    /// `train.max_steps_per_epoch`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_steps_per_epoch: Option<usize>,
}

/// The training loop's settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    pub epochs: usize,
    /// Sequences per step (fixed; the last partial batch of an epoch is dropped).
    pub batch_size: usize,
    pub seed: u64,
    /// Linear warm-up steps, then `decay` (`constant`, or `linear` or `cosine` to zero at the
    /// last step).
    pub warmup_steps: u64,
    pub decay: Decay,
    /// Write a training line to the metrics log every this many steps.
    pub log_every: usize,
    /// Stop an epoch after this many steps (0 = the whole training set).
    pub max_steps_per_epoch: usize,
    /// Run directory (metrics, plot, model files).
    pub out_dir: PathBuf,
    /// Write a checkpoint every this many steps (0: only at epoch ends, where one is always
    /// written).
    pub checkpoint_every: u64,
    /// Keep the newest this many checkpoints (0: all).
    pub keep_checkpoints: usize,
    /// Stop (with a checkpoint, resumable with `comera train --resume`) after this many steps
    /// (0: run to the end).
    pub stop_after_steps: u64,
    /// Start the encoder (embeddings and blocks, with their ranks) from a pre-trained model:
    /// a run directory (its `model.safetensors`); the head stays freshly initialised.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_from: Option<PathBuf>,
    /// Evaluate every this many steps as well as at each epoch's end (0: epoch ends only).
    #[serde(default)]
    pub eval_every: u64,
    /// Gradient accumulation: each step runs this many micro-batches of
    /// `batch_size / accumulate_steps` examples and updates once, with the gradient of the
    /// whole batch (the same result as one batch, up to float summation order; activations
    /// for a micro-batch only). `batch_size` (and each phase's) must be a multiple of it.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub accumulate_steps: usize,
    /// Stop when a validation metric stops improving, keeping the best model in `best/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<EarlyStopping>,
    /// Training phases, run in order (empty: one phase of `epochs` × `batch_size` at
    /// `model.seq_len`). Epochs are numbered across phases, so `rank.late_after_epochs` can
    /// put the rank schedule's switch at a phase boundary.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub phases: Vec<Phase>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            epochs: 3,
            batch_size: 32,
            seed: 42,
            warmup_steps: 100,
            decay: Decay::Linear,
            log_every: 10,
            max_steps_per_epoch: 0,
            out_dir: PathBuf::from("runs/latest"),
            checkpoint_every: 500,
            keep_checkpoints: 3,
            stop_after_steps: 0,
            init_from: None,
            eval_every: 0,
            early_stopping: None,
            accumulate_steps: 1,
            phases: Vec::new(),
        }
    }
}

/// A whole run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    #[serde(default)]
    pub data: DataConfig,
    #[serde(default)]
    pub model: EncoderConfig,
    #[serde(default)]
    pub optim: AdamWConfig,
    #[serde(default)]
    pub train: TrainConfig,
    /// The rank schedule (early/late stage, truncation) of TT/TTM layers.
    #[serde(default)]
    pub rank: RankConfig,
    /// When present, dense weight matrices are trained with GaLore instead of AdamW.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub galore: Option<GaLoreConfig>,
}

impl RunConfig {
    /// The built-in default: a small TT/TTM encoder on the review data set (Recommended
    /// label), sized to train in minutes on 2 cores.
    pub fn builtin() -> RunConfig {
        RunConfig {
            data: DataConfig::default(),
            model: EncoderConfig {
                seq_len: 64,
                d_model: 128,
                heads: 4,
                ffn: 256,
                layers: 2,
                num_labels: 2,
                dropout: 0.1,
                attn_tt: LayerTt::uniform(&[8, 4, 4], &[4, 4, 8], 16),
                ffn_up_tt: LayerTt::uniform(&[8, 4, 4], &[8, 8, 4], 16),
                ffn_down_tt: LayerTt::uniform(&[8, 8, 4], &[4, 4, 8], 16),
                word_ttm: TtmConfig {
                    vocab_modes: vec![16, 20, 10, 10],
                    dim_modes: vec![4, 4, 4, 2],
                    rank: Rank::Uniform(16),
                },
                ..EncoderConfig::default()
            },
            // The gates' rate bounds how fast the late stage can prune (Adam moves a gate by
            // about lr_gates per step). 2e-2 from the first step left seeds 44-46 of 42-46 at
            // the majority class; with the gates' hold below it still made the late stage
            // uneven (seed 45 at the majority class after epoch 1, two seeds 1.7-2.2 points
            // below dense). 1e-2 with size_weight 0.5 learns on every seed (README).
            optim: AdamWConfig {
                lr_cores: 1e-3,
                lr_gates: 1e-2,
                lr_other: 1e-3,
                weight_decay: 0.01,
                ..AdamWConfig::default()
            },
            train: TrainConfig {
                epochs: 5,
                batch_size: 32,
                warmup_steps: 100,
                ..TrainConfig::default()
            },
            // One epoch of the early stage, then the late stage towards 0.3× the size at the
            // switch. rho_loss = 1 keeps the data loss's weight at 1 on size-branch steps (with
            // the authors' 0.1 the loss gradient's scale jumps tenfold between branches, and
            // Adam's second moment, set by the larger one, slows learning on size steps);
            // size_weight = 0.3 lets the loss decide which slices go first.
            rank: RankConfig {
                late_after_epochs: 1,
                target_loss: 0.3,
                target_ratio: Some(0.3),
                rho_loss: 1.0,
                size_weight: 0.5,
                gates_after_steps: 320,
                ..RankConfig::default()
            },
            galore: None,
        }
    }

    /// Parses a TOML config; errors name the file and the offending key or line.
    pub fn from_toml(path: &Path, text: &str) -> anyhow::Result<RunConfig> {
        parse(path, text, RunConfig::validate)
    }

    pub fn from_file(path: &Path) -> anyhow::Result<RunConfig> {
        Self::from_toml(path, &read_config(path)?)
    }

    /// Checks every table; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        self.model.validate().map_err(|e| e.to_string())?;
        if self.model.seq_len < 2 {
            return Err(format!(
                "model.seq_len: must be at least 2 ([CLS] and [SEP] take two positions), got {}",
                self.model.seq_len
            ));
        }
        self.optim.validate()?;
        self.rank.validate()?;
        if let Some(g) = &self.galore {
            g.validate()?;
        }
        let t = &self.train;
        check_loop(
            t.epochs,
            t.batch_size,
            t.log_every,
            t.early_stopping.as_ref(),
            &t.out_dir,
            t.accumulate_steps,
        )?;
        let d = &self.data;
        if !(0.0..1.0).contains(&d.valid_fraction) {
            return Err(format!(
                "data.valid_fraction: must be in [0, 1), got {}",
                d.valid_fraction
            ));
        }
        let known = [
            "reviews",
            "movie-snippets",
            "trec",
            "mnli",
            "tsv",
            "csv",
            "parquet",
            "corpus",
        ];
        if !known.contains(&d.source.as_str()) {
            return Err(format!(
                "data.source: `{}` is not one of {known:?}",
                d.source
            ));
        }
        let mlm = self.model.head == comera_model::HeadKind::Mlm;
        match (d.source.as_str(), mlm) {
            ("corpus", false) => {
                return Err(
                    "model.head: data.source `corpus` trains a masked-LM: set head = \"mlm\""
                        .into(),
                )
            }
            (s, true) if s != "corpus" => {
                return Err(format!(
                    "model.head: `mlm` needs data.source = \"corpus\" (got `{s}`)"
                ))
            }
            _ => {}
        }
        if mlm {
            if d.corpus.is_empty() {
                return Err("data.corpus: give at least one data-set name or path".into());
            }
            let p = |x: f64| (0.0..=1.0).contains(&x);
            if !(p(d.select_prob) && d.select_prob > 0.0) {
                return Err(format!(
                    "data.select_prob: must be in (0, 1], got {}",
                    d.select_prob
                ));
            }
            if !(p(d.mask_prob) && p(d.random_prob) && d.mask_prob + d.random_prob <= 1.0) {
                return Err(format!(
                    "data.mask_prob + data.random_prob: each in [0, 1], summing to at most 1, got {} + {}",
                    d.mask_prob, d.random_prob
                ));
            }
            d.tokenizer
                .parse::<comera_data::corpus::TokenizerKind>()
                .map_err(|e| format!("data.tokenizer: {e}"))?;
            if !["lines", "paragraphs", "wiki", "file"].contains(&d.text_docs.as_str()) {
                return Err(format!(
                    "data.text_docs: `{}` is not one of lines, paragraphs, wiki, file",
                    d.text_docs
                ));
            }
        }
        for (i, ph) in t.phases.iter().enumerate() {
            let f = |k: &str| format!("train.phases[{i}].{k}");
            if ph.seq_len < 3 || ph.seq_len > self.model.seq_len {
                return Err(format!(
                    "{}: {} is outside 3..={} (model.seq_len, the position table)",
                    f("seq_len"),
                    ph.seq_len,
                    self.model.seq_len
                ));
            }
            if ph.batch_size == 0 {
                return Err(format!("{}: must be at least 1", f("batch_size")));
            }
            if ph.epochs == 0 {
                return Err(format!("{}: must be at least 1", f("epochs")));
            }
            check_accumulation(t.accumulate_steps, ph.batch_size, &f("batch_size"))?;
        }
        Ok(())
    }

    /// The phases to run: `train.phases`, or the one phase `train.epochs`/`batch_size` give.
    pub fn phases(&self) -> Vec<Phase> {
        let t = &self.train;
        let mut v = if t.phases.is_empty() {
            vec![Phase {
                seq_len: self.model.seq_len,
                batch_size: t.batch_size,
                epochs: t.epochs,
                max_steps_per_epoch: None,
            }]
        } else {
            t.phases.clone()
        };
        for p in &mut v {
            p.max_steps_per_epoch.get_or_insert(t.max_steps_per_epoch);
        }
        v
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a run config serialises")
    }
}

/// The training loop's settings (`[train]` table).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DlrmTrainConfig {
    pub epochs: usize,
    /// Examples per step (fixed; an epoch's last partial batch is dropped).
    pub batch_size: usize,
    pub seed: u64,
    /// Linear warm-up steps, then `decay` (`constant`, or `linear` or `cosine` to zero at the
    /// last step).
    pub warmup_steps: u64,
    pub decay: Decay,
    /// Write a training line to the metrics log every this many steps.
    pub log_every: usize,
    /// Stop an epoch after this many steps (0 = the whole training set).
    pub max_steps_per_epoch: usize,
    /// Run directory (config, metrics, plot, model files, report).
    pub out_dir: PathBuf,
    /// Write `model.safetensors` after every epoch.
    pub save_model: bool,
    /// Write a checkpoint every this many steps (0: only at epoch ends, where one is always
    /// written).
    pub checkpoint_every: u64,
    /// Keep the newest this many checkpoints (0: all).
    pub keep_checkpoints: usize,
    /// Stop (with a checkpoint, resumable with `comera train --resume`) after this many steps
    /// (0: run to the end).
    pub stop_after_steps: u64,
    /// Evaluate every this many steps as well as at each epoch's end (0: epoch ends only).
    #[serde(default)]
    pub eval_every: u64,
    /// Gradient accumulation: each step runs this many micro-batches of
    /// `batch_size / accumulate_steps` examples and updates once, with the gradient of the
    /// whole batch (the same result as one batch, up to float summation order; activations
    /// for a micro-batch only). `batch_size` (and each phase's) must be a multiple of it.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub accumulate_steps: usize,
    /// Stop when a validation metric stops improving, keeping the best model in `best/`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stopping: Option<EarlyStopping>,
}

impl Default for DlrmTrainConfig {
    fn default() -> Self {
        DlrmTrainConfig {
            epochs: 3,
            batch_size: 256,
            seed: 42,
            warmup_steps: 0,
            decay: Decay::Constant,
            log_every: 50,
            max_steps_per_epoch: 0,
            out_dir: PathBuf::from("runs/dlrm"),
            save_model: true,
            checkpoint_every: 500,
            keep_checkpoints: 3,
            stop_after_steps: 0,
            eval_every: 0,
            early_stopping: None,
            accumulate_steps: 1,
        }
    }
}

fn one() -> usize {
    1
}

fn is_one(v: &usize) -> bool {
    *v == 1
}

/// The `[train]` fields every run has (encoder and DLRM alike), each named when wrong.
fn check_loop(
    epochs: usize,
    batch_size: usize,
    log_every: usize,
    early_stopping: Option<&EarlyStopping>,
    out_dir: &Path,
    accumulate_steps: usize,
) -> Result<(), String> {
    if epochs == 0 {
        return Err("train.epochs: must be at least 1".into());
    }
    if batch_size == 0 {
        return Err("train.batch_size: must be at least 1".into());
    }
    if log_every == 0 {
        return Err("train.log_every: must be at least 1".into());
    }
    if let Some(es) = early_stopping {
        es.validate()?;
    }
    if out_dir.as_os_str().is_empty() {
        return Err("train.out_dir: empty; name the run directory".into());
    }
    check_accumulation(accumulate_steps, batch_size, "train.batch_size")
}

/// `train.accumulate_steps` must be at least 1 and divide the batch size `batch` (`field`).
fn check_accumulation(steps: usize, batch: usize, field: &str) -> Result<(), String> {
    if steps == 0 {
        return Err("train.accumulate_steps: must be at least 1".into());
    }
    if !batch.is_multiple_of(steps) {
        return Err(format!(
            "train.accumulate_steps: {steps} does not divide {field} = {batch} (each step runs {steps} micro-batches of equal size)"
        ));
    }
    Ok(())
}

/// Early stopping (`[train.early_stopping]`): after each evaluation, the run stops once
/// `metric` has not improved by more than `min_delta` for `patience` evaluations in a row; the
/// model of the best evaluation is kept in `RUN/best/` (model files and `config.toml`, so
/// `eval`/`predict`/`export` read it like a run directory).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EarlyStopping {
    /// Evaluations without improvement before the run stops (at least 1).
    pub patience: usize,
    /// `valid_loss`, `valid_accuracy` or `valid_auc` (binary tasks).
    #[serde(default)]
    pub metric: StopMetric,
    /// `min` or `max`; default `min` for the loss, `max` for accuracy and AUC.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<StopMode>,
    /// The smallest change that counts as an improvement (default 0).
    #[serde(default)]
    pub min_delta: f64,
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

/// Whether lower or higher is better.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopMode {
    Min,
    Max,
}

impl EarlyStopping {
    fn validate(&self) -> Result<(), String> {
        if self.patience == 0 {
            return Err("train.early_stopping.patience: must be at least 1".into());
        }
        if !(self.min_delta >= 0.0 && self.min_delta.is_finite()) {
            return Err(format!(
                "train.early_stopping.min_delta: must be a finite number ≥ 0, got {}",
                self.min_delta
            ));
        }
        Ok(())
    }

    pub fn mode(&self) -> StopMode {
        self.mode.unwrap_or(match self.metric {
            StopMetric::ValidLoss => StopMode::Min,
            StopMetric::ValidAccuracy | StopMetric::ValidAuc => StopMode::Max,
        })
    }

    /// The watched figure of an evaluation (None: AUC of a task that has none).
    pub fn value(&self, s: &crate::task::EvalStats) -> Option<f64> {
        match self.metric {
            StopMetric::ValidLoss => Some(s.loss),
            StopMetric::ValidAccuracy => Some(s.accuracy),
            StopMetric::ValidAuc => s.auc,
        }
    }

    /// Whether `value` beats `best` (by more than `min_delta`); anything beats no best.
    pub fn improves(&self, value: f64, best: Option<f64>) -> bool {
        best.is_none_or(|b| match self.mode() {
            StopMode::Min => value < b - self.min_delta,
            StopMode::Max => value > b + self.min_delta,
        })
    }
}

/// A whole DLRM run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DlrmRunConfig {
    #[serde(default)]
    pub dlrm: comera_dlrm::DlrmConfig,
    #[serde(default)]
    pub data: comera_dlrm::config::CtrDataConfig,
    #[serde(default = "default_optim")]
    pub optim: AdamWConfig,
    #[serde(default)]
    pub train: DlrmTrainConfig,
    /// Rank-adaptive training of the TTM tables (`[rank]`, see comera-optim's `rank` module:
    /// size penalty, early/late stage, truncation of pruned rank slices). Off without the table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<RankConfig>,
}

/// DLRM's optimiser defaults: one learning rate of 1e-3 for everything, clipping at 10.
pub fn default_optim() -> AdamWConfig {
    AdamWConfig {
        lr_cores: 1e-3,
        lr_gates: 1e-3,
        lr_other: 1e-3,
        weight_decay: 0.0,
        clip_norm: 10.0,
        ..AdamWConfig::default()
    }
}

impl Default for DlrmRunConfig {
    fn default() -> Self {
        DlrmRunConfig {
            dlrm: comera_dlrm::DlrmConfig::default(),
            data: comera_dlrm::config::CtrDataConfig::default(),
            optim: default_optim(),
            train: DlrmTrainConfig::default(),
            rank: None,
        }
    }
}

/// Whether a parsed TOML document is a DLRM run config (it has a top-level `[dlrm]` table).
pub fn is_dlrm_config(text: &str) -> bool {
    text.parse::<toml::Table>()
        .map(|t| t.contains_key("dlrm"))
        .unwrap_or(false)
}

impl DlrmRunConfig {
    /// Parses a TOML config; errors name the file and the offending key or line.
    pub fn from_toml(path: &Path, text: &str) -> anyhow::Result<DlrmRunConfig> {
        parse(path, text, DlrmRunConfig::validate)
    }

    pub fn from_file(path: &Path) -> anyhow::Result<DlrmRunConfig> {
        Self::from_toml(path, &read_config(path)?)
    }

    /// Checks every table; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        self.dlrm.validate()?;
        self.optim.validate()?;
        if let Some(r) = &self.rank {
            r.validate()?;
        }
        let t = &self.train;
        check_loop(
            t.epochs,
            t.batch_size,
            t.log_every,
            t.early_stopping.as_ref(),
            &t.out_dir,
            t.accumulate_steps,
        )?;
        let d = &self.data;
        let known = ["movielens", "adult", "criteo", "synthetic"];
        if !known.contains(&d.source.as_str()) {
            return Err(format!(
                "data.source: `{}` is not one of {known:?}",
                d.source
            ));
        }
        if !(0.0..1.0).contains(&d.valid_fraction) {
            return Err(format!(
                "data.valid_fraction: must be in [0, 1), got {}",
                d.valid_fraction
            ));
        }
        if d.mapping.parse::<comera_data::ctr::CatMapping>().is_err() {
            return Err(format!(
                "data.mapping: `{}` is not `hash` or `modulo`",
                d.mapping
            ));
        }
        if d.source == "criteo" && d.train.is_none() {
            return Err("data.train: the criteo source needs a training file".into());
        }
        if !d.table_sizes.is_empty() && d.table_sizes.len() != comera_data::ctr::CRITEO_CATS {
            return Err(format!(
                "data.table_sizes: Criteo has {} categorical fields, got {} sizes",
                comera_data::ctr::CRITEO_CATS,
                d.table_sizes.len()
            ));
        }
        if d.table_sizes.contains(&0) {
            return Err("data.table_sizes: every table needs at least 1 row".into());
        }
        if d.table_sizes.is_empty() && d.total_rows < comera_data::ctr::CRITEO_CATS * 4 {
            return Err("data.total_rows: at least 104 (4 rows per table)".into());
        }
        if !(d.zipf_s > 0.0 && d.zipf_s.is_finite()) {
            return Err(format!("data.zipf_s: must be > 0, got {}", d.zipf_s));
        }
        if !(0.0..1.0).contains(&d.missing) {
            return Err(format!(
                "data.missing: must be in [0, 1), got {}",
                d.missing
            ));
        }
        Ok(())
    }

    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a run config serialises")
    }
}

/// A run config of either kind: a DLRM run (the file has a `[dlrm]` table) or an encoder run.
#[derive(Clone, Debug, PartialEq)]
#[allow(clippy::large_enum_variant)]
pub enum AnyRunConfig {
    Encoder(RunConfig),
    Dlrm(DlrmRunConfig),
}

impl AnyRunConfig {
    /// Parses either kind; errors name the file and the field.
    pub fn from_toml(path: &Path, text: &str) -> anyhow::Result<AnyRunConfig> {
        Ok(if is_dlrm_config(text) {
            AnyRunConfig::Dlrm(DlrmRunConfig::from_toml(path, text)?)
        } else {
            AnyRunConfig::Encoder(RunConfig::from_toml(path, text)?)
        })
    }

    pub fn from_file(path: &Path) -> anyhow::Result<AnyRunConfig> {
        Self::from_toml(path, &read_config(path)?)
    }

    /// The run directory.
    pub fn out_dir_mut(&mut self) -> &mut PathBuf {
        match self {
            AnyRunConfig::Encoder(c) => &mut c.train.out_dir,
            AnyRunConfig::Dlrm(c) => &mut c.train.out_dir,
        }
    }

    pub fn stop_after_steps_mut(&mut self) -> &mut u64 {
        match self {
            AnyRunConfig::Encoder(c) => &mut c.train.stop_after_steps,
            AnyRunConfig::Dlrm(c) => &mut c.train.stop_after_steps,
        }
    }
}

/// Command-line overrides of a run config's common fields.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub epochs: Option<usize>,
    pub batch_size: Option<usize>,
    pub seed: Option<u64>,
    pub out: Option<PathBuf>,
    pub max_steps_per_epoch: Option<usize>,
    pub stop_after_steps: Option<u64>,
    pub init_from: Option<PathBuf>,
    /// Every layer (or table) dense instead of TT/TTM.
    pub dense: bool,
}

impl AnyRunConfig {
    /// Applies `o` and checks the result; errors name the flag or field.
    pub fn apply(&mut self, o: &Overrides) -> anyhow::Result<()> {
        match self {
            AnyRunConfig::Encoder(cfg) => {
                if !cfg.train.phases.is_empty() && (o.epochs.is_some() || o.batch_size.is_some()) {
                    anyhow::bail!("--epochs / --batch-size: this config has [[train.phases]]; set epochs and batch_size per phase there");
                }
                let t = &mut cfg.train;
                set(&mut t.epochs, o.epochs);
                set(&mut t.batch_size, o.batch_size);
                set(&mut t.seed, o.seed);
                set(&mut t.out_dir, o.out.clone());
                set(&mut t.max_steps_per_epoch, o.max_steps_per_epoch);
                set(&mut t.stop_after_steps, o.stop_after_steps);
                if let Some(v) = &o.init_from {
                    t.init_from = Some(v.clone());
                }
                if o.dense {
                    cfg.model.make_dense();
                }
                cfg.validate().map_err(anyhow::Error::msg)
            }
            AnyRunConfig::Dlrm(cfg) => {
                if o.init_from.is_some() {
                    anyhow::bail!(
                        "--init-from: a DLRM run has no pre-trained encoder to start from"
                    );
                }
                let t = &mut cfg.train;
                set(&mut t.epochs, o.epochs);
                set(&mut t.batch_size, o.batch_size);
                set(&mut t.seed, o.seed);
                set(&mut t.out_dir, o.out.clone());
                set(&mut t.max_steps_per_epoch, o.max_steps_per_epoch);
                set(&mut t.stop_after_steps, o.stop_after_steps);
                if o.dense {
                    cfg.dlrm.tables = comera_dlrm::TableKind::Dense;
                }
                cfg.validate().map_err(anyhow::Error::msg)
            }
        }
    }

    pub fn to_toml(&self) -> String {
        match self {
            AnyRunConfig::Encoder(c) => c.to_toml(),
            AnyRunConfig::Dlrm(c) => c.to_toml(),
        }
    }
}

fn set<T>(field: &mut T, v: Option<T>) {
    if let Some(v) = v {
        *field = v;
    }
}

/// The text of a config file; the error names it.
fn read_config(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("{}: cannot read config: {e}", path.display()))
}

/// Parses and checks a config; errors name the file and the offending key, line or field.
fn parse<T: serde::de::DeserializeOwned>(
    path: &Path,
    text: &str,
    validate: impl Fn(&T) -> Result<(), String>,
) -> anyhow::Result<T> {
    let cfg: T = toml::from_str(text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    validate(&cfg).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(cfg)
}
