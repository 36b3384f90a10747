//! One encoder block: its layers, and its forward and backward as an adjacent pair.
//!
//! On N = B·T rows of width D (F for the FFN's hidden layer), from the block input x:
//!
//!   post-LN (BERT):  q, k, v = Q(x), K(x), V(x);   att = MHA(q, k, v; padding mask)
//!                    r1 = x + Dropout(O(att));     x1 = LN1(r1)
//!                    f = Dropout(Down(GELU(Up(x1))));   r2 = x1 + f;   out = LN2(r2)
//!   pre-LN:          l1 = LN1(x);  q, k, v from l1;  r1 = x + Dropout(O(att));  x1 = LN2(r1)
//!                    f as above;   out = r1 + f
//!
//! The block splits in two at the attention context `att`. Before it, q, k and v of every row
//! (each query attends to every key). After it, the *row-wise part* (O, residual + LN, FFN,
//! residual (+ LN)) treats each row on its own: [`rows_forward`] and [`rows_backward`] run it
//! on whichever rows go past q/k/v ([`Rows`]): all N, or, for a classifier's last block in
//! training, the B [CLS] rows only (`ClsRows`: the head reads nothing else).
//!
//! Backward, from ∂L/∂out (g = ∂L/∂·, ⊙ elementwise, D_p the dropout with keep-mask p):
//!   post-LN:  g_r2 = LN2'ᵀ g_out;   g_f = D_p(g_r2);   g_x1 = g_r2 + FFNᵀ(g_f)
//!             g_r1 = LN1'ᵀ g_x1;    g_o = D_p(g_r1)
//!   pre-LN:   g_f = D_p(g_out);     g_r1 = g_out + LN2'ᵀ FFNᵀ(g_f);   g_o = D_p(g_r1)
//!   FFNᵀ(g_f) = Upᵀ((Downᵀ g_f) ⊙ GELU'(h)),   h = Up(x1)
//!   g_att = Oᵀ g_o;   g_qkv = MHAᵀ(g_att);   g_x = g_r1 + [LN1'ᵀ] (Qᵀ g_q + Kᵀ g_k + Vᵀ g_v)
//! (LN1'ᵀ on the attention path pre-LN only). Every parameter gradient accumulates.

use super::any_linear;
use super::plan::BlockPlan;
use super::state::{
    BlockActs, BlockState, ClsRows, FfnScratch, RowActs, RowScratch, RowWs, Scratch,
};
use crate::config::{ConfigError, EncoderConfig, Layouts};
use comera_layers::activation::Gelu;
use comera_layers::any::AnyLinear;
use comera_layers::attention::{allowed_keys, Attention};
use comera_layers::dropout::Dropout;
use comera_layers::elementwise::{add_into, mul_into, sum_into};
use comera_layers::norm::LayerNorm;
use comera_layers::{Layer, Param, RankGates};
use comera_tensor::init;

/// One encoder block's layers.
#[derive(Clone, Debug)]
pub struct Block {
    pub q: AnyLinear,
    pub k: AnyLinear,
    pub v: AnyLinear,
    pub o: AnyLinear,
    pub up: AnyLinear,
    pub down: AnyLinear,
    pub ln1: LayerNorm,
    pub ln2: LayerNorm,
}

impl Block {
    /// Block `l`, its layers initialised in the order q, k, v, o, up, down.
    pub(super) fn new(
        cfg: &EncoderConfig,
        layouts: &Layouts,
        l: usize,
        rng: &mut init::Rng,
    ) -> Result<Block, ConfigError> {
        let (d, f, rule) = (cfg.d_model, cfg.ffn, RankGates::new(cfg.threshold));
        let p = format!("encoder.{l}");
        let mut linear =
            |name: &str, shape, n, m| any_linear(&format!("{p}.{name}"), shape, n, m, rule, rng);
        Ok(Block {
            q: linear("attn.q", &layouts.attn, d, d)?,
            k: linear("attn.k", &layouts.attn, d, d)?,
            v: linear("attn.v", &layouts.attn, d, d)?,
            o: linear("attn.o", &layouts.attn, d, d)?,
            up: linear("ffn.up", &layouts.ffn_up, d, f)?,
            down: linear("ffn.down", &layouts.ffn_down, f, d)?,
            ln1: LayerNorm::with_eps(&format!("{p}.ln1"), d, cfg.ln_eps),
            ln2: LayerNorm::with_eps(&format!("{p}.ln2"), d, cfg.ln_eps),
        })
    }

    pub(super) fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        for l in self.linears_mut() {
            l.visit_params_mut(f);
        }
        self.ln1.visit_params_mut(f);
        self.ln2.visit_params_mut(f);
    }

    pub(super) fn params(&self) -> Vec<&Param> {
        let mut v: Vec<&Param> = self.linears().iter().flat_map(|l| l.params()).collect();
        v.extend(self.ln1.params());
        v.extend(self.ln2.params());
        v
    }

    /// q, k, v, o, up, down.
    pub(super) fn linears(&self) -> [&AnyLinear; 6] {
        [&self.q, &self.k, &self.v, &self.o, &self.up, &self.down]
    }

    /// [`Block::linears`] mutably, same order.
    pub(super) fn linears_mut(&mut self) -> [&mut AnyLinear; 6] {
        [
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.o,
            &mut self.up,
            &mut self.down,
        ]
    }
}

/// What block `l`'s forward and backward read besides its layers and its state.
pub(super) struct BlockCx<'a> {
    pub attn: &'a Attention,
    /// After the attention output and after the FFN (seeded per block).
    pub drop_attn: &'a Dropout,
    pub drop_ffn: &'a Dropout,
    pub d: usize,
    pub f: usize,
    /// Padding mask, N (1 = real token).
    pub mask: &'a [u8],
    /// Dropout on, masks drawn from `step`.
    pub train: bool,
    pub step: u64,
}

/// Which rows go past q/k/v (the q, k, v of every row are always computed).
pub(super) enum Rows<'a> {
    /// All N rows, into the block's own activations.
    All,
    /// The first row of each sequence only, into `ClsRows`' B-row buffers.
    Cls(&'a mut ClsRows),
}

/// The block's forward from its input `x` (N × D) into `a` (or, past q/k/v, `rows`' buffers);
/// `sc` is scratch. Follows the plan in `s`, refreshed first for a rank change.
pub(super) fn block_forward(
    cx: &BlockCx,
    blk: &Block,
    x: &[f32],
    s: &mut BlockState,
    a: &mut BlockActs,
    rows: &mut Rows,
    sc: &mut Scratch,
) {
    s.plan.refresh(blk, x.len() / cx.d);
    let attn_in: &[f32] = if s.plan.pre_ln {
        blk.ln1.forward(&mut s.rows.ln1, x, &mut a.ln1_x);
        &a.ln1_x
    } else {
        x
    };
    qkv_forward(blk, s, attn_in, &mut a.qkv);
    match rows {
        Rows::All => {
            cx.attn
                .forward(&mut s.ws_attn, &a.qkv, Some(cx.mask), &mut a.rows.att);
            rows_forward(
                cx,
                blk,
                &mut s.plan,
                &mut s.rows,
                x,
                &mut a.rows,
                &mut sc.rows,
            );
        }
        Rows::Cls(c) => {
            allowed_keys(Some(cx.mask), &mut c.allow);
            let t = c.seq_len;
            cx.attn
                .forward_first(&a.qkv, &c.allow, t, &mut c.probs, &mut c.acts.att);
            first_rows(x, t, cx.d, &mut c.x);
            rows_forward(
                cx,
                blk,
                &mut c.plan,
                &mut c.ws,
                &c.x,
                &mut c.acts,
                &mut c.sc,
            );
        }
    }
}

/// Backward of [`block_forward`] from `sc.rows.d` (or, with [CLS] rows, `rows`' own `sc.d`)
/// = ∂L/∂out: accumulates every gradient of the block and *writes* `sc.rows.d` = ∂L/∂x.
pub(super) fn block_backward(
    cx: &BlockCx,
    blk: &mut Block,
    x: &[f32],
    s: &mut BlockState,
    a: &mut BlockActs,
    rows: &mut Rows,
    sc: &mut Scratch,
) {
    // The row-wise part leaves ∂L/∂att in its t[2] and ∂L/∂r1 in its t[0].
    match rows {
        Rows::All => {
            rows_backward(cx, blk, &mut s.plan, &mut s.rows, &mut a.rows, &mut sc.rows);
            cx.attn
                .backward(&mut s.ws_attn, &a.qkv, &sc.rows.t[2], &mut sc.dqkv);
        }
        Rows::Cls(c) => {
            rows_backward(cx, blk, &mut c.plan, &mut c.ws, &mut c.acts, &mut c.sc);
            let (t, datt) = (c.seq_len, &c.sc.t[2]);
            cx.attn
                .backward_first(&a.qkv, &c.probs, datt, t, &mut c.dattn, &mut sc.dqkv);
        }
    }
    let attn_in: &[f32] = if s.plan.pre_ln { &a.ln1_x } else { x };
    let [dres, t2, t3] = &mut sc.rows.t;
    qkv_backward(blk, s, attn_in, &sc.dqkv, t2, t3);
    // ∂L/∂x through the attention path.
    let dx_attn: &[f32] = if s.plan.pre_ln {
        blk.ln1.backward(&mut s.rows.ln1, x, t2, Some(t3));
        t3
    } else {
        t2
    };
    // Plus the residual x → r1, on the rows that went past q/k/v.
    match rows {
        Rows::All => sum_into(dres, dx_attn, &mut sc.rows.d),
        Rows::Cls(c) => {
            sc.rows.d.copy_from_slice(dx_attn);
            add_first_rows(&c.sc.t[0], c.seq_len, cx.d, &mut sc.rows.d);
        }
    }
}

/// The row-wise part on R rows, from the attention context `a.att` and the residual rows `x`:
///   r1 = x + Dropout(O(att));   x1 = LN1(r1) (post-LN) | LN2(r1) (pre-LN)
///   f = Dropout(Down(GELU(Up(x1))));   out = LN2(x1 + f) (post-LN) | r1 + f (pre-LN)
/// O(att) and then f live in `sc.t[0]`, each only until its residual sum.
fn rows_forward(
    cx: &BlockCx,
    blk: &Block,
    plan: &mut BlockPlan,
    ws: &mut RowWs,
    x: &[f32],
    a: &mut RowActs,
    sc: &mut RowScratch,
) {
    let [o, ..] = &mut sc.t;
    blk.o.forward(&mut ws.o, &a.att, o);
    // r1 = x + dropout(o) and its LayerNorm in one pass.
    let mask = cx.drop_attn.draw_mask(&mut ws.drop_attn, cx.step, cx.train);
    let (ln, ws_ln) = if plan.pre_ln {
        (&blk.ln2, &mut ws.ln2)
    } else {
        (&blk.ln1, &mut ws.ln1)
    };
    ln.forward_residual(ws_ln, x, o, mask, &mut a.r1, &mut a.x1);
    let f = o;
    ffn_forward(cx, blk, plan, ws, a, &mut sc.ffn, f);
    if plan.pre_ln {
        cx.drop_ffn
            .forward_in_place(&mut ws.drop_ffn, cx.step, cx.train, f);
        sum_into(&a.r1, f, &mut a.out);
    } else {
        // r2 = x1 + dropout(f) and LN2 in one pass.
        let mask = cx.drop_ffn.draw_mask(&mut ws.drop_ffn, cx.step, cx.train);
        blk.ln2
            .forward_residual(&mut ws.ln2, &a.x1, f, mask, &mut a.r2, &mut a.out);
    }
}

/// Backward of [`rows_forward`] from `sc.d` = ∂L/∂out: the row-wise layers' gradients; leaves
/// ∂L/∂att in `sc.t[2]` and ∂L/∂r1 (the residual's share of ∂L/∂x) in `sc.t[0]`.
fn rows_backward(
    cx: &BlockCx,
    blk: &mut Block,
    plan: &mut BlockPlan,
    ws: &mut RowWs,
    a: &mut RowActs,
    sc: &mut RowScratch,
) {
    let [t1, t2, t3] = &mut sc.t;
    // t1: ∂L/∂r2 (post-LN) or ∂L/∂out (pre-LN), the residual part of ∂L/∂x1 (post-LN) or
    // ∂L/∂r1 (pre-LN); t2: ∂L/∂f before the dropout.
    if plan.pre_ln {
        t1.copy_from_slice(&sc.d);
        cx.drop_ffn.backward(&ws.drop_ffn, t1, t2);
    } else {
        let mask = ws.drop_ffn.mask(cx.drop_ffn);
        blk.ln2
            .backward_residual(&mut ws.ln2, &a.r2, &sc.d, None, t1, mask, t2);
    }
    ffn_backward(blk, plan, ws, a, &mut sc.ffn, t2, t3);
    // t1 = ∂L/∂r1; sc.d (read above) = ∂L/∂o, through the dropout.
    if plan.pre_ln {
        blk.ln2.backward(&mut ws.ln2, &a.r1, t3, Some(t2));
        add_into(t1, t2);
        cx.drop_attn.backward(&ws.drop_attn, t1, &mut sc.d);
    } else {
        // ∂L/∂x1 = t1 + t3 (residual and FFN), through LN1.
        let mask = ws.drop_attn.mask(cx.drop_attn);
        blk.ln1
            .backward_residual(&mut ws.ln1, &a.r1, t1, Some(t3), t2, mask, &mut sc.d);
        std::mem::swap(t1, t2);
    }
    blk.o.backward(&mut ws.o, &a.att, &sc.d, Some(t3));
}

/// f = Down(GELU(Up(x1))) (R × D) from `a.x1`: Up → bias + GELU → Down in row blocks where the
/// plan fuses them (no R × F buffer), else one by one with h = Up(x1) saved and g = GELU(h)
/// kept or not as planned.
fn ffn_forward(
    cx: &BlockCx,
    blk: &Block,
    plan: &mut BlockPlan,
    ws: &mut RowWs,
    a: &mut RowActs,
    sc: &mut FfnScratch,
    f: &mut [f32],
) {
    if let (Some(w), AnyLinear::Tt(up), AnyLinear::Tt(down)) = (plan.ffn.on(), &blk.up, &blk.down) {
        w.forward(up, down, &a.x1, f);
        return;
    }
    // The buffers of the unfused path exist once a block takes it.
    let nf = a.x1.len() / cx.d * cx.f;
    ensure_len(&mut a.h, nf);
    ensure_len(&mut sc.dg, nf);
    blk.up.forward(&mut ws.up, &a.x1, &mut a.h);
    if plan.keep_gelu {
        // g = GELU(h) kept, and GELU'(h) in h's place, from one Φ/φ per value: the backward
        // evaluates no GELU.
        ensure_len(&mut a.g, nf);
        Gelu.forward_and_grad_in_place(&mut a.h, &mut a.g);
        blk.down.forward(&mut ws.down, &a.g, f);
    } else {
        // g = GELU(h) is not kept: the backward recomputes it.
        ensure_len(&mut sc.g, nf);
        Gelu.forward(&a.h, &mut sc.g);
        blk.down.forward(&mut ws.down, &sc.g, f);
    }
}

/// Backward of [`ffn_forward`] from `df` = ∂L/∂f: Up's and Down's gradients, and *writes*
/// `dx` = ∂L/∂x1. Off the fused path, ∂L/∂h = (Downᵀ df) ⊙ GELU'(h) in `sc.dg`.
fn ffn_backward(
    blk: &mut Block,
    plan: &mut BlockPlan,
    ws: &mut RowWs,
    a: &mut RowActs,
    sc: &mut FfnScratch,
    df: &[f32],
    dx: &mut [f32],
) {
    if let (Some(w), AnyLinear::Tt(up), AnyLinear::Tt(down)) =
        (plan.ffn.on(), &mut blk.up, &mut blk.down)
    {
        // The forward ran fused too (same layers, same ranks).
        w.backward(up, down, &a.x1, df, dx);
        return;
    }
    let g: &[f32] = if plan.keep_gelu {
        &a.g // and a.h holds GELU'(h) since the forward
    } else {
        // g = GELU(h) again for Down's backward, and GELU'(h) in h's place (h is not needed
        // again), from one Φ/φ per value.
        Gelu.forward_and_grad_in_place(&mut a.h, &mut sc.g);
        &sc.g
    };
    blk.down.backward(&mut ws.down, g, df, Some(&mut sc.dg));
    mul_into(&mut sc.dg, &a.h);
    blk.up.backward(&mut ws.up, &a.x1, &sc.dg, Some(dx));
}

/// q, k and v of `attn_in` into `qkv` ([Q | K | V], N × D each, the attention's layout): one
/// fused TT product where the plan says so, else one by one, each straight into its part.
fn qkv_forward(blk: &Block, s: &mut BlockState, attn_in: &[f32], qkv: &mut [f32]) {
    if let (Some(w), AnyLinear::Tt(q), AnyLinear::Tt(k), AnyLinear::Tt(v)) =
        (s.plan.qkv.on(), &blk.q, &blk.k, &blk.v)
    {
        w.forward(&[q, k, v], attn_in, qkv);
        return;
    }
    let (q, kv) = qkv.split_at_mut(qkv.len() / 3);
    let (k, v) = kv.split_at_mut(q.len());
    let [wq, wk, wv] = &mut s.ws_qkv;
    blk.q.forward(wq, attn_in, q);
    blk.k.forward(wk, attn_in, k);
    blk.v.forward(wv, attn_in, v);
}

/// The q, k, v layers' backward from `dqkv` ([∂L/∂q | ∂L/∂k | ∂L/∂v], N × D each): their
/// gradients, and *writes* `dx` (∂L/∂`attn_in`). `tmp` (N × D) is scratch.
fn qkv_backward(
    blk: &mut Block,
    s: &mut BlockState,
    attn_in: &[f32],
    dqkv: &[f32],
    dx: &mut [f32],
    tmp: &mut [f32],
) {
    if let (Some(w), AnyLinear::Tt(q), AnyLinear::Tt(k), AnyLinear::Tt(v)) =
        (s.plan.qkv.on(), &mut blk.q, &mut blk.k, &mut blk.v)
    {
        // The forward ran fused too (same layers, same ranks).
        w.backward(&mut [q, k, v], attn_in, dqkv, dx);
        return;
    }
    let nd = dqkv.len() / 3;
    let (dq, dk, dv) = (&dqkv[..nd], &dqkv[nd..2 * nd], &dqkv[2 * nd..]);
    let [wq, wk, wv] = &mut s.ws_qkv;
    blk.q.backward(wq, attn_in, dq, Some(dx));
    blk.k.backward_adding_dx(wk, attn_in, dk, dx, tmp);
    blk.v.backward_adding_dx(wv, attn_in, dv, dx, tmp);
}

/// Gives `v` length `len` (zeros), allocating only the first time (buffers of the unfused
/// paths exist only once a block needs them).
fn ensure_len(v: &mut Vec<f32>, len: usize) {
    if v.len() != len {
        v.resize(len, 0.0);
    }
}

/// rows[b] = x[b·T]: the first row of each sequence of T rows (B × D out of N × D).
pub(super) fn first_rows(x: &[f32], t: usize, d: usize, rows: &mut [f32]) {
    for (b, row) in rows.chunks_exact_mut(d).enumerate() {
        row.copy_from_slice(&x[b * t * d..b * t * d + d]);
    }
}

/// x[b·T] = rows[b]: [`first_rows`] backwards (the other rows are left as they are).
pub(super) fn set_first_rows(rows: &[f32], t: usize, d: usize, x: &mut [f32]) {
    for (b, row) in rows.chunks_exact(d).enumerate() {
        x[b * t * d..b * t * d + d].copy_from_slice(row);
    }
}

/// x[b·T] += rows[b].
fn add_first_rows(rows: &[f32], t: usize, d: usize, x: &mut [f32]) {
    for (b, row) in rows.chunks_exact(d).enumerate() {
        add_into(&mut x[b * t * d..b * t * d + d], row);
    }
}
