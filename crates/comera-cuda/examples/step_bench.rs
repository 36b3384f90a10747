//! Times the device training step of the paper model (SPEC §5: 6 post-LN encoders, d 768,
//! 12 heads, FFN 3072, seq 128, TT rank 30, TTM rank 32, classifier head; comera-model's
//! `EncoderConfig::default()`, as comera-bench's step benchmark builds it) and its dense
//! counterpart, captured once as a CUDA graph and replayed: median (and min, max) of N
//! replays at each batch size, the uncaptured (eager) step beside it, the host's per-batch
//! index work, and device memory. Prints a table, then one JSON object per line (also written
//! to `--json PATH`).
//!
//! ```text
//! cargo run --release -p comera-cuda --example step_bench -- [--batches 1,32] [--replays 50]
//!     [--eager 5] [--no-dense] [--json PATH]
//! ```
//!
//! What is timed: `graph.launch()` then a stream synchronise, per replay, with the batch
//! already on the device (the step's batch upload and the host's index work happen before;
//! `host_load_ms` reports them separately). Memory: device memory in use (total − free, as
//! `nvidia-smi` sees it for this process's context) after the plan is built and after the
//! replays, and its growth over the context alone (measured after the kernels are loaded).
//! The plan allocates every buffer up front (cuBLAS workspace included) and a step allocates
//! nothing, so the growth after the replays is the step's peak; it is comparable to, though
//! not the same measure as, PyTorch's `max_memory_allocated` (which counts tensors only).

use comera_cuda::engine::{EncoderPlan, StepConfig};
use comera_cuda::Device;
use comera_model::{Encoder, EncoderConfig};
use std::time::Instant;

struct Args {
    batches: Vec<usize>,
    replays: usize,
    eager: usize,
    dense: bool,
    json: Option<String>,
}

fn args() -> Args {
    let mut a = Args {
        batches: vec![1, 32],
        replays: 50,
        eager: 5,
        dense: true,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{k} needs a value"));
        match k.as_str() {
            "--batches" => {
                a.batches = val()
                    .split(',')
                    .map(|s| s.parse().expect("--batches 1,32"))
                    .collect()
            }
            "--replays" => a.replays = val().parse().expect("--replays N"),
            "--eager" => a.eager = val().parse().expect("--eager N"),
            "--no-dense" => a.dense = false,
            "--json" => a.json = Some(val()),
            other => panic!("unknown argument {other} (see the example's doc comment)"),
        }
    }
    a
}

/// A deterministic batch: ids spread over the vocabulary, two segments, the last 10% of
/// positions padded in every other sequence, labels cycling (comera-bench's `ClassBatch`
/// shape, without its RNG).
fn batch(cfg: &EncoderConfig, b: usize) -> (Vec<u32>, Vec<u32>, Vec<u32>, Vec<usize>) {
    let t = cfg.seq_len;
    let n = b * t;
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let ids = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % cfg.vocab_size as u64) as u32
        })
        .collect();
    let types = (0..n).map(|i| ((i % t) >= t / 2) as u32).collect();
    let pad = t / 10;
    let mask = (0..n)
        .map(|i| {
            let (s, p) = (i / t, i % t);
            (s % 2 == 0 || p == 0 || p < t - pad) as u32
        })
        .collect();
    let labels = (0..b).map(|i| i % cfg.num_labels).collect();
    (ids, types, mask, labels)
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    let a = args();
    let dev = Device::open(0).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(2)
    });
    let info = dev.info().clone();
    let (free0, total) = dev.memory().unwrap();
    let base_used = total - free0;
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let mut rows = Vec::new();
    let mut models = vec![("tt", EncoderConfig::default())];
    if a.dense {
        models.push((
            "dense",
            EncoderConfig {
                tt_linear: false,
                ttm_embedding: false,
                ..EncoderConfig::default()
            },
        ));
    }
    for (kind, cfg) in &models {
        let enc = Encoder::new(cfg, 0).expect("the paper config builds");
        for &b in &a.batches {
            let t = cfg.seq_len;
            let mut plan = EncoderPlan::new(&dev, &enc, 0, b, t, StepConfig::paper())
                .unwrap_or_else(|e| panic!("{kind} plan at batch {b}: {e}"));
            let used_plan = total - dev.memory().unwrap().0;
            let (ids, types, mask, labels) = batch(cfg, b);
            let t0 = Instant::now();
            plan.load(&dev, &ids, &types, &mask, &labels).unwrap();
            dev.stream().synchronize().unwrap();
            let host_load = t0.elapsed().as_secs_f64() * 1e3;
            plan.set_step(&dev, 1, 1, 1.0).unwrap();
            // Eager: the same launches, queued one by one from the host.
            let mut eager = Vec::new();
            for i in 0..a.eager + 1 {
                let t0 = Instant::now();
                plan.record_step(&dev).unwrap();
                dev.stream().synchronize().unwrap();
                if i > 0 {
                    eager.push(t0.elapsed().as_secs_f64() * 1e3);
                }
            }
            let t0 = Instant::now();
            let graph = dev.capture(|d| plan.record_step(d)).unwrap();
            let capture_ms = t0.elapsed().as_secs_f64() * 1e3;
            for _ in 0..3 {
                graph.launch().unwrap();
            }
            dev.stream().synchronize().unwrap();
            let mut times = Vec::with_capacity(a.replays);
            for _ in 0..a.replays {
                let t0 = Instant::now();
                graph.launch().unwrap();
                dev.stream().synchronize().unwrap();
                times.push(t0.elapsed().as_secs_f64() * 1e3);
            }
            let used_after = total - dev.memory().unwrap().0;
            let s = plan.stats(&dev).unwrap();
            let (med, min, max) = stats(times);
            let (emed, _, _) = if eager.is_empty() {
                (f64::NAN, 0.0, 0.0)
            } else {
                stats(eager)
            };
            rows.push(format!(
                "{{\"model\":\"{kind}\",\"batch\":{b},\"seq_len\":{t},\"gpu\":\"{}\",\"arch\":\"{}\",\
                 \"driver_cuda\":{},\"graph_ms_median\":{med:.4},\"graph_ms_min\":{min:.4},\
                 \"graph_ms_max\":{max:.4},\"replays\":{},\"eager_ms_median\":{emed:.4},\
                 \"capture_ms\":{capture_ms:.2},\"host_load_ms\":{host_load:.3},\
                 \"device_mib_in_use\":{:.1},\"device_mib_over_context\":{:.1},\
                 \"device_mib_plan\":{:.1},\"params\":{},\"loss\":{:.6},\"finite\":{}}}",
                info.name,
                info.arch,
                info.driver_version,
                a.replays,
                mib(used_after),
                mib(used_after - base_used),
                mib(used_plan - base_used),
                enc.num_params(),
                s.loss,
                s.loss.is_finite() && s.grad_norm.is_finite(),
            ));
            println!(
                "{kind:>5} b{b:<3} graph {med:8.3} ms (min {min:.3}, max {max:.3})  eager {emed:8.3} ms  \
                 host load {host_load:6.2} ms  memory {:7.1} MiB over the context  loss {:.4}",
                mib(used_after - base_used),
                s.loss
            );
            drop(graph);
            drop(plan);
        }
    }
    println!(
        "{} ({}), driver CUDA {}",
        info.name, info.arch, info.driver_version
    );
    for r in &rows {
        println!("{r}");
    }
    if let Some(path) = a.json {
        std::fs::write(&path, rows.join("\n") + "\n").expect("writing --json");
    }
}
