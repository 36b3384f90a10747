//! DLRM from the command line: `comera synth-criteo` writes a Criteo-format file, `comera train`
//! trains on it when the config has a `[dlrm]` table (TTM and dense tables), and bad data and
//! configs give clear errors (no network).

use crate::common::{
    assert_same_run, comera, every_command_works_on, records, s, synth_criteo as synth, tempdir,
};
use std::path::{Path, PathBuf};

fn config(dir: &Path, train: &Path, valid: &Path, extra: &str) -> PathBuf {
    let text = format!(
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
max_malformed = 5

[train]
epochs = 2
batch_size = 100
log_every = 5
out_dir = "{}"
{extra}
"#,
        s(train),
        s(valid),
        s(&dir.join("run"))
    );
    let p = dir.join("dlrm.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn trains_a_ttm_dlrm_on_a_criteo_file_and_reports() {
    let dir = tempdir("train");
    let train = synth(&dir, "train.tsv", "3000", "1");
    let valid = synth(&dir, "valid.tsv", "500", "2");
    let cfg = config(&dir, &train, &valid, "");
    let (code, out) = comera(&["--threads", "2", "train", "--config", s(&cfg), "--quiet"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("validation AUC"), "{out}");
    assert!(
        out.contains("samples/s") && out.contains("peak RSS"),
        "{out}"
    );
    assert!(out.contains("ttm 5"), "the largest tables are TTM: {out}");
    let run = dir.join("run");
    for f in [
        "config.toml",
        "metrics.jsonl",
        "curves.png",
        "model.safetensors",
        "model.toml",
    ] {
        assert!(run.join(f).exists(), "{f} missing");
    }
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["steps"], 60);
    let auc = report["final_valid"]["auc"].as_f64().unwrap();
    assert!(auc > 0.5 && auc <= 1.0, "{auc}");
    assert!(report["table_params"].as_u64() < report["dense_table_params"].as_u64());
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(
        metrics.lines().filter(|l| l.contains("\"eval\"")).count(),
        2
    );
    exports_tables_dense_and_as_trained(&dir, &run);

    // The same run with dense tables, and determinism: the same seed gives the same AUC.
    let (code, out) = comera(&[
        "--threads",
        "2",
        "train",
        "--config",
        s(&cfg),
        "--quiet",
        "--overwrite",
        "--dense",
        "--epochs",
        "1",
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("1.0x smaller"), "{out}");
    let a = comera(&[
        "--threads",
        "2",
        "train",
        "--config",
        s(&cfg),
        "--quiet",
        "--overwrite",
        "--epochs",
        "1",
    ])
    .1;
    let b = comera(&[
        "--threads",
        "2",
        "train",
        "--config",
        s(&cfg),
        "--quiet",
        "--overwrite",
        "--epochs",
        "1",
    ])
    .1;
    let auc_of = |t: &str| t.split("validation AUC").nth(1).unwrap()[..8].to_string();
    assert_eq!(auc_of(&a), auc_of(&b));

    // Rank-adaptive training of the TTM tables: a strong size penalty prunes and truncates.
    let rcfg = config(
        &dir,
        &train,
        &valid,
        "[optim]\nlr_gates = 0.05\n[rank]\ngamma = 5.0\ntruncate_every = 10\nnormalise_gates = false\n",
    );
    let (code, out) = comera(&[
        "train",
        "--config",
        s(&rcfg),
        "--quiet",
        "--epochs",
        "1",
        "--overwrite",
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("Ranks of the TT/TTM layers") && out.contains("table.C1"),
        "{out}"
    );
    let metrics = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert!(metrics.contains("\"truncate\""), "{metrics}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `comera export RUN --dense F --compressed G` of a TTM DLRM: G holds the parameters as
/// trained, byte for byte those of the run's `model.safetensors`; F the same, except that every
/// TTM table is one dense `<table>.weight` (rows × embedding_dim) in place of its cores and
/// gates.
fn exports_tables_dense_and_as_trained(dir: &Path, run: &Path) {
    let (dense, compressed) = (
        dir.join("dense.safetensors"),
        dir.join("compressed.safetensors"),
    );
    let (code, out) = comera(&[
        "export",
        s(run),
        "--dense",
        s(&dense),
        "--compressed",
        s(&compressed),
    ]);
    assert_eq!(code, 0, "{out}");
    let read = |p: &Path| std::fs::read(p).unwrap();
    let (trained, dense, compressed) = (
        read(&run.join("model.safetensors")),
        read(&dense),
        read(&compressed),
    );
    fn open(b: &[u8]) -> safetensors::SafeTensors<'_> {
        safetensors::SafeTensors::deserialize(b).unwrap()
    }
    let (trained, dense_st, compressed_st) = (open(&trained), open(&dense), open(&compressed));
    let names = |st: &safetensors::SafeTensors<'_>| {
        let mut n: Vec<String> = st.names().into_iter().map(String::from).collect();
        n.sort();
        n
    };
    assert_eq!(names(&compressed_st), names(&trained));
    for name in names(&trained) {
        assert_eq!(
            compressed_st.tensor(&name).unwrap().data(),
            trained.tensor(&name).unwrap().data(),
            "{name}"
        );
    }
    let tables: Vec<String> = names(&dense_st)
        .into_iter()
        .filter(|n| n.starts_with("table.") && n.ends_with(".weight"))
        .collect();
    assert!(
        !tables.is_empty(),
        "no dense table in {:?}",
        names(&dense_st)
    );
    for name in &tables {
        let prefix = format!("{}.", name.trim_end_matches(".weight"));
        assert!(
            !names(&dense_st)
                .iter()
                .any(|n| n != name && n.starts_with(&prefix)),
            "{prefix}: cores beside its dense table"
        );
        assert!(
            names(&trained).iter().any(|n| n.starts_with(&prefix)),
            "{prefix}: not a trained table"
        );
        let t = dense_st.tensor(name).unwrap();
        assert_eq!(t.shape()[1], 8, "{name}: embedding_dim");
        assert_eq!(t.data().len(), 4 * t.shape()[0] * t.shape()[1]);
        assert!(t.data().chunks(4).any(|b| b != [0; 4]), "{name}: all zero");
    }
    let (_, meta) = safetensors::SafeTensors::read_metadata(&dense).unwrap();
    let meta = meta.metadata().as_ref().unwrap();
    assert_eq!(meta["format"], "comera-dlrm");
    assert_eq!(meta["tables"], "dense");
}

#[test]
fn malformed_rows_are_counted_then_stop_the_run_with_line_numbers() {
    let dir = tempdir("malformed");
    let train = synth(&dir, "train.tsv", "400", "1");
    let valid = synth(&dir, "valid.tsv", "200", "2");
    // Three bad lines in the training file: tolerated (limit 5) and reported.
    let mut text = std::fs::read_to_string(&train).unwrap();
    text.push_str("1\t2\t3\n");
    text.push_str(&format!("0{}\tzz{}\n", "\t1".repeat(13), "\ta".repeat(25)));
    text.push_str(&format!("0\tx{}{}\n", "\t1".repeat(12), "\ta".repeat(26)));
    std::fs::write(&train, &text).unwrap();
    let cfg = config(&dir, &train, &valid, "");
    let (code, out) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--quiet",
        "--epochs",
        "1",
        "--overwrite",
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("3 malformed rows") && out.contains("401") && out.contains("402 (field C1"),
        "{out}"
    );
    // Over the limit: the run stops naming the file and the line.
    let bad = text.clone() + &"1\t2\n".repeat(3);
    std::fs::write(&train, bad).unwrap();
    let (code, out) = comera(&[
        "train",
        "--config",
        s(&cfg),
        "--quiet",
        "--epochs",
        "1",
        "--overwrite",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("train.tsv")
            && out.contains("more than 5 malformed")
            && out.contains("line 406"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_dlrm_configs_name_the_field() {
    let dir = tempdir("config");
    let p = dir.join("x.toml");
    std::fs::write(&p, "[dlrm]\nembedding_dims = 8\n").unwrap();
    let (code, out) = comera(&["train", "--config", s(&p)]);
    assert_eq!(code, 1);
    assert!(
        out.contains("x.toml") && out.contains("embedding_dims"),
        "{out}"
    );
    std::fs::write(&p, "[dlrm]\n[data]\nsource = \"criteo\"\n").unwrap();
    let (code, out) = comera(&["train", "--config", s(&p)]);
    assert_eq!(code, 1);
    assert!(out.contains("data.train"), "{out}");
    std::fs::write(&p, "[dlrm]\nttm_rank = 0\n").unwrap();
    let (code, out) = comera(&["train", "--config", s(&p), "--print-config"]);
    assert_eq!(code, 1);
    assert!(out.contains("dlrm.ttm_rank"), "{out}");
    std::fs::write(&p, "[dlrm]\n").unwrap();
    let (code, out) = comera(&["train", "--config", s(&p), "--print-config", "--dense"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("tables = \"dense\""), "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The MovieLens DLRM config of the repository, with `extra` appended.
fn movielens_config(dir: &Path, extra: &str) -> PathBuf {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/dlrm-movielens.toml");
    // Fast gates, so that a few dozen steps prune and truncate.
    let text = std::fs::read_to_string(repo)
        .unwrap()
        .replace("lr_gates = 0.001", "lr_gates = 0.05")
        + extra;
    let p = dir.join("movielens.toml");
    std::fs::write(&p, text).unwrap();
    p
}

#[test]
fn a_stopped_and_resumed_dlrm_run_matches_an_uninterrupted_one_bit_for_bit() {
    let dir = tempdir("resume");
    // Rank-adaptive tables, so the resumed run also has to continue the rank schedule and its
    // truncations exactly.
    let cfg = movielens_config(
        &dir,
        "\n[rank]\ngamma = 5.0\ntruncate_every = 7\nmin_rank = 1\nnormalise_gates = false\n",
    );
    let (a, b) = (dir.join("a"), dir.join("b"));
    let base = [
        "--threads",
        "2",
        "train",
        "--config",
        s(&cfg),
        "--epochs",
        "2",
        "--max-steps-per-epoch",
        "15",
        "--quiet",
    ];
    let (code, text) = comera(&[&base[..], &["--out", s(&a)]].concat());
    assert_eq!(code, 0, "{text}");
    // Stopped in the second epoch, between truncations.
    let (code, text) = comera(&[&base[..], &["--out", s(&b), "--stop-after-steps", "20"]].concat());
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("stopped after 20 steps"), "{text}");
    let (code, text) = comera(&["--threads", "2", "train", "--resume", s(&b), "--quiet"]);
    assert_eq!(code, 0, "{text}");
    assert!(!records(&a, "truncate").is_empty(), "the run truncated");
    assert_same_run(&a, &b, &["train", "eval", "truncate", "ranks"]);
    // A MovieLens model predicts and evaluates interaction rows (user_id, item_id; the rating,
    // if any, labels `eval --data`): the first rows of the fetched file, and rows of its own.
    let cache = std::env::var_os("COMERA_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(comera_data::default_cache_dir);
    let inter = comera_data::fetch("ml-100k-inter", &cache).unwrap();
    let head: Vec<String> = std::fs::read_to_string(&inter)
        .unwrap()
        .lines()
        .take(41)
        .map(str::to_string)
        .collect();
    let rows = dir.join("rows.inter");
    std::fs::write(&rows, head.join("\n") + "\n").unwrap();
    let (code, text) = comera(&["predict", s(&a), s(&rows)]);
    assert_eq!(code, 0, "{text}");
    let p: Vec<f64> = text.lines().map(|l| l.parse().unwrap()).collect();
    assert_eq!(p.len(), 40, "{text}");
    assert!(p.iter().all(|p| (0.0..=1.0).contains(p)), "{text}");
    let (code, text) = comera(&["eval", s(&a), "--data", s(&rows)]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("40 examples, AUC "), "{text}");
    // Without ratings: predict reads it, eval needs the labels.
    let pairs = dir.join("pairs.inter");
    std::fs::write(&pairs, "user_id:token\titem_id:token\n196\t242\n186\t302\n").unwrap();
    let (code, text) = comera(&["predict", s(&a), s(&pairs)]);
    assert_eq!(code, 0, "{text}");
    assert_eq!(text.lines().count(), 2, "{text}");
    let (code, text) = comera(&["eval", s(&a), "--data", s(&pairs)]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("rating"), "{text}");
    // An unknown user is named with its line.
    std::fs::write(
        &pairs,
        "user_id:token\titem_id:token\n196\t242\nnobody\t302\n",
    )
    .unwrap();
    let (code, text) = comera(&["predict", s(&a), s(&pairs)]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("pairs.inter:3") && text.contains("user `nobody`"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_adaptive_dlrm_keeps_min_rank_writes_its_rank_report_and_serves_every_command() {
    let dir = tempdir("rank");
    let train = synth(&dir, "train.tsv", "3000", "1");
    let valid = synth(&dir, "valid.tsv", "500", "2");
    // A size penalty strong enough to prune every slice it can: min_rank = 1 must keep one.
    let cfg = config(
        &dir,
        &train,
        &valid,
        "[optim]\nlr_gates = 0.1\n[rank]\ngamma = 50.0\ntruncate_every = 10\nmin_rank = 1\nnormalise_gates = false\n",
    );
    let (code, out) = comera(&["--threads", "2", "train", "--config", s(&cfg), "--quiet"]);
    assert_eq!(code, 0, "{out}");
    let run = dir.join("run");
    for f in ["ranks.md", "ranks.png", "curves.png", "report.json"] {
        assert!(run.join(f).exists(), "{f} missing: {out}");
    }
    let ranks = std::fs::read_to_string(run.join("ranks.md")).unwrap();
    assert!(ranks.contains("table.C"), "{ranks}");
    assert!(
        !ranks.contains("dead"),
        "min_rank = 1 keeps every table alive:\n{ranks}"
    );
    let end = &records(&run, "ranks")[0]["end"];
    for layer in end.as_array().unwrap() {
        assert_eq!(layer["dead"], false, "{layer}");
        for r in layer["ranks"].as_array().unwrap() {
            assert!(r.as_u64().unwrap() >= 1, "{layer}");
        }
    }
    assert!(
        !records(&run, "truncate").is_empty(),
        "the penalty pruned and truncated"
    );
    every_command_works_on(&run, &[s(&valid)], "0.");
    let _ = std::fs::remove_dir_all(&dir);
}
