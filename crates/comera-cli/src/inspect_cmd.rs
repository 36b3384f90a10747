//! `comera inspect PATH`: what a saved model or a training checkpoint holds — its layers,
//! shapes, ranks, parameter counts, compression, and the training state it was saved at.

use anyhow::Context;
use comera_train::checkpoint::{self, Checkpoint};
use comera_train::rank;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A run directory (or its `model.toml` / `model.safetensors`), or a checkpoint file
    /// (`RUN_DIR/checkpoints/step-*.safetensors`).
    path: PathBuf,
    /// Also list every parameter tensor with its shape.
    #[arg(long)]
    tensors: bool,
}

/// A checkpoint: its training state, then the model it holds.
fn checkpoint(a: &Args) -> anyhow::Result<ExitCode> {
    let ck = Checkpoint::load(&a.path)?;
    let model = ck.model()?;
    let p = &ck.progress;
    let (params, dense) = (model.num_params(), model.dense_equivalent_params());
    println!(
        "checkpoint {} (format {}, version {})",
        a.path.display(),
        checkpoint::FORMAT,
        checkpoint::VERSION
    );
    println!(
        "progress   step {}, epoch {} (+{} batches), {:.0} s of training; optimizer {}",
        p.step, p.epoch, p.batch_in_epoch, p.seconds, ck.optimizer
    );
    let r = &ck.rank;
    println!(
        "rank       {}; stage {:?}{}",
        if r.active() { "adaptive" } else { "off" },
        r.stage,
        r.target_size
            .map(|s| format!(", target size {s:.0}"))
            .unwrap_or_default()
    );
    println!(
        "parameters {params} ({dense} as a dense model: {:.1}× compression); {} layers, d_model {}",
        dense as f64 / params as f64,
        model.cfg.layers,
        model.cfg.d_model
    );
    if rank::sizes(&model).2 > 0.0 {
        println!(
            "\n{}",
            rank::rank_table(&[("now", &rank::layer_ranks(&model))])
        );
    }
    if a.tensors {
        for (name, shape) in ck.tensor_shapes() {
            println!("{name:<48} {shape:?}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let is_checkpoint = a.path.is_file()
        && a.path.extension().is_some_and(|e| e == "safetensors")
        && a.path
            .file_name()
            .is_some_and(|n| n != comera_train::files::MODEL_WEIGHTS);
    if is_checkpoint {
        return checkpoint(&a);
    }
    let dir = if a.path.is_dir() {
        a.path.clone()
    } else {
        a.path
            .parent()
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("."))
    };
    let (model, meta) = comera_train::load_model(&dir)
        .with_context(|| format!("{}: cannot inspect", a.path.display()))?;
    let c = &model.cfg;
    let (params, dense) = (model.num_params(), model.dense_equivalent_params());
    println!("model      {}", dir.display());
    println!(
        "encoder    {} layers, d_model {}, {} heads, ffn {}, seq_len {}, vocab {}, {}, {}",
        c.layers,
        c.d_model,
        c.heads,
        c.ffn,
        c.seq_len,
        c.vocab_size,
        match c.head {
            comera_model::HeadKind::Classifier =>
                format!("{} labels ({})", meta.labels.len(), meta.labels.join(", ")),
            comera_model::HeadKind::Mlm => format!(
                "masked-LM head ({} output projection)",
                format!("{:?}", c.mlm_decoder()).to_lowercase()
            ),
        },
        if c.pre_ln { "pre-LN" } else { "post-LN" }
    );
    println!(
        "layers     {} linear, {} word embedding",
        if c.tt_linear { "TT" } else { "dense" },
        if c.ttm_embedding { "TTM" } else { "dense" }
    );
    println!(
        "parameters {params} ({dense} as a dense model: {:.1}× compression)",
        dense as f64 / params as f64
    );
    let (s, s1, d) = rank::sizes(&model);
    if d > 0.0 {
        println!(
            "TT/TTM     S = {s} of {d} dense ({:.1}×), Ŝ = {s1:.1}, threshold {}",
            d / s.max(1.0),
            c.threshold
        );
    }
    println!(
        "trained    epoch {}, step {}; vocabulary {}{}",
        meta.epoch,
        meta.step,
        meta.vocab.display(),
        if meta.pair { "; sentence pairs" } else { "" }
    );
    if d > 0.0 {
        println!(
            "\n{}",
            rank::rank_table(&[("now", &rank::layer_ranks(&model))])
        );
    }
    if a.tensors {
        for p in model.params() {
            println!("{:<40} {:?} {:?}", p.name, p.shape, p.kind);
        }
    }
    Ok(ExitCode::SUCCESS)
}
