//! Encoder configuration (serde: the `[model]` table of a run's TOML config).

use comera_tensor::{TtShape, TtmShape};
use serde::{Deserialize, Serialize};

/// A configuration that cannot build a model; names the field and what was expected.
#[derive(Debug, thiserror::Error)]
#[error("{field}: {msg}")]
pub struct ConfigError {
    pub field: String,
    pub msg: String,
}

fn err(field: &str, msg: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        msg: msg.into(),
    }
}

/// Modes and rank of one kind of TT linear layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerTt {
    pub in_modes: Vec<usize>,
    pub out_modes: Vec<usize>,
    pub rank: usize,
}

impl LayerTt {
    fn shape(&self, field: &str, n: usize, m: usize) -> Result<TtShape, ConfigError> {
        let s = TtShape::uniform(&self.in_modes, &self.out_modes, self.rank)
            .map_err(|e| err(field, e.to_string()))?;
        s.check_features(n, m)
            .map_err(|e| err(field, format!("{e} (layer is {n} → {m})")))?;
        Ok(s)
    }
}

/// Modes and rank of the TTM word embedding.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TtmConfig {
    pub vocab_modes: Vec<usize>,
    pub dim_modes: Vec<usize>,
    pub rank: usize,
}

/// What sits on top of the encoder.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HeadKind {
    /// Sequence classification on the [CLS] position (pooler + classifier).
    #[default]
    Classifier,
    /// Masked-language-model head on the selected positions (transform + LN + projection).
    Mlm,
}

/// The MLM head's output projection (hidden → vocabulary logits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MlmDecoderKind {
    /// `tied` with a dense word embedding, `tt` with a TTM one (see [`EncoderConfig::mlm_decoder`]).
    #[default]
    Auto,
    /// A dense D × V matrix of its own.
    Dense,
    /// The (dense) word-embedding table, transposed, plus a bias: no extra weights.
    Tied,
    /// A TT linear layer D → V' (V' = product of `mlm_decoder_tt.out_modes` ≥ V; the padding
    /// logits are masked out of the softmax).
    Tt,
}

/// The encoder's shape. Defaults: the paper's model (SPEC §5).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EncoderConfig {
    /// Vocabulary size (rows of the word embedding).
    pub vocab_size: usize,
    /// Fixed sequence length T (inputs are padded/truncated to it).
    pub seq_len: usize,
    /// Model width D.
    pub d_model: usize,
    pub heads: usize,
    /// Feed-forward width.
    pub ffn: usize,
    pub layers: usize,
    pub num_labels: usize,
    /// Token-type vocabulary (2 for sentence pairs).
    pub type_vocab: usize,
    /// Dropout after embeddings, attention output and FFN output.
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
    pub dropout: f32,
    /// Pre-LN blocks (LN before attention/FFN, final LN) instead of BERT's post-LN.
    pub pre_ln: bool,
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
    pub ln_eps: f32,
    /// Std of the dense weights' and embeddings' initialisation (BERT: 0.02).
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
    pub init_std: f32,
    /// Rank-gate threshold τ.
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
    pub threshold: f32,
    /// Encoder linear layers as TT (true) or dense.
    pub tt_linear: bool,
    /// Word embedding as TTM (true) or dense.
    pub ttm_embedding: bool,
    /// TT layouts of the attention (D → D), FFN up (D → F) and FFN down (F → D) layers.
    pub attn_tt: LayerTt,
    pub ffn_up_tt: LayerTt,
    pub ffn_down_tt: LayerTt,
    pub word_ttm: TtmConfig,
    /// Classifier or masked-LM head.
    pub head: HeadKind,
    /// The MLM head's output projection. `auto` resolves to `tied` with a dense word embedding
    /// and to `tt` with a TTM one: on configs/mlm-rust.toml the TT projection was 1.31× faster
    /// per step than a dense one (`comera bench mlm`) and reached a lower held-out loss after
    /// the same 2M tokens (5.29 vs 5.66), with 7.5M fewer parameters.
    pub mlm_decoder: MlmDecoderKind,
    /// TT layout of the MLM output projection (`in_modes` multiply to D, `out_modes` to at
    /// least the vocabulary size).
    pub mlm_decoder_tt: LayerTt,
    /// Activation checkpointing: keep only each block's output during the forward and rebuild
    /// a block's activations from its input in the backward (one more forward of the blocks
    /// per step, the same gradients bit for bit, about 1/layers of the block activations).
    pub recompute_blocks: bool,
}

impl Default for EncoderConfig {
    fn default() -> Self {
        EncoderConfig {
            vocab_size: 30522,
            seq_len: 128,
            d_model: 768,
            heads: 12,
            ffn: 3072,
            layers: 6,
            num_labels: 3,
            type_vocab: 2,
            dropout: 0.1,
            pre_ln: false,
            ln_eps: 1e-12,
            init_std: 0.02,
            threshold: 0.01,
            tt_linear: true,
            ttm_embedding: true,
            attn_tt: LayerTt {
                in_modes: vec![12, 8, 8],
                out_modes: vec![8, 8, 12],
                rank: 30,
            },
            ffn_up_tt: LayerTt {
                in_modes: vec![12, 8, 8],
                out_modes: vec![16, 16, 12],
                rank: 30,
            },
            ffn_down_tt: LayerTt {
                in_modes: vec![12, 16, 16],
                out_modes: vec![8, 8, 12],
                rank: 30,
            },
            word_ttm: TtmConfig {
                vocab_modes: vec![16, 20, 10, 10],
                dim_modes: vec![4, 4, 8, 6],
                rank: 32,
            },
            head: HeadKind::Classifier,
            mlm_decoder: MlmDecoderKind::Auto,
            mlm_decoder_tt: LayerTt {
                in_modes: vec![12, 8, 8],
                out_modes: vec![20, 40, 40],
                rank: 30,
            },
            recompute_blocks: false,
        }
    }
}

/// The validated layouts a model is built from.
#[derive(Clone, Debug)]
pub struct Layouts {
    pub attn: Option<TtShape>,
    pub ffn_up: Option<TtShape>,
    pub ffn_down: Option<TtShape>,
    pub word: Option<TtmShape>,
    /// The MLM head's TT output projection (when the head is MLM and its decoder is TT).
    pub mlm_decoder: Option<TtShape>,
}

impl EncoderConfig {
    /// The MLM decoder kind with `auto` resolved.
    pub fn mlm_decoder(&self) -> MlmDecoderKind {
        match (self.mlm_decoder, self.ttm_embedding) {
            (MlmDecoderKind::Auto, false) => MlmDecoderKind::Tied,
            (MlmDecoderKind::Auto, true) => MlmDecoderKind::Tt,
            (k, _) => k,
        }
    }

    /// Checks every size and layout; the error names the field (e.g. `model.attn_tt`).
    pub fn validate(&self) -> Result<Layouts, ConfigError> {
        let positive = [
            ("model.vocab_size", self.vocab_size),
            ("model.seq_len", self.seq_len),
            ("model.d_model", self.d_model),
            ("model.heads", self.heads),
            ("model.ffn", self.ffn),
            ("model.layers", self.layers),
            ("model.type_vocab", self.type_vocab),
        ];
        for (f, v) in positive {
            if v == 0 {
                return Err(err(f, "must be at least 1"));
            }
        }
        if self.head == HeadKind::Classifier && self.num_labels < 2 {
            return Err(err(
                "model.num_labels",
                format!(
                    "a classifier needs at least 2 labels, got {}",
                    self.num_labels
                ),
            ));
        }
        if !self.d_model.is_multiple_of(self.heads) {
            return Err(err(
                "model.heads",
                format!(
                    "d_model {} is not divisible by {} heads",
                    self.d_model, self.heads
                ),
            ));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(err(
                "model.dropout",
                format!("must be in [0, 1), got {}", self.dropout),
            ));
        }
        if !(self.ln_eps > 0.0 && self.ln_eps.is_finite()) {
            return Err(err("model.ln_eps", "must be a positive number"));
        }
        // BERT uses 0.02; a standard deviation above 1 only saturates the softmax and GELU
        // (and at 1e30 overflows the first step's sums).
        if !(self.init_std > 0.0 && self.init_std <= 1.0) {
            return Err(err(
                "model.init_std",
                format!("must be in (0, 1] (BERT: 0.02), got {}", self.init_std),
            ));
        }
        // τ ≥ 1 would prune every slice of gates initialised at 1 at the first step.
        if !(self.threshold > 0.0 && self.threshold < 1.0) {
            return Err(err(
                "model.threshold",
                format!(
                    "must be in (0, 1) (gates start at 1; τ ≥ 1 prunes every rank slice at once), got {}",
                    self.threshold
                ),
            ));
        }
        let (d, f) = (self.d_model, self.ffn);
        let tt = self.tt_linear;
        let mlm_decoder = match (self.head, self.mlm_decoder()) {
            (HeadKind::Mlm, MlmDecoderKind::Tt) => {
                let t = &self.mlm_decoder_tt;
                let s = TtShape::uniform(&t.in_modes, &t.out_modes, t.rank)
                    .map_err(|e| err("model.mlm_decoder_tt", e.to_string()))?;
                if s.in_features() != d || s.out_features() < self.vocab_size {
                    return Err(err(
                        "model.mlm_decoder_tt",
                        format!(
                            "in_modes {:?} multiply to {} (expected d_model = {d}) and out_modes {:?} to {} (expected at least vocab_size = {})",
                            t.in_modes,
                            s.in_features(),
                            t.out_modes,
                            s.out_features(),
                            self.vocab_size
                        ),
                    ));
                }
                Some(s)
            }
            (HeadKind::Mlm, MlmDecoderKind::Tied) if self.ttm_embedding => return Err(err(
                "model.mlm_decoder",
                "`tied` needs a dense word embedding (ttm_embedding = false); use `tt` or `dense`",
            )),
            _ => None,
        };
        Ok(Layouts {
            mlm_decoder,
            attn: if tt {
                Some(self.attn_tt.shape("model.attn_tt", d, d)?)
            } else {
                None
            },
            ffn_up: if tt {
                Some(self.ffn_up_tt.shape("model.ffn_up_tt", d, f)?)
            } else {
                None
            },
            ffn_down: if tt {
                Some(self.ffn_down_tt.shape("model.ffn_down_tt", f, d)?)
            } else {
                None
            },
            word: if self.ttm_embedding {
                let t = &self.word_ttm;
                let s = TtmShape::uniform(&t.vocab_modes, &t.dim_modes, t.rank, self.vocab_size)
                    .map_err(|e| err("model.word_ttm", e.to_string()))?;
                if s.dim() != d {
                    return Err(err(
                        "model.word_ttm.dim_modes",
                        format!(
                            "{:?} multiply to {}, expected d_model = {d}",
                            t.dim_modes,
                            s.dim()
                        ),
                    ));
                }
                Some(s)
            } else {
                None
            },
        })
    }
}
