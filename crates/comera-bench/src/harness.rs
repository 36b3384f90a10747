//! What every benchmark shares, written once: medians, interleaved rounds of arms, child
//! processes (one per arm, so that a peak RSS belongs to one arm alone), peak and current
//! RSS, synthetic batches and inputs, and table printing.

use anyhow::{ensure, Context};
use comera_model::{Encoder, EncoderConfig, EncoderState};
use comera_optim::{AdamWConfig, Optimizer, StepReport, Stepper};
use comera_tensor::init;
use rand::seq::SliceRandom;
use rand::Rng;
use rand_distr::{Distribution, Uniform};
use serde::{de::DeserializeOwned, Deserialize, Serialize};
use std::ffi::OsStr;
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

/// Bytes in a MB as the benchmarks print it (MiB).
pub const MB: f64 = 1024.0 * 1024.0;

// ---------------------------------------------------------------------------------------------
// Medians and timing

/// The median (the mean of the two middle values for an even count); NaN for no values.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        f64::NAN
    } else if !n.is_multiple_of(2) {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// The median over every sample of every round (`None` when there is no sample).
pub fn pooled_median<'a>(rounds: impl IntoIterator<Item = &'a [f64]>) -> Option<f64> {
    let v: Vec<f64> = rounds.into_iter().flatten().copied().collect();
    (!v.is_empty()).then(|| median(v))
}

/// Runs the variants in `rounds` interleaved rounds: in each round every variant in turn makes
/// `warm` untimed calls, then gives `samples_per_round` samples, each the mean ms per call over
/// `inner[i]` back-to-back calls. Returns the samples of each variant.
///
/// Round r starts at variant r mod n, so no variant always runs first. That alone does not
/// stop a variant that leaves the caches cold (a large table, a large workspace) from slowing
/// its successors unevenly: with three variants, the one after it in the first round follows
/// it in two rounds of three. A warm-up call at the start of each visit (`warm`) does. (With a
/// fixed order, `bench ttm`'s automatic lookup on the BERT table, the same code as the
/// optimised one there, measured 7-13% slower than it, always run right after the naive
/// lookup's 92 MB of records; rotated, 4-16%; rotated with one warm-up call per visit, see
/// `interleaved_medians`.)
pub fn interleave(
    variants: &mut [Box<dyn FnMut() + '_>],
    rounds: usize,
    warm: usize,
    samples_per_round: usize,
    inner: &[usize],
) -> Vec<Vec<f64>> {
    let n = variants.len();
    let mut samples = vec![Vec::with_capacity(rounds * samples_per_round); n];
    for r in 0..rounds {
        for i in (0..n).map(|j| (r + j) % n) {
            let v = &mut variants[i];
            for _ in 0..warm {
                v();
            }
            for _ in 0..samples_per_round {
                let t = Instant::now();
                for _ in 0..inner[i] {
                    v();
                }
                samples[i].push(t.elapsed().as_secs_f64() * 1e3 / inner[i] as f64);
            }
        }
    }
    samples
}

/// Times each variant in interleaved rounds for about `seconds` in all (at least 7 rounds);
/// returns the median ms per call of each. Each visit of a variant starts with one untimed call
/// (its caches refilled after the other variants ran) and then takes `per_visit` samples, each
/// over enough back-to-back calls for at least 2 ms. Whole training steps take `per_visit` > 1:
/// consecutive steps, as in one training run (alternating single steps, `bench rank --batch 1`
/// timed the paper model at 36.3 ms/step where it steps at 22.8 alone).
pub fn interleaved_medians(
    variants: &mut [Box<dyn FnMut() + '_>],
    seconds: f64,
    per_visit: usize,
) -> Vec<f64> {
    let mut inner = Vec::with_capacity(variants.len());
    let mut round_s = 0.0;
    for v in variants.iter_mut() {
        v(); // warm-up (first-touch of buffers, thread pool start)
        let t = Instant::now();
        v();
        let dt = t.elapsed().as_secs_f64().max(1e-7);
        let k = (2e-3 / dt).ceil().max(1.0) as usize;
        inner.push(k);
        round_s += dt * (k * per_visit + 1) as f64; // with the visit's warm-up call
    }
    let rounds = ((seconds / round_s) as usize).clamp(7, 201);
    let samples = interleave(variants, rounds, 1, per_visit, &inner);
    samples.into_iter().map(median).collect()
}

/// Median ms of `f` over `reps` calls after one warm-up call.
pub fn median_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut one: [Box<dyn FnMut() + '_>; 1] = [Box::new(f)];
    median(interleave(&mut one, reps, 0, 1, &[1]).remove(0))
}

/// The machine's GEMM rate in this process (GFLOP/s): the median of `reps` products
/// C (n × n) = A·B through the engine's one GEMM (faer), after a warm-up product. The
/// benchmarks print it next to achieved rates so one sees the distance to the limit.
pub fn gemm_calibration_gflops(n: usize, reps: usize) -> f64 {
    use comera_tensor::{matmul, MatMut, MatRef};
    let mut rng = init::rng(99);
    let (a, b) = (normal_vec(&mut rng, n * n), normal_vec(&mut rng, n * n));
    let mut c = vec![0.0; n * n];
    let ms = median_ms(reps, || {
        matmul(
            MatMut::new(&mut c, n, n),
            MatRef::new(&a, n, n),
            MatRef::new(&b, n, n),
            false,
        )
    });
    gflops(2.0 * (n * n * n) as f64, ms)
}

/// GFLOP/s of `flops` done in `ms` milliseconds.
pub fn gflops(flops: f64, ms: f64) -> f64 {
    flops / (ms * 1e6)
}

/// Per-step times of a child's training steps, split at the phase boundaries.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct StepTimes {
    /// Whole steps.
    pub step_ms: Vec<f64>,
    pub fwd_ms: Vec<f64>,
    pub bwd_ms: Vec<f64>,
    pub opt_ms: Vec<f64>,
    /// The other workers' idle time in each step, summed over them
    /// ([`comera_optim::StepReport::pool_idle`]).
    #[serde(default)]
    pub idle_ms: Vec<f64>,
}

impl StepTimes {
    /// Records one step from its phases (see [`comera_optim::StepReport::phases`]).
    pub fn push_report(&mut self, r: &StepReport) {
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        let [f, b, o] = r.phases;
        self.step_ms.push(ms(f + b + o));
        self.fwd_ms.push(ms(f));
        self.bwd_ms.push(ms(b));
        self.opt_ms.push(ms(o));
        self.idle_ms.push(ms(r.pool_idle));
    }

    /// Medians over every step of every round: `[step, fwd, bwd, opt, idle]` ms (NaN where
    /// empty).
    pub fn pooled<'a>(rounds: impl Iterator<Item = &'a StepTimes> + Clone) -> [f64; 5] {
        let of =
            |f: fn(&StepTimes) -> &[f64]| pooled_median(rounds.clone().map(f)).unwrap_or(f64::NAN);
        [
            of(|t| &t.step_ms),
            of(|t| &t.fwd_ms),
            of(|t| &t.bwd_ms),
            of(|t| &t.opt_ms),
            of(|t| &t.idle_ms),
        ]
    }
}

// ---------------------------------------------------------------------------------------------
// Child processes and memory

/// Re-invokes this executable as `comera --threads THREADS bench ARGS…` and parses the JSON
/// line the child prints last; `label` names the child in errors.
pub fn run_child<T: DeserializeOwned>(
    threads: usize,
    args: impl IntoIterator<Item = impl AsRef<OsStr>>,
    label: &str,
) -> anyhow::Result<T> {
    // /proc/self/exe still runs this binary if a concurrent build has replaced the file.
    let proc_exe = std::path::Path::new("/proc/self/exe");
    let exe = if proc_exe.exists() {
        proc_exe.to_path_buf()
    } else {
        std::env::current_exe()?
    };
    let out = Command::new(exe)
        .args(["--threads", &threads.to_string(), "bench"])
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()?;
    ensure!(
        out.status.success(),
        "child {label} failed ({})",
        out.status
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| anyhow::anyhow!("child {label} printed no report"))?;
    serde_json::from_str(line).with_context(|| format!("child {label}: unreadable report"))
}

/// The child's side of [`run_child`]: prints `report` as its one JSON line.
pub fn report_to_parent<T: Serialize>(report: &T) -> anyhow::Result<ExitCode> {
    println!("{}", serde_json::to_string(report)?);
    Ok(ExitCode::SUCCESS)
}

/// A `/proc/self/status` field in kB (`VmHWM:`, `VmRSS:`), in bytes; 0 where there is none.
fn proc_status_bytes(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or(0)
}

/// `VmHWM` (peak resident set) of this process, in bytes.
pub fn peak_rss_bytes() -> u64 {
    proc_status_bytes("VmHWM:")
}

/// `VmRSS` (current resident set) of this process, in bytes.
pub fn current_rss_bytes() -> u64 {
    proc_status_bytes("VmRSS:")
}

// ---------------------------------------------------------------------------------------------
// Synthetic inputs and batches

/// `len` values drawn from N(0, 1).
pub fn normal_vec(rng: &mut init::Rng, len: usize) -> Vec<f32> {
    let mut v = vec![0.0; len];
    init::fill_normal(rng, &mut v, 1.0);
    v
}

/// A classification batch of `b` sequences (batch × seq_len ids, token types and attention
/// mask, one label per sequence).
pub struct ClassBatch {
    pub ids: Vec<u32>,
    pub types: Vec<u32>,
    pub mask: Vec<u32>,
    pub labels: Vec<usize>,
}

impl ClassBatch {
    /// Uniform ids, two segments, the last 10% of positions padded in every other sequence,
    /// uniform labels, all drawn from `seed`.
    pub fn random(cfg: &EncoderConfig, b: usize, seed: u64) -> Self {
        let t = cfg.seq_len;
        let n = b * t;
        let mut rng = init::rng(seed);
        let ids_d = Uniform::new(0, cfg.vocab_size as u32).expect("vocab ≥ 1");
        let ids = (0..n).map(|_| ids_d.sample(&mut rng)).collect();
        let types = (0..n).map(|i| ((i % t) >= t / 2) as u32).collect();
        let pad = t / 10;
        let mask = (0..n)
            .map(|i| {
                let (s, p) = (i / t, i % t);
                (s % 2 == 0 || p == 0 || p < t - pad) as u32
            })
            .collect();
        let lab_d = Uniform::new(0, cfg.num_labels.max(1)).expect("labels ≥ 1");
        let labels = (0..b).map(|_| lab_d.sample(&mut rng)).collect();
        ClassBatch {
            ids,
            types,
            mask,
            labels,
        }
    }

    /// Spread-out ids (a fixed stride through the vocabulary), none of them padding; one
    /// segment, no padding, labels cycling through the classes.
    pub fn strided(cfg: &EncoderConfig, b: usize) -> Self {
        let n = b * cfg.seq_len;
        ClassBatch {
            ids: (0..n)
                .map(|i| (1 + (i * 7919) % (cfg.vocab_size - 1)) as u32)
                .collect(),
            types: vec![0; n],
            mask: vec![1; n],
            labels: (0..b).map(|i| i % cfg.num_labels).collect(),
        }
    }

    /// Copies the batch into an encoder state made for it.
    pub fn load(&self, st: &mut EncoderState) -> anyhow::Result<()> {
        Ok(st.load(&self.ids, &self.types, &self.mask, &self.labels)?)
    }
}

/// A masked-LM batch of `b` sequences of `t` tokens: random ordinary ids (1000 ≤ id < vocab),
/// and `rows` labelled positions per sequence (never the first or the last), drawn from `seed`.
pub struct MlmBatch {
    pub ids: Vec<u32>,
    pub mask: Vec<u32>,
    /// The id at a labelled position, −100 elsewhere.
    pub labels: Vec<i32>,
    /// Flat positions of the labels, ascending.
    pub selected: Vec<u32>,
}

impl MlmBatch {
    pub fn random(b: usize, t: usize, rows: usize, vocab: u32, seed: u64) -> Self {
        let mut rng = init::rng(seed);
        let ids: Vec<u32> = (0..b * t).map(|_| rng.random_range(1000..vocab)).collect();
        let mask = vec![1u32; b * t];
        let mut labels = vec![-100i32; b * t];
        let mut selected = Vec::new();
        for r in 0..b {
            let mut pos: Vec<usize> = (1..t - 1).collect();
            pos.shuffle(&mut rng);
            let mut pos = pos[..rows.min(t - 2)].to_vec();
            pos.sort_unstable();
            for p in pos {
                let i = r * t + p;
                labels[i] = ids[i] as i32;
                selected.push(i as u32);
            }
        }
        MlmBatch {
            ids,
            mask,
            labels,
            selected,
        }
    }

    /// Copies the batch into an encoder state made for it.
    pub fn load(&self, st: &mut EncoderState) -> anyhow::Result<()> {
        Ok(st.load_mlm(&self.ids, &self.mask, &self.labels, &self.selected)?)
    }
}

/// A stepper for `model` with AdamW (`cfg`) at a constant rate, no rank schedule and no
/// clipping, as `bench rank` and `bench mlm` time the one training step.
pub(crate) fn plain_stepper(cfg: AdamWConfig, model: &mut Encoder) -> Stepper {
    let opt = Optimizer::new(cfg, None, model);
    Stepper::plain(opt, model)
}

// ---------------------------------------------------------------------------------------------
// Tables

/// A fixed-width text table: the first column left-aligned, the others right-aligned.
pub struct TextTable(pub &'static [usize]);

impl TextTable {
    /// One line of cells (the header: the column names), separated by one space.
    pub fn line<S: AsRef<str>>(&self, cells: &[S]) -> String {
        let mut s = String::new();
        for (i, (c, &w)) in cells.iter().zip(self.0).enumerate() {
            let c = c.as_ref();
            if i == 0 {
                s.push_str(&format!("{c:<w$}"));
            } else {
                s.push_str(&format!(" {c:>w$}"));
            }
        }
        s
    }
}

/// A Markdown table's header: the column names and the rule (`---:` right-aligns the columns
/// after the first when `numbers_right`).
pub fn md_header(columns: &[&str], numbers_right: bool) -> String {
    let rule: Vec<&str> = (0..columns.len())
        .map(|i| {
            if i > 0 && numbers_right {
                "---:"
            } else {
                "---"
            }
        })
        .collect();
    format!("{}\n|{}|", md_row(columns), rule.join("|"))
}

/// A Markdown table row.
pub fn md_row<S: AsRef<str>>(cells: &[S]) -> String {
    let cells: Vec<&str> = cells.iter().map(|c| c.as_ref()).collect();
    format!("| {} |", cells.join(" | "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
        assert_eq!(pooled_median([&[1.0, 5.0][..], &[3.0][..]]), Some(3.0));
        assert_eq!(pooled_median([&[][..]]), None);
    }

    #[test]
    fn text_table_pads_like_format_widths() {
        let t = TextTable(&[6, 5, 10]);
        assert_eq!(
            t.line(&["tt", "2", &format!("{:.2}", 1.234)]),
            format!("{:<6} {:>5} {:>10.2}", "tt", 2, 1.234)
        );
    }

    #[test]
    fn markdown_header_and_row() {
        assert_eq!(
            md_header(&["a", "b", "c"], true),
            "| a | b | c |\n|---|---:|---:|"
        );
        assert_eq!(md_header(&["a", "b"], false), "| a | b |\n|---|---|");
        assert_eq!(md_row(&["x".to_string(), "1".into()]), "| x | 1 |");
    }

    #[test]
    fn interleave_gives_every_variant_its_samples() {
        let (mut a, mut b) = (0, 0);
        let samples = {
            let mut v: Vec<Box<dyn FnMut() + '_>> = vec![Box::new(|| a += 1), Box::new(|| b += 1)];
            interleave(&mut v, 3, 1, 2, &[1, 4])
        };
        assert_eq!(samples.iter().map(Vec::len).collect::<Vec<_>>(), [6, 6]);
        assert_eq!((a, b), (6 + 3, 24 + 3), "one untimed call per visit");
    }

    #[test]
    fn each_round_starts_at_the_next_variant() {
        let order = std::cell::RefCell::new(Vec::new());
        {
            let log = &order;
            let mut v: Vec<Box<dyn FnMut() + '_>> = (0..3)
                .map(|i| Box::new(move || log.borrow_mut().push(i)) as Box<dyn FnMut()>)
                .collect();
            interleave(&mut v, 4, 0, 1, &[1, 1, 1]);
        }
        assert_eq!(order.into_inner(), [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]);
    }

    #[test]
    fn peak_rss_is_at_least_the_current_rss() {
        // The current size first: the process may grow between the two reads (other tests
        // run on other threads), and the peak read after it covers that growth.
        let now = current_rss_bytes();
        let peak = peak_rss_bytes();
        assert!(now > 0 && peak >= now, "peak {peak}, current {now}");
    }
}
