//! Hugging Face directories without Python: the export's names, shapes and config.json
//! fields (BERT for a post-LN model, RoBERTa-PreLayerNorm for a pre-LN one), the import of an
//! export reproducing the model's logits (classifier and masked-LM, TT/TTM layers
//! reconstructed), and refusals that name the field or tensor at fault.

use comera_import::hf::{export_hf, mlm_logits, read_hf, ModelInfo, ReadOptions};
use comera_model::Rank;
use comera_model::{Encoder, EncoderConfig, HeadKind, LayerTt, MlmDecoderKind, TtmConfig};
use safetensors::SafeTensors;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A fresh directory under the system temp dir, removed on drop.
struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("comera-hf-{tag}-{}", std::process::id()));
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

const V: usize = 30;

fn vocab() -> String {
    vocab_of(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
}

/// A vocabulary of V tokens starting with `special` in that order.
fn vocab_of(special: [&str; 5]) -> String {
    let mut v: Vec<String> = special.iter().map(|s| s.to_string()).collect();
    v.extend((v.len()..V).map(|i| format!("w{i}")));
    v.join("\n") + "\n"
}

/// A tiny post-LN encoder: TT linear layers and a TTM word table when `tt`; classifier or MLM.
fn tiny(tt: bool, head: HeadKind, decoder: MlmDecoderKind) -> Encoder {
    tiny_ln(tt, head, decoder, false)
}

/// [`tiny`], pre-LN when `pre_ln`.
fn tiny_ln(tt: bool, head: HeadKind, decoder: MlmDecoderKind, pre_ln: bool) -> Encoder {
    let cfg = EncoderConfig {
        pre_ln,
        vocab_size: V,
        seq_len: 8,
        d_model: 16,
        heads: 2,
        ffn: 32,
        layers: 2,
        num_labels: 3,
        dropout: 0.0,
        tt_linear: tt,
        ttm_embedding: tt,
        attn_tt: LayerTt::uniform(&[4, 4], &[4, 4], 3),
        ffn_up_tt: LayerTt::uniform(&[4, 4], &[4, 8], 3),
        ffn_down_tt: LayerTt::uniform(&[4, 8], &[4, 4], 3),
        word_ttm: TtmConfig {
            vocab_modes: vec![4, 8],
            dim_modes: vec![4, 4],
            rank: Rank::Uniform(3),
        },
        head,
        mlm_decoder: decoder,
        mlm_decoder_tt: LayerTt::uniform(&[4, 4], &[4, 8], 3),
        ..EncoderConfig::default()
    };
    let mut enc = Encoder::new(&cfg, 7).unwrap();
    // Non-zero LayerNorm and bias values, so a mapping mistake shows in the logits.
    let mut k = 0u32;
    enc.visit_params_mut(&mut |p| {
        if p.name.ends_with("bias") || p.name.ends_with("beta") || p.name.ends_with("gamma") {
            for v in p.value.iter_mut() {
                k = k.wrapping_mul(1_103_515_245).wrapping_add(12345);
                *v += ((k >> 16) % 200) as f32 / 1000.0 - 0.1;
            }
        }
    });
    enc
}

fn info(labels: usize) -> ModelInfo {
    ModelInfo {
        labels: (0..labels).map(|i| format!("label {i}")).collect(),
        vocab: vocab(),
        pair: false,
    }
}

/// Two padded sequences of ids.
fn batch(t: usize) -> (Vec<u32>, Vec<u32>) {
    let lens = [t, t - 3];
    let mut ids = vec![0u32; 2 * t];
    let mut mask = vec![0u32; 2 * t];
    for (s, &len) in lens.iter().enumerate() {
        for p in 0..len {
            ids[s * t + p] = if p == 0 {
                2
            } else {
                (5 + (s * 7 + p * 5) % (V - 5)) as u32
            };
            mask[s * t + p] = 1;
        }
    }
    (ids, mask)
}

fn classifier_logits(enc: &Encoder) -> Vec<f32> {
    let t = enc.cfg.seq_len;
    let (ids, mask) = batch(t);
    let mut st = enc.state(2);
    st.load(&ids, &vec![0; 2 * t], &mask, &[0, 0]).unwrap();
    enc.forward(&mut st, false, 0).unwrap();
    st.logits().to_vec()
}

fn masked_lm_logits(enc: &Encoder) -> Vec<f32> {
    let t = enc.cfg.seq_len;
    let (ids, mask) = batch(t);
    let mut st = enc.state(2);
    st.load_mlm(&ids, &mask, &vec![-100; 2 * t], &[]).unwrap();
    enc.forward(&mut st, false, 0).unwrap();
    mlm_logits(enc, st.hidden(), &[1, 3, t + 2]).unwrap()
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

fn config_json(dir: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

fn shapes(dir: &Path) -> std::collections::BTreeMap<String, Vec<usize>> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(
        meta.metadata().as_ref().unwrap().get("format").unwrap(),
        "pt",
        "transformers requires format = pt"
    );
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.iter()
        .map(|(n, v)| (n.to_string(), v.shape().to_vec()))
        .collect()
}

#[test]
fn classifier_export_layout_and_round_trip() {
    for tt in [true, false] {
        let dir = Dir::new(&format!("cls-{tt}"));
        let enc = tiny(tt, HeadKind::Classifier, MlmDecoderKind::Auto);
        let out = export_hf(&enc, &info(3), &dir.0).unwrap();
        assert_eq!(out.architecture, "BertForSequenceClassification");
        for f in [
            "config.json",
            "model.safetensors",
            "vocab.txt",
            "tokenizer_config.json",
            "special_tokens_map.json",
        ] {
            assert!(dir.0.join(f).is_file(), "{f} written");
        }
        let c = config_json(&dir.0);
        assert_eq!(c["architectures"][0], "BertForSequenceClassification");
        assert_eq!(c["model_type"], "bert");
        assert_eq!(c["hidden_size"], 16);
        assert_eq!(c["num_hidden_layers"], 2);
        assert_eq!(c["num_attention_heads"], 2);
        assert_eq!(c["intermediate_size"], 32);
        assert_eq!(c["vocab_size"], V);
        assert_eq!(c["max_position_embeddings"], 8);
        assert_eq!(c["hidden_act"], "gelu");
        assert_eq!(c["layer_norm_eps"].as_f64().unwrap() as f32, 1e-12);
        assert_eq!(c["id2label"]["2"], "label 2");
        assert_eq!(c["label2id"]["label 1"], 1);
        let tc: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.0.join("tokenizer_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(tc["tokenizer_class"], "BertTokenizer");
        assert_eq!(tc["do_lower_case"], true);

        let s = shapes(&dir.0);
        let want: &[(&str, &[usize])] = &[
            ("bert.embeddings.word_embeddings.weight", &[V, 16]),
            ("bert.embeddings.position_embeddings.weight", &[8, 16]),
            ("bert.embeddings.token_type_embeddings.weight", &[2, 16]),
            ("bert.embeddings.LayerNorm.weight", &[16]),
            (
                "bert.encoder.layer.1.attention.self.query.weight",
                &[16, 16],
            ),
            (
                "bert.encoder.layer.1.attention.output.LayerNorm.bias",
                &[16],
            ),
            ("bert.encoder.layer.0.intermediate.dense.weight", &[32, 16]),
            ("bert.encoder.layer.0.output.dense.weight", &[16, 32]),
            ("bert.encoder.layer.0.output.dense.bias", &[16]),
            ("bert.pooler.dense.weight", &[16, 16]),
            ("classifier.weight", &[3, 16]),
            ("classifier.bias", &[3]),
        ];
        for (name, shape) in want {
            assert_eq!(s.get(*name).map(Vec::as_slice), Some(*shape), "{name}");
        }
        // 5 embedding tensors, 16 per layer, pooler and classifier 2 each.
        assert_eq!(s.len(), 5 + 2 * 16 + 4, "{:?}", s.keys());
        assert!(s.keys().all(|k| !k.contains("core") && !k.contains("gate")));

        // Linear weights are stored (out, in): HF[j][i] = comera W[i][j] (square layers too).
        let bytes = std::fs::read(dir.0.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let dense = comera_import::densify(&enc);
        for (comera, hf) in [
            ("pooler.weight", "bert.pooler.dense.weight"),
            (
                "encoder.1.attn.q.weight",
                "bert.encoder.layer.1.attention.self.query.weight",
            ),
            (
                "encoder.0.attn.o.weight",
                "bert.encoder.layer.0.attention.output.dense.weight",
            ),
            ("classifier.weight", "classifier.weight"),
        ] {
            let w = dense
                .params()
                .into_iter()
                .find(|p| p.name == comera)
                .unwrap();
            let t: Vec<f32> = st
                .tensor(hf)
                .unwrap()
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            let (n, m) = (w.shape[0], w.shape[1]);
            for i in 0..n {
                for j in 0..m {
                    assert_eq!(t[j * n + i], w.value[i * m + j], "{hf}[{j}][{i}]");
                }
            }
        }

        let back = read_hf(&dir.0, &ReadOptions::default()).unwrap();
        assert_eq!(back.info.labels, info(3).labels);
        assert_eq!(back.info.vocab, vocab());
        assert!(back.import.unused.is_empty(), "{:?}", back.import.unused);
        assert!(back.import.kept_init.is_empty());
        let (a, b) = (classifier_logits(&back.encoder), classifier_logits(&enc));
        let d = max_rel_diff(&a, &b);
        assert!(d < 1e-5, "tt {tt}: logits differ by {d}: {a:?} vs {b:?}");
    }
}

#[test]
fn masked_lm_export_layout_and_round_trip() {
    // TTM embedding with a TT output projection (its padding cut), and a tied dense one.
    for (tt, decoder) in [(true, MlmDecoderKind::Auto), (false, MlmDecoderKind::Tied)] {
        let dir = Dir::new(&format!("mlm-{tt}"));
        let enc = tiny(tt, HeadKind::Mlm, decoder);
        let out = export_hf(&enc, &info(0), &dir.0).unwrap();
        assert_eq!(out.architecture, "BertForMaskedLM");
        assert_eq!(out.notes.iter().any(|n| n.contains("padding")), tt);
        let c = config_json(&dir.0);
        assert_eq!(c["architectures"][0], "BertForMaskedLM");
        assert_eq!(c["tie_word_embeddings"], !tt);
        let s = shapes(&dir.0);
        assert_eq!(
            s.get("cls.predictions.transform.dense.weight"),
            Some(&vec![16, 16])
        );
        assert_eq!(
            s.get("cls.predictions.transform.LayerNorm.weight"),
            Some(&vec![16])
        );
        assert_eq!(s.get("cls.predictions.bias"), Some(&vec![V]));
        assert_eq!(s.get("cls.predictions.decoder.bias"), Some(&vec![V]));
        assert_eq!(
            s.get("cls.predictions.decoder.weight").cloned(),
            tt.then(|| vec![V, 16]),
            "a tied decoder is the word table; an own one is (V, D)"
        );
        assert!(!s.contains_key("bert.pooler.dense.weight"));

        let back = read_hf(&dir.0, &ReadOptions::default()).unwrap();
        assert_eq!(back.encoder.cfg.head, HeadKind::Mlm);
        assert!(back.import.unused.is_empty(), "{:?}", back.import.unused);
        let (a, b) = (masked_lm_logits(&back.encoder), masked_lm_logits(&enc));
        assert_eq!(a.len(), 3 * V);
        let d = max_rel_diff(&a, &b);
        assert!(d < 1e-5, "tt {tt}: MLM logits differ by {d}");
    }
}

/// The F32 values of tensor `name` of the export in `dir`.
fn tensor(dir: &Path, name: &str) -> Vec<f32> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensor(name)
        .unwrap_or_else(|_| panic!("{name} written"))
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The value of comera parameter `name` of `enc` (TT/TTM layers reconstructed).
fn param(enc: &Encoder, name: &str) -> Vec<f32> {
    let dense = comera_import::densify(enc);
    let p = dense.params().into_iter().find(|p| p.name == name);
    p.unwrap_or_else(|| panic!("{name}")).value.clone()
}

/// (out, in) of a comera linear weight (in, out).
fn transposed(w: &[f32], n: usize, m: usize) -> Vec<f32> {
    (0..m)
        .flat_map(|j| (0..n).map(move |i| w[i * m + j]))
        .collect()
}

#[test]
fn pre_ln_classifier_exports_as_roberta_prelayernorm() {
    // [PAD] at id 0 (TT/TTM layers) and at id 3 (dense): RoBERTa's positions start at pad + 1.
    let orders = [
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
        ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"],
    ];
    for (tt, order) in [true, false].into_iter().zip(orders) {
        let dir = Dir::new(&format!("preln-cls-{tt}"));
        let enc = tiny_ln(tt, HeadKind::Classifier, MlmDecoderKind::Auto, true);
        let info = ModelInfo {
            vocab: vocab_of(order),
            pair: true,
            ..info(3)
        };
        let id = |tok: &str| order.iter().position(|t| *t == tok).unwrap();
        let pad = id("[PAD]");
        let out = export_hf(&enc, &info, &dir.0).unwrap();
        assert_eq!(
            out.architecture,
            "RobertaPreLayerNormForSequenceClassification"
        );
        let c = config_json(&dir.0);
        assert_eq!(
            c["architectures"][0],
            "RobertaPreLayerNormForSequenceClassification"
        );
        assert_eq!(c["model_type"], "roberta-prelayernorm");
        assert_eq!(c["max_position_embeddings"], 8 + pad + 1);
        assert_eq!(c["pad_token_id"], pad);
        assert_eq!(c["bos_token_id"], id("[CLS]"));
        assert_eq!(c["eos_token_id"], id("[SEP]"));
        assert_eq!(c["hidden_act"], "gelu");
        assert_eq!(c["layer_norm_eps"].as_f64().unwrap() as f32, 1e-12);
        assert_eq!(c["type_vocab_size"], 2);
        assert_eq!(c["id2label"]["2"], "label 2");
        assert_eq!(c["label2id"]["label 1"], 1);
        assert_eq!(c["comera_sentence_pair"], true);
        let tc: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.0.join("tokenizer_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(tc["tokenizer_class"], "BertTokenizer");
        assert_eq!(tc["pad_token"], "[PAD]");
        assert_eq!(
            std::fs::read_to_string(dir.0.join("vocab.txt")).unwrap(),
            info.vocab
        );

        let s = shapes(&dir.0);
        let p = "roberta_prelayernorm.";
        let mut want: Vec<(String, Vec<usize>)> = vec![
            (format!("{p}embeddings.word_embeddings.weight"), vec![V, 16]),
            (
                format!("{p}embeddings.position_embeddings.weight"),
                vec![8 + pad + 1, 16],
            ),
            (
                format!("{p}embeddings.token_type_embeddings.weight"),
                vec![2, 16],
            ),
            (format!("{p}embeddings.LayerNorm.weight"), vec![16]),
            (format!("{p}embeddings.LayerNorm.bias"), vec![16]),
            (format!("{p}LayerNorm.weight"), vec![16]),
            (format!("{p}LayerNorm.bias"), vec![16]),
            ("classifier.dense.weight".into(), vec![16, 16]),
            ("classifier.dense.bias".into(), vec![16]),
            ("classifier.out_proj.weight".into(), vec![3, 16]),
            ("classifier.out_proj.bias".into(), vec![3]),
        ];
        for l in 0..2 {
            let b = format!("{p}encoder.layer.{l}.");
            for (name, shape) in [
                ("attention.LayerNorm", vec![16]),
                ("attention.self.query", vec![16, 16]),
                ("attention.self.key", vec![16, 16]),
                ("attention.self.value", vec![16, 16]),
                ("attention.output.dense", vec![16, 16]),
                ("intermediate.LayerNorm", vec![16]),
                ("intermediate.dense", vec![32, 16]),
                ("output.dense", vec![16, 32]),
            ] {
                let bias = vec![shape[0]];
                want.push((format!("{b}{name}.weight"), shape));
                want.push((format!("{b}{name}.bias"), bias));
            }
        }
        let got: Vec<(String, Vec<usize>)> = s.into_iter().collect();
        want.sort();
        assert_eq!(got, want, "tt {tt}");

        // The position table: pad + 1 zero rows, then comera's rows 0..seq_len.
        let pos = tensor(&dir.0, &format!("{p}embeddings.position_embeddings.weight"));
        let (zeros, rows) = pos.split_at((pad + 1) * 16);
        assert!(zeros.iter().all(|&x| x == 0.0));
        assert_eq!(rows, param(&enc, "embeddings.position.weight"));
        // LayerNorms where RoBERTa-PreLayerNorm applies them; the pooler is the head's dense.
        for (hf, comera) in [
            (
                "encoder.layer.1.attention.LayerNorm.weight",
                "encoder.1.ln1.gamma",
            ),
            (
                "encoder.layer.1.intermediate.LayerNorm.bias",
                "encoder.1.ln2.beta",
            ),
            ("LayerNorm.weight", "encoder.ln_final.gamma"),
            ("embeddings.LayerNorm.bias", "embeddings.ln.beta"),
        ] {
            assert_eq!(
                tensor(&dir.0, &format!("{p}{hf}")),
                param(&enc, comera),
                "{hf}"
            );
        }
        for (hf, comera, m) in [
            ("classifier.dense.weight", "pooler.weight", 16),
            ("classifier.out_proj.weight", "classifier.weight", 3),
            (
                "roberta_prelayernorm.encoder.layer.0.output.dense.weight",
                "encoder.0.ffn.down.weight",
                16,
            ),
        ] {
            let w = param(&enc, comera);
            let n = w.len() / m;
            assert_eq!(tensor(&dir.0, hf), transposed(&w, n, m), "{hf}");
        }
        // comera's import reads BERT only.
        let e = read_hf(&dir.0, &ReadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("model_type"), "{e}");
    }
}

#[test]
fn pre_ln_masked_lm_exports_as_roberta_prelayernorm() {
    // A TT output projection (its padding cut) and a tied dense one.
    for (tt, decoder) in [(true, MlmDecoderKind::Auto), (false, MlmDecoderKind::Tied)] {
        let dir = Dir::new(&format!("preln-mlm-{tt}"));
        let enc = tiny_ln(tt, HeadKind::Mlm, decoder, true);
        let out = export_hf(&enc, &info(0), &dir.0).unwrap();
        assert_eq!(out.architecture, "RobertaPreLayerNormForMaskedLM");
        assert_eq!(out.notes.iter().any(|n| n.contains("padding")), tt);
        let c = config_json(&dir.0);
        assert_eq!(c["architectures"][0], "RobertaPreLayerNormForMaskedLM");
        assert_eq!(c["model_type"], "roberta-prelayernorm");
        assert_eq!(c["tie_word_embeddings"], !tt);
        assert_eq!(c["max_position_embeddings"], 9);
        assert!(c.get("id2label").is_none());
        let s = shapes(&dir.0);
        for (name, shape) in [
            ("lm_head.dense.weight", vec![16, 16]),
            ("lm_head.dense.bias", vec![16]),
            ("lm_head.layer_norm.weight", vec![16]),
            ("lm_head.layer_norm.bias", vec![16]),
            ("lm_head.bias", vec![V]),
            ("lm_head.decoder.bias", vec![V]),
            ("roberta_prelayernorm.LayerNorm.bias", vec![16]),
            (
                "roberta_prelayernorm.embeddings.position_embeddings.weight",
                vec![9, 16],
            ),
        ] {
            assert_eq!(s.get(name), Some(&shape), "{name}");
        }
        assert_eq!(
            s.get("lm_head.decoder.weight").cloned(),
            tt.then(|| vec![V, 16]),
            "a tied decoder is the word table; an own one is (V, D)"
        );
        // 5 embedding tensors, 16 per layer, the final LN, the head's 6 (7 untied).
        assert_eq!(
            s.len(),
            5 + 2 * 16 + 2 + 6 + usize::from(tt),
            "{:?}",
            s.keys()
        );
        assert!(s
            .keys()
            .all(|k| k.starts_with("roberta_prelayernorm.") || k.starts_with("lm_head.")));
        assert_eq!(
            tensor(&dir.0, "lm_head.bias"),
            param(&enc, "mlm.decoder.bias")
        );
        assert_eq!(
            tensor(&dir.0, "lm_head.decoder.bias"),
            tensor(&dir.0, "lm_head.bias")
        );
        assert_eq!(
            tensor(&dir.0, "lm_head.layer_norm.weight"),
            param(&enc, "mlm.ln.gamma")
        );
        if tt {
            let w = param(&enc, "mlm.decoder.weight");
            assert_eq!(
                tensor(&dir.0, "lm_head.decoder.weight"),
                transposed(&w, 16, V)
            );
        }
    }
}

/// Rewrites the export's model.safetensors through `edit` (name → Some(new shape/data) or None
/// to drop it).
/// A tensor's new shape and bytes, or `None` to drop it.
type Edit = dyn Fn(&str, &[usize], &[u8]) -> Option<(Vec<usize>, Vec<u8>)>;

fn rewrite(dir: &Path, edit: &Edit) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .iter()
        .filter_map(|(n, v)| edit(n, v.shape(), v.data()).map(|(s, d)| (n.to_string(), s, d)))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = kept
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), d)
                    .unwrap(),
            )
        })
        .collect();
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    std::fs::write(&path, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();
}

fn set_config(dir: &Path, key: &str, value: Value) {
    let mut c = config_json(dir);
    c[key] = value;
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
}

#[test]
fn bad_directories_are_refused_naming_the_field() {
    let dir = Dir::new("bad");
    let enc = tiny(false, HeadKind::Classifier, MlmDecoderKind::Auto);
    let fresh = || {
        export_hf(&enc, &info(3), &dir.0).unwrap();
    };
    let err = || {
        read_hf(&dir.0, &ReadOptions::default())
            .unwrap_err()
            .to_string()
    };

    fresh();
    rewrite(&dir.0, &|n, s, d| {
        (n != "bert.encoder.layer.1.output.dense.weight").then(|| (s.to_vec(), d.to_vec()))
    });
    let e = err();
    assert!(
        e.contains("encoder.layer.1.output.dense.weight") && e.contains("missing"),
        "{e}"
    );

    fresh();
    rewrite(&dir.0, &|n, s, d| {
        Some(if n == "bert.encoder.layer.0.attention.self.key.weight" {
            (vec![s[0], s[1] / 2], d[..d.len() / 2].to_vec())
        } else {
            (s.to_vec(), d.to_vec())
        })
    });
    let e = err();
    assert!(
        e.contains("encoder.layer.0.attention.self.key.weight") && e.contains("shape [16, 8]"),
        "{e}"
    );

    for (key, value, named) in [
        ("model_type", serde_json::json!("roberta"), "model_type"),
        (
            "architectures",
            serde_json::json!(["BertForTokenClassification"]),
            "architectures",
        ),
        ("hidden_act", serde_json::json!("gelu_new"), "hidden_act"),
        (
            "position_embedding_type",
            serde_json::json!("relative_key"),
            "position_embedding_type",
        ),
        ("vocab_size", serde_json::json!(V + 1), "vocab_size"),
    ] {
        fresh();
        set_config(&dir.0, key, value);
        let e = err();
        assert!(e.contains("config.json") && e.contains(named), "{key}: {e}");
    }

    fresh();
    let mut c = config_json(&dir.0);
    c.as_object_mut().unwrap().remove("num_hidden_layers");
    std::fs::write(dir.0.join("config.json"), c.to_string()).unwrap();
    let e = err();
    assert!(e.contains("num_hidden_layers"), "{e}");

    fresh();
    std::fs::remove_file(dir.0.join("vocab.txt")).unwrap();
    let e = err();
    assert!(e.contains("no vocabulary"), "{e}");

    fresh();
    std::fs::remove_file(dir.0.join("model.safetensors")).unwrap();
    let e = err();
    assert!(
        e.contains("model.safetensors") && e.contains("missing"),
        "{e}"
    );
}
