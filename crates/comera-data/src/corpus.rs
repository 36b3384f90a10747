//! Corpora for masked-language-model pre-training: plain-text files (`.gz` too) and source-code
//! directories read as a stream of documents, tokenised (BERT WordPiece or byte-level BPE), split
//! into train / held-out by document, and packed into fixed-length `[CLS] … [SEP]` blocks.
//!
//! **Order.** Sources are read in the order they were added. A code directory is walked
//! recursively without following symlinks, each directory's entries sorted by file name (bytes),
//! so the order is the sorted order of the path components and the same on every machine. Only
//! regular files whose extension (without the dot, case-sensitive) is in the list are read; each
//! file is one document, keyed by its path relative to the root (`/`-separated).
//!
//! **Text files.** Read line by line (a `.gz` name is gunzipped on the fly); documents are lines,
//! blank-line-separated paragraphs, WikiText articles (a new one starts at every top-level
//! ` = Title = ` heading) or the whole file ([`TextDocs`]). Documents that are empty after
//! trimming are dropped.
//!
//! **Bad input.** A missing source (file or root directory) is always an error. With
//! [`OnBadFile::Skip`] (the default) a code file that cannot be read or is not UTF-8 is skipped,
//! and so is a text line that is not UTF-8; both are counted in [`CorpusStats`] with the first
//! few reasons kept (file, line, byte offset). With [`OnBadFile::Error`] the first one stops the
//! stream with a [`CorpusError`] naming the file and line. (Real source trees hold a few
//! deliberately non-UTF-8 test files: skipping is what makes them usable.) A leading UTF-8 BOM is
//! removed.
//!
//! **Split.** A document goes to the held-out set when a hash of its key and the split seed falls
//! below `valid_fraction`: deterministic, independent of thread count and of the other documents
//! (adding a file moves no other file between the sets).
//!
//! **Packing.** Each split is packed separately: the documents' tokens are concatenated with one
//! `[SEP]` between consecutive documents (none when a document happens to start a block; a
//! separator landing in a block's last slot gives `… [SEP] [SEP]`, as RoBERTa's `</s></s>`)
//! and cut into blocks of `seq_len - 2` tokens, each
//! written as `[CLS] block [SEP]` (a document may continue into the next block). The last,
//! partial block is padded with `[PAD]` (or dropped: [`PackConfig::keep_partial`]). Every other
//! block has no padding.

use crate::bpe::BpeTokenizer;
use crate::fetch::{fetch, FetchError};
use crate::regular::{open_regular, read_regular};
use crate::tokenizer::{BertTokenizer, SpecialIds, TokenizerError};
use rayon::prelude::*;
use std::fs;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};

/// How many skip reasons [`CorpusStats::skipped`] keeps.
pub const MAX_SKIP_REASONS: usize = 20;

/// How a plain-text file is cut into documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TextDocs {
    /// Every non-blank line is a document.
    Lines,
    /// Runs of non-blank lines separated by blank lines.
    #[default]
    Paragraphs,
    /// WikiText: a top-level heading line ` = Title = ` (one `=` each side) starts a document.
    WikiArticles,
    /// The whole file is one document.
    WholeFile,
}

/// One source of documents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Text {
        path: PathBuf,
        docs: TextDocs,
    },
    Code {
        root: PathBuf,
        extensions: Vec<String>,
    },
}

/// What to do with a file (code) or line (text) that cannot be read or is not UTF-8.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnBadFile {
    #[default]
    Skip,
    Error,
}

/// A list of sources read in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Corpus {
    pub sources: Vec<Source>,
    pub on_bad_file: OnBadFile,
}

/// One document of a corpus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    /// Stable name: the path relative to the code root, or `file:first_line` for text.
    pub key: String,
    pub text: String,
}

/// Counts of what a pass over the corpus read and skipped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CorpusStats {
    /// Files opened (text files and code files with a matching extension).
    pub files: usize,
    pub documents: usize,
    /// UTF-8 bytes of the documents' text.
    pub bytes: u64,
    pub skipped_files: usize,
    pub skipped_lines: usize,
    /// The first [`MAX_SKIP_REASONS`] reasons, each naming the file (and line).
    pub skipped: Vec<String>,
}

/// What went wrong reading or tokenising a corpus; every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum CorpusError {
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: io::Error },
    #[error("{path}: line {line}: not UTF-8 ({detail})")]
    InvalidUtf8 {
        path: PathBuf,
        line: usize,
        detail: String,
    },
    #[error("walking {path}: {detail}")]
    Walk { path: PathBuf, detail: String },
    #[error("document {key}: {error}")]
    Tokenize { key: String, error: TokenizerError },
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Fetch(Box<FetchError>),
    #[error("{path}: not a packed-sequence file: {detail}")]
    BadPacked { path: PathBuf, detail: String },
    #[error("seq_len {seq_len} is too small: a block needs [CLS], [SEP] and at least one token")]
    SeqLenTooSmall { seq_len: usize },
}

impl From<FetchError> for CorpusError {
    fn from(e: FetchError) -> Self {
        CorpusError::Fetch(Box::new(e))
    }
}

impl Corpus {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a plain-text file (gunzipped when its name ends in `.gz`).
    pub fn text_file(mut self, path: impl Into<PathBuf>, docs: TextDocs) -> Self {
        self.sources.push(Source::Text {
            path: path.into(),
            docs,
        });
        self
    }

    /// Adds a directory of source files with these extensions (`"rs"` or `".rs"`).
    pub fn code_dir(mut self, root: impl Into<PathBuf>, extensions: &[&str]) -> Self {
        self.sources.push(Source::Code {
            root: root.into(),
            extensions: extensions
                .iter()
                .map(|e| e.trim_start_matches('.').to_string())
                .collect(),
        });
        self
    }

    pub fn on_bad_file(mut self, policy: OnBadFile) -> Self {
        self.on_bad_file = policy;
        self
    }

    /// A hash (hex SHA-256) of what the corpus would read: every source's kind and settings,
    /// and each file it reads by path, size and modification time (code trees walked like
    /// [`Corpus::documents`] walks them). Equal fingerprints mean the same documents, unless a
    /// file was rewritten with the same size within its timestamp's resolution.
    pub fn fingerprint(&self) -> Result<String, CorpusError> {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        let file = |h: &mut Sha256, path: &Path| -> Result<(), CorpusError> {
            let meta = fs::metadata(path).map_err(|source| CorpusError::Io {
                path: path.to_path_buf(),
                error: source,
            })?;
            let mtime = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            h.update(format!("{}\0{}\0{mtime}\0", path.display(), meta.len()));
            Ok(())
        };
        h.update(format!("{:?}\0", self.on_bad_file));
        for source in &self.sources {
            match source {
                Source::Text { path, docs } => {
                    h.update(format!("text {docs:?}\0"));
                    file(&mut h, path)?;
                }
                Source::Code { root, extensions } => {
                    h.update(format!("code {extensions:?}\0"));
                    for entry in walkdir::WalkDir::new(root)
                        .follow_links(false)
                        .sort_by_file_name()
                    {
                        let entry = entry.map_err(|e| CorpusError::Walk {
                            path: root.clone(),
                            detail: e.to_string(),
                        })?;
                        let wanted = entry.file_type().is_file()
                            && entry
                                .path()
                                .extension()
                                .and_then(|e| e.to_str())
                                .is_some_and(|e| extensions.iter().any(|x| x == e));
                        if wanted {
                            file(&mut h, entry.path())?;
                        }
                    }
                }
            }
        }
        Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }

    /// Streams the documents in order; [`Documents::stats`] counts what was read and skipped.
    pub fn documents(&self) -> Documents<'_> {
        Documents {
            corpus: self,
            next_source: 0,
            state: State::Between,
            stats: CorpusStats::default(),
        }
    }
}

/// The document stream of a [`Corpus`].
pub struct Documents<'a> {
    corpus: &'a Corpus,
    next_source: usize,
    state: State,
    stats: CorpusStats,
}

enum State {
    Between,
    Walk(Box<WalkState>),
    Text(Box<TextState>),
    Failed,
}

struct WalkState {
    iter: walkdir::IntoIter,
    root: PathBuf,
    extensions: Vec<String>,
}

struct TextState {
    reader: Box<dyn BufRead + Send>,
    path: PathBuf,
    docs: TextDocs,
    line: usize,
    buf: Vec<u8>,
    pending: String,
    pending_line: usize,
    eof: bool,
}

impl Documents<'_> {
    pub fn stats(&self) -> &CorpusStats {
        &self.stats
    }

    fn skip(&mut self, reason: String, file: bool) {
        if file {
            self.stats.skipped_files += 1;
        } else {
            self.stats.skipped_lines += 1;
        }
        if self.stats.skipped.len() < MAX_SKIP_REASONS {
            self.stats.skipped.push(reason);
        }
    }

    fn open_source(&mut self, source: &Source) -> Result<State, CorpusError> {
        match source {
            Source::Text { path, docs } => {
                let file = open_regular(path).map_err(|source| CorpusError::Io {
                    path: path.clone(),
                    error: source,
                })?;
                let reader: Box<dyn BufRead + Send> = if path.extension().is_some_and(|e| e == "gz")
                {
                    Box::new(BufReader::with_capacity(
                        1 << 16,
                        flate2::read::MultiGzDecoder::new(BufReader::new(file)),
                    ))
                } else {
                    Box::new(BufReader::with_capacity(1 << 16, file))
                };
                self.stats.files += 1;
                Ok(State::Text(Box::new(TextState {
                    reader,
                    path: path.clone(),
                    docs: *docs,
                    line: 0,
                    buf: Vec::new(),
                    pending: String::new(),
                    pending_line: 0,
                    eof: false,
                })))
            }
            Source::Code { root, extensions } => {
                let meta = fs::metadata(root).map_err(|source| CorpusError::Io {
                    path: root.clone(),
                    error: source,
                })?;
                if !meta.is_dir() {
                    return Err(CorpusError::Walk {
                        path: root.clone(),
                        detail: "not a directory".into(),
                    });
                }
                let iter = walkdir::WalkDir::new(root)
                    .follow_links(false)
                    .sort_by_file_name()
                    .into_iter();
                Ok(State::Walk(Box::new(WalkState {
                    iter,
                    root: root.clone(),
                    extensions: extensions.clone(),
                })))
            }
        }
    }

    /// The next document of a code walk, `None` when the walk is over.
    fn next_code(&mut self) -> Option<Result<Document, CorpusError>> {
        let policy = self.corpus.on_bad_file;
        loop {
            let State::Walk(w) = &mut self.state else {
                unreachable!()
            };
            let WalkState {
                iter,
                root,
                extensions,
            } = &mut **w;
            let entry = match iter.next()? {
                Ok(e) => e,
                Err(e) => {
                    let path = e.path().map(Path::to_path_buf).unwrap_or(root.clone());
                    let detail = e.to_string();
                    if policy == OnBadFile::Error {
                        return Some(Err(CorpusError::Walk { path, detail }));
                    }
                    self.skip(format!("{}: {detail}", path.display()), true);
                    continue;
                }
            };
            if !entry.file_type().is_file() {
                continue;
            }
            let path = entry.path();
            let wanted = path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| extensions.iter().any(|x| x == e));
            if !wanted {
                continue;
            }
            let key = path
                .strip_prefix(&*root)
                .unwrap_or(path)
                .components()
                .map(|c| c.as_os_str().to_string_lossy())
                .collect::<Vec<_>>()
                .join("/");
            let path = path.to_path_buf();
            self.stats.files += 1;
            let bytes = match read_regular(&path) {
                Ok(b) => b,
                Err(source) => {
                    if policy == OnBadFile::Error {
                        return Some(Err(CorpusError::Io {
                            path,
                            error: source,
                        }));
                    }
                    self.skip(format!("{}: {source}", path.display()), true);
                    continue;
                }
            };
            let text = match String::from_utf8(bytes) {
                Ok(t) => t,
                Err(e) => {
                    let (line, detail) = utf8_position(e.as_bytes(), e.utf8_error());
                    if policy == OnBadFile::Error {
                        return Some(Err(CorpusError::InvalidUtf8 { path, line, detail }));
                    }
                    self.skip(
                        format!("{}: line {line}: not UTF-8 ({detail})", path.display()),
                        true,
                    );
                    continue;
                }
            };
            let text = match text.strip_prefix('\u{feff}') {
                Some(t) => t.to_string(),
                None => text,
            };
            if text.trim().is_empty() {
                continue;
            }
            return Some(Ok(Document { key, text }));
        }
    }

    /// The next document of a text file, `None` at its end.
    fn next_text(&mut self) -> Option<Result<Document, CorpusError>> {
        let policy = self.corpus.on_bad_file;
        loop {
            let State::Text(t) = &mut self.state else {
                unreachable!()
            };
            if t.eof {
                return take_pending(&mut t.pending, &t.path, t.pending_line).map(Ok);
            }
            t.buf.clear();
            match t.reader.read_until(b'\n', &mut t.buf) {
                Ok(0) => {
                    t.eof = true;
                    continue;
                }
                Ok(_) => {}
                Err(source) => {
                    // A read error (e.g. corrupt gzip) ends this file either way.
                    let path = t.path.clone();
                    let line = t.line + 1;
                    t.eof = true;
                    if policy == OnBadFile::Error {
                        return Some(Err(CorpusError::Io {
                            path,
                            error: io::Error::new(source.kind(), format!("line {line}: {source}")),
                        }));
                    }
                    self.skip(format!("{}: line {line}: {source}", path.display()), true);
                    continue;
                }
            }
            t.line += 1;
            let line = match std::str::from_utf8(&t.buf) {
                Ok(s) => s,
                Err(e) => {
                    let (path, line) = (t.path.clone(), t.line);
                    let detail = format!("invalid byte at offset {} of the line", e.valid_up_to());
                    if policy == OnBadFile::Error {
                        return Some(Err(CorpusError::InvalidUtf8 { path, line, detail }));
                    }
                    self.skip(
                        format!("{}: line {line}: not UTF-8 ({detail})", path.display()),
                        false,
                    );
                    continue;
                }
            };
            let line = if t.line == 1 {
                line.strip_prefix('\u{feff}').unwrap_or(line)
            } else {
                line
            };
            let blank = line.trim().is_empty();
            let line_no = t.line;
            let starts_new = match t.docs {
                TextDocs::Lines => !blank,
                TextDocs::Paragraphs => blank,
                TextDocs::WikiArticles => is_wiki_title(line),
                TextDocs::WholeFile => false,
            };
            let done = if starts_new {
                take_pending(&mut t.pending, &t.path, t.pending_line)
            } else {
                None
            };
            match t.docs {
                TextDocs::Lines | TextDocs::Paragraphs if blank => {}
                _ => {
                    if t.pending.is_empty() {
                        t.pending_line = line_no;
                    }
                    t.pending.push_str(line);
                    if !line.ends_with('\n') {
                        t.pending.push('\n');
                    }
                }
            }
            if t.docs == TextDocs::Lines {
                // A line is complete as soon as it is read.
                if let Some(d) = take_pending(&mut t.pending, &t.path, t.pending_line) {
                    return Some(Ok(d));
                }
            }
            if let Some(d) = done {
                return Some(Ok(d));
            }
        }
    }
}

/// The pending document of a text file, unless it is blank.
fn take_pending(pending: &mut String, path: &Path, first_line: usize) -> Option<Document> {
    let text = std::mem::take(pending);
    if text.trim().is_empty() {
        return None;
    }
    Some(Document {
        key: format!("{}:{first_line}", path.display()),
        text,
    })
}

/// ` = Title = ` but not ` = = Section = = `.
fn is_wiki_title(line: &str) -> bool {
    let s = line.trim();
    s.len() >= 4 && s.starts_with("= ") && s.ends_with(" =") && !s.starts_with("= =")
}

/// 1-based line of a UTF-8 error and a description with the byte offset.
fn utf8_position(bytes: &[u8], e: std::str::Utf8Error) -> (usize, String) {
    let at = e.valid_up_to();
    let line = 1 + bytes[..at].iter().filter(|&&b| b == b'\n').count();
    let col = at
        - bytes[..at]
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |p| p + 1);
    (
        line,
        format!("invalid byte at file offset {at}, offset {col} of the line"),
    )
}

impl Iterator for Documents<'_> {
    type Item = Result<Document, CorpusError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let item = match self.state {
                State::Failed => return None,
                State::Between => {
                    let corpus = self.corpus;
                    let source = corpus.sources.get(self.next_source)?;
                    self.next_source += 1;
                    match self.open_source(source) {
                        Ok(s) => {
                            self.state = s;
                            continue;
                        }
                        Err(e) => Some(Err(e)),
                    }
                }
                State::Walk(_) => self.next_code(),
                State::Text(_) => self.next_text(),
            };
            match item {
                None => self.state = State::Between,
                Some(Ok(d)) => {
                    self.stats.documents += 1;
                    self.stats.bytes += d.text.len() as u64;
                    return Some(Ok(d));
                }
                Some(Err(e)) => {
                    self.state = State::Failed;
                    return Some(Err(e));
                }
            }
        }
    }
}

/// Which vocabulary tokenises a corpus.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// BERT base uncased WordPiece (30,522 ids; data set `bert-vocab`).
    WordPiece,
    /// GPT-2 byte-level BPE (50,257 ids + 5 specials; data sets `gpt2-vocab`, `gpt2-merges`).
    Gpt2Bpe,
}

/// A tokenizer name that [`TokenizerKind`] does not know.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown tokenizer {0:?}: use `wordpiece` (BERT) or `bpe` (GPT-2 byte-level)")]
pub struct UnknownTokenizer(pub String);

impl std::str::FromStr for TokenizerKind {
    type Err = UnknownTokenizer;
    fn from_str(s: &str) -> Result<Self, UnknownTokenizer> {
        match s {
            "wordpiece" | "bert" => Ok(TokenizerKind::WordPiece),
            "bpe" | "gpt2" | "gpt2-bpe" => Ok(TokenizerKind::Gpt2Bpe),
            _ => Err(UnknownTokenizer(s.to_string())),
        }
    }
}

/// A tokenizer for corpora: WordPiece or byte-level BPE behind one interface.
#[derive(Debug, Clone)]
pub enum CorpusTokenizer {
    WordPiece(BertTokenizer),
    Bpe(BpeTokenizer),
}

impl CorpusTokenizer {
    /// Loads the vocabulary of `kind`, fetching its files into `cache_dir` if needed.
    pub fn fetch(kind: TokenizerKind, cache_dir: &Path) -> Result<Self, CorpusError> {
        Ok(match kind {
            TokenizerKind::WordPiece => CorpusTokenizer::WordPiece(BertTokenizer::from_vocab_file(
                &fetch("bert-vocab", cache_dir)?,
            )?),
            TokenizerKind::Gpt2Bpe => CorpusTokenizer::Bpe(BpeTokenizer::from_files(
                &fetch("gpt2-vocab", cache_dir)?,
                &fetch("gpt2-merges", cache_dir)?,
            )?),
        })
    }

    pub fn kind(&self) -> TokenizerKind {
        match self {
            CorpusTokenizer::WordPiece(_) => TokenizerKind::WordPiece,
            CorpusTokenizer::Bpe(_) => TokenizerKind::Gpt2Bpe,
        }
    }

    /// Ids of `text` without special tokens.
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match self {
            CorpusTokenizer::WordPiece(t) => t.tokenize(text),
            CorpusTokenizer::Bpe(t) => t.tokenize(text),
        }
    }

    /// Number of ids, specials included (the model's vocabulary size).
    pub fn vocab_size(&self) -> usize {
        match self {
            CorpusTokenizer::WordPiece(t) => t.vocab_size(),
            CorpusTokenizer::Bpe(t) => t.vocab_size(),
        }
    }

    pub fn special_ids(&self) -> SpecialIds {
        match self {
            CorpusTokenizer::WordPiece(t) => t.special_ids(),
            CorpusTokenizer::Bpe(t) => t.special_ids(),
        }
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match self {
            CorpusTokenizer::WordPiece(t) => t.id_to_token(id),
            CorpusTokenizer::Bpe(t) => t.id_to_token(id),
        }
    }
}

/// Packing and split settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PackConfig {
    /// Block length including `[CLS]` and the closing `[SEP]` (at least 3).
    pub seq_len: usize,
    /// Fraction of documents held out (by a hash of their key), in [0, 1].
    pub valid_fraction: f64,
    pub split_seed: u64,
    /// Keep the last partial block of each split, padded with `[PAD]` (default true).
    pub keep_partial: bool,
    /// Documents are tokenised in parallel in chunks of about this many bytes (default 4 MiB).
    pub chunk_bytes: usize,
}

impl PackConfig {
    pub fn new(seq_len: usize) -> Self {
        PackConfig {
            seq_len,
            valid_fraction: 0.0,
            split_seed: 0,
            keep_partial: true,
            chunk_bytes: 4 << 20,
        }
    }
}

/// Whether the document with this key is held out.
pub fn is_held_out(key: &str, valid_fraction: f64, seed: u64) -> bool {
    if valid_fraction <= 0.0 {
        return false;
    }
    // FNV-1a of the key, mixed with the seed by SplitMix64: uniform in [0, 1).
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in key.as_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    let u = (splitmix64(h ^ splitmix64(seed)) >> 11) as f64 / (1u64 << 53) as f64;
    u < valid_fraction
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fixed-length packed blocks: row `i` is `input_ids[i*seq_len .. (i+1)*seq_len]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedSequences {
    pub seq_len: usize,
    pub input_ids: Vec<u32>,
    pub special: SpecialIds,
    /// Documents packed.
    pub documents: u64,
    /// Document tokens packed (without `[CLS]`, `[SEP]`, `[PAD]`).
    pub tokens: u64,
}

const PACKED_MAGIC: &[u8; 8] = b"CMRPACK1";

impl PackedSequences {
    pub fn new(seq_len: usize, special: SpecialIds) -> Self {
        PackedSequences {
            seq_len,
            input_ids: Vec::new(),
            special,
            documents: 0,
            tokens: 0,
        }
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.input_ids.len().checked_div(self.seq_len).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    pub fn row(&self, i: usize) -> &[u32] {
        &self.input_ids[i * self.seq_len..(i + 1) * self.seq_len]
    }

    /// Writes the blocks to `path` atomically (a temporary file beside it, then a rename):
    /// magic `CMRPACK1`, then little-endian u64 seq_len, rows, documents, tokens, the five
    /// special ids as u32 (pad, unk, cls, sep, mask), then the ids as u32.
    pub fn save(&self, path: &Path) -> Result<(), CorpusError> {
        let io_err = |source| CorpusError::Io {
            path: path.to_path_buf(),
            error: source,
        };
        let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
        let write = || -> io::Result<()> {
            let mut w = io::BufWriter::new(fs::File::create(&tmp)?);
            w.write_all(PACKED_MAGIC)?;
            for v in [
                self.seq_len as u64,
                self.len() as u64,
                self.documents,
                self.tokens,
            ] {
                w.write_all(&v.to_le_bytes())?;
            }
            let s = self.special;
            for v in [s.pad, s.unk, s.cls, s.sep, s.mask] {
                w.write_all(&v.to_le_bytes())?;
            }
            for chunk in self.input_ids.chunks(1 << 16) {
                let bytes: Vec<u8> = chunk.iter().flat_map(|v| v.to_le_bytes()).collect();
                w.write_all(&bytes)?;
            }
            w.into_inner().map_err(|e| e.into_error())?.sync_all()
        };
        if let Err(e) = write() {
            let _ = fs::remove_file(&tmp);
            return Err(io_err(e));
        }
        fs::rename(&tmp, path).map_err(io_err)
    }

    /// Reads a file written by [`PackedSequences::save`].
    pub fn load(path: &Path) -> Result<Self, CorpusError> {
        let bad = |detail: String| CorpusError::BadPacked {
            path: path.to_path_buf(),
            detail,
        };
        let mut r = BufReader::new(open_regular(path).map_err(|source| CorpusError::Io {
            path: path.to_path_buf(),
            error: source,
        })?);
        let mut head = [0u8; 8 + 32 + 20];
        r.read_exact(&mut head)
            .map_err(|e| bad(format!("header: {e}")))?;
        if &head[..8] != PACKED_MAGIC {
            return Err(bad("wrong magic (expected CMRPACK1)".into()));
        }
        let u64_at = |i: usize| u64::from_le_bytes(head[8 + 8 * i..16 + 8 * i].try_into().unwrap());
        let u32_at =
            |i: usize| u32::from_le_bytes(head[40 + 4 * i..44 + 4 * i].try_into().unwrap());
        let (seq_len, rows, documents, tokens) = (u64_at(0), u64_at(1), u64_at(2), u64_at(3));
        let n = seq_len
            .checked_mul(rows)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| bad(format!("{rows} rows of {seq_len} ids overflow")))?;
        let mut bytes = Vec::new();
        r.read_to_end(&mut bytes)
            .map_err(|e| bad(format!("ids: {e}")))?;
        if bytes.len() != n * 4 {
            return Err(bad(format!(
                "{rows} rows of {seq_len} ids need {} bytes after the header, found {}",
                n * 4,
                bytes.len()
            )));
        }
        let input_ids = bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        Ok(PackedSequences {
            seq_len: seq_len as usize,
            input_ids,
            special: SpecialIds {
                pad: u32_at(0),
                unk: u32_at(1),
                cls: u32_at(2),
                sep: u32_at(3),
                mask: u32_at(4),
            },
            documents,
            tokens,
        })
    }
}

/// Packs documents' token ids into blocks as they come (see the module docs).
#[derive(Debug, Clone)]
pub struct Packer {
    out: PackedSequences,
    /// Document tokens of the block being filled.
    cur: Vec<u32>,
}

impl Packer {
    pub fn new(seq_len: usize, special: SpecialIds) -> Result<Self, CorpusError> {
        if seq_len < 3 {
            return Err(CorpusError::SeqLenTooSmall { seq_len });
        }
        Ok(Packer {
            out: PackedSequences::new(seq_len, special),
            cur: Vec::with_capacity(seq_len),
        })
    }

    fn capacity(&self) -> usize {
        self.out.seq_len - 2
    }

    fn flush(&mut self) {
        let s = self.out.special;
        self.out.input_ids.push(s.cls);
        self.out.input_ids.extend_from_slice(&self.cur);
        self.out.input_ids.push(s.sep);
        let pad = self.out.seq_len - 2 - self.cur.len();
        self.out.input_ids.extend(std::iter::repeat_n(s.pad, pad));
        self.cur.clear();
    }

    /// Appends one document (ids without specials); an empty one is ignored.
    pub fn push_document(&mut self, ids: &[u32]) {
        if ids.is_empty() {
            return;
        }
        let cap = self.capacity();
        if !self.cur.is_empty() {
            self.cur.push(self.out.special.sep);
            if self.cur.len() == cap {
                self.flush();
            }
        }
        let mut rest = ids;
        while !rest.is_empty() {
            let take = (cap - self.cur.len()).min(rest.len());
            self.cur.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if self.cur.len() == cap {
                self.flush();
            }
        }
        self.out.documents += 1;
        self.out.tokens += ids.len() as u64;
    }

    /// The blocks, with the last partial one padded (`keep_partial`) or dropped.
    pub fn finish(mut self, keep_partial: bool) -> PackedSequences {
        if !self.cur.is_empty() && keep_partial {
            self.flush();
        }
        self.out
    }
}

/// A packed corpus: train and held-out blocks and what was read.
#[derive(Debug, Clone)]
pub struct PackedCorpus {
    pub train: PackedSequences,
    pub valid: PackedSequences,
    pub stats: CorpusStats,
}

/// Reads, tokenises (in parallel, chunk by chunk, order kept), splits and packs a corpus.
pub fn pack_corpus(
    corpus: &Corpus,
    tokenizer: &CorpusTokenizer,
    cfg: &PackConfig,
) -> Result<PackedCorpus, CorpusError> {
    let mut packed = pack_corpus_lengths(corpus, tokenizer, cfg, &[cfg.seq_len], &mut |_| {})?;
    Ok(packed.pop().expect("one sequence length"))
}

/// [`pack_corpus`] for several block lengths in one pass over the corpus (one tokenisation):
/// one [`PackedCorpus`] per entry of `seq_lens` (`cfg.seq_len` is not used), in that order.
/// `progress` is called with what has been read after each chunk of documents.
pub fn pack_corpus_lengths(
    corpus: &Corpus,
    tokenizer: &CorpusTokenizer,
    cfg: &PackConfig,
    seq_lens: &[usize],
    progress: &mut dyn FnMut(&CorpusStats),
) -> Result<Vec<PackedCorpus>, CorpusError> {
    let special = tokenizer.special_ids();
    // (train, valid) packers per block length.
    let mut packers = seq_lens
        .iter()
        .map(|&t| Ok((Packer::new(t, special)?, Packer::new(t, special)?)))
        .collect::<Result<Vec<_>, CorpusError>>()?;
    let mut docs = corpus.documents();
    let mut chunk: Vec<Document> = Vec::new();
    let mut chunk_bytes = 0usize;
    let mut flush_chunk = |chunk: &mut Vec<Document>| -> Result<(), CorpusError> {
        let ids: Vec<Vec<u32>> = chunk
            .par_iter()
            .map(|d| {
                tokenizer
                    .tokenize(&d.text)
                    .map_err(|source| CorpusError::Tokenize {
                        key: d.key.clone(),
                        error: source,
                    })
            })
            .collect::<Result<_, _>>()?;
        for (d, ids) in chunk.iter().zip(ids) {
            let held_out = is_held_out(&d.key, cfg.valid_fraction, cfg.split_seed);
            for (train, valid) in packers.iter_mut() {
                if held_out {
                    valid.push_document(&ids);
                } else {
                    train.push_document(&ids);
                }
            }
        }
        chunk.clear();
        Ok(())
    };
    while let Some(d) = docs.next() {
        let d = d?;
        chunk_bytes += d.text.len();
        chunk.push(d);
        if chunk_bytes >= cfg.chunk_bytes.max(1) {
            flush_chunk(&mut chunk)?;
            chunk_bytes = 0;
            progress(docs.stats());
        }
    }
    flush_chunk(&mut chunk)?;
    let stats = docs.stats().clone();
    progress(&stats);
    Ok(packers
        .into_iter()
        .map(|(train, valid)| PackedCorpus {
            train: train.finish(cfg.keep_partial),
            valid: valid.finish(cfg.keep_partial),
            stats: stats.clone(),
        })
        .collect())
}
