//! The CUDA step engine: the encoder's training step as a static plan on device buffers
//! (every buffer allocated once for a fixed batch, sequence length and ranks), queued as
//! kernel launches and cuBLAS products on the device's one stream, with no host round trip
//! inside a step, so that the whole step can be captured once with [`Device::capture`] and
//! replayed.
//!
//! - [`raw`]: buffers addressed by raw pointers, launches and row-major SGEMM on them;
//! - [`arena`]: every parameter, gradient and AdamW moment in four flat buffers, by the CPU
//!   model's names and shapes (upload and download: the seam for checkpoints and export);
//! - [`tt`]: a TT linear layer, merged path, forward and backward to cores and gates;
//! - [`encoder`]: the classifier encoder's whole step ([`EncoderPlan`]);
//! - [`memory`]: what a plan will hold on the device, before it allocates ([`PlanMemory`]);
//! - [`rank`]: the rank schedule inside that step (the stage's objective, the gates'
//!   projection) over every gated chain at once;
//! - [`profile`]: one eager step with every operation timed on its own (where the time goes);
//! - [`session`]: the seam comera-train calls ([`EncoderSession`]): device, plan and captured
//!   graphs (the step, and the evaluation pass); host batches in, statistics, logits and
//!   parameters out.
//!
//! [`Device::capture`]: crate::Device::capture

pub mod arena;
pub mod encoder;
pub mod memory;
mod mlm;
pub mod profile;
pub mod rank;
pub mod raw;
pub mod session;
pub mod tt;

pub use arena::{ParamArena, Tensor, Which};
pub use encoder::{DeviceStepStats, EncoderPlan, StepConfig, StepPhase};
pub use memory::PlanMemory;
pub use profile::Profile;
pub use rank::{ChainTable, DeviceBranch, DeviceObjective, RankSettings, RankStep};
pub use raw::{Blas, Buf, Gemm};
pub use session::{EncoderSession, Micro, Moments};
pub use tt::{Slot, TtDims, TtLayer};
