//! Token counts and tokenisation throughput of an MLM corpus.
//!
//! ```sh
//! cargo run --release -p comera-data --example corpus_stats -- \
//!     --code rust-src --ext rs --tokenizer wordpiece --threads 2 [--seq-len 128] [--valid 0.01]
//! cargo run --release -p comera-data --example corpus_stats -- \
//!     --text wikitext-2-train --docs wiki --tokenizer bpe
//! ```
//!
//! `--code` / `--text` take a path or a data-set name known to `comera data fetch` (fetched into
//! `$COMERA_DATA` or `~/.cache/comera`). `--save FILE` writes the packed training blocks.
//! Prints what was read, the token counts, and the wall time and tokens/s of reading,
//! tokenising and packing (one pass, `--threads` rayon threads).

use comera_data::corpus::{pack_corpus, Corpus, CorpusTokenizer, PackConfig, TextDocs};
use comera_data::{default_cache_dir, fetch};
use std::path::PathBuf;
use std::time::Instant;

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn resolve(arg: &str) -> Result<PathBuf, Box<dyn std::error::Error>> {
    let p = PathBuf::from(arg);
    if p.exists() {
        return Ok(p);
    }
    Ok(fetch(arg, &default_cache_dir())?)
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut corpus = Corpus::new();
    let mut exts: Vec<String> = vec!["rs".into()];
    let mut code: Vec<String> = Vec::new();
    let mut docs = TextDocs::Paragraphs;
    let mut tokenizer = "wordpiece".to_string();
    let mut cfg = PackConfig::new(128);
    let mut threads = 2usize;
    let mut save: Option<PathBuf> = None;
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--code" => code.push(val()?),
            "--ext" => exts = val()?.split(',').map(str::to_string).collect(),
            "--docs" => {
                docs = match val()?.as_str() {
                    "lines" => TextDocs::Lines,
                    "paragraphs" => TextDocs::Paragraphs,
                    "wiki" => TextDocs::WikiArticles,
                    "file" => TextDocs::WholeFile,
                    d => return Err(format!("--docs {d}: lines|paragraphs|wiki|file").into()),
                }
            }
            "--text" => corpus = corpus.text_file(resolve(&val()?)?, docs),
            "--tokenizer" => tokenizer = val()?,
            "--seq-len" => cfg.seq_len = val()?.parse()?,
            "--valid" => cfg.valid_fraction = val()?.parse()?,
            "--threads" => threads = val()?.parse()?,
            "--save" => save = Some(val()?.into()),
            _ => return Err(format!("unknown argument {a}").into()),
        }
    }
    for c in &code {
        let e: Vec<&str> = exts.iter().map(String::as_str).collect();
        corpus = corpus.code_dir(resolve(c)?, &e);
    }
    if corpus.sources.is_empty() {
        return Err("give --code DIR|NAME or --text FILE|NAME".into());
    }
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()?;
    let tok = CorpusTokenizer::fetch(tokenizer.parse()?, &default_cache_dir())?;
    let t0 = Instant::now();
    let packed = pack_corpus(&corpus, &tok, &cfg)?;
    let secs = t0.elapsed().as_secs_f64();
    let s = &packed.stats;
    let tokens = packed.train.tokens + packed.valid.tokens;
    println!("sources: {:?}", corpus.sources);
    println!(
        "tokenizer: {:?} (vocab {}), threads {threads}, seq_len {}",
        tok.kind(),
        tok.vocab_size(),
        cfg.seq_len
    );
    println!(
        "files {}  documents {}  bytes {}  skipped files {}  skipped lines {}",
        s.files, s.documents, s.bytes, s.skipped_files, s.skipped_lines
    );
    for r in &s.skipped {
        println!("  skipped: {r}");
    }
    println!(
        "tokens {tokens} ({:.3} per byte)  train: {} docs, {} tokens, {} blocks  held-out: {} docs, {} tokens, {} blocks",
        tokens as f64 / s.bytes.max(1) as f64,
        packed.train.documents,
        packed.train.tokens,
        packed.train.len(),
        packed.valid.documents,
        packed.valid.tokens,
        packed.valid.len()
    );
    println!(
        "time {secs:.2} s  {:.0} tokens/s  {:.2} MB/s",
        tokens as f64 / secs,
        s.bytes as f64 / secs / 1e6
    );
    if let Some(p) = save {
        packed.train.save(&p)?;
        println!(
            "saved {} training blocks to {}",
            packed.train.len(),
            p.display()
        );
    }
    Ok(())
}
