//! The BERT-style encoder of the paper (SPEC §5), dense or TT/TTM, with a classifier or a
//! masked-LM head; explicit forward and backward over a state planned once for a fixed
//! (batch, seq_len).
//!
//! Data flow, on N = B·T rows of width D:
//!
//! ```text
//! x0 = Dropout(LN(word[ids] + pos[t] + type[types]))               embeddings
//! x_{l+1} = Block_l(x_l),  l = 0 … L−1                              block.rs
//! H = x_L (post-LN), or LN_final(x_L) (pre-LN)                      the last hidden states
//! L = Head(H): classifier on the [CLS] rows, or MLM on labelled rows  head.rs
//! ```
//!
//! and the backward in reverse: the head leaves ∂L/∂H in the flowing gradient, each block maps
//! ∂L/∂x_{l+1} to ∂L/∂x_l accumulating its gradients, and the embeddings take ∂L/∂x0.
//!
//! Files, each with one role:
//! - `mod.rs` (this): the model [`Encoder`] — construction, parameters, pre-trained bodies, and
//!   the forward and backward driving the embeddings, the blocks and the head;
//! - `block.rs`: one block's layers ([`Block`]) and its `block_forward` / `block_backward`
//!   pair, with the formulas;
//! - `head.rs`: the classifier head ([`ClassifierHead`]) and the dispatch to the MLM head
//!   ([`crate::mlm_head`]);
//! - `state.rs`: [`EncoderState`], every buffer of a step, and loading a batch into it
//!   ([`BatchError`]);
//! - `distill.rs`: training against a frozen teacher's logits and hidden states
//!   ([`EncoderState::attach_teacher`], [`DistillLoss`]);
//! - `plan.rs`: the paths the blocks take (LN placement, fused q/k/v, fused FFN, GELU kept
//!   ([`KEEP_GELU_MAX_ROWS`]), recomputation, \[CLS\] rows), chosen when the state is built.
//!
//! In training a classifier's last block runs past q/k/v on the \[CLS\] rows only (the head
//! reads nothing else; see `state::ClsRows`), through the same block code. With recomputation
//! (`recompute_blocks`) the forward keeps only each block's output and the backward rebuilds a
//! block's activations from its input (same layers, same dropout masks: same values).

mod block;
mod distill;
mod head;
mod plan;
mod state;

pub use block::Block;
pub use distill::{DistillLoss, Teacher};
pub use head::{ClassifierHead, ClassifierState, Head, HeadState};
pub use plan::KEEP_GELU_MAX_ROWS;
pub use state::{BatchError, BlockState, ClassifierBatch, EncoderState, MlmBatch};

use crate::config::{ConfigError, EncoderConfig, LayerTt, Layouts};
use block::{block_backward, block_forward, first_rows, set_first_rows, BlockCx, Rows};
use comera_layers::any::{AnyEmbedding, AnyLinear};
use comera_layers::attention::Attention;
use comera_layers::dropout::Dropout;
use comera_layers::elementwise::add_into;
use comera_layers::norm::LayerNorm;
use comera_layers::trainable::numbered;
use comera_layers::{
    Compressible, Embedding, EmbeddingError, EmbeddingLayer, Layer, Linear, Param, RankGates,
    StepStats, TtLinear, TtmEmbedding,
};
use comera_tensor::{init, TtShape};
use state::{block_io, hidden_of, last_out};
use std::collections::HashMap;

/// The encoder and its head.
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

/// The word embedding: TTM of the layout's shape, or a dense table.
fn word_embedding(
    cfg: &EncoderConfig,
    layouts: &Layouts,
    rng: &mut init::Rng,
) -> Result<AnyEmbedding, ConfigError> {
    let (name, rule) = ("embeddings.word", RankGates::new(cfg.threshold));
    Ok(match &layouts.word {
        Some(s) => AnyEmbedding::Ttm(
            TtmEmbedding::new(name, s.clone(), rule, cfg.init_std, rng).map_err(|e| {
                ConfigError {
                    field: "model.word_ttm".into(),
                    msg: e.to_string(),
                }
            })?,
        ),
        None => AnyEmbedding::Dense(Embedding::new(
            name,
            cfg.vocab_size,
            cfg.d_model,
            cfg.init_std,
            rng,
        )),
    })
}

/// Whether two configs build a layer kind alike: both dense, or both TT of the same modes
/// (ranks may differ: the pre-trained ones are taken).
fn same_kind(a: &EncoderConfig, ka: &LayerTt, b: &EncoderConfig, kb: &LayerTt) -> bool {
    match (a.is_tt(ka), b.is_tt(kb)) {
        (false, false) => true,
        (true, true) => (&ka.in_modes, &ka.out_modes) == (&kb.in_modes, &kb.out_modes),
        _ => false,
    }
}

/// The first field in which `b`'s body differs from `a`'s (the pre-trained one), as an error.
fn body_mismatch(a: &EncoderConfig, b: &EncoderConfig) -> Option<ConfigError> {
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
    let (field, _) = same.iter().find(|(_, ok)| !ok)?;
    Some(ConfigError {
        field: format!("model.{field}"),
        msg: format!(
            "differs from the pre-trained encoder's (seq_len may only be shorter): {}",
            match *field {
                "seq_len" => format!("{} vs {}", a.seq_len, b.seq_len),
                _ => "see its config".into(),
            }
        ),
    })
}

impl Encoder {
    /// A freshly initialised model (seeded; dropout masks also derive from `seed`). Layers are
    /// initialised in the order word, position, type, blocks, head.
    pub fn new(cfg: &EncoderConfig, seed: u64) -> Result<Encoder, ConfigError> {
        let layouts = cfg.validate()?;
        let mut rng = init::rng(seed);
        let (d, std) = (cfg.d_model, cfg.init_std);
        let word = word_embedding(cfg, &layouts, &mut rng)?;
        let pos = Embedding::new("embeddings.position", cfg.seq_len, d, std, &mut rng);
        let types = Embedding::new("embeddings.token_type", cfg.type_vocab, d, std, &mut rng);
        let blocks = (0..cfg.layers)
            .map(|l| Block::new(cfg, &layouts, l, &mut rng))
            .collect::<Result<Vec<_>, _>>()?;
        let dseed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let head = Head::new(cfg, &layouts, dseed, &mut rng)?;
        // Dropout sites: the embeddings', then per block after attention and after the FFN.
        let drops = |site: u64| {
            (0..cfg.layers as u64)
                .map(|l| Dropout::new(cfg.dropout, dseed.wrapping_add(site + 2 * l)))
                .collect()
        };
        Ok(Encoder {
            cfg: cfg.clone(),
            word,
            pos,
            types,
            ln_emb: LayerNorm::with_eps("embeddings.ln", d, cfg.ln_eps),
            blocks,
            ln_final: cfg
                .pre_ln
                .then(|| LayerNorm::with_eps("encoder.ln_final", d, cfg.ln_eps)),
            head,
            attn: Attention::new(d, cfg.heads),
            drop_emb: Dropout::new(cfg.dropout, dseed),
            drop_attn: drops(1),
            drop_ffn: drops(2),
        })
    }

    /// Calls `f` on every parameter in a fixed order, without allocating.
    pub fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.visit_body_params_mut(f);
        self.head.visit_params_mut(f);
    }

    /// [`Encoder::visit_params_mut`]'s parameters with their places in its order, the blocks'
    /// on several threads at once (halves of the blocks as rayon tasks); the embeddings, the
    /// final LayerNorm and the head on this thread, in order.
    pub fn visit_params_par(&mut self, f: &(dyn Fn(usize, &mut Param) + Sync)) {
        let mut next = 0;
        {
            let mut visit = numbered(f, &mut next);
            self.word.visit_params_mut(&mut visit);
            self.pos.visit_params_mut(&mut visit);
            self.types.visit_params_mut(&mut visit);
            self.ln_emb.visit_params_mut(&mut visit);
        }
        next += visit_blocks_par(&mut self.blocks, next, f);
        let mut visit = numbered(f, &mut next);
        if let Some(ln) = &mut self.ln_final {
            ln.visit_params_mut(&mut visit);
        }
        self.head.visit_params_mut(&mut visit);
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
        if let Some(e) = body_mismatch(&self.cfg, &other.cfg) {
            return Err(e);
        }
        // The pre-trained ranks first, so that every tensor has its shape.
        self.take_ranks(other)?;
        self.copy_body(other)
    }

    /// Also takes `other`'s head (after [`Encoder::init_body_from`]): continued training of a
    /// classifier on the same labels. The heads must have the same layout.
    pub fn init_head_from(&mut self, other: &Encoder) -> Result<(), ConfigError> {
        if self.cfg.head != other.cfg.head || self.cfg.num_labels != other.cfg.num_labels {
            return Err(ConfigError {
                field: "model.head".into(),
                msg: "differs from the pre-trained model's head (kind or labels)".into(),
            });
        }
        let theirs: HashMap<&str, &Param> = other
            .head
            .params()
            .into_iter()
            .map(|p| (p.name.as_str(), p))
            .collect();
        // Every parameter checked before any is copied: a head of another layout (TT against
        // dense) is refused whole, never half-copied.
        for p in self.head.params() {
            match theirs.get(p.name.as_str()) {
                Some(q) if q.shape == p.shape => {}
                Some(q) => {
                    return Err(ConfigError {
                        field: p.name.clone(),
                        msg: format!(
                            "pre-trained shape {:?}, this model's {:?}",
                            q.shape, p.shape
                        ),
                    })
                }
                None => {
                    return Err(ConfigError {
                        field: p.name.clone(),
                        msg: "missing from the pre-trained model's head".into(),
                    })
                }
            }
        }
        self.head.visit_params_mut(&mut |p| {
            p.value.copy_from_slice(&theirs[p.name.as_str()].value);
        });
        Ok(())
    }

    /// Sets every TT/TTM layer to the ranks of `other`'s layer of the same name.
    fn take_ranks(&mut self, other: &Encoder) -> Result<(), ConfigError> {
        let mut ranks = HashMap::new();
        other.visit_compressible(&mut |l| {
            ranks.insert(l.layer_name().to_string(), l.ranks());
        });
        let mut err: Option<ConfigError> = None;
        self.visit_compressible_mut(&mut |l| match ranks.get(l.layer_name()) {
            Some(r) if *r != l.ranks() => {
                if let Err(e) = l.set_ranks(r) {
                    err.get_or_insert(ConfigError {
                        field: l.layer_name().to_string(),
                        msg: e.to_string(),
                    });
                }
            }
            _ => {}
        });
        err.map_or(Ok(()), Err)
    }

    /// Copies `other`'s body parameters (all but the head's) into this model's.
    fn copy_body(&mut self, other: &Encoder) -> Result<(), ConfigError> {
        let head: Vec<&str> = other
            .head
            .params()
            .iter()
            .map(|p| p.name.as_str())
            .collect();
        let theirs: HashMap<&str, &Param> = other
            .params()
            .into_iter()
            .filter(|p| !head.contains(&p.name.as_str()))
            .map(|p| (p.name.as_str(), p))
            .collect();
        let mut err: Option<ConfigError> = None;
        self.visit_body_params_mut(&mut |p| {
            if err.is_none() {
                err = copy_param(p, theirs.get(p.name.as_str()).copied()).err();
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
            for l in b.linears_mut() {
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

    /// Every gradient to zero, over the parallel visit (large ones in parallel chunks too).
    pub fn zero_grad(&mut self) {
        self.visit_params_par(&|_, p| comera_layers::elementwise::zero(&mut p.grad));
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

    /// What block `l` reads besides its layers and state, for a pass at `step`.
    fn block_cx<'a>(&'a self, l: usize, mask: &'a [u8], train: bool, step: u64) -> BlockCx<'a> {
        BlockCx {
            attn: &self.attn,
            drop_attn: &self.drop_attn[l],
            drop_ffn: &self.drop_ffn[l],
            d: self.cfg.d_model,
            f: self.cfg.ffn,
            mask,
            train,
            step,
        }
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
        self.embeddings_forward(st, train, step)?;
        // A classifier's last block on the [CLS] rows when training.
        st.last_cls = train && st.plan.cls_rows;
        for l in 0..self.blocks.len() {
            self.forward_block(l, st, train, step);
        }
        self.last_hidden(st);
        let hidden = hidden_of(&st.acts, &st.outs, &st.x_final);
        let stats = self
            .head
            .forward(&mut st.head, &self.word, hidden, st.t, train, step);
        Ok(if train {
            self.distill_forward(st, stats)
        } else {
            stats
        })
    }

    /// x0 = Dropout(LN(word[ids] + pos[t] + type[types])).
    fn embeddings_forward(
        &self,
        st: &mut EncoderState,
        train: bool,
        step: u64,
    ) -> Result<(), EmbeddingError> {
        let tmp = &mut st.sc.rows.t[0];
        self.word.forward(&mut st.ws_word, &st.ids, &mut st.emb)?;
        self.pos.forward(&mut st.ws_pos, &st.pos_ids, tmp)?;
        add_into(&mut st.emb, tmp);
        self.types.forward(&mut st.ws_type, &st.types, tmp)?;
        add_into(&mut st.emb, tmp);
        self.ln_emb.forward(&mut st.ws_ln_emb, &st.emb, &mut st.x0);
        self.drop_emb
            .forward_in_place(&mut st.ws_drop_emb, step, train, &mut st.x0);
        Ok(())
    }

    /// Block `l`'s forward on all rows, or on the [CLS] rows (the last block, training).
    fn forward_block(&self, l: usize, st: &mut EncoderState, train: bool, step: u64) {
        let rec = st.plan.recompute;
        let (x, a) = block_io(&st.x0, &st.outs, &mut st.acts, l, rec);
        let mut rows = match &mut st.cls {
            Some(c) if st.last_cls && l + 1 == self.blocks.len() => Rows::Cls(c),
            _ => Rows::All,
        };
        let cx = self.block_cx(l, &st.mask, train, step);
        block_forward(
            &cx,
            &self.blocks[l],
            x,
            &mut st.blocks[l],
            a,
            &mut rows,
            &mut st.sc,
        );
        if rec && matches!(rows, Rows::All) {
            // Keep only the block's output (the next block's input).
            std::mem::swap(&mut st.acts[0].rows.out, &mut st.outs[l]);
        }
    }

    /// The last hidden states from the last block's output: the final LN (pre-LN), and after a
    /// [CLS]-rows block its rows put where the head reads them.
    fn last_hidden(&self, st: &mut EncoderState) {
        let (d, t, last) = (self.cfg.d_model, st.t, self.blocks.len() - 1);
        let c = match &mut st.cls {
            Some(c) if st.last_cls => c,
            _ => {
                if let Some(ln) = &self.ln_final {
                    let out = last_out(&st.acts, &st.outs);
                    ln.forward(&mut st.ws_ln_final, out, &mut st.x_final);
                }
                return;
            }
        };
        let (rows, full) = match &self.ln_final {
            Some(ln) => {
                ln.forward(&mut c.ws_ln_final, &c.acts.out, &mut c.hidden);
                (&c.hidden, &mut st.x_final)
            }
            None if st.plan.recompute => (&c.acts.out, &mut st.outs[last]),
            None => (&c.acts.out, &mut st.acts[last].rows.out),
        };
        set_first_rows(rows, t, d, full);
    }

    /// Backward of the last training forward: accumulates every parameter's gradient.
    pub fn backward(&mut self, st: &mut EncoderState) {
        let dims = (st.t, self.cfg.d_model);
        self.head
            .backward(&mut st.head, &mut self.word, dims, &mut st.sc.rows.d);
        self.last_hidden_backward(st);
        // Blocks, last to first: `sc.rows.d` holds ∂L/∂out on entry and ∂L/∂x on exit (plus a
        // teacher's hidden-state terms, added as the gradient passes each hidden state).
        for l in (0..self.blocks.len()).rev() {
            self.distill_backward(st, l + 1);
            self.backward_block(l, st);
        }
        self.distill_backward(st, 0);
        self.embeddings_backward(st);
    }

    /// From ∂L/∂H in `sc.rows.d` to ∂L/∂(the last block's output): there, or in the [CLS]
    /// rows' own `sc.d` after a [CLS]-rows forward; through the final LN (pre-LN).
    fn last_hidden_backward(&mut self, st: &mut EncoderState) {
        let (d, t) = (self.cfg.d_model, st.t);
        if let (true, Some(c)) = (st.last_cls, &mut st.cls) {
            first_rows(&st.sc.rows.d, t, d, &mut c.sc.d);
            if let Some(ln) = &mut self.ln_final {
                let [_, tmp, _] = &mut c.sc.t;
                ln.backward(&mut c.ws_ln_final, &c.acts.out, &c.sc.d, Some(tmp));
                std::mem::swap(&mut c.sc.d, tmp);
            }
        } else if let Some(ln) = &mut self.ln_final {
            let out = last_out(&st.acts, &st.outs);
            let (dy, tmp) = (&mut st.sc.rows.d, &mut st.sc.rows.t[0]);
            ln.backward(&mut st.ws_ln_final, out, dy, Some(tmp));
            std::mem::swap(dy, tmp);
        }
    }

    /// Block `l`'s backward (its forward again first, with recomputation).
    fn backward_block(&mut self, l: usize, st: &mut EncoderState) {
        let rec = st.plan.recompute;
        let (x, a) = block_io(&st.x0, &st.outs, &mut st.acts, l, rec);
        let mut rows = match &mut st.cls {
            Some(c) if st.last_cls && l + 1 == self.blocks.len() => Rows::Cls(c),
            _ => Rows::All,
        };
        let cx = BlockCx {
            attn: &self.attn,
            drop_attn: &self.drop_attn[l],
            drop_ffn: &self.drop_ffn[l],
            d: self.cfg.d_model,
            f: self.cfg.ffn,
            mask: &st.mask,
            train: true,
            step: st.step,
        };
        let (blk, s) = (&mut self.blocks[l], &mut st.blocks[l]);
        if rec {
            // The block's activations again from its input: the same layers, the same dropout
            // masks (seeded by step), so the same values as the forward's.
            block_forward(&cx, blk, x, s, a, &mut rows, &mut st.sc);
        }
        block_backward(&cx, blk, x, s, a, &mut rows, &mut st.sc);
    }

    /// The embeddings' gradients from ∂L/∂x0 in `sc.rows.d`.
    fn embeddings_backward(&mut self, st: &mut EncoderState) {
        let (dx0, [demb, ..]) = (&mut st.sc.rows.d, &mut st.sc.rows.t);
        self.drop_emb.backward_in_place(&st.ws_drop_emb, dx0);
        self.ln_emb
            .backward(&mut st.ws_ln_emb, &st.emb, dx0, Some(demb));
        self.word.backward(&mut st.ws_word, &st.ids, demb);
        self.pos.backward(&mut st.ws_pos, &st.pos_ids, demb);
        self.types.backward(&mut st.ws_type, &st.types, demb);
    }
}

/// p ← q (a pre-trained parameter of the same name): same shape, or the first rows of a
/// longer position table.
fn copy_param(p: &mut Param, q: Option<&Param>) -> Result<(), ConfigError> {
    let err = |msg: String| ConfigError {
        field: p.name.clone(),
        msg,
    };
    match q {
        Some(q) if q.shape == p.shape => p.value.copy_from_slice(&q.value),
        Some(q) if p.name == "embeddings.position.weight" && q.shape[1] == p.shape[1] => {
            let len = p.value.len();
            p.value.copy_from_slice(&q.value[..len]);
        }
        Some(q) => {
            return Err(err(format!(
                "pre-trained shape {:?}, this model's {:?}",
                q.shape, p.shape
            )))
        }
        None => return Err(err("missing from the pre-trained encoder".into())),
    }
    Ok(())
}

/// Visits `blocks`' parameters, the first at place `first`, halves of the blocks as rayon
/// tasks; returns how many there were.
fn visit_blocks_par(
    blocks: &mut [Block],
    first: usize,
    f: &(dyn Fn(usize, &mut Param) + Sync),
) -> usize {
    match blocks {
        [] => 0,
        [block] => {
            let mut next = first;
            block.visit_params_mut(&mut numbered(f, &mut next));
            next - first
        }
        _ => {
            let (a, b) = blocks.split_at_mut(blocks.len() / 2);
            let mut in_a = 0;
            a.iter_mut()
                .for_each(|blk| blk.visit_params_mut(&mut |_| in_a += 1));
            let (na, nb) = comera_tensor::join(
                || visit_blocks_par(a, first, f),
                || visit_blocks_par(b, first + in_a, f),
            );
            na + nb
        }
    }
}
