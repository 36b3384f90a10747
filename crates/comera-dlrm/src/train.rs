//! The DLRM training loop: fixed-batch steps (forward, BCE, backward, clipping, AdamW), an
//! evaluation each epoch (AUC, log-loss, accuracy), the metrics log, the plot, model files and
//! a `report.json` with throughput and peak memory.

use crate::config::DlrmRunConfig;
use crate::data::{prepare, Prepared};
use crate::loss::{auc, bce_with_logits};
use crate::model::{Dlrm, DlrmState};
use anyhow::{anyhow, bail, Context};
use comera_data::ctr::{CtrBatch, CtrData};
use comera_optim::{clip_scale, AdamW, Schedule};
use comera_train::files::{write_atomic, MetricsLog};
use comera_train::plot::{plot_panels, Panel, Series};
use comera_train::rank::{self, RankController};
use comera_train::RankConfig;
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Validation figures.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct EvalStats {
    /// Mean BCE (log-loss).
    pub loss: f64,
    /// ROC AUC (0.5 when one class is absent).
    pub auc: f64,
    /// Accuracy at probability 0.5.
    pub accuracy: f64,
    pub examples: usize,
}

/// Evaluates on every example of `data`, batch by batch (the last partial batch is padded with
/// copies of the first example, which are not counted). `scores` is reused for the logits.
pub fn evaluate(
    model: &Dlrm,
    st: &mut DlrmState,
    data: &CtrData,
    batch: &mut CtrBatch,
    scores: &mut Vec<f32>,
) -> anyhow::Result<EvalStats> {
    let (b, n) = (st.batch(), data.len());
    if n == 0 {
        bail!("the validation set is empty");
    }
    scores.clear();
    let mut start = 0;
    while start < n {
        for j in 0..b {
            let i = if start + j < n { start + j } else { 0 };
            batch.set_from(j, data, i);
        }
        model
            .forward(st, &batch.dense, &batch.cats)
            .map_err(|e| anyhow!("validation data: {e}"))?;
        scores.extend_from_slice(&st.logits()[..b.min(n - start)]);
        start += b;
    }
    let (loss, correct) = bce_with_logits(scores, &data.labels, None);
    Ok(EvalStats {
        loss,
        auc: auc(scores, &data.labels).unwrap_or(0.5),
        accuracy: correct as f64 / n as f64,
        examples: n,
    })
}

/// What a finished run reports (also written to `report.json`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DlrmSummary {
    pub out_dir: PathBuf,
    pub epochs: usize,
    pub steps: u64,
    pub batch_size: usize,
    pub final_valid: EvalStats,
    /// Best validation AUC over the epochs and its epoch (1-based).
    pub best_valid_auc: f64,
    pub best_epoch: usize,
    pub params: usize,
    pub table_params: usize,
    pub dense_table_params: usize,
    pub tables: Vec<String>,
    /// Median of the per-step wall times (forward, loss, backward, clip, AdamW), in ms, and
    /// the samples/s it gives; batch loading is excluded.
    pub median_step_ms: f64,
    pub samples_per_s: f64,
    /// Training samples over the whole training wall time (loading included, evaluation not).
    pub overall_samples_per_s: f64,
    /// Peak resident set of the process (VmHWM), bytes; 0 where /proc is unavailable.
    pub peak_rss_bytes: u64,
    /// The engine's own accounting: parameters + gradients + AdamW moments, and the batch
    /// state (activations, table workspaces), bytes.
    pub param_bytes: usize,
    pub optimizer_bytes: usize,
    pub state_bytes: usize,
    pub seconds: f64,
}

impl DlrmSummary {
    /// Dense-table parameters over the tables' actual parameters.
    pub fn table_compression(&self) -> f64 {
        self.dense_table_params as f64 / self.table_params.max(1) as f64
    }
}

/// After a step: the rank schedule's stage switch and the truncation of pruned rank slices
/// (with the optimiser's moments cut to match).
#[allow(clippy::too_many_arguments)]
fn rank_hooks(
    rank: &mut RankController,
    model: &mut Dlrm,
    opt: &mut AdamW,
    log: &mut MetricsLog,
    step: u64,
    epoch: usize,
    epoch_end: bool,
    bar: &indicatif::ProgressBar,
) -> anyhow::Result<()> {
    if rank.after_step(model, step, epoch, epoch_end) {
        let (size, _, _) = rank::sizes(model);
        log.write(&json!({"kind": "stage", "stage": "late", "epoch": epoch, "step": step, "size": size, "target_size": rank.target_size, "ranks": rank::layer_ranks(model)}))?;
        say(
            bar,
            format!(
                "step {step}: late stage, size {size:.0} → target {:.0}",
                rank.target_size.unwrap_or(0.0)
            ),
        );
    }
    if rank.truncation_due(step, epoch_end) {
        let changed = rank::truncate(model);
        if !changed.is_empty() {
            opt.retain(&changed, |f| model.visit_params_mut(f));
            log.write(&json!({"kind": "truncate", "epoch": epoch, "step": step, "table_params": model.table_params(), "ranks": rank::layer_ranks(model)}))?;
        }
    }
    Ok(())
}

/// A line above the progress bar, or on stderr when the bar is hidden.
fn say(bar: &indicatif::ProgressBar, msg: String) {
    if bar.is_hidden() {
        eprintln!("{msg}");
    } else {
        bar.println(msg);
    }
}

/// Peak resident set size of this process (`VmHWM` in /proc/self/status), bytes.
pub fn peak_rss_bytes() -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

#[derive(Default)]
struct Curves {
    train_loss: Vec<(f64, f64)>,
    valid_loss: Vec<(f64, f64)>,
    valid_auc: Vec<(f64, f64)>,
    train_acc: Vec<(f64, f64)>,
    valid_acc: Vec<(f64, f64)>,
}

impl Curves {
    fn plot(&self, path: &Path) -> anyhow::Result<()> {
        let s = |name: &str, pts: &Vec<(f64, f64)>| Series::new(name, pts.clone());
        let panels = [
            Panel {
                title: "loss".into(),
                x_label: "step".into(),
                y_label: "binary cross-entropy".into(),
                series: vec![s("train", &self.train_loss), s("valid", &self.valid_loss)],
                log_y: false,
            },
            Panel {
                title: "validation AUC".into(),
                x_label: "step".into(),
                y_label: "AUC".into(),
                series: vec![s("valid", &self.valid_auc)],
                log_y: false,
            },
            Panel {
                title: "accuracy".into(),
                x_label: "step".into(),
                y_label: "accuracy".into(),
                series: vec![s("train", &self.train_acc), s("valid", &self.valid_acc)],
                log_y: false,
            },
        ];
        plot_panels(path, &panels, 900, 300)?;
        Ok(())
    }
}

/// What a saved model needs besides its weights (`model.toml`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DlrmMeta {
    pub model: crate::config::DlrmConfig,
    pub n_dense: usize,
    pub field_names: Vec<String>,
    pub table_sizes: Vec<usize>,
    pub tables: Vec<String>,
    pub epoch: usize,
    pub step: u64,
}

/// Writes `model.safetensors` (every parameter by name) and `model.toml`, each atomically.
pub fn save_model(dir: &Path, model: &Dlrm, meta: &DlrmMeta) -> anyhow::Result<()> {
    use safetensors::tensor::TensorView;
    use safetensors::Dtype;
    let params = model.params();
    let bytes: Vec<Vec<u8>> = params
        .iter()
        .map(|p| p.value.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = params
        .iter()
        .zip(&bytes)
        .map(|(p, b)| {
            Ok((
                p.name.clone(),
                TensorView::new(Dtype::F32, p.shape.clone(), b)?,
            ))
        })
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()?;
    let data = safetensors::serialize(views, None)?;
    write_atomic(&dir.join("model.safetensors"), &data)?;
    write_atomic(
        &dir.join("model.toml"),
        toml::to_string_pretty(meta)?.as_bytes(),
    )
}

/// Runs a whole DLRM training job as configured; writes into `cfg.train.out_dir`.
pub fn train(cfg: &DlrmRunConfig, progress: bool) -> anyhow::Result<DlrmSummary> {
    rayon::scope(|_| train_here(cfg, progress))
}

fn train_here(cfg: &DlrmRunConfig, progress: bool) -> anyhow::Result<DlrmSummary> {
    let t0 = Instant::now();
    let out = cfg.train.out_dir.clone();
    std::fs::create_dir_all(&out)
        .with_context(|| format!("{}: cannot create run directory", out.display()))?;
    let Prepared {
        mut train,
        valid,
        n_dense,
        field_names,
        table_sizes,
        summary,
    } = prepare(&cfg.data, cfg.train.seed)?;
    eprintln!("data  {summary}");
    write_atomic(&out.join("config.toml"), cfg.to_toml().as_bytes())?;
    let mut model = Dlrm::new(
        &cfg.dlrm,
        n_dense,
        &field_names,
        &table_sizes,
        cfg.train.seed,
    )
    .map_err(|e| anyhow!("dlrm: {e}"))?;
    let tables: Vec<String> = model.tables.iter().map(|t| t.describe()).collect();
    eprintln!(
        "model DLRM, dim {}, bottom {:?}, top {:?}: {} parameters; tables {} parameters ({} as dense tables, {:.1}x smaller)",
        cfg.dlrm.embedding_dim,
        cfg.dlrm.bottom_mlp,
        cfg.dlrm.top_mlp,
        model.num_params(),
        model.table_params(),
        model.dense_table_params(),
        model.dense_table_params() as f64 / model.table_params() as f64
    );
    for (name, t) in field_names.iter().zip(&tables) {
        eprintln!("      {name}: {t}");
    }
    let mut opt = AdamW::new(cfg.optim.clone(), |f| model.visit_params_mut(f));
    // Rank-adaptive training of the TTM tables when the config has a [rank] table.
    let rank_cfg = cfg.rank.clone().unwrap_or(RankConfig {
        enabled: false,
        ..RankConfig::default()
    });
    let mut rank = RankController::new(&rank_cfg, &model);
    let ranks_start = rank::layer_ranks(&model);
    let b = cfg.train.batch_size;
    let per_epoch_full = train.steps_per_epoch(b);
    if per_epoch_full == Some(0) {
        bail!("train.batch_size: {b} is larger than the training set");
    }
    let per_epoch = match (cfg.train.max_steps_per_epoch, per_epoch_full) {
        (0, p) => p,
        (m, Some(p)) => Some(m.min(p)),
        (m, None) => Some(m),
    };
    let total = per_epoch.map(|p| (p * cfg.train.epochs) as u64);
    let schedule = Schedule {
        warmup: cfg.train.warmup_steps.min(total.unwrap_or(u64::MAX)),
        total: total.unwrap_or(u64::MAX),
        decay: cfg.train.decay,
    };
    let mut st = model.state(b);
    let mut batch = CtrBatch::new(b, n_dense, field_names.len());
    let mut scores = Vec::with_capacity(valid.len() + b);
    let mut log = MetricsLog::create(&out.join("metrics.jsonl"))?;
    let mut curves = Curves::default();
    let bar = match (progress, total) {
        (false, _) => indicatif::ProgressBar::hidden(),
        (true, Some(t)) => indicatif::ProgressBar::new(t),
        (true, None) => indicatif::ProgressBar::new_spinner(),
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} {msg} [{elapsed_precise}<{eta_precise}]",
        )
        .expect("valid template"),
    );
    let mut step: u64 = 0;
    let mut step_ms: Vec<f64> = Vec::with_capacity(total.unwrap_or(1024).min(1 << 20) as usize);
    let mut train_secs = 0.0;
    let mut final_valid = EvalStats::default();
    let (mut best_auc, mut best_epoch) = (f64::NEG_INFINITY, 0);
    for epoch in 0..cfg.train.epochs {
        let ep_start = Instant::now();
        train.start_epoch(epoch, cfg.train.seed)?;
        let (mut ep_loss, mut ep_correct, mut ep_count) = (0.0, 0usize, 0usize);
        let (mut win_loss, mut win_correct, mut win_count, mut win_start) =
            (0.0, 0usize, 0usize, Instant::now());
        let mut in_epoch = 0usize;
        while per_epoch.is_none_or(|p| in_epoch < p) {
            if !train.next_batch(&mut batch)? {
                break;
            }
            let ts = Instant::now();
            model.zero_grad();
            model
                .forward(&mut st, &batch.dense, &batch.cats)
                .map_err(|e| anyhow!("training data, epoch {} step {step}: {e}", epoch + 1))?;
            let (loss, correct) = model.loss(&mut st, &batch.labels);
            if !loss.is_finite() {
                bail!("training diverged: loss is {loss} at epoch {} step {step} (lower the learning rates in [optim])", epoch + 1);
            }
            model.backward(&mut st, &batch.dense, &batch.cats);
            let obj = rank.apply(&mut model, loss);
            let (gscale, gnorm) = clip_scale(cfg.optim.clip_norm, |f| model.visit_params_mut(f));
            if !gnorm.is_finite() {
                bail!(
                    "training diverged: gradient norm is {gnorm} at epoch {} step {step}",
                    epoch + 1
                );
            }
            let lr = schedule.scale(step);
            opt.step(lr, gscale, |f| model.visit_params_mut(f));
            step_ms.push(ts.elapsed().as_secs_f64() * 1e3);
            step += 1;
            in_epoch += 1;
            let epoch_end = per_epoch == Some(in_epoch);
            rank_hooks(
                &mut rank,
                &mut model,
                &mut opt,
                &mut log,
                step,
                epoch + 1,
                epoch_end,
                &bar,
            )?;
            ep_loss += loss * b as f64;
            ep_correct += correct;
            ep_count += b;
            win_loss += loss * b as f64;
            win_correct += correct;
            win_count += b;
            if step.is_multiple_of(cfg.train.log_every as u64) {
                let secs = win_start.elapsed().as_secs_f64();
                let (l, a) = (
                    win_loss / win_count as f64,
                    win_correct as f64 / win_count as f64,
                );
                let sps = win_count as f64 / secs;
                log.write(&json!({"kind": "train", "epoch": epoch + 1, "step": step, "loss": l, "accuracy": a, "lr_scale": lr, "grad_norm": gnorm, "samples_per_s": sps, "peak_rss_bytes": peak_rss_bytes(), "size": obj.size, "branch": obj.branch}))?;
                curves.train_loss.push((step as f64, l));
                curves.train_acc.push((step as f64, a));
                bar.set_message(format!(
                    "epoch {} loss {l:.4} acc {a:.3} {sps:.0} samples/s",
                    epoch + 1
                ));
                (win_loss, win_correct, win_count, win_start) = (0.0, 0, 0, Instant::now());
            }
            bar.inc(1);
        }
        if per_epoch.is_none() {
            rank_hooks(
                &mut rank,
                &mut model,
                &mut opt,
                &mut log,
                step,
                epoch + 1,
                true,
                &bar,
            )?;
        }
        train_secs += ep_start.elapsed().as_secs_f64();
        if ep_count == 0 {
            bail!(
                "epoch {}: no full batch of {b} examples in the training data",
                epoch + 1
            );
        }
        if let Some(m) = train.malformed_summary() {
            say(&bar, format!("data  {m}"));
        }
        let v = evaluate(&model, &mut st, &valid, &mut batch, &mut scores)?;
        final_valid = v;
        if v.auc > best_auc {
            (best_auc, best_epoch) = (v.auc, epoch + 1);
        }
        let (tl, ta) = (
            ep_loss / ep_count as f64,
            ep_correct as f64 / ep_count as f64,
        );
        log.write(&json!({"kind": "eval", "epoch": epoch + 1, "step": step, "train_loss": tl, "train_accuracy": ta, "valid_loss": v.loss, "valid_auc": v.auc, "valid_accuracy": v.accuracy, "seconds": t0.elapsed().as_secs_f64(), "peak_rss_bytes": peak_rss_bytes()}))?;
        curves.valid_loss.push((step as f64, v.loss));
        curves.valid_auc.push((step as f64, v.auc));
        curves.valid_acc.push((step as f64, v.accuracy));
        say(
            &bar,
            format!(
                "epoch {}: train loss {tl:.4} acc {ta:.4} | valid loss {:.4} AUC {:.4} acc {:.4}",
                epoch + 1,
                v.loss,
                v.auc,
                v.accuracy
            ),
        );
        if cfg.train.save_model {
            let meta = DlrmMeta {
                model: cfg.dlrm.clone(),
                n_dense,
                field_names: field_names.clone(),
                table_sizes: table_sizes.clone(),
                tables: model.tables.iter().map(|t| t.describe()).collect(),
                epoch: epoch + 1,
                step,
            };
            save_model(&out, &model, &meta)?;
        }
        if let Err(e) = curves.plot(&out.join("curves.png")) {
            say(&bar, format!("warning: plot not written: {e:#}"));
        }
    }
    bar.finish_and_clear();
    if rank.active() {
        eprintln!(
            "ranks of the TTM tables:\n{}",
            rank::rank_table(&[("start", &ranks_start), ("end", &rank::layer_ranks(&model))])
        );
    }
    let med = median(&mut step_ms);
    let param_bytes = 8 * model.num_params(); // value + gradient
    let s = DlrmSummary {
        out_dir: out.clone(),
        epochs: cfg.train.epochs,
        steps: step,
        batch_size: b,
        final_valid,
        best_valid_auc: best_auc,
        best_epoch,
        params: model.num_params(),
        table_params: model.table_params(),
        dense_table_params: model.dense_table_params(),
        tables: model.tables.iter().map(|t| t.describe()).collect(),
        median_step_ms: med,
        samples_per_s: if med > 0.0 {
            b as f64 / (med / 1e3)
        } else {
            0.0
        },
        overall_samples_per_s: (step as f64 * b as f64) / train_secs.max(1e-9),
        peak_rss_bytes: peak_rss_bytes(),
        param_bytes,
        optimizer_bytes: opt.bytes(),
        state_bytes: st.bytes(),
        seconds: t0.elapsed().as_secs_f64(),
    };
    write_atomic(
        &out.join("report.json"),
        serde_json::to_string_pretty(&s)?.as_bytes(),
    )?;
    Ok(s)
}
