//! Helpers shared by the CLI's end-to-end tests.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs the `comera` binary; (exit code, stdout + stderr).
pub fn comera(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_comera"))
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// A fresh directory under cargo's scratch folder for integration tests (`target/tmp`, not the
/// system's temp dir: what a test leaves, such as the runs shared by a whole file, goes with
/// `cargo clean`), unique per test and process.
pub fn tempdir(tag: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("comera-train-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The metrics-log records of one kind.
pub fn records(run: &Path, kind: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|r| r["kind"] == kind)
        .collect()
}

/// Records without their wall-clock and process fields (tokens/s, ms/step, seconds, peak
/// resident set), for comparing runs.
pub fn untimed(records: Vec<serde_json::Value>) -> Vec<serde_json::Value> {
    records
        .into_iter()
        .map(|mut r| {
            for k in ["tokens_per_s", "ms_per_step", "seconds", "peak_rss_bytes"] {
                r.as_object_mut().unwrap().remove(k);
            }
            r
        })
        .collect()
}

/// Runs `a` and `b` ended alike: the metrics records of each kind in `kinds` equal (timing
/// fields aside) and `model.safetensors` byte for byte.
pub fn assert_same_run(a: &Path, b: &Path, kinds: &[&str]) {
    for kind in kinds {
        assert_eq!(
            untimed(records(a, kind)),
            untimed(records(b, kind)),
            "{kind} records differ"
        );
    }
    assert!(
        std::fs::read(a.join("model.safetensors")).unwrap()
            == std::fs::read(b.join("model.safetensors")).unwrap(),
        "final weights differ"
    );
}

/// Every command that reads a run directory works on `run`: `inspect` (the directory and its
/// newest checkpoint), `eval` (the directory and the checkpoint, which saw the same weights
/// at the run's end), `predict` with `inputs` (output must contain `expect`), `export
/// --compressed` and `plot`.
pub fn every_command_works_on(run: &Path, inputs: &[&str], expect: &str) {
    let r = run.to_str().unwrap();
    let (code, text) = comera(&["inspect", r]);
    assert_eq!(code, 0, "inspect: {text}");
    assert!(text.contains("parameters"), "inspect: {text}");
    let mut cks: Vec<PathBuf> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    cks.sort();
    let ck = cks
        .last()
        .expect("a checkpoint")
        .to_str()
        .unwrap()
        .to_string();
    let (code, text) = comera(&["inspect", &ck]);
    assert_eq!(code, 0, "inspect checkpoint: {text}");
    assert!(text.contains("progress"), "inspect checkpoint: {text}");
    let (code, from_model) = comera(&["eval", r]);
    assert_eq!(code, 0, "eval: {from_model}");
    assert!(from_model.contains("loss"), "eval: {from_model}");
    let (code, from_ck) = comera(&["eval", r, "--checkpoint", &ck]);
    assert_eq!(code, 0, "eval --checkpoint: {from_ck}");
    assert_eq!(
        from_model, from_ck,
        "the last checkpoint holds the final model"
    );
    let (code, text) = comera(&[&["predict", r][..], inputs].concat());
    assert_eq!(code, 0, "predict: {text}");
    assert!(text.contains(expect), "predict: {text}");
    // Outputs beside the run: nothing but training writes into a run directory.
    let beside = |what: &str| {
        let name = run.file_name().unwrap().to_string_lossy();
        run.with_file_name(format!("{name}-{what}"))
    };
    let out = beside("export.safetensors");
    let (code, text) = comera(&["export", r, "--compressed", out.to_str().unwrap()]);
    assert_eq!(code, 0, "export: {text}");
    assert!(out.exists(), "export: {text}");
    let fig = beside("plot.png");
    let (code, text) = comera(&["plot", r, "--out", fig.to_str().unwrap()]);
    assert_eq!(code, 0, "plot: {text}");
    assert!(
        std::fs::metadata(&fig).unwrap().len() > 1000,
        "plot: {text}"
    );
}

const WORDS: &[&str] = &[
    "the", "a", "dress", "shirt", "fit", "color", "is", "was", "very",
];

/// A path as the `&str` an argument list takes.
pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The rows of a sentiment-like TSV (see [`write_tsv`]).
#[derive(Clone, Copy)]
pub struct Tsv {
    pub rows: usize,
    /// "great"/"awful" as well as "good"/"bad".
    pub synonyms: bool,
    /// The key word in three places in turn (else always between two filler words).
    pub word_orders: bool,
}

/// A sentiment-like TSV (`train.tsv`: "good"/"great" mean pos, "bad"/"awful" mean neg, among
/// filler words) and its vocabulary (`vocab.txt`, 18 ids).
pub fn write_tsv(dir: &Path, t: Tsv) -> (PathBuf, PathBuf) {
    let vocab = dir.join("vocab.txt");
    let mut v = vec![
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "great", "bad", "awful",
    ];
    v.extend_from_slice(WORDS);
    std::fs::write(&vocab, v.join("\n") + "\n").unwrap();
    let mut tsv = String::from("sentence\tlabel\n");
    for i in 0..t.rows {
        let pos = i % 2 == 0;
        let k = if t.synonyms { i % 3 % 2 } else { 0 };
        let key = if pos {
            ["good", "great"][k]
        } else {
            ["bad", "awful"][k]
        };
        let f1 = WORDS[i % WORDS.len()];
        let f2 = WORDS[(i * 7 + 3) % WORDS.len()];
        let sentence = match if t.word_orders { i % 3 } else { 0 } {
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

/// [`write_tsv`] of 160 rows, with synonyms and word orders.
pub fn write_data(dir: &Path) -> (PathBuf, PathBuf) {
    write_tsv(
        dir,
        Tsv {
            rows: 160,
            synonyms: true,
            word_orders: true,
        },
    )
}

/// The TT/TTM layouts of the tests' classifier (`tt_linear`, `ttm_embedding` set to `tt`).
pub fn tt_layouts(tt: bool) -> String {
    format!(
        "tt_linear = {tt}\n\
         ttm_embedding = {tt}\n\
         attn_tt = {{ in_modes = [4, 4], out_modes = [4, 4], rank = 3 }}\n\
         ffn_up_tt = {{ in_modes = [4, 4], out_modes = [4, 8], rank = 3 }}\n\
         ffn_down_tt = {{ in_modes = [4, 8], out_modes = [4, 4], rank = 3 }}\n\
         word_ttm = {{ vocab_modes = [3, 6], dim_modes = [4, 4], rank = 3 }}\n"
    )
}

/// The settings of a classifier run config that the tests vary.
pub struct Classifier<'a> {
    /// Lines added to `[model]` (layouts).
    pub model: &'a str,
    pub lr_gates: f64,
    pub epochs: usize,
    pub warmup_steps: usize,
    /// Lines added to `[train]`, and any tables after it.
    pub extra: &'a str,
}

/// Writes `dir/name`: a classifier on the TSV `data` with `vocab` (a 1-layer post-LN encoder of
/// width 16, batch 8), writing into `dir/run`.
pub fn write_classifier(
    dir: &Path,
    name: &str,
    data: &Path,
    vocab: &Path,
    c: &Classifier,
) -> PathBuf {
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
{model}

[optim]
lr_cores = 0.01
lr_gates = {lr_gates}
lr_other = 0.01

[train]
epochs = {epochs}
batch_size = 8
warmup_steps = {warmup}
log_every = 5
out_dir = "{out}"
{extra}
"#,
        data = data.display(),
        vocab = vocab.display(),
        model = c.model,
        lr_gates = c.lr_gates,
        epochs = c.epochs,
        warmup = c.warmup_steps,
        extra = c.extra,
        out = dir.join("run").display()
    );
    let path = dir.join(name);
    std::fs::write(&path, cfg).unwrap();
    path
}

/// `dir/run.toml`: [`write_classifier`] for 6 epochs, TT layers if `tt`.
pub fn write_config(dir: &Path, data: &Path, vocab: &Path, tt: bool, extra: &str) -> PathBuf {
    write_classifier(
        dir,
        "run.toml",
        data,
        vocab,
        &Classifier {
            model: &tt_layouts(tt),
            lr_gates: 0.01,
            epochs: 6,
            warmup_steps: 5,
            extra,
        },
    )
}

/// A run's `report.json`.
pub fn report_json(run: &Path) -> serde_json::Value {
    let path = run.join("report.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// `comera synth-criteo` into `dir/name`: `rows` rows of tables of 20,000 rows in all, stream
/// `stream`.
pub fn synth_criteo(dir: &Path, name: &str, rows: &str, stream: &str) -> PathBuf {
    let p = dir.join(name);
    let (code, out) = comera(&[
        "synth-criteo",
        "--out",
        s(&p),
        "--rows",
        rows,
        "--total-rows",
        "20000",
        "--stream",
        stream,
    ]);
    assert_eq!(code, 0, "{out}");
    p
}

/// The special tokens and the words of [`write_corpus`]'s code.
const CODE_WORDS: &[&str] = &[
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "fn", "let", "mut", "if", "else", "return",
    "match", "loop",
];

/// 40 `.rs` files (in four subdirectories, with a `README.md` beside them that a run reading
/// `.rs` must ignore, if `nested`) whose lines repeat short patterns of 8 words, so that a
/// model can learn to fill in masked words; the vocabulary is the specials, those 8 words and
/// then `more_words`.
pub fn write_corpus(dir: &Path, more_words: &[&str], nested: bool) -> (PathBuf, PathBuf) {
    let vocab = dir.join("vocab.txt");
    let v: Vec<&str> = CODE_WORDS.iter().chain(more_words).copied().collect();
    std::fs::write(&vocab, v.join("\n") + "\n").unwrap();
    let words = &CODE_WORDS[5..];
    let code = dir.join("code");
    for i in 0..40usize {
        let sub = if nested {
            code.join(format!("m{}", i % 4))
        } else {
            code.clone()
        };
        std::fs::create_dir_all(&sub).unwrap();
        let mut text = String::new();
        for l in 0..30usize {
            let w = |k: usize| words[(i + l * 3 + k) % 8];
            text += &format!("let mut {} if {} else return {}\n", w(0), w(1), w(0));
        }
        std::fs::write(sub.join(format!("f{i}.rs")), text).unwrap();
    }
    if nested {
        std::fs::write(code.join("README.md"), "awful awful awful\n").unwrap();
    }
    (code, vocab)
}

pub fn checkpoints(run: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(run.join("checkpoints"))
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Rank-adaptive settings that make a short run switch stage and truncate.
pub const RANK_EXTRA: &str = "checkpoint_every = 4\nkeep_checkpoints = 2\n\n[rank]\nlate_after_epochs = 1\ntarget_ratio = 0.5\ntarget_loss = 0.2\ntruncate_every = 3";

/// Every file under `dir` (recursively, the lock aside) with its bytes: what "nothing changed"
/// compares.
pub fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.file_name().unwrap() == ".lock" {
                continue;
            }
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(
                    p.strip_prefix(dir).unwrap().to_path_buf(),
                    std::fs::read(&p).unwrap(),
                );
            }
        }
    }
    out
}

/// A finished small TT run in `dir/run` (3 steps); returns (dir, config, run).
pub fn small_run(tag: &str) -> (PathBuf, PathBuf, PathBuf) {
    let dir = tempdir(tag);
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 3");
    let (code, text) = comera(&["train", "--config", s(&cfg), "--quiet", "--epochs", "1"]);
    assert_eq!(code, 0, "{text}");
    (dir.clone(), cfg, dir.join("run"))
}

/// Makes a FIFO (named pipe) at `path`.
pub fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(s(path)).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// `comera ARGS` that must end within `limit` (a hang fails the test instead of blocking it).
pub fn comera_within(args: &[&str], limit: Duration) -> (i32, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_comera"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > limit {
            child.kill().unwrap();
            panic!("`comera {}` hung (killed after {limit:?})", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}
