//! What a step plan will hold on the device, computed from the host model before anything is
//! allocated, so that a run that cannot fit is refused with the whole figure (and its parts)
//! rather than by the first allocation that fails halfway through the plan.
//!
//! Unlike the CPU's estimate (`EncoderConfig::estimate_memory`, a formula within a factor of
//! two), this one is exact: it counts every buffer [`EncoderPlan::new`] allocates, in the
//! plan's order, with the same size functions the sub-plans allocate with
//! ([`TtLayer::device_bytes`], `Lin`, `Ln`, [`BlockLens`], `MlmPlan`, [`RankPlan`],
//! [`GateTable`]). The plan
//! records what its construction really allocated ([`EncoderPlan::device_bytes`]) and the GPU
//! tests require the two to be equal. Not counted, on either side: the CUDA context, the
//! compiled kernels, cuBLAS's handle and a captured graph's own state (the driver's, already
//! taken from the free memory the check compares with, or small), and the AdamW table
//! (28 bytes a tensor and 12 a tile of 2,048 parameters: 650 KB for 110 M parameters).
//!
//! The parts, in bytes, for a plan of batch B × T (N = B·T rows, width D, FFN width F, H heads,
//! L blocks; a classifier's last block runs past q/k/v on its B [CLS] rows):
//!
//! ```text
//! params      16·P           values, gradients, AdamW's m and v (P: the arena's floats;
//!                            4·P in a plan for inference)
//! activations ≈ 4·N·(L·(8·D + F) + 14·D + 3·F) + 4·L·B·H·T² + 4·B·H·T²
//!                            the blocks' saved buffers, the shared scratch, the head
//! ttm         4·N·(D + Σ_k r_k·e_k·r_{k+1}) + …   a TTM table's rows and slab gradients
//! other       32 MiB + …     the cuBLAS workspace, the batch's index buffers, the loss,
//!                            the norm, the rank schedule's tables
//! ```
//!
//! [`EncoderPlan::new`]: super::EncoderPlan::new
//! [`EncoderPlan::device_bytes`]: super::EncoderPlan::device_bytes

use super::arena::ParamArena;
use super::encoder::{BlockLens, Lin, Ln, StepConfig};
use super::mlm::MlmPlan;
use super::rank::RankPlan;
use super::raw::{Buf, CUBLAS_WORKSPACE};
use super::tt::GateTable;
use crate::device::Device;
use crate::error::CudaError;
use crate::ops::{Segments, TtmLayout};
use comera_layers::any::AnyEmbedding;
use comera_model::mlm_head::MlmDecoder;
use comera_model::{Encoder, Head};

/// The device memory of one step plan, in bytes, by part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanMemory {
    /// Parameters, gradients and AdamW's two moments (the arena, with its padding; the values
    /// alone in a plan for inference, [`StepConfig::forward_only`]).
    pub params: usize,
    /// The blocks' saved activations and layer workspaces, the embeddings' and the head's,
    /// and the step's shared scratch.
    pub activations: usize,
    /// A TTM word table's rows of the batch's ids and their slab gradients (0 for a dense
    /// table).
    pub ttm: usize,
    /// The cuBLAS workspace, the batch's index buffers, the loss and norm outputs, the rank
    /// schedule's tables.
    pub other: usize,
    /// A plan for the evaluation pass only ([`StepConfig::forward_only`]).
    pub forward_only: bool,
}

impl PlanMemory {
    /// What [`super::EncoderPlan::new`]`(dev, enc, seed, b, t, opt)` will allocate.
    pub fn of(
        enc: &Encoder,
        b: usize,
        t: usize,
        opt: &StepConfig,
    ) -> Result<PlanMemory, CudaError> {
        let cfg = &enc.cfg;
        super::EncoderPlan::check_shape(enc, b, t)?;
        let (d, n) = (cfg.d_model, b * t);
        let nd = n * d;
        let f = Buf::<f32>::zeros_bytes;
        let u = Buf::<u32>::zeros_bytes;
        let copied_u = Buf::<u32>::copy_bytes;
        let classifier = matches!(enc.head, Head::Classifier(_));

        let params: Vec<_> = enc
            .params()
            .iter()
            .map(|p| (p.name.clone(), p.shape.clone(), p.kind))
            .collect();
        let (tensors, floats) = ParamArena::layout(&params)?;

        let ttm = match &enc.word {
            AnyEmbedding::Dense(_) => 0,
            AnyEmbedding::Ttm(e) => {
                let s = e.shape();
                let layout = TtmLayout::new(s.vocab_modes(), s.dim_modes(), s.ranks())?;
                let digits: usize = layout.cores.iter().map(|c| u(n) + u(c.shape[1] + 1)).sum();
                let max_core = layout.cores.iter().map(|c| c.len()).max().unwrap_or(0);
                digits
                    + Buf::<i32>::copy_bytes(layout.meta.len())
                    + u(n)
                    + Buf::<i32>::zeros_bytes(1)
                    + f(nd)
                    + f(opt.backward_len(n * layout.slab_total))
                    + f(opt.backward_len(max_core))
            }
        };

        let mut activations = 0;
        let mut last_rows = n;
        let mut gated_cores = 0;
        for (l, blk) in enc.blocks.iter().enumerate() {
            let rows = if l + 1 == cfg.layers && classifier {
                b
            } else {
                n
            };
            let len = BlockLens::of(cfg, b, t, rows);
            activations += [&blk.q, &blk.k, &blk.v]
                .iter()
                .map(|x| Lin::device_bytes(x, n))
                .sum::<usize>()
                + [&blk.o, &blk.up, &blk.down]
                    .iter()
                    .map(|x| Lin::device_bytes(x, rows))
                    .sum::<usize>()
                + Ln::device_bytes(len.ln1_rows, d)
                + Ln::device_bytes(rows, d)
                + len.bytes();
            gated_cores += [&blk.q, &blk.k, &blk.v, &blk.o, &blk.up, &blk.down]
                .iter()
                .map(|x| Lin::gated_core_count(x))
                .sum::<usize>();
            last_rows = rows;
        }
        let (head, head_rows, classes) = match &enc.head {
            Head::Classifier(h) => {
                gated_cores +=
                    Lin::gated_core_count(&h.pool) + Lin::gated_core_count(&h.classifier);
                (
                    Lin::device_bytes(&h.pool, b)
                        + Lin::device_bytes(&h.classifier, b)
                        + 5 * f(b * d),
                    b,
                    cfg.num_labels,
                )
            }
            Head::Mlm(h) => {
                if let MlmDecoder::Own(l) = &h.decoder {
                    gated_cores += Lin::gated_core_count(l);
                }
                let rows = opt.mlm_rows(b, t);
                (MlmPlan::device_bytes(h, d, rows), rows, h.width())
            }
        };
        activations += head
            + Ln::device_bytes(n, d)
            + match cfg.pre_ln {
                true => Ln::device_bytes(last_rows, d) + f(last_rows * d),
                false => f(1),
            }
            // emb, x0, tmp, tq, oh, f: N × D each; g: N × F; the logits. The backward's:
            // dqh, dkh, dvh, dflow, dt1, dt2, dt3, datt: N × D each; dp: B·H·T²; dg, dhh:
            // N × F each; the logits' gradient (none for the forward only).
            + 6 * f(nd)
            + f(n * cfg.ffn)
            + f(head_rows * classes)
            + 8 * f(opt.backward_len(nd))
            + f(opt.backward_len(b * cfg.heads * t * t))
            + 2 * f(opt.backward_len(n * cfg.ffn))
            + f(opt.backward_len(head_rows * classes));

        let positions = Segments::of(&(0..n as u32).map(|i| i % t as u32).collect::<Vec<_>>());
        let other = Buf::<u8>::zeros_bytes(CUBLAS_WORKSPACE)
            + GateTable::device_bytes(gated_cores)
            + match &opt.rank {
                Some(r) => RankPlan::device_bytes(enc, &tensors, r)?,
                None => 0,
            }
            // slot, seg_order, seg_dst, types_ids, type_order (N each), seg_start (N + 1),
            // type_start
            + 5 * u(n)
            + u(n + 1)
            + u(cfg.type_vocab + 1)
            // pos_ids, pos_order, pos_start (fixed)
            + copied_u(n)
            + copied_u(positions.order.len())
            + copied_u(positions.start.len())
            // allow, label, cls_slot, seq_order, seq_start
            + f(n)
            + Buf::<i32>::zeros_bytes(head_rows)
            + 2 * copied_u(b)
            + copied_u(b + 1)
            // ce_count, ce_row_loss, ce_row_hit, ce_out, micro_acc
            + Buf::<i32>::zeros_bytes(1)
            + Buf::<f64>::zeros_bytes(head_rows)
            + f(head_rows)
            + Buf::<f64>::zeros_bytes(4)
            + Buf::<f64>::zeros_bytes(3)
            // norm_partial, norm, clip, scalars, step
            + Buf::<f64>::zeros_bytes(Device::grad_norm_partial_len(floats))
            + Buf::<f64>::zeros_bytes(1)
            + f(1)
            + Buf::<f32>::copy_bytes(3)
            + Buf::<u64>::zeros_bytes(1);

        Ok(PlanMemory {
            params: ParamArena::device_bytes(floats, !opt.forward_only),
            activations,
            ttm,
            other,
            forward_only: opt.forward_only,
        })
    }

    /// Bytes in all.
    pub fn total(&self) -> usize {
        self.params + self.activations + self.ttm + self.other
    }

    /// What the memory is for, with its parts, for an out-of-memory message
    /// ("the training step at batch 32 × 128 tokens (…)").
    pub fn describe(&self, b: usize, t: usize) -> String {
        let mib = |x: usize| format!("{:.1} MiB", x as f64 / (1u64 << 20) as f64);
        let ttm = match self.ttm {
            0 => String::new(),
            x => format!(", the TTM table's rows and slab gradients {}", mib(x)),
        };
        let (pass, params) = match self.forward_only {
            true => ("the evaluation pass", "parameters"),
            false => (
                "the training step",
                "parameters with gradients and AdamW moments",
            ),
        };
        format!(
            "{pass} at batch {b} × {t} tokens ({params} {}, activations and scratch {}{ttm}, the \
             cuBLAS workspace and tables {})",
            mib(self.params),
            mib(self.activations),
            mib(self.other),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use comera_model::EncoderConfig;

    fn paper(batch: usize) -> PlanMemory {
        let cfg = EncoderConfig {
            num_labels: 5,
            ..EncoderConfig::default()
        };
        let enc = Encoder::new(&cfg, 0).unwrap();
        PlanMemory::of(&enc, batch, cfg.seq_len, &StepConfig::paper()).unwrap()
    }

    /// The paper model at batch 32, part by part, against figures worked out by hand from the
    /// plan's buffers (module doc): N = 4,096 rows, D = 768, F = 3,072, 12 heads, T = 128.
    #[test]
    fn the_paper_model_at_batch_32_adds_up() {
        let m = paper(32);
        let (n, d, f, ht2) = (4096usize, 768usize, 3072usize, 32 * 12 * 128 * 128usize);
        // Five full blocks (q/k/v, P, att, r1, x1, out, h, r2: 8 N × D, N × F, P) and the last
        // block's q/k/v, att and P on N rows, the rest on its 32 [CLS] rows; the shared scratch
        // (14 N × D, 3 N × F, one P). Besides: the 36 TT layers' workspaces, mostly T1 and U1
        // (2·N·r_p floats, about 1 MiB a layer at r_p = 30 or 32), LayerNorms and the head.
        let big =
            4 * (5 * (8 * n * d + n * f + ht2) + (4 * n * d + ht2) + 14 * n * d + 3 * n * f + ht2);
        let tt_t1_u1 = 36 * 2 * 4 * n * 30;
        assert!(
            m.activations >= big + tt_t1_u1 && m.activations < big + 2 * tt_t1_u1 + (16 << 20),
            "activations {} vs the big buffers' {big}",
            m.activations
        );
        // The TTM table (30,522 × 768, rank 32): a row and one distinct id's slab gradients
        // (12,608 floats, docs/gpu.md) per row of the batch, padded to N.
        let slab = 4 * n * (d + 12_608);
        assert!(
            m.ttm >= slab && m.ttm < slab + (1 << 20),
            "ttm {} vs {slab}",
            m.ttm
        );
        assert!(m.other >= CUBLAS_WORKSPACE && m.other < CUBLAS_WORKSPACE + (1 << 20));
        // The TT/TTM model's few million parameters, four times.
        assert!(
            m.params > 4 * 4 * 1_000_000 && m.params < 4 * 4 * 20_000_000,
            "{m:?}"
        );
        // The whole near the figure docs/gpu.md derived (about 1.6 GiB at batch 32).
        let gib = m.total() as f64 / (1u64 << 30) as f64;
        assert!((1.0..2.5).contains(&gib), "{gib:.2} GiB");
        let text = m.describe(32, 128);
        println!("{text}: {:.2} GiB", gib);
        assert!(
            text.contains("batch 32 × 128") && text.contains("TTM"),
            "{text}"
        );
    }

    /// Activations grow with the batch, parameters do not; the rank schedule adds its tables.
    #[test]
    fn parts_scale_as_they_should() {
        let (one, two) = (paper(1), paper(2));
        assert_eq!(one.params, two.params);
        assert!(
            two.activations > one.activations && two.activations < 2 * one.activations + (1 << 20)
        );
        let cfg = EncoderConfig {
            num_labels: 2,
            ..EncoderConfig::default()
        };
        let enc = Encoder::new(&cfg, 0).unwrap();
        let rank = super::super::RankSettings::early_stage(&enc, 0.01);
        assert!(rank.is_some());
        let with = PlanMemory::of(
            &enc,
            1,
            cfg.seq_len,
            &StepConfig {
                rank,
                ..StepConfig::paper()
            },
        )
        .unwrap();
        let without = PlanMemory::of(&enc, 1, cfg.seq_len, &StepConfig::paper()).unwrap();
        assert!(with.other > without.other);
        let eval = PlanMemory::of(
            &enc,
            1,
            cfg.seq_len,
            &StepConfig {
                forward_only: true,
                ..StepConfig::paper()
            },
        )
        .unwrap();
        assert_eq!(
            eval.params,
            without.params / 4 + 12,
            "values, and 3 unused floats"
        );
        assert!(eval.describe(1, 128).starts_with("the evaluation pass"));
        assert_eq!(
            (with.params, with.activations, with.ttm),
            (without.params, without.activations, without.ttm)
        );
    }

    /// A plan for the forward only leaves out the backward's shared scratch (8 N × D, one P,
    /// 2 N × F and the logits' gradient) and the TTM table's slab gradients (N × 12,608) and
    /// core gradient: exactly those bytes, less the one float each keeps as an address.
    #[test]
    fn a_forward_only_plan_leaves_out_the_backward_scratch() {
        let cfg = EncoderConfig {
            num_labels: 5,
            ..EncoderConfig::default()
        };
        let enc = Encoder::new(&cfg, 0).unwrap();
        let of = |forward_only| {
            let opt = StepConfig {
                forward_only,
                ..StepConfig::paper()
            };
            PlanMemory::of(&enc, 32, cfg.seq_len, &opt).unwrap()
        };
        let (train, eval) = (of(false), of(true));
        let (n, d, f, ht2, classes) = (4096usize, 768usize, 3072usize, 32 * 12 * 128 * 128, 5);
        let scratch = 4 * (8 * n * d + ht2 + 2 * n * f + 32 * classes) - 4 * 12;
        assert_eq!(train.activations - eval.activations, scratch);
        let AnyEmbedding::Ttm(e) = &enc.word else {
            panic!("the paper model's word table is TTM")
        };
        let s = e.shape();
        let layout = TtmLayout::new(s.vocab_modes(), s.dim_modes(), s.ranks()).unwrap();
        let max_core = layout.cores.iter().map(|c| c.len()).max().unwrap();
        assert_eq!(layout.slab_total, 12_608);
        assert_eq!(
            train.ttm - eval.ttm,
            4 * (n * layout.slab_total + max_core) - 4 * 2
        );
        println!(
            "batch 32: training plan {:.2} GiB, evaluation plan {:.2} GiB",
            train.total() as f64 / (1u64 << 30) as f64,
            eval.total() as f64 / (1u64 << 30) as f64
        );
    }
}
