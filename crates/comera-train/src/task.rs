//! What the one training loop ([`crate::trainer`]) needs from a task: its phases, batches
//! loaded into the model's state, evaluation and model files. Three tasks implement it:
//! classification and masked-LM pre-training ([`EncoderTask`], the encoder) and click-through
//! prediction ([`CtrTask`], the DLRM).

use crate::config::ConfigError;
use crate::config::Phase;
use crate::data::{CorpusData, PreparedData};
use crate::distributed::Processes;
use crate::error::{Error, Result};
use crate::files::{DlrmMeta, ModelMeta};
use comera_data::ctr::{CtrBatch, CtrData};
use comera_data::mlm::MlmBatches;
use comera_data::{Batch, Batches, EncodedDataset, MlmBatch};
use comera_dlrm::data::TrainSource;
use comera_dlrm::loss::{auc, bce_with_logits};
use comera_dlrm::{Dlrm, DlrmState};
use comera_layers::{Model, Trainable};
use comera_model::{Encoder, EncoderConfig, EncoderState};
use std::ops::Range;
use std::path::PathBuf;

pub use comera_run::records::{ClassCounts, ClassReport, EvalStats};

/// One epoch's batches: loads the next one into the state.
pub trait EpochBatches<S> {
    /// Loads the next batch into `st`; false at the epoch's end.
    fn next_into(&mut self, st: &mut S) -> Result<bool>;
}

/// A training task over one model kind.
pub trait Task {
    type Model: Trainable;
    type Epoch<'a>: EpochBatches<<Self::Model as Trainable>::State>
    where
        Self: 'a;

    /// The phases, in order (one for tasks without phases).
    fn phases(&self) -> &[Phase];
    /// Batches in a full epoch of `phase` (None: a streamed source of unknown length).
    fn batches_per_epoch(&mut self, phase: &Phase) -> Result<Option<usize>>;
    /// A fresh state for this process's shard of `phase`'s batch shape.
    fn state(
        &self,
        model: &Self::Model,
        phase: &Phase,
    ) -> Result<<Self::Model as Trainable>::State>;
    /// The batches of epoch `epoch` (0-based, numbered across phases). The task is shared,
    /// so that it can evaluate in the middle of an epoch (`train.eval_every`).
    fn epoch<'a>(&'a self, phase: &Phase, epoch: usize) -> Result<Self::Epoch<'a>>;
    /// Held-out evaluation with the state of the current phase (sharded over the processes
    /// and summed: every process gets the same figures).
    fn evaluate(
        &self,
        model: &Self::Model,
        st: &mut <Self::Model as Trainable>::State,
        phase: &Phase,
    ) -> Result<EvalStats>;
    /// The model's `model.toml` (what loading it needs besides its weights).
    fn model_meta(&self, model: &Self::Model, epoch: usize, step: u64) -> Result<String>;
    /// Whether the run writes its model files after every epoch.
    fn saves_model(&self) -> bool {
        true
    }
    /// Sequence positions per example (1 for a row of tabular data).
    fn tokens_per_example(&self, phase: &Phase) -> usize;
    /// What the task's loss is called in messages.
    fn loss_name(&self) -> &'static str;
    /// Share of the most frequent label in the validation set (classification).
    fn majority_accuracy(&self) -> Option<f64> {
        None
    }
    /// Called after each epoch's training batches (a data-quality note to print, if any).
    fn epoch_note(&self) -> Option<String> {
        None
    }
    /// Task-specific fields of `report.json` (`st`: the last phase's training state).
    fn report_extra(
        &self,
        _model: &Self::Model,
        _st: &<Self::Model as Trainable>::State,
    ) -> serde_json::Map<String, serde_json::Value> {
        serde_json::Map::new()
    }
}

/// Where an encoder's evaluation pass runs: the CPU encoder over its state, or a GPU session
/// ([`crate::device::CudaLogits`]). Evaluation and prediction give both the same full batches
/// (the last partial one padded) and read the same `batch × classes` logits of a classifier,
/// or the same loss of a masked-LM batch, so everything after them is one host code for both
/// devices.
pub enum EncoderForward<'a> {
    Cpu {
        model: &'a Encoder,
        st: &'a mut EncoderState,
    },
    Cuda(&'a mut crate::device::CudaLogits),
}

impl EncoderForward<'_> {
    /// Sequences per batch.
    pub fn batch(&self) -> usize {
        match self {
            EncoderForward::Cpu { st, .. } => st.batch(),
            EncoderForward::Cuda(c) => c.batch(),
        }
    }

    /// A masked-LM batch's mean loss, correct count and counted positions, dropout off.
    fn mlm_stats(&mut self, b: &MlmBatch) -> Result<(f64, usize, usize)> {
        match self {
            EncoderForward::Cpu { model, st } => {
                load_mlm(st, b)?;
                let s = model.forward(st, false, 0)?;
                Ok((s.loss, s.correct, s.count))
            }
            EncoderForward::Cuda(c) => Ok(c.mlm_stats(b)?),
        }
    }

    /// The logits (`batch × classes`, row-major) of one full batch, dropout off.
    pub fn logits(&mut self, b: &Batch) -> Result<&[f32]> {
        match self {
            EncoderForward::Cpu { model, st } => {
                load_classify(st, b)?;
                model.forward(st, false, 0)?;
                Ok(st.logits())
            }
            EncoderForward::Cuda(c) => {
                Ok(c.logits(&b.input_ids, &b.token_type_ids, &b.attention_mask)?)
            }
        }
    }
}

/// Evaluates a classifier on every example of `data` (the last partial batch is padded with
/// copies of the first example, which are not counted).
pub fn evaluate_classifier(
    model: &Encoder,
    st: &mut EncoderState,
    data: &EncodedDataset,
) -> Result<EvalStats> {
    evaluate_classifier_sharded(model, st, data, &mut Processes::single())
}

/// [`evaluate_classifier`] over the processes: each takes its contiguous range of examples
/// ([`Shard::range`](crate::distributed::Shard::range)) and the sums are reduced.
pub fn evaluate_classifier_sharded(
    model: &Encoder,
    st: &mut EncoderState,
    data: &EncodedDataset,
    procs: &mut Processes,
) -> Result<EvalStats> {
    let c = model.cfg.num_labels;
    evaluate_classifier_with(&mut EncoderForward::Cpu { model, st }, c, data, procs)
}

/// [`evaluate_classifier_sharded`] with the logits of `forward` (the CPU's or a GPU's) for a
/// classifier of `c` classes.
pub fn evaluate_classifier_with(
    forward: &mut EncoderForward,
    c: usize,
    data: &EncodedDataset,
    procs: &mut Processes,
) -> Result<EvalStats> {
    let n = data.len();
    let mut sums = classifier_sums(forward, c, data, procs.shard.range(n))?;
    procs.sum_f64(&mut sums);
    let (counts, confusion) = class_counts_from_sums(&sums[2..], c);
    Ok(EvalStats {
        loss: sums[0] / n as f64,
        accuracy: sums[1] / n as f64,
        examples: n,
        auc: None,
        classes: Some(ClassReport::from_counts(&counts, confusion)),
    })
}

/// The per-class counts and the confusion matrix (empty beyond
/// [`ClassReport::CONFUSION_MAX_CLASSES`]) from the sums [`classifier_sums`] lays out after
/// its first two.
fn class_counts_from_sums(sums: &[f64], c: usize) -> (ClassCounts, Vec<Vec<u64>>) {
    let counts = |k: usize| sums[k * c..(k + 1) * c].iter().map(|&v| v as u64).collect();
    let class_counts = ClassCounts {
        support: counts(0),
        predicted: counts(1),
        correct: counts(2),
    };
    let confusion = sums[3 * c..]
        .chunks_exact(c)
        .map(|row| row.iter().map(|&v| v as u64).collect())
        .collect();
    (class_counts, confusion)
}

/// Summed cross-entropy, correct predictions, then per class (c each) the true examples, the
/// predictions and the correct ones, then the confusion matrix (c × c, true × predicted, where
/// c ≤ [`ClassReport::CONFUSION_MAX_CLASSES`]) over the examples `range` of `data`: all sums,
/// so that processes add theirs.
fn classifier_sums(
    engine: &mut EncoderForward,
    c: usize,
    data: &EncodedDataset,
    range: Range<usize>,
) -> Result<Vec<f64>> {
    let (b, t) = (engine.batch(), data.max_len);
    let n = range.end;
    let mut batch = Batch::default();
    let (mut loss, mut correct) = (0.0f64, 0usize);
    let mut counts = vec![0.0f64; 3 * c];
    let keep_confusion = c <= ClassReport::CONFUSION_MAX_CLASSES;
    let mut confusion = vec![0.0f64; if keep_confusion { c * c } else { 0 }];
    let mut start = range.start;
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
        let logits = engine.logits(&batch)?;
        for (j, row) in logits.chunks_exact(c).enumerate().take(n - start) {
            let label = batch.labels[j];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let lse = max as f64
                + row
                    .iter()
                    .map(|&v| ((v - max) as f64).exp())
                    .sum::<f64>()
                    .ln();
            loss += lse - row[label] as f64;
            let predicted = comera_layers::loss::argmax(row);
            correct += (predicted == label) as usize;
            counts[label] += 1.0;
            counts[c + predicted] += 1.0;
            counts[2 * c + label] += (predicted == label) as u8 as f64;
            if keep_confusion {
                confusion[label * c + predicted] += 1.0;
            }
        }
        start += b;
    }
    let mut sums = vec![loss, correct as f64];
    sums.extend(counts);
    sums.extend(confusion);
    Ok(sums)
}

/// Held-out masked-LM loss and masked-token accuracy over every batch of `blocks` (masks from
/// a fixed seed, so every evaluation and every run sees the same ones). `examples` counts the
/// predicted tokens.
pub fn evaluate_mlm(
    model: &Encoder,
    st: &mut EncoderState,
    data: &CorpusData,
    blocks: &comera_data::corpus::PackedSequences,
) -> Result<EvalStats> {
    let b = st.batch();
    evaluate_mlm_sharded(model, st, data, blocks, b, &mut Processes::single())
}

/// [`evaluate_mlm`] over the processes: the global batches of `batch_size` rows (the masks of
/// a single process), each process on its rows of each, the sums reduced.
pub fn evaluate_mlm_sharded(
    model: &Encoder,
    st: &mut EncoderState,
    data: &CorpusData,
    blocks: &comera_data::corpus::PackedSequences,
    batch_size: usize,
    procs: &mut Processes,
) -> Result<EvalStats> {
    let mut forward = EncoderForward::Cpu { model, st };
    evaluate_mlm_with(&mut forward, data, blocks, batch_size, procs)
}

/// [`evaluate_mlm_sharded`] with the pass of `forward` (the CPU's or a GPU's).
pub fn evaluate_mlm_with(
    forward: &mut EncoderForward,
    data: &CorpusData,
    blocks: &comera_data::corpus::PackedSequences,
    batch_size: usize,
    procs: &mut Processes,
) -> Result<EvalStats> {
    let b = batch_size;
    let rows = procs.shard.rows(b)?;
    let mut batch = MlmBatch::new(b, blocks.seq_len);
    let mut part = MlmBatch::new(rows.len(), blocks.seq_len);
    let mut it = MlmBatches::new(blocks, data.masker, b, 0x5EED_E7A1, false);
    let (mut loss, mut correct, mut count) = (0.0f64, 0usize, 0usize);
    while it.next_into(&mut batch) {
        let (l, c, k) = if procs.shard.is_whole() {
            forward.mlm_stats(&batch)?
        } else {
            mlm_rows(&batch, rows.clone(), &mut part);
            forward.mlm_stats(&part)?
        };
        if k > 0 {
            loss += l * k as f64;
        }
        correct += c;
        count += k;
    }
    if !procs.shard.is_whole() {
        let mut sums = [loss, correct as f64, count as f64];
        procs.sum_f64(&mut sums);
        (loss, correct, count) = (sums[0], sums[1] as usize, sums[2] as usize);
    }
    if count == 0 {
        return Err(Error::run(format!(
            "evaluation: the {} held-out blocks make no batch of {b}",
            blocks.len()
        )));
    }
    Ok(EvalStats {
        loss: loss / count as f64,
        accuracy: correct as f64 / count as f64,
        examples: count,
        auc: None,
        classes: None,
    })
}

/// Evaluates a DLRM on every example of `data`, batch by batch (the last partial batch is
/// padded with copies of the first example, which are not counted). Also returns the logits.
pub fn evaluate_ctr(
    model: &Dlrm,
    st: &mut DlrmState,
    data: &CtrData,
) -> Result<(EvalStats, Vec<f32>)> {
    evaluate_ctr_sharded(model, st, data, &mut Processes::single())
}

/// [`evaluate_ctr`] over the processes: each scores its contiguous range of examples
/// ([`Shard::range`](crate::distributed::Shard::range)); the scores are gathered in rank order (the order of `data`).
pub fn evaluate_ctr_sharded(
    model: &Dlrm,
    st: &mut DlrmState,
    data: &CtrData,
    procs: &mut Processes,
) -> Result<(EvalStats, Vec<f32>)> {
    let n = data.len();
    if n == 0 {
        return Err(Error::data("the validation set is empty"));
    }
    let mine = ctr_scores(model, st, data, procs.shard.range(n))?;
    let scores = if procs.shard.is_whole() {
        mine
    } else {
        procs.gather_f32(&mine)
    };
    let (loss, correct) = bce_with_logits(&scores, &data.labels, None);
    let stats = EvalStats {
        loss,
        accuracy: correct as f64 / n as f64,
        examples: n,
        auc: Some(auc(&scores, &data.labels).unwrap_or(0.5)),
        classes: None,
    };
    Ok((stats, scores))
}

/// The logits of the examples `range` of `data`, batch by batch (the last partial batch is
/// padded with copies of the first example, whose logits are dropped).
fn ctr_scores(
    model: &Dlrm,
    st: &mut DlrmState,
    data: &CtrData,
    range: Range<usize>,
) -> Result<Vec<f32>> {
    let (b, n) = (st.batch(), range.end);
    let mut batch = CtrBatch::new(b, data.dense_names.len(), data.field_names.len());
    let mut scores = Vec::with_capacity(range.len() + b);
    let mut start = range.start;
    while start < n {
        for j in 0..b {
            let i = if start + j < n { start + j } else { 0 };
            batch.set_from(j, data, i);
        }
        st.load(&batch)?;
        model
            .forward_logits(st)
            .map_err(|e| Error::data_with("validation data", e))?;
        scores.extend_from_slice(&st.logits()[..b.min(n - start)]);
        start += b;
    }
    Ok(scores)
}

/// Rows `rows` of a classification batch (row-major `[batch, seq_len]` buffers) into `out`.
fn classify_rows(src: &Batch, rows: Range<usize>, out: &mut Batch) {
    let t = src.input_ids.len() / src.labels.len().max(1);
    let cells = rows.start * t..rows.end * t;
    out.input_ids.clear();
    out.input_ids
        .extend_from_slice(&src.input_ids[cells.clone()]);
    out.token_type_ids.clear();
    out.token_type_ids
        .extend_from_slice(&src.token_type_ids[cells.clone()]);
    out.attention_mask.clear();
    out.attention_mask
        .extend_from_slice(&src.attention_mask[cells]);
    out.labels.clear();
    out.labels.extend_from_slice(&src.labels[rows]);
}

/// Rows `rows` of a masked-LM batch into `out` (made for `rows.len()` rows): the selected
/// flat positions `row·seq_len + col` inside the rows, shifted to the shard's first row.
fn mlm_rows(src: &MlmBatch, rows: Range<usize>, out: &mut MlmBatch) {
    let t = src.seq_len;
    let cells = rows.start * t..rows.end * t;
    out.input_ids.copy_from_slice(&src.input_ids[cells.clone()]);
    out.attention_mask
        .copy_from_slice(&src.attention_mask[cells.clone()]);
    out.labels.copy_from_slice(&src.labels[cells.clone()]);
    let first = cells.start as u32;
    out.selected.clear();
    out.selected.extend(
        src.selected
            .iter()
            .filter(|&&i| cells.contains(&(i as usize)))
            .map(|&i| i - first),
    );
}

/// Rows `rows` of a CTR batch into `out` (made for `rows.len()` rows; `cats` is field-major
/// `[n_fields, batch]`).
fn ctr_rows(src: &CtrBatch, rows: Range<usize>, out: &mut CtrBatch) {
    let (nd, b, ob) = (src.n_dense, src.batch, out.batch);
    out.dense
        .copy_from_slice(&src.dense[rows.start * nd..rows.end * nd]);
    for f in 0..src.n_fields {
        out.cats[f * ob..(f + 1) * ob]
            .copy_from_slice(&src.cats[f * b + rows.start..f * b + rows.end]);
    }
    out.labels.copy_from_slice(&src.labels[rows]);
}

fn load_classify(st: &mut EncoderState, b: &Batch) -> Result<()> {
    st.load(
        &b.input_ids,
        &b.token_type_ids,
        &b.attention_mask,
        &b.labels,
    )?;
    Ok(())
}

fn load_mlm(st: &mut EncoderState, b: &MlmBatch) -> Result<()> {
    st.load_mlm(&b.input_ids, &b.attention_mask, &b.labels, &b.selected)?;
    Ok(())
}

/// The data of an encoder run: labelled examples (classification) or a corpus (masked-LM).
/// One per run, so the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum EncoderData {
    Classify(PreparedData),
    Mlm(CorpusData),
}

/// Classification or masked-LM pre-training of the encoder.
pub struct EncoderTask {
    pub data: EncoderData,
    pub phases: Vec<Phase>,
    pub model_cfg: EncoderConfig,
    pub vocab: PathBuf,
    pub seed: u64,
    /// This process's shard of every global batch and held-out set.
    pub procs: std::cell::RefCell<Processes>,
    /// A distilled run's frozen teacher and loss, attached to every training state.
    pub teacher: Option<(std::sync::Arc<Encoder>, comera_model::DistillLoss)>,
}

/// One epoch's batches of an encoder task: the global batch, and this process's rows of it
/// (None: a single process loads the global batch itself).
#[allow(clippy::large_enum_variant)]
pub enum EncoderEpoch<'a> {
    Classify(Batches<'a>, Batch, Option<(Range<usize>, Batch)>),
    Mlm(MlmBatches<'a>, MlmBatch, Option<(Range<usize>, MlmBatch)>),
}

impl EpochBatches<EncoderState> for EncoderEpoch<'_> {
    fn next_into(&mut self, st: &mut EncoderState) -> Result<bool> {
        match self {
            EncoderEpoch::Classify(it, b, part) => {
                if !it.next_into(b) {
                    return Ok(false);
                }
                match part {
                    None => load_classify(st, b)?,
                    Some((rows, p)) => {
                        classify_rows(b, rows.clone(), p);
                        load_classify(st, p)?;
                    }
                }
            }
            EncoderEpoch::Mlm(it, b, part) => {
                if !it.next_into(b) {
                    return Ok(false);
                }
                match part {
                    None => load_mlm(st, b)?,
                    Some((rows, p)) => {
                        mlm_rows(b, rows.clone(), p);
                        load_mlm(st, p)?;
                    }
                }
            }
        }
        Ok(true)
    }
}

impl Task for EncoderTask {
    type Model = Encoder;
    type Epoch<'a> = EncoderEpoch<'a>;

    fn phases(&self) -> &[Phase] {
        &self.phases
    }

    fn batches_per_epoch(&mut self, phase: &Phase) -> Result<Option<usize>> {
        let (len, what) = match &mut self.data {
            EncoderData::Classify(d) => (d.train.len(), "examples"),
            EncoderData::Mlm(d) => (d.packed(phase.seq_len)?.train.len(), "blocks"),
        };
        if len < phase.batch_size {
            return Err(ConfigError::new(
                "train.batch_size",
                format!(
                    "{} is larger than the {len} training {what}",
                    phase.batch_size
                ),
            )
            .into());
        }
        Ok(Some(len / phase.batch_size))
    }

    fn state(&self, model: &Encoder, phase: &Phase) -> Result<EncoderState> {
        let rows = match &self.data {
            EncoderData::Mlm(d) => d.masker.max_selected_per_row(phase.seq_len),
            EncoderData::Classify(_) => 0,
        };
        let b = self.procs.borrow().shard.rows(phase.batch_size)?.len();
        let mut st = model.state_for(b, phase.seq_len, rows)?;
        if let Some((teacher, loss)) = &self.teacher {
            st.attach_teacher(model, teacher.clone(), loss.clone())?;
        }
        Ok(st)
    }

    fn epoch<'a>(&'a self, phase: &Phase, epoch: usize) -> Result<EncoderEpoch<'a>> {
        let (b, seed) = (phase.batch_size, self.seed.wrapping_add(epoch as u64));
        let shard = self.procs.borrow().shard;
        let rows = (!shard.is_whole()).then(|| shard.rows(b)).transpose()?;
        Ok(match &self.data {
            EncoderData::Classify(d) => EncoderEpoch::Classify(
                d.train.batches(b, seed),
                Batch::default(),
                rows.map(|r| (r, Batch::default())),
            ),
            EncoderData::Mlm(d) => EncoderEpoch::Mlm(
                MlmBatches::new(&d.packed_ref(phase.seq_len).train, d.masker, b, seed, true),
                MlmBatch::new(b, phase.seq_len),
                rows.map(|r| {
                    let n = r.len();
                    (r, MlmBatch::new(n, phase.seq_len))
                }),
            ),
        })
    }

    fn evaluate(&self, model: &Encoder, st: &mut EncoderState, phase: &Phase) -> Result<EvalStats> {
        let procs = &mut *self.procs.borrow_mut();
        match &self.data {
            EncoderData::Classify(d) => evaluate_classifier_sharded(model, st, &d.valid, procs),
            EncoderData::Mlm(d) => {
                let blocks = &d.packed_ref(st.seq_len()).valid;
                evaluate_mlm_sharded(model, st, d, blocks, phase.batch_size, procs)
            }
        }
    }

    fn model_meta(&self, _model: &Encoder, epoch: usize, step: u64) -> Result<String> {
        let (labels, pair) = match &self.data {
            EncoderData::Classify(d) => (d.label_names.clone(), d.pair),
            EncoderData::Mlm(_) => (Vec::new(), false),
        };
        let meta = ModelMeta {
            run_id: None,
            weights_sha256: None,
            meta_sha256: None,
            model: self.model_cfg.clone(),
            labels,
            vocab: self.vocab.clone(),
            pair,
            epoch,
            step,
        };
        Ok(toml::to_string_pretty(&meta)?)
    }

    fn tokens_per_example(&self, phase: &Phase) -> usize {
        phase.seq_len
    }

    fn loss_name(&self) -> &'static str {
        "cross-entropy"
    }

    /// A distilled run: the teacher's size, memory and forward time (of this process, since
    /// it last started).
    fn report_extra(
        &self,
        _model: &Encoder,
        st: &EncoderState,
    ) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        if let Some(t) = st.teacher() {
            let (param_bytes, state_bytes) = t.bytes();
            m.insert(
                "teacher".into(),
                serde_json::json!({
                    "params": t.model().num_params(),
                    "param_bytes": param_bytes,
                    "state_bytes": state_bytes,
                    "forward_seconds": t.forward_time().as_secs_f64(),
                }),
            );
        }
        m
    }

    fn majority_accuracy(&self) -> Option<f64> {
        match &self.data {
            EncoderData::Classify(d) => {
                let mut counts = vec![0usize; d.label_names.len()];
                for &l in &d.valid.labels {
                    counts[l] += 1;
                }
                let top = *counts.iter().max().unwrap_or(&0);
                Some(top as f64 / d.valid.labels.len().max(1) as f64)
            }
            EncoderData::Mlm(_) => None,
        }
    }
}

/// Click-through-rate prediction with a DLRM.
pub struct CtrTask {
    /// The training source: read by one epoch at a time (a cell, so that the task can
    /// evaluate on `valid` while an epoch is under way).
    pub train: std::cell::RefCell<TrainSource>,
    pub valid: CtrData,
    pub phases: Vec<Phase>,
    /// What a saved model needs besides its weights (epoch and step filled in on save).
    pub meta: DlrmMeta,
    pub seed: u64,
    pub save_model: bool,
    /// This process's shard of every global batch and of the validation set.
    pub procs: std::cell::RefCell<Processes>,
}

/// One epoch of a CTR task: the streamed or shuffled training source, its global batch, and
/// this process's rows of it (None: a single process loads the global batch itself).
pub struct CtrEpoch<'a> {
    source: std::cell::RefMut<'a, TrainSource>,
    batch: CtrBatch,
    part: Option<(Range<usize>, CtrBatch)>,
}

impl EpochBatches<DlrmState> for CtrEpoch<'_> {
    fn next_into(&mut self, st: &mut DlrmState) -> Result<bool> {
        let more = self
            .source
            .next_batch(&mut self.batch)
            .map_err(|e| Error::DlrmData(e.into()))?;
        if !more {
            return Ok(false);
        }
        match &mut self.part {
            None => st.load(&self.batch)?,
            Some((rows, p)) => {
                ctr_rows(&self.batch, rows.clone(), p);
                st.load(p)?;
            }
        }
        Ok(true)
    }
}

impl Task for CtrTask {
    type Model = Dlrm;
    type Epoch<'a> = CtrEpoch<'a>;

    fn phases(&self) -> &[Phase] {
        &self.phases
    }

    fn batches_per_epoch(&mut self, phase: &Phase) -> Result<Option<usize>> {
        let n = self.train.get_mut().steps_per_epoch(phase.batch_size);
        if n == Some(0) {
            return Err(ConfigError::new(
                "train.batch_size",
                format!("{} is larger than the training set", phase.batch_size),
            )
            .into());
        }
        Ok(n)
    }

    fn state(&self, model: &Dlrm, phase: &Phase) -> Result<DlrmState> {
        Ok(model.state(self.procs.borrow().shard.rows(phase.batch_size)?.len()))
    }

    fn epoch<'a>(&'a self, phase: &Phase, epoch: usize) -> Result<CtrEpoch<'a>> {
        let mut source = self.train.try_borrow_mut().map_err(|_| {
            Error::run("internal: an epoch of the training source is still under way")
        })?;
        source
            .start_epoch(epoch, self.seed)
            .map_err(|e| Error::DlrmData(e.into()))?;
        let batch = CtrBatch::new(
            phase.batch_size,
            self.meta.n_dense,
            self.meta.field_names.len(),
        );
        let shard = self.procs.borrow().shard;
        let part = match shard.is_whole() {
            true => None,
            false => {
                let rows = shard.rows(phase.batch_size)?;
                let (nd, nf) = (self.meta.n_dense, self.meta.field_names.len());
                let p = CtrBatch::new(rows.len(), nd, nf);
                Some((rows, p))
            }
        };
        Ok(CtrEpoch {
            source,
            batch,
            part,
        })
    }

    fn evaluate(&self, model: &Dlrm, st: &mut DlrmState, _phase: &Phase) -> Result<EvalStats> {
        let procs = &mut *self.procs.borrow_mut();
        Ok(evaluate_ctr_sharded(model, st, &self.valid, procs)?.0)
    }

    fn saves_model(&self) -> bool {
        self.save_model
    }

    fn model_meta(&self, model: &Dlrm, epoch: usize, step: u64) -> Result<String> {
        let meta = DlrmMeta {
            tables: model.tables.iter().map(|t| t.describe()).collect(),
            epoch,
            step,
            ..self.meta.clone()
        };
        Ok(toml::to_string_pretty(&meta)?)
    }

    fn tokens_per_example(&self, _phase: &Phase) -> usize {
        1
    }

    fn loss_name(&self) -> &'static str {
        "binary cross-entropy"
    }

    fn epoch_note(&self) -> Option<String> {
        self.train.borrow().malformed_summary()
    }

    fn report_extra(
        &self,
        model: &Dlrm,
        _st: &comera_dlrm::DlrmState,
    ) -> serde_json::Map<String, serde_json::Value> {
        let mut m = serde_json::Map::new();
        m.insert("table_params".into(), model.table_params().into());
        m.insert(
            "dense_table_params".into(),
            model.dense_table_params().into(),
        );
        m.insert(
            "tables".into(),
            model
                .tables
                .iter()
                .map(|t| t.describe())
                .collect::<Vec<_>>()
                .into(),
        );
        m.insert("num_params".into(), Model::num_params(model).into());
        m
    }
}
