//! `comera bench ttm`: TTM lookups (optimised, naive, and the per-batch choice between them
//! that layers use by default) vs a dense gather, forward+backward.

use crate::harness::{interleaved_medians, normal_vec, TextTable};
use comera_layers::{Embedding, EmbeddingLayer, Lookup, RankGates, TtmEmbedding};
use comera_tensor::{init, TtmShape};
use rand_distr::{Distribution, Uniform, Zipf};
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct TtmArgs {
    /// Which tables: bert (30522×768, 4096 Zipf ids), dlrm (11,000,000×64 at 10k and 40k ids,
    /// Zipf and uniform).
    #[arg(long, value_delimiter = ',', default_values_t = vec!["bert".to_string(), "dlrm".into()])]
    tables: Vec<String>,
    /// TT rank of every inner bond.
    #[arg(long, default_value_t = 32)]
    rank: usize,
    /// Also time the dense gather (the 11M×64 dense table needs 5.6 GB with its gradient).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    dense: bool,
    /// Seconds per cell.
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// One JSON object a line per measurement.
    #[arg(long)]
    json: bool,
}

/// Ids drawn from Zipf(s) over ranks, mapped to table rows by a fixed bijection
/// (rank·a mod V with gcd(a, V) = 1) so that frequent ids are spread over the table, or
/// uniform when `zipf` is `None`.
fn draw_ids(rows: usize, n: usize, zipf: Option<f64>, seed: u64) -> Vec<u32> {
    let mut rng = init::rng(seed);
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    let mut a = 2_654_435_761u64 % rows as u64;
    while gcd(a, rows as u64) != 1 {
        a += 1;
    }
    match zipf {
        Some(s) => {
            let z = Zipf::new(rows as f64, s).expect("valid Zipf parameters");
            (0..n)
                .map(|_| (((z.sample(&mut rng) as u64 - 1) * a) % rows as u64) as u32)
                .collect()
        }
        None => {
            let u = Uniform::new(0, rows as u32).expect("non-empty range");
            (0..n).map(|_| u.sample(&mut rng)).collect()
        }
    }
}

struct Case {
    table: &'static str,
    shape: TtmShape,
    tokens: usize,
    dist: Option<f64>,
}

/// Column widths of the text table.
const TABLE: TextTable = TextTable(&[17, 6, 8, 7, 11, 11, 11, 10, 10, 11, 9, 11, 11, 11]);

pub fn run(a: TtmArgs) -> anyhow::Result<ExitCode> {
    let mut cases = Vec::new();
    for t in &a.tables {
        match t.as_str() {
            "bert" => cases.push(Case {
                table: "bert-30522x768",
                shape: TtmShape::uniform(&[16, 20, 10, 10], &[4, 4, 8, 6], a.rank, 30522)?,
                tokens: 4096,
                dist: Some(1.1),
            }),
            "dlrm" => {
                for tokens in [10_000, 40_000] {
                    for dist in [Some(1.1), None] {
                        cases.push(Case {
                            table: "dlrm-11000000x64",
                            shape: TtmShape::uniform(
                                &[200, 220, 250],
                                &[4, 4, 4],
                                a.rank,
                                11_000_000,
                            )?,
                            tokens,
                            dist,
                        });
                    }
                }
            }
            other => anyhow::bail!("--tables: unknown table `{other}` (expected bert or dlrm)"),
        }
    }
    if !a.json {
        println!("forward+backward µs per looked-up id (median); extra memory = lookup workspace; rank {}", a.rank);
        println!(
            "{}",
            TABLE.line(&[
                "table",
                "ids",
                "dist",
                "unique",
                "optimized",
                "naive",
                "auto",
                "picked",
                "auto/best",
                "dense",
                "naive/opt",
                "opt MB",
                "naive MB",
                "auto MB",
            ])
        );
    }
    let mut dense_cache: Option<(usize, usize, Embedding)> = None;
    for c in &cases {
        let mut rng = init::rng(3);
        let ttm = TtmEmbedding::new(
            c.table,
            c.shape.clone(),
            RankGates::default(),
            1.0,
            &mut rng,
        )?;
        let ids = draw_ids(c.shape.num_embeddings(), c.tokens, c.dist, 7);
        let mut uniq = ids.clone();
        uniq.sort_unstable();
        uniq.dedup();
        let d = c.shape.dim();
        let dy = normal_vec(&mut rng, c.tokens * d);
        let (mut t_opt, mut t_naive, mut t_auto) = (ttm.clone(), ttm.clone(), ttm.clone());
        let mut ws_opt = t_opt.workspace_with(c.tokens, Lookup::Optimized);
        let mut ws_naive = t_naive.workspace_with(c.tokens, Lookup::Naive);
        let mut ws_auto = t_auto.workspace_with(c.tokens, Lookup::Auto);
        let (opt_bytes, naive_bytes, auto_bytes, split) = (
            ws_opt.bytes(),
            ws_naive.bytes(),
            ws_auto.bytes(),
            ws_opt.split(),
        );
        let (mut y1, mut y2, mut y3, mut y4) = (
            vec![0.0; c.tokens * d],
            vec![0.0; c.tokens * d],
            vec![0.0; c.tokens * d],
            vec![0.0; c.tokens * d],
        );
        let key = (c.shape.num_embeddings(), d);
        if a.dense && dense_cache.as_ref().map(|(v, dd, _)| (*v, *dd)) != Some(key) {
            drop(dense_cache.take()); // free the previous table before making the next
            dense_cache = Some((
                key.0,
                key.1,
                Embedding::new("dense", key.0, key.1, 1.0, &mut rng),
            ));
        }
        let mut variants: Vec<Box<dyn FnMut() + '_>> = vec![
            Box::new(|| {
                t_opt
                    .forward(&mut ws_opt, &ids, &mut y1)
                    .expect("valid ids");
                t_opt.backward(&mut ws_opt, &ids, &dy);
            }),
            Box::new(|| {
                t_naive
                    .forward(&mut ws_naive, &ids, &mut y2)
                    .expect("valid ids");
                t_naive.backward(&mut ws_naive, &ids, &dy);
            }),
            Box::new(|| {
                t_auto
                    .forward(&mut ws_auto, &ids, &mut y4)
                    .expect("valid ids");
                t_auto.backward(&mut ws_auto, &ids, &dy);
            }),
        ];
        if a.dense {
            let dense = &mut dense_cache.as_mut().expect("made above").2;
            let mut ws = dense.workspace(c.tokens);
            let (ids, dy, y3) = (&ids, &dy, &mut y3);
            variants.push(Box::new(move || {
                dense.forward(&mut ws, ids, y3).expect("valid ids");
                dense.backward(&mut ws, ids, dy);
            }));
        }
        let med = interleaved_medians(&mut variants, a.seconds, 1);
        drop(variants);
        let picked = ws_auto.chosen().name();
        let auto_vs_best = med[2] / med[0].min(med[1]);
        let per_id = |ms: f64| ms * 1e3 / c.tokens as f64;
        let dist = c
            .dist
            .map(|s| format!("zipf{s}"))
            .unwrap_or_else(|| "uniform".into());
        if a.json {
            let mut rows = vec![
                serde_json::json!({"table": c.table, "tokens": c.tokens, "dist": dist, "unique": uniq.len(), "lookup": "optimized", "split": split, "median_ms": med[0], "us_per_id": per_id(med[0]), "extra_bytes": opt_bytes}),
                serde_json::json!({"table": c.table, "tokens": c.tokens, "dist": dist, "unique": uniq.len(), "lookup": "naive", "median_ms": med[1], "us_per_id": per_id(med[1]), "extra_bytes": naive_bytes}),
                serde_json::json!({"table": c.table, "tokens": c.tokens, "dist": dist, "unique": uniq.len(), "lookup": "auto", "picked": picked, "vs_best": auto_vs_best, "median_ms": med[2], "us_per_id": per_id(med[2]), "extra_bytes": auto_bytes}),
            ];
            if a.dense {
                rows.push(serde_json::json!({"table": c.table, "tokens": c.tokens, "dist": dist, "unique": uniq.len(), "lookup": "dense", "median_ms": med[3], "us_per_id": per_id(med[3]), "extra_bytes": 0}));
            }
            for r in rows {
                println!("{r}");
            }
        } else {
            let dense = if a.dense {
                format!("{:.3}", per_id(med[3]))
            } else {
                "-".into()
            };
            let row = [
                c.table.to_string(),
                c.tokens.to_string(),
                dist,
                uniq.len().to_string(),
                format!("{:.3}", per_id(med[0])),
                format!("{:.3}", per_id(med[1])),
                format!("{:.3}", per_id(med[2])),
                picked.to_string(),
                format!("{auto_vs_best:.2}"),
                dense,
                format!("{:.2}", med[1] / med[0]),
                format!("{:.1}", opt_bytes as f64 / 1e6),
                format!("{:.1}", naive_bytes as f64 / 1e6),
                format!("{:.1}", auto_bytes as f64 / 1e6),
            ];
            println!("{}", TABLE.line(&row));
        }
    }
    Ok(ExitCode::SUCCESS)
}
