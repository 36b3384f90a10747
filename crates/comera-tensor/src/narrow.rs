//! Tall, narrow products on AVX-512: C (m × n, 2 ≤ n ≤ 16, rows contiguous) = A·B or
//! C += A·B, one row of C in one 16-lane register.
//!
//! `faer` computes a row-major C as Cᵀ, column-major, and tiles that 16·j rows by 4 columns;
//! for n ≤ 16 the tile is one 16 × 4 block high: four accumulators, bound by FMA latency
//! (the TT merged path's T1 = X·L and U1 = dY·Rᵀ at rank 15 ran at about 125 GFLOP/s
//! single-threaded where the same products at rank 30 ran at 200-210). Two forms:
//!
//! - axpy, B's rows contiguous (T1 = X·L with L row-major N × r, and dL = Xᵀ·U1 with A a
//!   transposed view): C[i, :] = Σ_l A[i, l] · B[l, :], in tiles of 12 rows: 12
//!   accumulators, and per l one (masked) load of B's row and 12 broadcasts of A (any layout);
//! - dot, B's columns and A's rows contiguous (U1 = dY·Rᵀ, B = Rᵀ a view of R, r × M):
//!   C[i, j] = Σ_l A[i, l] · B[l, j] as 16-lane partial sums over l in tiles of 4 rows × 5
//!   columns (20 accumulators, 9 loads per 20 FMAs), each reduced to one value at the end.
//!
//! Measured single-threaded (`faer` → these kernels), 128 rows, rank 15: X·L over 768
//! 22.7 → 15.3 µs; dY·Rᵀ over 768 23.2 → 14.9 µs, over 3,072 96-120 → 64.7 µs. In
//! `bench step --ops --rank 15` at batch 32 the fused FFN went 6.1 / 14.4 → 5.4 / 13.4 ms
//! (forward / backward per layer).
//!
//! Every element is summed in one fixed order (l ascending: in the axpy form one FMA per l
//! onto C's value when accumulating, 0 otherwise; in
//! the dot form lane l mod 16 per lane, then `_mm512_reduce_add_ps`), the same in every tile
//! size, so a row's result does not depend on how rows are split between threads. Used only
//! where the CPU has AVX-512 F (detected once); elsewhere `faer` computes these products.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Narrowest and widest C handled here (one 16-lane register per row; a single column is a
/// dot product `faer` does well).
const MIN_N: usize = 2;
const MAX_N: usize = 16;

/// Shortest inner length handled here (below it the dot form's reductions dominate).
const MIN_K: usize = 32;

/// A product for these kernels: raw views whose extents were checked by their owners
/// (`faer` views built from bounds-checked `MatRef`/`MatMut`).
pub(crate) struct Product {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// A (m × k): element (i, l) at `a[i·a_rs + l·a_cs]`, with a_cs = 1 in the dot form.
    pub a: *const f32,
    pub a_rs: isize,
    pub a_cs: isize,
    /// B (k × n): element (l, j) at `b[l·b_rs + j·b_cs]`, with b_cs = 1 (axpy form) or
    /// b_rs = 1 (dot form).
    pub b: *const f32,
    pub b_rs: isize,
    pub b_cs: isize,
    /// C (m × n): element (i, j) at `c[i·c_rs + j]`.
    pub c: *mut f32,
    pub c_rs: isize,
    pub accumulate: bool,
}

/// Whether this CPU runs these kernels (AVX-512 F), detected once.
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx512f"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Computes `p` if its shape and layout suit a kernel here and the CPU has them; returns
/// whether it did.
///
/// # Safety
/// Every element of A, B and C that the strides address for the given shape lies in a live
/// allocation, and C overlaps neither A nor B.
pub(crate) unsafe fn try_compute(p: &Product) -> bool {
    if !(available() && (MIN_N..=MAX_N).contains(&p.n) && p.k >= MIN_K && p.m >= 1) {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if p.b_cs == 1 {
            // SAFETY: AVX-512 F is present (checked above); the caller vouches for the views.
            unsafe { axpy(p) };
            return true;
        }
        if p.b_rs == 1 && p.a_cs == 1 {
            // SAFETY: as above.
            unsafe { dot(p) };
            return true;
        }
    }
    false
}

/// Lanes 0..n of a 16-lane register.
#[cfg(target_arch = "x86_64")]
fn lanes(n: usize) -> __mmask16 {
    ((1u32 << n) - 1) as __mmask16
}

/// Inner-length block of the axpy form: the B rows of a block (16 KiB) and, for a transposed A,
/// the cache lines of A's columns that a row tile reads stay in L1 across the block, and a
/// block's rows of A in L2 across the row tiles (unblocked, dL = Xᵀ·U over 4,096 rows ran at
/// 45 GFLOP/s, re-reading X from memory for every row tile).
#[cfg(target_arch = "x86_64")]
const AXPY_KB: usize = 256;

/// Axpy form (see the module doc): the inner length in blocks of `AXPY_KB`, in each block tiles
/// of 12, then 4, then 1 rows, each row's sum carried from block to block in C.
///
/// # Safety
/// The CPU supports AVX-512 F (callers check with [`available`], as [`try_compute`] does);
/// `p` is in the axpy form (`b_cs == 1`, `2 ≤ n ≤ 16`) and every element of A (m × k),
/// B (k × n) and C (m × n) that its strides address lies in a live allocation, with C
/// overlapping neither A nor B.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpy(p: &Product) {
    for k0 in (0..p.k).step_by(AXPY_KB) {
        let k1 = (k0 + AXPY_KB).min(p.k);
        // The first block starts from 0 unless C is accumulated into; later ones from C.
        let from_c = p.accumulate || k0 > 0;
        let mut i = 0;
        // SAFETY (the tiles): rows i.., inner indices k0..k1 are inside the views.
        while p.m - i >= 12 {
            unsafe { axpy_tile::<12>(p, i, k0, k1, from_c) };
            i += 12;
        }
        while p.m - i >= 4 {
            // SAFETY: as above.
            unsafe { axpy_tile::<4>(p, i, k0, k1, from_c) };
            i += 4;
        }
        while i < p.m {
            // SAFETY: as above.
            unsafe { axpy_tile::<1>(p, i, k0, k1, from_c) };
            i += 1;
        }
    }
}

/// Rows i0..i0+R of C: acc_r (C's row, or 0) += A[i0 + r, l] · B[l, :] for l in k0..k1, one
/// FMA per l, then stored masked.
///
/// # Safety
/// The CPU supports AVX-512 F (checked by [`try_compute`] before [`axpy`] runs); `p` is as
/// [`axpy`] requires, `i0 + R ≤ m`, `k0 ≤ k1 ≤ k` and `n ≤ 16`, so that rows i0..i0+R of A
/// (inner indices k0..k1) and C (lanes 0..n) and rows k0..k1 of B are inside the views.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn axpy_tile<const R: usize>(p: &Product, i0: usize, k0: usize, k1: usize, from_c: bool) {
    let mask = lanes(p.n);
    // SAFETY: C rows i0..i0+R, lanes 0..n, are inside C.
    let c_rows: [*mut f32; R] =
        std::array::from_fn(|r| unsafe { p.c.offset((i0 + r) as isize * p.c_rs) });
    let mut acc: [__m512; R] = std::array::from_fn(|r| {
        if from_c {
            // SAFETY: lanes 0..n of C row i0 + r are inside C (see `c_rows`).
            unsafe { _mm512_maskz_loadu_ps(mask, c_rows[r]) }
        } else {
            _mm512_setzero_ps()
        }
    });
    // SAFETY: rows i0..i0+R of A are inside A.
    let a_rows: [*const f32; R] =
        std::array::from_fn(|r| unsafe { p.a.offset((i0 + r) as isize * p.a_rs) });
    for l in k0..k1 {
        // SAFETY (all loads here): B row l lanes 0..n and A[i0 + r, l] are inside the views.
        let b_row = unsafe { _mm512_maskz_loadu_ps(mask, p.b.offset(l as isize * p.b_rs)) };
        for r in 0..R {
            // SAFETY: as above (A[i0 + r, l]).
            let a_il = unsafe { _mm512_set1_ps(*a_rows[r].offset(l as isize * p.a_cs)) };
            acc[r] = _mm512_fmadd_ps(a_il, b_row, acc[r]);
        }
    }
    for r in 0..R {
        // SAFETY: lanes 0..n of C row i0 + r are inside C, which no view read here overlaps.
        unsafe { _mm512_mask_storeu_ps(c_rows[r], mask, acc[r]) };
    }
}

/// Inner-length block of the dot form: 4 rows of A and 5 columns of B over it (27 KiB) stay
/// in L1 while the row tile's column tiles run, instead of A being re-read from L2 for each.
#[cfg(target_arch = "x86_64")]
const DOT_KB: usize = 768;

/// Dot form (see the module doc): tiles of 4 (then 1) rows × 5 (or the remaining) columns,
/// the inner length in blocks of `DOT_KB` with the tile's 16-lane partial sums kept on the
/// stack between blocks.
///
/// # Safety
/// The CPU supports AVX-512 F (callers check with [`available`], as [`try_compute`] does);
/// `p` is in the dot form (`b_rs == 1`, `a_cs == 1`, `2 ≤ n ≤ 16`) and every element of
/// A (m × k), B (k × n) and C (m × n) that its strides address lies in a live allocation, with
/// C overlapping neither A nor B.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot(p: &Product) {
    let mut i = 0;
    while i < p.m {
        let rows = if p.m - i >= 4 { 4 } else { 1 };
        let mut partial = [[_mm512_setzero_ps(); MAX_N]; 4];
        for k0 in (0..p.k).step_by(DOT_KB) {
            let k1 = (k0 + DOT_KB).min(p.k);
            let mut j = 0;
            while j < p.n {
                let cols = (p.n - j).min(5);
                // SAFETY: rows i..i+rows, columns j..j+cols and inner indices k0..k1 are
                // inside the views.
                unsafe {
                    match (rows, cols) {
                        (4, 5) => dot_block::<4, 5>(p, i, j, k0, k1, &mut partial),
                        (4, 4) => dot_block::<4, 4>(p, i, j, k0, k1, &mut partial),
                        (4, 3) => dot_block::<4, 3>(p, i, j, k0, k1, &mut partial),
                        (4, 2) => dot_block::<4, 2>(p, i, j, k0, k1, &mut partial),
                        (4, _) => dot_block::<4, 1>(p, i, j, k0, k1, &mut partial),
                        (_, 5) => dot_block::<1, 5>(p, i, j, k0, k1, &mut partial),
                        (_, 4) => dot_block::<1, 4>(p, i, j, k0, k1, &mut partial),
                        (_, 3) => dot_block::<1, 3>(p, i, j, k0, k1, &mut partial),
                        (_, 2) => dot_block::<1, 2>(p, i, j, k0, k1, &mut partial),
                        _ => dot_block::<1, 1>(p, i, j, k0, k1, &mut partial),
                    }
                }
                j += cols;
            }
        }
        for (r, row) in partial.iter().take(rows).enumerate() {
            for (j, v) in row.iter().take(p.n).enumerate() {
                let sum = _mm512_reduce_add_ps(*v);
                // SAFETY: C[i + r, j] is inside C.
                let c = unsafe { &mut *p.c.offset((i + r) as isize * p.c_rs + j as isize) };
                *c = if p.accumulate { *c + sum } else { sum };
            }
        }
        i += rows;
    }
}

/// partial[r][j0 + s] += the 16-lane products of A row i0 + r and B column j0 + s over
/// l in k0..k1 (the last chunk of the inner length masked).
///
/// # Safety
/// The CPU supports AVX-512 F (checked by [`try_compute`] before [`dot`] runs); `p` is as
/// [`dot`] requires, `i0 + R ≤ min(m, 4)` rows from i0 exist, `j0 + S ≤ n ≤ 16` and
/// `k0 ≤ k1 ≤ k`, so that A rows i0..i0+R and B columns j0..j0+S over inner indices k0..k1
/// are inside the views.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn dot_block<const R: usize, const S: usize>(
    p: &Product,
    i0: usize,
    j0: usize,
    k0: usize,
    k1: usize,
    partial: &mut [[__m512; MAX_N]; 4],
) {
    let mut acc: [[__m512; S]; R] =
        std::array::from_fn(|r| std::array::from_fn(|s| partial[r][j0 + s]));
    // SAFETY: rows i0..i0+R of A and columns j0..j0+S of B are inside the views.
    let a_rows: [*const f32; R] =
        std::array::from_fn(|r| unsafe { p.a.offset((i0 + r) as isize * p.a_rs) });
    // SAFETY: as above.
    let b_cols: [*const f32; S] =
        std::array::from_fn(|s| unsafe { p.b.offset((j0 + s) as isize * p.b_cs) });
    let mut l = k0;
    while l < k1 {
        let mask = lanes((k1 - l).min(16));
        // SAFETY: lanes 0..(mask) of A row i0 + r and of B column j0 + s from l are inside
        // the views (l + lanes ≤ k1 ≤ k).
        let a: [__m512; R] =
            std::array::from_fn(|r| unsafe { _mm512_maskz_loadu_ps(mask, a_rows[r].add(l)) });
        // SAFETY: as above.
        let b: [__m512; S] =
            std::array::from_fn(|s| unsafe { _mm512_maskz_loadu_ps(mask, b_cols[s].add(l)) });
        for r in 0..R {
            for s in 0..S {
                acc[r][s] = _mm512_fmadd_ps(a[r], b[s], acc[r][s]);
            }
        }
        l += 16;
    }
    for r in 0..R {
        for s in 0..S {
            partial[r][j0 + s] = acc[r][s];
        }
    }
}
