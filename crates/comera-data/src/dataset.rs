//! Fixed-shape encoded data sets, seeded shuffled batches, and a seeded train/validation split.
//!
//! Shuffles use `ChaCha8Rng::seed_from_u64(seed)`: the same seed gives the same order on every
//! machine. Pass a different seed each epoch (e.g. `base + epoch`).

use crate::loaders::Example;
use crate::tokenizer::{BertTokenizer, Encoding, TokenizerError};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

/// Examples tokenised to `max_len`: row `i` of each flat buffer is `[i*max_len, (i+1)*max_len)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedDataset {
    pub max_len: usize,
    pub input_ids: Vec<u32>,
    pub token_type_ids: Vec<u32>,
    pub attention_mask: Vec<u32>,
    pub labels: Vec<usize>,
    /// How many examples were cut to fit `max_len`.
    pub truncated: usize,
}

/// One batch, laid out like `EncodedDataset` with `batch_size` rows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Batch {
    pub input_ids: Vec<u32>,
    pub token_type_ids: Vec<u32>,
    pub attention_mask: Vec<u32>,
    pub labels: Vec<usize>,
}

impl EncodedDataset {
    /// Tokenises every example (`encode_pair` when it has `text_b`), in parallel, in order.
    pub fn encode(
        tokenizer: &BertTokenizer,
        examples: &[Example],
        max_len: usize,
    ) -> Result<Self, TokenizerError> {
        let encodings: Vec<Encoding> = examples
            .par_iter()
            .map(|ex| match &ex.text_b {
                Some(b) => tokenizer.encode_pair(&ex.text_a, b, max_len),
                None => tokenizer.encode_single(&ex.text_a, max_len),
            })
            .collect::<Result<_, _>>()?;
        let n = examples.len();
        let mut out = EncodedDataset {
            max_len,
            input_ids: Vec::with_capacity(n * max_len),
            token_type_ids: Vec::with_capacity(n * max_len),
            attention_mask: Vec::with_capacity(n * max_len),
            labels: examples.iter().map(|ex| ex.label).collect(),
            truncated: 0,
        };
        for e in encodings {
            out.input_ids.extend_from_slice(&e.input_ids);
            out.token_type_ids.extend_from_slice(&e.token_type_ids);
            out.attention_mask.extend_from_slice(&e.attention_mask);
            out.truncated += usize::from(e.truncated);
        }
        Ok(out)
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// The `len() / batch_size` full batches of a seeded shuffle; the last partial batch is
    /// dropped so every batch has the same shape. Panics if `batch_size` is 0.
    pub fn batches(&self, batch_size: usize, seed: u64) -> Batches<'_> {
        assert!(batch_size > 0, "batch_size must be positive");
        let mut order: Vec<usize> = (0..self.len()).collect();
        order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
        order.truncate(self.len() / batch_size * batch_size);
        Batches {
            data: self,
            order,
            batch_size,
            next: 0,
        }
    }
}

/// Iterator over the full shuffled batches of an `EncodedDataset`.
#[derive(Debug, Clone)]
pub struct Batches<'a> {
    data: &'a EncodedDataset,
    order: Vec<usize>,
    batch_size: usize,
    next: usize,
}

impl Batches<'_> {
    /// Writes the next batch into `out`, reusing its buffers; false when there is none left.
    pub fn next_into(&mut self, out: &mut Batch) -> bool {
        if self.next + self.batch_size > self.order.len() {
            return false;
        }
        let d = self.data;
        let l = d.max_len;
        out.input_ids.clear();
        out.token_type_ids.clear();
        out.attention_mask.clear();
        out.labels.clear();
        for &i in &self.order[self.next..self.next + self.batch_size] {
            out.input_ids
                .extend_from_slice(&d.input_ids[i * l..(i + 1) * l]);
            out.token_type_ids
                .extend_from_slice(&d.token_type_ids[i * l..(i + 1) * l]);
            out.attention_mask
                .extend_from_slice(&d.attention_mask[i * l..(i + 1) * l]);
            out.labels.push(d.labels[i]);
        }
        self.next += self.batch_size;
        true
    }
}

impl Iterator for Batches<'_> {
    type Item = Batch;

    fn next(&mut self) -> Option<Batch> {
        let mut batch = Batch::default();
        self.next_into(&mut batch).then_some(batch)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = (self.order.len() - self.next) / self.batch_size;
        (left, Some(left))
    }
}

impl ExactSizeIterator for Batches<'_> {}

/// Splits `items` into (train, validation) with `round(len * valid_fraction)` items drawn by a
/// seeded shuffle for validation; both parts keep the original order. Panics unless
/// `0 <= valid_fraction <= 1`.
pub fn train_valid_split<T>(items: Vec<T>, valid_fraction: f64, seed: u64) -> (Vec<T>, Vec<T>) {
    assert!(
        (0.0..=1.0).contains(&valid_fraction),
        "valid_fraction {valid_fraction} outside [0, 1]"
    );
    let n = items.len();
    let n_valid = ((n as f64) * valid_fraction).round() as usize;
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    let mut is_valid = vec![false; n];
    for &i in &order[..n_valid] {
        is_valid[i] = true;
    }
    let (mut train, mut valid) = (Vec::with_capacity(n - n_valid), Vec::with_capacity(n_valid));
    for (item, v) in items.into_iter().zip(is_valid) {
        if v {
            valid.push(item);
        } else {
            train.push(item);
        }
    }
    (train, valid)
}
