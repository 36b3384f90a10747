//! `train` and `resume`: a config (TOML text, from a file, a string or a dict) with data handed
//! over in memory merged in, run on a pool of its own with the GIL released, the loop's events
//! going to a Python callback.

use crate::errors::{guard, IntoPy};
use crate::events::{json_to_py, PyObserver};
use comera_train::config::{ConfigError, DataSource};
use comera_train::inputs::{self, ClickRows, LabelledTexts};
use comera_train::{AnyRunConfig, RunOptions, TrainSummary};
use numpy::PyReadonlyArray1;
use numpy::PyReadonlyArray2;
use pyo3::prelude::*;
use std::path::{Path, PathBuf};

/// A JSON object (a dict config, as `json.dumps` wrote it) as TOML text.
#[pyfunction]
pub fn json_to_toml(json: &str) -> PyResult<String> {
    let value: serde_json::Value = serde_json::from_str(json)
        .map_err(|e| crate::errors::ConfigError::new_err(format!("config: {e}")))?;
    let table: toml::Table = toml::Value::try_from(value)
        .ok()
        .and_then(|v| v.as_table().cloned())
        .ok_or_else(|| {
            crate::errors::ConfigError::new_err(
                "config: a dict of tables ({\"model\": {...}, \"train\": {...}}) with values TOML can hold (no None)",
            )
        })?;
    Ok(toml::to_string(&table).unwrap_or_default())
}

/// Parses and checks a config: `text` is TOML, `origin` names it in errors (a path, `<dict>`).
/// `None` is the built-in run.
fn parse(text: Option<&str>, origin: &str) -> comera_train::Result<AnyRunConfig> {
    match text {
        Some(t) => AnyRunConfig::from_toml(Path::new(origin), t),
        None => Ok(AnyRunConfig::Encoder(comera_train::RunConfig::builtin())),
    }
}

/// The config as comera resolves it (every default filled in), as TOML: what
/// `comera train --print-config` prints.
#[pyfunction]
#[pyo3(signature = (text, origin))]
pub fn resolve_config(text: Option<&str>, origin: &str) -> PyResult<String> {
    guard(|| Ok(parse(text, origin).py_err()?.to_toml()))
}

/// Labelled texts from Python: (texts, second texts or None, labels).
type TextsArg = (Vec<String>, Option<Vec<String>>, Vec<String>);

/// Click rows from Python: dense (n × 13), categorical (n × 26) and labels (n), int64.
type ClicksArg<'py> = (
    PyReadonlyArray2<'py, i64>,
    PyReadonlyArray2<'py, i64>,
    PyReadonlyArray1<'py, i64>,
);

/// Data handed over in memory, copied out of Python objects.
#[derive(Default)]
struct MemoryData {
    train: Option<LabelledTexts>,
    valid: Option<LabelledTexts>,
    labels: Option<Vec<String>>,
    corpus_texts: Option<Vec<String>>,
    corpus_paths: Option<Vec<String>>,
    clicks_train: Option<(Vec<i64>, Vec<i64>, Vec<i64>)>,
    clicks_valid: Option<(Vec<i64>, Vec<i64>, Vec<i64>)>,
}

fn texts(t: Option<TextsArg>) -> Option<LabelledTexts> {
    t.map(|(text, text_pair, label)| LabelledTexts {
        text,
        text_pair,
        label,
    })
}

fn clicks(c: Option<ClicksArg<'_>>) -> PyResult<Option<(Vec<i64>, Vec<i64>, Vec<i64>)>> {
    c.map(|(d, k, l)| Ok((d.as_slice()?.to_vec(), k.as_slice()?.to_vec(), l.as_slice()?.to_vec())))
        .transpose()
}

impl MemoryData {
    fn is_empty(&self) -> bool {
        self.train.is_none()
            && self.valid.is_none()
            && self.corpus_texts.is_none()
            && self.corpus_paths.is_none()
            && self.clicks_train.is_none()
    }

    /// Stores the data as files in the cache and points the config at them.
    fn merge_into(self, cfg: &mut AnyRunConfig) -> comera_train::Result<Vec<String>> {
        let mut said = Vec::new();
        match cfg {
            AnyRunConfig::Encoder(c) => {
                let cache = comera_train::data::cache_dir(&c.data);
                if self.clicks_train.is_some() {
                    return Err(ConfigError::new(
                        "clicks",
                        "click rows train a DLRM: give a DLRM config ([model] with tables)",
                    )
                    .into());
                }
                if self.corpus_texts.is_some() || self.corpus_paths.is_some() {
                    if self.train.is_some() {
                        return Err(ConfigError::new(
                            "corpus",
                            "give either a corpus (masked-LM pre-training) or labelled texts, not both",
                        )
                        .into());
                    }
                    let d = &mut c.data;
                    d.source = DataSource::Corpus;
                    c.model.head = comera_model::HeadKind::Mlm;
                    d.corpus = self.corpus_paths.unwrap_or_default();
                    if let Some(docs) = &self.corpus_texts {
                        let s = inputs::store_corpus(&cache, docs)?;
                        said.push(format!(
                            "corpus: {} documents from memory, stored as {} (sha256 {})",
                            s.rows,
                            s.path.display(),
                            &s.sha256[..16]
                        ));
                        d.corpus.insert(0, s.path.display().to_string());
                        d.text_docs = "paragraphs".into();
                    }
                } else if let Some(train) = self.train {
                    let d = &mut c.data;
                    let labels = match self.labels {
                        Some(l) => l,
                        None => {
                            let mut all = train.label_set();
                            if let Some(v) = &self.valid {
                                all.extend(v.label_set());
                                all.sort();
                                all.dedup();
                            }
                            all
                        }
                    };
                    let s = inputs::store_labelled_texts(&cache, &train, "training data")?;
                    said.push(format!(
                        "data: {} training examples from memory, stored as {} (sha256 {})",
                        s.rows,
                        s.path.display(),
                        &s.sha256[..16]
                    ));
                    d.source = DataSource::Csv;
                    d.text_a = Some("text".into());
                    d.text_b = train.text_pair.as_ref().map(|_| "text_pair".into());
                    d.label = Some("label".into());
                    d.labels = Some(labels);
                    d.train = Some(s.path);
                    d.train_sha256 = Some(s.sha256);
                    d.valid = None;
                    d.valid_sha256 = None;
                    if let Some(v) = self.valid {
                        if v.text_pair.is_some() != train.text_pair.is_some() {
                            return Err(ConfigError::new(
                                "valid",
                                "the validation data and the training data must both be sentence pairs, or neither",
                            )
                            .into());
                        }
                        let s = inputs::store_labelled_texts(&cache, &v, "validation data")?;
                        said.push(format!(
                            "data: {} validation examples from memory, stored as {} (sha256 {})",
                            s.rows,
                            s.path.display(),
                            &s.sha256[..16]
                        ));
                        d.valid = Some(s.path);
                        d.valid_sha256 = Some(s.sha256);
                    }
                } else if self.valid.is_some() {
                    return Err(ConfigError::new(
                        "valid",
                        "validation data without training data; give data= too",
                    )
                    .into());
                }
                c.validate()?;
            }
            AnyRunConfig::Dlrm(c) => {
                if self.train.is_some() || self.corpus_texts.is_some() {
                    return Err(ConfigError::new(
                        "data",
                        "a DLRM config trains on click rows (dense, categorical, label arrays), not texts",
                    )
                    .into());
                }
                if let Some((dense, cats, labels)) = self.clicks_train {
                    let cache = c
                        .data
                        .cache_dir
                        .clone()
                        .unwrap_or_else(comera_data::default_cache_dir);
                    let rows = ClickRows {
                        dense: &dense,
                        cats: &cats,
                        labels: &labels,
                    };
                    let (s, mut sizes) = inputs::store_click_rows(&cache, &rows, "training rows")?;
                    said.push(format!(
                        "data: {} click rows from memory, stored as {} (sha256 {})",
                        s.rows,
                        s.path.display(),
                        &s.sha256[..16]
                    ));
                    c.data.source = "criteo".into();
                    c.data.train = Some(s.path);
                    c.data.valid = None;
                    if let Some((dense, cats, labels)) = self.clicks_valid {
                        let rows = ClickRows {
                            dense: &dense,
                            cats: &cats,
                            labels: &labels,
                        };
                        let (s, vs) = inputs::store_click_rows(&cache, &rows, "validation rows")?;
                        for (a, b) in sizes.iter_mut().zip(vs) {
                            *a = (*a).max(b);
                        }
                        c.data.valid = Some(s.path);
                    }
                    if c.data.table_sizes.is_empty() {
                        // Tables that hold every id given (ids are taken modulo the size).
                        c.data.table_sizes = sizes;
                        c.data.mapping = "modulo".into();
                    }
                }
                c.validate()?;
            }
        }
        Ok(said)
    }
}

/// The run's events go to `callback` (and to the terminal when `console`); the GIL is
/// released while the run works, taken back at each event.
fn run_with(
    py: Python<'_>,
    threads: Option<usize>,
    callback: Option<Py<PyAny>>,
    console: bool,
    overwrite: bool,
    work: impl FnOnce(RunOptions) -> comera_train::Result<TrainSummary> + Send,
) -> PyResult<TrainSummary> {
    let (observer, raised) = PyObserver::new(callback);
    let mut opts = RunOptions {
        overwrite,
        ..RunOptions::default()
    };
    opts.observers.push(Box::new(observer));
    if console {
        opts.observers
            .push(Box::new(comera_train::console::Console::new(true)));
    }
    let mut pool = rayon::ThreadPoolBuilder::new().stack_size(comera_train::WORKER_STACK_BYTES);
    if let Some(t) = threads {
        pool = pool.num_threads(t.max(1));
    }
    let pool = pool.build().map_err(|e| {
        crate::errors::RunError::new_err(format!("cannot start the worker threads: {e}"))
    })?;
    let result = py.detach(|| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.install(|| work(opts))
        }))
    });
    let summary = match result {
        Ok(r) => r.py_err(),
        Err(payload) => std::panic::resume_unwind(payload),
    };
    // An exception of the callback, or Ctrl-C: raised after the run's checkpoint.
    if let Some(e) = raised.lock().unwrap_or_else(|p| p.into_inner()).take() {
        return Err(e);
    }
    summary
}

fn summary_py(py: Python<'_>, s: &TrainSummary) -> PyResult<Py<PyAny>> {
    let v = serde_json::to_value(s).unwrap_or(serde_json::Value::Null);
    Ok(json_to_py(py, &v)?.unbind())
}

/// Trains a run; returns its summary (a dict) once it ends (finished or stopped).
#[pyfunction]
#[pyo3(signature = (
    text, origin, *, out=None, overwrite=false, epochs=None, batch_size=None, seed=None,
    stop_after_steps=None, init_from=None, dense=false, train=None, valid=None, labels=None,
    corpus_texts=None, corpus_paths=None, clicks_train=None, clicks_valid=None,
    callback=None, console=false, threads=None
))]
#[allow(clippy::too_many_arguments)]
pub fn train<'py>(
    py: Python<'py>,
    text: Option<String>,
    origin: String,
    out: Option<PathBuf>,
    overwrite: bool,
    epochs: Option<usize>,
    batch_size: Option<usize>,
    seed: Option<u64>,
    stop_after_steps: Option<u64>,
    init_from: Option<PathBuf>,
    dense: bool,
    train: Option<TextsArg>,
    valid: Option<TextsArg>,
    labels: Option<Vec<String>>,
    corpus_texts: Option<Vec<String>>,
    corpus_paths: Option<Vec<String>>,
    clicks_train: Option<ClicksArg<'py>>,
    clicks_valid: Option<ClicksArg<'py>>,
    callback: Option<Py<PyAny>>,
    console: bool,
    threads: Option<usize>,
) -> PyResult<Py<PyAny>> {
    let data = MemoryData {
        train: texts(train),
        valid: texts(valid),
        labels,
        corpus_texts,
        corpus_paths,
        clicks_train: clicks(clicks_train)?,
        clicks_valid: clicks(clicks_valid)?,
    };
    let summary = guard(|| {
        let mut cfg = parse(text.as_deref(), &origin).py_err()?;
        cfg.apply(&comera_train::Overrides {
            epochs,
            batch_size,
            seed,
            out,
            max_steps_per_epoch: None,
            stop_after_steps,
            init_from,
            dense,
        })
        .py_err()?;
        let said = if data.is_empty() {
            Vec::new()
        } else {
            data.merge_into(&mut cfg).py_err()?
        };
        // What was stored from memory is said first, as the loop says its own lines.
        for line in said {
            if console {
                eprintln!("{line}");
            }
            if let Some(cb) = &callback {
                let ev = json_to_py(py, &serde_json::json!({"kind": "message", "text": line}))?;
                cb.call1(py, (ev,))?;
            }
        }
        run_with(py, threads, callback, console, overwrite, move |opts| {
            match &cfg {
                AnyRunConfig::Encoder(c) => comera_train::train(c, opts),
                AnyRunConfig::Dlrm(c) => comera_train::train_dlrm(c, opts),
            }
        })
    })?;
    summary_py(py, &summary)
}

/// Continues the run in `path` from its newest checkpoint; returns its summary.
#[pyfunction]
#[pyo3(signature = (path, *, callback=None, console=false, threads=None))]
pub fn resume(
    py: Python<'_>,
    path: PathBuf,
    callback: Option<Py<PyAny>>,
    console: bool,
    threads: Option<usize>,
) -> PyResult<Py<PyAny>> {
    let summary = guard(|| {
        run_with(py, threads, callback, console, false, move |opts| {
            comera_train::resume_with(&path, opts)
        })
    })?;
    summary_py(py, &summary)
}
