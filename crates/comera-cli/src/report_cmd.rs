//! `comera report RUN… --out DIR`: runs side by side as a results page (Markdown tables, plots
//! and the figures as JSON). The work is comera-train's ([`comera_train::results`]).

use comera_train::results::{write_report, PaperTable, ReportOptions, RunResults};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Run directories, in the order of the tables (finished, stopped or still running).
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// Output directory: report.md, report.json, score.png, compression.png, cost.png, written
    /// as one unit. It must be new or empty (never a run directory or inside one).
    #[arg(long)]
    out: PathBuf,
    /// Replace --out DIR if it holds an earlier report page (and nothing else).
    #[arg(long)]
    overwrite: bool,
    /// Names of the runs in the tables (default: the directories' names).
    #[arg(long, value_delimiter = ',')]
    names: Vec<String>,
    /// The page's title.
    #[arg(long, default_value = "")]
    title: String,
    /// The run the time and memory ratios are taken against (default: the first dense run).
    #[arg(long)]
    baseline: Option<String>,
    /// Put the paper's figures beside the tables: six-encoder, dlrm or pretrain.
    #[arg(long)]
    paper: Option<String>,
    /// A command that made the runs, shown on the page (repeatable).
    #[arg(long = "command")]
    commands: Vec<String>,
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    if !a.names.is_empty() && a.names.len() != a.runs.len() {
        anyhow::bail!("--names: {} names for {} runs", a.names.len(), a.runs.len());
    }
    let paper = match &a.paper {
        Some(p) => Some(PaperTable::parse(p).ok_or_else(|| {
            anyhow::anyhow!(
                "--paper: `{p}` is not one of {}",
                PaperTable::NAMES.join(", ")
            )
        })?),
        None => None,
    };
    let runs = a
        .runs
        .iter()
        .enumerate()
        .map(|(i, dir)| RunResults::read(dir, a.names.get(i).map(String::as_str)))
        .collect::<Result<Vec<_>, _>>()?;
    let files = write_report(
        &runs,
        &a.out,
        a.overwrite,
        &ReportOptions {
            title: a.title,
            baseline: a.baseline,
            paper,
            commands: a.commands,
        },
    )?;
    println!("report: {}", files.markdown.display());
    println!("figures: {}", files.json.display());
    for p in &files.plots {
        println!("plot: {}", p.display());
    }
    Ok(ExitCode::SUCCESS)
}
