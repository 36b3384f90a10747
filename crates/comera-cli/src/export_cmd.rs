//! `comera export SRC --dense F | --compressed F | --hf DIR`: argument parsing for
//! [`comera_import::command::export`].

use std::path::PathBuf;
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
    comera_import::command::export(
        &a.src,
        a.dense.as_deref(),
        a.compressed.as_deref(),
        a.hf.as_deref(),
        a.samples,
        a.overwrite,
    )?;
    Ok(ExitCode::SUCCESS)
}
