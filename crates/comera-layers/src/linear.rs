//! The dense linear layer `Y = X·W + b`, W of shape (N, M): the baseline every TT layer is
//! compared against.

use crate::{accumulate_bias_grad, add_bias, check_len, Layer, Param, ParamKind};
use comera_tensor::{init, matmul, MatMut, MatRef};

/// Dense `Y = X·W + b`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub weight: Param, // (N, M)
    pub bias: Param,   // (M)
}

/// The dense layer needs nothing besides the caller's `x`: its workspace only pins the batch.
#[derive(Debug)]
pub struct LinearWorkspace {
    batch: usize,
}

impl Linear {
    /// W ~ N(0, 1/(N+M)) (the variance the TT initialisation reproduces), b = 0.
    pub fn new(name: &str, n: usize, m: usize, rng: &mut init::Rng) -> Linear {
        let mut w = vec![0.0; n * m];
        init::fill_normal(rng, &mut w, (1.0 / (n + m) as f32).sqrt());
        Linear {
            weight: Param::new(format!("{name}.weight"), &[n, m], ParamKind::Other, w),
            bias: Param::zeros(format!("{name}.bias"), &[m], ParamKind::Other),
        }
    }
}

impl Layer for Linear {
    type Workspace = LinearWorkspace;

    fn in_features(&self) -> usize {
        self.weight.shape[0]
    }
    fn out_features(&self) -> usize {
        self.weight.shape[1]
    }

    fn workspace(&self, batch: usize) -> LinearWorkspace {
        LinearWorkspace { batch }
    }

    fn forward(&self, ws: &mut LinearWorkspace, x: &[f32], y: &mut [f32]) {
        let (b, n, m) = (ws.batch, self.in_features(), self.out_features());
        check_len("Linear x", x.len(), b * n);
        check_len("Linear y", y.len(), b * m);
        matmul(
            MatMut::new(y, b, m),
            MatRef::new(x, b, n),
            MatRef::new(&self.weight.value, n, m),
            false,
        );
        add_bias(y, &self.bias.value);
    }

    fn backward(
        &mut self,
        ws: &mut LinearWorkspace,
        x: &[f32],
        dy: &[f32],
        dx: Option<&mut [f32]>,
    ) {
        let (b, n, m) = (ws.batch, self.in_features(), self.out_features());
        check_len("Linear dy", dy.len(), b * m);
        let w = MatRef::new(&self.weight.value, n, m);
        if let Some(dx) = dx {
            check_len("Linear dx", dx.len(), b * n);
            matmul(MatMut::new(dx, b, n), MatRef::new(dy, b, m), w.t(), false); // dX = dY·Wᵀ
        }
        let xt = MatRef::new(x, b, n).t();
        matmul(
            MatMut::new(&mut self.weight.grad, n, m),
            xt,
            MatRef::new(dy, b, m),
            true,
        ); // dW += Xᵀ·dY
        accumulate_bias_grad(dy, &mut self.bias.grad);
    }

    fn params(&self) -> Vec<&Param> {
        vec![&self.weight, &self.bias]
    }
    fn params_mut(&mut self) -> Vec<&mut Param> {
        vec![&mut self.weight, &mut self.bias]
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.weight);
        f(&mut self.bias);
    }
}
