//! Tensor and layout primitives of the comera engine.
//!
//! Everything here works on flat, row-major `f32` buffers owned by the caller:
//! - [`gemm`]: the single matrix-multiply entry point (backend chosen by benchmark, hidden here);
//! - [`layout`]: tensor-train shapes (modes, ranks) with the checks every layer relies on;
//! - [`factor`]: proposing factorisations and ranks for a layer of a given size;
//! - [`ttsvd`]: TT-SVD, tensor-train (and TTM embedding) cores from a dense tensor, with a
//!   rank cap or an error target, and the reconstruction back;
//! - [`math`]: element-wise functions that vectorise (`exp`);
//! - `narrow`: AVX-512 kernels for tall products at most 16 columns wide (behind [`gemm`]);
//! - `wide`: an AVX-512 kernel for short, wide products whose output is streamed to memory
//!   (behind [`gemm::matmul_serial_streamed`]);
//! - [`permute`]: axis permutations of dense tensors (strided copies);
//! - [`simd`]: the run-time instruction-set choice of element-wise kernels ([`multiversion!`]);
//! - [`init`]: seeded, reproducible random initialisation;
//! - [`join()`]: `rayon::join` whose caller spins rather than sleeps while it waits.
//!
//! A dense 16 × 16 weight that is a TT matrix of rank 3 over in modes `[4, 4]` and out modes
//! `[4, 4]` comes back from TT-SVD with those ranks and reconstructs to rounding:
//!
//! ```
//! use comera_tensor::ttsvd::{rel_error, tt_matrix_svd, tt_reconstruct, TtSvdOptions};
//! use comera_tensor::{init, TtShape};
//!
//! let shape = TtShape::uniform(&[4, 4], &[4, 4], 3)?;
//! let modes: Vec<usize> = (0..shape.n_cores()).map(|k| shape.mode(k)).collect();
//! // Random cores of that layout, multiplied out to the dense 16 × 16 weight.
//! let mut rng = init::rng(7);
//! let cores: Vec<Vec<f32>> = (0..shape.n_cores())
//!     .map(|k| {
//!         let mut c = vec![0.0; shape.core_len(k)];
//!         init::fill_normal(&mut rng, &mut c, 1.0);
//!         c
//!     })
//!     .collect();
//! let w = tt_reconstruct(&cores, &modes, shape.ranks());
//! assert_eq!(w.len(), 16 * 16);
//!
//! let tt = tt_matrix_svd(&w, &[4, 4], &[4, 4], &TtSvdOptions::rank(3))?;
//! assert_eq!(tt.ranks, [1, 3, 3, 3, 1]);
//! let back = tt_reconstruct(&tt.cores, &tt.modes, &tt.ranks);
//! assert!(rel_error(&back, &w) < 1e-5);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

// Every unsafe operation inside an `unsafe fn` sits in its own `unsafe {}` block with a
// `// SAFETY:` comment.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod factor;
pub mod gemm;
pub mod init;
mod join;
pub mod layout;
pub mod math;
mod narrow;
mod outer_sum;
pub mod permute;
pub mod simd;
pub mod ttsvd;
mod wide;

pub use gemm::{
    matmul, matmul_row_pieces, matmul_serial, matmul_serial_streamed, DisjointMut, MatMut, MatRef,
};
pub use join::{for_each, for_each_claimed, join};
pub use layout::{ShapeError, TtShape, TtmShape};
