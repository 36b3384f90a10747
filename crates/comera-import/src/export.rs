//! Exports: dense (HF BERT layout) and compressed (comera's own parameters), and reading the
//! compressed one back.
//!
//! - Dense export: every TT layer reconstructed (`W = G_1 D_1 ⋯ G_K`, gates thresholded), the
//!   TTM table expanded, all weights under the HF names of [`crate::bert`] (linear weights
//!   (out, in)), position table of `seq_len` rows. Metadata: `format = pt`,
//!   `comera_format = bert-dense`, `comera_version = 1`, `comera_config` (the dense
//!   [`EncoderConfig`] as JSON) and `hf_config` (a BERT `config.json`). [`crate::load_bert`]
//!   reads it back.
//! - Compressed export: every parameter by its comera name and shape — TT cores, rank gates,
//!   biases, LayerNorms, the other embeddings, pooler and classifier; nothing reconstructed.
//!   Metadata: `comera_format = compressed`, `comera_version = 1`, `config` (the
//!   [`EncoderConfig`] as JSON), `params`, `dense_equivalent_params`. Core shapes carry the
//!   ranks, so layers of any (also non-uniform) ranks load back with [`load_compressed`]. With
//!   uniform ranks the tensors are exactly a run's `model.safetensors`.

use crate::bert::{hf_name, HfBertConfig};
use crate::{ImportError, Result};
use comera_layers::{
    Embedding, Layer, Linear, Param, ParamKind, RankGates, TtLinear, TtmEmbedding,
};
use comera_model::{
    AnyEmbedding, AnyLinear, Encoder, EncoderConfig, Head, HeadKind, MlmDecoder, MlmDecoderKind,
    MlmHead,
};
use comera_tensor::{TtShape, TtmShape};
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;

/// Version written into (and required from) both export formats.
pub const EXPORT_VERSION: &str = "1";

/// A copy of `enc` with every TT linear layer and the TTM table replaced by their dense
/// reconstructions (same names: `….weight` (in, out), `….bias`; `embeddings.word.weight`).
pub fn densify(enc: &Encoder) -> Encoder {
    let mut out = enc.clone();
    let heads = match &mut out.head {
        Head::Classifier(h) => vec![&mut h.pool, &mut h.classifier],
        Head::Mlm(_) => Vec::new(), // the TT output projection is cut to V columns below
    };
    let blocks = out.blocks.iter_mut().flat_map(|blk| {
        [
            &mut blk.q,
            &mut blk.k,
            &mut blk.v,
            &mut blk.o,
            &mut blk.up,
            &mut blk.down,
        ]
    });
    for lin in blocks.chain(heads) {
        if let AnyLinear::Tt(t) = lin {
            let prefix = t
                .bias
                .name
                .strip_suffix(".bias")
                .unwrap_or(&t.bias.name)
                .to_string();
            let (n, m) = (t.shape().in_features(), t.shape().out_features());
            let weight = Param::new(
                format!("{prefix}.weight"),
                &[n, m],
                ParamKind::Other,
                t.dense_weight(),
            );
            let mut bias = t.bias.clone();
            bias.grad.fill(0.0);
            *lin = AnyLinear::Dense(Linear { weight, bias });
        }
    }
    if let AnyEmbedding::Ttm(e) = &out.word {
        let (v, d) = (e.shape().num_embeddings(), e.shape().dim());
        out.word = AnyEmbedding::Dense(Embedding {
            table: Param::new(
                "embeddings.word.weight",
                &[v, d],
                ParamKind::Other,
                e.dense_table(),
            ),
        });
    }
    // A TT output projection D → V' becomes a dense D × V one: the V' − V padding columns
    // only ever give −∞ logits (masked out of the softmax), so cutting them changes nothing.
    if let Head::Mlm(h) = &out.head {
        if let MlmDecoder::Own(AnyLinear::Tt(t)) = &h.decoder {
            let (d, wide, v) = (t.in_features(), t.out_features(), out.cfg.vocab_size);
            let full = t.dense_weight(); // D × V'
            let weight: Vec<f32> = full
                .chunks_exact(wide)
                .flat_map(|row| row[..v].iter().copied())
                .collect();
            let lin = Linear {
                weight: Param::new("mlm.decoder.weight", &[d, v], ParamKind::Other, weight),
                bias: Param::new(
                    "mlm.decoder.bias",
                    &[v],
                    ParamKind::Other,
                    t.bias.value[..v].to_vec(),
                ),
            };
            let mut rng = comera_tensor::init::rng(0);
            let mut head =
                MlmHead::new(d, v, out.cfg.ln_eps, Some(AnyLinear::Dense(lin)), &mut rng);
            head.transform = h.transform.clone();
            head.ln = h.ln.clone();
            out.head = Head::Mlm(head);
            out.cfg.mlm_decoder = MlmDecoderKind::Dense;
        }
    }
    // `auto` would now resolve to `tied`: name the decoder the head has.
    if out.cfg.head == HeadKind::Mlm && out.cfg.mlm_decoder == MlmDecoderKind::Auto {
        out.cfg.mlm_decoder = match &out.head {
            Head::Mlm(MlmHead {
                decoder: MlmDecoder::Tied { .. },
                ..
            }) => MlmDecoderKind::Tied,
            _ => MlmDecoderKind::Dense,
        };
    }
    out.cfg.make_dense();
    out
}

/// A tensor to write: name, shape, little-endian F32 bytes.
pub(crate) type NamedTensor = (String, Vec<usize>, Vec<u8>);

/// Safetensors bytes with tensors sorted by name and the metadata keys sorted, so the same
/// model always gives the same file (the `safetensors` crate takes the metadata as a `HashMap`
/// and writes it in hash order). Header padded with spaces to a multiple of 8 bytes.
pub(crate) fn serialize(
    tensors: &[NamedTensor],
    meta: BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let typed: Vec<(String, &str, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, b)| (n.clone(), "F32", s.clone(), b.clone()))
        .collect();
    serialize_typed(&typed, meta)
}

/// [`serialize`] with a dtype per tensor (`F32` or `I64`).
pub(crate) fn serialize_typed(
    tensors: &[(String, &str, Vec<usize>, Vec<u8>)],
    meta: BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| tensors[a].0.cmp(&tensors[b].0));
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".to_string(), serde_json::json!(meta));
    let mut offset = 0usize;
    for &i in &order {
        let (name, dtype, shape, bytes) = &tensors[i];
        let size = if *dtype == "I64" { 8 } else { 4 };
        if bytes.len() != size * shape.iter().product::<usize>() {
            return Err(ImportError::new(
                name,
                format!("{} bytes for shape {shape:?}", bytes.len()),
            ));
        }
        header.insert(
            name.clone(),
            serde_json::json!({
                "dtype": dtype,
                "shape": shape,
                "data_offsets": [offset, offset + bytes.len()],
            }),
        );
        offset += bytes.len();
    }
    // serde_json keeps keys sorted (or, with `preserve_order`, in the sorted insertion order).
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header))
        .map_err(|e| ImportError::new("export", format!("header as JSON: {e}")))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + offset);
    out.extend((h.len() as u64).to_le_bytes());
    out.extend(h);
    for &i in &order {
        out.extend(&tensors[i].3);
    }
    Ok(out)
}

pub(crate) fn le_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn config_json(cfg: &EncoderConfig) -> Result<String> {
    serde_json::to_string(cfg)
        .map_err(|e| ImportError::new("export", format!("config as JSON: {e}")))
}

/// The parameters of `enc` under their Hugging Face BERT names (without the `bert.` prefix)
/// and layouts, TT/TTM layers reconstructed ([`densify`]): (name, shape, little-endian F32).
pub(crate) fn hf_tensors(dense: &Encoder) -> Result<Vec<NamedTensor>> {
    let mut tensors = Vec::new();
    for p in dense.params() {
        let h = hf_name(&p.name)
            .ok_or_else(|| ImportError::new(&p.name, "parameter has no Hugging Face name"))?;
        if h.transpose {
            let (n, m) = (p.shape[0], p.shape[1]);
            let mut t = vec![0.0f32; n * m];
            for i in 0..n {
                for j in 0..m {
                    t[j * n + i] = p.value[i * m + j];
                }
            }
            tensors.push((h.name, vec![m, n], le_bytes(&t)));
        } else {
            tensors.push((h.name, p.shape.clone(), le_bytes(&p.value)));
        }
    }
    Ok(tensors)
}

/// The dense export of `enc` as safetensors bytes (see the module docs).
pub fn export_dense(enc: &Encoder) -> Result<Vec<u8>> {
    let dense = densify(enc);
    let tensors = hf_tensors(&dense)?;
    let hf = serde_json::to_string(&HfBertConfig::from_encoder(&dense.cfg))
        .map_err(|e| ImportError::new("export", format!("config as JSON: {e}")))?;
    let meta = BTreeMap::from([
        ("format".to_string(), "pt".to_string()),
        ("comera_format".to_string(), "bert-dense".to_string()),
        ("comera_version".to_string(), EXPORT_VERSION.to_string()),
        ("comera_config".to_string(), config_json(&dense.cfg)?),
        ("hf_config".to_string(), hf),
    ]);
    serialize(&tensors, meta)
}

/// The compressed export of `enc` as safetensors bytes (see the module docs).
pub fn export_compressed(enc: &Encoder) -> Result<Vec<u8>> {
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = enc
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.shape.clone(), le_bytes(&p.value)))
        .collect();
    let meta = BTreeMap::from([
        ("comera_format".to_string(), "compressed".to_string()),
        ("comera_version".to_string(), EXPORT_VERSION.to_string()),
        ("config".to_string(), config_json(&enc.cfg)?),
        ("params".to_string(), enc.num_params().to_string()),
        (
            "dense_equivalent_params".to_string(),
            enc.dense_equivalent_params().to_string(),
        ),
    ]);
    serialize(&tensors, meta)
}

/// Reads a compressed export; `source` names it in errors. Every tensor is checked by name,
/// dtype and shape; TT/TTM ranks come from the core shapes.
pub fn load_compressed(bytes: &[u8], source: &str) -> Result<Encoder> {
    let bad = |e: safetensors::SafeTensorError| {
        ImportError::new(source, format!("not a valid safetensors file: {e}"))
    };
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(bad)?;
    let st = SafeTensors::deserialize(bytes).map_err(bad)?;
    let meta = meta.metadata().clone().unwrap_or_default();
    let field = |k: &str| {
        meta.get(k).ok_or_else(|| {
            ImportError::new(
                source,
                format!("metadata has no `{k}`; not a comera compressed export"),
            )
        })
    };
    let format = field("comera_format")?;
    if format != "compressed" {
        return Err(ImportError::new(
            format!("{source}: metadata `comera_format`"),
            format!("is `{format}`, expected `compressed`"),
        ));
    }
    let version = field("comera_version")?;
    if version != EXPORT_VERSION {
        return Err(ImportError::new(
            format!("{source}: metadata `comera_version`"),
            format!("is `{version}`, this build reads version {EXPORT_VERSION}"),
        ));
    }
    let cfg: EncoderConfig = serde_json::from_str(field("config")?)
        .map_err(|e| ImportError::new(format!("{source}: metadata `config`"), format!("{e}")))?;
    let mut enc = Encoder::new(&cfg, 0)
        .map_err(|e| ImportError::new(format!("{source}: metadata `config`"), e.to_string()))?;
    let read = |name: &str| -> Result<(Vec<usize>, Vec<f32>)> {
        let t = st
            .tensor(name)
            .map_err(|_| ImportError::new(format!("{source}: tensor `{name}`"), "is missing"))?;
        if t.dtype() != Dtype::F32 {
            return Err(ImportError::new(
                format!("{source}: tensor `{name}`"),
                format!("is {:?}, expected F32", t.dtype()),
            ));
        }
        let v: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(ImportError::new(
                format!("{source}: tensor `{name}`"),
                format!("element {i} is not finite"),
            ));
        }
        Ok((t.shape().to_vec(), v))
    };
    let rule = RankGates::new(cfg.threshold);
    // Ranks of a chain from its cores' shapes: [1, r_1, …, 1], each core (r, s…, r').
    let chain =
        |prefix: &str, n_cores: usize, dims: usize| -> Result<(Vec<usize>, Vec<Vec<f32>>)> {
            let mut ranks = vec![1usize];
            let mut cores = Vec::with_capacity(n_cores);
            for k in 1..=n_cores {
                let name = format!("{prefix}.core.{k}");
                let (shape, v) = read(&name)?;
                if shape.len() != dims || shape[0] != *ranks.last().expect("nonempty") {
                    return Err(ImportError::new(
                        format!("{source}: tensor `{name}`"),
                        format!(
                            "has shape {shape:?}; expected {dims} axes starting with rank {}",
                            ranks.last().expect("nonempty")
                        ),
                    ));
                }
                ranks.push(shape[dims - 1]);
                cores.push(v);
            }
            Ok((ranks, cores))
        };
    let gates = |prefix: &str, ranks: &[usize]| -> Result<Vec<Vec<f32>>> {
        (1..ranks.len() - 1)
            .map(|b| read(&format!("{prefix}.gate.{b}")).map(|(_, v)| v))
            .collect()
    };
    let layer_err =
        |name: &str, e: String| ImportError::new(format!("{source}: layer `{name}`"), e);
    for (l, blk) in enc.blocks.iter_mut().enumerate() {
        for (kind, lin) in [
            ("attn.q", &mut blk.q),
            ("attn.k", &mut blk.k),
            ("attn.v", &mut blk.v),
            ("attn.o", &mut blk.o),
            ("ffn.up", &mut blk.up),
            ("ffn.down", &mut blk.down),
        ] {
            if let AnyLinear::Tt(t) = lin {
                let name = format!("encoder.{l}.{kind}");
                let (in_modes, out_modes) = (
                    t.shape().in_modes().to_vec(),
                    t.shape().out_modes().to_vec(),
                );
                let (ranks, cores) = chain(&name, in_modes.len() + out_modes.len(), 3)?;
                let shape = TtShape::new(&in_modes, &out_modes, &ranks)
                    .map_err(|e| layer_err(&name, e.to_string()))?;
                let g = gates(&name, &ranks)?;
                let (_, bias) = read(&format!("{name}.bias"))?;
                *t = TtLinear::from_parts(&name, shape, rule, cores, g, bias)
                    .map_err(|e| layer_err(&name, e.to_string()))?;
            }
        }
    }
    if let AnyEmbedding::Ttm(e) = &mut enc.word {
        let name = "embeddings.word";
        let s = e.shape().clone();
        let (ranks, cores) = chain(name, s.n_cores(), 4)?;
        let shape = TtmShape::new(s.vocab_modes(), s.dim_modes(), &ranks, s.num_embeddings())
            .map_err(|e| layer_err(name, e.to_string()))?;
        let g = gates(name, &ranks)?;
        *e = TtmEmbedding::from_parts(name, shape, rule, cores, g)
            .map_err(|e| layer_err(name, e.to_string()))?;
    }
    let mut err: Option<ImportError> = None;
    enc.visit_params_mut(&mut |p| {
        if err.is_some() {
            return;
        }
        match read(&p.name) {
            Ok((shape, v)) if shape == p.shape => p.value = v,
            Ok((shape, _)) => {
                err = Some(ImportError::new(
                    format!("{source}: tensor `{}`", p.name),
                    format!("has shape {shape:?}, expected {:?}", p.shape),
                ))
            }
            Err(e) => err = Some(e),
        }
    });
    match err {
        Some(e) => Err(e),
        None => Ok(enc),
    }
}

/// The `comera_format` metadata of safetensors bytes (`compressed`, `bert-dense`), if any.
pub fn format_of(bytes: &[u8]) -> Option<String> {
    let (_, meta) = SafeTensors::read_metadata(bytes).ok()?;
    meta.metadata().as_ref()?.get("comera_format").cloned()
}
