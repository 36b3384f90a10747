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

    fn bond_measures(&self, gates: &[&[f32]], l1: bool) -> Vec<f64> {
        let mut a = Vec::with_capacity(gates.len() + 2);
        a.push(1.0);
        for g in gates {
            a.push(if l1 {
                g.iter().map(|&d| self.value(d) as f64).sum()
            } else {
                self.active(g) as f64
            });
        }
        a.push(1.0);
        a
    }

    fn size(&self, modes: &[usize], gates: &[&[f32]], l1: bool) -> f64 {
        assert_eq!(
            gates.len() + 1,
            modes.len(),
            "a chain of K cores has K-1 gated bonds"
        );
        let a = self.bond_measures(gates, l1);
        modes
            .iter()
            .enumerate()
            .map(|(k, &s)| s as f64 * a[k] * a[k + 1])
            .sum()
    }

    /// S: the exact parameter count of the surviving cores.
    pub fn size_l0(&self, modes: &[usize], gates: &[&[f32]]) -> f64 {
        self.size(modes, gates, false)
    }

    /// Ŝ: the ℓ1 surrogate of S.
    pub fn size_l1(&self, modes: &[usize], gates: &[&[f32]]) -> f64 {
        self.size(modes, gates, true)
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
        assert_eq!(
            gates.len() + 1,
            modes.len(),
            "a chain of K cores has K-1 gated bonds"
        );
        assert_eq!(grads.len(), gates.len());
        let a = self.bond_measures(gates, true);
        for (b, (gate, grad)) in gates.iter().zip(grads.iter_mut()).enumerate() {
            // Bond b+1 (1-based) sits between cores b and b+1 (0-based).
            let k = b + 1;
            let da = modes[k - 1] as f64 * a[k - 1] + modes[k] as f64 * a[k + 1];
            for (g, &d) in grad.iter_mut().zip(gate.iter()) {
                if self.is_active(d) {
                    *g += scale * da as f32;
                }
            }
        }
    }
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
        let v: Vec<&[f32]> = gates.iter().map(|g| g.value.as_slice()).collect();
        self.size_l0(modes, &v)
    }

    /// Ŝ over gate parameters.
    pub fn params_size_l1(&self, modes: &[usize], gates: &[crate::Param]) -> f64 {
        let v: Vec<&[f32]> = gates.iter().map(|g| g.value.as_slice()).collect();
        self.size_l1(modes, &v)
    }

    /// Accumulates `scale · ∂Ŝ/∂d` into the gate parameters' gradients.
    pub fn params_size_l1_grad(&self, modes: &[usize], gates: &mut [crate::Param], scale: f32) {
        let values: Vec<Vec<f32>> = gates.iter().map(|g| g.value.clone()).collect();
        let refs: Vec<&[f32]> = values.iter().map(Vec::as_slice).collect();
        let mut grads: Vec<&mut [f32]> = gates.iter_mut().map(|g| g.grad.as_mut_slice()).collect();
        self.size_l1_grad(modes, &refs, scale, &mut grads);
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
