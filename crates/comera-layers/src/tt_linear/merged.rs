//! Merged path: T1 = X·L (B × r_p), Y = T1·R + 1·bᵀ. Batch cost 2·B·r_p·(N + M) per product.
//! Backward: dR = T1ᵀ·dY, db = 1ᵀ·dY, U1 = dY·Rᵀ, dX = U1·Lᵀ, dL = Xᵀ·U1, then peel both
//! chains.
//!
//! The bias rides along as one more rank: T1⁺ = [T1 | 1] (B × (r_p + 1)) and R⁺ = [R ; bᵀ]
//! ((r_p + 1) × M), so Y = T1⁺·R⁺ and [dR ; dbᵀ] = T1⁺ᵀ·dY are each one product. Adding b and
//! summing dY as passes of their own read (and for b, wrote) the B × M activations once more
//! each: at 4,096 tokens × 3,072 that is 50 MB from memory per pass, several ms on 2 cores,
//! for 1/(r_p + 1) more arithmetic here.
//!
//! Three schedules, by batch. Above one block of rows (and for partial gradients of modest
//! size) every product runs in row lanes, each lane on one thread (`lanes`: the products of
//! a block of rows back to back while its rows are in cache). Otherwise:
//!
//! Two sides. Below `PAIR_MAX_MACS` the products are thin (r_p = 30 columns or inner length)
//! and a threaded GEMM keeps the second core partly idle, so every product runs on one thread
//! and a call runs as two tasks a round, one for each side of the layer: the input cores (their
//! gating, the left chain, its peel, their gradients) with the products that need L, the
//! output cores with those that need R (`Merged::forward_paired`, `Merged::backward_paired`):
//! two rounds a backward, one and the output product a forward, instead of a parallel section
//! for each step. The split does not depend on the thread count, so neither do the bits.
//!
//! Threaded, above: one threaded product after the other.
//!
//! The fused layers that share this path's products (`shared`, `ffn`) still pair them as
//! (dR ∥ U1), (dX ∥ dL) at small batches (`output_side`, `input_side`). At r_p ≤
//! `SPLIT_DL_MAX_RANK` their second pair is split differently: dL = Xᵀ·U1 reads the layer
//! input X, saved by the forward and cold by now, down its columns (the narrow kernel's
//! transposed-A form), one thread pulling the whole of X from memory while the other finishes
//! its dX from cache and waits. Instead the dX task also takes the first third of dL's rows and
//! the other task the rest, so both cores pull X. Each row of dL is the same sum either way
//! (the narrow kernel's rows do not depend on how they are split), so the bits do not change.

use super::chain::LeasedChains;
use super::lanes;
use super::pool::{Lease, Scratch};
use super::{CoreGrads, TtLinear};
use crate::elementwise::copy;
use comera_tensor::{matmul, matmul_row_pieces, matmul_serial, MatMut, MatRef, TtShape};

/// Largest product (multiply-adds, B·r_p·max(N, M)) run as two single-threaded tasks rather
/// than threaded: measured with `comera bench tt-linear` (768×768 at 128 and 256 tokens:
/// 1.2× faster forward+backward; at 1024 tokens and above the threaded products are as fast).
pub(crate) const PAIR_MAX_MACS: usize = 1 << 24;

/// Rows of a piece of the products at small batches (`paired`) that are cut by rows. The
/// forward's output product Y = T1⁺·R⁺ first: its inner
/// length is only r_p + 1, and the threaded backend split its 128 rows poorly. Measured on 2
/// Zen 4 cores (products alone, 2 threads, best of 7 × 200 calls): 128 × 31 · 31 × 768 44 µs
/// threaded, 35 µs in 64- or 32-row pieces; 128 × 31 · 31 × 3,072 129-150 µs threaded, 141-145
/// µs in pieces. The X·L product (inner length N) scaled well threaded too (1.85×), but runs in
/// the same pieces beside the right chain (`Merged::forward_paired`), and so does the
/// backward's dX = U1·Lᵀ, where the task done first takes over the other's pieces.
const PIECE_ROWS: usize = 32;

/// Largest r_p at which the paired dL is split between both tasks (see the module doc): the
/// narrow kernels' width. Measured inside the step (`comera --threads 2 bench step --batch 1`,
/// the o projection, timer around the pair, not committed): rank 15 108 → 62-64 µs per call;
/// at rank 30 (`faer`, which packs X) the same split was slower (160-177 → 198-201 µs).
const SPLIT_DL_MAX_RANK: usize = 16;

/// Rows of dL that the dX task also computes when the pair is split: dX (from cache) is about
/// a fifth of the cold dL's time at rank 15; a third balanced best of the halves and thirds
/// measured.
const SPLIT_DL_FIRST: usize = 3;

/// Whether `batch` rows of `shape` run as two tasks (see the module doc).
pub(crate) fn paired(shape: &TtShape, batch: usize) -> bool {
    let wide = shape.in_features().max(shape.out_features());
    batch * shape.middle_rank() * wide <= PAIR_MAX_MACS
}

/// Saved between forward and backward: T1⁺ only (B × (r_p + 1)). The chains, R⁺, [dR ; dbᵀ]
/// and U1 (or the lanes' scratch) are borrowed for each call; the backward rebuilds the
/// chains.
#[derive(Debug)]
pub(crate) struct Merged {
    chains: LeasedChains,
    t1: Vec<f32>, // B × (r_p + 1): T1, then a column of ones
    r1: Lease,    // [(r_p + 1) × M]: R, then bᵀ (forward)
    // [(r_p + 1) × M, …]: dR then dbᵀ, and U1 (B × r_p), or in lanes their partials and U1
    // blocks (`lanes::scratch_lens`)
    dr1_u1: Lease,
    lanes: bool, // whether the products run in row lanes (`lanes::suits`)
}

impl Merged {
    pub fn new(shape: &TtShape, batch: usize) -> Merged {
        let (n, m, rp) = super::sizes(shape);
        let mut t1 = vec![0.0; batch * (rp + 1)];
        t1.chunks_exact_mut(rp + 1).for_each(|row| row[rp] = 1.0);
        let lanes = !paired(shape, batch) && lanes::suits(batch, n, m, rp);
        let mut backward = vec![(rp + 1) * m];
        if lanes {
            backward.extend(lanes::scratch_lens(batch, n, m, rp));
        } else {
            backward.push(batch * rp);
        }
        Merged {
            chains: LeasedChains::new(shape),
            t1,
            r1: Lease::new(vec![(rp + 1) * m]),
            dr1_u1: Lease::new(backward),
            lanes,
        }
    }

    /// Bytes kept between calls.
    pub fn bytes(&self) -> usize {
        4 * self.t1.len()
    }

    /// Bytes borrowed from the thread's pool during a call (the larger of forward's and
    /// backward's).
    pub fn scratch_bytes(&self) -> usize {
        self.chains.bytes() + self.r1.bytes().max(self.dr1_u1.bytes())
    }

    /// `y = x·W + bias` for `layer` (whose gated cores this writes into `h`).
    pub fn forward(
        &mut self,
        layer: &TtLinear,
        h: &mut [Scratch],
        batch: usize,
        x: &[f32],
        y: &mut [f32],
    ) {
        let shape = &layer.shape;
        if !self.lanes && paired(shape, batch) {
            self.forward_paired(layer, h, batch, x, y);
            return;
        }
        let (n, m, rp) = super::sizes(shape);
        layer.gate_cores(h);
        let mut built = self.chains.build(shape, h, false);
        let chains = built.lent();
        let mut r1 = self.r1.acquire();
        let r1 = &mut r1[0];
        copy(&mut r1[..rp * m], chains.r());
        r1[rp * m..].copy_from_slice(&layer.bias.value);
        if self.lanes {
            let (l, r1) = (MatRef::new(chains.l(), n, rp), MatRef::new(r1, rp + 1, m));
            lanes::forward(x, l, &mut self.t1, r1, y);
            return;
        }
        // T1 into the first r_p columns of T1⁺ (the last stays 1).
        matmul(
            MatMut::strided(&mut self.t1, batch, rp, rp + 1, 1),
            MatRef::new(x, batch, n),
            MatRef::new(chains.l(), n, rp),
            false,
        );
        matmul(
            MatMut::new(y, batch, m),
            MatRef::new(&self.t1, batch, rp + 1),
            MatRef::new(r1, rp + 1, m),
            false,
        );
    }

    /// Whether [`Merged::backward`] can add dX into its `dx` (`add_dx`): the row lanes can.
    pub fn adds_dx(&self) -> bool {
        self.lanes
    }

    /// The backward of `forward` for `layer`: dX (when wanted; added into `dx` with `add_dx`,
    /// which only the row lanes take: [`Merged::adds_dx`]), and the gradients of its cores,
    /// gates (through their gated cores `h` and their gradients `dh`, scratch) and bias.
    #[allow(clippy::too_many_arguments)] // the path's full data flow, spelled out
    pub fn backward(
        &mut self,
        layer: &mut TtLinear,
        h: &mut [Scratch],
        dh: &mut [Scratch],
        batch: usize,
        x: &[f32],
        dy: &[f32],
        dx: Option<&mut [f32]>,
        add_dx: bool,
    ) {
        assert!(
            !add_dx || self.lanes,
            "the merged path adds dX in its row lanes only"
        );
        if !self.lanes && paired(&layer.shape, batch) {
            self.backward_paired(layer, h, dh, batch, x, dy, dx);
            return;
        }
        let shape = &layer.shape;
        let (n, m, rp) = super::sizes(shape);
        layer.gate_cores(h);
        let mut built = self.chains.build(shape, h, true);
        let mut chains = built.lent();
        let mut scratch = self.dr1_u1.acquire();
        let (l_rows, r, dl, dr) = chains.seed_grads();
        let (l, r) = (MatRef::new(l_rows, n, rp), MatRef::new(r, rp, m));
        let dr1 = match &mut scratch[..] {
            [dr1, partials, u1s, lt] if self.lanes => {
                let scratch = (&mut **partials, &mut **u1s, &mut **lt);
                lanes::backward(&self.t1, x, dy, l_rows, r, dr1, dl, dx, add_dx, scratch);
                dr1
            }
            [dr1, u1] => {
                let t1 = MatRef::new(&self.t1, batch, rp + 1);
                output_side(false, t1, MatRef::new(dy, batch, m), r, dr1, u1);
                let u1 = MatRef::new(u1, batch, rp);
                input_side(false, x, batch, u1, l, dx, dl);
                dr1
            }
            _ => unreachable!("the buffers leased in `new`"),
        };
        split_dr_db(dr1, dr, &mut layer.bias.grad);
        chains.peel(shape, h, dh);
        layer.accumulate_core_grads(dh);
    }

    /// The forward at small batches (`paired`): the two sides of the layer side by side,
    ///   (gate the input cores, left chain, T1 = X·L)  ∥  (gate the output cores, right chain,
    ///   R⁺ = [R ; bᵀ]),
    /// then Y = T1⁺·R⁺; T1 and Y in row pieces of [`PIECE_ROWS`] (single-threaded,
    /// fixed by the shapes), which a task that is done takes over from the other.
    fn forward_paired(
        &mut self,
        layer: &TtLinear,
        h: &mut [Scratch],
        batch: usize,
        x: &[f32],
        y: &mut [f32],
    ) {
        let shape = &layer.shape;
        let ((n, m, rp), p) = (super::sizes(shape), shape.p());
        let mut lent = self.chains.lend(false);
        let mut chains = lent.lent();
        let (left, right) = chains.sides();
        let mut r1 = self.r1.acquire();
        let r1 = &mut r1[0];
        let (h_in, h_out) = h.split_at_mut(p);
        let t1 = &mut self.t1;
        comera_tensor::join(
            || {
                layer.gate_side(0, h_in);
                let left = left.build(shape, h_in);
                // T1 into the first r_p columns of T1⁺ (the last stays 1).
                matmul_row_pieces(
                    MatMut::strided(t1, batch, rp, rp + 1, 1),
                    MatRef::new(x, batch, n),
                    MatRef::new(left.l(), n, rp),
                    false,
                    PIECE_ROWS,
                );
            },
            || {
                layer.gate_side(p, h_out);
                let right = right.build(shape, h_out);
                r1[..rp * m].copy_from_slice(right.r());
                r1[rp * m..].copy_from_slice(&layer.bias.value);
            },
        );
        forward_out(
            true,
            MatMut::new(y, batch, m),
            MatRef::new(&self.t1, batch, rp + 1),
            MatRef::new(r1, rp + 1, m),
        );
    }

    /// The backward at small batches (`paired`): every product single-threaded, in two rounds
    /// of two tasks, each side of the layer (its cores' gating, chain, peel and gradients)
    /// beside the products that need it:
    ///   round 1: (gate input cores, left chain)  ∥  (gate output cores, right chain,
    ///            U1 = dY·Rᵀ),                              [dR ; dbᵀ] = T1⁺ᵀ·dY on either;
    ///   round 2: (dL = Xᵀ·U1, peel left, input cores' gradients)  ∥  (peel right, output
    ///            cores' gradients),                        dX = U1·Lᵀ on either;
    /// so that a call forks twice around work of similar size, instead of once for each of its
    /// steps. The products that need no chain (dR, dX) go to the task with fewer multiply-adds
    /// (by the shapes: a 768 → 3,072 layer's right chain is four times its left one, a
    /// 3,072 → 768 layer's the other way round); the chains' products, their peels and dX cut
    /// into row pieces, which a task that is done takes over from the other.
    ///
    /// The input side goes first, on the calling thread, because it is the longer one (dL reads
    /// the layer input X, cold by now), so that the one left waiting is the pool's other
    /// worker, in its poller, rather than the caller: in `rayon::join` a waiting caller went
    /// to sleep after a few dozen `sched_yield`s and was woken some 20-50 µs after the other
    /// task ended (`comera_tensor::join`, used here, spins instead). Measured inside the step
    /// (`comera --threads 2 bench step --batch 1`, a timer on each task, not committed), output
    /// side first, with `rayon::join`: the 3,072 → 768 layer's second round took 509 µs against
    /// 350 and 464 µs for its two tasks, the 768 → 3,072 layer's 278 against 162 and 224.
    ///
    /// Every product is computed by one call on one thread in pieces fixed by the shapes, so
    /// the bits do not depend on the thread count.
    #[allow(clippy::too_many_arguments)] // the path's full data flow, spelled out
    fn backward_paired(
        &mut self,
        layer: &mut TtLinear,
        h: &mut [Scratch],
        dh: &mut [Scratch],
        batch: usize,
        x: &[f32],
        dy: &[f32],
        dx: Option<&mut [f32]>,
    ) {
        let p = layer.shape.p();
        let (n, m, rp) = super::sizes(&layer.shape);
        let (left_macs, right_macs) = self.chains.layout().build_macs(&layer.shape);
        let dr_on_left = left_macs <= right_macs + batch * rp * m;
        let dx_on_left = n * batch * rp + 2 * left_macs <= 2 * right_macs;
        let mut lent = self.chains.lend(true);
        let mut chains = lent.lent();
        let (left, right) = chains.sides();
        let mut scratch = self.dr1_u1.acquire();
        let [dr1, u1] = &mut scratch[..] else {
            unreachable!("the buffers leased in `new`")
        };
        let (h_in, h_out) = h.split_at_mut(p);
        let (dh_in, dh_out) = dh.split_at_mut(p);
        let (t1, dy) = (
            MatRef::new(&self.t1, batch, rp + 1),
            MatRef::new(dy, batch, m),
        );
        let grad_r = |dr1: &mut [f32]| {
            matmul_serial(MatMut::new(dr1, rp + 1, m), t1.t(), dy, false);
        };
        let (dr_left, dr_right) = on_one(dr_on_left, &mut **dr1);
        let (layer_ref, shape) = (&*layer, &layer.shape);
        let (left, right) = comera_tensor::join(
            || {
                layer_ref.gate_side(0, h_in);
                let left = left.build(shape, h_in);
                dr_left.map(grad_r);
                left
            },
            || {
                layer_ref.gate_side(p, h_out);
                let right = right.build(shape, h_out);
                let r = MatRef::new(right.r(), rp, m);
                matmul_serial(MatMut::new(u1, batch, rp), dy, r.t(), false);
                dr_right.map(grad_r);
                right
            },
        );
        let (u1, dr1, h_in, h_out) = (MatRef::new(u1, batch, rp), &*dr1, &*h_in, &*h_out);
        let l = MatRef::new(left.l(), n, rp);
        let grad_x = |dx: &mut [f32]| {
            let dx = MatMut::new(dx, batch, n);
            matmul_row_pieces(dx, u1, l.t(), false, PIECE_ROWS);
        };
        let (dx_left, dx_right) = on_one(dx_on_left, dx);
        let shape = &layer.shape;
        let (mut grads_in, mut grads_out) =
            CoreGrads::sides(layer.rule, p, &mut layer.cores, &mut layer.gates);
        let db = &mut layer.bias.grad;
        comera_tensor::join(
            || {
                let mut left = left;
                let xt = MatRef::new(x, batch, n).t();
                matmul_serial(MatMut::new(left.dl(), n, rp), xt, u1, false);
                left.peel(shape, h_in, dh_in);
                grads_in.accumulate(dh_in);
                dx_left.flatten().map(grad_x);
            },
            || {
                let mut right = right;
                split_dr_db(dr1, right.dr(), db);
                right.peel(shape, h_out, dh_out);
                grads_out.accumulate(dh_out);
                dx_right.flatten().map(grad_x);
            },
        );
    }
}

/// [dR ; dbᵀ] ((r_p + 1) × M, `dr1`) apart: dR into the chain's seed `dr` (r_p × M), and
/// db += its last row.
fn split_dr_db(dr1: &[f32], dr: &mut [f32], db: &mut [f32]) {
    let (dr_rows, db_row) = dr1.split_at(dr.len());
    copy(dr, dr_rows);
    for (g, v) in db.iter_mut().zip(db_row) {
        *g += v;
    }
}

/// `v` for the first of two tasks when `first`, else for the second.
fn on_one<T>(first: bool, v: T) -> (Option<T>, Option<T>) {
    if first {
        (Some(v), None)
    } else {
        (None, Some(v))
    }
}

/// The forward's output product Y = T1⁺·R⁺ (B × M, inner length r_p + 1): in row pieces of
/// [`PIECE_ROWS`] when `pair` (see `paired`), else threaded.
pub(crate) fn forward_out(pair: bool, y: MatMut<'_>, t1: MatRef<'_>, r1: MatRef<'_>) {
    if pair {
        matmul_row_pieces(y, t1, r1, false, PIECE_ROWS);
    } else {
        matmul(y, t1, r1, false);
    }
}

/// The output side of the backward, dR = T1ᵀ·dY (t × M, t = T1's width: r_p, or r_p + 1 with
/// the bias's column) and U1 = dY·Rᵀ (B × r_p): two single-threaded tasks when `pair` (see
/// `paired`), else one threaded product after the other.
pub(crate) fn output_side(
    pair: bool,
    t1: MatRef<'_>,
    dy: MatRef<'_>,
    r: MatRef<'_>,
    dr: &mut [f32],
    u1: &mut [f32],
) {
    let (rp, m, batch) = (r.rows(), r.cols(), dy.rows());
    let t = t1.cols();
    if pair {
        comera_tensor::join(
            || matmul_serial(MatMut::new(dr, t, m), t1.t(), dy, false),
            || matmul_serial(MatMut::new(u1, batch, rp), dy, r.t(), false),
        );
    } else {
        matmul(MatMut::new(dr, t, m), t1.t(), dy, false);
        matmul(MatMut::new(u1, batch, rp), dy, r.t(), false);
    }
}

/// The input side, dX = U1·Lᵀ (B × N, when wanted) and dL = Xᵀ·U1 (N × r_p) for the layer
/// input `x` (B × N): two single-threaded tasks when `pair`, with dL's first rows on dX's task
/// at r_p ≤ `SPLIT_DL_MAX_RANK` (module doc), else threaded products.
pub(crate) fn input_side(
    pair: bool,
    x: &[f32],
    batch: usize,
    u1: MatRef<'_>,
    l: MatRef<'_>,
    dx: Option<&mut [f32]>,
    dl: &mut [f32],
) {
    let (n, rp) = (l.rows(), l.cols());
    let xm = MatRef::new(x, batch, n);
    match dx {
        Some(dx) if pair && rp <= SPLIT_DL_MAX_RANK => {
            // dX ∥ dL, dL's rows [0, at) with dX and [at, N) on their own.
            let at = n / SPLIT_DL_FIRST;
            let (dl_first, dl_rest) = dl.split_at_mut(at * rp);
            // Rows [a, b) of Xᵀ (N × B): columns a..b of X (B × N).
            let xt_rows = |a: usize, b: usize| MatRef::strided(&x[a..], b - a, batch, 1, n);
            comera_tensor::join(
                || {
                    matmul_serial(MatMut::new(dx, batch, n), u1, l.t(), false);
                    matmul_serial(MatMut::new(dl_first, at, rp), xt_rows(0, at), u1, false);
                },
                || matmul_serial(MatMut::new(dl_rest, n - at, rp), xt_rows(at, n), u1, false),
            );
        }
        Some(dx) if pair => {
            // dL first, on the calling thread: it is the longer (X is cold), and the other
            // worker is the better one to wait (see `Merged::backward_paired`).
            comera_tensor::join(
                || matmul_serial(MatMut::new(dl, n, rp), xm.t(), u1, false),
                || matmul_serial(MatMut::new(dx, batch, n), u1, l.t(), false),
            );
        }
        Some(dx) => {
            matmul(MatMut::new(dx, batch, n), u1, l.t(), false);
            matmul(MatMut::new(dl, n, rp), xm.t(), u1, false);
        }
        None => matmul(MatMut::new(dl, n, rp), xm.t(), u1, false),
    }
}
