//! `comera export SRC --dense F | --compressed F | --hf DIR`: a run directory, compressed export
//! or BERT checkpoint written as a dense or compressed export or a Hugging Face directory (with
//! validation inputs and comera's logits on them); a DLRM run as a dense or compressed export.
//! The loading and the Hugging Face export are comera-import's ([`comera_import::run`]); this
//! parses the options, writes the dense and compressed files and prints what was written.

use anyhow::ensure;
use comera_import::run::{check_hf_target, load_model_source, write_hf_run};
use comera_import::{save_compressed, save_dense};
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
    /// Replace an earlier comera export at --dense FILE / --compressed FILE, or in --hf DIR
    /// (which must hold nothing else; the new export is written beside it and swapped in whole).
    /// Files comera did not export, and a run directory's files, are never replaced.
    #[arg(long)]
    overwrite: bool,
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    check_targets(&a)?;
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
                    comera_train::files::export_dlrm(p, &m, &meta, dense)?;
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

/// The outputs' paths against the rule of [`comera_train::outputs`], before anything is read or
/// written: each file absent or an earlier comera export (with --overwrite), none inside a run
/// directory, no two at one place.
fn check_targets(a: &Args) -> anyhow::Result<()> {
    use comera_train::outputs::{self, Output};
    let mut all = Vec::new();
    for (flag, path) in [("--dense", &a.dense), ("--compressed", &a.compressed)] {
        if let Some(p) = path {
            outputs::check_output_file(p, flag, a.overwrite, outputs::is_comera_export)?;
            let parent = p.parent().filter(|d| !d.as_os_str().is_empty());
            if parent.is_some_and(comera_import::run::is_hf_export) {
                anyhow::bail!(
                    "{flag}: {} is inside a comera Hugging Face export, which is written and replaced whole (--hf); name a path outside it",
                    p.display()
                );
            }
            all.push(Output {
                flag,
                path: p,
                is_dir: false,
            });
        }
    }
    if let Some(dir) = &a.hf {
        outputs::check_outside_runs(dir, "--hf")?;
        all.push(Output {
            flag: "--hf",
            path: dir,
            is_dir: true,
        });
    }
    outputs::check_distinct_outputs(&all)?;
    Ok(())
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
        check_hf_target(dir, overwrite)?;
    }
    let (m, meta) = load_model_source(src)?;
    println!(
        "{}: {} parameters (dense equivalent {})",
        src.display(),
        m.num_params(),
        m.dense_equivalent_params()
    );
    if let Some(p) = dense {
        save_dense(&m, p)?;
        println!(
            "wrote {} (dense export, Hugging Face BERT names)",
            p.display()
        );
    }
    if let Some(p) = compressed {
        save_compressed(&m, p)?;
        println!("wrote {} (compressed export)", p.display());
    }
    if let Some(dir) = hf_dir {
        let out = write_hf_run(src, &m, meta.as_ref(), dir, samples)?;
        println!(
            "wrote {} ({}: {}); load it with {}.from_pretrained(\"{0}\") and AutoTokenizer",
            out.dir.display(),
            out.architecture,
            out.files.join(", "),
            out.architecture
        );
        for n in &out.notes {
            println!("  note: {n}");
        }
        if let Some(check) = &out.check_file {
            println!(
                "wrote {} ({} validation inputs and comera's logits on them)",
                check.display(),
                out.checked
            );
        }
    }
    Ok(())
}
