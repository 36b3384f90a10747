//! What `comera import` and `comera export` do (the CLI only parses arguments): load a model,
//! check it, compress it by TT-SVD with a report per layer, write it.

use crate::compress::summarise;
use crate::hf::{self, ModelInfo, ReadOptions};
use crate::minilm::{self, CheckReport, Reference};
use crate::{compress, export_compressed, export_dense, load_bert, CompressOptions, LayerReport};
use anyhow::{bail, ensure, Context};
use comera_model::{Encoder, HeadKind, MlmDecoderKind};
use comera_tensor::ttsvd::{Absorb, TtSvdOptions};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Where the model comes from.
pub enum Source {
    /// all-MiniLM-L6-v2 (fetched into this cache directory), checked against the built-in
    /// reference.
    Minilm(PathBuf),
    /// A Hugging Face directory or `.zip` of one, or a single `.safetensors` file.
    Hf(PathBuf),
}

/// Options of [`import`] (see `comera import --help`).
#[derive(Clone, Debug, Default)]
pub struct ImportOptions {
    pub check: bool,
    pub reference: Option<PathBuf>,
    pub tt: bool,
    pub rank: Vec<usize>,
    pub tol: Option<f64>,
    pub dense_embedding: bool,
    pub uniform_ranks: bool,
    pub left: bool,
    pub seq_len: Option<usize>,
    pub num_labels: Option<usize>,
    pub seed: u64,
    pub json: bool,
    /// Run directory to write the (last) model into.
    pub out: Option<PathBuf>,
    /// Run config whose data, optimiser and training settings the run directory gets.
    pub config: Option<PathBuf>,
    /// Replace the comera run in `out` (the rules of `train --overwrite`).
    pub overwrite: bool,
}

/// `comera import`: returns false when `--check` failed.
pub fn import(src: Source, o: &ImportOptions) -> anyhow::Result<bool> {
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

/// The files `comera export --hf` writes: a directory holding these and nothing else (with a
/// `config.json` that names `comera_sentence_pair`) is an earlier export that `--overwrite`
/// may replace.
const HF_EXPORT_FILES: &[&str] = &[
    "config.json",
    "model.safetensors",
    "vocab.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "comera_check.safetensors",
];

/// Refuses an `export --hf` target that is not absent, empty, or (with `overwrite`) an earlier
/// comera export: a run directory is never an export target, and a folder of the user's is
/// never replaced.
fn check_hf_target(dir: &Path, src: &Path, overwrite: bool) -> anyhow::Result<()> {
    let Ok(meta) = std::fs::symlink_metadata(dir) else {
        return Ok(());
    };
    if !meta.is_dir() {
        bail!(
            "--hf: {} is {}, not a directory; name a new directory",
            dir.display(),
            comera_data::regular::file_kind(&meta)
        );
    }
    let same = |a: &Path, b: &Path| matches!((a.canonicalize(), b.canonicalize()), (Ok(a), Ok(b)) if a == b);
    if same(dir, src) || dir.join(comera_train::run_dir::IDENTITY).exists() {
        bail!(
            "--hf: {} is a comera run directory; export into a directory of its own",
            dir.display()
        );
    }
    let names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("{}: cannot list", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if names.is_empty() {
        return Ok(());
    }
    if !overwrite {
        bail!(
            "--hf: {} is not empty ({}); add --overwrite to replace an earlier comera export, or name a new directory",
            dir.display(),
            names.join(", ")
        );
    }
    let is_export = names.iter().all(|n| HF_EXPORT_FILES.contains(&n.as_str()))
        && comera_data::read_regular_to_string(&dir.join("config.json"))
            .is_ok_and(|t| t.contains("\"comera_sentence_pair\""));
    if !is_export {
        bail!(
            "--hf: --overwrite refused: {} is not an earlier comera export (it holds {}); nothing was removed",
            dir.display(),
            names.join(", ")
        );
    }
    Ok(())
}

/// Loads any model source `export` accepts: a run directory (with its meta), a compressed
/// export, or a BERT checkpoint.
pub fn load_any(src: &Path) -> anyhow::Result<(Encoder, Option<comera_train::ModelMeta>)> {
    if src.is_dir() {
        let (m, meta) = comera_train::load_model(src)?;
        return Ok((m, Some(meta)));
    }
    let bytes = std::fs::read(src).with_context(|| format!("{}: cannot read", src.display()))?;
    if crate::export::format_of(&bytes).is_some_and(|f| f == "compressed") {
        Ok((
            crate::load_compressed(&bytes, &src.display().to_string())?,
            None,
        ))
    } else {
        Ok((load_bert(src, None, None, 0)?.0, None))
    }
}

/// `comera export`.
pub fn export(
    src: &Path,
    dense: Option<&Path>,
    compressed: Option<&Path>,
    hf_dir: Option<&Path>,
    samples: usize,
    overwrite: bool,
) -> anyhow::Result<()> {
    ensure!(
        dense.is_some() || compressed.is_some() || hf_dir.is_some(),
        "nothing to write: give --dense FILE, --compressed FILE and/or --hf DIR"
    );
    ensure!(
        samples == 0 || hf_dir.is_some(),
        "--samples: goes with --hf DIR"
    );
    if let Some(dir) = hf_dir {
        check_hf_target(dir, src, overwrite)?;
    }
    let (m, meta) = load_any(src)?;
    println!(
        "{}: {} parameters (dense equivalent {})",
        src.display(),
        m.num_params(),
        m.dense_equivalent_params()
    );
    if let Some(p) = dense {
        comera_train::write_atomic(p, &export_dense(&m)?)?;
        println!(
            "wrote {} (dense export, Hugging Face BERT names)",
            p.display()
        );
    }
    if let Some(p) = compressed {
        comera_train::write_atomic(p, &export_compressed(&m)?)?;
        println!("wrote {} (compressed export)", p.display());
    }
    if let Some(dir) = hf_dir {
        let meta = meta.ok_or_else(|| {
            anyhow::anyhow!(
                "--hf: {} is not a run directory; the label names and vocabulary come from a run's model.toml",
                src.display()
            )
        })?;
        let vocab = comera_data::read_regular_to_string(&meta.vocab)
            .with_context(|| format!("vocabulary {}", meta.vocab.display()))?;
        let info = ModelInfo {
            labels: meta.labels.clone(),
            vocab,
            pair: meta.pair,
        };
        // The whole directory is written beside the target and swapped in at once.
        let mut checked = 0;
        let mut out = None;
        comera_train::files::replace_dir_atomic(dir, |tmp| {
            out = Some(hf::export_hf(&m, &info, tmp)?);
            if samples > 0 {
                let (ids, types, mask, pos) = hf::validation_inputs(src, &m, samples)?;
                let bytes = hf::check_file(&m, &ids, &types, &mask, pos.as_deref())?;
                comera_train::write_atomic(&tmp.join("comera_check.safetensors"), &bytes)?;
                checked = ids.len() / m.cfg.seq_len;
            }
            Ok::<(), anyhow::Error>(())
        })?;
        let out = out.expect("written by the closure");
        println!(
            "wrote {} ({}: {}); load it with {}.from_pretrained(\"{0}\") and AutoTokenizer",
            dir.display(),
            out.architecture,
            out.files.join(", "),
            out.architecture
        );
        for n in &out.notes {
            println!("  note: {n}");
        }
        if samples > 0 {
            println!(
                "wrote {} ({checked} validation inputs and comera's logits on them)",
                dir.join("comera_check.safetensors").display(),
            );
        }
    }
    Ok(())
}
