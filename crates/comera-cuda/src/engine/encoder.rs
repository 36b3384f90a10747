//! The classifier encoder's training step on the device (post-LN, the paper's model family):
//! a plan built once from a CPU [`Encoder`] for a fixed batch B and sequence length T, every
//! buffer allocated in [`EncoderPlan::new`], and one step queued by
//! [`EncoderPlan::record_step`] as kernel launches and cuBLAS products on the device's stream:
//! no allocation, no host round trip, so the whole step can be captured once
//! ([`crate::Device::capture`]) and replayed. Per step the host only copies the batch and
//! three scalars in ([`EncoderPlan::load`], [`EncoderPlan::set_step`]) and, when it wants
//! them, reads the loss and gradient norm back ([`EncoderPlan::stats`]).
//!
//! It mirrors comera-model's encoder (`encoder/mod.rs`, `block.rs`, `head.rs`) layer for
//! layer, with the same parameter names, dropout seeds and mask indices:
//!
//! ```text
//! x0 = Dropout(LN(word[ids] + pos[t] + type[types]))
//! block l, post-LN (BERT):
//!           q, k, v = Q(x), K(x), V(x) → heads (B, H, T, dh);  P = softmax(s·Q·Kᵀ, padding)
//!           att = merge(P·V);  r1 = x + Dropout(O(att));  x1 = LN1(r1)
//!           r2 = x1 + Dropout(Down(GELU(Up(x1))));  out = LN2(r2)
//! block l, pre-LN:
//!           l1 = LN1(x);  q, k, v from l1;  r1 = x + Dropout(O(att));  x1 = LN2(r1)
//!           out = r1 + Dropout(Down(GELU(Up(x1))));  after the last block, H = LN_final(out)
//! head:     logits = C(Dropout(tanh(P(h_cls))));  L = mean CE
//! ```
//! As on the CPU, the last block runs past q/k/v on the B [CLS] rows only (its attention
//! is computed for every row and its first rows taken: the same values), so its dropout
//! masks are drawn over B·D elements exactly as the CPU draws them.
//!
//! Then the backward (block.rs' formulas), the global gradient norm and clip factor, and one
//! AdamW step over the flat parameter arena (per-group learning rates, gate freezing), all on
//! the device. With the rank schedule on ([`StepConfig::rank`]) the stage's objective is formed
//! between the backward pass and clipping, and the gates are projected after AdamW
//! ([`super::rank`]); a truncation is the host's, followed by a new plan at the new ranks.
//! What the step does not do yet (see docs/gpu.md): a layer whose rank reached 0.

use super::arena::ParamArena;
use super::memory::PlanMemory;
use super::mlm::MlmPlan;
use super::profile;
use super::rank::{DeviceObjective, RankPlan, RankSettings, RankStep};
use super::raw::{self, grid, grid_stride, launch, Blas, Buf, Gemm, BLOCK};
use super::tt::{GateTable, GatedCore, Slot, TtDims, TtLayer};
use crate::device::Device;
use crate::error::{driver, CudaError};
use crate::ops::{self, AdamConsts, AdamTable, Segments, TtmLayout};
use comera_layers::any::{AnyEmbedding, AnyLinear};
use comera_layers::ParamKind;
use comera_model::{Encoder, Head};
use cudarc::cublas::CudaBlas;
use cudarc::driver::LaunchConfig;

/// The optimiser settings of a device step (the CPU's `AdamWConfig` and clipping) and the
/// rank schedule's.
#[derive(Clone, Debug)]
pub struct StepConfig {
    pub lr_cores: f32,
    pub lr_gates: f32,
    pub lr_other: f32,
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Global gradient-norm clipping (0: none).
    pub max_grad_norm: f32,
    /// Rank gates at or below this are frozen (the CPU's `freeze_gates_at`).
    pub freeze_gates_at: Option<f32>,
    /// Whether the rank gates learn. Without the rank schedule they are constants (the CPU's
    /// `RankController::apply` drops ∂/∂gate before clipping): their gradients are zeroed
    /// after the backward, so they take no part in the norm, and AdamW moves them by exactly 0
    /// with zero moments.
    pub train_gates: bool,
    /// The rank schedule (the CPU's active `RankController`), or None. With it the gates
    /// learn (`train_gates` is not read) and `freeze_gates_at` should be the model's τ, as the
    /// CPU's `RankController::attach` sets it.
    pub rank: Option<RankSettings>,
    /// A masked-LM head's rows per sequence (the CPU state's `mlm_rows_per_seq`: the head
    /// has room for B·min(this, T) predicted positions); 0: the CPU's default, 15% of T.
    pub mlm_rows_per_seq: usize,
    /// A plan for the evaluation pass only: the parameter arena holds no gradients or AdamW
    /// moments (a quarter of a training plan's arena), the backward's shared scratch and a TTM
    /// table's slab gradients are not allocated ([`StepConfig::backward_len`]), and a training
    /// step is refused.
    pub forward_only: bool,
}

impl StepConfig {
    /// The authors' transformer settings (SPEC §3) without clipping.
    pub fn paper() -> StepConfig {
        StepConfig {
            lr_cores: 1e-4,
            lr_gates: 1e-3,
            lr_other: 5e-5,
            weight_decay: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            max_grad_norm: 0.0,
            freeze_gates_at: None,
            train_gates: true,
            rank: None,
            mlm_rows_per_seq: 0,
            forward_only: false,
        }
    }

    /// The length to allocate for a buffer of `len` elements that only the backward uses: 0
    /// (one element, an address to pass) in a plan for the forward only, else `len`. The
    /// plan and its memory estimate (`PlanMemory::of`) both size such buffers with it.
    pub fn backward_len(&self, len: usize) -> usize {
        if self.forward_only {
            0
        } else {
            len
        }
    }

    /// R, the rows a masked-LM head has room for at batch `b` × `t`: b·min(rows per
    /// sequence, T), as the CPU state's (`Encoder::state_for`).
    pub fn mlm_rows(&self, b: usize, t: usize) -> usize {
        let per_seq = match self.mlm_rows_per_seq {
            0 => (15 * t).div_ceil(100).max(1),
            k => k,
        };
        b * per_seq.min(t)
    }
}

/// The phases of a training step, in order ([`EncoderPlan::record_step_through`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepPhase {
    /// Gradients zeroed, embeddings, blocks, head.
    Forward,
    /// The cross-entropy and its gradient.
    Loss,
    /// The backward, and the rank objective's gradients (with the schedule).
    Backward,
    /// Gradient norm and clip factor, AdamW, the gates' projection (with the schedule).
    Update,
}

/// What one step reports (read back after the step; reading it waits for the stream).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceStepStats {
    pub loss: f64,
    pub correct: f64,
    pub count: f64,
    pub grad_norm: f64,
    /// The rank schedule's objective (None without it).
    pub objective: Option<DeviceObjective>,
}

/// A linear layer on the device: TT (merged path) or dense.
pub(super) enum Lin {
    Tt(Box<TtLayer>),
    Dense {
        n: usize,
        m: usize,
        rows: usize,
        w: Slot,
        b: Slot,
        partial: Buf<f32>,
    },
}

impl Lin {
    pub(super) fn new(
        dev: &Device,
        arena: &ParamArena,
        l: &AnyLinear,
        name: &str,
        rows: usize,
        tau: f32,
    ) -> Result<Lin, CudaError> {
        let slot = |n: &str| Slot {
            w: arena.w(n),
            g: arena.g(n),
        };
        Ok(match l {
            AnyLinear::Tt(t) => Lin::Tt(Box::new(TtLayer::new(
                dev,
                TtDims::from_shape(t.shape()),
                rows,
                tau,
                slot,
                name,
            )?)),
            AnyLinear::Dense(d) => Lin::dense(dev, arena, d, name, rows)?,
        })
    }

    /// A TT layer's gated cores (none for a dense layer).
    pub(super) fn gated_cores(&self) -> Vec<GatedCore> {
        match self {
            Lin::Tt(t) => t.gated_cores(),
            Lin::Dense { .. } => Vec::new(),
        }
    }

    /// Gated cores of layer `l` as a plan has them ([`Lin::gated_cores`]), before it is built.
    pub(super) fn gated_core_count(l: &AnyLinear) -> usize {
        match l {
            AnyLinear::Tt(t) => t.shape().n_cores() - 1,
            AnyLinear::Dense(_) => 0,
        }
    }

    /// Bytes [`Lin::new`] allocates for layer `l` on `rows` rows.
    pub(super) fn device_bytes(l: &AnyLinear, rows: usize) -> usize {
        match l {
            AnyLinear::Tt(t) => TtLayer::device_bytes(&TtDims::from_shape(t.shape()), rows),
            AnyLinear::Dense(d) => Lin::dense_bytes(d, rows),
        }
    }

    /// Bytes [`Lin::dense`] allocates: the bias gradient's column-sum partials.
    pub(super) fn dense_bytes(l: &comera_layers::Linear, rows: usize) -> usize {
        Buf::<f32>::zeros_bytes(ops::chunks(rows) * l.weight.shape[1])
    }

    /// A dense layer `l` (weight N × M, bias M) named `name` on `rows` rows.
    pub(super) fn dense(
        dev: &Device,
        arena: &ParamArena,
        l: &comera_layers::Linear,
        name: &str,
        rows: usize,
    ) -> Result<Lin, CudaError> {
        let [n, m] = [l.weight.shape[0], l.weight.shape[1]];
        let slot = |n: &str| Slot {
            w: arena.w(n),
            g: arena.g(n),
        };
        Ok(Lin::Dense {
            n,
            m,
            rows,
            w: slot(&format!("{name}.weight")),
            b: slot(&format!("{name}.bias")),
            partial: Buf::zeros(dev, ops::chunks(rows) * m)?,
        })
    }

    /// y (rows × M) = x (rows × N)·W + b.
    pub(super) fn forward(
        &self,
        dev: &Device,
        blas: &CudaBlas,
        x: u64,
        y: u64,
    ) -> Result<(), CudaError> {
        match self {
            // The cores were gated for every TT layer at once (`EncoderPlan::forward`).
            Lin::Tt(t) => t.forward_products(dev, blas, x, y),
            Lin::Dense {
                n, m, rows, w, b, ..
            } => {
                // SAFETY: x holds rows·N floats, y rows·M, the weight N·M, the bias M.
                unsafe {
                    Gemm::new(*rows, *m, *n, false, false).run(blas, x, w.w, y)?;
                    let (r, wi) = (*rows as i64, *m as i32);
                    launch(
                        dev,
                        "add_bias_rows",
                        grid_stride(rows * m),
                        &[&y, &b.w, &r, &wi],
                    )
                }
            }
        }
    }

    /// Accumulates the layer's gradients from dy (rows × M); writes (or with `add`, adds to)
    /// dx (rows × N) when given.
    pub(super) fn backward(
        &self,
        dev: &Device,
        blas: &CudaBlas,
        x: u64,
        dy: u64,
        dx: Option<(u64, bool)>,
    ) -> Result<(), CudaError> {
        match self {
            // The gated cores' gradients follow for every TT layer at once
            // (`EncoderPlan::backward`).
            Lin::Tt(t) => t.backward_products(dev, blas, x, dy, dx),
            Lin::Dense {
                n,
                m,
                rows,
                w,
                b,
                partial,
            } => {
                // SAFETY: as in `forward`; dW (N × M) += xᵀ·dy, dx = dy·Wᵀ.
                unsafe {
                    Gemm::new(*n, *m, *rows, true, false)
                        .acc()
                        .run(blas, x, dy, w.g)?;
                    if let Some((dx, add)) = dx {
                        let g = Gemm::new(*rows, *n, *m, false, true);
                        (if add { g.acc() } else { g }).run(blas, dy, w.w, dx)?;
                    }
                }
                column_sum(dev, dy, *rows, *m, partial.ptr(), b.g)
            }
        }
    }
}

/// out (W) += Σ_rows x (rows × W), the CPU's row chunks (elementwise.cu).
pub(super) fn column_sum(
    dev: &Device,
    x: u64,
    rows: usize,
    w: usize,
    part: u64,
    out: u64,
) -> Result<(), CudaError> {
    let (r, wi) = (rows as i32, w as i32);
    let (per, nc) = (ops::rows_per_chunk(rows) as i32, ops::chunks(rows) as i32);
    let cols = (w as u32).div_ceil(BLOCK);
    let one = 1i32;
    // SAFETY: x holds rows·W floats, part chunks·W, out W.
    unsafe {
        launch(
            dev,
            "column_sum_partials",
            grid(cols, nc as u32, BLOCK),
            &[&x, &r, &wi, &per, &part],
        )?;
        launch(
            dev,
            "column_sum_finish",
            grid(cols, 1, BLOCK),
            &[&part, &nc, &wi, &wi, &one, &out],
        )
    }
}

/// A LayerNorm's parameters and its saved statistics for `rows` rows.
pub(super) struct Ln {
    gamma: Slot,
    beta: Slot,
    rows: usize,
    dim: usize,
    eps: f32,
    mean: Buf<f32>,
    rstd: Buf<f32>,
    partial: Buf<f32>,
}

impl Ln {
    pub(super) fn new(
        dev: &Device,
        arena: &ParamArena,
        name: &str,
        rows: usize,
        dim: usize,
        eps: f32,
    ) -> Result<Ln, CudaError> {
        Ok(Ln {
            gamma: Slot {
                w: arena.w(&format!("{name}.gamma")),
                g: arena.g(&format!("{name}.gamma")),
            },
            beta: Slot {
                w: arena.w(&format!("{name}.beta")),
                g: arena.g(&format!("{name}.beta")),
            },
            rows,
            dim,
            eps,
            mean: Buf::zeros(dev, rows)?,
            rstd: Buf::zeros(dev, rows)?,
            partial: Buf::zeros(dev, Device::layer_norm_partial_len(rows, dim))?,
        })
    }

    /// Bytes [`Ln::new`] allocates for `rows` rows of `dim`.
    pub(super) fn device_bytes(rows: usize, dim: usize) -> usize {
        let f = Buf::<f32>::zeros_bytes;
        2 * f(rows) + f(Device::layer_norm_partial_len(rows, dim))
    }

    /// y = LN(x) (layernorm.cu), saving μ and 1/σ.
    pub(super) fn forward(&self, dev: &Device, x: u64, y: u64) -> Result<(), CudaError> {
        let (r, d) = (self.rows as i32, self.dim as i32);
        let (mean, rstd) = (self.mean.ptr(), self.rstd.ptr());
        // SAFETY: x, y hold rows·D floats; γ, β D; μ, 1/σ rows.
        unsafe {
            launch(
                dev,
                "layer_norm_forward",
                grid(self.rows as u32, 1, BLOCK),
                &[
                    &x,
                    &self.gamma.w,
                    &self.beta.w,
                    &self.eps,
                    &r,
                    &d,
                    &y,
                    &mean,
                    &rstd,
                ],
            )
        }
    }

    /// dx = LN'ᵀ(dy + extra) (extra: 0 for none), dγ, dβ accumulated.
    pub(super) fn backward(
        &self,
        dev: &Device,
        x: u64,
        dy: u64,
        extra: u64,
        dx: u64,
    ) -> Result<(), CudaError> {
        let (r, d) = (self.rows as i32, self.dim as i32);
        let (mean, rstd) = (self.mean.ptr(), self.rstd.ptr());
        let (per, nc) = (
            ops::rows_per_chunk(self.rows) as i32,
            ops::chunks(self.rows) as i32,
        );
        let part = self.partial.ptr();
        let cols = (self.dim as u32).div_ceil(BLOCK);
        let (stride, one) = (2 * d, 1i32);
        let part_beta = part + 4 * self.dim as u64;
        // SAFETY: x, dy, extra (when not null), dx hold rows·D floats; the partials
        // (chunks, 2D); the finishing sums read columns < D of rows of stride 2D, from the
        // start (γ) and from column D (β).
        unsafe {
            launch(
                dev,
                "layer_norm_backward_dx",
                grid(self.rows as u32, 1, BLOCK),
                &[&x, &dy, &extra, &mean, &rstd, &self.gamma.w, &r, &d, &dx],
            )?;
            launch(
                dev,
                "layer_norm_param_partials",
                grid(cols, nc as u32, BLOCK),
                &[&x, &dy, &extra, &mean, &rstd, &r, &d, &per, &part],
            )?;
            launch(
                dev,
                "column_sum_finish",
                grid(cols, 1, BLOCK),
                &[&part, &nc, &d, &stride, &one, &self.gamma.g],
            )?;
            launch(
                dev,
                "column_sum_finish",
                grid(cols, 1, BLOCK),
                &[&part_beta, &nc, &d, &stride, &one, &self.beta.g],
            )
        }
    }
}

/// One dropout site: its seed and keep threshold (dropout.cu, the CPU's counter hash).
#[derive(Clone, Copy)]
struct DropSite {
    seed: u64,
    threshold: u64,
    scale: f32,
}

impl DropSite {
    fn new(p: f32, seed: u64) -> DropSite {
        DropSite {
            seed,
            threshold: ops::dropout_threshold(p),
            scale: 1.0 / (1.0 - p),
        }
    }

    /// out = mask ⊙ x / (1 − p) over n elements (in place allowed); also its own backward.
    fn apply(&self, dev: &Device, step: u64, x: u64, out: u64, n: usize) -> Result<(), CudaError> {
        let nn = n as i64;
        // SAFETY: x and out hold n floats, step one u64.
        unsafe {
            launch(
                dev,
                "dropout_apply",
                grid_stride(n),
                &[
                    &x,
                    &out,
                    &nn,
                    &self.seed,
                    &step,
                    &self.threshold,
                    &self.scale,
                ],
            )
        }
    }

    /// out = x + mask ⊙ branch / (1 − p) when `on` (training), else out = x + branch (an
    /// evaluation pass: dropout is the identity, as on the CPU with `train = false`).
    #[allow(clippy::too_many_arguments)]
    fn residual(
        &self,
        dev: &Device,
        on: bool,
        step: u64,
        x: u64,
        branch: u64,
        out: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        if on {
            return self.add(dev, step, x, branch, out, n);
        }
        let nn = n as i64;
        // SAFETY: x, branch and out hold n floats (elementwise.cu's `add`, out_i = x_i + b_i).
        unsafe { launch(dev, "add", grid_stride(n), &[&x, &branch, &out, &nn]) }
    }

    /// out = x + mask ⊙ branch / (1 − p).
    fn add(
        &self,
        dev: &Device,
        step: u64,
        x: u64,
        branch: u64,
        out: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        let nn = n as i64;
        // SAFETY: x, branch and out hold n floats, step one u64.
        unsafe {
            launch(
                dev,
                "dropout_add",
                grid_stride(n),
                &[
                    &x,
                    &branch,
                    &out,
                    &nn,
                    &self.seed,
                    &step,
                    &self.threshold,
                    &self.scale,
                ],
            )
        }
    }
}

/// One block's layers and saved activations. Rows R = N, or B for the last block past q/k/v.
struct BlockPlan {
    q: Lin,
    k: Lin,
    v: Lin,
    o: Lin,
    up: Lin,
    down: Lin,
    ln1: Ln,
    ln2: Ln,
    drop_attn: DropSite,
    drop_ffn: DropSite,
    /// Rows past q/k/v (N, or B on the [CLS] rows).
    rows: usize,
    /// Pre-LN: LN1 before q/k/v (on all N rows), LN2 on r1, and out = r1 + f.
    pre_ln: bool,
    lx: Buf<f32>,       // N × D: LN1(x), the q/k/v input (pre-LN; unused post-LN)
    qh: Buf<f32>,       // (B, H, T, dh)
    kh: Buf<f32>,       // (B, H, T, dh)
    vh: Buf<f32>,       // (B, H, T, dh)
    p: Buf<f32>,        // (B·H, T, T): the attention probabilities
    att: Buf<f32>,      // N × D: the attention context (all rows)
    x_rows: Buf<f32>,   // R × D: the residual rows (the [CLS] rows' input; unused when R = N)
    att_rows: Buf<f32>, // R × D: the context of the rows past q/k/v (= att when R = N)
    r1: Buf<f32>,       // R × D
    x1: Buf<f32>,       // R × D
    h: Buf<f32>,        // R × F: Up(x1)
    r2: Buf<f32>,       // R × D (post-LN; unused pre-LN)
    out: Buf<f32>,      // R × D: the block output (the next block's input)
}

/// The lengths (floats) of a [`BlockPlan`]'s buffers, for the plan and its memory estimate.
pub(super) struct BlockLens {
    /// Rows LN1 normalises: N pre-LN (before q/k/v), the block's rows post-LN.
    pub ln1_rows: usize,
    /// N × D: qh, kh, vh, att.
    pub nd: usize,
    /// lx: N × D pre-LN, else unused (1).
    pub lx: usize,
    /// P: B·H·T².
    pub p: usize,
    /// x_rows, att_rows: R × D when the block runs past q/k/v on fewer rows, else unused.
    pub last_rows: usize,
    /// R × D: r1, x1, out; R × F: h; r2: R × D post-LN, else unused.
    pub rd: usize,
    pub rf: usize,
    pub r2: usize,
}

impl BlockLens {
    /// A block of `cfg` at batch `b` × `t` running past q/k/v on `rows` rows (N, or B).
    pub(super) fn of(cfg: &comera_model::EncoderConfig, b: usize, t: usize, rows: usize) -> Self {
        let (n, d) = (b * t, cfg.d_model);
        let fewer = rows < n;
        BlockLens {
            ln1_rows: if cfg.pre_ln { n } else { rows },
            nd: n * d,
            lx: if cfg.pre_ln { n * d } else { 1 },
            p: b * cfg.heads * t * t,
            last_rows: if fewer { rows * d } else { 1 },
            rd: rows * d,
            rf: rows * cfg.ffn,
            r2: if cfg.pre_ln { 1 } else { rows * d },
        }
    }

    /// Bytes of the block's own buffers (its layers' workspaces not included).
    pub(super) fn bytes(&self) -> usize {
        let f = Buf::<f32>::zeros_bytes;
        f(self.lx)
            + 4 * f(self.nd)
            + f(self.p)
            + 2 * f(self.last_rows)
            + 3 * f(self.rd)
            + f(self.rf)
            + f(self.r2)
    }
}

/// The classifier head's layers and activations (B rows: the [CLS] rows).
struct ClsHead {
    pool: Lin,
    cls: Lin,
    drop: DropSite,
    hcls: Buf<f32>,    // B × D
    pre: Buf<f32>,     // B × D
    pooled: Buf<f32>,  // B × D
    dpooled: Buf<f32>, // B × D
    dcls: Buf<f32>,    // B × D
}

/// What sits on the last hidden states.
enum HeadPlan {
    Classifier(Box<ClsHead>),
    Mlm(Box<MlmPlan>),
}

/// The word embedding on the device.
enum Word {
    Dense { table: Slot },
    Ttm(Box<Ttm>),
}

/// A TTM word embedding's device state.
struct Ttm {
    layout: TtmLayout,
    meta: Buf<i32>,
    cores: Slot,
    gates: Slot,
    /// The batch's distinct ids, padded to N with id 0 (their rows neither computed nor read).
    distinct: Buf<u32>,
    /// How many of `distinct` are the batch's (written with each batch): the TTM kernels'
    /// grid is fixed at N blocks, and the blocks past this count return at once.
    live: Buf<i32>,
    rows: Buf<f32>, // N × D: the rows of the distinct ids
    slab: Buf<f32>, // N × slab_total: their slab gradients
    dh: Buf<f32>,   // the largest core: one core's gradient before the gates
    /// Per core: the distinct ids grouped by digit (order padded to N, start v_k + 1).
    digits: Vec<(Buf<u32>, Buf<u32>)>,
}

/// The whole step's plan. See the module doc.
pub struct EncoderPlan {
    pub b: usize,
    pub t: usize,
    d: usize,
    heads: usize,
    ffn: usize,
    /// The logits' width: C classes, or the MLM decoder's V′.
    classes: usize,
    vocab: usize,
    tau: f32,
    pub arena: ParamArena,
    table: AdamTable,
    consts: AdamConsts,
    /// [`StepConfig::train_gates`].
    train_gates: bool,
    /// [`StepConfig::rank`] on the device.
    rank: Option<RankPlan>,
    max_norm: f32,
    word: Word,
    pos: Slot,
    types: Slot,
    ln_emb: Ln,
    drop_emb: DropSite,
    blocks: Vec<BlockPlan>,
    /// Pre-LN: the final LayerNorm on the last block's output rows, and its output (R × D).
    ln_final: Option<Ln>,
    hfinal: Buf<f32>,
    head: HeadPlan,
    /// Rows of the head's logits: B (classifier) or R (masked-LM).
    head_rows: usize,
    // The batch, copied in by `load` (fixed buffers, read by the captured step).
    slot: Buf<u32>, // N: the word-embedding row of each token (a distinct-id row for TTM, the id for dense)
    seg_order: Buf<u32>, // N: tokens sorted by word id
    seg_start: Buf<u32>, // N + 1: segment starts, padded with N (empty segments)
    seg_dst: Buf<u32>, // N: the table row of each segment (dense word; padded with 0)
    types_ids: Buf<u32>, // N
    type_order: Buf<u32>,
    type_start: Buf<u32>, // type_vocab + 1
    pos_ids: Buf<u32>,    // N: t of each token (fixed)
    pos_order: Buf<u32>,  // N: tokens by position (fixed)
    pos_start: Buf<u32>,  // T + 1 (fixed)
    allow: Buf<f32>,      // B × T: 1 for a real token
    label: Buf<i32>,      // head rows: a class, or a token (IGNORE_INDEX: none)
    cls_slot: Buf<u32>,   // B: b·T, the [CLS] rows (fixed)
    seq_order: Buf<u32>,  // B: 0..B (fixed)
    seq_start: Buf<u32>,  // B + 1: 0..=B (fixed)
    // Activations and scratch.
    emb: Buf<f32>, // N × D: word + pos + type
    x0: Buf<f32>,  // N × D
    tmp: Buf<f32>, // N × D
    tq: Buf<f32>,  // N × D: a q/k/v projection in rows, or its gradient
    oh: Buf<f32>,  // (B, H, T, dh): P·V, or ∂L/∂O
    dqh: Buf<f32>, // (B, H, T, dh) ×3: ∂L/∂Q, ∂L/∂K, ∂L/∂V
    dkh: Buf<f32>,
    dvh: Buf<f32>,
    dp: Buf<f32>,    // (B·H, T, T)
    g: Buf<f32>,     // N × F: GELU(h)
    dg: Buf<f32>,    // N × F
    dhh: Buf<f32>,   // N × F
    f: Buf<f32>,     // N × D
    dflow: Buf<f32>, // N × D: the flowing gradient
    dt1: Buf<f32>,   // N × D
    dt2: Buf<f32>,
    dt3: Buf<f32>,
    datt: Buf<f32>,   // N × D
    logits: Buf<f32>, // head rows × C (classes, or the MLM decoder's width V′)
    dlogits: Buf<f32>,
    ce_count: Buf<i32>,
    ce_row_loss: Buf<f64>,
    ce_row_hit: Buf<f32>,
    ce_out: Buf<f64>, // [mean loss, loss sum, counted rows, correct]
    /// An accumulated step's sums over its micro-batches so far: [Σ mean loss·counted rows,
    /// Σ counted rows, Σ correct] ([`EncoderPlan::record_micro`]).
    micro_acc: Buf<f64>,
    norm_partial: Buf<f64>,
    norm: Buf<f64>,
    clip: Buf<f32>,
    scalars: Buf<f32>, // (lr_scale, 1 − β1^t, 1 − β2^t)
    step: Buf<u64>,    // the dropout step
    /// The plan's cuBLAS handle and workspace.
    blas: Blas,
    /// Every TT layer's gated cores, gated in one launch a forward (None: no TT layer).
    gates: Option<GateTable>,
    /// What the plan's construction allocated ([`EncoderPlan::device_bytes`]).
    device_bytes: usize,
}

/// The dropout seeds of comera-model's `Encoder::new` for model seed `seed` (its
/// `dseed`, the sites `dseed + 1 + 2l` after attention and `dseed + 2 + 2l` after the FFN,
/// `dseed + 2³²` in the head). Kept in step with comera-model by the GPU test that compares
/// a step with dropout on.
fn dropout_seeds(seed: u64, layers: usize) -> (u64, Vec<(u64, u64)>, u64) {
    let dseed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let blocks = (0..layers as u64)
        .map(|l| (dseed.wrapping_add(1 + 2 * l), dseed.wrapping_add(2 + 2 * l)))
        .collect();
    (dseed, blocks, dseed.wrapping_add(1 << 32))
}

impl EncoderPlan {
    /// The plan of `enc` (a classifier or a masked-LM model, post- or pre-LN; its current
    /// ranks), checked against the device's free memory first ([`PlanMemory`]), for batches of `b`
    /// sequences of `t ≤ cfg.seq_len` tokens, its dropout seeded as `Encoder::new(cfg, seed)`
    /// seeds it. Parameters are uploaded from `enc`; AdamW's moments start at zero.
    pub fn new(
        dev: &Device,
        enc: &Encoder,
        seed: u64,
        b: usize,
        t: usize,
        opt: StepConfig,
    ) -> Result<EncoderPlan, CudaError> {
        let cfg = &enc.cfg;
        let classifier = matches!(enc.head, Head::Classifier(_));
        Self::check_shape(enc, b, t)?;
        let (d, heads, ffn, labels) = (cfg.d_model, cfg.heads, cfg.ffn, cfg.num_labels);
        let (n, tau, eps) = (b * t, cfg.threshold, cfg.ln_eps);
        // The whole plan, checked against the free memory before the first allocation.
        let need = PlanMemory::of(enc, b, t, &opt)?;
        dev.ensure_fits(&need.describe(b, t), need.total())?;
        let allocated_before = raw::allocated_on_this_thread();
        let params: Vec<_> = enc
            .params()
            .iter()
            .map(|p| (p.name.clone(), p.shape.clone(), p.kind))
            .collect();
        let mut arena = ParamArena::new(dev, &params, !opt.forward_only)?;
        arena.upload(dev, &enc.params())?;
        let decay = |kind: ParamKind, shape_len: usize| {
            if kind == ParamKind::RankGate || shape_len < 2 {
                0.0
            } else {
                opt.weight_decay
            }
        };
        // Decay by tensor: the table takes it per group, so look the shape up per kind and
        // name through a closure over the arena's tensors.
        let table = {
            let rows: Vec<crate::ops::AdamTensor> = arena
                .tensors
                .iter()
                .enumerate()
                .map(|(i, tn)| {
                    let end = arena
                        .tensors
                        .get(i + 1)
                        .map_or(arena.total(), |nx| nx.offset);
                    crate::ops::AdamTensor {
                        len: end - tn.offset,
                        lr: match tn.kind {
                            ParamKind::TtCore => opt.lr_cores,
                            ParamKind::RankGate => opt.lr_gates,
                            ParamKind::Other => opt.lr_other,
                        },
                        decay: decay(tn.kind, tn.shape.len()),
                        is_gate: tn.kind == ParamKind::RankGate,
                    }
                })
                .collect();
            dev.adam_table(&rows)?
        };
        let slot = |name: &str| Slot {
            w: arena.w(name),
            g: arena.g(name),
        };
        let word = match &enc.word {
            AnyEmbedding::Dense(_) => Word::Dense {
                table: slot("embeddings.word.weight"),
            },
            AnyEmbedding::Ttm(e) => {
                let s = e.shape();
                let mut layout = TtmLayout::new(s.vocab_modes(), s.dim_modes(), s.ranks())?;
                // The arena pads each tensor: offsets relative to the first core and gate.
                let p = s.vocab_modes().len();
                let core_at = |k: usize| arena.get(&format!("embeddings.word.core.{}", k + 1));
                let gate_at = |k: usize| arena.get(&format!("embeddings.word.gate.{k}"));
                let c0 = core_at(0)?.offset;
                let g0 = if p > 1 { gate_at(1)?.offset } else { 0 };
                let meta_cores = 1 + 2 * p + (p + 1);
                for k in 0..p {
                    let off = core_at(k)?.offset - c0;
                    layout.meta[meta_cores + k] = off as i32;
                    layout.cores[k].offset = off;
                    if k + 1 < p {
                        let goff = gate_at(k + 1)?.offset - g0;
                        layout.meta[meta_cores + p + k + 1] = goff as i32;
                        layout.cores[k].gate_offset = Some(goff);
                    }
                }
                let cores = Slot {
                    w: arena.w("embeddings.word.core.1"),
                    g: arena.g("embeddings.word.core.1"),
                };
                let gates = if p > 1 {
                    slot("embeddings.word.gate.1")
                } else {
                    cores
                };
                let max_core = layout.cores.iter().map(|c| c.len()).max().unwrap_or(0);
                let digits = layout
                    .cores
                    .iter()
                    .map(|c| Ok((Buf::zeros(dev, n)?, Buf::zeros(dev, c.shape[1] + 1)?)))
                    .collect::<Result<Vec<_>, CudaError>>()?;
                Word::Ttm(Box::new(Ttm {
                    meta: Buf::copy_from_host(dev, &layout.meta)?,
                    cores,
                    gates,
                    distinct: Buf::zeros(dev, n)?,
                    live: Buf::zeros(dev, 1)?,
                    rows: Buf::zeros(dev, n * d)?,
                    slab: Buf::zeros(dev, opt.backward_len(n * layout.slab_total))?,
                    dh: Buf::zeros(dev, opt.backward_len(max_core))?,
                    digits,
                    layout,
                }))
            }
        };
        let (demb, dblocks, dhead) = dropout_seeds(seed, cfg.layers);
        let p = cfg.dropout;
        let nd = n * d;
        let mut blocks = Vec::with_capacity(cfg.layers);
        for (l, blk) in enc.blocks.iter().enumerate() {
            let last = l + 1 == cfg.layers;
            // A classifier's last block runs past q/k/v on the [CLS] rows only.
            let rows = if last && classifier { b } else { n };
            let pre = format!("encoder.{l}");
            let lin = |x: &AnyLinear, name: &str, r: usize| {
                Lin::new(dev, &arena, x, &format!("{pre}.{name}"), r, tau)
            };
            let z = |len: usize| Buf::<f32>::zeros(dev, len);
            let len = BlockLens::of(cfg, b, t, rows);
            blocks.push(BlockPlan {
                q: lin(&blk.q, "attn.q", n)?,
                k: lin(&blk.k, "attn.k", n)?,
                v: lin(&blk.v, "attn.v", n)?,
                o: lin(&blk.o, "attn.o", rows)?,
                up: lin(&blk.up, "ffn.up", rows)?,
                down: lin(&blk.down, "ffn.down", rows)?,
                ln1: Ln::new(dev, &arena, &format!("{pre}.ln1"), len.ln1_rows, d, eps)?,
                ln2: Ln::new(dev, &arena, &format!("{pre}.ln2"), rows, d, eps)?,
                drop_attn: DropSite::new(p, dblocks[l].0),
                drop_ffn: DropSite::new(p, dblocks[l].1),
                rows,
                pre_ln: cfg.pre_ln,
                lx: z(len.lx)?,
                qh: z(len.nd)?,
                kh: z(len.nd)?,
                vh: z(len.nd)?,
                p: z(len.p)?,
                att: z(len.nd)?,
                x_rows: z(len.last_rows)?,
                att_rows: z(len.last_rows)?,
                r1: z(len.rd)?,
                x1: z(len.rd)?,
                h: z(len.rf)?,
                r2: z(len.r2)?,
                out: z(len.rd)?,
            });
        }
        let z = |len: usize| Buf::<f32>::zeros(dev, len);
        let zu = |len: usize| Buf::<u32>::zeros(dev, len);
        let last_rows = blocks.last().map_or(n, |l| l.rows);
        let word_table = match &word {
            Word::Dense { table } => Some(*table),
            Word::Ttm(_) => None,
        };
        let (head, head_rows, classes) = match &enc.head {
            Head::Classifier(h) => {
                let head = ClsHead {
                    pool: Lin::new(dev, &arena, &h.pool, "pooler", b, tau)?,
                    cls: Lin::new(dev, &arena, &h.classifier, "classifier", b, tau)?,
                    drop: DropSite::new(p, dhead),
                    hcls: z(b * d)?,
                    pre: z(b * d)?,
                    pooled: z(b * d)?,
                    dpooled: z(b * d)?,
                    dcls: z(b * d)?,
                };
                (HeadPlan::Classifier(Box::new(head)), b, labels)
            }
            Head::Mlm(h) => {
                let rows = opt.mlm_rows(b, t);
                let head = MlmPlan::new(dev, &arena, h, cfg, rows, word_table)?;
                let width = head.width;
                (HeadPlan::Mlm(Box::new(head)), rows, width)
            }
        };
        // The backward's shared scratch: none in a plan for the forward only.
        let (nd_bwd, p_bwd, nf_bwd, logits_bwd) = (
            opt.backward_len(nd),
            opt.backward_len(b * heads * t * t),
            opt.backward_len(n * ffn),
            opt.backward_len(head_rows * classes),
        );
        let (t32, b32) = (t as u32, b as u32);
        let pos_ids: Vec<u32> = (0..n as u32).map(|i| i % t32).collect();
        let pos_seg = Segments::of(&pos_ids);
        let consts = AdamConsts {
            beta1: opt.beta1,
            beta2: opt.beta2,
            eps: opt.eps,
            freeze_gates_at: opt.freeze_gates_at,
        };
        let blas = Blas::new(dev)?;
        let mut gated: Vec<GatedCore> = blocks
            .iter()
            .flat_map(|b| [&b.q, &b.k, &b.v, &b.o, &b.up, &b.down])
            .flat_map(Lin::gated_cores)
            .collect();
        match &head {
            HeadPlan::Classifier(c) => {
                gated.extend(c.pool.gated_cores());
                gated.extend(c.cls.gated_cores());
            }
            HeadPlan::Mlm(m) => gated.extend(m.gated_cores()),
        }
        let gates = GateTable::new(dev, &gated, tau)?;
        let rank = match opt.rank {
            Some(r) => Some(RankPlan::new(dev, enc, &arena, tau, r)?),
            None => None,
        };
        let mut plan = EncoderPlan {
            blas,
            rank,
            b,
            t,
            d,
            heads,
            ffn,
            classes,
            vocab: cfg.vocab_size,
            tau,
            table,
            consts,
            train_gates: opt.train_gates,
            max_norm: opt.max_grad_norm,
            word,
            pos: slot("embeddings.position.weight"),
            types: slot("embeddings.token_type.weight"),
            ln_emb: Ln::new(dev, &arena, "embeddings.ln", n, d, eps)?,
            drop_emb: DropSite::new(p, demb),
            ln_final: match cfg.pre_ln {
                true => Some(Ln::new(dev, &arena, "encoder.ln_final", last_rows, d, eps)?),
                false => None,
            },
            hfinal: z(if cfg.pre_ln { last_rows * d } else { 1 })?,
            head,
            head_rows,
            blocks,
            slot: zu(n)?,
            seg_order: zu(n)?,
            seg_start: zu(n + 1)?,
            seg_dst: zu(n)?,
            types_ids: zu(n)?,
            type_order: zu(n)?,
            type_start: zu(cfg.type_vocab + 1)?,
            pos_ids: Buf::copy_from_host(dev, &pos_ids)?,
            pos_order: Buf::copy_from_host(dev, &pos_seg.order)?,
            pos_start: Buf::copy_from_host(dev, &pos_seg.start)?,
            allow: z(n)?,
            label: Buf::zeros(dev, head_rows)?,
            cls_slot: Buf::copy_from_host(dev, &(0..b32).map(|i| i * t32).collect::<Vec<_>>())?,
            seq_order: Buf::copy_from_host(dev, &(0..b32).collect::<Vec<_>>())?,
            seq_start: Buf::copy_from_host(dev, &(0..=b32).collect::<Vec<_>>())?,
            emb: z(nd)?,
            x0: z(nd)?,
            tmp: z(nd)?,
            tq: z(nd)?,
            oh: z(nd)?,
            dqh: z(nd_bwd)?,
            dkh: z(nd_bwd)?,
            dvh: z(nd_bwd)?,
            dp: z(p_bwd)?,
            g: z(n * ffn)?,
            dg: z(nf_bwd)?,
            dhh: z(nf_bwd)?,
            f: z(nd)?,
            dflow: z(nd_bwd)?,
            dt1: z(nd_bwd)?,
            dt2: z(nd_bwd)?,
            dt3: z(nd_bwd)?,
            datt: z(nd_bwd)?,
            logits: z(head_rows * classes)?,
            dlogits: z(logits_bwd)?,
            ce_count: Buf::zeros(dev, 1)?,
            ce_row_loss: Buf::zeros(dev, head_rows)?,
            ce_row_hit: z(head_rows)?,
            ce_out: Buf::zeros(dev, 4)?,
            micro_acc: Buf::zeros(dev, 3)?,
            norm_partial: Buf::zeros(dev, Device::grad_norm_partial_len(arena.total()))?,
            norm: Buf::zeros(dev, 1)?,
            clip: z(1)?,
            scalars: Buf::copy_from_host(dev, &[1.0f32, 1.0, 1.0])?,
            step: Buf::zeros(dev, 1)?,
            arena,
            gates,
            device_bytes: 0,
        };
        plan.device_bytes = raw::allocated_on_this_thread() - allocated_before;
        Ok(plan)
    }

    /// Refuses a batch of `b` sequences of `t` tokens that `enc` cannot take (none, or longer
    /// than its position table), before anything is planned.
    pub fn check_shape(enc: &Encoder, b: usize, t: usize) -> Result<(), CudaError> {
        let max = enc.cfg.seq_len;
        if t == 0 || t > max || b == 0 {
            return Err(CudaError::Plan(format!(
                "batch {b} × {t} tokens (at least one sequence of 1..={max} tokens)"
            )));
        }
        Ok(())
    }

    /// Bytes of device memory the plan's buffers hold: what its construction allocated,
    /// which [`PlanMemory::of`] computed before allocating (the GPU tests hold the two equal).
    pub fn device_bytes(&self) -> usize {
        self.device_bytes
    }

    /// Copies one classifier batch in: ids, token types and attention mask (B × T, mask 1 =
    /// real token), one label per sequence. Checked as the CPU's `EncoderState::load` checks
    /// them (lengths, ids below the vocabulary, types below the type vocabulary, labels below
    /// the classes).
    pub fn load(
        &mut self,
        dev: &Device,
        ids: &[u32],
        types: &[u32],
        mask: &[u32],
        labels: &[usize],
    ) -> Result<(), CudaError> {
        if !matches!(self.head, HeadPlan::Classifier(_)) {
            return Err(CudaError::Plan(
                "a classifier batch for a masked-LM plan (load_mlm)".into(),
            ));
        }
        check_len("labels", labels.len(), self.b)?;
        if let Some(&l) = labels.iter().find(|&&l| l >= self.classes) {
            return Err(CudaError::Plan(format!(
                "label {l} ≥ {} labels",
                self.classes
            )));
        }
        self.load_tokens(dev, ids, types, mask)?;
        let lab: Vec<i32> = labels.iter().map(|&l| l as i32).collect();
        dev.stream()
            .memcpy_htod(&lab, self.label.slice_mut())
            .map_err(driver("copying a batch to the device"))
    }

    /// Copies one masked-LM batch in (the CPU's `EncoderState::load_mlm`): the (masked) ids
    /// and attention mask (B × T; token types 0), each token's label (`IGNORE_INDEX` where
    /// nothing is predicted) and the predicted positions, ascending, at most the head's R.
    pub fn load_mlm(
        &mut self,
        dev: &Device,
        ids: &[u32],
        mask: &[u32],
        token_labels: &[i32],
        selected: &[u32],
    ) -> Result<(), CudaError> {
        let n = self.b * self.t;
        let HeadPlan::Mlm(h) = &self.head else {
            return Err(CudaError::Plan(
                "a masked-LM batch for a classifier plan (load)".into(),
            ));
        };
        let (rows, vocab) = (h.rows, h.vocab);
        check_len("labels", token_labels.len(), n)?;
        if selected.len() > rows {
            return Err(CudaError::Plan(format!(
                "{} selected positions, the masked-LM head has room for {rows}",
                selected.len()
            )));
        }
        if let Some(w) = selected.windows(2).find(|w| w[0] >= w[1]) {
            return Err(CudaError::Plan(format!(
                "selected positions not ascending: {} then {}",
                w[0], w[1]
            )));
        }
        if let Some(&p) = selected.iter().find(|&&p| p as usize >= n) {
            return Err(CudaError::Plan(format!(
                "selected position {p} ≥ {n} tokens"
            )));
        }
        let ignore = comera_layers::loss::IGNORE_INDEX;
        let mut labels: Vec<i32> = selected.iter().map(|&p| token_labels[p as usize]).collect();
        if let Some(&l) = labels
            .iter()
            .find(|&&l| l != ignore && !(0..vocab as i32).contains(&l))
        {
            return Err(CudaError::Plan(format!(
                "token label {l} outside the vocabulary ({vocab})"
            )));
        }
        labels.resize(rows, ignore);
        let mut sel = selected.to_vec();
        sel.resize(rows, 0);
        let mut start: Vec<u32> = (0..=selected.len() as u32).collect();
        start.resize(rows + 1, selected.len() as u32);
        self.load_tokens(dev, ids, &vec![0; n], mask)?;
        let HeadPlan::Mlm(h) = &mut self.head else {
            unreachable!("checked above")
        };
        let s = dev.stream();
        let e = || driver("copying a batch to the device");
        s.memcpy_htod(&sel, h.sel.slice_mut()).map_err(e())?;
        s.memcpy_htod(&start, h.sel_start.slice_mut())
            .map_err(e())?;
        s.memcpy_htod(&labels, self.label.slice_mut()).map_err(e())
    }

    /// The tokens of a batch (host index work: the word ids' segments, and for a TTM table the
    /// distinct ids and their digit groups), checked: lengths, ids below the vocabulary, types
    /// below the type vocabulary.
    fn load_tokens(
        &mut self,
        dev: &Device,
        ids: &[u32],
        types: &[u32],
        mask: &[u32],
    ) -> Result<(), CudaError> {
        let (vocab, type_vocab) = (self.vocab, self.type_start.len() - 1);
        let n = self.b * self.t;
        for (what, len) in [
            ("input_ids", ids.len()),
            ("token_type_ids", types.len()),
            ("attention_mask", mask.len()),
        ] {
            check_len(what, len, n)?;
        }
        if let Some(&id) = ids.iter().find(|&&i| i as usize >= vocab) {
            return Err(CudaError::Plan(format!(
                "token id {id} ≥ the vocabulary ({vocab})"
            )));
        }
        if let Some(&ty) = types.iter().find(|&&i| i as usize >= type_vocab) {
            return Err(CudaError::Plan(format!("token type {ty} ≥ {type_vocab}")));
        }
        let s = dev.stream();
        let e = || driver("copying a batch to the device");
        let seg = Segments::of(ids);
        let pad = |mut v: Vec<u32>, len: usize, with: u32| {
            v.resize(len, with);
            v
        };
        s.memcpy_htod(&seg.order, self.seg_order.slice_mut())
            .map_err(e())?;
        s.memcpy_htod(
            &pad(seg.start.clone(), n + 1, n as u32),
            self.seg_start.slice_mut(),
        )
        .map_err(e())?;
        match &mut self.word {
            Word::Dense { .. } => {
                s.memcpy_htod(ids, self.slot.slice_mut()).map_err(e())?;
                s.memcpy_htod(&pad(seg.ids.clone(), n, 0), self.seg_dst.slice_mut())
                    .map_err(e())?;
            }
            Word::Ttm(w) => {
                let Ttm {
                    layout,
                    distinct,
                    live,
                    digits,
                    ..
                } = &mut **w;
                s.memcpy_htod(&seg.slot, self.slot.slice_mut())
                    .map_err(e())?;
                s.memcpy_htod(&pad(seg.ids.clone(), n, 0), distinct.slice_mut())
                    .map_err(e())?;
                s.memcpy_htod(&[seg.ids.len() as i32], live.slice_mut())
                    .map_err(e())?;
                for ((order, start), (o, st)) in ops::ttm_digit_segments(layout, &seg.ids)
                    .into_iter()
                    .zip(digits.iter_mut())
                {
                    s.memcpy_htod(&pad(order, n, 0), o.slice_mut())
                        .map_err(e())?;
                    s.memcpy_htod(&start, st.slice_mut()).map_err(e())?;
                }
            }
        }
        s.memcpy_htod(types, self.types_ids.slice_mut())
            .map_err(e())?;
        // Token types by row of the type table: every row a segment (empty ones add nothing).
        let tv = self.type_start.len() - 1;
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.sort_by_key(|&i| types[i as usize]);
        let mut start = vec![0u32; tv + 1];
        for &ty in types {
            start[ty as usize + 1] += 1;
        }
        for i in 0..tv {
            start[i + 1] += start[i];
        }
        s.memcpy_htod(&order, self.type_order.slice_mut())
            .map_err(e())?;
        s.memcpy_htod(&start, self.type_start.slice_mut())
            .map_err(e())?;
        let allow: Vec<f32> = mask.iter().map(|&m| (m != 0) as u32 as f32).collect();
        s.memcpy_htod(&allow, self.allow.slice_mut()).map_err(e())?;
        Ok(())
    }

    /// Sets the step's dropout counter and AdamW's scalars for optimiser step `t_adam`
    /// (1-based, the CPU's count) at learning-rate scale `lr_scale` (the schedule).
    pub fn set_step(
        &mut self,
        dev: &Device,
        step: u64,
        t_adam: i32,
        lr_scale: f32,
    ) -> Result<(), CudaError> {
        self.set_update_scalars(dev, t_adam, lr_scale)?;
        self.set_dropout_step(dev, step)
    }

    /// AdamW's scalars for optimiser step `t_adam` at learning-rate scale `lr_scale` alone
    /// (an accumulated step's update; [`EncoderPlan::set_step`]).
    pub fn set_update_scalars(
        &mut self,
        dev: &Device,
        t_adam: i32,
        lr_scale: f32,
    ) -> Result<(), CudaError> {
        let sc = [
            lr_scale,
            1.0 - self.consts.beta1.powi(t_adam),
            1.0 - self.consts.beta2.powi(t_adam),
        ];
        dev.stream()
            .memcpy_htod(&sc, self.scalars.slice_mut())
            .map_err(driver("copying the step's scalars to the device"))
    }

    /// The dropout counter alone (a micro-batch's; [`EncoderPlan::set_step`]).
    pub fn set_dropout_step(&mut self, dev: &Device, step: u64) -> Result<(), CudaError> {
        dev.stream()
            .memcpy_htod(&[step], self.step.slice_mut())
            .map_err(driver("copying the step's scalars to the device"))
    }

    /// The loss, correct count, counted rows and gradient norm of the last step (waits for
    /// the stream).
    pub fn stats(&self, dev: &Device) -> Result<DeviceStepStats, CudaError> {
        let (loss, correct, count) = self.loss_stats(dev)?;
        let norm = dev
            .stream()
            .clone_dtoh(self.norm.slice())
            .map_err(driver("reading the step's gradient norm"))?;
        let objective = match &self.rank {
            Some(r) => Some(r.objective(dev)?),
            None => None,
        };
        Ok(DeviceStepStats {
            loss,
            correct,
            count,
            grad_norm: norm[0],
            objective,
        })
    }

    /// The mean loss, correct count and counted rows of the last loss computed: a step's, or a
    /// masked-LM evaluation pass's (waits for the stream).
    pub fn loss_stats(&self, dev: &Device) -> Result<(f64, f64, f64), CudaError> {
        let out = dev
            .stream()
            .clone_dtoh(self.ce_out.slice())
            .map_err(driver("reading the loss"))?;
        Ok((out[0], out[3], out[2]))
    }

    /// The rank schedule's inputs for the next step (hold, stage and target), read by the
    /// captured step from device memory. An error without the rank schedule.
    pub fn set_rank_step(&mut self, dev: &Device, r: RankStep) -> Result<(), CudaError> {
        match &mut self.rank {
            Some(plan) => plan.set_step(dev, r),
            None => Err(CudaError::Plan(
                "rank schedule inputs for a plan without the rank schedule".into(),
            )),
        }
    }

    /// τ: the model's gate threshold.
    pub fn threshold(&self) -> f32 {
        self.tau
    }

    /// The rank schedule's device half (None without it).
    pub fn rank_plan(&self) -> Option<&RankPlan> {
        self.rank.as_ref()
    }

    /// Whether the plan runs the rank schedule.
    pub fn has_rank_schedule(&self) -> bool {
        self.rank.is_some()
    }

    /// Queues one whole training step: gradients zeroed, forward, loss, backward, the rank
    /// objective (with the schedule), gradient norm and clip factor, AdamW, the gates'
    /// projection (with the schedule). Nothing waits on the host, nothing is allocated.
    pub fn record_step(&self, dev: &Device) -> Result<(), CudaError> {
        self.record_step_through(dev, StepPhase::Update)
    }

    /// The step's phases up to and including `last` ([`EncoderPlan::record_step`] is all of
    /// them): the step benchmark captures each prefix as a graph, and the differences of their
    /// replay times say where a step's time goes.
    pub fn record_step_through(&self, dev: &Device, last: StepPhase) -> Result<(), CudaError> {
        self.training()?;
        let blas = &self.blas.handle;
        self.zero_grads(dev)?;
        self.forward(dev, blas, true)?;
        if last == StepPhase::Forward {
            return Ok(());
        }
        self.loss(dev, true)?;
        if last == StepPhase::Loss {
            return Ok(());
        }
        self.backward(dev, blas)?;
        self.record_gate_grads(dev)?;
        if last == StepPhase::Backward {
            return Ok(());
        }
        self.record_update(dev)
    }

    /// Starts an accumulated step (several micro-batches, then one update: the CPU's
    /// `Stepper::step_accumulated`): the gradients and the micro-batch sums zeroed. Queued on
    /// the stream, not part of a graph.
    pub fn begin_accumulation(&mut self, dev: &Device) -> Result<(), CudaError> {
        self.training()?;
        self.zero_grads(dev)?;
        dev.stream()
            .memcpy_htod(&[0.0f64; 3], self.micro_acc.slice_mut())
            .map_err(driver("zeroing the micro-batch sums"))
    }

    /// Queues one micro-batch of an accumulated step on the batch loaded, at the dropout step
    /// set (the CPU's `step · micro-batches + i`): forward, loss, and the backward *added* to
    /// the gradients, which stay the mean over every counted row so far (c rows before this
    /// micro-batch's n: ·c/n before its backward, ·n/(c + n) after; `optim.cu`), and its
    /// loss, counted rows and correct count added to the step's sums. The same launches for
    /// every micro-batch of every step: captured once.
    pub fn record_micro(&self, dev: &Device) -> Result<(), CudaError> {
        self.training()?;
        let blas = &self.blas.handle;
        self.forward(dev, blas, true)?;
        self.loss(dev, true)?;
        self.micro_scale_grads(dev, false)?;
        self.backward(dev, blas)?;
        self.micro_scale_grads(dev, true)?;
        let (ce, acc) = (self.ce_out.ptr(), self.micro_acc.ptr());
        // SAFETY: ce_out holds 4 doubles, micro_acc 3.
        unsafe { launch(dev, "micro_add_stats", grid(1, 1, 32), &[&ce, &acc]) }
    }

    /// Queues the end of an accumulated step after its micro-batches: the step's loss
    /// statistics from their sums (into `ce_out`, where [`EncoderPlan::stats`] and the rank
    /// objective read them), then what follows a single batch's backward: the rank
    /// objective's gradients, the gradient norm and clip factor, AdamW, the gates' projection.
    pub fn record_apply(&self, dev: &Device) -> Result<(), CudaError> {
        self.training()?;
        let (acc, ce) = (self.micro_acc.ptr(), self.ce_out.ptr());
        // SAFETY: micro_acc holds 3 doubles, ce_out 4.
        unsafe { launch(dev, "micro_finish_stats", grid(1, 1, 32), &[&acc, &ce])? };
        self.record_gate_grads(dev)?;
        self.record_update(dev)
    }

    /// Refuses a training step on a plan for inference only.
    fn training(&self) -> Result<(), CudaError> {
        if self.arena.has_grads() {
            return Ok(());
        }
        Err(CudaError::Plan(
            "a training step on a plan for inference only (StepConfig::forward_only)".into(),
        ))
    }

    fn zero_grads(&self, dev: &Device) -> Result<(), CudaError> {
        profile::scope("zero grads");
        // SAFETY: the arena's gradient buffer holds `total` floats.
        unsafe { raw::zero(dev, self.arena.g.ptr(), self.arena.total()) }
    }

    /// g ← the micro-batch factor (`optim.cu` `micro_scale_grads`: before or `after` the
    /// backward) over the whole gradient buffer.
    fn micro_scale_grads(&self, dev: &Device, after: bool) -> Result<(), CudaError> {
        let total = self.arena.total();
        let (g, n, acc, ce) = (
            self.arena.g.ptr(),
            total as i64,
            self.micro_acc.ptr(),
            self.ce_out.ptr(),
        );
        let after = after as i32;
        // SAFETY: g holds `total` floats, micro_acc 3 doubles, ce_out 4.
        unsafe {
            launch(
                dev,
                "micro_scale_grads",
                grid_stride(total),
                &[&g, &n, &acc, &ce, &after],
            )
        }
    }

    /// After the backward: the rank objective's gradients added (with the schedule; ce_out[0],
    /// the step's mean loss, weighs them in the late stage), or, when the gates do not train,
    /// their gradients zeroed.
    fn record_gate_grads(&self, dev: &Device) -> Result<(), CudaError> {
        profile::scope("rank objective");
        if let Some(rank) = &self.rank {
            return rank.record_objective(dev, &self.arena, &self.table, self.ce_out.ptr());
        }
        if self.train_gates {
            return Ok(());
        }
        for t in self
            .arena
            .tensors
            .iter()
            .filter(|t| t.kind == ParamKind::RankGate)
        {
            // SAFETY: a tensor of the arena: `len` floats at `offset` of the gradient buffer.
            unsafe { raw::zero(dev, self.arena.g.ptr() + 4 * t.offset as u64, t.len)? };
        }
        Ok(())
    }

    /// Gradient norm and clip factor, AdamW, and the gates' projection (with the schedule).
    fn record_update(&self, dev: &Device) -> Result<(), CudaError> {
        profile::scope("update");
        self.update(dev)?;
        match &self.rank {
            Some(rank) => {
                profile::scope("rank projection");
                rank.record_project(dev, &self.arena, self.clip.ptr())
            }
            None => Ok(()),
        }
    }

    /// Queues one evaluation pass over the batch loaded last: the forward with dropout off
    /// (the CPU's `Encoder::forward(st, false, _)`), no backward; it leaves the logits
    /// (head rows × C, row-major) in the plan's logits buffer for [`EncoderPlan::logits`]. A
    /// masked-LM head also computes its loss over the labelled rows (no gradient) for
    /// [`EncoderPlan::loss_stats`]: its logits (R × V′) are too many to read back per batch,
    /// while a classifier's loss, accuracy and class table are the host's, from the logits.
    /// Parameters, gradients, moments and the dropout step are not touched, so it may run
    /// between training steps (an evaluation during training) or in a session opened for
    /// inference only. Like [`EncoderPlan::record_step`] it allocates nothing and waits for
    /// nothing, so it can be captured as a graph.
    pub fn record_eval_forward(&self, dev: &Device) -> Result<(), CudaError> {
        self.forward(dev, &self.blas.handle, false)?;
        match self.head {
            HeadPlan::Classifier(_) => Ok(()),
            HeadPlan::Mlm(_) => self.loss(dev, false),
        }
    }

    /// The logits of the last pass (head rows × C, row-major: B × classes, or a masked-LM
    /// head's R × V′; waits for the stream).
    pub fn logits(&self, dev: &Device) -> Result<Vec<f32>, CudaError> {
        dev.stream()
            .clone_dtoh(self.logits.slice())
            .map_err(driver("reading the logits"))
    }

    /// The logits' row length: the classifier's classes C, or the MLM decoder's width V′.
    pub fn classes(&self) -> usize {
        self.classes
    }

    /// Rows of the logits: B for a classifier, the MLM head's row capacity R.
    pub fn head_rows(&self) -> usize {
        self.head_rows
    }

    fn step_ptr(&self) -> u64 {
        self.step.ptr()
    }

    /// Token rows gathered from a table: out[i] = src[slot[i]] (embedding.cu).
    fn gather(
        &self,
        dev: &Device,
        src: u64,
        slot: u64,
        rows: usize,
        out: u64,
    ) -> Result<(), CudaError> {
        gather_rows(dev, self.d, src, slot, rows, out)
    }

    /// dst[row u] (+)= Σ_{tokens of segment u, in token order} dy[token] (embedding.cu).
    #[allow(clippy::too_many_arguments)]
    fn segment_sum(
        &self,
        dev: &Device,
        dy: u64,
        order: u64,
        start: u64,
        dst_row: u64,
        segments: usize,
        accumulate: bool,
        dst: u64,
    ) -> Result<(), CudaError> {
        let segs = Segs {
            order,
            start,
            dst_row,
            segments,
        };
        segment_sum_rows(dev, self.d, dy, segs, accumulate, dst)
    }

    /// The head layout of one projection in rows (`to_heads`) or back.
    fn permute(&self, dev: &Device, src: u64, dst: u64, to_heads: bool) -> Result<(), CudaError> {
        let (b, t, h, dh, w) = (
            self.b as i32,
            self.t as i32,
            self.heads as i32,
            (self.d / self.heads) as i32,
            self.d as i32,
        );
        let (zero, dir) = (0i32, to_heads as i32);
        // SAFETY: both sides hold B·T·D floats.
        unsafe {
            launch(
                dev,
                "heads_permute",
                grid_stride(self.b * self.t * self.d),
                &[&src, &dst, &b, &t, &h, &dh, &w, &zero, &dir],
            )
        }
    }

    /// The forward to the logits (B × C). With `train`, dropout is on (masks from the device
    /// step counter); without, every dropout site is the identity (the residual sums are
    /// plain adds), as the CPU's forward with `train = false`.
    fn forward(&self, dev: &Device, blas: &CudaBlas, train: bool) -> Result<(), CudaError> {
        let (b, t, d, n) = (self.b, self.t, self.d, self.b * self.t);
        let nd = n * d;
        let step = self.step_ptr();
        // Every TT layer's gated cores H_c, all at once ([`GateTable`]).
        profile::scope("fwd gated cores");
        if let Some(g) = &self.gates {
            g.record_gate(dev)?;
        }
        profile::scope("fwd embeddings");
        // Embeddings: word rows (TTM: the distinct ids' rows, then gathered), + pos + type.
        match &self.word {
            Word::Dense { table } => {
                self.gather(dev, table.w, self.slot.ptr(), n, self.emb.ptr())?
            }
            Word::Ttm(w) => {
                let Ttm {
                    layout,
                    meta,
                    cores,
                    gates,
                    distinct,
                    live,
                    rows,
                    ..
                } = &**w;
                let (c, chain) = (n as i32, layout.chain as i32);
                let (mp, ids, out, lv) = (meta.ptr(), distinct.ptr(), rows.ptr(), live.ptr());
                let cfg = LaunchConfig {
                    shared_mem_bytes: (2 * layout.chain * 4) as u32,
                    ..grid(n as u32, 1, BLOCK)
                };
                // SAFETY: cores and gates laid out as the patched meta says; N distinct ids
                // (padded with id 0) below the table's rows, the first live[0] of them the
                // batch's; rows holds N·D floats; two chain buffers of shared memory (≤ 48 KiB,
                // checked by TtmLayout::new).
                unsafe {
                    launch(
                        dev,
                        "ttm_rows",
                        cfg,
                        &[
                            &cores.w, &gates.w, &mp, &self.tau, &ids, &c, &chain, &out, &lv,
                        ],
                    )?
                };
                self.gather(dev, out, self.slot.ptr(), n, self.emb.ptr())?;
            }
        }
        let (emb, tmp) = (self.emb.ptr(), self.tmp.ptr());
        let nn = nd as i64;
        self.gather(dev, self.pos.w, self.pos_ids.ptr(), n, tmp)?;
        // SAFETY: emb and tmp hold N·D floats.
        unsafe { launch(dev, "add_into", grid_stride(nd), &[&emb, &tmp, &nn])? };
        self.gather(dev, self.types.w, self.types_ids.ptr(), n, tmp)?;
        // SAFETY: as above.
        unsafe { launch(dev, "add_into", grid_stride(nd), &[&emb, &tmp, &nn])? };
        let x0 = self.x0.ptr();
        self.ln_emb.forward(dev, emb, x0)?;
        if train {
            self.drop_emb.apply(dev, step, x0, x0, nd)?;
        }
        // Blocks.
        let (h, dh) = (self.heads, d / self.heads);
        let units = b * h;
        let scale = 1.0 / (dh as f32).sqrt();
        let mut x = x0;
        for blk in &self.blocks {
            profile::scope("fwd q/k/v");
            let tq = self.tq.ptr();
            let attn_in = if blk.pre_ln {
                blk.ln1.forward(dev, x, blk.lx.ptr())?;
                blk.lx.ptr()
            } else {
                x
            };
            for (lin, dst) in [(&blk.q, &blk.qh), (&blk.k, &blk.kh), (&blk.v, &blk.vh)] {
                lin.forward(dev, blas, attn_in, tq)?;
                self.permute(dev, tq, dst.ptr(), true)?;
            }
            profile::scope("fwd attention");
            // SAFETY: (B·H) units of T × dh heads and T × T scores, packed.
            unsafe {
                Gemm::new(t, t, dh, false, true).run_batched(
                    blas,
                    blk.qh.ptr(),
                    t * dh,
                    blk.kh.ptr(),
                    t * dh,
                    blk.p.ptr(),
                    t * t,
                    units,
                )?;
            }
            let (u, hh, tt, causal, null) = (units as i32, h as i32, t as i32, 0i32, 0u64);
            let (pp, al) = (blk.p.ptr(), self.allow.ptr());
            // SAFETY: P holds units·T·T floats, allow B·T; no stats.
            unsafe {
                launch(
                    dev,
                    "softmax_rows_forward",
                    grid(((units * t) as u32).div_ceil(BLOCK / 32), 1, BLOCK),
                    &[&pp, &al, &u, &hh, &tt, &scale, &causal, &null],
                )?;
                Gemm::new(t, dh, t, false, false).run_batched(
                    blas,
                    pp,
                    t * t,
                    blk.vh.ptr(),
                    t * dh,
                    self.oh.ptr(),
                    t * dh,
                    units,
                )?;
            }
            self.permute(dev, self.oh.ptr(), blk.att.ptr(), false)?;
            profile::scope("fwd o");
            // The row-wise part on R rows (the [CLS] rows of the last block).
            let r = blk.rows;
            let (xr, att) = if r == n {
                (x, blk.att.ptr())
            } else {
                self.gather(dev, x, self.cls_slot.ptr(), r, blk.x_rows.ptr())?;
                self.gather(
                    dev,
                    blk.att.ptr(),
                    self.cls_slot.ptr(),
                    r,
                    blk.att_rows.ptr(),
                )?;
                (blk.x_rows.ptr(), blk.att_rows.ptr())
            };
            let o = self.tmp.ptr();
            blk.o.forward(dev, blas, att, o)?;
            blk.drop_attn
                .residual(dev, train, step, xr, o, blk.r1.ptr(), r * d)?;
            profile::scope("fwd residual + layernorm");
            let ln_r1 = if blk.pre_ln { &blk.ln2 } else { &blk.ln1 };
            ln_r1.forward(dev, blk.r1.ptr(), blk.x1.ptr())?;
            profile::scope("fwd ffn");
            blk.up.forward(dev, blas, blk.x1.ptr(), blk.h.ptr())?;
            let (hp, gp, rf) = (blk.h.ptr(), self.g.ptr(), (r * self.ffn) as i64);
            // SAFETY: h and g hold R·F floats.
            unsafe {
                launch(
                    dev,
                    "gelu_forward",
                    grid_stride(r * self.ffn),
                    &[&hp, &gp, &rf],
                )?
            };
            let f = self.f.ptr();
            blk.down.forward(dev, blas, gp, f)?;
            profile::scope("fwd residual + layernorm");
            if blk.pre_ln {
                blk.drop_ffn
                    .residual(dev, train, step, blk.r1.ptr(), f, blk.out.ptr(), r * d)?;
            } else {
                blk.drop_ffn
                    .residual(dev, train, step, blk.x1.ptr(), f, blk.r2.ptr(), r * d)?;
                blk.ln2.forward(dev, blk.r2.ptr(), blk.out.ptr())?;
            }
            x = blk.out.ptr();
        }
        profile::scope("fwd head");
        if let Some(ln) = &self.ln_final {
            ln.forward(dev, x, self.hfinal.ptr())?;
            x = self.hfinal.ptr();
        }
        let c = match &self.head {
            HeadPlan::Mlm(m) => return m.forward(dev, blas, x, self.logits.ptr()),
            HeadPlan::Classifier(c) => c,
        };
        // Head on the [CLS] rows (the last block already ran on them only).
        let hcls = c.hcls.ptr();
        let last_rows = self.blocks.last().map_or(n, |l| l.rows);
        if last_rows == n {
            self.gather(dev, x, self.cls_slot.ptr(), b, hcls)?;
        } else {
            // SAFETY: both hold B·D floats.
            unsafe { raw::copy(dev, hcls, x, b * d)? };
        }
        let (pre, pooled) = (c.pre.ptr(), c.pooled.ptr());
        c.pool.forward(dev, blas, hcls, pre)?;
        let bd = (b * d) as i64;
        // SAFETY: pre and pooled hold B·D floats.
        unsafe {
            launch(
                dev,
                "tanh_forward",
                grid_stride(b * d),
                &[&pre, &pooled, &bd],
            )?
        };
        if train {
            c.drop.apply(dev, step, pooled, pooled, b * d)?;
        }
        c.cls.forward(dev, blas, pooled, self.logits.ptr())
    }

    /// Cross-entropy of the logits against the batch's labels, and ∂L/∂logits.
    fn loss(&self, dev: &Device, with_grad: bool) -> Result<(), CudaError> {
        profile::scope("loss");
        // Cross-entropy, mean over the counted rows (a classifier's B, no label ignored; the
        // masked-LM head's labelled rows of R), and ∂L/∂logits when `with_grad`.
        let b = self.head_rows;
        let ignore = match self.head {
            HeadPlan::Classifier(_) => i32::MIN,
            HeadPlan::Mlm(_) => comera_layers::loss::IGNORE_INDEX,
        };
        let (rows, classes, write) = (b as i32, self.classes as i32, with_grad as i32);
        let (lg, lb, cnt, dl) = (
            self.logits.ptr(),
            self.label.ptr(),
            self.ce_count.ptr(),
            self.dlogits.ptr(),
        );
        let (rl, rh, out) = (
            self.ce_row_loss.ptr(),
            self.ce_row_hit.ptr(),
            self.ce_out.ptr(),
        );
        // SAFETY: logits and their gradient hold rows·C floats, labels and the row buffers rows
        // (the head's rows), out 4.
        unsafe {
            launch(
                dev,
                "cross_entropy_count",
                grid(1, 1, 1024),
                &[&lb, &rows, &ignore, &cnt],
            )?;
            launch(
                dev,
                "cross_entropy_rows",
                grid(b as u32, 1, BLOCK),
                &[
                    &lg, &lb, &rows, &classes, &ignore, &cnt, &write, &dl, &rl, &rh,
                ],
            )?;
            launch(
                dev,
                "cross_entropy_reduce",
                grid(1, 1, 1024),
                &[&rl, &rh, &rows, &cnt, &out],
            )?;
        }
        Ok(())
    }

    fn backward(&self, dev: &Device, blas: &CudaBlas) -> Result<(), CudaError> {
        let (b, t, d, n) = (self.b, self.t, self.d, self.b * self.t);
        let nd = n * d;
        let step = self.step_ptr();
        let dflow = self.dflow.ptr();
        let last_rows = self.blocks.last().map_or(n, |l| l.rows);
        profile::scope("bwd head");
        match &self.head {
            // ∂L/∂H of the selected rows, scattered into N rows.
            HeadPlan::Mlm(m) => m.backward(dev, blas, self.dlogits.ptr(), dflow, n)?,
            HeadPlan::Classifier(c) => self.classifier_backward(dev, blas, c, last_rows)?,
        }
        if let (Some(ln), Some(last)) = (&self.ln_final, self.blocks.last()) {
            // Through the final LN (pre-LN), on the last block's R output rows.
            let dt1 = self.dt1.ptr();
            ln.backward(dev, last.out.ptr(), dflow, 0, dt1)?;
            // SAFETY: both hold at least R·D floats.
            unsafe { raw::copy(dev, dflow, dt1, last_rows * d)? };
        }
        let (h, dh) = (self.heads, d / self.heads);
        let units = b * h;
        let scale = 1.0 / (dh as f32).sqrt();
        for (l, blk) in self.blocks.iter().enumerate().rev() {
            let r = blk.rows;
            let x = if l == 0 {
                self.x0.ptr()
            } else {
                self.blocks[l - 1].out.ptr()
            };
            let att = if r == n {
                blk.att.ptr()
            } else {
                blk.att_rows.ptr()
            };
            profile::scope("bwd residual + layernorm");
            let (dt1, dt2, dt3) = (self.dt1.ptr(), self.dt2.ptr(), self.dt3.ptr());
            if blk.pre_ln {
                // g_f = D(g_out).
                blk.drop_ffn.apply(dev, step, dflow, dt2, r * d)?;
            } else {
                // g_r2 = LN2'ᵀ g_out; g_f = D(g_r2).
                blk.ln2.backward(dev, blk.r2.ptr(), dflow, 0, dt1)?;
                blk.drop_ffn.apply(dev, step, dt1, dt2, r * d)?;
            }
            profile::scope("bwd ffn");
            // FFN: g = GELU(h) again for Down's backward; g_h = (Downᵀ g_f) ⊙ GELU'(h).
            let (hp, gp, dgp, dhp) = (blk.h.ptr(), self.g.ptr(), self.dg.ptr(), self.dhh.ptr());
            let rf = (r * self.ffn) as i64;
            // SAFETY: h, g, dg and dhh hold at least R·F floats.
            unsafe {
                launch(
                    dev,
                    "gelu_forward",
                    grid_stride(r * self.ffn),
                    &[&hp, &gp, &rf],
                )?
            };
            blk.down.backward(dev, blas, gp, dt2, Some((dgp, false)))?;
            // SAFETY: as above.
            unsafe {
                launch(
                    dev,
                    "gelu_backward",
                    grid_stride(r * self.ffn),
                    &[&hp, &dgp, &dhp, &rf],
                )?
            };
            blk.up
                .backward(dev, blas, blk.x1.ptr(), dhp, Some((dt3, false)))?;
            if blk.pre_ln {
                // g_r1 = LN2'ᵀ (Upᵀ…) + g_out (the CPU's sum, in either order the same bits).
                blk.ln2.backward(dev, blk.r1.ptr(), dt3, 0, dt2)?;
                let rd = (r * d) as i64;
                // SAFETY: dt2 and dflow hold at least R·D floats.
                unsafe { launch(dev, "add_into", grid_stride(r * d), &[&dt2, &dflow, &rd])? };
            } else {
                // g_r1 = LN1'ᵀ (g_r2 + Upᵀ…).
                blk.ln1.backward(dev, blk.r1.ptr(), dt1, dt3, dt2)?;
            }
            profile::scope("bwd o");
            // g_o = D(g_r1).
            blk.drop_attn.apply(dev, step, dt2, dt3, r * d)?;
            // g_att = Oᵀ g_o (R rows), into N rows for the attention backward.
            let datt = self.datt.ptr();
            if r == n {
                blk.o.backward(dev, blas, att, dt3, Some((datt, false)))?;
            } else {
                blk.o.backward(dev, blas, att, dt3, Some((dt1, false)))?;
                // SAFETY: datt holds N·D floats.
                unsafe { raw::zero(dev, datt, nd)? };
                self.segment_sum(
                    dev,
                    dt1,
                    self.seq_order.ptr(),
                    self.seq_start.ptr(),
                    self.cls_slot.ptr(),
                    b,
                    false,
                    datt,
                )?;
            }
            profile::scope("bwd attention");
            // Attention: dV = Pᵀ·dO, dP = dO·Vᵀ, dS = softmax'(dP), dQ = dS·K, dK = dSᵀ·Q.
            let doh = self.oh.ptr();
            self.permute(dev, datt, doh, true)?;
            let (pp, dpp) = (blk.p.ptr(), self.dp.ptr());
            let (u, tt) = (units as i32, t as i32);
            // SAFETY: (B·H) units of T × dh heads and T × T probabilities, packed.
            unsafe {
                Gemm::new(t, dh, t, true, false).run_batched(
                    blas,
                    pp,
                    t * t,
                    doh,
                    t * dh,
                    self.dvh.ptr(),
                    t * dh,
                    units,
                )?;
                Gemm::new(t, t, dh, false, true).run_batched(
                    blas,
                    doh,
                    t * dh,
                    blk.vh.ptr(),
                    t * dh,
                    dpp,
                    t * t,
                    units,
                )?;
                launch(
                    dev,
                    "softmax_rows_backward",
                    grid(((units * t) as u32).div_ceil(BLOCK / 32), 1, BLOCK),
                    &[&pp, &dpp, &u, &tt, &scale],
                )?;
                Gemm::new(t, dh, t, false, false).run_batched(
                    blas,
                    dpp,
                    t * t,
                    blk.kh.ptr(),
                    t * dh,
                    self.dqh.ptr(),
                    t * dh,
                    units,
                )?;
                Gemm::new(t, dh, t, true, false).run_batched(
                    blas,
                    dpp,
                    t * t,
                    blk.qh.ptr(),
                    t * dh,
                    self.dkh.ptr(),
                    t * dh,
                    units,
                )?;
            }
            // The residual's share of g_x (g_r1, R rows) is kept in dt2 until the end.
            // Pre-LN: q/k/v's input gradient (into dt1, free by now) goes through LN1.
            let tq = self.tq.ptr();
            let (qkv_in, dqkv_in) = if blk.pre_ln {
                (blk.lx.ptr(), dt1)
            } else {
                (x, dflow)
            };
            profile::scope("bwd q/k/v");
            let mut first = true;
            for (lin, dsrc) in [
                (&blk.q, &self.dqh),
                (&blk.k, &self.dkh),
                (&blk.v, &self.dvh),
            ] {
                self.permute(dev, dsrc.ptr(), tq, false)?;
                lin.backward(dev, blas, qkv_in, tq, Some((dqkv_in, !first)))?;
                first = false;
            }
            if blk.pre_ln {
                blk.ln1.backward(dev, x, dt1, 0, dflow)?;
            }
            profile::scope("bwd residual + layernorm");
            let nn = nd as i64;
            if r == n {
                // SAFETY: both hold N·D floats.
                unsafe { launch(dev, "add_into", grid_stride(nd), &[&dflow, &dt2, &nn])? };
            } else {
                self.segment_sum(
                    dev,
                    dt2,
                    self.seq_order.ptr(),
                    self.seq_start.ptr(),
                    self.cls_slot.ptr(),
                    b,
                    true,
                    dflow,
                )?;
            }
        }
        profile::scope("bwd embeddings");
        // Embeddings.
        self.drop_emb.apply(dev, step, dflow, dflow, nd)?;
        let demb = self.dt1.ptr();
        self.ln_emb.backward(dev, self.emb.ptr(), dflow, 0, demb)?;
        let null = 0u64;
        match &self.word {
            Word::Dense { table } => self.segment_sum(
                dev,
                demb,
                self.seg_order.ptr(),
                self.seg_start.ptr(),
                self.seg_dst.ptr(),
                n,
                true,
                table.g,
            )?,
            Word::Ttm(w) => {
                let Ttm {
                    layout,
                    meta,
                    cores,
                    gates,
                    distinct,
                    live,
                    rows,
                    slab,
                    dh,
                    digits,
                } = &**w;
                // Per distinct id, its tokens' gradients summed in token order (padding: 0).
                self.segment_sum(
                    dev,
                    demb,
                    self.seg_order.ptr(),
                    self.seg_start.ptr(),
                    null,
                    n,
                    false,
                    rows.ptr(),
                )?;
                let (c, chain, total) = (n as i32, layout.chain as i32, layout.slab_total as i32);
                let (mp, ids, dr, sl) = (meta.ptr(), distinct.ptr(), rows.ptr(), slab.ptr());
                let lv = live.ptr();
                let cfg = LaunchConfig {
                    shared_mem_bytes: (3 * layout.chain * 4) as u32,
                    ..grid(n as u32, 1, BLOCK)
                };
                // SAFETY: as ttm_rows; drows N·D and slab N·slab_total floats (the rows past
                // live[0] neither computed nor read by the per-digit sums below).
                unsafe {
                    launch(
                        dev,
                        "ttm_slab_grads",
                        cfg,
                        &[
                            &cores.w, &gates.w, &mp, &self.tau, &ids, &c, &chain, &dr, &sl, &lv,
                        ],
                    )?
                };
                for (core, (dorder, dstart)) in layout.cores.iter().zip(digits) {
                    let [ra, vk, ek, rb] = core.shape.map(|x| x as i32);
                    let len = core.len();
                    let soff = core.slab_offset as i32;
                    let (o, st, dhp) = (dorder.ptr(), dstart.ptr(), dh.ptr());
                    let cw = cores.w + 4 * core.offset as u64;
                    let cg = cores.g + 4 * core.offset as u64;
                    let rows = (core.shape[0] * core.shape[1] * core.shape[2]) as i64;
                    // SAFETY: dh holds the largest core; the digit segments index the real
                    // distinct ids' rows of slab; core and gate addresses follow the patched
                    // layout inside the arena.
                    unsafe {
                        launch(
                            dev,
                            "ttm_core_grad_sums",
                            grid_stride(len),
                            &[&sl, &total, &soff, &o, &st, &ra, &vk, &ek, &rb, &dhp],
                        )?;
                        let (gw, gg) = match core.gate_offset {
                            Some(g) => (gates.w + 4 * g as u64, gates.g + 4 * g as u64),
                            None => (0, 0),
                        };
                        launch(
                            dev,
                            "gated_grads_core",
                            grid_stride(len),
                            &[&dhp, &gw, &rows, &rb, &self.tau, &cg],
                        )?;
                        if gw != 0 {
                            launch(
                                dev,
                                "gated_grads_gate",
                                grid((rb as u32).div_ceil(BLOCK), 1, BLOCK),
                                &[&dhp, &cw, &gw, &rows, &rb, &self.tau, &gg],
                            )?;
                        }
                    }
                }
            }
        }
        self.segment_sum(
            dev,
            demb,
            self.pos_order.ptr(),
            self.pos_start.ptr(),
            null,
            t,
            true,
            self.pos.g,
        )?;
        self.segment_sum(
            dev,
            demb,
            self.type_order.ptr(),
            self.type_start.ptr(),
            null,
            self.type_start.len() - 1,
            true,
            self.types.g,
        )?;
        profile::scope("bwd gated cores");
        // Every TT layer's gated cores: their gradients through the gates, all at once.
        match &self.gates {
            Some(g) => g.record_grads(dev),
            None => Ok(()),
        }
    }

    /// The classifier head's backward from ∂L/∂logits: its gradients, and ∂L/∂(the last
    /// block's output) in `dflow` (its B [CLS] rows, or scattered into N rows).
    fn classifier_backward(
        &self,
        dev: &Device,
        blas: &CudaBlas,
        c: &ClsHead,
        last_rows: usize,
    ) -> Result<(), CudaError> {
        let (b, d, n) = (self.b, self.d, self.b * self.t);
        let nd = n * d;
        let step = self.step_ptr();
        let (pooled, dpooled, pre, hcls, dcls) = (
            c.pooled.ptr(),
            c.dpooled.ptr(),
            c.pre.ptr(),
            c.hcls.ptr(),
            c.dcls.ptr(),
        );
        c.cls.backward(
            dev,
            blas,
            pooled,
            self.dlogits.ptr(),
            Some((dpooled, false)),
        )?;
        c.drop.apply(dev, step, dpooled, dpooled, b * d)?;
        let bd = (b * d) as i64;
        // SAFETY: pre and dpooled hold B·D floats.
        unsafe {
            launch(
                dev,
                "tanh_backward",
                grid_stride(b * d),
                &[&pre, &dpooled, &bd],
            )?
        };
        c.pool
            .backward(dev, blas, hcls, dpooled, Some((dcls, false)))?;
        // ∂L/∂(last block output): its B rows are the [CLS] rows (or scattered into N rows).
        let dflow = self.dflow.ptr();
        if last_rows == n {
            // SAFETY: dflow holds N·D floats.
            unsafe { raw::zero(dev, dflow, nd)? };
            self.segment_sum(
                dev,
                dcls,
                self.seq_order.ptr(),
                self.seq_start.ptr(),
                self.cls_slot.ptr(),
                b,
                false,
                dflow,
            )?;
        } else {
            // SAFETY: both hold B·D floats.
            unsafe { raw::copy(dev, dflow, dcls, b * d)? };
        }
        Ok(())
    }

    /// Gradient norm and clip factor, then AdamW over the whole arena (optim.cu).
    fn update(&self, dev: &Device) -> Result<(), CudaError> {
        let total = self.arena.total();
        let parts = Device::grad_norm_partial_len(total);
        let (g, part, norm, clip) = (
            self.arena.g.ptr(),
            self.norm_partial.ptr(),
            self.norm.ptr(),
            self.clip.ptr(),
        );
        let (nn, per, first) = (total as i64, ops::GRAD_NORM_PER_BLOCK as i64, 0i32);
        let p = parts as i32;
        let tau = self.consts.freeze_gates_at.unwrap_or(-1.0);
        let t = &self.table;
        let (off, len, tiles, starts, lr, decay, gate) = (
            raw_ptr(&t.offset, dev),
            raw_ptr(&t.len, dev),
            raw_ptr(&t.tile_tensor, dev),
            raw_ptr(&t.tile_start, dev),
            raw_ptr(&t.lr, dev),
            raw_ptr(&t.decay, dev),
            raw_ptr(&t.gate, dev),
        );
        let (w, m, v, sc) = (
            self.arena.w.ptr(),
            self.arena.m.ptr(),
            self.arena.v.ptr(),
            self.scalars.ptr(),
        );
        let (b1, b2, eps) = (self.consts.beta1, self.consts.beta2, self.consts.eps);
        // AdamW always reads the clip factor, also without clipping (max_norm 0: the factor is
        // then exactly 1 for a finite norm), so that a non-finite norm (NaN factor) skips the
        // update as the CPU does, rather than writing NaN into the parameters and moments.
        // SAFETY: g holds `total` floats and the partials one per chunk of
        // GRAD_NORM_PER_BLOCK; norm and clip one value each; AdamW's table tiles 0..total of
        // the four flat buffers (built in `new`), scalars 3.
        unsafe {
            launch(
                dev,
                "grad_sum_squares",
                grid(parts as u32, 1, BLOCK),
                &[&g, &nn, &per, &first, &part],
            )?;
            launch(
                dev,
                "grad_norm_finish",
                grid(1, 1, 1024),
                &[&part, &p, &self.max_norm, &norm, &clip],
            )?;
            launch(
                dev,
                "adamw_update",
                grid(t.tiles() as u32, 1, BLOCK),
                &[
                    &w, &g, &m, &v, &off, &len, &tiles, &starts, &lr, &decay, &gate, &sc, &clip,
                    &b1, &b2, &eps, &tau,
                ],
            )
        }
    }
}

/// out (rows × D) = src[slot[i]] (embedding.cu `gather_rows`).
pub(super) fn gather_rows(
    dev: &Device,
    d: usize,
    src: u64,
    slot: u64,
    rows: usize,
    out: u64,
) -> Result<(), CudaError> {
    let (r, di) = (rows as i32, d as i32);
    // SAFETY: slot holds `rows` indices below src's rows; out rows·D floats.
    unsafe {
        launch(
            dev,
            "gather_rows",
            grid(rows as u32, 1, BLOCK),
            &[&src, &slot, &r, &di, &out],
        )
    }
}

/// Segments of rows: segment u is `order[start[u] .. start[u + 1]]`, summed into row
/// `dst_row[u]` (or row u when `dst_row` is null).
pub(super) struct Segs {
    pub order: u64,
    pub start: u64,
    pub dst_row: u64,
    pub segments: usize,
}

/// dst[row u] (+)= Σ_{rows of segment u, in order} dy[row] (embedding.cu `segment_sum_rows`;
/// an empty segment that accumulates touches nothing).
pub(super) fn segment_sum_rows(
    dev: &Device,
    d: usize,
    dy: u64,
    s: Segs,
    accumulate: bool,
    dst: u64,
) -> Result<(), CudaError> {
    let (order, start, dst_row) = (s.order, s.start, s.dst_row);
    let (sg, di, acc) = (s.segments as i32, d as i32, accumulate as i32);
    // SAFETY: order/start describe `segments` segments of rows of dy; dst_row (or row u
    // when null) addresses rows of dst.
    unsafe {
        launch(
            dev,
            "segment_sum_rows",
            grid(s.segments as u32, 1, BLOCK),
            &[&dy, &order, &start, &dst_row, &sg, &di, &acc, &dst],
        )
    }
}

/// `what` has `len` values where the plan takes `want`.
fn check_len(what: &str, len: usize, want: usize) -> Result<(), CudaError> {
    if len == want {
        return Ok(());
    }
    Err(CudaError::Plan(format!(
        "{what}: {len} values, the plan takes {want}"
    )))
}

/// The device address of a cudarc buffer the plan owns for its whole life.
pub(super) fn raw_ptr<T>(s: &cudarc::driver::CudaSlice<T>, dev: &Device) -> u64 {
    use cudarc::driver::DevicePtr;
    let (p, _sync) = s.device_ptr(dev.stream());
    p
}
