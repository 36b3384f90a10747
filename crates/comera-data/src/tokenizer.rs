//! BERT WordPiece tokenisation from a `vocab.txt` (one token a line, id = line index), with
//! fixed-length `[CLS] a [SEP] (b [SEP])` encodings padded with `[PAD]`.
//!
//! Normalisation is BERT-uncased (clean text, lowercase, strip accents, space around CJK
//! characters), pre-tokenisation splits on whitespace and punctuation, words longer than 100
//! characters become `[UNK]`. Truncation of pairs is longest-first: one token at a time from the
//! end of the longer side (from `b` on a tie).

use std::path::{Path, PathBuf};
use tokenizers::models::wordpiece::WordPiece;
use tokenizers::normalizers::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::Tokenizer;

/// The special tokens a vocab must hold.
pub const SPECIAL_TOKENS: [&str; 5] = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"];

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("vocab {path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("vocab {path}: special token {token} missing (a BERT vocab needs {SPECIAL_TOKENS:?})")]
    MissingSpecial { path: PathBuf, token: String },
    #[error("vocab {path}: line {line}: token {token:?} already on line {first_line}")]
    DuplicateToken {
        path: PathBuf,
        line: usize,
        first_line: usize,
        token: String,
    },
    #[error("max_len {max_len} is too small: {needed} special tokens need at least {needed}")]
    MaxLenTooSmall { max_len: usize, needed: usize },
    #[error("tokenising {text:?}: {detail}")]
    Tokenize { text: String, detail: String },
}

/// One fixed-length encoding; all three vectors have length `max_len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoding {
    pub input_ids: Vec<u32>,
    /// 0 for `[CLS] a [SEP]`, 1 for `b [SEP]`, 0 for padding.
    pub token_type_ids: Vec<u32>,
    /// 1 for real tokens, 0 for padding.
    pub attention_mask: Vec<u32>,
    /// Whether tokens were cut to fit `max_len`.
    pub truncated: bool,
}

/// Ids of the special tokens in the vocab.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecialIds {
    pub pad: u32,
    pub unk: u32,
    pub cls: u32,
    pub sep: u32,
    pub mask: u32,
}

/// A BERT WordPiece tokenizer.
#[derive(Clone)]
pub struct BertTokenizer {
    inner: Tokenizer,
    special: SpecialIds,
    vocab_size: usize,
}

impl std::fmt::Debug for BertTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BertTokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("special", &self.special)
            .finish()
    }
}

impl BertTokenizer {
    /// Reads `vocab.txt`: one token a line (trailing whitespace trimmed), id = 0-based line.
    pub fn from_vocab_file(path: &Path) -> Result<Self, TokenizerError> {
        let text =
            crate::regular::read_regular_to_string(path).map_err(|source| TokenizerError::Io {
                path: path.to_path_buf(),
                error: source,
            })?;
        Self::from_vocab_text(&text, path)
    }

    /// As `from_vocab_file`, from the file's text; `origin` names it in errors.
    pub fn from_vocab_text(text: &str, origin: &Path) -> Result<Self, TokenizerError> {
        let mut vocab: ahash::AHashMap<String, u32> = ahash::AHashMap::new();
        for (i, line) in text.lines().enumerate() {
            let token = line.trim_end();
            if let Some(&first) = vocab.get(token) {
                return Err(TokenizerError::DuplicateToken {
                    path: origin.to_path_buf(),
                    line: i + 1,
                    first_line: first as usize + 1,
                    token: token.to_string(),
                });
            }
            vocab.insert(token.to_string(), i as u32);
        }
        let id = |token: &str| {
            vocab
                .get(token)
                .copied()
                .ok_or_else(|| TokenizerError::MissingSpecial {
                    path: origin.to_path_buf(),
                    token: token.to_string(),
                })
        };
        let special = SpecialIds {
            pad: id("[PAD]")?,
            unk: id("[UNK]")?,
            cls: id("[CLS]")?,
            sep: id("[SEP]")?,
            mask: id("[MASK]")?,
        };
        let vocab_size = vocab.len();
        let model = WordPiece::builder()
            .vocab(vocab)
            .unk_token("[UNK]".to_string())
            .continuing_subword_prefix("##".to_string())
            .max_input_chars_per_word(100)
            .build()
            .map_err(|e| TokenizerError::Tokenize {
                text: String::new(),
                detail: format!("building WordPiece from {}: {e}", origin.display()),
            })?;
        let mut inner = Tokenizer::new(model);
        inner.with_normalizer(Some(BertNormalizer::new(true, true, Some(true), true)));
        inner.with_pre_tokenizer(Some(BertPreTokenizer));
        Ok(BertTokenizer {
            inner,
            special,
            vocab_size,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn special_ids(&self) -> SpecialIds {
        self.special
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// WordPiece ids of `text`, without special tokens, padding or truncation.
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Tokenize {
                text: text.chars().take(80).collect(),
                detail: e.to_string(),
            })
    }

    /// `[CLS] text [SEP] [PAD]...`, cut to `max_len` (needs `max_len >= 2`).
    pub fn encode_single(&self, text: &str, max_len: usize) -> Result<Encoding, TokenizerError> {
        if max_len < 2 {
            return Err(TokenizerError::MaxLenTooSmall { max_len, needed: 2 });
        }
        let mut a = self.tokenize(text)?;
        let truncated = a.len() > max_len - 2;
        a.truncate(max_len - 2);
        Ok(self.assemble(&a, None, max_len, truncated))
    }

    /// `[CLS] a [SEP] b [SEP] [PAD]...`, cut longest-first to `max_len` (needs `max_len >= 3`).
    pub fn encode_pair(
        &self,
        a: &str,
        b: &str,
        max_len: usize,
    ) -> Result<Encoding, TokenizerError> {
        if max_len < 3 {
            return Err(TokenizerError::MaxLenTooSmall { max_len, needed: 3 });
        }
        let (mut a, mut b) = (self.tokenize(a)?, self.tokenize(b)?);
        let budget = max_len - 3;
        let truncated = a.len() + b.len() > budget;
        let (na, nb) = longest_first(a.len(), b.len(), budget);
        a.truncate(na);
        b.truncate(nb);
        Ok(self.assemble(&a, Some(&b), max_len, truncated))
    }

    fn assemble(&self, a: &[u32], b: Option<&[u32]>, max_len: usize, truncated: bool) -> Encoding {
        let s = self.special;
        let mut ids = Vec::with_capacity(max_len);
        ids.push(s.cls);
        ids.extend_from_slice(a);
        ids.push(s.sep);
        let first = ids.len();
        if let Some(b) = b {
            ids.extend_from_slice(b);
            ids.push(s.sep);
        }
        let used = ids.len();
        debug_assert!(used <= max_len);
        ids.resize(max_len, s.pad);
        let mut token_type_ids = vec![0; max_len];
        token_type_ids[first..used].fill(1);
        let mut attention_mask = vec![0; max_len];
        attention_mask[..used].fill(1);
        Encoding {
            input_ids: ids,
            token_type_ids,
            attention_mask,
            truncated,
        }
    }
}

/// Lengths kept of two sequences of lengths `na`, `nb` so that they fit `budget`: drop one token
/// at a time from the longer one (from the second on a tie).
fn longest_first(mut na: usize, mut nb: usize, budget: usize) -> (usize, usize) {
    while na + nb > budget {
        if na > nb {
            na -= 1;
        } else {
            nb -= 1;
        }
    }
    (na, nb)
}

#[cfg(test)]
mod regular_file_tests {
    use super::*;

    /// A FIFO as a vocabulary once waited for a writer forever (and `/dev/zero` read zeros
    /// until memory ran out); both are refused, saying what the path is.
    #[test]
    fn a_fifo_as_a_vocabulary_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("vocab.txt");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path made above.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = BertTokenizer::from_vocab_file(&fifo).unwrap_err();
        assert!(err.to_string().contains("FIFO"), "{err}");
    }
}
