//! Paths for a TT linear layer `Y = X·W + b` (X: B × N, W: N × M held as K = p + q cores).
//!
//! Notation (0-based cores c = 0..K-1, core c of shape r_c × s_c × r_{c+1}, H_c = gated core):
//! - `merged`: L = H_0⋯H_{p-1} (N × r_p) and R = H_p⋯H_{K-1} (r_p × M) by chains of GEMMs,
//!   then T1 = X·L, Y = T1·R. Backward: dR = T1ᵀ·dY, U1 = dY·Rᵀ, dX = U1·Lᵀ, dL = Xᵀ·U1, then
//!   dH_c peeled off dL and dR through the saved chain prefixes. Best for large batches.
//! - `sequential`: X (digits reversed) is contracted core by core, one GEMM per core whose rows
//!   are the batch times the not-yet-contracted modes. No batch-independent work; best for
//!   small batches.
//! - `dense`: W = L·R is formed, then Y = X·W. Best when ranks are high relative to the modes.
//!
//! Each cost function lists exactly the GEMMs and passes that `comera-layers`' `TtLinear` runs.

use crate::cost::{CostModel, Costing};
use comera_tensor::TtShape;

/// A way to contract a TT linear layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TtPath {
    Merged,
    Sequential,
    Dense,
}

impl TtPath {
    pub const ALL: [TtPath; 3] = [TtPath::Merged, TtPath::Sequential, TtPath::Dense];

    pub fn name(self) -> &'static str {
        match self {
            TtPath::Merged => "merged",
            TtPath::Sequential => "sequential",
            TtPath::Dense => "dense",
        }
    }

    pub fn parse(s: &str) -> Option<TtPath> {
        TtPath::ALL.into_iter().find(|p| p.name() == s)
    }
}

impl std::fmt::Display for TtPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a step runs: inference only, or training (forward + backward, with or without dX).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    Train { need_dx: bool },
}

/// The estimated cost of one path.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PathCost {
    pub path: TtPath,
    pub flops: f64,
    pub bytes: f64,
    pub gemm_calls: usize,
    pub est_ms: f64,
}

/// The path chosen for a layer's shape, ranks and batch, with every candidate's estimate.
#[derive(Clone, Debug)]
pub struct ContractionPlan {
    pub path: TtPath,
    pub batch: usize,
    pub ranks: Vec<usize>,
    pub pass: Pass,
    pub costs: Vec<PathCost>,
}

impl ContractionPlan {
    /// Estimates every path and picks the cheapest (ties go to the earlier path in
    /// [`TtPath::ALL`]).
    pub fn for_tt_linear(shape: &TtShape, batch: usize, pass: Pass, model: &CostModel) -> Self {
        let costs: Vec<PathCost> = TtPath::ALL
            .iter()
            .map(|&p| tt_linear_cost(shape, batch, p, pass, model))
            .collect();
        let best = costs
            .iter()
            .min_by(|a, b| a.est_ms.total_cmp(&b.est_ms))
            .expect("three paths")
            .path;
        ContractionPlan {
            path: best,
            batch,
            ranks: shape.ranks().to_vec(),
            pass,
            costs,
        }
    }

    /// A plan that always uses `path` (costs are still estimated, for reporting).
    pub fn fixed(
        shape: &TtShape,
        batch: usize,
        pass: Pass,
        model: &CostModel,
        path: TtPath,
    ) -> Self {
        let mut plan = Self::for_tt_linear(shape, batch, pass, model);
        plan.path = path;
        plan
    }

    /// Whether this plan was made for these ranks and this batch.
    pub fn is_valid_for(&self, shape: &TtShape, batch: usize) -> bool {
        self.batch == batch && self.ranks == shape.ranks()
    }

    pub fn cost_of(&self, path: TtPath) -> &PathCost {
        self.costs
            .iter()
            .find(|c| c.path == path)
            .expect("every path is costed")
    }
}

/// Products n_0⋯n_{c-1} (prefix, `pre[c]`) of the input modes.
fn prefix(modes: &[usize]) -> Vec<usize> {
    let mut v = vec![1];
    for &m in modes {
        v.push(v.last().unwrap() * m);
    }
    v
}

/// The left and right chains that build L and R (merged and dense paths).
fn chains(shape: &TtShape, model: &CostModel, c: &mut Costing) {
    let (p, k) = (shape.p(), shape.n_cores());
    let r = shape.ranks();
    let pre = prefix(shape.in_modes());
    // left[c] = left[c-1] (P_c × r_c) · H_c (r_c × n_c·r_{c+1})
    for i in 1..p {
        c.gemm(model, pre[i], shape.mode(i) * r[i + 1], r[i]);
    }
    // right[c] = H_c (r_c·s_c × r_{c+1}) · right[c+1] (r_{c+1} × Q_{c+1})
    let mut q = shape.mode(k - 1);
    for i in (p..k - 1).rev() {
        c.gemm(model, r[i] * shape.mode(i), q, r[i + 1]);
        q *= shape.mode(i);
    }
}

/// Backward through the chains: dH_c peeled off dL (left) and dR (right).
fn peel(shape: &TtShape, model: &CostModel, c: &mut Costing) {
    let (p, k) = (shape.p(), shape.n_cores());
    let r = shape.ranks();
    let pre = prefix(shape.in_modes());
    for i in (1..p).rev() {
        let w = shape.mode(i) * r[i + 1];
        c.gemm(model, r[i], w, pre[i]); // dH_c = left[c-1]ᵀ · dL_c
        c.gemm(model, pre[i], r[i], w); // dL_{c-1} = dL_c · H_cᵀ
    }
    let mut q: usize = shape.out_features();
    for i in p..k - 1 {
        q /= shape.mode(i);
        c.gemm(model, r[i] * shape.mode(i), r[i + 1], q); // dH_c = dR_c · right[c+1]ᵀ
        c.gemm(model, r[i + 1], q, r[i] * shape.mode(i)); // dR_{c+1} = H_cᵀ · dR_c
    }
}

/// Estimated cost of one path for a batch of `batch` rows.
pub fn tt_linear_cost(
    shape: &TtShape,
    batch: usize,
    path: TtPath,
    pass: Pass,
    model: &CostModel,
) -> PathCost {
    let (n, m) = (shape.in_features(), shape.out_features());
    let (p, k) = (shape.p(), shape.n_cores());
    let r = shape.ranks();
    let rp = shape.middle_rank();
    let b = batch;
    let mut c = Costing::default();
    // Gating the cores (H = G·diag(g)) is done on every path.
    c.stream(model, 2 * shape.core_params());
    let train = matches!(pass, Pass::Train { .. });
    let need_dx = matches!(pass, Pass::Train { need_dx: true });
    match path {
        TtPath::Merged => {
            chains(shape, model, &mut c);
            c.gemm(model, b, rp, n); // T1 = X·L
            c.gemm(model, b, m, rp); // Y = T1·R
            if train {
                chains(shape, model, &mut c); // rebuilt: only T1 is kept from the forward
                c.gemm(model, rp, m, b); // dR = T1ᵀ·dY
                c.gemm(model, b, rp, m); // U1 = dY·Rᵀ
                if need_dx {
                    c.gemm(model, b, n, rp); // dX = U1·Lᵀ
                }
                c.gemm(model, n, rp, b); // dL = Xᵀ·U1
                peel(shape, model, &mut c);
            }
        }
        TtPath::Dense => {
            chains(shape, model, &mut c);
            c.gemm(model, n, m, rp); // W = L·R
            c.gemm(model, b, m, n); // Y = X·W
            if train {
                chains(shape, model, &mut c); // chains and W rebuilt: nothing is kept
                c.gemm(model, n, m, rp);
                if need_dx {
                    c.gemm(model, b, n, m); // dX = dY·Wᵀ
                }
                c.gemm(model, n, m, b); // dW = Xᵀ·dY
                c.gemm(model, n, rp, m); // dL = dW·Rᵀ
                c.gemm(model, rp, m, n); // dR = Lᵀ·dW
                peel(shape, model, &mut c);
            }
        }
        TtPath::Sequential => {
            c.gather(model, b * n); // X digits reversed
            let in_core_params: usize = (0..p).map(|i| shape.core_len(i)).sum();
            c.gather(model, in_core_params); // H'_c = H_c with (r, s) swapped
                                             // Input side: S_{c+1} (rows_c × r_{c+1}) = S_c (rows_c × n_c·r_c) · H'_c.
            let mut rows = b * n;
            let mut in_rows = Vec::with_capacity(p);
            for i in 0..p {
                rows /= shape.mode(i);
                in_rows.push(rows);
                c.gemm(model, rows, r[i + 1], shape.mode(i) * r[i]);
            }
            // Output side: Z_{c+1} (rows × s_c·r_{c+1}) = Z_c (rows × r_c) · H_c.
            let mut out_rows = Vec::with_capacity(k - p);
            let mut rows = b;
            for i in p..k {
                out_rows.push(rows);
                c.gemm(model, rows, shape.mode(i) * r[i + 1], r[i]);
                rows *= shape.mode(i);
            }
            if train {
                c.gather(model, in_core_params); // H' again (scratch, not kept)
                for i in (p..k).rev() {
                    let rows = out_rows[i - p];
                    let w = shape.mode(i) * r[i + 1];
                    c.gemm(model, r[i], w, rows); // dH_c = Z_cᵀ · dZ_{c+1}
                    c.gemm(model, rows, r[i], w); // dZ_c = dZ_{c+1} · H_cᵀ
                }
                for i in (0..p).rev() {
                    let rows = in_rows[i];
                    let w = shape.mode(i) * r[i];
                    c.gemm(model, w, r[i + 1], rows); // dH'_c = S_cᵀ · dS_{c+1}
                    if i > 0 || need_dx {
                        c.gemm(model, rows, w, r[i + 1]); // dS_c = dS_{c+1} · H'_cᵀ
                    }
                }
                c.gather(model, in_core_params); // dH' back to dH
                if need_dx {
                    c.gather(model, b * n); // dS_0 digits back to dX
                }
            }
        }
    }
    // Bias add, and in training the bias gradient (a column sum of dY).
    c.stream(model, 2 * b * m);
    if train {
        c.stream(model, b * m);
        c.stream(model, 2 * shape.core_params()); // the cores gated again for the backward
        c.stream(model, 4 * shape.core_params()); // core and gate gradients from dH
    }
    PathCost {
        path,
        flops: c.flops,
        bytes: c.bytes,
        gemm_calls: c.gemm_calls,
        est_ms: c.seconds * 1e3,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_merged_for_large_batches_and_sequential_for_tiny_ones() {
        let s = TtShape::uniform(&[12, 8, 8], &[8, 8, 12], 30).unwrap();
        let model = CostModel::default();
        let big = ContractionPlan::for_tt_linear(&s, 4096, Pass::Train { need_dx: true }, &model);
        assert_eq!(big.path, TtPath::Merged);
        let tiny = ContractionPlan::for_tt_linear(&s, 1, Pass::Train { need_dx: true }, &model);
        assert_eq!(tiny.path, TtPath::Sequential);
        // Full rank relative to tiny modes: forming W is cheapest.
        let wide = TtShape::uniform(&[4, 4], &[4, 4], 16).unwrap();
        let d = ContractionPlan::for_tt_linear(&wide, 512, Pass::Train { need_dx: true }, &model);
        assert_eq!(d.path, TtPath::Dense);
    }

    #[test]
    fn flop_counts_match_the_formulas() {
        // Merged forward of a p = q = 1 layer: chains are empty, X·L and T1·R remain.
        let s = TtShape::uniform(&[6], &[5], 3).unwrap();
        let c = tt_linear_cost(&s, 4, TtPath::Merged, Pass::Forward, &CostModel::default());
        assert_eq!(c.flops, (2 * 4 * 3 * 6 + 2 * 4 * 5 * 3) as f64);
        assert_eq!(c.gemm_calls, 2);
    }

    #[test]
    fn plan_is_invalidated_by_rank_or_batch_changes() {
        let s = TtShape::uniform(&[4, 4], &[4, 4], 3).unwrap();
        let plan = ContractionPlan::for_tt_linear(&s, 8, Pass::Forward, &CostModel::default());
        assert!(plan.is_valid_for(&s, 8));
        assert!(!plan.is_valid_for(&s, 9));
        let s2 = TtShape::uniform(&[4, 4], &[4, 4], 2).unwrap();
        assert!(!plan.is_valid_for(&s2, 8));
    }
}
