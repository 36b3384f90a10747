//! Encoding into fixed shapes, seeded batches and splits.

use comera_data::{train_valid_split, Batch, BertTokenizer, EncodedDataset, Example};
use std::collections::HashSet;
use std::path::Path;

fn tokenizer() -> BertTokenizer {
    let vocab = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\ncat\nsat\non\nmat\na\ndog\n";
    BertTokenizer::from_vocab_text(vocab, Path::new("vocab.txt")).unwrap()
}

fn examples(n: usize) -> Vec<Example> {
    (0..n)
        .map(|i| Example {
            text_a: "the cat sat on the mat"
                .split(' ')
                .take(1 + i % 6)
                .collect::<Vec<_>>()
                .join(" "),
            text_b: (i % 2 == 1).then(|| "a dog".to_string()),
            label: i % 3,
        })
        .collect()
}

#[test]
fn encode_gives_flat_fixed_length_rows() {
    let tok = tokenizer();
    let exs = examples(10);
    let d = EncodedDataset::encode(&tok, &exs, 6).unwrap();
    assert_eq!(d.len(), 10);
    assert_eq!(d.input_ids.len(), 60);
    assert_eq!(d.token_type_ids.len(), 60);
    assert_eq!(d.attention_mask.len(), 60);
    assert_eq!(d.labels, exs.iter().map(|e| e.label).collect::<Vec<_>>());
    for (i, ex) in exs.iter().enumerate() {
        let want = match &ex.text_b {
            Some(b) => tok.encode_pair(&ex.text_a, b, 6).unwrap(),
            None => tok.encode_single(&ex.text_a, 6).unwrap(),
        };
        assert_eq!(&d.input_ids[i * 6..(i + 1) * 6], &want.input_ids[..]);
        assert_eq!(
            &d.token_type_ids[i * 6..(i + 1) * 6],
            &want.token_type_ids[..]
        );
        assert_eq!(
            &d.attention_mask[i * 6..(i + 1) * 6],
            &want.attention_mask[..]
        );
    }
    // Rows of 5 or 6 words don't fit 4 word slots; pairs beyond 3 slots are cut too.
    assert!(d.truncated > 0 && d.truncated < 10, "{}", d.truncated);
    assert!(EncodedDataset::encode(&tok, &[], 6).unwrap().is_empty());
}

#[test]
fn batches_are_seeded_full_and_disjoint() {
    let d = EncodedDataset::encode(&tokenizer(), &examples(10), 6).unwrap();
    let batches: Vec<Batch> = d.batches(3, 7).collect();
    assert_eq!(batches.len(), 3, "the partial batch of 1 is dropped");
    let mut seen = HashSet::new();
    for b in &batches {
        assert_eq!(b.input_ids.len(), 18);
        assert_eq!(b.token_type_ids.len(), 18);
        assert_eq!(b.attention_mask.len(), 18);
        assert_eq!(b.labels.len(), 3);
        for r in 0..3 {
            // Find the dataset row this batch row came from.
            let row = &b.input_ids[r * 6..(r + 1) * 6];
            let i = (0..10)
                .find(|&i| {
                    !seen.contains(&i)
                        && &d.input_ids[i * 6..(i + 1) * 6] == row
                        && d.labels[i] == b.labels[r]
                        && d.token_type_ids[i * 6..(i + 1) * 6]
                            == b.token_type_ids[r * 6..(r + 1) * 6]
                })
                .expect("batch row comes from an unused dataset row");
            seen.insert(i);
        }
    }
    assert_eq!(seen.len(), 9);

    // Same seed, same batches; another seed, another order.
    assert_eq!(d.batches(3, 7).collect::<Vec<_>>(), batches);
    let other: Vec<Batch> = d.batches(3, 8).collect();
    assert_ne!(other, batches);

    // next_into reuses a buffer and yields the same batches.
    let mut it = d.batches(3, 7);
    assert_eq!(it.len(), 3);
    let mut buf = Batch::default();
    for want in &batches {
        assert!(it.next_into(&mut buf));
        assert_eq!(&buf, want);
    }
    assert!(!it.next_into(&mut buf));
    assert_eq!(d.batches(11, 0).count(), 0);
}

#[test]
fn split_is_seeded_disjoint_and_keeps_order() {
    let items: Vec<u32> = (0..100).collect();
    let (train, valid) = train_valid_split(items.clone(), 0.1, 42);
    assert_eq!((train.len(), valid.len()), (90, 10));
    assert!(train.windows(2).all(|w| w[0] < w[1]));
    assert!(valid.windows(2).all(|w| w[0] < w[1]));
    let mut all: Vec<u32> = train.iter().chain(&valid).copied().collect();
    all.sort();
    assert_eq!(all, items);
    assert_eq!(
        train_valid_split(items.clone(), 0.1, 42),
        (train, valid.clone())
    );
    assert_ne!(train_valid_split(items.clone(), 0.1, 43).1, valid);

    assert_eq!(train_valid_split(items.clone(), 0.0, 1).1.len(), 0);
    assert_eq!(train_valid_split(items.clone(), 1.0, 1).0.len(), 0);
    assert_eq!(train_valid_split(vec![1, 2, 3], 0.5, 1).1.len(), 2); // round(1.5)
}
