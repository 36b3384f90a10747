//! `TtLinear`: a linear layer whose weight lives as tensor-train cores with rank gates.
//!
//! W (N × M) = G_0·D_1·G_1·D_2 ⋯ D_{K-1}·G_{K-1} (SPEC §1, §6), never stored dense. Every path
//! works on the *gated cores* H_c = G_c·diag(g(d_{c+1})) (H_{K-1} = G_{K-1}), formed once per
//! step; the backward of any path yields dH_c, from which
//!   dG_c = dH_c·diag(g(d_{c+1})),   dd_{c+1}[j] = Σ_{a,s} dH_c[a,s,j]·G_c[a,s,j]  (d_j > τ only).
//! A pruned gate entry (d ≤ τ) zeroes its rank slice in H, so the slice contributes nothing and
//! every gradient through it is exactly zero.

mod chain;
mod dense;
mod ffn;
mod lanes;
mod merged;
pub(crate) mod pool;
mod sequential;
mod shared;

pub use ffn::FusedFfn;
pub use pool::{clear_pool as clear_scratch_pool, pooled_bytes as scratch_pool_bytes};
use pool::{Lease, Scratch};
pub use shared::SharedInput;

use crate::compress;
use crate::{
    accumulate_bias_grad, add_bias, check_len, Layer, LayerError, Param, ParamKind, RankGates,
};
use comera_plan::{ContractionPlan, CostModel, Pass, TtPath};
use comera_tensor::{init, matmul, MatMut, MatRef, TtShape};

/// A TT linear layer `Y = X·W + b`.
///
/// A 16 → 16 layer over in modes `[4, 4]` and out modes `[4, 4]` at rank 3: its forward is
/// `X·W + b` with W the dense weight its cores represent, and its backward writes
/// `dX = dY·Wᵀ` and accumulates every core's gradient.
///
/// ```
/// use comera_layers::{Layer, RankGates, TtLinear};
/// use comera_tensor::{init, TtShape};
///
/// let mut rng = init::rng(1);
/// let shape = TtShape::uniform(&[4, 4], &[4, 4], 3)?;
/// let mut layer = TtLinear::new("fc", shape, RankGates::default(), &mut rng)?;
/// init::fill_normal(&mut rng, &mut layer.bias.value, 0.1);
/// let (batch, n, m) = (2, layer.in_features(), layer.out_features());
/// let mut x = vec![0.0; batch * n];
/// init::fill_normal(&mut rng, &mut x, 1.0);
///
/// // Scratch, saved intermediates and the contraction plan for this batch, made once.
/// let mut ws = layer.workspace(batch);
/// let mut y = vec![0.0; batch * m];
/// layer.forward(&mut ws, &x, &mut y);
///
/// let w = layer.dense_weight(); // N × M, row-major
/// let close = |got: f32, want: f64| (got as f64 - want).abs() <= 1e-5 * (1.0 + want.abs());
/// for b in 0..batch {
///     for j in 0..m {
///         let want: f64 = layer.bias.value[j] as f64
///             + (0..n).map(|i| x[b * n + i] as f64 * w[i * m + j] as f64).sum::<f64>();
///         assert!(close(y[b * m + j], want));
///     }
/// }
///
/// // Backward with dY = 1: dX = dY·Wᵀ; the gradients (zeroed by `zero_grad`) accumulate.
/// let dy = vec![1.0; batch * m];
/// let mut dx = vec![0.0; batch * n];
/// layer.zero_grad();
/// layer.backward(&mut ws, &x, &dy, Some(&mut dx));
/// for b in 0..batch {
///     for i in 0..n {
///         let want: f64 = (0..m).map(|j| w[i * m + j] as f64).sum();
///         assert!(close(dx[b * n + i], want));
///     }
/// }
/// assert!(layer.cores.iter().all(|c| c.grad.iter().any(|&g| g != 0.0)));
/// assert_eq!(layer.bias.grad, vec![batch as f32; m]);
/// # Ok::<(), comera_layers::LayerError>(())
/// ```
#[derive(Clone, Debug)]
pub struct TtLinear {
    shape: TtShape,
    rule: RankGates,
    /// Core c (0-based), shape (r_c, s_c, r_{c+1}).
    pub cores: Vec<Param>,
    /// Gate on bond c + 1 (0-based index c), between cores c and c + 1; length r_{c+1}.
    pub gates: Vec<Param>,
    pub bias: Param,
    /// Set by a truncation that left a bond without active entries: W = 0, so the layer
    /// skips its contraction and outputs its bias.
    dead: bool,
}

impl TtLinear {
    /// A freshly initialised layer: cores ~ N(0,1)/sqrt(r_{c+1}) · σ^(1/K), σ = sqrt(1/(N+M)),
    /// so that Var(W_ij) = 1/(N+M); gates at 1; bias 0.
    pub fn new(
        name: &str,
        shape: TtShape,
        rule: RankGates,
        rng: &mut init::Rng,
    ) -> Result<TtLinear, LayerError> {
        check_threshold(rule.threshold)?;
        let (n, m, k) = (shape.in_features(), shape.out_features(), shape.n_cores());
        let sigma = (1.0 / (n + m) as f64).sqrt();
        let scale = sigma.powf(1.0 / k as f64);
        let cores = (0..k)
            .map(|c| {
                let dims = shape.core_shape(c);
                let mut v = vec![0.0; shape.core_len(c)];
                init::fill_normal(rng, &mut v, (scale / (dims[2] as f64).sqrt()) as f32);
                Param::new(
                    format!("{name}.core.{}", c + 1),
                    &dims,
                    ParamKind::TtCore,
                    v,
                )
            })
            .collect();
        let gates = RankGates::initial_params(name, shape.ranks());
        let bias = Param::zeros(format!("{name}.bias"), &[m], ParamKind::Other);
        Ok(TtLinear {
            shape,
            rule,
            cores,
            gates,
            bias,
            dead: false,
        })
    }

    /// A layer from given values (cores in order, gates for bonds 1..K-1, bias), all checked
    /// against `shape`.
    pub fn from_parts(
        name: &str,
        shape: TtShape,
        rule: RankGates,
        cores: Vec<Vec<f32>>,
        gates: Vec<Vec<f32>>,
        bias: Vec<f32>,
    ) -> Result<TtLinear, LayerError> {
        check_threshold(rule.threshold)?;
        let k = shape.n_cores();
        let count = |what: &str, got: usize, want: usize| {
            if got == want {
                Ok(())
            } else {
                Err(LayerError::ParamShape {
                    name: format!("{name}.{what} (count)"),
                    expected: vec![want],
                    got: vec![got],
                })
            }
        };
        count("core", cores.len(), k)?;
        count("gate", gates.len(), k - 1)?;
        let check = |pname: String, v: &[f32], dims: &[usize]| {
            if v.len() == dims.iter().product::<usize>() {
                Ok(())
            } else {
                Err(LayerError::ParamShape {
                    name: pname,
                    expected: dims.to_vec(),
                    got: vec![v.len()],
                })
            }
        };
        let mut core_params = Vec::with_capacity(k);
        for (c, v) in cores.into_iter().enumerate() {
            let dims = shape.core_shape(c);
            let pname = format!("{name}.core.{}", c + 1);
            check(pname.clone(), &v, &dims)?;
            core_params.push(Param::new(pname, &dims, ParamKind::TtCore, v));
        }
        let mut gate_params = Vec::with_capacity(k - 1);
        for (b, v) in gates.into_iter().enumerate() {
            let dims = [shape.ranks()[b + 1]];
            let pname = format!("{name}.gate.{}", b + 1);
            check(pname.clone(), &v, &dims)?;
            gate_params.push(Param::new(pname, &dims, ParamKind::RankGate, v));
        }
        let m = shape.out_features();
        check(format!("{name}.bias"), &bias, &[m])?;
        let bias = Param::new(format!("{name}.bias"), &[m], ParamKind::Other, bias);
        Ok(TtLinear {
            shape,
            rule,
            cores: core_params,
            gates: gate_params,
            bias,
            dead: false,
        })
    }

    pub fn shape(&self) -> &TtShape {
        &self.shape
    }

    pub fn rank_gates(&self) -> RankGates {
        self.rule
    }

    /// S: parameters of the surviving cores (SPEC §6).
    pub fn size_l0(&self) -> f64 {
        self.rule
            .params_size(|c| self.shape.mode(c), &self.gates, false)
    }

    /// Ŝ: the ℓ1 surrogate of S.
    pub fn size_l1(&self) -> f64 {
        self.rule
            .params_size(|c| self.shape.mode(c), &self.gates, true)
    }

    /// Accumulates `scale · ∂Ŝ/∂gates` into the gates' gradients.
    pub fn accumulate_size_l1_grad(&mut self, scale: f32) {
        let shape = &self.shape;
        self.rule
            .params_size_l1_grad_by(|c| shape.mode(c), &mut self.gates, scale);
    }

    /// The backward with ∂L/∂x *added* into `dx` (dx += ∂L/∂x): for an input that feeds
    /// several layers (attention's q, k and v). The merged path's row lanes add in their
    /// streamed dX product, so no N × D buffer is written and read back per layer; the other
    /// paths write ∂L/∂x into `tmp` (as long as `dx`) and add it. Either way the bits of
    /// [`Layer::backward`] into `tmp` followed by `add_into(dx, tmp)`.
    pub fn backward_adding_dx(
        &mut self,
        ws: &mut TtLinearWorkspace,
        x: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        tmp: &mut [f32],
    ) {
        if matches!(&ws.bufs, PathBuffers::Merged(p) if p.adds_dx()) {
            self.backward_into(ws, x, dy, Some(dx), true);
        } else {
            self.backward_into(ws, x, dy, Some(&mut *tmp), false);
            crate::elementwise::add_into(dx, tmp);
        }
    }

    /// [`Layer::backward`], writing ∂L/∂x into `dx` or, with `add_dx` (a path that
    /// [`Merged::adds_dx`]), adding it.
    fn backward_into(
        &mut self,
        ws: &mut TtLinearWorkspace,
        x: &[f32],
        dy: &[f32],
        dx: Option<&mut [f32]>,
        add_dx: bool,
    ) {
        assert!(
            ws.plan.is_valid_for(&self.shape, ws.batch),
            "TtLinear backward: ranks changed since forward"
        );
        let b = ws.batch;
        check_len("TtLinear x", x.len(), b * self.in_features());
        check_len("TtLinear dy", dy.len(), b * self.out_features());
        if let Some(dx) = dx.as_deref() {
            check_len("TtLinear dx", dx.len(), b * self.in_features());
        }
        if self.dead {
            // No gradient reaches the input: dx is 0, or unchanged when adding.
            if let (Some(dx), false) = (dx, add_dx) {
                dx.fill(0.0);
            }
            accumulate_bias_grad(dy, &mut self.bias.grad);
            return;
        }
        // The gated cores again (cheaper to redo than to keep per layer), then the path, then
        // the cores' and gates' gradients from dH.
        let (mut h, mut dh) = (ws.h.acquire(), ws.dh.acquire());
        let s = &self.shape;
        match &mut ws.bufs {
            // The merged path does all three itself (each chain's beside its products at small
            // batches), and sums the bias's gradient in its dR product (see `merged`).
            PathBuffers::Merged(p) => p.backward(self, &mut h, &mut dh, b, x, dy, dx, add_dx),
            PathBuffers::Sequential(p) => {
                self.gate_cores(&mut h);
                p.backward(s, &h, &mut dh, b, dy, dx);
                accumulate_bias_grad(dy, &mut self.bias.grad);
                self.accumulate_core_grads(&dh);
            }
            PathBuffers::Dense(p) => {
                self.gate_cores(&mut h);
                p.backward(s, &h, &mut dh, b, x, dy, dx);
                accumulate_bias_grad(dy, &mut self.bias.grad);
                self.accumulate_core_grads(&dh);
            }
        }
    }

    /// The dense weight W = L·R (N × M) the cores represent, for tests and export.
    pub fn dense_weight(&self) -> Vec<f32> {
        let s = &self.shape;
        let (n, m, rp) = sizes(s);
        let mut h_lease = Lease::new(core_lens(s));
        let mut h = h_lease.acquire();
        self.gate_cores(&mut h);
        let layout = chain::Chains::new(s);
        let mut product_lease = Lease::new(layout.product_lens().to_vec());
        let mut products = product_lease.acquire();
        let mut chains = layout.lent(&mut products, &mut []);
        chains.build(s, &h);
        let mut w = vec![0.0; n * m];
        matmul(
            MatMut::new(&mut w, n, m),
            MatRef::new(chains.l(), n, rp),
            MatRef::new(chains.r(), rp, m),
            false,
        );
        w
    }

    /// H_c = G_c·diag(g(d_{c+1})) for every core: the input cores and the output cores side by
    /// side (each core on its own; a few µs of element-wise work a layer call that a step of
    /// many calls would otherwise spend on one thread).
    fn gate_cores(&self, h: &mut [Scratch]) {
        let p = self.shape.p();
        let (h_in, h_out) = h.split_at_mut(p);
        comera_tensor::join(|| self.gate_side(0, h_in), || self.gate_side(p, h_out));
    }

    /// H_c for the cores `first..first + h.len()` into `h` (the last core has no gate: H = G).
    fn gate_side(&self, first: usize, h: &mut [Scratch]) {
        for (c, h) in (first..).zip(h.iter_mut()) {
            match self.gates.get(c) {
                Some(g) => self.rule.gate_core(&self.cores[c].value, &g.value, h),
                None => h.copy_from_slice(&self.cores[c].value),
            }
        }
    }

    /// dG_c += dH_c·diag(g), dd[j] += Σ dH_c[.., j]·G_c[.., j] (active entries only): the input
    /// and the output cores side by side, as in `gate_cores` (each core's sums on one thread,
    /// in the same order whatever the thread count).
    fn accumulate_core_grads(&mut self, dh: &[Scratch]) {
        let (dh_in, dh_out) = dh.split_at(self.shape.p());
        let (mut input, mut output) =
            CoreGrads::sides(self.rule, self.shape.p(), &mut self.cores, &mut self.gates);
        comera_tensor::join(|| input.accumulate(dh_in), || output.accumulate(dh_out));
    }
}

/// The cores and gates of one side of a layer (input cores 0..p or output cores p..K), whose
/// gradients a path accumulates from their dH_c (`accumulate`), apart from the other side's.
pub(crate) struct CoreGrads<'a> {
    rule: RankGates,
    cores: &'a mut [Param],
    /// The gates on the bonds after these cores (one fewer on the output side: the last core
    /// has none).
    gates: &'a mut [Param],
}

impl<'a> CoreGrads<'a> {
    /// The input and the output side of a layer's `cores` and `gates` (its rule, and its p:
    /// how many cores are on the input side).
    pub(crate) fn sides(
        rule: RankGates,
        p: usize,
        cores: &'a mut [Param],
        gates: &'a mut [Param],
    ) -> (CoreGrads<'a>, CoreGrads<'a>) {
        let (c_in, c_out) = cores.split_at_mut(p);
        let (g_in, g_out) = gates.split_at_mut(p.min(gates.len()));
        (
            CoreGrads {
                rule,
                cores: c_in,
                gates: g_in,
            },
            CoreGrads {
                rule,
                cores: c_out,
                gates: g_out,
            },
        )
    }

    /// dG_c += dH_c·diag(g), dd_{c+1} += Σ dH_c·G_c for this side's cores (`dh`: their dH_c).
    pub(crate) fn accumulate(&mut self, dh: &[Scratch]) {
        for (c, (core, dh)) in self.cores.iter_mut().zip(dh).enumerate() {
            self.rule
                .accumulate_chain_core(core, self.gates.get_mut(c), dh);
        }
    }
}

compress::impl_compressible!(
    TtLinear,
    dense_params: |s| s.in_features() * s.out_features(),
    with_ranks: |s, ranks| TtShape::new(s.in_modes(), s.out_modes(), ranks),
);

/// (N, M, r_p) of `shape`: the input and output widths and the middle rank, the sizes of
/// L (N × r_p) and R (r_p × M).
fn sizes(shape: &TtShape) -> (usize, usize, usize) {
    (
        shape.in_features(),
        shape.out_features(),
        shape.middle_rank(),
    )
}

/// Lengths of the cores of `shape`, in order (the gated cores H_c and their gradients dH_c).
fn core_lens(shape: &TtShape) -> Vec<usize> {
    (0..shape.n_cores()).map(|c| shape.core_len(c)).collect()
}

pub(crate) fn check_threshold(t: f32) -> Result<(), LayerError> {
    if t.is_finite() && t >= 0.0 {
        Ok(())
    } else {
        Err(LayerError::Threshold(t))
    }
}

/// The buffers of the path in use.
#[derive(Debug)]
enum PathBuffers {
    Merged(merged::Merged),
    Sequential(sequential::Sequential),
    Dense(dense::Dense),
}

/// Everything a `TtLinear` step needs for one batch size: the plan and the chosen path's saved
/// intermediates. Made once; re-planned (and only then reallocated) when the layer's ranks
/// change or a different path is forced. Buffers needed only during a call (gated cores, their
/// gradients, chain products, gradient scratch) are borrowed from a per-thread pool shared by
/// all layers (see [`scratch_pool_bytes`]), so a model holds one set of them, not one per layer.
#[derive(Debug)]
pub struct TtLinearWorkspace {
    batch: usize,
    pass: Pass,
    forced: Option<TtPath>,
    model: CostModel,
    plan: ContractionPlan,
    shape: TtShape,
    h: Lease,  // H_c (gated cores), scratch
    dh: Lease, // dH_c, scratch
    bufs: PathBuffers,
}

impl TtLinearWorkspace {
    fn new(
        shape: &TtShape,
        batch: usize,
        pass: Pass,
        forced: Option<TtPath>,
        model: CostModel,
    ) -> Self {
        let plan = match forced {
            Some(p) => ContractionPlan::fixed(shape, batch, pass, &model, p),
            None => ContractionPlan::for_tt_linear(shape, batch, pass, &model),
        };
        let bufs = match plan.path {
            TtPath::Merged => PathBuffers::Merged(merged::Merged::new(shape, batch)),
            TtPath::Sequential => {
                PathBuffers::Sequential(sequential::Sequential::new(shape, batch))
            }
            TtPath::Dense => PathBuffers::Dense(dense::Dense::new(shape)),
        };
        TtLinearWorkspace {
            batch,
            pass,
            forced,
            model,
            plan,
            shape: shape.clone(),
            h: Lease::new(core_lens(shape)),
            dh: Lease::new(core_lens(shape)),
            bufs,
        }
    }

    /// The plan in force (path and every path's estimate).
    pub fn plan(&self) -> &ContractionPlan {
        &self.plan
    }

    pub fn path(&self) -> TtPath {
        self.plan.path
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Forces a path (`None`: let the planner choose). Re-plans and reallocates.
    pub fn force_path(&mut self, path: Option<TtPath>) {
        *self =
            TtLinearWorkspace::new(&self.shape, self.batch, self.pass, path, self.model.clone());
    }

    /// Plans for inference only or for training with/without dX. Re-plans and reallocates.
    pub fn set_pass(&mut self, pass: Pass) {
        *self = TtLinearWorkspace::new(
            &self.shape,
            self.batch,
            pass,
            self.forced,
            self.model.clone(),
        );
    }

    /// Uses another machine model. Re-plans and reallocates.
    pub fn set_cost_model(&mut self, model: CostModel) {
        *self = TtLinearWorkspace::new(&self.shape, self.batch, self.pass, self.forced, model);
    }

    /// Counted FLOPs (2 per multiply-add, chain products included, as the planner counts
    /// them) of one forward and of one backward on the path in use.
    pub fn flops(&self) -> (f64, f64) {
        let fwd = comera_plan::tt_linear_cost(
            &self.shape,
            self.batch,
            self.plan.path,
            Pass::Forward,
            &self.model,
        )
        .flops;
        (fwd, self.plan.cost_of(self.plan.path).flops - fwd)
    }

    /// Bytes held by this workspace between calls (what the forward saves for the backward).
    pub fn bytes(&self) -> usize {
        match &self.bufs {
            PathBuffers::Merged(b) => b.bytes(),
            PathBuffers::Sequential(b) => b.bytes(),
            PathBuffers::Dense(b) => b.bytes(),
        }
    }

    /// Bytes this layer borrows from the thread's scratch pool during a backward call (the
    /// pool holds, after a step, at least the largest of these over the model's layers).
    pub fn scratch_bytes(&self) -> usize {
        self.h.bytes()
            + self.dh.bytes()
            + match &self.bufs {
                PathBuffers::Merged(b) => b.scratch_bytes(),
                PathBuffers::Sequential(b) => b.scratch_bytes(),
                PathBuffers::Dense(b) => b.scratch_bytes(),
            }
    }

    /// Re-plans if the layer's ranks changed since the plan was made.
    fn ensure(&mut self, shape: &TtShape) {
        if !self.plan.is_valid_for(shape, self.batch) {
            *self = TtLinearWorkspace::new(
                shape,
                self.batch,
                self.pass,
                self.forced,
                self.model.clone(),
            );
        }
    }
}

impl Layer for TtLinear {
    type Workspace = TtLinearWorkspace;

    fn in_features(&self) -> usize {
        self.shape.in_features()
    }
    fn out_features(&self) -> usize {
        self.shape.out_features()
    }

    fn workspace(&self, batch: usize) -> TtLinearWorkspace {
        TtLinearWorkspace::new(
            &self.shape,
            batch,
            Pass::Train { need_dx: true },
            None,
            CostModel::default(),
        )
    }

    fn forward(&self, ws: &mut TtLinearWorkspace, x: &[f32], y: &mut [f32]) {
        ws.ensure(&self.shape);
        let b = ws.batch;
        check_len("TtLinear x", x.len(), b * self.in_features());
        check_len("TtLinear y", y.len(), b * self.out_features());
        if self.dead {
            y.fill(0.0);
            add_bias(y, &self.bias.value);
            return;
        }
        let mut h = ws.h.acquire();
        let s = &self.shape;
        match &mut ws.bufs {
            // The merged path gates the cores itself (beside its products at small batches),
            // and adds the bias in its last product (see `merged`).
            PathBuffers::Merged(p) => p.forward(self, &mut h, b, x, y),
            PathBuffers::Sequential(p) => {
                self.gate_cores(&mut h);
                p.forward(s, &h, b, x, y);
                add_bias(y, &self.bias.value);
            }
            PathBuffers::Dense(p) => {
                self.gate_cores(&mut h);
                p.forward(s, &h, b, x, y);
                add_bias(y, &self.bias.value);
            }
        }
    }

    fn backward(
        &mut self,
        ws: &mut TtLinearWorkspace,
        x: &[f32],
        dy: &[f32],
        dx: Option<&mut [f32]>,
    ) {
        self.backward_into(ws, x, dy, dx, false);
    }

    fn params(&self) -> Vec<&Param> {
        self.cores
            .iter()
            .chain(&self.gates)
            .chain(std::iter::once(&self.bias))
            .collect()
    }
    fn params_mut(&mut self) -> Vec<&mut Param> {
        self.cores
            .iter_mut()
            .chain(self.gates.iter_mut())
            .chain(std::iter::once(&mut self.bias))
            .collect()
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.cores
            .iter_mut()
            .chain(self.gates.iter_mut())
            .chain(std::iter::once(&mut self.bias))
            .for_each(f);
    }
}
