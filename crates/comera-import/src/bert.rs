//! Hugging Face BERT checkpoints → a dense comera [`Encoder`].
//!
//! Name mapping (comera ← HF; `ᵀ` marks a transposed linear weight: HF stores (out, in), comera
//! `Y = X·W + b` with W (in, out)):
//!
//! | comera | Hugging Face BERT |
//! |---|---|
//! | `embeddings.word.weight` | `embeddings.word_embeddings.weight` |
//! | `embeddings.position.weight` (seq_len rows) | `embeddings.position_embeddings.weight` (first seq_len rows) |
//! | `embeddings.token_type.weight` | `embeddings.token_type_embeddings.weight` |
//! | `embeddings.ln.{gamma,beta}` | `embeddings.LayerNorm.{weight,bias}` |
//! | `encoder.{l}.attn.{q,k,v}.weight` | `encoder.layer.{l}.attention.self.{query,key,value}.weight`ᵀ |
//! | `encoder.{l}.attn.o.weight` | `encoder.layer.{l}.attention.output.dense.weight`ᵀ |
//! | `encoder.{l}.ln1.{gamma,beta}` | `encoder.layer.{l}.attention.output.LayerNorm.{weight,bias}` |
//! | `encoder.{l}.ffn.up.weight` | `encoder.layer.{l}.intermediate.dense.weight`ᵀ |
//! | `encoder.{l}.ffn.down.weight` | `encoder.layer.{l}.output.dense.weight`ᵀ |
//! | `encoder.{l}.ln2.{gamma,beta}` | `encoder.layer.{l}.output.LayerNorm.{weight,bias}` |
//! | `pooler.weight` | `pooler.dense.weight`ᵀ |
//! | `classifier.weight` | `classifier.weight`ᵀ (optional: kept at its initialisation if absent) |
//! | `encoder.ln_final.{gamma,beta}` (pre-LN only) | `encoder.final_layer_norm.{weight,bias}` (comera's own) |
//! | `mlm.transform.weight` | `cls.predictions.transform.dense.weight`ᵀ |
//! | `mlm.ln.{gamma,beta}` | `cls.predictions.transform.LayerNorm.{weight,bias}` |
//! | `mlm.decoder.weight` (dense decoder) | `cls.predictions.decoder.weight`ᵀ |
//! | `mlm.decoder.bias` | `cls.predictions.bias` |
//!
//! Biases map alike (`….bias`). A leading `bert.` on every HF name (as in
//! `BertForSequenceClassification` files) is accepted. Only `hidden_act = "gelu"` (exact erf,
//! what comera computes) and absolute position embeddings are accepted.

use crate::{ImportError, Result, SizeLimit};
use comera_model::{Encoder, EncoderConfig, LayerTt, Rank, TtmConfig};
use comera_tensor::factor::balanced_factorisations;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek};
use std::path::Path;

/// The fields of a HF `config.json` comera uses (others are ignored).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HfBertConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f64,
    #[serde(default = "default_init")]
    pub initializer_range: f64,
    #[serde(default = "default_dropout")]
    pub hidden_dropout_prob: f64,
    #[serde(default = "default_pos_type")]
    pub position_embedding_type: String,
    #[serde(default = "default_model_type")]
    pub model_type: String,
}

fn default_act() -> String {
    "gelu".into()
}
fn default_max_pos() -> usize {
    512
}
fn default_type_vocab() -> usize {
    2
}
fn default_eps() -> f64 {
    1e-12
}
fn default_init() -> f64 {
    0.02
}
fn default_dropout() -> f64 {
    0.1
}
fn default_pos_type() -> String {
    "absolute".into()
}
fn default_model_type() -> String {
    "bert".into()
}

impl HfBertConfig {
    /// Parses a `config.json` text; `what` names it in errors.
    pub fn parse(text: &str, what: &str) -> Result<HfBertConfig> {
        serde_json::from_str(text)
            .map_err(|e| ImportError::new(what, format!("not a usable BERT config.json: {e}")))
    }

    /// The dense comera encoder of this shape, `seq_len` positions and a `num_labels` head.
    /// The TT/TTM layouts are filled with [`default_layouts`] (used only when compressing).
    pub fn encoder_config(
        &self,
        what: &str,
        seq_len: usize,
        num_labels: usize,
    ) -> Result<EncoderConfig> {
        if self.hidden_act != "gelu" {
            return Err(ImportError::new(
                format!("{what}: hidden_act"),
                format!(
                    "`{}` is not supported; comera computes the exact erf GELU (`gelu`)",
                    self.hidden_act
                ),
            ));
        }
        if self.position_embedding_type != "absolute" {
            return Err(ImportError::new(
                format!("{what}: position_embedding_type"),
                format!(
                    "`{}` is not supported; expected `absolute`",
                    self.position_embedding_type
                ),
            ));
        }
        // Sizes beyond any real model are refused by name before anything is computed from
        // them (the TT layouts below factorise the widths), with comera's own limits.
        use comera_train::config::{LAYERS, ROWS, SEQ_LEN, WIDTH};
        let u = |v: usize| v as u64;
        for (field, value, bound) in [
            ("vocab_size", u(self.vocab_size), ROWS),
            ("hidden_size", u(self.hidden_size), WIDTH),
            ("num_hidden_layers", u(self.num_hidden_layers), LAYERS),
            ("num_attention_heads", u(self.num_attention_heads), WIDTH),
            ("intermediate_size", u(self.intermediate_size), WIDTH),
            ("type_vocab_size", u(self.type_vocab_size), ROWS),
            ("num_labels (id2label)", u(num_labels), ROWS),
        ] {
            bound
                .check(field, value)
                .map_err(|e| ImportError::new(what, e.to_string()))?;
        }
        let max_positions = SEQ_LEN.limit.min(u(self.max_position_embeddings)) as usize;
        if seq_len == 0 || seq_len > max_positions {
            return Err(ImportError::new(
                format!("{what}: max_position_embeddings"),
                format!(
                    "seq_len {seq_len} must be between 1 and the model's {} positions (at most {})",
                    self.max_position_embeddings, SEQ_LEN.limit
                ),
            ));
        }
        let mut cfg = EncoderConfig {
            vocab_size: self.vocab_size,
            seq_len,
            d_model: self.hidden_size,
            heads: self.num_attention_heads,
            ffn: self.intermediate_size,
            layers: self.num_hidden_layers,
            num_labels,
            type_vocab: self.type_vocab_size,
            dropout: self.hidden_dropout_prob as f32,
            pre_ln: false,
            ln_eps: self.layer_norm_eps as f32,
            init_std: self.initializer_range as f32,
            tt_linear: false,
            ttm_embedding: false,
            ..EncoderConfig::default()
        };
        // Dense, the config's checks need no TT layouts: check it, and its memory, first.
        let lay = cfg.validate().map_err(|e| self.refuse(what, e))?;
        check_import_fits(&cfg, &lay, what)?;
        set_default_layouts(&mut cfg, 8);
        cfg.validate().map_err(|e| self.refuse(what, e))?;
        Ok(cfg)
    }

    /// A comera config error as one of this `config.json`'s fields (`what` names the file).
    fn refuse(&self, what: &str, e: comera_model::ConfigError) -> ImportError {
        let field = match e.field.as_str() {
            "model.vocab_size" => "vocab_size",
            "model.seq_len" => "max_position_embeddings",
            "model.d_model" => "hidden_size",
            "model.heads" => "num_attention_heads",
            "model.ffn" => "intermediate_size",
            "model.layers" => "num_hidden_layers",
            "model.num_labels" => "id2label",
            "model.type_vocab" => "type_vocab_size",
            "model.dropout" => "hidden_dropout_prob",
            "model.ln_eps" => "layer_norm_eps",
            "model.init_std" => "initializer_range",
            _ => return ImportError::new(what, format!("config gives no valid encoder: {e}")),
        };
        ImportError::new(format!("{what}: {field}"), e.msg)
    }

    /// The HF config describing a comera encoder's shape (for the dense export).
    pub fn from_encoder(cfg: &EncoderConfig) -> HfBertConfig {
        HfBertConfig {
            vocab_size: cfg.vocab_size,
            hidden_size: cfg.d_model,
            num_hidden_layers: cfg.layers,
            num_attention_heads: cfg.heads,
            intermediate_size: cfg.ffn,
            hidden_act: default_act(),
            max_position_embeddings: cfg.seq_len,
            type_vocab_size: cfg.type_vocab,
            layer_norm_eps: cfg.ln_eps as f64,
            initializer_range: cfg.init_std as f64,
            hidden_dropout_prob: cfg.dropout as f64,
            position_embedding_type: default_pos_type(),
            model_type: default_model_type(),
        }
    }
}

/// Refuses to import a model of shape `cfg` (validated, dense: `lay`) when the machine lacks
/// the memory: the import holds the file's bytes, its parsed tensors and the model's values
/// and gradients (four copies of the weights) and runs a batch on sample sentences.
pub fn check_import_fits(
    cfg: &EncoderConfig,
    lay: &comera_model::config::Layouts,
    what: &str,
) -> Result<()> {
    let mut estimate = cfg.estimate_inference_memory(lay, 8, cfg.seq_len, 4);
    estimate.params_fields = "hidden_size, intermediate_size, num_hidden_layers or vocab_size";
    estimate.state_fields = "--seq-len, num_hidden_layers or hidden_size";
    estimate
        .check(
            comera_train::trainer::available_memory_bytes(),
            "importing this model",
        )
        .map_err(|e| ImportError::new(what, e.to_string()))
}

/// Balanced 3-factor TT layouts for the encoder's linear layers (inputs largest factor first,
/// outputs reversed, as the paper's 12·8·8 → 8·8·12) and a 4-core TTM layout for the word
/// table (the paper's vocab modes 16·20·10·10 when they hold V, else four near-equal factors),
/// all at `rank`. For MiniLM: 384 = 8·8·6, 1536 = 16·12·8, dim 384 = 4·4·4·6.
pub fn set_default_layouts(cfg: &mut EncoderConfig, rank: usize) {
    let modes = |n: usize, parts: usize| {
        balanced_factorisations(n, parts, 1)
            .pop()
            .unwrap_or_else(|| vec![n])
    };
    let fwd = |n: usize| modes(n, 3);
    let rev = |n: usize| {
        let mut m = modes(n, 3);
        m.reverse();
        m
    };
    let (d, f) = (cfg.d_model, cfg.ffn);
    cfg.attn_tt = LayerTt::uniform(&fwd(d), &rev(d), rank);
    cfg.ffn_up_tt = LayerTt::uniform(&fwd(d), &rev(f), rank);
    cfg.ffn_down_tt = LayerTt::uniform(&fwd(f), &rev(d), rank);
    let paper = [16usize, 20, 10, 10];
    let v = cfg.vocab_size;
    let vocab_modes = if v <= paper.iter().product() {
        paper.to_vec()
    } else {
        near_equal_cover(v, 4)
    };
    cfg.word_ttm = TtmConfig {
        vocab_modes,
        dim_modes: {
            let mut m = modes(d, 4);
            m.reverse();
            m
        },
        rank: Rank::Uniform(rank),
    };
}

/// `parts` factors as equal as possible whose product is at least `v`.
fn near_equal_cover(v: usize, parts: usize) -> Vec<usize> {
    let b = (v as f64).powf(1.0 / parts as f64).ceil() as usize;
    let mut m = vec![b.max(1); parts];
    // Shrink factors from the last while the product still covers v.
    for k in (0..parts).rev() {
        while m[k] > 1 {
            m[k] -= 1;
            if m.iter().product::<usize>() < v {
                m[k] += 1;
                break;
            }
        }
    }
    m
}

/// One F32 tensor read from a file.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// The tensors of a checkpoint (F32 only; others are remembered by dtype for error messages),
/// with its metadata and, when it came with one, the `config.json` text.
#[derive(Clone, Debug)]
pub struct BertWeights {
    /// The file (and member) read, for messages.
    pub source: String,
    pub metadata: HashMap<String, String>,
    pub config_json: Option<String>,
    tensors: BTreeMap<String, Tensor>,
    other_dtypes: BTreeMap<String, String>,
}

impl BertWeights {
    /// Reads a `.zip` (members `model.safetensors` and, if present, `config.json`) or a
    /// safetensors file (with `config.json` beside it, if present).
    pub fn open(path: &Path) -> Result<BertWeights> {
        let shown = path.display().to_string();
        let mut file = comera_data::open_regular(path)
            .map_err(|e| ImportError::new(&shown, format!("cannot read: {e}")))?;
        let mut magic = [0u8; 4];
        let is_zip = file.read_exact(&mut magic).is_ok() && &magic == b"PK\x03\x04";
        file.rewind()
            .map_err(|e| ImportError::new(&shown, format!("cannot read: {e}")))?;
        if is_zip {
            let mut zip = zip::ZipArchive::new(file)
                .map_err(|e| ImportError::new(&shown, format!("not a readable zip: {e}")))?;
            let config = crate::zip_member(&mut zip, &shown, "config.json", &SizeLimit::text())?
                .map(|c| {
                    String::from_utf8(c).map_err(|_| {
                        ImportError::new(format!("{shown}: config.json"), "not UTF-8 text")
                    })
                })
                .transpose()?;
            let st =
                crate::zip_member(&mut zip, &shown, "model.safetensors", &SizeLimit::weights())?
                    .ok_or_else(|| {
                        ImportError::new(&shown, "the zip has no member `model.safetensors`")
                    })?;
            let mut w = BertWeights::from_bytes(&st, &format!("{shown}: model.safetensors"))?;
            w.config_json = config;
            Ok(w)
        } else {
            drop(file);
            let bytes = crate::read_file_limited(path, &SizeLimit::weights())?;
            let mut w = BertWeights::from_bytes(&bytes, &shown)?;
            let sibling = path.with_file_name("config.json");
            if sibling.is_file() {
                let text = crate::read_file_limited(&sibling, &SizeLimit::text())?;
                w.config_json = Some(String::from_utf8(text).map_err(|_| {
                    ImportError::new(sibling.display().to_string(), "not UTF-8 text")
                })?);
            }
            Ok(w)
        }
    }

    /// Parses safetensors bytes; `source` names them in errors.
    pub fn from_bytes(bytes: &[u8], source: &str) -> Result<BertWeights> {
        let bad = |e: safetensors::SafeTensorError| {
            ImportError::new(source, format!("not a valid safetensors file: {e}"))
        };
        let (_, meta) = SafeTensors::read_metadata(bytes).map_err(bad)?;
        let st = SafeTensors::deserialize(bytes).map_err(bad)?;
        let mut tensors = BTreeMap::new();
        let mut other_dtypes = BTreeMap::new();
        for (name, view) in st.iter() {
            let name = name.strip_prefix("bert.").unwrap_or(name).to_string();
            if view.dtype() == Dtype::F32 {
                let data = view
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                tensors.insert(
                    name,
                    Tensor {
                        shape: view.shape().to_vec(),
                        data,
                    },
                );
            } else {
                other_dtypes.insert(name, format!("{:?}", view.dtype()));
            }
        }
        Ok(BertWeights {
            source: source.to_string(),
            metadata: meta.metadata().clone().unwrap_or_default(),
            config_json: None,
            tensors,
            other_dtypes,
        })
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    /// Names of the F32 tensors.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The tensor `name`, or an error naming it (missing, or not F32).
    pub fn require(&self, name: &str) -> Result<&Tensor> {
        self.tensors.get(name).ok_or_else(|| {
            let what = format!("{}: tensor `{name}`", self.source);
            match self.other_dtypes.get(name) {
                Some(dt) => ImportError::new(what, format!("is {dt}, expected F32")),
                None => ImportError::new(what, "is missing"),
            }
        })
    }

    /// The encoder config the file describes: the exact comera config from a comera export's
    /// metadata (`comera_config`), else the HF `config.json` (from the zip, the metadata key
    /// `hf_config`, or beside the file). `seq_len` and `num_labels` override the file's (HF
    /// defaults: min(128, positions) and 2).
    pub fn encoder_config(
        &self,
        seq_len: Option<usize>,
        num_labels: Option<usize>,
    ) -> Result<EncoderConfig> {
        let cfg = if let Some(text) = self.metadata.get("comera_config") {
            let what = format!("{}: metadata `comera_config`", self.source);
            let mut cfg: EncoderConfig = serde_json::from_str(text)
                .map_err(|e| ImportError::new(&what, format!("not a comera config: {e}")))?;
            cfg.tt_linear = false;
            cfg.ttm_embedding = false;
            if let Some(t) = seq_len {
                cfg.seq_len = t;
            }
            if let Some(n) = num_labels {
                cfg.num_labels = n;
            }
            let lay = cfg
                .validate()
                .map_err(|e| ImportError::new(&what, format!("config: {e}")))?;
            check_import_fits(&cfg, &lay, &what)?;
            cfg
        } else {
            let (text, what) = match (self.metadata.get("hf_config"), &self.config_json) {
                (Some(t), _) => (t, format!("{}: metadata `hf_config`", self.source)),
                (None, Some(t)) => (t, format!("{}: config.json", self.source)),
                (None, None) => {
                    return Err(ImportError::new(
                        &self.source,
                        "no model config: expected config.json in the zip or beside the file, \
                         or `comera_config`/`hf_config` in the safetensors metadata",
                    ))
                }
            };
            let hf = HfBertConfig::parse(text, &what)?;
            let t = seq_len.unwrap_or(hf.max_position_embeddings.min(128));
            hf.encoder_config(&what, t, num_labels.unwrap_or(2))?
        };
        let rows = self
            .get("embeddings.position_embeddings.weight")
            .map(|t| t.shape.first().copied().unwrap_or(0));
        if let Some(rows) = rows {
            if cfg.seq_len > rows {
                return Err(ImportError::new(
                    format!(
                        "{}: tensor `embeddings.position_embeddings.weight`",
                        self.source
                    ),
                    format!(
                        "has {rows} positions, seq_len {} asks for more",
                        cfg.seq_len
                    ),
                ));
            }
        }
        cfg.validate()
            .map_err(|e| ImportError::new(&self.source, format!("config: {e}")))?;
        Ok(cfg)
    }
}

/// How a comera parameter is stored in a HF file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfName {
    pub name: String,
    /// A linear weight: the HF tensor is the transpose (out, in).
    pub transpose: bool,
    /// The position table: the comera table is the first `seq_len` rows.
    pub leading_rows: bool,
    /// Absent from plain BERT checkpoints (the classification head): keep the initial value.
    pub optional: bool,
}

/// The HF name of a dense comera parameter (`None` for TT cores and gates).
pub fn hf_name(comera: &str) -> Option<HfName> {
    let plain = |name: &str, transpose: bool| HfName {
        name: name.to_string(),
        transpose,
        leading_rows: false,
        optional: false,
    };
    let fixed = match comera {
        "embeddings.word.weight" => Some(plain("embeddings.word_embeddings.weight", false)),
        "embeddings.position.weight" => Some(HfName {
            leading_rows: true,
            ..plain("embeddings.position_embeddings.weight", false)
        }),
        "embeddings.token_type.weight" => {
            Some(plain("embeddings.token_type_embeddings.weight", false))
        }
        "embeddings.ln.gamma" => Some(plain("embeddings.LayerNorm.weight", false)),
        "embeddings.ln.beta" => Some(plain("embeddings.LayerNorm.bias", false)),
        "pooler.weight" => Some(plain("pooler.dense.weight", true)),
        "pooler.bias" => Some(plain("pooler.dense.bias", false)),
        "classifier.weight" => Some(HfName {
            optional: true,
            ..plain("classifier.weight", true)
        }),
        "classifier.bias" => Some(HfName {
            optional: true,
            ..plain("classifier.bias", false)
        }),
        "encoder.ln_final.gamma" => Some(plain("encoder.final_layer_norm.weight", false)),
        "encoder.ln_final.beta" => Some(plain("encoder.final_layer_norm.bias", false)),
        "mlm.transform.weight" => Some(plain("cls.predictions.transform.dense.weight", true)),
        "mlm.transform.bias" => Some(plain("cls.predictions.transform.dense.bias", false)),
        "mlm.ln.gamma" => Some(plain("cls.predictions.transform.LayerNorm.weight", false)),
        "mlm.ln.beta" => Some(plain("cls.predictions.transform.LayerNorm.bias", false)),
        "mlm.decoder.weight" => Some(plain("cls.predictions.decoder.weight", true)),
        "mlm.decoder.bias" => Some(plain("cls.predictions.bias", false)),
        _ => None,
    };
    if fixed.is_some() {
        return fixed;
    }
    let rest = comera.strip_prefix("encoder.")?;
    let (l, rest) = rest.split_once('.')?;
    let l: usize = l.parse().ok()?;
    let (layer, leaf) = rest.rsplit_once('.')?;
    let hf_layer = match layer {
        "attn.q" => "attention.self.query",
        "attn.k" => "attention.self.key",
        "attn.v" => "attention.self.value",
        "attn.o" => "attention.output.dense",
        "ffn.up" => "intermediate.dense",
        "ffn.down" => "output.dense",
        "ln1" => "attention.output.LayerNorm",
        "ln2" => "output.LayerNorm",
        _ => return None,
    };
    let is_ln = layer.starts_with("ln");
    let (hf_leaf, transpose) = match (leaf, is_ln) {
        ("weight", false) => ("weight", true),
        ("bias", false) => ("bias", false),
        ("gamma", true) => ("weight", false),
        ("beta", true) => ("bias", false),
        _ => return None,
    };
    Some(plain(
        &format!("encoder.layer.{l}.{hf_layer}.{hf_leaf}"),
        transpose,
    ))
}

/// What a dense import did besides filling every mapped parameter.
#[derive(Clone, Debug, Default)]
pub struct ImportInfo {
    /// Parameters absent from the file, left at their seeded initialisation (the classifier).
    pub kept_init: Vec<String>,
    /// F32 tensors of the file no parameter used.
    pub unused: Vec<String>,
}

/// A dense encoder of shape `cfg` (its TT/TTM flags are ignored: every layer is dense) with
/// every parameter read from `w`, checked by name and shape. Parameters the file lacks and that
/// are optional (the classification head) keep their initialisation from `seed`.
pub fn import_dense(
    w: &BertWeights,
    cfg: &EncoderConfig,
    seed: u64,
) -> Result<(Encoder, ImportInfo)> {
    let mut cfg = cfg.clone();
    cfg.tt_linear = false;
    cfg.ttm_embedding = false;
    let mut enc = Encoder::new(&cfg, seed)
        .map_err(|e| ImportError::new(&w.source, format!("config: {e}")))?;
    let mut info = ImportInfo::default();
    let mut used = std::collections::BTreeSet::new();
    let mut err: Option<ImportError> = None;
    enc.visit_params_mut(&mut |p| {
        if err.is_some() {
            return;
        }
        let Some(h) = hf_name(&p.name) else {
            err = Some(ImportError::new(
                &p.name,
                "comera parameter with no Hugging Face name",
            ));
            return;
        };
        let Some(t) = w.get(&h.name) else {
            if h.optional {
                info.kept_init.push(p.name.clone());
            } else {
                err = w.require(&h.name).err();
            }
            return;
        };
        used.insert(h.name.clone());
        if let Err(e) = fill(p, t, &h, &w.source) {
            err = Some(e);
        }
    });
    if let Some(e) = err {
        return Err(e);
    }
    info.unused = w
        .names()
        .filter(|n| !used.contains(*n))
        .map(str::to_string)
        .collect();
    Ok((enc, info))
}

/// Copies `t` (HF layout) into comera parameter `p`, checking the shape.
fn fill(p: &mut comera_layers::Param, t: &Tensor, h: &HfName, source: &str) -> Result<()> {
    let want: Vec<usize> = if h.transpose {
        p.shape.iter().rev().copied().collect()
    } else {
        p.shape.clone()
    };
    let ok = if h.leading_rows {
        t.shape.len() == 2 && t.shape[1] == want[1] && t.shape[0] >= want[0]
    } else {
        t.shape == want
    };
    if !ok {
        let expected = if h.leading_rows {
            format!("[≥{}, {}]", want[0], want[1])
        } else {
            format!("{want:?}")
        };
        return Err(ImportError::new(
            format!("{source}: tensor `{}`", h.name),
            format!(
                "has shape {:?}, expected {expected} (for comera `{}`)",
                t.shape, p.name
            ),
        ));
    }
    if h.transpose {
        let (n, m) = (p.shape[0], p.shape[1]); // comera (in, out); HF (out, in) = (m, n)
        for i in 0..n {
            for j in 0..m {
                p.value[i * m + j] = t.data[j * n + i];
            }
        }
    } else {
        let len = p.value.len();
        p.value.copy_from_slice(&t.data[..len]);
    }
    if let Some(i) = p.value.iter().position(|v| !v.is_finite()) {
        return Err(ImportError::new(
            format!("{source}: tensor `{}`", h.name),
            format!(
                "has a non-finite value (element {i} of comera `{}`)",
                p.name
            ),
        ));
    }
    Ok(())
}

/// Opens a BERT checkpoint ([`BertWeights::open`]) and imports it densely with its config
/// ([`BertWeights::encoder_config`]).
pub fn load_bert(
    path: &Path,
    seq_len: Option<usize>,
    num_labels: Option<usize>,
    seed: u64,
) -> Result<(Encoder, ImportInfo)> {
    let w = BertWeights::open(path)?;
    let cfg = w.encoder_config(seq_len, num_labels)?;
    import_dense(&w, &cfg, seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways() {
        let h = hf_name("encoder.3.attn.q.weight").unwrap();
        assert_eq!(h.name, "encoder.layer.3.attention.self.query.weight");
        assert!(h.transpose);
        let h = hf_name("encoder.0.ln2.gamma").unwrap();
        assert_eq!(h.name, "encoder.layer.0.output.LayerNorm.weight");
        assert!(!h.transpose);
        assert_eq!(
            hf_name("encoder.5.ffn.down.bias").unwrap().name,
            "encoder.layer.5.output.dense.bias"
        );
        assert!(hf_name("encoder.0.attn.q.core.1").is_none());
        assert!(hf_name("embeddings.word.core.2").is_none());
        // Every parameter of a dense encoder has a distinct HF name.
        let cfg = EncoderConfig {
            tt_linear: false,
            ttm_embedding: false,
            vocab_size: 50,
            seq_len: 8,
            d_model: 16,
            heads: 2,
            ffn: 32,
            layers: 2,
            ..EncoderConfig::default()
        };
        let enc = Encoder::new(&cfg, 1).unwrap();
        let names: std::collections::BTreeSet<String> = enc
            .params()
            .iter()
            .map(|p| hf_name(&p.name).unwrap().name)
            .collect();
        assert_eq!(names.len(), enc.params().len());
    }

    #[test]
    fn default_layouts_for_minilm() {
        let mut cfg = EncoderConfig {
            vocab_size: 30522,
            d_model: 384,
            ffn: 1536,
            ..EncoderConfig::default()
        };
        set_default_layouts(&mut cfg, 16);
        assert_eq!(cfg.attn_tt.in_modes, vec![8, 8, 6]);
        assert_eq!(cfg.attn_tt.out_modes, vec![6, 8, 8]);
        assert_eq!(cfg.ffn_up_tt.out_modes.iter().product::<usize>(), 1536);
        assert_eq!(cfg.word_ttm.vocab_modes, vec![16, 20, 10, 10]);
        assert_eq!(cfg.word_ttm.dim_modes.iter().product::<usize>(), 384);
        cfg.tt_linear = true;
        cfg.ttm_embedding = true;
        cfg.validate().unwrap();
        assert!(near_equal_cover(40000, 4).iter().product::<usize>() >= 40000);
    }

    #[test]
    fn bad_config_is_named() {
        let text = r#"{"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 16, "hidden_act": "gelu_new"}"#;
        let hf = HfBertConfig::parse(text, "x/config.json").unwrap();
        let e = hf.encoder_config("x/config.json", 4, 2).unwrap_err();
        assert!(e.to_string().contains("hidden_act"), "{e}");
        let e = HfBertConfig::parse("{}", "y/config.json").unwrap_err();
        assert!(e.to_string().starts_with("y/config.json"), "{e}");
    }
}
