//! TT-SVD: tensor-train cores from a dense tensor by sequential truncated SVDs (Oseledets 2011).
//!
//! A tensor A with modes `[s_1, …, s_K]` (row-major, s_1 slowest) is split left to right: the
//! unfolding C_1 = A as (s_1 × rest) is factored C = U·Σ·Vᵀ, the first r_1 columns of U become
//! core 1 (1, s_1, r_1), and C_2 = Σ_{:r_1}·Vᵀ_{:r_1} reshaped to (r_1·s_2 × rest) goes on;
//! the last remainder (r_{K-1}·s_K × 1) is core K. Each bond keeps
//! - at most `max_rank` singular values (a cap), and
//! - with a relative Frobenius error target ε, the fewest r_k whose discarded tail satisfies
//!   Σ_{i>r_k} σ_i² ≤ (ε²·‖A‖² − D_{k-1})/(K−k), D_{k-1} being what bonds 1..k−1 discarded
//!   (Oseledets' uniform share ε²‖A‖²/(K−1), plus whatever earlier bonds left unused — outer
//!   bonds are often exact). The squared errors of the truncations add (they are orthogonal
//!   projections), so ‖A − TT‖_F ≤ ε·‖A‖_F overall. A cap can override the target;
//!   [`TtDecomposition::rel_error`] reports what was achieved.
//!
//! Without cap or target every nonzero singular value is kept (r_k = min of the unfolding's
//! sides), and the reconstruction is exact up to rounding. The SVDs run in `f64` (faer), the
//! cores are returned as `f32`.
//!
//! Where the singular values go ([`Absorb`]): `Left` leaves cores 1..K−1 left-orthonormal and
//! all of the scale in core K (plain TT-SVD); `Balanced` (the default) then rescales every core
//! by a positive factor, the factors multiplying to 1, so that all cores have the same Frobenius
//! norm — the represented tensor is unchanged, and no core starts out much larger than the
//! others (which suits training with a β·Σ‖G‖² penalty and rank gates at 1).
//!
//! [`ttm_svd`] does the same for a TTM embedding table E (V × D, V ≤ ∏v_k, D = ∏e_k): rows are
//! zero-padded to ∏v_k, the index (i_1..i_p, c_1..c_p) is reordered to (i_1, c_1, …, i_p, c_p),
//! and TT-SVD with modes v_k·e_k gives cores (r_{k-1}, v_k, e_k, r_k) (SPEC §6 layout).

/// Where the singular values end up (see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Absorb {
    /// Cores 1..K−1 left-orthonormal, all scale in the last core.
    Left,
    /// Every core rescaled to the same Frobenius norm (product of the factors 1).
    #[default]
    Balanced,
}

/// Truncation and scaling choices.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TtSvdOptions {
    /// Largest rank on any bond (`None`: no cap).
    pub max_rank: Option<usize>,
    /// Relative Frobenius error target ε ≥ 0 (`None`: keep every nonzero singular value).
    pub rel_tol: Option<f64>,
    pub absorb: Absorb,
}

impl TtSvdOptions {
    /// A cap on every bond's rank.
    pub fn rank(r: usize) -> TtSvdOptions {
        TtSvdOptions {
            max_rank: Some(r),
            ..TtSvdOptions::default()
        }
    }

    /// A relative Frobenius error target.
    pub fn tolerance(eps: f64) -> TtSvdOptions {
        TtSvdOptions {
            rel_tol: Some(eps),
            ..TtSvdOptions::default()
        }
    }
}

/// Inputs TT-SVD cannot work with.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum TtSvdError {
    #[error("tt-svd: modes {modes:?} are empty or contain a zero")]
    BadModes { modes: Vec<usize> },
    #[error("tt-svd: {what}: {got} values, expected {expected} (the product of the modes)")]
    Length {
        what: &'static str,
        got: usize,
        expected: usize,
    },
    #[error("tt-svd: max_rank must be at least 1, got 0")]
    ZeroRank,
    #[error("tt-svd: rel_tol must be a finite number ≥ 0, got {0}")]
    Tolerance(f64),
    #[error("tt-svd: the tensor has a non-finite entry at flat index {0}")]
    NonFinite(usize),
    #[error("tt-svd: {rows} rows do not fit vocab modes {modes:?} (capacity {capacity})")]
    Rows {
        rows: usize,
        capacity: usize,
        modes: Vec<usize>,
    },
    #[error("tt-svd: vocab modes {vocab:?} and dim modes {dim:?} differ in length")]
    CoreCount { vocab: Vec<usize>, dim: Vec<usize> },
    #[error("tt-svd: the SVD of a {rows} × {cols} unfolding did not converge")]
    NoConvergence { rows: usize, cols: usize },
    #[error(
        "tt-svd: cannot pad ranks {from:?} to {to:?} (every target must be ≥ the rank, ends 1)"
    )]
    Pad { from: Vec<usize>, to: Vec<usize> },
}

/// A tensor train: core k has shape (ranks[k], modes[k], ranks[k+1]), row-major.
#[derive(Clone, Debug)]
pub struct TtDecomposition {
    pub modes: Vec<usize>,
    /// `[1, r_1, …, r_{K-1}, 1]`.
    pub ranks: Vec<usize>,
    pub cores: Vec<Vec<f32>>,
    /// ‖A‖_F of the input.
    pub norm: f64,
    /// √(Σ discarded σ²)/‖A‖_F: the relative error of the truncation (exact in exact
    /// arithmetic; 0 for a zero tensor). Measure the `f32` cores with [`rel_error`] when it
    /// matters.
    pub rel_error: f64,
}

/// The TT-SVD of `data` (row-major, shape `modes`).
pub fn tt_svd(
    data: &[f32],
    modes: &[usize],
    opts: &TtSvdOptions,
) -> Result<TtDecomposition, TtSvdError> {
    check_modes(modes)?;
    let total: usize = modes.iter().product();
    if data.len() != total {
        return Err(TtSvdError::Length {
            what: "tensor",
            got: data.len(),
            expected: total,
        });
    }
    let a: Vec<f64> = data.iter().map(|&v| v as f64).collect();
    tt_svd_f64(a, modes, opts)
}

fn check_modes(modes: &[usize]) -> Result<(), TtSvdError> {
    if modes.is_empty() || modes.contains(&0) {
        return Err(TtSvdError::BadModes {
            modes: modes.to_vec(),
        });
    }
    Ok(())
}

fn tt_svd_f64(
    a: Vec<f64>,
    modes: &[usize],
    opts: &TtSvdOptions,
) -> Result<TtDecomposition, TtSvdError> {
    if opts.max_rank == Some(0) {
        return Err(TtSvdError::ZeroRank);
    }
    if let Some(t) = opts.rel_tol {
        if !(t.is_finite() && t >= 0.0) {
            return Err(TtSvdError::Tolerance(t));
        }
    }
    if let Some(i) = a.iter().position(|v| !v.is_finite()) {
        return Err(TtSvdError::NonFinite(i));
    }
    let k = modes.len();
    let norm2: f64 = a.iter().map(|v| v * v).sum();
    // Total budget for the discarded squared singular values; bond i may use an equal share
    // of what the bonds before it left over.
    let total_budget = opts.rel_tol.map_or(0.0, |eps| eps * eps * norm2);
    let mut ranks = vec![1usize; k + 1];
    let mut cores: Vec<Vec<f64>> = Vec::with_capacity(k);
    let mut discarded = 0.0f64;
    let mut c = a;
    let mut rest: usize = modes.iter().product();
    for i in 0..k - 1 {
        let rows = ranks[i] * modes[i];
        rest /= modes[i];
        let cols = rest;
        let m = faer::MatRef::from_row_major_slice(&c, rows, cols);
        let svd = m
            .thin_svd()
            .map_err(|_| TtSvdError::NoConvergence { rows, cols })?;
        let (u, s, v) = (svd.U(), svd.S().column_vector(), svd.V());
        let full = s.nrows();
        let sig: Vec<f64> = (0..full).map(|j| s[j]).collect();
        // Tail sums: tail[r] = Σ_{j ≥ r} σ_j².
        let mut tail = vec![0.0f64; full + 1];
        for j in (0..full).rev() {
            tail[j] = tail[j + 1] + sig[j] * sig[j];
        }
        let budget = (total_budget - discarded).max(0.0) / (k - 1 - i) as f64;
        let mut r = if opts.rel_tol.is_some() {
            (1..=full).find(|&r| tail[r] <= budget).unwrap_or(full)
        } else {
            full
        };
        if let Some(cap) = opts.max_rank {
            r = r.min(cap);
        }
        r = r.max(1);
        discarded += tail[r];
        ranks[i + 1] = r;
        let mut core = vec![0.0f64; rows * r];
        for row in 0..rows {
            for j in 0..r {
                core[row * r + j] = u[(row, j)];
            }
        }
        cores.push(core);
        // Next remainder: Σ_{:r}·Vᵀ_{:r} (r × cols), read as (r·s_{i+1}) × (cols / s_{i+1}).
        let mut next = vec![0.0f64; r * cols];
        for j in 0..r {
            let sj = sig[j];
            let row = &mut next[j * cols..(j + 1) * cols];
            for (col, x) in row.iter_mut().enumerate() {
                *x = sj * v[(col, j)];
            }
        }
        c = next;
    }
    cores.push(c); // (r_{K-1}, s_K, 1)
    if opts.absorb == Absorb::Balanced && k > 1 {
        balance(&mut cores);
    }
    let norm = norm2.sqrt();
    Ok(TtDecomposition {
        modes: modes.to_vec(),
        ranks,
        cores: cores
            .into_iter()
            .map(|c| c.into_iter().map(|v| v as f32).collect())
            .collect(),
        norm,
        rel_error: if norm2 > 0.0 {
            (discarded / norm2).sqrt()
        } else {
            0.0
        },
    })
}

/// Rescales the cores to a common Frobenius norm (the geometric mean); the factors multiply to
/// 1, so the product is unchanged. A zero core leaves everything as it is.
fn balance(cores: &mut [Vec<f64>]) {
    let norms: Vec<f64> = cores
        .iter()
        .map(|c| c.iter().map(|v| v * v).sum::<f64>().sqrt())
        .collect();
    if norms.iter().any(|&n| n == 0.0 || !n.is_finite()) {
        return;
    }
    let target = (norms.iter().map(|n| n.ln()).sum::<f64>() / norms.len() as f64).exp();
    for (c, n) in cores.iter_mut().zip(&norms) {
        let f = target / n;
        c.iter_mut().for_each(|v| *v *= f);
    }
}

/// The full tensor (row-major over `modes`) a tensor train represents (accumulated in `f64`).
pub fn tt_reconstruct(cores: &[Vec<f32>], modes: &[usize], ranks: &[usize]) -> Vec<f32> {
    // Left to right: P (prefix, r_k) ← P·G_k, P of shape (∏ s_{<k}, r_k).
    let mut p: Vec<f64> = vec![1.0];
    let mut rows = 1usize;
    for (k, core) in cores.iter().enumerate() {
        let (r0, s, r1) = (ranks[k], modes[k], ranks[k + 1]);
        let mut next = vec![0.0f64; rows * s * r1];
        for row in 0..rows {
            let prow = &p[row * r0..(row + 1) * r0];
            for a in 0..r0 {
                let pa = prow[a];
                if pa == 0.0 {
                    continue;
                }
                let g = &core[a * s * r1..(a + 1) * s * r1];
                let out = &mut next[row * s * r1..(row + 1) * s * r1];
                for (o, &gv) in out.iter_mut().zip(g) {
                    *o += pa * gv as f64;
                }
            }
        }
        p = next;
        rows *= s;
    }
    p.into_iter().map(|v| v as f32).collect()
}

/// ‖got − want‖_F / ‖want‖_F (in `f64`; 0 when both are zero, ∞ when only `want` is).
pub fn rel_error(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "rel_error: lengths differ");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        let d = g as f64 - w as f64;
        num += d * d;
        den += (w as f64) * (w as f64);
    }
    if den == 0.0 {
        if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (num / den).sqrt()
    }
}

/// TT-SVD of a weight W (N × M, row-major) for a TT linear layer with `in_modes` (∏ = N) and
/// `out_modes` (∏ = M): the row index is the input digits, the column index the output digits,
/// both row-major (SPEC §6), so W's flat buffer is the tensor over `in_modes ++ out_modes`.
pub fn tt_matrix_svd(
    w: &[f32],
    in_modes: &[usize],
    out_modes: &[usize],
    opts: &TtSvdOptions,
) -> Result<TtDecomposition, TtSvdError> {
    check_modes(in_modes)?;
    check_modes(out_modes)?;
    let modes: Vec<usize> = in_modes.iter().chain(out_modes).copied().collect();
    tt_svd(w, &modes, opts)
}

/// A TTM decomposition: core k has shape (ranks[k], vocab_modes[k], dim_modes[k], ranks[k+1]).
#[derive(Clone, Debug)]
pub struct TtmDecomposition {
    pub vocab_modes: Vec<usize>,
    pub dim_modes: Vec<usize>,
    pub ranks: Vec<usize>,
    pub cores: Vec<Vec<f32>>,
    pub rel_error: f64,
}

/// TT-SVD of an embedding table (`rows` × D, row-major) into TTM cores (see the module docs).
/// Rows past `rows` (up to ∏ vocab_modes) are taken as zeros.
pub fn ttm_svd(
    table: &[f32],
    rows: usize,
    vocab_modes: &[usize],
    dim_modes: &[usize],
    opts: &TtSvdOptions,
) -> Result<TtmDecomposition, TtSvdError> {
    check_modes(vocab_modes)?;
    check_modes(dim_modes)?;
    if vocab_modes.len() != dim_modes.len() {
        return Err(TtSvdError::CoreCount {
            vocab: vocab_modes.to_vec(),
            dim: dim_modes.to_vec(),
        });
    }
    let capacity: usize = vocab_modes.iter().product();
    let d: usize = dim_modes.iter().product();
    if rows == 0 || rows > capacity {
        return Err(TtSvdError::Rows {
            rows,
            capacity,
            modes: vocab_modes.to_vec(),
        });
    }
    if table.len() != rows * d {
        return Err(TtSvdError::Length {
            what: "embedding table",
            got: table.len(),
            expected: rows * d,
        });
    }
    check_finite(table)?;
    let p = vocab_modes.len();
    // Digit strides of the source (i_1..i_p, c_1..c_p) and of the destination (i_1, c_1, …).
    let mut dst_stride_v = vec![0usize; p];
    let mut dst_stride_e = vec![0usize; p];
    let mut s = 1usize;
    for k in (0..p).rev() {
        dst_stride_e[k] = s;
        s *= dim_modes[k];
        dst_stride_v[k] = s;
        s *= vocab_modes[k];
    }
    // Offset in the destination of each row id and of each column.
    let row_off = digit_offsets(vocab_modes, &dst_stride_v, rows);
    let col_off = digit_offsets(dim_modes, &dst_stride_e, d);
    let mut a = vec![0.0f64; capacity * d];
    for (i, row) in table.chunks_exact(d).enumerate() {
        let base = row_off[i];
        for (c, &v) in row.iter().enumerate() {
            a[base + col_off[c]] = v as f64;
        }
    }
    let modes: Vec<usize> = vocab_modes
        .iter()
        .zip(dim_modes)
        .map(|(v, e)| v * e)
        .collect();
    let tt = tt_svd_f64(a, &modes, opts)?;
    Ok(TtmDecomposition {
        vocab_modes: vocab_modes.to_vec(),
        dim_modes: dim_modes.to_vec(),
        ranks: tt.ranks,
        // (r, v_k·e_k, r') row-major with merged index i_k·e_k + c_k is (r, v_k, e_k, r').
        cores: tt.cores,
        rel_error: tt.rel_error,
    })
}

fn check_finite(x: &[f32]) -> Result<(), TtSvdError> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(TtSvdError::NonFinite(i)),
        None => Ok(()),
    }
}

/// For n = 0..count: Σ_k digit_k(n)·stride[k], digits of n row-major over `modes`.
fn digit_offsets(modes: &[usize], stride: &[usize], count: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(count);
    let mut digits = vec![0usize; modes.len()];
    let mut off = 0usize;
    for _ in 0..count {
        out.push(off);
        // Odometer increment, last digit fastest.
        for k in (0..modes.len()).rev() {
            digits[k] += 1;
            off += stride[k];
            if digits[k] < modes[k] {
                break;
            }
            off -= digits[k] * stride[k];
            digits[k] = 0;
        }
    }
    out
}

/// Zero-pads tensor-train cores from `ranks` to `target` ranks (each ≥ the current one, ends 1):
/// the new rank slices are zero, so the represented tensor is unchanged. `mode_len[k]` is the
/// size of core k's middle (s_k, or v_k·e_k for TTM cores).
pub fn pad_ranks(
    cores: &[Vec<f32>],
    mode_len: &[usize],
    ranks: &[usize],
    target: &[usize],
) -> Result<Vec<Vec<f32>>, TtSvdError> {
    let k = cores.len();
    let ok = mode_len.len() == k
        && ranks.len() == k + 1
        && target.len() == k + 1
        && target[0] == 1
        && target[k] == 1
        && ranks.iter().zip(target).all(|(r, t)| r <= t);
    if !ok {
        return Err(TtSvdError::Pad {
            from: ranks.to_vec(),
            to: target.to_vec(),
        });
    }
    Ok((0..k)
        .map(|c| {
            let (r0, s, r1) = (ranks[c], mode_len[c], ranks[c + 1]);
            let (t0, t1) = (target[c], target[c + 1]);
            let mut out = vec![0.0f32; t0 * s * t1];
            for a in 0..r0 {
                for i in 0..s {
                    let src = &cores[c][(a * s + i) * r1..(a * s + i + 1) * r1];
                    out[(a * s + i) * t1..(a * s + i) * t1 + r1].copy_from_slice(src);
                }
            }
            out
        })
        .collect())
}

#[cfg(test)]
// Index loops mirror the formulas (core k, rank a, b).
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;
    use crate::init;

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut v = vec![0.0; n];
        init::fill_normal(&mut init::rng(seed), &mut v, 1.0);
        v
    }

    /// A tensor of small TT rank plus a little noise, so truncation has something to find.
    fn low_rank_plus_noise(modes: &[usize], r: usize, noise: f32, seed: u64) -> Vec<f32> {
        let k = modes.len();
        let ranks: Vec<usize> = (0..=k)
            .map(|i| if i == 0 || i == k { 1 } else { r })
            .collect();
        let cores: Vec<Vec<f32>> = (0..k)
            .map(|c| random(ranks[c] * modes[c] * ranks[c + 1], seed + c as u64))
            .collect();
        let mut t = tt_reconstruct(&cores, modes, &ranks);
        let e = random(t.len(), seed + 100);
        for (x, n) in t.iter_mut().zip(e) {
            *x += noise * n;
        }
        t
    }

    #[test]
    fn full_rank_reconstructs_exactly() {
        let modes = [4, 3, 5, 2, 3];
        let a = random(modes.iter().product(), 1);
        for absorb in [Absorb::Left, Absorb::Balanced] {
            let opts = TtSvdOptions {
                absorb,
                ..TtSvdOptions::default()
            };
            let tt = tt_svd(&a, &modes, &opts).unwrap();
            // Full ranks: min(∏ left, ∏ right) on every bond.
            assert_eq!(tt.ranks, vec![1, 4, 12, 6, 3, 1]);
            let b = tt_reconstruct(&tt.cores, &modes, &tt.ranks);
            let e = rel_error(&b, &a);
            assert!(e < 1e-6, "{absorb:?}: {e}");
            assert!(tt.rel_error < 1e-12);
        }
    }

    #[test]
    fn left_cores_are_orthonormal_and_balanced_norms_equal() {
        let modes = [3, 4, 2, 5];
        let a = random(120, 2);
        let left = tt_svd(
            &a,
            &modes,
            &TtSvdOptions {
                absorb: Absorb::Left,
                ..TtSvdOptions::default()
            },
        )
        .unwrap();
        for k in 0..modes.len() - 1 {
            let (rows, r) = (left.ranks[k] * modes[k], left.ranks[k + 1]);
            let g = &left.cores[k];
            for i in 0..r {
                for j in 0..r {
                    let dot: f64 = (0..rows)
                        .map(|row| g[row * r + i] as f64 * g[row * r + j] as f64)
                        .sum();
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((dot - want).abs() < 1e-5, "core {k} ({i},{j}): {dot}");
                }
            }
        }
        let bal = tt_svd(&a, &modes, &TtSvdOptions::default()).unwrap();
        let norms: Vec<f64> = bal
            .cores
            .iter()
            .map(|c| c.iter().map(|&v| (v as f64).powi(2)).sum::<f64>().sqrt())
            .collect();
        for n in &norms {
            assert!((n / norms[0] - 1.0).abs() < 1e-5, "{norms:?}");
        }
    }

    #[test]
    fn error_is_monotone_in_rank() {
        let (in_modes, out_modes) = ([4, 6, 4], [6, 4, 4]);
        let w = low_rank_plus_noise(&[4, 6, 4, 6, 4, 4], 5, 0.05, 3);
        let mut last = f64::INFINITY;
        for r in [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 96] {
            let tt = tt_matrix_svd(&w, &in_modes, &out_modes, &TtSvdOptions::rank(r)).unwrap();
            assert!(tt.ranks.iter().all(|&x| x <= r));
            let got = rel_error(&tt_reconstruct(&tt.cores, &tt.modes, &tt.ranks), &w);
            // The bound from the discarded singular values holds (f32 rounding aside).
            assert!(
                got <= tt.rel_error * (1.0 + 1e-3) + 1e-6,
                "rank {r}: {got} vs {}",
                tt.rel_error
            );
            assert!(got <= last + 1e-6, "rank {r}: {got} > {last}");
            last = got;
        }
        assert!(last < 1e-5, "full rank error {last}");
    }

    #[test]
    fn error_meets_the_target() {
        let modes = [4, 6, 4, 6, 4, 4];
        let w = low_rank_plus_noise(&modes, 4, 0.1, 4);
        let full = tt_svd(&w, &modes, &TtSvdOptions::default()).unwrap();
        let full_params: usize = full.cores.iter().map(Vec::len).sum();
        let mut last_params = 0;
        for eps in [0.5, 0.2, 0.1, 0.05, 0.01, 1e-3] {
            let tt = tt_svd(&w, &modes, &TtSvdOptions::tolerance(eps)).unwrap();
            let got = rel_error(&tt_reconstruct(&tt.cores, &modes, &tt.ranks), &w);
            assert!(got <= eps, "target {eps}: got {got} (ranks {:?})", tt.ranks);
            let params: usize = tt.cores.iter().map(Vec::len).sum();
            assert!(params >= last_params && params <= full_params);
            last_params = params;
        }
        // A loose target on a near-rank-4 tensor finds rank ≤ 4 on the inner bonds.
        let tt = tt_svd(&w, &modes, &TtSvdOptions::tolerance(0.2)).unwrap();
        assert!(tt.ranks.iter().all(|&r| r <= 4), "{:?}", tt.ranks);
        // A cap wins over the target.
        let both = TtSvdOptions {
            max_rank: Some(2),
            rel_tol: Some(1e-6),
            absorb: Absorb::Balanced,
        };
        let tt = tt_svd(&w, &modes, &both).unwrap();
        assert!(tt.ranks.iter().all(|&r| r <= 2));
    }

    #[test]
    fn ttm_reconstructs_the_table() {
        let (v, e) = ([3, 4, 2], [2, 3, 2]);
        let rows = 21; // < 24: the padded rows are zeros
        let d = 12;
        let table = random(rows * d, 5);
        let ttm = ttm_svd(&table, rows, &v, &e, &TtSvdOptions::default()).unwrap();
        // Rebuild E[i, (c)] from the cores directly (SPEC §6).
        for i in 0..rows {
            let digits = [i / 8, (i / 2) % 4, i % 2];
            for c in 0..d {
                let cd = [c / 6, (c / 2) % 3, c % 2];
                let mut vec = vec![1.0f64];
                for k in 0..3 {
                    let (r0, r1) = (ttm.ranks[k], ttm.ranks[k + 1]);
                    let mut next = vec![0.0f64; r1];
                    for a in 0..r0 {
                        for b in 0..r1 {
                            let idx = ((a * v[k] + digits[k]) * e[k] + cd[k]) * r1 + b;
                            next[b] += vec[a] * ttm.cores[k][idx] as f64;
                        }
                    }
                    vec = next;
                }
                let want = table[i * d + c] as f64;
                assert!(
                    (vec[0] - want).abs() < 1e-5,
                    "E[{i},{c}] = {} vs {want}",
                    vec[0]
                );
            }
        }
        assert_eq!(
            ttm_svd(&table, 25, &v, &e, &TtSvdOptions::default()).unwrap_err(),
            TtSvdError::Rows {
                rows: 25,
                capacity: 24,
                modes: v.to_vec()
            }
        );
    }

    #[test]
    fn padding_keeps_the_tensor() {
        let modes = [3, 4, 5];
        let a = random(60, 6);
        let tt = tt_svd(&a, &modes, &TtSvdOptions::rank(2)).unwrap();
        let target = [1, 4, 4, 1];
        let padded = pad_ranks(&tt.cores, &modes, &tt.ranks, &target).unwrap();
        let x = tt_reconstruct(&tt.cores, &modes, &tt.ranks);
        let y = tt_reconstruct(&padded, &modes, &target);
        assert_eq!(x, y);
        assert!(pad_ranks(&tt.cores, &modes, &tt.ranks, &[1, 1, 4, 1]).is_err());
    }

    #[test]
    fn bad_inputs_are_errors() {
        let o = TtSvdOptions::default();
        assert!(matches!(
            tt_svd(&[1.0; 5], &[2, 3], &o),
            Err(TtSvdError::Length { .. })
        ));
        assert!(matches!(
            tt_svd(&[], &[2, 0], &o),
            Err(TtSvdError::BadModes { .. })
        ));
        assert_eq!(
            tt_svd(&[1.0; 6], &[2, 3], &TtSvdOptions::rank(0)).unwrap_err(),
            TtSvdError::ZeroRank
        );
        assert_eq!(
            tt_svd(&[1.0; 6], &[2, 3], &TtSvdOptions::tolerance(-1.0)).unwrap_err(),
            TtSvdError::Tolerance(-1.0)
        );
        let mut x = [1.0; 6];
        x[4] = f32::NAN;
        assert_eq!(
            tt_svd(&x, &[2, 3], &o).unwrap_err(),
            TtSvdError::NonFinite(4)
        );
        // A zero tensor is fine: rank 1, zero error.
        let z = tt_svd(&[0.0; 6], &[2, 3], &TtSvdOptions::tolerance(0.1)).unwrap();
        assert_eq!(z.ranks, vec![1, 1, 1]);
        assert_eq!(z.rel_error, 0.0);
    }
}
