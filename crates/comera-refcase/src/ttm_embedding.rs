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
    let mut cores = Vec::with_capacity(p);
    for k in 0..p {
        cores.push(
            case.f32s(&format!("core.{}", k + 1), &shape.core_shape(k))?
                .to_vec(),
        );
    }
    let mut gates = Vec::with_capacity(p - 1);
    for (b, &r) in ranks.iter().enumerate().take(p).skip(1) {
        gates.push(case.f32s(&format!("gate.{b}"), &[r])?.to_vec());
    }
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
    for k in 0..p {
        checks.push(case.check(
            &format!("grad.core.{}", k + 1),
            &shape.core_shape(k),
            &table.cores[k].grad,
            tol,
        )?);
    }
    for b in 0..p - 1 {
        let r = table.gates[b].len();
        checks.push(case.check(
            &format!("grad.gate.{}", b + 1),
            &[r],
            &table.gates[b].grad,
            tol,
        )?);
    }
    if case.tensors.contains_key("expected.size_l0") {
        checks.push(case.check("size_l0", &[1], &[table.size_l0() as f32], tol)?);
        checks.push(case.check("size_l1", &[1], &[table.size_l1() as f32], tol)?);
        for g in &mut table.gates {
            g.grad.fill(0.0);
        }
        table.accumulate_size_l1_grad(1.0);
        for b in 0..p - 1 {
            let r = table.gates[b].len();
            checks.push(case.check(
                &format!("grad_size_l1.gate.{}", b + 1),
                &[r],
                &table.gates[b].grad,
                tol,
            )?);
        }
    }
    Ok(Report { label, checks })
}
