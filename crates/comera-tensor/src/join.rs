//! [`join`]: `rayon::join` whose caller never sleeps while it waits; [`for_each`]: a parallel
//! iterator's `for_each` on it; [`for_each_claimed`]: units of equal work claimed one at a
//! time by a few tasks, each with its own scratch.
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

use rayon::iter::plumbing::{Producer, ProducerCallback};
use rayon::iter::IndexedParallelIterator;
use rayon::slice::ParallelSliceMut;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

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

/// `iter.for_each(f)` for an indexed parallel iterator whose items are each worth a task (row
/// blocks, chunks of thousands of elements, lanes): the items cut in halves down to single
/// items, each fork a [`join`].
///
/// Why not rayon's own `for_each`: it forks with `rayon::join`, whose caller sleeps when the
/// half it waits for outlives its own by more than a few dozen yields (module doc), and it
/// cuts a loop into about two pieces a thread, cut again only when a piece is stolen, so at 2
/// threads the last quarter of a loop of 16 row blocks can be left to one thread. A step at
/// batch 1 runs hundreds of such loops of tens of µs each (LayerNorm's row blocks, element-wise
/// passes, dropout masks, AdamW's chunks). Here the caller spins as in [`join`], and a thread
/// that is done takes the other's untaken halves down to one item. Which thread computes an
/// item never changes a result.
pub fn for_each<I, F>(iter: I, f: F)
where
    I: IndexedParallelIterator,
    F: Fn(I::Item) + Sync + Send,
{
    struct Halves<F> {
        f: F,
        len: usize,
    }
    impl<T, F: Fn(T) + Sync + Send> ProducerCallback<T> for Halves<F> {
        type Output = ();
        fn callback<P: Producer<Item = T>>(self, producer: P) {
            halves(producer, self.len, &self.f);
        }
    }
    fn halves<P: Producer>(p: P, len: usize, f: &(impl Fn(P::Item) + Sync + Send)) {
        if len <= 1 {
            p.into_iter().for_each(f);
            return;
        }
        let (a, b) = p.split_at(len / 2);
        join(|| halves(a, len / 2, f), || halves(b, len - len / 2, f));
    }
    let len = iter.len();
    iter.with_producer(Halves { f, len });
}

/// `f(u, scratch)` for every unit `u` in `0..units`, each exactly once: `scratch` is cut into
/// slots of `slot_len` floats, one task a slot (forked as [`for_each`] forks), and each task
/// claims the next unclaimed unit from a shared counter until none is left (OpenMP's dynamic
/// schedule), passing its own slot.
///
/// Why not fixed groups of units, one a thread: a thread that the machine delays (a busy
/// virtual machine's neighbours, an interrupt) then holds up the end of the whole loop by its
/// delay, and a thread that is not free when the loop starts leaves its group to the end; here
/// the others take its units and the loop ends at most one unit after its last claim. Which
/// slot computes a unit varies from run to run, so `f`'s results must not depend on what the
/// slot holds on entry (scratch only); then they do not depend on the thread count either.
pub fn for_each_claimed<F>(units: usize, scratch: &mut [f32], slot_len: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync + Send,
{
    assert!(
        slot_len > 0 && !scratch.is_empty() && scratch.len().is_multiple_of(slot_len),
        "for_each_claimed: {} scratch floats in slots of {slot_len}",
        scratch.len()
    );
    let next = AtomicUsize::new(0);
    for_each(scratch.par_chunks_mut(slot_len), |slot| loop {
        // Relaxed: the counter only hands out indices; each unit's data is reached through
        // `f`, and the forks' joins order everything before and after the loop.
        let u = next.fetch_add(1, Ordering::Relaxed);
        if u >= units {
            break;
        }
        f(u, slot);
    });
}

#[cfg(test)]
mod tests {
    use super::{for_each, for_each_claimed, join};
    use rayon::prelude::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
    }

    #[test]
    fn runs_both_on_one_thread_and_on_several() {
        for threads in [1, 2, 3] {
            let pool = pool(threads);
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

    #[test]
    fn for_each_visits_every_item_once_in_zipped_chunks_on_any_pool() {
        for threads in [1, 2, 3] {
            let pool = pool(threads);
            for len in [0usize, 1, 5, 16, 1000] {
                let x: Vec<f32> = (0..len).map(|i| i as f32).collect();
                let mut y = vec![0.0f32; len];
                let mut seen = vec![0u8; len.div_ceil(7)];
                pool.install(|| {
                    for_each(
                        y.par_chunks_mut(7)
                            .zip(x.par_chunks(7))
                            .zip(seen.par_iter_mut())
                            .enumerate(),
                        |(c, ((y, x), seen))| {
                            *seen += 1;
                            for (i, (y, x)) in y.iter_mut().zip(x).enumerate() {
                                *y = 2.0 * x + (c * 7 + i) as f32;
                            }
                        },
                    )
                });
                assert!(seen.iter().all(|&s| s == 1), "{threads} threads, {len}");
                assert!(y.iter().enumerate().all(|(i, &v)| v == 3.0 * i as f32));
            }
        }
    }

    #[test]
    fn for_each_claimed_runs_every_unit_once_with_a_whole_slot() {
        for threads in [1, 2, 3] {
            let pool = pool(threads);
            for (units, slots) in [(0usize, 1usize), (1, 3), (5, 2), (100, 3)] {
                let runs: Vec<AtomicU32> = (0..units).map(|_| AtomicU32::new(0)).collect();
                let mut scratch = vec![0.0f32; slots * 4];
                pool.install(|| {
                    for_each_claimed(units, &mut scratch, 4, |u, slot| {
                        assert_eq!(slot.len(), 4);
                        slot.fill(u as f32);
                        runs[u].fetch_add(1, Ordering::Relaxed);
                    })
                });
                assert!(
                    runs.iter().all(|r| r.load(Ordering::Relaxed) == 1),
                    "{threads} threads, {units} units, {slots} slots"
                );
            }
        }
    }
}
