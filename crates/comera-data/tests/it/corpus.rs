//! Corpus reading (walk order, extension filter, text document modes, bad files), the held-out
//! split and packing into fixed-length blocks, on small files the tests write.

use comera_data::corpus::{
    is_held_out, pack_corpus, Corpus, CorpusError, CorpusTokenizer, OnBadFile, PackConfig, Packer,
    TextDocs,
};
use comera_data::tokenizer::SpecialIds;
use comera_data::BertTokenizer;
use std::fs;
use std::io::Write;
use std::path::Path;

const SPECIAL: SpecialIds = SpecialIds {
    pad: 0,
    unk: 1,
    cls: 2,
    sep: 3,
    mask: 4,
};

fn write(root: &Path, rel: &str, bytes: &[u8]) {
    let p = root.join(rel);
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    fs::write(p, bytes).unwrap();
}

fn keys(c: &Corpus) -> Vec<String> {
    c.documents().map(|d| d.unwrap().key).collect()
}

#[test]
fn code_walk_is_sorted_recursive_and_filtered_by_extension() {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path();
    for rel in [
        "b.rs",
        "a.rs",
        "Z.rs",
        "lib/z.rs",
        "lib/m/x.rs",
        "lib/a.go",
        "lib/README.md",
        "a/b.rs",
        "noext",
        "c.rs.bak",
    ] {
        write(r, rel, format!("// {rel}\nfn f() {{}}\n").as_bytes());
    }
    write(r, "empty.rs", b"  \n\n");
    #[cfg(unix)]
    std::os::unix::fs::symlink(r.join("a.rs"), r.join("link.rs")).unwrap();

    let c = Corpus::new().code_dir(r, &["rs"]);
    // Byte order of names at each level: uppercase before lowercase, a dir's files in place.
    assert_eq!(
        keys(&c),
        ["Z.rs", "a/b.rs", "a.rs", "b.rs", "lib/m/x.rs", "lib/z.rs"]
    );
    let c = Corpus::new().code_dir(r, &[".go", "md"]);
    assert_eq!(keys(&c), ["lib/README.md", "lib/a.go"]);

    let docs: Vec<_> = Corpus::new()
        .code_dir(r, &["rs"])
        .documents()
        .map(Result::unwrap)
        .collect();
    assert_eq!(docs[0].text, "// Z.rs\nfn f() {}\n");
    // Same order again (deterministic), and the stats count the blank file as read.
    let c = Corpus::new().code_dir(r, &["rs"]);
    let mut it = c.documents();
    let n = it.by_ref().count();
    assert_eq!(n, 6);
    assert_eq!(it.stats().files, 7);
    assert_eq!(it.stats().documents, 6);
}

#[test]
fn invalid_utf8_is_skipped_with_a_reason_or_an_error_naming_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path();
    write(r, "a.rs", b"fn a() {}\n");
    write(r, "bad.rs", b"fn b() {}\n// \xff\xfe latin-1\n");
    write(r, "c.rs", b"\xef\xbb\xbffn c() {}\n");

    let c = Corpus::new().code_dir(r, &["rs"]);
    let mut it = c.documents();
    let docs: Vec<_> = it.by_ref().map(Result::unwrap).collect();
    assert_eq!(docs.len(), 2);
    assert_eq!(docs[1].text, "fn c() {}\n", "BOM removed");
    let s = it.stats();
    assert_eq!((s.files, s.skipped_files, s.documents), (3, 1, 2));
    assert!(
        s.skipped[0].contains("bad.rs") && s.skipped[0].contains("line 2"),
        "{:?}",
        s.skipped
    );

    let c = Corpus::new()
        .code_dir(r, &["rs"])
        .on_bad_file(OnBadFile::Error);
    let mut it = c.documents();
    assert!(it.next().unwrap().is_ok());
    let err = it.next().unwrap().unwrap_err();
    assert!(
        matches!(err, CorpusError::InvalidUtf8 { line: 2, .. }),
        "{err}"
    );
    let msg = err.to_string();
    assert!(msg.contains("bad.rs") && msg.contains("line 2"), "{msg}");
    assert!(it.next().is_none(), "the stream ends after an error");

    // Text files: a bad line is skipped (counted) or an error with its line number.
    let t = r.join("t.txt");
    fs::write(&t, b"one\n\xc3\x28 two\nthree\n").unwrap();
    let c = Corpus::new().text_file(&t, TextDocs::Lines);
    let mut it = c.documents();
    let texts: Vec<String> = it.by_ref().map(|d| d.unwrap().text).collect();
    assert_eq!(texts, ["one\n", "three\n"]);
    assert_eq!(it.stats().skipped_lines, 1);
    let c = Corpus::new()
        .text_file(&t, TextDocs::Lines)
        .on_bad_file(OnBadFile::Error);
    let err = c.documents().nth(1).unwrap().unwrap_err();
    assert!(
        err.to_string().contains("t.txt") && err.to_string().contains("line 2"),
        "{err}"
    );
}

#[test]
fn missing_sources_are_errors_naming_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope");
    for c in [
        Corpus::new().code_dir(&missing, &["rs"]),
        Corpus::new().text_file(&missing, TextDocs::Lines),
    ] {
        let err = c.documents().next().unwrap().unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
    }
    let f = dir.path().join("file.rs");
    fs::write(&f, "x").unwrap();
    let err = Corpus::new()
        .code_dir(&f, &["rs"])
        .documents()
        .next()
        .unwrap()
        .unwrap_err();
    assert!(err.to_string().contains("not a directory"), "{err}");
}

const WIKI: &str = " \n = Alpha = \n \n Alpha is a letter . \n \n = = History = = \n \n Old .\n \n = Beta = \n \n Beta too .\n";

#[test]
fn text_documents_by_lines_paragraphs_articles_and_whole_file_also_gzipped() {
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("wiki.txt");
    fs::write(&plain, WIKI).unwrap();
    let gz = dir.path().join("wiki.raw.gz");
    {
        let mut w = flate2::write::GzEncoder::new(
            fs::File::create(&gz).unwrap(),
            flate2::Compression::default(),
        );
        w.write_all(WIKI.as_bytes()).unwrap();
        w.finish().unwrap();
    }
    for path in [&plain, &gz] {
        let texts = |docs| -> Vec<String> {
            Corpus::new()
                .text_file(path, docs)
                .documents()
                .map(|d| d.unwrap().text)
                .collect()
        };
        let articles = texts(TextDocs::WikiArticles);
        assert_eq!(articles.len(), 2, "{articles:?}");
        assert!(articles[0].starts_with(" = Alpha = \n") && articles[0].contains("Old ."));
        assert!(articles[1].starts_with(" = Beta = \n") && articles[1].contains("Beta too"));
        assert_eq!(texts(TextDocs::Paragraphs).len(), 6);
        assert_eq!(texts(TextDocs::Lines).len(), 6);
        assert_eq!(texts(TextDocs::WholeFile), [WIKI]);
    }
    let keys: Vec<String> = Corpus::new()
        .text_file(&plain, TextDocs::WikiArticles)
        .documents()
        .map(|d| d.unwrap().key)
        .collect();
    assert!(
        keys[0].ends_with("wiki.txt:2") && keys[1].ends_with("wiki.txt:10"),
        "{keys:?}"
    );
}

#[test]
fn held_out_split_is_deterministic_by_key_and_near_the_fraction() {
    let keys: Vec<String> = (0..20_000).map(|i| format!("src/file{i}.rs")).collect();
    let held = |seed| -> Vec<bool> { keys.iter().map(|k| is_held_out(k, 0.1, seed)).collect() };
    let a = held(7);
    assert_eq!(a, held(7));
    assert_ne!(a, held(8));
    let frac = a.iter().filter(|&&h| h).count() as f64 / keys.len() as f64;
    assert!((frac - 0.1).abs() < 0.01, "{frac}");
    assert!(keys.iter().all(|k| !is_held_out(k, 0.0, 7)));
    assert!(keys.iter().all(|k| is_held_out(k, 1.0, 7)));
}

/// Rows of `p` with their structure checked; returns the content tokens in order.
fn check_rows(p: &comera_data::PackedSequences) -> Vec<u32> {
    let l = p.seq_len;
    assert_eq!(p.input_ids.len() % l, 0);
    let mut content = Vec::new();
    for i in 0..p.len() {
        let row = p.row(i);
        assert_eq!(row.len(), l);
        assert_eq!(row[0], SPECIAL.cls);
        let used = row.iter().position(|&t| t == SPECIAL.pad).unwrap_or(l);
        assert!(row[used..].iter().all(|&t| t == SPECIAL.pad));
        assert_eq!(row[used - 1], SPECIAL.sep);
        if i + 1 < p.len() {
            assert_eq!(used, l, "only the last block is padded");
        }
        content.extend_from_slice(&row[1..used - 1]);
    }
    content
}

#[test]
fn packing_fills_fixed_blocks_with_separators_between_documents() {
    let docs: Vec<Vec<u32>> = (0..50)
        .map(|d| (0..(d * 7 % 23)).map(|t| 10 + d * 100 + t).collect())
        .collect();
    for seq_len in [3, 4, 8, 16, 128] {
        let mut p = Packer::new(seq_len, SPECIAL).unwrap();
        for d in &docs {
            p.push_document(d);
        }
        let packed = p.finish(true);
        let content = check_rows(&packed);
        // The content is the non-empty documents joined by [SEP], except that a document
        // starting a block needs none.
        let mut want = Vec::new();
        for d in docs.iter().filter(|d| !d.is_empty()) {
            if want.len() % (seq_len - 2) != 0 {
                want.push(SPECIAL.sep);
            }
            want.extend_from_slice(d);
        }
        assert_eq!(content, want, "seq_len {seq_len}");
        assert_eq!(packed.len(), want.len().div_ceil(seq_len - 2));
        assert_eq!(
            packed.tokens,
            docs.iter().map(|d| d.len() as u64).sum::<u64>()
        );
        assert_eq!(
            packed.documents,
            docs.iter().filter(|d| !d.is_empty()).count() as u64
        );

        let mut q = Packer::new(seq_len, SPECIAL).unwrap();
        for d in &docs {
            q.push_document(d);
        }
        let dropped = q.finish(false);
        assert_eq!(dropped.len(), want.len() / (seq_len - 2));
        assert!(!dropped.input_ids.contains(&SPECIAL.pad));
    }
    assert!(matches!(
        Packer::new(2, SPECIAL),
        Err(CorpusError::SeqLenTooSmall { seq_len: 2 })
    ));
}

#[test]
fn packed_sequences_save_and_load_round_trip() {
    let mut p = Packer::new(8, SPECIAL).unwrap();
    p.push_document(&[10, 11, 12, 13, 14, 15, 16, 17, 18]);
    p.push_document(&[20, 21]);
    let packed = p.finish(true);
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("train.pack");
    packed.save(&f).unwrap();
    assert_eq!(comera_data::PackedSequences::load(&f).unwrap(), packed);
    fs::write(&f, b"CMRPACK1 too short").unwrap();
    let err = comera_data::PackedSequences::load(&f).unwrap_err();
    assert!(err.to_string().contains("train.pack"), "{err}");
}

const VOCAB: &str = "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nfn\nmain\n(\n)\n{\n}\nlet\nx\n=\n1\n;\n";

#[test]
fn pack_corpus_tokenises_splits_by_document_and_packs_deterministically() {
    let dir = tempfile::tempdir().unwrap();
    let r = dir.path();
    for i in 0..40 {
        let body = "let x = 1 ;\n".repeat(i % 5 + 1);
        write(
            r,
            &format!("m{i:02}/f.rs"),
            format!("fn main() {{\n{body}}}\n").as_bytes(),
        );
    }
    let tok = CorpusTokenizer::WordPiece(
        BertTokenizer::from_vocab_text(VOCAB, Path::new("code-vocab.txt")).unwrap(),
    );
    assert_eq!(tok.special_ids(), SPECIAL);
    let corpus = Corpus::new().code_dir(r, &["rs"]);
    let mut cfg = PackConfig::new(16);
    cfg.valid_fraction = 0.25;
    cfg.split_seed = 3;
    cfg.chunk_bytes = 100; // several parallel chunks
    let a = pack_corpus(&corpus, &tok, &cfg).unwrap();
    assert_eq!(a.stats.documents, 40);
    assert_eq!(a.train.documents + a.valid.documents, 40);
    assert!(a.valid.documents > 0 && a.train.documents > a.valid.documents);
    let n_valid = (0..40)
        .filter(|i| is_held_out(&format!("m{i:02}/f.rs"), 0.25, 3))
        .count() as u64;
    assert_eq!(a.valid.documents, n_valid);
    check_rows(&a.train);
    check_rows(&a.valid);
    assert!(!a.train.input_ids.contains(&SPECIAL.unk));
    // Every file is 6 + 5·k tokens: the totals add up.
    let total: u64 = (0..40).map(|i| 6 + 5 * (i % 5 + 1)).sum();
    assert_eq!(a.train.tokens + a.valid.tokens, total);

    cfg.chunk_bytes = 1 << 20;
    let b = pack_corpus(&corpus, &tok, &cfg).unwrap();
    assert_eq!(a.train, b.train, "chunking does not change the result");
    assert_eq!(a.valid, b.valid);
}
