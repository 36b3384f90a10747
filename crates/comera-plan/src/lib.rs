//! The contraction planner.
//!
//! A TT layer can be contracted in several orders ("paths") that give the same numbers at very
//! different costs, depending on the batch, the modes and the current ranks. For each path this
//! crate lists the GEMMs and memory passes the layer's implementation runs (forward, and
//! optionally backward), estimates their time from a simple machine model (FLOPs at an
//! efficiency that drops for thin operands, bytes moved, a fixed cost per call), and picks the
//! cheapest. A [`ContractionPlan`] is made once for a layer's shapes and batch and reused every
//! step; it is redone when the ranks change.
//!
//! Modules (private; their items are re-exported here):
//! - `cost`: the machine model ([`CostModel`]) and the running totals of one path
//!   ([`Costing`]: FLOPs, bytes, GEMM calls, time);
//! - `tt_linear`: the paths of a TT linear layer ([`TtPath`]: merged, sequential, dense), the
//!   cost of each ([`tt_linear_cost`]) and the plan that picks one ([`ContractionPlan`]).
//!
//! Planning a 256 → 256 layer (modes `[16, 16]` × `[16, 16]`, rank 8) for training:
//!
//! ```
//! use comera_plan::{ContractionPlan, CostModel, Pass, TtPath};
//! use comera_tensor::TtShape;
//!
//! let shape = TtShape::uniform(&[16, 16], &[16, 16], 8)?;
//! let model = CostModel::default();
//! let train = Pass::Train { need_dx: true };
//! let small = ContractionPlan::for_tt_linear(&shape, 1, train, &model);
//! let large = ContractionPlan::for_tt_linear(&shape, 4096, train, &model);
//! // Every path is costed, and the cheapest is picked.
//! assert_eq!(small.costs.len(), TtPath::ALL.len());
//! for plan in [&small, &large] {
//!     let cheapest = plan.costs.iter().map(|c| c.est_ms).fold(f64::INFINITY, f64::min);
//!     assert_eq!(plan.cost_of(plan.path).est_ms, cheapest);
//! }
//! // No batch-independent work at batch 1; the chains' cost amortised at a large batch.
//! assert_eq!((small.path, large.path), (TtPath::Sequential, TtPath::Merged));
//! // A plan holds for its batch and ranks only.
//! assert!(small.is_valid_for(&shape, 1));
//! assert!(!small.is_valid_for(&shape, 4096));
//! assert!(!small.is_valid_for(&TtShape::uniform(&[16, 16], &[16, 16], 4)?, 1));
//! # Ok::<(), comera_tensor::ShapeError>(())
//! ```

mod cost;
mod tt_linear;

pub use cost::{CostModel, Costing};
pub use tt_linear::{tt_linear_cost, ContractionPlan, Pass, PathCost, TtPath};
