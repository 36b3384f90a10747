//! The rank schedule on a tiny TT/TTM encoder: the objective's gradient, stage switching,
//! and truncation that leaves the model's function and the next training step unchanged.

use comera_layers::RankGates;
use comera_model::Rank;
use comera_model::{Encoder, EncoderConfig, EncoderState, LayerTt, TtmConfig};
use comera_optim::{AdamW, AdamWConfig};
use comera_train::rank::{self, Branch, RankConfig, RankController, Stage};

fn config() -> EncoderConfig {
    let tt = |i: Vec<usize>, o: Vec<usize>| LayerTt::uniform(&i, &o, 4);
    EncoderConfig {
        vocab_size: 50,
        seq_len: 5,
        d_model: 16,
        heads: 2,
        ffn: 32,
        layers: 1,
        num_labels: 2,
        dropout: 0.0,
        attn_tt: tt(vec![4, 4], vec![4, 4]),
        ffn_up_tt: tt(vec![4, 4], vec![8, 4]),
        ffn_down_tt: tt(vec![8, 4], vec![4, 4]),
        word_ttm: TtmConfig {
            vocab_modes: vec![5, 10],
            dim_modes: vec![4, 4],
            rank: Rank::Uniform(4),
        },
        ..EncoderConfig::default()
    }
}

fn loaded_state(m: &Encoder) -> EncoderState {
    let mut st = m.state(2);
    let ids: Vec<u32> = vec![2, 7, 11, 49, 0, 3, 3, 18, 0, 0];
    let mask: Vec<u32> = ids.iter().map(|&i| (i != 0) as u32).collect();
    st.load(&ids, &[0; 10], &mask, &[1, 0]).unwrap();
    st
}

/// Prunes a few gate entries by hand (a stand-in for what training does).
fn prune_some(m: &mut Encoder) {
    let mut k = 0;
    m.visit_params_mut(&mut |p| {
        if p.kind == comera_layers::ParamKind::RankGate {
            let n = p.len();
            p.value[k % n] = 0.004;
            if n > 2 {
                p.value[(k + 2) % n] = -0.3;
            }
            k += 1;
        }
    });
}

/// One full training step (forward, backward, rank objective, AdamW); returns the loss.
fn train_step(
    m: &mut Encoder,
    st: &mut EncoderState,
    ctl: &mut RankController,
    opt: &mut AdamW,
) -> f64 {
    m.zero_grad();
    let s = m.forward(st, true, 0).unwrap();
    m.backward(st);
    ctl.apply(m, s.loss, 0);
    opt.step(1.0, 1.0, |f| m.visit_params_mut(f));
    s.loss
}

#[test]
fn truncation_keeps_outputs_and_the_next_step() {
    let mut a = Encoder::new(&config(), 5).unwrap();
    prune_some(&mut a);
    let rcfg = RankConfig::default();
    let mut ctl_a = RankController::new(&rcfg, &a);
    let mut opt_a = AdamW::new(AdamWConfig::default(), |f| a.visit_params_mut(f));
    opt_a.freeze_gates_at = Some(0.01);
    let mut st_a = loaded_state(&a);
    // A step with momentum in every parameter, then copy everything.
    train_step(&mut a, &mut st_a, &mut ctl_a, &mut opt_a);
    let (mut b, mut ctl_b, mut opt_b) = (a.clone(), ctl_a.clone(), opt_a.clone());
    let mut st_b = loaded_state(&b);
    let params_before = b.num_params();
    let changed = rank::truncate(&mut b);
    assert!(!changed.is_empty());
    opt_b.retain(&changed, |f| b.visit_params_mut(f));
    assert!(
        b.num_params() < params_before,
        "truncation removed parameters"
    );
    assert_eq!(
        rank::sizes(&a).0,
        rank::sizes(&b).0,
        "S counts surviving slices: unchanged by truncation"
    );
    let la = a.forward(&mut st_a, false, 0).unwrap().loss;
    let lb = b.forward(&mut st_b, false, 0).unwrap().loss;
    assert!((la - lb).abs() < 1e-5 * la.abs().max(1.0), "{la} vs {lb}");
    let logits_a = st_a.logits().to_vec();
    for (x, y) in logits_a.iter().zip(st_b.logits()) {
        assert!((x - y).abs() < 1e-5, "logits changed: {x} vs {y}");
    }
    // The next two training steps see the same losses.
    for _ in 0..2 {
        let la = train_step(&mut a, &mut st_a, &mut ctl_a, &mut opt_a);
        let lb = train_step(&mut b, &mut st_b, &mut ctl_b, &mut opt_b);
        assert!((la - lb).abs() < 1e-5 * la.abs().max(1.0), "{la} vs {lb}");
    }
}

#[test]
fn pruned_gates_stay_pruned_and_get_no_update() {
    let mut m = Encoder::new(&config(), 6).unwrap();
    prune_some(&mut m);
    let pruned: Vec<(String, usize)> = m
        .params()
        .iter()
        .filter(|p| p.kind == comera_layers::ParamKind::RankGate)
        .flat_map(|p| {
            let name = p.name.clone();
            p.value
                .iter()
                .enumerate()
                .filter(|(_, &v)| v <= 0.01)
                .map(move |(j, _)| (name.clone(), j))
        })
        .collect();
    assert!(!pruned.is_empty());
    let mut ctl = RankController::new(
        &RankConfig {
            gamma: 0.0,
            ..RankConfig::default()
        },
        &m,
    );
    let mut opt = AdamW::new(AdamWConfig::default(), |f| m.visit_params_mut(f));
    opt.freeze_gates_at = Some(0.01);
    // Momentum pointing upwards for every gate entry, as if the loss wanted them back.
    let mut i = 0;
    m.visit_params_mut(&mut |p| {
        if p.kind == comera_layers::ParamKind::RankGate {
            opt.m[i].fill(-1.0);
            opt.v[i].fill(1.0);
        }
        i += 1;
    });
    let before: Vec<f32> = values(&m, &pruned);
    let mut st = loaded_state(&m);
    for _ in 0..3 {
        train_step(&mut m, &mut st, &mut ctl, &mut opt);
    }
    assert_eq!(values(&m, &pruned), before, "a pruned gate moved");
    assert!(before.iter().all(|&v| !RankGates::default().is_active(v)));
}

fn values(m: &Encoder, which: &[(String, usize)]) -> Vec<f32> {
    which
        .iter()
        .map(|(n, j)| m.params().iter().find(|p| &p.name == n).unwrap().value[*j])
        .collect()
}

#[test]
fn early_stage_adds_gamma_times_the_normalised_size_gradient() {
    let mut m = Encoder::new(&config(), 7).unwrap();
    let gamma = 0.5;
    let mut ctl = RankController::new(
        &RankConfig {
            gamma,
            ..RankConfig::default()
        },
        &m,
    );
    let s_ref = ctl.s_ref;
    assert_eq!(s_ref, rank::sizes(&m).0);
    m.zero_grad();
    let obj = ctl.apply(&mut m, 0.7, 0);
    assert_eq!(obj.branch, Branch::Early);
    // Expected: γ/S_ref · ∂Ŝ/∂d, from each layer's own size gradient.
    let mut expect = m.clone();
    expect.zero_grad();
    expect.visit_compressible_mut(&mut |l| l.accumulate_size_l1_grad((gamma / s_ref) as f32));
    for (p, q) in m.params().iter().zip(expect.params()) {
        assert_eq!(p.grad, q.grad, "{}", p.name);
    }
    // Numerically: Ŝ(d + h·e) − Ŝ(d − h·e) ≈ 2h·∂Ŝ/∂d for one gate entry.
    let name = "encoder.0.ffn.up.gate.2";
    let g = m.params().iter().find(|p| p.name == name).unwrap().grad[1] as f64;
    let shift = |m: &mut Encoder, h: f32| {
        m.visit_params_mut(&mut |p| {
            if p.name == name {
                p.value[1] += h;
            }
        })
    };
    let h = 1e-2;
    shift(&mut m, h);
    let up = rank::sizes(&m).1;
    shift(&mut m, -2.0 * h);
    let down = rank::sizes(&m).1;
    let fd = gamma * (up - down) / (2.0 * h as f64) / s_ref;
    assert!((fd - g).abs() < 1e-4 * fd.abs(), "fd {fd} vs {g}");
}

#[test]
fn a_layer_prefix_confines_the_size_and_its_gradient_to_those_layers() {
    let mut m = Encoder::new(&config(), 7).unwrap();
    let cfg = RankConfig {
        gamma: 0.5,
        layer_prefix: "encoder.".into(),
        late_after_steps: 1,
        target_ratio: None,
        target_compression: Some(4.0),
        ..RankConfig::default()
    };
    cfg.validate().unwrap();
    cfg.check_layers(&m).unwrap();
    let mut ctl = RankController::new(&cfg, &m);
    // S and the dense reference are the encoder blocks' alone.
    let (all, _, all_dense) = rank::sizes(&m);
    let (blocks, _, blocks_dense) = rank::sizes_of(&m, "encoder.");
    assert!(blocks < all && blocks_dense < all_dense);
    assert_eq!((ctl.s_ref, ctl.dense_ref), (blocks, blocks_dense));
    m.zero_grad();
    let obj = ctl.apply(&mut m, 0.7, 0);
    assert_eq!(obj.size, blocks);
    // The size gradient reaches the blocks' gates and not the word table's.
    for p in m.params() {
        if p.kind == comera_layers::ParamKind::RankGate {
            let moved = p.grad.iter().any(|&g| g != 0.0);
            assert_eq!(moved, p.name.starts_with("encoder."), "{}", p.name);
        }
    }
    // The late stage's target: the blocks' dense parameters over target_compression.
    let mut opt = comera_optim::Optimizer::new(AdamWConfig::default(), None, &mut m);
    ctl.after_step(&mut m, &mut opt, 1, 1, false);
    assert_eq!(ctl.stage, Stage::Late);
    assert_eq!(ctl.target_size, Some(blocks_dense / 4.0));
    // A prefix naming no layer is refused by field.
    let none = RankConfig {
        layer_prefix: "decoder.".into(),
        ..RankConfig::default()
    };
    let e = none.check_layers(&m).unwrap_err().to_string();
    assert!(
        e.contains("rank.layer_prefix") && e.contains("embeddings.word"),
        "{e}"
    );
}

#[test]
fn late_stage_switches_by_epochs_and_picks_the_active_branch() {
    let mut m = Encoder::new(&config(), 8).unwrap();
    let cfg = RankConfig {
        late_after_epochs: 2,
        target_ratio: Some(0.5),
        target_loss: 0.5,
        ..RankConfig::default()
    };
    cfg.validate().unwrap();
    let mut ctl = RankController::new(&cfg, &m);
    assert!(!ctl.switch_if_due(&m, 10, 1, true));
    assert!(!ctl.switch_if_due(&m, 15, 2, false));
    assert!(ctl.switch_if_due(&m, 20, 2, true));
    assert_eq!(ctl.stage, Stage::Late);
    let s = rank::sizes(&m).0;
    assert_eq!(ctl.target_size, Some(0.5 * s));
    // (S − S0)/S = 0.5 > (L − L0)/L for L = 0.6: the size branch.
    let obj = ctl.apply(&mut m, 0.6, 0);
    assert_eq!(obj.branch, Branch::Size);
    assert!((obj.w_size - (1.0 + 0.01)).abs() < 1e-12);
    // For L = 5: (5 − 0.5)/5 = 0.9 > 0.5: the loss branch, ω1 = 1/L.
    let obj = ctl.apply(&mut m, 5.0, 0);
    assert_eq!(obj.branch, Branch::Loss);
    assert!((obj.w_loss - (0.2 + 0.1)).abs() < 1e-12);
}

#[test]
fn plateau_switch_and_config_errors() {
    let m = Encoder::new(&config(), 9).unwrap();
    let cfg = RankConfig {
        plateau_steps: 5,
        target_ratio: None,
        target_compression: Some(100.0),
        ..RankConfig::default()
    };
    let mut ctl = RankController::new(&cfg, &m);
    assert!(!ctl.switch_if_due(&m, 1, 1, false));
    assert!(!ctl.switch_if_due(&m, 3, 1, false));
    assert!(
        ctl.switch_if_due(&m, 6, 1, false),
        "S did not move over 5 steps"
    );
    assert_eq!(ctl.target_size, Some(ctl.dense_ref / 100.0));
    // Neither target: the authors' ratio.
    let neither = RankConfig {
        late_after_steps: 1,
        ..RankConfig::default()
    };
    neither.validate().unwrap();
    let mut ctl = RankController::new(&neither, &m);
    assert!(ctl.switch_if_due(&m, 1, 1, false));
    let s = rank::sizes(&m).0;
    assert_eq!(ctl.target_size, Some(rank::DEFAULT_TARGET_RATIO * s));
    let both = RankConfig {
        target_ratio: Some(0.5),
        target_compression: Some(10.0),
        ..RankConfig::default()
    };
    assert!(both
        .validate()
        .unwrap_err()
        .to_string()
        .contains("not both"));
    let bad = RankConfig {
        target_ratio: Some(1.5),
        ..RankConfig::default()
    };
    assert_eq!(bad.validate().unwrap_err().field, "rank.target_ratio");
}

/// With the rank schedule off the model is a plain TT/TTM model: the gates stay at their
/// initial 1 whatever `lr_gates` is, their gradient is dropped before clipping (so it is not
/// part of the gradient norm), and the cores still train.
#[test]
fn without_the_rank_schedule_gates_are_constants() {
    use comera_layers::ParamKind;
    use comera_optim::{Decay, Optimizer, Schedule, Stepper};
    let mut m = Encoder::new(&config(), 8).unwrap();
    let off = RankConfig {
        enabled: false,
        ..RankConfig::default()
    };
    let rank = RankController::new(&off, &m);
    assert!(!rank.active());
    // A gate rate that would move every gate by about 0.5 per step if gates trained.
    let cfg = AdamWConfig {
        lr_gates: 0.5,
        lr_cores: 1e-2,
        ..AdamWConfig::default()
    };
    let optimizer = Optimizer::new(cfg, None, &mut m);
    let schedule = Schedule {
        warmup: 0,
        total: 100,
        decay: Decay::Constant,
    };
    let cores_before: Vec<Vec<f32>> = m
        .params()
        .iter()
        .filter(|p| p.kind == ParamKind::TtCore)
        .map(|p| p.value.clone())
        .collect();
    let mut stepper = Stepper::new(optimizer, rank, schedule, 1.0, 0.01);
    let mut st = loaded_state(&m);
    for step in 0..5 {
        let report = stepper.step(&mut m, &mut st, step).unwrap();
        // The norm clipping saw: every gradient but the gates'.
        let mut sq = 0.0f64;
        for p in m.params() {
            if p.kind == ParamKind::RankGate {
                assert!(
                    p.grad.iter().all(|&g| g == 0.0),
                    "{} has a gradient",
                    p.name
                );
            }
            sq += p.grad.iter().map(|&g| (g as f64) * (g as f64)).sum::<f64>();
        }
        let rel = (report.grad_norm - sq.sqrt()).abs() / sq.sqrt();
        assert!(
            rel < 1e-6,
            "grad norm {} vs {}",
            report.grad_norm,
            sq.sqrt()
        );
    }
    let gates: Vec<&comera_layers::Param> = m
        .params()
        .into_iter()
        .filter(|p| p.kind == ParamKind::RankGate)
        .collect();
    assert!(!gates.is_empty());
    for g in gates {
        assert!(
            g.value.iter().all(|&v| v == 1.0),
            "{} moved: {:?}",
            g.name,
            g.value
        );
    }
    let cores_after: Vec<&comera_layers::Param> = m
        .params()
        .into_iter()
        .filter(|p| p.kind == ParamKind::TtCore)
        .collect();
    assert!(cores_before
        .iter()
        .zip(cores_after)
        .any(|(b, a)| b != &a.value));
}
