//! The contraction planner.
//!
//! A TT layer can be contracted in several orders ("paths") that give the same numbers at very
//! different costs, depending on the batch, the modes and the current ranks. For each path this
//! crate lists the GEMMs and memory passes the layer's implementation runs (forward, and
//! optionally backward), estimates their time from a simple machine model (FLOPs at an
//! efficiency that drops for thin operands, bytes moved, a fixed cost per call), and picks the
//! cheapest. A [`ContractionPlan`] is made once for a layer's shapes and batch and reused every
//! step; it is redone when the ranks change.

mod cost;
mod tt_linear;

pub use cost::{CostModel, Costing};
pub use tt_linear::{tt_linear_cost, ContractionPlan, Pass, PathCost, TtPath};
