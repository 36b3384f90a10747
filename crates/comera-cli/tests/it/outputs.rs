//! Every output refuses to replace what comera did not write, every input is applied or
//! refused (issue 47): each test reproduces an input that once lost data, was silently ignored
//! or aborted, and asserts that it is now refused with a clear error (and nothing changed), or
//! gives the right result.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::common::{
    comera, comera_within, mkfifo, s, small_run, snapshot, tempdir, write_config, write_data,
};

/// The small run's config with no label set: the labels are the values found in the data.
fn config_finding_labels(tag: &str) -> (PathBuf, PathBuf) {
    let dir = tempdir(tag);
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 2");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let without = text.replace("labels = [\"neg\", \"pos\"]\n", "");
    assert_ne!(text, without, "the config names no labels to take out");
    std::fs::write(&cfg, without).unwrap();
    (dir, cfg)
}

fn assert_refused(code: i32, text: &str, wanted: &str, case: &str) {
    assert_eq!(code, 1, "{case}: {text}");
    assert!(text.contains("error: "), "{case}: {text}");
    assert!(
        text.contains(wanted),
        "{case}: expected `{wanted}` in: {text}"
    );
}

/// Items 1 and 3: `export --dense/--compressed` never writes into a run directory (with or
/// without --overwrite), replaces only an earlier comera export and only with --overwrite,
/// never writes through a link, and two outputs of one command may not share a path.
#[test]
fn file_exports_replace_only_comera_exports_and_never_a_runs_files() {
    let (dir, _, run) = small_run("outputs-export");
    let other = dir.join("other");
    std::fs::create_dir(&other).unwrap();
    let before = snapshot(&run);
    let hf = dir.join("hf");
    let (code, text) = comera(&["export", s(&run), "--hf", s(&hf)]);
    assert_eq!(code, 0, "{text}");
    let hf_before = snapshot(&hf);
    let mut targets: Vec<PathBuf> = before.keys().map(|k| run.join(k)).collect();
    targets.push(run.join("new.safetensors"));
    targets.push(run.join("checkpoints/new.safetensors"));
    targets.push(hf.join("model.safetensors"));
    for target in &targets {
        for flag in ["--dense", "--compressed"] {
            for overwrite in [false, true] {
                let mut args = vec!["export", s(&run), flag, s(target)];
                if overwrite {
                    args.push("--overwrite");
                }
                let (code, text) = comera(&args);
                assert_eq!(code, 1, "{args:?}: {text}");
                assert!(text.contains(flag), "{args:?}: {text}");
            }
        }
    }
    assert_eq!(snapshot(&run), before, "the run's files changed");
    assert_eq!(snapshot(&hf), hf_before, "the Hugging Face export changed");
    let (code, text) = comera(&["eval", s(&run)]);
    assert_eq!(code, 0, "eval after the refused exports: {text}");

    // A user's file: refused without --overwrite, and with it (comera did not write it).
    let mine = other.join("mine.safetensors");
    std::fs::write(&mine, b"a user's file").unwrap();
    for extra in [&[][..], &["--overwrite"][..]] {
        let (code, text) = comera(&[&["export", s(&run), "--dense", s(&mine)][..], extra].concat());
        assert_refused(code, &text, "--dense", "a user's file");
    }
    assert_eq!(std::fs::read(&mine).unwrap(), b"a user's file");

    // An earlier export: refused without --overwrite, replaced with it.
    let earlier = other.join("dense.safetensors");
    let (code, text) = comera(&["export", s(&run), "--dense", s(&earlier)]);
    assert_eq!(code, 0, "{text}");
    let (code, text) = comera(&["export", s(&run), "--dense", s(&earlier)]);
    assert_refused(code, &text, "add --overwrite", "an earlier export");
    let (code, text) = comera(&["export", s(&run), "--dense", s(&earlier), "--overwrite"]);
    assert_eq!(code, 0, "{text}");

    // A link to an earlier export is refused, and the export stays as it was.
    let link = other.join("link.safetensors");
    std::os::unix::fs::symlink(&earlier, &link).unwrap();
    let exported = std::fs::read(&earlier).unwrap();
    let (code, text) = comera(&["export", s(&run), "--compressed", s(&link), "--overwrite"]);
    assert_refused(code, &text, "symbolic link", "a link");
    assert_eq!(std::fs::read(&earlier).unwrap(), exported);

    // Two outputs of one command at one place.
    let both = other.join("both.safetensors");
    let (code, text) = comera(&[
        "export",
        s(&run),
        "--dense",
        s(&both),
        "--compressed",
        s(&both),
    ]);
    assert_refused(code, &text, "overlap", "--dense F --compressed F");
    let x = other.join("x");
    let (code, text) = comera(&["export", s(&run), "--hf", s(&x), "--dense", s(&x)]);
    assert_refused(code, &text, "overlap", "--hf X --dense X");
    let inside = x.join("model.safetensors");
    let (code, text) = comera(&["export", s(&run), "--hf", s(&x), "--dense", s(&inside)]);
    assert_refused(code, &text, "overlap", "--hf X --dense X/model.safetensors");
    assert!(
        !both.exists() && !x.exists(),
        "a refused export wrote something"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Items 2 and 8: `report --out` never writes into a run (another run's `report.json` stays),
/// replaces only an earlier page and only with --overwrite, refuses a link; and a run stopped
/// before its first evaluation is reported, marked, its scores shown as "–".
#[test]
fn report_pages_are_written_whole_and_never_into_a_run() {
    let (dir, cfg, run) = small_run("outputs-report");
    let stopped = dir.join("stopped");
    let (code, text) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--quiet",
        "--stop-after-steps",
        "1",
        "--out",
        s(&stopped),
    ]);
    assert_eq!(code, 0, "{text}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(stopped.join("report.json")).unwrap())
            .unwrap();
    assert!(summary["best_valid"].is_null(), "{summary}");

    let before = snapshot(&run);
    for out in [run.clone(), run.join("page"), run.join("checkpoints")] {
        for extra in [&[][..], &["--overwrite"][..]] {
            let (code, text) =
                comera(&[&["report", s(&stopped), "--out", s(&out)][..], extra].concat());
            assert_refused(
                code,
                &text,
                "run directory",
                &format!("--out {}", out.display()),
            );
        }
    }
    assert_eq!(snapshot(&run), before, "a report wrote into a run");
    let (code, text) = comera(&["report", s(&run), "--out", s(&dir.join("p0"))]);
    assert_eq!(code, 0, "the run still reads: {text}");

    // A stopped run without an evaluation is on the page, marked, with "–" for its scores.
    let page = dir.join("page");
    let (code, text) = comera(&["report", s(&stopped), s(&run), "--out", s(&page)]);
    assert_eq!(code, 0, "{text}");
    let md = std::fs::read_to_string(page.join("report.md")).unwrap();
    let row = md
        .lines()
        .find(|l| l.starts_with("| stopped (stopped)"))
        .unwrap();
    assert!(row.contains("| – | – |"), "{row}");

    // The page again: refused without --overwrite, replaced whole with it.
    let (code, text) = comera(&["report", s(&run), "--out", s(&page)]);
    assert_refused(code, &text, "add --overwrite", "an earlier page");
    let (code, text) = comera(&["report", s(&run), "--out", s(&page), "--overwrite"]);
    assert_eq!(code, 0, "{text}");
    let md = std::fs::read_to_string(page.join("report.md")).unwrap();
    assert!(
        !md.contains("| stopped"),
        "the old page's rows stayed: {md}"
    );

    // A user's directory that holds a page's names, and a link to a page.
    let mine = dir.join("mine");
    std::fs::create_dir(&mine).unwrap();
    std::fs::write(mine.join("report.md"), "my notes").unwrap();
    let (code, text) = comera(&["report", s(&run), "--out", s(&mine), "--overwrite"]);
    assert_refused(
        code,
        &text,
        "not an earlier comera output",
        "a user's folder",
    );
    assert_eq!(
        std::fs::read_to_string(mine.join("report.md")).unwrap(),
        "my notes"
    );
    let link = dir.join("link");
    std::os::unix::fs::symlink(&page, &link).unwrap();
    let (code, text) = comera(&["report", s(&run), "--out", s(&link), "--overwrite"]);
    assert_refused(code, &text, "symbolic link", "a link");
    std::fs::remove_dir_all(&dir).ok();
}

/// Item 4: 100,000 distinct labels train and evaluate (per-class counts, no labels² table)
/// under an 8 GB address-space limit; one more label is refused naming the file and line.
#[test]
fn a_hundred_thousand_labels_train_and_one_more_is_refused() {
    let (dir, cfg) = config_finding_labels("outputs-labels");
    for (labels, ok) in [(100_000usize, true), (100_001, false)] {
        let csv = dir.join(format!("labels-{labels}.csv"));
        let mut text = String::from("text,label\n");
        for i in 0..labels {
            text += &format!("good {i},L{i}\n");
        }
        std::fs::write(&csv, text).unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_comera"));
        cmd.args([
            "--threads",
            "2",
            "train",
            "--config",
            s(&cfg),
            "--data",
            s(&csv),
            "--set",
            "data.text_a=text",
            "--epochs",
            "1",
            "--quiet",
            "--out",
            s(&dir.join(format!("run-{labels}"))),
        ]);
        limit_address_space(&mut cmd, 8_000_000 * 1024);
        let out = cmd.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        if ok {
            assert_eq!(out.status.code(), Some(0), "{labels} labels: {text}");
        } else {
            assert_eq!(out.status.code(), Some(1), "{labels} labels: {text}");
            assert!(
                text.contains(&format!("labels-{labels}.csv:{}", labels + 1))
                    && text.contains("at most 100000 distinct labels"),
                "{text}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Sets RLIMIT_AS of the child `cmd` starts.
fn limit_address_space(cmd: &mut Command, bytes: u64) {
    use std::os::unix::process::CommandExt;
    // SAFETY: setrlimit is async-signal-safe; it only lowers this child's own limit.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Item 5: a data file replaced by a FIFO under a stopped run is refused on resume at once.
#[test]
fn a_fifo_in_place_of_a_stopped_runs_data_is_refused_on_resume() {
    let dir = tempdir("outputs-fifo");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 3");
    let run = dir.join("run");
    let (code, text) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--quiet",
        "--stop-after-steps",
        "2",
    ]);
    assert_eq!(code, 0, "{text}");
    std::fs::remove_file(&data).unwrap();
    mkfifo(&data);
    let (code, text) = comera_within(&["train", "--resume", s(&run)], Duration::from_secs(60));
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("FIFO") && text.contains("train.tsv"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Item 6: `--set data.…` is applied over what `--data` fills in; a flag and a setting of one
/// field are an error naming both.
#[test]
fn settings_of_the_data_table_win_over_data_files_defaults() {
    let dir = tempdir("outputs-set-data");
    let csv = dir.join("good.csv");
    std::fs::write(&csv, "text,label,body\nt good,pos,b 1\nt bad,neg,b 2\n").unwrap();
    let config = |extra: &[&str]| {
        comera(&[&["train", "--data", s(&csv), "--print-config"][..], extra].concat())
    };
    let (code, text) = config(&[
        "--set",
        "data.text_a=body",
        "--set",
        "data.labels=[\"pos\", \"neg\"]",
    ]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("text_a = \"body\""), "{text}");
    // The labels in the order given (the data's own order would be neg, pos).
    let (pos, neg) = (text.find("\"pos\"").unwrap(), text.find("\"neg\"").unwrap());
    assert!(pos < neg, "{text}");
    let (code, text) = config(&["--set", "data.label=body"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("label = \"body\""), "{text}");
    for (setting, flag) in [
        ("data.source=tsv", "--data"),
        ("data.train=other.csv", "--data"),
    ] {
        let (code, text) = config(&["--set", setting]);
        assert_refused(code, &text, flag, setting);
        assert!(text.contains(setting), "{text}");
    }
    let (code, text) = comera(&[
        "train",
        "--epochs",
        "2",
        "--set",
        "train.epochs=3",
        "--print-config",
    ]);
    assert_refused(
        code,
        &text,
        "--epochs sets train.epochs too",
        "--epochs and train.epochs",
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Items 7 and 11: `--extend-epochs` without `--resume`, a teacher that is the run's own
/// output or empty, malformed `distill.layers` and a `--set` value of several lines are
/// errors, not silently dropped.
#[test]
fn flags_that_would_be_ignored_or_misapplied_are_errors() {
    let (dir, cfg, run) = small_run("outputs-flags");
    let (code, text) = comera(&["train", "--config", s(&cfg), "--extend-epochs", "2"]);
    assert_refused(
        code,
        &text,
        "--extend-epochs",
        "--extend-epochs without --resume",
    );
    let before = snapshot(&run);
    let (code, text) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--teacher",
        s(&run),
        "--out",
        s(&run),
        "--overwrite",
    ]);
    assert_refused(code, &text, "distill.teacher", "--teacher D --out D");
    assert_eq!(snapshot(&run), before, "the teacher changed");
    let (code, text) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--set",
        "distill.teacher=\"\"",
        "--print-config",
    ]);
    assert_refused(code, &text, "is empty", "an empty teacher");
    // A teacher of its own: a copy of the run.
    let teacher = dir.join("teacher");
    let copied = Command::new("cp")
        .args(["-r", s(&run), s(&teacher)])
        .status()
        .unwrap();
    assert!(copied.success());
    for (layers, wanted) in [("[[0, 0, 0]]", "two numbers"), ("[[0, 9]]", "out of range")] {
        let text = std::fs::read_to_string(&cfg).unwrap()
            + &format!(
                "\n[distill]\nteacher = \"{}\"\nhidden_weight = 1.0\nlayers = {layers}\n",
                s(&teacher)
            );
        let cfg2 = dir.join("distill.toml");
        std::fs::write(&cfg2, text).unwrap();
        let (code, text) = comera(&[
            "train",
            "--config",
            s(&cfg2),
            "--quiet",
            "--out",
            s(&dir.join("student")),
        ]);
        assert_refused(code, &text, wanted, layers);
        assert!(text.contains("layers"), "{text}");
    }
    let (code, text) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--set",
        "train.epochs=2\nseed=5",
        "--print-config",
    ]);
    assert_refused(code, &text, "line break", "a --set of two lines");
    std::fs::remove_dir_all(&dir).ok();
}

/// Item 11: a label with a control character in the data is refused, naming file and line.
#[test]
fn labels_with_control_characters_are_refused() {
    let (dir, cfg) = config_finding_labels("outputs-control");
    let csv = dir.join("control.csv");
    std::fs::write(&csv, "text,label\ngood a,pos\nbad b,\"ne\u{0}g\"\n").unwrap();
    let (code, text) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--data",
        s(&csv),
        "--set",
        "data.text_a=text",
        "--quiet",
        "--out",
        s(&dir.join("r")),
    ]);
    assert_refused(code, &text, "control characters", "a NUL in a label");
    assert!(text.contains("control.csv:3"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Item 9: Parquet files as pyarrow writes them, in each codec, train the same model bit for
/// bit as the uncompressed file.
#[test]
fn parquet_in_every_codec_trains_the_same_model() {
    let dir = tempdir("outputs-parquet");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 3");
    let fixtures =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../comera-data/tests/fixtures/parquet");
    let mut weights = Vec::new();
    for codec in ["none", "snappy", "gzip", "brotli", "lz4", "zstd"] {
        let out = dir.join(codec);
        let (code, text) = comera(&[
            "--threads",
            "2",
            "train",
            "--config",
            s(&cfg),
            "--data",
            s(&fixtures.join(format!("reviews-{codec}.parquet"))),
            "--set",
            "data.text_a=text",
            "--epochs",
            "1",
            "--quiet",
            "--out",
            s(&out),
        ]);
        assert_eq!(code, 0, "{codec}: {text}");
        weights.push((codec, std::fs::read(out.join("model.safetensors")).unwrap()));
    }
    for (codec, w) in &weights[1..] {
        assert!(
            *w == weights[0].1,
            "{codec} trained another model than the uncompressed file"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
