//! TableFormat-file and Parquet loaders on small files written here.

use comera_data::{
    load_parquet, load_reviews, load_table, Example, Labels, LoadError, ReviewLabel, TableFormat,
    TableSpec,
};
use std::path::{Path, PathBuf};

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn ex(a: &str, b: Option<&str>, label: usize) -> Example {
    Example {
        text_a: a.to_string(),
        text_b: b.map(str::to_string),
        label,
    }
}

const MNLI_HEADER: &str = "index\tgenre\tsentence1\tsentence2\tgold_label";

#[test]
fn mnli_tsv_reads_pairs_and_ignores_other_columns() {
    let dir = tempfile::tempdir().unwrap();
    let body = format!(
        "{MNLI_HEADER}\r\n\
         0\tfiction\tHe said \"stop.\tShe didn't.\tcontradiction\r\n\
         1\tslate\t\"Quoted\" start\tend \"quoted\"\tentailment\r\n\
         \r\n\
         2\tgov\tCafé, naïve\t  \tneutral\r\n\
         3\tgov\tA, b\tc;d\t neutral \r\n"
    );
    let path = write(dir.path(), "dev.tsv", body.as_bytes());
    let set = load_table(&path, &TableSpec::mnli()).unwrap();
    assert_eq!(set.label_names, ["entailment", "neutral", "contradiction"]);
    assert_eq!(
        set.examples,
        vec![
            ex("He said \"stop.", Some("She didn't."), 2),
            ex("\"Quoted\" start", Some("end \"quoted\""), 0),
            ex("A, b", Some("c;d"), 1),
        ]
    );
    assert_eq!(set.dropped, 1, "the row with a blank sentence2");
}

fn mnli_err(body: &str) -> (LoadError, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "train.tsv", body.as_bytes());
    let err = load_table(&path, &TableSpec::mnli()).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("train.tsv"), "{msg}");
    (err, msg)
}

#[test]
fn a_row_with_a_stray_tab_names_its_line() {
    let (err, msg) = mnli_err(&format!(
        "{MNLI_HEADER}\n0\tg\ta\tb\tneutral\n1\tg\ta\twith\ttab\tneutral\n"
    ));
    assert!(
        matches!(
            err,
            LoadError::ColumnCount {
                line: 3,
                expected: 5,
                found: 6,
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.contains(":3:") && msg.contains("expected 5 fields"),
        "{msg}"
    );

    let (err, _) = mnli_err(&format!("{MNLI_HEADER}\n0\tg\ta\tb\n"));
    assert!(matches!(
        err,
        LoadError::ColumnCount {
            line: 2,
            found: 4,
            ..
        }
    ));
}

#[test]
fn an_unknown_label_names_line_field_and_label_set() {
    let (err, msg) = mnli_err(&format!(
        "{MNLI_HEADER}\n0\tg\ta\tb\tneutral\n1\tg\ta\tb\tneutral\n2\tg\ta\tb\t-\n"
    ));
    assert!(matches!(err, LoadError::BadLabel { line: 4, .. }), "{msg}");
    for part in [":4:", "gold_label", "\"-\"", "entailment", "contradiction"] {
        assert!(msg.contains(part), "{part} in {msg}");
    }
}

#[test]
fn a_missing_column_names_the_column_and_the_header() {
    let (err, msg) = mnli_err("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tneutral\n");
    assert!(matches!(err, LoadError::MissingColumn { .. }), "{msg}");
    assert!(
        msg.contains(":1:") && msg.contains("gold_label") && msg.contains("sentence2"),
        "{msg}"
    );
}

#[test]
fn non_utf8_names_line_and_field() {
    let mut body = format!("{MNLI_HEADER}\n0\tg\tok\tok\tneutral\n1\tg\tok\t").into_bytes();
    body.extend_from_slice(b"bad \xff byte\tneutral\n");
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "bad.tsv", &body);
    let err = load_table(&path, &TableSpec::mnli()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, LoadError::NotUtf8 { line: 3, .. }), "{msg}");
    assert!(msg.contains("sentence2") && msg.contains("UTF-8"), "{msg}");
}

#[test]
fn empty_and_missing_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "empty.tsv", b"");
    assert!(matches!(
        load_table(&path, &TableSpec::mnli()),
        Err(LoadError::Empty { .. })
    ));
    let missing = dir.path().join("missing.tsv");
    let err = load_table(&missing, &TableSpec::mnli()).unwrap_err();
    assert!(matches!(err, LoadError::Io { .. }));
    assert!(err.to_string().contains("missing.tsv"));
}

#[test]
fn csv_handles_quoting_and_counts_lines_of_multiline_records() {
    let dir = tempfile::tempdir().unwrap();
    let body = "\u{feff}label,id,review\n\
                pos,1,\"Great, really \"\"great\"\" value\"\n\
                neg,2,\"two\nlines\"\n\
                pos,3,plain\n\
                meh,4,unknown label here\n";
    let path = write(dir.path(), "reviews.csv", body.as_bytes());
    let spec = TableSpec::single(
        TableFormat::Csv,
        "review",
        "label",
        Labels::names(&["neg", "pos"]),
    );
    let err = load_table(&path, &spec).unwrap_err();
    let msg = err.to_string();
    // The two-line record occupies lines 3-4, so the bad label is on line 6.
    assert!(matches!(err, LoadError::BadLabel { line: 6, .. }), "{msg}");
    assert!(msg.contains("\"meh\"") && msg.contains("`label`"), "{msg}");

    let body = body.replace("meh", "neg");
    let path = write(dir.path(), "reviews.csv", body.as_bytes());
    let set = load_table(&path, &spec).unwrap();
    assert_eq!(
        set.examples,
        vec![
            ex("Great, really \"great\" value", None, 1),
            ex("two\nlines", None, 0),
            ex("plain", None, 1),
            ex("unknown label here", None, 0),
        ]
    );
    assert_eq!(set.label_names, ["neg", "pos"]);
}

#[test]
fn numeric_labels_binarised_at_a_threshold() {
    let dir = tempfile::tempdir().unwrap();
    let body = "id\tsentiment\ttext\r\n1\t2.3\tgood\r\n2\t-0.5\tbad\r\n3\t0\tflat\r\n";
    let path = write(dir.path(), "snippets.tsv", body.as_bytes());
    let set = load_table(&path, &TableSpec::movie_snippets()).unwrap();
    let labels: Vec<usize> = set.examples.iter().map(|e| e.label).collect();
    assert_eq!(labels, vec![1, 0, 0]);
    assert_eq!(set.examples[2].text_a, "flat");
    assert_eq!(set.label_names, ["negative", "positive"]);

    let path = write(
        dir.path(),
        "bad.tsv",
        b"id\tsentiment\ttext\n1\tvery\tgood\n",
    );
    let msg = load_table(&path, &TableSpec::movie_snippets())
        .unwrap_err()
        .to_string();
    assert!(msg.contains(":2:") && msg.contains("a number"), "{msg}");
}

mod parquet_files {
    use super::*;
    use parquet::basic::{Compression, ConvertedType, Repetition, Type as PhysicalType};
    use parquet::data_type::{ByteArray, ByteArrayType, Int32Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::types::Type;
    use std::sync::Arc;

    /// A brotli Parquet file shaped like the reviews set: optional text, two int labels, an age.
    fn reviews_file(dir: &Path, texts: &[Option<&str>], ratings: &[i32]) -> PathBuf {
        let path = dir.join("reviews.parquet.brotli");
        let col = |name: &str, ty, rep| {
            let b = Type::primitive_type_builder(name, ty).with_repetition(rep);
            let b = if ty == PhysicalType::BYTE_ARRAY {
                b.with_converted_type(ConvertedType::UTF8)
            } else {
                b
            };
            Arc::new(b.build().unwrap())
        };
        let schema = Type::group_type_builder("schema")
            .with_fields(vec![
                col("Age", PhysicalType::INT32, Repetition::REQUIRED),
                col(
                    "Review Text",
                    PhysicalType::BYTE_ARRAY,
                    Repetition::OPTIONAL,
                ),
                col("Rating", PhysicalType::INT32, Repetition::REQUIRED),
                col("Recommended IND", PhysicalType::INT32, Repetition::REQUIRED),
            ])
            .build()
            .unwrap();
        let props = WriterProperties::builder()
            .set_compression(Compression::BROTLI(Default::default()))
            .build();
        let file = std::fs::File::create(&path).unwrap();
        let mut writer =
            SerializedFileWriter::new(file, Arc::new(schema), Arc::new(props)).unwrap();
        let mut rg = writer.next_row_group().unwrap();
        let n = ratings.len();
        // Age
        let mut c = rg.next_column().unwrap().unwrap();
        let ages: Vec<i32> = (0..n as i32).map(|i| 30 + i).collect();
        c.typed::<Int32Type>()
            .write_batch(&ages, None, None)
            .unwrap();
        c.close().unwrap();
        // Review Text (nulls have definition level 0)
        let mut c = rg.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = texts
            .iter()
            .flatten()
            .map(|t| ByteArray::from(*t))
            .collect();
        let defs: Vec<i16> = texts.iter().map(|t| i16::from(t.is_some())).collect();
        c.typed::<ByteArrayType>()
            .write_batch(&values, Some(&defs), None)
            .unwrap();
        c.close().unwrap();
        // Rating, Recommended IND
        for values in [
            ratings.to_vec(),
            ratings.iter().map(|&r| i32::from(r >= 4)).collect(),
        ] {
            let mut c = rg.next_column().unwrap().unwrap();
            c.typed::<Int32Type>()
                .write_batch(&values, None, None)
                .unwrap();
            c.close().unwrap();
        }
        rg.close().unwrap();
        writer.close().unwrap();
        path
    }

    #[test]
    fn reviews_pick_text_and_label_and_drop_empty_text() {
        let dir = tempfile::tempdir().unwrap();
        let texts = [
            Some("Love it"),
            None,
            Some("Too small"),
            Some("  "),
            Some("Fine"),
        ];
        let path = reviews_file(dir.path(), &texts, &[5, 4, 2, 3, 3]);

        let set = load_reviews(&path, ReviewLabel::Rating).unwrap();
        assert_eq!(
            set.examples,
            vec![
                ex("Love it", None, 4),
                ex("Too small", None, 1),
                ex("Fine", None, 2)
            ]
        );
        assert_eq!(set.dropped, 2);
        assert_eq!(set.label_names, ["1", "2", "3", "4", "5"]);

        let set = load_reviews(&path, ReviewLabel::Recommended).unwrap();
        let labels: Vec<usize> = set.examples.iter().map(|e| e.label).collect();
        assert_eq!(labels, vec![1, 0, 0]);
        // The column holds 0/1 codes; the labels are named after what they mean.
        assert_eq!(set.label_names, ["not recommended", "recommended"]);

        // Any column can be the label, as text or as a number.
        let set = load_parquet(&path, "Review Text", "Age", &Labels::Above(31.5)).unwrap();
        let labels: Vec<usize> = set.examples.iter().map(|e| e.label).collect();
        assert_eq!(labels, vec![0, 1, 1]);
    }

    #[test]
    fn label_outside_the_set_and_missing_column_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = reviews_file(dir.path(), &[Some("a"), Some("b"), Some("c")], &[5, 7, 1]);
        let err = load_reviews(&path, ReviewLabel::Rating).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, LoadError::ParquetValue { row: 2, .. }),
            "{msg}"
        );
        assert!(msg.contains("Rating") && msg.contains("\"7\""), "{msg}");

        let err = load_parquet(&path, "Title", "Rating", &Labels::names(&["1"])).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, LoadError::MissingColumn { .. }), "{msg}");
        assert!(
            msg.contains("Title") && msg.contains("Review Text"),
            "{msg}"
        );

        let not_parquet = write(dir.path(), "x.parquet", b"not parquet at all");
        let err = load_parquet(&not_parquet, "a", "b", &Labels::Above(0.0)).unwrap_err();
        assert!(matches!(err, LoadError::Parquet { .. }), "{err}");
    }
}
