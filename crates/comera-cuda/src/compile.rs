//! The kernel sources and their compilation by NVRTC into machine code (CUBIN) for one GPU
//! architecture.
//!
//! Machine code, not PTX: PTX from an NVRTC newer than the driver does not load (the driver
//! JIT-compiles PTX and refuses a newer PTX version), while a CUBIN for the GPU's own
//! architecture from any 13.x NVRTC loads on a 13.0 driver. NVRTC runs once when the device is
//! opened (all sources, well under a second per source on a recent CPU; not measured here).
//!
//! Options: `--fmad=false` (a·b + c is two roundings, as on the CPU engine; the kernels write
//! `fmaf` where the CPU code uses `mul_add`), IEEE division and square root (NVRTC's default),
//! no fast math.

use crate::error::{nvrtc, CudaError};
use cudarc::nvrtc::{result, sys};
use std::ffi::{c_char, CString};
use std::fmt;

/// A GPU architecture, `sm_{major}{minor}`: the compute capability the machine code is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Arch {
    pub major: u32,
    pub minor: u32,
}

impl Arch {
    /// A100 (Ampere).
    pub const SM80: Arch = Arch { major: 8, minor: 0 };
    /// H100 / H200 (Hopper).
    pub const SM90: Arch = Arch { major: 9, minor: 0 };
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// One `.cu` file: its name, its text and the kernels (`extern "C"` functions) it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    pub name: &'static str,
    pub source: &'static str,
    pub kernels: &'static [&'static str],
}

/// Prepended to every source (block reductions, the integer types).
pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// Every kernel source of the engine. CI compiles each for [`Arch::SM80`] and [`Arch::SM90`].
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        name: "layernorm.cu",
        source: include_str!("../kernels/layernorm.cu"),
        kernels: &[
            "layer_norm_forward",
            "layer_norm_backward_dx",
            "layer_norm_param_partials",
        ],
    },
    KernelSource {
        name: "elementwise.cu",
        source: include_str!("../kernels/elementwise.cu"),
        kernels: &[
            "add",
            "add_into",
            "add_bias_rows",
            "column_sum_partials",
            "column_sum_finish",
            "fill_columns",
        ],
    },
    KernelSource {
        name: "gelu.cu",
        source: include_str!("../kernels/gelu.cu"),
        kernels: &["gelu_forward", "gelu_bias_value_grad", "gelu_backward"],
    },
    KernelSource {
        name: "softmax.cu",
        source: include_str!("../kernels/softmax.cu"),
        kernels: &["softmax_rows_forward", "softmax_rows_backward"],
    },
    KernelSource {
        name: "dropout.cu",
        source: include_str!("../kernels/dropout.cu"),
        kernels: &[
            "dropout_apply",
            "dropout_add",
            "dropout_mask",
            "step_advance",
        ],
    },
    KernelSource {
        name: "cross_entropy.cu",
        source: include_str!("../kernels/cross_entropy.cu"),
        kernels: &[
            "cross_entropy_count",
            "cross_entropy_rows",
            "cross_entropy_reduce",
        ],
    },
    KernelSource {
        name: "embedding.cu",
        source: include_str!("../kernels/embedding.cu"),
        kernels: &[
            "gather_rows",
            "segment_sum_rows",
            "ttm_rows",
            "ttm_slab_grads",
            "ttm_core_grad_sums",
        ],
    },
    KernelSource {
        name: "optim.cu",
        source: include_str!("../kernels/optim.cu"),
        kernels: &["grad_sum_squares", "grad_norm_finish", "adamw_update"],
    },
    KernelSource {
        name: "encoder.cu",
        source: include_str!("../kernels/encoder.cu"),
        kernels: &["heads_permute", "tanh_forward", "tanh_backward"],
    },
    KernelSource {
        name: "rank.cu",
        source: include_str!("../kernels/rank.cu"),
        kernels: &[
            "rank_size_l1_grad",
            "gate_columns",
            "gated_grads_core",
            "gated_grads_gate",
            "gate_columns_table",
            "gated_grads_core_table",
            "gated_grads_gate_table",
            "rank_chain_sizes",
            "rank_objective",
            "rank_objective_grads",
            "rank_size_grads",
            "rank_project",
            "rank_gather_gates",
        ],
    },
];

/// The options every source is compiled with, for `arch`.
pub fn options(arch: Arch) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--fmad=false".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--ftz=false".into(),
    ]
}

/// The text NVRTC compiles for `src`: [`COMMON`], then the source, with a `#line` so that
/// errors name the source file and its own line numbers.
pub fn full_text(src: &KernelSource) -> String {
    format!("{COMMON}\n#line 1 \"{}\"\n{}", src.name, src.source)
}

/// Whether the NVRTC library can be loaded (nothing is loaded twice: cudarc keeps it).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen libnvrtc under the names cudarc knows; no NVRTC call is made.
    unsafe { sys::is_culib_present() }
}

/// The loaded NVRTC's version (major, minor); [`CudaError::NoNvrtc`] when it cannot be loaded.
pub fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    if !nvrtc_available() {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); nvrtcVersion writes two ints.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(nvrtc("nvrtcVersion"))?;
    Ok((major, minor))
}

/// Compiles one source to a CUBIN for `arch`. A compile error is
/// [`CudaError::KernelCompile`] with NVRTC's log.
pub fn compile(src: &KernelSource, arch: Arch) -> Result<Vec<u8>, CudaError> {
    compile_with_log(src, arch).map(|(cubin, _)| cubin)
}

/// [`compile`], also returning NVRTC's log of a successful compilation (its warnings; empty
/// when there are none).
pub fn compile_with_log(src: &KernelSource, arch: Arch) -> Result<(Vec<u8>, String), CudaError> {
    let version = nvrtc_version()?;
    if version.0 < 13 {
        return Err(CudaError::NvrtcTooOld { found: version });
    }
    let text = CString::new(full_text(src)).expect("kernel sources contain no NUL byte");
    let name = CString::new(src.name).expect("source names contain no NUL byte");
    let prog = result::create_program(&text, Some(&name)).map_err(nvrtc("nvrtcCreateProgram"))?;
    // SAFETY: `prog` was just created and is destroyed below, once; `text` and `name` outlive it.
    let compiled = unsafe { result::compile_program(prog, &options(arch)) };
    // SAFETY: `prog` is live (destroyed below).
    let log = unsafe { result::get_program_log(prog) }
        .map(|log| c_chars_to_string(&log))
        .unwrap_or_else(|e| format!("(no log: {e})"));
    let out = match compiled {
        Ok(()) => cubin(prog).map(|bin| (bin, log)),
        Err(_) => Err(CudaError::KernelCompile {
            kernel: src.name,
            arch,
            log,
        }),
    };
    // SAFETY: `prog` is live and not used after this.
    unsafe { result::destroy_program(prog) }.map_err(nvrtc("nvrtcDestroyProgram"))?;
    out
}

/// The CUBIN of a compiled program (cudarc wraps PTX retrieval only).
fn cubin(prog: sys::nvrtcProgram) -> Result<Vec<u8>, CudaError> {
    let mut size = 0usize;
    // SAFETY: `prog` is a live, successfully compiled program; the call writes one usize.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .map_err(nvrtc("nvrtcGetCUBINSize"))?;
    let mut bin = vec![0u8; size];
    // SAFETY: `bin` holds the `size` bytes NVRTC just reported for this program.
    unsafe { sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut c_char) }
        .result()
        .map_err(nvrtc("nvrtcGetCUBIN"))?;
    Ok(bin)
}

/// NVRTC's NUL-terminated log as text.
fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Every source compiled for `arch`, in [`SOURCES`] order.
pub fn compile_all(arch: Arch) -> Result<Vec<(&'static KernelSource, Vec<u8>)>, CudaError> {
    SOURCES.iter().map(|s| Ok((s, compile(s, arch)?))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_source_is_listed_once_with_its_kernels() {
        let mut names: Vec<_> = SOURCES.iter().map(|s| s.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), SOURCES.len());
        for s in SOURCES {
            for k in s.kernels {
                let def = format!("__global__ void {k}(");
                assert!(
                    s.source.contains(&def),
                    "{}: kernel `{k}` is listed but not defined as `extern \"C\" {def}`",
                    s.name
                );
            }
            // And every kernel defined in the file is listed.
            let defined = s.source.matches("__global__ void ").count();
            assert_eq!(
                defined,
                s.kernels.len(),
                "{}: kernels defined vs listed",
                s.name
            );
        }
        assert_eq!(Arch::SM90.to_string(), "sm_90");
        assert!(full_text(&SOURCES[0]).contains("#line 1 \"layernorm.cu\""));
    }
}
