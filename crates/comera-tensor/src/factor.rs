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
    for f in (2..=max.min(n)).rev() {
        if n.is_multiple_of(f) {
            cur.push(f);
            collect(n / f, parts - 1, f, cur, out);
            cur.pop();
        }
    }
}

/// The largest uniform rank r ≥ 1 whose cores hold at most `budget` parameters, or `None`
/// when even rank 1 exceeds it.
pub fn rank_for_budget(
    in_modes: &[usize],
    out_modes: &[usize],
    budget: usize,
) -> Result<Option<usize>, ShapeError> {
    let mut best = None;
    let mut r = 1;
    loop {
        let params = TtShape::uniform(in_modes, out_modes, r)?.core_params();
        if params > budget {
            return Ok(best);
        }
        best = Some(r);
        r += 1;
    }
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
    }
}
