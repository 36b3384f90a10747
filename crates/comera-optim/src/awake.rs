//! Keeping the pool's other workers awake through a training step.
//!
//! A step alternates parallel sections (products, row-parallel element-wise passes, the two
//! TT chains side by side) with short serial ones. A rayon worker that finds no work spins
//! for a few dozen `sched_yield`s and then sleeps; the next parallel section pays for waking
//! it (a futex wake, and on a virtual machine the wait for its vCPU). At batch 1 a step has
//! hundreds of such sections. While a step runs, the other workers instead run a poller that
//! takes the step's work as soon as it is pushed (`rayon::yield_now`) and spins otherwise, as
//! OpenMP runtimes do by default. Which worker runs a piece of work never changes its result.
//!
//! Measured (`comera --threads 2 bench step --batch 1 --models tt`, 3 interleaved runs each,
//! medians): rank 30 21.67 → 20.04 ms, rank 15 13.82 → 13.22 ms; batch 32 unchanged (a few
//! sections of 10+ ms each); the default review run bit-identical.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Nanoseconds the pollers have found no work, summed over every poller since the process
/// started: the time the pool's other workers waited (at the step's serial parts and at its
/// barriers) instead of computing. Shared by every step in the process; a benchmark reads it
/// around one step at a time ([`pool_idle`]).
static IDLE_NS: AtomicU64 = AtomicU64::new(0);

/// The pollers' idle time so far (see `IDLE_NS`); the difference over one step is the time
/// its other workers waited, summed over them (a perfectly parallel step: zero; a serial one:
/// (threads − 1) × its length).
pub(crate) fn pool_idle() -> Duration {
    Duration::from_nanos(IDLE_NS.load(Ordering::Relaxed))
}

/// Runs `f` on this worker while the pool's other workers poll for its parallel work instead
/// of going to sleep between its parallel sections. Just runs `f` when `wanted` is false, off a
/// pool worker, with one thread, or with more threads than this process may run on at once
/// (`available_parallelism`: the CPU affinity, e.g. `mpirun`'s binding), where a spinning
/// poller would take a core from the step itself. Allocates nothing (the pollers are
/// `rayon::join` jobs on this stack).
pub(crate) fn with_workers_awake<R>(wanted: bool, f: impl FnOnce() -> R) -> R {
    let Some(me) = rayon::current_thread_index() else {
        return f();
    };
    let threads = rayon::current_num_threads();
    if !wanted || threads < 2 || threads > usable_cores() {
        return f();
    }
    let others = threads - 1;
    let stop = AtomicBool::new(false);
    let stop_ref = &stop;
    let run = OnThisThread(move || {
        let r = f();
        // The joins then wait for the pollers, which see this at their next poll (the step's
        // own work is all done by now).
        stop_ref.store(true, Ordering::Release);
        r
    });
    with_pollers(others, me, &stop, run).0
}

/// CPUs this process may run on (`available_parallelism`), read once: on Linux it reads the
/// affinity mask and cgroup files, which is no work for every training step.
fn usable_cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// `f` as the first half of `k` nested joins whose second halves are pollers.
fn with_pollers<R, F: FnOnce() -> R>(
    k: usize,
    me: usize,
    stop: &AtomicBool,
    f: OnThisThread<F>,
) -> OnThisThread<R> {
    if k == 0 {
        return OnThisThread((f.0)());
    }
    rayon::join(|| with_pollers(k - 1, me, stop, f), || poll(me, stop)).0
}

/// Takes the pool's pending work until `stop`, spinning when there is none. On the stepping
/// worker itself (taken from its own queue while it waits in a join) it returns at once: it
/// must never hold up the step.
fn poll(me: usize, stop: &AtomicBool) {
    if rayon::current_thread_index() == Some(me) {
        return;
    }
    // Since when this poller has found the queues empty (None: it has just worked). A stretch
    // ends where the call that found work began (`asked`), not where that work ended.
    let mut idle_since: Option<Instant> = None;
    let mut idle = Duration::ZERO;
    while !stop.load(Ordering::Acquire) {
        let asked = Instant::now();
        if let Some(rayon::Yield::Idle) = rayon::yield_now() {
            idle_since.get_or_insert(asked);
            std::hint::spin_loop();
        } else if let Some(t) = idle_since.take() {
            idle += asked - t;
        }
    }
    if let Some(t) = idle_since {
        idle += t.elapsed();
    }
    IDLE_NS.fetch_add(idle.as_nanos() as u64, Ordering::Relaxed);
}

/// A value (the step closure, its result) that `rayon::join` only ever moves within the
/// calling thread: called on a pool worker, `join` runs its first closure on that thread, and
/// the value is made and consumed there. The step closure borrows things that are not `Send`
/// (a data loader's callback), which is sound because they never leave this thread.
struct OnThisThread<T>(T);

// SAFETY: see the type's doc: `with_workers_awake` builds it only on a pool worker (checked)
// and `with_pollers` hands it only to the first closure of `rayon::join`, which runs on that
// same worker; the pollers (the second closures, which may run elsewhere) never touch it.
unsafe impl<T> Send for OnThisThread<T> {}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nested parallel work inside the awake section completes with the same result on 1, 2
    /// and 4 threads, and the section returns (no poller is left holding a worker).
    #[test]
    fn parallel_work_inside_completes_on_every_pool_size() {
        fn sum(v: &[u64]) -> u64 {
            if v.len() <= 64 {
                return v.iter().sum();
            }
            let (a, b) = v.split_at(v.len() / 2);
            let (x, y) = rayon::join(|| sum(a), || sum(b));
            x + y
        }
        let v: Vec<u64> = (0..100_000).collect();
        for threads in [1, 2, 4] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let got = pool.install(|| {
                (0..20)
                    .map(|_| with_workers_awake(true, || sum(&v)))
                    .sum::<u64>()
            });
            assert_eq!(got, 20 * (100_000 * 99_999 / 2), "{threads} threads");
        }
        // Off the pool it just runs.
        assert_eq!(with_workers_awake(true, || 7), 7);
    }
}
