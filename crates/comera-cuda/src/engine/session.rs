//! The seam comera-train calls (`comera_train::device`; see docs/gpu.md): one object that
//! owns the device, the plan and its captured step, takes host batches and returns host
//! statistics, and moves parameters and AdamW moments between the device and the CPU model by
//! name (checkpoints, evaluation, export, resuming on either device). It also computes a
//! classifier's logits batch by batch ([`EncoderSession::logits`]), and a masked-LM model's
//! loss and logits ([`EncoderSession::mlm_eval`], [`EncoderSession::mlm_logits`]), for
//! `comera eval` and `comera predict` on the GPU, in a session opened for that alone
//! ([`EncoderSession::for_inference`]) or between training steps.

use super::arena::Which;
use super::encoder::{DeviceStepStats, EncoderPlan, StepConfig};
use super::rank::{RankSettings, RankStep};
use crate::device::Device;
use crate::error::CudaError;
use comera_model::Encoder;
use cudarc::driver::CudaGraph;

/// AdamW's state of one parameter: its name, first and second moments.
pub type Moments = (String, Vec<f32>, Vec<f32>);

/// A classifier encoder training on one GPU: [`EncoderPlan`] plus its CUDA graph, captured
/// after the first step (which runs its launches one by one: `run_recorded`) and replayed
/// from the second on.
pub struct EncoderSession {
    // Field order is drop order: the graphs, then the plan's buffers, then the device.
    graph: Option<CudaGraph>,
    /// The evaluation pass ([`EncoderPlan::record_eval_forward`]), captured after the first
    /// [`EncoderSession::logits`] and replayed from the second on: a second graph, because the pass is
    /// another sequence of launches (no dropout, no loss, no backward, no update) on the same
    /// fixed buffers. An evaluation or a prediction runs it once per batch, many times over the
    /// same shapes, and a forward of the paper model is a few hundred small launches whose
    /// queuing costs more than their work at evaluation batch sizes; one capture (about one
    /// eager pass of host time) pays for itself from the second batch on.
    eval_graph: Option<CudaGraph>,
    /// An accumulated step's two graphs ([`EncoderSession::accumulate`]): one micro-batch
    /// (the same launches for each), and the update after the last
    /// ([`EncoderSession::apply_accumulated`]).
    micro_graph: Option<CudaGraph>,
    apply_graph: Option<CudaGraph>,
    /// The plan; None only after planning again failed (the old plan is released first, so
    /// that a larger one can take its memory), when every call is an error.
    plan: Option<EncoderPlan>,
    dev: Device,
    /// Optimiser steps taken (AdamW's t; the next step is t + 1).
    t_adam: i32,
    /// Opened by [`EncoderSession::for_inference`]: [`EncoderSession::step`] is refused.
    inference_only: bool,
    /// B zero labels: the plan's label buffer is loaded with them for an evaluation pass
    /// (which reads no label).
    no_labels: Vec<usize>,
    /// Replay the captured graphs (true) or queue the launches one by one (false: the same
    /// launches, for comparison and debugging).
    pub use_graph: bool,
    /// What the plan was built with, to plan the step again at new ranks
    /// ([`EncoderSession::resume`] after a truncation).
    seed: u64,
    opt: StepConfig,
    /// The rank schedule's inputs for the next step ([`EncoderSession::set_rank_step`]).
    rank_step: RankStep,
    /// Micro-batches accumulated into the open step (0: none open).
    micro_batches: usize,
}

/// Where a micro-batch sits in an accumulated step ([`EncoderSession::accumulate`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Micro {
    /// 0-based within its step: micro-batch 0 starts the step (the gradients zeroed).
    pub index: usize,
    /// Its dropout step, the CPU's `step · micro-batches + index`.
    pub dropout_step: u64,
}

impl EncoderSession {
    /// Opens `cuda:ordinal` and plans `enc`'s step for batches of `b` × `t` tokens (dropout
    /// seeded from `seed`, as `Encoder::new(cfg, seed)`); parameters are uploaded from `enc`.
    pub fn new(
        ordinal: usize,
        enc: &Encoder,
        seed: u64,
        b: usize,
        t: usize,
        opt: StepConfig,
    ) -> Result<EncoderSession, CudaError> {
        let dev = Device::open(ordinal)?;
        let plan = EncoderPlan::new(&dev, enc, seed, b, t, opt.clone())?;
        Ok(EncoderSession {
            seed,
            opt,
            rank_step: RankStep::EARLY,
            graph: None,
            eval_graph: None,
            micro_graph: None,
            apply_graph: None,
            micro_batches: 0,
            plan: Some(plan),
            dev,
            t_adam: 0,
            inference_only: false,
            no_labels: vec![0; b],
            use_graph: true,
        })
    }

    /// Opens `cuda:ordinal` for inference only: `enc`'s parameters uploaded, batches of `b` ×
    /// `t` tokens (dropout off, so no seed): a classifier's logits by
    /// [`EncoderSession::logits`], a masked-LM model's loss by [`EncoderSession::mlm_eval`]
    /// and its logits by [`EncoderSession::mlm_logits`], on at most `mlm_rows_per_seq`
    /// predicted positions a sequence (0: the CPU's default, 15% of T; ignored for a
    /// classifier). [`EncoderSession::step`] is refused. The plan holds the parameters without
    /// gradients or moments, and without the backward's shared scratch or a TTM table's slab
    /// gradients ([`StepConfig::forward_only`]); each block still keeps its own activations
    /// and each layer its backward workspace.
    pub fn for_inference(
        ordinal: usize,
        enc: &Encoder,
        b: usize,
        t: usize,
        mlm_rows_per_seq: usize,
    ) -> Result<EncoderSession, CudaError> {
        let opt = StepConfig {
            mlm_rows_per_seq,
            forward_only: true,
            ..StepConfig::paper()
        };
        let mut s = EncoderSession::new(ordinal, enc, 0, b, t, opt)?;
        s.inference_only = true;
        Ok(s)
    }

    /// Sequences per batch (B) and tokens per sequence (T) of the plan.
    pub fn shape(&self) -> (usize, usize) {
        self.plan.as_ref().map_or((0, 0), |p| (p.b, p.t))
    }

    /// The classifier's logits (B × C, row-major, C = [`EncoderPlan::classes`]) of one batch
    /// (B × T ids, types, mask; mask 1 = real token): the forward with dropout off on the
    /// device's current parameters, the CPU's `Encoder::forward(st, false, _)` then
    /// `st.logits()`. A batch of fewer sequences is the caller's to pad (the plan's shape is
    /// fixed). Captured as a graph on the first call when `use_graph` (see `eval_graph`).
    pub fn logits(
        &mut self,
        (ids, types, mask): (&[u32], &[u32], &[u32]),
    ) -> Result<Vec<f32>, CudaError> {
        plan_mut(&mut self.plan)?.load(&self.dev, ids, types, mask, &self.no_labels)?;
        self.run_eval()?;
        self.plan()?.logits(&self.dev)
    }

    /// A masked-LM model's evaluation of one batch (B × T masked ids and mask, each token's
    /// label or `IGNORE_INDEX`, the predicted positions ascending): the forward with dropout
    /// off and the cross-entropy over the labelled positions, as the CPU's
    /// `Encoder::forward(st, false, _)` after `st.load_mlm`. Returns the mean loss, the
    /// correct count and the counted positions. Captured as a graph on the first call when
    /// `use_graph` (the pass of [`EncoderSession::logits`], which the session shares).
    pub fn mlm_eval(
        &mut self,
        (ids, mask, token_labels, selected): (&[u32], &[u32], &[i32], &[u32]),
    ) -> Result<(f64, f64, f64), CudaError> {
        plan_mut(&mut self.plan)?.load_mlm(&self.dev, ids, mask, token_labels, selected)?;
        self.run_eval()?;
        self.plan()?.loss_stats(&self.dev)
    }

    /// A masked-LM model's logits at the predicted positions of one batch (B × T ids and
    /// mask, the positions ascending): R × V′ rows, row-major, R = the head's rows
    /// ([`EncoderPlan::head_rows`]) of which the first `selected.len()` are the positions' (a
    /// TT decoder's padding columns past the vocabulary hold −∞).
    pub fn mlm_logits(
        &mut self,
        (ids, mask, selected): (&[u32], &[u32], &[u32]),
    ) -> Result<Vec<f32>, CudaError> {
        // The pass computes a loss too; label 0 at the positions keeps it defined, unread.
        let mut labels = vec![comera_layers::loss::IGNORE_INDEX; ids.len()];
        for &p in selected {
            if let Some(l) = labels.get_mut(p as usize) {
                *l = 0;
            }
        }
        plan_mut(&mut self.plan)?.load_mlm(&self.dev, ids, mask, &labels, selected)?;
        self.run_eval()?;
        self.plan()?.logits(&self.dev)
    }

    /// The evaluation pass on the batch loaded: replayed from its graph, or launched.
    fn run_eval(&mut self) -> Result<(), CudaError> {
        let plan = self.plan.as_ref().ok_or_else(lost_plan)?;
        let graph = self.use_graph.then_some(&mut self.eval_graph);
        run_recorded(&self.dev, graph, "replaying the evaluation graph", |d| {
            plan.record_eval_forward(d)
        })
    }

    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// The plan (an error after planning again failed, see [`EncoderSession::resume`]).
    pub fn plan(&self) -> Result<&EncoderPlan, CudaError> {
        self.plan.as_ref().ok_or_else(lost_plan)
    }

    /// Runs the rank schedule `settings` (None: off) from the next step on. When they differ
    /// from the plan's, the step is planned again for `enc` (the model the session trains,
    /// for its structure) with the device's parameters, moments and t carried over through the
    /// host, and captured again on the next step.
    pub fn set_rank_schedule(
        &mut self,
        enc: &Encoder,
        settings: Option<RankSettings>,
    ) -> Result<(), CudaError> {
        if settings == self.opt.rank {
            return Ok(());
        }
        let tau = self.plan()?.threshold();
        let opt = StepConfig {
            freeze_gates_at: settings.as_ref().map(|_| tau),
            rank: settings,
            ..self.opt.clone()
        };
        self.replan_carrying(enc, self.shape(), opt)
    }

    /// Batches of `b` × `t` tokens from the next step on, a masked-LM head predicting at most
    /// `mlm_rows_per_seq` positions a sequence (a run's next phase). When that differs from
    /// the plan's shape, the step is planned again for `enc` (the model the session trains,
    /// for its structure) with the device's parameters, moments and t carried over through the
    /// host, and captured again on the next step.
    pub fn reshape(
        &mut self,
        enc: &Encoder,
        (b, t): (usize, usize),
        mlm_rows_per_seq: usize,
    ) -> Result<(), CudaError> {
        let opt = StepConfig {
            mlm_rows_per_seq,
            ..self.opt.clone()
        };
        if (b, t) == self.shape() && opt.mlm_rows(b, t) == self.opt.mlm_rows(b, t) {
            return Ok(());
        }
        // Refused before the old plan goes: a shape the model cannot take, a plan that cannot fit.
        self.fits_in_place_of_the_plan(&super::PlanMemory::of(enc, b, t, &opt)?, (b, t))?;
        self.replan_carrying(enc, (b, t), opt)
    }

    /// Plans the step again for `enc` (the model the session trains, for its structure) at
    /// batch `b` × `t` with settings `opt`, the device's parameters, moments and t carried over
    /// through the host. If the new plan fails, the session goes back to the plan it had, with
    /// that state (the caller may still copy it out, a checkpoint), and returns the error.
    fn replan_carrying(
        &mut self,
        enc: &Encoder,
        (b, t): (usize, usize),
        opt: StepConfig,
    ) -> Result<(), CudaError> {
        let mut host = enc.clone();
        self.download_into(&mut host)?;
        let (moments, t_adam) = self.moments()?;
        let (old_shape, old_opt) = (self.shape(), std::mem::replace(&mut self.opt, opt));
        if let Err(e) = self.replan_at(&host, (b, t)) {
            self.opt = old_opt;
            self.replan_at(&host, old_shape)?;
            self.set_moments(&moments, t_adam)?;
            return Err(e);
        }
        self.set_moments(&moments, t_adam)
    }

    /// Checks, before a run starts, that the step planned at each of `shapes` (batch,
    /// tokens, masked-LM rows per sequence: a run's later phases) will fit on the device once
    /// this session's own plan is released for it ([`EncoderSession::reshape`] releases the
    /// old plan first): [`CudaError::OutOfMemory`] naming the first that would not.
    pub fn check_shapes_fit(
        &self,
        enc: &Encoder,
        shapes: &[(usize, usize, usize)],
    ) -> Result<(), CudaError> {
        for &(b, t, mlm_rows_per_seq) in shapes {
            let opt = StepConfig {
                mlm_rows_per_seq,
                ..self.opt.clone()
            };
            // Also refuses a shape the model cannot take (`EncoderPlan::check_shape`).
            self.fits_in_place_of_the_plan(&super::PlanMemory::of(enc, b, t, &opt)?, (b, t))?;
        }
        Ok(())
    }

    /// Whether a plan of `need` fits in the device's free memory with this session's plan
    /// released: [`CudaError::OutOfMemory`] naming it at batch `b` × `t` if not.
    fn fits_in_place_of_the_plan(
        &self,
        need: &super::PlanMemory,
        (b, t): (usize, usize),
    ) -> Result<(), CudaError> {
        let (free, total) = self.dev.memory()?;
        let available = free + self.plan()?.device_bytes();
        crate::device::check_fits(
            self.dev.info().ordinal,
            &need.describe(b, t),
            need.total(),
            available,
            total,
        )
    }

    /// The rank schedule's inputs (hold, stage and target) for the steps from now on: the
    /// host's `RankController` decides them between steps. Ignored without the schedule.
    pub fn set_rank_step(&mut self, r: RankStep) {
        self.rank_step = r;
    }

    /// One training step on a classifier batch (B × T ids, types, mask; B labels) at dropout
    /// step `step` and learning-rate scale `lr_scale`; returns the loss and gradient norm (the
    /// one host wait of a step).
    pub fn step(
        &mut self,
        (ids, types, mask, labels): (&[u32], &[u32], &[u32], &[usize]),
        step: u64,
        lr_scale: f32,
    ) -> Result<DeviceStepStats, CudaError> {
        self.whole_step()?;
        plan_mut(&mut self.plan)?.load(&self.dev, ids, types, mask, labels)?;
        self.run_step(step, lr_scale)
    }

    /// One training step on a masked-LM batch (B × T masked ids and mask, each token's label
    /// or `IGNORE_INDEX`, the predicted positions ascending), as [`EncoderSession::step`].
    pub fn step_mlm(
        &mut self,
        (ids, mask, token_labels, selected): (&[u32], &[u32], &[i32], &[u32]),
        step: u64,
        lr_scale: f32,
    ) -> Result<DeviceStepStats, CudaError> {
        self.whole_step()?;
        plan_mut(&mut self.plan)?.load_mlm(&self.dev, ids, mask, token_labels, selected)?;
        self.run_step(step, lr_scale)
    }

    /// One micro-batch of an accumulated step (`train.accumulate_steps`: several batches, one
    /// update; the CPU's `Stepper::step_accumulated`), a classifier batch as in
    /// [`EncoderSession::step`]: its forward and backward, the gradients kept as the mean over
    /// every counted row of the step's micro-batches so far. `micro.index` 0 starts the step;
    /// the others follow in order. [`EncoderSession::apply_accumulated`] ends it. Nothing is
    /// read back.
    pub fn accumulate(
        &mut self,
        (ids, types, mask, labels): (&[u32], &[u32], &[u32], &[usize]),
        micro: Micro,
    ) -> Result<(), CudaError> {
        self.next_micro(micro)?;
        plan_mut(&mut self.plan)?.load(&self.dev, ids, types, mask, labels)?;
        self.run_micro(micro)
    }

    /// [`EncoderSession::accumulate`] of a masked-LM batch (as [`EncoderSession::step_mlm`]
    /// takes it).
    pub fn accumulate_mlm(
        &mut self,
        (ids, mask, token_labels, selected): (&[u32], &[u32], &[i32], &[u32]),
        micro: Micro,
    ) -> Result<(), CudaError> {
        self.next_micro(micro)?;
        plan_mut(&mut self.plan)?.load_mlm(&self.dev, ids, mask, token_labels, selected)?;
        self.run_micro(micro)
    }

    /// Ends the accumulated step: the rank objective (with the schedule), clipping, AdamW at
    /// learning-rate scale `lr_scale`, the gates' projection; returns the step's loss (the
    /// mean over every counted row of its micro-batches), correct count, counted rows and
    /// gradient norm, as [`EncoderSession::step`] does (the one host wait of the step).
    pub fn apply_accumulated(&mut self, lr_scale: f32) -> Result<DeviceStepStats, CudaError> {
        self.trainable()?;
        if self.micro_batches == 0 {
            return Err(CudaError::Plan(
                "an accumulated step's update without a micro-batch (EncoderSession::accumulate first)"
                    .into(),
            ));
        }
        self.micro_batches = 0;
        let t_adam = self.t_adam + 1;
        plan_mut(&mut self.plan)?.set_update_scalars(&self.dev, t_adam, lr_scale)?;
        if self.plan()?.has_rank_schedule() {
            plan_mut(&mut self.plan)?.set_rank_step(&self.dev, self.rank_step)?;
        }
        let plan = self.plan.as_ref().ok_or_else(lost_plan)?;
        let graph = self.use_graph.then_some(&mut self.apply_graph);
        run_recorded(&self.dev, graph, "replaying the update graph", |d| {
            plan.record_apply(d)
        })?;
        self.t_adam = t_adam;
        self.plan()?.stats(&self.dev)
    }

    /// Checks that `micro` comes next: index 0 starts a step (dropping one left open, as the
    /// CPU drops a step whose data ended inside it), any other continues the open step.
    fn next_micro(&self, micro: Micro) -> Result<(), CudaError> {
        self.trainable()?;
        if micro.index != 0 && micro.index != self.micro_batches {
            return Err(CudaError::Plan(format!(
                "micro-batch {} of an accumulated step where {} comes next",
                micro.index, self.micro_batches
            )));
        }
        Ok(())
    }

    /// The micro-batch loaded: the step begun first if it is the step's first, then its
    /// captured graph (or the launches).
    fn run_micro(&mut self, micro: Micro) -> Result<(), CudaError> {
        let p = plan_mut(&mut self.plan)?;
        if micro.index == 0 {
            p.begin_accumulation(&self.dev)?;
        }
        p.set_dropout_step(&self.dev, micro.dropout_step)?;
        self.micro_batches = micro.index;
        let plan = self.plan.as_ref().ok_or_else(lost_plan)?;
        let graph = self.use_graph.then_some(&mut self.micro_graph);
        run_recorded(&self.dev, graph, "replaying the micro-batch graph", |d| {
            plan.record_micro(d)
        })?;
        self.micro_batches += 1;
        Ok(())
    }

    /// Refuses a whole step while an accumulated one is open (its micro-batches would be
    /// lost), and what [`EncoderSession::trainable`] refuses.
    fn whole_step(&self) -> Result<(), CudaError> {
        self.trainable()?;
        if self.micro_batches > 0 {
            return Err(CudaError::Plan(format!(
                "a whole step while an accumulated one is open ({} micro-batches; \
                 EncoderSession::apply_accumulated ends it)",
                self.micro_batches
            )));
        }
        Ok(())
    }

    /// Refuses a training step in a session opened for inference.
    fn trainable(&self) -> Result<(), CudaError> {
        if self.inference_only {
            return Err(CudaError::Plan(
                "a training step in a session opened for inference only (EncoderSession::for_inference)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// The step on the batch loaded: its scalars, the captured graph (or the launches), the
    /// statistics.
    fn run_step(&mut self, step: u64, lr_scale: f32) -> Result<DeviceStepStats, CudaError> {
        plan_mut(&mut self.plan)?.set_step(&self.dev, step, self.t_adam + 1, lr_scale)?;
        if self.plan()?.has_rank_schedule() {
            plan_mut(&mut self.plan)?.set_rank_step(&self.dev, self.rank_step)?;
        }
        let plan = self.plan.as_ref().ok_or_else(lost_plan)?;
        let graph = self.use_graph.then_some(&mut self.graph);
        run_recorded(&self.dev, graph, "replaying the step graph", |d| {
            plan.record_step(d)
        })?;
        self.t_adam += 1;
        self.plan()?.stats(&self.dev)
    }

    /// Copies the device's parameters into `enc` (same names and shapes): for a checkpoint,
    /// an evaluation on the CPU, an export.
    pub fn download_into(&self, enc: &mut Encoder) -> Result<(), CudaError> {
        self.plan()?
            .arena
            .download(&self.dev, false, |f| enc.visit_params_mut(f))
    }

    /// The rank gates' values into `enc` (same names and shapes), nothing else: the host's
    /// view of the active ranks between steps (one small transfer). Without the rank schedule
    /// it does nothing (the gates are constants).
    pub fn download_gates_into(&self, enc: &mut Encoder) -> Result<(), CudaError> {
        let plan = self.plan()?;
        let Some(rank) = plan.rank_plan() else {
            return Ok(());
        };
        let gates = rank.gates(&self.dev, &plan.arena)?;
        let mut by_name: std::collections::HashMap<&str, Vec<f32>> = gates.into_iter().collect();
        let mut bad = None;
        enc.visit_params_mut(&mut |p| {
            if let Some(v) = by_name.remove(p.name.as_str()) {
                if v.len() == p.value.len() {
                    p.value.copy_from_slice(&v);
                } else {
                    bad.get_or_insert_with(|| p.name.clone());
                }
            }
        });
        match (bad, by_name.keys().next()) {
            (Some(name), _) => Err(CudaError::Plan(format!(
                "gate `{name}`: the host model's shape differs from the device plan's"
            ))),
            (None, Some(name)) => Err(CudaError::Plan(format!(
                "gate `{name}` of the device plan is not in the host model"
            ))),
            (None, None) => Ok(()),
        }
    }

    /// AdamW's moments by parameter name (for a checkpoint's optimiser state), and t.
    pub fn moments(&self) -> Result<(Vec<Moments>, i32), CudaError> {
        let a = &self.plan()?.arena;
        let (m, v) = (
            a.download_flat(&self.dev, Which::M)?,
            a.download_flat(&self.dev, Which::V)?,
        );
        let rows = a
            .tensors
            .iter()
            .map(|t| {
                let r = t.offset..t.offset + t.len;
                (t.name.clone(), m[r.clone()].to_vec(), v[r].to_vec())
            })
            .collect();
        Ok((rows, self.t_adam))
    }

    /// Resumes from host state: parameters from `enc`, then the moments by name and AdamW's t
    /// (a run started on the CPU, or on another GPU, or the host's truncation of pruned rank
    /// slices). When `enc`'s ranks differ from the plan's, the step is planned again at the
    /// new ranks and captured again on the next step (the old plan's buffers are freed once
    /// the new one is built; a truncation only shrinks them).
    pub fn resume(
        &mut self,
        enc: &Encoder,
        moments: &[Moments],
        t_adam: i32,
    ) -> Result<(), CudaError> {
        let params = enc.params();
        if self.plan()?.arena.reshaped(&params) {
            self.replan(enc)?;
        } else {
            plan_mut(&mut self.plan)?.arena.upload(&self.dev, &params)?;
        }
        self.set_moments(moments, t_adam)
    }

    /// Plans the step again for `enc` (its ranks, its parameters uploaded, zero moments) with
    /// the session's settings; the captured graphs, which name the old plan's buffers, go.
    fn replan(&mut self, enc: &Encoder) -> Result<(), CudaError> {
        let (b, t) = self.shape();
        self.replan_at(enc, (b, t))
    }

    /// [`EncoderSession::replan`] for batches of `b` × `t` tokens.
    fn replan_at(&mut self, enc: &Encoder, (b, t): (usize, usize)) -> Result<(), CudaError> {
        self.graph = None;
        self.eval_graph = None;
        self.micro_graph = None;
        self.apply_graph = None;
        self.micro_batches = 0;
        // The old plan's buffers go first: a larger plan (a later phase's longer sequences)
        // may need their memory. cudarc frees them into the device's memory pool
        // asynchronously; a synchronise hands them back before the new plan's memory check.
        self.plan = None;
        self.dev
            .stream()
            .synchronize()
            .map_err(crate::error::driver("cuStreamSynchronize"))?;
        self.plan = Some(EncoderPlan::new(
            &self.dev,
            enc,
            self.seed,
            b,
            t,
            self.opt.clone(),
        )?);
        self.no_labels = vec![0; b];
        Ok(())
    }

    /// AdamW's moments by name and its step count t.
    fn set_moments(&mut self, moments: &[Moments], t_adam: i32) -> Result<(), CudaError> {
        for (name, m, v) in moments {
            plan_mut(&mut self.plan)?
                .arena
                .upload_moments(&self.dev, name, m, v)?;
        }
        self.t_adam = t_adam;
        Ok(())
    }
}

/// Runs what `record` queues on `dev`'s stream: with a `graph` slot, replayed from the graph
/// captured there (`what` names the replay in an error); without, launched one by one (the
/// same launches).
///
/// The first call with an empty slot launches one by one, waits for the stream, and only then
/// captures the graph for the calls after it (capturing runs nothing): by then every kernel
/// and cuBLAS module the launches use has run once, so none is loaded for the first time
/// inside the capture (CUDA loads modules lazily; PyTorch's graph recipe warms up the same
/// way).
fn run_recorded(
    dev: &Device,
    graph: Option<&mut Option<CudaGraph>>,
    what: &'static str,
    record: impl Fn(&Device) -> Result<(), CudaError>,
) -> Result<(), CudaError> {
    let Some(slot) = graph else {
        return record(dev);
    };
    match slot {
        Some(g) => g.launch().map_err(crate::error::driver(what)),
        None => {
            record(dev)?;
            dev.stream()
                .synchronize()
                .map_err(crate::error::driver("cuStreamSynchronize"))?;
            *slot = Some(dev.capture(&record)?);
            Ok(())
        }
    }
}

/// The session's plan to change (a free function over the field, so that the session's other
/// fields stay borrowable beside it).
fn plan_mut(plan: &mut Option<EncoderPlan>) -> Result<&mut EncoderPlan, CudaError> {
    plan.as_mut().ok_or_else(lost_plan)
}

/// The error of a session whose plan is gone (planning it again failed).
fn lost_plan() -> CudaError {
    CudaError::Plan(
        "the session has no step plan: planning it again (after a truncation or for a new \
         phase) failed, as the error then said"
            .into(),
    )
}
