//! `comera bench compare`: the paper's comparison (SPEC §5) in one command — standard training
//! (dense + AdamW), GaLore (dense + gradient low-rank projection) and CoMERA (TT/TTM layers,
//! rank-adaptive) on the same model size, data, seed and number of steps.
//!
//! Two parts, each arm in its own child process (this executable re-invoked with the hidden
//! `--child`), so that every peak RSS (`VmHWM`) belongs to one arm alone:
//!
//! - timing and memory, per arm and batch size: whole training steps (forward with loss,
//!   zero-grad, backward, the rank-adaptive gradient terms for CoMERA, clipping, optimiser) on a
//!   fixed synthetic batch; median ms/step over the timed steps, and for GaLore separately the
//!   steps that recompute the SVD projections (forced after the normal steps, so both kinds are
//!   measured whatever T is), with the per-step cost amortised over T; peak RSS against the
//!   engine's own accounting (parameters, gradients, optimiser state, `EncoderState::bytes`
//!   split into activations and layer workspaces);
//! - training, per arm: `comera_train::train` on the config's data for the same steps, giving
//!   the final training loss and validation accuracy.
//!
//! Results are printed and written to the output directory as `compare.md`, `compare.json` and
//! `compare.png` (bar charts), beside each arm's resolved config and training run directory.

use crate::harness::{
    current_rss_bytes, md_header, md_row, peak_rss_bytes, pooled_median, report_to_parent,
    run_child, ClassBatch, StepTimes, MB,
};
use anyhow::{bail, ensure, Context};
use comera_layers::attention::Attention;
use comera_model::{AnyEmbedding, AnyLinear, Encoder, EncoderConfig};
use comera_optim::{Decay, GaLoreConfig, Optimizer, Schedule, Stepper};
use comera_train::plot::{plot_panels, Bars, Panel, Series};
use comera_train::{RankController, RunConfig};
use serde::{Deserialize, Serialize};
use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

const ARMS: [&str; 3] = ["dense", "galore", "comera"];
const WARMUP: usize = 2;
/// Largest disagreement between the engine's accounting and the peak RSS that counts as
/// agreement (relative to the peak RSS).
const AGREE: f64 = 0.15;

#[derive(clap::Args, Clone)]
pub struct CompareArgs {
    /// Run config (TOML) shared by every arm: data, model size, optimiser, seed, training
    /// length, and the `[galore]` and `[rank]` tables (defaults: the built-in config).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Use the paper's encoder (SPEC §5: 6 layers, d 768, 12 heads, FFN 3072, seq 128, vocab
    /// 30522, TT rank 30, TTM rank 32) instead of the config's `[model]` table.
    #[arg(long)]
    paper_model: bool,
    /// Every arm keeps only the blocks' outputs and recomputes a block's activations in the
    /// backward (`model.recompute_blocks`: less memory, one more forward of the blocks).
    #[arg(long)]
    recompute_blocks: bool,
    /// Batch sizes of the timing part (the paper: 1 for memory, 32 for speed).
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 32])]
    batch: Vec<usize>,
    /// Timed normal steps per child (after 2 warm-up steps).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// GaLore: timed projection-refresh (SVD) steps per child, after the normal steps.
    #[arg(long, default_value_t = 2)]
    refresh_steps: usize,
    /// Rounds of (dense, GaLore, CoMERA) timing children, one after the other.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Training steps per arm (one epoch of at most this many steps; default: as the config).
    #[arg(long)]
    train_steps: Option<usize>,
    /// Arms to run (dense, galore, comera).
    #[arg(long, value_delimiter = ',', default_values_t = ARMS.map(String::from).to_vec())]
    arms: Vec<String>,
    /// Skip the training part (timing and memory only).
    #[arg(long)]
    no_train: bool,
    /// Skip the timing part (training only).
    #[arg(long)]
    no_timing: bool,
    /// Output directory (results, resolved configs, training runs).
    #[arg(long, default_value = "runs/compare")]
    out: PathBuf,
    /// Internal: `time:ARM` or `train:ARM`, run in this process with `--resolved`.
    #[arg(long, hide = true)]
    child: Option<String>,
    /// Internal: the arm's resolved config.
    #[arg(long, hide = true)]
    resolved: Option<PathBuf>,
}

/// What a timing child measured.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct TimeReport {
    arm: String,
    batch: usize,
    seq_len: usize,
    threads: usize,
    times: StepTimes,
    /// GaLore: the steps that recomputed the projections.
    refresh: StepTimes,
    update_every: Option<u64>,
    peak_rss_bytes: u64,
    /// RSS when the child started (binary, libraries, thread pool), before the model.
    base_rss_bytes: u64,
    params: usize,
    dense_equivalent_params: usize,
    weight_bytes: usize,
    grad_bytes: usize,
    optimizer_bytes: usize,
    /// GaLore's optimiser bytes split: moments, projections, buffers and SVD scratch.
    galore_bytes: Option<[usize; 3]>,
    activation_bytes: usize,
    workspace_bytes: usize,
    loss: f64,
}

impl TimeReport {
    fn engine_bytes(&self) -> usize {
        self.weight_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.activation_bytes
            + self.workspace_bytes
    }
}

/// What a training child reported.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct TrainReport {
    arm: String,
    steps: u64,
    batch: usize,
    final_train_loss: Option<f64>,
    valid_loss: f64,
    valid_accuracy: f64,
    majority_accuracy: f64,
    params: usize,
    initial_params: usize,
    dense_params: usize,
    seconds: f64,
    peak_rss_bytes: u64,
    out_dir: PathBuf,
}

/// The arm's config: the same data, seed, optimiser and model size, with its layer kinds and
/// optimiser.
fn arm_config(base: &RunConfig, arm: &str, out: &Path) -> anyhow::Result<RunConfig> {
    let mut c = base.clone();
    match arm {
        "dense" | "galore" => {
            c.model.tt_linear = false;
            c.model.ttm_embedding = false;
            c.rank.enabled = false;
            c.galore = (arm == "galore").then(|| base.galore.clone().unwrap_or_default());
        }
        "comera" => {
            c.model.tt_linear = true;
            c.model.ttm_embedding = true;
            c.galore = None;
        }
        other => bail!("--arms: unknown arm `{other}` (expected dense, galore or comera)"),
    }
    c.train.out_dir = out.join(format!("train-{arm}"));
    c.validate()
        .map_err(|e| anyhow::anyhow!("{arm} arm configuration: {e}"))?;
    Ok(c)
}

/// The shared config: the file (or built-in), the paper model if asked, the step override.
fn base_config(a: &CompareArgs) -> anyhow::Result<RunConfig> {
    let mut c = match &a.config {
        Some(p) => RunConfig::from_file(p)?,
        None => RunConfig::builtin(),
    };
    if a.paper_model {
        c.model = EncoderConfig {
            num_labels: c.model.num_labels,
            dropout: c.model.dropout,
            ..EncoderConfig::default()
        };
    }
    if a.recompute_blocks {
        c.model.recompute_blocks = true;
    }
    if let Some(n) = a.train_steps {
        ensure!(n >= 1, "--train-steps must be at least 1");
        c.train.epochs = 1;
        c.train.max_steps_per_epoch = n;
        c.train.log_every = c.train.log_every.min(n);
    }
    c.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(c)
}

/// Bytes of the layer workspaces an `EncoderState` for `b` sequences holds (TT/TTM saved
/// intermediates and scratch, attention probabilities): made afresh with the layers' own
/// constructors and measured, one at a time (call after reading the peak RSS).
fn layer_workspace_bytes(enc: &Encoder, b: usize) -> usize {
    let c = &enc.cfg;
    let n = b * c.seq_len;
    let mut total = AnyEmbedding::workspace_bytes(&enc.word.workspace(n));
    for blk in &enc.blocks {
        for l in [&blk.q, &blk.k, &blk.v, &blk.o, &blk.up, &blk.down] {
            total += AnyLinear::workspace_bytes(&l.workspace(n));
        }
    }
    // As the encoder makes them: P is recomputed in the backward, not kept.
    let attn = Attention::new(c.d_model, c.heads).workspace_recompute(b, c.seq_len);
    total + c.layers * Attention::workspace_bytes(&attn)
}

/// One arm at one batch size, in this process.
fn time_child(cfg: &RunConfig, arm: &str, a: &CompareArgs) -> anyhow::Result<TimeReport> {
    ensure!(a.batch.len() == 1, "--child takes exactly one --batch");
    let b = a.batch[0];
    ensure!(b >= 1, "--batch must be at least 1");
    let base_rss_bytes = current_rss_bytes();
    let mcfg = &cfg.model;
    let mut enc = Encoder::new(mcfg, cfg.train.seed)?;
    let mut st = enc.state(b);
    // The training step as runs take it (constant learning rate: the schedule does not change
    // the work).
    let optimizer = Optimizer::new(cfg.optim.clone(), cfg.galore.clone(), &mut enc);
    let rank = RankController::new(&cfg.rank, &enc);
    let schedule = Schedule {
        warmup: 0,
        total: u64::MAX,
        decay: Decay::Constant,
    };
    let mut stepper = Stepper::new(
        optimizer,
        rank,
        schedule,
        cfg.optim.clip_norm,
        mcfg.threshold,
    );
    ClassBatch::random(mcfg, b, cfg.train.seed.wrapping_add(1)).load(&mut st)?;

    let (mut times, mut refresh_times) = (StepTimes::default(), StepTimes::default());
    let refreshes = if matches!(stepper.optimizer, Optimizer::GaLore(_)) {
        a.refresh_steps
    } else {
        0
    };
    let mut loss = 0.0;
    for step in 0..WARMUP + a.steps + refreshes {
        let forced = step >= WARMUP + a.steps;
        let refresh = match &mut stepper.optimizer {
            Optimizer::GaLore(g) => {
                if forced {
                    g.request_refresh();
                }
                g.refresh_due()
            }
            Optimizer::AdamW(_) => false,
        };
        let r = stepper
            .step(&mut enc, &mut st, step as u64)
            .with_context(|| format!("{arm}: step {step}"))?;
        loss = r.stats.loss;
        if step >= WARMUP {
            let kind = if refresh {
                &mut refresh_times
            } else {
                &mut times
            };
            kind.push_report(&r);
        }
    }
    let peak_rss_bytes = peak_rss_bytes();
    // Accounting (after the peak was read: the workspaces are rebuilt to be measured).
    let params = enc.num_params();
    let state = st.bytes();
    // TT/TTM layers borrow their per-call scratch from one pool per thread, shared by every
    // layer (`EncoderState::bytes` counts this thread's, which ran the steps).
    let layer_ws = (layer_workspace_bytes(&enc, b)
        + comera_layers::tt_linear::scratch_pool_bytes())
    .min(state);
    let workspace_bytes = layer_ws;
    let (optimizer_bytes, galore_bytes, update_every) = match &stepper.optimizer {
        Optimizer::AdamW(o) => (o.bytes(), None, None),
        Optimizer::GaLore(g) => {
            let d = g.breakdown();
            (
                d.total(),
                Some([d.moments, d.projections, d.scratch]),
                Some(g.galore.update_every),
            )
        }
    };
    Ok(TimeReport {
        arm: arm.to_string(),
        batch: b,
        seq_len: mcfg.seq_len,
        threads: rayon::current_num_threads(),
        times,
        refresh: refresh_times,
        update_every,
        peak_rss_bytes,
        base_rss_bytes,
        params,
        dense_equivalent_params: enc.dense_equivalent_params(),
        weight_bytes: 4 * params,
        grad_bytes: 4 * params,
        optimizer_bytes,
        galore_bytes,
        activation_bytes: state - layer_ws,
        workspace_bytes,
        loss,
    })
}

/// The last training-window loss of a run's metrics log.
fn last_train_loss(metrics: &Path) -> Option<f64> {
    use comera_train::observe::Record;
    let text = std::fs::read_to_string(metrics).ok()?;
    text.lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<Record>(l).ok())
        .find_map(|r| match r {
            Record::Train(t) => Some(t.loss),
            _ => None,
        })
}

fn train_child(cfg: &RunConfig, arm: &str) -> anyhow::Result<TrainReport> {
    // Each arm's scratch run directory is replaced by the next benchmark run.
    let opts = comera_train::RunOptions {
        overwrite: true,
        ..Default::default()
    };
    let s = comera_train::train(cfg, opts)?;
    Ok(TrainReport {
        arm: arm.to_string(),
        steps: s.steps,
        batch: cfg.train.batch_size,
        final_train_loss: last_train_loss(&s.out_dir.join("metrics.jsonl")),
        valid_loss: s.final_valid.loss,
        valid_accuracy: s.final_valid.accuracy,
        majority_accuracy: s.majority_accuracy.unwrap_or(0.0),
        params: s.params,
        initial_params: s.initial_params,
        dense_params: s.dense_params,
        seconds: s.seconds,
        peak_rss_bytes: peak_rss_bytes(),
        out_dir: s.out_dir,
    })
}

/// Runs one child (`time:ARM` or `train:ARM`) on the arm's resolved config.
fn spawn<T: serde::de::DeserializeOwned>(
    child: &str,
    resolved: &Path,
    extra: &[String],
    threads: usize,
) -> anyhow::Result<T> {
    let mut args: Vec<OsString> = ["compare", "--child", child, "--resolved"]
        .map(OsString::from)
        .to_vec();
    args.push(resolved.into());
    args.extend(extra.iter().map(OsString::from));
    run_child(threads, &args, &format!("`{child}`"))
}

/// One arm at one batch, its rounds merged.
#[derive(Clone, Debug, Serialize)]
struct Timing {
    arm: String,
    batch: usize,
    seq_len: usize,
    threads: usize,
    steps: usize,
    median_ms: f64,
    fwd_ms: f64,
    bwd_ms: f64,
    opt_ms: f64,
    tokens_per_s: f64,
    /// GaLore: median of the refresh steps, and the step time amortised over T.
    refresh_ms: Option<f64>,
    refresh_opt_ms: Option<f64>,
    update_every: Option<u64>,
    amortised_ms: f64,
    peak_rss_bytes: u64,
    base_rss_bytes: u64,
    params: usize,
    dense_equivalent_params: usize,
    compression: f64,
    weight_bytes: usize,
    grad_bytes: usize,
    optimizer_bytes: usize,
    galore_moment_bytes: Option<usize>,
    galore_projection_bytes: Option<usize>,
    galore_scratch_bytes: Option<usize>,
    activation_bytes: usize,
    workspace_bytes: usize,
    engine_bytes: usize,
    /// (peak RSS − process baseline − engine bytes) / peak RSS.
    rss_gap: f64,
    agrees: bool,
    explanation: Option<String>,
    loss: f64,
}

fn merge(reports: Vec<TimeReport>) -> Timing {
    let [median_ms, fwd_ms, bwd_ms, opt_ms, _] =
        StepTimes::pooled(reports.iter().map(|r| &r.times));
    let refresh_ms = pooled_median(reports.iter().map(|r| &r.refresh.step_ms[..]));
    let refresh_opt_ms = pooled_median(reports.iter().map(|r| &r.refresh.opt_ms[..]));
    let rss = reports.iter().map(|r| r.peak_rss_bytes).max().unwrap_or(0);
    let base = reports.iter().map(|r| r.base_rss_bytes).max().unwrap_or(0);
    let steps = reports.iter().map(|r| r.times.step_ms.len()).sum();
    let r = &reports[0];
    let amortised_ms = match (refresh_ms, r.update_every) {
        (Some(f), Some(t)) if t >= 1 => (median_ms * (t - 1) as f64 + f) / t as f64,
        _ => median_ms,
    };
    let engine = r.engine_bytes();
    let rss_gap = (rss as f64 - base as f64 - engine as f64) / rss.max(1) as f64;
    let agrees = rss_gap.abs() <= AGREE;
    let explanation = (!agrees).then(|| explain(r, rss, base, engine));
    Timing {
        arm: r.arm.clone(),
        batch: r.batch,
        seq_len: r.seq_len,
        threads: r.threads,
        steps,
        median_ms,
        fwd_ms,
        bwd_ms,
        opt_ms,
        tokens_per_s: (r.batch * r.seq_len) as f64 / (median_ms / 1e3),
        refresh_ms,
        refresh_opt_ms,
        update_every: r.update_every,
        amortised_ms,
        peak_rss_bytes: rss,
        base_rss_bytes: base,
        params: r.params,
        dense_equivalent_params: r.dense_equivalent_params,
        compression: r.dense_equivalent_params as f64 / r.params.max(1) as f64,
        weight_bytes: r.weight_bytes,
        grad_bytes: r.grad_bytes,
        optimizer_bytes: r.optimizer_bytes,
        galore_moment_bytes: r.galore_bytes.map(|b| b[0]),
        galore_projection_bytes: r.galore_bytes.map(|b| b[1]),
        galore_scratch_bytes: r.galore_bytes.map(|b| b[2]),
        activation_bytes: r.activation_bytes,
        workspace_bytes: r.workspace_bytes,
        engine_bytes: engine,
        rss_gap,
        agrees,
        explanation,
        loss: r.loss,
    }
}

/// Why the peak RSS and the accounting (process baseline + engine) differ by more than 15%,
/// from what was measured.
fn explain(r: &TimeReport, rss: u64, base: u64, engine: usize) -> String {
    let mb = |b: f64| b / MB;
    let rest = rss as f64 - base as f64 - engine as f64;
    let mut s = format!(
        "peak RSS {:.1} MB vs process baseline {:.1} MB (binary, libraries, thread stacks, \
         measured before the model was built) + engine {:.1} MB",
        mb(rss as f64),
        mb(base as f64),
        mb(engine as f64)
    );
    if rest >= 0.0 {
        let _ = write!(
            s,
            "; the remaining {:.1} MB ({:.0}% of the peak) are allocations outside the engine's \
             accounting: GEMM packing buffers, allocator slack and fragmentation{}",
            mb(rest),
            100.0 * rest / rss.max(1) as f64,
            if r.galore_bytes.is_some() {
                ", and faer's SVD temporaries on refresh steps"
            } else {
                ""
            }
        );
    } else {
        let _ = write!(
            s,
            "; the accounting exceeds the peak by {:.1} MB: buffers allocated zeroed but never \
             written (e.g. the unused part of a scratch sized for the worst case) are not resident",
            mb(-rest)
        );
    }
    s
}

/// The note for a GaLore arm that projected no matrix: it is the dense + AdamW arm again.
fn galore_equals_dense(g: &GaLoreConfig) -> String {
    format!(
        "the GaLore arm projected no matrix (rank {} is not below any matrix's smaller side): \
         it is the dense + AdamW arm again; set a smaller galore.rank, or 0 for a quarter of \
         each matrix's smaller side",
        g.rank_label()
    )
}

/// `v` with `decimals` decimals, or "–" when there is none.
fn or_dash(v: Option<f64>, decimals: usize) -> String {
    v.map(|x| format!("{x:.decimals$}"))
        .unwrap_or_else(|| "–".into())
}

fn arm_label(arm: &str) -> &str {
    match arm {
        "dense" => "dense + AdamW",
        "galore" => "dense + GaLore",
        "comera" => "CoMERA (TT/TTM)",
        other => other,
    }
}

/// One series of bars: bar i of `values` is centred at `x0 + i` (arm i + 1 sits at x = i + 1,
/// so a group of series shifts `x0` around 1).
fn bars(name: &str, x0: f64, values: &[f64]) -> Series {
    Series::new(
        name,
        values
            .iter()
            .enumerate()
            .map(|(i, &v)| (x0 + i as f64, v))
            .collect(),
    )
}

fn chart(
    path: &Path,
    timings: &[Timing],
    arms: &[String],
    batches: &[usize],
) -> anyhow::Result<()> {
    let mut panels = Vec::new();
    for &b in batches {
        let row: Vec<&Timing> = arms
            .iter()
            .filter_map(|a| timings.iter().find(|t| &t.arm == a && t.batch == b))
            .collect();
        if row.is_empty() {
            continue;
        }
        let names: Vec<String> = row.iter().map(|t| arm_label(&t.arm).to_string()).collect();
        panels.push(Panel {
            title: format!("batch {b}: median ms per training step"),
            x_label: "arm".into(),
            y_label: "ms/step".into(),
            series: vec![
                bars(
                    "median ms/step",
                    1.0 - 0.2,
                    &row.iter().map(|t| t.median_ms).collect::<Vec<_>>(),
                ),
                bars(
                    "amortised incl. SVD refresh",
                    1.0 + 0.2,
                    &row.iter().map(|t| t.amortised_ms).collect::<Vec<_>>(),
                ),
            ],
            log_y: false,
            bars: Some(Bars {
                width: 0.35,
                x_names: names.clone(),
            }),
            ..Default::default()
        });
        let w = 0.13;
        let comp = |f: fn(&Timing) -> f64| row.iter().map(|t| f(t) / MB).collect::<Vec<_>>();
        panels.push(Panel {
            title: format!("batch {b}: memory, MB"),
            x_label: "arm".into(),
            y_label: "MB".into(),
            series: vec![
                bars(
                    "peak RSS",
                    1.0 - 2.5 * w,
                    &comp(|t| t.peak_rss_bytes as f64),
                ),
                bars("weights", 1.0 - 1.5 * w, &comp(|t| t.weight_bytes as f64)),
                bars("gradients", 1.0 - 0.5 * w, &comp(|t| t.grad_bytes as f64)),
                bars(
                    "optimiser",
                    1.0 + 0.5 * w,
                    &comp(|t| t.optimizer_bytes as f64),
                ),
                bars(
                    "activations",
                    1.0 + 1.5 * w,
                    &comp(|t| t.activation_bytes as f64),
                ),
                bars(
                    "workspaces",
                    1.0 + 2.5 * w,
                    &comp(|t| t.workspace_bytes as f64),
                ),
            ],
            log_y: false,
            bars: Some(Bars {
                width: w,
                x_names: names.clone(),
            }),
            ..Default::default()
        });
    }
    plot_panels(path, &panels, 1000, 340)?;
    Ok(())
}

fn ratio_line(
    what: &str,
    num: &Timing,
    den: &Timing,
    paper: &str,
    target: Option<(f64, f64)>,
) -> String {
    let mem = num.peak_rss_bytes as f64 / den.peak_rss_bytes.max(1) as f64;
    let speed = num.median_ms / den.median_ms;
    let amort = num.amortised_ms / den.amortised_ms;
    let mut s = format!(
        "- batch {}: {what}: peak RSS {:.2}x less ({:.1} MB / {:.1} MB), {:.2}x faster per step \
         (median {:.2} ms / {:.2} ms)",
        num.batch,
        mem,
        num.peak_rss_bytes as f64 / MB,
        den.peak_rss_bytes as f64 / MB,
        speed,
        num.median_ms,
        den.median_ms
    );
    if let Some(t) = num.update_every.filter(|_| num.refresh_ms.is_some()) {
        let _ = write!(
            s,
            ", {amort:.2}x with GaLore's SVD refresh amortised over T = {t} ({:.2} ms / {:.2} ms)",
            num.amortised_ms, den.amortised_ms
        );
    }
    let _ = write!(s, "; paper: {paper}");
    if let Some((tm, ts)) = target {
        let _ = write!(
            s,
            "; issue target ≥{tm}x memory and ≥{ts}x speed: {}",
            match (mem >= tm, speed >= ts) {
                (true, true) => "met",
                (true, false) => "memory met, speed not met",
                (false, true) => "speed met, memory not met",
                (false, false) => "not met",
            }
        );
    }
    s
}

fn report(
    a: &CompareArgs,
    base: &RunConfig,
    timings: &[Timing],
    trains: &[TrainReport],
    command: &str,
) -> String {
    let mut md = String::new();
    let m = &base.model;
    let _ = writeln!(md, "# comera bench compare\n");
    let _ = writeln!(
        md,
        "Model: {} layers, d_model {}, {} heads, FFN {}, seq {}, vocab {}; TT rank {}/{}/{}, TTM \
         rank {}. Seed {}. {} threads. Config: {}.\n",
        m.layers,
        m.d_model,
        m.heads,
        m.ffn,
        m.seq_len,
        m.vocab_size,
        m.attn_tt.rank,
        m.ffn_up_tt.rank,
        m.ffn_down_tt.rank,
        m.word_ttm.rank,
        base.train.seed,
        rayon::current_num_threads(),
        a.config
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "built-in".into())
    );
    let g = base.galore.clone().unwrap_or_default();
    let _ = writeln!(
        md,
        "Arms: dense + AdamW; dense + GaLore (rank {}, T = {}, α = {}, on the encoder's and \
         pooler's dense matrices; embeddings {}); CoMERA: TT linear layers + TTM word embedding, \
         AdamW{}.\n",
        g.rank_label(),
        g.update_every,
        g.scale,
        if g.embeddings {
            "projected too"
        } else {
            "and small matrices with AdamW"
        },
        if base.rank.enabled {
            " with the rank-adaptive objective (early stage: size penalty on the gates)"
        } else {
            " (rank adaptation off in this config)"
        }
    );
    let _ = writeln!(md, "Reproduce: `{command}`\n");
    if !timings.is_empty() {
        let _ = writeln!(
            md,
            "## Step time and memory\n\nOne process per arm and batch; a step is forward with \
             loss, backward, (CoMERA: rank-adaptive gradient terms), clipping and the optimiser, \
             on a fixed synthetic batch; medians over the timed steps after {WARMUP} warm-up \
             steps. GaLore's steps that recompute the SVD projections are timed separately \
             (\"refresh\") and the cost per step amortised over T. Memory: peak RSS (VmHWM) of \
             the arm's process, and the engine's own accounting — weights and gradients (4 bytes \
             each per parameter), optimiser state (`bytes()`; GaLore: moments, projections, SVD \
             buffers), activations (`EncoderState::bytes` minus layer workspaces) and layer \
             workspaces (TT/TTM saved intermediates, the per-thread scratch pool the TT/TTM layers \
             share, attention probabilities). The \
             accounting checked against the peak RSS is the engine's bytes plus the process \
             baseline (its RSS when the child started, before the model was built).\n"
        );
        let columns = [
            "arm",
            "batch",
            "median ms/step",
            "tokens/s",
            "refresh ms",
            "amortised ms",
            "peak RSS MB",
            "baseline MB",
            "weights MB",
            "grads MB",
            "optimiser MB",
            "activations MB",
            "workspaces MB",
            "engine MB",
            "RSS − accounted",
            "params",
            "compression",
        ];
        let _ = writeln!(md, "{}", md_header(&columns, true));
        let mb = |bytes: f64| format!("{:.1}", bytes / MB);
        for t in timings {
            let row = [
                arm_label(&t.arm).to_string(),
                t.batch.to_string(),
                format!("{:.2}", t.median_ms),
                format!("{:.0}", t.tokens_per_s),
                or_dash(t.refresh_ms, 0),
                format!("{:.2}", t.amortised_ms),
                mb(t.peak_rss_bytes as f64),
                mb(t.base_rss_bytes as f64),
                mb(t.weight_bytes as f64),
                mb(t.grad_bytes as f64),
                mb(t.optimizer_bytes as f64),
                mb(t.activation_bytes as f64),
                mb(t.workspace_bytes as f64),
                mb(t.engine_bytes as f64),
                format!(
                    "{:+.1}%{}",
                    100.0 * t.rss_gap,
                    if t.agrees { "" } else { " (see notes)" }
                ),
                t.params.to_string(),
                format!("{:.1}x", t.compression),
            ];
            let _ = writeln!(md, "{}", md_row(&row));
        }
        let _ = writeln!(md, "\nRatios (each names its baseline):\n");
        let find = |arm: &str, b: usize| timings.iter().find(|t| t.arm == arm && t.batch == b);
        for &b in &a.batch {
            if let (Some(gl), Some(c)) = (find("galore", b), find("comera", b)) {
                let (paper, target) = if b == 1 {
                    ("9x less memory, 2x faster (RTX 3090)", Some((15.0, 8.0)))
                } else {
                    ("(reported at batch 1 only)", None)
                };
                let _ = writeln!(
                    md,
                    "{}",
                    ratio_line("CoMERA vs GaLore", gl, c, paper, target)
                );
            }
            if let (Some(d), Some(c)) = (find("dense", b), find("comera", b)) {
                let paper = if b == 32 {
                    "2-3x faster per epoch than standard training"
                } else {
                    "(speed reported at batch 32)"
                };
                let _ = writeln!(md, "{}", ratio_line("CoMERA vs dense", d, c, paper, None));
            }
            if let (Some(d), Some(gl)) = (find("dense", b), find("galore", b)) {
                let _ = writeln!(
                    md,
                    "- batch {b}: GaLore vs dense: peak RSS {:.2}x less, {:.2}x faster per step \
                     (normal steps); optimiser state {:.1} MB vs {:.1} MB",
                    d.peak_rss_bytes as f64 / gl.peak_rss_bytes.max(1) as f64,
                    d.median_ms / gl.median_ms,
                    gl.optimizer_bytes as f64 / MB,
                    d.optimizer_bytes as f64 / MB
                );
            }
        }
        let notes: Vec<&Timing> = timings.iter().filter(|t| !t.agrees).collect();
        let _ = writeln!(
            md,
            "\nAccounting (baseline + engine) vs peak RSS: {} of {} measurements agree within \
             {:.0}%.",
            timings.len() - notes.len(),
            timings.len(),
            100.0 * AGREE
        );
        for t in notes {
            let _ = writeln!(
                md,
                "- {} at batch {}: {}.",
                arm_label(&t.arm),
                t.batch,
                t.explanation.as_deref().unwrap_or("")
            );
        }
        for t in timings.iter().filter(|t| t.galore_moment_bytes.is_some()) {
            if t.galore_projection_bytes == Some(0) {
                let _ = writeln!(md, "- {}", galore_equals_dense(&g));
            }
            let _ = writeln!(
                md,
                "- GaLore state at batch {}: moments {:.1} MB, projections {:.1} MB, buffers and \
                 SVD scratch {:.1} MB; refresh step {} ms (optimiser part {} ms).",
                t.batch,
                t.galore_moment_bytes.unwrap_or(0) as f64 / MB,
                t.galore_projection_bytes.unwrap_or(0) as f64 / MB,
                t.galore_scratch_bytes.unwrap_or(0) as f64 / MB,
                or_dash(t.refresh_ms, 0),
                or_dash(t.refresh_opt_ms, 0)
            );
        }
        let _ = writeln!(md);
    }
    if !trains.is_empty() {
        let _ = writeln!(
            md,
            "## Training on the config's data\n\n`comera_train::train` per arm in its own \
             process, same data, seed and steps. Final training loss: the last logged window \
             (`log_every` steps); validation: after the last epoch.\n"
        );
        let columns = [
            "arm",
            "steps",
            "batch",
            "final train loss",
            "valid loss",
            "valid accuracy",
            "majority class",
            "params (start → end)",
            "compression",
            "seconds",
            "peak RSS MB",
        ];
        let _ = writeln!(md, "{}", md_header(&columns, true));
        for t in trains {
            let row = [
                arm_label(&t.arm).to_string(),
                t.steps.to_string(),
                t.batch.to_string(),
                or_dash(t.final_train_loss, 4),
                format!("{:.4}", t.valid_loss),
                format!("{:.4}", t.valid_accuracy),
                format!("{:.4}", t.majority_accuracy),
                format!("{} → {}", t.initial_params, t.params),
                format!("{:.1}x", t.dense_params as f64 / t.params.max(1) as f64),
                format!("{:.0}", t.seconds),
                format!("{:.1}", t.peak_rss_bytes as f64 / MB),
            ];
            let _ = writeln!(md, "{}", md_row(&row));
        }
        let _ = writeln!(md);
    }
    md
}

pub fn run(a: CompareArgs) -> anyhow::Result<ExitCode> {
    if let Some(child) = a.child.clone() {
        let path = a
            .resolved
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("--child needs --resolved"))?;
        let cfg = RunConfig::from_file(path)?;
        return match child.split_once(':') {
            Some(("time", arm)) => report_to_parent(&rayon::scope(|_| time_child(&cfg, arm, &a))?),
            Some(("train", arm)) => report_to_parent(&train_child(&cfg, arm)?),
            _ => bail!("--child: expected time:ARM or train:ARM, got `{child}`"),
        };
    }
    ensure!(a.rounds >= 1, "--rounds must be at least 1");
    ensure!(a.steps >= 1, "--steps must be at least 1");
    ensure!(!a.arms.is_empty(), "--arms: nothing to run");
    ensure!(
        a.batch.iter().all(|&b| b >= 1),
        "--batch: every batch size must be at least 1"
    );
    let base = base_config(&a)?;
    std::fs::create_dir_all(&a.out)
        .with_context(|| format!("{}: cannot create the output directory", a.out.display()))?;
    // Each arm's resolved config, written where the children (and the reader) find it.
    let mut resolved = Vec::new();
    for arm in &a.arms {
        let c = arm_config(&base, arm, &a.out)?;
        let path = a.out.join(format!("config-{arm}.toml"));
        comera_train::write_atomic(&path, c.to_toml().as_bytes())?;
        resolved.push((arm.clone(), path));
    }
    let threads = rayon::current_num_threads();
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let mut timings = Vec::new();
    if !a.no_timing {
        for &b in &a.batch {
            let mut per_arm: Vec<Vec<TimeReport>> = a.arms.iter().map(|_| Vec::new()).collect();
            for _ in 0..a.rounds {
                for (i, (arm, path)) in resolved.iter().enumerate() {
                    eprintln!("timing {} at batch {b} …", arm_label(arm));
                    let extra = [
                        "--batch".to_string(),
                        b.to_string(),
                        "--steps".into(),
                        a.steps.to_string(),
                        "--refresh-steps".into(),
                        a.refresh_steps.to_string(),
                    ];
                    per_arm[i].push(spawn(&format!("time:{arm}"), path, &extra, threads)?);
                }
            }
            for reps in per_arm {
                let t = merge(reps);
                println!(
                    "{:<16} batch {:>3}: {:>9.2} ms/step (fwd {:.1}, bwd {:.1}, opt {:.1}){}  peak RSS {:>8.1} MB  engine {:>8.1} MB  params {}",
                    arm_label(&t.arm),
                    t.batch,
                    t.median_ms,
                    t.fwd_ms,
                    t.bwd_ms,
                    t.opt_ms,
                    t.refresh_ms
                        .map(|r| format!(", refresh step {r:.0} ms"))
                        .unwrap_or_default(),
                    t.peak_rss_bytes as f64 / MB,
                    t.engine_bytes as f64 / MB,
                    t.params
                );
                if t.galore_projection_bytes == Some(0) {
                    eprintln!(
                        "warning: {}",
                        galore_equals_dense(&base.galore.clone().unwrap_or_default())
                    );
                }
                timings.push(t);
            }
        }
    }
    let mut trains = Vec::new();
    if !a.no_train {
        for (arm, path) in &resolved {
            eprintln!("training {} …", arm_label(arm));
            let r: TrainReport = spawn(&format!("train:{arm}"), path, &[], threads)?;
            println!(
                "{:<16} trained {} steps: train loss {}, valid accuracy {:.4} (loss {:.4}), {} params, {:.0} s",
                arm_label(&r.arm),
                r.steps,
                or_dash(r.final_train_loss, 4),
                r.valid_accuracy,
                r.valid_loss,
                r.params,
                r.seconds
            );
            trains.push(r);
        }
    }
    let md = report(&a, &base, &timings, &trains, &command);
    println!("\n{md}");
    comera_train::write_atomic(&a.out.join("compare.md"), md.as_bytes())?;
    let json = serde_json::json!({
        "command": command,
        "threads": threads,
        "model": base.model,
        "galore": base.galore.clone().unwrap_or_default(),
        "rank": base.rank,
        "seed": base.train.seed,
        "timing": timings,
        "training": trains,
    });
    comera_train::write_atomic(
        &a.out.join("compare.json"),
        serde_json::to_string_pretty(&json)?.as_bytes(),
    )?;
    if !timings.is_empty() {
        if let Err(e) = chart(&a.out.join("compare.png"), &timings, &a.arms, &a.batch) {
            eprintln!("warning: chart not written: {e:#}");
        }
    }
    println!(
        "written: {} (compare.md, compare.json{}, config-*.toml{})",
        a.out.display(),
        if timings.is_empty() {
            ""
        } else {
            ", compare.png"
        },
        if trains.is_empty() { "" } else { ", train-*/" }
    );
    Ok(ExitCode::SUCCESS)
}
