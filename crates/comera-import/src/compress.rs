//! TT/TTM layers from dense weights by TT-SVD, with the reconstruction error of every layer.
//!
//! Each encoder linear layer's W (in, out) is decomposed with the modes of the config's
//! `attn_tt` / `ffn_up_tt` / `ffn_down_tt` (input digits, then output digits, SPEC §6), the word
//! table with `word_ttm`'s vocab and dim modes. Gates start at 1, biases are kept, singular
//! values are absorbed as [`comera_tensor::ttsvd::Absorb`] says (balanced by default: every core
//! of a layer has the same Frobenius norm).
//!
//! TT-SVD's own ranks are at most the cap and often lower on the outer bonds (bond 1 of a
//! 384 = 8·8·6 layer has rank ≤ 8). With [`CompressOptions::uniform`] every layer of a kind is
//! zero-padded to one rank (the largest rank TT-SVD chose for that kind, ≤ the cap), so
//! the config's `rank` fields describe the model exactly and it can be rebuilt by
//! `Encoder::new` (model files, checkpoints). The padded slices are zero and stay so: they
//! change nothing, and rank-adaptive training prunes their gates.

use crate::{ImportError, Result};
use comera_layers::{RankGates, TtLinear, TtmEmbedding};
use comera_model::Rank;
use comera_model::{AnyEmbedding, AnyLinear, Encoder};
use comera_tensor::ttsvd::{self, TtDecomposition, TtSvdOptions};
use comera_tensor::{TtShape, TtmShape};
use rayon::prelude::*;

/// What to compress and how.
#[derive(Clone, Copy, Debug)]
pub struct CompressOptions {
    /// TT-SVD of the encoder's linear layers (`None`: leave them as they are).
    pub linear: Option<TtSvdOptions>,
    /// TT-SVD of the word embedding into TTM cores (`None`: leave it as it is).
    pub word: Option<TtSvdOptions>,
    /// Pad each layer kind to one uniform rank (see the module docs).
    pub uniform: bool,
}

impl CompressOptions {
    /// Linear layers and word table at rank cap `r`, TT-SVD's own ranks (not padded).
    pub fn rank(r: usize) -> CompressOptions {
        CompressOptions {
            linear: Some(TtSvdOptions::rank(r)),
            word: Some(TtSvdOptions::rank(r)),
            uniform: false,
        }
    }
}

/// One compressed layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerReport {
    /// Parameter prefix, e.g. `encoder.2.ffn.up` or `embeddings.word`.
    pub name: String,
    /// `attn.q`, `attn.k`, `attn.v`, `attn.o`, `ffn.up`, `ffn.down` or `word`.
    pub kind: String,
    /// The ranks TT-SVD chose, `[1, r_1, …, 1]` (before any padding).
    pub ranks: Vec<usize>,
    /// Core parameters at those ranks.
    pub params: usize,
    /// Core parameters as stored (after padding to the uniform rank).
    pub stored_params: usize,
    /// Entries of the dense weight or table.
    pub dense_params: usize,
    /// ‖W_TT − W‖_F / ‖W‖_F, measured on the built layer's reconstruction.
    pub rel_error: f64,
    /// The same predicted from the discarded singular values.
    pub predicted: f64,
}

const KINDS: [&str; 6] = ["attn.q", "attn.k", "attn.v", "attn.o", "ffn.up", "ffn.down"];

/// A copy of `enc` with the requested layers replaced by TT-SVD layers, and one report per
/// replaced layer (linear layers by block, then the word table). Layers already TT/TTM are
/// re-decomposed from their dense reconstruction.
pub fn compress(enc: &Encoder, opts: &CompressOptions) -> Result<(Encoder, Vec<LayerReport>)> {
    let mut out = enc.clone();
    let mut cfg = enc.cfg.clone();
    let rule = RankGates::new(cfg.threshold);
    let mut reports = Vec::new();
    if let Some(topts) = &opts.linear {
        // (block, kind index, W, bias, in_modes, out_modes), decomposed in parallel.
        let jobs: Vec<(usize, usize, Vec<f32>, Vec<f32>)> = enc
            .blocks
            .iter()
            .enumerate()
            .flat_map(|(l, b)| {
                [&b.q, &b.k, &b.v, &b.o, &b.up, &b.down]
                    .into_iter()
                    .enumerate()
                    .map(move |(k, lin)| {
                        let (w, bias) = dense_parts(lin);
                        (l, k, w, bias)
                    })
            })
            .collect();
        let layout = |k: usize| match k {
            0..=3 => &cfg.attn_tt,
            4 => &cfg.ffn_up_tt,
            _ => &cfg.ffn_down_tt,
        };
        let tts: Vec<Result<TtDecomposition>> = jobs
            .par_iter()
            .map(|(l, k, w, _)| {
                let t = layout(*k);
                ttsvd::tt_matrix_svd(w, &t.in_modes, &t.out_modes, topts).map_err(|e| {
                    ImportError::new(format!("encoder.{l}.{}", KINDS[*k]), e.to_string())
                })
            })
            .collect();
        let tts: Vec<TtDecomposition> = tts.into_iter().collect::<Result<_>>()?;
        // Uniform rank per layout (attention, FFN up, FFN down).
        let group = |k: usize| match k {
            0..=3 => 0,
            4 => 1,
            _ => 2,
        };
        // The largest rank TT-SVD chose in each group (≤ the cap): the uniform rank.
        let mut uni = [1usize; 3];
        for ((_, k, _, _), tt) in jobs.iter().zip(&tts) {
            let g = &mut uni[group(*k)];
            *g = (*g).max(tt.ranks.iter().copied().max().unwrap_or(1));
        }
        let built: Vec<Result<(TtLinear, LayerReport)>> = jobs
            .par_iter()
            .zip(tts.par_iter())
            .map(|((l, k, w, bias), tt)| {
                let name = format!("encoder.{l}.{}", KINDS[*k]);
                let t = layout(*k);
                let target = if opts.uniform {
                    uniform_ranks(tt.ranks.len(), uni[group(*k)])
                } else {
                    tt.ranks.clone()
                };
                let cores = ttsvd::pad_ranks(&tt.cores, &tt.modes, &tt.ranks, &target)
                    .map_err(|e| ImportError::new(&name, e.to_string()))?;
                let shape = TtShape::new(&t.in_modes, &t.out_modes, &target)
                    .map_err(|e| ImportError::new(&name, e.to_string()))?;
                let gates = target[1..target.len() - 1]
                    .iter()
                    .map(|&r| vec![1.0; r])
                    .collect();
                let layer = TtLinear::from_parts(&name, shape, rule, cores, gates, bias.clone())
                    .map_err(|e| ImportError::new(&name, e.to_string()))?;
                let rel_error = ttsvd::rel_error(&layer.dense_weight(), w);
                let report = LayerReport {
                    kind: KINDS[*k].to_string(),
                    params: core_params(&tt.ranks, &tt.modes),
                    stored_params: core_params(&target, &tt.modes),
                    dense_params: w.len(),
                    ranks: tt.ranks.clone(),
                    rel_error,
                    predicted: tt.rel_error,
                    name,
                };
                Ok((layer, report))
            })
            .collect();
        for ((l, k, _, _), b) in jobs.iter().zip(built) {
            let (layer, report) = b?;
            let blk = &mut out.blocks[*l];
            let slot = match k {
                0 => &mut blk.q,
                1 => &mut blk.k,
                2 => &mut blk.v,
                3 => &mut blk.o,
                4 => &mut blk.up,
                _ => &mut blk.down,
            };
            *slot = AnyLinear::Tt(layer);
            reports.push(report);
        }
        cfg.tt_linear = true;
        cfg.attn_tt.rank = Rank::Uniform(uni[0]);
        cfg.ffn_up_tt.rank = Rank::Uniform(uni[1]);
        cfg.ffn_down_tt.rank = Rank::Uniform(uni[2]);
    }
    if let Some(topts) = &opts.word {
        let name = "embeddings.word";
        let table = match &enc.word {
            AnyEmbedding::Dense(e) => e.table.value.clone(),
            AnyEmbedding::Ttm(e) => e.dense_table(),
        };
        let t = &cfg.word_ttm;
        let v = cfg.vocab_size;
        let ttm = ttsvd::ttm_svd(&table, v, &t.vocab_modes, &t.dim_modes, topts)
            .map_err(|e| ImportError::new(name, e.to_string()))?;
        let max = ttm.ranks.iter().copied().max().unwrap_or(1);
        let target = if opts.uniform {
            uniform_ranks(ttm.ranks.len(), max)
        } else {
            ttm.ranks.clone()
        };
        let mode_len: Vec<usize> = t
            .vocab_modes
            .iter()
            .zip(&t.dim_modes)
            .map(|(a, b)| a * b)
            .collect();
        let cores = ttsvd::pad_ranks(&ttm.cores, &mode_len, &ttm.ranks, &target)
            .map_err(|e| ImportError::new(name, e.to_string()))?;
        let shape = TtmShape::new(&t.vocab_modes, &t.dim_modes, &target, v)
            .map_err(|e| ImportError::new(name, e.to_string()))?;
        let gates = target[1..target.len() - 1]
            .iter()
            .map(|&r| vec![1.0; r])
            .collect();
        let layer = TtmEmbedding::from_parts(name, shape, rule, cores, gates)
            .map_err(|e| ImportError::new(name, e.to_string()))?;
        let rel_error = ttsvd::rel_error(&layer.dense_table(), &table);
        reports.push(LayerReport {
            name: name.to_string(),
            kind: "word".to_string(),
            params: core_params(&ttm.ranks, &mode_len),
            stored_params: core_params(&target, &mode_len),
            dense_params: table.len(),
            ranks: ttm.ranks.clone(),
            rel_error,
            predicted: ttm.rel_error,
        });
        out.word = AnyEmbedding::Ttm(layer);
        cfg.ttm_embedding = true;
        cfg.word_ttm.rank = Rank::Uniform(target.iter().copied().max().unwrap_or(1));
    }
    out.cfg = cfg;
    Ok((out, reports))
}

/// The dense weight (in, out) and bias of a linear layer of either kind.
pub(crate) fn dense_parts(lin: &AnyLinear) -> (Vec<f32>, Vec<f32>) {
    match lin {
        AnyLinear::Dense(d) => (d.weight.value.clone(), d.bias.value.clone()),
        AnyLinear::Tt(t) => (t.dense_weight(), t.bias.value.clone()),
    }
}

fn uniform_ranks(len: usize, r: usize) -> Vec<usize> {
    (0..len)
        .map(|i| if i == 0 || i + 1 == len { 1 } else { r })
        .collect()
}

fn core_params(ranks: &[usize], modes: &[usize]) -> usize {
    modes
        .iter()
        .enumerate()
        .map(|(k, s)| ranks[k] * s * ranks[k + 1])
        .sum()
}

/// Mean and max relative error per layer kind, in [`KINDS`] order then `word`.
pub fn summarise(reports: &[LayerReport]) -> Vec<(String, usize, f64, f64)> {
    let mut out = Vec::new();
    for kind in KINDS.iter().copied().chain(["word"]) {
        let errs: Vec<f64> = reports
            .iter()
            .filter(|r| r.kind == kind)
            .map(|r| r.rel_error)
            .collect();
        if errs.is_empty() {
            continue;
        }
        let mean = errs.iter().sum::<f64>() / errs.len() as f64;
        let max = errs.iter().copied().fold(0.0, f64::max);
        out.push((kind.to_string(), errs.len(), mean, max));
    }
    out
}
