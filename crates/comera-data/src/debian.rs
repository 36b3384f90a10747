//! Source trees that ship as Debian packages (`rust-src`, `golang-1.19-src`), fetched with the
//! ordinary client and cached with a pinned checksum.
//!
//! `fetch_debian(set, cache_dir)` returns `cache_dir/<name>/<dir_name>`, the package's source
//! root. When `cache_dir/<name>/.comera-complete` records the pinned `.deb` sha256, the cached
//! tree is returned without touching the network. Otherwise `apt-get download PKG=VERSION` (or
//! `$COMERA_APT_GET`; it works without root) saves the `.deb` into a temporary directory inside
//! the cache, its sha256 is checked, and the members under `root` of its `data.tar.xz` (read in
//! Rust: `ar` + `lzma-rust2` + `tar`, no `dpkg-deb` needed) are extracted into the temporary
//! directory, which is then renamed into place: a reader sees the old tree or the whole new one.
//! Only regular files are extracted (symlinks and hard links are skipped); paths are checked to
//! stay inside the target. The marker is trusted without re-hashing the extracted files.
//!
//! `apt-get download` needs the package lists: if it cannot find the pinned version, run
//! `apt-get update` first (the error says so).

use crate::download::{download_verified, tail, DownloadError, TempDir};
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

/// A source tree inside a Debian package.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DebianSet {
    /// Data set name for `comera data fetch`.
    pub name: &'static str,
    pub description: &'static str,
    /// Debian package name and exact version.
    pub package: &'static str,
    pub version: &'static str,
    /// File name `apt-get download` saves.
    pub deb: &'static str,
    /// sha256 of that file.
    pub sha256: &'static str,
    /// Directory inside the package's data archive that is extracted (no leading `./`).
    pub root: &'static str,
    /// Name it gets under `cache_dir/<name>/`.
    pub dir_name: &'static str,
}

/// Every Debian-packaged data set, with pinned checksums (Debian 12 "bookworm").
pub const DEBIAN_SETS: &[DebianSet] = &[
    DebianSet {
        name: "rust-src",
        description: "Rust 1.63 standard library and compiler sources (22,331 .rs files, 65 MB of .rs)",
        package: "rust-src",
        version: "1.63.0+dfsg1-2",
        deb: "rust-src_1.63.0+dfsg1-2_all.deb",
        sha256: "410b8c6d464cabbe5fb3154ab8c3d374980dd597fbe7e3b7bb3ed8dd1bf11e25",
        root: "usr/src/rustc-1.63.0",
        dir_name: "rustc-1.63.0",
    },
    DebianSet {
        name: "go-src",
        description: "Go 1.19 sources: src/ (standard library, 5,557 .go files), test/, misc/ (8,906 .go files in all)",
        package: "golang-1.19-src",
        version: "1.19.8-2",
        deb: "golang-1.19-src_1.19.8-2_all.deb",
        sha256: "2dfa82fe4f08f4e0193c532e561af4c91871f5235608f04f2bb8d57bb288df5a",
        root: "usr/share/go-1.19",
        dir_name: "go-1.19",
    },
];

const MARKER: &str = ".comera-complete";

/// What went wrong fetching a Debian-packaged set; every variant names the data set.
#[derive(Debug, thiserror::Error)]
pub enum DebianError {
    #[error("data set `{data_set}`: {path}: {error}")]
    Io {
        data_set: String,
        path: PathBuf,
        error: io::Error,
    },
    #[error("data set `{data_set}`: cannot run `{apt_get} download {spec}`: {detail} (needs Debian's apt; or set COMERA_APT_GET)")]
    AptMissing {
        data_set: String,
        spec: String,
        apt_get: String,
        detail: String,
    },
    #[error("data set `{data_set}`: `apt-get download {spec}` failed ({status}): {stderr}{hint}")]
    DownloadFailed {
        data_set: String,
        spec: String,
        status: String,
        stderr: String,
        hint: String,
    },
    #[error("data set `{data_set}`: apt-get downloaded {spec} but not {deb}; found {found:?}")]
    DebMissing {
        data_set: String,
        spec: String,
        deb: String,
        found: Vec<String>,
    },
    #[error("data set `{data_set}` (Debian package {spec}): checksum mismatch for {deb}: expected sha256 {expected}, got {actual}")]
    ChecksumMismatch {
        data_set: String,
        spec: String,
        deb: String,
        expected: String,
        actual: String,
    },
    #[error("data set `{data_set}`: cannot read {deb}: {detail}")]
    BadDeb {
        data_set: String,
        deb: String,
        detail: String,
    },
}

/// Looks a Debian-packaged set up by name.
pub fn debian_set(name: &str) -> Option<&'static DebianSet> {
    DEBIAN_SETS.iter().find(|d| d.name == name)
}

/// Path of the cached source root of `set`, downloading and extracting it if needed.
pub fn fetch_debian(set: &DebianSet, cache_dir: &Path) -> Result<PathBuf, DebianError> {
    let apt = std::env::var("COMERA_APT_GET")
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "apt-get".to_string());
    fetch_debian_with(set, cache_dir, &apt)
}

/// `fetch_debian` with an explicit `apt-get` program (tests use a stand-in).
pub fn fetch_debian_with(
    set: &DebianSet,
    cache_dir: &Path,
    apt_get: &str,
) -> Result<PathBuf, DebianError> {
    let target = cache_dir.join(set.name);
    let tree = target.join(set.dir_name);
    if is_cached(set, cache_dir) {
        return Ok(tree);
    }
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DebianError::Io {
            data_set: set.name.to_string(),
            path,
            error: source,
        }
    };
    fs::create_dir_all(cache_dir).map_err(io_err(cache_dir))?;
    let tmp = TempDir::new(cache_dir, "deb-").map_err(io_err(cache_dir))?;
    let dl = tmp.0.join("download");
    fs::create_dir_all(&dl).map_err(io_err(&dl))?;
    let deb = download(set, &dl, apt_get)?;
    let staged = tmp.0.join(set.name);
    let (files, bytes) = extract(set, &deb, &staged.join(set.dir_name))?;
    let marker = staged.join(MARKER);
    {
        let mut f = fs::File::create(&marker).map_err(io_err(&marker))?;
        write!(
            f,
            "deb {}\nsha256 {}\nfiles {files}\nbytes {bytes}\n",
            set.deb, set.sha256
        )
        .and_then(|_| f.sync_all())
        .map_err(io_err(&marker))?;
    }
    if target.exists() {
        // Move the stale tree aside (removed with the temp dir), then put the new one in place.
        let old = tmp.0.join("old");
        fs::rename(&target, &old).map_err(io_err(&target))?;
    }
    fs::rename(&staged, &target).map_err(io_err(&target))?;
    Ok(tree)
}

fn spec(set: &DebianSet) -> String {
    format!("{}={}", set.package, set.version)
}

/// Whether the marker of a complete extraction of the pinned `.deb` is in place.
pub fn is_cached(set: &DebianSet, cache_dir: &Path) -> bool {
    let dir = cache_dir.join(set.name);
    let Ok(marker) = fs::read_to_string(dir.join(MARKER)) else {
        return false;
    };
    marker
        .lines()
        .any(|l| l.strip_prefix("sha256 ") == Some(set.sha256))
        && dir.join(set.dir_name).is_dir()
}

/// Downloads the pinned `.deb` of `set` into `dir` with `apt-get download` and checks its
/// sha256.
fn download(set: &DebianSet, dir: &Path, apt_get: &str) -> Result<PathBuf, DebianError> {
    let spec = spec(set);
    let mut cmd = Command::new(apt_get);
    cmd.args(["download", "-q", &spec]).current_dir(dir);
    download_verified(&mut cmd, dir, set.deb, set.sha256).map_err(|e| {
        let data_set = set.name.to_string();
        match e {
            DownloadError::Spawn(e) => DebianError::AptMissing {
                data_set,
                spec: spec.clone(),
                apt_get: apt_get.to_string(),
                detail: e.to_string(),
            },
            DownloadError::Failed { status, stderr } => {
                let hint = if stderr.contains("Unable to locate")
                    || stderr.contains("was not found")
                    || stderr.contains("has no installation candidate")
                {
                    " (the package lists may be missing or newer: run `apt-get update`; the pinned version is from Debian 12 bookworm)"
                } else {
                    ""
                };
                DebianError::DownloadFailed {
                    data_set,
                    spec: spec.clone(),
                    status,
                    stderr: tail(&stderr, 8),
                    hint: hint.to_string(),
                }
            }
            DownloadError::Missing { found } => DebianError::DebMissing {
                data_set,
                spec: spec.clone(),
                deb: set.deb.to_string(),
                found,
            },
            DownloadError::Io(path, source) => DebianError::Io {
                data_set,
                path,
                error: source,
            },
            DownloadError::Checksum { actual } => DebianError::ChecksumMismatch {
                data_set,
                spec: spec.clone(),
                deb: set.deb.to_string(),
                expected: set.sha256.to_string(),
                actual,
            },
        }
    })
}

/// Extracts the regular files under `set.root` of the `.deb`'s data archive into `dest`;
/// returns (files, bytes).
fn extract(set: &DebianSet, deb: &Path, dest: &Path) -> Result<(u64, u64), DebianError> {
    let bad = |detail: String| DebianError::BadDeb {
        data_set: set.name.to_string(),
        deb: set.deb.to_string(),
        detail,
    };
    let file = fs::File::open(deb).map_err(|e| bad(e.to_string()))?;
    let mut ar = ar::Archive::new(io::BufReader::with_capacity(1 << 16, file));
    let mut saw_binary = false;
    while let Some(entry) = ar.next_entry() {
        let mut entry = entry.map_err(|e| bad(format!("ar archive: {e}")))?;
        let id = String::from_utf8_lossy(entry.header().identifier())
            .trim_end_matches('/')
            .to_string();
        if id == "debian-binary" {
            let mut v = String::new();
            entry
                .read_to_string(&mut v)
                .map_err(|e| bad(format!("debian-binary: {e}")))?;
            if !v.starts_with("2.") {
                return Err(bad(format!("unsupported format version {:?}", v.trim())));
            }
            saw_binary = true;
            continue;
        }
        if !id.starts_with("data.tar") {
            continue;
        }
        if !saw_binary {
            return Err(bad("no debian-binary member before the data archive".into()));
        }
        let reader: Box<dyn Read> = match id.as_str() {
            "data.tar.xz" => Box::new(lzma_rust2::XzReader::new(entry, true)),
            "data.tar.gz" => Box::new(flate2::read::GzDecoder::new(entry)),
            "data.tar" => Box::new(entry),
            other => {
                return Err(bad(format!(
                    "data member {other} is not supported (xz, gz or plain tar)"
                )))
            }
        };
        return extract_tar(set, reader, dest).map_err(|e| match e {
            TarError::Io(path, source) => DebianError::Io {
                data_set: set.name.to_string(),
                path,
                error: source,
            },
            TarError::Bad(detail) => bad(format!("{id}: {detail}")),
        });
    }
    Err(bad("no data.tar.* member".into()))
}

enum TarError {
    Io(PathBuf, io::Error),
    Bad(String),
}

fn extract_tar(set: &DebianSet, reader: impl Read, dest: &Path) -> Result<(u64, u64), TarError> {
    let root = Path::new(set.root);
    let mut tar = tar::Archive::new(reader);
    let (mut files, mut bytes) = (0u64, 0u64);
    fs::create_dir_all(dest).map_err(|e| TarError::Io(dest.to_path_buf(), e))?;
    for entry in tar.entries().map_err(|e| TarError::Bad(e.to_string()))? {
        let mut entry = entry.map_err(|e| TarError::Bad(e.to_string()))?;
        let path = entry
            .path()
            .map_err(|e| TarError::Bad(e.to_string()))?
            .into_owned();
        let path = path.strip_prefix(".").unwrap_or(&path);
        let Ok(rel) = path.strip_prefix(root) else {
            continue;
        };
        if rel.as_os_str().is_empty() {
            continue;
        }
        if !rel.components().all(|c| matches!(c, Component::Normal(_))) {
            return Err(TarError::Bad(format!(
                "unsafe path {} in the archive",
                path.display()
            )));
        }
        let out = dest.join(rel);
        match entry.header().entry_type() {
            tar::EntryType::Directory => {
                fs::create_dir_all(&out).map_err(|e| TarError::Io(out.clone(), e))?;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                if let Some(parent) = out.parent() {
                    fs::create_dir_all(parent).map_err(|e| TarError::Io(parent.into(), e))?;
                }
                let mut f = fs::File::create(&out).map_err(|e| TarError::Io(out.clone(), e))?;
                bytes += io::copy(&mut entry, &mut f)
                    .map_err(|e| TarError::Bad(format!("{}: {e}", path.display())))?;
                files += 1;
            }
            _ => {}
        }
    }
    if files == 0 {
        return Err(TarError::Bad(format!("no files under {}", set.root)));
    }
    Ok((files, bytes))
}
