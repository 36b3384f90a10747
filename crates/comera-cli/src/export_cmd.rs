//! `comera export SRC --dense OUT | --compressed OUT`: a saved model out of comera.

use anyhow::Context;
use comera_import::{export_compressed, export_dense, load_bert, load_compressed};
use comera_model::Encoder;
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
}

/// Loads any model source `export` accepts.
pub fn load_any(src: &Path) -> anyhow::Result<Encoder> {
    if src.is_dir() {
        let (m, _) = comera_train::files::load_model(src)?;
        return Ok(m);
    }
    let bytes = std::fs::read(src).with_context(|| format!("{}: cannot read", src.display()))?;
    if comera_import::export::format_of(&bytes).is_some_and(|f| f == "compressed") {
        Ok(load_compressed(&bytes, &src.display().to_string())?)
    } else {
        Ok(load_bert(src, None, None, 0)?.0)
    }
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        a.dense.is_some() || a.compressed.is_some(),
        "nothing to write: give --dense OUT and/or --compressed OUT"
    );
    let m = load_any(&a.src)?;
    println!(
        "{}: {} parameters (dense equivalent {})",
        a.src.display(),
        m.num_params(),
        m.dense_equivalent_params()
    );
    if let Some(p) = &a.dense {
        comera_train::files::write_atomic(p, &export_dense(&m)?)?;
        println!(
            "wrote {} (dense export, Hugging Face BERT names)",
            p.display()
        );
    }
    if let Some(p) = &a.compressed {
        comera_train::files::write_atomic(p, &export_compressed(&m)?)?;
        println!("wrote {} (compressed export)", p.display());
    }
    Ok(ExitCode::SUCCESS)
}
