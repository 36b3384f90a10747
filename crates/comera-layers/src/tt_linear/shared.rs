//! TT layers that read one input X (attention's q, k and v), on the merged path together:
//!   T1 = X·[L_1 | … | L_n]                (B × S, S = Σ r_p,i: one product instead of n)
//!   Y_i = T1_i·R_i + b_i                  (T1_i: T1's columns of layer i)
//! into one output Y = [Y_1 | … | Y_n], the layers' B × M_i outputs one after the other (the
//! layout the attention reads Q, K and V in). Backward from dY = [dY_1 | … | dY_n] likewise:
//!   dR_i = T1_iᵀ·dY_i,   U_i = dY_i·R_iᵀ   (U = [U_1 | … | U_n], B × S)
//!   dX = U·[L_1 | … | L_n]ᵀ                (one product; the sum over layers is its inner sum)
//!   [dL_1 | … | dL_n] = Xᵀ·U               (one product)
//! then each layer peels its chains as on its own. The result is each layer's own merged-path
//! result up to float rounding (the same sums, grouped in larger products).
//!
//! Everything a layer does on its own runs with the other layers' side by side (halves of the
//! layers as rayon tasks, each layer on its own buffers): gating and chain builds, the
//! forward's Y_i + b_i, the backward's (dR_i, U_i, db_i) and the peels. A forward is then
//! four parallel sections (the layers' chains, Lcat, T1, the outputs), a backward five (chains,
//! Lcat, the output sides, dX ∥ dLcat, the peels), whatever the layer count. At
//! small batches (see `merged::paired`) the products run single-threaded, as two tasks where
//! they pair up: (dR_i ∥ U_i) and (dX ∥ dL).
//!
//! It applies while every layer plans the merged path at this batch (the planner still decides
//! per layer; see [`SharedInput::applies`]) and none is dead, and is chosen only up to
//! [`MAX_ROWS`] rows, where it was measured not to lose; otherwise callers run the layers one
//! by one.

use super::chain::Chains;
use super::merged::{forward_out, input_side, paired};
use super::pool::{Lease, Scratch};
use super::TtLinear;
use crate::{accumulate_bias_grad, add_bias, check_len, Layer};
use comera_plan::TtPath;
use comera_tensor::{matmul, matmul_serial, DisjointMut, MatMut, MatRef, TtShape};
use rayon::prelude::*;
use std::ops::Range;

/// Rows above which the fusion is not used (the layers run one by one): measured with
/// `comera bench step --ops` on the paper's q/k/v (2 threads), fused vs one by one: a tie at
/// 128 rows, the fused backward 1.2× slower at 1,024 rows and the fused step 1.15-1.4× slower
/// at 4,096 rows (its products read and write strided column blocks of T1, U and dY).
pub const MAX_ROWS: usize = 128;

/// The fused workspace of n layers sharing an input, for one batch size.
#[derive(Debug)]
pub struct SharedInput {
    batch: usize,
    n_in: usize,
    /// Each layer's shape when planned (a rank change invalidates the fusion).
    shapes: Vec<TtShape>,
    /// Column offset of each layer in T1/U (prefix sums of r_p) and in Y (of M).
    rcol: Vec<usize>,
    mcol: Vec<usize>,
    t1: Vec<f32>, // B × S, saved for the backward
    /// Per layer: its chain layout and its places in the leases below.
    members: Vec<Member>,
    // Every layer's scratch, layer after layer in one lease of each kind (one guard a kind
    // holds all n layers' buffers at once, without a list of guards to allocate).
    h: Lease,        // H_c (gated cores)
    dh: Lease,       // dH_c
    products: Lease, // chain products
    grads: Lease,    // their gradient scratch
    /// [Lcat (N × S), U (B × S), dLcat (N × S)], scratch.
    cat: Lease,
}

impl SharedInput {
    /// The fused workspace for `layers` at `batch` rows, or `None` when the fusion does not
    /// apply (a layer planned off the merged path, a dead layer, or different input widths)
    /// or does not pay (more than [`MAX_ROWS`] rows).
    pub fn new(layers: &[&TtLinear], batch: usize) -> Option<SharedInput> {
        if batch > MAX_ROWS {
            return None;
        }
        if layers
            .iter()
            .any(|l| l.workspace(batch).path() != TtPath::Merged)
        {
            return None;
        }
        SharedInput::new_unplanned(layers, batch)
    }

    /// The same without asking the planner (every layer on the merged path whatever it would
    /// choose): for tests on shapes too small for the merged path to win.
    pub fn new_unplanned(layers: &[&TtLinear], batch: usize) -> Option<SharedInput> {
        let n_in = layers.first()?.in_features();
        if layers.len() > MAX_MEMBERS || layers.iter().any(|l| l.dead || l.in_features() != n_in) {
            return None;
        }
        let prefix = |v: Vec<usize>| {
            let mut acc = 0;
            let mut out = vec![0];
            for x in v {
                acc += x;
                out.push(acc);
            }
            out
        };
        let rcol = prefix(layers.iter().map(|l| l.shape.middle_rank()).collect());
        let mcol = prefix(layers.iter().map(|l| l.out_features()).collect());
        let s = *rcol.last().expect("n ≥ 1");
        let (mut core_lens, mut product_lens, mut grad_lens) = (vec![], vec![], vec![]);
        let members = layers
            .iter()
            .map(|l| {
                let chains = Chains::new(&l.shape);
                let append = |lens: &mut Vec<usize>, more: &[usize]| {
                    lens.extend_from_slice(more);
                    lens.len() - more.len()..lens.len()
                };
                Member {
                    cores: append(&mut core_lens, &super::core_lens(&l.shape)),
                    products: append(&mut product_lens, chains.product_lens()),
                    grads: append(&mut grad_lens, chains.grad_lens()),
                    chains,
                }
            })
            .collect();
        Some(SharedInput {
            batch,
            n_in,
            shapes: layers.iter().map(|l| l.shape.clone()).collect(),
            rcol,
            mcol,
            t1: vec![0.0; batch * s],
            members,
            h: Lease::new(core_lens.clone()),
            dh: Lease::new(core_lens),
            products: Lease::new(product_lens),
            grads: Lease::new(grad_lens),
            cat: Lease::new(vec![n_in * s, batch * s, n_in * s]),
        })
    }

    /// Whether this workspace still fits `layers` (same ranks and none dead since it was made).
    pub fn applies(&self, layers: &[&TtLinear]) -> bool {
        layers.len() == self.shapes.len()
            && layers
                .iter()
                .zip(&self.shapes)
                .all(|(l, s)| !l.dead && l.shape == *s)
    }

    /// Whether the products run as two tasks (every layer small enough at this batch).
    fn paired(&self) -> bool {
        self.shapes.iter().all(|s| paired(s, self.batch))
    }

    /// Bytes kept between calls (T1).
    pub fn bytes(&self) -> usize {
        4 * self.t1.len()
    }

    /// Σ M_i: the output holds B × this many floats.
    pub fn out_width(&self) -> usize {
        *self.mcol.last().expect("n ≥ 1")
    }

    /// Counted FLOPs of one forward and one backward: each layer's merged path (the fused
    /// products do the same multiply-adds, grouped).
    pub fn flops(&self) -> (f64, f64) {
        self.shapes
            .iter()
            .map(|s| super::ffn::merged_flops(s, self.batch))
            .fold((0.0, 0.0), |(f, b), (x, y)| (f + x, b + y))
    }

    /// `y` = [X·W_1 + b_1 | … | X·W_n + b_n] (B × M_i each, one after the other) for `x`
    /// (B × N).
    pub fn forward(&mut self, layers: &[&TtLinear], x: &[f32], y: &mut [f32]) {
        assert!(
            self.applies(layers),
            "SharedInput: layers changed since planned"
        );
        let (b, n, s, w) = (
            self.batch,
            self.n_in,
            *self.rcol.last().expect("n ≥ 1"),
            self.out_width(),
        );
        check_len("SharedInput x", x.len(), b * n);
        check_len("SharedInput y", y.len(), b * w);
        let pair = self.paired();
        let (mut cat, mut h) = (self.cat.acquire(), self.h.acquire());
        let mut products = self.products.acquire();
        build_all(
            &self.members,
            &self.rcol,
            layers,
            &mut h,
            &mut products,
            &mut cat[0],
        );
        matmul(
            MatMut::new(&mut self.t1, b, s),
            MatRef::new(x, b, n),
            MatRef::new(&cat[0], n, s),
            false,
        );
        // Y_i = T1_i·R_i + b_i, the layers side by side (each in row pieces at small batches).
        let mut ys = per_member(y, b, &self.mcol);
        let (members, rcol, t1) = (&self.members, &self.rcol, &self.t1);
        let products = &products;
        comera_tensor::for_each(ys[..layers.len()].par_iter_mut().enumerate(), |(i, yi)| {
            let yi = &mut **yi;
            let (r0, rp, m) = (rcol[i], rcol[i + 1] - rcol[i], yi.len() / b);
            forward_out(
                pair,
                MatMut::new(yi, b, m),
                MatRef::strided(&t1[r0..], b, rp, s, 1),
                MatRef::new(members[i].r(products), rp, m),
            );
            add_bias(yi, &layers[i].bias.value);
        });
    }

    /// Accumulates every layer's gradients from `dy` = [dY_1 | … | dY_n] (B × M_i each, one
    /// after the other) and *writes* `dx` (B × N) = Σ_i dY_i·W_iᵀ.
    pub fn backward(
        &mut self,
        layers: &mut [&mut TtLinear],
        x: &[f32],
        dy: &[f32],
        dx: &mut [f32],
    ) {
        let (b, n, s, w) = (
            self.batch,
            self.n_in,
            *self.rcol.last().expect("n ≥ 1"),
            self.out_width(),
        );
        check_len("SharedInput x", x.len(), b * n);
        check_len("SharedInput dy", dy.len(), b * w);
        check_len("SharedInput dx", dx.len(), b * n);
        let k = layers.len();
        assert!(
            k == self.shapes.len()
                && layers
                    .iter()
                    .zip(&self.shapes)
                    .all(|(l, sh)| !l.dead && l.shape == *sh),
            "SharedInput backward: layers changed since forward"
        );
        // Gates, chains and Lcat, as in the forward.
        let pair = self.paired();
        let (mut cat, mut h, mut dh) = (self.cat.acquire(), self.h.acquire(), self.dh.acquire());
        let (mut products, mut grads) = (self.products.acquire(), self.grads.acquire());
        let readonly: [&TtLinear; MAX_MEMBERS] = std::array::from_fn(|i| &*layers[i.min(k - 1)]);
        let (members, rcol) = (&self.members, &self.rcol);
        build_all(
            members,
            rcol,
            &readonly[..k],
            &mut h,
            &mut products,
            &mut cat[0],
        );
        let [lcat, u, dlcat] = &mut cat[..] else {
            unreachable!("three buffers")
        };
        // dR_i = T1_iᵀ·dY_i, U_i = dY_i·R_iᵀ and db_i += Σ_rows dY_i, the layers side by side.
        let out = OutputSide {
            t1: (&self.t1, s),
            dy,
            u: DisjointMut::new(u),
            rcol,
            mcol: &self.mcol,
            pair,
        };
        let own = Own {
            h: &mut [],
            dh: &mut [],
            products: &mut products,
            grads: &mut grads,
        };
        each_member(members, 0, layers, own, &|i, member, l, own| {
            let mut chains = member.chains.lent(own.products, own.grads);
            let (_, r, _, dr) = chains.seed_grads();
            out.member(i, r, dr, &mut l.bias.grad);
        });
        let um = MatRef::new(u, b, s);
        // dX = U·Lcatᵀ,  dLcat = Xᵀ·U (as on the merged path).
        input_side(pair, x, b, um, MatRef::new(lcat, n, s), Some(dx), dlcat);
        // Every layer takes its dL out of dLcat, peels its chains and accumulates its cores'
        // gradients, halves of the layers as rayon tasks.
        let own = Own {
            h: &mut h,
            dh: &mut dh,
            products: &mut products,
            grads: &mut grads,
        };
        each_member(members, 0, layers, own, &|i, member, l, own| {
            let mut chains = member.chains.lent(own.products, own.grads);
            let (_, _, dl, _) = chains.seed_grads();
            let (r0, rp) = (rcol[i], rcol[i + 1] - rcol[i]);
            for (dst, src) in dl.chunks_exact_mut(rp).zip(dlcat.chunks_exact(s)) {
                dst.copy_from_slice(&src[r0..r0 + rp]);
            }
            chains.peel(&l.shape, own.h, own.dh);
            l.accumulate_core_grads(own.dh);
        });
    }
}

/// `y` (B × Σ M_i, the layers' outputs one after the other) cut into each layer's B × M_i
/// (`mcol`: prefix sums of M_i); the slots past the layers are empty.
fn per_member<'a>(y: &'a mut [f32], b: usize, mcol: &[usize]) -> [&'a mut [f32]; MAX_MEMBERS] {
    let mut parts: [&mut [f32]; MAX_MEMBERS] = Default::default();
    let mut rest = y;
    for (i, w) in mcol.windows(2).enumerate() {
        let (part, tail) = rest.split_at_mut(b * (w[1] - w[0]));
        parts[i] = part;
        rest = tail;
    }
    parts
}

/// The backward's output side of a [`SharedInput`], run by every layer on its own: its
/// [dR_i ; U_i] pair (two tasks at small batches, as on the merged path) and its bias's
/// gradient.
struct OutputSide<'a> {
    t1: (&'a [f32], usize), // T1 (B × S) and S
    dy: &'a [f32],          // [dY_1 | … | dY_n], B × M_i each
    /// U (B × S): layer i alone writes its columns `rcol[i]..rcol[i + 1]`.
    u: DisjointMut<'a>,
    rcol: &'a [usize],
    mcol: &'a [usize],
    pair: bool,
}

impl OutputSide<'_> {
    /// Layer `i`'s dR_i = T1_iᵀ·dY_i (into `dr`, its chain's seed), U_i = dY_i·R_iᵀ (`r`: its
    /// R) and db_i += Σ_rows dY_i.
    fn member(&self, i: usize, r: &[f32], dr: &mut [f32], db: &mut [f32]) {
        let ((t1, s), u) = (self.t1, &self.u);
        let b = t1.len() / s;
        let (r0, rp) = (self.rcol[i], self.rcol[i + 1] - self.rcol[i]);
        let (m0, m) = (self.mcol[i], self.mcol[i + 1] - self.mcol[i]);
        let dyi = &self.dy[b * m0..b * (m0 + m)];
        let (dyi_m, r) = (MatRef::new(dyi, b, m), MatRef::new(r, rp, m));
        let t1i = MatRef::strided(&t1[r0..], b, rp, s, 1);
        let mut grad_r = move || {
            let dr = MatMut::new(dr, rp, m);
            if self.pair {
                matmul_serial(dr, t1i.t(), dyi_m, false);
            } else {
                matmul(dr, t1i.t(), dyi_m, false);
            }
        };
        // SAFETY: layer i alone writes U's columns r0..r0 + rp (its U_i), and nothing reads
        // U until every layer's task is done.
        let grad_u = || unsafe { u.matmul_serial_into(r0, (b, rp, s, 1), dyi_m, r.t(), false) };
        if self.pair {
            comera_tensor::join(grad_r, grad_u);
        } else {
            grad_r();
            grad_u();
        }
        accumulate_bias_grad(dyi, db);
    }
}

/// Every layer's gated cores and chains (halves of the layers as rayon tasks), then each L into
/// its columns `rcol` of Lcat = [L_1 | … | L_n] (`lcat`, N × S).
fn build_all(
    members: &[Member],
    rcol: &[usize],
    layers: &[&TtLinear],
    h: &mut [Scratch],
    products: &mut [Scratch],
    lcat: &mut [f32],
) {
    let own = Own {
        h,
        dh: &mut [],
        products,
        grads: &mut [],
    };
    let mut layers: [&TtLinear; MAX_MEMBERS] =
        std::array::from_fn(|i| layers[i.min(layers.len() - 1)]);
    each_member(
        members,
        0,
        &mut layers[..members.len()],
        own,
        &|_, member, l, own| {
            l.gate_cores(own.h);
            let mut chains = member.chains.lent(own.products, &mut []);
            chains.build(&l.shape, own.h);
        },
    );
    // Lcat's rows in parallel groups, each row from every layer's L (plain copies).
    let s = *rcol.last().expect("n ≥ 1");
    let ls: [&[f32]; MAX_MEMBERS] = std::array::from_fn(|i| match members.get(i) {
        Some(member) => member.l(products),
        None => &[],
    });
    let group = (crate::elementwise::CHUNK / s).max(1);
    comera_tensor::for_each(lcat.par_chunks_mut(group * s).enumerate(), |(g, rows)| {
        for (j, dst) in rows.chunks_exact_mut(s).enumerate() {
            let row = g * group + j;
            for (i, l) in ls[..members.len()].iter().enumerate() {
                let (c0, c1) = (rcol[i], rcol[i + 1]);
                dst[c0..c1].copy_from_slice(&l[row * (c1 - c0)..(row + 1) * (c1 - c0)]);
            }
        }
    });
}

/// Most layers one [`SharedInput`] fuses (attention's q, k and v: 3; more run one by one).
const MAX_MEMBERS: usize = 8;

/// The part of the lent buffers that belongs to a run of members, in member order (`dh` and
/// `grads` empty in a forward).
struct Own<'a> {
    h: &'a mut [Scratch],
    dh: &'a mut [Scratch],
    products: &'a mut [Scratch],
    grads: &'a mut [Scratch],
}

impl<'a> Own<'a> {
    /// The buffers of `members[..mid]` and of `members[mid..]` (`members` own these).
    fn split(self, members: &[Member], mid: usize) -> (Own<'a>, Own<'a>) {
        let (first, at) = (&members[0], &members[mid]);
        fn cut(v: &mut [Scratch], n: usize) -> (&mut [Scratch], &mut [Scratch]) {
            let n = n.min(v.len());
            v.split_at_mut(n)
        }
        let (h0, h1) = cut(self.h, at.cores.start - first.cores.start);
        let (dh0, dh1) = cut(self.dh, at.cores.start - first.cores.start);
        let (p0, p1) = cut(self.products, at.products.start - first.products.start);
        let (g0, g1) = cut(self.grads, at.grads.start - first.grads.start);
        (
            Own {
                h: h0,
                dh: dh0,
                products: p0,
                grads: g0,
            },
            Own {
                h: h1,
                dh: dh1,
                products: p1,
                grads: g1,
            },
        )
    }
}

/// Runs `leaf(i, member, layer, own)` for members `first..` (`members`, their `layers` and
/// their part `own` of the leased buffers), halves of them as rayon tasks.
fn each_member<T: Send>(
    members: &[Member],
    first: usize,
    layers: &mut [T],
    own: Own<'_>,
    leaf: &(impl Fn(usize, &Member, &mut T, Own<'_>) + Sync),
) {
    match members {
        [] => {}
        [member] => leaf(first, member, &mut layers[0], own),
        _ => {
            let mid = members.len() / 2;
            let (a, b) = own.split(members, mid);
            let (la, lb) = layers.split_at_mut(mid);
            comera_tensor::join(
                || each_member(&members[..mid], first, la, a, leaf),
                || each_member(&members[mid..], first + mid, lb, b, leaf),
            );
        }
    }
}

/// One layer of a [`SharedInput`]: its chain layout and the places of its buffers in the
/// workspace's leases.
#[derive(Debug)]
struct Member {
    chains: Chains,
    cores: Range<usize>,    // its H_c in `h`, its dH_c in `dh`
    products: Range<usize>, // its chain products in `products`
    grads: Range<usize>,    // their gradient scratch in `grads`
}

impl Member {
    /// Its L (N × r_p) in the lent `products`, once built.
    fn l<'a>(&self, products: &'a [Scratch]) -> &'a [f32] {
        &products[self.products.start + self.chains.left_len() - 1]
    }

    /// Its R (r_p × M) in the lent `products`, once built.
    fn r<'a>(&self, products: &'a [Scratch]) -> &'a [f32] {
        &products[self.products.start + self.chains.left_len()]
    }
}
