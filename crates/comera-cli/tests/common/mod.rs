//! Helpers shared by the CLI's end-to-end tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

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

/// A fresh directory under the system temp dir, unique per test and process.
pub fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("comera-train-test-{tag}-{}", std::process::id()));
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

/// Records without their wall-clock fields (tokens/s, ms/step, seconds), for comparing runs.
pub fn untimed(records: Vec<serde_json::Value>) -> Vec<serde_json::Value> {
    records
        .into_iter()
        .map(|mut r| {
            for k in ["tokens_per_s", "ms_per_step", "seconds"] {
                r.as_object_mut().unwrap().remove(k);
            }
            r
        })
        .collect()
}
