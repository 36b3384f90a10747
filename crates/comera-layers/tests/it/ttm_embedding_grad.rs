//! TtmEmbedding proven by the dense table, finite differences, lookup agreement and
//! thread-count determinism.
#![allow(clippy::needless_range_loop)]

use comera_layers::{Embedding, EmbeddingError, EmbeddingLayer, Lookup, RankGates, TtmEmbedding};
use comera_tensor::{init, TtmShape};
use rand::Rng as _;

use crate::common::assert_close;

/// (vocab modes, dim modes, ranks, rows)
type Case = (&'static [usize], &'static [usize], &'static [usize], usize);

const SHAPES: &[Case] = &[
    (&[7], &[5], &[1, 1], 6),
    (&[8, 6], &[4, 3], &[1, 5, 1], 45),
    (&[5, 4, 3], &[2, 3, 4], &[1, 4, 6, 1], 60),
    (&[3, 4, 2, 3], &[2, 2, 3, 2], &[1, 3, 4, 2, 1], 70),
    (&[2, 3, 2, 2, 3], &[2, 1, 2, 3, 2], &[1, 2, 3, 3, 2, 1], 72),
];

fn random_table(
    rng: &mut init::Rng,
    s: (&[usize], &[usize], &[usize], usize),
    prune: bool,
) -> TtmEmbedding {
    let shape = TtmShape::new(s.0, s.1, s.2, s.3).unwrap();
    let mut t = TtmEmbedding::new("e", shape, RankGates::default(), 1.0, rng).unwrap();
    for c in &mut t.cores {
        init::fill_normal(rng, &mut c.value, 0.8);
    }
    for (b, g) in t.gates.iter_mut().enumerate() {
        for d in &mut g.value {
            *d = rng.random_range(0.3..1.5);
        }
        if prune && g.value.len() > 1 {
            let j = b % g.value.len();
            g.value[j] = [-0.2f32, 0.0, 0.01][b % 3];
        }
    }
    t
}

/// Ids with duplicates, including 0 and V-1.
fn random_ids(rng: &mut init::Rng, rows: usize, n: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..n).map(|_| rng.random_range(0..rows as u32)).collect();
    ids[0] = 0;
    ids[1] = rows as u32 - 1;
    ids[2] = ids[3];
    ids
}

fn run(t: &TtmEmbedding, lookup: Lookup, ids: &[u32], dy: &[f32]) -> (Vec<f32>, Vec<Vec<f32>>) {
    let mut t = t.clone();
    for p in t.params_mut() {
        p.grad.fill(0.0);
    }
    let mut ws = t.workspace_with(ids.len(), lookup);
    let mut y = vec![0.0; ids.len() * t.dim()];
    t.forward(&mut ws, ids, &mut y).unwrap();
    t.backward(&mut ws, ids, dy);
    (y, t.params().iter().map(|p| p.grad.clone()).collect())
}

fn loss(t: &TtmEmbedding, ids: &[u32], dy: &[f32]) -> f64 {
    let mut ws = t.workspace_with(ids.len(), Lookup::Naive);
    let mut y = vec![0.0; ids.len() * t.dim()];
    t.forward(&mut ws, ids, &mut y).unwrap();
    y.iter().zip(dy).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// Reference row: the chain of gated core slices, contracted naively in f64.
fn reference_row(t: &TtmEmbedding, id: usize) -> Vec<f64> {
    let s = t.shape();
    let (v, e, r) = (s.vocab_modes(), s.dim_modes(), s.ranks());
    let p = s.n_cores();
    let mut digits = vec![0; p];
    let mut rest = id;
    for k in (0..p).rev() {
        digits[k] = rest % v[k];
        rest /= v[k];
    }
    // acc: (columns so far) × r_k
    let mut acc = vec![1.0f64];
    let mut cols = 1;
    for k in 0..p {
        let core = &t.cores[k].value;
        let gate = |b: usize| {
            if k + 1 < p {
                RankGates::default().value(t.gates[k].value[b]) as f64
            } else {
                1.0
            }
        };
        let mut next = vec![0.0; cols * e[k] * r[k + 1]];
        for c in 0..cols {
            for a in 0..r[k] {
                let x = acc[c * r[k] + a];
                for ce in 0..e[k] {
                    for b in 0..r[k + 1] {
                        let g = core[((a * v[k] + digits[k]) * e[k] + ce) * r[k + 1] + b] as f64;
                        next[(c * e[k] + ce) * r[k + 1] + b] += x * g * gate(b);
                    }
                }
            }
        }
        acc = next;
        cols *= e[k];
    }
    acc
}

#[test]
fn lookups_match_the_reference_rows_and_each_other() {
    let mut rng = init::rng(21);
    for &s in SHAPES {
        for prune in [false, true] {
            let t = random_table(&mut rng, s, prune);
            let ids = random_ids(&mut rng, s.3, 19);
            let mut dy = vec![0.0; ids.len() * t.dim()];
            init::fill_normal(&mut rng, &mut dy, 1.0);
            let (yn, gn) = run(&t, Lookup::Naive, &ids, &dy);
            let (yo, go) = run(&t, Lookup::Optimized, &ids, &dy);
            let want: Vec<f32> = ids
                .iter()
                .flat_map(|&i| reference_row(&t, i as usize))
                .map(|v| v as f32)
                .collect();
            assert_close(&format!("{s:?} naive y"), &yn, &want, 1e-5);
            assert_close(&format!("{s:?} optimized y"), &yo, &want, 1e-5);
            for (k, (a, b)) in gn.iter().zip(&go).enumerate() {
                assert_close(&format!("{s:?} prune {prune} param {k}"), b, a, 1e-5);
            }
        }
    }
}

#[test]
fn finite_differences_match_core_and_gate_gradients() {
    let mut rng = init::rng(22);
    for &s in SHAPES {
        let t = random_table(&mut rng, s, true);
        let ids = random_ids(&mut rng, s.3, 9);
        let mut dy = vec![0.0; ids.len() * t.dim()];
        init::fill_normal(&mut rng, &mut dy, 1.0);
        for lookup in [Lookup::Naive, Lookup::Optimized] {
            let (_, grads) = run(&t, lookup, &ids, &dy);
            let eps = 1e-2f32;
            for (k, analytic) in grads.iter().enumerate() {
                let name = t.params()[k].name.clone();
                let mut fd = vec![0.0f32; analytic.len()];
                for i in 0..analytic.len() {
                    let v = t.params()[k].value[i];
                    if name.contains("gate") && (v - 0.01).abs() < 2.0 * eps {
                        continue;
                    }
                    let (mut tp, mut tm) = (t.clone(), t.clone());
                    tp.params_mut()[k].value[i] = v + eps;
                    tm.params_mut()[k].value[i] = v - eps;
                    fd[i] =
                        ((loss(&tp, &ids, &dy) - loss(&tm, &ids, &dy)) / (2.0 * eps as f64)) as f32;
                }
                if name.contains("gate") {
                    for (i, &d) in t.params()[k].value.iter().enumerate() {
                        if d <= 0.01 {
                            assert_eq!(
                                analytic[i], 0.0,
                                "{name}[{i}] is pruned and must get no gradient"
                            );
                        }
                    }
                }
                assert_close(&format!("{lookup:?} {name} {s:?}"), analytic, &fd, 5e-3);
            }
        }
    }
}

#[test]
fn gradients_are_bit_identical_for_any_thread_count() {
    let mut rng = init::rng(23);
    let shape = TtmShape::uniform(&[16, 20, 10, 10], &[4, 4, 8, 6], 16, 30522).unwrap();
    let t = TtmEmbedding::new("e", shape, RankGates::default(), 1.0, &mut rng).unwrap();
    let ids = random_ids(&mut rng, 30522, 700);
    let mut dy = vec![0.0; ids.len() * 768];
    init::fill_normal(&mut rng, &mut dy, 1.0);
    let results: Vec<_> = [1usize, 2, 3]
        .iter()
        .map(|&n| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap();
            pool.install(|| {
                (
                    run(&t, Lookup::Optimized, &ids, &dy),
                    run(&t, Lookup::Naive, &ids, &dy),
                )
            })
        })
        .collect();
    for r in &results[1..] {
        assert!(
            r.0 .0 == results[0].0 .0 && r.0 .1 == results[0].0 .1,
            "optimised lookup differs across thread counts"
        );
        assert!(
            r.1 .1 == results[0].1 .1,
            "naive lookup differs across thread counts"
        );
    }
}

/// The lookup an `Auto` workspace ran for `ids`, with its output and gradients.
fn run_auto(t: &TtmEmbedding, ids: &[u32], dy: &[f32]) -> (Lookup, Vec<f32>, Vec<Vec<f32>>) {
    let mut t = t.clone();
    for p in t.params_mut() {
        p.grad.fill(0.0);
    }
    let mut ws = t.workspace(ids.len());
    assert_eq!(ws.lookup(), Lookup::Auto);
    let mut y = vec![0.0; ids.len() * t.dim()];
    t.forward(&mut ws, ids, &mut y).unwrap();
    t.backward(&mut ws, ids, dy);
    let grads = t.params().iter().map(|p| p.grad.clone()).collect();
    (ws.chosen(), y, grads)
}

#[test]
fn auto_lookup_picks_per_batch_and_matches_the_pick_bit_for_bit() {
    let mut rng = init::rng(26);
    // A DLRM-like table: distinct ids give the optimised lookup nothing to share, while few
    // ids repeated many times share nearly all of its chains.
    let shape = TtmShape::uniform(&[20, 22, 25], &[4, 4, 4], 8, 11_000).unwrap();
    let t = TtmEmbedding::new("e", shape, RankGates::default(), 1.0, &mut rng).unwrap();
    let n = 600;
    let distinct: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % 11_000).collect();
    let repeated: Vec<u32> = (0..n as u32).map(|i| (i % 5) * 2003).collect();
    let mut dy = vec![0.0; n * t.dim()];
    init::fill_normal(&mut rng, &mut dy, 1.0);
    for (ids, want) in [(&distinct, Lookup::Naive), (&repeated, Lookup::Optimized)] {
        let (chosen, y, g) = run_auto(&t, ids, &dy);
        assert_eq!(chosen, want);
        let (y_want, g_want) = run(&t, want, ids, &dy);
        assert!(y == y_want && g == g_want, "auto differs from {want:?}");
    }
    // One workspace, alternating batches: each batch runs its own pick.
    let mut t2 = t.clone();
    let mut ws = t2.workspace(n);
    let mut y = vec![0.0; n * t.dim()];
    for (ids, want) in [
        (&distinct, Lookup::Naive),
        (&repeated, Lookup::Optimized),
        (&distinct, Lookup::Naive),
    ] {
        t2.forward(&mut ws, ids, &mut y).unwrap();
        assert_eq!(ws.chosen(), want);
        t2.backward(&mut ws, ids, &dy);
        let (y_want, _) = run(&t, want, ids, &dy);
        assert!(
            y == y_want,
            "auto workspace reused: output differs from {want:?}"
        );
    }
}

#[test]
fn bad_ids_and_shapes_are_clear_errors() {
    let mut rng = init::rng(24);
    let t = random_table(&mut rng, SHAPES[1], false);
    let mut ws = t.workspace(3);
    let mut y = vec![0.0; 3 * t.dim()];
    assert_eq!(
        t.forward(&mut ws, &[1, 45, 2], &mut y).unwrap_err(),
        EmbeddingError::IdOutOfRange {
            pos: 1,
            id: 45,
            rows: 45
        }
    );
    assert_eq!(
        t.forward(&mut ws, &[], &mut []).unwrap_err(),
        EmbeddingError::Empty
    );
    assert!(matches!(
        t.forward(&mut ws, &[1, 2], &mut y[..2 * 12]).unwrap_err(),
        EmbeddingError::TokenCount { .. }
    ));
    assert!(TtmShape::new(&[8, 6], &[4, 3, 2], &[1, 5, 1], 45).is_err());
    assert!(TtmShape::new(&[8, 6], &[4, 3], &[1, 5, 1], 49).is_err());
    assert!(TtmShape::new(&[8, 6], &[4, 3], &[1, 0, 1], 45).is_err());
    let e = Embedding::new("d", 10, 4, 1.0, &mut rng);
    let mut ews = e.workspace(1);
    assert!(e.forward(&mut ews, &[10], &mut [0.0; 4]).is_err());
}

#[test]
fn dense_embedding_scatters_gradients_per_id() {
    let mut rng = init::rng(25);
    let mut e = Embedding::new("d", 6, 3, 1.0, &mut rng);
    let ids = [2u32, 5, 2];
    let mut ws = e.workspace(3);
    let mut y = vec![0.0; 9];
    e.forward(&mut ws, &ids, &mut y).unwrap();
    assert_eq!(&y[0..3], &e.table.value[6..9]);
    let dy: Vec<f32> = (0..9).map(|i| i as f32).collect();
    e.backward(&mut ws, &ids, &dy);
    assert_eq!(&e.table.grad[6..9], &[6.0, 8.0, 10.0]);
    assert_eq!(&e.table.grad[15..18], &[3.0, 4.0, 5.0]);
    assert!(e.table.grad[..6].iter().all(|&g| g == 0.0));
}

#[test]
fn initialisation_gives_rows_the_requested_variance() {
    let mut rng = init::rng(26);
    let shape = TtmShape::uniform(&[16, 20, 10, 10], &[4, 4, 8, 6], 32, 30522).unwrap();
    let t = TtmEmbedding::new("e", shape, RankGates::default(), 1.0, &mut rng).unwrap();
    let ids: Vec<u32> = (0..2000u32).map(|i| i * 15).collect();
    let mut ws = t.workspace(ids.len());
    let mut y = vec![0.0; ids.len() * 768];
    t.forward(&mut ws, &ids, &mut y).unwrap();
    let var = y.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / y.len() as f64;
    assert!((var - 1.0).abs() < 0.3, "row variance {var}");
}

/// The dense table's gradient (the position and token-type tables, a dense word table) summed
/// in column bands on several threads is the plain in-order loop's bit for bit, on 1, 2 and 3
/// threads: repeated ids (positions of 40 sequences, and a table of 2 rows where nearly every
/// id is 0, as token types), a width that is not a whole number of bands, and a batch below
/// the parallel threshold.
#[test]
fn dense_table_gradients_are_the_in_order_sums_for_any_thread_count() {
    let mut rng = init::rng(31);
    for (rows, d, ids) in [
        (
            128usize,
            200usize,
            (0..40 * 128).map(|i| (i % 128) as u32).collect::<Vec<_>>(),
        ),
        (2, 130, (0..3000).map(|i| (i % 97 == 0) as u32).collect()),
        (50, 70, (0..9).map(|i| (i * 7 % 50) as u32).collect()),
    ] {
        let table = Embedding::new("t", rows, d, 0.5, &mut rng);
        let mut dy = vec![0.0; ids.len() * d];
        init::fill_normal(&mut rng, &mut dy, 1.0);
        // The plain loop, in row order.
        let mut want = vec![0.0f32; rows * d];
        for (row, &id) in dy.chunks_exact(d).zip(&ids) {
            for (g, v) in want[id as usize * d..][..d].iter_mut().zip(row) {
                *g += v;
            }
        }
        for threads in [1usize, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut t = table.clone();
            let mut ws = t.workspace(ids.len());
            pool.install(|| t.backward(&mut ws, &ids, &dy));
            let same = t
                .table
                .grad
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{rows} × {d}, {} ids, {threads} threads", ids.len());
        }
    }
}
