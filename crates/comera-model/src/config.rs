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

/// The largest LayerNorm ε accepted: well below the unit variance of normalised activations.
pub const MAX_LN_EPS: f32 = 1e-2;

fn err(field: &str, msg: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        msg: msg.into(),
    }
}

/// The rank of a TT/TTM layer: one number for every bond between cores, or a list with one
/// rank per bond (K − 1 entries for K cores: TT linear layers have one core per input and per
/// output mode, TTM tables one per mode pair).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rank {
    Uniform(usize),
    PerBond(Vec<usize>),
}

impl From<usize> for Rank {
    fn from(r: usize) -> Rank {
        Rank::Uniform(r)
    }
}

impl std::fmt::Display for Rank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rank::Uniform(r) => write!(f, "{r}"),
            Rank::PerBond(v) => write!(f, "{v:?}"),
        }
    }
}

impl Serialize for Rank {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Rank::Uniform(r) => s.serialize_u64(*r as u64),
            Rank::PerBond(v) => v.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Rank {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Rank, D::Error> {
        use serde::de::{Error, SeqAccess, Unexpected, Visitor};
        struct RankVisitor;
        impl<'de> Visitor<'de> for RankVisitor {
            type Value = Rank;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(
                    "a rank (a positive integer such as 16) or one rank per bond between cores (such as [8, 4, 2, 4, 8])",
                )
            }
            fn visit_u64<E: Error>(self, v: u64) -> Result<Rank, E> {
                usize::try_from(v)
                    .map(Rank::Uniform)
                    .map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &self))
            }
            fn visit_i64<E: Error>(self, v: i64) -> Result<Rank, E> {
                match u64::try_from(v) {
                    Ok(u) => self.visit_u64(u),
                    Err(_) => Err(E::invalid_value(Unexpected::Signed(v), &self)),
                }
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Rank, A::Error> {
                let mut ranks = Vec::new();
                while let Some(r) = seq.next_element::<usize>()? {
                    ranks.push(r);
                }
                Ok(Rank::PerBond(ranks))
            }
        }
        d.deserialize_any(RankVisitor)
    }
}

/// The largest rank each bond of a tensor train with cores of `sizes` (each core's mode
/// product) can use: bond k (between cores k and k+1) joins a (Π_{j≤k} s_j) × (Π_{j>k} s_j)
/// unfolding, whose rank is at most the smaller side. Computed in f64 (sizes can be huge).
pub fn bond_limits(sizes: &[usize]) -> Vec<usize> {
    let total: f64 = sizes.iter().map(|&s| s as f64).product();
    let mut left = 1.0f64;
    sizes[..sizes.len().saturating_sub(1)]
        .iter()
        .map(|&s| {
            left *= s as f64;
            left.min(total / left).min(usize::MAX as f64) as usize
        })
        .collect()
}

/// The largest rank any bond of a tensor train with cores of `sizes` can use (the maximum of
/// [`bond_limits`]; 1 for a single core): a uniform rank above it is waste at every bond.
pub fn useful_rank(sizes: &[usize]) -> usize {
    bond_limits(sizes).into_iter().max().unwrap_or(1).max(1)
}

impl Rank {
    /// The full rank list `[1, r_1, …, r_{K−1}, 1]` for cores of `sizes`, capping what the
    /// shape cannot use (with a warning in `warnings`):
    /// - a list is capped bond by bond at [`bond_limits`];
    /// - one number is capped at [`useful_rank`] only, so that a uniform rank keeps the
    ///   authors' layout (the paper's rank 30 on a bond of a 12-wide end core is kept: those
    ///   slices are redundant, and the rank schedule can prune them).
    pub fn resolve(
        &self,
        field: &str,
        sizes: &[usize],
        warnings: &mut Vec<String>,
    ) -> Result<Vec<usize>, ConfigError> {
        let limits = bond_limits(sizes);
        let inner: Vec<usize> = match self {
            Rank::Uniform(0) => return Err(err(field, "must be at least 1")),
            Rank::Uniform(r) => {
                let max = useful_rank(sizes);
                if *r > max {
                    warnings.push(format!(
                        "{field} = {r} exceeds the largest useful rank {max} for cores of sizes {sizes:?}: capped to {max} (ranks above it add parameters, not expressiveness)"
                    ));
                }
                vec![(*r).min(max); limits.len()]
            }
            Rank::PerBond(v) => {
                if v.len() != limits.len() {
                    return Err(err(
                        field,
                        format!(
                            "{} ranks given, but {} cores of sizes {sizes:?} have {} bonds: give one rank per bond, or one number",
                            v.len(),
                            sizes.len(),
                            limits.len()
                        ),
                    ));
                }
                if let Some(b) = v.iter().position(|&r| r == 0) {
                    return Err(err(
                        field,
                        format!(
                            "bond {} has rank 0 in {v:?}; every rank must be at least 1",
                            b + 1
                        ),
                    ));
                }
                let capped: Vec<usize> = v.iter().zip(&limits).map(|(&r, &l)| r.min(l)).collect();
                if capped != *v {
                    warnings.push(format!(
                        "{field} = {v:?} exceeds what cores of sizes {sizes:?} can use at some bonds (at most {limits:?}): capped to {capped:?}"
                    ));
                }
                capped
            }
        };
        let mut ranks = Vec::with_capacity(inner.len() + 2);
        ranks.push(1);
        ranks.extend(inner);
        ranks.push(1);
        Ok(ranks)
    }
}

/// Modes and rank of one kind of TT linear layer, and whether that kind is TT at all.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerTt {
    pub in_modes: Vec<usize>,
    pub out_modes: Vec<usize>,
    pub rank: Rank,
    /// This kind as TT (true) or dense (false). Absent: the attention and FFN kinds follow
    /// `model.tt_linear`; a pooler or classifier whose table is given is TT.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tt: Option<bool>,
}

impl LayerTt {
    /// A TT layout with one rank on every bond (`tt` left to the model's default).
    pub fn uniform(in_modes: &[usize], out_modes: &[usize], rank: usize) -> LayerTt {
        LayerTt {
            in_modes: in_modes.to_vec(),
            out_modes: out_modes.to_vec(),
            rank: Rank::Uniform(rank),
            tt: None,
        }
    }

    /// The validated layout of an `n → m` layer, ranks capped to what the modes support.
    fn shape(
        &self,
        field: &str,
        n: usize,
        m: usize,
        warnings: &mut Vec<String>,
    ) -> Result<TtShape, ConfigError> {
        let probe = TtShape::uniform(&self.in_modes, &self.out_modes, 1)
            .map_err(|e| err(field, e.to_string()))?;
        probe
            .check_features(n, m)
            .map_err(|e| err(field, format!("{e} (layer is {n} → {m})")))?;
        let sizes: Vec<usize> = self
            .in_modes
            .iter()
            .chain(&self.out_modes)
            .copied()
            .collect();
        let ranks = self
            .rank
            .resolve(&format!("{field}.rank"), &sizes, warnings)?;
        TtShape::new(&self.in_modes, &self.out_modes, &ranks).map_err(|e| err(field, e.to_string()))
    }
}

/// Modes and rank of the TTM word embedding.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TtmConfig {
    pub vocab_modes: Vec<usize>,
    pub dim_modes: Vec<usize>,
    pub rank: Rank,
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
    /// The attention and FFN layers as TT (true) or dense: the default of each kind, which
    /// its own table's `tt` overrides (e.g. TT attention with a dense FFN).
    pub tt_linear: bool,
    /// Word embedding as TTM (true) or dense.
    pub ttm_embedding: bool,
    /// TT layouts of the attention (D → D), FFN up (D → F) and FFN down (F → D) layers.
    pub attn_tt: LayerTt,
    pub ffn_up_tt: LayerTt,
    pub ffn_down_tt: LayerTt,
    pub word_ttm: TtmConfig,
    /// The classifier head's pooler (D → D) and classifier (D → labels) as TT layers; absent:
    /// dense, as in the paper.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pooler_tt: Option<LayerTt>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub classifier_tt: Option<LayerTt>,
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
            attn_tt: LayerTt::uniform(&[12, 8, 8], &[8, 8, 12], 30),
            ffn_up_tt: LayerTt::uniform(&[12, 8, 8], &[16, 16, 12], 30),
            ffn_down_tt: LayerTt::uniform(&[12, 16, 16], &[8, 8, 12], 30),
            word_ttm: TtmConfig {
                vocab_modes: vec![16, 20, 10, 10],
                dim_modes: vec![4, 4, 8, 6],
                rank: Rank::Uniform(32),
            },
            pooler_tt: None,
            classifier_tt: None,
            head: HeadKind::Classifier,
            mlm_decoder: MlmDecoderKind::Auto,
            mlm_decoder_tt: LayerTt::uniform(&[12, 8, 8], &[20, 40, 40], 30),
            recompute_blocks: false,
        }
    }
}

/// The validated layouts a model is built from: a TT/TTM shape per layer kind, `None` for a
/// dense one.
#[derive(Clone, Debug)]
pub struct Layouts {
    pub attn: Option<TtShape>,
    pub ffn_up: Option<TtShape>,
    pub ffn_down: Option<TtShape>,
    pub word: Option<TtmShape>,
    /// The classifier head's pooler and classifier (classifier head only).
    pub pooler: Option<TtShape>,
    pub classifier: Option<TtShape>,
    /// The MLM head's TT output projection (when the head is MLM and its decoder is TT).
    pub mlm_decoder: Option<TtShape>,
    /// Ranks capped to what their shapes support, one message each.
    pub warnings: Vec<String>,
    /// The head the layouts are for (which head layers exist).
    pub head: HeadKind,
}

impl Layouts {
    /// `TT attention, FFN up, FFN down; TTM word embedding; dense pooler, classifier`.
    pub fn describe(&self) -> String {
        let mut kinds = vec![
            ("attention", self.attn.is_some()),
            ("FFN up", self.ffn_up.is_some()),
            ("FFN down", self.ffn_down.is_some()),
        ];
        match self.head {
            HeadKind::Classifier => kinds.extend([
                ("pooler", self.pooler.is_some()),
                ("classifier", self.classifier.is_some()),
            ]),
            HeadKind::Mlm => kinds.push(("MLM projection", self.mlm_decoder.is_some())),
        }
        let list = |tt: bool| -> String {
            kinds
                .iter()
                .filter(|(_, t)| *t == tt)
                .map(|(k, _)| *k)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (tt, dense) = (list(true), list(false));
        let mut parts = Vec::new();
        if !tt.is_empty() {
            parts.push(format!("TT {tt}"));
        }
        parts.push(format!(
            "{} word embedding",
            if self.word.is_some() { "TTM" } else { "dense" }
        ));
        if !dense.is_empty() {
            parts.push(format!("dense {dense}"));
        }
        parts.join("; ")
    }
}

impl EncoderConfig {
    /// Whether a TT-capable layer kind is TT: its table's `tt`, else `model.tt_linear`.
    pub fn is_tt(&self, kind: &LayerTt) -> bool {
        kind.tt.unwrap_or(self.tt_linear)
    }

    /// Every layer dense: no TT kind, no TTM table, a dense MLM projection where it was TT
    /// (the `--dense` twin of a run and the config of a densified export).
    pub fn make_dense(&mut self) {
        self.tt_linear = false;
        self.ttm_embedding = false;
        for kind in [
            &mut self.attn_tt,
            &mut self.ffn_up_tt,
            &mut self.ffn_down_tt,
        ] {
            kind.tt = None;
        }
        self.pooler_tt = None;
        self.classifier_tt = None;
        if self.mlm_decoder == MlmDecoderKind::Tt {
            self.mlm_decoder = MlmDecoderKind::Dense;
        }
    }

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
        self.check_scalars()?;
        let (d, f) = (self.d_model, self.ffn);
        let mut warnings = Vec::new();
        let w = &mut warnings;
        let attn = self.linear_layout("model.attn_tt", &self.attn_tt, d, d, w)?;
        let ffn_up = self.linear_layout("model.ffn_up_tt", &self.ffn_up_tt, d, f, w)?;
        let ffn_down = self.linear_layout("model.ffn_down_tt", &self.ffn_down_tt, f, d, w)?;
        let pooler = self.head_layout("model.pooler_tt", &self.pooler_tt, d, w)?;
        let labels = self.num_labels;
        let classifier = self.head_layout("model.classifier_tt", &self.classifier_tt, labels, w)?;
        let mlm_decoder = self.mlm_decoder_layout(w)?;
        let word = self.word_layout(w)?;
        Ok(Layouts {
            attn,
            ffn_up,
            ffn_down,
            word,
            pooler,
            classifier,
            mlm_decoder,
            warnings,
            head: self.head,
        })
    }

    /// The sizes and scalars: positive sizes, heads dividing d_model, rates in range.
    fn check_scalars(&self) -> Result<(), ConfigError> {
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
        // ε is added to a variance (about 1 for normalised activations): BERT uses 1e-12,
        // others 1e-5; one near the variance no longer normalises (1e30 zeroes every output).
        if !(self.ln_eps > 0.0 && self.ln_eps <= MAX_LN_EPS) {
            return Err(err(
                "model.ln_eps",
                format!(
                    "must be in (0, {MAX_LN_EPS}] (BERT: 1e-12), got {}",
                    self.ln_eps
                ),
            ));
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
        Ok(())
    }

    /// A body layer kind n → m: its TT shape, or `None` for dense.
    fn linear_layout(
        &self,
        field: &str,
        kind: &LayerTt,
        n: usize,
        m: usize,
        warnings: &mut Vec<String>,
    ) -> Result<Option<TtShape>, ConfigError> {
        self.is_tt(kind)
            .then(|| kind.shape(field, n, m, warnings))
            .transpose()
    }

    /// A classifier-head layer d_model → m: TT where configured (and not `tt = false`).
    fn head_layout(
        &self,
        field: &str,
        kind: &Option<LayerTt>,
        m: usize,
        warnings: &mut Vec<String>,
    ) -> Result<Option<TtShape>, ConfigError> {
        match kind {
            Some(k) if self.head == HeadKind::Classifier && k.tt != Some(false) => {
                k.shape(field, self.d_model, m, warnings).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The MLM output projection's TT shape (D → V' ≥ V), if the head is MLM with a TT one.
    fn mlm_decoder_layout(
        &self,
        warnings: &mut Vec<String>,
    ) -> Result<Option<TtShape>, ConfigError> {
        let d = self.d_model;
        if self.mlm_decoder_tt.tt.is_some() {
            return Err(err(
                "model.mlm_decoder_tt.tt",
                "the MLM projection's kind is model.mlm_decoder (\"tt\", \"dense\", \"tied\" or \"auto\")",
            ));
        }
        let mlm_decoder = match (self.head, self.mlm_decoder()) {
            (HeadKind::Mlm, MlmDecoderKind::Tt) => {
                let t = &self.mlm_decoder_tt;
                let field = "model.mlm_decoder_tt";
                let probe = TtShape::uniform(&t.in_modes, &t.out_modes, 1)
                    .map_err(|e| err(field, e.to_string()))?;
                if probe.in_features() != d || probe.out_features() < self.vocab_size {
                    return Err(err(
                        field,
                        format!(
                            "in_modes {:?} multiply to {} (expected d_model = {d}) and out_modes {:?} to {} (expected at least vocab_size = {})",
                            t.in_modes,
                            probe.in_features(),
                            t.out_modes,
                            probe.out_features(),
                            self.vocab_size
                        ),
                    ));
                }
                Some(t.shape(field, d, probe.out_features(), warnings)?)
            }
            (HeadKind::Mlm, MlmDecoderKind::Tied) if self.ttm_embedding => return Err(err(
                "model.mlm_decoder",
                "`tied` needs a dense word embedding (ttm_embedding = false); use `tt` or `dense`",
            )),
            _ => None,
        };
        Ok(mlm_decoder)
    }

    /// The word embedding's TTM shape, if it is TTM.
    fn word_layout(&self, warnings: &mut Vec<String>) -> Result<Option<TtmShape>, ConfigError> {
        let d = self.d_model;
        let word = if self.ttm_embedding {
            let t = &self.word_ttm;
            let probe = TtmShape::uniform(&t.vocab_modes, &t.dim_modes, 1, self.vocab_size)
                .map_err(|e| err("model.word_ttm", e.to_string()))?;
            if probe.dim() != d {
                return Err(err(
                    "model.word_ttm.dim_modes",
                    format!(
                        "{:?} multiply to {}, expected d_model = {d}",
                        t.dim_modes,
                        probe.dim()
                    ),
                ));
            }
            let ranks = t
                .rank
                .resolve("model.word_ttm.rank", &probe.size_modes(), warnings)?;
            Some(
                TtmShape::new(&t.vocab_modes, &t.dim_modes, &ranks, self.vocab_size)
                    .map_err(|e| err("model.word_ttm", e.to_string()))?,
            )
        } else {
            None
        };
        Ok(word)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_norm_epsilon_beyond_the_variance_is_refused() {
        for bad in [0.0, -1e-5, 1e30, f32::INFINITY, f32::NAN, 0.5] {
            let cfg = EncoderConfig {
                ln_eps: bad,
                ..EncoderConfig::default()
            };
            let e = cfg.validate().unwrap_err();
            assert_eq!(e.field, "model.ln_eps", "{bad}: {e}");
        }
        for good in [1e-12, 1e-5, MAX_LN_EPS] {
            let cfg = EncoderConfig {
                ln_eps: good,
                ..EncoderConfig::default()
            };
            cfg.validate().unwrap();
        }
    }
}
