//! LayerNorm, GELU/tanh, dropout, softmax cross-entropy and multi-head attention proven by
//! finite differences and against naive references.
#![allow(clippy::needless_range_loop)]

use comera_layers::activation::{gelu, Gelu, Tanh};
use comera_layers::attention::Attention;
use comera_layers::dropout::Dropout;
use comera_layers::loss::{CrossEntropy, IGNORE_INDEX};
use comera_layers::norm::LayerNorm;
use comera_layers::Layer;
use comera_tensor::init;

use crate::common::assert_close;

fn random_vec(rng: &mut init::Rng, n: usize, std: f32) -> Vec<f32> {
    let mut v = vec![0.0; n];
    init::fill_normal(rng, &mut v, std);
    v
}

/// Σ y·dy in f64.
fn dot(y: &[f32], dy: &[f32]) -> f64 {
    y.iter().zip(dy).map(|(&a, &b)| a as f64 * b as f64).sum()
}

const EPS: f32 = 1e-2;

/// Central differences of a scalar function of `x`, every entry.
fn fd_grad(x: &[f32], f: impl Fn(&[f32]) -> f64) -> Vec<f32> {
    let mut x = x.to_vec();
    (0..x.len())
        .map(|i| {
            let v = x[i];
            x[i] = v + EPS;
            let lp = f(&x);
            x[i] = v - EPS;
            let lm = f(&x);
            x[i] = v;
            ((lp - lm) / (2.0 * EPS as f64)) as f32
        })
        .collect()
}

// ---------------------------------------------------------------- LayerNorm

fn random_layer_norm(rng: &mut init::Rng, d: usize, eps: f32) -> LayerNorm {
    let mut ln = LayerNorm::with_eps("ln", d, eps);
    for g in &mut ln.gamma.value {
        *g = 1.0 + 0.3 * random_vec(rng, 1, 1.0)[0];
    }
    init::fill_normal(rng, &mut ln.beta.value, 0.5);
    ln
}

#[test]
fn layer_norm_forward_matches_naive() {
    let mut rng = init::rng(21);
    let (rows, d) = (6, 11);
    for eps in [1e-12f32, 1e-5, 0.5] {
        let ln = random_layer_norm(&mut rng, d, eps);
        let mut x = random_vec(&mut rng, rows * d, 2.0);
        for (i, v) in x.iter_mut().enumerate() {
            *v += (i / d) as f32 * 3.0 - 5.0; // row offsets
        }
        let mut ws = ln.workspace(rows);
        let mut y = vec![f32::NAN; rows * d];
        ln.forward(&mut ws, &x, &mut y);
        let mut want = vec![0.0f32; rows * d];
        for r in 0..rows {
            let xr: Vec<f64> = x[r * d..(r + 1) * d].iter().map(|&v| v as f64).collect();
            let mean = xr.iter().sum::<f64>() / d as f64;
            let var = xr.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
            let rstd = 1.0 / (var + eps as f64).sqrt();
            for i in 0..d {
                want[r * d + i] = ((xr[i] - mean) * rstd * ln.gamma.value[i] as f64
                    + ln.beta.value[i] as f64) as f32;
            }
            assert!((ws.mean()[r] as f64 - mean).abs() < 1e-5 * mean.abs().max(1.0));
            assert!((ws.rstd()[r] as f64 - rstd).abs() < 1e-5 * rstd);
        }
        assert_close(&format!("layer norm y (eps {eps})"), &y, &want, 1e-5);
    }
    // The default is BERT's ε.
    assert_eq!(LayerNorm::new("ln", 4).eps, 1e-12);
}

/// `forward_residual` / `backward_residual` against the separate passes they replace (dropout,
/// sum, LayerNorm; add, LayerNorm backward, dropout backward): the same bits, with and without
/// a mask, with and without the extra gradient, on rows that are whole mask words (d = 128)
/// and rows that start inside one (d = 100), over several parallel row blocks.
#[test]
fn residual_layer_norm_gives_the_separate_passes_bits() {
    use comera_layers::elementwise::{add_into, sum_into};
    let mut rng = init::rng(29);
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits());
    for (rows, d) in [(40usize, 128usize), (37, 100), (1, 100)] {
        let n = rows * d;
        for (p, extra) in [(0.3f32, true), (0.3, false), (0.0, true)] {
            let drop = Dropout::new(p, 7);
            let ln = random_layer_norm(&mut rng, d, 1e-12);
            let x = random_vec(&mut rng, n, 1.0);
            let branch = random_vec(&mut rng, n, 1.0);
            let dy = random_vec(&mut rng, n, 1.0);
            let dy2 = random_vec(&mut rng, n, 1.0);
            // Separate passes.
            let (mut l1, mut ws1, mut dws1) = (ln.clone(), ln.workspace(rows), drop.workspace(n));
            let mut o = branch.clone();
            drop.forward_in_place(&mut dws1, 3, true, &mut o);
            let mut r1 = vec![0.0; n];
            sum_into(&x, &o, &mut r1);
            let mut y1 = vec![0.0; n];
            l1.forward(&mut ws1, &r1, &mut y1);
            let mut g1 = dy.clone();
            if extra {
                add_into(&mut g1, &dy2);
            }
            let (mut dr1, mut db1) = (vec![0.0; n], vec![0.0; n]);
            l1.backward(&mut ws1, &r1, &g1, Some(&mut dr1));
            drop.backward(&dws1, &dr1, &mut db1);
            // One pass each way.
            let (mut l2, mut ws2, mut dws2) = (ln.clone(), ln.workspace(rows), drop.workspace(n));
            let (mut r2, mut y2) = (vec![f32::NAN; n], vec![f32::NAN; n]);
            let mask = drop.draw_mask(&mut dws2, 3, true);
            assert_eq!(mask.is_some(), p > 0.0);
            l2.forward_residual(&mut ws2, &x, &branch, mask, &mut r2, &mut y2);
            let (mut dr2, mut db2) = (vec![f32::NAN; n], vec![f32::NAN; n]);
            let extra_dy = extra.then_some(&dy2[..]);
            let mask = dws2.mask(&drop);
            l2.backward_residual(&mut ws2, &r2, &dy, extra_dy, &mut dr2, mask, &mut db2);
            let case = format!("rows {rows}, d {d}, p {p}, extra {extra}");
            assert!(same(&r2, &r1), "{case}: r");
            assert!(same(&y2, &y1), "{case}: y");
            assert!(same(&dr2, &dr1), "{case}: dr");
            assert!(same(&db2, &db1), "{case}: dbranch");
            for k in 0..2 {
                assert!(
                    same(&l2.params()[k].grad, &l1.params()[k].grad),
                    "{case}: param {k}"
                );
            }
            if p > 0.0 {
                assert!(db2.contains(&0.0) && db2.iter().any(|&v| v != 0.0));
            }
        }
    }
}

#[test]
fn layer_norm_matches_finite_differences() {
    let mut rng = init::rng(22);
    let (rows, d) = (4, 7);
    for eps in [1e-12f32, 1e-3] {
        let ln = random_layer_norm(&mut rng, d, eps);
        let x = random_vec(&mut rng, rows * d, 1.5);
        let dy = random_vec(&mut rng, rows * d, 1.0);
        let loss = |l: &LayerNorm, x: &[f32]| {
            let mut ws = l.workspace(rows);
            let mut y = vec![0.0; rows * d];
            l.forward(&mut ws, x, &mut y);
            dot(&y, &dy)
        };
        let mut l = ln.clone();
        let mut ws = l.workspace(rows);
        let mut y = vec![0.0; rows * d];
        l.forward(&mut ws, &x, &mut y);
        let mut dx = vec![f32::NAN; rows * d]; // dx is written, not accumulated
        l.backward(&mut ws, &x, &dy, Some(&mut dx));
        assert_close("layer norm dx", &dx, &fd_grad(&x, |x| loss(&ln, x)), 2e-3);
        for k in 0..2 {
            let fd = fd_grad(&ln.params()[k].value, |v| {
                let mut lp = ln.clone();
                lp.params_mut()[k].value.copy_from_slice(v);
                loss(&lp, &x)
            });
            let name = ln.params()[k].name.clone();
            assert_close(&name, &l.params()[k].grad, &fd, 2e-3);
        }
        // Parameter gradients accumulate; dx = None still gives them.
        let once: Vec<Vec<f32>> = l.params().iter().map(|p| p.grad.clone()).collect();
        l.backward(&mut ws, &x, &dy, None);
        for (p, g) in l.params().iter().zip(&once) {
            let twice: Vec<f32> = g.iter().map(|v| 2.0 * v).collect();
            assert_close(&format!("{} accumulates", p.name), &p.grad, &twice, 1e-6);
        }
    }
}

/// Many rows (blocks of `block_rows`, the last one short): dγ, dβ and dx match an f64 naive
/// backward, and forward and backward are bit-identical on 1, 2 and 3 threads.
#[test]
fn layer_norm_row_blocks_match_naive_on_any_thread_count() {
    let mut rng = init::rng(23);
    let (rows, d) = (203, 24);
    assert!(rows % comera_layers::norm::block_rows(rows) != 0);
    let ln = random_layer_norm(&mut rng, d, 1e-5);
    let x = random_vec(&mut rng, rows * d, 1.5);
    let dy = random_vec(&mut rng, rows * d, 1.0);
    let run = || {
        let mut l = ln.clone();
        let mut ws = l.workspace(rows);
        let mut y = vec![0.0; rows * d];
        l.forward(&mut ws, &x, &mut y);
        let mut dx = vec![f32::NAN; rows * d];
        l.backward(&mut ws, &x, &dy, Some(&mut dx));
        (y, dx, l.gamma.grad.clone(), l.beta.grad.clone())
    };
    let runs: Vec<_> = [1usize, 2, 3]
        .iter()
        .map(|&n| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap();
            pool.install(run)
        })
        .collect();
    for r in &runs[1..] {
        assert!(*r == runs[0], "layer norm differs across thread counts");
    }
    // f64: n = (x − μ)·r, g = γ ⊙ dy, dx = r·(g − mean(g) − n·mean(g·n)).
    let (mut dgamma, mut dbeta) = (vec![0.0f64; d], vec![0.0f64; d]);
    let mut dx = vec![0.0f32; rows * d];
    for r in 0..rows {
        let xr: Vec<f64> = x[r * d..(r + 1) * d].iter().map(|&v| v as f64).collect();
        let mean = xr.iter().sum::<f64>() / d as f64;
        let var = xr.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
        let rstd = 1.0 / (var + 1e-5).sqrt();
        let n: Vec<f64> = xr.iter().map(|v| (v - mean) * rstd).collect();
        let g: Vec<f64> = (0..d)
            .map(|i| ln.gamma.value[i] as f64 * dy[r * d + i] as f64)
            .collect();
        let mean_g = g.iter().sum::<f64>() / d as f64;
        let mean_gn = g.iter().zip(&n).map(|(g, n)| g * n).sum::<f64>() / d as f64;
        for i in 0..d {
            dgamma[i] += dy[r * d + i] as f64 * n[i];
            dbeta[i] += dy[r * d + i] as f64;
            dx[r * d + i] = (rstd * (g[i] - mean_g - n[i] * mean_gn)) as f32;
        }
    }
    let f = |v: Vec<f64>| v.into_iter().map(|v| v as f32).collect::<Vec<f32>>();
    let (_, got_dx, got_dgamma, got_dbeta) = &runs[0];
    assert_close("layer norm dx (blocks)", got_dx, &dx, 1e-5);
    assert_close("layer norm dγ (blocks)", got_dgamma, &f(dgamma), 1e-5);
    assert_close("layer norm dβ (blocks)", got_dbeta, &f(dbeta), 1e-5);
}

// ---------------------------------------------------------------- activations

#[test]
fn gelu_matches_known_values_and_finite_differences() {
    // x·Φ(x) from the standard normal CDF.
    for (x, want) in [
        (0.0f32, 0.0f64),
        (1.0, 0.841_344_746_068_542_9),
        (-1.0, -0.158_655_253_931_457_05),
        (2.5, 2.484_475_836_685_559_7),
        (-3.0, -0.004_049_694_094_890_31),
    ] {
        assert!(
            (gelu(x) as f64 - want).abs() < 2e-6,
            "gelu({x}) = {}",
            gelu(x)
        );
    }
    let mut rng = init::rng(23);
    let n = 64;
    let x = random_vec(&mut rng, n, 2.0);
    let dy = random_vec(&mut rng, n, 1.0);
    let loss = |x: &[f32]| {
        let mut y = vec![0.0; n];
        Gelu.forward(x, &mut y);
        dot(&y, &dy)
    };
    let mut dx = vec![f32::NAN; n];
    Gelu.backward(&x, &dy, &mut dx);
    assert_close("gelu dx", &dx, &fd_grad(&x, loss), 2e-3);
    let mut d = dy.clone();
    Gelu.backward_in_place(&x, &mut d);
    assert_eq!(d, dx, "in-place GELU backward");
}

#[test]
fn tanh_matches_finite_differences() {
    let mut rng = init::rng(24);
    let n = 64;
    let x = random_vec(&mut rng, n, 1.5);
    let dy = random_vec(&mut rng, n, 1.0);
    let mut y = vec![0.0; n];
    Tanh.forward(&x, &mut y);
    for (a, b) in y.iter().zip(&x) {
        assert!((*a as f64 - (*b as f64).tanh()).abs() < 1e-6);
    }
    let loss = |x: &[f32]| {
        let mut y = vec![0.0; n];
        Tanh.forward(x, &mut y);
        dot(&y, &dy)
    };
    let mut dx = vec![f32::NAN; n];
    Tanh.backward(&x, &dy, &mut dx);
    assert_close("tanh dx", &dx, &fd_grad(&x, loss), 2e-3);
    let mut d = dy.clone();
    Tanh.backward_in_place(&x, &mut d);
    assert_eq!(d, dx, "in-place tanh backward");
}

// ---------------------------------------------------------------- dropout

fn dropout_mask(drop: &Dropout, n: usize, step: u64) -> Vec<bool> {
    let mut ws = drop.workspace(n);
    let x = vec![1.0f32; n];
    let mut y = vec![0.0; n];
    drop.forward(&mut ws, step, true, &x, &mut y);
    (0..n).map(|i| ws.kept(i)).collect()
}

#[test]
fn dropout_is_seeded_and_scaled() {
    let n = 1000; // not a multiple of 64
    let drop = Dropout::new(0.1, 42);
    let m0 = dropout_mask(&drop, n, 0);
    assert_eq!(
        m0,
        dropout_mask(&Dropout::new(0.1, 42), n, 0),
        "same seed, same step"
    );
    assert_ne!(m0, dropout_mask(&drop, n, 1), "different step");
    assert_ne!(
        m0,
        dropout_mask(&Dropout::new(0.1, 43), n, 0),
        "different seed"
    );
    for (i, &k) in m0.iter().enumerate() {
        assert_eq!(k, drop.keep(0, i), "mask formula");
    }

    // Kept fraction ≈ 1 − p over many elements (binomial, 5σ).
    for p in [0.1f32, 0.5, 0.9] {
        let big = 100_000;
        let d = Dropout::new(p, 7);
        let kept = dropout_mask(&d, big, 3).iter().filter(|&&k| k).count() as f64;
        let (mu, sd) = (
            big as f64 * (1.0 - p as f64),
            (big as f64 * p as f64 * (1.0 - p as f64)).sqrt(),
        );
        assert!(
            (kept - mu).abs() < 5.0 * sd,
            "p {p}: kept {kept}, want {mu}"
        );
    }

    // y = m·x/(1 − p); backward uses the same mask; in-place variants agree.
    let mut rng = init::rng(25);
    let x = random_vec(&mut rng, n, 1.0);
    let dy = random_vec(&mut rng, n, 1.0);
    let mut ws = drop.workspace(n);
    let mut y = vec![f32::NAN; n];
    drop.forward(&mut ws, 5, true, &x, &mut y);
    assert!(ws.is_active());
    let mut dx = vec![f32::NAN; n];
    drop.backward(&ws, &dy, &mut dx);
    let s = 1.0 / (1.0 - 0.1f32);
    for i in 0..n {
        let k = drop.keep(5, i);
        assert_eq!(ws.kept(i), k);
        assert_eq!(y[i], if k { x[i] * s } else { 0.0 });
        assert_eq!(dx[i], if k { dy[i] * s } else { 0.0 });
    }
    let mut ws2 = drop.workspace(n);
    let mut y2 = x.clone();
    drop.forward_in_place(&mut ws2, 5, true, &mut y2);
    assert_eq!(y2, y);
    let mut d2 = dy.clone();
    drop.backward_in_place(&ws2, &mut d2);
    assert_eq!(d2, dx);

    // The backward is the gradient of Σ y·dy for a fixed step (the map is linear).
    let fd = fd_grad(&x, |x| {
        let mut ws = drop.workspace(n);
        let mut y = vec![0.0; n];
        drop.forward(&mut ws, 5, true, x, &mut y);
        dot(&y, &dy)
    });
    assert_close("dropout dx", &dx, &fd, 1e-3);
}

#[test]
fn dropout_is_the_identity_at_eval_and_p_zero() {
    let mut rng = init::rng(26);
    let n = 130;
    let x = random_vec(&mut rng, n, 1.0);
    let dy = random_vec(&mut rng, n, 1.0);
    for (drop, train) in [
        (Dropout::new(0.0, 1), true),
        (Dropout::new(0.0, 1), false),
        (Dropout::new(0.3, 1), false),
    ] {
        let mut ws = drop.workspace(n);
        // A training step first, so the workspace holds a real mask when p > 0.
        let mut y = vec![0.0; n];
        drop.forward(&mut ws, 0, true, &x, &mut y);
        drop.forward(&mut ws, 1, train, &x, &mut y);
        assert!(!ws.is_active());
        assert_eq!(y, x, "p {} train {train}: y = x", drop.p);
        let mut dx = vec![f32::NAN; n];
        drop.backward(&ws, &dy, &mut dx);
        assert_eq!(dx, dy, "p {} train {train}: dx = dy", drop.p);
        let mut v = x.clone();
        drop.forward_in_place(&mut ws, 2, train, &mut v);
        assert_eq!(v, x);
        assert!((0..n).all(|i| ws.kept(i)));
    }
}

// ---------------------------------------------------------------- cross-entropy

#[test]
fn cross_entropy_matches_naive_and_finite_differences() {
    let mut rng = init::rng(27);
    let (rows, c) = (7, 5);
    let mut logits = random_vec(&mut rng, rows * c, 2.0);
    logits[3 * c + 1] += 40.0; // a large logit: the max-subtraction keeps it finite
    let labels = [2, IGNORE_INDEX, 0, 1, 4, IGNORE_INDEX, 3];
    let ce = CrossEntropy::new(c);
    let mut dl = vec![f32::NAN; rows * c];
    let st = ce.forward_backward(&logits, &labels, &mut dl);
    assert_eq!(st, ce.forward(&logits, &labels));

    // Naive reference in f64.
    let (mut sum, mut count, mut correct) = (0.0f64, 0, 0);
    for r in 0..rows {
        if labels[r] == IGNORE_INDEX {
            continue;
        }
        let z: Vec<f64> = logits[r * c..(r + 1) * c]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        sum += lse - z[labels[r] as usize];
        count += 1;
        let am = (0..c).fold(0, |b, j| if z[j] > z[b] { j } else { b });
        correct += (am == labels[r] as usize) as usize;
    }
    assert_eq!(st.count, count);
    assert_eq!(st.correct, correct);
    assert_eq!(ce.accuracy_counts(&logits, &labels), (correct, count));
    assert!((st.loss - sum / count as f64).abs() < 1e-5, "{st:?}");
    assert!((st.loss_sum - sum).abs() < 1e-4);

    // Ignored rows: exactly zero gradient.
    for r in [1, 5] {
        assert!(dl[r * c..(r + 1) * c].iter().all(|&v| v == 0.0));
    }
    let fd = fd_grad(&logits, |z| ce.forward(z, &labels).loss);
    assert_close("cross-entropy dlogits", &dl, &fd, 2e-3);

    // A custom ignore label and no ignore label.
    let labels2 = [2, 7, 0, 1, 4, 7, 3];
    let ce7 = CrossEntropy::with_ignore_index(c, Some(7));
    assert_eq!(ce7.forward(&logits, &labels2), st);
    let all = [2, 1, 0, 1, 4, 0, 3];
    let ce_none = CrossEntropy::with_ignore_index(c, None);
    let mut dl2 = vec![0.0; rows * c];
    let st2 = ce_none.forward_backward(&logits, &all, &mut dl2);
    assert_eq!(st2.count, rows);
    let fd = fd_grad(&logits, |z| ce_none.forward(z, &all).loss);
    assert_close("cross-entropy dlogits (no ignore)", &dl2, &fd, 2e-3);
}

#[test]
fn cross_entropy_with_every_row_ignored_is_zero() {
    let ce = CrossEntropy::new(3);
    let logits = [1.0f32, 2.0, 3.0, -1.0, 0.0, 1.0];
    let mut dl = [f32::NAN; 6];
    let st = ce.forward_backward(&logits, &[IGNORE_INDEX, IGNORE_INDEX], &mut dl);
    assert_eq!((st.loss, st.count, st.correct), (0.0, 0, 0));
    assert!(dl.iter().all(|&v| v == 0.0));
}

// ---------------------------------------------------------------- attention

/// Naive attention in f64 of `qkv` (3, B, T, D): out (B, T, D) and probs (B, H, T, T).
fn naive_attention(
    qkv: &[f32],
    mask: Option<&[u8]>,
    b_: usize,
    t: usize,
    d: usize,
    nh: usize,
    causal: bool,
) -> (Vec<f32>, Vec<f32>) {
    let hd = d / nh;
    // Column c of the concatenated row [q | k | v] of token i of sequence b.
    let at =
        |b: usize, i: usize, c: usize| qkv[(c / d) * b_ * t * d + (b * t + i) * d + c % d] as f64;
    let mut out = vec![0.0f32; b_ * t * d];
    let mut probs = vec![0.0f32; b_ * nh * t * t];
    for b in 0..b_ {
        for h in 0..nh {
            for i in 0..t {
                let allowed: Vec<bool> = (0..t)
                    .map(|j| mask.is_none_or(|m| m[b * t + j] == 1) && (!causal || j <= i))
                    .collect();
                let s: Vec<f64> = (0..t)
                    .map(|j| {
                        if !allowed[j] {
                            return f64::NEG_INFINITY;
                        }
                        (0..hd)
                            .map(|e| at(b, i, h * hd + e) * at(b, j, d + h * hd + e))
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                if m == f64::NEG_INFINITY {
                    continue; // no allowed key: P = 0, output 0
                }
                let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                let p: Vec<f64> = s.iter().map(|v| (v - m).exp() / z).collect();
                for j in 0..t {
                    probs[((b * nh + h) * t + i) * t + j] = p[j] as f32;
                }
                for e in 0..hd {
                    out[(b * t + i) * d + h * hd + e] = (0..t)
                        .map(|j| p[j] * at(b, j, 2 * d + h * hd + e))
                        .sum::<f64>()
                        as f32;
                }
            }
        }
    }
    (out, probs)
}

/// (B, T): batch 0 has no padding (its last three positions are padded when B = 1), batch 1
/// has its last two positions padded, batch 2 has a padded position in the middle, batch 3
/// (when present) is all padding.
fn padding_mask(b_: usize, t: usize) -> Vec<u8> {
    let mut m = vec![1u8; b_ * t];
    if b_ == 1 {
        m[t - 3..t].fill(0);
    } else {
        m[t + t - 2..2 * t].fill(0);
    }
    if b_ > 2 {
        m[2 * t + 1] = 0;
    }
    if b_ > 3 {
        m[3 * t..4 * t].fill(0);
    }
    m
}

#[test]
fn attention_forward_matches_naive() {
    let mut rng = init::rng(28);
    for &(b_, t, d, nh) in &[
        (4usize, 6usize, 12usize, 3usize),
        (2, 9, 8, 1),
        (1, 33, 16, 4),
    ] {
        let qkv = random_vec(&mut rng, b_ * t * 3 * d, 1.0);
        let mask = padding_mask(b_, t);
        for causal in [false, true] {
            for m in [None, Some(mask.as_slice())] {
                let attn = if causal {
                    Attention::causal(d, nh)
                } else {
                    Attention::new(d, nh)
                };
                let mut ws = attn.workspace(b_, t);
                let mut out = vec![f32::NAN; b_ * t * d];
                attn.forward(&mut ws, &qkv, m, &mut out);
                let (want, want_p) = naive_attention(&qkv, m, b_, t, d, nh, causal);
                let tag = format!("B{b_} T{t} D{d} H{nh} causal {causal} mask {}", m.is_some());
                assert!(out.iter().all(|v| v.is_finite()), "{tag}: finite");
                assert_close(&format!("{tag} out"), &out, &want, 1e-5);
                assert_close(&format!("{tag} probs"), ws.probs(), &want_p, 1e-5);
                // Excluded keys have exactly zero probability.
                for (i, (&p, &w)) in ws.probs().iter().zip(&want_p).enumerate() {
                    if w == 0.0 {
                        assert_eq!(p, 0.0, "{tag}: probs[{i}]");
                    }
                }
            }
        }
    }
}

#[test]
fn attention_matches_finite_differences() {
    let mut rng = init::rng(29);
    let (b_, t, d, nh) = (4, 5, 8, 2);
    let qkv = random_vec(&mut rng, b_ * t * 3 * d, 1.0);
    let dout = random_vec(&mut rng, b_ * t * d, 1.0);
    let mask = padding_mask(b_, t);
    for causal in [false, true] {
        for m in [None, Some(mask.as_slice())] {
            let attn = if causal {
                Attention::causal(d, nh)
            } else {
                Attention::new(d, nh)
            };
            let mut ws = attn.workspace(b_, t);
            let loss = |x: &[f32]| {
                let mut ws = attn.workspace(b_, t);
                let mut out = vec![0.0; b_ * t * d];
                attn.forward(&mut ws, x, m, &mut out);
                dot(&out, &dout)
            };
            let mut out = vec![0.0; b_ * t * d];
            attn.forward(&mut ws, &qkv, m, &mut out);
            let mut dqkv = vec![f32::NAN; b_ * t * 3 * d]; // written, not accumulated
            attn.backward(&mut ws, &qkv, &dout, &mut dqkv);
            let tag = format!("attention causal {causal} mask {}", m.is_some());
            assert_close(&tag, &dqkv, &fd_grad(&qkv, loss), 3e-3);
            // K and V rows at padding positions get exactly zero gradient.
            if let Some(m) = m {
                let nd = b_ * t * d;
                for b in 0..b_ {
                    for j in 0..t {
                        if m[b * t + j] == 0 {
                            let rows = [nd, 2 * nd].map(|at| &dqkv[at + (b * t + j) * d..][..d]);
                            assert!(
                                rows.iter().all(|r| r.iter().all(|&v| v == 0.0)),
                                "{tag}: dK/dV b{b} j{j}"
                            );
                        }
                    }
                }
            }
            // Deterministic: the same inputs give bit-identical results.
            let mut dqkv2 = vec![0.0; dqkv.len()];
            attn.forward(&mut ws, &qkv, m, &mut out);
            attn.backward(&mut ws, &qkv, &dout, &mut dqkv2);
            assert_eq!(dqkv, dqkv2, "{tag}: repeatable");
        }
    }
}

/// Shapes large enough that the GEMMs inside attention take their threaded path.
#[test]
fn attention_at_bert_like_sizes_matches_naive() {
    let mut rng = init::rng(30);
    let (b_, t, d, nh) = (2, 64, 128, 2);
    let qkv = random_vec(&mut rng, b_ * t * 3 * d, 0.3);
    let mut mask = vec![1u8; b_ * t];
    mask[t + 40..2 * t].fill(0);
    let attn = Attention::new(d, nh);
    let mut ws = attn.workspace(b_, t);
    let mut out = vec![0.0; b_ * t * d];
    attn.forward(&mut ws, &qkv, Some(&mask), &mut out);
    let (want, _) = naive_attention(&qkv, Some(&mask), b_, t, d, nh, false);
    assert_close("attention (64 tokens) out", &out, &want, 1e-4);
}

// ---------------------------------------------------------------- distillation losses

#[test]
fn logit_kd_matches_naive_kl_and_finite_differences() {
    use comera_layers::distill::logit_kd;
    let mut rng = init::rng(31);
    let (rows, c) = (5, 4);
    let student = random_vec(&mut rng, rows * c, 2.0);
    let mut teacher = random_vec(&mut rng, rows * c, 2.0);
    teacher[2 * c] += 30.0; // a confident teacher row
    let mut scratch = vec![0.0; 2 * c];
    for tau in [1.0f32, 2.5] {
        let kd = |s: &[f32]| {
            let mut sink = vec![0.0; rows * c];
            logit_kd(s, &teacher, c, tau, 1.0, &mut sink, &mut vec![0.0; 2 * c])
        };
        // Naive reference in f64: τ²/N Σ_r KL(softmax(t/τ) ‖ softmax(s/τ)).
        let softmax = |z: &[f32]| {
            let z: Vec<f64> = z.iter().map(|&v| v as f64 / tau as f64).collect();
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = z.iter().map(|v| (v - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            e.into_iter().map(|v| v / sum).collect::<Vec<f64>>()
        };
        let mut want = 0.0;
        for r in 0..rows {
            let p = softmax(&teacher[r * c..(r + 1) * c]);
            let q = softmax(&student[r * c..(r + 1) * c]);
            want += (0..c).map(|j| p[j] * (p[j].ln() - q[j].ln())).sum::<f64>();
        }
        want *= (tau * tau) as f64 / rows as f64;
        assert!(
            (kd(&student) - want).abs() < 1e-6,
            "τ={tau}: {} vs {want}",
            kd(&student)
        );
        // The gradient is added, scaled by the weight.
        let mut d = vec![1.0f32; rows * c];
        logit_kd(&student, &teacher, c, tau, 0.5, &mut d, &mut scratch);
        let got: Vec<f32> = d.iter().map(|v| (v - 1.0) / 0.5).collect();
        assert_close("∂L_kd/∂s", &got, &fd_grad(&student, kd), 2e-3);
    }
    // The same logits: no divergence, no gradient.
    let mut d = vec![0.0f32; rows * c];
    let same = logit_kd(&student, &student, c, 3.0, 1.0, &mut d, &mut scratch);
    assert!(
        same.abs() < 1e-6 && d.iter().all(|v| v.abs() < 1e-6),
        "{same}"
    );
}

#[test]
fn hidden_mse_is_a_mean_over_sequences_of_real_tokens_and_matches_finite_differences() {
    use comera_layers::distill::{hidden_mse, hidden_mse_grad};
    let mut rng = init::rng(33);
    let (t, d) = (3, 5);
    let rows = 3 * t; // three sequences; the last one all padding
    let h = random_vec(&mut rng, rows * d, 1.0);
    let mut g = random_vec(&mut rng, rows * d, 1.0);
    let mask = [1u8, 1, 0, 1, 0, 0, 0, 0, 0];
    // Naive: each sequence's mean over its real tokens' entries, then the mean over the
    // three sequences (the empty one counts 0).
    let sq = |r: usize| -> f64 {
        (0..d)
            .map(|j| (h[r * d + j] as f64 - g[r * d + j] as f64).powi(2))
            .sum()
    };
    let want = ((sq(0) + sq(1)) / (2 * d) as f64 + sq(3) / d as f64) / 3.0;
    assert!((hidden_mse(&h, &g, &mask, t) - want).abs() < 1e-9);
    // Padding rows: whatever the teacher says there costs nothing.
    g[2 * d..3 * d].iter_mut().for_each(|v| *v += 100.0);
    g[5 * d..6 * d].iter_mut().for_each(|v| *v += 100.0);
    assert!((hidden_mse(&h, &g, &mask, t) - want).abs() < 1e-9);
    let mut dh = vec![0.0f32; rows * d];
    hidden_mse_grad(&h, &g, &mask, t, 1.5, &mut dh);
    let fd = fd_grad(&h, |x| 1.5 * hidden_mse(x, &g, &mask, t));
    assert_close("1.5·∂L_h/∂h", &dh, &fd, 2e-3);
    assert!(dh[2 * d..3 * d].iter().all(|&v| v == 0.0));
    // Split across two "processes" (sequences 0 and 1–2), weighted by sequences: the same
    // loss as the whole batch.
    let (a, b) = (
        hidden_mse(&h[..t * d], &g[..t * d], &mask[..t], t),
        hidden_mse(&h[t * d..], &g[t * d..], &mask[t..], t),
    );
    assert!(((a + 2.0 * b) / 3.0 - want).abs() < 1e-9);
    // No real token: zero loss, zero gradient.
    let none = [0u8; 9];
    assert_eq!(hidden_mse(&h, &g, &none, t), 0.0);
    let mut dz = vec![0.0f32; rows * d];
    hidden_mse_grad(&h, &g, &none, t, 1.0, &mut dz);
    assert!(dz.iter().all(|&v| v == 0.0));
}
