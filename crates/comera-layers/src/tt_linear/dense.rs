//! Dense path: W = L·R (N × M), Y = X·W. Backward: dX = dY·Wᵀ, dW = Xᵀ·dY, dL = dW·Rᵀ,
//! dR = Lᵀ·dW, then peel both chains. Wins only when ranks are high relative to the modes.

use super::chain::{LeasedChains, LentChains};
use super::pool::{Lease, Scratch};
use comera_tensor::{matmul, MatMut, MatRef, TtShape};

/// Nothing is kept between calls: W, dW and the chains are scratch borrowed for each call,
/// and the backward rebuilds the chains and W.
#[derive(Debug)]
pub(crate) struct Dense {
    chains: LeasedChains,
    w: Lease, // [W (N × M), dW (N × M)]
}

impl Dense {
    pub fn new(shape: &TtShape) -> Dense {
        let nm = shape.in_features() * shape.out_features();
        Dense {
            chains: LeasedChains::new(shape),
            w: Lease::new(vec![nm, nm]),
        }
    }

    /// Bytes kept between calls.
    pub fn bytes(&self) -> usize {
        0
    }

    /// Bytes borrowed from the thread's pool during a backward call.
    pub fn scratch_bytes(&self) -> usize {
        self.chains.bytes() + self.w.bytes()
    }

    pub fn forward(
        &mut self,
        shape: &TtShape,
        h: &[Scratch],
        batch: usize,
        x: &[f32],
        y: &mut [f32],
    ) {
        let (n, m) = (shape.in_features(), shape.out_features());
        let mut built = self.chains.build(shape, h, false);
        let mut w = self.w.acquire();
        product_w(shape, &built.lent(), &mut w[0]);
        matmul(
            MatMut::new(y, batch, m),
            MatRef::new(x, batch, n),
            MatRef::new(&w[0], n, m),
            false,
        );
    }

    #[allow(clippy::too_many_arguments)] // the path's full data flow, spelled out
    pub fn backward(
        &mut self,
        shape: &TtShape,
        h: &[Scratch],
        dh: &mut [Scratch],
        batch: usize,
        x: &[f32],
        dy: &[f32],
        dx: Option<&mut [f32]>,
    ) {
        let (n, m, rp) = super::sizes(shape);
        let dy = MatRef::new(dy, batch, m);
        let mut built = self.chains.build(shape, h, true);
        let mut chains = built.lent();
        let mut lent_w = self.w.acquire();
        let [w, dw] = &mut lent_w[..] else {
            unreachable!("two buffers")
        };
        product_w(shape, &chains, w);
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
        let (l, r, dl, dr) = chains.seed_grads();
        matmul(MatMut::new(dl, n, rp), dw, MatRef::new(r, rp, m).t(), false);
        matmul(MatMut::new(dr, rp, m), MatRef::new(l, n, rp).t(), dw, false);
        chains.peel(shape, h, dh);
    }
}

/// W = L·R into `w`, from built chains.
fn product_w(shape: &TtShape, chains: &LentChains<'_>, w: &mut [f32]) {
    let (n, m, rp) = super::sizes(shape);
    matmul(
        MatMut::new(w, n, m),
        MatRef::new(chains.l(), n, rp),
        MatRef::new(chains.r(), rp, m),
        false,
    );
}
