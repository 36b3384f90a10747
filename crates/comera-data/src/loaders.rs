//! Text-classification data sets as `Example`s: delimited tables (GLUE TSV, CSV) and Parquet.
//!
//! Columns are picked by header name; other columns are ignored. TSV is split on tabs only, with
//! no quoting (as GLUE's files need: a `"` is an ordinary character); CSV follows RFC 4180
//! quoting. Rows whose text is empty are dropped and counted. Errors name the file, the 1-based
//! line (the header is line 1; for Parquet, the 1-based row) and the field.

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

    /// The class names, in label order.
    pub fn label_names(&self) -> Vec<String> {
        match self {
            Labels::Names(names) => names.clone(),
            Labels::Above(t) => vec![format!("<= {t}"), format!("> {t}")],
            Labels::AboveNamed(_, names) => names.to_vec(),
            Labels::Coded { names, .. } => names.clone(),
        }
    }

    /// The label of `value`, or what was expected.
    fn map(&self, value: &str) -> Result<usize, LabelExpected> {
        let value = value.trim();
        match self {
            Labels::Names(names) | Labels::Coded { values: names, .. } => names
                .iter()
                .position(|n| n == value)
                .ok_or_else(|| LabelExpected::OneOf(names.clone())),
            Labels::Above(t) | Labels::AboveNamed(t, _) => match value.parse::<f64>() {
                Ok(v) if !v.is_nan() => Ok(usize::from(v > *t)),
                _ => Err(LabelExpected::Number),
            },
        }
    }
}

/// What a label field should have held (a [`LoadError::BadLabel`] says "label … is not" this).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LabelExpected {
    #[error("one of {0:?}")]
    OneOf(Vec<String>),
    #[error("a number")]
    Number,
}

/// Field separator of a delimited file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delimited {
    /// Tab-separated, no quoting.
    Tsv,
    /// Comma-separated with `"` quoting.
    Csv,
}

/// Which columns of a delimited file with a header row make the examples.
#[derive(Debug, Clone, PartialEq)]
pub struct TableSpec {
    pub format: Delimited,
    pub text_a: String,
    pub text_b: Option<String>,
    pub label: String,
    pub labels: Labels,
}

impl TableSpec {
    /// One text column and a label column.
    pub fn single(format: Delimited, text: &str, label: &str, labels: Labels) -> Self {
        TableSpec {
            format,
            text_a: text.to_string(),
            text_b: None,
            label: label.to_string(),
            labels,
        }
    }

    /// Two text columns and a label column.
    pub fn pair(format: Delimited, a: &str, b: &str, label: &str, labels: Labels) -> Self {
        TableSpec {
            text_b: Some(b.to_string()),
            ..TableSpec::single(format, a, label, labels)
        }
    }

    /// GLUE MNLI TSV: `sentence1`, `sentence2`, `gold_label` in entailment/neutral/contradiction.
    pub fn mnli() -> Self {
        TableSpec::pair(
            Delimited::Tsv,
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
            Delimited::Tsv,
            "text",
            "sentiment",
            Labels::AboveNamed(0.0, names),
        )
    }

    /// The `trec` CSV with its six coarse classes (`label-coarse` 0-5: abbreviation, entity,
    /// description, human, location, numeric — TREC-6's order).
    pub fn trec_coarse() -> Self {
        TableSpec::single(
            Delimited::Csv,
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

/// Reads a delimited file with a header row into examples.
pub fn load_table(path: &Path, spec: &TableSpec) -> Result<LoadedSet, LoadError> {
    let file = open_regular(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        error: source,
    })?;
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .delimiter(match spec.format {
            Delimited::Tsv => b'\t',
            Delimited::Csv => b',',
        })
        .quoting(spec.format == Delimited::Csv)
        .from_reader(std::io::BufReader::new(file));
    let p = || path.to_path_buf();
    let read_err = |e: csv::Error| {
        let line = e.position().map_or(0, |pos| pos.line());
        match e.into_kind() {
            csv::ErrorKind::Io(source) => LoadError::Io {
                path: p(),
                error: source,
            },
            other => LoadError::Malformed {
                path: p(),
                line,
                detail: format!("{other:?}"),
            },
        }
    };

    let mut record = csv::ByteRecord::new();
    if !reader.read_byte_record(&mut record).map_err(read_err)? {
        return Err(LoadError::Empty { path: p() });
    }
    let header_line = record.position().map_or(1, |pos| pos.line());
    let mut header = Vec::with_capacity(record.len());
    for (i, field) in record.iter().enumerate() {
        let name = std::str::from_utf8(field).map_err(|e| LoadError::NotUtf8 {
            path: p(),
            line: header_line,
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
    let column = |name: &str| {
        let mut found = header.iter().enumerate().filter(|(_, h)| *h == name);
        match (found.next(), found.next()) {
            (Some((i, _)), None) => Ok(i),
            (Some((first, _)), Some((second, _))) => Err(LoadError::DuplicateColumn {
                path: p(),
                column: name.to_string(),
                first: first + 1,
                second: second + 1,
            }),
            (None, _) => Err(LoadError::MissingColumn {
                path: p(),
                column: name.to_string(),
                header: header.clone(),
            }),
        }
    };
    let col_a = column(&spec.text_a)?;
    let col_b = spec.text_b.as_deref().map(column).transpose()?;
    let col_label = column(&spec.label)?;

    let mut out = LoadedSet {
        examples: Vec::new(),
        label_names: spec.labels.label_names(),
        dropped: 0,
    };
    while reader.read_byte_record(&mut record).map_err(read_err)? {
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
        let label = spec
            .labels
            .map(value)
            .map_err(|expected| LoadError::BadLabel {
                path: p(),
                line,
                field: spec.label.clone(),
                value: value.to_string(),
                expected,
            })?;
        if a.trim().is_empty() || b.is_some_and(|b| b.trim().is_empty()) {
            out.dropped += 1;
            continue;
        }
        out.examples.push(Example {
            text_a: a.to_string(),
            text_b: b.map(str::to_string),
            label,
        });
    }
    Ok(out)
}

/// Reads a text column and a label column of a Parquet file (any compression the `parquet`
/// crate was built with, here brotli). Labels are matched as text (`Int(3)` is `"3"`).
pub fn load_parquet(
    path: &Path,
    text_column: &str,
    label_column: &str,
    labels: &Labels,
) -> Result<LoadedSet, LoadError> {
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
    let pick = |name: &str| {
        fields
            .iter()
            .find(|f| f.name() == name)
            .cloned()
            .ok_or_else(|| LoadError::MissingColumn {
                path: p(),
                column: name.to_string(),
                header: fields.iter().map(|f| f.name().to_string()).collect(),
            })
    };
    let projection = Type::group_type_builder(root.name())
        .with_fields(vec![pick(text_column)?, pick(label_column)?])
        .build()
        .map_err(pq)?;

    let mut out = LoadedSet {
        examples: Vec::new(),
        label_names: labels.label_names(),
        dropped: 0,
    };
    let rows = reader.get_row_iter(Some(projection)).map_err(pq)?;
    for (i, row) in rows.enumerate() {
        let row_no = i as u64 + 1;
        let row = row.map_err(pq)?;
        let (mut text, mut label) = (None, None);
        for (name, field) in row.get_column_iter() {
            let value = field_text(field).map_err(|detail| LoadError::ParquetValue {
                path: p(),
                row: row_no,
                field: name.clone(),
                detail,
            })?;
            if name == text_column {
                text = value;
            } else if name == label_column {
                label = value;
            }
        }
        let label_value = label.ok_or_else(|| LoadError::ParquetValue {
            path: p(),
            row: row_no,
            field: label_column.to_string(),
            detail: "label is null".to_string(),
        })?;
        let label = labels
            .map(&label_value)
            .map_err(|expected| LoadError::ParquetValue {
                path: p(),
                row: row_no,
                field: label_column.to_string(),
                detail: format!("label {label_value:?} is not {expected}"),
            })?;
        match text {
            Some(t) if !t.trim().is_empty() => out.examples.push(Example {
                text_a: t,
                text_b: None,
                label,
            }),
            _ => out.dropped += 1,
        }
    }
    Ok(out)
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
        TableSpec::single(Delimited::Tsv, "text", "label", Labels::names(&["a", "b"]))
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
