//! `comera train`, `eval`, `predict` end to end on a small data set the test writes itself
//! (no network), and clear errors for bad configs and data.

use crate::common::{
    assert_same_run, checkpoints, comera, every_command_works_on, records, tempdir, write_config,
    write_data, RANK_EXTRA,
};
use std::path::Path;

#[test]
fn train_eval_predict_on_a_small_local_data_set() {
    for tt in [true, false] {
        let dir = tempdir(if tt { "tt" } else { "dense" });
        let (data, vocab) = write_data(&dir);
        let cfg = write_config(&dir, &data, &vocab, tt, "");
        let (code, text) = comera(&["train", "--config", cfg.to_str().unwrap(), "--quiet"]);
        assert_eq!(code, 0, "{text}");
        let run = dir.join("run");
        for f in [
            "config.toml",
            "metrics.jsonl",
            "curves.png",
            "model.safetensors",
            "model.toml",
        ] {
            assert!(run.join(f).exists(), "{f} missing: {text}");
        }
        let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        let evals: Vec<serde_json::Value> = metrics
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|r| r["kind"] == "eval")
            .collect();
        assert_eq!(evals.len(), 6, "one evaluation per epoch");
        let acc = evals.last().unwrap()["valid_accuracy"].as_f64().unwrap();
        assert!(
            acc >= 0.9,
            "tt={tt}: the keyword task is easy, got validation accuracy {acc}\n{metrics}"
        );
        let first_loss = evals[0]["train_loss"].as_f64().unwrap();
        let last_loss = evals.last().unwrap()["train_loss"].as_f64().unwrap();
        assert!(
            last_loss < first_loss,
            "training loss falls: {first_loss} -> {last_loss}"
        );

        let (code, text) = comera(&["eval", run.to_str().unwrap()]);
        assert_eq!(code, 0, "{text}");
        assert!(text.contains("accuracy"), "{text}");
        let (code, text) = comera(&[
            "predict",
            run.to_str().unwrap(),
            "the good dress",
            "a bad fit",
        ]);
        assert_eq!(code, 0, "{text}");
        let labels: Vec<&str> = text
            .lines()
            .map(|l| l.split('\t').next().unwrap())
            .collect();
        assert_eq!(labels, ["pos", "neg"], "{text}");
        every_command_works_on(&run, &["the good dress"], "pos\t");
        if tt {
            a_copied_run_predicts_without_the_files_it_was_trained_from(&dir, &run, &vocab, &data);
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// A run directory copied to another place, with its vocabulary and data gone, still
/// predicts and evaluates on a file given (the run keeps its own vocab.txt; `eval --data`
/// reads that file only).
fn a_copied_run_predicts_without_the_files_it_was_trained_from(
    dir: &Path,
    run: &Path,
    vocab: &Path,
    data: &Path,
) {
    let moved = dir.join("elsewhere").join("run");
    std::fs::create_dir_all(moved.parent().unwrap()).unwrap();
    let status = std::process::Command::new("cp")
        .args(["-r", run.to_str().unwrap(), moved.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(status.success());
    let kept = dir.join("elsewhere").join("data.tsv");
    std::fs::copy(data, &kept).unwrap();
    std::fs::remove_file(vocab).unwrap();
    std::fs::remove_file(data).unwrap();
    std::fs::remove_dir_all(run).unwrap();
    let m = moved.to_str().unwrap();
    let (code, text) = comera(&["predict", m, "the good dress", "a bad fit"]);
    assert_eq!(code, 0, "{text}");
    let labels: Vec<&str> = text
        .lines()
        .map(|l| l.split('\t').next().unwrap())
        .collect();
    assert_eq!(labels, ["pos", "neg"], "{text}");
    let (code, text) = comera(&["eval", m, "--data", kept.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("macro-F1"), "{text}");
}

#[test]
fn label_names_from_the_config_are_what_predict_and_eval_show() {
    let dir = tempdir("names");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, false, "max_steps_per_epoch = 2");
    let text = std::fs::read_to_string(&cfg).unwrap().replace(
        "labels = [\"neg\", \"pos\"]",
        "labels = [\"neg\", \"pos\"]\nlabel_names = [\"negative\", \"positive\"]",
    );
    std::fs::write(&cfg, text).unwrap();
    let (code, text) = comera(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--epochs",
        "1",
        "--quiet",
    ]);
    assert_eq!(code, 0, "{text}");
    let run = dir.join("run");
    let (code, text) = comera(&[
        "predict",
        run.to_str().unwrap(),
        "the good dress",
        "a bad fit",
    ]);
    assert_eq!(code, 0, "{text}");
    for line in text.lines() {
        let label = line.split('\t').next().unwrap();
        assert!(["negative", "positive"].contains(&label), "{text}");
    }
    // A count that does not match the data's labels is refused, naming the field.
    let bad = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("[\"negative\", \"positive\"]", "[\"a\", \"b\", \"c\"]");
    std::fs::write(&cfg, bad).unwrap();
    let (code, text) = comera(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--out",
        dir.join("run2").to_str().unwrap(),
        "--quiet",
    ]);
    assert_ne!(code, 0, "{text}");
    assert!(
        text.contains("data.label_names") && text.contains("3 names for the 2 labels"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn same_seed_same_thread_count_gives_the_same_model() {
    let dir = tempdir("det");
    let (data, vocab) = write_data(&dir);
    let mut weights = Vec::new();
    for _ in 0..2 {
        let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 4");
        let (code, text) = comera(&[
            "--threads",
            "2",
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--epochs",
            "1",
            "--quiet",
            "--overwrite",
        ]);
        assert_eq!(code, 0, "{text}");
        weights.push(std::fs::read(dir.join("run/model.safetensors")).unwrap());
    }
    assert!(
        weights[0] == weights[1],
        "two runs with the same seed differ"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_configs_and_rows_name_the_file_and_field() {
    let dir = tempdir("bad");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "bogus_field = 3");
    let (code, text) = comera(&["train", "--config", cfg.to_str().unwrap(), "--quiet"]);
    assert_ne!(code, 0);
    assert!(
        text.contains("run.toml") && text.contains("bogus_field"),
        "{text}"
    );

    let cfg = write_config(&dir, &data, &vocab, true, "");
    let text_cfg = std::fs::read_to_string(&cfg).unwrap().replace(
        "in_modes = [4, 4], out_modes = [4, 8]",
        "in_modes = [4, 5], out_modes = [4, 8]",
    );
    std::fs::write(&cfg, text_cfg).unwrap();
    let (code, text) = comera(&["train", "--config", cfg.to_str().unwrap(), "--quiet"]);
    assert_ne!(code, 0);
    assert!(text.contains("model.ffn_up_tt"), "{text}");

    let mut rows = std::fs::read_to_string(&data).unwrap();
    rows += "a good dress\tmaybe\n";
    std::fs::write(&data, rows).unwrap();
    let cfg = write_config(&dir, &data, &vocab, true, "");
    let (code, text) = comera(&["train", "--config", cfg.to_str().unwrap(), "--quiet"]);
    assert_ne!(code, 0);
    assert!(
        text.contains("train.tsv") && text.contains("162") && text.contains("maybe"),
        "{text}"
    );

    let cfg = write_config(&dir, &dir.join("missing.tsv"), &vocab, true, "");
    let (code, text) = comera(&["train", "--config", cfg.to_str().unwrap(), "--quiet"]);
    assert_ne!(code, 0);
    assert!(text.contains("missing.tsv"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bench_step_runs_on_tiny_sizes() {
    let (code, text) = comera(&[
        "bench",
        "step",
        "--d-model",
        "64",
        "--layers",
        "1",
        "--seq-len",
        "16",
        "--batch",
        "2",
        "--steps",
        "2",
        "--rounds",
        "1",
        "--json",
    ]);
    assert_eq!(code, 0, "{text}");
    let rows: Vec<serde_json::Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert_eq!(rows.len(), 2, "{text}");
    for r in rows {
        assert!(r["median_ms"].as_f64().unwrap() > 0.0);
        assert!(r["peak_rss_bytes"].as_u64().unwrap() > 0);
    }
}

#[test]
fn a_stopped_and_resumed_run_matches_an_uninterrupted_one_bit_for_bit() {
    // Resumed on 1 thread after 2: the step's bits do not depend on the thread count.
    resume_matches("resume", true, RANK_EXTRA, true, "1");
}

#[test]
fn a_resumed_galore_run_matches_an_uninterrupted_one_bit_for_bit() {
    // Projections refreshed every 5 steps: the stop at 22 falls between refreshes.
    let extra =
        "checkpoint_every = 4\nkeep_checkpoints = 2\n\n[galore]\nrank = 4\nupdate_every = 5";
    resume_matches("resume-galore", false, extra, false, "2");
}

/// Runs the same config uninterrupted and stopped at step 22 (both on 2 threads) then resumed
/// on `resume_threads`; the records and final weights must be identical (`rank`: the run must
/// also switch stage and truncate).
fn resume_matches(tag: &str, tt: bool, extra: &str, rank: bool, resume_threads: &str) {
    let dir = tempdir(tag);
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, tt, extra);
    // Fast gates, so that 30 late-stage steps prune and truncate.
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replace("lr_gates = 0.01", "lr_gates = 0.1")).unwrap();
    let cfg = cfg.to_str().unwrap();
    let (a, b) = (dir.join("a"), dir.join("b"));
    let base = [
        "--threads",
        "2",
        "train",
        "--config",
        cfg,
        "--epochs",
        "3",
        "--quiet",
    ];
    let (code, text) = comera(&[&base[..], &["--out", a.to_str().unwrap()]].concat());
    assert_eq!(code, 0, "{text}");
    // Stopped mid-epoch, after the switch to the late stage and after truncations.
    let (code, text) = comera(
        &[
            &base[..],
            &["--out", b.to_str().unwrap(), "--stop-after-steps", "22"],
        ]
        .concat(),
    );
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("stopped after 22 steps"), "{text}");
    assert!(checkpoints(&b).len() <= 2, "keep_checkpoints = 2");
    let (code, text) = comera(&[
        "--threads",
        resume_threads,
        "train",
        "--resume",
        b.to_str().unwrap(),
        "--quiet",
    ]);
    assert_eq!(code, 0, "{text}");
    if rank {
        assert!(!records(&a, "truncate").is_empty(), "the run truncated");
        assert!(!records(&a, "stage").is_empty(), "the run switched stage");
    }
    assert_same_run(&a, &b, &["train", "eval", "truncate", "stage"]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn early_stopping_evaluates_every_n_steps_keeps_the_best_model_and_ends_the_run() {
    let dir = tempdir("early");
    let (data, vocab) = write_data(&dir);
    // An improvement must exceed 1.0 in accuracy: only the first evaluation improves (on none),
    // so the evaluations at steps 4 and 6 do not, and patience 2 stops the run at step 6.
    let extra = "eval_every = 2\ndecay = \"cosine\"\n\n[train.early_stopping]\npatience = 2\nmetric = \"valid_accuracy\"\nmin_delta = 1.0";
    let cfg = write_config(&dir, &data, &vocab, true, extra);
    let run = dir.join("run");
    let (code, text) = comera(&["train", "--config", cfg.to_str().unwrap(), "--quiet"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("stopped early at step 6"), "{text}");
    let evals = records(&run, "eval");
    let steps: Vec<u64> = evals.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [2, 4, 6]);
    let stop = records(&run, "early_stop");
    assert_eq!(stop.len(), 1);
    assert_eq!(stop[0]["step"], 6);
    assert_eq!(stop[0]["best"], evals[0]["valid_accuracy"]);
    // best/ holds the model of the first evaluation, readable like a run directory.
    let best = run.join("best");
    let (code, text) = comera(&["eval", best.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    let acc = evals[0]["valid_accuracy"].as_f64().unwrap();
    assert!(
        text.contains(&format!("accuracy {acc:.4}")),
        "{acc}: {text}"
    );
    // The run is over: resuming says so.
    let (code, text) = comera(&["train", "--resume", run.to_str().unwrap(), "--quiet"]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("the run finished"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn off_a_terminal_the_log_has_a_line_per_logging_window() {
    let dir = tempdir("log-lines");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 10");
    // No --quiet, and stderr is a pipe: the bar is replaced by lines.
    let (code, text) = comera(&["train", "--config", cfg.to_str().unwrap(), "--epochs", "1"]);
    assert_eq!(code, 0, "{text}");
    let steps: Vec<&str> = text.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(steps.len(), 2, "log_every = 5 over 10 steps: {text}");
    assert!(
        steps[1].starts_with("step 10/10 epoch 1 loss ")
            && steps[1].contains(" lr ")
            && steps[1].contains("tok/s")
            && steps[1].contains("ETA 0s"),
        "{text}"
    );
    assert!(text.contains("epoch 1: train loss"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn gradient_accumulation_matches_the_whole_batch_with_micro_batch_activations() {
    let dir = tempdir("accumulate");
    let (data, vocab) = write_data(&dir);
    let (a, b) = (dir.join("a"), dir.join("b"));
    for (out, extra) in [(&a, ""), (&b, "accumulate_steps = 4\n")] {
        // Dropout is 0 in this config, so the micro-batches see exactly the batch's examples.
        let cfg = write_config(
            &dir,
            &data,
            &vocab,
            true,
            &format!("{extra}max_steps_per_epoch = 10"),
        );
        let (code, text) = comera(&[
            "--threads",
            "2",
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--epochs",
            "2",
            "--quiet",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{text}");
    }
    let close = |x: &serde_json::Value, y: &serde_json::Value, what: &str| {
        let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
        let rel = (x - y).abs() / x.abs().max(1e-12);
        assert!(rel < 1e-4, "{what}: {x} vs {y} ({rel:.1e})");
    };
    let (ta, tb) = (records(&a, "train"), records(&b, "train"));
    assert_eq!(ta.len(), 4);
    assert_eq!(ta.len(), tb.len());
    for (x, y) in ta.iter().zip(&tb) {
        assert_eq!(x["step"], y["step"]);
        close(&x["loss"], &y["loss"], "train loss");
        close(&x["grad_norm"], &y["grad_norm"], "gradient norm");
        assert_eq!(x["accuracy"], y["accuracy"]);
    }
    for (x, y) in records(&a, "eval").iter().zip(&records(&b, "eval")) {
        close(&x["valid_loss"], &y["valid_loss"], "validation loss");
    }
    let report = |r: &std::path::Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(r.join("report.json")).unwrap()).unwrap()
    };
    let (sa, sb) = (
        report(&a)["state_bytes"].as_u64().unwrap(),
        report(&b)["state_bytes"].as_u64().unwrap(),
    );
    assert!(sb < sa, "micro-batch state {sb} vs batch state {sa}");
    std::fs::remove_dir_all(&dir).ok();
}
