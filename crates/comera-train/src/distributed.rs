//! Data-parallel training over several processes (cargo feature `mpi`): the one place that
//! talks to MPI.
//!
//! `mpirun -np N comera train …` starts N copies of the same run. Every process holds the
//! whole model, reads the same deterministic sequence of global batches (the config's batch
//! size B is the global batch) and keeps its shard of each: process p of N keeps rows
//!
//!   [⌊p·B/N⌋, ⌊(p+1)·B/N⌋)
//!
//! so shards differ by at most one row when N does not divide B (each process plans its state
//! for its own shard size; B < N is refused). The step all-reduces the gradients
//! ([`comera_optim::DataParallel`]) and every process applies the same update. Evaluation
//! splits the held-out set by the same rule (contiguous ranges of examples; for a masked LM,
//! the rows of each global batch, so the masks are those of one process) and sums.
//! Process 0 alone writes the run directory; the checkpoint does not depend on N.
//!
//! Without the feature (or without mpirun) the run is one process: [`processes`] is (0, 1).

use comera_optim::Collective;
use std::ops::Range;
use std::sync::OnceLock;

/// (this process's index, number of processes), set once by [`init`].
static WORLD: OnceLock<(usize, usize)> = OnceLock::new();

/// This process's index and the number of processes ((0, 1) without MPI).
pub fn processes() -> (usize, usize) {
    *WORLD.get().unwrap_or(&(0, 1))
}

/// Whether this process writes the run directory (process 0).
pub fn is_writer() -> bool {
    processes().0 == 0
}

/// This process's part of a global batch or of a held-out set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

impl Shard {
    /// One process: everything.
    pub const WHOLE: Shard = Shard { index: 0, count: 1 };

    /// This process's shard of the world.
    pub fn of_world() -> Shard {
        let (index, count) = processes();
        Shard { index, count }
    }

    /// Rows [⌊p·n/N⌋, ⌊(p+1)·n/N⌋) of n.
    pub fn range(&self, n: usize) -> Range<usize> {
        let (p, c) = (self.index, self.count);
        p * n / c..(p + 1) * n / c
    }

    /// This process's rows of a global batch of `batch_size`, refusing a batch smaller than the
    /// number of processes (every process needs a row).
    pub fn rows(&self, batch_size: usize) -> crate::Result<Range<usize>> {
        if batch_size < self.count {
            return Err(crate::config::ConfigError::new(
                "train.batch_size",
                format!(
                    "{batch_size} is smaller than the {} processes (every process trains on at least one row of each global batch)",
                    self.count
                ),
            )
            .into());
        }
        Ok(self.range(batch_size))
    }

    pub fn is_whole(&self) -> bool {
        self.count == 1
    }
}

/// This process's shard and the collectives a task's evaluation needs.
pub struct Processes {
    pub shard: Shard,
    comm: Option<Box<dyn Collective>>,
    scratch: Vec<f64>,
}

impl Processes {
    /// One process (evaluation of a saved model, tests).
    pub fn single() -> Processes {
        Processes {
            shard: Shard::WHOLE,
            comm: None,
            scratch: Vec::new(),
        }
    }

    /// The processes of this run.
    pub fn world() -> Processes {
        Processes {
            shard: Shard::of_world(),
            comm: collective(),
            scratch: Vec::new(),
        }
    }

    /// Sums `v` over processes in rank order, in place (nothing for one process).
    pub fn sum_f64(&mut self, v: &mut [f64]) {
        if let Some(c) = &mut self.comm {
            comera_optim::collective::sum_f64(c.as_mut(), v, &mut self.scratch);
        }
    }

    /// Every process's `mine`, concatenated in rank order.
    pub fn gather_f32(&mut self, mine: &[f32]) -> Vec<f32> {
        match &mut self.comm {
            Some(c) => c.gather_f32(mine),
            None => mine.to_vec(),
        }
    }
}

/// The collectives of this run's processes (None for a single process).
pub fn collective() -> Option<Box<dyn Collective>> {
    if processes().1 < 2 {
        return None;
    }
    #[cfg(feature = "mpi")]
    {
        Some(Box::new(mpi_world::MpiWorld::new()))
    }
    #[cfg(not(feature = "mpi"))]
    {
        None
    }
}

/// Held for the whole program: MPI is finalised when it drops.
pub struct Guard {
    #[cfg(feature = "mpi")]
    _universe: Option<mpi::environment::Universe>,
}

/// Starts MPI when built with the `mpi` feature (a plain start without mpirun is a world of
/// one process); a no-op otherwise. Call once, first thing in `main`, and hold the guard.
pub fn init() -> crate::Result<Guard> {
    #[cfg(feature = "mpi")]
    {
        mpi_world::init()
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = WORLD.set((0, 1));
        Ok(Guard {})
    }
}

/// Ends every process of the job (after this one printed why); returns normally for a single
/// process. Called on an error so the other processes do not wait for this one forever.
pub fn abort_job(code: i32) {
    if processes().1 < 2 {
        return;
    }
    #[cfg(feature = "mpi")]
    mpi_world::abort(code);
    #[cfg(not(feature = "mpi"))]
    let _ = code;
}

#[cfg(feature = "mpi")]
mod mpi_world {
    use super::WORLD;
    use comera_optim::Collective;
    use mpi::datatype::PartitionMut;
    use mpi::topology::SimpleCommunicator;
    use mpi::traits::*;
    use mpi::Count;

    pub(super) fn init() -> crate::Result<super::Guard> {
        // The loop runs on a rayon worker, not on the thread that initialised MPI: one thread
        // at a time calls MPI (SERIALIZED). Errors on COMM_WORLD stay MPI_ERRORS_ARE_FATAL (the
        // default): a failed collective ends the job instead of returning.
        let (universe, level) = mpi::initialize_with_threading(mpi::Threading::Serialized)
            .ok_or_else(|| crate::Error::run("MPI: already initialised"))?;
        if level < mpi::Threading::Serialized {
            return Err(crate::Error::run(format!(
                "MPI: the library provides thread level {level:?}; data-parallel training needs Serialized"
            )));
        }
        let world = universe.world();
        let _ = WORLD.set((world.rank() as usize, world.size() as usize));
        Ok(super::Guard {
            _universe: Some(universe),
        })
    }

    pub(super) fn abort(code: i32) {
        SimpleCommunicator::world().abort(code)
    }

    /// MPI_COMM_WORLD and the buffers of the deterministic sum.
    pub(super) struct MpiWorld {
        world: SimpleCommunicator,
        /// Blocks of every process for this process's chunk (N·chunk values).
        received: Vec<f32>,
        /// Padded send buffer and the summed chunks of every process (N·chunk values each).
        padded: Vec<f32>,
        chunk_sums: Vec<f32>,
    }

    impl MpiWorld {
        pub(super) fn new() -> MpiWorld {
            MpiWorld {
                world: SimpleCommunicator::world(),
                received: Vec::new(),
                padded: Vec::new(),
                chunk_sums: Vec::new(),
            }
        }
    }

    impl Collective for MpiWorld {
        fn rank(&self) -> usize {
            self.world.rank() as usize
        }

        fn size(&self) -> usize {
            self.world.size() as usize
        }

        /// Reduce-scatter by all-to-all, then all-gather: the buffer (padded to N equal chunks
        /// of k) is cut into N chunks; process q receives chunk q of every process, sums them
        /// in rank order 0..N, and the sums are all-gathered. Each process sends and receives
        /// 2·(N−1)·k values, the traffic of a ring all-reduce, and the order of every sum is
        /// fixed whatever algorithm MPI picks for the two data movements.
        fn sum_f32(&mut self, buf: &mut [f32]) {
            let n = self.size();
            let k = buf.len().div_ceil(n).max(1);
            self.padded.resize(n * k, 0.0);
            self.padded[..buf.len()].copy_from_slice(buf);
            self.padded[buf.len()..].fill(0.0);
            self.received.resize(n * k, 0.0);
            self.world
                .all_to_all_into(&self.padded[..], &mut self.received[..]);
            let mine = &mut self.padded[..k];
            mine.copy_from_slice(&self.received[..k]);
            for p in 1..n {
                for (s, x) in mine.iter_mut().zip(&self.received[p * k..(p + 1) * k]) {
                    *s += x;
                }
            }
            self.chunk_sums.resize(n * k, 0.0);
            self.world
                .all_gather_into(&self.padded[..k], &mut self.chunk_sums[..]);
            buf.copy_from_slice(&self.chunk_sums[..buf.len()]);
        }

        fn gather_f64(&mut self, mine: &[f64], all: &mut [f64]) {
            self.world.all_gather_into(mine, all);
        }

        fn gather_u64(&mut self, mine: u64, all: &mut [u64]) {
            self.world.all_gather_into(&mine, all);
        }

        fn gather_f32(&mut self, mine: &[f32]) -> Vec<f32> {
            let n = self.size();
            let mut counts = vec![0 as Count; n];
            self.world
                .all_gather_into(&(mine.len() as Count), &mut counts[..]);
            let displs: Vec<Count> = counts
                .iter()
                .scan(0, |at, &c| {
                    let d = *at;
                    *at += c;
                    Some(d)
                })
                .collect();
            let total = counts.iter().map(|&c| c as usize).sum();
            let mut all = vec![0.0f32; total];
            {
                let mut part = PartitionMut::new(&mut all[..], counts, &displs[..]);
                self.world.all_gather_varcount_into(mine, &mut part);
            }
            all
        }
    }
}

/// Stops the run with a clear error when the processes' rank decisions differ (a hash of the
/// per-layer ranks, gathered after every step of a rank-adaptive run). Every process sees the
/// same gathered hashes, so all of them stop.
pub fn check_same_ranks(
    stepper: &mut comera_optim::Stepper,
    model: &dyn comera_layers::Model,
    step: u64,
) -> crate::Result<()> {
    let Some(dp) = &mut stepper.data_parallel else {
        return Ok(());
    };
    let hash = comera_optim::collective::ranks_hash(&comera_optim::rank::layer_ranks(model));
    let mut all = vec![0u64; dp.comm.size()];
    dp.comm.gather_u64(hash, &mut all);
    if all.iter().any(|&h| h != all[0]) {
        let ranks: Vec<String> = all.iter().map(|h| format!("{h:016x}")).collect();
        return Err(crate::Error::run(format!(
            "step {step}: the processes disagree on the ranks (hash of the per-layer ranks by process: {}); their gradients or rank decisions diverged",
            ranks.join(", ")
        )));
    }
    Ok(())
}

/// The data-parallel figures of `report.json`: processes, gradient bytes all-reduced per step
/// (of the last step: truncation shrinks it), and the steps' time in collectives vs the rest.
pub fn report(
    summary: &mut comera_run::records::TrainSummary,
    dp: &comera_optim::DataParallel,
    step_ms: &[f64],
) {
    let steps_s = step_ms.iter().sum::<f64>() / 1e3;
    let comm_s = dp.comm_time.as_secs_f64();
    let extra = &mut summary.extra;
    extra.insert("processes".into(), dp.comm.size().into());
    extra.insert("allreduce_bytes_per_step".into(), dp.bytes_per_step.into());
    extra.insert("comm_seconds".into(), comm_s.into());
    extra.insert("compute_seconds".into(), (steps_s - comm_s).max(0.0).into());
}
