//! `comera synth-criteo`: synthetic Criteo-format files (DLRM runs go through `comera train`).

use anyhow::Context;
use comera_data::ctr::{SynthCriteo, SynthSpec, CRITEO_CATS};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct SynthArgs {
    /// Output file (Criteo TSV: label, 13 integers, 26 categorical ids as 8 hex digits).
    #[arg(long)]
    out: PathBuf,
    /// Rows (examples) to write.
    #[arg(long)]
    rows: u64,
    /// Total rows of the 26 tables, split Criteo-like (a few huge tables, many small).
    #[arg(long, default_value_t = 1_000_000)]
    total_rows: usize,
    /// Explicit table sizes, 26 comma-separated numbers (overrides --total-rows).
    #[arg(long, value_delimiter = ',')]
    table_sizes: Vec<usize>,
    /// Zipf exponent of the categorical ids.
    #[arg(long, default_value_t = 1.1)]
    zipf: f64,
    /// Probability that a field is empty.
    #[arg(long, default_value_t = 0.02)]
    missing: f64,
    /// Seed of the hidden label model (the same seed as a `synthetic` run's `train.seed`
    /// gives the same model); --stream picks the rows.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    #[arg(long, default_value_t = 0)]
    stream: u64,
}

pub fn synth(a: SynthArgs) -> anyhow::Result<ExitCode> {
    let sizes = if a.table_sizes.is_empty() {
        if a.total_rows < CRITEO_CATS * 4 {
            anyhow::bail!(
                "--total-rows: at least {} (4 rows per table)",
                CRITEO_CATS * 4
            );
        }
        SynthSpec::criteo_like_sizes(a.total_rows)
    } else {
        a.table_sizes.clone()
    };
    let spec = SynthSpec {
        table_sizes: sizes.clone(),
        zipf_s: a.zipf,
        missing: a.missing,
        seed: a.seed,
    };
    let mut g = SynthCriteo::with_stream(spec, a.stream)?;
    let f = std::fs::File::create(&a.out)
        .with_context(|| format!("{}: cannot create", a.out.display()))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
    g.write_tsv(&mut w, a.rows)
        .and_then(|_| w.flush())
        .with_context(|| format!("{}: cannot write", a.out.display()))?;
    println!(
        "{}: {} rows; table sizes {}",
        a.out.display(),
        a.rows,
        sizes
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    Ok(ExitCode::SUCCESS)
}
