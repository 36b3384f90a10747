//! LayerNorm over the last dimension.
//!
//! For each row x (length D) of a `(rows, D)` buffer:
//!   μ = (1/D) Σ_i x_i,   σ² = (1/D) Σ_i (x_i − μ)²   (biased variance, as BERT / PyTorch),
//!   r = 1/√(σ² + ε),     n_i = (x_i − μ)·r,           y_i = γ_i·n_i + β_i.
//! Forward saves μ and r per row. Backward, with g_i = γ_i·dy_i (the gradient w.r.t. n):
//!   dβ_i += Σ_rows dy_i,   dγ_i += Σ_rows dy_i·n_i,
//!   dx_i  = r·(g_i − mean_j(g_j) − n_i·mean_j(g_j·n_j)).
//! Rows run in parallel in fixed blocks of [`block_rows`] rows. Parameter gradients are summed
//! in row order within a block, then block by block in order, so results depend on the inputs
//! and the row count only, never on the thread count.
//!
//! A post-LN transformer block normalises residual sums, y = LN(x + dropout(b)), and its
//! backward needs ∂L/∂r of r = x + dropout(b) twice over (the residual and the dropped branch).
//! [`LayerNorm::forward_residual`] and [`LayerNorm::backward_residual`] do the dropout, the
//! sum and the normalisation in one pass over each row while it is in cache (three passes over
//! the whole buffer before, each reading and writing B·T·D floats from further away); each
//! element is the same expression as in the separate passes, so the bits are the same.

use crate::dropout::Mask;
use crate::{check_len, Layer, Param, ParamKind};
use rayon::prelude::*;

/// BERT's LayerNorm epsilon.
pub const BERT_LAYER_NORM_EPS: f32 = 1e-12;

/// `y = γ ⊙ (x − μ)/√(σ² + ε) + β` over the last dimension.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    pub gamma: Param, // (D)
    pub beta: Param,  // (D)
    pub eps: f32,
}

/// Saved statistics for a fixed number of rows (batch · sequence length).
#[derive(Debug)]
pub struct LayerNormWorkspace {
    rows: usize,
    mean: Vec<f32>, // (rows)
    rstd: Vec<f32>, // (rows)
    /// Per row block, its partial [dγ | dβ]: (blocks, 2·D).
    partial: Vec<f32>,
}

/// Rows per parallel block: about 16 blocks per call, at least 8 rows each (a block of 8 rows
/// of width 768 is already ~25 KB of work per pass).
pub fn block_rows(rows: usize) -> usize {
    rows.div_ceil(16).max(8)
}

impl LayerNormWorkspace {
    /// μ per row, as saved by the last forward.
    pub fn mean(&self) -> &[f32] {
        &self.mean
    }

    /// 1/√(σ² + ε) per row, as saved by the last forward.
    pub fn rstd(&self) -> &[f32] {
        &self.rstd
    }
}

impl LayerNorm {
    /// γ = 1, β = 0, ε = 1e-12 (BERT).
    pub fn new(name: &str, dim: usize) -> LayerNorm {
        LayerNorm::with_eps(name, dim, BERT_LAYER_NORM_EPS)
    }

    /// γ = 1, β = 0, any ε ≥ 0.
    pub fn with_eps(name: &str, dim: usize, eps: f32) -> LayerNorm {
        assert!(
            eps.is_finite() && eps >= 0.0,
            "LayerNorm eps must be finite and non-negative, got {eps}"
        );
        LayerNorm {
            gamma: Param::new(
                format!("{name}.gamma"),
                &[dim],
                ParamKind::Other,
                vec![1.0; dim],
            ),
            beta: Param::zeros(format!("{name}.beta"), &[dim], ParamKind::Other),
            eps,
        }
    }

    pub fn dim(&self) -> usize {
        self.gamma.value.len()
    }

    /// A residual sum and its normalisation in one pass over the rows: `r = x + branch` (the
    /// branch dropped out by `mask` when given) and `y = LN(r)`; `r` is what the backward
    /// reads. The same bits as the dropout, `sum_into` and [`Layer::forward`] one after
    /// another.
    pub fn forward_residual(
        &self,
        ws: &mut LayerNormWorkspace,
        x: &[f32],
        branch: &[f32],
        mask: Option<Mask<'_>>,
        r: &mut [f32],
        y: &mut [f32],
    ) {
        let (rows, d) = (ws.rows, self.dim());
        check_len("LayerNorm residual x", x.len(), rows * d);
        check_len("LayerNorm residual branch", branch.len(), rows * d);
        check_len("LayerNorm residual r", r.len(), rows * d);
        check_len("LayerNorm residual y", y.len(), rows * d);
        let (gamma, beta, eps) = (&self.gamma.value, &self.beta.value, self.eps);
        let br = block_rows(rows);
        let blocks = y
            .par_chunks_mut(br * d)
            .zip(r.par_chunks_mut(br * d))
            .zip(ws.mean.par_chunks_mut(br))
            .zip(ws.rstd.par_chunks_mut(br))
            .enumerate();
        comera_tensor::for_each(blocks, |(b, (((y, r), mean), rstd))| {
            for (i, (yr, rr)) in y.chunks_exact_mut(d).zip(r.chunks_exact_mut(d)).enumerate() {
                let at = (b * br + i) * d..(b * br + i + 1) * d;
                match &mask {
                    Some(m) => m.add_dropped(at.start, &x[at.clone()], &branch[at], rr),
                    None => crate::elementwise::kernels::sum(&x[at.clone()], &branch[at], rr),
                }
                (mean[i], rstd[i]) = kernels::forward_row(rr, gamma, beta, eps, yr);
            }
        });
    }

    /// The backward of [`LayerNorm::forward_residual`] from ∂L/∂y = `dy` plus `extra` (when y
    /// also feeds something else: a post-LN block's LN1 output feeds both its FFN and its
    /// second residual): accumulates dγ, dβ and writes `dr` = ∂L/∂r (the gradient of the
    /// residual input x) and `dbranch` = ∂L/∂branch (`dr` through the mask). The same bits as
    /// `add_into`, [`Layer::backward`] and the dropout's backward one after another.
    #[allow(clippy::too_many_arguments)] // the residual's whole data flow
    pub fn backward_residual(
        &mut self,
        ws: &mut LayerNormWorkspace,
        r: &[f32],
        dy: &[f32],
        extra: Option<&[f32]>,
        dr: &mut [f32],
        mask: Option<Mask<'_>>,
        dbranch: &mut [f32],
    ) {
        let n = ws.rows * self.dim();
        check_len("LayerNorm residual dr", dr.len(), n);
        check_len("LayerNorm residual dbranch", dbranch.len(), n);
        if let Some(e) = extra {
            check_len("LayerNorm residual extra", e.len(), n);
        }
        self.backward_rows(ws, r, dy, extra, Some(dr), Some((mask, dbranch)));
    }

    /// The backward over parallel row blocks (see the module doc): ∂L/∂y is `dy` (+ `extra`,
    /// summed as it is read), dx is written when given, and ∂L/∂branch from dx
    /// through the mask (or a copy of dx) when `branch` is given (it needs dx).
    fn backward_rows(
        &mut self,
        ws: &mut LayerNormWorkspace,
        x: &[f32],
        dy: &[f32],
        extra: Option<&[f32]>,
        dx: Option<&mut [f32]>,
        branch: Option<(Option<Mask<'_>>, &mut [f32])>,
    ) {
        let (rows, d) = (ws.rows, self.dim());
        check_len("LayerNorm x", x.len(), rows * d);
        check_len("LayerNorm dy", dy.len(), rows * d);
        if let Some(dx) = dx.as_deref() {
            check_len("LayerNorm dx", dx.len(), rows * d);
        }
        assert!(
            branch.is_none() || dx.is_some(),
            "LayerNorm: the branch gradient needs dx"
        );
        let gamma = &self.gamma.value;
        let br = block_rows(rows);
        let (mean, rstd) = (&ws.mean, &ws.rstd);
        let (branch_mask, db) = match branch {
            Some((m, db)) => (m, Some(db)),
            None => (None, None),
        };
        // One row block: its rows in order into the block's zeroed [dγ | dβ], dx (and the
        // branch's gradient) if wanted.
        let block = |b: usize,
                     partial: &mut [f32],
                     dx: Option<&mut [f32]>,
                     db: Option<&mut [f32]>| {
            partial.fill(0.0);
            let (dgamma, dbeta) = partial.split_at_mut(d);
            let r0 = b * br;
            let (mut dx, mut db) = (dx, db);
            for r in r0..(r0 + br).min(rows) {
                let at = r * d..(r + 1) * d;
                let local = (r - r0) * d..(r - r0 + 1) * d;
                let dxr = dx.as_deref_mut().map(|dx| &mut dx[local.clone()]);
                kernels::backward_row(
                    &x[at.clone()],
                    &dy[at.clone()],
                    extra.map(|e| &e[at.clone()]),
                    mean[r],
                    rstd[r],
                    gamma,
                    dgamma,
                    dbeta,
                    dxr,
                );
                if let (Some(db), Some(dx)) = (db.as_deref_mut(), dx.as_deref()) {
                    match &branch_mask {
                        Some(m) => m.apply(at.start, &dx[local.clone()], &mut db[local.clone()]),
                        None => db[local.clone()].copy_from_slice(&dx[local.clone()]),
                    }
                }
            }
        };
        let partials = ws.partial.par_chunks_mut(2 * d).enumerate();
        match (dx, db) {
            (Some(dx), Some(db)) => comera_tensor::for_each(
                partials
                    .zip(dx.par_chunks_mut(br * d))
                    .zip(db.par_chunks_mut(br * d)),
                |(((b, p), dx), db)| block(b, p, Some(dx), Some(db)),
            ),
            (Some(dx), None) => {
                comera_tensor::for_each(partials.zip(dx.par_chunks_mut(br * d)), |((b, p), dx)| {
                    block(b, p, Some(dx), None)
                })
            }
            (None, _) => comera_tensor::for_each(partials, |(b, p)| block(b, p, None, None)),
        }
        // Blocks in order: dγ += Σ_b dγ_b beside dβ += Σ_b dβ_b (each element's sum in block
        // order on one thread; at batch 1, 16 blocks of 2·768 floats that the other worker
        // used to wait for).
        let partial = &ws.partial;
        let sum_blocks = |grad: &mut [f32], half: usize| {
            for p in partial.chunks_exact(2 * d) {
                crate::elementwise::kernels::add(grad, &p[half * d..(half + 1) * d]);
            }
        };
        comera_tensor::join(
            || sum_blocks(&mut self.gamma.grad, 0),
            || sum_blocks(&mut self.beta.grad, 1),
        );
    }
}

impl Layer for LayerNorm {
    type Workspace = LayerNormWorkspace;

    fn in_features(&self) -> usize {
        self.dim()
    }
    fn out_features(&self) -> usize {
        self.dim()
    }

    /// `batch` is the number of rows normalised per step (e.g. B·T).
    fn workspace(&self, batch: usize) -> LayerNormWorkspace {
        LayerNormWorkspace {
            rows: batch,
            mean: vec![0.0; batch],
            rstd: vec![0.0; batch],
            partial: vec![0.0; batch.div_ceil(block_rows(batch)) * 2 * self.dim()],
        }
    }

    fn forward(&self, ws: &mut LayerNormWorkspace, x: &[f32], y: &mut [f32]) {
        let (rows, d) = (ws.rows, self.dim());
        check_len("LayerNorm x", x.len(), rows * d);
        check_len("LayerNorm y", y.len(), rows * d);
        let (gamma, beta, eps) = (&self.gamma.value, &self.beta.value, self.eps);
        let br = block_rows(rows);
        let blocks = y
            .par_chunks_mut(br * d)
            .zip(x.par_chunks(br * d))
            .zip(ws.mean.par_chunks_mut(br))
            .zip(ws.rstd.par_chunks_mut(br));
        comera_tensor::for_each(blocks, |(((y, x), mean), rstd)| {
            for (r, (yr, xr)) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)).enumerate() {
                (mean[r], rstd[r]) = kernels::forward_row(xr, gamma, beta, eps, yr);
            }
        });
    }

    fn backward(
        &mut self,
        ws: &mut LayerNormWorkspace,
        x: &[f32],
        dy: &[f32],
        dx: Option<&mut [f32]>,
    ) {
        self.backward_rows(ws, x, dy, None, dx, None);
    }

    fn params(&self) -> Vec<&Param> {
        vec![&self.gamma, &self.beta]
    }
    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.gamma, &mut self.beta]
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.gamma);
        f(&mut self.beta);
    }
}

/// Row kernels: sums over 32 lanes in a fixed order (the result depends only on the inputs),
/// compiled for each instruction-set level (`comera_tensor::multiversion!`).
mod kernels {
    const L: usize = 32;

    /// Σ_i f(a_i, b_i, c_i) in `L` lanes (lane l takes i ≡ l mod L, up to the last whole
    /// group of L), then the lanes in order, then the tail. Over zipped chunks rather than
    /// indices, so the loop has no bounds checks and vectorises; 32 lanes are two 16-lane
    /// registers on AVX-512 (four on AVX2), enough independent sums that a row is not bound by
    /// the add latency. LayerNorm of 128 × 768 on one thread, 8 lanes over indices → this:
    /// forward 37.4 → 13.8 µs, backward 69.7 → 26.1 µs (16 lanes: the same; 64: 17.4 / 28.5).
    #[inline(always)]
    fn lane_sum(a: &[f32], b: &[f32], c: &[f32], f: impl Fn(f32, f32, f32) -> f32) -> f32 {
        let n = a.len();
        let (a, b, c) = (&a[..n], &b[..n], &c[..n]);
        let mut acc = [0.0f32; L];
        let groups = a
            .chunks_exact(L)
            .zip(b.chunks_exact(L))
            .zip(c.chunks_exact(L));
        for ((a, b), c) in groups {
            for l in 0..L {
                acc[l] += f(a[l], b[l], c[l]);
            }
        }
        let full = n / L * L;
        let mut tail = 0.0f32;
        for i in full..n {
            tail += f(a[i], b[i], c[i]);
        }
        acc.iter().sum::<f32>() + tail
    }

    comera_tensor::multiversion! {
        /// Normalises one row into `y`; returns (μ, 1/√(σ² + ε)).
        pub(super) fn forward_row(
            x: &[f32],
            gamma: &[f32],
            beta: &[f32],
            eps: f32,
            y: &mut [f32],
        ) -> (f32, f32) {
            let d = x.len();
            let (gamma, beta, y) = (&gamma[..d], &beta[..d], &mut y[..d]);
            // Two passes (mean, then centred variance) for accuracy when |μ| ≫ σ.
            let mean = lane_sum(x, x, x, |x, _, _| x) / d as f32;
            let var = lane_sum(x, x, x, |x, _, _| (x - mean) * (x - mean)) / d as f32;
            let rstd = 1.0 / (var + eps).sqrt();
            for i in 0..d {
                y[i] = gamma[i] * ((x[i] - mean) * rstd) + beta[i];
            }
            (mean, rstd)
        }
    }

    /// Backward of one row (see [`backward_row`]) with ∂L/∂y = dy (+ extra when `EXTRA`, the
    /// same sum `add_into` forms).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn backward_row_body<const EXTRA: bool>(
        x: &[f32],
        dy: &[f32],
        extra: &[f32],
        mean: f32,
        rstd: f32,
        gamma: &[f32],
        dgamma: &mut [f32],
        dbeta: &mut [f32],
        dx: Option<&mut [f32]>,
    ) {
        let d = x.len();
        let (dy, extra, gamma) = (&dy[..d], &extra[..d], &gamma[..d]);
        let (dgamma, dbeta) = (&mut dgamma[..d], &mut dbeta[..d]);
        let dy_of = |dy: f32, e: f32| if EXTRA { dy + e } else { dy };
        // One pass: the parameter gradients dγ_i += dy_i·n_i, dβ_i += dy_i, and the row sums of
        // g = γ ⊙ dy and g·n for dx, in `lane_sum`'s lanes and order (the same bits as three
        // passes; LayerNorm backward of 128 × 768 on one thread 45.4 → 32.6 µs).
        let full = d / L * L;
        let (mut acc_g, mut acc_gn) = ([0.0f32; L], [0.0f32; L]);
        let groups = x[..full]
            .chunks_exact(L)
            .zip(
                dy[..full]
                    .chunks_exact(L)
                    .zip(extra[..full].chunks_exact(L)),
            )
            .zip(gamma[..full].chunks_exact(L))
            .zip(dgamma[..full].chunks_exact_mut(L))
            .zip(dbeta[..full].chunks_exact_mut(L));
        for ((((x, (dy, e)), g), dg), db) in groups {
            for l in 0..L {
                let (n, dy) = ((x[l] - mean) * rstd, dy_of(dy[l], e[l]));
                dg[l] += dy * n;
                db[l] += dy;
                acc_g[l] += g[l] * dy;
                acc_gn[l] += g[l] * dy * n;
            }
        }
        let (mut tail_g, mut tail_gn) = (0.0f32, 0.0f32);
        for i in full..d {
            let (n, dy) = ((x[i] - mean) * rstd, dy_of(dy[i], extra[i]));
            dgamma[i] += dy * n;
            dbeta[i] += dy;
            tail_g += gamma[i] * dy;
            tail_gn += gamma[i] * dy * n;
        }
        if let Some(dx) = dx {
            // dx from the row means of g and g·n.
            let mean_g = (acc_g.iter().sum::<f32>() + tail_g) / d as f32;
            let mean_gn = (acc_gn.iter().sum::<f32>() + tail_gn) / d as f32;
            let dx = &mut dx[..d];
            for i in 0..d {
                let (n, dy) = ((x[i] - mean) * rstd, dy_of(dy[i], extra[i]));
                dx[i] = rstd * (gamma[i] * dy - mean_g - n * mean_gn);
            }
        }
    }

    comera_tensor::multiversion! {
        /// Backward of one row from ∂L/∂y = `dy` (+ `extra`): accumulates dγ, dβ and writes dx
        /// (if given).
        #[allow(clippy::too_many_arguments)]
        pub(super) fn backward_row(
            x: &[f32],
            dy: &[f32],
            extra: Option<&[f32]>,
            mean: f32,
            rstd: f32,
            gamma: &[f32],
            dgamma: &mut [f32],
            dbeta: &mut [f32],
            dx: Option<&mut [f32]>,
        ) {
            match extra {
                Some(e) => backward_row_body::<true>(x, dy, e, mean, rstd, gamma, dgamma, dbeta, dx),
                None => backward_row_body::<false>(x, dy, dy, mean, rstd, gamma, dgamma, dbeta, dx),
            }
        }
    }
}
