//! Embedding tables: the common interface, id checks, and the dense `Embedding` (the baseline
//! of `TtmEmbedding`, also used for position and token-type embeddings).
//!
//! Forward gathers one D-wide row per id; backward scatter-adds dY rows into the table's
//! gradient in token order (deterministic for any thread count).

use crate::{Param, ParamKind};
use comera_tensor::init;
use rayon::prelude::*;

/// Bad ids for an embedding lookup (ids come from data, so these are user-facing errors).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EmbeddingError {
    #[error("empty batch: an embedding lookup needs at least one id")]
    Empty,
    #[error(
        "id {id} at position {pos} is out of range: the table has {rows} rows (ids 0..{rows})"
    )]
    IdOutOfRange { pos: usize, id: u64, rows: usize },
    #[error("batch has {got} ids but the workspace was planned for {expected}")]
    TokenCount { got: usize, expected: usize },
}

/// Checks a batch of ids against a table of `rows` rows and a planned batch of `tokens`.
pub fn check_ids(ids: &[u32], rows: usize, tokens: usize) -> Result<(), EmbeddingError> {
    if ids.is_empty() {
        return Err(EmbeddingError::Empty);
    }
    if ids.len() != tokens {
        return Err(EmbeddingError::TokenCount {
            got: ids.len(),
            expected: tokens,
        });
    }
    if let Some((pos, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= rows) {
        return Err(EmbeddingError::IdOutOfRange {
            pos,
            id: id as u64,
            rows,
        });
    }
    Ok(())
}

/// Converts signed ids (e.g. int64 from a file) to table ids, rejecting negatives and ids ≥ rows.
pub fn ids_from_i64(ids: &[i64], rows: usize) -> Result<Vec<u32>, EmbeddingError> {
    ids.iter()
        .enumerate()
        .map(|(pos, &id)| {
            if id < 0 || id as u64 >= rows as u64 || id > u32::MAX as i64 {
                Err(EmbeddingError::IdOutOfRange {
                    pos,
                    id: id as u64,
                    rows,
                })
            } else {
                Ok(id as u32)
            }
        })
        .collect()
}

/// An embedding table: ids (tokens) → rows (tokens × dim).
pub trait EmbeddingLayer {
    type Workspace;

    fn num_embeddings(&self) -> usize;
    fn dim(&self) -> usize;

    /// Everything a lookup of exactly `tokens` ids needs, allocated once.
    fn workspace(&self, tokens: usize) -> Self::Workspace;

    /// `y[t] = E[ids[t]]`; saves in `ws` what backward needs.
    fn forward(
        &self,
        ws: &mut Self::Workspace,
        ids: &[u32],
        y: &mut [f32],
    ) -> Result<(), EmbeddingError>;

    /// Accumulates the table's (or cores') gradients from `dy` (tokens × dim) for the ids of the
    /// matching forward.
    fn backward(&mut self, ws: &mut Self::Workspace, ids: &[u32], dy: &[f32]);

    fn params(&self) -> Vec<&Param>;
    fn params_mut(&mut self) -> Vec<&mut Param>;

    /// Calls `f` on every parameter without allocating.
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param));
}

/// Columns per parallel task of the dense table's gradient (64 floats: four cache lines).
const GRAD_BAND: usize = 64;

/// A dense V × D table.
#[derive(Clone, Debug)]
pub struct Embedding {
    pub table: Param, // (V, D)
}

/// The dense table needs no scratch; the workspace pins the batch size.
#[derive(Debug)]
pub struct EmbeddingWorkspace {
    tokens: usize,
}

impl Embedding {
    /// Rows ~ N(0, std²).
    pub fn new(name: &str, rows: usize, dim: usize, std: f32, rng: &mut init::Rng) -> Embedding {
        let mut v = vec![0.0; rows * dim];
        init::fill_normal(rng, &mut v, std);
        Embedding {
            table: Param::new(format!("{name}.weight"), &[rows, dim], ParamKind::Other, v),
        }
    }
}

impl EmbeddingLayer for Embedding {
    type Workspace = EmbeddingWorkspace;

    fn num_embeddings(&self) -> usize {
        self.table.shape[0]
    }
    fn dim(&self) -> usize {
        self.table.shape[1]
    }

    fn workspace(&self, tokens: usize) -> EmbeddingWorkspace {
        EmbeddingWorkspace { tokens }
    }

    fn forward(
        &self,
        ws: &mut EmbeddingWorkspace,
        ids: &[u32],
        y: &mut [f32],
    ) -> Result<(), EmbeddingError> {
        check_ids(ids, self.num_embeddings(), ws.tokens)?;
        let d = self.dim();
        crate::check_len("Embedding y", y.len(), ids.len() * d);
        // Rows gathered in parallel groups (plain copies: the same bits on any thread count; at
        // the paper's batch 32 the position rows are 12.6 MB a step).
        let group = (crate::elementwise::CHUNK / d.max(1)).max(1);
        let table = &self.table.value;
        comera_tensor::for_each(
            y.par_chunks_mut(group * d).zip(ids.par_chunks(group)),
            |(y, ids)| {
                for (row, &id) in y.chunks_exact_mut(d).zip(ids) {
                    let id = id as usize;
                    row.copy_from_slice(&table[id * d..(id + 1) * d]);
                }
            },
        );
        Ok(())
    }

    /// ∂T[id_i] += dy_i for every row i, in row order. From two parallel chunks of dy on, the
    /// columns are cut into bands of [`GRAD_BAND`] floats, one task each, every task adding
    /// all rows of its band in row order: each element sums the same terms in the same order
    /// as the plain loop, so the bits do not depend on the thread count. (At the paper's batch
    /// 32 the position and token-type tables' gradients read 12.6 MB of dy each a step; the
    /// loop ran on one thread while the other waited.)
    fn backward(&mut self, _ws: &mut EmbeddingWorkspace, ids: &[u32], dy: &[f32]) {
        let d = self.dim();
        crate::check_len("Embedding dy", dy.len(), ids.len() * d);
        if dy.len() < 2 * crate::elementwise::CHUNK || d <= GRAD_BAND {
            for (row, &id) in dy.chunks_exact(d).zip(ids) {
                let id = id as usize;
                for (g, v) in self.table.grad[id * d..(id + 1) * d].iter_mut().zip(row) {
                    *g += v;
                }
            }
            return;
        }
        let grad = comera_tensor::DisjointMut::new(&mut self.table.grad);
        comera_tensor::for_each((0..d.div_ceil(GRAD_BAND)).into_par_iter(), |band| {
            let cols = band * GRAD_BAND..((band + 1) * GRAD_BAND).min(d);
            for (row, &id) in dy.chunks_exact(d).zip(ids) {
                // SAFETY: this task alone touches the columns `cols` of the table's rows.
                unsafe { grad.add_at(id as usize * d + cols.start, &row[cols.clone()]) };
            }
        });
    }

    fn params(&self) -> Vec<&Param> {
        vec![&self.table]
    }
    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.table]
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.table);
    }
}
