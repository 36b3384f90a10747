//! `train` and `resume`: a config (TOML text, from a file, a string or a dict) with data handed
//! over in memory merged in, run on a pool of its own with the GIL released, the loop's events
//! going to a Python callback.

use crate::errors::{guard, IntoPy};
use crate::events::{json_to_py, PyObserver};
use comera_train::config::ConfigError;
use comera_train::data::{LABEL_COLUMN, PAIR_COLUMNS, TEXT_COLUMNS};
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
    Ok(table.to_string())
}

/// Parses and checks a config: `text` is TOML, `origin` names it in errors (a path, `<dict>`).
/// `None` is the built-in run.
fn parse(text: Option<&str>, origin: &str) -> comera_train::Result<AnyRunConfig> {
    match text {
        Some(t) => Ok(AnyRunConfig::from_toml(Path::new(origin), t)?),
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
pub(crate) type TextsArg = (Vec<String>, Option<Vec<String>>, Vec<String>);

/// Click rows copied out of Python: dense, categorical and labels, row-major.
type ClickVecs = (Vec<i64>, Vec<i64>, Vec<i64>);

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
    clicks_train: Option<ClickVecs>,
    clicks_valid: Option<ClickVecs>,
}

fn texts(t: Option<TextsArg>) -> Option<LabelledTexts> {
    t.map(|(text, text_pair, label)| LabelledTexts {
        text,
        text_pair,
        label,
    })
}

fn clicks(c: Option<ClicksArg<'_>>) -> PyResult<Option<ClickVecs>> {
    c.map(|(d, k, l)| {
        Ok((
            d.as_slice()?.to_vec(),
            k.as_slice()?.to_vec(),
            l.as_slice()?.to_vec(),
        ))
    })
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

    /// Stores the data as files in the cache and points the config's `[data]` table at them
    /// (before the config is parsed, so that it is checked as a whole, as a file would be).
    /// Returns the config text and a line about each file stored.
    fn merge_into(self, text: Option<&str>) -> comera_train::Result<(String, Vec<String>)> {
        let bad = |field: &str, reason: &str| -> comera_train::Error {
            ConfigError::new(field, reason).into()
        };
        let text = match text {
            Some(t) => t.to_string(),
            None => comera_train::RunConfig::builtin().to_toml(),
        };
        // A config that does not parse is left to the parser to report.
        let Ok(mut table) = text.parse::<toml::Table>() else {
            return Ok((text, Vec::new()));
        };
        let dlrm = table.contains_key("dlrm");
        let data = table
            .entry("data")
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let Some(data) = data.as_table_mut() else {
            return Err(bad("data", "must be a table"));
        };
        let cache = data
            .get("cache_dir")
            .and_then(|v| v.as_str())
            .map(PathBuf::from)
            .unwrap_or_else(comera_data::default_cache_dir);
        let str_v = |s: &str| toml::Value::String(s.to_string());
        let path_v = |p: &Path| toml::Value::String(p.display().to_string());
        let list_v = |l: &[String]| toml::Value::Array(l.iter().map(|s| str_v(s)).collect());
        let mut said = Vec::new();
        let mut stored = |what: &str, s: &inputs::StoredInput| {
            said.push(format!(
                "{what}: {} from memory, stored as {} (sha256 {})",
                s.rows,
                s.path.display(),
                &s.sha256[..16]
            ))
        };
        if dlrm {
            if self.train.is_some() || self.corpus_texts.is_some() || self.corpus_paths.is_some() {
                return Err(bad(
                    "data",
                    "a DLRM config trains on click rows (dense, categorical, label arrays), not texts",
                ));
            }
            let Some((dense, cats, labels)) = self.clicks_train else {
                return Ok((text, said));
            };
            let rows = ClickRows {
                dense: &dense,
                cats: &cats,
                labels: &labels,
            };
            let (s, mut sizes) = inputs::store_click_rows(&cache, &rows, "training rows")?;
            stored("training rows", &s);
            put(data, "source", str_v("criteo"));
            put(data, "train", path_v(&s.path));
            data.remove("valid");
            if let Some((dense, cats, labels)) = self.clicks_valid {
                let rows = ClickRows {
                    dense: &dense,
                    cats: &cats,
                    labels: &labels,
                };
                let (s, vs) = inputs::store_click_rows(&cache, &rows, "validation rows")?;
                stored("validation rows", &s);
                for (a, b) in sizes.iter_mut().zip(vs) {
                    *a = (*a).max(b);
                }
                put(data, "valid", path_v(&s.path));
            }
            if !data.contains_key("table_sizes") {
                // Tables that hold every id given (ids are taken modulo the size).
                data.insert(
                    "table_sizes".into(),
                    toml::Value::Array(
                        sizes
                            .iter()
                            .map(|&n| toml::Value::Integer(n as i64))
                            .collect(),
                    ),
                );
                data.insert("mapping".into(), str_v("modulo"));
            }
        } else if self.clicks_train.is_some() {
            return Err(bad(
                "clicks",
                "click rows train a DLRM: give a DLRM config (a [dlrm] table)",
            ));
        } else if self.corpus_texts.is_some() || self.corpus_paths.is_some() {
            if self.train.is_some() {
                return Err(bad(
                    "corpus",
                    "give either a corpus (masked-LM pre-training) or labelled texts, not both",
                ));
            }
            let mut corpus = self.corpus_paths.unwrap_or_default();
            if let Some(docs) = &self.corpus_texts {
                let s = inputs::store_corpus(&cache, docs)?;
                stored("corpus documents", &s);
                corpus.insert(0, s.path.display().to_string());
                put(data, "text_docs", str_v("paragraphs"));
            }
            put(data, "source", str_v("corpus"));
            put(data, "corpus", list_v(&corpus));
        } else if let Some(train) = self.train {
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
            stored("training examples", &s);
            put(data, "source", str_v("csv"));
            put(data, "text_a", str_v(TEXT_COLUMNS[0]));
            match &train.text_pair {
                Some(_) => put(data, "text_b", str_v(PAIR_COLUMNS[0])),
                None => {
                    data.remove("text_b");
                }
            }
            put(data, "label", str_v(LABEL_COLUMN));
            put(data, "labels", list_v(&labels));
            put(data, "train", path_v(&s.path));
            put(data, "train_sha256", str_v(&s.sha256));
            data.remove("valid");
            data.remove("valid_sha256");
            if let Some(v) = self.valid {
                if v.text_pair.is_some() != train.text_pair.is_some() {
                    return Err(bad(
                        "valid",
                        "the validation data and the training data must both be sentence pairs, or neither",
                    ));
                }
                let s = inputs::store_labelled_texts(&cache, &v, "validation data")?;
                stored("validation examples", &s);
                put(data, "valid", path_v(&s.path));
                put(data, "valid_sha256", str_v(&s.sha256));
            }
        } else if self.valid.is_some() {
            return Err(bad(
                "valid",
                "validation data without training data; give data= too",
            ));
        }
        Ok((table.to_string(), said))
    }
}

/// Sets `key` of a TOML table.
fn put(table: &mut toml::Table, key: &str, value: toml::Value) {
    table.insert(key.to_string(), value);
}

/// Runs `work` with the run's events going to `callback` (and to the terminal when
/// `console`). The run works on a thread of its own, on a pool of `threads` workers, with the
/// GIL released; this thread waits for it and runs Python's signal handlers every 50 ms (only
/// the main thread can): a Ctrl-C asks the run to stop after its current step, with a
/// checkpoint, and its `KeyboardInterrupt` is raised once the run has ended. An exception of
/// the callback is raised the same way.
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
    let result = std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::channel();
        scope.spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                pool.install(|| work(opts))
            }));
            let _ = tx.send(r);
        });
        let mut rx = Some(rx);
        loop {
            // The receiver goes into the GIL-free closure and back (it is Send, not Sync).
            let (waited, back) = py.detach(|| {
                let rx = rx.take().expect("put back after each wait");
                (rx.recv_timeout(std::time::Duration::from_millis(50)), rx)
            });
            rx = Some(back);
            match waited {
                Ok(r) => break r,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    if let Err(e) = py.check_signals() {
                        PyObserver::stop_with(&raised, e);
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    break Err(Box::new("the run's thread ended without a result"))
                }
            }
        }
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
    callback=None, console=false, threads=None, device=None
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
    device: Option<String>,
) -> PyResult<Py<PyAny>> {
    let device = crate::errors::device_arg("device", device.as_deref())?;
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
        let (text, said) = if data.is_empty() {
            (text, Vec::new())
        } else {
            let (t, said) = data.merge_into(text.as_deref()).py_err()?;
            (Some(t), said)
        };
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
            data: None,
            valid: None,
            teacher: None,
            device,
        })
        .py_err()?;
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
        run_with(
            py,
            threads,
            callback,
            console,
            overwrite,
            move |opts| match &cfg {
                AnyRunConfig::Encoder(c) => comera_train::train(c, opts),
                AnyRunConfig::Dlrm(c) => comera_train::train_dlrm(c, opts),
            },
        )
    })?;
    summary_py(py, &summary)
}

/// Continues the run in `path` from its newest checkpoint (extended first by
/// `extend_epochs` epochs when given); returns its summary.
#[pyfunction]
#[pyo3(signature = (
    path, *, callback=None, console=false, threads=None, extend_epochs=None, device=None
))]
pub fn resume(
    py: Python<'_>,
    path: PathBuf,
    callback: Option<Py<PyAny>>,
    console: bool,
    threads: Option<usize>,
    extend_epochs: Option<usize>,
    device: Option<String>,
) -> PyResult<Py<PyAny>> {
    let device = crate::errors::device_arg("device", device.as_deref())?;
    let how = comera_train::Continue {
        extend_epochs,
        device,
        ..Default::default()
    };
    let summary = guard(|| {
        run_with(py, threads, callback, console, false, move |opts| {
            comera_train::continue_run(&path, how, opts)
        })
    })?;
    summary_py(py, &summary)
}
