//! The training loop: fixed-shape steps over shuffled batches, evaluation each epoch, the
//! metrics log, the plot and the model files.

use crate::config::RunConfig;
use crate::data::{prepare, PreparedData};
use crate::files::{save_model, MetricsLog, ModelMeta};
use crate::plot::{plot_panels, Panel, Series};
use crate::rank::{self, Branch, LayerRanks, RankController, Stage};
use anyhow::{bail, Context};
use comera_data::{Batch, EncodedDataset};
use comera_layers::Retained;
use comera_model::{Encoder, EncoderState};
use comera_optim::{clip_scale, AdamW, GaLore, Schedule};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Loss and accuracy over a data set.
#[derive(Clone, Copy, Debug, Default)]
pub struct EvalStats {
    pub loss: f64,
    pub accuracy: f64,
    pub examples: usize,
}

/// Evaluates `model` on every example of `data` (the last partial batch is padded with copies
/// of the first example, which are not counted).
pub fn evaluate(
    model: &Encoder,
    st: &mut EncoderState,
    data: &EncodedDataset,
) -> anyhow::Result<EvalStats> {
    let (b, t, c) = (st.batch(), data.max_len, model.cfg.num_labels);
    let n = data.len();
    let mut batch = Batch::default();
    let (mut loss, mut correct) = (0.0f64, 0usize);
    let mut start = 0;
    while start < n {
        batch.input_ids.clear();
        batch.token_type_ids.clear();
        batch.attention_mask.clear();
        batch.labels.clear();
        for j in 0..b {
            let i = if start + j < n { start + j } else { 0 };
            batch
                .input_ids
                .extend_from_slice(&data.input_ids[i * t..(i + 1) * t]);
            batch
                .token_type_ids
                .extend_from_slice(&data.token_type_ids[i * t..(i + 1) * t]);
            batch
                .attention_mask
                .extend_from_slice(&data.attention_mask[i * t..(i + 1) * t]);
            batch.labels.push(data.labels[i]);
        }
        st.load(
            &batch.input_ids,
            &batch.token_type_ids,
            &batch.attention_mask,
            &batch.labels,
        )
        .map_err(anyhow::Error::msg)?;
        model.forward(st, false, 0)?;
        for (j, row) in st.logits().chunks_exact(c).enumerate().take(n - start) {
            let label = batch.labels[j];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let lse = max as f64
                + row
                    .iter()
                    .map(|&v| ((v - max) as f64).exp())
                    .sum::<f64>()
                    .ln();
            loss += lse - row[label] as f64;
            correct += (comera_layers::loss::argmax(row) == label) as usize;
        }
        start += b;
    }
    Ok(EvalStats {
        loss: loss / n as f64,
        accuracy: correct as f64 / n as f64,
        examples: n,
    })
}

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct TrainSummary {
    pub out_dir: PathBuf,
    pub epochs: usize,
    pub steps: u64,
    pub final_valid: EvalStats,
    pub majority_accuracy: f64,
    /// Trainable parameters at the end (after truncations).
    pub params: usize,
    /// Trainable parameters at the start.
    pub initial_params: usize,
    pub dense_params: usize,
    pub seconds: f64,
    /// Per-layer ranks of the TT/TTM layers at the start, at the switch to the late stage (if
    /// any) and at the end.
    pub ranks_start: Vec<LayerRanks>,
    pub ranks_switch: Option<Vec<LayerRanks>>,
    pub ranks_end: Vec<LayerRanks>,
}

impl TrainSummary {
    pub fn compression(&self) -> f64 {
        self.dense_params as f64 / self.params as f64
    }
}

/// Share of the most frequent label among `labels`.
fn majority(labels: &[usize], classes: usize) -> f64 {
    let mut counts = vec![0usize; classes];
    for &l in labels {
        counts[l] += 1;
    }
    *counts.iter().max().unwrap_or(&0) as f64 / labels.len().max(1) as f64
}

/// The optimiser a run uses: AdamW, or GaLore for dense matrices (AdamW for the rest).
enum Optimizer {
    AdamW(AdamW),
    GaLore(Box<GaLore>),
}

impl Optimizer {
    fn step(&mut self, lr: f32, gscale: f32, model: &mut Encoder) {
        match self {
            Optimizer::AdamW(o) => o.step(lr, gscale, |f| model.visit_params_mut(f)),
            Optimizer::GaLore(o) => o.step(lr, gscale, |f| model.visit_params_mut(f)),
        }
    }

    /// Cuts the moments of truncated parameters. GaLore runs are not truncated (see
    /// [`train`]), so only AdamW has to follow.
    fn retain(&mut self, changed: &[Retained], model: &mut Encoder) {
        if let Optimizer::AdamW(o) = self {
            o.retain(changed, |f| model.visit_params_mut(f));
        }
    }
}

struct Curves {
    train_loss: Vec<(f64, f64)>,
    valid_loss: Vec<(f64, f64)>,
    train_acc: Vec<(f64, f64)>,
    valid_acc: Vec<(f64, f64)>,
    /// Compression of the TT/TTM layers (dense / S) and of the whole model over steps.
    size_ratio: Vec<(f64, f64)>,
    model_ratio: Vec<(f64, f64)>,
    /// Per layer: mean active rank over its bonds, over steps.
    ranks: Vec<(String, Vec<(f64, f64)>)>,
}

impl Curves {
    fn record_ranks(&mut self, step: u64, layers: &[LayerRanks], dense_ref: f64, model_ratio: f64) {
        let size: f64 = layers.iter().map(|l| l.size).sum();
        self.size_ratio
            .push((step as f64, dense_ref / size.max(1.0)));
        self.model_ratio.push((step as f64, model_ratio));
        if self.ranks.is_empty() {
            self.ranks = layers
                .iter()
                .map(|l| (l.name.clone(), Vec::new()))
                .collect();
        }
        for ((_, pts), l) in self.ranks.iter_mut().zip(layers) {
            let mean = l.ranks.iter().sum::<usize>() as f64 / l.ranks.len().max(1) as f64;
            pts.push((step as f64, mean));
        }
    }

    /// Rank evolution, compression and loss over steps.
    fn plot_ranks(&self, path: &Path) -> anyhow::Result<()> {
        let s = |name: &str, pts: &Vec<(f64, f64)>| Series {
            name: name.into(),
            points: pts.clone(),
        };
        let panels = [
            Panel {
                title: "mean active rank per layer".into(),
                x_label: "step".into(),
                y_label: "rank".into(),
                series: self.ranks.iter().map(|(n, p)| s(n, p)).collect(),
                log_y: false,
            },
            Panel {
                title: "compression".into(),
                x_label: "step".into(),
                y_label: "dense / compressed".into(),
                series: vec![
                    s("TT/TTM layers (dense / S)", &self.size_ratio),
                    s("whole model", &self.model_ratio),
                ],
                log_y: true,
            },
            Panel {
                title: "loss".into(),
                x_label: "step".into(),
                y_label: "cross-entropy".into(),
                series: vec![s("train", &self.train_loss), s("valid", &self.valid_loss)],
                log_y: false,
            },
        ];
        plot_panels(path, &panels, 1300, 380)?;
        Ok(())
    }

    fn plot(&self, path: &Path) -> anyhow::Result<()> {
        let s = |name: &str, pts: &Vec<(f64, f64)>| Series {
            name: name.into(),
            points: pts.clone(),
        };
        let panels = [
            Panel {
                title: "loss".into(),
                x_label: "step".into(),
                y_label: "cross-entropy".into(),
                series: vec![s("train", &self.train_loss), s("valid", &self.valid_loss)],
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
        plot_panels(path, &panels, 900, 360)?;
        Ok(())
    }
}

/// Runs a whole training job as configured; writes into `cfg.train.out_dir`.
///
/// The job runs on a worker of the rayon pool, so parallel work inside a step is scheduled
/// through the workers' own queues (no per-call injection, no allocation in the step).
pub fn train(cfg: &RunConfig, progress: bool) -> anyhow::Result<TrainSummary> {
    rayon::scope(|_| train_here(cfg, progress))
}

fn train_here(cfg: &RunConfig, progress: bool) -> anyhow::Result<TrainSummary> {
    let t0 = Instant::now();
    let out = cfg.train.out_dir.clone();
    std::fs::create_dir_all(&out)
        .with_context(|| format!("{}: cannot create run directory", out.display()))?;
    let data: PreparedData = prepare(&cfg.data, cfg.model.seq_len, cfg.train.seed)?;
    eprintln!("data  {}", data.summary);
    let mut mcfg = cfg.model.clone();
    if mcfg.vocab_size != data.tokenizer.vocab_size() {
        bail!(
            "model.vocab_size: {} but the vocabulary {} has {} tokens",
            mcfg.vocab_size,
            data.vocab.display(),
            data.tokenizer.vocab_size()
        );
    }
    mcfg.num_labels = data.label_names.len();
    let mut resolved = cfg.clone();
    resolved.model = mcfg.clone();
    crate::files::write_atomic(&out.join("config.toml"), resolved.to_toml().as_bytes())?;

    let mut model = Encoder::new(&mcfg, cfg.train.seed).map_err(|e| anyhow::anyhow!("{e}"))?;
    let (params, dense_params) = (model.num_params(), model.dense_equivalent_params());
    eprintln!(
        "model {} layers, d_model {}, {}{}: {params} parameters ({dense_params} dense, {:.1}x compression)",
        mcfg.layers,
        mcfg.d_model,
        if mcfg.tt_linear { "TT linear" } else { "dense linear" },
        if mcfg.ttm_embedding { " + TTM embedding" } else { " + dense embedding" },
        dense_params as f64 / params as f64
    );
    let mut rank = RankController::new(&cfg.rank, &model);
    let ranks_start = rank::layer_ranks(&model);
    let mut ranks_switch = None;
    let mut opt = match &cfg.galore {
        Some(g) => {
            if rank.active() {
                eprintln!(
                    "note  GaLore run: rank gates are trained, but pruned slices are not truncated"
                );
            }
            Optimizer::GaLore(Box::new(GaLore::new(cfg.optim.clone(), g.clone(), |f| {
                model.visit_params_mut(f)
            })))
        }
        None => {
            let mut o = AdamW::new(cfg.optim.clone(), |f| model.visit_params_mut(f));
            if rank.active() {
                o.freeze_gates_at = Some(mcfg.threshold);
            }
            Optimizer::AdamW(o)
        }
    };
    let truncating = rank.active() && matches!(opt, Optimizer::AdamW(_));
    let b = cfg.train.batch_size;
    let per_epoch_full = data.train.len() / b;
    if per_epoch_full == 0 {
        bail!(
            "train.batch_size: {b} is larger than the {} training examples",
            data.train.len()
        );
    }
    let per_epoch = match cfg.train.max_steps_per_epoch {
        0 => per_epoch_full,
        m => m.min(per_epoch_full),
    };
    let total = (per_epoch * cfg.train.epochs) as u64;
    let schedule = Schedule {
        warmup: cfg.train.warmup_steps.min(total),
        total,
        decay: cfg.train.decay,
    };
    let mut st = model.state(b);
    let mut log = MetricsLog::create(&out.join("metrics.jsonl"))?;
    let mut curves = Curves {
        train_loss: vec![],
        valid_loss: vec![],
        train_acc: vec![],
        valid_acc: vec![],
        size_ratio: vec![],
        model_ratio: vec![],
        ranks: vec![],
    };
    let model_ratio = |m: &Encoder| dense_params as f64 / m.num_params() as f64;
    if rank.active() {
        curves.record_ranks(0, &ranks_start, rank.dense_ref, model_ratio(&model));
    }
    let bar = if progress {
        indicatif::ProgressBar::new(total)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} {msg} [{elapsed_precise}<{eta_precise}]",
        )
        .expect("valid template"),
    );
    let tokens_per_step = (b * mcfg.seq_len) as f64;
    let mut step: u64 = 0;
    let mut batch = Batch::default();
    let mut final_valid = EvalStats::default();
    for epoch in 0..cfg.train.epochs {
        let mut batches = data
            .train
            .batches(b, cfg.train.seed.wrapping_add(epoch as u64));
        let (mut ep_loss, mut ep_correct, mut ep_count) = (0.0, 0usize, 0usize);
        let (mut win_loss, mut win_correct, mut win_count, mut win_start) =
            (0.0, 0usize, 0usize, Instant::now());
        for i in 0..per_epoch {
            if !batches.next_into(&mut batch) {
                break;
            }
            let epoch_end = i + 1 == per_epoch;
            st.load(
                &batch.input_ids,
                &batch.token_type_ids,
                &batch.attention_mask,
                &batch.labels,
            )
            .map_err(anyhow::Error::msg)?;
            model.zero_grad();
            let s = model.forward(&mut st, true, step)?;
            if !s.loss.is_finite() {
                bail!("training diverged: loss is {} at epoch {} step {step} (lower the learning rates in [optim])", s.loss, epoch + 1);
            }
            model.backward(&mut st);
            let obj = rank.apply(&mut model, s.loss);
            let (gscale, gnorm) = clip_scale(cfg.optim.clip_norm, |f| model.visit_params_mut(f));
            if !gnorm.is_finite() {
                bail!(
                    "training diverged: gradient norm is {gnorm} at epoch {} step {step}",
                    epoch + 1
                );
            }
            let lr = schedule.scale(step);
            opt.step(lr, gscale, &mut model);
            step += 1;
            if rank.after_step(&model, step, epoch + 1, epoch_end) {
                let now = rank::layer_ranks(&model);
                let (size, _, _) = rank::sizes(&model);
                log.write(&json!({"kind": "stage", "stage": "late", "epoch": epoch + 1, "step": step, "size": size, "target_size": rank.target_size, "ranks": now}))?;
                bar.println(format!(
                    "step {step}: late stage, size {size:.0} → target {:.0}",
                    rank.target_size.unwrap_or(0.0)
                ));
                ranks_switch = Some(now);
            }
            if truncating && rank.truncation_due(step, epoch_end) {
                let changed = rank::truncate(&mut model);
                if !changed.is_empty() {
                    opt.retain(&changed, &mut model);
                    let now = rank::layer_ranks(&model);
                    log.write(&json!({"kind": "truncate", "epoch": epoch + 1, "step": step, "params": model.num_params(), "compression": model_ratio(&model), "ranks": now}))?;
                }
            }
            ep_loss += s.loss * s.count as f64;
            ep_correct += s.correct;
            ep_count += s.count;
            win_loss += s.loss * s.count as f64;
            win_correct += s.correct;
            win_count += s.count;
            if step.is_multiple_of(cfg.train.log_every as u64) {
                let secs = win_start.elapsed().as_secs_f64();
                let steps_in_window = (win_count / b).max(1) as f64;
                let (l, a) = (
                    win_loss / win_count as f64,
                    win_correct as f64 / win_count as f64,
                );
                let tps = tokens_per_step * steps_in_window / secs;
                let stage = match obj.branch {
                    Branch::Early => "early",
                    Branch::Loss => "late-loss",
                    Branch::Size => "late-size",
                };
                log.write(&json!({"kind": "train", "epoch": epoch + 1, "step": step, "loss": l, "accuracy": a, "lr_scale": lr, "grad_norm": gnorm, "tokens_per_s": tps, "size": obj.size, "size_l1": obj.size_l1, "branch": stage, "params": model.num_params(), "compression": model_ratio(&model)}))?;
                if rank.active() {
                    let now = rank::layer_ranks(&model);
                    curves.record_ranks(step, &now, rank.dense_ref, model_ratio(&model));
                }
                curves.train_loss.push((step as f64, l));
                curves.train_acc.push((step as f64, a));
                let size = if rank.active() {
                    format!(" {:.1}x", model_ratio(&model))
                } else {
                    String::new()
                };
                bar.set_message(format!(
                    "epoch {} loss {l:.4} acc {a:.3}{size} {tps:.0} tok/s",
                    epoch + 1
                ));
                (win_loss, win_correct, win_count, win_start) = (0.0, 0, 0, Instant::now());
            }
            bar.inc(1);
        }
        let valid = evaluate(&model, &mut st, &data.valid)?;
        final_valid = valid;
        let (tl, ta) = (
            ep_loss / ep_count.max(1) as f64,
            ep_correct as f64 / ep_count.max(1) as f64,
        );
        log.write(&json!({"kind": "eval", "epoch": epoch + 1, "step": step, "train_loss": tl, "train_accuracy": ta, "valid_loss": valid.loss, "valid_accuracy": valid.accuracy, "seconds": t0.elapsed().as_secs_f64()}))?;
        curves.valid_loss.push((step as f64, valid.loss));
        curves.valid_acc.push((step as f64, valid.accuracy));
        bar.println(format!(
            "epoch {}: train loss {tl:.4} acc {ta:.4} | valid loss {:.4} acc {:.4}",
            epoch + 1,
            valid.loss,
            valid.accuracy
        ));
        let meta = ModelMeta {
            model: mcfg.clone(),
            labels: data.label_names.clone(),
            vocab: data.vocab.clone(),
            pair: data.pair,
            epoch: epoch + 1,
            step,
        };
        save_model(&out, &model, &meta)?;
        if let Err(e) = curves.plot(&out.join("curves.png")) {
            bar.println(format!("warning: plot not written: {e:#}"));
        }
        if rank.active() {
            if let Err(e) = curves.plot_ranks(&out.join("ranks.png")) {
                bar.println(format!("warning: plot not written: {e:#}"));
            }
        }
    }
    bar.finish_and_clear();
    let ranks_end = rank::layer_ranks(&model);
    if rank.active() {
        let mut points: Vec<(&str, &[LayerRanks])> = vec![("start", &ranks_start)];
        if let Some(r) = &ranks_switch {
            points.push(("after early stage", r));
        }
        points.push(("end", &ranks_end));
        let table = rank::rank_table(&points);
        let stage = match rank.stage {
            Stage::Early => "early",
            Stage::Late => "late",
        };
        let text = format!(
            "# Ranks of the TT/TTM layers\n\nStage at the end: {stage}. Whole model: {} → {} parameters ({:.1}× → {:.1}× compression vs {dense_params} dense).\n\n{table}",
            params,
            model.num_params(),
            dense_params as f64 / params as f64,
            model_ratio(&model)
        );
        crate::files::write_atomic(&out.join("ranks.md"), text.as_bytes())?;
        log.write(&json!({"kind": "ranks", "step": step, "start": ranks_start, "switch": ranks_switch, "end": ranks_end}))?;
    }
    Ok(TrainSummary {
        out_dir: out,
        epochs: cfg.train.epochs,
        steps: step,
        final_valid,
        majority_accuracy: majority(&data.valid.labels, data.label_names.len()),
        params: model.num_params(),
        initial_params: params,
        dense_params,
        seconds: t0.elapsed().as_secs_f64(),
        ranks_start,
        ranks_switch,
        ranks_end,
    })
}
