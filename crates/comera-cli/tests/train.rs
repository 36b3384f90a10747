//! `comera train`, `eval`, `predict` end to end on a small data set the test writes itself
//! (no network), and clear errors for bad configs and data.

use std::path::{Path, PathBuf};
use std::process::Command;

mod common;
use common::{comera, every_command_works_on, records, tempdir, untimed};

const WORDS: &[&str] = &[
    "the", "a", "dress", "shirt", "fit", "color", "is", "was", "very",
];

/// A sentiment-like TSV: "good"/"great" mean pos, "bad"/"awful" mean neg, among filler words.
fn write_data(dir: &Path) -> (PathBuf, PathBuf) {
    let vocab = dir.join("vocab.txt");
    let mut v = vec![
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "great", "bad", "awful",
    ];
    v.extend_from_slice(WORDS);
    std::fs::write(&vocab, v.join("\n") + "\n").unwrap();
    let mut tsv = String::from("sentence\tlabel\n");
    for i in 0..160usize {
        let pos = i % 2 == 0;
        let key = if pos {
            ["good", "great"][i % 3 % 2]
        } else {
            ["bad", "awful"][i % 3 % 2]
        };
        let f1 = WORDS[i % WORDS.len()];
        let f2 = WORDS[(i * 7 + 3) % WORDS.len()];
        let sentence = match i % 3 {
            0 => format!("{f1} {key} {f2}"),
            1 => format!("{key} {f1} {f2} {f1}"),
            _ => format!("{f2} {f1} {key}"),
        };
        tsv += &format!("{sentence}\t{}\n", if pos { "pos" } else { "neg" });
    }
    let data = dir.join("train.tsv");
    std::fs::write(&data, tsv).unwrap();
    (data, vocab)
}

fn write_config(dir: &Path, data: &Path, vocab: &Path, tt: bool, extra: &str) -> PathBuf {
    let cfg = format!(
        r#"
[data]
source = "tsv"
train = "{data}"
text_a = "sentence"
label = "label"
labels = ["neg", "pos"]
vocab = "{vocab}"
valid_fraction = 0.25

[model]
vocab_size = 18
seq_len = 8
d_model = 16
heads = 2
ffn = 32
layers = 1
dropout = 0.0
tt_linear = {tt}
ttm_embedding = {tt}
attn_tt = {{ in_modes = [4, 4], out_modes = [4, 4], rank = 3 }}
ffn_up_tt = {{ in_modes = [4, 4], out_modes = [4, 8], rank = 3 }}
ffn_down_tt = {{ in_modes = [4, 8], out_modes = [4, 4], rank = 3 }}
word_ttm = {{ vocab_modes = [3, 6], dim_modes = [4, 4], rank = 3 }}

[optim]
lr_cores = 0.01
lr_gates = 0.01
lr_other = 0.01

[train]
epochs = 6
batch_size = 8
warmup_steps = 5
log_every = 5
out_dir = "{out}"
{extra}
"#,
        data = data.display(),
        vocab = vocab.display(),
        out = dir.join("run").display()
    );
    let path = dir.join("run.toml");
    std::fs::write(&path, cfg).unwrap();
    path
}

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
        std::fs::remove_dir_all(&dir).ok();
    }
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

fn checkpoints(run: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(run.join("checkpoints"))
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Rank-adaptive settings that make a short run switch stage and truncate.
const RANK_EXTRA: &str = "checkpoint_every = 4\nkeep_checkpoints = 2\n\n[rank]\nlate_after_epochs = 1\ntarget_ratio = 0.5\ntarget_loss = 0.2\ntruncate_every = 3";

#[test]
fn a_stopped_and_resumed_run_matches_an_uninterrupted_one_bit_for_bit() {
    resume_matches("resume", true, RANK_EXTRA, true);
}

#[test]
fn a_resumed_galore_run_matches_an_uninterrupted_one_bit_for_bit() {
    // Projections refreshed every 5 steps: the stop at 22 falls between refreshes.
    let extra =
        "checkpoint_every = 4\nkeep_checkpoints = 2\n\n[galore]\nrank = 4\nupdate_every = 5";
    resume_matches("resume-galore", false, extra, false);
}

/// Runs the same config uninterrupted and stopped at step 22 then resumed; the records and
/// final weights must be identical (`rank`: the run must also switch stage and truncate).
fn resume_matches(tag: &str, tt: bool, extra: &str, rank: bool) {
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
        "2",
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
    for kind in ["train", "eval", "truncate", "stage"] {
        assert_eq!(
            untimed(records(&a, kind)),
            untimed(records(&b, kind)),
            "{kind} records differ after resume"
        );
    }
    assert!(
        std::fs::read(a.join("model.safetensors")).unwrap()
            == std::fs::read(b.join("model.safetensors")).unwrap(),
        "final weights differ after resume"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_kill_during_a_checkpoint_write_leaves_the_previous_one_resumable() {
    let dir = tempdir("kill");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "checkpoint_every = 3");
    let run = dir.join("run");
    let mut child = Command::new(env!("CARGO_BIN_EXE_comera"))
        .args([
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--epochs",
            "2",
            "--quiet",
        ])
        .env("COMERA_TEST_CHECKPOINT_DELAY_MS", "2000")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Wait for a finished checkpoint and the next one's temporary file, then SIGKILL.
    let t0 = std::time::Instant::now();
    let temp_seen = loop {
        let names: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        let done = names.iter().any(|n| n.starts_with("step-"));
        let temp = names.iter().any(|n| n.contains(".tmp-"));
        if done && temp {
            break true;
        }
        if t0.elapsed().as_secs() > 120 || child.try_wait().unwrap().is_some() {
            break false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(temp_seen, "never saw a checkpoint being written");
    let done = checkpoints(&run)
        .into_iter()
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("step-")
        })
        .collect::<Vec<_>>();
    assert!(!done.is_empty());
    for ck in &done {
        let (code, text) = comera(&["inspect", ck.to_str().unwrap()]);
        assert_eq!(code, 0, "{}: {text}", ck.display());
    }
    let (code, text) = comera(&["train", "--resume", run.to_str().unwrap(), "--quiet"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("done: 2 epochs"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn corrupt_truncated_or_foreign_checkpoints_are_refused_by_name() {
    let dir = tempdir("corrupt");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "");
    let run = dir.join("run");
    let (code, text) = comera(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--epochs",
        "1",
        "--quiet",
    ]);
    assert_eq!(code, 0, "{text}");
    let ck = checkpoints(&run)
        .pop()
        .expect("a checkpoint at the epoch's end");
    let good = std::fs::read(&ck).unwrap();
    let (code, text) = comera(&["inspect", ck.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("step 15"), "{text}");
    let replace = |from: &str, to: &str| -> Vec<u8> {
        let s = String::from_utf8_lossy(&good).into_owned();
        assert!(s.contains(from), "{from} not in the header");
        let i = good
            .windows(from.len())
            .position(|w| w == from.as_bytes())
            .unwrap();
        let mut b = good.clone();
        b[i..i + from.len()].copy_from_slice(to.as_bytes());
        b
    };
    let mut flipped = good.clone();
    *flipped.last_mut().unwrap() ^= 0x40;
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "truncated",
            good[..good.len() / 2].to_vec(),
            "truncated or corrupt",
        ),
        ("empty", Vec::new(), "truncated or corrupt"),
        ("flipped data byte", flipped, "hash mismatch"),
        (
            "wrong version",
            replace("\"version\":\"2\"", "\"version\":\"7\""),
            "version 7",
        ),
        (
            "wrong format",
            replace("comera-checkpoint", "other-checkpoint!"),
            "format",
        ),
        // The hash covers the metadata: a changed model shape or step is caught.
        (
            "foreign model",
            replace("seq_len = 8", "seq_len = 9"),
            "hash mismatch",
        ),
        (
            "flipped step",
            replace("\\\"step\\\":15", "\\\"step\\\":95"),
            "hash mismatch",
        ),
    ];
    for (what, bytes, expect) in cases {
        std::fs::write(&ck, &bytes).unwrap();
        let (code, text) = comera(&["inspect", ck.to_str().unwrap()]);
        assert_eq!(code, 2, "{what}: {text}");
        assert!(
            text.contains(expect),
            "{what}: expected `{expect}` in: {text}"
        );
        assert!(
            text.contains(&*ck.file_name().unwrap().to_string_lossy()),
            "{what}: {text}"
        );
        assert!(!text.contains("panicked"), "{what}: {text}");
        let (code, text) = comera(&["train", "--resume", run.to_str().unwrap(), "--quiet"]);
        assert_eq!(code, 2, "{what}: resume must refuse: {text}");
        assert!(text.contains(expect), "{what}: {text}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_run_directory_has_one_writer_one_config_and_no_stale_temporaries() {
    let dir = tempdir("trust");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 3");
    let run = dir.join("run");
    let train = |extra: &[&str]| {
        comera(
            &[
                &[
                    "train",
                    "--config",
                    cfg.to_str().unwrap(),
                    "--quiet",
                    "--epochs",
                    "1",
                ][..],
                extra,
            ]
            .concat(),
        )
    };
    // A temporary file of a process that no longer runs is removed when the run starts.
    std::fs::create_dir_all(&run).unwrap();
    let stale = run.join(".metrics.jsonl.tmp-4000000");
    std::fs::write(&stale, b"half written").unwrap();
    let (code, text) = train(&[]);
    assert_eq!(code, 0, "{text}");
    assert!(!stale.exists(), "stale temporary left behind");
    // Resuming a finished run says so.
    let (code, text) = comera(&["train", "--resume", run.to_str().unwrap(), "--quiet"]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("the run finished"), "{text}");
    // A checkpoint of another run (other seed) dropped in under a higher step is refused.
    let other = dir.join("other");
    let (code, text) = train(&["--seed", "7", "--out", other.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    let foreign = checkpoints(&other).pop().unwrap();
    std::fs::copy(
        &foreign,
        run.join("checkpoints/step-0000009999.safetensors"),
    )
    .unwrap();
    let (code, text) = comera(&["train", "--resume", run.to_str().unwrap(), "--quiet"]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("another config"), "{text}");
    // A second writer is refused while the directory is locked.
    let lock = std::fs::OpenOptions::new()
        .write(true)
        .open(run.join(".lock"))
        .unwrap();
    lock.try_lock().unwrap();
    let (code, text) = train(&[]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("in use by another comera process"), "{text}");
    drop(lock);
    std::fs::remove_dir_all(&dir).ok();
}
