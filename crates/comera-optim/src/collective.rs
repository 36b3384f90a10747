//! Data-parallel steps over several processes: what the step needs from the processes it runs
//! on ([`Collective`], implemented over MPI by comera-train's `distributed` module) and the
//! step's gradient reduction ([`DataParallel`]).
//!
//! Every process holds the whole model and computes the gradient of its shard's mean loss
//! L_p over its c_p predictions (examples, or labelled tokens for a masked LM). The global
//! batch's mean loss is L = Σ_p c_p·L_p / C with C = Σ_p c_p, so its gradient is
//!
//!   ∇L = Σ_p (c_p / C) · ∇L_p
//!
//! summed over processes in rank order 0..N on every element ([`Collective::sum_f32`]): every
//! process gets the same bits, and so does a rerun with the same N.

use comera_layers::{LossTerms, Model, Param, StepStats};
use std::time::{Duration, Instant};

/// Values gathered per process by [`DataParallel::reduce_stats`]: the loss sum, correct,
/// count and the three loss-term sums.
const STATS: usize = 6;

/// The collective operations of a data-parallel run (all blocking; every process calls them in
/// the same order).
pub trait Collective {
    /// This process's index, 0-based.
    fn rank(&self) -> usize;
    /// Number of processes.
    fn size(&self) -> usize;
    /// Element-wise sum of `buf` over all processes, in place. Each element is summed in rank
    /// order 0..N whatever the transport does, so every process gets the same bits and a rerun
    /// with the same N gives them again. Allocates only when `buf` outgrows earlier calls.
    fn sum_f32(&mut self, buf: &mut [f32]);
    /// `all[p·k..(p+1)·k]` ← process p's `mine` (k = `mine.len()`, the same on every process;
    /// `all.len()` = k·N).
    fn gather_f64(&mut self, mine: &[f64], all: &mut [f64]);
    /// `all[p]` ← process p's `mine` (`all.len()` = N).
    fn gather_u64(&mut self, mine: u64, all: &mut [u64]);
    /// The concatenation of every process's `mine` in rank order (lengths may differ).
    fn gather_f32(&mut self, mine: &[f32]) -> Vec<f32>;
}

/// Sums `v` (k values per process) over processes in rank order, in place (`v` becomes the
/// global sums). `scratch` holds k·N values.
pub fn sum_f64(comm: &mut dyn Collective, v: &mut [f64], scratch: &mut Vec<f64>) {
    let (k, n) = (v.len(), comm.size());
    scratch.resize(k * n, 0.0);
    comm.gather_f64(v, scratch);
    v.fill(0.0);
    for p in 0..n {
        for (s, x) in v.iter_mut().zip(&scratch[p * k..(p + 1) * k]) {
            *s += x;
        }
    }
}

/// The gradient reduction of a data-parallel step, with its buffers and timings.
pub struct DataParallel {
    pub comm: Box<dyn Collective>,
    /// Every parameter's gradient, in `visit_params_mut` order (the one fused buffer; its
    /// length follows truncation, its capacity is kept).
    flat: Vec<f32>,
    /// (loss·count, correct, count) of every process, 3·N values.
    stats: Vec<f64>,
    /// Bytes of gradient all-reduced by the last step (4 per trainable scalar).
    pub bytes_per_step: usize,
    /// Time spent in collectives since the start.
    pub comm_time: Duration,
    /// Steps taken since the start.
    pub steps: u64,
}

impl DataParallel {
    pub fn new(comm: Box<dyn Collective>) -> DataParallel {
        let n = comm.size();
        DataParallel {
            comm,
            flat: Vec::new(),
            stats: vec![0.0; STATS * n],
            bytes_per_step: 0,
            comm_time: Duration::ZERO,
            steps: 0,
        }
    }

    /// The global batch's stats from this process's (summed in rank order) and this process's
    /// share c_p / C of the global loss (0 when it has no prediction in the batch). A distilled
    /// step's loss terms are averaged the same way as the loss.
    pub fn reduce_stats(&mut self, local: StepStats) -> (StepStats, f64) {
        let t = Instant::now();
        // A shard without predictions has a 0/0 mean loss: it contributes nothing.
        let weight = if local.count > 0 {
            local.count as f64
        } else {
            0.0
        };
        let terms = local
            .terms
            .unwrap_or_default()
            .to_array()
            .map(|v| v * weight);
        let mut sums = [
            local.loss * weight,
            local.correct as f64,
            local.count as f64,
            terms[0],
            terms[1],
            terms[2],
        ];
        let mut all = std::mem::take(&mut self.stats);
        self.comm.gather_f64(&sums, &mut all);
        sums = [0.0; STATS];
        for p in all.chunks_exact(STATS) {
            for (s, x) in sums.iter_mut().zip(p) {
                *s += x;
            }
        }
        self.stats = all;
        self.comm_time += t.elapsed();
        let count = sums[2] as usize;
        let mean = |sum: f64| if count > 0 { sum / count as f64 } else { 0.0 };
        let global = StepStats {
            loss: mean(sums[0]),
            correct: sums[1] as usize,
            count,
            terms: local
                .terms
                .map(|_| LossTerms::from_array([sums[3], sums[4], sums[5]].map(mean))),
        };
        let share = if count > 0 && local.count > 0 {
            local.count as f64 / count as f64
        } else {
            0.0
        };
        (global, share)
    }

    /// Replaces every gradient by Σ_p share_p · grad_p (module docs), through one fused buffer.
    pub fn reduce_grads(&mut self, model: &mut dyn Model, share: f64) {
        let share = share as f32;
        let mut len = 0;
        model.visit_params_mut(&mut |p: &mut Param| len += p.grad.len());
        self.flat.resize(len, 0.0);
        let mut at = 0;
        model.visit_params_mut(&mut |p: &mut Param| {
            let dst = &mut self.flat[at..at + p.grad.len()];
            if share == 0.0 {
                // Not share·grad: the gradient of an empty shard may be 0/0.
                dst.fill(0.0);
            } else {
                for (d, g) in dst.iter_mut().zip(&p.grad) {
                    *d = share * g;
                }
            }
            at += p.grad.len();
        });
        let t = Instant::now();
        self.comm.sum_f32(&mut self.flat);
        self.comm_time += t.elapsed();
        let mut at = 0;
        model.visit_params_mut(&mut |p: &mut Param| {
            let n = p.grad.len();
            p.grad.copy_from_slice(&self.flat[at..at + n]);
            at += n;
        });
        self.bytes_per_step = 4 * len;
        self.steps += 1;
    }
}

/// A hash of the per-layer ranks (FNV-1a over names and ranks), to check cheaply that every
/// process took the same rank decisions.
pub fn ranks_hash(ranks: &[crate::rank::LayerRanks]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for l in ranks {
        eat(l.name.as_bytes());
        for &r in &l.ranks {
            eat(&(r as u64).to_le_bytes());
        }
    }
    h
}
