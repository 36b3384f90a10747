//! f32 GEMM backend benchmark for comera: gemm 0.19, faer 0.24, matrixmultiply 0.3,
//! OpenBLAS (system libopenblas via cblas_sgemm).
//!
//! All matrices are row-major. For each shape (m, k, n) three operand layouts are timed:
//!   NN: C = A·B,   A stored m×k, B stored k×n
//!   TN: C = Aᵀ·B,  A stored k×m, B stored k×n
//!   NT: C = A·Bᵀ,  A stored m×k, B stored n×k
//! C is always m×n row-major and is overwritten (beta = 0 semantics).
//!
//! Usage: cargo run --release [-- --only gemm,faer,mm,blas] [--quick] [--passes N]

use std::hint::black_box;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------- OpenBLAS FFI
#[allow(non_camel_case_types)]
type CBLAS_INT = i32; // Debian's libopenblas0 is the LP64 (32-bit int) build.
const CBLAS_ROW_MAJOR: i32 = 101;
const CBLAS_NO_TRANS: i32 = 111;
const CBLAS_TRANS: i32 = 112;

#[link(name = "openblas")]
extern "C" {
    fn cblas_sgemm(
        layout: i32,
        trans_a: i32,
        trans_b: i32,
        m: CBLAS_INT,
        n: CBLAS_INT,
        k: CBLAS_INT,
        alpha: f32,
        a: *const f32,
        lda: CBLAS_INT,
        b: *const f32,
        ldb: CBLAS_INT,
        beta: f32,
        c: *mut f32,
        ldc: CBLAS_INT,
    );
    fn openblas_set_num_threads(n: i32);
    fn openblas_get_num_threads() -> i32;
    fn openblas_get_corename() -> *const std::os::raw::c_char;
    fn openblas_get_config() -> *const std::os::raw::c_char;
}

// ---------------------------------------------------------------- problem layout
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    NN,
    TN,
    NT,
}

impl Op {
    fn label(self) -> &'static str {
        match self {
            Op::NN => "A·B",
            Op::TN => "Aᵀ·B",
            Op::NT => "A·Bᵀ",
        }
    }
}

/// One GEMM problem: logical C(m×n) = opA(m×k) · opB(k×n), row-major storage.
#[derive(Clone, Copy, Debug)]
struct Prob {
    m: usize,
    k: usize,
    n: usize,
    op: Op,
}

impl Prob {
    /// (row stride, col stride) of the *logical* m×k A inside its storage.
    fn a_strides(&self) -> (isize, isize) {
        match self.op {
            Op::NN | Op::NT => (self.k as isize, 1), // stored m×k
            Op::TN => (1, self.m as isize),          // stored k×m, read transposed
        }
    }
    /// (row stride, col stride) of the *logical* k×n B inside its storage.
    fn b_strides(&self) -> (isize, isize) {
        match self.op {
            Op::NN | Op::TN => (self.n as isize, 1), // stored k×n
            Op::NT => (1, self.k as isize),          // stored n×k, read transposed
        }
    }
    fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
}

// ---------------------------------------------------------------- backends
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Backend {
    Gemm1,
    GemmRayon2,
    FaerSeq,
    FaerRayon2,
    Mm,
    Blas1,
    Blas2,
}

const ALL_BACKENDS: [Backend; 7] = [
    Backend::Gemm1,
    Backend::GemmRayon2,
    Backend::FaerSeq,
    Backend::FaerRayon2,
    Backend::Mm,
    Backend::Blas1,
    Backend::Blas2,
];

impl Backend {
    fn label(self) -> &'static str {
        match self {
            Backend::Gemm1 => "gemm 1T",
            Backend::GemmRayon2 => "gemm Rayon(2)",
            Backend::FaerSeq => "faer Seq",
            Backend::FaerRayon2 => "faer rayon(2)",
            #[cfg(not(feature = "mm-threading"))]
            Backend::Mm => "matrixmultiply 1T",
            #[cfg(feature = "mm-threading")]
            Backend::Mm => "matrixmultiply threading",
            Backend::Blas1 => "OpenBLAS 1T",
            Backend::Blas2 => "OpenBLAS 2T",
        }
    }
    fn family(self) -> &'static str {
        match self {
            Backend::Gemm1 | Backend::GemmRayon2 => "gemm",
            Backend::FaerSeq | Backend::FaerRayon2 => "faer",
            Backend::Mm => "mm",
            Backend::Blas1 | Backend::Blas2 => "blas",
        }
    }

    /// Prepare global state for this backend (OpenBLAS thread count).
    fn enter(self) {
        unsafe {
            match self {
                Backend::Blas1 => openblas_set_num_threads(1),
                Backend::Blas2 => openblas_set_num_threads(2),
                _ => {}
            }
        }
    }

    /// Pause after a block of this backend so its worker threads stop spinning
    /// before the next backend is timed (OpenBLAS pthreads busy-wait ~2^28 cycles).
    fn cooldown(self) -> Duration {
        match self {
            Backend::Blas2 => Duration::from_millis(250),
            Backend::GemmRayon2 | Backend::FaerRayon2 => Duration::from_millis(30),
            _ => Duration::from_millis(10),
        }
    }

    /// C := opA · opB (overwrite).
    #[inline(never)]
    fn run(self, p: &Prob, a: &[f32], b: &[f32], c: &mut [f32]) {
        let (m, k, n) = (p.m, p.k, p.n);
        let (a_rs, a_cs) = p.a_strides();
        let (b_rs, b_cs) = p.b_strides();
        debug_assert_eq!(a.len(), m * k);
        debug_assert_eq!(b.len(), k * n);
        debug_assert_eq!(c.len(), m * n);
        match self {
            Backend::Gemm1 | Backend::GemmRayon2 => {
                let par = if self == Backend::Gemm1 {
                    gemm::Parallelism::None
                } else {
                    gemm::Parallelism::Rayon(2)
                };
                // gemm convention: dst := alpha·dst + beta·lhs·rhs; strides given as (cs, rs).
                // read_dst = false => alpha is ignored and dst is overwritten.
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        c.as_mut_ptr(),
                        1,          // dst_cs
                        n as isize, // dst_rs
                        false,      // read_dst
                        a.as_ptr(),
                        a_cs,
                        a_rs,
                        b.as_ptr(),
                        b_cs,
                        b_rs,
                        0.0f32, // alpha (dst scale)
                        1.0f32, // beta (product scale)
                        false,
                        false,
                        false,
                        par,
                    );
                }
            }
            Backend::FaerSeq | Backend::FaerRayon2 => {
                use faer::linalg::matmul::matmul;
                use faer::{Accum, MatMut, MatRef, Par};
                let par = if self == Backend::FaerSeq {
                    Par::Seq
                } else {
                    Par::rayon(2)
                };
                let lhs = match p.op {
                    Op::TN => MatRef::from_row_major_slice(a, k, m).transpose(),
                    _ => MatRef::from_row_major_slice(a, m, k),
                };
                let rhs = match p.op {
                    Op::NT => MatRef::from_row_major_slice(b, n, k).transpose(),
                    _ => MatRef::from_row_major_slice(b, k, n),
                };
                let dst = MatMut::from_row_major_slice_mut(c, m, n);
                matmul(dst, Accum::Replace, lhs, rhs, 1.0f32, par);
            }
            Backend::Mm => unsafe {
                // matrixmultiply convention: C := alpha·A·B + beta·C; strides given as (rs, cs).
                matrixmultiply::sgemm(
                    m,
                    k,
                    n,
                    1.0,
                    a.as_ptr(),
                    a_rs,
                    a_cs,
                    b.as_ptr(),
                    b_rs,
                    b_cs,
                    0.0,
                    c.as_mut_ptr(),
                    n as isize,
                    1,
                );
            },
            Backend::Blas1 | Backend::Blas2 => {
                let (ta, lda) = match p.op {
                    Op::TN => (CBLAS_TRANS, m),
                    _ => (CBLAS_NO_TRANS, k),
                };
                let (tb, ldb) = match p.op {
                    Op::NT => (CBLAS_TRANS, k),
                    _ => (CBLAS_NO_TRANS, n),
                };
                unsafe {
                    cblas_sgemm(
                        CBLAS_ROW_MAJOR,
                        ta,
                        tb,
                        m as CBLAS_INT,
                        n as CBLAS_INT,
                        k as CBLAS_INT,
                        1.0,
                        a.as_ptr(),
                        lda as CBLAS_INT,
                        b.as_ptr(),
                        ldb as CBLAS_INT,
                        0.0,
                        c.as_mut_ptr(),
                        n as CBLAS_INT,
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------- data + reference
struct Rng(u64);
impl Rng {
    fn next_f32(&mut self) -> f32 {
        // xorshift64*, mapped to [-1, 1)
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let v = self.0.wrapping_mul(0x2545F4914F6CDD1D);
        ((v >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, len: usize) -> Vec<f32> {
        (0..len).map(|_| self.next_f32()).collect()
    }
}

/// Naive triple loop with f64 accumulation, honouring the same strides.
fn reference(p: &Prob, a: &[f32], b: &[f32]) -> Vec<f32> {
    let (a_rs, a_cs) = p.a_strides();
    let (b_rs, b_cs) = p.b_strides();
    let mut c = vec![0.0f32; p.m * p.n];
    for i in 0..p.m {
        for j in 0..p.n {
            let mut acc = 0.0f64;
            for l in 0..p.k {
                let av = a[(i as isize * a_rs + l as isize * a_cs) as usize] as f64;
                let bv = b[(l as isize * b_rs + j as isize * b_cs) as usize] as f64;
                acc += av * bv;
            }
            c[i * p.n + j] = acc as f32;
        }
    }
    c
}

fn max_abs_err(x: &[f32], y: &[f32]) -> f32 {
    x.iter()
        .zip(y)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, |m, e| if e.is_nan() || m.is_nan() { f32::NAN } else { m.max(e) })
}

// ---------------------------------------------------------------- timing
struct Cell {
    samples_ns_per_call: Vec<f64>, // one entry per timed sample, already divided by inner reps
    pass_medians: Vec<f64>,
    inner: usize,
    max_err: f32,
    dirty: bool, // a block still saw foreign CPU load after all retries
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// A workload: `batch` independent problems of the same shape, run back-to-back as one "call unit".
struct Workload {
    name: String,
    prob: Prob,
    batch: usize,
    a: Vec<Vec<f32>>,
    b: Vec<Vec<f32>>,
    c: Vec<Vec<f32>>,
    reference: Vec<Vec<f32>>, // reference for each batch member (all checked)
}

impl Workload {
    fn new(name: &str, m: usize, k: usize, n: usize, op: Op, batch: usize, rng: &mut Rng) -> Self {
        let prob = Prob { m, k, n, op };
        let a: Vec<Vec<f32>> = (0..batch).map(|_| rng.vec(m * k)).collect();
        let b: Vec<Vec<f32>> = (0..batch).map(|_| rng.vec(k * n)).collect();
        let c = (0..batch).map(|_| vec![f32::NAN; m * n]).collect();
        let reference = (0..batch).map(|i| reference(&prob, &a[i], &b[i])).collect();
        Workload { name: name.to_string(), prob, batch, a, b, c, reference }
    }

    #[inline(never)]
    fn run_unit(&mut self, be: Backend) {
        for i in 0..self.batch {
            be.run(&self.prob, &self.a[i], &self.b[i], &mut self.c[i]);
        }
        black_box(&mut self.c);
    }

    fn check(&mut self, be: Backend) -> f32 {
        for c in self.c.iter_mut() {
            c.fill(f32::NAN);
        }
        self.run_unit(be);
        let mut worst = 0.0f32;
        for i in 0..self.batch {
            let e = max_abs_err(&self.c[i], &self.reference[i]);
            worst = if e.is_nan() { f32::NAN } else { worst.max(e) };
        }
        worst
    }

    fn flops_per_call(&self) -> f64 {
        self.prob.flops()
    }
}

struct Config {
    passes: usize,
    samples_per_pass: usize,
    min_sample: Duration,
    warmup: Duration,
    foreign_thresh: f64,
    max_retries: usize,
    max_wait: Duration,
}

// ---------------------------------------------------------------- contention gating
// The machine is shared (2 cores; other jobs may compile concurrently). We read /proc/stat
// (all CPUs busy jiffies) and /proc/self/stat (this process, all threads) around each block;
// the difference is CPU time burnt by *other* processes. Blocks with foreign load are redone
// after waiting for the machine to go quiet.
fn cpu_jiffies() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let mut busy = 0u64;
    if let Some(line) = stat.lines().next() {
        let f: Vec<u64> = line.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
        // user nice system idle iowait irq softirq steal
        if f.len() >= 8 {
            busy = f[0] + f[1] + f[2] + f[5] + f[6] + f[7];
        }
    }
    let me = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let mut mine = 0u64;
    if let Some(close) = me.rfind(')') {
        let f: Vec<&str> = me[close + 2..].split_whitespace().collect();
        // after ")": state(0) ... utime is field 14 overall => index 11 here, stime index 12
        if f.len() > 12 {
            mine = f[11].parse::<u64>().unwrap_or(0) + f[12].parse::<u64>().unwrap_or(0);
        }
    }
    (busy, mine)
}

/// Foreign CPU usage (in cores) between two snapshots over `secs` wall seconds (USER_HZ = 100).
fn foreign_cores(a: (u64, u64), b: (u64, u64), secs: f64) -> f64 {
    let busy = b.0.saturating_sub(a.0) as f64;
    let mine = b.1.saturating_sub(a.1) as f64;
    ((busy - mine).max(0.0) / 100.0) / secs.max(1e-3)
}

/// Wait (up to `max_wait`) until other processes use < `thresh` cores over a 300 ms window.
fn wait_quiet(thresh: f64, max_wait: Duration) -> bool {
    let start = Instant::now();
    loop {
        let a = cpu_jiffies();
        std::thread::sleep(Duration::from_millis(300));
        let b = cpu_jiffies();
        if foreign_cores(a, b, 0.3) < thresh {
            return true;
        }
        if start.elapsed() > max_wait {
            return false;
        }
    }
}

struct GateStats {
    retries: usize,
    contaminated_blocks: usize,
    waited: Duration,
}

/// Time one backend on one workload for one pass. Returns per-call ns samples and whether
/// the block still saw foreign CPU load after the allowed retries.
fn time_block(
    w: &mut Workload,
    be: Backend,
    cfg: &Config,
    inner: &mut usize,
    gate: &mut GateStats,
) -> (Vec<f64>, bool) {
    let mut attempt = 0;
    loop {
        be.enter();
        let snap0 = cpu_jiffies();
        let wall0 = Instant::now();
        // Warm-up (also lets thread pools spin up) for at least cfg.warmup and 3 units.
        let t0 = Instant::now();
        let mut n = 0;
        while n < 3 || t0.elapsed() < cfg.warmup {
            w.run_unit(be);
            n += 1;
        }
        // Calibrate inner repetitions once so every sample lasts >= min_sample.
        if *inner == 0 {
            let t = Instant::now();
            w.run_unit(be);
            let one = t.elapsed().as_secs_f64().max(1e-9);
            *inner = ((cfg.min_sample.as_secs_f64() / one).ceil() as usize).max(1);
        }
        let mut out = Vec::with_capacity(cfg.samples_per_pass);
        for _ in 0..cfg.samples_per_pass {
            let t = Instant::now();
            for _ in 0..*inner {
                w.run_unit(be);
            }
            let dt = t.elapsed().as_secs_f64();
            out.push(dt * 1e9 / (*inner * w.batch) as f64);
        }
        let foreign = foreign_cores(snap0, cpu_jiffies(), wall0.elapsed().as_secs_f64());
        std::thread::sleep(be.cooldown());
        if foreign < cfg.foreign_thresh {
            return (out, false);
        }
        attempt += 1;
        if attempt > cfg.max_retries {
            gate.contaminated_blocks += 1;
            return (out, true);
        }
        gate.retries += 1;
        let t = Instant::now();
        wait_quiet(cfg.foreign_thresh * 0.5, cfg.max_wait);
        gate.waited += t.elapsed();
    }
}

fn fmt_time(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e4 {
        format!("{:.0} µs", ns / 1e3)
    } else if ns >= 1e3 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{:.2} µs", ns / 1e3)
    }
}

fn cstr(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return "?".into();
    }
    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim().to_string()
}

fn main() {
    #[cfg(feature = "mm-threading")]
    if std::env::var_os("MATMUL_NUM_THREADS").is_none() {
        // Read lazily by matrixmultiply on first call; set before any call.
        std::env::set_var("MATMUL_NUM_THREADS", "2");
    }

    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut only: Option<Vec<String>> = None;
    let mut quick = false;
    let mut shape_filter: Option<String> = None;
    let mut passes = 3usize;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--only" => {
                i += 1;
                only = Some(args[i].split(',').map(|s| s.trim().to_string()).collect());
            }
            "--quick" => quick = true,
            "--shape" => {
                i += 1;
                shape_filter = Some(args[i].clone());
            }
            "--passes" => {
                i += 1;
                passes = args[i].parse().expect("--passes N");
            }
            other => panic!("unknown argument {other}"),
        }
        i += 1;
    }
    let backends: Vec<Backend> = ALL_BACKENDS
        .iter()
        .copied()
        .filter(|b| only.as_ref().map_or(true, |o| o.iter().any(|x| x == b.family())))
        .collect();

    let cfg = Config {
        passes,
        samples_per_pass: if quick { 5 } else { 15 },
        min_sample: Duration::from_millis(2),
        warmup: Duration::from_millis(if quick { 20 } else { 100 }),
        foreign_thresh: 0.10,
        max_retries: 6,
        max_wait: Duration::from_secs(60),
    };
    let mut gate = GateStats { retries: 0, contaminated_blocks: 0, waited: Duration::ZERO };

    // ---------------- environment report
    println!("# gemm-bench");
    println!();
    println!("- loadavg at start: {}", loadavg());
    println!(
        "- OPENBLAS_CORETYPE={:?} OPENBLAS_NUM_THREADS={:?} OMP_NUM_THREADS={:?} RAYON_NUM_THREADS={:?} MATMUL_NUM_THREADS={:?}",
        std::env::var("OPENBLAS_CORETYPE").ok(),
        std::env::var("OPENBLAS_NUM_THREADS").ok(),
        std::env::var("OMP_NUM_THREADS").ok(),
        std::env::var("RAYON_NUM_THREADS").ok(),
        std::env::var("MATMUL_NUM_THREADS").ok(),
    );
    unsafe {
        println!(
            "- OpenBLAS core: {} | config: {} | default threads: {}",
            cstr(openblas_get_corename()),
            cstr(openblas_get_config()),
            openblas_get_num_threads()
        );
    }
    println!("- rayon global pool threads: {}", rayon::current_num_threads());
    println!(
        "- cpu features (runtime): avx2={} fma={} avx512f={}",
        std::is_x86_feature_detected!("avx2"),
        std::is_x86_feature_detected!("fma"),
        std::is_x86_feature_detected!("avx512f")
    );
    println!(
        "- build features: mm-threading={} x86-v4={}",
        cfg!(feature = "mm-threading"),
        cfg!(feature = "x86-v4")
    );
    println!(
        "- method: {} passes x {} samples per (shape, op, backend); each sample >= {:?} (inner loop), warm-up >= {:?}; backends run in blocks, order reversed on odd passes; a block is redone (up to {}x, after waiting for quiet) if other processes used > {} cores during it",
        cfg.passes, cfg.samples_per_pass, cfg.min_sample, cfg.warmup, cfg.max_retries, cfg.foreign_thresh
    );
    println!();

    let mut rng = Rng(0x9E3779B97F4A7C15);

    // ---------------- correctness on small, odd shapes (all ops, all backends)
    println!("## Correctness vs naive f64-accumulated triple loop (max abs error)");
    println!();
    print!("| shape m×k×n | op |");
    for b in &backends {
        print!(" {} |", b.label());
    }
    println!();
    print!("|---|---|");
    for _ in &backends {
        print!("---|");
    }
    println!();
    let mut any_bad = false;
    for &(m, k, n) in &[(17usize, 33usize, 29usize), (8, 30, 30), (1, 5, 3), (67, 129, 45)] {
        for op in [Op::NN, Op::TN, Op::NT] {
            let mut w = Workload::new("check", m, k, n, op, 1, &mut rng);
            print!("| {m}×{k}×{n} | {} |", op.label());
            for &be in &backends {
                be.enter();
                let e = w.check(be);
                if !(e <= 1e-4 * k as f32) {
                    any_bad = true;
                }
                print!(" {:.1e} |", e);
            }
            println!();
        }
    }
    println!();
    if any_bad {
        println!("**ERROR: some backend disagrees with the reference; aborting.**");
        std::process::exit(1);
    }

    // ---------------- benchmark shapes
    let shapes: Vec<(&str, usize, usize, usize, usize)> = vec![
        ("square", 1024, 1024, 1024, 1),
        ("tall-skinny", 4096, 768, 30, 1),
        ("tall-skinny", 4096, 30, 768, 1),
        ("tall-skinny (Tᵀ·dY)", 30, 4096, 768, 1),
        ("core merge", 64, 30, 240, 1),
        ("core", 8, 30, 900, 1),
        ("core", 900, 30, 8, 1),
        ("core", 30, 30, 30, 1),
        ("core", 12, 30, 360, 1),
        ("batched 1000×", 8, 30, 30, 1000),
    ];

    struct Row {
        name: String,
        prob: Prob,
        batch: usize,
        cells: Vec<Cell>,
    }
    let mut rows: Vec<Row> = Vec::new();

    for &(name, m, k, n, batch) in &shapes {
        if let Some(f) = &shape_filter {
            if !format!("{m}x{k}x{n}").contains(f.as_str()) {
                continue;
            }
        }
        for op in [Op::NN, Op::TN, Op::NT] {
            let mut w = Workload::new(name, m, k, n, op, batch, &mut rng);
            let mut cells: Vec<Cell> = Vec::new();
            let mut inners = vec![0usize; backends.len()];
            let mut per_pass: Vec<Vec<Vec<f64>>> = vec![Vec::new(); backends.len()];
            let mut errs = vec![0.0f32; backends.len()];
            let mut dirty_cells = vec![false; backends.len()];
            for (bi, &be) in backends.iter().enumerate() {
                be.enter();
                errs[bi] = w.check(be);
                let tol = 1e-4 * k as f32;
                if !(errs[bi] <= tol) {
                    eprintln!(
                        "WRONG RESULT: {} {}x{}x{} {:?}: max abs err {}",
                        be.label(),
                        m,
                        k,
                        n,
                        op,
                        errs[bi]
                    );
                }
            }
            std::thread::sleep(Duration::from_millis(300));
            for pass in 0..cfg.passes {
                let order: Vec<usize> = if pass % 2 == 0 {
                    (0..backends.len()).collect()
                } else {
                    (0..backends.len()).rev().collect()
                };
                for bi in order {
                    let (s, dirty) = time_block(&mut w, backends[bi], &cfg, &mut inners[bi], &mut gate);
                    per_pass[bi].push(s);
                    if dirty {
                        dirty_cells[bi] = true;
                    }
                }
            }
            for bi in 0..backends.len() {
                let mut all: Vec<f64> = per_pass[bi].iter().flatten().copied().collect();
                let mut pm: Vec<f64> = Vec::new();
                for s in &per_pass[bi] {
                    let mut s = s.clone();
                    pm.push(median(&mut s));
                }
                median(&mut all); // sorts
                cells.push(Cell {
                    samples_ns_per_call: all,
                    pass_medians: pm,
                    inner: inners[bi],
                    max_err: errs[bi],
                    dirty: dirty_cells[bi],
                });
            }
            // progress line on stderr
            eprint!("{name} {m}x{k}x{n} {:?}:", op);
            for (bi, c) in cells.iter().enumerate() {
                let mut s = c.samples_ns_per_call.clone();
                let pm: Vec<String> = c.pass_medians.iter().map(|&x| fmt_time(x)).collect();
                eprint!(" {}={} [{}]", backends[bi].label(), fmt_time(median(&mut s)), pm.join(" "));
            }
            eprintln!();
            rows.push(Row { name: w.name.clone(), prob: w.prob, batch, cells });
        }
    }

    // ---------------- results table
    println!("## Results: median time per call (GFLOP/s)");
    println!();
    println!("Cells: median over all samples; `~` marks cells whose pass medians differ by >15% (noisy); `!` marks cells where a block still saw other processes' CPU load after retries. Bold = fastest in row.");
    println!();
    print!("| shape m×k×n | op |");
    for b in &backends {
        print!(" {} |", b.label());
    }
    println!();
    print!("|---|---|");
    for _ in &backends {
        print!("---:|");
    }
    println!();
    let mut worst_err = vec![0.0f32; backends.len()];
    for r in &rows {
        let meds: Vec<f64> = r
            .cells
            .iter()
            .map(|c| {
                let mut s = c.samples_ns_per_call.clone();
                median(&mut s)
            })
            .collect();
        let best = meds.iter().cloned().fold(f64::INFINITY, f64::min);
        let shape = if r.batch > 1 {
            format!("{} {}×{}×{} (per call)", r.name, r.prob.m, r.prob.k, r.prob.n)
        } else {
            format!("{} {}×{}×{}", r.name, r.prob.m, r.prob.k, r.prob.n)
        };
        print!("| {} | {} |", shape, r.prob.op.label());
        for (bi, c) in r.cells.iter().enumerate() {
            worst_err[bi] = worst_err[bi].max(c.max_err);
            let t = meds[bi];
            let gf = r.prob.flops() / t; // flops per ns = GFLOP/s
            let pmin = c.pass_medians.iter().cloned().fold(f64::INFINITY, f64::min);
            let pmax = c.pass_medians.iter().cloned().fold(0.0, f64::max);
            let noisy = match (c.dirty, pmax > 1.15 * pmin) {
                (true, _) => "!",
                (false, true) => "~",
                _ => "",
            };
            let txt = format!("{}{} ({:.1})", noisy, fmt_time(t), gf);
            if t == best {
                print!(" **{}** |", txt);
            } else {
                print!(" {} |", txt);
            }
        }
        println!();
    }
    println!();
    println!("## Best pass median per cell (GFLOP/s) — least-contended estimate");
    println!();
    print!("| shape m×k×n | op |");
    for b in &backends {
        print!(" {} |", b.label());
    }
    println!();
    print!("|---|---|");
    for _ in &backends {
        print!("---:|");
    }
    println!();
    for r in &rows {
        let shape = if r.batch > 1 {
            format!("{} {}×{}×{} (per call)", r.name, r.prob.m, r.prob.k, r.prob.n)
        } else {
            format!("{} {}×{}×{}", r.name, r.prob.m, r.prob.k, r.prob.n)
        };
        print!("| {} | {} |", shape, r.prob.op.label());
        for c in &r.cells {
            let best = c.pass_medians.iter().cloned().fold(f64::INFINITY, f64::min);
            print!(" {} ({:.1}) |", fmt_time(best), r.prob.flops() / best);
        }
        println!();
    }
    println!();
    println!("Max abs error vs reference over all benchmark shapes (checked on the exact benchmark buffers):");
    println!();
    for (bi, b) in backends.iter().enumerate() {
        println!("- {}: {:.2e}", b.label(), worst_err[bi]);
    }
    println!();
    println!("Inner-loop repetitions per sample (tiny shapes):");
    println!();
    for r in &rows {
        if r.cells.iter().any(|c| c.inner > 1) {
            print!("- {} {}×{}×{} {}:", r.name, r.prob.m, r.prob.k, r.prob.n, r.prob.op.label());
            for (bi, c) in r.cells.iter().enumerate() {
                print!(" {}={}", backends[bi].label(), c.inner);
            }
            println!();
        }
    }
    let _ = Workload::flops_per_call;
    println!();
    println!(
        "- contention gating: {} block retries, {:.1} s waited for quiet, {} blocks accepted while contaminated",
        gate.retries,
        gate.waited.as_secs_f64(),
        gate.contaminated_blocks
    );
    println!("- loadavg at end: {}", loadavg());
}
