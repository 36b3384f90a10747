//! Short, wide products on AVX-512 whose output is streamed to memory: C (m × n, rows
//! contiguous) = A·B, or C += A·B, for a short inner length k (≤ `MAX_K`) and B's rows
//! contiguous,
//!
//! ```text
//! C[i, j] = Σ_l A[i, l] · B[l, j]        (l ascending, one FMA per l, from 0)
//! C[i, j] = C[i, j] + Σ_l A[i, l] · B[l, j]   (accumulating: the sum above, then one add)
//! ```
//!
//! These are the TT merged path's products that write a layer's activations: the forward's
//! Y = T1⁺·R⁺ (B × M, k = r_p + 1) and the backward's dX = U1·Lᵀ (B × N, k = r_p). Their
//! arithmetic is small beside what they write (at r_p = 30, 31 FMAs per float of C), and C is
//! as large as the batch's activations (4,096 × 768 floats: 12.6 MB), far beyond the L2 and
//! not read again by the layer. Written with ordinary stores, every cache line of C is first
//! read from memory (a write-allocate) and then evicts the rows of X and dY that the lane's
//! next products read from L2. Here C is written with non-temporal stores instead, which
//! neither read nor cache it, wherever C's row stride is a whole number of cache lines (else
//! with ordinary stores: the same values, bit for bit).
//!
//! C is walked in panels of 64 columns (four 16-lane registers per row), and within a panel
//! in tiles of 6 rows: 24 accumulators, and per l four loads of B's row chunk (k × 64 floats
//! stay in L1 across the row tiles), six broadcasts of A and 24 FMAs. A narrower panel at
//! each end (the columns before the rows' first cache-line boundary, and n's remainder) is
//! masked and stored with ordinary masked stores.
//!
//! While it runs, the kernel can bring in what the caller reads next (`Ahead`: the next row
//! block's X, or dY): each tile prefetches a share of those cache lines into L2, about one per
//! FMA step, so they arrive during the arithmetic instead of stalling the next product, which
//! would otherwise start on lines still in memory (figures in `tt_linear/lanes.rs`).
//!
//! Every element is summed in the one order above, whatever its tile or store, so the bits
//! depend neither on how rows are split between threads nor on C's alignment. Used only where
//! the CPU has AVX-512 F (`narrow::available`); elsewhere `faer` computes these products.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Longest inner length handled here (the B panel, k × 256 bytes, stays in L1).
pub(crate) const MAX_K: usize = 64;

/// Narrowest C handled here: one panel.
pub(crate) const MIN_N: usize = 64;

/// A product for this kernel: raw views whose extents were checked by their owners.
pub(crate) struct Product {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// A (m × k): element (i, l) at `a[i·a_rs + l·a_cs]`.
    pub a: *const f32,
    pub a_rs: isize,
    pub a_cs: isize,
    /// B (k × n): element (l, j) at `b[l·b_rs + j]`.
    pub b: *const f32,
    pub b_rs: isize,
    /// C (m × n): element (i, j) at `c[i·c_rs + j]`.
    pub c: *mut f32,
    pub c_rs: isize,
    /// C += A·B (C read before it is written) instead of C = A·B.
    pub accumulate: bool,
    /// Memory to prefetch while the product runs.
    pub ahead: Ahead,
}

/// Cache lines to prefetch into L2 during a product: up to two address ranges, walked as one
/// list of lines. Addresses only (a prefetch never faults): nothing is read through them.
pub(crate) struct Ahead {
    /// (address of the first line, number of lines) of each range.
    ranges: [(usize, usize); 2],
}

impl Ahead {
    /// The lines covering `slices` (at most two).
    #[track_caller]
    pub(crate) fn new(slices: &[&[f32]]) -> Ahead {
        assert!(
            slices.len() <= 2,
            "at most two slices ahead, got {}",
            slices.len()
        );
        let mut ranges = [(0, 0); 2];
        for (range, s) in ranges.iter_mut().zip(slices) {
            if !s.is_empty() {
                let first = s.as_ptr() as usize & !63;
                let end = (s.as_ptr() as usize + 4 * s.len()).next_multiple_of(64);
                *range = (first, (end - first) / 64);
            }
        }
        Ahead { ranges }
    }

    fn lines(&self) -> usize {
        self.ranges[0].1 + self.ranges[1].1
    }

    /// The address of line `q` of the list (q < `lines()`).
    #[inline(always)]
    fn line(&self, q: usize) -> *const i8 {
        let [(a, n), (b, _)] = self.ranges;
        (if q < n { a + 64 * q } else { b + 64 * (q - n) }) as *const i8
    }
}

/// The lines of an [`Ahead`] still to prefetch, handed out `per_tile` to each tile in turn.
#[cfg(target_arch = "x86_64")]
struct Prefetch<'a> {
    ahead: &'a Ahead,
    next: usize,
    per_tile: usize,
}

#[cfg(target_arch = "x86_64")]
impl Prefetch<'_> {
    /// The next tile's share of lines: [s, e).
    #[inline(always)]
    fn take(&mut self) -> (usize, usize) {
        let s = self.next;
        self.next = (s + self.per_tile).min(self.ahead.lines());
        (s, self.next)
    }
}

/// Whether a product of these sizes is computed here (on a CPU that has AVX-512 F).
pub(crate) fn suits(m: usize, n: usize, k: usize) -> bool {
    crate::narrow::available() && m >= 1 && n >= MIN_N && (1..=MAX_K).contains(&k)
}

/// Computes `C = A·B`, or `C += A·B` with `p.accumulate` (see the module doc).
///
/// # Safety
/// `suits(m, n, k)` holds; every element of A, B and C that the strides address for the
/// given shape lies in a live allocation, and C overlaps neither A nor B.
pub(crate) unsafe fn compute(p: &Product) {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: AVX-512 F is present (`suits`); the caller vouches for the views.
        unsafe { panels(p) }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = p;
        unreachable!("`suits` is false off x86-64");
    }
}

/// Rows per tile.
#[cfg(target_arch = "x86_64")]
const ROWS: usize = 6;

/// The panels of C's columns (see the module doc), each in row tiles of `ROWS`, then 1.
///
/// When C's row stride is a whole number of cache lines, every row starts at the same offset
/// within its line: the first `head` columns (up to that line's end) form a narrow panel of
/// their own, so that every full panel after it starts on a line and is streamed.
///
/// # Safety
/// As [`compute`], with AVX-512 F present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn panels(p: &Product) {
    let lines = (p.c_rs * 4) % 64 == 0;
    let head = if lines {
        ((64 - (p.c as usize) % 64) % 64 / 4).min(p.n)
    } else {
        0
    };
    // Tiles in all: panels × row tiles (`ROWS` rows, then single rows).
    let tiles = (usize::from(head > 0) + (p.n - head).div_ceil(64)) * (p.m / ROWS + p.m % ROWS);
    let mut prefetch = Prefetch {
        ahead: &p.ahead,
        next: 0,
        per_tile: p.ahead.lines().div_ceil(tiles),
    };
    if head > 0 {
        // SAFETY: columns 0..head are inside C.
        unsafe { panel(p, 0, head, false, &mut prefetch) };
    }
    let mut j0 = head;
    while j0 < p.n {
        let w = (p.n - j0).min(64);
        // SAFETY: columns j0..j0 + w are inside C; with `lines`, C's rows at j0 are aligned.
        unsafe { panel(p, j0, w, lines, &mut prefetch) };
        j0 += w;
    }
    if lines {
        // Streaming stores are weakly ordered: fence them before the caller's next step (a
        // join after which another thread reads C).
        _mm_sfence();
    }
}

/// Columns j0..j0 + w (w ≤ 64) of C, every row; a full panel (w = 64) is streamed when
/// `stream`, a narrower one is written with masked ordinary stores.
///
/// # Safety
/// As [`compute`], with AVX-512 F present; columns j0..j0 + w are inside C, and with `stream`
/// C's rows are 64-byte aligned at column j0.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn panel(p: &Product, j0: usize, w: usize, stream: bool, pf: &mut Prefetch<'_>) {
    let mut i = 0;
    // SAFETY (the tiles): rows i.., columns j0..j0 + w are inside the views.
    if w == 64 {
        while p.m - i >= ROWS {
            unsafe { tile::<ROWS, 4>(p, i, j0, 0xFFFF, stream, pf.take()) };
            i += ROWS;
        }
        while i < p.m {
            unsafe { tile::<1, 4>(p, i, j0, 0xFFFF, stream, pf.take()) };
            i += 1;
        }
        return;
    }
    // w mod 16 columns masked in the last register.
    let last = match w % 16 {
        0 => 0xFFFF,
        r => ((1u32 << r) - 1) as __mmask16,
    };
    while i < p.m {
        let rows = if p.m - i >= ROWS { ROWS } else { 1 };
        let lines = pf.take();
        // SAFETY: as above.
        unsafe {
            match (rows, w.div_ceil(16)) {
                (ROWS, 1) => tile::<ROWS, 1>(p, i, j0, last, false, lines),
                (ROWS, 2) => tile::<ROWS, 2>(p, i, j0, last, false, lines),
                (ROWS, 3) => tile::<ROWS, 3>(p, i, j0, last, false, lines),
                (ROWS, _) => tile::<ROWS, 4>(p, i, j0, last, false, lines),
                (_, 1) => tile::<1, 1>(p, i, j0, last, false, lines),
                (_, 2) => tile::<1, 2>(p, i, j0, last, false, lines),
                (_, 3) => tile::<1, 3>(p, i, j0, last, false, lines),
                _ => tile::<1, 4>(p, i, j0, last, false, lines),
            }
        }
        i += rows;
    }
}

/// Rows i0..i0+R, columns j0..j0+16·V of C (the last register's lanes masked by `last`):
/// acc = Σ_l A[i, l] · B[l, j0..], then (C + acc when accumulating) stored (streamed when
/// `stream`, which needs `last` full and C's rows 64-byte aligned). Lines [s, e) of `p.ahead` are prefetched on the way,
/// spread over the steps l (one per step, more when e - s > k).
///
/// # Safety
/// AVX-512 F is present; rows i0..i0+R of A and C, rows 0..k of B and the columns the tile
/// covers (through `last`) are inside the views; with `stream`, C's rows are 64-byte aligned.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn tile<const R: usize, const V: usize>(
    p: &Product,
    i0: usize,
    j0: usize,
    last: __mmask16,
    stream: bool,
    (s, e): (usize, usize),
) {
    let mask = |v: usize| if v + 1 == V { last } else { 0xFFFF };
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    // SAFETY: rows i0..i0+R of A are inside A.
    let a_rows: [*const f32; R] =
        std::array::from_fn(|r| unsafe { p.a.offset((i0 + r) as isize * p.a_rs) });
    // SAFETY: column j0 of B's rows is inside B.
    let b_panel = unsafe { p.b.add(j0) };
    for l in 0..p.k {
        let mut q = s + l;
        while q < e {
            // A prefetch reads nothing and never faults, whatever the address.
            _mm_prefetch::<_MM_HINT_T1>(p.ahead.line(q));
            q += p.k;
        }
        // SAFETY (all loads here): B row l, the tile's columns (masked), and A[i0 + r, l] are
        // inside the views.
        let b_row = unsafe { b_panel.offset(l as isize * p.b_rs) };
        let b: [__m512; V] =
            std::array::from_fn(|v| unsafe { _mm512_maskz_loadu_ps(mask(v), b_row.add(16 * v)) });
        for r in 0..R {
            // SAFETY: as above (A[i0 + r, l]).
            let a = unsafe { _mm512_set1_ps(*a_rows[r].offset(l as isize * p.a_cs)) };
            for v in 0..V {
                acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: C row i0 + r, the tile's columns (masked) are inside C, which no view read
        // here overlaps; streamed only when the row is 64-byte aligned (the caller's `stream`).
        unsafe {
            let c_row = p.c.offset((i0 + r) as isize * p.c_rs).add(j0);
            for (v, &x) in acc.iter().enumerate() {
                let x = if p.accumulate {
                    _mm512_add_ps(_mm512_maskz_loadu_ps(mask(v), c_row.add(16 * v)), x)
                } else {
                    x
                };
                if stream {
                    _mm512_stream_ps(c_row.add(16 * v), x);
                } else {
                    _mm512_mask_storeu_ps(c_row.add(16 * v), mask(v), x);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{matmul_serial_streamed, MatMut, MatRef};

    /// C = A·B (or, with `init`, C = init + A·B) through `matmul_serial_streamed` into a
    /// buffer whose first row starts `offset` floats past a cache line, rows `c_rs` apart,
    /// prefetching `ahead`; returns C's m × n values.
    #[allow(clippy::too_many_arguments)]
    fn streamed(
        a: &[f32],
        a_t: bool,
        b: &[f32],
        (m, n, k): (usize, usize, usize),
        offset: usize,
        c_rs: usize,
        ahead: &[&[f32]],
        init: Option<&[f32]>,
    ) -> Vec<f32> {
        // A Vec of 16-float (one line) blocks is line-aligned.
        let mut lines = vec![[f32::NAN; 16]; (offset + m * c_rs).div_ceil(16) + 1];
        let flat = lines.as_flattened_mut();
        if let Some(init) = init {
            for i in 0..m {
                flat[offset + i * c_rs..][..n].copy_from_slice(&init[i * n..(i + 1) * n]);
            }
        }
        let a = if a_t {
            MatRef::new(a, k, m).t()
        } else {
            MatRef::new(a, m, k)
        };
        let c = MatMut::strided(&mut flat[offset..], m, n, c_rs, 1);
        matmul_serial_streamed(c, a, MatRef::new(b, k, n), init.is_some(), ahead);
        (0..m)
            .flat_map(|i| flat[offset + i * c_rs..][..n].to_vec())
            .collect()
    }

    #[test]
    fn streamed_products_match_the_sum_in_f64_with_the_same_bits_at_any_alignment_and_prefetch() {
        // Shapes of the TT merged path (k = r_p + 1 with the bias, n = 768 or 3,072) and
        // edges: one panel, masked tails, single rows, k = 1 and k = MAX_K; C's rows a whole
        // number of lines apart (streamed after a head panel) or not (ordinary stores).
        for &(m, n, k) in &[
            (128, 768, 31),
            (7, 64, 30),
            (13, 100, 1),
            (6, 250, 64),
            (1, 3072, 17),
        ] {
            for a_t in [false, true] {
                let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
                let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
                let reference: Vec<f64> = (0..m * n)
                    .map(|ij| {
                        let (i, j) = (ij / n, ij % n);
                        (0..k)
                            .map(|l| {
                                let a_il = if a_t { a[l * m + i] } else { a[i * k + l] };
                                a_il as f64 * b[l * n + j] as f64
                            })
                            .sum()
                    })
                    .collect();
                let first = streamed(&a, a_t, &b, (m, n, k), 0, n.next_multiple_of(16), &[], None);
                for (c, r) in first.iter().zip(&reference) {
                    assert!(
                        (*c as f64 - r).abs() < 1e-5 * k as f64,
                        "{m}×{n}×{k}: {c} vs {r}"
                    );
                }
                // Prefetching (a hint) changes nothing: a slice of any size, or two.
                let big = vec![0.5f32; 100_000];
                let aheads: [&[&[f32]]; 3] = [&[], &[&b[1..]], &[&a, &big[3..]]];
                for (i, (offset, c_rs)) in [(1, n.next_multiple_of(16)), (5, n + 3), (15, n)]
                    .into_iter()
                    .enumerate()
                {
                    let other = streamed(&a, a_t, &b, (m, n, k), offset, c_rs, aheads[i], None);
                    assert!(
                        other == first,
                        "{m}×{n}×{k}: bits differ at offset {offset}, row stride {c_rs}"
                    );
                    // Accumulating into C: C + A·B, on AVX-512 the same bits as the product
                    // then one add (what `add_into` of a product written apart gives); where
                    // `matmul_serial` computes it instead, its own order, within rounding.
                    let init: Vec<f32> = (0..m * n).map(|i| (i as f32 * 0.07).sin()).collect();
                    let added = streamed(&a, a_t, &b, (m, n, k), offset, c_rs, &[], Some(&init));
                    let want: Vec<f32> = init.iter().zip(&first).map(|(c, p)| c + p).collect();
                    if crate::narrow::available() {
                        assert!(
                            added == want,
                            "{m}×{n}×{k}: accumulated bits differ at offset {offset}, row \
                             stride {c_rs}"
                        );
                    } else {
                        for (x, w) in added.iter().zip(&want) {
                            assert!((x - w).abs() <= 1e-5 * (1.0 + w.abs()), "{m}×{n}×{k}");
                        }
                    }
                }
            }
        }
    }
}
