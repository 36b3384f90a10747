//! GaLore: gradient low-rank projection (Zhao et al., "GaLore: Memory-Efficient LLM Training by
//! Gradient Low-Rank Projection", ICML 2024), the memory-saving baseline of the CoMERA paper
//! (SPEC §5).
//!
//! For each projected weight matrix W (m×n, comera's `Linear` weight is (in, out)) with gradient
//! G, every `update_every` (T) steps the projection P is recomputed from the SVD G = U·S·Vᵀ of
//! the current gradient, keeping the top-r singular vectors of the smaller side:
//!
//! - m ≥ n: P = V[:, :r] (n×r), the projected gradient R = G·P (m×r), the update N·Pᵀ;
//! - m < n: P = U[:, :r] (m×r), R = Pᵀ·G (r×n), the update P·N.
//!
//! Adam's moments live in R's shape (this is where the memory goes down); N is Adam's
//! normalised step computed on R, projected back and scaled by α (`scale`), and decoupled weight
//! decay acts on the full W as in [`AdamW`](crate::AdamW):
//! `W ← W − lr·(α·back(N) + λ·W)`. As in the authors' reference implementation, the moments are
//! kept (not reset) when the projection changes, and the first step always computes one.
//!
//! Which parameters are projected: 2-D parameters of kind [`ParamKind::Other`] (dense weight
//! matrices) whose smaller side is larger than the rank and at least `min_dim`. Embedding tables
//! (a parameter name with a segment starting with `embedding`, e.g. `embeddings.word.weight`)
//! are left to plain AdamW unless `embeddings = true`: the GaLore paper projects the attention
//! and MLP matrices only. 1-D parameters (biases, LayerNorm), TT/TTM cores, rank gates and small
//! matrices (the classifier) use plain AdamW with the same hyper-parameters and groups.
//!
//! The SVD is `faer`'s (only the needed side's singular vectors are computed). Its scratch, the
//! singular-vector buffer and the projected-gradient buffer are allocated once in
//! [`GaLore::new`] for the largest projected matrix, so [`GaLore::bytes`] counts them and a
//! normal step allocates nothing; a refresh step may still allocate inside `faer`'s SVD.
//! Fallback when the SVD cannot be used (no convergence, or a non-finite gradient or result):
//! the previous projection is kept; on the very first refresh, where there is none, P is a
//! randomised range finder's basis — Gram-Schmidt-orthonormalised G·Ω (or Gᵀ·Ω) for a seeded
//! Gaussian Ω, with random directions standing in for any the gradient does not span. The
//! fallback allocates Ω. Both events are counted in [`GaLore::svd_fallbacks`].

use crate::{AdamWConfig, CHUNK};
use comera_layers::{Param, ParamKind};
use comera_tensor::gemm::{matmul, MatMut, MatRef};
use comera_tensor::init;
use faer::dyn_stack::{MemBuffer, MemStack, StackReq};
use faer::linalg::svd::{svd, svd_scratch, ComputeSvdVectors};
use faer::Par;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// GaLore hyper-parameters (the `[galore]` table of a run config).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GaLoreConfig {
    /// Rank r of the projection; 0 (the default): what each matrix supports, a quarter of its
    /// smaller side (the GaLore paper's d/4), so no model is too narrow for it.
    pub rank: usize,
    /// Steps between projection refreshes (T); the first step always computes one.
    pub update_every: u64,
    /// Scale α of the projected-back update.
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
    pub scale: f32,
    /// Project only matrices whose smaller side is at least this (0 = no limit beyond the
    /// rank: a matrix is projected only when its smaller side exceeds r).
    pub min_dim: usize,
    /// Also project embedding tables (the GaLore paper does not).
    pub embeddings: bool,
}

impl Default for GaLoreConfig {
    /// r = a quarter of each matrix's smaller side (the GaLore paper's 60M-350M models use
    /// d/4), T = 200, α = 0.25 (the GaLore paper's values).
    fn default() -> Self {
        GaLoreConfig {
            rank: 0,
            update_every: 200,
            scale: 0.25,
            min_dim: 0,
            embeddings: false,
        }
    }
}

impl GaLoreConfig {
    /// Checks the values; the error names the field.
    pub fn validate(&self) -> Result<(), crate::SettingError> {
        use crate::SettingError;
        if self.update_every == 0 {
            return Err(SettingError::new(
                "galore.update_every",
                "must be at least 1",
            ));
        }
        if !(self.scale > 0.0 && self.scale.is_finite()) {
            return Err(SettingError::new(
                "galore.scale",
                format!("must be positive and finite, got {}", self.scale),
            ));
        }
        Ok(())
    }

    /// Whether a parameter is projected (see the module documentation).
    pub fn projects(&self, p: &Param) -> bool {
        if p.kind != ParamKind::Other || p.shape.len() != 2 {
            return false;
        }
        let small = p.shape[0].min(p.shape[1]);
        let embedding = p.name.split('.').any(|s| s.starts_with("embedding"));
        let r = self.rank_for(small);
        r >= 1 && small > r && small >= self.min_dim && (self.embeddings || !embedding)
    }

    /// The projection rank of a matrix whose smaller side is `small`: `rank`, or with
    /// `rank = 0` a quarter of `small` (0 for matrices narrower than 4: not projected).
    pub fn rank_for(&self, small: usize) -> usize {
        match self.rank {
            0 => small / 4,
            r => r,
        }
    }

    /// The rank as a phrase for reports.
    pub fn rank_label(&self) -> String {
        match self.rank {
            0 => "a quarter of each matrix's smaller side".into(),
            r => r.to_string(),
        }
    }
}

/// Which side of the gradient the projection keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// m < n: P = U[:, :r] (m×r), R = Pᵀ·G (r×n).
    Left,
    /// m ≥ n: P = V[:, :r] (n×r), R = G·P (m×r).
    Right,
}

/// The state of one projected matrix.
#[derive(Clone, Debug)]
pub struct Projected {
    pub name: String,
    /// The weight's shape (m, n).
    pub rows: usize,
    pub cols: usize,
    pub rank: usize,
    pub side: Side,
    /// The projection, row-major: (m×r) for [`Side::Left`], (n×r) for [`Side::Right`].
    pub p: Vec<f32>,
    /// Adam's moments in R's shape (r×n or m×r), row-major.
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    /// Times P was computed (by SVD or fallback).
    pub refreshes: u64,
    /// The step (1-based, as [`GaLore::t`] after it) whose gradient P was last computed from;
    /// 0 before the first.
    pub refreshed_at: u64,
}

impl Projected {
    /// Shape of R and of the moments.
    pub fn projected_shape(&self) -> (usize, usize) {
        match self.side {
            Side::Left => (self.rank, self.cols),
            Side::Right => (self.rows, self.rank),
        }
    }

    /// Length of the side P spans (rows of P).
    fn side_len(&self) -> usize {
        match self.side {
            Side::Left => self.rows,
            Side::Right => self.cols,
        }
    }
}

/// Optimiser state of one parameter, in visiting order.
#[derive(Clone, Debug)]
pub enum ParamState {
    /// Plain AdamW moments (full size).
    Adam { m: Vec<f32>, v: Vec<f32> },
    /// A GaLore-projected matrix.
    Projected(Projected),
}

/// Bytes of GaLore's state by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GaLoreBytes {
    /// Adam moments: projected ones plus the plain AdamW ones of unprojected parameters.
    pub moments: usize,
    /// The projections P.
    pub projections: usize,
    /// Projected-gradient buffer, singular values and vectors, and the SVD's scratch.
    pub scratch: usize,
}

impl GaLoreBytes {
    pub fn total(&self) -> usize {
        self.moments + self.projections + self.scratch
    }
}

/// Buffers for the SVD refresh, sized for the largest projected matrix.
struct SvdWork {
    /// Singular vectors of the needed side, column-major k×k (k = min(m, n)).
    vectors: Vec<f32>,
    /// Singular values (k).
    values: Vec<f32>,
    stack: MemBuffer,
    stack_bytes: usize,
    par: Par,
}

impl std::fmt::Debug for SvdWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SvdWork")
            .field("vectors", &self.vectors.len())
            .field("values", &self.values.len())
            .field("stack_bytes", &self.stack_bytes)
            .finish()
    }
}

/// GaLore for the projected matrices, AdamW for everything else; the same interface as
/// [`AdamW`](crate::AdamW).
#[derive(Debug)]
pub struct GaLore {
    pub cfg: AdamWConfig,
    pub galore: GaLoreConfig,
    /// Steps taken.
    pub t: u64,
    pub state: Vec<ParamState>,
    /// Refresh events (steps on which every projection was recomputed).
    pub refresh_steps: u64,
    /// Projections that could not come from the SVD (kept, or the range finder's).
    pub svd_fallbacks: u64,
    /// Projected gradient / normalised update, r × (largest other side).
    scratch: Vec<f32>,
    svd: SvdWork,
    force_refresh: bool,
}

fn svd_par() -> Par {
    match rayon::current_num_threads() {
        0 | 1 => Par::Seq,
        n => Par::rayon(n),
    }
}

fn vectors_needed(side: Side) -> (ComputeSvdVectors, ComputeSvdVectors) {
    match side {
        Side::Left => (ComputeSvdVectors::Thin, ComputeSvdVectors::No),
        Side::Right => (ComputeSvdVectors::No, ComputeSvdVectors::Thin),
    }
}

impl GaLore {
    /// State for the parameters `visit` walks over. Panics on an invalid `galore` config (call
    /// [`GaLoreConfig::validate`] first to get the error as a value).
    pub fn new(
        cfg: AdamWConfig,
        galore: GaLoreConfig,
        visit: impl FnOnce(&mut dyn FnMut(&mut Param)),
    ) -> GaLore {
        if let Err(e) = galore.validate() {
            panic!("{e}");
        }
        let par = svd_par();
        let mut state = Vec::new();
        let (mut scratch_len, mut k_max) = (0usize, 0usize);
        let mut req = StackReq::EMPTY;
        visit(&mut |p: &mut Param| {
            if galore.projects(p) {
                let (rows, cols) = (p.shape[0], p.shape[1]);
                let rank = galore.rank_for(rows.min(cols));
                let side = if rows >= cols {
                    Side::Right
                } else {
                    Side::Left
                };
                let pr = Projected {
                    name: p.name.clone(),
                    rows,
                    cols,
                    rank,
                    side,
                    p: vec![0.0; rows.min(cols) * rank],
                    m: vec![0.0; rank * rows.max(cols)],
                    v: vec![0.0; rank * rows.max(cols)],
                    refreshes: 0,
                    refreshed_at: 0,
                };
                scratch_len = scratch_len.max(pr.m.len());
                k_max = k_max.max(rows.min(cols));
                let (cu, cv) = vectors_needed(side);
                req = req.or(svd_scratch::<f32>(
                    rows,
                    cols,
                    cu,
                    cv,
                    par,
                    Default::default(),
                ));
                state.push(ParamState::Projected(pr));
            } else {
                state.push(ParamState::Adam {
                    m: vec![0.0; p.len()],
                    v: vec![0.0; p.len()],
                });
            }
        });
        let stack_bytes = req.unaligned_bytes_required();
        GaLore {
            cfg,
            galore,
            t: 0,
            state,
            refresh_steps: 0,
            svd_fallbacks: 0,
            scratch: vec![0.0; scratch_len],
            svd: SvdWork {
                vectors: vec![0.0; k_max * k_max],
                values: vec![0.0; k_max],
                stack: MemBuffer::new(req),
                stack_bytes,
                par,
            },
            force_refresh: false,
        }
    }

    /// Makes the next step recompute every projection (whatever the step count).
    pub fn request_refresh(&mut self) {
        self.force_refresh = true;
    }

    /// Whether the next step recomputes the projections.
    pub fn refresh_due(&self) -> bool {
        self.force_refresh || self.t.is_multiple_of(self.galore.update_every)
    }

    /// The projected matrices' states, in visiting order.
    pub fn projected(&self) -> impl Iterator<Item = &Projected> {
        self.state.iter().filter_map(|s| match s {
            ParamState::Projected(p) => Some(p),
            ParamState::Adam { .. } => None,
        })
    }

    /// Bytes of optimiser state by kind.
    pub fn breakdown(&self) -> GaLoreBytes {
        let mut b = GaLoreBytes::default();
        for s in &self.state {
            match s {
                ParamState::Adam { m, v } => b.moments += 4 * (m.len() + v.len()),
                ParamState::Projected(p) => {
                    b.moments += 4 * (p.m.len() + p.v.len());
                    b.projections += 4 * p.p.len();
                }
            }
        }
        b.scratch = 4 * (self.scratch.len() + self.svd.vectors.len() + self.svd.values.len())
            + self.svd.stack_bytes;
        b
    }

    /// Bytes of optimiser state (moments, projections, buffers and SVD scratch).
    pub fn bytes(&self) -> usize {
        self.breakdown().total()
    }

    /// One update of every parameter with learning rates scaled by `lr_scale` (the schedule)
    /// and gradients scaled by `grad_scale` (clipping). On refresh steps (the first, every
    /// `update_every`-th, or after [`GaLore::request_refresh`]) the projections are recomputed
    /// first from the current gradients. Allocation-free except inside the SVD and its fallback.
    pub fn step(
        &mut self,
        lr_scale: f32,
        grad_scale: f32,
        visit: impl FnOnce(&mut dyn FnMut(&mut Param)),
    ) {
        let refresh = self.refresh_due();
        self.force_refresh = false;
        self.t += 1;
        if refresh {
            self.refresh_steps += 1;
        }
        let t = self.t;
        let c = &self.cfg;
        let alpha = self.galore.scale;
        let bc1 = 1.0 - c.beta1.powi(t.min(i32::MAX as u64) as i32);
        let bc2 = 1.0 - c.beta2.powi(t.min(i32::MAX as u64) as i32);
        let (states, scratch, svdw, fallbacks) = (
            &mut self.state,
            &mut self.scratch,
            &mut self.svd,
            &mut self.svd_fallbacks,
        );
        // The plain parameters' update: AdamW's own (no gate freezing here).
        let plain = crate::Update::new(c, t, None, lr_scale, grad_scale);
        let mut i = 0;
        visit(&mut |p: &mut Param| {
            let lr = c.lr(p.kind) * lr_scale;
            let decay = if p.kind == ParamKind::RankGate || p.shape.len() < 2 {
                0.0
            } else {
                c.weight_decay
            };
            assert!(
                i < states.len(),
                "optimiser state covers {} parameters, the model has more",
                states.len()
            );
            match &mut states[i] {
                ParamState::Adam { m, v } => plain.param(p, m, v),
                ParamState::Projected(pr) => {
                    assert!(
                        p.shape.len() == 2 && p.shape[0] == pr.rows && p.shape[1] == pr.cols,
                        "optimiser state does not match parameter {} ({:?}, state {}x{})",
                        p.name,
                        p.shape,
                        pr.rows,
                        pr.cols
                    );
                    if refresh {
                        if !refresh_projection(pr, &p.grad, svdw) {
                            *fallbacks += 1;
                            fallback_projection(pr, &p.grad, i as u64);
                        }
                        pr.refreshes += 1;
                        pr.refreshed_at = t;
                    }
                    projected_update(c, lr, decay, alpha, grad_scale, bc1, bc2, p, pr, scratch);
                }
            }
            i += 1;
        });
        assert_eq!(
            i,
            self.state.len(),
            "optimiser state covers {} parameters, the model has {i}",
            self.state.len()
        );
    }
}

/// R = proj(G); Adam on R; W ← (1 − lr·λ)·W − lr·α·back(N).
#[allow(clippy::too_many_arguments)]
fn projected_update(
    c: &AdamWConfig,
    lr: f32,
    decay: f32,
    alpha: f32,
    grad_scale: f32,
    bc1: f32,
    bc2: f32,
    p: &mut Param,
    pr: &mut Projected,
    scratch: &mut [f32],
) {
    let (m, n, r) = (pr.rows, pr.cols, pr.rank);
    let len = pr.m.len();
    let rbuf = &mut scratch[..len];
    let g = MatRef::new(&p.grad, m, n);
    match pr.side {
        Side::Left => matmul(
            MatMut::new(rbuf, r, n),
            MatRef::new(&pr.p, m, r).t(),
            g,
            false,
        ),
        Side::Right => matmul(MatMut::new(rbuf, m, r), g, MatRef::new(&pr.p, n, r), false),
    }
    // Adam on R, leaving −lr·α·N in the buffer.
    let step = -lr * alpha;
    let update = |((x, m), v): ((&mut [f32], &mut [f32]), &mut [f32])| {
        for ((x, m), v) in x.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()) {
            let g = *x * grad_scale;
            *m = c.beta1 * *m + (1.0 - c.beta1) * g;
            *v = c.beta2 * *v + (1.0 - c.beta2) * g * g;
            *x = step * ((*m / bc1) / ((*v / bc2).sqrt() + c.eps));
        }
    };
    if len >= 2 * CHUNK {
        rbuf.par_chunks_mut(CHUNK)
            .zip(pr.m.par_chunks_mut(CHUNK))
            .zip(pr.v.par_chunks_mut(CHUNK))
            .for_each(update);
    } else {
        update(((&mut rbuf[..], &mut pr.m[..]), &mut pr.v[..]));
    }
    let keep = 1.0 - lr * decay;
    if keep != 1.0 {
        if p.value.len() >= 2 * CHUNK {
            p.value
                .par_chunks_mut(CHUNK)
                .for_each(|w| w.iter_mut().for_each(|w| *w *= keep));
        } else {
            p.value.iter_mut().for_each(|w| *w *= keep);
        }
    }
    let w = MatMut::new(&mut p.value, m, n);
    match pr.side {
        Side::Left => matmul(w, MatRef::new(&pr.p, m, r), MatRef::new(rbuf, r, n), true),
        Side::Right => matmul(
            w,
            MatRef::new(rbuf, m, r),
            MatRef::new(&pr.p, n, r).t(),
            true,
        ),
    }
}

/// P from the SVD of G; false (P untouched) when the SVD fails or anything is non-finite.
fn refresh_projection(pr: &mut Projected, grad: &[f32], w: &mut SvdWork) -> bool {
    if !grad.iter().all(|g| g.is_finite()) {
        return false;
    }
    let (m, n, r) = (pr.rows, pr.cols, pr.rank);
    let k = m.min(n);
    let a = faer::MatRef::from_row_major_slice(grad, m, n);
    let vecs = faer::MatMut::from_column_major_slice_mut(&mut w.vectors[..k * k], k, k);
    let s = faer::diag::DiagMut::from_slice_mut(&mut w.values[..k]);
    let (u, v) = match pr.side {
        Side::Left => (Some(vecs), None),
        Side::Right => (None, Some(vecs)),
    };
    let stack = MemStack::new(&mut w.stack);
    let ok = svd(a, s, u, v, w.par, stack, Default::default()).is_ok();
    if !ok {
        return false;
    }
    let vecs = &w.vectors[..k * k];
    if !vecs[..k * r].iter().all(|x| x.is_finite()) {
        return false;
    }
    // Columns 0..r of the (column-major, leading dimension k) vectors, row-major into P.
    let side = pr.side_len();
    debug_assert_eq!(side, k);
    for i in 0..side {
        for j in 0..r {
            pr.p[i * r + j] = vecs[j * k + i];
        }
    }
    true
}

/// Keeps the previous projection, or (first refresh) builds one with a randomised range finder.
fn fallback_projection(pr: &mut Projected, grad: &[f32], seed: u64) {
    if pr.refreshes > 0 {
        return;
    }
    let (m, n, r) = (pr.rows, pr.cols, pr.rank);
    let mut rng = init::rng(0x6A10_5EED ^ seed);
    let finite = grad.iter().all(|g| g.is_finite());
    if finite {
        // Y = G·Ω (Left: m×r, Ω n×r) or Gᵀ·Ω (Right: n×r, Ω m×r), written into P.
        let other = if pr.side == Side::Left { n } else { m };
        let mut omega = vec![0.0f32; other * r];
        init::fill_normal(&mut rng, &mut omega, 1.0);
        let g = MatRef::new(grad, m, n);
        let g = if pr.side == Side::Left { g } else { g.t() };
        let side = pr.side_len();
        matmul(
            MatMut::new(&mut pr.p, side, r),
            g,
            MatRef::new(&omega, other, r),
            false,
        );
    } else {
        init::fill_normal(&mut rng, &mut pr.p, 1.0);
    }
    let side = pr.side_len();
    orthonormalise_columns(&mut pr.p, side, r, &mut rng);
}

/// Modified Gram-Schmidt (twice) on the columns of a row-major rows×cols matrix; a column
/// that vanishes (the data do not span it) is replaced by a random one and redone.
pub(crate) fn orthonormalise_columns(a: &mut [f32], rows: usize, cols: usize, rng: &mut init::Rng) {
    assert!(
        cols <= rows,
        "cannot have {cols} orthonormal columns of length {rows}"
    );
    let col_norm = |a: &[f32], j: usize| -> f64 {
        (0..rows)
            .map(|i| (a[i * cols + j] as f64).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    for j in 0..cols {
        let mut tries = 0;
        loop {
            let before = col_norm(a, j);
            for _ in 0..2 {
                for q in 0..j {
                    let dot: f64 = (0..rows)
                        .map(|i| a[i * cols + q] as f64 * a[i * cols + j] as f64)
                        .sum();
                    for i in 0..rows {
                        a[i * cols + j] -= (dot * a[i * cols + q] as f64) as f32;
                    }
                }
            }
            let after = col_norm(a, j);
            if after.is_finite() && after > 1e-6 * before.max(f64::MIN_POSITIVE) && after > 1e-30 {
                for i in 0..rows {
                    a[i * cols + j] = (a[i * cols + j] as f64 / after) as f32;
                }
                break;
            }
            tries += 1;
            assert!(tries < 16, "could not complete an orthonormal basis");
            let mut col = vec![0.0f32; rows];
            init::fill_normal(rng, &mut col, 1.0);
            for i in 0..rows {
                a[i * cols + j] = col[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gram_schmidt_completes_a_rank_deficient_basis() {
        let (rows, cols) = (6, 3);
        // Two identical columns and a zero one.
        let mut a = vec![0.0f32; rows * cols];
        for i in 0..rows {
            a[i * cols] = i as f32 + 1.0;
            a[i * cols + 1] = i as f32 + 1.0;
        }
        let mut rng = init::rng(3);
        orthonormalise_columns(&mut a, rows, cols, &mut rng);
        for p in 0..cols {
            for q in 0..cols {
                let dot: f32 = (0..rows).map(|i| a[i * cols + p] * a[i * cols + q]).sum();
                let want = if p == q { 1.0 } else { 0.0 };
                assert!((dot - want).abs() < 1e-5, "({p},{q}) = {dot}");
            }
        }
    }

    #[test]
    fn config_errors_name_the_field() {
        let bad = |c: GaLoreConfig| c.validate().unwrap_err().field;
        assert!(
            bad(GaLoreConfig {
                update_every: 0,
                ..Default::default()
            }) == "galore.update_every"
        );
        assert!(
            bad(GaLoreConfig {
                scale: f32::NAN,
                ..Default::default()
            }) == "galore.scale"
        );
        assert!(GaLoreConfig::default().validate().is_ok());
    }

    #[test]
    fn the_default_rank_is_what_each_matrix_supports() {
        let g = GaLoreConfig::default();
        let m = |rows: usize, cols: usize| {
            Param::new(
                "encoder.0.ffn.up.w",
                &[rows, cols],
                ParamKind::Other,
                vec![0.0; rows * cols],
            )
        };
        // The built-in model's 128-wide matrices are projected at rank 32 (a fixed 128 would
        // have left them alone: GaLore = AdamW), the paper model's at 192.
        assert!(g.projects(&m(128, 256)) && g.rank_for(128) == 32);
        assert!(g.projects(&m(768, 3072)) && g.rank_for(768) == 192);
        // A 2-column classifier is not.
        assert!(!g.projects(&m(128, 2)));
        let fixed = GaLoreConfig {
            rank: 128,
            ..Default::default()
        };
        assert!(!fixed.projects(&m(128, 256)) && fixed.projects(&m(768, 768)));
    }
}
