//! Where a device step's time goes, operation by operation: the step queued once, eagerly,
//! with every kernel launch, cuBLAS product, memset and copy timed on its own by two CUDA
//! events around it (`comera bench step --device cuda --profile`, the `step_bench` example's
//! `--profile`).
//!
//! An event pair around an operation launched from the host would also time the host's
//! launch latency whenever the GPU is idle, waiting for the launch. So each operation is
//! queued behind a short spin (`spin_wait`, a kernel that reads the global timer for
//! [`SPIN_NS`] and touches no memory): while the GPU spins, the host queues the start event,
//! the operation and the end event, and the GPU then runs the three back to back. The host
//! waits for the end event before the next operation. The operations run in the step's order
//! on the step's data (each sees what the ones before it wrote, and the L2 cache they left),
//! one at a time, so the sum of their times is the step with no launch gaps and no overlap
//! between neighbours: the captured graph's step time minus that sum is what the graph's
//! dependencies and launches cost.
//!
//! Only for an eager step: events cannot be waited on inside a stream capture, so a capture
//! queued from inside [`Profile::run`] fails with the driver's error at its first operation.
//! Outside a `Profile::run` nothing is timed, and capturing works as always.

use crate::device::Device;
use crate::error::{driver, CudaError};
use std::cell::RefCell;
use std::collections::BTreeMap;

/// How long the spin in front of each timed operation lasts: long enough for the host to queue
/// an event, a launch (a cuBLAS call queues one or two) and an event behind it.
pub const SPIN_NS: i64 = 50_000;

/// One timed operation.
#[derive(Clone, Debug, serde::Serialize)]
pub struct OpTime {
    /// The part of the step it belongs to ([`scope`]), e.g. `fwd ffn`.
    pub scope: &'static str,
    /// The kernel's name, or `sgemm m×n×k` (`, batch c`), `memset`, `memcpy`.
    pub op: String,
    pub ms: f64,
}

/// Totals over the operations of one label.
#[derive(Clone, Debug, serde::Serialize)]
pub struct OpTotal {
    pub label: String,
    pub calls: usize,
    pub ms: f64,
}

/// The timed operations of one eager step, in order.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Profile {
    pub ops: Vec<OpTime>,
}

struct Active {
    dev_stream: std::sync::Arc<cudarc::driver::CudaStream>,
    spin: cudarc::driver::CudaFunction,
    scope: &'static str,
    ops: Vec<OpTime>,
}

thread_local! {
    static ACTIVE: RefCell<Option<Active>> = const { RefCell::new(None) };
}

impl Profile {
    /// Runs `queue` (which queues operations on `dev`'s stream through [`super::raw`]) with
    /// every operation timed on its own, then waits for the stream.
    pub fn run(
        dev: &Device,
        queue: impl FnOnce(&Device) -> Result<(), CudaError>,
    ) -> Result<Profile, CudaError> {
        dev.stream()
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))?;
        ACTIVE.with(|a| {
            *a.borrow_mut() = Some(Active {
                dev_stream: dev.stream().clone(),
                spin: dev.kernel("spin_wait").clone(),
                scope: "",
                ops: Vec::new(),
            })
        });
        let result = queue(dev);
        let active = ACTIVE.with(|a| a.borrow_mut().take());
        result?;
        dev.stream()
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))?;
        Ok(Profile {
            ops: active.map(|a| a.ops).unwrap_or_default(),
        })
    }

    /// The sum of every operation's time, ms.
    pub fn total_ms(&self) -> f64 {
        self.ops.iter().map(|o| o.ms).sum()
    }

    /// Totals by `key` of each operation, the largest first.
    pub fn totals(&self, key: impl Fn(&OpTime) -> String) -> Vec<OpTotal> {
        let mut by: BTreeMap<String, (usize, f64)> = BTreeMap::new();
        for o in &self.ops {
            let e = by.entry(key(o)).or_default();
            e.0 += 1;
            e.1 += o.ms;
        }
        let mut v: Vec<OpTotal> = by
            .into_iter()
            .map(|(label, (calls, ms))| OpTotal { label, calls, ms })
            .collect();
        v.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        v
    }

    /// Totals by part of the step.
    pub fn by_scope(&self) -> Vec<OpTotal> {
        self.totals(|o| o.scope.to_string())
    }

    /// Totals by operation (kernel name, or the product's shape).
    pub fn by_op(&self) -> Vec<OpTotal> {
        self.totals(|o| o.op.clone())
    }
}

/// Marks the operations queued from here on (on this thread, while a [`Profile::run`] is
/// active) as belonging to `name`; free when no profile runs.
pub fn scope(name: &'static str) {
    ACTIVE.with(|a| {
        if let Some(a) = a.borrow_mut().as_mut() {
            a.scope = name;
        }
    });
}

/// Queues `op` (which queues one operation on the profiled stream), timed when a
/// [`Profile::run`] is active on this thread; otherwise just `op`.
pub(crate) fn timed(
    label: impl FnOnce() -> String,
    op: impl FnOnce() -> Result<(), CudaError>,
) -> Result<(), CudaError> {
    let Some(mut active) = ACTIVE.with(|a| a.borrow_mut().take()) else {
        return op();
    };
    let result = active.time(label, op);
    ACTIVE.with(|a| *a.borrow_mut() = Some(active));
    result
}

impl Active {
    fn time(
        &mut self,
        label: impl FnOnce() -> String,
        op: impl FnOnce() -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        use cudarc::driver::{sys::CUevent_flags, PushKernelArg};
        let stream = &self.dev_stream;
        let ns = SPIN_NS;
        let mut b = stream.launch_builder(&self.spin);
        b.arg(&ns);
        // SAFETY: spin_wait(long long ns) takes one 64-bit integer and touches no memory.
        unsafe { b.launch(super::raw::grid(1, 1, 1)) }.map_err(driver("spin_wait"))?;
        let timing = Some(CUevent_flags::CU_EVENT_DEFAULT);
        let start = stream
            .record_event(timing)
            .map_err(driver("cuEventRecord"))?;
        op()?;
        let end = stream
            .record_event(timing)
            .map_err(driver("cuEventRecord"))?;
        let ms = start
            .elapsed_ms(&end)
            .map_err(driver("cuEventElapsedTime"))?;
        self.ops.push(OpTime {
            scope: self.scope,
            op: label(),
            ms: ms as f64,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(scope: &'static str, op: &str, ms: f64) -> OpTime {
        OpTime {
            scope,
            op: op.to_string(),
            ms,
        }
    }

    #[test]
    fn totals_add_up_by_scope_and_by_operation_the_largest_first() {
        let p = Profile {
            ops: vec![
                op("fwd ffn", "sgemm 128×3072×30 (a b)", 0.5),
                op("fwd attention", "softmax_rows_forward", 0.25),
                op("fwd ffn", "gelu_forward", 0.125),
                op("bwd ffn", "gelu_forward", 0.125),
            ],
        };
        assert_eq!(p.total_ms(), 1.0);
        let s = p.by_scope();
        let names: Vec<_> = s
            .iter()
            .map(|t| (t.label.as_str(), t.calls, t.ms))
            .collect();
        assert_eq!(
            names,
            [
                ("fwd ffn", 2, 0.625),
                ("fwd attention", 1, 0.25),
                ("bwd ffn", 1, 0.125)
            ]
        );
        let o = p.by_op();
        assert_eq!(o[0].label, "sgemm 128×3072×30 (a b)");
        // Equal totals keep the labels' order.
        assert_eq!(
            (o[1].label.as_str(), o[1].calls, o[1].ms),
            ("gelu_forward", 2, 0.25)
        );
        // Outside Profile::run, an operation is only run, not timed.
        let mut ran = false;
        timed(
            || unreachable!("no label without a profile"),
            || {
                ran = true;
                Ok(())
            },
        )
        .unwrap();
        assert!(ran);
    }
}
