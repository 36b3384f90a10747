//! Touch nothing outside the run, lose nothing inside it (issue 35, items 1-5, 9, 10's FIFOs
//! and 12): each test reproduces what once destroyed a user's files or a run and asserts that
//! it is now refused (and nothing changed), or, for a stop by signal, that nothing is lost.
//! Special files are only ever ones these tests create in their own temporary directories.

use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{
    assert_same_run, checkpoints, comera, comera_within, mkfifo, s, small_run, snapshot, tempdir,
    write_config, write_data,
};

/// A character device node like /dev/null (1, 3), made in the test's own directory; false
/// where this process may not make one (not root).
fn mknod_null(path: &Path) -> bool {
    let c = std::ffi::CString::new(s(path)).unwrap();
    // SAFETY: a NUL-terminated path.
    unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) == 0 }
}

/// Item 1: an export (or plot) over a device node, a FIFO or a symlink is refused, and the node
/// is still what it was.
#[test]
fn exports_never_replace_a_device_a_fifo_or_a_symlink() {
    let (dir, _, run) = small_run("special-targets");
    let device = dir.join("null-device");
    if mknod_null(&device) {
        for kind in ["--compressed", "--dense"] {
            let (code, text) = comera(&["export", s(&run), kind, s(&device)]);
            assert_eq!(code, 1, "{text}");
            assert!(text.contains("character device"), "{text}");
            let meta = std::fs::symlink_metadata(&device).unwrap();
            assert!(
                meta.file_type().is_char_device(),
                "{kind} replaced the device"
            );
        }
    }
    let fifo = dir.join("fifo");
    mkfifo(&fifo);
    let (code, text) = comera_within(
        &["export", s(&run), "--compressed", s(&fifo)],
        Duration::from_secs(60),
    );
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("FIFO"), "{text}");
    let (code, text) = comera_within(
        &["plot", s(&run), "--out", s(&fifo)],
        Duration::from_secs(60),
    );
    assert_eq!(code, 1, "{text}");
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    // A symlink to a file of the user's: neither the link nor its target is touched.
    let precious = dir.join("precious.txt");
    std::fs::write(&precious, b"keep me").unwrap();
    let link = dir.join("link.safetensors");
    std::os::unix::fs::symlink(&precious, &link).unwrap();
    let (code, text) = comera(&["export", s(&run), "--compressed", s(&link)]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("symbolic link"), "{text}");
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(std::fs::read(&precious).unwrap(), b"keep me");
    // No temporary file is left beside any of them.
    let left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Item 2: an --overwrite whose new run fails its checks (a batch larger than the data, a
/// missing init_from) leaves the previous run exactly as it was, usable.
#[test]
fn a_failing_overwrite_keeps_the_previous_run_whole() {
    let (dir, cfg, run) = small_run("failing-overwrite");
    let before = snapshot(&run);
    let text = std::fs::read_to_string(&cfg).unwrap();
    let big_batch = dir.join("big-batch.toml");
    std::fs::write(
        &big_batch,
        text.replace("batch_size = 8", "batch_size = 100000"),
    )
    .unwrap();
    let (code, out) = comera(&["train", "--config", s(&big_batch), "--quiet", "--overwrite"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("batch_size"), "{out}");
    assert_eq!(
        snapshot(&run),
        before,
        "the failed overwrite changed the run"
    );
    let (code, out) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--quiet",
        "--overwrite",
        "--init-from",
        s(&dir.join("missing")),
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("init_from"), "{out}");
    assert_eq!(
        snapshot(&run),
        before,
        "the failed overwrite changed the run"
    );
    let (code, out) = comera(&["eval", s(&run)]);
    assert_eq!(code, 0, "{out}");
    assert!(!run.join(".replaced-run").exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// Item 2, the kill: an --overwrite killed before the new run's first checkpoint gives the
/// directory back to the previous run when it is next opened.
#[test]
fn an_overwrite_killed_before_its_first_checkpoint_is_undone_on_the_next_open() {
    let (dir, cfg, run) = small_run("killed-overwrite");
    let before = snapshot(&run);
    // A run stopped by SIGKILL leaves the moved-aside run in place; simulate that state the
    // way the process leaves it: the old run's files in .replaced-run, a new config beside.
    let aside = run.join(".replaced-run");
    std::fs::create_dir(&aside).unwrap();
    for e in std::fs::read_dir(&run).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_owned();
        if name != ".lock" && name != ".replaced-run" {
            std::fs::rename(&p, aside.join(&name)).unwrap();
        }
    }
    std::fs::write(run.join("config.toml"), b"the new run's").unwrap();
    let (code, out) = comera(&["train", "--resume", s(&run), "--quiet"]);
    assert!(out.contains("previous run was restored"), "{out}");
    assert!(out.contains("finished"), "{out}");
    assert_eq!(code, 1, "{out}");
    assert_eq!(snapshot(&run), before);
    let _ = cfg;
    std::fs::remove_dir_all(&dir).ok();
}

/// Item 3: --overwrite of a directory that is not a verified comera run, or that holds files
/// comera did not write, is refused, lists what it would have deleted, and deletes nothing.
#[test]
fn overwrite_refuses_what_is_not_a_verified_run_and_lists_it() {
    let (dir, cfg, run) = small_run("not-a-run");
    // A user's project folder whose config is the one in use.
    let project = dir.join("project");
    std::fs::create_dir_all(project.join("data")).unwrap();
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace(s(&run), s(&project));
    std::fs::write(project.join("config.toml"), &text).unwrap();
    std::fs::write(project.join("notes.txt"), b"notes").unwrap();
    std::fs::write(project.join("data/train.tsv"), b"a\tb\n").unwrap();
    let before = snapshot(&project);
    let (code, out) = comera(&[
        "train",
        "--config",
        s(&project.join("config.toml")),
        "--quiet",
        "--overwrite",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("not a comera run"), "{out}");
    assert!(out.contains("notes.txt") && out.contains("data"), "{out}");
    assert_eq!(snapshot(&project), before);
    // A stray metrics.jsonl beside a thesis.
    let thesis = dir.join("thesis");
    std::fs::create_dir_all(&thesis).unwrap();
    std::fs::write(thesis.join("metrics.jsonl"), b"{}\n").unwrap();
    std::fs::write(thesis.join("thesis.tex"), b"years of work").unwrap();
    let before = snapshot(&thesis);
    let (code, out) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--quiet",
        "--overwrite",
        "--out",
        s(&thesis),
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("thesis.tex"), "{out}");
    assert_eq!(snapshot(&thesis), before);
    // A verified run with a file of the user's in it.
    std::fs::write(run.join("thesis.tex"), b"years of work").unwrap();
    let before = snapshot(&run);
    let (code, out) = comera(&["train", "--config", s(&cfg), "--quiet", "--overwrite"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("did not write (thesis.tex)"), "{out}");
    assert_eq!(snapshot(&run), before);
    // A run whose config.toml was edited does not verify.
    std::fs::remove_file(run.join("thesis.tex")).unwrap();
    std::fs::write(run.join("config.toml"), b"# edited\n").unwrap();
    let (code, out) = comera(&["train", "--config", s(&cfg), "--quiet", "--overwrite"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("does not match"), "{out}");
    // A dangling symlink as --out says what it is.
    let dangling = dir.join("dangling");
    std::os::unix::fs::symlink(dir.join("nowhere"), &dangling).unwrap();
    let (code, out) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--quiet",
        "--out",
        s(&dangling),
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("symbolic link"), "{out}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Item 4: `import hf --out` and `export --hf` respect a run directory: its lock, and no
/// writing into it without --overwrite (export --hf never); a user's folder is never written.
#[test]
fn import_and_export_hf_respect_runs_locks_and_users_folders() {
    let (dir, cfg, run) = small_run("hf-one-writer");
    let hf = dir.join("hf");
    let (code, out) = comera(&["export", s(&run), "--hf", s(&hf)]);
    assert_eq!(code, 0, "{out}");
    let before = snapshot(&run);
    // Into an existing run: refused without --overwrite.
    let (code, out) = comera(&[
        "import",
        "hf",
        s(&hf),
        "--out",
        s(&run),
        "--config",
        s(&cfg),
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("holds run"), "{out}");
    assert_eq!(snapshot(&run), before);
    // With --overwrite, but while another process holds the run's lock: refused.
    let lock = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(run.join(".lock"))
        .unwrap();
    lock.try_lock().unwrap();
    let (code, out) = comera(&[
        "import",
        "hf",
        s(&hf),
        "--out",
        s(&run),
        "--config",
        s(&cfg),
        "--overwrite",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("in use by another comera process"), "{out}");
    assert_eq!(snapshot(&run), before);
    drop(lock);
    // --overwrite replaces the run with the import: a run of its own that verifies.
    let (code, out) = comera(&[
        "import",
        "hf",
        s(&hf),
        "--out",
        s(&run),
        "--config",
        s(&cfg),
        "--overwrite",
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(run.join("run.toml").exists() && !run.join("checkpoints").exists());
    let (code, out) = comera(&["eval", s(&run)]);
    assert_eq!(code, 0, "{out}");
    // export --hf into a run directory (its own or another) is refused.
    let before = snapshot(&run);
    for args in [
        vec!["export", s(&run), "--hf", s(&run)],
        vec!["export", s(&run), "--hf", s(&run), "--overwrite"],
    ] {
        let (code, out) = comera(&args);
        assert_eq!(code, 1, "{out}");
        assert!(out.contains("is a comera run directory"), "{out}");
    }
    assert_eq!(snapshot(&run), before);
    // A user's folder with a config.json: refused, with or without --overwrite.
    let mine = dir.join("mine");
    std::fs::create_dir_all(&mine).unwrap();
    std::fs::write(mine.join("config.json"), b"{\"mine\": true}").unwrap();
    for extra in [None, Some("--overwrite")] {
        let mut args = vec!["export", s(&run), "--hf", s(&mine)];
        args.extend(extra);
        let (code, out) = comera(&args);
        assert_eq!(code, 1, "{out}");
        assert!(out.contains("config.json"), "{out}");
    }
    assert_eq!(
        std::fs::read(mine.join("config.json")).unwrap(),
        b"{\"mine\": true}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Item 5: an export over an earlier one is all or nothing: refused without --overwrite,
/// complete with it, and when it fails part-way (the file size limit, standing in for a full
/// disk) the earlier export is still whole and no temporary is left once comera runs again.
#[test]
fn an_hf_export_is_replaced_whole_or_not_at_all() {
    let (dir, cfg, run_a) = small_run("hf-whole");
    let run_b = dir.join("b");
    let (code, out) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--quiet",
        "--epochs",
        "1",
        "--seed",
        "9",
        "--out",
        s(&run_b),
    ]);
    assert_eq!(code, 0, "{out}");
    let (hf, fresh_b) = (dir.join("hf"), dir.join("fresh-b"));
    let (code, out) = comera(&["export", s(&run_a), "--hf", s(&hf)]);
    assert_eq!(code, 0, "{out}");
    let a_files = snapshot(&hf);
    let (code, out) = comera(&["export", s(&run_b), "--hf", s(&hf)]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("--overwrite"), "{out}");
    assert_eq!(snapshot(&hf), a_files);
    // Fails part-way: every file over 2 KiB is refused by the kernel (EFBIG).
    let out = Command::new(env!("CARGO_BIN_EXE_comera"))
        .args(["export", s(&run_b), "--hf", s(&hf), "--overwrite"])
        .stdin(Stdio::null())
        .env("COMERA_TEST", "1")
        .output_with_fsize_limit(2048);
    assert!(
        !out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        snapshot(&hf),
        a_files,
        "a failed export changed the earlier one"
    );
    // Complete with --overwrite: exactly what an export of B into a new directory holds.
    let (code, out) = comera(&["export", s(&run_b), "--hf", s(&hf), "--overwrite"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = comera(&["export", s(&run_b), "--hf", s(&fresh_b)]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(snapshot(&hf), snapshot(&fresh_b));
    let left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(left.is_empty(), "temporaries left: {left:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Runs a command with RLIMIT_FSIZE set (and SIGXFSZ ignored, so the limit is a write error).
trait OutputWithFsizeLimit {
    fn output_with_fsize_limit(&mut self, bytes: u64) -> std::process::Output;
}

impl OutputWithFsizeLimit for Command {
    fn output_with_fsize_limit(&mut self, bytes: u64) -> std::process::Output {
        use std::os::unix::process::CommandExt;
        // SAFETY: setrlimit and signal are async-signal-safe, called between fork and exec.
        unsafe {
            self.pre_exec(move || {
                let lim = libc::rlimit {
                    rlim_cur: bytes,
                    rlim_max: bytes,
                };
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        self.output().unwrap()
    }
}

/// Item 9: a model.toml edited after comera wrote it is refused by every reader.
#[test]
fn an_edited_model_toml_is_refused() {
    let (dir, _, run) = small_run("model-toml");
    let meta = run.join("model.toml");
    let text = std::fs::read_to_string(&meta).unwrap();
    assert!(text.contains("meta_sha256 = "), "{text}");
    let edited = text.replacen("threshold = ", "threshold = 0.999 #", 1);
    assert_ne!(edited, text, "model.toml names the gate threshold");
    std::fs::write(&meta, &edited).unwrap();
    for cmd in [
        vec!["eval", s(&run)],
        vec!["predict", s(&run), "a good dress"],
    ] {
        let (code, out) = comera(&cmd);
        assert_eq!(code, 1, "{out}");
        assert!(out.contains("model.toml does not match"), "{out}");
    }
    std::fs::write(&meta, &text).unwrap();
    let (code, out) = comera(&["eval", s(&run)]);
    assert_eq!(code, 0, "{out}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Item 10: a FIFO in place of the metrics log or of a checkpoint is refused (or skipped),
/// never waited on.
#[test]
fn a_fifo_in_the_run_directory_is_refused_not_waited_on() {
    let dir = tempdir("fifo-run");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 3");
    let run = dir.join("run");
    let (code, out) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--quiet",
        "--stop-after-steps",
        "2",
    ]);
    assert_eq!(code, 0, "{out}");
    // A FIFO named like the newest checkpoint: its header cannot be read, so it ranks below
    // the real one (and is never opened for its content).
    let fake = run.join("checkpoints/step-0000009999.safetensors");
    mkfifo(&fake);
    std::fs::remove_file(run.join("metrics.jsonl")).unwrap();
    mkfifo(&run.join("metrics.jsonl"));
    let limit = Duration::from_secs(60);
    let (code, out) = comera_within(&["train", "--resume", s(&run), "--quiet"], limit);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("metrics.jsonl") && out.contains("FIFO"),
        "{out}"
    );
    // With the log back as a file, the run resumes past the FIFO checkpoint.
    std::fs::remove_file(run.join("metrics.jsonl")).unwrap();
    std::fs::write(run.join("metrics.jsonl"), b"").unwrap();
    let (code, out) = comera_within(&["train", "--resume", s(&run), "--quiet"], limit);
    assert_eq!(code, 0, "{out}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Item 12: SIGINT (and SIGTERM) at random moments of a rank-adaptive run: the run exits with
/// 130 (143) after the step it was in, with a checkpoint at that step, and `--resume` ends with
/// the model of a run that was never interrupted, byte for byte. Ten random points, as the kill
/// test does.
#[test]
fn sigint_at_random_steps_stops_with_a_checkpoint_and_resumes_bit_identically() {
    let dir = tempdir("sigint");
    // A larger data set and model than the other tests, so that steps take a fair share of
    // the run's time and the signals land inside epochs as well as at their ends.
    let (_, vocab) = write_data(&dir);
    let words = [
        "the", "a", "dress", "shirt", "fit", "color", "is", "was", "very",
    ];
    let mut tsv = String::from("sentence\tlabel\n");
    for i in 0..1200usize {
        let key = if i % 2 == 0 {
            ["good", "great"][i % 3 % 2]
        } else {
            ["bad", "awful"][i % 3 % 2]
        };
        let w = |k: usize| words[(i * k + k) % words.len()];
        tsv += &format!(
            "{} {key} {} {}\t{}\n",
            w(1),
            w(7),
            w(5),
            if i % 2 == 0 { "pos" } else { "neg" }
        );
    }
    let data = dir.join("big.tsv");
    std::fs::write(&data, tsv).unwrap();
    let extra = "\n[rank]\nlate_after_epochs = 1\ntarget_ratio = 0.5\ntarget_loss = 0.2\ntruncate_every = 3";
    let cfg = write_config(&dir, &data, &vocab, true, extra);
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("lr_gates = 0.01", "lr_gates = 0.1")
        .replace("d_model = 16", "d_model = 64")
        .replace("heads = 2", "heads = 4")
        .replace("ffn = 32", "ffn = 256")
        .replace("seq_len = 8", "seq_len = 32")
        .replace("batch_size = 8", "batch_size = 16")
        .replace(
            "in_modes = [4, 4], out_modes = [4, 4]",
            "in_modes = [8, 8], out_modes = [8, 8]",
        )
        .replace(
            "in_modes = [4, 4], out_modes = [4, 8]",
            "in_modes = [8, 8], out_modes = [16, 16]",
        )
        .replace(
            "in_modes = [4, 8], out_modes = [4, 4]",
            "in_modes = [16, 16], out_modes = [8, 8]",
        )
        .replace("dim_modes = [4, 4]", "dim_modes = [8, 8]");
    std::fs::write(&cfg, text).unwrap();
    let train = |out: &Path| -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_comera"));
        c.args([
            "--threads",
            "2",
            "train",
            "--config",
            s(&cfg),
            "--epochs",
            "6",
            "--quiet",
            "--out",
            s(out),
        ]);
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    };
    let whole = dir.join("whole");
    let out = train(&whole).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let steps_per_epoch = 1200 * 3 / 4 / 16;
    // xorshift64: the signal moments, reproducible.
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut inside_epochs = 0;
    // At least 10 signals; more (up to 40) until two of them have stopped a run inside an
    // epoch: where a signal lands depends on how long the steps take against the epoch ends'
    // evaluation and checkpoint on this machine, and a fixed count made the test flaky.
    for k in 0..40 {
        if k >= 10 && inside_epochs >= 2 {
            break;
        }
        let run = dir.join(format!("run-{k}"));
        let (signal, status) = if k % 5 == 4 {
            (libc::SIGTERM, 143)
        } else {
            (libc::SIGINT, 130)
        };
        let child = train(&run).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(150 + next() % 700));
        let t_signal = Instant::now();
        // SAFETY: signalling our own child process.
        assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
        let out = child.wait_with_output().unwrap();
        let waited = t_signal.elapsed();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        if out.status.success() {
            // The signal came after the run's end: nothing to check at this point.
            assert_eq!(
                snapshot(&run).get(Path::new("model.safetensors")),
                snapshot(&whole).get(Path::new("model.safetensors"))
            );
            continue;
        }
        assert_eq!(out.status.code(), Some(status), "{text}");
        assert!(
            waited < Duration::from_secs(10),
            "took {waited:?} to stop: {text}"
        );
        let step: u64 = text
            .split("after step ")
            .nth(1)
            .and_then(|t| t.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no stop line: {text}"));
        assert!(
            text.contains(&format!("resume with: comera train --resume {}", s(&run))),
            "{text}"
        );
        let newest = checkpoints(&run).pop().expect("a checkpoint");
        assert_eq!(
            newest.file_name().unwrap().to_string_lossy(),
            format!("step-{step:010}.safetensors"),
            "the checkpoint is at the step the run stopped after"
        );
        inside_epochs += usize::from(!step.is_multiple_of(steps_per_epoch as u64));
        let (code, text) = comera(&["--threads", "2", "train", "--resume", s(&run), "--quiet"]);
        assert_eq!(code, 0, "{text}");
        assert_same_run(&whole, &run, &["train", "eval", "truncate", "stage"]);
    }
    assert!(
        inside_epochs >= 2,
        "only {inside_epochs} stops inside an epoch"
    );
    std::fs::remove_dir_all(&dir).ok();
}
