//! Masked-language-model batches from packed blocks, written into preallocated buffers.
//!
//! In each row, the positions holding an ordinary token (not one of the five specials `[PAD]`,
//! `[UNK]`, `[CLS]`, `[SEP]`, `[MASK]`) are eligible; `select_prob × eligible` of them, rounded
//! stochastically (down or up with the fraction's probability, so the expected rate is exactly
//! `select_prob`) and at least one when any is eligible, are drawn without replacement — a count
//! per row as in the original BERT data maker rather than a coin per token, so every row has
//! labels. Each selected position gets, with
//! probabilities `mask_prob` / `random_prob` / the rest (default 0.8 / 0.1 / 0.1): `[MASK]`, a
//! uniformly random ordinary token id (never a special), or its own id. Labels are the original id
//! at selected positions and [`IGNORE_LABEL`] (−100, the cross-entropy layer's ignore index)
//! elsewhere. `attention_mask` is 1 except at `[PAD]`.
//!
//! **Determinism.** [`MlmBatches`] draws the row order (when shuffling) and then every mask
//! from one `ChaCha8Rng::seed_from_u64(seed)`, in row order, on the calling thread: the same seed
//! gives the same batches on every machine and thread count. For held-out evaluation, use
//! `shuffle = false` and the same seed every time so the losses of different evaluations and runs
//! are over the same masks.

use crate::corpus::{CorpusTokenizer, PackedSequences};
use crate::tokenizer::SpecialIds;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Label of positions that are not predicted (the cross-entropy layer's `IGNORE_INDEX`).
pub const IGNORE_LABEL: i32 = -100;

/// Masking probabilities.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlmConfig {
    /// Fraction of eligible tokens selected for prediction (0.15).
    pub select_prob: f64,
    /// Of the selected, the fraction replaced by `[MASK]` (0.8).
    pub mask_prob: f64,
    /// Of the selected, the fraction replaced by a random token (0.1); the rest keep their id.
    pub random_prob: f64,
}

impl Default for MlmConfig {
    fn default() -> Self {
        MlmConfig {
            select_prob: 0.15,
            mask_prob: 0.8,
            random_prob: 0.1,
        }
    }
}

/// One batch of `batch_size` rows of `seq_len`, row-major; reuse it every step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlmBatch {
    pub batch_size: usize,
    pub seq_len: usize,
    /// Masked input ids.
    pub input_ids: Vec<u32>,
    /// 1 for tokens, 0 for `[PAD]`.
    pub attention_mask: Vec<u32>,
    /// Original id at selected positions, [`IGNORE_LABEL`] elsewhere.
    pub labels: Vec<i32>,
    /// Flat indices (`row * seq_len + col`) of the selected positions, ascending: gather the
    /// hidden states there to run the output projection only where there is a label.
    pub selected: Vec<u32>,
    scratch: Vec<u32>,
}

impl MlmBatch {
    /// All buffers allocated to full size once.
    pub fn new(batch_size: usize, seq_len: usize) -> Self {
        let n = batch_size * seq_len;
        MlmBatch {
            batch_size,
            seq_len,
            input_ids: vec![0; n],
            attention_mask: vec![0; n],
            labels: vec![IGNORE_LABEL; n],
            selected: Vec::with_capacity(n),
            scratch: Vec::with_capacity(seq_len),
        }
    }

    /// Number of labelled positions.
    pub fn num_selected(&self) -> usize {
        self.selected.len()
    }
}

/// Applies the MLM corruption; holds no state, so one masker serves every batch and thread.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlmMasker {
    pub config: MlmConfig,
    pub special: SpecialIds,
    /// Random replacements are drawn from `0..random_upper`, specials excluded.
    pub random_upper: u32,
}

impl MlmMasker {
    /// Random replacements over `0..vocab_size` minus the specials. Panics if the probabilities
    /// are outside [0, 1] or `mask_prob + random_prob > 1`, or if no ordinary id exists.
    pub fn new(config: MlmConfig, special: SpecialIds, vocab_size: usize) -> Self {
        let ok = |p: f64| (0.0..=1.0).contains(&p);
        assert!(
            ok(config.select_prob)
                && ok(config.mask_prob)
                && ok(config.random_prob)
                && config.mask_prob + config.random_prob <= 1.0 + 1e-12,
            "bad MLM probabilities {config:?}"
        );
        let upper = u32::try_from(vocab_size).expect("vocab_size fits u32");
        let s = special;
        let n_special = [s.pad, s.unk, s.cls, s.sep, s.mask]
            .iter()
            .filter(|&&i| i < upper)
            .count();
        assert!(
            vocab_size > n_special,
            "vocab of {vocab_size} ids has no ordinary token"
        );
        MlmMasker {
            config,
            special,
            random_upper: upper,
        }
    }

    /// For a corpus tokenizer (BPE: random ids over the base vocabulary).
    pub fn for_tokenizer(config: MlmConfig, tokenizer: &CorpusTokenizer) -> Self {
        let upper = match tokenizer {
            CorpusTokenizer::WordPiece(t) => t.vocab_size(),
            CorpusTokenizer::Bpe(t) => t.base_vocab_size(),
        };
        Self::new(config, tokenizer.special_ids(), upper)
    }

    /// Upper bound on the labelled positions of one row of `seq_len` (`ceil(seq_len ×
    /// select_prob)`, at least 1): size gather buffers for the output projection with
    /// `batch_size ×` this.
    pub fn max_selected_per_row(&self, seq_len: usize) -> usize {
        ((seq_len as f64 * self.config.select_prob).ceil() as usize).clamp(1, seq_len.max(1))
    }

    pub fn is_special(&self, id: u32) -> bool {
        let s = self.special;
        id == s.pad || id == s.unk || id == s.cls || id == s.sep || id == s.mask
    }

    fn random_token<R: Rng>(&self, rng: &mut R) -> u32 {
        loop {
            let id = rng.random_range(0..self.random_upper);
            if !self.is_special(id) {
                return id;
            }
        }
    }

    /// Masks `out.input_ids` (the original ids of every row) in place and fills
    /// `attention_mask`, `labels` and `selected`. Allocates nothing.
    pub fn mask_in_place<R: Rng>(&self, out: &mut MlmBatch, rng: &mut R) {
        let l = out.seq_len;
        let n = out.batch_size * l;
        assert_eq!(
            out.input_ids.len(),
            n,
            "input_ids must hold batch_size × seq_len"
        );
        out.attention_mask.resize(n, 0);
        out.labels.resize(n, IGNORE_LABEL);
        out.labels.fill(IGNORE_LABEL);
        out.selected.clear();
        let c = self.config;
        for r in 0..out.batch_size {
            let row = &mut out.input_ids[r * l..(r + 1) * l];
            for (m, &id) in out.attention_mask[r * l..(r + 1) * l]
                .iter_mut()
                .zip(row.iter())
            {
                *m = u32::from(id != self.special.pad);
            }
            out.scratch.clear();
            out.scratch
                .extend((0..l as u32).filter(|&j| !self.is_special(row[j as usize])));
            let eligible = out.scratch.len();
            if eligible == 0 {
                continue;
            }
            // floor(x) or floor(x) + 1 with probability frac(x): expected exactly x.
            let x = eligible as f64 * c.select_prob;
            let extra = usize::from(rng.random::<f64>() < x.fract());
            let k = (x.floor() as usize + extra).clamp(1, eligible);
            // Partial Fisher–Yates: the first k of scratch are a uniform k-subset.
            for i in 0..k {
                let j = rng.random_range(i..eligible);
                out.scratch.swap(i, j);
            }
            out.scratch[..k].sort_unstable();
            for &j in &out.scratch[..k] {
                let j = j as usize;
                out.labels[r * l + j] = row[j] as i32;
                out.selected.push((r * l + j) as u32);
                let u: f64 = rng.random();
                if u < c.mask_prob {
                    row[j] = self.special.mask;
                } else if u < c.mask_prob + c.random_prob {
                    row[j] = self.random_token(rng);
                }
            }
        }
    }

    /// Copies `rows` (`batch_size × seq_len` original ids) into `out` and masks them.
    pub fn mask_into<R: Rng>(&self, rows: &[u32], out: &mut MlmBatch, rng: &mut R) {
        out.input_ids.clear();
        out.input_ids.extend_from_slice(rows);
        self.mask_in_place(out, rng);
    }
}

/// Seeded MLM batches over packed blocks; the last partial batch is dropped.
#[derive(Debug, Clone)]
pub struct MlmBatches<'a> {
    data: &'a PackedSequences,
    masker: MlmMasker,
    order: Vec<u32>,
    batch_size: usize,
    next: usize,
    rng: ChaCha8Rng,
}

impl<'a> MlmBatches<'a> {
    /// `data.len() / batch_size` batches, rows in a seeded shuffle (or in order), masks from
    /// the same seeded stream. Panics if `batch_size` is 0.
    pub fn new(
        data: &'a PackedSequences,
        masker: MlmMasker,
        batch_size: usize,
        seed: u64,
        shuffle: bool,
    ) -> Self {
        assert!(batch_size > 0, "batch_size must be positive");
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut order: Vec<u32> = (0..data.len() as u32).collect();
        if shuffle {
            order.shuffle(&mut rng);
        }
        order.truncate(data.len() / batch_size * batch_size);
        MlmBatches {
            data,
            masker,
            order,
            batch_size,
            next: 0,
            rng,
        }
    }

    /// Batches left.
    pub fn remaining(&self) -> usize {
        (self.order.len() - self.next) / self.batch_size
    }

    /// Writes the next batch into `out` (made by `MlmBatch::new(batch_size, seq_len)`); false
    /// when none is left. Allocates nothing.
    pub fn next_into(&mut self, out: &mut MlmBatch) -> bool {
        if self.next + self.batch_size > self.order.len() {
            return false;
        }
        let l = self.data.seq_len;
        assert!(
            out.batch_size == self.batch_size && out.seq_len == l,
            "MlmBatch is {}×{}, batches are {}×{l}",
            out.batch_size,
            out.seq_len,
            self.batch_size
        );
        out.input_ids.clear();
        for &i in &self.order[self.next..self.next + self.batch_size] {
            out.input_ids.extend_from_slice(self.data.row(i as usize));
        }
        self.next += self.batch_size;
        self.masker.mask_in_place(out, &mut self.rng);
        true
    }
}

impl Iterator for MlmBatches<'_> {
    type Item = MlmBatch;

    fn next(&mut self) -> Option<MlmBatch> {
        let mut b = MlmBatch::new(self.batch_size, self.data.seq_len);
        self.next_into(&mut b).then_some(b)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.remaining();
        (n, Some(n))
    }
}

impl ExactSizeIterator for MlmBatches<'_> {}
