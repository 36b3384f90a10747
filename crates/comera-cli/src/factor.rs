//! `comera factor N M`: balanced mode lists and a rank for a parameter budget.

use comera_tensor::factor::{balanced_factorisations, rank_for_budget};
use comera_tensor::TtShape;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Input width N.
    n: usize,
    /// Output width M.
    m: usize,
    /// Number of factors per side (p = q).
    #[arg(long, default_value_t = 3)]
    factors: usize,
    /// Parameter budget for the cores (default: 1/20 of the dense N·M).
    #[arg(long)]
    budget: Option<usize>,
    /// How many proposals per side.
    #[arg(long, default_value_t = 3)]
    top: usize,
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(a.n > 0 && a.m > 0, "N and M must be positive");
    anyhow::ensure!(a.factors > 0, "--factors must be at least 1");
    let budget = a.budget.unwrap_or(a.n * a.m / 20);
    let ins = balanced_factorisations(a.n, a.factors, a.top);
    let outs = balanced_factorisations(a.m, a.factors, a.top);
    println!(
        "dense {}x{}: {} parameters; core budget {budget}",
        a.n,
        a.m,
        a.n * a.m
    );
    for i in &ins {
        for o in &outs {
            let mut o = o.clone();
            o.reverse(); // output modes smallest first mirrors the input side (12·8·8 → 8·8·12)
            match rank_for_budget(i, &o, budget)? {
                Some(r) => {
                    let s = TtShape::uniform(i, &o, r)?;
                    println!(
                        "in {i:?} out {o:?} rank {r}: {} core parameters ({:.1}x compression)",
                        s.core_params(),
                        (a.n * a.m) as f64 / s.core_params() as f64
                    );
                }
                None => println!("in {i:?} out {o:?}: even rank 1 exceeds the budget"),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
