//! WordPiece tokenisation, special tokens, truncation and padding with a tiny vocab.

use comera_data::{BertTokenizer, TokenizerError};
use std::path::Path;

const VOCAB: &str = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\ncat\nsat\non\nmat\na\ndog\nran\n##s\nrun\n.\n,\ncafe\n中\n国\n";

fn tiny() -> BertTokenizer {
    BertTokenizer::from_vocab_text(VOCAB, Path::new("tiny-vocab.txt")).unwrap()
}

#[test]
fn vocab_file_ids_are_line_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("vocab.txt");
    // CRLF line endings and trailing spaces are trimmed, as BERT's loader does.
    std::fs::write(&path, VOCAB.replace('\n', " \r\n")).unwrap();
    let tok = BertTokenizer::from_vocab_file(&path).unwrap();
    assert_eq!(tok.vocab_size(), 20);
    assert_eq!(tok.token_to_id("cat"), Some(6));
    assert_eq!(tok.id_to_token(13).as_deref(), Some("##s"));
    let s = tok.special_ids();
    assert_eq!((s.pad, s.unk, s.cls, s.sep, s.mask), (0, 1, 2, 3, 4));
}

#[test]
fn normalises_and_splits_words_into_pieces() {
    let tok = tiny();
    assert_eq!(tok.tokenize("The CAT sat.").unwrap(), vec![5, 6, 7, 15]);
    assert_eq!(tok.tokenize("Café").unwrap(), vec![17]); // accent stripped
    assert_eq!(tok.tokenize("runs,").unwrap(), vec![14, 13, 16]);
    assert_eq!(tok.tokenize("xyz cats").unwrap(), vec![1, 6, 13]);
    assert_eq!(tok.tokenize("中国").unwrap(), vec![18, 19]); // CJK chars split
    assert_eq!(tok.tokenize("  \t\n").unwrap(), Vec::<u32>::new());
}

#[test]
fn single_sentence_is_wrapped_and_padded() {
    let e = tiny().encode_single("The cat sat.", 8).unwrap();
    assert_eq!(e.input_ids, vec![2, 5, 6, 7, 15, 3, 0, 0]);
    assert_eq!(e.token_type_ids, vec![0; 8]);
    assert_eq!(e.attention_mask, vec![1, 1, 1, 1, 1, 1, 0, 0]);
    assert!(!e.truncated);

    let e = tiny().encode_single("The cat sat on the mat", 5).unwrap();
    assert_eq!(e.input_ids, vec![2, 5, 6, 7, 3]);
    assert_eq!(e.attention_mask, vec![1; 5]);
    assert!(e.truncated);

    let e = tiny().encode_single("", 4).unwrap();
    assert_eq!(e.input_ids, vec![2, 3, 0, 0]);
}

#[test]
fn pair_is_typed_and_padded() {
    let e = tiny().encode_pair("the cat", "a dog", 10).unwrap();
    assert_eq!(e.input_ids, vec![2, 5, 6, 3, 10, 11, 3, 0, 0, 0]);
    assert_eq!(e.token_type_ids, vec![0, 0, 0, 0, 1, 1, 1, 0, 0, 0]);
    assert_eq!(e.attention_mask, vec![1, 1, 1, 1, 1, 1, 1, 0, 0, 0]);
    assert!(!e.truncated);
}

#[test]
fn pair_truncation_is_longest_first() {
    // 6 + 3 tokens into 10 - 3 = 7: only the longer first sentence loses tokens.
    let e = tiny()
        .encode_pair("the cat sat on the mat", "a dog ran", 10)
        .unwrap();
    assert_eq!(e.input_ids, vec![2, 5, 6, 7, 8, 3, 10, 11, 12, 3]);
    assert_eq!(e.token_type_ids, vec![0, 0, 0, 0, 0, 0, 1, 1, 1, 1]);
    assert_eq!(e.attention_mask, vec![1; 10]);
    assert!(e.truncated);

    // The second is the longer one.
    let e = tiny()
        .encode_pair("a", "the cat sat on the mat", 7)
        .unwrap();
    assert_eq!(e.input_ids, vec![2, 10, 3, 5, 6, 7, 3]);

    // Equal lengths: the second gives up the odd token.
    let e = tiny().encode_pair("the cat", "a dog", 6).unwrap();
    assert_eq!(e.input_ids, vec![2, 5, 6, 3, 10, 3]);
    assert_eq!(e.token_type_ids, vec![0, 0, 0, 0, 1, 1]);

    // Nothing left of either sentence but the special tokens.
    let e = tiny().encode_pair("the cat", "a dog", 3).unwrap();
    assert_eq!(e.input_ids, vec![2, 3, 3]);
    assert_eq!(e.token_type_ids, vec![0, 0, 1]);
}

#[test]
fn too_small_max_len_is_an_error() {
    let err = tiny().encode_pair("a", "b", 2).unwrap_err();
    assert!(matches!(
        err,
        TokenizerError::MaxLenTooSmall {
            max_len: 2,
            needed: 3
        }
    ));
    assert!(tiny().encode_single("a", 1).is_err());
}

#[test]
fn missing_special_token_is_a_clear_error() {
    let vocab = VOCAB.replace("[SEP]\n", "");
    let err = BertTokenizer::from_vocab_text(&vocab, Path::new("no-sep.txt")).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, TokenizerError::MissingSpecial { .. }),
        "{msg}"
    );
    assert!(msg.contains("[SEP]") && msg.contains("no-sep.txt"), "{msg}");

    let err = BertTokenizer::from_vocab_text("", Path::new("empty.txt")).unwrap_err();
    assert!(err.to_string().contains("[PAD]"), "{err}");
}

#[test]
fn duplicate_token_and_missing_file_are_errors() {
    let vocab = format!("{VOCAB}cat\n");
    let msg = BertTokenizer::from_vocab_text(&vocab, Path::new("dup.txt"))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("line 21") && msg.contains("line 7") && msg.contains("cat"),
        "{msg}"
    );

    let err = BertTokenizer::from_vocab_file(Path::new("/nonexistent/vocab.txt")).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/vocab.txt"), "{err}");
}
