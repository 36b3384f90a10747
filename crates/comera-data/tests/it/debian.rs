//! Debian-packaged source trees: a `.deb` the test builds (ar + data.tar.xz) served by a
//! stand-in `apt-get`, checksum pinning, extraction of the root only, atomic caching.
#![cfg(unix)]

use comera_data::debian::{fetch_debian_with, is_cached, DebianError, DebianSet, DEBIAN_SETS};
use comera_data::fetch::sha256_file;
use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

fn tar_xz(entries: &[(&str, Option<&[u8]>)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, data) in entries {
        let mut h = tar::Header::new_gnu();
        match data {
            Some(d) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(d.len() as u64);
                h.set_mode(0o644);
                h.set_cksum();
                b.append_data(&mut h, path, *d).unwrap();
            }
            None if path.ends_with('/') => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                h.set_mode(0o755);
                h.set_cksum();
                b.append_data(&mut h, path, &[][..]).unwrap();
            }
            None => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_size(0);
                h.set_mode(0o777);
                b.append_link(&mut h, path, "target.rs").unwrap();
            }
        }
    }
    let tar = b.into_inner().unwrap();
    let mut w =
        lzma_rust2::XzWriter::new(Vec::new(), lzma_rust2::XzOptions::with_preset(1)).unwrap();
    w.write_all(&tar).unwrap();
    w.finish().unwrap()
}

/// Writes `pkg_1.0_all.deb` into `dir` and returns the set describing it.
fn deb_fixture(dir: &Path) -> DebianSet {
    let data = tar_xz(&[
        ("./", None),
        ("./usr/src/pkg-1.0/", None),
        ("./usr/src/pkg-1.0/lib.rs", Some(b"pub fn f() {}\n")),
        ("./usr/src/pkg-1.0/sub/mod.rs", Some(b"mod x;\n")),
        ("./usr/src/pkg-1.0/link.rs", None),
        ("./usr/share/doc/pkg/copyright", Some(b"MIT\n")),
    ]);
    let control = tar_xz(&[("./control", Some(b"Package: pkg\n"))]);
    let path = dir.join("pkg_1.0_all.deb");
    {
        let mut ar = ar::Builder::new(fs::File::create(&path).unwrap());
        for (name, bytes) in [
            ("debian-binary", &b"2.0\n"[..]),
            ("control.tar.xz", &control[..]),
            ("data.tar.xz", &data[..]),
        ] {
            let h = ar::Header::new(name.as_bytes().to_vec(), bytes.len() as u64);
            ar.append(&h, bytes).unwrap();
        }
    }
    DebianSet {
        name: "pkg-src",
        description: "test",
        package: "pkg",
        version: "1.0",
        deb: "pkg_1.0_all.deb",
        sha256: leak(sha256_file(&path).unwrap()),
        root: "usr/src/pkg-1.0",
        dir_name: "pkg-1.0",
    }
}

/// A stand-in for `apt-get` that logs its arguments and copies `deb` into the working dir.
fn fake_apt(dir: &Path, deb: &Path) -> String {
    let script = dir.join("fake-apt-get");
    let log = dir.join("apt.log");
    fs::write(
        &script,
        format!(
            "#!/bin/sh\necho \"$@\" >> '{}'\ncp '{}' .\n",
            log.display(),
            deb.display()
        ),
    )
    .unwrap();
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    script.display().to_string()
}

#[test]
fn downloads_verifies_extracts_the_root_and_caches() {
    let dir = tempfile::tempdir().unwrap();
    let set = deb_fixture(dir.path());
    let apt = fake_apt(dir.path(), &dir.path().join(set.deb));
    let cache = dir.path().join("cache");

    let tree = fetch_debian_with(&set, &cache, &apt).unwrap();
    assert_eq!(tree, cache.join("pkg-src").join("pkg-1.0"));
    assert_eq!(fs::read(tree.join("lib.rs")).unwrap(), b"pub fn f() {}\n");
    assert_eq!(fs::read(tree.join("sub/mod.rs")).unwrap(), b"mod x;\n");
    assert!(!tree.join("link.rs").exists(), "symlinks are not extracted");
    assert!(!cache.join("pkg-src").join("usr").exists());
    let log = fs::read_to_string(dir.path().join("apt.log")).unwrap();
    assert_eq!(log.trim(), "download -q pkg=1.0");
    assert!(is_cached(&set, &cache));
    // Only the set's directory is left in the cache.
    let left: Vec<_> = fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, [std::ffi::OsString::from("pkg-src")]);

    // Cached: no apt-get needed.
    let again = fetch_debian_with(&set, &cache, "/nonexistent/apt-get").unwrap();
    assert_eq!(again, tree);

    // A stale tree (other checksum in the marker) is replaced whole.
    fs::write(tree.join("stale.rs"), "x").unwrap();
    let marker = cache.join("pkg-src").join(".comera-complete");
    fs::write(&marker, "sha256 0000\n").unwrap();
    assert!(!is_cached(&set, &cache));
    let err = fetch_debian_with(&set, &cache, "/nonexistent/apt-get").unwrap_err();
    assert!(matches!(err, DebianError::AptMissing { .. }), "{err}");
    assert!(err.to_string().contains("pkg-src"), "{err}");
    fetch_debian_with(&set, &cache, &apt).unwrap();
    assert!(!tree.join("stale.rs").exists());
    assert!(tree.join("lib.rs").exists());
}

#[test]
fn wrong_checksum_and_bad_archives_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let set = deb_fixture(dir.path());
    let apt = fake_apt(dir.path(), &dir.path().join(set.deb));
    let cache = dir.path().join("cache");

    let mut wrong = set;
    wrong.sha256 = leak("0".repeat(64));
    let msg = fetch_debian_with(&wrong, &cache, &apt)
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains(&"0".repeat(64)) && msg.contains(set.sha256) && msg.contains(set.deb),
        "{msg}"
    );
    assert!(!cache.join("pkg-src").exists());

    let mut other_root = set;
    other_root.root = "usr/src/absent";
    let msg = fetch_debian_with(&other_root, &cache, &apt)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("no files under usr/src/absent"), "{msg}");

    let mut other_name = set;
    other_name.deb = "pkg_2.0_all.deb";
    let err = fetch_debian_with(&other_name, &cache, &apt).unwrap_err();
    assert!(matches!(err, DebianError::DebMissing { .. }), "{err}");
    assert!(err.to_string().contains("pkg_1.0_all.deb"), "{err}");

    // Not an ar archive at all.
    let junk = dir.path().join("junk");
    fs::create_dir_all(&junk).unwrap();
    fs::write(junk.join(set.deb), b"not a deb").unwrap();
    let mut junk_set = set;
    junk_set.sha256 = leak(sha256_file(&junk.join(set.deb)).unwrap());
    let apt = fake_apt(&junk, &junk.join(set.deb));
    let err = fetch_debian_with(&junk_set, &cache, &apt).unwrap_err();
    assert!(matches!(err, DebianError::BadDeb { .. }), "{err}");
    // No temporary directories are left behind.
    let left = fs::read_dir(&cache).map(|rd| rd.count()).unwrap_or(0);
    assert_eq!(left, 0);
}

#[test]
fn apt_failures_name_the_package_and_hint_at_apt_get_update() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("failing-apt-get");
    fs::write(
        &script,
        "#!/bin/sh\necho \"E: Can't select version '9.9' for 'pkg'\" >&2\necho \"E: Version '9.9' for 'pkg' was not found\" >&2\nexit 100\n",
    )
    .unwrap();
    fs::set_permissions(&script, fs::Permissions::from_mode(0o755)).unwrap();
    let set = DEBIAN_SETS[0];
    let err =
        fetch_debian_with(&set, &dir.path().join("cache"), script.to_str().unwrap()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, DebianError::DownloadFailed { .. }), "{msg}");
    assert!(msg.contains("rust-src=1.63.0+dfsg1-2"), "{msg}");
    assert!(
        msg.contains("apt-get update") && msg.contains("was not found"),
        "{msg}"
    );
}

#[test]
fn the_registry_pins_are_hex_and_the_names_are_fetchable() {
    for s in DEBIAN_SETS {
        assert_eq!(s.sha256.len(), 64);
        assert!(s.sha256.bytes().all(|b| b.is_ascii_hexdigit()));
        assert!(s.deb.starts_with(&format!("{}_{}", s.package, s.version)));
        assert!(comera_data::fetch::data_set(s.name).is_none(), "{}", s.name);
    }
    let err = comera_data::fetch("no-such-set", Path::new("/nonexistent")).unwrap_err();
    assert!(err.to_string().contains("rust-src"), "{err}");
}
