//! `comera import` and `comera export` end to end, on a tiny BERT the test writes itself (no
//! downloads); the MiniLM check runs only when its weights are already cached.

use comera_model::{Encoder, EncoderConfig};
use std::path::{Path, PathBuf};
use std::process::Command;

fn comera(args: &[&str]) -> (i32, String) {
    comera_env(args, &[])
}

fn comera_env(args: &[&str], env: &[(&str, &Path)]) -> (i32, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_comera"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// A fresh directory under the system temp dir, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("comera-import-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
    fn path(&self, name: &str) -> String {
        self.0.join(name).to_string_lossy().into_owned()
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A tiny random BERT in the Hugging Face layout (via comera's dense export).
fn tiny_bert(dir: &Dir) -> String {
    let cfg = EncoderConfig {
        vocab_size: 60,
        seq_len: 12,
        d_model: 16,
        heads: 2,
        ffn: 32,
        layers: 2,
        num_labels: 2,
        tt_linear: false,
        ttm_embedding: false,
        ..EncoderConfig::default()
    };
    let mut cfg = cfg;
    comera_import::bert::set_default_layouts(&mut cfg, 4);
    let enc = Encoder::new(&cfg, 3).unwrap();
    let path = dir.path("tiny.safetensors");
    std::fs::write(&path, comera_import::export_dense(&enc).unwrap()).unwrap();
    path
}

#[test]
fn import_compress_and_export_a_bert_file() {
    let dir = Dir::new("roundtrip");
    let tiny = tiny_bert(&dir);
    let c = dir.path("c.safetensors");
    let (code, text) = comera(&[
        "import",
        "bert",
        &tiny,
        "--seq-len",
        "8",
        "--tt",
        "--rank",
        "2,4",
    ]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("seq_len 8"), "{text}");
    for kind in [
        "attn.q",
        "attn.o",
        "ffn.up",
        "ffn.down",
        "word",
        "encoder.1.ffn.down",
        "embeddings.word",
    ] {
        assert!(text.contains(kind), "report lists {kind}: {text}");
    }
    assert!(
        text.contains("rank ≤ 2") && text.contains("rank ≤ 4"),
        "{text}"
    );
    // A file without a vocabulary beside it cannot become a run directory.
    let (code, text) = comera(&["import", "hf", &tiny, "--out", &dir.path("run")]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("vocab"), "{text}");

    // The dense file exports as a compressed file and back to the same dense file.
    let d2 = dir.path("d2.safetensors");
    let (code, text) = comera(&["export", &tiny, "--compressed", &c]);
    assert_eq!(code, 0, "{text}");
    let (code, text) = comera(&["export", &c, "--dense", &d2]);
    assert_eq!(code, 0, "{text}");
    let same = std::fs::read(&d2).unwrap() == std::fs::read(&tiny).unwrap();
    assert!(same, "dense → compressed → dense gives the same file");
    let (code, text) = comera(&["import", "hf", &tiny, "--tt", "--tol", "0.5", "--json"]);
    assert_eq!(code, 0, "{text}");
    let kinds: Vec<String> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "tt_svd")
        .map(|v| {
            assert!(v["max_rel_error"].as_f64().unwrap() <= 0.5, "{v}");
            v["kind"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(kinds.len(), 7, "{text}");
    let layers = text.lines().filter(|l| l.contains("tt_svd_layer")).count();
    assert_eq!(layers, 2 * 6 + 1, "one line per compressed layer: {text}");
}

#[test]
fn bad_inputs_are_clear_errors() {
    let dir = Dir::new("errors");
    let tiny = tiny_bert(&dir);
    let missing = dir.path("missing.safetensors");
    let (code, text) = comera(&["import", "bert", &missing]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("missing.safetensors") && text.contains("does not exist"),
        "{text}"
    );

    let bytes = std::fs::read(&tiny).unwrap();
    let cut = dir.path("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let (code, text) = comera(&["import", "bert", &cut]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("cut.safetensors") && text.contains("not a valid safetensors"),
        "{text}"
    );

    let (code, text) = comera(&["import", "bert", &tiny, "--tt"]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("--rank"), "{text}");
    let (code, text) = comera(&["import", "bert", &tiny, "--check"]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("--reference"), "{text}");
    let (code, text) = comera(&["import", "bert", &tiny, "--seq-len", "13"]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("position"), "{text}");

    // A HF config comera cannot run (tanh-approximate GELU), from a config.json beside the file.
    let sub = Dir::new("errors-hf");
    let plain = sub.path("model.safetensors");
    // Strip the comera metadata by re-serialising the tensors only.
    let w = comera_import::BertWeights::from_bytes(&bytes, "tiny").unwrap();
    let mut header = serde_json::Map::new();
    let mut blob = Vec::new();
    for name in w.names() {
        let t = w.get(name).unwrap();
        let start = blob.len();
        blob.extend(t.data.iter().flat_map(|v| v.to_le_bytes()));
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": t.shape, "data_offsets": [start, blob.len()]}),
        );
    }
    let h = serde_json::to_vec(&header).unwrap();
    let mut file = (h.len() as u64).to_le_bytes().to_vec();
    file.extend(&h);
    file.extend(&blob);
    std::fs::write(&plain, file).unwrap();
    let (code, text) = comera(&["import", "bert", &plain]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("no model config"), "{text}");
    std::fs::write(
        sub.path("config.json"),
        r#"{"vocab_size": 60, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 32, "max_position_embeddings": 12, "hidden_act": "gelu_new"}"#,
    )
    .unwrap();
    let (code, text) = comera(&["import", "bert", &plain]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("config.json: hidden_act"), "{text}");
    std::fs::write(
        sub.path("config.json"),
        r#"{"vocab_size": 60, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 32, "max_position_embeddings": 12}"#,
    )
    .unwrap();
    let (code, text) = comera(&["import", "bert", &plain]);
    assert_eq!(code, 0, "{text}");

    let (code, text) = comera(&["export", &tiny]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("--dense"), "{text}");
}

#[test]
fn minilm_check_when_cached() {
    let cache = comera_data::default_cache_dir();
    if comera_import::minilm::cached(&cache).is_none() {
        eprintln!(
            "SKIPPED: all-MiniLM-L6-v2 weights not in {} (run `comera data fetch minilm`)",
            cache.display()
        );
        return;
    }
    let (code, text) = comera_env(&["import", "minilm", "--check"], &[("COMERA_DATA", &cache)]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("PASS"), "{text}");
}
