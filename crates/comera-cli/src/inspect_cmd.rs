//! `comera inspect PATH`: what a saved model (encoder or DLRM) or a training checkpoint holds —
//! its layers, shapes, ranks, parameter counts, compression, and the training state.

use anyhow::Context;
use comera_train::checkpoint::{self, Checkpoint};
use comera_train::files::{ModelMeta, SavedModel};
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

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    if !a.path.exists() {
        anyhow::bail!("{}: no such file or directory", a.path.display());
    }
    // A run stopped before its first evaluation has checkpoints but no model files yet:
    // show its newest checkpoint (by the step inside the file, as resume ranks them).
    let mut a = a;
    if a.path.is_dir() && !a.path.join(comera_train::files::MODEL_META).exists() {
        if let Some(newest) = checkpoint::list(&a.path)?.pop() {
            println!(
                "run        {} (no model files yet: showing its newest checkpoint)",
                a.path.display()
            );
            a.path = newest;
        }
    }
    let is_checkpoint = a.path.is_file()
        && a.path.extension().is_some_and(|e| e == "safetensors")
        && a.path
            .file_name()
            .is_some_and(|n| n != comera_train::files::MODEL_WEIGHTS);
    let saved = if is_checkpoint {
        let ck = Checkpoint::load(&a.path)?;
        let p = &ck.progress;
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
        ck.saved_model()?
    } else {
        let dir = if a.path.is_dir() {
            a.path.clone()
        } else {
            a.path
                .parent()
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("."))
        };
        println!("model      {}", dir.display());
        comera_train::infer::check_saved_model(&dir)?;
        comera_train::load_saved(&dir)
            .with_context(|| format!("{}: cannot inspect", a.path.display()))?
    };
    match &saved {
        SavedModel::Encoder(m, meta) => describe_encoder(m, meta),
        SavedModel::Dlrm(m, meta) => {
            println!(
                "dlrm       dim {}, bottom MLP {:?}, top MLP {:?}, {} dense features, {} fields",
                m.cfg.embedding_dim,
                m.cfg.bottom_mlp,
                m.cfg.top_mlp,
                m.n_dense,
                m.n_fields()
            );
            for (name, t) in m.field_names.iter().zip(&m.tables) {
                println!("table      {name}: {}", t.describe());
            }
            println!("trained    epoch {}, step {}", meta.epoch, meta.step);
        }
    }
    let model = saved.model();
    let (params, dense) = (model.num_params(), model.dense_equivalent_params());
    println!(
        "parameters {params} ({dense} as a dense model: {:.1}× compression)",
        dense as f64 / params as f64
    );
    let (s, s1, d) = rank::sizes(model);
    if d > 0.0 {
        println!(
            "TT/TTM     S = {s} of {d} dense ({:.1}×), Ŝ = {s1:.1}\n\n{}",
            d / s.max(1.0),
            rank::rank_table(&[("now", &rank::layer_ranks(model))])
        );
    }
    if a.tensors {
        for p in model.params() {
            println!("{:<40} {:?} {:?}", p.name, p.shape, p.kind);
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn describe_encoder(model: &comera_model::Encoder, meta: &ModelMeta) {
    let c = &model.cfg;
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
    let layers = c
        .validate()
        .map_or_else(|e| format!("invalid config: {e}"), |l| l.describe());
    println!("layers     {layers}; gate threshold {}", c.threshold);
    println!(
        "trained    epoch {}, step {}; vocabulary {}{}",
        meta.epoch,
        meta.step,
        meta.vocab.display(),
        if meta.pair { "; sentence pairs" } else { "" }
    );
}
