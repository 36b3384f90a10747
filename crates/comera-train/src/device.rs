//! The seam between the training loop and the device its steps run on.
//!
//! The loop takes each step through one of two engines and sees nothing else of the device:
//!
//! - the CPU (`train.device = "cpu"`, the default): `comera_optim::Stepper` over the model's
//!   own buffers, as it always has;
//! - a [`DeviceStep`]: the whole step (forward, backward, clipping, AdamW) on the device, with
//!   parameters and moments kept there. The loop hands it the batch it loaded into the host
//!   state and gets the loss back; whenever it needs the model on the host (an evaluation, a
//!   checkpoint, model files, the end of the run) it calls [`DeviceStep::copy_to_host`], which
//!   copies parameters and AdamW's moments back by name. The run directory, the metrics log,
//!   checkpoints and model files are therefore the same on both devices: a run started on
//!   one resumes on the other (`comera train --resume DIR --device cpu`).
//!
//! What a device does not do yet is refused before the run directory is touched, with
//! [`DeviceError::NotYet`] naming it; the CLI ends such a run with status 2. On CUDA today
//! (docs/gpu.md): the text classifier and masked-LM pre-training (post- or pre-LN, TT/TTM or
//! dense), dropout, AdamW with its parameter groups, clipping, the learning-rate schedule, the
//! rank schedule, runs of several phases ([`DeviceStep::set_shape`] at each phase) and gradient
//! accumulation ([`DeviceStep::accumulate`] per micro-batch, then
//! [`DeviceStep::apply_accumulated`]). The rank
//! schedule is split at the seam: the stage's objective and the gates' projection run inside
//! the device's step ([`DeviceStep::step`] takes the host's [`RankStep`]: hold, stage, target,
//! and gives back the objective); the stage switch and the truncation of pruned slices stay
//! with the host's `RankController`, which reads the model only after the steps that need it
//! (`RankController::reads_model_after`; the loop copies the device's parameters back first),
//! and a truncated model goes back to the device through [`DeviceStep::copy_from_host`], which
//! plans the step again at the new ranks.
//!
//! Evaluation and prediction of a saved encoder (`comera eval` / `comera predict --device
//! cuda`) take a classifier's logits, or a masked-LM batch's loss or logits, from
//! [`CudaLogits`] (a session opened for inference only, the forward with dropout off, batch by
//! batch); everything else about them — the metrics, the probabilities, the output — is the
//! same host code as on the CPU (`crate::infer`). [`check_inference`] refuses, before the
//! device is opened, the models it does not take (a DLRM).

use comera_cuda::engine::{
    DeviceObjective, DeviceStepStats, EncoderSession, Micro, Moments, RankSettings, RankStep,
    StepConfig,
};
use comera_cuda::{CudaError, DeviceSpec};
use comera_layers::Trainable;
use comera_model::{Encoder, EncoderState};
use comera_optim::{AdamWConfig, Optimizer};

/// A device that cannot take this run, or that failed under it.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The device's own failure (no driver, no GPU, a kernel that does not compile, out of
    /// memory), whose message says what is missing and what to do.
    #[error("device {device}")]
    Cuda {
        device: DeviceSpec,
        #[source]
        source: CudaError,
    },
    /// Something this run asks for that the device does not do yet.
    #[error("device {device}: {what} is not on the GPU yet; use the CPU (--device cpu, the default); docs/gpu.md lists what is")]
    NotYet { device: DeviceSpec, what: String },
}

/// What one step on a device gives back (the one wait for the device in a step).
#[derive(Clone, Copy, Debug)]
pub struct DeviceStats {
    /// Mean loss over the counted predictions.
    pub loss: f64,
    pub correct: usize,
    pub count: usize,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// The rank schedule's objective of the step (None without the schedule).
    pub objective: Option<DeviceObjective>,
}

/// The training step of model kind `M` on a device other than the CPU.
pub trait DeviceStep<M: Trainable> {
    /// The device, as messages name it (`cuda:0 (NVIDIA H200)`).
    fn describe(&self) -> String;
    /// One step on the batch loaded in `st` at 0-based step `step` (which seeds dropout) and
    /// learning-rate scale `lr_scale`: forward, backward, the rank objective (with `rank`,
    /// the host's inputs for it), clipping, the optimiser, the gates' projection.
    fn step(
        &mut self,
        st: &M::State,
        step: u64,
        lr_scale: f32,
        rank: Option<RankStep>,
    ) -> Result<DeviceStats, DeviceError>;
    /// One micro-batch of an accumulated step (`train.accumulate_steps` > 1) on the batch
    /// loaded in `st`: its forward (dropout at `micro.dropout_step`) and backward, added into
    /// the step's gradients as the CPU's `Stepper::step_accumulated` adds them (the mean over
    /// every counted prediction of the step). `micro.index` 0 starts the step.
    fn accumulate(&mut self, st: &M::State, micro: Micro) -> Result<(), DeviceError>;
    /// Ends an accumulated step: what [`DeviceStep::step`] does after its backward (the rank
    /// objective, clipping, the optimiser, the gates' projection), and its statistics over
    /// all its micro-batches.
    fn apply_accumulated(
        &mut self,
        step: u64,
        lr_scale: f32,
        rank: Option<RankStep>,
    ) -> Result<DeviceStats, DeviceError>;
    /// Parameters into `model` and AdamW's moments and step count into `optimizer`, by name.
    fn copy_to_host(&mut self, model: &mut M, optimizer: &mut Optimizer)
        -> Result<(), DeviceError>;
    /// The rank gates' values into `model`, nothing else (one small transfer): the active
    /// ranks a log line reports between the steps that copy everything back.
    fn copy_gates_to_host(&mut self, model: &mut M) -> Result<(), DeviceError>;
    /// Parameters, moments and step count from the host (a run resumed from a checkpoint, or
    /// truncated by the host: the device plans its step again at the model's ranks).
    fn copy_from_host(&mut self, model: &M, optimizer: &Optimizer) -> Result<(), DeviceError>;
    /// The batch shape of the steps from now on: the state the loop built for the phase it
    /// enters (its batch size, sequence length, a masked-LM head's rows). The device plans its
    /// step again when the shape differs from its plan's, carrying over its parameters,
    /// moments and step count.
    fn set_shape(&mut self, model: &M, st: &M::State) -> Result<(), DeviceError>;
    /// The rank schedule the steps run (None: off), as the run's controller has it once the
    /// run is set up (a resumed run's comes from its checkpoint); the device plans its step
    /// again only when it differs from what the engine was built with.
    fn set_rank_schedule(
        &mut self,
        model: &M,
        settings: Option<RankSettings>,
    ) -> Result<(), DeviceError>;
}

/// What the device engine needs of a run besides its model.
#[derive(Clone, Debug)]
pub struct DeviceRun {
    pub device: DeviceSpec,
    /// The optimiser's settings, its clipping (`clip_norm`) among them.
    pub optim: AdamWConfig,
    /// Sequences per step, and tokens per sequence.
    pub batch: usize,
    pub seq_len: usize,
    /// The run's seed (dropout's masks derive from it, as `Encoder::new` derives them).
    pub seed: u64,
    /// The rank schedule (None: off), see [`rank_settings`].
    pub rank: Option<RankSettings>,
    /// A masked-LM run's predicted positions per sequence at most (its masker's; 0 for a
    /// classifier): the device's head has room for batch × this.
    pub mlm_rows_per_seq: usize,
    /// The shapes of the run's later phases (batch, tokens, masked-LM rows per sequence), if
    /// any: each must fit on the device too, checked before the run starts.
    pub later_phases: Vec<(usize, usize, usize)>,
}

/// What the device's step needs of a run's rank schedule: its settings when it is active.
pub fn rank_settings(rc: &comera_optim::rank::RankController) -> Option<RankSettings> {
    if !rc.active() {
        return None;
    }
    let c = &rc.cfg;
    Some(RankSettings {
        gamma: c.gamma,
        beta: c.beta,
        rho_loss: c.rho_loss,
        rho_size: c.rho_size,
        target_loss: c.target_loss,
        size_weight: c.size_weight,
        s_ref: rc.s_ref,
        layer_prefix: c.layer_prefix.clone(),
        min_rank: c.min_rank,
        normalise_gates: c.normalise_gates,
    })
}

/// The host's inputs to step `step` (0-based) of the rank schedule on a device.
pub fn rank_step(rc: &comera_optim::rank::RankController, step: u64) -> Option<RankStep> {
    rc.active().then(|| RankStep {
        hold: rc.holds_gates(step),
        late_target: rc.late_target(),
    })
}

/// A device step's objective as the CPU reports its own (`RankController::apply`).
pub fn objective(loss: f64, o: DeviceObjective) -> comera_optim::rank::Objective {
    use comera_cuda::engine::DeviceBranch;
    use comera_optim::rank::Branch;
    comera_optim::rank::Objective {
        loss,
        size: o.size,
        size_l1: o.size_l1,
        branch: match o.branch {
            DeviceBranch::Early => Branch::Early,
            DeviceBranch::Loss => Branch::Loss,
            DeviceBranch::Size => Branch::Size,
        },
        w_loss: o.w_loss,
        w_size: o.w_size,
    }
}

/// How the run is set up, as far as a device engine cares (checked by [`check_run`]).
#[derive(Clone, Copy, Debug)]
pub struct RunShape {
    /// A `[galore]` section.
    pub galore: bool,
    /// The run's processes (data-parallel over MPI).
    pub processes: usize,
    /// A distillation teacher.
    pub teacher: bool,
}

/// Refuses, before anything is written, what no device engine does yet.
pub fn check_run(device: DeviceSpec, run: RunShape) -> Result<(), DeviceError> {
    let not_yet = |what: &str| {
        Err(DeviceError::NotYet {
            device,
            what: what.into(),
        })
    };
    if run.galore {
        return not_yet("GaLore ([galore])");
    }
    if run.processes > 1 {
        return not_yet("data-parallel training over several processes");
    }
    if run.teacher {
        return not_yet("distillation ([distill])");
    }
    Ok(())
}

/// What this machine offers for `--device` (`comera devices`, `comera.devices()`): the CPU
/// and the CUDA survey ([`comera_cuda::survey`]; with `open`, each GPU opened as a run opens
/// it).
#[derive(Clone, Debug)]
pub struct Devices {
    pub cpu: DevicesCpu,
    pub cuda: comera_cuda::Survey,
}

/// The CPU of [`Devices`]: its model name and this process's pool threads.
#[derive(Clone, Debug)]
pub struct DevicesCpu {
    pub name: String,
    pub threads: usize,
}

impl Devices {
    /// `{"cpu": {"name", "threads"}, "cuda": the survey}` (`comera devices --json`).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "cpu": { "name": self.cpu.name, "threads": self.cpu.threads },
            "cuda": serde_json::to_value(&self.cuda).unwrap_or(serde_json::Value::Null),
        })
    }
}

/// This machine's [`Devices`].
pub fn devices(open: bool) -> Devices {
    let m = crate::Machine::this();
    Devices {
        cpu: DevicesCpu {
            name: m.cpu,
            threads: m.threads,
        },
        cuda: comera_cuda::survey(open),
    }
}

/// What a model's evaluation or prediction on `device` is refused for (before the device is
/// opened, before anything is read or written past the model): a DLRM, whose `model` is
/// `None`. Every encoder is taken (a classifier or a masked-LM model, post- or pre-LN, TT/TTM
/// or dense).
pub fn check_inference(device: DeviceSpec, model: Option<&Encoder>) -> Result<(), DeviceError> {
    if device.is_cuda() && model.is_none() {
        return Err(DeviceError::NotYet {
            device,
            what: "a DLRM (click-through) model".into(),
        });
    }
    Ok(())
}

/// A model's evaluation pass on a CUDA GPU, batch by batch: a classifier's logits, or a
/// masked-LM model's loss (and logits at its predicted positions). A session opened for
/// inference only ([`EncoderSession::for_inference`]: the parameters uploaded, the forward with
/// dropout off captured once as a graph and replayed per batch).
pub struct CudaLogits {
    session: EncoderSession,
    device: DeviceSpec,
    logits: Vec<f32>,
}

impl CudaLogits {
    /// Opens the GPU of `device` (`cuda` / `cuda:N`) for `model`'s evaluation pass on batches
    /// of `batch` sequences of `seq_len` tokens, a masked-LM head predicting at most
    /// `mlm_rows_per_seq` positions a sequence (the CPU state's `state_for` argument; ignored
    /// for a classifier). Refuses what [`check_inference`] refuses.
    pub fn new(
        device: DeviceSpec,
        model: &Encoder,
        batch: usize,
        seq_len: usize,
        mlm_rows_per_seq: usize,
    ) -> Result<CudaLogits, DeviceError> {
        check_inference(device, Some(model))?;
        let Some(ordinal) = device.cuda_ordinal() else {
            return Err(DeviceError::NotYet {
                device,
                what: "the CPU through the device seam".into(),
            });
        };
        let session =
            EncoderSession::for_inference(ordinal, model, batch, seq_len, mlm_rows_per_seq)
                .map_err(|source| DeviceError::Cuda { device, source })?;
        Ok(CudaLogits {
            session,
            device,
            logits: Vec::new(),
        })
    }

    /// Sequences per batch.
    pub fn batch(&self) -> usize {
        self.session.shape().0
    }

    /// The logits (batch × classes, row-major) of one full batch (batch × seq_len ids, types
    /// and mask, mask 1 = real token).
    pub fn logits(
        &mut self,
        ids: &[u32],
        types: &[u32],
        mask: &[u32],
    ) -> Result<&[f32], DeviceError> {
        self.logits = self
            .session
            .logits((ids, types, mask))
            .map_err(self.failed())?;
        Ok(&self.logits)
    }

    /// A masked-LM batch's mean loss, correct count and counted positions (the CPU's
    /// `Encoder::forward(st, false, _)` after `st.load_mlm`).
    pub fn mlm_stats(
        &mut self,
        b: &comera_data::mlm::MlmBatch,
    ) -> Result<(f64, usize, usize), DeviceError> {
        let (loss, correct, count) = self
            .session
            .mlm_eval((&b.input_ids, &b.attention_mask, &b.labels, &b.selected))
            .map_err(self.failed())?;
        Ok((loss, correct as usize, count as usize))
    }

    /// A masked-LM model's logits at the positions `selected` of one batch (ids and mask):
    /// rows of the decoder's width, the first `selected.len()` of them the positions'.
    pub fn mlm_logits(
        &mut self,
        ids: &[u32],
        mask: &[u32],
        selected: &[u32],
    ) -> Result<&[f32], DeviceError> {
        self.logits = self
            .session
            .mlm_logits((ids, mask, selected))
            .map_err(self.failed())?;
        Ok(&self.logits)
    }

    /// The session's failure as this device's.
    fn failed(&self) -> impl FnOnce(CudaError) -> DeviceError {
        let device = self.device;
        move |source| DeviceError::Cuda { device, source }
    }
}

/// A classifier batch's mask and labels in the words a step engine loads (mask 0/1 as `u32`,
/// labels as indices), into buffers kept between steps.
pub(crate) fn classifier_words(
    batch: &comera_model::encoder::ClassifierBatch,
    mask: &mut Vec<u32>,
    labels: &mut Vec<usize>,
) {
    mask.clear();
    mask.extend(batch.mask.iter().map(|&m| m as u32));
    labels.clear();
    labels.extend(batch.labels.iter().map(|&l| l as usize));
}

/// The text classifier's step on a CUDA GPU ([`EncoderSession`]: the whole step captured once
/// as a CUDA graph and replayed).
pub struct CudaEncoder {
    session: EncoderSession,
    device: DeviceSpec,
    /// The host batch in the device's types: mask as 0/1 words, labels as indices.
    mask: Vec<u32>,
    labels: Vec<usize>,
}

impl CudaEncoder {
    /// Opens the GPU of `run.device`, plans `model`'s step for `run`'s batch shape and uploads
    /// the parameters (checked against the GPU's free memory before anything is allocated).
    pub fn new(run: &DeviceRun, model: &Encoder) -> Result<CudaEncoder, DeviceError> {
        let device = run.device;
        let not_yet = |what: &str| DeviceError::NotYet {
            device,
            what: what.into(),
        };
        let ordinal = device
            .cuda_ordinal()
            .ok_or_else(|| not_yet("the CPU through the device seam"))?;
        let o = &run.optim;
        let opt = StepConfig {
            lr_cores: o.lr_cores,
            lr_gates: o.lr_gates,
            lr_other: o.lr_other,
            weight_decay: o.weight_decay,
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            max_grad_norm: o.clip_norm,
            // With the rank schedule pruned gate entries freeze (the CPU's
            // `RankController::attach`); without it the gates are constants.
            freeze_gates_at: run.rank.is_some().then_some(model.cfg.threshold),
            train_gates: false,
            rank: run.rank.clone(),
            mlm_rows_per_seq: run.mlm_rows_per_seq,
            forward_only: false,
        };
        let session = EncoderSession::new(ordinal, model, run.seed, run.batch, run.seq_len, opt)
            .map_err(|source| DeviceError::Cuda { device, source })?;
        session
            .check_shapes_fit(model, &run.later_phases)
            .map_err(|source| DeviceError::Cuda { device, source })?;
        let n = run.batch * run.seq_len;
        Ok(CudaEncoder {
            session,
            device,
            mask: Vec::with_capacity(n),
            labels: Vec::with_capacity(run.batch),
        })
    }

    fn not_yet_galore(&self) -> DeviceError {
        DeviceError::NotYet {
            device: self.device,
            what: "GaLore ([galore])".into(),
        }
    }

    fn cuda(&self) -> impl Fn(CudaError) -> DeviceError + '_ {
        |source| DeviceError::Cuda {
            device: self.device,
            source,
        }
    }
}

/// What a batch goes through on the device: a whole step, or one micro-batch of an
/// accumulated one.
enum Pass {
    Step { step: u64, lr_scale: f32 },
    Micro(Micro),
}

impl CudaEncoder {
    /// The batch loaded in `st` (a classifier's or a masked-LM batch) through `pass`: a whole
    /// step's statistics, or None after a micro-batch.
    fn pass(
        &mut self,
        st: &EncoderState,
        pass: Pass,
    ) -> Result<Option<DeviceStepStats>, CudaError> {
        let s = &mut self.session;
        if let Some(batch) = st.classifier_batch() {
            classifier_words(&batch, &mut self.mask, &mut self.labels);
            let batch = (batch.ids, batch.types, &self.mask[..], &self.labels[..]);
            match pass {
                Pass::Step { step, lr_scale } => s.step(batch, step, lr_scale).map(Some),
                Pass::Micro(m) => s.accumulate(batch, m).map(|()| None),
            }
        } else if let Some(batch) = st.mlm_batch() {
            self.mask.clear();
            self.mask.extend(batch.mask.iter().map(|&m| m as u32));
            let batch = (
                batch.ids,
                &self.mask[..],
                batch.token_labels,
                batch.selected,
            );
            match pass {
                Pass::Step { step, lr_scale } => s.step_mlm(batch, step, lr_scale).map(Some),
                Pass::Micro(m) => s.accumulate_mlm(batch, m).map(|()| None),
            }
        } else {
            unreachable!("an encoder state holds a classifier or a masked-LM batch")
        }
    }
}

/// A device step's statistics as the loop takes them.
fn host_stats(s: DeviceStepStats) -> DeviceStats {
    DeviceStats {
        loss: s.loss,
        correct: s.correct as usize,
        count: s.count as usize,
        grad_norm: s.grad_norm,
        objective: s.objective,
    }
}

impl DeviceStep<Encoder> for CudaEncoder {
    fn describe(&self) -> String {
        let dev = self.session.device();
        format!("{} ({})", self.device, dev.info().name)
    }

    fn step(
        &mut self,
        st: &EncoderState,
        step: u64,
        lr_scale: f32,
        rank: Option<RankStep>,
    ) -> Result<DeviceStats, DeviceError> {
        if let Some(r) = rank {
            self.session.set_rank_step(r);
        }
        let s = self.pass(st, Pass::Step { step, lr_scale });
        match s.map_err(self.cuda())? {
            Some(s) => Ok(host_stats(s)),
            None => unreachable!("a whole step gives its statistics"),
        }
    }

    fn accumulate(&mut self, st: &EncoderState, micro: Micro) -> Result<(), DeviceError> {
        self.pass(st, Pass::Micro(micro)).map_err(self.cuda())?;
        Ok(())
    }

    fn apply_accumulated(
        &mut self,
        _step: u64,
        lr_scale: f32,
        rank: Option<RankStep>,
    ) -> Result<DeviceStats, DeviceError> {
        if let Some(r) = rank {
            self.session.set_rank_step(r);
        }
        let s = self.session.apply_accumulated(lr_scale);
        Ok(host_stats(s.map_err(self.cuda())?))
    }

    fn set_shape(&mut self, model: &Encoder, st: &EncoderState) -> Result<(), DeviceError> {
        let shape = (st.batch(), st.seq_len());
        self.session
            .reshape(model, shape, st.mlm_rows_per_seq())
            .map_err(self.cuda())
    }

    fn set_rank_schedule(
        &mut self,
        model: &Encoder,
        settings: Option<RankSettings>,
    ) -> Result<(), DeviceError> {
        let device = self.device;
        self.session
            .set_rank_schedule(model, settings)
            .map_err(|source| DeviceError::Cuda { device, source })
    }

    fn copy_to_host(
        &mut self,
        model: &mut Encoder,
        optimizer: &mut Optimizer,
    ) -> Result<(), DeviceError> {
        self.session.download_into(model).map_err(self.cuda())?;
        let (moments, t) = self.session.moments().map_err(self.cuda())?;
        let adam = match optimizer {
            Optimizer::AdamW(adam) => adam,
            Optimizer::GaLore(_) => return Err(self.not_yet_galore()),
        };
        // The arena holds the model's parameters in the model's order (`EncoderPlan::new`).
        for (i, (name, m, v)) in moments.into_iter().enumerate() {
            match (adam.m.get_mut(i), adam.v.get_mut(i)) {
                (Some(am), Some(av)) if am.len() == m.len() && av.len() == v.len() => {
                    am.copy_from_slice(&m);
                    av.copy_from_slice(&v);
                }
                _ => {
                    return Err(self.cuda()(CudaError::Plan(format!(
                        "the device's moments of `{name}` do not match the host optimiser's"
                    ))))
                }
            }
        }
        adam.t = t as u64;
        Ok(())
    }

    fn copy_gates_to_host(&mut self, model: &mut Encoder) -> Result<(), DeviceError> {
        self.session.download_gates_into(model).map_err(self.cuda())
    }

    fn copy_from_host(
        &mut self,
        model: &Encoder,
        optimizer: &Optimizer,
    ) -> Result<(), DeviceError> {
        let adam = match optimizer {
            Optimizer::AdamW(adam) => adam,
            Optimizer::GaLore(_) => return Err(self.not_yet_galore()),
        };
        let moments: Vec<Moments> = model
            .params()
            .iter()
            .zip(adam.m.iter().zip(&adam.v))
            .map(|(p, (m, v))| (p.name.clone(), m.clone(), v.clone()))
            .collect();
        let t = i32::try_from(adam.t).unwrap_or(i32::MAX);
        self.session.resume(model, &moments, t).map_err(self.cuda())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plain() -> RunShape {
        RunShape {
            galore: false,
            processes: 1,
            teacher: false,
        }
    }

    fn tiny(pre_ln: bool, head: comera_model::HeadKind) -> Encoder {
        let cfg = comera_model::EncoderConfig {
            vocab_size: 20,
            seq_len: 8,
            d_model: 8,
            heads: 2,
            ffn: 16,
            layers: 1,
            num_labels: 2,
            tt_linear: false,
            ttm_embedding: false,
            pre_ln,
            head,
            mlm_decoder: comera_model::config::MlmDecoderKind::Dense,
            ..comera_model::EncoderConfig::default()
        };
        Encoder::new(&cfg, 1).unwrap()
    }

    /// Evaluation and prediction on a GPU take every encoder: a classifier, post- or pre-LN,
    /// and a masked-LM model; a DLRM is refused by name (before any device is opened: this
    /// holds without a GPU); the CPU takes every model.
    #[test]
    fn check_inference_takes_every_encoder_and_names_a_dlrm() {
        use comera_model::HeadKind;
        let dev = DeviceSpec::Cuda(0);
        for pre_ln in [false, true] {
            for head in [HeadKind::Classifier, HeadKind::Mlm] {
                let model = tiny(pre_ln, head);
                assert!(
                    check_inference(dev, Some(&model)).is_ok(),
                    "{pre_ln} {head:?}"
                );
            }
        }
        let e = check_inference(dev, None).unwrap_err();
        assert!(matches!(e, DeviceError::NotYet { .. }), "{e:?}");
        let e = e.to_string();
        assert!(e.starts_with("device cuda:0: "), "{e}");
        assert!(e.contains("a DLRM"), "{e}");
        assert!(e.contains("--device cpu"), "says what to do: {e}");
        assert!(
            check_inference(DeviceSpec::Cpu, None).is_ok(),
            "the CPU: a DLRM"
        );
    }

    #[test]
    fn check_run_takes_a_plain_run_and_names_each_thing_it_refuses() {
        let dev = DeviceSpec::Cuda(1);
        assert!(check_run(dev, plain()).is_ok());
        for (shape, named) in [
            (
                RunShape {
                    galore: true,
                    ..plain()
                },
                "[galore]",
            ),
            (
                RunShape {
                    processes: 2,
                    ..plain()
                },
                "several processes",
            ),
            (
                RunShape {
                    teacher: true,
                    ..plain()
                },
                "[distill]",
            ),
        ] {
            let e = check_run(dev, shape).unwrap_err().to_string();
            assert!(e.starts_with("device cuda:1: "), "{e}");
            assert!(e.contains(named), "{named}: {e}");
            assert!(e.contains("--device cpu"), "says what to do: {e}");
        }
    }
}
