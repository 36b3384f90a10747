//! Element-wise activations (GELU, tanh) with backward.
