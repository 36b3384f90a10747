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
        for b in 0..bsz {
            let qkv_b = &qkv[b * t * 3 * d..(b + 1) * t * 3 * d]; // (T, 3D)
            let out_b = &mut out[b * t * d..(b + 1) * t * d]; // (T, D)
            let mask_b = mask.map(|m| &m[b * t..(b + 1) * t]); // (T)
            for h in 0..nh {
                let q = MatRef::strided(&qkv_b[h * hd..], t, hd, 3 * d, 1); // (T, d)
                let k = MatRef::strided(&qkv_b[d + h * hd..], t, hd, 3 * d, 1); // (T, d)
                let v = MatRef::strided(&qkv_b[2 * d + h * hd..], t, hd, 3 * d, 1); // (T, d)
                let p = &mut ws.probs[(b * nh + h) * t * t..(b * nh + h + 1) * t * t]; // (T, T)
                                                                                       // Q·Kᵀ, then scale, mask and softmax each row in place.
                matmul(MatMut::new(p, t, t), q, k.t(), false);
                for i in 0..t {
                    let row = &mut p[i * t..(i + 1) * t];
                    let allowed = |j: usize| -> bool {
                        mask_b.is_none_or(|m| m[j] != 0) && (!self.causal || j <= i)
                    };
                    let mut max = f32::NEG_INFINITY;
                    for j in 0..t {
                        if allowed(j) {
                            row[j] *= scale;
                            max = max.max(row[j]);
                        }
                    }
                    if max == f32::NEG_INFINITY {
                        row.fill(0.0); // no allowed key
                        continue;
                    }
                    let mut sum = 0.0f32;
                    for j in 0..t {
                        if allowed(j) {
                            let e = comera_tensor::math::exp(row[j] - max);
                            row[j] = e;
                            sum += e;
                        } else {
                            row[j] = 0.0;
                        }
                    }
                    let inv = 1.0 / sum;
                    for x in row.iter_mut() {
                        *x *= inv;
                    }
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
                for i in 0..t {
                    let pr = &p[i * t..(i + 1) * t];
                    let dr = &mut ds[i * t..(i + 1) * t];
                    let dot: f32 = pr.iter().zip(dr.iter()).map(|(a, b)| a * b).sum();
                    for (x, &pv) in dr.iter_mut().zip(pr) {
                        *x = scale * pv * (*x - dot);
                    }
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
