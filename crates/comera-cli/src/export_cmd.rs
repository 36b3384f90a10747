//! `comera export SRC --dense F | --compressed F | --hf DIR`: a run directory, compressed export
//! or BERT checkpoint written as a dense or compressed export or a Hugging Face directory (with
//! validation inputs and comera's logits on them); a DLRM run as a dense or compressed export.

use anyhow::{bail, ensure, Context};
use comera_import::hf::{self, ModelInfo};
use comera_import::{export_compressed, export_dense, load_bert};
use comera_model::{Encoder, HeadKind};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A run directory (model.toml + model.safetensors), a compressed export, or a BERT
    /// checkpoint (`.zip` or dense `.safetensors`).
    src: PathBuf,
    /// Write the dense export: reconstructed weights, Hugging Face BERT names and layout.
    #[arg(long)]
    dense: Option<PathBuf>,
    /// Write the compressed export: cores, gates and the other parameters, config in metadata.
    #[arg(long)]
    compressed: Option<PathBuf>,
    /// Write a Hugging Face directory (config.json, model.safetensors, tokenizer files) that
    /// transformers loads with from_pretrained(DIR); SRC must be a run directory.
    #[arg(long)]
    hf: Option<PathBuf>,
    /// With --hf: also write DIR/comera_check.safetensors, this many validation inputs of the
    /// run with comera's logits on them, to compare another implementation against.
    #[arg(long, default_value_t = 0)]
    samples: usize,
    /// With --hf: replace DIR if it holds an earlier comera export (and nothing else). The new
    /// export is written beside DIR and swapped in whole.
    #[arg(long)]
    overwrite: bool,
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    if a.src.is_dir() {
        if let comera_train::SavedModel::Dlrm(m, meta) = comera_train::load_saved(&a.src)? {
            anyhow::ensure!(
                a.hf.is_none(),
                "--hf: {} holds a DLRM, which Hugging Face BERT cannot represent",
                a.src.display()
            );
            anyhow::ensure!(
                a.dense.is_some() || a.compressed.is_some(),
                "nothing to write: give --dense FILE and/or --compressed FILE"
            );
            for (path, dense) in [(&a.dense, true), (&a.compressed, false)] {
                if let Some(p) = path {
                    let bytes = comera_train::files::export_dlrm(&m, &meta, dense)?;
                    comera_train::write_atomic(p, &bytes)?;
                    println!(
                        "wrote {} (DLRM, {} tables)",
                        p.display(),
                        if dense { "dense" } else { "as trained" }
                    );
                }
            }
            return Ok(ExitCode::SUCCESS);
        }
    }
    export_encoder(
        &a.src,
        a.dense.as_deref(),
        a.compressed.as_deref(),
        a.hf.as_deref(),
        a.samples,
        a.overwrite,
    )?;
    Ok(ExitCode::SUCCESS)
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
fn load_any(src: &Path) -> anyhow::Result<(Encoder, Option<comera_train::ModelMeta>)> {
    if src.is_dir() {
        let (m, meta) = comera_train::load_model(src)?;
        return Ok((m, Some(meta)));
    }
    let bytes = std::fs::read(src).with_context(|| format!("{}: cannot read", src.display()))?;
    if comera_import::export::format_of(&bytes).is_some_and(|f| f == "compressed") {
        Ok((
            comera_import::load_compressed(&bytes, &src.display().to_string())?,
            None,
        ))
    } else {
        Ok((load_bert(src, None, None, 0)?.0, None))
    }
}

/// `comera export` of an encoder (a run directory, compressed export or BERT checkpoint).
fn export_encoder(
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
                let (ids, types, mask, pos) = validation_inputs(src, &m, samples)?;
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

/// Up to `n` validation inputs of the run in `run_dir` (its `config.toml` data settings) for
/// [`hf::check_file`]: ids, token types, attention masks (n × T) and, for a masked-LM, the masked
/// ids of the evaluation masking and the first masked position of each row.
#[allow(clippy::type_complexity)]
fn validation_inputs(
    run_dir: &Path,
    enc: &Encoder,
    n: usize,
) -> anyhow::Result<(Vec<u32>, Vec<u32>, Vec<u32>, Option<Vec<usize>>)> {
    let what = run_dir.join("config.toml").display().to_string();
    let cfg =
        comera_train::RunConfig::from_file(&run_dir.join("config.toml")).context(what.clone())?;
    let t = enc.cfg.seq_len;
    if enc.cfg.head == HeadKind::Mlm {
        let mut data = comera_train::data::CorpusData::new(&cfg.data, cfg.train.seed)
            .with_context(|| what.clone())?;
        data.packed(t).with_context(|| what.clone())?;
        let blocks = &data.packed_ref(t).valid;
        let b = n.min(blocks.len()).max(1);
        let mut batch = comera_data::mlm::MlmBatch::new(b, t);
        let mut it = comera_data::mlm::MlmBatches::new(blocks, data.masker, b, 0x5EED_E7A1, false);
        if !it.next_into(&mut batch) {
            bail!("{what}: no held-out block to take inputs from");
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
    let data =
        comera_train::data::prepare(&cfg.data, t, cfg.train.seed).with_context(|| what.clone())?;
    let v = &data.valid;
    let m = n.min(v.len());
    Ok((
        v.input_ids[..m * t].to_vec(),
        v.token_type_ids[..m * t].to_vec(),
        v.attention_mask[..m * t].to_vec(),
        None,
    ))
}
