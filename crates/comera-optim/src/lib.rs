//! Optimisers over a model's parameters, visited in a fixed order without allocation, and the
//! training step that drives them.
//!
//! In this file:
//! - [`AdamW`] ([`AdamWConfig`]): Adam with decoupled weight decay and one learning rate per
//!   parameter group (TT cores, rank gates, everything else; SPEC §3);
//! - [`Schedule`]: linear warm-up, then constant, linear or cosine decay ([`Decay`]);
//! - [`clip_scale`]: the factor that brings the global gradient norm under a limit
//!   ([`clip_scale_par`]: the same over a model's parallel visit).
//!
//! Modules:
//! - [`galore`]: GaLore (low-rank projected Adam for dense matrices);
//! - [`optimizer`]: [`Optimizer`], AdamW or GaLore behind one type with checkpoint state;
//! - [`rank`]: the rank schedule of CoMERA (SPEC §3): stages, objective, truncation;
//! - [`step`]: [`Stepper::step`], the one training step of every trainer and benchmark;
//! - [`collective`]: data-parallel steps over several processes (the gradient all-reduce);
//! - `awake` (private; [`with_workers_awake`] for benchmarks that time a step's parts): keeps
//!   the thread pool's other workers spinning through a step, so its many short parallel
//!   sections do not each pay for waking them.
//!
//! Models expose `visit_params_mut(&mut dyn FnMut(&mut Param))`; the optimiser keeps its
//! moments in the same order.

mod awake;
pub mod collective;
pub mod galore;
pub mod optimizer;
pub mod rank;
pub mod step;
pub use collective::{Collective, DataParallel};
pub use galore::{GaLore, GaLoreBytes, GaLoreConfig};
pub use optimizer::{OptState, Optimizer};
pub use rank::{RankConfig, RankController};
pub use step::{StepError, StepReport, Stepper};

/// Runs `f` with the pool's other workers kept polling for its parallel work, as they are
/// through a training step (`Stepper::step`): for a benchmark that times parts of a step on
/// their own under the same conditions. Just runs `f` off a pool worker or with one thread.
pub fn with_workers_awake<R>(f: impl FnOnce() -> R) -> R {
    awake::with_workers_awake(true, f)
}

use comera_layers::{Model, Param, ParamKind, Retained};
use rayon::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// A setting out of its range: the field (`optim.lr_cores`, `rank.gamma`, …) and what was
/// expected, as the config validation reports it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct SettingError {
    pub field: &'static str,
    pub reason: String,
}

impl SettingError {
    pub fn new(field: &'static str, reason: impl Into<String>) -> SettingError {
        SettingError {
            field,
            reason: reason.into(),
        }
    }
}

/// (weights, gradients, first moments, second moments) of one chunk, as zipped iterators give them.
type Chunks<'a> = (((&'a mut [f32], &'a [f32]), &'a mut [f32]), &'a mut [f32]);

// Parameters of at least two CHUNKs are updated in parallel chunks: the element-wise passes'
// chunk (16,384 floats), so that the paper model's 57,600-float middle cores of its attention
// TT layers (1.38 M of its 2.16 M parameters) are split over the threads too (at 1 << 15 they
// ran on one thread). Every element is updated on its own, so the split never changes a result.
use comera_layers::elementwise::CHUNK;
use serde::{Deserialize, Serialize};

/// AdamW hyper-parameters (the `[optim]` table of a run config).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    /// Learning rate of TT/TTM cores.
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
    pub lr_cores: f32,
    /// Learning rate of rank gates.
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
    pub lr_gates: f32,
    /// Learning rate of every other parameter (dense weights, biases, LayerNorm, embeddings).
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
    pub lr_other: f32,
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
    pub beta1: f32,
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
    pub beta2: f32,
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
    pub eps: f32,
    /// Decoupled weight decay (not applied to gates, biases or LayerNorm).
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
    pub weight_decay: f32,
    /// Clip the global gradient norm to this (0 = off).
    #[serde(serialize_with = "comera_layers::config_float::shortest_f32")]
    pub clip_norm: f32,
}

impl Default for AdamWConfig {
    /// The authors' transformer settings (SPEC §3): no weight decay, 1e-4 / 1e-3 / 5e-5.
    fn default() -> Self {
        AdamWConfig {
            lr_cores: 1e-4,
            lr_gates: 1e-3,
            lr_other: 5e-5,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            clip_norm: 1.0,
        }
    }
}

impl AdamWConfig {
    /// Checks the values; the error names the field.
    pub fn validate(&self) -> Result<(), SettingError> {
        let checks = [
            (
                "optim.lr_cores",
                self.lr_cores >= 0.0 && self.lr_cores.is_finite(),
            ),
            (
                "optim.lr_gates",
                self.lr_gates >= 0.0 && self.lr_gates.is_finite(),
            ),
            (
                "optim.lr_other",
                self.lr_other >= 0.0 && self.lr_other.is_finite(),
            ),
            ("optim.beta1", (0.0..1.0).contains(&self.beta1)),
            ("optim.beta2", (0.0..1.0).contains(&self.beta2)),
            ("optim.eps", self.eps > 0.0 && self.eps.is_finite()),
            (
                "optim.weight_decay",
                self.weight_decay >= 0.0 && self.weight_decay.is_finite(),
            ),
            (
                "optim.clip_norm",
                self.clip_norm >= 0.0 && self.clip_norm.is_finite(),
            ),
        ];
        match checks.iter().find(|(_, ok)| !ok) {
            Some((f, _)) => Err(SettingError::new(
                f,
                "out of range (learning rates, eps, decay and clip ≥ 0, betas in [0, 1))",
            )),
            None => Ok(()),
        }
    }

    fn lr(&self, kind: ParamKind) -> f32 {
        match kind {
            ParamKind::TtCore => self.lr_cores,
            ParamKind::RankGate => self.lr_gates,
            ParamKind::Other => self.lr_other,
        }
    }
}

/// AdamW state: first and second moments per parameter, in visiting order.
#[derive(Clone, Debug)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    /// Steps taken.
    pub t: u64,
    pub m: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    /// Rank-gate entries at or below this value are pruned: they are not updated and their
    /// moments are zeroed, so momentum cannot revive a pruned slice (`None`: no freezing).
    pub freeze_gates_at: Option<f32>,
    /// Which parameters a parallel step has reached ([`AdamW::step_par`]).
    claims: Claims,
}

impl AdamW {
    /// Moments sized for the parameters `visit` walks over.
    pub fn new(cfg: AdamWConfig, visit: impl FnOnce(&mut dyn FnMut(&mut Param))) -> AdamW {
        let (mut m, mut v) = (Vec::new(), Vec::new());
        visit(&mut |p: &mut Param| {
            m.push(vec![0.0; p.len()]);
            v.push(vec![0.0; p.len()]);
        });
        AdamW {
            cfg,
            t: 0,
            m,
            v,
            freeze_gates_at: None,
            claims: Claims::default(),
        }
    }

    /// Bytes of optimiser state.
    pub fn bytes(&self) -> usize {
        4 * self.m.iter().chain(&self.v).map(Vec::len).sum::<usize>()
    }

    /// One update of every parameter with learning rates scaled by `lr_scale` (the schedule)
    /// and gradients scaled by `grad_scale` (clipping). Allocation-free.
    pub fn step(
        &mut self,
        lr_scale: f32,
        grad_scale: f32,
        visit: impl FnOnce(&mut dyn FnMut(&mut Param)),
    ) {
        self.t += 1;
        let update = Update::new(
            &self.cfg,
            self.t,
            self.freeze_gates_at,
            lr_scale,
            grad_scale,
        );
        let (ms, vs) = (&mut self.m, &mut self.v);
        let mut i = 0;
        visit(&mut |p: &mut Param| {
            update.param(p, &mut ms[i], &mut vs[i]);
            i += 1;
        });
        assert_eq!(
            i,
            self.m.len(),
            "optimiser state covers {} parameters, the model has {i}",
            self.m.len()
        );
    }

    /// [`AdamW::step`] on `model`'s parameters through its parallel visit
    /// ([`Model::visit_params_par`]): small parameters (the paper model's hundreds of TT cores
    /// of 360 to 14,400 floats) are then updated on several threads at once instead of one
    /// after the other on one. Each parameter's update is the same as in `step`, so are the
    /// bits. Allocation-free once the claims are sized.
    pub fn step_par(&mut self, lr_scale: f32, grad_scale: f32, model: &mut dyn Model) {
        self.t += 1;
        let update = Update::new(
            &self.cfg,
            self.t,
            self.freeze_gates_at,
            lr_scale,
            grad_scale,
        );
        let n = self.m.len();
        self.claims.reset(n);
        let moments = SharedMoments {
            m: self.m.as_mut_ptr(),
            v: self.v.as_mut_ptr(),
        };
        let (claims, moments) = (&self.claims, &moments);
        model.visit_params_par(&|i, p| {
            assert!(
                claims.claim(i),
                "parameter {i} visited twice, or beyond the optimiser state's {n}"
            );
            // SAFETY: `claim` returned true, so i < n (the vectors' length, unchanged while
            // this borrow of `self` lasts) and no other call of this closure in this visit got
            // index i: this is the only reference to m[i] and v[i].
            let (m, v) = unsafe { (&mut *moments.m.add(i), &mut *moments.v.add(i)) };
            update.param(p, m, v);
        });
        let visited = self.claims.count();
        assert_eq!(
            visited, n,
            "optimiser state covers {n} parameters, the model has {visited}"
        );
    }
}

/// One step's AdamW update of any parameter (GaLore's plain parameters take it too).
pub(crate) struct Update<'a> {
    cfg: &'a AdamWConfig,
    bc1: f32,
    bc2: f32,
    lr_scale: f32,
    grad_scale: f32,
    freeze_gates_at: Option<f32>,
}

impl Update<'_> {
    /// The update of step `t` (1 for the first).
    pub(crate) fn new(
        cfg: &AdamWConfig,
        t: u64,
        freeze_gates_at: Option<f32>,
        lr_scale: f32,
        grad_scale: f32,
    ) -> Update<'_> {
        let t = t.min(i32::MAX as u64) as i32;
        Update {
            cfg,
            bc1: 1.0 - cfg.beta1.powi(t),
            bc2: 1.0 - cfg.beta2.powi(t),
            lr_scale,
            grad_scale,
            freeze_gates_at,
        }
    }

    /// Updates `p` with its moments `m` and `v`: large parameters in parallel chunks.
    pub(crate) fn param(&self, p: &mut Param, m: &mut [f32], v: &mut [f32]) {
        let c = self.cfg;
        let lr = c.lr(p.kind) * self.lr_scale;
        let decay = if p.kind == ParamKind::RankGate || p.shape.len() < 2 {
            0.0
        } else {
            c.weight_decay
        };
        assert_eq!(
            m.len(),
            p.len(),
            "optimiser state does not match parameter {}",
            p.name
        );
        // Element-wise, so chunks can run on any thread with identical results.
        let k = kernels::Adam {
            beta1: c.beta1,
            beta2: c.beta2,
            bc1: self.bc1,
            bc2: self.bc2,
            eps: c.eps,
            lr,
            decay,
            grad_scale: self.grad_scale,
        };
        let update = |(((w, g), m), v): Chunks<'_>| kernels::adam(&k, w, g, m, v);
        if let (ParamKind::RankGate, Some(tau)) = (p.kind, self.freeze_gates_at) {
            // Gates are short: one pass, pruned entries frozen with zeroed moments.
            for (((w, &g), m), v) in p
                .value
                .iter_mut()
                .zip(&p.grad)
                .zip(m.iter_mut())
                .zip(v.iter_mut())
            {
                if *w <= tau {
                    (*m, *v) = (0.0, 0.0);
                } else {
                    update((
                        (
                            (std::slice::from_mut(w), std::slice::from_ref(&g)),
                            std::slice::from_mut(m),
                        ),
                        std::slice::from_mut(v),
                    ));
                }
            }
        } else if p.len() >= 2 * CHUNK {
            comera_tensor::for_each(
                p.value
                    .par_chunks_mut(CHUNK)
                    .zip(p.grad.par_chunks(CHUNK))
                    .zip(m.par_chunks_mut(CHUNK))
                    .zip(v.par_chunks_mut(CHUNK)),
                update,
            );
        } else {
            update((((&mut p.value[..], &p.grad[..]), m), v));
        }
    }
}

/// The moment vectors of an [`AdamW`], lent to a parallel visit one index at a time (each
/// index only to the call that claimed it, see [`Claims`]).
struct SharedMoments {
    m: *mut Vec<f32>,
    v: *mut Vec<f32>,
}

// SAFETY: the pointers are only dereferenced at an index claimed through `Claims`, which hands
// each index to one caller per visit, so no two threads ever reach the same vector.
unsafe impl Sync for SharedMoments {}

/// One flag per parameter index, set when a parallel visit hands that index out: what makes
/// sure no two threads update the same moments, whatever the model's visit does.
#[derive(Debug, Default)]
struct Claims(Vec<AtomicBool>);

impl Clone for Claims {
    /// Fresh flags (claims live only during one visit).
    fn clone(&self) -> Claims {
        Claims::default()
    }
}

impl Claims {
    /// `n` flags, all clear (allocates only when `n` changes).
    fn reset(&mut self, n: usize) {
        if self.0.len() == n {
            self.0.iter_mut().for_each(|c| *c.get_mut() = false);
        } else {
            self.0 = (0..n).map(|_| AtomicBool::new(false)).collect();
        }
    }

    /// Sets flag `i`: true if it was clear (and in range).
    fn claim(&self, i: usize) -> bool {
        self.0
            .get(i)
            .is_some_and(|c| !c.swap(true, Ordering::Relaxed))
    }

    /// Flags set.
    fn count(&mut self) -> usize {
        self.0.iter_mut().map(|c| *c.get_mut() as usize).sum()
    }
}

impl AdamW {
    /// Cuts the moments of truncated parameters to the entries that survived (`changed`, by
    /// parameter name, as [`comera_layers::Compressible::truncate`] reports them). Parameters
    /// are visited in the same order as in [`AdamW::step`].
    pub fn retain(&mut self, changed: &[Retained], visit: impl FnOnce(&mut dyn FnMut(&mut Param))) {
        let (ms, vs) = (&mut self.m, &mut self.v);
        let mut i = 0;
        visit(&mut |p: &mut Param| {
            if let Some(r) = changed.iter().find(|r| r.name == p.name) {
                for buf in [&mut ms[i], &mut vs[i]] {
                    *buf = r.kept.iter().map(|&j| buf[j]).collect();
                }
            }
            assert_eq!(
                ms[i].len(),
                p.len(),
                "optimiser state does not match parameter {} after truncation",
                p.name
            );
            i += 1;
        });
    }
}

/// The factor (≤ 1) that scales gradients to a global ℓ2 norm of at most `max_norm`
/// (1 when `max_norm` is 0), and the norm itself. Summed in f64 in visiting order, each
/// parameter over 8 fixed lanes (deterministic).
pub fn clip_scale(max_norm: f32, visit: impl FnOnce(&mut dyn FnMut(&mut Param))) -> (f32, f64) {
    let mut sq = 0.0f64;
    visit(&mut |p: &mut Param| {
        sq += kernels::sum_sq(&p.grad);
    });
    scale_for(max_norm, sq.sqrt())
}

/// [`clip_scale`] over `model`'s parallel visit ([`Model::visit_params_par`]): each
/// parameter's sum of squares on whichever thread visits it, into `sums` by index, then added
/// in index order, so the norm is the same, bit for bit, as [`clip_scale`]'s.
pub fn clip_scale_par(max_norm: f32, model: &mut dyn Model, sums: &mut ParamSums) -> (f32, f64) {
    // The slots are sized by the visit itself: a visit that reaches beyond them (the first
    // step, or a model that changed) counts its parameters, and the sums are taken again.
    let mut visited = sums.visit(model);
    if visited != sums.0.len() {
        sums.0 = (0..visited).map(|_| AtomicU64::new(0)).collect();
        visited = sums.visit(model);
    }
    assert_eq!(
        visited,
        sums.0.len(),
        "the parallel visit missed parameters"
    );
    let sq = sums.0.iter().fold(0.0f64, |acc, s| {
        acc + f64::from_bits(s.load(Ordering::Relaxed))
    });
    scale_for(max_norm, sq.sqrt())
}

/// Per-parameter sums of squares of [`clip_scale_par`], kept between steps (allocated when the
/// parameter count changes).
#[derive(Debug, Default)]
pub struct ParamSums(Vec<AtomicU64>);

impl ParamSums {
    /// Each parameter's sum of squares into its slot (those beyond the slots are only
    /// counted); returns how many parameters the visit reached.
    fn visit(&self, model: &mut dyn Model) -> usize {
        let visited = AtomicUsize::new(0);
        model.visit_params_par(&|i, p| {
            if let Some(slot) = self.0.get(i) {
                slot.store(kernels::sum_sq(&p.grad).to_bits(), Ordering::Relaxed);
            }
            visited.fetch_add(1, Ordering::Relaxed);
        });
        visited.into_inner()
    }
}

/// The clipping factor for a gradient norm.
fn scale_for(max_norm: f32, norm: f64) -> (f32, f64) {
    if max_norm > 0.0 && norm > max_norm as f64 {
        ((max_norm as f64 / norm) as f32, norm)
    } else {
        (1.0, norm)
    }
}

/// Learning-rate schedule: linear warm-up over `warmup` steps, then constant, linear or cosine
/// decay to zero at `total` steps.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decay {
    Constant,
    /// 1 − u, with u = (t − warmup)/(total − warmup) the fraction of the decay done.
    Linear,
    /// ½·(1 + cos(π·u)): slow at both ends, half way at the middle.
    Cosine,
}

#[derive(Clone, Copy, Debug)]
pub struct Schedule {
    pub warmup: u64,
    pub total: u64,
    pub decay: Decay,
}

impl Schedule {
    /// The learning-rate multiplier at (0-based) step `t`.
    pub fn scale(&self, t: u64) -> f32 {
        if t < self.warmup {
            return (t + 1) as f32 / self.warmup as f32;
        }
        match self.decay {
            Decay::Constant => 1.0,
            Decay::Linear | Decay::Cosine => {
                let span = self.total.saturating_sub(self.warmup).max(1);
                let u = ((t - self.warmup) as f64 / span as f64).min(1.0);
                match self.decay {
                    Decay::Linear => (1.0 - u) as f32,
                    _ => (0.5 * (1.0 + (std::f64::consts::PI * u).cos())) as f32,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quadratic() -> Vec<Param> {
        vec![
            Param::new("w", &[2, 2], ParamKind::Other, vec![1.0, -2.0, 3.0, 0.5]),
            Param::new("core", &[1, 2, 1], ParamKind::TtCore, vec![2.0, -1.0]),
            Param::new("gate", &[2], ParamKind::RankGate, vec![1.0, 1.0]),
        ]
    }

    #[test]
    fn adamw_minimises_a_quadratic_with_group_learning_rates() {
        let mut ps = quadratic();
        let cfg = AdamWConfig {
            lr_cores: 0.05,
            lr_gates: 0.0,
            lr_other: 0.05,
            clip_norm: 0.0,
            ..AdamWConfig::default()
        };
        let mut opt = AdamW::new(cfg, |f| ps.iter_mut().for_each(f));
        for _ in 0..400 {
            for p in &mut ps {
                for (g, v) in p.grad.iter_mut().zip(&p.value) {
                    *g = 2.0 * v; // ∇ Σ v²
                }
            }
            opt.step(1.0, 1.0, |f| ps.iter_mut().for_each(f));
        }
        assert!(
            ps[0]
                .value
                .iter()
                .chain(&ps[1].value)
                .all(|v| v.abs() < 0.05),
            "{:?}",
            ps
        );
        assert_eq!(
            ps[2].value,
            vec![1.0, 1.0],
            "gate learning rate 0 leaves gates alone"
        );
        assert_eq!(opt.t, 400);
    }

    #[test]
    fn clipping_and_schedule() {
        let mut ps = quadratic();
        ps[0].grad = vec![3.0, 4.0, 0.0, 0.0];
        let (s, n) = clip_scale(1.0, |f| ps.iter_mut().for_each(f));
        assert!((n - 5.0).abs() < 1e-9 && (s - 0.2).abs() < 1e-7);
        assert_eq!(clip_scale(0.0, |f| ps.iter_mut().for_each(f)).0, 1.0);
        let sch = Schedule {
            warmup: 4,
            total: 14,
            decay: Decay::Linear,
        };
        assert_eq!(sch.scale(0), 0.25);
        assert_eq!(sch.scale(4), 1.0);
        assert_eq!(sch.scale(9), 0.5);
        assert_eq!(sch.scale(20), 0.0);
        // Cosine: warm-up as linear, then ½(1 + cos πu): 1 at the start of the decay, ½ half
        // way, ¼·(2 − √2) three quarters along... and 0 at the end.
        let cos = Schedule {
            decay: Decay::Cosine,
            ..sch
        };
        assert_eq!(cos.scale(0), 0.25);
        assert_eq!(cos.scale(4), 1.0);
        assert!((cos.scale(9) - 0.5).abs() < 1e-7);
        let u = 7.5f64 / 10.0;
        let three_quarters = Schedule {
            warmup: 0,
            total: 40,
            decay: Decay::Cosine,
        };
        assert!(
            (three_quarters.scale(30) as f64 - 0.5 * (1.0 + (std::f64::consts::PI * u).cos()))
                .abs()
                < 1e-7
        );
        assert!((three_quarters.scale(30) as f64 - 0.25 * (2.0 - 2f64.sqrt())).abs() < 1e-6);
        assert_eq!(cos.scale(14), 0.0);
        assert_eq!(cos.scale(99), 0.0);
        assert_eq!(
            Schedule {
                warmup: 0,
                total: 5,
                decay: Decay::Constant
            }
            .scale(3),
            1.0
        );
        assert!(AdamWConfig {
            beta1: 1.0,
            ..AdamWConfig::default()
        }
        .validate()
        .unwrap_err()
        .to_string()
        .starts_with("optim.beta1: "));
    }
}

/// The element-wise loops of the optimiser, compiled for each instruction-set level
/// (`comera_tensor::multiversion!`; the baseline x86-64 build runs them 4 lanes wide). The AdamW
/// arithmetic is the same expression in every build (no contraction into FMAs), so they agree
/// bit for bit.
mod kernels {
    /// One AdamW update's constants.
    pub(crate) struct Adam {
        pub beta1: f32,
        pub beta2: f32,
        pub bc1: f32,
        pub bc2: f32,
        pub eps: f32,
        pub lr: f32,
        pub decay: f32,
        pub grad_scale: f32,
    }

    comera_tensor::multiversion! {
        /// w, m, v ← one AdamW step with gradient g (all the same length).
        pub(crate) fn adam(k: &Adam, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
            assert!(g.len() == w.len() && m.len() == w.len() && v.len() == w.len());
            let n = w.len();
            let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
            for i in 0..n {
                let g = g[i] * k.grad_scale;
                m[i] = k.beta1 * m[i] + (1.0 - k.beta1) * g;
                v[i] = k.beta2 * v[i] + (1.0 - k.beta2) * g * g;
                w[i] -= k.lr * ((m[i] / k.bc1) / ((v[i] / k.bc2).sqrt() + k.eps) + k.decay * w[i]);
            }
        }
    }

    comera_tensor::multiversion! {
        /// Σ g² in f64.
        pub(crate) fn sum_sq(g: &[f32]) -> f64 {
            const L: usize = 8;
            let mut acc = [0.0f64; L];
            let chunks = g.chunks_exact(L);
            let tail: f64 = chunks
                .remainder()
                .iter()
                .map(|&x| (x as f64) * (x as f64))
                .sum();
            for c in chunks {
                for l in 0..L {
                    acc[l] += (c[l] as f64) * (c[l] as f64);
                }
            }
            acc.iter().sum::<f64>() + tail
        }
    }
}
