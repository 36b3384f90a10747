//! Running a `tt_linear` reference case.

use crate::{RefCase, RefCaseError, Report};
use comera_layers::{Layer, RankGates, TtLinear};
use comera_plan::TtPath;
use comera_tensor::TtShape;

/// Builds the case's layer (every tensor checked against the metadata's shapes).
fn build(case: &RefCase) -> Result<(TtLinear, usize), RefCaseError> {
    let in_modes = case.meta_usizes("in_modes")?;
    let out_modes = case.meta_usizes("out_modes")?;
    let ranks = case.meta_usizes("ranks")?;
    let threshold = case.meta_f32("threshold")?;
    let shape = TtShape::new(&in_modes, &out_modes, &ranks).map_err(|e| RefCaseError::Invalid {
        file: case.file.clone(),
        msg: format!("metadata: {e}"),
    })?;
    let (n, m, k) = (shape.in_features(), shape.out_features(), shape.n_cores());
    let xs = case.shape_of("x")?;
    if xs.len() != 2 || xs[1] != n {
        return Err(RefCaseError::TensorShape {
            file: case.file.clone(),
            name: "x".into(),
            got: xs.to_vec(),
            expected: vec![xs.first().copied().unwrap_or(0), n],
        });
    }
    let batch = xs[0];
    let (cores, gates) = case.chain_values((0..k).map(|c| shape.core_shape(c)), &ranks)?;
    let bias = case.f32s("bias", &[m])?.to_vec();
    let layer = TtLinear::from_parts("case", shape, RankGates::new(threshold), cores, gates, bias)
        .map_err(|e| RefCaseError::Invalid {
            file: case.file.clone(),
            msg: e.to_string(),
        })?;
    Ok((layer, batch))
}

/// Runs forward and backward with `path` (`None`: the planner's choice) and checks y, every
/// gradient, and the size measures against the case's expectations.
pub fn verify_tt_linear(case: &RefCase, path: Option<TtPath>) -> Result<Report, RefCaseError> {
    let tol = case.meta_f32("tolerance")? as f64;
    let (mut layer, batch) = build(case)?;
    let (n, m) = (layer.in_features(), layer.out_features());
    let x = case.f32s("x", &[batch, n])?.to_vec();
    let dy = case.f32s("dy", &[batch, m])?.to_vec();
    let mut ws = layer.workspace(batch);
    if path.is_some() {
        ws.force_path(path);
    }
    let label = match path {
        Some(p) => p.to_string(),
        None => format!("planner ({})", ws.path()),
    };
    let mut y = vec![0.0; batch * m];
    layer.forward(&mut ws, &x, &mut y);
    let mut dx = vec![0.0; batch * n];
    layer.backward(&mut ws, &x, &dy, Some(&mut dx));

    let mut checks = vec![
        case.check("y", &[batch, m], &y, tol)?,
        case.check("grad.x", &[batch, n], &dx, tol)?,
    ];
    checks.extend(case.check_grads("grad", "core", &layer.cores, tol)?);
    checks.extend(case.check_grads("grad", "gate", &layer.gates, tol)?);
    checks.push(case.check("grad.bias", &[m], &layer.bias.grad, tol)?);
    checks.extend(case.check_sizes(&mut layer, |l| &mut l.gates, tol)?);
    Ok(Report { label, checks })
}
