//! Multi-head self-attention core with a padding mask (no projections: the Q/K/V and output
//! projections are separate layers owned by the model).
//!
//! Input `qkv` (3, B, T, D) holds Q, K and V one after the other, each (B, T, D): the layout in
//! which the q, k and v projections write their outputs without a copy (one fused product
//! writes its layers' outputs one after the other too). Head h (of H, size d = D/H) of batch b
//! uses the T × d strided views (row stride D)
//!   Q_bh = Q[b, :, h·d .. (h+1)·d],  K_bh = K[b, :, h·d ..],  V_bh = V[b, :, h·d ..].
//! With s = 1/√d and the allowed set A(b, i) = { j : mask[b, j] = 1 (and j ≤ i if causal) }:
//!   S = s·Q·Kᵀ (T × T),   P_ij = exp(S_ij − max_{A} S_i·) / Σ_{k∈A} exp(S_ik − max) for j ∈ A,
//!   P_ij = 0 otherwise (an excluded key acts as a −∞ score),
//!   O_bh = P·V  → out[b, :, h·d .. (h+1)·d]   (out is (B, T, D)).
//! Query rows at padding positions are ordinary rows (finite outputs); a row with no allowed key
//! (an all-padding sequence) gets P = 0 and output 0. P (B, H, T, T) is saved for backward:
//!   dV = Pᵀ·dO,   dP = dO·Vᵀ,   dS_ij = P_ij·(dP_ij − Σ_k P_ik·dP_ik),
//!   dQ = s·dS·K,  dK = s·dSᵀ·Q,
//! all written straight into the matching strided views of dqkv (3, B, T, D). Excluded entries
//! have P = 0, so they pass no gradient: K and V rows at padding positions get exactly zero.
//!
//! Each (b, h) is independent and writes disjoint columns: the units are claimed one at a time
//! by one task per thread, each unit's products on one thread with that task's scratch, so
//! results do not depend on the thread count.
//!
//! [`Attention::forward_first`] / [`Attention::backward_first`] compute the same for the first
//! query row of each sequence only (what a classifier on the [CLS] position reads from the
//! last block): per (b, h) the T scores s·q_0·k_j, their masked softmax p (kept, (B, H, T)) and
//! o_0 = Σ_j p_j·v_j; backward dp_j = dO_0·v_j, ds'_j = s·p_j·(dp_j − Σ_k p_k·dp_k),
//! dq_0 = Σ_j ds'_j·k_j, dk_j = ds'_j·q_0, dv_j = p_j·dO_0, and dq of every other row 0.

use crate::check_len;
use comera_tensor::{matmul_serial, DisjointMut, MatMut, MatRef};

/// Largest P (B·H·T² floats, 4 MiB) that [`Attention::workspace_for`] keeps for the backward
/// instead of recomputing it. Keeping it makes the backward skip one S = Q·Kᵀ product and one
/// softmax pass per head: measured with `comera --threads 2 bench step --batch 1` on the
/// paper's model, 0.4-0.6 ms less of a 24 ms step for 4.5 MiB more (6 blocks × 0.75 MiB).
pub const KEEP_P_MAX_FLOATS: usize = 1 << 20;

/// Multi-head scaled dot-product self-attention over a QKV buffer (3, B, T, D).
#[derive(Clone, Copy, Debug)]
pub struct Attention {
    d_model: usize,
    n_heads: usize,
    /// Also exclude keys after the query (j > i).
    pub causal: bool,
}

/// Saved probabilities and scratch for a fixed (batch, seq_len).
///
/// The B·H (sequence, head) units are independent: tasks (one a thread) claim them one
/// at a time, each running a unit's serial GEMMs in its own (T, T) scratch, so every unit's
/// bits are the same whatever the thread count or which task takes it.
#[derive(Debug)]
pub struct AttentionWorkspace {
    batch: usize,
    seq: usize,
    /// Kept P, (B, H, T, T); empty in recompute mode.
    probs: Vec<f32>,
    /// Per task (one a thread when the workspace was made): (T, T) for P (recompute mode),
    /// then (T, T) for dP/dS.
    scratch: Vec<f32>,
    allow: Vec<f32>, // (B, T): 1 for an allowed key, else 0
    /// Recompute mode: P is not kept; `stats` holds each row's (max, 1/sum).
    recompute: bool,
    stats: Vec<f32>, // (B, H, T, 2) in recompute mode, else empty
}

impl AttentionWorkspace {
    /// The attention probabilities of the last forward, (B, H, T, T); empty for a workspace
    /// that does not keep them ([`Attention::workspace_recompute`]).
    pub fn probs(&self) -> &[f32] {
        &self.probs
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Whether the backward rebuilds P from Q and K (see [`Attention::workspace_recompute`]).
    pub fn recomputes(&self) -> bool {
        self.recompute
    }

    pub fn seq_len(&self) -> usize {
        self.seq
    }
}

/// Runs `f(u, p_u, stats_u, scratch)` for every (sequence, head) unit `u` of `0..units`, in
/// parallel: the scratch slots (`cu` floats each, one a thread) claim units one at a time
/// ([`comera_tensor::for_each_claimed`]), so a delayed thread holds up at most one unit.
/// `p_u` is unit u's kept P (`pu` floats; empty in recompute mode), `stats_u` its row
/// statistics (`su` floats; empty when P is kept). A unit's bits never depend on which slot
/// computes it: the slot is scratch, written before it is read.
#[allow(clippy::too_many_arguments)]
fn run_units(
    units: usize,
    probs: &mut [f32],
    pu: usize,
    stats: &mut [f32],
    su: usize,
    scratch: &mut [f32],
    cu: usize,
    f: &(impl Fn(usize, &mut [f32], &mut [f32], &mut [f32]) + Sync),
) {
    let (probs, stats) = (DisjointMut::new(probs), DisjointMut::new(stats));
    comera_tensor::for_each_claimed(units, scratch, cu, |u, scratch| {
        // SAFETY: the counter hands unit u to one call only, and only unit u's call touches
        // its P (`u·pu ..`) and its statistics (`u·su ..`).
        unsafe {
            probs.with_range(u * pu, pu, |p| {
                stats.with_range(u * su, su, |st| f(u, p, st, scratch))
            })
        }
    });
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

    /// Multiply-adds ×2 of one forward over `batch` sequences of `seq_len` tokens: per head
    /// S = Q·Kᵀ and O = P·V, 2·T²·d each (the softmax is not counted).
    pub fn forward_flops(&self, batch: usize, seq_len: usize) -> f64 {
        2.0 * 2.0 * (batch * self.n_heads * seq_len * seq_len * self.head_dim()) as f64
    }

    /// The same for a backward: dV = Pᵀ·dO, dP = dO·Vᵀ, dQ = dS·K, dK = dSᵀ·Q, plus S = Q·Kᵀ
    /// again for a workspace that recomputes P.
    pub fn backward_flops(&self, ws: &AttentionWorkspace) -> f64 {
        let per = 2.0 * (ws.batch * self.n_heads * ws.seq * ws.seq * self.head_dim()) as f64;
        per * if ws.recompute { 5.0 } else { 4.0 }
    }

    fn new_workspace(&self, batch: usize, seq_len: usize, recompute: bool) -> AttentionWorkspace {
        let (units, tt) = (batch * self.n_heads, seq_len * seq_len);
        let parts = rayon::current_num_threads().clamp(1, units.max(1));
        AttentionWorkspace {
            batch,
            seq: seq_len,
            probs: if recompute {
                Vec::new()
            } else {
                vec![0.0; units * tt]
            },
            scratch: vec![0.0; parts * 2 * tt],
            allow: vec![1.0; batch * seq_len],
            recompute,
            stats: if recompute {
                vec![0.0; units * 2 * seq_len]
            } else {
                Vec::new()
            },
        }
    }

    /// Allocates P (B, H, T, T) and a (T, T) scratch per thread.
    pub fn workspace(&self, batch: usize, seq_len: usize) -> AttentionWorkspace {
        self.new_workspace(batch, seq_len, false)
    }

    /// A workspace that does not keep P (B·H·T² floats) for the backward but only each row's
    /// max and normaliser (B·H·T·2 floats), and recomputes P from Q and K in the backward (one
    /// more T×T×d product per head; the same bits as the forward's P, so the gradients are
    /// those of [`Attention::workspace`]).
    pub fn workspace_recompute(&self, batch: usize, seq_len: usize) -> AttentionWorkspace {
        self.new_workspace(batch, seq_len, true)
    }

    /// The workspace a model plans with: P kept when it is small (at most
    /// [`KEEP_P_MAX_FLOATS`] floats, e.g. batch 1 × 12 heads × 128² tokens: 0.75 MiB), where
    /// recomputing it would cost a product and a softmax pass per head to save nothing that
    /// matters; recomputed above (at the paper's batch 32, P is 24 MiB per block).
    pub fn workspace_for(&self, batch: usize, seq_len: usize) -> AttentionWorkspace {
        let p_floats = batch * self.n_heads * seq_len * seq_len;
        self.new_workspace(batch, seq_len, p_floats > KEEP_P_MAX_FLOATS)
    }

    /// Bytes held by a workspace (P or the row statistics, scratch, mask).
    pub fn workspace_bytes(ws: &AttentionWorkspace) -> usize {
        4 * (ws.probs.len() + ws.scratch.len() + ws.allow.len() + ws.stats.len())
    }

    /// S = Q·Kᵀ of head `h` of one sequence (its Q and K rows `q_b`, `k_b`: (T, D) each) into
    /// `p`, then the masked softmax of each row (saving or applying the row statistics in
    /// `stats`, 2 per row).
    #[allow(clippy::too_many_arguments)]
    fn probs_of_head(
        &self,
        q_b: &[f32],
        k_b: &[f32],
        h: usize,
        t: usize,
        allow: &[f32],
        p: &mut [f32],
        stats: Option<&mut [f32]>,
        reuse: bool,
    ) {
        let (d, hd) = (self.d_model, self.head_dim());
        let scale = 1.0 / (hd as f32).sqrt();
        let q = MatRef::strided(&q_b[h * hd..], t, hd, d, 1); // (T, d)
        let k = MatRef::strided(&k_b[h * hd..], t, hd, d, 1); // (T, d)
        matmul_serial(MatMut::new(p, t, t), q, k.t(), false);
        let mut stats = stats;
        for (i, row) in p.chunks_exact_mut(t).enumerate() {
            // Keys after the query are excluded under a causal mask.
            let len = if self.causal { i + 1 } else { t };
            let (head, tail) = row.split_at_mut(len);
            let st = stats.as_deref_mut().map(|s| &mut s[2 * i..2 * i + 2]);
            match (st, reuse) {
                (Some(st), true) => softmax::apply(head, &allow[..len], scale, st[0], st[1]),
                (Some(st), false) => {
                    let (max, inv) = softmax::row(head, &allow[..len], scale);
                    st.copy_from_slice(&[max, inv]);
                }
                (None, _) => {
                    softmax::row(head, &allow[..len], scale);
                }
            }
            tail.fill(0.0);
        }
    }

    /// `out` (B, T, D) = attention of `qkv` (3, B, T, D); `mask` (B, T), 1 = real token,
    /// 0 = padding (`None`: no padding). Saves P (or its row statistics) in `ws`.
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
        check_len("Attention qkv", qkv.len(), 3 * bsz * t * d);
        check_len("Attention out", out.len(), bsz * t * d);
        if let Some(m) = mask {
            check_len("Attention mask", m.len(), bsz * t);
        }
        allowed_keys(mask, &mut ws.allow);
        let (tt, recompute) = (t * t, ws.recompute);
        let allow_all = &ws.allow;
        let out = DisjointMut::new(out);
        let (pu, su) = if recompute { (0, 2 * t) } else { (tt, 0) };
        run_units(
            bsz * nh,
            &mut ws.probs,
            pu,
            &mut ws.stats,
            su,
            &mut ws.scratch,
            2 * tt,
            &|u, p_kept, stats, scratch| {
                let (b, h) = (u / nh, u % nh);
                let [q_b, k_b, v_b] = sequence(qkv, bsz, t, d, b);
                let allow = &allow_all[b * t..(b + 1) * t];
                let v = MatRef::strided(&v_b[h * hd..], t, hd, d, 1); // (T, d)
                let (p, stats) = if recompute {
                    (&mut scratch[..tt], Some(stats))
                } else {
                    (p_kept, None)
                };
                // Q·Kᵀ, then scale, mask and softmax each row in place.
                self.probs_of_head(q_b, k_b, h, t, allow, p, stats, false);
                // O = P·V into this head's columns of out.
                // SAFETY: unit (b, h) alone writes out[b, :, h·d .. (h+1)·d].
                unsafe {
                    out.matmul_serial_into(
                        b * t * d + h * hd,
                        (t, hd, d, 1),
                        MatRef::new(p, t, t),
                        v,
                        false,
                    )
                };
            },
        );
    }

    /// Counted FLOPs of [`Attention::forward_first`] plus [`Attention::backward_first`]: per
    /// sequence, head and key 2 multiply-adds per head dimension forward (score, o_0) and 4
    /// backward (dp, dk, dv, dq).
    pub fn first_flops(&self, batch: usize, seq_len: usize) -> f64 {
        2.0 * 6.0 * (batch * seq_len * self.d_model) as f64
    }

    /// Floats of the kept probabilities of [`Attention::forward_first`], and of the scratch of
    /// [`Attention::backward_first`]: (B, H, T).
    pub fn first_probs_len(&self, batch: usize, seq_len: usize) -> usize {
        batch * self.n_heads * seq_len
    }

    /// Attention output of the first query row of each sequence only: `out_first` (B, D) =
    /// row 0 of [`Attention::forward`]'s output for `qkv` (3, B, T, D) and the padding mask
    /// `allow` (B, T; see [`allowed_keys`]). Keeps those rows' probabilities in `probs`
    /// ((B, H, T), see [`Attention::first_probs_len`]). The (sequence, head) units run in
    /// parallel, each on one thread (at batch 1 the heads of the one sequence side by side),
    /// so the bits do not depend on the thread count.
    pub fn forward_first(
        &self,
        qkv: &[f32],
        allow: &[f32],
        seq_len: usize,
        probs: &mut [f32],
        out_first: &mut [f32],
    ) {
        use rayon::prelude::*;
        let (t, d, nh, hd) = (seq_len, self.d_model, self.n_heads, self.head_dim());
        let bsz = out_first.len() / d;
        check_len("Attention qkv", qkv.len(), 3 * bsz * t * d);
        check_len("Attention out_first", out_first.len(), bsz * d);
        check_len("Attention allow", allow.len(), bsz * t);
        check_len("Attention probs", probs.len(), self.first_probs_len(bsz, t));
        let scale = 1.0 / (hd as f32).sqrt();
        // Under a causal mask the first query sees only the first key.
        let len = if self.causal { 1 } else { t };
        // Unit u = b·H + h: its probabilities are probs' u-th T floats, its output the u-th
        // head-wide piece of out_first (B, H, dh).
        let units = probs
            .par_chunks_mut(t)
            .zip(out_first.par_chunks_mut(hd))
            .enumerate();
        comera_tensor::for_each(units, |(u, (p, o))| {
            let (b, h) = (u / nh, u % nh);
            let [q_b, k_b, v_b] = sequence(qkv, bsz, t, d, b);
            let allow = &allow[b * t..b * t + len];
            let q = &q_b[h * hd..(h + 1) * hd];
            for (j, pj) in p.iter_mut().enumerate() {
                *pj = dot(q, &k_b[j * d + h * hd..][..hd]);
            }
            let (head, tail) = p.split_at_mut(len);
            softmax::row(head, allow, scale);
            tail.fill(0.0);
            // o_0 = Σ_j p_j·v_j, j ascending.
            o.fill(0.0);
            for (j, &pj) in p.iter().enumerate() {
                let v = &v_b[j * d + h * hd..][..hd];
                for (ov, &vv) in o.iter_mut().zip(v) {
                    *ov += pj * vv;
                }
            }
        });
    }

    /// Given the `qkv` and `probs` of the matching [`Attention::forward_first`] and
    /// `dout_first` (B, D), *writes* `dqkv` (3, B, T, D): dq of the first rows, dk and dv of
    /// every row, 0 elsewhere. `scratch` holds (B, H, T) floats ([`Attention::first_probs_len`]).
    /// The (sequence, head) units run in parallel as in the forward, each writing its head's
    /// columns of dK and dV and of dQ's first row.
    pub fn backward_first(
        &self,
        qkv: &[f32],
        probs: &[f32],
        dout_first: &[f32],
        seq_len: usize,
        scratch: &mut [f32],
        dqkv: &mut [f32],
    ) {
        use rayon::prelude::*;
        let (t, d, nh, hd) = (seq_len, self.d_model, self.n_heads, self.head_dim());
        let bsz = dout_first.len() / d;
        check_len("Attention qkv", qkv.len(), 3 * bsz * t * d);
        check_len("Attention dout_first", dout_first.len(), bsz * d);
        check_len("Attention probs", probs.len(), self.first_probs_len(bsz, t));
        check_len(
            "Attention scratch",
            scratch.len(),
            self.first_probs_len(bsz, t),
        );
        check_len("Attention dqkv", dqkv.len(), 3 * bsz * t * d);
        let scale = 1.0 / (hd as f32).sqrt();
        // dQ is 0 but in the first rows, which the units add into.
        crate::elementwise::zero(&mut dqkv[..bsz * t * d]);
        let (dqkv, nd) = (DisjointMut::new(dqkv), bsz * t * d);
        let units = scratch
            .par_chunks_mut(t)
            .zip(probs.par_chunks(t))
            .zip(dout_first.par_chunks(hd))
            .enumerate();
        comera_tensor::for_each(units, |(u, ((ds, p), d_o))| {
            let (b, h) = (u / nh, u % nh);
            let [q_b, k_b, v_b] = sequence(qkv, bsz, t, d, b);
            let q = &q_b[h * hd..(h + 1) * hd];
            // dp_j = dO_0·v_j, then ds'_j = s·p_j·(dp_j − ⟨p, dp⟩) in place.
            for (j, dsj) in ds.iter_mut().enumerate() {
                *dsj = dot(d_o, &v_b[j * d + h * hd..][..hd]);
            }
            softmax::grad(p, ds, scale);
            // dk_j = ds'_j·q_0,  dv_j = p_j·dO_0 (every row's head columns of dK, dV written).
            for j in 0..t {
                let at = (b * t + j) * d + h * hd;
                // SAFETY: unit (b, h) alone touches columns h·dh .. (h+1)·dh of sequence b's
                // rows of dQ, dK and dV.
                unsafe {
                    dqkv.with_range(nd + at, hd, |dk| {
                        for (dk, &qv) in dk.iter_mut().zip(q) {
                            *dk = ds[j] * qv;
                        }
                    });
                    dqkv.with_range(2 * nd + at, hd, |dv| {
                        for (dv, &g) in dv.iter_mut().zip(d_o) {
                            *dv = p[j] * g;
                        }
                    });
                }
            }
            // dq_0 = Σ_j ds'_j·k_j, j ascending.
            // SAFETY: as above (row 0 of sequence b, head h's columns).
            unsafe {
                dqkv.with_range(b * t * d + h * hd, hd, |dq| {
                    for (j, &dsj) in ds.iter().enumerate() {
                        let k = &k_b[j * d + h * hd..][..hd];
                        for (g, &kv) in dq.iter_mut().zip(k) {
                            *g += dsj * kv;
                        }
                    }
                });
            }
        });
    }

    /// Given the `qkv` of the matching forward and `dout` (B, T, D), *writes* `dqkv`
    /// (3, B, T, D).
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
        check_len("Attention qkv", qkv.len(), 3 * bsz * t * d);
        check_len("Attention dout", dout.len(), bsz * t * d);
        check_len("Attention dqkv", dqkv.len(), 3 * bsz * t * d);
        let scale = 1.0 / (hd as f32).sqrt();
        let (tt, recompute) = (t * t, ws.recompute);
        let allow_all = &ws.allow;
        let (dqkv, nd) = (DisjointMut::new(dqkv), bsz * t * d);
        let (pu, su) = if recompute { (0, 2 * t) } else { (tt, 0) };
        run_units(
            bsz * nh,
            &mut ws.probs,
            pu,
            &mut ws.stats,
            su,
            &mut ws.scratch,
            2 * tt,
            &|u, p_kept, stats, scratch| {
                let (pbuf, ds) = scratch.split_at_mut(tt);
                let (b, h) = (u / nh, u % nh);
                let [q_b, k_b, v_b] = sequence(qkv, bsz, t, d, b);
                let dout_b = &dout[b * t * d..(b + 1) * t * d]; // (T, D)
                let q = MatRef::strided(&q_b[h * hd..], t, hd, d, 1); // (T, d)
                let k = MatRef::strided(&k_b[h * hd..], t, hd, d, 1); // (T, d)
                let v = MatRef::strided(&v_b[h * hd..], t, hd, d, 1); // (T, d)
                let d_o = MatRef::strided(&dout_b[h * hd..], t, hd, d, 1); // (T, d)
                let p: &[f32] = if recompute {
                    // P again from Q and K with the forward's row statistics.
                    let allow = &allow_all[b * t..(b + 1) * t];
                    self.probs_of_head(q_b, k_b, h, t, allow, pbuf, Some(stats), true);
                    pbuf
                } else {
                    p_kept // (T, T)
                };
                let pm = MatRef::new(p, t, t);
                // This head's columns of sequence b's rows of dQ, dK and dV.
                let base = b * t * d + h * hd;
                let (dq_at, dk_at, dv_at) = (base, nd + base, 2 * nd + base);
                // dV = Pᵀ·dO
                // SAFETY (this and the two writes below): unit (b, h) alone writes this
                // head's columns of sequence b's rows of dQ, dK and dV.
                unsafe { dqkv.matmul_serial_into(dv_at, (t, hd, d, 1), pm.t(), d_o, false) };
                // dP = dO·Vᵀ, then dS' = s·P ⊙ (dP − rowsum(P ⊙ dP)) in place.
                matmul_serial(MatMut::new(ds, t, t), d_o, v.t(), false);
                for (pr, dr) in p.chunks_exact(t).zip(ds.chunks_exact_mut(t)) {
                    softmax::grad(pr, dr, scale);
                }
                let dsm = MatRef::new(ds, t, t);
                // dQ = dS'·K,  dK = dS'ᵀ·Q
                // SAFETY: as for dV (this head's columns of dQ[b]).
                unsafe { dqkv.matmul_serial_into(dq_at, (t, hd, d, 1), dsm, k, false) };
                // SAFETY: as for dV (this head's columns of dK[b]).
                unsafe { dqkv.matmul_serial_into(dk_at, (t, hd, d, 1), dsm.t(), q, false) };
            },
        );
    }
}

/// `allow` (B, T) from a padding mask (1 = real token): 1 for an allowed key, 0 for a padding
/// one; every key allowed without a mask.
pub fn allowed_keys(mask: Option<&[u8]>, allow: &mut [f32]) {
    match mask {
        Some(m) => {
            for (a, &v) in allow.iter_mut().zip(m) {
                *a = (v != 0) as u8 as f32;
            }
        }
        None => allow.fill(1.0),
    }
}

/// Sequence `b`'s rows of Q, K and V ((T, D) each) in `qkv` (3, B, T, D).
fn sequence(qkv: &[f32], bsz: usize, t: usize, d: usize, b: usize) -> [&[f32]; 3] {
    let (nd, rows) = (bsz * t * d, b * t * d..(b + 1) * t * d);
    [0, 1, 2].map(|part| &qkv[part * nd..][rows.clone()])
}

/// ⟨a, b⟩ summed in index order.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Row kernels of the softmax and its backward, summing over 32 lanes in a fixed order (results
/// depend only on the inputs), compiled for each instruction-set level
/// (`comera_tensor::multiversion!`).
mod softmax {
    /// Two 16-lane registers on AVX-512: with 8 the exp ran half as wide as the CPU allows
    /// (attention forward at batch 1, `bench step --ops`: 1.08 → 0.90 ms per step).
    const L: usize = 32;

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
    fn row_body(row: &mut [f32], allow: &[f32], scale: f32) -> (f32, f32) {
        let max = masked_max(row, allow);
        if max == f32::NEG_INFINITY {
            row.fill(0.0); // no allowed key
            return (max, 0.0);
        }
        let inv = 1.0 / exp_sum(row, allow, scale, max);
        for x in row.iter_mut() {
            *x *= inv;
        }
        (max, inv)
    }

    /// `row_body` with its statistics given: the same operations, so the same bits.
    #[inline(always)]
    fn apply_body(row: &mut [f32], allow: &[f32], scale: f32, max: f32, inv: f32) {
        if max == f32::NEG_INFINITY {
            row.fill(0.0);
            return;
        }
        exp_sum(row, allow, scale, max);
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

    comera_tensor::multiversion! {
        /// Softmax of `scale·row` over the entries with `allow` ≠ 0 (the others get 0); a row
        /// with no allowed entry becomes all zeros. Returns the row's (max, 1/sum) for
        /// [`apply`].
        pub(super) fn row(row: &mut [f32], allow: &[f32], scale: f32) -> (f32, f32) {
            assert_eq!(row.len(), allow.len());
            row_body(row, allow, scale)
        }
    }

    comera_tensor::multiversion! {
        /// The softmax of [`row`] again from the same scores and its returned statistics.
        pub(super) fn apply(row: &mut [f32], allow: &[f32], scale: f32, max: f32, inv: f32) {
            assert_eq!(row.len(), allow.len());
            apply_body(row, allow, scale, max, inv)
        }
    }

    comera_tensor::multiversion! {
        /// The softmax backward of one row: `dp` ← scale·p ⊙ (dp − ⟨p, dp⟩).
        pub(super) fn grad(p: &[f32], dp: &mut [f32], scale: f32) {
            assert_eq!(p.len(), dp.len());
            grad_body(p, dp, scale)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recompute_workspace_gives_the_same_bits() {
        let (b, t, d, nh) = (2, 13, 12, 3);
        let mut rng = comera_tensor::init::rng(5);
        let mut qkv = vec![0.0; b * t * 3 * d];
        let mut dout = vec![0.0; b * t * d];
        comera_tensor::init::fill_normal(&mut rng, &mut qkv, 1.0);
        comera_tensor::init::fill_normal(&mut rng, &mut dout, 1.0);
        // Second sequence: last 4 positions padded; a third mask with nothing allowed.
        let mask: Vec<u8> = (0..b * t).map(|i| (i < t || i % t < t - 4) as u8).collect();
        let none = vec![0u8; b * t];
        for attn in [Attention::new(d, nh), Attention::causal(d, nh)] {
            for m in [None, Some(&mask[..]), Some(&none[..])] {
                let run = |mut ws: AttentionWorkspace| {
                    let mut out = vec![0.0; b * t * d];
                    let mut dqkv = vec![0.0; b * t * 3 * d];
                    attn.forward(&mut ws, &qkv, m, &mut out);
                    attn.backward(&mut ws, &qkv, &dout, &mut dqkv);
                    (out, dqkv)
                };
                let kept = run(attn.workspace(b, t));
                let again = run(attn.workspace_recompute(b, t));
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&kept.0), bits(&again.0), "out");
                assert_eq!(bits(&kept.1), bits(&again.1), "dqkv");
            }
        }
        let ws = Attention::new(d, nh).workspace_recompute(b, t);
        assert!(Attention::workspace_bytes(&ws) < 4 * b * nh * t * t);
    }

    /// Heads are claimed by 1, 2 or 3 tasks (a different task for a unit from run to run): the
    /// same bits.
    #[test]
    fn same_bits_on_any_thread_count() {
        let (b, t, d, nh) = (3, 17, 24, 4);
        let mut rng = comera_tensor::init::rng(6);
        let mut qkv = vec![0.0; b * t * 3 * d];
        let mut dout = vec![0.0; b * t * d];
        comera_tensor::init::fill_normal(&mut rng, &mut qkv, 1.0);
        comera_tensor::init::fill_normal(&mut rng, &mut dout, 1.0);
        let mask: Vec<u8> = (0..b * t).map(|i| (i % t < t - i / t) as u8).collect();
        let attn = Attention::new(d, nh);
        let run = |threads: usize, recompute: bool| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let mut ws = if recompute {
                    attn.workspace_recompute(b, t)
                } else {
                    attn.workspace(b, t)
                };
                assert_eq!(ws.scratch.len(), threads * 2 * t * t);
                let mut out = vec![0.0; b * t * d];
                let mut dqkv = vec![0.0; b * t * 3 * d];
                attn.forward(&mut ws, &qkv, Some(&mask), &mut out);
                attn.backward(&mut ws, &qkv, &dout, &mut dqkv);
                out.iter()
                    .chain(&dqkv)
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>()
            })
        };
        let one = run(1, true);
        for (threads, recompute) in [(2, true), (3, true), (1, false), (3, false)] {
            assert!(
                one == run(threads, recompute),
                "{threads} threads, recompute {recompute}"
            );
        }
    }
    /// The first-row attention is row 0 of the full one, forward and backward (the full
    /// backward given a dO that is zero but for the first rows), with padding, with a
    /// sequence that is all padding, and causal.
    #[test]
    fn first_rows_match_the_full_attention() {
        let (b, t, d, nh) = (3, 11, 12, 3);
        let mut rng = comera_tensor::init::rng(7);
        let mut qkv = vec![0.0; b * t * 3 * d];
        let mut dfirst = vec![0.0; b * d];
        comera_tensor::init::fill_normal(&mut rng, &mut qkv, 1.0);
        comera_tensor::init::fill_normal(&mut rng, &mut dfirst, 1.0);
        // Sequence 1: last 3 positions padded; sequence 2: all padding.
        let mask: Vec<u8> = (0..b * t)
            .map(|i| (i < t || (i < 2 * t && i % t < t - 3)) as u8)
            .collect();
        let allow: Vec<f32> = mask.iter().map(|&m| m as f32).collect();
        let mut dout = vec![0.0; b * t * d];
        for (s, row) in dfirst.chunks_exact(d).enumerate() {
            dout[s * t * d..s * t * d + d].copy_from_slice(row);
        }
        for attn in [Attention::new(d, nh), Attention::causal(d, nh)] {
            let mut ws = attn.workspace(b, t);
            let (mut out, mut dqkv) = (vec![0.0; b * t * d], vec![0.0; b * t * 3 * d]);
            attn.forward(&mut ws, &qkv, Some(&mask), &mut out);
            attn.backward(&mut ws, &qkv, &dout, &mut dqkv);
            let mut probs = vec![0.0; attn.first_probs_len(b, t)];
            let (mut out1, mut dqkv1) = (vec![0.0; b * d], vec![1.0; b * t * 3 * d]);
            let mut scratch = vec![0.0; attn.first_probs_len(b, t)];
            attn.forward_first(&qkv, &allow, t, &mut probs, &mut out1);
            attn.backward_first(&qkv, &probs, &dfirst, t, &mut scratch, &mut dqkv1);
            let close = |x: f32, y: f32| (x - y).abs() <= 1e-5 * (1.0 + y.abs());
            for s in 0..b {
                for j in 0..d {
                    let (x, y) = (out1[s * d + j], out[s * t * d + j]);
                    assert!(close(x, y), "out seq {s} col {j}: {x} vs {y}");
                }
            }
            for (i, (&x, &y)) in dqkv1.iter().zip(&dqkv).enumerate() {
                assert!(close(x, y), "dqkv {i}: {x} vs {y}");
            }
            assert!(dqkv1.iter().any(|&x| x != 0.0));
        }
    }
}
