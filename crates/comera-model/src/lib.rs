//! Models built from comera layers: the BERT-style encoder of the paper, dense or TT/TTM,
//! with a sequence-classification head or a masked-language-model head, trained with explicit
//! forward and backward passes over a state planned once for a fixed batch shape.
//!
//! - [`config`]: the model's shape (sizes, dense or TT/TTM per layer kind, modes and ranks
//!   per bond, capped to what a shape can use, the head), checked with errors that name the
//!   field;
//! - [`estimate`]: memory at a batch shape before anything is built, refused with a
//!   [`MemoryError`] that names the fields to reduce;
//! - [`encoder`]: the [`Encoder`] (embeddings, `layers` post-LN or pre-LN blocks, a head) and
//!   its [`EncoderState`] for one (batch, seq_len); a batch goes in with
//!   [`EncoderState::load`] or [`EncoderState::load_mlm`] ([`BatchError`] when it does not fit);
//! - [`mlm_head`]: the masked-LM head (transform, LayerNorm, dense / tied / TT output
//!   projection) on the labelled positions only;
//! - `trainable`: [`Encoder`] as a [`comera_layers::Trainable`], so that the one training step
//!   and loop drive it with either head.

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
pub use encoder::{
    BatchError, DistillLoss, Encoder, EncoderState, Head, Teacher, KEEP_GELU_MAX_ROWS,
};
pub use estimate::{MemoryError, MemoryEstimate};
pub use mlm_head::{MlmDecoder, MlmHead};
