//! `comera bench mlm`: masked-LM pre-training steps of one model size as dense, CoMERA with a
//! TT output projection, and CoMERA with a dense output projection — the measurement behind
//! the MLM head's default (`mlm_decoder = "auto"`) and the pre-training speed claim.
//!
//! Every arm runs whole training steps (forward, MLM loss on 15% of the positions, backward,
//! AdamW) on the same synthetic batch in this process; arms alternate round by round and the
//! medians of the per-step times are reported, with ratios to the dense arm.

use crate::harness::{interleave, md_header, md_row, median, plain_stepper, MlmBatch};
use comera_model::{Encoder, EncoderConfig, HeadKind, MlmDecoderKind};
use comera_train::RunConfig;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct MlmArgs {
    /// An MLM run config (`[model] head = "mlm"`): model size, sequence length, batch size.
    #[arg(long)]
    config: PathBuf,
    /// Sequences per step (default: the config's first phase or train.batch_size).
    #[arg(long)]
    batch: Option<usize>,
    /// Timed steps per arm and round (after 1 warm-up step per arm).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Rounds of (dense, comera-tt-decoder, comera-dense-decoder).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Arms to run.
    #[arg(long, value_delimiter = ',', default_values_t = vec!["dense".to_string(), "comera".into(), "comera-dense-decoder".into()])]
    arms: Vec<String>,
}

fn arm_config(base: &EncoderConfig, arm: &str) -> anyhow::Result<EncoderConfig> {
    let mut c = base.clone();
    c.head = HeadKind::Mlm;
    match arm {
        "dense" => {
            c.tt_linear = false;
            c.ttm_embedding = false;
            c.mlm_decoder = MlmDecoderKind::Tied;
        }
        "comera" => {
            c.tt_linear = true;
            c.ttm_embedding = true;
            c.mlm_decoder = MlmDecoderKind::Tt;
        }
        "comera-dense-decoder" => {
            c.tt_linear = true;
            c.ttm_embedding = true;
            c.mlm_decoder = MlmDecoderKind::Dense;
        }
        other => {
            anyhow::bail!("--arms: unknown arm `{other}` (dense, comera, comera-dense-decoder)")
        }
    }
    Ok(c)
}

pub fn run(a: MlmArgs) -> anyhow::Result<ExitCode> {
    let cfg = RunConfig::from_file(&a.config)?;
    let phases = cfg.phases();
    let t = phases[0].seq_len;
    let b = a.batch.unwrap_or(phases[0].batch_size);
    let vocab = cfg.model.vocab_size as u32;
    let rows = (t as f64 * cfg.data.select_prob).ceil() as usize;
    // One synthetic batch: random ordinary ids, `rows` labelled positions per sequence.
    let batch = MlmBatch::random(b, t, rows, vocab, cfg.train.seed);
    let mut models = Vec::new();
    for name in &a.arms {
        let c = arm_config(&cfg.model, name)?;
        let mut model = Encoder::new(&c, cfg.train.seed).map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut st = model
            .state_for(b, t, rows)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        batch.load(&mut st)?;
        let stepper = plain_stepper(cfg.optim.clone(), &mut model);
        models.push((model, st, stepper));
    }
    // One warm-up step per arm (and the one place a failing step reports its error).
    for (model, st, stepper) in &mut models {
        stepper.step(model, st, 0)?;
    }
    let one_call_per_sample = vec![1; models.len()];
    let times = {
        let mut steps: Vec<Box<dyn FnMut() + '_>> = models
            .iter_mut()
            .map(|(model, st, stepper)| {
                Box::new(move || {
                    stepper
                        .step(model, st, 0)
                        .expect("the warm-up step succeeded");
                }) as Box<dyn FnMut()>
            })
            .collect();
        interleave(&mut steps, a.rounds, 0, a.steps, &one_call_per_sample)
    };
    println!(
        "MLM training steps: batch {b} × seq {t}, {rows} predicted positions per sequence, vocab {vocab}; {} threads; {} rounds × {} steps per arm, interleaved",
        rayon::current_num_threads(),
        a.rounds,
        a.steps
    );
    println!();
    let columns = [
        "arm",
        "parameters",
        "median ms/step",
        "tokens/s",
        "vs dense",
    ];
    println!("{}", md_header(&columns, false));
    let medians: Vec<f64> = times.into_iter().map(median).collect();
    let dense_ms = a
        .arms
        .iter()
        .position(|name| name == "dense")
        .map(|i| medians[i]);
    for ((name, (model, _, _)), &ms) in a.arms.iter().zip(&models).zip(&medians) {
        // The dense arm is the reference; a slower arm says "slower", not "0.80× faster".
        let ratio = match dense_ms {
            _ if name == "dense" => "reference".to_string(),
            Some(d) if d >= ms => format!("{:.2}× faster", d / ms),
            Some(d) => format!("{:.2}× slower", ms / d),
            None => "-".to_string(),
        };
        let row = [
            name.clone(),
            model.num_params().to_string(),
            format!("{ms:.1}"),
            format!("{:.0}", (b * t) as f64 / ms * 1e3),
            ratio,
        ];
        println!("{}", md_row(&row));
    }
    Ok(ExitCode::SUCCESS)
}
