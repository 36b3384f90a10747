//! An error's message names the file and prints its cause once: the cause is part of the
//! message, and not also a `source()` that a chain printer (anyhow's `{:#}`) would add again.

use comera_data::ctr::{load_adult, CatMapping, CriteoReader, CriteoSpec};
use comera_data::{load_table, BertTokenizer, Labels, TableFormat, TableSpec};
use std::error::Error;
use std::path::Path;

/// Every cause in the chain of `e` is printed once by a chain printer.
fn cause_once(e: &(dyn Error + 'static), path: &Path) -> String {
    let msg = e.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("No such file"), "{msg}");
    let mut chain = msg.clone();
    let mut cur = e.source();
    while let Some(s) = cur {
        let part = s.to_string();
        assert!(
            !msg.contains(&part),
            "cause `{part}` printed twice in `{msg}`"
        );
        chain = format!("{chain}: {part}");
        cur = s.source();
    }
    chain
}

#[test]
fn io_errors_name_the_file_and_print_the_cause_once() {
    let path = std::env::temp_dir().join("comera-no-such-file-errors-test.tsv");
    let spec = TableSpec::single(TableFormat::Tsv, "sentence", "label", Labels::names(&["0"]));
    cause_once(&load_table(&path, &spec).unwrap_err(), &path);
    cause_once(&BertTokenizer::from_vocab_file(&path).unwrap_err(), &path);
    cause_once(&load_adult(&path, "income").unwrap_err(), &path);
    let criteo = CriteoSpec {
        table_sizes: vec![10; 26],
        mapping: CatMapping::Hash,
        max_malformed: 0,
    };
    match CriteoReader::open(&path, criteo) {
        Err(e) => {
            cause_once(&e, &path);
        }
        Ok(_) => panic!("opened a missing file"),
    }
}

#[test]
fn setting_names_parse_to_typed_errors() {
    let e = "lsh".parse::<CatMapping>().unwrap_err();
    assert_eq!(e.to_string(), "`lsh` is not `hash` or `modulo`");
    let e = "sentencepiece"
        .parse::<comera_data::TokenizerKind>()
        .unwrap_err();
    assert!(e.to_string().contains("\"sentencepiece\""), "{e}");
    assert_eq!(e.0, "sentencepiece");
}
