//! bf16 GEMM with f32 accumulation for AVX-512 BF16 (`vdpbf16ps`, `vcvtne2ps2bf16`).
//!
//! `C(m×n, f32) = A(m×k, f32) · B(k×n, f32)`, all operands given as strided f32 views.
//! A and B are rounded to bf16 (round-to-nearest-even, by `vcvtne2ps2bf16`) while packing;
//! products are accumulated in f32 by `vdpbf16ps`.
//!
//! Packed layouts (one "pair" = two consecutive-k bf16 values in one u32, low half = even k):
//! * A block, per strip of MR rows: `[chunk][row i < MR][16 pairs]` (chunk = 16 pairs = 32 k).
//!   From a row-major A this is a pure streaming conversion (no shuffles); the kernel reads
//!   row i's pair `l` of chunk `ch` with an embedded `{1to16}` broadcast.
//! * B panel, per strip of NR = 16·NV columns: `[pair p][col j < NR]` u32. From a row-major B
//!   this is `vcvtne2ps2bf16` of two k-rows + one `vpermw` interleave per 16 columns.
//! Both are zero-padded to whole chunks (k) and whole strips (m, n).
//!
//! Microkernel: MR×NV zmm accumulators, per pair: NV loads of B, MR broadcasts of A,
//! MR·NV `vdpbf16ps`. Blocking: jc (NC) → pc (KC) → pack B panel → ic (MC) → pack A block
//! → jr (NR) → ir (MR). Two threads: rayon::join over a split of C's rows (or columns when
//! C is wider than tall); each thread packs its own operands.

use core::arch::x86_64::*;
use std::cell::RefCell;

pub fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512bf16")
}

/// Strided read-only f32 matrix view: element (i, j) = `ptr[i*rs + j*cs]`.
#[derive(Clone, Copy)]
pub struct View {
    pub ptr: *const f32,
    pub rs: usize,
    pub cs: usize,
}
/// Strided mutable f32 matrix view.
#[derive(Clone, Copy)]
pub struct ViewMut {
    pub ptr: *mut f32,
    pub rs: usize,
    pub cs: usize,
}
unsafe impl Send for View {}
unsafe impl Sync for View {}
unsafe impl Send for ViewMut {}
unsafe impl Sync for ViewMut {}

impl View {
    pub fn new(s: &[f32], rs: usize, cs: usize) -> Self {
        View { ptr: s.as_ptr(), rs, cs }
    }
    fn t(self) -> Self {
        View { ptr: self.ptr, rs: self.cs, cs: self.rs }
    }
}
impl ViewMut {
    pub fn new(s: &mut [f32], rs: usize, cs: usize) -> Self {
        ViewMut { ptr: s.as_mut_ptr(), rs, cs }
    }
    fn t(self) -> Self {
        ViewMut { ptr: self.ptr, rs: self.cs, cs: self.rs }
    }
}

/// Microkernel shape: MR rows × NV zmm (NR = 16·NV columns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kern {
    M12N2,
    M14N2,
    M6N4,
    M7N4,
    M8N3,
    M4N4,
}
impl Kern {
    pub fn mr_nv(self) -> (usize, usize) {
        match self {
            Kern::M12N2 => (12, 2),
            Kern::M14N2 => (14, 2),
            Kern::M6N4 => (6, 4),
            Kern::M7N4 => (7, 4),
            Kern::M8N3 => (8, 3),
            Kern::M4N4 => (4, 4),
        }
    }
}

/// Cache blocking (KC in k elements, must be a multiple of 32; MC multiple of MR; NC multiple of NR —
/// they are rounded as needed).
#[derive(Clone, Copy, Debug)]
pub struct Cfg {
    pub kern_narrow: Kern, // used when n (after orientation) ≤ 32
    pub kern_wide: Kern,
    pub kc: usize,
    pub mc: usize,
    pub nc: usize,
    pub narrow_full_k: bool,
}
pub const DEFAULT_CFG: Cfg = Cfg { kern_narrow: Kern::M12N2, kern_wide: Kern::M6N4, kc: 384, mc: 192, nc: 3072, narrow_full_k: true };

// ------------------------------------------------------------------ scalar bf16 helpers

/// f32 → bf16 bits, round to nearest even (same as vcvtne2ps2bf16 for normal numbers).
#[inline]
pub fn f2bf(x: f32) -> u16 {
    let b = x.to_bits();
    if x.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    let r = b.wrapping_add(0x7fff + ((b >> 16) & 1));
    (r >> 16) as u16
}
#[inline]
pub fn bf2f(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    bf2f(f2bf(x))
}

#[inline]
fn ceil_div(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}
#[inline]
fn mask16(valid: usize) -> u16 {
    if valid >= 16 {
        0xffff
    } else {
        ((1u32 << valid) - 1) as u16
    }
}

// ------------------------------------------------------------------ packing

/// Pack rows [i0, i0+mc) × k-range [p0, p0+kc) of A into `out` (strips of MR rows).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_a(a: View, i0: usize, mc: usize, m: usize, p0: usize, kc: usize, mr: usize, out: *mut u32) {
    let chunks = ceil_div(kc, 32);
    let strips = ceil_div(mc, mr);
    let strip_sz = chunks * mr * 16;
    for s in 0..strips {
        let sp = out.add(s * strip_sz);
        for r in 0..mr {
            let i = i0 + s * mr + r;
            let row_ok = s * mr + r < mc && i < m;
            for ch in 0..chunks {
                let dst = sp.add(ch * mr * 16 + r * 16);
                if !row_ok {
                    _mm512_storeu_si512(dst as *mut _, _mm512_setzero_si512());
                    continue;
                }
                let kk = ch * 32;
                let valid = kc - kk; // > 0
                if a.cs == 1 {
                    let src = a.ptr.wrapping_add(i * a.rs + p0 + kk);
                    let (lo, hi) = if valid >= 32 {
                        (_mm512_loadu_ps(src), _mm512_loadu_ps(src.add(16)))
                    } else {
                        let lo = _mm512_maskz_loadu_ps(mask16(valid), src);
                        let hi = if valid > 16 { _mm512_maskz_loadu_ps(mask16(valid - 16), src.wrapping_add(16)) } else { _mm512_setzero_ps() };
                        (lo, hi)
                    };
                    let v: __m512bh = _mm512_cvtne2ps_pbh(hi, lo);
                    _mm512_storeu_si512(dst as *mut _, core::mem::transmute::<__m512bh, __m512i>(v));
                } else {
                    // generic strided path (scalar)
                    for l in 0..16 {
                        let k0 = kk + 2 * l;
                        let x0 = if k0 < kc { *a.ptr.add(i * a.rs + (p0 + k0) * a.cs) } else { 0.0 };
                        let x1 = if k0 + 1 < kc { *a.ptr.add(i * a.rs + (p0 + k0 + 1) * a.cs) } else { 0.0 };
                        *dst.add(l) = f2bf(x0) as u32 | ((f2bf(x1) as u32) << 16);
                    }
                }
            }
        }
    }
}

/// Pack k-range [p0, p0+kc) × columns [j0, j0+nc) of B into `out` (strips of NR = 16·NV cols).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_b(b: View, p0: usize, kc: usize, j0: usize, nc: usize, nv: usize, out: *mut u32) {
    let nr = 16 * nv;
    let chunks = ceil_div(kc, 32);
    let pairs = chunks * 16;
    let strips = ceil_div(nc, nr);
    let strip_sz = pairs * nr;
    // word permutation: out[2t] = lo[t], out[2t+1] = hi[t] (lo = words 0..16, hi = words 16..32)
    let idx: [u16; 32] = core::array::from_fn(|w| if w % 2 == 0 { (w / 2) as u16 } else { (16 + w / 2) as u16 });
    let idx = _mm512_loadu_si512(idx.as_ptr() as *const _);
    for s in 0..strips {
        let sp = out.add(s * strip_sz);
        let jb = s * nr;
        if b.cs == 1 {
            for p in 0..pairs {
                let k0 = 2 * p;
                for v in 0..nv {
                    let dst = sp.add(p * nr + v * 16);
                    let jv = jb + v * 16;
                    let valid = nc.saturating_sub(jv);
                    if k0 >= kc || valid == 0 {
                        _mm512_storeu_si512(dst as *mut _, _mm512_setzero_si512());
                        continue;
                    }
                    let m = mask16(valid);
                    let src = b.ptr.wrapping_add((p0 + k0) * b.rs + j0 + jv);
                    let lo = _mm512_maskz_loadu_ps(m, src);
                    let hi = if k0 + 1 < kc { _mm512_maskz_loadu_ps(m, src.wrapping_add(b.rs)) } else { _mm512_setzero_ps() };
                    let cv = core::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo));
                    _mm512_storeu_si512(dst as *mut _, _mm512_permutexvar_epi16(idx, cv));
                }
            }
        } else if b.rs == 1 {
            // B stored transposed (k contiguous per column): convert 32 k at a time, scatter pairs.
            for jj in 0..nr {
                let j = jb + jj;
                if j >= nc {
                    for p in 0..pairs {
                        *sp.add(p * nr + jj) = 0;
                    }
                    continue;
                }
                for ch in 0..chunks {
                    let kk = ch * 32;
                    let valid = kc - kk;
                    let src = b.ptr.wrapping_add((j0 + j) * b.cs + p0 + kk);
                    let lo = _mm512_maskz_loadu_ps(mask16(valid), src);
                    let hi = if valid > 16 {
                        _mm512_maskz_loadu_ps(mask16(valid - 16), src.wrapping_add(16))
                    } else {
                        _mm512_setzero_ps()
                    };
                    let mut tmp = [0u32; 16];
                    _mm512_storeu_si512(tmp.as_mut_ptr() as *mut _, core::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
                    for l in 0..16 {
                        *sp.add((ch * 16 + l) * nr + jj) = tmp[l];
                    }
                }
            }
        } else {
            for p in 0..pairs {
                let k0 = 2 * p;
                for jj in 0..nr {
                    let j = jb + jj;
                    let val = if j < nc && k0 < kc {
                        let x0 = *b.ptr.add((p0 + k0) * b.rs + (j0 + j) * b.cs);
                        let x1 = if k0 + 1 < kc { *b.ptr.add((p0 + k0 + 1) * b.rs + (j0 + j) * b.cs) } else { 0.0 };
                        f2bf(x0) as u32 | ((f2bf(x1) as u32) << 16)
                    } else {
                        0
                    };
                    *sp.add(p * nr + jj) = val;
                }
            }
        }
    }
}

// ------------------------------------------------------------------ microkernel

#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
#[inline]
unsafe fn kernel<const MR: usize, const NV: usize>(
    chunks: usize,
    a: *const u32,
    b: *const u32,
    c: *mut f32,
    c_rs: usize,
    mr_eff: usize,
    masks: [u16; NV],
    accumulate: bool,
) {
    let mut acc = [[_mm512_setzero_ps(); NV]; MR];
    let mut a = a;
    let mut b = b;
    for _ in 0..chunks {
        for l in 0..16 {
            let mut bv = [_mm512_setzero_si512(); NV];
            for v in 0..NV {
                bv[v] = _mm512_loadu_si512(b.add(l * NV * 16 + v * 16) as *const _);
            }
            for i in 0..MR {
                let av = _mm512_set1_epi32(*a.add(i * 16 + l) as i32);
                let avb = core::mem::transmute::<__m512i, __m512bh>(av);
                for v in 0..NV {
                    acc[i][v] = _mm512_dpbf16_ps(acc[i][v], avb, core::mem::transmute::<__m512i, __m512bh>(bv[v]));
                }
            }
        }
        a = a.add(MR * 16);
        b = b.add(16 * NV * 16);
    }
    for i in 0..MR {
        if i < mr_eff {
            let row = c.add(i * c_rs);
            for v in 0..NV {
                let p = row.wrapping_add(v * 16);
                let m = masks[v];
                if m == 0xffff {
                    let x = if accumulate { _mm512_add_ps(_mm512_loadu_ps(p), acc[i][v]) } else { acc[i][v] };
                    _mm512_storeu_ps(p, x);
                } else if m != 0 {
                    let x = if accumulate { _mm512_add_ps(_mm512_maskz_loadu_ps(m, p), acc[i][v]) } else { acc[i][v] };
                    _mm512_mask_storeu_ps(p, m, x);
                }
            }
        }
    }
}

// ------------------------------------------------------------------ driver

/// 64-byte aligned, zero-initialised u32 buffer (packed panels are written in whole cache lines).
pub struct ABuf {
    v: Vec<u32>,
    off: usize,
    len: usize,
}
impl ABuf {
    pub const fn new() -> Self {
        ABuf { v: Vec::new(), off: 0, len: 0 }
    }
    fn zeroed(len: usize) -> Self {
        let mut b = ABuf::new();
        b.ensure(len);
        b
    }
    fn ensure(&mut self, len: usize) {
        if self.len < len {
            self.v = vec![0u32; len + 16];
            self.off = (16 - (self.v.as_ptr() as usize / 4) % 16) % 16;
            self.len = len;
        }
    }
    fn ptr(&self) -> *const u32 {
        unsafe { self.v.as_ptr().add(self.off) }
    }
    fn mut_ptr(&mut self) -> *mut u32 {
        unsafe { self.v.as_mut_ptr().add(self.off) }
    }
}

#[derive(Clone, Copy)]
enum Src {
    F32(View),
    /// pre-packed whole operand (layout of `prepack_*`), base pointer
    Packed(*const u32),
}
unsafe impl Send for Src {}
unsafe impl Sync for Src {}

thread_local! {
    static BUF_A: RefCell<ABuf> = const { RefCell::new(ABuf::new()) };
    static BUF_B: RefCell<ABuf> = const { RefCell::new(ABuf::new()) };
}

/// Block sizes for a problem. Narrow outputs (n ≤ NR, one column strip): the B panel is only
/// k×NR, so take the whole k (≤ 4096) in one block and shrink MC so the A block stays ≈ 384 KB
/// (A is then read in whole contiguous rows, and C is written once). Only when packing on the fly:
/// with pre-packed operands the kc-blocked B micro-panel in L1 is faster.
pub static NARROW_A_BYTES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(192 * 1024);
fn round_cfg(cfg: &Cfg, mr: usize, nr: usize, n: usize, k: usize, prepacked: bool) -> (usize, usize, usize) {
    let mut kc = (cfg.kc.max(32) / 32) * 32;
    let mut mc = ceil_div(cfg.mc.max(mr), mr) * mr;
    if cfg.narrow_full_k && !prepacked && n <= nr && k > kc {
        kc = ceil_div(k, 32).min(128) * 32;
        mc = mc.min(((NARROW_A_BYTES.load(std::sync::atomic::Ordering::Relaxed) / (kc * 2)) / mr).max(1) * mr);
    }
    let nc = ceil_div(cfg.nc.max(nr), nr) * nr;
    (kc, mc, nc)
}

/// Sub-problem: rows [ib, ie), cols [jb, je) of C (ib multiple of MR, jb multiple of NR).
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn run_range<const MR: usize, const NV: usize>(
    m: usize,
    n: usize,
    k: usize,
    a: Src,
    b: Src,
    c: ViewMut,
    (ib, ie): (usize, usize),
    (jb, je): (usize, usize),
    cfg: &Cfg,
) {
    let nr = 16 * NV;
    let (kc_blk, mc_blk, nc_blk) = round_cfg(cfg, MR, nr, n, k, matches!(a, Src::Packed(_)));
    let strips_m_all = ceil_div(m, MR);
    let strips_n_all = ceil_div(n, nr);
    let full_chunks = kc_blk / 32;
    BUF_A.with(|ba| {
        BUF_B.with(|bb| {
            let mut ba = ba.borrow_mut();
            let mut bb = bb.borrow_mut();
            if let Src::F32(_) = a {
                ba.ensure(full_chunks * 16 * mc_blk);
            }
            if let Src::F32(_) = b {
                bb.ensure(full_chunks * 16 * nc_blk);
            }
            let mut tile = [0f32; 14 * 64];
            let mut jc = jb;
            while jc < je {
                let nc = nc_blk.min(je - jc);
                let mut pc = 0;
                while pc < k {
                    let kc = kc_blk.min(k - pc);
                    let chunks = ceil_div(kc, 32);
                    let bstrip = chunks * 16 * nr;
                    let bpanel: *const u32 = match b {
                        Src::F32(bv) => {
                            pack_b(bv, pc, kc, jc, nc, NV, bb.mut_ptr());
                            bb.ptr()
                        }
                        Src::Packed(p) => p.add((pc / kc_blk) * strips_n_all * full_chunks * 16 * nr + (jc / nr) * bstrip),
                    };
                    let mut ic = ib;
                    while ic < ie {
                        let mc = mc_blk.min(ie - ic);
                        let astrip = chunks * MR * 16;
                        let ablock: *const u32 = match a {
                            Src::F32(av) => {
                                pack_a(av, ic, mc, m, pc, kc, MR, ba.mut_ptr());
                                ba.ptr()
                            }
                            Src::Packed(p) => p.add((pc / kc_blk) * strips_m_all * full_chunks * MR * 16 + (ic / MR) * astrip),
                        };
                        let mut jr = 0;
                        while jr < nc {
                            let nr_eff = nr.min(nc - jr);
                            let masks: [u16; NV] = core::array::from_fn(|v| mask16(nr_eff.saturating_sub(v * 16)));
                            let bp = bpanel.add((jr / nr) * bstrip);
                            let mut ir = 0;
                            while ir < mc {
                                let mr_eff = MR.min(mc - ir);
                                let ap = ablock.add((ir / MR) * astrip);
                                let (i, j) = (ic + ir, jc + jr);
                                if c.cs == 1 {
                                    kernel::<MR, NV>(chunks, ap, bp, c.ptr.add(i * c.rs + j), c.rs, mr_eff, masks, pc > 0);
                                } else {
                                    kernel::<MR, NV>(chunks, ap, bp, tile.as_mut_ptr(), nr, mr_eff, masks, false);
                                    for ii in 0..mr_eff {
                                        for jj in 0..nr_eff {
                                            let d = c.ptr.add((i + ii) * c.rs + (j + jj) * c.cs);
                                            let t = tile[ii * nr + jj];
                                            *d = if pc > 0 { *d + t } else { t };
                                        }
                                    }
                                }
                                ir += MR;
                            }
                            jr += nr;
                        }
                        ic += mc;
                    }
                    pc += kc;
                }
                jc += nc;
            }
        })
    })
}

fn run_kern<const MR: usize, const NV: usize>(m: usize, n: usize, k: usize, a: Src, b: Src, c: ViewMut, threads: usize, cfg: &Cfg) {
    let nr = 16 * NV;
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m {
            for j in 0..n {
                unsafe { *c.ptr.add(i * c.rs + j * c.cs) = 0.0 };
            }
        }
        return;
    }
    unsafe {
        if threads <= 1 {
            run_range::<MR, NV>(m, n, k, a, b, c, (0, m), (0, n), cfg);
        } else {
            let sm = ceil_div(m, MR);
            let sn = ceil_div(n, nr);
            // split the dimension with more micro-tiles (rows preferred on ties)
            if sm >= 2 && (sm * MR >= sn * nr || sn < 2) {
                let mid = (sm / 2) * MR;
                rayon::join(
                    || run_range::<MR, NV>(m, n, k, a, b, c, (0, mid), (0, n), cfg),
                    || run_range::<MR, NV>(m, n, k, a, b, c, (mid, m), (0, n), cfg),
                );
            } else if sn >= 2 {
                let mid = (sn / 2) * nr;
                rayon::join(
                    || run_range::<MR, NV>(m, n, k, a, b, c, (0, m), (0, mid), cfg),
                    || run_range::<MR, NV>(m, n, k, a, b, c, (0, m), (mid, n), cfg),
                );
            } else {
                run_range::<MR, NV>(m, n, k, a, b, c, (0, m), (0, n), cfg);
            }
        }
    }
}

fn dispatch(kern: Kern, m: usize, n: usize, k: usize, a: Src, b: Src, c: ViewMut, threads: usize, cfg: &Cfg) {
    match kern {
        Kern::M12N2 => run_kern::<12, 2>(m, n, k, a, b, c, threads, cfg),
        Kern::M14N2 => run_kern::<14, 2>(m, n, k, a, b, c, threads, cfg),
        Kern::M6N4 => run_kern::<6, 4>(m, n, k, a, b, c, threads, cfg),
        Kern::M7N4 => run_kern::<7, 4>(m, n, k, a, b, c, threads, cfg),
        Kern::M8N3 => run_kern::<8, 3>(m, n, k, a, b, c, threads, cfg),
        Kern::M4N4 => run_kern::<4, 4>(m, n, k, a, b, c, threads, cfg),
    }
}

// ------------------------------------------------------------------ orientation / plan

/// Chosen orientation: either C = A·B, or Cᵀ = Bᵀ·Aᵀ (swap), picked so that the larger operand
/// gets the fast (contiguous-k for A, contiguous-n for B) packing path.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub swap: bool,
    pub kern: Kern,
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

fn pack_cost(rows: usize, cols: usize, fast: bool, semi: bool) -> f64 {
    let e = (rows * cols) as f64;
    if fast {
        e
    } else if semi {
        3.0 * e
    } else {
        8.0 * e
    }
}

pub fn plan(m: usize, n: usize, k: usize, a: View, b: View, c: ViewMut, cfg: &Cfg) -> Plan {
    // cost of orientation (A', B', C') ~ packing work + strided C writes
    let cost = |av: View, bv: View, cv: ViewMut, mm: usize, nn: usize| {
        pack_cost(mm, k, av.cs == 1, false) + pack_cost(k, nn, bv.cs == 1, bv.rs == 1) + if cv.cs == 1 { 0.0 } else { 4.0 * (mm * nn) as f64 }
    };
    let c0 = cost(a, b, c, m, n);
    let c1 = cost(b.t(), a.t(), c.t(), n, m);
    let swap = c1 < c0;
    let (mm, nn) = if swap { (n, m) } else { (m, n) };
    let kern = if nn <= 32 { cfg.kern_narrow } else { cfg.kern_wide };
    Plan { swap, kern, m: mm, n: nn, k }
}

/// C = A·B (C overwritten), operands converted to bf16 inside (packing cost included).
pub fn gemm(m: usize, n: usize, k: usize, a: View, b: View, c: ViewMut, threads: usize, cfg: &Cfg) {
    let p = plan(m, n, k, a, b, c, cfg);
    if p.swap {
        dispatch(p.kern, p.m, p.n, k, Src::F32(b.t()), Src::F32(a.t()), c.t(), threads, cfg);
    } else {
        dispatch(p.kern, p.m, p.n, k, Src::F32(a), Src::F32(b), c, threads, cfg);
    }
}

/// Both operands pre-packed to bf16 in the layout the driver reads (for kernel-only timing).
pub struct Prepacked {
    pub plan: Plan,
    pa: ABuf,
    pb: ABuf,
}

pub fn prepack(m: usize, n: usize, k: usize, a: View, b: View, c: ViewMut, cfg: &Cfg) -> Prepacked {
    let p = plan(m, n, k, a, b, c, cfg);
    let (av, bv) = if p.swap { (b.t(), a.t()) } else { (a, b) };
    let (mr, nv) = p.kern.mr_nv();
    let nr = 16 * nv;
    let (kc_blk, _, _) = round_cfg(cfg, mr, nr, p.n, k, true);
    let full_chunks = kc_blk / 32;
    let strips_m = ceil_div(p.m, mr);
    let strips_n = ceil_div(p.n, nr);
    let nkb = ceil_div(k, kc_blk);
    let mut pa = ABuf::zeroed(nkb * strips_m * full_chunks * mr * 16);
    let mut pb = ABuf::zeroed(nkb * strips_n * full_chunks * 16 * nr);
    unsafe {
        for kb in 0..nkb {
            let pc = kb * kc_blk;
            let kc = kc_blk.min(k - pc);
            pack_a(av, 0, p.m, p.m, pc, kc, mr, pa.mut_ptr().add(kb * strips_m * full_chunks * mr * 16));
            pack_b(bv, pc, kc, 0, p.n, nv, pb.mut_ptr().add(kb * strips_n * full_chunks * 16 * nr));
        }
    }
    Prepacked { plan: p, pa, pb }
}

pub fn gemm_prepacked(pp: &Prepacked, c: ViewMut, threads: usize, cfg: &Cfg) {
    let p = pp.plan;
    let cv = if p.swap { c.t() } else { c };
    dispatch(p.kern, p.m, p.n, p.k, Src::Packed(pp.pa.ptr()), Src::Packed(pp.pb.ptr()), cv, threads, cfg);
}

/// Plain f32 → bf16 conversion of a contiguous slice (bandwidth probe).
pub fn convert(x: &[f32], y: &mut [u16]) {
    assert!(y.len() >= x.len() && x.len() % 32 == 0);
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn go(x: &[f32], y: &mut [u16]) {
        for i in (0..x.len()).step_by(32) {
            let lo = _mm512_loadu_ps(x.as_ptr().add(i));
            let hi = _mm512_loadu_ps(x.as_ptr().add(i + 16));
            let v = core::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo));
            _mm512_storeu_si512(y.as_mut_ptr().add(i) as *mut _, v);
        }
    }
    unsafe { go(x, &mut y[..x.len() / 32 * 32]) }
}
