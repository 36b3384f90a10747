//! The `comera` command from the Python package: the `comera` console script
//! (`python/comera/_cli.py`, installed by `pip install`) runs comera-cli's command in its own
//! process, so the command line needs no second build.

use pyo3::prelude::*;
use std::ffi::OsString;

/// Runs the `comera` command for `argv` (the program's name first) with the GIL released and
/// returns its exit status. For the console script only: the command builds rayon's global
/// pool, which a process can do once.
#[pyfunction]
pub fn cli_main(py: Python<'_>, argv: Vec<OsString>) -> u8 {
    py.detach(|| comera_cli::run(argv))
}
