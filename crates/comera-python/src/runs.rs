//! A run directory from Python: its config, records, predictions and evaluations, each read
//! through the library as the command line reads it.

use crate::errors::{guard, IntoPy};
use crate::events::json_to_py;
use comera_train::config::DataSource;
use comera_train::data::{LABEL_COLUMN, PAIR_COLUMNS, TEXT_COLUMNS};
use comera_train::inputs::{self, LabelledTexts};
use comera_train::SavedModel;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::prelude::*;
use std::path::{Path, PathBuf};

/// The run's `config.toml`, checked against the SHA-256 its `run.toml` names.
#[pyfunction]
pub fn run_config(path: PathBuf) -> PyResult<String> {
    guard(|| {
        let id = comera_train::run_dir::RunIdentity::read(&path).py_err()?;
        id.verified_config(&path).py_err()
    })
}

/// Every record of the run's `metrics.jsonl`, as dicts (`kind` names the record).
#[pyfunction]
pub fn run_metrics(py: Python<'_>, path: PathBuf) -> PyResult<Py<PyAny>> {
    let records =
        guard(|| comera_train::observe::read_metrics(&path.join("metrics.jsonl")).py_err())?;
    let v = serde_json::to_value(records).unwrap_or(serde_json::Value::Null);
    Ok(json_to_py(py, &v)?.unbind())
}

/// Each text's most probable label, and every class's probability (`len(texts) × C`), with
/// the label names in column order.
#[pyfunction]
#[pyo3(signature = (path, texts, *, batch_size=32, checkpoint=None, device=None))]
pub fn run_predict<'py>(
    py: Python<'py>,
    path: PathBuf,
    texts: Vec<String>,
    batch_size: usize,
    checkpoint: Option<PathBuf>,
    device: Option<String>,
) -> PyResult<(Vec<String>, Bound<'py, PyAny>, Vec<String>)> {
    let device = crate::errors::device_arg("device", device.as_deref())?.unwrap_or_default();
    let (probs, names) = guard(|| {
        let (saved, _) = comera_train::infer::load_run(&path, checkpoint.as_deref()).py_err()?;
        let SavedModel::Encoder(model, meta) = saved else {
            return Err(crate::errors::ModelError::new_err(format!(
                "{}: a DLRM; predict takes texts for a text classifier",
                path.display()
            )));
        };
        let probs = py
            .detach(|| {
                crate::threads::install(|| {
                    comera_train::infer::predict_probabilities_on(
                        &model, &meta, &texts, batch_size, device,
                    )
                })
            })?
            .py_err()?;
        Ok((probs, meta.labels))
    })?;
    let c = names.len();
    let labels = probs
        .chunks_exact(c)
        .map(|row| names[comera_layers::loss::argmax(row)].clone())
        .collect();
    let n = probs.len() / c.max(1);
    let array = PyArray1::from_vec(py, probs).reshape([n, c])?;
    Ok((labels, array.into_any(), names))
}

/// What this machine offers for `device=`: the CPU, each NVIDIA GPU (or why there is none),
/// NVRTC and cuBLAS; with `open`, each GPU opened as a run opens it (`comera devices`).
#[pyfunction]
#[pyo3(signature = (*, open=false))]
pub fn devices(py: Python<'_>, open: bool) -> PyResult<Py<PyAny>> {
    let d = py.detach(|| comera_train::device::devices(open));
    Ok(json_to_py(py, &d.to_json())?.unbind())
}

/// Evaluates the run's model: on its own held-out data (`data` None), on a file in its data
/// format, or on labelled texts handed over in memory.
#[pyfunction]
#[pyo3(signature = (path, *, texts=None, file=None, batch_size=64, checkpoint=None, device=None))]
pub fn run_evaluate(
    py: Python<'_>,
    path: PathBuf,
    texts: Option<crate::training::TextsArg>,
    file: Option<PathBuf>,
    batch_size: usize,
    checkpoint: Option<PathBuf>,
    device: Option<String>,
) -> PyResult<Py<PyAny>> {
    let device = crate::errors::device_arg("device", device.as_deref())?.unwrap_or_default();
    let (kind, stats) = guard(|| {
        py.detach(|| {
            crate::threads::install(|| {
                evaluate(
                    &path,
                    texts,
                    file.as_deref(),
                    (batch_size, device),
                    checkpoint.as_deref(),
                )
            })
        })?
        .py_err()
    })?;
    let mut v = serde_json::to_value(stats).unwrap_or(serde_json::Value::Null);
    if let serde_json::Value::Object(o) = &mut v {
        o.insert("task".into(), serde_json::Value::String(kind.into()));
    }
    Ok(json_to_py(py, &v)?.unbind())
}

fn evaluate(
    run: &Path,
    texts: Option<crate::training::TextsArg>,
    file: Option<&Path>,
    (batch, device): (usize, comera_train::DeviceSpec),
    checkpoint: Option<&Path>,
) -> comera_train::Result<(&'static str, comera_train::EvalStats)> {
    use comera_train::infer::EvalKind;
    let Some((text, text_pair, label)) = texts else {
        let (kind, s) = comera_train::infer::eval_run_on(run, checkpoint, file, batch, device)?;
        let kind = match kind {
            EvalKind::Classifier => "classifier",
            EvalKind::MaskedLm => "masked_lm",
            EvalKind::Ctr => "ctr",
        };
        return Ok((kind, s));
    };
    let cfg = comera_train::RunConfig::from_file(&run.join("config.toml"))?;
    let t = LabelledTexts {
        text,
        text_pair,
        label,
    };
    let stored = inputs::store_labelled_texts(
        &comera_train::data::cache_dir(&cfg.data),
        &t,
        "evaluation data",
    )?;
    let data = comera_train::DataConfig {
        source: DataSource::Csv,
        valid: Some(stored.path),
        valid_sha256: Some(stored.sha256),
        text_a: Some(TEXT_COLUMNS[0].into()),
        text_b: t.text_pair.as_ref().map(|_| PAIR_COLUMNS[0].into()),
        label: Some(LABEL_COLUMN.into()),
        labels: None,
        cache_dir: cfg.data.cache_dir.clone(),
        ..comera_train::DataConfig::default()
    };
    let s = comera_train::infer::eval_classifier_on(run, checkpoint, data, batch, device)?;
    Ok(("classifier", s))
}

/// TOML text as Python objects (dicts, lists, numbers, strings): a config for Python 3.9+,
/// which has no TOML reader of its own before 3.11.
#[pyfunction]
pub fn toml_to_py(py: Python<'_>, text: &str) -> PyResult<Py<PyAny>> {
    let table: toml::Table = text
        .parse()
        .map_err(|e| crate::errors::ConfigError::new_err(format!("TOML: {e}")))?;
    let v = serde_json::to_value(table).unwrap_or(serde_json::Value::Null);
    Ok(json_to_py(py, &v)?.unbind())
}
