//! Sequential path: X is contracted core by core, with no batch-independent work.
//!
//! Input side. X (B, n_0..n_{p-1}) is first permuted to digit-reversed order
//! S_0 = (B, n_{p-1}, …, n_1, n_0, r_0 = 1). State S_c has layout (rows_c, n_c, r_c) with
//! rows_c = B·n_{p-1}⋯n_{c+1}, so one GEMM contracts (n_c, r_c) jointly:
//!   S_{c+1} (rows_c × r_{c+1}) = S_c (rows_c × n_c·r_c) · H'_c (n_c·r_c × r_{c+1}),
//! with H'_c = H_c with its first two axes swapped. S_p = (B × r_p) = X·L.
//! Output side. Z_p = S_p; Z_{c+1} (rows·s_c × r_{c+1}) = Z_c (rows × r_c) · H_c (r_c × s_c·r_{c+1}),
//! rows = B·m_p⋯m_{c-1}; Z_K = Y. Backward runs the same GEMMs transposed:
//!   dH_c = Z_cᵀ·dZ_{c+1}, dZ_c = dZ_{c+1}·H_cᵀ;  dH'_c = S_cᵀ·dS_{c+1}, dS_c = dS_{c+1}·H'_cᵀ,
//! and dX is dS_0 with its digits put back in order.

use super::pool::{Lease, Scratch};
use comera_tensor::permute::permute;
use comera_tensor::{matmul, MatMut, MatRef, TtShape};

/// The states S and Z are kept between forward and backward; H', dH' and the gradient
/// ping-pong are scratch borrowed for each call (the backward re-permutes H').
#[derive(Debug)]
pub(crate) struct Sequential {
    x_dims: Vec<usize>,     // [B, n_0, …, n_{p-1}]
    xr_dims: Vec<usize>,    // [B, n_{p-1}, …, n_0]
    digit_perm: Vec<usize>, // [0, p, p-1, …, 1] (its own inverse)
    s: Vec<Vec<f32>>,       // S_0..S_p; S_c: rows_c·n_c × r_c elements = B·(N/P_c)·r_c
    z: Vec<Vec<f32>>,       // Z_{p+1}..Z_{K-1}
    hp: Lease,              // H'_c, c < p: (n_c, r_c, r_{c+1})
    dhp: Lease,             // dH'_c
    d: Lease,               // dS / dZ ping-pong
}

impl Sequential {
    pub fn new(shape: &TtShape, batch: usize) -> Sequential {
        let (p, k, r) = (shape.p(), shape.n_cores(), shape.ranks());
        let n = shape.in_features();
        let mut x_dims = vec![batch];
        x_dims.extend_from_slice(shape.in_modes());
        let mut xr_dims = vec![batch];
        xr_dims.extend(shape.in_modes().iter().rev());
        let mut digit_perm = vec![0];
        digit_perm.extend((1..=p).rev());
        let mut s = Vec::with_capacity(p + 1);
        let mut pre = 1;
        for c in 0..=p {
            s.push(vec![0.0; batch * (n / pre) * r[c]]);
            if c < p {
                pre *= shape.mode(c);
            }
        }
        let mut z = Vec::new();
        let mut zmax = 0;
        let mut rows = batch;
        for c in p..k {
            zmax = zmax.max(rows * r[c]);
            rows *= shape.mode(c);
            if c + 1 < k {
                z.push(vec![0.0; rows * r[c + 1]]);
            }
        }
        let dmax = s.iter().map(Vec::len).max().unwrap_or(0).max(zmax);
        let hp: Vec<usize> = (0..p).map(|c| shape.core_len(c)).collect();
        Sequential {
            x_dims,
            xr_dims,
            digit_perm,
            s,
            z,
            hp: Lease::new(hp.clone()),
            dhp: Lease::new(hp),
            d: Lease::new(vec![dmax; 2]),
        }
    }

    /// Bytes kept between calls.
    pub fn bytes(&self) -> usize {
        let v = |b: &[Vec<f32>]| b.iter().map(Vec::len).sum::<usize>();
        4 * (v(&self.s) + v(&self.z))
    }

    /// Bytes borrowed from the thread's pool during a backward call.
    pub fn scratch_bytes(&self) -> usize {
        self.hp.bytes() + self.dhp.bytes() + self.d.bytes()
    }

    pub fn forward(
        &mut self,
        shape: &TtShape,
        h: &[Scratch],
        batch: usize,
        x: &[f32],
        y: &mut [f32],
    ) {
        let (p, k, r) = (shape.p(), shape.n_cores(), shape.ranks());
        permute(x, &self.x_dims, &self.digit_perm, &mut self.s[0]);
        let mut hp = self.hp.acquire();
        permute_cores(shape, h, &mut hp);
        let mut rows = batch * shape.in_features();
        for c in 0..p {
            rows /= shape.mode(c);
            let w = shape.mode(c) * r[c];
            let (done, rest) = self.s.split_at_mut(c + 1);
            matmul(
                MatMut::new(&mut rest[0], rows, r[c + 1]),
                MatRef::new(&done[c], rows, w),
                MatRef::new(&hp[c], w, r[c + 1]),
                false,
            );
        }
        let mut rows = batch;
        for c in p..k {
            let w = shape.mode(c) * r[c + 1];
            let core = MatRef::new(&h[c], r[c], w);
            // Z_{c+1} goes to z[c - p] (or to y for the last core); Z_c is S_p or z[c - 1 - p].
            let (before, after) = self.z.split_at_mut(c - p);
            let input: &[f32] = if c == p {
                &self.s[p]
            } else {
                &before[c - 1 - p]
            };
            let out: &mut [f32] = if c + 1 == k { &mut *y } else { &mut after[0] };
            matmul(
                MatMut::new(out, rows, w),
                MatRef::new(input, rows, r[c]),
                core,
                false,
            );
            rows *= shape.mode(c);
        }
    }

    pub fn backward(
        &mut self,
        shape: &TtShape,
        h: &[Scratch],
        dh: &mut [Scratch],
        batch: usize,
        dy: &[f32],
        dx: Option<&mut [f32]>,
    ) {
        let (p, k, r) = (shape.p(), shape.n_cores(), shape.ranks());
        let (mut hp, mut dhp, mut d) = (self.hp.acquire(), self.dhp.acquire(), self.d.acquire());
        permute_cores(shape, h, &mut hp);
        let (d0, d1) = d.split_at_mut(1);
        let (mut cur, mut next) = (&mut d0[0], &mut d1[0]);
        // Output side, from dZ_K = dY down to dZ_p = dS_p (left in `cur`).
        let mut rows = batch * shape.out_features();
        for c in (p..k).rev() {
            let w = shape.mode(c) * r[c + 1];
            rows /= shape.mode(c);
            let zc: &[f32] = if c == p {
                &self.s[p]
            } else {
                &self.z[c - 1 - p]
            };
            let dz_next: &[f32] = if c + 1 == k { dy } else { &cur[..rows * w] };
            let dz_next = MatRef::new(dz_next, rows, w);
            matmul(
                MatMut::new(&mut dh[c], r[c], w),
                MatRef::new(zc, rows, r[c]).t(),
                dz_next,
                false,
            );
            matmul(
                MatMut::new(&mut next[..rows * r[c]], rows, r[c]),
                dz_next,
                MatRef::new(&h[c], r[c], w).t(),
                false,
            );
            std::mem::swap(&mut cur, &mut next);
        }
        // Input side, from dS_p down to dS_0.
        let need_dx = dx.is_some();
        let mut tail = 1; // n_{c+1}⋯n_{p-1}
        for c in (0..p).rev() {
            let rows = batch * tail;
            tail *= shape.mode(c);
            let w = shape.mode(c) * r[c];
            let ds_next = MatRef::new(&cur[..rows * r[c + 1]], rows, r[c + 1]);
            matmul(
                MatMut::new(&mut dhp[c], w, r[c + 1]),
                MatRef::new(&self.s[c], rows, w).t(),
                ds_next,
                false,
            );
            if c > 0 || need_dx {
                matmul(
                    MatMut::new(&mut next[..rows * w], rows, w),
                    ds_next,
                    MatRef::new(&hp[c], w, r[c + 1]).t(),
                    false,
                );
                std::mem::swap(&mut cur, &mut next);
            }
            let hp_dims = [shape.mode(c), r[c], r[c + 1]];
            permute(&dhp[c], &hp_dims, &[1, 0, 2], &mut dh[c]);
        }
        if let Some(dx) = dx {
            let n = batch * shape.in_features();
            permute(&cur[..n], &self.xr_dims, &self.digit_perm, dx);
        }
    }
}

/// H'_c = H_c with its first two axes swapped, c < p.
fn permute_cores(shape: &TtShape, h: &[Scratch], hp: &mut [Scratch]) {
    for c in 0..shape.p() {
        permute(&h[c], &shape.core_shape(c), &[1, 0, 2], &mut hp[c]);
    }
}
