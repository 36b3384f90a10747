//! Physical truncation leaves a layer's function and its surviving gradients unchanged, and a
//! layer with a dead bond outputs its bias (TT linear) or zeros (TTM).

use comera_layers::{
    Compressible, EmbeddingLayer, Layer, RankGates, Retained, TtLinear, TtmEmbedding,
};
use comera_tensor::{init, TtShape, TtmShape};
use rand::Rng as _;

fn random_vec(rng: &mut init::Rng, n: usize) -> Vec<f32> {
    let mut v = vec![0.0; n];
    init::fill_normal(rng, &mut v, 1.0);
    v
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// Gradients of every parameter (name → values) after one backward of Σ y·dy.
fn tt_step(
    layer: &mut TtLinear,
    ws: &mut <TtLinear as Layer>::Workspace,
    x: &[f32],
    dy: &[f32],
    b: usize,
) -> (Vec<f32>, Vec<f32>) {
    let mut y = vec![0.0; b * layer.out_features()];
    let mut dx = vec![0.0; b * layer.in_features()];
    layer.zero_grad();
    layer.forward(ws, x, &mut y);
    layer.backward(ws, x, dy, Some(&mut dx));
    (y, dx)
}

fn pick(v: &[f32], kept: &[usize]) -> Vec<f32> {
    kept.iter().map(|&i| v[i]).collect()
}

fn grads_by_name(params: Vec<&comera_layers::Param>) -> Vec<(String, Vec<f32>)> {
    params
        .into_iter()
        .map(|p| (p.name.clone(), p.grad.clone()))
        .collect()
}

/// Surviving gradients after truncation equal the kept entries of the gradients before.
fn check_retained(
    before: &[(String, Vec<f32>)],
    after: &[(String, Vec<f32>)],
    changed: &[Retained],
) {
    for ((name, g0), (name1, g1)) in before.iter().zip(after) {
        assert_eq!(name, name1);
        let expect = match changed.iter().find(|r| &r.name == name) {
            Some(r) => pick(g0, &r.kept),
            None => g0.clone(),
        };
        assert!(
            max_rel(g1, &expect) < 1e-5,
            "{name}: gradient changed by truncation"
        );
    }
}

#[test]
fn tt_linear_truncation_preserves_function_and_gradients() {
    let mut rng = init::rng(11);
    let shape = TtShape::new(&[4, 3, 2], &[2, 5], &[1, 4, 5, 3, 4, 1]).unwrap();
    let mut layer = TtLinear::new("l", shape, RankGates::default(), &mut rng).unwrap();
    for g in &mut layer.gates {
        for d in &mut g.value {
            *d = rng.random_range(0.3..1.2);
        }
    }
    // Prune some slices (below, at and far below τ), keep at least one per bond.
    layer.gates[0].value[1] = 0.005;
    layer.gates[1].value[0] = -0.3;
    layer.gates[1].value[4] = 0.01;
    layer.gates[3].value[2] = 0.0;
    init::fill_normal(&mut rng, &mut layer.bias.value, 0.5);
    let b = 7;
    let x = random_vec(&mut rng, b * 24);
    let dy = random_vec(&mut rng, b * 10);
    let mut ws = layer.workspace(b);
    let (y0, dx0) = tt_step(&mut layer, &mut ws, &x, &dy, b);
    let g0 = grads_by_name(layer.params());
    let s0 = layer.size_l0();

    let changed = layer.truncate();
    assert_eq!(layer.ranks(), vec![1, 3, 3, 3, 3, 1]);
    assert_eq!(
        layer.size_l0(),
        s0,
        "S counts surviving slices only, before and after"
    );
    assert!(!layer.is_dead());
    let (y1, dx1) = tt_step(&mut layer, &mut ws, &x, &dy, b);
    assert!(max_rel(&y1, &y0) < 1e-5, "output changed by truncation");
    assert!(max_rel(&dx1, &dx0) < 1e-5, "dX changed by truncation");
    check_retained(&g0, &grads_by_name(layer.params()), &changed);
    // A second truncation has nothing to do.
    assert!(layer.truncate().is_empty());
}

#[test]
fn tt_linear_with_a_dead_bond_outputs_its_bias() {
    let mut rng = init::rng(12);
    let shape = TtShape::uniform(&[4, 3], &[3, 4], 3).unwrap();
    let mut layer = TtLinear::new("l", shape, RankGates::default(), &mut rng).unwrap();
    layer.gates[1].value.fill(0.0);
    init::fill_normal(&mut rng, &mut layer.bias.value, 0.5);
    assert!(layer.is_dead());
    let b = 3;
    let x = random_vec(&mut rng, b * 12);
    let dy = random_vec(&mut rng, b * 12);
    let mut ws = layer.workspace(b);
    let (y0, _) = tt_step(&mut layer, &mut ws, &x, &dy, b);
    layer.truncate();
    let (y1, dx1) = tt_step(&mut layer, &mut ws, &x, &dy, b);
    assert_eq!(y0, y1);
    for row in y1.chunks_exact(12) {
        assert_eq!(row, &layer.bias.value[..]);
    }
    assert!(dx1.iter().all(|&v| v == 0.0));
    assert!(layer.cores.iter().all(|c| c.grad.iter().all(|&g| g == 0.0)));
    let sums: Vec<f32> = (0..12)
        .map(|j| (0..b).map(|i| dy[i * 12 + j]).sum())
        .collect();
    assert!(max_rel(&layer.bias.grad, &sums) < 1e-6);
}

#[test]
fn ttm_truncation_preserves_rows_and_gradients() {
    let mut rng = init::rng(13);
    let shape = TtmShape::new(&[5, 4, 3], &[2, 3, 2], &[1, 6, 5, 1], 57).unwrap();
    let mut table = TtmEmbedding::new("e", shape, RankGates::default(), 1.0, &mut rng).unwrap();
    table.gates[0].value[2] = 0.001;
    table.gates[0].value[5] = -1.0;
    table.gates[1].value[0] = 0.0;
    let ids: Vec<u32> = vec![0, 3, 56, 3, 17, 40, 17, 9];
    let dy = random_vec(&mut rng, ids.len() * 12);
    let mut ws = table.workspace(ids.len());
    let run = |t: &mut TtmEmbedding, ws: &mut <TtmEmbedding as EmbeddingLayer>::Workspace| {
        let mut y = vec![0.0; ids.len() * 12];
        t.visit_params_mut(&mut |p| p.grad.fill(0.0));
        t.forward(ws, &ids, &mut y).unwrap();
        t.backward(ws, &ids, &dy);
        y
    };
    let y0 = run(&mut table, &mut ws);
    let g0 = grads_by_name(table.params());
    let changed = table.truncate();
    assert_eq!(table.ranks(), vec![1, 4, 4, 1]);
    let y1 = run(&mut table, &mut ws);
    assert!(max_rel(&y1, &y0) < 1e-5);
    check_retained(&g0, &grads_by_name(table.params()), &changed);

    table.gates[1].value.fill(0.0);
    let changed = table.truncate();
    assert!(table.is_dead());
    assert!(!changed.is_empty());
    let y2 = run(&mut table, &mut ws);
    assert!(y2.iter().all(|&v| v == 0.0));
}

#[test]
fn a_layer_is_named_by_its_parameters_prefix_before_and_after_truncation() {
    let mut rng = init::rng(17);
    let shape = TtShape::new(&[4, 3], &[3, 4], &[1, 3, 4, 2, 1]).unwrap();
    let mut linear =
        TtLinear::new("encoder.0.attn.q", shape, RankGates::default(), &mut rng).unwrap();
    let shape = TtmShape::new(&[5, 4, 3], &[2, 3, 2], &[1, 6, 5, 1], 57).unwrap();
    let mut table = TtmEmbedding::new(
        "embeddings.word",
        shape,
        RankGates::default(),
        1.0,
        &mut rng,
    )
    .unwrap();
    linear.gates[0].value[1] = 0.0;
    table.gates[0].value[2] = 0.0;
    linear.truncate();
    table.truncate();
    assert_eq!(linear.layer_name(), "encoder.0.attn.q");
    assert_eq!(table.layer_name(), "embeddings.word");
}
