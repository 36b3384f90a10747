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
//! Each block's products run single-threaded, in h and g blocks of the thread's own, so a
//! block's work stays on one core and the step does not fork and join around every small
//! product. The forward's blocks are independent: one task a thread claims them one at a time
//! (`comera_tensor::for_each_claimed`). The backward's blocks meet in the sums dL_d, dR_u and
//! db_u, so they are cut into *lanes*, contiguous runs of blocks fixed by the batch alone (at
//! most [`LANES`]); the tasks claim whole lanes, each lane sums its blocks into its own partial
//! sums, and the partials are then added in lane order. So the result depends neither on the
//! thread count nor on scheduling, and equals the unfused Up → GELU → Down up to float
//! rounding. Measured against blocks of 128 rows run in order with threaded products
//! (`comera --threads 2 bench step --batch 32 --ops`, paper model): the backward 6% faster at
//! rank 30 and 16% at rank 15, the forward unchanged; blocks of 16, 32 and 64 rows within a
//! few percent of each other.

use super::chain::{Chains, LentChains};
use super::merged::{input_side, output_side, paired};
use super::pool::{Lease, Lent, Scratch};
use super::TtLinear;
use crate::activation::simd::{gelu_bias_in_place, gelu_bias_value_grad};
use crate::elementwise::kernels::{add, mul};
use crate::elementwise::{add_into, sum_into};
use crate::{accumulate_bias_grad, add_bias, bias_grad_columns, check_len, Layer};
use comera_plan::TtPath;
use comera_tensor::{matmul, matmul_serial, DisjointMut, MatMut, MatRef, TtShape};

/// Most lanes a batch's blocks are cut into (module doc; [`max_lanes`]): so at most this many
/// threads share a backward, and at most this many partial sums (F·(r_d + r_u + 1) floats
/// each: 0.7 MiB at F = 3,072 and rank 30) are held. Fixed lanes, where there used to be one
/// per thread, make the bits independent of the thread count, and a thread that the machine
/// delays holds up at most its last lane: at batch 32 on 2 Zen 3 vCPUs (`comera --threads 2
/// bench step --scaling --threads-list 2`, 12 interleaved runs, medians) the pool's idle share
/// was 3.6% with a lane a thread, 3.0% with 8 lanes and 2.7% with 16, the step's time the same
/// within the noise.
const LANES: usize = 16;

/// The most lanes: [`LANES`], or `COMERA_FFN_LANES` from the environment (read once). Another
/// lane count changes the order of a few f32 sums (the lanes' partials) and nothing else: a
/// perturbation of one rounding, which `tools/gpu/e2e.sh` uses to measure how far a run drifts
/// from one (the CPU run it judges the GPU's against, and the same run with 1 lane).
fn max_lanes() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| match std::env::var("COMERA_FFN_LANES") {
        Ok(v) => v
            .trim()
            .parse()
            .ok()
            .filter(|&n| n >= 1)
            .unwrap_or_else(|| {
                eprintln!(
                    "warning: COMERA_FFN_LANES={v:?} is not a whole number of at least 1; \
                     using {LANES}"
                );
                LANES
            }),
        Err(_) => LANES,
    })
}

/// Rows per block: a thread's two ROWS × F blocks (h and g) take 384 KB each at F = 3072.
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
    /// [tasks × h and g blocks (ROWS × F each), lanes × partial sums (`Partials`),
    /// U_u (B × r_u), U_d (B × r_d)], scratch; tasks: the thread count when the workspace was
    /// made, at most the lanes.
    buf: Lease,
    /// [GELU'(h) | g] (B × F each), kept from the forward for the backward at most
    /// [`KEEP_MAX_ROWS`] rows; empty otherwise (the backward recomputes them).
    kept: Vec<f32>,
}

/// One lane's partial sums, split from its part of the flat buffer: dL_d (F × r_d), dR_u
/// (r_u × F) and db_u (F).
struct Partials<'a> {
    dld: &'a mut [f32],
    dru: &'a mut [f32],
    dbu: &'a mut [f32],
}

impl<'a> Partials<'a> {
    /// Floats of one lane's partial sums.
    fn len(f: usize, ru: usize, rd: usize) -> usize {
        f * rd + ru * f + f
    }

    fn split(buf: &'a mut [f32], f: usize, ru: usize, rd: usize) -> Partials<'a> {
        let (dld, rest) = buf.split_at_mut(f * rd);
        let (dru, rest) = rest.split_at_mut(ru * f);
        Partials {
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
        let lane_rows = batch.max(1).div_ceil(ROWS).div_ceil(max_lanes()) * ROWS;
        let lanes = batch.max(1).div_ceil(lane_rows);
        let tasks = rayon::current_num_threads().clamp(1, lanes);
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
                tasks * 2 * ROWS * f,
                lanes * Partials::len(f, ru, rd),
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
        let bias = &up.bias.value;
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
        let t1u = &self.t1u;
        let t1d = DisjointMut::new(&mut self.t1d);
        let rows_of = |i: usize| i * ROWS..b.min((i + 1) * ROWS);
        let blocks = b.div_ceil(ROWS);
        if self.kept.is_empty() {
            comera_tensor::for_each_claimed(blocks, &mut buf[0], 2 * ROWS * f, |i, hg| {
                let rows = rows_of(i);
                let (h, g) = hg.split_at_mut(ROWS * f);
                let t1u = &t1u[rows.start * ru..rows.end * ru];
                // SAFETY: block i alone writes its rows of T1d.
                unsafe {
                    t1d.with_range(rows.start * rd, rows.len() * rd, |t1d| {
                        block(t1u, t1d, h, g, false)
                    })
                };
            });
        } else {
            let (gp, g) = self.kept.split_at_mut(b * f);
            let (gp, g) = (DisjointMut::new(gp), DisjointMut::new(g));
            comera_tensor::for_each_claimed(blocks, &mut buf[0], 2 * ROWS * f, |i, _| {
                let rows = rows_of(i);
                let (at, len) = (rows.start * f, rows.len() * f);
                let t1u = &t1u[rows.start * ru..rows.end * ru];
                // SAFETY: block i alone writes its rows of T1d, GELU'(h) and g.
                unsafe {
                    t1d.with_range(rows.start * rd, rows.len() * rd, |t1d| {
                        gp.with_range(at, len, |gp| {
                            g.with_range(at, len, |g| block(t1u, t1d, gp, g, true))
                        })
                    })
                };
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
        let [hg, partials, uu, ud] = &mut buf[..] else {
            unreachable!("four buffers")
        };
        let dym = MatRef::new(dy, b, m);
        {
            // Down's output side: dR_d = T1dᵀ·dY,  U_d = dY·R_dᵀ (as on the merged path).
            let (_, r, _, dr) = cd.seed_grads();
            let (r, t1d) = (MatRef::new(r, rd, m), MatRef::new(&self.t1d, b, rd));
            output_side(paired(&self.shapes[1], b), t1d, dym, r, dr, ud);
        }
        let (lr, plen) = (self.lane_rows, Partials::len(f, ru, rd));
        {
            let ld = MatRef::new(cd.seed_grads().0, f, rd);
            let rum = MatRef::new(cu.seed_grads().1, ru, f);
            let bias = &up.bias.value;
            // A lane's blocks, in the h and g blocks `hg` of the task that claimed it; `kept`:
            // the lane's rows of the forward's [GELU'(h) | g].
            let lane_blocks = |uu: &mut [f32],
                               ud: &[f32],
                               t1u: &[f32],
                               hg: &mut [f32],
                               lane: Partials<'_>,
                               kept: Option<(&[f32], &[f32])>| {
                let (hb, gb) = hg.split_at_mut(ROWS * f);
                lane.dbu.fill(0.0);
                let blocks = uu
                    .chunks_mut(ROWS * ru)
                    .zip(ud.chunks(ROWS * rd))
                    .zip(t1u.chunks(ROWS * ru));
                for (i, ((uu, ud), t1u)) in blocks.enumerate() {
                    let rows = t1u.len() / ru;
                    let (h, g) = (&mut hb[..rows * f], &mut gb[..rows * f]);
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
                    // dL_d += gᵀ·U_d;  dg = U_d·L_dᵀ (into the task's g);  dh = dg ⊙ GELU'(h).
                    matmul_serial(MatMut::new(lane.dld, f, rd), gm.t(), ud, i > 0);
                    let dg = &mut gb[..rows * f];
                    matmul_serial(MatMut::new(dg, rows, f), ud, ld.t(), false);
                    mul(dg, gp);
                    let dh = MatRef::new(dg, rows, f);
                    // dR_u += T1uᵀ·dh;  db_u += Σ_rows dh;  U_u = dh·R_uᵀ.
                    matmul_serial(MatMut::new(lane.dru, ru, f), t1u.t(), dh, i > 0);
                    bias_grad_columns(dg, f, 0, lane.dbu); // on this lane only
                    matmul_serial(MatMut::new(uu, rows, ru), dh, rum.t(), false);
                }
            };
            let (t1u, kept) = (&self.t1u, &self.kept);
            let (ud, lanes) = (&*ud, partials.len() / plen);
            let (uu, partials) = (DisjointMut::new(uu), DisjointMut::new(partials));
            comera_tensor::for_each_claimed(lanes, hg, 2 * ROWS * f, |lane, hg| {
                let rows = lane * lr..b.min((lane + 1) * lr);
                let kept = (!kept.is_empty()).then(|| {
                    let (gp, g) = kept.split_at(b * f);
                    let at = rows.start * f..rows.end * f;
                    (&gp[at.clone()], &g[at])
                });
                let (ud, t1u) = (
                    &ud[rows.start * rd..rows.end * rd],
                    &t1u[rows.start * ru..rows.end * ru],
                );
                // SAFETY: lane `lane` alone writes its rows of U_u and its partial sums.
                unsafe {
                    uu.with_range(rows.start * ru, rows.len() * ru, |uu| {
                        partials.with_range(lane * plen, plen, |p| {
                            lane_blocks(uu, ud, t1u, hg, Partials::split(p, f, ru, rd), kept)
                        })
                    })
                };
            });
        }
        // The lanes' partial sums, in lane order, element by element (in parallel chunks: at
        // batch 1 and rank 15 serially 0.16-0.18 ms per step).
        {
            let (_, _, dld, _) = cd.seed_grads();
            let (_, _, _, dru) = cu.seed_grads();
            let mut parts = partials
                .chunks_mut(plen)
                .map(|s| Partials::split(s, f, ru, rd));
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
