//! The `comera` binary end to end.

use crate::common::comera;
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    std::env::var("COMERA_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../comera-refcase/fixtures")
        })
}

#[test]
fn verify_passes_every_tt_linear_case() {
    let mut files: Vec<String> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("tt_"))
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert!(files.len() >= 7);
    let mut args = vec!["verify"];
    args.extend(files.iter().map(String::as_str));
    let (code, text) = comera(&args);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains(&format!("{} passed, 0 failed", files.len())),
        "{text}"
    );
    for path in ["merged", "sequential", "dense", "planner"] {
        assert!(text.contains(path), "report lists the {path} run: {text}");
    }
}

#[test]
fn verify_passes_every_ttm_case() {
    let mut files: Vec<String> = std::fs::read_dir(fixtures())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("ttm_"))
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert!(files.len() >= 3);
    let mut args = vec!["verify"];
    args.extend(files.iter().map(String::as_str));
    let (code, text) = comera(&args);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("naive") && text.contains("optimized"),
        "{text}"
    );
}

#[test]
fn verify_fails_on_missing_or_corrupt_files() {
    let dir = std::env::temp_dir().join(format!("comera-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.safetensors");
    std::fs::write(&bad, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json").unwrap();
    let (code, text) = comera(&["verify", bad.to_str().unwrap()]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("bad.safetensors") && text.contains("not a valid safetensors"),
        "{text}"
    );
    let (code, text) = comera(&["verify", dir.join("nope.safetensors").to_str().unwrap()]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("cannot read"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn factor_proposes_the_paper_layout() {
    let (code, text) = comera(&["factor", "768", "768", "--budget", "20000"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("[12, 8, 8]"), "{text}");
}

#[test]
fn factor_handles_primes_huge_widths_and_refuses_absurd_ones() {
    let (code, text) = comera(&["factor", "997", "768"]);
    assert_eq!(code, 0, "{text}");
    assert!(
        text.contains("N = 997 has no balanced 3-factor layout")
            && text.contains("1000 = [10, 10, 10]"),
        "{text}"
    );
    let (code, text) = comera(&["factor", "4294967296", "4294967296"]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("18446744073709551616 parameters"), "{text}");
    assert!(!text.contains(" 0 core parameters"), "{text}");
    let (code, text) = comera(&["factor", "18446744073709551615", "768"]);
    assert_ne!(code, 0, "{text}");
    assert!(text.contains("beyond 4294967296"), "{text}");
}

#[test]
fn data_list_marks_cached_sets_with_their_size() {
    let dir = std::env::temp_dir().join(format!("comera-data-list-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("bert-vocab")).unwrap();
    std::fs::write(
        dir.join("bert-vocab/vocab.txt"),
        vec![b'a'; 3 * 1048576 / 2],
    )
    .unwrap();
    let (code, text) = comera(&["data", "list", "--cache-dir", dir.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}");
    let line = |name: &str| {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no {name} in\n{text}"))
            .to_string()
    };
    assert!(line("bert-vocab").contains("cached 1.5 MiB"), "{text}");
    assert!(!line("reviews").contains("cached"), "{text}");
    assert!(!line("rust-src").contains("cached"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bench_emits_json_lines() {
    let (code, text) = comera(&[
        "bench",
        "tt-linear",
        "--layers",
        "768x768",
        "--tokens",
        "4",
        "--seconds",
        "0.01",
        "--json",
        "--rank",
        "4",
    ]);
    assert_eq!(code, 0, "{text}");
    let rows: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 5);
    for r in &rows {
        assert_eq!(r["layer"], "768x768");
        assert_eq!(r["tokens"], 4);
        assert!(r["median_ms"].as_f64().unwrap() > 0.0);
    }
}
