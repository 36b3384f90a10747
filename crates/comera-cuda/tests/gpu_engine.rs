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

use comera_cuda::engine::{raw, Blas, Buf, ParamArena, Slot, TtDims, TtLayer, Which};
use comera_cuda::{CudaError, Device};
use comera_layers::{Layer, Param, RankGates, TtLinear};
use comera_tensor::{init, TtShape};
use std::sync::OnceLock;

/// The device every test shares and a cuBLAS handle on its stream, or `None` here.
fn device() -> Option<(
    &'static Device,
    &'static comera_cuda::cudarc::cublas::CudaBlas,
)> {
    static DEVICE: OnceLock<Result<(Device, Blas), String>> = OnceLock::new();
    let required = std::env::var("COMERA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match DEVICE.get_or_init(|| match Device::open(0) {
        Ok(d) => {
            let blas = Blas::new(&d).unwrap_or_else(|e| panic!("cuBLAS: {e}"));
            Ok((d, blas))
        }
        Err(
            e @ (CudaError::NoDriver
            | CudaError::NoDevice
            | CudaError::DriverTooOld { .. }
            | CudaError::NoNvrtc),
        ) => Err(e.to_string()),
        Err(other) => panic!("cuda:0 is present but could not be opened: {other}"),
    }) {
        Ok((d, b)) => Some((d, &b.handle)),
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
    let mut arena = ParamArena::new(dev, &dims.params("l"), true).unwrap();
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
        Buf::copy_from_host(dev, &x).unwrap(),
        Buf::copy_from_host(dev, &dy).unwrap(),
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
    let x = Buf::copy_from_host(dev, &normal(3, rows * n, 1.0)).unwrap();
    let dy = Buf::copy_from_host(dev, &normal(4, rows * m, 1.0)).unwrap();
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

mod encoder_step {
    //! One training step of a small TT/TTM classifier on the device against the CPU engine,
    //! from the same parameters and batch (dropout on, clipping on, AdamW's three groups).
    //!
    //! Tolerances. The device computes the same formulas in f32 but sums in other orders
    //! (cuBLAS' blocking, tree reductions in LayerNorm and softmax, expf/tanhf against the
    //! CPU's exp/tanh). One reordered f32 sum of L terms differs by at most L·2⁻²⁴ of the sum
    //! of its terms' magnitudes; the widest sums here have L ≤ 64 terms (4e-6). First-order
    //! errors add along a chain: the forward to the logits is ≈ 25 such operations (2 blocks
    //! × (q/k/v chains, 2 attention products, softmax, o, 2 LN, up, down) + embeddings +
    //! head), ≤ 1e-4 of the logits' magnitude in the worst case. The loss (f64 reduction on
    //! both sides) is compared at 1e-4 relative; each parameter's gradient, whose chain is
    //! about twice as long and passes LayerNorm's 1/σ, at 1e-3 of that tensor's largest
    //! gradient (SPEC §6's form); the gradient norm at 1e-4 relative (a sum of squares
    //! dominated by the largest entries).
    //!
    //! Parameters after the update: AdamW's first step with clip factor c moves each entry by
    //! lr·u(g), u(g) = c·g/(c·|g| + ε) (m̂ = c·g, √v̂ = c·|g|), ≈ ±lr. With the gradient
    //! known to within δ (the gradient tolerance above) and |g| − δ = g_lo > 0, the sign is
    //! certain and |u(g) − u(g')| ≤ c·δ·ε/(c·g_lo + ε)² (u's slope), plus 1e-4 for the clip
    //! factors' own difference; where |g| ≤ δ the sign may flip and the entry may move by up
    //! to 2·lr the other way. The check is lr times that bound (at most 2) plus
    //! 1e-6·max(|w|, 1) for the rounding of w − lr·u. A wrong index, layout or sign fails it
    //! by orders of magnitude.
    use super::*;
    use comera_cuda::engine::{EncoderPlan, StepConfig};
    use comera_layers::ParamKind;
    use comera_model::config::{LayerTt, Rank, TtmConfig};
    use comera_model::{Encoder, EncoderConfig};
    use cudarc::driver::CudaGraph;

    const SEED: u64 = 11;
    const STEP: u64 = 5;

    fn config() -> EncoderConfig {
        EncoderConfig {
            vocab_size: 200,
            seq_len: 16,
            d_model: 32,
            heads: 4,
            ffn: 64,
            layers: 2,
            num_labels: 3,
            type_vocab: 2,
            dropout: 0.1,
            attn_tt: LayerTt::uniform(&[4, 8], &[8, 4], 3),
            ffn_up_tt: LayerTt::uniform(&[4, 8], &[8, 8], 3),
            ffn_down_tt: LayerTt::uniform(&[8, 8], &[4, 8], 3),
            word_ttm: TtmConfig {
                vocab_modes: vec![5, 8, 5],
                dim_modes: vec![2, 4, 4],
                rank: Rank::Uniform(4),
            },
            ..EncoderConfig::default()
        }
    }

    /// Three sequences of 16 tokens: repeated ids (the embeddings' segment sums), two token
    /// types, padding at the end of the second sequence.
    fn batch() -> (Vec<u32>, Vec<u32>, Vec<u32>, Vec<usize>) {
        let (b, t) = (3, 16);
        let ids = (0..b * t)
            .map(|i| ((i * 37) % 61 + (i % 3) * 50) as u32 % 200)
            .collect();
        let types = (0..b * t).map(|i| ((i % t) >= t / 2) as u32).collect();
        let mask = (0..b * t)
            .map(|i| !(i / t == 1 && i % t >= 12) as u32)
            .collect();
        (ids, types, mask, vec![2, 0, 1])
    }

    fn step_config() -> StepConfig {
        StepConfig {
            lr_cores: 1e-3,
            lr_gates: 1e-2,
            lr_other: 5e-4,
            max_grad_norm: 1.0,
            ..StepConfig::paper()
        }
    }

    fn model() -> Encoder {
        model_with(false)
    }

    /// [`model`], post-LN or pre-LN.
    fn model_with(pre_ln: bool) -> Encoder {
        model_of(&EncoderConfig { pre_ln, ..config() })
    }

    /// A model of `cfg` with [`model`]'s changes.
    fn model_of(cfg: &EncoderConfig) -> Encoder {
        let mut enc = Encoder::new(cfg, SEED).unwrap();
        // Gates away from 1, one entry pruned (≤ τ) in a TT layer and in the TTM table.
        let mut i = 0u64;
        enc.visit_params_mut(&mut |p| {
            if p.kind == ParamKind::RankGate {
                p.value = normal(500 + i, p.len(), 0.3)
                    .iter()
                    .map(|v| 1.0 + v)
                    .collect();
                i += 1;
            }
            if p.name == "encoder.0.attn.q.gate.1" || p.name == "embeddings.word.gate.2" {
                p.value[1] = 0.004;
            }
            if p.name.ends_with(".bias") || p.name.ends_with(".beta") {
                p.value = normal(600 + i, p.len(), 0.05);
                i += 1;
            }
        });
        enc
    }

    /// The CPU step: loss, gradient norm, gradients (before the update) and parameters after.
    fn cpu_step(enc: &mut Encoder) -> CpuStep {
        let (ids, types, mask, labels) = batch();
        let mut st = enc.state(3);
        st.load(&ids, &types, &mask, &labels).unwrap();
        cpu_step_on(enc, st)
    }

    /// Loss, gradient norm, clip factor, gradients, parameters after the update.
    type CpuStep = (f64, f64, f32, Vec<Param>, Vec<Param>);

    /// The CPU step on the batch loaded in `st`.
    fn cpu_step_on(enc: &mut Encoder, mut st: comera_model::EncoderState) -> CpuStep {
        enc.zero_grad();
        let stats = enc.forward(&mut st, true, STEP).unwrap();
        enc.backward(&mut st);
        let grads: Vec<Param> = enc.params().into_iter().cloned().collect();
        let sc = step_config();
        let (scale, norm) = comera_optim::clip_scale(sc.max_grad_norm, |f| enc.visit_params_mut(f));
        let mut opt = comera_optim::AdamW::new(adam_config(), |f| enc.visit_params_mut(f));
        opt.step(1.0, scale, |f| enc.visit_params_mut(f));
        let after: Vec<Param> = enc.params().into_iter().cloned().collect();
        (stats.loss, norm, scale, grads, after)
    }

    /// [`step_config`]'s optimiser settings as the CPU takes them.
    fn adam_config() -> comera_optim::AdamWConfig {
        let sc = step_config();
        comera_optim::AdamWConfig {
            lr_cores: sc.lr_cores,
            lr_gates: sc.lr_gates,
            lr_other: sc.lr_other,
            weight_decay: sc.weight_decay,
            beta1: sc.beta1,
            beta2: sc.beta2,
            eps: sc.eps,
            ..Default::default()
        }
    }

    /// A session's whole flat buffer `which` (values, gradients or a moment), on the host.
    fn arena_flat(s: &comera_cuda::engine::EncoderSession, which: Which) -> Vec<f32> {
        s.plan()
            .unwrap()
            .arena
            .download_flat(s.device(), which)
            .unwrap()
    }

    fn device_plan(dev: &Device, enc: &Encoder) -> EncoderPlan {
        let (ids, types, mask, labels) = batch();
        let mut plan = EncoderPlan::new(dev, enc, SEED, 3, 16, step_config()).unwrap();
        plan.load(dev, &ids, &types, &mask, &labels).unwrap();
        plan.set_step(dev, STEP, 1, 1.0).unwrap();
        plan
    }

    #[test]
    fn one_step_matches_the_cpu_engine() {
        step_matches_the_cpu_engine(false);
    }

    /// The same step of the pre-LN block (LN1 before q/k/v on every row, LN2 on r1, out =
    /// r1 + f), same tolerances; and its evaluation pass (dropout off) against the CPU's
    /// forward without dropout (logits within 1e-4, as the post-LN pass below).
    #[test]
    fn one_pre_ln_step_matches_the_cpu_engine() {
        let Some((dev, _)) = device() else { return };
        step_matches_the_cpu_engine(true);
        let _l = lock();
        let enc = model_with(true);
        let (ids, types, mask, labels) = batch();
        let mut st = enc.state(3);
        st.load(&ids, &types, &mask, &labels).unwrap();
        enc.forward(&mut st, false, 0).unwrap();
        let plan = device_plan(dev, &enc);
        plan.record_eval_forward(dev).unwrap();
        assert_close(
            "pre-LN logits",
            &plan.logits(dev).unwrap(),
            st.logits(),
            1e-4,
        );
    }

    /// Dead layers (`rank.min_rank = 0` lets a bond lose every active entry): the truncation
    /// keeps one pruned slice on such a bond, and the CPU layer then skips its contraction (a
    /// TT layer outputs its bias, a TTM table zeros). The device computes the chain as it is,
    /// with that slice gated to exactly 0, so the layer's product is exactly 0 and every core
    /// and gate gradient of it exactly 0; one step of a model with a dead TT layer and a dead
    /// TTM table against the CPU's (the one-step tolerances, module doc), and the dead layers'
    /// cores and gates without a gradient on the device.
    #[test]
    fn dead_layers_step_as_on_the_cpu() {
        let Some((dev, _)) = device() else { return };
        let _l = lock();
        use comera_layers::Compressible;
        let mut enc = model();
        enc.visit_params_mut(&mut |p| {
            if p.name == "encoder.1.attn.o.gate.1" || p.name == "embeddings.word.gate.1" {
                p.value.fill(0.0);
            }
        });
        comera_optim::rank::truncate(&mut enc);
        let mut dead = Vec::new();
        enc.visit_compressible(&mut |l: &dyn Compressible| {
            if l.is_dead() {
                dead.push(l.layer_name().to_string());
            }
        });
        assert_eq!(
            dead,
            ["embeddings.word", "encoder.1.attn.o"],
            "the dead layers"
        );
        let mut cpu = enc.clone();
        let want = cpu_step(&mut cpu);
        let plan = device_plan(dev, &enc);
        assert_step_matches(dev, &enc, &plan, want, 3.0);
        let mut got = enc.clone();
        plan.arena
            .download(dev, true, |f| got.visit_params_mut(f))
            .unwrap();
        for p in got.params() {
            let of_dead = dead.iter().any(|l| p.name.starts_with(&format!("{l}.")));
            if of_dead && !p.name.ends_with(".bias") {
                assert!(
                    p.grad.iter().all(|&g| g == 0.0),
                    "{} has a gradient",
                    p.name
                );
            }
        }
    }

    fn step_matches_the_cpu_engine(pre_ln: bool) {
        let Some((dev, _)) = device() else { return };
        let _l = lock();
        let enc = model_with(pre_ln);
        let mut cpu = enc.clone();
        let want = cpu_step(&mut cpu);
        let plan = device_plan(dev, &enc);
        assert_step_matches(dev, &enc, &plan, want, 3.0);
    }

    /// One recorded step of `plan` (from `enc`, batch loaded) against the CPU's `want`
    /// (module doc's tolerances); `count` predictions.
    fn assert_step_matches(
        dev: &Device,
        enc: &Encoder,
        plan: &EncoderPlan,
        want: CpuStep,
        count: f64,
    ) {
        plan.record_step(dev).unwrap();
        assert_plan_matches(dev, enc, plan, want, count);
    }

    /// The step `plan` (from `enc`) took against the CPU's `want`: its statistics, gradients
    /// and parameters (module doc's tolerances); `count` predictions.
    fn assert_plan_matches(
        dev: &Device,
        enc: &Encoder,
        plan: &EncoderPlan,
        (loss, norm, clip, grads, after): CpuStep,
        count: f64,
    ) {
        let stats = plan.stats(dev).unwrap();
        println!(
            "loss {} (CPU {loss}), grad norm {} (CPU {norm})",
            stats.loss, stats.grad_norm
        );
        assert!((stats.loss - loss).abs() <= 1e-4 * loss.abs(), "loss");
        assert!(
            (stats.grad_norm - norm).abs() <= 1e-4 * norm,
            "gradient norm"
        );
        assert_eq!(stats.count, count);
        let mut got = enc.clone();
        plan.arena
            .download(dev, true, |f| got.visit_params_mut(f))
            .unwrap();
        let sc = step_config();
        for ((g, c), a) in got.params().iter().zip(&grads).zip(&after) {
            assert_eq!(g.name, c.name);
            let gmax = c.grad.iter().fold(0f32, |m, v| m.max(v.abs()));
            let gtol = 1e-3 * gmax.max(1e-6);
            assert_close(&format!("grad {}", c.name), &g.grad, &c.grad, 1e-3);
            let lr = match c.kind {
                ParamKind::TtCore => sc.lr_cores,
                ParamKind::RankGate => sc.lr_gates,
                ParamKind::Other => sc.lr_other,
            };
            for (i, ((&w, &want), &gc)) in g.value.iter().zip(&a.value).zip(&c.grad).enumerate() {
                let (c_, eps) = (clip as f64, sc.eps as f64);
                let g_lo = (gc.abs() as f64 - gtol as f64).max(0.0);
                let du = if g_lo == 0.0 {
                    2.0
                } else {
                    (c_ * gtol as f64 * eps / (c_ * g_lo + eps).powi(2) + 1e-4).min(2.0)
                };
                let allowed = lr as f64 * du + 1e-6 * (want.abs() as f64).max(1.0);
                assert!(
                    ((w - want).abs() as f64) <= allowed,
                    "{}[{i}] after the update: {w} vs the CPU's {want} (gradient {gc}, allowed {allowed:.2e})",
                    c.name
                );
            }
        }
    }

    /// One training step of a masked-LM model against the CPU's, two ways: a TT/TTM body
    /// with a TT decoder wider than the vocabulary (240 logits for 200 ids: the padding
    /// logits at −∞), post-LN; and a dense pre-LN body with the decoder tied to the word
    /// table (its gradient gets the decoder's and the embedding's shares). 10 of the head's
    /// 12 rows are predicted (the rest padded and ignored), one sequence with padding.
    /// Tolerances: the classifier step's (module doc); the head adds four operations (the
    /// transform, GELU, LN, the decoder) to a chain of the same kind.
    /// A masked-LM batch of [`batch`]'s ids and mask: 4 rows per sequence, 10 positions picked
    /// (the second sequence predicts 2: its head rows are padded), labels at them; with the
    /// positions and the rows per sequence.
    fn mlm_batch() -> (Vec<u32>, Vec<u32>, Vec<i32>, Vec<u32>, usize) {
        let (ids, _, mask, _) = batch();
        let t = 16usize;
        let picks: [&[usize]; 3] = [&[1, 4, 9, 13], &[2, 5], &[0, 3, 7, 15]];
        let selected: Vec<u32> = picks
            .iter()
            .enumerate()
            .flat_map(|(s, p)| p.iter().map(move |&q| (s * t + q) as u32))
            .collect();
        let mut labels = vec![comera_layers::loss::IGNORE_INDEX; ids.len()];
        for &p in &selected {
            labels[p as usize] = ((p * 13 + 5) % 200) as i32;
        }
        (ids, mask, labels, selected, 4)
    }

    /// The masked-LM models of the MLM tests: a TT/TTM body with a padded TT decoder, and a
    /// dense pre-LN body with a tied decoder.
    fn mlm_configs() -> [(&'static str, EncoderConfig); 2] {
        use comera_model::config::{HeadKind, MlmDecoderKind};
        [
            (
                "TT decoder",
                EncoderConfig {
                    head: HeadKind::Mlm,
                    mlm_decoder: MlmDecoderKind::Tt,
                    mlm_decoder_tt: LayerTt::uniform(&[4, 8], &[5, 8, 6], 3),
                    ..config()
                },
            ),
            (
                "tied decoder, pre-LN",
                EncoderConfig {
                    head: HeadKind::Mlm,
                    mlm_decoder: MlmDecoderKind::Tied,
                    tt_linear: false,
                    ttm_embedding: false,
                    pre_ln: true,
                    ..config()
                },
            ),
        ]
    }

    #[test]
    fn one_mlm_step_matches_the_cpu_engine() {
        let Some((dev, _)) = device() else { return };
        let (ids, mask, labels, selected, per_seq) = mlm_batch();
        let t = 16;
        for (what, cfg) in mlm_configs() {
            let _l = lock();
            println!("{what}");
            let enc = model_of(&cfg);
            let mut cpu = enc.clone();
            let mut st = cpu.state_for(3, t, per_seq).unwrap();
            st.load_mlm(&ids, &mask, &labels, &selected).unwrap();
            let want = cpu_step_on(&mut cpu, st);
            let opt = StepConfig {
                mlm_rows_per_seq: per_seq,
                ..step_config()
            };
            let mut plan = EncoderPlan::new(dev, &enc, SEED, 3, t, opt).unwrap();
            assert_eq!(plan.head_rows(), 12);
            plan.load_mlm(dev, &ids, &mask, &labels, &selected).unwrap();
            plan.set_step(dev, STEP, 1, 1.0).unwrap();
            assert_step_matches(dev, &enc, &plan, want, selected.len() as f64);
        }
    }

    /// A masked-LM model's evaluation pass through a session opened for inference (what
    /// `comera eval` and `predict --device cuda` run) against the CPU's
    /// `Encoder::forward(st, false, _)`: the loss over the labelled positions within 1e-5
    /// relative, the correct and counted positions exactly; the logits at the positions (the
    /// first rows of `mlm_logits`) within the forward's bound, 1e-4 of the largest (see
    /// `inference_logits_match_the_cpu_forward_without_dropout`; the loss is a mean of
    /// log-softmaxes of those logits, within twice that bound of magnitudes ≤ 10 here, and the
    /// f64 sums agree). Graph and eager give the same bits; a second batch is read from device
    /// memory.
    #[test]
    fn mlm_evaluation_matches_the_cpu_forward() {
        if device().is_none() {
            return;
        }
        use comera_cuda::engine::EncoderSession;
        let (ids, mask, labels, selected, per_seq) = mlm_batch();
        let t = 16;
        let ids2: Vec<u32> = ids.iter().map(|&i| (i * 7 + 3) % 200).collect();
        for (what, cfg) in mlm_configs() {
            let _l = lock();
            let enc = model_of(&cfg);
            let width = match &enc.head {
                comera_model::Head::Mlm(h) => h.width(),
                _ => unreachable!("an MLM config"),
            };
            let cpu = |ids: &[u32]| {
                let mut st = enc.state_for(3, t, per_seq).unwrap();
                st.load_mlm(ids, &mask, &labels, &selected).unwrap();
                let s = enc.forward(&mut st, false, 0).unwrap();
                (s, st.logits()[..selected.len() * width].to_vec())
            };
            let mut graph = EncoderSession::for_inference(0, &enc, 3, t, per_seq).unwrap();
            let mut eager = EncoderSession::for_inference(0, &enc, 3, t, per_seq).unwrap();
            eager.use_graph = false;
            for (k, i) in [&ids, &ids2, &ids].into_iter().enumerate() {
                let (want, want_logits) = cpu(i);
                let got = graph.mlm_eval((i, &mask, &labels, &selected)).unwrap();
                let e = eager.mlm_eval((i, &mask, &labels, &selected)).unwrap();
                assert_eq!(got.0.to_bits(), e.0.to_bits(), "{what} {k}: graph vs eager");
                assert_eq!(
                    (got.1, got.2),
                    (want.correct as f64, want.count as f64),
                    "{what} {k}: correct, counted"
                );
                let rel = (got.0 - want.loss).abs() / want.loss.abs().max(1e-6);
                assert!(rel <= 1e-5, "{what} {k}: loss {} vs {}", got.0, want.loss);
                let logits = graph.mlm_logits((i, &mask, &selected)).unwrap();
                let logits = &logits[..selected.len() * width];
                let finite = |v: &[f32]| {
                    v.iter()
                        .map(|&x| if x.is_finite() { x } else { 0.0 })
                        .collect::<Vec<_>>()
                };
                assert_eq!(
                    logits.iter().map(|x| x.is_finite()).collect::<Vec<_>>(),
                    want_logits
                        .iter()
                        .map(|x| x.is_finite())
                        .collect::<Vec<_>>(),
                    "{what} {k}: the padding logits (−∞) in the same places"
                );
                assert_close(
                    &format!("{what} {k}: logits"),
                    &finite(logits),
                    &finite(&want_logits),
                    1e-4,
                );
            }
        }
    }

    /// The memory estimate made before allocating ([`PlanMemory::of`]) is what the plan's
    /// construction allocates, byte for byte, for every kind of plan: TT/TTM and dense,
    /// post- and pre-LN, a classifier and masked-LM heads (a padded TT decoder, a tied one),
    /// with and without the rank schedule, and for inference only.
    #[test]
    fn the_plan_allocates_exactly_its_estimate() {
        let Some((dev, _)) = device() else { return };
        use comera_cuda::engine::{PlanMemory, RankSettings};
        use comera_model::config::{HeadKind, MlmDecoderKind};
        let dense = EncoderConfig {
            tt_linear: false,
            ttm_embedding: false,
            ..config()
        };
        for (what, cfg) in [
            ("TT/TTM classifier", config()),
            (
                "dense pre-LN classifier",
                EncoderConfig {
                    pre_ln: true,
                    ..dense.clone()
                },
            ),
            (
                "masked LM, TT decoder",
                EncoderConfig {
                    head: HeadKind::Mlm,
                    mlm_decoder: MlmDecoderKind::Tt,
                    mlm_decoder_tt: LayerTt::uniform(&[4, 8], &[5, 8, 6], 3),
                    ..config()
                },
            ),
            (
                "masked LM, tied decoder, pre-LN",
                EncoderConfig {
                    head: HeadKind::Mlm,
                    mlm_decoder: MlmDecoderKind::Tied,
                    pre_ln: true,
                    ..dense.clone()
                },
            ),
        ] {
            let _l = lock();
            let enc = model_of(&cfg);
            let rank = RankSettings::early_stage(&enc, 0.01);
            for opt in [
                step_config(),
                StepConfig {
                    rank,
                    mlm_rows_per_seq: 4,
                    ..step_config()
                },
                StepConfig {
                    forward_only: true,
                    ..step_config()
                },
            ] {
                let want = PlanMemory::of(&enc, 3, 16, &opt).unwrap();
                let plan = EncoderPlan::new(dev, &enc, SEED, 3, 16, opt.clone()).unwrap();
                assert_eq!(
                    plan.device_bytes(),
                    want.total(),
                    "{what} (rank schedule: {}, forward only: {}): allocated {} bytes, \
                     estimated {want:?}",
                    opt.rank.is_some(),
                    opt.forward_only,
                    plan.device_bytes()
                );
            }
        }
    }

    /// Without the rank schedule the gates are constants, as on the CPU (`RankController::apply`
    /// zeroes their gradients before clipping): after a step they hold their values bit for
    /// bit, with zero gradients and moments, and the gradient norm is the CPU's over the rest.
    #[test]
    fn gates_stay_constant_without_the_rank_schedule() {
        let Some((dev, _)) = device() else { return };
        let _l = lock();
        let enc = model();
        let mut cpu = enc.clone();
        let (ids, types, mask, labels) = batch();
        let mut st = cpu.state(3);
        st.load(&ids, &types, &mask, &labels).unwrap();
        cpu.zero_grad();
        cpu.forward(&mut st, true, STEP).unwrap();
        cpu.backward(&mut st);
        cpu.visit_params_mut(&mut |p| {
            if p.kind == ParamKind::RankGate {
                p.grad.fill(0.0);
            }
        });
        let (_, norm) = comera_optim::clip_scale(0.0, |f| cpu.visit_params_mut(f));
        let opt = StepConfig {
            train_gates: false,
            ..step_config()
        };
        let mut plan = EncoderPlan::new(dev, &enc, SEED, 3, 16, opt).unwrap();
        plan.load(dev, &ids, &types, &mask, &labels).unwrap();
        plan.set_step(dev, STEP, 1, 1.0).unwrap();
        plan.record_step(dev).unwrap();
        let stats = plan.stats(dev).unwrap();
        assert!(
            (stats.grad_norm - norm).abs() <= 1e-4 * norm,
            "gradient norm {} vs the CPU's {norm} without the gates",
            stats.grad_norm
        );
        let mut got = enc.clone();
        plan.arena
            .download(dev, true, |f| got.visit_params_mut(f))
            .unwrap();
        for (g, before) in got.params().iter().zip(enc.params()) {
            if g.kind == ParamKind::RankGate {
                assert_eq!(g.value, before.value, "{} moved", g.name);
                assert!(
                    g.grad.iter().all(|&v| v == 0.0),
                    "{} has a gradient",
                    g.name
                );
            }
        }
        let m = plan.arena.download_flat(dev, Which::M).unwrap();
        for t in plan
            .arena
            .tensors
            .iter()
            .filter(|t| t.kind == ParamKind::RankGate)
        {
            assert!(
                m[t.offset..t.offset + t.len].iter().all(|&v| v == 0.0),
                "{} moments",
                t.name
            );
        }
    }

    /// The device's settings of the CPU controller `rc` made from `cfg` (comera-train's
    /// `device::rank_settings`, which this crate cannot reach).
    fn rank_settings(
        cfg: &comera_optim::rank::RankConfig,
        rc: &comera_optim::rank::RankController,
    ) -> comera_cuda::engine::RankSettings {
        comera_cuda::engine::RankSettings {
            gamma: cfg.gamma,
            beta: cfg.beta,
            rho_loss: cfg.rho_loss,
            rho_size: cfg.rho_size,
            target_loss: cfg.target_loss,
            size_weight: cfg.size_weight,
            s_ref: rc.s_ref,
            layer_prefix: cfg.layer_prefix.clone(),
            min_rank: cfg.min_rank,
            normalise_gates: cfg.normalise_gates,
        }
    }

    /// What a step left in a plan, as bits: its loss and gradient norm, and the flat
    /// parameters, gradients and both moments.
    type StepBits = ([u64; 2], [Vec<u32>; 4]);

    fn step_bits(dev: &Device, plan: &EncoderPlan) -> StepBits {
        let s = plan.stats(dev).unwrap();
        let flat = |w| -> Vec<u32> {
            let v = plan.arena.download_flat(dev, w).unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        };
        (
            [s.loss.to_bits(), s.grad_norm.to_bits()],
            [Which::Value, Which::Grad, Which::M, Which::V].map(flat),
        )
    }

    /// `got` is `want` bit for bit; a difference is named.
    fn assert_same_step(got: &StepBits, want: &StepBits) {
        assert!(got.0 == want.0, "loss or gradient norm differ");
        for (i, what) in ["parameters", "gradients", "first moments", "second moments"]
            .iter()
            .enumerate()
        {
            assert!(got.1[i] == want.1[i], "{what} differ");
        }
    }

    /// A second batch for [`batch`]'s shape: other ids and labels, padding in the first
    /// sequence.
    fn second_batch() -> (Vec<u32>, Vec<u32>, Vec<u32>, Vec<usize>) {
        let (b, t) = (3, 16);
        let (ids, types, _, _) = batch();
        let ids = ids.iter().map(|&i| (i * 7 + 13) % 200).collect();
        let mask = (0..b * t)
            .map(|i| !(i / t == 0 && i % t >= 9) as u32)
            .collect();
        (ids, types, mask, vec![1, 1, 0])
    }

    /// Gradient accumulation (`train.accumulate_steps = 2`): [`batch`] and [`second_batch`]
    /// as two micro-batches, then one update, against the CPU's `Stepper::step_accumulated` on
    /// the same two (dropout steps 2·STEP and 2·STEP + 1; without the rank schedule, so the
    /// gates are constants on both sides): the loss over all 6 predictions, the gradient norm,
    /// the gradients and the parameters after, within the one-step tolerances (the micro-batch
    /// factors, 3/3 and 3/6, are exact on both sides). Then the same step from the same start
    /// with the micro-batch and update graphs captured once and replayed (the second replay
    /// must read the second batch and dropout step from device memory) gives the uncaptured
    /// step's bits.
    #[test]
    fn an_accumulated_step_matches_the_cpu_stepper() {
        let Some((dev, _)) = device() else { return };
        let _l = lock();
        let enc = model();
        let micro = [batch(), second_batch()];
        // The CPU's accumulated step.
        let mut cpu = enc.clone();
        let sc = step_config();
        let optimizer = comera_optim::Optimizer::new(adam_config(), None, &mut cpu);
        let rank = comera_optim::rank::RankController::new(
            &comera_optim::rank::RankConfig {
                enabled: false,
                ..Default::default()
            },
            &cpu,
        );
        let schedule = comera_optim::Schedule {
            warmup: 0,
            total: u64::MAX,
            decay: comera_optim::Decay::Constant,
        };
        let threshold = cpu.cfg.threshold;
        let mut stepper =
            comera_optim::Stepper::new(optimizer, rank, schedule, sc.max_grad_norm, threshold);
        let mut st = cpu.state(3);
        let (ids, types, mask, labels) = &micro[0];
        st.load(ids, types, mask, labels).unwrap();
        let mut load_second = |st: &mut comera_model::EncoderState| {
            let (ids, types, mask, labels) = &micro[1];
            st.load(ids, types, mask, labels).unwrap();
            Ok(true)
        };
        let report = stepper
            .step_accumulated(&mut cpu, &mut st, STEP, 2, &mut load_second)
            .unwrap();
        assert_eq!(report.stats.count, 6);
        let norm = report.grad_norm;
        let clip = if norm > sc.max_grad_norm as f64 {
            (sc.max_grad_norm as f64 / norm) as f32
        } else {
            1.0
        };
        // Its gradients (the gates' zeroed, as the device's without the schedule) and the
        // parameters after the update.
        let grads: Vec<Param> = cpu.params().into_iter().cloned().collect();
        let want = (report.stats.loss, norm, clip, grads.clone(), grads);
        // The device's, launched one by one.
        let opt = StepConfig {
            train_gates: false,
            ..step_config()
        };
        let mut plan = EncoderPlan::new(dev, &enc, SEED, 3, 16, opt).unwrap();
        let accumulate = |plan: &mut EncoderPlan, graphs: Option<(&CudaGraph, &CudaGraph)>| {
            plan.begin_accumulation(dev).unwrap();
            for (i, (ids, types, mask, labels)) in micro.iter().enumerate() {
                plan.load(dev, ids, types, mask, labels).unwrap();
                plan.set_dropout_step(dev, 2 * STEP + i as u64).unwrap();
                match graphs {
                    Some((m, _)) => m.launch().unwrap(),
                    None => plan.record_micro(dev).unwrap(),
                }
            }
            plan.set_update_scalars(dev, 1, 1.0).unwrap();
            match graphs {
                Some((_, a)) => a.launch().unwrap(),
                None => plan.record_apply(dev).unwrap(),
            }
        };
        accumulate(&mut plan, None);
        assert_plan_matches(dev, &enc, &plan, want, 6.0);
        let eager = step_bits(dev, &plan);
        // Back to the same start (parameters from the model, zero moments; the gradients are
        // zeroed by the step), the two graphs captured once and replayed.
        plan.arena.upload(dev, &enc.params()).unwrap();
        let micro_graph = dev.capture(|d| plan.record_micro(d)).unwrap();
        let apply_graph = dev.capture(|d| plan.record_apply(d)).unwrap();
        accumulate(&mut plan, Some((&micro_graph, &apply_graph)));
        dev.stream().synchronize().unwrap();
        assert_same_step(&step_bits(dev, &plan), &eager);
    }

    /// A step whose gradient norm is not finite (a NaN planted in a bias) changes no parameter
    /// and no moment, as on the CPU (the host then reports the divergence): with clipping off
    /// (`max_grad_norm` 0, where AdamW once read no clip factor and wrote NaN everywhere) and
    /// on, and with the rank schedule, whose projection after the update (min_rank, the gates'
    /// normalisation) is skipped too.
    #[test]
    fn a_step_with_a_non_finite_gradient_changes_nothing() {
        let Some((dev, _)) = device() else { return };
        let _l = lock();
        use comera_cuda::engine::RankSettings;
        use comera_optim::rank::{RankConfig, RankController};
        let mut enc = model();
        enc.visit_params_mut(&mut |p| {
            if p.name == "encoder.1.ffn.down.bias" {
                p.value[0] = f32::NAN;
            }
        });
        let rank_cfg = RankConfig::default();
        let rc = RankController::new(&rank_cfg, &enc);
        let settings = RankSettings {
            min_rank: 2,
            normalise_gates: true,
            ..rank_settings(&rank_cfg, &rc)
        };
        let (ids, types, mask, labels) = batch();
        for (max_grad_norm, rank) in [(0.0, None), (1.0, None), (0.0, Some(settings))] {
            let case = format!("max_grad_norm {max_grad_norm}, rank {}", rank.is_some());
            let opt = StepConfig {
                max_grad_norm,
                freeze_gates_at: rank.as_ref().map(|_| enc.cfg.threshold),
                rank,
                ..step_config()
            };
            let mut plan = EncoderPlan::new(dev, &enc, SEED, 3, 16, opt).unwrap();
            plan.load(dev, &ids, &types, &mask, &labels).unwrap();
            plan.set_step(dev, STEP, 1, 1.0).unwrap();
            let bits = |w| -> Vec<u32> {
                let v = plan.arena.download_flat(dev, w).unwrap();
                v.iter().map(|x| x.to_bits()).collect()
            };
            let before = bits(Which::Value);
            plan.record_step(dev).unwrap();
            let stats = plan.stats(dev).unwrap();
            assert!(
                !stats.grad_norm.is_finite(),
                "{case}: norm {}",
                stats.grad_norm
            );
            assert!(bits(Which::Value) == before, "{case}: parameters changed");
            for w in [Which::M, Which::V] {
                assert!(bits(w).iter().all(|&b| b == 0), "{case}: moments changed");
            }
        }
    }

    /// The test model's plan after one uncaptured step, set back to that step's start
    /// (parameters from the model, zero moments and gradients), and that step's bits.
    fn a_step_and_back_to_its_start(dev: &Device) -> (EncoderPlan, StepBits) {
        let enc = model();
        let mut plan = device_plan(dev, &enc);
        plan.record_step(dev).unwrap();
        let bits = step_bits(dev, &plan);
        plan.arena.upload(dev, &enc.params()).unwrap();
        plan.set_step(dev, STEP, 1, 1.0).unwrap();
        (plan, bits)
    }

    /// The whole step captured as one CUDA graph and replayed gives the uncaptured step's
    /// loss, gradient norm, parameters and moments bit for bit.
    #[test]
    fn a_captured_step_replays_bit_for_bit() {
        let Some((dev, _)) = device() else { return };
        let _l = lock();
        let (plan, want) = a_step_and_back_to_its_start(dev);
        let graph = dev.capture(|d| plan.record_step(d)).unwrap();
        graph.launch().unwrap();
        dev.stream().synchronize().unwrap();
        assert_same_step(&step_bits(dev, &plan), &want);
    }

    /// The step profiler (`bench step --device cuda --ops`) times every operation of a step
    /// and changes none of its results: the profiled step gives the plain eager step's bits,
    /// and its operations are those of the step, each timed, in parts of the step that the
    /// encoder names.
    #[test]
    fn a_profiled_step_times_every_operation_and_gives_the_same_bits() {
        let Some((dev, _)) = device() else { return };
        let _l = lock();
        use comera_cuda::engine::Profile;
        let (plan, want) = a_step_and_back_to_its_start(dev);
        let profile = Profile::run(dev, |d| plan.record_step(d)).unwrap();
        assert_same_step(&step_bits(dev, &plan), &want);
        assert!(profile.ops.len() > 50, "{} operations", profile.ops.len());
        assert!(
            profile.ops.iter().all(|o| o.ms.is_finite() && o.ms >= 0.0),
            "every operation timed"
        );
        let scopes: Vec<_> = profile.by_scope().into_iter().map(|t| t.label).collect();
        for part in ["fwd ffn", "bwd attention", "loss", "update"] {
            assert!(scopes.iter().any(|s| s == part), "{part} among {scopes:?}");
        }
        // Outside the profile, nothing is timed: a capture still works.
        let graph = dev.capture(|d| plan.record_step(d)).unwrap();
        graph.launch().unwrap();
        dev.stream().synchronize().unwrap();
    }

    /// Two steps on two different batches through the session: replaying the captured graph
    /// (the second replay must read the second batch, step and scalars from device memory)
    /// gives the same bits as queuing the launches eagerly; and the parameters and moments
    /// downloaded by name resume a fresh session that then takes the same third step.
    #[test]
    fn session_replays_new_batches_and_resumes_by_name() {
        if device().is_none() {
            return;
        }
        let _l = lock();
        use comera_cuda::engine::EncoderSession;
        let enc = model();
        let (ids, types, mask, labels) = batch();
        let ids2: Vec<u32> = ids.iter().map(|&i| (i * 7 + 3) % 200).collect();
        let labels2 = vec![1, 2, 0];
        let run = |graph: bool, steps: usize| {
            let mut s = EncoderSession::new(0, &enc, SEED, 3, 16, step_config()).unwrap();
            s.use_graph = graph;
            let mut losses = Vec::new();
            for k in 0..steps {
                let (i, l) = if k % 2 == 0 {
                    (&ids, &labels)
                } else {
                    (&ids2, &labels2)
                };
                let st = s.step((i, &types, &mask, l), STEP + k as u64, 1.0).unwrap();
                losses.push((st.loss.to_bits(), st.grad_norm.to_bits()));
            }
            (s, losses)
        };
        let (g, lg) = run(true, 2);
        let (e, le) = run(false, 2);
        assert_eq!(lg, le, "graph and eager losses");
        assert_ne!(lg[0], lg[1], "the second step saw another batch");
        let flat = arena_flat;
        assert!(
            flat(&g, Which::Value) == flat(&e, Which::Value),
            "parameters"
        );
        assert!(flat(&g, Which::M) == flat(&e, Which::M), "moments");
        // Resume: parameters and moments by name into a fresh session, then a third step.
        let mut host = enc.clone();
        g.download_into(&mut host).unwrap();
        let (moments, t) = g.moments().unwrap();
        assert_eq!(t, 2);
        let mut r = EncoderSession::new(0, &host, SEED, 3, 16, step_config()).unwrap();
        r.resume(&host, &moments, t).unwrap();
        let mut g = g;
        let a = g
            .step((&ids, &types, &mask, &labels), STEP + 2, 1.0)
            .unwrap();
        let b = r
            .step((&ids, &types, &mask, &labels), STEP + 2, 1.0)
            .unwrap();
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "resumed loss");
        assert!(
            flat(&g, Which::Value) == flat(&r, Which::Value),
            "resumed parameters"
        );
    }

    /// A session reshaped for a new phase (batch 3 × 16 → 2 × 8, `EncoderSession::reshape`)
    /// steps as a fresh session at that shape given the first one's parameters, moments and
    /// t: the same loss, norm and parameters bit for bit; and asking for the shape it has
    /// plans nothing again. The shapes of later phases are checked against the free memory
    /// before a run starts (`check_shapes_fit`): an absurd one is refused by name; and a
    /// reshape to a shape the model cannot take or the memory cannot hold is refused while the
    /// session keeps its plan.
    #[test]
    fn a_reshaped_session_steps_as_a_fresh_one_at_the_new_shape() {
        if device().is_none() {
            return;
        }
        let _l = lock();
        use comera_cuda::engine::EncoderSession;
        let enc = model();
        let (ids, types, mask, labels) = batch();
        let mut a = EncoderSession::new(0, &enc, SEED, 3, 16, step_config()).unwrap();
        a.step((&ids, &types, &mask, &labels), STEP, 1.0).unwrap();
        let before = a.plan().unwrap().device_bytes();
        a.reshape(&enc, (3, 16), 0).unwrap();
        assert_eq!(
            a.plan().unwrap().device_bytes(),
            before,
            "the same shape: no new plan"
        );
        a.reshape(&enc, (2, 8), 0).unwrap();
        assert_eq!(a.shape(), (2, 8));
        let mut host = enc.clone();
        a.download_into(&mut host).unwrap();
        let (moments, t) = a.moments().unwrap();
        let mut b = EncoderSession::new(0, &host, SEED, 2, 8, step_config()).unwrap();
        b.resume(&host, &moments, t).unwrap();
        let half = |v: &[u32]| -> Vec<u32> {
            (0..2)
                .flat_map(|s| v[s * 16..s * 16 + 8].to_vec())
                .collect()
        };
        let small = (
            half(&ids),
            half(&types),
            half(&mask),
            vec![labels[0], labels[1]],
        );
        let sa = a
            .step((&small.0, &small.1, &small.2, &small.3), STEP + 1, 1.0)
            .unwrap();
        let sb = b
            .step((&small.0, &small.1, &small.2, &small.3), STEP + 1, 1.0)
            .unwrap();
        assert_eq!(
            (sa.loss.to_bits(), sa.grad_norm.to_bits()),
            (sb.loss.to_bits(), sb.grad_norm.to_bits()),
            "the reshaped session's step"
        );
        let flat = |s: &EncoderSession| arena_flat(s, Which::Value);
        assert!(flat(&a) == flat(&b), "parameters after the reshaped step");
        assert!(a.check_shapes_fit(&enc, &[(2, 8, 0), (3, 16, 0)]).is_ok());
        let e = a.check_shapes_fit(&enc, &[(1 << 20, 16, 0)]).unwrap_err();
        assert!(matches!(e, CudaError::OutOfMemory { .. }), "{e}");
        assert!(e.to_string().contains("batch 1048576 × 16"), "{e}");
        // A shape the model cannot take, or one that cannot fit, is refused before the plan
        // goes: the session keeps its shape and steps on.
        assert!(
            a.reshape(&enc, (2, 17), 0).is_err(),
            "longer than the positions"
        );
        assert!(
            a.reshape(&enc, (1 << 20, 16), 0).is_err(),
            "beyond the memory"
        );
        assert_eq!(a.shape(), (2, 8));
        a.step((&small.0, &small.1, &small.2, &small.3), STEP + 2, 1.0)
            .unwrap();
    }

    /// The evaluation pass (dropout off, no loss) through a session opened for inference,
    /// against the CPU's `Encoder::forward(st, false, _)` logits on two batches of the model
    /// above (dropout 0.1 in its config: a pass that kept dropout on would miss by O(1)).
    ///
    /// Tolerance: 1e-4 of the largest logit (SPEC §6's form), the forward's bound derived in
    /// this module's doc — ≈ 25 chained operations to the logits, each a reordered f32 sum
    /// of at most 64 terms (≤ 4e-6 of its terms' magnitudes) or an `expf`/`tanhf` of a few
    /// ulp; the pass here is exactly the step's forward minus the dropout launches, so the
    /// step test's forward bound holds unchanged. A wrong index, mask or layout is O(1).
    ///
    /// Also: the captured pass gives the eager launches' logits bit for bit and reads each
    /// replay's batch from device memory (three calls, two batches); a session opened for
    /// inference refuses a training step; and an evaluation pass between training steps
    /// changes nothing of the training (the next step's loss, norm and parameters are those
    /// of a session that never evaluated).
    #[test]
    fn inference_logits_match_the_cpu_forward_without_dropout() {
        if device().is_none() {
            return;
        }
        let _l = lock();
        use comera_cuda::engine::EncoderSession;
        let enc = model();
        let (ids, types, mask, labels) = batch();
        let ids2: Vec<u32> = ids.iter().map(|&i| (i * 7 + 3) % 200).collect();
        let cpu = |ids: &[u32]| {
            let mut st = enc.state(3);
            st.load(ids, &types, &mask, &labels).unwrap();
            enc.forward(&mut st, false, 0).unwrap();
            st.logits().to_vec()
        };
        let (want1, want2) = (cpu(&ids), cpu(&ids2));
        assert_ne!(want1, want2, "two batches with different logits");
        let mut graph = EncoderSession::for_inference(0, &enc, 3, 16, 0).unwrap();
        let mut eager = EncoderSession::for_inference(0, &enc, 3, 16, 0).unwrap();
        eager.use_graph = false;
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (k, (i, want)) in [(&ids, &want1), (&ids2, &want2), (&ids, &want1)]
            .into_iter()
            .enumerate()
        {
            let g = graph.logits((i, &types, &mask)).unwrap();
            let e = eager.logits((i, &types, &mask)).unwrap();
            assert_eq!(g.len(), 3 * 3, "B × C logits");
            assert!(
                bits(&g) == bits(&e),
                "call {k}: graph and eager logits differ"
            );
            assert_close(&format!("logits of call {k}"), &g, want, 1e-4);
        }
        let e = graph
            .step((&ids, &types, &mask, &labels), STEP, 1.0)
            .unwrap_err();
        assert!(e.to_string().contains("inference only"), "{e}");
        // An evaluation pass between training steps leaves the training as it was.
        let mut a = EncoderSession::new(0, &enc, SEED, 3, 16, step_config()).unwrap();
        let mut b = EncoderSession::new(0, &enc, SEED, 3, 16, step_config()).unwrap();
        a.step((&ids, &types, &mask, &labels), STEP, 1.0).unwrap();
        b.step((&ids, &types, &mask, &labels), STEP, 1.0).unwrap();
        a.logits((&ids2, &types, &mask)).unwrap();
        let sa = a
            .step((&ids2, &types, &mask, &labels), STEP + 1, 1.0)
            .unwrap();
        let sb = b
            .step((&ids2, &types, &mask, &labels), STEP + 1, 1.0)
            .unwrap();
        assert_eq!(
            (sa.loss.to_bits(), sa.grad_norm.to_bits()),
            (sb.loss.to_bits(), sb.grad_norm.to_bits()),
            "the step after an evaluation pass"
        );
        let flat = |s: &EncoderSession| arena_flat(s, Which::Value);
        assert!(
            bits(&flat(&a)) == bits(&flat(&b)),
            "parameters after an evaluation pass"
        );
    }

    /// The rank schedule inside the device's step against the CPU's `RankController`, in
    /// each of its four regimes: the early stage, the late stage's loss branch and size
    /// branch, and the gates held (`gates_after_steps`). With β ≠ 0, a layer prefix that
    /// leaves the TTM table out, `min_rank` 2 on a bond that has one active entry left (so
    /// the projection revives one), and the gates' normalisation on. A fifth case runs the
    /// early stage with `min_rank` 0 on a model with a dead TT layer inside the prefix (a bond
    /// without an active entry, after the truncation): its bond counts 0 in S and Ŝ, takes no
    /// gradient from Ŝ, and the projection revives nothing, as on the CPU.
    ///
    /// The learning rates are 0, so AdamW leaves every parameter's value as it was (w − 0·u)
    /// and the projection starts from the CPU's values: the parameters after the step
    /// (`min_rank`'s revived entries, the normalised gates, their left cores scaled by each
    /// bond's largest gate) must equal the CPU's exactly. S counts active entries and must match exactly;
    /// Ŝ is the same f64 sums in the same order (1e-12 relative). The weights w_L, w_S and the
    /// gradients after the objective carry the loss's and the gradients' own differences:
    /// 1e-4 relative and 1e-3 of each tensor's largest gradient (the module doc). Each case's
    /// targets put the late stage's two branches far apart, so the branch cannot flip on the
    /// loss's last digits.
    #[test]
    fn rank_schedule_step_matches_the_cpu_controller() {
        let Some((dev, _)) = device() else { return };
        let _l = lock();
        use comera_cuda::engine::{DeviceBranch, RankStep};
        use comera_optim::rank::{Branch, RankConfig, RankController, Stage};
        let mut enc = model();
        enc.visit_params_mut(&mut |p| {
            // One active entry left on this bond: min_rank 2 revives the largest pruned one.
            if p.name == "encoder.1.ffn.up.gate.2" {
                for (j, v) in p.value.iter_mut().enumerate() {
                    *v = if j == 0 { 0.8 } else { 0.002 * j as f32 };
                }
            }
        });
        let rank_cfg = RankConfig {
            gamma: 0.05,
            beta: 0.01,
            size_weight: 0.5,
            min_rank: 2,
            normalise_gates: true,
            layer_prefix: "encoder.".into(),
            ..RankConfig::default()
        };
        let (ids, types, mask, labels) = batch();
        // The CPU's forward and backward from `enc`: the data loss, gradients left in `cpu`.
        let cpu_backward = |cpu: &mut Encoder| {
            let mut st = cpu.state(3);
            st.load(&ids, &types, &mask, &labels).unwrap();
            cpu.zero_grad();
            let loss = cpu.forward(&mut st, true, STEP).unwrap().loss;
            cpu.backward(&mut st);
            loss
        };
        let loss0 = cpu_backward(&mut enc.clone());
        let s0 = RankController::new(&rank_cfg, &enc).sizes(&enc).0;
        let mut with_dead = enc.clone();
        with_dead.visit_params_mut(&mut |p| {
            if p.name == "encoder.0.attn.o.gate.1" {
                p.value.fill(0.0);
            }
        });
        comera_optim::rank::truncate(&mut with_dead);
        let mut dead = Vec::new();
        with_dead.visit_compressible(&mut |l: &dyn comera_layers::Compressible| {
            if l.is_dead() {
                dead.push(l.layer_name().to_string());
            }
        });
        assert_eq!(dead, ["encoder.0.attn.o"], "the dead layer");
        let base = enc;
        // (name, hold, late target S0 with target loss L0, the branch it must take, a dead
        // layer and min_rank 0)
        let cases = [
            ("early", false, None, Branch::Early, false),
            (
                "late, loss branch",
                false,
                Some((s0, 0.0)),
                Branch::Loss,
                false,
            ),
            (
                "late, size branch",
                false,
                Some((0.5 * s0, 10.0 * loss0)),
                Branch::Size,
                false,
            ),
            ("gates held", true, None, Branch::Early, false),
            ("a dead layer, min_rank 0", false, None, Branch::Early, true),
        ];
        for (what, hold, late, branch, dead) in cases {
            let enc = if dead {
                with_dead.clone()
            } else {
                base.clone()
            };
            let mut cfg = rank_cfg.clone();
            if dead {
                cfg.min_rank = 0;
            }
            if let Some((_, l0)) = late {
                cfg.target_loss = l0;
            }
            let mut rc = RankController::new(&cfg, &enc);
            if let Some((target, _)) = late {
                rc.stage = Stage::Late;
                rc.target_size = Some(target);
            }
            if hold {
                rc.cfg.gates_after_steps = STEP + 1;
            }
            // CPU: forward, backward, objective, (AdamW at rate 0: nothing), projection.
            let mut cpu = enc.clone();
            let loss = cpu_backward(&mut cpu);
            let obj = rc.apply(&mut cpu, loss, STEP);
            assert_eq!(obj.branch, branch, "{what}: the CPU's branch");
            let grads: Vec<Param> = cpu.params().into_iter().cloned().collect();
            let (_, norm) = comera_optim::clip_scale(1.0, |f| cpu.visit_params_mut(f));
            rc.project(&mut cpu);
            // The device.
            let settings = rank_settings(&cfg, &rc);
            let opt = StepConfig {
                lr_cores: 0.0,
                lr_gates: 0.0,
                lr_other: 0.0,
                freeze_gates_at: Some(enc.cfg.threshold),
                rank: Some(settings),
                ..step_config()
            };
            let mut plan = EncoderPlan::new(dev, &enc, SEED, 3, 16, opt).unwrap();
            plan.load(dev, &ids, &types, &mask, &labels).unwrap();
            plan.set_step(dev, STEP, 1, 1.0).unwrap();
            plan.set_rank_step(
                dev,
                RankStep {
                    hold,
                    late_target: late.map(|l| l.0),
                },
            )
            .unwrap();
            plan.record_step(dev).unwrap();
            let stats = plan.stats(dev).unwrap();
            let o = stats
                .objective
                .expect("the objective of a rank-schedule step");
            println!("{what}: device {o:?}, CPU {obj:?}");
            assert_eq!(o.size, obj.size, "{what}: S");
            assert!(
                (o.size_l1 - obj.size_l1).abs() <= 1e-12 * obj.size_l1,
                "{what}: Ŝ"
            );
            let want_branch = match obj.branch {
                Branch::Early => DeviceBranch::Early,
                Branch::Loss => DeviceBranch::Loss,
                Branch::Size => DeviceBranch::Size,
            };
            assert_eq!(o.branch, want_branch, "{what}: branch");
            for (name, got, want) in [("w_L", o.w_loss, obj.w_loss), ("w_S", o.w_size, obj.w_size)]
            {
                assert!(
                    (got - want).abs() <= 1e-4 * want.abs().max(1e-12),
                    "{what}: {name} {got} vs the CPU's {want}"
                );
            }
            assert!(
                (stats.grad_norm - norm).abs() <= 1e-4 * norm,
                "{what}: gradient norm {} vs the CPU's {norm}",
                stats.grad_norm
            );
            let mut got = enc.clone();
            plan.arena
                .download(dev, true, |f| got.visit_params_mut(f))
                .unwrap();
            for ((g, c), after) in got.params().iter().zip(&grads).zip(cpu.params()) {
                assert_close(&format!("{what}: grad {}", c.name), &g.grad, &c.grad, 1e-3);
                if hold && g.kind == ParamKind::RankGate {
                    assert!(g.grad.iter().all(|&v| v == 0.0), "{what}: {}", g.name);
                }
                assert!(
                    g.value == after.value,
                    "{what}: {} after the projection differs from the CPU's",
                    g.name
                );
            }
        }
    }

    /// A truncation (the host's) followed by `EncoderSession::resume` with the smaller model
    /// plans the step again at the new ranks: the next step's loss is the CPU's forward of the
    /// truncated model (1e-4 relative, the module doc), a second step replays the new graph,
    /// and the session's parameters are the truncated model's names and shapes. And the gates
    /// copied alone (`download_gates_into`) are those of a whole download.
    #[test]
    fn a_truncated_model_is_planned_again() {
        if device().is_none() {
            return;
        }
        let _l = lock();
        use comera_cuda::engine::{EncoderSession, Moments, RankSettings};
        use comera_optim::rank::{RankConfig, RankController};
        let enc = model();
        let rank_cfg = RankConfig::default();
        let rc = RankController::new(&rank_cfg, &enc);
        let opt = StepConfig {
            freeze_gates_at: Some(enc.cfg.threshold),
            rank: Some(RankSettings {
                layer_prefix: String::new(),
                min_rank: 1,
                normalise_gates: true,
                ..rank_settings(&rank_cfg, &rc)
            }),
            ..step_config()
        };
        let (ids, types, mask, labels) = batch();
        let mut s = EncoderSession::new(0, &enc, SEED, 3, 16, opt).unwrap();
        s.step((&ids, &types, &mask, &labels), STEP, 1.0).unwrap();
        let mut host = enc.clone();
        s.download_into(&mut host).unwrap();
        // model() pruned entries of encoder.0.attn.q and the TTM table: cut them.
        let changed = comera_optim::rank::truncate(&mut host);
        assert!(!changed.is_empty(), "the model has pruned slices to cut");
        let moments: Vec<Moments> = host
            .params()
            .iter()
            .map(|p| (p.name.clone(), vec![0.0; p.len()], vec![0.0; p.len()]))
            .collect();
        s.resume(&host, &moments, 1).unwrap();
        for (t, p) in s.plan().unwrap().arena.tensors.iter().zip(host.params()) {
            assert_eq!((&t.name, &t.shape), (&p.name, &p.shape));
        }
        let mut st = host.state(3);
        st.load(&ids, &types, &mask, &labels).unwrap();
        let want = host.forward(&mut st, true, STEP + 1).unwrap().loss;
        let a = s
            .step((&ids, &types, &mask, &labels), STEP + 1, 1.0)
            .unwrap();
        assert!(
            (a.loss - want).abs() <= 1e-4 * want.abs(),
            "loss after the truncation {} vs the CPU's {want}",
            a.loss
        );
        let b = s
            .step((&ids, &types, &mask, &labels), STEP + 2, 1.0)
            .unwrap();
        assert!(b.loss.is_finite() && b.objective.is_some());
        // The gates alone (gathered on the device) are the whole download's gates.
        let (mut gates, mut all) = (host.clone(), host.clone());
        s.download_gates_into(&mut gates).unwrap();
        s.download_into(&mut all).unwrap();
        for (g, a) in gates.params().iter().zip(all.params()) {
            if g.kind == ParamKind::RankGate {
                assert!(g.value == a.value, "{}", g.name);
            }
        }
    }
}
