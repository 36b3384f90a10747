//! Element-wise sums and products over flat buffers: the residual connections and gradient
//! sums between layers, a saved derivative applied to a gradient.
//!
//! Buffers of at least two [`CHUNK`]s run in parallel chunks of [`CHUNK`] elements; every
//! element is computed on its own, so results do not depend on the thread count.

use crate::check_len;
use rayon::prelude::*;

/// Elements per parallel chunk (64 KiB of f32): large enough that a chunk outweighs the task.
pub const CHUNK: usize = 1 << 14;

/// `acc_i += x_i`.
#[track_caller]
pub fn add_into(acc: &mut [f32], x: &[f32]) {
    check_len("add_into x", x.len(), acc.len());
    zip_in_place(acc, x, kernels::add);
}

/// `out_i = a_i + b_i`.
#[track_caller]
pub fn sum_into(a: &[f32], b: &[f32], out: &mut [f32]) {
    check_len("sum_into a", a.len(), out.len());
    check_len("sum_into b", b.len(), out.len());
    let f = |((out, a), b): ((&mut [f32], &[f32]), &[f32])| kernels::sum(a, b, out);
    if out.len() >= 2 * CHUNK {
        comera_tensor::for_each(
            out.par_chunks_mut(CHUNK)
                .zip(a.par_chunks(CHUNK))
                .zip(b.par_chunks(CHUNK)),
            f,
        );
    } else {
        f(((out, a), b));
    }
}

/// `v_i = 0`, in parallel chunks from two chunks on, like the passes above (zeroing a model's
/// gradients at the start of a step: 8.7 MB at the paper's TT/TTM model; on a 2-vCPU Zen 4
/// machine as fast as one core, which already draws its memory bandwidth: docs/scaling.md).
pub fn zero(v: &mut [f32]) {
    if v.len() >= 2 * CHUNK {
        comera_tensor::for_each(v.par_chunks_mut(CHUNK), |c| c.fill(0.0));
    } else {
        v.fill(0.0);
    }
}

/// `dst_i = src_i`, in parallel chunks from two chunks on like the passes above (a layer's R
/// or dR, up to 95 k floats, copied between the layer's parallel sections).
#[track_caller]
pub fn copy(dst: &mut [f32], src: &[f32]) {
    check_len("copy src", src.len(), dst.len());
    if dst.len() >= 2 * CHUNK {
        comera_tensor::for_each(
            dst.par_chunks_mut(CHUNK).zip(src.par_chunks(CHUNK)),
            |(d, s)| d.copy_from_slice(s),
        );
    } else {
        dst.copy_from_slice(src);
    }
}

/// `acc_i *= x_i`.
#[track_caller]
pub fn mul_into(acc: &mut [f32], x: &[f32]) {
    check_len("mul_into x", x.len(), acc.len());
    zip_in_place(acc, x, kernels::mul);
}

/// `kernel(acc, x)` over the whole buffers, in parallel chunks from two chunks on (lengths
/// checked by the caller).
#[inline(always)]
fn zip_in_place(acc: &mut [f32], x: &[f32], kernel: fn(&mut [f32], &[f32])) {
    let f = |(acc, x): (&mut [f32], &[f32])| kernel(acc, x);
    if acc.len() >= 2 * CHUNK {
        comera_tensor::for_each(acc.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)), f);
    } else {
        f((acc, x));
    }
}

/// The loops, compiled for each instruction-set level (`comera_tensor::multiversion!`).
pub(crate) mod kernels {
    comera_tensor::multiversion! {
        /// `acc_i += x_i`.
        pub(crate) fn add(acc: &mut [f32], x: &[f32]) {
            for (a, &v) in acc.iter_mut().zip(x) {
                *a += v;
            }
        }
    }

    comera_tensor::multiversion! {
        /// `acc_i *= x_i`.
        pub(crate) fn mul(acc: &mut [f32], x: &[f32]) {
            for (a, &v) in acc.iter_mut().zip(x) {
                *a *= v;
            }
        }
    }

    comera_tensor::multiversion! {
        /// `out_i = a_i + b_i`.
        pub(crate) fn sum(a: &[f32], b: &[f32], out: &mut [f32]) {
            for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
                *o = x + y;
            }
        }
    }
}
