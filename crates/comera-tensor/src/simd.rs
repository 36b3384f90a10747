//! Run-time choice of the instruction set for the engine's element-wise kernels.
//!
//! The release build targets baseline x86-64 (SSE2), so a loop the compiler vectorises runs 4
//! lanes wide. [`multiversion!`](crate::multiversion) compiles a kernel's body three times —
//! AVX-512 (x86-64-v4: 16 lanes), AVX2 + FMA (8 lanes) and the baseline — and each call takes
//! the widest one this CPU has ([`level`]). The three copies compute the same bits: Rust never
//! fuses a multiply and an add on its own, and a kernel that sums does so in the fixed lane order
//! written in its source, so the width changes only how many lanes run at once, not the result.
//! A kernel that wants FMA asks for it with `mul_add` (as [`math::exp`](crate::math::exp) does):
//! one rounding on every level, an FMA instruction on AVX2 and AVX-512, libm's `fmaf` on the
//! baseline (slow there, but the same bits).
//! (The exceptions in the engine, the small-GEMM kernels in [`gemm`](crate::gemm) and the
//! AVX-512 `narrow` kernels behind it, use FMA intrinsics and keep their own dispatch.)
//!
//! `COMERA_SIMD=avx2` or `COMERA_SIMD=baseline` in the environment caps the level (to compare,
//! or to rule the wider code out); [`set_level`] does the same from code.

use std::sync::atomic::{AtomicU8, Ordering};

/// An instruction-set level, narrowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// The build's target (SSE2 on x86-64).
    Baseline = 1,
    /// AVX2 + FMA (x86-64-v3).
    Avx2 = 2,
    /// AVX-512 F/BW/DQ/VL (x86-64-v4).
    Avx512 = 3,
}

impl Level {
    /// The name `COMERA_SIMD` takes.
    pub fn name(self) -> &'static str {
        match self {
            Level::Baseline => "baseline",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }

    /// The level a `COMERA_SIMD` value names (case and surrounding spaces ignored).
    pub fn parse(name: &str) -> Option<Level> {
        match name.trim().to_ascii_lowercase().as_str() {
            "avx512" => Some(Level::Avx512),
            "avx2" => Some(Level::Avx2),
            "baseline" => Some(Level::Baseline),
            _ => None,
        }
    }

    fn from_u8(v: u8) -> Level {
        match v {
            3 => Level::Avx512,
            2 => Level::Avx2,
            _ => Level::Baseline,
        }
    }
}

/// 0 until the first call of [`level`], then the level in use.
static LEVEL: AtomicU8 = AtomicU8::new(0);

/// The widest level this CPU supports: every feature that [`multiversion!`](crate::multiversion)
/// enables for that level's copy is detected (the copies' soundness rests on this).
pub fn detected() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let v3 = has!("avx2")
            && has!("fma")
            && has!("bmi1")
            && has!("bmi2")
            && has!("lzcnt")
            && has!("popcnt");
        if v3 && has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512vl") {
            return Level::Avx512;
        }
        if v3 {
            return Level::Avx2;
        }
    }
    Level::Baseline
}

/// The level the kernels run at: the detected one, capped by `COMERA_SIMD` (read once) or by
/// [`set_level`].
#[inline]
pub fn level() -> Level {
    match LEVEL.load(Ordering::Relaxed) {
        0 => {
            let cap = match std::env::var("COMERA_SIMD") {
                Ok(v) => Level::parse(&v).unwrap_or_else(|| {
                    eprintln!(
                        "warning: COMERA_SIMD={v:?} is not one of avx512, avx2, baseline; \
                         using the widest level this CPU has"
                    );
                    Level::Avx512
                }),
                Err(_) => Level::Avx512,
            };
            set_level(cap)
        }
        v => Level::from_u8(v),
    }
}

/// Runs the kernels at `want`, or at the detected level if that is narrower; returns the level
/// now in use. For benchmarks and the tests that check every level gives the same bits.
pub fn set_level(want: Level) -> Level {
    let level = want.min(detected());
    LEVEL.store(level as u8, Ordering::Relaxed);
    level
}

/// Defines `fn name(args) -> ret { body }` compiled at every [`Level`] and dispatched at run
/// time by [`level`]. Arguments are plain `name: Type` pairs; the body may call `#[inline(always)]`
/// helpers, which are then compiled into each level.
#[macro_export]
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body($($arg: $ty),*) $(-> $ret)? $body

            /// `body` compiled for x86-64-v4.
            ///
            /// # Safety
            /// The CPU supports every feature enabled here (AVX-512 F/BW/DQ/VL, AVX2, FMA, BMI1/2,
            /// LZCNT, POPCNT); the dispatch below checks with `simd::level()`, which reports
            /// `Level::Avx512` only when `is_x86_feature_detected!` found them all.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn v4($($arg: $ty),*) $(-> $ret)? {
                body($($arg),*)
            }

            /// `body` compiled for x86-64-v3.
            ///
            /// # Safety
            /// The CPU supports every feature enabled here (AVX2, FMA, BMI1/2, LZCNT, POPCNT);
            /// the dispatch below checks with `simd::level()`, which reports `Level::Avx2` or
            /// higher only when `is_x86_feature_detected!` found them all.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn v3($($arg: $ty),*) $(-> $ret)? {
                body($($arg),*)
            }

            match $crate::simd::level() {
                // SAFETY: `level` only reports a level whose features this CPU has.
                #[cfg(target_arch = "x86_64")]
                $crate::simd::Level::Avx512 => unsafe { v4($($arg),*) },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                $crate::simd::Level::Avx2 => unsafe { v3($($arg),*) },
                _ => body($($arg),*),
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::multiversion! {
        /// A kernel with a fixed-order lane sum and an element-wise pass.
        fn kernel(x: &[f32], y: &mut [f32]) -> f32 {
            let mut acc = [0.0f32; 8];
            for (c, o) in x.chunks_exact(8).zip(y.chunks_exact_mut(8)) {
                for l in 0..8 {
                    acc[l] += c[l] * c[l];
                    o[l] = (c[l] * 1.5 + 0.25) / (1.0 + c[l].abs());
                }
            }
            acc.iter().sum()
        }
    }

    #[test]
    fn level_names_parse_and_others_do_not() {
        for l in [Level::Baseline, Level::Avx2, Level::Avx512] {
            assert_eq!(Level::parse(l.name()), Some(l));
        }
        assert_eq!(Level::parse(" AVX2\n"), Some(Level::Avx2));
        assert_eq!(Level::parse("avx-512"), None);
        assert_eq!(Level::parse(""), None);
    }

    #[test]
    fn every_level_gives_the_same_bits_and_the_cap_holds() {
        let x: Vec<f32> = (0..4096)
            .map(|i| ((i * 7919) % 1000) as f32 / 77.0 - 6.0)
            .collect();
        let run = |want| {
            let got = set_level(want);
            assert!(got <= want && got <= detected());
            let mut y = vec![0.0; x.len()];
            let s = kernel(&x, &mut y);
            (
                s.to_bits(),
                y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            )
        };
        let base = run(Level::Baseline);
        assert_eq!(level(), Level::Baseline);
        assert_eq!(run(Level::Avx2), base);
        assert_eq!(run(Level::Avx512), base);
        assert_eq!(level(), detected());
    }
}
