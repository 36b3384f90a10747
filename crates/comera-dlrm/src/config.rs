//! The DLRM run configuration: one TOML file with `[dlrm]` (the model), `[data]`, `[optim]`,
//! `[train]` tables. Every field is documented in `configs/dlrm-movielens.toml`; unknown fields
//! are errors, and messages name the file and the field.

use comera_optim::{AdamWConfig, Decay};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// How each categorical field's table is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TableKind {
    /// TTM when the table has at least `ttm_threshold` rows, dense otherwise.
    Auto,
    /// Every table dense (the baseline).
    Dense,
    /// Every table TTM.
    Ttm,
}

/// The model (`[dlrm]` table).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DlrmConfig {
    /// Width of every embedding row and of the bottom MLP's output.
    pub embedding_dim: usize,
    /// Hidden widths of the bottom MLP over the dense features (ReLU after every layer; a last
    /// layer to `embedding_dim` is appended).
    pub bottom_mlp: Vec<usize>,
    /// Hidden widths of the top MLP (ReLU between layers; a last layer to 1 logit is appended).
    pub top_mlp: Vec<usize>,
    /// `auto`, `dense` or `ttm`.
    pub tables: TableKind,
    /// Under `auto`, tables with at least this many rows are TTM.
    pub ttm_threshold: usize,
    /// Cores per TTM table (modes proposed from the row count and `embedding_dim`).
    pub ttm_cores: usize,
    /// Uniform TTM rank (clamped per bond to what the modes allow).
    pub ttm_rank: usize,
    /// Rank-gate threshold τ.
    pub gate_threshold: f32,
    /// Standard deviation of the initial embedding entries (dense and TTM alike).
    pub embedding_std: f32,
}

impl Default for DlrmConfig {
    fn default() -> Self {
        DlrmConfig {
            embedding_dim: 16,
            bottom_mlp: vec![64],
            top_mlp: vec![64, 32],
            tables: TableKind::Auto,
            ttm_threshold: 100,
            ttm_cores: 3,
            ttm_rank: 8,
            gate_threshold: 0.01,
            embedding_std: 0.1,
        }
    }
}

impl DlrmConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.embedding_dim == 0 {
            return Err("dlrm.embedding_dim: must be at least 1".into());
        }
        if self.bottom_mlp.contains(&0) || self.top_mlp.contains(&0) {
            return Err("dlrm.bottom_mlp / dlrm.top_mlp: widths must be at least 1".into());
        }
        if self.ttm_cores == 0 {
            return Err("dlrm.ttm_cores: must be at least 1".into());
        }
        if self.ttm_rank == 0 {
            return Err("dlrm.ttm_rank: must be at least 1".into());
        }
        if !(self.gate_threshold >= 0.0 && self.gate_threshold.is_finite()) {
            return Err("dlrm.gate_threshold: must be finite and ≥ 0".into());
        }
        if !(self.embedding_std > 0.0 && self.embedding_std.is_finite()) {
            return Err("dlrm.embedding_std: must be finite and > 0".into());
        }
        Ok(())
    }
}

/// Where the examples come from (`[data]` table).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CtrDataConfig {
    /// `movielens` (fetched ml-100k), `adult` (fetched), `criteo` (files `train`/`valid`) or
    /// `synthetic` (generated Criteo-format rows).
    pub source: String,
    /// Criteo training file (streamed in file order).
    pub train: Option<PathBuf>,
    /// Criteo validation file (read into memory, at most `max_valid` rows).
    pub valid: Option<PathBuf>,
    /// Held-out fraction for `movielens` and `adult`.
    pub valid_fraction: f64,
    /// Use at most this many training / validation examples (0 = all).
    pub max_train: usize,
    pub max_valid: usize,
    /// MovieLens: click = rating ≥ this.
    pub click_threshold: f32,
    /// Criteo / synthetic: rows of each of the 26 tables (empty: from `total_rows`).
    pub table_sizes: Vec<usize>,
    /// Criteo / synthetic: total rows of the 26 tables, split Criteo-like (a few huge tables,
    /// many small) when `table_sizes` is empty.
    pub total_rows: usize,
    /// Criteo: `hash` or `modulo` (the hex value modulo the table size).
    pub mapping: String,
    /// Synthetic: training examples per epoch and validation examples.
    pub synthetic_train: usize,
    pub synthetic_valid: usize,
    /// Synthetic: Zipf exponent of the ids and the share of empty fields.
    pub zipf_s: f64,
    pub missing: f64,
    /// Malformed rows tolerated (counted and reported with line numbers) before the run stops.
    pub max_malformed: u64,
    /// Cache for fetched data (default `$COMERA_DATA` or `~/.cache/comera`).
    pub cache_dir: Option<PathBuf>,
}

impl Default for CtrDataConfig {
    fn default() -> Self {
        CtrDataConfig {
            source: "movielens".into(),
            train: None,
            valid: None,
            valid_fraction: 0.1,
            max_train: 0,
            max_valid: 0,
            click_threshold: 4.0,
            table_sizes: vec![],
            total_rows: 1_000_000,
            mapping: "modulo".into(),
            synthetic_train: 1_000_000,
            synthetic_valid: 100_000,
            zipf_s: 1.1,
            missing: 0.02,
            max_malformed: 100,
            cache_dir: None,
        }
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
    /// Linear warm-up steps, then `decay` (`constant` or `linear` to zero at the last step).
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
        }
    }
}

/// A whole DLRM run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DlrmRunConfig {
    #[serde(default)]
    pub dlrm: DlrmConfig,
    #[serde(default)]
    pub data: CtrDataConfig,
    #[serde(default = "default_optim")]
    pub optim: AdamWConfig,
    #[serde(default)]
    pub train: DlrmTrainConfig,
    /// Rank-adaptive training of the TTM tables (`[rank]`, see comera-train's `rank` module:
    /// size penalty, early/late stage, truncation of pruned rank slices). Off without the table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<comera_train::RankConfig>,
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
            dlrm: DlrmConfig::default(),
            data: CtrDataConfig::default(),
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
        let cfg: DlrmRunConfig =
            toml::from_str(text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        cfg.validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(cfg)
    }

    pub fn from_file(path: &Path) -> anyhow::Result<DlrmRunConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("{}: cannot read config: {e}", path.display()))?;
        Self::from_toml(path, &text)
    }

    /// Checks every table; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        self.dlrm.validate()?;
        self.optim.validate()?;
        if let Some(r) = &self.rank {
            r.validate()?;
        }
        let t = &self.train;
        if t.epochs == 0 {
            return Err("train.epochs: must be at least 1".into());
        }
        if t.batch_size == 0 {
            return Err("train.batch_size: must be at least 1".into());
        }
        if t.log_every == 0 {
            return Err("train.log_every: must be at least 1".into());
        }
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
