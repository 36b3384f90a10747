//! Seeded dropout with inverted scaling.
//!
//! Training: y_i = m_i·x_i/(1 − p) with m_i ∈ {0, 1}, P(m_i = 0) = p; backward
//! dx_i = m_i·dy_i/(1 − p). Evaluation (or p = 0): y = x, dx = dy.
//!
//! The mask is a pure function of (seed, step, i): a counter-based hash
//!   k = mix(seed ⊕ mix(step + φ)),   u_i = mix(k + (i + 1)·φ)   (mix = SplitMix64's finaliser,
//!   φ = 0x9E3779B97F4A7C15), m_i = [⌊u_i / 2³²⌋ ≥ round(p·2³²)],
//! so the same seed and step give the same mask on every machine and thread count, and no
//! generator state is carried between steps. Give every dropout site its own seed. The mask is
//! kept as a bitmask (1 = kept) in the workspace for backward.

use crate::check_len;
use crate::elementwise::CHUNK;

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function (a bijection on u64 with good avalanche).
#[inline(always)]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// ⌊u_i / 2³²⌋ of element `i` under the step's `key`: u_i = mix(k + (i + 1)·φ) (module doc).
#[inline(always)]
fn hash_hi(key: u64, i: u64) -> u64 {
    mix64(key.wrapping_add(i.wrapping_add(1).wrapping_mul(GOLDEN))) >> 32
}

/// Seeded inverted dropout with drop probability `p`.
#[derive(Clone, Copy, Debug)]
pub struct Dropout {
    pub p: f32,
    pub seed: u64,
}

/// The mask of the last forward, for a fixed number of elements.
#[derive(Debug)]
pub struct DropoutWorkspace {
    len: usize,
    /// Whether the last forward dropped anything (training with p > 0); if not, backward is
    /// the identity.
    active: bool,
    bits: Vec<u64>, // (⌈len/64⌉), bit i%64 of word i/64 = m_i
}

/// A drawn mask for kernels that apply it inside their own pass (the residual + LayerNorm of
/// [`crate::norm::LayerNorm::forward_residual`]): element i is kept iff bit i % 64 of word
/// i / 64 is set, and a kept element is scaled by `scale` = 1/(1 − p).
#[derive(Clone, Copy, Debug)]
pub struct Mask<'a> {
    bits: &'a [u64],
    scale: f32,
}

impl Mask<'_> {
    /// `out_j = x_j + m_{e0+j}·scale·branch_j` over one run of elements starting at element
    /// `e0` of the mask: the same value as dropping `branch` out and adding it to `x`.
    #[track_caller]
    pub fn add_dropped(&self, e0: usize, x: &[f32], branch: &[f32], out: &mut [f32]) {
        check_len("Mask::add_dropped x", x.len(), out.len());
        check_len("Mask::add_dropped branch", branch.len(), out.len());
        self.runs(e0, out.len(), |bits, lo, hi| {
            kernels::add_masked(
                bits,
                self.scale,
                &x[lo..hi],
                &branch[lo..hi],
                &mut out[lo..hi],
            )
        });
    }

    /// `out_j = m_{e0+j}·scale·v_j` over one run of elements starting at element `e0`.
    #[track_caller]
    pub fn apply(&self, e0: usize, v: &[f32], out: &mut [f32]) {
        check_len("Mask::apply v", v.len(), out.len());
        self.runs(e0, out.len(), |bits, lo, hi| {
            kernels::apply_mask(bits, self.scale, &v[lo..hi], &mut out[lo..hi])
        });
    }

    /// Splits elements e0..e0+len into runs that start on a mask word (the vector kernels
    /// take whole words from bit 0): `f(words, lo, hi)` for local indices lo..hi, with the
    /// words of a run that starts inside a word shifted down to its first element (at most 63
    /// elements, the row's head, when a row is not a whole number of words long).
    fn runs(&self, e0: usize, len: usize, mut f: impl FnMut(&[u64], usize, usize)) {
        let head = ((64 - e0 % 64) % 64).min(len);
        if head > 0 {
            let word = [self.bits[e0 / 64] >> (e0 % 64)];
            f(&word, 0, head);
        }
        if head < len {
            f(&self.bits[(e0 + head) / 64..], head, len);
        }
    }
}

impl DropoutWorkspace {
    /// Whether element `i` was kept by the last forward (always true when it was the identity).
    pub fn kept(&self, i: usize) -> bool {
        assert!(
            i < self.len,
            "dropout mask index {i} out of range {}",
            self.len
        );
        !self.active || (self.bits[i / 64] >> (i % 64)) & 1 == 1
    }

    /// Whether the last forward applied a mask (training with p > 0).
    pub fn is_active(&self) -> bool {
        self.active
    }

    /// The last forward's mask with the layer's scale, or `None` if it was the identity.
    pub fn mask(&self, dropout: &Dropout) -> Option<Mask<'_>> {
        self.active.then_some(Mask {
            bits: &self.bits,
            scale: dropout.scale(),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Dropout {
    /// Panics unless 0 ≤ p < 1.
    pub fn new(p: f32, seed: u64) -> Dropout {
        assert!(
            (0.0..1.0).contains(&p),
            "dropout probability must be in [0, 1), got {p}"
        );
        Dropout { p, seed }
    }

    /// A workspace for buffers of `len` elements.
    pub fn workspace(&self, len: usize) -> DropoutWorkspace {
        DropoutWorkspace {
            len,
            active: false,
            bits: vec![0; len.div_ceil(64)],
        }
    }

    /// 1/(1 − p).
    pub fn scale(&self) -> f32 {
        1.0 / (1.0 - self.p)
    }

    /// Whether element `i` is kept at `step` (the mask formula; forward uses exactly this).
    pub fn keep(&self, step: u64, i: usize) -> bool {
        let key = self.key(step);
        self.keep_with_key(key, i)
    }

    #[inline]
    fn key(&self, step: u64) -> u64 {
        mix64(self.seed ^ mix64(step.wrapping_add(GOLDEN)))
    }

    /// round(p·2³²) < 2³² since p < 1.
    #[inline]
    fn threshold(&self) -> u64 {
        (self.p as f64 * 4_294_967_296.0).round() as u64
    }

    #[inline]
    fn keep_with_key(&self, key: u64, i: usize) -> bool {
        hash_hi(key, i as u64) >= self.threshold()
    }

    /// Draws the mask for `step` into `ws` (or marks it inactive); returns whether active.
    fn draw(&self, ws: &mut DropoutWorkspace, step: u64, train: bool) -> bool {
        ws.active = train && self.p > 0.0;
        if ws.active {
            use rayon::prelude::*;
            let key = self.key(step);
            let len = ws.len;
            // Each bit depends only on (key, index): words are drawn in parallel, in chunks of
            // 256 words (16k elements), with the same result on any thread count.
            let threshold = self.threshold();
            comera_tensor::for_each(ws.bits.par_chunks_mut(256).enumerate(), |(c, words)| {
                kernels::draw_words(words, c * 256, len, key, threshold)
            });
        }
        ws.active
    }

    /// Draws the mask of `step` into `ws` for a kernel that applies it in its own pass (`None`
    /// when not training or p = 0: the identity). The backward reads it with
    /// [`DropoutWorkspace::mask`].
    pub fn draw_mask<'a>(
        &self,
        ws: &'a mut DropoutWorkspace,
        step: u64,
        train: bool,
    ) -> Option<Mask<'a>> {
        self.draw(ws, step, train);
        ws.mask(self)
    }

    /// `y = m ⊙ x / (1 − p)` with the mask of `step` when `train`, else `y = x`.
    pub fn forward(
        &self,
        ws: &mut DropoutWorkspace,
        step: u64,
        train: bool,
        x: &[f32],
        y: &mut [f32],
    ) {
        check_len("Dropout x", x.len(), ws.len);
        check_len("Dropout y", y.len(), ws.len);
        if !self.draw(ws, step, train) {
            y.copy_from_slice(x);
            return;
        }
        apply_mask(&ws.bits, self.scale(), x, y);
    }

    /// [`Dropout::forward`] overwriting `x` with `y`.
    pub fn forward_in_place(
        &self,
        ws: &mut DropoutWorkspace,
        step: u64,
        train: bool,
        x: &mut [f32],
    ) {
        check_len("Dropout x", x.len(), ws.len);
        if self.draw(ws, step, train) {
            apply_mask_in_place(&ws.bits, self.scale(), x);
        }
    }

    /// `dx = m ⊙ dy / (1 − p)` with the last forward's mask (`dx = dy` if it was the identity).
    pub fn backward(&self, ws: &DropoutWorkspace, dy: &[f32], dx: &mut [f32]) {
        check_len("Dropout dy", dy.len(), ws.len);
        check_len("Dropout dx", dx.len(), ws.len);
        if ws.active {
            apply_mask(&ws.bits, self.scale(), dy, dx);
        } else {
            dx.copy_from_slice(dy);
        }
    }

    /// [`Dropout::backward`] with `d` holding dy on entry and dx on return.
    pub fn backward_in_place(&self, ws: &DropoutWorkspace, d: &mut [f32]) {
        check_len("Dropout d", d.len(), ws.len);
        if ws.active {
            apply_mask_in_place(&ws.bits, self.scale(), d);
        }
    }
}

/// The mask loops, compiled for each instruction-set level (`comera_tensor::multiversion!`):
/// the hash's 64-bit multiplies vectorise only with AVX-512 (`vpmullq`).
mod kernels {
    use super::hash_hi;

    comera_tensor::multiversion! {
        /// Mask words `first_word..` (bit b of word w is element 64·w + b, of `len` in all) for
        /// the step's `key`: element i is kept iff ⌊u_i / 2³²⌋ ≥ `threshold`.
        pub(super) fn draw_words(
            words: &mut [u64],
            first_word: usize,
            len: usize,
            key: u64,
            threshold: u64,
        ) {
            for (j, word) in words.iter_mut().enumerate() {
                let w = first_word + j;
                let n = (len - w * 64).min(64);
                // The hashes of the word's elements first (a loop that vectorises), then
                // their bits.
                let mut hi = [0u64; 64];
                for (b, h) in hi.iter_mut().enumerate() {
                    *h = hash_hi(key, (w * 64 + b) as u64);
                }
                let mut bits = 0u64;
                for (b, &h) in hi[..n].iter().enumerate() {
                    bits |= ((h >= threshold) as u64) << b;
                }
                *word = bits;
            }
        }
    }

    comera_tensor::multiversion! {
        /// `out_i = m_i·scale·inp_i` for the elements of `bits`' words.
        pub(super) fn apply_mask(bits: &[u64], scale: f32, inp: &[f32], out: &mut [f32]) {
            for ((o, i), &word) in out.chunks_mut(64).zip(inp.chunks(64)).zip(bits) {
                for (b, (ov, &iv)) in o.iter_mut().zip(i).enumerate() {
                    *ov = if (word >> b) & 1 == 1 { iv * scale } else { 0.0 };
                }
            }
        }
    }

    comera_tensor::multiversion! {
        /// `out_i = x_i + m_i·scale·branch_i` for the elements of `bits`' words.
        pub(super) fn add_masked(bits: &[u64], scale: f32, x: &[f32], branch: &[f32], out: &mut [f32]) {
            let runs = out.chunks_mut(64).zip(x.chunks(64)).zip(branch.chunks(64)).zip(bits);
            for (((o, x), br), &word) in runs {
                for (b, ((ov, &xv), &bv)) in o.iter_mut().zip(x).zip(br).enumerate() {
                    *ov = xv + if (word >> b) & 1 == 1 { bv * scale } else { 0.0 };
                }
            }
        }
    }

    comera_tensor::multiversion! {
        /// `v_i ← m_i·scale·v_i` for the elements of `bits`' words.
        pub(super) fn apply_mask_in_place(bits: &[u64], scale: f32, v: &mut [f32]) {
            for (chunk, &word) in v.chunks_mut(64).zip(bits) {
                for (b, x) in chunk.iter_mut().enumerate() {
                    *x = if (word >> b) & 1 == 1 { *x * scale } else { 0.0 };
                }
            }
        }
    }
}

/// `out_i = m_i·scale·inp_i`, in parallel chunks of [`CHUNK`] elements (element-wise).
fn apply_mask(bits: &[u64], scale: f32, inp: &[f32], out: &mut [f32]) {
    use rayon::prelude::*;
    let f = |((out, inp), bits): ((&mut [f32], &[f32]), &[u64])| {
        kernels::apply_mask(bits, scale, inp, out)
    };
    if out.len() >= 2 * CHUNK {
        comera_tensor::for_each(
            out.par_chunks_mut(CHUNK)
                .zip(inp.par_chunks(CHUNK))
                .zip(bits.par_chunks(CHUNK / 64)),
            f,
        );
    } else {
        f(((out, inp), bits));
    }
}

/// `v_i ← m_i·scale·v_i`, in parallel chunks of [`CHUNK`] elements (element-wise).
fn apply_mask_in_place(bits: &[u64], scale: f32, v: &mut [f32]) {
    use rayon::prelude::*;
    let f = |(v, bits): (&mut [f32], &[u64])| kernels::apply_mask_in_place(bits, scale, v);
    if v.len() >= 2 * CHUNK {
        comera_tensor::for_each(v.par_chunks_mut(CHUNK).zip(bits.par_chunks(CHUNK / 64)), f);
    } else {
        f((v, bits));
    }
}
