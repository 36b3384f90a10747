//! Dense-or-tensorised layers, so a model is written once for both.

use comera_layers::embedding::EmbeddingWorkspace;
use comera_layers::linear::LinearWorkspace;
use comera_layers::{
    Embedding, EmbeddingError, EmbeddingLayer, Layer, Linear, Param, TtLinear, TtLinearWorkspace,
    TtmEmbedding, TtmWorkspace,
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

/// The word embedding: dense or TTM.
#[derive(Clone, Debug)]
pub enum WordEmbedding {
    Dense(Embedding),
    Ttm(TtmEmbedding),
}

#[derive(Debug)]
pub enum WordEmbeddingWorkspace {
    Dense(EmbeddingWorkspace),
    Ttm(Box<TtmWorkspace>),
}

impl WordEmbedding {
    pub fn workspace(&self, tokens: usize) -> WordEmbeddingWorkspace {
        match self {
            WordEmbedding::Dense(e) => WordEmbeddingWorkspace::Dense(e.workspace(tokens)),
            WordEmbedding::Ttm(e) => WordEmbeddingWorkspace::Ttm(Box::new(e.workspace(tokens))),
        }
    }

    pub fn forward(
        &self,
        ws: &mut WordEmbeddingWorkspace,
        ids: &[u32],
        y: &mut [f32],
    ) -> Result<(), EmbeddingError> {
        match (self, ws) {
            (WordEmbedding::Dense(e), WordEmbeddingWorkspace::Dense(w)) => e.forward(w, ids, y),
            (WordEmbedding::Ttm(e), WordEmbeddingWorkspace::Ttm(w)) => e.forward(w, ids, y),
            _ => unreachable!("workspace made for another embedding kind"),
        }
    }

    pub fn backward(&mut self, ws: &mut WordEmbeddingWorkspace, ids: &[u32], dy: &[f32]) {
        match (self, ws) {
            (WordEmbedding::Dense(e), WordEmbeddingWorkspace::Dense(w)) => e.backward(w, ids, dy),
            (WordEmbedding::Ttm(e), WordEmbeddingWorkspace::Ttm(w)) => e.backward(w, ids, dy),
            _ => unreachable!("workspace made for another embedding kind"),
        }
    }

    pub fn params(&self) -> Vec<&Param> {
        match self {
            WordEmbedding::Dense(e) => e.params(),
            WordEmbedding::Ttm(e) => e.params(),
        }
    }

    pub fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        match self {
            WordEmbedding::Dense(e) => e.visit_params_mut(f),
            WordEmbedding::Ttm(e) => e.visit_params_mut(f),
        }
    }

    /// Parameters of the dense table this one stands for.
    pub fn dense_equivalent(&self) -> usize {
        match self {
            WordEmbedding::Dense(e) => e.table.len(),
            WordEmbedding::Ttm(e) => e.num_embeddings() * e.dim(),
        }
    }

    pub fn workspace_bytes(ws: &WordEmbeddingWorkspace) -> usize {
        match ws {
            WordEmbeddingWorkspace::Dense(_) => 0,
            WordEmbeddingWorkspace::Ttm(w) => w.bytes(),
        }
    }
}
