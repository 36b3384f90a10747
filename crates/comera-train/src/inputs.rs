//! Data handed over in memory (a library user's lists and arrays) stored as ordinary data
//! files, so a run made from them is like any other: its `config.toml` names the files, a
//! resumed or re-run job reads the same bytes, and `data.train_sha256` / `data.valid_sha256`
//! refuse a file that changed.
//!
//! Files go to `CACHE/inputs/SHA256.EXT` (content-addressed: the same data is stored once, and
//! a name can only ever hold its own bytes), written atomically. Formats:
//! - labelled texts: CSV (RFC 4180 quoting, so any text survives) with columns `text`,
//!   `text_pair` (sentence pairs) and `label`;
//! - a masked-LM corpus: a text file of paragraphs (one document a paragraph, read with
//!   `data.text_docs = "paragraphs"`);
//! - click logs: Criteo-format TSV (label, 13 integer features, 26 categorical ids in hex).

use crate::error::{Error, IoContext, Result};
use comera_data::ctr::{CRITEO_CATS, CRITEO_DENSE};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The text column a file source uses when `data.text_a` does not name one: the first of these
/// the file has.
pub const TEXT_COLUMNS: &[&str] = &["text", "sentence", "sentence1"];
/// The second text of a sentence pair, when `data.text_a` and `data.text_b` are not set.
pub const PAIR_COLUMNS: &[&str] = &["text_pair", "sentence2"];
/// The label column, when `data.label` does not name one.
pub const LABEL_COLUMN: &str = "label";

/// A data file written from memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredInput {
    pub path: PathBuf,
    /// SHA-256 of its bytes (hex), also its file name.
    pub sha256: String,
    /// Rows (examples, documents) it holds.
    pub rows: usize,
}

/// Labelled texts: one text (or a pair) and a label each.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelledTexts {
    pub text: Vec<String>,
    /// Second texts of sentence pairs (same length as `text`).
    pub text_pair: Option<Vec<String>>,
    pub label: Vec<String>,
}

impl LabelledTexts {
    /// The distinct labels in the order a file's labels take ([`comera_data::sorted_labels`]):
    /// the label set when the caller gives none.
    pub fn label_set(&self) -> Vec<String> {
        comera_data::sorted_labels(self.label.clone())
    }

    fn check(&self, what: &str) -> Result<()> {
        let n = self.text.len();
        if n == 0 {
            return Err(Error::data(format!("{what}: no examples")));
        }
        if self.label.len() != n {
            return Err(Error::data(format!(
                "{what}: {n} texts but {} labels; give one label a text",
                self.label.len()
            )));
        }
        if let Some(p) = &self.text_pair {
            if p.len() != n {
                return Err(Error::data(format!(
                    "{what}: {n} texts but {} second texts (text_pair); give one a text",
                    p.len()
                )));
            }
        }
        Ok(())
    }
}

/// SHA-256 of `bytes`, hex.
pub fn sha256_bytes(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The SHA-256 of the file at `path`, hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let bytes = comera_data::read_regular(path).io(path, "cannot read")?;
    Ok(sha256_bytes(&bytes))
}

/// Refuses `path` if its SHA-256 is not `expected` (`field` names the config field).
pub fn check_sha256(path: &Path, expected: &str, field: &str) -> Result<()> {
    let got = sha256_file(path)?;
    if got != expected.to_ascii_lowercase() {
        return Err(crate::config::ConfigError::new(
            field,
            format!(
                "{} has sha256 {got}, not {expected}: the file changed since the run was configured; restore it, or start a new run",
                path.display()
            ),
        )
        .into());
    }
    Ok(())
}

/// Writes `bytes` to `cache/inputs/SHA256.ext`.
fn store(cache: &Path, ext: &str, bytes: &[u8], rows: usize) -> Result<StoredInput> {
    let sha256 = sha256_bytes(bytes);
    let dir = cache.join("inputs");
    std::fs::create_dir_all(&dir).io(&dir, "create")?;
    let path = dir.join(format!("{sha256}.{ext}"));
    crate::files::write_atomic(&path, bytes)?;
    Ok(StoredInput { path, sha256, rows })
}

/// Stores labelled texts as CSV (`text`, `text_pair`, `label`: the columns a file source finds
/// by convention, [`TEXT_COLUMNS`]); `what` names them in errors
/// (`training data`).
pub fn store_labelled_texts(cache: &Path, t: &LabelledTexts, what: &str) -> Result<StoredInput> {
    t.check(what)?;
    let mut w = csv::Writer::from_writer(Vec::new());
    let csv_err = |e: csv::Error| Error::data(format!("{what}: {e}"));
    match &t.text_pair {
        Some(_) => w.write_record([TEXT_COLUMNS[0], PAIR_COLUMNS[0], LABEL_COLUMN]),
        None => w.write_record([TEXT_COLUMNS[0], LABEL_COLUMN]),
    }
    .map_err(csv_err)?;
    for i in 0..t.text.len() {
        match &t.text_pair {
            Some(p) => w.write_record([&t.text[i], &p[i], &t.label[i]]),
            None => w.write_record([&t.text[i], &t.label[i]]),
        }
        .map_err(csv_err)?;
    }
    let bytes = w
        .into_inner()
        .map_err(|e| Error::data(format!("{what}: {e}")))?;
    store(cache, "csv", &bytes, t.text.len())
}

/// Stores a corpus of documents as paragraphs: blank lines inside a document are closed up
/// (a blank line is what separates documents), empty documents are dropped.
pub fn store_corpus(cache: &Path, docs: &[String]) -> Result<StoredInput> {
    let mut text = String::new();
    let mut rows = 0;
    for doc in docs {
        let lines: Vec<&str> = doc.lines().filter(|l| !l.trim().is_empty()).collect();
        if lines.is_empty() {
            continue;
        }
        for l in lines {
            text.push_str(l);
            text.push('\n');
        }
        text.push('\n');
        rows += 1;
    }
    if rows == 0 {
        return Err(Error::data("corpus: no non-empty document"));
    }
    store(cache, "txt", text.as_bytes(), rows)
}

/// Click logs in memory: `dense` n × 13 integer features (negative = missing), `cats` n × 26
/// categorical ids, `labels` n clicks (0 or 1), row-major.
pub struct ClickRows<'a> {
    pub dense: &'a [i64],
    pub cats: &'a [i64],
    pub labels: &'a [i64],
}

/// Stores click rows as Criteo-format TSV; returns the file and, for each of the 26 fields,
/// its largest id + 1 (the table size that holds every id).
pub fn store_click_rows(
    cache: &Path,
    rows: &ClickRows<'_>,
    what: &str,
) -> Result<(StoredInput, Vec<usize>)> {
    let n = rows.labels.len();
    if n == 0 {
        return Err(Error::data(format!("{what}: no rows")));
    }
    if rows.dense.len() != n * CRITEO_DENSE || rows.cats.len() != n * CRITEO_CATS {
        return Err(Error::data(format!(
            "{what}: the DLRM reads Criteo-layout rows: {n} labels need {n} × {CRITEO_DENSE} integer features and {n} × {CRITEO_CATS} categorical ids, got {} and {} values",
            rows.dense.len(),
            rows.cats.len()
        )));
    }
    let mut sizes = vec![1usize; CRITEO_CATS];
    let mut text = String::with_capacity(n * 160);
    for i in 0..n {
        let label = rows.labels[i];
        if label != 0 && label != 1 {
            return Err(Error::data(format!(
                "{what}: label of row {i} is {label}; a click label is 0 or 1"
            )));
        }
        text.push_str(if label == 1 { "1" } else { "0" });
        for &v in &rows.dense[i * CRITEO_DENSE..(i + 1) * CRITEO_DENSE] {
            text.push('\t');
            if v >= 0 {
                text.push_str(&v.to_string());
            }
        }
        for (f, &id) in rows.cats[i * CRITEO_CATS..(i + 1) * CRITEO_CATS]
            .iter()
            .enumerate()
        {
            if id < 0 {
                return Err(Error::data(format!(
                    "{what}: categorical id {id} in row {i}, field {f}; ids are 0 or more"
                )));
            }
            sizes[f] = sizes[f].max(id as usize + 1);
            text.push('\t');
            text.push_str(&format!("{id:x}"));
        }
        text.push('\n');
    }
    Ok((store(cache, "tsv", text.as_bytes(), n)?, sizes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labelled_texts_round_trip_through_the_csv_loader_whatever_they_hold() {
        let dir = std::env::temp_dir().join(format!("comera-inputs-{}", std::process::id()));
        let t = LabelledTexts {
            text: vec!["a, \"quoted\"\ttab".into(), "two\nlines".into(), "b".into()],
            text_pair: None,
            label: vec!["y".into(), "x".into(), "y".into()],
        };
        let s = store_labelled_texts(&dir, &t, "training data").unwrap();
        assert_eq!(s.rows, 3);
        assert!(s.path.ends_with(format!("inputs/{}.csv", s.sha256)));
        let spec = comera_data::TableSpec::single(
            comera_data::TableFormat::Csv,
            "text",
            "label",
            comera_data::Labels::Names(t.label_set()),
        );
        let back = comera_data::load_table(&s.path, &spec).unwrap();
        let texts: Vec<&str> = back.examples.iter().map(|e| e.text_a.as_str()).collect();
        assert_eq!(texts, ["a, \"quoted\"\ttab", "two\nlines", "b"]);
        let labels: Vec<usize> = back.examples.iter().map(|e| e.label).collect();
        assert_eq!(labels, [1, 0, 1]);
        check_sha256(&s.path, &s.sha256, "data.train_sha256").unwrap();
        std::fs::write(&s.path, "text,label\nz,y\n").unwrap();
        let err = check_sha256(&s.path, &s.sha256, "data.train_sha256").unwrap_err();
        assert!(err.to_string().contains("changed since"), "{err}");
        let bad = LabelledTexts {
            label: vec!["y".into()],
            ..t
        };
        let err = store_labelled_texts(&dir, &bad, "training data").unwrap_err();
        assert!(err.to_string().contains("3 texts but 1 labels"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
