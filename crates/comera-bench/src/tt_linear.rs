//! `comera bench tt-linear`: forward+backward of the paper's TT linear layers on every
//! contraction path, the planner's pick and the dense layer, interleaved in one run.

use crate::harness::{interleaved_medians, normal_vec, TextTable};
use comera_layers::{Layer, Linear, RankGates, TtLinear};
use comera_plan::TtPath;
use comera_tensor::{init, TtShape};
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct TtLinearArgs {
    /// Token counts (batch × sequence) to measure.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 32, 128, 1024, 4096])]
    tokens: Vec<usize>,
    /// TT rank of every inner bond.
    #[arg(long, default_value_t = 30)]
    rank: usize,
    /// Layers to measure (768x768, 768x3072, 3072x768).
    #[arg(long, value_delimiter = ',', default_values_t = vec!["768x768".to_string(), "768x3072".into(), "3072x768".into()])]
    layers: Vec<String>,
    /// Seconds to spend per (layer, tokens) cell (at least 7 rounds are always taken).
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    /// One JSON object a line per measurement instead of the table.
    #[arg(long)]
    json: bool,
}

/// The paper's modes (SPEC §5) for a layer name.
fn paper_modes(layer: &str) -> anyhow::Result<(Vec<usize>, Vec<usize>)> {
    Ok(match layer {
        "768x768" => (vec![12, 8, 8], vec![8, 8, 12]),
        "768x3072" => (vec![12, 8, 8], vec![16, 16, 12]),
        "3072x768" => (vec![12, 16, 16], vec![8, 8, 12]),
        other => anyhow::bail!(
            "--layers: unknown layer `{other}` (expected 768x768, 768x3072 or 3072x768)"
        ),
    })
}

/// One forward+backward (with dX) of `layer` in `ws` on fixed N(0, 1) inputs drawn from `seed`.
fn fwd_bwd<'a, L: Layer>(
    layer: &'a mut L,
    mut ws: L::Workspace,
    tokens: usize,
    seed: u64,
) -> Box<dyn FnMut() + 'a>
where
    L::Workspace: 'a,
{
    let (n, m) = (layer.in_features(), layer.out_features());
    let mut rng = init::rng(seed);
    let x = normal_vec(&mut rng, tokens * n);
    let dy = normal_vec(&mut rng, tokens * m);
    let mut y = vec![0.0; tokens * m];
    let mut dx = vec![0.0; tokens * n];
    Box::new(move || {
        layer.forward(&mut ws, &x, &mut y);
        layer.backward(&mut ws, &x, &dy, Some(&mut dx));
    })
}

/// Column widths of the text table.
const TABLE: TextTable = TextTable(&[9, 6, 10, 10, 10, 10, 11, 8, 9]);

pub fn run(a: TtLinearArgs) -> anyhow::Result<ExitCode> {
    // On a pool worker with the others polling for work, as through a training step.
    rayon::scope(|_| comera_optim::with_workers_awake(|| measure(a)))
}

fn measure(a: TtLinearArgs) -> anyhow::Result<ExitCode> {
    let threads = rayon::current_num_threads();
    if !a.json {
        println!(
            "forward+backward (with dX) median ms per call; rank {}; {threads} threads",
            a.rank
        );
        println!(
            "{}",
            TABLE.line(&[
                "layer",
                "tokens",
                "merged",
                "sequential",
                "tt-dense",
                "Linear",
                "pick",
                "pick/best",
                "Linear/TT",
            ])
        );
    }
    for name in &a.layers {
        let (im, om) = paper_modes(name)?;
        let shape = TtShape::uniform(&im, &om, a.rank)?;
        let mut rng = init::rng(0);
        let tt = TtLinear::new(name, shape.clone(), RankGates::default(), &mut rng)?;
        let dense = Linear::new(name, shape.in_features(), shape.out_features(), &mut rng);
        for &tokens in &a.tokens {
            let mut layers: Vec<TtLinear> = (0..4).map(|_| tt.clone()).collect();
            let mut dense = dense.clone();
            let dense_ws = dense.workspace(tokens);
            let mut variants: Vec<Box<dyn FnMut() + '_>> = Vec::new();
            let mut pick = TtPath::Merged;
            let mut est = Vec::new();
            for (i, l) in layers.iter_mut().enumerate() {
                // Each forced path, then (None) the planner's pick.
                let path = TtPath::ALL.get(i).copied();
                let mut ws = l.workspace(tokens);
                if path.is_some() {
                    ws.force_path(path);
                } else {
                    est = ws.plan().costs.clone();
                    pick = ws.path();
                }
                variants.push(fwd_bwd(l, ws, tokens, 1));
            }
            variants.push(fwd_bwd(&mut dense, dense_ws, tokens, 2));
            let med = interleaved_medians(&mut variants, a.seconds, 1);
            drop(variants);
            let (paths, planner, linear) = (&med[..3], med[3], med[4]);
            let best = paths.iter().copied().fold(f64::INFINITY, f64::min);
            if a.json {
                for (i, p) in TtPath::ALL.iter().enumerate() {
                    let e = est
                        .iter()
                        .find(|c| c.path == *p)
                        .map(|c| c.est_ms)
                        .unwrap_or(f64::NAN);
                    let rec = serde_json::json!({"layer": name, "tokens": tokens, "path": p.name(), "median_ms": paths[i], "est_ms": e, "threads": threads});
                    println!("{rec}");
                }
                println!(
                    "{}",
                    serde_json::json!({"layer": name, "tokens": tokens, "path": "linear", "median_ms": linear, "threads": threads})
                );
                println!(
                    "{}",
                    serde_json::json!({"layer": name, "tokens": tokens, "path": "planner", "pick": pick.name(), "median_ms": planner, "best_ms": best, "threads": threads})
                );
            } else {
                let pick_ms = paths[TtPath::ALL.iter().position(|p| *p == pick).unwrap()];
                let row = [
                    name.clone(),
                    tokens.to_string(),
                    format!("{:.4}", paths[0]),
                    format!("{:.4}", paths[1]),
                    format!("{:.4}", paths[2]),
                    format!("{linear:.4}"),
                    pick.name().to_string(),
                    format!("{:.2}", pick_ms / best),
                    format!("{:.2}", linear / best),
                ];
                println!("{}", TABLE.line(&row));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
