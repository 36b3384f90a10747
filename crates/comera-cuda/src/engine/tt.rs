//! A TT linear layer on the device, the merged path (SPEC §1): Y = X·W + b with
//! W = L·R never formed, on raw addresses into the plan's flat buffers.
//!
//! Cores G_c (r_c, s_c, r_{c+1}), c = 0..K−1, s = [n_0..n_{p−1}, m_0..m_{q−1}]; gate c
//! (length r_{c+1}) on the bond after core c. Gated cores H_c = G_c·diag(g(d_c)) (c < K−1),
//! H_{K−1} = G_{K−1} (read in place). With P_c = n_0⋯n_{c−1} and Q_c = s_c⋯s_{K−1}:
//!
//! ```text
//! L_1 = H_0 (n_0 × r_1)            L_{c+1} (P_c × s_c·r_{c+1}) = L_c (P_c × r_c) · H_c (r_c × s_c·r_{c+1})
//! R_{K−1} = H_{K−1} (r_{K−1} × m_{q−1})   R_c (r_c·s_c × Q_{c+1}) = H_c (r_c·s_c × r_{c+1}) · R_{c+1}
//! L = L_p (N × r_p), R = R_p (r_p × M);   T1 = X·L (B × r_p);   Y = T1·R + 1·bᵀ
//! ```
//! (row-major reshapes only: L_{c+1} read as (P_{c+1} × r_{c+1}), R_c as (r_c × Q_c)).
//!
//! Backward from dY (B × M), the CPU's merged path:
//! ```text
//! dR = T1ᵀ·dY,  db += 1ᵀ·dY,  U1 = dY·Rᵀ,  dX (+)= U1·Lᵀ,  dL = Xᵀ·U1
//! left peel  (c = p−1..1):  dH_c = L_cᵀ·dL_{c+1},  dL_c = dL_{c+1}·H_cᵀ      (dH_0 = dL_1)
//! right peel (c = p..K−2):  dH_c = dR_c·R_{c+1}ᵀ,  dR_{c+1} = H_cᵀ·dR_c      (dG_{K−1} += dR_{K−1})
//! dG_c += dH_c·diag(g(d_c)),  dd_c[j] += Σ_{a,s} dH_c[a,s,j]·G_c[a,s,j]  (d_j > τ only; rank.cu)
//! ```
//!
//! Why merged and not "rebuild W, one GEMM" on the GPU: per layer and step the merged path
//! costs 2·B·r_p·(N + M) multiply-adds in each of its four batch products, the dense
//! rebuild 2·N·r_p·M to form W plus 2·B·N·M per batch product. For the paper's 768 × 768
//! layer at rank 30 and B = 4,096 tokens that is 0.38 GFLOP against 4.9 GFLOP per product
//! (13× less); at B = 128 tokens (batch 1) 12 MFLOP against 186 MFLOP. The chains themselves
//! (products of at most 12·8·30 × 30 × 8·30) are the same on both paths. The merged path
//! also stores no N × M weight or gradient (the memory bar of issue 48).

use super::raw::{grid, grid_stride, launch, Buf, Gemm};
use crate::device::Device;
use crate::error::CudaError;
use cudarc::cublas::CudaBlas;

/// The fixed shape of one device TT layer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TtDims {
    pub in_modes: Vec<usize>,
    pub out_modes: Vec<usize>,
    /// [1, r_1, …, r_{K−1}, 1].
    pub ranks: Vec<usize>,
}

impl TtDims {
    pub fn from_shape(s: &comera_tensor::TtShape) -> TtDims {
        TtDims {
            in_modes: s.in_modes().to_vec(),
            out_modes: s.out_modes().to_vec(),
            ranks: s.ranks().to_vec(),
        }
    }
    pub fn p(&self) -> usize {
        self.in_modes.len()
    }
    pub fn k(&self) -> usize {
        self.in_modes.len() + self.out_modes.len()
    }
    pub fn n(&self) -> usize {
        self.in_modes.iter().product()
    }
    pub fn m(&self) -> usize {
        self.out_modes.iter().product()
    }
    /// s_c.
    pub fn mode(&self, c: usize) -> usize {
        let p = self.p();
        if c < p {
            self.in_modes[c]
        } else {
            self.out_modes[c - p]
        }
    }
    /// Floats of core c: r_c·s_c·r_{c+1}.
    pub fn core_len(&self, c: usize) -> usize {
        self.ranks[c] * self.mode(c) * self.ranks[c + 1]
    }
    /// The host parameter names and shapes, in the CPU layer's order: cores, gates, bias.
    pub fn params(&self, name: &str) -> Vec<(String, Vec<usize>, comera_layers::ParamKind)> {
        use comera_layers::ParamKind;
        let k = self.k();
        let mut v: Vec<_> = (0..k)
            .map(|c| {
                (
                    format!("{name}.core.{}", c + 1),
                    vec![self.ranks[c], self.mode(c), self.ranks[c + 1]],
                    ParamKind::TtCore,
                )
            })
            .collect();
        v.extend((1..k).map(|b| {
            (
                format!("{name}.gate.{b}"),
                vec![self.ranks[b]],
                ParamKind::RankGate,
            )
        }));
        v.push((format!("{name}.bias"), vec![self.m()], ParamKind::Other));
        v
    }
}

/// Addresses of one tensor's value and gradient in the plan's flat buffers.
#[derive(Clone, Copy, Debug)]
pub struct Slot {
    pub w: u64,
    pub g: u64,
}

/// Where a layer's gated cores and chain products sit in its workspace buffers.
struct ChainLayout {
    /// H_0..H_{K−2}: offsets, and floats in all.
    h_off: Vec<usize>,
    h_len: usize,
    /// L_2..L_p, then R_p..R_{K−2}: offsets, and floats in all.
    l_off: Vec<usize>,
    r_off: Vec<usize>,
    chain_len: usize,
}

impl ChainLayout {
    fn of(dims: &TtDims) -> ChainLayout {
        let (k, p) = (dims.k(), dims.p());
        let mut h_off = Vec::new();
        let mut at = 0;
        for c in 0..k.saturating_sub(1) {
            h_off.push(at);
            at += dims.core_len(c);
        }
        let h_len = at;
        // L_{c+1} for c = 1..p−1: P_c·s_c·r_{c+1} floats.
        let (mut l_off, mut r_off) = (Vec::new(), Vec::new());
        let mut at = 0;
        for c in 1..p {
            l_off.push(at);
            at += TtLayer::prefix(dims, c) * dims.mode(c) * dims.ranks[c + 1];
        }
        // R_c for c = p..K−2: r_c·Q_c floats.
        for c in p..k.saturating_sub(1) {
            r_off.push(at);
            at += dims.ranks[c] * TtLayer::suffix(dims, c);
        }
        ChainLayout {
            h_off,
            h_len,
            l_off,
            r_off,
            chain_len: at,
        }
    }
}

/// A TT layer's device workspace for a fixed batch of `rows` rows.
pub struct TtLayer {
    pub dims: TtDims,
    rows: usize,
    tau: f32,
    cores: Vec<Slot>,
    gates: Vec<Slot>,
    bias: Slot,
    /// Gated cores H_0..H_{K−2} and their gradients, back to back (offsets `h_off`).
    h: Buf<f32>,
    dh: Buf<f32>,
    h_off: Vec<usize>,
    /// L_2..L_p, R_p..R_{K−2} (and their gradients), back to back (offsets `l_off`, `r_off`).
    chain: Buf<f32>,
    dchain: Buf<f32>,
    l_off: Vec<usize>,
    r_off: Vec<usize>,
    /// T1 (rows × r_p), saved by the forward; U1 (rows × r_p), backward scratch.
    t1: Buf<f32>,
    u1: Buf<f32>,
    /// The bias gradient's column-sum partials.
    partial: Buf<f32>,
}

impl TtLayer {
    /// The workspace of layer `name` whose parameters sit at `slot(name of tensor)`.
    pub fn new(
        dev: &Device,
        dims: TtDims,
        rows: usize,
        tau: f32,
        slot: impl Fn(&str) -> Slot,
        name: &str,
    ) -> Result<TtLayer, CudaError> {
        let (k, p) = (dims.k(), dims.p());
        if p == 0 || k == p || dims.ranks.len() != k + 1 || dims.ranks.contains(&0) {
            return Err(CudaError::Plan(format!(
                "TT layer `{name}`: modes {:?} → {:?} with ranks {:?} (every rank ≥ 1, at \
                 least one input and one output mode)",
                dims.in_modes, dims.out_modes, dims.ranks
            )));
        }
        let cores = (0..k)
            .map(|c| slot(&format!("{name}.core.{}", c + 1)))
            .collect();
        let gates = (1..k).map(|b| slot(&format!("{name}.gate.{b}"))).collect();
        let bias = slot(&format!("{name}.bias"));
        let ChainLayout {
            h_off,
            h_len,
            l_off,
            r_off,
            chain_len,
        } = ChainLayout::of(&dims);
        let rp = dims.ranks[p];
        let m = dims.m();
        Ok(TtLayer {
            rows,
            tau,
            cores,
            gates,
            bias,
            h: Buf::zeros(dev, h_len)?,
            dh: Buf::zeros(dev, h_len)?,
            h_off,
            chain: Buf::zeros(dev, chain_len)?,
            dchain: Buf::zeros(dev, chain_len)?,
            l_off,
            r_off,
            t1: Buf::zeros(dev, rows * rp)?,
            u1: Buf::zeros(dev, rows * rp)?,
            partial: Buf::zeros(dev, crate::ops::chunks(rows) * m)?,
            dims,
        })
    }

    /// Bytes [`TtLayer::new`] allocates for a layer of `dims` on `rows` rows (the plan's
    /// memory estimate, before anything is allocated).
    pub fn device_bytes(dims: &TtDims, rows: usize) -> usize {
        let c = ChainLayout::of(dims);
        let f = Buf::<f32>::zeros_bytes;
        2 * f(c.h_len)
            + 2 * f(c.chain_len)
            + 2 * f(rows * dims.ranks[dims.p()])
            + f(crate::ops::chunks(rows) * dims.m())
    }

    /// P_c = n_0⋯n_{c−1}.
    fn prefix(d: &TtDims, c: usize) -> usize {
        d.in_modes[..c].iter().product()
    }

    /// Q_c = s_c⋯s_{K−1} (c ≥ p).
    fn suffix(d: &TtDims, c: usize) -> usize {
        (c..d.k()).map(|i| d.mode(i)).product()
    }

    /// Bytes of device memory the workspace holds.
    pub fn bytes(&self) -> usize {
        self.h.bytes()
            + self.dh.bytes()
            + self.chain.bytes()
            + self.dchain.bytes()
            + self.t1.bytes()
            + self.u1.bytes()
            + self.partial.bytes()
    }

    /// H_c (c < K−1 from the workspace, H_{K−1} the last core itself).
    fn h_at(&self, c: usize) -> u64 {
        if c + 1 == self.dims.k() {
            self.cores[c].w
        } else {
            self.h.at(self.h_off[c], self.dims.core_len(c))
        }
    }

    /// dH_c for c < K−1.
    fn dh_at(&self, c: usize) -> u64 {
        self.dh.at(self.h_off[c], self.dims.core_len(c))
    }

    /// L_c (c = 1..p): L_1 = H_0.
    fn l_at(&self, c: usize) -> u64 {
        if c == 1 {
            self.h_at(0)
        } else {
            let len = Self::prefix(&self.dims, c) * self.dims.ranks[c];
            self.chain.at(self.l_off[c - 2], len)
        }
    }

    /// dL_c (c = 1..p): dL_1 = dH_0.
    fn dl_at(&self, c: usize) -> u64 {
        if c == 1 {
            self.dh_at(0)
        } else {
            let len = Self::prefix(&self.dims, c) * self.dims.ranks[c];
            self.dchain.at(self.l_off[c - 2], len)
        }
    }

    /// R_c (c = p..K−1): R_{K−1} = H_{K−1}.
    fn r_at(&self, c: usize) -> u64 {
        let k = self.dims.k();
        if c + 1 == k {
            self.h_at(c)
        } else {
            let len = self.dims.ranks[c] * Self::suffix(&self.dims, c);
            self.chain.at(self.r_off[c - self.dims.p()], len)
        }
    }

    /// Where dR_c goes and whether it accumulates: dR_{K−1} straight into the last core's
    /// gradient (accumulating), the others into the workspace.
    fn dr_at(&self, c: usize) -> (u64, bool) {
        let k = self.dims.k();
        if c + 1 == k {
            (self.cores[c].g, true)
        } else {
            let len = self.dims.ranks[c] * Self::suffix(&self.dims, c);
            (self.dchain.at(self.r_off[c - self.dims.p()], len), false)
        }
    }

    /// y (rows × M) = x (rows × N)·W + b. x and y are addresses of rows·N and rows·M floats.
    pub fn forward(&self, dev: &Device, blas: &CudaBlas, x: u64, y: u64) -> Result<(), CudaError> {
        self.gate(dev)?;
        self.forward_products(dev, blas, x, y)
    }

    /// The layer's gated cores H_0..H_{K−2} (what [`GateTable`] gates, and takes the gradients
    /// of, for every TT layer of a plan at once).
    pub fn gated_cores(&self) -> Vec<GatedCore> {
        let d = &self.dims;
        (0..d.k() - 1)
            .map(|c| GatedCore {
                core: self.cores[c],
                gate: self.gates[c],
                h: self.h_at(c),
                dh: self.dh_at(c),
                rows: (d.ranks[c] * d.mode(c)) as i64,
                r: d.ranks[c + 1] as i32,
            })
            .collect()
    }

    /// H_c = G_c ⊙ g(d_c) over the last axis (rank.cu gate_columns), this layer's cores alone.
    fn gate(&self, dev: &Device) -> Result<(), CudaError> {
        for c in self.gated_cores() {
            let n = (c.rows * c.r as i64) as usize;
            // SAFETY: core and h hold rows·r floats, gate r (the plan's layout).
            unsafe {
                launch(
                    dev,
                    "gate_columns",
                    grid_stride(n),
                    &[&c.core.w, &c.gate.w, &c.rows, &c.r, &self.tau, &c.h],
                )?
            };
        }
        Ok(())
    }

    /// [`TtLayer::forward`] on cores gated already (by [`TtLayer::gate`], or for every layer
    /// of a plan by [`GateTable::record_gate`]).
    pub fn forward_products(
        &self,
        dev: &Device,
        blas: &CudaBlas,
        x: u64,
        y: u64,
    ) -> Result<(), CudaError> {
        let d = &self.dims;
        let (k, p, b) = (d.k(), d.p(), self.rows);
        let (n, m, rp) = (d.n(), d.m(), d.ranks[p]);
        // SAFETY (every product below): the addresses are the workspace's and the arena's
        // ranges laid out in `new` for exactly these sizes; x, y are the caller's rows·N and
        // rows·M floats.
        unsafe {
            for c in 1..p {
                let pc = Self::prefix(d, c);
                Gemm::new(pc, d.mode(c) * d.ranks[c + 1], d.ranks[c], false, false).run(
                    blas,
                    self.l_at(c),
                    self.h_at(c),
                    self.l_at(c + 1),
                )?;
            }
            for c in (p..k - 1).rev() {
                let rows = d.ranks[c] * d.mode(c);
                Gemm::new(rows, Self::suffix(d, c + 1), d.ranks[c + 1], false, false).run(
                    blas,
                    self.h_at(c),
                    self.r_at(c + 1),
                    self.r_at(c),
                )?;
            }
            let t1 = self.t1.ptr();
            Gemm::new(b, rp, n, false, false).run(blas, x, self.l_at(p), t1)?;
            Gemm::new(b, m, rp, false, false).run(blas, t1, self.r_at(p), y)?;
        }
        let (rows, w) = (b as i64, m as i32);
        // SAFETY: y holds rows·M floats, the bias M (elementwise.cu add_bias_rows).
        unsafe {
            launch(
                dev,
                "add_bias_rows",
                grid_stride(b * m),
                &[&y, &self.bias.w, &rows, &w],
            )
        }
    }

    /// The backward of [`TtLayer::forward`] on the same x: from dy (rows × M) *accumulates*
    /// every core, gate and bias gradient, and writes (or with `dx_acc` adds to) dx (rows × N)
    /// when given.
    pub fn backward(
        &self,
        dev: &Device,
        blas: &CudaBlas,
        x: u64,
        dy: u64,
        dx: Option<(u64, bool)>,
    ) -> Result<(), CudaError> {
        self.backward_products(dev, blas, x, dy, dx)?;
        self.gated_grads(dev)
    }

    /// [`TtLayer::backward`] up to dH_c: the gated cores' gradients through their gates are
    /// left to [`TtLayer::gated_grads`] (or for every layer of a plan to
    /// [`GateTable::record_grads`]); the last core's and the bias's are accumulated here.
    pub fn backward_products(
        &self,
        dev: &Device,
        blas: &CudaBlas,
        x: u64,
        dy: u64,
        dx: Option<(u64, bool)>,
    ) -> Result<(), CudaError> {
        let d = &self.dims;
        let (k, p, b) = (d.k(), d.p(), self.rows);
        let (n, m, rp) = (d.n(), d.m(), d.ranks[p]);
        let (t1, u1) = (self.t1.ptr(), self.u1.ptr());
        // SAFETY (every product below): as in `forward`; dy holds rows·M floats, dx rows·N.
        unsafe {
            let (dr, acc) = self.dr_at(p);
            let g = Gemm::new(rp, m, b, true, false);
            (if acc { g.acc() } else { g }).run(blas, t1, dy, dr)?;
            Gemm::new(b, rp, m, false, true).run(blas, dy, self.r_at(p), u1)?;
            if let Some((dx, add)) = dx {
                let g = Gemm::new(b, n, rp, false, true);
                (if add { g.acc() } else { g }).run(blas, u1, self.l_at(p), dx)?;
            }
            Gemm::new(n, rp, b, true, false).run(blas, x, u1, self.dl_at(p))?;
            for c in (1..p).rev() {
                let (pc, w) = (Self::prefix(d, c), d.mode(c) * d.ranks[c + 1]);
                let r = d.ranks[c];
                Gemm::new(r, w, pc, true, false).run(
                    blas,
                    self.l_at(c),
                    self.dl_at(c + 1),
                    self.dh_at(c),
                )?;
                Gemm::new(pc, r, w, false, true).run(
                    blas,
                    self.dl_at(c + 1),
                    self.h_at(c),
                    self.dl_at(c),
                )?;
            }
            for c in p..k - 1 {
                let (rows, q, r) = (
                    d.ranks[c] * d.mode(c),
                    Self::suffix(d, c + 1),
                    d.ranks[c + 1],
                );
                let (drc, _) = self.dr_at(c);
                Gemm::new(rows, r, q, false, true).run(
                    blas,
                    drc,
                    self.r_at(c + 1),
                    self.dh_at(c),
                )?;
                let (drn, acc) = self.dr_at(c + 1);
                let g = Gemm::new(r, q, rows, true, false);
                (if acc { g.acc() } else { g }).run(blas, self.h_at(c), drc, drn)?;
            }
        }
        // The bias: db += Σ_rows dY (elementwise.cu, the CPU's row chunks).
        let (r, w) = (b as i32, m as i32);
        let (per, nc) = (
            crate::ops::rows_per_chunk(b) as i32,
            crate::ops::chunks(b) as i32,
        );
        let cols = (m as u32).div_ceil(super::raw::BLOCK);
        let part = self.partial.ptr();
        let one = 1i32;
        // SAFETY: dy holds rows·M floats, the partials chunks·M, the bias gradient M.
        unsafe {
            launch(
                dev,
                "column_sum_partials",
                grid(cols, nc as u32, super::raw::BLOCK),
                &[&dy, &r, &w, &per, &part],
            )?;
            launch(
                dev,
                "column_sum_finish",
                grid(cols, 1, super::raw::BLOCK),
                &[&part, &nc, &w, &w, &one, &self.bias.g],
            )?;
        }
        Ok(())
    }

    /// dG_c, dd_c from dH_c through the gates (rank.cu, the CPU's accumulate_gated_grads),
    /// this layer's cores alone.
    fn gated_grads(&self, dev: &Device) -> Result<(), CudaError> {
        for c in self.gated_cores() {
            let n = (c.rows * c.r as i64) as usize;
            // SAFETY: dh, the core and its gradient hold rows·r floats, the gate and its
            // gradient r.
            unsafe {
                launch(
                    dev,
                    "gated_grads_core",
                    grid_stride(n),
                    &[&c.dh, &c.gate.w, &c.rows, &c.r, &self.tau, &c.core.g],
                )?;
                launch(
                    dev,
                    "gated_grads_gate",
                    grid(
                        (c.r as u32).div_ceil(super::raw::BLOCK),
                        1,
                        super::raw::BLOCK,
                    ),
                    &[
                        &c.dh, &c.core.w, &c.gate.w, &c.rows, &c.r, &self.tau, &c.gate.g,
                    ],
                )?;
            }
        }
        Ok(())
    }
}

/// One gated core of a TT layer: its value and gradient, its gate's, and where its gated
/// value H_c and the gradient dH_c live (rows × r each, r its gate's length).
#[derive(Clone, Copy, Debug)]
pub struct GatedCore {
    pub core: Slot,
    pub gate: Slot,
    pub h: u64,
    pub dh: u64,
    pub rows: i64,
    pub r: i32,
}

/// Every gated core of a plan's TT layers, so that a step gates them all in one launch before
/// the forward and takes their gradients through the gates in two after the backward, instead
/// of three launches per core (the paper model: 36 layers of 5 gated cores, 540 launches of
/// a few thousand elements each a step, against 3). Each core's arithmetic is the per-layer
/// kernels' (rank.cu), so the results are the same bits.
pub struct GateTable {
    core_w: Buf<u64>,
    core_g: Buf<u64>,
    gate_w: Buf<u64>,
    gate_g: Buf<u64>,
    h: Buf<u64>,
    dh: Buf<u64>,
    rows: Buf<i64>,
    r: Buf<i32>,
    cores: usize,
    /// The largest core (rows·r) and gate (r): the launches' x extents.
    max_len: usize,
    max_r: usize,
    tau: f32,
}

impl GateTable {
    /// The table of `cores` (None when there is none: a dense model), gates thresholded at τ.
    pub fn new(
        dev: &Device,
        cores: &[GatedCore],
        tau: f32,
    ) -> Result<Option<GateTable>, CudaError> {
        if cores.is_empty() {
            return Ok(None);
        }
        // One launch row (grid.y) per core.
        if cores.len() > 65_535 {
            return Err(CudaError::Plan(format!(
                "{} gated TT cores: the gating launches take at most 65,535",
                cores.len()
            )));
        }
        let col = |f: &dyn Fn(&GatedCore) -> u64| {
            Buf::copy_from_host(dev, &cores.iter().map(f).collect::<Vec<_>>())
        };
        Ok(Some(GateTable {
            core_w: col(&|c| c.core.w)?,
            core_g: col(&|c| c.core.g)?,
            gate_w: col(&|c| c.gate.w)?,
            gate_g: col(&|c| c.gate.g)?,
            h: col(&|c| c.h)?,
            dh: col(&|c| c.dh)?,
            rows: Buf::copy_from_host(dev, &cores.iter().map(|c| c.rows).collect::<Vec<_>>())?,
            r: Buf::copy_from_host(dev, &cores.iter().map(|c| c.r).collect::<Vec<_>>())?,
            cores: cores.len(),
            max_len: cores
                .iter()
                .map(|c| (c.rows * c.r as i64) as usize)
                .max()
                .unwrap_or(0),
            max_r: cores.iter().map(|c| c.r as usize).max().unwrap_or(0),
            tau,
        }))
    }

    /// Bytes [`GateTable::new`] allocates for `cores` gated cores (0 for none).
    pub fn device_bytes(cores: usize) -> usize {
        match cores {
            0 => 0,
            n => {
                6 * Buf::<u64>::copy_bytes(n)
                    + Buf::<i64>::copy_bytes(n)
                    + Buf::<i32>::copy_bytes(n)
            }
        }
    }

    /// The x extent of the per-core table launches: the largest core's floats in blocks, at
    /// most 1,024 (the kernels stride over the rest).
    fn core_blocks(&self) -> u32 {
        (self.max_len as u32).div_ceil(super::raw::BLOCK).min(1024)
    }

    /// H_c = G_c ⊙ g(d_c) for every core (rank.cu gate_columns_table).
    pub fn record_gate(&self, dev: &Device) -> Result<(), CudaError> {
        let blocks = self.core_blocks();
        let (cw, gw, h, rows, r) = (
            self.core_w.ptr(),
            self.gate_w.ptr(),
            self.h.ptr(),
            self.rows.ptr(),
            self.r.ptr(),
        );
        // SAFETY: each entry's addresses are a gated core's (rows·r floats), its gate's (r) and
        // its H (rows·r), laid out by the TT layers' workspaces and the arena.
        unsafe {
            launch(
                dev,
                "gate_columns_table",
                grid(blocks, self.cores as u32, super::raw::BLOCK),
                &[&cw, &gw, &rows, &r, &self.tau, &h],
            )
        }
    }

    /// dG_c += dH_c ⊙ g(d_c) and dd_c += Σ_rows dH_c ⊙ G_c for every core (rank.cu
    /// gated_grads_core_table, gated_grads_gate_table).
    pub fn record_grads(&self, dev: &Device) -> Result<(), CudaError> {
        let blocks = self.core_blocks();
        let gate_blocks = (self.max_r as u32).div_ceil(super::raw::BLOCK);
        let (cw, cg, gw, gg, dh, rows, r) = (
            self.core_w.ptr(),
            self.core_g.ptr(),
            self.gate_w.ptr(),
            self.gate_g.ptr(),
            self.dh.ptr(),
            self.rows.ptr(),
            self.r.ptr(),
        );
        // SAFETY: as in `record_gate`; dH and the core's gradient hold rows·r floats, the
        // gate's gradient r.
        unsafe {
            launch(
                dev,
                "gated_grads_core_table",
                grid(blocks, self.cores as u32, super::raw::BLOCK),
                &[&dh, &gw, &rows, &r, &self.tau, &cg],
            )?;
            launch(
                dev,
                "gated_grads_gate_table",
                grid(gate_blocks, self.cores as u32, super::raw::BLOCK),
                &[&dh, &cw, &gw, &rows, &r, &self.tau, &gg],
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use comera_layers::{Layer, RankGates, TtLinear};
    use comera_tensor::{init, TtShape};

    /// The device layer's tensors are the CPU layer's, by name, shape, kind and order: the
    /// parameter seam (upload and download by name) depends on it.
    #[test]
    fn device_tensors_are_the_cpu_layers() {
        for (i, o, r) in [
            (&[4usize, 4, 3][..], &[3usize, 4, 4][..], 5),
            (&[12, 8, 8], &[8, 8, 12], 30),
            (&[6], &[2, 5], 2),
        ] {
            let shape = TtShape::uniform(i, o, r).unwrap();
            let cpu = TtLinear::new(
                "x.y",
                shape.clone(),
                RankGates::new(0.01),
                &mut init::rng(1),
            )
            .unwrap();
            let want: Vec<_> = cpu
                .params()
                .iter()
                .map(|p| (p.name.clone(), p.shape.clone(), p.kind))
                .collect();
            let dims = TtDims::from_shape(&shape);
            assert_eq!(dims.params("x.y"), want);
            assert_eq!(
                (dims.n(), dims.m()),
                (cpu.in_features(), cpu.out_features())
            );
            for c in 0..dims.k() {
                assert_eq!(dims.core_len(c), shape.core_len(c));
            }
        }
    }
}
