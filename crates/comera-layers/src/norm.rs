//! LayerNorm.
