//! The feed-forward block Y = Down(GELU(Up(X))) of two TT layers on the merged path, run in
//! row blocks so that the F-wide activations (h = X·W_u + b_u, g = GELU(h) and their
//! gradients) only exist for `ROWS` rows at a time, in a core's cache: no B × F buffer at all.
//! Forward (W_u = L_u·R_u: N × F, W_d = L_d·R_d: F × M):
//!   T1u = X·L_u                                      (B × r_u, saved)
//!   per block β of rows:  g_β = GELU(T1u_β·R_u + b_u)  (bias and GELU in one pass);
//!                         T1d_β = g_β·L_d
//!   Y = T1d·R_d + b_d                                (T1d: B × r_d, saved)
//! Backward from dY:
//!   dR_d = T1dᵀ·dY,  U_d = dY·R_dᵀ                   (B × r_d)
//!   per block β:  h_β = T1u_β·R_u + b_u,  g_β = GELU(h_β)   (the forward's bits again),
//!                 with GELU'(h_β) from the same Φ/φ, kept in h_β's place
//!                 dL_d += g_βᵀ·U_d,β;   dg_β = U_d,β·L_dᵀ;   dh_β = dg_β ⊙ GELU'(h_β)
//!                 dR_u += T1u_βᵀ·dh_β;  db_u += Σ_rows dh_β;  U_u,β = dh_β·R_uᵀ
//!   dX = U_u·L_uᵀ,  dL_u = Xᵀ·U_u,  db_d = Σ_rows dY; then each layer peels its chains.
//! Up to [`KEEP_MAX_ROWS`] rows the forward instead keeps g and GELU'(h) for all B rows
//! (2 × B × F floats, computed from one Φ/φ per value as above) and the backward reads them
//! rather than forming h and its GELU again; the same values either way, so the same bits.
//!
//! The blocks run in *lanes*, one per worker thread (fixed when the workspace is made): lane t
//! takes a contiguous run of blocks and runs their products single-threaded with its own h and
//! g blocks, so a block's work stays on one core and the step does not fork and join around
//! every small product. Each lane sums its blocks' dL_d, dR_u and db_u into its own partial
//! sums, which are then added in lane order; the forward has nothing to sum. So the result
//! depends on the lane count (the thread count), not on scheduling, and equals the unfused
//! Up → GELU → Down up to float rounding. Measured against blocks of 128 rows run in order
//! with threaded products (`comera --threads 2 bench step --batch 32 --ops`, paper model): the
//! backward 6% faster at rank 30 and 16% at rank 15, the forward unchanged; blocks of 16, 32
//! and 64 rows within a few percent of each other.

use super::chain::{Chains, LentChains};
use super::merged::{input_side, output_side, paired};
use super::pool::{Lease, Lent, Scratch};
use super::TtLinear;
use crate::activation::simd::{gelu_bias_in_place, gelu_bias_value_grad};
use crate::elementwise::kernels::{add, mul};
use crate::elementwise::{add_into, sum_into};
use crate::{accumulate_bias_grad, add_bias, bias_grad_columns, check_len, Layer};
use comera_plan::TtPath;
use comera_tensor::{matmul, matmul_serial, MatMut, MatRef, TtShape};
use rayon::prelude::*;

/// Rows per block: a lane's two ROWS × F blocks (h and g) take 384 KB each at F = 3072.
const ROWS: usize = 32;

/// Batches of at most this many rows run unfused unless Up is thin (see `THIN_UP_RANK`): at
/// 128 rows (batch 1 × 128 tokens) and rank 30 the fused path's recomputation of h costs more
/// than reading back the N × F buffers it saves (whole step 20.04 → 20.64 ms,
/// `comera --threads 2 bench step --batch 1`, 3 interleaved runs).
const MIN_FUSED_ROWS: usize = 128;

/// Rows up to which the forward keeps g and GELU'(h) (2 × B × F floats: 3 MiB per layer at
/// 128 rows and F = 3,072) for the backward instead of the backward recomputing them; above
/// it they would cost more memory than the recomputation costs time. Measured on the paper's
/// model at rank 15, batch 1 (`comera --threads 2 bench rank --paper-model`, with a temporary
/// switch: both ways side by side in one process, six medians in three runs): recomputing
/// 20.15, 20.62, 19.84, 20.02, 20.62, 19.69 ms per step; keeping 19.81, 20.38, 19.47, 19.87,
/// 21.66, 19.27 ms.
pub const KEEP_MAX_ROWS: usize = MIN_FUSED_ROWS;

/// Up's middle rank at or below which the fused path is used at any batch: recomputing
/// h = T1·R_u is then cheap next to the 3 × N × F floats the unfused backward reads back from
/// memory (rank 15, batch 1: whole step 13.22 → 12.85 ms, as above; 18 MB less peak RSS).
const THIN_UP_RANK: usize = 16;

/// Counted FLOPs (forward, backward) of one layer on the merged path for `rows` rows, as the
/// planner counts them (2 per multiply-add, chain products included).
pub(crate) fn merged_flops(s: &TtShape, rows: usize) -> (f64, f64) {
    let cost = |pass| {
        comera_plan::tt_linear_cost(s, rows, TtPath::Merged, pass, &Default::default()).flops
    };
    let fwd = cost(comera_plan::Pass::Forward);
    (fwd, cost(comera_plan::Pass::Train { need_dx: true }) - fwd)
}

/// The fused workspace of one Up → GELU → Down pair for one batch size.
#[derive(Debug)]
pub struct FusedFfn {
    batch: usize,
    shapes: [TtShape; 2],
    t1u: Vec<f32>, // B × r_u, saved
    t1d: Vec<f32>, // B × r_d, saved
    chains: [Chains; 2],
    products: [Lease; 2], // chain products of up, down (scratch)
    grads: [Lease; 2],    // their gradient scratch
    h: [Lease; 2],        // gated cores of up, down (scratch)
    dh: [Lease; 2],       // their gradients (scratch)
    /// Rows per lane: a whole number of blocks; the last lane may have fewer.
    lane_rows: usize,
    /// [lanes × lane scratch (`Lane`), U_u (B × r_u), U_d (B × r_d)], scratch.
    buf: Lease,
    /// [GELU'(h) | g] (B × F each), kept from the forward for the backward at most
    /// [`KEEP_MAX_ROWS`] rows; empty otherwise (the backward recomputes them).
    kept: Vec<f32>,
}

/// One lane's scratch, split from its part of the flat buffer: the h and g blocks
/// (ROWS × F each) and its partial sums of dL_d (F × r_d), dR_u (r_u × F) and db_u (F).
struct Lane<'a> {
    h: &'a mut [f32],
    g: &'a mut [f32],
    dld: &'a mut [f32],
    dru: &'a mut [f32],
    dbu: &'a mut [f32],
}

impl<'a> Lane<'a> {
    /// Floats of one lane's scratch.
    fn len(f: usize, ru: usize, rd: usize) -> usize {
        2 * ROWS * f + f * rd + ru * f + f
    }

    fn split(buf: &'a mut [f32], f: usize, ru: usize, rd: usize) -> Lane<'a> {
        let (h, rest) = buf.split_at_mut(ROWS * f);
        let (g, rest) = rest.split_at_mut(ROWS * f);
        let (dld, rest) = rest.split_at_mut(f * rd);
        let (dru, rest) = rest.split_at_mut(ru * f);
        Lane {
            h,
            g,
            dld,
            dru,
            dbu: &mut rest[..f],
        }
    }
}

impl FusedFfn {
    /// The fused workspace for `up` (N → F) and `down` (F → M) at `batch` rows, or `None` when
    /// it does not apply (either planned off the merged path at this batch, dead, or widths
    /// that do not chain) or does not pay (at most `MIN_FUSED_ROWS` rows and Up's rank above
    /// `THIN_UP_RANK`).
    pub fn new(up: &TtLinear, down: &TtLinear, batch: usize) -> Option<FusedFfn> {
        if batch <= MIN_FUSED_ROWS && up.shape.middle_rank() > THIN_UP_RANK {
            return None;
        }
        if [up, down]
            .iter()
            .any(|l| l.workspace(batch).path() != TtPath::Merged)
        {
            return None;
        }
        FusedFfn::new_unplanned(up, down, batch)
    }

    /// The same without asking the planner (tests on shapes too small for it to pick merged).
    pub fn new_unplanned(up: &TtLinear, down: &TtLinear, batch: usize) -> Option<FusedFfn> {
        if up.dead || down.dead || up.out_features() != down.in_features() {
            return None;
        }
        let (ru, rd, f) = (
            up.shape.middle_rank(),
            down.shape.middle_rank(),
            up.out_features(),
        );
        let lens = |l: &TtLinear| super::core_lens(&l.shape);
        let chains = [Chains::new(&up.shape), Chains::new(&down.shape)];
        let lanes = rayon::current_num_threads().max(1);
        let lane_rows = batch.max(1).div_ceil(ROWS).div_ceil(lanes) * ROWS;
        let used_lanes = batch.div_ceil(lane_rows);
        Some(FusedFfn {
            batch,
            shapes: [up.shape.clone(), down.shape.clone()],
            t1u: vec![0.0; batch * ru],
            t1d: vec![0.0; batch * rd],
            products: chains
                .each_ref()
                .map(|c| Lease::new(c.product_lens().to_vec())),
            grads: chains
                .each_ref()
                .map(|c| Lease::new(c.grad_lens().to_vec())),
            chains,
            h: [Lease::new(lens(up)), Lease::new(lens(down))],
            dh: [Lease::new(lens(up)), Lease::new(lens(down))],
            lane_rows,
            buf: Lease::new(vec![
                used_lanes * Lane::len(f, ru, rd),
                batch * ru,
                batch * rd,
            ]),
            kept: if batch <= KEEP_MAX_ROWS {
                vec![0.0; 2 * batch * f]
            } else {
                Vec::new()
            },
        })
    }

    /// The same workspace recomputing g and GELU'(h) in the backward at any batch (tests:
    /// both modes give the same bits).
    #[doc(hidden)]
    pub fn recomputing(mut self) -> FusedFfn {
        self.kept = Vec::new();
        self
    }

    /// Whether the forward keeps g and GELU'(h) for the backward (see [`KEEP_MAX_ROWS`]).
    pub fn keeps_gelu(&self) -> bool {
        !self.kept.is_empty()
    }

    /// Whether this workspace still fits the layers (same ranks, neither dead).
    pub fn applies(&self, up: &TtLinear, down: &TtLinear) -> bool {
        !up.dead && !down.dead && up.shape == self.shapes[0] && down.shape == self.shapes[1]
    }

    /// Bytes kept between calls (T1u, T1d, and g with GELU'(h) when kept).
    pub fn bytes(&self) -> usize {
        4 * (self.t1u.len() + self.t1d.len() + self.kept.len())
    }

    /// Counted FLOPs of one forward and one backward: both layers' merged paths, plus
    /// h = T1u·R_u again in the backward unless the forward kept g and GELU'(h).
    pub fn flops(&self) -> (f64, f64) {
        let (uf, ub) = merged_flops(&self.shapes[0], self.batch);
        let (df, db) = merged_flops(&self.shapes[1], self.batch);
        let s = &self.shapes[0];
        let again = if self.keeps_gelu() {
            0.0
        } else {
            2.0 * (self.batch * s.middle_rank() * s.out_features()) as f64
        };
        (uf + df, ub + db + again)
    }

    /// `y` (B × M) = Down(GELU(Up(`x`))) for `x` (B × N).
    pub fn forward(&mut self, up: &TtLinear, down: &TtLinear, x: &[f32], y: &mut [f32]) {
        assert!(
            self.applies(up, down),
            "FusedFfn: layers changed since planned"
        );
        let b = self.batch;
        let (n, f, m) = (up.in_features(), up.out_features(), down.out_features());
        let (ru, rd) = (up.shape.middle_rank(), down.shape.middle_rank());
        check_len("FusedFfn x", x.len(), b * n);
        check_len("FusedFfn y", y.len(), b * m);
        // Scratch from this thread's pool (the pool is per thread), back when dropped.
        let mut buf = self.buf.acquire();
        let mut h = self.h.each_mut().map(Lease::acquire);
        let mut products = self.products.each_mut().map(Lease::acquire);
        let [pu, pd] = &mut products;
        let mut chains = [
            self.chains[0].lent(pu, &mut []),
            self.chains[1].lent(pd, &mut []),
        ];
        build_both([up, down], &mut h, &mut chains);
        let (lu, ru_m) = (chains[0].l(), chains[0].r());
        let (ld, rd_m) = (chains[1].l(), chains[1].r());
        matmul(
            MatMut::new(&mut self.t1u, b, ru),
            MatRef::new(x, b, n),
            MatRef::new(lu, n, ru),
            false,
        );
        let (lr, lane_len, bias) = (self.lane_rows, Lane::len(f, ru, rd), &up.bias.value);
        let (rum, ldm) = (MatRef::new(ru_m, ru, f), MatRef::new(ld, f, rd));
        // One block: g = GELU(T1u·R_u + b_u) (and GELU'(h) into `h` when kept), T1d = g·L_d.
        let block = |t1u: &[f32], t1d: &mut [f32], h: &mut [f32], g: &mut [f32], keep: bool| {
            let rows = t1u.len() / ru;
            let (h, g) = (&mut h[..rows * f], &mut g[..rows * f]);
            let t1u = MatRef::new(t1u, rows, ru);
            if keep {
                matmul_serial(MatMut::new(h, rows, f), t1u, rum, false);
                gelu_bias_value_grad(h, bias, g);
            } else {
                matmul_serial(MatMut::new(g, rows, f), t1u, rum, false);
                gelu_bias_in_place(g, bias);
            }
            matmul_serial(
                MatMut::new(t1d, rows, rd),
                MatRef::new(g, rows, f),
                ldm,
                false,
            );
        };
        let lanes = self
            .t1d
            .par_chunks_mut(lr * rd)
            .zip(self.t1u.par_chunks(lr * ru));
        if self.kept.is_empty() {
            comera_tensor::for_each(
                lanes.zip(buf[0].par_chunks_mut(lane_len)),
                |((t1d, t1u), scratch)| {
                    let lane = Lane::split(scratch, f, ru, rd);
                    for (t1d, t1u) in t1d.chunks_mut(ROWS * rd).zip(t1u.chunks(ROWS * ru)) {
                        block(t1u, t1d, lane.h, lane.g, false);
                    }
                },
            );
        } else {
            let (gp, g) = self.kept.split_at_mut(b * f);
            let lanes = lanes
                .zip(gp.par_chunks_mut(lr * f))
                .zip(g.par_chunks_mut(lr * f));
            comera_tensor::for_each(lanes, |(((t1d, t1u), gp), g)| {
                let blocks = t1d
                    .chunks_mut(ROWS * rd)
                    .zip(t1u.chunks(ROWS * ru))
                    .zip(gp.chunks_mut(ROWS * f).zip(g.chunks_mut(ROWS * f)));
                for ((t1d, t1u), (gp, g)) in blocks {
                    block(t1u, t1d, gp, g, true);
                }
            });
        }
        matmul(
            MatMut::new(y, b, m),
            MatRef::new(&self.t1d, b, rd),
            MatRef::new(rd_m, rd, m),
            false,
        );
        add_bias(y, &down.bias.value);
    }

    /// Accumulates both layers' gradients from `dy` (B × M) and *writes* `dx` (B × N).
    pub fn backward(
        &mut self,
        up: &mut TtLinear,
        down: &mut TtLinear,
        x: &[f32],
        dy: &[f32],
        dx: &mut [f32],
    ) {
        assert!(
            self.applies(up, down),
            "FusedFfn backward: layers changed since forward"
        );
        let b = self.batch;
        let (n, f, m) = (up.in_features(), up.out_features(), down.out_features());
        let (ru, rd) = (up.shape.middle_rank(), down.shape.middle_rank());
        check_len("FusedFfn x", x.len(), b * n);
        check_len("FusedFfn dy", dy.len(), b * m);
        check_len("FusedFfn dx", dx.len(), b * n);
        // Scratch from this thread's pool (the pool is per thread), back when dropped.
        let mut buf = self.buf.acquire();
        let mut h = self.h.each_mut().map(Lease::acquire);
        let mut dh = self.dh.each_mut().map(Lease::acquire);
        let mut products = self.products.each_mut().map(Lease::acquire);
        let mut grads = self.grads.each_mut().map(Lease::acquire);
        let ([pu, pd], [gu, gd]) = (&mut products, &mut grads);
        let mut chains = [self.chains[0].lent(pu, gu), self.chains[1].lent(pd, gd)];
        build_both([&*up, &*down], &mut h, &mut chains);
        let [cu, cd] = &mut chains;
        let [lanes, uu, ud] = &mut buf[..] else {
            unreachable!("three buffers")
        };
        let dym = MatRef::new(dy, b, m);
        {
            // Down's output side: dR_d = T1dᵀ·dY,  U_d = dY·R_dᵀ (as on the merged path).
            let (_, r, _, dr) = cd.seed_grads();
            let (r, t1d) = (MatRef::new(r, rd, m), MatRef::new(&self.t1d, b, rd));
            output_side(paired(&self.shapes[1], b), t1d, dym, r, dr, ud);
        }
        let (lr, lane_len) = (self.lane_rows, Lane::len(f, ru, rd));
        {
            let ld = MatRef::new(cd.seed_grads().0, f, rd);
            let rum = MatRef::new(cu.seed_grads().1, ru, f);
            let bias = &up.bias.value;
            // A lane's blocks; `kept`: the lane's rows of the forward's [GELU'(h) | g].
            let lane_blocks = |uu: &mut [f32],
                               ud: &[f32],
                               t1u: &[f32],
                               scratch: &mut [f32],
                               kept: Option<(&[f32], &[f32])>| {
                let lane = Lane::split(scratch, f, ru, rd);
                lane.dbu.fill(0.0);
                let blocks = uu
                    .chunks_mut(ROWS * ru)
                    .zip(ud.chunks(ROWS * rd))
                    .zip(t1u.chunks(ROWS * ru));
                for (i, ((uu, ud), t1u)) in blocks.enumerate() {
                    let rows = t1u.len() / ru;
                    let (h, g) = (&mut lane.h[..rows * f], &mut lane.g[..rows * f]);
                    let (t1u, ud) = (MatRef::new(t1u, rows, ru), MatRef::new(ud, rows, rd));
                    let (gp, gm): (&[f32], MatRef<'_>) = match kept {
                        Some((gp, g)) => {
                            let at = i * ROWS * f..(i * ROWS + rows) * f;
                            (&gp[at.clone()], MatRef::new(&g[at], rows, f))
                        }
                        None => {
                            // g as in the forward; h ← GELU'(h) (one Φ/φ for both).
                            matmul_serial(MatMut::new(h, rows, f), t1u, rum, false);
                            gelu_bias_value_grad(h, bias, g);
                            (h, MatRef::new(g, rows, f))
                        }
                    };
                    // dL_d += gᵀ·U_d;  dg = U_d·L_dᵀ (into the lane's g);  dh = dg ⊙ GELU'(h).
                    matmul_serial(MatMut::new(lane.dld, f, rd), gm.t(), ud, i > 0);
                    let dg = &mut lane.g[..rows * f];
                    matmul_serial(MatMut::new(dg, rows, f), ud, ld.t(), false);
                    mul(dg, gp);
                    let dh = MatRef::new(dg, rows, f);
                    // dR_u += T1uᵀ·dh;  db_u += Σ_rows dh;  U_u = dh·R_uᵀ.
                    matmul_serial(MatMut::new(lane.dru, ru, f), t1u.t(), dh, i > 0);
                    bias_grad_columns(dg, f, 0, lane.dbu); // on this lane only
                    matmul_serial(MatMut::new(uu, rows, ru), dh, rum.t(), false);
                }
            };
            let lanes_in = uu
                .par_chunks_mut(lr * ru)
                .zip(ud.par_chunks(lr * rd))
                .zip(self.t1u.par_chunks(lr * ru))
                .zip(lanes.par_chunks_mut(lane_len));
            if self.kept.is_empty() {
                comera_tensor::for_each(lanes_in, |(((uu, ud), t1u), scratch)| {
                    lane_blocks(uu, ud, t1u, scratch, None)
                });
            } else {
                let (gp, g) = self.kept.split_at(b * f);
                let lanes_in = lanes_in.zip(gp.par_chunks(lr * f).zip(g.par_chunks(lr * f)));
                comera_tensor::for_each(lanes_in, |((((uu, ud), t1u), scratch), (gp, g))| {
                    lane_blocks(uu, ud, t1u, scratch, Some((gp, g)))
                });
            }
        }
        // The lanes' partial sums, in lane order, element by element (in parallel chunks: at
        // batch 1 and rank 15 serially 0.16-0.18 ms per step).
        {
            let (_, _, dld, _) = cd.seed_grads();
            let (_, _, _, dru) = cu.seed_grads();
            let mut parts = lanes
                .chunks_mut(lane_len)
                .map(|s| Lane::split(s, f, ru, rd));
            let first = parts.next().expect("at least one lane");
            add(&mut up.bias.grad, first.dbu);
            match parts.next() {
                Some(second) => {
                    sum_into(first.dld, second.dld, dld);
                    sum_into(first.dru, second.dru, dru);
                    add(&mut up.bias.grad, second.dbu);
                }
                None => {
                    dld.copy_from_slice(first.dld);
                    dru.copy_from_slice(first.dru);
                }
            }
            for lane in parts {
                add_into(dld, lane.dld);
                add_into(dru, lane.dru);
                add(&mut up.bias.grad, lane.dbu);
            }
        }
        // Up's input side: dX = U_u·L_uᵀ,  dL_u = Xᵀ·U_u (as on the merged path).
        let (lu, _, dlu, _) = cu.seed_grads();
        let (uu, lu) = (MatRef::new(uu, b, ru), MatRef::new(lu, n, ru));
        input_side(paired(&self.shapes[0], b), x, b, uu, lu, Some(dx), dlu);
        // Both layers' chains peeled side by side (as built).
        let peel =
            |l: &mut TtLinear, chains: &mut LentChains<'_>, h: &[Scratch], dh: &mut [Scratch]| {
                chains.peel(&l.shape, h, dh);
                l.accumulate_core_grads(dh);
            };
        let ([h0, h1], [d0, d1]) = (&h, &mut dh);
        comera_tensor::join(|| peel(up, cu, h0, d0), || peel(down, cd, h1, d1));
        accumulate_bias_grad(dy, &mut down.bias.grad);
    }
}

/// Gates both layers' cores into `h` and builds their chains, the two layers side by side
/// (each layer's two chains are two tasks again, see `chain`): at rank 15 a layer's chains are
/// a few small products whose joins, not their arithmetic, set the time.
fn build_both(layers: [&TtLinear; 2], h: &mut [Lent<'_>; 2], chains: &mut [LentChains<'_>; 2]) {
    let build = |l: &TtLinear, h: &mut [Scratch], chains: &mut LentChains<'_>| {
        l.gate_cores(h);
        chains.build(&l.shape, h);
    };
    let ([h0, h1], [c0, c1]) = (h, chains);
    comera_tensor::join(|| build(layers[0], h0, c0), || build(layers[1], h1, c1));
}
