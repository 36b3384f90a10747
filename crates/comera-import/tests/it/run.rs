//! The library calls behind `comera import` and `comera export --hf`: a Hugging Face directory
//! imported, compressed at two rank caps and written as a run directory, the steps reported in
//! order; the run exported back as a Hugging Face directory; and refusals with the messages
//! the command line shows.

use comera_import::hf::{export_hf, ModelInfo};
use comera_import::run::{export_run_hf, ImportStep};
use comera_import::{import_to_run, ImportOptions, ModelSource, TtOptions};
use comera_model::{Encoder, EncoderConfig};
use std::path::PathBuf;

/// A fresh directory under the system temp dir, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("comera-run-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The message and its sources, as the command line prints an error.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    comera_train::error::Chain(e).to_string()
}

/// A tiny dense classifier written as a Hugging Face directory `dir/hf`.
fn tiny_hf(dir: &Dir) -> PathBuf {
    let mut cfg = EncoderConfig {
        vocab_size: 30,
        seq_len: 8,
        d_model: 16,
        heads: 2,
        ffn: 32,
        layers: 2,
        num_labels: 2,
        tt_linear: false,
        ttm_embedding: false,
        ..EncoderConfig::default()
    };
    comera_import::bert::set_default_layouts(&mut cfg, 4);
    let enc = Encoder::new(&cfg, 3).unwrap();
    let mut vocab: Vec<String> = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    vocab.extend((vocab.len()..30).map(|i| format!("w{i}")));
    let info = ModelInfo {
        labels: vec!["no".into(), "yes".into()],
        vocab: vocab.join("\n") + "\n",
        pair: false,
    };
    let hf = dir.0.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    export_hf(&enc, &info, &hf).unwrap();
    hf
}

#[test]
fn an_import_compressed_at_two_ranks_becomes_a_run_that_exports_back() {
    let dir = Dir::new("roundtrip");
    let hf = tiny_hf(&dir);
    let run = dir.0.join("run");
    let mut opts = ImportOptions::new(ModelSource::Path(hf.clone()));
    opts.tt = Some(TtOptions {
        ranks: vec![2, 3],
        ..TtOptions::default()
    });
    opts.out = Some(run.clone());
    let mut steps = Vec::new();
    let outcome = import_to_run(opts, |s| {
        steps.push(match s {
            ImportStep::Read(m) => format!("read {}", m.source.display()),
            ImportStep::Checked { .. } => "checked".into(),
            ImportStep::Compressed(c) => format!("rank {:?}", c.rank),
        })
    })
    .unwrap();
    assert_eq!(
        steps,
        [
            format!("read {}", hf.display()),
            "rank Some(2)".into(),
            "rank Some(3)".into()
        ]
    );
    assert!(outcome.check.is_none() && outcome.check_passed());
    assert_eq!(outcome.compressions.len(), 2);
    for c in &outcome.compressions {
        assert!(!c.layers.is_empty());
        let d = c.deviation.as_ref().expect("measured on sample sentences");
        assert_eq!(d.against, "the dense import");
        assert!(d.report.frob_rel.is_finite());
    }
    let last = outcome.compressions.last().unwrap();
    assert_eq!(outcome.model().num_params(), last.params);
    assert!(last.params < outcome.imported.encoder.num_params());
    let written = outcome.run_dir.as_ref().unwrap();
    assert_eq!(written, &std::fs::canonicalize(&run).unwrap());
    let (saved, meta) = comera_train::load_model(written).unwrap();
    assert_eq!(saved.num_params(), last.params);
    assert_eq!(meta.labels, ["no", "yes"]);

    let out = dir.0.join("export");
    let e = export_run_hf(&run, &out, 0, false).unwrap();
    assert_eq!(e.dir, out);
    assert_eq!(e.architecture, "BertForSequenceClassification");
    assert!(e.files.iter().any(|f| f == "model.safetensors"));
    assert!(e.check_file.is_none() && e.checked == 0);

    let again = export_run_hf(&run, &out, 0, false).unwrap_err();
    assert!(
        again.to_string().starts_with("--hf: ") && again.to_string().contains("is not empty"),
        "{again}"
    );
    export_run_hf(&run, &out, 0, true).expect("an earlier export is replaced");
    let into_run = export_run_hf(&run, &run, 0, true).unwrap_err();
    assert!(
        into_run.to_string().contains("is a comera run directory"),
        "{into_run}"
    );
}

#[test]
fn refusals_keep_the_command_lines_messages() {
    let dir = Dir::new("refusals");
    let hf = tiny_hf(&dir);

    let mut opts = ImportOptions::new(ModelSource::Path(hf.clone()));
    opts.tt = Some(TtOptions {
        ranks: vec![2, 0],
        ..TtOptions::default()
    });
    let e = import_to_run(opts, |_| {}).unwrap_err();
    assert_eq!(
        e.to_string(),
        "--rank: 0 is not a rank (must be at least 1)"
    );

    let mut opts = ImportOptions::new(ModelSource::Path(hf.clone()));
    opts.check = true;
    let e = import_to_run(opts, |_| {}).unwrap_err();
    assert_eq!(
        e.to_string(),
        "--check: needs --reference FILE (input_ids.{i}, hidden.{i})"
    );

    let mut opts = ImportOptions::new(ModelSource::Path(hf.clone()));
    opts.reference = Some(dir.0.join("missing.safetensors"));
    let e = import_to_run(opts, |_| {}).unwrap_err();
    let text = chain(&e);
    assert!(
        text.starts_with(&format!(
            "{}: cannot read: ",
            dir.0.join("missing.safetensors").display()
        )),
        "{text}"
    );

    // A folder of the user's is no run directory to write into: refused before the import,
    // the reason after `--out`.
    let mut opts = ImportOptions::new(ModelSource::Path(hf.clone()));
    opts.out = Some(hf.clone());
    let mut steps = 0;
    let e = import_to_run(opts, |_| steps += 1).unwrap_err();
    assert_eq!(steps, 0, "refused before reading");
    assert_eq!(e.to_string(), "--out");
    assert!(chain(&e).starts_with("--out: "), "{}", chain(&e));
}

#[test]
fn a_hub_name_that_is_no_directory_says_how_to_get_a_local_copy() {
    let opts = comera_import::hf::ReadOptions {
        seq_len: None,
        num_labels: None,
        seed: 0,
    };
    let Err(e) = comera_import::hf::read_hf(std::path::Path::new("bert-base-uncased"), &opts)
    else {
        panic!("no such directory")
    };
    let msg = chain(&e);
    assert!(
        msg.contains("bert-base-uncased")
            && msg.contains("local copy")
            && msg.contains("--local-dir"),
        "{msg}"
    );
    // A path that is plainly a path gets the plain message.
    let Err(e) = comera_import::hf::read_hf(std::path::Path::new("/nonexistent/model/dir"), &opts)
    else {
        panic!("no such directory")
    };
    assert!(chain(&e).ends_with("does not exist"), "{}", chain(&e));
}

#[test]
fn a_compression_target_sizes_the_blocks_and_an_unreachable_one_is_refused() {
    let dir = Dir::new("target");
    let hf = tiny_hf(&dir);
    let with = |target: f64| {
        let mut opts = ImportOptions::new(ModelSource::Path(hf.clone()));
        opts.tt = Some(TtOptions {
            target_compression: Some(target),
            embedding_rank: Some(2),
            ..TtOptions::default()
        });
        import_to_run(opts, |_| {})
    };
    let outcome = with(2.0).unwrap();
    let c = &outcome.compressions[0];
    let (blocks, dense) = c.block_params;
    assert_eq!(
        dense,
        comera_import::run::block_params(&outcome.imported.encoder)
    );
    assert_eq!(blocks, comera_import::run::block_params(outcome.model()));
    // At the target, and not far under it: the tolerance is the smallest that reaches it.
    assert!(blocks as f64 <= dense as f64 / 2.0, "{blocks} of {dense}");
    assert!(blocks as f64 > dense as f64 / 4.0, "{blocks} of {dense}");
    assert!(c.tol.is_some_and(|t| t > 0.0) && c.target_compression == Some(2.0));
    // The word table takes its own rank cap.
    let word = c.layers.iter().find(|l| l.kind == "word").unwrap();
    assert!(word.ranks.iter().all(|&r| r <= 2), "{:?}", word.ranks);

    let e = with(1e6).unwrap_err().to_string();
    assert!(
        e.starts_with("--target-compression: 1000000× is out of reach") && e.contains("rank 1"),
        "{e}"
    );
    let e = with(0.5).unwrap_err().to_string();
    assert!(e.contains("expected a factor > 1"), "{e}");
}
