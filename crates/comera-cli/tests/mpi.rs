//! Data-parallel training under `mpirun` (feature `mpi`; needs Open MPI's `mpirun` on PATH):
//! N = 2 and 3 processes on the same global batch follow one process (losses to a relative
//! 1e-5, the same ranks after truncation), a rerun with the same N is bit-identical, a run
//! resumes with another N, and a process that fails ends the job instead of hanging. A
//! classifier (AdamW and GaLore), a masked LM (two phases) and a DLRM.
#![cfg(feature = "mpi")]

#[path = "it/common/mod.rs"]
mod common;
use common::{
    comera, records, s, synth_criteo as synth, tempdir, tt_layouts, write_classifier, write_tsv,
    Classifier, Tsv,
};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs `comera args` on `n` processes under mpirun (`n` = 1: the binary alone, a world of
/// one); (exit code, stdout + stderr). A run that hangs is killed after 240 s.
fn launch(n: usize, args: &[&str]) -> (i32, String) {
    if n == 1 {
        return comera(args);
    }
    let np = n.to_string();
    let out = Command::new("timeout")
        .args([
            "240",
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &np,
        ])
        .arg(env!("CARGO_BIN_EXE_comera"))
        .args(args)
        // Containers refuse the cross-memory-attach single copy: plain shared memory.
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .output()
        .expect("mpirun on PATH (apt-get install openmpi-bin libopenmpi-dev)");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// `comera --threads 1 train --config cfg --out out --quiet extra…` on `n` processes; must
/// succeed.
fn train(n: usize, cfg: &Path, out: &Path, extra: &[&str]) -> String {
    let base = [
        "--threads",
        "1",
        "train",
        "--config",
        s(cfg),
        "--out",
        s(out),
        "--quiet",
    ];
    let (code, text) = launch(n, &[&base[..], extra].concat());
    assert_eq!(code, 0, "{n} processes: {text}");
    text
}

fn close(a: f64, b: f64, what: &str) {
    let rel = (a - b).abs() / a.abs().max(b.abs()).max(1e-12);
    assert!(rel <= 1e-5, "{what}: {a} vs {b} (relative {rel:.2e})");
}

/// Run `b` (on `n` processes, or resumed on `n`) followed run `a` (one process): every train record's loss and
/// every eval record's figures to a relative 1e-5, the same truncation and stage records
/// (ranks, parameter counts), at least `min_steps` steps.
fn same_run(a: &Path, b: &Path, n: usize, min_steps: u64) {
    let (ta, tb) = (records(a, "train"), records(b, "train"));
    assert_eq!(ta.len(), tb.len(), "train records");
    assert!(
        ta.last().unwrap()["step"].as_u64().unwrap() >= min_steps,
        "at least {min_steps} steps"
    );
    for (x, y) in ta.iter().zip(&tb) {
        assert_eq!(x["step"], y["step"]);
        close(
            x["loss"].as_f64().unwrap(),
            y["loss"].as_f64().unwrap(),
            &format!("train loss at step {} with {n} processes", x["step"]),
        );
        // (A resumed run's records before the resume come from the first session's N.)
        assert!(y["processes"].as_u64().unwrap() > 1, "{y}");
        assert!(y["allreduce_bytes_per_step"].as_u64().unwrap() > 0, "{y}");
        assert_eq!(x["params"], y["params"], "step {}", x["step"]);
    }
    let (ea, eb) = (records(a, "eval"), records(b, "eval"));
    assert_eq!(ea.len(), eb.len(), "eval records");
    for (x, y) in ea.iter().zip(&eb) {
        for k in ["train_loss", "valid_loss", "valid_accuracy"] {
            close(
                x[k].as_f64().unwrap(),
                y[k].as_f64().unwrap(),
                &format!("{k} at step {} with {n} processes", x["step"]),
            );
        }
        if let Some(auc) = x.get("valid_auc") {
            close(
                auc.as_f64().unwrap(),
                y["valid_auc"].as_f64().unwrap(),
                "AUC",
            );
        }
    }
    for kind in ["truncate", "stage"] {
        let strip = |v: Vec<serde_json::Value>| -> Vec<serde_json::Value> {
            v.into_iter()
                .map(|mut r| {
                    // The stage record's size is a float of the gates: compared above via loss.
                    r.as_object_mut().unwrap().remove("size");
                    r.as_object_mut().unwrap().remove("target_size");
                    r.as_object_mut().unwrap().remove("compression");
                    r
                })
                .collect()
        };
        assert_eq!(
            strip(records(a, kind)),
            strip(records(b, kind)),
            "{kind} records (ranks) with {n} processes"
        );
    }
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(b.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["processes"], n, "report.json");
    assert!(report["comm_seconds"].as_f64().unwrap() > 0.0, "{report}");
}

fn bytes(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

// ---- classifier --------------------------------------------------------------------------

/// A classifier: 120 training rows, batch 8 (15 steps per epoch; 3 processes get 2, 3, 3
/// rows), 3 epochs. `tt`: TT layers with a rank schedule whose late stage starts after
/// epoch 1 and truncates every 3 steps (fast gates, so it prunes).
fn classifier_config(dir: &Path, tt: bool, extra: &str) -> PathBuf {
    let rows = Tsv {
        rows: 160,
        synonyms: true,
        word_orders: false,
    };
    let (data, vocab) = write_tsv(dir, rows);
    let c = Classifier {
        model: &tt_layouts(tt),
        lr_gates: 0.1,
        epochs: 3,
        warmup_steps: 5,
        extra,
    };
    write_classifier(dir, "run.toml", &data, &vocab, &c)
}

const RANK: &str = "checkpoint_every = 4\n\n[rank]\nlate_after_epochs = 1\ntarget_ratio = 0.5\ntarget_loss = 0.2\ntruncate_every = 3";

#[test]
fn a_rank_adaptive_classifier_on_2_and_3_processes_follows_one_and_reruns_bit_for_bit() {
    let dir = tempdir("mpi-classifier");
    let cfg = classifier_config(&dir, true, RANK);
    let one = dir.join("one");
    train(1, &cfg, &one, &[]);
    assert!(!records(&one, "truncate").is_empty(), "the run truncated");
    for n in [2, 3] {
        let run = dir.join(format!("n{n}"));
        train(n, &cfg, &run, &[]);
        same_run(&one, &run, n, 30);
    }
    let again = dir.join("n3-again");
    train(3, &cfg, &again, &[]);
    assert!(
        bytes(&dir.join("n3/model.safetensors")) == bytes(&again.join("model.safetensors")),
        "a rerun on 3 processes gives other weights"
    );
    // Only process 0 wrote: one metrics line per record, not one per process.
    assert_eq!(records(&again, "train").len(), records(&one, "train").len());
    std::fs::remove_dir_all(&dir).ok();
}

/// GaLore: one projection (rank 1, from the first step's gradient) keeps the processes' runs
/// within 1e-5 of one process, through a stop on 2 processes and a resume on 3. Refreshed
/// low-rank projections are not compared across N: on this tiny model a change of the
/// gradients in the last bits moves GaLore's losses by ~1e-4 even in one process (measured:
/// lr_other 0.01 → 0.0100000005 moves a rank-2 GaLore run's losses by up to 5.5e-4, an AdamW
/// run's by 2.2e-7), because the top-r singular subspace of a gradient with close singular
/// values is ill-conditioned. What holds there is determinism: a rerun with the same N is
/// bit-identical.
#[test]
fn galore_on_2_and_3_processes_follows_one_resumes_across_n_and_reruns_bit_for_bit() {
    let dir = tempdir("mpi-galore");
    let cfg = classifier_config(
        &dir,
        false,
        "checkpoint_every = 4\n\n[galore]\nrank = 1\nupdate_every = 1000",
    );
    let one = dir.join("one");
    train(1, &cfg, &one, &[]);
    let run = dir.join("resumed");
    let text = train(2, &cfg, &run, &["--stop-after-steps", "22"]);
    assert!(text.contains("stopped after 22 steps"), "{text}");
    let (code, text) = launch(
        3,
        &["--threads", "1", "train", "--resume", s(&run), "--quiet"],
    );
    assert_eq!(code, 0, "{text}");
    same_run(&one, &run, 3, 30);
    let refreshed = classifier_config(&dir, false, "[galore]\nrank = 4\nupdate_every = 5");
    let (a, b) = (dir.join("a"), dir.join("b"));
    train(2, &refreshed, &a, &[]);
    train(2, &refreshed, &b, &[]);
    assert!(
        bytes(&a.join("model.safetensors")) == bytes(&b.join("model.safetensors")),
        "a GaLore rerun on 2 processes gives other weights"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Distillation: every process runs the teacher on its own rows, and the loss terms and
/// gradients (means over sequences) combine to one process's.
#[test]
fn a_distilled_classifier_on_2_processes_follows_one() {
    let dir = tempdir("mpi-distill");
    let teacher = dir.join("teacher");
    train(1, &classifier_config(&dir, false, ""), &teacher, &[]);
    let distill = format!(
        "checkpoint_every = 4\n\n[distill]\nteacher = \"{}\"\nlogit_weight = 0.5\nhidden_weight = 0.5\nlayers = [[0, 0], [1, 1]]",
        teacher.display()
    );
    let cfg = classifier_config(&dir, true, &distill);
    let one = dir.join("one");
    train(1, &cfg, &one, &[]);
    let two = dir.join("two");
    train(2, &cfg, &two, &[]);
    same_run(&one, &two, 2, 30);
    for (x, y) in records(&one, "train").iter().zip(&records(&two, "train")) {
        for term in ["task", "logits", "hidden"] {
            close(
                x["loss_terms"][term].as_f64().unwrap(),
                y["loss_terms"][term].as_f64().unwrap(),
                &format!("{term} term at step {}", x["step"]),
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_failing_process_ends_the_job_with_its_error() {
    let dir = tempdir("mpi-fail");
    let cfg = classifier_config(&dir, false, "");
    // Process 0 cannot lock the run directory (held here); the others would wait for it in
    // the first step's all-reduce without the abort.
    let run = dir.join("run");
    std::fs::create_dir_all(&run).unwrap();
    let lock = std::fs::File::create(run.join(".lock")).unwrap();
    lock.lock().unwrap();
    let (code, text) = launch(
        2,
        &["--threads", "1", "train", "--config", s(&cfg), "--quiet"],
    );
    assert_ne!(code, 0, "{text}");
    assert_ne!(code, 124, "the job hung until the timeout: {text}");
    assert!(text.contains("in use by another comera process"), "{text}");
    drop(lock);
    // A global batch smaller than the number of processes is refused by every process.
    let (code, text) = launch(
        3,
        &[
            "--threads",
            "1",
            "train",
            "--config",
            s(&cfg),
            "--batch-size",
            "2",
            "--quiet",
        ],
    );
    assert_ne!(code, 0, "{text}");
    assert_ne!(code, 124, "the job hung until the timeout: {text}");
    assert!(text.contains("smaller than the 3 processes"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

// ---- masked LM ---------------------------------------------------------------------------

/// 40 `.rs` files of short repeated patterns and their 13-word vocabulary.
fn write_corpus(dir: &Path) -> (PathBuf, PathBuf) {
    common::write_corpus(dir, &[], false)
}

#[test]
fn masked_lm_pretraining_on_2_and_3_processes_follows_one() {
    let dir = tempdir("mpi-mlm");
    let (code, vocab) = write_corpus(&dir);
    let cfg = format!(
        r#"
[data]
source = "corpus"
corpus = ["{code}"]
extensions = ["rs"]
vocab = "{vocab}"
valid_fraction = 0.2

[model]
head = "mlm"
vocab_size = 13
seq_len = 16
d_model = 16
heads = 2
ffn = 32
layers = 1
dropout = 0.0
pre_ln = true
tt_linear = true
ttm_embedding = true
attn_tt = {{ in_modes = [4, 4], out_modes = [4, 4], rank = 3 }}
ffn_up_tt = {{ in_modes = [4, 4], out_modes = [4, 8], rank = 3 }}
ffn_down_tt = {{ in_modes = [4, 8], out_modes = [4, 4], rank = 3 }}
word_ttm = {{ vocab_modes = [2, 7], dim_modes = [4, 4], rank = 3 }}
mlm_decoder_tt = {{ in_modes = [4, 4], out_modes = [2, 7], rank = 3 }}

[optim]
lr_cores = 0.01
lr_gates = 0.01
lr_other = 0.01

[train]
warmup_steps = 5
log_every = 5
out_dir = "{out}"

[[train.phases]]
seq_len = 8
batch_size = 8
epochs = 2
max_steps_per_epoch = 10

[[train.phases]]
seq_len = 16
batch_size = 4
epochs = 1
max_steps_per_epoch = 10
"#,
        code = code.display(),
        vocab = vocab.display(),
        out = dir.join("run").display()
    );
    let cfg_path = dir.join("mlm.toml");
    std::fs::write(&cfg_path, cfg).unwrap();
    let one = dir.join("one");
    train(1, &cfg_path, &one, &[]);
    for n in [2, 3] {
        let run = dir.join(format!("n{n}"));
        train(n, &cfg_path, &run, &[]);
        same_run(&one, &run, n, 30);
    }
    std::fs::remove_dir_all(&dir).ok();
}

// ---- DLRM --------------------------------------------------------------------------------

#[test]
fn a_rank_adaptive_dlrm_on_2_processes_follows_one_and_resumes_on_3() {
    let dir = tempdir("mpi-dlrm");
    let train_rows = synth(&dir, "train.tsv", "3000", "1");
    let valid = synth(&dir, "valid.tsv", "500", "2");
    let cfg = format!(
        r#"
[dlrm]
embedding_dim = 8
bottom_mlp = [16]
top_mlp = [16]
tables = "auto"
ttm_threshold = 500
ttm_cores = 2
ttm_rank = 4

[data]
source = "criteo"
train = "{}"
valid = "{}"
total_rows = 20000
mapping = "modulo"

[train]
epochs = 2
batch_size = 100
log_every = 5
checkpoint_every = 10
out_dir = "{}"

[optim]
lr_gates = 0.1

[rank]
gamma = 50.0
truncate_every = 10
min_rank = 1
normalise_gates = false
"#,
        s(&train_rows),
        s(&valid),
        s(&dir.join("run"))
    );
    let cfg_path = dir.join("dlrm.toml");
    std::fs::write(&cfg_path, cfg).unwrap();
    let one = dir.join("one");
    train(1, &cfg_path, &one, &[]);
    assert!(!records(&one, "truncate").is_empty(), "the run truncated");
    let two = dir.join("n2");
    train(2, &cfg_path, &two, &[]);
    same_run(&one, &two, 2, 30);
    let resumed = dir.join("resumed");
    train(2, &cfg_path, &resumed, &["--stop-after-steps", "20"]);
    let (code, text) = launch(
        3,
        &[
            "--threads",
            "1",
            "train",
            "--resume",
            s(&resumed),
            "--quiet",
        ],
    );
    assert_eq!(code, 0, "{text}");
    same_run(&one, &resumed, 3, 30);
    std::fs::remove_dir_all(&dir).ok();
}
