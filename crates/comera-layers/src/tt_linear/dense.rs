//! Dense path: W = L·R (N × M), Y = X·W. Backward: dX = dY·Wᵀ, dW = Xᵀ·dY, dL = dW·Rᵀ,
//! dR = Lᵀ·dW, then peel both chains. Wins only when ranks are high relative to the modes.

use super::chain::Chains;
use comera_tensor::{matmul, MatMut, MatRef, TtShape};

#[derive(Debug)]
pub(crate) struct Dense {
    pub chains: Chains,
    w: Vec<f32>,  // N × M
    dw: Vec<f32>, // N × M
}

impl Dense {
    pub fn new(shape: &TtShape) -> Dense {
        let nm = shape.in_features() * shape.out_features();
        Dense {
            chains: Chains::new(shape),
            w: vec![0.0; nm],
            dw: vec![0.0; nm],
        }
    }

    pub fn bytes(&self) -> usize {
        self.chains.bytes() + 4 * (self.w.len() + self.dw.len())
    }

    pub fn forward(
        &mut self,
        shape: &TtShape,
        h: &[Vec<f32>],
        batch: usize,
        x: &[f32],
        y: &mut [f32],
    ) {
        let (n, m, rp) = (
            shape.in_features(),
            shape.out_features(),
            shape.middle_rank(),
        );
        self.chains.build(shape, h);
        matmul(
            MatMut::new(&mut self.w, n, m),
            MatRef::new(self.chains.l(), n, rp),
            MatRef::new(self.chains.r(), rp, m),
            false,
        );
        matmul(
            MatMut::new(y, batch, m),
            MatRef::new(x, batch, n),
            MatRef::new(&self.w, n, m),
            false,
        );
    }

    #[allow(clippy::too_many_arguments)] // the path's full data flow, spelled out
    pub fn backward(
        &mut self,
        shape: &TtShape,
        h: &[Vec<f32>],
        dh: &mut [Vec<f32>],
        batch: usize,
        x: &[f32],
        dy: &[f32],
        dx: Option<&mut [f32]>,
    ) {
        let (n, m, rp) = (
            shape.in_features(),
            shape.out_features(),
            shape.middle_rank(),
        );
        let dy = MatRef::new(dy, batch, m);
        if let Some(dx) = dx {
            matmul(
                MatMut::new(dx, batch, n),
                dy,
                MatRef::new(&self.w, n, m).t(),
                false,
            );
        }
        matmul(
            MatMut::new(&mut self.dw, n, m),
            MatRef::new(x, batch, n).t(),
            dy,
            false,
        );
        let dw = MatRef::new(&self.dw, n, m);
        let (l, r, dl, dr) = self.chains.seed_grads();
        matmul(MatMut::new(dl, n, rp), dw, MatRef::new(r, rp, m).t(), false);
        matmul(MatMut::new(dr, rp, m), MatRef::new(l, n, rp).t(), dw, false);
        self.chains.peel_left(shape, h, dh);
        self.chains.peel_right(shape, h, dh);
    }
}
