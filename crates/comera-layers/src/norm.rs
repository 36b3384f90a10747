//! LayerNorm over the last dimension.
//!
//! For each row x (length D) of a `(rows, D)` buffer:
//!   μ = (1/D) Σ_i x_i,   σ² = (1/D) Σ_i (x_i − μ)²   (biased variance, as BERT / PyTorch),
//!   r = 1/√(σ² + ε),     n_i = (x_i − μ)·r,           y_i = γ_i·n_i + β_i.
//! Forward saves μ and r per row. Backward, with g_i = γ_i·dy_i (the gradient w.r.t. n):
//!   dβ_i += Σ_rows dy_i,   dγ_i += Σ_rows dy_i·n_i,
//!   dx_i  = r·(g_i − mean_j(g_j) − n_i·mean_j(g_j·n_j)).
//! Parameter gradients are summed in row order, so results do not depend on anything but the
//! inputs.

use crate::{check_len, Layer, Param, ParamKind};

/// BERT's LayerNorm epsilon.
pub const BERT_LAYER_NORM_EPS: f32 = 1e-12;

/// `y = γ ⊙ (x − μ)/√(σ² + ε) + β` over the last dimension.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    pub gamma: Param, // (D)
    pub beta: Param,  // (D)
    pub eps: f32,
}

/// Saved statistics for a fixed number of rows (batch · sequence length).
#[derive(Debug)]
pub struct LayerNormWorkspace {
    rows: usize,
    mean: Vec<f32>, // (rows)
    rstd: Vec<f32>, // (rows)
}

impl LayerNormWorkspace {
    /// μ per row, as saved by the last forward.
    pub fn mean(&self) -> &[f32] {
        &self.mean
    }

    /// 1/√(σ² + ε) per row, as saved by the last forward.
    pub fn rstd(&self) -> &[f32] {
        &self.rstd
    }
}

impl LayerNorm {
    /// γ = 1, β = 0, ε = 1e-12 (BERT).
    pub fn new(name: &str, dim: usize) -> LayerNorm {
        LayerNorm::with_eps(name, dim, BERT_LAYER_NORM_EPS)
    }

    /// γ = 1, β = 0, any ε ≥ 0.
    pub fn with_eps(name: &str, dim: usize, eps: f32) -> LayerNorm {
        assert!(
            eps.is_finite() && eps >= 0.0,
            "LayerNorm eps must be finite and non-negative, got {eps}"
        );
        LayerNorm {
            gamma: Param::new(
                format!("{name}.gamma"),
                &[dim],
                ParamKind::Other,
                vec![1.0; dim],
            ),
            beta: Param::zeros(format!("{name}.beta"), &[dim], ParamKind::Other),
            eps,
        }
    }

    pub fn dim(&self) -> usize {
        self.gamma.value.len()
    }
}

impl Layer for LayerNorm {
    type Workspace = LayerNormWorkspace;

    fn in_features(&self) -> usize {
        self.dim()
    }
    fn out_features(&self) -> usize {
        self.dim()
    }

    /// `batch` is the number of rows normalised per step (e.g. B·T).
    fn workspace(&self, batch: usize) -> LayerNormWorkspace {
        LayerNormWorkspace {
            rows: batch,
            mean: vec![0.0; batch],
            rstd: vec![0.0; batch],
        }
    }

    fn forward(&self, ws: &mut LayerNormWorkspace, x: &[f32], y: &mut [f32]) {
        let (rows, d) = (ws.rows, self.dim());
        check_len("LayerNorm x", x.len(), rows * d);
        check_len("LayerNorm y", y.len(), rows * d);
        let (gamma, beta) = (&self.gamma.value, &self.beta.value);
        for r in 0..rows {
            let xr = &x[r * d..(r + 1) * d]; // (D)
            let yr = &mut y[r * d..(r + 1) * d]; // (D)
                                                 // Two passes (mean, then centred variance) for accuracy when |μ| ≫ σ.
            let mean = xr.iter().sum::<f32>() / d as f32;
            let var = xr.iter().map(|&v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
            let rstd = 1.0 / (var + self.eps).sqrt();
            for i in 0..d {
                let n = (xr[i] - mean) * rstd;
                yr[i] = gamma[i] * n + beta[i];
            }
            ws.mean[r] = mean;
            ws.rstd[r] = rstd;
        }
    }

    fn backward(
        &mut self,
        ws: &mut LayerNormWorkspace,
        x: &[f32],
        dy: &[f32],
        dx: Option<&mut [f32]>,
    ) {
        let (rows, d) = (ws.rows, self.dim());
        check_len("LayerNorm x", x.len(), rows * d);
        check_len("LayerNorm dy", dy.len(), rows * d);
        let mut dx = dx;
        if let Some(dx) = dx.as_deref() {
            check_len("LayerNorm dx", dx.len(), rows * d);
        }
        let gamma = &self.gamma.value;
        for r in 0..rows {
            let (mean, rstd) = (ws.mean[r], ws.rstd[r]);
            let xr = &x[r * d..(r + 1) * d]; // (D)
            let dyr = &dy[r * d..(r + 1) * d]; // (D)
                                               // Parameter gradients: dγ_i += dy_i·n_i, dβ_i += dy_i.
                                               // Row reductions for dx: mean(g), mean(g·n) with g = γ ⊙ dy.
            let (mut sum_g, mut sum_gn) = (0.0f32, 0.0f32);
            for i in 0..d {
                let n = (xr[i] - mean) * rstd;
                let g = gamma[i] * dyr[i];
                self.gamma.grad[i] += dyr[i] * n;
                self.beta.grad[i] += dyr[i];
                sum_g += g;
                sum_gn += g * n;
            }
            if let Some(dx) = dx.as_deref_mut() {
                let (mean_g, mean_gn) = (sum_g / d as f32, sum_gn / d as f32);
                let dxr = &mut dx[r * d..(r + 1) * d]; // (D)
                for i in 0..d {
                    let n = (xr[i] - mean) * rstd;
                    dxr[i] = rstd * (gamma[i] * dyr[i] - mean_g - n * mean_gn);
                }
            }
        }
    }

    fn params(&self) -> Vec<&Param> {
        vec![&self.gamma, &self.beta]
    }
    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.gamma, &mut self.beta]
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.gamma);
        f(&mut self.beta);
    }
}
