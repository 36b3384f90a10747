//! Distillation losses: what a student learns from a frozen teacher besides the labels.
//!
//! Logit distillation at temperature τ (Hinton et al. 2015) over N rows of C logits, student
//! s and teacher t:
//!   p_r = softmax(t_r / τ),   q_r = softmax(s_r / τ),
//!   L_kd = (τ² / N) Σ_r Σ_c p_rc (ln p_rc − ln q_rc)      (KL(p‖q), mean over rows),
//!   ∂L_kd/∂s_rc = (τ / N) (q_rc − p_rc).
//! The τ² keeps the gradient's size independent of τ, so its weight means the same at any
//! temperature. Both softmaxes are max-subtracted; sums are in f64.
//!
//! Hidden-state matching over the real tokens of S sequences of T rows of width D (mask
//! m_i = 1 for a real token, 0 for padding; M_s = the real tokens of sequence s), student h and
//! teacher g: the mean over sequences of each sequence's mean over its real tokens,
//!   L_h = (1/S) Σ_s (1 / (M_s·D)) Σ_{i ∈ s} m_i ‖h_i − g_i‖²,
//!   ∂L_h/∂h_i = (2 / (S·M_s·D)) m_i (h_i − g_i).
//! A mean over sequences, like the task's loss over examples, so a batch split across
//! processes (each its sequences, shares weighted by sequences) gives the same loss and
//! gradient as one process. A sequence without a real token contributes 0.

/// The terms of a distilled step's loss (each unweighted; the total is their weighted sum).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossTerms {
    /// The task's own loss on the labels (cross-entropy).
    pub task: f64,
    /// L_kd: the temperature-scaled KL divergence to the teacher's logits.
    pub logits: f64,
    /// L_h: the mean squared error to the teacher's hidden states, averaged over the mapped
    /// layer pairs.
    pub hidden: f64,
}

impl LossTerms {
    /// `self + other·w` term by term (running sums over steps and processes).
    pub fn add_scaled(&mut self, other: &LossTerms, w: f64) {
        self.task += other.task * w;
        self.logits += other.logits * w;
        self.hidden += other.hidden * w;
    }

    /// The terms as an array, in the order task, logits, hidden (for reductions).
    pub fn to_array(self) -> [f64; 3] {
        [self.task, self.logits, self.hidden]
    }

    /// From [`LossTerms::to_array`]'s order.
    pub fn from_array([task, logits, hidden]: [f64; 3]) -> LossTerms {
        LossTerms {
            task,
            logits,
            hidden,
        }
    }
}

/// Writes softmax(z / τ) of one row into `out`.
fn softmax_t(z: &[f32], tau: f32, out: &mut [f64]) {
    let m = z.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let tau = tau as f64;
    let mut sum = 0.0f64;
    for (o, &v) in out.iter_mut().zip(z) {
        *o = ((v as f64 - m) / tau).exp();
        sum += *o;
    }
    out.iter_mut().for_each(|o| *o /= sum);
}

/// L_kd of `student` against `teacher` (both N × `classes`, row-major) at temperature `tau`,
/// and `weight`·∂L_kd/∂student *added* into `dstudent`. `scratch` holds 2·`classes` values.
#[track_caller]
pub fn logit_kd(
    student: &[f32],
    teacher: &[f32],
    classes: usize,
    tau: f32,
    weight: f32,
    dstudent: &mut [f32],
    scratch: &mut [f64],
) -> f64 {
    assert!(
        classes > 0 && student.len().is_multiple_of(classes),
        "logits N × C"
    );
    assert_eq!(student.len(), teacher.len(), "teacher logits");
    assert_eq!(student.len(), dstudent.len(), "logit gradient");
    assert!(tau > 0.0, "temperature > 0");
    let rows = student.len() / classes;
    if rows == 0 {
        return 0.0;
    }
    let (p, q) = scratch[..2 * classes].split_at_mut(classes);
    let tau64 = tau as f64;
    let g = weight as f64 * tau64 / rows as f64;
    let mut kl = 0.0f64;
    for r in 0..rows {
        let span = r * classes..(r + 1) * classes;
        softmax_t(&teacher[span.clone()], tau, p);
        softmax_t(&student[span.clone()], tau, q);
        for c in 0..classes {
            if p[c] > 0.0 {
                // q underflows to 0 only where the student is e^-700 below its max: clamp so
                // the loss stays finite (the gradient needs no clamp).
                kl += p[c] * (p[c].ln() - q[c].max(f64::MIN_POSITIVE).ln());
            }
        }
        for (d, (&qc, &pc)) in dstudent[span].iter_mut().zip(q.iter().zip(p.iter())) {
            *d += (g * (qc - pc)) as f32;
        }
    }
    kl * tau64 * tau64 / rows as f64
}

/// Each sequence of `t` rows: (its student rows, teacher rows, mask, 1/(M_s·D) or 0 without
/// a real token).
fn sequences<'a>(
    student: &'a [f32],
    teacher: &'a [f32],
    mask: &'a [u8],
    t: usize,
) -> impl Iterator<Item = (&'a [f32], &'a [f32], &'a [u8], f64)> {
    assert_eq!(student.len(), teacher.len(), "teacher hidden states");
    assert!(
        t > 0 && mask.len().is_multiple_of(t),
        "mask: sequences of {t} rows"
    );
    let d = student.len() / mask.len().max(1);
    assert_eq!(d * mask.len(), student.len(), "hidden states rows × D");
    let span = t * d;
    student
        .chunks_exact(span)
        .zip(teacher.chunks_exact(span))
        .zip(mask.chunks_exact(t))
        .map(move |((h, g), m)| {
            let real = m.iter().filter(|&&k| k != 0).count();
            let inv = if real == 0 {
                0.0
            } else {
                1.0 / (real * d) as f64
            };
            (h, g, m, inv)
        })
}

/// L_h of `student` against `teacher` (both `mask.len()` × D row-major, sequences of `t`).
#[track_caller]
pub fn hidden_mse(student: &[f32], teacher: &[f32], mask: &[u8], t: usize) -> f64 {
    let d = student.len() / mask.len().max(1);
    let mut sum = 0.0f64;
    let mut seqs = 0usize;
    for (h, g, m, inv) in sequences(student, teacher, mask, t) {
        seqs += 1;
        let rows = h.chunks_exact(d).zip(g.chunks_exact(d)).zip(m);
        let sq: f64 = rows
            .filter(|(_, &k)| k != 0)
            .map(|((h, g), _)| {
                h.iter()
                    .zip(g)
                    .map(|(&a, &b)| (a as f64 - b as f64).powi(2))
                    .sum::<f64>()
            })
            .sum();
        sum += sq * inv;
    }
    if seqs == 0 {
        0.0
    } else {
        sum / seqs as f64
    }
}

/// `weight`·∂L_h/∂student *added* into `dstudent` (rows × D, as [`hidden_mse`]).
#[track_caller]
pub fn hidden_mse_grad(
    student: &[f32],
    teacher: &[f32],
    mask: &[u8],
    t: usize,
    weight: f32,
    dstudent: &mut [f32],
) {
    assert_eq!(student.len(), dstudent.len(), "hidden-state gradient");
    let d = student.len() / mask.len().max(1);
    let seqs = mask.len() / t.max(1);
    let span = t * d;
    let each = sequences(student, teacher, mask, t).zip(dstudent.chunks_exact_mut(span));
    for ((h, g, m, inv), dh) in each {
        let s = (2.0 * weight as f64 * inv / seqs as f64) as f32;
        let rows = h
            .chunks_exact(d)
            .zip(g.chunks_exact(d))
            .zip(dh.chunks_exact_mut(d));
        for (((h, g), dh), &k) in rows.zip(m) {
            if k != 0 {
                for ((o, &a), &b) in dh.iter_mut().zip(h).zip(g) {
                    *o += s * (a - b);
                }
            }
        }
    }
}
