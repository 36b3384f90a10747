//! The masked-language-model head (BERT's `cls.predictions`), run on the selected positions only.
//!
//! With H the encoder's last hidden states (N × D) and s_1 < … < s_S the positions that carry a
//! label (about 15% of N), the head gathers X = H[s] (R × D, R ≥ S a fixed row capacity; rows
//! past S are zero and unlabelled) and computes
//!   T = LN(GELU(X·W_t + b_t)),   Z = T·W_o + b_o   (R × V'),
//!   L = mean over labelled rows of softmax cross-entropy(Z_r, y_r).
//! W_o is a dense D × V matrix, the word-embedding table transposed (`tied`: Eᵀ, no weights of
//! its own), or a TT linear layer D → V' with V' ≥ V (the V' − V padding logits are set to −∞,
//! so they take no probability and get no gradient). Running the projection on R ≈ 0.15·N
//! rows instead of N is what makes a vocabulary-sized output affordable.
//!
//! Backward: ∂L/∂Z from the loss (in place of Z), then through W_o (tied: ∂E += ∂Zᵀ·T,
//! ∂T = ∂Z·E), LN, GELU and W_t, giving ∂L/∂X; the encoder scatters it back to rows s.

use comera_layers::activation::Gelu;
use comera_layers::any::{AnyLinear, AnyLinearWorkspace};
use comera_layers::linear::LinearWorkspace;
use comera_layers::loss::{CrossEntropy, IGNORE_INDEX};
use comera_layers::norm::{LayerNorm, LayerNormWorkspace};
use comera_layers::{accumulate_bias_grad, add_bias, Layer, Linear, Param, ParamKind};
use comera_tensor::{init, matmul, MatMut, MatRef};

/// The output projection.
#[derive(Clone, Debug)]
pub enum MlmDecoder {
    /// A dense or TT layer of its own.
    Own(AnyLinear),
    /// The dense word-embedding table (V × D), transposed; only the bias (V) is the head's.
    Tied { bias: Param },
}

/// Transform + LayerNorm + output projection.
#[derive(Clone, Debug)]
pub struct MlmHead {
    pub transform: Linear,
    pub ln: LayerNorm,
    pub decoder: MlmDecoder,
    /// Vocabulary size V (labels are below it).
    pub vocab: usize,
    ce: CrossEntropy,
}

/// The head's buffers for a fixed row capacity R.
#[derive(Debug)]
pub struct MlmHeadState {
    rows: usize,
    ws_transform: LinearWorkspace,
    ws_ln: LayerNormWorkspace,
    ws_decoder: Option<AnyLinearWorkspace>,
    /// Flat positions (row·T + t) of the labelled tokens, ascending (≤ R of them).
    pub(crate) selected: Vec<u32>,
    /// Per-token labels of the batch (N), `IGNORE_INDEX` where nothing is predicted.
    pub(crate) token_labels: Vec<i32>,
    labels: Vec<i32>,        // R
    x: Vec<f32>,             // R × D (gathered hidden states)
    pre: Vec<f32>,           // R × D (before GELU)
    act: Vec<f32>,           // R × D (after GELU)
    t: Vec<f32>,             // R × D (after LN)
    logits: Vec<f32>,        // R × V' (∂L/∂Z after a training forward)
    scratch: Vec<f64>,       // 2R (row losses for the loss)
    dt: Vec<f32>,            // R × D
    dpre: Vec<f32>,          // R × D
    pub(crate) dx: Vec<f32>, // R × D
}

impl MlmHead {
    /// A fresh head: `decoder` is the output projection, or `None` for one tied to the
    /// word-embedding table (then `vocab` is its row count).
    pub fn new(
        d: usize,
        vocab: usize,
        ln_eps: f32,
        decoder: Option<AnyLinear>,
        rng: &mut init::Rng,
    ) -> MlmHead {
        let transform = Linear::new("mlm.transform", d, d, rng);
        let ln = LayerNorm::with_eps("mlm.ln", d, ln_eps);
        let decoder = match decoder {
            Some(l) => MlmDecoder::Own(l),
            None => MlmDecoder::Tied {
                bias: Param::zeros("mlm.decoder.bias".to_string(), &[vocab], ParamKind::Other),
            },
        };
        let width = match &decoder {
            MlmDecoder::Own(l) => l.out_features(),
            MlmDecoder::Tied { .. } => vocab,
        };
        MlmHead {
            transform,
            ln,
            decoder,
            vocab,
            ce: CrossEntropy::with_ignore_index(width, Some(IGNORE_INDEX)),
        }
    }

    /// Logits per row V' (≥ V).
    pub fn width(&self) -> usize {
        self.ce.classes
    }

    pub fn state(&self, rows: usize, tokens: usize) -> MlmHeadState {
        let d = self.transform.in_features();
        let z = |n: usize| vec![0.0f32; n];
        MlmHeadState {
            rows,
            ws_transform: self.transform.workspace(rows),
            ws_ln: self.ln.workspace(rows),
            ws_decoder: match &self.decoder {
                MlmDecoder::Own(l) => Some(l.workspace(rows)),
                MlmDecoder::Tied { .. } => None,
            },
            selected: Vec::with_capacity(rows),
            token_labels: vec![IGNORE_INDEX; tokens],
            labels: vec![IGNORE_INDEX; rows],
            x: z(rows * d),
            pre: z(rows * d),
            act: z(rows * d),
            t: z(rows * d),
            logits: z(rows * self.width()),
            scratch: vec![0.0; 2 * rows],
            dt: z(rows * d),
            dpre: z(rows * d),
            dx: z(rows * d),
        }
    }

    /// Forward on `hidden` (N × D) at `st.selected`; with `grad`, leaves ∂L/∂Z for
    /// [`MlmHead::backward`]. `table` is the word-embedding table (V × D) of a tied head.
    pub fn forward(
        &self,
        st: &mut MlmHeadState,
        hidden: &[f32],
        table: Option<&Param>,
        grad: bool,
    ) -> comera_layers::loss::CrossEntropyStats {
        let d = self.transform.in_features();
        let (r, w) = (st.rows, self.width());
        // Gather: x[i] = hidden[s_i]; rows past S are zero and unlabelled.
        let used = st.selected.len();
        for (i, &s) in st.selected.iter().enumerate() {
            let s = s as usize;
            st.x[i * d..(i + 1) * d].copy_from_slice(&hidden[s * d..(s + 1) * d]);
            st.labels[i] = st.token_labels[s];
        }
        st.x[used * d..].fill(0.0);
        st.labels[used..].fill(IGNORE_INDEX);
        self.transform
            .forward(&mut st.ws_transform, &st.x, &mut st.pre);
        Gelu.forward(&st.pre, &mut st.act);
        self.ln.forward(&mut st.ws_ln, &st.act, &mut st.t);
        match (&self.decoder, &mut st.ws_decoder) {
            (MlmDecoder::Own(l), Some(ws)) => l.forward(ws, &st.t, &mut st.logits),
            (MlmDecoder::Tied { bias }, None) => {
                let e = &table
                    .expect("a tied MLM head needs the embedding table")
                    .value;
                // Z = T·Eᵀ + b: (R × D)·(D × V).
                matmul(
                    MatMut::new(&mut st.logits, r, w),
                    MatRef::new(&st.t, r, d),
                    MatRef::new(e, w, d).t(),
                    false,
                );
                add_bias(&mut st.logits, &bias.value);
            }
            _ => unreachable!("MLM head state made for another decoder"),
        }
        if w > self.vocab {
            for row in st.logits.chunks_exact_mut(w) {
                row[self.vocab..].fill(f32::NEG_INFINITY);
            }
        }
        self.ce
            .forward_rows(&mut st.logits, &st.labels, &mut st.scratch, grad)
    }

    /// Backward of the last training forward: accumulates the head's gradients (and the tied
    /// table's) and leaves ∂L/∂X in `st.dx`.
    pub fn backward(&mut self, st: &mut MlmHeadState, table: Option<&mut Param>) {
        let d = self.transform.in_features();
        let (r, w) = (st.rows, self.width());
        // ∂Z of the padding logits is exactly 0 (softmax of −∞).
        match (&mut self.decoder, &mut st.ws_decoder) {
            (MlmDecoder::Own(l), Some(ws)) => l.backward(ws, &st.t, &st.logits, Some(&mut st.dt)),
            (MlmDecoder::Tied { bias }, None) => {
                let e = table.expect("a tied MLM head needs the embedding table");
                let dz = MatRef::new(&st.logits, r, w);
                // ∂T = ∂Z·E: (R × V)·(V × D).
                matmul(
                    MatMut::new(&mut st.dt, r, d),
                    dz,
                    MatRef::new(&e.value, w, d),
                    false,
                );
                // ∂E += ∂Zᵀ·T: (V × R)·(R × D).
                matmul(
                    MatMut::new(&mut e.grad, w, d),
                    dz.t(),
                    MatRef::new(&st.t, r, d),
                    true,
                );
                accumulate_bias_grad(&st.logits, &mut bias.grad);
            }
            _ => unreachable!("MLM head state made for another decoder"),
        }
        self.ln
            .backward(&mut st.ws_ln, &st.act, &st.dt, Some(&mut st.dpre));
        Gelu.backward_in_place(&st.pre, &mut st.dpre);
        self.transform
            .backward(&mut st.ws_transform, &st.x, &st.dpre, Some(&mut st.dx));
    }

    pub fn params(&self) -> Vec<&Param> {
        let mut v = self.transform.params();
        v.extend(self.ln.params());
        match &self.decoder {
            MlmDecoder::Own(l) => v.extend(l.params()),
            MlmDecoder::Tied { bias } => v.push(bias),
        }
        v
    }

    pub fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.transform.visit_params_mut(f);
        self.ln.visit_params_mut(f);
        match &mut self.decoder {
            MlmDecoder::Own(l) => l.visit_params_mut(f),
            MlmDecoder::Tied { bias } => f(bias),
        }
    }
}

impl MlmHeadState {
    /// Logits of the labelled rows of the last forward: `rows() × V′` (V′ ≥ the vocabulary;
    /// padding columns of a TT decoder are −∞). Overwritten by ∂L/∂Z in a training forward.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }
    /// Bytes of the head's buffers.
    pub fn bytes(&self) -> usize {
        4 * (self.x.len()
            + self.pre.len()
            + self.act.len()
            + self.t.len()
            + self.logits.len()
            + self.dt.len()
            + self.dpre.len()
            + self.dx.len())
            + 8 * self.scratch.len()
            + self
                .ws_decoder
                .as_ref()
                .map_or(0, AnyLinear::workspace_bytes)
    }

    /// Row capacity R.
    pub fn rows(&self) -> usize {
        self.rows
    }
}
