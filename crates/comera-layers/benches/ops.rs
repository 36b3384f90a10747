//! Per-operation timings of the paper's TT/TTM encoder step (SPEC §5) at batch 1 (128 tokens),
//! each layer operation timed on its own, with how often a step calls it.
//!
//! `cargo test --release -p comera-layers --bench ops -- --ignored --nocapture`
//! (`OPS_TOKENS=4096` for batch 32, `RAYON_NUM_THREADS` for the thread count).

use comera_layers::activation::Gelu;
use comera_layers::attention::Attention;
use comera_layers::norm::LayerNorm;
use comera_layers::{EmbeddingLayer, Layer, RankGates, TtLinear, TtmEmbedding};
use comera_tensor::{init, TtShape, TtmShape};
use std::time::Instant;

fn time_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn rand(rng: &mut init::Rng, len: usize) -> Vec<f32> {
    let mut v = vec![0.0f32; len];
    init::fill_normal(rng, &mut v, 1.0);
    v
}

const MB: f64 = 1024.0 * 1024.0;

fn run() {
    let t = 128;
    let n: usize = std::env::var("OPS_TOKENS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(t);
    let b = n / t;
    let (d, f, nl, heads, vocab) = (768, 3072, 6, 12, 30522);
    let reps: usize = std::env::var("OPS_REPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    let mut rng = init::rng(7);
    let rule = RankGates::new(0.01);
    let mut rows: Vec<(String, f64, usize)> = Vec::new();
    let mut ws_total = 0usize;
    for (name, shape, count) in [
        (
            "tt q/k/v/o",
            TtShape::uniform(&[12, 8, 8], &[8, 8, 12], 30).unwrap(),
            4 * nl,
        ),
        (
            "tt ffn up",
            TtShape::uniform(&[12, 8, 8], &[12, 16, 16], 30).unwrap(),
            nl,
        ),
        (
            "tt ffn down",
            TtShape::uniform(&[12, 16, 16], &[8, 8, 12], 30).unwrap(),
            nl,
        ),
    ] {
        let mut layer = TtLinear::new(name, shape, rule, &mut rng).unwrap();
        let mut ws = layer.workspace(n);
        let x = rand(&mut rng, n * layer.in_features());
        let dy = rand(&mut rng, n * layer.out_features());
        let mut y = vec![0.0; n * layer.out_features()];
        let mut dx = vec![0.0; n * layer.in_features()];
        ws_total += count * ws.bytes();
        rows.push((
            format!(
                "{name} fwd [{}; ws {:.3} MB]",
                ws.path(),
                ws.bytes() as f64 / MB
            ),
            time_ms(reps, || layer.forward(&mut ws, &x, &mut y)),
            count,
        ));
        rows.push((
            format!("{name} bwd"),
            time_ms(reps, || {
                layer.forward(&mut ws, &x, &mut y);
                layer.backward(&mut ws, &x, &dy, Some(&mut dx))
            }) - rows.last().unwrap().1,
            count,
        ));
    }
    let attn = Attention::new(d, heads);
    let mut aws = attn.workspace(b, t);
    let qkv = rand(&mut rng, 3 * n * d);
    let dout = rand(&mut rng, n * d);
    let mut out = vec![0.0; n * d];
    let mut dqkv = vec![0.0; 3 * n * d];
    let mask: Vec<u8> = (0..n).map(|i| (i % t < t - t / 10) as u8).collect();
    rows.push((
        "attention fwd".into(),
        time_ms(reps, || attn.forward(&mut aws, &qkv, Some(&mask), &mut out)),
        nl,
    ));
    rows.push((
        "attention fwd (no mask)".into(),
        time_ms(reps, || attn.forward(&mut aws, &qkv, None, &mut out)),
        0,
    ));
    rows.push((
        "attention bwd".into(),
        time_ms(reps, || attn.backward(&mut aws, &qkv, &dout, &mut dqkv)),
        nl,
    ));
    let mut ln = LayerNorm::new("ln", d);
    let mut lws = ln.workspace(n);
    let x = rand(&mut rng, n * d);
    let mut y = vec![0.0; n * d];
    rows.push((
        "layernorm fwd".into(),
        time_ms(reps, || ln.forward(&mut lws, &x, &mut y)),
        2 * nl + 1,
    ));
    rows.push((
        "layernorm bwd".into(),
        time_ms(reps, || ln.backward(&mut lws, &x, &dout, Some(&mut y))),
        2 * nl + 1,
    ));
    let h = rand(&mut rng, n * f);
    let mut g = vec![0.0; n * f];
    rows.push((
        "gelu fwd".into(),
        time_ms(reps, || Gelu.forward(&h, &mut g)),
        nl,
    ));
    rows.push((
        "gelu bwd".into(),
        time_ms(reps, || Gelu.backward_in_place(&h, &mut g)),
        nl,
    ));
    let shape = TtmShape::uniform(&[16, 20, 10, 10], &[4, 4, 8, 6], 32, vocab).unwrap();
    let mut emb = TtmEmbedding::new("word", shape, rule, 1.0, &mut rng).unwrap();
    let mut ews = emb.workspace(n);
    let ids: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % vocab as u32).collect();
    let mut ey = vec![0.0; n * d];
    let dey = rand(&mut rng, n * d);
    ws_total += ews.bytes();
    rows.push((
        format!("ttm fwd [ws {:.3} MB]", ews.bytes() as f64 / MB),
        time_ms(reps, || emb.forward(&mut ews, &ids, &mut ey).unwrap()),
        1,
    ));
    rows.push((
        "ttm bwd".into(),
        time_ms(reps, || emb.backward(&mut ews, &ids, &dey)),
        1,
    ));
    println!(
        "\nper-operation medians, {n} tokens, {} threads; TT+TTM workspaces {:.2} MB",
        rayon::current_num_threads(),
        ws_total as f64 / MB
    );
    println!(
        "{:<44} {:>10} {:>6} {:>10}",
        "op", "ms/call", "calls", "ms/step"
    );
    let mut total = 0.0;
    for (name, ms, count) in &rows {
        total += ms * *count as f64;
        println!(
            "{name:<44} {ms:>10.3} {count:>6} {:>10.2}",
            ms * *count as f64
        );
    }
    println!("{:<44} {:>10} {:>6} {total:>10.2}", "sum", "", "");
}

#[test]
#[ignore = "benchmark: run with --ignored --nocapture"]
fn ops() {
    // On a pool worker, as training runs.
    rayon::scope(|_| run());
}
