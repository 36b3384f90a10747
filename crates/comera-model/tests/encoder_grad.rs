//! The encoder's backward against finite differences on a tiny model (2 layers, width 16),
//! dense and TT/TTM, post-LN and pre-LN, with padding and dropout in the batch; the classifier
//! head and the masked-LM head with each output projection (dense, tied, TT with padded
//! vocabulary).

use comera_model::Rank;
use comera_model::{
    DistillLoss, Encoder, EncoderConfig, EncoderState, HeadKind, LayerTt, MlmDecoderKind, TtmConfig,
};
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
        attn_tt: LayerTt::uniform(&[4, 4], &[4, 4], 3),
        ffn_up_tt: LayerTt::uniform(&[4, 4], &[4, 8], 3),
        ffn_down_tt: LayerTt::uniform(&[4, 8], &[4, 4], 3),
        word_ttm: TtmConfig {
            vocab_modes: vec![5, 4, 3],
            dim_modes: vec![2, 2, 4],
            rank: Rank::Uniform(3),
        },
        pooler_tt: None,
        classifier_tt: None,
        head: HeadKind::Classifier,
        mlm_decoder: MlmDecoderKind::Auto,
        // 16 → 64 ≥ 60: four padding logits.
        mlm_decoder_tt: LayerTt::uniform(&[4, 4], &[8, 8], 3),
        recompute_blocks: false,
    }
}

fn tiny_mlm(tt: bool, decoder: MlmDecoderKind) -> EncoderConfig {
    EncoderConfig {
        head: HeadKind::Mlm,
        mlm_decoder: decoder,
        ..tiny(tt, false)
    }
}

/// Loads [`batch`] with MLM labels at a few positions (not all of them masked in the input).
fn load_mlm(st: &mut EncoderState, b: &Batch) {
    let selected = [1u32, 4, 7, 13];
    let mut labels = vec![-100i32; b.ids.len()];
    let mut ids = b.ids.clone();
    for (j, &s) in selected.iter().enumerate() {
        labels[s as usize] = (7 + 11 * j as i32) % 60;
        if j % 2 == 0 {
            ids[s as usize] = 3; // the "[MASK]" of this test
        }
    }
    st.load_mlm(&ids, &b.mask, &labels, &selected).unwrap();
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
    check(&tiny(tt, pre_ln), &|st, b| {
        st.load(&b.ids, &b.types, &b.mask, &b.labels).unwrap()
    });
}

/// Every parameter's name and gradient.
fn named_grads(m: &Encoder) -> Vec<(String, Vec<f32>)> {
    m.params()
        .iter()
        .map(|p| (p.name.clone(), p.grad.clone()))
        .collect()
}

fn check(cfg: &EncoderConfig, load: &dyn Fn(&mut EncoderState, &Batch)) {
    check_with(cfg, load, &|_, _| {});
}

/// [`check`] with `setup` applied to the model and its fresh state (a teacher attached, …).
fn check_with(
    cfg: &EncoderConfig,
    load: &dyn Fn(&mut EncoderState, &Batch),
    setup: &dyn Fn(&Encoder, &mut EncoderState),
) {
    let (tt, pre_ln) = (cfg.tt_linear, cfg.pre_ln);
    let mut m = Encoder::new(cfg, 5).unwrap();
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
    // Room for 2 labelled positions per sequence: 6 rows, 2 of them padding for `load_mlm`.
    let mut st = m.state_for(3, 6, 2).unwrap();
    setup(&m, &mut st);
    load(&mut st, &b);
    m.zero_grad();
    loss(&m, &mut st);
    m.backward(&mut st);
    let grads = named_grads(&m);
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

/// A dense 3-layer teacher of the tiny student's width and labels, and a loss with every term
/// on: the embeddings', a middle and the last hidden state matched.
fn attach_teacher(m: &Encoder, st: &mut EncoderState) {
    let cfg = EncoderConfig {
        layers: 3,
        ..tiny(false, false)
    };
    let teacher = std::sync::Arc::new(Encoder::new(&cfg, 11).unwrap());
    let loss = DistillLoss {
        task_weight: 0.5,
        logit_weight: 0.7,
        temperature: 2.0,
        hidden_weight: 0.9,
        layers: vec![(0, 0), (1, 2), (2, 3)],
    };
    st.attach_teacher(m, teacher, loss).unwrap();
}

#[test]
fn distilled_loss_matches_finite_differences() {
    let load =
        |st: &mut EncoderState, b: &Batch| st.load(&b.ids, &b.types, &b.mask, &b.labels).unwrap();
    check_with(&tiny(true, false), &load, &attach_teacher);
    let recomputed = EncoderConfig {
        recompute_blocks: true,
        ..tiny(true, true)
    };
    check_with(&recomputed, &load, &attach_teacher);
}

#[test]
fn distilled_loss_is_the_weighted_sum_of_its_terms() {
    let cfg = tiny(true, false);
    let m = Encoder::new(&cfg, 5).unwrap();
    let b = batch(&mut init::rng(9));
    let mut st = m.state_for(3, 6, 0).unwrap();
    st.load(&b.ids, &b.types, &b.mask, &b.labels).unwrap();
    // The teacher's map matches the last hidden state, which runs the last block on every row
    // (the [CLS]-rows block draws its dropout masks differently).
    st.full_last_block();
    let plain = m.forward(&mut st, true, 7).unwrap();
    assert_eq!(plain.terms, None);
    attach_teacher(&m, &mut st);
    let s = m.forward(&mut st, true, 7).unwrap();
    let t = s.terms.expect("a distilled step has terms");
    assert_eq!(t.task, plain.loss, "the task term is the undistilled loss");
    assert!(t.logits > 0.0 && t.hidden > 0.0, "{t:?}");
    // The weights are f32.
    let want = 0.5 * t.task + 0.7f32 as f64 * t.logits + 0.9f32 as f64 * t.hidden;
    assert!(
        (s.loss - want).abs() < 1e-12 * want.abs(),
        "{} vs {want}",
        s.loss
    );
    // Evaluation forwards are the student's own.
    assert_eq!(m.forward(&mut st, false, 7).unwrap().terms, None);
    assert!(st.teacher().unwrap().forward_time() > std::time::Duration::ZERO);
}

#[test]
fn a_teacher_that_cannot_teach_is_refused_by_field() {
    let m = Encoder::new(&tiny(false, false), 5).unwrap();
    let mut st = m.state_for(3, 6, 0).unwrap();
    let loss = DistillLoss {
        task_weight: 1.0,
        logit_weight: 1.0,
        temperature: 1.0,
        hidden_weight: 1.0,
        layers: vec![(1, 1)],
    };
    let cases: [(EncoderConfig, DistillLoss, &str, &str); 5] = [
        (
            EncoderConfig {
                num_labels: 4,
                ..tiny(false, false)
            },
            loss.clone(),
            "distill.teacher",
            "4 labels",
        ),
        (
            EncoderConfig {
                d_model: 32,
                heads: 2,
                ..tiny(false, false)
            },
            loss.clone(),
            "distill.layers",
            "32 wide",
        ),
        (
            tiny(false, false),
            DistillLoss {
                layers: vec![(3, 1)],
                ..loss.clone()
            },
            "distill.layers",
            "0 (embeddings) to 2",
        ),
        (
            tiny(false, false),
            DistillLoss {
                temperature: 0.0,
                ..loss.clone()
            },
            "distill.temperature",
            "> 0",
        ),
        (
            tiny_mlm(false, MlmDecoderKind::Auto),
            loss.clone(),
            "distill.teacher",
            "classifier",
        ),
    ];
    for (cfg, loss, field, msg) in cases {
        let teacher = std::sync::Arc::new(Encoder::new(&cfg, 1).unwrap());
        let e = st.attach_teacher(&m, teacher, loss).unwrap_err();
        assert_eq!(e.field, field, "{e:?}");
        assert!(e.msg.contains(msg), "{e:?}");
    }
    assert!(st.teacher().is_none());
}

#[test]
fn mlm_head_dense_decoder_matches_finite_differences() {
    check(&tiny_mlm(false, MlmDecoderKind::Dense), &load_mlm);
}

#[test]
fn mlm_head_tied_decoder_matches_finite_differences() {
    // The tied projection's gradient reaches the word-embedding rows of every vocabulary
    // entry, not only the looked-up ones: the picks above cover both.
    check(&tiny_mlm(false, MlmDecoderKind::Tied), &load_mlm);
}

#[test]
fn mlm_head_tt_decoder_with_padded_vocabulary_matches_finite_differences() {
    let cfg = tiny_mlm(true, MlmDecoderKind::Auto);
    assert_eq!(cfg.mlm_decoder(), MlmDecoderKind::Tt);
    check(&cfg, &load_mlm);
}

#[test]
fn mlm_loss_counts_only_labelled_positions() {
    let cfg = tiny_mlm(false, MlmDecoderKind::Tied);
    let m = Encoder::new(&cfg, 5).unwrap();
    let mut rng = init::rng(9);
    let b = batch(&mut rng);
    let mut st = m.state_for(3, 6, 2).unwrap();
    load_mlm(&mut st, &b);
    let s = m.forward(&mut st, false, 0).unwrap();
    assert_eq!(s.count, 4);
    assert!(s.loss.is_finite() && s.loss > 0.0, "{}", s.loss);
    // Changing the label of an unselected position changes nothing.
    let mut labels = vec![-100i32; 18];
    for (j, s) in [1usize, 4, 7, 13].iter().enumerate() {
        labels[*s] = (7 + 11 * j as i32) % 60;
    }
    labels[0] = 5;
    let mut ids = b.ids.clone();
    for (j, s) in [1usize, 4, 7, 13].iter().enumerate() {
        if j % 2 == 0 {
            ids[*s] = 3;
        }
    }
    st.load_mlm(&ids, &b.mask, &labels, &[1, 4, 7, 13]).unwrap();
    let s2 = m.forward(&mut st, false, 0).unwrap();
    assert_eq!(s.loss, s2.loss);
    // Bad selections are refused.
    assert!(st.load_mlm(&ids, &b.mask, &labels, &[4, 1]).is_err());
    assert!(st.load_mlm(&ids, &b.mask, &labels, &[1, 40]).is_err());
    assert!(st.load(&b.ids, &b.types, &b.mask, &b.labels).is_err());
}

#[test]
fn tied_decoder_needs_a_dense_embedding() {
    let e = Encoder::new(&tiny_mlm(true, MlmDecoderKind::Tied), 1).unwrap_err();
    assert_eq!(e.field, "model.mlm_decoder");
    let mut cfg = tiny_mlm(true, MlmDecoderKind::Tt);
    cfg.mlm_decoder_tt.out_modes = vec![7, 8];
    let e = Encoder::new(&cfg, 1).unwrap_err();
    assert_eq!(e.field, "model.mlm_decoder_tt");
}

/// Per-layer choices: TT attention, a dense FFN up and a TT FFN down, a TT pooler and a TT
/// classifier, with per-bond ranks (one of them above what its bond supports, so capped) and a
/// dense word embedding.
fn mixed() -> EncoderConfig {
    let mut cfg = tiny(false, false);
    cfg.attn_tt.tt = Some(true);
    cfg.attn_tt.rank = Rank::PerBond(vec![2, 3, 2]);
    cfg.ffn_down_tt.tt = Some(true);
    cfg.ffn_down_tt.rank = Rank::PerBond(vec![3, 2, 9]); // the last bond supports 4
    let mut pooler = LayerTt::uniform(&[4, 4], &[4, 4], 2);
    pooler.rank = Rank::PerBond(vec![2, 4, 3]);
    cfg.pooler_tt = Some(pooler);
    cfg.classifier_tt = Some(LayerTt::uniform(&[4, 4], &[1, 3], 2));
    cfg
}

#[test]
fn mixed_dense_and_tt_layers_with_per_bond_ranks_match_finite_differences() {
    let cfg = mixed();
    let lay = cfg.validate().unwrap();
    assert_eq!(lay.ffn_down.as_ref().unwrap().ranks(), [1, 3, 2, 4, 1]);
    assert_eq!(lay.warnings.len(), 1, "{:?}", lay.warnings);
    assert!(
        lay.warnings[0].contains("model.ffn_down_tt.rank"),
        "{:?}",
        lay.warnings
    );
    let m = Encoder::new(&cfg, 5).unwrap();
    let shape = |name: &str| {
        m.params()
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no parameter {name}"))
            .shape
            .clone()
    };
    // Each kind as configured: cores (r_{k-1}, s_k, r_k) with the per-bond ranks, or a matrix.
    assert_eq!(shape("encoder.1.attn.q.core.2"), [2, 4, 3]);
    assert_eq!(shape("encoder.1.attn.o.core.4"), [2, 4, 1]);
    assert_eq!(shape("encoder.0.ffn.up.weight"), [16, 32]);
    assert_eq!(shape("encoder.0.ffn.down.core.4"), [4, 4, 1]);
    assert_eq!(shape("pooler.core.3"), [4, 4, 3]);
    assert_eq!(shape("classifier.core.3"), [2, 1, 2]);
    assert_eq!(shape("embeddings.word.weight"), [60, 16]);
    let mut tt_layers = 0;
    m.visit_compressible(&mut |_| tt_layers += 1);
    assert_eq!(
        tt_layers,
        2 * (4 + 1) + 2,
        "q, k, v, o, down per block; pooler, classifier"
    );
    check(&cfg, &|st, b| {
        st.load(&b.ids, &b.types, &b.mask, &b.labels).unwrap()
    });
}

#[test]
fn per_bond_ranks_are_checked_by_field() {
    let mut cfg = tiny(true, false);
    cfg.attn_tt.rank = Rank::PerBond(vec![2, 3]);
    let e = cfg.validate().unwrap_err();
    assert_eq!(e.field, "model.attn_tt.rank");
    assert!(
        e.msg.contains("2 ranks given") && e.msg.contains("3 bonds"),
        "{e}"
    );
    cfg.attn_tt.rank = Rank::PerBond(vec![2, 0, 3]);
    let e = cfg.validate().unwrap_err();
    assert!(e.msg.contains("bond 2 has rank 0"), "{e}");
    // One number above every bond's limit is capped to the largest useful rank, with a warning.
    let mut cfg = tiny(true, false);
    cfg.word_ttm.rank = Rank::Uniform(1000);
    let lay = cfg.validate().unwrap();
    // TTM cores of sizes 5·2, 4·2, 3·4: bonds support min(10, 96) and min(80, 12).
    assert_eq!(lay.word.unwrap().ranks(), [1, 12, 12, 1]);
    assert!(
        lay.warnings[0].contains("model.word_ttm.rank = 1000"),
        "{:?}",
        lay.warnings
    );
    // `tt = false` makes a kind dense even when model.tt_linear is on.
    let mut cfg = tiny(true, false);
    cfg.ffn_up_tt.tt = Some(false);
    let m = Encoder::new(&cfg, 1).unwrap();
    assert!(m
        .params()
        .iter()
        .any(|p| p.name == "encoder.0.ffn.up.weight"));
    assert!(m
        .params()
        .iter()
        .any(|p| p.name == "encoder.0.ffn.down.core.1"));
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

#[test]
fn init_body_from_copies_the_pretrained_body_and_keeps_the_head() {
    let mut pre_cfg = tiny_mlm(true, MlmDecoderKind::Auto);
    pre_cfg.seq_len = 12;
    let mut pre = Encoder::new(&pre_cfg, 3).unwrap();
    // Truncated ranks in the pre-trained model: the fine-tuned one must take them.
    pre.visit_compressible_mut(&mut |l| {
        if l.layer_name() == "encoder.0.attn.q" {
            l.set_ranks(&[1, 2, 3, 2, 1]).unwrap();
        }
    });
    let fresh = Encoder::new(&tiny(true, false), 8).unwrap();
    let mut ft = fresh.clone();
    ft.init_body_from(&pre).unwrap();
    let pre_params: std::collections::HashMap<String, Vec<f32>> = pre
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.value.clone()))
        .collect();
    let fresh_params: std::collections::HashMap<String, Vec<f32>> = fresh
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.value.clone()))
        .collect();
    let mut body = 0;
    for p in ft.params() {
        if p.name.starts_with("pooler") || p.name.starts_with("classifier") {
            assert_eq!(
                p.value, fresh_params[&p.name],
                "{} keeps its own head",
                p.name
            );
        } else if p.name == "embeddings.position.weight" {
            // 6 of the 12 pre-trained positions.
            assert_eq!(p.value[..], pre_params[&p.name][..6 * 16]);
        } else {
            assert_eq!(p.value, pre_params[&p.name], "{}", p.name);
            body += 1;
        }
    }
    assert!(body > 20);
    let mut q_ranks = vec![];
    ft.visit_compressible(&mut |l| {
        if l.layer_name() == "encoder.0.attn.q" {
            q_ranks = l.ranks();
        }
    });
    assert_eq!(q_ranks, vec![1, 2, 3, 2, 1]);
    // Another body shape is refused by field.
    let e = Encoder::new(&tiny(true, true), 1)
        .unwrap()
        .init_body_from(&pre)
        .unwrap_err();
    assert_eq!(e.field, "model.pre_ln");
}

/// Block recomputation (activation checkpointing) gives the same loss and gradients, bit for
/// bit, with dropout on, for post-LN, pre-LN and MLM models.
#[test]
fn recomputed_blocks_give_identical_gradients() {
    let mut rng = init::rng(4);
    let b = batch(&mut rng);
    for (cfg, mlm) in [
        (tiny(true, false), false),
        (tiny(false, true), false),
        (tiny_mlm(true, MlmDecoderKind::Auto), true),
    ] {
        let run = |recompute: bool| {
            let cfg = EncoderConfig {
                recompute_blocks: recompute,
                ..cfg.clone()
            };
            let mut m = Encoder::new(&cfg, 5).unwrap();
            let mut st = m.state_for(3, 6, 2).unwrap();
            if mlm {
                load_mlm(&mut st, &b);
            } else {
                st.load(&b.ids, &b.types, &b.mask, &b.labels).unwrap();
            }
            m.zero_grad();
            let loss = m.forward(&mut st, true, 11).unwrap().loss;
            let hidden = st.hidden().to_vec();
            m.backward(&mut st);
            let grads: Vec<Vec<f32>> = m.params().iter().map(|p| p.grad.clone()).collect();
            (loss, hidden, grads, st.bytes())
        };
        let (l0, h0, g0, bytes0) = run(false);
        let (l1, h1, g1, bytes1) = run(true);
        assert_eq!(l0, l1);
        assert_eq!(h0, h1);
        assert_eq!(g0, g1, "mlm={mlm}");
        assert!(g0.iter().any(|g| g.iter().any(|&v| v != 0.0)));
        assert!(bytes1 < bytes0, "{bytes1} vs {bytes0}");
    }
}

/// q, k and v as one fused TT product, and Up → GELU → Down fused in row blocks, give the
/// gradients of the layers run one by one (which the finite-difference tests above prove),
/// post-LN and pre-LN.
#[test]
fn fused_qkv_and_ffn_give_the_gradients_of_separate_layers() {
    for pre_ln in [false, true] {
        let cfg = tiny(true, pre_ln);
        let mut m = Encoder::new(&cfg, 5).unwrap();
        let mut rng = init::rng(9);
        let b = batch(&mut rng);
        let run = |m: &mut Encoder, fuse: bool| {
            let mut st = m.state_for(3, 6, 2).unwrap();
            if fuse {
                assert_eq!(st.force_fused_qkv(m), cfg.layers);
                assert_eq!(st.force_fused_ffn(m), cfg.layers);
            }
            st.load(&b.ids, &b.types, &b.mask, &b.labels).unwrap();
            m.zero_grad();
            let l = loss(m, &mut st);
            m.backward(&mut st);
            let g: Vec<Vec<f32>> = m.params().iter().map(|p| p.grad.clone()).collect();
            (l, g)
        };
        let (l1, g1) = run(&mut m, false);
        let (l2, g2) = run(&mut m, true);
        assert!((l1 - l2).abs() <= 1e-5 * l1.abs(), "loss {l1} vs {l2}");
        for (i, (a, b)) in g1.iter().zip(&g2).enumerate() {
            let scale = a.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
            let err = a
                .iter()
                .zip(b)
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                err <= 1e-4 * scale,
                "pre_ln {pre_ln} param {i}: {err} vs {scale}"
            );
        }
    }
}

#[test]
fn ffn_gelu_kept_at_few_rows_and_recomputed_at_many_gives_the_same_gradients() {
    // 3 sequences (18 rows: g = GELU(h) kept from the forward) against the same 3 repeated 8
    // times (144 rows: recomputed in the backward); without dropout, the mean loss and its
    // gradients are the same up to summation order.
    for tt in [false, true] {
        let cfg = EncoderConfig {
            dropout: 0.0,
            ..tiny(tt, false)
        };
        let m0 = Encoder::new(&cfg, 5).unwrap();
        let b = batch(&mut init::rng(9));
        let run = |copies: usize| {
            let mut m = m0.clone();
            let mut st = m.state_for(3 * copies, 6, 2).unwrap();
            let rep = |v: &[u32]| v.repeat(copies);
            st.load(
                &rep(&b.ids),
                &rep(&b.types),
                &rep(&b.mask),
                &b.labels.repeat(copies),
            )
            .unwrap();
            m.zero_grad();
            let loss = m.forward(&mut st, true, 7).unwrap().loss;
            m.backward(&mut st);
            (loss, named_grads(&m))
        };
        let ((loss_few, few), (loss_many, many)) = (run(1), run(8));
        assert!(
            (loss_few - loss_many).abs() <= 1e-5 * loss_few.abs(),
            "tt={tt}"
        );
        let mut ffn_checked = false;
        for ((name, a), (_, b)) in few.iter().zip(&many) {
            let scale = a.iter().fold(0.0f32, |m, g| m.max(g.abs()));
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= 1e-4 * scale + 1e-7,
                    "tt={tt} {name}: {x} (18 rows) vs {y} (144 rows)"
                );
            }
            ffn_checked |= name.contains("ffn") && scale > 0.0;
        }
        assert!(ffn_checked, "tt={tt}: no FFN gradient compared");
    }
}

/// A classifier's last block on the [CLS] rows only (training) gives the loss and gradients of
/// the full block, post-LN and pre-LN, dense and TT, with and without block recomputation
/// (without dropout: the [CLS]-rows block draws its two masks over the B rows).
#[test]
fn cls_rows_last_block_gives_the_full_blocks_gradients() {
    let mut rng = init::rng(21);
    let b = batch(&mut rng);
    for (tt, pre_ln, recompute) in [
        (false, false, false),
        (true, false, false),
        (true, true, false),
        (true, false, true),
    ] {
        let cfg = EncoderConfig {
            dropout: 0.0,
            recompute_blocks: recompute,
            ..tiny(tt, pre_ln)
        };
        let run = |full: bool| {
            let mut m = Encoder::new(&cfg, 5).unwrap();
            let mut st = m.state_for(3, 6, 2).unwrap();
            if full {
                st.full_last_block();
            }
            st.load(&b.ids, &b.types, &b.mask, &b.labels).unwrap();
            m.zero_grad();
            let loss = m.forward(&mut st, true, 3).unwrap().loss;
            m.backward(&mut st);
            (loss, named_grads(&m))
        };
        let (l_cls, g_cls) = run(false);
        let (l_full, g_full) = run(true);
        let what = format!("tt {tt}, pre-LN {pre_ln}, recompute {recompute}");
        assert!(
            (l_cls - l_full).abs() <= 1e-6 * l_full.abs().max(1.0),
            "{what}: loss {l_cls} vs {l_full}"
        );
        for ((name, a), (_, e)) in g_cls.iter().zip(&g_full) {
            let scale = e.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
            let worst = a
                .iter()
                .zip(e)
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                worst <= 1e-4 * scale,
                "{what}: {name} differs by {worst} (scale {scale})"
            );
        }
        assert!(g_cls.iter().any(|(_, g)| g.iter().any(|&v| v != 0.0)));
    }
}
