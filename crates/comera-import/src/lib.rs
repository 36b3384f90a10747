//! Moving weights in and out of comera.
//!
//! - [`bert`]: Hugging Face BERT checkpoints (a `.safetensors` file, or a `.zip` holding
//!   `model.safetensors` + `config.json`) loaded into a dense [`comera_model::Encoder`]; the name
//!   mapping between the two layouts (HF linear weights are (out, in), comera's (in, out));
//! - [`compress`]: TT/TTM layers initialised from the dense weights by TT-SVD
//!   ([`comera_tensor::ttsvd`]), with the reconstruction error of every layer;
//! - [`export`]: a dense export (reconstructed weights in the HF BERT layout, re-importable by
//!   [`bert`]) and a compressed export (cores, gates and the other parameters, with the model
//!   config in the file's metadata);
//! - [`hf`]: Hugging Face model directories both ways (`config.json`, `model.safetensors` with
//!   the `bert.` prefix, tokenizer files) and comera run directories written from them;
//! - [`minilm`]: all-MiniLM-L6-v2 (fetched from a package registry into the data cache) and the
//!   check of the dense import against reference hidden states computed independently
//!   (`tests/data/make_minilm_reference.py`, NumPy).

pub mod bert;
pub mod command;
pub mod compress;
pub mod export;
pub mod hf;
pub mod minilm;

pub use bert::{import_dense, load_bert, BertWeights, HfBertConfig};
pub use compress::{compress, CompressOptions, LayerReport};
pub use export::{densify, export_compressed, export_dense, load_compressed};

/// Anything that stops an import or export; names the file (or tensor) and what was expected.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {msg}")]
pub struct ImportError {
    /// The file, file member or tensor at fault.
    pub what: String,
    pub msg: String,
}

impl ImportError {
    pub fn new(what: impl Into<String>, msg: impl Into<String>) -> ImportError {
        ImportError {
            what: what.into(),
            msg: msg.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, ImportError>;
