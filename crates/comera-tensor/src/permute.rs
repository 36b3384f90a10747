//! Axis permutations of dense row-major tensors (strided copies), allocation-free.

/// Most axes a permuted tensor may have.
pub const MAX_AXES: usize = 16;

/// Writes `dst = src` with axes permuted: `dst` has shape `[dims[perm[0]], dims[perm[1]], …]`,
/// i.e. destination axis `a` is source axis `perm[a]`. `dims` is the source shape.
pub fn permute(src: &[f32], dims: &[usize], perm: &[usize], dst: &mut [f32]) {
    let n: usize = dims.iter().product();
    assert_eq!(src.len(), n, "permute: source length");
    assert_eq!(dst.len(), n, "permute: destination length");
    assert_eq!(dims.len(), perm.len(), "permute: rank");
    let rank = dims.len();
    assert!(rank <= MAX_AXES, "permute: at most {MAX_AXES} axes");
    if n == 0 {
        return;
    }
    // Row-major strides of the source, taken in destination-axis order.
    let mut src_strides = [0usize; MAX_AXES];
    let mut s = 1;
    for a in (0..rank).rev() {
        src_strides[a] = s;
        s *= dims[a];
    }
    let mut out_dims = [0usize; MAX_AXES];
    let mut strides = [0usize; MAX_AXES];
    for (a, &src_axis) in perm.iter().enumerate() {
        out_dims[a] = dims[src_axis];
        strides[a] = src_strides[src_axis];
    }
    // Walk the destination in order; the innermost axis is a strided gather.
    let inner = out_dims[rank - 1];
    let inner_stride = strides[rank - 1];
    let mut idx = [0usize; MAX_AXES];
    let mut base = 0usize;
    for chunk in dst.chunks_exact_mut(inner) {
        for (j, d) in chunk.iter_mut().enumerate() {
            *d = src[base + j * inner_stride];
        }
        // Advance the outer multi-index (odometer), keeping `base` in step.
        let mut a = rank - 1;
        while a > 0 {
            a -= 1;
            idx[a] += 1;
            base += strides[a];
            if idx[a] < out_dims[a] {
                break;
            }
            base -= strides[a] * out_dims[a];
            idx[a] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposes_and_reverses_axes() {
        let src: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let mut dst = vec![0.0; 24];
        permute(&src, &[2, 3, 4], &[2, 1, 0], &mut dst);
        // dst[c, b, a] = src[a, b, c]
        for a in 0..2 {
            for b in 0..3 {
                for c in 0..4 {
                    assert_eq!(dst[c * 6 + b * 2 + a], src[a * 12 + b * 4 + c]);
                }
            }
        }
        let mut back = vec![0.0; 24];
        permute(&dst, &[4, 3, 2], &[2, 1, 0], &mut back);
        assert_eq!(back, src);
    }
}
