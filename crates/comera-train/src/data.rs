//! Turning a `[data]` table into tokenised, fixed-length training and validation sets.

use crate::config::ConfigError;
use crate::config::{DataConfig, DataSource};
use crate::error::{Error, IoContext, Result};
use comera_data::corpus::{
    pack_corpus_lengths, Corpus, CorpusStats, CorpusTokenizer, PackConfig, PackedCorpus,
    PackedSequences, TextDocs, TokenizerKind,
};
use comera_data::mlm::{MlmConfig, MlmMasker};
use comera_data::{
    default_cache_dir, fetch, load_reviews, load_table, table_columns, train_valid_split,
    BertTokenizer, EncodedDataset, Example, Labels, LoadedSet, ReviewLabel, TableFormat, TableSpec,
};
use std::path::{Path, PathBuf};

/// Tokenised data ready for training.
pub struct PreparedData {
    /// The `[data]` table as the run records it: a file source's columns named, its labels
    /// (read from the data when not configured) and the files' SHA-256 digests.
    pub data: DataConfig,
    pub tokenizer: BertTokenizer,
    pub vocab: PathBuf,
    pub train: EncodedDataset,
    pub valid: EncodedDataset,
    pub label_names: Vec<String>,
    pub pair: bool,
    /// A one-line description for the log.
    pub summary: String,
}

/// The data cache: `data.cache_dir`, else `$COMERA_DATA` or `~/.cache/comera`.
pub fn cache_dir(cfg: &DataConfig) -> PathBuf {
    cfg.cache_dir.clone().unwrap_or_else(default_cache_dir)
}

/// The vocabulary file: the configured one, or the fetched BERT uncased vocab.
pub fn vocab_path(cfg: &DataConfig) -> Result<PathBuf> {
    match &cfg.vocab {
        Some(p) => Ok(p.clone()),
        None => Ok(fetch("bert-vocab", &cache_dir(cfg))?),
    }
}

fn required<'a, T>(v: &'a Option<T>, field: &str, source: DataSource) -> Result<&'a T> {
    v.as_ref().ok_or_else(|| {
        ConfigError::new(
            format!("data.{field}"),
            format!("required for source `{source}`"),
        )
        .into()
    })
}

/// The columns a file source uses when `data.text_a`, `data.text_b` and `data.label` name none
/// (defined beside the writer of data files, [`crate::inputs`]).
pub use crate::inputs::{LABEL_COLUMN, PAIR_COLUMNS, TEXT_COLUMNS};

/// The table format of a file source.
fn table_format(source: DataSource) -> Option<TableFormat> {
    Some(match source {
        DataSource::Mnli | DataSource::Tsv => TableFormat::Tsv,
        DataSource::Csv => TableFormat::Csv,
        DataSource::Jsonl => TableFormat::Jsonl,
        DataSource::Parquet => TableFormat::Parquet,
        _ => return None,
    })
}

/// `cfg` with a file source's columns named: those `[data]` gives, the rest found by convention
/// in the training file's columns ([`TEXT_COLUMNS`], [`PAIR_COLUMNS`], [`LABEL_COLUMN`]).
/// Other sources are returned as they are.
pub fn resolve_columns(cfg: &DataConfig) -> Result<DataConfig> {
    let mut out = cfg.clone();
    let Some(format) = table_format(cfg.source).filter(|_| cfg.source != DataSource::Mnli) else {
        return Ok(out);
    };
    if cfg.text_a.is_some() && cfg.label.is_some() {
        return Ok(out);
    }
    let train = required(&cfg.train, "train", cfg.source)?;
    let columns = table_columns(train, format)?;
    let find = |names: &[&str]| {
        names
            .iter()
            .find(|n| columns.iter().any(|c| c == *n))
            .map(|n| n.to_string())
    };
    if out.text_a.is_none() {
        out.text_a = Some(find(TEXT_COLUMNS).ok_or_else(|| {
            ConfigError::new(
                "data.text_a",
                format!(
                    "not set, and {} has none of the columns {TEXT_COLUMNS:?} (its columns: {columns:?}); name the text column",
                    train.display()
                ),
            )
        })?);
        if out.text_b.is_none() {
            out.text_b = find(PAIR_COLUMNS);
        }
    }
    if out.label.is_none() {
        if !columns.iter().any(|c| c == LABEL_COLUMN) {
            return Err(ConfigError::new(
                "data.label",
                format!(
                    "not set, and {} has no `{LABEL_COLUMN}` column (its columns: {columns:?}); name the label column",
                    train.display()
                ),
            )
            .into());
        }
        out.label = Some(LABEL_COLUMN.to_string());
    }
    Ok(out)
}

/// The columns and labels a file source reads: `labels` as configured, or read from the data
/// (`Labels::FromData`).
fn file_spec(cfg: &DataConfig, format: TableFormat, labels: Labels) -> Result<TableSpec> {
    let src = cfg.source;
    let a = required(&cfg.text_a, "text_a", src)?;
    let label = required(&cfg.label, "label", src)?;
    Ok(match &cfg.text_b {
        Some(b) => TableSpec::pair(format, a, b, label, labels),
        None => TableSpec::single(format, a, label, labels),
    })
}

/// The examples of one file of a file source; `labels` as in [`file_spec`].
fn load_file(cfg: &DataConfig, path: &Path, labels: Labels) -> Result<LoadedSet> {
    match (cfg.source, table_format(cfg.source)) {
        (DataSource::Mnli, _) => Ok(load_table(path, &TableSpec::mnli())?),
        (_, Some(format)) => Ok(load_table(path, &file_spec(cfg, format, labels)?)?),
        (other, None) => {
            Err(ConfigError::new("data.source", format!("`{other}` does not read files")).into())
        }
    }
}

/// The configured source's labelled examples: a training set, and its own validation set
/// when the source has one (TREC's test split, a `data.valid` file).
fn load_sets(cfg: &DataConfig) -> Result<(LoadedSet, Option<LoadedSet>)> {
    let cache = cache_dir(cfg);
    Ok(match cfg.source {
        DataSource::Reviews => {
            let label = match cfg.label.as_deref().unwrap_or("recommended") {
                "recommended" => ReviewLabel::Recommended,
                "rating" => ReviewLabel::Rating,
                other => {
                    return Err(ConfigError::new(
                        "data.label",
                        format!(
                            "`{other}` is not a review label (expected `recommended` or `rating`)"
                        ),
                    )
                    .into())
                }
            };
            (load_reviews(&fetch("reviews", &cache)?, label)?, None)
        }
        DataSource::MovieSnippets => (
            load_table(
                &fetch("movie-snippets", &cache)?,
                &TableSpec::movie_snippets(),
            )?,
            None,
        ),
        DataSource::Trec => {
            // Rows 0-5451 are TREC's training set, the rest its test set.
            let mut all = load_table(&fetch("trec", &cache)?, &TableSpec::trec_coarse())?;
            let test = all.examples.split_off(all.examples.len().min(5452));
            let names = all.label_names.clone();
            (
                all,
                Some(LoadedSet {
                    examples: test,
                    label_names: names,
                    dropped: 0,
                }),
            )
        }
        DataSource::Corpus => {
            return Err(ConfigError::new(
                "data.source",
                "`corpus` is a masked-LM corpus, not labelled examples",
            )
            .into())
        }
        DataSource::Mnli
        | DataSource::Tsv
        | DataSource::Csv
        | DataSource::Jsonl
        | DataSource::Parquet => {
            let train_path = required(&cfg.train, "train", cfg.source)?;
            if let Some(sha) = &cfg.train_sha256 {
                crate::inputs::check_sha256(train_path, sha, "data.train_sha256")?;
            }
            if let (Some(p), Some(sha)) = (&cfg.valid, &cfg.valid_sha256) {
                crate::inputs::check_sha256(p, sha, "data.valid_sha256")?;
            }
            // Without `data.labels` the training file's values are the labels (sorted); the
            // validation file must use the same ones.
            let labels = cfg.labels.clone().map_or(Labels::FromData, Labels::Names);
            let train = load_file(cfg, train_path, labels)?;
            let valid = cfg
                .valid
                .as_ref()
                .map(|p| load_file(cfg, p, Labels::Names(train.label_names.clone())))
                .transpose()?;
            (train, valid)
        }
    })
}

/// Loads, splits and tokenises the configured data.
pub fn prepare(cfg: &DataConfig, seq_len: usize, seed: u64) -> Result<PreparedData> {
    let mut data = resolve_columns(cfg)?;
    let cfg = &data;
    let (train_set, valid_set) = load_sets(cfg)?;
    if train_set.label_names.len() < 2 && !train_set.examples.is_empty() {
        return Err(ConfigError::new(
            "data.label",
            format!(
                "the training data has one label only ({:?}); a classifier needs at least 2",
                train_set.label_names
            ),
        )
        .into());
    }
    let label_names = label_names(cfg, &train_set.label_names)?;
    let train_set_labels = train_set.label_names.clone();
    let dropped = train_set.dropped + valid_set.as_ref().map_or(0, |v| v.dropped);
    let (mut train, mut valid): (Vec<Example>, Vec<Example>) = match valid_set {
        Some(v) => (train_set.examples, v.examples),
        None => train_valid_split(train_set.examples, cfg.valid_fraction, seed),
    };
    if cfg.max_train > 0 {
        train.truncate(cfg.max_train);
    }
    if cfg.max_valid > 0 {
        valid.truncate(cfg.max_valid);
    }
    if train.is_empty() {
        return Err(Error::data(format!(
            "data: no training examples (source `{}`)",
            cfg.source
        )));
    }
    if valid.is_empty() {
        return Err(Error::data(
            "data: no validation examples (set data.valid or a positive data.valid_fraction)",
        ));
    }
    let pair = train.iter().any(|e| e.text_b.is_some());
    let vocab = vocab_path(cfg)?;
    let tokenizer = BertTokenizer::from_vocab_file(&vocab)
        .map_err(|e| Error::data_with(format!("data.vocab: {}", vocab.display()), e))?;
    let train_enc = EncodedDataset::encode(&tokenizer, &train, seq_len)?;
    let valid_enc = EncodedDataset::encode(&tokenizer, &valid, seq_len)?;
    let columns = match (&cfg.text_a, &cfg.text_b, &cfg.label) {
        (Some(a), b, Some(l)) if cfg.source.reads_files() => format!(
            " (text `{a}`{}, label `{l}`)",
            b.as_ref().map_or(String::new(), |b| format!(" + `{b}`"))
        ),
        _ => String::new(),
    };
    let summary = format!(
        "{}{columns}: {} train / {} valid examples, {} labels {:?}{}, {} rows without text dropped, {} train examples truncated to {seq_len} tokens",
        cfg.source,
        train_enc.len(),
        valid_enc.len(),
        label_names.len(),
        label_names,
        if cfg.labels.is_none() && cfg.source.reads_files() { " (from the data)" } else { "" },
        dropped,
        train_enc.truncated
    );
    record_inputs(&mut data, train_set_labels)?;
    Ok(PreparedData {
        data,
        tokenizer,
        vocab,
        train: train_enc,
        valid: valid_enc,
        label_names,
        pair,
        summary,
    })
}

/// The names the labels are shown by: `data.label_names`, one for each label found (`found`),
/// or the labels themselves.
fn label_names(cfg: &DataConfig, found: &[String]) -> Result<Vec<String>> {
    match &cfg.label_names {
        Some(names) if names.len() != found.len() => Err(ConfigError::new(
            "data.label_names",
            format!(
                "{} names for the {} labels of source `{}` ({:?})",
                names.len(),
                found.len(),
                cfg.source,
                found
            ),
        )
        .into()),
        Some(names) => Ok(names.clone()),
        None => Ok(found.to_vec()),
    }
}

/// What the run records of a file source: the labels it read (`found`) and the files'
/// digests, so that a file that changes under a stopped run is refused when it resumes.
fn record_inputs(data: &mut DataConfig, found: Vec<String>) -> Result<()> {
    if !data.source.reads_files() {
        return Ok(());
    }
    if data.source != DataSource::Mnli && data.labels.is_none() {
        data.labels = Some(found);
    }
    if let (None, Some(p)) = (&data.train_sha256, &data.train) {
        data.train_sha256 = Some(crate::inputs::sha256_file(p)?);
    }
    if let (None, Some(p)) = (&data.valid_sha256, &data.valid) {
        data.valid_sha256 = Some(crate::inputs::sha256_file(p)?);
    }
    Ok(())
}

/// Masked-LM data: a corpus, its tokenizer and masker, packed per sequence length on demand
/// (pre-training phases may change the length).
pub struct CorpusData {
    pub tokenizer: CorpusTokenizer,
    pub masker: MlmMasker,
    /// The vocabulary file (for the model's metadata).
    pub vocab: PathBuf,
    corpus: Corpus,
    pack: PackConfig,
    max_train: usize,
    max_valid: usize,
    packed: Vec<(usize, PackedCorpus)>,
    /// Where packed blocks are cached (`<cache>/corpus`).
    cache: PathBuf,
}

impl CorpusData {
    /// Resolves the sources and loads the tokenizer; nothing is read from the corpus yet.
    pub fn new(cfg: &DataConfig, seed: u64) -> Result<CorpusData> {
        let cache = cache_dir(cfg);
        let kind = cfg
            .tokenizer
            .parse::<TokenizerKind>()
            .map_err(|e| ConfigError::new("data.tokenizer", e.to_string()))?;
        let (tokenizer, vocab) = match (kind, &cfg.vocab) {
            (TokenizerKind::WordPiece, Some(v)) => (
                CorpusTokenizer::WordPiece(
                    BertTokenizer::from_vocab_file(v)
                        .map_err(|e| Error::data_with(format!("data.vocab: {}", v.display()), e))?,
                ),
                v.clone(),
            ),
            (TokenizerKind::WordPiece, None) => {
                let v = fetch("bert-vocab", &cache)?;
                (CorpusTokenizer::fetch(kind, &cache)?, v)
            }
            (TokenizerKind::Gpt2Bpe, _) => {
                let v = fetch("gpt2-vocab", &cache)?;
                (CorpusTokenizer::fetch(kind, &cache)?, v)
            }
        };
        let docs = match cfg.text_docs.as_str() {
            "lines" => TextDocs::Lines,
            "paragraphs" => TextDocs::Paragraphs,
            "wiki" => TextDocs::WikiArticles,
            "file" => TextDocs::WholeFile,
            other => {
                return Err(ConfigError::new(
                    "data.text_docs",
                    format!("`{other}` is not one of lines, paragraphs, wiki, file"),
                )
                .into())
            }
        };
        let exts: Vec<&str> = cfg.extensions.iter().map(String::as_str).collect();
        let mut corpus = Corpus::new();
        for (i, src) in cfg.corpus.iter().enumerate() {
            let p = PathBuf::from(src);
            let path = if p.exists() {
                p
            } else if comera_data::fetch::data_set(src).is_some()
                || comera_data::debian::debian_set(src).is_some()
            {
                fetch(src, &cache)?
            } else {
                return Err(ConfigError::new(
                    format!("data.corpus[{i}]"),
                    format!("`{src}` is neither an existing path nor a data set `comera data list` knows"),
                )
                .into());
            };
            corpus = if path.is_dir() {
                corpus.code_dir(path, &exts)
            } else {
                corpus.text_file(path, docs)
            };
        }
        let masker = MlmMasker::for_tokenizer(
            MlmConfig {
                select_prob: cfg.select_prob,
                mask_prob: cfg.mask_prob,
                random_prob: cfg.random_prob,
            },
            &tokenizer,
        );
        let mut pack = PackConfig::new(128);
        pack.valid_fraction = cfg.valid_fraction;
        pack.split_seed = seed;
        Ok(CorpusData {
            tokenizer,
            masker,
            vocab,
            corpus,
            pack,
            max_train: cfg.max_train,
            max_valid: cfg.max_valid,
            packed: Vec::new(),
            cache: cache.join("corpus"),
        })
    }

    /// The corpus packed into blocks of `seq_len` (read and tokenised on first use, saying
    /// so on stderr: for the commands that evaluate a saved run).
    pub fn packed(&mut self, seq_len: usize) -> Result<&PackedCorpus> {
        self.pack(&[seq_len], &mut |m| eprintln!("{m}"))?;
        Ok(self.packed_ref(seq_len))
    }

    /// Packs the corpus into blocks of each of `seq_lens` not packed yet: from the on-disk
    /// cache when it holds them, otherwise in one pass over the corpus (one tokenisation for
    /// every length, with progress on stderr), then cached.
    ///
    /// The cache (`<cache_dir>/corpus/<key>-<seq_len>.{train,valid}` and `.stats.json`) is
    /// keyed by a hash of the corpus' files (paths, sizes, modification times), the tokenizer
    /// and its vocabulary file, the split (held-out fraction, seed) and the format, so a
    /// changed file, tokenizer or split tokenises anew. A damaged entry is re-made.
    ///
    /// What it does (cache hits, tokenising progress every 5 s, the blocks made) is told to
    /// `say`, line by line.
    pub fn pack(&mut self, seq_lens: &[usize], say: &mut dyn FnMut(String)) -> Result<()> {
        let mut missing: Vec<usize> = Vec::new();
        for &t in seq_lens {
            if !missing.contains(&t) && !self.packed.iter().any(|(l, _)| *l == t) {
                missing.push(t);
            }
        }
        if missing.is_empty() {
            return Ok(());
        }
        let key = self.cache_key()?;
        let entry = |t: usize, part: &str| self.cache.join(format!("{key}-{t}.{part}"));
        let mut made = Vec::new();
        missing.retain(|&t| {
            match load_cached(
                &entry(t, "train"),
                &entry(t, "valid"),
                &entry(t, "stats.json"),
            ) {
                Some(p) => {
                    say(format!(
                        "data  corpus blocks of {t} tokens from the cache ({}), tokenised earlier",
                        entry(t, "*").display()
                    ));
                    made.push((t, p));
                    false
                }
                None => true,
            }
        });
        if !missing.is_empty() {
            let t0 = std::time::Instant::now();
            let mut last = t0;
            let mut progress = |st: &CorpusStats| {
                if last.elapsed().as_secs_f64() >= 5.0 {
                    last = std::time::Instant::now();
                    say(format!(
                        "data  tokenising the corpus: {} files, {} documents, {:.1} MB read ({:.0} s)",
                        st.files,
                        st.documents,
                        st.bytes as f64 / 1e6,
                        t0.elapsed().as_secs_f64()
                    ));
                }
            };
            let packs = pack_corpus_lengths(
                &self.corpus,
                &self.tokenizer,
                &self.pack,
                &missing,
                &mut progress,
            )?;
            say(format!(
                "data  tokenised in {:.1} s; cached in {}",
                t0.elapsed().as_secs_f64(),
                self.cache.display()
            ));
            for (&t, p) in missing.iter().zip(packs) {
                if let Err(e) = save_cached(
                    &p,
                    &entry(t, "train"),
                    &entry(t, "valid"),
                    &entry(t, "stats.json"),
                ) {
                    say(format!(
                        "warning: corpus cache not written: {}",
                        crate::error::Chain(&e)
                    ));
                }
                made.push((t, p));
            }
        }
        for (t, p) in made {
            self.finish_pack(t, p, say)?;
        }
        Ok(())
    }

    /// The cache key: format, tokenizer, vocabulary, corpus fingerprint, split.
    fn cache_key(&self) -> Result<String> {
        let vocab = comera_data::regular::read_regular(&self.vocab)
            .io(&self.vocab, "cannot read the vocabulary")?;
        let kind = match &self.tokenizer {
            CorpusTokenizer::WordPiece(_) => "wordpiece",
            CorpusTokenizer::Bpe(_) => "bpe",
        };
        let text = format!(
            "comera corpus cache 1\0{kind}\0{}\0{}\0{}\0{}\0{}",
            crate::run_dir::sha256_hex(&String::from_utf8_lossy(&vocab)),
            self.corpus.fingerprint()?,
            self.pack.valid_fraction,
            self.pack.split_seed,
            self.pack.keep_partial
        );
        Ok(crate::run_dir::sha256_hex(&text)[..24].to_string())
    }

    /// Applies `max_train`/`max_valid`, checks that both splits have blocks, reports and keeps
    /// the blocks of length `seq_len`.
    fn finish_pack(
        &mut self,
        seq_len: usize,
        mut p: PackedCorpus,
        say: &mut dyn FnMut(String),
    ) -> Result<()> {
        for (set, max) in [
            (&mut p.train, self.max_train),
            (&mut p.valid, self.max_valid),
        ] {
            if max > 0 && set.len() > max {
                set.input_ids.truncate(max * seq_len);
                let sp = set.special;
                set.tokens = set
                    .input_ids
                    .iter()
                    .filter(|&&i| i != sp.pad && i != sp.cls && i != sp.sep)
                    .count() as u64;
            }
        }
        if p.train.is_empty() {
            return Err(Error::data(format!(
                "data.corpus: no training blocks of {seq_len} tokens in {:?}",
                self.corpus.sources
            )));
        }
        if p.valid.is_empty() {
            return Err(Error::data(format!("data.valid_fraction: no held-out block of {seq_len} tokens (raise the fraction or add documents)")));
        }
        let s = &p.stats;
        say(format!(
            "data  corpus, {} files, {} documents ({} skipped files, {} skipped lines): seq_len {seq_len}, {} train blocks ({} tokens), {} held-out blocks ({} tokens)",
            s.files,
            s.documents,
            s.skipped_files,
            s.skipped_lines,
            p.train.len(),
            p.train.tokens,
            p.valid.len(),
            p.valid.tokens
        ));
        self.packed.push((seq_len, p));
        Ok(())
    }
}

/// A cached packed corpus, or None when any part is missing or damaged.
fn load_cached(train: &Path, valid: &Path, stats: &Path) -> Option<PackedCorpus> {
    let s: serde_json::Value =
        serde_json::from_str(&comera_data::regular::read_regular_to_string(stats).ok()?).ok()?;
    let n = |k: &str| s[k].as_u64();
    let stats = CorpusStats {
        files: n("files")? as usize,
        documents: n("documents")? as usize,
        bytes: n("bytes")?,
        skipped_files: n("skipped_files")? as usize,
        skipped_lines: n("skipped_lines")? as usize,
        ..CorpusStats::default()
    };
    Some(PackedCorpus {
        train: PackedSequences::load(train).ok()?,
        valid: PackedSequences::load(valid).ok()?,
        stats,
    })
}

/// Writes a packed corpus to the cache (each file atomically; the stats last, so a complete
/// stats file means complete blocks).
fn save_cached(p: &PackedCorpus, train: &Path, valid: &Path, stats: &Path) -> Result<()> {
    if let Some(dir) = train.parent() {
        std::fs::create_dir_all(dir).io(dir, "cannot create")?;
    }
    p.train.save(train)?;
    p.valid.save(valid)?;
    let s = &p.stats;
    let json = serde_json::json!({"files": s.files, "documents": s.documents, "bytes": s.bytes, "skipped_files": s.skipped_files, "skipped_lines": s.skipped_lines});
    Ok(crate::files::write_atomic(
        stats,
        json.to_string().as_bytes(),
    )?)
}

impl CorpusData {
    /// The blocks of a sequence length already packed by [`CorpusData::packed`]; panics
    /// otherwise (a bug in the caller).
    pub fn packed_ref(&self, seq_len: usize) -> &PackedCorpus {
        &self
            .packed
            .iter()
            .find(|(l, _)| *l == seq_len)
            .unwrap_or_else(|| panic!("corpus not packed for seq_len {seq_len}"))
            .1
    }
}
