//! The step engine's pieces on a GPU against the CPU engine (comera-layers), and the parameter
//! seam (upload, download by name).
//!
//! Runs where a CUDA device and cuBLAS can be opened; elsewhere each test prints
//! `skipped: no CUDA device (why)` and passes — unless `COMERA_REQUIRE_GPU=1`
//! (`tools/gpu/check.sh` sets it), where a missing device fails every test.
//!
//! Tolerance of the TT layer (forward y, dX, every core, gate and bias gradient), checked as
//! SPEC §6 checks the reference cases, max|got − exp| ≤ tol · max(max|exp|, 1e-6), tol = 1e-4:
//! both sides compute the same products in f32 but cuBLAS sums in another order (and its own
//! blocking) than comera's GEMM. Every value here is a chain of at most K = 6 nested f32 dot
//! products, each of at most L = 64 terms (the largest inner length: N, M, B or s·r). A
//! reordered sum of L terms differs by at most γ_L·Σ|terms| with γ_L ≈ L·2⁻²⁴ ≈ 4e-6;
//! compounded over 6 levels that is ≤ 2.3e-5 of the terms' magnitudes, and random-sign data
//! makes Σ|terms| a few times |Σ| at most for the largest entries, which the tolerance is
//! relative to. 1e-4 leaves that margin; a wrong index, transpose or missed gate is O(1).

#![cfg(feature = "cuda")]

use comera_cuda::cudarc::cublas::CudaBlas;
use comera_cuda::engine::{raw, Buf, ParamArena, Slot, TtDims, TtLayer, Which};
use comera_cuda::{CudaError, Device};
use comera_layers::{Layer, Param, RankGates, TtLinear};
use comera_tensor::{init, TtShape};
use std::sync::OnceLock;

/// The device every test shares and a cuBLAS handle on its stream, or `None` here.
fn device() -> Option<&'static (Device, CudaBlas)> {
    struct Shared((Device, CudaBlas));
    // SAFETY-free wrapper: the handle is used from one test at a time (a Mutex below).
    unsafe impl Sync for Shared {}
    unsafe impl Send for Shared {}
    static DEVICE: OnceLock<Result<Shared, String>> = OnceLock::new();
    let required = std::env::var("COMERA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match DEVICE.get_or_init(|| match Device::open(0) {
        Ok(d) => {
            let blas = d.cublas().unwrap_or_else(|e| panic!("cuBLAS: {e}"));
            Ok(Shared((d, blas)))
        }
        Err(
            e @ (CudaError::NoDriver
            | CudaError::NoDevice
            | CudaError::DriverTooOld { .. }
            | CudaError::NoNvrtc),
        ) => Err(e.to_string()),
        Err(other) => panic!("cuda:0 is present but could not be opened: {other}"),
    }) {
        Ok(s) => Some(&s.0),
        Err(why) => {
            assert!(!required, "COMERA_REQUIRE_GPU=1 but no CUDA device: {why}");
            println!("skipped: no CUDA device ({why})");
            None
        }
    }
}

/// One test at a time on the shared stream and handle.
fn lock() -> std::sync::MutexGuard<'static, ()> {
    static L: std::sync::Mutex<()> = std::sync::Mutex::new(());
    L.lock().unwrap_or_else(|e| e.into_inner())
}

fn normal(seed: u64, n: usize, std: f32) -> Vec<f32> {
    let mut rng = init::rng(seed);
    let mut v = vec![0.0; n];
    init::fill_normal(&mut rng, &mut v, std);
    v
}

/// SPEC §6's check.
fn assert_close(what: &str, got: &[f32], exp: &[f32], tol: f64) {
    assert_eq!(got.len(), exp.len(), "{what}: length");
    let scale = exp
        .iter()
        .fold(0f64, |m, &e| m.max(e.abs() as f64))
        .max(1e-6);
    let err = got
        .iter()
        .zip(exp)
        .fold(0f64, |m, (&g, &e)| m.max((g as f64 - e as f64).abs()));
    assert!(
        err <= tol * scale,
        "{what}: max error {err:.3e} > {tol:.0e} × {scale:.3e}"
    );
}

/// A CPU TT layer (input modes [4, 4, 3], output [3, 4, 4], rank 5, one gate entry pruned on
/// the middle bond and one on an output bond, a random bias) and its device twin over an arena.
struct Pair {
    cpu: TtLinear,
    arena: ParamArena,
    dev_layer: TtLayer,
}

const TAU: f32 = 0.01;

fn pair(dev: &Device, rows: usize) -> Pair {
    let shape = TtShape::uniform(&[4, 4, 3], &[3, 4, 4], 5).unwrap();
    let mut rng = init::rng(7);
    let mut cpu = TtLinear::new("l", shape.clone(), RankGates::new(TAU), &mut rng).unwrap();
    for (i, g) in cpu.gates.iter_mut().enumerate() {
        g.value = normal(100 + i as u64, g.len(), 0.5)
            .iter()
            .map(|v| 1.0 + v)
            .collect();
    }
    cpu.gates[2].value[1] = 0.005; // pruned (≤ τ): its slice contributes nothing
    cpu.gates[3].value[4] = -0.3; // negative: also inactive
    cpu.bias.value = normal(9, cpu.bias.len(), 0.1);
    let dims = TtDims::from_shape(&shape);
    let mut arena = ParamArena::new(dev, &dims.params("l")).unwrap();
    arena.upload(dev, &cpu.params()).unwrap();
    let slot = |n: &str| Slot {
        w: arena.w(n),
        g: arena.g(n),
    };
    let dev_layer = TtLayer::new(dev, dims, rows, TAU, slot, "l").unwrap();
    Pair {
        cpu,
        arena,
        dev_layer,
    }
}

fn grads_by_name(dev: &Device, arena: &ParamArena) -> Vec<(String, Vec<f32>)> {
    let g = arena.download_flat(dev, Which::Grad).unwrap();
    arena
        .tensors
        .iter()
        .map(|t| (t.name.clone(), g[t.offset..t.offset + t.len].to_vec()))
        .collect()
}

#[test]
fn tt_layer_matches_the_cpu_forward_and_backward() {
    let Some((dev, blas)) = device() else { return };
    let _l = lock();
    let rows = 37;
    let mut p = pair(dev, rows);
    let (n, m) = (p.cpu.in_features(), p.cpu.out_features());
    let x = normal(1, rows * n, 1.0);
    let dy = normal(2, rows * m, 1.0);
    // CPU.
    let mut ws = p.cpu.workspace(rows);
    let mut y = vec![0.0; rows * m];
    p.cpu.forward(&mut ws, &x, &mut y);
    p.cpu.zero_grad();
    let mut dx = vec![0.0; rows * n];
    p.cpu.backward(&mut ws, &x, &dy, Some(&mut dx));
    // Device.
    let (xd, dyd) = (
        Buf::from_host(dev, &x).unwrap(),
        Buf::from_host(dev, &dy).unwrap(),
    );
    let (yd, dxd) = (
        Buf::<f32>::zeros(dev, rows * m).unwrap(),
        Buf::<f32>::zeros(dev, rows * n).unwrap(),
    );
    p.dev_layer.forward(dev, blas, xd.ptr(), yd.ptr()).unwrap();
    p.dev_layer
        .backward(dev, blas, xd.ptr(), dyd.ptr(), Some((dxd.ptr(), false)))
        .unwrap();
    let s = dev.stream();
    assert_close("y", &s.clone_dtoh(yd.slice()).unwrap(), &y, 1e-4);
    assert_close("dx", &s.clone_dtoh(dxd.slice()).unwrap(), &dx, 1e-4);
    let cpu: Vec<&Param> = p.cpu.params();
    for (name, g) in grads_by_name(dev, &p.arena) {
        let c = cpu.iter().find(|q| q.name == name).unwrap();
        assert_close(&format!("grad {name}"), &g, &c.grad, 1e-4);
    }
    // The pruned entries pass no gradient, exactly.
    let g = grads_by_name(dev, &p.arena);
    let gate3 = &g.iter().find(|(n, _)| n == "l.gate.3").unwrap().1;
    assert_eq!(gate3[1], 0.0);
}

/// The layer's forward and backward (gradients zeroed first) captured as a CUDA graph and
/// replayed twice give the uncaptured launches' bits exactly: same kernels, same cuBLAS
/// calls, same order, on the same buffers.
#[test]
fn tt_layer_replayed_from_a_graph_gives_the_same_bits() {
    let Some((dev, blas)) = device() else { return };
    let _l = lock();
    let rows = 37;
    let p = pair(dev, rows);
    let (n, m) = (p.dev_layer.dims.n(), p.dev_layer.dims.m());
    let x = Buf::from_host(dev, &normal(3, rows * n, 1.0)).unwrap();
    let dy = Buf::from_host(dev, &normal(4, rows * m, 1.0)).unwrap();
    let y = Buf::<f32>::zeros(dev, rows * m).unwrap();
    let dx = Buf::<f32>::zeros(dev, rows * n).unwrap();
    let total = p.arena.total();
    let step = |d: &Device| -> Result<(), CudaError> {
        // SAFETY: the arena's gradient buffer holds `total` floats.
        unsafe { raw::zero(d, p.arena.g.ptr(), total)? };
        p.dev_layer.forward(d, blas, x.ptr(), y.ptr())?;
        p.dev_layer
            .backward(d, blas, x.ptr(), dy.ptr(), Some((dx.ptr(), false)))
    };
    let s = dev.stream();
    step(dev).unwrap();
    let want = (
        s.clone_dtoh(y.slice()).unwrap(),
        s.clone_dtoh(dx.slice()).unwrap(),
        p.arena.download_flat(dev, Which::Grad).unwrap(),
    );
    // Scribble over the outputs so that a replay that does nothing cannot pass.
    // SAFETY: the buffers hold these many floats.
    unsafe {
        raw::zero(dev, y.ptr(), rows * m).unwrap();
        raw::zero(dev, p.arena.g.ptr(), total).unwrap();
    }
    let graph = dev.capture(|d| step(d)).unwrap();
    for replay in 0..2 {
        graph.launch().unwrap();
        s.synchronize().unwrap();
        let got = (
            s.clone_dtoh(y.slice()).unwrap(),
            s.clone_dtoh(dx.slice()).unwrap(),
            p.arena.download_flat(dev, Which::Grad).unwrap(),
        );
        assert!(got == want, "replay {replay} differs from the launches");
    }
}

/// Upload then download returns every value bit for bit, by name; a host set with a
/// missing or reshaped parameter is refused before anything is copied.
#[test]
fn arena_round_trips_parameters_by_name() {
    let Some((dev, _)) = device() else { return };
    let _l = lock();
    let mut p = pair(dev, 4);
    let want: Vec<Param> = p.cpu.params().into_iter().cloned().collect();
    p.cpu.visit_params_mut(&mut |q| q.value.fill(f32::NAN));
    p.arena
        .download(dev, false, |f| p.cpu.visit_params_mut(f))
        .unwrap();
    for (got, want) in p.cpu.params().iter().zip(&want) {
        assert_eq!(got.name, want.name);
        assert!(got.value == want.value, "{}", got.name);
    }
    let mut fewer: Vec<&Param> = want.iter().collect();
    fewer.pop();
    let e = p.arena.upload(dev, &fewer).unwrap_err();
    assert!(e.to_string().contains("l.bias"), "{e}");
}
