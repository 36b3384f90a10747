//! `comera train`, `comera eval`, `comera predict`.

use anyhow::{bail, Context};
use comera_data::BertTokenizer;
use comera_train::{evaluate, load_model, train as run_training, RunConfig};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct TrainArgs {
    /// Run configuration (TOML; every field is documented in configs/reviews-small.toml).
    /// Without it: the built-in small TT/TTM encoder on the review data set.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Overrides of the config's common fields.
    #[arg(long)]
    epochs: Option<usize>,
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long)]
    seed: Option<u64>,
    /// Run directory.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Dense linear layers and embedding instead of TT/TTM.
    #[arg(long)]
    dense: bool,
    /// Stop each epoch after this many steps.
    #[arg(long)]
    max_steps_per_epoch: Option<usize>,
    /// Print the resolved configuration and exit.
    #[arg(long)]
    print_config: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Continue the run in this directory from its newest checkpoint (its own config; other
    /// options are ignored).
    #[arg(long, conflicts_with_all = ["config", "print_config"])]
    resume: Option<PathBuf>,
    /// Stop after this many steps with a checkpoint (resumable).
    #[arg(long)]
    stop_after_steps: Option<u64>,
    /// Start the encoder from a pre-trained run directory (sets `train.init_from`).
    #[arg(long)]
    init_from: Option<PathBuf>,
}

pub fn train(a: TrainArgs) -> anyhow::Result<ExitCode> {
    if let Some(p) = a
        .config
        .as_deref()
        .filter(|p| crate::dlrm_cmd::is_dlrm(p).unwrap_or(false))
    {
        if a.stop_after_steps.is_some() {
            bail!(
                "--stop-after-steps: DLRM runs ({}) have no checkpoints yet",
                p.display()
            );
        }
        if a.init_from.is_some() {
            bail!(
                "--init-from: DLRM runs ({}) have no pre-trained encoder",
                p.display()
            );
        }
        let (epochs, batch_size, seed, out) = (a.epochs, a.batch_size, a.seed, a.out.clone());
        let (dense, max_steps_per_epoch) = (a.dense, a.max_steps_per_epoch);
        let (print_config, quiet) = (a.print_config, a.quiet);
        let o = crate::dlrm_cmd::Overrides {
            epochs,
            batch_size,
            seed,
            out,
            dense,
            max_steps_per_epoch,
            print_config,
            quiet,
        };
        return crate::dlrm_cmd::train(p, o);
    }
    if let Some(dir) = &a.resume {
        let s = comera_train::resume(dir, !a.quiet)?;
        report(&s);
        return Ok(ExitCode::SUCCESS);
    }
    let mut cfg = match &a.config {
        Some(p) => RunConfig::from_file(p)?,
        None => RunConfig::builtin(),
    };
    if !cfg.train.phases.is_empty() && (a.epochs.is_some() || a.batch_size.is_some()) {
        bail!("--epochs / --batch-size: this config has [[train.phases]]; set epochs and batch_size per phase there");
    }
    if let Some(v) = a.epochs {
        cfg.train.epochs = v;
    }
    if let Some(v) = a.batch_size {
        cfg.train.batch_size = v;
    }
    if let Some(v) = a.seed {
        cfg.train.seed = v;
    }
    if let Some(v) = a.out {
        cfg.train.out_dir = v;
    }
    if let Some(v) = a.max_steps_per_epoch {
        cfg.train.max_steps_per_epoch = v;
    }
    if let Some(v) = a.stop_after_steps {
        cfg.train.stop_after_steps = v;
    }
    if let Some(v) = a.init_from {
        cfg.train.init_from = Some(v);
    }
    if a.dense {
        cfg.model.tt_linear = false;
        cfg.model.ttm_embedding = false;
    }
    cfg.validate().map_err(anyhow::Error::msg)?;
    if a.print_config {
        print!("{}", cfg.to_toml());
        return Ok(ExitCode::SUCCESS);
    }
    let s = run_training(&cfg, !a.quiet)?;
    report(&s);
    Ok(ExitCode::SUCCESS)
}

/// The last lines of a training run.
fn report(s: &comera_train::TrainSummary) {
    if s.stopped {
        println!(
            "stopped after {} steps; resume with: comera train --resume {}",
            s.steps,
            s.out_dir.display()
        );
        return;
    }
    if let Ok(table) = std::fs::read_to_string(s.out_dir.join("ranks.md")) {
        println!("{table}");
    }
    let v = &s.final_valid;
    let result = match s.majority_accuracy {
        Some(m) => format!(
            "validation accuracy {:.4} (majority class {m:.4}), loss {:.4}",
            v.accuracy, v.loss
        ),
        None => format!(
            "held-out MLM loss {:.4} (perplexity {:.1}), masked-token accuracy {:.4} over {} predicted tokens; {} tokens trained",
            v.loss,
            v.loss.exp(),
            v.accuracy,
            v.examples,
            s.tokens
        ),
    };
    println!(
        "done: {} epochs, {} steps in {:.0} s; {result}; {} parameters ({:.1}x compression vs dense {}); run directory {}",
        s.epochs,
        s.steps,
        s.seconds,
        s.params,
        s.compression(),
        s.dense_params,
        s.out_dir.display()
    );
}

#[derive(clap::Args)]
pub struct EvalArgs {
    /// Run directory holding model.safetensors, model.toml and config.toml.
    model: PathBuf,
    /// Sequences per forward pass.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
}

pub fn eval(a: EvalArgs) -> anyhow::Result<ExitCode> {
    let (model, meta) = load_model(&a.model)?;
    let cfg_path = a.model.join("config.toml");
    let cfg = RunConfig::from_file(&cfg_path)
        .with_context(|| "eval reads the run's data settings from its config.toml")?;
    if cfg.data.source == "corpus" {
        let mut data = comera_train::data::CorpusData::new(&cfg.data, cfg.train.seed)?;
        let t = meta.model.seq_len;
        data.packed(t)?;
        let blocks = &data.packed_ref(t).valid;
        let rows = data.masker.max_selected_per_row(t);
        let mut st = model
            .state_for(a.batch_size, t, rows)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let s = comera_train::trainer::evaluate_mlm(&model, &mut st, &data, blocks)?;
        println!(
            "{}: {} held-out tokens predicted, MLM loss {:.4}, perplexity {:.2}, masked-token accuracy {:.4}",
            a.model.display(),
            s.examples,
            s.loss,
            s.loss.exp(),
            s.accuracy
        );
        return Ok(ExitCode::SUCCESS);
    }
    let data = comera_train::data::prepare(&cfg.data, meta.model.seq_len, cfg.train.seed)?;
    let mut st = model.state(a.batch_size);
    let s = evaluate(&model, &mut st, &data.valid)?;
    println!(
        "{}: {} examples, accuracy {:.4}, loss {:.4}",
        a.model.display(),
        s.examples,
        s.accuracy,
        s.loss
    );
    Ok(ExitCode::SUCCESS)
}

#[derive(clap::Args)]
pub struct PredictArgs {
    /// Run directory holding model.safetensors and model.toml.
    model: PathBuf,
    /// Texts to classify (one per argument); with none, lines are read from standard input.
    /// For sentence-pair models separate the two texts with a tab.
    texts: Vec<String>,
}

pub fn predict(a: PredictArgs) -> anyhow::Result<ExitCode> {
    let (model, meta) = load_model(&a.model)?;
    if meta.model.head != comera_model::HeadKind::Classifier {
        bail!(
            "{}: a masked-LM (pre-trained) model has no labels to predict; fine-tune it with train.init_from = \"{}\"",
            a.model.display(),
            a.model.display()
        );
    }
    let tok = BertTokenizer::from_vocab_file(&meta.vocab)
        .with_context(|| format!("vocabulary {}", meta.vocab.display()))?;
    let texts: Vec<String> = if a.texts.is_empty() {
        std::io::stdin().lines().collect::<Result<_, _>>()?
    } else {
        a.texts
    };
    let t = meta.model.seq_len;
    let mut st = model.state(1);
    for text in texts {
        let enc = if meta.pair {
            let Some((x, y)) = text.split_once('\t') else {
                bail!("this model reads sentence pairs: separate the two texts with a tab")
            };
            tok.encode_pair(x, y, t)?
        } else {
            tok.encode_single(&text, t)?
        };
        st.load(
            &enc.input_ids,
            &enc.token_type_ids,
            &enc.attention_mask,
            &[0],
        )
        .map_err(anyhow::Error::msg)?;
        model.forward(&mut st, false, 0)?;
        let logits = st.logits();
        let label = comera_layers::loss::argmax(logits);
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let z: f32 = logits.iter().map(|&v| (v - max).exp()).sum();
        println!(
            "{}\t{:.3}\t{}",
            meta.labels[label],
            (logits[label] - max).exp() / z,
            text
        );
    }
    Ok(ExitCode::SUCCESS)
}
