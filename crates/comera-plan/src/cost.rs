//! A small machine model: what a GEMM or a memory pass costs on this CPU.

/// Machine constants used to turn operation counts into time estimates.
///
/// A GEMM of m×k by k×n runs at `peak_gflops` (or `single_gflops` below the threading
/// threshold) scaled by an efficiency in (0, 1] that falls when the output is thinner than the
/// backend's micro-kernel can fill (`sqrt(min(1, min(m, n) / full_mn))`) and, more steeply,
/// when the inner dimension is too short to amortise packing (`min(1, k / full_k)`); it is never
/// faster than moving its operands at `mem_gbps`, and pays `call_us` of fixed overhead.
/// The constants were fitted to `comera bench tt-linear --json` (measured vs `est_ms`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct CostModel {
    /// Sustained GEMM throughput on large operands, all threads used (GFLOP/s).
    pub peak_gflops: f64,
    /// Single-thread throughput (GFLOP/s), for products below the threading threshold.
    pub single_gflops: f64,
    /// Products with at least this many multiply-adds use all threads.
    pub parallel_min_macs: f64,
    /// Streaming memory bandwidth (GB/s).
    pub mem_gbps: f64,
    /// Fixed cost of one GEMM call (µs).
    pub call_us: f64,
    /// Operand width at which the micro-kernel is fully used (rows/cols).
    pub full_mn: f64,
    /// Inner dimension at which packing is amortised.
    pub full_k: f64,
}

impl Default for CostModel {
    /// Constants measured on the project's 2-core CI machine class with the `gemm` backend
    /// (see `tools/gemm-bench` and `comera bench tt-linear`).
    fn default() -> Self {
        CostModel {
            peak_gflops: 90.0,
            single_gflops: 50.0,
            parallel_min_macs: (1u64 << 18) as f64,
            mem_gbps: 20.0,
            call_us: 0.4,
            full_mn: 24.0,
            full_k: 64.0,
        }
    }
}

/// Running totals for one path: FLOPs, bytes moved, GEMM calls and the time estimate.
#[derive(Clone, Debug, Default)]
pub struct Costing {
    pub flops: f64,
    pub bytes: f64,
    pub gemm_calls: usize,
    pub seconds: f64,
}

impl Costing {
    /// Accounts for `C (m×n) = A (m×k) · B (k×n)`.
    pub fn gemm(&mut self, model: &CostModel, m: usize, n: usize, k: usize) {
        let (mf, nf, kf) = (m as f64, n as f64, k as f64);
        let flops = 2.0 * mf * nf * kf;
        let bytes = 4.0 * (mf * kf + kf * nf + mf * nf);
        let eff = ((mf.min(nf) / model.full_mn).min(1.0) * (kf / model.full_k).min(1.0))
            .sqrt()
            .max(0.02);
        let rate = if mf * nf * kf >= model.parallel_min_macs {
            model.peak_gflops
        } else {
            model.single_gflops
        };
        let t_flops = flops / (rate * 1e9 * eff);
        let t_bytes = bytes / (model.mem_gbps * 1e9);
        self.flops += flops;
        self.bytes += bytes;
        self.gemm_calls += 1;
        self.seconds += t_flops.max(t_bytes) + model.call_us * 1e-6;
    }

    /// Accounts for an element-wise pass that reads and writes `elems` f32 values in total.
    pub fn stream(&mut self, model: &CostModel, elems: usize) {
        let bytes = 4.0 * elems as f64;
        self.bytes += bytes;
        self.seconds += bytes / (model.mem_gbps * 1e9);
    }

    /// Accounts for a strided gather (permutation) of `elems` values: read + write, at half
    /// the streaming bandwidth.
    pub fn gather(&mut self, model: &CostModel, elems: usize) {
        let bytes = 8.0 * elems as f64;
        self.bytes += bytes;
        self.seconds += 2.0 * bytes / (model.mem_gbps * 1e9);
    }
}
