//! Layers of the comera engine.
//!
//! Each layer has one explicit forward and one hand-derived backward over flat row-major `f32`
//! buffers, in the style of llm.c. A layer owns its parameters (values and gradients, see
//! [`Param`]); everything a step needs besides them (saved intermediates, scratch space, the
//! contraction plan) lives in a workspace made once for a fixed batch by
//! [`Layer::workspace`] and reused every step, so a steady-state step allocates nothing.
//!
//! Conventions: `Y = X·W + b` with X of shape (batch, in_features); `backward` *accumulates*
//! into the parameters' gradients (`grad += …`, call [`Layer::zero_grad`] between steps) and
//! *writes* dX.
//!
//! Modules:
//! - [`tt_linear`]: [`TtLinear`], the TT linear layer (merged, sequential and dense
//!   contraction paths chosen by `comera-plan`), plus [`tt_linear::FusedFfn`] (a TT
//!   feed-forward block in row blocks), [`tt_linear::SharedInput`] (TT layers reading one input
//!   on one product) and the per-thread scratch pool they lease from;
//! - [`ttm_embedding`]: [`TtmEmbedding`], an embedding table as TTM cores (naive or
//!   deduplicated lookup);
//! - [`gates`]: [`RankGates`], the rank gates on the cores' bonds and the size measures built
//!   from them;
//! - [`compress`]: [`Compressible`], what the rank schedule needs from a gated TT/TTM layer,
//!   and physical truncation of pruned rank slices;
//! - [`linear`], [`embedding`], [`mlp`]: the dense baselines ([`Linear`], [`Embedding`] and
//!   the [`EmbeddingLayer`] interface, [`Mlp`]);
//! - [`any`]: [`AnyLinear`] and [`AnyEmbedding`], dense or tensorised behind one type;
//! - [`attention`]: multi-head self-attention with a padding mask (projections excluded);
//! - [`norm`], [`activation`], [`dropout`], [`elementwise`], [`loss`]: LayerNorm, GELU and
//!   tanh, seeded dropout, residual sums and products, softmax cross-entropy;
//! - [`distill`]: the distillation losses (logit KL at a temperature, hidden-state MSE) and
//!   [`LossTerms`], a distilled step's loss by term;
//! - [`param`]: [`Param`], a named tensor with its gradient and optimiser group;
//! - [`trainable`]: [`Model`] and [`Trainable`], what the training engine needs from a model;
//! - [`config_float`]: config fields held as `f32`, written as their shortest decimal.
//!
//! [`TtLinear`] and [`TtmEmbedding`] have runnable examples of a forward and a backward.

// Index loops mirror the formulas in the comments (core c, bond c + 1, …); keep them.
#![allow(clippy::needless_range_loop)]

pub mod activation;
pub mod any;
pub mod attention;
pub mod compress;
pub mod config_float;
pub mod distill;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
pub mod gates;
pub mod linear;
pub mod loss;
pub mod mlp;
pub mod norm;
pub mod param;
pub mod trainable;
pub mod tt_linear;
pub mod ttm_embedding;

pub use any::{AnyEmbedding, AnyLinear};
pub use compress::{Compressible, Retained};
pub use distill::LossTerms;
pub use embedding::{Embedding, EmbeddingError, EmbeddingLayer};
pub use gates::RankGates;
pub use linear::Linear;
pub use mlp::Mlp;
pub use param::{Param, ParamKind};
pub use trainable::{MemoryBreakdown, Model, StepStats, Trainable};
pub use tt_linear::{TtLinear, TtLinearWorkspace};
pub use ttm_embedding::{Lookup, TtmEmbedding, TtmWorkspace};

use comera_tensor::ShapeError;

/// Errors from building a layer.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error(transparent)]
    Shape(#[from] ShapeError),
    #[error("{name}: expected shape {expected:?}, got {got:?}")]
    ParamShape {
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("threshold must be finite and non-negative, got {0}")]
    Threshold(f32),
}

/// A layer mapping `(batch, in_features)` to `(batch, out_features)`.
pub trait Layer {
    /// Saved intermediates and scratch for one fixed batch size.
    type Workspace;

    fn in_features(&self) -> usize;
    fn out_features(&self) -> usize;

    /// Allocates everything a step at this batch size needs.
    fn workspace(&self, batch: usize) -> Self::Workspace;

    /// `y = f(x)`; saves in `ws` what [`Layer::backward`] needs.
    fn forward(&self, ws: &mut Self::Workspace, x: &[f32], y: &mut [f32]);

    /// Given the `x` of the matching forward and `dy = ∂loss/∂y`, accumulates parameter
    /// gradients and writes `dx` when asked for.
    fn backward(&mut self, ws: &mut Self::Workspace, x: &[f32], dy: &[f32], dx: Option<&mut [f32]>);

    fn params(&self) -> Vec<&Param>;
    fn params_mut(&mut self) -> Vec<&mut Param>;

    /// Calls `f` on every parameter, in the order of [`Layer::params`], without allocating
    /// (optimiser steps use this).
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param));

    fn zero_grad(&mut self) {
        self.visit_params_mut(&mut |p| crate::elementwise::zero(&mut p.grad));
    }

    /// Number of trainable scalars.
    fn num_params(&self) -> usize {
        self.params().iter().map(|p| p.value.len()).sum()
    }
}

/// Panics with a clear message when a buffer does not have the length the layer expects.
/// (Buffer lengths inside the engine are its own invariants; user input is checked earlier.)
#[track_caller]
pub(crate) fn check_len(what: &str, buf: usize, expected: usize) {
    assert_eq!(
        buf, expected,
        "{what}: buffer has {buf} elements, expected {expected}"
    );
}

/// `db[j] += Σ_b dy[b, j]` (bias gradient), summed in row order for determinism. Large
/// buffers run in parallel over column ranges, each summing its columns over every row in
/// order: the same bits on any thread count.
pub fn accumulate_bias_grad(dy: &[f32], db: &mut [f32]) {
    use rayon::prelude::*;
    /// Columns per parallel range (a multiple of 16 lanes; 512 bytes of each row).
    const COLS: usize = 128;
    let w = db.len();
    if dy.len() >= 2 * elementwise::CHUNK && w >= 2 * COLS {
        comera_tensor::for_each(db.par_chunks_mut(COLS).enumerate(), |(i, db)| {
            bias_grad_columns(dy, w, i * COLS, db)
        });
    } else {
        bias_grad_columns(dy, w, 0, db);
    }
}

comera_tensor::multiversion! {
    /// `db[j] += Σ_b dy[b, c0 + j]` for rows of `w` values, in row order.
    pub(crate) fn bias_grad_columns(dy: &[f32], w: usize, c0: usize, db: &mut [f32]) {
        for row in dy.chunks_exact(w) {
            for (g, v) in db.iter_mut().zip(&row[c0..]) {
                *g += v;
            }
        }
    }
}

/// `y[b, :] += bias` for every row; large buffers in parallel chunks of whole rows.
pub fn add_bias(y: &mut [f32], bias: &[f32]) {
    use rayon::prelude::*;
    let chunk = elementwise::CHUNK.div_ceil(bias.len()) * bias.len();
    if y.len() >= 2 * chunk {
        comera_tensor::for_each(y.par_chunks_mut(chunk), |y| add_bias_rows(y, bias));
    } else {
        add_bias_rows(y, bias);
    }
}

comera_tensor::multiversion! {
    /// `y[b, :] += bias` for every row.
    fn add_bias_rows(y: &mut [f32], bias: &[f32]) {
        for row in y.chunks_exact_mut(bias.len()) {
            for (v, b) in row.iter_mut().zip(bias) {
                *v += b;
            }
        }
    }
}
