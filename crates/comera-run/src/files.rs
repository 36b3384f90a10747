//! Files a run writes: atomic writes, model files (safetensors + TOML), the metrics log.
//!
//! Integrity: `model.safetensors` carries, in its metadata, `sha256` = [`digest`] of its
//! tensors (name, shape, bytes, in file order); `model.toml` starts with the stamp
//! `run_id` (the run that wrote it, see [`crate::run_dir`]) and `weights_sha256` (the same
//! digest), so a weights file that was damaged, or that belongs to another model, is refused by
//! every loader, and so is a non-finite weight (named).

use crate::error::{BoxError, Error, IoContext, Result};
use comera_dlrm::Dlrm;
use comera_layers::{Model, Param};
use comera_model::{Encoder, EncoderConfig};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Component, Path, PathBuf};

/// Why an atomic write failed: the target, the file the failing operation was on (the
/// temporary file or the target) and the I/O error.
#[derive(Debug, thiserror::Error)]
#[error("{}: {what}", .file.display())]
pub struct WriteError {
    /// The file that was to be written.
    pub path: PathBuf,
    /// The file the failing operation was on.
    pub file: PathBuf,
    /// What was being done ("cannot create", "cannot write", …).
    pub what: &'static str,
    #[source]
    pub source: std::io::Error,
}

/// A file that is not a whole safetensors file.
#[derive(Debug, thiserror::Error)]
#[error("not a complete safetensors file (truncated or corrupt?)")]
pub struct Incomplete(#[source] pub safetensors::SafeTensorError);

/// A tensor of a saved file (model weights, checkpoint) that the model cannot take.
#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    #[error("tensor `{0}` is missing")]
    Missing(String),
    /// A checkpoint's tensor of another shape than the model's parameter.
    #[error("tensor `{name}` has shape {shape:?}, the model expects {expected:?}")]
    Shape {
        name: String,
        shape: Vec<usize>,
        expected: Vec<usize>,
    },
    /// A weights file's tensor of another type or shape than the model's parameter.
    #[error("tensor `{name}` is {dtype:?} {shape:?}, expected F32 {expected:?}")]
    Layout {
        name: String,
        dtype: Dtype,
        shape: Vec<usize>,
        expected: Vec<usize>,
    },
    /// A checkpoint's tensor that is not F32.
    #[error("tensor `{name}` is {dtype:?}, expected F32")]
    Dtype { name: String, dtype: Dtype },
    /// An optimiser tensor with another number of values than the optimiser's state.
    #[error("tensor `{name}` has shape {shape:?}, expected {len} values")]
    Values {
        name: String,
        shape: Vec<usize>,
        len: usize,
    },
    /// A rank gate whose shape is not one positive length.
    #[error("tensor `{name}` has shape {shape:?}, expected one positive length (a rank)")]
    Gate { name: String, shape: Vec<usize> },
    #[error("tensor `{name}` holds a non-finite value ({value} at index {index})")]
    NotFinite {
        name: String,
        value: f32,
        index: usize,
    },
    /// Saved ranks a layer cannot take.
    #[error("{layer}: ranks {ranks:?}")]
    Ranks {
        layer: String,
        ranks: Vec<usize>,
        #[source]
        source: comera_layers::LayerError,
    },
}

/// Refuses a write target comera may not replace. Only an absent path or a regular file may be
/// written (by renaming a temporary file over it): a rename over a device, a FIFO, a socket or a
/// symlink would replace that node itself (as root, `export … /dev/null` replaced the system's
/// `/dev/null`), and a directory is not a file.
pub fn check_write_target(path: &Path) -> Result<(), WriteError> {
    let refuse = |kind: &str| {
        WriteError {
        path: path.to_path_buf(),
        file: path.to_path_buf(),
        what: "refused",
        source: std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("it is {kind}; comera writes only regular files and never replaces anything else (name a new file)"),
        ),
    }
    };
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(WriteError {
            path: path.to_path_buf(),
            file: path.to_path_buf(),
            what: "cannot inspect",
            source,
        }),
        Ok(m) if m.file_type().is_file() => Ok(()),
        Ok(m) => Err(refuse(comera_data::regular::file_kind(&m))),
    }
}

/// The temporary file [`write_atomic`] writes `path` through: `.NAME.tmp-PID` beside it (the
/// name [`remove_stale_temporaries`] recognises).
fn temporary_for(path: &Path) -> Result<PathBuf, WriteError> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| WriteError {
        path: path.to_path_buf(),
        file: path.to_path_buf(),
        what: "not a file path",
        source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
    })?;
    Ok(dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, flushed to
/// disk, then renamed over `path`. A crash leaves either the old file or the new one; a failed
/// write leaves no temporary file. `path` must be absent or a regular file
/// ([`check_write_target`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    Ok(write_atomic_then(path, bytes, || {})?)
}

/// [`write_atomic`] for contents that `fill` writes into the temporary file itself, piece by
/// piece: no buffer the size of the file is made.
pub fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut std::fs::File) -> std::io::Result<()>,
) -> Result<(), WriteError> {
    write_atomic_by(path, |_, f| fill(f), || {})
}

/// [`write_atomic`] with `before_rename` called between the flushed temporary file and the
/// rename (the window in which a crash must leave the old file intact).
pub fn write_atomic_then(
    path: &Path,
    bytes: &[u8],
    before_rename: impl FnOnce(),
) -> Result<(), WriteError> {
    write_atomic_by(path, |_, f| f.write_all(bytes), before_rename)
}

/// Writes a safetensors file atomically as [`write_atomic_then`] does, tensor by tensor: no
/// buffer the size of the file is made (a dense paper-sized model's checkpoint is 800 MB of
/// parameters and moments, which `safetensors::serialize` would copy whole before writing).
pub fn write_safetensors_then<'a>(
    path: &Path,
    tensors: Vec<(String, TensorView<'a>)>,
    meta: HashMap<String, String>,
    before_rename: impl FnOnce(),
) -> Result<(), WriteError> {
    write_atomic_by(
        path,
        |tmp, _| {
            safetensors::serialize_to_file(tensors, Some(meta), tmp).map_err(|e| match e {
                safetensors::SafeTensorError::IoError(io) => io,
                other => std::io::Error::other(other),
            })
        },
        before_rename,
    )
}

/// The framing of every atomic write: `fill` writes the temporary file (given by path and as
/// the file comera created new there), which is then flushed to disk, `before_rename` runs,
/// and it is renamed over `path`; on failure it is removed.
fn write_atomic_by(
    path: &Path,
    fill: impl FnOnce(&Path, &mut std::fs::File) -> std::io::Result<()>,
    before_rename: impl FnOnce(),
) -> Result<(), WriteError> {
    check_write_target(path)?;
    let fail = |file: &Path, what: &'static str, source: std::io::Error| WriteError {
        path: path.to_path_buf(),
        file: file.to_path_buf(),
        what,
        source,
    };
    let tmp = temporary_for(path)?;
    if let Some(dir) = tmp.parent() {
        std::fs::create_dir_all(dir).map_err(|e| fail(dir, "cannot create directory", e))?;
    }
    // A leftover of this pid (or a symlink planted there) is removed, never written through:
    // the temporary file is created new.
    let _ = std::fs::remove_file(&tmp);
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| fail(&tmp, "cannot create", e))
        .and_then(|mut f| {
            // fsync flushes the file, whichever handle wrote it.
            fill(&tmp, &mut f)
                .and_then(|_| f.sync_all())
                .map_err(|e| fail(&tmp, "cannot write", e))
        })
        .and_then(|()| {
            before_rename();
            // Checked again: the target may have changed while the bytes were written.
            check_write_target(path)?;
            std::fs::rename(&tmp, path).map_err(|e| fail(path, "cannot rename into place", e))
        });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// What a saved model needs besides its weights.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelMeta {
    /// The stamp [`save_model_files`] writes (absent in the text a checkpoint holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights_sha256: Option<String>,
    /// SHA-256 of the rest of `model.toml` (see [`save_model_files`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta_sha256: Option<String>,
    pub model: EncoderConfig,
    /// Label names, in label order.
    pub labels: Vec<String>,
    /// The vocabulary the model was trained with.
    pub vocab: PathBuf,
    /// Whether inputs are sentence pairs.
    pub pair: bool,
    pub epoch: usize,
    pub step: u64,
}

pub const MODEL_WEIGHTS: &str = "model.safetensors";
pub const MODEL_META: &str = "model.toml";

/// What a saved DLRM needs besides its weights (`model.toml`, with `kind = "dlrm"`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DlrmMeta {
    /// The stamp [`save_model_files`] writes (absent in the text a checkpoint holds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights_sha256: Option<String>,
    /// SHA-256 of the rest of `model.toml` (see [`save_model_files`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub meta_sha256: Option<String>,
    /// Always `dlrm`: tells a DLRM's `model.toml` from an encoder's.
    pub kind: String,
    pub model: comera_dlrm::DlrmConfig,
    pub n_dense: usize,
    pub field_names: Vec<String>,
    pub table_sizes: Vec<usize>,
    /// Each table as built (`dense 943x32`, `ttm 943x32 v=… e=… r=…`).
    pub tables: Vec<String>,
    pub epoch: usize,
    pub step: u64,
}

/// A model saved in a run directory, of whichever kind.
#[allow(clippy::large_enum_variant)]
pub enum SavedModel {
    Encoder(Encoder, ModelMeta),
    Dlrm(Dlrm, DlrmMeta),
}

/// `path` made absolute with symbolic links resolved as far as it exists (the rest appended
/// as given, `..` and `.` taken lexically): two spellings of one place compare equal.
pub fn resolved(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut lexical = PathBuf::new();
    for c in absolute.components() {
        match c {
            Component::ParentDir => {
                lexical.pop();
            }
            Component::CurDir => {}
            other => lexical.push(other),
        }
    }
    let mut existing = lexical.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(real) = existing.canonicalize() {
            return rest.iter().rev().fold(real, |p, c| p.join(c));
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                existing = parent;
            }
            _ => return lexical,
        }
    }
}

/// SHA-256 of a text, hex.
pub fn sha256_hex(text: &str) -> String {
    digest(std::iter::once(("", &[][..], text.as_bytes())))
}

/// Hash of (name, shape, bytes) of every tensor, in the given order (hex SHA-256). Lengths are
/// hashed before each field, so no two different sequences share a preimage.
pub fn digest<'a>(items: impl Iterator<Item = (&'a str, &'a [usize], &'a [u8])>) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for (name, shape, bytes) in items {
        h.update((name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        for d in shape {
            h.update((*d as u64).to_le_bytes());
        }
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Little-endian bytes of `v` (the safetensors F32 payload).
pub fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A tensor to save: name, shape and safetensors payload ([`f32_payload`]).
pub type NamedPayload<'a> = (String, &'a [usize], Cow<'a, [u8]>);

/// The safetensors F32 payload of `v` without a copy where the machine is little-endian (its
/// memory is the payload), else [`le_bytes`].
pub fn f32_payload(v: &[f32]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        Cow::Owned(le_bytes(v))
    }
}

/// The metadata entries a digest covers (all but `sha256`), sorted by key, as [`digest`] items
/// (key, no shape, the value's bytes).
pub(crate) fn meta_items(
    meta: &HashMap<String, String>,
) -> impl Iterator<Item = (&str, &[usize], &[u8])> {
    let mut keys: Vec<&String> = meta.keys().filter(|k| *k != "sha256").collect();
    keys.sort();
    keys.into_iter()
        .map(move |k| (k.as_str(), &[][..], meta[k].as_bytes()))
}

/// Writes the F32 `tensors` as the safetensors file `path` ([`write_safetensors_then`]:
/// atomically, streamed from the payloads), with `meta` and one more entry, `sha256`: the
/// [`digest`] of `meta`'s entries ([`meta_items`]) and then of the tensors in file order
/// (safetensors orders them by name). Returns the digest.
pub(crate) fn write_digested_safetensors(
    path: &Path,
    mut tensors: Vec<NamedPayload<'_>>,
    mut meta: HashMap<String, String>,
    before_rename: impl FnOnce(),
) -> Result<String> {
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let sha =
        digest(meta_items(&meta).chain(tensors.iter().map(|(n, s, b)| (n.as_str(), *s, &b[..]))));
    meta.insert("sha256".into(), sha.clone());
    write_safetensors_then(path, payload_views(&tensors)?, meta, before_rename)?;
    Ok(sha)
}

/// The safetensors F32 views of `tensors`' payloads (no copy).
fn payload_views<'a>(tensors: &'a [NamedPayload<'_>]) -> Result<Vec<(String, TensorView<'a>)>> {
    Ok(tensors
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(Dtype::F32, s.to_vec(), b)?)))
        .collect::<std::result::Result<_, safetensors::SafeTensorError>>()?)
}

/// Writes `model.safetensors`: every parameter by name, with `sha256` = [`digest`] of the
/// tensors in file order as its metadata, atomically. Returns the digest.
pub fn save_weights(dir: &Path, params: &[&Param]) -> Result<String> {
    let tensors = params
        .iter()
        .map(|p| (p.name.clone(), p.shape.as_slice(), f32_payload(&p.value)))
        .collect();
    // No metadata but the digest: safetensors writes its metadata map in hash order, so a
    // second key would make two saves of the same weights differ in their bytes.
    write_digested_safetensors(&dir.join(MODEL_WEIGHTS), tensors, HashMap::new(), || {})
}

/// The stamp keys that head a `model.toml`, in order; the text after them is what
/// `meta_sha256` covers.
const STAMP_KEYS: [&str; 3] = ["run_id", "weights_sha256", "meta_sha256"];

/// A `model.toml` text split into its stamp lines and the rest (what `meta_sha256` covers).
fn split_stamp(text: &str) -> (&str, &str) {
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        let key = line.split_once(" = \"").map(|(k, _)| k);
        if !key.is_some_and(|k| STAMP_KEYS.contains(&k)) {
            break;
        }
        at += line.len();
    }
    text.split_at(at)
}

/// Saves `model.safetensors` and `model.toml` (`meta_toml`, stamped with `run_id`, the
/// weights' digest and its own digest `meta_sha256`, so an edited file is refused, not used)
/// into `dir`, each atomically; the weights are written first so a meta file never points at
/// missing weights.
pub fn save_model_files(
    dir: &Path,
    params: &[&Param],
    meta_toml: &str,
    run_id: Option<&str>,
) -> Result<()> {
    let sha = save_weights(dir, params)?;
    // Root keys go before the first table header of the serialised meta.
    let mut text = String::new();
    if let Some(id) = run_id {
        text.push_str(&format!("run_id = \"{id}\"\n"));
    }
    text.push_str(&format!("weights_sha256 = \"{sha}\"\n"));
    text.push_str(&format!("meta_sha256 = \"{}\"\n", sha256_hex(meta_toml)));
    text.push_str(meta_toml);
    write_atomic(&dir.join(MODEL_META), text.as_bytes())
}

/// Saves an encoder (`model.safetensors` + `model.toml`) outside a training run.
pub fn save_model(dir: &Path, model: &Encoder, meta: &ModelMeta) -> Result<()> {
    let meta = ModelMeta {
        run_id: None,
        weights_sha256: None,
        meta_sha256: None,
        ..meta.clone()
    };
    let run_id = meta_run_id(dir);
    save_model_files(
        dir,
        &model.params(),
        &toml::to_string_pretty(&meta)?,
        run_id.as_deref(),
    )
}

/// The run id of the run directory `dir` (from its `run.toml`), if it is one.
fn meta_run_id(dir: &Path) -> Option<String> {
    crate::identity::RunIdentity::read(dir).ok().map(|r| r.id)
}

/// Loads an encoder saved by [`save_model`]; every parameter must be present with its shape.
pub fn load_model(dir: &Path) -> Result<(Encoder, ModelMeta)> {
    match load_saved(dir)? {
        SavedModel::Encoder(m, meta) => Ok((m, meta)),
        SavedModel::Dlrm(..) => Err(Error::model(format!(
            "{}: holds a DLRM; this needs an encoder (a text model)",
            dir.join(MODEL_META).display()
        ))),
    }
}

/// The run's own copy of its vocabulary, beside `model.toml`.
pub const RUN_VOCAB: &str = "vocab.txt";

impl SavedModel {
    /// Resolves the vocabulary of an encoder saved in (or checkpointed by) run directory
    /// `dir`: a relative path is the run's own file; an absolute one that no longer exists (a
    /// run copied from another machine) falls back to the run's copy when it has one.
    pub fn resolve_vocab(&mut self, dir: &Path) {
        if let SavedModel::Encoder(_, meta) = self {
            let own = dir.join(RUN_VOCAB);
            if meta.vocab.is_relative() {
                meta.vocab = dir.join(&meta.vocab);
            } else if !meta.vocab.exists() && own.exists() {
                meta.vocab = own;
            }
        }
    }
}

/// Loads the model saved in a run directory, of whichever kind `model.toml` says.
pub fn load_saved(dir: &Path) -> Result<SavedModel> {
    let meta_path = dir.join(MODEL_META);
    if !meta_path.exists() && dir.join("config.json").is_file() {
        // The commonest mistake: naming a downloaded model where a comera model is wanted.
        return Err(Error::model(format!(
            "{}: a Hugging Face model directory (config.json), not a comera model (no model.toml): import it first with `comera import hf {} --out RUN` (with --seq-len as in your config), then name RUN",
            dir.display(),
            dir.display()
        )));
    }
    let text = comera_data::read_regular_to_string(&meta_path).io(&meta_path, "cannot read")?;
    let mut saved = SavedModel::from_meta(&meta_path, &text)?;
    let (_, body) = split_stamp(&text);
    match saved.meta_sha256() {
        None => return Err(Error::model(format!(
            "{}: no `meta_sha256` (written by an older comera?); the file cannot be checked",
            meta_path.display()
        ))),
        Some(sha) if sha != sha256_hex(body) => return Err(Error::model(format!(
            "{}: model.toml does not match its digest (meta_sha256): it was edited after comera wrote it; restore it (a checkpoint holds the model's settings too)",
            meta_path.display()
        ))),
        Some(_) => {}
    }
    let (run_id, sha) = saved.stamp();
    let Some(sha) = sha.map(str::to_string) else {
        return Err(Error::model(format!(
            "{}: no `weights_sha256` (written by an older comera?); the weights cannot be checked",
            meta_path.display()
        )));
    };
    if let (Some(id), Ok(own)) = (run_id, crate::identity::RunIdentity::read(dir)) {
        if id != own.id {
            return Err(Error::model(format!(
                "{}: written by run {id}, but the directory is run {} ({}); the model files belong to another run",
                meta_path.display(),
                own.id,
                dir.join(crate::identity::IDENTITY).display()
            )));
        }
    }
    load_weights(&dir.join(MODEL_WEIGHTS), saved.model_mut(), Some(&sha))?;
    saved.resolve_vocab(dir);
    Ok(saved)
}

impl SavedModel {
    /// A freshly initialised model of the kind and shape `model.toml` text describes (`path`
    /// names it in errors); fill its weights with [`load_weights`].
    pub fn from_meta(path: &Path, text: &str) -> Result<SavedModel> {
        let kind = text
            .parse::<toml::Table>()
            .map_err(|e| Error::parse(path, e))?
            .get("kind")
            .and_then(|k| k.as_str().map(str::to_string));
        Ok(match kind.as_deref() {
            Some("dlrm") => {
                let meta: DlrmMeta = toml::from_str(text).map_err(|e| Error::parse(path, e))?;
                let model = Dlrm::new(
                    &meta.model,
                    meta.n_dense,
                    &meta.field_names,
                    &meta.table_sizes,
                    0,
                )
                .map_err(|e| Error::model_with(path.display().to_string(), e))?;
                SavedModel::Dlrm(model, meta)
            }
            None => {
                let meta: ModelMeta = toml::from_str(text).map_err(|e| Error::parse(path, e))?;
                let model = Encoder::new(&meta.model, 0)
                    .map_err(|e| Error::model_with(path.display().to_string(), e))?;
                SavedModel::Encoder(model, meta)
            }
            Some(k) => {
                return Err(Error::model(format!(
                    "{}: kind `{k}` is not `dlrm` (or absent, for an encoder)",
                    path.display()
                )))
            }
        })
    }

    /// The digest of the rest of the `model.toml` it was read from.
    fn meta_sha256(&self) -> Option<&str> {
        match self {
            SavedModel::Encoder(_, m) => m.meta_sha256.as_deref(),
            SavedModel::Dlrm(_, m) => m.meta_sha256.as_deref(),
        }
    }

    /// The stamp of the `model.toml` it was read from: (run id, weights digest).
    fn stamp(&self) -> (Option<&str>, Option<&str>) {
        let (id, sha) = match self {
            SavedModel::Encoder(_, m) => (&m.run_id, &m.weights_sha256),
            SavedModel::Dlrm(_, m) => (&m.run_id, &m.weights_sha256),
        };
        (id.as_deref(), sha.as_deref())
    }

    pub fn model(&self) -> &dyn Model {
        match self {
            SavedModel::Encoder(m, _) => m,
            SavedModel::Dlrm(m, _) => m,
        }
    }

    pub fn model_mut(&mut self) -> &mut dyn Model {
        match self {
            SavedModel::Encoder(m, _) => m,
            SavedModel::Dlrm(m, _) => m,
        }
    }
}

/// Fills `model` from a weights file: checks its digest (the one in its metadata, and
/// `expected_sha256` from `model.toml` when given), re-shapes the model to the saved ranks, then
/// fills every parameter by name (missing, mis-shaped or non-finite tensors are errors naming
/// them).
pub fn load_weights(
    wpath: &Path,
    model: &mut dyn Model,
    expected_sha256: Option<&str>,
) -> Result<()> {
    let bytes = comera_data::read_regular(wpath).io(wpath, "cannot read")?;
    let named = |e: BoxError| Error::model_with(wpath.display().to_string(), e);
    let incomplete = |e: safetensors::SafeTensorError| named(Box::new(Incomplete(e)));
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(incomplete)?;
    let st = SafeTensors::deserialize(&bytes).map_err(incomplete)?;
    let saved_sha = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get("sha256"))
        .ok_or_else(|| {
            Error::model(format!(
                "{}: no `sha256` in its metadata (written by an older comera?)",
                wpath.display()
            ))
        })?;
    let mut names = st.names();
    names.sort();
    let views = names
        .iter()
        .map(|&n| st.tensor(n).map(|t| (n, t)))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| named(e.into()))?;
    let sha = digest(views.iter().map(|(n, t)| (*n, t.shape(), t.data())));
    if &sha != saved_sha {
        return Err(Error::model(format!(
            "{}: content hash mismatch (the file was modified or damaged after it was written)",
            wpath.display()
        )));
    }
    if let Some(expected) = expected_sha256.filter(|e| *e != sha) {
        return Err(Error::model(format!(
            "{}: its weights (sha256 {}…) are not the ones model.toml names ({}…): the pair is from different models, or a save was interrupted (use the newest checkpoint)",
            wpath.display(),
            &sha[..12],
            &expected[..expected.len().min(12)]
        )));
    }
    reshape_ranks(model, &|name| {
        st.tensor(name).ok().map(|t| t.shape().to_vec())
    })
    .map_err(|e| named(e.into()))?;
    let mut err: Option<TensorError> = None;
    model.visit_params_mut(&mut |p| {
        if err.is_some() {
            return;
        }
        let r = (|| {
            let t = st
                .tensor(&p.name)
                .map_err(|_| TensorError::Missing(p.name.clone()))?;
            if t.dtype() != Dtype::F32 || t.shape() != p.shape.as_slice() {
                return Err(TensorError::Layout {
                    name: p.name.clone(),
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                    expected: p.shape.clone(),
                });
            }
            for (v, c) in p.value.iter_mut().zip(t.data().chunks_exact(4)) {
                *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            check_finite(p)
        })();
        if let Err(e) = r {
            err = Some(e);
        }
    });
    err.map_or(Ok(()), |e| Err(named(e.into())))
}

/// Refuses a parameter holding NaN or ±∞, naming it and the first bad entry.
pub fn check_finite(p: &Param) -> Result<(), TensorError> {
    match p.value.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(index) => Err(TensorError::NotFinite {
            name: p.name.clone(),
            value: p.value[index],
            index,
        }),
    }
}

/// Gives every TT/TTM layer of `model` the ranks its saved gates have (a truncated model is
/// saved with its physical ranks), so its parameters can then be filled in by name.
/// `saved_shape(name)` is the shape of the saved tensor of that parameter name, if any.
pub fn reshape_ranks(
    model: &mut dyn Model,
    saved_shape: &dyn Fn(&str) -> Option<Vec<usize>>,
) -> Result<(), TensorError> {
    let mut err: Option<TensorError> = None;
    model.visit_compressible_mut(&mut |layer| {
        if err.is_some() {
            return;
        }
        let now = layer.ranks();
        let mut ranks = vec![1];
        for k in 1..now.len() - 1 {
            let name = format!("{}.gate.{k}", layer.layer_name());
            match saved_shape(&name) {
                Some(s) if s.len() == 1 && s[0] > 0 => ranks.push(s[0]),
                Some(s) => {
                    err = Some(TensorError::Gate { name, shape: s });
                    return;
                }
                None => {
                    err = Some(TensorError::Missing(name));
                    return;
                }
            }
        }
        ranks.push(1);
        if ranks != now {
            if let Err(source) = layer.set_ranks(&ranks) {
                err = Some(TensorError::Ranks {
                    layer: layer.layer_name().to_string(),
                    ranks,
                    source,
                });
            }
        }
    });
    err.map_or(Ok(()), Err)
}

/// Appends JSON lines to the run's metrics log.
pub struct MetricsLog {
    file: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
}

impl MetricsLog {
    /// Starts a new log (a fresh run), replacing a regular file of that name.
    pub fn create(path: &Path) -> Result<MetricsLog> {
        check_write_target(path)?;
        let f = std::fs::File::create(path).io(path, "cannot create")?;
        Ok(MetricsLog {
            file: std::io::BufWriter::new(f),
            path: path.to_path_buf(),
        })
    }

    /// Opens an existing log to append to (a resumed run). Only a regular file: opening a FIFO
    /// for writing would wait for a reader.
    pub fn append(path: &Path) -> Result<MetricsLog> {
        check_write_target(path)?;
        let f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .io(path, "cannot open for appending")?;
        Ok(MetricsLog {
            file: std::io::BufWriter::new(f),
            path: path.to_path_buf(),
        })
    }

    pub fn write(&mut self, record: &serde_json::Value) -> Result<()> {
        writeln!(self.file, "{record}")
            .and_then(|_| self.file.flush())
            .io(&self.path, "cannot write")
    }
}

/// Writes a DLRM as the safetensors file `path` (atomically, streamed from the parameters'
/// own memory), `model.toml` in its metadata (`format` `comera-dlrm`, `model`): with `dense`,
/// every TTM table reconstructed as its dense V × D matrix (named `<table>.weight`), the rest
/// as trained; without, the parameters as trained (cores and gates).
pub fn export_dlrm(path: &Path, model: &Dlrm, meta: &DlrmMeta, dense: bool) -> Result<()> {
    // The dense tables are made first: the payloads below borrow them.
    let dense_tables: Vec<(String, Vec<usize>, Vec<f32>)> = model
        .tables
        .iter()
        .filter_map(|t| match (t, dense) {
            (comera_layers::AnyEmbedding::Ttm(e), true) => Some((
                format!("{}.weight", comera_layers::Compressible::layer_name(e)),
                vec![t.rows(), t.dim()],
                e.dense_table(),
            )),
            _ => None,
        })
        .collect();
    fn as_payload(p: &Param) -> NamedPayload<'_> {
        (p.name.clone(), &p.shape[..], f32_payload(&p.value))
    }
    let mut tensors: Vec<NamedPayload<'_>> =
        model.bottom.params().into_iter().map(as_payload).collect();
    for t in &model.tables {
        if !(dense && matches!(t, comera_layers::AnyEmbedding::Ttm(_))) {
            tensors.extend(t.params().into_iter().map(as_payload));
        }
    }
    tensors.extend(model.top.params().into_iter().map(as_payload));
    tensors.extend(
        dense_tables
            .iter()
            .map(|(n, s, v)| (n.clone(), &s[..], f32_payload(v))),
    );
    let metadata = [
        ("format".to_string(), "comera-dlrm".to_string()),
        (
            "tables".to_string(),
            if dense { "dense" } else { "as trained" }.to_string(),
        ),
        ("model".to_string(), toml::to_string_pretty(meta)?),
    ]
    .into_iter()
    .collect();
    write_safetensors_then(path, payload_views(&tensors)?, metadata, || {})?;
    Ok(())
}

/// Writes the directory `dir` as one unit: `write` fills a fresh temporary directory beside it
/// (`.NAME.tmp-PID`), which then takes `dir`'s place in one atomic exchange (Linux
/// `renameat2(RENAME_EXCHANGE)`; elsewhere two renames), so a reader sees the old directory or
/// the new one, never a mix, and a failed or killed write leaves `dir` as it was (its temporary
/// is removed, or by the next write if the process was killed). `dir` must be absent or a
/// directory; the caller decides whether an existing one may be replaced.
///
/// `write`'s error is returned as it is; the function's own (I/O) errors are converted into
/// its type.
pub fn replace_dir_atomic<E: From<Error>>(
    dir: &Path,
    write: impl FnOnce(&Path) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = dir
        .file_name()
        .ok_or_else(|| Error::run(format!("{}: not a directory name", dir.display())))?;
    std::fs::create_dir_all(parent).io(parent, "cannot create directory")?;
    remove_stale_temporaries(parent);
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir(&tmp).io(&tmp, "cannot create")?;
    let placed = write(&tmp).and_then(|()| {
        let exists = std::fs::symlink_metadata(dir).is_ok();
        if !exists {
            return Ok(std::fs::rename(&tmp, dir).io(dir, "cannot rename into place")?);
        }
        Ok(exchange(&tmp, dir).io(dir, "cannot swap the new directory in")?)
    });
    // Now `tmp` holds the replaced directory (or the failed new one): either way, it goes.
    let _ = std::fs::remove_dir_all(&tmp);
    placed
}

/// Swaps two directory entries atomically (Linux `renameat2` with `RENAME_EXCHANGE`); where the
/// file system cannot, `b` is renamed aside and `a` into its place (a short window without
/// `b`, never a mix).
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
    };
    let (ca, cb) = (c(a)?, c(b)?);
    // SAFETY: two NUL-terminated paths that outlive the call.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if !matches!(err.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOSYS)) {
        return Err(err);
    }
    let mut aside = a.as_os_str().to_owned();
    aside.push(".old");
    let aside = PathBuf::from(aside);
    std::fs::rename(b, &aside)?;
    std::fs::rename(a, b)?;
    std::fs::rename(&aside, a)
}

/// Removes temporary files and directories (`.NAME.tmp-PID`, left by [`write_atomic`] and
/// [`replace_dir_atomic`]) of processes that no longer run from `dir`; returns how many. (Where
/// /proc is missing nothing is removed.)
pub fn remove_stale_temporaries(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix('.')
            .and_then(|n| n.rsplit_once(".tmp-"))
            .and_then(|(_, pid)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let alive = Path::new("/proc").join(pid.to_string()).exists();
        if alive || !Path::new("/proc/self").exists() {
            continue;
        }
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        let gone = if is_dir {
            std::fs::remove_dir_all(e.path())
        } else {
            std::fs::remove_file(e.path())
        };
        removed += usize::from(gone.is_ok());
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_dlrm() -> Dlrm {
        let cfg = comera_dlrm::DlrmConfig::default();
        Dlrm::new(&cfg, 2, &["user".to_string()], &[10], 0).unwrap()
    }

    #[test]
    fn a_streamed_safetensors_write_has_the_bytes_of_a_buffered_one_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("comera-files-stream-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = [1.5f32, -2.0, 3.25, 0.0, 7.0, -0.5];
        let b = [0.125f32; 3];
        let (pa, pb) = (f32_payload(&a), f32_payload(&b));
        let views = || -> Vec<(String, TensorView<'_>)> {
            vec![
                (
                    "b".into(),
                    TensorView::new(Dtype::F32, vec![3], &pb).unwrap(),
                ),
                (
                    "a".into(),
                    TensorView::new(Dtype::F32, vec![2, 3], &pa).unwrap(),
                ),
            ]
        };
        let meta = || [("k".to_string(), "v".to_string())].into_iter().collect();
        let path = dir.join("t.safetensors");
        write_safetensors_then(&path, views(), meta(), || {}).unwrap();
        let buffered = safetensors::serialize(views(), Some(meta())).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), buffered);
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "a temporary file was left"
        );
        // The payload is the values' little-endian bytes, as the reader expects.
        let st = SafeTensors::deserialize(&buffered).unwrap();
        assert_eq!(st.tensor("a").unwrap().data(), &le_bytes(&a)[..]);
        // A target that is not a regular file is refused, and nothing is written.
        let link = dir.join("link.safetensors");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        let err = write_safetensors_then(&link, views(), meta(), || {}).unwrap_err();
        assert_eq!(err.what, "refused", "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), buffered);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_non_finite_weight_is_refused_by_name_even_with_a_valid_hash() {
        let dir = std::env::temp_dir().join(format!("comera-files-nan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut model = tiny_dlrm();
        let mut named = String::new();
        model.visit_params_mut(&mut |p| {
            if named.is_empty() {
                p.value[0] = f32::NAN;
                named = p.name.clone();
            }
        });
        let sha = save_weights(&dir, &model.params()).unwrap();
        let err = load_weights(&dir.join(MODEL_WEIGHTS), &mut tiny_dlrm(), Some(&sha)).unwrap_err();
        let err = crate::error::Chain(&err).to_string();
        assert!(err.contains("non-finite") && err.contains(&named), "{err}");
        // The same file with a finite value loads, and checks its digest against model.toml's.
        let good = tiny_dlrm();
        let sha = save_weights(&dir, &good.params()).unwrap();
        load_weights(&dir.join(MODEL_WEIGHTS), &mut tiny_dlrm(), Some(&sha)).unwrap();
        let err = load_weights(&dir.join(MODEL_WEIGHTS), &mut tiny_dlrm(), Some("00"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("not the ones model.toml names"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
