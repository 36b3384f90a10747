//! The kernel sources and their compilation by NVRTC into machine code (CUBIN) for one GPU
//! architecture.
//!
//! Machine code, not PTX: PTX from an NVRTC newer than the driver does not load (the driver
//! JIT-compiles PTX and refuses a newer PTX version), while a CUBIN for the GPU's own
//! architecture from any 13.x NVRTC loads on a 13.0 driver. NVRTC runs when the device is
//! opened (all sources for one architecture: 2-3 s on this workplace's 2-vCPU Zen 4, where the
//! `nvrtc_compile` test compiles them for two in 3.8-6.7 s), and the CUBINs are kept in a cache
//! on disk for the next command ([`compile_cached`]).
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
        kernels: &[
            "grad_sum_squares",
            "grad_norm_finish",
            "adamw_update",
            "micro_scale_grads",
            "micro_add_stats",
            "micro_finish_stats",
        ],
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
    KernelSource {
        name: "profile.cu",
        source: include_str!("../kernels/profile.cu"),
        kernels: &["spin_wait"],
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

/// Every source compiled for `arch`, in [`SOURCES`] order, through the on-disk cache
/// ([`compile_cached`]).
pub fn compile_all(arch: Arch) -> Result<Vec<(&'static KernelSource, Vec<u8>)>, CudaError> {
    SOURCES
        .iter()
        .map(|s| Ok((s, compile_cached(s, arch)?)))
        .collect()
}

/// [`compile`], with the CUBIN kept in the kernel cache ([`kernel_cache_dir`]) and taken from
/// there when the same source was compiled before by the same NVRTC, for the same
/// architecture, with the same options: NVRTC takes a few seconds for all the sources, which
/// every `--device cuda` command would otherwise pay when it opens the GPU. A cache file holds
/// its whole key (NVRTC's version, the architecture, the options, the source's full text) and
/// is used only when that key is the one asked for; a file that cannot be read or written is
/// compiled around, never an error.
pub fn compile_cached(src: &KernelSource, arch: Arch) -> Result<Vec<u8>, CudaError> {
    compile_cached_in(kernel_cache_dir().as_deref(), src, arch)
}

/// [`compile_cached`] with the cache in `dir` (None: no cache).
pub fn compile_cached_in(
    dir: Option<&std::path::Path>,
    src: &KernelSource,
    arch: Arch,
) -> Result<Vec<u8>, CudaError> {
    let (major, minor) = nvrtc_version()?;
    let key = format!(
        "comera kernel cache 1\nnvrtc {major}.{minor}\narch {arch}\noptions {}\n{}",
        options(arch).join(" "),
        full_text(src)
    );
    match dir {
        Some(dir) => cached(dir, &cache_file_name(src.name, arch, &key), &key, || {
            compile(src, arch)
        }),
        None => compile(src, arch),
    }
}

/// The kernel cache's folder: `$COMERA_KERNEL_CACHE` (`none` for no cache), else
/// `$HOME/.cache/comera/kernels`; None without either.
pub fn kernel_cache_dir() -> Option<std::path::PathBuf> {
    match std::env::var_os("COMERA_KERNEL_CACHE").filter(|d| !d.is_empty()) {
        Some(d) if d == "none" => None,
        Some(d) => Some(d.into()),
        None => std::env::var_os("HOME")
            .filter(|h| !h.is_empty())
            .map(|h| std::path::PathBuf::from(h).join(".cache/comera/kernels")),
    }
}

/// `{source}-{arch}-{FNV-1a of the key}.cubin`: the key itself is checked inside the file.
fn cache_file_name(source: &str, arch: Arch, key: &str) -> String {
    let hash = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    format!(
        "{}-{arch}-{hash:016x}.cubin",
        source.trim_end_matches(".cu")
    )
}

/// The bytes cached in `dir/name` under `key`, else `make()`'s, written there (atomically: a
/// temporary file renamed) for the next time. A cache file is the key's length (8 bytes, little
/// endian), the key, the bytes.
fn cached(
    dir: &std::path::Path,
    name: &str,
    key: &str,
    make: impl FnOnce() -> Result<Vec<u8>, CudaError>,
) -> Result<Vec<u8>, CudaError> {
    let path = dir.join(name);
    if let Ok(file) = std::fs::read(&path) {
        let k = key.len();
        if file.len() > 8 + k
            && file[..8] == (k as u64).to_le_bytes()
            && &file[8..8 + k] == key.as_bytes()
        {
            return Ok(file[8 + k..].to_vec());
        }
    }
    let bytes = make()?;
    let mut file = Vec::with_capacity(8 + key.len() + bytes.len());
    file.extend_from_slice(&(key.len() as u64).to_le_bytes());
    file.extend_from_slice(key.as_bytes());
    file.extend_from_slice(&bytes);
    let tmp = dir.join(format!("{name}.tmp.{}", std::process::id()));
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&tmp, &file))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cache hands back what was cached under the same key, and compiles again for another
    /// key under the same file name, a damaged file, or a folder it cannot write (never an
    /// error for the cache's own sake).
    #[test]
    fn the_kernel_cache_returns_what_it_was_given_for_the_same_key_only() {
        let dir = std::env::temp_dir().join(format!("comera-kernel-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let calls = std::cell::Cell::new(0);
        let make = |b: u8| {
            let calls = &calls;
            move || {
                calls.set(calls.get() + 1);
                Ok(vec![b; 5])
            }
        };
        let name = cache_file_name("rank.cu", Arch::SM90, "key one");
        assert!(
            name.starts_with("rank-sm_90-") && name.ends_with(".cubin"),
            "{name}"
        );
        assert_ne!(name, cache_file_name("rank.cu", Arch::SM80, "key one"));
        assert_eq!(cached(&dir, &name, "key one", make(1)).unwrap(), vec![1; 5]);
        assert_eq!(cached(&dir, &name, "key one", make(2)).unwrap(), vec![1; 5]);
        assert_eq!(calls.get(), 1, "the second call read the cache");
        // Another key under the same name (a hash collision): compiled again, and cached.
        assert_eq!(cached(&dir, &name, "key two", make(3)).unwrap(), vec![3; 5]);
        assert_eq!(cached(&dir, &name, "key two", make(4)).unwrap(), vec![3; 5]);
        assert_eq!(calls.get(), 2);
        // A damaged file: compiled again.
        std::fs::write(dir.join(&name), b"garbage").unwrap();
        assert_eq!(cached(&dir, &name, "key two", make(5)).unwrap(), vec![5; 5]);
        assert_eq!(calls.get(), 3);
        // A folder that cannot be made (a file is in the way): compiled, no error.
        let blocked = dir.join(&name).join("sub");
        assert_eq!(
            cached(&blocked, &name, "key two", make(6)).unwrap(),
            vec![6; 5]
        );
        assert_eq!(calls.get(), 4);
        // A failed compilation is the error it was, and nothing is cached.
        let e = cached(&dir, "other.cubin", "k", || Err(CudaError::NoNvrtc)).unwrap_err();
        assert!(matches!(e, CudaError::NoNvrtc));
        assert!(!dir.join("other.cubin").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn every_source_is_listed_once_with_its_kernels() {
        let mut names: Vec<_> = SOURCES.iter().map(|s| s.name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), SOURCES.len());
        for s in SOURCES {
            for k in s.kernels {
                // `__global__ void k(`, or `__global__ void __launch_bounds__(n) k(`.
                let named = format!(" {k}(");
                assert!(
                    s.source
                        .lines()
                        .any(|l| l.contains("__global__ void ") && l.contains(&named)),
                    "{}: kernel `{k}` is listed but not defined as `extern \"C\" __global__ \
                     void {k}(`",
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
