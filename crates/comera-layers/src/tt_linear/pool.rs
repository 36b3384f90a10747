//! Scratch buffers shared by every layer that runs on a thread.
//!
//! A layer's transient buffers (gated cores, chain products, gradient ping-pongs) are only
//! needed during one forward or backward call, so instead of each of a model's dozens of
//! layers owning its own set, a [`Lease`] lends them from a per-thread pool for the call: its
//! [`Lease::acquire`] returns a guard, [`Lent`], that holds the buffers and hands them back
//! when it is dropped, on every path out of the call (early returns and panics included). After
//! the first step the pool holds enough buffers for the largest layer and no call allocates.
//!
//! Lent buffers hold whatever the previous borrower left in them: every user writes an element
//! before it reads it (results therefore do not depend on the pool's history).
//!
//! No `unsafe`: a lent buffer ([`Scratch`]) keeps its vector at its full initialised length
//! and shows only its first `len` elements, so handing it back needs no `set_len`, and its
//! vector is never exposed (nothing can swap, shrink or de-initialise it while lent).

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

/// One lent buffer: derefs to its first `len` elements (the length its lease asked for).
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    /// The pool's buffer at its full initialised length (≥ `len`), as it goes back.
    buf: Vec<f32>,
    len: usize,
}

impl std::ops::Deref for Scratch {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf[..self.len]
    }
}

impl std::ops::DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[..self.len]
    }
}

/// A fixed list of buffer lengths, lent from the thread's pool while a [`Lent`] from
/// [`Lease::acquire`] lives. The lease owns the slots the lent buffers sit in (made once, with
/// the lease), so lending allocates nothing once the pool is warm.
#[derive(Debug, Default)]
pub(crate) struct Lease {
    lens: Vec<usize>,
    slots: Vec<Scratch>,
}

impl Lease {
    pub fn new(lens: Vec<usize>) -> Lease {
        let slots = lens.iter().map(|_| Scratch::default()).collect();
        Lease { lens, slots }
    }

    /// Bytes this lease borrows while acquired.
    pub fn bytes(&self) -> usize {
        4 * self.lens.iter().sum::<usize>()
    }

    /// Borrows one buffer per length (exactly that long) from the pool: for each, the smallest
    /// idle buffer that is long enough, else the longest one grown (new elements zeroed). The
    /// buffers go back to the pool when the returned guard is dropped. The guard borrows the
    /// lease mutably, so a lease is lent at most once at a time.
    pub fn acquire(&mut self) -> Lent<'_> {
        POOL.with(|p| {
            let mut pool = p.borrow_mut();
            for (slot, &len) in self.slots.iter_mut().zip(&self.lens) {
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
                let mut buf = match fit {
                    Some(j) => pool.swap_remove(j),
                    None => Vec::new(),
                };
                if buf.len() < len {
                    buf.resize(len, 0.0);
                }
                *slot = Scratch { buf, len };
            }
        });
        Lent {
            slots: &mut self.slots,
        }
    }
}

/// A lease's buffers while lent: derefs to them (one [`Scratch`] per length, in order) and
/// hands every one back to the thread's pool when dropped. One pointer wide; lending and
/// returning move vectors between the pool and the lease's slots, nothing more.
#[derive(Debug)]
pub(crate) struct Lent<'a> {
    slots: &'a mut [Scratch],
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        let bufs = self.slots.iter_mut().map(|s| {
            s.len = 0;
            std::mem::take(&mut s.buf)
        });
        // A guard dropped while its thread's locals are being destroyed finds no pool: its
        // buffers then stay in the lease's slots and are freed with it.
        let _ = POOL.try_with(|p| p.borrow_mut().extend(bufs));
    }
}

impl std::ops::Deref for Lent<'_> {
    type Target = [Scratch];
    fn deref(&self) -> &[Scratch] {
        self.slots
    }
}

impl std::ops::DerefMut for Lent<'_> {
    fn deref_mut(&mut self) -> &mut [Scratch] {
        self.slots
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_reuse_buffers_and_keep_exact_lengths() {
        clear_pool();
        let mut a = Lease::new(vec![10, 3]);
        {
            let mut lent = a.acquire();
            assert_eq!((lent[0].len(), lent[1].len()), (10, 3));
            lent[0].fill(1.0);
        }
        let before = pooled_bytes();
        assert!(before >= 4 * 13, "both buffers are back in the pool");
        let mut b = Lease::new(vec![4]);
        assert_eq!(
            b.acquire()[0].len(),
            4,
            "the 3-long buffer grows or the 10-long one is cut"
        );
        let mut c = Lease::new(vec![10, 3]);
        drop(c.acquire());
        assert_eq!(pooled_bytes(), before.max(pooled_bytes()));
        clear_pool();
        assert_eq!(pooled_bytes(), 0);
    }

    #[test]
    fn an_early_return_or_a_panic_hands_the_buffers_back() {
        clear_pool();
        let mut a = Lease::new(vec![8, 8]);
        let early = |a: &mut Lease| -> Option<()> {
            let lent = a.acquire();
            lent.first().filter(|s| s.is_empty())?; // returns here
            unreachable!("the buffers are 8 long")
        };
        assert!(early(&mut a).is_none());
        assert_eq!(pooled_bytes(), 4 * 16);
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _lent = a.acquire();
            panic!("a failed check inside a layer call");
        }));
        assert!(panicked.is_err());
        assert_eq!(pooled_bytes(), 4 * 16, "nothing stays lent");
        clear_pool();
    }
}
