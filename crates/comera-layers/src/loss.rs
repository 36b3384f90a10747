//! Softmax cross-entropy over integer labels, with an ignore label and mean reduction.
//!
//! For logits z of shape (rows, C) and labels y (rows), a row r counts unless
//! y_r = ignore_index (PyTorch's −100 by default: masked-LM positions that are not predicted);
//! with N = #counted rows,
//!   m_r = max_c z_rc,   lse_r = m_r + ln Σ_c exp(z_rc − m_r)   (max-subtracted, stable),
//!   L = (1/N) Σ_{counted r} (lse_r − z_{r,y_r}),
//!   ∂L/∂z_rc = (softmax(z_r)_c − [c = y_r]) / N for counted rows, 0 for ignored rows.
//! With no counted row, L = 0 and the gradient is 0. Row losses are summed in f64 in row order.

use crate::check_len;

/// The ignore label PyTorch uses by default.
pub const IGNORE_INDEX: i32 = -100;

/// Softmax cross-entropy over `classes` classes.
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropy {
    pub classes: usize,
    /// Rows whose label equals this are skipped (no loss, no gradient, not counted).
    pub ignore_index: Option<i32>,
}

/// What one evaluation of the loss saw.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CrossEntropyStats {
    /// Mean loss over counted rows (0 if none).
    pub loss: f64,
    /// Summed loss over counted rows.
    pub loss_sum: f64,
    /// Counted (non-ignored) rows.
    pub count: usize,
    /// Counted rows whose argmax (first maximum) equals the label.
    pub correct: usize,
}

/// Index of the first maximum of `row` (0 for an empty row).
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (c, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = c;
        }
    }
    best
}

impl CrossEntropy {
    /// Ignores rows labelled [`IGNORE_INDEX`] (−100).
    pub fn new(classes: usize) -> CrossEntropy {
        CrossEntropy::with_ignore_index(classes, Some(IGNORE_INDEX))
    }

    pub fn with_ignore_index(classes: usize, ignore_index: Option<i32>) -> CrossEntropy {
        assert!(classes > 0, "cross-entropy needs at least one class");
        if let Some(ig) = ignore_index {
            assert!(
                ig < 0 || ig as usize >= classes,
                "ignore_index {ig} is a valid class of {classes}"
            );
        }
        CrossEntropy {
            classes,
            ignore_index,
        }
    }

    /// The class of a counted row, `None` for an ignored one; panics on any other label.
    #[inline]
    fn class_of(&self, label: i32) -> Option<usize> {
        if Some(label) == self.ignore_index {
            return None;
        }
        assert!(
            label >= 0 && (label as usize) < self.classes,
            "label {label} outside 0..{}",
            self.classes
        );
        Some(label as usize)
    }

    fn check(&self, logits: &[f32], labels: &[i32]) -> usize {
        let rows = labels.len();
        check_len("CrossEntropy logits", logits.len(), rows * self.classes);
        rows
    }

    /// Number of rows that count (labels other than the ignore label).
    pub fn counted(&self, labels: &[i32]) -> usize {
        labels
            .iter()
            .filter(|&&l| self.class_of(l).is_some())
            .count()
    }

    /// Loss and accuracy counts, no gradient. `logits` (rows, C), `labels` (rows).
    pub fn forward(&self, logits: &[f32], labels: &[i32]) -> CrossEntropyStats {
        let rows = self.check(logits, labels);
        let c = self.classes;
        let mut stats = CrossEntropyStats::default();
        for r in 0..rows {
            let Some(y) = self.class_of(labels[r]) else {
                continue;
            };
            let z = &logits[r * c..(r + 1) * c]; // (C)
            let best = argmax(z);
            let m = z[best];
            let sum: f64 = z.iter().map(|&v| (v - m).exp() as f64).sum();
            stats.loss_sum += m as f64 + sum.ln() - z[y] as f64;
            stats.count += 1;
            stats.correct += (best == y) as usize;
        }
        stats.loss = if stats.count > 0 {
            stats.loss_sum / stats.count as f64
        } else {
            0.0
        };
        stats
    }

    /// Loss and accuracy counts, and *writes* `dlogits` (rows, C) = ∂(mean loss)/∂logits.
    pub fn forward_backward(
        &self,
        logits: &[f32],
        labels: &[i32],
        dlogits: &mut [f32],
    ) -> CrossEntropyStats {
        let rows = self.check(logits, labels);
        check_len("CrossEntropy dlogits", dlogits.len(), rows * self.classes);
        let c = self.classes;
        let n = self.counted(labels);
        let inv_n = if n > 0 { 1.0 / n as f32 } else { 0.0 };
        let mut stats = CrossEntropyStats::default();
        for r in 0..rows {
            let d = &mut dlogits[r * c..(r + 1) * c]; // (C)
            let Some(y) = self.class_of(labels[r]) else {
                d.fill(0.0);
                continue;
            };
            let z = &logits[r * c..(r + 1) * c]; // (C)
            let best = argmax(z);
            let m = z[best];
            // d ← exp(z − m), then softmax/N − onehot/N.
            let mut sum = 0.0f64;
            for (dv, &zv) in d.iter_mut().zip(z) {
                let e = (zv - m).exp();
                *dv = e;
                sum += e as f64;
            }
            let k = (1.0 / sum) as f32 * inv_n;
            for dv in d.iter_mut() {
                *dv *= k;
            }
            d[y] -= inv_n;
            stats.loss_sum += m as f64 + sum.ln() - z[y] as f64;
            stats.count += 1;
            stats.correct += (best == y) as usize;
        }
        stats.loss = if stats.count > 0 {
            stats.loss_sum / stats.count as f64
        } else {
            0.0
        };
        stats
    }

    /// [`CrossEntropy::forward_backward`] for wide rows (a vocabulary): overwrites `logits`
    /// with ∂(mean loss)/∂logits, rows in parallel. `scratch` holds two f64 per row (row loss,
    /// hit); the row losses are summed in row order afterwards, so the result does not depend
    /// on the thread count. Without `grad`, `logits` is left unchanged (evaluation).
    pub fn forward_rows(
        &self,
        logits: &mut [f32],
        labels: &[i32],
        scratch: &mut [f64],
        grad: bool,
    ) -> CrossEntropyStats {
        use rayon::prelude::*;
        let rows = self.check(logits, labels);
        check_len("CrossEntropy scratch", scratch.len(), 2 * rows);
        let c = self.classes;
        let n = self.counted(labels);
        let inv_n = if n > 0 { 1.0 / n as f32 } else { 0.0 };
        logits
            .par_chunks_mut(c)
            .zip(scratch.par_chunks_mut(2))
            .zip(labels.par_iter())
            .for_each(|((z, out), &label)| {
                let Some(y) = self.class_of(label) else {
                    if grad {
                        z.fill(0.0);
                    }
                    out.fill(f64::NAN);
                    return;
                };
                let best = argmax(z);
                let m = z[best];
                let zy = z[y];
                let sum: f64 = if grad {
                    let mut sum = 0.0f64;
                    for v in z.iter_mut() {
                        let e = (*v - m).exp();
                        *v = e;
                        sum += e as f64;
                    }
                    let k = (1.0 / sum) as f32 * inv_n;
                    for v in z.iter_mut() {
                        *v *= k;
                    }
                    z[y] -= inv_n;
                    sum
                } else {
                    z.iter().map(|&v| (v - m).exp() as f64).sum()
                };
                out[0] = m as f64 + sum.ln() - zy as f64;
                out[1] = (best == y) as u8 as f64;
            });
        let mut stats = CrossEntropyStats::default();
        for out in scratch.chunks_exact(2) {
            if !out[0].is_nan() {
                stats.loss_sum += out[0];
                stats.count += 1;
                stats.correct += (out[1] > 0.5) as usize;
            }
        }
        stats.loss = if stats.count > 0 {
            stats.loss_sum / stats.count as f64
        } else {
            0.0
        };
        stats
    }

    /// (correct, counted): counted rows whose argmax equals the label, and counted rows.
    pub fn accuracy_counts(&self, logits: &[f32], labels: &[i32]) -> (usize, usize) {
        let rows = self.check(logits, labels);
        let c = self.classes;
        let (mut correct, mut count) = (0, 0);
        for r in 0..rows {
            if let Some(y) = self.class_of(labels[r]) {
                count += 1;
                correct += (argmax(&logits[r * c..(r + 1) * c]) == y) as usize;
            }
        }
        (correct, count)
    }
}
