//! The run configuration: one TOML file with `[data]`, `[model]`, `[optim]` and `[train]`
//! tables. Every field is documented in `configs/reviews-small.toml`; unknown fields are errors.

use comera_cuda::DeviceSpec;
use comera_model::Rank;
use comera_model::{EncoderConfig, LayerTt, TtmConfig};
use comera_optim::galore::GaLoreConfig;
use comera_optim::rank::RankConfig;
use comera_optim::{AdamWConfig, Decay};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext};
use crate::records::EvalStats;
pub use crate::records::StopMetric;

/// A config field or a command-line flag with a value the run cannot use: `FILE:LINE:COLUMN:
/// FIELD: REASON` (the file, and the line and column where the file sets the field, when
/// known).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// The config file, when the config was read from one.
    pub file: Option<PathBuf>,
    /// The line and column (1-based) where the file sets the field.
    pub position: Option<(usize, usize)>,
    /// The field (`train.epochs`, `data.label_names[1]`) or flag (`--seed`).
    pub field: String,
    /// What is wrong with its value.
    pub reason: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{}", file.display())?;
            if let Some((line, column)) = self.position {
                write!(f, ":{line}:{column}")?;
            }
            write!(f, ": ")?;
        }
        if self.field.is_empty() {
            write!(f, "{}", self.reason)
        } else {
            write!(f, "{}: {}", self.field, self.reason)
        }
    }
}

impl ConfigError {
    /// `field: reason`, in no file yet.
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
        ConfigError {
            file: None,
            position: None,
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// The same error, naming the config `file` and the field's position in its `text`.
    pub fn in_file(mut self, file: &Path, text: &str) -> ConfigError {
        self.position = field_position(text, &self.field);
        self.file = Some(file.to_path_buf());
        self
    }
}

impl From<comera_dlrm::config::ConfigError> for ConfigError {
    fn from(e: comera_dlrm::config::ConfigError) -> ConfigError {
        ConfigError::new(e.field, e.reason)
    }
}

impl From<comera_optim::SettingError> for ConfigError {
    fn from(e: comera_optim::SettingError) -> ConfigError {
        ConfigError::new(e.field, e.reason)
    }
}

impl From<comera_model::ConfigError> for ConfigError {
    fn from(e: comera_model::ConfigError) -> ConfigError {
        ConfigError::new(e.field, e.msg)
    }
}

/// `field: reason`.
fn bad(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::new(field, reason)
}

/// An upper bound on an integer a user types (a config field or a command-line flag), with
/// the reason for it. Every such number is checked against one before anything is planned or
/// allocated from it, so that a typo is an error naming the field rather than a panic, an
/// abort or gigabytes of memory; each limit is far beyond real use.
#[derive(Clone, Copy, Debug)]
pub struct Bound {
    pub limit: u64,
    pub why: &'static str,
}

impl Bound {
    /// `field: VALUE is more than the limit LIMIT; WHY` when `value` exceeds the limit.
    pub fn check(&self, field: &str, value: u64) -> Result<(), ConfigError> {
        if value > self.limit {
            return Err(bad(
                field,
                format!(
                    "{value} is more than the limit {}; {}",
                    self.limit, self.why
                ),
            ));
        }
        Ok(())
    }
}

/// Any count, step number or seed: a run writes its config back as TOML (`config.toml` in
/// the run directory, read again by `--resume`, `eval` and `predict`), and TOML integers are
/// signed 64-bit.
pub const TOML_INT: Bound = Bound {
    limit: i64::MAX as u64,
    why: "a run's config is saved as TOML, whose integers are signed 64-bit",
};

/// Epochs of a run (summed over its phases): the trainer plans every epoch before the first
/// step (a few bytes each), and a million epochs of even one step each is days of training.
pub const EPOCHS: Bound = Bound {
    limit: 1_000_000,
    why: "a million epochs is already days of single-step epochs (each epoch is planned before the first step)",
};

/// Examples per step: buffers are planned for a whole batch, and 2^20 sequences is more than
/// any CPU's memory holds the activations of (the memory check refuses smaller ones that do
/// not fit either, with the estimate).
pub const BATCH: Bound = Bound {
    limit: 1 << 20,
    why: "a step's buffers are planned for the whole batch",
};

/// Tokens per sequence: the position table has a row per position and attention a score per
/// pair of positions (2^16 tokens: 2^32 scores a head), BERT uses 512.
pub const SEQ_LEN: Bound = Bound {
    limit: 1 << 16,
    why: "attention holds a score for every pair of positions (BERT uses 512)",
};

/// A layer's width (model.d_model, model.ffn, dlrm.embedding_dim, MLP widths) or a TT/TTM
/// rank: a dense 2^16 × 2^16 matrix is 16 GiB of weights; the widest published transformer
/// layers are about 50,000.
pub const WIDTH: Bound = Bound {
    limit: 1 << 16,
    why: "a dense square layer of that width is 16 GiB of weights",
};

/// Rows of a word embedding, token types or classes: 2^24 (16.7 million) rows is 64 times the
/// largest tokenizers' vocabularies.
pub const ROWS: Bound = Bound {
    limit: 1 << 24,
    why: "a table of that many rows is 64 times the largest tokenizers' vocabularies",
};

/// Encoder blocks: 1,024 is ten times the deepest published BERT-style encoders.
pub const LAYERS: Bound = Bound {
    limit: 1024,
    why: "ten times the deepest published encoders",
};

/// Cores of a DLRM TTM table: TT-Rec and CoMERA use 3-4; a table of 2^32 rows split over 16
/// cores already has 4 rows a mode, so more cores only add rank bonds.
pub const TTM_CORES: Bound = Bound {
    limit: 16,
    why: "a table of 2^32 rows in 16 cores has 4 rows a mode (TT-Rec and CoMERA use 3-4 cores)",
};

/// Rows of one DLRM table, and the total of the 26 synthetic/Criteo tables: ids are 32-bit
/// (the synthetic generator's and the hashed Criteo ids').
pub const TABLE_ROWS: Bound = Bound {
    limit: u32::MAX as u64,
    why: "categorical ids are 32-bit",
};

/// Examples held in memory (the synthetic validation set): about 200 bytes each, so 10^7 is
/// 2 GB.
pub const HELD_EXAMPLES: Bound = Bound {
    limit: 10_000_000,
    why: "the set is held in memory (about 200 bytes an example)",
};

/// Where an encoder run's examples come from (`data.source`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DataSource {
    /// The women's clothing review set (fetched; label `recommended` or `rating`).
    Reviews,
    /// Rotten Tomatoes movie snippets (fetched; binary sentiment).
    MovieSnippets,
    /// TREC question classification, 6 coarse classes (fetched).
    Trec,
    /// An MNLI file in GLUE's TSV layout (`train`/`valid`).
    Mnli,
    /// Files of the user's (`train`/`valid`): text and label columns named by `text_a`,
    /// `text_b`, `label` or found by convention (`text`/`sentence`, `text_pair`, `label`).
    Tsv,
    Csv,
    /// JSON Lines: one object a line.
    Jsonl,
    Parquet,
    /// Masked-LM pre-training on the text files and code directories of `data.corpus`.
    Corpus,
}

impl DataSource {
    /// The name in a config file.
    pub fn name(self) -> &'static str {
        match self {
            DataSource::Reviews => "reviews",
            DataSource::MovieSnippets => "movie-snippets",
            DataSource::Trec => "trec",
            DataSource::Mnli => "mnli",
            DataSource::Tsv => "tsv",
            DataSource::Csv => "csv",
            DataSource::Jsonl => "jsonl",
            DataSource::Parquet => "parquet",
            DataSource::Corpus => "corpus",
        }
    }

    /// Whether the examples are read from `data.train` / `data.valid` (a file source).
    pub fn reads_files(self) -> bool {
        matches!(
            self,
            DataSource::Mnli
                | DataSource::Tsv
                | DataSource::Csv
                | DataSource::Jsonl
                | DataSource::Parquet
        )
    }

    /// The file source a file name's extension says (`.csv`, `.tsv`, `.jsonl`, `.parquet`).
    pub fn for_file(path: &Path) -> Option<DataSource> {
        use comera_data::TableFormat;
        Some(match TableFormat::from_extension(path)? {
            TableFormat::Csv => DataSource::Csv,
            TableFormat::Tsv => DataSource::Tsv,
            TableFormat::Jsonl => DataSource::Jsonl,
            TableFormat::Parquet => DataSource::Parquet,
        })
    }

    /// Whether the run is a masked-LM pre-training (on a corpus) rather than a classifier.
    pub fn is_corpus(self) -> bool {
        self == DataSource::Corpus
    }
}

impl std::fmt::Display for DataSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the examples come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    pub source: DataSource,
    /// Training file (file sources).
    pub train: Option<PathBuf>,
    /// Validation file; without one, `valid_fraction` of the training examples is held out.
    pub valid: Option<PathBuf>,
    /// SHA-256 of the training / validation file (hex): a file that changed is refused
    /// (set for data handed over in memory; optional otherwise).
    pub train_sha256: Option<String>,
    pub valid_sha256: Option<String>,
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

impl DataConfig {
    /// Train on `file` (and validate on `valid`): the source from the file's extension. The
    /// columns and labels of a config that reads files stay (they describe the user's files);
    /// after a fetched data set they are found in the file.
    pub fn use_file(&mut self, file: &Path, valid: Option<&Path>) -> Result<(), ConfigError> {
        let source = DataSource::for_file(file).ok_or_else(|| {
            ConfigError::new(
                "--data",
                format!(
                    "{}: cannot tell the format from the name; expected .csv, .tsv, .jsonl or .parquet",
                    file.display()
                ),
            )
        })?;
        if let Some(v) = valid {
            if DataSource::for_file(v) != Some(source) {
                return Err(ConfigError::new(
                    "--valid",
                    format!(
                        "{}: expected a {} file like --data {}",
                        v.display(),
                        source,
                        file.display()
                    ),
                ));
            }
        }
        if !self.source.reads_files() || self.source == DataSource::Mnli {
            self.text_a = None;
            self.text_b = None;
            self.label = None;
            self.labels = None;
            self.label_names = None;
        }
        self.source = source;
        self.train = Some(file.to_path_buf());
        self.valid = valid.map(Path::to_path_buf);
        self.train_sha256 = None;
        self.valid_sha256 = None;
        Ok(())
    }
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            source: DataSource::Reviews,
            train: None,
            valid: None,
            train_sha256: None,
            valid_sha256: None,
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

impl DataConfig {
    /// A masked-LM run's corpus fields: a corpus, masking fractions, tokenizer, documents.
    fn check_corpus_fields(&self) -> Result<(), ConfigError> {
        let d = self;
        if d.corpus.is_empty() {
            return Err(bad(
                "data.corpus",
                "give at least one data-set name or path",
            ));
        }
        let p = |x: f64| (0.0..=1.0).contains(&x);
        if !(p(d.select_prob) && d.select_prob > 0.0) {
            return Err(bad(
                "data.select_prob",
                format!("must be in (0, 1], got {}", d.select_prob),
            ));
        }
        if !(p(d.mask_prob) && p(d.random_prob) && d.mask_prob + d.random_prob <= 1.0) {
            return Err(bad(
                "data.mask_prob + data.random_prob",
                format!(
                    "each in [0, 1], summing to at most 1, got {} + {}",
                    d.mask_prob, d.random_prob
                ),
            ));
        }
        d.tokenizer
            .parse::<comera_data::corpus::TokenizerKind>()
            .map_err(|e| bad("data.tokenizer", e.to_string()))?;
        if !["lines", "paragraphs", "wiki", "file"].contains(&d.text_docs.as_str()) {
            return Err(bad(
                "data.text_docs",
                format!(
                    "`{}` is not one of lines, paragraphs, wiki, file",
                    d.text_docs
                ),
            ));
        }
        Ok(())
    }

    /// A classification run refuses the masked-LM fields set to anything but their defaults:
    /// they would be ignored, and a user who set one expects it to do something.
    fn check_no_corpus_fields(&self) -> Result<(), ConfigError> {
        let default = DataConfig::default();
        let set = [
            ("corpus", self.corpus != default.corpus),
            ("extensions", self.extensions != default.extensions),
            ("text_docs", self.text_docs != default.text_docs),
            ("tokenizer", self.tokenizer != default.tokenizer),
            // `!=` on floats: NaN differs from every default too.
            ("select_prob", self.select_prob != default.select_prob),
            ("mask_prob", self.mask_prob != default.mask_prob),
            ("random_prob", self.random_prob != default.random_prob),
        ];
        match set.iter().find(|(_, changed)| *changed) {
            Some((field, _)) => Err(bad(format!("data.{field}"), format!(
                "only masked-LM runs (data.source = \"corpus\") use it, and this run classifies `{}` data; remove it",
                self.source
            ))),
            None => Ok(()),
        }
    }
}

/// Labels and label names (`field`) are shown one a line, written into `predict`'s TSV and
/// exported as Hugging Face's `label2id` keys: each must be non-empty, free of control
/// characters (a tab or newline breaks the TSV) and different from the others.
fn check_names(field: &str, names: &[String]) -> Result<(), ConfigError> {
    if names.is_empty() {
        return Err(bad(field, "empty; give one name per label"));
    }
    for (i, name) in names.iter().enumerate() {
        if name.trim().is_empty() {
            return Err(bad(format!("{field}[{i}]"), format!("empty name {name:?}")));
        }
        if name.chars().any(char::is_control) {
            return Err(bad(format!("{field}[{i}]"), format!(
                "{name:?} holds a control character (tab, newline, …), which would break predict's TSV output"
            )));
        }
        if let Some(j) = names[..i].iter().position(|n| n == name) {
            return Err(bad(
                format!("{field}[{i}]"),
                format!("{name:?} is also {field}[{j}]; every label needs its own name"),
            ));
        }
    }
    Ok(())
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
    /// Where the steps run: `cpu` (the default) or `cuda` / `cuda:N` (docs/gpu.md says what
    /// trains on a GPU yet). Not part of what a run stores: a run moves between devices
    /// through its checkpoints (`comera train --resume DIR --device cpu`).
    #[serde(default, skip_serializing_if = "is_cpu")]
    pub device: DeviceSpec,
}

/// Why a DLRM run refuses a GPU.
const DLRM_ON_CPU: &str = "DLRM runs train on the CPU only (docs/gpu.md: what is on the GPU)";

/// Whether `d` is the CPU (the default, left out of a written config).
fn is_cpu(d: &DeviceSpec) -> bool {
    *d == DeviceSpec::Cpu
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
            device: DeviceSpec::Cpu,
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
    /// When present, the classifier is distilled from a frozen teacher.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distill: Option<DistillConfig>,
}

/// The `[distill]` table: train the classifier against a frozen teacher's logits and hidden
/// states as well as the labels (`comera_model::DistillLoss` has the loss's formula):
///   L = task_weight·CE + logit_weight·τ²·KL(teacher ‖ student at τ) + hidden_weight·MSE.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DistillConfig {
    /// The teacher: a comera model directory (a run, its `best/`, or an imported model) with a
    /// classifier head for the same labels and vocabulary. A Hugging Face model is imported
    /// first (`comera import hf DIR --out …`, then fine-tuned: `train --dense --init-from`).
    /// Without one (here or from `--teacher`) the table only holds the settings: the run is
    /// not distilled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher: Option<PathBuf>,
    /// The teacher's weights' SHA-256, recorded when the run starts; a resumed run refuses a
    /// teacher that changed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher_sha256: Option<String>,
    /// Weight of the cross-entropy on the labels.
    #[serde(
        default = "DistillConfig::one",
        serialize_with = "comera_layers::config_float::shortest_f32"
    )]
    pub task_weight: f32,
    /// Weight of the KL divergence to the teacher's logits (0: hidden states only).
    #[serde(
        default = "DistillConfig::one",
        serialize_with = "comera_layers::config_float::shortest_f32"
    )]
    pub logit_weight: f32,
    /// Softmax temperature τ of the logit term.
    #[serde(
        default = "DistillConfig::temperature",
        serialize_with = "comera_layers::config_float::shortest_f32"
    )]
    pub temperature: f32,
    /// Weight of the hidden-state MSE (mean over the layer pairs; 0: logits only).
    #[serde(default, serialize_with = "comera_layers::config_float::shortest_f32")]
    pub hidden_weight: f32,
    /// [student, teacher] hidden-state pairs, numbered as Hugging Face's `hidden_states`:
    /// 0 = the embeddings' output, k = block k's output. Empty with hidden_weight > 0: every
    /// student block k is matched to teacher block k·(teacher layers / student layers) (the
    /// map is recorded in the run's config).
    #[serde(default, deserialize_with = "block_pairs")]
    pub layers: Vec<[usize; 2]>,
    /// Start the student's classifier head (pooler and classifier) from the teacher's, when
    /// the run does not get one from `init_from` and the two heads have one layout: the
    /// student's last hidden states are pulled towards the teacher's, which that head reads.
    #[serde(default = "DistillConfig::yes")]
    pub init_head: bool,
}

impl DistillConfig {
    fn one() -> f32 {
        1.0
    }
    fn temperature() -> f32 {
        2.0
    }
    fn yes() -> bool {
        true
    }

    /// A teacher at `dir` with the default weights: the labels and the teacher's logits at
    /// τ = 2, no hidden-state term.
    pub fn with_teacher(dir: PathBuf) -> DistillConfig {
        DistillConfig {
            teacher: Some(dir),
            teacher_sha256: None,
            task_weight: 1.0,
            logit_weight: 1.0,
            temperature: 2.0,
            hidden_weight: 0.0,
            layers: Vec::new(),
            init_head: true,
        }
    }

    /// The layer map: the given pairs (each block number within its model: 0 to S for the
    /// student, 0 to T for the teacher), or (hidden_weight > 0 and none given) each student
    /// block k on teacher block k·T/S (`s`, `t`: the layer counts; T a multiple of S).
    pub fn layer_map(&self, s: usize, t: usize) -> Result<Vec<(usize, usize)>, ConfigError> {
        for (k, &[i, j]) in self.layers.iter().enumerate() {
            if i > s || j > t {
                return Err(bad(
                    format!("distill.layers[{k}]"),
                    format!(
                        "[{i}, {j}] is out of range: the student has hidden states 0 to {s}, the teacher 0 to {t} (0 = the embeddings, k = block k)"
                    ),
                ));
            }
        }
        if !self.layers.is_empty() || self.hidden_weight == 0.0 {
            return Ok(self.layers.iter().map(|&[i, j]| (i, j)).collect());
        }
        if s == 0 || !t.is_multiple_of(s) {
            return Err(bad(
                "distill.layers",
                format!(
                    "the teacher's {t} layers are not a multiple of the student's {s}: give the pairs, e.g. layers = [[{s}, {t}]]"
                ),
            ));
        }
        Ok((1..=s).map(|k| (k, k * t / s)).collect())
    }

    /// The model-level loss with `layers` resolved.
    pub fn loss(&self, layers: Vec<(usize, usize)>) -> comera_model::DistillLoss {
        comera_model::DistillLoss {
            task_weight: self.task_weight,
            logit_weight: self.logit_weight,
            temperature: self.temperature,
            hidden_weight: self.hidden_weight,
            layers,
        }
    }
}

/// `distill.layers` read strictly: a list of `[student, teacher]` pairs, each exactly two
/// block numbers (serde's fixed arrays would take the first two of a longer list).
fn block_pairs<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<[usize; 2]>, D::Error> {
    let lists = Vec::<Vec<usize>>::deserialize(d)?;
    lists
        .into_iter()
        .enumerate()
        .map(|(k, pair)| {
            <[usize; 2]>::try_from(pair.as_slice()).map_err(|_| {
                serde::de::Error::custom(format!(
                    "pair {k} is {pair:?}: each pair is [student block, teacher block], two numbers"
                ))
            })
        })
        .collect()
}

/// Whether two paths name one place (see [`crate::files::resolved`]).
fn same_place(a: &Path, b: &Path) -> bool {
    crate::files::resolved(a) == crate::files::resolved(b)
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
            // The first fifth of the run (one epoch of five) in the early stage, the gates held
            // for its first tenth; then the late stage towards 0.3× the size at the switch.
            // As fractions of the run, both stages happen in a run of any length (a short run
            // on small data too). rho_loss = 1 keeps the data loss's weight at 1 on size-branch
            // steps (with the authors' 0.1 the loss gradient's scale jumps tenfold between
            // branches, and Adam's second moment, set by the larger one, slows learning on size
            // steps); size_weight = 0.3 lets the loss decide which slices go first.
            rank: RankConfig {
                late_after_fraction: 0.2,
                target_loss: 0.3,
                target_ratio: Some(0.3),
                rho_loss: 1.0,
                size_weight: 0.5,
                gates_after_fraction: 0.1,
                ..RankConfig::default()
            },
            galore: None,
            distill: None,
        }
    }

    /// Parses a TOML config; errors name the file and the offending key or line.
    ///
    /// A config without a `[model]` table gets the built-in run's small model (the paper's
    /// 768-wide six-encoder model takes a table that asks for it), and with it, unless the file
    /// has those tables, the built-in `[optim]` and `[rank]`: a user who brings only data gets
    /// a model that trains in minutes on a CPU through both rank stages.
    pub fn from_toml(path: &Path, text: &str) -> crate::Result<RunConfig> {
        let mut cfg: RunConfig = toml::from_str(text).map_err(|e| Error::parse(path, e))?;
        if let Ok(table) = text.parse::<toml::Table>() {
            if !table.contains_key("model") {
                // The built-in model comes with the settings tuned for it: its optimiser and
                // its rank schedule (as fractions of the run), unless the file gives them.
                let builtin = RunConfig::builtin();
                cfg.model = builtin.model;
                if !table.contains_key("optim") {
                    cfg.optim = builtin.optim;
                }
                if !table.contains_key("rank") {
                    cfg.rank = builtin.rank;
                }
            }
        }
        cfg.validate().map_err(|e| e.in_file(path, text))?;
        Ok(cfg)
    }

    pub fn from_file(path: &Path) -> crate::Result<RunConfig> {
        Self::from_toml(path, &read_config(path)?)
    }

    /// Checks every table; the message names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        // Bounds first: the layouts below are computed from these numbers.
        self.check_bounds()?;
        self.model.validate()?;
        if self.model.seq_len < 2 {
            return Err(bad(
                "model.seq_len",
                format!(
                    "must be at least 2 ([CLS] and [SEP] take two positions), got {}",
                    self.model.seq_len
                ),
            ));
        }
        self.optim.validate()?;
        self.rank.validate()?;
        if let Some(g) = &self.galore {
            g.validate()?;
        }
        if let Some(ds) = &self.distill {
            self.check_distill(ds)?;
        }
        if let Some(init) = &self.train.init_from {
            if init.as_os_str().is_empty() || same_place(init, &self.train.out_dir) {
                return Err(bad(
                    "train.init_from",
                    format!(
                        "`{}` is empty or this run's own directory (train.out_dir), which the run replaces; name the pre-trained model's directory",
                        init.display()
                    ),
                ));
            }
        }
        self.check_data()?;
        self.check_phases()
    }

    /// The `[distill]` table: a classifier's, a teacher that is not this run's own directory,
    /// a well-formed digest of one.
    fn check_distill(&self, ds: &DistillConfig) -> Result<(), ConfigError> {
        if self.model.head == comera_model::HeadKind::Mlm {
            return Err(bad(
                "distill",
                "distillation trains a classifier; this config trains a masked-LM",
            ));
        }
        if ds
            .teacher
            .as_ref()
            .is_some_and(|t| t.as_os_str().is_empty())
        {
            return Err(bad(
                "distill.teacher",
                "is empty; name the teacher's model directory, or leave distill.teacher out to train without one",
            ));
        }
        if let Some(teacher) = &ds.teacher {
            if same_place(teacher, &self.train.out_dir) {
                return Err(bad(
                    "distill.teacher",
                    format!(
                        "{} is this run's own directory (train.out_dir), which the run replaces; train the student into a directory of its own",
                        teacher.display()
                    ),
                ));
            }
        }
        if ds.teacher_sha256.is_some() && ds.teacher.is_none() {
            return Err(bad(
                "distill.teacher_sha256",
                "checks a teacher, and distill.teacher names none",
            ));
        }
        if let Some(sha) = &ds.teacher_sha256 {
            if !is_sha256(sha) {
                return Err(bad(
                    "distill.teacher_sha256",
                    format!("`{sha}` is not a SHA-256 (64 hex digits)"),
                ));
            }
        }
        Ok(())
    }

    /// The `[data]` table: its source fits the head, the fields of the other kind of run are
    /// absent, digests check files that are read, label names are usable.
    fn check_data(&self) -> Result<(), ConfigError> {
        let d = &self.data;
        if !(0.0..1.0).contains(&d.valid_fraction) {
            return Err(bad(
                "data.valid_fraction",
                format!("must be in [0, 1), got {}", d.valid_fraction),
            ));
        }
        let mlm = self.model.head == comera_model::HeadKind::Mlm;
        match (d.source, mlm) {
            (DataSource::Corpus, false) => {
                return Err(bad(
                    "model.head",
                    "data.source `corpus` trains a masked-LM: set head = \"mlm\"",
                ))
            }
            (s, true) if !s.is_corpus() => {
                return Err(bad(
                    "model.head",
                    format!("`mlm` needs data.source = \"corpus\" (got `{s}`)"),
                ))
            }
            _ => {}
        }
        if mlm {
            d.check_corpus_fields()?;
        } else {
            d.check_no_corpus_fields()?;
        }
        for (field, sha, file) in [
            ("train_sha256", &d.train_sha256, &d.train),
            ("valid_sha256", &d.valid_sha256, &d.valid),
        ] {
            if let Some(sha) = sha {
                if file.is_none() || !d.source.reads_files() {
                    return Err(bad(
                        format!("data.{field}"),
                        "checks a data file of a file source (data.train / data.valid); remove it",
                    ));
                }
                if !is_sha256(sha) {
                    return Err(bad(
                        format!("data.{field}"),
                        format!("`{sha}` is not a SHA-256 (64 hex digits)"),
                    ));
                }
            }
        }
        if let Some(labels) = &d.labels {
            check_names("data.labels", labels)?;
        }
        if let Some(names) = &d.label_names {
            check_names("data.label_names", names)?;
        }
        Ok(())
    }

    /// Every `[[train.phases]]` entry: its sequence fits the position table, and its batch
    /// splits into the accumulation steps.
    fn check_phases(&self) -> Result<(), ConfigError> {
        let t = &self.train;
        for (i, ph) in t.phases.iter().enumerate() {
            let f = |k: &str| format!("train.phases[{i}].{k}");
            if ph.seq_len < 3 || ph.seq_len > self.model.seq_len {
                return Err(bad(
                    f("seq_len"),
                    format!(
                        "{} is outside 3..={} (model.seq_len, the position table)",
                        ph.seq_len, self.model.seq_len
                    ),
                ));
            }
            if ph.batch_size == 0 {
                return Err(bad(f("batch_size"), "must be at least 1"));
            }
            if ph.epochs == 0 {
                return Err(bad(f("epochs"), "must be at least 1"));
            }
            check_accumulation(t.accumulate_steps, ph.batch_size, &f("batch_size"))?;
        }
        Ok(())
    }

    /// Every integer of the config against its [`Bound`].
    fn check_bounds(&self) -> Result<(), ConfigError> {
        let (m, t, d) = (&self.model, &self.train, &self.data);
        let u = |v: usize| v as u64;
        for (field, value, bound) in [
            ("model.vocab_size", u(m.vocab_size), ROWS),
            ("model.seq_len", u(m.seq_len), SEQ_LEN),
            ("model.d_model", u(m.d_model), WIDTH),
            ("model.heads", u(m.heads), WIDTH),
            ("model.ffn", u(m.ffn), WIDTH),
            ("model.layers", u(m.layers), LAYERS),
            ("model.num_labels", u(m.num_labels), ROWS),
            ("model.type_vocab", u(m.type_vocab), ROWS),
            ("data.max_train", u(d.max_train), TOML_INT),
            ("data.max_valid", u(d.max_valid), TOML_INT),
        ] {
            bound.check(field, value)?;
        }
        t.loop_fields().validate()?;
        let mut epochs = 0u64;
        for (i, ph) in t.phases.iter().enumerate() {
            let f = |k: &str| format!("train.phases[{i}].{k}");
            BATCH.check(&f("batch_size"), u(ph.batch_size))?;
            EPOCHS.check(&f("epochs"), u(ph.epochs))?;
            TOML_INT.check(
                &f("max_steps_per_epoch"),
                u(ph.max_steps_per_epoch.unwrap_or(0)),
            )?;
            epochs = epochs.saturating_add(u(ph.epochs));
        }
        EPOCHS.check("train.phases (epochs of all phases)", epochs)
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

/// The `[train]` fields every kind of run has (encoder and DLRM alike): what the loop reads
/// (comera-train's `LoopSettings::new`) and what [`LoopFields::validate`] checks, once for
/// both kinds.
#[derive(Clone, Debug, PartialEq)]
pub struct LoopFields {
    pub epochs: usize,
    pub batch_size: usize,
    pub seed: u64,
    pub warmup_steps: u64,
    pub decay: Decay,
    pub log_every: usize,
    pub max_steps_per_epoch: usize,
    pub out_dir: PathBuf,
    pub checkpoint_every: u64,
    pub keep_checkpoints: usize,
    pub stop_after_steps: u64,
    pub eval_every: u64,
    pub accumulate_steps: usize,
    pub early_stopping: Option<EarlyStopping>,
}

/// [`LoopFields`] from a `[train]` table of either kind (their shared fields have one name).
macro_rules! loop_fields {
    ($t:expr) => {{
        let t = $t;
        LoopFields {
            epochs: t.epochs,
            batch_size: t.batch_size,
            seed: t.seed,
            warmup_steps: t.warmup_steps,
            decay: t.decay,
            log_every: t.log_every,
            max_steps_per_epoch: t.max_steps_per_epoch,
            out_dir: t.out_dir.clone(),
            checkpoint_every: t.checkpoint_every,
            keep_checkpoints: t.keep_checkpoints,
            stop_after_steps: t.stop_after_steps,
            eval_every: t.eval_every,
            accumulate_steps: t.accumulate_steps,
            early_stopping: t.early_stopping.clone(),
        }
    }};
}

impl TrainConfig {
    /// The fields the loop reads.
    pub fn loop_fields(&self) -> LoopFields {
        loop_fields!(self)
    }
}

impl DlrmTrainConfig {
    /// The fields the loop reads.
    pub fn loop_fields(&self) -> LoopFields {
        loop_fields!(self)
    }
}

impl LoopFields {
    /// Each value, named when wrong: bounds first, then what the loop needs.
    fn validate(&self) -> Result<(), ConfigError> {
        let u = |v: usize| v as u64;
        for (field, value, bound) in [
            ("train.epochs", u(self.epochs), EPOCHS),
            ("train.batch_size", u(self.batch_size), BATCH),
            ("train.seed", self.seed, TOML_INT),
            ("train.warmup_steps", self.warmup_steps, TOML_INT),
            ("train.log_every", u(self.log_every), TOML_INT),
            (
                "train.max_steps_per_epoch",
                u(self.max_steps_per_epoch),
                TOML_INT,
            ),
            ("train.checkpoint_every", self.checkpoint_every, TOML_INT),
            ("train.keep_checkpoints", u(self.keep_checkpoints), TOML_INT),
            ("train.stop_after_steps", self.stop_after_steps, TOML_INT),
            ("train.eval_every", self.eval_every, TOML_INT),
            ("train.accumulate_steps", u(self.accumulate_steps), BATCH),
        ] {
            bound.check(field, value)?;
        }
        if let Some(es) = &self.early_stopping {
            TOML_INT.check("train.early_stopping.patience", u(es.patience))?;
        }
        if self.epochs == 0 {
            return Err(bad("train.epochs", "must be at least 1"));
        }
        if self.batch_size == 0 {
            return Err(bad("train.batch_size", "must be at least 1"));
        }
        if self.log_every == 0 {
            return Err(bad("train.log_every", "must be at least 1"));
        }
        if let Some(es) = &self.early_stopping {
            es.validate()?;
        }
        if self.out_dir.as_os_str().is_empty() {
            return Err(bad("train.out_dir", "empty; name the run directory"));
        }
        check_accumulation(self.accumulate_steps, self.batch_size, "train.batch_size")
    }
}

/// `train.accumulate_steps` must be at least 1 and divide the batch size `batch` (`field`).
fn check_accumulation(steps: usize, batch: usize, field: &str) -> Result<(), ConfigError> {
    if steps == 0 {
        return Err(bad("train.accumulate_steps", "must be at least 1"));
    }
    if !batch.is_multiple_of(steps) {
        return Err(bad("train.accumulate_steps", format!("{steps} does not divide {field} = {batch} (each step runs {steps} micro-batches of equal size)"
        )));
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

/// Whether lower or higher is better.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopMode {
    Min,
    Max,
}

impl EarlyStopping {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.patience == 0 {
            return Err(bad("train.early_stopping.patience", "must be at least 1"));
        }
        if !(self.min_delta >= 0.0 && self.min_delta.is_finite()) {
            return Err(bad(
                "train.early_stopping.min_delta",
                format!("must be a finite number ≥ 0, got {}", self.min_delta),
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
    pub fn value(&self, s: &EvalStats) -> Option<f64> {
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
    pub fn from_toml(path: &Path, text: &str) -> crate::Result<DlrmRunConfig> {
        parse(path, text, DlrmRunConfig::validate)
    }

    pub fn from_file(path: &Path) -> crate::Result<DlrmRunConfig> {
        Self::from_toml(path, &read_config(path)?)
    }

    /// Checks every table; the message names the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        // Bounds first: table layouts are proposed from these numbers.
        self.check_bounds()?;
        self.dlrm.validate()?;
        self.optim.validate()?;
        if let Some(r) = &self.rank {
            r.validate()?;
        }
        let d = &self.data;
        if !(0.0..1.0).contains(&d.valid_fraction) {
            return Err(bad(
                "data.valid_fraction",
                format!("must be in [0, 1), got {}", d.valid_fraction),
            ));
        }
        if d.mapping.parse::<comera_data::ctr::CatMapping>().is_err() {
            return Err(bad(
                "data.mapping",
                format!("`{}` is not `hash` or `modulo`", d.mapping),
            ));
        }
        if d.source == comera_dlrm::CtrSource::Criteo && d.train.is_none() {
            return Err(bad("data.train", "the criteo source needs a training file"));
        }
        if !d.table_sizes.is_empty() && d.table_sizes.len() != comera_data::ctr::CRITEO_CATS {
            return Err(bad(
                "data.table_sizes",
                format!(
                    "Criteo has {} categorical fields, got {} sizes",
                    comera_data::ctr::CRITEO_CATS,
                    d.table_sizes.len()
                ),
            ));
        }
        if d.table_sizes.contains(&0) {
            return Err(bad("data.table_sizes", "every table needs at least 1 row"));
        }
        if d.table_sizes.is_empty() && d.total_rows < comera_data::ctr::CRITEO_CATS * 4 {
            return Err(bad("data.total_rows", "at least 104 (4 rows per table)"));
        }
        if !(d.zipf_s > 0.0 && d.zipf_s.is_finite()) {
            return Err(bad("data.zipf_s", format!("must be > 0, got {}", d.zipf_s)));
        }
        if !(0.0..1.0).contains(&d.missing) {
            return Err(bad(
                "data.missing",
                format!("must be in [0, 1), got {}", d.missing),
            ));
        }
        Ok(())
    }

    /// Every integer of the config against its [`Bound`].
    fn check_bounds(&self) -> Result<(), ConfigError> {
        let (m, t, d) = (&self.dlrm, &self.train, &self.data);
        let u = |v: usize| v as u64;
        for (field, value, bound) in [
            ("dlrm.embedding_dim", u(m.embedding_dim), WIDTH),
            ("dlrm.ttm_threshold", u(m.ttm_threshold), TOML_INT),
            ("dlrm.ttm_cores", u(m.ttm_cores), TTM_CORES),
            ("dlrm.ttm_rank", u(m.ttm_rank), WIDTH),
            ("data.max_train", u(d.max_train), TOML_INT),
            ("data.max_valid", u(d.max_valid), TOML_INT),
            ("data.total_rows", u(d.total_rows), TABLE_ROWS),
            ("data.synthetic_train", u(d.synthetic_train), TOML_INT),
            ("data.synthetic_valid", u(d.synthetic_valid), HELD_EXAMPLES),
            ("data.max_malformed", d.max_malformed, TOML_INT),
        ] {
            bound.check(field, value)?;
        }
        t.loop_fields().validate()?;
        for (name, widths) in [
            ("dlrm.bottom_mlp", &m.bottom_mlp),
            ("dlrm.top_mlp", &m.top_mlp),
        ] {
            for (i, &w) in widths.iter().enumerate() {
                WIDTH.check(&format!("{name}[{i}]"), u(w))?;
            }
        }
        for (i, &rows) in d.table_sizes.iter().enumerate() {
            TABLE_ROWS.check(&format!("data.table_sizes[{i}]"), u(rows))?;
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
    pub fn from_toml(path: &Path, text: &str) -> crate::Result<AnyRunConfig> {
        Ok(if is_dlrm_config(text) {
            AnyRunConfig::Dlrm(DlrmRunConfig::from_toml(path, text)?)
        } else {
            AnyRunConfig::Encoder(RunConfig::from_toml(path, text)?)
        })
    }

    /// [`AnyRunConfig::from_toml`] with `settings` (`--set section.key=value`, see
    /// [`Setting`]) applied to the file's tables first, so they are checked like the file:
    /// an error that a setting causes names the setting.
    pub fn from_toml_with(
        path: &Path,
        text: &str,
        settings: &[Setting],
    ) -> crate::Result<AnyRunConfig> {
        if settings.is_empty() {
            return Self::from_toml(path, text);
        }
        let mut table: toml::Table = text.parse().map_err(|e| Error::parse(path, e))?;
        if !table.contains_key("dlrm") {
            // What a config without `[model]` gets (`RunConfig::from_toml`), made explicit
            // so that a setting changes it rather than replacing it.
            let builtin = RunConfig::builtin();
            if !table.contains_key("model") {
                for (key, value) in [
                    ("model", toml::Value::try_from(&builtin.model)),
                    ("optim", toml::Value::try_from(&builtin.optim)),
                    ("rank", toml::Value::try_from(&builtin.rank)),
                ] {
                    if key == "model" || !table.contains_key(key) {
                        table.insert(key.into(), value.expect("the built-in config serialises"));
                    }
                }
            }
        }
        let original = table.clone();
        for s in settings {
            s.apply(&mut table)?;
        }
        let e = match Self::from_toml(Path::new(""), &table.to_string()) {
            Ok(cfg) => return Ok(cfg),
            Err(e) => e,
        };
        if let Some(s) = settings.iter().find(|s| s.sets(&e)) {
            return Err(s.error_of(e));
        }
        if let Error::Parse { .. } = e {
            // A value of the wrong type or an unknown field: the setting that alone causes it.
            for s in settings {
                let mut one = original.clone();
                s.apply(&mut one)?;
                if let Err(e @ Error::Parse { .. }) =
                    Self::from_toml(Path::new(""), &one.to_string())
                {
                    return Err(s.error_of(e));
                }
            }
        }
        // The file alone is a valid config: the settings made it invalid (e.g. two settings
        // of the rank schedule's switch). Named after the setting of the same table.
        if Self::from_toml(path, text).is_ok() {
            let table_of = |f: &str| f.split(['.', '[']).next().unwrap_or_default().to_string();
            let field = match &e {
                Error::Config(c) => table_of(&c.field),
                _ => String::new(),
            };
            let s = settings
                .iter()
                .rev()
                .find(|s| s.key[0] == field)
                .unwrap_or(&settings[settings.len() - 1]);
            return Err(s.error_of(e));
        }
        // An error of the file's own fields: named with their place in the file.
        Err(match e {
            Error::Config(c) => ConfigError::new(c.field, c.reason)
                .in_file(path, text)
                .into(),
            other => other,
        })
    }

    pub fn from_file(path: &Path) -> crate::Result<AnyRunConfig> {
        Self::from_toml(path, &read_config(path)?)
    }

    /// [`AnyRunConfig::from_file`] with `settings` ([`AnyRunConfig::from_toml_with`]).
    pub fn from_file_with(path: &Path, settings: &[Setting]) -> crate::Result<AnyRunConfig> {
        Self::from_toml_with(path, &read_config(path)?, settings)
    }

    /// The built-in run ([`RunConfig::builtin`]) with `settings`.
    pub fn builtin_with(settings: &[Setting]) -> crate::Result<AnyRunConfig> {
        let builtin = RunConfig::builtin();
        if settings.is_empty() {
            return Ok(AnyRunConfig::Encoder(builtin));
        }
        Self::from_toml_with(Path::new("(built-in config)"), &builtin.to_toml(), settings)
    }

    /// The config of `comera train`: the file (or the built-in run) with `settings`, then the
    /// flags of `overrides`. A setting and a flag of the same field are an error naming both;
    /// `--data FILE` fills in the data table's defaults for the file (its source, columns and
    /// labels found in it), and a `--set data.…` of a column or label field wins over them.
    pub fn resolve(
        config: Option<&Path>,
        settings: &[Setting],
        overrides: &Overrides,
    ) -> crate::Result<AnyRunConfig> {
        overrides.check_settings(settings)?;
        let mut cfg = match config {
            Some(p) => AnyRunConfig::from_file_with(p, settings)?,
            None => AnyRunConfig::builtin_with(settings)?,
        };
        cfg.apply(overrides)?;
        let data_settings: Vec<Setting> = settings
            .iter()
            .filter(|s| s.key[0] == "data")
            .cloned()
            .collect();
        if overrides.data.is_some() && !data_settings.is_empty() {
            let origin = config.unwrap_or(Path::new("(built-in config)"));
            cfg = AnyRunConfig::from_toml_with(origin, &cfg.to_toml(), &data_settings)?;
        }
        Ok(cfg)
    }

    /// The run directory.
    pub fn out_dir_mut(&mut self) -> &mut PathBuf {
        match self {
            AnyRunConfig::Encoder(c) => &mut c.train.out_dir,
            AnyRunConfig::Dlrm(c) => &mut c.train.out_dir,
        }
    }

    /// The run's epochs (over all its phases).
    pub fn epochs(&self) -> usize {
        match self {
            AnyRunConfig::Encoder(c) => c.phases().iter().map(|p| p.epochs).sum(),
            AnyRunConfig::Dlrm(c) => c.train.epochs,
        }
    }

    /// Adds `n` epochs: to `train.epochs`, or to the last of `[[train.phases]]`; checked.
    pub fn add_epochs(&mut self, n: usize) -> Result<(), ConfigError> {
        match self {
            AnyRunConfig::Encoder(c) => {
                let epochs = match c.train.phases.last_mut() {
                    Some(p) => &mut p.epochs,
                    None => &mut c.train.epochs,
                };
                *epochs = epochs.saturating_add(n);
                c.validate()
            }
            AnyRunConfig::Dlrm(c) => {
                c.train.epochs = c.train.epochs.saturating_add(n);
                c.validate()
            }
        }
        .map_err(|e| ConfigError::new("--extend-epochs", e.to_string()))
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
    /// Train on this file (`.csv`, `.tsv`, `.jsonl`, `.parquet`: the source from its
    /// extension; columns and labels as `[data]` names them, or found in the file).
    pub data: Option<PathBuf>,
    /// Validate on this file (with `data`; without it, `data.valid_fraction` is held out).
    pub valid: Option<PathBuf>,
    /// Distil from this teacher (`distill.teacher`; a `[distill]` table with its defaults
    /// when the config has none).
    pub teacher: Option<PathBuf>,
    /// Train on this device (`train.device`).
    pub device: Option<DeviceSpec>,
}

impl Overrides {
    /// The flags given, each with the config fields it sets (`--data FILE` sets the data file,
    /// its format and their digests; `--valid` the validation file).
    fn given_flags(&self) -> Vec<(&'static str, &'static [&'static str])> {
        let data: &'static [&'static str] = &[
            "data.source",
            "data.train",
            "data.valid",
            "data.train_sha256",
            "data.valid_sha256",
        ];
        [
            ("--epochs", self.epochs.is_some(), &["train.epochs"][..]),
            (
                "--batch-size",
                self.batch_size.is_some(),
                &["train.batch_size"],
            ),
            ("--seed", self.seed.is_some(), &["train.seed"]),
            ("--out", self.out.is_some(), &["train.out_dir"]),
            (
                "--max-steps-per-epoch",
                self.max_steps_per_epoch.is_some(),
                &["train.max_steps_per_epoch"],
            ),
            (
                "--stop-after-steps",
                self.stop_after_steps.is_some(),
                &["train.stop_after_steps"],
            ),
            (
                "--init-from",
                self.init_from.is_some(),
                &["train.init_from"],
            ),
            ("--teacher", self.teacher.is_some(), &["distill.teacher"]),
            ("--device", self.device.is_some(), &["train.device"]),
            ("--data", self.data.is_some(), data),
            (
                "--valid",
                self.valid.is_some(),
                &["data.valid", "data.valid_sha256"],
            ),
        ]
        .into_iter()
        .filter(|&(_, given, _)| given)
        .map(|(flag, _, fields)| (flag, fields))
        .collect()
    }

    /// Refuses a `--set` of a field that a given flag sets too: which of the two was meant?
    pub fn check_settings(&self, settings: &[Setting]) -> Result<(), ConfigError> {
        for s in settings {
            let field = s.field();
            for (flag, fields) in self.given_flags() {
                if fields.contains(&field.as_str()) {
                    return Err(ConfigError::new(
                        format!("--set {}", s.text),
                        format!("{flag} sets {field} too; give one of the two"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Each flag against the [`Bound`] of the field it sets; the error names the flag.
    fn check_bounds(&self) -> Result<(), ConfigError> {
        let u = |v: Option<usize>| v.map(|v| v as u64);
        for (flag, value, bound) in [
            ("--epochs", u(self.epochs), EPOCHS),
            ("--batch-size", u(self.batch_size), BATCH),
            ("--seed", self.seed, TOML_INT),
            (
                "--max-steps-per-epoch",
                u(self.max_steps_per_epoch),
                TOML_INT,
            ),
            ("--stop-after-steps", self.stop_after_steps, TOML_INT),
        ] {
            if let Some(v) = value {
                bound.check(flag, v)?;
            }
        }
        Ok(())
    }
}

impl AnyRunConfig {
    /// Where a resumed run goes on (`--resume DIR --device D`); DLRM runs stay on the CPU.
    pub fn set_device(&mut self, device: DeviceSpec) -> Result<(), ConfigError> {
        match self {
            AnyRunConfig::Encoder(cfg) => cfg.train.device = device,
            AnyRunConfig::Dlrm(_) if device.is_cuda() => {
                return Err(ConfigError::new("--device", DLRM_ON_CPU));
            }
            AnyRunConfig::Dlrm(_) => {}
        }
        Ok(())
    }

    /// Applies `o` and checks the result; errors name the flag or field.
    pub fn apply(&mut self, o: &Overrides) -> crate::Result<()> {
        o.check_bounds()?;
        match self {
            AnyRunConfig::Encoder(cfg) => {
                if !cfg.train.phases.is_empty() && (o.epochs.is_some() || o.batch_size.is_some()) {
                    return Err(bad(
                        "--epochs / --batch-size",
                        "this config has [[train.phases]]; set epochs and batch_size per phase there",
                    )
                    .into());
                }
                if o.max_steps_per_epoch.is_some()
                    && cfg
                        .train
                        .phases
                        .iter()
                        .any(|p| p.max_steps_per_epoch.is_some())
                {
                    return Err(bad(
                        "--max-steps-per-epoch",
                        "this config's [[train.phases]] set max_steps_per_epoch, which would override it; set it per phase there",
                    )
                    .into());
                }
                if let Some(file) = &o.data {
                    cfg.data.use_file(file, o.valid.as_deref())?;
                } else if o.valid.is_some() {
                    return Err(bad("--valid", "goes with --data FILE").into());
                }
                let t = &mut cfg.train;
                set(&mut t.epochs, o.epochs);
                set(&mut t.batch_size, o.batch_size);
                set(&mut t.seed, o.seed);
                set(&mut t.out_dir, o.out.clone());
                set(&mut t.max_steps_per_epoch, o.max_steps_per_epoch);
                set(&mut t.stop_after_steps, o.stop_after_steps);
                set(&mut t.device, o.device);
                if let Some(v) = &o.init_from {
                    t.init_from = Some(v.clone());
                }
                if let Some(dir) = &o.teacher {
                    match &mut cfg.distill {
                        Some(d) => d.teacher = Some(dir.clone()),
                        None => cfg.distill = Some(DistillConfig::with_teacher(dir.clone())),
                    }
                }
                if o.dense {
                    cfg.model.make_dense();
                }
                Ok(cfg.validate()?)
            }
            AnyRunConfig::Dlrm(cfg) => {
                if o.data.is_some() || o.valid.is_some() {
                    return Err(bad(
                        "--data",
                        "a DLRM run reads click logs named in its config's [data] table (data.train)",
                    )
                    .into());
                }
                if o.init_from.is_some() {
                    return Err(bad(
                        "--init-from",
                        "a DLRM run has no pre-trained encoder to start from",
                    )
                    .into());
                }
                if o.device.is_some_and(DeviceSpec::is_cuda) {
                    return Err(bad("--device", DLRM_ON_CPU).into());
                }
                if o.teacher.is_some() {
                    return Err(bad(
                        "--teacher",
                        "distillation trains a text classifier; a DLRM run has no teacher",
                    )
                    .into());
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
                Ok(cfg.validate()?)
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

/// One `--set section.key=value`: a config field and its value. The value is read as a TOML
/// value (`3`, `0.5`, `true`, `["a", "b"]`, `"text"`), and as a string when it is not one
/// (`--set data.train=my.csv`). A numeric part of the key indexes an array of tables
/// (`train.phases.1.epochs`).
#[derive(Clone, Debug, PartialEq)]
pub struct Setting {
    /// The argument as given.
    pub text: String,
    pub key: Vec<String>,
    pub value: toml::Value,
}

impl std::str::FromStr for Setting {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Setting, ConfigError> {
        let bad = |why: &str| ConfigError::new(format!("--set {text}"), why.to_string());
        let (key, value) = text
            .split_once('=')
            .ok_or_else(|| bad("expected section.key=value (e.g. train.epochs=3)"))?;
        let key: Vec<String> = key
            .trim()
            .split('.')
            .map(|k| k.trim().to_string())
            .collect();
        if key.len() < 2 || key.iter().any(String::is_empty) {
            return Err(bad(
                "expected a dotted field such as train.epochs or model.layers (the table, then the key)",
            ));
        }
        let value = value.trim();
        // One TOML value (a number, a string, an array, an inline table), else the text as a
        // string. Text that parses only as several lines of TOML (`5\nx = 1`) is refused:
        // its second line would be dropped.
        let value = match format!("v = {value}").parse::<toml::Table>() {
            Ok(mut t) if t.len() == 1 => t.remove("v").expect("the one key"),
            _ if value.contains(['\n', '\r']) => {
                return Err(bad(
                    "the value holds a line break; a --set value is one TOML value (quote a string, e.g. data.text_a='\"body\"')",
                ))
            }
            _ => toml::Value::String(value.to_string()),
        };
        Ok(Setting {
            text: text.to_string(),
            key,
            value,
        })
    }
}

impl Setting {
    /// The field as a config error names it (`train.phases[1].epochs`).
    fn field(&self) -> String {
        let mut out = String::new();
        for k in &self.key {
            match k.parse::<usize>() {
                Ok(i) => out.push_str(&format!("[{i}]")),
                Err(_) if out.is_empty() => out.push_str(k),
                Err(_) => out.push_str(&format!(".{k}")),
            }
        }
        out
    }

    /// Sets the field in `table` (creating tables on the way).
    fn apply(&self, table: &mut toml::Table) -> Result<(), ConfigError> {
        let mut root = toml::Value::Table(std::mem::take(table));
        let result = self.apply_to(&mut root);
        if let toml::Value::Table(t) = root {
            *table = t;
        }
        result
    }

    fn apply_to(&self, root: &mut toml::Value) -> Result<(), ConfigError> {
        let bad = |why: String| ConfigError::new(format!("--set {}", self.text), why);
        let (last, path) = self.key.split_last().expect("a key has two parts or more");
        let mut here = root;
        let mut walked = String::new();
        for k in path {
            walked.push_str(if walked.is_empty() { "" } else { "." });
            walked.push_str(k);
            here = match (here, k.parse::<usize>()) {
                (toml::Value::Array(items), Ok(i)) => {
                    let n = items.len();
                    items.get_mut(i).ok_or_else(|| {
                        bad(format!(
                            "{walked}: the array has {n} entries (0 to {})",
                            n.saturating_sub(1)
                        ))
                    })?
                }
                (toml::Value::Table(t), _) => {
                    let indexed = self.key[walked.matches('.').count() + 1..]
                        .first()
                        .is_some_and(|next| next.parse::<usize>().is_ok());
                    if indexed && !t.contains_key(k) {
                        return Err(bad(format!(
                            "{walked}: the config has no such array of tables to index"
                        )));
                    }
                    t.entry(k.clone())
                        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                }
                (other, _) => {
                    return Err(bad(format!(
                        "{walked}: is {}, not a table",
                        other.type_str()
                    )))
                }
            };
        }
        match here {
            toml::Value::Table(t) => {
                t.insert(last.clone(), self.value.clone());
                Ok(())
            }
            other => Err(bad(format!(
                "{walked}: is {}, not a table",
                other.type_str()
            ))),
        }
    }

    /// Whether `e` is about this setting's field.
    fn sets(&self, e: &Error) -> bool {
        matches!(e, Error::Config(c) if c.field == self.field() || c.field.starts_with(&format!("{}[", self.field())))
    }

    /// `e` as an error of this setting: `--set KEY=VALUE: reason`.
    fn error_of(&self, e: Error) -> Error {
        let reason = match &e {
            Error::Config(c) if c.field == self.field() => c.reason.clone(),
            Error::Config(c) => format!("{}: {}", c.field, c.reason),
            Error::Parse { source, .. } => match source.downcast_ref::<toml::de::Error>() {
                Some(t) => t.message().to_string(),
                None => source.to_string(),
            },
            other => crate::error::Chain(other).to_string(),
        };
        ConfigError::new(format!("--set {}", self.text), reason).into()
    }
}

fn set<T>(field: &mut T, v: Option<T>) {
    if let Some(v) = v {
        *field = v;
    }
}

/// Whether `text` is a SHA-256 digest as the run files write one: 64 hex digits.
fn is_sha256(text: &str) -> bool {
    text.len() == 64 && text.chars().all(|c| c.is_ascii_hexdigit())
}

/// The text of a config file; the error names it.
fn read_config(path: &Path) -> crate::Result<String> {
    comera_data::regular::read_regular_to_string(path).io(path, "cannot read config")
}

/// Parses and checks a config; errors name the file and the offending key, line or field.
fn parse<T: serde::de::DeserializeOwned>(
    path: &Path,
    text: &str,
    validate: impl Fn(&T) -> Result<(), ConfigError>,
) -> crate::Result<T> {
    let cfg: T = toml::from_str(text).map_err(|e| Error::parse(path, e))?;
    // A field set in the file points at its line and column, like the TOML parser's own
    // errors.
    validate(&cfg).map_err(|e| e.in_file(path, text))?;
    Ok(cfg)
}

/// A TOML value with the byte span of every value inside it. (The `toml` crate cannot span a
/// table named only by a dotted header such as `[[train.phases]]` without `[train]`: such a
/// document has no positions, and its errors name the field only.)
enum SpannedValue {
    Table(Vec<(String, toml::Spanned<SpannedValue>)>),
    Array(Vec<toml::Spanned<SpannedValue>>),
    Leaf,
}

impl<'de> Deserialize<'de> for SpannedValue {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{MapAccess, SeqAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = SpannedValue;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a TOML value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<SpannedValue, A::Error> {
                let mut entries = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    entries.push((key, map.next_value()?));
                }
                Ok(SpannedValue::Table(entries))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<SpannedValue, A::Error> {
                let mut items = Vec::new();
                while let Some(v) = seq.next_element()? {
                    items.push(v);
                }
                Ok(SpannedValue::Array(items))
            }
            fn visit_bool<E>(self, _: bool) -> Result<SpannedValue, E> {
                Ok(SpannedValue::Leaf)
            }
            fn visit_i64<E>(self, _: i64) -> Result<SpannedValue, E> {
                Ok(SpannedValue::Leaf)
            }
            fn visit_u64<E>(self, _: u64) -> Result<SpannedValue, E> {
                Ok(SpannedValue::Leaf)
            }
            fn visit_f64<E>(self, _: f64) -> Result<SpannedValue, E> {
                Ok(SpannedValue::Leaf)
            }
            fn visit_str<E>(self, _: &str) -> Result<SpannedValue, E> {
                Ok(SpannedValue::Leaf)
            }
            fn visit_enum<A: serde::de::EnumAccess<'de>>(
                self,
                _: A,
            ) -> Result<SpannedValue, A::Error> {
                Ok(SpannedValue::Leaf)
            }
        }
        d.deserialize_any(V)
    }
}

/// The 1-based line and column of the value of `field` (`train.epochs`,
/// `train.phases[1].seq_len`, `data.label_names[2]`) in the TOML `text`, if the file sets it.
fn field_position(text: &str, field: &str) -> Option<(usize, usize)> {
    let root: toml::Spanned<SpannedValue> = toml::from_str(text).ok()?;
    let mut node = &root;
    for part in field.split('.') {
        let (key, indices) = match part.find('[') {
            Some(i) => (&part[..i], &part[i..]),
            None => (part, ""),
        };
        let SpannedValue::Table(entries) = node.get_ref() else {
            return None;
        };
        node = &entries.iter().find(|(k, _)| k == key)?.1;
        for index in indices.split_terminator(']') {
            let i: usize = index.strip_prefix('[')?.parse().ok()?;
            let SpannedValue::Array(items) = node.get_ref() else {
                return None;
            };
            node = items.get(i)?;
        }
    }
    let start = node.span().start;
    let before = text.get(..start)?;
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    Some((line, column))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoder(text: &str) -> String {
        RunConfig::from_toml(Path::new("c.toml"), text)
            .unwrap_err()
            .to_string()
    }

    fn dlrm(text: &str) -> String {
        DlrmRunConfig::from_toml(Path::new("d.toml"), text)
            .unwrap_err()
            .to_string()
    }

    /// Epochs once planned a vector entry each before the first step: 2^32 aborted on a
    /// 103 GB allocation, 2^62 panicked, 10^9 filled 24 GB (issue 35).
    #[test]
    fn epochs_beyond_the_limit_are_refused_with_the_line() {
        for n in ["4294967296", "1000000000", "4611686018427387904"] {
            let msg = encoder(&format!("[train]\nlog_every = 5\nepochs = {n}\n"));
            assert_eq!(
                msg,
                format!(
                    "c.toml:3:10: train.epochs: {n} is more than the limit 1000000; {}",
                    EPOCHS.why
                )
            );
        }
        let msg = encoder(
            "[model]\nseq_len = 64\n[[train.phases]]\nseq_len = 32\nbatch_size = 8\nepochs = 1\n\n[[train.phases]]\nseq_len = 64\nbatch_size = 8\nepochs = 5000000\n",
        );
        assert!(
            msg.starts_with("c.toml: train.phases[1].epochs: 5000000 is more than the limit"),
            "{msg}"
        );
        let phase = "[[train.phases]]\nseq_len = 32\nbatch_size = 8\nepochs = 600000\n";
        let msg = encoder(&format!("[model]\nseq_len = 64\n{phase}{phase}"));
        assert!(
            msg.contains("train.phases (epochs of all phases): 1200000 is more than"),
            "{msg}"
        );
        let mut ok = RunConfig::builtin();
        ok.train.epochs = 1_000_000;
        ok.validate().unwrap();
    }

    #[test]
    fn sizes_beyond_their_limits_name_the_field() {
        for (text, field) in [
            ("[model]\nd_model = 1099511627776\n", "model.d_model"),
            (
                "[model]\nvocab_size = 4611686018427387904\n",
                "model.vocab_size",
            ),
            ("[model]\nseq_len = 1000000\n", "model.seq_len"),
            ("[model]\nlayers = 100000\n", "model.layers"),
            ("[train]\nbatch_size = 100000000\n", "train.batch_size"),
        ] {
            let msg = encoder(text);
            assert!(msg.starts_with("c.toml:2:"), "{msg}");
            assert!(
                msg.contains(&format!("{field}: ")) && msg.contains("is more than the limit"),
                "{msg}"
            );
        }
    }

    #[test]
    fn command_line_values_beyond_their_limits_name_the_flag() {
        let big = i64::MAX as u64 + 1;
        for (o, flag) in [
            (
                Overrides {
                    seed: Some(big),
                    ..Overrides::default()
                },
                "--seed",
            ),
            (
                Overrides {
                    stop_after_steps: Some(big),
                    ..Overrides::default()
                },
                "--stop-after-steps",
            ),
            (
                Overrides {
                    max_steps_per_epoch: Some(big as usize),
                    ..Overrides::default()
                },
                "--max-steps-per-epoch",
            ),
            (
                Overrides {
                    epochs: Some(big as usize),
                    ..Overrides::default()
                },
                "--epochs",
            ),
            (
                Overrides {
                    batch_size: Some(1 << 30),
                    ..Overrides::default()
                },
                "--batch-size",
            ),
        ] {
            for mut cfg in [
                AnyRunConfig::Encoder(RunConfig::builtin()),
                AnyRunConfig::Dlrm(DlrmRunConfig::default()),
            ] {
                let msg = cfg.apply(&o).unwrap_err().to_string();
                assert!(
                    msg.starts_with(&format!("{flag}: ")) && msg.contains("is more than the limit"),
                    "{msg}"
                );
            }
        }
        // The largest seed is kept and written back.
        let mut cfg = AnyRunConfig::Encoder(RunConfig::builtin());
        cfg.apply(&Overrides {
            seed: Some(i64::MAX as u64),
            ..Overrides::default()
        })
        .unwrap();
        assert!(cfg.to_toml().contains("seed = 9223372036854775807"));
    }

    /// A DLRM's `data.source` outside its set is refused as an encoder's is: by the parser,
    /// with the file's line, or naming the `--set` that gave it, and listing the names.
    #[test]
    fn an_unknown_data_source_is_refused_alike_for_encoder_and_dlrm() {
        let parser_says = |e: Error| match e {
            Error::Parse { path, source } => {
                let t = source
                    .downcast_ref::<toml::de::Error>()
                    .expect("a TOML error");
                (path, t.span().map(|s| s.start), t.message().to_string())
            }
            other => panic!("not a parse error: {other}"),
        };
        let (encoder_file, dlrm_file) = (Path::new("c.toml"), Path::new("d.toml"));
        let encoder = parser_says(
            RunConfig::from_toml(encoder_file, "[data]\nsource = \"bogus\"\n").unwrap_err(),
        );
        let dlrm = parser_says(
            DlrmRunConfig::from_toml(dlrm_file, "[dlrm]\n[data]\nsource = \"bogus\"\n")
                .unwrap_err(),
        );
        let names = |kinds: &str| format!("unknown variant `bogus`, expected one of {kinds}");
        assert_eq!(
            encoder,
            (encoder_file.into(), Some(16), names("`reviews`, `movie-snippets`, `trec`, `mnli`, `tsv`, `csv`, `jsonl`, `parquet`, `corpus`"))
        );
        assert_eq!(
            dlrm,
            (
                dlrm_file.into(),
                Some(23),
                names("`movielens`, `adult`, `criteo`, `synthetic`")
            )
        );
        let set: Setting = "data.source=bogus".parse().unwrap();
        for (text, kinds) in [
            ("[data]\n", "`reviews`, `movie-snippets`"),
            ("[dlrm]\n", "`movielens`, `adult`, `criteo`, `synthetic`"),
        ] {
            let msg =
                AnyRunConfig::from_toml_with(Path::new("x.toml"), text, std::slice::from_ref(&set))
                    .unwrap_err()
                    .to_string();
            assert!(
                msg.starts_with(
                    "--set data.source=bogus: unknown variant `bogus`, expected one of "
                ) && msg.contains(kinds),
                "{msg}"
            );
        }
        // Every name reads back as itself, as run configs on disk spell it.
        for source in [
            comera_dlrm::CtrSource::Movielens,
            comera_dlrm::CtrSource::Adult,
            comera_dlrm::CtrSource::Criteo,
            comera_dlrm::CtrSource::Synthetic,
        ] {
            let mut cfg = DlrmRunConfig::default();
            cfg.data.source = source;
            cfg.data.train = Some("t.tsv".into());
            let text = cfg.to_toml();
            assert!(text.contains(&format!("source = \"{source}\"")), "{text}");
            assert_eq!(DlrmRunConfig::from_toml(dlrm_file, &text).unwrap(), cfg);
        }
    }

    #[test]
    fn dlrm_sizes_and_cores_beyond_their_limits_name_the_field() {
        let msg = dlrm("[dlrm]\nttm_cores = 64\n");
        assert!(
            msg.starts_with("d.toml:2:13: dlrm.ttm_cores: 64 is more than the limit 16;"),
            "{msg}"
        );
        for (text, field) in [
            ("[dlrm]\nembedding_dim = 1000000000\n", "dlrm.embedding_dim"),
            ("[dlrm]\ntop_mlp = [64, 1000000000]\n", "dlrm.top_mlp[1]"),
            (
                "[dlrm]\n[data]\nsynthetic_valid = 1000000000000\n",
                "data.synthetic_valid",
            ),
            (
                "[dlrm]\n[data]\ntotal_rows = 1000000000000\n",
                "data.total_rows",
            ),
            ("[dlrm]\n[train]\nepochs = 4294967296\n", "train.epochs"),
        ] {
            let msg = dlrm(text);
            assert!(
                msg.contains(&format!(" {field}: ")) && msg.contains("is more than the limit"),
                "{msg}"
            );
        }
    }

    #[test]
    fn masked_lm_fields_on_a_classification_run_are_refused() {
        for (field, value) in [
            ("select_prob", "nan"),
            ("tokenizer", "\"sentencepiece\""),
            ("mask_prob", "0.5"),
            ("corpus", "[\"rust-src\"]"),
            ("text_docs", "\"lines\""),
        ] {
            let msg = encoder(&format!("[data]\n{field} = {value}\n"));
            assert!(
                msg.starts_with("c.toml:2:")
                    && msg.contains(&format!("data.{field}: only masked-LM runs")),
                "{msg}"
            );
        }
        // The defaults (as every saved config.toml spells them out) are fine.
        let saved = RunConfig::builtin().to_toml();
        RunConfig::from_toml(Path::new("saved.toml"), &saved).unwrap();
    }

    #[test]
    fn label_names_must_be_distinct_non_empty_and_one_line() {
        for (names, what) in [
            (
                "[\"a\", \"a\"]",
                "data.label_names[1]: \"a\" is also data.label_names[0]",
            ),
            ("[\"a\", \"\"]", "data.label_names[1]: empty name"),
            (
                "[\"a\", \"b\\tc\"]",
                "data.label_names[1]: \"b\\tc\" holds a control character",
            ),
            (
                "[\"a\\nb\", \"c\"]",
                "data.label_names[0]: \"a\\nb\" holds a control character",
            ),
            ("[]", "data.label_names: empty"),
        ] {
            let msg = encoder(&format!("[data]\nlabel_names = {names}\n"));
            assert!(msg.contains(what), "{names}: {msg}");
        }
        let msg = encoder("[data]\nsource = \"tsv\"\nlabels = [\"pos\", \"neg\", \"pos\"]\n");
        assert!(msg.starts_with("c.toml:3:25: data.labels[2]:"), "{msg}");
    }
}
