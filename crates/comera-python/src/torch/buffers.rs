//! Reused output buffers for `comera.torch`'s activations (y, dx).
//!
//! A layer's output and input gradient are as large as its activations (4,096 tokens × 3,072
//! floats: 50 MB), and a fresh allocation that large is a fresh `mmap` whose every page faults
//! when the kernel first writes it: about 15 ms of a 768×3072 layer's 50-70 ms forward and
//! backward, measured on 2 Zen 3 cores. So the buffers are kept and reused instead, the way
//! torch's CUDA allocator caches device memory: `empty(rows, cols)` hands out a NumPy array
//! (wrapped with `torch.from_numpy`, no copy) over a buffer owned by a `PooledBuffer`; when
//! the last array or tensor viewing it is gone, Python drops the `PooledBuffer`, whose `Drop`
//! puts the buffer back in the cache for the next call of that size. The cache keeps at most
//! `limit` bytes (1 GiB unless `set_cache_limit` says otherwise; 0 turns it off) and
//! `empty_cache` frees it.
//!
//! A reused buffer holds stale values: it is only handed out for outputs the kernels
//! overwrite entirely.

use numpy::ndarray::ArrayViewMut2;
use numpy::PyArray2;
use pyo3::prelude::*;
use std::sync::Mutex;

/// Bytes the cache keeps when nothing else is said.
const DEFAULT_LIMIT_BYTES: usize = 1 << 30;

/// Free buffers, most recently returned last, and the cache's limit in bytes.
struct Cache {
    free: Vec<Vec<f32>>,
    limit: usize,
}

impl Cache {
    fn bytes(&self) -> usize {
        self.free.iter().map(|b| 4 * b.len()).sum()
    }
}

static CACHE: Mutex<Cache> = Mutex::new(Cache {
    free: Vec::new(),
    limit: DEFAULT_LIMIT_BYTES,
});

fn cache() -> std::sync::MutexGuard<'static, Cache> {
    // The cache holds plain buffers: a panic while it was locked leaves it usable.
    CACHE.lock().unwrap_or_else(|p| p.into_inner())
}

/// The owner of one buffer lent to NumPy; it returns the buffer to the cache when dropped.
#[pyclass(module = "comera._comera", frozen)]
pub struct PooledBuffer {
    data: Vec<f32>,
}

impl Drop for PooledBuffer {
    fn drop(&mut self) {
        let data = std::mem::take(&mut self.data);
        let mut c = cache();
        if 4 * data.len() + c.bytes() <= c.limit {
            c.free.push(data);
        }
    }
}

/// A `rows × cols` float32 array (C order) whose values are undefined, over a reused buffer
/// when the cache has one of that size.
#[pyfunction]
pub fn empty(py: Python<'_>, rows: usize, cols: usize) -> PyResult<Bound<'_, PyArray2<f32>>> {
    let len = rows
        .checked_mul(cols)
        .ok_or_else(|| pyo3::exceptions::PyValueError::new_err("empty: rows × cols overflows"))?;
    let reused = {
        let mut c = cache();
        c.free
            .iter()
            .rposition(|b| b.len() == len)
            .map(|i| c.free.swap_remove(i))
    };
    let mut data = reused.unwrap_or_else(|| vec![0.0; len]);
    // The array writes through this pointer (moving the Vec into its owner does not move its
    // heap buffer).
    let ptr = data.as_mut_ptr();
    let owner = Bound::new(py, PooledBuffer { data })?;
    // SAFETY: `ptr` addresses `len` = rows × cols floats, owned by `owner`, which is the
    // array's base: it keeps the buffer alive and never touches or reallocates it until its
    // `Drop`, when no array refers to it any more.
    Ok(unsafe {
        let view = ArrayViewMut2::from_shape_ptr((rows, cols), ptr);
        PyArray2::borrow_from_array(&view, owner.into_any())
    })
}

/// Frees every cached buffer; returns how many bytes were freed.
#[pyfunction]
pub fn empty_cache() -> usize {
    let mut c = cache();
    let bytes = c.bytes();
    c.free.clear();
    bytes
}

/// Bytes held by the cache now.
#[pyfunction]
pub fn cached_bytes() -> usize {
    cache().bytes()
}

/// Sets the most bytes the cache keeps (0: keep nothing), freeing buffers beyond it; returns
/// the previous limit.
#[pyfunction]
pub fn set_cache_limit(bytes: usize) -> usize {
    let mut c = cache();
    let old = std::mem::replace(&mut c.limit, bytes);
    while c.bytes() > bytes {
        c.free.remove(0);
    }
    old
}
