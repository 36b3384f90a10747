//! Softmax cross-entropy loss.
