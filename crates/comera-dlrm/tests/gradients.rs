//! The DLRM's hand-derived backward against central finite differences, TTM tables against
//! their dense equivalent, and determinism across thread counts.

use comera_data::ctr::CtrBatch;
use comera_dlrm::config::{DlrmConfig, TableKind};
use comera_dlrm::model::{Dlrm, DlrmState};
use comera_layers::{AnyEmbedding as Table, Embedding, Model, Param, ParamKind, Trainable};

fn cfg(tables: TableKind) -> DlrmConfig {
    DlrmConfig {
        embedding_dim: 4,
        bottom_mlp: vec![6],
        top_mlp: vec![8],
        tables,
        ttm_threshold: 20,
        ttm_cores: 2,
        ttm_rank: 3,
        gate_threshold: 0.01,
        embedding_std: 0.5,
    }
}

const SIZES: [usize; 3] = [5, 30, 7];

fn names() -> Vec<String> {
    ["a", "b", "c"].iter().map(|s| s.to_string()).collect()
}

/// A batch of 6: dense 6 × 3, ids field-major 3 × 6 (with a repeated id), labels.
fn batch() -> (Vec<f32>, Vec<u32>, Vec<f32>) {
    let dense: Vec<f32> = (0..18).map(|i| ((i * 7 % 11) as f32) / 5.0 - 0.8).collect();
    let ids = vec![
        0, 1, 4, 4, 2, 3, // field a
        29, 0, 13, 13, 7, 21, // field b
        6, 5, 0, 1, 2, 6, // field c
    ];
    let labels = vec![1.0, 0.0, 1.0, 0.0, 0.0, 1.0];
    (dense, ids, labels)
}

/// The state of `model` for the batch, loaded.
fn loaded(model: &Dlrm, dense: &[f32], ids: &[u32], labels: &[f32]) -> DlrmState {
    let mut st = model.state(6);
    let mut b = CtrBatch::new(6, 3, 3);
    b.dense.copy_from_slice(dense);
    b.cats.copy_from_slice(ids);
    b.labels.copy_from_slice(labels);
    st.load(&b).unwrap();
    st
}

fn loss(model: &Dlrm) -> f64 {
    let (dense, ids, labels) = batch();
    let mut st = loaded(model, &dense, &ids, &labels);
    model.forward(&mut st, false, 0).unwrap().loss
}

fn check_gradients(kind: TableKind) {
    let mut model = Dlrm::new(&cfg(kind), 3, &names(), &SIZES, 3).unwrap();
    let (dense, ids, labels) = batch();
    let mut st = loaded(&model, &dense, &ids, &labels);
    model.zero_grad();
    model.forward(&mut st, true, 0).unwrap();
    model.backward(&mut st);
    let analytic: Vec<(String, Vec<f32>)> = model
        .params()
        .iter()
        .map(|p| (p.name.clone(), p.grad.clone()))
        .collect();
    let h = 1e-3f32;
    let mut checked = 0;
    for (pi, (name, grad)) in analytic.iter().enumerate() {
        // A few entries of every parameter, always including the largest gradient.
        let big = (0..grad.len())
            .max_by(|&a, &b| grad[a].abs().total_cmp(&grad[b].abs()))
            .unwrap();
        let mut picks = vec![big, 0, grad.len() / 2, grad.len() - 1];
        picks.dedup();
        for &k in &picks {
            let at = |delta: f32| {
                let mut m = model.clone();
                let mut i = 0;
                m.visit_params_mut(&mut |p: &mut Param| {
                    if i == pi {
                        p.value[k] += delta;
                    }
                    i += 1;
                });
                loss(&m)
            };
            let num = (at(h) - at(-h)) / (2.0 * h as f64);
            let ana = grad[k] as f64;
            assert!(
                (num - ana).abs() <= 1e-3 + 0.02 * num.abs().max(ana.abs()),
                "{name}[{k}]: finite difference {num:.6e}, backward {ana:.6e}"
            );
            checked += 1;
        }
    }
    assert!(checked > 20);
}

#[test]
fn backward_matches_finite_differences_with_dense_tables() {
    check_gradients(TableKind::Dense);
}

#[test]
fn backward_matches_finite_differences_with_ttm_tables() {
    let m = Dlrm::new(&cfg(TableKind::Auto), 3, &names(), &SIZES, 3).unwrap();
    assert!(matches!(m.tables[1], Table::Ttm(_)));
    assert!(matches!(m.tables[0], Table::Dense(_)));
    check_gradients(TableKind::Auto);
    check_gradients(TableKind::Ttm);
}

#[test]
fn a_ttm_table_behaves_like_its_dense_equivalent() {
    let ttm = Dlrm::new(&cfg(TableKind::Ttm), 3, &names(), &SIZES, 5).unwrap();
    let mut dense = ttm.clone();
    for t in &mut dense.tables {
        if let Table::Ttm(e) = t {
            let rows = e.shape().num_embeddings();
            let mut d = Embedding::new("x", rows, 4, 1.0, &mut comera_tensor::init::rng(0));
            d.table = Param::new("x", &[rows, 4], ParamKind::Other, e.dense_table());
            *t = Table::Dense(d);
        }
    }
    let (a, b) = (loss(&ttm), loss(&dense));
    assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    assert!(ttm.table_params() < ttm.dense_table_params());
}

#[test]
fn bad_ids_are_errors_naming_the_field() {
    let m = Dlrm::new(&cfg(TableKind::Auto), 3, &names(), &SIZES, 3).unwrap();
    let (dense, mut ids, labels) = batch();
    ids[7] = 30;
    let mut st = loaded(&m, &dense, &ids, &labels);
    let e = m.forward(&mut st, false, 0).unwrap_err().to_string();
    assert!(e.contains("field `b`") && e.contains("30"), "{e}");
    let mut short = CtrBatch::new(6, 3, 3);
    short.dense.truncate(3);
    let e = st.load(&short).unwrap_err().to_string();
    assert!(e.contains("dense"), "{e}");
}

#[test]
fn training_steps_are_identical_on_one_and_two_threads() {
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            let mut m = Dlrm::new(&cfg(TableKind::Auto), 3, &names(), &SIZES, 9).unwrap();
            let mut opt = comera_optim::AdamW::new(comera_optim::AdamWConfig::default(), |f| {
                m.visit_params_mut(f)
            });
            let (dense, ids, labels) = batch();
            let mut st = loaded(&m, &dense, &ids, &labels);
            let mut losses = vec![];
            for _ in 0..5 {
                m.zero_grad();
                losses.push(m.forward(&mut st, true, 0).unwrap().loss);
                m.backward(&mut st);
                opt.step(1.0, 1.0, |f| m.visit_params_mut(f));
            }
            assert!(losses[4] < losses[0], "{losses:?}");
            losses
        })
    };
    assert_eq!(run(1), run(2));
}
