//! The integration tests of this crate as one test binary, a module a file: one link of
//! the engine instead of one a file (each test binary links the whole engine).

mod config_doc;
mod rank;
mod step;
