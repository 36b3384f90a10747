//! The one training step every trainer and benchmark runs ([`Stepper::step`]):
//!
//!   zero_grad → forward (loss) → finite check → backward → rank-objective gradient
//!   → clipping → optimiser update → rank projection (min rank, gate normalisation)
//!
//! and, between steps when the schedule asks, physical truncation of pruned rank slices with
//! the optimiser's moments cut to match ([`Stepper::truncate`]). Pruned gate entries are frozen
//! by the optimiser whenever the rank schedule is active, so momentum cannot revive a pruned
//! slice. Without an active schedule the gates are constants: their gradient is dropped by the
//! rank objective ([`RankController::apply`]), so they never move and stay out of clipping.

use crate::optimizer::Optimizer;
use crate::rank::{self, LayerRanks, Objective, RankController};
use crate::Schedule;
use comera_layers::{Model, Retained, StepStats, Trainable};

/// A step that could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("batch: {0}")]
    Input(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error(
        "training diverged: {what} is {value} at step {step} (lower the learning rates in [optim])"
    )]
    Diverged {
        what: &'static str,
        value: f64,
        step: u64,
    },
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
    /// Wall time of the step's three phases: zero-grad + forward; backward + rank objective;
    /// clipping + optimiser + rank projection (what benchmarks report).
    pub phases: [std::time::Duration; 3],
}

/// Everything a step needs besides the model and its batch state.
pub struct Stepper {
    pub optimizer: Optimizer,
    pub rank: RankController,
    pub schedule: Schedule,
    /// Clip the global gradient norm to this (0: no clipping).
    pub clip_norm: f32,
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
        }
    }

    /// A stepper driving `rank` (a fresh [`RankController`], or a resumed one). With an active
    /// rank schedule, gate entries at or below the model's gate threshold τ are frozen by the
    /// optimiser.
    pub fn new(
        mut optimizer: Optimizer,
        rank: RankController,
        schedule: Schedule,
        clip_norm: f32,
        gate_threshold: f32,
    ) -> Stepper {
        if rank.active() {
            optimizer.freeze_gates_at(gate_threshold);
        }
        Stepper {
            optimizer,
            rank,
            schedule,
            clip_norm,
        }
    }

    /// Whether truncation can run (an active schedule and an optimiser that follows it).
    pub fn truncating(&self) -> bool {
        self.rank.active() && self.optimizer.supports_truncation()
    }

    /// One training step on the batch loaded in `st`; `step` is the 0-based step index (it
    /// seeds dropout and picks the learning rate).
    pub fn step<M: Trainable>(
        &mut self,
        model: &mut M,
        st: &mut M::State,
        step: u64,
    ) -> Result<StepReport, StepError> {
        let t0 = std::time::Instant::now();
        model.zero_grad();
        let stats = model
            .forward(st, true, step)
            .map_err(|e| StepError::Input(Box::new(e)))?;
        if !stats.loss.is_finite() {
            return Err(StepError::Diverged {
                what: "loss",
                value: stats.loss,
                step,
            });
        }
        let t1 = std::time::Instant::now();
        model.backward(st);
        let objective = self.rank.apply(model, stats.loss);
        let t2 = std::time::Instant::now();
        let (grad_scale, grad_norm) =
            crate::clip_scale(self.clip_norm, |f| model.visit_params_mut(f));
        if !grad_norm.is_finite() {
            return Err(StepError::Diverged {
                what: "gradient norm",
                value: grad_norm,
                step,
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
            phases: [t1 - t0, t2 - t1, t3 - t2],
        })
    }

    /// After step `step` (1-based count of steps done) of epoch `epoch` (1-based): switches
    /// the rank schedule to its late stage when due (returns the ranks at the switch), then
    /// truncates pruned slices when due (returns whether anything changed).
    pub fn after_step(
        &mut self,
        model: &mut dyn Model,
        step: u64,
        epoch: usize,
        epoch_end: bool,
    ) -> (Option<Vec<LayerRanks>>, bool) {
        let switched = self
            .rank
            .after_step(model, step, epoch, epoch_end)
            .then(|| rank::layer_ranks(model));
        let truncated = self.truncating()
            && self.rank.truncation_due(step, epoch_end)
            && !self.truncate(model).is_empty();
        (switched, truncated)
    }

    /// Removes pruned rank slices from every TT/TTM layer and cuts the optimiser's moments to
    /// match; returns the changed parameters.
    pub fn truncate(&mut self, model: &mut dyn Model) -> Vec<Retained> {
        let changed = rank::truncate(model);
        if !changed.is_empty() {
            self.optimizer.retain(&changed, model);
        }
        changed
    }
}
