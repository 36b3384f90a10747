//! What comera writes outside a run directory (`export --dense/--compressed`, `report --out`,
//! `plot --out`), and the one rule for what such a write may replace:
//!
//! - a target that does not exist is written (as one unit: a file atomically, a directory
//!   swapped in whole);
//! - a target that exists is replaced only with `--overwrite`, and only if comera wrote it
//!   (a safetensors export names its format in its metadata, a figure says `Software: comera`,
//!   a report page holds only the page's files and its `report.json`);
//! - nothing inside a run directory is ever a target (a run has one writer: `train`), nor a
//!   symbolic link, nor anything but a regular file (a directory, for a page);
//! - two outputs of one command may not share a path (nor one lie inside the other).
//!
//! The checks run before anything is computed or written, so a refused command changes
//! nothing. Errors name the flag and say what to do.

use crate::config::ConfigError;
use crate::files::resolved;
use crate::identity::{RunIdentity, IDENTITY};
use std::path::{Path, PathBuf};

/// The refusal of a target, naming its flag.
fn refuse(flag: &str, reason: String) -> crate::Error {
    ConfigError::new(flag, reason).into()
}

/// The run directory `path` lies in (`path` itself or the nearest ancestor holding a
/// `run.toml` that is a comera run's identity), if any.
pub fn enclosing_run(path: &Path) -> Option<PathBuf> {
    resolved(path)
        .ancestors()
        .find(|dir| dir.join(IDENTITY).is_file() && RunIdentity::read(dir).is_ok())
        .map(Path::to_path_buf)
}

/// Refuses a target inside a run directory (or the run directory itself), whatever
/// `--overwrite` says.
pub fn check_outside_runs(path: &Path, flag: &str) -> crate::Result<()> {
    let Some(run) = enclosing_run(path) else {
        return Ok(());
    };
    let place = if run == resolved(path) {
        "is a comera run directory".to_string()
    } else {
        format!("is inside the run directory {}", run.display())
    };
    Err(refuse(
        flag,
        format!(
            "{} {place}; a run's directory holds only what its training wrote: name a path outside it",
            path.display()
        ),
    ))
}

/// What a file target of `flag` may be (the module's rule): absent, or with `overwrite` a
/// regular file that `ours` recognises as comera's own output; never inside a run directory
/// or a symbolic link.
pub fn check_output_file(
    path: &Path,
    flag: &str,
    overwrite: bool,
    ours: impl FnOnce(&Path) -> bool,
) -> crate::Result<()> {
    check_outside_runs(path, flag)?;
    let meta = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(crate::Error::io(path, "cannot inspect", e)),
        Ok(meta) => meta,
    };
    if meta.file_type().is_symlink() {
        return Err(refuse(
            flag,
            format!(
                "{} is a symbolic link; comera does not write through links: name the file itself or a new one",
                path.display()
            ),
        ));
    }
    if !meta.is_file() {
        return Err(refuse(
            flag,
            format!(
                "{} is {}; name a new file",
                path.display(),
                comera_data::regular::file_kind(&meta)
            ),
        ));
    }
    if !overwrite {
        return Err(refuse(
            flag,
            format!(
                "{} exists; add --overwrite to replace an earlier comera output, or name a new file",
                path.display()
            ),
        ));
    }
    if !ours(path) {
        return Err(refuse(
            flag,
            format!(
                "--overwrite refused: {} was not written by comera (comera replaces only its own outputs); nothing was changed",
                path.display()
            ),
        ));
    }
    Ok(())
}

/// What a directory target of `flag` may be: absent or empty, or with `overwrite` a directory
/// that `ours` recognises as comera's own output (it is then replaced whole); never a run
/// directory, inside one, or a symbolic link.
pub fn check_output_dir(
    dir: &Path,
    flag: &str,
    overwrite: bool,
    ours: impl FnOnce(&Path) -> bool,
) -> crate::Result<()> {
    check_outside_runs(dir, flag)?;
    let meta = match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(crate::Error::io(dir, "cannot inspect", e)),
        Ok(meta) => meta,
    };
    if meta.file_type().is_symlink() || !meta.is_dir() {
        return Err(refuse(
            flag,
            format!(
                "{} is {}, not a directory; name a new directory",
                dir.display(),
                comera_data::regular::file_kind(&meta)
            ),
        ));
    }
    let names = entry_names(dir)?;
    if names.is_empty() {
        return Ok(());
    }
    if !overwrite {
        return Err(refuse(
            flag,
            format!(
                "{} is not empty ({}); add --overwrite to replace an earlier comera output, or name a new directory",
                dir.display(),
                names.join(", ")
            ),
        ));
    }
    if !ours(dir) {
        return Err(refuse(
            flag,
            format!(
                "--overwrite refused: {} is not an earlier comera output (it holds {}); nothing was removed",
                dir.display(),
                names.join(", ")
            ),
        ));
    }
    Ok(())
}

/// The names in `dir`, sorted.
pub fn entry_names(dir: &Path) -> crate::Result<Vec<String>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| crate::Error::io(dir, "cannot list", e))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    Ok(names)
}

/// One output of a command: its flag, its path, and whether it is a directory (whose inside
/// is its own too).
#[derive(Clone, Copy, Debug)]
pub struct Output<'a> {
    pub flag: &'a str,
    pub path: &'a Path,
    pub is_dir: bool,
}

/// Refuses two outputs of one command at one path, or one inside another's directory: the
/// second write would replace (or break) the first.
pub fn check_distinct_outputs(outputs: &[Output<'_>]) -> crate::Result<()> {
    let places: Vec<PathBuf> = outputs.iter().map(|o| resolved(o.path)).collect();
    for (i, a) in outputs.iter().enumerate() {
        for (j, b) in outputs.iter().enumerate().skip(i + 1) {
            let inside = |outer: &Output, o: usize, inner: usize| {
                outer.is_dir && places[inner].starts_with(&places[o])
            };
            if places[i] == places[j] || inside(a, i, j) || inside(b, j, i) {
                return Err(refuse(
                    b.flag,
                    format!(
                        "{} and {} {} overlap (one is, or lies inside, the other); give each output a path of its own",
                        b.path.display(),
                        a.flag,
                        a.path.display()
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Whether `path` is a safetensors file comera exported: its metadata names a comera export
/// format (`comera_format` of an encoder export, `format = comera-dlrm` of a DLRM's). Only the
/// header is read.
pub fn is_comera_export(path: &Path) -> bool {
    safetensors_metadata(path).is_some_and(|meta| {
        meta.contains_key("comera_format")
            || meta.get("format").map(String::as_str) == Some("comera-dlrm")
    })
}

/// The metadata of a safetensors file's header (none if it is not one, or has none).
fn safetensors_metadata(path: &Path) -> Option<std::collections::HashMap<String, String>> {
    use std::io::Read;
    /// Headers larger than this are not comera's (a model's header is a few hundred KiB).
    const MAX_HEADER: u64 = 64 << 20;
    let mut file = comera_data::open_regular(path).ok()?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).ok()?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER {
        return None;
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header).ok()?;
    let header: serde_json::Value = serde_json::from_slice(&header).ok()?;
    let meta = header.get("__metadata__")?.as_object()?;
    Some(
        meta.iter()
            .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tempdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("comera-outputs-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn resolved_spellings_of_one_place_are_equal() {
        let d = tempdir("resolved");
        std::fs::create_dir(d.join("a")).unwrap();
        std::os::unix::fs::symlink(d.join("a"), d.join("link")).unwrap();
        assert_eq!(resolved(&d.join("a/x.st")), resolved(&d.join("link/x.st")));
        assert_eq!(
            resolved(&d.join("a/../a/./x.st")),
            resolved(&d.join("a/x.st"))
        );
        assert_eq!(
            resolved(&d.join("new/y")),
            d.canonicalize().unwrap().join("new/y")
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn two_outputs_at_one_place_are_refused() {
        let d = tempdir("distinct");
        let f = d.join("f.safetensors");
        let out = |flag, path, is_dir| Output { flag, path, is_dir };
        let err =
            check_distinct_outputs(&[out("--dense", &f, false), out("--compressed", &f, false)])
                .unwrap_err();
        assert!(err.to_string().contains("overlap"), "{err}");
        let hf = d.join("hf");
        let inside = hf.join("model.safetensors");
        assert!(
            check_distinct_outputs(&[out("--hf", &hf, true), out("--dense", &hf, false)]).is_err()
        );
        assert!(
            check_distinct_outputs(&[out("--hf", &hf, true), out("--dense", &inside, false)])
                .is_err()
        );
        assert!(
            check_distinct_outputs(&[out("--dense", &f, false), out("--hf", &hf, true)]).is_ok()
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_file_is_replaced_only_with_overwrite_and_only_if_ours() {
        let d = tempdir("file");
        let f = d.join("x.bin");
        assert!(check_output_file(&f, "--dense", false, |_| false).is_ok());
        std::fs::write(&f, b"user data").unwrap();
        let no = check_output_file(&f, "--dense", false, |_| true).unwrap_err();
        assert!(no.to_string().contains("add --overwrite"), "{no}");
        let theirs = check_output_file(&f, "--dense", true, |_| false).unwrap_err();
        assert!(
            theirs.to_string().contains("not written by comera"),
            "{theirs}"
        );
        assert!(check_output_file(&f, "--dense", true, |_| true).is_ok());
        std::os::unix::fs::symlink(&f, d.join("link")).unwrap();
        let link = check_output_file(&d.join("link"), "--dense", true, |_| true).unwrap_err();
        assert!(link.to_string().contains("symbolic link"), "{link}");
        assert!(!is_comera_export(&f));
        let _ = std::fs::remove_dir_all(&d);
    }
}
