//! TtLinear and Linear proven by finite differences and by agreement of all contraction paths.
#![allow(clippy::needless_range_loop)]

use comera_layers::{Layer, Linear, RankGates, TtLinear};
use comera_plan::TtPath;
use comera_tensor::{init, TtShape};
use rand::Rng as _;

use crate::common::assert_close;

/// loss = Σ y·dy, evaluated in f64 from the layer's f32 output.
fn loss<L: Layer>(layer: &L, batch: usize, x: &[f32], dy: &[f32]) -> f64 {
    let mut ws = layer.workspace(batch);
    let mut y = vec![0.0; batch * layer.out_features()];
    layer.forward(&mut ws, x, &mut y);
    y.iter().zip(dy).map(|(&a, &b)| a as f64 * b as f64).sum()
}

fn random_vec(rng: &mut init::Rng, n: usize) -> Vec<f32> {
    let mut v = vec![0.0; n];
    init::fill_normal(rng, &mut v, 1.0);
    v
}

/// A TtLinear with cores scaled so that outputs are O(1), gates drawn around 1, some pruned.
fn random_tt(
    rng: &mut init::Rng,
    in_modes: &[usize],
    out_modes: &[usize],
    ranks: &[usize],
    prune: bool,
) -> TtLinear {
    let shape = TtShape::new(in_modes, out_modes, ranks).unwrap();
    let mut layer = TtLinear::new("t", shape, RankGates::default(), rng).unwrap();
    for c in &mut layer.cores {
        init::fill_normal(rng, &mut c.value, 0.7);
    }
    for g in &mut layer.gates {
        for d in &mut g.value {
            *d = rng.random_range(0.3..1.5);
        }
    }
    if prune {
        // Prune one entry per bond where the bond has more than one (negative, zero and τ itself).
        let bad = [-0.2f32, 0.0, 0.01, 0.005];
        for (i, g) in layer.gates.iter_mut().enumerate() {
            if g.value.len() > 1 {
                let j = i % g.value.len();
                g.value[j] = bad[i % bad.len()];
            }
        }
    }
    init::fill_normal(rng, &mut layer.bias.value, 0.5);
    layer
}

struct Grads {
    y: Vec<f32>,
    dx: Vec<f32>,
    params: Vec<Vec<f32>>,
}

fn run(layer: &TtLinear, path: TtPath, batch: usize, x: &[f32], dy: &[f32]) -> Grads {
    let mut l = layer.clone();
    l.zero_grad();
    let mut ws = l.workspace(batch);
    ws.force_path(Some(path));
    assert_eq!(ws.path(), path);
    let mut y = vec![0.0; batch * l.out_features()];
    l.forward(&mut ws, x, &mut y);
    let mut dx = vec![0.0; batch * l.in_features()];
    l.backward(&mut ws, x, dy, Some(&mut dx));
    Grads {
        y,
        dx,
        params: l.params().iter().map(|p| p.grad.clone()).collect(),
    }
}

const SHAPES: &[(&[usize], &[usize], &[usize])] = &[
    (&[6], &[5], &[1, 3, 1]),
    (&[4, 3], &[2, 5], &[1, 3, 4, 2, 1]),
    (&[8, 6], &[3, 4, 5], &[1, 4, 5, 3, 4, 1]),
    (&[4, 4, 4], &[4, 4, 2], &[1, 3, 5, 4, 6, 2, 1]),
    (&[3, 2, 2, 2], &[5], &[1, 2, 3, 4, 2, 1]),
    (&[7], &[2, 3, 2], &[1, 4, 3, 2, 1]),
];

#[test]
fn all_paths_agree_with_the_dense_weight() {
    let mut rng = init::rng(7);
    for (i, &(im, om, r)) in SHAPES.iter().enumerate() {
        for &prune in &[false, true] {
            let layer = random_tt(&mut rng, im, om, r, prune);
            let (n, m) = (layer.in_features(), layer.out_features());
            for &batch in &[1usize, 5] {
                let x = random_vec(&mut rng, batch * n);
                let dy = random_vec(&mut rng, batch * m);
                // Reference: Y = X·W + b with W from the cores.
                let w = layer.dense_weight();
                let mut want = vec![0.0f32; batch * m];
                for b in 0..batch {
                    for j in 0..m {
                        let mut acc = layer.bias.value[j] as f64;
                        for k in 0..n {
                            acc += x[b * n + k] as f64 * w[k * m + j] as f64;
                        }
                        want[b * m + j] = acc as f32;
                    }
                }
                let base = run(&layer, TtPath::Merged, batch, &x, &dy);
                assert_close(&format!("shape {i} y"), &base.y, &want, 1e-5);
                for path in [TtPath::Sequential, TtPath::Dense] {
                    let g = run(&layer, path, batch, &x, &dy);
                    let tag = format!("shape {i} prune {prune} batch {batch} {path}");
                    assert_close(&format!("{tag} y"), &g.y, &base.y, 1e-5);
                    assert_close(&format!("{tag} dx"), &g.dx, &base.dx, 1e-5);
                    for (k, (a, b)) in g.params.iter().zip(&base.params).enumerate() {
                        assert_close(&format!("{tag} param {k}"), a, b, 1e-5);
                    }
                }
            }
        }
    }
}

#[test]
fn finite_differences_match_every_gradient() {
    let mut rng = init::rng(11);
    for &(im, om, r) in SHAPES {
        let layer = random_tt(&mut rng, im, om, r, true);
        let (n, m, batch) = (layer.in_features(), layer.out_features(), 3);
        let x = random_vec(&mut rng, batch * n);
        let dy = random_vec(&mut rng, batch * m);
        for path in TtPath::ALL {
            let g = run(&layer, path, batch, &x, &dy);
            let eps = 1e-2f32;
            // dX
            let mut fd = vec![0.0f32; x.len()];
            for i in 0..x.len() {
                let (mut xp, mut xm) = (x.clone(), x.clone());
                xp[i] += eps;
                xm[i] -= eps;
                fd[i] = ((loss(&layer, batch, &xp, &dy) - loss(&layer, batch, &xm, &dy))
                    / (2.0 * eps as f64)) as f32;
            }
            assert_close(&format!("{path} dx {im:?}->{om:?}"), &g.dx, &fd, 2e-3);
            // Every parameter, every entry.
            for (k, analytic) in g.params.iter().enumerate() {
                let mut fd = vec![0.0f32; analytic.len()];
                for i in 0..analytic.len() {
                    let mut lp = layer.clone();
                    let mut lm = layer.clone();
                    let v = lp.params()[k].value[i];
                    let is_gate = lp.params()[k].name.contains("gate");
                    if is_gate && (v - 0.01).abs() < 2.0 * eps {
                        // Too close to τ for a central difference; exactness is tested elsewhere.
                        continue;
                    }
                    lp.params_mut()[k].value[i] = v + eps;
                    lm.params_mut()[k].value[i] = v - eps;
                    fd[i] = ((loss(&lp, batch, &x, &dy) - loss(&lm, batch, &x, &dy))
                        / (2.0 * eps as f64)) as f32;
                }
                let name = layer.params()[k].name.clone();
                // Pruned gate entries get exactly zero gradient.
                if name.contains("gate") {
                    for (i, &d) in layer.params()[k].value.iter().enumerate() {
                        if d <= 0.01 {
                            assert_eq!(
                                analytic[i], 0.0,
                                "{path} {name}[{i}] pruned but has gradient"
                            );
                        }
                    }
                }
                assert_close(
                    &format!("{path} {name} {im:?}->{om:?}"),
                    analytic,
                    &fd,
                    5e-3,
                );
            }
        }
    }
}

#[test]
fn a_fully_pruned_bond_outputs_the_bias_and_passes_no_gradient() {
    let mut rng = init::rng(3);
    for mid in [1usize, 2, 3] {
        let mut layer = random_tt(&mut rng, &[4, 3], &[3, 2, 2], &[1, 3, 2, 4, 2, 1], false);
        layer.gates[mid].value.fill(0.0);
        let (n, m, batch) = (layer.in_features(), layer.out_features(), 4);
        let x = random_vec(&mut rng, batch * n);
        let dy = random_vec(&mut rng, batch * m);
        for path in TtPath::ALL {
            let g = run(&layer, path, batch, &x, &dy);
            for b in 0..batch {
                assert_eq!(
                    &g.y[b * m..(b + 1) * m],
                    layer.bias.value.as_slice(),
                    "{path}: y must be the bias"
                );
            }
            assert!(
                g.dx.iter().all(|&v| v == 0.0),
                "{path}: dx must be exactly 0"
            );
            let params = layer.params();
            for (p, grad) in params.iter().zip(&g.params) {
                if p.name.ends_with("bias") {
                    continue;
                }
                assert!(
                    grad.iter().all(|&v| v == 0.0),
                    "{path}: {} gradient must be exactly 0",
                    p.name
                );
            }
        }
    }
}

#[test]
fn dense_linear_matches_finite_differences() {
    let mut rng = init::rng(5);
    let mut layer = Linear::new("l", 7, 4, &mut rng);
    init::fill_normal(&mut rng, &mut layer.bias.value, 0.3);
    let batch = 3;
    let x = random_vec(&mut rng, batch * 7);
    let dy = random_vec(&mut rng, batch * 4);
    let mut ws = layer.workspace(batch);
    let mut y = vec![0.0; batch * 4];
    layer.forward(&mut ws, &x, &mut y);
    let mut dx = vec![0.0; batch * 7];
    layer.backward(&mut ws, &x, &dy, Some(&mut dx));
    let eps = 1e-2;
    for k in 0..2 {
        let analytic = layer.params()[k].grad.clone();
        let fd: Vec<f32> = (0..analytic.len())
            .map(|i| {
                let (mut lp, mut lm) = (layer.clone(), layer.clone());
                lp.params_mut()[k].value[i] += eps;
                lm.params_mut()[k].value[i] -= eps;
                ((loss(&lp, batch, &x, &dy) - loss(&lm, batch, &x, &dy)) / (2.0 * eps as f64))
                    as f32
            })
            .collect();
        assert_close("linear param", &analytic, &fd, 2e-3);
    }
    let fd: Vec<f32> = (0..x.len())
        .map(|i| {
            let (mut xp, mut xm) = (x.clone(), x.clone());
            xp[i] += eps;
            xm[i] -= eps;
            ((loss(&layer, batch, &xp, &dy) - loss(&layer, batch, &xm, &dy)) / (2.0 * eps as f64))
                as f32
        })
        .collect();
    assert_close("linear dx", &dx, &fd, 2e-3);
}

#[test]
fn initialisation_gives_the_specified_weight_variance() {
    let mut rng = init::rng(1);
    let shape = TtShape::uniform(&[12, 8, 8], &[8, 8, 12], 30).unwrap();
    let layer = TtLinear::new("t", shape, RankGates::default(), &mut rng).unwrap();
    let w = layer.dense_weight();
    let var = w.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / w.len() as f64;
    let want = 1.0 / (768.0 + 768.0);
    assert!(
        (var / want - 1.0).abs() < 0.25,
        "Var(W) = {var}, want {want}"
    );
    assert!(layer
        .gates
        .iter()
        .all(|g| g.value.iter().all(|&d| d == 1.0)));
}

#[test]
fn size_surrogate_gradient_matches_finite_differences() {
    let mut rng = init::rng(9);
    let mut layer = random_tt(&mut rng, &[4, 3], &[2, 5], &[1, 3, 4, 2, 1], true);
    layer.zero_grad();
    layer.accumulate_size_l1_grad(1.0);
    let eps = 1e-3;
    for b in 0..layer.gates.len() {
        for j in 0..layer.gates[b].value.len() {
            let v = layer.gates[b].value[j];
            if (v - 0.01).abs() < 2.0 * eps {
                continue;
            }
            let (mut lp, mut lm) = (layer.clone(), layer.clone());
            lp.gates[b].value[j] = v + eps;
            lm.gates[b].value[j] = v - eps;
            let fd = (lp.size_l1() - lm.size_l1()) / (2.0 * eps as f64);
            assert!(
                (layer.gates[b].grad[j] as f64 - fd).abs() < 1e-2 * fd.abs().max(1.0),
                "bond {b} entry {j}"
            );
        }
    }
}

#[test]
fn merged_path_at_small_batches_gives_the_same_bits_on_any_thread_count() {
    // The paper's attention shape at 128 rows and small ranks: the chains, their peels and the
    // backward's independent products run as two single-threaded tasks, whatever the pool size.
    let mut rng = init::rng(31);
    let layer = random_tt(
        &mut rng,
        &[12, 8, 8],
        &[8, 8, 12],
        &[1, 6, 5, 7, 5, 6, 1],
        true,
    );
    let batch = 128;
    let x = random_vec(&mut rng, batch * 768);
    let dy = random_vec(&mut rng, batch * 768);
    merged_on_any_thread_count(&layer, batch, &x, &dy);
}

#[test]
fn chains_cut_into_row_pieces_agree_with_dense_and_give_the_same_bits_on_any_thread_count() {
    // The paper's FFN up shape (768 → 3,072) at rank 30 and 128 rows: the right chain's last
    // product (480 × 30 · 30 × 192) and its peel run in four row pieces each, the left
    // chain's last (96 × 30 · 30 × 240) in two, on whichever threads take them.
    merged_at_rank_30_against_dense(41, &[16, 16, 12], 128);
}

#[test]
fn merged_path_in_row_lanes_agrees_with_dense_and_gives_the_same_bits_on_any_thread_count() {
    // The paper's attention shape at rank 30 and 1,100 rows (above the two-task size): the
    // merged path runs in row lanes, 8 of 138 rows, the last 134, each in blocks of 128 rows
    // and a short one. Pruned gates and the bias included.
    merged_at_rank_30_against_dense(37, &[8, 8, 12], 1100);
}

/// A layer from 768 = [12, 8, 8] to `out_modes` at rank 30 (cores of outputs of order 10,
/// pruned gates, a bias) on `batch` rows: the merged path on 1, 2 and 3 threads, the same bits,
/// and the dense path's result within 1e-4.
fn merged_at_rank_30_against_dense(seed: u64, out_modes: &[usize], batch: usize) {
    let mut rng = init::rng(seed);
    let ranks = [1, 30, 30, 30, 30, 30, 1];
    let mut layer = random_tt(&mut rng, &[12, 8, 8], out_modes, &ranks, true);
    for c in &mut layer.cores {
        init::fill_normal(&mut rng, &mut c.value, 0.2);
    }
    let x = random_vec(&mut rng, batch * 768);
    let dy = random_vec(&mut rng, batch * layer.out_features());
    let base = merged_on_any_thread_count(&layer, batch, &x, &dy);
    let dense = run(&layer, TtPath::Dense, batch, &x, &dy);
    assert_close("y", &base.y, &dense.y, 1e-4);
    assert_close("dx", &base.dx, &dense.dx, 1e-4);
    for (k, (a, b)) in base.params.iter().zip(&dense.params).enumerate() {
        assert_close(&format!("param {k}"), a, b, 1e-4);
    }
}

/// The merged path on 1, 2 and 3 threads: asserts identical bits, returns the result.
fn merged_on_any_thread_count(layer: &TtLinear, batch: usize, x: &[f32], dy: &[f32]) -> Grads {
    let mut runs = [1usize, 2, 3].map(|n| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap();
        pool.install(|| run(layer, TtPath::Merged, batch, x, dy))
    });
    for r in &runs[1..] {
        assert!(r.y == runs[0].y, "forward differs across thread counts");
        assert!(r.dx == runs[0].dx, "dX differs across thread counts");
        assert!(
            r.params == runs[0].params,
            "parameter gradients differ across thread counts"
        );
    }
    std::mem::replace(
        &mut runs[0],
        Grads {
            y: vec![],
            dx: vec![],
            params: vec![],
        },
    )
}

/// `backward_adding_dx` (an input feeding several layers: attention's q, k and v) gives the
/// bits of `backward` into a buffer of its own followed by `add_into`, on every path: the
/// merged path in row lanes (the paper's attention shape at 1,100 rows), where it adds in the
/// streamed dX product, at two-task sizes (128 rows) and on the other paths, where it writes
/// the scratch and adds it; and a dead layer adds nothing. The parameters' gradients are
/// those of `backward`.
#[test]
fn adding_dx_is_the_backward_then_an_add() {
    let mut rng = init::rng(43);
    let ranks = [1, 30, 30, 30, 30, 30, 1];
    let mut layer = random_tt(&mut rng, &[12, 8, 8], &[8, 8, 12], &ranks, true);
    for c in &mut layer.cores {
        init::fill_normal(&mut rng, &mut c.value, 0.2);
    }
    let mut dead = layer.clone();
    dead.gates[2].value.fill(0.0);
    comera_layers::Compressible::truncate(&mut dead);
    assert!(comera_layers::Compressible::is_dead(&dead));
    for (batch, path, layer) in [
        (1100, TtPath::Merged, &layer),
        (128, TtPath::Merged, &layer),
        (40, TtPath::Sequential, &layer),
        (40, TtPath::Dense, &layer),
        (300, TtPath::Merged, &dead),
    ] {
        let x = random_vec(&mut rng, batch * 768);
        let dy = random_vec(&mut rng, batch * 768);
        let before = random_vec(&mut rng, batch * 768);
        let want = run(layer, path, batch, &x, &dy);
        let mut l = layer.clone();
        l.zero_grad();
        let mut ws = l.workspace(batch);
        ws.force_path(Some(path));
        let mut y = vec![0.0; batch * 768];
        l.forward(&mut ws, &x, &mut y);
        let (mut dx, mut tmp) = (before.clone(), vec![f32::NAN; batch * 768]);
        l.backward_adding_dx(&mut ws, &x, &dy, &mut dx, &mut tmp);
        let mut sum = before.clone();
        comera_layers::elementwise::add_into(&mut sum, &want.dx);
        assert!(dx == sum, "{path:?} at {batch} rows: dx + ∂L/∂x");
        let params: Vec<Vec<f32>> = l.params().iter().map(|p| p.grad.clone()).collect();
        assert!(params == want.params, "{path:?} at {batch} rows: gradients");
    }
}
