//! `TtmKernel`: comera's `TtmEmbedding` lookup and backward on numpy views of torch tensors.

use super::{check_count, lock, read, run_kernel, write, State, Workspaces};
use comera_layers::embedding::ids_from_i64;
use comera_layers::{EmbeddingLayer, RankGates, TtmEmbedding, TtmWorkspace};
use comera_tensor::TtmShape;
use numpy::{
    PyReadonlyArray1, PyReadonlyArrayDyn, PyReadwriteArray1, PyReadwriteArray2,
    PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::sync::Mutex;

/// The lookup and backward of a TTM embedding table (comera's `TtmEmbedding`), for
/// `comera.torch.TTMEmbedding`. The V × D table is held as p cores of shape
/// (r_k, v_k, e_k, r_{k+1}); row i has digits (i_1..i_p) over `vocab_modes` (i_1 slowest),
/// column c digits (c_1..c_p) over `dim_modes`, and
/// E[i, c] = F_1[0, i_1, c_1, :]·diag(g_1)·F_2[:, i_2, c_2, :] ⋯ F_p[:, i_p, c_p, 0]
/// with the rank gates g(d) = d if d > threshold else 0 (the last core is not gated).
///
/// The lookup deduplicates the batch's ids and computes shared half-chains once when that is
/// cheaper (comera's optimised lookup). Parameters are passed (and copied) every call; the
/// output and its gradient are written and read in place. One workspace per token count.
#[pyclass(module = "comera._comera", frozen)]
pub struct TtmKernel {
    shape: TtmShape,
    threshold: f32,
    state: Mutex<State<TtmEmbedding, TtmWorkspace>>,
}

struct Values<'a> {
    cores: Vec<&'a [f32]>,
    gates: Vec<&'a [f32]>,
}

impl TtmKernel {
    fn values<'a>(
        &self,
        cores: &'a [PyReadonlyArrayDyn<'_, f32>],
        gates: &'a [PyReadonlyArray1<'_, f32>],
    ) -> PyResult<Values<'a>> {
        let s = &self.shape;
        let p = s.n_cores();
        check_count("cores", cores.len(), p)?;
        check_count("gates", gates.len(), p - 1)?;
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
        Ok(Values { cores, gates })
    }

    /// Table ids from int64 ids, with a clear error for negative or too large ones.
    fn ids(&self, ids: &PyReadonlyArray1<'_, i64>) -> PyResult<Vec<u32>> {
        let n = ids.shape()[0];
        let raw = read(ids, "ids", &[n])?;
        ids_from_i64(raw, self.shape.num_embeddings())
            .map_err(|e| PyValueError::new_err(e.to_string()))
    }
}

fn load(layer: &mut TtmEmbedding, v: &Values<'_>) {
    for (p, c) in layer.cores.iter_mut().zip(&v.cores) {
        p.value.copy_from_slice(c);
    }
    for (p, g) in layer.gates.iter_mut().zip(&v.gates) {
        p.value.copy_from_slice(g);
    }
}

#[pymethods]
impl TtmKernel {
    /// A kernel for a `num_embeddings` × ∏dim_modes table over `vocab_modes`
    /// (∏ ≥ num_embeddings) and `dim_modes`, ranks `[1, r_1, …, r_{p-1}, 1]`; gate entries at or
    /// below `threshold` are pruned.
    #[new]
    #[pyo3(signature = (vocab_modes, dim_modes, ranks, num_embeddings, threshold = 0.01))]
    fn new(
        vocab_modes: Vec<usize>,
        dim_modes: Vec<usize>,
        ranks: Vec<usize>,
        num_embeddings: usize,
        threshold: f32,
    ) -> PyResult<Self> {
        let shape = TtmShape::new(&vocab_modes, &dim_modes, &ranks, num_embeddings)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let p = shape.n_cores();
        let cores = (0..p).map(|c| vec![0.0; shape.core_len(c)]).collect();
        let gates = (1..p).map(|b| vec![1.0; shape.ranks()[b]]).collect();
        let layer = TtmEmbedding::from_parts(
            "ttm",
            shape.clone(),
            RankGates::new(threshold),
            cores,
            gates,
        )
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(TtmKernel {
            shape,
            threshold,
            state: Mutex::new(State {
                layer,
                ws: Workspaces::new(),
            }),
        })
    }

    /// V, the number of rows.
    #[getter]
    fn num_embeddings(&self) -> usize {
        self.shape.num_embeddings()
    }

    /// D, the row width.
    #[getter]
    fn embedding_dim(&self) -> usize {
        self.shape.dim()
    }

    /// `[1, r_1, …, r_{p-1}, 1]`.
    #[getter]
    fn ranks(&self) -> Vec<usize> {
        self.shape.ranks().to_vec()
    }

    /// The shape (r_k, v_k, e_k, r_{k+1}) of every core.
    #[getter]
    fn core_shapes(&self) -> Vec<[usize; 4]> {
        (0..self.shape.n_cores())
            .map(|c| self.shape.core_shape(c))
            .collect()
    }

    /// The gate threshold τ.
    #[getter]
    fn threshold(&self) -> f32 {
        self.threshold
    }

    /// `y[t] = E[ids[t]]` for int64 `ids` (T) into `y` (T × D). Returns the forward's id.
    fn forward(
        &self,
        py: Python<'_>,
        ids: PyReadonlyArray1<'_, i64>,
        cores: Vec<PyReadonlyArrayDyn<'_, f32>>,
        gates: Vec<PyReadonlyArray1<'_, f32>>,
        mut y: PyReadwriteArray2<'_, f32>,
    ) -> PyResult<u64> {
        let ids = self.ids(&ids)?;
        let t = ids.len();
        let ys = write(&mut y, "y", &[t, self.shape.dim()])?;
        let v = self.values(&cores, &gates)?;
        if t == 0 {
            return Ok(0);
        }
        run_kernel(py, "TtmEmbedding forward", || {
            let mut st = lock(&self.state);
            let State { layer, ws } = &mut *st;
            load(layer, &v);
            let id = ws.fresh_id();
            let slot = ws.get(t, || layer.workspace(t));
            slot.last_forward = 0;
            layer
                .forward(&mut slot.ws, &ids, ys)
                .map_err(|e| e.to_string())?;
            slot.last_forward = id;
            Ok(id)
        })
    }

    /// The backward of forward `forward_id` on the same ids and parameter values: writes the
    /// gradients of the cores and gates for `dy` (T × D) into the arrays given (overwriting
    /// them). Recomputes the forward first if another one on the same token count ran since;
    /// returns whether it did.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        py: Python<'_>,
        forward_id: u64,
        ids: PyReadonlyArray1<'_, i64>,
        cores: Vec<PyReadonlyArrayDyn<'_, f32>>,
        gates: Vec<PyReadonlyArray1<'_, f32>>,
        dy: numpy::PyReadonlyArray2<'_, f32>,
        mut core_grads: Vec<PyReadwriteArrayDyn<'_, f32>>,
        mut gate_grads: Vec<PyReadwriteArray1<'_, f32>>,
    ) -> PyResult<bool> {
        let s = &self.shape;
        let p = s.n_cores();
        let ids = self.ids(&ids)?;
        let t = ids.len();
        let dys = read(&dy, "dy", &[t, s.dim()])?;
        let v = self.values(&cores, &gates)?;
        check_count("core_grads", core_grads.len(), p)?;
        check_count("gate_grads", gate_grads.len(), p - 1)?;
        let mut cg = Vec::with_capacity(p);
        for (c, a) in core_grads.iter_mut().enumerate() {
            cg.push(write(a, &format!("core_grads[{c}]"), &s.core_shape(c))?);
        }
        let mut gg = Vec::with_capacity(p - 1);
        for (i, a) in gate_grads.iter_mut().enumerate() {
            gg.push(write(a, &format!("gate_grads[{i}]"), &[s.ranks()[i + 1]])?);
        }
        if t == 0 {
            cg.iter_mut().for_each(|g| g.fill(0.0));
            gg.iter_mut().for_each(|g| g.fill(0.0));
            return Ok(false);
        }
        let d = s.dim();
        run_kernel(py, "TtmEmbedding backward", move || {
            let mut st = lock(&self.state);
            let State { layer, ws } = &mut *st;
            load(layer, &v);
            let slot = ws.get(t, || layer.workspace(t));
            let recomputed = forward_id == 0 || slot.last_forward != forward_id;
            if recomputed {
                slot.last_forward = 0;
                let mut y = vec![0.0f32; t * d];
                layer
                    .forward(&mut slot.ws, &ids, &mut y)
                    .map_err(|e| e.to_string())?;
            }
            slot.last_forward = 0;
            layer.visit_params_mut(&mut |p| p.grad.fill(0.0));
            layer.backward(&mut slot.ws, &ids, dys);
            for (out, p) in cg.into_iter().zip(&layer.cores) {
                out.copy_from_slice(&p.grad);
            }
            for (out, p) in gg.into_iter().zip(&layer.gates) {
                out.copy_from_slice(&p.grad);
            }
            Ok(recomputed)
        })
    }
}
