//! Seeded random initialisation. One generator type (ChaCha8) everywhere, so a seed means
//! the same numbers on every machine and every thread count.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

/// The engine's random generator.
pub type Rng = ChaCha8Rng;

/// A generator from a seed.
pub fn rng(seed: u64) -> Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// Fills `buf` with independent N(0, std²) samples.
pub fn fill_normal(rng: &mut Rng, buf: &mut [f32], std: f32) {
    for v in buf {
        let z: f32 = StandardNormal.sample(rng);
        *v = z * std;
    }
}

/// Fills `buf` with independent U(-bound, bound) samples.
pub fn fill_uniform(rng: &mut Rng, buf: &mut [f32], bound: f32) {
    let d = rand_distr::Uniform::new_inclusive(-bound, bound).expect("finite bound");
    for v in buf {
        *v = d.sample(rng);
    }
}
