//! Tensor-train layouts: which modes a layer's cores carry and which ranks join them.
//!
//! A TT matrix of shape N × M with N = n_1⋯n_p and M = m_1⋯m_q is held as K = p + q cores,
//! core k of shape (r_{k-1}, s_k, r_k) with s = [n_1..n_p, m_1..m_q] and r_0 = r_K = 1.
//! Bond k (k = 1..K-1) joins cores k and k+1 and carries r_k rank-gate entries; bond p is the
//! "middle" bond between the input and output halves.

use thiserror::Error;

/// A shape that cannot describe a TT layer, with what was expected.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum ShapeError {
    #[error("{what}: mode list is empty (need at least one factor)")]
    NoModes { what: &'static str },
    #[error("{what}: modes {modes:?} contain a zero")]
    ZeroMode {
        what: &'static str,
        modes: Vec<usize>,
    },
    #[error("{what}: modes {modes:?} multiply to {product}, expected {expected}")]
    ProductMismatch {
        what: &'static str,
        modes: Vec<usize>,
        product: usize,
        expected: usize,
    },
    #[error("ranks: expected {expected} entries (number of cores + 1), got {got} ({ranks:?})")]
    RankCount {
        expected: usize,
        got: usize,
        ranks: Vec<usize>,
    },
    #[error("ranks: boundary ranks must be 1, got {ranks:?}")]
    BoundaryRank { ranks: Vec<usize> },
    #[error(
        "vocab_modes has {vocab} factors but dim_modes has {dim}; a TTM core pairs one of each"
    )]
    CoreCount { vocab: usize, dim: usize },
    #[error("num_embeddings = {rows}: must be between 1 and the product of vocab_modes {modes:?} = {capacity}")]
    Rows {
        rows: usize,
        capacity: usize,
        modes: Vec<usize>,
    },
    #[error("ranks: bond {bond} has rank 0 ({ranks:?}); every rank must be at least 1")]
    ZeroRank { bond: usize, ranks: Vec<usize> },
}

/// Checks a mode list and returns its product.
pub fn mode_product(what: &'static str, modes: &[usize]) -> Result<usize, ShapeError> {
    if modes.is_empty() {
        return Err(ShapeError::NoModes { what });
    }
    if modes.contains(&0) {
        return Err(ShapeError::ZeroMode {
            what,
            modes: modes.to_vec(),
        });
    }
    Ok(modes.iter().product())
}

/// Checks that a mode list multiplies out to `expected`.
pub fn check_modes(what: &'static str, modes: &[usize], expected: usize) -> Result<(), ShapeError> {
    let product = mode_product(what, modes)?;
    if product != expected {
        return Err(ShapeError::ProductMismatch {
            what,
            modes: modes.to_vec(),
            product,
            expected,
        });
    }
    Ok(())
}

/// Checks a rank list for `cores` cores: `cores + 1` entries, ends 1, none 0.
pub fn check_ranks(ranks: &[usize], cores: usize) -> Result<(), ShapeError> {
    if ranks.len() != cores + 1 {
        return Err(ShapeError::RankCount {
            expected: cores + 1,
            got: ranks.len(),
            ranks: ranks.to_vec(),
        });
    }
    if ranks[0] != 1 || ranks[cores] != 1 {
        return Err(ShapeError::BoundaryRank {
            ranks: ranks.to_vec(),
        });
    }
    if let Some(bond) = ranks.iter().position(|&r| r == 0) {
        return Err(ShapeError::ZeroRank {
            bond,
            ranks: ranks.to_vec(),
        });
    }
    Ok(())
}

/// The layout of a TT linear layer's cores (validated on construction).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TtShape {
    in_modes: Vec<usize>,
    out_modes: Vec<usize>,
    ranks: Vec<usize>,
}

impl TtShape {
    /// A layout with explicit ranks `[1, r_1, …, r_{K-1}, 1]`.
    pub fn new(
        in_modes: &[usize],
        out_modes: &[usize],
        ranks: &[usize],
    ) -> Result<Self, ShapeError> {
        mode_product("in_modes", in_modes)?;
        mode_product("out_modes", out_modes)?;
        check_ranks(ranks, in_modes.len() + out_modes.len())?;
        Ok(TtShape {
            in_modes: in_modes.to_vec(),
            out_modes: out_modes.to_vec(),
            ranks: ranks.to_vec(),
        })
    }

    /// A layout with the same rank on every inner bond.
    pub fn uniform(
        in_modes: &[usize],
        out_modes: &[usize],
        rank: usize,
    ) -> Result<Self, ShapeError> {
        let k = in_modes.len() + out_modes.len();
        let ranks: Vec<usize> = (0..=k)
            .map(|i| if i == 0 || i == k { 1 } else { rank })
            .collect();
        Self::new(in_modes, out_modes, &ranks)
    }

    /// Checks that the layout maps `n` inputs to `m` outputs.
    pub fn check_features(&self, n: usize, m: usize) -> Result<(), ShapeError> {
        check_modes("in_modes", &self.in_modes, n)?;
        check_modes("out_modes", &self.out_modes, m)
    }

    pub fn in_modes(&self) -> &[usize] {
        &self.in_modes
    }
    pub fn out_modes(&self) -> &[usize] {
        &self.out_modes
    }
    /// `[r_0 = 1, r_1, …, r_K = 1]`.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }
    /// Number of input factors p.
    pub fn p(&self) -> usize {
        self.in_modes.len()
    }
    /// Number of output factors q.
    pub fn q(&self) -> usize {
        self.out_modes.len()
    }
    /// Number of cores K = p + q.
    pub fn n_cores(&self) -> usize {
        self.p() + self.q()
    }
    /// N = ∏ n_i.
    pub fn in_features(&self) -> usize {
        self.in_modes.iter().product()
    }
    /// M = ∏ m_j.
    pub fn out_features(&self) -> usize {
        self.out_modes.iter().product()
    }
    /// Mode s_k of core k (0-based core index).
    pub fn mode(&self, k: usize) -> usize {
        if k < self.p() {
            self.in_modes[k]
        } else {
            self.out_modes[k - self.p()]
        }
    }
    /// Shape (r_{k-1}, s_k, r_k) of core k (0-based core index).
    pub fn core_shape(&self, k: usize) -> [usize; 3] {
        [self.ranks[k], self.mode(k), self.ranks[k + 1]]
    }
    /// Number of elements of core k (0-based).
    pub fn core_len(&self, k: usize) -> usize {
        self.core_shape(k).iter().product()
    }
    /// Rank of the middle bond r_p.
    pub fn middle_rank(&self) -> usize {
        self.ranks[self.p()]
    }
    /// Total number of core parameters Σ_k r_{k-1}·s_k·r_k.
    pub fn core_params(&self) -> usize {
        (0..self.n_cores()).map(|k| self.core_len(k)).sum()
    }
}

/// The layout of a TTM embedding table: V ≤ ∏ v_k rows, D = ∏ e_k columns, p cores of shape
/// (r_{k-1}, v_k, e_k, r_k). Row i is split into mixed-radix digits (i_1..i_p) over v, i_1
/// slowest; column (c_1..c_p) over e, c_1 slowest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TtmShape {
    vocab_modes: Vec<usize>,
    dim_modes: Vec<usize>,
    ranks: Vec<usize>,
    num_embeddings: usize,
}

impl TtmShape {
    pub fn new(
        vocab_modes: &[usize],
        dim_modes: &[usize],
        ranks: &[usize],
        num_embeddings: usize,
    ) -> Result<Self, ShapeError> {
        let capacity = mode_product("vocab_modes", vocab_modes)?;
        mode_product("dim_modes", dim_modes)?;
        if vocab_modes.len() != dim_modes.len() {
            return Err(ShapeError::CoreCount {
                vocab: vocab_modes.len(),
                dim: dim_modes.len(),
            });
        }
        if num_embeddings == 0 || num_embeddings > capacity {
            return Err(ShapeError::Rows {
                rows: num_embeddings,
                capacity,
                modes: vocab_modes.to_vec(),
            });
        }
        check_ranks(ranks, vocab_modes.len())?;
        Ok(TtmShape {
            vocab_modes: vocab_modes.to_vec(),
            dim_modes: dim_modes.to_vec(),
            ranks: ranks.to_vec(),
            num_embeddings,
        })
    }

    /// Same rank on every inner bond.
    pub fn uniform(
        vocab_modes: &[usize],
        dim_modes: &[usize],
        rank: usize,
        num_embeddings: usize,
    ) -> Result<Self, ShapeError> {
        let k = vocab_modes.len();
        let ranks: Vec<usize> = (0..=k)
            .map(|i| if i == 0 || i == k { 1 } else { rank })
            .collect();
        Self::new(vocab_modes, dim_modes, &ranks, num_embeddings)
    }

    pub fn vocab_modes(&self) -> &[usize] {
        &self.vocab_modes
    }
    pub fn dim_modes(&self) -> &[usize] {
        &self.dim_modes
    }
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }
    /// Number of cores p.
    pub fn n_cores(&self) -> usize {
        self.vocab_modes.len()
    }
    /// V, the number of rows.
    pub fn num_embeddings(&self) -> usize {
        self.num_embeddings
    }
    /// D = ∏ e_k.
    pub fn dim(&self) -> usize {
        self.dim_modes.iter().product()
    }
    /// Shape (r_{k-1}, v_k, e_k, r_k) of core k (0-based).
    pub fn core_shape(&self, k: usize) -> [usize; 4] {
        [
            self.ranks[k],
            self.vocab_modes[k],
            self.dim_modes[k],
            self.ranks[k + 1],
        ]
    }
    pub fn core_len(&self, k: usize) -> usize {
        self.core_shape(k).iter().product()
    }
    pub fn core_params(&self) -> usize {
        (0..self.n_cores()).map(|k| self.core_len(k)).sum()
    }
    /// s_k = v_k·e_k, the per-core mode size in the size measure S.
    pub fn size_mode(&self, k: usize) -> usize {
        self.vocab_modes[k] * self.dim_modes[k]
    }
    /// Every core's [`TtmShape::size_mode`].
    pub fn size_modes(&self) -> Vec<usize> {
        (0..self.n_cores()).map(|k| self.size_mode(k)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttm_shapes_are_checked() {
        let s = TtmShape::uniform(&[16, 20, 10, 10], &[4, 4, 8, 6], 32, 30522).unwrap();
        assert_eq!(
            (s.dim(), s.n_cores(), s.core_shape(1)),
            (768, 4, [32, 20, 4, 32])
        );
        assert!(matches!(
            TtmShape::uniform(&[16, 20], &[4, 4, 8], 3, 10),
            Err(ShapeError::CoreCount { .. })
        ));
        assert!(matches!(
            TtmShape::uniform(&[4, 4], &[4, 4], 3, 17),
            Err(ShapeError::Rows { .. })
        ));
        assert!(matches!(
            TtmShape::uniform(&[4, 4], &[4, 4], 3, 0),
            Err(ShapeError::Rows { .. })
        ));
    }

    #[test]
    fn validates_modes_and_ranks() {
        let s = TtShape::uniform(&[12, 8, 8], &[8, 8, 12], 30).unwrap();
        assert_eq!(
            (s.in_features(), s.out_features(), s.n_cores()),
            (768, 768, 6)
        );
        assert_eq!(s.core_shape(0), [1, 12, 30]);
        assert_eq!(s.core_shape(5), [30, 12, 1]);
        assert!(s.check_features(768, 768).is_ok());
        assert!(matches!(
            s.check_features(769, 768),
            Err(ShapeError::ProductMismatch { .. })
        ));
        assert!(matches!(
            TtShape::new(&[4], &[4], &[1, 2]),
            Err(ShapeError::RankCount { .. })
        ));
        assert!(matches!(
            TtShape::new(&[4], &[4], &[1, 0, 1]),
            Err(ShapeError::ZeroRank { .. })
        ));
        assert!(matches!(
            TtShape::new(&[4], &[4], &[2, 3, 1]),
            Err(ShapeError::BoundaryRank { .. })
        ));
        assert!(matches!(
            TtShape::new(&[], &[4], &[1, 1]),
            Err(ShapeError::NoModes { .. })
        ));
        assert!(matches!(
            TtShape::new(&[4, 0], &[4], &[1, 2, 2, 1]),
            Err(ShapeError::ZeroMode { .. })
        ));
    }
}
