//! The encoder's backward against finite differences on a tiny model (2 layers, width 16),
//! dense and TT/TTM, post-LN and pre-LN, with padding and dropout in the batch.

use comera_model::{Encoder, EncoderConfig, EncoderState, LayerTt, TtmConfig};
use comera_tensor::init;
use rand::Rng as _;

fn tiny(tt: bool, pre_ln: bool) -> EncoderConfig {
    EncoderConfig {
        vocab_size: 60,
        seq_len: 6,
        d_model: 16,
        heads: 2,
        ffn: 32,
        layers: 2,
        num_labels: 3,
        type_vocab: 2,
        dropout: 0.1,
        pre_ln,
        ln_eps: 1e-5,
        init_std: 0.5,
        threshold: 0.01,
        tt_linear: tt,
        ttm_embedding: tt,
        attn_tt: LayerTt {
            in_modes: vec![4, 4],
            out_modes: vec![4, 4],
            rank: 3,
        },
        ffn_up_tt: LayerTt {
            in_modes: vec![4, 4],
            out_modes: vec![4, 8],
            rank: 3,
        },
        ffn_down_tt: LayerTt {
            in_modes: vec![4, 8],
            out_modes: vec![4, 4],
            rank: 3,
        },
        word_ttm: TtmConfig {
            vocab_modes: vec![5, 4, 3],
            dim_modes: vec![2, 2, 4],
            rank: 3,
        },
    }
}

struct Batch {
    ids: Vec<u32>,
    types: Vec<u32>,
    mask: Vec<u32>,
    labels: Vec<usize>,
}

/// Three sequences of 6 tokens; the second and third are padded at the end.
fn batch(rng: &mut init::Rng) -> Batch {
    let lens = [6usize, 4, 2];
    let mut b = Batch {
        ids: vec![],
        types: vec![],
        mask: vec![],
        labels: vec![0, 2, 1],
    };
    for &len in &lens {
        for t in 0..6 {
            let real = t < len;
            b.ids.push(if real { rng.random_range(1..60) } else { 0 });
            b.types.push((real && t >= len / 2) as u32);
            b.mask.push(real as u32);
        }
    }
    b
}

fn loss(m: &Encoder, st: &mut EncoderState) -> f64 {
    m.forward(st, true, 7).unwrap().loss
}

fn check_model(tt: bool, pre_ln: bool) {
    let cfg = tiny(tt, pre_ln);
    let mut m = Encoder::new(&cfg, 5).unwrap();
    let mut rng = init::rng(9);
    // Gates away from 1 so that gate gradients are not trivially tied to core gradients.
    m.visit_params_mut(&mut |p| {
        if p.name.contains("gate") {
            for d in &mut p.value {
                *d = rng.random_range(0.5..1.5);
            }
        }
    });
    let b = batch(&mut rng);
    let mut st = m.state(3);
    st.load(&b.ids, &b.types, &b.mask, &b.labels).unwrap();
    m.zero_grad();
    loss(&m, &mut st);
    m.backward(&mut st);
    let grads: Vec<(String, Vec<f32>)> = m
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.grad.clone()))
        .collect();
    let eps = 1e-2f32;
    let mut kinds_checked = std::collections::BTreeSet::new();
    for (pi, (name, grad)) in grads.iter().enumerate() {
        let scale = grad.iter().fold(0.0f32, |a, g| a.max(g.abs()));
        // Up to 6 entries per tensor, spread over it; for embedding tables the rows of used ids.
        let len = grad.len();
        let picks: Vec<usize> = if name.contains("embeddings.word.weight") {
            let d = cfg.d_model;
            b.ids
                .iter()
                .take(3)
                .map(|&id| id as usize * d + 3)
                .collect()
        } else {
            (0..6).map(|j| (j * 7919 + 13) % len).collect()
        };
        for i in picks {
            let mut plus = m.clone();
            let mut minus = m.clone();
            let mut k = 0;
            plus.visit_params_mut(&mut |p| {
                if k == pi {
                    p.value[i] += eps;
                }
                k += 1;
            });
            k = 0;
            minus.visit_params_mut(&mut |p| {
                if k == pi {
                    p.value[i] -= eps;
                }
                k += 1;
            });
            let fd = ((loss(&plus, &mut st) - loss(&minus, &mut st)) / (2.0 * eps as f64)) as f32;
            let err = (fd - grad[i]).abs();
            assert!(
                err <= 3e-2 * scale.max(1e-3) + 2e-4,
                "tt={tt} pre_ln={pre_ln} {name}[{i}]: analytic {} vs finite difference {fd} (tensor max {scale})",
                grad[i]
            );
        }
        let kind = name
            .split('.')
            .filter(|s| s.parse::<usize>().is_err())
            .collect::<Vec<_>>()
            .join(".");
        kinds_checked.insert(kind);
    }
    if tt {
        assert!(
            kinds_checked.iter().any(|k| k.contains("core"))
                && kinds_checked.iter().any(|k| k.contains("gate"))
        );
    }
    assert!(kinds_checked.len() >= 15, "{kinds_checked:?}");
}

#[test]
fn dense_post_ln_matches_finite_differences() {
    check_model(false, false);
}

#[test]
fn tt_post_ln_matches_finite_differences() {
    check_model(true, false);
}

#[test]
fn tt_pre_ln_matches_finite_differences() {
    check_model(true, true);
}

#[test]
fn padding_tokens_do_not_change_the_prediction() {
    for tt in [false, true] {
        let m = Encoder::new(&tiny(tt, false), 3).unwrap();
        let mut rng = init::rng(4);
        let mut b = batch(&mut rng);
        let mut st = m.state(3);
        st.load(&b.ids, &b.types, &b.mask, &b.labels).unwrap();
        m.forward(&mut st, false, 0).unwrap();
        let before = st.logits().to_vec();
        b.ids[6 + 5] = 17; // a padded position of sequence 2
        b.ids[12 + 3] = 42; // and of sequence 3
        st.load(&b.ids, &b.types, &b.mask, &b.labels).unwrap();
        m.forward(&mut st, false, 0).unwrap();
        assert_eq!(before, st.logits(), "tt={tt}");
    }
}

#[test]
fn invalid_configs_name_the_field() {
    let mut c = tiny(true, false);
    c.attn_tt.in_modes = vec![4, 5];
    let e = Encoder::new(&c, 0).unwrap_err().to_string();
    assert!(e.contains("model.attn_tt") && e.contains("16"), "{e}");
    let mut c = tiny(true, false);
    c.heads = 3;
    assert!(Encoder::new(&c, 0)
        .unwrap_err()
        .to_string()
        .contains("model.heads"));
    let mut c = tiny(true, false);
    c.word_ttm.dim_modes = vec![2, 2, 2];
    assert!(Encoder::new(&c, 0)
        .unwrap_err()
        .to_string()
        .contains("model.word_ttm"));
    let mut c = tiny(false, false);
    c.num_labels = 1;
    assert!(Encoder::new(&c, 0)
        .unwrap_err()
        .to_string()
        .contains("model.num_labels"));
}

#[test]
fn tensorised_model_is_smaller_than_its_dense_equivalent() {
    let m = Encoder::new(&EncoderConfig::default(), 0).unwrap();
    let dense = Encoder::new(
        &EncoderConfig {
            tt_linear: false,
            ttm_embedding: false,
            ..EncoderConfig::default()
        },
        0,
    )
    .unwrap();
    assert_eq!(m.dense_equivalent_params(), dense.num_params());
    assert!(
        m.num_params() * 20 < dense.num_params(),
        "{} vs {}",
        m.num_params(),
        dense.num_params()
    );
}
