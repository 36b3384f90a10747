//! `comera bench step`: whole training steps of the encoder, dense vs TT/TTM.
//!
//! One step is forward (with loss), zero-grad, backward, gradient clipping and the AdamW
//! update. Each (model, batch) is measured in its own child process (this executable
//! re-invoked with the hidden `--child dense|tt`), so that the peak RSS (`VmHWM`) belongs to
//! one model alone; children run one after the other, dense and TT alternating for
//! `--rounds`, and the reported median is over every timed step of every round.

use crate::harness::{
    gemm_calibration_gflops, gflops, median_ms, normal_vec, peak_rss_bytes, report_to_parent,
    run_child, ClassBatch, StepTimes, TextTable, MB,
};
use comera_model::{Encoder, EncoderConfig};
use comera_optim::{clip_scale_par, AdamW, AdamWConfig, Optimizer, ParamSums, Stepper};
use comera_tensor::{factor::balanced_factorisations, init};
use serde::{Deserialize, Serialize};
use std::process::ExitCode;

#[derive(clap::Args, Clone)]
pub struct StepArgs {
    /// Sequences per step (a list measures each).
    #[arg(long, value_delimiter = ',', default_values_t = vec![32usize])]
    batch: Vec<usize>,
    /// Sequence length (default: the paper's 128).
    #[arg(long)]
    seq_len: Option<usize>,
    /// Encoder blocks (default: the paper's 6).
    #[arg(long)]
    layers: Option<usize>,
    /// Model width (default 768); TT/TTM modes are then derived as balanced factorisations.
    #[arg(long)]
    d_model: Option<usize>,
    /// Feed-forward width (default 3072, or 4 × d_model when --d-model is given).
    #[arg(long)]
    ffn: Option<usize>,
    /// Attention heads (default 12, or a divisor of d_model near d_model/64 when it is given).
    #[arg(long)]
    heads: Option<usize>,
    /// TT rank of every TT linear layer and TTM rank of the word embedding (default: the
    /// paper's 30 and 32).
    #[arg(long)]
    rank: Option<usize>,
    /// Timed steps per child (after 2 warm-up steps).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Rounds of (dense, TT) child processes, alternating.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Measure only these models.
    #[arg(long, value_delimiter = ',', default_values_t = vec!["dense".to_string(), "tt".into()])]
    models: Vec<String>,
    /// One JSON object a line per (model, batch) instead of the table.
    #[arg(long)]
    json: bool,
    /// Internal: run one model in this process and print its measurement as JSON.
    #[arg(long, hide = true)]
    child: Option<String>,
    /// Time each layer operation of the TT/TTM step in this process (per call and per step,
    /// at the first --batch), instead of whole steps: where a step's time goes, with each
    /// operation's counted FLOPs and GFLOP/s next to a GEMM-rate calibration. With
    /// `--device cuda`: one eager step with every kernel, product and copy timed on its own.
    #[arg(long)]
    ops: bool,
    /// Run each model at 1, 2, 4, … threads up to the machine's cores (the cores themselves
    /// last when not a power of two), interleaved in each round, and print each count's median
    /// step time, speed-up over 1 thread and parallel efficiency (speed-up / threads).
    #[arg(long)]
    scaling: bool,
    /// With --scaling: these thread counts instead of 1, 2, 4, … up to the cores.
    #[arg(long, value_delimiter = ',')]
    threads_list: Vec<usize>,
    /// `cuda` or `cuda:N`: the paper model's step on that GPU, captured once as a CUDA graph
    /// and replayed (`--batch`, `--models` and `--json` apply; `--steps` timed replays, at
    /// least 20; `--ops`: one more eager step with every kernel, product and copy timed on
    /// its own, by part of the step and by operation; the shape flags and `--scaling` are the
    /// CPU's). Default `cpu`.
    #[arg(long, default_value = "cpu")]
    device: comera_train::DeviceSpec,
}

/// `bench step --device cuda:N`: the device step benchmark ([`comera_cuda::bench`]), a line
/// per model and batch (or its JSON), then TT/TTM against dense at each batch.
fn on_gpu(a: &StepArgs, ordinal: usize) -> anyhow::Result<ExitCode> {
    let cpu_only = [
        ("--seq-len", a.seq_len.is_some()),
        ("--layers", a.layers.is_some()),
        ("--d-model", a.d_model.is_some()),
        ("--ffn", a.ffn.is_some()),
        ("--heads", a.heads.is_some()),
        ("--rank", a.rank.is_some()),
        ("--scaling", a.scaling),
    ];
    if let Some((flag, _)) = cpu_only.iter().find(|f| f.1) {
        anyhow::bail!("{flag}: the GPU step benchmark runs the paper model's shape only (--batch, --models, --steps, --ops, --json)");
    }
    for m in &a.models {
        anyhow::ensure!(
            m == "tt" || m == "dense",
            "--models: `{m}` is neither tt nor dense"
        );
    }
    let args = comera_cuda::bench::StepBenchArgs {
        ordinal,
        batches: a.batch.clone(),
        replays: a.steps.max(20),
        eager: 5,
        tt: a.models.iter().any(|m| m == "tt"),
        dense: a.models.iter().any(|m| m == "dense"),
        ops: a.ops,
    };
    let print = |r: &comera_cuda::bench::StepBenchRow| {
        if a.json {
            println!("{}", serde_json::to_string(r).unwrap_or_default());
        } else {
            println!(
                "{:>5}  batch {:>3}  {:9.3} ms (min {:.3}, max {:.3}, {} replays)  eager {:9.3} ms  {:8.1} MiB  {}\n             forward {:.3} ms, loss {:.3}, backward {:.3}, update {:.3}",
                r.model,
                r.batch,
                r.graph_ms_median,
                r.graph_ms_min,
                r.graph_ms_max,
                r.replays,
                r.eager_ms_median,
                r.device_mib_over_context,
                r.gpu,
                r.phase_ms.forward,
                r.phase_ms.loss,
                r.phase_ms.backward,
                r.phase_ms.update
            );
            if let Some(ops) = &r.ops {
                print!("{}", ops.table("             "));
            }
        }
    };
    let device = comera_train::DeviceSpec::Cuda(ordinal);
    let rows = comera_cuda::bench::step_bench(&args, print)
        .map_err(|source| comera_train::device::DeviceError::Cuda { device, source })?;
    if !a.json {
        for &b in &a.batch {
            let ms = |m: &str| {
                rows.iter()
                    .find(|r| r.model == m && r.batch == b)
                    .map(|r| r.graph_ms_median)
            };
            if let (Some(tt), Some(dense)) = (ms("tt"), ms("dense")) {
                println!("batch {b}: TT/TTM {:.2}x faster than dense", dense / tt);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// What one child process measured.
#[derive(Serialize, Deserialize)]
struct ChildReport {
    model: String,
    batch: usize,
    seq_len: usize,
    times: StepTimes,
    peak_rss_bytes: u64,
    params: usize,
    dense_equivalent_params: usize,
    /// Parameter values and gradients: 2 × 4 × params.
    param_bytes: usize,
    state_bytes: usize,
    optimizer_bytes: usize,
    loss: f64,
    threads: usize,
    /// Counted FLOPs of one step ([`step_flops`]).
    step_flops: f64,
}

const WARMUP: usize = 2;
/// Side of the square GEMM that calibrates the machine's rate.
const CAL_N: usize = 1024;
const SEED: u64 = 1234;

/// Balanced modes of `n` in `parts` factors (largest first).
fn modes(n: usize, parts: usize) -> Vec<usize> {
    balanced_factorisations(n, parts, 1)
        .pop()
        .unwrap_or_else(|| vec![n])
}

/// The paper's configuration with the overrides applied (TT modes re-derived for new widths).
fn config(a: &StepArgs, model: &str) -> anyhow::Result<EncoderConfig> {
    let mut c = EncoderConfig::default();
    if let Some(t) = a.seq_len {
        c.seq_len = t;
    }
    if let Some(l) = a.layers {
        c.layers = l;
    }
    let resized = a.d_model.is_some() || a.ffn.is_some();
    if let Some(d) = a.d_model {
        anyhow::ensure!(d >= 1, "--d-model must be at least 1");
        c.d_model = d;
        c.ffn = 4 * d;
        c.heads = a.heads.unwrap_or_else(|| {
            let want = (d / 64).max(1);
            (1..=d)
                .filter(|h| d % h == 0)
                .min_by_key(|&h| (h as isize - want as isize).abs())
                .unwrap_or(1)
        });
    }
    if let Some(f) = a.ffn {
        c.ffn = f;
    }
    if let Some(h) = a.heads {
        c.heads = h;
    }
    if let Some(r) = a.rank {
        c.attn_tt.rank = r.into();
        c.ffn_up_tt.rank = r.into();
        c.ffn_down_tt.rank = r.into();
        c.word_ttm.rank = r.into();
    }
    if resized {
        let (d, f) = (c.d_model, c.ffn);
        let md = modes(d, 3);
        let mf = modes(f, 3);
        let md_rev: Vec<usize> = md.iter().rev().copied().collect();
        c.attn_tt.in_modes = md.clone();
        c.attn_tt.out_modes = md_rev.clone();
        c.ffn_up_tt.in_modes = md.clone();
        c.ffn_up_tt.out_modes = mf.clone();
        c.ffn_down_tt.in_modes = mf;
        c.ffn_down_tt.out_modes = md_rev;
        c.word_ttm.dim_modes = modes(d, c.word_ttm.vocab_modes.len());
    }
    match model {
        "tt" => {}
        "dense" => {
            c.tt_linear = false;
            c.ttm_embedding = false;
        }
        other => anyhow::bail!("--models: unknown model `{other}` (expected dense or tt)"),
    }
    c.validate()
        .map_err(|e| anyhow::anyhow!("model configuration: {e}"))?;
    Ok(c)
}

/// Counted FLOPs (2 per multiply-add) of one training step of `enc` at `b` sequences: every
/// linear layer's forward and backward as the encoder runs it (a TT layer on its planned path,
/// chain products included; q/k/v and the FFN fused where the encoder fuses them; a dense
/// layer 2·N·in·out forward and twice that backward) and attention's products. Element-wise
/// work, embeddings, the loss and the optimiser are not counted.
pub fn step_flops(enc: &Encoder, b: usize) -> f64 {
    use comera_layers::attention::Attention;
    use comera_layers::tt_linear::{FusedFfn, SharedInput};
    use comera_layers::Layer;
    use comera_model::AnyLinear;
    let cfg = &enc.cfg;
    let n = b * cfg.seq_len;
    // One linear layer on `rows` rows, forward and backward.
    let on_rows = |l: &AnyLinear, rows: usize| match l {
        AnyLinear::Tt(t) => {
            let (f, g) = t.workspace(rows).flops();
            f + g
        }
        AnyLinear::Dense(d) => 6.0 * (rows * d.in_features() * d.out_features()) as f64,
    };
    let one = |l: &AnyLinear| on_rows(l, n);
    let attn = Attention::new(cfg.d_model, cfg.heads);
    let ws = attn.workspace_for(b, cfg.seq_len);
    let mut total = 0.0;
    // A classifier's last block runs past its q, k, v on the [CLS] rows only (as training does).
    let cls = matches!(enc.head, comera_model::Head::Classifier(_));
    for (l, blk) in enc.blocks.iter().enumerate() {
        let cls_block = cls && l + 1 == enc.blocks.len();
        total += match (&blk.q, &blk.k, &blk.v) {
            (AnyLinear::Tt(q), AnyLinear::Tt(k), AnyLinear::Tt(v)) => {
                SharedInput::new(&[q, k, v], n).map(|w| w.flops().0 + w.flops().1)
            }
            _ => None,
        }
        .unwrap_or_else(|| one(&blk.q) + one(&blk.k) + one(&blk.v));
        if cls_block {
            total += on_rows(&blk.o, b) + on_rows(&blk.up, b) + on_rows(&blk.down, b);
            total += attn.first_flops(b, cfg.seq_len);
            continue;
        }
        total += attn.forward_flops(b, cfg.seq_len) + attn.backward_flops(&ws);
        total += one(&blk.o);
        total += match (&blk.up, &blk.down) {
            (AnyLinear::Tt(up), AnyLinear::Tt(down)) => {
                FusedFfn::new(up, down, n).map(|w| w.flops().0 + w.flops().1)
            }
            _ => None,
        }
        .unwrap_or_else(|| one(&blk.up) + one(&blk.down));
    }
    if let comera_model::Head::Classifier(h) = &enc.head {
        total += on_rows(&h.pool, b) + on_rows(&h.classifier, b);
    }
    total
}

/// Runs one model at one batch size in this process.
fn child(a: &StepArgs, model: &str) -> anyhow::Result<ChildReport> {
    anyhow::ensure!(a.batch.len() == 1, "--child takes exactly one --batch");
    let b = a.batch[0];
    anyhow::ensure!(b >= 1, "--batch must be at least 1");
    let cfg = config(a, model)?;
    let mut enc = Encoder::new(&cfg, SEED)?;
    let mut st = enc.state(b);
    let ocfg = AdamWConfig::default();
    let clip_norm = ocfg.clip_norm;
    let mut stepper = Stepper::plain(Optimizer::new(ocfg, None, &mut enc), &enc);
    stepper.clip_norm = clip_norm;

    // Inputs: random ids, two segments, last 10% of positions padded in every other sequence.
    ClassBatch::random(&cfg, b, SEED + 1).load(&mut st)?;

    let mut times = StepTimes::default();
    let mut loss = 0.0;
    for step in 0..WARMUP + a.steps {
        let r = stepper.step(&mut enc, &mut st, step as u64)?;
        loss = r.stats.loss;
        if step >= WARMUP {
            times.push_report(&r);
        }
    }
    let params = enc.num_params();
    Ok(ChildReport {
        step_flops: step_flops(&enc, b),
        model: model.to_string(),
        batch: b,
        seq_len: cfg.seq_len,
        times,
        peak_rss_bytes: peak_rss_bytes(),
        params,
        dense_equivalent_params: enc.dense_equivalent_params(),
        param_bytes: 2 * 4 * params,
        // Includes the scratch pool the TT/TTM layers share on this thread.
        state_bytes: st.bytes(),
        optimizer_bytes: stepper.optimizer.bytes(),
        loss,
        threads: rayon::current_num_threads(),
    })
}

/// Re-invokes this executable for one (model, batch) and parses its report.
fn spawn(a: &StepArgs, model: &str, batch: usize, threads: usize) -> anyhow::Result<ChildReport> {
    let mut args: Vec<String> = ["step", "--child", model, "--batch", &batch.to_string()]
        .map(String::from)
        .to_vec();
    args.extend(["--steps".to_string(), a.steps.to_string()]);
    for (flag, v) in [
        ("--seq-len", a.seq_len),
        ("--layers", a.layers),
        ("--d-model", a.d_model),
        ("--ffn", a.ffn),
        ("--heads", a.heads),
        ("--rank", a.rank),
    ] {
        if let Some(v) = v {
            args.extend([flag.to_string(), v.to_string()]);
        }
    }
    run_child(threads, &args, &format!("`{model}` at batch {batch}"))
}

/// One model's rounds merged: medians over all timed steps, the largest peak RSS.
struct Merged {
    r: ChildReport,
    median_ms: f64,
    fwd: f64,
    bwd: f64,
    opt: f64,
    /// The other workers' idle ms per step ([`comera_optim::StepReport::pool_idle`]).
    idle: f64,
    rss: u64,
}

fn merge(reports: Vec<ChildReport>) -> Merged {
    let rss = reports.iter().map(|r| r.peak_rss_bytes).max().unwrap_or(0);
    let [median_ms, fwd, bwd, opt, idle] = StepTimes::pooled(reports.iter().map(|r| &r.times));
    let r = reports.into_iter().next().expect("at least one round");
    Merged {
        r,
        median_ms,
        fwd,
        bwd,
        opt,
        idle,
        rss,
    }
}

/// Column widths of the text table.
const TABLE: TextTable = TextTable(&[6, 5, 10, 9, 9, 9, 10, 11, 9, 10, 10, 10, 10, 11, 8, 6]);

pub fn run(a: StepArgs) -> anyhow::Result<ExitCode> {
    if let Some(ordinal) = a.device.cuda_ordinal() {
        return on_gpu(&a, ordinal);
    }
    if a.ops {
        // On a pool worker with the others polling, as in a step (`Stepper::step`).
        rayon::scope(|_| comera_optim::with_workers_awake(|| ops(&a)))?;
        return Ok(ExitCode::SUCCESS);
    }
    if let Some(model) = a.child.clone() {
        let rep = rayon::scope(|_| child(&a, &model))?; // on a pool worker, as `comera train` runs
        return report_to_parent(&rep);
    }
    anyhow::ensure!(a.rounds >= 1, "--rounds must be at least 1");
    anyhow::ensure!(a.steps >= 1, "--steps must be at least 1");
    anyhow::ensure!(!a.models.is_empty(), "--models: nothing to measure");
    for m in &a.models {
        config(&a, m)?; // fail early, in the parent, on a bad configuration
    }
    if a.scaling {
        return scaling(&a);
    }
    let threads = rayon::current_num_threads();
    // The machine's GEMM rate in this run, next to each step's achieved rate.
    let cal_gflops = gemm_calibration_gflops(CAL_N, 7);
    if !a.json {
        print_step_header(&a, threads)?;
    }
    for &batch in &a.batch {
        anyhow::ensure!(batch >= 1, "--batch must be at least 1");
        let mut per_model: Vec<Vec<ChildReport>> = a.models.iter().map(|_| Vec::new()).collect();
        for _ in 0..a.rounds {
            for (i, m) in a.models.iter().enumerate() {
                per_model[i].push(spawn(&a, m, batch, threads)?);
            }
        }
        let merged: Vec<Merged> = per_model.into_iter().map(merge).collect();
        print_batch(&a, batch, &merged, cal_gflops);
    }
    Ok(ExitCode::SUCCESS)
}

/// The step table's title line (the model's sizes, steps, rounds, threads) and its header.
fn print_step_header(a: &StepArgs, threads: usize) -> anyhow::Result<()> {
    let c = config(a, &a.models[0])?;
    println!(
        "training step (forward+loss, backward, clip, AdamW); {} layers, d {}, ffn {}, heads {}, \
         seq {}; {} timed steps after {WARMUP} warm-up × {} rounds (one process per model and round); \
         {threads} threads",
        c.layers, c.d_model, c.ffn, c.heads, c.seq_len, a.steps, a.rounds
    );
    println!(
        "{}",
        TABLE.line(&[
            "model",
            "batch",
            "median_ms",
            "fwd_ms",
            "bwd_ms",
            "opt_ms",
            "tokens/s",
            "params",
            "rss_MB",
            "param+g_MB",
            "adam_MB",
            "state_MB",
            "engine_MB",
            "GFLOP/step",
            "GFLOP/s",
            "%cal",
        ])
    );
    Ok(())
}

/// One batch size's rows (JSON lines with `--json`), and with both a dense and a TT model
/// the comparison line; `cal_gflops`: the GEMM calibration rate.
fn print_batch(a: &StepArgs, batch: usize, merged: &[Merged], cal_gflops: f64) {
    let find = |name: &str| merged.iter().find(|m| m.r.model == name);
    let (dense, tt) = (find("dense"), find("tt"));
    for m in merged {
        let r = &m.r;
        let tokens_per_s = (r.batch * r.seq_len) as f64 / (m.median_ms / 1e3);
        let engine = r.param_bytes + r.optimizer_bytes + r.state_bytes;
        let rate = gflops(r.step_flops, m.median_ms);
        if a.json {
            let mut rec = serde_json::json!({
                "model": r.model, "batch": r.batch, "seq_len": r.seq_len,
                "median_ms": m.median_ms, "fwd_ms": m.fwd, "bwd_ms": m.bwd, "opt_ms": m.opt,
                "idle_ms": m.idle, "tokens_per_s": tokens_per_s, "peak_rss_bytes": m.rss,
                "params": r.params, "dense_equivalent_params": r.dense_equivalent_params,
                "param_bytes": r.param_bytes, "state_bytes": r.state_bytes,
                "optimizer_bytes": r.optimizer_bytes, "engine_bytes": engine,
                "steps": a.steps * a.rounds, "loss": r.loss, "threads": r.threads,
                "step_flops": r.step_flops, "gflops": rate,
                "calibration_gflops": cal_gflops,
            });
            if let (Some(d), "tt") = (dense, r.model.as_str()) {
                rec["speedup_vs_dense"] = (d.median_ms / m.median_ms).into();
                rec["rss_ratio_vs_dense"] = (d.rss as f64 / m.rss.max(1) as f64).into();
            }
            println!("{rec}");
        } else {
            let row = [
                r.model.clone(),
                r.batch.to_string(),
                format!("{:.2}", m.median_ms),
                format!("{:.2}", m.fwd),
                format!("{:.2}", m.bwd),
                format!("{:.2}", m.opt),
                format!("{tokens_per_s:.0}"),
                r.params.to_string(),
                format!("{:.1}", m.rss as f64 / MB),
                format!("{:.1}", r.param_bytes as f64 / MB),
                format!("{:.1}", r.optimizer_bytes as f64 / MB),
                format!("{:.1}", r.state_bytes as f64 / MB),
                format!("{:.1}", engine as f64 / MB),
                format!("{:.2}", r.step_flops / 1e9),
                format!("{rate:.1}"),
                format!("{:.0}", 100.0 * rate / cal_gflops),
            ];
            println!("{}", TABLE.line(&row));
        }
    }
    if let (Some(d), Some(t), false) = (dense, tt, a.json) {
        let eng = |m: &Merged| (m.r.param_bytes + m.r.optimizer_bytes + m.r.state_bytes) as f64;
        println!(
            "batch {batch}: TT speedup {:.2}x (dense {:.2} ms / TT {:.2} ms); peak RSS dense/TT {:.2}x \
             ({:.0} / {:.0} MB); engine bytes dense/TT {:.2}x; params dense/TT {:.1}x",
            d.median_ms / t.median_ms,
            d.median_ms,
            t.median_ms,
            d.rss as f64 / t.rss.max(1) as f64,
            d.rss as f64 / MB,
            t.rss as f64 / MB,
            eng(d) / eng(t),
            d.r.params as f64 / t.r.params as f64
        );
    }
}

/// `--ops`: each operation of a TT/TTM training step timed on its own, as the encoder runs it
/// (fused q/k/v and FFN where the planner allows; the pool's other workers polling for work
/// between parallel sections, as through a step), with counted FLOPs (the layers' own
/// formulas) and achieved GFLOP/s, and a 1024³ GEMM through the engine as the reference rate.
fn ops(a: &StepArgs) -> anyhow::Result<()> {
    let b = a.batch[0];
    let cfg = config(a, "tt")?;
    let n = b * cfg.seq_len;
    let mut times = OpTimes {
        reps: a.steps.max(5),
        rows: Vec::new(),
    };
    // One generator for every layer and input, drawn from in this order.
    let mut rng = init::rng(SEED);
    let lay = cfg.validate()?;
    let ffn_fused = time_tt_linears(&mut times, &mut rng, &cfg, &lay, n)?;
    time_attention_and_norm(&mut times, &mut rng, &cfg, b);
    if !ffn_fused {
        time_gelu(&mut times, &mut rng, n, cfg.ffn, cfg.layers);
    }
    time_ttm(&mut times, &mut rng, &cfg, &lay, n)?;
    time_optimizer(&mut times, &cfg)?;
    // The machine's GEMM rate in this run: a 1024³ product through the engine's one GEMM.
    let cal = gemm_calibration_gflops(CAL_N, times.reps);
    println!(
        "per-operation medians, batch {b} ({n} tokens), {} threads; GEMM calibration \
         ({CAL_N}³ product): {cal:.1} GFLOP/s",
        rayon::current_num_threads(),
    );
    print_op_table(&times.rows, cal);
    Ok(())
}

/// The rows of `--ops`: (operation, ms per call, calls per step, counted FLOPs per call; 0:
/// not counted).
struct OpTimes {
    reps: usize,
    rows: Vec<(String, f64, usize, f64)>,
}

impl OpTimes {
    /// Times `f` (the median of `reps` calls) as the row `name`.
    fn time(&mut self, name: impl Into<String>, calls: usize, flops: f64, f: impl FnMut()) {
        let name = name.into();
        let ms = median_ms(self.reps, f);
        self.rows.push((name, ms, calls, flops));
    }
}

/// The TT linear layers of a step: q/k/v and the FFN fused when the planner puts them on the
/// merged path (as the encoder does: one product for q, k, v; Up → bias+GELU → Down in row
/// blocks), each layer on its own otherwise, and the attention output. Whether the FFN is
/// fused.
fn time_tt_linears(
    times: &mut OpTimes,
    rng: &mut init::Rng,
    cfg: &EncoderConfig,
    lay: &comera_model::config::Layouts,
    n: usize,
) -> anyhow::Result<bool> {
    use comera_layers::tt_linear::{FusedFfn, SharedInput};
    use comera_layers::{Layer, RankGates, TtLinear};
    use comera_tensor::TtShape;
    let (d, nl) = (cfg.d_model, cfg.layers);
    let rule = RankGates::new(cfg.threshold);
    let tt = |s: &Option<TtShape>| {
        s.clone()
            .ok_or_else(|| anyhow::anyhow!("the tt arm has TT layers"))
    };
    let new_tt = |rng: &mut init::Rng, name: &str, shape: &TtShape| {
        TtLinear::new(name, shape.clone(), rule, rng)
    };
    let attn_shape = tt(&lay.attn)?;
    let mut qkv_layers = [
        new_tt(rng, "q", &attn_shape)?,
        new_tt(rng, "k", &attn_shape)?,
        new_tt(rng, "v", &attn_shape)?,
    ];
    let mut singles: Vec<(&str, TtShape, usize)> = vec![("tt o", attn_shape.clone(), nl)];
    let fused_qkv = {
        let refs = [&qkv_layers[0], &qkv_layers[1], &qkv_layers[2]];
        SharedInput::new(&refs, n)
    };
    match fused_qkv {
        Some(mut w) => {
            let x = normal_vec(rng, n * d);
            let dy = normal_vec(rng, n * 3 * d);
            let mut y = vec![0.0; n * 3 * d];
            let mut dx = vec![0.0; n * d];
            let (ff, fb) = w.flops();
            let refs = [&qkv_layers[0], &qkv_layers[1], &qkv_layers[2]];
            times.time("tt q/k/v fused fwd [merged]", nl, ff, || {
                w.forward(&refs, &x, &mut y)
            });
            let [q, k, v] = &mut qkv_layers;
            times.time("tt q/k/v fused bwd", nl, fb, || {
                w.backward(&mut [&mut *q, &mut *k, &mut *v], &x, &dy, &mut dx)
            });
        }
        None => singles.push(("tt q/k/v", attn_shape.clone(), 3 * nl)),
    }
    let (up_shape, down_shape) = (tt(&lay.ffn_up)?, tt(&lay.ffn_down)?);
    let mut up = new_tt(rng, "up", &up_shape)?;
    let mut down = new_tt(rng, "down", &down_shape)?;
    let ffn_fused = match FusedFfn::new(&up, &down, n) {
        Some(mut w) => {
            let x = normal_vec(rng, n * d);
            let dy = normal_vec(rng, n * d);
            let mut y = vec![0.0; n * d];
            let mut dx = vec![0.0; n * d];
            let (ff, fb) = w.flops();
            times.time("tt ffn up+gelu+down fused fwd", nl, ff, || {
                w.forward(&up, &down, &x, &mut y)
            });
            times.time("tt ffn up+gelu+down fused bwd", nl, fb, || {
                w.backward(&mut up, &mut down, &x, &dy, &mut dx)
            });
            true
        }
        None => {
            singles.push(("tt ffn up", up_shape.clone(), nl));
            singles.push(("tt ffn down", down_shape.clone(), nl));
            false
        }
    };
    for (name, shape, count) in singles {
        let mut layer = new_tt(rng, name, &shape)?;
        let mut ws = layer.workspace(n);
        let x = normal_vec(rng, n * layer.in_features());
        let dy = normal_vec(rng, n * layer.out_features());
        let mut y = vec![0.0; n * layer.out_features()];
        let mut dx = vec![0.0; n * layer.in_features()];
        let (ff, fb) = ws.flops();
        let fwd = format!(
            "{name} fwd [{}; ws {:.2} MB]",
            ws.path(),
            ws.bytes() as f64 / MB
        );
        times.time(fwd, count, ff, || layer.forward(&mut ws, &x, &mut y));
        times.time(format!("{name} bwd"), count, fb, || {
            layer.backward(&mut ws, &x, &dy, Some(&mut dx))
        });
    }
    Ok(ffn_fused)
}

/// Attention as the encoder runs it (P kept, or recomputed in the backward at larger
/// batches), and LayerNorm.
fn time_attention_and_norm(
    times: &mut OpTimes,
    rng: &mut init::Rng,
    cfg: &EncoderConfig,
    b: usize,
) {
    use comera_layers::attention::Attention;
    use comera_layers::norm::LayerNorm;
    use comera_layers::Layer;
    let (t, d, nl) = (cfg.seq_len, cfg.d_model, cfg.layers);
    let n = b * t;
    let attn = Attention::new(d, cfg.heads);
    let mut aws = attn.workspace_for(b, t);
    let qkv = normal_vec(rng, 3 * n * d);
    let dout = normal_vec(rng, n * d);
    let mut out = vec![0.0; n * d];
    let mut dqkv = vec![0.0; 3 * n * d];
    let mask: Vec<u8> = (0..n).map(|i| (i % t < t - t / 10) as u8).collect();
    times.time("attention fwd", nl, attn.forward_flops(b, t), || {
        attn.forward(&mut aws, &qkv, Some(&mask), &mut out)
    });
    let bwd = if aws.recomputes() {
        "attention bwd (P recomputed)"
    } else {
        "attention bwd (P kept)"
    };
    let bwd_flops = attn.backward_flops(&aws);
    times.time(bwd, nl, bwd_flops, || {
        attn.backward(&mut aws, &qkv, &dout, &mut dqkv)
    });
    let mut ln = LayerNorm::new("ln", d);
    let mut lws = ln.workspace(n);
    let x = normal_vec(rng, n * d);
    let mut y = vec![0.0; n * d];
    times.time("layernorm fwd", 2 * nl + 1, 0.0, || {
        ln.forward(&mut lws, &x, &mut y)
    });
    times.time("layernorm bwd", 2 * nl + 1, 0.0, || {
        ln.backward(&mut lws, &x, &dout, Some(&mut y))
    });
}

/// GELU as the encoder runs an unfused FFN (`n` rows of `ffn` hidden values): up to
/// KEEP_GELU_MAX_ROWS rows the forward keeps g and GELU'(h) from one pass and the backward
/// multiplies; above, the forward gives g alone and the backward evaluates both again, then
/// multiplies.
fn time_gelu(times: &mut OpTimes, rng: &mut init::Rng, n: usize, ffn: usize, layers: usize) {
    use comera_layers::activation::Gelu;
    use comera_layers::elementwise::mul_into;
    let mut h = normal_vec(rng, n * ffn);
    let (mut g, mut dg) = (vec![0.0; n * ffn], normal_vec(rng, n * ffn));
    let ones = vec![1.0; n * ffn]; // a derivative that keeps dg's values (no underflow)
    if n <= comera_model::KEEP_GELU_MAX_ROWS {
        times.time("gelu fwd (g and GELU' kept)", layers, 0.0, || {
            Gelu.forward_and_grad_in_place(&mut h, &mut g)
        });
        times.time("gelu bwd (dg ⊙ GELU')", layers, 0.0, || {
            mul_into(&mut dg, &ones)
        });
    } else {
        times.time("gelu fwd", layers, 0.0, || Gelu.forward(&h, &mut g));
        times.time("gelu bwd (recomputed)", layers, 0.0, || {
            Gelu.forward_and_grad_in_place(&mut h, &mut g);
            mul_into(&mut dg, &ones);
        });
    }
}

/// The TTM word table's lookup and its backward.
fn time_ttm(
    times: &mut OpTimes,
    rng: &mut init::Rng,
    cfg: &EncoderConfig,
    lay: &comera_model::config::Layouts,
    n: usize,
) -> anyhow::Result<()> {
    use comera_layers::{EmbeddingLayer, RankGates, TtmEmbedding};
    let d = cfg.d_model;
    let shape = lay
        .word
        .clone()
        .ok_or_else(|| anyhow::anyhow!("the tt arm has a TTM table"))?;
    let mut emb = TtmEmbedding::new("word", shape, RankGates::new(cfg.threshold), 1.0, rng)?;
    let mut ews = emb.workspace(n);
    let ids: Vec<u32> = (0..n as u32)
        .map(|i| (i * 7919) % cfg.vocab_size as u32)
        .collect();
    let mut ey = vec![0.0; n * d];
    let dey = normal_vec(rng, n * d);
    let fwd = format!("ttm fwd [ws {:.2} MB]", ews.bytes() as f64 / MB);
    times.time(fwd, 1, 0.0, || {
        emb.forward(&mut ews, &ids, &mut ey).expect("ids < V")
    });
    times.time("ttm bwd", 1, 0.0, || emb.backward(&mut ews, &ids, &dey));
    Ok(())
}

/// The step's work over all parameters: gradient clipping, AdamW's update, zeroing the
/// gradients.
fn time_optimizer(times: &mut OpTimes, cfg: &EncoderConfig) -> anyhow::Result<()> {
    let mut enc = Encoder::new(cfg, SEED)?;
    let ocfg = AdamWConfig::default();
    let mut opt = AdamW::new(ocfg, |f| enc.visit_params_mut(f));
    let mut sums = ParamSums::default();
    // As the step runs them: over the model's parallel visit.
    times.time(
        format!("clip norm ({} params)", enc.num_params()),
        1,
        0.0,
        || {
            clip_scale_par(1.0, &mut enc, &mut sums);
        },
    );
    times.time("adamw", 1, 0.0, || opt.step_par(1.0, 1.0, &mut enc));
    times.time("zero grad", 1, 0.0, || enc.zero_grad());
    Ok(())
}

/// The `--ops` table: per operation its time per call and per step, counted GFLOP per step,
/// the rate and its share of the GEMM calibration `cal`; then the sums.
fn print_op_table(rows: &[(String, f64, usize, f64)], cal: f64) {
    let table = TextTable(&[44, 10, 6, 10, 10, 9, 6]);
    println!(
        "{}",
        table.line(&[
            "op",
            "ms/call",
            "calls",
            "ms/step",
            "GFLOP/step",
            "GFLOP/s",
            "%cal"
        ])
    );
    let (mut total, mut total_flops, mut counted_ms) = (0.0, 0.0, 0.0);
    for (name, ms, count, flops) in rows {
        let per_step = ms * *count as f64;
        total += per_step;
        let (fl, rate, pct) = if *flops > 0.0 {
            total_flops += flops * *count as f64;
            counted_ms += per_step;
            (
                format!("{:.2}", flops * *count as f64 / 1e9),
                format!("{:.1}", gflops(*flops, *ms)),
                format!("{:.0}", 100.0 * gflops(*flops, *ms) / cal),
            )
        } else {
            (String::new(), String::new(), String::new())
        };
        let row = [
            name.clone(),
            format!("{ms:.3}"),
            count.to_string(),
            format!("{per_step:.2}"),
            fl,
            rate,
            pct,
        ];
        println!("{}", table.line(&row));
    }
    println!(
        "{}",
        table.line(&[
            "sum",
            "",
            "",
            &format!("{total:.2}"),
            &format!("{:.2}", total_flops / 1e9),
            &format!("{:.1}", gflops(total_flops, counted_ms)),
            &format!("{:.0}", 100.0 * gflops(total_flops, counted_ms) / cal),
        ])
    );
    println!(
        "counted work over the whole step: {:.1} GFLOP/s ({:.0}% of the calibration); at the \
         calibration rate it would take {:.1} ms",
        gflops(total_flops, total),
        100.0 * gflops(total_flops, total) / cal,
        total_flops / cal / 1e6
    );
}

/// The thread counts `--scaling` measures: `--threads-list`, or 1, 2, 4, … below the machine's
/// cores (`available_parallelism`) and the cores themselves.
fn scaling_counts(a: &StepArgs) -> Vec<usize> {
    if !a.threads_list.is_empty() {
        return a.threads_list.clone();
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut v: Vec<usize> = std::iter::successors(Some(1usize), |t| Some(t * 2))
        .take_while(|&t| t < cores)
        .collect();
    v.push(cores);
    v
}

/// `--scaling`: every (model, batch) at each thread count, one child process per (count,
/// round), the counts interleaved within each round (so a burst of load on the machine falls on
/// all of them), medians over every timed step; speed-up T₁/T_p and efficiency T₁/(p·T_p)
/// against the 1-thread median (or the first count's, scaled by its threads, when 1 is not
/// measured).
fn scaling(a: &StepArgs) -> anyhow::Result<ExitCode> {
    let counts = scaling_counts(a);
    anyhow::ensure!(
        counts.iter().all(|&t| t >= 1),
        "--threads-list: thread counts are at least 1"
    );
    let table = TextTable(&[6, 5, 8, 10, 9, 9, 9, 9, 9, 11]);
    if !a.json {
        let c = config(a, &a.models[0])?;
        println!(
            "scaling of the training step; {} layers, d {}, seq {}; {} timed steps after \
             {WARMUP} warm-up × {} rounds per thread count (interleaved); threads {counts:?}",
            c.layers, c.d_model, c.seq_len, a.steps, a.rounds
        );
        println!(
            "{}",
            table.line(&[
                "model",
                "batch",
                "threads",
                "median_ms",
                "fwd_ms",
                "bwd_ms",
                "opt_ms",
                "idle_ms",
                "speedup",
                "efficiency"
            ])
        );
    }
    for &batch in &a.batch {
        anyhow::ensure!(batch >= 1, "--batch must be at least 1");
        for m in &a.models {
            let mut per_count: Vec<Vec<ChildReport>> = counts.iter().map(|_| Vec::new()).collect();
            for r in 0..a.rounds {
                // Round r starts at a different count, so none always runs first.
                for i in (0..counts.len()).map(|j| (r + j) % counts.len()) {
                    per_count[i].push(spawn(a, m, batch, counts[i])?);
                }
            }
            let merged: Vec<Merged> = per_count.into_iter().map(merge).collect();
            // The 1-thread time (or the first count's, as if it scaled perfectly to it).
            let base = merged[0].median_ms * counts[0] as f64;
            for (m, &t) in merged.iter().zip(&counts) {
                let speedup = base / m.median_ms;
                let eff = speedup / t as f64;
                if a.json {
                    let rec = serde_json::json!({
                        "model": m.r.model, "batch": batch, "seq_len": m.r.seq_len,
                        "threads": t, "child_threads": m.r.threads,
                        "median_ms": m.median_ms, "fwd_ms": m.fwd, "bwd_ms": m.bwd,
                        "opt_ms": m.opt, "idle_ms": m.idle, "speedup": speedup,
                        "efficiency": eff,
                        "steps": a.steps * a.rounds, "loss": m.r.loss,
                    });
                    println!("{rec}");
                } else {
                    let row = [
                        m.r.model.clone(),
                        batch.to_string(),
                        t.to_string(),
                        format!("{:.2}", m.median_ms),
                        format!("{:.2}", m.fwd),
                        format!("{:.2}", m.bwd),
                        format!("{:.2}", m.opt),
                        format!("{:.2}", m.idle),
                        format!("{speedup:.2}"),
                        format!("{:.0}%", 100.0 * eff),
                    ];
                    println!("{}", table.line(&row));
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
