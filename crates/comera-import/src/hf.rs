//! Hugging Face model directories, both ways.
//!
//! Export ([`export_hf`]): a directory that `transformers` loads with `from_pretrained(DIR)`
//! alone — `config.json`, `model.safetensors` (TT/TTM layers reconstructed, a TT output
//! projection cut to the vocabulary's V columns) and the tokenizer files of the run's
//! vocabulary (`vocab.txt`, `tokenizer_config.json` with `BertTokenizer`,
//! `special_tokens_map.json`). A classifier records `id2label`/`label2id` from the run's label
//! names. The family follows the LayerNorm placement:
//! - post-LN: `bert` (`BertForSequenceClassification` or `BertForMaskedLM`), every body tensor
//!   under `bert.`, the head as `classifier.*` or `cls.predictions.*`;
//! - pre-LN: `roberta-prelayernorm` (`RobertaPreLayerNormForSequenceClassification` or
//!   `…ForMaskedLM`), which computes what comera's pre-LN encoder does — embedding LN, LN before
//!   attention (`attention.LayerNorm` = comera's `ln1`) and before the FFN
//!   (`intermediate.LayerNorm` = `ln2`), residual sums without LN, a final LN
//!   (`roberta_prelayernorm.LayerNorm`), exact-erf GELU; the classifier head is dense + tanh +
//!   linear on the first token (`classifier.dense` = comera's pooler, `classifier.out_proj`),
//!   the MLM head `lm_head.{dense,layer_norm,decoder,bias}`. RoBERTa numbers a non-padding
//!   token at position t as `pad_token_id + 1 + t` (padding tokens get `pad_token_id`), so the
//!   position table is written with `pad_token_id + 1` zero rows before comera's `seq_len`
//!   rows. Only the hidden states *of* `[PAD]` positions differ from comera's (they are never
//!   attended to, so no other position's output, logit or prediction changes).
//!
//! Import ([`read_hf`]): a directory (or a `.zip` of one) with `config.json`,
//! `model.safetensors` and `vocab.txt` or a WordPiece `tokenizer.json` into a dense
//! [`Encoder`] with its label names and vocabulary; `comera import --out` saves it as a comera run
//! directory (`model.toml`, `model.safetensors`, `vocab.txt`, `config.toml`) that `inspect`,
//! `eval`, `predict` and `train --init-from` read. Unsupported configs are refused naming the
//! `config.json` field; missing or mis-shaped tensors naming the tensor.
//!
//! [`sample_reference`] and [`verdict`] say how far a compressed model is from the pretrained
//! one on sample inputs; [`check_file`] writes validation inputs with comera's logits so an
//! export can be compared with `transformers` outside comera.

use crate::bert::{import_dense, BertWeights, HfBertConfig, ImportInfo};
use crate::export::{
    densify, hf_tensors, safetensors_bytes, save_safetensors, write_error, FileData, FileTensor,
};
use crate::minilm::Reference;
use crate::{read_file_limited, zip_member, ImportError, Result, SizeLimit};
use comera_data::BertTokenizer;
use comera_layers::activation::Gelu;
use comera_layers::Layer;
use comera_model::{
    AnyEmbedding, AnyLinear, Encoder, EncoderConfig, Head, HeadKind, MlmDecoder, MlmDecoderKind,
};
use comera_tensor::{matmul, MatMut, MatRef};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// The Hugging Face class of a classifier export.
pub const SEQUENCE_CLASSIFICATION: &str = "BertForSequenceClassification";
/// The Hugging Face class of a masked-LM export.
pub const MASKED_LM: &str = "BertForMaskedLM";
/// The Hugging Face class of a pre-LN classifier export.
pub const PRE_LN_SEQUENCE_CLASSIFICATION: &str = "RobertaPreLayerNormForSequenceClassification";
/// The Hugging Face class of a pre-LN masked-LM export.
pub const PRE_LN_MASKED_LM: &str = "RobertaPreLayerNormForMaskedLM";

/// The architectures [`read_hf`] reads (with the head each implies).
const ARCHITECTURES: [&str; 4] = [
    "BertModel",
    SEQUENCE_CLASSIFICATION,
    MASKED_LM,
    "BertForPreTraining",
];

/// What a run's model needs besides its weights to be a Hugging Face model.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// Label names in label order (classifier).
    pub labels: Vec<String>,
    /// `vocab.txt` text, one token a line, line i = id i.
    pub vocab: String,
    /// Sentence-pair inputs (recorded in `config.json` as `comera_sentence_pair`).
    pub pair: bool,
}

/// What [`export_hf`] wrote.
#[derive(Clone, Debug)]
pub struct HfExport {
    /// `BertForSequenceClassification` or `BertForMaskedLM` (post-LN),
    /// `RobertaPreLayerNormForSequenceClassification` or `RobertaPreLayerNormForMaskedLM`
    /// (pre-LN).
    pub architecture: &'static str,
    /// File names written into the directory.
    pub files: Vec<String>,
    /// Changes a reader should know about (e.g. a TT decoder's padding columns dropped).
    pub notes: Vec<String>,
}

/// The Hugging Face model family of an export: the one whose LayerNorm placement is the model's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    /// Post-LN: `bert`.
    Bert,
    /// Pre-LN: `roberta-prelayernorm`.
    RobertaPreLn,
}

impl Family {
    fn of(cfg: &EncoderConfig) -> Family {
        if cfg.pre_ln {
            Family::RobertaPreLn
        } else {
            Family::Bert
        }
    }

    fn model_type(self) -> &'static str {
        match self {
            Family::Bert => "bert",
            Family::RobertaPreLn => "roberta-prelayernorm",
        }
    }

    fn architecture(self, head: HeadKind) -> &'static str {
        match (self, head) {
            (Family::Bert, HeadKind::Classifier) => SEQUENCE_CLASSIFICATION,
            (Family::Bert, HeadKind::Mlm) => MASKED_LM,
            (Family::RobertaPreLn, HeadKind::Classifier) => PRE_LN_SEQUENCE_CLASSIFICATION,
            (Family::RobertaPreLn, HeadKind::Mlm) => PRE_LN_MASKED_LM,
        }
    }

    /// Rows of the position table before comera's row 0: RoBERTa numbers positions from
    /// `pad_token_id + 1`.
    fn position_offset(self, pad: u32) -> usize {
        match self {
            Family::Bert => 0,
            Family::RobertaPreLn => pad as usize + 1,
        }
    }

    /// The name in this family of the tensor that [`hf_tensors`] names `bert` (a BERT name
    /// without the `bert.` prefix).
    fn tensor_name(self, bert: &str) -> String {
        match self {
            Family::Bert if bert.starts_with("classifier.") || bert.starts_with("cls.") => {
                bert.to_string()
            }
            Family::Bert => format!("bert.{bert}"),
            Family::RobertaPreLn => {
                // (BERT prefix, RoBERTa-PreLayerNorm prefix); the first that matches is used.
                const RENAMES: [(&str, &str); 9] = [
                    ("pooler.dense.", "classifier.dense."),
                    ("classifier.", "classifier.out_proj."),
                    ("cls.predictions.transform.dense.", "lm_head.dense."),
                    (
                        "cls.predictions.transform.LayerNorm.",
                        "lm_head.layer_norm.",
                    ),
                    ("cls.predictions.decoder.", "lm_head.decoder."),
                    ("cls.predictions.bias", "lm_head.bias"),
                    // Pre-LN: comera's ln1 sits before the attention, ln2 before the FFN.
                    ("attention.output.LayerNorm.", "attention.LayerNorm."),
                    ("output.LayerNorm.", "intermediate.LayerNorm."),
                    ("encoder.final_layer_norm.", "LayerNorm."),
                ];
                // Block tensors: `encoder.layer.{l}.` + the part renamed.
                let (layer, rest) = match bert.strip_prefix("encoder.layer.") {
                    Some(r) => match r.split_once('.') {
                        Some((l, rest)) => (format!("encoder.layer.{l}."), rest),
                        None => (String::new(), bert),
                    },
                    None => (String::new(), bert),
                };
                let renamed = RENAMES
                    .iter()
                    .find_map(|(from, to)| {
                        rest.strip_prefix(from).map(|tail| format!("{to}{tail}"))
                    })
                    .unwrap_or_else(|| rest.to_string());
                let name = format!("{layer}{renamed}");
                // The head (BERT's pooler included) sits beside the body.
                if name.starts_with("classifier.") || name.starts_with("lm_head.") {
                    name
                } else {
                    format!("roberta_prelayernorm.{name}")
                }
            }
        }
    }
}

/// The name that [`export_hf`] gives comera's parameter `comera_name` of a model of `cfg`
/// (e.g. `encoder.0.ffn.up.bias` → `bert.encoder.layer.0.intermediate.dense.bias`); `None`
/// for a name the export does not write.
pub fn hf_export_name(cfg: &EncoderConfig, comera_name: &str) -> Option<String> {
    crate::bert::hf_name(comera_name).map(|h| Family::of(cfg).tensor_name(&h.name))
}

/// Writes `enc` as a Hugging Face directory, BERT (post-LN) or RoBERTa-PreLayerNorm (pre-LN)
/// (see the module docs).
pub fn export_hf(enc: &Encoder, info: &ModelInfo, dir: &Path) -> Result<HfExport> {
    let cfg = &enc.cfg;
    let family = Family::of(cfg);
    let vocab_len = info.vocab.lines().count();
    if vocab_len != cfg.vocab_size {
        return Err(ImportError::new(
            "vocabulary",
            format!(
                "has {vocab_len} tokens, the model's vocab_size is {}",
                cfg.vocab_size
            ),
        ));
    }
    let tok = BertTokenizer::from_vocab_text(&info.vocab, Path::new("vocab.txt"))
        .map_err(|e| ImportError::new("vocabulary", e.to_string()))?;
    let mut notes = Vec::new();
    if let Head::Mlm(h) = &enc.head {
        if let MlmDecoder::Own(AnyLinear::Tt(t)) = &h.decoder {
            notes.push(format!(
                "the TT output projection ({} → {} logits) is written as a dense {} × {} matrix: its {} padding columns only ever give −∞ logits and are dropped",
                t.in_features(),
                t.out_features(),
                cfg.vocab_size,
                t.in_features(),
                t.out_features() - cfg.vocab_size
            ));
        }
    }
    let mut tensorised = 0;
    enc.visit_compressible(&mut |_| tensorised += 1);
    if tensorised > 0 {
        notes.push(format!(
            "TT/TTM layers reconstructed to dense: {} parameters as {} dense ones",
            enc.num_params(),
            enc.dense_equivalent_params()
        ));
    }
    let dense = densify(enc);
    let ids = tok.special_ids();
    let offset = family.position_offset(ids.pad);
    let positions = family.tensor_name("embeddings.position_embeddings.weight");
    let mut tensors: Vec<FileTensor<'_>> = hf_tensors(&dense)?;
    for t in &mut tensors {
        t.name = family.tensor_name(&t.name);
        if t.name == positions && offset > 0 {
            // Zero rows for the positions RoBERTa never gives a non-padding token.
            if let FileData::F32(values) = t.data {
                t.data = FileData::F32AfterZeroRows {
                    rows: offset,
                    values,
                };
                t.shape[0] += offset;
            }
        }
    }
    let mut config = json!({
        "model_type": family.model_type(),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "intermediate_size": cfg.ffn,
        "hidden_act": "gelu",
        "hidden_dropout_prob": short(cfg.dropout),
        "attention_probs_dropout_prob": 0.0,
        "max_position_embeddings": cfg.seq_len + offset,
        "type_vocab_size": cfg.type_vocab,
        "initializer_range": short(cfg.init_std),
        "layer_norm_eps": short(cfg.ln_eps),
        "pad_token_id": ids.pad,
        "position_embedding_type": "absolute",
        "torch_dtype": "float32",
        "comera_sentence_pair": info.pair,
    });
    if family == Family::RobertaPreLn {
        // RoBERTa's <s> and </s> are BERT's [CLS] and [SEP] (its defaults are 0 and 2).
        config["bos_token_id"] = json!(ids.cls);
        config["eos_token_id"] = json!(ids.sep);
    }
    let architecture = family.architecture(cfg.head);
    match cfg.head {
        HeadKind::Classifier => {
            if info.labels.len() != cfg.num_labels {
                return Err(ImportError::new(
                    "labels",
                    format!(
                        "{} label names for a {}-label classifier",
                        info.labels.len(),
                        cfg.num_labels
                    ),
                ));
            }
            let id2label: serde_json::Map<String, Value> = info
                .labels
                .iter()
                .enumerate()
                .map(|(i, l)| (i.to_string(), json!(l)))
                .collect();
            let label2id: serde_json::Map<String, Value> = info
                .labels
                .iter()
                .enumerate()
                .map(|(i, l)| (l.clone(), json!(i)))
                .collect();
            config["id2label"] = Value::Object(id2label);
            config["label2id"] = Value::Object(label2id);
            config["problem_type"] = json!("single_label_classification");
        }
        HeadKind::Mlm => {
            let tied = dense.cfg.mlm_decoder() == MlmDecoderKind::Tied;
            config["tie_word_embeddings"] = json!(tied);
            // transformers keeps `cls.predictions.decoder.bias` (`lm_head.decoder.bias`) as
            // the same tensor as `cls.predictions.bias` (`lm_head.bias`); both are written.
            let bias = family.tensor_name("cls.predictions.bias");
            let found = tensors.iter().find_map(|t| match t.data {
                FileData::F32(values) if t.name == bias => Some((t.shape.clone(), values)),
                _ => None,
            });
            if let Some((shape, values)) = found {
                tensors.push(FileTensor {
                    name: family.tensor_name("cls.predictions.decoder.bias"),
                    shape,
                    data: FileData::F32(values),
                });
            }
        }
    }
    config["architectures"] = json!([architecture]);
    let t = cfg.seq_len;
    let tokenizer_config = json!({
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": true,
        "tokenize_chinese_chars": true,
        "strip_accents": null,
        "model_max_length": t,
        "unk_token": "[UNK]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
        "clean_up_tokenization_spaces": true,
    });
    let special = json!({
        "unk_token": "[UNK]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
    });
    let weights = "model.safetensors";
    let weights_meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    save_safetensors(&dir.join(weights), tensors, &weights_meta)?;
    let pretty = |v: &Value| serde_json::to_string_pretty(v).expect("JSON values print") + "\n";
    let mut vocab = info.vocab.clone();
    if !vocab.ends_with('\n') {
        vocab.push('\n');
    }
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("config.json", pretty(&config).into_bytes()),
        ("vocab.txt", vocab.into_bytes()),
        (
            "tokenizer_config.json",
            pretty(&tokenizer_config).into_bytes(),
        ),
        ("special_tokens_map.json", pretty(&special).into_bytes()),
    ];
    for (name, bytes) in &files {
        write_file(&dir.join(name), bytes)?;
    }
    // The files in the order a reader expects: the config, the weights, the tokenizer's.
    let mut written: Vec<String> = files.iter().map(|(n, _)| n.to_string()).collect();
    written.insert(1, weights.to_string());
    Ok(HfExport {
        architecture,
        files: written,
        notes,
    })
}

/// An f32 as the f64 of its shortest decimal form (0.1, not 0.10000000149011612).
fn short(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    comera_train::files::write_atomic(path, bytes).map_err(|e| write_error(path, &e))
}

/// A Hugging Face BERT read by [`read_hf`]: the dense model and what a run needs besides it.
#[derive(Clone, Debug)]
pub struct HfModel {
    pub encoder: Encoder,
    pub info: ModelInfo,
    /// The `architectures` entry the head came from.
    pub architecture: String,
    pub import: ImportInfo,
    /// Things the reader should know (e.g. a tokenizer setting comera does not follow).
    pub notes: Vec<String>,
}

/// Options of [`read_hf`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ReadOptions {
    /// Sequence length (default: min(128, max_position_embeddings)).
    pub seq_len: Option<usize>,
    /// Labels of a fresh classifier when the file has none (default 2).
    pub num_labels: Option<usize>,
    /// Seed of the parts the file lacks (a fresh classifier).
    pub seed: u64,
}

/// Reads member `name` of a model directory or a `.zip` of one (`None` when absent), if it
/// holds at most `limit` bytes (a zip member's declared size and the bytes it inflates to are
/// both checked).
fn member(src: &Path, name: &str, limit: &SizeLimit) -> Result<Option<Vec<u8>>> {
    let shown = src.display().to_string();
    if src.is_dir() {
        let p = src.join(name);
        if !p.exists() {
            return Ok(None);
        }
        return read_file_limited(&p, limit).map(Some);
    }
    let f = comera_data::open_regular(src)
        .map_err(|e| ImportError::new(&shown, format!("cannot read: {e}")))?;
    let mut zip = zip::ZipArchive::new(f).map_err(|e| {
        ImportError::new(
            &shown,
            format!("neither a directory nor a readable zip: {e}"),
        )
    })?;
    zip_member(&mut zip, &shown, name, limit)
}

/// The most bytes the `model.safetensors` of a model of shape `cfg` (its file holds
/// `max_positions` position rows) may hold: twice its weights in F32 with a masked-LM head
/// besides (a checkpoint may hold a few tensors comera does not use) and room for the header,
/// and at most what the machine can load.
fn weights_limit(cfg: &EncoderConfig, max_positions: usize) -> SizeLimit {
    let expected = cfg
        .validate()
        .map(|lay| {
            let (d, v) = (cfg.d_model as f64, cfg.vocab_size as f64);
            let own = cfg.estimate_inference_memory(&lay, 1, max_positions, 1);
            own.params_bytes + 4.0 * (d * v + d * d + v)
        })
        .unwrap_or(f64::INFINITY);
    let bytes = 2.0 * expected + (16u64 << 20) as f64;
    SizeLimit {
        bytes: bytes.min(u64::MAX as f64) as u64,
        why: format!(
            "config.json describes about {} of F32 weights",
            comera_model::estimate::bytes_text(expected)
        ),
    }
    .min(SizeLimit::weights())
}

fn text(bytes: Vec<u8>, what: &str) -> Result<String> {
    String::from_utf8(bytes).map_err(|_| ImportError::new(what, "not UTF-8 text"))
}

/// The vocabulary of a model directory: `vocab.txt`, else the WordPiece vocabulary of
/// `tokenizer.json` (`model.vocab`, token → id) written out in id order.
fn read_vocab(src: &Path) -> Result<Option<String>> {
    let shown = src.display().to_string();
    if let Some(b) = member(src, "vocab.txt", &SizeLimit::text())? {
        return text(b, &format!("{shown}: vocab.txt")).map(Some);
    }
    let Some(b) = member(src, "tokenizer.json", &SizeLimit::text())? else {
        return Ok(None);
    };
    let what = format!("{shown}: tokenizer.json");
    let v: Value = serde_json::from_slice(&b)
        .map_err(|e| ImportError::new(&what, format!("not JSON: {e}")))?;
    let kind = v["model"]["type"].as_str().unwrap_or("");
    if kind != "WordPiece" {
        return Err(ImportError::new(
            format!("{what}: model.type"),
            format!("is `{kind}`; comera reads BERT WordPiece vocabularies only"),
        ));
    }
    let map = v["model"]["vocab"]
        .as_object()
        .ok_or_else(|| ImportError::new(format!("{what}: model.vocab"), "is not a map"))?;
    let mut tokens = vec![None; map.len()];
    for (tok, id) in map {
        let id = id.as_u64().map(|i| i as usize).filter(|&i| i < map.len());
        let slot = id.and_then(|i| tokens.get_mut(i)).ok_or_else(|| {
            ImportError::new(
                format!("{what}: model.vocab"),
                format!("token {tok:?} has id {id:?}, not one of 0..{}", map.len()),
            )
        })?;
        *slot = Some(tok.clone());
    }
    let mut out = String::new();
    for (i, t) in tokens.into_iter().enumerate() {
        let t = t.ok_or_else(|| {
            ImportError::new(
                format!("{what}: model.vocab"),
                format!("no token has id {i}"),
            )
        })?;
        out.push_str(&t);
        out.push('\n');
    }
    Ok(Some(out))
}

/// Whether a model directory (or `.zip`) has member `name`.
fn has_member(src: &Path, name: &str) -> bool {
    if src.is_dir() {
        return src.join(name).exists();
    }
    comera_data::open_regular(src)
        .ok()
        .and_then(|f| zip::ZipArchive::new(f).ok())
        .is_some_and(|z| z.index_for_name(name).is_some())
}

/// The label names of a classifier's `id2label` (`v`): ids 0..n each once, at least two, as
/// many as `num_labels` says when present; `field` names a config.json field in errors.
fn id2label(
    v: &Value,
    num_labels: Option<&Value>,
    field: &dyn Fn(&str) -> String,
) -> Result<Vec<String>> {
    let m = v
        .as_object()
        .ok_or_else(|| ImportError::new(field("id2label"), "is not a map of id to label name"))?;
    if m.len() < 2 {
        return Err(ImportError::new(
            field("id2label"),
            format!(
                "has {} label(s); a classifier needs at least 2 (ids \"0\", \"1\", …)",
                m.len()
            ),
        ));
    }
    let mut names = vec![None; m.len()];
    for (k, name) in m {
        let slot = k
            .parse::<usize>()
            .ok()
            .filter(|i| i.to_string() == *k)
            .and_then(|i| names.get_mut(i))
            .ok_or_else(|| {
                ImportError::new(
                    field("id2label"),
                    format!("key {k:?} is not an id in 0..{}", m.len() - 1),
                )
            })?;
        *slot = Some(
            name.as_str()
                .map(str::to_string)
                .unwrap_or(name.to_string()),
        );
    }
    // n distinct keys each in 0..n fill every slot.
    let names: Vec<String> = names.into_iter().flatten().collect();
    if let Some(n) = num_labels {
        if n.as_u64() != Some(names.len() as u64) {
            return Err(ImportError::new(
                field("num_labels"),
                format!("is {n}, but id2label names {} labels", names.len()),
            ));
        }
    }
    Ok(names)
}

/// Reads a Hugging Face BERT directory (or a `.zip` of one); see the module docs.
pub fn read_hf(src: &Path, opts: &ReadOptions) -> Result<HfModel> {
    let shown = src.display().to_string();
    if !src.exists() {
        // A hub name (`bert-base-uncased`, `org/model`) rather than a path: comera reads local
        // copies only (it downloads nothing but from package registries).
        let hint = if src.is_relative() && src.components().count() <= 2 {
            format!(
                "does not exist; comera reads a local copy of a Hugging Face model: download it first (e.g. `huggingface-cli download {shown} --local-dir models/{shown}`, or `git clone https://huggingface.co/{shown}`), then give that directory"
            )
        } else {
            "does not exist".to_string()
        };
        return Err(ImportError::new(&shown, hint));
    }
    let cfg_what = format!("{shown}: config.json");
    let config_text = text(
        member(src, "config.json", &SizeLimit::text())?.ok_or_else(|| {
            ImportError::new(
                &cfg_what,
                "is missing (a Hugging Face model directory has one)",
            )
        })?,
        &cfg_what,
    )?;
    let config: Value = serde_json::from_str(&config_text)
        .map_err(|e| ImportError::new(&cfg_what, format!("not JSON: {e}")))?;
    let field = |k: &str| format!("{cfg_what}: {k}");
    match config.get("model_type").and_then(Value::as_str) {
        Some("bert") => {}
        Some(other) => {
            return Err(ImportError::new(
                field("model_type"),
                format!("is `{other}`; comera reads `bert` models only"),
            ))
        }
        None => {
            return Err(ImportError::new(
                field("model_type"),
                "is missing; expected `bert`",
            ))
        }
    }
    let architecture = match config.get("architectures") {
        None | Some(Value::Null) => "BertModel".to_string(),
        Some(v) => {
            let a = v
                .as_array()
                .and_then(|a| a.first())
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ImportError::new(field("architectures"), "is not a list of class names")
                })?;
            if !ARCHITECTURES.contains(&a) {
                return Err(ImportError::new(
                    field("architectures"),
                    format!("`{a}` is not supported; expected one of {ARCHITECTURES:?}"),
                ));
            }
            a.to_string()
        }
    };
    if config.get("is_decoder").and_then(Value::as_bool) == Some(true) {
        return Err(ImportError::new(
            field("is_decoder"),
            "is true: comera's encoder attends both ways",
        ));
    }
    let hf = HfBertConfig::parse(&config_text, &cfg_what)?;
    let mlm = matches!(architecture.as_str(), MASKED_LM | "BertForPreTraining");
    // Labels: id2label of a classifier (ids 0..n), else a fresh head of num_labels.
    let labels: Vec<String> = match (&architecture[..], config.get("id2label")) {
        (SEQUENCE_CLASSIFICATION, Some(v)) => id2label(v, config.get("num_labels"), &field)?,
        _ => (0..opts.num_labels.unwrap_or(2))
            .map(|i| format!("LABEL_{i}"))
            .collect(),
    };
    let seq_len = opts.seq_len.unwrap_or(hf.max_position_embeddings.min(128));
    let mut cfg = hf.encoder_config(&cfg_what, seq_len, labels.len().max(2))?;
    if mlm {
        cfg.head = HeadKind::Mlm;
        let tied = config
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        cfg.mlm_decoder = if tied {
            MlmDecoderKind::Tied
        } else {
            MlmDecoderKind::Dense
        };
    }
    let st_what = format!("{shown}: model.safetensors");
    let weights_limit = weights_limit(&cfg, hf.max_position_embeddings);
    let Some(bytes) = member(src, "model.safetensors", &weights_limit)? else {
        let hint = if has_member(src, "pytorch_model.bin") {
            " (there is a pytorch_model.bin: comera reads safetensors only; save the model with safe_serialization=True)"
        } else {
            ""
        };
        return Err(ImportError::new(&st_what, format!("is missing{hint}")));
    };
    let vocab = read_vocab(src)?.ok_or_else(|| {
        ImportError::new(
            &shown,
            "has no vocabulary: expected vocab.txt or a WordPiece tokenizer.json",
        )
    })?;
    let n = vocab.lines().count();
    if n != cfg.vocab_size {
        return Err(ImportError::new(
            field("vocab_size"),
            format!("is {} but the vocabulary has {n} tokens", cfg.vocab_size),
        ));
    }
    BertTokenizer::from_vocab_text(&vocab, Path::new("vocab.txt"))
        .map_err(|e| ImportError::new(format!("{shown}: vocabulary"), e.to_string()))?;
    let weights = BertWeights::from_bytes(&bytes, &st_what)?;
    let (encoder, mut import) = import_dense(&weights, &cfg, opts.seed)?;
    // transformers writes the MLM bias twice (`cls.predictions.bias` and the decoder's).
    let bias = |n: &str| weights.get(n).map(|t| &t.data);
    import
        .unused
        .retain(|n| n != "cls.predictions.decoder.bias" || bias(n) != bias("cls.predictions.bias"));
    let mut notes = Vec::new();
    if let Some(b) = member(src, "tokenizer_config.json", &SizeLimit::text())? {
        let tc: Value = serde_json::from_slice(&b).unwrap_or(Value::Null);
        if tc.get("do_lower_case").and_then(Value::as_bool) == Some(false) {
            notes.push("tokenizer_config.json: do_lower_case = false, but comera's BERT tokenizer lower-cases: the model will see other ids than it was trained on".into());
        }
    }
    let pair = config
        .get("comera_sentence_pair")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(HfModel {
        encoder,
        info: ModelInfo {
            labels,
            vocab,
            pair,
        },
        architecture,
        import,
        notes,
    })
}

/// Sample inputs for measuring how far a model moved: the built-in MiniLM reference
/// sentences, tokenised with `vocab`, and `enc`'s last hidden states on them.
pub fn sample_reference(enc: &Encoder, vocab: &str) -> Result<Reference> {
    let tok = BertTokenizer::from_vocab_text(vocab, Path::new("vocab.txt"))
        .map_err(|e| ImportError::new("vocabulary", e.to_string()))?;
    let sentences = crate::minilm::reference().sentences;
    let t = enc.cfg.seq_len;
    let mut ids = Vec::new();
    for s in &sentences {
        let e = tok
            .encode_single(s, t)
            .map_err(|e| ImportError::new("sample sentence", e.to_string()))?;
        let len = e.attention_mask.iter().filter(|&&m| m != 0).count();
        ids.push(e.input_ids[..len].to_vec());
    }
    let mut r = Reference {
        sentences,
        ids,
        hidden: Vec::new(),
        d_model: enc.cfg.d_model,
    };
    // The model's own hidden states: check against an empty reference fills nothing, so run
    // the batch directly.
    let (b, d) = (r.ids.len(), enc.cfg.d_model);
    let (ids, mask) = pad_batch(&r.ids, t);
    let mut st = enc.state(b);
    st.load(&ids, &vec![0; b * t], &mask, &vec![0; b])
        .map_err(|e| ImportError::new("sample batch", e.to_string()))?;
    enc.forward(&mut st, false, 0)
        .map_err(|e| ImportError::new("sample batch", e.to_string()))?;
    let h = st.hidden();
    for (s, row) in r.ids.iter().enumerate() {
        r.hidden
            .push(h[s * t * d..s * t * d + row.len() * d].to_vec());
    }
    Ok(r)
}

/// Ids and attention masks (batch × t) of unpadded id rows.
fn pad_batch(rows: &[Vec<u32>], t: usize) -> (Vec<u32>, Vec<u32>) {
    let mut ids = vec![0u32; rows.len() * t];
    let mut mask = vec![0u32; rows.len() * t];
    for (s, row) in rows.iter().enumerate() {
        ids[s * t..s * t + row.len()].copy_from_slice(row);
        mask[s * t..s * t + row.len()].fill(1);
    }
    (ids, mask)
}

/// In words, what a hidden-state error (‖H_compressed − H‖_F / ‖H‖_F on sample inputs) means.
pub fn verdict(frob_rel: f64) -> String {
    if frob_rel <= 0.01 {
        format!("hidden-state error {frob_rel:.3}: the compressed model computes what the pretrained one does")
    } else if frob_rel <= 0.1 {
        format!("hidden-state error {frob_rel:.3}: close to the pretrained model, not equal to it; check the task metric before relying on it")
    } else {
        format!("hidden-state error {frob_rel:.2}: treat this as an initialisation, not as the pretrained model; to keep the pretrained model's accuracy, distil it from the dense model fine-tuned on your task (train --init-from THIS --teacher TEACHER; README, \"Compressing a pretrained model\")")
    }
}

/// The MLM head's logits (rows × V, padding columns of a TT projection cut) at flat
/// positions `rows` of `hidden` (N × D): transform, GELU, LayerNorm, output projection.
pub fn mlm_logits(enc: &Encoder, hidden: &[f32], rows: &[usize]) -> Result<Vec<f32>> {
    let Head::Mlm(h) = &enc.head else {
        return Err(ImportError::new("model.head", "is not a masked-LM head"));
    };
    let (d, v, r) = (enc.cfg.d_model, enc.cfg.vocab_size, rows.len());
    let mut x = vec![0.0f32; r * d];
    for (i, &s) in rows.iter().enumerate() {
        x[i * d..(i + 1) * d].copy_from_slice(&hidden[s * d..(s + 1) * d]);
    }
    let mut pre = vec![0.0f32; r * d];
    h.transform
        .forward(&mut h.transform.workspace(r), &x, &mut pre);
    let mut act = vec![0.0f32; r * d];
    Gelu.forward(&pre, &mut act);
    let mut t = vec![0.0f32; r * d];
    h.ln.forward(&mut h.ln.workspace(r), &act, &mut t);
    let wide = h.width();
    let mut z = vec![0.0f32; r * wide];
    match &h.decoder {
        MlmDecoder::Own(l) => l.forward(&mut l.workspace(r), &t, &mut z),
        MlmDecoder::Tied { bias } => {
            let AnyEmbedding::Dense(e) = &enc.word else {
                return Err(ImportError::new(
                    "model.mlm_decoder",
                    "tied to a word embedding that is not dense",
                ));
            };
            // Z = T·Eᵀ + b: (R × D)·(D × V).
            matmul(
                MatMut::new(&mut z, r, wide),
                MatRef::new(&t, r, d),
                MatRef::new(&e.table.value, wide, d).t(),
                false,
            );
            for row in z.chunks_exact_mut(wide) {
                for (o, b) in row.iter_mut().zip(&bias.value) {
                    *o += b;
                }
            }
        }
    }
    Ok(z.chunks_exact(wide)
        .flat_map(|row| row[..v].iter().copied())
        .collect())
}

/// Validation inputs and comera's logits on them, as safetensors bytes, for comparing an
/// export with another implementation: `input_ids`, `attention_mask`, `token_type_ids` (I64,
/// n × T) and `logits` (F32): n × labels for a classifier; for a masked-LM, `positions` (I64,
/// n: the first masked position of each row) and the logits there (n × V).
pub fn check_file(
    enc: &Encoder,
    ids: &[u32],
    types: &[u32],
    mask: &[u32],
    positions: Option<&[usize]>,
) -> Result<Vec<u8>> {
    let t = enc.cfg.seq_len;
    let n = ids.len() / t;
    let mut st = enc.state(n);
    let (logits, width) = match positions {
        None => {
            st.load(ids, types, mask, &vec![0; n])
                .map_err(|e| ImportError::new("check inputs", e.to_string()))?;
            enc.forward(&mut st, false, 0)
                .map_err(|e| ImportError::new("check inputs", e.to_string()))?;
            (st.logits().to_vec(), enc.cfg.num_labels)
        }
        Some(pos) => {
            st.load_mlm(ids, mask, &vec![-100; n * t], &[])
                .map_err(|e| ImportError::new("check inputs", e.to_string()))?;
            enc.forward(&mut st, false, 0)
                .map_err(|e| ImportError::new("check inputs", e.to_string()))?;
            let flat: Vec<usize> = pos.iter().enumerate().map(|(i, &p)| i * t + p).collect();
            (mlm_logits(enc, st.hidden(), &flat)?, enc.cfg.vocab_size)
        }
    };
    let i64s = |name: &str, shape: Vec<usize>, v: &[u32]| FileTensor {
        name: name.to_string(),
        shape,
        data: FileData::I64(v.iter().map(|&x| x as i64).collect()),
    };
    let mut tensors = vec![
        i64s("input_ids", vec![n, t], ids),
        i64s("attention_mask", vec![n, t], mask),
        i64s("token_type_ids", vec![n, t], types),
        FileTensor {
            name: "logits".to_string(),
            shape: vec![n, width],
            data: FileData::F32Owned(logits),
        },
    ];
    if let Some(pos) = positions {
        let p: Vec<u32> = pos.iter().map(|&p| p as u32).collect();
        tensors.push(i64s("positions", vec![n], &p));
    }
    safetensors_bytes(
        tensors,
        &BTreeMap::from([("format".to_string(), "pt".to_string())]),
    )
}

/// The contents of a [`check_file`].
#[derive(Clone, Debug)]
pub struct CheckInputs {
    /// n × T each.
    pub input_ids: Vec<u32>,
    pub token_type_ids: Vec<u32>,
    pub attention_mask: Vec<u32>,
    /// Masked-LM: the position (in its row) whose logits are stored.
    pub positions: Option<Vec<usize>>,
    /// n × width.
    pub logits: Vec<f32>,
}

/// Reads a [`check_file`]; `source` names it in errors.
pub fn read_check_file(bytes: &[u8], source: &str) -> Result<CheckInputs> {
    let st = safetensors::SafeTensors::deserialize(bytes)
        .map_err(|e| ImportError::new(source, format!("not a valid safetensors file: {e}")))?;
    let get = |name: &str, dtype: safetensors::Dtype| {
        let t = st
            .tensor(name)
            .map_err(|_| ImportError::new(format!("{source}: tensor `{name}`"), "is missing"))?;
        if t.dtype() != dtype {
            return Err(ImportError::new(
                format!("{source}: tensor `{name}`"),
                format!("is {:?}, expected {dtype:?}", t.dtype()),
            ));
        }
        Ok(t.data().to_vec())
    };
    let ints = |name: &str| -> Result<Vec<u32>> {
        Ok(get(name, safetensors::Dtype::I64)?
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")) as u32)
            .collect())
    };
    let positions = match st.tensor("positions") {
        Ok(_) => Some(ints("positions")?.into_iter().map(|p| p as usize).collect()),
        Err(_) => None,
    };
    Ok(CheckInputs {
        input_ids: ints("input_ids")?,
        token_type_ids: ints("token_type_ids")?,
        attention_mask: ints("attention_mask")?,
        positions,
        logits: get("logits", safetensors::Dtype::F32)?
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect(),
    })
}
