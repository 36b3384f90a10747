//! Everything a step of an [`Encoder`] needs for a fixed (batch, seq_len), allocated once when
//! the state is built: inputs, activations, gradient scratch, layer workspaces and the plan
//! ([`super::plan`]) the blocks follow. A steady-state training step allocates nothing.
//!
//! Shapes: B sequences of T tokens, N = B·T rows, width D, FFN width F, H heads.

use super::block::Block;
use super::head::{Head, HeadState};
use super::plan::{BlockPlan, EncoderPlan};
use super::Encoder;
use comera_layers::any::{AnyEmbedding, AnyEmbeddingWorkspace, AnyLinear, AnyLinearWorkspace};
use comera_layers::attention::{Attention, AttentionWorkspace};
use comera_layers::dropout::{Dropout, DropoutWorkspace};
use comera_layers::embedding::EmbeddingWorkspace;
use comera_layers::norm::{LayerNorm, LayerNormWorkspace};
use comera_layers::tt_linear::{FusedFfn, SharedInput};
use comera_layers::{EmbeddingLayer, Layer};

/// A batch that does not fit the state or the model's head (see [`EncoderState::load`] and
/// [`EncoderState::load_mlm`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    #[error("{what}: {len} values, expected batch × seq_len = {expected}")]
    Length {
        what: &'static str,
        len: usize,
        expected: usize,
    },
    #[error("labels: {len} values, expected batch = {batch}")]
    Labels { len: usize, batch: usize },
    #[error("labels: this model has an MLM head; load batches with load_mlm")]
    MlmHead,
    #[error("this model has a classifier head; load batches with load")]
    ClassifierHead,
    #[error("{selected} labelled positions, the MLM head has room for {room}")]
    TooManySelected { selected: usize, room: usize },
    #[error("selected positions not ascending: {first} then {then}")]
    NotAscending { first: u32, then: u32 },
    #[error("selected position {position} outside 0..{n}")]
    OutOfRange { position: u32, n: usize },
}

/// A classifier batch as the state holds it ([`EncoderState::classifier_batch`]).
#[derive(Clone, Copy, Debug)]
pub struct ClassifierBatch<'a> {
    pub ids: &'a [u32],    // B × T
    pub types: &'a [u32],  // B × T
    pub mask: &'a [u8],    // B × T: 1 = real token
    pub labels: &'a [i32], // B
}

/// A loaded masked-LM batch as a step engine on another device takes it
/// ([`EncoderState::mlm_batch`]).
pub struct MlmBatch<'a> {
    pub ids: &'a [u32],          // B × T: the masked ids
    pub mask: &'a [u8],          // B × T: 1 = real token
    pub token_labels: &'a [i32], // B × T: the label of each token, or IGNORE_INDEX
    pub selected: &'a [u32],     // the predicted positions, ascending
}

/// Everything a step of an [`Encoder`] needs for a fixed (batch, seq_len).
#[derive(Debug)]
pub struct EncoderState {
    pub(super) b: usize,
    pub(super) t: usize,
    pub(super) n: usize,
    pub(super) ids: Vec<u32>,     // N
    pub(super) types: Vec<u32>,   // N
    pub(super) pos_ids: Vec<u32>, // N: t of each row
    pub(super) mask: Vec<u8>,     // N: 1 = real token
    pub(super) ws_word: AnyEmbeddingWorkspace,
    pub(super) ws_pos: EmbeddingWorkspace,
    pub(super) ws_type: EmbeddingWorkspace,
    pub(super) ws_ln_emb: LayerNormWorkspace,
    pub(super) ws_drop_emb: DropoutWorkspace,
    pub(super) ws_ln_final: LayerNormWorkspace,
    pub(super) emb: Vec<f32>, // N × D: word + position + type
    pub(super) x0: Vec<f32>,  // N × D: the first block's input
    pub(super) plan: EncoderPlan,
    pub(super) blocks: Vec<BlockState>,
    /// One set per block, or one shared set when blocks are recomputed.
    pub(super) acts: Vec<BlockActs>,
    /// With block recomputation: each block's output (N × D), the next block's input.
    pub(super) outs: Vec<Vec<f32>>,
    pub(super) x_final: Vec<f32>, // N × D (pre-LN only): LN_final(last block's output)
    pub(super) head: HeadState,
    pub(super) sc: Scratch,
    /// The step of the last forward (its dropout masks, for recomputation).
    pub(super) step: u64,
    /// Classifier heads: the last block's [CLS] rows, used by training forwards.
    pub(super) cls: Option<ClsRows>,
    /// Whether the last forward ran the last block on the [CLS] rows only.
    pub(super) last_cls: bool,
    /// A frozen teacher that training forwards distil from (see `distill.rs`).
    pub(super) teacher: Option<Box<super::Teacher>>,
}

/// Scratch shared by all blocks (N rows).
#[derive(Debug)]
pub(super) struct Scratch {
    /// The row-wise part's; in the forward also q, k, v of unfused blocks (t[0..3]).
    pub rows: RowScratch,
    pub dqkv: Vec<f32>, // [∂L/∂q | ∂L/∂k | ∂L/∂v], N × D each
}

/// Gradient scratch of a block's row-wise part on R rows (its forward's too).
#[derive(Debug)]
pub(super) struct RowScratch {
    pub d: Vec<f32>,      // R × D: the flowing gradient
    pub t: [Vec<f32>; 3], // R × D each
    pub ffn: FfnScratch,
}

/// The unfused FFN's scratch (R × F each; empty until a block takes that path).
#[derive(Debug)]
pub(super) struct FfnScratch {
    pub dg: Vec<f32>, // ∂L/∂g, then ∂L/∂h
    pub g: Vec<f32>,  // GELU(h) of the block being run where it is not kept (recomputed)
}

/// The workspaces of a block's row-wise layers (O, LN1, LN2, Up, Down, the dropouts), R rows.
#[derive(Debug)]
pub(super) struct RowWs {
    pub o: AnyLinearWorkspace,
    pub up: AnyLinearWorkspace,
    pub down: AnyLinearWorkspace,
    pub ln1: LayerNormWorkspace,
    pub ln2: LayerNormWorkspace,
    pub drop_attn: DropoutWorkspace,
    pub drop_ffn: DropoutWorkspace,
}

/// One block's plan and layer workspaces.
#[derive(Debug)]
pub struct BlockState {
    pub(super) plan: BlockPlan,
    pub(super) ws_qkv: [AnyLinearWorkspace; 3],
    pub(super) ws_attn: AttentionWorkspace,
    /// N rows; `rows.ln1` is also LN1's on the attention input (pre-LN).
    pub(super) rows: RowWs,
}

/// One block's saved activations (N rows).
#[derive(Debug)]
pub(super) struct BlockActs {
    pub ln1_x: Vec<f32>, // N × D (pre-LN only): LN1(x), the attention input
    pub qkv: Vec<f32>,   // [q | k | v], N × D each
    pub rows: RowActs,
}

/// The row-wise part's saved activations (R rows).
#[derive(Debug)]
pub(super) struct RowActs {
    pub att: Vec<f32>, // R × D: the attention context
    pub r1: Vec<f32>,  // R × D: x + Dropout(O(att))
    pub x1: Vec<f32>,  // R × D: the FFN input, LN1(r1) (post-LN) or LN2(r1) (pre-LN)
    pub h: Vec<f32>,   // R × F (unfused FFN only): h, or GELU'(h) where g is kept
    pub g: Vec<f32>,   // R × F (unfused FFN, GELU kept only): GELU(h)
    pub r2: Vec<f32>,  // R × D (post-LN only): x1 + f
    pub out: Vec<f32>, // R × D
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
///
/// These are the row-wise part's buffers on B rows; the block's code is the same
/// (`block::Rows::Cls`).
#[derive(Debug)]
pub(super) struct ClsRows {
    pub seq_len: usize,
    /// The row-wise layers one by one, GELU kept.
    pub plan: BlockPlan,
    pub ws: RowWs,
    pub ws_ln_final: LayerNormWorkspace,
    pub allow: Vec<f32>,  // B × T: 1 for a real token, 0 for padding
    pub probs: Vec<f32>,  // B × H × T: the first rows' attention probabilities
    pub x: Vec<f32>,      // B × D: the block input's first rows (the residual)
    pub acts: RowActs,    // B rows
    pub hidden: Vec<f32>, // B × D: LN_final(out) (pre-LN)
    pub sc: RowScratch,   // B rows; sc.d = ∂L/∂(the last hidden rows) to start the backward
    pub dattn: Vec<f32>,  // B × H × T: the attention backward's scratch
}

fn zeros(len: usize) -> Vec<f32> {
    vec![0.0; len]
}

fn f32_bytes<'a>(vs: impl IntoIterator<Item = &'a Vec<f32>>) -> usize {
    vs.into_iter().map(|v| 4 * v.capacity()).sum()
}

impl RowWs {
    fn new(blk: &Block, drops: [&Dropout; 2], rows: usize, d: usize) -> RowWs {
        RowWs {
            o: blk.o.workspace(rows),
            up: blk.up.workspace(rows),
            down: blk.down.workspace(rows),
            ln1: blk.ln1.workspace(rows),
            ln2: blk.ln2.workspace(rows),
            drop_attn: drops[0].workspace(rows * d),
            drop_ffn: drops[1].workspace(rows * d),
        }
    }

    fn bytes(&self) -> usize {
        [&self.o, &self.up, &self.down]
            .into_iter()
            .map(AnyLinear::workspace_bytes)
            .sum()
    }
}

impl RowActs {
    /// R rows; h (and g, if kept) only for an unfused FFN; r2 only post-LN.
    fn new(
        rows: usize,
        d: usize,
        f: usize,
        pre_ln: bool,
        unfused: bool,
        keep_gelu: bool,
    ) -> RowActs {
        let if_ = |on: bool, len: usize| if on { zeros(len) } else { Vec::new() };
        RowActs {
            att: zeros(rows * d),
            r1: zeros(rows * d),
            x1: zeros(rows * d),
            h: if_(unfused, rows * f),
            g: if_(unfused && keep_gelu, rows * f),
            r2: if_(!pre_ln, rows * d),
            out: zeros(rows * d),
        }
    }

    fn bytes(&self) -> usize {
        f32_bytes([
            &self.att, &self.r1, &self.x1, &self.h, &self.g, &self.r2, &self.out,
        ])
    }
}

impl RowScratch {
    fn new(rows: usize, d: usize) -> RowScratch {
        RowScratch {
            d: zeros(rows * d),
            t: [zeros(rows * d), zeros(rows * d), zeros(rows * d)],
            ffn: FfnScratch {
                dg: Vec::new(),
                g: Vec::new(),
            },
        }
    }

    fn bytes(&self) -> usize {
        f32_bytes([&self.d, &self.ffn.dg, &self.ffn.g]) + f32_bytes(&self.t)
    }
}

impl BlockState {
    fn new(m: &Encoder, l: usize, b: usize, t: usize) -> BlockState {
        let (blk, n, d) = (&m.blocks[l], b * t, m.cfg.d_model);
        BlockState {
            plan: BlockPlan::new(blk, m.cfg.pre_ln, n),
            ws_qkv: [blk.q.workspace(n), blk.k.workspace(n), blk.v.workspace(n)],
            // Above a few MiB, P is rebuilt in the backward from q, k (one extra q·kᵀ per
            // head) rather than kept: B·H·T² floats per block.
            ws_attn: m.attn.workspace_for(b, t),
            rows: RowWs::new(blk, [&m.drop_attn[l], &m.drop_ffn[l]], n, d),
        }
    }

    fn bytes(&self) -> usize {
        let qkv: usize = self.ws_qkv.iter().map(AnyLinear::workspace_bytes).sum();
        qkv + self.rows.bytes()
            + self.plan.qkv.ws().map_or(0, SharedInput::bytes)
            + self.plan.ffn.ws().map_or(0, FusedFfn::bytes)
            + Attention::workspace_bytes(&self.ws_attn)
    }
}

impl BlockActs {
    fn new(n: usize, d: usize, f: usize, pre_ln: bool, unfused: bool) -> BlockActs {
        BlockActs {
            ln1_x: if pre_ln { zeros(n * d) } else { Vec::new() },
            qkv: zeros(3 * n * d),
            rows: RowActs::new(n, d, f, pre_ln, unfused, super::plan::keeps_gelu(n)),
        }
    }

    fn bytes(&self) -> usize {
        f32_bytes([&self.ln1_x, &self.qkv]) + self.rows.bytes()
    }
}

impl ClsRows {
    fn new(m: &Encoder, b: usize, t: usize) -> ClsRows {
        let (d, f, l) = (m.cfg.d_model, m.cfg.ffn, m.blocks.len() - 1);
        let blk = &m.blocks[l];
        let mut sc = RowScratch::new(b, d);
        sc.ffn.dg = zeros(b * f);
        ClsRows {
            seq_len: t,
            plan: BlockPlan::cls_rows(m.cfg.pre_ln),
            ws: RowWs::new(blk, [&m.drop_attn[l], &m.drop_ffn[l]], b, d),
            ws_ln_final: match &m.ln_final {
                Some(ln) => ln.workspace(b),
                None => blk.ln2.workspace(0),
            },
            allow: zeros(b * t),
            probs: zeros(m.attn.first_probs_len(b, t)),
            x: zeros(b * d),
            acts: RowActs::new(b, d, f, m.cfg.pre_ln, true, true),
            hidden: zeros(b * d),
            sc,
            dattn: zeros(m.attn.first_probs_len(b, t)),
        }
    }

    fn bytes(&self) -> usize {
        f32_bytes([&self.allow, &self.probs, &self.x, &self.hidden, &self.dattn])
            + self.acts.bytes()
            + self.sc.bytes()
            + self.ws.bytes()
    }
}

impl EncoderState {
    pub(super) fn new(m: &Encoder, b: usize, t: usize, mlm_rows_per_seq: usize) -> EncoderState {
        let c = &m.cfg;
        let (d, f, n) = (c.d_model, c.ffn, b * t);
        let blocks: Vec<BlockState> = (0..c.layers).map(|l| BlockState::new(m, l, b, t)).collect();
        let mut sc = Scratch {
            rows: RowScratch::new(n, d),
            dqkv: zeros(3 * n * d),
        };
        let unfused = blocks.iter().any(|s| s.plan.ffn.ws().is_none());
        if unfused {
            sc.rows.ffn.dg = zeros(n * f);
            if !super::plan::keeps_gelu(n) {
                sc.rows.ffn.g = zeros(n * f);
            }
        }
        let plan = EncoderPlan {
            recompute: c.recompute_blocks,
            cls_rows: matches!(m.head, Head::Classifier(_)),
        };
        let sets = if plan.recompute { 1 } else { c.layers };
        let ln_final = m
            .ln_final
            .clone()
            .unwrap_or_else(|| LayerNorm::new("unused", d));
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
            emb: zeros(n * d),
            x0: zeros(n * d),
            blocks,
            acts: (0..sets)
                .map(|_| BlockActs::new(n, d, f, c.pre_ln, unfused))
                .collect(),
            outs: if plan.recompute {
                (0..c.layers).map(|_| zeros(n * d)).collect()
            } else {
                Vec::new()
            },
            x_final: if c.pre_ln { zeros(n * d) } else { Vec::new() },
            cls: plan.cls_rows.then(|| ClsRows::new(m, b, t)),
            plan,
            last_cls: false,
            teacher: None,
            head: HeadState::new(&m.head, b, t, d, c.num_labels, mlm_rows_per_seq),
            sc,
            step: 0,
        }
    }

    /// Fuses every TT block's q/k/v whatever the planner chose (tests: the fused path on
    /// shapes too small for the planner to pick it). Returns the number of fused blocks.
    #[doc(hidden)]
    pub fn force_fused_qkv(&mut self, m: &Encoder) -> usize {
        let n = self.n;
        let blocks = m.blocks.iter().zip(&mut self.blocks);
        blocks
            .map(|(blk, s)| s.plan.force_fused_qkv(blk, n) as usize)
            .sum()
    }

    /// Fuses every TT block's Up → GELU → Down whatever the planner chose (tests, as
    /// [`EncoderState::force_fused_qkv`]). Returns the number of fused blocks.
    #[doc(hidden)]
    pub fn force_fused_ffn(&mut self, m: &Encoder) -> usize {
        let n = self.n;
        let blocks = m.blocks.iter().zip(&mut self.blocks);
        blocks
            .map(|(blk, s)| s.plan.force_fused_ffn(blk, n) as usize)
            .sum()
    }

    /// Runs a classifier's last block on every row in training too (tests: the [CLS]-rows
    /// block against the full one).
    #[doc(hidden)]
    pub fn full_last_block(&mut self) {
        self.plan.cls_rows = false;
        self.cls = None;
    }

    /// Number of sequences per step.
    pub fn batch(&self) -> usize {
        self.b
    }

    /// Sequence length T of this state.
    pub fn seq_len(&self) -> usize {
        self.t
    }

    /// A masked-LM head's predicted positions per sequence at most (its R / B: the
    /// `mlm_rows_per_seq` that [`super::Encoder::state_for`] was given, capped at T); 0 for a
    /// classifier.
    pub fn mlm_rows_per_seq(&self) -> usize {
        match &self.head {
            HeadState::Mlm(h) => h.rows() / self.b.max(1),
            HeadState::Classifier(_) => 0,
        }
    }

    /// The classifier batch loaded last ([`EncoderState::load`]); `None` for a masked-LM
    /// state. A step engine on another device takes its batch from here.
    pub fn classifier_batch(&self) -> Option<ClassifierBatch<'_>> {
        match &self.head {
            HeadState::Classifier(h) => Some(ClassifierBatch {
                ids: &self.ids,
                types: &self.types,
                mask: &self.mask,
                labels: &h.labels,
            }),
            HeadState::Mlm(_) => None,
        }
    }

    /// The masked-LM batch loaded last (None for a classifier's state).
    pub fn mlm_batch(&self) -> Option<MlmBatch<'_>> {
        match &self.head {
            HeadState::Mlm(h) => Some(MlmBatch {
                ids: &self.ids,
                mask: &self.mask,
                token_labels: &h.token_labels,
                selected: &h.selected,
            }),
            HeadState::Classifier(_) => None,
        }
    }

    /// Copies one batch in: ids, token types and attention mask (batch × seq_len each, mask
    /// 1 = real token) and one label per sequence. Lengths are checked.
    pub fn load(
        &mut self,
        ids: &[u32],
        types: &[u32],
        mask: &[u32],
        labels: &[usize],
    ) -> Result<(), BatchError> {
        self.check_lens([
            ("input_ids", ids.len()),
            ("token_type_ids", types.len()),
            ("attention_mask", mask.len()),
        ])?;
        let HeadState::Classifier(h) = &mut self.head else {
            return Err(BatchError::MlmHead);
        };
        if labels.len() != self.b {
            return Err(BatchError::Labels {
                len: labels.len(),
                batch: self.b,
            });
        }
        for (l, &v) in h.labels.iter_mut().zip(labels) {
            *l = v as i32;
        }
        self.ids.copy_from_slice(ids);
        self.types.copy_from_slice(types);
        self.set_mask(mask);
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
    ) -> Result<(), BatchError> {
        let n = self.n;
        let HeadState::Mlm(h) = &self.head else {
            return Err(BatchError::ClassifierHead);
        };
        self.check_lens([
            ("input_ids", ids.len()),
            ("attention_mask", mask.len()),
            ("labels", labels.len()),
        ])?;
        if selected.len() > h.rows() {
            let (selected, room) = (selected.len(), h.rows());
            return Err(BatchError::TooManySelected { selected, room });
        }
        if let Some(w) = selected.windows(2).find(|w| w[0] >= w[1]) {
            let (first, then) = (w[0], w[1]);
            return Err(BatchError::NotAscending { first, then });
        }
        if let Some(&position) = selected.iter().find(|&&s| s as usize >= n) {
            return Err(BatchError::OutOfRange { position, n });
        }
        self.ids.copy_from_slice(ids);
        self.types.fill(0);
        self.set_mask(mask);
        let HeadState::Mlm(h) = &mut self.head else {
            unreachable!("checked above")
        };
        h.token_labels.copy_from_slice(labels);
        h.selected.clear();
        h.selected.extend_from_slice(selected);
        Ok(())
    }

    /// Every input is batch × seq_len long.
    fn check_lens<const K: usize>(
        &self,
        lens: [(&'static str, usize); K],
    ) -> Result<(), BatchError> {
        match lens.into_iter().find(|&(_, len)| len != self.n) {
            Some((what, len)) => Err(BatchError::Length {
                what,
                len,
                expected: self.n,
            }),
            None => Ok(()),
        }
    }

    fn set_mask(&mut self, mask: &[u32]) {
        for (m, &v) in self.mask.iter_mut().zip(mask) {
            *m = (v != 0) as u8;
        }
    }

    /// The encoder's last hidden states of the last forward, `(batch·seq_len, d_model)`
    /// row-major (after the final LayerNorm for pre-LN models): what BERT calls
    /// `last_hidden_state`. After a training forward of a classifier only the \[CLS\] rows
    /// (b·seq_len) are computed (see `ClsRows`); the other rows are stale.
    pub fn hidden(&self) -> &[f32] {
        hidden_of(&self.acts, &self.outs, &self.x_final)
    }

    /// Logits of the last forward: a classifier's `(batch, num_labels)` row-major, or an MLM
    /// head's labelled rows (see [`crate::mlm_head::MlmHeadState::logits`]).
    pub fn logits(&self) -> &[f32] {
        self.head.logits()
    }

    /// Bytes of activations, gradients scratch and layer workspaces (excluding parameters).
    pub fn bytes(&self) -> usize {
        f32_bytes([&self.emb, &self.x0, &self.x_final])
            + self.head.bytes()
            + self.sc.rows.bytes()
            + f32_bytes([&self.sc.dqkv])
            + AnyEmbedding::workspace_bytes(&self.ws_word)
            + self.acts.iter().map(BlockActs::bytes).sum::<usize>()
            + f32_bytes(&self.outs)
            + self.cls.as_ref().map_or(0, ClsRows::bytes)
            + self.blocks.iter().map(BlockState::bytes).sum::<usize>()
            // The TT layers' scratch, shared through this thread's pool.
            + comera_layers::tt_linear::scratch_pool_bytes()
    }
}

/// The last block's output: its activations' `out`, or with block recomputation the kept
/// output.
pub(super) fn last_out<'a>(acts: &'a [BlockActs], outs: &'a [Vec<f32>]) -> &'a [f32] {
    match outs.last() {
        Some(o) => o,
        None => &acts.last().expect("at least one layer").rows.out,
    }
}

/// The last hidden states: the last block's output, or the final LN's (pre-LN).
pub(super) fn hidden_of<'a>(
    acts: &'a [BlockActs],
    outs: &'a [Vec<f32>],
    x_final: &'a [f32],
) -> &'a [f32] {
    if x_final.is_empty() {
        last_out(acts, outs)
    } else {
        x_final
    }
}

/// Block `l`'s input (the embeddings' output or the previous block's output) and the
/// activation buffers it runs in (its own, or the one shared set with recomputation).
pub(super) fn block_io<'a>(
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
        let x: &[f32] = if l == 0 { x0 } else { &done[l - 1].rows.out };
        (x, &mut rest[0])
    }
}
