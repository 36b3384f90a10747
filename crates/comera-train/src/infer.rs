//! Using a saved model of any kind: evaluation on its run's held-out data, on a given file or
//! from a checkpoint ([`eval_run`]), and predictions ([`predict_probabilities`] for a classifier,
//! [`fill_mask`] for a masked-LM encoder, [`predict_clicks`] for a DLRM).
//!
//! An encoder's evaluation and predictions also run on a GPU ([`eval_run_on`],
//! [`predict_probabilities_on`], [`fill_mask`] with `cuda` / `cuda:N`): only a classifier's
//! logits, or a masked-LM batch's loss or logits, are computed there
//! ([`crate::device::CudaLogits`]), batch by batch as on the CPU; the metrics and the
//! probabilities are the same host code. A DLRM is refused there by name with a
//! [`DeviceError`](crate::device::DeviceError) before the device is opened and before any data
//! is read.

use crate::checkpoint::Checkpoint;
use crate::config::ConfigError;
use crate::config::{AnyRunConfig, DataSource};
use crate::data::{prepare, CorpusData};
use crate::device::{check_inference, CudaLogits};
use crate::distributed::Processes;
use crate::error::{Error, Result};
use crate::files::{load_saved, DlrmMeta, ModelMeta, SavedModel, MODEL_META};
use crate::task::{
    evaluate_classifier_with, evaluate_ctr, evaluate_mlm_with, EncoderForward, EvalStats,
};
use crate::trainer::available_memory_bytes;
use comera_cuda::DeviceSpec;
use comera_data::ctr::{CatMapping, CriteoReader, CriteoSpec, CtrData, MovieLensFeatures};
use comera_data::BertTokenizer;
use comera_dlrm::config::{CtrDataConfig, CtrSource};
use comera_dlrm::loss::sigmoid;
use comera_dlrm::Dlrm;
use comera_layers::Model;
use comera_model::estimate::bytes_text;
use comera_model::{Encoder, HeadKind};
use std::path::Path;

/// The model of a run directory, or of one of its checkpoints, with the run's config.
pub fn load_run(run: &Path, checkpoint: Option<&Path>) -> Result<(SavedModel, AnyRunConfig)> {
    match checkpoint {
        Some(p) => {
            let ck = Checkpoint::load(p)?;
            let mut saved = ck.saved_model()?;
            saved.resolve_vocab(run);
            Ok((saved, ck.config()?))
        }
        None => {
            let cfg_path = run.join("config.toml");
            let cfg = AnyRunConfig::from_file(&cfg_path).map_err(|e| {
                Error::run_with("the run's data settings come from its config.toml", e)
            })?;
            check_saved_model(run)?;
            Ok((load_saved(run)?, cfg))
        }
    }
}

/// Refuses the model of a run directory before anything of it is built: a model whose memory
/// (estimated from its `model.toml`: the model's values and gradients, and the weights file
/// read beside them) exceeds what the machine has, or a classifier with other than one label
/// name per class. A `model.toml` that does not parse is left to the loader to report.
pub fn check_saved_model(run: &Path) -> Result<()> {
    let path = run.join(MODEL_META);
    let Ok(text) = comera_data::read_regular_to_string(&path) else {
        return Ok(());
    };
    let Ok(table) = text.parse::<toml::Table>() else {
        return Ok(());
    };
    let what = format!("loading the model of {}", path.display());
    let available = available_memory_bytes();
    if table.get("kind").and_then(|k| k.as_str()) == Some("dlrm") {
        let Ok(meta) = toml::from_str::<DlrmMeta>(&text) else {
            return Ok(());
        };
        // Training holds four values a parameter (value, gradient, two moments); loading
        // holds the value, the gradient and the file's bytes.
        let need = meta
            .model
            .estimate_memory_bytes(meta.n_dense, &meta.table_sizes, 1)
            * 3.0
            / 4.0;
        if need > available {
            return Err(Error::model(format!(
                "{what} needs about {}, but {} are available; the model's table_sizes or model.embedding_dim are too large for this machine",
                bytes_text(need),
                bytes_text(available)
            )));
        }
        return Ok(());
    }
    let Ok(meta) = toml::from_str::<ModelMeta>(&text) else {
        return Ok(());
    };
    let lay = meta
        .model
        .validate()
        .map_err(|e| Error::model_with(path.display().to_string(), e))?;
    meta.model
        .estimate_inference_memory(&lay, 1, meta.model.seq_len, 3)
        .check(available, &what)?;
    check_labels(&meta, &path)
}

/// A classifier's `labels` must name each of its `num_labels` classes once.
fn check_labels(meta: &ModelMeta, source: &Path) -> Result<()> {
    if meta.model.head == HeadKind::Classifier && meta.labels.len() != meta.model.num_labels {
        return Err(Error::model(format!(
            "{}: labels: {} names for a {}-label classifier (model.num_labels); each class needs one",
            source.display(),
            meta.labels.len(),
            meta.model.num_labels
        )));
    }
    Ok(())
}

/// Why a model gave non-finite outputs, as far as its weights tell: the largest weight
/// magnitude and where it is.
fn non_finite_cause(model: &dyn Model) -> String {
    let mut largest = (0.0f32, "");
    for p in model.params() {
        for v in &p.value {
            if v.abs() > largest.0 {
                largest = (v.abs(), &p.name);
            }
        }
    }
    let (magnitude, name) = largest;
    if magnitude > 1e6 {
        format!(
            "weights up to {magnitude:.1e} (`{name}`) overflow f32 arithmetic; the model file is damaged or was not trained"
        )
    } else {
        format!(
            "its largest weight is {magnitude:.3} (`{name}`); the arithmetic overflowed on this input"
        )
    }
}

/// An error if `values` (what the model computed for `what`) holds a NaN or an infinity.
fn check_finite_outputs(values: &[f32], model: &dyn Model, what: &str) -> Result<()> {
    if values.iter().all(|v| v.is_finite()) {
        return Ok(());
    }
    Err(Error::model(format!(
        "the model's {what} are not finite ({})",
        non_finite_cause(model)
    )))
}

/// What [`eval_run`] evaluated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvalKind {
    Classifier,
    MaskedLm,
    Ctr,
}

/// Evaluates the model of `run` (or of `checkpoint`) on its run's held-out data, or on
/// `data`: a file in the run's data format (a TSV/CSV/Parquet file of a file-source
/// classifier, a text file for a masked-LM model, a Criteo-format TSV for a DLRM).
pub fn eval_run(
    run: &Path,
    checkpoint: Option<&Path>,
    data: Option<&Path>,
    batch: usize,
) -> Result<(EvalKind, EvalStats)> {
    eval_run_on(run, checkpoint, data, batch, DeviceSpec::Cpu)
}

/// [`eval_run`] with the model's forward on `device`: `cpu`, or a CUDA GPU (a classifier's
/// logits, a masked-LM model's loss; a DLRM is refused there with a
/// [`DeviceError`](crate::device::DeviceError), before any data is read).
pub fn eval_run_on(
    run: &Path,
    checkpoint: Option<&Path>,
    data: Option<&Path>,
    batch: usize,
    device: DeviceSpec,
) -> Result<(EvalKind, EvalStats)> {
    if batch == 0 {
        return Err(ConfigError::new("--batch-size", "must be at least 1").into());
    }
    match load_run(run, checkpoint)? {
        (SavedModel::Encoder(model, meta), AnyRunConfig::Encoder(mut cfg)) => {
            check_inference(device, Some(&model))?;
            let t = meta.model.seq_len;
            // The model's own WordPiece vocabulary (the run's copy), whatever the config named.
            if cfg.data.tokenizer == "wordpiece" {
                cfg.data.vocab = Some(meta.vocab.clone());
            }
            if cfg.data.source.is_corpus() {
                if let Some(f) = data {
                    // Every document of the file is held out.
                    cfg.data.corpus = vec![f.display().to_string()];
                    cfg.data.valid_fraction = 1.0;
                }
                let mut d = CorpusData::new(&cfg.data, cfg.train.seed)?;
                d.packed(t)?;
                let rows = d.masker.max_selected_per_row(t);
                let blocks = &d.packed_ref(t).valid;
                let batch = clamp_batch(batch, blocks.len(), "held-out blocks")?;
                let (mut st, mut gpu);
                let mut forward = if device.is_cuda() {
                    gpu = CudaLogits::new(device, &model, batch, t, rows)?;
                    EncoderForward::Cuda(&mut gpu)
                } else {
                    st = model.state_for(batch, t, rows)?;
                    EncoderForward::Cpu {
                        model: &model,
                        st: &mut st,
                    }
                };
                let procs = &mut Processes::single();
                let s = evaluate_mlm_with(&mut forward, &d, blocks, batch, procs)?;
                check_finite_loss(&s, &model)?;
                return Ok((EvalKind::MaskedLm, s));
            }
            if let Some(f) = data {
                if !cfg.data.source.reads_files() || cfg.data.source == DataSource::Mnli {
                    return Err(ConfigError::new(
                        "--data",
                        format!("the run's data source `{}` is a fetched data set; --data takes a file of a file-source run (tsv, csv, jsonl, parquet)",
                        cfg.data.source),
                    )
                    .into());
                }
                // The file's own format, when its name says it (a run trained on CSV can
                // score a JSON Lines file with the same columns).
                if let Some(source) = DataSource::for_file(f) {
                    cfg.data.source = source;
                }
                // Only this file is read (not the training file the run came from).
                cfg.data.valid = Some(f.to_path_buf());
                cfg.data.train = Some(f.to_path_buf());
                cfg.data.train_sha256 = None;
                cfg.data.valid_sha256 = None;
            }
            let d = prepare(&cfg.data, t, cfg.train.seed)?;
            Ok((
                EvalKind::Classifier,
                evaluate_prepared(&model, &meta, &d, batch, device)?,
            ))
        }
        (SavedModel::Dlrm(model, _), AnyRunConfig::Dlrm(cfg)) => {
            check_inference(device, None)?;
            let valid = match data {
                Some(f) => read_click_rows(&model, &cfg.data, f, true)?,
                None => {
                    comera_dlrm::data::prepare(&cfg.data, cfg.train.seed)
                        .map_err(|e| Error::DlrmData(e.into()))?
                        .valid
                }
            };
            let batch = clamp_batch(batch, valid.len(), "validation examples")?;
            let mut st = model.state(batch);
            let s = evaluate_ctr(&model, &mut st, &valid)?.0;
            check_finite_loss(&s, &model)?;
            Ok((EvalKind::Ctr, s))
        }
        _ => Err(Error::model(format!(
            "{}: the model and the run's config.toml are of different kinds",
            run.display()
        ))),
    }
}

/// Evaluates the classifier of `run` (or of `checkpoint`) on the examples of `data`: a `[data]`
/// table of a file source whose `valid` file (or, without one, `train` file) is read whole.
/// Its labels default to the model's; labels that differ from the model's are refused. The
/// logits are computed on `device` (`cpu`, or a CUDA GPU, as [`eval_run_on`]).
pub fn eval_classifier_on(
    run: &Path,
    checkpoint: Option<&Path>,
    mut data: crate::config::DataConfig,
    batch: usize,
    device: DeviceSpec,
) -> Result<EvalStats> {
    if batch == 0 {
        return Err(ConfigError::new("batch_size", "must be at least 1").into());
    }
    let (SavedModel::Encoder(model, meta), AnyRunConfig::Encoder(cfg)) = load_run(run, checkpoint)?
    else {
        return Err(Error::model(format!(
            "{}: not a text classifier; evaluate it on its own data (eval_run)",
            run.display()
        )));
    };
    if meta.model.head != HeadKind::Classifier {
        return Err(Error::model(format!(
            "{}: a masked-LM model; evaluate it on text with eval_run",
            run.display()
        )));
    }
    match &data.labels {
        Some(l) if *l != meta.labels => {
            return Err(ConfigError::new(
                "data.labels",
                format!(
                    "the data's labels {:?} are not the model's {:?}",
                    l, meta.labels
                ),
            )
            .into())
        }
        _ => data.labels = Some(meta.labels.clone()),
    }
    if data.vocab.is_none() {
        data.vocab = Some(meta.vocab.clone());
    }
    // Every example is held out: the file is the validation set.
    match (&data.train, &data.valid) {
        (Some(_), None) => data.valid = data.train.clone(),
        (None, Some(_)) => data.train = data.valid.clone(),
        _ => {}
    }
    check_inference(device, Some(&model))?;
    let d = prepare(&data, meta.model.seq_len, cfg.train.seed)?;
    evaluate_prepared(&model, &meta, &d, batch, device)
}

/// A classifier on the validation set of `d`, whose labels must be the model's (an imported
/// model's config may name another data set: its accuracy there would mean nothing); its
/// logits computed on `device`.
fn evaluate_prepared(
    model: &Encoder,
    meta: &ModelMeta,
    d: &crate::data::PreparedData,
    batch: usize,
    device: DeviceSpec,
) -> Result<EvalStats> {
    if d.label_names != meta.labels {
        return Err(ConfigError::new(
            "data.labels",
            format!(
                "the data's labels {:?} are not the model's {:?}; evaluate it on data with its labels (--data FILE)",
                d.label_names, meta.labels
            ),
        )
        .into());
    }
    let batch = clamp_batch(batch, d.valid.len(), "validation examples")?;
    let c = model.cfg.num_labels;
    let procs = &mut Processes::single();
    let mut s = if device.is_cuda() {
        let mut gpu = CudaLogits::new(device, model, batch, d.valid.max_len, 0)?;
        evaluate_classifier_with(&mut EncoderForward::Cuda(&mut gpu), c, &d.valid, procs)?
    } else {
        let mut st = model.state(batch);
        evaluate_classifier_with(
            &mut EncoderForward::Cpu { model, st: &mut st },
            c,
            &d.valid,
            procs,
        )?
    };
    check_finite_loss(&s, model)?;
    if let Some(c) = &mut s.classes {
        c.labels = meta.labels.clone();
    }
    Ok(s)
}

/// An error if an evaluation's loss is not finite (the model's outputs overflowed).
fn check_finite_loss(s: &EvalStats, model: &dyn Model) -> Result<()> {
    if s.loss.is_finite() {
        return Ok(());
    }
    Err(Error::model(format!(
        "the evaluation loss is {}: the model's outputs are not finite ({})",
        s.loss,
        non_finite_cause(model)
    )))
}

/// The evaluation batch: at most the `n` items there are (a larger batch would only allocate
/// padding); no items at all is an error.
fn clamp_batch(batch: usize, n: usize, what: &str) -> Result<usize> {
    if n == 0 {
        return Err(Error::model(format!("no {what} to evaluate on")));
    }
    Ok(batch.min(n))
}

/// Reads a Criteo-format TSV for `model` (its table sizes, the run's id mapping).
/// The rows of `path` in the format of the model's data source (`cfg.source`): Criteo TSV for
/// `criteo` and `synthetic`; for `movielens`, an interaction file whose users and items are
/// looked up in the fetched MovieLens user and item files (labelled from its ratings at the
/// run's click threshold when `labelled`).
pub fn read_click_rows(
    model: &Dlrm,
    cfg: &CtrDataConfig,
    path: &Path,
    labelled: bool,
) -> Result<CtrData> {
    match cfg.source {
        CtrSource::Movielens => {
            let cache = cfg
                .cache_dir
                .clone()
                .unwrap_or_else(comera_data::default_cache_dir);
            let user = comera_data::fetch("ml-100k-user", &cache)?;
            let item = comera_data::fetch("ml-100k-item", &cache)?;
            let features = MovieLensFeatures::read(&user, &item, cfg.max_malformed)?;
            let sizes: Vec<usize> = model.tables.iter().map(|t| t.rows()).collect();
            if sizes != features.table_sizes {
                return Err(Error::model(format!(
                    "the model's tables ({sizes:?} rows) are not MovieLens' ({:?}): it was trained on other user and item files",
                    features.table_sizes
                )));
            }
            let data = features.rows(path, labelled.then_some(cfg.click_threshold))?;
            if data.is_empty() {
                return Err(Error::model(format!(
                    "{}: the input file is empty (no rows)",
                    path.display()
                )));
            }
            Ok(data)
        }
        CtrSource::Criteo | CtrSource::Synthetic => read_criteo(model, &cfg.mapping, path),
        CtrSource::Adult => Err(Error::model(format!(
            "{}: a DLRM trained on `{}` data scores no file (only criteo, synthetic and movielens models do)",
            path.display(),
            cfg.source
        ))),
    }
}

fn read_criteo(model: &Dlrm, mapping: &str, path: &Path) -> Result<CtrData> {
    let sizes: Vec<usize> = model.tables.iter().map(|t| t.rows()).collect();
    if sizes.len() != comera_data::ctr::CRITEO_CATS {
        return Err(Error::model(format!(
            "{}: this DLRM has {} fields; only models trained on Criteo-format data read Criteo TSV rows",
            path.display(),
            sizes.len()
        )));
    }
    let spec = CriteoSpec {
        table_sizes: sizes,
        mapping: mapping
            .parse::<CatMapping>()
            .map_err(|e| ConfigError::new("data.mapping", e.to_string()))?,
        max_malformed: 0,
    };
    let data = CriteoReader::open(path, spec)?.read_all(0)?;
    if data.is_empty() {
        return Err(Error::model(format!(
            "{}: the input file is empty (no rows)",
            path.display()
        )));
    }
    Ok(data)
}

/// Every class's probability for each text (pairs separated by a tab): `texts.len() × C`,
/// row-major, in `meta.labels` order; softmax of the logits, `batch` texts a forward (the
/// last batch padded with copies of its first text, which are dropped).
pub fn predict_probabilities(
    model: &Encoder,
    meta: &ModelMeta,
    texts: &[String],
    batch: usize,
) -> Result<Vec<f32>> {
    predict_probabilities_on(model, meta, texts, batch, DeviceSpec::Cpu)
}

/// [`predict_probabilities`] with the logits computed on `device` (`cpu`, or a CUDA GPU: the
/// same batches, the last padded and its padding dropped, the same softmax on the host). The
/// GPU is opened before any text is encoded; what it does not take is refused first.
pub fn predict_probabilities_on(
    model: &Encoder,
    meta: &ModelMeta,
    texts: &[String],
    batch: usize,
    device: DeviceSpec,
) -> Result<Vec<f32>> {
    if meta.model.head != HeadKind::Classifier {
        return Err(Error::model("a masked-LM model has no labels to predict: use it to fill [MASK] tokens, or fine-tune it with train.init_from"));
    }
    if batch == 0 {
        return Err(ConfigError::new("batch_size", "must be at least 1").into());
    }
    check_labels(meta, Path::new(MODEL_META))?;
    check_inference(device, Some(model))?;
    let tok = BertTokenizer::from_vocab_file(&meta.vocab)
        .map_err(|e| Error::model_with(format!("vocabulary {}", meta.vocab.display()), e))?;
    let (t, c) = (meta.model.seq_len, meta.labels.len());
    let b = batch.min(texts.len().max(1));
    let (mut st, mut gpu);
    let mut engine = if device.is_cuda() {
        gpu = CudaLogits::new(device, model, b, t, 0)?;
        EncoderForward::Cuda(&mut gpu)
    } else {
        st = model.state(b);
        EncoderForward::Cpu { model, st: &mut st }
    };
    // One batch of encoded texts: ids, token types, mask (b × t each), no labels (zeros).
    let mut enc_batch = comera_data::Batch {
        labels: vec![0; b],
        ..Default::default()
    };
    let mut out = Vec::with_capacity(texts.len() * c);
    for chunk in texts.chunks(b) {
        enc_batch.input_ids.clear();
        enc_batch.token_type_ids.clear();
        enc_batch.attention_mask.clear();
        for j in 0..b {
            let text = &chunk[if j < chunk.len() { j } else { 0 }];
            let enc = if meta.pair {
                let Some((x, y)) = text.split_once('\t') else {
                    return Err(Error::model(
                        "this model reads sentence pairs: separate the two texts with a tab",
                    ));
                };
                tok.encode_pair(x, y, t)?
            } else {
                tok.encode_single(text, t)?
            };
            enc_batch.input_ids.extend_from_slice(&enc.input_ids);
            enc_batch
                .token_type_ids
                .extend_from_slice(&enc.token_type_ids);
            enc_batch
                .attention_mask
                .extend_from_slice(&enc.attention_mask);
        }
        let logits = engine.logits(&enc_batch)?;
        check_finite_outputs(logits, model, "logits")?;
        for row in logits.chunks_exact(c).take(chunk.len()) {
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let z: f32 = row.iter().map(|&v| (v - max).exp()).sum();
            out.extend(row.iter().map(|&v| (v - max).exp() / z));
        }
    }
    Ok(out)
}

/// The `[MASK]`s of a text filled: for each, the most probable tokens with their
/// probabilities, best first.
pub type FilledMasks = Vec<Vec<(String, f32)>>;

/// For each `[MASK]` of each of `texts`, the `k` most probable tokens with their
/// probabilities, the logits computed on `device` (`cpu`, or a CUDA GPU: one sequence at a
/// time, the head with room for a mask at every position; the same softmax on the host).
pub fn fill_mask(
    model: &Encoder,
    meta: &ModelMeta,
    texts: &[String],
    k: usize,
    device: DeviceSpec,
) -> Result<Vec<FilledMasks>> {
    let comera_model::Head::Mlm(head) = &model.head else {
        return Err(Error::model(
            "a classifier has no masked-LM head: use it to predict labels",
        ));
    };
    // Logit rows are the decoder's width V′ ≥ V (a TT decoder pads).
    let width = head.width();
    check_inference(device, Some(model))?;
    let tok = BertTokenizer::from_vocab_file(&meta.vocab)
        .map_err(|e| Error::model_with(format!("vocabulary {}", meta.vocab.display()), e))?;
    let t = meta.model.seq_len;
    let mut gpu = match device.is_cuda() {
        true => Some(CudaLogits::new(device, model, 1, t, t)?),
        false => None,
    };
    texts
        .iter()
        .map(|text| {
            let (ids, mask, selected) = masked_sequence(&tok, text, t)?;
            let mut st;
            let logits = match &mut gpu {
                Some(gpu) => gpu.mlm_logits(&ids, &mask, &selected)?,
                None => {
                    st = model.state_for(1, t, selected.len())?;
                    let mut labels = vec![-100; t];
                    for &p in &selected {
                        labels[p as usize] = 0;
                    }
                    st.load_mlm(&ids, &mask, &labels, &selected)?;
                    model.forward(&mut st, false, 0)?;
                    st.logits()
                }
            };
            top_tokens(model, meta, &tok, logits, (selected.len(), width), k)
        })
        .collect()
}

/// `text` as one sequence of `t` tokens, `[CLS] piece [MASK] piece … [SEP] [PAD]…` (the text
/// split at its `[MASK]`s, so they need no support from the tokenizer's own splitting): ids,
/// attention mask, and the positions of the `[MASK]`s (at least one).
fn masked_sequence(
    tok: &BertTokenizer,
    text: &str,
    t: usize,
) -> Result<(Vec<u32>, Vec<u32>, Vec<u32>)> {
    let sp = tok.special_ids();
    let mut ids = vec![sp.cls];
    for (i, piece) in text.split("[MASK]").enumerate() {
        if i > 0 {
            ids.push(sp.mask);
        }
        ids.extend(tok.tokenize(piece)?);
    }
    ids.truncate(t - 1);
    ids.push(sp.sep);
    let mut mask = vec![1u32; ids.len()];
    mask.resize(t, 0);
    ids.resize(t, sp.pad);
    let selected: Vec<u32> = (0..t as u32)
        .filter(|&i| ids[i as usize] == sp.mask)
        .collect();
    if selected.is_empty() {
        return Err(Error::model(format!("no [MASK] in the text (within its first {t} tokens): write [MASK] where a token is to be predicted")));
    }
    Ok((ids, mask, selected))
}

/// The `k` most probable tokens of each of the first `masks` rows of `logits` (rows of
/// `width`, the decoder's; a TT decoder's padding columns past the vocabulary are −∞ by
/// design and not read).
fn top_tokens(
    model: &Encoder,
    meta: &ModelMeta,
    tok: &BertTokenizer,
    logits: &[f32],
    (masks, width): (usize, usize),
    k: usize,
) -> Result<FilledMasks> {
    let vocab = meta.model.vocab_size.min(width);
    for row in logits.chunks_exact(width.max(1)).take(masks) {
        check_finite_outputs(&row[..vocab], model, "logits")?;
    }
    Ok(logits
        .chunks_exact(width)
        .take(masks)
        .map(|row| {
            let row = &row[..vocab];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let z: f32 = row.iter().map(|&v| (v - max).exp()).sum();
            let mut idx: Vec<usize> = (0..vocab).collect();
            idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            idx.iter()
                .take(k)
                .map(|&i| {
                    let token = tok.id_to_token(i as u32).unwrap_or_else(|| format!("#{i}"));
                    (token, (row[i] - max).exp() / z)
                })
                .collect()
        })
        .collect())
}

/// Click probabilities of the rows of a file in the format the model was trained on: a
/// Criteo-format TSV (label column included, as in training files; it is ignored) or, for a
/// MovieLens model, an interaction file (`user_id`, `item_id`; see [`read_click_rows`]).
pub fn predict_clicks(model: &Dlrm, data: &CtrDataConfig, path: &Path) -> Result<Vec<f32>> {
    let data = read_click_rows(model, data, path, false)?;
    let mut st = model.state(1);
    let (_, scores) = evaluate_ctr(model, &mut st, &data)?;
    check_finite_outputs(&scores, model, "click logits")?;
    Ok(scores.into_iter().map(sigmoid).collect())
}
