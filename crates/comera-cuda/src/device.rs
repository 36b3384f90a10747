//! Opening a GPU: the probe (driver, its version, the device), the context and stream, and the
//! engine's kernels compiled by NVRTC for the device's architecture and loaded.
//!
//! The order of the checks is the order of what a user must fix: the driver library, the
//! driver's CUDA version, a device at that ordinal, NVRTC, then each kernel. Each failure is
//! its own [`CudaError`] with a message saying what to do.

use crate::compile::{self, Arch};
use crate::error::{driver, CudaError, MIN_DRIVER_VERSION};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaGraph, CudaStream, DriverError};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::Arc;

/// What the driver says about a device, before anything is compiled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    /// E.g. `NVIDIA H200`.
    pub name: String,
    /// The compute capability, e.g. sm_90.
    pub arch: Arch,
    /// Bytes of device memory.
    pub total_memory: usize,
    /// The CUDA version the driver supports, 1000·major + 10·minor (13000 for CUDA 13.0).
    pub driver_version: i32,
}

/// Whether the CUDA driver library can be loaded at all (false on a machine without the
/// NVIDIA driver; nothing is initialised).
pub fn driver_available() -> bool {
    // SAFETY: only tries to dlopen libcuda under the names cudarc knows; no driver call is made.
    unsafe { sys::is_culib_present() }
}

/// Loads and initialises the driver and checks its version: [`CudaError::NoDriver`],
/// [`CudaError::DriverTooOld`], [`CudaError::NoDevice`] (cuInit found none).
fn init_driver() -> Result<i32, CudaError> {
    if !driver_available() {
        return Err(CudaError::NoDriver);
    }
    let mut version = 0;
    // SAFETY: the library is present (checked above); cuDriverGetVersion writes one int and may
    // be called before cuInit.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(driver("cuDriverGetVersion"))?;
    if version < MIN_DRIVER_VERSION {
        return Err(CudaError::DriverTooOld { found: version });
    }
    match cudarc::driver::result::init() {
        Ok(()) => Ok(version),
        Err(DriverError(sys::cudaError_enum::CUDA_ERROR_NO_DEVICE)) => Err(CudaError::NoDevice),
        Err(e) => Err(driver("cuInit")(e)),
    }
}

/// The number of CUDA devices (after the driver checks of [`probe`]).
pub fn device_count() -> Result<usize, CudaError> {
    init_driver()?;
    let n = CudaContext::device_count().map_err(driver("cuDeviceGetCount"))?;
    Ok(n.max(0) as usize)
}

/// Checks that device `ordinal` can be used and describes it, without creating a context or
/// compiling anything.
pub fn probe(ordinal: usize) -> Result<DeviceInfo, CudaError> {
    let driver_version = init_driver()?;
    let count = CudaContext::device_count().map_err(driver("cuDeviceGetCount"))?;
    if count <= 0 {
        return Err(CudaError::NoDevice);
    }
    if ordinal >= count as usize {
        return Err(CudaError::OrdinalOutOfRange {
            ordinal,
            count: count as usize,
        });
    }
    use cudarc::driver::result::device;
    let dev = device::get(ordinal as i32).map_err(driver("cuDeviceGet"))?;
    let attr = |a| {
        // SAFETY: `dev` is a valid device handle from cuDeviceGet; the attribute is a plain query.
        unsafe { device::get_attribute(dev, a) }.map_err(driver("cuDeviceGetAttribute"))
    };
    let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    Ok(DeviceInfo {
        ordinal,
        name: device::get_name(dev).map_err(driver("cuDeviceGetName"))?,
        arch: Arch {
            major: major as u32,
            minor: minor as u32,
        },
        // SAFETY: as above.
        total_memory: unsafe { device::total_mem(dev) }.map_err(driver("cuDeviceTotalMem"))?,
        driver_version,
    })
}

/// An opened GPU: its context, the stream the engine runs on, and every kernel of
/// [`compile::SOURCES`] compiled for its architecture and loaded.
pub struct Device {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: HashMap<&'static str, CudaFunction>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("info", &self.info)
            .field("kernels", &self.kernels.len())
            .finish()
    }
}

impl Device {
    /// Probes device `ordinal` ([`probe`]), creates its context and a stream, and compiles and
    /// loads every kernel ([`CudaError::NoNvrtc`], [`CudaError::KernelCompile`]).
    pub fn open(ordinal: usize) -> Result<Device, CudaError> {
        let info = probe(ordinal)?;
        let ctx = CudaContext::new(ordinal).map_err(driver("creating the CUDA context"))?;
        // SAFETY: a `Device` queues all its work on its one stream (`stream` below), in order,
        // and its buffers are made, used and freed on that stream; cudarc's per-buffer events
        // (which order uses of a buffer across streams) are then not needed, and they would add
        // an event record and a wait to every launch and get in the way of graph capture.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(driver("creating a CUDA stream"))?;
        let mut kernels = HashMap::new();
        for (src, cubin) in compile::compile_all(info.arch)? {
            let module = ctx
                .load_module(Ptx::from_binary(cubin))
                .map_err(driver("loading a compiled kernel module"))?;
            for &k in src.kernels {
                let f = module
                    .load_function(k)
                    .map_err(driver("finding a kernel in its module"))?;
                kernels.insert(k, f);
            }
        }
        Ok(Device {
            info,
            ctx,
            stream,
            kernels,
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every operation of the engine is queued on (and a step graph captured from).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A loaded kernel by name (one of [`compile::KernelSource::kernels`]); panics on a name
    /// that is not one (a bug, not a user error).
    pub fn kernel(&self, name: &str) -> &CudaFunction {
        self.kernels
            .get(name)
            .unwrap_or_else(|| panic!("no kernel named `{name}` in comera-cuda's sources"))
    }

    /// (free, total) bytes of device memory now.
    pub fn memory(&self) -> Result<(usize, usize), CudaError> {
        self.ctx.mem_get_info().map_err(driver("cuMemGetInfo"))
    }

    /// Checks, before allocating, that `needed` bytes (an estimate of what `what` will
    /// allocate) fit in the device's free memory: [`CudaError::OutOfMemory`] otherwise.
    pub fn ensure_fits(&self, what: &str, needed: usize) -> Result<(), CudaError> {
        let (free, total) = self.memory()?;
        check_fits(self.info.ordinal, what, needed, free, total)
    }

    /// Captures what `record` queues on the device's stream as a CUDA graph (nothing runs
    /// while capturing), to be replayed with [`CudaGraph::launch`]. Capture is thread-local:
    /// other threads' CUDA calls neither join nor break it. Buffers must be allocated before
    /// (a captured step allocates nothing), and values that change from step to step must be
    /// read by the kernels from device memory (the dropout step counter, the clip factor, the
    /// step's learning-rate scalars), since a replay repeats the captured launch arguments.
    pub fn capture(
        &self,
        record: impl FnOnce(&Device) -> Result<(), CudaError>,
    ) -> Result<CudaGraph, CudaError> {
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("beginning a stream capture"))?;
        let recorded = record(self);
        // End the capture whether or not recording succeeded, so the stream is usable again.
        let ended = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(driver("ending a stream capture"));
        recorded?;
        ended?.ok_or(CudaError::NothingCaptured)
    }

    /// A cuBLAS handle on the engine's stream ([`CudaError::NoCublas`] if the library cannot
    /// be loaded).
    pub fn cublas(&self) -> Result<cudarc::cublas::CudaBlas, CudaError> {
        // SAFETY: only tries to dlopen libcublas; no cuBLAS call is made.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaError::NoCublas);
        }
        cudarc::cublas::CudaBlas::new(self.stream.clone()).map_err(|source| CudaError::Cublas {
            context: "creating the cuBLAS handle",
            source,
        })
    }
}

/// The memory check of [`Device::ensure_fits`] on given figures.
pub fn check_fits(
    ordinal: usize,
    what: &str,
    needed: usize,
    free: usize,
    total: usize,
) -> Result<(), CudaError> {
    if needed > free {
        return Err(CudaError::OutOfMemory {
            ordinal,
            what: what.to_string(),
            needed,
            free,
            total,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_check_refuses_what_does_not_fit() {
        assert!(check_fits(0, "x", 10, 10, 20).is_ok());
        let e = check_fits(1, "the step's buffers", 11, 10, 20).unwrap_err();
        assert!(
            matches!(
                e,
                CudaError::OutOfMemory {
                    ordinal: 1,
                    needed: 11,
                    free: 10,
                    total: 20,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(e.to_string().contains("the step's buffers"));
    }

    /// On a machine without the driver the probe says so (and does not panic); with one it
    /// either describes the device or names what is missing.
    #[test]
    fn probe_reports_a_typed_error_or_a_device() {
        match probe(0) {
            Ok(info) => {
                println!(
                    "cuda:0 is {} ({}), driver CUDA {}",
                    info.name, info.arch, info.driver_version
                );
                assert!(info.total_memory > 0);
                let count = device_count().unwrap();
                assert!(matches!(
                    probe(count),
                    Err(CudaError::OrdinalOutOfRange { ordinal, count: c }) if ordinal == count && c == count
                ));
            }
            Err(e) => {
                println!("no usable GPU here: {e}");
                assert!(
                    matches!(
                        e,
                        CudaError::NoDriver | CudaError::DriverTooOld { .. } | CudaError::NoDevice
                    ),
                    "{e:?}"
                );
                if !driver_available() {
                    assert!(matches!(e, CudaError::NoDriver));
                    assert!(matches!(Device::open(0), Err(CudaError::NoDriver)));
                }
            }
        }
    }
}

/// What this machine offers for `--device cuda` (`comera devices`): the driver, each GPU, NVRTC
/// and cuBLAS, found without creating a context; with `open`, each GPU also opened as a run
/// opens it (a context, the kernels compiled for it, a cuBLAS handle).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Survey {
    /// The CUDA version the driver supports (`13.0`), when a usable driver is there.
    pub driver_cuda: Option<String>,
    /// Why no GPU can be used (no driver, a driver too old, none found), if so.
    pub problem: Option<String>,
    pub gpus: Vec<GpuEntry>,
    /// NVRTC's version (`13.0`), when it loads and is new enough.
    pub nvrtc: Option<String>,
    /// Why NVRTC cannot be used, if so.
    pub nvrtc_problem: Option<String>,
    /// Whether cuBLAS 13 (`libcublas.so.13`) loads.
    pub cublas: bool,
}

/// One GPU of a [`Survey`].
#[derive(Clone, Debug, serde::Serialize)]
pub struct GpuEntry {
    /// `cuda:N`, as `--device` names it.
    pub device: String,
    pub name: String,
    /// The compute capability (`sm_90`).
    pub arch: String,
    pub memory_bytes: usize,
    /// With `open`: whether it opened (`problem` says why not); None without `open`.
    pub ready: Option<bool>,
    pub problem: Option<String>,
}

/// Surveys this machine's CUDA devices (see [`Survey`]).
pub fn survey(open: bool) -> Survey {
    let version = |v: i32| format!("{}.{}", v / 1000, (v % 1000) / 10);
    let (driver_cuda, problem, count) = match init_driver().and_then(|v| Ok((v, device_count()?))) {
        Ok((v, 0)) => (Some(version(v)), Some(CudaError::NoDevice.to_string()), 0),
        Ok((v, n)) => (Some(version(v)), None, n),
        Err(e) => (None, Some(e.to_string()), 0),
    };
    let gpus = (0..count)
        .map(|n| match probe(n) {
            Ok(info) => {
                let opened = open.then(|| Device::open(n).and_then(|d| d.cublas().map(|_| ())));
                GpuEntry {
                    device: format!("cuda:{n}"),
                    name: info.name,
                    arch: info.arch.to_string(),
                    memory_bytes: info.total_memory,
                    ready: opened.as_ref().map(Result::is_ok),
                    problem: opened.and_then(Result::err).map(|e| e.to_string()),
                }
            }
            Err(e) => GpuEntry {
                device: format!("cuda:{n}"),
                name: String::new(),
                arch: String::new(),
                memory_bytes: 0,
                ready: open.then_some(false),
                problem: Some(e.to_string()),
            },
        })
        .collect();
    let (nvrtc, nvrtc_problem) = match crate::compile::nvrtc_version() {
        Ok((major, minor)) if major >= 13 => (Some(format!("{major}.{minor}")), None),
        Ok((major, minor)) => (
            Some(format!("{major}.{minor}")),
            Some(
                CudaError::NvrtcTooOld {
                    found: (major, minor),
                }
                .to_string(),
            ),
        ),
        Err(e) => (None, Some(e.to_string())),
    };
    Survey {
        driver_cuda,
        problem,
        gpus,
        nvrtc,
        nvrtc_problem,
        // SAFETY: only tries to dlopen libcublas; no cuBLAS call is made.
        cublas: unsafe { cudarc::cublas::sys::is_culib_present() },
    }
}
