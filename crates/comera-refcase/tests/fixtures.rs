//! Every reference case in `crates/comera-refcase/fixtures/` (SPEC §6) passes on every path, and malformed cases
//! are clear errors.

use comera_refcase::{verify, RefCase, RefCaseError};
use std::path::{Path, PathBuf};

/// The reference cases kept in this crate (`fixtures/`), or `$COMERA_FIXTURES`.
fn fixtures_dir() -> PathBuf {
    if let Ok(d) = std::env::var("COMERA_FIXTURES") {
        return PathBuf::from(d);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn cases(prefix: &str) -> Vec<PathBuf> {
    let dir = fixtures_dir();
    let mut v: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("fixtures directory {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.starts_with(prefix) && name.ends_with(".safetensors")
        })
        .collect();
    v.sort();
    v
}

/// Every case named `prefix*` (at least `min_files` of them) is of `kind`, gives `runs`
/// reports (`what` they are) of at least `min_checks` checks each, and passes every check.
fn every_case_passes(
    prefix: &str,
    min_files: usize,
    kind: &str,
    runs: usize,
    what: &str,
    min_checks: usize,
) {
    let files = cases(prefix);
    assert!(
        files.len() >= min_files,
        "expected the {prefix}* reference cases, found {files:?}"
    );
    for f in files {
        let case = RefCase::load(&f).unwrap();
        assert_eq!(case.kind().unwrap(), kind);
        let reports = verify(&case).unwrap();
        assert_eq!(reports.len(), runs, "{what}");
        for r in reports {
            assert!(r.checks.len() >= min_checks);
            for c in &r.checks {
                assert!(
                    c.passed(),
                    "{}: {} {}: error {:.3e}",
                    f.display(),
                    r.label,
                    c.name,
                    c.error
                );
            }
        }
    }
}

#[test]
fn every_tt_linear_case_passes_on_every_path() {
    let what = "three paths and the planner's choice";
    every_case_passes("tt_", 7, "tt_linear", 4, what, 5);
}

#[test]
fn every_ttm_embedding_case_passes_with_both_lookups() {
    every_case_passes(
        "ttm_",
        3,
        "ttm_embedding",
        2,
        "naive and optimised lookups",
        3,
    );
}

#[test]
fn ttm_ids_out_of_range_are_errors() {
    let f = cases("ttm_p2").pop().expect("ttm_p2 case");
    let mut case = RefCase::load(&f).unwrap();
    if let comera_refcase::TensorData::I64(v) = &mut case.tensors.get_mut("ids").unwrap().data {
        v[3] = 45; // num_embeddings is 45
    }
    let err = verify(&case).unwrap_err().to_string();
    assert!(
        err.contains("id 45 at position 3") && err.contains("45 rows"),
        "{err}"
    );
    let mut case = RefCase::load(&f).unwrap();
    case.metadata.insert("num_embeddings".into(), "49".into()); // > 8·6
    let err = verify(&case).unwrap_err().to_string();
    assert!(err.contains("num_embeddings"), "{err}");
}

fn first_tt_case() -> (PathBuf, Vec<u8>) {
    let f = cases("tt_p2q2").pop().expect("tt_p2q2 case");
    let bytes = std::fs::read(&f).unwrap();
    (f, bytes)
}

#[test]
fn truncated_file_is_a_format_error() {
    let (f, bytes) = first_tt_case();
    let err = RefCase::parse(&f, &bytes[..bytes.len() / 2]).unwrap_err();
    assert!(matches!(err, RefCaseError::Format { .. }), "{err}");
    assert!(
        err.to_string().contains("tt_p2q2"),
        "error names the file: {err}"
    );
}

#[test]
fn missing_and_misshaped_tensors_are_named() {
    let (f, _) = first_tt_case();
    let mut case = RefCase::load(&f).unwrap();
    case.tensors.remove("core.2");
    let err = verify(&case).unwrap_err();
    assert!(
        matches!(&err, RefCaseError::MissingTensor { name, .. } if name == "core.2"),
        "{err}"
    );

    let mut case = RefCase::load(&f).unwrap();
    case.tensors.get_mut("gate.1").unwrap().shape = vec![7];
    let err = verify(&case).unwrap_err();
    assert!(err.to_string().contains("gate.1"), "{err}");

    let mut case = RefCase::load(&f).unwrap();
    case.metadata.insert("in_modes".into(), "[5,3]".into());
    let err = verify(&case).unwrap_err();
    assert!(
        err.to_string().contains("x"),
        "x no longer matches N = 15: {err}"
    );

    let mut case = RefCase::load(&f).unwrap();
    case.metadata.insert("ranks".into(), "[1,3,0,2,1]".into());
    let err = verify(&case).unwrap_err();
    assert!(err.to_string().contains("rank 0"), "{err}");

    let mut case = RefCase::load(&f).unwrap();
    case.metadata.insert("ranks".into(), "[1,3,4,1]".into());
    assert!(verify(&case)
        .unwrap_err()
        .to_string()
        .contains("expected 5 entries"));

    let mut case = RefCase::load(&f).unwrap();
    case.metadata.insert("tolerance".into(), "abc".into());
    assert!(matches!(
        verify(&case).unwrap_err(),
        RefCaseError::BadMeta { .. }
    ));
}

#[test]
fn a_wrong_expectation_fails_the_check() {
    let (f, _) = first_tt_case();
    let mut case = RefCase::load(&f).unwrap();
    if let comera_refcase::TensorData::F32(v) =
        &mut case.tensors.get_mut("expected.grad.core.3").unwrap().data
    {
        v[0] += 0.1;
    }
    let reports = verify(&case).unwrap();
    assert!(reports.iter().all(|r| !r.passed()));
}
