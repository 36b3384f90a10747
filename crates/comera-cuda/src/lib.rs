//! comera's CUDA device, and only that: the driver, cuBLAS and NVRTC loaded at run time
//! (cudarc's dynamic loading, so the crate and its tests build and pass on a machine with no
//! GPU, no driver and no CUDA toolkit), the training step's non-GEMM kernels in CUDA C
//! (`kernels/*.cu`, compiled by NVRTC when a device is opened), typed launches over device
//! buffers, and the errors a user can meet on the way.
//!
//! - [`spec`]: [`DeviceSpec`], the `cpu` / `cuda` / `cuda:N` device string. Always compiled:
//!   with `default-features = false` the crate is only this, without cudarc.
//! - `compile` (feature `cuda`): the kernel sources and their NVRTC compilation to machine code.
//! - `device`: the probe (driver, version, device), [`Device::open`], the memory check.
//! - `ops`: one typed launch per kernel, shapes checked on the host.
//! - `error`: [`CudaError`], a message per failure that says what to do.
//!
//! - `bench` (feature `cuda`): the device step benchmark (`comera bench step --device cuda`).
//! - `engine` (feature `cuda`): the classifier encoder's whole training step on device
//!   buffers (`EncoderPlan`), capturable as one CUDA graph, and the seam the loop will call
//!   (`EncoderSession`).
//!
//! Status: the kernels compile (CI compiles each for sm_80 and sm_90); the engine's step is
//! written and compiles. Their correctness tests against the CPU engine and the step
//! benchmark run wherever a GPU is present and have not run yet (see `docs/gpu.md`).

pub mod spec;
pub use spec::{DeviceSpec, ParseDeviceError};

#[cfg(feature = "cuda")]
pub mod bench;
#[cfg(feature = "cuda")]
pub mod compile;
#[cfg(feature = "cuda")]
pub mod device;
#[cfg(feature = "cuda")]
pub mod engine;
#[cfg(feature = "cuda")]
pub mod error;
#[cfg(feature = "cuda")]
pub mod ops;

#[cfg(feature = "cuda")]
pub use compile::{Arch, KernelSource, SOURCES};
#[cfg(feature = "cuda")]
pub use cudarc;
#[cfg(feature = "cuda")]
pub use device::{probe, survey, Device, DeviceInfo, GpuEntry, Survey};
#[cfg(feature = "cuda")]
pub use error::CudaError;
