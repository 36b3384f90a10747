//! GaLore on small least-squares problems: the loss goes down, the moments have the projected
//! shapes, and the projections are recomputed exactly every T steps.

use comera_layers::{Param, ParamKind};
use comera_optim::galore::{ParamState, Side};
use comera_optim::{AdamW, AdamWConfig, GaLore, GaLoreConfig};
use comera_tensor::init;

/// min ½‖X·W + b − Y‖² / batch over a tall (24×10, right projection) and a wide (8×20, left
/// projection) weight, each with its own data, plus a bias (plain AdamW).
struct Problem {
    xs: [Vec<f32>; 2],
    ys: [Vec<f32>; 2],
    batch: usize,
}

const TALL: (usize, usize) = (24, 10);
const WIDE: (usize, usize) = (8, 20);

fn problem() -> (Problem, Vec<Param>) {
    let batch = 64;
    let mut rng = init::rng(7);
    let mut mk = |(m, n): (usize, usize)| {
        let mut x = vec![0.0; batch * m];
        init::fill_normal(&mut rng, &mut x, 1.0);
        let mut w_true = vec![0.0; m * n];
        init::fill_normal(&mut rng, &mut w_true, 1.0);
        let mut y = vec![0.0; batch * n];
        for b in 0..batch {
            for j in 0..n {
                y[b * n + j] = (0..m).map(|i| x[b * m + i] * w_true[i * n + j]).sum();
            }
        }
        (x, y)
    };
    let (x0, y0) = mk(TALL);
    let (x1, y1) = mk(WIDE);
    let params = vec![
        Param::zeros("tall.weight", &[TALL.0, TALL.1], ParamKind::Other),
        Param::zeros("tall.bias", &[TALL.1], ParamKind::Other),
        Param::zeros("wide.weight", &[WIDE.0, WIDE.1], ParamKind::Other),
    ];
    (
        Problem {
            xs: [x0, x1],
            ys: [y0, y1],
            batch,
        },
        params,
    )
}

/// Loss, and gradients written into the parameters.
fn loss_and_grad(pb: &Problem, ps: &mut [Param]) -> f64 {
    let mut loss = 0.0f64;
    for (k, (wi, bias, (m, n))) in [(0usize, Some(1usize), TALL), (2, None, WIDE)]
        .into_iter()
        .enumerate()
    {
        let (x, y) = (&pb.xs[k], &pb.ys[k]);
        let mut gw = vec![0.0f32; m * n];
        let mut gb = vec![0.0f32; n];
        for b in 0..pb.batch {
            for j in 0..n {
                let mut pred: f32 = (0..m).map(|i| x[b * m + i] * ps[wi].value[i * n + j]).sum();
                if let Some(bi) = bias {
                    pred += ps[bi].value[j];
                }
                let r = pred - y[b * n + j];
                loss += 0.5 * (r as f64) * (r as f64) / pb.batch as f64;
                for i in 0..m {
                    gw[i * n + j] += x[b * m + i] * r / pb.batch as f32;
                }
                gb[j] += r / pb.batch as f32;
            }
        }
        ps[wi].grad.copy_from_slice(&gw);
        if let Some(bi) = bias {
            ps[bi].grad.copy_from_slice(&gb);
        }
    }
    loss
}

fn adam_cfg() -> AdamWConfig {
    AdamWConfig {
        lr_other: 0.2,
        clip_norm: 0.0,
        ..AdamWConfig::default()
    }
}

#[test]
fn galore_decreases_the_loss_with_projected_state_and_refreshes_every_t_steps() {
    let (pb, mut ps) = problem();
    let gcfg = GaLoreConfig {
        rank: 4,
        update_every: 5,
        scale: 0.25,
        ..GaLoreConfig::default()
    };
    let mut opt = GaLore::new(adam_cfg(), gcfg, |f| ps.iter_mut().for_each(f));

    // Projected shapes: tall 24×10 (m ≥ n) → P = V[:, :4] (10×4), moments 24×4; wide 8×20 →
    // P = U[:, :4] (8×4), moments 4×20; the bias keeps full AdamW moments.
    let proj: Vec<_> = opt.projected().collect();
    assert_eq!(proj.len(), 2);
    assert_eq!(
        (proj[0].side, proj[0].p.len(), proj[0].projected_shape()),
        (Side::Right, 10 * 4, (24, 4))
    );
    assert_eq!(proj[0].m.len(), 24 * 4);
    assert_eq!(
        (proj[1].side, proj[1].p.len(), proj[1].projected_shape()),
        (Side::Left, 8 * 4, (4, 20))
    );
    assert_eq!(proj[1].v.len(), 4 * 20);
    match &opt.state[1] {
        ParamState::Adam { m, v } => assert_eq!((m.len(), v.len()), (10, 10)),
        other => panic!("the bias should use AdamW, got {other:?}"),
    }
    let adamw = AdamW::new(adam_cfg(), |f| ps.iter_mut().for_each(f));
    assert!(
        opt.breakdown().moments < adamw.bytes(),
        "projected moments are smaller than AdamW's"
    );

    let first = loss_and_grad(&pb, &mut ps);
    let mut last_p: Vec<Vec<f32>> = opt.projected().map(|p| p.p.clone()).collect();
    let mut loss = first;
    let steps = 300u64;
    for step in 1..=steps {
        opt.step(1.0, 1.0, |f| ps.iter_mut().for_each(f));
        assert_eq!(opt.t, step);
        // Refreshed on steps 1, 1 + T, 1 + 2T, …: P changes exactly there.
        let refreshed = (step - 1) % 5 == 0;
        for (k, p) in opt.projected().enumerate() {
            assert_eq!(p.refreshed_at, 1 + 5 * ((step - 1) / 5), "step {step}");
            assert_eq!(p.refreshes, 1 + (step - 1) / 5);
            let changed = p.p != last_p[k];
            assert_eq!(changed, refreshed, "{} at step {step}", p.name);
            last_p[k] = p.p.clone();
        }
        loss = loss_and_grad(&pb, &mut ps);
        assert!(loss.is_finite());
    }
    assert_eq!(opt.refresh_steps, steps / 5);
    assert_eq!(opt.svd_fallbacks, 0);
    assert!(
        loss < 0.05 * first,
        "loss {first:.4} → {loss:.4} after {steps} steps"
    );
    // Each P has orthonormal columns.
    for p in opt.projected() {
        let (side, r) = (p.p.len() / p.rank, p.rank);
        for a in 0..r {
            for b in 0..r {
                let dot: f32 = (0..side).map(|i| p.p[i * r + a] * p.p[i * r + b]).sum();
                assert!((dot - (a == b) as u8 as f32).abs() < 1e-4, "{}", p.name);
            }
        }
    }
}

#[test]
fn the_projection_spans_the_top_singular_vectors() {
    // A rank-2 gradient with known row and column spaces; with r = 2 the projection must
    // capture it exactly: G·P·Pᵀ = G (right) and P·Pᵀ·G = G (left).
    for (m, n) in [(12usize, 6usize), (5, 9)] {
        let mut rng = init::rng(11);
        let (mut a, mut b) = (vec![0.0f32; m * 2], vec![0.0f32; 2 * n]);
        init::fill_normal(&mut rng, &mut a, 1.0);
        init::fill_normal(&mut rng, &mut b, 1.0);
        let mut ps = [Param::zeros("w", &[m, n], ParamKind::Other)];
        for i in 0..m {
            for j in 0..n {
                ps[0].grad[i * n + j] = a[i * 2] * b[j] + a[i * 2 + 1] * b[n + j];
            }
        }
        let g = ps[0].grad.clone();
        let gcfg = GaLoreConfig {
            rank: 2,
            update_every: 3,
            ..GaLoreConfig::default()
        };
        let mut opt = GaLore::new(adam_cfg(), gcfg, |f| ps.iter_mut().for_each(f));
        opt.step(1.0, 1.0, |f| ps.iter_mut().for_each(f));
        let p = opt.projected().next().unwrap();
        let r = 2;
        let norm: f32 = g.iter().map(|x| x * x).sum::<f32>().sqrt();
        let mut err = 0.0f32;
        for i in 0..m {
            for j in 0..n {
                let rec: f32 = match p.side {
                    // (G·P·Pᵀ)[i, j] = Σ_q Σ_k G[i, q]·P[q, k]·P[j, k]
                    Side::Right => (0..n)
                        .map(|q| {
                            g[i * n + q]
                                * (0..r).map(|k| p.p[q * r + k] * p.p[j * r + k]).sum::<f32>()
                        })
                        .sum(),
                    // (P·Pᵀ·G)[i, j] = Σ_q Σ_k P[i, k]·P[q, k]·G[q, j]
                    Side::Left => (0..m)
                        .map(|q| {
                            (0..r).map(|k| p.p[i * r + k] * p.p[q * r + k]).sum::<f32>()
                                * g[q * n + j]
                        })
                        .sum(),
                };
                err = err.max((rec - g[i * n + j]).abs());
            }
        }
        assert!(err < 1e-4 * norm, "{m}x{n}: max error {err} (‖G‖ {norm})");
        assert_eq!(p.side, if m >= n { Side::Right } else { Side::Left });
    }
}

#[test]
fn forced_refresh_and_non_finite_gradient_fallback() {
    let gcfg = GaLoreConfig {
        rank: 3,
        update_every: 1000,
        ..GaLoreConfig::default()
    };
    // First step on a NaN gradient: no SVD possible and no previous projection, so the
    // range finder supplies an orthonormal P.
    let (pb, mut ps) = problem();
    let mut opt = GaLore::new(adam_cfg(), gcfg.clone(), |f| ps.iter_mut().for_each(f));
    loss_and_grad(&pb, &mut ps);
    ps[0].grad.fill(f32::NAN);
    opt.step(1.0, 1.0, |f| ps.iter_mut().for_each(f));
    assert_eq!(opt.svd_fallbacks, 1);
    let tall = opt.projected().next().unwrap();
    assert_eq!(tall.refreshes, 1);
    for a in 0..3 {
        for b in 0..3 {
            let dot: f32 = (0..10).map(|i| tall.p[i * 3 + a] * tall.p[i * 3 + b]).sum();
            assert!((dot - (a == b) as u8 as f32).abs() < 1e-4);
        }
    }

    // No refresh is due for 1000 steps, unless asked for.
    let (pb, mut ps) = problem();
    let mut opt = GaLore::new(adam_cfg(), gcfg, |f| ps.iter_mut().for_each(f));
    for _ in 0..2 {
        loss_and_grad(&pb, &mut ps);
        opt.step(1.0, 1.0, |f| ps.iter_mut().for_each(f));
    }
    assert!(!opt.refresh_due());
    assert_eq!((opt.refresh_steps, opt.svd_fallbacks), (1, 0));
    let first = opt.projected().next().unwrap().p.clone();
    opt.request_refresh();
    assert!(opt.refresh_due());
    loss_and_grad(&pb, &mut ps);
    opt.step(1.0, 1.0, |f| ps.iter_mut().for_each(f));
    assert_eq!(opt.refresh_steps, 2);
    let now = opt.projected().next().unwrap();
    assert_eq!((now.refreshes, now.refreshed_at), (2, 3));
    assert_ne!(
        now.p, first,
        "the forced refresh recomputed P from the new gradient"
    );
    // A later non-finite gradient keeps the previous projection.
    let before = now.p.clone();
    opt.request_refresh();
    loss_and_grad(&pb, &mut ps);
    ps[0].grad[5] = f32::INFINITY;
    opt.step(1.0, 1.0, |f| ps.iter_mut().for_each(f));
    assert_eq!(opt.svd_fallbacks, 1);
    assert_eq!(opt.projected().next().unwrap().p, before);
}
