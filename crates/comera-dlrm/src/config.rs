//! The DLRM's model (`[dlrm]`) and data (`[data]`) tables of a run config (the run config
//! itself is comera-train's `DlrmRunConfig`). Every field is documented in
//! `configs/dlrm-movielens.toml`; unknown fields are errors, and messages name the field.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

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
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
    pub gate_threshold: f32,
    /// Standard deviation of the initial embedding entries (dense and TTM alike).
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
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

/// A `[dlrm]` setting out of range: the field (`dlrm.embedding_dim`, …) and why.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct ConfigError {
    pub field: &'static str,
    pub reason: String,
}

impl DlrmConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |field, reason: &str| {
            Err(ConfigError {
                field,
                reason: reason.into(),
            })
        };
        if self.embedding_dim == 0 {
            return bad("dlrm.embedding_dim", "must be at least 1");
        }
        if self.bottom_mlp.contains(&0) || self.top_mlp.contains(&0) {
            return bad(
                "dlrm.bottom_mlp / dlrm.top_mlp",
                "widths must be at least 1",
            );
        }
        if self.ttm_cores == 0 {
            return bad("dlrm.ttm_cores", "must be at least 1");
        }
        if self.ttm_rank == 0 {
            return bad("dlrm.ttm_rank", "must be at least 1");
        }
        // τ ≥ 1 would prune every slice of gates initialised at 1 at the first step.
        if !(self.gate_threshold > 0.0 && self.gate_threshold < 1.0) {
            return bad(
                "dlrm.gate_threshold",
                &format!(
                    "must be in (0, 1) (gates start at 1; τ ≥ 1 prunes every rank slice at once), got {}",
                    self.gate_threshold
                ),
            );
        }
        if !(self.embedding_std > 0.0 && self.embedding_std.is_finite()) {
            return bad("dlrm.embedding_std", "must be finite and > 0");
        }
        Ok(())
    }

    /// Training memory in bytes (parameters with gradients and AdamW's moments, and the batch
    /// state) for `n_dense` features, tables of `table_sizes` rows and `batch` examples; an
    /// estimate made before anything is allocated, in f64 so that absurd sizes cannot overflow.
    /// A TTM table of R rows × D is counted as at most c·r²·(R·D)^(1/c) (c cores of rank r).
    pub fn estimate_memory_bytes(
        &self,
        n_dense: usize,
        table_sizes: &[usize],
        batch: usize,
    ) -> f64 {
        let d = self.embedding_dim as f64;
        let (c, r) = (self.ttm_cores as f64, self.ttm_rank as f64);
        let tables: f64 = table_sizes
            .iter()
            .map(|&rows| {
                let dense = rows as f64 * d;
                let ttm = c * r * r * dense.powf(1.0 / c);
                match self.tables {
                    TableKind::Dense => dense,
                    TableKind::Ttm => ttm.min(dense),
                    TableKind::Auto if rows >= self.ttm_threshold => ttm.min(dense),
                    TableKind::Auto => dense,
                }
            })
            .sum();
        let mlp = |widths: &[f64]| -> f64 { widths.windows(2).map(|w| (w[0] + 1.0) * w[1]).sum() };
        let n_f = table_sizes.len() as f64 + 1.0;
        let mut bottom = vec![n_dense as f64];
        bottom.extend(self.bottom_mlp.iter().map(|&w| w as f64));
        bottom.push(d);
        let mut top = vec![d + n_f * (n_f - 1.0) / 2.0];
        top.extend(self.top_mlp.iter().map(|&w| w as f64));
        top.push(1.0);
        let params = tables + mlp(&bottom) + mlp(&top);
        // Per example: every MLP activation and its gradient, the looked-up rows and the
        // pairwise dot products, each twice (value and gradient).
        let per_example = 2.0 * (bottom.iter().sum::<f64>() + top.iter().sum::<f64>() + n_f * d);
        4.0 * (4.0 * params + batch as f64 * per_example)
    }
}

/// Where a DLRM run's examples come from (`data.source`); a name outside the set is refused
/// when the config is read, as the encoder's `data.source` is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CtrSource {
    /// MovieLens-100K (fetched; click = rating ≥ `click_threshold`).
    Movielens,
    /// The Adult census set (fetched; label income > 50K).
    Adult,
    /// Criteo-format files (`train` streamed, `valid` read into memory).
    Criteo,
    /// Generated Criteo-format rows.
    Synthetic,
}

impl CtrSource {
    /// The name in a config file.
    pub fn name(self) -> &'static str {
        match self {
            CtrSource::Movielens => "movielens",
            CtrSource::Adult => "adult",
            CtrSource::Criteo => "criteo",
            CtrSource::Synthetic => "synthetic",
        }
    }
}

impl std::fmt::Display for CtrSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the examples come from (`[data]` table).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CtrDataConfig {
    /// `movielens` (fetched ml-100k), `adult` (fetched), `criteo` (files `train`/`valid`) or
    /// `synthetic` (generated Criteo-format rows).
    pub source: CtrSource,
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
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
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
            source: CtrSource::Movielens,
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
