//! DLRM with dense or TTM embedding tables on CTR data (the paper's second experiment,
//! SPEC §5). A model crate: the training loop that drives it is comera-train's.
//!
//! - [`model`]: the model (bottom MLP, per-field tables chosen dense or TTM, pairwise
//!   dot-product interaction, top MLP) with a hand-derived backward, planned once per batch;
//!   it implements [`comera_layers::Trainable`];
//! - [`loss`]: BCE on logits, AUC;
//! - [`config`]: the `[dlrm]` (model) and `[data]` tables of a DLRM run config;
//! - [`data`]: in-memory, streamed-file and synthetic batch sources.

pub mod config;
pub mod data;
pub mod loss;
pub mod model;

pub use config::{CtrSource, DlrmConfig, TableKind};
pub use model::{propose_ttm_shape, Dlrm, DlrmError, DlrmState};
