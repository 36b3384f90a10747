//! Dense path: W = L·R (N × M), Y = X·W. Backward: dX = dY·Wᵀ, dW = Xᵀ·dY, dL = dW·Rᵀ,
//! dR = Lᵀ·dW, then peel both chains. Wins only when ranks are high relative to the modes.

use super::chain::{Chains, LentChains};
use super::pool::{Lease, Scratch};
use comera_tensor::{matmul, MatMut, MatRef, TtShape};

/// Nothing is kept between calls: W, dW and the chains are scratch borrowed for each call,
/// and the backward rebuilds the chains and W.
#[derive(Debug)]
pub(crate) struct Dense {
    chains: Chains,
    products: Lease, // the chain products
    grads: Lease,    // their gradient scratch
    w: Lease,        // [W (N × M), dW (N × M)]
}

impl Dense {
    pub fn new(shape: &TtShape) -> Dense {
        let nm = shape.in_features() * shape.out_features();
        let chains = Chains::new(shape);
        Dense {
            products: Lease::new(chains.product_lens().to_vec()),
            grads: Lease::new(chains.grad_lens().to_vec()),
            chains,
            w: Lease::new(vec![nm, nm]),
        }
    }

    /// Bytes kept between calls.
    pub fn bytes(&self) -> usize {
        0
    }

    /// Bytes borrowed from the thread's pool during a backward call.
    pub fn scratch_bytes(&self) -> usize {
        self.products.bytes() + self.grads.bytes() + self.w.bytes()
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
        let mut products = self.products.acquire();
        let mut chains = self.chains.lent(&mut products, &mut []);
        let mut w = self.w.acquire();
        build_w(shape, h, &mut chains, &mut w[0]);
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
        let (mut products, mut grads) = (self.products.acquire(), self.grads.acquire());
        let mut chains = self.chains.lent(&mut products, &mut grads);
        let mut lent_w = self.w.acquire();
        let [w, dw] = &mut lent_w[..] else {
            unreachable!("two buffers")
        };
        build_w(shape, h, &mut chains, w);
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

/// Builds the chains from the gated cores `h`, then W = L·R into `w`.
fn build_w(shape: &TtShape, h: &[Scratch], chains: &mut LentChains<'_>, w: &mut [f32]) {
    let (n, m, rp) = super::sizes(shape);
    chains.build(shape, h);
    matmul(
        MatMut::new(w, n, m),
        MatRef::new(chains.l(), n, rp),
        MatRef::new(chains.r(), rp, m),
        false,
    );
}
