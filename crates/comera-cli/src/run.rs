//! `comera train`, `comera eval`, `comera predict`: argument parsing, then comera-train.

use anyhow::{bail, Context};
use comera_train::config::Setting;
use comera_train::device::check_inference;
use comera_train::infer::{
    eval_run_on, fill_mask, load_run, predict_clicks, predict_probabilities_on, EvalKind,
};
use comera_train::{AnyRunConfig, DeviceSpec, Overrides, SavedModel, TrainSummary};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct TrainArgs {
    /// Run configuration (TOML; every field is documented in configs/reviews-small.toml, or
    /// configs/dlrm-movielens.toml for a DLRM). Without it: the built-in small TT/TTM encoder
    /// on the review data set.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Train on your own file of labelled texts: .csv, .tsv, .jsonl or .parquet, with a text
    /// column (`text` or `sentence`, plus `text_pair` for sentence pairs) and a `label` column
    /// (other names: --set data.text_a=… / data.label=…); the labels are the values found.
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// Validation file for --data (same format); without it, data.valid_fraction (0.1) of the
    /// training rows is held out.
    #[arg(long, value_name = "FILE", requires = "data")]
    valid: Option<PathBuf>,
    /// Set any config field, checked like the file: --set train.epochs=3 --set
    /// model.layers=4 --set data.labels='["neg","pos"]' (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Passes over the training data (train.epochs).
    #[arg(long)]
    epochs: Option<usize>,
    /// Examples per step (train.batch_size; the last partial batch of an epoch is dropped).
    #[arg(long)]
    batch_size: Option<usize>,
    /// Seed of initialisation, data order and dropout (train.seed). Same seed and thread
    /// count, same result bit for bit.
    #[arg(long)]
    seed: Option<u64>,
    /// Run directory (train.out_dir; default runs/latest).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Dense layers and embeddings (tables) instead of TT/TTM.
    #[arg(long)]
    dense: bool,
    /// Stop each epoch after this many steps (train.max_steps_per_epoch).
    #[arg(long)]
    max_steps_per_epoch: Option<usize>,
    /// Print the resolved configuration and exit.
    #[arg(long)]
    print_config: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Continue the run in this directory from its newest checkpoint that verifies (its own
    /// config; other options are refused).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["config", "data", "set", "print_config", "epochs", "batch_size", "seed", "out", "dense", "max_steps_per_epoch", "init_from", "teacher", "overwrite"])]
    resume: Option<PathBuf>,
    /// With --resume: train the run N more epochs (a finished run too); recorded in its
    /// config.toml and run.toml, so it stays resumable. The learning-rate schedule is
    /// stretched over the new length.
    #[arg(long, value_name = "N", requires = "resume")]
    extend_epochs: Option<usize>,
    /// Replace the run in the run directory (its files are removed first). Without it, a
    /// non-empty run directory is refused.
    #[arg(long)]
    overwrite: bool,
    /// Stop with a checkpoint once the run has done this many steps (resumable; with
    /// --resume too, to run a long job in sittings).
    #[arg(long)]
    stop_after_steps: Option<u64>,
    /// Start the encoder from a pre-trained run directory (sets `train.init_from`).
    #[arg(long, value_name = "DIR")]
    init_from: Option<PathBuf>,
    /// Distil from this teacher, a comera classifier directory of the same labels (sets
    /// `distill.teacher`; the loss's weights, temperature and layer map are the `[distill]`
    /// table's, or `--set distill.temperature=4`, …).
    #[arg(long, value_name = "DIR")]
    teacher: Option<PathBuf>,
    /// Train on this device: `cpu`, `cuda` (the first GPU) or `cuda:N` (sets `train.device`;
    /// with --resume, where the run goes on: a run moves between devices through its
    /// checkpoints). docs/gpu.md says what trains on a GPU yet.
    #[arg(long, value_name = "DEVICE")]
    device: Option<comera_train::DeviceSpec>,
}

pub fn train(a: TrainArgs) -> anyhow::Result<ExitCode> {
    // A graceful stop on the first SIGINT/SIGTERM (checkpoint after the step; a second signal
    // ends at once). Not under MPI: every process must stop at the same step, and mpirun
    // delivers a signal to each at its own moment.
    if comera_train::distributed::processes().1 == 1 {
        comera_train::interrupt::install()
            .map_err(|e| anyhow::anyhow!("cannot install the SIGINT/SIGTERM handlers: {e}"))?;
    }
    if let Some(dir) = &a.resume {
        let how = comera_train::Continue {
            extend_epochs: a.extend_epochs,
            stop_after_steps: a.stop_after_steps,
            device: a.device,
        };
        return Ok(report(&comera_train::continue_run(
            dir,
            how,
            console(a.quiet),
        )?));
    }
    if a.extend_epochs.is_some() {
        bail!(
            "--extend-epochs: goes with --resume DIR (it trains a stopped or finished run further)"
        );
    }
    let settings = a
        .set
        .iter()
        .map(|s| s.parse::<Setting>())
        .collect::<Result<Vec<_>, _>>()?;
    let cfg = AnyRunConfig::resolve(
        a.config.as_deref(),
        &settings,
        &Overrides {
            epochs: a.epochs,
            batch_size: a.batch_size,
            seed: a.seed,
            out: a.out,
            max_steps_per_epoch: a.max_steps_per_epoch,
            stop_after_steps: a.stop_after_steps,
            init_from: a.init_from,
            dense: a.dense,
            data: a.data,
            valid: a.valid,
            teacher: a.teacher,
            device: a.device,
        },
    )?;
    if a.print_config {
        print!("{}", cfg.to_toml());
        return Ok(ExitCode::SUCCESS);
    }
    let opts = comera_train::RunOptions {
        overwrite: a.overwrite,
        ..console(a.quiet)
    };
    let s = match &cfg {
        AnyRunConfig::Encoder(c) => comera_train::train(c, opts)?,
        AnyRunConfig::Dlrm(c) => comera_train::train_dlrm(c, opts)?,
    };
    Ok(report(&s))
}

/// Run options that show the run on the terminal: messages, and unless `quiet` the progress
/// (only process 0 of a data-parallel run speaks).
fn console(quiet: bool) -> comera_train::RunOptions {
    let mut opts = comera_train::RunOptions::default();
    if comera_train::distributed::is_writer() {
        let console = comera_train::console::Console::new(!quiet);
        opts.observers.push(Box::new(console));
    }
    opts
}

/// The last lines of a training run, and the exit status: 0, or 128 + the signal number
/// (130 for SIGINT, 143 for SIGTERM) for a run stopped by a signal.
fn report(s: &TrainSummary) -> ExitCode {
    let status = match s.interrupted {
        Some(signal) => ExitCode::from((128 + signal).clamp(0, 255) as u8),
        None => ExitCode::SUCCESS,
    };
    // Data-parallel: process 0 speaks for the run.
    if !comera_train::distributed::is_writer() {
        return status;
    }
    if let Some(signal) = s.interrupted {
        println!(
            "stopped by {} after step {} with a checkpoint; resume with: comera train --resume {}",
            comera_train::interrupt::signal_name(signal),
            s.steps,
            s.out_dir.display()
        );
        return status;
    }
    if s.stopped {
        println!(
            "stopped after {} steps; resume with: comera train --resume {}",
            s.steps,
            s.out_dir.display()
        );
        return status;
    }
    if let Ok(table) = std::fs::read_to_string(s.out_dir.join("ranks.md")) {
        println!("{table}");
    }
    let v = &s.final_valid;
    let result = match (v.auc, s.majority_accuracy) {
        (Some(auc), _) => format!(
            "validation AUC {auc:.4} (best {:.4} at epoch {}), log-loss {:.4}, accuracy {:.4} on {} examples",
            s.best_valid, s.best_epoch, v.loss, v.accuracy, v.examples
        ),
        (None, Some(m)) => format!(
            "validation accuracy {:.4} (majority class {m:.4}), loss {:.4}",
            v.accuracy, v.loss
        ),
        (None, None) => format!(
            "held-out MLM loss {:.4} (perplexity {:.1}), masked-token accuracy {:.4} over {} predicted tokens; {} tokens trained",
            v.loss,
            v.loss.exp(),
            v.accuracy,
            v.examples,
            s.tokens
        ),
    };
    // A run of phases names each phase's batch size ("steps of 32, then 16").
    let mut batches: Vec<String> = s.phase_batch_sizes.iter().map(usize::to_string).collect();
    batches.dedup();
    let batches = match batches.len() {
        0 => s.batch_size.to_string(),
        _ => batches.join(", then "),
    };
    println!(
        "done: {} epochs, {} steps of {batches} in {:.0} s; {result}; {} parameters (whole model {:.1}× compression vs dense {}); run directory {}",
        s.epochs,
        s.steps,
        s.seconds,
        s.params,
        s.compression(),
        s.dense_params,
        s.out_dir.display()
    );
    if s.early_stopped {
        println!(
            "stopped early at step {} (train.early_stopping); the best model is in {}",
            s.steps,
            s.out_dir.join(comera_train::trainer::BEST_DIR).display()
        );
    }
    let plots: Vec<String> = ["curves.png", "ranks.png"]
        .iter()
        .map(|f| s.out_dir.join(f))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect();
    if !plots.is_empty() {
        println!("plots: {}", plots.join(", "));
    }
    const MIB: f64 = 1048576.0;
    println!(
        "speed: median step {:.1} ms = {:.0} samples/s; peak RSS {:.1} MiB (parameters+grads {:.1} MiB, optimiser {:.1} MiB, batch state {:.1} MiB); report {}",
        s.median_step_ms,
        s.examples_per_s,
        s.peak_rss_bytes as f64 / MIB,
        s.param_bytes as f64 / MIB,
        s.optimizer_bytes as f64 / MIB,
        s.state_bytes as f64 / MIB,
        s.out_dir.join("report.json").display()
    );
    if let (Some(n), Some(bytes), Some(comm), Some(compute)) = (
        s.extra.get("processes"),
        s.extra.get("allreduce_bytes_per_step"),
        s.extra.get("comm_seconds").and_then(|v| v.as_f64()),
        s.extra.get("compute_seconds").and_then(|v| v.as_f64()),
    ) {
        println!(
            "data-parallel: {n} processes, {bytes} gradient bytes all-reduced per step, steps spent {comm:.2} s in communication and {compute:.2} s in compute"
        );
    }
    status
}

#[derive(clap::Args)]
pub struct EvalArgs {
    /// Run directory holding model.safetensors, model.toml and config.toml.
    model: PathBuf,
    /// Evaluate this checkpoint of the run instead of its model files.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Score this file instead of the run's held-out data: labelled texts (.csv, .tsv, .jsonl,
    /// .parquet, with the run's columns and labels), a Criteo TSV or a MovieLens interaction
    /// file for a DLRM.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Examples per forward pass.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Compute the logits on this device: `cpu` (the default), `cuda` (the first GPU) or
    /// `cuda:N`. On a GPU: a text classifier (post-LN); docs/gpu.md says what runs there.
    #[arg(long, value_name = "DEVICE")]
    device: Option<DeviceSpec>,
}

pub fn eval(a: EvalArgs) -> anyhow::Result<ExitCode> {
    let (kind, s) = eval_run_on(
        &a.model,
        a.checkpoint.as_deref(),
        a.data.as_deref(),
        a.batch_size,
        a.device.unwrap_or(DeviceSpec::Cpu),
    )?;
    let (m, n) = (a.model.display(), s.examples);
    match kind {
        EvalKind::Classifier => {
            println!(
                "{m}: {n} examples, accuracy {:.4}, loss {:.4}",
                s.accuracy, s.loss
            );
            if let Some(c) = &s.classes {
                println!("{}", c.table(s.accuracy));
            }
        }
        EvalKind::MaskedLm => println!(
            "{m}: {n} held-out tokens predicted, MLM loss {:.4}, perplexity {:.2}, masked-token accuracy {:.4}",
            s.loss,
            s.loss.exp(),
            s.accuracy
        ),
        EvalKind::Ctr => println!(
            "{m}: {n} examples, AUC {:.4}, log-loss {:.4}, accuracy {:.4}",
            s.auc.unwrap_or(0.5),
            s.loss,
            s.accuracy
        ),
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(clap::Args)]
pub struct PredictArgs {
    /// Run directory holding model.safetensors and model.toml.
    model: PathBuf,
    /// Inputs, one per argument (with none, lines of standard input): texts to classify
    /// (pairs separated by a tab), texts with [MASK] tokens for a masked-LM model, or for a
    /// DLRM one file of rows in the format it was trained on (Criteo TSV; for MovieLens an
    /// interaction file with `user_id` and `item_id` columns, as ml-100k.inter).
    inputs: Vec<String>,
    /// Labels shown per text, most probable first, each with its probability (classifiers;
    /// default 1), or tokens shown per [MASK] (masked-LM models; default 5).
    #[arg(long)]
    top_k: Option<usize>,
    /// One JSON object per input: a classifier's label, its probability, the top-k labels and
    /// every label's probability (`probabilities`, in the model's label order).
    #[arg(long)]
    json: bool,
    /// Texts per forward pass (classifiers).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Compute the logits on this device: `cpu` (the default), `cuda` (the first GPU) or
    /// `cuda:N`. On a GPU: a text classifier (post-LN); docs/gpu.md says what runs there.
    #[arg(long, value_name = "DEVICE")]
    device: Option<DeviceSpec>,
    /// Write the predictions to this file instead of standard output (the same lines; the
    /// file is written once every prediction is made, and not at all on an error).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

/// Where predictions go: standard output line by line, or all at once into `--out`.
struct Lines<'a> {
    file: Option<(&'a Path, String)>,
}

impl Lines<'_> {
    fn line(&mut self, line: std::fmt::Arguments) {
        match &mut self.file {
            Some((_, text)) => {
                use std::fmt::Write;
                // Writing into a String cannot fail.
                let _ = writeln!(text, "{line}");
            }
            None => println!("{line}"),
        }
    }

    fn finish(self) -> anyhow::Result<()> {
        if let Some((path, text)) = self.file {
            comera_train::write_atomic(path, text.as_bytes())
                .with_context(|| format!("--out {}", path.display()))?;
        }
        Ok(())
    }
}

/// Text as it may be echoed into a line of tab-separated output: control characters (tabs,
/// newlines, terminal escape codes) shown escaped (`\t`, `\u{1b}`), everything else as is.
fn printable(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// The texts to predict: the arguments, or the lines of standard input. Lines that are not
/// UTF-8 and empty texts are reported on stderr by line and left out (returned count), so one
/// bad line does not cost the others their predictions.
fn predict_inputs(args: Vec<String>) -> anyhow::Result<(Vec<String>, usize)> {
    use std::io::BufRead;
    let raw: Vec<Result<String, usize>> = if args.is_empty() {
        let mut lines = Vec::new();
        for (i, line) in std::io::stdin().lock().split(b'\n').enumerate() {
            let mut bytes = line.map_err(|e| anyhow::anyhow!("standard input: {e}"))?;
            if bytes.last() == Some(&b'\r') {
                bytes.pop();
            }
            lines.push(String::from_utf8(bytes).map_err(|_| i + 1));
        }
        lines
    } else {
        args.into_iter().map(Ok).collect()
    };
    let what = |n: usize| {
        if raw.len() > 1 {
            format!("input {n}")
        } else {
            "input".into()
        }
    };
    let mut bad = 0;
    let mut texts = Vec::new();
    for (i, r) in raw.iter().enumerate() {
        match r {
            Err(line) => {
                eprintln!("error: standard input line {line}: not UTF-8 text; skipped");
                bad += 1;
            }
            Ok(t) if t.trim().is_empty() => {
                eprintln!("error: {}: empty text; nothing to predict", what(i + 1));
                bad += 1;
            }
            Ok(t) => texts.push(t.clone()),
        }
    }
    Ok((texts, bad))
}

pub fn predict(a: PredictArgs) -> anyhow::Result<ExitCode> {
    let device = a.device.unwrap_or(DeviceSpec::Cpu);
    if let Some(out) = &a.out {
        // A directory, a device or a symlink is refused before any work.
        comera_train::files::check_write_target(out)
            .with_context(|| format!("--out {}", out.display()))?;
    }
    let (inputs, bad) = predict_inputs(a.inputs)?;
    let mut lines = Lines {
        file: a.out.as_deref().map(|p| (p, String::new())),
    };
    match load_run(&a.model, None)? {
        (SavedModel::Encoder(model, meta), _) if meta.model.head == comera_model::HeadKind::Mlm => {
            anyhow::ensure!(
                !a.json,
                "--json: goes with a classifier (this is a masked-LM model)"
            );
            let k = a.top_k.unwrap_or(5);
            let filled = fill_mask(&model, &meta, &inputs, k, device)?;
            for (text, masks) in inputs.iter().zip(&filled) {
                for (i, top) in masks.iter().enumerate() {
                    let shown: Vec<String> =
                        top.iter().map(|(t, p)| format!("{t} {p:.3}")).collect();
                    lines.line(format_args!(
                        "[MASK] {}\t{}\t{}",
                        i + 1,
                        shown.join("\t"),
                        printable(text)
                    ));
                }
            }
        }
        (SavedModel::Encoder(model, meta), _) => {
            let probs = predict_probabilities_on(&model, &meta, &inputs, a.batch_size, device)?;
            let k = a.top_k.unwrap_or(1).clamp(1, meta.labels.len());
            for (row, text) in probs.chunks_exact(meta.labels.len()).zip(&inputs) {
                let mut order: Vec<usize> = (0..row.len()).collect();
                order.sort_by(|&i, &j| row[j].total_cmp(&row[i]).then(i.cmp(&j)));
                let top = &order[..k];
                if a.json {
                    let line = serde_json::json!({
                        "text": text,
                        "label": meta.labels[top[0]],
                        "probability": row[top[0]],
                        "top": top.iter().map(|&i| (meta.labels[i].as_str(), row[i])).collect::<Vec<_>>(),
                        "probabilities": row,
                        "labels": meta.labels,
                    });
                    lines.line(format_args!("{line}"));
                } else {
                    let shown: Vec<String> = top
                        .iter()
                        .map(|&i| format!("{}\t{:.3}", meta.labels[i], row[i]))
                        .collect();
                    lines.line(format_args!("{}\t{}", shown.join("\t"), printable(text)));
                }
            }
        }
        (SavedModel::Dlrm(model, _), AnyRunConfig::Dlrm(cfg)) => {
            check_inference(device, None)?;
            let [file] = inputs.as_slice() else {
                bail!("a DLRM predicts the rows of one file: give its path (Criteo-format TSV, or for a MovieLens model a `user_id:token<TAB>item_id:token` interaction file)")
            };
            for p in predict_clicks(&model, &cfg.data, std::path::Path::new(file))? {
                lines.line(format_args!("{p:.6}"));
            }
        }
        _ => bail!(
            "{}: model and config.toml are of different kinds",
            a.model.display()
        ),
    }
    lines.finish()?;
    if bad > 0 {
        eprintln!("{bad} input(s) skipped (above)");
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}
