//! The device step benchmark (`comera bench step --device cuda`, and the `step_bench`
//! example that `tools/gpu/check.sh` runs): the paper model's training step (SPEC §5: 6
//! post-LN encoders, d 768, 12 heads, FFN 3072, seq 128, TT rank 30, TTM rank 32, classifier
//! head; `EncoderConfig::default()`, as the CPU step benchmark builds it) and its dense
//! counterpart, captured once as a CUDA graph and replayed. The TT/TTM step includes the
//! rank schedule's early stage (γ = 0.01, the authors' CE + 0.01·rank loss, with the gates'
//! projection after AdamW), as the authors' step that it is compared with does.
//!
//! What is timed: `graph.launch()` then a stream synchronise, per replay, with the batch
//! already on the device (the step's batch upload and the host's index work happen before;
//! `host_load_ms` reports them separately); the uncaptured (eager) step beside it. Memory:
//! device memory in use (total − free, as `nvidia-smi` sees it for this process's context)
//! after the plan is built and after the replays, and its growth over the context alone
//! (measured after the kernels are loaded). Then the step's phases (forward, loss, backward,
//! update): each prefix of the step captured as a graph of its own and replayed, a phase the
//! difference of two prefixes' medians. With `ops`, one more eager step with every operation
//! timed on its own ([`crate::engine::profile`]), summed by part of the step and by kernel or
//! product shape. The plan allocates every buffer up front (cuBLAS
//! workspace included) and a step allocates nothing, so the growth after the replays is the
//! step's peak; it is comparable to, though not the same measure as, PyTorch's
//! `max_memory_allocated` (which counts tensors only).

use crate::device::Device;
use crate::engine::profile::OpTotal;
use crate::engine::{EncoderPlan, Profile, RankSettings, RankStep, StepConfig, StepPhase};
use crate::error::CudaError;
use comera_model::{Encoder, EncoderConfig};
use std::time::Instant;

/// What to run.
#[derive(Clone, Debug)]
pub struct StepBenchArgs {
    /// The GPU's ordinal.
    pub ordinal: usize,
    pub batches: Vec<usize>,
    /// Timed replays per model and batch (their median is the figure).
    pub replays: usize,
    /// Timed eager steps per model and batch.
    pub eager: usize,
    /// The TT/TTM model, and the dense one (its 2× baseline).
    pub tt: bool,
    pub dense: bool,
    /// Also one eager step with every operation timed on its own ([`StepBenchRow::ops`]).
    pub ops: bool,
}

impl Default for StepBenchArgs {
    fn default() -> Self {
        StepBenchArgs {
            ordinal: 0,
            batches: vec![1, 32],
            replays: 50,
            eager: 5,
            tt: true,
            dense: true,
            ops: false,
        }
    }
}

/// One model at one batch size.
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepBenchRow {
    /// `tt` or `dense`.
    pub model: &'static str,
    pub batch: usize,
    pub seq_len: usize,
    pub gpu: String,
    pub arch: String,
    pub driver_cuda: i32,
    pub graph_ms_median: f64,
    pub graph_ms_min: f64,
    pub graph_ms_max: f64,
    pub replays: usize,
    pub eager_ms_median: f64,
    pub capture_ms: f64,
    pub host_load_ms: f64,
    pub device_mib_in_use: f64,
    pub device_mib_over_context: f64,
    pub device_mib_plan: f64,
    /// The plan's own buffers: what it allocated, as computed before allocating
    /// ([`crate::engine::PlanMemory`]); the rest of `device_mib_plan` is cuBLAS's and the
    /// driver's.
    pub device_mib_buffers: f64,
    pub params: usize,
    /// The step's phases, from prefixes of it replayed on their own (medians; differences of
    /// noisy medians, so a small phase can come out slightly negative).
    pub phase_ms: PhaseMs,
    /// Whether the step ran the rank schedule's early stage (the TT/TTM model).
    pub rank_schedule: bool,
    /// The last replay's loss, and whether it and the gradient norm were finite.
    pub loss: f64,
    pub finite: bool,
    /// With [`StepBenchArgs::ops`]: where one eager step's time goes ([`Profile`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ops: Option<OpsSummary>,
}

/// One step's operations timed one by one ([`Profile`]), summed by part of the step and by
/// operation.
#[derive(Clone, Debug, serde::Serialize)]
pub struct OpsSummary {
    /// The operations' times added up: the step without launch gaps or overlap (compare
    /// with `graph_ms_median`).
    pub total_ms: f64,
    pub operations: usize,
    /// By part of the step (`fwd ffn`, `bwd attention`, …), the largest first.
    pub by_scope: Vec<OpTotal>,
    /// By kernel or product shape, the largest first ([`OPS_LISTED`] of them).
    pub by_op: Vec<OpTotal>,
}

/// How many operations [`OpsSummary::by_op`] lists.
pub const OPS_LISTED: usize = 30;

impl OpsSummary {
    fn of(p: &Profile) -> OpsSummary {
        let mut by_op = p.by_op();
        by_op.truncate(OPS_LISTED);
        OpsSummary {
            total_ms: p.total_ms(),
            operations: p.ops.len(),
            by_scope: p.by_scope(),
            by_op,
        }
    }

    /// The two tables as text, each line indented by `indent`.
    pub fn table(&self, indent: &str) -> String {
        let mut out = format!(
            "{indent}{} operations timed one by one: {:.3} ms in all\n",
            self.operations, self.total_ms
        );
        for (title, rows) in [
            ("part of the step", &self.by_scope),
            ("operation", &self.by_op),
        ] {
            out += &format!(
                "{indent}{title:<44} {:>6} {:>10} {:>6}\n",
                "calls", "ms", "share"
            );
            for r in rows.iter() {
                out += &format!(
                    "{indent}{:<44} {:>6} {:>10.3} {:>5.1}%\n",
                    r.label,
                    r.calls,
                    r.ms,
                    100.0 * r.ms / self.total_ms.max(f64::MIN_POSITIVE)
                );
            }
        }
        out
    }
}

/// A step's time by phase ([`StepPhase`]), ms.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct PhaseMs {
    /// Gradients zeroed and the forward.
    pub forward: f64,
    pub loss: f64,
    /// The backward (and the rank objective's gradients).
    pub backward: f64,
    /// Norm, clipping, AdamW (and the gates' projection).
    pub update: f64,
}

/// Replays `graph` three times untimed, then `n` (at least one) times, each launch followed
/// by a stream synchronise; the times in ms.
fn replay_times(
    dev: &Device,
    graph: &cudarc::driver::CudaGraph,
    n: usize,
) -> Result<Vec<f64>, CudaError> {
    let sync = || {
        dev.stream()
            .synchronize()
            .map_err(crate::error::driver("cuStreamSynchronize"))
    };
    let launch = || {
        graph
            .launch()
            .map_err(crate::error::driver("cuGraphLaunch"))
    };
    for _ in 0..3 {
        launch()?;
    }
    sync()?;
    let mut times = Vec::with_capacity(n.max(1));
    for _ in 0..n.max(1) {
        let t0 = Instant::now();
        launch()?;
        sync()?;
        times.push(ms(t0));
    }
    Ok(times)
}

/// Runs the benchmark; `on_row` sees each row as it is measured (to print it).
pub fn step_bench(
    a: &StepBenchArgs,
    mut on_row: impl FnMut(&StepBenchRow),
) -> Result<Vec<StepBenchRow>, CudaError> {
    let dev = Device::open(a.ordinal)?;
    let (free0, total) = dev.memory()?;
    let base_used = total - free0;
    let mut models = Vec::new();
    if a.tt {
        models.push(("tt", EncoderConfig::default()));
    }
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
    let mut rows = Vec::new();
    for (kind, cfg) in &models {
        let enc = Encoder::new(cfg, 0).map_err(|e| CudaError::Plan(format!("{kind}: {e}")))?;
        for &b in &a.batches {
            let row = one(&dev, a, kind, &enc, b, (base_used, total))?;
            on_row(&row);
            rows.push(row);
        }
    }
    Ok(rows)
}

/// `kind`'s step at batch `b`: planned, timed eager, captured, replayed.
fn one(
    dev: &Device,
    a: &StepBenchArgs,
    kind: &'static str,
    enc: &Encoder,
    b: usize,
    (base_used, total): (usize, usize),
) -> Result<StepBenchRow, CudaError> {
    let mib = |bytes: usize| bytes as f64 / (1 << 20) as f64;
    let cfg = &enc.cfg;
    let t = cfg.seq_len;
    let rank = RankSettings::early_stage(enc, 0.01);
    let opt = StepConfig {
        freeze_gates_at: rank.as_ref().map(|_| cfg.threshold),
        rank: rank.clone(),
        ..StepConfig::paper()
    };
    let mut plan = EncoderPlan::new(dev, enc, 0, b, t, opt)?;
    if rank.is_some() {
        plan.set_rank_step(dev, RankStep::EARLY)?;
    }
    let used_plan = total - dev.memory()?.0;
    let (ids, types, mask, labels) = batch(cfg, b);
    let sync = |d: &Device| {
        d.stream()
            .synchronize()
            .map_err(crate::error::driver("cuStreamSynchronize"))
    };
    let t0 = Instant::now();
    plan.load(dev, &ids, &types, &mask, &labels)?;
    sync(dev)?;
    let host_load_ms = ms(t0);
    plan.set_step(dev, 1, 1, 1.0)?;
    // Eager: the same launches, queued one by one from the host (the first one warms up).
    let mut eager = Vec::new();
    for i in 0..a.eager + 1 {
        let t0 = Instant::now();
        plan.record_step(dev)?;
        sync(dev)?;
        if i > 0 {
            eager.push(ms(t0));
        }
    }
    let t0 = Instant::now();
    let graph = dev.capture(|d| plan.record_step(d))?;
    let capture_ms = ms(t0);
    let times = replay_times(dev, &graph, a.replays)?;
    let used_after = total - dev.memory()?.0;
    let s = plan.stats(dev)?;
    // Where the time goes: each prefix of the step captured on its own and replayed; a
    // phase's time is the difference of the medians of its prefix and the one before.
    let mut through = Vec::new();
    for last in [StepPhase::Forward, StepPhase::Loss, StepPhase::Backward] {
        let g = dev.capture(|d| plan.record_step_through(d, last))?;
        through.push(median_min_max(replay_times(dev, &g, a.replays)?).0);
    }
    let ops = if a.ops {
        Some(OpsSummary::of(&Profile::run(dev, |d| plan.record_step(d))?))
    } else {
        None
    };
    let (med, min, max) = median_min_max(times);
    let info = dev.info();
    Ok(StepBenchRow {
        model: kind,
        batch: b,
        seq_len: t,
        gpu: info.name.clone(),
        arch: info.arch.to_string(),
        driver_cuda: info.driver_version,
        graph_ms_median: med,
        graph_ms_min: min,
        graph_ms_max: max,
        replays: a.replays.max(1),
        eager_ms_median: if eager.is_empty() {
            f64::NAN
        } else {
            median_min_max(eager).0
        },
        capture_ms,
        host_load_ms,
        device_mib_in_use: mib(used_after),
        device_mib_over_context: mib(used_after - base_used),
        device_mib_plan: mib(used_plan - base_used),
        device_mib_buffers: mib(plan.device_bytes()),
        phase_ms: PhaseMs {
            forward: through[0],
            loss: through[1] - through[0],
            backward: through[2] - through[1],
            update: med - through[2],
        },
        params: enc.num_params(),
        rank_schedule: rank.is_some(),
        loss: s.loss,
        finite: s.loss.is_finite() && s.grad_norm.is_finite(),
        ops,
    })
}

fn ms(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e3
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

/// (median, min, max) of a non-empty sample.
fn median_min_max(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}
