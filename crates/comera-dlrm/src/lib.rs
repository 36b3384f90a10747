//! DLRM with dense or TTM embedding tables on CTR data (the paper's second experiment,
//! SPEC §5).
//!
//! - [`model`]: the model (bottom MLP, per-field tables chosen dense or TTM, pairwise
//!   dot-product interaction, top MLP) with a hand-derived backward, planned once per batch;
//! - [`loss`]: BCE on logits, AUC;
//! - [`config`]: the run configuration (`[dlrm]`, `[data]`, `[optim]`, `[train]`);
//! - [`data`]: in-memory, streamed-file and synthetic batch sources;
//! - [`train`]: the training loop with evaluation, metrics log, plot, model files and a
//!   throughput/memory report.

pub mod config;
pub mod data;
pub mod loss;
pub mod model;
pub mod train;

pub use config::{is_dlrm_config, DlrmConfig, DlrmRunConfig, TableKind};
pub use model::{propose_ttm_shape, Dlrm, DlrmState, Table};
pub use train::{evaluate, peak_rss_bytes, train, DlrmSummary, EvalStats};
