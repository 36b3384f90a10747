//! Scratch buffers shared by every layer that runs on a thread.
//!
//! A layer's transient buffers (gated cores, chain products, gradient ping-pongs) are only
//! needed during one forward or backward call, so instead of each of a model's dozens of
//! layers owning its own set, a [`Lease`] borrows them from a per-thread pool for the call and
//! hands them back at its end. After the first step the pool holds enough buffers for the
//! largest layer and no call allocates.
//!
//! Lent buffers hold whatever the previous borrower left in them: every user writes an element
//! before it reads it (results therefore do not depend on the pool's history).

use std::cell::RefCell;

thread_local! {
    /// Idle buffers of this thread, each at its full initialised length.
    static POOL: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// Bytes of scratch held by this thread's pool (idle buffers; lent ones are counted by their
/// leases while lent, which is only during a layer call).
pub fn pooled_bytes() -> usize {
    POOL.with(|p| 4 * p.borrow().iter().map(Vec::capacity).sum::<usize>())
}

/// Frees this thread's idle scratch buffers (e.g. after the model shrank).
pub fn clear_pool() {
    POOL.with(|p| p.borrow_mut().clear());
}

/// A fixed list of buffer lengths, borrowed from the thread's pool between [`Lease::acquire`]
/// and [`Lease::release`]; derefs to the buffers (empty while not acquired).
#[derive(Debug, Default)]
pub(crate) struct Lease {
    lens: Vec<usize>,
    bufs: Vec<Vec<f32>>,
    /// Initialised length of each lent buffer (≥ its `lens` entry), restored on release.
    full: Vec<usize>,
    held: bool,
}

impl Lease {
    pub fn new(lens: Vec<usize>) -> Lease {
        let n = lens.len();
        Lease {
            lens,
            bufs: (0..n).map(|_| Vec::new()).collect(),
            full: vec![0; n],
            held: false,
        }
    }

    /// Bytes this lease borrows while acquired.
    pub fn bytes(&self) -> usize {
        4 * self.lens.iter().sum::<usize>()
    }

    /// Borrows one buffer per length (exactly that long) from the pool: for each, the smallest
    /// idle buffer that is long enough, else the longest one grown (new elements zeroed).
    pub fn acquire(&mut self) {
        assert!(!self.held, "scratch lease acquired twice");
        self.held = true;
        POOL.with(|p| {
            let mut pool = p.borrow_mut();
            for (i, &len) in self.lens.iter().enumerate() {
                let fit = pool
                    .iter()
                    .enumerate()
                    .filter(|(_, b)| b.len() >= len)
                    .min_by_key(|(_, b)| b.len())
                    .map(|(j, _)| j)
                    .or_else(|| {
                        pool.iter()
                            .enumerate()
                            .max_by_key(|(_, b)| b.len())
                            .map(|(j, _)| j)
                    });
                let mut v = match fit {
                    Some(j) => pool.swap_remove(j),
                    None => Vec::new(),
                };
                if v.len() < len {
                    v.resize(len, 0.0);
                }
                self.full[i] = v.len();
                v.truncate(len);
                self.bufs[i] = v;
            }
        });
    }

    /// Hands every buffer back to the pool (nothing if not acquired).
    pub fn release(&mut self) {
        if !std::mem::replace(&mut self.held, false) {
            return;
        }
        POOL.with(|p| {
            let mut pool = p.borrow_mut();
            for (v, &full) in self.bufs.iter_mut().zip(&self.full) {
                let mut v = std::mem::take(v);
                assert!(full <= v.capacity() && v.len() <= full);
                // SAFETY: the first `full` elements were initialised before the buffer was
                // lent (it was that long then), truncating an f32 buffer leaves them in place,
                // and `full` is within the capacity (checked above).
                unsafe { v.set_len(full) };
                pool.push(v);
            }
        });
    }
}

impl std::ops::Deref for Lease {
    type Target = [Vec<f32>];
    fn deref(&self) -> &[Vec<f32>] {
        &self.bufs
    }
}

impl std::ops::DerefMut for Lease {
    fn deref_mut(&mut self) -> &mut [Vec<f32>] {
        &mut self.bufs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_reuse_buffers_and_keep_exact_lengths() {
        clear_pool();
        let mut a = Lease::new(vec![10, 3]);
        a.acquire();
        assert_eq!((a[0].len(), a[1].len()), (10, 3));
        a[0].fill(1.0);
        a.release();
        assert!(a[0].is_empty());
        let before = pooled_bytes();
        let mut b = Lease::new(vec![4]);
        b.acquire();
        assert_eq!(
            b[0].len(),
            4,
            "the 3-long buffer grows or the 10-long one is cut"
        );
        b.release();
        let mut c = Lease::new(vec![10, 3]);
        c.acquire();
        c.release();
        assert_eq!(pooled_bytes(), before.max(pooled_bytes()));
        clear_pool();
        assert_eq!(pooled_bytes(), 0);
    }
}
