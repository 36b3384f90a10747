//! The rank schedule of CoMERA training (SPEC §3): the early stage's linear scalarisation, the
//! late stage's achievement scalarisation towards a target (L0, S0), and physical truncation of
//! pruned rank slices.
//!
//! Sizes are measured in units of the model's TT/TTM size at the start, S_ref (so Ŝn = Ŝ/S_ref
//! starts at 1 with all gates at 1); that makes γ and the ρ-terms independent of the model's
//! scale (the authors' "count-normalised" penalty). After the backward pass has left ∂L in the
//! gradients, [`RankController::apply`] turns them into the gradient of the stage's objective:
//!
//! - early:  L + γ·Ŝn + β·Σ‖G‖²                 → w_L = 1,           w_S = γ;
//! - late:   max{(L − L0)/L, (S − S0)/S} + ρ_L·L + ρ_S·Ŝn + β·Σ‖G‖², with ω1 = 1/L and
//!   ω2 = 1/S frozen at the current iterate and the active branch picked every step
//!   (a subgradient step):
//!   loss branch → w_L = 1/L + ρ_L, w_S = ρ_S;  size branch → w_L = ρ_L, w_S = 1/Sn + ρ_S
//!   (∂S is taken through its surrogate Ŝ).
//!
//! The gradient becomes w_L·∂L + w_S·∂Ŝn + 2β·G (G: every TT/TTM core).
//!
//! ## Where the schedule acts
//!
//! Everything the schedule does is a method of [`RankController`], in the order a step meets it:
//!
//! 1. [`RankController::attach`], once, when the stepper is built: freezes pruned gate entries
//!    in the optimiser (momentum cannot revive a pruned slice).
//! 2. [`RankController::apply`], in each step after the backward pass: the stage's objective.
//! 3. [`RankController::project`], in each step after the optimiser's update: `min_rank` and
//!    gate normalisation.
//! 4. [`RankController::after_step`], between steps: the switch to the late stage and the
//!    physical truncation of pruned slices (with the optimiser's moments cut to match),
//!    returned as [`RankEvent`]s that the training loop only records and reports.

use crate::optimizer::Optimizer;
use crate::SettingError;
use comera_layers::{Model, ParamKind, Retained};
use serde::{Deserialize, Serialize};

/// The late stage's S0 = this × S at the switch when the config gives neither `target_ratio`
/// nor `target_compression` (the authors' default).
pub const DEFAULT_TARGET_RATIO: f64 = 0.2;

/// The `[rank]` table of a run config.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RankConfig {
    /// Rank-adaptive training (size penalty, stages, truncation) for TT/TTM layers.
    pub enabled: bool,
    /// γ: weight of the size surrogate Ŝ/S_ref in the early stage.
    pub gamma: f64,
    /// β: weight of Σ‖G‖² over all TT/TTM cores (removes the scale ambiguity between cores
    /// and gates).
    pub beta: f64,
    /// Start the late stage after this many epochs (0: no switch by epochs).
    pub late_after_epochs: usize,
    /// Start it after this many steps (0: no switch by steps).
    pub late_after_steps: u64,
    /// Start it once this fraction of the run's steps is done (0: not by fraction; resolved
    /// into `late_after_steps` when the run's length is known, [`RankConfig::resolved`]).
    pub late_after_fraction: f64,
    /// Also start it once S changed by less than `plateau_tol` (relative) over
    /// `plateau_steps` early-stage steps (0: off).
    pub plateau_steps: u64,
    pub plateau_tol: f64,
    /// L0: the late stage's target loss.
    pub target_loss: f64,
    /// S0 = target_ratio × S at the switch ...
    pub target_ratio: Option<f64>,
    /// ... or S0 = (dense parameters of the TT/TTM layers) / target_compression (neither:
    /// target_ratio [`DEFAULT_TARGET_RATIO`]).
    pub target_compression: Option<f64>,
    /// ρ_L, ρ_S: the late stage's regularising terms ρ_L·L + ρ_S·Ŝn (authors: 0.1, 0.01).
    pub rho_loss: f64,
    pub rho_size: f64,
    /// Remove pruned rank slices physically every this many steps (0: only at epoch ends).
    pub truncate_every: u64,
    /// Multiplies the size term's gradient in both stages. Adam moves a gate by about
    /// lr·E[g]/rms(g), so when the size gradient dwarfs the loss gradient's noise every gate
    /// shrinks at the same rate whatever its importance (and a small model collapses); a
    /// smaller weight lets the loss gradient decide which slices go first.
    pub size_weight: f64,
    /// After every step, move each bond's scale from its gates into the neighbouring core
    /// (largest gate = 1; the function is unchanged), so pruning is relative within a bond.
    pub normalise_gates: bool,
    /// Every bond keeps at least this many active entries (0 lets a layer die: a dead TT
    /// linear layer outputs its bias, a dead TTM table zeros).
    pub min_rank: usize,
    /// Hold the gates (constants, as without the schedule) for this many steps: the cores
    /// first learn the task as a plain TT/TTM model, then the gates and the size terms act.
    /// Gates trained from the first step can push a fresh small model to the majority class
    /// before it has learnt anything (0: from the first step).
    pub gates_after_steps: u64,
    /// Hold the gates for this fraction of the run's steps (0: not by fraction; resolved into
    /// `gates_after_steps`, [`RankConfig::resolved`]).
    pub gates_after_fraction: f64,
    /// Only the TT/TTM layers whose names start with this take part: their size is the S of
    /// both stages (and of `target_compression`), and only their gates feel the size terms.
    /// `"encoder."` aims a compressed encoder's blocks at a target while its embedding table
    /// keeps its ranks (empty: every TT/TTM layer).
    pub layer_prefix: String,
}

impl Default for RankConfig {
    fn default() -> Self {
        RankConfig {
            enabled: true,
            gamma: 0.01,
            beta: 0.0,
            late_after_epochs: 0,
            late_after_steps: 0,
            late_after_fraction: 0.0,
            plateau_steps: 0,
            plateau_tol: 0.01,
            target_loss: 0.8,
            target_ratio: None,
            target_compression: None,
            rho_loss: 0.1,
            rho_size: 0.01,
            truncate_every: 100,
            min_rank: 1,
            size_weight: 1.0,
            normalise_gates: true,
            gates_after_steps: 0,
            gates_after_fraction: 0.0,
            layer_prefix: String::new(),
        }
    }
}

impl RankConfig {
    /// Checks the values; the error names the field.
    pub fn validate(&self) -> Result<(), SettingError> {
        let nonneg = [
            ("rank.gamma", self.gamma),
            ("rank.beta", self.beta),
            ("rank.plateau_tol", self.plateau_tol),
            ("rank.rho_loss", self.rho_loss),
            ("rank.rho_size", self.rho_size),
            ("rank.size_weight", self.size_weight),
        ];
        for (name, v) in nonneg {
            if !(v.is_finite() && v >= 0.0) {
                return Err(SettingError::new(
                    name,
                    format!("expected a finite number ≥ 0, got {v}"),
                ));
            }
        }
        if !(self.target_loss.is_finite() && self.target_loss >= 0.0) {
            return Err(SettingError::new(
                "rank.target_loss",
                format!("expected a finite number ≥ 0, got {}", self.target_loss),
            ));
        }
        if let Some(r) = self.target_ratio {
            if !(r > 0.0 && r <= 1.0) {
                return Err(SettingError::new(
                    "rank.target_ratio",
                    format!("expected a value in (0, 1], got {r}"),
                ));
            }
        }
        if let Some(c) = self.target_compression {
            if !(c.is_finite() && c >= 1.0) {
                return Err(SettingError::new(
                    "rank.target_compression",
                    format!("expected a value ≥ 1, got {c}"),
                ));
            }
        }
        for (name, fraction) in [
            ("rank.late_after_fraction", self.late_after_fraction),
            ("rank.gates_after_fraction", self.gates_after_fraction),
        ] {
            if !(0.0..1.0).contains(&fraction) {
                return Err(SettingError::new(
                    name,
                    format!(
                        "expected a fraction of the run's steps in [0, 1) (0: off), got {fraction}"
                    ),
                ));
            }
        }
        let switches = [
            self.late_after_fraction > 0.0,
            self.late_after_epochs > 0,
            self.late_after_steps > 0,
        ];
        if switches.iter().filter(|&&on| on).count() > 1 {
            return Err(SettingError::new(
                "rank.late_after_fraction",
                "give the switch once: late_after_fraction, late_after_epochs or late_after_steps (set the others to 0)",
            ));
        }
        if self.gates_after_fraction > 0.0 && self.gates_after_steps > 0 {
            return Err(SettingError::new(
                "rank.gates_after_fraction",
                "give the hold once: gates_after_fraction or gates_after_steps (set the other to 0)",
            ));
        }
        match (self.target_ratio, self.target_compression) {
            (Some(_), Some(_)) => Err(SettingError::new(
                "rank",
                "give either target_ratio or target_compression, not both",
            )),
            _ => Ok(()),
        }
    }

    /// Checks `layer_prefix` against a model: with the schedule on, it must name at least one
    /// of its TT/TTM layers.
    pub fn check_layers(&self, model: &dyn Model) -> Result<(), SettingError> {
        let mut names = Vec::new();
        model.visit_compressible(&mut |l| names.push(l.layer_name().to_string()));
        let prefix = self.layer_prefix.as_str();
        if self.enabled && !names.is_empty() && !names.iter().any(|n| n.starts_with(prefix)) {
            return Err(SettingError::new(
                "rank.layer_prefix",
                format!(
                    "no TT/TTM layer's name starts with `{prefix}` (the layers: {})",
                    names.join(", ")
                ),
            ));
        }
        Ok(())
    }

    fn has_late_stage(&self) -> bool {
        self.enabled && (self.switches_by_schedule() || self.plateau_steps > 0)
    }

    /// Whether the late stage starts at a set point (an epoch, a step or a fraction of the run).
    fn switches_by_schedule(&self) -> bool {
        self.late_after_epochs > 0 || self.late_after_steps > 0 || self.late_after_fraction > 0.0
    }

    /// Whether a setting is a fraction of the run, which [`RankConfig::resolved`] needs the
    /// run's length for.
    pub fn has_fractions(&self) -> bool {
        self.late_after_fraction > 0.0 || self.gates_after_fraction > 0.0
    }

    /// The schedule for a run of `total_steps` steps: the fractions turned into step counts
    /// (rounded to the nearest step; a switch after at least one step).
    pub fn resolved(&self, total_steps: u64) -> RankConfig {
        let at = |f: f64| (f * total_steps as f64).round() as u64;
        let mut out = self.clone();
        if out.late_after_fraction > 0.0 {
            out.late_after_steps = at(out.late_after_fraction).max(1);
            out.late_after_fraction = 0.0;
        }
        if out.gates_after_fraction > 0.0 {
            out.gates_after_steps = at(out.gates_after_fraction);
            out.gates_after_fraction = 0.0;
        }
        out
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    Early,
    Late,
}

/// Which term drove a step: the early objective, or the late stage's loss or size branch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Branch {
    Early,
    Loss,
    Size,
}

/// What one step's objective was made of.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Objective {
    /// The data loss L.
    pub loss: f64,
    /// S: exact surviving parameters of the TT/TTM layers.
    pub size: f64,
    /// Ŝ (unnormalised).
    pub size_l1: f64,
    pub branch: Branch,
    /// The weights the gradient was built with.
    pub w_loss: f64,
    pub w_size: f64,
}

/// One TT/TTM layer's ranks and size at a point of training.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerRanks {
    pub name: String,
    /// Active entries per inner bond.
    pub ranks: Vec<usize>,
    /// S of this layer.
    pub size: f64,
    pub dense: usize,
    pub dead: bool,
}

/// Per-layer ranks and sizes of a model now.
pub fn layer_ranks(model: &dyn Model) -> Vec<LayerRanks> {
    let mut out = Vec::new();
    model.visit_compressible(&mut |l| {
        let a = l.active_ranks();
        out.push(LayerRanks {
            name: l.layer_name().to_string(),
            ranks: a[1..a.len() - 1].to_vec(),
            size: l.size_l0(),
            dense: l.dense_params(),
            dead: l.is_dead(),
        })
    });
    out
}

/// (S, Ŝ, dense parameters) summed over a model's TT/TTM layers.
pub fn sizes(model: &dyn Model) -> (f64, f64, f64) {
    sizes_of(model, "")
}

/// [`sizes`] over the TT/TTM layers whose names start with `prefix`.
pub fn sizes_of(model: &dyn Model, prefix: &str) -> (f64, f64, f64) {
    let (mut s, mut s1, mut d) = (0.0, 0.0, 0.0);
    model.visit_compressible(&mut |l| {
        if l.layer_name().starts_with(prefix) {
            s += l.size_l0();
            s1 += l.size_l1();
            d += l.dense_params() as f64;
        }
    });
    (s, s1, d)
}

/// The rank schedule's state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankController {
    pub cfg: RankConfig,
    pub stage: Stage,
    /// S_ref: the TT/TTM size at the start (the unit of Ŝn).
    pub s_ref: f64,
    /// Dense parameters of the TT/TTM layers.
    pub dense_ref: f64,
    /// S0, set at the switch to the late stage.
    pub target_size: Option<f64>,
    /// The step at which the late stage began.
    pub switched_at: Option<u64>,
    /// Plateau detection: the step and S at the start of the current window.
    window: Option<(u64, f64)>,
}

impl RankController {
    pub fn new(cfg: &RankConfig, model: &dyn Model) -> RankController {
        let (s, _, d) = sizes_of(model, &cfg.layer_prefix);
        RankController {
            cfg: cfg.clone(),
            stage: Stage::Early,
            s_ref: s.max(1.0),
            dense_ref: d,
            target_size: None,
            switched_at: None,
            window: None,
        }
    }

    /// (S, Ŝ, dense parameters) of the layers the schedule acts on (`layer_prefix`).
    pub fn sizes(&self, model: &dyn Model) -> (f64, f64, f64) {
        sizes_of(model, &self.cfg.layer_prefix)
    }

    /// Whether the controller does anything (enabled and the model has TT/TTM layers).
    pub fn active(&self) -> bool {
        self.cfg.enabled && self.dense_ref > 0.0
    }

    /// Turns the data-loss gradient left by the backward pass into the gradient of the
    /// current stage's objective (module docs). `loss` is the batch's mean data loss.
    pub fn apply(&mut self, model: &mut dyn Model, loss: f64, step: u64) -> Objective {
        let (s, s1, _) = self.sizes(model);
        let mut obj = Objective {
            loss,
            size: s,
            size_l1: s1,
            branch: Branch::Early,
            w_loss: 1.0,
            w_size: 0.0,
        };
        if !self.active() || self.holds_gates(step) {
            // Without the rank schedule (or while `gates_after_steps` holds them) the model is
            // a plain TT/TTM model (as in the authors' code): the gates are constants (1 from
            // initialisation), so ∂/∂gate is dropped here, before clipping. They take no part
            // in the gradient norm and, with a zero gradient and zero moments, AdamW (or
            // GaLore's Adam) moves them by exactly 0, so no entry can drift to τ and silently
            // kill its slice.
            model.visit_params_mut(&mut |p| {
                if p.kind == ParamKind::RankGate {
                    p.grad.fill(0.0);
                }
            });
            return obj;
        }
        let c = &self.cfg;
        let (w_loss, w_size, branch) = match (self.stage, self.target_size) {
            (Stage::Late, Some(s0)) => {
                let l = loss.max(1e-12);
                let sz = s.max(1.0);
                let (f_loss, f_size) = ((loss - c.target_loss) / l, (s - s0) / sz);
                if f_loss >= f_size {
                    (1.0 / l + c.rho_loss, c.rho_size, Branch::Loss)
                } else {
                    (c.rho_loss, self.s_ref / sz + c.rho_size, Branch::Size)
                }
            }
            _ => (1.0, c.gamma, Branch::Early),
        };
        (obj.w_loss, obj.w_size, obj.branch) = (w_loss, w_size, branch);
        let beta2 = (2.0 * c.beta) as f32;
        let wl = w_loss as f32;
        if wl != 1.0 || beta2 != 0.0 {
            model.visit_params_mut(&mut |p| {
                let b = if p.kind == ParamKind::TtCore {
                    beta2
                } else {
                    0.0
                };
                if wl != 1.0 {
                    p.grad.iter_mut().for_each(|g| *g *= wl);
                }
                if b != 0.0 {
                    for (g, &v) in p.grad.iter_mut().zip(&p.value) {
                        *g += b * v;
                    }
                }
            });
        }
        let ws = (c.size_weight * w_size / self.s_ref) as f32;
        if ws != 0.0 {
            let prefix = &c.layer_prefix;
            model.visit_compressible_mut(&mut |l| {
                if l.layer_name().starts_with(prefix.as_str()) {
                    l.accumulate_size_l1_grad(ws)
                }
            });
        }
        obj
    }

    /// After the optimiser's step: keeps `min_rank` active entries on every bond, then (with
    /// `normalise_gates`) moves each bond's scale into its core.
    pub fn project(&self, model: &mut dyn Model) {
        if !self.active() {
            return;
        }
        let (k, norm) = (self.cfg.min_rank, self.cfg.normalise_gates);
        model.visit_compressible_mut(&mut |l| {
            if k > 0 {
                l.keep_min_rank(k);
            }
            if norm {
                l.normalise_gates();
            }
        });
    }

    /// Once, when the stepper is built: with an active schedule, gate entries at or below the
    /// model's gate threshold τ are frozen by the optimiser (pruned slices are not updated and
    /// their moments are zeroed, so momentum cannot revive them).
    pub fn attach(&self, optimizer: &mut Optimizer, gate_threshold: f32) {
        if self.active() {
            optimizer.freeze_gates_at(gate_threshold);
        }
    }

    /// Between steps, after step `step` (1-based count of steps done) of epoch `epoch`
    /// (1-based; `epoch_end` when it was the epoch's last): the switch to the late stage when
    /// due, then the truncation of pruned slices when due (with `optimizer`'s moments cut to
    /// match; GaLore's projected state cannot be cut, so a GaLore run never truncates).
    pub fn after_step(
        &mut self,
        model: &mut dyn Model,
        optimizer: &mut Optimizer,
        step: u64,
        epoch: usize,
        epoch_end: bool,
    ) -> Vec<RankEvent> {
        let mut events = Vec::new();
        if self.switch_if_due(model, step, epoch, epoch_end) {
            let (size, _, _) = self.sizes(model);
            events.push(RankEvent::LateStage {
                size,
                target_size: self.target_size.unwrap_or(0.0),
                ranks: layer_ranks(model),
            });
        }
        if optimizer.supports_truncation() && self.truncation_due(step, epoch_end) {
            let before = stored_ranks(model);
            if !truncate_with(model, optimizer).is_empty() {
                let after = stored_ranks(model);
                let layers = before
                    .into_iter()
                    .zip(after)
                    .filter(|(b, a)| b.1 != a.1)
                    .map(|((name, before), (_, after))| TruncatedLayer {
                        name,
                        before,
                        after,
                    })
                    .collect();
                events.push(RankEvent::Truncated {
                    layers,
                    ranks: layer_ranks(model),
                });
            }
        }
        events
    }

    /// After step `step` (1-based count of steps done) of epoch `epoch` (1-based; `epoch_end`
    /// when it was the epoch's last): switches to the late stage when due. Returns whether it
    /// switched now.
    pub fn switch_if_due(
        &mut self,
        model: &dyn Model,
        step: u64,
        epoch: usize,
        epoch_end: bool,
    ) -> bool {
        if self.stage != Stage::Early || !self.cfg.has_late_stage() || !self.active() {
            return false;
        }
        let by_epochs =
            epoch_end && self.cfg.late_after_epochs > 0 && epoch >= self.cfg.late_after_epochs;
        let by_steps = self.cfg.late_after_steps > 0 && step >= self.cfg.late_after_steps;
        let mut by_plateau = false;
        if self.cfg.plateau_steps > 0 {
            let (s, _, _) = self.sizes(model);
            match self.window {
                None => self.window = Some((step, s)),
                Some((start, s_start)) if step - start >= self.cfg.plateau_steps => {
                    by_plateau = (s - s_start).abs() <= self.cfg.plateau_tol * s_start.max(1.0);
                    self.window = Some((step, s));
                }
                _ => {}
            }
        }
        if !(by_epochs || by_steps || by_plateau) {
            return false;
        }
        let (s, _, _) = self.sizes(model);
        self.target_size = Some(match (self.cfg.target_ratio, self.cfg.target_compression) {
            (_, Some(c)) => self.dense_ref / c,
            (Some(r), None) => r * s,
            (None, None) => DEFAULT_TARGET_RATIO * s,
        });
        self.stage = Stage::Late;
        self.switched_at = Some(step);
        true
    }

    /// Whether [`RankController::after_step`] after step `step` (the same arguments) may
    /// read the model (the sizes for the switch or the plateau window) or truncate it. A run
    /// whose parameters live on a device copies them to the host first, and only then.
    pub fn reads_model_after(&self, step: u64, epoch_end: bool) -> bool {
        if !self.active() {
            return false;
        }
        let c = &self.cfg;
        let may_switch = self.stage == Stage::Early
            && c.has_late_stage()
            && (epoch_end
                || (c.late_after_steps > 0 && step >= c.late_after_steps)
                || (c.plateau_steps > 0
                    && self
                        .window
                        .is_none_or(|(start, _)| step.saturating_sub(start) >= c.plateau_steps)));
        may_switch || self.truncation_due(step, epoch_end)
    }

    /// The late stage's target S0 once it has begun (None in the early stage).
    pub fn late_target(&self) -> Option<f64> {
        match self.stage {
            Stage::Late => self.target_size,
            Stage::Early => None,
        }
    }

    /// Whether the gates are held at step `step` (0-based; `gates_after_steps`).
    pub fn holds_gates(&self, step: u64) -> bool {
        step < self.cfg.gates_after_steps
    }

    /// Whether a truncation is due after `step` steps (or at an epoch's end).
    pub fn truncation_due(&self, step: u64, epoch_end: bool) -> bool {
        self.active()
            && (epoch_end
                || (self.cfg.truncate_every > 0 && step.is_multiple_of(self.cfg.truncate_every)))
    }
}

/// What the rank schedule did between two steps ([`RankController::after_step`]).
#[derive(Clone, Debug, PartialEq)]
pub enum RankEvent {
    /// The switch to the late stage: S at the switch, the target S0 it set, and the ranks.
    LateStage {
        size: f64,
        target_size: f64,
        ranks: Vec<LayerRanks>,
    },
    /// Pruned slices removed: the layers whose stored ranks changed, and every layer's ranks
    /// after the cut.
    Truncated {
        layers: Vec<TruncatedLayer>,
        ranks: Vec<LayerRanks>,
    },
}

/// One layer's stored inner ranks before and after a truncation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TruncatedLayer {
    pub name: String,
    pub before: Vec<usize>,
    pub after: Vec<usize>,
}

/// Each TT/TTM layer's name and stored (physical) inner ranks.
fn stored_ranks(model: &dyn Model) -> Vec<(String, Vec<usize>)> {
    let mut out = Vec::new();
    model.visit_compressible(&mut |l| {
        let r = l.ranks();
        out.push((l.layer_name().to_string(), r[1..r.len() - 1].to_vec()));
    });
    out
}

/// Removes pruned rank slices from every TT/TTM layer and cuts `optimizer`'s moments to match;
/// returns the changed parameters.
pub fn truncate_with(model: &mut dyn Model, optimizer: &mut Optimizer) -> Vec<Retained> {
    let changed = truncate(model);
    if !changed.is_empty() {
        optimizer.retain(&changed, model);
    }
    changed
}

/// Removes pruned rank slices from every TT/TTM layer; returns the changed parameters (for the
/// optimiser's moments).
pub fn truncate(model: &mut dyn Model) -> Vec<Retained> {
    let mut changed = Vec::new();
    model.visit_compressible_mut(&mut |l| changed.extend(l.truncate()));
    changed
}

/// A Markdown table of per-layer ranks and sizes at several points (`points`: a title and the
/// layers), each cell reading `first → … → last`, with a total row of the TT/TTM sizes, and
/// below it the one labelled compression figure of the TT/TTM layers (their dense equivalent
/// over their size) at each point.
pub fn rank_table(points: &[(&str, &[LayerRanks])]) -> String {
    let titles: Vec<&str> = points.iter().map(|p| p.0).collect();
    let arrow = " → ";
    let mut s = format!(
        "| layer | dense params | ranks: {t} | size: {t} |\n|---|---|---|---|\n",
        t = titles.join(arrow)
    );
    let Some((_, first)) = points.first() else {
        return s;
    };
    let fmt = |r: &[usize]| {
        r.iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join("-")
    };
    let mut totals = vec![0.0; points.len()];
    for (i, layer) in first.iter().enumerate() {
        let (mut ranks, mut sizes) = (Vec::new(), Vec::new());
        for (j, (_, layers)) in points.iter().enumerate() {
            match layers.get(i) {
                Some(l) => {
                    totals[j] += l.size;
                    let dead = if l.dead { " (dead)" } else { "" };
                    ranks.push(format!("{}{dead}", fmt(&l.ranks)));
                    sizes.push(format!("{:.0}", l.size));
                }
                None => {
                    ranks.push("–".into());
                    sizes.push("–".into());
                }
            }
        }
        s.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            layer.name,
            layer.dense,
            ranks.join(arrow),
            sizes.join(arrow)
        ));
    }
    let dense: usize = first.iter().map(|l| l.dense).sum();
    let join =
        |f: &dyn Fn(f64) -> String| totals.iter().map(|&t| f(t)).collect::<Vec<_>>().join(arrow);
    s.push_str(&format!(
        "| **TT/TTM total** | {dense} | | {} |\n\nTT/TTM layers ({}): compression vs their dense equivalent {}.\n",
        join(&|t| format!("{t:.0}")),
        titles.join(arrow),
        join(&|t| format!("{:.1}×", dense as f64 / t.max(1.0)))
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(name: &str, ranks: &[usize], size: f64) -> LayerRanks {
        LayerRanks {
            name: name.into(),
            ranks: ranks.to_vec(),
            size,
            dense: 1000,
            dead: false,
        }
    }

    /// A device run copies its parameters to the host only where `after_step` reads the model:
    /// the truncation steps, the switch's step, the plateau windows' ends, epoch ends; after
    /// the switch only the truncations.
    #[test]
    fn the_model_is_read_after_exactly_the_steps_that_need_it() {
        let mut c = RankController {
            cfg: RankConfig {
                truncate_every: 4,
                late_after_steps: 6,
                ..RankConfig::default()
            },
            stage: Stage::Early,
            s_ref: 100.0,
            dense_ref: 1000.0,
            target_size: None,
            switched_at: None,
            window: None,
        };
        let reads = |c: &RankController| {
            (1..=10)
                .filter(|&s| c.reads_model_after(s, false))
                .collect::<Vec<_>>()
        };
        assert_eq!(reads(&c), vec![4, 6, 7, 8, 9, 10]);
        assert!(c.reads_model_after(3, true), "an epoch's end");
        c.stage = Stage::Late;
        c.target_size = Some(20.0);
        assert_eq!(reads(&c), vec![4, 8]);
        assert_eq!(c.late_target(), Some(20.0));
        c.stage = Stage::Early;
        c.cfg.late_after_steps = 0;
        c.cfg.plateau_steps = 3;
        assert_eq!(reads(&c), (1..=10).collect::<Vec<_>>(), "no window yet");
        c.window = Some((2, 50.0));
        assert_eq!(reads(&c), vec![4, 5, 6, 7, 8, 9, 10]);
        c.cfg.enabled = false;
        assert_eq!(reads(&c), Vec::<u64>::new());
        assert_eq!(c.late_target(), None);
    }

    #[test]
    fn rank_table_reads_start_to_end_and_labels_its_one_compression_figure() {
        let start = [layer("a", &[4, 4], 200.0), layer("b", &[3], 300.0)];
        let end = [layer("a", &[2, 1], 50.0), layer("b", &[1], 50.0)];
        let t = rank_table(&[("start", &start), ("end", &end)]);
        assert!(
            t.contains("| ranks: start → end | size: start → end |"),
            "{t}"
        );
        assert!(t.contains("| a | 1000 | 4-4 → 2-1 | 200 → 50 |"), "{t}");
        assert!(
            t.contains("| **TT/TTM total** | 2000 | | 500 → 100 |"),
            "{t}"
        );
        assert!(
            t.contains(
                "TT/TTM layers (start → end): compression vs their dense equivalent 4.0× → 20.0×."
            ),
            "{t}"
        );
        // No compression figure in a ranks column.
        for line in t.lines().filter(|l| l.starts_with("| ")) {
            let ranks_cell = line.split('|').nth(3).unwrap();
            assert!(!ranks_cell.contains('×'), "{line}");
        }
    }
}
