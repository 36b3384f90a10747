//! Kernels behind `comera.torch` (python/comera/torch.py): TT linear and TTM embedding layers
//! whose forward and backward are comera's own (`TtLinear`, `TtmEmbedding`: planned
//! contraction order, hand-derived backward, rank gates), called on torch CPU tensors through
//! numpy views of their memory.
//!
//! The Python side owns every parameter (torch `Parameter`s); each call passes their current
//! values, which are copied into the Rust layer (cores, gates and bias are small: kilobytes),
//! while activations (x, y, dy, dx) are read and written in place. A kernel object keeps one
//! workspace per batch-row count (the contraction plan and what the forward saves for the
//! backward), tagged with the id of the forward that filled it: a backward whose forward is no
//! longer the workspace's last one recomputes that forward first.
//!
//! Every call releases the GIL while the kernel runs and turns a panic into a Python
//! `RuntimeError`; bad shapes and values are `ValueError`s, checked before any kernel runs.
//!
//! Threads: the kernels run on the pool of [`crate::threads`] (rayon's global pool until
//! `set_num_threads(n)` gives them one of their own; rebuilt in a child after `fork`). On the
//! merged contraction path a layer's results do not depend on the thread count.

use numpy::{PyReadonlyArray, PyReadwriteArray, PyUntypedArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use std::panic::AssertUnwindSafe;
use std::sync::{Mutex, MutexGuard};

mod buffers;
mod linear;
mod svd;
mod ttm;

/// Registers the `comera.torch` kernels in the extension module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<linear::TtLinearKernel>()?;
    m.add_class::<ttm::TtmKernel>()?;
    m.add_function(wrap_pyfunction!(svd::tt_matrix_svd, m)?)?;
    m.add_function(wrap_pyfunction!(svd::ttm_svd, m)?)?;
    m.add_function(wrap_pyfunction!(svd::balanced_modes, m)?)?;
    m.add_class::<buffers::PooledBuffer>()?;
    m.add_function(wrap_pyfunction!(buffers::empty, m)?)?;
    m.add_function(wrap_pyfunction!(buffers::empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(buffers::cached_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(buffers::set_cache_limit, m)?)?;
    Ok(())
}

/// How many workspaces (batch-row counts) a kernel keeps; the least recently used goes first.
const MAX_WORKSPACES: usize = 4;

/// A workspace with the id of the forward whose intermediates it holds (0: none).
struct Slot<W> {
    rows: usize,
    ws: W,
    last_forward: u64,
}

/// Workspaces by batch-row count, most recently used last.
struct Workspaces<W> {
    slots: Vec<Slot<W>>,
    next_id: u64,
}

impl<W> Workspaces<W> {
    fn new() -> Self {
        Workspaces {
            slots: Vec::new(),
            next_id: 1,
        }
    }

    /// The workspace for `rows` rows (made by `make` if absent), moved to the back.
    fn get(&mut self, rows: usize, make: impl FnOnce() -> W) -> &mut Slot<W> {
        match self.slots.iter().position(|s| s.rows == rows) {
            Some(i) => {
                let s = self.slots.remove(i);
                self.slots.push(s);
            }
            None => {
                if self.slots.len() >= MAX_WORKSPACES {
                    self.slots.remove(0);
                }
                self.slots.push(Slot {
                    rows,
                    ws: make(),
                    last_forward: 0,
                });
            }
        }
        self.slots.last_mut().expect("just pushed")
    }

    fn fresh_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Drops every workspace (after a panic left them in an unknown state).
    fn clear(&mut self) {
        self.slots.clear();
    }
}

/// What a kernel's mutex guards: the Rust layer (its parameter values are refreshed every
/// call) and its workspaces.
struct State<L, W> {
    layer: L,
    ws: Workspaces<W>,
}

/// Locks a kernel's state. A panic during an earlier call poisons the mutex: its workspaces
/// are dropped (their saved intermediates may be half written) and the state is used again.
fn lock<L, W>(m: &Mutex<State<L, W>>) -> MutexGuard<'_, State<L, W>> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => {
            let mut g = poisoned.into_inner();
            g.ws.clear();
            m.clear_poison();
            g
        }
    }
}

/// Runs `f` without the GIL (in the kernels' pool, [`crate::threads::install`]), catching
/// panics: `Err(msg)` becomes a `ValueError`, a panic a `RuntimeError` naming `what`.
fn run_kernel<T: Send>(
    py: Python<'_>,
    what: &str,
    f: impl FnOnce() -> Result<T, String> + Send,
) -> PyResult<T> {
    let run = move || crate::threads::install(f);
    match py.detach(|| std::panic::catch_unwind(AssertUnwindSafe(run))) {
        Ok(Ok(Ok(v))) => Ok(v),
        Ok(Ok(Err(msg))) => Err(PyValueError::new_err(msg)),
        Ok(Err(e)) => Err(e),
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(PyRuntimeError::new_err(format!(
                "{what}: comera's kernel panicked ({msg}); this is a bug in comera, please report it"
            )))
        }
    }
}

fn shape_err(what: &str, got: &[usize], want: &[usize]) -> PyErr {
    PyValueError::new_err(format!("{what}: expected shape {want:?}, got {got:?}"))
}

/// The C-contiguous data of a read-only array with shape `want`.
fn read<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    a: &'a PyReadonlyArray<'_, T, D>,
    what: &str,
    want: &[usize],
) -> PyResult<&'a [T]> {
    if a.shape() != want {
        return Err(shape_err(what, a.shape(), want));
    }
    if !a.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{what}: the array must be C-contiguous"
        )));
    }
    a.as_slice()
        .map_err(|e| PyValueError::new_err(format!("{what}: {e}")))
}

/// The C-contiguous data of a writable array with shape `want`.
fn write<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    a: &'a mut PyReadwriteArray<'_, T, D>,
    what: &str,
    want: &[usize],
) -> PyResult<&'a mut [T]> {
    if a.shape() != want {
        return Err(shape_err(what, a.shape(), want));
    }
    if !a.is_c_contiguous() {
        return Err(PyValueError::new_err(format!(
            "{what}: the array must be C-contiguous"
        )));
    }
    a.as_slice_mut()
        .map_err(|e| PyValueError::new_err(format!("{what}: {e}")))
}

/// Checks that a list of parameter arrays has `want` entries.
fn check_count(what: &str, got: usize, want: usize) -> PyResult<()> {
    if got == want {
        Ok(())
    } else {
        Err(PyValueError::new_err(format!(
            "{what}: expected {want} arrays, got {got}"
        )))
    }
}
