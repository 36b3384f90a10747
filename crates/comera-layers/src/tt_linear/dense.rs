//! Dense path: W = L·R (N × M), Y = X·W. Backward: dX = dY·Wᵀ, dW = Xᵀ·dY, dL = dW·Rᵀ,
//! dR = Lᵀ·dW, then peel both chains. Wins only when ranks are high relative to the modes.

use super::chain::Chains;
use super::pool::Lease;
use comera_tensor::{matmul, MatMut, MatRef, TtShape};

/// Nothing is kept between calls: W, dW and the chains are scratch borrowed for each call,
/// and the backward rebuilds the chains and W.
#[derive(Debug)]
pub(crate) struct Dense {
    pub chains: Chains,
    w: Lease, // [W (N × M), dW (N × M)]
}

impl Dense {
    pub fn new(shape: &TtShape) -> Dense {
        let nm = shape.in_features() * shape.out_features();
        Dense {
            chains: Chains::new(shape),
            w: Lease::new(vec![nm, nm]),
        }
    }

    /// Bytes kept between calls.
    pub fn bytes(&self) -> usize {
        0
    }

    /// Bytes borrowed from the thread's pool during a backward call.
    pub fn scratch_bytes(&self) -> usize {
        self.chains.scratch_bytes() + self.w.bytes()
    }

    /// W = L·R into `w[0]` (chains acquired).
    fn build_w(&mut self, shape: &TtShape, h: &[Vec<f32>]) {
        let (n, m, rp) = (
            shape.in_features(),
            shape.out_features(),
            shape.middle_rank(),
        );
        self.chains.build(shape, h);
        matmul(
            MatMut::new(&mut self.w[0], n, m),
            MatRef::new(self.chains.l(), n, rp),
            MatRef::new(self.chains.r(), rp, m),
            false,
        );
    }

    pub fn forward(
        &mut self,
        shape: &TtShape,
        h: &[Vec<f32>],
        batch: usize,
        x: &[f32],
        y: &mut [f32],
    ) {
        let (n, m) = (shape.in_features(), shape.out_features());
        self.chains.acquire_forward();
        self.w.acquire();
        self.build_w(shape, h);
        matmul(
            MatMut::new(y, batch, m),
            MatRef::new(x, batch, n),
            MatRef::new(&self.w[0], n, m),
            false,
        );
        self.w.release();
        self.chains.release();
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
        self.chains.acquire_backward();
        self.w.acquire();
        self.build_w(shape, h);
        let (w, dw) = self.w.split_at_mut(1);
        let (w, dw) = (&w[0], &mut dw[0]);
        if let Some(dx) = dx {
            matmul(
                MatMut::new(dx, batch, n),
                dy,
                MatRef::new(w, n, m).t(),
                false,
            );
        }
        matmul(
            MatMut::new(dw, n, m),
            MatRef::new(x, batch, n).t(),
            dy,
            false,
        );
        let dw = MatRef::new(dw, n, m);
        let (l, r, dl, dr) = self.chains.seed_grads();
        matmul(MatMut::new(dl, n, rp), dw, MatRef::new(r, rp, m).t(), false);
        matmul(MatMut::new(dr, rp, m), MatRef::new(l, n, rp).t(), dw, false);
        self.chains.peel(shape, h, dh);
        self.w.release();
        self.chains.release();
    }
}
