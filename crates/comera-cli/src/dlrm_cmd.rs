//! DLRM from the command line: `comera train --config dlrm.toml` (a config with a `[dlrm]`
//! table) and `comera synth-criteo` (synthetic Criteo-format files).

use anyhow::Context;
use comera_data::ctr::{SynthCriteo, SynthSpec, CRITEO_CATS};
use comera_dlrm::{is_dlrm_config, DlrmRunConfig, TableKind};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Whether the config file is a DLRM run config (it has a top-level `[dlrm]` table).
pub fn is_dlrm(path: &Path) -> anyhow::Result<bool> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("{}: cannot read config: {e}", path.display()))?;
    Ok(is_dlrm_config(&text))
}

/// The `comera train` flags a DLRM run honours.
pub struct Overrides {
    pub epochs: Option<usize>,
    pub batch_size: Option<usize>,
    pub seed: Option<u64>,
    pub out: Option<PathBuf>,
    /// Every table dense (the baseline).
    pub dense: bool,
    pub max_steps_per_epoch: Option<usize>,
    pub print_config: bool,
    pub quiet: bool,
}

pub fn train(path: &Path, o: Overrides) -> anyhow::Result<ExitCode> {
    let mut cfg = DlrmRunConfig::from_file(path)?;
    if let Some(v) = o.epochs {
        cfg.train.epochs = v;
    }
    if let Some(v) = o.batch_size {
        cfg.train.batch_size = v;
    }
    if let Some(v) = o.seed {
        cfg.train.seed = v;
    }
    if let Some(v) = o.out {
        cfg.train.out_dir = v;
    }
    if let Some(v) = o.max_steps_per_epoch {
        cfg.train.max_steps_per_epoch = v;
    }
    if o.dense {
        cfg.dlrm.tables = TableKind::Dense;
    }
    cfg.validate()
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    if o.print_config {
        print!("{}", cfg.to_toml());
        return Ok(ExitCode::SUCCESS);
    }
    let s = comera_dlrm::train(&cfg, !o.quiet)?;
    let v = &s.final_valid;
    println!(
        "done: {} epochs, {} steps of {} in {:.0} s; validation AUC {:.4} (best {:.4} at epoch {}), log-loss {:.4}, accuracy {:.4} on {} examples",
        s.epochs,
        s.steps,
        s.batch_size,
        s.seconds,
        v.auc,
        s.best_valid_auc,
        s.best_epoch,
        v.loss,
        v.accuracy,
        v.examples
    );
    println!(
        "tables: {} parameters ({:.1}x smaller than {} dense); model {} parameters",
        s.table_params,
        s.table_compression(),
        s.dense_table_params,
        s.params
    );
    println!(
        "speed: median step {:.1} ms = {:.0} samples/s ({:.0} samples/s overall); peak RSS {:.1} MiB (parameters+grads {:.1} MiB, AdamW {:.1} MiB, batch state {:.1} MiB); report {}",
        s.median_step_ms,
        s.samples_per_s,
        s.overall_samples_per_s,
        s.peak_rss_bytes as f64 / 1048576.0,
        s.param_bytes as f64 / 1048576.0,
        s.optimizer_bytes as f64 / 1048576.0,
        s.state_bytes as f64 / 1048576.0,
        s.out_dir.join("report.json").display()
    );
    Ok(ExitCode::SUCCESS)
}

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
