//! comera run directories from imported models, and Hugging Face exports of runs: the work of
//! `comera import` (read a model, check it, compress it by TT-SVD, write it as a run
//! directory) and of `comera export RUN --hf`, for every front end. Nothing here prints: each
//! function returns what a front end reports (the command line prints it, the Python package
//! returns it), and [`import_to_run`] also hands each step to a callback as it is done, since
//! a compression at several ranks takes minutes.

use crate::bert::ImportInfo;
use crate::compress::{compress, CompressOptions, LayerReport};
use crate::hf::{self, ModelInfo, ReadOptions};
use crate::minilm::{self, CheckReport, Reference};
use crate::{load_bert, ImportError, Result};
use comera_model::{Encoder, HeadKind, MlmDecoderKind};
use comera_tensor::ttsvd::{Absorb, TtSvdOptions};
use comera_train::{ModelMeta, RunConfig};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Where an import's model comes from.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// all-MiniLM-L6-v2, fetched into this cache directory on first use ([`minilm::fetch`]),
    /// with the built-in reference hidden states to check it against.
    Minilm { cache_dir: PathBuf },
    /// A Hugging Face directory or `.zip` of one, or a single `.safetensors` file (config
    /// from its metadata or a `config.json` beside it).
    Path(PathBuf),
}

/// TT-SVD compression of an imported model: encoder linear layers to TT, the word table to TTM.
#[derive(Clone, Debug, Default)]
pub struct TtOptions {
    /// Rank caps, one compression per cap (the last one is kept); empty: one compression
    /// bounded by `tol` alone (full rank without it).
    pub ranks: Vec<usize>,
    /// Relative Frobenius error target per layer.
    pub tol: Option<f64>,
    /// Make the encoder blocks (every parameter of `encoder.*`) this many times smaller than
    /// the dense model's: the per-layer error target `tol` is searched for (the same relative
    /// error for every layer, so each layer keeps the ranks its own spectrum needs), under the
    /// rank caps if any. Excludes `tol`.
    pub target_compression: Option<f64>,
    /// The word table's TTM rank cap, in place of the caps and tolerance of the linear layers
    /// (the table's spectrum is flat: an error target that suits the blocks wipes it out).
    pub embedding_rank: Option<usize>,
    /// Keep the word embedding dense (a masked-LM whose output projection is tied to it must).
    pub dense_embedding: bool,
    /// Zero-pad each layer kind to one uniform rank (default: TT-SVD's own ranks per bond).
    pub uniform_ranks: bool,
    /// Put all singular values into the last core (default: balance the core norms).
    pub left: bool,
}

impl TtOptions {
    /// Refuses a rank cap of 0, and a compression target that is not > 1 or comes with a
    /// tolerance.
    fn check_ranks(&self) -> Result<()> {
        if self.ranks.contains(&0) || self.embedding_rank == Some(0) {
            return Err(ImportError::new(
                "--rank",
                "0 is not a rank (must be at least 1)",
            ));
        }
        if let Some(x) = self.target_compression {
            if !(x > 1.0 && x.is_finite()) {
                return Err(ImportError::new(
                    "--target-compression",
                    format!("{x}: expected a factor > 1 (10: the blocks ten times smaller)"),
                ));
            }
            if self.tol.is_some() {
                return Err(ImportError::new(
                    "--target-compression",
                    "chooses the error tolerance itself: give it or --tol, not both",
                ));
            }
        }
        Ok(())
    }
}

/// Parameters of the encoder's blocks (`encoder.*`: TT cores and gates or dense weights,
/// biases, LayerNorms), embeddings and head excluded.
pub fn block_params(m: &Encoder) -> usize {
    m.params()
        .iter()
        .filter(|p| p.name.starts_with("encoder."))
        .map(|p| p.value.len())
        .sum()
}

/// The smallest per-layer relative error (to 1e-3) at which TT-SVD of `dense`'s linear layers
/// under `rank` makes the blocks at least `factor` times smaller than `dense`'s, and the
/// blocks' parameters there. Bisection: fewer parameters as the error grows.
fn tol_for_compression(
    dense: &Encoder,
    factor: f64,
    rank: Option<usize>,
    absorb: Absorb,
    uniform: bool,
) -> Result<(f64, usize)> {
    let goal = block_params(dense) as f64 / factor;
    let blocks_at = |tol: f64| -> Result<usize> {
        let svd = TtSvdOptions {
            max_rank: rank,
            rel_tol: Some(tol),
            absorb,
        };
        let copts = CompressOptions {
            linear: Some(svd),
            word: None,
            uniform,
        };
        Ok(block_params(&compress(dense, &copts)?.0))
    };
    // The tolerance bounds each of a layer's d − 1 truncations by its share of the error, so a
    // tolerance of 1 need not reach rank 1: grow the bracket until the goal is met (by 64 every
    // bond is at rank 1).
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    let mut at_hi = blocks_at(hi)?;
    while at_hi as f64 > goal {
        if hi >= 64.0 {
            return Err(ImportError::new(
                "--target-compression",
                format!(
                    "{factor}× is out of reach for these TT layouts: at rank 1 the blocks still have {at_hi} parameters, {:.1}× fewer than the dense {}",
                    block_params(dense) as f64 / at_hi as f64,
                    block_params(dense)
                ),
            ));
        }
        (lo, hi) = (hi, 2.0 * hi);
        at_hi = blocks_at(hi)?;
    }
    let mut best = (hi, at_hi);
    while hi - lo > 1e-3 * hi {
        let mid = 0.5 * (lo + hi);
        let n = blocks_at(mid)?;
        if n as f64 <= goal {
            (hi, best) = (mid, (mid, n));
        } else {
            lo = mid;
        }
    }
    Ok(best)
}

/// What [`import_to_run`] reads, checks, compresses and writes.
#[derive(Clone, Debug)]
pub struct ImportOptions {
    pub source: ModelSource,
    /// Compare the dense import's last hidden states with the reference (MiniLM's built-in
    /// one, else `reference`); the result is [`ImportOutcome::check`].
    pub check: bool,
    /// Reference hidden states (safetensors with `input_ids.{i}`, `hidden.{i}`), in place of
    /// MiniLM's built-in ones.
    pub reference: Option<PathBuf>,
    /// Sequence length, labels of a fresh classifier, seed of the parts the checkpoint lacks.
    pub read: ReadOptions,
    /// Compress by TT-SVD (`None`: the dense import is the model).
    pub tt: Option<TtOptions>,
    /// Write the (last) model as a comera run directory here ([`write_run_dir`]).
    pub out: Option<PathBuf>,
    /// The run config whose data, optimiser and training settings the run directory's
    /// `config.toml` takes (default: the built-in run's, or a masked-LM corpus run).
    pub config: Option<RunConfig>,
    /// Replace the comera run in `out` (only a directory holding a comera run and nothing
    /// else; the old run is restored if the import fails).
    pub overwrite: bool,
}

impl ImportOptions {
    /// A dense import of `source`: no check, no compression, nothing written.
    pub fn new(source: ModelSource) -> ImportOptions {
        ImportOptions {
            source,
            check: false,
            reference: None,
            read: ReadOptions::default(),
            tt: None,
            out: None,
            config: None,
            overwrite: false,
        }
    }
}

/// A model read by [`read_model`]: the dense encoder and what a run needs besides it.
#[derive(Clone, Debug)]
pub struct ImportedModel {
    /// The file or directory read (MiniLM: the fetched `model.zip`).
    pub source: PathBuf,
    pub encoder: Encoder,
    /// Labels, vocabulary and input kind; `None` for a single `.safetensors` file without a
    /// `vocab.txt` beside it, which cannot become a run directory.
    pub info: Option<ModelInfo>,
    pub import: ImportInfo,
    /// Things the reader should know (e.g. a tokenizer setting comera does not follow).
    pub notes: Vec<String>,
    /// Seconds the reading took.
    pub seconds: f64,
}

/// Reads a model densely: a single `.safetensors` file ([`load_bert`], with the `vocab.txt`
/// beside it if there is one and label names `LABEL_i`), else a Hugging Face directory or
/// `.zip` of one ([`hf::read_hf`]).
pub fn read_model(path: &Path, opts: &ReadOptions) -> Result<ImportedModel> {
    let t0 = Instant::now();
    let single_file = path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("safetensors"));
    let (encoder, info, import, notes) = if single_file {
        let (enc, ii) = load_bert(path, opts.seq_len, opts.num_labels, opts.seed)?;
        let vocab = path.with_file_name("vocab.txt");
        let info = comera_data::read_regular_to_string(&vocab)
            .ok()
            .map(|v| ModelInfo {
                labels: (0..enc.cfg.num_labels)
                    .map(|i| format!("LABEL_{i}"))
                    .collect(),
                vocab: v,
                pair: false,
            });
        (enc, info, ii, Vec::new())
    } else {
        let m = hf::read_hf(path, opts)?;
        (m.encoder, Some(m.info), m.import, m.notes)
    };
    Ok(ImportedModel {
        source: path.to_path_buf(),
        encoder,
        info,
        import,
        notes,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// One TT-SVD compression of a dense model (one per rank cap).
#[derive(Clone, Debug)]
pub struct Compression {
    /// The rank cap (`None`: bounded by `tol` alone, or full rank).
    pub rank: Option<usize>,
    /// The per-layer error target used (given, or found for `target_compression`).
    pub tol: Option<f64>,
    /// The blocks' compression asked for, if any.
    pub target_compression: Option<f64>,
    /// The encoder blocks' parameters ([`block_params`]): compressed, dense.
    pub block_params: (usize, usize),
    /// Every compressed layer's ranks, parameters and relative weight error.
    pub layers: Vec<LayerReport>,
    /// The compressed model's parameters.
    pub params: usize,
    /// The parameters of the compressed model's dense equivalent.
    pub dense_equivalent: usize,
    /// How far the compressed model's last hidden states are from the reference (or the dense
    /// model's own on sample sentences); `None` with neither a reference nor a vocabulary.
    pub deviation: Option<Deviation>,
    /// Seconds of the compression itself (without the deviation check).
    pub seconds: f64,
}

/// The hidden-state deviation of a compressed model.
#[derive(Clone, Debug)]
pub struct Deviation {
    pub report: CheckReport,
    /// What it was measured against: `the reference` or `the dense import`.
    pub against: &'static str,
}

/// Compresses `dense` by TT-SVD once per rank cap of `tt`, measuring each compressed model's
/// hidden states against `reference` (else the dense model's own on sample sentences
/// tokenised with `info`'s vocabulary), and hands each compression to `done` as it is made.
/// Returns the compressions and the last compressed model.
pub fn compress_ranks(
    dense: &Encoder,
    info: Option<&ModelInfo>,
    reference: Option<&Reference>,
    tt: &TtOptions,
    mut done: impl FnMut(&Compression),
) -> Result<(Vec<Compression>, Encoder)> {
    tt.check_ranks()?;
    if dense.cfg.head == HeadKind::Mlm
        && dense.cfg.mlm_decoder() == MlmDecoderKind::Tied
        && !tt.dense_embedding
    {
        return Err(ImportError::new(
            "--tt",
            "this masked-LM's output projection is tied to the word embedding, which must stay dense: add --dense-embedding",
        ));
    }
    // Hidden states the compressed model is measured against: the reference's (MiniLM:
    // computed independently from the original weights), else the dense import's own on
    // sample sentences.
    let sampled = match (reference, info) {
        (None, Some(i)) => Some(hf::sample_reference(dense, &i.vocab)?),
        _ => None,
    };
    let against = match (reference, &sampled) {
        (Some(r), _) => Some((r, "the reference")),
        (None, Some(s)) => Some((s, "the dense import")),
        (None, None) => None,
    };
    let caps: Vec<Option<usize>> = if tt.ranks.is_empty() {
        vec![None]
    } else {
        tt.ranks.iter().map(|&r| Some(r)).collect()
    };
    let absorb = if tt.left {
        Absorb::Left
    } else {
        Absorb::Balanced
    };
    let mut compressions = Vec::new();
    let mut last = None;
    for rank in caps {
        let tol = match tt.target_compression {
            Some(x) => Some(tol_for_compression(dense, x, rank, absorb, tt.uniform_ranks)?.0),
            None => tt.tol,
        };
        let svd = TtSvdOptions {
            max_rank: rank,
            rel_tol: tol,
            absorb,
        };
        let word = match tt.embedding_rank {
            Some(r) => TtSvdOptions {
                max_rank: Some(r),
                rel_tol: None,
                absorb,
            },
            None => svd,
        };
        let copts = CompressOptions {
            linear: Some(svd),
            word: (!tt.dense_embedding).then_some(word),
            uniform: tt.uniform_ranks,
        };
        let t = Instant::now();
        let (m, layers) = compress(dense, &copts)?;
        let seconds = t.elapsed().as_secs_f64();
        let deviation = match against {
            Some((r, what)) => Some(Deviation {
                report: minilm::check(&m, r)?,
                against: what,
            }),
            None => None,
        };
        let c = Compression {
            rank,
            tol,
            target_compression: tt.target_compression,
            block_params: (block_params(&m), block_params(dense)),
            layers,
            params: m.num_params(),
            dense_equivalent: m.dense_equivalent_params(),
            deviation,
            seconds,
        };
        done(&c);
        compressions.push(c);
        last = Some(m);
    }
    Ok((compressions, last.expect("at least one rank cap")))
}

/// A step of [`import_to_run`], handed to its callback when done.
#[derive(Clone, Copy, Debug)]
pub enum ImportStep<'a> {
    /// The model was read.
    Read(&'a ImportedModel),
    /// The dense import was checked against the reference.
    Checked {
        reference: &'a Reference,
        report: &'a CheckReport,
    },
    /// One compression was made (one per rank cap).
    Compressed(&'a Compression),
}

/// What [`import_to_run`] did.
#[derive(Clone, Debug)]
pub struct ImportOutcome {
    /// The dense import.
    pub imported: ImportedModel,
    /// The reference hidden states (MiniLM's built-in ones, or the options' file).
    pub reference: Option<Reference>,
    /// The dense import's check against the reference (when asked for).
    pub check: Option<CheckReport>,
    /// The compressions, one per rank cap (none without TT).
    pub compressions: Vec<Compression>,
    /// The last compression's model (`None` without TT).
    pub compressed: Option<Encoder>,
    /// The run directory written (absolute), with `out`.
    pub run_dir: Option<PathBuf>,
}

impl ImportOutcome {
    /// The import's model, the one written to the run directory: the last compression's, else
    /// the dense import.
    pub fn model(&self) -> &Encoder {
        self.compressed.as_ref().unwrap_or(&self.imported.encoder)
    }

    /// Whether the dense import is within [`minilm::TOLERANCE`] of the reference (true when it
    /// was not checked).
    pub fn check_passed(&self) -> bool {
        self.check.as_ref().is_none_or(CheckReport::passes)
    }
}

/// Imports a model: reads it ([`read_model`]; MiniLM fetched first), checks it against the
/// reference, compresses it ([`compress_ranks`]) and writes the last model as a run directory
/// ([`write_run_dir`]), as `opts` asks; hands each step to `progress` when done.
pub fn import_to_run(
    opts: ImportOptions,
    mut progress: impl FnMut(ImportStep<'_>),
) -> Result<ImportOutcome> {
    // Before the import's work: options and a target that will be refused are refused now.
    if let Some(tt) = &opts.tt {
        tt.check_ranks()?;
    }
    if let Some(dir) = &opts.out {
        comera_train::run_dir::check_fresh_target(dir, opts.overwrite)
            .map_err(|e| ImportError::context("--out", e))?;
    }
    let (path, builtin) = match opts.source {
        ModelSource::Minilm { cache_dir } => (minilm::fetch(&cache_dir)?, true),
        ModelSource::Path(p) => (p, false),
    };
    let reference: Option<Reference> = match (&opts.reference, builtin) {
        (Some(p), _) => {
            let bytes = comera_data::read_regular(p)
                .map_err(|e| ImportError::with_source(p.display().to_string(), "cannot read", e))?;
            Some(minilm::parse_reference(&bytes, &p.display().to_string())?)
        }
        (None, true) => Some(minilm::reference()),
        (None, false) => None,
    };
    if opts.check && reference.is_none() {
        return Err(ImportError::new(
            "--check",
            "needs --reference FILE (input_ids.{i}, hidden.{i})",
        ));
    }

    let imported = read_model(&path, &opts.read)?;
    progress(ImportStep::Read(&imported));
    let dense = &imported.encoder;

    let mut check = None;
    if let (true, Some(r)) = (opts.check, &reference) {
        let report = minilm::check(dense, r)?;
        progress(ImportStep::Checked {
            reference: r,
            report: &report,
        });
        check = Some(report);
    }

    let (compressions, compressed) = match &opts.tt {
        Some(tt) => {
            let (cs, m) =
                compress_ranks(dense, imported.info.as_ref(), reference.as_ref(), tt, |c| {
                    progress(ImportStep::Compressed(c))
                })?;
            (cs, Some(m))
        }
        None => (Vec::new(), None),
    };

    let mut outcome = ImportOutcome {
        imported,
        reference,
        check,
        compressions,
        compressed,
        run_dir: None,
    };
    if let Some(dir) = &opts.out {
        let info = outcome.imported.info.as_ref().ok_or_else(|| {
            ImportError::new(
                "--out",
                format!(
                    "{} comes without a vocabulary (vocab.txt beside it); a run directory needs one",
                    outcome.imported.source.display()
                ),
            )
        })?;
        outcome.run_dir = Some(write_run_dir(
            dir,
            outcome.model(),
            info,
            opts.config,
            opts.overwrite,
        )?);
    }
    Ok(outcome)
}

/// Writes `model` as a comera run directory (`model.toml`, `model.safetensors`, `vocab.txt`,
/// `config.toml`, `run.toml`) with `run`'s data, optimiser and training settings (default: the
/// built-in run's, or a masked-LM corpus run for an MLM head). The directory is opened like a
/// training run's ([`comera_train::run_dir::RunDir::create`]): locked, refused when it holds
/// anything unless `overwrite` and it holds a comera run; returns its absolute path.
pub fn write_run_dir(
    dir: &Path,
    model: &Encoder,
    info: &ModelInfo,
    run: Option<RunConfig>,
    overwrite: bool,
) -> Result<PathBuf> {
    let shown = || dir.display().to_string();
    std::fs::create_dir_all(dir)
        .map_err(|e| ImportError::with_source(shown(), "cannot create", e))?;
    let abs = std::fs::canonicalize(dir)
        .map_err(|e| ImportError::with_source(shown(), "cannot resolve", e))?;
    let vocab = abs.join("vocab.txt");
    let mut run = run.unwrap_or_else(|| {
        let mut r = RunConfig::builtin();
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
        .map_err(|e| ImportError::new(shown(), format!("config.toml: {e}")))?;
    let run_dir = comera_train::run_dir::RunDir::create(&abs, &run.to_toml(), overwrite)?;
    comera_train::write_atomic(&vocab, info.vocab.as_bytes())?;
    let meta = ModelMeta {
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

/// The files [`export_run_hf`] writes: a directory holding these and nothing else (with a
/// `config.json` that names `comera_sentence_pair`) is an earlier export that `overwrite` may
/// replace.
pub const HF_EXPORT_FILES: &[&str] = &[
    "config.json",
    "model.safetensors",
    "vocab.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "comera_check.safetensors",
    // The compressed form that the Python package makes of an export
    // (`Run.export_hf(dir, compressed=True)`: comera.torch layers, loaded with
    // `trust_remote_code=True`).
    "comera_model.safetensors",
    "modeling_comera.py",
];

/// The name of the check file [`write_hf_run`] writes with `samples`.
pub const CHECK_FILE: &str = "comera_check.safetensors";

/// What [`export_run_hf`] wrote.
#[derive(Clone, Debug)]
pub struct HfRunExport {
    /// The directory written.
    pub dir: PathBuf,
    /// `BertForSequenceClassification` or `BertForMaskedLM`.
    pub architecture: &'static str,
    /// File names written into the directory.
    pub files: Vec<String>,
    /// Changes a reader should know about (e.g. a TT decoder's padding columns dropped).
    pub notes: Vec<String>,
    /// The check file ([`CHECK_FILE`]) written with `samples` > 0.
    pub check_file: Option<PathBuf>,
    /// Validation inputs in the check file (with comera's logits on them).
    pub checked: usize,
}

/// Refuses an `export --hf` target that is not absent, empty, or (with `overwrite`) an earlier
/// comera export: a run directory is never an export target, and a folder of the user's is
/// never replaced.
pub fn check_hf_target(dir: &Path, overwrite: bool) -> Result<()> {
    // The rule's refusals name the flag already: keep their reason under ours.
    let to_import = |e: comera_run::Error| match e {
        comera_run::Error::Config(c) => ImportError::new("--hf", c.reason),
        other => ImportError::new("--hf", comera_train::error::Chain(&other).to_string()),
    };
    comera_train::outputs::check_output_dir(dir, "--hf", overwrite, is_hf_export).map_err(to_import)
}

/// Whether `dir` holds an earlier comera Hugging Face export (its files and nothing else,
/// with comera's own field in `config.json`).
pub fn is_hf_export(dir: &Path) -> bool {
    comera_train::outputs::entry_names(dir).is_ok_and(|names| {
        names.iter().all(|n| HF_EXPORT_FILES.contains(&n.as_str()))
            && comera_data::read_regular_to_string(&dir.join("config.json"))
                .is_ok_and(|t| t.contains("\"comera_sentence_pair\""))
    })
}

/// Loads any encoder `comera export` takes: a run directory (with its meta), a compressed
/// export, or a BERT checkpoint.
pub fn load_model_source(src: &Path) -> Result<(Encoder, Option<ModelMeta>)> {
    if src.is_dir() {
        let (m, meta) = comera_train::load_model(src)?;
        return Ok((m, Some(meta)));
    }
    let bytes = comera_data::read_regular(src)
        .map_err(|e| ImportError::with_source(src.display().to_string(), "cannot read", e))?;
    if crate::export::format_of(&bytes).is_some_and(|f| f == "compressed") {
        Ok((
            crate::load_compressed(&bytes, &src.display().to_string())?,
            None,
        ))
    } else {
        Ok((load_bert(src, None, None, 0)?.0, None))
    }
}

/// Writes `model`, loaded from `src` with its `meta` ([`load_model_source`]), as a Hugging
/// Face directory `dir` ([`hf::export_hf`]) and, with `samples` > 0, the check file of that
/// many validation inputs of the run. The whole directory is written beside `dir` and swapped
/// in at once; `dir` must have passed [`check_hf_target`]. `meta` (a run directory's) is
/// required: the label names and vocabulary come from it.
pub fn write_hf_run(
    src: &Path,
    model: &Encoder,
    meta: Option<&ModelMeta>,
    dir: &Path,
    samples: usize,
) -> Result<HfRunExport> {
    let meta = meta.ok_or_else(|| {
        ImportError::new(
            "--hf",
            format!(
                "{} is not a run directory; the label names and vocabulary come from a run's model.toml",
                src.display()
            ),
        )
    })?;
    let vocab = comera_data::read_regular_to_string(&meta.vocab)
        .map_err(|e| ImportError::context(format!("vocabulary {}", meta.vocab.display()), e))?;
    let info = ModelInfo {
        labels: meta.labels.clone(),
        vocab,
        pair: meta.pair,
    };
    let mut checked = 0;
    let mut written = None;
    comera_train::files::replace_dir_atomic(dir, |tmp| {
        written = Some(hf::export_hf(model, &info, tmp)?);
        if samples > 0 {
            let (ids, types, mask, pos) = validation_inputs(src, model, samples)?;
            let bytes = hf::check_file(model, &ids, &types, &mask, pos.as_deref())?;
            comera_train::write_atomic(&tmp.join(CHECK_FILE), &bytes)?;
            checked = ids.len() / model.cfg.seq_len;
        }
        Ok::<(), ImportError>(())
    })?;
    let written = written.expect("written by the closure");
    Ok(HfRunExport {
        dir: dir.to_path_buf(),
        architecture: written.architecture,
        files: written.files,
        notes: written.notes,
        check_file: (samples > 0).then(|| dir.join(CHECK_FILE)),
        checked,
    })
}

/// `comera export RUN --hf DIR`: the run directory `src` written as a Hugging Face directory
/// ([`check_hf_target`], [`load_model_source`], [`write_hf_run`]).
pub fn export_run_hf(
    src: &Path,
    dir: &Path,
    samples: usize,
    overwrite: bool,
) -> Result<HfRunExport> {
    check_hf_target(dir, overwrite)?;
    let (model, meta) = load_model_source(src)?;
    write_hf_run(src, &model, meta.as_ref(), dir, samples)
}

/// Up to `n` validation inputs of the run in `run_dir` (its `config.toml` data settings) for
/// [`hf::check_file`]: ids, token types, attention masks (n × T) and, for a masked-LM, the masked
/// ids of the evaluation masking and the first masked position of each row.
#[allow(clippy::type_complexity)]
fn validation_inputs(
    run_dir: &Path,
    enc: &Encoder,
    n: usize,
) -> Result<(Vec<u32>, Vec<u32>, Vec<u32>, Option<Vec<usize>>)> {
    let what = run_dir.join("config.toml").display().to_string();
    let cfg = RunConfig::from_file(&run_dir.join("config.toml"))
        .map_err(|e| ImportError::context(&what, e))?;
    let t = enc.cfg.seq_len;
    if enc.cfg.head == HeadKind::Mlm {
        let mut data = comera_train::data::CorpusData::new(&cfg.data, cfg.train.seed)
            .map_err(|e| ImportError::context(&what, e))?;
        data.packed(t).map_err(|e| ImportError::context(&what, e))?;
        let blocks = &data.packed_ref(t).valid;
        let b = n.min(blocks.len()).max(1);
        let mut batch = comera_data::mlm::MlmBatch::new(b, t);
        let mut it = comera_data::mlm::MlmBatches::new(blocks, data.masker, b, 0x5EED_E7A1, false);
        if !it.next_into(&mut batch) {
            return Err(ImportError::new(
                what,
                "no held-out block to take inputs from",
            ));
        }
        // Rows with a masked position: the first one of each.
        let mut rows = Vec::new();
        let mut positions = Vec::new();
        for r in 0..b {
            if let Some(p) = (0..t).find(|&p| batch.labels[r * t + p] != -100) {
                rows.push(r);
                positions.push(p);
            }
        }
        let take = |v: &[u32]| -> Vec<u32> {
            rows.iter()
                .flat_map(|&r| v[r * t..(r + 1) * t].iter().copied())
                .collect()
        };
        let ids = take(&batch.input_ids);
        let mask = take(&batch.attention_mask);
        let types = vec![0; ids.len()];
        return Ok((ids, types, mask, Some(positions)));
    }
    let data = comera_train::data::prepare(&cfg.data, t, cfg.train.seed)
        .map_err(|e| ImportError::context(&what, e))?;
    let v = &data.valid;
    let m = n.min(v.len());
    Ok((
        v.input_ids[..m * t].to_vec(),
        v.token_type_ids[..m * t].to_vec(),
        v.attention_mask[..m * t].to_vec(),
        None,
    ))
}
