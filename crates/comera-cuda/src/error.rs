//! What can go wrong when comera opens a GPU, compiles its kernels or plans its buffers.
//!
//! Every message names what is missing and what to do about it; the CLI prints it and exits
//! with status 2 before anything is written to the run directory.

use crate::compile::Arch;

/// The oldest driver comera runs on: the CUDA version `cuDriverGetVersion` reports
/// (1000·major + 10·minor). The bindings are CUDA 13.0's, and the kernels are compiled by an
/// NVRTC of the 13.x line, whose machine code a 13.0 driver (R580) loads.
pub const MIN_DRIVER_VERSION: i32 = 13000;

/// `13000` → `13.0`.
pub fn cuda_version_string(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// A CUDA device could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "no NVIDIA driver found (the CUDA driver library libcuda.so could not be loaded): \
         install the NVIDIA driver (R580 or newer, for CUDA {min}), check that `nvidia-smi` \
         works, or run on the CPU (`--device cpu`)",
        min = cuda_version_string(MIN_DRIVER_VERSION)
    )]
    NoDriver,

    #[error(
        "the NVIDIA driver supports CUDA {found} but comera needs CUDA {min} or newer: update \
         the NVIDIA driver to R580 or newer, or run on the CPU (`--device cpu`)",
        found = cuda_version_string(*.found),
        min = cuda_version_string(MIN_DRIVER_VERSION)
    )]
    DriverTooOld { found: i32 },

    #[error(
        "the NVIDIA driver found no CUDA device: check `nvidia-smi` and CUDA_VISIBLE_DEVICES, \
         or run on the CPU (`--device cpu`)"
    )]
    NoDevice,

    #[error(
        "CUDA device {ordinal} does not exist: this machine has {count} ({available}); pick \
         one with `--device cuda:N` (check CUDA_VISIBLE_DEVICES)",
        available = if *.count == 1 { "only cuda:0".to_string() } else { format!("cuda:0 to cuda:{}", .count - 1) }
    )]
    OrdinalOutOfRange { ordinal: usize, count: usize },

    #[error(
        "NVRTC, the CUDA runtime compiler comera builds its kernels with (libnvrtc.so.13), could \
         not be loaded: install it (`pip install nvidia-cuda-nvrtc==13.0.*` and add its \
         `nvidia/cu13/lib` folder to LD_LIBRARY_PATH, or install the CUDA 13 toolkit), or run \
         on the CPU (`--device cpu`)"
    )]
    NoNvrtc,

    #[error(
        "NVRTC {found} is too old: comera's kernels need NVRTC 13.0 or newer (\
         `pip install nvidia-cuda-nvrtc==13.0.*`, its `nvidia/cu13/lib` on LD_LIBRARY_PATH), or \
         run on the CPU (`--device cpu`)",
        found = format!("{}.{}", .found.0, .found.1)
    )]
    NvrtcTooOld { found: (i32, i32) },

    #[error(
        "cuBLAS (libcublas.so.13) could not be loaded: install it (`pip install \
         nvidia-cublas==13.0.*` and add its lib folder to LD_LIBRARY_PATH, or install the CUDA 13 \
         toolkit), or run on the CPU (`--device cpu`)"
    )]
    NoCublas,

    #[error("kernel source `{kernel}` failed to compile for {arch} (a bug in comera: please report it with this log):\n{log}")]
    KernelCompile {
        kernel: &'static str,
        arch: Arch,
        log: String,
    },

    #[error(
        "not enough GPU memory on cuda:{ordinal} for {what}: it needs about {need} but {free} \
         of {total} are free; lower the batch size, use a smaller model, free the GPU (see \
         `nvidia-smi`) or run on the CPU (`--device cpu`)",
        need = mib(*.needed), free = mib(*.free), total = mib(*.total)
    )]
    OutOfMemory {
        ordinal: usize,
        what: String,
        needed: usize,
        free: usize,
        total: usize,
    },

    #[error("device buffer `{name}` holds {got} elements, the operation needs {expected}")]
    Shape {
        name: &'static str,
        expected: usize,
        got: usize,
    },

    #[error("the device plan: {0}")]
    Plan(String),

    #[error("a CUDA graph capture recorded no work (a bug in comera: please report it)")]
    NothingCaptured,

    #[error("CUDA driver call failed ({context}): {source}")]
    Driver {
        context: &'static str,
        #[source]
        source: cudarc::driver::DriverError,
    },

    #[error("NVRTC call failed ({context}): {source}")]
    Nvrtc {
        context: &'static str,
        #[source]
        source: cudarc::nvrtc::result::NvrtcError,
    },

    #[error("cuBLAS call failed ({context}): {source}")]
    Cublas {
        context: &'static str,
        #[source]
        source: cudarc::cublas::result::CublasError,
    },
}

/// Bytes as MiB with one decimal.
fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

/// `.map_err(driver("what"))`: a driver error with what was being done.
pub(crate) fn driver(
    context: &'static str,
) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    move |source| CudaError::Driver { context, source }
}

/// `.map_err(nvrtc("what"))`.
pub(crate) fn nvrtc(
    context: &'static str,
) -> impl FnOnce(cudarc::nvrtc::result::NvrtcError) -> CudaError {
    move |source| CudaError::Nvrtc { context, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_what_is_missing_and_what_to_do() {
        let too_old = CudaError::DriverTooOld { found: 12040 }.to_string();
        assert!(
            too_old.contains("CUDA 12.4") && too_old.contains("CUDA 13.0"),
            "{too_old}"
        );
        assert!(too_old.contains("update the NVIDIA driver"), "{too_old}");
        let range = CudaError::OrdinalOutOfRange {
            ordinal: 3,
            count: 2,
        }
        .to_string();
        assert!(
            range.contains("device 3") && range.contains("cuda:0 to cuda:1"),
            "{range}"
        );
        let one = CudaError::OrdinalOutOfRange {
            ordinal: 1,
            count: 1,
        }
        .to_string();
        assert!(one.contains("only cuda:0"), "{one}");
        let oom = CudaError::OutOfMemory {
            ordinal: 0,
            what: "the paper model at batch 32".into(),
            needed: 3 << 30,
            free: 1 << 30,
            total: 2 << 30,
        }
        .to_string();
        assert!(
            oom.contains("3072.0 MiB") && oom.contains("1024.0 MiB of 2048.0 MiB"),
            "{oom}"
        );
        assert!(oom.contains("lower the batch size"), "{oom}");
        assert!(CudaError::NoDriver.to_string().contains("libcuda.so"));
        assert!(CudaError::NoNvrtc.to_string().contains("nvidia-cuda-nvrtc"));
        let compile = CudaError::KernelCompile {
            kernel: "layernorm.cu",
            arch: Arch::SM90,
            log: "layernorm.cu(3): error: expected a \";\"".into(),
        }
        .to_string();
        assert!(
            compile.contains("layernorm.cu")
                && compile.contains("sm_90")
                && compile.contains("expected"),
            "{compile}"
        );
    }
}
