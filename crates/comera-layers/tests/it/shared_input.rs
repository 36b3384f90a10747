//! `SharedInput` (q, k, v as one fused merged-path product) against the layers run one by one
//! and against finite differences of its own forward.
#![allow(clippy::needless_range_loop)]

use comera_layers::tt_linear::SharedInput;
use comera_layers::{Layer, RankGates, TtLinear};
use comera_tensor::{init, TtShape};
use rand::Rng as _;

use crate::common::assert_close;

fn random_vec(rng: &mut init::Rng, n: usize) -> Vec<f32> {
    let mut v = vec![0.0; n];
    init::fill_normal(rng, &mut v, 1.0);
    v
}

/// Three layers on one input width (24) with different output modes and ranks, gates around 1
/// with one pruned entry each.
fn layers(rng: &mut init::Rng) -> Vec<TtLinear> {
    let specs: [(&[usize], &[usize], &[usize]); 3] = [
        (&[4, 6], &[6, 4], &[1, 3, 5, 2, 1]),
        (&[4, 6], &[3, 8], &[1, 2, 3, 4, 1]),
        (&[4, 3, 2], &[2, 5], &[1, 4, 6, 3, 2, 1]),
    ];
    specs
        .iter()
        .enumerate()
        .map(|(i, &(im, om, r))| {
            let shape = TtShape::new(im, om, r).unwrap();
            let mut l = TtLinear::new(&format!("l{i}"), shape, RankGates::default(), rng).unwrap();
            for c in &mut l.cores {
                init::fill_normal(rng, &mut c.value, 0.7);
            }
            for g in &mut l.gates {
                for d in &mut g.value {
                    *d = rng.random_range(0.3..1.5);
                }
                g.value[0] = 0.0; // pruned
            }
            init::fill_normal(rng, &mut l.bias.value, 0.5);
            l
        })
        .collect()
}

/// Forward of the fused workspace: [Y_1 | … | Y_n], B × M_i each.
fn fused_forward(ls: &[TtLinear], batch: usize, x: &[f32]) -> Vec<f32> {
    let refs: Vec<&TtLinear> = ls.iter().collect();
    let mut w = SharedInput::new_unplanned(&refs, batch).expect("merged path at this batch");
    let mut y = vec![f32::NAN; batch * w.out_width()];
    w.forward(&refs, x, &mut y);
    y
}

fn loss(ls: &[TtLinear], batch: usize, x: &[f32], dy: &[f32]) -> f64 {
    let y = fused_forward(ls, batch, x);
    y.iter().zip(dy).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// (y = [Y_1 | … | Y_n], dx, every layer's parameter gradients) of the fused workspace.
fn fused_run(
    ls: &[TtLinear],
    batch: usize,
    x: &[f32],
    dy: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
    let mut ls = ls.to_vec();
    let refs: Vec<&TtLinear> = ls.iter().collect();
    let mut w = SharedInput::new_unplanned(&refs, batch).unwrap();
    let mut y = vec![f32::NAN; batch * w.out_width()];
    w.forward(&refs, x, &mut y);
    let mut dx = vec![f32::NAN; x.len()]; // written, not accumulated
    let mut muts: Vec<&mut TtLinear> = ls.iter_mut().collect();
    w.backward(&mut muts, x, dy, &mut dx);
    let grads = ls
        .iter()
        .flat_map(|l| l.params().into_iter().map(|p| p.grad.clone()))
        .collect();
    (y, dx, grads)
}

#[test]
fn fused_equals_the_layers_one_by_one() {
    let mut rng = init::rng(41);
    let ls = layers(&mut rng);
    for batch in [1usize, 5, 40] {
        let n = ls[0].in_features();
        let w: usize = ls.iter().map(|l| l.out_features()).sum();
        let x = random_vec(&mut rng, batch * n);
        let dy = random_vec(&mut rng, batch * w);
        let (y, dx, grads) = fused_run(&ls, batch, &x, &dy);
        // One by one: the output's blocks, dx summed.
        let (mut want_y, mut want_dx, mut want_g) =
            (vec![0.0; batch * w], vec![0.0; x.len()], vec![]);
        let mut m0 = 0;
        for l in &ls {
            let mut l = l.clone();
            let m = l.out_features();
            let mut ws = l.workspace(batch);
            let mut yi = vec![0.0; batch * m];
            l.forward(&mut ws, &x, &mut yi);
            let block = batch * m0..batch * (m0 + m);
            want_y[block.clone()].copy_from_slice(&yi);
            let dyi = &dy[block];
            let mut dxi = vec![0.0; x.len()];
            l.backward(&mut ws, &x, dyi, Some(&mut dxi));
            for (a, b) in want_dx.iter_mut().zip(&dxi) {
                *a += b;
            }
            want_g.extend(l.params().into_iter().map(|p| p.grad.clone()));
            m0 += m;
        }
        assert_close(&format!("y batch {batch}"), &y, &want_y, 1e-5);
        assert_close(&format!("dx batch {batch}"), &dx, &want_dx, 1e-5);
        for (i, (g, wg)) in grads.iter().zip(&want_g).enumerate() {
            assert_close(&format!("param {i} batch {batch}"), g, wg, 1e-5);
        }
    }
}

#[test]
fn fused_gives_the_same_bits_on_any_thread_count() {
    // The layers' chains are built and peeled side by side (halves of the layers as tasks),
    // each on its own buffers of different sizes: any pool gives the same bits.
    let mut rng = init::rng(43);
    let ls = layers(&mut rng);
    let batch = 7;
    let x = random_vec(&mut rng, batch * ls[0].in_features());
    let w: usize = ls.iter().map(|l| l.out_features()).sum();
    let dy = random_vec(&mut rng, batch * w);
    let runs = [1usize, 2, 3].map(|n| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap();
        pool.install(|| fused_run(&ls, batch, &x, &dy))
    });
    for r in &runs[1..] {
        assert!(
            r == &runs[0],
            "the fused q/k/v differs across thread counts"
        );
    }
}

#[test]
fn fused_matches_finite_differences() {
    let mut rng = init::rng(42);
    let ls = layers(&mut rng);
    let batch = 3;
    let n = ls[0].in_features();
    let w: usize = ls.iter().map(|l| l.out_features()).sum();
    let x = random_vec(&mut rng, batch * n);
    let dy = random_vec(&mut rng, batch * w);
    let (_, dx, grads) = fused_run(&ls, batch, &x, &dy);
    let eps = 1e-2f32;
    let mut fd = vec![0.0f32; x.len()];
    for i in 0..x.len() {
        let (mut xp, mut xm) = (x.clone(), x.clone());
        xp[i] += eps;
        xm[i] -= eps;
        fd[i] =
            ((loss(&ls, batch, &xp, &dy) - loss(&ls, batch, &xm, &dy)) / (2.0 * eps as f64)) as f32;
    }
    assert_close("dx", &dx, &fd, 2e-3);
    let mut k = 0;
    for li in 0..ls.len() {
        for pi in 0..ls[li].params().len() {
            let analytic = &grads[k];
            k += 1;
            let mut fd = vec![0.0f32; analytic.len()];
            for i in 0..analytic.len() {
                let (mut lp, mut lm) = (ls.clone(), ls.clone());
                let v = lp[li].params()[pi].value[i];
                if lp[li].params()[pi].name.contains("gate") && (v - 0.01).abs() < 2.0 * eps {
                    continue; // at the threshold: no central difference (pruned: exact zero)
                }
                lp[li].params_mut()[pi].value[i] = v + eps;
                lm[li].params_mut()[pi].value[i] = v - eps;
                fd[i] = ((loss(&lp, batch, &x, &dy) - loss(&lm, batch, &x, &dy))
                    / (2.0 * eps as f64)) as f32;
            }
            let name = &ls[li].params()[pi].name;
            assert_close(name, analytic, &fd, 5e-3);
        }
    }
}

#[test]
fn no_fusion_across_input_widths_rank_changes_or_other_plans() {
    let mut rng = init::rng(43);
    let ls = layers(&mut rng);
    let other = TtLinear::new(
        "o",
        TtShape::new(&[5, 5], &[4, 4], &[1, 2, 3, 2, 1]).unwrap(),
        RankGates::default(),
        &mut rng,
    )
    .unwrap();
    assert!(SharedInput::new_unplanned(&[&ls[0], &other], 4).is_none());
    let refs: Vec<&TtLinear> = ls.iter().collect();
    let w = SharedInput::new_unplanned(&refs, 4).unwrap();
    assert!(w.applies(&refs));
    let mut shrunk = ls[1].clone();
    use comera_layers::Compressible;
    shrunk.set_ranks(&[1, 2, 2, 2, 1]).unwrap();
    assert!(!w.applies(&[&ls[0], &shrunk, &ls[2]]));
    // The planner's choice: fused only if the layer plans the merged path.
    let tiny = TtLinear::new(
        "t",
        TtShape::new(&[4, 4], &[4, 4], &[1, 4, 16, 4, 1]).unwrap(),
        RankGates::default(),
        &mut rng,
    )
    .unwrap();
    let path = tiny.workspace(4).path();
    assert_eq!(
        SharedInput::new(&[&tiny, &tiny], 4).is_some(),
        path == comera_plan::TtPath::Merged
    );
}
