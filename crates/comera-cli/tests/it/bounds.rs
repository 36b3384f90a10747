//! Issue 35, items 6, 7 and 11: numbers a user types are bounded (an error naming the field or
//! flag, never a panic, an abort or gigabytes of memory), every shape search ends, and the
//! smaller gaps (masked-LM fields on a classification run, label names, repeated header
//! columns, FIFOs as data files or vocabularies) are clear errors. Every command here stops at
//! validation or at the first file read: nothing trains, nothing is fetched.

use crate::common::{comera, tempdir};
use std::path::{Path, PathBuf};

/// `comera --threads 1 train --config <text> --print-config` (stops after validation).
fn print_config(dir: &Path, text: &str, extra: &[&str]) -> (i32, String) {
    let cfg = dir.join("run.toml");
    std::fs::write(&cfg, text).unwrap();
    let mut args = vec!["--threads", "1", "train", "--config", cfg.to_str().unwrap()];
    args.extend_from_slice(extra);
    args.push("--print-config");
    comera(&args)
}

/// An error of the run (exit 1), not a panic or an abort.
fn assert_refused(code: i32, text: &str, wanted: &str) {
    assert_eq!(code, 1, "{text}");
    assert!(!text.contains("panicked"), "{text}");
    assert!(text.contains(wanted), "expected {wanted:?} in: {text}");
}

fn fifo(path: &Path) -> PathBuf {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path made above.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    path.to_path_buf()
}

#[test]
fn epochs_beyond_the_limit_are_an_error_naming_the_field_and_line() {
    let dir = tempdir("bounds-epochs");
    // 2^32 aborted on a 103 GB allocation, 2^62 panicked, 10^9 filled 24 GB.
    for n in ["4294967296", "4611686018427387904", "1000000000"] {
        let (code, text) = print_config(&dir, &format!("[train]\nepochs = {n}\n"), &[]);
        assert_refused(
            code,
            &text,
            &format!("run.toml:2:10: train.epochs: {n} is more than the limit 1000000;"),
        );
    }
    let (code, text) = print_config(&dir, "[dlrm]\n[train]\nepochs = 4294967296\n", &[]);
    assert_refused(
        code,
        &text,
        "train.epochs: 4294967296 is more than the limit",
    );
    let (code, text) = print_config(&dir, "[train]\nepochs = 2\n", &["--epochs", "4294967296"]);
    assert_refused(
        code,
        &text,
        "--epochs: 4294967296 is more than the limit 1000000",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn flags_beyond_what_a_run_config_can_save_name_the_flag() {
    let dir = tempdir("bounds-flags");
    // These panicked in serialising the config ("a run config serialises: OutOfRange").
    let big = "9223372036854775808";
    for flag in ["--seed", "--max-steps-per-epoch", "--stop-after-steps"] {
        for cfg in ["[train]\nepochs = 1\n", "[dlrm]\n"] {
            let (code, text) = print_config(&dir, cfg, &[flag, big]);
            assert_refused(
                code,
                &text,
                &format!("{flag}: {big} is more than the limit 9223372036854775807"),
            );
        }
    }
    // The largest seed a config can hold is accepted and written back.
    let (code, text) = print_config(&dir, "", &["--seed", "9223372036854775807"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("seed = 9223372036854775807"), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sizes_beyond_their_limits_are_an_error_naming_the_field() {
    let dir = tempdir("bounds-sizes");
    for (text, field) in [
        ("[model]\nd_model = 1099511627776\n", "model.d_model"),
        ("[model]\nseq_len = 100000000\n", "model.seq_len"),
        ("[train]\nbatch_size = 4294967296\n", "train.batch_size"),
        ("[dlrm]\nembedding_dim = 4294967296\n", "dlrm.embedding_dim"),
        (
            "[dlrm]\n[data]\nsynthetic_valid = 100000000000\n",
            "data.synthetic_valid",
        ),
    ] {
        let (code, out) = print_config(&dir, text, &[]);
        assert_refused(code, &out, &format!("{field}: "));
        assert!(out.contains("is more than the limit"), "{out}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `ttm_cores = 64` looped forever in proposing the tables' shapes.
#[test]
fn dlrm_ttm_cores_beyond_the_limit_are_refused_at_once() {
    let dir = tempdir("bounds-cores");
    let (code, text) = print_config(&dir, "[dlrm]\nttm_cores = 64\n", &[]);
    assert_refused(
        code,
        &text,
        "run.toml:2:13: dlrm.ttm_cores: 64 is more than the limit 16",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn masked_lm_fields_on_a_classification_run_are_refused() {
    let dir = tempdir("bounds-mlm-fields");
    for (field, value) in [("select_prob", "nan"), ("tokenizer", "\"sentencepiece\"")] {
        let (code, text) = print_config(&dir, &format!("[data]\n{field} = {value}\n"), &[]);
        assert_refused(
            code,
            &text,
            &format!(
                "run.toml:2:{}: data.{field}: only masked-LM runs",
                field.len() + 4
            ),
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn label_names_repeated_empty_or_with_tabs_are_refused() {
    let dir = tempdir("bounds-label-names");
    for (names, wanted) in [
        (
            r#"["yes", "yes"]"#,
            "data.label_names[1]: \"yes\" is also data.label_names[0]",
        ),
        (r#"["", "yes"]"#, "data.label_names[0]: empty name"),
        (r#"["a\tb", "c"]"#, "holds a control character"),
        (r#"["a", "b\nc"]"#, "holds a control character"),
    ] {
        let (code, text) = print_config(&dir, &format!("[data]\nlabel_names = {names}\n"), &[]);
        assert_refused(code, &text, wanted);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A file-source run on `train`, with `vocab` (the data are read before the vocabulary).
fn tsv_run(dir: &Path, train: &Path, vocab: &Path) -> (i32, String) {
    let cfg = dir.join("run.toml");
    std::fs::write(
        &cfg,
        format!(
            "[data]\nsource = \"tsv\"\ntrain = {:?}\nvocab = {:?}\ntext_a = \"text\"\nlabel = \"label\"\nlabels = [\"a\", \"b\"]\n[train]\nout_dir = {:?}\n",
            train,
            vocab,
            dir.join("run")
        ),
    )
    .unwrap();
    comera(&[
        "--threads",
        "1",
        "train",
        "--quiet",
        "--config",
        cfg.to_str().unwrap(),
    ])
}

#[test]
fn a_tsv_naming_a_read_column_twice_is_refused() {
    let dir = tempdir("bounds-dup-column");
    let train = dir.join("train.tsv");
    std::fs::write(&train, "text\tlabel\ttext\nhello\ta\tworld\n").unwrap();
    let (code, text) = tsv_run(&dir, &train, &dir.join("vocab.txt"));
    assert_refused(
        code,
        &text,
        "train.tsv:1: column `text` appears twice in the header (columns 1 and 3)",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A FIFO as the data file or the vocabulary waited forever for a writer.
#[test]
fn a_fifo_as_data_file_or_vocabulary_is_refused() {
    let dir = tempdir("bounds-fifo");
    let data_fifo = fifo(&dir.join("train.tsv"));
    let (code, text) = tsv_run(&dir, &data_fifo, &dir.join("vocab.txt"));
    assert_refused(code, &text, "is a FIFO (named pipe), not a regular file");
    assert!(text.contains("train.tsv"), "{text}");

    let train = dir.join("real.tsv");
    let rows: String = (0..20)
        .map(|i| format!("text {i}\t{}\n", ["a", "b"][i % 2]))
        .collect();
    std::fs::write(&train, format!("text\tlabel\n{rows}")).unwrap();
    let vocab_fifo = fifo(&dir.join("vocab.txt"));
    let _ = std::fs::remove_dir_all(dir.join("run"));
    let (code, text) = tsv_run(&dir, &train, &vocab_fifo);
    assert_refused(code, &text, "is a FIFO (named pipe), not a regular file");
    assert!(
        text.contains("data.vocab") && text.contains("vocab.txt"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every shipped config still passes the bounds.
#[test]
fn the_shipped_configs_are_within_the_bounds() {
    let configs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs");
    for entry in std::fs::read_dir(configs).unwrap() {
        let path = entry.unwrap().path();
        let (code, text) = comera(&[
            "--threads",
            "1",
            "train",
            "--config",
            path.to_str().unwrap(),
            "--print-config",
        ]);
        assert_eq!(code, 0, "{}: {text}", path.display());
    }
}
