//! Each kernel on a GPU against the CPU engine's own function (comera-layers, comera-optim).
//!
//! Runs where a CUDA device can be opened (driver, device, NVRTC); elsewhere each test prints
//! `skipped: no CUDA device (why)` and passes — unless `COMERA_REQUIRE_GPU=1`
//! (`tools/gpu/check.sh` sets it), where a device that cannot be opened fails every test.
//!
//! What is compared how:
//! - bit for bit where the GPU does the same IEEE operations in the same order as the CPU: the
//!   dropout masks (integer hashing), AdamW (element-wise, no FMA contraction on either side),
//!   the embedding gather and its segment-ordered backward, the residual sums, the gating of a
//!   core;
//! - within a tolerance elsewhere, as the reference cases are checked (SPEC §6):
//!   max|got − exp| ≤ tol · max(max|exp|, 1e-6). The sources of difference are the order of a
//!   reduction (a tree over a block instead of the CPU's 32 lanes; each f32 sum of n terms
//!   differs by at most ~n·2⁻²⁴ relative, far less in practice) and expf against the CPU's exp
//!   (a few ulp). Tolerances: 1e-5 where a row sum of up to 768 terms enters (LayerNorm,
//!   softmax), 2e-6 for element-wise transcendental functions (GELU), 1e-5 for sums of rows.

#![cfg(feature = "cuda")]

use comera_cuda::cudarc::driver::CudaSlice;
use comera_cuda::ops::{ttm_digit_segments, AdamConsts, AdamTensor, Segments, TtmLayout};
use comera_cuda::{CudaError, Device};
use comera_layers::{Layer, Param, ParamKind};
use std::sync::OnceLock;

/// The device every test shares (opened once: compiling the kernels takes seconds), or `None`
/// when there is none here.
fn device() -> Option<&'static Device> {
    static DEVICE: OnceLock<Result<Device, String>> = OnceLock::new();
    let required = std::env::var("COMERA_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match DEVICE.get_or_init(|| match Device::open(0) {
        Ok(d) => {
            let i = d.info();
            eprintln!(
                "cuda:0: {} ({}), driver CUDA {}",
                i.name, i.arch, i.driver_version
            );
            Ok(d)
        }
        Err(e) => match e {
            CudaError::NoDriver
            | CudaError::NoDevice
            | CudaError::DriverTooOld { .. }
            | CudaError::NoNvrtc => Err(e.to_string()),
            // A GPU is there but the engine cannot use it: that is a failure, not a skip.
            other => panic!("cuda:0 is present but could not be opened: {other}"),
        },
    }) {
        Ok(d) => Some(d),
        Err(why) => {
            assert!(!required, "COMERA_REQUIRE_GPU=1 but no CUDA device: {why}");
            println!("skipped: no CUDA device ({why})");
            None
        }
    }
}

fn up<T: comera_cuda::cudarc::driver::DeviceRepr>(dev: &Device, v: &[T]) -> CudaSlice<T> {
    dev.stream().clone_htod(v).unwrap()
}

fn zeros<
    T: comera_cuda::cudarc::driver::DeviceRepr + comera_cuda::cudarc::driver::ValidAsZeroBits,
>(
    dev: &Device,
    n: usize,
) -> CudaSlice<T> {
    dev.stream().alloc_zeros(n).unwrap()
}

fn down<T: comera_cuda::cudarc::driver::DeviceRepr + Default + Clone>(
    dev: &Device,
    d: &CudaSlice<T>,
) -> Vec<T> {
    dev.stream().clone_dtoh(d).unwrap()
}

fn normal(seed: u64, n: usize, std: f32) -> Vec<f32> {
    let mut rng = comera_tensor::init::rng(seed);
    let mut v = vec![0.0; n];
    comera_tensor::init::fill_normal(&mut rng, &mut v, std);
    v
}

/// SPEC §6's check: max|got − exp| ≤ tol · max(max|exp|, 1e-6).
#[track_caller]
fn close(name: &str, got: &[f32], exp: &[f32], tol: f32) {
    assert_eq!(got.len(), exp.len(), "{name}: lengths");
    let scale = exp.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
    let (mut worst, mut at) = (0.0f32, 0);
    for (i, (g, e)) in got.iter().zip(exp).enumerate() {
        let d = (g - e).abs();
        if d.is_nan() || d > worst {
            (worst, at) = (if d.is_nan() { f32::INFINITY } else { d }, i);
        }
    }
    println!("{name}: max |diff| {worst:.3e} (scale {scale:.3e})");
    assert!(
        worst <= tol * scale,
        "{name}: max |got − exp| = {worst:e} at {at} (got {}, expected {}) > {tol:e} · {scale:e}",
        got[at],
        exp[at]
    );
}

#[track_caller]
fn same_bits(name: &str, got: &[f32], exp: &[f32]) {
    assert_eq!(got.len(), exp.len(), "{name}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != exp[i].to_bits()) {
        panic!(
            "{name}: element {i} differs: got {} expected {}",
            got[i], exp[i]
        );
    }
    println!("{name}: same bits ({} values)", got.len());
}

#[test]
fn layer_norm_forward_and_backward_match_the_cpu() {
    let Some(dev) = device() else { return };
    for (rows, dim) in [(37, 768), (300, 50), (5, 1)] {
        let mut ln = comera_layers::norm::LayerNorm::new("ln", dim);
        ln.gamma.value = normal(1, dim, 1.0);
        ln.beta.value = normal(2, dim, 1.0);
        // A large mean: the two-pass variance must not cancel.
        let x: Vec<f32> = normal(3, rows * dim, 2.0)
            .iter()
            .map(|v| v + 30.0)
            .collect();
        let dy = normal(4, rows * dim, 1.0);
        let extra = normal(5, rows * dim, 1.0);
        let mut ws = ln.workspace(rows);
        let mut y = vec![0.0; rows * dim];
        ln.forward(&mut ws, &x, &mut y);
        // The CPU backward from dy + extra (what the GPU's `extra` adds as it reads).
        let dsum: Vec<f32> = dy.iter().zip(&extra).map(|(a, b)| a + b).collect();
        ln.gamma.grad = normal(6, dim, 1.0); // gradients accumulate
        ln.beta.grad = normal(7, dim, 1.0);
        let (g0, b0) = (ln.gamma.grad.clone(), ln.beta.grad.clone());
        let mut dx = vec![0.0; rows * dim];
        ln.backward(&mut ws, &x, &dsum, Some(&mut dx));

        let (gx, gg, gb) = (
            up(dev, &x),
            up(dev, &ln.gamma.value),
            up(dev, &ln.beta.value),
        );
        let (mut gy, mut gm, mut gr) = (zeros(dev, rows * dim), zeros(dev, rows), zeros(dev, rows));
        dev.layer_norm_forward(&gx, &gg, &gb, ln.eps, rows, &mut gy, &mut gm, &mut gr)
            .unwrap();
        let tag = format!("LayerNorm {rows}x{dim}");
        close(&format!("{tag} y"), &down(dev, &gy), &y, 1e-5);
        close(&format!("{tag} mean"), &down(dev, &gm), ws.mean(), 1e-5);
        close(&format!("{tag} rstd"), &down(dev, &gr), ws.rstd(), 1e-5);

        let (gdy, gex) = (up(dev, &dy), up(dev, &extra));
        let mut gdx = zeros(dev, rows * dim);
        let mut part = zeros(dev, Device::layer_norm_partial_len(rows, dim));
        let (mut gdg, mut gdb) = (up(dev, &g0), up(dev, &b0));
        dev.layer_norm_backward(
            &gx,
            &gdy,
            Some(&gex),
            &gm,
            &gr,
            &gg,
            rows,
            &mut gdx,
            &mut part,
            &mut gdg,
            &mut gdb,
        )
        .unwrap();
        close(&format!("{tag} dx"), &down(dev, &gdx), &dx, 1e-5);
        close(
            &format!("{tag} dgamma"),
            &down(dev, &gdg),
            &ln.gamma.grad,
            1e-5,
        );
        close(
            &format!("{tag} dbeta"),
            &down(dev, &gdb),
            &ln.beta.grad,
            1e-5,
        );
    }
}

#[test]
fn gelu_matches_the_cpu() {
    let Some(dev) = device() else { return };
    let (rows, w) = (33, 96);
    let n = rows * w;
    let x: Vec<f32> = normal(11, n, 3.0);
    let dy = normal(12, n, 1.0);
    let bias = normal(13, w, 1.0);
    let gelu = comera_layers::activation::Gelu;
    let (mut y, mut dx) = (vec![0.0; n], vec![0.0; n]);
    gelu.forward(&x, &mut y);
    gelu.backward(&x, &dy, &mut dx);
    let (mut h, mut g) = (x.clone(), vec![0.0; n]);
    gelu.forward_bias_and_grad_in_place(&mut h, &bias, &mut g);

    let (gx, gdy) = (up(dev, &x), up(dev, &dy));
    let (mut gy, mut gdx) = (zeros(dev, n), zeros(dev, n));
    dev.gelu_forward(&gx, &mut gy).unwrap();
    dev.gelu_backward(&gx, &gdy, &mut gdx).unwrap();
    close("GELU y", &down(dev, &gy), &y, 2e-6);
    close("GELU dx", &down(dev, &gdx), &dx, 2e-6);
    let (mut gh, gbias, mut gg) = (up(dev, &x), up(dev, &bias), zeros(dev, n));
    dev.gelu_bias_value_grad(&mut gh, &gbias, &mut gg).unwrap();
    close("GELU(h + b)", &down(dev, &gg), &g, 2e-6);
    close("GELU'(h + b)", &down(dev, &gh), &h, 2e-6);
}

/// S = Q·Kᵀ per (b, h), unscaled, (B·H, T, T), each entry a dot product in index order, for
/// `qkv` in the CPU attention's layout (3, B, T, D).
fn scores(qkv: &[f32], b: usize, t: usize, d: usize, nh: usize) -> Vec<f32> {
    let (hd, nd) = (d / nh, b * t * d);
    let mut s = vec![0.0; b * nh * t * t];
    for bi in 0..b {
        for h in 0..nh {
            for i in 0..t {
                for j in 0..t {
                    let q = &qkv[(bi * t + i) * d + h * hd..][..hd];
                    let k = &qkv[nd + (bi * t + j) * d + h * hd..][..hd];
                    s[((bi * nh + h) * t + i) * t + j] = q.iter().zip(k).map(|(a, b)| a * b).sum();
                }
            }
        }
    }
    s
}

#[test]
fn attention_softmax_rows_match_the_cpu() {
    let Some(dev) = device() else { return };
    let (b, t, d, nh) = (3, 45, 48, 4);
    let qkv = normal(21, b * t * 3 * d, 1.0);
    // Sequence 1 padded after 30 tokens, sequence 2 all padding (its rows are zeros).
    let mask: Vec<u8> = (0..b * t)
        .map(|i| (i / t == 0 || (i / t == 1 && i % t < 30)) as u8)
        .collect();
    let allow: Vec<f32> = mask.iter().map(|&m| m as f32).collect();
    let s = scores(&qkv, b, t, d, nh);
    let scale = 1.0 / ((d / nh) as f32).sqrt();
    for causal in [false, true] {
        let attn = if causal {
            comera_layers::attention::Attention::causal(d, nh)
        } else {
            comera_layers::attention::Attention::new(d, nh)
        };
        let mut ws = attn.workspace(b, t);
        let mut out = vec![0.0; b * t * d];
        attn.forward(&mut ws, &qkv, Some(&mask), &mut out);
        let p_cpu = ws.probs().to_vec();

        let (mut gp, ga) = (up(dev, &s), up(dev, &allow));
        let mut stats = zeros(dev, b * nh * t * 2);
        dev.softmax_rows_forward(&mut gp, &ga, b, nh, t, scale, causal, Some(&mut stats))
            .unwrap();
        let p = down(dev, &gp);
        close(&format!("softmax P (causal {causal})"), &p, &p_cpu, 1e-5);
        assert!(
            p[2 * nh * t * t..].iter().all(|&v| v == 0.0),
            "all-padding rows are zeros"
        );

        // Backward: dS = s·P ⊙ (dP − Σ P⊙dP), against the formula in f64 on the CPU's P.
        let dp = normal(22, p_cpu.len(), 1.0);
        let mut expect = vec![0.0f32; dp.len()];
        for ((pr, dr), er) in p_cpu.chunks(t).zip(dp.chunks(t)).zip(expect.chunks_mut(t)) {
            let dot: f64 = pr.iter().zip(dr).map(|(&a, &b)| a as f64 * b as f64).sum();
            for ((e, &pv), &dv) in er.iter_mut().zip(pr).zip(dr) {
                *e = (scale as f64 * pv as f64 * (dv as f64 - dot)) as f32;
            }
        }
        let (gpc, mut gdp) = (up(dev, &p_cpu), up(dev, &dp));
        dev.softmax_rows_backward(&gpc, &mut gdp, b * nh, t, scale)
            .unwrap();
        close(
            &format!("softmax dS (causal {causal})"),
            &down(dev, &gdp),
            &expect,
            1e-5,
        );
    }
}

#[test]
fn dropout_masks_are_the_cpus_bit_for_bit() {
    let Some(dev) = device() else { return };
    let n = 100_003;
    let x = normal(31, n, 1.0);
    let branch = normal(32, n, 1.0);
    for (p, seed, step) in [
        (0.1f32, 7u64, 0u64),
        (0.5, 12345, 99),
        (0.9, u64::MAX, 1 << 40),
    ] {
        let drop = comera_layers::dropout::Dropout::new(p, seed);
        let mut gstep = up(dev, &[step]);
        let mut gmask = zeros(dev, n);
        dev.dropout_mask(&mut gmask, p, seed, &gstep).unwrap();
        let mask = down(dev, &gmask);
        let cpu: Vec<f32> = (0..n).map(|i| drop.keep(step, i) as u8 as f32).collect();
        same_bits(&format!("dropout mask p={p}"), &mask, &cpu);

        let mut ws = drop.workspace(n);
        let mut y = vec![0.0; n];
        drop.forward(&mut ws, step, true, &x, &mut y);
        let (gx, mut gy) = (up(dev, &x), zeros(dev, n));
        dev.dropout_apply(&gx, &mut gy, p, seed, &gstep).unwrap();
        same_bits(&format!("dropout y p={p}"), &down(dev, &gy), &y);

        let mut r = vec![0.0; n];
        // The residual form: x + dropped branch.
        let m = drop.draw_mask(&mut ws, step, true).unwrap();
        m.add_dropped(0, &x, &branch, &mut r);
        let (gb, mut gr) = (up(dev, &branch), zeros(dev, n));
        dev.dropout_add(&gx, &gb, &mut gr, p, seed, &gstep).unwrap();
        same_bits(&format!("dropout residual p={p}"), &down(dev, &gr), &r);

        // The step counter advances on the device: the next mask is the next step's.
        dev.step_advance(&mut gstep).unwrap();
        dev.dropout_mask(&mut gmask, p, seed, &gstep).unwrap();
        let next: Vec<f32> = (0..n)
            .map(|i| drop.keep(step + 1, i) as u8 as f32)
            .collect();
        same_bits(
            &format!("dropout mask p={p}, next step"),
            &down(dev, &gmask),
            &next,
        );
    }
}

#[test]
fn cross_entropy_matches_the_cpu() {
    let Some(dev) = device() else { return };
    for (rows, classes, ignore) in [(64, 5, Some(-100)), (40, 30522, Some(-100)), (7, 3, None)] {
        let logits = normal(41, rows * classes, 3.0);
        let labels: Vec<i32> = (0..rows)
            .map(|r| {
                if ignore.is_some() && r % 5 == 3 {
                    -100
                } else {
                    ((r * 7919) % classes) as i32
                }
            })
            .collect();
        let ce = comera_layers::loss::CrossEntropy::with_ignore_index(classes, ignore);
        let mut dl = vec![0.0; rows * classes];
        let stats = ce.forward_backward(&logits, &labels, &mut dl);

        let (gl, glab) = (up(dev, &logits), up(dev, &labels));
        let mut gd = zeros(dev, rows * classes);
        let (mut count, mut rl, mut rh, mut out) = (
            zeros(dev, 1),
            zeros(dev, rows),
            zeros(dev, rows),
            zeros(dev, 4),
        );
        dev.cross_entropy(
            &gl,
            &glab,
            classes,
            ignore,
            Some(&mut gd),
            &mut count,
            &mut rl,
            &mut rh,
            &mut out,
        )
        .unwrap();
        let o: Vec<f64> = down(dev, &out);
        let tag = format!("cross-entropy {rows}x{classes}");
        println!("{tag}: loss {} (CPU {})", o[0], stats.loss);
        assert!(
            (o[0] - stats.loss).abs() <= 1e-6 * stats.loss.abs().max(1.0),
            "{tag} loss"
        );
        assert_eq!(o[2] as usize, stats.count, "{tag} counted rows");
        assert_eq!(o[3] as usize, stats.correct, "{tag} correct");
        close(&format!("{tag} dlogits"), &down(dev, &gd), &dl, 1e-5);
    }
}

#[test]
fn dense_embedding_gather_and_backward_are_the_cpus_bit_for_bit() {
    let Some(dev) = device() else { return };
    use comera_layers::EmbeddingLayer;
    let (rows, dim) = (50, 24);
    let mut rng = comera_tensor::init::rng(51);
    let mut emb = comera_layers::Embedding::new("emb", rows, dim, 1.0, &mut rng);
    let ids: Vec<u32> = (0..200u32)
        .map(|t| (t * t + 3 * t) % rows as u32 % 17)
        .collect();
    let dy = normal(52, ids.len() * dim, 1.0);
    emb.table.grad = normal(53, rows * dim, 1.0);
    let grad0 = emb.table.grad.clone();
    let mut ws = emb.workspace(ids.len());
    let mut y = vec![0.0; ids.len() * dim];
    emb.forward(&mut ws, &ids, &mut y).unwrap();
    emb.backward(&mut ws, &ids, &dy);

    let (gt, gids) = (up(dev, &emb.table.value), up(dev, &ids));
    let mut gy = zeros(dev, ids.len() * dim);
    dev.gather_rows(&gt, &gids, dim, &mut gy).unwrap();
    same_bits("embedding rows", &down(dev, &gy), &y);
    let seg = Segments::of(&ids);
    let (order, start, rows_of) = (up(dev, &seg.order), up(dev, &seg.start), up(dev, &seg.ids));
    let (gdy, mut gg) = (up(dev, &dy), up(dev, &grad0));
    dev.segment_sum_rows(&gdy, &order, &start, Some(&rows_of), dim, true, &mut gg)
        .unwrap();
    same_bits("embedding grad", &down(dev, &gg), &emb.table.grad);
}

#[test]
fn ttm_rows_match_the_cpu_lookup() {
    let Some(dev) = device() else { return };
    use comera_layers::{EmbeddingLayer, RankGates, TtmEmbedding};
    use comera_tensor::TtmShape;
    // A small table, and the paper's BERT table (30522 × 768, rank 32) on a few ids.
    for (vm, dm, rank, v, ids) in [
        (
            vec![4, 5, 3],
            vec![2, 3, 2],
            3,
            55usize,
            (0..55u32).collect::<Vec<_>>(),
        ),
        (
            vec![16, 20, 10, 10],
            vec![4, 4, 8, 6],
            32,
            30522,
            vec![0, 1, 101, 102, 2023, 30521, 7592, 101],
        ),
    ] {
        let shape = TtmShape::uniform(&vm, &dm, rank, v).unwrap();
        let mut rng = comera_tensor::init::rng(61);
        let base =
            TtmEmbedding::new("ttm", shape.clone(), RankGates::default(), 1.0, &mut rng).unwrap();
        let cores: Vec<Vec<f32>> = base.cores.iter().map(|c| c.value.clone()).collect();
        // Gates: some pruned (≤ τ = 0.01), the rest away from 1.
        let gates: Vec<Vec<f32>> = base
            .gates
            .iter()
            .enumerate()
            .map(|(b, g)| {
                (0..g.len())
                    .map(|j| {
                        if (j + b) % 4 == 1 {
                            0.005
                        } else {
                            0.5 + j as f32 * 0.1
                        }
                    })
                    .collect()
            })
            .collect();
        let table = TtmEmbedding::from_parts(
            "ttm",
            shape.clone(),
            RankGates::default(),
            cores.clone(),
            gates.clone(),
        )
        .unwrap();
        let mut ws = table.workspace(ids.len());
        let mut y = vec![0.0; ids.len() * table.dim()];
        table.forward(&mut ws, &ids, &mut y).unwrap();

        let ranks = shape.ranks().to_vec();
        let layout = TtmLayout::new(&vm, &dm, &ranks).unwrap();
        let meta = up(dev, &layout.meta);
        let gcores = up(dev, &cores.concat());
        let ggates = up(dev, &gates.concat());
        let gids = up(dev, &ids);
        let mut rows = zeros(dev, ids.len() * layout.dim);
        dev.ttm_rows(&layout, &meta, &gcores, &ggates, 0.01, &gids, &mut rows)
            .unwrap();
        close(
            &format!("TTM rows {vm:?}x{dm:?} rank {rank}"),
            &down(dev, &rows),
            &y,
            1e-5,
        );
    }
}

/// Parameters of three groups, 2-D and 1-D, with gradients.
fn params() -> Vec<Param> {
    let mut ps = vec![
        Param::new("core", &[30, 40], ParamKind::TtCore, normal(71, 1200, 0.5)),
        Param::new(
            "gate",
            &[30],
            ParamKind::RankGate,
            (0..30).map(|i| 0.005 + i as f32 * 0.02).collect(),
        ),
        Param::new("w", &[64, 70], ParamKind::Other, normal(72, 4480, 0.5)),
        Param::new("bias", &[70], ParamKind::Other, normal(73, 70, 0.5)),
    ];
    for (i, p) in ps.iter_mut().enumerate() {
        p.grad = normal(80 + i as u64, p.len(), 2.0);
    }
    ps
}

#[test]
fn grad_norm_and_clip_factor_match_the_cpu() {
    let Some(dev) = device() else { return };
    let mut ps = params();
    let flat: Vec<f32> = ps.iter().flat_map(|p| p.grad.clone()).collect();
    for max_norm in [0.0f32, 1.0, 1e9] {
        let (scale, norm) = comera_optim::clip_scale(max_norm, |f| ps.iter_mut().for_each(f));
        let g = up(dev, &flat);
        let mut part = zeros(dev, Device::grad_norm_partial_len(flat.len()));
        let (mut gn, mut gc) = (zeros(dev, 1), zeros(dev, 1));
        dev.grad_norm(&g, max_norm, &mut part, &mut gn, &mut gc)
            .unwrap();
        let (n, c) = (down(dev, &gn)[0], down(dev, &gc)[0]);
        println!("grad norm {n} (CPU {norm}), clip {c} (CPU {scale})");
        assert!((n - norm).abs() <= 1e-12 * norm, "norm");
        assert!((c - scale).abs() <= 1e-6 * scale, "clip factor");
    }
    // A non-finite gradient: the factor is NaN, and the update leaves everything as it was.
    let mut bad = flat.clone();
    bad[7] = f32::INFINITY;
    let g = up(dev, &bad);
    let mut part = zeros(dev, Device::grad_norm_partial_len(bad.len()));
    let (mut gn, mut gc) = (zeros(dev, 1), zeros(dev, 1));
    dev.grad_norm(&g, 1.0, &mut part, &mut gn, &mut gc).unwrap();
    assert!(down(dev, &gc)[0].is_nan());
    let tensors = [AdamTensor {
        len: bad.len(),
        lr: 1e-3,
        decay: 0.0,
        is_gate: false,
    }];
    let table = dev.adam_table(&tensors).unwrap();
    let w0 = normal(90, bad.len(), 1.0);
    let (mut w, mut m, mut v) = (up(dev, &w0), zeros(dev, bad.len()), zeros(dev, bad.len()));
    let scalars = up(dev, &[1.0f32, 0.1, 0.001]);
    let consts = AdamConsts {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        freeze_gates_at: None,
    };
    dev.adamw_update(
        &table,
        consts,
        &mut w,
        &g,
        &mut m,
        &mut v,
        &scalars,
        Some(&gc),
    )
    .unwrap();
    same_bits(
        "AdamW after a non-finite norm (unchanged)",
        &down(dev, &w),
        &w0,
    );
}

#[test]
fn adamw_steps_are_the_cpus_bit_for_bit() {
    let Some(dev) = device() else { return };
    let cfg = comera_optim::AdamWConfig {
        lr_cores: 1e-2,
        lr_gates: 3e-2,
        lr_other: 5e-3,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut ps = params();
    let mut opt = comera_optim::AdamW::new(cfg.clone(), |f| ps.iter_mut().for_each(f));
    opt.freeze_gates_at = Some(0.01);
    let tensors: Vec<AdamTensor> = ps
        .iter()
        .map(|p| AdamTensor {
            len: p.len(),
            lr: match p.kind {
                ParamKind::TtCore => cfg.lr_cores,
                ParamKind::RankGate => cfg.lr_gates,
                ParamKind::Other => cfg.lr_other,
            },
            decay: if p.kind == ParamKind::RankGate || p.shape.len() < 2 {
                0.0
            } else {
                cfg.weight_decay
            },
            is_gate: p.kind == ParamKind::RankGate,
        })
        .collect();
    let table = dev.adam_table(&tensors).unwrap();
    let consts = AdamConsts {
        beta1: cfg.beta1,
        beta2: cfg.beta2,
        eps: cfg.eps,
        freeze_gates_at: Some(0.01),
    };
    let flat = |ps: &[Param], f: fn(&Param) -> &Vec<f32>| {
        ps.iter().flat_map(|p| f(p).clone()).collect::<Vec<f32>>()
    };
    let mut w = up(dev, &flat(&ps, |p| &p.value));
    let n = table_len(&tensors);
    let (mut m, mut v) = (zeros(dev, n), zeros(dev, n));
    for (t, (lr_scale, grad_scale)) in [(1.0f32, 1.0f32), (0.5, 0.25), (0.9, 1.0)]
        .into_iter()
        .enumerate()
    {
        for (i, p) in ps.iter_mut().enumerate() {
            p.grad = normal(100 + 10 * t as u64 + i as u64, p.len(), 1.0);
        }
        let g = up(dev, &flat(&ps, |p| &p.grad));
        opt.step(lr_scale, grad_scale, |f| ps.iter_mut().for_each(f));
        // The step's scalars, computed on the host as the CPU's AdamW does.
        let tt = (t + 1) as i32;
        let scalars = up(
            dev,
            &[lr_scale, 1.0 - cfg.beta1.powi(tt), 1.0 - cfg.beta2.powi(tt)],
        );
        let clip = up(dev, &[grad_scale]);
        dev.adamw_update(
            &table,
            consts,
            &mut w,
            &g,
            &mut m,
            &mut v,
            &scalars,
            Some(&clip),
        )
        .unwrap();
        same_bits(
            &format!("AdamW step {} parameters", t + 1),
            &down(dev, &w),
            &flat(&ps, |p| &p.value),
        );
        same_bits(
            &format!("AdamW step {} m", t + 1),
            &down(dev, &m),
            &opt.m.concat(),
        );
        same_bits(
            &format!("AdamW step {} v", t + 1),
            &down(dev, &v),
            &opt.v.concat(),
        );
    }
}

fn table_len(t: &[AdamTensor]) -> usize {
    t.iter().map(|t| t.len).sum()
}

#[test]
fn rank_gate_pieces_match_the_cpu() {
    let Some(dev) = device() else { return };
    let rule = comera_layers::RankGates::default();
    let modes = [12usize, 8, 8, 12, 16, 16];
    let gates: Vec<Vec<f32>> = (0..5)
        .map(|b| {
            (0..30)
                .map(|j| {
                    if (j * 7 + b) % 5 == 0 {
                        0.003
                    } else {
                        0.02 + 0.03 * j as f32
                    }
                })
                .collect()
        })
        .collect();
    let gate_refs: Vec<&[f32]> = gates.iter().map(|g| &g[..]).collect();
    let scale = 0.37f32;
    let mut grads: Vec<Vec<f32>> = (0..5).map(|b| normal(120 + b, 30, 1.0)).collect();
    let g0 = grads.concat();
    {
        let mut refs: Vec<&mut [f32]> = grads.iter_mut().map(|g| &mut g[..]).collect();
        rule.size_l1_grad(&modes, &gate_refs, scale, &mut refs);
    }
    let size = rule.size_l1(&modes, &gate_refs);

    let (gg, glen) = (up(dev, &gates.concat()), up(dev, &[30i32; 5]));
    let gmodes = up(dev, &modes.iter().map(|&m| m as f64).collect::<Vec<_>>());
    let (gs, mut ggr, mut gsize) = (up(dev, &[scale]), up(dev, &g0), zeros(dev, 1));
    dev.rank_size_l1_grad(
        &gg,
        &glen,
        &gmodes,
        rule.threshold,
        &gs,
        &mut ggr,
        &mut gsize,
    )
    .unwrap();
    same_bits(
        "size-surrogate gate gradients",
        &down(dev, &ggr),
        &grads.concat(),
    );
    let s: f64 = down(dev, &gsize)[0];
    println!("size surrogate {s} (CPU {size})");
    assert_eq!(s.to_bits(), size.to_bits(), "Ŝ, summed in the same order");

    let core = normal(130, 20 * 30, 1.0);
    let mut h = vec![0.0; core.len()];
    rule.gate_core(&core, &gates[0], &mut h);
    let (gc, gate0, mut gh) = (up(dev, &core), up(dev, &gates[0]), zeros(dev, core.len()));
    dev.gate_columns(&gc, &gate0, rule.threshold, &mut gh)
        .unwrap();
    same_bits("gated core", &down(dev, &gh), &h);
}

#[test]
fn residual_sums_and_bias_gradients_match_the_cpu() {
    let Some(dev) = device() else { return };
    let (rows, w) = (300, 77);
    let (a, b) = (normal(141, rows * w, 1.0), normal(142, rows * w, 1.0));
    let bias = normal(143, w, 1.0);
    let mut sum = vec![0.0; a.len()];
    comera_layers::elementwise::sum_into(&a, &b, &mut sum);
    let (ga, gb, mut go) = (up(dev, &a), up(dev, &b), zeros(dev, a.len()));
    dev.add(&ga, &gb, &mut go).unwrap();
    same_bits("residual sum", &down(dev, &go), &sum);
    let mut acc = a.clone();
    comera_layers::elementwise::add_into(&mut acc, &b);
    let mut gacc = up(dev, &a);
    dev.add_into(&mut gacc, &gb).unwrap();
    same_bits("add_into", &down(dev, &gacc), &acc);
    let mut y = a.clone();
    comera_layers::add_bias(&mut y, &bias);
    let (mut gy, gbias) = (up(dev, &a), up(dev, &bias));
    dev.add_bias_rows(&mut gy, &gbias).unwrap();
    same_bits("bias add", &down(dev, &gy), &y);

    let mut db = normal(144, w, 1.0);
    let mut gdb = up(dev, &db);
    comera_layers::accumulate_bias_grad(&a, &mut db);
    let mut part = zeros(dev, Device::column_sum_partial_len(rows, w));
    dev.column_sum(&ga, rows, &mut part, true, &mut gdb)
        .unwrap();
    close("bias gradient", &down(dev, &gdb), &db, 1e-5);
}

/// A shape mismatch is refused on the host before anything is queued.
#[test]
fn wrong_shapes_are_refused_before_launch() {
    let Some(dev) = device() else { return };
    let (x, mut y) = (zeros::<f32>(dev, 10), zeros::<f32>(dev, 11));
    let e = dev.gelu_forward(&x, &mut y).unwrap_err();
    assert!(
        matches!(
            e,
            CudaError::Shape {
                expected: 10,
                got: 11,
                ..
            }
        ),
        "{e}"
    );
}

/// A captured graph replays with new values where kernels read them from the device: the
/// dropout mask of each replay is the next step's, because the graph advances the step counter
/// on the device. (Its own device handle: capture takes over a stream, and the other tests
/// share theirs.)
#[test]
fn a_captured_graph_replays_with_the_next_steps_mask() {
    if device().is_none() {
        return;
    }
    let dev = Device::open(0).unwrap();
    let (n, p, seed, step0) = (5000, 0.3f32, 42u64, 10u64);
    let mut step = up(&dev, &[step0]);
    let mut mask = zeros::<f32>(&dev, n);
    let graph = dev
        .capture(|d| {
            d.dropout_mask(&mut mask, p, seed, &step)?;
            d.step_advance(&mut step)
        })
        .unwrap();
    // Capturing ran nothing.
    assert_eq!(down(&dev, &step), vec![step0]);
    let drop = comera_layers::dropout::Dropout::new(p, seed);
    for r in 0..3 {
        graph.launch().unwrap();
        let cpu: Vec<f32> = (0..n)
            .map(|i| drop.keep(step0 + r, i) as u8 as f32)
            .collect();
        same_bits(&format!("graph replay {r}: mask"), &down(&dev, &mask), &cpu);
        assert_eq!(down(&dev, &step), vec![step0 + r + 1]);
    }
}

#[test]
fn gated_core_gradients_are_the_cpus_bit_for_bit() {
    let Some(dev) = device() else { return };
    let rule = comera_layers::RankGates::default();
    let (rows, r) = (45, 30);
    let core = normal(150, rows * r, 1.0);
    let dh = normal(151, rows * r, 1.0);
    let gate: Vec<f32> = (0..r)
        .map(|j| {
            if j % 4 == 2 {
                0.004
            } else {
                0.1 + 0.05 * j as f32
            }
        })
        .collect();
    let (mut cg, mut gg) = (normal(152, rows * r, 1.0), normal(153, r, 1.0));
    let (gcg0, ggg0) = (up(dev, &cg), up(dev, &gg));
    rule.accumulate_gated_grads(&core, &mut cg, &gate, &mut gg, &dh);
    let (gcore, ggate, gdh) = (up(dev, &core), up(dev, &gate), up(dev, &dh));
    let (mut gcg, mut ggg) = (gcg0, ggg0);
    dev.gated_grads(&gcore, &ggate, &gdh, rule.threshold, &mut gcg, &mut ggg)
        .unwrap();
    same_bits("gated core gradient", &down(dev, &gcg), &cg);
    same_bits("gate gradient", &down(dev, &ggg), &gg);
}

#[test]
fn ttm_backward_matches_the_cpu() {
    let Some(dev) = device() else { return };
    use comera_layers::{EmbeddingLayer, RankGates, TtmEmbedding};
    use comera_tensor::TtmShape;
    for (vm, dm, rank, v, tokens) in [
        (vec![4, 5, 3], vec![2, 3, 2], 3, 55usize, 90usize),
        (vec![16, 20, 10, 10], vec![4, 4, 8, 6], 32, 30522, 300),
    ] {
        let shape = TtmShape::uniform(&vm, &dm, rank, v).unwrap();
        let mut rng = comera_tensor::init::rng(161);
        let base =
            TtmEmbedding::new("ttm", shape.clone(), RankGates::default(), 1.0, &mut rng).unwrap();
        let cores: Vec<Vec<f32>> = base.cores.iter().map(|c| c.value.clone()).collect();
        let gates: Vec<Vec<f32>> = base
            .gates
            .iter()
            .enumerate()
            .map(|(b, g)| {
                (0..g.len())
                    .map(|j| {
                        if (j + 2 * b) % 5 == 0 {
                            0.002
                        } else {
                            0.3 + j as f32 * 0.05
                        }
                    })
                    .collect()
            })
            .collect();
        let mut table = TtmEmbedding::from_parts(
            "ttm",
            shape.clone(),
            RankGates::default(),
            cores.clone(),
            gates.clone(),
        )
        .unwrap();
        // Ids with repeats (a Zipf-like head), so segments hold several tokens.
        let ids: Vec<u32> = (0..tokens as u64)
            .map(|t| ((t * t * 2654435761) % 97 * 7919 % v as u64) as u32)
            .collect();
        let dy = normal(162, tokens * table.dim(), 1.0);
        let mut ws = table.workspace(tokens);
        let mut y = vec![0.0; tokens * table.dim()];
        table.forward(&mut ws, &ids, &mut y).unwrap();
        table.backward(&mut ws, &ids, &dy);
        let cpu_cores: Vec<f32> = table.cores.iter().flat_map(|c| c.grad.clone()).collect();
        let cpu_gates: Vec<f32> = table.gates.iter().flat_map(|g| g.grad.clone()).collect();

        let layout = TtmLayout::new(&vm, &dm, shape.ranks()).unwrap();
        let seg = Segments::of(&ids);
        let u = seg.distinct();
        let digits = ttm_digit_segments(&layout, &seg.ids);
        let gdigits: Vec<_> = digits
            .iter()
            .map(|(o, s)| (up(dev, o), up(dev, s)))
            .collect();
        let (meta, gcores, ggates) = (
            up(dev, &layout.meta),
            up(dev, &cores.concat()),
            up(dev, &gates.concat()),
        );
        let (gdy, gorder, gstart, gdistinct) = (
            up(dev, &dy),
            up(dev, &seg.order),
            up(dev, &seg.start),
            up(dev, &seg.ids),
        );
        let mut drows = zeros(dev, u * layout.dim);
        let mut slabs = zeros(dev, u * layout.slab_total);
        let mut dh = zeros(dev, layout.cores.iter().map(|c| c.len()).max().unwrap());
        let (mut cg, mut gg) = (zeros(dev, layout.core_len), zeros(dev, layout.gate_len));
        dev.ttm_backward(
            &layout, &meta, &gcores, &ggates, 0.01, &gdy, &gorder, &gstart, &gdistinct, &gdigits,
            &mut drows, &mut slabs, &mut dh, &mut cg, &mut gg,
        )
        .unwrap();
        let tag = format!("TTM backward {vm:?}x{dm:?} rank {rank}, {u} distinct of {tokens}");
        close(
            &format!("{tag}: core gradients"),
            &down(dev, &cg),
            &cpu_cores,
            1e-5,
        );
        close(
            &format!("{tag}: gate gradients"),
            &down(dev, &gg),
            &cpu_gates,
            1e-5,
        );
    }
}

/// cuBLAS in row-major terms, each transpose combination, against an f64 product.
#[test]
fn cublas_matmul_in_row_major_terms() {
    let Some(dev) = device() else { return };
    let blas = dev.cublas().unwrap();
    let (m, n, k) = (37, 29, 51);
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let a = normal(170, m * k, 1.0);
        let b = normal(171, k * n, 1.0);
        let c0 = normal(172, m * n, 1.0);
        let at = |i: usize, l: usize| if ta { a[l * m + i] } else { a[i * k + l] };
        let bt = |l: usize, j: usize| if tb { b[j * k + l] } else { b[l * n + j] };
        let (alpha, beta) = (0.75f32, 0.5f32);
        let expect: Vec<f32> = (0..m * n)
            .map(|ij| {
                let (i, j) = (ij / n, ij % n);
                let dot: f64 = (0..k).map(|l| at(i, l) as f64 * bt(l, j) as f64).sum();
                (alpha as f64 * dot + beta as f64 * c0[ij] as f64) as f32
            })
            .collect();
        let (ga, gb, mut gc) = (up(dev, &a), up(dev, &b), up(dev, &c0));
        dev.matmul(&blas, (m, n, k), &ga, ta, &gb, tb, alpha, beta, &mut gc)
            .unwrap();
        close(
            &format!("cuBLAS row-major (ta {ta}, tb {tb})"),
            &down(dev, &gc),
            &expect,
            1e-5,
        );
    }
}
