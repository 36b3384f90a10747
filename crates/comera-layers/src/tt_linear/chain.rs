//! The two core chains of a TT layer, shared by the merged and dense paths.
//!
//! Left chain (input side, cores 0..p-1):
//!   left[0] = H_0 (n_0 × r_1);  left[c] = left[c-1] (P_c × r_c) · H_c (r_c × n_c·r_{c+1}),
//! so left[c] is (n_0⋯n_c) × r_{c+1} and L = left[p-1] is N × r_p.
//! Right chain (output side, cores p..K-1), built from the right:
//!   right[K-1] = H_{K-1} (r_{K-1} × m_q);  right[c] = H_c (r_c·s_c × r_{c+1}) · right[c+1],
//! so right[c] is r_c × (s_c⋯s_{K-1}) and R = right[p] is r_p × M.
//! Backward peels dH_c off dL and dR through the saved chain entries:
//!   dH_c = left[c-1]ᵀ·dL_c,  dL_{c-1} = dL_c·H_cᵀ   (dL_c viewed as P_c × n_c·r_{c+1})
//!   dH_c = dR_c·right[c+1]ᵀ, dR_{c+1} = H_cᵀ·dR_c   (dR_c viewed as r_c·s_c × Q_{c+1})
//! The two chains (and the two peels) are independent: they run as two rayon tasks. Their
//! products are small (at most N·r² multiply-adds), too small to thread one by one, but the
//! chains are lopsided: for the paper's 768 → 3,072 layer the right chain's last product
//! (480 × 30 · 30 × 192, 2.8 M multiply-adds) is 3.6× the whole left chain, so with one task
//! a chain the second core idled for most of it. So each product is also cut into row pieces
//! of about `PIECE_MACS` multiply-adds (`product`), and a peel's two products per core run as
//! two tasks: the work a layer call forks is then a dozen pieces of similar size, which two or
//! more cores share evenly. Every piece is single-threaded and the cut
//! depends on the shapes alone, so the bits do not depend on the thread count.

use super::pool::{Lease, Lent, Scratch};
use comera_tensor::{matmul_row_pieces, MatMut, MatRef, TtShape};

/// Multiply-adds of one row piece of a chain product (see the module doc): large enough that
/// a piece outweighs the fork that hands it to another core (a few µs with the step's pool
/// awake), small enough that a 2.8 M product makes four.
const PIECE_MACS: usize = 1 << 19;

/// Most pieces one chain product is cut into.
const MAX_PIECES: usize = 4;

/// C = A·B into the first A.rows × B.cols elements of `c` (row-major), its rows cut into
/// pieces of about [`PIECE_MACS`] multiply-adds (at most [`MAX_PIECES`], fixed by the shapes)
/// that run as rayon tasks, each single-threaded (`matmul_row_pieces`).
fn product(c: &mut [f32], a: MatRef<'_>, b: MatRef<'_>) {
    let (m, n) = (a.rows(), b.cols());
    let pieces = (m * a.cols() * n)
        .div_ceil(PIECE_MACS)
        .clamp(1, MAX_PIECES.min(m.max(1)));
    matmul_row_pieces(
        MatMut::new(&mut c[..m * n], m, n),
        a,
        b,
        false,
        m.div_ceil(pieces),
    );
}

/// Two products that read the same operands, as two tasks when together they make more than
/// one piece (a peel's dH_c and the next gradient).
fn both(macs: usize, first: impl FnOnce() + Send, second: impl FnOnce() + Send) {
    if macs > PIECE_MACS {
        comera_tensor::join(first, second);
    } else {
        first();
        second();
    }
}

/// The chain layout of one layer: the lengths of its chain products and of their gradient
/// scratch (ping-pong pairs), which its owner lends from the thread's scratch pool for a call
/// (a lease of [`Chains::product_lens`], and for a backward one of [`Chains::grad_lens`]), and
/// how to read them ([`Chains::lent`]). Nothing here outlives a layer call: the backward
/// rebuilds the chains from the cores (the same GEMMs, so the same bits as in the forward).
#[derive(Debug)]
pub(crate) struct Chains {
    pre: Vec<usize>, // P_c = n_0⋯n_{c-1}, c = 0..=p
    /// left[c] (P_{c+1} × r_{c+1}) for c < p, then right[c - p] (r_c × Q_c) for c ≥ p.
    products: Vec<usize>,
    /// [dL, dL scratch, dR, dR scratch]: dL (N × r_p) goes into the first (see `seed_grads`)
    /// before `peel`, dR (r_p × M) into the third.
    grads: Vec<usize>,
}

/// One layer's [`Chains`] with the two leases its products and their gradient scratch are lent
/// from: what the merged and dense paths hold (the shared-input block leases several layers'
/// chains at once instead).
#[derive(Debug)]
pub(crate) struct LeasedChains {
    chains: Chains,
    products: Lease,
    grads: Lease,
}

impl LeasedChains {
    pub fn new(shape: &TtShape) -> LeasedChains {
        let chains = Chains::new(shape);
        LeasedChains {
            products: Lease::new(chains.product_lens().to_vec()),
            grads: Lease::new(chains.grad_lens().to_vec()),
            chains,
        }
    }

    /// Bytes borrowed from the thread's pool during a backward call.
    pub fn bytes(&self) -> usize {
        self.products.bytes() + self.grads.bytes()
    }

    /// The layout (see [`Chains::build_macs`]).
    pub fn layout(&self) -> &Chains {
        &self.chains
    }

    /// Borrows the chain products from the thread's pool (and, for a backward, `grads`, their
    /// gradient scratch: products first) and builds the chains from the gated cores `h`.
    pub fn build(&mut self, shape: &TtShape, h: &[Scratch], grads: bool) -> BuiltChains<'_> {
        let mut built = self.lend(grads);
        built.lent().build(shape, h);
        built
    }

    /// The same buffers, not built yet: for a path that builds each chain beside its own
    /// products ([`LentChains::sides`]).
    pub fn lend(&mut self, grads: bool) -> BuiltChains<'_> {
        BuiltChains {
            chains: &self.chains,
            products: self.products.acquire(),
            grads: grads.then(|| self.grads.acquire()),
        }
    }
}

/// Built chains in buffers lent by [`LeasedChains::build`], handed back to the pool when
/// dropped (the gradient scratch first).
pub(crate) struct BuiltChains<'a> {
    chains: &'a Chains,
    grads: Option<Lent<'a>>,
    products: Lent<'a>,
}

impl BuiltChains<'_> {
    /// The chains (see [`Chains::lent`]; without gradient scratch in a forward).
    pub fn lent(&mut self) -> LentChains<'_> {
        let grads: &mut [Scratch] = match &mut self.grads {
            Some(g) => g,
            None => &mut [],
        };
        self.chains.lent(&mut self.products, grads)
    }
}

/// One layer's chains in lent buffers (see [`Chains::lent`]).
pub(crate) struct LentChains<'a> {
    pre: &'a [usize],
    left: &'a mut [Scratch],
    right: &'a mut [Scratch],
    dl: &'a mut [Scratch],
    dr: &'a mut [Scratch],
}

/// P_c = n_0⋯n_{c-1} for c = 0..=p.
pub(crate) fn in_prefix(shape: &TtShape) -> impl Iterator<Item = usize> + '_ {
    std::iter::once(1).chain(shape.in_modes().iter().scan(1, |acc, &n| {
        *acc *= n;
        Some(*acc)
    }))
}

fn q_of(shape: &TtShape, c: usize) -> usize {
    (c..shape.n_cores()).map(|i| shape.mode(i)).product()
}

impl Chains {
    pub fn new(shape: &TtShape) -> Chains {
        let (p, k, r) = (shape.p(), shape.n_cores(), shape.ranks());
        let pre: Vec<usize> = in_prefix(shape).collect();
        let left = (0..p).map(|c| pre[c + 1] * r[c + 1]);
        let right = (p..k).map(|c| r[c] * q_of(shape, c));
        let lmax = left.clone().max().unwrap_or(0);
        let rmax = right.clone().max().unwrap_or(0);
        Chains {
            products: left.chain(right).collect(),
            grads: vec![lmax, lmax, rmax, rmax],
            pre,
        }
    }

    /// Multiply-adds of building the left and the right chain (each chain's peel does twice
    /// its build's), for a path that places its own products beside them.
    pub fn build_macs(&self, shape: &TtShape) -> (usize, usize) {
        let (p, k, r) = (shape.p(), shape.n_cores(), shape.ranks());
        let left = (1..p)
            .map(|c| self.pre[c] * r[c] * shape.mode(c) * r[c + 1])
            .sum();
        let right = (p..k - 1)
            .map(|c| r[c] * shape.mode(c) * r[c + 1] * q_of(shape, c + 1))
            .sum();
        (left, right)
    }

    /// How many of the chain products are the left chain's (p; the right chain's follow, R
    /// first).
    pub fn left_len(&self) -> usize {
        self.pre.len() - 1
    }

    /// Lengths of the chain products (for `build`).
    pub fn product_lens(&self) -> &[usize] {
        &self.products
    }

    /// Lengths of the gradient scratch (for `seed_grads` and `peel`).
    pub fn grad_lens(&self) -> &[usize] {
        &self.grads
    }

    /// The chains in lent buffers: `products` as long as [`Chains::product_lens`] and `grads`
    /// as [`Chains::grad_lens`] (in a forward, which has no gradients, empty).
    pub fn lent<'a>(
        &'a self,
        products: &'a mut [Scratch],
        grads: &'a mut [Scratch],
    ) -> LentChains<'a> {
        let (left, right) = products.split_at_mut(self.left_len());
        let (dl, dr) = grads.split_at_mut(grads.len() / 2);
        LentChains {
            pre: &self.pre,
            left,
            right,
            dl,
            dr,
        }
    }
}

impl LentChains<'_> {
    /// L (N × r_p).
    pub fn l(&self) -> &[f32] {
        self.left.last().expect("p ≥ 1")
    }

    /// R (r_p × M).
    pub fn r(&self) -> &[f32] {
        &self.right[0]
    }

    /// (L, R, dL, dR) for the path's backward to fill dL (N × r_p) and dR (r_p × M) from.
    pub fn seed_grads(&mut self) -> (&[f32], &[f32], &mut [f32], &mut [f32]) {
        let l = self.left.last().expect("p ≥ 1");
        let (nl, nr) = (l.len(), self.right[0].len());
        (
            l,
            &self.right[0],
            &mut self.dl[0][..nl],
            &mut self.dr[0][..nr],
        )
    }

    /// The two chains apart, for a path that runs each chain's build and peel in a task of its
    /// own beside its own products (the merged path's small-batch backward).
    pub fn sides(&mut self) -> (LeftChain<'_>, RightChain<'_>) {
        (
            LeftChain {
                pre: self.pre,
                products: &mut *self.left,
                grads: &mut *self.dl,
            },
            RightChain {
                products: &mut *self.right,
                grads: &mut *self.dr,
            },
        )
    }

    /// Builds every chain entry from the gated cores `h` (left and right chains side by side).
    pub fn build(&mut self, shape: &TtShape, h: &[Scratch]) {
        let (pre, left, right) = (self.pre, &mut *self.left, &mut *self.right);
        let (h_in, h_out) = h.split_at(shape.p());
        comera_tensor::join(
            || build_left(shape, h_in, pre, left),
            || build_right(shape, h_out, right),
        );
    }

    /// From dL in `dl[0]` and dR in `dr[0]`, writes dH_c for every core (the two peels side
    /// by side).
    pub fn peel(&mut self, shape: &TtShape, h: &[Scratch], dh: &mut [Scratch]) {
        let (dh_in, dh_out) = dh.split_at_mut(shape.p());
        let (pre, left, right) = (self.pre, &*self.left, &*self.right);
        let (dl, dr) = (&mut *self.dl, &mut *self.dr);
        let (h_in, h_out) = h.split_at(shape.p());
        comera_tensor::join(
            || peel_left(shape, h_in, pre, left, dl, dh_in),
            || peel_right(shape, h_out, right, dr, dh_out),
        );
    }
}

/// The left chain of [`LentChains::sides`] before it is built: its products and its gradient
/// scratch.
pub(crate) struct LeftChain<'a> {
    pre: &'a [usize],
    products: &'a mut [Scratch],
    grads: &'a mut [Scratch],
}

/// The left chain once built: L can be read (for as long as the buffers are lent) while the
/// chain is peeled.
pub(crate) struct BuiltLeft<'a> {
    pre: &'a [usize],
    products: &'a [Scratch],
    grads: &'a mut [Scratch],
}

impl<'a> LeftChain<'a> {
    /// Builds the chain from the gated input cores `h_in` (H_0..H_{p-1}).
    pub fn build(self, shape: &TtShape, h_in: &[Scratch]) -> BuiltLeft<'a> {
        build_left(shape, h_in, self.pre, self.products);
        BuiltLeft {
            pre: self.pre,
            products: self.products,
            grads: self.grads,
        }
    }
}

impl<'a> BuiltLeft<'a> {
    /// L (N × r_p).
    pub fn l(&self) -> &'a [f32] {
        self.products.last().expect("p ≥ 1")
    }

    /// Where the path writes dL (N × r_p) before `peel`.
    pub fn dl(&mut self) -> &mut [f32] {
        let n = self.l().len();
        &mut self.grads[0][..n]
    }

    /// From dL (in `dl`), writes dH_c for the input cores c = 0..p-1 (`dh_in`).
    pub fn peel(self, shape: &TtShape, h_in: &[Scratch], dh_in: &mut [Scratch]) {
        peel_left(shape, h_in, self.pre, self.products, self.grads, dh_in);
    }
}

/// The right chain of [`LentChains::sides`] before it is built.
pub(crate) struct RightChain<'a> {
    products: &'a mut [Scratch],
    grads: &'a mut [Scratch],
}

/// The right chain once built: R can be read while the chain is peeled.
pub(crate) struct BuiltRight<'a> {
    products: &'a [Scratch],
    grads: &'a mut [Scratch],
}

impl<'a> RightChain<'a> {
    /// Builds the chain from the gated output cores `h_out` (H_p..H_{K-1}).
    pub fn build(self, shape: &TtShape, h_out: &[Scratch]) -> BuiltRight<'a> {
        build_right(shape, h_out, self.products);
        BuiltRight {
            products: self.products,
            grads: self.grads,
        }
    }
}

impl<'a> BuiltRight<'a> {
    /// R (r_p × M).
    pub fn r(&self) -> &'a [f32] {
        &self.products[0]
    }

    /// Where the path writes dR (r_p × M) before `peel`.
    pub fn dr(&mut self) -> &mut [f32] {
        let n = self.r().len();
        &mut self.grads[0][..n]
    }

    /// From dR (in `dr`), writes dH_c for the output cores c = p..K-1 (`dh_out[c - p]`).
    pub fn peel(self, shape: &TtShape, h_out: &[Scratch], dh_out: &mut [Scratch]) {
        peel_right(shape, h_out, self.products, self.grads, dh_out);
    }
}

/// left[0] = H_0;  left[c] = left[c-1] · H_c  (`h`: the input cores' H_0..H_{p-1}).
fn build_left(shape: &TtShape, h: &[Scratch], pre: &[usize], left: &mut [Scratch]) {
    let (p, r) = (shape.p(), shape.ranks());
    left[0].copy_from_slice(&h[0]);
    for c in 1..p {
        let (done, rest) = left.split_at_mut(c);
        let w = shape.mode(c) * r[c + 1];
        product(
            &mut rest[0],
            MatRef::new(&done[c - 1], pre[c], r[c]),
            MatRef::new(&h[c], r[c], w),
        );
    }
}

/// right[K-1] = H_{K-1};  right[c] = H_c · right[c+1]  (`right` and `h`, the output cores'
/// H_p..H_{K-1}, at index c - p).
fn build_right(shape: &TtShape, h: &[Scratch], right: &mut [Scratch]) {
    let (p, k, r) = (shape.p(), shape.n_cores(), shape.ranks());
    right[k - 1 - p].copy_from_slice(&h[k - 1 - p]);
    for c in (p..k - 1).rev() {
        let (head, tail) = right.split_at_mut(c + 1 - p);
        let qn = q_of(shape, c + 1);
        product(
            &mut head[c - p],
            MatRef::new(&h[c - p], r[c] * shape.mode(c), r[c + 1]),
            MatRef::new(&tail[0], r[c + 1], qn),
        );
    }
}

/// From dL in `dl[0]`, writes dH_c for the input cores c = 0..p-1 (`dh_in`; `h`: their H).
fn peel_left(
    shape: &TtShape,
    h: &[Scratch],
    pre: &[usize],
    left: &[Scratch],
    dl: &mut [Scratch],
    dh_in: &mut [Scratch],
) {
    let (p, r) = (shape.p(), shape.ranks());
    let (a, b) = dl.split_at_mut(1);
    let (mut cur, mut next) = (&mut a[0], &mut b[0]);
    for c in (1..p).rev() {
        let w = shape.mode(c) * r[c + 1];
        let dlc = MatRef::new(&cur[..pre[c] * w], pre[c], w);
        let (dhc, next_dl) = (&mut dh_in[c], &mut **next);
        both(
            2 * pre[c] * r[c] * w,
            || product(dhc, MatRef::new(&left[c - 1], pre[c], r[c]).t(), dlc),
            || product(next_dl, dlc, MatRef::new(&h[c], r[c], w).t()),
        );
        std::mem::swap(&mut cur, &mut next);
    }
    let n0 = dh_in[0].len();
    dh_in[0].copy_from_slice(&cur[..n0]);
}

/// From dR in `dr[0]`, writes dH_c for the output cores c = p..K-1 (`dh_out[c - p]`; `h`, the
/// output cores' H, at index c - p too).
fn peel_right(
    shape: &TtShape,
    h: &[Scratch],
    right: &[Scratch],
    dr: &mut [Scratch],
    dh_out: &mut [Scratch],
) {
    let (p, k, r) = (shape.p(), shape.n_cores(), shape.ranks());
    let (a, b) = dr.split_at_mut(1);
    let (mut cur, mut next) = (&mut a[0], &mut b[0]);
    for c in p..k - 1 {
        let rows = r[c] * shape.mode(c);
        let qn = q_of(shape, c + 1);
        let drc = MatRef::new(&cur[..rows * qn], rows, qn);
        let right_next = MatRef::new(&right[c + 1 - p], r[c + 1], qn);
        let (dhc, next_dr) = (&mut dh_out[c - p], &mut **next);
        both(
            2 * rows * r[c + 1] * qn,
            || product(dhc, drc, right_next.t()),
            || product(next_dr, MatRef::new(&h[c - p], rows, r[c + 1]).t(), drc),
        );
        std::mem::swap(&mut cur, &mut next);
    }
    let nl = dh_out[k - 1 - p].len();
    dh_out[k - 1 - p].copy_from_slice(&cur[..nl]);
}
