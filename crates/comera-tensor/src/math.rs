//! Element-wise math that vectorises: a branch-free `exp` for the hot loops (GELU, softmax).

/// e^x for f32, branch-free (so loops around it vectorise), relative error ≤ 2e-7 over the
/// finite range; saturates to e^−87.3 below −87.3 and to e^88.3 above 88.3.
///
/// x = n·ln2 + r with n = round(x/ln2) and |r| ≤ ln2/2; e^r by its degree-7 Taylor polynomial
/// (truncation error < r⁸/8! ≈ 5e-9); 2^n built directly in the exponent bits.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75; // ln 2 split so that n·LN2_HI is exact
    const LN2_LO: f32 = 1.428_606_8e-6;
    const ROUND: f32 = 12_582_912.0; // 1.5·2^23: adding and subtracting rounds to an integer
    let x = x.clamp(-87.3, 88.3); // keeps 2^n a normal number: -126 ≤ n ≤ 127
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    let two_n = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * two_n
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_matches_std_to_a_few_ulp() {
        let mut worst = 0.0f64;
        for i in -87_000..=88_000 {
            let x = i as f32 * 1e-3;
            let want = (x as f64).exp();
            let got = super::exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert!(
            (0.0..1e-37).contains(&super::exp(-1000.0)),
            "saturates towards 0"
        );
        assert!(super::exp(1000.0).is_finite(), "saturates below infinity");
        assert!(super::exp(0.0) == 1.0);
    }
}
