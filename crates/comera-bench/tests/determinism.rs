//! The determinism contract for a whole training step: same seed and same thread count give the
//! same bits, run after run. Small encoders (dense and TT/TTM) take three steps of the one
//! training step (`Stepper::step`: zero-grad, forward, backward, clipping, AdamW) twice on a
//! fresh pool of 1 and of 2 threads; every parameter must come out bit for bit the same. The
//! dense word table (2,100 × 32 floats) is long enough for AdamW's and zeroing's parallel chunks.

use comera_bench::harness::ClassBatch;
use comera_model::{Encoder, EncoderConfig, LayerTt, Rank, TtmConfig};
use comera_optim::{AdamWConfig, Optimizer, Stepper};

fn config(tt: bool) -> EncoderConfig {
    EncoderConfig {
        vocab_size: 2100,
        seq_len: 32,
        d_model: 32,
        heads: 4,
        ffn: 64,
        layers: 2,
        num_labels: 3,
        dropout: 0.1,
        tt_linear: tt,
        ttm_embedding: tt,
        attn_tt: LayerTt::uniform(&[4, 8], &[8, 4], 4),
        ffn_up_tt: LayerTt::uniform(&[4, 8], &[8, 8], 4),
        ffn_down_tt: LayerTt::uniform(&[8, 8], &[8, 4], 4),
        word_ttm: TtmConfig {
            vocab_modes: vec![14, 15, 10],
            dim_modes: vec![2, 4, 4],
            rank: Rank::Uniform(4),
        },
        ..EncoderConfig::default()
    }
}

/// Every parameter's bits after three steps at batch `b` on a pool of `threads` (the step on
/// a pool worker, as `comera train` runs it), and the losses.
fn run(tt: bool, b: usize, threads: usize) -> (Vec<u32>, Vec<u64>) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        let cfg = config(tt);
        let mut enc = Encoder::new(&cfg, 7).unwrap();
        let mut st = enc.state(b);
        let ocfg = AdamWConfig::default();
        let mut stepper = Stepper::plain(Optimizer::new(ocfg.clone(), None, &mut enc), &enc);
        stepper.clip_norm = ocfg.clip_norm;
        ClassBatch::random(&cfg, b, 8).load(&mut st).unwrap();
        let losses = (0..3)
            .map(|s| {
                stepper
                    .step(&mut enc, &mut st, s)
                    .unwrap()
                    .stats
                    .loss
                    .to_bits()
            })
            .collect();
        let bits = enc
            .params()
            .iter()
            .flat_map(|p| p.value.iter().map(|v| v.to_bits()))
            .collect();
        (bits, losses)
    })
}

#[test]
fn a_step_gives_the_same_bits_run_after_run_at_a_given_thread_count() {
    for tt in [false, true] {
        for b in [1, 8] {
            for threads in [1, 2] {
                let first = run(tt, b, threads);
                let again = run(tt, b, threads);
                assert!(
                    first == again,
                    "tt={tt} batch {b}, {threads} threads: two runs differ"
                );
            }
        }
    }
}

/// Nothing in the step depends on the thread count (docs/scaling.md, "What depends on the
/// thread count"): every split of the work is fixed by the shapes, and each value is computed
/// by one call in one order. At batch 8 (256 rows) the TT model runs its feed-forward blocks
/// fused, in lanes.
#[test]
fn a_step_gives_the_same_bits_on_any_thread_count() {
    for tt in [false, true] {
        for b in [1, 8] {
            let one = run(tt, b, 1);
            for threads in [2, 3] {
                assert!(
                    one == run(tt, b, threads),
                    "tt={tt} batch {b}: {threads} threads differ from 1"
                );
            }
        }
    }
}
