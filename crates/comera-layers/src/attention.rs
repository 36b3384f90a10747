//! Multi-head self-attention core with a padding mask (no projections: the Q/K/V and output
//! projections are separate layers owned by the model).
//!
//! Input `qkv` (B, T, 3D) holds Q, K, V concatenated on the last axis (llm.c's layout); head h
//! (of H, size d = D/H) of batch b uses the T × d strided views (row stride 3D)
//!   Q_bh = qkv[b, :, h·d .. (h+1)·d],  K_bh = qkv[b, :, D + h·d ..],  V_bh = qkv[b, :, 2D + h·d ..].
//! With s = 1/√d and the allowed set A(b, i) = { j : mask[b, j] = 1 (and j ≤ i if causal) }:
//!   S = s·Q·Kᵀ (T × T),   P_ij = exp(S_ij − max_{A} S_i·) / Σ_{k∈A} exp(S_ik − max) for j ∈ A,
//!   P_ij = 0 otherwise (an excluded key acts as a −∞ score),
//!   O_bh = P·V  → out[b, :, h·d .. (h+1)·d]   (out is (B, T, D)).
//! Query rows at padding positions are ordinary rows (finite outputs); a row with no allowed key
//! (an all-padding sequence) gets P = 0 and output 0. P (B, H, T, T) is saved for backward:
//!   dV = Pᵀ·dO,   dP = dO·Vᵀ,   dS_ij = P_ij·(dP_ij − Σ_k P_ik·dP_ik),
//!   dQ = s·dS·K,  dK = s·dSᵀ·Q,
//! all written straight into the matching strided views of dqkv (B, T, 3D). Excluded entries
//! have P = 0, so they pass no gradient: K and V rows at padding positions get exactly zero.
//!
//! Each (b, h) is independent and writes disjoint columns; they run in a fixed order (the GEMMs
//! themselves use the thread pool when large), so results do not depend on the thread count.

use crate::check_len;
use comera_tensor::{matmul, MatMut, MatRef};

/// Multi-head scaled dot-product self-attention over a packed QKV buffer.
#[derive(Clone, Copy, Debug)]
pub struct Attention {
    d_model: usize,
    n_heads: usize,
    /// Also exclude keys after the query (j > i).
    pub causal: bool,
}

/// Saved probabilities and scratch for a fixed (batch, seq_len).
#[derive(Debug)]
pub struct AttentionWorkspace {
    batch: usize,
    seq: usize,
    probs: Vec<f32>,   // (B, H, T, T)
    scratch: Vec<f32>, // (T, T): dP, then dS, of the current head in backward
    allow: Vec<f32>,   // (T): 1 for an allowed key of the current sequence, else 0
}

impl AttentionWorkspace {
    /// The attention probabilities of the last forward, (B, H, T, T).
    pub fn probs(&self) -> &[f32] {
        &self.probs
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    pub fn seq_len(&self) -> usize {
        self.seq
    }
}

impl Attention {
    /// Bidirectional (encoder) attention; panics unless `n_heads` divides `d_model`.
    pub fn new(d_model: usize, n_heads: usize) -> Attention {
        assert!(
            n_heads > 0 && d_model / n_heads * n_heads == d_model,
            "attention: {n_heads} heads do not divide d_model {d_model}"
        );
        Attention {
            d_model,
            n_heads,
            causal: false,
        }
    }

    /// The same with a causal mask (j ≤ i) on top of the padding mask.
    pub fn causal(d_model: usize, n_heads: usize) -> Attention {
        Attention {
            causal: true,
            ..Attention::new(d_model, n_heads)
        }
    }

    pub fn d_model(&self) -> usize {
        self.d_model
    }

    pub fn n_heads(&self) -> usize {
        self.n_heads
    }

    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_heads
    }

    /// Allocates P (B, H, T, T) and a T × T scratch.
    pub fn workspace(&self, batch: usize, seq_len: usize) -> AttentionWorkspace {
        AttentionWorkspace {
            batch,
            seq: seq_len,
            probs: vec![0.0; batch * self.n_heads * seq_len * seq_len],
            scratch: vec![0.0; seq_len * seq_len],
            allow: vec![1.0; seq_len],
        }
    }

    /// `out` (B, T, D) = attention of `qkv` (B, T, 3D); `mask` (B, T), 1 = real token,
    /// 0 = padding (`None`: no padding). Saves P in `ws`.
    pub fn forward(
        &self,
        ws: &mut AttentionWorkspace,
        qkv: &[f32],
        mask: Option<&[u8]>,
        out: &mut [f32],
    ) {
        let (bsz, t, d, nh, hd) = (
            ws.batch,
            ws.seq,
            self.d_model,
            self.n_heads,
            self.head_dim(),
        );
        check_len("Attention qkv", qkv.len(), bsz * t * 3 * d);
        check_len("Attention out", out.len(), bsz * t * d);
        if let Some(m) = mask {
            check_len("Attention mask", m.len(), bsz * t);
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let mut allow = std::mem::take(&mut ws.allow);
        allow.resize(t, 1.0);
        for b in 0..bsz {
            let qkv_b = &qkv[b * t * 3 * d..(b + 1) * t * 3 * d]; // (T, 3D)
            let out_b = &mut out[b * t * d..(b + 1) * t * d]; // (T, D)
                                                              // 1 for an allowed key, 0 for a padding one.
            match mask {
                Some(m) => {
                    for (a, &v) in allow.iter_mut().zip(&m[b * t..(b + 1) * t]) {
                        *a = (v != 0) as u8 as f32;
                    }
                }
                None => allow.fill(1.0),
            }
            for h in 0..nh {
                let q = MatRef::strided(&qkv_b[h * hd..], t, hd, 3 * d, 1); // (T, d)
                let k = MatRef::strided(&qkv_b[d + h * hd..], t, hd, 3 * d, 1); // (T, d)
                let v = MatRef::strided(&qkv_b[2 * d + h * hd..], t, hd, 3 * d, 1); // (T, d)
                let p = &mut ws.probs[(b * nh + h) * t * t..(b * nh + h + 1) * t * t]; // (T, T)
                                                                                       // Q·Kᵀ, then scale, mask and softmax each row in place.
                matmul(MatMut::new(p, t, t), q, k.t(), false);
                for (i, row) in p.chunks_exact_mut(t).enumerate() {
                    // Keys after the query are excluded under a causal mask.
                    let len = if self.causal { i + 1 } else { t };
                    let (head, tail) = row.split_at_mut(len);
                    softmax::row(head, &allow[..len], scale);
                    tail.fill(0.0);
                }
                // O = P·V into this head's columns of out.
                matmul(
                    MatMut::strided(&mut out_b[h * hd..], t, hd, d, 1),
                    MatRef::new(p, t, t),
                    v,
                    false,
                );
            }
        }
        ws.allow = allow;
    }

    /// Given the `qkv` of the matching forward and `dout` (B, T, D), *writes* `dqkv`
    /// (B, T, 3D).
    pub fn backward(
        &self,
        ws: &mut AttentionWorkspace,
        qkv: &[f32],
        dout: &[f32],
        dqkv: &mut [f32],
    ) {
        let (bsz, t, d, nh, hd) = (
            ws.batch,
            ws.seq,
            self.d_model,
            self.n_heads,
            self.head_dim(),
        );
        check_len("Attention qkv", qkv.len(), bsz * t * 3 * d);
        check_len("Attention dout", dout.len(), bsz * t * d);
        check_len("Attention dqkv", dqkv.len(), bsz * t * 3 * d);
        let scale = 1.0 / (hd as f32).sqrt();
        for b in 0..bsz {
            let qkv_b = &qkv[b * t * 3 * d..(b + 1) * t * 3 * d]; // (T, 3D)
            let dqkv_b = &mut dqkv[b * t * 3 * d..(b + 1) * t * 3 * d]; // (T, 3D)
            let dout_b = &dout[b * t * d..(b + 1) * t * d]; // (T, D)
            for h in 0..nh {
                let q = MatRef::strided(&qkv_b[h * hd..], t, hd, 3 * d, 1); // (T, d)
                let k = MatRef::strided(&qkv_b[d + h * hd..], t, hd, 3 * d, 1); // (T, d)
                let v = MatRef::strided(&qkv_b[2 * d + h * hd..], t, hd, 3 * d, 1); // (T, d)
                let d_o = MatRef::strided(&dout_b[h * hd..], t, hd, d, 1); // (T, d)
                let p = &ws.probs[(b * nh + h) * t * t..(b * nh + h + 1) * t * t]; // (T, T)
                let pm = MatRef::new(p, t, t);
                // dV = Pᵀ·dO
                matmul(
                    MatMut::strided(&mut dqkv_b[2 * d + h * hd..], t, hd, 3 * d, 1),
                    pm.t(),
                    d_o,
                    false,
                );
                // dP = dO·Vᵀ, then dS' = s·P ⊙ (dP − rowsum(P ⊙ dP)) in place.
                let ds = &mut ws.scratch;
                matmul(MatMut::new(ds, t, t), d_o, v.t(), false);
                for (pr, dr) in p.chunks_exact(t).zip(ds.chunks_exact_mut(t)) {
                    softmax::grad(pr, dr, scale);
                }
                let dsm = MatRef::new(ds, t, t);
                // dQ = dS'·K,  dK = dS'ᵀ·Q
                matmul(
                    MatMut::strided(&mut dqkv_b[h * hd..], t, hd, 3 * d, 1),
                    dsm,
                    k,
                    false,
                );
                matmul(
                    MatMut::strided(&mut dqkv_b[d + h * hd..], t, hd, 3 * d, 1),
                    dsm.t(),
                    q,
                    false,
                );
            }
        }
    }
}

/// Row kernels of the softmax and its backward, vectorised over 8 lanes (fixed lane order, so
/// results depend only on the inputs) and compiled a second time with AVX2 + FMA, picked at
/// run time.
mod softmax {
    const L: usize = 8;

    /// Max over the allowed entries (−∞ if none).
    #[inline(always)]
    fn masked_max(row: &[f32], allow: &[f32]) -> f32 {
        let mut acc = [f32::NEG_INFINITY; L];
        let (rc, ac) = (row.chunks_exact(L), allow.chunks_exact(L));
        let (rr, ar) = (rc.remainder(), ac.remainder());
        for (r, a) in rc.zip(ac) {
            for l in 0..L {
                let v = if a[l] != 0.0 { r[l] } else { f32::NEG_INFINITY };
                acc[l] = if v > acc[l] { v } else { acc[l] };
            }
        }
        let mut max = f32::NEG_INFINITY;
        for (&r, &a) in rr.iter().zip(ar) {
            if a != 0.0 && r > max {
                max = r;
            }
        }
        acc.iter().fold(max, |m, &v| if v > m { v } else { m })
    }

    /// row ← exp(scale·(row − max)) on allowed entries, 0 elsewhere; returns the sum.
    #[inline(always)]
    fn exp_sum(row: &mut [f32], allow: &[f32], scale: f32, max: f32) -> f32 {
        let shift = scale * max;
        let mut acc = [0.0f32; L];
        let mut tail = 0.0f32;
        let n = row.len() / L * L;
        let (rb, rr) = row.split_at_mut(n);
        let (ab, ar) = allow.split_at(n);
        for (r, a) in rb.chunks_exact_mut(L).zip(ab.chunks_exact(L)) {
            for l in 0..L {
                let e = comera_tensor::math::exp(scale * r[l] - shift);
                let e = if a[l] != 0.0 { e } else { 0.0 };
                r[l] = e;
                acc[l] += e;
            }
        }
        for (r, &a) in rr.iter_mut().zip(ar) {
            let e = comera_tensor::math::exp(scale * *r - shift);
            *r = if a != 0.0 { e } else { 0.0 };
            tail += *r;
        }
        acc.iter().sum::<f32>() + tail
    }

    #[inline(always)]
    fn row_body(row: &mut [f32], allow: &[f32], scale: f32) {
        let max = masked_max(row, allow);
        if max == f32::NEG_INFINITY {
            row.fill(0.0); // no allowed key
            return;
        }
        let inv = 1.0 / exp_sum(row, allow, scale, max);
        for x in row.iter_mut() {
            *x *= inv;
        }
    }

    /// dS row = scale·P ⊙ (dP − Σ P⊙dP), in place in `dp`.
    #[inline(always)]
    fn grad_body(p: &[f32], dp: &mut [f32], scale: f32) {
        let mut acc = [0.0f32; L];
        let n = p.len() / L * L;
        for (a, b) in p[..n].chunks_exact(L).zip(dp[..n].chunks_exact(L)) {
            for l in 0..L {
                acc[l] += a[l] * b[l];
            }
        }
        let tail: f32 = p[n..].iter().zip(&dp[n..]).map(|(a, b)| a * b).sum();
        let dot = acc.iter().sum::<f32>() + tail;
        for (x, &pv) in dp.iter_mut().zip(p) {
            *x = scale * pv * (*x - dot);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn row_avx2(row: &mut [f32], allow: &[f32], scale: f32) {
        row_body(row, allow, scale)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn grad_avx2(p: &[f32], dp: &mut [f32], scale: f32) {
        grad_body(p, dp, scale)
    }

    fn has_avx2() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// Softmax of `scale·row` over the entries with `allow` ≠ 0 (the others get 0); a row with
    /// no allowed entry becomes all zeros.
    pub(super) fn row(row: &mut [f32], allow: &[f32], scale: f32) {
        assert_eq!(row.len(), allow.len());
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU supports the features the function was compiled for.
            return unsafe { row_avx2(row, allow, scale) };
        }
        row_body(row, allow, scale)
    }

    /// The softmax backward of one row: `dp` ← scale·p ⊙ (dp − ⟨p, dp⟩).
    pub(super) fn grad(p: &[f32], dp: &mut [f32], scale: f32) {
        assert_eq!(p.len(), dp.len());
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU supports the features the function was compiled for.
            return unsafe { grad_avx2(p, dp, scale) };
        }
        grad_body(p, dp, scale)
    }
}
