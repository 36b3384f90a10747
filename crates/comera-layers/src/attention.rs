//! Multi-head self-attention with a padding mask.
