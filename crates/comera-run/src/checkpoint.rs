//! Training checkpoints: one safetensors file holding everything a run needs to continue
//! exactly where it stopped.
//!
//! Layout (format `comera-checkpoint`, version 3):
//! - tensors `model/<name>`: every parameter at its current (possibly truncated) shape;
//! - tensors `opt/…`: the optimiser's state ([`OptState`]: AdamW's moments, or GaLore's
//!   projections and projected moments);
//! - metadata (`__metadata__`, strings): `format`, `version`, `config` (the resolved run config,
//!   TOML), `progress` (step, epoch, position in the epoch's data order, running sums; JSON),
//!   `model` (the model's `model.toml`), `rank` (the rank schedule's state; JSON), `optimizer`
//!   (the optimiser's kind and scalars, such as Adam's step count; JSON), `run_id` (the run
//!   that wrote it, [`crate::run_dir`]) and
//!   `sha256`: a hash of every other metadata field (by key) and every tensor's name, shape and
//!   bytes in file order, so a flipped bit anywhere resume reads is caught.
//!
//! Data order and dropout need no RNG state of their own: each epoch's shuffle is seeded by
//! (seed, epoch) and dropout masks by (seed, step), so (epoch, position, step) restores them.
//! Files are written atomically ([`crate::files::write_atomic`]: temporary file, fsync, rename)
//! as `checkpoints/step-<step>.safetensors`; the newest `keep` are kept. "Newest" goes by the
//! step inside the file (read from its header), not by its name: a renamed file is ranked by
//! what it holds.

use crate::config::AnyRunConfig;
use crate::error::{BoxError, Error, IoContext, Result};
use crate::files::TensorError;
use crate::files::{digest, f32_payload, meta_items, write_digested_safetensors, NamedPayload};
use comera_layers::{Model, Param};
use comera_optim::rank::{LayerRanks, RankController};
use comera_optim::OptState;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const FORMAT: &str = "comera-checkpoint";
pub const VERSION: u32 = 3;
pub const DIR: &str = "checkpoints";

/// A checkpoint that cannot be used: the file, then what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The file is not a checkpoint this comera can resume from.
    #[error("{}: not a usable checkpoint", .path.display())]
    Unusable {
        path: PathBuf,
        #[source]
        source: Defect,
    },
    /// The model's (or optimiser's) tensors do not fit the saved ones.
    #[error("{}", .path.display())]
    Tensor {
        path: PathBuf,
        #[source]
        source: TensorError,
    },
}

/// What makes a file not a usable checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum Defect {
    #[error("not a complete safetensors file (truncated or corrupt?)")]
    Incomplete(#[source] safetensors::SafeTensorError),
    #[error("no metadata: not a comera checkpoint")]
    NoMetadata,
    #[error("metadata field `{0}` is missing")]
    MissingField(String),
    #[error("metadata `format` is `{0}`, expected `{FORMAT}`")]
    Format(String),
    #[error("checkpoint version {0}; this comera reads version {VERSION}")]
    Version(String),
    #[error("tensor `{name}`")]
    Tensor {
        name: String,
        #[source]
        source: safetensors::SafeTensorError,
    },
    #[error(transparent)]
    Layout(TensorError),
    #[error("content hash mismatch (the file was modified or damaged after it was written)")]
    Hash,
    /// A metadata field that does not parse (`config`, `progress`, `rank`, `optimizer`).
    #[error("metadata `{field}`")]
    Metadata {
        field: &'static str,
        #[source]
        source: BoxError,
    },
}

/// Where in training a checkpoint was taken, and the running sums the logs need.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// Steps done.
    pub step: u64,
    /// The epoch in progress (0-based) and how many of its batches are done.
    pub epoch: usize,
    pub batch_in_epoch: usize,
    /// Sums over the epoch so far and over the current logging window.
    pub ep_loss: f64,
    pub ep_correct: usize,
    pub ep_count: usize,
    pub win_loss: f64,
    pub win_correct: usize,
    pub win_count: usize,
    /// Seconds of training before this checkpoint (for the logs' clocks).
    pub seconds: f64,
    /// Ranks at the start and at the switch to the late stage (for the final rank table).
    pub ranks_start: Vec<LayerRanks>,
    pub ranks_switch: Option<Vec<LayerRanks>>,
    /// Early stopping: the best value of the watched metric so far, and evaluations since.
    #[serde(default)]
    pub best_metric: Option<f64>,
    #[serde(default)]
    pub evals_since_best: usize,
    /// A distilled run: the window's loss terms, each summed ×count like `win_loss`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub win_terms: Option<comera_layers::LossTerms>,
}

/// A loaded checkpoint, checked.
pub struct Checkpoint {
    pub path: PathBuf,
    /// The run that wrote it.
    pub run_id: String,
    /// The resolved run config the checkpoint was written with (TOML).
    pub config_toml: String,
    /// The model's `model.toml` at the checkpoint.
    pub model_toml: String,
    pub progress: Progress,
    pub rank: RankController,
    /// The optimiser's scalars (`kind`, `t`, …).
    pub optimizer: serde_json::Value,
    tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

/// Path of the checkpoint after `step` steps in `run_dir`.
pub fn path_for(run_dir: &Path, step: u64) -> PathBuf {
    run_dir
        .join(DIR)
        .join(format!("step-{step:010}.safetensors"))
}

/// The step a checkpoint file says it holds, read from its header alone (not verified: the
/// hash is checked when it is loaded); None when the header cannot be read.
pub fn header_step(path: &Path) -> Option<u64> {
    use std::io::Read;
    let mut f = comera_data::open_regular(path).ok()?;
    let mut n = [0u8; 8];
    f.read_exact(&mut n).ok()?;
    let n = u64::from_le_bytes(n);
    // A header is a few kB of JSON (the config, progress and rank state); refuse absurd sizes.
    if n > 64 << 20 {
        return None;
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).ok()?;
    let header: serde_json::Value = serde_json::from_slice(&header).ok()?;
    let progress = header.get("__metadata__")?.get("progress")?.as_str()?;
    serde_json::from_str::<serde_json::Value>(progress)
        .ok()?
        .get("step")?
        .as_u64()
}

/// Checkpoints of a run, oldest first by the step inside each file (files whose header cannot
/// be read come first; temporary files of interrupted writes are ignored).
pub fn list(run_dir: &Path) -> Result<Vec<PathBuf>> {
    let dir = run_dir.join(DIR);
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .io(&dir, "cannot list")?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("step-") && n.ends_with(".safetensors"))
        })
        .collect();
    v.sort();
    v.sort_by_cached_key(|p| header_step(p).map_or((0, 0), |s| (1, s)));
    Ok(v)
}

/// The run's state a checkpoint saves besides tensors.
pub struct RunState<'a> {
    /// The run's id ([`crate::run_dir::RunIdentity`]).
    pub run_id: &'a str,
    /// The resolved run config (TOML).
    pub config_toml: &'a str,
    /// The model's `model.toml` (kind, shape, labels, vocabulary).
    pub model_toml: &'a str,
    pub progress: &'a Progress,
    pub rank: &'a RankController,
}

/// Writes a checkpoint atomically and removes all but the newest `keep` (0: keep all).
pub fn save(
    run_dir: &Path,
    run: &RunState<'_>,
    model: &dyn Model,
    opt: &OptState<'_>,
    keep: usize,
) -> Result<PathBuf> {
    // The payloads borrow the values (no copy of a model that may be most of the memory).
    let params = model.params();
    let mut tensors: Vec<NamedPayload<'_>> = params
        .iter()
        .map(|p| {
            (
                format!("model/{}", p.name),
                &p.shape[..],
                f32_payload(&p.value),
            )
        })
        .collect();
    for (name, shape, v) in &opt.tensors {
        tensors.push((format!("opt/{name}"), &shape[..], f32_payload(v)));
    }
    let meta: HashMap<String, String> = [
        ("format", FORMAT.to_string()),
        ("version", VERSION.to_string()),
        ("config", run.config_toml.to_string()),
        ("model", run.model_toml.to_string()),
        ("progress", serde_json::to_string(run.progress)?),
        ("rank", serde_json::to_string(run.rank)?),
        ("optimizer", opt.scalars.to_string()),
        ("run_id", run.run_id.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let path = path_for(run_dir, run.progress.step);
    write_digested_safetensors(&path, tensors, meta, || {
        // For the kill-during-write test: hold the finished temporary file this long before
        // the rename, so a SIGKILL lands mid-write.
        if let Some(ms) = std::env::var("COMERA_TEST_CHECKPOINT_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
    })?;
    if keep > 0 {
        let all = list(run_dir)?;
        for old in &all[..all.len().saturating_sub(keep)] {
            std::fs::remove_file(old).io(old, "cannot remove old checkpoint")?;
        }
    }
    Ok(path)
}

impl Checkpoint {
    /// Reads and checks a checkpoint: format, version, hash, and every metadata field.
    pub fn load(path: &Path) -> Result<Checkpoint> {
        let bytes = comera_data::read_regular(path).io(path, "cannot read")?;
        Self::parse(path, &bytes).map_err(|source| {
            CheckpointError::Unusable {
                path: path.to_path_buf(),
                source,
            }
            .into()
        })
    }

    fn parse(path: &Path, bytes: &[u8]) -> Result<Checkpoint, Defect> {
        let (_, header) = SafeTensors::read_metadata(bytes).map_err(Defect::Incomplete)?;
        let st = SafeTensors::deserialize(bytes).map_err(Defect::Incomplete)?;
        let meta = header.metadata().as_ref().ok_or(Defect::NoMetadata)?;
        let field = |k: &str| meta.get(k).ok_or_else(|| Defect::MissingField(k.into()));
        if field("format")? != FORMAT {
            return Err(Defect::Format(field("format")?.clone()));
        }
        let version = field("version")?;
        if version != &VERSION.to_string() {
            return Err(Defect::Version(version.clone()));
        }
        let mut names: Vec<&str> = st.names();
        names.sort();
        let mut tensors = HashMap::new();
        let mut items = Vec::with_capacity(names.len());
        for &name in &names {
            let t = st.tensor(name).map_err(|source| Defect::Tensor {
                name: name.into(),
                source,
            })?;
            if t.dtype() != Dtype::F32 {
                return Err(Defect::Layout(TensorError::Dtype {
                    name: name.into(),
                    dtype: t.dtype(),
                }));
            }
            items.push((name, t.shape().to_vec(), t.data()));
        }
        let sha =
            digest(meta_items(meta).chain(items.iter().map(|(n, s, b)| (*n, s.as_slice(), *b))));
        if &sha != field("sha256")? {
            return Err(Defect::Hash);
        }
        for (name, shape, data) in items {
            let v: Vec<f32> = data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            tensors.insert(name.to_string(), (shape, v));
        }
        let config_toml = field("config")?.clone();
        let model_toml = field("model")?.clone();
        let bad = |field: &'static str| {
            move |e: Box<dyn std::error::Error + Send + Sync>| Defect::Metadata { field, source: e }
        };
        AnyRunConfig::from_toml(Path::new("<checkpoint config>"), &config_toml)
            .map_err(|e| bad("config")(e.into()))?;
        let progress: Progress =
            serde_json::from_str(field("progress")?).map_err(|e| bad("progress")(e.into()))?;
        let rank: RankController =
            serde_json::from_str(field("rank")?).map_err(|e| bad("rank")(e.into()))?;
        let optimizer: serde_json::Value =
            serde_json::from_str(field("optimizer")?).map_err(|e| bad("optimizer")(e.into()))?;
        let run_id = field("run_id")?.clone();
        Ok(Checkpoint {
            path: path.to_path_buf(),
            run_id,
            config_toml,
            model_toml,
            progress,
            rank,
            optimizer,
            tensors,
        })
    }

    /// Tensor names and shapes (for `comera inspect`).
    pub fn tensor_shapes(&self) -> Vec<(&str, &[usize])> {
        let mut v: Vec<(&str, &[usize])> = self
            .tensors
            .iter()
            .map(|(n, (s, _))| (n.as_str(), s.as_slice()))
            .collect();
        v.sort();
        v
    }

    /// The run config the checkpoint was written with.
    pub fn config(&self) -> Result<AnyRunConfig> {
        AnyRunConfig::from_toml(&self.path, &self.config_toml)
    }

    /// The model at the checkpoint, of whichever kind, with its parameters.
    pub fn saved_model(&self) -> Result<crate::files::SavedModel> {
        let mut saved = crate::files::SavedModel::from_meta(&self.path, &self.model_toml)?;
        self.load_params(saved.model_mut())?;
        Ok(saved)
    }

    /// Loads the checkpoint's parameters into `model` (built from the checkpoint's config):
    /// re-shaped to the saved ranks, every parameter filled in (missing or mis-shaped tensors
    /// are errors).
    pub fn load_params(&self, model: &mut dyn Model) -> Result<()> {
        crate::files::reshape_ranks(model, &|name| {
            self.tensors
                .get(&format!("model/{name}"))
                .map(|(s, _)| s.clone())
        })
        .map_err(|e| self.tensor_error(e))?;
        self.fill(model, "model/", &mut |p, v| p.value.copy_from_slice(v))?;
        let mut bad = Ok(());
        model.visit_params_mut(&mut |p| {
            if bad.is_ok() {
                bad = crate::files::check_finite(p);
            }
        });
        bad.map_err(|e| self.tensor_error(e))
    }

    /// `PATH`, then what is wrong with the tensor.
    fn tensor_error(&self, source: TensorError) -> Error {
        CheckpointError::Tensor {
            path: self.path.clone(),
            source,
        }
        .into()
    }

    /// Fills `buf` from the saved optimiser tensor `opt/<name>` (for
    /// [`comera_optim::Optimizer::restore`]).
    pub fn opt_fill(&self, name: &str, buf: &mut [f32]) -> Result<(), BoxError> {
        let v = self.opt_tensor(name, buf.len())?;
        buf.copy_from_slice(v);
        Ok(())
    }

    /// The saved optimiser tensor `opt/<name>`: its values, which must have `len` entries.
    pub fn opt_tensor(&self, name: &str, len: usize) -> Result<&[f32]> {
        match self.tensors.get(&format!("opt/{name}")) {
            Some((_, v)) if v.len() == len => Ok(v),
            Some((s, _)) => Err(self.tensor_error(TensorError::Values {
                name: format!("opt/{name}"),
                shape: s.clone(),
                len,
            })),
            None => Err(self.tensor_error(TensorError::Missing(format!("opt/{name}")))),
        }
    }

    /// Calls `f(param, saved values)` for every parameter of `model`, in visiting order, with
    /// the tensor `<prefix><name>` (which must exist with the parameter's shape).
    fn fill(
        &self,
        model: &mut dyn Model,
        prefix: &str,
        f: &mut dyn FnMut(&mut Param, &[f32]),
    ) -> Result<()> {
        let mut err = None;
        model.visit_params_mut(&mut |p| {
            if err.is_some() {
                return;
            }
            let key = format!("{prefix}{}", p.name);
            match self.tensors.get(&key) {
                Some((shape, v)) if shape == &p.shape => f(p, v),
                Some((shape, _)) => {
                    err = Some(TensorError::Shape {
                        name: key,
                        shape: shape.clone(),
                        expected: p.shape.clone(),
                    })
                }
                None => err = Some(TensorError::Missing(key)),
            }
        });
        match err {
            Some(e) => Err(self.tensor_error(e)),
            None => Ok(()),
        }
    }
}
