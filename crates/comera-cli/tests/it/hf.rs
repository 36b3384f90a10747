//! The Hugging Face round trip end to end, no Python and no network: train a small run on data
//! the test writes, `export --hf`, `import hf` into a run directory that reproduces the run's
//! logits and that `inspect`, `eval`, `predict` and `train --init-from` accept, dense and
//! TT-SVD compressed.

use std::path::{Path, PathBuf};

use crate::common::{comera, s, tempdir, tt_layouts, write_classifier, write_tsv, Classifier, Tsv};

/// A run config `dir/name` (1 epoch of a 1-layer post-LN encoder with `layouts` in
/// `[model]`) on 120 rows of "good"/"bad" sentences.
fn write_config(dir: &Path, name: &str, layouts: &str) -> PathBuf {
    let rows = Tsv {
        rows: 120,
        synonyms: false,
        word_orders: false,
    };
    let (data, vocab) = write_tsv(dir, rows);
    let c = Classifier {
        model: layouts,
        lr_gates: 0.01,
        epochs: 1,
        warmup_steps: 2,
        extra: "",
    };
    write_classifier(dir, name, &data, &vocab, &c)
}

/// The run's logits on the export's check inputs, and the logits stored there.
fn logits_on_check_inputs(run: &Path, check: &Path) -> (Vec<f32>, Vec<f32>) {
    let (model, _) = comera_train::load_model(run).unwrap();
    let c = comera_import::hf::read_check_file(&std::fs::read(check).unwrap(), "check").unwrap();
    let (ids, types, mask, want) = (c.input_ids, c.token_type_ids, c.attention_mask, c.logits);
    let n = ids.len() / model.cfg.seq_len;
    let mut state = model.state(n);
    state.load(&ids, &types, &mask, &vec![0; n]).unwrap();
    model.forward(&mut state, false, 0).unwrap();
    (state.logits().to_vec(), want)
}

#[test]
fn export_hf_then_import_hf_reproduces_the_run() {
    let dir = tempdir("hf-roundtrip");
    let cfg = write_config(&dir, "run.toml", &tt_layouts(true));
    let run = dir.join("run");
    let (code, text) = comera(&["train", "--config", s(&cfg), "--quiet"]);
    assert_eq!(code, 0, "{text}");

    // Export: a BertForSequenceClassification directory with check inputs.
    let hf = dir.join("hf");
    let (code, text) = comera(&["export", s(&run), "--hf", s(&hf), "--samples", "8"]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("BertForSequenceClassification") && text.contains("8 validation inputs"),
        "{text}"
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["id2label"]["0"], "neg");
    assert_eq!(config["id2label"]["1"], "pos");
    assert_eq!(config["label2id"]["pos"], 1);
    assert_eq!(
        std::fs::read_to_string(hf.join("vocab.txt")).unwrap(),
        std::fs::read_to_string(dir.join("vocab.txt")).unwrap()
    );
    // The stored logits are the run's own.
    let check = hf.join("comera_check.safetensors");
    let (got, want) = logits_on_check_inputs(&run, &check);
    assert_eq!(got, want);

    // Import into a run directory: same logits on the same inputs, same predictions.
    let back = dir.join("back");
    let (code, text) = comera(&[
        "import",
        "hf",
        s(&hf),
        "--out",
        s(&back),
        "--config",
        s(&cfg),
    ]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("2-label classifier"), "{text}");
    let (got, want) = logits_on_check_inputs(&back, &check);
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let diff = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(diff <= 1e-5 * scale.max(1.0), "logits differ by {diff}");
    let texts = ["the good dress", "a bad shirt is very bad"];
    let (c1, p1) = comera(&["predict", s(&run), texts[0], texts[1]]);
    let (c2, p2) = comera(&["predict", s(&back), texts[0], texts[1]]);
    assert_eq!((c1, c2), (0, 0), "{p1}\n{p2}");
    assert_eq!(p1, p2);
    for (cmd, want) in [("inspect", "2 labels (neg, pos)"), ("eval", "accuracy")] {
        let (code, text) = comera(&[cmd, s(&back)]);
        assert_eq!(code, 0, "{cmd}: {text}");
        assert!(text.contains(want), "{cmd}: {text}");
    }
    // `eval` reports per class, with the confusion matrix and the majority baseline.
    let (_, text) = comera(&["eval", s(&back)]);
    for want in [
        "precision  recall      f1  support",
        "macro-F1",
        "for always the majority class",
        "confusion (rows: true class, columns: predicted)",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
    assert!(
        text.lines().any(|l| l.starts_with("neg ")) && text.lines().any(|l| l.starts_with("pos ")),
        "a row per label: {text}"
    );
    // Fine-tune from it (a dense body: --dense).
    let (code, text) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--dense",
        "--quiet",
        "--init-from",
        s(&back),
        "--out",
        s(&dir.join("ft-dense")),
    ]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("init  encoder from"), "{text}");

    // TT-SVD import: per-layer errors, the hidden-state error in words, a run directory that
    // trains on with its ranks.
    let tt = dir.join("tt");
    let (code, text) = comera(&[
        "import",
        "hf",
        s(&hf),
        "--tt",
        "--rank",
        "2",
        "--out",
        s(&tt),
        "--config",
        s(&cfg),
    ]);
    assert_eq!(code, 0, "{text}");
    for want in [
        "encoder.0.ffn.down",
        "embeddings.word",
        "hidden-state error",
        "dense import",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
    let (code, text) = comera(&["inspect", s(&tt)]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("TT attention, FFN up, FFN down"), "{text}");
    let (model, _) = comera_train::load_model(&tt).unwrap();
    let c = &model.cfg;
    let layouts = format!(
        "tt_linear = true\nttm_embedding = true\n\
         attn_tt = {{ in_modes = {:?}, out_modes = {:?}, rank = 2 }}\n\
         ffn_up_tt = {{ in_modes = {:?}, out_modes = {:?}, rank = 2 }}\n\
         ffn_down_tt = {{ in_modes = {:?}, out_modes = {:?}, rank = 2 }}\n\
         word_ttm = {{ vocab_modes = {:?}, dim_modes = {:?}, rank = 2 }}\n",
        c.attn_tt.in_modes,
        c.attn_tt.out_modes,
        c.ffn_up_tt.in_modes,
        c.ffn_up_tt.out_modes,
        c.ffn_down_tt.in_modes,
        c.ffn_down_tt.out_modes,
        c.word_ttm.vocab_modes,
        c.word_ttm.dim_modes
    );
    let tt_cfg = write_config(&dir, "tt.toml", &layouts);
    let (code, text) = comera(&[
        "train",
        "--config",
        s(&tt_cfg),
        "--quiet",
        "--init-from",
        s(&tt),
        "--out",
        s(&dir.join("ft-tt")),
    ]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("init  encoder from"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn export_hf_needs_a_run_directory() {
    let dir = tempdir("hf-errors");
    let (code, text) = comera(&["export", s(&dir.join("nope")), "--hf", s(&dir.join("out"))]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("nope"), "{text}");
    let (code, text) = comera(&["import", "hf", s(&dir.join("nope"))]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("nope") && text.contains("does not exist"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
