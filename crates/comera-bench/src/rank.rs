//! `comera bench rank RUN_DIR`: training-step time of a rank-adaptive run's model as it was
//! at the start (initial ranks) and as it ended (truncated ranks), side by side in one run.

use crate::harness::{interleaved_medians, md_header, md_row, plain_stepper, ClassBatch};
use anyhow::Context;
use comera_model::Encoder;
use comera_optim::AdamWConfig;
use comera_train::rank;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct RankArgs {
    /// A run directory with `model.safetensors` + `model.toml` (from `comera train`).
    run: PathBuf,
    /// Sequences per step (default: 32).
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Seconds to spend measuring (interleaved rounds, at least 7 each).
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
}

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

pub fn run(a: RankArgs) -> anyhow::Result<ExitCode> {
    let (mut trained, meta) = comera_train::load_model(&a.run)
        .with_context(|| format!("{}: not a model directory", a.run.display()))?;
    // Removes slices still pruned at the save and marks dead layers (as training would next).
    rank::truncate(&mut trained);
    let mut initial = Encoder::new(&meta.model, 0).map_err(|e| anyhow::anyhow!("{e}"))?;
    let dense = initial.dense_equivalent_params() as f64;
    let rows = [
        (
            "initial ranks",
            initial.num_params(),
            rank::sizes(&initial).0,
        ),
        (
            "truncated (end of run)",
            trained.num_params(),
            rank::sizes(&trained).0,
        ),
    ];
    let ms = {
        let mut variants = vec![
            train_step(&mut initial, a.batch)?,
            train_step(&mut trained, a.batch)?,
        ];
        interleaved_medians(&mut variants, a.seconds)
    };
    let tokens = (a.batch * meta.model.seq_len) as f64;
    println!(
        "training step (forward+loss, backward, AdamW), batch {} × seq {}, {} threads; model from {}",
        a.batch,
        meta.model.seq_len,
        rayon::current_num_threads(),
        a.run.display()
    );
    let columns = [
        "model",
        "params",
        "compression vs dense",
        "TT/TTM size S",
        "median ms/step",
        "tokens/s",
    ];
    println!("{}", md_header(&columns, false));
    for ((name, params, size), ms) in rows.iter().zip(&ms) {
        let row = [
            name.to_string(),
            params.to_string(),
            format!("{:.1}×", dense / *params as f64),
            size.to_string(),
            format!("{ms:.2}"),
            format!("{:.0}", tokens / ms * 1e3),
        ];
        println!("{}", md_row(&row));
    }
    println!(
        "\nstep-time ratio initial / truncated: {:.2}×",
        ms[0] / ms[1]
    );
    let table = rank::rank_table(&[
        ("initial", &rank::layer_ranks(&initial)),
        ("truncated", &rank::layer_ranks(&trained)),
    ]);
    println!("\n{table}");
    Ok(ExitCode::SUCCESS)
}
