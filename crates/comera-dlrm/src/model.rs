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

use crate::config::{ConfigError, DlrmConfig, TableKind};
use crate::loss::bce_with_logits;
use comera_data::ctr::CtrBatch;
use comera_layers::any::AnyEmbeddingWorkspace;
use comera_layers::mlp::MlpState;
use comera_layers::{
    AnyEmbedding, Compressible, Embedding, MemoryBreakdown, Mlp, Model, Param, RankGates,
    StepStats, Trainable, TtmEmbedding,
};
use comera_tensor::factor::balanced_factorisations;
use comera_tensor::{init, TtmShape};
use rayon::prelude::*;

/// A model that cannot be built, or a batch it cannot take (wrong sizes, an id out of range).
/// Each message is whole on one line (the cause included), as callers print it with `{}`.
#[derive(Debug, thiserror::Error)]
pub enum DlrmError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("the data has no dense features; DLRM's bottom MLP needs at least one")]
    NoDenseFeatures,
    #[error("the data has no categorical fields")]
    NoFields,
    /// A TTM table whose layout cannot be proposed.
    #[error("{table}: {error}")]
    Layout { table: String, error: LayoutError },
    /// A TTM table that cannot be built on its proposed layout.
    #[error("{table}: {error}")]
    Table {
        table: String,
        error: comera_layers::LayerError,
    },
    #[error("batch has {got_dense} dense values, {got_ids} ids and {got_labels} labels; the model expects {dense}, {ids} and {labels}")]
    BatchSize {
        got_dense: usize,
        got_ids: usize,
        got_labels: usize,
        dense: usize,
        ids: usize,
        labels: usize,
    },
    /// A field's lookup failed (an id out of its table's range).
    #[error("field `{field}`: {error}")]
    Lookup {
        field: String,
        error: comera_layers::EmbeddingError,
    },
}

/// Why [`propose_ttm_shape`] has no layout for a table.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("cannot factor dim {dim} into {cores} modes")]
    Factor { dim: usize, cores: usize },
    #[error(transparent)]
    Shape(#[from] comera_tensor::ShapeError),
}

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
) -> Result<TtmShape, LayoutError> {
    let e = balanced_factorisations(dim, cores, 1)
        .pop()
        .ok_or(LayoutError::Factor { dim, cores })?;
    let p = cores;
    // Whether p modes of m rows cover the table; a product past usize::MAX covers any table
    // (so the search below ends for any number of cores).
    let covers = |m: usize| {
        u32::try_from(p)
            .ok()
            .and_then(|p| m.checked_pow(p))
            .is_none_or(|c| c >= rows)
    };
    // From the f64 root, which may be off by one either way.
    let mut m = (rows as f64).powf(1.0 / p as f64).ceil().max(1.0) as usize;
    while m > 1 && covers(m - 1) {
        m -= 1;
    }
    while !covers(m) {
        m += 1;
    }
    let mut v = vec![m; p];
    loop {
        let mut changed = false;
        for k in (0..p).rev() {
            if v[k] > 1 {
                // The product with v[k] lowered by one, saturating (then it covers any table).
                let prod = v.iter().enumerate().fold(1usize, |a, (j, &x)| {
                    a.saturating_mul(if j == k { x - 1 } else { x })
                });
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
    Ok(TtmShape::new(&v, &e, &ranks, rows)?)
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
    pub tables: Vec<AnyEmbedding>,
    pub top: Mlp,
}

/// Everything a step at one batch size needs, allocated once.
#[derive(Debug)]
pub struct DlrmState {
    batch: usize,
    bottom: MlpState,
    top: MlpState,
    tws: Vec<AnyEmbeddingWorkspace>,
    /// The loaded batch: dense features (B × n_dense), ids (field-major F × B), labels (B).
    dense: Vec<f32>,
    ids: Vec<u32>,
    labels: Vec<f32>,
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
        self.top.output()
    }

    /// Loads a batch of exactly [`DlrmState::batch`] examples (checked).
    pub fn load(&mut self, b: &CtrBatch) -> Result<(), DlrmError> {
        if b.dense.len() != self.dense.len()
            || b.cats.len() != self.ids.len()
            || b.labels.len() != self.labels.len()
        {
            return Err(DlrmError::BatchSize {
                got_dense: b.dense.len(),
                got_ids: b.cats.len(),
                got_labels: b.labels.len(),
                dense: self.dense.len(),
                ids: self.ids.len(),
                labels: self.labels.len(),
            });
        }
        self.dense.copy_from_slice(&b.dense);
        self.ids.copy_from_slice(&b.cats);
        self.labels.copy_from_slice(&b.labels);
        Ok(())
    }

    /// Bytes held by the state's buffers (activations, gradients, table workspaces, batch).
    pub fn bytes(&self) -> usize {
        let ws: usize = self.tws.iter().map(AnyEmbedding::workspace_bytes).sum();
        self.bottom.bytes()
            + self.top.bytes()
            + 4 * (self.t.capacity()
                + self.dt.capacity()
                + self.z.capacity()
                + self.dz.capacity()
                + self.dense.capacity()
                + self.ids.capacity()
                + self.labels.capacity())
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
    ) -> Result<Dlrm, DlrmError> {
        cfg.validate()?;
        if n_dense == 0 {
            return Err(DlrmError::NoDenseFeatures);
        }
        if table_sizes.is_empty() {
            return Err(DlrmError::NoFields);
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
                let shape =
                    propose_ttm_shape(rows, d, cfg.ttm_cores, cfg.ttm_rank).map_err(|error| {
                        DlrmError::Layout {
                            table: name.clone(),
                            error,
                        }
                    })?;
                AnyEmbedding::Ttm(
                    TtmEmbedding::new(&name, shape, rule, cfg.embedding_std, &mut trng).map_err(
                        |error| DlrmError::Table {
                            table: name.clone(),
                            error,
                        },
                    )?,
                )
            } else {
                AnyEmbedding::Dense(Embedding::new(&name, rows, d, cfg.embedding_std, &mut trng))
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
            dense: vec![0.0; batch * self.n_dense],
            ids: vec![0; batch * f],
            labels: vec![0.0; batch],
            t: vec![0.0; (f + 1) * batch * d],
            dt: vec![0.0; (f + 1) * batch * d],
            z: vec![0.0; batch * self.interaction_width()],
            dz: vec![0.0; batch * self.interaction_width()],
        }
    }

    /// Forward on the loaded batch up to the logits ([`DlrmState::logits`]). Bad ids are an
    /// error naming the field.
    pub fn forward_logits(&self, st: &mut DlrmState) -> Result<(), DlrmError> {
        let (b, f, d) = (st.batch, self.n_fields(), self.cfg.embedding_dim);
        let bd = b * d;
        self.bottom.forward(&mut st.bottom, &st.dense);
        let (slot0, rest) = st.t.split_at_mut(bd);
        slot0.copy_from_slice(self.bottom.output(&st.bottom));
        let ids = &st.ids;
        self.tables
            .par_iter()
            .zip(st.tws.par_iter_mut())
            .zip(rest.par_chunks_mut(bd))
            .enumerate()
            .try_for_each(|(k, ((tab, ws), y))| {
                tab.forward(ws, &ids[k * b..(k + 1) * b], y)
                    .map_err(|error| DlrmError::Lookup {
                        field: self.field_names.get(k).map_or("?", String::as_str).into(),
                        error,
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

    /// Trainable scalars of the embedding tables.
    pub fn table_params(&self) -> usize {
        self.tables.iter().map(AnyEmbedding::num_params).sum()
    }

    /// What the tables would hold as dense V × D tables.
    pub fn dense_table_params(&self) -> usize {
        self.tables.iter().map(|t| t.rows()).sum::<usize>() * self.cfg.embedding_dim
    }
}

impl Model for Dlrm {
    /// Parameters by reference, in visiting order.
    fn params(&self) -> Vec<&Param> {
        let mut v = self.bottom.params();
        for t in &self.tables {
            v.extend(t.params());
        }
        v.extend(self.top.params());
        v
    }

    /// Every parameter, in a fixed order (bottom MLP, tables, top MLP).
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.bottom.visit_params_mut(f);
        for t in &mut self.tables {
            t.visit_params_mut(f);
        }
        self.top.visit_params_mut(f);
    }

    /// The TTM tables, in field order.
    fn visit_compressible(&self, f: &mut dyn FnMut(&dyn Compressible)) {
        self.tables
            .iter()
            .filter_map(AnyEmbedding::compressible)
            .for_each(f);
    }

    fn visit_compressible_mut(&mut self, f: &mut dyn FnMut(&mut dyn Compressible)) {
        for t in self
            .tables
            .iter_mut()
            .filter_map(AnyEmbedding::compressible_mut)
        {
            f(t);
        }
    }

    fn num_params(&self) -> usize {
        self.bottom.num_params() + self.top.num_params() + self.table_params()
    }

    fn dense_equivalent_params(&self) -> usize {
        self.num_params() - self.table_params() + self.dense_table_params()
    }
}

impl Trainable for Dlrm {
    type State = DlrmState;
    type Error = DlrmError;

    /// Logits, then the mean BCE against the loaded labels; dL/dlogit is left for the
    /// backward. `correct` counts predictions at probability 0.5.
    fn forward(
        &self,
        st: &mut DlrmState,
        _train: bool,
        _step: u64,
    ) -> Result<StepStats, DlrmError> {
        self.forward_logits(st)?;
        let (logits, dl) = self.top.output_and_grad(&mut st.top);
        let (loss, correct) = bce_with_logits(logits, &st.labels, Some(dl));
        Ok(StepStats {
            loss,
            correct,
            count: st.batch,
            terms: None,
        })
    }

    /// Backward of the last forward: accumulates every parameter gradient.
    fn backward(&mut self, st: &mut DlrmState) {
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
        let ids = &st.ids;
        self.tables
            .par_iter_mut()
            .zip(st.tws.par_iter_mut())
            .zip(drest.par_chunks(bd))
            .enumerate()
            .for_each(|(k, ((tab, ws), dy))| tab.backward(ws, &ids[k * b..(k + 1) * b], dy));
        self.bottom.output_grad(&mut st.bottom).copy_from_slice(dt0);
        self.bottom.backward(&mut st.bottom, &st.dense, None);
    }

    fn bytes(&self, st: &DlrmState) -> MemoryBreakdown {
        let params = 4 * self.num_params();
        MemoryBreakdown {
            params,
            grads: params,
            state: st.bytes(),
        }
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

    /// 64 cores: every m ≥ 2 overflows m^64, which the search once took for "too few rows"
    /// and looped on forever (issue 35).
    #[test]
    fn more_cores_than_a_product_can_count_still_propose_a_shape() {
        for (rows, cores) in [
            (943, 64),
            (2, 64),
            (1, 200),
            (u32::MAX as usize, 64),
            (10_000_000, 40),
        ] {
            let s = propose_ttm_shape(rows, 16, cores, 8).unwrap();
            assert_eq!(s.vocab_modes().len(), cores);
            let covered = s
                .vocab_modes()
                .iter()
                .try_fold(1usize, |a, &v| a.checked_mul(v));
            assert!(covered.is_none_or(|c| c >= rows), "{rows} rows: {s:?}");
        }
    }
}
