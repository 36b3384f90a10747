//! The one training step ([`Stepper::step`]) on a DLRM with TTM tables under a strong size
//! penalty: pruned gate entries stay pruned (momentum cannot revive them), `min_rank` keeps
//! every bond alive, and truncation then removes exactly the pruned slices.

use comera_data::ctr::CtrBatch;
use comera_dlrm::{Dlrm, DlrmConfig, DlrmState, TableKind};
use comera_layers::{Model, ParamKind};
use comera_optim::rank::{self, RankConfig, RankController};
use comera_optim::{AdamWConfig, Decay, Optimizer, Schedule, Stepper};

const TAU: f32 = 0.01;

fn model() -> Dlrm {
    let cfg = DlrmConfig {
        embedding_dim: 4,
        bottom_mlp: vec![6],
        top_mlp: vec![8],
        tables: TableKind::Ttm,
        ttm_threshold: 0,
        ttm_cores: 2,
        ttm_rank: 4,
        gate_threshold: TAU,
        embedding_std: 0.5,
    };
    let names: Vec<String> = ["a", "b"].iter().map(|s| s.to_string()).collect();
    Dlrm::new(&cfg, 3, &names, &[30, 40], 7).unwrap()
}

fn loaded(m: &Dlrm) -> DlrmState {
    let mut b = CtrBatch::new(6, 3, 2);
    for (i, v) in b.dense.iter_mut().enumerate() {
        *v = ((i * 7 % 11) as f32) / 5.0 - 0.8;
    }
    b.cats
        .copy_from_slice(&[0, 1, 29, 13, 2, 3, 39, 0, 13, 13, 7, 21]);
    b.labels.copy_from_slice(&[1.0, 0.0, 1.0, 0.0, 0.0, 1.0]);
    let mut st = m.state(6);
    st.load(&b).unwrap();
    st
}

/// Every gate entry of the model, in visiting order.
fn gates(m: &mut Dlrm) -> Vec<f32> {
    let mut g = Vec::new();
    m.visit_params_mut(&mut |p| {
        if p.kind == ParamKind::RankGate {
            g.extend_from_slice(&p.value);
        }
    });
    g
}

#[test]
fn pruned_gates_stay_pruned_and_min_rank_keeps_every_bond_alive() {
    let mut m = model();
    let mut st = loaded(&m);
    let rcfg = RankConfig {
        gamma: 50.0,
        min_rank: 1,
        // Without normalisation the penalty shrinks whole bonds: min_rank must step in.
        normalise_gates: false,
        ..RankConfig::default()
    };
    let cfg = AdamWConfig {
        lr_gates: 0.1,
        ..AdamWConfig::default()
    };
    let optimizer = Optimizer::new(cfg, None, &mut m);
    let schedule = Schedule {
        warmup: 0,
        total: 1000,
        decay: Decay::Constant,
    };
    let rank = RankController::new(&rcfg, &m);
    assert!(rank.active());
    let mut stepper = Stepper::new(optimizer, rank, schedule, 10.0, TAU);
    let mut pruned_at: Vec<Option<usize>> = vec![None; gates(&mut m).len()];
    for step in 0..60 {
        stepper.step(&mut m, &mut st, step).unwrap();
        for (i, &g) in gates(&mut m).iter().enumerate() {
            match pruned_at[i] {
                // The only way back is min_rank's projection, which sets the entry to 2τ when
                // its bond would otherwise fall below min_rank active entries.
                Some(at) if g > TAU => {
                    assert_eq!(
                        g,
                        2.0 * TAU,
                        "gate entry {i} pruned at step {at} revived to {g} at step {step}"
                    );
                    pruned_at[i] = None;
                }
                None if g <= TAU => pruned_at[i] = Some(step as usize),
                _ => {}
            }
        }
        for l in rank::layer_ranks(&m) {
            assert!(
                !l.dead && l.ranks.iter().all(|&r| r >= 1),
                "step {step}: {l:?}"
            );
        }
    }
    let pruned = pruned_at.iter().filter(|p| p.is_some()).count();
    assert!(pruned > 0, "the penalty pruned gate entries");
    // Truncation removes exactly the pruned entries; the rest stay above τ.
    let before = gates(&mut m).len();
    assert!(!stepper.truncate(&mut m).is_empty());
    let after = gates(&mut m);
    assert_eq!(after.len(), before - pruned);
    assert!(after.iter().all(|&g| g > TAU), "{after:?}");
    // And the next step runs on the truncated model with the optimiser's cut moments.
    let mut st = loaded(&m);
    stepper.step(&mut m, &mut st, 60).unwrap();
}
