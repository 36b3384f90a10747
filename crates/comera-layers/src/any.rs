//! Dense-or-tensorised layers, so a model is written once for both: [`AnyLinear`] (dense or
//! TT) and [`AnyEmbedding`] (dense or TTM), used by the encoder and the DLRM alike.

use crate::embedding::EmbeddingWorkspace;
use crate::linear::LinearWorkspace;
use crate::{
    Compressible, Embedding, EmbeddingError, EmbeddingLayer, Layer, Linear, Param, TtLinear,
    TtLinearWorkspace, TtmEmbedding, TtmWorkspace,
};

/// A linear layer that is dense or TT.
#[derive(Clone, Debug)]
pub enum AnyLinear {
    Dense(Linear),
    Tt(TtLinear),
}

#[derive(Debug)]
pub enum AnyLinearWorkspace {
    Dense(LinearWorkspace),
    Tt(Box<TtLinearWorkspace>),
}

impl AnyLinear {
    pub fn workspace(&self, batch: usize) -> AnyLinearWorkspace {
        match self {
            AnyLinear::Dense(l) => AnyLinearWorkspace::Dense(l.workspace(batch)),
            AnyLinear::Tt(l) => AnyLinearWorkspace::Tt(Box::new(l.workspace(batch))),
        }
    }

    pub fn forward(&self, ws: &mut AnyLinearWorkspace, x: &[f32], y: &mut [f32]) {
        match (self, ws) {
            (AnyLinear::Dense(l), AnyLinearWorkspace::Dense(w)) => l.forward(w, x, y),
            (AnyLinear::Tt(l), AnyLinearWorkspace::Tt(w)) => l.forward(w, x, y),
            _ => unreachable!("workspace made for another layer kind"),
        }
    }

    pub fn backward(
        &mut self,
        ws: &mut AnyLinearWorkspace,
        x: &[f32],
        dy: &[f32],
        dx: Option<&mut [f32]>,
    ) {
        match (self, ws) {
            (AnyLinear::Dense(l), AnyLinearWorkspace::Dense(w)) => l.backward(w, x, dy, dx),
            (AnyLinear::Tt(l), AnyLinearWorkspace::Tt(w)) => l.backward(w, x, dy, dx),
            _ => unreachable!("workspace made for another layer kind"),
        }
    }

    /// The backward with ∂L/∂x *added* into `dx`, `tmp` (as long as `dx`) as scratch: a TT
    /// layer's row lanes add in place (`TtLinear::backward_adding_dx`); otherwise the layer
    /// writes `tmp` and it is added. The bits of `backward` into `tmp`, then `add_into`.
    pub fn backward_adding_dx(
        &mut self,
        ws: &mut AnyLinearWorkspace,
        x: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        tmp: &mut [f32],
    ) {
        match (self, ws) {
            (AnyLinear::Dense(l), AnyLinearWorkspace::Dense(w)) => {
                l.backward(w, x, dy, Some(&mut *tmp));
                crate::elementwise::add_into(dx, tmp);
            }
            (AnyLinear::Tt(l), AnyLinearWorkspace::Tt(w)) => {
                l.backward_adding_dx(w, x, dy, dx, tmp)
            }
            _ => unreachable!("workspace made for another layer kind"),
        }
    }

    pub fn params(&self) -> Vec<&Param> {
        match self {
            AnyLinear::Dense(l) => l.params(),
            AnyLinear::Tt(l) => l.params(),
        }
    }

    pub fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        match self {
            AnyLinear::Dense(l) => l.visit_params_mut(f),
            AnyLinear::Tt(l) => l.visit_params_mut(f),
        }
    }

    pub fn out_features(&self) -> usize {
        match self {
            AnyLinear::Dense(l) => l.out_features(),
            AnyLinear::Tt(l) => l.out_features(),
        }
    }

    /// The TT layer, for the rank schedule; `None` when dense.
    pub fn compressible(&self) -> Option<&dyn Compressible> {
        match self {
            AnyLinear::Dense(_) => None,
            AnyLinear::Tt(l) => Some(l),
        }
    }

    pub fn compressible_mut(&mut self) -> Option<&mut dyn Compressible> {
        match self {
            AnyLinear::Dense(_) => None,
            AnyLinear::Tt(l) => Some(l),
        }
    }

    /// Parameters of the dense layer this one stands for (N·M + M).
    pub fn dense_equivalent(&self) -> usize {
        match self {
            AnyLinear::Dense(l) => l.num_params(),
            AnyLinear::Tt(l) => l.in_features() * l.out_features() + l.out_features(),
        }
    }

    /// Workspace bytes (saved intermediates and scratch), for memory accounting.
    pub fn workspace_bytes(ws: &AnyLinearWorkspace) -> usize {
        match ws {
            AnyLinearWorkspace::Dense(_) => 0,
            AnyLinearWorkspace::Tt(w) => w.bytes(),
        }
    }
}

/// An embedding table: dense or TTM.
#[derive(Clone, Debug)]
pub enum AnyEmbedding {
    Dense(Embedding),
    Ttm(TtmEmbedding),
}

#[derive(Debug)]
pub enum AnyEmbeddingWorkspace {
    Dense(EmbeddingWorkspace),
    Ttm(Box<TtmWorkspace>),
}

impl AnyEmbedding {
    pub fn workspace(&self, tokens: usize) -> AnyEmbeddingWorkspace {
        match self {
            AnyEmbedding::Dense(e) => AnyEmbeddingWorkspace::Dense(e.workspace(tokens)),
            AnyEmbedding::Ttm(e) => AnyEmbeddingWorkspace::Ttm(Box::new(e.workspace(tokens))),
        }
    }

    pub fn forward(
        &self,
        ws: &mut AnyEmbeddingWorkspace,
        ids: &[u32],
        y: &mut [f32],
    ) -> Result<(), EmbeddingError> {
        match (self, ws) {
            (AnyEmbedding::Dense(e), AnyEmbeddingWorkspace::Dense(w)) => e.forward(w, ids, y),
            (AnyEmbedding::Ttm(e), AnyEmbeddingWorkspace::Ttm(w)) => e.forward(w, ids, y),
            _ => unreachable!("workspace made for another embedding kind"),
        }
    }

    pub fn backward(&mut self, ws: &mut AnyEmbeddingWorkspace, ids: &[u32], dy: &[f32]) {
        match (self, ws) {
            (AnyEmbedding::Dense(e), AnyEmbeddingWorkspace::Dense(w)) => e.backward(w, ids, dy),
            (AnyEmbedding::Ttm(e), AnyEmbeddingWorkspace::Ttm(w)) => e.backward(w, ids, dy),
            _ => unreachable!("workspace made for another embedding kind"),
        }
    }

    pub fn params(&self) -> Vec<&Param> {
        match self {
            AnyEmbedding::Dense(e) => e.params(),
            AnyEmbedding::Ttm(e) => e.params(),
        }
    }

    pub fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        match self {
            AnyEmbedding::Dense(e) => e.visit_params_mut(f),
            AnyEmbedding::Ttm(e) => e.visit_params_mut(f),
        }
    }

    /// Rows of the table (the vocabulary).
    pub fn rows(&self) -> usize {
        match self {
            AnyEmbedding::Dense(e) => e.num_embeddings(),
            AnyEmbedding::Ttm(e) => e.num_embeddings(),
        }
    }

    /// Width of a row.
    pub fn dim(&self) -> usize {
        match self {
            AnyEmbedding::Dense(e) => e.dim(),
            AnyEmbedding::Ttm(e) => e.dim(),
        }
    }

    /// Trainable scalars.
    pub fn num_params(&self) -> usize {
        self.params().iter().map(|p| p.len()).sum()
    }

    /// `dense 943x16` or `ttm 943x16 v=[10, 10, 10] e=[4, 2, 2] r=[1, 8, 8, 1]`.
    pub fn describe(&self) -> String {
        match self {
            AnyEmbedding::Dense(t) => format!("dense {}x{}", t.num_embeddings(), t.dim()),
            AnyEmbedding::Ttm(t) => {
                let s = t.shape();
                format!(
                    "ttm {}x{} v={:?} e={:?} r={:?}",
                    s.num_embeddings(),
                    s.dim(),
                    s.vocab_modes(),
                    s.dim_modes(),
                    s.ranks()
                )
            }
        }
    }

    /// The TTM table, for the rank schedule; `None` when dense.
    pub fn compressible(&self) -> Option<&dyn Compressible> {
        match self {
            AnyEmbedding::Dense(_) => None,
            AnyEmbedding::Ttm(e) => Some(e),
        }
    }

    pub fn compressible_mut(&mut self) -> Option<&mut dyn Compressible> {
        match self {
            AnyEmbedding::Dense(_) => None,
            AnyEmbedding::Ttm(e) => Some(e),
        }
    }

    /// Parameters of the dense table this one stands for.
    pub fn dense_equivalent(&self) -> usize {
        match self {
            AnyEmbedding::Dense(e) => e.table.len(),
            AnyEmbedding::Ttm(e) => e.num_embeddings() * e.dim(),
        }
    }

    pub fn workspace_bytes(ws: &AnyEmbeddingWorkspace) -> usize {
        match ws {
            AnyEmbeddingWorkspace::Dense(_) => 0,
            AnyEmbeddingWorkspace::Ttm(w) => w.bytes(),
        }
    }
}
