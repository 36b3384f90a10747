//! Proposing TT layouts: balanced factorisations of a width and a rank for a parameter budget.

use crate::layout::{ShapeError, TtShape};

/// All multisets of `parts` factors (each ≥ 2 unless `n` forces a 1) whose product is `n`,
/// most balanced first (smallest spread of log-factors), each listed largest factor first.
/// Returns at most `limit` proposals; empty when `parts == 0` or `n == 0`.
pub fn balanced_factorisations(n: usize, parts: usize, limit: usize) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    if parts == 0 || n == 0 {
        return out;
    }
    let mut cur = Vec::with_capacity(parts);
    collect(n, parts, n, &mut cur, &mut out);
    if out.is_empty() {
        // n has fewer prime factors than `parts`: pad with ones (still a valid layout).
        let mut f = balanced_factorisations(n, parts - 1, 1)
            .pop()
            .unwrap_or_else(|| vec![n]);
        f.push(1);
        out.push(f);
    }
    let spread = |f: &Vec<usize>| {
        let logs: Vec<f64> = f.iter().map(|&x| (x as f64).ln()).collect();
        let mean = logs.iter().sum::<f64>() / logs.len() as f64;
        logs.iter().map(|l| (l - mean).powi(2)).sum::<f64>()
    };
    out.sort_by(|a, b| spread(a).total_cmp(&spread(b)).then_with(|| b.cmp(a)));
    out.truncate(limit);
    out
}

fn collect(n: usize, parts: usize, max: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
    let divisors = divisors(n);
    collect_from(&divisors, n, parts, max, cur, out);
}

/// `collect` over the divisors of the original width only (every factor divides it), so the
/// work grows with the number of divisors, not with `n`.
fn collect_from(
    divisors: &[usize],
    n: usize,
    parts: usize,
    max: usize,
    cur: &mut Vec<usize>,
    out: &mut Vec<Vec<usize>>,
) {
    if parts == 1 {
        if n >= 2 && n <= max {
            cur.push(n);
            out.push(cur.clone());
            cur.pop();
        } else if n == 1 && cur.is_empty() {
            out.push(vec![1]);
        }
        return;
    }
    for &f in divisors.iter().rev() {
        if f >= 2 && f <= max.min(n) && n.is_multiple_of(f) {
            cur.push(f);
            collect_from(divisors, n / f, parts - 1, f, cur, out);
            cur.pop();
        }
    }
}

/// The divisors of `n` in increasing order (trial division up to √n).
fn divisors(n: usize) -> Vec<usize> {
    let (mut small, mut large) = (Vec::new(), Vec::new());
    let mut d = 1usize;
    while d.saturating_mul(d) <= n {
        if n.is_multiple_of(d) {
            small.push(d);
            if d != n / d {
                large.push(n / d);
            }
        }
        d += 1;
    }
    small.extend(large.into_iter().rev());
    small
}

/// Whether a factorisation is balanced enough to be a useful TT layout: no factor of 1 (unless
/// the width itself is 1) and the largest factor at most 4× the smallest.
pub fn is_balanced(f: &[usize]) -> bool {
    let (min, max) = (f.iter().min(), f.iter().max());
    match (min, max) {
        (Some(&lo), Some(&hi)) => f.iter().product::<usize>() == 1 || (lo >= 2 && hi <= 4 * lo),
        _ => false,
    }
}

/// For a width without a balanced `parts`-factor layout (a prime, or a prime times a small
/// number): the smallest width n' > n, within n + n/4 + 16, that has one, with its most
/// balanced factorisation. The layer is then padded: extra input features are zeros, extra
/// output features are dropped.
pub fn padded_balanced(n: usize, parts: usize) -> Option<(usize, Vec<usize>)> {
    let limit = n.saturating_add(n / 4 + 16);
    (n.saturating_add(1)..=limit).find_map(|c| {
        let f = balanced_factorisations(c, parts, 1).pop()?;
        is_balanced(&f).then_some((c, f))
    })
}

/// Core parameters of a TT layout with these modes (inputs then outputs) at one uniform inner
/// rank, in u128 (saturating) so no width or rank overflows: s_1·r + Σ r²·s_k + s_K·r.
pub fn uniform_core_params(modes: &[usize], rank: usize) -> u128 {
    let r = rank as u128;
    let k = modes.len();
    modes
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            let left = if i == 0 { 1 } else { r };
            let right = if i + 1 == k { 1 } else { r };
            left.saturating_mul(s as u128).saturating_mul(right)
        })
        .fold(0u128, u128::saturating_add)
}

/// The largest uniform rank r ≥ 1 whose cores hold at most `budget` parameters, or `None`
/// when even rank 1 exceeds it. A binary search: the count grows with r.
pub fn rank_for_budget(
    in_modes: &[usize],
    out_modes: &[usize],
    budget: usize,
) -> Result<Option<usize>, ShapeError> {
    TtShape::uniform(in_modes, out_modes, 1)?;
    let modes: Vec<usize> = in_modes.iter().chain(out_modes).copied().collect();
    let fits = |r: usize| uniform_core_params(&modes, r) <= budget as u128;
    if !fits(1) {
        return Ok(None);
    }
    // fits(lo) holds, fits(hi) does not (a rank above the budget itself never fits, as every
    // layout has at least two cores, each with at least r parameters).
    let (mut lo, mut hi) = (1usize, budget.saturating_add(1));
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(Some(lo))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_the_papers_factorisations() {
        let f = balanced_factorisations(768, 3, 3);
        assert_eq!(f[0].iter().product::<usize>(), 768);
        assert!(f.contains(&vec![12, 8, 8]), "{f:?}");
        assert_eq!(
            balanced_factorisations(3072, 3, 5)[0]
                .iter()
                .product::<usize>(),
            3072
        );
        assert_eq!(balanced_factorisations(7, 2, 3), vec![vec![7, 1]]);
        for f in balanced_factorisations(360, 3, 10) {
            assert_eq!(f.iter().product::<usize>(), 360);
        }
    }

    #[test]
    fn rank_budget_is_tight() {
        let r = rank_for_budget(&[12, 8, 8], &[8, 8, 12], 20_000)
            .unwrap()
            .unwrap();
        let at = TtShape::uniform(&[12, 8, 8], &[8, 8, 12], r)
            .unwrap()
            .core_params();
        let above = TtShape::uniform(&[12, 8, 8], &[8, 8, 12], r + 1)
            .unwrap()
            .core_params();
        assert!(at <= 20_000 && above > 20_000);
        assert_eq!(rank_for_budget(&[4], &[4], 3).unwrap(), None);
        // The u128 count agrees with the layout's own.
        for r in [1, 2, 7, 30] {
            let s = TtShape::uniform(&[12, 8, 8], &[8, 8, 12], r).unwrap();
            assert_eq!(
                uniform_core_params(&[12, 8, 8, 8, 8, 12], r),
                s.core_params() as u128
            );
        }
    }

    #[test]
    fn huge_and_prime_widths_are_quick_and_exact() {
        // 2^32 = (2^11)(2^11)(2^10): the divisor walk is √n work, not n.
        let f = balanced_factorisations(1 << 32, 3, 1);
        assert_eq!(f, vec![vec![2048, 2048, 1024]]);
        let r = rank_for_budget(&f[0], &f[0], usize::MAX).unwrap().unwrap();
        assert!(r > 1_000_000, "{r}");
        // A prime has only the padded-with-ones layout; the nearest balanced width is offered.
        assert_eq!(balanced_factorisations(997, 3, 3), vec![vec![997, 1, 1]]);
        assert!(!is_balanced(&[997, 1, 1]));
        let (n, f) = padded_balanced(997, 3).unwrap();
        assert_eq!((n, f.iter().product::<usize>()), (1000, 1000));
        assert!(is_balanced(&f), "{f:?}");
        assert!(is_balanced(&[12, 8, 8]) && !is_balanced(&[64, 2, 2]));
        // A large prime (2^31 − 1) factors in √n steps.
        assert_eq!(
            balanced_factorisations(2_147_483_647, 2, 3),
            vec![vec![2_147_483_647, 1]]
        );
    }
}
