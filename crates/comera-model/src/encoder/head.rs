//! What sits on the encoder's last hidden states H (N × D): the classifier on the [CLS] (first)
//! position of each sequence,
//!   logits = C(Dropout(tanh(P(h_cls)))),   L = mean softmax cross-entropy over the labels,
//! or the masked-LM head of [`crate::mlm_head`] on the labelled positions. Both leave ∂L/∂H in
//! the encoder's flowing gradient for the blocks' backward.

use super::any_linear;
use crate::config::{ConfigError, EncoderConfig, HeadKind, Layouts, MlmDecoderKind};
use crate::mlm_head::{MlmDecoder, MlmHead, MlmHeadState};
use comera_layers::activation::Tanh;
use comera_layers::any::{AnyEmbedding, AnyLinear, AnyLinearWorkspace};
use comera_layers::dropout::{Dropout, DropoutWorkspace};
use comera_layers::loss::{CrossEntropy, CrossEntropyStats};
use comera_layers::{Param, RankGates, StepStats};
use comera_tensor::init;

/// What sits on the encoder's last hidden states.
#[derive(Clone, Debug)]
// One per model: the variants' size difference costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
pub enum Head {
    Classifier(ClassifierHead),
    Mlm(MlmHead),
}

/// Pooler + classifier on the \[CLS\] position (each dense or TT).
#[derive(Clone, Debug)]
pub struct ClassifierHead {
    pub pool: AnyLinear,
    pub classifier: AnyLinear,
    drop: Dropout,
    ce: CrossEntropy,
}

impl ClassifierHead {
    fn new(
        cfg: &EncoderConfig,
        layouts: &Layouts,
        dseed: u64,
        rng: &mut init::Rng,
    ) -> Result<ClassifierHead, ConfigError> {
        let (d, rule) = (cfg.d_model, RankGates::new(cfg.threshold));
        let labels = cfg.num_labels;
        Ok(ClassifierHead {
            pool: any_linear("pooler", &layouts.pooler, d, d, rule, rng)?,
            classifier: any_linear("classifier", &layouts.classifier, d, labels, rule, rng)?,
            drop: Dropout::new(cfg.dropout, dseed.wrapping_add(1 << 32)),
            ce: CrossEntropy::with_ignore_index(labels, None),
        })
    }
}

impl Head {
    /// The head of `cfg` (its layers initialised after the blocks'); `dseed` seeds dropout.
    pub(super) fn new(
        cfg: &EncoderConfig,
        layouts: &Layouts,
        dseed: u64,
        rng: &mut init::Rng,
    ) -> Result<Head, ConfigError> {
        if cfg.head == HeadKind::Classifier {
            return Ok(Head::Classifier(ClassifierHead::new(
                cfg, layouts, dseed, rng,
            )?));
        }
        let (d, v, rule) = (cfg.d_model, cfg.vocab_size, RankGates::new(cfg.threshold));
        let decoder = match cfg.mlm_decoder() {
            MlmDecoderKind::Tied => None,
            // A TT projection's width is its out_modes' product (≥ the vocabulary).
            _ => Some(any_linear(
                "mlm.decoder",
                &layouts.mlm_decoder,
                d,
                v,
                rule,
                rng,
            )?),
        };
        Ok(Head::Mlm(MlmHead::new(d, v, cfg.ln_eps, decoder, rng)))
    }

    pub(super) fn params(&self) -> Vec<&Param> {
        match self {
            Head::Classifier(h) => {
                let mut v = h.pool.params();
                v.extend(h.classifier.params());
                v
            }
            Head::Mlm(h) => h.params(),
        }
    }

    pub(super) fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        match self {
            Head::Classifier(h) => {
                h.pool.visit_params_mut(f);
                h.classifier.visit_params_mut(f);
            }
            Head::Mlm(h) => h.visit_params_mut(f),
        }
    }

    /// The head's linear layers: pooler and classifier, or the MLM head's own projection.
    pub(super) fn linears(&self) -> impl Iterator<Item = &AnyLinear> {
        // Without allocating: the rank objective visits them every step.
        let (first, second) = match self {
            Head::Classifier(h) => (Some(&h.pool), Some(&h.classifier)),
            Head::Mlm(h) => match &h.decoder {
                MlmDecoder::Own(l) => (Some(l), None),
                _ => (None, None),
            },
        };
        first.into_iter().chain(second)
    }

    /// [`Head::linears`] mutably, same order, without allocating.
    pub(super) fn visit_linears_mut(&mut self, f: &mut dyn FnMut(&mut AnyLinear)) {
        match self {
            Head::Classifier(h) => {
                f(&mut h.pool);
                f(&mut h.classifier);
            }
            Head::Mlm(h) => {
                if let MlmDecoder::Own(l) = &mut h.decoder {
                    f(l);
                }
            }
        }
    }

    /// The loss on `hidden` (N × D, sequences of `t` rows); with `train`, dropout is on and
    /// ∂L/∂logits is left in `hs` for [`Head::backward`]. A tied MLM projection reads the
    /// word-embedding table.
    pub(super) fn forward(
        &self,
        hs: &mut HeadState,
        word: &AnyEmbedding,
        hidden: &[f32],
        t: usize,
        train: bool,
        step: u64,
    ) -> StepStats {
        let stats = match (self, hs) {
            (Head::Classifier(h), HeadState::Classifier(hs)) => {
                hs.forward(h, hidden, t, train, step)
            }
            (Head::Mlm(h), HeadState::Mlm(hs)) => h.forward(hs, hidden, dense_table(word), train),
            _ => unreachable!("state made for another head"),
        };
        StepStats {
            loss: stats.loss,
            correct: stats.correct,
            count: stats.count,
            terms: None,
        }
    }

    /// Backward of [`Head::forward`]: the head's gradients (and a tied projection's, into the
    /// table), and *writes* ∂L/∂H into `dh` (N × D, sequences of T rows of width D; rows the
    /// head does not read are 0).
    pub(super) fn backward(
        &mut self,
        hs: &mut HeadState,
        word: &mut AnyEmbedding,
        (t, d): (usize, usize),
        dh: &mut [f32],
    ) {
        dh.fill(0.0);
        match (self, hs) {
            (Head::Classifier(h), HeadState::Classifier(hs)) => {
                hs.backward(h);
                super::block::set_first_rows(&hs.dcls, t, d, dh);
            }
            (Head::Mlm(h), HeadState::Mlm(hs)) => {
                let table = match word {
                    AnyEmbedding::Dense(e) => Some(&mut e.table),
                    AnyEmbedding::Ttm(_) => None,
                };
                h.backward(hs, table);
                for (&s, row) in hs.selected.iter().zip(hs.dx.chunks_exact(d)) {
                    let s = s as usize;
                    dh[s * d..(s + 1) * d].copy_from_slice(row);
                }
            }
            _ => unreachable!("state made for another head"),
        }
    }
}

/// The dense word-embedding table (a tied MLM projection's), if the embedding is dense.
fn dense_table(word: &AnyEmbedding) -> Option<&Param> {
    match word {
        AnyEmbedding::Dense(e) => Some(&e.table),
        AnyEmbedding::Ttm(_) => None,
    }
}

/// The head's part of an [`super::EncoderState`].
#[derive(Debug)]
pub enum HeadState {
    Classifier(ClassifierState),
    Mlm(MlmHeadState),
}

impl HeadState {
    /// For `b` sequences of `t` rows; an MLM head predicts at most `mlm_rows_per_seq` rows each.
    pub(super) fn new(
        head: &Head,
        b: usize,
        t: usize,
        d: usize,
        labels: usize,
        mlm_rows_per_seq: usize,
    ) -> HeadState {
        match head {
            Head::Classifier(h) => HeadState::Classifier(ClassifierState::new(h, b, d, labels)),
            Head::Mlm(h) => HeadState::Mlm(h.state(b * mlm_rows_per_seq.min(t), b * t)),
        }
    }

    pub(super) fn logits(&self) -> &[f32] {
        match self {
            HeadState::Classifier(h) => &h.logits,
            HeadState::Mlm(h) => h.logits(),
        }
    }

    /// A classifier's logits and ∂L/∂logits (B × C each) after a training forward.
    pub(super) fn classifier_logits_mut(&mut self) -> Option<(&[f32], &mut [f32])> {
        match self {
            HeadState::Classifier(h) => Some((&h.logits, &mut h.dlogits)),
            HeadState::Mlm(_) => None,
        }
    }

    pub(super) fn bytes(&self) -> usize {
        match self {
            HeadState::Classifier(h) => h.bytes(),
            HeadState::Mlm(h) => h.bytes(),
        }
    }
}

/// The classifier head's activations and scratch (B rows).
#[derive(Debug)]
pub struct ClassifierState {
    ws_pool: AnyLinearWorkspace,
    ws_cls: AnyLinearWorkspace,
    ws_drop: DropoutWorkspace,
    pub(super) labels: Vec<i32>, // B
    cls: Vec<f32>,               // B × D: h_cls
    pooled_pre: Vec<f32>,        // B × D
    pooled: Vec<f32>,            // B × D
    logits: Vec<f32>,            // B × C
    dlogits: Vec<f32>,           // B × C
    dpooled: Vec<f32>,           // B × D
    dcls: Vec<f32>,              // B × D
}

impl ClassifierState {
    fn new(h: &ClassifierHead, b: usize, d: usize, c: usize) -> ClassifierState {
        let z = |len: usize| vec![0.0f32; len];
        ClassifierState {
            ws_pool: h.pool.workspace(b),
            ws_cls: h.classifier.workspace(b),
            ws_drop: h.drop.workspace(b * d),
            labels: vec![0; b],
            cls: z(b * d),
            pooled_pre: z(b * d),
            pooled: z(b * d),
            logits: z(b * c),
            dlogits: z(b * c),
            dpooled: z(b * d),
            dcls: z(b * d),
        }
    }

    /// The width D.
    fn d(&self) -> usize {
        self.cls.len() / self.labels.len()
    }

    /// Head forward on `hidden` (B·T × D).
    fn forward(
        &mut self,
        h: &ClassifierHead,
        hidden: &[f32],
        t: usize,
        train: bool,
        step: u64,
    ) -> CrossEntropyStats {
        super::block::first_rows(hidden, t, self.d(), &mut self.cls);
        h.pool
            .forward(&mut self.ws_pool, &self.cls, &mut self.pooled_pre);
        Tanh.forward(&self.pooled_pre, &mut self.pooled);
        h.drop
            .forward_in_place(&mut self.ws_drop, step, train, &mut self.pooled);
        h.classifier
            .forward(&mut self.ws_cls, &self.pooled, &mut self.logits);
        if train {
            h.ce.forward_backward(&self.logits, &self.labels, &mut self.dlogits)
        } else {
            h.ce.forward(&self.logits, &self.labels)
        }
    }

    /// Head backward: leaves ∂L/∂h_cls in `dcls`.
    fn backward(&mut self, h: &mut ClassifierHead) {
        h.classifier.backward(
            &mut self.ws_cls,
            &self.pooled,
            &self.dlogits,
            Some(&mut self.dpooled),
        );
        h.drop.backward_in_place(&self.ws_drop, &mut self.dpooled);
        Tanh.backward_in_place(&self.pooled_pre, &mut self.dpooled);
        h.pool.backward(
            &mut self.ws_pool,
            &self.cls,
            &self.dpooled,
            Some(&mut self.dcls),
        );
    }

    fn bytes(&self) -> usize {
        [
            &self.cls,
            &self.pooled_pre,
            &self.pooled,
            &self.logits,
            &self.dlogits,
            &self.dpooled,
            &self.dcls,
        ]
        .iter()
        .map(|v| 4 * v.capacity())
        .sum()
    }
}
