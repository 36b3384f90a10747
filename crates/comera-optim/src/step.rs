//! The one training step every trainer and benchmark runs ([`Stepper::step`]):
//!
//!   zero_grad → forward (loss) → [data-parallel: global loss] → finite check → backward
//!   → [data-parallel: gradient all-reduce] → rank-objective gradient → clipping
//!   → optimiser update → rank projection (min rank, gate normalisation)
//!
//! and, between steps, the rank schedule's stage switch and physical truncation of pruned rank
//! slices with the optimiser's moments cut to match ([`Stepper::after_step`], which is
//! [`RankController::after_step`]). Pruned gate entries are frozen by the optimiser whenever
//! the rank schedule is active ([`RankController::attach`]), so momentum cannot revive a pruned
//! slice. Without an active schedule the gates are constants: their gradient is dropped by the
//! rank objective ([`RankController::apply`]), so they never move and stay out of clipping.

use crate::collective::DataParallel;
use crate::optimizer::Optimizer;
use crate::rank::{self, Objective, RankController, RankEvent};
use crate::Schedule;
use comera_layers::{LossTerms, Model, Retained, StepStats, Trainable};

/// An error of the data a step reads.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Multiplies every parameter's gradient by `s`.
fn scale_grads(model: &mut dyn Model, s: f32) {
    model.visit_params_mut(&mut |p| p.grad.iter_mut().for_each(|g| *g *= s));
}

/// A step that could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// The data ended inside an accumulated step (its micro-batches are dropped).
    #[error("the data ended inside an accumulated step")]
    EndOfData,
    #[error("batch: {0}")]
    Input(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("training diverged: {what} is {value} at step {step} ({hint})")]
    Diverged {
        what: &'static str,
        value: f64,
        step: u64,
        /// What to change: at the first step nothing has been updated yet, so the learning
        /// rates are not the cause.
        hint: &'static str,
    },
}

impl StepError {
    /// `what` (the loss, the gradient norm) is `value`, not finite, at step `step`: with the
    /// hint of what to change (a device's step reports it as the CPU's does).
    pub fn diverged(what: &'static str, value: f64, step: u64) -> StepError {
        StepError::Diverged {
            what,
            value,
            step,
            hint: diverged_hint(step),
        }
    }
}

/// What to change when step `step` is not finite.
fn diverged_hint(step: u64) -> &'static str {
    if step == 0 {
        "at the first step, before any update: the initial weights or the inputs are out of range; check model.init_std (or dlrm.embedding_std) and the data"
    } else {
        "lower the learning rates in [optim]"
    }
}

/// What one step did.
#[derive(Clone, Copy, Debug)]
pub struct StepReport {
    pub stats: StepStats,
    /// The rank objective's terms and branch (weights 1/0 when the schedule is off).
    pub objective: Objective,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// The schedule's learning-rate scale at this step.
    pub lr_scale: f32,
    /// Wall time of the step's three phases: forward (every micro-batch's); zero-grad,
    /// backward, reductions and rank objective; clipping + optimiser + rank projection (what
    /// benchmarks report).
    pub phases: [std::time::Duration; 3],
    /// Of which in collectives (data-parallel runs; zero otherwise).
    pub comm: std::time::Duration,
    /// The time the pool's other workers found no work during the step, summed over them
    /// (zero with one thread, or when they are not kept polling: see `awake.rs`). With p
    /// threads and a step of wall time W, the other workers computed (p − 1)·W − idle.
    /// Counted process-wide, so it is the step's own only while no other step runs.
    pub pool_idle: std::time::Duration,
}

/// Everything a step needs besides the model and its batch state.
pub struct Stepper {
    pub optimizer: Optimizer,
    pub rank: RankController,
    pub schedule: Schedule,
    /// Clip the global gradient norm to this (0: no clipping).
    pub clip_norm: f32,
    /// Several processes, each on its shard of the batch (None: this process alone).
    pub data_parallel: Option<DataParallel>,
    /// Clipping's per-parameter sums of squares (scratch kept between steps).
    pub param_sums: crate::ParamSums,
}

impl Stepper {
    /// A plain stepper: `optimizer` at a constant learning rate, no rank schedule, no
    /// clipping (benchmarks and tests).
    pub fn plain(optimizer: Optimizer, model: &dyn Model) -> Stepper {
        let off = crate::rank::RankConfig {
            enabled: false,
            ..Default::default()
        };
        let schedule = Schedule {
            warmup: 0,
            total: u64::MAX,
            decay: crate::Decay::Constant,
        };
        Stepper {
            optimizer,
            rank: RankController::new(&off, model),
            schedule,
            clip_norm: 0.0,
            data_parallel: None,
            param_sums: Default::default(),
        }
    }

    /// A stepper driving `rank` (a fresh [`RankController`], or a resumed one), attached to the
    /// optimiser ([`RankController::attach`]: pruned gates frozen).
    pub fn new(
        mut optimizer: Optimizer,
        rank: RankController,
        schedule: Schedule,
        clip_norm: f32,
        gate_threshold: f32,
    ) -> Stepper {
        rank.attach(&mut optimizer, gate_threshold);
        Stepper {
            optimizer,
            rank,
            schedule,
            clip_norm,
            data_parallel: None,
            param_sums: Default::default(),
        }
    }

    /// Time spent in collectives since the start (zero for a single process).
    pub fn comm_time(&self) -> std::time::Duration {
        self.data_parallel
            .as_ref()
            .map_or(std::time::Duration::ZERO, |dp| dp.comm_time)
    }

    /// One training step on the batch loaded in `st`; `step` is the 0-based step index (it
    /// seeds dropout and picks the learning rate).
    pub fn step<M: Trainable>(
        &mut self,
        model: &mut M,
        st: &mut M::State,
        step: u64,
    ) -> Result<StepReport, StepError> {
        self.step_accumulated(model, st, step, 1, &mut |_| Ok(false))
    }

    /// One training step over `micro` batches (gradient accumulation): the first is loaded in
    /// `st`, `load_next` loads each following one (false: the data ended inside the step,
    /// [`StepError::EndOfData`], and nothing is updated). Micro-batch i's forward seeds its
    /// dropout with `step·micro + i`.
    ///
    /// The update uses the gradient of the mean loss over all the micro-batches' predictions,
    /// as one batch of them all would (up to the order of float sums). Micro-batch i
    /// contributes the gradient g_i of its mean loss over n_i predictions; the layers' backward
    /// adds into the gradient buffers, so the running mean G_i = (N_{i−1}·G_{i−1} + n_i·g_i)/N_i
    /// (N_i = n_1 + … + n_i) is kept by scaling the buffers by N_{i−1}/n_i before that backward
    /// and by n_i/N_i after it.
    ///
    /// In a single process, the pool's other workers are kept polling for the step's parallel
    /// work for its whole length (see `awake.rs`).
    pub fn step_accumulated<M: Trainable>(
        &mut self,
        model: &mut M,
        st: &mut M::State,
        step: u64,
        micro: usize,
        load_next: &mut dyn FnMut(&mut M::State) -> Result<bool, BoxError>,
    ) -> Result<StepReport, StepError> {
        // Not with several processes: they may share this machine's cores, and a poller would
        // spin on a core another process computes on.
        let keep_awake = self.data_parallel.is_none();
        let idle0 = crate::awake::pool_idle();
        let mut r = crate::awake::with_workers_awake(keep_awake, || {
            self.step_body(model, st, step, micro, load_next)
        })?;
        r.pool_idle = crate::awake::pool_idle().saturating_sub(idle0);
        Ok(r)
    }

    /// [`Stepper::step_accumulated`]'s work: forward and backward of each micro-batch, the
    /// reductions across processes, the rank objective, clipping, the optimiser and the rank
    /// projection.
    fn step_body<M: Trainable>(
        &mut self,
        model: &mut M,
        st: &mut M::State,
        step: u64,
        micro: usize,
        load_next: &mut dyn FnMut(&mut M::State) -> Result<bool, BoxError>,
    ) -> Result<StepReport, StepError> {
        let t0 = std::time::Instant::now();
        let comm0 = self.comm_time();
        let mut forward = std::time::Duration::ZERO;
        model.zero_grad();
        let (mut loss_sum, mut correct, mut count) = (0.0f64, 0usize, 0usize);
        let mut terms: Option<LossTerms> = None;
        for i in 0..micro.max(1) {
            if i > 0 && !load_next(st).map_err(StepError::Input)? {
                return Err(StepError::EndOfData);
            }
            let tf = std::time::Instant::now();
            let local = model
                .forward(st, true, step * micro.max(1) as u64 + i as u64)
                .map_err(|e| StepError::Input(Box::new(e)))?;
            forward += tf.elapsed();
            let n = local.count;
            if n == 0 {
                // Nothing to predict in this micro-batch (an MLM batch without labels).
                continue;
            }
            if !local.loss.is_finite() && self.data_parallel.is_none() {
                return Err(StepError::Diverged {
                    what: "loss",
                    value: local.loss,
                    step,
                    hint: diverged_hint(step),
                });
            }
            if count > 0 {
                scale_grads(model, count as f32 / n as f32);
            }
            model.backward(st);
            if count > 0 {
                scale_grads(model, n as f32 / (count + n) as f32);
            }
            loss_sum += local.loss * n as f64;
            if let Some(t) = &local.terms {
                terms
                    .get_or_insert_with(Default::default)
                    .add_scaled(t, n as f64);
            }
            correct += local.correct;
            count += n;
        }
        let per_prediction = 1.0 / count.max(1) as f64;
        let local = StepStats {
            loss: loss_sum * per_prediction,
            correct,
            count,
            terms: terms.map(|t| {
                let mut mean = LossTerms::default();
                mean.add_scaled(&t, per_prediction);
                mean
            }),
        };
        // Data-parallel: the global batch's loss (every process takes the same decisions from
        // it), then the gradients reduced with this process's share of it; both before the
        // rank objective, whose gradient is added once, on the reduced gradient.
        let (stats, share) = match &mut self.data_parallel {
            Some(dp) => dp.reduce_stats(local),
            None => (local, 1.0),
        };
        if !stats.loss.is_finite() {
            return Err(StepError::Diverged {
                what: "loss",
                value: stats.loss,
                step,
                hint: diverged_hint(step),
            });
        }
        if let Some(dp) = &mut self.data_parallel {
            dp.reduce_grads(model, share);
        }
        let objective = self.rank.apply(model, stats.loss, step);
        let t2 = std::time::Instant::now();
        let (grad_scale, grad_norm) =
            crate::clip_scale_par(self.clip_norm, model, &mut self.param_sums);
        if !grad_norm.is_finite() {
            return Err(StepError::Diverged {
                what: "gradient norm",
                value: grad_norm,
                step,
                hint: diverged_hint(step),
            });
        }
        let lr_scale = self.schedule.scale(step);
        self.optimizer.step(lr_scale, grad_scale, model);
        self.rank.project(model);
        let t3 = std::time::Instant::now();
        Ok(StepReport {
            stats,
            objective,
            grad_norm,
            lr_scale,
            phases: [forward, (t2 - t0).saturating_sub(forward), t3 - t2],
            comm: self.comm_time() - comm0,
            pool_idle: std::time::Duration::ZERO, // set by the caller, around the pollers
        })
    }

    /// Between steps: the rank schedule's stage switch and truncation
    /// ([`RankController::after_step`]).
    pub fn after_step(
        &mut self,
        model: &mut dyn Model,
        step: u64,
        epoch: usize,
        epoch_end: bool,
    ) -> Vec<RankEvent> {
        self.rank
            .after_step(model, &mut self.optimizer, step, epoch, epoch_end)
    }

    /// Removes pruned rank slices from every TT/TTM layer now and cuts the optimiser's moments
    /// to match; returns the changed parameters ([`rank::truncate_with`]).
    pub fn truncate(&mut self, model: &mut dyn Model) -> Vec<Retained> {
        rank::truncate_with(model, &mut self.optimizer)
    }
}
