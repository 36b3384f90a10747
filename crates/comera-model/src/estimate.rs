//! What an encoder will need before it is built: its memory at a batch shape, so that a config
//! that cannot fit is refused before anything is allocated.
//!
//! Memory, in f32 values (× 4 bytes), computed in f64 so that absurd sizes cannot overflow:
//!
//!   training = 4·P                  (values, gradients, AdamW's two moments)
//!            + A(B, T)              (the batch state: activations, workspaces)
//!   P        = Σ layers' parameters (dense: n·m; TT: Σ_k r_{k-1}·n_k·m_k·r_k)
//!   A(B, T) ≈ B·T·(layers·(10·D + F + H·T) + 4·D) + head
//!   head     = B·(4·D + 2·C) + 6·C + 2·min(C, 100)²   (classifier over C labels, with the
//!                                                     evaluation's per-class counts)
//!
//! The activation term counts, per block and token, about ten D-wide buffers (input, q, k, v,
//! context, attention output, residual sums, LayerNorms and their gradients), one F-wide and
//! one T-long row per head: the fused paths (FFN recomputing its hidden layer, blocked
//! attention) keep fewer, the plain dense paths more. Checked against the built state's own
//! count in the tests: within a factor of 2 both ways (the paper's TT model 1.5× above, a
//! small dense one 0.8×).

use crate::config::{EncoderConfig, HeadKind, Layouts, MlmDecoderKind};
use comera_tensor::{TtShape, TtmShape};

/// An estimate of a model's training memory at one batch shape, in bytes, with what drives it.
#[derive(Clone, Debug)]
pub struct MemoryEstimate {
    /// Parameters, gradients and optimiser moments (training), or the parameter values as
    /// many times as they are held (inference).
    pub params_bytes: f64,
    /// The batch state.
    pub state_bytes: f64,
    /// What the parameter term holds, in words.
    pub params_what: &'static str,
    /// The config fields that drive each term (for the error naming them).
    pub params_fields: &'static str,
    pub state_fields: &'static str,
}

impl MemoryEstimate {
    pub fn total(&self) -> f64 {
        self.params_bytes + self.state_bytes
    }

    /// Refuses an estimate above `available` bytes, naming the fields of the larger term.
    pub fn check(&self, available: f64, what: &str) -> Result<(), MemoryError> {
        if self.total() <= available {
            return Ok(());
        }
        let fields = if self.params_bytes >= self.state_bytes {
            self.params_fields
        } else {
            self.state_fields
        };
        Err(MemoryError {
            what: what.to_string(),
            estimate: self.clone(),
            available,
            fields,
        })
    }
}

/// A model that needs more memory than is available (see [`MemoryEstimate::check`]).
#[derive(Clone, Debug, thiserror::Error)]
#[error(
    "{what} needs about {} ({} {}, batch state {}), but {} are available; reduce {fields}",
    bytes_text(.estimate.total()),
    .estimate.params_what,
    bytes_text(.estimate.params_bytes),
    bytes_text(.estimate.state_bytes),
    bytes_text(*.available)
)]
pub struct MemoryError {
    /// What needs the memory ("training at batch 32 × 128 tokens", …).
    pub what: String,
    pub estimate: MemoryEstimate,
    /// Bytes available.
    pub available: f64,
    /// The config fields that drive the larger term.
    pub fields: &'static str,
}

/// A byte count in the largest binary unit it reaches, with one decimal (`12.0 KiB`,
/// `0.9 GiB` is shown as `921.6 MiB`, `4.1 TiB`).
pub fn bytes_text(bytes: f64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut value = bytes;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

fn tt_params(s: &TtShape) -> f64 {
    (0..s.n_cores()).map(|k| s.core_len(k) as f64).sum()
}

fn ttm_params(s: &TtmShape) -> f64 {
    (0..s.n_cores()).map(|k| s.core_len(k) as f64).sum()
}

impl EncoderConfig {
    /// The training memory of this encoder at `batch` sequences of `seq_len` tokens (after
    /// [`EncoderConfig::validate`], whose layouts it takes).
    pub fn estimate_memory(&self, lay: &Layouts, batch: usize, seq_len: usize) -> MemoryEstimate {
        let (d, f, v) = (self.d_model as f64, self.ffn as f64, self.vocab_size as f64);
        let (b, t, h) = (batch as f64, seq_len as f64, self.heads as f64);
        let linear = |s: &Option<TtShape>, n: f64, m: f64| s.as_ref().map_or(n * m, tt_params);
        let block = 4.0 * linear(&lay.attn, d, d)
            + linear(&lay.ffn_up, d, f)
            + linear(&lay.ffn_down, f, d)
            + 9.0 * d
            + f;
        let word = lay.word.as_ref().map_or(v * d, ttm_params);
        let head = match self.head {
            HeadKind::Classifier => {
                linear(&lay.pooler, d, d) + linear(&lay.classifier, d, self.num_labels as f64)
            }
            HeadKind::Mlm => {
                d * d
                    + match self.mlm_decoder() {
                        MlmDecoderKind::Tied | MlmDecoderKind::Auto => v,
                        MlmDecoderKind::Dense => d * v,
                        MlmDecoderKind::Tt => lay.mlm_decoder.as_ref().map_or(d * v, tt_params),
                    }
            }
        };
        let params = self.layers as f64 * block + word + (t + self.type_vocab as f64) * d + head;
        let per_token = self.layers as f64 * (10.0 * d + f + h * t) + 4.0 * d;
        let c = self.num_labels as f64;
        let head_state = match self.head {
            // The pooled rows, the logits and their gradient, and the evaluation's per-class
            // counts (3·c f64, two f32 words each; its confusion matrix is kept only up to 100
            // classes, 2·c² words at most 20,000).
            HeadKind::Classifier => b * (4.0 * d + 2.0 * c) + 6.0 * c + 2.0 * c.min(100.0).powi(2),
            // Logits over the vocabulary on ⌈0.15·T⌉ positions per sequence, and their gradient.
            HeadKind::Mlm => b * (0.15 * t).ceil() * 2.0 * (v + d),
        };
        MemoryEstimate {
            params_bytes: 4.0 * 4.0 * params,
            state_bytes: 4.0 * (b * t * per_token + head_state),
            params_what: "parameters with gradients and optimiser",
            params_fields:
                "model.layers, model.d_model, model.ffn, the TT/TTM ranks or model.vocab_size",
            state_fields:
                "train.batch_size, model.seq_len (or the phase's), model.layers or model.d_model",
        }
    }

    /// The memory of running this encoder without training it, at `batch` sequences of
    /// `seq_len` tokens: its parameter values held `copies` times (loading a model holds the
    /// file's bytes and its parsed tensors besides the model's own values) and the batch state.
    pub fn estimate_inference_memory(
        &self,
        lay: &Layouts,
        batch: usize,
        seq_len: usize,
        copies: usize,
    ) -> MemoryEstimate {
        let training = self.estimate_memory(lay, batch, seq_len);
        MemoryEstimate {
            // Training holds four values a parameter (value, gradient, two moments).
            params_bytes: training.params_bytes / 4.0 * copies as f64,
            params_what: "parameters",
            state_fields: "model.seq_len, model.layers or model.d_model",
            ..training
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{bond_limits, useful_rank};
    use crate::{Encoder, MlmDecoderKind};
    use comera_layers::Trainable;

    /// The estimate is within a factor of 2 of the built model's measured memory
    /// (parameters ×4 for values, gradients and two moments; the state's own count).
    fn close_to_built(cfg: &EncoderConfig, batch: usize) {
        let lay = cfg.validate().unwrap();
        let est = cfg.estimate_memory(&lay, batch, cfg.seq_len);
        let model = Encoder::new(cfg, 0).unwrap();
        let st = match cfg.head {
            HeadKind::Classifier => model.state(batch),
            HeadKind::Mlm => model
                .state_for(
                    batch,
                    cfg.seq_len,
                    (0.15 * cfg.seq_len as f64).ceil() as usize,
                )
                .unwrap(),
        };
        let params = 4.0 * 4.0 * model.num_params() as f64;
        let state = model.bytes(&st).state as f64;
        for (what, e, real) in [
            ("parameters", est.params_bytes, params),
            ("state", est.state_bytes, state),
        ] {
            let ratio = e / real;
            assert!(
                (0.5..=2.0).contains(&ratio),
                "{what}: estimate {e:.3e} vs built {real:.3e} (ratio {ratio:.2}) for {cfg:?}"
            );
        }
    }

    #[test]
    fn the_estimate_matches_the_built_paper_model() {
        let cfg = EncoderConfig {
            num_labels: 2,
            ..EncoderConfig::default()
        };
        close_to_built(&cfg, 2);
    }

    #[test]
    fn the_estimate_matches_built_dense_and_mlm_models() {
        let dense = EncoderConfig {
            vocab_size: 1000,
            seq_len: 64,
            d_model: 128,
            heads: 4,
            ffn: 512,
            layers: 2,
            num_labels: 2,
            tt_linear: false,
            ttm_embedding: false,
            ..EncoderConfig::default()
        };
        close_to_built(&dense, 4);
        let mlm = EncoderConfig {
            head: HeadKind::Mlm,
            mlm_decoder: MlmDecoderKind::Dense,
            ..dense
        };
        close_to_built(&mlm, 4);
    }

    #[test]
    fn absurd_sizes_are_refused_without_overflow() {
        let cfg = EncoderConfig {
            layers: 1_000_000_000,
            ..EncoderConfig::default()
        };
        let lay = cfg.validate().unwrap();
        let e = cfg.estimate_memory(&lay, 32, 128);
        let msg = e.check(24e9, "training").unwrap_err().to_string();
        assert!(msg.contains("model.layers"), "{msg}");
        let e = EncoderConfig::default().estimate_memory(&lay, 32, 100_000_000);
        let msg = e.check(24e9, "training").unwrap_err().to_string();
        assert!(msg.contains("model.seq_len"), "{msg}");
    }

    #[test]
    fn inference_holds_the_values_only_and_sizes_read_in_their_unit() {
        let cfg = EncoderConfig {
            d_model: 1 << 20,
            heads: 1,
            ffn: 1 << 20,
            tt_linear: false,
            ttm_embedding: false,
            ..EncoderConfig::default()
        };
        let lay = cfg.validate().unwrap();
        let train = cfg.estimate_memory(&lay, 1, 8);
        let run = cfg.estimate_inference_memory(&lay, 1, 8, 1);
        assert_eq!(run.params_bytes * 4.0, train.params_bytes);
        let msg = run
            .check(21.3 * (1u64 << 30) as f64, "loading")
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("TiB") && msg.contains("21.3 GiB are available"),
            "{msg}"
        );
        assert_eq!(bytes_text(4.1 * (1u64 << 40) as f64), "4.1 TiB");
        assert_eq!(bytes_text(0.5 * (1u64 << 30) as f64), "512.0 MiB");
        assert_eq!(bytes_text(100.0), "100.0 B");
        assert!(bytes_text(1e30).ends_with(" EiB"));
    }

    #[test]
    fn useful_rank_is_the_largest_bond_limit() {
        assert_eq!(bond_limits(&[12, 8, 8, 8, 8, 12]), [12, 96, 768, 96, 12]);
        // A 32 → 32 layer with modes [4, 8 | 8, 4]: the middle bond can use 32.
        assert_eq!(useful_rank(&[4, 8, 8, 4]), 32);
        assert_eq!(useful_rank(&[2, 2]), 2);
        assert_eq!(useful_rank(&[7]), 1);
    }
}
