//! TT layers that read one input X (attention's q, k and v), on the merged path together:
//!   T1 = X·[L_1 | … | L_n]                (B × S, S = Σ r_p,i: one product instead of n)
//!   Y_i = T1_i·R_i + b_i                  (T1_i: T1's columns of layer i)
//! into column blocks of one packed output Y = [Y_1 | … | Y_n] (B × Σ M_i, llm.c's QKV layout).
//! Backward from the packed dY = [dY_1 | … | dY_n]:
//!   dR_i = T1_iᵀ·dY_i,   U_i = dY_i·R_iᵀ   (U = [U_1 | … | U_n], B × S)
//!   dX = U·[L_1 | … | L_n]ᵀ                (one product; the sum over layers is its inner sum)
//!   [dL_1 | … | dL_n] = Xᵀ·U               (one product)
//! then each layer peels its chains as on its own. The result is each layer's own merged-path
//! result up to float rounding (the same sums, grouped in larger products).
//!
//! At small batches (see `merged::paired`) the backward's independent products run as two
//! single-threaded tasks, as on the merged path: (dR_i ∥ U_i) and (dX ∥ dL).
//!
//! It applies while every layer plans the merged path at this batch (the planner still decides
//! per layer; see [`SharedInput::applies`]) and none is dead, and is chosen only up to
//! [`MAX_ROWS`] rows, where it was measured not to lose; otherwise callers run the layers one
//! by one.

use super::chain::Chains;
use super::merged::{input_side, paired};
use super::pool::Lease;
use super::TtLinear;
use crate::{accumulate_bias_grad, add_bias, check_len, Layer};
use comera_plan::TtPath;
use comera_tensor::{matmul, matmul_serial, MatMut, MatRef, TtShape};

/// Rows above which the fusion is not used (the layers run one by one): measured with
/// `comera bench step --ops` on the paper's q/k/v (2 threads), fused vs one by one: a tie at
/// 128 rows, the fused backward 1.2× slower at 1,024 rows and the fused step 1.15-1.4× slower
/// at 4,096 rows (its products read and write strided column blocks of T1, U and dY).
pub const MAX_ROWS: usize = 128;

/// The fused workspace of n layers sharing an input, for one batch size.
#[derive(Debug)]
pub struct SharedInput {
    batch: usize,
    n_in: usize,
    /// Each layer's shape when planned (a rank change invalidates the fusion).
    shapes: Vec<TtShape>,
    /// Column offset of each layer in T1/U (prefix sums of r_p) and in Y (of M).
    rcol: Vec<usize>,
    mcol: Vec<usize>,
    t1: Vec<f32>, // B × S, saved for the backward
    chains: Vec<Chains>,
    h: Vec<Lease>,  // per layer: H_c (gated cores), scratch
    dh: Vec<Lease>, // per layer: dH_c, scratch
    /// [Lcat (N × S), U (B × S), dLcat (N × S)], scratch.
    cat: Lease,
    /// [b_1 | … | b_n] (Σ M_i): the forward adds it to the packed Y in one pass, the backward
    /// accumulates the bias gradients into it (from each layer's, and back) in one pass.
    bias: Vec<f32>,
}

impl SharedInput {
    /// The fused workspace for `layers` at `batch` rows, or `None` when the fusion does not
    /// apply (a layer planned off the merged path, a dead layer, or different input widths)
    /// or does not pay (more than [`MAX_ROWS`] rows).
    pub fn new(layers: &[&TtLinear], batch: usize) -> Option<SharedInput> {
        if batch > MAX_ROWS {
            return None;
        }
        if layers
            .iter()
            .any(|l| l.workspace(batch).path() != TtPath::Merged)
        {
            return None;
        }
        SharedInput::new_unplanned(layers, batch)
    }

    /// The same without asking the planner (every layer on the merged path whatever it would
    /// choose): for tests on shapes too small for the merged path to win.
    pub fn new_unplanned(layers: &[&TtLinear], batch: usize) -> Option<SharedInput> {
        let n_in = layers.first()?.in_features();
        if layers.iter().any(|l| l.dead || l.in_features() != n_in) {
            return None;
        }
        let prefix = |v: Vec<usize>| {
            let mut acc = 0;
            let mut out = vec![0];
            for x in v {
                acc += x;
                out.push(acc);
            }
            out
        };
        let rcol = prefix(layers.iter().map(|l| l.shape.middle_rank()).collect());
        let mcol = prefix(layers.iter().map(|l| l.out_features()).collect());
        let s = *rcol.last().expect("n ≥ 1");
        let lens = |l: &TtLinear| {
            (0..l.shape.n_cores())
                .map(|c| l.shape.core_len(c))
                .collect()
        };
        Some(SharedInput {
            batch,
            n_in,
            shapes: layers.iter().map(|l| l.shape.clone()).collect(),
            bias: vec![0.0; *mcol.last().expect("n ≥ 1")],
            rcol,
            mcol,
            t1: vec![0.0; batch * s],
            chains: layers.iter().map(|l| Chains::new(&l.shape)).collect(),
            h: layers.iter().map(|l| Lease::new(lens(l))).collect(),
            dh: layers.iter().map(|l| Lease::new(lens(l))).collect(),
            cat: Lease::new(vec![n_in * s, batch * s, n_in * s]),
        })
    }

    /// Whether this workspace still fits `layers` (same ranks and none dead since it was made).
    pub fn applies(&self, layers: &[&TtLinear]) -> bool {
        layers.len() == self.shapes.len()
            && layers
                .iter()
                .zip(&self.shapes)
                .all(|(l, s)| !l.dead && l.shape == *s)
    }

    /// Whether the products run as two tasks (every layer small enough at this batch).
    fn paired(&self) -> bool {
        self.shapes.iter().all(|s| paired(s, self.batch))
    }

    /// Bytes kept between calls (T1).
    pub fn bytes(&self) -> usize {
        4 * self.t1.len()
    }

    /// Width of the packed output (Σ M_i).
    pub fn out_width(&self) -> usize {
        *self.mcol.last().expect("n ≥ 1")
    }

    /// Counted FLOPs of one forward and one backward: each layer's merged path (the fused
    /// products do the same multiply-adds, grouped).
    pub fn flops(&self) -> (f64, f64) {
        self.shapes
            .iter()
            .map(|s| super::ffn::merged_flops(s, self.batch))
            .fold((0.0, 0.0), |(f, b), (x, y)| (f + x, b + y))
    }

    /// Layer `i`'s gated cores and chains (leases acquired; `backward`: also the gradient
    /// scratch), and its L into its columns of Lcat = [L_1 | … | L_n] (`cat[0]`, acquired).
    fn build(&mut self, i: usize, l: &TtLinear, backward: bool) {
        let s = *self.rcol.last().expect("n ≥ 1");
        self.h[i].acquire();
        l.gate_cores(&mut self.h[i]);
        if backward {
            self.dh[i].acquire();
            self.chains[i].acquire_backward();
        } else {
            self.chains[i].acquire_forward();
        }
        self.chains[i].build(&l.shape, &self.h[i]);
        let (c0, rp) = (self.rcol[i], self.rcol[i + 1] - self.rcol[i]);
        for (dst, src) in self.cat[0]
            .chunks_exact_mut(s)
            .zip(self.chains[i].l().chunks_exact(rp))
        {
            dst[c0..c0 + rp].copy_from_slice(src);
        }
    }

    fn release(&mut self) {
        self.cat.release();
        for i in 0..self.shapes.len() {
            self.h[i].release();
            self.dh[i].release();
            self.chains[i].release();
        }
    }

    /// `y` (B × Σ M_i, packed) = [X·W_1 + b_1 | … | X·W_n + b_n] for `x` (B × N).
    pub fn forward(&mut self, layers: &[&TtLinear], x: &[f32], y: &mut [f32]) {
        assert!(
            self.applies(layers),
            "SharedInput: layers changed since planned"
        );
        let (b, n, s, w) = (
            self.batch,
            self.n_in,
            *self.rcol.last().expect("n ≥ 1"),
            self.out_width(),
        );
        check_len("SharedInput x", x.len(), b * n);
        check_len("SharedInput y", y.len(), b * w);
        self.cat.acquire();
        for (i, l) in layers.iter().enumerate() {
            self.build(i, l, false);
        }
        matmul(
            MatMut::new(&mut self.t1, b, s),
            MatRef::new(x, b, n),
            MatRef::new(&self.cat[0], n, s),
            false,
        );
        for (i, l) in layers.iter().enumerate() {
            let (r0, rp) = (self.rcol[i], self.rcol[i + 1] - self.rcol[i]);
            let (m0, m) = (self.mcol[i], self.mcol[i + 1] - self.mcol[i]);
            matmul(
                MatMut::strided(&mut y[m0..], b, m, w, 1),
                MatRef::strided(&self.t1[r0..], b, rp, s, 1),
                MatRef::new(self.chains[i].r(), rp, m),
                false,
            );
            self.bias[m0..m0 + m].copy_from_slice(&l.bias.value);
        }
        add_bias(y, &self.bias);
        self.release();
    }

    /// Accumulates every layer's gradients from the packed `dy` (B × Σ M_i) and *writes*
    /// `dx` (B × N) = Σ_i dY_i·W_iᵀ.
    pub fn backward(
        &mut self,
        layers: &mut [&mut TtLinear],
        x: &[f32],
        dy: &[f32],
        dx: &mut [f32],
    ) {
        let (b, n, s, w) = (
            self.batch,
            self.n_in,
            *self.rcol.last().expect("n ≥ 1"),
            self.out_width(),
        );
        check_len("SharedInput x", x.len(), b * n);
        check_len("SharedInput dy", dy.len(), b * w);
        check_len("SharedInput dx", dx.len(), b * n);
        let k = layers.len();
        assert!(
            k == self.shapes.len()
                && layers
                    .iter()
                    .zip(&self.shapes)
                    .all(|(l, sh)| !l.dead && l.shape == *sh),
            "SharedInput backward: layers changed since forward"
        );
        // Gates, chains and Lcat, as in the forward.
        let pair = self.paired();
        self.cat.acquire();
        for i in 0..k {
            self.build(i, &*layers[i], true);
        }
        let (lcat, rest) = self.cat.split_at_mut(1);
        let (u, dlcat) = rest.split_at_mut(1);
        let (lcat, u, dlcat) = (&lcat[0], &mut u[0], &mut dlcat[0]);
        // dR_i = T1_iᵀ·dY_i,  U_i = dY_i·R_iᵀ.
        for i in 0..k {
            let (r0, rp) = (self.rcol[i], self.rcol[i + 1] - self.rcol[i]);
            let (m0, m) = (self.mcol[i], self.mcol[i + 1] - self.mcol[i]);
            let dyi = MatRef::strided(&dy[m0..], b, m, w, 1);
            let (_, r, _, dr) = self.chains[i].seed_grads();
            let r = MatRef::new(r, rp, m);
            let t1i = MatRef::strided(&self.t1[r0..], b, rp, s, 1);
            let dr = MatMut::new(dr, rp, m);
            let ui = MatMut::strided(&mut u[r0..], b, rp, s, 1);
            if pair {
                rayon::join(
                    || matmul_serial(dr, t1i.t(), dyi, false),
                    || matmul_serial(ui, dyi, r.t(), false),
                );
            } else {
                matmul(dr, t1i.t(), dyi, false);
                matmul(ui, dyi, r.t(), false);
            }
        }
        let um = MatRef::new(u, b, s);
        // dX = U·Lcatᵀ,  dLcat = Xᵀ·U (as on the merged path).
        input_side(pair, x, b, um, MatRef::new(lcat, n, s), Some(dx), dlcat);
        // db_i += Σ_rows dY_i: every layer's gradient packed, accumulated in one pass (the
        // same additions in the same order as layer by layer), and unpacked.
        for (i, l) in layers.iter().enumerate() {
            self.bias[self.mcol[i]..self.mcol[i + 1]].copy_from_slice(&l.bias.grad);
        }
        accumulate_bias_grad(dy, &mut self.bias);
        for i in 0..k {
            let (r0, rp) = (self.rcol[i], self.rcol[i + 1] - self.rcol[i]);
            {
                let (_, _, dl, _) = self.chains[i].seed_grads();
                for (dst, src) in dl.chunks_exact_mut(rp).zip(dlcat.chunks_exact(s)) {
                    dst.copy_from_slice(&src[r0..r0 + rp]);
                }
            }
            let l = &mut *layers[i];
            self.chains[i].peel(&l.shape, &self.h[i], &mut self.dh[i]);
            l.accumulate_core_grads(&self.dh[i]);
            l.bias
                .grad
                .copy_from_slice(&self.bias[self.mcol[i]..self.mcol[i + 1]]);
        }
        self.release();
    }
}
