//! Merged path: T1 = X·L (B × r_p), Y = T1·R. Batch cost 2·B·r_p·(N + M) per product.
//! Backward: dR = T1ᵀ·dY, U1 = dY·Rᵀ, dX = U1·Lᵀ, dL = Xᵀ·U1, then peel both chains.

use super::chain::Chains;
use super::pool::Lease;
use comera_tensor::{matmul, MatMut, MatRef, TtShape};

/// Saved between forward and backward: T1 only (B × r_p). The chains and U1 are scratch
/// borrowed for each call; the backward rebuilds the chains.
#[derive(Debug)]
pub(crate) struct Merged {
    pub chains: Chains,
    t1: Vec<f32>, // B × r_p
    u1: Lease,    // [B × r_p]
}

impl Merged {
    pub fn new(shape: &TtShape, batch: usize) -> Merged {
        let rp = shape.middle_rank();
        Merged {
            chains: Chains::new(shape),
            t1: vec![0.0; batch * rp],
            u1: Lease::new(vec![batch * rp]),
        }
    }

    /// Bytes kept between calls.
    pub fn bytes(&self) -> usize {
        4 * self.t1.len()
    }

    /// Bytes borrowed from the thread's pool during a backward call.
    pub fn scratch_bytes(&self) -> usize {
        self.chains.scratch_bytes() + self.u1.bytes()
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
        self.chains.acquire_forward();
        self.chains.build(shape, h);
        matmul(
            MatMut::new(&mut self.t1, batch, rp),
            MatRef::new(x, batch, n),
            MatRef::new(self.chains.l(), n, rp),
            false,
        );
        matmul(
            MatMut::new(y, batch, m),
            MatRef::new(&self.t1, batch, rp),
            MatRef::new(self.chains.r(), rp, m),
            false,
        );
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
        self.chains.build(shape, h);
        self.u1.acquire();
        let (l, r, dl, dr) = self.chains.seed_grads();
        let (l, r) = (MatRef::new(l, n, rp), MatRef::new(r, rp, m));
        matmul(
            MatMut::new(dr, rp, m),
            MatRef::new(&self.t1, batch, rp).t(),
            dy,
            false,
        );
        matmul(MatMut::new(&mut self.u1[0], batch, rp), dy, r.t(), false);
        let u1 = MatRef::new(&self.u1[0], batch, rp);
        if let Some(dx) = dx {
            matmul(MatMut::new(dx, batch, n), u1, l.t(), false);
        }
        matmul(
            MatMut::new(dl, n, rp),
            MatRef::new(x, batch, n).t(),
            u1,
            false,
        );
        self.chains.peel_left(shape, h, dh);
        self.chains.peel_right(shape, h, dh);
        self.u1.release();
        self.chains.release();
    }
}
