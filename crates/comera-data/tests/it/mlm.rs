//! MLM masking: selection rate, 80/10/10 split, specials never touched, labels, determinism by
//! seed, and no reallocation of the caller's buffers.

use comera_data::corpus::{PackedSequences, Packer};
use comera_data::mlm::{MlmBatch, MlmBatches, MlmConfig, MlmMasker, IGNORE_LABEL};
use comera_data::tokenizer::SpecialIds;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const SPECIAL: SpecialIds = SpecialIds {
    pad: 0,
    unk: 100,
    cls: 101,
    sep: 102,
    mask: 103,
};
const VOCAB: usize = 1000;

/// Blocks of seq_len 64 from documents of varied lengths; ids avoid the specials except
/// a few `[UNK]`s; the last block is padded.
fn packed(n_docs: usize) -> PackedSequences {
    let mut p = Packer::new(64, SPECIAL).unwrap();
    for d in 0..n_docs {
        let doc: Vec<u32> = (0..(d * 37 % 150 + 1))
            .map(|t| {
                if (d + t) % 97 == 0 {
                    SPECIAL.unk
                } else {
                    200 + ((d * 31 + t * 7) % 700) as u32
                }
            })
            .collect();
        p.push_document(&doc);
    }
    p.finish(true)
}

fn masker() -> MlmMasker {
    MlmMasker::new(MlmConfig::default(), SPECIAL, VOCAB)
}

#[test]
fn selection_rate_and_80_10_10_split_on_a_large_batch() {
    let data = packed(3000);
    assert!(data.len() > 1000, "{}", data.len());
    let m = masker();
    let bs = data.len();
    let mut batch = MlmBatch::new(bs, data.seq_len);
    let mut it = MlmBatches::new(&data, m, bs, 42, false);
    assert!(it.next_into(&mut batch));
    let (mut eligible, mut selected, mut masked, mut random, mut kept) = (0, 0, 0, 0, 0);
    for i in 0..bs * data.seq_len {
        let orig = data.input_ids[i];
        let got = batch.input_ids[i];
        let label = batch.labels[i];
        let special = m.is_special(orig);
        assert_eq!(batch.attention_mask[i], u32::from(orig != SPECIAL.pad));
        if special {
            assert_eq!(got, orig, "special at {i} changed");
            assert_eq!(label, IGNORE_LABEL, "special at {i} selected");
            continue;
        }
        eligible += 1;
        if label == IGNORE_LABEL {
            assert_eq!(got, orig, "unselected token at {i} changed");
            continue;
        }
        selected += 1;
        assert_eq!(label, orig as i32);
        if got == SPECIAL.mask {
            masked += 1;
        } else if got == orig {
            kept += 1;
        } else {
            assert!(
                !m.is_special(got) && (got as usize) < VOCAB,
                "random id {got}"
            );
            random += 1;
        }
    }
    assert_eq!(batch.selected.len(), selected);
    let cap = m.max_selected_per_row(data.seq_len);
    assert_eq!(cap, 10);
    for r in 0..bs {
        let row = &batch.labels[r * data.seq_len..(r + 1) * data.seq_len];
        assert!(row.iter().filter(|&&l| l != IGNORE_LABEL).count() <= cap);
    }
    assert!(batch.selected.windows(2).all(|w| w[0] < w[1]));
    for &p in &batch.selected {
        assert_ne!(batch.labels[p as usize], IGNORE_LABEL);
    }
    let rate = selected as f64 / eligible as f64;
    let f = |n: usize| n as f64 / selected as f64;
    println!(
        "eligible {eligible} selected {selected} ({rate:.4}): mask {:.4} random {:.4} kept {:.4}",
        f(masked),
        f(random),
        f(kept)
    );
    assert!((rate - 0.15).abs() < 0.003, "{rate}");
    assert!((f(masked) - 0.8).abs() < 0.01, "{}", f(masked));
    assert!((f(random) - 0.1).abs() < 0.01, "{}", f(random));
    // A random draw can hit the original id (1 in ~900): kept is 0.1 plus a hair.
    assert!((f(kept) - 0.1).abs() < 0.01, "{}", f(kept));
}

#[test]
fn each_row_gets_the_exact_count_and_at_least_one_label() {
    let m = masker();
    let mut batch = MlmBatch::new(3, 8);
    // A full row (6 eligible: 0.9 → 0 or 1, at least 1), a row with one token, a row of
    // specials only.
    let rows = [
        101, 300, 301, 302, 303, 304, 305, 102, //
        101, 300, 102, 0, 0, 0, 0, 0, //
        101, 102, 0, 0, 0, 0, 0, 0,
    ];
    m.mask_into(&rows, &mut batch, &mut ChaCha8Rng::seed_from_u64(1));
    let per_row: Vec<usize> = (0..3)
        .map(|r| {
            batch.labels[r * 8..(r + 1) * 8]
                .iter()
                .filter(|&&l| l != IGNORE_LABEL)
                .count()
        })
        .collect();
    assert_eq!(per_row, [1, 1, 0]);
    assert_eq!(&batch.attention_mask[8..16], &[1, 1, 1, 0, 0, 0, 0, 0]);

    let mut big = MlmBatch::new(1, 202);
    let mut row = vec![101u32];
    row.extend((0..200).map(|i| 200 + i));
    row.push(102);
    m.mask_into(&row, &mut big, &mut ChaCha8Rng::seed_from_u64(2));
    assert_eq!(big.num_selected(), 30);
}

#[test]
fn same_seed_same_batches_different_seed_different() {
    let data = packed(400);
    let m = masker();
    let run = |seed: u64, shuffle: bool| -> Vec<MlmBatch> {
        MlmBatches::new(&data, m, 8, seed, shuffle).collect()
    };
    let a = run(5, true);
    assert_eq!(a.len(), data.len() / 8);
    assert_eq!(a, run(5, true));
    assert_ne!(a, run(6, true));
    // Without shuffling the rows come in order (only the masks differ by seed).
    let b = run(5, false);
    let c = run(6, false);
    for (x, y) in b.iter().zip(&c) {
        assert_eq!(orig_rows(x), orig_rows(y));
        assert_ne!(x.input_ids, y.input_ids);
    }
    assert_eq!(orig_rows(&b[0]), data.input_ids[..8 * data.seq_len]);
}

fn orig_rows(b: &MlmBatch) -> Vec<u32> {
    b.input_ids
        .iter()
        .zip(&b.labels)
        .map(|(&i, &l)| if l == IGNORE_LABEL { i } else { l as u32 })
        .collect()
}

#[test]
fn next_into_reuses_the_buffers() {
    let data = packed(400);
    let mut it = MlmBatches::new(&data, masker(), 16, 9, true);
    let mut batch = MlmBatch::new(16, data.seq_len);
    let ptrs = |b: &MlmBatch| {
        (
            b.input_ids.as_ptr(),
            b.attention_mask.as_ptr(),
            b.labels.as_ptr(),
            b.selected.as_ptr(),
        )
    };
    let before = ptrs(&batch);
    let mut n = 0;
    while it.next_into(&mut batch) {
        assert_eq!(ptrs(&batch), before);
        n += 1;
    }
    assert_eq!(n, data.len() / 16);
    assert_eq!(it.remaining(), 0);
}

#[test]
#[should_panic(expected = "MlmBatch is")]
fn a_batch_of_the_wrong_shape_is_refused() {
    let data = packed(100);
    let mut it = MlmBatches::new(&data, masker(), 4, 0, false);
    let mut batch = MlmBatch::new(4, 32);
    it.next_into(&mut batch);
}
