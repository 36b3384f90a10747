//! The integration tests of this crate as one test binary, a module a file: one link of
//! the engine instead of one a file (each test binary links the whole engine).

mod common;
mod fused_ffn;
mod shared_input;
mod transformer_layers;
mod truncate;
mod tt_linear_grad;
mod ttm_embedding_grad;
