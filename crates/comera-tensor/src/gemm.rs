//! The one GEMM entry point of the engine.
//!
//! Every contraction in comera ends up here as `C (m×n) = A (m×k) · B (k×n)` (optionally
//! `C += …`) over strided views of flat `f32` buffers, so a transpose is a view, never a copy.
//! The backend is the `gemm` crate (chosen by the benchmark in `tools/gemm-bench`); no other
//! module talks to it. Views are bounds-checked when they are made, so the `unsafe` call below
//! only ever sees in-bounds pointers.

use gemm::Parallelism;

/// Products with at most this many multiply-adds skip the backend: its dispatch and packing
/// cost more than the arithmetic (TTM slab chains, per-id rows). Measured with `comera bench ttm`.
const SMALL_MACS: usize = 1 << 14;

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
}

/// `C = A·B`, or `C += A·B` when `accumulate` is set. Shapes must agree (panics otherwise:
/// a shape mismatch here is an engine bug, user-facing shapes are checked at layer boundaries).
pub fn matmul(c: MatMut<'_>, a: MatRef<'_>, b: MatRef<'_>, accumulate: bool) {
    assert_eq!(
        a.cols, b.rows,
        "matmul inner dimensions differ: {}x{} · {}x{}",
        a.rows, a.cols, b.rows, b.cols
    );
    assert_eq!((c.rows, c.cols), (a.rows, b.cols), "matmul output shape");
    let (m, n, k) = (a.rows, b.cols, a.cols);
    stats::record(m, n, k, &c, &a, &b, accumulate);
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
    if m * n * k <= SMALL_MACS {
        small_matmul(c, a, b, accumulate);
        return;
    }
    let threads = rayon::current_num_threads();
    let parallelism = if threads > 1 && m * n * k >= PARALLEL_MIN_MACS {
        Parallelism::Rayon(threads)
    } else {
        Parallelism::None
    };
    // SAFETY: every view was bounds-checked at construction for its full extent, `c` is a
    // unique borrow, and the dimensions passed are the views' own.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.data.as_mut_ptr(),
            c.cs as isize,
            c.rs as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// `C (+)= A·B` for tiny operands: row by row, `C[i, :] += A[i, l] · B[l, :]`, which the
/// compiler vectorises when B and C rows are contiguous.
fn small_matmul(c: MatMut<'_>, a: MatRef<'_>, b: MatRef<'_>, accumulate: bool) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    for i in 0..m {
        let crow = i * c.rs;
        if !accumulate {
            for j in 0..n {
                c.data[crow + j * c.cs] = 0.0;
            }
        }
        for l in 0..k {
            let av = a.data[i * a.rs + l * a.cs];
            let brow = l * b.rs;
            if c.cs == 1 && b.cs == 1 {
                let (cr, br) = (&mut c.data[crow..crow + n], &b.data[brow..brow + n]);
                for (cv, &bv) in cr.iter_mut().zip(br) {
                    *cv += av * bv;
                }
            } else {
                for j in 0..n {
                    c.data[crow + j * c.cs] += av * b.data[brow + j * b.cs];
                }
            }
        }
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

    #[test]
    #[should_panic(expected = "needs")]
    fn out_of_bounds_view_panics() {
        let d = [0.0f32; 5];
        let _ = MatRef::new(&d, 2, 3);
    }
}

mod stats {
    use std::collections::HashMap;
    use std::sync::Mutex;
    static S: Mutex<Option<(u64, HashMap<(usize, usize, usize, u8, u8, u8, bool), u64>)>> =
        Mutex::new(None);
    pub fn record(
        m: usize,
        n: usize,
        k: usize,
        c: &super::MatMut,
        a: &super::MatRef,
        b: &super::MatRef,
        acc: bool,
    ) {
        if std::env::var_os("GEMM_STATS").is_none() {
            return;
        }
        let lay = |rs: usize, cs: usize| {
            if cs == 1 {
                b'R'
            } else if rs == 1 {
                b'C'
            } else {
                b'S'
            }
        };
        let mut g = S.lock().unwrap();
        let e = g.get_or_insert_with(|| (0, HashMap::new()));
        e.0 += 1;
        *e.1.entry((
            m,
            n,
            k,
            lay(c.rs, c.cs),
            lay(a.rs, a.cs),
            lay(b.rs, b.cs),
            acc,
        ))
        .or_default() += 1;
        if e.0 % (1 << 15) == 0 {
            let mut v: Vec<_> = e.1.iter().collect();
            v.sort_by_key(|x| std::cmp::Reverse(*x.1));
            eprintln!("--- {} calls", e.0);
            for (key, cnt) in v.iter().take(25) {
                eprintln!(
                    "m{} n{} k{} c{} a{} b{} acc{}: {}",
                    key.0, key.1, key.2, key.3 as char, key.4 as char, key.5 as char, key.6, cnt
                );
            }
        }
    }
}
