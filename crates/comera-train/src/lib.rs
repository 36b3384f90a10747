//! Training runs: the run configuration, the training loop with evaluation, the metrics log,
//! plots, and model files (safetensors + TOML, written atomically).

pub mod checkpoint;
pub mod config;
pub mod data;
pub mod files;
pub mod plot;
pub mod rank;
pub mod trainer;

pub use config::{DataConfig, RunConfig, TrainConfig};
pub use files::{load_model, save_model, write_atomic, ModelMeta};
pub use rank::{RankAdaptive, RankConfig, RankController};
pub use trainer::{evaluate, resume, train, EvalStats, TrainSummary};
