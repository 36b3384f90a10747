//! Parquet files as pyarrow and pandas write them (fixtures/parquet, made by its make.py):
//! every codec reads to the same examples as the uncompressed file, and a file with a column
//! named twice is refused as a CSV header would be.

use comera_data::{load_parquet, Labels, LoadError};
use std::path::PathBuf;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/parquet")
        .join(name)
}

#[test]
fn every_codec_reads_the_same_rows() {
    let plain = load_parquet(
        &fixture("reviews-none.parquet"),
        "text",
        "label",
        &Labels::FromData,
    )
    .unwrap();
    assert_eq!(plain.examples.len(), 48);
    assert_eq!(plain.label_names, ["neg", "pos"]);
    for codec in ["snappy", "gzip", "brotli", "lz4", "zstd"] {
        let path = fixture(&format!("reviews-{codec}.parquet"));
        let set = load_parquet(&path, "text", "label", &Labels::FromData)
            .unwrap_or_else(|e| panic!("{codec}: {e}"));
        assert_eq!(set, plain, "{codec}");
    }
}

#[test]
fn a_column_named_twice_is_refused() {
    let path = fixture("duplicate-text.parquet");
    let err = load_parquet(&path, "text", "label", &Labels::FromData).unwrap_err();
    assert!(matches!(err, LoadError::DuplicateColumn { .. }), "{err}");
    assert!(err.to_string().contains("`text` appears twice"), "{err}");
}
