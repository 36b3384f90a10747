//! The parallel parameter visit (`Model::visit_params_par`) that the optimiser's update, the
//! clipping norm and zeroing run over: every parameter once, at its place in the serial order,
//! and the same bits as the serial visit.

use comera_layers::{Model, Param};
use comera_model::{Encoder, EncoderConfig};
use comera_optim::{clip_scale, clip_scale_par, AdamW, AdamWConfig, ParamSums};
use comera_tensor::init;
use std::sync::Mutex;

mod common;

fn encoder() -> Encoder {
    let cfg = EncoderConfig {
        seq_len: 16,
        layers: 3,
        ..common::small_encoder(true)
    };
    Encoder::new(&cfg, 3).unwrap()
}

/// Gradients N(0, 1) drawn in the serial order from `seed`.
fn fill_grads(model: &mut Encoder, seed: u64) {
    let mut rng = init::rng(seed);
    model.visit_params_mut(&mut |p: &mut Param| init::fill_normal(&mut rng, &mut p.grad, 1.0));
}

fn bits(model: &mut Encoder) -> Vec<u32> {
    let mut out = vec![];
    model.visit_params_mut(&mut |p| out.extend(p.value.iter().map(|v| v.to_bits())));
    out
}

#[test]
fn every_parameter_once_at_its_serial_place() {
    let mut model = encoder();
    let mut serial = vec![];
    model.visit_params_mut(&mut |p| serial.push(p.name.clone()));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    let seen = Mutex::new(vec![None; serial.len()]);
    pool.install(|| {
        Model::visit_params_par(&mut model, &|i, p| {
            let mut seen = seen.lock().unwrap();
            assert!(seen[i].is_none(), "index {i} visited twice");
            seen[i] = Some(p.name.clone());
        })
    });
    let seen: Vec<String> = seen.into_inner().unwrap().into_iter().flatten().collect();
    assert_eq!(seen, serial);
}

#[test]
fn adamw_and_clipping_over_the_parallel_visit_give_the_serial_bits() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let (mut a, mut b) = (encoder(), encoder());
    let mut opt_a = AdamW::new(AdamWConfig::default(), |f| a.visit_params_mut(f));
    let mut opt_b = opt_a.clone();
    let mut sums = ParamSums::default();
    for step in 0..3 {
        fill_grads(&mut a, step);
        fill_grads(&mut b, step);
        let (scale_a, norm_a) = clip_scale(1.0, |f| a.visit_params_mut(f));
        opt_a.step(1.0, scale_a, |f| a.visit_params_mut(f));
        pool.install(|| {
            let (scale_b, norm_b) = clip_scale_par(1.0, &mut b, &mut sums);
            assert_eq!(norm_a.to_bits(), norm_b.to_bits(), "step {step}: norm");
            assert_eq!(scale_a.to_bits(), scale_b.to_bits(), "step {step}: scale");
            opt_b.step_par(1.0, scale_b, &mut b);
        });
        assert!(
            bits(&mut a) == bits(&mut b),
            "step {step}: parameters differ"
        );
        assert!(norm_a > 1.0, "the gradients are clipped (norm {norm_a})");
    }
}

#[test]
#[should_panic(expected = "beyond the optimiser state")]
fn a_model_with_other_parameters_than_the_state_is_refused() {
    let mut small = encoder();
    let mut opt = AdamW::new(AdamWConfig::default(), |f| small.visit_params_mut(f));
    opt.m.pop();
    opt.v.pop();
    opt.step_par(1.0, 1.0, &mut small);
}
