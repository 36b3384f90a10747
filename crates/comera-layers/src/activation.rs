//! Element-wise activations (GELU, tanh) with backward.
//!
//! GELU, the exact erf form BERT uses:
//!   y = ½·x·(1 + erf(x/√2)) = x·Φ(x),
//!   dy/dx = Φ(x) + x·φ(x) = ½·(1 + erf(x/√2)) + x·exp(−x²/2)/√(2π).
//! tanh:
//!   y = tanh(x),   dy/dx = 1 − tanh²(x).
//! Both backwards take the forward's *input* x (recomputing what they need), so no workspace is
//! kept. `dx` is written; `*_in_place` variants overwrite `dy` with `dx`.

use crate::check_len;
use comera_tensor::math::exp;
use rayon::prelude::*;

// Buffers of at least two chunks are processed in parallel chunks (element-wise, so the
// result does not depend on the thread count).
use crate::elementwise::CHUNK;

/// 1/√2.
const INV_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
/// 1/√(2π).
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// `y = x·Φ(x)` (exact erf GELU).
#[derive(Clone, Copy, Debug, Default)]
pub struct Gelu;

/// `y = tanh(x)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tanh;

/// Φ(x) = ½·(1 + erf(x/√2)) and φ(x) = exp(−x²/2)/√(2π), sharing one exp.
///
/// erf by Abramowitz & Stegun 7.1.26: erf(z) = 1 − t·P(t)·exp(−z²), t = 1/(1 + p·z) for z ≥ 0
/// (odd in z), |error| ≤ 1.5e-7, i.e. at f32 rounding level; with z = x/√2, exp(−z²) is the
/// exp(−x²/2) that φ needs anyway. Branch-free, so the loops below vectorise around the exp;
/// the polynomials in `mul_add` form, one FMA each on AVX2/AVX-512 (see `comera_tensor::math::exp`).
#[inline(always)]
fn cdf_pdf(x: f32) -> (f32, f32) {
    const P: f32 = 0.327_591_1;
    const A: [f32; 5] = [
        0.254_829_6,
        -0.284_496_74,
        1.421_413_8,
        -1.453_152_1,
        1.061_405_4,
    ];
    let z = (x * INV_SQRT_2).abs();
    let t = 1.0 / P.mul_add(z, 1.0);
    let poly = t * A[4]
        .mul_add(t, A[3])
        .mul_add(t, A[2])
        .mul_add(t, A[1])
        .mul_add(t, A[0]);
    let e = exp(-0.5 * x * x);
    let erf = (-poly).mul_add(e, 1.0).copysign(x);
    (erf.mul_add(0.5, 0.5), INV_SQRT_2PI * e)
}

/// GELU of one value.
#[inline(always)]
pub fn gelu(x: f32) -> f32 {
    x * cdf_pdf(x).0
}

/// d GELU(x) / dx = Φ(x) + x·φ(x).
#[inline(always)]
pub fn gelu_grad(x: f32) -> f32 {
    let (cdf, pdf) = cdf_pdf(x);
    x.mul_add(pdf, cdf)
}

/// The GELU loops, compiled for each instruction-set level (`comera_tensor::multiversion!`):
/// the baseline build vectorises the erf/exp arithmetic only 4 lanes wide.
pub(crate) mod simd {
    use super::{cdf_pdf, gelu, gelu_grad};

    comera_tensor::multiversion! {
        /// `y = GELU(x)`.
        pub fn gelu_forward(y: &mut [f32], x: &[f32]) {
            for (yi, &xi) in y.iter_mut().zip(x) {
                *yi = gelu(xi);
            }
        }
    }

    comera_tensor::multiversion! {
        /// `y[r, :] ← GELU(y[r, :] + bias)`: the same bits as adding the bias, then
        /// `gelu_forward`.
        pub fn gelu_bias_in_place(y: &mut [f32], bias: &[f32]) {
            for row in y.chunks_exact_mut(bias.len()) {
                for (yi, &bi) in row.iter_mut().zip(bias) {
                    *yi = gelu(*yi + bi);
                }
            }
        }
    }

    comera_tensor::multiversion! {
        /// `g ← GELU(h)`, `h ← GELU'(h)`, from one Φ/φ evaluation.
        pub fn gelu_value_grad(h: &mut [f32], g: &mut [f32]) {
            for (hi, gi) in h.iter_mut().zip(g.iter_mut()) {
                let x = *hi;
                let (cdf, pdf) = cdf_pdf(x);
                *gi = x * cdf; // = gelu(x)
                *hi = x.mul_add(pdf, cdf); // = gelu_grad(x)
            }
        }
    }

    comera_tensor::multiversion! {
        /// `g ← GELU(h + bias)`, `h ← GELU'(h + bias)` row by row, from one Φ/φ evaluation.
        pub fn gelu_bias_value_grad(h: &mut [f32], bias: &[f32], g: &mut [f32]) {
            let w = bias.len();
            for (hrow, grow) in h.chunks_exact_mut(w).zip(g.chunks_exact_mut(w)) {
                for ((hi, gi), &bi) in hrow.iter_mut().zip(grow.iter_mut()).zip(bias) {
                    let x = *hi + bi;
                    let (cdf, pdf) = cdf_pdf(x);
                    *gi = x * cdf; // = gelu(x)
                    *hi = x.mul_add(pdf, cdf); // = gelu_grad(x)
                }
            }
        }
    }

    comera_tensor::multiversion! {
        /// `d ← d ⊙ GELU'(x)`.
        pub fn gelu_backward_in_place(d: &mut [f32], x: &[f32]) {
            for (g, &xi) in d.iter_mut().zip(x) {
                *g *= gelu_grad(xi);
            }
        }
    }
}

impl Gelu {
    /// `y = GELU(x)`, any shape.
    pub fn forward(&self, x: &[f32], y: &mut [f32]) {
        check_len("Gelu y", y.len(), x.len());
        let f = |(y, x): (&mut [f32], &[f32])| simd::gelu_forward(y, x);
        if x.len() >= 2 * CHUNK {
            comera_tensor::for_each(y.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)), f);
        } else {
            f((y, x));
        }
    }

    /// `y[r, :] ← GELU(y[r, :] + bias)` for every row (a linear layer's output pass with its
    /// bias and the activation in one sweep); the same bits as `add_bias` then
    /// [`Gelu::forward`].
    pub fn forward_bias_in_place(&self, y: &mut [f32], bias: &[f32]) {
        let w = bias.len();
        assert!(
            w > 0 && y.len().is_multiple_of(w),
            "Gelu: {} values in rows of {w}",
            y.len()
        );
        let f = |y: &mut [f32]| simd::gelu_bias_in_place(y, bias);
        let chunk = CHUNK.div_ceil(w) * w; // whole rows
        if y.len() >= 2 * chunk {
            comera_tensor::for_each(y.par_chunks_mut(chunk), f);
        } else {
            f(y);
        }
    }

    /// For a backward that recomputes the forward: `g[r, :] = GELU(h[r, :] + bias)` and
    /// `h[r, :] ← GELU'(h[r, :] + bias)` (h's pre-activation is not needed again, its
    /// derivative is), sharing one Φ/φ per value; the same bits as `add_bias`, then
    /// [`Gelu::forward`] into `g` and the factor [`Gelu::backward_in_place`] applies.
    pub fn forward_bias_and_grad_in_place(&self, h: &mut [f32], bias: &[f32], g: &mut [f32]) {
        let w = bias.len();
        assert!(
            w > 0 && h.len().is_multiple_of(w),
            "Gelu: {} values in rows of {w}",
            h.len()
        );
        check_len("Gelu g", g.len(), h.len());
        let f = |(h, g): (&mut [f32], &mut [f32])| simd::gelu_bias_value_grad(h, bias, g);
        let chunk = CHUNK.div_ceil(w) * w; // whole rows
        if h.len() >= 2 * chunk {
            comera_tensor::for_each(h.par_chunks_mut(chunk).zip(g.par_chunks_mut(chunk)), f);
        } else {
            f((h, g));
        }
    }

    /// For a backward that recomputes the forward: `g = GELU(h)` and `h ← GELU'(h)` (h is not
    /// needed again, its derivative is), sharing one Φ/φ per value; the same bits as
    /// [`Gelu::forward`] into `g` and the factor [`Gelu::backward_in_place`] applies.
    pub fn forward_and_grad_in_place(&self, h: &mut [f32], g: &mut [f32]) {
        check_len("Gelu g", g.len(), h.len());
        let f = |(h, g): (&mut [f32], &mut [f32])| simd::gelu_value_grad(h, g);
        if h.len() >= 2 * CHUNK {
            comera_tensor::for_each(h.par_chunks_mut(CHUNK).zip(g.par_chunks_mut(CHUNK)), f);
        } else {
            f((h, g));
        }
    }

    /// `dx = dy ⊙ GELU'(x)`, x the forward's input.
    pub fn backward(&self, x: &[f32], dy: &[f32], dx: &mut [f32]) {
        check_len("Gelu dy", dy.len(), x.len());
        check_len("Gelu dx", dx.len(), x.len());
        for ((d, &g), &xi) in dx.iter_mut().zip(dy).zip(x) {
            *d = g * gelu_grad(xi);
        }
    }

    /// `d ← d ⊙ GELU'(x)`: `d` holds dy on entry and dx on return.
    pub fn backward_in_place(&self, x: &[f32], d: &mut [f32]) {
        check_len("Gelu d", d.len(), x.len());
        let f = |(d, x): (&mut [f32], &[f32])| simd::gelu_backward_in_place(d, x);
        if x.len() >= 2 * CHUNK {
            comera_tensor::for_each(d.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)), f);
        } else {
            f((d, x));
        }
    }
}

impl Tanh {
    /// `y = tanh(x)`, any shape.
    pub fn forward(&self, x: &[f32], y: &mut [f32]) {
        check_len("Tanh y", y.len(), x.len());
        for (yi, &xi) in y.iter_mut().zip(x) {
            *yi = xi.tanh();
        }
    }

    /// `dx = dy ⊙ (1 − tanh²(x))`, x the forward's input.
    pub fn backward(&self, x: &[f32], dy: &[f32], dx: &mut [f32]) {
        check_len("Tanh dy", dy.len(), x.len());
        check_len("Tanh dx", dx.len(), x.len());
        for ((d, &g), &xi) in dx.iter_mut().zip(dy).zip(x) {
            let t = xi.tanh();
            *d = g * (1.0 - t * t);
        }
    }

    /// `d ← d ⊙ (1 − tanh²(x))`: `d` holds dy on entry and dx on return.
    pub fn backward_in_place(&self, x: &[f32], d: &mut [f32]) {
        check_len("Tanh d", d.len(), x.len());
        for (g, &xi) in d.iter_mut().zip(x) {
            let t = xi.tanh();
            *g *= 1.0 - t * t;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_and_derivative_in_one_pass_give_the_same_bits_as_two() {
        // Long enough for the parallel chunks; values around every branch of erf's sign.
        let n = 3 * CHUNK + 17;
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 6.0).collect();
        let dy: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
        let (mut g, mut dx) = (vec![0.0; n], dy.clone());
        Gelu.forward(&x, &mut g);
        Gelu.backward_in_place(&x, &mut dx);
        let (mut h, mut g1, mut dx1) = (x.clone(), vec![0.0; n], dy.clone());
        Gelu.forward_and_grad_in_place(&mut h, &mut g1);
        crate::elementwise::mul_into(&mut dx1, &h);
        assert!(g.iter().zip(&g1).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(dx.iter().zip(&dx1).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    #[test]
    fn fast_erf_gelu_matches_the_exact_form_to_f32_precision() {
        for i in -8000..=8000 {
            let x = i as f32 * 1e-3;
            let exact = 0.5 * x as f64 * (1.0 + libm::erf(x as f64 / std::f64::consts::SQRT_2));
            assert!(
                (gelu(x) as f64 - exact).abs() <= 1e-6 * (1.0 + x.abs() as f64),
                "x = {x}"
            );
            let cdf = 0.5 * (1.0 + libm::erf(x as f64 / std::f64::consts::SQRT_2));
            let pdf = (-0.5 * (x as f64).powi(2)).exp() / (2.0 * std::f64::consts::PI).sqrt();
            assert!(
                (gelu_grad(x) as f64 - (cdf + x as f64 * pdf)).abs()
                    <= 1e-6 * (1.0 + x.abs() as f64),
                "x = {x}"
            );
        }
    }
}
