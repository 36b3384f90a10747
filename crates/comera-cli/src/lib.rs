//! The `comera` command as a library: the Python package (crates/comera-python) installs a
//! `comera` script that runs this same command in its own process, so that `pip install`
//! puts the command on the PATH without a second build. The binary (`main.rs`) is the one
//! source: it is compiled here as a module, unchanged.

// `main` itself, and anything only the binary's tests use, is unused from the library.
#[allow(dead_code)]
#[path = "main.rs"]
mod command;

/// Runs the command for `args` (the program's name first) and returns its exit status, as
/// the `comera` binary would exit with it (0 success, 1 an error, 2 a usage error; `--help`,
/// `--version` and usage errors end the process from inside, as the binary does).
///
/// Call it once per process, from a process that has not started rayon's global pool: the
/// command builds that pool with its `--threads`.
pub fn run(args: impl IntoIterator<Item = std::ffi::OsString>) -> u8 {
    let code = command::run_from(args);
    // `ExitCode` is opaque: its value is found by comparison.
    (0..=u8::MAX)
        .find(|&c| std::process::ExitCode::from(c) == code)
        .unwrap_or(1)
}
