//! `comera report`: a results page from tiny runs (a rank-adaptive TT/TTM run that switches to
//! its late stage, a dense run, a stopped run), checked against the runs' own reports.

use crate::common::*;

#[test]
fn a_report_tables_tiny_runs_from_their_directories() {
    let dir = tempdir("report");
    let (data, vocab) = write_data(&dir);
    // 3 epochs of 4 steps; the late stage from step 6, truncating every 2 steps.
    let cfg = write_config(
        &dir,
        &data,
        &vocab,
        true,
        "max_steps_per_epoch = 4\n\n[rank]\nlate_after_steps = 6\ntarget_ratio = 0.5\ntruncate_every = 2\n",
    );
    let (tt, dense, stopped) = (dir.join("tt"), dir.join("dense"), dir.join("stopped"));
    // Trained on other data (fewer examples): no dense run shares its data.
    let other = dir.join("other");
    for (out, extra) in [
        (&tt, &["--set", "train.epochs=3"][..]),
        (&dense, &["--set", "train.epochs=3", "--dense"][..]),
        (&stopped, &["--set", "train.stop_after_steps=5"][..]),
        (
            &other,
            &["--set", "train.epochs=1", "--set", "data.max_train=16"][..],
        ),
    ] {
        let (code, text) = comera(
            &[
                &["--threads", "2", "train", "--quiet", "--config", s(&cfg)][..],
                extra,
                &["--out", s(out)][..],
            ]
            .concat(),
        );
        assert_eq!(code, 0, "{text}");
    }
    let out = dir.join("report");
    let (code, text) = comera(&[
        "report",
        s(&tt),
        s(&dense),
        s(&stopped),
        s(&other),
        "--out",
        s(&out),
        "--paper",
        "six-encoder",
        "--title",
        "tiny table",
        "--command",
        "comera train --config run.toml",
    ]);
    assert_eq!(code, 0, "{text}");
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.starts_with("# tiny table"), "{md}");
    // Each arm's row holds the final accuracy its own report gives, and its kind.
    let row = |name: &str| {
        md.lines()
            .find(|l| l.starts_with(&format!("| {name}")))
            .unwrap_or_else(|| panic!("no row for {name}:\n{md}"))
            .to_string()
    };
    for (run, arm) in [(&tt, "CoMERA: TT/TTM, rank-adaptive"), (&dense, "dense")] {
        let r = report_json(run);
        let acc = r["final_valid"]["accuracy"].as_f64().unwrap();
        let line = row(run.file_name().unwrap().to_str().unwrap());
        assert!(line.contains(&format!("| {arm} |")), "{line}");
        assert!(line.contains(&format!("| {acc:.4} |")), "{acc}: {line}");
        assert!(line.contains("| 3/3 |"), "{line}");
        assert!(line.contains(&format!("| {} |", r["params"])), "{line}");
    }
    // The TT run's TT/TTM compression at start, switch and end, from its own rank lists.
    let r = report_json(&tt);
    let tt_ratio = |k: &str| {
        let layers = r[k].as_array().unwrap();
        let dense: f64 = layers.iter().map(|l| l["dense"].as_f64().unwrap()).sum();
        let size: f64 = layers.iter().map(|l| l["size"].as_f64().unwrap()).sum();
        format!("{:.1}×", dense / size)
    };
    let want = format!(
        "{} → {} → {}",
        tt_ratio("ranks_start"),
        tt_ratio("ranks_switch"),
        tt_ratio("ranks_end")
    );
    assert!(row("tt").contains(&want), "{want}: {}", row("tt"));
    // Each run's baseline is the dense run on its data: the dense run's ratios are 1, and the
    // run on other data has none.
    assert!(row("dense").contains("| 1.00× |"), "{}", row("dense"));
    assert!(
        md.contains("(the dense run on the same data: tt → dense, dense → dense, stopped → dense)"),
        "{md}"
    );
    let other = row("other");
    let cells: Vec<&str> = other.split('|').map(str::trim).collect();
    assert_eq!(
        (cells[11], cells[13]),
        ("–", "–"),
        "time and memory ratios: {other}"
    );
    assert!(row("stopped (stopped)").contains("| 1/6 |"), "{md}");
    assert!(
        md.contains("## Ranks of tt (late stage from step 6)"),
        "{md}"
    );
    assert!(md.contains("The paper's figures (GPU"), "{md}");
    assert!(md.contains("comera train --config run.toml"), "{md}");
    let figures: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(figures.as_array().unwrap().len(), 4);
    assert_eq!(figures[0]["switch_step"], 6);
    for png in ["score.png", "compression.png", "cost.png"] {
        let bytes = std::fs::read(out.join(png)).unwrap();
        assert!(bytes.starts_with(b"\x89PNG"), "{png}");
    }

    // A directory that is not a run is named; so is an unknown paper table or baseline.
    let (code, text) = comera(&["report", s(&dir), "--out", s(&out)]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("run.toml"), "{text}");
    let (code, text) = comera(&["report", s(&tt), "--out", s(&out), "--paper", "mnli"]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("--paper") && text.contains("six-encoder"),
        "{text}"
    );
    let (code, text) = comera(&["report", s(&tt), "--out", s(&out), "--baseline", "x"]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("--baseline") && text.contains("tt"), "{text}");
    std::fs::remove_dir_all(&dir).ok();
}
