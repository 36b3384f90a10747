//! `TtmEmbedding`: a V × D embedding table held as p tensor-train-matrix cores with rank gates.
//!
//! Core k (0-based) has shape (r_k, v_k, e_k, r_{k+1}); id i has digits (i_0..i_{p-1}) over v
//! (i_0 slowest) and E[i, (c_0..c_{p-1})] = F_0[0,i_0,c_0,:]·g_1·F_1[:,i_1,c_1,:]⋯F_{p-1}[:,i_{p-1},c_{p-1},0].
//! For a fixed digit, slab(k, i) = F_k[:, i, :, :]·diag(g_{k+1}) is an r_k × e_k·r_{k+1} matrix;
//! the engine keeps the gated cores permuted to (v_k, r_k, e_k, r_{k+1}) so every slab is one
//! contiguous block.
//!
//! Chains. A left chain over cores 0..s for digits (i_0..i_{s-1}):
//!   A_0 = slab(0, i_0) (e_0 × r_1),  A_k = A_{k-1} (e_0⋯e_{k-1} × r_k) · slab(k, i_k) → (e_0⋯e_k × r_{k+1});
//! a right chain over cores s..p from the right:
//!   B_{p-1} = slab(p-1, ·) (r_{p-1}·e_{p-1} × 1),  B_k = slab(k, i_k) (r_k·e_k × r_{k+1}) · B_{k+1} → (r_k × e_k⋯e_{p-1}).
//! A row is A_{s-1} (E_L × r_s) · B_s (r_s × E_R), flattened row-major: exactly E[i].
//!
//! Two lookups, both exact:
//! - `Naive`: one full left chain (s = p) per token.
//! - `Optimized` (SPEC §2): deduplicate the batch's ids; split the cores at s (chosen by cost);
//!   compute each distinct left half (i_0..i_{s-1}) and right half (i_s..) chain once per step;
//!   one small GEMM per unique id; scatter rows back to tokens.
//! - `Auto` (the default) deduplicates the batch's ids and runs whichever of the two its cost
//!   estimate says is cheaper for this batch ([`Layout::step_cost`]): the optimised lookup pays
//!   off when ids repeat (Zipf-like text and click logs), the naive one when nearly every id is
//!   distinct (its chains cost the same and it has no per-id bookkeeping). The choice depends
//!   on the ids only, so a step's bits do not depend on timing.
//!
//! Backward accumulates dY per unique id in token order, then into the half products, then
//! through the chains into the slabs, always in sorted-id order: bit-identical for any thread
//! count.

use crate::compress;
use crate::embedding::{check_ids, EmbeddingError, EmbeddingLayer};
use crate::{LayerError, Param, ParamKind, RankGates};
use comera_tensor::permute::permute;
use comera_tensor::{init, matmul, matmul_serial, MatMut, MatRef, TtmShape};
use rayon::prelude::*;

/// Which lookup a workspace runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    Naive,
    Optimized,
    /// Naive or optimised, chosen per batch by estimated cost.
    Auto,
}

impl Lookup {
    pub fn name(self) -> &'static str {
        match self {
            Lookup::Naive => "naive",
            Lookup::Optimized => "optimized",
            Lookup::Auto => "auto",
        }
    }
}

/// Cost of one small GEMM call (dispatch, packing) in multiply-add FLOP equivalents, and the
/// optimised lookup's bookkeeping per distinct id (sorted order, slots, the scattered rows and
/// their gradient sums): fitted to `comera bench ttm` (on the 11M×64 table with uniform ids the
/// two lookups do the same chain FLOPs and the optimised one was ~25% slower per id).
const CALL_FLOPS: f64 = 5e3;
const UNIQUE_FLOPS: f64 = 4e4;

/// A TTM embedding table.
///
/// An 18 × 8 table over vocab modes `[4, 5]` and dim modes `[2, 4]` at rank 3: a lookup gives
/// the rows of the dense table the cores represent, and its backward accumulates the cores'
/// gradients.
///
/// ```
/// use comera_layers::{EmbeddingError, EmbeddingLayer, RankGates, TtmEmbedding};
/// use comera_tensor::{init, TtmShape};
///
/// let mut rng = init::rng(1);
/// let shape = TtmShape::uniform(&[4, 5], &[2, 4], 3, 18)?;
/// let mut table = TtmEmbedding::new("emb", shape, RankGates::default(), 1.0, &mut rng)?;
/// let (v, d) = (table.num_embeddings(), table.dim());
/// assert_eq!((v, d), (18, 8));
/// let dense = table.dense_table(); // V × D, row-major
///
/// let ids = [3u32, 17, 3, 0];
/// let mut ws = table.workspace(ids.len());
/// let mut y = vec![0.0; ids.len() * d];
/// table.forward(&mut ws, &ids, &mut y)?;
/// for (t, &id) in ids.iter().enumerate() {
///     let (got, want) = (&y[t * d..(t + 1) * d], &dense[id as usize * d..(id as usize + 1) * d]);
///     assert!(got.iter().zip(want).all(|(a, b)| (a - b).abs() <= 1e-6 * (1.0 + b.abs())));
/// }
///
/// let dy = vec![1.0; ids.len() * d];
/// table.backward(&mut ws, &ids, &dy);
/// assert!(table.cores.iter().all(|c| c.grad.iter().any(|&g| g != 0.0)));
///
/// // Ids are checked against V.
/// let bad = table.forward(&mut ws, &[3, 18, 0, 1], &mut y);
/// assert!(matches!(bad, Err(EmbeddingError::IdOutOfRange { pos: 1, id: 18, .. })));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct TtmEmbedding {
    shape: TtmShape,
    rule: RankGates,
    /// Core k, shape (r_k, v_k, e_k, r_{k+1}).
    pub cores: Vec<Param>,
    /// Gate on bond k + 1 (between cores k and k + 1), length r_{k+1}.
    pub gates: Vec<Param>,
    /// Set by a truncation that left a bond without active entries: every row is 0, so
    /// lookups skip the chain.
    dead: bool,
}

/// A run of a TTM layer's cores, `first..first + cores.len()`, with the gates on the bonds
/// after them (none after the last core), whose gradients one task accumulates from their dH.
struct TtmCoreGrads<'a> {
    shape: &'a TtmShape,
    rule: RankGates,
    first: usize,
    cores: &'a mut [Param],
    gates: &'a mut [Param],
}

impl TtmCoreGrads<'_> {
    /// dG_k += dH_k·diag(g), dd += Σ dH_k·G_k for these cores, from `dh` (their dH in slab
    /// layout, (v_k, r_k, e_k, r_{k+1})); `tmp`: a core's worth of scratch.
    fn accumulate(&mut self, dh: &[Vec<f32>], tmp: &mut [f32]) {
        for (i, (core, dh)) in self.cores.iter_mut().zip(dh).enumerate() {
            let k = self.first + i;
            let s = self.shape.core_shape(k);
            let dk = &mut tmp[..self.shape.core_len(k)];
            permute(dh, &[s[1], s[0], s[2], s[3]], &[1, 0, 2, 3], dk);
            self.rule
                .accumulate_chain_core(core, self.gates.get_mut(i), dk);
        }
    }
}

impl TtmEmbedding {
    /// Cores ~ N(0,1)·sqrt(std^(2/p) / r_{k+1}), so rows have entries of variance std²
    /// (std = 1 matches a freshly initialised dense table); gates at 1.
    pub fn new(
        name: &str,
        shape: TtmShape,
        rule: RankGates,
        std: f32,
        rng: &mut init::Rng,
    ) -> Result<TtmEmbedding, LayerError> {
        crate::tt_linear::check_threshold(rule.threshold)?;
        let p = shape.n_cores();
        let var_k = (std as f64).powf(2.0 / p as f64);
        let cores = (0..p)
            .map(|k| {
                let dims = shape.core_shape(k);
                let mut v = vec![0.0; shape.core_len(k)];
                init::fill_normal(rng, &mut v, (var_k / dims[3] as f64).sqrt() as f32);
                Param::new(
                    format!("{name}.core.{}", k + 1),
                    &dims,
                    ParamKind::TtCore,
                    v,
                )
            })
            .collect();
        let gates = RankGates::initial_params(name, shape.ranks());
        Ok(TtmEmbedding {
            shape,
            rule,
            cores,
            gates,
            dead: false,
        })
    }

    /// A table from given core and gate values, checked against `shape`.
    pub fn from_parts(
        name: &str,
        shape: TtmShape,
        rule: RankGates,
        cores: Vec<Vec<f32>>,
        gates: Vec<Vec<f32>>,
    ) -> Result<TtmEmbedding, LayerError> {
        crate::tt_linear::check_threshold(rule.threshold)?;
        let p = shape.n_cores();
        let bad = |pname: String, expected: Vec<usize>, got: usize| LayerError::ParamShape {
            name: pname,
            expected,
            got: vec![got],
        };
        if cores.len() != p {
            return Err(bad(format!("{name}.core (count)"), vec![p], cores.len()));
        }
        if gates.len() != p - 1 {
            return Err(bad(
                format!("{name}.gate (count)"),
                vec![p - 1],
                gates.len(),
            ));
        }
        let mut cp = Vec::with_capacity(p);
        for (k, v) in cores.into_iter().enumerate() {
            let dims = shape.core_shape(k);
            let pname = format!("{name}.core.{}", k + 1);
            if v.len() != shape.core_len(k) {
                return Err(bad(pname, dims.to_vec(), v.len()));
            }
            cp.push(Param::new(pname, &dims, ParamKind::TtCore, v));
        }
        let mut gp = Vec::with_capacity(p - 1);
        for (b, v) in gates.into_iter().enumerate() {
            let r = shape.ranks()[b + 1];
            let pname = format!("{name}.gate.{}", b + 1);
            if v.len() != r {
                return Err(bad(pname, vec![r], v.len()));
            }
            gp.push(Param::new(pname, &[r], ParamKind::RankGate, v));
        }
        Ok(TtmEmbedding {
            shape,
            rule,
            cores: cp,
            gates: gp,
            dead: false,
        })
    }

    pub fn shape(&self) -> &TtmShape {
        &self.shape
    }

    /// S: parameters of the surviving cores (s_k = v_k·e_k).
    pub fn size_l0(&self) -> f64 {
        self.rule
            .params_size(|k| self.shape.size_mode(k), &self.gates, false)
    }

    /// Ŝ: the ℓ1 surrogate of S.
    pub fn size_l1(&self) -> f64 {
        self.rule
            .params_size(|k| self.shape.size_mode(k), &self.gates, true)
    }

    /// Accumulates `scale · ∂Ŝ/∂gates` into the gates' gradients.
    pub fn accumulate_size_l1_grad(&mut self, scale: f32) {
        let shape = &self.shape;
        self.rule
            .params_size_l1_grad_by(|k| shape.size_mode(k), &mut self.gates, scale);
    }

    /// A workspace for `tokens` ids with a chosen lookup.
    pub fn workspace_with(&self, tokens: usize, lookup: Lookup) -> TtmWorkspace {
        TtmWorkspace::new(&self.shape, tokens, lookup)
    }

    /// Gated cores in slab layout (v_k, r_k, e_k, r_{k+1}), the first and the second half of
    /// the cores side by side. Gating acts on the last axis only, so it commutes with the
    /// permutation.
    fn gate_cores(&self, ws: &mut TtmWorkspace) {
        let mid = self.shape.n_cores() / 2;
        let (h0, h1) = ws.h.split_at_mut(mid);
        let [t0, t1] = &mut ws.scratch_cores;
        comera_tensor::join(|| self.gate_side(0, h0, t0), || self.gate_side(mid, h1, t1));
    }

    /// The gated cores `first..first + h.len()` into `h` (`tmp`: a core's worth of scratch).
    fn gate_side(&self, first: usize, h: &mut [Vec<f32>], tmp: &mut [f32]) {
        let p = self.shape.n_cores();
        for (k, h) in (first..).zip(h.iter_mut()) {
            let dims = self.shape.core_shape(k);
            if k + 1 == p {
                permute(&self.cores[k].value, &dims, &[1, 0, 2, 3], h);
            } else {
                let tmp = &mut tmp[..self.shape.core_len(k)];
                permute(&self.cores[k].value, &dims, &[1, 0, 2, 3], tmp);
                self.rule.gate_core(tmp, &self.gates[k].value, h);
            }
        }
    }

    /// Core and gate gradients from dH (slab layout), the first and the second half of the
    /// cores side by side.
    fn accumulate_core_grads(&mut self, ws: &mut TtmWorkspace) {
        let mid = self.shape.n_cores() / 2;
        let (dh0, dh1) = ws.dh.split_at(mid);
        let [t0, t1] = &mut ws.scratch_cores;
        let (mut a, mut b) = self.core_sides(mid);
        comera_tensor::join(|| a.accumulate(dh0, t0), || b.accumulate(dh1, t1));
    }

    /// The cores (and their gates) before core `at` and from it on, for two tasks that
    /// accumulate their gradients apart ([`TtmCoreGrads::accumulate`]).
    fn core_sides(&mut self, at: usize) -> (TtmCoreGrads<'_>, TtmCoreGrads<'_>) {
        let (c0, c1) = self.cores.split_at_mut(at);
        let bonds = self.gates.len();
        let (g0, g1) = self.gates.split_at_mut(at.min(bonds));
        let (shape, rule) = (&self.shape, self.rule);
        (
            TtmCoreGrads {
                shape,
                rule,
                first: 0,
                cores: c0,
                gates: g0,
            },
            TtmCoreGrads {
                shape,
                rule,
                first: at,
                cores: c1,
                gates: g1,
            },
        )
    }

    /// The dense table (V × D) the cores represent, for tests and export.
    pub fn dense_table(&self) -> Vec<f32> {
        let v = self.shape.num_embeddings();
        let ids: Vec<u32> = (0..v as u32).collect();
        let mut ws = self.workspace_with(v, Lookup::Optimized);
        let mut y = vec![0.0; v * self.shape.dim()];
        self.forward(&mut ws, &ids, &mut y)
            .expect("every id below V is valid");
        y
    }
}

compress::impl_compressible!(
    TtmEmbedding,
    dense_params: |s| s.num_embeddings() * s.dim(),
    with_ranks: |s, ranks| TtmShape::new(s.vocab_modes(), s.dim_modes(), ranks, s.num_embeddings()),
);

/// Static facts of a chain split: digit strides, partial-product sizes and offsets.
#[derive(Clone, Debug)]
struct Layout {
    p: usize,
    split: usize,
    r: Vec<usize>,
    e: Vec<usize>,
    v: Vec<usize>,
    stride: Vec<usize>, // stride[k] = ∏_{j>k} v_j (digit k of id = id / stride[k] % v_k)
    slab: Vec<usize>,   // r_k·e_k·r_{k+1}
    eprefix: Vec<usize>, // e_0⋯e_{k-1}, k = 0..=p
    esuffix: Vec<usize>, // e_k⋯e_{p-1}, k = 0..=p
    lofs: Vec<usize>,   // offset of A_k in a left chain record, k < split
    lper: usize,        // floats per left chain record
    rofs: Vec<usize>,   // offset of B_k in a right chain record (index k - split), k ≥ split
    rper: usize,        // floats per right chain record (1 when the right half is empty)
}

impl Layout {
    fn new(shape: &TtmShape, split: usize) -> Layout {
        let p = shape.n_cores();
        let (r, e, v) = (
            shape.ranks().to_vec(),
            shape.dim_modes().to_vec(),
            shape.vocab_modes().to_vec(),
        );
        let mut stride = vec![1; p];
        for k in (0..p.saturating_sub(1)).rev() {
            stride[k] = stride[k + 1] * v[k + 1];
        }
        let slab = (0..p).map(|k| r[k] * e[k] * r[k + 1]).collect();
        let mut eprefix = vec![1; p + 1];
        for k in 0..p {
            eprefix[k + 1] = eprefix[k] * e[k];
        }
        let mut esuffix = vec![1; p + 1];
        for k in (0..p).rev() {
            esuffix[k] = esuffix[k + 1] * e[k];
        }
        let mut lofs = Vec::with_capacity(split);
        let mut lper = 0;
        for k in 0..split {
            lofs.push(lper);
            lper += eprefix[k + 1] * r[k + 1];
        }
        let mut rofs = Vec::with_capacity(p - split);
        let mut rper = 0;
        for k in split..p {
            rofs.push(rper);
            rper += r[k] * esuffix[k];
        }
        if split == p {
            rper = 1;
        }
        Layout {
            p,
            split,
            r,
            e,
            v,
            stride,
            slab,
            eprefix,
            esuffix,
            lofs,
            lper,
            rofs,
            rper,
        }
    }

    fn digit(&self, id: usize, k: usize) -> usize {
        (id / self.stride[k]) % self.v[k]
    }

    /// Left-half key of an id (digits 0..split) and right-half key (digits split..p).
    fn keys(&self, id: usize) -> (usize, usize) {
        let div = self.stride[self.split - 1];
        (id / div, id % div)
    }

    /// A_{split-1}: the left partial (E_L × r_split) inside a left record.
    fn lp<'a>(&self, rec: &'a [f32]) -> &'a [f32] {
        let k = self.split - 1;
        &rec[self.lofs[k]..self.lofs[k] + self.eprefix[k + 1] * self.r[k + 1]]
    }

    /// B_split: the right partial (r_split × E_R) inside a right record.
    fn rp<'a>(&self, rec: &'a [f32]) -> &'a [f32] {
        if self.split == self.p {
            &rec[..1]
        } else {
            &rec[..self.r[self.split] * self.esuffix[self.split]]
        }
    }

    fn slab<'a>(&self, h: &'a [Vec<f32>], k: usize, i: usize) -> &'a [f32] {
        &h[k][i * self.slab[k]..(i + 1) * self.slab[k]]
    }

    /// Left chain over cores 0..split for the digits of `id`, into `rec` (lper floats).
    fn left_chain(&self, h: &[Vec<f32>], id: usize, rec: &mut [f32]) {
        let (r, e) = (&self.r, &self.e);
        let s0 = self.slab(h, 0, self.digit(id, 0));
        rec[..s0.len()].copy_from_slice(s0);
        for k in 1..self.split {
            let (prev, cur) = rec.split_at_mut(self.lofs[k]);
            let rows = self.eprefix[k];
            let w = e[k] * r[k + 1];
            matmul_serial(
                MatMut::new(&mut cur[..rows * w], rows, w),
                MatRef::new(&prev[self.lofs[k - 1]..], rows, r[k]),
                MatRef::new(self.slab(h, k, self.digit(id, k)), r[k], w),
                false,
            );
        }
    }

    /// Right chain over cores split..p for the digits of `id`, into `rec` (rper floats).
    fn right_chain(&self, h: &[Vec<f32>], id: usize, rec: &mut [f32]) {
        let (p, s, r, e) = (self.p, self.split, &self.r, &self.e);
        if s == p {
            rec[0] = 1.0;
            return;
        }
        let last = self.slab(h, p - 1, self.digit(id, p - 1));
        let o = self.rofs[p - 1 - s];
        rec[o..o + last.len()].copy_from_slice(last);
        for k in (s..p - 1).rev() {
            let (head, tail) = rec.split_at_mut(self.rofs[k + 1 - s]);
            let cols = self.esuffix[k + 1];
            let o = self.rofs[k - s];
            matmul_serial(
                MatMut::new(&mut head[o..o + r[k] * e[k] * cols], r[k] * e[k], cols),
                MatRef::new(self.slab(h, k, self.digit(id, k)), r[k] * e[k], r[k + 1]),
                MatRef::new(tail, r[k + 1], cols),
                false,
            );
        }
    }

    /// Backward of `left_chain`: from dA_{split-1} in `d[0]`, accumulates into the slabs of dH.
    fn left_chain_back(
        &self,
        h: &[Vec<f32>],
        dh: &mut [Vec<f32>],
        id: usize,
        rec: &[f32],
        d: &mut [Vec<f32>; 2],
    ) {
        let (r, e) = (&self.r, &self.e);
        let [a, b] = d;
        let (mut cur, mut next) = (a, b);
        for k in (1..self.split).rev() {
            let rows = self.eprefix[k];
            let w = e[k] * r[k + 1];
            let i = self.digit(id, k);
            let da = MatRef::new(&cur[..rows * w], rows, w);
            let slab_len = self.slab[k];
            let dslab = &mut dh[k][i * slab_len..(i + 1) * slab_len];
            matmul(
                MatMut::new(dslab, r[k], w),
                MatRef::new(&rec[self.lofs[k - 1]..], rows, r[k]).t(),
                da,
                true,
            );
            matmul(
                MatMut::new(&mut next[..rows * r[k]], rows, r[k]),
                da,
                MatRef::new(self.slab(h, k, i), r[k], w).t(),
                false,
            );
            std::mem::swap(&mut cur, &mut next);
        }
        let i = self.digit(id, 0);
        let n = self.slab[0];
        for (g, v) in dh[0][i * n..(i + 1) * n].iter_mut().zip(cur.iter()) {
            *g += v;
        }
    }

    /// Backward of `right_chain`: from dB_split in `d[0]`, accumulates into the slabs of dH of
    /// cores split..p (`dh`, core k at index k − split).
    fn right_chain_back(
        &self,
        h: &[Vec<f32>],
        dh: &mut [Vec<f32>],
        id: usize,
        rec: &[f32],
        d: &mut [Vec<f32>; 2],
    ) {
        let (p, s, r, e) = (self.p, self.split, &self.r, &self.e);
        if s == p {
            return;
        }
        let [a, b] = d;
        let (mut cur, mut next) = (a, b);
        for k in s..p - 1 {
            let rows = r[k] * e[k];
            let cols = self.esuffix[k + 1];
            let i = self.digit(id, k);
            let db = MatRef::new(&cur[..rows * cols], rows, cols);
            let slab_len = self.slab[k];
            let o = self.rofs[k + 1 - s];
            let b_next = MatRef::new(&rec[o..], r[k + 1], cols);
            matmul(
                MatMut::new(
                    &mut dh[k - s][i * slab_len..(i + 1) * slab_len],
                    rows,
                    r[k + 1],
                ),
                db,
                b_next.t(),
                true,
            );
            matmul(
                MatMut::new(&mut next[..r[k + 1] * cols], r[k + 1], cols),
                MatRef::new(self.slab(h, k, i), rows, r[k + 1]).t(),
                db,
                false,
            );
            std::mem::swap(&mut cur, &mut next);
        }
        let i = self.digit(id, p - 1);
        let n = self.slab[p - 1];
        for (g, v) in dh[p - 1 - s][i * n..(i + 1) * n].iter_mut().zip(cur.iter()) {
            *g += v;
        }
    }

    /// Estimated cost (FLOP equivalents) of one forward + backward with this split for a batch
    /// of `tokens` ids, `unique` of them distinct, with `n_left` and `n_right` distinct halves:
    /// every chain step is one GEMM forward and two backward (of the same size), the optimised
    /// lookup adds one row GEMM per distinct id (two more backward) and its bookkeeping; the
    /// naive lookup (split = p) runs one full chain per token.
    fn step_cost(&self, tokens: usize, unique: usize, n_left: usize, n_right: usize) -> f64 {
        let (p, s, r, e) = (self.p, self.split, &self.r, &self.e);
        let (lf, rf): (f64, f64) = (
            (1..s)
                .map(|k| 2.0 * (self.eprefix[k] * r[k] * e[k] * r[k + 1]) as f64)
                .sum(),
            (s..p.saturating_sub(1))
                .map(|k| 2.0 * (r[k] * e[k] * r[k + 1] * self.esuffix[k + 1]) as f64)
                .sum(),
        );
        let (lcalls, rcalls) = ((s - 1) as f64, (p - 1).saturating_sub(s) as f64);
        if s == p {
            // Naive: one left chain per token, no deduplication.
            return tokens as f64 * 3.0 * (lf + CALL_FLOPS * lcalls);
        }
        let row = 2.0 * (self.eprefix[s] * r[s] * self.esuffix[s]) as f64;
        let chains = n_left as f64 * (lf + CALL_FLOPS * lcalls)
            + n_right as f64 * (rf + CALL_FLOPS * rcalls);
        3.0 * chains + unique as f64 * (3.0 * (row + CALL_FLOPS) + UNIQUE_FLOPS)
    }

    /// Estimated FLOPs of one optimised step with this split (forward; backward is ~2×).
    fn cost(&self, unique: usize) -> f64 {
        let (p, s, r, e) = (self.p, self.split, &self.r, &self.e);
        let n_left = unique.min(self.v[..s].iter().product()) as f64;
        let n_right = if s == p {
            0.0
        } else {
            unique.min(self.v[s..].iter().product()) as f64
        };
        let lf: f64 = (1..s)
            .map(|k| 2.0 * (self.eprefix[k] * r[k] * e[k] * r[k + 1]) as f64)
            .sum();
        let rf: f64 = (s..p.saturating_sub(1))
            .map(|k| 2.0 * (r[k] * e[k] * r[k + 1] * self.esuffix[k + 1]) as f64)
            .sum();
        let row = 2.0 * (self.eprefix[s] * r[s] * self.esuffix[s]) as f64;
        n_left * lf + n_right * rf + unique as f64 * row
    }
}

/// Scratch of the optimised lookup, sized for the worst case (every id distinct). Its chain
/// records live in the workspace's `rec`: left slots at 0, right slots from `rrec_at`.
#[derive(Debug)]
struct Optimized {
    order: Vec<u64>,     // id << 32 | token, sorted
    uniq: Vec<u32>,      // distinct ids, ascending
    seg: Vec<u32>,       // uniq[u] occupies order[seg[u]..seg[u+1]]
    uleft: Vec<u32>,     // left slot of each unique id
    uright: Vec<u32>,    // right slot of each unique id
    left_ids: Vec<u32>,  // a representative id per left slot
    right_ids: Vec<u32>, // a representative id per right slot
    rorder: Vec<u64>,    // right key << 32 | unique index, sorted
    lseg: Vec<u32>,      // left slot j holds uniques lseg[j]..lseg[j+1] (uleft is sorted)
    rseg: Vec<u32>,      // right slot j holds the uniques of rorder[rseg[j]..rseg[j+1]]
    token_u: Vec<u32>,   // the unique index of each token
    rrec_at: usize,      // offset of the right records in `rec` (left slots × lper)
    rows: Vec<f32>,      // unique × D
    drows: Vec<f32>,     // unique × D
    dlp: Vec<f32>,       // left slots × E_L·r_s
    drp: Vec<f32>,       // right slots × r_s·E_R
}

/// The token of an `order` entry.
fn token_of(entry: u64) -> usize {
    (entry & 0xffff_ffff) as usize
}

/// Everything a TTM lookup of a fixed number of ids needs.
#[derive(Debug)]
pub struct TtmWorkspace {
    /// The ranks this workspace was sized for (re-made when a truncation changes them).
    ranks: Vec<usize>,
    tokens: usize,
    lookup: Lookup,
    /// The lookup the last forward ran (naive or optimised), which its backward runs too.
    chosen: Lookup,
    /// The optimised lookup's split (unused by a naive-only workspace).
    layout: Layout,
    /// The naive lookup's layout (split = p).
    naive_layout: Layout,
    /// Whether `rec` has room for the naive lookup (`Auto`: only if it can be the cheaper).
    can_naive: bool,
    h: Vec<Vec<f32>>,
    dh: Vec<Vec<f32>>,
    /// A core's worth of scratch for each of two tasks (gating, gradients; see `core_sides`).
    scratch_cores: [Vec<f32>; 2],
    /// Gradient ping-pong scratch of the chain backward, one pair per half (left, right).
    d: [[Vec<f32>; 2]; 2],
    /// Chain records, saved for the backward: naive: tokens × lper (split = p); optimised:
    /// left slots × lper, then right slots × rper. One buffer, sized for the larger.
    rec: Vec<f32>,
    opt: Option<Optimized>,
}

impl TtmWorkspace {
    fn new(shape: &TtmShape, tokens: usize, lookup: Lookup) -> TtmWorkspace {
        let p = shape.n_cores();
        let unique = tokens.min(shape.num_embeddings()).max(1);
        let naive_layout = Layout::new(shape, p);
        let layout = (1..=p)
            .map(|s| Layout::new(shape, s))
            .min_by(|a, b| a.cost(unique).total_cmp(&b.cost(unique)))
            .expect("p ≥ 1");
        let h: Vec<Vec<f32>> = (0..p).map(|k| vec![0.0; shape.core_len(k)]).collect();
        let maxcore = h.iter().map(Vec::len).max().unwrap_or(0);
        let dmax = layout
            .lper
            .max(layout.rper)
            .max(naive_layout.lper)
            .max(shape.dim());
        // `Auto` keeps the naive records only if the naive lookup can win: its cost does not
        // depend on the ids, the optimised one's is largest when every id is distinct.
        let worst = |s: usize| unique.min(shape.vocab_modes()[s..].iter().product());
        let opt_worst = layout.step_cost(
            tokens,
            unique,
            unique.min(shape.vocab_modes()[..layout.split].iter().product()),
            worst(layout.split),
        );
        let can_naive = match lookup {
            Lookup::Naive => true,
            Lookup::Optimized => false,
            Lookup::Auto => naive_layout.step_cost(tokens, 0, 0, 0) < opt_worst,
        };
        let naive_rec = if can_naive {
            tokens * naive_layout.lper
        } else {
            0
        };
        let (opt_rec, opt) = if lookup == Lookup::Naive {
            (0, None)
        } else {
            let s = layout.split;
            let n_left = unique.min(shape.vocab_modes()[..s].iter().product());
            let n_right = unique.min(shape.vocab_modes()[s..].iter().product());
            let (el, er, rs) = (layout.eprefix[s], layout.esuffix[s], layout.r[s]);
            let d = shape.dim();
            (
                n_left * layout.lper + n_right * layout.rper,
                Some(Optimized {
                    order: Vec::with_capacity(tokens),
                    uniq: Vec::with_capacity(unique),
                    seg: Vec::with_capacity(unique + 1),
                    uleft: Vec::with_capacity(unique),
                    uright: Vec::with_capacity(unique),
                    left_ids: Vec::with_capacity(n_left),
                    right_ids: Vec::with_capacity(n_right),
                    rorder: Vec::with_capacity(unique),
                    lseg: Vec::with_capacity(n_left + 1),
                    rseg: Vec::with_capacity(n_right + 1),
                    token_u: Vec::with_capacity(tokens),
                    rrec_at: n_left * layout.lper,
                    rows: vec![0.0; unique * d],
                    drows: vec![0.0; unique * d],
                    dlp: vec![0.0; n_left * el * rs],
                    drp: vec![0.0; n_right * rs * er],
                }),
            )
        };
        TtmWorkspace {
            ranks: shape.ranks().to_vec(),
            tokens,
            lookup,
            chosen: if lookup == Lookup::Naive {
                Lookup::Naive
            } else {
                Lookup::Optimized
            },
            layout,
            naive_layout,
            can_naive,
            dh: h.clone(),
            h,
            scratch_cores: [vec![0.0; maxcore], vec![0.0; maxcore]],
            d: std::array::from_fn(|_| [vec![0.0; dmax], vec![0.0; dmax]]),
            rec: vec![0.0; naive_rec.max(opt_rec)],
            opt,
        }
    }

    /// The lookup this workspace was made for (`Auto`: chosen per batch).
    pub fn lookup(&self) -> Lookup {
        self.lookup
    }

    /// The lookup the last forward ran: naive or optimised.
    pub fn chosen(&self) -> Lookup {
        self.chosen
    }

    /// Re-makes the workspace if the table's ranks changed since it was made.
    fn ensure(&mut self, shape: &TtmShape) {
        if self.ranks != shape.ranks() {
            *self = TtmWorkspace::new(shape, self.tokens, self.lookup);
        }
    }

    /// The core index where the optimised lookup splits left and right halves.
    pub fn split(&self) -> usize {
        self.layout.split
    }

    /// Bytes held by this workspace (its buffers' capacity).
    pub fn bytes(&self) -> usize {
        let v = |b: &[Vec<f32>]| b.iter().map(Vec::capacity).sum::<usize>();
        let mut f = v(&self.h)
            + v(&self.dh)
            + v(&self.scratch_cores)
            + self.d.iter().map(|d| v(d)).sum::<usize>()
            + self.rec.capacity();
        let mut pairs = 0;
        if let Some(o) = &self.opt {
            f += o.rows.capacity() + o.drows.capacity() + o.dlp.capacity() + o.drp.capacity();
            f += o.uniq.capacity() + o.seg.capacity() + o.uleft.capacity() + o.uright.capacity();
            f += o.left_ids.capacity() + o.right_ids.capacity() + o.token_u.capacity();
            f += o.lseg.capacity() + o.rseg.capacity();
            pairs += o.order.capacity() + o.rorder.capacity();
        }
        4 * f + 8 * pairs
    }
}

impl Optimized {
    /// Deduplicates `ids` and assigns left/right half slots (no allocation: every vector was
    /// reserved for the worst case).
    fn index(&mut self, layout: &Layout, ids: &[u32]) {
        self.order.clear();
        self.order.extend(
            ids.iter()
                .enumerate()
                .map(|(t, &id)| ((id as u64) << 32) | t as u64),
        );
        self.order.sort_unstable();
        self.uniq.clear();
        self.seg.clear();
        for (pos, &entry) in self.order.iter().enumerate() {
            let id = (entry >> 32) as u32;
            if self.uniq.last() != Some(&id) {
                self.uniq.push(id);
                self.seg.push(pos as u32);
            }
        }
        self.seg.push(self.order.len() as u32);
        self.token_u.clear();
        self.token_u.resize(self.order.len(), 0);
        for (u, w) in self.seg.windows(2).enumerate() {
            for &entry in &self.order[w[0] as usize..w[1] as usize] {
                self.token_u[token_of(entry)] = u as u32;
            }
        }
        // Left keys are non-decreasing along sorted ids.
        self.uleft.clear();
        self.left_ids.clear();
        self.lseg.clear();
        let mut last_key = usize::MAX;
        for (u, &id) in self.uniq.iter().enumerate() {
            let (lk, _) = layout.keys(id as usize);
            if lk != last_key {
                self.left_ids.push(id);
                self.lseg.push(u as u32);
                last_key = lk;
            }
            self.uleft.push((self.left_ids.len() - 1) as u32);
        }
        self.lseg.push(self.uniq.len() as u32);
        // Right keys: sort (key, unique index) pairs.
        self.rorder.clear();
        self.rorder.extend(
            self.uniq
                .iter()
                .enumerate()
                .map(|(u, &id)| ((layout.keys(id as usize).1 as u64) << 32) | u as u64),
        );
        self.rorder.sort_unstable();
        self.uright.clear();
        self.uright.resize(self.uniq.len(), 0);
        self.right_ids.clear();
        self.rseg.clear();
        let mut last_key = u64::MAX;
        for (at, &entry) in self.rorder.iter().enumerate() {
            let (rk, u) = (entry >> 32, entry & 0xffff_ffff);
            if rk != last_key {
                self.right_ids.push(self.uniq[u as usize]);
                self.rseg.push(at as u32);
                last_key = rk;
            }
            self.uright[u as usize] = (self.right_ids.len() - 1) as u32;
        }
        self.rseg.push(self.rorder.len() as u32);
    }
}

impl EmbeddingLayer for TtmEmbedding {
    type Workspace = TtmWorkspace;

    fn num_embeddings(&self) -> usize {
        self.shape.num_embeddings()
    }
    fn dim(&self) -> usize {
        self.shape.dim()
    }

    fn workspace(&self, tokens: usize) -> TtmWorkspace {
        TtmWorkspace::new(&self.shape, tokens, Lookup::Auto)
    }

    fn forward(
        &self,
        ws: &mut TtmWorkspace,
        ids: &[u32],
        y: &mut [f32],
    ) -> Result<(), EmbeddingError> {
        check_ids(ids, self.num_embeddings(), ws.tokens)?;
        let d = self.dim();
        crate::check_len("TtmEmbedding y", y.len(), ids.len() * d);
        ws.ensure(&self.shape);
        if self.dead {
            y.fill(0.0);
            return Ok(());
        }
        self.gate_cores(ws);
        // Deduplicate (all but a naive-only workspace), then choose for this batch.
        ws.chosen = match (&mut ws.opt, ws.lookup) {
            (None, _) => Lookup::Naive,
            (Some(o), lookup) => {
                o.index(&ws.layout, ids);
                let naive = ws.naive_layout.step_cost(ids.len(), 0, 0, 0);
                let opt = ws.layout.step_cost(
                    ids.len(),
                    o.uniq.len(),
                    o.left_ids.len(),
                    o.right_ids.len(),
                );
                if lookup == Lookup::Auto && ws.can_naive && naive < opt {
                    Lookup::Naive
                } else {
                    Lookup::Optimized
                }
            }
        };
        let h = &ws.h;
        if ws.chosen == Lookup::Naive {
            let l = &ws.naive_layout;
            ws.rec[..ids.len() * l.lper]
                .par_chunks_exact_mut(l.lper)
                .zip(y.par_chunks_exact_mut(d))
                .zip(ids)
                .for_each(|((rec, row), &id)| {
                    l.left_chain(h, id as usize, rec);
                    row.copy_from_slice(l.lp(rec));
                });
            return Ok(());
        }
        let (l, o) = (&ws.layout, ws.opt.as_mut().expect("an optimised workspace"));
        let (lrec, rrec) = ws.rec.split_at_mut(o.rrec_at);
        let (lrec, rrec) = (
            &mut lrec[..o.left_ids.len() * l.lper],
            &mut rrec[..o.right_ids.len() * l.rper],
        );
        // Every distinct half once, each on one thread (they write their own records).
        comera_tensor::join(
            || {
                (lrec.par_chunks_exact_mut(l.lper).zip(&o.left_ids))
                    .for_each(|(rec, &id)| l.left_chain(h, id as usize, rec))
            },
            || {
                (rrec.par_chunks_exact_mut(l.rper).zip(&o.right_ids))
                    .for_each(|(rec, &id)| l.right_chain(h, id as usize, rec))
            },
        );
        let s = l.split;
        let (el, er, rs) = (l.eprefix[s], l.esuffix[s], l.r[s]);
        let (lrec, rrec) = (&*lrec, &*rrec);
        let (uleft, uright) = (&o.uleft, &o.uright);
        o.rows[..uleft.len() * d]
            .par_chunks_exact_mut(d)
            .enumerate()
            .for_each(|(u, row)| {
                let lrec = &lrec[uleft[u] as usize * l.lper..][..l.lper];
                let rrec = &rrec[uright[u] as usize * l.rper..][..l.rper];
                matmul_serial(
                    MatMut::new(row, el, er),
                    MatRef::new(l.lp(lrec), el, rs),
                    MatRef::new(l.rp(rrec), rs, er),
                    false,
                );
            });
        let rows = &o.rows;
        y.par_chunks_exact_mut(d)
            .zip(&o.token_u)
            .for_each(|(out, &u)| out.copy_from_slice(&rows[u as usize * d..][..d]));
        Ok(())
    }

    fn backward(&mut self, ws: &mut TtmWorkspace, ids: &[u32], dy: &[f32]) {
        let d = self.dim();
        crate::check_len("TtmEmbedding dy", dy.len(), ids.len() * d);
        assert_eq!(
            ids.len(),
            ws.tokens,
            "TtmEmbedding backward: ids differ from the forward's"
        );
        assert_eq!(
            ws.ranks,
            self.shape.ranks(),
            "TtmEmbedding backward: ranks changed since forward"
        );
        if self.dead {
            return;
        }
        for dh in &mut ws.dh {
            dh.fill(0.0);
        }
        if ws.chosen == Lookup::Naive {
            let l = &ws.naive_layout;
            for ((rec, g), &id) in ws.rec.chunks_exact(l.lper).zip(dy.chunks_exact(d)).zip(ids) {
                ws.d[0][0][..d].copy_from_slice(g);
                l.left_chain_back(&ws.h, &mut ws.dh, id as usize, rec, &mut ws.d[0]);
            }
            self.accumulate_core_grads(ws);
        } else {
            let l = &ws.layout;
            let o = ws.opt.as_mut().expect("an optimised workspace");
            let (lrec, rrec) = ws.rec.split_at(o.rrec_at);
            let s = l.split;
            let (el, er, rs) = (l.eprefix[s], l.esuffix[s], l.r[s]);
            let (seg, order) = (&o.seg, &o.order);
            // dRow_u = Σ_{tokens of u} dY[t], in token order.
            o.drows[..o.uniq.len() * d]
                .par_chunks_exact_mut(d)
                .enumerate()
                .for_each(|(u, acc)| {
                    acc.fill(0.0);
                    for &entry in &order[seg[u] as usize..seg[u + 1] as usize] {
                        let t = token_of(entry);
                        for (a, g) in acc.iter_mut().zip(&dy[t * d..(t + 1) * d]) {
                            *a += g;
                        }
                    }
                });
            // dLp = Σ dRow·Rpᵀ over the uniques of each left slot and dRp = Σ Lpᵀ·dRow over
            // those of each right slot, each slot on one thread summing in unique-id order.
            let (nl, nr) = (o.left_ids.len(), o.right_ids.len());
            let (drows, uleft, uright) = (&o.drows, &o.uleft, &o.uright);
            let drow = |u: usize| MatRef::new(&drows[u * d..(u + 1) * d], el, er);
            let lp = |ls: usize| MatRef::new(l.lp(&lrec[ls * l.lper..][..l.lper]), el, rs);
            let rp = |rsl: usize| MatRef::new(l.rp(&rrec[rsl * l.rper..][..l.rper]), rs, er);
            let (lseg, rseg, rorder) = (&o.lseg, &o.rseg, &o.rorder);
            let (dlp, drp) = (&mut o.dlp[..nl * el * rs], &mut o.drp[..nr * rs * er]);
            comera_tensor::join(
                || {
                    dlp.par_chunks_exact_mut(el * rs)
                        .enumerate()
                        .for_each(|(ls, dlp)| {
                            let uniques = lseg[ls] as usize..lseg[ls + 1] as usize;
                            for (i, u) in uniques.enumerate() {
                                let out = MatMut::new(dlp, el, rs);
                                matmul_serial(out, drow(u), rp(uright[u] as usize).t(), i > 0);
                            }
                        })
                },
                || {
                    if s == l.p {
                        return; // no right half
                    }
                    drp.par_chunks_exact_mut(rs * er)
                        .enumerate()
                        .for_each(|(rsl, drp)| {
                            let entries = &rorder[rseg[rsl] as usize..rseg[rsl + 1] as usize];
                            for (i, &entry) in entries.iter().enumerate() {
                                let u = (entry & 0xffff_ffff) as usize;
                                let out = MatMut::new(drp, rs, er);
                                matmul_serial(out, lp(uleft[u] as usize).t(), drow(u), i > 0);
                            }
                        })
                },
            );
            // Through the chains into the slabs: the left halves touch cores 0..s and the right
            // halves cores s..p, so the two sides run side by side (each in slot order), and
            // each then takes its own cores' gradients from their dH.
            let (dh_left, dh_right) = ws.dh.split_at_mut(s);
            let [d_left, d_right] = &mut ws.d;
            let [t_left, t_right] = &mut ws.scratch_cores;
            let h = &ws.h;
            let (mut grads_left, mut grads_right) = self.core_sides(s);
            comera_tensor::join(
                || {
                    for (slot, &id) in o.left_ids.iter().enumerate() {
                        d_left[0][..el * rs].copy_from_slice(&dlp[slot * el * rs..][..el * rs]);
                        let rec = &lrec[slot * l.lper..][..l.lper];
                        l.left_chain_back(h, dh_left, id as usize, rec, d_left);
                    }
                    grads_left.accumulate(dh_left, t_left);
                },
                || {
                    if s == l.p {
                        return; // no right half
                    }
                    for (slot, &id) in o.right_ids.iter().enumerate() {
                        d_right[0][..rs * er].copy_from_slice(&drp[slot * rs * er..][..rs * er]);
                        let rec = &rrec[slot * l.rper..][..l.rper];
                        l.right_chain_back(h, dh_right, id as usize, rec, d_right);
                    }
                    grads_right.accumulate(dh_right, t_right);
                },
            );
        }
    }

    fn params(&self) -> Vec<&Param> {
        self.cores.iter().chain(&self.gates).collect()
    }
    fn params_mut(&mut self) -> Vec<&mut Param> {
        self.cores.iter_mut().chain(self.gates.iter_mut()).collect()
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.cores
            .iter_mut()
            .chain(self.gates.iter_mut())
            .for_each(f);
    }
}
