//! What every benchmark shares: medians, interleaved rounds, child processes, peak RSS.

use std::time::Instant;

/// Times each variant in interleaved rounds; returns the median ms per call of each.
pub fn interleaved_medians(variants: &mut [Box<dyn FnMut() + '_>], seconds: f64) -> Vec<f64> {
    // Calibrate: enough inner calls for a ≥ 2 ms sample, and a round count for the budget.
    let mut inner = Vec::with_capacity(variants.len());
    let mut round_s = 0.0;
    for v in variants.iter_mut() {
        v(); // warm-up (first-touch of buffers, thread pool start)
        let t = Instant::now();
        v();
        let dt = t.elapsed().as_secs_f64().max(1e-7);
        let k = (2e-3 / dt).ceil().max(1.0) as usize;
        inner.push(k);
        round_s += dt * k as f64;
    }
    let rounds = ((seconds / round_s) as usize).clamp(7, 201);
    let mut samples = vec![Vec::with_capacity(rounds); variants.len()];
    for _ in 0..rounds {
        for (i, v) in variants.iter_mut().enumerate() {
            let t = Instant::now();
            for _ in 0..inner[i] {
                v();
            }
            samples[i].push(t.elapsed().as_secs_f64() * 1e3 / inner[i] as f64);
        }
    }
    samples.into_iter().map(median).collect()
}

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if !n.is_multiple_of(2) {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// `VmHWM` (peak resident set) of this process, in bytes.
pub fn peak_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}
