//! Python bindings of comera: the `comera._comera` extension module behind the `comera`
//! package (python/comera). A thin layer over the library: every decision is comera's own.

use pyo3::prelude::*;

mod torch;

#[pymodule]
fn _comera(m: &Bound<'_, PyModule>) -> PyResult<()> {
    torch::register(m)?;
    Ok(())
}
