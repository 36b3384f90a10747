//! Rank gates: the diagonal factors D_k = diag(g(d_k)) on a TT chain's inner bonds, and the
//! model-size measures built from them (SPEC §3, §6).
//!
//! A gate entry d counts only above the threshold τ: g(d) = d if d > τ, else 0, and it
//! receives gradient only there. A chain of K cores with mode sizes s_1..s_K (s_k = v_k·e_k for
//! TTM cores) and gates on bonds 1..K-1 has size
//!   S = Σ_k s_k · a_{k-1} · a_k,   a_0 = a_K = 1,
//! with a_k = #{entries of bond k above τ} (exact surviving parameter count, "ℓ0") or
//! a_k = Σ g(d) over bond k (the smooth surrogate Ŝ, "ℓ1").

/// Threshold semantics of rank gates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankGates {
    pub threshold: f32,
}

impl Default for RankGates {
    /// τ = 0.01, as in the authors' code.
    fn default() -> Self {
        RankGates { threshold: 0.01 }
    }
}

impl RankGates {
    pub fn new(threshold: f32) -> RankGates {
        RankGates { threshold }
    }

    /// Whether a gate entry is alive (d > τ).
    #[inline]
    pub fn is_active(&self, d: f32) -> bool {
        d > self.threshold
    }

    /// The thresholded gate value g(d).
    #[inline]
    pub fn value(&self, d: f32) -> f32 {
        if self.is_active(d) {
            d
        } else {
            0.0
        }
    }

    /// Number of active entries of one bond.
    pub fn active(&self, gate: &[f32]) -> usize {
        gate.iter().filter(|&&d| self.is_active(d)).count()
    }

    /// a_k of one bond: its active entries (ℓ0) or the sum of their values (ℓ1).
    fn measure(&self, gate: &[f32], l1: bool) -> f64 {
        if l1 {
            gate.iter().map(|&d| self.value(d) as f64).sum()
        } else {
            self.active(gate) as f64
        }
    }

    /// S (or Ŝ) of a chain of the K-1 `gates` of its inner bonds, core k of mode size
    /// `mode(k)`, in one pass over the bonds. Nothing here allocates: the rank objective
    /// evaluates it for every layer in every step.
    fn size<'g>(
        &self,
        mode: impl Fn(usize) -> usize,
        gates: impl ExactSizeIterator<Item = &'g [f32]>,
        l1: bool,
    ) -> f64 {
        // a_1 … a_{K-1}, then a_K = 1; a_0 = 1 starts `prev`.
        let cores = gates.len() + 1;
        let mut next = gates.map(|g| self.measure(g, l1)).chain([1.0]);
        let mut prev = 1.0;
        let mut size = 0.0;
        for k in 0..cores {
            let a = next.next().expect("K measures after a_0");
            size += mode(k) as f64 * prev * a;
            prev = a;
        }
        size
    }

    /// ∂Ŝ/∂d for the active entries of bond b (0-based; between cores b and b+1), from its
    /// neighbours' gates (`None` at the chain's ends, where a = 1): s_b·a_b + s_{b+1}·a_{b+2}
    /// in the 1-based a of the module doc.
    fn bond_size_l1_grad(
        &self,
        mode: &impl Fn(usize) -> usize,
        b: usize,
        before: Option<&[f32]>,
        after: Option<&[f32]>,
    ) -> f64 {
        let a = |g: Option<&[f32]>| g.map_or(1.0, |g| self.measure(g, true));
        mode(b) as f64 * a(before) + mode(b + 1) as f64 * a(after)
    }

    /// `grad[j] += v` for the active entries j of `gate`.
    fn add_to_active(&self, gate: &[f32], grad: &mut [f32], v: f32) {
        for (g, &d) in grad.iter_mut().zip(gate) {
            if self.is_active(d) {
                *g += v;
            }
        }
    }

    /// S: the exact parameter count of the surviving cores.
    pub fn size_l0(&self, modes: &[usize], gates: &[&[f32]]) -> f64 {
        check_bonds(modes, gates.len());
        self.size(|k| modes[k], gates.iter().copied(), false)
    }

    /// Ŝ: the ℓ1 surrogate of S.
    pub fn size_l1(&self, modes: &[usize], gates: &[&[f32]]) -> f64 {
        check_bonds(modes, gates.len());
        self.size(|k| modes[k], gates.iter().copied(), true)
    }

    /// Accumulates `scale · ∂Ŝ/∂d` into `grads` (one slice per bond):
    /// ∂Ŝ/∂d_{k,j} = s_k·a_{k-1} + s_{k+1}·a_{k+1} for active entries, 0 otherwise.
    pub fn size_l1_grad(
        &self,
        modes: &[usize],
        gates: &[&[f32]],
        scale: f32,
        grads: &mut [&mut [f32]],
    ) {
        check_bonds(modes, gates.len());
        assert_eq!(grads.len(), gates.len());
        let mode = |k: usize| modes[k];
        for (b, (gate, grad)) in gates.iter().zip(grads.iter_mut()).enumerate() {
            let (before, after) = (
                b.checked_sub(1).map(|i| gates[i]),
                gates.get(b + 1).copied(),
            );
            let da = self.bond_size_l1_grad(&mode, b, before, after);
            self.add_to_active(gate, grad, scale * da as f32);
        }
    }
}

/// Panics unless a chain of `modes.len()` cores has `bonds` gated bonds (K − 1).
fn check_bonds(modes: &[usize], bonds: usize) {
    assert_eq!(
        bonds + 1,
        modes.len(),
        "a chain of K cores has K-1 gated bonds"
    );
}

/// Gating a core and taking gradients through the gate. A core's last axis is the gated bond
/// (r_k entries); the other axes may be in any order as long as `core`, `grad` and `dh` agree.
impl RankGates {
    /// `h[.., j] = core[.., j] · g(gate[j])`.
    pub fn gate_core(&self, core: &[f32], gate: &[f32], h: &mut [f32]) {
        let r = gate.len();
        let rows = h.chunks_exact_mut(r).zip(core.chunks_exact(r));
        if gate.iter().all(|&d| self.is_active(d)) {
            // Every entry alive: g(d) = d, a plain column scaling that vectorises.
            for (hrow, crow) in rows {
                for ((hv, &cv), &d) in hrow.iter_mut().zip(crow).zip(gate) {
                    *hv = cv * d;
                }
            }
            return;
        }
        for (hrow, crow) in rows {
            for ((hv, &cv), &d) in hrow.iter_mut().zip(crow).zip(gate) {
                *hv = cv * self.value(d);
            }
        }
    }

    /// A chain core's gradients from dH, the gradient of its gated core: through its gate
    /// (`accumulate_gated_grads`), or for the last core of a chain, which has none, dG += dH.
    pub fn accumulate_chain_core(
        &self,
        core: &mut crate::Param,
        gate: Option<&mut crate::Param>,
        dh: &[f32],
    ) {
        match gate {
            Some(gate) => self.accumulate_gated_grads(
                &core.value,
                &mut core.grad,
                &gate.value,
                &mut gate.grad,
                dh,
            ),
            None => core.grad.iter_mut().zip(dh).for_each(|(g, d)| *g += d),
        }
    }

    /// Given dH for H = G·diag(g(d)): `grad[.., j] += dh[.., j]·d_j` and
    /// `gate_grad[j] += Σ dh[.., j]·core[.., j]`, for active entries j only.
    pub fn accumulate_gated_grads(
        &self,
        core: &[f32],
        grad: &mut [f32],
        gate: &[f32],
        gate_grad: &mut [f32],
        dh: &[f32],
    ) {
        let r = gate.len();
        let rows = grad
            .chunks_exact_mut(r)
            .zip(core.chunks_exact(r))
            .zip(dh.chunks_exact(r));
        if gate.iter().all(|&d| self.is_active(d)) {
            // Every entry alive (always before the first pruning): the same sums in the same
            // order without the per-entry test, so the loops vectorise.
            for ((grow, crow), drow) in rows {
                for (((gv, gg), &dv), (&cv, &d)) in grow
                    .iter_mut()
                    .zip(gate_grad.iter_mut())
                    .zip(drow)
                    .zip(crow.iter().zip(gate))
                {
                    *gv += dv * d;
                    *gg += dv * cv;
                }
            }
            return;
        }
        for ((grow, crow), drow) in rows {
            for j in 0..r {
                let d = gate[j];
                if self.is_active(d) {
                    grow[j] += drow[j] * d;
                    gate_grad[j] += drow[j] * crow[j];
                }
            }
        }
    }
}

impl RankGates {
    /// The gate parameters of a chain with these ranks `[1, r_1, …, r_{K-1}, 1]`, all at 1
    /// (`{name}.gate.{b}` for bond b = 1..K-1).
    pub fn initial_params(name: &str, ranks: &[usize]) -> Vec<crate::Param> {
        (1..ranks.len().saturating_sub(1))
            .map(|b| {
                crate::Param::new(
                    format!("{name}.gate.{b}"),
                    &[ranks[b]],
                    crate::ParamKind::RankGate,
                    vec![1.0; ranks[b]],
                )
            })
            .collect()
    }
}

/// Size measures of a layer's gate parameters (one `Param` per bond); `modes[k]` = s_k.
impl RankGates {
    /// S over gate parameters.
    pub fn params_size_l0(&self, modes: &[usize], gates: &[crate::Param]) -> f64 {
        check_bonds(modes, gates.len());
        self.params_size(|k| modes[k], gates, false)
    }

    /// Ŝ over gate parameters.
    pub fn params_size_l1(&self, modes: &[usize], gates: &[crate::Param]) -> f64 {
        check_bonds(modes, gates.len());
        self.params_size(|k| modes[k], gates, true)
    }

    /// S (`l1` false) or Ŝ over gate parameters, core k of mode size `mode(k)`.
    pub(crate) fn params_size(
        &self,
        mode: impl Fn(usize) -> usize,
        gates: &[crate::Param],
        l1: bool,
    ) -> f64 {
        self.size(mode, gates.iter().map(|g| g.value.as_slice()), l1)
    }

    /// Accumulates `scale · ∂Ŝ/∂d` into the gate parameters' gradients.
    pub fn params_size_l1_grad(&self, modes: &[usize], gates: &mut [crate::Param], scale: f32) {
        check_bonds(modes, gates.len());
        self.params_size_l1_grad_by(|k| modes[k], gates, scale);
    }

    /// The same, core k of mode size `mode(k)`.
    pub(crate) fn params_size_l1_grad_by(
        &self,
        mode: impl Fn(usize) -> usize,
        gates: &mut [crate::Param],
        scale: f32,
    ) {
        for b in 0..gates.len() {
            let value = |i: usize| gates.get(i).map(|g| g.value.as_slice());
            let (before, after) = (b.checked_sub(1).and_then(value), value(b + 1));
            let da = self.bond_size_l1_grad(&mode, b, before, after);
            let g = &mut gates[b];
            self.add_to_active(&g.value, &mut g.grad, scale * da as f32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_is_strict() {
        let g = RankGates::new(0.01);
        assert_eq!(g.value(0.01), 0.0);
        assert_eq!(g.value(-0.5), 0.0);
        assert_eq!(g.value(0.02), 0.02);
    }

    #[test]
    fn sizes_of_a_small_chain() {
        let g = RankGates::new(0.01);
        let (g1, g2) = ([1.0, 0.5, 0.0], [0.2, 0.005]);
        let gates: [&[f32]; 2] = [&g1, &g2];
        // a = [1, 2, 1, 1] (ℓ0), [1, 1.5, 0.2, 1] (ℓ1); modes 4, 3, 5.
        assert_eq!(g.size_l0(&[4, 3, 5], &gates), (4 * 2 + 3 * 2 + 5) as f64);
        let l1 = g.size_l1(&[4, 3, 5], &gates);
        assert!((l1 - (4.0 * 1.5 + 3.0 * 1.5 * 0.2 + 5.0 * 0.2)).abs() < 1e-6);
        let mut d1 = [0.0; 3];
        let mut d2 = [0.0; 2];
        g.size_l1_grad(&[4, 3, 5], &gates, 1.0, &mut [&mut d1, &mut d2]);
        assert!((d1[0] - (4.0 + 3.0 * 0.2)).abs() < 1e-6 && d1[2] == 0.0);
        assert!((d2[0] - (3.0 * 1.5 + 5.0)).abs() < 1e-6 && d2[1] == 0.0);
    }

    #[test]
    fn gated_cores_and_gradients_skip_dead_entries_and_match_the_entrywise_definition() {
        let g = RankGates::new(0.01);
        let (rows, r) = (7, 5);
        let val = |i: usize, a: f32| ((i as f32 + a) * 0.731).sin();
        let core: Vec<f32> = (0..rows * r).map(|i| val(i, 0.3)).collect();
        let dh: Vec<f32> = (0..rows * r).map(|i| val(i, 1.7)).collect();
        for gate in [[0.9, 1.1, 0.4, 2.0, 0.7], [0.9, 0.005, 0.4, -1.0, 0.7]] {
            let (mut grad, mut gate_grad) = (vec![0.25f32; rows * r], vec![0.5f32; r]);
            g.accumulate_gated_grads(&core, &mut grad, &gate, &mut gate_grad, &dh);
            // The definition, entry by entry in row order.
            let (mut want, mut want_gate) = (vec![0.25f32; rows * r], vec![0.5f32; r]);
            for i in 0..rows {
                for j in (0..r).filter(|&j| gate[j] > 0.01) {
                    want[i * r + j] += dh[i * r + j] * gate[j];
                    want_gate[j] += dh[i * r + j] * core[i * r + j];
                }
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&grad), bits(&want), "gates {gate:?}");
            assert_eq!(bits(&gate_grad), bits(&want_gate), "gates {gate:?}");
            // And the gated core itself: H[.., j] = G[.., j]·g(d_j), dead columns zero.
            let mut h = vec![f32::NAN; rows * r];
            g.gate_core(&core, &gate, &mut h);
            let want_h: Vec<f32> = (0..rows * r)
                .map(|i| core[i] * g.value(gate[i % r]))
                .collect();
            assert_eq!(bits(&h), bits(&want_h), "gates {gate:?}");
        }
    }
}
