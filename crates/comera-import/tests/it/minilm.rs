//! all-MiniLM-L6-v2: the dense import reproduces the reference hidden states.
//!
//! Needs the 91 MB weights in the data cache (`comera data fetch minilm`, or any run of
//! `comera import minilm`); tests never download, so without them this test says it was
//! skipped and passes.

use comera_import::minilm;
use comera_import::{compress, load_bert, CompressOptions};

#[test]
fn reference_file_is_well_formed() {
    let r = minilm::reference();
    assert_eq!(r.ids.len(), 3);
    assert_eq!(r.d_model, 384);
    for (ids, h) in r.ids.iter().zip(&r.hidden) {
        assert_eq!(ids[0], 101, "[CLS] first");
        assert_eq!(*ids.last().unwrap(), 102, "[SEP] last");
        assert_eq!(h.len(), ids.len() * 384);
        assert!(h.iter().all(|v| v.is_finite()));
    }
    assert_eq!(r.sentences.len(), 3);
}

#[test]
fn dense_import_matches_reference_hidden_states() {
    let cache = comera_data::default_cache_dir();
    let Some(path) = minilm::cached(&cache) else {
        eprintln!(
            "SKIPPED: all-MiniLM-L6-v2 weights not in {} (run `comera data fetch minilm`)",
            cache.display()
        );
        return;
    };
    // seq_len 16: the sentences (≤ 12 tokens) are padded, so the attention mask is exercised.
    let (enc, info) = load_bert(&path, Some(16), Some(2), 0).unwrap();
    assert_eq!(
        info.kept_init,
        vec![
            "classifier.weight".to_string(),
            "classifier.bias".to_string()
        ]
    );
    assert!(info.unused.is_empty(), "{:?}", info.unused);
    let rep = minilm::check(&enc, &minilm::reference()).unwrap();
    eprintln!("MiniLM dense import: {rep:?}");
    assert!(
        rep.max_rel <= minilm::TOLERANCE,
        "max relative error {} > {}",
        rep.max_rel,
        minilm::TOLERANCE
    );
    // TT-SVD of every linear layer at a small rank builds and reports sane errors (the word
    // table is left out here to keep the test quick; `comera import minilm --tt` covers it).
    let opts = CompressOptions {
        word: None,
        ..CompressOptions::rank(4)
    };
    let (tt, reports) = compress(&enc, &opts).unwrap();
    assert_eq!(reports.len(), 6 * 6);
    for r in &reports {
        assert!(r.rel_error > 0.0 && r.rel_error < 1.0, "{r:?}");
    }
    assert!(tt.num_params() < enc.num_params());
    assert!(tt.cfg.tt_linear && !tt.cfg.ttm_embedding);
}
