//! comera's errors as Python exceptions: `ComeraError`, and under it `ConfigError`,
//! `DataError`, `RunError`, `ModelError` and `DeviceError`, each carrying comera's whole message (the error
//! and its sources, `message: source: source…`, as the command line prints it). A Rust panic
//! never crosses into Python: [`guard`] turns it into a `ComeraError`.

use comera_train::Error;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    _comera,
    ComeraError,
    PyException,
    "Any error of comera (a bad config, bad data, a damaged run, a model that cannot be used)."
);
create_exception!(
    _comera,
    ConfigError,
    ComeraError,
    "A config field or argument comera cannot use; the message names the field."
);
create_exception!(
    _comera,
    DataError,
    ComeraError,
    "Data that cannot be read or used: a file, a column, a label, a tokenizer."
);
create_exception!(
    _comera,
    RunError,
    ComeraError,
    "A run directory that cannot be created, resumed, locked or read, or a run that failed."
);
create_exception!(
    _comera,
    ModelError,
    ComeraError,
    "A model that cannot be built, loaded or used."
);

create_exception!(
    _comera,
    DeviceError,
    ComeraError,
    "A device that is not there or cannot take the work: no NVIDIA driver, GPU or NVRTC, a plan \
     that does not fit in the GPU's memory, or something the GPU path does not do yet."
);

/// Registers the exception classes in the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("ComeraError", py.get_type::<ComeraError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("DataError", py.get_type::<DataError>())?;
    m.add("RunError", py.get_type::<RunError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("ModelError", py.get_type::<ModelError>())?;
    Ok(())
}

/// A comera error as the Python exception of its kind, in Python's words where the command
/// line's would name its flags (`--overwrite`, `comera train --resume`).
pub fn to_py(e: impl Into<Error>) -> PyErr {
    let e = e.into();
    let msg = in_python_words(&e);
    match e {
        Error::Config(_) | Error::ModelConfig(_) | Error::Parse { .. } | Error::TomlSer(_) => {
            ConfigError::new_err(msg)
        }
        Error::Data { .. }
        | Error::Tokenizer(_)
        | Error::Load(_)
        | Error::Corpus(_)
        | Error::Ctr(_)
        | Error::DlrmData(_)
        | Error::Fetch(_)
        | Error::Embedding(_)
        | Error::Batch(_) => DataError::new_err(msg),
        Error::Model { .. } | Error::Dlrm(_) | Error::SafeTensors(_) => ModelError::new_err(msg),
        Error::Run { .. }
        | Error::RunDir(_)
        | Error::Checkpoint(_)
        | Error::Io { .. }
        | Error::Write(_)
        | Error::Plot(_)
        | Error::Step(_)
        | Error::Memory(_) => RunError::new_err(msg),
        Error::Device(_) => DeviceError::new_err(msg),
        _ => ComeraError::new_err(msg),
    }
}

/// The error's message (the error and its sources), with what the command line says in flags
/// said in `comera.train` / `comera.resume` arguments.
fn in_python_words(e: &Error) -> String {
    use comera_train::run_dir::RunDirError;
    if let Error::RunDir(d) = e {
        if let RunDirError::Occupied { path, what } = d.as_ref() {
            return format!(
                "{}: {what}; continue it with comera.resume({:?}) (or Run.resume()), replace it with overwrite=True, or choose another out=",
                path.display(),
                path.display().to_string()
            );
        }
    }
    let msg = comera_train::error::Chain(e).to_string();
    // A finished run: `... To train it further: comera train --resume DIR --extend-epochs N`.
    let msg = match msg.split_once("To train it further: comera train --resume ") {
        Some((head, tail)) => {
            let dir = tail.strip_suffix(" --extend-epochs N").unwrap_or(tail);
            format!("{head}To train it further: comera.resume({dir:?}, extend_epochs=N)")
        }
        None => msg,
    };
    // The command line's flags that are arguments of comera.train / comera.resume.
    const ARGUMENTS: [(&str, &str); 9] = [
        ("--device cpu", "device=\"cpu\""),
        ("--device", "device"),
        ("--overwrite", "overwrite=True"),
        ("--extend-epochs", "extend_epochs"),
        ("--epochs", "epochs"),
        ("--batch-size", "batch_size"),
        ("--seed", "seed"),
        ("--stop-after-steps", "stop_after_steps"),
        ("--init-from", "init_from"),
    ];
    ARGUMENTS
        .iter()
        .fold(msg, |m, (flag, argument)| m.replace(flag, argument))
}

/// Runs `f`, turning a panic into a `ComeraError` (with the panic's text) and a comera error
/// into its exception.
pub fn guard<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let text = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            Err(ComeraError::new_err(format!(
                "internal error (a bug in comera; please report it): {text}"
            )))
        }
    }
}

/// `Result<T, comera_train::Error>` (or an error that becomes one, such as comera-run's) into a
/// `PyResult`.
pub trait IntoPy<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T, E: Into<Error>> IntoPy<T> for Result<T, E> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

/// A device string (`cpu`, `cuda`, `cuda:N`) of argument `what`; a bad one is a
/// `ConfigError` naming the argument and the accepted forms.
pub fn device_arg(what: &str, s: Option<&str>) -> PyResult<Option<comera_train::DeviceSpec>> {
    s.map(|s| {
        s.parse::<comera_train::DeviceSpec>()
            .map_err(|e| ConfigError::new_err(format!("{what}: {e}")))
    })
    .transpose()
}
