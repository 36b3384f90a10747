//! The paths a block takes, chosen once for a state's row count instead of at every call.
//!
//! - LayerNorm placement: post-LN (BERT) or pre-LN, from the config;
//! - q, k, v: one fused TT product into `qkv` ([q | k | v]), or three layers one by one;
//! - the FFN: Up → bias + GELU → Down fused in row blocks (no N × F buffer), or the three one
//!   by one, keeping g = GELU(h) for the backward at few rows ([`KEEP_GELU_MAX_ROWS`]) or
//!   recomputing it there;
//! - for the whole stack ([`EncoderPlan`]): whether blocks are recomputed in the backward, and
//!   whether a classifier's training forwards run the last block past q/k/v on the [CLS] rows
//!   only.
//!
//! The fused paths are planned by comera-layers' planner for the layers' TT shapes. A rank
//! change (training truncates ranks) gives the layers new shapes; [`BlockPlan::refresh`], at
//! the top of each block forward, compares shapes and plans again only then, and the backward
//! follows what its forward took.

use super::block::Block;
use comera_layers::any::AnyLinear;
use comera_layers::tt_linear::{FusedFfn, SharedInput};
use comera_layers::TtLinear;
use comera_tensor::TtShape;

/// Rows up to which a block off the fused FFN path keeps g = GELU(h) (N × F) from its forward
/// beside GELU'(h), so that its backward evaluates no GELU: at most one row block of the fused
/// path (whose own g never exceeds that). Measured with `comera bench step --batch 1` on the
/// paper model (128 rows; six runs each, interleaved): step median 44.8 → 43.0 ms, peak RSS
/// 88.5 → 96.3 MiB (1.5 MB per block, less the shared g scratch). Above it the fused path,
/// or the memory, wins.
pub const KEEP_GELU_MAX_ROWS: usize = 128;

/// Whether a block off the fused FFN path keeps GELU(h) at `rows` rows.
pub(super) fn keeps_gelu(rows: usize) -> bool {
    rows <= KEEP_GELU_MAX_ROWS
}

/// The stack's choices: fixed when the state is built.
#[derive(Clone, Copy, Debug)]
pub(super) struct EncoderPlan {
    /// Keep only each block's output in the forward; rebuild its activations in the backward.
    pub recompute: bool,
    /// A classifier's training forward runs the last block past q/k/v on the [CLS] rows only
    /// (see `ClsRows`).
    pub cls_rows: bool,
}

/// A fused path's workspace and the TT shapes it was planned for.
#[derive(Debug)]
pub(super) struct Fused<W> {
    /// `None`: the planner chose the layers one by one (or they are not all TT).
    ws: Option<W>,
    shapes: Vec<TtShape>,
    /// The path the block takes: planned, and applicable to the layers as they are.
    on: bool,
}

impl<W> Fused<W> {
    fn off() -> Fused<W> {
        Fused {
            ws: None,
            shapes: Vec::new(),
            on: false,
        }
    }

    fn planned(ws: Option<W>, layers: &[&TtLinear]) -> Fused<W> {
        Fused {
            ws,
            shapes: layers.iter().map(|l| l.shape().clone()).collect(),
            on: false,
        }
    }

    /// The workspace when the block takes this path.
    pub fn on(&mut self) -> Option<&mut W> {
        self.ws.as_mut().filter(|_| self.on)
    }

    pub fn ws(&self) -> Option<&W> {
        self.ws.as_ref()
    }

    /// Plans again (with `plan`) if `layers` changed shape since, then decides whether the
    /// block takes the path.
    fn refresh(
        &mut self,
        layers: &[&TtLinear],
        plan: impl FnOnce(&[&TtLinear]) -> Option<W>,
        applies: impl Fn(&W, &[&TtLinear]) -> bool,
    ) {
        let same = self.shapes.len() == layers.len()
            && self.shapes.iter().zip(layers).all(|(s, l)| s == l.shape());
        if !same {
            *self = Fused::planned(plan(layers), layers);
        }
        self.on = self.ws.as_ref().is_some_and(|w| applies(w, layers));
    }
}

/// How one block runs at a fixed row count N.
#[derive(Debug)]
pub(super) struct BlockPlan {
    /// Pre-LN: l1 = LN1(x) feeds q/k/v and LN2 normalises the FFN input (else post-LN).
    pub pre_ln: bool,
    /// Off the fused FFN: keep g = GELU(h) from the forward (else the backward recomputes it).
    pub keep_gelu: bool,
    /// q, k, v as one fused TT product.
    pub qkv: Fused<SharedInput>,
    /// Up → GELU → Down fused in row blocks.
    pub ffn: Fused<FusedFfn>,
}

/// The TT layers of `ls`, if all are TT (without allocating: called every forward).
fn all_tt<const K: usize>(ls: [&AnyLinear; K]) -> Option<[&TtLinear; K]> {
    let tt = ls.map(|l| match l {
        AnyLinear::Tt(t) => Some(t),
        _ => None,
    });
    tt.iter()
        .all(Option::is_some)
        .then(|| tt.map(Option::unwrap))
}

impl BlockPlan {
    /// The planner's choices for `blk` at `rows` rows.
    pub fn new(blk: &Block, pre_ln: bool, rows: usize) -> BlockPlan {
        let mut plan = BlockPlan {
            pre_ln,
            keep_gelu: keeps_gelu(rows),
            qkv: Fused::off(),
            ffn: Fused::off(),
        };
        if let Some(l) = all_tt([&blk.q, &blk.k, &blk.v]) {
            plan.qkv = Fused::planned(SharedInput::new(&l, rows), &l);
        }
        if let Some([up, down]) = all_tt([&blk.up, &blk.down]) {
            plan.ffn = Fused::planned(FusedFfn::new(up, down, rows), &[up, down]);
        }
        plan
    }

    /// The [CLS] rows' plan: the row-wise layers one by one, GELU kept (B rows).
    pub fn cls_rows(pre_ln: bool) -> BlockPlan {
        BlockPlan {
            pre_ln,
            keep_gelu: true,
            qkv: Fused::off(),
            ffn: Fused::off(),
        }
    }

    /// Follows a rank change of `blk`'s layers (plans again at `rows` rows only if a shape
    /// changed) and decides the fused paths of the next forward and its backward.
    pub fn refresh(&mut self, blk: &Block, rows: usize) {
        match all_tt([&blk.q, &blk.k, &blk.v]) {
            Some(l) => self
                .qkv
                .refresh(&l, |l| SharedInput::new(l, rows), |w, l| w.applies(l)),
            None => self.qkv.on = false,
        }
        match all_tt([&blk.up, &blk.down]) {
            Some(l) => self.ffn.refresh(
                &l,
                |l| FusedFfn::new(l[0], l[1], rows),
                |w, l| w.applies(l[0], l[1]),
            ),
            None => self.ffn.on = false,
        }
    }

    /// Fuses q/k/v whatever the planner chose (tests). Returns whether it could.
    pub fn force_fused_qkv(&mut self, blk: &Block, rows: usize) -> bool {
        let Some(l) = all_tt([&blk.q, &blk.k, &blk.v]) else {
            return false;
        };
        self.qkv.ws = SharedInput::new_unplanned(&l, rows);
        self.qkv.ws.is_some()
    }

    /// Fuses the FFN whatever the planner chose (tests). Returns whether it could.
    pub fn force_fused_ffn(&mut self, blk: &Block, rows: usize) -> bool {
        let Some([up, down]) = all_tt([&blk.up, &blk.down]) else {
            return false;
        };
        self.ffn.ws = FusedFfn::new_unplanned(up, down, rows);
        self.ffn.ws.is_some()
    }
}
