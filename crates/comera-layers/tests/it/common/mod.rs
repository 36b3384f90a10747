//! Helpers shared by the layer tests.

/// Asserts max|got − want| ≤ rel · max(max|want|, 1e-6).
pub fn assert_close(what: &str, got: &[f32], want: &[f32], rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        err <= rel * scale,
        "{what}: max error {err} > {rel} × {scale}"
    );
}
