//! Files a run writes: atomic writes, model files (safetensors + TOML), the metrics log.

use anyhow::{anyhow, bail, Context};
use comera_dlrm::Dlrm;
use comera_layers::{Model, Param};
use comera_model::{Encoder, EncoderConfig};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, flushed to
/// disk, then renamed over `path`. A crash leaves either the old file or the new one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    write_atomic_then(path, bytes, || {})
}

/// [`write_atomic`] with `before_rename` called between the flushed temporary file and the
/// rename (the window in which a crash must leave the old file intact).
pub fn write_atomic_then(
    path: &Path,
    bytes: &[u8],
    before_rename: impl FnOnce(),
) -> anyhow::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)
        .with_context(|| format!("{}: cannot create directory", dir.display()))?;
    let name = path
        .file_name()
        .ok_or_else(|| anyhow!("{}: not a file path", path.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let mut f =
        std::fs::File::create(&tmp).with_context(|| format!("{}: cannot create", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .with_context(|| format!("{}: cannot write", tmp.display()))?;
    drop(f);
    before_rename();
    std::fs::rename(&tmp, path)
        .with_context(|| format!("{}: cannot rename into place", path.display()))?;
    Ok(())
}

/// What a saved model needs besides its weights.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelMeta {
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

/// Writes `model.safetensors`: every parameter by name, atomically.
pub fn save_weights(dir: &Path, params: &[&Param]) -> anyhow::Result<()> {
    let bytes: Vec<Vec<u8>> = params
        .iter()
        .map(|p| p.value.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, TensorView<'_>)> = params
        .iter()
        .zip(&bytes)
        .map(|(p, b)| {
            Ok((
                p.name.clone(),
                TensorView::new(Dtype::F32, p.shape.clone(), b)?,
            ))
        })
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    let data = safetensors::serialize(views, None)?;
    write_atomic(&dir.join(MODEL_WEIGHTS), &data)
}

/// Saves `model.safetensors` and `model.toml` (`meta_toml`) into `dir`, each atomically; the
/// weights are written first so a meta file never points at missing weights.
pub fn save_model_files(dir: &Path, params: &[&Param], meta_toml: &str) -> anyhow::Result<()> {
    save_weights(dir, params)?;
    write_atomic(&dir.join(MODEL_META), meta_toml.as_bytes())
}

/// Saves an encoder (`model.safetensors` + `model.toml`).
pub fn save_model(dir: &Path, model: &Encoder, meta: &ModelMeta) -> anyhow::Result<()> {
    save_model_files(dir, &model.params(), &toml::to_string_pretty(meta)?)
}

/// Loads an encoder saved by [`save_model`]; every parameter must be present with its shape.
pub fn load_model(dir: &Path) -> anyhow::Result<(Encoder, ModelMeta)> {
    match load_saved(dir)? {
        SavedModel::Encoder(m, meta) => Ok((m, meta)),
        SavedModel::Dlrm(..) => bail!(
            "{}: holds a DLRM; this needs an encoder (a text model)",
            dir.join(MODEL_META).display()
        ),
    }
}

/// Loads the model saved in a run directory, of whichever kind `model.toml` says.
pub fn load_saved(dir: &Path) -> anyhow::Result<SavedModel> {
    let meta_path = dir.join(MODEL_META);
    let text = std::fs::read_to_string(&meta_path)
        .with_context(|| format!("{}: cannot read", meta_path.display()))?;
    let mut saved = SavedModel::from_meta(&meta_path, &text)?;
    load_weights(&dir.join(MODEL_WEIGHTS), saved.model_mut())?;
    Ok(saved)
}

impl SavedModel {
    /// A freshly initialised model of the kind and shape `model.toml` text describes (`path`
    /// names it in errors); fill its weights with [`load_weights`].
    pub fn from_meta(path: &Path, text: &str) -> anyhow::Result<SavedModel> {
        let bad = |e: &dyn std::fmt::Display| anyhow!("{}: {e}", path.display());
        let kind = text
            .parse::<toml::Table>()
            .map_err(|e| bad(&e))?
            .get("kind")
            .and_then(|k| k.as_str().map(str::to_string));
        Ok(match kind.as_deref() {
            Some("dlrm") => {
                let meta: DlrmMeta = toml::from_str(text).map_err(|e| bad(&e))?;
                let model = Dlrm::new(
                    &meta.model,
                    meta.n_dense,
                    &meta.field_names,
                    &meta.table_sizes,
                    0,
                )
                .map_err(|e| bad(&e))?;
                SavedModel::Dlrm(model, meta)
            }
            None => {
                let meta: ModelMeta = toml::from_str(text).map_err(|e| bad(&e))?;
                let model = Encoder::new(&meta.model, 0).map_err(|e| bad(&e))?;
                SavedModel::Encoder(model, meta)
            }
            Some(k) => bail!(
                "{}: kind `{k}` is not `dlrm` (or absent, for an encoder)",
                path.display()
            ),
        })
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

/// Fills `model` from a weights file: re-shaped to the saved ranks, then every parameter by
/// name (missing or mis-shaped tensors are errors naming them).
pub fn load_weights(wpath: &Path, model: &mut dyn Model) -> anyhow::Result<()> {
    let bytes =
        std::fs::read(wpath).with_context(|| format!("{}: cannot read", wpath.display()))?;
    let st = SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow!("{}: not a valid safetensors file: {e}", wpath.display()))?;
    reshape_ranks(model, &|name| {
        st.tensor(name).ok().map(|t| t.shape().to_vec())
    })
    .map_err(|e| anyhow!("{}: {e}", wpath.display()))?;
    let mut err: Option<anyhow::Error> = None;
    model.visit_params_mut(&mut |p| {
        if err.is_some() {
            return;
        }
        let r = (|| {
            let t = st
                .tensor(&p.name)
                .map_err(|_| anyhow!("tensor `{}` is missing", p.name))?;
            if t.dtype() != Dtype::F32 || t.shape() != p.shape.as_slice() {
                bail!(
                    "tensor `{}` is {:?} {:?}, expected F32 {:?}",
                    p.name,
                    t.dtype(),
                    t.shape(),
                    p.shape
                );
            }
            for (v, c) in p.value.iter_mut().zip(t.data().chunks_exact(4)) {
                *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
            Ok(())
        })();
        if let Err(e) = r {
            err = Some(anyhow!("{}: {e}", wpath.display()));
        }
    });
    err.map_or(Ok(()), Err)
}

/// Gives every TT/TTM layer of `model` the ranks its saved gates have (a truncated model is
/// saved with its physical ranks), so its parameters can then be filled in by name.
/// `saved_shape(name)` is the shape of the saved tensor of that parameter name, if any.
pub fn reshape_ranks(
    model: &mut dyn Model,
    saved_shape: &dyn Fn(&str) -> Option<Vec<usize>>,
) -> anyhow::Result<()> {
    let mut err: Option<anyhow::Error> = None;
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
                    err = Some(anyhow!(
                        "tensor `{name}` has shape {s:?}, expected one positive length (a rank)"
                    ));
                    return;
                }
                None => {
                    err = Some(anyhow!("tensor `{name}` is missing"));
                    return;
                }
            }
        }
        ranks.push(1);
        if ranks != now {
            if let Err(e) = layer.set_ranks(&ranks) {
                err = Some(anyhow!("{}: ranks {ranks:?}: {e}", layer.layer_name()));
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
    pub fn create(path: &Path) -> anyhow::Result<MetricsLog> {
        let f = std::fs::File::create(path)
            .with_context(|| format!("{}: cannot create", path.display()))?;
        Ok(MetricsLog {
            file: std::io::BufWriter::new(f),
            path: path.to_path_buf(),
        })
    }

    /// Opens an existing log to append to (a resumed run).
    pub fn append(path: &Path) -> anyhow::Result<MetricsLog> {
        let f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .with_context(|| format!("{}: cannot open for appending", path.display()))?;
        Ok(MetricsLog {
            file: std::io::BufWriter::new(f),
            path: path.to_path_buf(),
        })
    }

    pub fn write(&mut self, record: &serde_json::Value) -> anyhow::Result<()> {
        writeln!(self.file, "{record}")
            .and_then(|_| self.file.flush())
            .with_context(|| format!("{}: cannot write", self.path.display()))
    }
}

/// A DLRM as one safetensors file, `model.toml` in its metadata (`format` `comera-dlrm`,
/// `model`): with `dense`, every TTM table reconstructed as its dense V × D matrix (named
/// `<table>.weight`), the rest as trained; without, the parameters as trained (cores and gates).
pub fn export_dlrm(model: &Dlrm, meta: &DlrmMeta, dense: bool) -> anyhow::Result<Vec<u8>> {
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let as_tensor = |p: &Param| (p.name.clone(), p.shape.clone(), bytes(&p.value));
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> =
        model.bottom.params().into_iter().map(as_tensor).collect();
    for t in &model.tables {
        match (t, dense) {
            (comera_layers::AnyEmbedding::Ttm(e), true) => {
                let name = format!("{}.weight", comera_layers::Compressible::layer_name(e));
                tensors.push((name, vec![t.rows(), t.dim()], bytes(&e.dense_table())));
            }
            _ => tensors.extend(t.params().into_iter().map(as_tensor)),
        }
    }
    tensors.extend(model.top.params().into_iter().map(as_tensor));
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(Dtype::F32, s.clone(), b)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
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
    Ok(safetensors::serialize(views, Some(metadata))?)
}
