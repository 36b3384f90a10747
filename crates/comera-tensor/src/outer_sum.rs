//! Sums of outer products on AVX2 + FMA: C (r × W) = Pᵀ·Q for P (K × r) narrow (r ≤ `MAX_R`)
//! and Q (K × W), both with rows contiguous, K long:
//!
//! ```text
//! C[i, j] = Σ_k P[k, i] · Q[k, j]        (k ascending, one FMA per k, from 0)
//! ```
//!
//! These are the weight gradients of a batch: in the TT merged path dR = T1ᵀ·dY (r_p × M) and
//! dL = Xᵀ·U1 = (U1ᵀ·X)ᵀ, each summed over the B tokens of the batch. `faer` packs both
//! operands for them and ran them at 53-74 GFLOP/s on 2 Zen 3 cores (B = 4,096, r_p = 30,
//! W = 768 or 3,072), against 80-124 for the layer's other four products.
//!
//! Here C is walked in strips of 16 columns (two 8-lane registers per row). Within a strip,
//! K is walked in blocks of `KB` rows, so that the strip's block of Q (KB × 64 bytes) and the
//! block of P stay in L1 while every row tile of C passes over them; a row tile is 6 rows of
//! C × 16 columns: 12 accumulators, and per k two loads of Q's row chunk, six broadcasts of P
//! and 12 FMAs. The strip's sums are carried from block to block in a small buffer and
//! written to C (any strides; added to C when accumulating) at the end. The last strip's
//! missing columns (W mod 16) are packed as zeros and not written.
//!
//! Every element is summed in one fixed order (above), whatever the tile, the block or the
//! thread that computes it, so the bits do not depend on how the strips are split between
//! threads. Used only where the CPU has AVX2 and FMA (detected once); elsewhere `faer`
//! computes these products.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Widest P (the narrow side, rows of C) handled here: ranks up to 39 with the bias's column.
pub(crate) const MAX_R: usize = 40;

/// Shortest K worth a call: below it the strip buffer's round trip and the C writes weigh.
pub(crate) const MIN_K: usize = 256;

/// Narrowest Q handled here: 16 strips, 8 a thread on 2. Narrower products (the sequential
/// path's, e.g. K = 262,144 × r = 12 × W = 30) leave threads idle on too few strips and ran
/// no faster than `faer`.
pub(crate) const MIN_W: usize = 256;

/// Rows of K per block (see the module doc): Q's block 8 KiB, P's at r = 30 15 KiB.
#[cfg(target_arch = "x86_64")]
const KB: usize = 128;

/// Rows of C per register tile.
#[cfg(target_arch = "x86_64")]
const TILE_R: usize = 6;

/// A product for these kernels: raw views whose extents were checked by their owners (built
/// from bounds-checked `MatRef`/`MatMut`s).
#[derive(Clone, Copy)]
pub(crate) struct OuterSum {
    /// K, r and W.
    pub k: usize,
    pub r: usize,
    pub w: usize,
    /// P (K × r): element (k, i) at `p[k·p_rs + i]`.
    pub p: *const f32,
    pub p_rs: usize,
    /// Q (K × W): element (k, j) at `q[k·q_rs + j]`.
    pub q: *const f32,
    pub q_rs: usize,
    /// C (r × W): element (i, j) at `c[i·c_rs + j·c_cs]`.
    pub c: *mut f32,
    pub c_rs: usize,
    pub c_cs: usize,
    pub accumulate: bool,
}

// SAFETY: an `OuterSum` is only handed to threads that write disjoint column ranges of C
// (`compute` splits by strips) and read P and Q, which nobody writes during the call.
unsafe impl Send for OuterSum {}
unsafe impl Sync for OuterSum {}

/// Whether this CPU runs these kernels (AVX2 and FMA), detected once.
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether a product of this shape is one for these kernels on this CPU.
pub(crate) fn suits(k: usize, r: usize, w: usize) -> bool {
    available() && (1..=MAX_R).contains(&r) && k >= MIN_K && w >= MIN_W
}

/// Computes `s` (which must `suit`) with its strips split into `parts` contiguous ranges run
/// with `rayon::join`.
///
/// # Safety
/// Every element of P, Q and C that the strides address for the given shape lies in a live
/// allocation, C overlaps neither P nor Q, and nothing else reads or writes C during the call.
pub(crate) unsafe fn compute(s: OuterSum, parts: usize) {
    debug_assert!(suits(s.k, s.r, s.w));
    let strips = s.w.div_ceil(16);
    split(s, 0, strips, parts.clamp(1, strips));
}

/// Strips `[a, b)` of `s` on `parts` threads.
fn split(s: OuterSum, a: usize, b: usize, parts: usize) {
    if parts <= 1 {
        // SAFETY: `compute`'s caller vouches for the views; AVX2 and FMA are present
        // (`suits`); the columns of these strips are written by this call only.
        #[cfg(target_arch = "x86_64")]
        SUMS.with(|sums| unsafe {
            strips_sum(&s, a * 16, (b * 16).min(s.w), &mut sums.borrow_mut())
        });
        return;
    }
    let left = parts / 2;
    let at = a + (b - a) * left / parts;
    crate::join(|| split(s, a, at, left), || split(s, at, b, parts - left));
}

thread_local! {
    /// The sums of a thread's columns of C (r × their count), carried from block to block.
    static SUMS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The columns `ja .. jb` of C (`ja` a multiple of 16), summed in `sums` (resized to
/// r × the strips' padded width) and then written to C.
///
/// K is the outer loop, so Q is read along its rows, block after block (read a strip at a
/// time down all K rows, every row is a new page: 4,096 rows of 3,072 floats missed the TLB
/// on every line and ran at a third of this speed).
///
/// # Safety
/// As [`compute`], and the CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn strips_sum(s: &OuterSum, ja: usize, jb: usize, sums: &mut Vec<f32>) {
    let wp = (jb - ja).div_ceil(16) * 16; // padded to whole strips
    sums.clear();
    sums.resize(s.r * wp, 0.0); // r × wp, row i at i·wp
    let mut packed = [0.0f32; KB * 16]; // a strip of Q's block, KB × 16
    let mut tile_sums = [0.0f32; TILE_R * 16];
    for k0 in (0..s.k).step_by(KB) {
        let kn = (s.k - k0).min(KB);
        // SAFETY: rows k0..k0+kn of P are inside its view (the caller's promise for k < K).
        let p = unsafe { s.p.add(k0 * s.p_rs) };
        for j0 in (ja..jb).step_by(16) {
            // Q's rows are a long stride apart (often a multiple of 4 KiB), so the block's
            // lines would share a few L1 sets and evict each other between row tiles: copy
            // them into one contiguous block first, the last strip's missing columns as 0.
            let mask = lane_mask(jb - j0);
            for k in 0..kn {
                // SAFETY: row k0 + k of Q, columns j0.. up to jb (the masks' lanes), is
                // inside the view; `packed` has KB·16 floats.
                unsafe {
                    let src = s.q.add((k0 + k) * s.q_rs + j0);
                    let dst = packed.as_mut_ptr().add(k * 16);
                    _mm256_storeu_ps(dst, _mm256_maskload_ps(src, mask.0));
                    _mm256_storeu_ps(dst.add(8), _mm256_maskload_ps(src.add(8), mask.1));
                }
            }
            let mut i = 0;
            while i < s.r {
                let rows = (s.r - i).min(TILE_R);
                let acc = &mut tile_sums[..rows * 16];
                for (t, row) in acc.chunks_exact_mut(16).enumerate() {
                    row.copy_from_slice(&sums[(i + t) * wp + j0 - ja..][..16]);
                }
                // SAFETY: columns i..i+rows of P's block are inside; `packed` holds kn rows.
                unsafe {
                    let (p, q) = (p.add(i), packed.as_ptr());
                    match rows {
                        6 => tile::<6>(p, s.p_rs, q, kn, acc),
                        5 => tile::<5>(p, s.p_rs, q, kn, acc),
                        4 => tile::<4>(p, s.p_rs, q, kn, acc),
                        3 => tile::<3>(p, s.p_rs, q, kn, acc),
                        2 => tile::<2>(p, s.p_rs, q, kn, acc),
                        _ => tile::<1>(p, s.p_rs, q, kn, acc),
                    }
                }
                for (t, row) in acc.chunks_exact(16).enumerate() {
                    sums[(i + t) * wp + j0 - ja..][..16].copy_from_slice(row);
                }
                i += rows;
            }
        }
    }
    for i in 0..s.r {
        for j in ja..jb {
            // SAFETY: (i, j) is inside C, and only this call writes these columns.
            let c = unsafe { &mut *s.c.add(i * s.c_rs + j * s.c_cs) };
            let v = sums[i * wp + j - ja];
            *c = if s.accumulate { *c + v } else { v };
        }
    }
}

/// Load masks of the lanes `0 .. min(width, 16)` of a strip's two registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn lane_mask(width: usize) -> (__m256i, __m256i) {
    let lane = |l: usize| if l < width { -1 } else { 0 };
    let m = |o: usize| {
        _mm256_setr_epi32(
            lane(o),
            lane(o + 1),
            lane(o + 2),
            lane(o + 3),
            lane(o + 4),
            lane(o + 5),
            lane(o + 6),
            lane(o + 7),
        )
    };
    (m(0), m(8))
}

/// `acc (R × 16) += Σ_{k < kn} P[k, 0..R]ᵀ · Q[k, 0..16]` for Q a packed block (row k at
/// `q + 16·k`): R × 2 accumulators held in registers over the block.
///
/// # Safety
/// The CPU has AVX2 and FMA; `p[k·p_rs + i]` (i < R) is inside P's view and `q` holds kn
/// rows of 16 for k < kn; `acc` has R·16 elements.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile<const R: usize>(
    p: *const f32,
    p_rs: usize,
    q: *const f32,
    kn: usize,
    acc: &mut [f32],
) {
    debug_assert_eq!(acc.len(), R * 16);
    let mut lo = [_mm256_setzero_ps(); R];
    let mut hi = [_mm256_setzero_ps(); R];
    for i in 0..R {
        // SAFETY: acc has R·16 floats.
        unsafe {
            lo[i] = _mm256_loadu_ps(acc.as_ptr().add(i * 16));
            hi[i] = _mm256_loadu_ps(acc.as_ptr().add(i * 16 + 8));
        }
    }
    for k in 0..kn {
        // SAFETY: row k of both blocks is inside (the caller's promise).
        unsafe {
            let qk = q.add(k * 16);
            let (q0, q1) = (_mm256_loadu_ps(qk), _mm256_loadu_ps(qk.add(8)));
            let pk = p.add(k * p_rs);
            for i in 0..R {
                let a = _mm256_broadcast_ss(&*pk.add(i));
                lo[i] = _mm256_fmadd_ps(a, q0, lo[i]);
                hi[i] = _mm256_fmadd_ps(a, q1, hi[i]);
            }
        }
    }
    for i in 0..R {
        // SAFETY: as above.
        unsafe {
            _mm256_storeu_ps(acc.as_mut_ptr().add(i * 16), lo[i]);
            _mm256_storeu_ps(acc.as_mut_ptr().add(i * 16 + 8), hi[i]);
        }
    }
}
