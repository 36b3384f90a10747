//! Python bindings of comera: the `comera._comera` extension module behind the `comera`
//! package (`python/comera`). A thin layer over the library, as the command line is: configs
//! are parsed and checked by comera-train, runs are comera-train's loop, records are its typed
//! records as dicts, errors its typed errors as exceptions. The Python package adds only
//! argument conversion (lists, NumPy, pandas) and presentation (a tqdm bar in notebooks).
//!
//! - [`errors`]: the exception classes and the conversion of comera's errors and panics;
//! - [`events`]: the loop's events as dicts, and the observer that calls Python;
//! - [`training`]: `train` and `resume`, with data handed over in memory;
//! - [`runs`]: a run directory's config, records, predictions and evaluations;
//! - [`hf`]: Hugging Face models in (`import_hf`, TT-SVD compression) and out (`export_hf`);
//! - [`torch`]: the kernels of `comera.torch`'s TT layers;
//! - [`threads`]: the threads they (and predictions) run on, rebuilt after `fork`;
//! - [`cli`]: the `comera` command, for the package's console script.

use pyo3::prelude::*;

mod cli;
mod errors;
mod events;
mod hf;
mod runs;
mod threads;
mod torch;
mod training;

#[pymodule]
fn _comera(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(training::json_to_toml, m)?)?;
    m.add_function(wrap_pyfunction!(training::resolve_config, m)?)?;
    m.add_function(wrap_pyfunction!(training::train, m)?)?;
    m.add_function(wrap_pyfunction!(training::resume, m)?)?;
    m.add_function(wrap_pyfunction!(runs::toml_to_py, m)?)?;
    m.add_function(wrap_pyfunction!(runs::run_config, m)?)?;
    m.add_function(wrap_pyfunction!(runs::run_metrics, m)?)?;
    m.add_function(wrap_pyfunction!(runs::run_predict, m)?)?;
    m.add_function(wrap_pyfunction!(runs::run_evaluate, m)?)?;
    m.add_function(wrap_pyfunction!(runs::devices, m)?)?;
    m.add_function(wrap_pyfunction!(hf::import_hf, m)?)?;
    m.add_function(wrap_pyfunction!(hf::export_hf, m)?)?;
    m.add_function(wrap_pyfunction!(hf::run_tt_modules, m)?)?;
    torch::register(m)?;
    threads::register(m)?;
    m.add_function(wrap_pyfunction!(cli::cli_main, m)?)?;
    Ok(())
}
