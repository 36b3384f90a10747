//! Distillation: a classifier student trained against a frozen teacher encoder's logits and
//! hidden states as well as the labels.
//!
//! The teacher rides in the student's training state ([`EncoderState::attach_teacher`]), so the
//! one training step and loop need nothing new: a training forward runs the teacher forward on
//! the same batch (no dropout, no gradient; its parameters are not the model's, so no optimiser
//! ever sees them) and then the student, whose loss becomes
//!
//! ```text
//!   L = w_task·CE(s, y) + w_logits·L_kd(s, t; τ) + w_hidden·(1/P) Σ_{(i,j) ∈ map} L_h(h_i, g_j)
//! ```
//!
//! with s, t the student's and teacher's logits, h_i the student's hidden state i and g_j the
//! teacher's hidden state j (numbered as Hugging Face's `hidden_states`: 0 = the embeddings'
//! output, k = block k's output), P pairs in the layer map, and L_kd, L_h as in
//! [`comera_layers::distill`]. The backward adds w_logits·∂L_kd/∂s to the head's ∂CE/∂s (scaled
//! by w_task), and w_hidden/P·∂L_h/∂h_i to the flowing gradient as it passes hidden state i.
//!
//! Evaluation forwards (`train = false`) ignore the teacher: held-out figures are the
//! student's own.

use super::{Encoder, EncoderState};
use crate::config::{ConfigError, HeadKind};
use comera_layers::distill::{hidden_mse, hidden_mse_grad, logit_kd};
use comera_layers::{LossTerms, StepStats};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The distillation loss's weights, temperature and layer map.
#[derive(Clone, Debug, PartialEq)]
pub struct DistillLoss {
    /// w_task: weight of the cross-entropy on the labels.
    pub task_weight: f32,
    /// w_logits: weight of the KL divergence to the teacher's logits.
    pub logit_weight: f32,
    /// τ: the softmax temperature of both sides of the KL divergence.
    pub temperature: f32,
    /// w_hidden: weight of the hidden-state MSE (mean over the pairs).
    pub hidden_weight: f32,
    /// (student hidden state, teacher hidden state) pairs; 0 = embeddings, k = block k.
    pub layers: Vec<(usize, usize)>,
}

/// A frozen teacher and its own state for the student's batch shape.
#[derive(Debug)]
pub struct Teacher {
    model: Arc<Encoder>,
    state: EncoderState,
    loss: DistillLoss,
    /// 2·C values for the two softmaxes of a row.
    scratch: Vec<f64>,
    /// Wall time of the teacher's forwards since it was attached.
    forward_time: Duration,
}

impl Teacher {
    /// The teacher's model.
    pub fn model(&self) -> &Encoder {
        &self.model
    }

    /// Wall time spent in the teacher's forwards.
    pub fn forward_time(&self) -> Duration {
        self.forward_time
    }

    /// Bytes of the teacher's parameters and of its forward state.
    pub fn bytes(&self) -> (usize, usize) {
        (4 * self.model.num_params(), self.state.bytes())
    }

    /// The hidden pairs' weight each: w_hidden / P.
    fn pair_weight(&self) -> f32 {
        self.loss.hidden_weight / self.loss.layers.len().max(1) as f32
    }
}

impl DistillLoss {
    /// Checks that `teacher` can teach `student` under this loss, naming the field at fault
    /// (what [`EncoderState::attach_teacher`] checks, without building any state).
    pub fn check(&self, student: &Encoder, teacher: &Encoder) -> Result<(), ConfigError> {
        check(student, teacher, self)
    }
}

/// Checks that `teacher` can teach `student` under `loss`, naming the field at fault.
fn check(student: &Encoder, teacher: &Encoder, loss: &DistillLoss) -> Result<(), ConfigError> {
    let err = |field: &str, msg: String| {
        Err(ConfigError {
            field: field.into(),
            msg,
        })
    };
    let (s, t) = (&student.cfg, &teacher.cfg);
    if s.head != HeadKind::Classifier || t.head != HeadKind::Classifier {
        return err(
            "distill.teacher",
            "distillation trains a classifier from a classifier (the student and the teacher must both have classifier heads)".into(),
        );
    }
    if loss.logit_weight > 0.0 && s.num_labels != t.num_labels {
        return err(
            "distill.teacher",
            format!(
                "the teacher predicts {} labels, the student {}: logit distillation needs the same labels (set distill.logit_weight = 0 to match hidden states only)",
                t.num_labels, s.num_labels
            ),
        );
    }
    if s.vocab_size != t.vocab_size {
        return err(
            "distill.teacher",
            format!(
                "the teacher's vocabulary has {} tokens, the student's {}: both must read the same token ids",
                t.vocab_size, s.vocab_size
            ),
        );
    }
    if t.seq_len < s.seq_len {
        return err(
            "distill.teacher",
            format!(
                "the teacher reads at most {} tokens, the student {}: the teacher must read the student's sequences",
                t.seq_len, s.seq_len
            ),
        );
    }
    if !(loss.temperature > 0.0 && loss.temperature.is_finite()) {
        return err(
            "distill.temperature",
            format!("{}: expected a number > 0", loss.temperature),
        );
    }
    for (field, w) in [
        ("distill.task_weight", loss.task_weight),
        ("distill.logit_weight", loss.logit_weight),
        ("distill.hidden_weight", loss.hidden_weight),
    ] {
        if !(w >= 0.0 && w.is_finite()) {
            return err(field, format!("{w}: expected a number ≥ 0"));
        }
    }
    if loss.hidden_weight > 0.0 {
        if loss.layers.is_empty() {
            return err(
                "distill.layers",
                "distill.hidden_weight > 0 but no layer pairs are given (e.g. layers = [[2, 4], [4, 8]])".into(),
            );
        }
        if s.d_model != t.d_model {
            return err(
                "distill.layers",
                format!(
                    "the teacher's hidden states are {} wide, the student's {}: hidden-state matching needs the same width",
                    t.d_model, s.d_model
                ),
            );
        }
    }
    for &(i, j) in &loss.layers {
        if i > s.layers || j > t.layers {
            return err(
                "distill.layers",
                format!(
                    "[{i}, {j}]: hidden states are numbered 0 (embeddings) to {} for the student and to {} for the teacher",
                    s.layers, t.layers
                ),
            );
        }
    }
    Ok(())
}

impl EncoderState {
    /// Attaches `teacher` to this (training) state of `student`: from now on every training
    /// forward also runs the teacher and the loss is the distillation loss (module docs).
    /// The teacher gets its own state for this batch shape; it is never trained.
    pub fn attach_teacher(
        &mut self,
        student: &Encoder,
        teacher: Arc<Encoder>,
        loss: DistillLoss,
    ) -> Result<(), ConfigError> {
        check(student, &teacher, &loss)?;
        let state = teacher
            .state_for(self.b, self.t, 0)
            .map_err(|e| ConfigError {
                field: "distill.teacher".into(),
                msg: format!("{}: {}", e.field, e.msg),
            })?;
        // The student's last hidden state is matched on every row: its last block cannot run
        // on the [CLS] rows only.
        let n_layers = student.cfg.layers;
        if loss.hidden_weight > 0.0 && loss.layers.iter().any(|&(i, _)| i == n_layers) {
            self.full_last_block();
        }
        let classes = teacher.cfg.num_labels;
        self.teacher = Some(Box::new(Teacher {
            model: teacher,
            state,
            loss,
            scratch: vec![0.0; 2 * classes],
            forward_time: Duration::ZERO,
        }));
        Ok(())
    }

    /// The attached teacher, if any.
    pub fn teacher(&self) -> Option<&Teacher> {
        self.teacher.as_deref()
    }

    /// Hidden state `k` of the last forward (N × D): 0 = the embeddings' output x0, k = block
    /// k's output. Rows the last forward did not compute are stale (see [`Self::hidden`]).
    pub fn hidden_state(&self, k: usize) -> &[f32] {
        match k {
            0 => &self.x0,
            k if self.plan.recompute => &self.outs[k - 1],
            k => &self.acts[k - 1].rows.out,
        }
    }
}

impl Encoder {
    /// The teacher's forward on the batch loaded in the student's state `st`, then the
    /// distillation terms added to the student's `stats` (its cross-entropy) and to its logit
    /// gradient. Called after the student's training forward.
    pub(super) fn distill_forward(&self, st: &mut EncoderState, stats: StepStats) -> StepStats {
        let Some(mut teacher) = st.teacher.take() else {
            return stats;
        };
        let t0 = Instant::now();
        let ts = &mut teacher.state;
        ts.ids.copy_from_slice(&st.ids);
        ts.types.copy_from_slice(&st.types);
        ts.mask.copy_from_slice(&st.mask);
        teacher
            .model
            .forward(&mut teacher.state, false, st.step)
            .expect("the student's batch passed the same vocabulary's checks");
        teacher.forward_time += t0.elapsed();

        let loss = &teacher.loss;
        let (logits, dlogits) = st
            .head
            .classifier_logits_mut()
            .expect("checked at attach: a classifier");
        // The head left ∂CE/∂s: weigh it, then add the KL term's gradient.
        dlogits.iter_mut().for_each(|g| *g *= loss.task_weight);
        let classes = teacher.model.cfg.num_labels;
        let kd = if loss.logit_weight > 0.0 {
            let t_logits = teacher.state.head.logits();
            let scratch = &mut teacher.scratch;
            logit_kd(
                logits,
                t_logits,
                classes,
                loss.temperature,
                loss.logit_weight,
                dlogits,
                scratch,
            )
        } else {
            0.0
        };
        let hidden = if loss.hidden_weight > 0.0 {
            let sum: f64 = loss
                .layers
                .iter()
                .map(|&(i, j)| {
                    hidden_mse(
                        st.hidden_state(i),
                        teacher.state.hidden_state(j),
                        &st.mask,
                        st.t,
                    )
                })
                .sum();
            sum / loss.layers.len() as f64
        } else {
            0.0
        };
        let terms = LossTerms {
            task: stats.loss,
            logits: kd,
            hidden,
        };
        let total = loss.task_weight as f64 * terms.task
            + loss.logit_weight as f64 * terms.logits
            + loss.hidden_weight as f64 * terms.hidden;
        st.teacher = Some(teacher);
        StepStats {
            loss: total,
            terms: Some(terms),
            ..stats
        }
    }

    /// Adds w_hidden/P·∂L_h/∂h_k for every pair on the student's hidden state `k` into the
    /// flowing gradient `st.sc.rows.d` (which holds ∂L/∂h_k when this is called).
    pub(super) fn distill_backward(&self, st: &mut EncoderState, k: usize) {
        let Some(teacher) = &st.teacher else { return };
        if teacher.loss.hidden_weight == 0.0 {
            return;
        }
        let w = teacher.pair_weight();
        // The flowing gradient taken out (a move, no allocation) while the state is read.
        let mut d = std::mem::take(&mut st.sc.rows.d);
        for &(i, j) in teacher.loss.layers.iter().filter(|&&(i, _)| i == k) {
            let g = teacher.state.hidden_state(j);
            hidden_mse_grad(st.hidden_state(i), g, &st.mask, st.t, w, &mut d);
        }
        st.sc.rows.d = d;
    }
}
