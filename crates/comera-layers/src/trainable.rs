//! What the training engine needs from a model: [`Model`] (its parameters and its TT/TTM
//! layers, for optimisers, checkpoints and the rank schedule) and [`Trainable`] (a step on a
//! batch loaded into the model's state: forward to a loss, backward).
//!
//! Every trainable model implements both — the encoder with a classifier or masked-LM head and
//! the DLRM — so one step function and one training loop serve them all. A model is planned
//! once for a fixed batch: its [`Trainable::State`] holds every activation and workspace, and
//! the batch is loaded into the state before [`Trainable::forward`].

use crate::{Compressible, Param};

/// What one step (or one evaluation batch) saw.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Mean data loss over the batch's `count` predictions.
    pub loss: f64,
    /// Correct predictions (argmax, or probability ≥ 0.5 for a binary logit).
    pub correct: usize,
    /// Predictions the loss averages over (examples, or labelled tokens).
    pub count: usize,
    /// A distilled step's loss by term (`loss` is their weighted sum); None otherwise.
    pub terms: Option<crate::LossTerms>,
}

/// Bytes a model holds for training, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MemoryBreakdown {
    /// Parameter values.
    pub params: usize,
    /// Parameter gradients.
    pub grads: usize,
    /// Activations, workspaces and scratch of the batch state.
    pub state: usize,
}

impl MemoryBreakdown {
    pub fn total(&self) -> usize {
        self.params + self.grads + self.state
    }
}

/// `f` for a serial visit: each parameter gets the place `*next`, which then moves on (the
/// serial visits a parallel one is made of, starting where the parameters before them end).
pub fn numbered<'a>(
    f: &'a (dyn Fn(usize, &mut Param) + Sync),
    next: &'a mut usize,
) -> impl FnMut(&mut Param) + 'a {
    move |p| {
        f(*next, p);
        *next += 1;
    }
}

/// A model's parameters and its compressible (TT/TTM) layers. Object-safe, so the optimiser
/// and the rank schedule take `&mut dyn Model`.
pub trait Model {
    /// Calls `f` on every parameter in a fixed order (stable names), without allocating.
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param));
    /// Calls `f(i, p)` on every parameter `p`, `i` its place in the order of
    /// [`Model::visit_params_mut`], each parameter once but possibly several on different
    /// threads at once (the optimiser's update, clipping's sums and zeroing over hundreds of
    /// small parameters). Without allocating. The default visits them in order on this thread.
    fn visit_params_par(&mut self, f: &(dyn Fn(usize, &mut Param) + Sync)) {
        let mut next = 0;
        self.visit_params_mut(&mut numbered(f, &mut next));
    }
    /// Every parameter, in the order of [`Model::visit_params_mut`].
    fn params(&self) -> Vec<&Param>;
    /// Calls `f` on every TT/TTM layer in a fixed order.
    fn visit_compressible(&self, f: &mut dyn FnMut(&dyn Compressible));
    /// [`Model::visit_compressible`] with mutable layers, same order, without allocating.
    fn visit_compressible_mut(&mut self, f: &mut dyn FnMut(&mut dyn Compressible));
    /// Trainable scalars.
    fn num_params(&self) -> usize;
    /// Scalars of the same model with every TT/TTM layer dense.
    fn dense_equivalent_params(&self) -> usize;
}

/// A model the training step drives.
pub trait Trainable: Model {
    /// Activations and workspaces for one fixed batch shape, with the loaded batch.
    type State;
    /// Bad input in a batch (an id out of range, …).
    type Error: std::error::Error + Send + Sync + 'static;

    fn zero_grad(&mut self) {
        self.visit_params_par(&|_, p| crate::elementwise::zero(&mut p.grad));
    }

    /// Forward on the batch loaded in `st` to the mean loss and task statistics. With `train`,
    /// dropout is on (masks from `step`) and the loss gradient is left for
    /// [`Trainable::backward`].
    fn forward(
        &self,
        st: &mut Self::State,
        train: bool,
        step: u64,
    ) -> Result<StepStats, Self::Error>;

    /// Backward of the last training forward: accumulates every parameter's gradient.
    fn backward(&mut self, st: &mut Self::State);

    /// Bytes held for training with this state.
    fn bytes(&self, st: &Self::State) -> MemoryBreakdown;
}
