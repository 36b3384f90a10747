//! The element-wise kernels (GELU, LayerNorm, softmax, dropout masks, residual sums) are compiled
//! for each instruction-set level and picked at run time (`comera_tensor::simd`); every level
//! must give the same bits. A tiny TT/TTM encoder with dropout, widths that leave vector tails,
//! one forward and backward at each level the CPU has: the loss and every gradient agree bit
//! for bit. (Its own test binary: the level is process-wide.)

use comera_model::{Encoder, EncoderConfig, HeadKind, LayerTt, MlmDecoderKind, Rank, TtmConfig};
use comera_tensor::simd::{self, Level};

fn config() -> EncoderConfig {
    EncoderConfig {
        vocab_size: 60,
        seq_len: 7,
        d_model: 24,
        heads: 2,
        ffn: 40,
        layers: 2,
        num_labels: 3,
        type_vocab: 2,
        dropout: 0.1,
        pre_ln: false,
        ln_eps: 1e-5,
        init_std: 0.5,
        threshold: 0.01,
        tt_linear: true,
        ttm_embedding: true,
        attn_tt: LayerTt::uniform(&[4, 6], &[4, 6], 3),
        ffn_up_tt: LayerTt::uniform(&[4, 6], &[5, 8], 3),
        ffn_down_tt: LayerTt::uniform(&[5, 8], &[4, 6], 3),
        word_ttm: TtmConfig {
            vocab_modes: vec![5, 4, 3],
            dim_modes: vec![2, 3, 4],
            rank: Rank::Uniform(3),
        },
        pooler_tt: None,
        classifier_tt: None,
        head: HeadKind::Classifier,
        mlm_decoder: MlmDecoderKind::Auto,
        mlm_decoder_tt: LayerTt::uniform(&[4, 6], &[8, 8], 3),
        recompute_blocks: false,
    }
}

/// The loss and every gradient, as bits, after one forward and backward at `level`.
fn step_at(level: Level) -> (Level, u64, Vec<(String, Vec<u32>)>) {
    let got = simd::set_level(level);
    let cfg = config();
    let mut m = Encoder::new(&cfg, 5).unwrap();
    let (b, t) = (4, cfg.seq_len);
    let mut st = m.state_for(b, t, 0).unwrap();
    let lens = [7usize, 5, 3, 7];
    let (mut ids, mut types, mut mask) = (vec![], vec![], vec![]);
    for (s, &len) in lens.iter().enumerate() {
        for i in 0..t {
            let real = i < len;
            ids.push(if real {
                ((s * 13 + i * 7) % 59 + 1) as u32
            } else {
                0
            });
            types.push((real && i >= len / 2) as u32);
            mask.push(real as u32);
        }
    }
    st.load(&ids, &types, &mask, &[0, 2, 1, 0]).unwrap();
    m.zero_grad();
    let loss = m.forward(&mut st, true, 3).unwrap().loss;
    m.backward(&mut st);
    let grads = m
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.grad.iter().map(|g| g.to_bits()).collect()))
        .collect();
    (got, loss.to_bits(), grads)
}

#[test]
fn every_instruction_set_level_gives_the_same_loss_and_gradients() {
    let (_, loss, grads) = step_at(Level::Baseline);
    assert!(f64::from_bits(loss).is_finite());
    assert!(grads
        .iter()
        .any(|(_, g)| g.iter().any(|&b| f32::from_bits(b) != 0.0)));
    for level in [Level::Avx2, Level::Avx512] {
        let (got, l, g) = step_at(level);
        assert_eq!(l, loss, "loss at {} vs baseline", got.name());
        for ((name, a), (_, b)) in grads.iter().zip(&g) {
            assert!(
                a == b,
                "{name}: gradient at {} differs from baseline",
                got.name()
            );
        }
    }
    simd::set_level(simd::detected());
}
