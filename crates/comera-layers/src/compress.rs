//! What the rank-adaptive training loop needs from a layer whose weights live in gated TT/TTM
//! cores ([`Compressible`]), and physical truncation of a gated chain ([`truncate_chain`]).
//!
//! Truncation removes, on every inner bond k, the rank slices whose gate entry is pruned
//! (d ≤ τ): slice j of bond k is column j of core k−1's last axis, row j of core k's first
//! axis and entry j of gate k. A pruned slice contributes exactly nothing to the chain's
//! product (its gated value is 0), so removing it leaves the layer's function unchanged. The
//! kept flat indices of every changed parameter are returned ([`Retained`]) so that the
//! optimiser can cut its moments the same way.
//!
//! A bond with no active entry makes the whole chain the zero tensor: the layer is *dead*. Its
//! chain keeps one (pruned) slice on such bonds so every shape stays valid, and the layer skips
//! its contraction (a dead `TtLinear` outputs its bias, a dead `TtmEmbedding` zeros).

use crate::{Param, RankGates};

/// The flat indices of a parameter that survived a truncation, and its new shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Retained {
    pub name: String,
    pub shape: Vec<usize>,
    /// Increasing indices into the parameter's old flat value.
    pub kept: Vec<usize>,
}

/// A layer made of gated TT/TTM cores.
pub trait Compressible {
    /// The layer's name (the prefix of its parameters' names).
    fn layer_name(&self) -> &str;
    /// Physical ranks `[1, r_1, …, r_{K-1}, 1]`.
    fn ranks(&self) -> Vec<usize>;
    /// Active gate entries per bond, `[1, a_1, …, a_{K-1}, 1]`.
    fn active_ranks(&self) -> Vec<usize>;
    /// S: the exact parameter count of the surviving cores (SPEC §6).
    fn size_l0(&self) -> f64;
    /// Ŝ: the ℓ1 surrogate of S.
    fn size_l1(&self) -> f64;
    /// Gate gradients += `scale · ∂Ŝ/∂d`.
    fn accumulate_size_l1_grad(&mut self, scale: f32);
    /// Parameters the same layer has when dense (N·M or V·D, without bias).
    fn dense_params(&self) -> usize;
    /// Whether a bond has no active entry left (the chain is the zero tensor).
    fn is_dead(&self) -> bool;
    /// Removes every pruned rank slice; returns the parameters that changed. The layer's
    /// function is unchanged; workspaces re-plan on their next use.
    fn truncate(&mut self) -> Vec<Retained>;
    /// Re-shapes the layer to `ranks` (`[1, …, 1]`), with zero cores and gates at 1: for
    /// loading a truncated layer whose values are then filled in by name.
    fn set_ranks(&mut self, ranks: &[usize]) -> Result<(), crate::LayerError>;
    /// Keeps at least `min_rank` active entries on every bond (see [`keep_min_rank`]).
    fn keep_min_rank(&mut self, min_rank: usize);
    /// Rescales every bond so its largest gate is 1 (see [`normalise_gates`]).
    fn normalise_gates(&mut self);
}

/// `impl Compressible` for a gated chain layer: a struct with fields `shape` (its layout),
/// `rule`, `cores`, `gates` and `dead`, and inherent `size_l0`, `size_l1` and
/// `accumulate_size_l1_grad`. What differs between layers is given as two closures:
/// `dense_params: |shape| …` (the dense layer's parameter count) and
/// `with_ranks: |shape, ranks| …` (the layout at new ranks, a `Result<_, ShapeError>`).
macro_rules! impl_compressible {
    ($layer:ty, dense_params: |$s:ident| $dense:expr, with_ranks: |$s2:ident, $r:ident| $reshaped:expr $(,)?) => {
        impl $crate::compress::Compressible for $layer {
            fn layer_name(&self) -> &str {
                $crate::compress::layer_name(&self.cores)
            }
            fn ranks(&self) -> Vec<usize> {
                self.shape.ranks().to_vec()
            }
            fn active_ranks(&self) -> Vec<usize> {
                $crate::compress::active_ranks(self.rule, &self.gates)
            }
            fn size_l0(&self) -> f64 {
                <$layer>::size_l0(self)
            }
            fn size_l1(&self) -> f64 {
                <$layer>::size_l1(self)
            }
            fn accumulate_size_l1_grad(&mut self, scale: f32) {
                <$layer>::accumulate_size_l1_grad(self, scale)
            }
            fn dense_params(&self) -> usize {
                let $s = &self.shape;
                $dense
            }
            fn is_dead(&self) -> bool {
                self.dead || self.active_ranks().contains(&0)
            }
            fn truncate(&mut self) -> Vec<$crate::compress::Retained> {
                let ($r, changed, dead) =
                    $crate::compress::truncate_chain(self.rule, &mut self.cores, &mut self.gates);
                let $r = &$r[..];
                let $s2 = &self.shape;
                self.shape = $reshaped.expect("truncated ranks are positive with unit ends");
                self.dead |= dead;
                changed
            }
            fn normalise_gates(&mut self) {
                $crate::compress::normalise_gates(self.rule, &mut self.cores, &mut self.gates)
            }
            fn keep_min_rank(&mut self, min_rank: usize) {
                $crate::compress::keep_min_rank(self.rule, &mut self.gates, min_rank)
            }
            fn set_ranks(&mut self, $r: &[usize]) -> Result<(), $crate::LayerError> {
                let $s2 = &self.shape;
                let shape = $reshaped?;
                let shapes = (0..shape.n_cores()).map(|c| shape.core_shape(c).to_vec());
                $crate::compress::reset_chain(&mut self.cores, &mut self.gates, $r, shapes);
                self.shape = shape;
                Ok(())
            }
        }
    };
}
pub(crate) use impl_compressible;

/// The name of the layer whose chain `cores` is: the prefix its cores are named by
/// (`{layer}.core.1`, `{layer}.core.2`, …), read off the first core.
pub(crate) fn layer_name(cores: &[Param]) -> &str {
    let first = &cores.first().expect("a chain has cores").name;
    first.strip_suffix(".core.1").unwrap_or(first)
}

/// Moves each bond's scale from its gates into the core on its left: with m the largest gate
/// of bond k, the active entries d_j → d_j/m and core k−1's slices G[…, j] → m·G[…, j], which
/// leaves every product G·diag(g) — the layer's function — unchanged. The size penalty then
/// cannot shrink a whole chain towards zero (which silences the layer long before any slice is
/// pruned); it can only make some slices small *relative to* the bond's strongest one.
/// Pruned entries are left as they are.
pub fn normalise_gates(rule: RankGates, cores: &mut [Param], gates: &mut [Param]) {
    for (b, g) in gates.iter_mut().enumerate() {
        let m = g.value.iter().fold(0.0f32, |m, &d| m.max(d));
        if !rule.is_active(m) || (m - 1.0).abs() < 1e-6 {
            continue;
        }
        let core = &mut cores[b];
        let r = g.len();
        for (j, d) in g.value.iter_mut().enumerate() {
            if rule.is_active(*d) {
                *d /= m;
                for row in core.value.chunks_exact_mut(r) {
                    row[j] *= m;
                }
            }
        }
    }
}

/// Projects gates onto "at least `min_rank` active entries per bond": on a bond with fewer,
/// the largest entries that fell to τ or below are set back to 2τ (or 1e-3 when τ = 0). A
/// rank-adaptive step cannot then kill a layer unless `min_rank` is 0.
pub fn keep_min_rank(rule: RankGates, gates: &mut [Param], min_rank: usize) {
    for g in gates {
        let k = min_rank.min(g.len());
        if rule.active(&g.value) >= k {
            continue;
        }
        // Rare (a bond about to die): sorting allocates, the steady state does not.
        let mut order: Vec<usize> = (0..g.len()).collect();
        order.sort_by(|&a, &b| g.value[b].total_cmp(&g.value[a]).then(a.cmp(&b)));
        let floor = if rule.threshold > 0.0 {
            2.0 * rule.threshold
        } else {
            1e-3
        };
        for &j in &order[..k] {
            if !rule.is_active(g.value[j]) {
                g.value[j] = floor;
            }
        }
    }
}

/// Zero cores of the given shapes and gates at 1 sized by `ranks`, keeping the names.
pub(crate) fn reset_chain(
    cores: &mut [Param],
    gates: &mut [Param],
    ranks: &[usize],
    core_shapes: impl Iterator<Item = Vec<usize>>,
) {
    for (c, shape) in cores.iter_mut().zip(core_shapes) {
        *c = Param::zeros(c.name.clone(), &shape, c.kind);
    }
    for (b, g) in gates.iter_mut().enumerate() {
        let r = ranks[b + 1];
        *g = Param::new(g.name.clone(), &[r], g.kind, vec![1.0; r]);
    }
}

/// Flat indices of `core` (shape `[r_in, mid…, r_out]`) kept when only rows `keep_in` of the
/// first axis and columns `keep_out` of the last axis survive.
fn kept_core_indices(shape: &[usize], keep_in: &[usize], keep_out: &[usize]) -> Vec<usize> {
    let r_out = *shape.last().expect("a core has axes");
    let mid: usize = shape[1..shape.len() - 1].iter().product();
    let mut kept = Vec::with_capacity(keep_in.len() * mid * keep_out.len());
    for &a in keep_in {
        for m in 0..mid {
            let base = (a * mid + m) * r_out;
            kept.extend(keep_out.iter().map(|&b| base + b));
        }
    }
    kept
}

/// Keeps `kept` entries of the parameter's value and gradient and sets its new shape.
pub fn retain_param(p: &mut Param, kept: &[usize], shape: Vec<usize>) {
    debug_assert_eq!(kept.len(), shape.iter().product::<usize>());
    p.value = kept.iter().map(|&i| p.value[i]).collect();
    p.grad = kept.iter().map(|&i| p.grad[i]).collect();
    p.shape = shape;
}

/// Truncates a gated chain in place: `cores[k]` has shape `[r_k, …, r_{k+1}]`, `gates[k]` is
/// bond k + 1 (length r_{k+1}). Returns the new ranks, the changed parameters, and whether the
/// chain is dead (some bond had no active entry; it keeps its first slice, still pruned).
pub fn truncate_chain(
    rule: RankGates,
    cores: &mut [Param],
    gates: &mut [Param],
) -> (Vec<usize>, Vec<Retained>, bool) {
    assert_eq!(cores.len(), gates.len() + 1, "K cores have K-1 gated bonds");
    let mut dead = false;
    // keep[k]: surviving indices of bond k (k = 0..=K); outer bonds keep their single index.
    let mut keep: Vec<Vec<usize>> = vec![vec![0]];
    for g in gates.iter() {
        let mut active: Vec<usize> = (0..g.len())
            .filter(|&j| rule.is_active(g.value[j]))
            .collect();
        if active.is_empty() {
            dead = true;
            active.push(0);
        }
        keep.push(active);
    }
    keep.push(vec![0]);
    let mut changed = Vec::new();
    for (k, core) in cores.iter_mut().enumerate() {
        let (r_in, r_out) = (core.shape[0], *core.shape.last().expect("a core has axes"));
        if keep[k].len() == r_in && keep[k + 1].len() == r_out {
            continue;
        }
        let kept = kept_core_indices(&core.shape, &keep[k], &keep[k + 1]);
        let mut shape = core.shape.clone();
        shape[0] = keep[k].len();
        *shape.last_mut().expect("a core has axes") = keep[k + 1].len();
        retain_param(core, &kept, shape.clone());
        changed.push(Retained {
            name: core.name.clone(),
            shape,
            kept,
        });
    }
    for (b, gate) in gates.iter_mut().enumerate() {
        let kept = &keep[b + 1];
        if kept.len() == gate.len() {
            continue;
        }
        let shape = vec![kept.len()];
        retain_param(gate, kept, shape.clone());
        changed.push(Retained {
            name: gate.name.clone(),
            shape,
            kept: kept.clone(),
        });
    }
    let ranks = keep.iter().map(Vec::len).collect();
    (ranks, changed, dead)
}

/// `[1, a_1, …, a_{K-1}, 1]`: active entries per bond.
pub fn active_ranks(rule: RankGates, gates: &[Param]) -> Vec<usize> {
    let mut a = vec![1];
    a.extend(gates.iter().map(|g| rule.active(&g.value)));
    a.push(1);
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ParamKind;

    #[test]
    fn kept_indices_of_a_core() {
        // shape (2, 3, 2): keep row 1 of the first axis and column 0 of the last.
        let k = kept_core_indices(&[2, 3, 2], &[1], &[0]);
        assert_eq!(k, vec![6, 8, 10]);
    }

    #[test]
    fn truncating_drops_pruned_slices_and_reports_them() {
        let rule = RankGates::new(0.01);
        let mut cores = vec![
            Param::new(
                "c.core.1",
                &[1, 2, 3],
                ParamKind::TtCore,
                (0..6).map(|v| v as f32).collect(),
            ),
            Param::new(
                "c.core.2",
                &[3, 2, 1],
                ParamKind::TtCore,
                (0..6).map(|v| v as f32).collect(),
            ),
        ];
        let mut gates = vec![Param::new(
            "c.gate.1",
            &[3],
            ParamKind::RankGate,
            vec![0.5, 0.005, 0.7],
        )];
        let (ranks, changed, dead) = truncate_chain(rule, &mut cores, &mut gates);
        assert_eq!(ranks, vec![1, 2, 1]);
        assert!(!dead);
        assert_eq!(cores[0].value, vec![0.0, 2.0, 3.0, 5.0]);
        assert_eq!(cores[1].value, vec![0.0, 1.0, 4.0, 5.0]);
        assert_eq!(gates[0].value, vec![0.5, 0.7]);
        assert_eq!(changed.len(), 3);
        // Nothing left to remove: a second truncation changes nothing.
        let (_, changed, _) = truncate_chain(rule, &mut cores, &mut gates);
        assert!(changed.is_empty());
    }

    #[test]
    fn min_rank_projection_revives_the_largest_entries_only_when_needed() {
        let rule = RankGates::new(0.01);
        let mut gates = vec![
            Param::new(
                "g.1",
                &[4],
                ParamKind::RankGate,
                vec![0.002, 0.009, -0.5, 0.0],
            ),
            Param::new("g.2", &[3], ParamKind::RankGate, vec![0.3, 0.001, 0.0]),
        ];
        keep_min_rank(rule, &mut gates, 2);
        assert_eq!(gates[0].value, vec![0.02, 0.02, -0.5, 0.0]);
        assert_eq!(gates[1].value, vec![0.3, 0.02, 0.0]);
        keep_min_rank(rule, &mut gates, 0);
        assert_eq!(gates[1].value, vec![0.3, 0.02, 0.0]);
    }

    #[test]
    fn normalising_gates_keeps_every_gated_product() {
        let rule = RankGates::new(0.01);
        let mut cores = vec![
            Param::new(
                "c.core.1",
                &[1, 2, 3],
                ParamKind::TtCore,
                vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            ),
            Param::new(
                "c.core.2",
                &[3, 1, 1],
                ParamKind::TtCore,
                vec![1.0, 1.0, 1.0],
            ),
        ];
        let mut gates = vec![Param::new(
            "c.gate.1",
            &[3],
            ParamKind::RankGate,
            vec![0.5, 0.005, 0.25],
        )];
        let gated = |c: &[Param], g: &[Param]| -> Vec<f32> {
            c[0].value
                .iter()
                .enumerate()
                .map(|(i, v)| v * rule.value(g[0].value[i % 3]))
                .collect()
        };
        let before = gated(&cores, &gates);
        normalise_gates(rule, &mut cores, &mut gates);
        assert_eq!(gates[0].value, vec![1.0, 0.005, 0.5]);
        assert_eq!(gated(&cores, &gates), before);
    }

    #[test]
    fn a_bond_without_active_entries_kills_the_chain() {
        let rule = RankGates::new(0.01);
        let mut cores = vec![
            Param::zeros("c.core.1", &[1, 2, 2], ParamKind::TtCore),
            Param::zeros("c.core.2", &[2, 2, 1], ParamKind::TtCore),
        ];
        let mut gates = vec![Param::new(
            "c.gate.1",
            &[2],
            ParamKind::RankGate,
            vec![0.0, -1.0],
        )];
        let (ranks, _, dead) = truncate_chain(rule, &mut cores, &mut gates);
        assert!(dead);
        assert_eq!(ranks, vec![1, 1, 1]);
        assert!(!rule.is_active(gates[0].value[0]));
    }
}
