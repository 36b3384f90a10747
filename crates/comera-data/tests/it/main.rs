//! The integration tests of this crate as one test binary, a module a file: one link of
//! the engine instead of one a file (each test binary links the whole engine).

mod bpe;
mod corpus;
mod dataset;
mod debian;
mod errors;
mod loaders;
mod mlm;
mod real_data;
mod tokenizer;
