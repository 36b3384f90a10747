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
}
