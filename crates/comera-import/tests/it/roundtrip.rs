//! Export → import round trips and TT-SVD compression of small random models (no downloads).

use comera_import::bert::BertWeights;
use comera_import::{
    compress, export_compressed, export_dense, import_dense, load_compressed, save_compressed,
    save_dense, CompressOptions,
};
use comera_model::Rank;
use comera_model::{Encoder, EncoderConfig, LayerTt, TtmConfig};
use comera_tensor::ttsvd::TtSvdOptions;

fn small(tt: bool) -> EncoderConfig {
    EncoderConfig {
        vocab_size: 47,
        seq_len: 8,
        d_model: 16,
        heads: 2,
        ffn: 32,
        layers: 2,
        num_labels: 3,
        tt_linear: tt,
        ttm_embedding: tt,
        attn_tt: LayerTt::uniform(&[4, 4], &[4, 4], 3),
        ffn_up_tt: LayerTt::uniform(&[4, 4], &[4, 8], 3),
        ffn_down_tt: LayerTt::uniform(&[8, 4], &[4, 4], 3),
        word_ttm: TtmConfig {
            vocab_modes: vec![5, 10],
            dim_modes: vec![4, 4],
            rank: Rank::Uniform(3),
        },
        ..EncoderConfig::default()
    }
}

/// Random non-trivial parameters everywhere (LayerNorm and biases too), seeded.
fn randomise(enc: &mut Encoder, seed: u64) {
    let mut rng = comera_tensor::init::rng(seed);
    enc.visit_params_mut(&mut |p| {
        let mut v = vec![0.0; p.len()];
        comera_tensor::init::fill_normal(&mut rng, &mut v, 0.3);
        for (x, r) in p.value.iter_mut().zip(v) {
            *x = if p.name.ends_with("gamma") || p.name.contains(".gate.") {
                1.0 + 0.5 * r.abs()
            } else {
                *x + r
            };
        }
    });
}

/// Hidden states and logits on a fixed padded batch.
fn run(enc: &Encoder) -> (Vec<f32>, Vec<f32>) {
    let (b, t) = (3, enc.cfg.seq_len);
    let ids: Vec<u32> = (0..b * t).map(|i| ((i * 7 + 3) % 47) as u32).collect();
    let types: Vec<u32> = (0..b * t).map(|i| ((i / 5) % 2) as u32).collect();
    let mask: Vec<u32> = (0..b * t).map(|i| u32::from(i % t < t - i / t)).collect();
    let mut st = enc.state(b);
    st.load(&ids, &types, &mask, &[0, 1, 2]).unwrap();
    enc.forward(&mut st, false, 0).unwrap();
    (st.hidden().to_vec(), st.logits().to_vec())
}

fn max_rel(got: &[f32], want: &[f32]) -> f64 {
    let m = want.iter().fold(0.0f64, |a, &w| a.max((w as f64).abs()));
    let d = got
        .iter()
        .zip(want)
        .fold(0.0f64, |a, (&g, &w)| a.max((g as f64 - w as f64).abs()));
    d / m.max(1e-6)
}

#[test]
fn dense_export_reimports_to_the_same_outputs() {
    let mut enc = Encoder::new(&small(false), 5).unwrap();
    randomise(&mut enc, 6);
    let bytes = export_dense(&enc).unwrap();
    let w = BertWeights::from_bytes(&bytes, "dense.safetensors").unwrap();
    // HF layout: (out, in) linear weights, BERT names.
    let q = w
        .get("encoder.layer.1.attention.self.query.weight")
        .unwrap();
    assert_eq!(q.shape, vec![16, 16]);
    assert_eq!(
        w.get("encoder.layer.0.intermediate.dense.weight")
            .unwrap()
            .shape,
        vec![32, 16]
    );
    assert_eq!(w.metadata.get("comera_format").unwrap(), "bert-dense");
    let cfg = w.encoder_config(None, None).unwrap();
    assert_eq!(cfg, small(false));
    let (back, info) = import_dense(&w, &cfg, 99).unwrap();
    assert!(
        info.kept_init.is_empty() && info.unused.is_empty(),
        "{info:?}"
    );
    assert_eq!(run(&back), run(&enc), "dense round trip is exact");
}

#[test]
fn dense_export_of_a_tt_model_matches_it() {
    let mut enc = Encoder::new(&small(true), 7).unwrap();
    randomise(&mut enc, 8);
    let bytes = export_dense(&enc).unwrap();
    let w = BertWeights::from_bytes(&bytes, "dense.safetensors").unwrap();
    let cfg = w.encoder_config(None, None).unwrap();
    assert!(!cfg.tt_linear && !cfg.ttm_embedding);
    let (back, _) = import_dense(&w, &cfg, 1).unwrap();
    let ((h1, l1), (h2, l2)) = (run(&enc), run(&back));
    assert!(max_rel(&h2, &h1) < 1e-5, "{}", max_rel(&h2, &h1));
    assert!(max_rel(&l2, &l1) < 1e-5, "{}", max_rel(&l2, &l1));
}

#[test]
fn compressed_export_round_trips_exactly() {
    let mut enc = Encoder::new(&small(true), 9).unwrap();
    randomise(&mut enc, 10);
    let bytes = export_compressed(&enc).unwrap();
    let back = load_compressed(&bytes, "c.safetensors").unwrap();
    assert_eq!(back.cfg, enc.cfg);
    assert_eq!(back.num_params(), enc.num_params());
    assert_eq!(run(&back), run(&enc));
    // Broken files are refused with the file named, never a panic.
    for cut in [0, 7, 100, bytes.len() / 2, bytes.len() - 1] {
        let e = load_compressed(&bytes[..cut], "cut.safetensors").unwrap_err();
        assert!(e.to_string().starts_with("cut.safetensors"), "{e}");
    }
    let dense = export_dense(&enc).unwrap();
    let e = load_compressed(&dense, "d.safetensors").unwrap_err();
    assert!(e.to_string().contains("expected `compressed`"), "{e}");
}

#[test]
fn saved_exports_are_the_exported_bytes() {
    // `save_*` stream the file a tensor at a time; it must be the in-memory export exactly.
    let mut enc = Encoder::new(&small(true), 13).unwrap();
    randomise(&mut enc, 14);
    let dir = std::env::temp_dir().join(format!("comera-save-exports-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (d, c) = (dir.join("d.safetensors"), dir.join("c.safetensors"));
    save_dense(&enc, &d).unwrap();
    save_compressed(&enc, &c).unwrap();
    assert!(std::fs::read(&d).unwrap() == export_dense(&enc).unwrap());
    assert!(std::fs::read(&c).unwrap() == export_compressed(&enc).unwrap());
    // A target that is not a regular file is refused, and left as it was.
    let e = save_dense(&enc, &dir).unwrap_err();
    assert!(e.to_string().contains(&*dir.to_string_lossy()), "{e}");
    assert!(dir.is_dir());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn full_rank_tt_svd_keeps_the_model_and_error_falls_with_rank() {
    let mut enc = Encoder::new(&small(false), 11).unwrap();
    randomise(&mut enc, 12);
    let (want_h, _) = run(&enc);
    let full = CompressOptions {
        linear: Some(TtSvdOptions::default()),
        word: Some(TtSvdOptions::default()),
        uniform: true,
    };
    let (tt, reports) = compress(&enc, &full).unwrap();
    assert!(tt.cfg.tt_linear && tt.cfg.ttm_embedding);
    assert_eq!(reports.len(), 2 * 6 + 1);
    for r in &reports {
        assert!(r.rel_error < 1e-5, "{}: {}", r.name, r.rel_error);
    }
    let (h, _) = run(&tt);
    assert!(max_rel(&h, &want_h) < 1e-4, "{}", max_rel(&h, &want_h));
    // Uniform ranks: the config rebuilds the same structure.
    let rebuilt = Encoder::new(&tt.cfg, 0).unwrap();
    let shapes = |e: &Encoder| {
        e.params()
            .iter()
            .map(|p| p.shape.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(shapes(&rebuilt), shapes(&tt));

    let mut last = vec![f64::INFINITY; reports.len()];
    for r in [1, 2, 4, 8] {
        let (m, reps) = compress(&enc, &CompressOptions::rank(r)).unwrap();
        assert!(m
            .params()
            .iter()
            .all(|p| p.value.iter().all(|v| v.is_finite())));
        for (i, rep) in reps.iter().enumerate() {
            assert!(rep.ranks.iter().all(|&x| x <= r));
            assert!(rep.rel_error <= last[i] + 1e-6, "{} rank {r}", rep.name);
            // Measured = predicted for linear layers; for the table the padded rows' share of
            // the error is not measured, so measured ≤ predicted.
            assert!(rep.rel_error <= rep.predicted + 1e-4, "{rep:?}");
            if rep.kind != "word" {
                assert!((rep.rel_error - rep.predicted).abs() < 1e-4, "{rep:?}");
            }
            last[i] = rep.rel_error;
        }
    }
}

#[test]
fn exact_ranks_survive_the_compressed_round_trip() {
    let mut enc = Encoder::new(&small(false), 13).unwrap();
    randomise(&mut enc, 14);
    let opts = CompressOptions {
        linear: Some(TtSvdOptions::tolerance(0.3)),
        word: Some(TtSvdOptions::rank(3)),
        uniform: false,
    };
    let (tt, reports) = compress(&enc, &opts).unwrap();
    for r in reports.iter().filter(|r| r.kind != "word") {
        assert!(r.rel_error <= 0.3, "{r:?}");
        assert_eq!(r.params, r.stored_params);
    }
    let back = load_compressed(&export_compressed(&tt).unwrap(), "x").unwrap();
    assert_eq!(run(&back), run(&tt));
}

/// Per-layer choices survive both exports: TT attention with a dense FFN up, a TT pooler and
/// classifier, per-bond ranks; the dense export reconstructs every TT layer (head included).
#[test]
fn exports_of_a_model_with_per_layer_choices_match_it() {
    let mut cfg = small(false);
    cfg.attn_tt.tt = Some(true);
    cfg.attn_tt.rank = Rank::PerBond(vec![2, 4, 3]);
    cfg.ffn_down_tt.tt = Some(true);
    cfg.pooler_tt = Some(LayerTt::uniform(&[4, 4], &[4, 4], 2));
    cfg.classifier_tt = Some(LayerTt::uniform(&[4, 4], &[3, 1], 2));
    let mut enc = Encoder::new(&cfg, 11).unwrap();
    randomise(&mut enc, 12);
    let names: Vec<String> = enc.params().iter().map(|p| p.name.clone()).collect();
    for name in [
        "pooler.core.1",
        "classifier.core.4",
        "encoder.0.ffn.up.weight",
    ] {
        assert!(names.iter().any(|n| n == name), "no {name} in {names:?}");
    }
    let back = load_compressed(&export_compressed(&enc).unwrap(), "c.safetensors").unwrap();
    assert_eq!(back.cfg, enc.cfg);
    assert_eq!(run(&back), run(&enc));
    let bytes = export_dense(&enc).unwrap();
    let w = BertWeights::from_bytes(&bytes, "dense.safetensors").unwrap();
    let dense_cfg = w.encoder_config(None, None).unwrap();
    assert!(dense_cfg.pooler_tt.is_none() && dense_cfg.attn_tt.tt.is_none());
    let (dense, _) = import_dense(&w, &dense_cfg, 1).unwrap();
    assert_eq!(dense.num_params(), enc.dense_equivalent_params());
    let ((h1, l1), (h2, l2)) = (run(&enc), run(&dense));
    assert!(max_rel(&h2, &h1) < 1e-5, "{}", max_rel(&h2, &h1));
    assert!(max_rel(&l2, &l1) < 1e-5, "{}", max_rel(&l2, &l1));
}
