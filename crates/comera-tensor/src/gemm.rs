//! The one GEMM entry point of the engine.
//!
//! Every contraction in comera ends up here as `C (m×n) = A (m×k) · B (k×n)` (optionally
//! `C += …`) over strided views of flat `f32` buffers, so a transpose is a view, never a copy.
//! The backend is `faer` (chosen by the benchmark in `tools/gemm-bench`: fastest on the big
//! tall-skinny products threaded, lowest per-call cost single-threaded, and allocation-free
//! single-threaded, which the `gemm` crate is not); no other
//! module talks to it. Views are bounds-checked when they are made, so the `unsafe` call below
//! only ever sees in-bounds pointers.

use crate::{narrow, outer_sum, wide};
use faer::{Accum, Par};

/// Products with at most this many multiply-adds skip the backend (its dispatch and packing
/// cost more than the arithmetic: TTM slab chains, per-id rows), except when B must be packed
/// for few rows of C (see `use_small`). Measured with the `small_product_timings` test and
/// `comera bench ttm`: every TTM shape is at or below it.
const SMALL_MACS: usize = 1 << 14;

/// The row-axpy form on an unpacked B with C at least `AXPY_WIDE_N` wide still beats the
/// backend up to this many multiply-adds (measured 0.8-0.9× its time at 32·32·32 … 32·256·16,
/// a tie at 64·64·64).
const AXPY_WIDE_MACS: usize = 1 << 17;

/// See `AXPY_WIDE_MACS`.
const AXPY_WIDE_N: usize = 16;

/// When B has to be packed (its rows not contiguous), the copy is amortised over the rows of
/// C; with fewer rows than this the backend wins (4·32·128 with B a transposed view: 2.8×).
const PACK_MIN_M: usize = 8;

/// Products with fewer multiply-adds than this run on one thread: below it, waking the pool
/// costs more than it saves (measured on the tiny TT core contractions).
const PARALLEL_MIN_MACS: usize = 1 << 18;

/// A read-only strided matrix view: element (i, j) is `data[i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    data: &'a [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

/// A mutable strided matrix view: element (i, j) is `data[i * rs + j * cs]`.
#[derive(Debug)]
pub struct MatMut<'a> {
    data: &'a mut [f32],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

fn check_extent(len: usize, rows: usize, cols: usize, rs: usize, cs: usize) {
    if rows > 0 && cols > 0 {
        let last = (rows - 1) * rs + (cols - 1) * cs;
        assert!(
            last < len,
            "matrix view {rows}x{cols} (strides {rs},{cs}) needs {} elements, buffer has {len}",
            last + 1
        );
    }
}

impl<'a> MatRef<'a> {
    /// Row-major `rows × cols` view of the first `rows * cols` elements of `data`.
    pub fn new(data: &'a [f32], rows: usize, cols: usize) -> Self {
        Self::strided(data, rows, cols, cols, 1)
    }

    /// General strided view; panics if any element would fall outside `data`.
    pub fn strided(data: &'a [f32], rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        check_extent(data.len(), rows, cols, rs, cs);
        MatRef {
            data,
            rows,
            cols,
            rs,
            cs,
        }
    }

    /// The transposed view (no copy).
    pub fn t(self) -> Self {
        MatRef {
            data: self.data,
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Rows `[a, b)` of this view (any strides; no copy).
    pub fn row_range(self, a: usize, b: usize) -> Self {
        assert!(
            a <= b && b <= self.rows,
            "rows {a}..{b} of a {}-row view",
            self.rows
        );
        if a == b {
            return MatRef { rows: 0, ..self };
        }
        MatRef::strided(
            &self.data[a * self.rs..],
            b - a,
            self.cols,
            self.rs,
            self.cs,
        )
    }
}

impl<'a> MatMut<'a> {
    /// Row-major `rows × cols` view of the first `rows * cols` elements of `data`.
    pub fn new(data: &'a mut [f32], rows: usize, cols: usize) -> Self {
        Self::strided(data, rows, cols, cols, 1)
    }

    /// General strided view; panics if any element would fall outside `data`.
    pub fn strided(data: &'a mut [f32], rows: usize, cols: usize, rs: usize, cs: usize) -> Self {
        check_extent(data.len(), rows, cols, rs, cs);
        MatMut {
            data,
            rows,
            cols,
            rs,
            cs,
        }
    }

    /// Rows `[0, at)` and `[at, rows)` as two views. A row's elements must lie before the next
    /// row's (row-major with any row stride, `(cols − 1)·cs < rs`): panics otherwise.
    pub fn split_rows(self, at: usize) -> (MatMut<'a>, MatMut<'a>) {
        let MatMut {
            data,
            rows,
            cols,
            rs,
            cs,
        } = self;
        assert!(at <= rows, "row {at} of a {rows}-row view");
        assert!(
            rows < 2 || cols == 0 || (cols - 1) * cs < rs,
            "split_rows needs rows that do not interleave (cols {cols}, strides {rs},{cs})"
        );
        let (first, second) = data.split_at_mut((at * rs).min(data.len()));
        (
            MatMut::strided(first, at, cols, rs, cs),
            MatMut::strided(second, rows - at, cols, rs, cs),
        )
    }
}

/// `C = A·B` (or `C +=`) with C's rows cut into blocks of `rows_per_piece` rows (the last may
/// be shorter) that run as rayon tasks, each on one thread ([`matmul_serial`]). The cut depends
/// on `rows_per_piece` alone, so the bits do not depend on the thread count. For few rows and
/// a short inner dimension, which the threaded backend splits poorly: 128 × 31 · 31 × 768 on
/// 2 Zen 4 cores took 44 µs threaded and 35 µs in four pieces of 32 rows (one thread: 58 µs).
/// C's rows must not interleave (see [`MatMut::split_rows`]).
pub fn matmul_row_pieces(
    c: MatMut<'_>,
    a: MatRef<'_>,
    b: MatRef<'_>,
    accumulate: bool,
    rows_per_piece: usize,
) {
    let per = rows_per_piece.max(1);
    if c.rows <= per {
        matmul_serial(c, a, b, accumulate);
        return;
    }
    // Half of the pieces (rounded down) on each side, so every cut falls on a piece boundary.
    let at = c.rows.div_ceil(per) / 2 * per;
    let (c0, c1) = c.split_rows(at);
    let (a0, a1) = (a.row_range(0, at), a.row_range(at, a.rows));
    crate::join(
        || matmul_row_pieces(c0, a0, b, accumulate, per),
        || matmul_row_pieces(c1, a1, b, accumulate, per),
    );
}

/// `C = A·B`, or `C += A·B` when `accumulate` is set. Shapes must agree (panics otherwise:
/// a shape mismatch here is an engine bug, user-facing shapes are checked at layer boundaries).
pub fn matmul(c: MatMut<'_>, a: MatRef<'_>, b: MatRef<'_>, accumulate: bool) {
    matmul_on(c, a, b, accumulate, true)
}

/// [`matmul`] on the calling thread only: for callers that already run independent products
/// in parallel (one per attention head), so that each product's bits do not depend on the
/// thread count.
pub fn matmul_serial(c: MatMut<'_>, a: MatRef<'_>, b: MatRef<'_>, accumulate: bool) {
    matmul_on(c, a, b, accumulate, false)
}

/// `C = A·B` (or `C += A·B` when `accumulate`) on the calling thread, for a C that the caller
/// writes once and does not read again soon (a layer's activations, far larger than the
/// caches): where the CPU has AVX-512 and the product is short and wide (inner length at most
/// 64, C at least 64 columns, C's and B's rows contiguous) it runs on the `wide` kernel, which
/// writes C with non-temporal stores when C's rows are 64-byte aligned (saving the read of
/// every line written, and the eviction of what the caller reads next); anything else is
/// [`matmul_serial`]. The bits depend on the shapes and the CPU, never on C's alignment;
/// accumulating gives, on the `wide` kernel, the bits of the product written apart and then
/// added (elsewhere [`matmul_serial`]'s own accumulation, equal within rounding).
///
/// `ahead` is memory the caller reads right after this product (at most two slices, e.g. the
/// next row block of a layer's input): the `wide` kernel prefetches its cache lines into L2,
/// a few per tile, so that they arrive while it computes instead of stalling the next
/// product. A hint only: it changes no value, and the other path ignores it.
pub fn matmul_serial_streamed(
    c: MatMut<'_>,
    a: MatRef<'_>,
    b: MatRef<'_>,
    accumulate: bool,
    ahead: &[&[f32]],
) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    if c.cs == 1 && b.cs == 1 && (c.rows, c.cols, b.rows) == (m, n, k) && wide::suits(m, n, k) {
        let product = wide::Product {
            m,
            n,
            k,
            a: a.data.as_ptr(),
            a_rs: a.rs as isize,
            a_cs: a.cs as isize,
            b: b.data.as_ptr(),
            b_rs: b.rs as isize,
            c: c.data.as_mut_ptr(),
            c_rs: c.rs as isize,
            accumulate,
            ahead: wide::Ahead::new(ahead),
        };
        // SAFETY: the views were bounds-checked at construction for their full extents (every
        // element they address for these shapes is inside its slice; the shapes agree, checked
        // above), and `c` is a unique borrow that aliases neither `a` nor `b`. `ahead` holds
        // live slices (prefetches never fault in any case).
        unsafe { wide::compute(&product) };
        return;
    }
    matmul_serial(c, a, b, accumulate);
}

fn matmul_on(c: MatMut<'_>, a: MatRef<'_>, b: MatRef<'_>, accumulate: bool, parallel: bool) {
    assert_eq!(
        a.cols, b.rows,
        "matmul inner dimensions differ: {}x{} · {}x{}",
        a.rows, a.cols, b.rows, b.cols
    );
    assert_eq!((c.rows, c.cols), (a.rows, b.cols), "matmul output shape");
    let (m, n, k) = (a.rows, b.cols, a.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    c.data[i * c.rs + j * c.cs] = 0.0;
                }
            }
        }
        return;
    }
    if use_small(&c, &a, &b) {
        small_matmul(c, a, b, accumulate);
    } else {
        backend(c, a, b, accumulate, parallel);
    }
}

/// A buffer that several threads fill at once, each writing only elements no other thread
/// reads or writes during the call (e.g. the columns of one attention head in a (B, T, D)
/// output). Writes go through a raw pointer, never through overlapping `&mut` slices.
#[derive(Clone, Copy, Debug)]
pub struct DisjointMut<'a> {
    ptr: *mut f32,
    len: usize,
    _borrow: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: a `DisjointMut` is a unique borrow of its buffer for 'a; the only way to write
// through it (`matmul_serial_into`) is `unsafe` and requires the caller to keep the elements
// each thread writes disjoint from those any other thread touches.
unsafe impl Send for DisjointMut<'_> {}
unsafe impl Sync for DisjointMut<'_> {}

impl<'a> DisjointMut<'a> {
    pub fn new(data: &'a mut [f32]) -> Self {
        DisjointMut {
            ptr: data.as_mut_ptr(),
            len: data.len(),
            _borrow: std::marker::PhantomData,
        }
    }

    /// `C = A·B` (or `C +=`) on the calling thread, C the strided `rows × cols` view starting
    /// at element `offset` (bounds-checked like [`MatMut::strided`]).
    ///
    /// # Safety
    /// While this runs, no other thread may read or write any element of that view.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul_serial_into(
        &self,
        offset: usize,
        (rows, cols, rs, cs): (usize, usize, usize, usize),
        a: MatRef<'_>,
        b: MatRef<'_>,
        accumulate: bool,
    ) {
        assert!(
            offset <= self.len,
            "DisjointMut offset {offset} > {}",
            self.len
        );
        check_extent(self.len - offset, rows, cols, rs, cs);
        assert_eq!(a.cols, b.rows, "matmul inner dimensions differ");
        assert_eq!((rows, cols), (a.rows, b.cols), "matmul output shape");
        if rows == 0 || cols == 0 {
            return;
        }
        let stride = |x: usize| x as isize;
        // SAFETY: the view is in bounds (checked above), `a` and `b` were bounds-checked when
        // made and are shared borrows of other buffers (a `DisjointMut` holds its buffer's
        // unique borrow), and the caller guarantees no other thread touches C's elements.
        let (lhs, rhs, dst) = unsafe {
            (
                faer::MatRef::<f32>::from_raw_parts(
                    a.data.as_ptr(),
                    a.rows,
                    a.cols,
                    stride(a.rs),
                    stride(a.cs),
                ),
                faer::MatRef::<f32>::from_raw_parts(
                    b.data.as_ptr(),
                    b.rows,
                    b.cols,
                    stride(b.rs),
                    stride(b.cs),
                ),
                faer::MatMut::<f32>::from_raw_parts_mut(
                    self.ptr.add(offset),
                    rows,
                    cols,
                    stride(rs),
                    stride(cs),
                ),
            )
        };
        let accum = if accumulate {
            Accum::Add
        } else {
            Accum::Replace
        };
        faer::linalg::matmul::matmul(dst, accum, lhs, rhs, 1.0f32, Par::Seq);
    }

    /// `f` on the elements `offset .. offset + len`, on the calling thread (bounds-checked).
    ///
    /// # Safety
    /// While `f` runs, no other thread may read or write any of those elements.
    pub unsafe fn with_range<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&mut [f32]) -> R,
    ) -> R {
        assert!(
            offset <= self.len && len <= self.len - offset,
            "DisjointMut: {len} elements at {offset} of {}",
            self.len
        );
        // SAFETY: in bounds (checked above), and the caller guarantees that no other thread
        // touches these elements while `f` runs (the slice does not outlive it).
        f(unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset), len) })
    }

    /// `C[offset + i] += x[i]` for every i of `x`, on the calling thread (bounds-checked).
    ///
    /// # Safety
    /// While this runs, no other thread may read or write any of those elements.
    pub unsafe fn add_at(&self, offset: usize, x: &[f32]) {
        assert!(
            offset <= self.len && x.len() <= self.len - offset,
            "DisjointMut: {} elements at {offset} of {}",
            x.len(),
            self.len
        );
        // SAFETY: in bounds (checked above), and the caller guarantees that no other thread
        // touches these elements; `x` is a shared borrow of another buffer.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset), x.len()) };
        for (d, &v) in dst.iter_mut().zip(x) {
            *d += v;
        }
    }
}

/// Whether the small kernels beat the backend on this product (per layout class, measured).
fn use_small(c: &MatMut<'_>, a: &MatRef<'_>, b: &MatRef<'_>) -> bool {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let macs = m * n * k;
    if macs > AXPY_WIDE_MACS {
        return false;
    }
    // The layout `small_matmul` will see: a column-major C is computed as Cᵀ = Bᵀ·Aᵀ.
    let (m, n, a, b) = if c.cs != 1 && c.rs == 1 {
        (n, m, b.t(), a.t())
    } else {
        (m, n, *a, *b)
    };
    if b.cs == 1 {
        // Row-axpy on B in place.
        macs <= SMALL_MACS || (n >= AXPY_WIDE_N && c.cs.min(c.rs) == 1)
    } else if n <= NARROW_N && a.rs == 1 && m >= 8 {
        macs <= SMALL_MACS // column form
    } else {
        macs <= SMALL_MACS && m >= PACK_MIN_M // B packed, then row-axpy
    }
}

/// `faer` on non-empty views of agreeing shapes, threaded above `PARALLEL_MIN_MACS`.
fn backend(mut c: MatMut<'_>, a: MatRef<'_>, b: MatRef<'_>, accumulate: bool, parallel: bool) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let threads = rayon::current_num_threads();
    let parts = if parallel && m * n * k >= PARALLEL_MIN_MACS {
        threads
    } else {
        1
    };
    if let Some(s) = outer_sum_form(&mut c, &a, &b, accumulate) {
        // SAFETY: the views were bounds-checked at construction for their full extents, `c`
        // is a unique borrow that aliases neither `a` nor `b` (shared borrows).
        unsafe { outer_sum::compute(s, parts) };
        return;
    }
    let stride = |x: usize| x as isize;
    // SAFETY: every view was bounds-checked at construction for its full extent (so every
    // element (i, j) with i < rows, j < cols lies inside its slice), `c` is a unique borrow and
    // does not alias `a` or `b` (they are shared borrows), and the dimensions passed are the
    // views' own (checked to agree by `matmul`).
    let (lhs, rhs, dst) = unsafe {
        (
            faer::MatRef::<f32>::from_raw_parts(a.data.as_ptr(), m, k, stride(a.rs), stride(a.cs)),
            faer::MatRef::<f32>::from_raw_parts(b.data.as_ptr(), k, n, stride(b.rs), stride(b.cs)),
            faer::MatMut::<f32>::from_raw_parts_mut(
                c.data.as_mut_ptr(),
                m,
                n,
                stride(c.rs),
                stride(c.cs),
            ),
        )
    };
    split_matmul(
        dst,
        lhs,
        rhs,
        if accumulate {
            Accum::Add
        } else {
            Accum::Replace
        },
        parts,
    );
}

/// The product as a sum of outer products (`outer_sum`), if it is one those kernels take:
/// A a transposed view and B rows contiguous (C = Pᵀ·Q with P = Aᵀ and Q = B, both K × ·
/// row-major, summed over the long inner length K), with A's or B's side narrow and stored
/// densely (K × r, as the batch's activations are; a narrow side that is itself a strided
/// view of something wider would have each row tile re-read its lines from afar). With B the
/// narrow side, Cᵀ = Bᵀ·A is computed instead (C written through swapped strides).
fn outer_sum_form(
    c: &mut MatMut<'_>,
    a: &MatRef<'_>,
    b: &MatRef<'_>,
    accumulate: bool,
) -> Option<outer_sum::OuterSum> {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    if a.rs != 1 || b.cs != 1 {
        return None;
    }
    let (p, q) = (a.data.as_ptr(), b.data.as_ptr());
    let c_ptr = c.data.as_mut_ptr();
    if outer_sum::suits(k, m, n) && a.cs == m {
        Some(outer_sum::OuterSum {
            k,
            r: m,
            w: n,
            p,
            p_rs: a.cs,
            q,
            q_rs: b.rs,
            c: c_ptr,
            c_rs: c.rs,
            c_cs: c.cs,
            accumulate,
        })
    } else if outer_sum::suits(k, n, m) && b.rs == n {
        Some(outer_sum::OuterSum {
            k,
            r: n,
            w: m,
            p: q,
            p_rs: b.rs,
            q: p,
            q_rs: a.cs,
            c: c_ptr,
            c_rs: c.cs,
            c_cs: c.rs,
            accumulate,
        })
    } else {
        None
    }
}

/// Splits C into `parts` blocks (halving its longer side) run with `rayon::join`, each a
/// single-threaded `faer` product over the full inner dimension. Unlike `faer`'s own threading
/// this allocates nothing (the joins live on the stack), and every element of C is still
/// computed by exactly one call, so a given thread count always gives the same bits.
fn split_matmul(
    dst: faer::MatMut<'_, f32>,
    lhs: faer::MatRef<'_, f32>,
    rhs: faer::MatRef<'_, f32>,
    accum: Accum,
    parts: usize,
) {
    let (m, n) = (dst.nrows(), dst.ncols());
    if parts <= 1 || (m < 2 && n < 2) {
        serial_product(dst, accum, lhs, rhs);
        return;
    }
    let left = parts / 2;
    if m >= n {
        let at = m * left / parts;
        let (d1, d2) = dst.split_at_row_mut(at);
        let (l1, l2) = lhs.split_at_row(at);
        crate::join(
            || split_matmul(d1, l1, rhs, accum, left),
            || split_matmul(d2, l2, rhs, accum, parts - left),
        );
    } else {
        let at = n * left / parts;
        let (d1, d2) = dst.split_at_col_mut(at);
        let (r1, r2) = rhs.split_at_col(at);
        crate::join(
            || split_matmul(d1, lhs, r1, accum, left),
            || split_matmul(d2, lhs, r2, accum, parts - left),
        );
    }
}

/// One single-threaded product, C = A·B or C += A·B: the `narrow` kernels for a row-major C at
/// most 16 columns wide (where `faer`'s tile is FMA-latency bound), `faer` otherwise.
fn serial_product(
    mut dst: faer::MatMut<'_, f32>,
    accum: Accum,
    lhs: faer::MatRef<'_, f32>,
    rhs: faer::MatRef<'_, f32>,
) {
    if dst.col_stride() == 1 {
        let product = narrow::Product {
            m: dst.nrows(),
            n: dst.ncols(),
            k: lhs.ncols(),
            a: lhs.as_ptr(),
            a_rs: lhs.row_stride(),
            a_cs: lhs.col_stride(),
            b: rhs.as_ptr(),
            b_rs: rhs.row_stride(),
            b_cs: rhs.col_stride(),
            c: dst.as_mut().as_ptr_mut(),
            c_rs: dst.row_stride(),
            accumulate: matches!(accum, Accum::Add),
        };
        // SAFETY: the three views come from bounds-checked `MatRef`/`MatMut`s (see `backend`),
        // so every element their strides address for these shapes is in bounds, and C is a
        // unique borrow that does not alias A or B.
        if unsafe { narrow::try_compute(&product) } {
            return;
        }
    }
    faer::linalg::matmul::matmul(dst, accum, lhs, rhs, 1.0f32, Par::Seq);
}

// ---------------------------------------------------------------------------------------------
// Small products.
//
// For tiny products the backend's dispatch and packing dominate, so (as `use_small`
// decides) they run on the kernels below instead. Every layout is brought to one of two forms
// with C rows contiguous (a column-major C is handled as Cᵀ = Bᵀ·Aᵀ, any other C through a
// row-major scratch):
// - column: `C[i.., j] += A[i.., l] · B[l, j]` when C is narrow (n ≤ `NARROW_N`) and A is a
//   transposed view (columns contiguous), over tiles of 16, 8 or 4 rows × 4 columns;
// - row-axpy: `C[i, :] += A[i, l] · B[l, :]` otherwise, B packed row-major first when its rows
//   are not contiguous, over tiles of up to 4 rows × 16 columns of C held in registers, so each
//   B row chunk is loaded once per 4 rows.
// All indexing is on slices sized before the inner loops (no per-element bounds checks in
// them). On x86-64 the kernels are compiled a second time with AVX2 + FMA enabled and picked
// at run time; the results differ from the portable build only by FMA rounding.

/// A multiply-add: fused (one rounding) where the target has FMA, `a * b + c` otherwise
/// (`f32::mul_add` without hardware FMA is a slow library call).
trait MulAdd {
    fn mul_add(a: f32, b: f32, c: f32) -> f32;
}

struct Plain;

impl MulAdd for Plain {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

#[cfg(target_arch = "x86_64")]
struct Fused;

#[cfg(target_arch = "x86_64")]
impl MulAdd for Fused {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// C with at most this many columns and A a transposed view (columns contiguous) takes the
/// column form: the row-axpy form's row chunks would be shorter than a vector.
const NARROW_N: usize = 8;

thread_local! {
    /// Scratch for a packed B and for a strided C (at most `SMALL_MACS` floats each: larger
    /// products with those layouts go to the backend).
    static SCRATCH: std::cell::RefCell<(Vec<f32>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// The operands of a small product with C rows contiguous: `c[i * crs + j]`.
struct Small<'s> {
    c: &'s mut [f32],
    crs: usize,
    a: MatRef<'s>,
    b: MatRef<'s>,
    accumulate: bool,
}

fn small_matmul(c: MatMut<'_>, a: MatRef<'_>, b: MatRef<'_>, accumulate: bool) {
    if c.cs == 1 {
        small_dispatch(Small {
            c: c.data,
            crs: c.rs,
            a,
            b,
            accumulate,
        });
    } else if c.rs == 1 {
        // Cᵀ (row-major with row stride c.cs) = Bᵀ·Aᵀ.
        small_dispatch(Small {
            c: c.data,
            crs: c.cs,
            a: b.t(),
            b: a.t(),
            accumulate,
        });
    } else {
        // Neither rows nor columns contiguous: compute into a row-major scratch.
        let (m, n) = (c.rows, c.cols);
        let mut tmp = SCRATCH.with(|s| std::mem::take(&mut s.borrow_mut().1));
        tmp.clear();
        tmp.resize(m * n, 0.0);
        if accumulate {
            for (i, row) in tmp.chunks_exact_mut(n).enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = c.data[i * c.rs + j * c.cs];
                }
            }
        }
        small_dispatch(Small {
            c: &mut tmp,
            crs: n,
            a,
            b,
            accumulate,
        });
        for (i, row) in tmp.chunks_exact(n).enumerate() {
            for (j, &v) in row.iter().enumerate() {
                c.data[i * c.rs + j * c.cs] = v;
            }
        }
        SCRATCH.with(|s| s.borrow_mut().1 = tmp);
    }
}

#[cfg(test)]
thread_local! {
    /// Tests set this to run the portable kernels on a machine with AVX2 + FMA.
    static FORCE_PORTABLE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn small_dispatch(p: Small<'_>) {
    #[cfg(test)]
    if FORCE_PORTABLE.with(|f| f.get()) {
        small_kernels::<Plain>(p);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU supports AVX2 and FMA (checked just above), the only
            // requirement of calling a function compiled with those features enabled.
            unsafe { small_avx2_fma(p) };
            return;
        }
    }
    small_kernels::<Plain>(p);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn small_avx2_fma(p: Small<'_>) {
    small_kernels::<Fused>(p);
}

#[inline(always)]
fn small_kernels<M: MulAdd>(p: Small<'_>) {
    let (a, b) = (p.a, p.b);
    let (m, n, k) = (a.rows, b.cols, a.cols);
    if n <= NARROW_N && a.rs == 1 && m >= 8 {
        column_form::<M>(p);
    } else if b.cs == 1 {
        axpy_form::<M>(p.c, p.crs, a, b.data, b.rs, n, p.accumulate);
    } else {
        // Pack B row-major (k × n), reading it along its contiguous axis when it has one.
        let mut bp = SCRATCH.with(|s| std::mem::take(&mut s.borrow_mut().0));
        bp.clear();
        bp.resize(k * n, 0.0);
        if b.rs == 1 {
            for j in 0..n {
                let col = &b.data[j * b.cs..][..k];
                for (l, &v) in col.iter().enumerate() {
                    bp[l * n + j] = v;
                }
            }
        } else {
            for (l, row) in bp.chunks_exact_mut(n).enumerate() {
                for (j, v) in row.iter_mut().enumerate() {
                    *v = b.data[l * b.rs + j * b.cs];
                }
            }
        }
        axpy_form::<M>(p.c, p.crs, a, &bp, n, n, p.accumulate);
        SCRATCH.with(|s| s.borrow_mut().0 = bp);
    }
}

/// `C (+)= A·B` for narrow C (n < `NARROW_N`) with A columns contiguous (a transposed view):
/// `C[i.., j] += A[i.., l] · B[l, j]`, vectorised over 16, 8 or 4 rows of C.
#[inline(always)]
fn column_form<M: MulAdd>(p: Small<'_>) {
    let (a, b) = (p.a, p.b);
    let m = a.rows;
    let mut i = 0;
    while i + 16 <= m {
        column_rows::<M, 16>(p.c, p.crs, a, b, i, p.accumulate);
        i += 16;
    }
    if i + 8 <= m {
        column_rows::<M, 8>(p.c, p.crs, a, b, i, p.accumulate);
        i += 8;
    }
    if i + 4 <= m {
        column_rows::<M, 4>(p.c, p.crs, a, b, i, p.accumulate);
        i += 4;
    }
    while i < m {
        column_rows::<M, 1>(p.c, p.crs, a, b, i, p.accumulate);
        i += 1;
    }
}

/// Rows `i0..i0 + H` of a narrow C, in groups of up to 4 columns.
#[inline(always)]
fn column_rows<M: MulAdd, const H: usize>(
    c: &mut [f32],
    crs: usize,
    a: MatRef<'_>,
    b: MatRef<'_>,
    i0: usize,
    accumulate: bool,
) {
    let n = b.cols;
    let c = &mut c[i0 * crs..];
    let (acs, a) = (a.cs, &a.data[i0..]);
    let mut j = 0;
    while j + 4 <= n {
        column_tile::<M, H, 4>(c, crs, a, acs, b, j, accumulate);
        j += 4;
    }
    if j + 2 <= n {
        column_tile::<M, H, 2>(c, crs, a, acs, b, j, accumulate);
        j += 2;
    }
    if j < n {
        column_tile::<M, H, 1>(c, crs, a, acs, b, j, accumulate);
    }
}

/// `C[0..H, j0..j0 + Q] (+)= A[0..H, :] · B[:, j0..j0 + Q]`, column l of A's H rows at
/// `a[l * acs..][..H]`; the tile is held in registers and written back strided once.
#[inline(always)]
fn column_tile<M: MulAdd, const H: usize, const Q: usize>(
    c: &mut [f32],
    crs: usize,
    a: &[f32],
    acs: usize,
    b: MatRef<'_>,
    j0: usize,
    accumulate: bool,
) {
    let mut acc = [[0.0f32; H]; Q];
    let bd = &b.data[j0 * b.cs..];
    for l in 0..b.rows {
        let av: &[f32; H] = a[l * acs..][..H].try_into().expect("H elements");
        let bl = &bd[l * b.rs..];
        let mut ys = [0.0f32; Q];
        for (q, y) in ys.iter_mut().enumerate() {
            *y = bl[q * b.cs];
        }
        for q in 0..Q {
            for t in 0..H {
                acc[q][t] = M::mul_add(av[t], ys[q], acc[q][t]);
            }
        }
    }
    // Transpose the tile through memory: C rows are contiguous, the tile's vectors are not.
    // `black_box` makes that explicit; without it LLVM scalarises the accumulators for the
    // strided write-back and the whole loop runs on scalars (5-20x slower, measured).
    let acc = std::hint::black_box(acc);
    for t in 0..H {
        let row = &mut c[t * crs + j0..][..Q];
        for (q, v) in row.iter_mut().enumerate() {
            *v = if accumulate {
                *v + acc[q][t]
            } else {
                acc[q][t]
            };
        }
    }
}

/// `C (+)= A·B` with B rows contiguous (`b[l * brs + j]`, n columns) and C rows contiguous.
#[inline(always)]
fn axpy_form<M: MulAdd>(
    c: &mut [f32],
    crs: usize,
    a: MatRef<'_>,
    b: &[f32],
    brs: usize,
    n: usize,
    accumulate: bool,
) {
    let m = a.rows;
    let mut i = 0;
    while i + 4 <= m {
        axpy_rows::<M, 4>(c, crs, a, i, b, brs, n, accumulate);
        i += 4;
    }
    if i + 2 <= m {
        axpy_rows::<M, 2>(c, crs, a, i, b, brs, n, accumulate);
        i += 2;
    }
    if i < m {
        axpy_rows::<M, 1>(c, crs, a, i, b, brs, n, accumulate);
    }
}

/// Rows `i0..i0 + R` of A, read as k groups of R values (`get(l)[r] = A[i0 + r, l]`).
trait APanel<const R: usize> {
    fn get(&self, l: usize) -> [f32; R];
}

/// A transposed view (columns contiguous): group l is one slice.
struct AColumns<'s> {
    data: &'s [f32],
    cs: usize,
}

impl<const R: usize> APanel<R> for AColumns<'_> {
    #[inline(always)]
    fn get(&self, l: usize) -> [f32; R] {
        *<&[f32; R]>::try_from(&self.data[l * self.cs..][..R]).expect("R elements")
    }
}

/// A with rows contiguous: R row slices of length k.
struct ARows<'s, const R: usize> {
    rows: [&'s [f32]; R],
}

impl<const R: usize> APanel<R> for ARows<'_, R> {
    #[inline(always)]
    fn get(&self, l: usize) -> [f32; R] {
        std::array::from_fn(|r| self.rows[r][l])
    }
}

/// Any other A: element by element.
struct AStrided<'s> {
    data: &'s [f32],
    rs: usize,
    cs: usize,
}

impl<const R: usize> APanel<R> for AStrided<'_> {
    #[inline(always)]
    fn get(&self, l: usize) -> [f32; R] {
        std::array::from_fn(|r| self.data[r * self.rs + l * self.cs])
    }
}

/// Rows `i0..i0 + R` of C, in column chunks of 16, 8, 4, then single columns.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn axpy_rows<M: MulAdd, const R: usize>(
    c: &mut [f32],
    crs: usize,
    a: MatRef<'_>,
    i0: usize,
    b: &[f32],
    brs: usize,
    n: usize,
    accumulate: bool,
) {
    let k = a.cols;
    if a.rs == 1 {
        let p = AColumns {
            data: &a.data[i0..],
            cs: a.cs,
        };
        axpy_chunks::<M, R, _>(c, crs, &p, k, i0, b, brs, n, accumulate);
    } else if a.cs == 1 {
        let p = ARows::<R> {
            rows: std::array::from_fn(|r| &a.data[(i0 + r) * a.rs..][..k]),
        };
        axpy_chunks::<M, R, _>(c, crs, &p, k, i0, b, brs, n, accumulate);
    } else {
        let p = AStrided {
            data: &a.data[i0 * a.rs..],
            rs: a.rs,
            cs: a.cs,
        };
        axpy_chunks::<M, R, _>(c, crs, &p, k, i0, b, brs, n, accumulate);
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn axpy_chunks<M: MulAdd, const R: usize, P: APanel<R>>(
    c: &mut [f32],
    crs: usize,
    panel: &P,
    k: usize,
    i0: usize,
    b: &[f32],
    brs: usize,
    n: usize,
    accumulate: bool,
) {
    let c = &mut c[i0 * crs..];
    let mut j = 0;
    while j + 16 <= n {
        axpy_tile::<M, R, 16, P>(c, crs, panel, k, j, b, brs, accumulate);
        j += 16;
    }
    if j + 8 <= n {
        axpy_tile::<M, R, 8, P>(c, crs, panel, k, j, b, brs, accumulate);
        j += 8;
    }
    if j + 4 <= n {
        axpy_tile::<M, R, 4, P>(c, crs, panel, k, j, b, brs, accumulate);
        j += 4;
    }
    while j < n {
        axpy_tile::<M, R, 1, P>(c, crs, panel, k, j, b, brs, accumulate);
        j += 1;
    }
}

/// `C[0..R, j0..j0 + W] (+)= A_panel · B[.., j0..j0 + W]`, the tile held in registers.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn axpy_tile<M: MulAdd, const R: usize, const W: usize, P: APanel<R>>(
    c: &mut [f32],
    crs: usize,
    panel: &P,
    k: usize,
    j0: usize,
    b: &[f32],
    brs: usize,
    accumulate: bool,
) {
    let mut acc = [[0.0f32; W]; R];
    if accumulate {
        for (r, row) in acc.iter_mut().enumerate() {
            row.copy_from_slice(&c[r * crs + j0..][..W]);
        }
    }
    let b = &b[j0..];
    for l in 0..k {
        let bv: &[f32; W] = b[l * brs..][..W].try_into().expect("W elements");
        let av = panel.get(l);
        for r in 0..R {
            for t in 0..W {
                acc[r][t] = M::mul_add(av[r], bv[t], acc[r][t]);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        c[r * crs + j0..][..W].copy_from_slice(row);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|l| a[i * k + l] * b[l * n + j]).sum();
            }
        }
        c
    }

    #[test]
    fn matches_naive_with_transposed_views_and_accumulation() {
        let (m, k, n) = (7, 5, 3);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.71).cos()).collect();
        let want = naive(&a, &b, m, k, n);
        let mut c = vec![0.0; m * n];
        matmul(
            MatMut::new(&mut c, m, n),
            MatRef::new(&a, m, k),
            MatRef::new(&b, k, n),
            false,
        );
        for (x, y) in c.iter().zip(&want) {
            assert!((x - y).abs() < 1e-5);
        }
        // (Bᵀ·Aᵀ)ᵀ = A·B: compute Cᵀ into a transposed destination and accumulate once more.
        let mut ct = vec![0.0; n * m];
        let at = MatRef::new(&a, m, k).t();
        let bt = MatRef::new(&b, k, n).t();
        matmul(MatMut::new(&mut ct, n, m), bt, at, false);
        matmul(MatMut::new(&mut ct, n, m), bt, at, true);
        for i in 0..m {
            for j in 0..n {
                assert!((ct[j * m + i] - 2.0 * want[i * n + j]).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn large_products_match_naive_too() {
        let (m, k, n) = (70, 40, 50);
        let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.013).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.029).cos()).collect();
        let want = naive(&a, &b, m, k, n);
        let mut c = vec![0.0; m * n];
        matmul(
            MatMut::new(&mut c, m, n),
            MatRef::new(&a, m, k),
            MatRef::new(&b, k, n),
            false,
        );
        for (x, y) in c.iter().zip(&want) {
            assert!((x - y).abs() < 1e-4);
        }
    }

    /// Gradient-shaped products (C = Pᵀ·Q summed over a long K, `outer_sum`) in both
    /// orientations (dR = T1ᵀ·dY with P narrow; dL = Xᵀ·U1 with Q narrow, written through
    /// swapped strides), with row tiles short of 6, a strip short of 16 columns, K not a
    /// multiple of the block, and accumulation: against f64 sums, and bit-identical on 1 and
    /// 2 threads.
    #[test]
    fn outer_sums_match_f64_and_do_not_depend_on_threads() {
        for &(k, r, w) in &[
            (300, 30, 263),
            (257, 1, 256),
            (512, 7, 300),
            (260, 32, 400),
            (300, 40, 270),
        ] {
            let p: Vec<f32> = (0..k * r).map(|i| (i as f32 * 0.37).sin()).collect();
            let q: Vec<f32> = (0..k * w).map(|i| (i as f32 * 0.11).cos()).collect();
            assert!(outer_sum::suits(k, r, w) || !outer_sum::available());
            // want[i][j] = Σ_k P[k, i] · Q[k, j]
            let want: Vec<f64> = (0..r * w)
                .map(|e| {
                    let (i, j) = (e / w, e % w);
                    (0..k)
                        .map(|l| p[l * r + i] as f64 * q[l * w + j] as f64)
                        .sum()
                })
                .collect();
            let close = |got: f32, want: f64, what: &str| {
                assert!(
                    (got as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "{what}: {got} vs {want} ({k}×{r}×{w})"
                );
            };
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    // C = Pᵀ·Q (r × w), then accumulated once more.
                    let mut c = vec![0.0; r * w];
                    let (pt, qm) = (MatRef::new(&p, k, r).t(), MatRef::new(&q, k, w));
                    matmul(MatMut::new(&mut c, r, w), pt, qm, false);
                    let once = c.clone();
                    matmul(MatMut::new(&mut c, r, w), pt, qm, true);
                    // Cᵀ = Qᵀ·P (w × r, the narrow side is B's).
                    let mut ct = vec![0.0; w * r];
                    matmul(
                        MatMut::new(&mut ct, w, r),
                        qm.t(),
                        MatRef::new(&p, k, r),
                        false,
                    );
                    (once, c, ct)
                })
            };
            let (once, twice, ct) = run(2);
            for i in 0..r {
                for j in 0..w {
                    close(once[i * w + j], want[i * w + j], "Pᵀ·Q");
                    close(twice[i * w + j], 2.0 * want[i * w + j], "+= Pᵀ·Q");
                    close(ct[j * r + i], want[i * w + j], "Qᵀ·P");
                }
            }
            assert_eq!(
                (once, twice, ct),
                run(1),
                "bits differ between 1 and 2 threads"
            );
        }
    }

    /// Storage layouts of a logical r × c matrix in the tests.
    #[derive(Clone, Copy, Debug)]
    enum Lay {
        Row,
        RowPad,
        Col,
        ColPad,
        Strided,
    }

    const LAYS: [Lay; 5] = [Lay::Row, Lay::RowPad, Lay::Col, Lay::ColPad, Lay::Strided];

    /// (buffer length, rs, cs) of a layout.
    fn geometry(lay: Lay, r: usize, c: usize) -> (usize, usize, usize) {
        let (rs, cs) = match lay {
            Lay::Row => (c, 1),
            Lay::RowPad => (c + 3, 1),
            Lay::Col => (1, r),
            Lay::ColPad => (1, r + 2),
            Lay::Strided => (2 * c + 3, 2),
        };
        let len = if r == 0 || c == 0 {
            0
        } else {
            (r - 1) * rs + (c - 1) * cs + 1
        };
        (len, rs, cs)
    }

    /// A buffer holding `f(i, j)` at the layout's positions and `pad` everywhere else.
    fn fill(lay: Lay, r: usize, c: usize, pad: f32, f: impl Fn(usize, usize) -> f32) -> Store {
        let (len, rs, cs) = geometry(lay, r, c);
        let mut data = vec![pad; len];
        for i in 0..r {
            for j in 0..c {
                data[i * rs + j * cs] = f(i, j);
            }
        }
        Store { data, rs, cs, r, c }
    }

    struct Store {
        data: Vec<f32>,
        rs: usize,
        cs: usize,
        r: usize,
        c: usize,
    }

    impl Store {
        fn view(&self) -> MatRef<'_> {
            MatRef::strided(&self.data, self.r, self.c, self.rs, self.cs)
        }
        fn view_mut(&mut self) -> MatMut<'_> {
            MatMut::strided(&mut self.data, self.r, self.c, self.rs, self.cs)
        }
        fn at(&self, i: usize, j: usize) -> f32 {
            self.data[i * self.rs + j * self.cs]
        }
    }

    /// Checks `matmul` on every layout combination of A, B and C against an f64 reference;
    /// padding is NaN in every buffer (so a read of it poisons the result and a write to it
    /// shows), and so is C's content when it must be overwritten.
    fn check_all_layouts(m: usize, n: usize, k: usize) {
        let fa = |i: usize, l: usize| ((i * 7 + l * 3) as f32 * 0.37).sin();
        let fb = |l: usize, j: usize| ((l * 5 + j * 11) as f32 * 0.71).cos();
        let fc = |i: usize, j: usize| ((i * 13 + j) as f32 * 0.19).sin();
        for la in LAYS {
            let a = fill(la, m, k, f32::NAN, fa);
            for lb in LAYS {
                let b = fill(lb, k, n, f32::NAN, fb);
                for lc in LAYS {
                    for accumulate in [false, true] {
                        let init =
                            |i: usize, j: usize| if accumulate { fc(i, j) } else { f32::NAN };
                        let mut c = fill(lc, m, n, f32::NAN, init);
                        matmul(c.view_mut(), a.view(), b.view(), accumulate);
                        let mut touched = vec![false; c.data.len()];
                        for i in 0..m {
                            for j in 0..n {
                                touched[i * c.rs + j * c.cs] = true;
                                let (mut want, mut scale) = (0.0f64, 0.0f64);
                                if accumulate {
                                    want = fc(i, j) as f64;
                                    scale = want.abs();
                                }
                                for l in 0..k {
                                    let t = fa(i, l) as f64 * fb(l, j) as f64;
                                    want += t;
                                    scale += t.abs();
                                }
                                let got = c.at(i, j) as f64;
                                assert!(
                                    (got - want).abs() <= 1e-5 * scale + 1e-6,
                                    "{m}x{n}x{k} A {la:?} B {lb:?} C {lc:?} acc {accumulate}: \
                                     C[{i},{j}] = {got}, want {want}"
                                );
                            }
                        }
                        for (v, t) in c.data.iter().zip(&touched) {
                            assert!(
                                *t || v.is_nan(),
                                "{m}x{n}x{k} A {la:?} B {lb:?} C {lc:?}: padding written"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn tiny_shapes_on_every_layout() {
        // Both builds of the kernels: the run-time pick (AVX2 + FMA where available) and the
        // portable one.
        for portable in [false, true] {
            FORCE_PORTABLE.with(|f| f.set(portable));
            for m in [1, 2, 3, 4, 5, 7, 9, 16, 21] {
                for n in [1, 3, 4, 5, 8, 9, 17] {
                    for k in [0, 1, 2, 7, 8, 9, 16, 17] {
                        check_all_layouts(m, n, k);
                    }
                }
            }
        }
        FORCE_PORTABLE.with(|f| f.set(false));
    }

    #[test]
    fn shapes_around_the_thresholds_on_every_layout() {
        // The engine's own shapes, kernel edges (16-column chunks, 4/16-row blocks, narrow C,
        // PACK_MIN_M rows), and the SMALL_MACS / AXPY_WIDE_MACS / PARALLEL_MIN_MACS boundaries.
        let shapes = [
            (4, 16, 32),
            (4, 128, 32),
            (128, 4, 32),
            (32, 128, 4),
            (4, 32, 128),
            (16, 32, 4),
            (128, 6, 32),
            (8, 240, 30),
            (1, 30, 240),
            (30, 12, 64),
            (33, 31, 15),
            (5, 47, 16),
            (6, 2, 23),
            (3, 5, 300),
            (16, 32, 32), // = SMALL_MACS
            (16, 32, 33), // just above
            (17, 31, 31), // just below
            (8, 8, 8),
            (7, 8, 8),
            (40, 8, 9),
            (17, 7, 3),
            (32, 64, 64), // = AXPY_WIDE_MACS
            (32, 64, 65), // just above
            (64, 64, 64), // = PARALLEL_MIN_MACS
            (63, 64, 64), // just below
            // `narrow` kernels: the engine's dL = Xᵀ·U at rank 15, row tiles 12/4/1 and
            // column tiles 5..1 with remainders, inner lengths across `DOT_KB` = 768 with a
            // masked last chunk, widths 2 and 16, and just outside them.
            (768, 15, 128),
            (37, 15, 768),
            (9, 16, 1601),
            (13, 2, 33),
            (12, 16, 47),
            (5, 3, 32),
            (29, 7, 31),
            (17, 1, 64),
        ];
        assert_eq!(16 * 32 * 32, SMALL_MACS);
        assert_eq!(32 * 64 * 64, AXPY_WIDE_MACS);
        assert_eq!(64 * 64 * 64, PARALLEL_MIN_MACS);
        for (m, n, k) in shapes {
            check_all_layouts(m, n, k);
        }
    }

    /// Micro-benchmark of the small range: `cargo test --release -p comera-tensor --
    /// --ignored --nocapture small_product_timings`. Prints ns per call of `matmul` and of
    /// the `gemm` crate on the engine's tiny shapes (layouts R = rows contiguous,
    /// C = transposed view).
    #[test]
    #[ignore]
    fn small_product_timings() {
        let shapes: &[(usize, usize, usize, char, char, bool)] = &[
            (16, 4, 32, 'R', 'R', false),
            (4, 128, 32, 'R', 'R', false),
            (16, 32, 4, 'R', 'C', false),
            (32, 4, 16, 'C', 'R', true),
            (32, 128, 4, 'C', 'R', true),
            (4, 32, 128, 'R', 'C', false),
            (4, 16, 32, 'R', 'R', false),
            (4, 32, 16, 'R', 'C', true),
            (32, 16, 4, 'C', 'R', true),
            (32, 4, 128, 'C', 'R', false),
            (128, 32, 4, 'R', 'C', true),
            (128, 4, 32, 'R', 'R', false),
            (128, 6, 32, 'R', 'R', false),
            (16, 32, 256, 'R', 'C', false),
            (32, 256, 16, 'C', 'R', true),
            (128, 32, 6, 'R', 'C', false),
            (32, 6, 128, 'C', 'R', true),
            (16, 256, 32, 'R', 'R', false),
            (16, 32, 48, 'R', 'C', true),
            (32, 48, 16, 'C', 'R', true),
            (8, 240, 30, 'R', 'R', false),
            (8, 240, 30, 'R', 'C', false),
            (1, 240, 30, 'R', 'C', false),
            (1, 30, 240, 'R', 'R', false),
            (8, 30, 240, 'R', 'C', false),
            (64, 30, 12, 'R', 'C', false),
            (240, 30, 8, 'C', 'R', false),
            (30, 240, 8, 'C', 'R', false),
            (30, 12, 64, 'C', 'R', false),
            (32, 32, 32, 'R', 'R', false),
            (32, 32, 32, 'R', 'C', false),
            (32, 32, 32, 'C', 'R', false),
            (64, 32, 32, 'R', 'R', false),
            (64, 32, 32, 'R', 'C', false),
            (64, 32, 32, 'C', 'R', false),
            (30, 240, 12, 'C', 'R', false),
            (240, 30, 12, 'R', 'C', false),
            (64, 64, 64, 'R', 'R', false),
        ];
        let time = |f: &mut dyn FnMut()| {
            let mut best = f64::MAX;
            for _ in 0..7 {
                let reps: usize =
                    std::env::var("SMALL_REPS").map_or(2000, |r| r.parse().expect("SMALL_REPS"));
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    f();
                }
                best = best.min(t.elapsed().as_secs_f64() * 1e9 / reps as f64);
            }
            best
        };
        println!(
            "{:>5} {:>5} {:>5} A B acc   matmul_ns  small_ns   gemm_ns small/gemm",
            "m", "n", "k"
        );
        // SMALL_SHAPE=m,n,k limits the run to one shape (for profiling).
        let only = std::env::var("SMALL_SHAPE").ok();
        for &(m, n, k, la, lb, acc) in shapes {
            if only.as_ref().is_some_and(|o| *o != format!("{m},{n},{k}")) {
                continue;
            }
            let lay = |c: char| if c == 'R' { Lay::Row } else { Lay::Col };
            let a = fill(lay(la), m, k, 0.0, |i, l| ((i + 2 * l) as f32).sin());
            let b = fill(lay(lb), k, n, 0.0, |l, j| ((3 * l + j) as f32).cos());
            let mut c = vec![0.0f32; m * n];
            let t_new = time(&mut || {
                matmul(MatMut::new(&mut c, m, n), a.view(), b.view(), acc);
                std::hint::black_box(&mut c);
            });
            let t_small = time(&mut || {
                small_matmul(MatMut::new(&mut c, m, n), a.view(), b.view(), acc);
                std::hint::black_box(&mut c);
            });
            let t_gemm = time(&mut || {
                backend(MatMut::new(&mut c, m, n), a.view(), b.view(), acc, true);
                std::hint::black_box(&mut c);
            });
            println!(
                "{m:>5} {n:>5} {k:>5} {la} {lb} {:>3} {t_new:>11.1} {t_small:>9.1} {t_gemm:>9.1} {:>6.2}",
                acc as u8,
                t_small / t_gemm
            );
        }
    }

    #[test]
    #[should_panic(expected = "needs")]
    fn out_of_bounds_view_panics() {
        let d = [0.0f32; 5];
        let _ = MatRef::new(&d, 2, 3);
    }
}
