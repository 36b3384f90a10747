//! Turning a `[data]` table into tokenised, fixed-length training and validation sets.

use crate::config::DataConfig;
use anyhow::{anyhow, bail, Context};
use comera_data::{
    default_cache_dir, fetch, load_parquet, load_reviews, load_table, train_valid_split,
    BertTokenizer, Delimited, EncodedDataset, Example, Labels, LoadedSet, ReviewLabel, TableSpec,
};
use std::path::{Path, PathBuf};

/// Tokenised data ready for training.
pub struct PreparedData {
    pub tokenizer: BertTokenizer,
    pub vocab: PathBuf,
    pub train: EncodedDataset,
    pub valid: EncodedDataset,
    pub label_names: Vec<String>,
    pub pair: bool,
    /// A one-line description for the log.
    pub summary: String,
}

fn cache_dir(cfg: &DataConfig) -> PathBuf {
    cfg.cache_dir.clone().unwrap_or_else(default_cache_dir)
}

/// The vocabulary file: the configured one, or the fetched BERT uncased vocab.
pub fn vocab_path(cfg: &DataConfig) -> anyhow::Result<PathBuf> {
    match &cfg.vocab {
        Some(p) => Ok(p.clone()),
        None => Ok(fetch("bert-vocab", &cache_dir(cfg))?),
    }
}

fn required<'a, T>(v: &'a Option<T>, field: &str, source: &str) -> anyhow::Result<&'a T> {
    v.as_ref()
        .ok_or_else(|| anyhow!("data.{field}: required for source `{source}`"))
}

fn file_spec(cfg: &DataConfig, format: Delimited) -> anyhow::Result<TableSpec> {
    let src = &cfg.source;
    let a = required(&cfg.text_a, "text_a", src)?;
    let label = required(&cfg.label, "label", src)?;
    let names = required(&cfg.labels, "labels", src)?;
    let labels = Labels::Names(names.clone());
    Ok(match &cfg.text_b {
        Some(b) => TableSpec::pair(format, a, b, label, labels),
        None => TableSpec::single(format, a, label, labels),
    })
}

fn load_file(cfg: &DataConfig, path: &Path) -> anyhow::Result<LoadedSet> {
    Ok(match cfg.source.as_str() {
        "mnli" => load_table(path, &TableSpec::mnli())?,
        "tsv" => load_table(path, &file_spec(cfg, Delimited::Tsv)?)?,
        "csv" => load_table(path, &file_spec(cfg, Delimited::Csv)?)?,
        "parquet" => {
            let src = &cfg.source;
            let names = required(&cfg.labels, "labels", src)?;
            load_parquet(
                path,
                required(&cfg.text_a, "text_a", src)?,
                required(&cfg.label, "label", src)?,
                &Labels::Names(names.clone()),
            )?
        }
        other => bail!("data.source: `{other}` does not read files"),
    })
}

/// Loads, splits and tokenises the configured data.
pub fn prepare(cfg: &DataConfig, seq_len: usize, seed: u64) -> anyhow::Result<PreparedData> {
    let cache = cache_dir(cfg);
    let (train_set, valid_set): (LoadedSet, Option<LoadedSet>) = match cfg.source.as_str() {
        "reviews" => {
            let label = match cfg.label.as_deref().unwrap_or("recommended") {
                "recommended" => ReviewLabel::Recommended,
                "rating" => ReviewLabel::Rating,
                other => bail!("data.label: `{other}` is not a review label (expected `recommended` or `rating`)"),
            };
            (load_reviews(&fetch("reviews", &cache)?, label)?, None)
        }
        "movie-snippets" => (
            load_table(
                &fetch("movie-snippets", &cache)?,
                &TableSpec::movie_snippets(),
            )?,
            None,
        ),
        "trec" => {
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
        _ => {
            let train_path = required(&cfg.train, "train", &cfg.source)?;
            let train = load_file(cfg, train_path)?;
            let valid = cfg.valid.as_ref().map(|p| load_file(cfg, p)).transpose()?;
            (train, valid)
        }
    };
    let label_names = train_set.label_names.clone();
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
        bail!("data: no training examples (source `{}`)", cfg.source);
    }
    if valid.is_empty() {
        bail!("data: no validation examples (set data.valid or a positive data.valid_fraction)");
    }
    let pair = train.iter().any(|e| e.text_b.is_some());
    let vocab = vocab_path(cfg)?;
    let tokenizer = BertTokenizer::from_vocab_file(&vocab)
        .with_context(|| format!("data.vocab: {}", vocab.display()))?;
    let train_enc = EncodedDataset::encode(&tokenizer, &train, seq_len)?;
    let valid_enc = EncodedDataset::encode(&tokenizer, &valid, seq_len)?;
    let summary = format!(
        "{}: {} train / {} valid examples, {} labels, {} rows without text dropped, {} train examples truncated to {seq_len} tokens",
        cfg.source,
        train_enc.len(),
        valid_enc.len(),
        label_names.len(),
        dropped,
        train_enc.truncated
    );
    Ok(PreparedData {
        tokenizer,
        vocab,
        train: train_enc,
        valid: valid_enc,
        label_names,
        pair,
        summary,
    })
}
