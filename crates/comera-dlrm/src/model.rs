//! The DLRM model: bottom MLP over the dense features, one embedding table per categorical
//! field (dense or TTM), pairwise dot-product interaction, top MLP, one logit.
//!
//! Forward for a batch of B examples with F fields and width D:
//!   x0 = ReLU-MLP_bottom(dense)                              (B × D)
//!   T_0 = x0, T_f = E_f[ids_f] for f = 1..F                  ((F+1) × B × D, field-major)
//!   z_b = [x0_b, ⟨T_i,b, T_j,b⟩ for i = 1..F, j = 0..i−1]     (B × (D + F(F+1)/2))
//!   logit = MLP_top(z)                                       (ReLU between layers, none last)
//!   L = mean_b BCE(σ(logit_b), y_b)
//! Backward (hand-derived): dlogit = (σ(logit) − y)/B; top MLP backward gives dz; for pair
//! p = (i, j), dT_i,b += dz_b,D+p · T_j,b and dT_j,b += dz_b,D+p · T_i,b; dx0 = dz_b,:D + dT_0;
//! tables accumulate from dT_f; the bottom MLP backward from dx0.
//!
//! The state is planned once for a fixed batch (every buffer allocated up front); tables run in
//! parallel (each table's work is independent, so results do not depend on the thread count).

use crate::config::{DlrmConfig, TableKind};
use crate::loss::bce_with_logits;
use comera_layers::embedding::EmbeddingWorkspace;
use comera_layers::linear::LinearWorkspace;
use comera_layers::{
    Compressible, Embedding, EmbeddingError, EmbeddingLayer, Layer, Linear, Param, RankGates,
    TtmEmbedding, TtmWorkspace,
};
use comera_tensor::factor::balanced_factorisations;
use comera_tensor::{init, TtmShape};
use rayon::prelude::*;

/// Proposes a TTM layout for a `rows × dim` table with `cores` cores and uniform `rank`:
/// dim modes are comera-tensor's most balanced factorisation of `dim`; vocab modes start at
/// ⌈rows^(1/p)⌉ each and are lowered one at a time (round robin from the last) while their
/// product still covers `rows`; each bond's rank is clamped to the largest rank the modes on
/// either side can use (∏ v·e of the left or right cores).
pub fn propose_ttm_shape(
    rows: usize,
    dim: usize,
    cores: usize,
    rank: usize,
) -> Result<TtmShape, String> {
    let e = balanced_factorisations(dim, cores, 1)
        .pop()
        .ok_or_else(|| format!("cannot factor dim {dim} into {cores} modes"))?;
    let p = cores;
    let mut m = (rows as f64).powf(1.0 / p as f64).ceil().max(1.0) as usize;
    while m.checked_pow(p as u32).is_none_or(|c| c < rows) {
        m += 1;
    }
    let mut v = vec![m; p];
    loop {
        let mut changed = false;
        for k in (0..p).rev() {
            if v[k] > 1 {
                let prod: usize = v.iter().product::<usize>() / v[k] * (v[k] - 1);
                if prod >= rows {
                    v[k] -= 1;
                    changed = true;
                }
            }
        }
        if !changed {
            break;
        }
    }
    v.sort_unstable_by(|a, b| b.cmp(a));
    let sizes: Vec<usize> = v.iter().zip(&e).map(|(a, b)| a * b).collect();
    let mut ranks = vec![1; p + 1];
    for (k, r) in ranks.iter_mut().enumerate().take(p).skip(1) {
        let left = sizes[..k]
            .iter()
            .try_fold(1usize, |a, &s| a.checked_mul(s))
            .unwrap_or(usize::MAX);
        let right = sizes[k..]
            .iter()
            .try_fold(1usize, |a, &s| a.checked_mul(s))
            .unwrap_or(usize::MAX);
        *r = rank.min(left).min(right);
    }
    TtmShape::new(&v, &e, &ranks, rows).map_err(|err| err.to_string())
}

/// One field's table.
#[derive(Clone, Debug)]
pub enum Table {
    Dense(Embedding),
    Ttm(TtmEmbedding),
}

/// A table's lookup workspace.
#[derive(Debug)]
// One per table, made once: the size difference between variants is irrelevant.
#[allow(clippy::large_enum_variant)]
pub enum TableWs {
    Dense(EmbeddingWorkspace),
    Ttm(TtmWorkspace),
}

impl Table {
    pub fn rows(&self) -> usize {
        match self {
            Table::Dense(t) => t.num_embeddings(),
            Table::Ttm(t) => t.num_embeddings(),
        }
    }

    /// Trainable scalars.
    pub fn num_params(&self) -> usize {
        match self {
            Table::Dense(t) => t.params().iter().map(|p| p.len()).sum(),
            Table::Ttm(t) => t.params().iter().map(|p| p.len()).sum(),
        }
    }

    /// `dense 943×16` or `ttm 943×16 v=[10,10,10] e=[4,2,2] r=[1,8,8,1]`.
    pub fn describe(&self) -> String {
        match self {
            Table::Dense(t) => format!("dense {}x{}", t.num_embeddings(), t.dim()),
            Table::Ttm(t) => {
                let s = t.shape();
                format!(
                    "ttm {}x{} v={:?} e={:?} r={:?}",
                    s.num_embeddings(),
                    s.dim(),
                    s.vocab_modes(),
                    s.dim_modes(),
                    s.ranks()
                )
            }
        }
    }

    fn workspace(&self, tokens: usize) -> TableWs {
        match self {
            Table::Dense(t) => TableWs::Dense(t.workspace(tokens)),
            Table::Ttm(t) => TableWs::Ttm(t.workspace(tokens)),
        }
    }

    fn forward(&self, ws: &mut TableWs, ids: &[u32], y: &mut [f32]) -> Result<(), EmbeddingError> {
        match (self, ws) {
            (Table::Dense(t), TableWs::Dense(w)) => t.forward(w, ids, y),
            (Table::Ttm(t), TableWs::Ttm(w)) => t.forward(w, ids, y),
            _ => unreachable!("table and workspace kinds always match"),
        }
    }

    fn backward(&mut self, ws: &mut TableWs, ids: &[u32], dy: &[f32]) {
        match (self, ws) {
            (Table::Dense(t), TableWs::Dense(w)) => t.backward(w, ids, dy),
            (Table::Ttm(t), TableWs::Ttm(w)) => t.backward(w, ids, dy),
            _ => unreachable!("table and workspace kinds always match"),
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        match self {
            Table::Dense(t) => t.visit_params_mut(f),
            Table::Ttm(t) => t.visit_params_mut(f),
        }
    }

    fn params(&self) -> Vec<&Param> {
        match self {
            Table::Dense(t) => t.params(),
            Table::Ttm(t) => t.params(),
        }
    }
}

/// A stack of dense layers with ReLU after each layer (after the last one too when
/// `relu_last`).
#[derive(Clone, Debug)]
pub struct Mlp {
    pub layers: Vec<Linear>,
    pub relu_last: bool,
}

/// Per-batch buffers of an [`Mlp`]: each layer's output (after its ReLU) and its gradient.
#[derive(Debug)]
pub struct MlpState {
    ws: Vec<LinearWorkspace>,
    acts: Vec<Vec<f32>>,
    dacts: Vec<Vec<f32>>,
}

impl Mlp {
    /// Layers `widths[0] → widths[1] → … → widths[last]`.
    pub fn new(name: &str, widths: &[usize], relu_last: bool, rng: &mut init::Rng) -> Mlp {
        let layers = widths
            .windows(2)
            .enumerate()
            .map(|(l, w)| Linear::new(&format!("{name}.{l}"), w[0], w[1], rng))
            .collect();
        Mlp { layers, relu_last }
    }

    pub fn state(&self, batch: usize) -> MlpState {
        let acts: Vec<Vec<f32>> = self
            .layers
            .iter()
            .map(|l| vec![0.0; batch * l.out_features()])
            .collect();
        MlpState {
            ws: self.layers.iter().map(|l| l.workspace(batch)).collect(),
            dacts: acts.clone(),
            acts,
        }
    }

    fn relu_at(&self, l: usize) -> bool {
        l + 1 < self.layers.len() || self.relu_last
    }

    pub fn forward(&self, st: &mut MlpState, x: &[f32]) {
        for l in 0..self.layers.len() {
            let (prev, cur) = st.acts.split_at_mut(l);
            let input = if l == 0 { x } else { &prev[l - 1][..] };
            self.layers[l].forward(&mut st.ws[l], input, &mut cur[0]);
            if self.relu_at(l) {
                relu_in_place(&mut cur[0]);
            }
        }
    }

    /// The last layer's output.
    pub fn output<'a>(&self, st: &'a MlpState) -> &'a [f32] {
        st.acts.last().expect("an MLP has a layer")
    }

    /// The last layer's output gradient (to be written before `backward`).
    pub fn output_grad<'a>(&self, st: &'a mut MlpState) -> &'a mut [f32] {
        st.dacts.last_mut().expect("an MLP has a layer")
    }

    /// From the output gradient in [`Mlp::output_grad`], accumulates parameter gradients and
    /// writes `dx` when given. Clobbers the state's gradient buffers.
    pub fn backward(&mut self, st: &mut MlpState, x: &[f32], mut dx: Option<&mut [f32]>) {
        for l in (0..self.layers.len()).rev() {
            if self.relu_at(l) {
                relu_backward_in_place(&st.acts[l], &mut st.dacts[l]);
            }
            let (dprev, dcur) = st.dacts.split_at_mut(l);
            let input = if l == 0 { x } else { &st.acts[l - 1][..] };
            let d_in = if l == 0 {
                dx.as_deref_mut()
            } else {
                Some(&mut dprev[l - 1][..])
            };
            self.layers[l].backward(&mut st.ws[l], input, &dcur[0], d_in);
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        for l in &mut self.layers {
            l.visit_params_mut(f);
        }
    }

    fn num_params(&self) -> usize {
        self.layers.iter().map(|l| l.num_params()).sum()
    }
}

/// y ← max(y, 0).
pub fn relu_in_place(y: &mut [f32]) {
    for v in y {
        *v = v.max(0.0);
    }
}

/// d ← d ⊙ [y > 0], y the ReLU's output.
pub fn relu_backward_in_place(y: &[f32], d: &mut [f32]) {
    for (g, &v) in d.iter_mut().zip(y) {
        if v <= 0.0 {
            *g = 0.0;
        }
    }
}

/// Index of pair (i, j), i > j, in the interaction's upper-triangle order
/// (i = 1..F, j = 0..i−1): i(i−1)/2 + j.
#[inline]
pub fn pair_index(i: usize, j: usize) -> usize {
    i * (i - 1) / 2 + j
}

/// The DLRM model.
#[derive(Clone, Debug)]
pub struct Dlrm {
    pub cfg: DlrmConfig,
    pub n_dense: usize,
    pub field_names: Vec<String>,
    pub bottom: Mlp,
    pub tables: Vec<Table>,
    pub top: Mlp,
}

/// Everything a step at one batch size needs, allocated once.
#[derive(Debug)]
pub struct DlrmState {
    batch: usize,
    bottom: MlpState,
    top: MlpState,
    tws: Vec<TableWs>,
    /// (F+1) × B × D: slot 0 the bottom output, slot f the table f−1 rows.
    t: Vec<f32>,
    dt: Vec<f32>,
    /// B × (D + P): the top MLP's input and its gradient.
    z: Vec<f32>,
    dz: Vec<f32>,
}

impl DlrmState {
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// The logits of the last forward (B).
    pub fn logits(&self) -> &[f32] {
        self.top.acts.last().expect("an MLP has a layer")
    }

    /// Bytes held by the state's buffers (activations, gradients, table workspaces).
    pub fn bytes(&self) -> usize {
        let v = |b: &[Vec<f32>]| b.iter().map(Vec::capacity).sum::<usize>();
        let ws: usize = self
            .tws
            .iter()
            .map(|w| match w {
                TableWs::Dense(_) => 0,
                TableWs::Ttm(w) => w.bytes(),
            })
            .sum();
        4 * (v(&self.bottom.acts)
            + v(&self.bottom.dacts)
            + v(&self.top.acts)
            + v(&self.top.dacts)
            + self.t.capacity()
            + self.dt.capacity()
            + self.z.capacity()
            + self.dz.capacity())
            + ws
    }
}

impl Dlrm {
    /// A model for `n_dense` dense features and fields with these table sizes.
    pub fn new(
        cfg: &DlrmConfig,
        n_dense: usize,
        field_names: &[String],
        table_sizes: &[usize],
        seed: u64,
    ) -> Result<Dlrm, String> {
        cfg.validate()?;
        if n_dense == 0 {
            return Err(
                "the data has no dense features; DLRM's bottom MLP needs at least one".into(),
            );
        }
        if table_sizes.is_empty() {
            return Err("the data has no categorical fields".into());
        }
        let mut rng = init::rng(seed);
        let d = cfg.embedding_dim;
        let mut widths = vec![n_dense];
        widths.extend(&cfg.bottom_mlp);
        widths.push(d);
        let bottom = Mlp::new("bottom", &widths, true, &mut rng);
        let rule = RankGates::new(cfg.gate_threshold);
        let mut tables = Vec::with_capacity(table_sizes.len());
        for (f, &rows) in table_sizes.iter().enumerate() {
            let name = format!(
                "table.{}",
                field_names.get(f).cloned().unwrap_or_else(|| f.to_string())
            );
            let ttm = match cfg.tables {
                TableKind::Dense => false,
                TableKind::Ttm => true,
                TableKind::Auto => rows >= cfg.ttm_threshold,
            };
            let mut trng = init::rng(seed ^ (0x7ab1e ^ (f as u64 + 1)).wrapping_mul(0x9e37_79b9));
            tables.push(if ttm {
                let shape = propose_ttm_shape(rows, d, cfg.ttm_cores, cfg.ttm_rank)
                    .map_err(|e| format!("{name}: {e}"))?;
                Table::Ttm(
                    TtmEmbedding::new(&name, shape, rule, cfg.embedding_std, &mut trng)
                        .map_err(|e| format!("{name}: {e}"))?,
                )
            } else {
                Table::Dense(Embedding::new(&name, rows, d, cfg.embedding_std, &mut trng))
            });
        }
        let f = table_sizes.len();
        let mut widths = vec![d + f * (f + 1) / 2];
        widths.extend(&cfg.top_mlp);
        widths.push(1);
        let top = Mlp::new("top", &widths, false, &mut rng);
        Ok(Dlrm {
            cfg: cfg.clone(),
            n_dense,
            field_names: field_names.to_vec(),
            bottom,
            tables,
            top,
        })
    }

    pub fn n_fields(&self) -> usize {
        self.tables.len()
    }

    /// Width of the top MLP's input: D + F(F+1)/2.
    pub fn interaction_width(&self) -> usize {
        let f = self.n_fields();
        self.cfg.embedding_dim + f * (f + 1) / 2
    }

    /// Buffers for batches of exactly `batch` examples.
    pub fn state(&self, batch: usize) -> DlrmState {
        let (f, d) = (self.n_fields(), self.cfg.embedding_dim);
        DlrmState {
            batch,
            bottom: self.bottom.state(batch),
            top: self.top.state(batch),
            tws: self.tables.iter().map(|t| t.workspace(batch)).collect(),
            t: vec![0.0; (f + 1) * batch * d],
            dt: vec![0.0; (f + 1) * batch * d],
            z: vec![0.0; batch * self.interaction_width()],
            dz: vec![0.0; batch * self.interaction_width()],
        }
    }

    /// Forward for one batch (dense B × n_dense, ids field-major F × B); the logits are in
    /// [`DlrmState::logits`]. Bad ids are an error naming the field.
    pub fn forward(&self, st: &mut DlrmState, dense: &[f32], ids: &[u32]) -> Result<(), String> {
        let (b, f, d) = (st.batch, self.n_fields(), self.cfg.embedding_dim);
        if dense.len() != b * self.n_dense || ids.len() != b * f {
            return Err(format!(
                "batch has {} dense values and {} ids; the model expects {} × {} and {} × {}",
                dense.len(),
                ids.len(),
                b,
                self.n_dense,
                f,
                b
            ));
        }
        let bd = b * d;
        self.bottom.forward(&mut st.bottom, dense);
        let (slot0, rest) = st.t.split_at_mut(bd);
        slot0.copy_from_slice(self.bottom.output(&st.bottom));
        self.tables
            .par_iter()
            .zip(st.tws.par_iter_mut())
            .zip(rest.par_chunks_mut(bd))
            .enumerate()
            .try_for_each(|(k, ((tab, ws), y))| {
                tab.forward(ws, &ids[k * b..(k + 1) * b], y).map_err(|e| {
                    format!(
                        "field `{}`: {e}",
                        self.field_names.get(k).map_or("?", String::as_str)
                    )
                })
            })?;
        let t = &st.t;
        let w = self.interaction_width();
        st.z.par_chunks_mut(w)
            .with_min_len(64)
            .enumerate()
            .for_each(|(s, zr)| {
                let row = |i: usize| &t[i * bd + s * d..i * bd + (s + 1) * d];
                zr[..d].copy_from_slice(row(0));
                for i in 1..=f {
                    let ti = row(i);
                    for j in 0..i {
                        zr[d + pair_index(i, j)] = dot(ti, row(j));
                    }
                }
            });
        self.top.forward(&mut st.top, &st.z);
        Ok(())
    }

    /// Mean BCE of the last forward's logits against `labels`; writes dL/dlogit for
    /// [`Dlrm::backward`]. Returns (mean loss, correct predictions at 0.5).
    pub fn loss(&self, st: &mut DlrmState, labels: &[f32]) -> (f64, usize) {
        let logits = st.top.acts.last().expect("an MLP has a layer");
        let dl = st.top.dacts.last_mut().expect("an MLP has a layer");
        bce_with_logits(logits, labels, Some(dl))
    }

    /// Backward of the last forward and [`Dlrm::loss`]: accumulates every parameter gradient.
    pub fn backward(&mut self, st: &mut DlrmState, dense: &[f32], ids: &[u32]) {
        let (b, f, d) = (st.batch, self.n_fields(), self.cfg.embedding_dim);
        let bd = b * d;
        let w = self.interaction_width();
        self.top.backward(&mut st.top, &st.z, Some(&mut st.dz));
        let (t, dz) = (&st.t, &st.dz);
        st.dt.par_chunks_mut(bd).enumerate().for_each(|(i, dti)| {
            for s in 0..b {
                let g = &dz[s * w..(s + 1) * w];
                let out = &mut dti[s * d..(s + 1) * d];
                if i == 0 {
                    out.copy_from_slice(&g[..d]);
                } else {
                    out.fill(0.0);
                }
                for j in 0..=f {
                    if j == i {
                        continue;
                    }
                    let p = if i > j {
                        pair_index(i, j)
                    } else {
                        pair_index(j, i)
                    };
                    let c = g[d + p];
                    let tj = &t[j * bd + s * d..j * bd + (s + 1) * d];
                    for (o, &v) in out.iter_mut().zip(tj) {
                        *o += c * v;
                    }
                }
            }
        });
        let (dt0, drest) = st.dt.split_at(bd);
        self.tables
            .par_iter_mut()
            .zip(st.tws.par_iter_mut())
            .zip(drest.par_chunks(bd))
            .enumerate()
            .for_each(|(k, ((tab, ws), dy))| tab.backward(ws, &ids[k * b..(k + 1) * b], dy));
        self.bottom.output_grad(&mut st.bottom).copy_from_slice(dt0);
        self.bottom.backward(&mut st.bottom, dense, None);
    }

    /// Every parameter, in a fixed order (bottom MLP, tables, top MLP).
    pub fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.bottom.visit_params_mut(f);
        for t in &mut self.tables {
            t.visit_params_mut(f);
        }
        self.top.visit_params_mut(f);
    }

    /// Parameters by reference, in visiting order.
    pub fn params(&self) -> Vec<&Param> {
        let mut v: Vec<&Param> = Vec::new();
        for l in &self.bottom.layers {
            v.extend(l.params());
        }
        for t in &self.tables {
            v.extend(t.params());
        }
        for l in &self.top.layers {
            v.extend(l.params());
        }
        v
    }

    /// Zeroes every gradient (dense tables: the whole table, as dense training does).
    pub fn zero_grad(&mut self) {
        self.visit_params_mut(&mut |p| p.grad.fill(0.0));
    }

    pub fn num_params(&self) -> usize {
        self.bottom.num_params()
            + self.top.num_params()
            + self.tables.iter().map(Table::num_params).sum::<usize>()
    }

    /// Trainable scalars of the embedding tables.
    pub fn table_params(&self) -> usize {
        self.tables.iter().map(Table::num_params).sum()
    }

    /// What the tables would hold as dense V × D tables.
    pub fn dense_table_params(&self) -> usize {
        self.tables.iter().map(|t| t.rows()).sum::<usize>() * self.cfg.embedding_dim
    }

    /// The TTM tables, for the rank-adaptive controller (size penalty, truncation).
    pub fn compressible_mut(&mut self) -> Vec<&mut dyn Compressible> {
        self.tables
            .iter_mut()
            .filter_map(|t| match t {
                Table::Ttm(t) => Some(t as &mut dyn Compressible),
                Table::Dense(_) => None,
            })
            .collect()
    }
}

impl comera_train::RankAdaptive for Dlrm {
    fn visit_compressible(&self, f: &mut dyn FnMut(&dyn Compressible)) {
        for t in &self.tables {
            if let Table::Ttm(t) = t {
                f(t);
            }
        }
    }
    fn visit_compressible_mut(&mut self, f: &mut dyn FnMut(&mut dyn Compressible)) {
        for t in &mut self.tables {
            if let Table::Ttm(t) = t {
                f(t);
            }
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        Dlrm::visit_params_mut(self, f)
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums: vectorises, and the order is fixed.
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposed_ttm_shapes_cover_the_rows() {
        let s = propose_ttm_shape(943, 16, 3, 8).unwrap();
        assert_eq!(s.vocab_modes(), &[10, 10, 10]);
        assert_eq!(s.dim_modes().iter().product::<usize>(), 16);
        assert_eq!(s.ranks(), &[1, 8, 8, 1]);
        let s = propose_ttm_shape(10_000_000, 64, 3, 32).unwrap();
        assert!(s.vocab_modes().iter().product::<usize>() >= 10_000_000);
        assert!(
            s.vocab_modes().iter().product::<usize>() < 10_100_000,
            "{s:?}"
        );
        let s = propose_ttm_shape(2, 16, 3, 8).unwrap();
        assert_eq!(s.vocab_modes().iter().product::<usize>(), 2);
        assert!(s.ranks().iter().all(|&r| r >= 1));
        assert_eq!(pair_index(1, 0), 0);
        assert_eq!(pair_index(2, 1), 2);
        assert_eq!(pair_index(3, 0), 3);
    }
}
