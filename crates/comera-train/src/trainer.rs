//! The training loop: fixed-shape steps over shuffled batches, evaluation each epoch, the
//! metrics log, the plot and the model files.

use crate::checkpoint::{self, Checkpoint, OptState, Progress};
use crate::config::Phase;
use crate::config::RunConfig;
use crate::data::{prepare, CorpusData, PreparedData};
use crate::files::{save_model, MetricsLog, ModelMeta};
use crate::plot::{plot_panels, Panel, Series};
use crate::rank::{self, Branch, LayerRanks, RankController, Stage};
use anyhow::{bail, Context};
use comera_data::mlm::MlmBatches;
use comera_data::{Batch, Batches, EncodedDataset, MlmBatch};
use comera_layers::Retained;
use comera_model::{Encoder, EncoderState};
use comera_optim::galore::ParamState;
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

/// Held-out masked-LM loss and masked-token accuracy over every batch of `blocks` (masks from
/// a fixed seed, so every evaluation and every run sees the same ones). `examples` counts the
/// predicted tokens.
pub fn evaluate_mlm(
    model: &Encoder,
    st: &mut EncoderState,
    data: &CorpusData,
    blocks: &comera_data::corpus::PackedSequences,
) -> anyhow::Result<EvalStats> {
    let b = st.batch();
    let mut batch = MlmBatch::new(b, blocks.seq_len);
    let mut it = MlmBatches::new(blocks, data.masker, b, 0x5EED_E7A1, false);
    let (mut loss, mut correct, mut count) = (0.0f64, 0usize, 0usize);
    while it.next_into(&mut batch) {
        load_mlm(st, &batch)?;
        let s = model.forward(st, false, 0)?;
        loss += s.loss * s.count as f64;
        correct += s.correct;
        count += s.count;
    }
    if count == 0 {
        bail!(
            "evaluation: the {} held-out blocks make no batch of {b}",
            blocks.len()
        );
    }
    Ok(EvalStats {
        loss: loss / count as f64,
        accuracy: correct as f64 / count as f64,
        examples: count,
    })
}

fn load_mlm(st: &mut EncoderState, b: &MlmBatch) -> anyhow::Result<()> {
    st.load_mlm(&b.input_ids, &b.attention_mask, &b.labels, &b.selected)
        .map_err(anyhow::Error::msg)
}

/// The data of a run: labelled examples (classification) or a corpus (masked-LM).
enum TaskData {
    Classify(PreparedData),
    Mlm(CorpusData),
}

/// One epoch's batches (one per epoch: the variants' size difference does not matter).
#[allow(clippy::large_enum_variant)]
enum EpochBatches<'a> {
    Classify(Batches<'a>, Batch),
    Mlm(MlmBatches<'a>, MlmBatch),
}

impl EpochBatches<'_> {
    /// Loads the next batch into `st`; false at the epoch's end.
    fn next_into(&mut self, st: &mut EncoderState) -> anyhow::Result<bool> {
        match self {
            EpochBatches::Classify(it, b) => {
                if !it.next_into(b) {
                    return Ok(false);
                }
                st.load(
                    &b.input_ids,
                    &b.token_type_ids,
                    &b.attention_mask,
                    &b.labels,
                )
                .map_err(anyhow::Error::msg)?;
            }
            EpochBatches::Mlm(it, b) => {
                if !it.next_into(b) {
                    return Ok(false);
                }
                load_mlm(st, b)?;
            }
        }
        Ok(true)
    }
}

impl TaskData {
    /// Training examples (classification) or blocks (corpus) at `seq_len`.
    fn train_len(&mut self, seq_len: usize) -> anyhow::Result<usize> {
        Ok(match self {
            TaskData::Classify(d) => d.train.len(),
            TaskData::Mlm(d) => d.packed(seq_len)?.train.len(),
        })
    }

    /// Packs every phase's sequence length up front (so epochs can borrow the data).
    fn prepare_phases(&mut self, phases: &[Phase]) -> anyhow::Result<()> {
        for p in phases {
            self.train_len(p.seq_len)?;
        }
        Ok(())
    }

    fn epoch_batches(&self, seq_len: usize, b: usize, seed: u64) -> EpochBatches<'_> {
        match self {
            TaskData::Classify(d) => {
                EpochBatches::Classify(d.train.batches(b, seed), Batch::default())
            }
            TaskData::Mlm(d) => {
                let packed = d.packed_ref(seq_len);
                EpochBatches::Mlm(
                    MlmBatches::new(&packed.train, d.masker, b, seed, true),
                    MlmBatch::new(b, seq_len),
                )
            }
        }
    }

    fn evaluate(&self, model: &Encoder, st: &mut EncoderState) -> anyhow::Result<EvalStats> {
        match self {
            TaskData::Classify(d) => evaluate(model, st, &d.valid),
            TaskData::Mlm(d) => evaluate_mlm(model, st, d, &d.packed_ref(st.seq_len()).valid),
        }
    }
}

/// What a finished run reports.
#[derive(Clone, Debug)]
pub struct TrainSummary {
    pub out_dir: PathBuf,
    pub epochs: usize,
    pub steps: u64,
    /// Sequence positions trained on.
    pub tokens: u64,
    /// For a masked-LM run, `final_valid` is the held-out MLM loss and masked-token accuracy.
    pub final_valid: EvalStats,
    /// Share of the most frequent label (classification runs).
    pub majority_accuracy: Option<f64>,
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
    /// Whether the run stopped early at `train.stop_after_steps` (resumable).
    pub stopped: bool,
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

    /// The state a checkpoint saves: tensors in parameter order, named after the parameters.
    fn state(&self, model: &mut Encoder) -> OptState {
        let mut tensors = Vec::new();
        let mut i = 0;
        let scalars = match self {
            Optimizer::AdamW(o) => {
                model.visit_params_mut(&mut |p| {
                    tensors.push((format!("m/{}", p.name), p.shape.clone(), o.m[i].clone()));
                    tensors.push((format!("v/{}", p.name), p.shape.clone(), o.v[i].clone()));
                    i += 1;
                });
                json!({"kind": "adamw", "t": o.t})
            }
            Optimizer::GaLore(o) => {
                let names: Vec<String> = model.params().iter().map(|p| p.name.clone()).collect();
                let mut projected = serde_json::Map::new();
                for st in &o.state {
                    match st {
                        ParamState::Adam { m, v } => {
                            let name = &names[i];
                            tensors.push((format!("m/{name}"), vec![m.len()], m.clone()));
                            tensors.push((format!("v/{name}"), vec![v.len()], v.clone()));
                        }
                        ParamState::Projected(pr) => {
                            let (a, b) = pr.projected_shape();
                            let n = &pr.name;
                            tensors.push((
                                format!("p/{n}"),
                                vec![pr.p.len() / pr.rank, pr.rank],
                                pr.p.clone(),
                            ));
                            tensors.push((format!("m/{n}"), vec![a, b], pr.m[..a * b].to_vec()));
                            tensors.push((format!("v/{n}"), vec![a, b], pr.v[..a * b].to_vec()));
                            projected.insert(n.clone(), json!([pr.refreshes, pr.refreshed_at]));
                        }
                    }
                    i += 1;
                }
                json!({"kind": "galore", "t": o.t, "refresh_steps": o.refresh_steps, "svd_fallbacks": o.svd_fallbacks, "projected": projected})
            }
        };
        OptState { scalars, tensors }
    }

    /// Restores [`Optimizer::state`] from a checkpoint (a fresh optimiser for the same model).
    fn restore(&mut self, ck: &Checkpoint, model: &mut Encoder) -> anyhow::Result<()> {
        let s = &ck.optimizer;
        let kind = s["kind"].as_str().unwrap_or("");
        let num = |k: &str| {
            s[k].as_u64()
                .ok_or_else(|| anyhow::anyhow!("{}: optimizer `{k}` is missing", ck.path.display()))
        };
        match self {
            Optimizer::AdamW(o) if kind == "adamw" => {
                o.t = num("t")?;
                let mut i = 0;
                let mut err = None;
                model.visit_params_mut(&mut |p| {
                    let r = (|| -> anyhow::Result<()> {
                        o.m[i].copy_from_slice(ck.opt_tensor(&format!("m/{}", p.name), p.len())?);
                        o.v[i].copy_from_slice(ck.opt_tensor(&format!("v/{}", p.name), p.len())?);
                        Ok(())
                    })();
                    if let (Err(e), None) = (r, &err) {
                        err = Some(e);
                    }
                    i += 1;
                });
                err.map_or(Ok(()), Err)
            }
            Optimizer::GaLore(o) if kind == "galore" => {
                let names: Vec<String> = model.params().iter().map(|p| p.name.clone()).collect();
                (o.t, o.refresh_steps, o.svd_fallbacks) =
                    (num("t")?, num("refresh_steps")?, num("svd_fallbacks")?);
                for (i, st) in o.state.iter_mut().enumerate() {
                    match st {
                        ParamState::Adam { m, v } => {
                            let name = &names[i];
                            let len = m.len();
                            m.copy_from_slice(ck.opt_tensor(&format!("m/{name}"), len)?);
                            v.copy_from_slice(ck.opt_tensor(&format!("v/{name}"), len)?);
                        }
                        ParamState::Projected(pr) => {
                            let (a, b) = pr.projected_shape();
                            let n = pr.name.clone();
                            let len = pr.p.len();
                            pr.p.copy_from_slice(ck.opt_tensor(&format!("p/{n}"), len)?);
                            pr.m[..a * b].copy_from_slice(ck.opt_tensor(&format!("m/{n}"), a * b)?);
                            pr.v[..a * b].copy_from_slice(ck.opt_tensor(&format!("v/{n}"), a * b)?);
                            let counts = &s["projected"][&n];
                            pr.refreshes = counts[0].as_u64().unwrap_or(0);
                            pr.refreshed_at = counts[1].as_u64().unwrap_or(0);
                        }
                    }
                }
                Ok(())
            }
            _ => bail!(
                "{}: the checkpoint's optimiser is `{kind}`, the run's config asks for {}",
                ck.path.display(),
                match self {
                    Optimizer::AdamW(_) => "adamw",
                    Optimizer::GaLore(_) => "galore (a [galore] table)",
                }
            ),
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

/// Curves for the plots, built from the metrics log's records (so a resumed run plots its
/// whole history).
#[derive(Default)]
struct Curves {
    train_loss: Vec<(f64, f64)>,
    valid_loss: Vec<(f64, f64)>,
    train_acc: Vec<(f64, f64)>,
    valid_acc: Vec<(f64, f64)>,
    /// Compression of the whole model over steps.
    model_ratio: Vec<(f64, f64)>,
    /// Per layer: mean active rank over its bonds, over steps.
    ranks: Vec<(String, Vec<(f64, f64)>)>,
}

impl Curves {
    /// Takes in one metrics record.
    fn add(&mut self, r: &serde_json::Value) {
        let num = |k: &str| r.get(k).and_then(serde_json::Value::as_f64);
        let Some(step) = num("step") else { return };
        match r.get("kind").and_then(serde_json::Value::as_str) {
            Some("train") => {
                if let (Some(l), Some(a)) = (num("loss"), num("accuracy")) {
                    self.train_loss.push((step, l));
                    self.train_acc.push((step, a));
                }
                if let Some(c) = num("compression") {
                    self.model_ratio.push((step, c));
                }
                if let Some(layers) = r.get("mean_ranks").and_then(|v| v.as_object()) {
                    for (name, v) in layers {
                        let Some(v) = v.as_f64() else { continue };
                        match self.ranks.iter_mut().find(|(n, _)| n == name) {
                            Some((_, pts)) => pts.push((step, v)),
                            None => self.ranks.push((name.clone(), vec![(step, v)])),
                        }
                    }
                }
            }
            Some("eval") => {
                if let (Some(l), Some(a)) = (num("valid_loss"), num("valid_accuracy")) {
                    self.valid_loss.push((step, l));
                    self.valid_acc.push((step, a));
                }
            }
            _ => {}
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
                title: "compression of the whole model".into(),
                x_label: "step".into(),
                y_label: "dense / trainable parameters".into(),
                series: vec![s("whole model", &self.model_ratio)],
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
    rayon::scope(|_| train_here(cfg, None, progress))
}

/// Continues the run in `run_dir` from its newest checkpoint. With the same thread count, the
/// losses are bit for bit those of a run that was never stopped.
pub fn resume(run_dir: &Path, progress: bool) -> anyhow::Result<TrainSummary> {
    let path = checkpoint::list(run_dir)?.pop().ok_or_else(|| {
        anyhow::anyhow!(
            "{}: no checkpoint to resume from (expected {}/step-*.safetensors)",
            run_dir.display(),
            checkpoint::DIR
        )
    })?;
    let ck = Checkpoint::load(&path)?;
    let mut cfg = ck.config.clone();
    cfg.train.out_dir = run_dir.to_path_buf();
    // A resumed run runs to the configured end (the stop is what interrupted it).
    cfg.train.stop_after_steps = 0;
    eprintln!("resume {} (step {})", path.display(), ck.progress.step);
    rayon::scope(|_| train_here(&cfg, Some(ck), progress))
}

/// Rewrites the metrics log without records after `step` (written after the checkpoint a run
/// resumes from) and returns the kept records.
fn metrics_up_to(path: &Path, step: u64) -> anyhow::Result<Vec<serde_json::Value>> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut kept = Vec::new();
    let mut out = String::new();
    for line in text.lines() {
        // A line cut short by a kill is dropped like a later one.
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v.get("step")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0)
            <= step
        {
            out.push_str(line);
            out.push('\n');
            kept.push(v);
        }
    }
    crate::files::write_atomic(path, out.as_bytes())?;
    Ok(kept)
}

/// Mean active rank per layer, as a JSON object (for the metrics log and the rank plot).
fn mean_ranks(layers: &[LayerRanks]) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for l in layers {
        let mean = l.ranks.iter().sum::<usize>() as f64 / l.ranks.len().max(1) as f64;
        m.insert(l.name.clone(), json!(mean));
    }
    serde_json::Value::Object(m)
}

fn train_here(
    cfg: &RunConfig,
    resume: Option<Checkpoint>,
    progress: bool,
) -> anyhow::Result<TrainSummary> {
    let t0 = Instant::now();
    let out = cfg.train.out_dir.clone();
    std::fs::create_dir_all(&out)
        .with_context(|| format!("{}: cannot create run directory", out.display()))?;
    let phases = cfg.phases();
    let mut data = if cfg.data.source == "corpus" {
        TaskData::Mlm(CorpusData::new(&cfg.data, cfg.train.seed)?)
    } else {
        if let Some(p) = phases.iter().find(|p| p.seq_len != cfg.model.seq_len) {
            bail!(
                "train.phases: seq_len {} differs from model.seq_len {}; only corpus (masked-LM) runs change the sequence length",
                p.seq_len,
                cfg.model.seq_len
            );
        }
        let d: PreparedData = prepare(&cfg.data, cfg.model.seq_len, cfg.train.seed)?;
        eprintln!("data  {}", d.summary);
        TaskData::Classify(d)
    };
    let (vocab_size, vocab_path) = match &data {
        TaskData::Classify(d) => (d.tokenizer.vocab_size(), d.vocab.clone()),
        TaskData::Mlm(d) => (d.tokenizer.vocab_size(), d.vocab.clone()),
    };
    let mut mcfg = cfg.model.clone();
    if mcfg.vocab_size != vocab_size {
        bail!(
            "model.vocab_size: {} but the vocabulary {} has {vocab_size} tokens",
            mcfg.vocab_size,
            vocab_path.display(),
        );
    }
    if let TaskData::Classify(d) = &data {
        mcfg.num_labels = d.label_names.len();
    }
    data.prepare_phases(&phases)?;
    let mut resolved = cfg.clone();
    resolved.model = mcfg.clone();
    if let Some(ck) = &resume {
        if ck.config.model != mcfg {
            bail!(
                "{}: the checkpoint's [model] differs from what its run's data gives now (labels or vocabulary changed?)",
                ck.path.display()
            );
        }
    } else {
        crate::files::write_atomic(&out.join("config.toml"), resolved.to_toml().as_bytes())?;
    }

    let mut model = match &resume {
        Some(ck) => ck.model()?,
        None => {
            let mut m = Encoder::new(&mcfg, cfg.train.seed).map_err(|e| anyhow::anyhow!("{e}"))?;
            if let Some(dir) = &cfg.train.init_from {
                let (pre, _) = crate::files::load_model(dir)
                    .with_context(|| format!("train.init_from: {}", dir.display()))?;
                m.init_body_from(&pre)
                    .map_err(|e| anyhow::anyhow!("train.init_from: {}: {e}", dir.display()))?;
                eprintln!(
                    "init  encoder from {} ({} parameters)",
                    dir.display(),
                    pre.num_params()
                );
            }
            m
        }
    };
    let dense_params = model.dense_equivalent_params();
    let initial_params = Encoder::new(&mcfg, cfg.train.seed)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .num_params();
    eprintln!(
        "model {} layers, d_model {}, {}{}: {} parameters ({dense_params} dense, {:.1}x compression)",
        mcfg.layers,
        mcfg.d_model,
        if mcfg.tt_linear { "TT linear" } else { "dense linear" },
        if mcfg.ttm_embedding { " + TTM embedding" } else { " + dense embedding" },
        model.num_params(),
        dense_params as f64 / model.num_params() as f64
    );
    let mut rank = match &resume {
        Some(ck) => ck.rank.clone(),
        None => RankController::new(&cfg.rank, &model),
    };
    let mut prog = match &resume {
        Some(ck) => ck.progress.clone(),
        None => Progress {
            ranks_start: rank::layer_ranks(&model),
            ..Progress::default()
        },
    };
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
    if let Some(ck) = &resume {
        opt.restore(ck, &mut model)?;
    }
    let truncating = rank.active() && matches!(opt, Optimizer::AdamW(_));
    // Each epoch's phase and steps; epochs are numbered across phases.
    let mut epochs: Vec<(usize, usize)> = Vec::new();
    for (i, ph) in phases.iter().enumerate() {
        let len = data.train_len(ph.seq_len)?;
        let full = len / ph.batch_size;
        if full == 0 {
            bail!(
                "train.batch_size: {} is larger than the {len} training {}",
                ph.batch_size,
                match data {
                    TaskData::Classify(_) => "examples",
                    TaskData::Mlm(_) => "blocks",
                }
            );
        }
        let per_epoch = match ph.max_steps_per_epoch.unwrap_or(0) {
            0 => full,
            m => m.min(full),
        };
        epochs.extend(std::iter::repeat_n((i, per_epoch), ph.epochs));
    }
    let total: u64 = epochs.iter().map(|e| e.1 as u64).sum();
    // Tokens seen before step `s` (sequence positions, padding included).
    let tokens_at = |s: u64| -> u64 {
        let mut left = s;
        let mut tokens = 0;
        for &(ph, n) in &epochs {
            let k = left.min(n as u64);
            tokens += k * (phases[ph].batch_size * phases[ph].seq_len) as u64;
            left -= k;
        }
        tokens
    };
    let schedule = Schedule {
        warmup: cfg.train.warmup_steps.min(total),
        total,
        decay: cfg.train.decay,
    };
    let new_state = |model: &Encoder, ph: &Phase| -> anyhow::Result<EncoderState> {
        let rows = match &data {
            TaskData::Mlm(d) => d.masker.max_selected_per_row(ph.seq_len),
            TaskData::Classify(_) => 0,
        };
        model
            .state_for(ph.batch_size, ph.seq_len, rows)
            .map_err(|e| anyhow::anyhow!("{e}"))
    };
    let mut st_phase = epochs.get(prog.epoch).map_or(phases.len() - 1, |e| e.0);
    let mut st = new_state(&model, &phases[st_phase])?;
    let metrics_path = out.join("metrics.jsonl");
    let mut curves = Curves::default();
    let mut log = match &resume {
        Some(_) => {
            for r in metrics_up_to(&metrics_path, prog.step)? {
                curves.add(&r);
            }
            MetricsLog::append(&metrics_path)?
        }
        None => MetricsLog::create(&metrics_path)?,
    };
    // Writes a record to the log and the curves.
    let record = |log: &mut MetricsLog, curves: &mut Curves, r: serde_json::Value| {
        curves.add(&r);
        log.write(&r)
    };
    let model_ratio = |m: &Encoder| dense_params as f64 / m.num_params() as f64;
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
    bar.set_position(prog.step);
    let base_seconds = prog.seconds;
    let mut win_steps = 0usize;
    let mut final_valid = EvalStats::default();
    let mut win_start = Instant::now();
    let mut stopped = false;
    let checkpoint_every = cfg.train.checkpoint_every;
    let save_checkpoint = |prog: &Progress,
                           rank: &RankController,
                           model: &mut Encoder,
                           opt: &Optimizer|
     -> anyhow::Result<()> {
        let state = opt.state(model);
        let keep = cfg.train.keep_checkpoints;
        checkpoint::save(&out, &resolved, prog, rank, model, &state, keep).map(|_| ())
    };
    let n_epochs = epochs.len();
    'epochs: for (epoch, &(ph, per_epoch)) in epochs.iter().enumerate().skip(prog.epoch) {
        let phase = &phases[ph];
        let b = phase.batch_size;
        if ph != st_phase {
            st = new_state(&model, phase)?;
            st_phase = ph;
            bar.suspend(|| eprintln!("phase {}: seq_len {}, batch {b}", ph + 1, phase.seq_len));
        }
        let tokens_per_step = (b * phase.seq_len) as f64;
        let mut batches =
            data.epoch_batches(phase.seq_len, b, cfg.train.seed.wrapping_add(epoch as u64));
        // Resuming inside an epoch: replay its data order up to the checkpoint.
        for _ in 0..prog.batch_in_epoch {
            batches.next_into(&mut st)?;
        }
        for i in prog.batch_in_epoch..per_epoch {
            if !batches.next_into(&mut st)? {
                break;
            }
            let epoch_end = i + 1 == per_epoch;
            model.zero_grad();
            let step = prog.step;
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
            rank.project(&mut model);
            prog.step += 1;
            prog.batch_in_epoch = i + 1;
            let step = prog.step;
            if rank.after_step(&model, step, epoch + 1, epoch_end) {
                let now = rank::layer_ranks(&model);
                let (size, _, _) = rank::sizes(&model);
                record(
                    &mut log,
                    &mut curves,
                    json!({"kind": "stage", "stage": "late", "epoch": epoch + 1, "step": step, "size": size, "target_size": rank.target_size, "ranks": now}),
                )?;
                bar.println(format!(
                    "step {step}: late stage, size {size:.0} → target {:.0}",
                    rank.target_size.unwrap_or(0.0)
                ));
                prog.ranks_switch = Some(now);
            }
            if truncating && rank.truncation_due(step, epoch_end) {
                let changed = rank::truncate(&mut model);
                if !changed.is_empty() {
                    opt.retain(&changed, &mut model);
                    let now = rank::layer_ranks(&model);
                    record(
                        &mut log,
                        &mut curves,
                        json!({"kind": "truncate", "epoch": epoch + 1, "step": step, "params": model.num_params(), "compression": model_ratio(&model), "ranks": now}),
                    )?;
                }
            }
            prog.ep_loss += s.loss * s.count as f64;
            prog.ep_correct += s.correct;
            prog.ep_count += s.count;
            prog.win_loss += s.loss * s.count as f64;
            prog.win_correct += s.correct;
            prog.win_count += s.count;
            win_steps += 1;
            if step.is_multiple_of(cfg.train.log_every as u64) {
                let secs = win_start.elapsed().as_secs_f64();
                let steps_in_window = win_steps.max(1) as f64;
                let (l, a) = (
                    prog.win_loss / prog.win_count as f64,
                    prog.win_correct as f64 / prog.win_count as f64,
                );
                let tps = tokens_per_step * steps_in_window / secs;
                let branch = match obj.branch {
                    Branch::Early => "early",
                    Branch::Loss => "late-loss",
                    Branch::Size => "late-size",
                };
                let mut r = json!({"kind": "train", "epoch": epoch + 1, "step": step, "tokens": tokens_at(step), "loss": l, "accuracy": a, "lr_scale": lr, "grad_norm": gnorm, "tokens_per_s": tps, "ms_per_step": secs * 1e3 / steps_in_window, "params": model.num_params(), "compression": model_ratio(&model)});
                if rank.active() {
                    r["size"] = json!(obj.size);
                    r["size_l1"] = json!(obj.size_l1);
                    r["branch"] = json!(branch);
                    r["mean_ranks"] = mean_ranks(&rank::layer_ranks(&model));
                }
                record(&mut log, &mut curves, r)?;
                let size = if rank.active() {
                    format!(" {:.1}x", model_ratio(&model))
                } else {
                    String::new()
                };
                bar.set_message(format!(
                    "epoch {} loss {l:.4} acc {a:.3}{size} {tps:.0} tok/s",
                    epoch + 1
                ));
                (prog.win_loss, prog.win_correct, prog.win_count) = (0.0, 0, 0);
                win_steps = 0;
                win_start = Instant::now();
            }
            bar.inc(1);
            if epoch_end {
                break;
            }
            let stop_now = cfg.train.stop_after_steps > 0 && step >= cfg.train.stop_after_steps;
            if stop_now || (checkpoint_every > 0 && step.is_multiple_of(checkpoint_every)) {
                prog.seconds = base_seconds + t0.elapsed().as_secs_f64();
                save_checkpoint(&prog, &rank, &mut model, &opt)?;
            }
            if stop_now {
                stopped = true;
                break 'epochs;
            }
        }
        drop(batches);
        let valid = data.evaluate(&model, &mut st)?;
        final_valid = valid;
        let (tl, ta) = (
            prog.ep_loss / prog.ep_count.max(1) as f64,
            prog.ep_correct as f64 / prog.ep_count.max(1) as f64,
        );
        let secs = base_seconds + t0.elapsed().as_secs_f64();
        record(
            &mut log,
            &mut curves,
            json!({"kind": "eval", "epoch": epoch + 1, "step": prog.step, "tokens": tokens_at(prog.step), "train_loss": tl, "train_accuracy": ta, "valid_loss": valid.loss, "valid_accuracy": valid.accuracy, "valid_perplexity": valid.loss.exp(), "seconds": secs}),
        )?;
        bar.println(format!(
            "epoch {}: train loss {tl:.4} acc {ta:.4} | valid loss {:.4} acc {:.4}",
            epoch + 1,
            valid.loss,
            valid.accuracy
        ));
        let (labels, pair) = match &data {
            TaskData::Classify(d) => (d.label_names.clone(), d.pair),
            TaskData::Mlm(_) => (Vec::new(), false),
        };
        let meta = ModelMeta {
            model: mcfg.clone(),
            labels,
            vocab: vocab_path.clone(),
            pair,
            epoch: epoch + 1,
            step: prog.step,
        };
        save_model(&out, &model, &meta)?;
        // The next epoch starts from a clean slate; checkpoint that point.
        (prog.epoch, prog.batch_in_epoch) = (epoch + 1, 0);
        (prog.ep_loss, prog.ep_correct, prog.ep_count) = (0.0, 0, 0);
        prog.seconds = secs;
        save_checkpoint(&prog, &rank, &mut model, &opt)?;
        if let Err(e) = curves.plot(&out.join("curves.png")) {
            bar.println(format!("warning: plot not written: {e:#}"));
        }
        if rank.active() {
            if let Err(e) = curves.plot_ranks(&out.join("ranks.png")) {
                bar.println(format!("warning: plot not written: {e:#}"));
            }
        }
        let stop_now = cfg.train.stop_after_steps > 0 && prog.step >= cfg.train.stop_after_steps;
        if stop_now && epoch + 1 < n_epochs {
            stopped = true;
            break;
        }
    }
    bar.finish_and_clear();
    let ranks_end = rank::layer_ranks(&model);
    if rank.active() && !stopped {
        let mut points: Vec<(&str, &[LayerRanks])> = vec![("start", &prog.ranks_start)];
        if let Some(r) = &prog.ranks_switch {
            points.push(("after early stage", r));
        }
        points.push(("end", &ranks_end));
        let table = rank::rank_table(&points);
        let stage = match rank.stage {
            Stage::Early => "early",
            Stage::Late => "late",
        };
        let text = format!(
            "# Ranks of the TT/TTM layers\n\nStage at the end: {stage}. Whole model: {initial_params} → {} parameters ({:.1}× → {:.1}× compression vs {dense_params} dense).\n\n{table}",
            model.num_params(),
            dense_params as f64 / initial_params as f64,
            model_ratio(&model)
        );
        crate::files::write_atomic(&out.join("ranks.md"), text.as_bytes())?;
        record(
            &mut log,
            &mut curves,
            json!({"kind": "ranks", "step": prog.step, "start": prog.ranks_start, "switch": prog.ranks_switch, "end": ranks_end}),
        )?;
    }
    Ok(TrainSummary {
        out_dir: out,
        epochs: n_epochs,
        steps: prog.step,
        tokens: tokens_at(prog.step),
        final_valid,
        majority_accuracy: match &data {
            TaskData::Classify(d) => Some(majority(&d.valid.labels, d.label_names.len())),
            TaskData::Mlm(_) => None,
        },
        params: model.num_params(),
        initial_params,
        dense_params,
        seconds: base_seconds + t0.elapsed().as_secs_f64(),
        ranks_start: prog.ranks_start,
        ranks_switch: prog.ranks_switch,
        ranks_end,
        stopped,
    })
}
