//! The crate's error type: what went wrong, with the typed error of the layer below as its
//! source (never flattened into the message). A message never repeats its source: the
//! command line prints the chain with `{:#}` (`message: source: source…`).

use std::path::{Path, PathBuf};

pub use comera_report::plot::PlotError;
pub use comera_run::error::{
    BoxError, Chain, CheckpointError, ConfigError, IoContext, RunDirError, TensorError, WriteError,
};

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything a run, an evaluation or a model file can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A config field or a command-line flag the run cannot use (names the file and field).
    #[error(transparent)]
    Config(Box<ConfigError>),
    /// A file or directory that cannot be read, created, listed, …: `PATH: cannot …`, then
    /// the system's reason.
    #[error("{}: {action}", .path.display())]
    Io {
        path: PathBuf,
        /// What was being done (`cannot read`, `cannot create directory`, …).
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// An atomic write that failed.
    #[error(transparent)]
    Write(Box<WriteError>),
    /// A file (TOML, JSON) that does not parse: the file, then the parser's reason.
    #[error("{}", .path.display())]
    Parse {
        path: PathBuf,
        #[source]
        source: BoxError,
    },
    /// A checkpoint that cannot be read or used.
    #[error(transparent)]
    Checkpoint(Box<CheckpointError>),
    /// A run directory that cannot be created, resumed or locked.
    #[error(transparent)]
    RunDir(Box<RunDirError>),
    /// A figure that cannot be drawn or written.
    #[error(transparent)]
    Plot(Box<PlotError>),
    /// The data: a source, a file of examples, a tokenizer or vocabulary, a batch.
    #[error("{what}")]
    Data {
        what: String,
        #[source]
        source: Option<BoxError>,
    },
    /// A model: saved files that cannot be used, a model that cannot be built or run.
    #[error("{what}")]
    Model {
        what: String,
        #[source]
        source: Option<BoxError>,
    },
    /// The run itself: its processes, its evaluation, its outputs.
    #[error("{what}")]
    Run {
        what: String,
        #[source]
        source: Option<BoxError>,
    },
    /// A training step that could not be taken (diverged, data ended, a bad batch).
    #[error(transparent)]
    Step(#[from] comera_optim::StepError),
    /// The device of `train.device` / `--device`: missing, failed, or not doing what the run
    /// asks for yet (the CLI's exit status 2).
    #[error(transparent)]
    Device(#[from] crate::device::DeviceError),
    /// A model config that cannot build a model (names the field).
    #[error(transparent)]
    ModelConfig(#[from] comera_model::ConfigError),
    /// A model that would not fit in the memory left.
    #[error(transparent)]
    Memory(#[from] comera_model::MemoryError),
    /// A batch the model's state cannot take (its shape, its token ids).
    #[error(transparent)]
    Batch(#[from] comera_model::BatchError),
    /// A DLRM that cannot be built or take a batch.
    #[error(transparent)]
    Dlrm(#[from] comera_dlrm::DlrmError),
    /// A tokenizer or vocabulary.
    #[error(transparent)]
    Tokenizer(Box<comera_data::tokenizer::TokenizerError>),
    /// A file of labelled examples.
    #[error(transparent)]
    Load(Box<comera_data::loaders::LoadError>),
    /// Token ids out of an embedding's range.
    #[error(transparent)]
    Embedding(Box<comera_layers::embedding::EmbeddingError>),
    /// A masked-LM corpus.
    #[error(transparent)]
    Corpus(Box<comera_data::corpus::CorpusError>),
    /// Click-through data.
    #[error(transparent)]
    Ctr(Box<comera_data::ctr::CtrError>),
    /// Tensors that cannot be serialised as safetensors.
    #[error(transparent)]
    SafeTensors(Box<safetensors::SafeTensorError>),
    /// A value that cannot be written as TOML.
    #[error(transparent)]
    TomlSer(Box<toml::ser::Error>),
    /// A value that cannot be written or read as JSON.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// The DLRM's data (comera-dlrm's preparation and batching), passed on as it is.
    #[error(transparent)]
    DlrmData(BoxError),
    /// A data set that cannot be fetched.
    #[error(transparent)]
    Fetch(Box<comera_data::fetch::FetchError>),
}

/// `From` for the boxed variants (boxed to keep `Result<T, Error>` small).
macro_rules! boxed_from {
    ($($variant:ident($ty:ty),)*) => {
        $(impl From<$ty> for Error {
            fn from(e: $ty) -> Error {
                Error::$variant(Box::new(e))
            }
        })*
    };
}

boxed_from! {
    Config(ConfigError),
    Write(WriteError),
    Checkpoint(CheckpointError),
    RunDir(RunDirError),
    Plot(PlotError),
    Tokenizer(comera_data::tokenizer::TokenizerError),
    Corpus(comera_data::corpus::CorpusError),
    Ctr(comera_data::ctr::CtrError),
    Fetch(comera_data::fetch::FetchError),
    Load(comera_data::loaders::LoadError),
    Embedding(comera_layers::embedding::EmbeddingError),
    SafeTensors(safetensors::SafeTensorError),
    TomlSer(toml::ser::Error),
}

impl Error {
    /// [`Error::Data`] without a source.
    pub fn data(what: impl Into<String>) -> Error {
        Error::Data {
            what: what.into(),
            source: None,
        }
    }

    /// [`Error::Data`]: `what`, caused by `source`.
    pub fn data_with(what: impl Into<String>, source: impl Into<BoxError>) -> Error {
        Error::Data {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    /// [`Error::Model`] without a source.
    pub fn model(what: impl Into<String>) -> Error {
        Error::Model {
            what: what.into(),
            source: None,
        }
    }

    /// [`Error::Model`]: `what`, caused by `source`.
    pub fn model_with(what: impl Into<String>, source: impl Into<BoxError>) -> Error {
        Error::Model {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    /// [`Error::Run`] without a source.
    pub fn run(what: impl Into<String>) -> Error {
        Error::Run {
            what: what.into(),
            source: None,
        }
    }

    /// [`Error::Run`]: `what`, caused by `source`.
    pub fn run_with(what: impl Into<String>, source: impl Into<BoxError>) -> Error {
        Error::Run {
            what: what.into(),
            source: Some(source.into()),
        }
    }

    /// [`Error::Io`].
    pub fn io(path: &Path, action: &'static str, source: std::io::Error) -> Error {
        Error::Io {
            path: path.to_path_buf(),
            action,
            source,
        }
    }

    /// [`Error::Parse`].
    pub fn parse(path: &Path, source: impl Into<BoxError>) -> Error {
        Error::Parse {
            path: path.to_path_buf(),
            source: source.into(),
        }
    }
}

/// A run storage error (comera-run's) as the same variant of ours.
impl From<comera_run::Error> for Error {
    fn from(e: comera_run::Error) -> Error {
        use comera_run::Error as Run;
        match e {
            Run::Config(e) => Error::Config(e),
            Run::Io {
                path,
                action,
                source,
            } => Error::Io {
                path,
                action,
                source,
            },
            Run::Write(e) => Error::Write(e),
            Run::Parse { path, source } => Error::Parse { path, source },
            Run::Checkpoint(e) => Error::Checkpoint(e),
            Run::RunDir(e) => Error::RunDir(e),
            Run::Model { what, source } => Error::Model { what, source },
            Run::Run { what, source } => Error::Run { what, source },
            Run::SafeTensors(e) => Error::SafeTensors(e),
            Run::TomlSer(e) => Error::TomlSer(e),
            Run::Json(e) => Error::Json(e),
        }
    }
}

/// A report's error (comera-report's) as the same variant of ours.
impl From<comera_report::Error> for Error {
    fn from(e: comera_report::Error) -> Error {
        match e {
            comera_report::Error::Run(e) => e.into(),
            comera_report::Error::Plot(e) => Error::Plot(e),
        }
    }
}
