//! The threads comera's work runs on when Python calls it outside a training run
//! (`comera.torch`'s kernels, predictions, evaluations, imports and exports), and what happens
//! to them across `fork`.
//!
//! Until `set_num_threads` is called, that work runs on rayon's global pool
//! (`RAYON_NUM_THREADS` when it starts, else every core), called from the caller's thread;
//! `set_num_threads(n)` gives it a pool of its own, which can be changed at any time.
//! (A training run makes a pool of its own for each run.)
//!
//! `fork` copies only the thread that called it: in the child, a pool's workers are gone
//! while its bookkeeping says they are there, and the first job handed to it would wait
//! forever (a forking `DataLoader` whose dataset calls a comera layer after the parent has
//! used one). So a handler registered with `pthread_atfork` counts forks in the child, and
//! the first call after a fork builds a fresh pool with the thread count the parent had; the
//! parent's pools are left alone (their memory is leaked in the child: dropping them would
//! signal threads that do not exist there).

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Once, RwLock};

/// The pool of this module and the fork generation of the process that built it.
struct OwnPool {
    pool: Arc<rayon::ThreadPool>,
    generation: u64,
}

/// The kernels' own pool, once `set_num_threads` or a fork has made one (else rayon's global
/// pool).
static POOL: RwLock<Option<OwnPool>> = RwLock::new(None);

/// How many `fork`s separate this process from the one that loaded the module (0: that one).
static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);

/// Runs in the child right after `fork`: only an atomic add (async-signal-safe).
extern "C" fn after_fork_in_child() {
    FORK_GENERATION.fetch_add(1, Ordering::SeqCst);
}

/// Registers the fork handler (once per process) and the Python functions.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    static REGISTER: Once = Once::new();
    let mut status = 0;
    REGISTER.call_once(|| {
        // SAFETY: `after_fork_in_child` is an `extern "C" fn()` with static lifetime that only
        // performs an atomic add, which is allowed in a child after fork.
        status = unsafe { libc::pthread_atfork(None, None, Some(after_fork_in_child)) };
    });
    if status != 0 {
        return Err(PyRuntimeError::new_err(format!(
            "cannot register comera's fork handler (pthread_atfork: error {status})"
        )));
    }
    m.add_function(wrap_pyfunction!(set_num_threads, m)?)?;
    m.add_function(wrap_pyfunction!(get_num_threads, m)?)?;
    Ok(())
}

fn build(threads: usize) -> PyResult<Arc<rayon::ThreadPool>> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("comera-{i}"))
        .build()
        .map(Arc::new)
        .map_err(|e| PyRuntimeError::new_err(format!("cannot start {threads} threads: {e}")))
}

/// The pool the next call runs in (`None`: rayon's global pool, from the caller's thread).
/// In a process forked since the pool (or the global pool) was made, a fresh pool with the
/// same number of threads.
fn pool() -> PyResult<Option<Arc<rayon::ThreadPool>>> {
    let generation = FORK_GENERATION.load(Ordering::SeqCst);
    {
        let own = POOL.read().unwrap_or_else(|p| p.into_inner());
        match &*own {
            Some(p) if p.generation == generation => return Ok(Some(p.pool.clone())),
            None if generation == 0 => return Ok(None),
            _ => {}
        }
    }
    let mut own = POOL.write().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = &*own {
        if p.generation == generation {
            return Ok(Some(p.pool.clone()));
        }
    }
    // Forked: the parent's pool (its own or rayon's global one) has no threads here.
    let threads = match own.take() {
        Some(stale) => {
            let n = stale.pool.current_num_threads();
            std::mem::forget(stale);
            n
        }
        // Reads the global pool's size only; it starts no thread.
        None => rayon::current_num_threads(),
    };
    let pool = build(threads)?;
    *own = Some(OwnPool {
        pool: pool.clone(),
        generation,
    });
    Ok(Some(pool))
}

/// Runs `f` in the kernels' pool (or on this thread, with rayon's global pool, when there is
/// none). Call it without the GIL.
pub fn install<T: Send>(f: impl FnOnce() -> T + Send) -> PyResult<T> {
    Ok(match pool()? {
        Some(p) => p.install(f),
        None => f(),
    })
}

/// Runs the kernels on `threads` threads from now on (a pool of their own; a kernel running
/// meanwhile finishes on the pool it started on).
#[pyfunction]
fn set_num_threads(threads: usize) -> PyResult<()> {
    if threads == 0 {
        return Err(PyValueError::new_err("threads must be at least 1, got 0"));
    }
    let pool = build(threads)?;
    let generation = FORK_GENERATION.load(Ordering::SeqCst);
    let mut own = POOL.write().unwrap_or_else(|p| p.into_inner());
    if let Some(stale) = own.take() {
        if stale.generation == generation {
            drop(stale);
        } else {
            // A parent's pool: no threads to stop here.
            std::mem::forget(stale);
        }
    }
    *own = Some(OwnPool { pool, generation });
    Ok(())
}

/// The number of threads the kernels run on.
#[pyfunction]
fn get_num_threads() -> PyResult<usize> {
    Ok(match pool()? {
        Some(p) => p.current_num_threads(),
        None => rayon::current_num_threads(),
    })
}
