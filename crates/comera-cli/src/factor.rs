//! `comera factor N M`: balanced mode lists and a rank for a parameter budget.

use comera_tensor::factor::{
    balanced_factorisations, is_balanced, padded_balanced, rank_for_budget, uniform_core_params,
};
use std::process::ExitCode;

/// The widest layer side `factor` takes (2^32): far beyond any trainable layer, and small
/// enough that factorising (√N trial divisions) stays instant.
const MAX_WIDTH: usize = 1 << 32;

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
    for (name, w) in [("N", a.n), ("M", a.m)] {
        anyhow::ensure!(
            w <= MAX_WIDTH,
            "{name} = {w} is beyond {MAX_WIDTH} (2^32): no layer is that wide"
        );
    }
    anyhow::ensure!((1..=16).contains(&a.factors), "--factors must be in 1..=16");
    let dense = a.n as u128 * a.m as u128;
    let budget = a
        .budget
        .unwrap_or_else(|| usize::try_from(dense / 20).unwrap_or(usize::MAX));
    let ins = balanced_factorisations(a.n, a.factors, a.top);
    let outs = balanced_factorisations(a.m, a.factors, a.top);
    println!(
        "dense {}x{}: {dense} parameters; core budget {budget}",
        a.n, a.m
    );
    for (side, w, best, what) in [
        ("N", a.n, &ins, "input: the extra features are zeros"),
        ("M", a.m, &outs, "output: the extra columns are dropped"),
    ] {
        if a.factors > 1 && best.first().is_some_and(|f| !is_balanced(f)) {
            match padded_balanced(w, a.factors) {
                Some((p, f)) => println!(
                    "{side} = {w} has no balanced {}-factor layout (best {:?}); pad the {what}: {p} = {f:?} ({} more)",
                    a.factors,
                    best[0],
                    p - w
                ),
                None => println!(
                    "{side} = {w} has no balanced {}-factor layout (best {:?})",
                    a.factors, best[0]
                ),
            }
        }
    }
    for i in &ins {
        for o in &outs {
            let mut o = o.clone();
            o.reverse(); // output modes smallest first mirrors the input side (12·8·8 → 8·8·12)
            match rank_for_budget(i, &o, budget)? {
                Some(r) => {
                    let modes: Vec<usize> = i.iter().chain(&o).copied().collect();
                    let params = uniform_core_params(&modes, r);
                    println!(
                        "in {i:?} out {o:?} rank {r}: {params} core parameters ({:.1}x compression)",
                        dense as f64 / params as f64
                    );
                }
                None => println!("in {i:?} out {o:?}: even rank 1 exceeds the budget"),
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
