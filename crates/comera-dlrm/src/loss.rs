//! Binary cross-entropy on logits, and the evaluation metrics of a CTR model (AUC, log-loss,
//! accuracy).
//!
//! For a logit z and label y ∈ {0, 1}, with σ the logistic function:
//!   BCE(z, y) = −y·ln σ(z) − (1 − y)·ln(1 − σ(z)) = max(z, 0) − z·y + ln(1 + e^(−|z|))
//! (the stable form), and ∂BCE/∂z = σ(z) − y. The mean over B examples has gradient
//! (σ(z) − y)/B. Losses are summed in f64 in example order.

/// σ(z), stable for either sign.
#[inline]
pub fn sigmoid(z: f32) -> f32 {
    if z >= 0.0 {
        1.0 / (1.0 + (-z).exp())
    } else {
        let e = z.exp();
        e / (1.0 + e)
    }
}

/// BCE of one logit, in f64.
#[inline]
pub fn bce(z: f32, y: f32) -> f64 {
    let z = z as f64;
    z.max(0.0) - z * y as f64 + (-z.abs()).exp().ln_1p()
}

/// Mean BCE of `logits` against `labels` and the number of correct predictions at
/// probability 0.5 (logit 0); when `dlogits` is given, writes ∂(mean)/∂logit into it.
pub fn bce_with_logits(
    logits: &[f32],
    labels: &[f32],
    dlogits: Option<&mut [f32]>,
) -> (f64, usize) {
    assert_eq!(logits.len(), labels.len(), "one logit per label");
    let n = logits.len().max(1);
    let mut sum = 0.0f64;
    let mut correct = 0;
    for (&z, &y) in logits.iter().zip(labels) {
        sum += bce(z, y);
        correct += ((z > 0.0) == (y > 0.5)) as usize;
    }
    if let Some(d) = dlogits {
        let inv = 1.0 / n as f32;
        for ((g, &z), &y) in d.iter_mut().zip(logits).zip(labels) {
            *g = (sigmoid(z) - y) * inv;
        }
    }
    (sum / n as f64, correct)
}

/// Area under the ROC curve of `scores` for binary `labels`: the probability that a random
/// positive scores above a random negative, ties counting one half (Mann-Whitney U with
/// average ranks). `None` when one class is absent.
pub fn auc(scores: &[f32], labels: &[f32]) -> Option<f64> {
    assert_eq!(scores.len(), labels.len());
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(a.cmp(&b)));
    let (mut pos, mut rank_sum) = (0u64, 0.0f64);
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j < idx.len() && scores[idx[j]] == scores[idx[i]] {
            j += 1;
        }
        // Ranks i+1..=j share the average (i + 1 + j) / 2.
        let avg = (i + 1 + j) as f64 / 2.0;
        for &k in &idx[i..j] {
            if labels[k] > 0.5 {
                pos += 1;
                rank_sum += avg;
            }
        }
        i = j;
    }
    let neg = scores.len() as u64 - pos;
    if pos == 0 || neg == 0 {
        return None;
    }
    let (p, n) = (pos as f64, neg as f64);
    Some((rank_sum - p * (p + 1.0) / 2.0) / (p * n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bce_matches_the_textbook_form_and_its_gradient() {
        for &(z, y) in &[(0.3f32, 1.0f32), (-2.0, 0.0), (5.0, 0.0), (-30.0, 1.0)] {
            let p = 1.0 / (1.0 + (-(z as f64)).exp());
            let textbook = -(y as f64) * p.ln() - (1.0 - y as f64) * (1.0 - p).ln();
            assert!(
                (bce(z, y) - textbook).abs() < 1e-6 * (1.0 + textbook),
                "{z} {y}"
            );
        }
        let (z, y) = ([0.5f32, -1.0], [1.0f32, 1.0]);
        let mut d = [0.0; 2];
        let (l, c) = bce_with_logits(&z, &y, Some(&mut d));
        assert_eq!(c, 1);
        let h = 1e-3;
        let lp = bce_with_logits(&[0.5 + h, -1.0], &y, None).0;
        let lm = bce_with_logits(&[0.5 - h, -1.0], &y, None).0;
        assert!(((lp - lm) / (2.0 * h as f64) - d[0] as f64).abs() < 1e-4);
        assert!(l > 0.0);
    }

    #[test]
    fn auc_counts_pairs_and_ties() {
        assert_eq!(
            auc(&[0.1, 0.4, 0.35, 0.8], &[0.0, 0.0, 1.0, 1.0]),
            Some(0.75)
        );
        assert_eq!(auc(&[0.5, 0.5], &[0.0, 1.0]), Some(0.5));
        assert_eq!(auc(&[1.0, 2.0], &[1.0, 1.0]), None);
        assert_eq!(auc(&[3.0, 2.0, 1.0], &[1.0, 0.0, 0.0]), Some(1.0));
    }
}
