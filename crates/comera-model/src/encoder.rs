//! The BERT-style encoder classifier of the paper (SPEC §5), dense or TT/TTM.
//!
//! Embeddings: x0 = Dropout(LN(word[ids] + pos[t] + type[types])).
//! Post-LN block (BERT; pre-LN as an option, see below):
//!   q, k, v = Q(x), K(x), V(x);  att = MHA(q, k, v; padding mask);  a = Dropout(O(att))
//!   r1 = x + a;  x1 = LN1(r1);  f = Dropout(Down(GELU(Up(x1))));  r2 = x1 + f;  out = LN2(r2)
//! Pre-LN block: l1 = LN1(x); … from l1 …; r1 = x + a; l2 = LN2(r1); f = …(l2); out = r1 + f,
//! and a final LN after the last block.
//! Heads ([`Head`]): the classifier on the [CLS] (first) position,
//! logits = C(Dropout(tanh(P(h_cls)))) with softmax cross-entropy over the labels; or the
//! masked-LM head of [`crate::mlm_head`] on the labelled positions.
//!
//! [`EncoderState`] holds every activation, gradient scratch and layer workspace for one fixed
//! (batch, seq_len), allocated once; a steady-state training step allocates nothing.

use crate::config::{ConfigError, EncoderConfig, HeadKind, LayerTt, Layouts, MlmDecoderKind};
use crate::mlm_head::{MlmDecoder, MlmHead, MlmHeadState};
use comera_layers::activation::{Gelu, Tanh};
use comera_layers::any::{AnyEmbedding, AnyEmbeddingWorkspace, AnyLinear, AnyLinearWorkspace};
use comera_layers::attention::{allowed_keys, Attention, AttentionWorkspace};
use comera_layers::dropout::{Dropout, DropoutWorkspace};
use comera_layers::elementwise::{add_into, mul_into, sum_into};
use comera_layers::embedding::EmbeddingWorkspace;
use comera_layers::loss::CrossEntropy;
use comera_layers::norm::{LayerNorm, LayerNormWorkspace};
use comera_layers::tt_linear::{FusedFfn, SharedInput};
use comera_layers::{
    Compressible, Embedding, EmbeddingError, EmbeddingLayer, Layer, Linear, Param, RankGates,
    StepStats, TtLinear, TtmEmbedding,
};
use comera_tensor::{init, TtShape};

/// Whether two configs build a layer kind alike: both dense, or both TT of the same modes
/// (ranks may differ: the pre-trained ones are taken).
fn same_kind(a: &EncoderConfig, ka: &LayerTt, b: &EncoderConfig, kb: &LayerTt) -> bool {
    match (a.is_tt(ka), b.is_tt(kb)) {
        (false, false) => true,
        (true, true) => (&ka.in_modes, &ka.out_modes) == (&kb.in_modes, &kb.out_modes),
        _ => false,
    }
}

/// One encoder block's layers.
#[derive(Clone, Debug)]
pub struct Block {
    pub q: AnyLinear,
    pub k: AnyLinear,
    pub v: AnyLinear,
    pub o: AnyLinear,
    pub up: AnyLinear,
    pub down: AnyLinear,
    pub ln1: LayerNorm,
    pub ln2: LayerNorm,
}

impl Block {
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        for l in [
            &mut self.q,
            &mut self.k,
            &mut self.v,
            &mut self.o,
            &mut self.up,
            &mut self.down,
        ] {
            l.visit_params_mut(f);
        }
        self.ln1.visit_params_mut(f);
        self.ln2.visit_params_mut(f);
    }

    fn params(&self) -> Vec<&Param> {
        let mut v = Vec::new();
        for l in [&self.q, &self.k, &self.v, &self.o, &self.up, &self.down] {
            v.extend(l.params());
        }
        v.extend(self.ln1.params());
        v.extend(self.ln2.params());
        v
    }

    fn linears(&self) -> [&AnyLinear; 6] {
        [&self.q, &self.k, &self.v, &self.o, &self.up, &self.down]
    }
}

/// The encoder classifier.
#[derive(Clone, Debug)]
pub struct Encoder {
    pub cfg: EncoderConfig,
    pub word: AnyEmbedding,
    pub pos: Embedding,
    pub types: Embedding,
    pub ln_emb: LayerNorm,
    pub blocks: Vec<Block>,
    /// Pre-LN only: the LN after the last block.
    pub ln_final: Option<LayerNorm>,
    pub head: Head,
    attn: Attention,
    drop_emb: Dropout,
    drop_attn: Vec<Dropout>,
    drop_ffn: Vec<Dropout>,
}

/// What sits on the encoder's last hidden states.
#[derive(Clone, Debug)]
// One per model: the variants' size difference costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
pub enum Head {
    Classifier(ClassifierHead),
    Mlm(MlmHead),
}

/// Pooler + classifier on the [CLS] position (each dense or TT).
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
        Ok(ClassifierHead {
            pool: any_linear("pooler", &layouts.pooler, d, d, rule, rng)?,
            classifier: any_linear(
                "classifier",
                &layouts.classifier,
                d,
                cfg.num_labels,
                rule,
                rng,
            )?,
            drop: Dropout::new(cfg.dropout, dseed.wrapping_add(1 << 32)),
            ce: CrossEntropy::with_ignore_index(cfg.num_labels, None),
        })
    }
}

/// A linear layer `name` (n → m): TT of `shape`, or dense when there is none.
fn any_linear(
    name: &str,
    shape: &Option<TtShape>,
    n: usize,
    m: usize,
    rule: RankGates,
    rng: &mut init::Rng,
) -> Result<AnyLinear, ConfigError> {
    Ok(match shape {
        Some(s) => {
            AnyLinear::Tt(
                TtLinear::new(name, s.clone(), rule, rng).map_err(|e| ConfigError {
                    field: name.to_string(),
                    msg: e.to_string(),
                })?,
            )
        }
        None => AnyLinear::Dense(Linear::new(name, n, m, rng)),
    })
}

impl Head {
    fn params(&self) -> Vec<&Param> {
        match self {
            Head::Classifier(h) => {
                let mut v = h.pool.params();
                v.extend(h.classifier.params());
                v
            }
            Head::Mlm(h) => h.params(),
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        match self {
            Head::Classifier(h) => {
                h.pool.visit_params_mut(f);
                h.classifier.visit_params_mut(f);
            }
            Head::Mlm(h) => h.visit_params_mut(f),
        }
    }

    /// The head's linear layers: pooler and classifier, or the MLM head's own projection.
    fn linears(&self) -> Vec<&AnyLinear> {
        match self {
            Head::Classifier(h) => vec![&h.pool, &h.classifier],
            Head::Mlm(h) => match &h.decoder {
                MlmDecoder::Own(l) => vec![l],
                _ => Vec::new(),
            },
        }
    }

    /// [`Head::linears`] mutably, same order, without allocating.
    fn visit_linears_mut(&mut self, f: &mut dyn FnMut(&mut AnyLinear)) {
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
}

impl Encoder {
    /// A freshly initialised model (seeded; dropout masks also derive from `seed`).
    pub fn new(cfg: &EncoderConfig, seed: u64) -> Result<Encoder, ConfigError> {
        let layouts = cfg.validate()?;
        let mut rng = init::rng(seed);
        let rule = RankGates::new(cfg.threshold);
        let (d, f) = (cfg.d_model, cfg.ffn);
        let word = match &layouts.word {
            Some(s) => AnyEmbedding::Ttm(
                TtmEmbedding::new("embeddings.word", s.clone(), rule, cfg.init_std, &mut rng)
                    .map_err(|e| ConfigError {
                        field: "model.word_ttm".into(),
                        msg: e.to_string(),
                    })?,
            ),
            None => AnyEmbedding::Dense(Embedding::new(
                "embeddings.word",
                cfg.vocab_size,
                d,
                cfg.init_std,
                &mut rng,
            )),
        };
        let pos = Embedding::new(
            "embeddings.position",
            cfg.seq_len,
            d,
            cfg.init_std,
            &mut rng,
        );
        let types = Embedding::new(
            "embeddings.token_type",
            cfg.type_vocab,
            d,
            cfg.init_std,
            &mut rng,
        );
        let ln_emb = LayerNorm::with_eps("embeddings.ln", d, cfg.ln_eps);
        let mut linear = |name: String, shape: &Option<TtShape>, n: usize, m: usize| {
            any_linear(&name, shape, n, m, rule, &mut rng)
        };
        let mut blocks = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = format!("encoder.{l}");
            blocks.push(Block {
                q: linear(format!("{p}.attn.q"), &layouts.attn, d, d)?,
                k: linear(format!("{p}.attn.k"), &layouts.attn, d, d)?,
                v: linear(format!("{p}.attn.v"), &layouts.attn, d, d)?,
                o: linear(format!("{p}.attn.o"), &layouts.attn, d, d)?,
                up: linear(format!("{p}.ffn.up"), &layouts.ffn_up, d, f)?,
                down: linear(format!("{p}.ffn.down"), &layouts.ffn_down, f, d)?,
                ln1: LayerNorm::with_eps(&format!("{p}.ln1"), d, cfg.ln_eps),
                ln2: LayerNorm::with_eps(&format!("{p}.ln2"), d, cfg.ln_eps),
            });
        }
        let ln_final = cfg
            .pre_ln
            .then(|| LayerNorm::with_eps("encoder.ln_final", d, cfg.ln_eps));
        let dseed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let head = match cfg.head {
            HeadKind::Classifier => {
                Head::Classifier(ClassifierHead::new(cfg, &layouts, dseed, &mut rng)?)
            }
            HeadKind::Mlm => {
                let decoder = match cfg.mlm_decoder() {
                    MlmDecoderKind::Tied => None,
                    // A TT projection's width is its out_modes' product (≥ the vocabulary).
                    _ => Some(any_linear(
                        "mlm.decoder",
                        &layouts.mlm_decoder,
                        d,
                        cfg.vocab_size,
                        rule,
                        &mut rng,
                    )?),
                };
                Head::Mlm(MlmHead::new(
                    d,
                    cfg.vocab_size,
                    cfg.ln_eps,
                    decoder,
                    &mut rng,
                ))
            }
        };
        Ok(Encoder {
            cfg: cfg.clone(),
            word,
            pos,
            types,
            ln_emb,
            blocks,
            ln_final,
            head,
            attn: Attention::new(d, cfg.heads),
            drop_emb: Dropout::new(cfg.dropout, dseed),
            drop_attn: (0..cfg.layers)
                .map(|l| Dropout::new(cfg.dropout, dseed + 1 + 2 * l as u64))
                .collect(),
            drop_ffn: (0..cfg.layers)
                .map(|l| Dropout::new(cfg.dropout, dseed + 2 + 2 * l as u64))
                .collect(),
        })
    }

    /// Calls `f` on every parameter in a fixed order, without allocating.
    pub fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.visit_body_params_mut(f);
        self.head.visit_params_mut(f);
    }

    /// The parameters of the embeddings and blocks (not the head), in the same order.
    fn visit_body_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.word.visit_params_mut(f);
        self.pos.visit_params_mut(f);
        self.types.visit_params_mut(f);
        self.ln_emb.visit_params_mut(f);
        for b in &mut self.blocks {
            b.visit_params_mut(f);
        }
        if let Some(ln) = &mut self.ln_final {
            ln.visit_params_mut(f);
        }
    }

    /// Starts from a pre-trained encoder (the pre-train → fine-tune flow): takes `other`'s
    /// embeddings and blocks — with its (possibly truncated) TT/TTM ranks — and keeps this
    /// model's own head. The two must have the same body shape; this model's sequence length
    /// may be shorter (the first rows of the position table are taken).
    pub fn init_body_from(&mut self, other: &Encoder) -> Result<(), ConfigError> {
        let (a, b) = (&self.cfg, &other.cfg);
        let same = [
            ("vocab_size", a.vocab_size == b.vocab_size),
            ("d_model", a.d_model == b.d_model),
            ("heads", a.heads == b.heads),
            ("ffn", a.ffn == b.ffn),
            ("layers", a.layers == b.layers),
            ("type_vocab", a.type_vocab == b.type_vocab),
            ("pre_ln", a.pre_ln == b.pre_ln),
            ("ttm_embedding", a.ttm_embedding == b.ttm_embedding),
            ("attn_tt", same_kind(a, &a.attn_tt, b, &b.attn_tt)),
            ("ffn_up_tt", same_kind(a, &a.ffn_up_tt, b, &b.ffn_up_tt)),
            (
                "ffn_down_tt",
                same_kind(a, &a.ffn_down_tt, b, &b.ffn_down_tt),
            ),
            (
                "word_ttm",
                !a.ttm_embedding
                    || (&a.word_ttm.vocab_modes, &a.word_ttm.dim_modes)
                        == (&b.word_ttm.vocab_modes, &b.word_ttm.dim_modes),
            ),
            ("seq_len", a.seq_len <= b.seq_len),
        ];
        if let Some((field, _)) = same.iter().find(|(_, ok)| !ok) {
            return Err(ConfigError {
                field: format!("model.{field}"),
                msg: format!(
                    "differs from the pre-trained encoder's (seq_len may only be shorter): {}",
                    match *field {
                        "seq_len" => format!("{} vs {}", a.seq_len, b.seq_len),
                        _ => "see its config".into(),
                    }
                ),
            });
        }
        // The pre-trained ranks first, so that every tensor has its shape.
        let mut ranks = std::collections::HashMap::new();
        other.visit_compressible(&mut |l| {
            ranks.insert(l.layer_name().to_string(), l.ranks());
        });
        let mut err: Option<ConfigError> = None;
        self.visit_compressible_mut(&mut |l| {
            if let Some(r) = ranks.get(l.layer_name()) {
                if *r != l.ranks() {
                    if let Err(e) = l.set_ranks(r) {
                        err.get_or_insert(ConfigError {
                            field: l.layer_name().to_string(),
                            msg: e.to_string(),
                        });
                    }
                }
            }
        });
        // Their body parameters: all but the head's.
        let head: Vec<&str> = other
            .head
            .params()
            .iter()
            .map(|p| p.name.as_str())
            .collect();
        let theirs: std::collections::HashMap<&str, &Param> = other
            .params()
            .into_iter()
            .filter(|p| !head.contains(&p.name.as_str()))
            .map(|p| (p.name.as_str(), p))
            .collect();
        self.visit_body_params_mut(&mut |p| {
            if err.is_some() {
                return;
            }
            match theirs.get(p.name.as_str()) {
                Some(q) if q.shape == p.shape => p.value.copy_from_slice(&q.value),
                // The position table of a shorter sequence: its first rows.
                Some(q) if p.name == "embeddings.position.weight" && q.shape[1] == p.shape[1] => {
                    let len = p.value.len();
                    p.value.copy_from_slice(&q.value[..len]);
                }
                Some(q) => {
                    err = Some(ConfigError {
                        field: p.name.clone(),
                        msg: format!(
                            "pre-trained shape {:?}, this model's {:?}",
                            q.shape, p.shape
                        ),
                    })
                }
                None => {
                    err = Some(ConfigError {
                        field: p.name.clone(),
                        msg: "missing from the pre-trained encoder".into(),
                    })
                }
            }
        });
        err.map_or(Ok(()), Err)
    }

    /// Calls `f` on every TT/TTM layer: the word embedding (if TTM), then each block's
    /// q, k, v, o, up, down (if TT), then the head's pooler, classifier or MLM output
    /// projection (if TT).
    pub fn visit_compressible(&self, f: &mut dyn FnMut(&dyn Compressible)) {
        if let AnyEmbedding::Ttm(t) = &self.word {
            f(t);
        }
        let blocks = self.blocks.iter().flat_map(|b| b.linears());
        for l in blocks.chain(self.head.linears()) {
            if let AnyLinear::Tt(t) = l {
                f(t);
            }
        }
    }

    /// [`Encoder::visit_compressible`] with mutable layers, same order, without allocating.
    pub fn visit_compressible_mut(&mut self, f: &mut dyn FnMut(&mut dyn Compressible)) {
        if let AnyEmbedding::Ttm(t) = &mut self.word {
            f(t);
        }
        for b in &mut self.blocks {
            for l in [
                &mut b.q,
                &mut b.k,
                &mut b.v,
                &mut b.o,
                &mut b.up,
                &mut b.down,
            ] {
                if let AnyLinear::Tt(t) = l {
                    f(t);
                }
            }
        }
        self.head.visit_linears_mut(&mut |l| {
            if let AnyLinear::Tt(t) = l {
                f(t);
            }
        });
    }

    /// Every parameter, in the order of [`Encoder::visit_params_mut`].
    pub fn params(&self) -> Vec<&Param> {
        let mut v = self.word.params();
        v.extend(self.pos.params());
        v.extend(self.types.params());
        v.extend(self.ln_emb.params());
        for b in &self.blocks {
            v.extend(b.params());
        }
        if let Some(ln) = &self.ln_final {
            v.extend(ln.params());
        }
        v.extend(self.head.params());
        v
    }

    pub fn zero_grad(&mut self) {
        self.visit_params_mut(&mut |p| p.grad.fill(0.0));
    }

    /// Trainable scalars.
    pub fn num_params(&self) -> usize {
        self.params().iter().map(|p| p.len()).sum()
    }

    /// Scalars of the same model with every layer dense.
    pub fn dense_equivalent_params(&self) -> usize {
        let count = |l: &AnyLinear| l.params().iter().map(|p| p.len()).sum::<usize>();
        let mut tensorised = self.word.num_params();
        let mut dense = self.word.dense_equivalent();
        for l in self.blocks.iter().flat_map(|b| b.linears()) {
            tensorised += count(l);
            dense += l.dense_equivalent();
        }
        for l in self.head.linears() {
            tensorised += count(l);
            dense += match (l, &self.head) {
                // A TT output projection D → V' stands for a dense D × V matrix + bias.
                (AnyLinear::Tt(t), Head::Mlm(_)) => (t.in_features() + 1) * self.cfg.vocab_size,
                _ => l.dense_equivalent(),
            };
        }
        self.num_params() - tensorised + dense
    }

    /// Fresh activations and workspaces for `batch` sequences of `cfg.seq_len` tokens (an MLM
    /// head gets room for 15% of the positions, rounded up, per sequence).
    pub fn state(&self, batch: usize) -> EncoderState {
        let t = self.cfg.seq_len;
        EncoderState::new(self, batch, t, (15 * t).div_ceil(100).max(1))
    }

    /// Fresh state for `batch` sequences of `seq_len ≤ cfg.seq_len` tokens whose MLM head (if
    /// any) predicts at most `mlm_rows_per_seq` positions per sequence.
    pub fn state_for(
        &self,
        batch: usize,
        seq_len: usize,
        mlm_rows_per_seq: usize,
    ) -> Result<EncoderState, ConfigError> {
        if seq_len == 0 || seq_len > self.cfg.seq_len {
            return Err(ConfigError {
                field: "seq_len".into(),
                msg: format!(
                    "{seq_len} tokens, the model's position table has 1..={}",
                    self.cfg.seq_len
                ),
            });
        }
        Ok(EncoderState::new(self, batch, seq_len, mlm_rows_per_seq))
    }

    /// Forward pass on the batch loaded in `st`; with `train`, dropout is on (masks from
    /// `step`) and the loss gradient is left ready for [`Encoder::backward`].
    pub fn forward(
        &self,
        st: &mut EncoderState,
        train: bool,
        step: u64,
    ) -> Result<StepStats, EmbeddingError> {
        st.step = step;
        self.forward_body(st, train, step)?;
        let stats = match (&self.head, &mut st.head) {
            (Head::Classifier(h), HeadState::Classifier(hs)) => {
                let hidden = hidden_of(&st.acts, &st.outs, &st.x_final);
                hs.forward(h, hidden, st.t, train, step)
            }
            (Head::Mlm(h), HeadState::Mlm(hs)) => {
                let hidden = hidden_of(&st.acts, &st.outs, &st.x_final);
                let table = match &self.word {
                    AnyEmbedding::Dense(e) => Some(&e.table),
                    AnyEmbedding::Ttm(_) => None,
                };
                h.forward(hs, hidden, table, train)
            }
            _ => unreachable!("state made for another head"),
        };
        Ok(StepStats {
            loss: stats.loss,
            correct: stats.correct,
            count: stats.count,
        })
    }

    /// Embeddings and blocks (and the final LN of a pre-LN model): the last hidden states.
    fn forward_body(
        &self,
        st: &mut EncoderState,
        train: bool,
        step: u64,
    ) -> Result<(), EmbeddingError> {
        // Embeddings.
        self.word.forward(&mut st.ws_word, &st.ids, &mut st.emb)?;
        self.pos
            .forward(&mut st.ws_pos, &st.pos_ids, &mut st.sc.tmp[0])?;
        add_into(&mut st.emb, &st.sc.tmp[0]);
        self.types
            .forward(&mut st.ws_type, &st.types, &mut st.sc.tmp[0])?;
        add_into(&mut st.emb, &st.sc.tmp[0]);
        self.ln_emb.forward(&mut st.ws_ln_emb, &st.emb, &mut st.x0);
        self.drop_emb
            .forward_in_place(&mut st.ws_drop_emb, step, train, &mut st.x0);
        // Blocks (a classifier's last one on the [CLS] rows when training).
        let rec = self.cfg.recompute_blocks;
        let last = self.blocks.len() - 1;
        st.last_cls = train && st.cls.is_some();
        for l in 0..self.blocks.len() {
            let (x, a) = block_io(&st.x0, &st.outs, &mut st.acts, l, rec);
            match &mut st.cls {
                Some(c) if st.last_cls && l == last => {
                    self.cls_block_forward(
                        l,
                        x,
                        &mut st.blocks[l],
                        a,
                        c,
                        &mut st.sc,
                        &st.mask,
                        step,
                    );
                    continue;
                }
                _ => self.block_forward(
                    l,
                    x,
                    &mut st.blocks[l],
                    a,
                    &mut st.sc,
                    &st.mask,
                    train,
                    step,
                ),
            }
            if rec {
                // Keep only the block's output (the next block's input).
                std::mem::swap(&mut st.acts[0].out, &mut st.outs[l]);
            }
        }
        if let (true, Some(c)) = (st.last_cls, &st.cls) {
            // The [CLS] rows into the last hidden states, where the head reads them.
            let (d, t) = (self.cfg.d_model, st.t);
            let rows = if self.ln_final.is_some() {
                &c.hidden
            } else {
                &c.out
            };
            let full: &mut [f32] = if self.ln_final.is_some() {
                &mut st.x_final
            } else if rec {
                &mut st.outs[last]
            } else {
                &mut st.acts[last].out
            };
            for (b, row) in rows.chunks_exact(d).enumerate() {
                full[b * t * d..b * t * d + d].copy_from_slice(row);
            }
        } else if let Some(ln) = &self.ln_final {
            let last = last_out(&st.acts, &st.outs);
            ln.forward(&mut st.ws_ln_final, last, &mut st.x_final);
        }
        Ok(())
    }

    /// The last block's forward on the [CLS] rows (see [`ClsBlock`]): q, k and v of every row
    /// into `a.qkv` (and LN1 of every row into `a.ln1_out`, pre-LN), the rest on B rows in `c`.
    #[allow(clippy::too_many_arguments)]
    fn cls_block_forward(
        &self,
        l: usize,
        x: &[f32],
        s: &mut BlockState,
        a: &mut BlockActs,
        c: &mut ClsBlock,
        sc: &mut Scratch,
        mask: &[u8],
        step: u64,
    ) {
        let (d, t) = (self.cfg.d_model, c.seq_len);
        let blk = &self.blocks[l];
        let pre = self.cfg.pre_ln;
        let attn_in: &[f32] = if pre {
            blk.ln1.forward(&mut s.ws_ln1, x, &mut a.ln1_out);
            &a.ln1_out
        } else {
            x
        };
        qkv_forward(blk, s, d, attn_in, &mut sc.tmp, &mut a.qkv);
        allowed_keys(Some(mask), &mut c.allow);
        self.attn
            .forward_first(&a.qkv, &c.allow, t, &mut c.probs, &mut c.att);
        blk.o.forward(&mut c.ws_o, &c.att, &mut c.o);
        for (b, row) in c.x.chunks_exact_mut(d).enumerate() {
            row.copy_from_slice(&x[b * t * d..b * t * d + d]);
        }
        let mask = self.drop_attn[l].draw_mask(&mut c.ws_drop_attn, step, true);
        let (ln, ws_ln) = if pre {
            (&blk.ln2, &mut c.ws_ln2)
        } else {
            (&blk.ln1, &mut c.ws_ln1)
        };
        ln.forward_residual(ws_ln, &c.x, &c.o, mask, &mut c.r1, &mut c.x1);
        // g = GELU(h) and GELU'(h) in h's place (B rows: both kept).
        blk.up.forward(&mut c.ws_up, &c.x1, &mut c.h);
        Gelu.forward_and_grad_in_place(&mut c.h, &mut c.g);
        blk.down.forward(&mut c.ws_down, &c.g, &mut c.f);
        if pre {
            self.drop_ffn[l].forward_in_place(&mut c.ws_drop_ffn, step, true, &mut c.f);
            sum_into(&c.r1, &c.f, &mut c.out);
            if let Some(ln) = &self.ln_final {
                ln.forward(&mut c.ws_ln_final, &c.out, &mut c.hidden);
            }
        } else {
            let mask = self.drop_ffn[l].draw_mask(&mut c.ws_drop_ffn, step, true);
            blk.ln2
                .forward_residual(&mut c.ws_ln2, &c.x1, &c.f, mask, &mut c.r2, &mut c.out);
        }
    }

    /// Backward of [`Encoder::cls_block_forward`] from `c.dout` (∂L/∂ the last hidden rows,
    /// before the final LN for pre-LN): every gradient of the block, and *writes* `sc.d`
    /// (∂L/∂x, N × D).
    fn cls_block_backward(
        &mut self,
        l: usize,
        x: &[f32],
        s: &mut BlockState,
        a: &mut BlockActs,
        c: &mut ClsBlock,
        sc: &mut Scratch,
    ) {
        let (d, t) = (self.cfg.d_model, c.seq_len);
        let pre = self.cfg.pre_ln;
        let blk = &mut self.blocks[l];
        let [d1, d2, d3] = &mut c.d;
        if let Some(ln) = &mut self.ln_final {
            ln.backward(&mut c.ws_ln_final, &c.out, &c.dout, Some(d2));
            std::mem::swap(&mut c.dout, d2);
        }
        // d1: ∂L/∂r2 (post-LN), or ∂L/∂out, the residual part of ∂L/∂r1 (pre-LN); d2: the
        // FFN output's gradient, through the dropout.
        if pre {
            d1.copy_from_slice(&c.dout);
            self.drop_ffn[l].backward(&c.ws_drop_ffn, d1, d2);
        } else {
            let mask = c.ws_drop_ffn.mask(&self.drop_ffn[l]);
            blk.ln2
                .backward_residual(&mut c.ws_ln2, &c.r2, &c.dout, None, d1, mask, d2);
        }
        blk.down.backward(&mut c.ws_down, &c.g, d2, Some(&mut c.dg));
        // dh = dg ⊙ GELU'(h), then d3 = ∂L/∂x1 through the FFN.
        mul_into(&mut c.dg, &c.h);
        blk.up.backward(&mut c.ws_up, &c.x1, &c.dg, Some(d3));
        // d1 = ∂L/∂r1; c.dout (read above) = ∂L/∂o, through the dropout.
        if pre {
            blk.ln2.backward(&mut c.ws_ln2, &c.r1, d3, Some(d2));
            add_into(d1, d2);
            self.drop_attn[l].backward(&c.ws_drop_attn, d1, &mut c.dout);
        } else {
            let mask = c.ws_drop_attn.mask(&self.drop_attn[l]);
            blk.ln1
                .backward_residual(&mut c.ws_ln1, &c.r1, d1, Some(d3), d2, mask, &mut c.dout);
            std::mem::swap(d1, d2);
        }
        blk.o.backward(&mut c.ws_o, &c.att, &c.dout, Some(d3)); // ∂L/∂att (first rows)
        self.attn
            .backward_first(&a.qkv, &c.probs, d3, t, &mut c.dattn, &mut sc.dqkv);
        let attn_in: &[f32] = if pre { &a.ln1_out } else { x };
        let [_, t2, t3] = &mut sc.tmp;
        qkv_backward(blk, s, d, attn_in, &sc.dqkv, &mut sc.d, t2, t3);
        if pre {
            blk.ln1.backward(&mut s.ws_ln1, x, t2, Some(t3));
            sc.d.copy_from_slice(t3);
        } else {
            sc.d.copy_from_slice(t2);
        }
        // The residual x → r1 on the first rows.
        for (b, row) in d1.chunks_exact(d).enumerate() {
            add_into(&mut sc.d[b * t * d..b * t * d + d], row);
        }
    }

    /// One block's forward from its input `x` into `a`; `sc`'s q/k/v, tmp[0] and g are scratch.
    #[allow(clippy::too_many_arguments)]
    fn block_forward(
        &self,
        l: usize,
        x: &[f32],
        s: &mut BlockState,
        a: &mut BlockActs,
        sc: &mut Scratch,
        mask: &[u8],
        train: bool,
        step: u64,
    ) {
        let d = self.cfg.d_model;
        let blk = &self.blocks[l];
        let attn_in: &[f32] = if self.cfg.pre_ln {
            blk.ln1.forward(&mut s.ws_ln1, x, &mut a.ln1_out);
            &a.ln1_out
        } else {
            x
        };
        // q, k, v: TT layers on the merged path as one fused product straight into the
        // saved interleaved qkv; otherwise one by one through tmp[0..3] (free until the
        // attention output). The attention output and the FFN output only live until their
        // residual sums, in tmp[0].
        qkv_forward(blk, s, d, attn_in, &mut sc.tmp, &mut a.qkv);
        self.attn
            .forward(&mut s.ws_attn, &a.qkv, Some(mask), &mut a.att);
        let o = &mut sc.tmp[0];
        blk.o.forward(&mut s.ws_o, &a.att, o);
        // r1 = x + dropout(o) and its LayerNorm (LN2 pre-LN, LN1 post-LN) in one pass.
        let mask = self.drop_attn[l].draw_mask(&mut s.ws_drop_attn, step, train);
        let (ln, ws_ln, ffn_in) = if self.cfg.pre_ln {
            (&blk.ln2, &mut s.ws_ln2, &mut a.ln2_out)
        } else {
            (&blk.ln1, &mut s.ws_ln1, &mut a.ln1_out)
        };
        ln.forward_residual(ws_ln, x, o, mask, &mut a.r1, ffn_in);
        let ffn_in: &[f32] = ffn_in;
        let f = &mut sc.tmp[0];
        if let Some((w, up, down)) = fused_ffn(blk, s, x.len() / d) {
            // Up → bias + GELU → Down in row blocks: no N × F buffer.
            w.forward(up, down, ffn_in, f);
        } else {
            let rows = x.len() / d;
            let nf = rows * self.cfg.ffn;
            ensure_len(&mut a.h, nf);
            ensure_len(&mut sc.dg, nf);
            blk.up.forward(&mut s.ws_up, ffn_in, &mut a.h);
            if keeps_gelu(rows) {
                // g = GELU(h) kept, and GELU'(h) in h's place, from one Φ/φ per value: the
                // backward evaluates no GELU.
                ensure_len(&mut a.g, nf);
                Gelu.forward_and_grad_in_place(&mut a.h, &mut a.g);
                blk.down.forward(&mut s.ws_down, &a.g, f);
            } else {
                // g = GELU(h) is not kept: the backward recomputes it.
                ensure_len(&mut sc.g, nf);
                Gelu.forward(&a.h, &mut sc.g);
                blk.down.forward(&mut s.ws_down, &sc.g, f);
            }
        }
        if self.cfg.pre_ln {
            self.drop_ffn[l].forward_in_place(&mut s.ws_drop_ffn, step, train, f);
            sum_into(&a.r1, f, &mut a.out);
        } else {
            // r2 = x1 + dropout(f) and LN2 in one pass.
            let mask = self.drop_ffn[l].draw_mask(&mut s.ws_drop_ffn, step, train);
            blk.ln2
                .forward_residual(&mut s.ws_ln2, &a.ln1_out, f, mask, &mut a.r2, &mut a.out);
        }
    }

    /// Backward of the last training forward: accumulates every parameter's gradient.
    pub fn backward(&mut self, st: &mut EncoderState) {
        let (d, t) = (self.cfg.d_model, st.t);
        // Head: `st.sc.d` ← ∂L/∂(last hidden states).
        st.sc.d.fill(0.0);
        match (&mut self.head, &mut st.head) {
            (Head::Classifier(h), HeadState::Classifier(hs)) => {
                hs.backward(h);
                for (b, row) in hs.dcls.chunks_exact(d).enumerate() {
                    st.sc.d[b * t * d..b * t * d + d].copy_from_slice(row);
                }
            }
            (Head::Mlm(h), HeadState::Mlm(hs)) => {
                let table = match &mut self.word {
                    AnyEmbedding::Dense(e) => Some(&mut e.table),
                    AnyEmbedding::Ttm(_) => None,
                };
                h.backward(hs, table);
                for (i, &s) in hs.selected.iter().enumerate() {
                    let s = s as usize;
                    st.sc.d[s * d..(s + 1) * d].copy_from_slice(&hs.dx[i * d..(i + 1) * d]);
                }
            }
            _ => unreachable!("state made for another head"),
        }
        let mut cls = match &mut st.cls {
            Some(c) if st.last_cls => {
                // ∂L/∂ the [CLS] rows; the final LN's backward is the block's (B rows).
                for (b, row) in c.dout.chunks_exact_mut(d).enumerate() {
                    row.copy_from_slice(&st.sc.d[b * t * d..b * t * d + d]);
                }
                Some(c)
            }
            _ => {
                if let Some(ln) = &mut self.ln_final {
                    let last = last_out(&st.acts, &st.outs);
                    ln.backward(&mut st.ws_ln_final, last, &st.sc.d, Some(&mut st.sc.tmp[0]));
                    std::mem::swap(&mut st.sc.d, &mut st.sc.tmp[0]);
                }
                None
            }
        };
        // Blocks, last to first: `sc.d` holds ∂L/∂out on entry and ∂L/∂x on exit.
        let rec = self.cfg.recompute_blocks;
        for l in (0..self.blocks.len()).rev() {
            let (x, a) = block_io(&st.x0, &st.outs, &mut st.acts, l, rec);
            let sc = &mut st.sc;
            let s = &mut st.blocks[l];
            if let Some(c) = cls.take() {
                if rec {
                    // The block's activations again from its input (same masks, same values).
                    self.cls_block_forward(l, x, s, a, c, sc, &st.mask, st.step);
                }
                self.cls_block_backward(l, x, s, a, c, sc);
                continue;
            }
            if rec {
                // Rebuild the block's activations from its input: the same layers, the same
                // dropout masks (seeded by step), so the same values as the forward's.
                self.block_forward(l, x, s, a, sc, &st.mask, true, st.step);
            }
            let blk = &mut self.blocks[l];
            let [t1, t2, t3] = &mut sc.tmp;
            let pre = self.cfg.pre_ln;
            // t1: ∂L/∂r2 (post-LN) or ∂L/∂out (pre-LN), the residual part of the FFN input's
            // gradient; t2: the FFN output's, through the dropout.
            if pre {
                t1.copy_from_slice(&sc.d);
                self.drop_ffn[l].backward(&s.ws_drop_ffn, t1, t2);
            } else {
                let mask = s.ws_drop_ffn.mask(&self.drop_ffn[l]);
                blk.ln2
                    .backward_residual(&mut s.ws_ln2, &a.r2, &sc.d, None, t1, mask, t2);
            }
            let ffn_in: &[f32] = if pre { &a.ln2_out } else { &a.ln1_out };
            let fused = match (&mut blk.up, &mut blk.down, &mut s.ws_ffn) {
                (AnyLinear::Tt(up), AnyLinear::Tt(down), Some(w)) if w.applies(up, down) => {
                    // The forward ran fused too (same layers, same ranks).
                    w.backward(up, down, ffn_in, t2, t3);
                    true
                }
                _ => false,
            };
            if !fused {
                let g: &[f32] = if keeps_gelu(ffn_in.len() / d) {
                    &a.g // and a.h holds GELU'(h) since the forward
                } else {
                    // g = GELU(h) again for Down's backward, and GELU'(h) in h's place (h is
                    // not needed again), from one Φ/φ per value.
                    Gelu.forward_and_grad_in_place(&mut a.h, &mut sc.g);
                    &sc.g
                };
                blk.down.backward(&mut s.ws_down, g, t2, Some(&mut sc.dg));
                // dh = dg ⊙ GELU'(h)
                mul_into(&mut sc.dg, &a.h);
                blk.up.backward(&mut s.ws_up, ffn_in, &sc.dg, Some(t3));
            }
            // t1 = ∂L/∂r1; sc.d (free until qkv_backward) = ∂L/∂o, through the dropout.
            if pre {
                blk.ln2.backward(&mut s.ws_ln2, &a.r1, t3, Some(t2));
                add_into(t1, t2);
                self.drop_attn[l].backward(&s.ws_drop_attn, t1, &mut sc.d);
            } else {
                // ∂L/∂x1 = t1 + t3 (residual and FFN), through LN1.
                let mask = s.ws_drop_attn.mask(&self.drop_attn[l]);
                blk.ln1
                    .backward_residual(&mut s.ws_ln1, &a.r1, t1, Some(t3), t2, mask, &mut sc.d);
                std::mem::swap(t1, t2);
            }
            blk.o.backward(&mut s.ws_o, &a.att, &sc.d, Some(t3));
            self.attn.backward(&mut s.ws_attn, &a.qkv, t3, &mut sc.dqkv);
            let attn_in: &[f32] = if pre { &a.ln1_out } else { x };
            // sc.d, read by o's backward above, is scratch until its ∂L/∂x is written below.
            qkv_backward(blk, s, d, attn_in, &sc.dqkv, &mut sc.d, t2, t3);
            // t2 = ∂L/∂(attention input)
            if pre {
                blk.ln1.backward(&mut s.ws_ln1, x, t2, Some(t3));
                sum_into(t1, t3, &mut sc.d);
            } else {
                sum_into(t1, t2, &mut sc.d);
            }
        }
        // Embeddings.
        self.drop_emb
            .backward_in_place(&st.ws_drop_emb, &mut st.sc.d);
        let [t1, ..] = &mut st.sc.tmp;
        self.ln_emb
            .backward(&mut st.ws_ln_emb, &st.emb, &st.sc.d, Some(t1));
        self.word.backward(&mut st.ws_word, &st.ids, t1);
        self.pos.backward(&mut st.ws_pos, &st.pos_ids, t1);
        self.types.backward(&mut st.ws_type, &st.types, t1);
    }
}

/// The fused q/k/v workspace and layers of a block whose q, k and v are TT layers planned on
/// the merged path (`None`: run them one by one). Planned when the state is made and again
/// only after a rank change.
fn shared_qkv<'a>(
    blk: &'a Block,
    s: &'a mut BlockState,
    rows: usize,
) -> Option<(&'a mut SharedInput, [&'a TtLinear; 3])> {
    let (AnyLinear::Tt(q), AnyLinear::Tt(k), AnyLinear::Tt(v)) = (&blk.q, &blk.k, &blk.v) else {
        return None;
    };
    let layers = [q, k, v];
    let same = s.qkv_shapes.len() == 3
        && s.qkv_shapes
            .iter()
            .zip(&layers)
            .all(|(a, l)| a == l.shape());
    if !same {
        s.qkv_shapes = layers.iter().map(|l| l.shape().clone()).collect();
        s.ws_qkv = SharedInput::new(&layers, rows);
    }
    match &mut s.ws_qkv {
        Some(w) if w.applies(&layers) => Some((w, layers)),
        _ => None,
    }
}

/// q, k and v of `attn_in` into `qkv` (N × 3D, [`interleave`]'s rows): one fused TT product
/// where the planner allows (see `shared_qkv`), else one by one through `tmp`.
fn qkv_forward(
    blk: &Block,
    s: &mut BlockState,
    d: usize,
    attn_in: &[f32],
    tmp: &mut [Vec<f32>; 3],
    qkv: &mut [f32],
) {
    if let Some((w, layers)) = shared_qkv(blk, s, attn_in.len() / d) {
        w.forward(&layers, attn_in, qkv);
    } else {
        let [q, k, v] = tmp;
        blk.q.forward(&mut s.ws_q, attn_in, q);
        blk.k.forward(&mut s.ws_k, attn_in, k);
        blk.v.forward(&mut s.ws_v, attn_in, v);
        interleave(q, k, v, d, qkv);
    }
}

/// The q, k, v layers' backward from `dqkv` (N × 3D): their gradients, and *writes* `dx`
/// (∂L/∂`attn_in`). `dy` and `tmp` (N × D each) are scratch.
#[allow(clippy::too_many_arguments)]
fn qkv_backward(
    blk: &mut Block,
    s: &mut BlockState,
    d: usize,
    attn_in: &[f32],
    dqkv: &[f32],
    dy: &mut [f32],
    dx: &mut [f32],
    tmp: &mut [f32],
) {
    if let (AnyLinear::Tt(q), AnyLinear::Tt(k), AnyLinear::Tt(v), Some(w)) =
        (&mut blk.q, &mut blk.k, &mut blk.v, &mut s.ws_qkv)
    {
        if w.applies(&[q, k, v]) {
            // The forward ran fused too (same layers, same ranks).
            w.backward(&mut [q, k, v], attn_in, dqkv, dx);
            return;
        }
    }
    // One of ∂L/∂q, ∂L/∂k, ∂L/∂v at a time in dy.
    column_block(dqkv, d, 0, dy);
    blk.q.backward(&mut s.ws_q, attn_in, dy, Some(dx));
    column_block(dqkv, d, 1, dy);
    blk.k.backward(&mut s.ws_k, attn_in, dy, Some(tmp));
    add_into(dx, tmp);
    column_block(dqkv, d, 2, dy);
    blk.v.backward(&mut s.ws_v, attn_in, dy, Some(tmp));
    add_into(dx, tmp);
}

/// The fused FFN workspace and layers of a block whose up and down are TT layers planned on
/// the merged path (`None`: run Up, GELU, Down one by one). Planned when the state is made and
/// again only after a rank change.
fn fused_ffn<'a>(
    blk: &'a Block,
    s: &'a mut BlockState,
    rows: usize,
) -> Option<(&'a mut FusedFfn, &'a TtLinear, &'a TtLinear)> {
    let (AnyLinear::Tt(up), AnyLinear::Tt(down)) = (&blk.up, &blk.down) else {
        return None;
    };
    let same = s.ffn_shapes.len() == 2
        && s.ffn_shapes[0] == *up.shape()
        && s.ffn_shapes[1] == *down.shape();
    if !same {
        s.ffn_shapes = vec![up.shape().clone(), down.shape().clone()];
        s.ws_ffn = FusedFfn::new(up, down, rows);
    }
    match &mut s.ws_ffn {
        Some(w) if w.applies(up, down) => Some((w, up, down)),
        _ => None,
    }
}

/// Rows up to which a block off the fused FFN path keeps g = GELU(h) (N × F) from its forward
/// beside GELU'(h), so that its backward evaluates no GELU: at most one row block of the fused
/// path (whose own g never exceeds that). Measured with `comera bench step --batch 1` on the
/// paper model (128 rows; six runs each, interleaved): step median 44.8 → 43.0 ms, peak RSS
/// 88.5 → 96.3 MiB (1.5 MB per block, less the shared g scratch). Above it the fused path,
/// or the memory, wins.
pub const KEEP_GELU_MAX_ROWS: usize = 128;

fn keeps_gelu(rows: usize) -> bool {
    rows <= KEEP_GELU_MAX_ROWS
}

/// Gives `v` length `len` (zeros), allocating only the first time (buffers of the unfused
/// paths exist only once a block needs them).
fn ensure_len(v: &mut Vec<f32>, len: usize) {
    if v.len() != len {
        v.resize(len, 0.0);
    }
}

/// qkv[n] = [q[n] | k[n] | v[n]] (rows of width 3D).
fn interleave(q: &[f32], k: &[f32], v: &[f32], d: usize, qkv: &mut [f32]) {
    for (((row, q), k), v) in qkv
        .chunks_exact_mut(3 * d)
        .zip(q.chunks_exact(d))
        .zip(k.chunks_exact(d))
        .zip(v.chunks_exact(d))
    {
        row[..d].copy_from_slice(q);
        row[d..2 * d].copy_from_slice(k);
        row[2 * d..].copy_from_slice(v);
    }
}

/// out[n] = qkv[n][j·D..(j+1)·D]: one of q, k, v (j = 0, 1, 2) out of [`interleave`]'s rows.
fn column_block(qkv: &[f32], d: usize, j: usize, out: &mut [f32]) {
    for (row, o) in qkv.chunks_exact(3 * d).zip(out.chunks_exact_mut(d)) {
        o.copy_from_slice(&row[j * d..(j + 1) * d]);
    }
}

/// One block's layer workspaces.
#[derive(Debug)]
pub struct BlockState {
    ws_q: AnyLinearWorkspace,
    ws_k: AnyLinearWorkspace,
    ws_v: AnyLinearWorkspace,
    ws_o: AnyLinearWorkspace,
    ws_up: AnyLinearWorkspace,
    ws_down: AnyLinearWorkspace,
    /// q, k and v as one fused TT product (see `shared_qkv`), planned for these shapes.
    ws_qkv: Option<SharedInput>,
    qkv_shapes: Vec<comera_tensor::TtShape>,
    /// Up → GELU → Down fused in row blocks (see `fused_ffn`), planned for these shapes.
    ws_ffn: Option<FusedFfn>,
    ffn_shapes: Vec<comera_tensor::TtShape>,
    ws_attn: AttentionWorkspace,
    ws_ln1: LayerNormWorkspace,
    ws_ln2: LayerNormWorkspace,
    ws_drop_attn: DropoutWorkspace,
    ws_drop_ffn: DropoutWorkspace,
}

/// One block's saved activations (N = batch·seq_len rows).
#[derive(Debug)]
struct BlockActs {
    qkv: Vec<f32>,     // N × 3D
    att: Vec<f32>,     // N × D
    r1: Vec<f32>,      // N × D
    ln1_out: Vec<f32>, // N × D
    ln2_out: Vec<f32>, // N × D (pre-LN only)
    h: Vec<f32>,       // N × F (unfused FFN only): h, or GELU'(h) where g is kept
    g: Vec<f32>,       // N × F: GELU(h), kept only at N ≤ KEEP_GELU_MAX_ROWS (unfused FFN)
    r2: Vec<f32>,      // N × D (post-LN only)
    out: Vec<f32>,     // N × D
}

/// A classifier's last block on the [CLS] rows only, in training. The head reads only the first
/// position of each sequence, so past the K and V of every row (which that position attends
/// to) the last block's attention query, output projection, residuals, LayerNorms and FFN
/// only matter on those B rows: the same formulas on them, with the gradients of the whole
/// block (every other row of the block's output has no path to the loss). The dropout masks
/// of those two sites are drawn over the B rows. Measured on the paper's model (2 threads,
/// Zen 4, runs alternating with the full block): `comera bench rank --paper-model --batch 1`
/// rank 30 33.7-33.9 → 31.0-31.5 ms, rank 15 22.1-22.3 → 20.0-20.7 ms; `comera bench step
/// --batch 32` 944-963 → 755-844 ms, peak RSS 790 → 731 MiB.
#[derive(Debug)]
struct ClsBlock {
    seq_len: usize,
    ws_o: AnyLinearWorkspace,
    ws_up: AnyLinearWorkspace,
    ws_down: AnyLinearWorkspace,
    ws_ln1: LayerNormWorkspace,
    ws_ln2: LayerNormWorkspace,
    ws_ln_final: LayerNormWorkspace,
    ws_drop_attn: DropoutWorkspace,
    ws_drop_ffn: DropoutWorkspace,
    allow: Vec<f32>,  // B × T: 1 for a real token, 0 for padding
    probs: Vec<f32>,  // B × H × T: the first rows' attention probabilities
    x: Vec<f32>,      // B × D: the block input's first rows (the residual)
    att: Vec<f32>,    // B × D
    o: Vec<f32>,      // B × D: Dropout(O(att))
    r1: Vec<f32>,     // B × D
    x1: Vec<f32>,     // B × D: the FFN input, LN1(r1) (post-LN) or LN2(r1) (pre-LN)
    h: Vec<f32>,      // B × F: GELU'(h) after the forward
    g: Vec<f32>,      // B × F: GELU(h)
    f: Vec<f32>,      // B × D: Dropout(Down(g))
    r2: Vec<f32>,     // B × D (post-LN)
    out: Vec<f32>,    // B × D: the block's output rows
    hidden: Vec<f32>, // B × D: LN_final(out) (pre-LN)
    dout: Vec<f32>,   // B × D: ∂L/∂(the last hidden rows)
    d: [Vec<f32>; 3], // B × D gradient scratch
    dg: Vec<f32>,     // B × F
    dattn: Vec<f32>,  // B × T: the attention backward's scratch
}

impl ClsBlock {
    fn new(m: &Encoder, b: usize, t: usize) -> ClsBlock {
        let (d, f, l) = (m.cfg.d_model, m.cfg.ffn, m.blocks.len() - 1);
        let blk = &m.blocks[l];
        let z = |len: usize| vec![0.0f32; len];
        ClsBlock {
            seq_len: t,
            ws_o: blk.o.workspace(b),
            ws_up: blk.up.workspace(b),
            ws_down: blk.down.workspace(b),
            ws_ln1: blk.ln1.workspace(b),
            ws_ln2: blk.ln2.workspace(b),
            ws_ln_final: match &m.ln_final {
                Some(ln) => ln.workspace(b),
                None => blk.ln2.workspace(0),
            },
            ws_drop_attn: m.drop_attn[l].workspace(b * d),
            ws_drop_ffn: m.drop_ffn[l].workspace(b * d),
            allow: z(b * t),
            probs: z(m.attn.first_probs_len(b, t)),
            x: z(b * d),
            att: z(b * d),
            o: z(b * d),
            r1: z(b * d),
            x1: z(b * d),
            h: z(b * f),
            g: z(b * f),
            f: z(b * d),
            r2: z(b * d),
            out: z(b * d),
            hidden: z(b * d),
            dout: z(b * d),
            d: [z(b * d), z(b * d), z(b * d)],
            dg: z(b * f),
            dattn: z(b * t),
        }
    }

    fn bytes(&self) -> usize {
        let mut total = 0;
        for v in [
            &self.allow,
            &self.probs,
            &self.x,
            &self.att,
            &self.o,
            &self.r1,
            &self.x1,
            &self.h,
            &self.g,
            &self.f,
            &self.r2,
            &self.out,
            &self.hidden,
            &self.dout,
            &self.dg,
            &self.dattn,
        ]
        .into_iter()
        .chain(&self.d)
        {
            total += 4 * v.capacity();
        }
        for w in [&self.ws_o, &self.ws_up, &self.ws_down] {
            total += AnyLinear::workspace_bytes(w);
        }
        total
    }
}

/// The classifier head's activations and scratch (B rows).
#[derive(Debug)]
pub struct ClassifierState {
    ws_pool: AnyLinearWorkspace,
    ws_cls: AnyLinearWorkspace,
    ws_drop: DropoutWorkspace,
    labels: Vec<i32>,     // B
    cls: Vec<f32>,        // B × D
    pooled_pre: Vec<f32>, // B × D
    pooled: Vec<f32>,     // B × D
    logits: Vec<f32>,     // B × C
    dlogits: Vec<f32>,    // B × C
    dpooled: Vec<f32>,    // B × D
    dcls: Vec<f32>,       // B × D
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

    /// Head forward on `hidden` (B·T × D).
    fn forward(
        &mut self,
        h: &ClassifierHead,
        hidden: &[f32],
        t: usize,
        train: bool,
        step: u64,
    ) -> comera_layers::loss::CrossEntropyStats {
        let d = self.cls.len() / self.labels.len();
        for (b, row) in self.cls.chunks_exact_mut(d).enumerate() {
            row.copy_from_slice(&hidden[b * t * d..b * t * d + d]);
        }
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
        4 * [
            &self.cls,
            &self.pooled_pre,
            &self.pooled,
            &self.logits,
            &self.dlogits,
            &self.dpooled,
            &self.dcls,
        ]
        .iter()
        .map(|v| v.capacity())
        .sum::<usize>()
    }
}

/// The head's part of an [`EncoderState`].
#[derive(Debug)]
pub enum HeadState {
    Classifier(ClassifierState),
    Mlm(MlmHeadState),
}

/// The last block's output: its activations' `out`, or with block recomputation the kept
/// output.
fn last_out<'a>(acts: &'a [BlockActs], outs: &'a [Vec<f32>]) -> &'a [f32] {
    match outs.last() {
        Some(o) => o,
        None => &acts.last().expect("at least one layer").out,
    }
}

/// The last hidden states: the last block's output, or the final LN's (pre-LN).
fn hidden_of<'a>(acts: &'a [BlockActs], outs: &'a [Vec<f32>], x_final: &'a [f32]) -> &'a [f32] {
    if x_final.is_empty() {
        last_out(acts, outs)
    } else {
        x_final
    }
}

/// Block `l`'s input (the embeddings' output or the previous block's output) and the
/// activation buffers it runs in (its own, or the one shared set with recomputation).
fn block_io<'a>(
    x0: &'a [f32],
    outs: &'a [Vec<f32>],
    acts: &'a mut [BlockActs],
    l: usize,
    recompute: bool,
) -> (&'a [f32], &'a mut BlockActs) {
    if recompute {
        let x: &[f32] = if l == 0 { x0 } else { &outs[l - 1] };
        (x, &mut acts[0])
    } else {
        let (done, rest) = acts.split_at_mut(l);
        let x: &[f32] = if l == 0 { x0 } else { &done[l - 1].out };
        (x, &mut rest[0])
    }
}

/// Everything a step of an [`Encoder`] needs for a fixed (batch, seq_len).
#[derive(Debug)]
pub struct EncoderState {
    b: usize,
    t: usize,
    n: usize,
    ids: Vec<u32>,
    types: Vec<u32>,
    pos_ids: Vec<u32>,
    mask: Vec<u8>,
    ws_word: AnyEmbeddingWorkspace,
    ws_pos: EmbeddingWorkspace,
    ws_type: EmbeddingWorkspace,
    ws_ln_emb: LayerNormWorkspace,
    ws_drop_emb: DropoutWorkspace,
    ws_ln_final: LayerNormWorkspace,
    emb: Vec<f32>, // N × D
    x0: Vec<f32>,  // N × D
    blocks: Vec<BlockState>,
    /// One set per block, or one shared set when blocks are recomputed.
    acts: Vec<BlockActs>,
    /// With block recomputation: each block's output (N × D), the next block's input.
    outs: Vec<Vec<f32>>,
    x_final: Vec<f32>, // N × D (pre-LN only)
    head: HeadState,
    sc: Scratch,
    /// The step of the last forward (its dropout masks, for recomputation).
    step: u64,
    /// Classifier heads: the last block on the [CLS] rows, used by training forwards.
    cls: Option<ClsBlock>,
    /// Whether the last forward ran the last block on the [CLS] rows only.
    last_cls: bool,
}

/// Scratch shared by all blocks.
#[derive(Debug)]
struct Scratch {
    d: Vec<f32>,        // N × D: the flowing gradient
    tmp: [Vec<f32>; 3], // N × D (q, k, v of unfused blocks in the forward)
    dqkv: Vec<f32>,     // N × 3D
    dg: Vec<f32>,       // N × F (only for blocks whose FFN does not run fused)
    g: Vec<f32>,        // N × F: GELU(h) of the block being run (recomputed in the backward; same)
}

impl EncoderState {
    fn new(m: &Encoder, b: usize, t: usize, mlm_rows_per_seq: usize) -> EncoderState {
        let c = &m.cfg;
        let (d, f) = (c.d_model, c.ffn);
        let n = b * t;
        let z = |len: usize| vec![0.0f32; len];
        let blocks: Vec<BlockState> = m
            .blocks
            .iter()
            .enumerate()
            .map(|(l, blk)| BlockState {
                ws_q: blk.q.workspace(n),
                ws_k: blk.k.workspace(n),
                ws_v: blk.v.workspace(n),
                ws_qkv: match (&blk.q, &blk.k, &blk.v) {
                    (AnyLinear::Tt(q), AnyLinear::Tt(k), AnyLinear::Tt(v)) => {
                        SharedInput::new(&[q, k, v], n)
                    }
                    _ => None,
                },
                ws_ffn: match (&blk.up, &blk.down) {
                    (AnyLinear::Tt(up), AnyLinear::Tt(down)) => FusedFfn::new(up, down, n),
                    _ => None,
                },
                ffn_shapes: [&blk.up, &blk.down]
                    .iter()
                    .filter_map(|l| match l {
                        AnyLinear::Tt(t) => Some(t.shape().clone()),
                        _ => None,
                    })
                    .collect(),
                qkv_shapes: [&blk.q, &blk.k, &blk.v]
                    .iter()
                    .filter_map(|l| match l {
                        AnyLinear::Tt(t) => Some(t.shape().clone()),
                        _ => None,
                    })
                    .collect(),
                ws_o: blk.o.workspace(n),
                ws_up: blk.up.workspace(n),
                ws_down: blk.down.workspace(n),
                // Above a few MiB, P is rebuilt in the backward from q, k (one extra q·kᵀ
                // per head) rather than kept: B·H·T² floats per block.
                ws_attn: m.attn.workspace_for(b, t),
                ws_ln1: blk.ln1.workspace(n),
                ws_ln2: blk.ln2.workspace(n),
                ws_drop_attn: m.drop_attn[l].workspace(n * d),
                ws_drop_ffn: m.drop_ffn[l].workspace(n * d),
            })
            .collect();
        let mut sc = Scratch {
            d: z(n * d),
            tmp: [z(n * d), z(n * d), z(n * d)],
            dqkv: z(3 * n * d),
            dg: Vec::new(),
            g: Vec::new(),
        };
        let unfused_ffn = blocks.iter().any(|b: &BlockState| b.ws_ffn.is_none());
        if unfused_ffn {
            sc.dg = z(n * f);
            if !keeps_gelu(n) {
                sc.g = z(n * f);
            }
        }
        let rec = c.recompute_blocks;
        let acts = (0..if rec { 1 } else { c.layers })
            .map(|_| BlockActs {
                qkv: z(3 * n * d),
                att: z(n * d),
                r1: z(n * d),
                ln1_out: z(n * d),
                ln2_out: if c.pre_ln { z(n * d) } else { Vec::new() },
                h: if unfused_ffn { z(n * f) } else { Vec::new() },
                g: if unfused_ffn && keeps_gelu(n) {
                    z(n * f)
                } else {
                    Vec::new()
                },
                r2: if c.pre_ln { Vec::new() } else { z(n * d) },
                out: z(n * d),
            })
            .collect();
        let outs = if rec {
            (0..c.layers).map(|_| z(n * d)).collect()
        } else {
            Vec::new()
        };
        let ln_final = m
            .ln_final
            .clone()
            .unwrap_or_else(|| LayerNorm::new("unused", d));
        let head = match &m.head {
            Head::Classifier(h) => {
                HeadState::Classifier(ClassifierState::new(h, b, d, c.num_labels))
            }
            Head::Mlm(h) => HeadState::Mlm(h.state(b * mlm_rows_per_seq.min(t), n)),
        };
        EncoderState {
            b,
            t,
            n,
            ids: vec![0; n],
            types: vec![0; n],
            pos_ids: (0..n).map(|i| (i % t) as u32).collect(),
            mask: vec![1; n],
            ws_word: m.word.workspace(n),
            ws_pos: m.pos.workspace(n),
            ws_type: m.types.workspace(n),
            ws_ln_emb: m.ln_emb.workspace(n),
            ws_drop_emb: m.drop_emb.workspace(n * d),
            ws_ln_final: ln_final.workspace(if m.ln_final.is_some() { n } else { 0 }),
            emb: z(n * d),
            x0: z(n * d),
            blocks,
            acts,
            outs,
            x_final: if c.pre_ln { z(n * d) } else { Vec::new() },
            cls: match &m.head {
                Head::Classifier(_) => Some(ClsBlock::new(m, b, t)),
                Head::Mlm(_) => None,
            },
            last_cls: false,
            head,
            sc,
            step: 0,
        }
    }

    /// Fuses every TT block's q/k/v whatever the planner chose (tests: the fused path on
    /// shapes too small for the planner to pick it). Returns the number of fused blocks.
    #[doc(hidden)]
    pub fn force_fused_qkv(&mut self, m: &Encoder) -> usize {
        let mut fused = 0;
        for (blk, s) in m.blocks.iter().zip(&mut self.blocks) {
            if let (AnyLinear::Tt(q), AnyLinear::Tt(k), AnyLinear::Tt(v)) = (&blk.q, &blk.k, &blk.v)
            {
                s.ws_qkv = SharedInput::new_unplanned(&[q, k, v], self.n);
                fused += s.ws_qkv.is_some() as usize;
            }
        }
        fused
    }

    /// Fuses every TT block's Up → GELU → Down whatever the planner chose (tests, as
    /// [`EncoderState::force_fused_qkv`]). Returns the number of fused blocks.
    #[doc(hidden)]
    pub fn force_fused_ffn(&mut self, m: &Encoder) -> usize {
        let mut fused = 0;
        for (blk, s) in m.blocks.iter().zip(&mut self.blocks) {
            if let (AnyLinear::Tt(up), AnyLinear::Tt(down)) = (&blk.up, &blk.down) {
                s.ws_ffn = FusedFfn::new_unplanned(up, down, self.n);
                fused += s.ws_ffn.is_some() as usize;
            }
        }
        fused
    }

    /// Runs a classifier's last block on every row in training too (tests: the [CLS]-rows
    /// block against the full one).
    #[doc(hidden)]
    pub fn full_last_block(&mut self) {
        self.cls = None;
    }

    /// Number of sequences per step.
    pub fn batch(&self) -> usize {
        self.b
    }

    /// Copies one batch in: ids, token types and attention mask (batch × seq_len each, mask
    /// 1 = real token) and one label per sequence. Lengths are checked.
    pub fn load(
        &mut self,
        ids: &[u32],
        types: &[u32],
        mask: &[u32],
        labels: &[usize],
    ) -> Result<(), String> {
        let n = self.n;
        for (what, len) in [
            ("input_ids", ids.len()),
            ("token_type_ids", types.len()),
            ("attention_mask", mask.len()),
        ] {
            if len != n {
                return Err(format!(
                    "{what}: {len} values, expected batch × seq_len = {n}"
                ));
            }
        }
        let HeadState::Classifier(h) = &mut self.head else {
            return Err("labels: this model has an MLM head; load batches with load_mlm".into());
        };
        if labels.len() != self.b {
            return Err(format!(
                "labels: {} values, expected batch = {}",
                labels.len(),
                self.b
            ));
        }
        self.ids.copy_from_slice(ids);
        self.types.copy_from_slice(types);
        for (m, &v) in self.mask.iter_mut().zip(mask) {
            *m = (v != 0) as u8;
        }
        for (l, &v) in h.labels.iter_mut().zip(labels) {
            *l = v as i32;
        }
        Ok(())
    }

    /// Copies one masked-LM batch in: (masked) ids and attention mask (batch × seq_len each),
    /// per-token labels (`IGNORE_INDEX` = −100 where nothing is predicted) and the flat
    /// positions that carry a label, ascending. Token types are all 0.
    pub fn load_mlm(
        &mut self,
        ids: &[u32],
        mask: &[u32],
        labels: &[i32],
        selected: &[u32],
    ) -> Result<(), String> {
        let n = self.n;
        let HeadState::Mlm(h) = &mut self.head else {
            return Err("this model has a classifier head; load batches with load".into());
        };
        for (what, len) in [
            ("input_ids", ids.len()),
            ("attention_mask", mask.len()),
            ("labels", labels.len()),
        ] {
            if len != n {
                return Err(format!(
                    "{what}: {len} values, expected batch × seq_len = {n}"
                ));
            }
        }
        if selected.len() > h.rows() {
            return Err(format!(
                "{} labelled positions, the MLM head has room for {}",
                selected.len(),
                h.rows()
            ));
        }
        if let Some(w) = selected.windows(2).find(|w| w[0] >= w[1]) {
            return Err(format!(
                "selected positions not ascending: {} then {}",
                w[0], w[1]
            ));
        }
        if let Some(&s) = selected.iter().find(|&&s| s as usize >= n) {
            return Err(format!("selected position {s} outside 0..{n}"));
        }
        self.ids.copy_from_slice(ids);
        self.types.fill(0);
        for (m, &v) in self.mask.iter_mut().zip(mask) {
            *m = (v != 0) as u8;
        }
        h.token_labels.copy_from_slice(labels);
        h.selected.clear();
        h.selected.extend_from_slice(selected);
        Ok(())
    }

    /// Sequence length T of this state.
    pub fn seq_len(&self) -> usize {
        self.t
    }

    /// The encoder's last hidden states of the last forward, `(batch·seq_len, d_model)`
    /// row-major (after the final LayerNorm for pre-LN models): what BERT calls
    /// `last_hidden_state`. After a training forward of a classifier only the [CLS] rows
    /// (b·seq_len) are computed (see `ClsBlock`); the other rows are stale.
    pub fn hidden(&self) -> &[f32] {
        hidden_of(&self.acts, &self.outs, &self.x_final)
    }

    /// Logits of the last forward: a classifier's `(batch, num_labels)` row-major, or an MLM
    /// head's labelled rows (see [`crate::mlm_head::MlmHeadState::logits`]).
    pub fn logits(&self) -> &[f32] {
        match &self.head {
            HeadState::Classifier(h) => &h.logits,
            HeadState::Mlm(h) => h.logits(),
        }
    }

    /// Bytes of activations, gradients scratch and layer workspaces (excluding parameters).
    pub fn bytes(&self) -> usize {
        let f = |v: &Vec<f32>| 4 * v.capacity();
        let mut total = [&self.emb, &self.x0, &self.x_final]
            .iter()
            .map(|v| f(v))
            .sum::<usize>();
        total += match &self.head {
            HeadState::Classifier(h) => h.bytes(),
            HeadState::Mlm(h) => h.bytes(),
        };
        let sc = &self.sc;
        total += [&sc.d, &sc.dqkv, &sc.dg, &sc.g]
            .iter()
            .map(|v| f(v))
            .sum::<usize>();
        total += sc.tmp.iter().map(f).sum::<usize>();
        total += AnyEmbedding::workspace_bytes(&self.ws_word);
        for a in &self.acts {
            total += [
                &a.qkv, &a.att, &a.r1, &a.ln1_out, &a.ln2_out, &a.h, &a.g, &a.r2, &a.out,
            ]
            .iter()
            .map(|v| f(v))
            .sum::<usize>();
        }
        total += self.outs.iter().map(f).sum::<usize>();
        total += self.cls.as_ref().map_or(0, ClsBlock::bytes);
        for s in &self.blocks {
            for w in [&s.ws_q, &s.ws_k, &s.ws_v, &s.ws_o, &s.ws_up, &s.ws_down] {
                total += AnyLinear::workspace_bytes(w);
            }
            total += s.ws_qkv.as_ref().map_or(0, SharedInput::bytes);
            total += s.ws_ffn.as_ref().map_or(0, FusedFfn::bytes);
            total += Attention::workspace_bytes(&s.ws_attn);
        }
        // The TT layers' scratch, shared through this thread's pool.
        total + comera_layers::tt_linear::scratch_pool_bytes()
    }
}
