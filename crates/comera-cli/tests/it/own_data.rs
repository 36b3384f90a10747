//! A user's own data in one command (`train --data FILE`), config fields set from the command
//! line (`--set`), and a finished run trained further (`--resume DIR --extend-epochs N`).

use crate::common::*;
use std::path::{Path, PathBuf};

/// Words that say each of three labels, and words that say nothing.
const SAYS: [(&str, [&str; 4]); 3] = [
    ("negative", ["awful", "torn", "cheap", "ugly"]),
    ("neutral", ["okay", "fine", "average", "plain"]),
    ("positive", ["great", "lovely", "perfect", "soft"]),
];
const FILLER: [&str; 6] = ["the", "dress", "was", "a", "colour", "and"];

/// `rows` (text, label) pairs: three words of the label among filler words.
fn reviews(rows: usize) -> Vec<(String, &'static str)> {
    (0..rows)
        .map(|i| {
            let (label, words) = SAYS[i % 3];
            let w = |k: usize| words[(i / 3 + k) % 4];
            let f = |k: usize| FILLER[(i * 5 + k) % FILLER.len()];
            (
                format!("{} {} {} {} {} {}", f(0), w(0), f(1), w(1), f(2), w(2)),
                label,
            )
        })
        .collect()
}

/// The same rows as `name.csv` (an id column besides `text` and `label`), `name.jsonl` or
/// `name.tsv` (its text column called `sentence`).
fn write_rows(dir: &Path, name: &str, rows: &[(String, &str)]) -> PathBuf {
    let path = dir.join(name);
    let text: String = match path.extension().and_then(|e| e.to_str()) {
        Some("csv") => std::iter::once("id,text,label\n".to_string())
            .chain(
                rows.iter()
                    .enumerate()
                    .map(|(i, (t, l))| format!("{i},\"{t}\",{l}\n")),
            )
            .collect(),
        Some("jsonl") => rows
            .iter()
            .map(|(t, l)| serde_json::json!({"text": t, "label": l}).to_string() + "\n")
            .collect(),
        Some("tsv") => std::iter::once("sentence\tlabel\n".to_string())
            .chain(rows.iter().map(|(t, l)| format!("{t}\t{l}\n")))
            .collect(),
        _ => unreachable!(),
    };
    std::fs::write(&path, text).unwrap();
    path
}

/// The TT/TTM compression of the run's layers at its start and at its end (`ranks.md`'s
/// summary line: "… compression vs their dense equivalent A× → B× → C×").
fn compression_start_end(run: &Path) -> (f64, f64) {
    let md = std::fs::read_to_string(run.join("ranks.md")).unwrap();
    let line = md.lines().find(|l| l.starts_with("TT/TTM layers")).unwrap();
    let figures: Vec<f64> = line
        .split(['×', ' '])
        .filter_map(|w| w.parse().ok())
        .collect();
    (figures[0], *figures.last().unwrap())
}

#[test]
fn train_data_file_trains_the_small_model_through_both_rank_stages_from_csv_jsonl_and_tsv() {
    let dir = tempdir("own-data");
    let rows = reviews(2000);
    for file in ["my.csv", "my.jsonl", "my.tsv"] {
        let data = write_rows(&dir, file, &rows);
        let run = dir.join(format!("run-{file}"));
        let (code, text) = comera(&[
            "--threads",
            "2",
            "train",
            "--data",
            s(&data),
            "--out",
            s(&run),
            "--quiet",
        ]);
        assert_eq!(code, 0, "{text}");
        // The columns found by convention, the labels read from the data (sorted), the
        // built-in small model.
        let column = if file.ends_with("tsv") {
            "sentence"
        } else {
            "text"
        };
        assert!(
            text.contains(&format!("(text `{column}`, label `label`)"))
                && text
                    .contains("3 labels [\"negative\", \"neutral\", \"positive\"] (from the data)"),
            "{text}"
        );
        assert!(text.contains("model 2 layers, d_model 128"), "{text}");
        // Both rank stages in a run of this length, and the ranks shrank.
        assert_eq!(records(&run, "stage").len(), 1, "{text}");
        let (start, end) = compression_start_end(&run);
        assert!(end > start, "{file}: TT/TTM compression {start}× → {end}×");
        // The run records what it read.
        let config = std::fs::read_to_string(run.join("config.toml")).unwrap();
        assert!(
            config.contains("labels = [\n    \"negative\",") && config.contains("train_sha256 = "),
            "{config}"
        );
        let (code, text) = comera(&["predict", s(&run), "the dress was lovely and soft"]);
        assert_eq!(code, 0, "{text}");
        assert!(text.starts_with("positive\t"), "{text}");
    }
    // Starting from the CSV run: on the same labels its classifier head goes on too; on other
    // labels a fresh head is trained on its encoder, and that is said.
    let base = dir.join("run-my.csv");
    let two: Vec<(String, &str)> = rows.iter().filter(|r| r.1 != "neutral").cloned().collect();
    for (file, rows, said) in [
        ("same.csv", &rows, "init  classifier head from"),
        ("two.csv", &two, "a fresh head is trained on its encoder"),
    ] {
        let data = write_rows(&dir, file, rows);
        let (code, text) = comera(&[
            "train",
            "--data",
            s(&data),
            "--init-from",
            s(&base),
            "--epochs",
            "1",
            "--max-steps-per-epoch",
            "3",
            "--out",
            s(&dir.join(file).with_extension("run")),
            "--quiet",
        ]);
        assert_eq!(code, 0, "{text}");
        assert!(text.contains(said), "{file}: {text}");
    }
    // Data whose labels are not the model's is refused, naming both.
    let other: Vec<(String, &str)> = rows[..30]
        .iter()
        .map(|(t, l)| (t.clone(), if *l == "positive" { "yes" } else { "no" }))
        .collect();
    let other = write_rows(&dir, "other.jsonl", &other);
    let (code, text) = comera(&["eval", s(&base), "--data", s(&other)]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("other.jsonl:1: field `label`: label \"no\" is not one of [\"negative\", \"neutral\", \"positive\"]"),
        "{text}"
    );
    // An unknown extension, and a validation file of another format.
    let data = dir.join("my.csv");
    let (code, text) = comera(&["train", "--data", s(&dir.join("my.txt"))]);
    assert_eq!(code, 1);
    assert!(
        text.contains("--data: ") && text.contains(".jsonl"),
        "{text}"
    );
    let (code, text) = comera(&[
        "train",
        "--data",
        s(&data),
        "--valid",
        s(&dir.join("my.tsv")),
    ]);
    assert_eq!(code, 1);
    assert!(
        text.contains("--valid: ") && text.contains("expected a csv file"),
        "{text}"
    );
    // A file without the conventional columns names what it has.
    std::fs::write(dir.join("odd.csv"), "body,stars\nnice,5\nbad,1\n").unwrap();
    let (code, text) = comera(&["train", "--data", s(&dir.join("odd.csv")), "--quiet"]);
    assert_eq!(code, 1);
    assert!(
        text.contains("data.text_a: not set") && text.contains("[\"body\", \"stars\"]"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn set_changes_any_config_field_and_a_bad_setting_is_named() {
    let print = |sets: &[&str]| {
        let mut args = vec!["train", "--print-config"];
        for s in sets {
            args.extend(["--set", s]);
        }
        comera(&args)
    };
    let (code, text) = print(&[
        "train.epochs=2",
        "model.layers=1",
        "data.labels=[\"a\", \"b\"]",
    ]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("\nepochs = 2\n") && text.contains("\nlayers = 1\n"),
        "{text}"
    );
    // The built-in model stays the built-in one, changed in the one field.
    assert!(text.contains("\nd_model = 128\n"), "{text}");
    for (setting, expected) in [
        (
            "train.epochs=abc",
            "--set train.epochs=abc: invalid type: string \"abc\"",
        ),
        (
            "train.epoch=2",
            "--set train.epoch=2: unknown field `epoch`",
        ),
        ("train.epochs=0", "--set train.epochs=0: must be at least 1"),
        ("epochs=3", "--set epochs=3: expected a dotted field"),
        (
            "train.phases.0.epochs=3",
            "train.phases: the config has no such array",
        ),
        (
            "rank.late_after_epochs=2",
            "--set rank.late_after_epochs=2: rank.late_after_fraction: give the switch once",
        ),
    ] {
        let (code, text) = print(&[setting]);
        assert_eq!(code, 1, "{setting}: {text}");
        assert!(text.contains(expected), "{setting}: {text}");
    }
    let (code, text) = print(&["rank.late_after_fraction=0", "rank.late_after_epochs=2"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("late_after_epochs = 2"), "{text}");
}

/// A finished run extended by two epochs, once in one go and once stopped inside the extension
/// and resumed: the same records and weights, bit for bit.
#[test]
fn a_finished_run_extended_then_stopped_and_resumed_matches_one_extended_in_one_go() {
    let dir = tempdir("extend");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 6");
    let (a, b) = (dir.join("a"), dir.join("b"));
    let train = |run: &Path, more: &[&str]| {
        let args = [
            &["--threads", "2", "train", "--quiet"][..],
            more,
            &["--resume", s(run)],
        ];
        comera(&args.concat())
    };
    for run in [&a, &b] {
        let (code, text) = comera(&[
            "--threads",
            "2",
            "train",
            "--config",
            s(&cfg),
            "--epochs",
            "2",
            "--out",
            s(run),
            "--quiet",
        ]);
        assert_eq!(code, 0, "{text}");
        let (code, text) = train(run, &[]);
        assert_eq!(code, 1, "{text}");
        assert!(text.contains("--extend-epochs N"), "{text}");
    }
    let (code, text) = train(&a, &["--extend-epochs", "2"]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("extend ") && text.contains("2 → 4 epochs"),
        "{text}"
    );
    assert!(text.contains("done: 4 epochs, 24 steps"), "{text}");
    let (code, text) = train(&b, &["--extend-epochs", "2", "--stop-after-steps", "15"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("stopped after 15 steps"), "{text}");
    let identity = std::fs::read_to_string(b.join("run.toml")).unwrap();
    assert!(
        identity.contains("[[extensions]]\nat_step = 12\nfrom_epochs = 2\nto_epochs = 4"),
        "{identity}"
    );
    let (code, text) = train(&b, &[]);
    assert_eq!(code, 0, "{text}");
    assert_same_run(&a, &b, &["train", "eval"]);
    std::fs::remove_dir_all(&dir).ok();
}
