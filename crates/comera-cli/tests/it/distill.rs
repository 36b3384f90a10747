//! Distillation (`[distill]`, `train --teacher`): a TT student trained against a dense teacher
//! run, stopped and resumed bit-identically; the teacher never trained and never in the
//! optimiser; a teacher that changed under a stopped run refused.

use crate::common::*;
use std::path::Path;

/// `comera --threads 2 train --quiet` with `args`; asserts success.
fn train_ok(args: &[&str]) -> String {
    let (code, text) = comera(&[&["--threads", "2", "train", "--quiet"][..], args].concat());
    assert_eq!(code, 0, "{text}");
    text
}

#[test]
fn a_distilled_run_resumes_bit_identically_and_never_trains_its_teacher() {
    let dir = tempdir("distill");
    let (data, vocab) = write_data(&dir);
    // The teacher: the dense model on the data (post-LN, 1 block, width 16).
    let plain = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 6");
    let teacher = dir.join("teacher");
    train_ok(&["--config", s(&plain), "--dense", "--out", s(&teacher)]);
    let teacher_weights = std::fs::read(teacher.join("model.safetensors")).unwrap();

    // The student: the TT model of the same config, with every distillation term on.
    let extra = format!(
        "max_steps_per_epoch = 6\n\n[distill]\nteacher = \"{}\"\nlogit_weight = 0.5\ntemperature = 3.0\nhidden_weight = 0.2\nlayers = [[0, 0], [1, 1]]\n",
        teacher.display()
    );
    let cfg = write_classifier(
        &dir,
        "student.toml",
        &data,
        &vocab,
        &Classifier {
            model: &tt_layouts(true),
            lr_gates: 0.01,
            epochs: 3,
            warmup_steps: 5,
            extra: &extra,
        },
    );
    let (a, b) = (dir.join("a"), dir.join("b"));
    let text = train_ok(&["--config", s(&cfg), "--out", s(&a)]);
    assert!(
        text.contains("teacher ") && text.contains("KL(τ = 3)"),
        "{text}"
    );
    // Same labels, same dense head layout: the student's head starts as the teacher's.
    assert!(
        text.contains("init  classifier head from the teacher"),
        "{text}"
    );
    train_ok(&[
        "--config",
        s(&cfg),
        "--out",
        s(&b),
        "--stop-after-steps",
        "7",
    ]);
    train_ok(&["--resume", s(&b)]);
    assert_same_run(&a, &b, &["train", "eval"]);

    // Each term is logged, and the loss is their weighted sum.
    let recs = records(&a, "train");
    assert!(!recs.is_empty());
    for r in &recs {
        let t = &r["loss_terms"];
        let (ce, kl, mse) = (
            t["task"].as_f64().unwrap(),
            t["logits"].as_f64().unwrap(),
            t["hidden"].as_f64().unwrap(),
        );
        assert!(kl > 0.0 && mse > 0.0, "{r}");
        let want = ce + 0.5 * kl + 0.2f32 as f64 * mse;
        let loss = r["loss"].as_f64().unwrap();
        assert!((loss - want).abs() < 1e-6 * want, "{r}");
    }
    // The run records its teacher's identity and the map it used.
    let config = std::fs::read_to_string(a.join("config.toml")).unwrap();
    assert!(config.contains("teacher_sha256 = \""), "{config}");
    let squeezed = config.replace([' ', '\n'], "");
    assert!(squeezed.contains("layers=[[0,0,],[1,1,],]"), "{config}");

    // The teacher was never written, and holds no optimiser state: the distilled run's
    // optimiser has exactly the bytes of the same student trained without a teacher.
    assert!(std::fs::read(teacher.join("model.safetensors")).unwrap() == teacher_weights);
    let alone = dir.join("alone");
    let plain_tt = write_classifier(
        &dir,
        "alone.toml",
        &data,
        &vocab,
        &Classifier {
            model: &tt_layouts(true),
            lr_gates: 0.01,
            epochs: 3,
            warmup_steps: 5,
            extra: "max_steps_per_epoch = 6",
        },
    );
    train_ok(&["--config", s(&plain_tt), "--out", s(&alone)]);
    let (ra, rs) = (report_json(&a), report_json(&alone));
    assert_eq!(ra["optimizer_bytes"], rs["optimizer_bytes"]);
    assert_eq!(ra["params"], rs["params"]);
    let t = &ra["teacher"];
    assert!(t["params"].as_u64().unwrap() > 0, "{ra}");
    assert!(t["forward_seconds"].as_f64().unwrap() > 0.0, "{ra}");
    assert!(t["state_bytes"].as_u64().unwrap() > 0, "{ra}");

    // A stopped run whose teacher was replaced by another model is refused on resume.
    let c = dir.join("c");
    train_ok(&[
        "--config",
        s(&cfg),
        "--out",
        s(&c),
        "--stop-after-steps",
        "4",
    ]);
    let other = dir.join("other");
    train_ok(&[
        "--config",
        s(&plain),
        "--dense",
        "--seed",
        "7",
        "--out",
        s(&other),
    ]);
    std::fs::rename(&teacher, dir.join("teacher-was")).unwrap();
    std::fs::rename(&other, &teacher).unwrap();
    let (code, text) = comera(&["train", "--quiet", "--resume", s(&c)]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("distill.teacher") && text.contains("not the teacher this run started with"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn teacher_errors_name_what_is_wrong() {
    let dir = tempdir("distill-errors");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 2");
    let missing = dir.join("no-such-teacher");
    let (code, text) = comera(&[
        "train",
        "--quiet",
        "--config",
        s(&cfg),
        "--teacher",
        s(&missing),
    ]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("distill.teacher") && text.contains("no-such-teacher"),
        "{text}"
    );
    // A Hugging Face directory is not a comera model: the error says to import it.
    let hf = dir.join("hf-model");
    std::fs::create_dir_all(&hf).unwrap();
    std::fs::write(hf.join("config.json"), "{}").unwrap();
    let (code, text) = comera(&["train", "--quiet", "--config", s(&cfg), "--teacher", s(&hf)]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("distill.teacher") && text.contains("comera import hf"),
        "{text}"
    );
    // A DLRM config has no teacher.
    let dlrm = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/dlrm-synthetic.toml");
    let (code, text) = comera(&[
        "train",
        "--quiet",
        "--config",
        s(&dlrm),
        "--teacher",
        s(&missing),
    ]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("--teacher"), "{text}");
    // A teacher with other labels cannot give logits for these.
    let teacher = dir.join("teacher");
    train_ok(&["--config", s(&cfg), "--dense", "--out", s(&teacher)]);
    let flipped = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 2");
    let text = std::fs::read_to_string(&flipped)
        .unwrap()
        .replace("labels = [\"neg\", \"pos\"]", "labels = [\"pos\", \"neg\"]");
    std::fs::write(&flipped, text).unwrap();
    let (code, text) = comera(&[
        "train",
        "--quiet",
        "--config",
        s(&flipped),
        "--teacher",
        s(&teacher),
        "--out",
        s(&dir.join("s")),
    ]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("the same labels in the same order"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}
