//! Models built from comera layers.
//!
//! - [`config`]: the model's shape (sizes, dense or TT/TTM per layer kind, modes and ranks),
//!   checked with errors that name the offending field;
//! - [`any`]: dense-or-tensorised wrappers (`AnyLinear`, `WordEmbedding`);
//! - [`encoder`]: the six-encoder BERT-style classifier of the paper, planned once for a fixed
//!   batch and sequence length, with explicit forward and backward.

pub mod any;
pub mod config;
pub mod encoder;
pub mod mlm_head;

pub use any::{AnyLinear, WordEmbedding};
pub use config::{ConfigError, EncoderConfig, HeadKind, LayerTt, MlmDecoderKind, TtmConfig};
pub use encoder::{Encoder, EncoderState, Head, StepStats};
pub use mlm_head::{MlmDecoder, MlmHead};
