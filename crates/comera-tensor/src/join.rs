//! [`join`]: `rayon::join` whose caller never sleeps while it waits.
//!
//! The thread that calls `rayon::join(a, b)` runs `a`; `b` waits in its queue for another
//! worker to take it. If `b` is not done when `a` is, rayon has the caller look for other work
//! and, after a few dozen `sched_yield`s without any, puts it to sleep, to be woken when `b`
//! ends: on a virtual machine that wake-up costs some 20-50 µs (measured inside the training
//! step at batch 1: a TT layer's backward round took 509 µs against 350 and 464 µs for its two
//! tasks). A training step forks hundreds of times, its forks last tens to hundreds of µs, and
//! the pool's other workers spin between them (`comera-optim`'s `awake`), so the caller does
//! the same: it keeps taking the pool's pending work (`rayon::yield_now`, which also runs `b`
//! itself when nobody took it) until `b` is done. Which thread runs what never changes a
//! result.

use std::sync::atomic::{AtomicBool, Ordering};

/// `(a(), b())`, `b` possibly on another worker (as `rayon::join`), the caller spinning for it
/// instead of sleeping (module doc).
pub fn join<A, B, RA, RB>(a: A, b: B) -> (RA, RB)
where
    A: FnOnce() -> RA + Send,
    B: FnOnce() -> RB + Send,
    RA: Send,
    RB: Send,
{
    let done = AtomicBool::new(false);
    rayon::join(
        || {
            let ra = a();
            // `b` is either running elsewhere or still on top of this worker's queue, where
            // `yield_now` takes it (a nested join's jobs are all gone by the time it returns).
            while !done.load(Ordering::Acquire) {
                if rayon::yield_now() != Some(rayon::Yield::Executed) {
                    std::hint::spin_loop();
                }
            }
            ra
        },
        || {
            let rb = b();
            done.store(true, Ordering::Release);
            rb
        },
    )
}

#[cfg(test)]
mod tests {
    use super::join;

    #[test]
    fn runs_both_on_one_thread_and_on_several() {
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let (a, b) = pool.install(|| {
                join(
                    || (0..1000u64).sum::<u64>(),
                    || join(|| 2u64, || (1..=10u64).product::<u64>()),
                )
            });
            assert_eq!((a, b), (499_500, (2, 3_628_800)));
        }
        // Off a pool (rayon's global one).
        assert_eq!(join(|| 1, || 2), (1, 2));
    }
}
