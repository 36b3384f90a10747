//! Hugging Face models both ways: `import_hf` (a BERT directory, or all-MiniLM-L6-v2, into a
//! comera run directory, compressed by TT-SVD when asked) and `export_hf` (a run into a
//! directory transformers loads), through comera-import as `comera import` / `export` do.

use crate::errors::{guard, ConfigError, ModelError};
use comera_import::hf::ReadOptions;
use comera_import::{ImportError, ImportOptions, ModelSource, TtOptions};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use std::path::PathBuf;

/// An import or export error as the exception of its kind: comera-train's errors (run
/// directories, configs, writes) as they are, a refused option (`--hf`, `--out`, …) as a
/// `ConfigError`, a model that cannot be read or written as a `ModelError`.
fn to_py(e: ImportError) -> PyErr {
    let msg = comera_train::error::Chain(&e).to_string();
    match e {
        ImportError::Train(t) => crate::errors::to_py(t),
        ImportError::Fault { what, .. } | ImportError::Context { what, .. }
            if what.starts_with("--") =>
        {
            ConfigError::new_err(msg)
        }
        _ => ModelError::new_err(msg),
    }
}

/// Imports a model into a run directory; returns what was done (parameters, compressions
/// with their per-layer errors, the run directory).
#[pyfunction]
#[pyo3(signature = (
    source, out, *, minilm_cache=None, tt=false, ranks=None, tol=None, dense_embedding=false,
    uniform_ranks=false, seq_len=None, num_labels=None, seed=0, config=None, overwrite=false
))]
#[allow(clippy::too_many_arguments)]
pub fn import_hf(
    py: Python<'_>,
    source: Option<PathBuf>,
    out: PathBuf,
    minilm_cache: Option<PathBuf>,
    tt: bool,
    ranks: Option<Vec<usize>>,
    tol: Option<f64>,
    dense_embedding: bool,
    uniform_ranks: bool,
    seq_len: Option<usize>,
    num_labels: Option<usize>,
    seed: u64,
    config: Option<(String, String)>,
    overwrite: bool,
) -> PyResult<Py<PyAny>> {
    let outcome = guard(|| {
        let source = match (source, minilm_cache) {
            (Some(p), _) => ModelSource::Path(p),
            (None, cache) => ModelSource::Minilm {
                cache_dir: cache.unwrap_or_else(comera_data::default_cache_dir),
            },
        };
        if !tt && (ranks.is_some() || tol.is_some()) {
            return Err(ConfigError::new_err(
                "rank/tol apply to TT compression; add tt=True",
            ));
        }
        let config = config
            .map(|(text, origin)| {
                comera_train::RunConfig::from_toml(std::path::Path::new(&origin), &text)
            })
            .transpose()
            .map_err(crate::errors::to_py)?;
        let opts = ImportOptions {
            read: ReadOptions {
                seq_len,
                num_labels,
                seed,
            },
            tt: tt.then(|| TtOptions {
                ranks: ranks.unwrap_or_default(),
                tol,
                target_compression: None,
                embedding_rank: None,
                dense_embedding,
                uniform_ranks,
                left: false,
            }),
            out: Some(out),
            config,
            overwrite,
            ..ImportOptions::new(source)
        };
        py.detach(|| crate::threads::install(|| comera_import::import_to_run(opts, |_| {})))?
            .map_err(to_py)
    })?;
    let d = PyDict::new(py);
    let m = outcome.model();
    d.set_item(
        "run_dir",
        outcome.run_dir.as_ref().map(|p| p.display().to_string()),
    )?;
    d.set_item("params", m.num_params())?;
    d.set_item("dense_params", outcome.imported.encoder.num_params())?;
    d.set_item("notes", outcome.imported.notes.clone())?;
    let comps = PyList::empty(py);
    for c in &outcome.compressions {
        let cd = PyDict::new(py);
        cd.set_item("rank", c.rank)?;
        cd.set_item("tol", c.tol)?;
        cd.set_item("params", c.params)?;
        cd.set_item("dense_equivalent", c.dense_equivalent)?;
        cd.set_item("seconds", c.seconds)?;
        if let Some(dev) = &c.deviation {
            cd.set_item("hidden_max_rel", dev.report.max_rel)?;
            cd.set_item("hidden_frob_rel", dev.report.frob_rel)?;
            cd.set_item("against", dev.against)?;
        }
        let layers = PyList::empty(py);
        for l in &c.layers {
            let ld = PyDict::new(py);
            ld.set_item("name", &l.name)?;
            ld.set_item("kind", &l.kind)?;
            ld.set_item("ranks", l.ranks.clone())?;
            ld.set_item("params", l.params)?;
            ld.set_item("dense_params", l.dense_params)?;
            ld.set_item("rel_error", l.rel_error)?;
            layers.append(ld)?;
        }
        cd.set_item("layers", layers)?;
        comps.append(cd)?;
    }
    d.set_item("compressions", comps)?;
    Ok(d.into_any().unbind())
}

/// Writes the run's model as a Hugging Face directory; returns its architecture, files and
/// notes.
#[pyfunction]
#[pyo3(signature = (run, dir, *, samples=0, overwrite=false))]
pub fn export_hf(
    py: Python<'_>,
    run: PathBuf,
    dir: PathBuf,
    samples: usize,
    overwrite: bool,
) -> PyResult<Py<PyAny>> {
    let e = guard(|| {
        py.detach(|| {
            crate::threads::install(|| comera_import::export_run_hf(&run, &dir, samples, overwrite))
        })?
        .map_err(to_py)
    })?;
    let d = PyDict::new(py);
    d.set_item("dir", e.dir.display().to_string())?;
    d.set_item("architecture", e.architecture)?;
    d.set_item("files", e.files.clone())?;
    d.set_item("notes", e.notes.clone())?;
    d.set_item("checked", e.checked)?;
    Ok(d.into_any().unbind())
}

/// The TT and TTM layers of a run's model with the names of the modules that hold them in its
/// Hugging Face export (`run.export_hf(dir, compressed=True)` puts comera.torch layers
/// there): per layer a dict with `module`, `kind` (`linear` or `embedding`), the modes, ranks,
/// gate `threshold`, and the `cores`, `gates` (and a linear's `bias`) as float32 arrays. A
/// TT output projection of a masked LM (its columns padded past the vocabulary) is not
/// listed: the export keeps it dense.
#[pyfunction]
pub fn run_tt_modules(py: Python<'_>, path: PathBuf) -> PyResult<Py<PyAny>> {
    use comera_model::{AnyEmbedding, AnyLinear, Head};
    use numpy::{PyArray1, PyArrayMethods};
    let (saved, _) =
        guard(|| comera_train::infer::load_run(&path, None).map_err(crate::errors::to_py))?;
    let comera_train::files::SavedModel::Encoder(enc, _) = saved else {
        return Err(ModelError::new_err(format!(
            "{}: a DLRM; only text encoders have a Hugging Face export",
            path.display()
        )));
    };
    let threshold = enc.cfg.threshold;
    let module = |param: &str, leaf: &str| -> PyResult<String> {
        comera_import::hf::hf_export_name(&enc.cfg, param)
            .and_then(|n| n.strip_suffix(leaf).map(str::to_string))
            .ok_or_else(|| ModelError::new_err(format!("{param}: no Hugging Face name")))
    };
    let array = |p: &comera_layers::Param| -> PyResult<Py<PyAny>> {
        Ok(PyArray1::from_slice(py, &p.value)
            .reshape(p.shape.clone())?
            .into_any()
            .unbind())
    };
    let arrays = |ps: &[comera_layers::Param]| -> PyResult<Vec<Py<PyAny>>> {
        ps.iter().map(array).collect()
    };
    let out = PyList::empty(py);
    if let AnyEmbedding::Ttm(t) = &enc.word {
        let d = PyDict::new(py);
        d.set_item("module", module("embeddings.word.weight", ".weight")?)?;
        d.set_item("kind", "embedding")?;
        d.set_item("vocab_modes", t.shape().vocab_modes().to_vec())?;
        d.set_item("dim_modes", t.shape().dim_modes().to_vec())?;
        d.set_item("num_embeddings", t.shape().num_embeddings())?;
        d.set_item("ranks", t.shape().ranks().to_vec())?;
        d.set_item("threshold", threshold)?;
        d.set_item("cores", arrays(&t.cores)?)?;
        d.set_item("gates", arrays(&t.gates)?)?;
        out.append(d)?;
    }
    let mut linears: Vec<&AnyLinear> = Vec::new();
    for b in &enc.blocks {
        linears.extend([&b.q, &b.k, &b.v, &b.o, &b.up, &b.down]);
    }
    if let Head::Classifier(h) = &enc.head {
        linears.extend([&h.pool, &h.classifier]);
    }
    for l in linears {
        let AnyLinear::Tt(t) = l else { continue };
        let d = PyDict::new(py);
        d.set_item("module", module(&t.bias.name, ".bias")?)?;
        d.set_item("kind", "linear")?;
        d.set_item("in_modes", t.shape().in_modes().to_vec())?;
        d.set_item("out_modes", t.shape().out_modes().to_vec())?;
        d.set_item("ranks", t.shape().ranks().to_vec())?;
        d.set_item("threshold", threshold)?;
        d.set_item("cores", arrays(&t.cores)?)?;
        d.set_item("gates", arrays(&t.gates)?)?;
        d.set_item("bias", array(&t.bias)?)?;
        out.append(d)?;
    }
    Ok(out.into_any().unbind())
}
