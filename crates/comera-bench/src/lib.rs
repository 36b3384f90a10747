//! `comera bench …`: the engine's benchmarks, measured side by side in one run (interleaved
//! rounds, or one child process per arm, and medians), behind one harness.
//!
//! The `comera` binary parses `comera bench SUBCOMMAND …` into [`Bench`] and calls [`run`].
//! Benchmarks that need a process per arm (so that a peak RSS belongs to one arm alone)
//! re-invoke that binary with hidden `--child` flags.
//!
//! Modules:
//! - [`harness`]: what every benchmark shares — medians, interleaved rounds, child processes,
//!   peak and current RSS, synthetic batches and inputs, table printing;
//! - [`tt_linear`]: `bench tt-linear`, TT linear layers on every contraction path vs dense;
//! - [`ttm`]: `bench ttm`, TTM embedding lookups (optimised, naive) vs a dense gather;
//! - [`step`]: `bench step`, whole encoder training steps, dense vs TT/TTM (and `--ops`);
//! - [`compare`]: `bench compare`, dense + AdamW vs dense + GaLore vs CoMERA (SPEC §5);
//! - [`rank`]: `bench rank`, a rank-adaptive run's model at its initial vs truncated ranks;
//! - [`mlm`]: `bench mlm`, masked-LM steps, dense vs CoMERA with a TT or dense projection.

pub mod compare;
pub mod harness;
pub mod mlm;
pub mod rank;
pub mod step;
pub mod tt_linear;
pub mod ttm;

use std::process::ExitCode;

/// `comera bench SUBCOMMAND`.
#[derive(clap::Subcommand)]
pub enum Bench {
    /// Forward+backward of the paper's TT linear layers on every path vs the dense layer.
    TtLinear(crate::tt_linear::TtLinearArgs),
    /// Forward+backward per looked-up id of TTM tables (optimised, naive) vs a dense gather.
    Ttm(crate::ttm::TtmArgs),
    /// Whole training steps (forward, loss, backward, AdamW) of the dense vs the TT/TTM encoder.
    Step(crate::step::StepArgs),
    /// Dense + AdamW vs dense + GaLore vs CoMERA (TT/TTM): step time, memory, loss, accuracy.
    Compare(crate::compare::CompareArgs),
    /// Step time of a rank-adaptive run's model at its initial vs its truncated ranks.
    Rank(crate::rank::RankArgs),
    /// Masked-LM pre-training steps: dense vs CoMERA with a TT or a dense output projection.
    Mlm(crate::mlm::MlmArgs),
}

/// Runs one benchmark (or, with a hidden `--child`, one arm of it in this process).
pub fn run(b: Bench) -> anyhow::Result<ExitCode> {
    match b {
        Bench::TtLinear(a) => tt_linear::run(a),
        Bench::Ttm(a) => ttm::run(a),
        Bench::Step(a) => step::run(a),
        Bench::Compare(a) => compare::run(a),
        Bench::Rank(a) => rank::run(a),
        Bench::Mlm(a) => mlm::run(a),
    }
}
