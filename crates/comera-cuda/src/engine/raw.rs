//! The engine's low level: device buffers addressed by raw pointers (llm.c style: a plan owns
//! every buffer for its whole life and its layers see offsets into them), kernel launches on
//! those pointers, and cuBLAS SGEMM in row-major terms on them.
//!
//! Why raw pointers rather than cudarc's borrowed views: one step touches hundreds of tensors
//! inside a few flat buffers (parameters, gradients, activations) and the AdamW kernel wants
//! parameters, gradients and moments flat; views would borrow a buffer mutably per tensor.
//! The safety argument is the plan's: a [`Buf`] is allocated once, never resized, and freed
//! only when the plan that owns it is dropped, after its stream has finished (cudarc
//! synchronises on drop); every pointer handed to a launch lies inside a live [`Buf`] at an
//! offset and length the plan computed from its fixed shapes, checked by [`Buf::at`].

use super::profile::timed;
use crate::device::Device;
use crate::error::{driver, CudaError};
use cudarc::cublas::sys::cublasOperation_t as Op;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits};

/// A device buffer of `len` elements that never moves or resizes, with its base address.
///
/// Every `Buf` allocated on a thread adds its bytes to that thread's count
/// ([`allocated_on_this_thread`]): a plan records what its construction allocated, and the GPU
/// tests hold that against the estimate made before allocating (`engine::memory`).
pub struct Buf<T> {
    slice: CudaSlice<T>,
    base: u64,
}

/// A failed allocation of `bytes` for `what`: [`CudaError::OutOfMemory`] (with the device's
/// free and total memory now) when the driver ran out of memory, else the driver's error. The
/// plan allocates everything before its first step, and the run directory is opened only
/// after the plan is built, so running out here writes nothing.
fn out_of_memory(
    dev: &Device,
    e: cudarc::driver::DriverError,
    what: &str,
    bytes: usize,
) -> CudaError {
    if e.0 != cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return driver("allocating a step buffer")(e);
    }
    let (free, total) = dev.memory().unwrap_or((0, dev.info().total_memory));
    CudaError::OutOfMemory {
        ordinal: dev.info().ordinal,
        what: what.to_string(),
        needed: bytes,
        free,
        total,
    }
}

thread_local! {
    static ALLOCATED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Bytes of every [`Buf`] allocated on this thread so far (it never decreases: a plan takes
/// the difference around its construction).
pub fn allocated_on_this_thread() -> usize {
    ALLOCATED.with(|a| a.get())
}

impl<T> Buf<T> {
    /// Bytes [`Buf::zeros`] allocates for `len` elements (at least one element).
    pub const fn zeros_bytes(len: usize) -> usize {
        if len == 0 {
            std::mem::size_of::<T>()
        } else {
            len * std::mem::size_of::<T>()
        }
    }

    /// Bytes [`Buf::copy_from_host`] allocates for `len` elements (at least one element, as
    /// [`Buf::zeros`]).
    pub const fn copy_bytes(len: usize) -> usize {
        Self::zeros_bytes(len)
    }

    fn counted(slice: CudaSlice<T>, dev: &Device) -> Buf<T> {
        ALLOCATED.with(|a| a.set(a.get() + slice.len() * std::mem::size_of::<T>()));
        let base = {
            let (base, _sync) = slice.device_ptr(dev.stream());
            base
        };
        Buf { slice, base }
    }
}

impl<T: DeviceRepr + ValidAsZeroBits> Buf<T> {
    /// `len` zeroed elements (at least one, so that every buffer has an address).
    pub fn zeros(dev: &Device, len: usize) -> Result<Buf<T>, CudaError> {
        let slice = dev
            .stream()
            .alloc_zeros::<T>(len.max(1))
            .map_err(|e| out_of_memory(dev, e, "a step buffer", Self::zeros_bytes(len)))?;
        Ok(Buf::counted(slice, dev))
    }
}

impl<T: DeviceRepr + ValidAsZeroBits> Buf<T> {
    /// A buffer holding a copy of `v`; an empty `v` gets one zeroed element, so that every
    /// buffer has an address (the driver refuses an allocation of 0 bytes).
    pub fn copy_from_host(dev: &Device, v: &[T]) -> Result<Buf<T>, CudaError> {
        if v.is_empty() {
            return Buf::zeros(dev, 0);
        }
        let slice = dev
            .stream()
            .clone_htod(v)
            .map_err(|e| out_of_memory(dev, e, "a step buffer", Self::copy_bytes(v.len())))?;
        Ok(Buf::counted(slice, dev))
    }
}

impl<T: DeviceRepr> Buf<T> {
    pub fn len(&self) -> usize {
        self.slice.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slice.len() == 0
    }

    /// The address of element `off`, for `len` elements from there (panics when they do not
    /// lie inside the buffer: a planning bug, caught before anything is launched).
    pub fn at(&self, off: usize, len: usize) -> u64 {
        assert!(
            off + len <= self.slice.len(),
            "device range {off}..{} outside a buffer of {}",
            off + len,
            self.slice.len()
        );
        self.base + (off * std::mem::size_of::<T>()) as u64
    }

    /// The base address (element 0).
    pub fn ptr(&self) -> u64 {
        self.base
    }

    pub fn slice(&self) -> &CudaSlice<T> {
        &self.slice
    }

    pub fn slice_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        self.slice.len() * std::mem::size_of::<T>()
    }
}

/// Threads per block of the engine's element-wise launches.
pub const BLOCK: u32 = 256;

/// A grid-stride launch over `n` elements.
pub fn grid_stride(n: usize) -> LaunchConfig {
    let blocks = (n as u64).div_ceil(BLOCK as u64).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A (x, y) grid of `block` threads.
pub fn grid(x: u32, y: u32, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x.max(1), y.max(1), 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches kernel `name` with `args` pushed in order (device pointers as `u64`, scalars as
/// themselves).
///
/// # Safety
/// `args` must match the kernel's parameter list in order and type, and every pointer among
/// them must address a live device range at least as long as the kernel reads or writes for
/// the sizes among `args`.
pub unsafe fn launch(
    dev: &Device,
    name: &'static str,
    cfg: LaunchConfig,
    args: &[&dyn Arg],
) -> Result<(), CudaError> {
    timed(
        || name.to_string(),
        || {
            let mut b = dev.stream().launch_builder(dev.kernel(name));
            for a in args {
                a.push(&mut b);
            }
            // SAFETY: the caller's contract (arguments match the kernel; pointers cover its
            // ranges).
            unsafe { b.launch(cfg) }.map_err(driver(name))?;
            Ok(())
        },
    )
}

/// A kernel argument passed by value.
pub trait Arg {
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>);
}

macro_rules! by_value {
    ($($t:ty),*) => {$(
        impl Arg for $t {
            fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>) {
                use cudarc::driver::PushKernelArg;
                b.arg(self);
            }
        }
    )*};
}
by_value!(u64, i64, i32, u32, f32);

/// Row-major SGEMM on raw device pointers: c (m × n) = alpha·op(a)·op(b) + beta·c, op(a)
/// (m × k) stored (m, k) or, with `ta`, (k, m); op(b) (k × n) stored (k, n) or (n, k). Leading
/// dimensions are the stored widths (`lda`, `ldb`, `ldc` override them for strided rows).
/// cuBLAS is column-major: it is asked for cᵀ = op(b)ᵀ·op(a)ᵀ, which is c read row by row.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub ta: bool,
    pub tb: bool,
    pub alpha: f32,
    pub beta: f32,
    pub lda: Option<usize>,
    pub ldb: Option<usize>,
    pub ldc: Option<usize>,
}

impl Gemm {
    /// c = op(a)·op(b) (beta 0), packed rows.
    pub fn new(m: usize, n: usize, k: usize, ta: bool, tb: bool) -> Gemm {
        Gemm {
            m,
            n,
            k,
            ta,
            tb,
            alpha: 1.0,
            beta: 0.0,
            lda: None,
            ldb: None,
            ldc: None,
        }
    }

    /// c += op(a)·op(b).
    pub fn acc(mut self) -> Gemm {
        self.beta = 1.0;
        self
    }

    pub fn alpha(mut self, alpha: f32) -> Gemm {
        self.alpha = alpha;
        self
    }

    pub fn ld(mut self, lda: Option<usize>, ldb: Option<usize>, ldc: Option<usize>) -> Gemm {
        self.lda = lda;
        self.ldb = ldb;
        self.ldc = ldc;
        self
    }

    fn lds(&self) -> (i32, i32, i32) {
        let lda = self.lda.unwrap_or(if self.ta { self.m } else { self.k });
        let ldb = self.ldb.unwrap_or(if self.tb { self.k } else { self.n });
        let ldc = self.ldc.unwrap_or(self.n);
        (lda as i32, ldb as i32, ldc as i32)
    }

    /// Queues the product on the handle's stream.
    ///
    /// # Safety
    /// `a`, `b`, `c` must address live device buffers holding the stored matrices for these
    /// sizes and leading dimensions.
    pub unsafe fn run(&self, blas: &CudaBlas, a: u64, b: u64, c: u64) -> Result<(), CudaError> {
        if self.m == 0 || self.n == 0 {
            return Ok(());
        }
        let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
        let (lda, ldb, ldc) = self.lds();
        timed(
            || self.label(1),
            || {
                // SAFETY: the caller's contract; alpha and beta are host scalars that outlive
                // the call.
                unsafe {
                    cudarc::cublas::result::sgemm(
                        *blas.handle(),
                        op(self.tb),
                        op(self.ta),
                        self.n as i32,
                        self.m as i32,
                        self.k as i32,
                        &self.alpha,
                        b as *const f32,
                        ldb,
                        a as *const f32,
                        lda,
                        &self.beta,
                        c as *mut f32,
                        ldc,
                    )
                }
                .map_err(|source| CudaError::Cublas {
                    context: "cublasSgemm",
                    source,
                })
            },
        )
    }

    /// The profiler's name for this product ([`super::profile`]): `sgemm m×n×k`, with `ᵀ`
    /// on a transposed operand, `+=` when it accumulates, and the batch count.
    fn label(&self, count: usize) -> String {
        let t = |b: bool| if b { "ᵀ" } else { "" };
        let acc = if self.beta != 0.0 { " +=" } else { "" };
        let batch = if count > 1 {
            format!(" ×{count}")
        } else {
            String::new()
        };
        format!(
            "sgemm {}×{}×{} (a{} b{}){acc}{batch}",
            self.m,
            self.n,
            self.k,
            t(self.ta),
            t(self.tb)
        )
    }

    /// `count` products at element strides `sa`, `sb`, `sc` (cublasSgemmStridedBatched).
    ///
    /// # Safety
    /// As [`Gemm::run`], for every one of the `count` matrices.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run_batched(
        &self,
        blas: &CudaBlas,
        a: u64,
        sa: usize,
        b: u64,
        sb: usize,
        c: u64,
        sc: usize,
        count: usize,
    ) -> Result<(), CudaError> {
        if self.m == 0 || self.n == 0 || count == 0 {
            return Ok(());
        }
        let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
        let (lda, ldb, ldc) = self.lds();
        timed(
            || self.label(count),
            || {
                // SAFETY: the caller's contract, for each of the `count` strided matrices.
                unsafe {
                    cudarc::cublas::result::sgemm_strided_batched(
                        *blas.handle(),
                        op(self.tb),
                        op(self.ta),
                        self.n as i32,
                        self.m as i32,
                        self.k as i32,
                        &self.alpha,
                        b as *const f32,
                        ldb,
                        sb as i64,
                        a as *const f32,
                        lda,
                        sa as i64,
                        &self.beta,
                        c as *mut f32,
                        ldc,
                        sc as i64,
                        count as i32,
                    )
                }
                .map_err(|source| CudaError::Cublas {
                    context: "cublasSgemmStridedBatched",
                    source,
                })
            },
        )
    }
}

/// Queues c ← 0 over `len` floats at `c`.
///
/// # Safety
/// `c` must address `len` live device floats.
pub unsafe fn zero(dev: &Device, c: u64, len: usize) -> Result<(), CudaError> {
    if len == 0 {
        return Ok(());
    }
    timed(
        || "memset".to_string(),
        // SAFETY: the caller's contract; cuMemsetD32Async on the engine's stream.
        || unsafe {
            cudarc::driver::sys::cuMemsetD32Async(c, 0, len, dev.stream().cu_stream())
                .result()
                .map_err(driver("cuMemsetD32Async"))
        },
    )
}

/// Queues a device-to-device copy of `len` floats.
///
/// # Safety
/// Both ranges must be live device floats and must not overlap.
pub unsafe fn copy(dev: &Device, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
    if len == 0 {
        return Ok(());
    }
    timed(
        || "memcpy".to_string(),
        // SAFETY: the caller's contract; an async copy on the engine's stream.
        || unsafe {
            cudarc::driver::sys::cuMemcpyDtoDAsync_v2(dst, src, len * 4, dev.stream().cu_stream())
                .result()
                .map_err(driver("cuMemcpyDtoDAsync"))
        },
    )
}

/// Bytes of a [`Blas`] workspace (NVIDIA's recommendation for Hopper).
pub const CUBLAS_WORKSPACE: usize = 32 << 20;

/// A cuBLAS handle on the device's stream with a workspace of its own, so that no cuBLAS call
/// allocates while a step is captured as a graph (the handle is declared before the workspace:
/// dropped first).
pub struct Blas {
    pub handle: CudaBlas,
    _workspace: Buf<u8>,
}

impl Blas {
    pub fn new(dev: &Device) -> Result<Blas, CudaError> {
        let handle = dev.cublas()?;
        let workspace = Buf::<u8>::zeros(dev, CUBLAS_WORKSPACE)?;
        // SAFETY: the workspace lives as long as the handle (both owned here, the handle
        // dropped first); every call on the handle is queued on the device's stream.
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(
                *handle.handle(),
                workspace.ptr() as *mut std::ffi::c_void,
                CUBLAS_WORKSPACE,
            )
            .result()
            .map_err(|source| CudaError::Cublas {
                context: "cublasSetWorkspace",
                source,
            })?
        };
        Ok(Blas {
            handle,
            _workspace: workspace,
        })
    }
}
