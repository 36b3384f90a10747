//! `FusedFfn` (Up → GELU → Down in row blocks) against the layers run one by one and against
//! finite differences of its own forward.
#![allow(clippy::needless_range_loop)]

use comera_layers::activation::Gelu;
use comera_layers::tt_linear::FusedFfn;
use comera_layers::{add_bias, Layer, RankGates, TtLinear};
use comera_tensor::{init, TtShape};
use rand::Rng as _;

use crate::common::assert_close;

fn random_vec(rng: &mut init::Rng, n: usize, std: f32) -> Vec<f32> {
    let mut v = vec![0.0; n];
    init::fill_normal(rng, &mut v, std);
    v
}

fn tt(rng: &mut init::Rng, name: &str, im: &[usize], om: &[usize], r: &[usize]) -> TtLinear {
    let shape = TtShape::new(im, om, r).unwrap();
    let mut l = TtLinear::new(name, shape, RankGates::default(), rng).unwrap();
    for c in &mut l.cores {
        init::fill_normal(rng, &mut c.value, 0.6);
    }
    for g in &mut l.gates {
        for d in &mut g.value {
            *d = rng.random_range(0.3..1.5);
        }
        g.value[0] = 0.0; // pruned
    }
    init::fill_normal(rng, &mut l.bias.value, 0.5);
    l
}

/// Up 12 → 20, down 20 → 6.
fn pair(rng: &mut init::Rng) -> (TtLinear, TtLinear) {
    (
        tt(rng, "up", &[3, 4], &[5, 4], &[1, 3, 4, 2, 1]),
        tt(rng, "down", &[4, 5], &[2, 3], &[1, 2, 5, 3, 1]),
    )
}

fn fused_y(up: &TtLinear, down: &TtLinear, batch: usize, x: &[f32]) -> Vec<f32> {
    let mut w = FusedFfn::new_unplanned(up, down, batch).unwrap();
    let mut y = vec![f32::NAN; batch * down.out_features()];
    w.forward(up, down, x, &mut y);
    y
}

fn loss(up: &TtLinear, down: &TtLinear, batch: usize, x: &[f32], dy: &[f32]) -> f64 {
    let y = fused_y(up, down, batch, x);
    y.iter().zip(dy).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// (y, dx, up's then down's parameter gradients) of the fused workspace.
fn fused_run(
    up: &TtLinear,
    down: &TtLinear,
    batch: usize,
    x: &[f32],
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
    let w = FusedFfn::new_unplanned(up, down, batch).unwrap();
    fused_run_with(w, up, down, x, dy)
}

fn fused_run_with(
    mut w: FusedFfn,
    up: &TtLinear,
    down: &TtLinear,
    x: &[f32],
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
    let batch = x.len() / up.in_features();
    let (mut up, mut down) = (up.clone(), down.clone());
    let mut y = vec![f32::NAN; batch * down.out_features()];
    w.forward(&up, &down, x, &mut y);
    let mut dx = vec![f32::NAN; x.len()]; // written
    w.backward(&mut up, &mut down, x, dy, &mut dx);
    let g = up
        .params()
        .into_iter()
        .chain(down.params())
        .map(|p| p.grad.clone())
        .collect();
    (y, dx, g)
}

#[test]
fn bias_and_gelu_in_one_pass_give_the_same_bits() {
    let mut rng = init::rng(50);
    let (rows, w) = (700, 96); // parallel chunks of whole rows
    let x = random_vec(&mut rng, rows * w, 2.0);
    let bias = random_vec(&mut rng, w, 1.0);
    let mut fused = x.clone();
    Gelu.forward_bias_in_place(&mut fused, &bias);
    let mut h = x.clone();
    add_bias(&mut h, &bias);
    let mut g = vec![0.0; h.len()];
    Gelu.forward(&h, &mut g);
    assert!(fused
        .iter()
        .zip(&g)
        .all(|(a, b)| a.to_bits() == b.to_bits()));
}

#[test]
fn gelu_value_and_derivative_in_one_pass_give_the_same_bits() {
    let mut rng = init::rng(52);
    let (rows, w) = (700, 96); // parallel chunks of whole rows
    let x = random_vec(&mut rng, rows * w, 2.0);
    let bias = random_vec(&mut rng, w, 1.0);
    let dy = random_vec(&mut rng, rows * w, 1.0);
    // One pass: g = GELU(x + b), and x + b replaced by GELU'(x + b), applied to dy.
    let (mut h, mut g) = (x.clone(), vec![0.0; x.len()]);
    Gelu.forward_bias_and_grad_in_place(&mut h, &bias, &mut g);
    let mut dx = dy.clone();
    comera_layers::elementwise::mul_into(&mut dx, &h);
    // Separately: add_bias, forward, backward.
    let mut pre = x.clone();
    add_bias(&mut pre, &bias);
    let mut want_g = vec![0.0; x.len()];
    Gelu.forward(&pre, &mut want_g);
    let mut want_dx = dy.clone();
    Gelu.backward_in_place(&pre, &mut want_dx);
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same(&g, &want_g), "GELU values differ");
    assert!(same(&dx, &want_dx), "GELU gradients differ");
}

#[test]
fn fused_equals_the_layers_one_by_one() {
    let mut rng = init::rng(51);
    let (up, down) = pair(&mut rng);
    // 300 rows: ten blocks of 32 rows (the last of 12), a lane each.
    for batch in [1usize, 7, 300] {
        let x = random_vec(&mut rng, batch * up.in_features(), 1.0);
        let dy = random_vec(&mut rng, batch * down.out_features(), 1.0);
        let (y, dx, grads) = fused_run(&up, &down, batch, &x, &dy);
        let (mut u, mut d) = (up.clone(), down.clone());
        let (mut wu, mut wd) = (u.workspace(batch), d.workspace(batch));
        let f = u.out_features();
        let mut h = vec![0.0; batch * f];
        u.forward(&mut wu, &x, &mut h);
        let mut g = vec![0.0; batch * f];
        Gelu.forward(&h, &mut g);
        let mut want_y = vec![0.0; batch * d.out_features()];
        d.forward(&mut wd, &g, &mut want_y);
        let mut dg = vec![0.0; batch * f];
        d.backward(&mut wd, &g, &dy, Some(&mut dg));
        Gelu.backward_in_place(&h, &mut dg);
        let mut want_dx = vec![0.0; x.len()];
        u.backward(&mut wu, &x, &dg, Some(&mut want_dx));
        assert_close(&format!("y batch {batch}"), &y, &want_y, 1e-5);
        assert_close(&format!("dx batch {batch}"), &dx, &want_dx, 1e-5);
        let want: Vec<Vec<f32>> = u
            .params()
            .into_iter()
            .chain(d.params())
            .map(|p| p.grad.clone())
            .collect();
        for (i, (a, b)) in grads.iter().zip(&want).enumerate() {
            assert_close(&format!("param {i} batch {batch}"), a, b, 1e-4);
        }
    }
}

#[test]
fn kept_gelu_gives_the_recomputing_backwards_bits() {
    let mut rng = init::rng(53);
    let (up, down) = pair(&mut rng);
    // 100 rows: blocks of 32, 32, 32 and 4, a lane each.
    for batch in [1usize, 7, 100] {
        let x = random_vec(&mut rng, batch * up.in_features(), 1.0);
        let dy = random_vec(&mut rng, batch * down.out_features(), 1.0);
        let keeping = FusedFfn::new_unplanned(&up, &down, batch).unwrap();
        assert!(
            keeping.keeps_gelu(),
            "batch {batch}: at most KEEP_MAX_ROWS rows"
        );
        let recomputing = FusedFfn::new_unplanned(&up, &down, batch)
            .unwrap()
            .recomputing();
        assert!(!recomputing.keeps_gelu());
        let (y, dx, grads) = fused_run_with(keeping, &up, &down, &x, &dy);
        let (want_y, want_dx, want_grads) = fused_run_with(recomputing, &up, &down, &x, &dy);
        let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same(&y, &want_y), "batch {batch}: y");
        assert!(same(&dx, &want_dx), "batch {batch}: dx");
        for (i, (a, b)) in grads.iter().zip(&want_grads).enumerate() {
            assert!(same(a, b), "batch {batch}: gradient of parameter {i}");
        }
        assert!(grads.iter().all(|g| g.iter().any(|&v| v != 0.0)));
    }
}

/// The lanes are fixed by the batch, not the thread count: 1, 2 and 3 threads give the same
/// bits, keeping GELU's values or recomputing them, with one block a lane (100 and 300 rows)
/// and with several, the last lane shorter (1,100 rows: 35 blocks in 12 lanes of 3).
#[test]
fn fused_gives_the_same_bits_on_any_thread_count() {
    let mut rng = init::rng(54);
    let (up, down) = pair(&mut rng);
    for (batch, recompute) in [(100usize, false), (100, true), (300, false), (1100, false)] {
        let x = random_vec(&mut rng, batch * up.in_features(), 1.0);
        let dy = random_vec(&mut rng, batch * down.out_features(), 1.0);
        let runs = [1usize, 2, 3].map(|n| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap();
            pool.install(|| {
                let w = FusedFfn::new_unplanned(&up, &down, batch).unwrap();
                let w = if recompute { w.recomputing() } else { w };
                let (y, dx, grads) = fused_run_with(w, &up, &down, &x, &dy);
                let bits = |v: &[f32]| v.iter().map(|a| a.to_bits()).collect::<Vec<_>>();
                (
                    bits(&y),
                    bits(&dx),
                    grads.iter().map(|g| bits(g)).collect::<Vec<_>>(),
                )
            })
        });
        for (threads, r) in [2, 3].iter().zip(&runs[1..]) {
            assert!(
                r == &runs[0],
                "batch {batch}, recompute {recompute}: {threads} threads differ from 1"
            );
        }
    }
}

#[test]
fn fused_matches_finite_differences() {
    let mut rng = init::rng(52);
    let (up, down) = pair(&mut rng);
    let batch = 130; // two blocks
    let x = random_vec(&mut rng, batch * up.in_features(), 1.0);
    let dy = random_vec(&mut rng, batch * down.out_features(), 1.0);
    let (_, dx, grads) = fused_run(&up, &down, batch, &x, &dy);
    let eps = 1e-2f32;
    // dx on the rows of both blocks.
    for &row in &[0usize, 127, 128, 129] {
        let n = up.in_features();
        let (mut fd, mut an) = (vec![], vec![]);
        for i in row * n..(row + 1) * n {
            let (mut xp, mut xm) = (x.clone(), x.clone());
            xp[i] += eps;
            xm[i] -= eps;
            fd.push(
                ((loss(&up, &down, batch, &xp, &dy) - loss(&up, &down, batch, &xm, &dy))
                    / (2.0 * eps as f64)) as f32,
            );
            an.push(dx[i]);
        }
        assert_close(&format!("dx row {row}"), &an, &fd, 5e-3);
    }
    let np = up.params().len();
    for (k, analytic) in grads.iter().enumerate() {
        let mut fd = vec![0.0f32; analytic.len()];
        for i in 0..analytic.len() {
            let (mut up_p, mut down_p) = (up.clone(), down.clone());
            let (mut up_m, mut down_m) = (up.clone(), down.clone());
            let (lp, lm) = if k < np {
                (&mut up_p, &mut up_m)
            } else {
                (&mut down_p, &mut down_m)
            };
            let j = if k < np { k } else { k - np };
            let v = lp.params()[j].value[i];
            if lp.params()[j].name.contains("gate") && (v - 0.01).abs() < 2.0 * eps {
                continue; // at the threshold: no central difference (pruned: exact zero)
            }
            lp.params_mut()[j].value[i] = v + eps;
            lm.params_mut()[j].value[i] = v - eps;
            fd[i] = ((loss(&up_p, &down_p, batch, &x, &dy) - loss(&up_m, &down_m, batch, &x, &dy))
                / (2.0 * eps as f64)) as f32;
        }
        assert_close(&format!("param {k}"), analytic, &fd, 5e-3);
    }
}
