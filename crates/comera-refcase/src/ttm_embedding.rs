//! Running a `ttm_embedding` reference case.

use crate::{RefCase, RefCaseError, Report};
use comera_layers::embedding::ids_from_i64;
use comera_layers::{EmbeddingLayer, Lookup, RankGates, TtmEmbedding};
use comera_tensor::TtmShape;

/// Runs the lookup forward and backward and checks y, every gradient and the size measures.
pub fn verify_ttm_embedding(case: &RefCase, lookup: Lookup) -> Result<Report, RefCaseError> {
    let invalid = |msg: String| RefCaseError::Invalid {
        file: case.file.clone(),
        msg,
    };
    let tol = case.meta_f32("tolerance")? as f64;
    let vocab = case.meta_usizes("vocab_modes")?;
    let dims = case.meta_usizes("dim_modes")?;
    let ranks = case.meta_usizes("ranks")?;
    let rows = case.meta_usize("num_embeddings")?;
    let threshold = case.meta_f32("threshold")?;
    let shape = TtmShape::new(&vocab, &dims, &ranks, rows)
        .map_err(|e| invalid(format!("metadata: {e}")))?;
    let (p, d) = (shape.n_cores(), shape.dim());
    let id_shape = case.shape_of("ids")?.to_vec();
    if id_shape.len() != 1 {
        return Err(RefCaseError::TensorShape {
            file: case.file.clone(),
            name: "ids".into(),
            got: id_shape,
            expected: vec![0],
        });
    }
    let tokens = id_shape[0];
    let ids = ids_from_i64(case.i64s("ids", &[tokens])?, rows)
        .map_err(|e| invalid(format!("ids: {e}")))?;
    let dy = case.f32s("dy", &[tokens, d])?.to_vec();
    let (cores, gates) = case.chain_values((0..p).map(|k| shape.core_shape(k)), &ranks)?;
    let mut table = TtmEmbedding::from_parts(
        "case",
        shape.clone(),
        RankGates::new(threshold),
        cores,
        gates,
    )
    .map_err(|e| invalid(e.to_string()))?;
    let mut ws = table.workspace_with(tokens, lookup);
    let mut y = vec![0.0; tokens * d];
    table
        .forward(&mut ws, &ids, &mut y)
        .map_err(|e| invalid(format!("ids: {e}")))?;
    table.backward(&mut ws, &ids, &dy);
    let label = match lookup {
        Lookup::Naive => "naive".to_string(),
        Lookup::Optimized => format!("optimized (split {})", ws.split()),
        Lookup::Auto => format!("auto (picked {})", ws.chosen().name()),
    };
    let mut checks = vec![case.check("y", &[tokens, d], &y, tol)?];
    checks.extend(case.check_grads("grad", "core", &table.cores, tol)?);
    checks.extend(case.check_grads("grad", "gate", &table.gates, tol)?);
    checks.extend(case.check_sizes(&mut table, |t| &mut t.gates, tol)?);
    Ok(Report { label, checks })
}
