//! The integration tests of this crate as one test binary, a module a file: one link of
//! the engine instead of one a file (each test binary links the whole engine).

mod bounds;
mod cli;
mod common;
mod device;
mod distill;
mod dlrm;
mod hf;
mod import;
mod mlm;
mod outputs;
mod own_data;
mod report;
mod safety;
mod train;
mod trust;
mod untrusted;
