//! `comera`: the command-line front end of the engine.

mod bench;
mod bench_ttm;
mod factor;
mod verify;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "comera",
    version,
    about = "Rank-adaptive tensor-train training engine (CoMERA) for CPUs"
)]
struct Cli {
    /// Worker threads (default: all cores). Same seed and thread count give the same result.
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check layers against reference cases (safetensors files, SPEC §6); non-zero exit on any failure.
    Verify(verify::Args),
    /// Benchmarks (median times, side by side in one run).
    #[command(subcommand)]
    Bench(bench::Bench),
    /// Propose TT layouts (balanced modes, rank for a parameter budget) for an N → M layer.
    Factor(factor::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(t) = cli.threads {
        if let Err(e) = rayon::ThreadPoolBuilder::new()
            .num_threads(t.max(1))
            .build_global()
        {
            eprintln!("error: --threads: {e}");
            return ExitCode::from(2);
        }
    }
    let result = match cli.command {
        Command::Verify(a) => verify::run(a),
        Command::Bench(b) => bench::run(b),
        Command::Factor(a) => factor::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
