//! `comera bench rank RUN_DIR`: training-step time of a rank-adaptive run's model as it was
//! at the start (initial ranks) and as it ended (truncated ranks), side by side in one run.
//! `comera bench rank --paper-model --truncate-to 15`: the same for the paper's encoder
//! (6 layers, 768/12/3072, TT rank 30, TTM rank 32) and a copy truncated to rank 15 (every
//! gate past the first 15 of a bond pruned, then the slices removed as training does), with
//! each model's counted FLOPs per step, so one sees whether the step shrinks with its work.

use crate::harness::{gflops, interleaved_medians, md_header, md_row, plain_stepper, ClassBatch};
use crate::step::step_flops;
use anyhow::Context;
use comera_layers::ParamKind;
use comera_model::Encoder;
use comera_model::EncoderConfig;
use comera_optim::AdamWConfig;
use comera_train::rank;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct RankArgs {
    /// A run directory with `model.safetensors` + `model.toml` (from `comera train`).
    #[arg(
        required_unless_present = "paper_model",
        conflicts_with = "paper_model"
    )]
    run: Option<PathBuf>,
    /// Instead of a run: the paper's encoder at its initial ranks vs truncated to
    /// --truncate-to.
    #[arg(long)]
    paper_model: bool,
    /// The rank every TT/TTM bond of the paper model is truncated to.
    #[arg(long, default_value_t = 15, requires = "paper_model")]
    truncate_to: usize,
    /// Sequences per step (default: 32).
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Seconds to spend measuring: interleaved rounds (at least 7), in each of which every
    /// model makes one untimed step and then `STEPS_PER_VISIT` timed ones.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
}

/// Timed steps of a model in a row, after one untimed step (see `interleaved_medians`).
const STEPS_PER_VISIT: usize = 4;

/// The one training step (forward, loss, backward, AdamW) of `model` on a fixed batch.
fn train_step(model: &mut Encoder, batch: usize) -> anyhow::Result<Box<dyn FnMut() + '_>> {
    let mut st = model.state(batch);
    ClassBatch::strided(&model.cfg, batch).load(&mut st)?;
    let mut stepper = plain_stepper(AdamWConfig::default(), model);
    Ok(Box::new(move || {
        stepper
            .step(model, &mut st, 0)
            .expect("ids below vocab_size");
    }))
}

/// The paper's encoder, and a copy whose bonds keep only their first `to` rank slices: the
/// gates past them pruned (set to 0, at or below any threshold), then truncated as training
/// truncates.
fn paper_models(to: usize) -> anyhow::Result<(Encoder, Encoder)> {
    anyhow::ensure!(to >= 1, "--truncate-to must be at least 1");
    let cfg = EncoderConfig::default();
    let initial = Encoder::new(&cfg, 0).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut trained = initial.clone();
    trained.visit_params_mut(&mut |p| {
        if p.kind == ParamKind::RankGate {
            for g in p.value.iter_mut().skip(to) {
                *g = 0.0;
            }
        }
    });
    rank::truncate(&mut trained);
    Ok((initial, trained))
}

pub fn run(a: RankArgs) -> anyhow::Result<ExitCode> {
    let (mut initial, mut trained, source) = match &a.run {
        Some(dir) => {
            let (mut trained, meta) = comera_train::load_model(dir)
                .with_context(|| format!("{}: not a model directory", dir.display()))?;
            // Removes slices still pruned at the save and marks dead layers (as training
            // would next).
            rank::truncate(&mut trained);
            let initial = Encoder::new(&meta.model, 0).map_err(|e| anyhow::anyhow!("{e}"))?;
            (initial, trained, dir.display().to_string())
        }
        None => {
            let (initial, trained) = paper_models(a.truncate_to)?;
            (
                initial,
                trained,
                format!("the paper's encoder, truncated to rank {}", a.truncate_to),
            )
        }
    };
    let seq_len = initial.cfg.seq_len;
    let flops = [step_flops(&initial, a.batch), step_flops(&trained, a.batch)];
    let dense = initial.dense_equivalent_params() as f64;
    let rows = [
        (
            "initial ranks",
            initial.num_params(),
            rank::sizes(&initial).0,
        ),
        ("truncated", trained.num_params(), rank::sizes(&trained).0),
    ];
    let ms = {
        let mut variants = vec![
            train_step(&mut initial, a.batch)?,
            train_step(&mut trained, a.batch)?,
        ];
        interleaved_medians(&mut variants, a.seconds, STEPS_PER_VISIT)
    };
    let tokens = (a.batch * seq_len) as f64;
    println!(
        "training step (forward+loss, backward, AdamW), batch {} × seq {}, {} threads; model from {}; \
         interleaved rounds of 1 untimed + {STEPS_PER_VISIT} timed steps per model",
        a.batch,
        seq_len,
        rayon::current_num_threads(),
        source
    );
    let columns = [
        "model",
        "params",
        "compression vs dense",
        "TT/TTM size S",
        "median ms/step",
        "tokens/s",
        "GFLOP/step",
        "GFLOP/s",
    ];
    println!("{}", md_header(&columns, false));
    for (((name, params, size), ms), fl) in rows.iter().zip(&ms).zip(&flops) {
        let row = [
            name.to_string(),
            params.to_string(),
            format!("{:.1}×", dense / *params as f64),
            size.to_string(),
            format!("{ms:.2}"),
            format!("{:.0}", tokens / ms * 1e3),
            format!("{:.2}", fl / 1e9),
            format!("{:.1}", gflops(*fl, *ms)),
        ];
        println!("{}", md_row(&row));
    }
    println!(
        "\nstep-time ratio initial / truncated: {:.2}× (counted FLOPs ratio {:.2}×)",
        ms[0] / ms[1],
        flops[0] / flops[1]
    );
    let table = rank::rank_table(&[
        ("initial", &rank::layer_ranks(&initial)),
        ("truncated", &rank::layer_ranks(&trained)),
    ]);
    println!("\n{table}");
    Ok(ExitCode::SUCCESS)
}
