//! `--device` and `train.device` (issue 48's host side): what a device cannot do, or a device
//! that is not there, ends the command with status 2 and a message that names it, before
//! anything is written; `cpu` is the default and changes nothing. These tests hold on a
//! machine with a GPU too: where one answers, the run either trains or is refused for a named
//! reason, never anything else.

use std::path::Path;

use crate::common::{comera, s, small_run, snapshot, tempdir, write_config, write_data};

/// `text` ends the command as a device error: status 2, `error: device cuda:N…`, and `wanted`.
fn assert_device_error(code: i32, text: &str, wanted: &str, case: &str) {
    assert_eq!(code, 2, "{case}: {text}");
    assert!(text.contains("error: device cuda:"), "{case}: {text}");
    assert!(
        text.contains(wanted),
        "{case}: expected `{wanted}` in: {text}"
    );
}

/// Train args of the tests' small TT classifier into `out`, on `device`.
fn train<'a>(cfg: &'a Path, out: &'a Path, device: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "train",
        "--config",
        s(cfg),
        "--quiet",
        "--epochs",
        "1",
        "--out",
        s(out),
    ];
    args.extend_from_slice(&["--device", device]);
    args.extend_from_slice(extra);
    args
}

/// What the GPU does not do yet is refused by name, with or without a GPU, and nothing is
/// created: GaLore (here on the dense model, as the paper's six-encoder table runs it).
#[test]
fn what_the_gpu_does_not_do_yet_is_refused_by_name_before_anything_is_written() {
    let dir = tempdir("device-not-yet");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 2");
    let out = dir.join("gpu-run");
    let extra = ["--dense", "--set", "galore.rank=4"];
    let (code, text) = comera(&train(&cfg, &out, "cuda", &extra));
    assert_device_error(code, &text, "GaLore ([galore])", "galore.rank=4");
    assert!(text.contains("--device cpu"), "says what to do: {text}");
    assert!(!out.exists(), "created {}", out.display());
    let _ = std::fs::remove_dir_all(dir);
}

/// The classifier's step, with the rank schedule (on in this config) or without, with
/// gradient accumulation, and with layers allowed to die (`rank.min_rank = 0`), is what the
/// GPU takes: without a GPU the command ends with status 2 naming what is missing (driver,
/// device or NVRTC) and writes nothing; with one it trains, and the run reads back on the CPU.
#[test]
fn a_gpu_run_trains_or_names_what_is_missing() {
    let dir = tempdir("device-missing");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 2");
    for (name, extra) in [
        ("rank-on", &[][..]),
        ("rank-off", &["--set", "rank.enabled=false"][..]),
        ("accumulated", &["--set", "train.accumulate_steps=2"][..]),
        ("min-rank-0", &["--set", "rank.min_rank=0"][..]),
    ] {
        let out = dir.join(name);
        let (code, text) = comera(&train(&cfg, &out, "cuda", extra));
        if code == 0 {
            println!("{name}: a GPU answered: {text}");
            let (code, text) = comera(&["eval", s(&out)]);
            assert_eq!(code, 0, "{name}: eval on the CPU of a GPU run: {text}");
            continue;
        }
        assert_eq!(code, 2, "{name}: {text}");
        assert!(text.contains("error: device cuda:0"), "{name}: {text}");
        assert!(
            MISSING.iter().any(|n| text.contains(n)),
            "{name}: names what is missing: {text}"
        );
        assert!(!out.exists(), "{name}: created {}", out.display());
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A stopped CPU run (with the rank schedule) resumed on a missing GPU: refused for what is
/// missing with status 2, every file of the run as it was; it then resumes on the CPU. (Where
/// a GPU answers, the run finishes there.)
#[test]
fn resuming_on_a_missing_gpu_leaves_the_run_as_it_was() {
    let dir = tempdir("device-resume");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, true, "max_steps_per_epoch = 4");
    let run = dir.join("run");
    let (code, text) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--quiet",
        "--epochs",
        "1",
        "--stop-after-steps",
        "2",
    ]);
    assert_eq!(code, 0, "{text}");
    let before = snapshot(&run);
    let (code, text) = comera(&["train", "--resume", s(&run), "--device", "cuda", "--quiet"]);
    if code == 0 {
        // The run finished on the GPU: nothing is left to resume on the CPU.
        println!("a GPU answered: {text}");
        let _ = std::fs::remove_dir_all(dir);
        return;
    }
    let wanted = MISSING
        .iter()
        .find(|n| text.contains(*n))
        .unwrap_or(&"driver");
    assert_device_error(code, &text, wanted, "resume on cuda");
    assert!(snapshot(&run) == before, "the run directory changed");
    let (code, text) = comera(&["train", "--resume", s(&run), "--device", "cpu", "--quiet"]);
    assert_eq!(code, 0, "resume on the CPU: {text}");
    let _ = std::fs::remove_dir_all(dir);
}

/// The device string: a bad one is a usage error that says how GPUs are named; a flag and a
/// setting of the same field are refused; `cpu` is the default and left out of the config.
#[test]
fn device_strings_flags_and_settings() {
    let (dir, cfg, _) = small_run("device-strings");
    let (code, text) = comera(&["train", "--config", s(&cfg), "--device", "gpu"]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("GPUs are named `cuda`"), "{text}");
    let (code, text) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--device",
        "cpu",
        "--set",
        "train.device=cuda",
    ]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("--device sets train.device too"), "{text}");
    let print = |extra: &[&str]| {
        let mut args = vec!["train", "--config", s(&cfg), "--print-config"];
        args.extend_from_slice(extra);
        let (code, text) = comera(&args);
        assert_eq!(code, 0, "{text}");
        text
    };
    assert!(!print(&[]).contains("\ndevice ="), "cpu is written out");
    assert!(!print(&["--device", "cpu"]).contains("\ndevice ="));
    assert!(print(&["--device", "cuda:1"]).contains("device = \"cuda:1\""));
    assert!(print(&["--set", "train.device=cuda"]).contains("device = \"cuda:0\""));
    let (code, text) = comera(&["train", "--config", s(&cfg), "--set", "train.device=tpu"]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("train.device"), "names the field: {text}");
    let _ = std::fs::remove_dir_all(dir);
}

/// `bench step --device cuda`: the paper model's step on the GPU, or, without one, status 2
/// naming what is missing; the CPU benchmark's shape flags are refused there.
#[test]
fn the_step_benchmark_on_a_gpu_runs_or_names_what_is_missing() {
    let (code, text) = comera(&["bench", "step", "--device", "cuda", "--seq-len", "64"]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("--seq-len: the GPU step benchmark"), "{text}");
    let (code, text) = comera(&[
        "bench", "step", "--device", "cuda", "--batch", "1", "--models", "tt", "--json",
    ]);
    if code == 0 {
        println!("a GPU answered: {text}");
        assert!(text.contains("\"graph_ms_median\""), "{text}");
        return;
    }
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("error: device cuda:0"), "{text}");
}

/// What a command on a missing GPU names: the driver, the device, NVRTC, cuBLAS or memory.
/// `text` ends the command as a GPU that is not there: status 2, `error: device cuda:N…`,
/// naming what is missing ([`MISSING`]).
pub(crate) fn assert_gpu_missing(code: i32, text: &str, case: &str) {
    let wanted = MISSING
        .iter()
        .find(|n| text.contains(*n))
        .unwrap_or(&"driver");
    assert_device_error(code, text, wanted, case);
}

const MISSING: [&str; 7] = [
    "NVIDIA driver",
    "driver",
    "no CUDA device",
    "NVRTC",
    "libnvrtc",
    "cuBLAS",
    "memory",
];

/// `eval` and `predict --device cuda` on a trained classifier: without a GPU, status 2, a
/// message that names what is missing and says to use `--device cpu`, and nothing written
/// (no `--out` file, no prediction on standard output); with one, they run, and `predict`
/// gives the CPU's labels. `--device cpu` is the default: the same output as no flag.
#[test]
fn eval_and_predict_on_a_gpu_run_there_or_name_what_is_missing_writing_nothing() {
    let (dir, _, run) = small_run("device-infer");
    let texts = ["a good dress", "the fit was very bad", "great color"];
    let predict = |extra: &[&str]| {
        let mut args = vec!["predict", s(&run), "--json"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&texts);
        comera(&args)
    };
    // The CPU: no flag and `--device cpu` alike, on stdout and into --out.
    let (code, plain) = comera(&["eval", s(&run)]);
    assert_eq!(code, 0, "{plain}");
    assert!(plain.contains("accuracy"), "{plain}");
    let (code, cpu) = comera(&["eval", s(&run), "--device", "cpu"]);
    assert_eq!((code, &cpu), (0, &plain), "eval --device cpu");
    let (code, plain_p) = predict(&[]);
    assert_eq!(code, 0, "{plain_p}");
    assert_eq!(plain_p.lines().count(), texts.len(), "{plain_p}");
    let (code, cpu_p) = predict(&["--device", "cpu"]);
    assert_eq!((code, &cpu_p), (0, &plain_p), "predict --device cpu");
    let cpu_file = dir.join("cpu.jsonl");
    let (code, text) = predict(&["--device", "cpu", "--out", s(&cpu_file)]);
    assert_eq!(
        (code, text.as_str()),
        (0, ""),
        "predict --out prints nothing"
    );
    assert_eq!(
        std::fs::read_to_string(&cpu_file).unwrap(),
        plain_p,
        "--out holds the lines standard output shows"
    );
    // An --out that is a directory is refused before any prediction, naming the flag.
    let (code, text) = predict(&["--out", s(&dir)]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("--out") && text.contains("directory"),
        "{text}"
    );
    assert!(!text.contains(texts[0]), "predicted anyway: {text}");
    let labels = |jsonl: &str| -> Vec<String> {
        jsonl
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["label"].to_string())
            .collect()
    };
    for device in ["cuda", "cuda:0"] {
        let (code, text) = comera(&["eval", s(&run), "--device", device]);
        if code == 0 {
            println!("a GPU answered: {text}");
            assert!(text.contains("accuracy"), "{text}");
        } else {
            assert_device_error(code, &text, "--device cpu", &format!("eval {device}"));
            assert!(
                MISSING.iter().any(|n| text.contains(n)),
                "names what is missing: {text}"
            );
            assert!(!text.contains("accuracy"), "eval {device} printed: {text}");
        }
        let out = dir.join(format!("{device}.jsonl").replace(':', "-"));
        let (code, text) = predict(&["--device", device, "--out", s(&out)]);
        if code == 0 {
            println!("a GPU answered: {text}");
            let got = std::fs::read_to_string(&out).unwrap();
            assert_eq!(labels(&got), labels(&plain_p), "the GPU's labels");
            continue;
        }
        assert_device_error(code, &text, "--device cpu", &format!("predict {device}"));
        assert!(
            MISSING.iter().any(|n| text.contains(n)),
            "names what is missing: {text}"
        );
        assert!(!out.exists(), "predict {device} created {}", out.display());
        for t in texts {
            assert!(
                !text.contains(t),
                "predict {device} printed a prediction: {text}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// A pre-LN classifier evaluated and predicted on the GPU: where one answers, both run;
/// without one, status 2 naming what is missing, and nothing written (no `--out` file). A bad
/// device string on `eval` and `predict` is a usage error that says how GPUs are named.
#[test]
fn eval_and_predict_of_a_pre_ln_model_on_the_gpu_and_bad_device_strings() {
    let dir = tempdir("device-infer-preln");
    let (data, vocab) = write_data(&dir);
    let cfg = write_config(&dir, &data, &vocab, false, "max_steps_per_epoch = 2");
    let run = dir.join("run");
    let (code, text) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--quiet",
        "--epochs",
        "1",
        "--set",
        "model.pre_ln=true",
    ]);
    assert_eq!(code, 0, "{text}");
    let (code, text) = comera(&["eval", s(&run), "--device", "cuda"]);
    if code != 0 {
        assert_gpu_missing(code, &text, "eval pre-LN");
    }
    let out = dir.join("p.txt");
    let (code, text) = comera(&[
        "predict",
        s(&run),
        "--device",
        "cuda:0",
        "--out",
        s(&out),
        "a good dress",
    ]);
    if code != 0 {
        assert_gpu_missing(code, &text, "predict pre-LN");
        assert!(!out.exists(), "created {}", out.display());
    }
    let (code, text) = comera(&["predict", s(&run), "--device", "cpu", "a good dress"]);
    assert_eq!(code, 0, "the CPU predicts with a pre-LN model: {text}");
    for cmd in ["eval", "predict"] {
        for bad in ["gpu", "cuda:x", "CUDA"] {
            let mut args = vec![cmd, s(&run), "--device", bad];
            if cmd == "predict" {
                args.push("a text");
            }
            let (code, text) = comera(&args);
            assert_eq!(code, 2, "{cmd} --device {bad}: {text}");
            assert!(
                text.contains("--device") && text.contains("cuda:N"),
                "{cmd} --device {bad} names the accepted forms: {text}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `comera devices` lists the CPU and each GPU, or says why there is none (status 0 either
/// way); `--json` holds the same; `--open` opens each GPU as a run would and ends with status 2
/// unless one opened (without a GPU: 2, naming what is missing).
#[test]
fn devices_lists_the_cpu_and_each_gpu_or_why_there_is_none() {
    let (code, text) = comera(&["devices"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.starts_with("cpu "), "{text}");
    let gpus = text.lines().filter(|l| l.starts_with("cuda:")).count();
    let none = text.lines().any(|l| l.starts_with("cuda     none: "));
    assert!(gpus > 0 || none, "a GPU line or why there is none: {text}");
    if none {
        assert!(MISSING.iter().any(|m| text.contains(m)), "{text}");
    }
    assert!(
        text.contains("\nnvrtc ") && text.contains("\ncublas "),
        "{text}"
    );
    let (code, json) = comera(&["devices", "--json"]);
    assert_eq!(code, 0, "{json}");
    let v: serde_json::Value = serde_json::from_str(json.trim()).expect(&json);
    assert_eq!(
        v["cuda"]["gpus"].as_array().map(Vec::len),
        Some(gpus),
        "{json}"
    );
    assert_eq!(v["cuda"]["problem"].is_string(), none, "{json}");
    assert!(v["cpu"]["threads"].as_u64().unwrap_or(0) >= 1, "{json}");
    let (code, text) = comera(&["devices", "--open"]);
    if code == 0 {
        assert!(text.contains("  ready"), "{text}");
    } else {
        assert_eq!(code, 2, "{text}");
        assert!(
            none || text.contains("cannot be used: "),
            "says why no GPU opened: {text}"
        );
    }
}
