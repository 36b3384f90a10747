//! TT-SVD of dense weights and tables (comera_tensor::ttsvd), and mode proposals, for
//! `TTLinear.from_linear` and `TTMEmbedding.from_embedding`.

use super::{read, run_kernel};
use comera_tensor::factor::balanced_factorisations;
use comera_tensor::ttsvd::{self, TtSvdOptions};
use numpy::{PyArray1, PyArrayDyn, PyArrayMethods, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

fn options(max_rank: Option<usize>, rel_tol: Option<f64>) -> TtSvdOptions {
    TtSvdOptions {
        max_rank,
        rel_tol,
        ..TtSvdOptions::default()
    }
}

type Cores<'py> = Vec<Bound<'py, PyArrayDyn<f32>>>;

fn to_arrays<'py>(
    py: Python<'py>,
    cores: Vec<Vec<f32>>,
    shapes: Vec<Vec<usize>>,
) -> PyResult<Cores<'py>> {
    cores
        .into_iter()
        .zip(shapes)
        .map(|(c, s)| PyArray1::from_vec(py, c).reshape(s))
        .collect()
}

/// TT-SVD of a weight `w` (N × M, float32, row-major; y = x·w) into TT cores over `in_modes`
/// (∏ = N) and `out_modes` (∏ = M): core c has shape (r_c, s_c, r_{c+1}), s = in_modes ++
/// out_modes. Each bond keeps at most `max_rank` singular values and, with `rel_tol`, the fewest
/// that keep the relative Frobenius error below it; neither: every nonzero singular value
/// (exact). Singular values are balanced over the cores (every core has the same norm).
/// Returns `(cores, ranks, rel_error)`, `ranks = [1, r_1, …, 1]`.
#[pyfunction]
#[pyo3(signature = (w, in_modes, out_modes, max_rank = None, rel_tol = None))]
pub fn tt_matrix_svd<'py>(
    py: Python<'py>,
    w: PyReadonlyArray2<'py, f32>,
    in_modes: Vec<usize>,
    out_modes: Vec<usize>,
    max_rank: Option<usize>,
    rel_tol: Option<f64>,
) -> PyResult<(Cores<'py>, Vec<usize>, f64)> {
    let shape = w.shape().to_vec();
    let data = read(&w, "w", &shape)?;
    let (n, m): (usize, usize) = (in_modes.iter().product(), out_modes.iter().product());
    if shape != [n, m] {
        return Err(PyValueError::new_err(format!(
            "w: shape {shape:?} does not match in_modes {in_modes:?} (∏ = {n}) × out_modes \
             {out_modes:?} (∏ = {m})"
        )));
    }
    let opts = options(max_rank, rel_tol);
    let tt = run_kernel(py, "tt_matrix_svd", || {
        ttsvd::tt_matrix_svd(data, &in_modes, &out_modes, &opts).map_err(|e| e.to_string())
    })?;
    let shapes = (0..tt.cores.len())
        .map(|c| vec![tt.ranks[c], tt.modes[c], tt.ranks[c + 1]])
        .collect();
    let (ranks, err) = (tt.ranks.clone(), tt.rel_error);
    Ok((to_arrays(py, tt.cores, shapes)?, ranks, err))
}

/// TT-SVD of an embedding table (V × D, float32) into TTM cores over `vocab_modes`
/// (∏ ≥ V; missing rows are zeros) and `dim_modes` (∏ = D): core k has shape
/// (r_k, v_k, e_k, r_{k+1}). `max_rank` / `rel_tol` as in `tt_matrix_svd`. Returns
/// `(cores, ranks, rel_error)`.
#[pyfunction]
#[pyo3(signature = (table, vocab_modes, dim_modes, max_rank = None, rel_tol = None))]
pub fn ttm_svd<'py>(
    py: Python<'py>,
    table: PyReadonlyArray2<'py, f32>,
    vocab_modes: Vec<usize>,
    dim_modes: Vec<usize>,
    max_rank: Option<usize>,
    rel_tol: Option<f64>,
) -> PyResult<(Cores<'py>, Vec<usize>, f64)> {
    let shape = table.shape().to_vec();
    let data = read(&table, "table", &shape)?;
    let d: usize = dim_modes.iter().product();
    if shape[1] != d {
        return Err(PyValueError::new_err(format!(
            "table: {} columns, but dim_modes {dim_modes:?} multiply to {d}",
            shape[1]
        )));
    }
    let opts = options(max_rank, rel_tol);
    let rows = shape[0];
    let tt = run_kernel(py, "ttm_svd", || {
        ttsvd::ttm_svd(data, rows, &vocab_modes, &dim_modes, &opts).map_err(|e| e.to_string())
    })?;
    let shapes = (0..tt.cores.len())
        .map(|k| {
            vec![
                tt.ranks[k],
                tt.vocab_modes[k],
                tt.dim_modes[k],
                tt.ranks[k + 1],
            ]
        })
        .collect();
    let (ranks, err) = (tt.ranks.clone(), tt.rel_error);
    Ok((to_arrays(py, tt.cores, shapes)?, ranks, err))
}

/// The most balanced factorisation of `n` into `parts` factors (largest first), comera's
/// default TT layout of a width, e.g. `balanced_modes(768, 3) == [12, 8, 8]`.
#[pyfunction]
#[pyo3(signature = (n, parts = 3))]
pub fn balanced_modes(n: usize, parts: usize) -> PyResult<Vec<usize>> {
    if n == 0 || parts == 0 {
        return Err(PyValueError::new_err(
            "balanced_modes: n and parts must be at least 1",
        ));
    }
    balanced_factorisations(n, parts, 1)
        .pop()
        .ok_or_else(|| PyValueError::new_err(format!("no factorisation of {n} into {parts}")))
}
