//! Click-through-rate (CTR) data for DLRM-style models: dense features, one categorical id per
//! field, a 0/1 label.
//!
//! - [`CriteoReader`]: a streaming reader of the Criteo TSV format (label, 13 integer, 26
//!   hexadecimal categorical fields; any field may be empty). Integers become
//!   `ln(1 + max(v, 0))` (missing = 0); categorical values are hashed ([`CatMapping::Hash`]) or
//!   taken modulo ([`CatMapping::Modulo`]) into each field's table size.
//! - [`load_movielens`]: MovieLens-100K from recbole's typed-TSV `.inter`/`.user`/`.item` files
//!   as a CTR task (click = rating ≥ threshold; fields user, item, age, gender, occupation,
//!   genres; dense features ln(1 + age) and the release year).
//! - [`load_adult`]: the Adult census Parquet as a CTR task (label income > 50K; string columns
//!   categorical, numeric columns dense).
//! - [`SynthCriteo`]: a seeded generator of Criteo-format rows with Zipf-distributed
//!   categorical ids over configurable table sizes (tens of millions of rows are fine: nothing
//!   per row of a table is stored), written as TSV or produced straight into batches.
//!
//! Malformed rows (wrong field count, bad label, non-numeric integers, bad hex, unknown ids)
//! are never silently dropped: each is counted with its 1-based line number, the first few
//! are kept for the report ([`Malformed`]), and once more than the configured limit are seen
//! the read stops with an error naming the file, the line and the reason.

use crate::regular::open_regular;
use rand::{Rng as _, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

/// Integer fields of a Criteo row.
pub const CRITEO_DENSE: usize = 13;
/// Categorical fields of a Criteo row.
pub const CRITEO_CATS: usize = 26;
/// Fields of a Criteo row (label + 13 + 26).
pub const CRITEO_FIELDS: usize = 1 + CRITEO_DENSE + CRITEO_CATS;
/// Malformed rows whose line and reason are kept for the report.
const KEEP_MALFORMED: usize = 10;

/// Errors of the CTR readers; every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum CtrError {
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}:{line}: {detail}")]
    Format {
        path: PathBuf,
        line: u64,
        detail: String,
    },
    #[error("{path}: more than {limit} malformed rows (the limit); the last at line {line}: {reason}{}", first_lines(.first))]
    TooManyMalformed {
        path: PathBuf,
        limit: u64,
        line: u64,
        reason: String,
        first: Vec<(u64, String)>,
    },
    #[error("{path}: cannot read it as Parquet: {detail}")]
    Parquet { path: PathBuf, detail: String },
    #[error("invalid CTR setting `{field}`: {detail}")]
    Config { field: String, detail: String },
}

fn first_lines(first: &[(u64, String)]) -> String {
    let mut s = String::new();
    if !first.is_empty() {
        s.push_str("; first malformed lines: ");
        for (i, (line, reason)) in first.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            let _ = write!(s, "{line} ({reason})");
        }
    }
    s
}

/// Counts malformed rows and keeps the first few; errors once more than `limit` are seen.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Malformed {
    pub path: PathBuf,
    pub limit: u64,
    pub count: u64,
    /// (1-based line, reason) of the first malformed rows.
    pub first: Vec<(u64, String)>,
}

impl Malformed {
    pub fn new(path: &Path, limit: u64) -> Malformed {
        Malformed {
            path: path.to_path_buf(),
            limit,
            count: 0,
            first: Vec::new(),
        }
    }

    /// Records a malformed row; `Err` when the count exceeds the limit.
    pub fn record(&mut self, line: u64, reason: String) -> Result<(), CtrError> {
        self.count += 1;
        if self.count > self.limit {
            return Err(CtrError::TooManyMalformed {
                path: self.path.clone(),
                limit: self.limit,
                line,
                reason,
                first: self.first.clone(),
            });
        }
        if self.first.len() < KEEP_MALFORMED {
            self.first.push((line, reason));
        }
        Ok(())
    }

    /// One line for the run's report: `none`, or the count with the first line numbers.
    pub fn summary(&self) -> String {
        if self.count == 0 {
            return format!("{}: no malformed rows", self.path.display());
        }
        format!(
            "{}: {} malformed rows skipped (limit {}){}",
            self.path.display(),
            self.count,
            self.limit,
            first_lines(&self.first)
        )
    }
}

/// A CTR data set in memory.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CtrData {
    pub dense_names: Vec<String>,
    pub field_names: Vec<String>,
    /// Rows of each field's embedding table (every id of field f is below `table_sizes[f]`).
    pub table_sizes: Vec<usize>,
    /// Examples × dense features, row-major.
    pub dense: Vec<f32>,
    /// Examples × fields, row-major.
    pub cats: Vec<u32>,
    /// 0 or 1 per example.
    pub labels: Vec<f32>,
}

impl CtrData {
    /// An empty set with this schema.
    pub fn empty(
        dense_names: Vec<String>,
        field_names: Vec<String>,
        table_sizes: Vec<usize>,
    ) -> Self {
        CtrData {
            dense_names,
            field_names,
            table_sizes,
            ..CtrData::default()
        }
    }

    pub fn len(&self) -> usize {
        self.labels.len()
    }
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
    pub fn n_dense(&self) -> usize {
        self.dense_names.len()
    }
    pub fn n_fields(&self) -> usize {
        self.field_names.len()
    }

    /// Share of positive labels.
    /// (0 for no examples; an empty f64 sum is −0.0, which would print as "-0.000").
    pub fn positive_rate(&self) -> f64 {
        let positives = self.labels.iter().filter(|&&l| l > 0.5).count();
        positives as f64 / self.len().max(1) as f64
    }

    /// The examples at `indices`, in that order.
    pub fn subset(&self, indices: &[usize]) -> CtrData {
        let (nd, nf) = (self.n_dense(), self.n_fields());
        let mut out = CtrData::empty(
            self.dense_names.clone(),
            self.field_names.clone(),
            self.table_sizes.clone(),
        );
        for &i in indices {
            out.dense
                .extend_from_slice(&self.dense[i * nd..(i + 1) * nd]);
            out.cats.extend_from_slice(&self.cats[i * nf..(i + 1) * nf]);
            out.labels.push(self.labels[i]);
        }
        out
    }

    /// A seeded shuffle split into (train, valid) with `valid_fraction` of the examples held
    /// out (at least one each when there are two or more examples).
    pub fn split(&self, valid_fraction: f64, seed: u64) -> (CtrData, CtrData) {
        let n = self.len();
        let mut idx: Vec<usize> = (0..n).collect();
        shuffle(&mut idx, seed);
        let mut nv = (n as f64 * valid_fraction).round() as usize;
        if n >= 2 {
            nv = nv.clamp(1, n - 1);
        }
        let (v, t) = idx.split_at(nv);
        (self.subset(t), self.subset(v))
    }
}

/// Fisher-Yates with ChaCha8 (the same permutation for a seed on every machine).
pub fn shuffle(idx: &mut [usize], seed: u64) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    for i in (1..idx.len()).rev() {
        let j = rng.random_range(0..=i);
        idx.swap(i, j);
    }
}

/// One fixed-size batch: dense features row-major (batch × n_dense), ids field-major
/// (n_fields × batch, so each table sees one contiguous id list), labels.
#[derive(Clone, Debug, PartialEq)]
pub struct CtrBatch {
    pub batch: usize,
    pub n_dense: usize,
    pub n_fields: usize,
    pub dense: Vec<f32>,
    pub cats: Vec<u32>,
    pub labels: Vec<f32>,
}

impl CtrBatch {
    pub fn new(batch: usize, n_dense: usize, n_fields: usize) -> CtrBatch {
        CtrBatch {
            batch,
            n_dense,
            n_fields,
            dense: vec![0.0; batch * n_dense],
            cats: vec![0; batch * n_fields],
            labels: vec![0.0; batch],
        }
    }

    /// The ids of field `f` (batch long).
    pub fn field(&self, f: usize) -> &[u32] {
        &self.cats[f * self.batch..(f + 1) * self.batch]
    }

    /// Writes example `i` of `data` into slot `j`.
    pub fn set_from(&mut self, j: usize, data: &CtrData, i: usize) {
        let (nd, nf, b) = (self.n_dense, self.n_fields, self.batch);
        self.dense[j * nd..(j + 1) * nd].copy_from_slice(&data.dense[i * nd..(i + 1) * nd]);
        for f in 0..nf {
            self.cats[f * b + j] = data.cats[i * nf + f];
        }
        self.labels[j] = data.labels[i];
    }

    /// Writes one example (dense row, ids in field order, label) into slot `j`.
    pub fn set_row(&mut self, j: usize, dense: &[f32], cats: &[u32], label: f32) {
        let (nd, b) = (self.n_dense, self.batch);
        self.dense[j * nd..(j + 1) * nd].copy_from_slice(dense);
        for (f, &c) in cats.iter().enumerate() {
            self.cats[f * b + j] = c;
        }
        self.labels[j] = label;
    }
}

/// How a categorical value becomes a row of its field's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CatMapping {
    /// A seeded 64-bit hash of (field, value) modulo the table size; a missing value hashes
    /// like its own value.
    Hash,
    /// The hexadecimal value modulo the table size (what DLRM's Criteo preprocessing does);
    /// a missing value is id 0.
    Modulo,
}

/// A categorical mapping name that [`CatMapping`] does not know.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not `hash` or `modulo`")]
pub struct UnknownMapping(pub String);

impl std::str::FromStr for CatMapping {
    type Err = UnknownMapping;
    fn from_str(s: &str) -> Result<Self, UnknownMapping> {
        match s {
            "hash" => Ok(CatMapping::Hash),
            "modulo" => Ok(CatMapping::Modulo),
            _ => Err(UnknownMapping(s.to_string())),
        }
    }
}

/// splitmix64: a fast, well-mixed, portable 64-bit hash step.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Sentinel hashed for a missing categorical value (not a valid 64-bit hex value's hash input
/// collision in practice: it is mixed with a different salt).
const MISSING_SALT: u64 = 0x6d69_7373_696e_6721;

/// How Criteo rows become features.
#[derive(Clone, Debug, PartialEq)]
pub struct CriteoSpec {
    /// Rows of each of the 26 tables.
    pub table_sizes: Vec<usize>,
    pub mapping: CatMapping,
    /// Malformed rows tolerated before the read stops.
    pub max_malformed: u64,
}

impl CriteoSpec {
    pub fn validate(&self) -> Result<(), CtrError> {
        if self.table_sizes.len() != CRITEO_CATS {
            return Err(CtrError::Config {
                field: "table_sizes".into(),
                detail: format!(
                    "Criteo has {CRITEO_CATS} categorical fields, got {} table sizes",
                    self.table_sizes.len()
                ),
            });
        }
        if let Some(f) = self.table_sizes.iter().position(|&s| s == 0) {
            return Err(CtrError::Config {
                field: "table_sizes".into(),
                detail: format!("table {f} has 0 rows"),
            });
        }
        if let Some(f) = self.table_sizes.iter().position(|&s| s > u32::MAX as usize) {
            return Err(CtrError::Config {
                field: "table_sizes".into(),
                detail: format!("table {f} has more than 2^32 rows"),
            });
        }
        Ok(())
    }

    /// The table row of categorical field `f` with value `v` (None = missing).
    #[inline]
    pub fn map(&self, f: usize, v: Option<u64>) -> u32 {
        let size = self.table_sizes[f] as u64;
        match (self.mapping, v) {
            (CatMapping::Modulo, Some(v)) => (v % size) as u32,
            (CatMapping::Modulo, None) => 0,
            (CatMapping::Hash, Some(v)) => (mix64(v ^ mix64(f as u64 + 1)) % size) as u32,
            (CatMapping::Hash, None) => (mix64(MISSING_SALT ^ mix64(f as u64 + 1)) % size) as u32,
        }
    }

    /// Names of the 13 dense and 26 categorical fields (`I1..I13`, `C1..C26`).
    pub fn names() -> (Vec<String>, Vec<String>) {
        (
            (1..=CRITEO_DENSE).map(|i| format!("I{i}")).collect(),
            (1..=CRITEO_CATS).map(|i| format!("C{i}")).collect(),
        )
    }
}

/// ln(1 + max(v, 0)), the DLRM transform of Criteo's count features.
#[inline]
pub fn log_transform(v: i64) -> f32 {
    (v.max(0) as f64).ln_1p() as f32
}

/// Why a Criteo line is malformed (values shown clipped to 24 characters).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MalformedRow {
    #[error("empty line")]
    Empty,
    #[error("label `{0}` is not 0 or 1")]
    Label(String),
    /// Dense field `I{field}` (1-based).
    #[error("field I{field}: `{value}` is not an integer")]
    NotInteger { field: usize, value: String },
    /// Categorical field `C{field}` (1-based).
    #[error("field C{field}: `{value}` is longer than 16 hex digits")]
    TooLong { field: usize, value: String },
    #[error("field C{field}: `{value}` is not hexadecimal")]
    NotHex { field: usize, value: String },
    #[error("expected {CRITEO_FIELDS} tab-separated fields, found {found}")]
    FieldCount { found: usize },
}

/// Parses one Criteo line into (label, dense, ids); `Err(reason)` for a malformed row.
pub fn parse_criteo_line(
    line: &str,
    spec: &CriteoSpec,
    dense: &mut [f32],
    cats: &mut [u32],
) -> Result<f32, MalformedRow> {
    let line = line.strip_suffix('\n').unwrap_or(line);
    let line = line.strip_suffix('\r').unwrap_or(line);
    let mut it = line.split('\t');
    let mut n = 0;
    let label = match it.next() {
        Some("0") => 0.0,
        Some("1") => 1.0,
        Some(other) => return Err(MalformedRow::Label(clip(other))),
        None => return Err(MalformedRow::Empty),
    };
    n += 1;
    for (i, d) in dense.iter_mut().enumerate() {
        let Some(s) = it.next() else {
            return Err(field_count(n));
        };
        n += 1;
        *d = if s.is_empty() {
            0.0
        } else {
            match s.parse::<i64>() {
                Ok(v) => log_transform(v),
                Err(_) => {
                    return Err(MalformedRow::NotInteger {
                        field: i + 1,
                        value: clip(s),
                    })
                }
            }
        };
    }
    for (f, c) in cats.iter_mut().enumerate() {
        let Some(s) = it.next() else {
            return Err(field_count(n));
        };
        n += 1;
        let v = if s.is_empty() {
            None
        } else if s.len() > 16 {
            return Err(MalformedRow::TooLong {
                field: f + 1,
                value: clip(s),
            });
        } else {
            match u64::from_str_radix(s, 16) {
                Ok(v) if !s.starts_with('+') => Some(v),
                _ => {
                    return Err(MalformedRow::NotHex {
                        field: f + 1,
                        value: clip(s),
                    })
                }
            }
        };
        *c = spec.map(f, v);
    }
    let extra = count_rest(it);
    if extra > 0 {
        return Err(field_count(n + extra));
    }
    Ok(label)
}

fn count_rest<'a>(it: impl Iterator<Item = &'a str>) -> usize {
    it.count()
}

fn field_count(found: usize) -> MalformedRow {
    MalformedRow::FieldCount { found }
}

fn clip(s: &str) -> String {
    if s.chars().count() > 24 {
        format!("{}…", s.chars().take(24).collect::<String>())
    } else {
        s.to_string()
    }
}

/// Streams Criteo rows from a file, skipping (and counting) malformed rows.
pub struct CriteoReader<R: BufRead> {
    reader: R,
    spec: CriteoSpec,
    line_no: u64,
    line: String,
    pub malformed: Malformed,
    /// Well-formed rows returned so far.
    pub rows: u64,
}

impl CriteoReader<BufReader<File>> {
    /// Opens a Criteo TSV file.
    pub fn open(path: &Path, spec: CriteoSpec) -> Result<Self, CtrError> {
        spec.validate()?;
        let f = open_regular(path).map_err(|source| CtrError::Io {
            path: path.to_path_buf(),
            error: source,
        })?;
        Ok(CriteoReader::new(
            BufReader::with_capacity(1 << 20, f),
            path,
            spec,
        ))
    }
}

impl<R: BufRead> CriteoReader<R> {
    /// Reads from any buffered source; `path` names it in messages.
    pub fn new(reader: R, path: &Path, spec: CriteoSpec) -> Self {
        let limit = spec.max_malformed;
        CriteoReader {
            reader,
            spec,
            line_no: 0,
            line: String::with_capacity(1024),
            malformed: Malformed::new(path, limit),
            rows: 0,
        }
    }

    pub fn spec(&self) -> &CriteoSpec {
        &self.spec
    }

    /// The next well-formed row into `dense` (13) and `cats` (26); `None` at the end.
    pub fn next_row(
        &mut self,
        dense: &mut [f32],
        cats: &mut [u32],
    ) -> Result<Option<f32>, CtrError> {
        loop {
            self.line.clear();
            let n = self
                .reader
                .read_line(&mut self.line)
                .map_err(|e| CtrError::Io {
                    path: self.malformed.path.clone(),
                    error: std::io::Error::new(e.kind(), format!("line {}: {e}", self.line_no + 1)),
                })?;
            if n == 0 {
                return Ok(None);
            }
            self.line_no += 1;
            match parse_criteo_line(&self.line, &self.spec, dense, cats) {
                Ok(label) => {
                    self.rows += 1;
                    return Ok(Some(label));
                }
                Err(reason) => self.malformed.record(self.line_no, reason.to_string())?,
            }
        }
    }

    /// Fills a whole batch; `false` (batch contents unspecified) when the file ends first.
    pub fn read_batch(&mut self, batch: &mut CtrBatch) -> Result<bool, CtrError> {
        let mut dense = [0.0f32; CRITEO_DENSE];
        let mut cats = [0u32; CRITEO_CATS];
        for j in 0..batch.batch {
            match self.next_row(&mut dense, &mut cats)? {
                Some(label) => batch.set_row(j, &dense, &cats, label),
                None => return Ok(false),
            }
        }
        Ok(true)
    }

    /// Reads up to `max_rows` rows (0 = all) into memory.
    pub fn read_all(&mut self, max_rows: usize) -> Result<CtrData, CtrError> {
        let (dn, cn) = CriteoSpec::names();
        let mut out = CtrData::empty(dn, cn, self.spec.table_sizes.clone());
        let mut dense = [0.0f32; CRITEO_DENSE];
        let mut cats = [0u32; CRITEO_CATS];
        while max_rows == 0 || out.len() < max_rows {
            match self.next_row(&mut dense, &mut cats)? {
                Some(label) => {
                    out.dense.extend_from_slice(&dense);
                    out.cats.extend_from_slice(&cats);
                    out.labels.push(label);
                }
                None => break,
            }
        }
        Ok(out)
    }
}

/// Zipf(s) over 1..=n by rejection-inversion (Hörmann & Derflinger 1996): O(1) per sample and
/// O(1) memory for any n.
#[derive(Clone, Copy, Debug)]
pub struct Zipf {
    n: f64,
    s: f64,
    h_x1: f64,
    h_n: f64,
    cut: f64,
}

impl Zipf {
    /// `n ≥ 1`, `s > 0`.
    pub fn new(n: u64, s: f64) -> Zipf {
        assert!(
            n >= 1 && s > 0.0 && s.is_finite(),
            "Zipf needs n ≥ 1, s > 0"
        );
        let mut z = Zipf {
            n: n as f64,
            s,
            h_x1: 0.0,
            h_n: 0.0,
            cut: 0.0,
        };
        z.h_x1 = z.h_int(1.5) - 1.0;
        z.h_n = z.h_int(z.n + 0.5);
        z.cut = 2.0 - z.h_int_inv(z.h_int(2.5) - z.h(2.0));
        z
    }

    fn h(&self, x: f64) -> f64 {
        (-self.s * x.ln()).exp()
    }

    /// ∫ x^-s, shifted so it is well defined at s = 1.
    fn h_int(&self, x: f64) -> f64 {
        let lx = x.ln();
        helper2((1.0 - self.s) * lx) * lx
    }

    fn h_int_inv(&self, x: f64) -> f64 {
        let t = (x * (1.0 - self.s)).max(-1.0);
        (helper1(t) * x).exp()
    }

    /// A sample in 1..=n.
    pub fn sample(&self, rng: &mut impl rand::Rng) -> u64 {
        loop {
            let u = self.h_n + rng.random::<f64>() * (self.h_x1 - self.h_n);
            let x = self.h_int_inv(u);
            let k = (x + 0.5).floor().clamp(1.0, self.n);
            if k - x <= self.cut || u >= self.h_int(k + 0.5) - self.h(k) {
                return k as u64;
            }
        }
    }
}

/// ln(1 + x) / x, stable near 0.
fn helper1(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.ln_1p() / x
    } else {
        1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x))
    }
}

/// (exp(x) − 1) / x, stable near 0.
fn helper2(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.exp_m1() / x
    } else {
        1.0 + x * 0.5 * (1.0 + x / 3.0 * (1.0 + 0.25 * x))
    }
}

/// Synthetic Criteo-format data: Zipf ids over the given table sizes, count-like integers, and
/// labels drawn from a hidden logistic model (per-id effects from a hash, a few dense weights)
/// so that a model can learn something measurable.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthSpec {
    /// Rows of each of the 26 tables.
    pub table_sizes: Vec<usize>,
    /// Zipf exponent of the ids (1.05-1.2 is Criteo-like).
    pub zipf_s: f64,
    /// Probability that an integer / categorical field is empty.
    pub missing: f64,
    pub seed: u64,
}

impl SynthSpec {
    /// 26 tables summing to `total_rows`, sized like Criteo's (a few huge, many small): table
    /// f gets a share proportional to 2^(−f/2.5), at least 4 rows.
    pub fn criteo_like_sizes(total_rows: usize) -> Vec<usize> {
        let w: Vec<f64> = (0..CRITEO_CATS)
            .map(|f| (-(f as f64) / 2.5).exp2())
            .collect();
        let sum: f64 = w.iter().sum();
        let mut sizes: Vec<usize> = w
            .iter()
            .map(|x| ((x / sum) * total_rows as f64).floor().max(4.0) as usize)
            .collect();
        let have: usize = sizes.iter().sum();
        if have < total_rows {
            sizes[0] += total_rows - have;
        }
        sizes
    }
}

/// Produces synthetic rows (deterministic for a seed).
pub struct SynthCriteo {
    spec: SynthSpec,
    rng: ChaCha8Rng,
    zipf: Vec<Zipf>,
    salt: u64,
}

/// One raw Criteo row before mapping (what a file line holds).
#[derive(Clone, Debug, Default)]
pub struct RawRow {
    pub label: bool,
    pub ints: [Option<i64>; CRITEO_DENSE],
    pub cats: [Option<u64>; CRITEO_CATS],
}

impl SynthCriteo {
    /// Stream 0 of the data set `spec` describes.
    pub fn new(spec: SynthSpec) -> Result<SynthCriteo, CtrError> {
        Self::with_stream(spec, 0)
    }

    /// Another stream of rows from the same hidden label model (e.g. one per epoch, or a
    /// validation stream): the same `spec.seed` means the same model, `stream` picks the rows.
    pub fn with_stream(spec: SynthSpec, stream: u64) -> Result<SynthCriteo, CtrError> {
        let cfg = |detail: String| CtrError::Config {
            field: "synthetic".into(),
            detail,
        };
        if spec.table_sizes.len() != CRITEO_CATS {
            return Err(cfg(format!(
                "needs {CRITEO_CATS} table sizes, got {}",
                spec.table_sizes.len()
            )));
        }
        if spec
            .table_sizes
            .iter()
            .any(|&s| s == 0 || s > u32::MAX as usize)
        {
            return Err(cfg("table sizes must be in 1..2^32".into()));
        }
        if !(spec.zipf_s > 0.0 && spec.zipf_s.is_finite()) {
            return Err(cfg(format!("zipf_s must be > 0, got {}", spec.zipf_s)));
        }
        if !(0.0..1.0).contains(&spec.missing) {
            return Err(cfg(format!(
                "missing must be in [0, 1), got {}",
                spec.missing
            )));
        }
        let zipf = spec
            .table_sizes
            .iter()
            .map(|&n| Zipf::new(n as u64, spec.zipf_s))
            .collect();
        Ok(SynthCriteo {
            rng: ChaCha8Rng::seed_from_u64(if stream == 0 {
                spec.seed
            } else {
                spec.seed ^ mix64(stream)
            }),
            salt: mix64(spec.seed ^ 0x5eed),
            spec,
            zipf,
        })
    }

    /// The per-id effect of the hidden label model: in [−a, a] with a larger for early fields.
    fn effect(&self, f: usize, id: u64) -> f64 {
        let h = mix64(id ^ mix64(self.salt.wrapping_add(f as u64)));
        let u = (h >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
        let a = if f < 8 { 1.2 } else { 0.3 };
        a * u
    }

    /// The next raw row.
    pub fn next_raw(&mut self, row: &mut RawRow) {
        let mut logit = -1.6;
        for (i, v) in row.ints.iter_mut().enumerate() {
            if self.rng.random::<f64>() < self.spec.missing {
                *v = None;
                continue;
            }
            // Geometric-ish counts with a heavy tail: floor(exp(U·scale)) − 1.
            let scale = 2.0 + (i % 5) as f64;
            let x = ((self.rng.random::<f64>() * scale).exp() - 1.0).floor() as i64;
            *v = Some(x);
            if i < 3 {
                logit += 0.25 * (log_transform(x) as f64 - scale / 2.0);
            }
        }
        for f in 0..CRITEO_CATS {
            let id = self.zipf[f].sample(&mut self.rng) - 1;
            logit += self.effect(f, id);
            row.cats[f] = if self.rng.random::<f64>() < self.spec.missing {
                None
            } else {
                Some(id)
            };
        }
        let p = 1.0 / (1.0 + (-logit).exp());
        row.label = self.rng.random::<f64>() < p;
    }

    /// Writes `rows` rows as Criteo TSV (ids as 8 hex digits, so `modulo` mapping with the
    /// same table sizes gives back the generated ids).
    pub fn write_tsv(&mut self, out: &mut impl Write, rows: u64) -> std::io::Result<()> {
        let mut row = RawRow::default();
        let mut line = String::with_capacity(512);
        for _ in 0..rows {
            self.next_raw(&mut row);
            line.clear();
            line.push(if row.label { '1' } else { '0' });
            for v in &row.ints {
                line.push('\t');
                if let Some(v) = v {
                    let _ = write!(line, "{v}");
                }
            }
            for v in &row.cats {
                line.push('\t');
                if let Some(v) = v {
                    let _ = write!(line, "{v:08x}");
                }
            }
            line.push('\n');
            out.write_all(line.as_bytes())?;
        }
        Ok(())
    }

    /// Fills a batch directly, exactly as writing the rows and reading them back with `spec`
    /// would.
    pub fn fill_batch(&mut self, spec: &CriteoSpec, batch: &mut CtrBatch) {
        let mut row = RawRow::default();
        let mut dense = [0.0f32; CRITEO_DENSE];
        let mut cats = [0u32; CRITEO_CATS];
        for j in 0..batch.batch {
            self.next_raw(&mut row);
            for (d, v) in dense.iter_mut().zip(&row.ints) {
                *d = v.map_or(0.0, log_transform);
            }
            for (f, (c, v)) in cats.iter_mut().zip(&row.cats).enumerate() {
                *c = spec.map(f, *v);
            }
            batch.set_row(j, &dense, &cats, row.label as u8 as f32);
        }
    }

    /// `n` rows in memory.
    pub fn generate(&mut self, spec: &CriteoSpec, n: usize) -> CtrData {
        let (dn, cn) = CriteoSpec::names();
        let mut out = CtrData::empty(dn, cn, spec.table_sizes.clone());
        let mut b = CtrBatch::new(1, CRITEO_DENSE, CRITEO_CATS);
        for _ in 0..n {
            self.fill_batch(spec, &mut b);
            out.dense.extend_from_slice(&b.dense);
            out.cats.extend_from_slice(&b.cats);
            out.labels.push(b.labels[0]);
        }
        out
    }
}

/// A recbole typed-TSV file: header `name:type` columns, tab-separated rows.
struct TypedTsv {
    path: PathBuf,
    columns: Vec<String>,
    /// (1-based line, fields) of every non-empty data row.
    rows: Vec<(u64, Vec<String>)>,
}

impl TypedTsv {
    fn read(path: &Path) -> Result<TypedTsv, CtrError> {
        let io = |source| CtrError::Io {
            path: path.to_path_buf(),
            error: source,
        };
        let f = open_regular(path).map_err(io)?;
        let mut lines = BufReader::new(f).lines();
        let header = match lines.next() {
            Some(h) => h.map_err(io)?,
            None => {
                return Err(CtrError::Format {
                    path: path.to_path_buf(),
                    line: 1,
                    detail: "empty file, expected a `name:type` header".into(),
                })
            }
        };
        let columns = header
            .trim_end_matches('\r')
            .split('\t')
            .map(|c| c.split(':').next().unwrap_or("").to_string())
            .collect();
        let mut rows = Vec::new();
        for (i, l) in lines.enumerate() {
            let l = l.map_err(io)?;
            let l = l.trim_end_matches('\r');
            if l.is_empty() {
                continue;
            }
            rows.push((i as u64 + 2, l.split('\t').map(str::to_string).collect()));
        }
        Ok(TypedTsv {
            path: path.to_path_buf(),
            columns,
            rows,
        })
    }

    /// The index of the column `name`; a missing or repeated column is an error.
    fn col(&self, name: &str) -> Result<usize, CtrError> {
        let header_error = |detail: String| CtrError::Format {
            path: self.path.clone(),
            line: 1,
            detail,
        };
        let mut found = self.columns.iter().enumerate().filter(|(_, c)| *c == name);
        match (found.next(), found.next()) {
            (Some((i, _)), None) => Ok(i),
            (Some((first, _)), Some((second, _))) => Err(header_error(format!(
                "column `{name}` appears twice in the header (columns {} and {}); rename one so that it is clear which to read",
                first + 1,
                second + 1
            ))),
            (None, _) => Err(header_error(format!(
                "header has no column `{name}` (columns: {:?})",
                self.columns
            ))),
        }
    }
}

/// Token → index in order of first appearance (deterministic).
#[derive(Default)]
struct Vocab {
    map: HashMap<String, u32>,
}

impl Vocab {
    fn id(&mut self, token: &str) -> u32 {
        let n = self.map.len() as u32;
        *self.map.entry(token.to_string()).or_insert(n)
    }
    fn len(&self) -> usize {
        self.map.len().max(1)
    }
}

/// MovieLens-100K's users and items as CTR features (from recbole's `ml-100k.user` and
/// `ml-100k.item`): categorical fields user, item, age, gender, occupation, genres (the item's
/// whole genre list as one token), dense features ln(1 + age) and (release year − 1900)/100 (0
/// when unknown). Ids are given in order of first appearance in those two files, so a model
/// trained on [`load_movielens`] reads the same ids here ([`MovieLensFeatures::rows`]).
pub struct MovieLensFeatures {
    /// user token → (user id, age id, gender id, occupation id, ln(1 + age))
    users: HashMap<String, (u32, u32, u32, u32, f32)>,
    /// item token → (item id, genres id, scaled release year)
    items: HashMap<String, (u32, u32, f32)>,
    user_file: PathBuf,
    item_file: PathBuf,
    /// Rows of each categorical field.
    pub table_sizes: Vec<usize>,
}

impl MovieLensFeatures {
    /// Dense feature names.
    pub const DENSE: [&'static str; 2] = ["log_age", "release_year"];
    /// Categorical field names.
    pub const FIELDS: [&'static str; 6] = ["user", "item", "age", "gender", "occupation", "genres"];

    /// Reads the user and item files (rows that do not parse are malformed, up to
    /// `max_malformed` each).
    pub fn read(user: &Path, item: &Path, max_malformed: u64) -> Result<Self, CtrError> {
        let users = TypedTsv::read(user)?;
        let items = TypedTsv::read(item)?;
        let (u_id, u_age, u_gender, u_occ) = (
            users.col("user_id")?,
            users.col("age")?,
            users.col("gender")?,
            users.col("occupation")?,
        );
        let (i_id, i_year, i_class) = (
            items.col("item_id")?,
            items.col("release_year")?,
            items.col("class")?,
        );
        let [mut v_user, mut v_item, mut v_age, mut v_gender, mut v_occ, mut v_genre] =
            std::array::from_fn(|_| Vocab::default());
        let mut user_rows = HashMap::new();
        let mut bad_users = Malformed::new(user, max_malformed);
        let need = u_id.max(u_age).max(u_gender).max(u_occ) + 1;
        for (line, r) in &users.rows {
            if r.len() < need {
                bad_users.record(
                    *line,
                    format!("expected {} fields, found {}", users.columns.len(), r.len()),
                )?;
                continue;
            }
            let age: f32 = match r[u_age].trim().parse::<f32>() {
                Ok(a) if a >= 0.0 => a,
                _ => {
                    bad_users.record(
                        *line,
                        format!("age `{}` is not a non-negative number", clip(&r[u_age])),
                    )?;
                    continue;
                }
            };
            let rec = (
                v_user.id(&r[u_id]),
                v_age.id(&r[u_age]),
                v_gender.id(&r[u_gender]),
                v_occ.id(&r[u_occ]),
                age.ln_1p(),
            );
            user_rows.insert(r[u_id].clone(), rec);
        }
        let mut item_rows = HashMap::new();
        let mut bad_items = Malformed::new(item, max_malformed);
        for (line, r) in &items.rows {
            if r.len() <= i_id {
                bad_items.record(
                    *line,
                    format!("expected {} fields, found {}", items.columns.len(), r.len()),
                )?;
                continue;
            }
            let year = r
                .get(i_year)
                .and_then(|y| y.trim().parse::<f32>().ok())
                .map_or(0.0, |y| (y - 1900.0) / 100.0);
            let genres = r.get(i_class).map_or("", |s| s.trim());
            let rec = (v_item.id(&r[i_id]), v_genre.id(genres), year);
            item_rows.insert(r[i_id].clone(), rec);
        }
        for m in [&bad_users, &bad_items] {
            if m.count > 0 {
                eprintln!("warning: {}", m.summary());
            }
        }
        Ok(MovieLensFeatures {
            users: user_rows,
            items: item_rows,
            user_file: user.to_path_buf(),
            item_file: item.to_path_buf(),
            table_sizes: [v_user, v_item, v_age, v_gender, v_occ, v_genre]
                .iter()
                .map(Vocab::len)
                .collect(),
        })
    }

    /// An empty [`CtrData`] with MovieLens' feature names and table sizes.
    fn empty(&self) -> CtrData {
        let mut out = CtrData::empty(
            Self::DENSE.iter().map(|s| s.to_string()).collect(),
            Self::FIELDS.iter().map(|s| s.to_string()).collect(),
            vec![],
        );
        out.table_sizes = self.table_sizes.clone();
        out
    }

    /// Appends the features of (`user`, `item`) with `label` to `out`; the error says which
    /// of the two is unknown.
    fn push(&self, out: &mut CtrData, user: &str, item: &str, label: f32) -> Result<(), String> {
        let Some(&(uid, age, gender, occ, log_age)) = self.users.get(user) else {
            return Err(format!(
                "user `{}` is not in {}",
                clip(user),
                self.user_file.display()
            ));
        };
        let Some(&(iid, genre, year)) = self.items.get(item) else {
            return Err(format!(
                "item `{}` is not in {}",
                clip(item),
                self.item_file.display()
            ));
        };
        out.dense.extend_from_slice(&[log_age, year]);
        out.cats
            .extend_from_slice(&[uid, iid, age, gender, occ, genre]);
        out.labels.push(label);
        Ok(())
    }

    /// The rows of an interaction file (recbole's `.inter` layout: a `name:type` header with
    /// `user_id` and `item_id` columns): with a `threshold`, labelled from its `rating` column
    /// (click = rating ≥ threshold; what `comera eval --data` scores), without one unlabelled
    /// (0; a `rating` column is ignored: what `comera predict` scores). An unknown user or
    /// item, or a bad rating, is an error naming its line.
    pub fn rows(&self, path: &Path, threshold: Option<f32>) -> Result<CtrData, CtrError> {
        let inters = TypedTsv::read(path)?;
        let (x_user, x_item) = (inters.col("user_id")?, inters.col("item_id")?);
        let x_rating = threshold.map(|_| inters.col("rating")).transpose()?;
        let need = x_user.max(x_item).max(x_rating.unwrap_or(0)) + 1;
        let mut out = self.empty();
        for (line, r) in &inters.rows {
            let bad = |detail: String| CtrError::Format {
                path: path.to_path_buf(),
                line: *line,
                detail,
            };
            if r.len() < need {
                return Err(bad(format!(
                    "expected {} fields, found {}",
                    inters.columns.len(),
                    r.len()
                )));
            }
            let label = match (x_rating, threshold) {
                (Some(x), Some(t)) => match r[x].trim().parse::<f32>() {
                    Ok(v) if v.is_finite() => (v >= t) as u8 as f32,
                    _ => return Err(bad(format!("rating `{}` is not a number", clip(&r[x])))),
                },
                _ => 0.0,
            };
            self.push(&mut out, &r[x_user], &r[x_item], label)
                .map_err(bad)?;
        }
        Ok(out)
    }
}

/// MovieLens-100K (recbole's `ml-100k.{inter,user,item}`) as CTR: click = rating ≥
/// `threshold`, with the features of [`MovieLensFeatures`]. Rows whose user or item is
/// unknown, or with a bad rating, are malformed.
pub fn load_movielens(
    inter: &Path,
    user: &Path,
    item: &Path,
    threshold: f32,
    max_malformed: u64,
) -> Result<CtrData, CtrError> {
    let features = MovieLensFeatures::read(user, item, max_malformed)?;
    let inters = TypedTsv::read(inter)?;
    let (x_user, x_item, x_rating) = (
        inters.col("user_id")?,
        inters.col("item_id")?,
        inters.col("rating")?,
    );
    let mut out = features.empty();
    let mut bad = Malformed::new(inter, max_malformed);
    for (line, r) in &inters.rows {
        if r.len() <= x_user.max(x_item).max(x_rating) {
            bad.record(
                *line,
                format!(
                    "expected {} fields, found {}",
                    inters.columns.len(),
                    r.len()
                ),
            )?;
            continue;
        }
        let rating: f32 = match r[x_rating].trim().parse::<f32>() {
            Ok(v) if v.is_finite() => v,
            _ => {
                bad.record(
                    *line,
                    format!("rating `{}` is not a number", clip(&r[x_rating])),
                )?;
                continue;
            }
        };
        let label = (rating >= threshold) as u8 as f32;
        if let Err(detail) = features.push(&mut out, &r[x_user], &r[x_item], label) {
            bad.record(*line, detail)?;
        }
    }
    if bad.count > 0 {
        eprintln!("warning: {}", bad.summary());
    }
    Ok(out)
}

/// The Adult census Parquet as CTR: label = the `label` column's value starts with `>`
/// (income >50K); every other string column is a categorical field (indexed in order of
/// first appearance; null is its own token), every numeric column a dense feature
/// ln(1 + max(v, 0)) (null = 0).
pub fn load_adult(path: &Path, label: &str) -> Result<CtrData, CtrError> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    let pq = |e: parquet::errors::ParquetError| CtrError::Parquet {
        path: path.to_path_buf(),
        detail: crate::loaders::parquet_detail(&e),
    };
    let file = open_regular(path).map_err(|source| CtrError::Io {
        path: path.to_path_buf(),
        error: source,
    })?;
    let reader = SerializedFileReader::new(file).map_err(pq)?;
    let mut dense_names: Vec<String> = Vec::new();
    let mut field_names: Vec<String> = Vec::new();
    let mut vocabs: Vec<Vocab> = Vec::new();
    let mut out = CtrData::default();
    let mut saw_label = false;
    for (i, row) in reader.get_row_iter(None).map_err(pq)?.enumerate() {
        let row = row.map_err(pq)?;
        let row_no = i as u64 + 1;
        let (mut d, mut c, mut y) = (0, 0, None);
        for (name, field) in row.get_column_iter() {
            let num = match field {
                Field::Int(v) => Some(*v as f64),
                Field::Long(v) => Some(*v as f64),
                Field::Short(v) => Some(*v as f64),
                Field::Float(v) => Some(*v as f64),
                Field::Double(v) => Some(*v),
                _ => None,
            };
            let text = match field {
                Field::Str(s) => Some(s.as_str()),
                Field::Null => Some(""),
                _ => None,
            };
            if name == label {
                y = Some(text.unwrap_or("").trim().starts_with('>'));
                saw_label = true;
            } else if let Some(v) = num {
                if i == 0 {
                    dense_names.push(name.clone());
                }
                if dense_names.get(d) != Some(name) {
                    return Err(CtrError::Format {
                        path: path.to_path_buf(),
                        line: row_no,
                        detail: format!("column `{name}` changed type (row {row_no})"),
                    });
                }
                out.dense.push(v.max(0.0).ln_1p() as f32);
                d += 1;
            } else if let Some(t) = text {
                if i == 0 {
                    field_names.push(name.clone());
                    vocabs.push(Vocab::default());
                }
                if field_names.get(c) != Some(name) {
                    return Err(CtrError::Format {
                        path: path.to_path_buf(),
                        line: row_no,
                        detail: format!("column `{name}` changed type (row {row_no})"),
                    });
                }
                out.cats.push(vocabs[c].id(t.trim()));
                c += 1;
            } else {
                return Err(CtrError::Format {
                    path: path.to_path_buf(),
                    line: row_no,
                    detail: format!("column `{name}`: unsupported value type ({field})"),
                });
            }
        }
        match y {
            Some(v) => out.labels.push(v as u8 as f32),
            None => {
                return Err(CtrError::Format {
                    path: path.to_path_buf(),
                    line: row_no,
                    detail: format!("no label column `{label}`"),
                })
            }
        }
        if d != dense_names.len() || c != field_names.len() {
            return Err(CtrError::Format {
                path: path.to_path_buf(),
                line: row_no,
                detail: "row has a different set of columns than row 1".into(),
            });
        }
    }
    if !saw_label {
        return Err(CtrError::Format {
            path: path.to_path_buf(),
            line: 1,
            detail: format!("no label column `{label}` (or no rows)"),
        });
    }
    out.table_sizes = vocabs.iter().map(Vocab::len).collect();
    out.dense_names = dense_names;
    out.field_names = field_names;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> CriteoSpec {
        CriteoSpec {
            table_sizes: vec![1000; CRITEO_CATS],
            mapping: CatMapping::Modulo,
            max_malformed: 2,
        }
    }

    fn line(label: &str, ints: &[&str], cats: &[&str]) -> String {
        let mut s = label.to_string();
        for v in ints.iter().chain(cats) {
            s.push('\t');
            s.push_str(v);
        }
        s.push('\n');
        s
    }

    #[test]
    fn parses_criteo_rows_with_missing_fields() {
        let mut ints = vec![""; 13];
        ints[0] = "5";
        ints[1] = "-3";
        let mut cats = vec![""; 26];
        cats[0] = "68fd1e64";
        cats[25] = "3e8";
        let l = line("1", &ints, &cats);
        let (mut d, mut c) = ([0.0; 13], [0; 26]);
        let y = parse_criteo_line(&l, &spec(), &mut d, &mut c).unwrap();
        assert_eq!(y, 1.0);
        assert!((d[0] - 6f32.ln()).abs() < 1e-6);
        assert_eq!(d[1], 0.0);
        assert_eq!(d[2], 0.0);
        assert_eq!(c[0], (0x68fd1e64u64 % 1000) as u32);
        assert_eq!(c[25], 0); // 0x3e8 = 1000
        assert_eq!(c[3], 0);
        let mut hs = spec();
        hs.mapping = CatMapping::Hash;
        parse_criteo_line(&l, &hs, &mut d, &mut c).unwrap();
        assert!(c.iter().all(|&x| x < 1000));
    }

    #[test]
    fn malformed_rows_are_counted_with_line_numbers_and_limited() {
        let good = line("0", &["1"; 13], &["a"; 26]);
        let short = "1\t2\t3\n".to_string();
        let bad_hex = line("0", &["1"; 13], &["zz"; 26]);
        let bad_int = line("0", &["x"; 13], &["a"; 26]);
        let text = [good.clone(), short, good.clone(), bad_hex, good.clone()].concat();
        let mut r = CriteoReader::new(text.as_bytes(), Path::new("t.tsv"), spec());
        let data = r.read_all(0).unwrap();
        assert_eq!(data.len(), 3);
        assert_eq!(r.malformed.count, 2);
        assert_eq!(r.malformed.first[0].0, 2);
        assert!(
            r.malformed.first[0].1.contains("found 3"),
            "{:?}",
            r.malformed
        );
        assert_eq!(r.malformed.first[1].0, 4);
        assert!(r.malformed.first[1].1.contains("C1"));
        assert!(r.malformed.summary().contains("2 malformed"));
        let text = [good.clone(), bad_int.clone(), bad_int.clone(), bad_int].concat();
        let mut r = CriteoReader::new(text.as_bytes(), Path::new("t.tsv"), spec());
        let e = r.read_all(0).unwrap_err().to_string();
        assert!(
            e.contains("t.tsv") && e.contains("line 4") && e.contains("I1"),
            "{e}"
        );
        let extra = format!("{}\tx\n", good.trim_end());
        let e = parse_criteo_line(&extra, &spec(), &mut [0.0; 13], &mut [0; 26]).unwrap_err();
        assert_eq!(e, MalformedRow::FieldCount { found: 41 });
        assert!(e.to_string().contains("found 41"), "{e}");
        let e = parse_criteo_line("2\t", &spec(), &mut [0.0; 13], &mut [0; 26]).unwrap_err();
        assert_eq!(e, MalformedRow::Label("2".into()));
        assert!(e.to_string().contains("label"), "{e}");
    }

    #[test]
    fn zipf_is_heavy_headed_and_in_range() {
        let z = Zipf::new(10_000_000, 1.1);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut ones = 0;
        for _ in 0..10_000 {
            let k = z.sample(&mut rng);
            assert!((1..=10_000_000).contains(&k));
            ones += (k == 1) as usize;
        }
        // P(1) = 1/H(10^7, 1.1) ≈ 0.1
        assert!((600..1500).contains(&ones), "{ones}");
        let z = Zipf::new(3, 1.0);
        for _ in 0..1000 {
            assert!((1..=3).contains(&z.sample(&mut rng)));
        }
    }

    #[test]
    fn synthetic_file_and_direct_batches_agree() {
        let sizes = SynthSpec::criteo_like_sizes(100_000);
        assert_eq!(sizes.iter().sum::<usize>(), 100_000);
        let s = SynthSpec {
            table_sizes: sizes.clone(),
            zipf_s: 1.1,
            missing: 0.05,
            seed: 7,
        };
        let mut g = SynthCriteo::new(s.clone()).unwrap();
        let mut buf = Vec::new();
        g.write_tsv(&mut buf, 50).unwrap();
        let cs = CriteoSpec {
            table_sizes: sizes,
            mapping: CatMapping::Modulo,
            max_malformed: 0,
        };
        let mut r = CriteoReader::new(&buf[..], Path::new("synth"), cs.clone());
        let from_file = r.read_all(0).unwrap();
        let direct = SynthCriteo::new(s).unwrap().generate(&cs, 50);
        assert_eq!(from_file, direct);
        assert!(direct.positive_rate() > 0.05 && direct.positive_rate() < 0.8);
    }

    #[test]
    fn movielens_typed_tsv_becomes_ctr() {
        let dir = tempfile::tempdir().unwrap();
        let w = |n: &str, s: &str| {
            let p = dir.path().join(n);
            std::fs::write(&p, s).unwrap();
            p
        };
        let inter = w(
            "x.inter",
            "user_id:token\titem_id:token\trating:float\ttimestamp:float\n1\t10\t4\t5\n2\t10\t3\t6\n1\t11\t5\t7\n9\t10\t5\t8\n",
        );
        let user = w(
            "x.user",
            "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n1\t24\tM\ttech\t1\n2\t53\tF\tother\t2\n",
        );
        let item = w(
            "x.item",
            "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n10\tA\t1995\tDrama Comedy\n11\tB\t\tDrama\n",
        );
        let d = load_movielens(&inter, &user, &item, 4.0, 5).unwrap();
        assert_eq!(d.len(), 3);
        assert_eq!(d.labels, vec![1.0, 0.0, 1.0]);
        assert_eq!(d.table_sizes, vec![2, 2, 2, 2, 2, 2]);
        assert_eq!(&d.cats[..6], &[0, 0, 0, 0, 0, 0]);
        assert_eq!(&d.cats[12..], &[0, 1, 0, 0, 0, 1]);
        assert!((d.dense[1] - 0.95).abs() < 1e-6 && d.dense[5] == 0.0);
        let e = load_movielens(&inter, &user, &item, 4.0, 0)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("x.inter") && e.contains("line 5") && e.contains("user `9`"),
            "{e}"
        );
        let (t, v) = d.split(0.34, 1);
        assert_eq!((t.len(), v.len()), (2, 1));
    }
}
