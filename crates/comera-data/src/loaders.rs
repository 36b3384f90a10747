//! Text-classification data sets as `Example`s: delimited tables (GLUE TSV, CSV), JSON Lines
//! and Parquet.
//!
//! Columns are picked by name (a header row, the keys of a JSON object, Parquet's schema); other
//! columns are ignored. TSV is split on tabs only, with no quoting (as GLUE's files need: a `"`
//! is an ordinary character); CSV follows RFC 4180 quoting; JSON Lines holds one object a line
//! (strings, numbers, booleans or null). Rows whose text is empty are dropped and counted.
//! Labels are matched against a given set, or read from the data ([`Labels::FromData`]).
//! Errors name the file, the 1-based line (the header is line 1; for Parquet, the 1-based row)
//! and the field.

use crate::regular::open_regular;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::Field;
use parquet::schema::types::Type;
use std::path::{Path, PathBuf};

/// One labelled example: a sentence, or a sentence pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Example {
    pub text_a: String,
    pub text_b: Option<String>,
    /// Index into `LoadedSet::label_names`.
    pub label: usize,
}

/// What a loader read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedSet {
    pub examples: Vec<Example>,
    pub label_names: Vec<String>,
    /// Rows dropped because a text field was empty (or null).
    pub dropped: usize,
}

/// How a label field becomes a class index.
#[derive(Debug, Clone, PartialEq)]
pub enum Labels {
    /// The field (trimmed) must be one of these; its position is the label.
    Names(Vec<String>),
    /// The distinct values of the field (trimmed) are the labels, sorted: as numbers when every
    /// value is one (`2` before `10`), else as text.
    FromData,
    /// The field is a number: label 1 if it is greater than the threshold, else 0.
    Above(f64),
    /// [`Labels::Above`] with names for the two sides (e.g. `negative`, `positive`).
    AboveNamed(f64, [String; 2]),
    /// The field (trimmed) must be one of `values` (codes such as `0`, `1`); its position is
    /// the label, and `names` (same length) are what the labels mean.
    Coded {
        values: Vec<String>,
        names: Vec<String>,
    },
}

impl Labels {
    /// `Labels::Names` from string slices.
    pub fn names(names: &[&str]) -> Self {
        Labels::Names(names.iter().map(|s| s.to_string()).collect())
    }

    /// `Labels::Coded` from (value, name) pairs.
    pub fn coded(pairs: &[(&str, &str)]) -> Self {
        Labels::Coded {
            values: pairs.iter().map(|p| p.0.to_string()).collect(),
            names: pairs.iter().map(|p| p.1.to_string()).collect(),
        }
    }

    /// The class names, in label order (empty for [`Labels::FromData`]: the data says).
    pub fn label_names(&self) -> Vec<String> {
        match self {
            Labels::Names(names) => names.clone(),
            Labels::FromData => Vec::new(),
            Labels::Above(t) => vec![format!("<= {t}"), format!("> {t}")],
            Labels::AboveNamed(_, names) => names.to_vec(),
            Labels::Coded { names, .. } => names.clone(),
        }
    }

    /// The mapper that reads one file's label fields.
    fn mapper(&self) -> LabelMapper<'_> {
        let mut index = ahash::AHashMap::new();
        if let Labels::Names(names) | Labels::Coded { values: names, .. } = self {
            for (i, n) in names.iter().enumerate() {
                index.entry(n.clone()).or_insert(i);
            }
        }
        LabelMapper {
            labels: self,
            seen: Vec::new(),
            index,
        }
    }
}

/// The most distinct labels a data set may have. A classifier's head, its logits and the
/// evaluation's per-class counts grow with the label count (its confusion table is kept only
/// for a few classes, see comera-train's `ClassReport`); beyond this many, a "label" column is
/// almost always an id or a free-text column named by mistake.
pub const MAX_LABELS: usize = 100_000;

/// Label fields to class indices for one file: for [`Labels::FromData`] the values in the
/// order first seen (`index` finds a value's position in `seen`), renumbered in sorted order
/// by [`LabelMapper::finish`]; for given names or codes, `index` holds their positions.
struct LabelMapper<'a> {
    labels: &'a Labels,
    seen: Vec<String>,
    index: ahash::AHashMap<String, usize>,
}

impl LabelMapper<'_> {
    /// The label of `value`, or what was expected.
    fn map(&mut self, value: &str) -> Result<usize, LabelExpected> {
        let value = value.trim();
        match self.labels {
            Labels::Names(names) | Labels::Coded { values: names, .. } => self
                .index
                .get(value)
                .copied()
                .ok_or_else(|| LabelExpected::OneOf(names.clone())),
            Labels::FromData => {
                if value.is_empty() {
                    return Err(LabelExpected::NonEmpty);
                }
                if let Some(&i) = self.index.get(value) {
                    return Ok(i);
                }
                // A label becomes a class name: predict prints it in TSV and the Hugging Face
                // export writes it as a `label2id` key (the rule of `data.label_names`).
                if value.chars().any(char::is_control) {
                    return Err(LabelExpected::NoControl);
                }
                if self.seen.len() == MAX_LABELS {
                    return Err(LabelExpected::AtMost(MAX_LABELS));
                }
                self.seen.push(value.to_string());
                self.index.insert(value.to_string(), self.seen.len() - 1);
                Ok(self.seen.len() - 1)
            }
            Labels::Above(t) | Labels::AboveNamed(t, _) => match value.parse::<f64>() {
                Ok(v) if !v.is_nan() => Ok(usize::from(v > *t)),
                _ => Err(LabelExpected::Number),
            },
        }
    }

    /// The set's label names, with the examples' labels renumbered to them.
    fn finish(self, examples: &mut [Example]) -> Vec<String> {
        if !matches!(self.labels, Labels::FromData) {
            return self.labels.label_names();
        }
        let names = sorted_labels(self.seen.clone());
        let sorted_position: ahash::AHashMap<&str, usize> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i))
            .collect();
        let new_index: Vec<usize> = self
            .seen
            .iter()
            .map(|v| sorted_position[v.as_str()])
            .collect();
        for e in examples {
            e.label = new_index[e.label];
        }
        names
    }
}

/// Label values in label order: as numbers when every value is a finite number (`2` before
/// `10`), else by text.
pub fn sorted_labels(mut values: Vec<String>) -> Vec<String> {
    values.sort();
    values.dedup();
    let numbers: Option<Vec<f64>> = values
        .iter()
        .map(|v| v.parse::<f64>().ok().filter(|x| x.is_finite()))
        .collect();
    if let Some(numbers) = numbers {
        let mut order: Vec<usize> = (0..values.len()).collect();
        order.sort_by(|&i, &j| numbers[i].total_cmp(&numbers[j]).then(i.cmp(&j)));
        values = order.into_iter().map(|i| values[i].clone()).collect();
    }
    values
}

/// Up to 20 of `names` as a list for an error (`["a", "b", …]` and how many in all beyond).
fn some_of(names: &[String]) -> String {
    const SHOWN: usize = 20;
    if names.len() <= SHOWN {
        return format!("{names:?}");
    }
    format!("{:?} … ({} in all)", &names[..SHOWN], names.len())
}

/// What a label field should have held (a [`LoadError::BadLabel`] says "label … is not" this).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LabelExpected {
    #[error("one of {}", some_of(.0))]
    OneOf(Vec<String>),
    #[error("a number")]
    Number,
    #[error("a non-empty value")]
    NonEmpty,
    #[error("a label free of control characters (tab, newline, NUL, …), which would break predict's TSV output and the exports' label maps")]
    NoControl,
    #[error("one of at most {0} distinct labels (this is one more; is the label column an id or a text column?)")]
    AtMost(usize),
}

/// The layout of a table file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableFormat {
    /// Tab-separated with a header row, no quoting.
    Tsv,
    /// Comma-separated with a header row and `"` quoting.
    Csv,
    /// JSON Lines: one JSON object a line.
    Jsonl,
    /// Apache Parquet.
    Parquet,
}

impl TableFormat {
    /// The format a file name's extension says (`.csv`, `.tsv`/`.tab`, `.jsonl`/`.ndjson`,
    /// `.parquet`/`.pq`), case-insensitive.
    pub fn from_extension(path: &Path) -> Option<TableFormat> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        Some(match ext.as_str() {
            "csv" => TableFormat::Csv,
            "tsv" | "tab" => TableFormat::Tsv,
            "jsonl" | "ndjson" => TableFormat::Jsonl,
            "parquet" | "pq" => TableFormat::Parquet,
            _ => return None,
        })
    }
}

/// Which columns of a table file make the examples.
#[derive(Debug, Clone, PartialEq)]
pub struct TableSpec {
    pub format: TableFormat,
    pub text_a: String,
    pub text_b: Option<String>,
    pub label: String,
    pub labels: Labels,
}

impl TableSpec {
    /// One text column and a label column.
    pub fn single(format: TableFormat, text: &str, label: &str, labels: Labels) -> Self {
        TableSpec {
            format,
            text_a: text.to_string(),
            text_b: None,
            label: label.to_string(),
            labels,
        }
    }

    /// Two text columns and a label column.
    pub fn pair(format: TableFormat, a: &str, b: &str, label: &str, labels: Labels) -> Self {
        TableSpec {
            text_b: Some(b.to_string()),
            ..TableSpec::single(format, a, label, labels)
        }
    }

    /// GLUE MNLI TSV: `sentence1`, `sentence2`, `gold_label` in entailment/neutral/contradiction.
    pub fn mnli() -> Self {
        TableSpec::pair(
            TableFormat::Tsv,
            "sentence1",
            "sentence2",
            "gold_label",
            Labels::names(&["entailment", "neutral", "contradiction"]),
        )
    }

    /// The `movie-snippets` TSV (`id`, `sentiment`, `text`), sentiment binarised at 0:
    /// `negative` (≤ 0) and `positive`.
    pub fn movie_snippets() -> Self {
        let names = ["negative".to_string(), "positive".to_string()];
        TableSpec::single(
            TableFormat::Tsv,
            "text",
            "sentiment",
            Labels::AboveNamed(0.0, names),
        )
    }

    /// The `trec` CSV with its six coarse classes (`label-coarse` 0-5: abbreviation, entity,
    /// description, human, location, numeric — TREC-6's order).
    pub fn trec_coarse() -> Self {
        TableSpec::single(
            TableFormat::Csv,
            "text",
            "label-coarse",
            Labels::coded(&[
                ("0", "ABBR"),
                ("1", "ENTY"),
                ("2", "DESC"),
                ("3", "HUM"),
                ("4", "LOC"),
                ("5", "NUM"),
            ]),
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: empty file, expected a header row")]
    Empty { path: PathBuf },
    #[error("{path}:1: header has no column `{column}` (columns: {header:?})")]
    MissingColumn {
        path: PathBuf,
        column: String,
        header: Vec<String>,
    },
    #[error("{path}:1: column `{column}` appears twice in the header (columns {first} and {second}); rename one so that it is clear which to read")]
    DuplicateColumn {
        path: PathBuf,
        column: String,
        first: usize,
        second: usize,
    },
    #[error("{path}:{line}: expected {expected} fields as in the header, found {found}")]
    ColumnCount {
        path: PathBuf,
        line: u64,
        expected: usize,
        found: usize,
    },
    #[error("{path}:{line}: field `{field}`: not valid UTF-8 ({detail})")]
    NotUtf8 {
        path: PathBuf,
        line: u64,
        field: String,
        detail: String,
    },
    #[error("{path}:{line}: field `{field}`: label {value:?} is not {expected}")]
    BadLabel {
        path: PathBuf,
        line: u64,
        field: String,
        value: String,
        expected: LabelExpected,
    },
    #[error("{path}:{line}: {detail}")]
    Malformed {
        path: PathBuf,
        line: u64,
        detail: String,
    },
    #[error("{path}: cannot read it as Parquet: {detail}")]
    Parquet { path: PathBuf, detail: String },
    #[error("{path}: row {row}: column `{field}`: {detail}")]
    ParquetValue {
        path: PathBuf,
        row: u64,
        field: String,
        detail: String,
    },
}

/// Reads a table file (of `spec.format`) into examples.
pub fn load_table(path: &Path, spec: &TableSpec) -> Result<LoadedSet, LoadError> {
    match spec.format {
        TableFormat::Tsv | TableFormat::Csv => load_delimited(path, spec),
        TableFormat::Jsonl => load_jsonl(path, spec),
        TableFormat::Parquet => load_parquet_table(path, spec),
    }
}

/// The column names of a table file: its header row, the keys of its first JSON object, or
/// its Parquet schema's top-level fields.
pub fn table_columns(path: &Path, format: TableFormat) -> Result<Vec<String>, LoadError> {
    let p = || path.to_path_buf();
    let io = |error| LoadError::Io { path: p(), error };
    match format {
        TableFormat::Tsv | TableFormat::Csv => {
            let mut reader = delimited_reader(path, format)?;
            let mut record = csv::ByteRecord::new();
            if !reader
                .read_byte_record(&mut record)
                .map_err(|e| csv_error(path, e))?
            {
                return Err(LoadError::Empty { path: p() });
            }
            header_names(path, &record)
        }
        TableFormat::Jsonl => {
            use std::io::BufRead;
            let file = open_regular(path).map_err(io)?;
            for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
                let line = line.map_err(io)?;
                if !line.trim().is_empty() {
                    return Ok(json_object(path, i as u64 + 1, &line)?
                        .keys()
                        .cloned()
                        .collect());
                }
            }
            Err(LoadError::Empty { path: p() })
        }
        TableFormat::Parquet => {
            let file = open_regular(path).map_err(io)?;
            let reader = SerializedFileReader::new(file).map_err(|e| LoadError::Parquet {
                path: p(),
                detail: parquet_detail(&e),
            })?;
            let root = reader
                .metadata()
                .file_metadata()
                .schema_descr()
                .root_schema();
            Ok(root
                .get_fields()
                .iter()
                .map(|f| f.name().to_string())
                .collect())
        }
    }
}

/// Rows of one file becoming examples: labels mapped, rows without text dropped.
struct Collector<'a> {
    with_pair: bool,
    labels: LabelMapper<'a>,
    examples: Vec<Example>,
    dropped: usize,
}

impl<'a> Collector<'a> {
    fn new(spec: &'a TableSpec) -> Self {
        Collector {
            with_pair: spec.text_b.is_some(),
            labels: spec.labels.mapper(),
            examples: Vec::new(),
            dropped: 0,
        }
    }

    /// One row: its texts (`None`: null or absent) and its label field. The label is checked
    /// first, so a bad label is an error even in a row that is dropped for its empty text.
    fn row(&mut self, a: Option<&str>, b: Option<&str>, label: &str) -> Result<(), LabelExpected> {
        let label = self.labels.map(label)?;
        let empty = |t: Option<&str>| t.is_none_or(|t| t.trim().is_empty());
        if empty(a) || (self.with_pair && empty(b)) {
            self.dropped += 1;
            return Ok(());
        }
        self.examples.push(Example {
            text_a: a.unwrap_or_default().to_string(),
            text_b: b.filter(|_| self.with_pair).map(str::to_string),
            label,
        });
        Ok(())
    }

    fn finish(mut self) -> LoadedSet {
        let label_names = self.labels.finish(&mut self.examples);
        LoadedSet {
            examples: self.examples,
            label_names,
            dropped: self.dropped,
        }
    }
}

/// A CSV/TSV reader of `path` (header row read as an ordinary record).
fn delimited_reader(
    path: &Path,
    format: TableFormat,
) -> Result<csv::Reader<std::io::BufReader<std::fs::File>>, LoadError> {
    let file = open_regular(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        error: source,
    })?;
    Ok(csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .delimiter(if format == TableFormat::Csv {
            b','
        } else {
            b'\t'
        })
        .quoting(format == TableFormat::Csv)
        .from_reader(std::io::BufReader::new(file)))
}

/// A CSV/TSV reading error, naming the file and line.
fn csv_error(path: &Path, e: csv::Error) -> LoadError {
    let line = e.position().map_or(0, |pos| pos.line());
    match e.into_kind() {
        csv::ErrorKind::Io(source) => LoadError::Io {
            path: path.to_path_buf(),
            error: source,
        },
        other => LoadError::Malformed {
            path: path.to_path_buf(),
            line,
            detail: format!("{other:?}"),
        },
    }
}

/// The column names of a header record (a UTF-8 byte-order mark and spaces trimmed).
fn header_names(path: &Path, record: &csv::ByteRecord) -> Result<Vec<String>, LoadError> {
    let line = record.position().map_or(1, |pos| pos.line());
    let mut header = Vec::with_capacity(record.len());
    for (i, field) in record.iter().enumerate() {
        let name = std::str::from_utf8(field).map_err(|e| LoadError::NotUtf8 {
            path: path.to_path_buf(),
            line,
            field: format!("column {}", i + 1),
            detail: e.to_string(),
        })?;
        let name = if i == 0 {
            name.trim_start_matches('\u{feff}')
        } else {
            name
        };
        header.push(name.trim().to_string());
    }
    Ok(header)
}

/// The index of column `name` in `header`: it must appear exactly once.
fn column_index(path: &Path, header: &[String], name: &str) -> Result<usize, LoadError> {
    let mut found = header.iter().enumerate().filter(|(_, h)| *h == name);
    match (found.next(), found.next()) {
        (Some((i, _)), None) => Ok(i),
        (Some((first, _)), Some((second, _))) => Err(LoadError::DuplicateColumn {
            path: path.to_path_buf(),
            column: name.to_string(),
            first: first + 1,
            second: second + 1,
        }),
        (None, _) => Err(LoadError::MissingColumn {
            path: path.to_path_buf(),
            column: name.to_string(),
            header: header.to_vec(),
        }),
    }
}

/// Reads a delimited file with a header row into examples.
fn load_delimited(path: &Path, spec: &TableSpec) -> Result<LoadedSet, LoadError> {
    let p = || path.to_path_buf();
    let mut reader = delimited_reader(path, spec.format)?;
    let mut record = csv::ByteRecord::new();
    if !reader
        .read_byte_record(&mut record)
        .map_err(|e| csv_error(path, e))?
    {
        return Err(LoadError::Empty { path: p() });
    }
    let header = header_names(path, &record)?;
    let col_a = column_index(path, &header, &spec.text_a)?;
    let col_b = spec
        .text_b
        .as_deref()
        .map(|b| column_index(path, &header, b))
        .transpose()?;
    let col_label = column_index(path, &header, &spec.label)?;

    let mut rows = Collector::new(spec);
    while reader
        .read_byte_record(&mut record)
        .map_err(|e| csv_error(path, e))?
    {
        let line = record.position().map_or(0, |pos| pos.line());
        if record.len() != header.len() {
            return Err(LoadError::ColumnCount {
                path: p(),
                line,
                expected: header.len(),
                found: record.len(),
            });
        }
        let text = |col: usize| {
            std::str::from_utf8(&record[col]).map_err(|e| LoadError::NotUtf8 {
                path: p(),
                line,
                field: header[col].clone(),
                detail: e.to_string(),
            })
        };
        let a = text(col_a)?;
        let b = col_b.map(text).transpose()?;
        let value = text(col_label)?;
        rows.row(Some(a), b, value)
            .map_err(|expected| LoadError::BadLabel {
                path: p(),
                line,
                field: spec.label.clone(),
                value: value.to_string(),
                expected,
            })?;
    }
    Ok(rows.finish())
}

/// Line `line` of a JSON Lines file as an object.
fn json_object(
    path: &Path,
    line: u64,
    text: &str,
) -> Result<serde_json::Map<String, serde_json::Value>, LoadError> {
    let malformed = |detail: String| LoadError::Malformed {
        path: path.to_path_buf(),
        line,
        detail,
    };
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(other) => Err(malformed(format!(
            "expected a JSON object ({{\"text\": …, \"label\": …}}), found {}",
            json_kind(&other)
        ))),
        Err(e) => Err(malformed(format!("not JSON: {e}"))),
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// Reads a JSON Lines file (one object a line; blank lines skipped) into examples. A text
/// field that is null or absent is an empty text (the row is dropped); the label field must be
/// present.
fn load_jsonl(path: &Path, spec: &TableSpec) -> Result<LoadedSet, LoadError> {
    use std::io::BufRead;
    let p = || path.to_path_buf();
    let file = open_regular(path).map_err(|error| LoadError::Io { path: p(), error })?;
    let mut rows = Collector::new(spec);
    let mut any = false;
    for (i, text) in std::io::BufReader::new(file).split(b'\n').enumerate() {
        let line = i as u64 + 1;
        let bytes = text.map_err(|error| LoadError::Io { path: p(), error })?;
        let text = std::str::from_utf8(&bytes).map_err(|e| LoadError::NotUtf8 {
            path: p(),
            line,
            field: "the line".to_string(),
            detail: e.to_string(),
        })?;
        if text.trim().is_empty() {
            continue;
        }
        any = true;
        let object = json_object(path, line, text)?;
        let field = |name: &str| -> Result<Option<String>, LoadError> {
            Ok(match object.get(name) {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_))) => {
                    Some(v.to_string())
                }
                Some(v) => {
                    return Err(LoadError::Malformed {
                        path: p(),
                        line,
                        detail: format!(
                            "field `{name}`: {}, expected text, a number or a boolean",
                            json_kind(v)
                        ),
                    })
                }
            })
        };
        let a = field(&spec.text_a)?;
        let b = spec.text_b.as_deref().map(field).transpose()?.flatten();
        let Some(value) = field(&spec.label)? else {
            return Err(LoadError::Malformed {
                path: p(),
                line,
                detail: format!(
                    "no label: field `{}` is {} (fields: {:?})",
                    spec.label,
                    if object.contains_key(&spec.label) {
                        "null"
                    } else {
                        "absent"
                    },
                    object.keys().collect::<Vec<_>>()
                ),
            });
        };
        rows.row(a.as_deref(), b.as_deref(), &value)
            .map_err(|expected| LoadError::BadLabel {
                path: p(),
                line,
                field: spec.label.clone(),
                value: value.clone(),
                expected,
            })?;
    }
    if !any {
        return Err(LoadError::Empty { path: p() });
    }
    Ok(rows.finish())
}

/// Reads a text column and a label column of a Parquet file ([`load_table`] with a Parquet
/// [`TableSpec`]).
pub fn load_parquet(
    path: &Path,
    text_column: &str,
    label_column: &str,
    labels: &Labels,
) -> Result<LoadedSet, LoadError> {
    let spec = TableSpec::single(
        TableFormat::Parquet,
        text_column,
        label_column,
        labels.clone(),
    );
    load_parquet_table(path, &spec)
}

/// Reads the columns of `spec` from a Parquet file (uncompressed, or compressed with any codec
/// common writers use: Snappy, gzip, Brotli, LZ4, Zstandard). Labels are matched as text (`Int(3)` is `"3"`).
fn load_parquet_table(path: &Path, spec: &TableSpec) -> Result<LoadedSet, LoadError> {
    let p = || path.to_path_buf();
    let pq = |e: parquet::errors::ParquetError| LoadError::Parquet {
        path: p(),
        detail: parquet_detail(&e),
    };
    let file = open_regular(path).map_err(|source| LoadError::Io {
        path: p(),
        error: source,
    })?;
    let reader = SerializedFileReader::new(file).map_err(pq)?;
    let root = reader
        .metadata()
        .file_metadata()
        .schema_descr()
        .root_schema();
    let fields = root.get_fields();
    // A column named twice is refused as in a CSV header (which of the two is meant?).
    let names: Vec<String> = fields.iter().map(|f| f.name().to_string()).collect();
    let pick = |name: &str| column_index(path, &names, name).map(|i| fields[i].clone());
    let mut wanted = vec![pick(&spec.text_a)?, pick(&spec.label)?];
    if let Some(b) = &spec.text_b {
        wanted.push(pick(b)?);
    }
    let projection = Type::group_type_builder(root.name())
        .with_fields(wanted)
        .build()
        .map_err(pq)?;

    let mut rows = Collector::new(spec);
    for (i, row) in reader
        .get_row_iter(Some(projection))
        .map_err(pq)?
        .enumerate()
    {
        let row_no = i as u64 + 1;
        let row = row.map_err(pq)?;
        let (mut a, mut b, mut label) = (None, None, None);
        for (name, field) in row.get_column_iter() {
            let value = field_text(field).map_err(|detail| LoadError::ParquetValue {
                path: p(),
                row: row_no,
                field: name.clone(),
                detail,
            })?;
            if *name == spec.text_a {
                a = value;
            } else if *name == spec.label {
                label = value;
            } else if Some(name) == spec.text_b.as_ref() {
                b = value;
            }
        }
        let value = label.ok_or_else(|| LoadError::ParquetValue {
            path: p(),
            row: row_no,
            field: spec.label.clone(),
            detail: "label is null".to_string(),
        })?;
        rows.row(a.as_deref(), b.as_deref(), &value)
            .map_err(|expected| LoadError::ParquetValue {
                path: p(),
                row: row_no,
                field: spec.label.clone(),
                detail: format!("label {value:?} is not {expected}"),
            })?;
    }
    Ok(rows.finish())
}

/// What went wrong reading a Parquet file, for a person: the `parquet` crate's own message
/// (which for damaged data is as terse as "Unexpected Encoding 7969" or "EOF"), with what that
/// usually means.
pub(crate) fn parquet_detail(e: &parquet::errors::ParquetError) -> String {
    use parquet::errors::ParquetError as E;
    let hint = match e {
        E::NYI(_) => "a Parquet feature this reader does not support",
        _ => "the file is not Parquet, or it is damaged or truncated",
    };
    format!("{e} ({hint})")
}

/// A Parquet value as text; `None` for null.
fn field_text(field: &Field) -> Result<Option<String>, String> {
    Ok(Some(match field {
        Field::Null => return Ok(None),
        Field::Str(s) => s.clone(),
        Field::Bytes(b) => std::str::from_utf8(b.data())
            .map_err(|e| format!("not valid UTF-8 ({e})"))?
            .to_string(),
        Field::Bool(v) => v.to_string(),
        Field::Byte(v) => v.to_string(),
        Field::Short(v) => v.to_string(),
        Field::Int(v) => v.to_string(),
        Field::Long(v) => v.to_string(),
        Field::UByte(v) => v.to_string(),
        Field::UShort(v) => v.to_string(),
        Field::UInt(v) => v.to_string(),
        Field::ULong(v) => v.to_string(),
        Field::Float(v) => v.to_string(),
        Field::Double(v) => v.to_string(),
        other => return Err(format!("unsupported value type ({other})")),
    }))
}

/// Label column of the `reviews` data set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReviewLabel {
    /// `Rating` 1-5 (labels 0-4).
    Rating,
    /// `Recommended IND` 0/1.
    Recommended,
}

/// The `reviews` Parquet: `Review Text` with the chosen label; rows without text are dropped.
pub fn load_reviews(path: &Path, label: ReviewLabel) -> Result<LoadedSet, LoadError> {
    let (column, labels) = match label {
        ReviewLabel::Rating => ("Rating", Labels::names(&["1", "2", "3", "4", "5"])),
        ReviewLabel::Recommended => (
            "Recommended IND",
            Labels::coded(&[("0", "not recommended"), ("1", "recommended")]),
        ),
    };
    load_parquet(path, "Review Text", column, &labels)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn spec() -> TableSpec {
        TableSpec::single(
            TableFormat::Tsv,
            "text",
            "label",
            Labels::names(&["a", "b"]),
        )
    }

    #[test]
    fn a_column_named_twice_in_the_header_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dup.tsv");
        std::fs::write(&path, "text\tlabel\ttext\nhello\ta\tworld\n").unwrap();
        let err = load_table(&path, &spec()).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, LoadError::DuplicateColumn { .. }), "{msg}");
        assert!(
            msg.contains("dup.tsv:1:") && msg.contains("`text`") && msg.contains("1 and 3"),
            "{msg}"
        );
        // A repeated column that is not read is no ambiguity.
        std::fs::write(&path, "text\tlabel\tx\tx\nhello\ta\t1\t2\n").unwrap();
        assert_eq!(load_table(&path, &spec()).unwrap().examples.len(), 1);
    }

    #[test]
    fn a_device_or_a_fifo_is_refused_as_a_data_file() {
        let err = load_table(Path::new("/dev/zero"), &spec()).unwrap_err();
        assert!(matches!(err, LoadError::Io { .. }), "{err}");
        assert!(err.to_string().contains("character device"), "{err}");
        let err = load_parquet(Path::new("/dev/zero"), "t", "l", &Labels::Above(0.0)).unwrap_err();
        assert!(err.to_string().contains("character device"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo.tsv");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path made above.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = load_table(&fifo, &spec()).unwrap_err();
        assert!(err.to_string().contains("FIFO"), "{err}");
    }

    /// A one-column Parquet file of `rows` texts, uncompressed so its pages can be damaged.
    fn parquet_file(path: &Path, rows: usize) {
        use parquet::basic::{ConvertedType, Repetition, Type as PhysicalType};
        use parquet::data_type::{ByteArray, ByteArrayType};
        use parquet::file::properties::WriterProperties;
        use parquet::file::writer::SerializedFileWriter;
        let col = |name: &str| {
            Arc::new(
                Type::primitive_type_builder(name, PhysicalType::BYTE_ARRAY)
                    .with_converted_type(ConvertedType::UTF8)
                    .with_repetition(Repetition::REQUIRED)
                    .build()
                    .unwrap(),
            )
        };
        let schema = Type::group_type_builder("schema")
            .with_fields(vec![col("text"), col("label")])
            .build()
            .unwrap();
        let props = WriterProperties::builder().build();
        let file = std::fs::File::create(path).unwrap();
        let mut writer =
            SerializedFileWriter::new(file, Arc::new(schema), Arc::new(props)).unwrap();
        let mut rg = writer.next_row_group().unwrap();
        for values in [
            (0..rows).map(|i| format!("text {i}")).collect::<Vec<_>>(),
            (0..rows).map(|i| format!("{}", i % 2)).collect(),
        ] {
            let values: Vec<ByteArray> =
                values.iter().map(|v| ByteArray::from(v.as_str())).collect();
            let mut c = rg.next_column().unwrap().unwrap();
            c.typed::<ByteArrayType>()
                .write_batch(&values, None, None)
                .unwrap();
            c.close().unwrap();
        }
        rg.close().unwrap();
        writer.close().unwrap();
    }

    #[test]
    fn a_damaged_parquet_file_is_called_damaged() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.parquet");
        parquet_file(&path, 50);
        let labels = Labels::names(&["0", "1"]);
        assert_eq!(
            load_parquet(&path, "text", "label", &labels)
                .unwrap()
                .examples
                .len(),
            50
        );
        // Overwrite the first column's page header (just after the 4-byte magic).
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[4..40].fill(b'x');
        std::fs::write(&path, &bytes).unwrap();
        let msg = load_parquet(&path, "text", "label", &labels)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("cannot read it as Parquet") && msg.contains("damaged or truncated"),
            "{msg}"
        );
        std::fs::write(&path, "text,label\nnot parquet,1\n").unwrap();
        let msg = load_parquet(&path, "text", "label", &labels)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("the file is not Parquet"), "{msg}");
    }
}
