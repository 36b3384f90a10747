//! `comera bench mlm`: masked-LM pre-training steps of one model size as dense, CoMERA with a
//! TT output projection, and CoMERA with a dense output projection — the measurement behind
//! the MLM head's default (`mlm_decoder = "auto"`) and the pre-training speed claim.
//!
//! Every arm runs whole training steps (forward, MLM loss on 15% of the positions, backward,
//! AdamW) on the same synthetic batch in this process; arms alternate round by round and the
//! medians of the per-step times are reported, with ratios to the dense arm.

use crate::harness::median;
use comera_model::{Encoder, EncoderConfig, HeadKind, MlmDecoderKind};
use comera_optim::AdamW;
use comera_train::RunConfig;
use rand::seq::SliceRandom;
use rand::Rng;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

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

struct Arm {
    name: String,
    model: Encoder,
    st: comera_model::EncoderState,
    opt: AdamW,
    times: Vec<f64>,
}

pub fn run(a: MlmArgs) -> anyhow::Result<ExitCode> {
    let cfg = RunConfig::from_file(&a.config)?;
    let phases = cfg.phases();
    let t = phases[0].seq_len;
    let b = a.batch.unwrap_or(phases[0].batch_size);
    let vocab = cfg.model.vocab_size as u32;
    let rows = (t as f64 * cfg.data.select_prob).ceil() as usize;
    // One synthetic batch: random ordinary ids, `rows` labelled positions per sequence.
    let mut rng = comera_tensor::init::rng(cfg.train.seed);
    let ids: Vec<u32> = (0..b * t).map(|_| rng.random_range(1000..vocab)).collect();
    let mask = vec![1u32; b * t];
    let mut labels = vec![-100i32; b * t];
    let mut selected = Vec::new();
    for r in 0..b {
        let mut pos: Vec<usize> = (1..t - 1).collect();
        pos.shuffle(&mut rng);
        let mut pos = pos[..rows.min(t - 2)].to_vec();
        pos.sort_unstable();
        for p in pos {
            let i = r * t + p;
            labels[i] = ids[i] as i32;
            selected.push(i as u32);
        }
    }
    let mut arms = Vec::new();
    for name in &a.arms {
        let c = arm_config(&cfg.model, name)?;
        let mut model = Encoder::new(&c, cfg.train.seed).map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut st = model
            .state_for(b, t, rows)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        st.load_mlm(&ids, &mask, &labels, &selected)
            .map_err(anyhow::Error::msg)?;
        let opt = AdamW::new(cfg.optim.clone(), |f| model.visit_params_mut(f));
        arms.push(Arm {
            name: name.clone(),
            model,
            st,
            opt,
            times: Vec::new(),
        });
    }
    let step = |arm: &mut Arm| -> anyhow::Result<f64> {
        let t0 = Instant::now();
        arm.model.zero_grad();
        arm.model.forward(&mut arm.st, true, 0)?;
        arm.model.backward(&mut arm.st);
        arm.opt.step(1.0, 1.0, |f| arm.model.visit_params_mut(f));
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    };
    for arm in &mut arms {
        step(arm)?;
    }
    for _ in 0..a.rounds {
        for arm in &mut arms {
            for _ in 0..a.steps {
                let ms = step(arm)?;
                arm.times.push(ms);
            }
        }
    }
    println!(
        "MLM training steps: batch {b} × seq {t}, {rows} predicted positions per sequence, vocab {vocab}; {} threads; {} rounds × {} steps per arm, interleaved",
        rayon::current_num_threads(),
        a.rounds,
        a.steps
    );
    println!();
    println!("| arm | parameters | median ms/step | tokens/s | vs dense |");
    println!("|---|---|---|---|---|");
    let dense_ms = arms
        .iter()
        .find(|x| x.name == "dense")
        .map(|x| median(x.times.clone()));
    for arm in &arms {
        let ms = median(arm.times.clone());
        let ratio = dense_ms.map_or("-".to_string(), |d| format!("{:.2}× faster", d / ms));
        println!(
            "| {} | {} | {ms:.1} | {:.0} | {ratio} |",
            arm.name,
            arm.model.num_params(),
            (b * t) as f64 / ms * 1e3
        );
    }
    Ok(ExitCode::SUCCESS)
}
