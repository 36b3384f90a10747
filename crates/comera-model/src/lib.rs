//! Models built from comera layers.
//!
//! - [`config`]: the model's shape (sizes, dense or TT/TTM per layer kind, modes and ranks
//!   per bond, capped to what a shape can use), checked with errors that name the field;
//! - [`estimate`]: memory at a batch shape before anything is built;
//! - [`Encoder`] implements [`comera_layers::Trainable`] (the one step and loop drive it);
//! - [`encoder`]: the six-encoder BERT-style classifier of the paper, planned once for a fixed
//!   batch and sequence length, with explicit forward and backward.

pub mod config;
pub mod encoder;
pub mod estimate;
pub mod mlm_head;
mod trainable;

pub use comera_layers::any::{AnyEmbedding, AnyLinear};
pub use comera_layers::StepStats;
pub use config::{
    bond_limits, useful_rank, ConfigError, EncoderConfig, HeadKind, LayerTt, MlmDecoderKind, Rank,
    TtmConfig,
};
pub use encoder::{Encoder, EncoderState, Head, KEEP_GELU_MAX_ROWS};
pub use mlm_head::{MlmDecoder, MlmHead};
