//! A run directory under attack: each test reproduces one way a run could be corrupted or
//! mixed up (another run's checkpoint, two writers, flipped bytes, damaged model files,
//! oversize configs, kills at random moments) and asserts the refusal or the correct result.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::common::{
    assert_same_run, checkpoints, comera, records, tempdir, write_config, write_data,
};

/// `comera train --config CFG --quiet --epochs N` plus `extra` arguments.
fn train(cfg: &Path, epochs: &str, extra: &[&str]) -> (i32, String) {
    let base = [
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--quiet",
        "--epochs",
        epochs,
    ];
    comera(&[&base[..], extra].concat())
}

fn resume(run: &Path) -> (i32, String) {
    comera(&["train", "--resume", run.to_str().unwrap(), "--quiet"])
}

/// The run id in `run/run.toml`.
fn run_id(run: &Path) -> String {
    let text = std::fs::read_to_string(run.join("run.toml")).unwrap();
    let line = text.lines().find(|l| l.starts_with("id = ")).unwrap();
    line.trim_start_matches("id = ")
        .trim_matches('"')
        .to_string()
}

/// A small run and a second one of the same config with another seed in `other`.
fn two_runs(tag: &str) -> (PathBuf, PathBuf, PathBuf, PathBuf) {
    let dir = tempdir(tag);
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 3");
    let (run, other) = (dir.join("run"), dir.join("other"));
    let (code, text) = train(&cfg, "1", &[]);
    assert_eq!(code, 0, "{text}");
    let (code, text) = train(
        &cfg,
        "1",
        &["--seed", "7", "--out", other.to_str().unwrap()],
    );
    assert_eq!(code, 0, "{text}");
    (dir, cfg, run, other)
}

#[test]
fn a_checkpoint_of_another_run_is_refused_naming_both_runs() {
    let (dir, _, run, other) = two_runs("foreign");
    let metrics = std::fs::read(run.join("metrics.jsonl")).unwrap();
    // Under a higher step than any of the run's own.
    let foreign = checkpoints(&other).pop().unwrap();
    std::fs::copy(
        &foreign,
        run.join("checkpoints/step-0000009999.safetensors"),
    )
    .unwrap();
    let (code, text) = resume(&run);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("refusing a checkpoint of another run"),
        "{text}"
    );
    assert!(
        text.contains(&run_id(&run)) && text.contains(&run_id(&other)),
        "{text}"
    );
    assert_eq!(
        std::fs::read(run.join("metrics.jsonl")).unwrap(),
        metrics,
        "log untouched"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_non_empty_run_directory_is_refused_unless_overwritten() {
    let (dir, cfg, run, _) = two_runs("nonempty");
    let id = run_id(&run);
    let (code, text) = train(&cfg, "1", &[]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains(&format!("holds run {id}")), "{text}");
    assert!(
        text.contains("--resume") && text.contains("--overwrite"),
        "{text}"
    );
    // --overwrite replaces the run: a new id, none of the old checkpoints.
    let old: Vec<PathBuf> = checkpoints(&run);
    std::fs::write(run.join("checkpoints/step-0000000999.safetensors"), b"old").unwrap();
    let (code, text) = train(&cfg, "1", &["--overwrite"]);
    assert_eq!(code, 0, "{text}");
    assert_ne!(run_id(&run), id);
    assert!(!run.join("checkpoints/step-0000000999.safetensors").exists());
    assert_eq!(checkpoints(&run).len(), old.len());
    // A directory that holds something other than a run is never cleared.
    let precious = dir.join("precious");
    std::fs::create_dir_all(&precious).unwrap();
    std::fs::write(precious.join("thesis.tex"), b"years of work").unwrap();
    let (code, text) = train(
        &cfg,
        "1",
        &["--overwrite", "--out", precious.to_str().unwrap()],
    );
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("not a comera run"), "{text}");
    assert!(precious.join("thesis.tex").exists());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn two_writers_of_one_directory_one_is_refused() {
    let dir = tempdir("writers");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 6");
    let run = dir.join("run");
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_comera"))
            .args([
                "train",
                "--config",
                cfg.to_str().unwrap(),
                "--quiet",
                "--epochs",
                "2",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (a, b) = (spawn(), spawn());
    let outs = [a.wait_with_output().unwrap(), b.wait_with_output().unwrap()];
    let ok = outs.iter().filter(|o| o.status.success()).count();
    assert_eq!(ok, 1, "exactly one writer succeeds");
    let refused = outs.iter().find(|o| !o.status.success()).unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{err}");
    assert!(
        err.contains("in use by another comera process (pid") || err.contains("holds run"),
        "{err}"
    );
    // The log is one run's, every line whole.
    let log = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    for line in log.lines() {
        serde_json::from_str::<serde_json::Value>(line).expect("a whole JSON line");
    }
    assert_eq!(records(&run, "eval").len(), 2);
    // A held lock refuses a writer, naming the holder.
    let lock = std::fs::OpenOptions::new()
        .write(true)
        .open(run.join(".lock"))
        .unwrap();
    lock.try_lock().unwrap();
    let (code, text) = resume(&run);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("in use by another comera process"), "{text}");
    drop(lock);
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
            replace("\"version\":\"3\"", "\"version\":\"7\""),
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
        assert_eq!(code, 1, "{what}: {text}");
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
        assert_eq!(code, 1, "{what}: resume must refuse: {text}");
        assert!(text.contains(expect), "{what}: {text}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn damaged_or_swapped_model_files_are_refused() {
    let (dir, _, run, other) = two_runs("model-files");
    let weights = run.join("model.safetensors");
    let good = std::fs::read(&weights).unwrap();
    let eval = || comera(&["eval", run.to_str().unwrap()]);
    // A flipped exponent bit in the last weight (a NaN or a huge value).
    let mut bad = good.clone();
    let n = bad.len();
    bad[n - 1] ^= 0x7f;
    std::fs::write(&weights, &bad).unwrap();
    let (code, text) = eval();
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("content hash mismatch") && text.contains("model.safetensors"),
        "{text}"
    );
    let (code, text) = comera(&["predict", run.to_str().unwrap(), "good fit"]);
    assert_eq!(code, 1, "{text}");
    // Another model's weights (other seed, same shapes) beside this model.toml.
    std::fs::copy(other.join("model.safetensors"), &weights).unwrap();
    let (code, text) = eval();
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("not the ones model.toml names"), "{text}");
    // Another run's model files, both.
    std::fs::copy(other.join("model.toml"), run.join("model.toml")).unwrap();
    let (code, text) = eval();
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("belong to another run"), "{text}");
    assert!(!text.contains("panicked"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn oversize_settings_exit_1_naming_the_fields() {
    let dir = tempdir("oversize");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 2");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let cases = [
        ("layers = 1\n", "layers = 1000000000\n", "model.layers"),
        ("seq_len = 8\n", "seq_len = 100000000\n", "model.seq_len"),
        (
            "batch_size = 8\n",
            "batch_size = 1000000000000\n",
            "train.batch_size",
        ),
        (
            "dropout = 0.0\n",
            "dropout = 0.0\nthreshold = 1.0\n",
            "model.threshold",
        ),
        (
            "dropout = 0.0\n",
            "dropout = 0.0\nthreshold = 0.0\n",
            "model.threshold",
        ),
    ];
    for (from, to, field) in cases {
        assert!(text.contains(from), "{from}");
        let p = dir.join("bad.toml");
        std::fs::write(&p, text.replace(from, to)).unwrap();
        let (code, out) = comera(&["train", "--config", p.to_str().unwrap(), "--quiet"]);
        assert_eq!(code, 1, "{to}: {out}");
        assert!(out.contains(field), "{to}: expected `{field}` in {out}");
        assert!(!out.contains("memory allocation"), "{to}: {out}");
    }
    assert!(!dir.join("run").exists(), "nothing was created");
    // An evaluation batch larger than the data is clamped to it.
    let (code, out) = comera(&[
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--quiet",
        "--epochs",
        "1",
    ]);
    assert_eq!(code, 0, "{out}");
    let run = dir.join("run");
    let (code, out) = comera(&["eval", run.to_str().unwrap(), "--batch-size", "100000000"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = comera(&["eval", run.to_str().unwrap(), "--batch-size", "0"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("--batch-size"), "{out}");
    // A rank beyond what the shape supports is not an error: it is capped, with a warning
    // naming the field (a run directory of its own).
    let p = dir.join("rank.toml");
    let capped = text
        .replace(
            "attn_tt = { in_modes = [4, 4], out_modes = [4, 4], rank = 3 }",
            "attn_tt = { in_modes = [4, 4], out_modes = [4, 4], rank = 100000 }",
        )
        .replace(
            &run.to_str().unwrap().to_string(),
            dir.join("run-rank").to_str().unwrap(),
        );
    assert!(capped.contains("rank = 100000") && capped.contains("run-rank"));
    std::fs::write(&p, capped).unwrap();
    let (code, out) = comera(&[
        "train",
        "--config",
        p.to_str().unwrap(),
        "--quiet",
        "--epochs",
        "1",
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("model.attn_tt.rank = 100000 exceeds") && out.contains("capped to 16"),
        "{out}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_finished_run_says_so_and_writes_nothing() {
    let (dir, _, run, _) = two_runs("finished");
    let before: Vec<Vec<u8>> = ["metrics.jsonl", "ranks.md", "report.json"]
        .iter()
        .map(|f| std::fs::read(run.join(f)).unwrap_or_default())
        .collect();
    for _ in 0..2 {
        let (code, text) = resume(&run);
        assert_eq!(code, 1, "{text}");
        assert!(text.contains("the run finished"), "{text}");
    }
    let after: Vec<Vec<u8>> = ["metrics.jsonl", "ranks.md", "report.json"]
        .iter()
        .map(|f| std::fs::read(run.join(f)).unwrap_or_default())
        .collect();
    assert!(before == after, "a finished run's files changed");
    // A new epoch count is refused with --resume, not ignored.
    let (code, text) = comera(&["train", "--resume", run.to_str().unwrap(), "--epochs", "3"]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("cannot be used with"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn stale_temporaries_are_removed_when_the_directory_is_opened() {
    let dir = tempdir("stale");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 3");
    let run = dir.join("run");
    let (code, text) = train(&cfg, "2", &["--stop-after-steps", "2"]);
    assert_eq!(code, 0, "{text}");
    // What a killed writer leaves (pid 4000000 is above Linux's pid_max: no such process).
    let stale = [
        run.join(".metrics.jsonl.tmp-4000000"),
        run.join(".model.safetensors.tmp-4000000"),
        run.join("checkpoints/.step-0000000003.safetensors.tmp-4000000"),
    ];
    for s in &stale {
        std::fs::write(s, b"half written").unwrap();
    }
    let (code, text) = resume(&run);
    assert_eq!(code, 0, "{text}");
    for s in &stale {
        assert!(!s.exists(), "{} left behind", s.display());
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `inspect RUN` on a run stopped before it wrote model files shows its newest checkpoint.
#[test]
fn inspecting_a_run_without_model_files_shows_its_newest_checkpoint() {
    let dir = tempdir("inspect-stopped");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "checkpoint_every = 2");
    let run = dir.join("run");
    let (code, text) = train(&cfg, "2", &["--stop-after-steps", "5"]);
    assert_eq!(code, 0, "{text}");
    assert!(!run.join("model.toml").exists());
    let (code, text) = comera(&["inspect", run.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("no model files yet"), "{text}");
    assert!(text.contains("step-0000000005.safetensors"), "{text}");
    assert!(text.contains("progress   step 5,"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Checkpoints every 4 steps, the newest 3 kept; 15 steps an epoch.
const EVERY_4: &str = "checkpoint_every = 4\nkeep_checkpoints = 3";

#[test]
fn a_damaged_newest_checkpoint_is_skipped_and_a_renamed_one_ranked_by_its_content() {
    let dir = tempdir("fallback");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, EVERY_4);
    let (a, b) = (dir.join("a"), dir.join("b"));
    let (code, text) = train(&cfg, "2", &["--out", a.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    let (code, text) = train(
        &cfg,
        "2",
        &["--out", b.to_str().unwrap(), "--stop-after-steps", "22"],
    );
    assert_eq!(code, 0, "{text}");
    let ck = |s: u64| b.join(format!("checkpoints/step-{s:010}.safetensors"));
    assert!(ck(16).exists() && ck(20).exists() && ck(22).exists());
    // The newest is damaged; an older one is renamed to look newest.
    let mut newest = std::fs::read(ck(22)).unwrap();
    let n = newest.len();
    newest[n - 1] ^= 0x01;
    std::fs::write(ck(22), newest).unwrap();
    std::fs::copy(ck(16), ck(99)).unwrap();
    let (code, text) = resume(&b);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("skip") && text.contains("step-0000000022") && text.contains("hash mismatch"),
        "{text}"
    );
    assert!(
        text.contains("step-0000000020.safetensors (step 20)"),
        "{text}"
    );
    assert_same_run(&a, &b, &["train", "eval"]);
    // Rotation goes by content too: the renamed step-16 checkpoint is gone.
    assert!(!ck(99).exists(), "{:?}", checkpoints(&b));
    std::fs::remove_dir_all(&dir).ok();
}

/// A rank-adaptive run killed (SIGKILL) 20 times at random moments, some inside checkpoint
/// writes, and continued each time, ends with the model and metrics records of a run that was
/// never interrupted, and no temporary file.
#[test]
fn twenty_kills_at_random_moments_change_nothing() {
    let dir = tempdir("kills");
    let (data, vocab) = write_data(&dir);
    let extra = "checkpoint_every = 1\nkeep_checkpoints = 2\n\n[rank]\nlate_after_epochs = 1\ntarget_ratio = 0.5\ntarget_loss = 0.2\ntruncate_every = 3";
    let cfg = write_config(&dir, &data, &vocab, true, extra);
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replace("lr_gates = 0.01", "lr_gates = 0.1")).unwrap();
    let cfg = cfg.to_str().unwrap();
    let (a, b) = (dir.join("a"), dir.join("b"));
    let fresh = |out: &Path| -> Vec<String> {
        [
            "--threads",
            "2",
            "train",
            "--config",
            cfg,
            "--epochs",
            "10",
            "--quiet",
            "--overwrite",
            "--out",
            out.to_str().unwrap(),
        ]
        .map(String::from)
        .to_vec()
    };
    let (code, out) = comera(&fresh(&a).iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "{out}");
    assert!(!records(&a, "truncate").is_empty(), "the run truncates");
    let temporaries = |run: &Path| -> Vec<String> {
        [run.to_path_buf(), run.join("checkpoints")]
            .iter()
            .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp-"))
            .collect()
    };
    // xorshift64: the kill moments, reproducible.
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut kills, mut in_writes) = (0, 0);
    loop {
        let resumable = checkpoints(&b).iter().any(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("step-")
        });
        let args = if resumable {
            [
                "--threads",
                "2",
                "train",
                "--resume",
                b.to_str().unwrap(),
                "--quiet",
            ]
            .map(String::from)
            .to_vec()
        } else {
            fresh(&b)
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_comera"))
            .args(&args)
            // Slow checkpoint writes, so that kills land inside them.
            .env("COMERA_TEST_CHECKPOINT_DELAY_MS", "40")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        if kills == 20 {
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            break;
        }
        if kills % 4 == 3 {
            // Inside a checkpoint write: once its temporary file exists.
            let t0 = std::time::Instant::now();
            while temporaries(&b).is_empty()
                && t0.elapsed().as_secs() < 20
                && child.try_wait().unwrap().is_none()
            {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            in_writes += usize::from(!temporaries(&b).is_empty());
        } else {
            std::thread::sleep(std::time::Duration::from_millis(30 + next() % 250));
        }
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            panic!(
                "the run ended ({status}) before kill {}: {}",
                kills + 1,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        child.kill().unwrap();
        child.wait().unwrap();
        kills += 1;
    }
    assert!(
        in_writes >= 4,
        "only {in_writes} kills inside checkpoint writes"
    );
    assert_same_run(&a, &b, &["train", "eval", "truncate", "stage", "ranks"]);
    assert!(temporaries(&b).is_empty(), "{:?}", temporaries(&b));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn errors_name_what_is_wrong_and_predict_output_stays_one_line_per_input() {
    let dir = tempdir("errors");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 3");
    let text = std::fs::read_to_string(&cfg).unwrap();
    for (from, to, expect) in [
        ("seq_len = 8\n", "seq_len = 1\n", "model.seq_len"),
        (
            "dropout = 0.0\n",
            "dropout = 0.0\ninit_std = 1e30\n",
            "model.init_std",
        ),
    ] {
        let p = dir.join("bad.toml");
        std::fs::write(&p, text.replace(from, to)).unwrap();
        let (code, out) = comera(&[
            "train",
            "--config",
            p.to_str().unwrap(),
            "--quiet",
            "--out",
            dir.join("bad").to_str().unwrap(),
        ]);
        assert_eq!(code, 1, "{to}: {out}");
        assert!(out.contains(expect), "{to}: expected `{expect}` in {out}");
        assert!(!out.contains("lower the learning rates"), "{to}: {out}");
    }
    let (code, out) = train(&cfg, "1", &[]);
    assert_eq!(code, 0, "{out}");
    let run = dir.join("run");
    // stdin: a good line, a non-UTF-8 line, an empty line, a line with a tab and an escape code.
    let mut child = Command::new(env!("CARGO_BIN_EXE_comera"))
        .args(["predict", run.to_str().unwrap()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin
            .write_all(b"good fit\n\xff\xfe bad\n\nawful\tcolor\x1b[31m\n")
            .unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert!(lines[0].ends_with("\tgood fit"), "{stdout}");
    assert!(lines[1].ends_with("\tawful\\tcolor\\u{1b}[31m"), "{stdout}");
    assert_eq!(lines[1].split('\t').count(), 3, "{stdout}");
    assert!(stderr.contains("line 2: not UTF-8"), "{stderr}");
    assert!(stderr.contains("input 3: empty text"), "{stderr}");
    // A reader that goes away ends the output quietly (no broken-pipe panic).
    let mut child = Command::new(env!("CARGO_BIN_EXE_comera"))
        .args(["inspect", run.to_str().unwrap(), "--tensors"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    let (code, out) = comera(&["inspect", dir.join("nothing-here").to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("no such file or directory"), "{out}");
    std::fs::remove_dir_all(&dir).ok();
}
