//! Training runs: the run configuration, the one training loop over tasks (classification,
//! masked LM, click-through prediction), evaluation, the metrics log, plots, checkpoints and
//! model files (safetensors + TOML, written atomically).
//!
//! - [`config`]: run configs (`RunConfig` for the encoder, `DlrmRunConfig`, either as
//!   `AnyRunConfig`), errors naming the file and field;
//! - [`task`]: the [`task::Task`] trait and its encoder and CTR implementations, evaluation;
//! - [`trainer`]: the loop ([`train`], [`train_dlrm`], [`resume`]) and `TrainSummary`, in three
//!   files: `setup` (config → data, model, run directory), `run` (the loop, top to bottom) and
//!   `report` (records, messages, plots, `ranks.md`);
//! - [`error`]: the crate's [`Error`] (typed, with the lower crates' errors as sources);
//! - [`checkpoint`]: checkpoints with exact resume;
//! - [`run_dir`]: a run directory's identity, lock, fresh start or resume;
//! - [`observe`]: typed metrics records, the loop's events and observers (a library user's
//!   window on a run, and a way to stop it);
//! - [`console`]: the terminal's view of a run (progress bar and messages), an observer;
//! - [`interrupt`]: the graceful stop (first SIGINT/SIGTERM: checkpoint after the step);
//! - [`infer`]: evaluation and predictions of a saved model of any kind;
//! - [`files`]: atomic writes, model files of every kind, the metrics log;
//! - [`outputs`]: what comera may write and replace outside a run directory (exports, pages);
//! - [`device`]: the seam between the loop and the device its steps run on (CPU, CUDA);
//! - [`data`]: the encoder's data (labelled examples, corpora);
//! - [`inputs`]: data handed over in memory, stored as content-addressed data files;
//! - [`distributed`]: data-parallel runs over several processes (feature `mpi`);
//! - [`plot`]: the figures;
//! - [`results`]: runs side by side (`comera report`): tables, plots, the paper's figures;
//! - [`rank`]: the rank schedule (re-exported from comera-optim: every decision it takes is a
//!   method of [`RankController`] in that one file).

pub mod checkpoint;
pub mod config;
pub mod console;
pub mod data;
pub mod device;
pub mod distributed;
pub mod error;
pub mod files;
pub mod infer;
pub mod inputs;
pub mod interrupt;
pub mod observe;
pub mod outputs;
pub mod plot;
pub mod results;
pub mod run_dir;
pub mod task;
pub mod trainer;

pub use comera_cuda::DeviceSpec;
pub use comera_optim::rank;
pub use config::{AnyRunConfig, DataConfig, DlrmRunConfig, Overrides, RunConfig, TrainConfig};
pub use error::{BoxError, Error, Result};
pub use files::{load_model, load_saved, save_model, write_atomic, ModelMeta, SavedModel};
pub use rank::{RankConfig, RankController};
pub use task::EvalStats;
/// Stack of each pool worker, which runs a whole job: the main thread's usual 8 MiB rather than
/// rayon's 2 MiB default (front ends build their pools with it).
pub const WORKER_STACK_BYTES: usize = 8 << 20;

pub use trainer::{
    continue_run, extend_with, peak_rss_bytes, resume, resume_with, train, train_dlrm, Continue,
    Machine, RunOptions, TrainSummary,
};
