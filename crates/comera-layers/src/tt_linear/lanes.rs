//! Row lanes: the merged path's products at a large batch, each lane of rows on one thread.
//!
//! For B rows, the forward Y = T1⁺·R⁺ with T1 = X·L and the backward
//!
//! ```text
//! U1 = dY·Rᵀ            (B × r_p)
//! [dR ; dbᵀ] = T1⁺ᵀ·dY  (t × M, t = r_p + 1)
//! dX = U1·Lᵀ            (B × N)
//! dL = Xᵀ·U1            (N × r_p)
//! ```
//!
//! are each one pass over B rows, and the two sums over B (dR, dL) are the only places rows
//! meet. So the rows are cut into at most `MAX_LANES` lanes, fixed by B alone; each lane runs
//! all of a call's products for its rows on one thread, a block of `BLOCK_ROWS` rows at a
//! time, and keeps its own partial dR and dL; the partials are then added in lane order.
//!
//! Why: run as whole threaded products, each of the six passes streams its B × (N or M)
//! activation from memory and meets the other thread at a barrier, and the two sums over B
//! ran at 40-60% of the others' speed. A block's dY (128 × 768 floats, 384 KiB) stays in the
//! core's cache from U1 to dR, its X from T1 to dL and its U1 from dX to dL, and the threads
//! meet once per call. Measured on 2 Zen 3 cores at B = 4,096, r_p = 30 (products alone, one
//! process): the backward 11.6 → 10.3 ms at 768 × 768 and 32.0 → 23.1 ms at 768 × 3,072.
//!
//! The two products that write activations, Y = T1⁺·R⁺ and dX = U1·Lᵀ (inner length r_p or
//! r_p + 1), go through `matmul_serial_streamed`, which on AVX-512 writes them past the caches
//! (no read of each line written, no eviction of the block's X and dY; dX's B operand is Lᵀ,
//! copied once a call so that its rows are contiguous). Measured on 2 Zen 4 cores at
//! B = 4,096 (`comera --threads 2 bench tt-linear --tokens 4096`, the two builds alternated
//! three times, forward + backward): 768 × 768 7.9-8.8 → 6.8-7.7 ms, 3,072 × 768 18.7-21.5 →
//! 17.7-19.2 ms, 768 × 3,072 unchanged within the noise (18.2-20.5 ms).
//!
//! Those two products also prefetch what the lane reads next (the next block's X in the
//! forward; this block's X and the next block's dY in the backward), so that the products
//! that read them first (T1, dL, U1, run by `faer`) find them in L2 instead of starting on
//! lines still in memory. Measured on 2 Zen 4 cores at 768 × 768, B = 4,096, through
//! `comera.torch.TTLinear` (timers around the kernel calls, the two builds alternated three
//! times, medians): forward 2.17-2.24 → 2.14-2.15 ms, backward 4.74-4.82 → 4.41-4.45 ms.
//! `comera bench tt-linear` shows no change within its noise (three alternations: 6.81-7.05
//! ms before, 6.85-7.15 after); its loop reuses one X and dY (25 MB, which the streamed
//! outputs may leave in the 32 MB L3: not measured).
//!
//! Every lane's work is serial and the lanes are fixed by B, so the bits do not depend on
//! the thread count. Lane 0 writes its partials straight into dR and dL (0 + a = a exactly),
//! the others into scratch.

use crate::elementwise::add_into;
use comera_tensor::permute::permute;
use comera_tensor::{matmul_serial, matmul_serial_streamed, MatMut, MatRef};
use rayon::prelude::*;

/// Most lanes a batch is cut into (so at most this many threads share a call, and at most
/// `MAX_LANES - 1` partial gradients are held).
pub(crate) const MAX_LANES: usize = 8;

/// Rows per block inside a lane, and the fewest rows of a lane.
pub(crate) const BLOCK_ROWS: usize = 128;

/// Largest partial gradient (t·M + N·r_p floats) a lane keeps: beyond it (a 32,000-wide MLM
/// output at rank 64 would hold 8 MB a lane) the products run threaded instead.
pub(crate) const MAX_PARTIAL: usize = 1 << 20;

/// How `batch` rows are cut: (lanes, rows per lane); the last lane may be shorter.
pub(crate) fn split(batch: usize) -> (usize, usize) {
    let rows = BLOCK_ROWS.max(batch.div_ceil(MAX_LANES));
    (batch.div_ceil(rows), rows)
}

/// Whether a merged product of these sizes runs in lanes (else as threaded products): a batch
/// of more than one block, and partials of at most `MAX_PARTIAL` floats.
pub(crate) fn suits(batch: usize, n: usize, m: usize, rp: usize) -> bool {
    batch > BLOCK_ROWS && (rp + 1) * m + n * rp <= MAX_PARTIAL
}

/// Scratch lengths for the backward's lanes: per lane after the first, dR (t × M) and dL
/// (N × r_p); per lane, one block of U1 (`BLOCK_ROWS` × r_p); Lᵀ (r_p × N).
pub(crate) fn scratch_lens(batch: usize, n: usize, m: usize, rp: usize) -> Vec<usize> {
    let (lanes, _) = split(batch);
    vec![
        (lanes - 1) * ((rp + 1) * m + n * rp),
        lanes * BLOCK_ROWS * rp,
        rp * n,
    ]
}

/// Row blocks `[a, b)` of `rows` rows.
fn blocks(rows: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..rows)
        .step_by(BLOCK_ROWS)
        .map(move |a| (a, (a + BLOCK_ROWS).min(rows)))
}

/// The forward in lanes for `x` (B × N): T1 (written into the first r_p columns of `t1`,
/// B × t) = X·L, then Y (B × M) = T1⁺·R⁺ with `r1` = R⁺ (t × M).
pub(crate) fn forward(x: &[f32], l: MatRef<'_>, t1: &mut [f32], r1: MatRef<'_>, y: &mut [f32]) {
    let (n, rp, m) = (l.rows(), l.cols(), r1.cols());
    let t = rp + 1;
    let (_, rows) = split(t1.len() / t);
    let lanes = t1
        .par_chunks_mut(rows * t)
        .zip(y.par_chunks_mut(rows * m))
        .zip(x.par_chunks(rows * n));
    comera_tensor::for_each(lanes, |((t1, y), x)| {
        let lane_rows = t1.len() / t;
        for (a, b) in blocks(lane_rows) {
            let t1b = &mut t1[a * t..b * t];
            let xb = MatRef::new(&x[a * n..b * n], b - a, n);
            matmul_serial(MatMut::strided(t1b, b - a, rp, t, 1), xb, l, false);
            let t1b = MatRef::new(t1b, b - a, t);
            // While Y is written, the next block's X comes into L2 for its T1.
            let next_x = &x[b * n..(b + BLOCK_ROWS).min(lane_rows) * n];
            let y = MatMut::new(&mut y[a * m..b * m], b - a, m);
            matmul_serial_streamed(y, t1b, r1, false, &[next_x]);
        }
    });
}

/// One lane's outputs in the backward.
struct Lane<'a> {
    /// The lane's first row.
    row: usize,
    /// Its rows.
    rows: usize,
    /// Its partial [dR ; dbᵀ] (t × M) and dL (N × r_p).
    dr: &'a mut [f32],
    dl: &'a mut [f32],
    /// One block of U1 (`BLOCK_ROWS` × r_p).
    u1: &'a mut [f32],
    /// Its rows of dX (rows × N), when wanted.
    dx: Option<&'a mut [f32]>,
}

/// The backward in lanes, from the forward's T1⁺ (`t1`, B × t), the layer input `x` (B × N),
/// `dy` (B × M), L (`l`, N × r_p row-major) and R (r_p × M): writes [dR ; dbᵀ] into `dr1`
/// (t × M), dL into `dl` (N × r_p) and dX into `dx` (B × N) when given, or adds dX into it
/// with `add_dx` (dX = dX + U1·Lᵀ in the streamed product: an input that feeds several
/// layers gets their gradients' sum without an N × D buffer written and read back per
/// layer). `scratch` (partials, U1 blocks, Lᵀ) is leased with [`scratch_lens`].
#[allow(clippy::too_many_arguments)] // the path's full data flow, spelled out
pub(crate) fn backward(
    t1: &[f32],
    x: &[f32],
    dy: &[f32],
    l: &[f32],
    r: MatRef<'_>,
    dr1: &mut [f32],
    dl: &mut [f32],
    dx: Option<&mut [f32]>,
    add_dx: bool,
    scratch: (&mut [f32], &mut [f32], &mut [f32]),
) {
    let (rp, m) = (r.rows(), r.cols());
    let n = l.len() / rp;
    let t = rp + 1;
    let batch = t1.len() / t;
    let (lanes, rows) = split(batch);
    let (partials, u1s, lt) = scratch;
    if dx.is_some() {
        // Lᵀ (r_p × N) with its rows contiguous, for the streamed dX = U1·Lᵀ.
        permute(l, &[n, rp], &[1, 0], lt);
    }
    let lt = MatRef::new(lt, rp, n);
    let mut partials = partials.chunks_exact_mut(t * m + n * rp);
    let mut u1s = u1s.chunks_exact_mut(BLOCK_ROWS * rp);
    let mut dxs = dx.map(|d| d.chunks_mut(rows * n));
    let (mut dr1, mut dl) = (Some(dr1), Some(dl));
    let mut work: [Option<Lane<'_>>; MAX_LANES] = std::array::from_fn(|lane| {
        if lane >= lanes {
            return None;
        }
        let (dr, dl) = match (dr1.take(), dl.take()) {
            (Some(dr), Some(dl)) => (dr, dl),
            _ => partials
                .next()
                .expect("a partial a lane")
                .split_at_mut(t * m),
        };
        Some(Lane {
            row: lane * rows,
            rows: rows.min(batch - lane * rows),
            dr,
            dl,
            u1: u1s.next().expect("a U1 block a lane"),
            dx: dxs.as_mut().map(|d| d.next().expect("dX rows a lane")),
        })
    });
    comera_tensor::for_each(work[..lanes].par_iter_mut(), |lane| {
        let lane = lane.as_mut().expect("a lane below `lanes`");
        // Rows [a, b) of a B × w matrix.
        fn rows(mat: &[f32], w: usize, a: usize, b: usize) -> MatRef<'_> {
            MatRef::new(&mat[a * w..b * w], b - a, w)
        }
        for (a, b) in blocks(lane.rows) {
            let first = a == 0;
            let (ra, rb) = (lane.row + a, lane.row + b);
            let (dyb, xb, t1b) = (rows(dy, m, ra, rb), rows(x, n, ra, rb), rows(t1, t, ra, rb));
            let u1 = &mut lane.u1[..(b - a) * rp];
            matmul_serial(MatMut::new(u1, b - a, rp), dyb, r.t(), false);
            matmul_serial(MatMut::new(lane.dr, t, m), t1b.t(), dyb, !first);
            let u1 = MatRef::new(u1, b - a, rp);
            if let Some(dx) = lane.dx.as_deref_mut() {
                // While dX is written, this block's X (for dL next) and the next block's dY
                // (for its U1) come into L2.
                let next_dy = &dy[rb * m..(rb + BLOCK_ROWS).min(lane.row + lane.rows) * m];
                let dxb = MatMut::new(&mut dx[a * n..b * n], b - a, n);
                matmul_serial_streamed(dxb, u1, lt, add_dx, &[&x[ra * n..rb * n], next_dy]);
            }
            matmul_serial(MatMut::new(lane.dl, n, rp), xb.t(), u1, !first);
        }
    });
    // dR and dL are lane 0's; add the others' in lane order (`add_into`: in parallel chunks;
    // serially these sums left the other threads idle for up to 7 × 118 k additions a call at
    // 768 × 3,072).
    let (first, rest) = work.split_at_mut(1);
    let first = first[0].as_mut().expect("lane 0");
    for lane in rest.iter().flatten() {
        add_into(first.dr, lane.dr);
        add_into(first.dl, lane.dl);
    }
}
