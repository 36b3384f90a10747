//! Every kernel source compiles with NVRTC to machine code for compute capability 8.0 (A100)
//! and 9.0 (H100/H200), and the machine code defines every kernel the source lists.
//!
//! Needs NVRTC (libnvrtc.so.13), not a GPU. Without NVRTC the test says it was skipped and
//! passes, unless `COMERA_REQUIRE_NVRTC=1` (CI sets it after installing NVRTC from PyPI, see
//! `.ci/run`), where a missing NVRTC fails.

#![cfg(feature = "cuda")]

use comera_cuda::compile::{self, Arch, KernelSource, SOURCES};
use comera_cuda::CudaError;

fn nvrtc_or_skip() -> bool {
    if compile::nvrtc_available() {
        return true;
    }
    let required = std::env::var("COMERA_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "COMERA_REQUIRE_NVRTC=1 but NVRTC could not be loaded: {}",
        CudaError::NoNvrtc
    );
    println!("skipped: NVRTC not found (libnvrtc.so.13; see docs/gpu.md to install it)");
    false
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90() {
    if !nvrtc_or_skip() {
        return;
    }
    let (major, minor) = compile::nvrtc_version().unwrap();
    println!("NVRTC {major}.{minor}");
    for arch in [Arch::SM80, Arch::SM90] {
        for src in SOURCES {
            let (cubin, log) =
                compile::compile_with_log(src, arch).unwrap_or_else(|e| panic!("{e}"));
            // No warnings either: a warning in a kernel is a bug waiting on a GPU.
            assert!(
                log.trim().is_empty(),
                "{} for {arch}: NVRTC says\n{log}",
                src.name
            );
            // An ELF image (CUBIN), not PTX text.
            assert_eq!(
                &cubin[..4],
                b"\x7fELF",
                "{} for {arch}: not a CUBIN",
                src.name
            );
            // `extern "C"` kernels keep their names in the ELF's symbol table.
            for k in src.kernels {
                let found = cubin
                    .windows(k.len() + 1)
                    .any(|w| &w[..k.len()] == k.as_bytes() && w[k.len()] == 0);
                assert!(
                    found,
                    "{} for {arch}: kernel `{k}` not in the CUBIN",
                    src.name
                );
            }
            println!(
                "{} for {arch}: {} bytes, kernels {:?}",
                src.name,
                cubin.len(),
                src.kernels
            );
        }
    }
}

/// A source that does not compile is a typed error carrying NVRTC's log, naming the file and
/// the line.
#[test]
fn a_broken_kernel_reports_the_nvrtc_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let broken = KernelSource {
        name: "broken.cu",
        source: "extern \"C\" __global__ void f(float* x) {\n  x[0] = undefined_name;\n}\n",
        kernels: &["f"],
    };
    match compile::compile(&broken, Arch::SM90) {
        Err(e @ CudaError::KernelCompile { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("broken.cu") && msg.contains("sm_90"), "{msg}");
            assert!(
                msg.contains("broken.cu(2)"),
                "the log names the line: {msg}"
            );
            assert!(msg.contains("undefined_name"), "{msg}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

/// The kernel cache on disk: a source compiled once into a folder is read back from it (the
/// same bytes, no second compilation's time), one file per source and architecture.
#[test]
fn compiled_kernels_are_cached_on_disk_and_read_back() {
    if !nvrtc_or_skip() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("comera-nvrtc-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let src = SOURCES.iter().find(|s| s.name == "rank.cu").unwrap();
    let t0 = std::time::Instant::now();
    let first = compile::compile_cached_in(Some(&dir), src, Arch::SM90).unwrap();
    let compiling = t0.elapsed();
    let t0 = std::time::Instant::now();
    let second = compile::compile_cached_in(Some(&dir), src, Arch::SM90).unwrap();
    let reading = t0.elapsed();
    assert!(first == second, "the cached CUBIN is the compiled one");
    assert_eq!(&second[..4], b"\x7fELF");
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().collect();
    assert_eq!(files.len(), 1, "one file, no temporary left: {files:?}");
    println!("rank.cu for sm_90: compiled in {compiling:?}, read back in {reading:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
