//! `TtLinearKernel`: comera's `TtLinear` forward and backward on numpy views of torch tensors.

use super::{check_count, lock, read, run_kernel, write, State, Workspaces};
use comera_layers::{Layer, RankGates, TtLinear, TtLinearWorkspace};
use comera_tensor::TtShape;
use numpy::{
    PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArrayDyn, PyReadwriteArray1, PyReadwriteArray2,
    PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::sync::Mutex;

/// The forward and backward of a TT linear layer `y = x·W + b` (comera's `TtLinear`), for
/// `comera.torch.TTLinear`. W (N × M) is held as K = p + q cores, core c of shape
/// (r_c, s_c, r_{c+1}) with s = in_modes ++ out_modes; row i of W is the input index with
/// digits over `in_modes` (first digit slowest), column j the output index over `out_modes`.
/// The layer works on the gated cores H_c = G_c·diag(g(d_{c+1})), g(d) = d if d > threshold
/// else 0 (the rank gates; the last core is not gated).
///
/// Parameters are passed on every call (their values are copied into the layer: they are
/// small); activations are read and written in place. The kernel keeps one workspace (the
/// contraction plan and the forward's saved intermediates) per batch-row count, for the last
/// few counts used.
#[pyclass(module = "comera._comera", frozen)]
pub struct TtLinearKernel {
    shape: TtShape,
    threshold: f32,
    state: Mutex<State<TtLinear, TtLinearWorkspace>>,
}

/// Read-only views of a call's parameter values.
struct Values<'a> {
    cores: Vec<&'a [f32]>,
    gates: Vec<&'a [f32]>,
    bias: Option<&'a [f32]>,
}

impl TtLinearKernel {
    fn values<'a>(
        &self,
        cores: &'a [PyReadonlyArrayDyn<'_, f32>],
        gates: &'a [PyReadonlyArray1<'_, f32>],
        bias: &'a Option<PyReadonlyArray1<'_, f32>>,
    ) -> PyResult<Values<'a>> {
        let s = &self.shape;
        let k = s.n_cores();
        check_count("cores", cores.len(), k)?;
        check_count("gates", gates.len(), k - 1)?;
        let cores = cores
            .iter()
            .enumerate()
            .map(|(c, a)| read(a, &format!("core {c}"), &s.core_shape(c)))
            .collect::<PyResult<Vec<_>>>()?;
        let gates = gates
            .iter()
            .enumerate()
            .map(|(b, a)| read(a, &format!("gate {b}"), &[s.ranks()[b + 1]]))
            .collect::<PyResult<Vec<_>>>()?;
        let bias = match bias {
            Some(a) => Some(read(a, "bias", &[s.out_features()])?),
            None => None,
        };
        Ok(Values { cores, gates, bias })
    }
}

/// Copies a call's parameter values into the layer.
fn load(layer: &mut TtLinear, v: &Values<'_>) {
    for (p, c) in layer.cores.iter_mut().zip(&v.cores) {
        p.value.copy_from_slice(c);
    }
    for (p, g) in layer.gates.iter_mut().zip(&v.gates) {
        p.value.copy_from_slice(g);
    }
    match v.bias {
        Some(b) => layer.bias.value.copy_from_slice(b),
        None => layer.bias.value.fill(0.0),
    }
}

#[pymethods]
impl TtLinearKernel {
    /// A kernel for in modes `in_modes` (∏ = N), out modes `out_modes` (∏ = M) and ranks
    /// `[1, r_1, …, r_{K-1}, 1]`; gate entries at or below `threshold` are pruned.
    #[new]
    #[pyo3(signature = (in_modes, out_modes, ranks, threshold = 0.01))]
    fn new(
        in_modes: Vec<usize>,
        out_modes: Vec<usize>,
        ranks: Vec<usize>,
        threshold: f32,
    ) -> PyResult<Self> {
        let shape = TtShape::new(&in_modes, &out_modes, &ranks)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let k = shape.n_cores();
        let cores = (0..k).map(|c| vec![0.0; shape.core_len(c)]).collect();
        let gates = (1..k).map(|b| vec![1.0; shape.ranks()[b]]).collect();
        let bias = vec![0.0; shape.out_features()];
        let layer = TtLinear::from_parts(
            "tt",
            shape.clone(),
            RankGates::new(threshold),
            cores,
            gates,
            bias,
        )
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(TtLinearKernel {
            shape,
            threshold,
            state: Mutex::new(State {
                layer,
                ws: Workspaces::new(),
            }),
        })
    }

    /// N, the input width.
    #[getter]
    fn in_features(&self) -> usize {
        self.shape.in_features()
    }

    /// M, the output width.
    #[getter]
    fn out_features(&self) -> usize {
        self.shape.out_features()
    }

    /// `[1, r_1, …, r_{K-1}, 1]`.
    #[getter]
    fn ranks(&self) -> Vec<usize> {
        self.shape.ranks().to_vec()
    }

    /// The shape (r_c, s_c, r_{c+1}) of every core.
    #[getter]
    fn core_shapes(&self) -> Vec<[usize; 3]> {
        (0..self.shape.n_cores())
            .map(|c| self.shape.core_shape(c))
            .collect()
    }

    /// The gate threshold τ: entries d ≤ τ are pruned (g(d) = 0).
    #[getter]
    fn threshold(&self) -> f32 {
        self.threshold
    }

    /// The contraction path the planner chose for `rows` batch rows (`"merged"`,
    /// `"sequential"` or `"dense"`).
    fn path(&self, py: Python<'_>, rows: usize) -> PyResult<String> {
        if rows == 0 {
            return Err(PyValueError::new_err("rows must be at least 1"));
        }
        run_kernel(py, "TtLinearKernel.path", || {
            let mut st = lock(&self.state);
            let State { layer, ws } = &mut *st;
            let slot = ws.get(rows, || layer.workspace(rows));
            Ok(format!("{:?}", slot.ws.path()).to_lowercase())
        })
    }

    /// `y = x·W + b` for `x` (B × N) into `y` (B × M), from the cores, gates and bias given
    /// (bias `None`: no bias). Returns the forward's id, for `backward`.
    #[pyo3(signature = (x, cores, gates, bias, y))]
    fn forward(
        &self,
        py: Python<'_>,
        x: PyReadonlyArray2<'_, f32>,
        cores: Vec<PyReadonlyArrayDyn<'_, f32>>,
        gates: Vec<PyReadonlyArray1<'_, f32>>,
        bias: Option<PyReadonlyArray1<'_, f32>>,
        mut y: PyReadwriteArray2<'_, f32>,
    ) -> PyResult<u64> {
        let (n, m) = (self.shape.in_features(), self.shape.out_features());
        let b = x.shape()[0];
        let xs = read(&x, "x", &[b, n])?;
        let ys = write(&mut y, "y", &[b, m])?;
        let v = self.values(&cores, &gates, &bias)?;
        if b == 0 {
            return Ok(0);
        }
        run_kernel(py, "TtLinear forward", || {
            let mut st = lock(&self.state);
            let State { layer, ws } = &mut *st;
            load(layer, &v);
            let id = ws.fresh_id();
            let slot = ws.get(b, || layer.workspace(b));
            slot.last_forward = 0;
            layer.forward(&mut slot.ws, xs, ys);
            slot.last_forward = id;
            Ok(id)
        })
    }

    /// The backward of forward `forward_id` on the same `x` and parameter values: writes
    /// `dx = dy·Wᵀ` (when `dx` is given) and the gradients of the cores, gates and bias (when
    /// `bias_grad` is given) into the arrays given (overwriting them). If another forward on
    /// the same batch-row count ran since, that forward is recomputed first. Returns whether
    /// it was.
    #[pyo3(signature = (forward_id, x, cores, gates, bias, dy, dx, core_grads, gate_grads, bias_grad))]
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        py: Python<'_>,
        forward_id: u64,
        x: PyReadonlyArray2<'_, f32>,
        cores: Vec<PyReadonlyArrayDyn<'_, f32>>,
        gates: Vec<PyReadonlyArray1<'_, f32>>,
        bias: Option<PyReadonlyArray1<'_, f32>>,
        dy: PyReadonlyArray2<'_, f32>,
        mut dx: Option<PyReadwriteArray2<'_, f32>>,
        mut core_grads: Vec<PyReadwriteArrayDyn<'_, f32>>,
        mut gate_grads: Vec<PyReadwriteArray1<'_, f32>>,
        mut bias_grad: Option<PyReadwriteArray1<'_, f32>>,
    ) -> PyResult<bool> {
        let s = &self.shape;
        let (n, m, k) = (s.in_features(), s.out_features(), s.n_cores());
        let b = x.shape()[0];
        let xs = read(&x, "x", &[b, n])?;
        let dys = read(&dy, "dy", &[b, m])?;
        let v = self.values(&cores, &gates, &bias)?;
        let dxs = match dx.as_mut() {
            Some(a) => Some(write(a, "dx", &[b, n])?),
            None => None,
        };
        check_count("core_grads", core_grads.len(), k)?;
        check_count("gate_grads", gate_grads.len(), k - 1)?;
        let mut cg = Vec::with_capacity(k);
        for (c, a) in core_grads.iter_mut().enumerate() {
            cg.push(write(a, &format!("core_grads[{c}]"), &s.core_shape(c))?);
        }
        let mut gg = Vec::with_capacity(k - 1);
        for (i, a) in gate_grads.iter_mut().enumerate() {
            gg.push(write(a, &format!("gate_grads[{i}]"), &[s.ranks()[i + 1]])?);
        }
        let bg = match bias_grad.as_mut() {
            Some(a) => Some(write(a, "bias_grad", &[m])?),
            None => None,
        };
        if b == 0 {
            cg.iter_mut().for_each(|g| g.fill(0.0));
            gg.iter_mut().for_each(|g| g.fill(0.0));
            if let Some(g) = bg {
                g.fill(0.0);
            }
            return Ok(false);
        }
        run_kernel(py, "TtLinear backward", move || {
            let mut st = lock(&self.state);
            let State { layer, ws } = &mut *st;
            load(layer, &v);
            let slot = ws.get(b, || layer.workspace(b));
            let recomputed = forward_id == 0 || slot.last_forward != forward_id;
            if recomputed {
                slot.last_forward = 0;
                let mut y = vec![0.0f32; b * m];
                layer.forward(&mut slot.ws, xs, &mut y);
            }
            // The backward may reuse the saved buffers: a second backward recomputes.
            slot.last_forward = 0;
            layer.zero_grad();
            layer.backward(&mut slot.ws, xs, dys, dxs);
            for (out, p) in cg.into_iter().zip(&layer.cores) {
                out.copy_from_slice(&p.grad);
            }
            for (out, p) in gg.into_iter().zip(&layer.gates) {
                out.copy_from_slice(&p.grad);
            }
            if let Some(out) = bg {
                out.copy_from_slice(&layer.bias.grad);
            }
            Ok(recomputed)
        })
    }

    /// The dense weight W (N × M, row-major) of the given cores and gates, computed by comera
    /// (for tests and export).
    fn dense_weight<'py>(
        &self,
        py: Python<'py>,
        cores: Vec<PyReadonlyArrayDyn<'py, f32>>,
        gates: Vec<PyReadonlyArray1<'py, f32>>,
    ) -> PyResult<Bound<'py, numpy::PyArray2<f32>>> {
        let v = self.values(&cores, &gates, &None)?;
        let (n, m) = (self.shape.in_features(), self.shape.out_features());
        let w = run_kernel(py, "TtLinear dense_weight", || {
            let mut st = lock(&self.state);
            load(&mut st.layer, &v);
            Ok(st.layer.dense_weight())
        })?;
        use numpy::PyArrayMethods;
        numpy::PyArray1::from_vec(py, w).reshape([n, m])
    }
}
