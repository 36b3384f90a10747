//! Tensor and layout primitives of the comera engine.
//!
//! Everything here works on flat, row-major `f32` buffers owned by the caller:
//! - [`gemm`]: the single matrix-multiply entry point (backend chosen by benchmark, hidden here);
//! - [`layout`]: tensor-train shapes (modes, ranks) with the checks every layer relies on;
//! - [`factor`]: proposing factorisations and ranks for a layer of a given size;
//! - [`math`]: element-wise functions that vectorise (`exp`);
//! - `narrow`: AVX-512 kernels for tall products at most 16 columns wide (behind [`gemm`]);
//! - [`permute`]: axis permutations of dense tensors (strided copies);
//! - [`simd`]: the run-time instruction-set choice of element-wise kernels ([`multiversion!`]);
//! - [`init`]: seeded, reproducible random initialisation.

pub mod factor;
pub mod gemm;
pub mod init;
pub mod layout;
pub mod math;
mod narrow;
pub mod permute;
pub mod simd;
pub mod ttsvd;

pub use gemm::{matmul, matmul_serial, DisjointMut, MatMut, MatRef};
pub use layout::{ShapeError, TtShape, TtmShape};
