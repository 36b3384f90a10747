//! The device step benchmark ([`comera_cuda::bench`]) as a program of its own, for
//! `tools/gpu/check.sh` (which runs prebuilt binaries on a GPU machine): prints a line per
//! model and batch, then one JSON object per line (also written to `--json PATH`).
//!
//! ```text
//! cargo run --release -p comera-cuda --example step_bench -- [--batches 1,32] [--replays 50]
//!     [--eager 5] [--no-dense] [--ops] [--json PATH]
//! ```
//!
//! The same benchmark is `comera bench step --device cuda`.

use comera_cuda::bench::{step_bench, StepBenchArgs, StepBenchRow};

/// The arguments, or a message saying which one is wrong.
fn args() -> Result<(StepBenchArgs, Option<String>), String> {
    let mut a = StepBenchArgs::default();
    let mut json = None;
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || it.next().ok_or(format!("{k} needs a value"));
        let num = |v: &str| v.parse::<usize>().map_err(|e| format!("{k} {v}: {e}"));
        match k.as_str() {
            "--batches" => a.batches = val()?.split(',').map(num).collect::<Result<_, _>>()?,
            "--replays" => a.replays = num(&val()?)?,
            "--eager" => a.eager = num(&val()?)?,
            "--no-dense" => a.dense = false,
            "--ops" => a.ops = true,
            "--json" => json = Some(val()?),
            other => {
                return Err(format!(
                    "unknown argument {other} (see the example's doc comment)"
                ))
            }
        }
    }
    Ok((a, json))
}

fn print(r: &StepBenchRow) {
    println!(
        "{:>5} b{:<3} graph {:8.3} ms (min {:.3}, max {:.3})  eager {:8.3} ms  host load {:6.2} ms  memory {:7.1} MiB over the context ({:.1} MiB of buffers)  loss {:.4}\n          phases: forward {:.3} ms, loss {:.3}, backward {:.3}, update {:.3}",
        r.model,
        r.batch,
        r.graph_ms_median,
        r.graph_ms_min,
        r.graph_ms_max,
        r.eager_ms_median,
        r.host_load_ms,
        r.device_mib_over_context,
        r.device_mib_buffers,
        r.loss,
        r.phase_ms.forward,
        r.phase_ms.loss,
        r.phase_ms.backward,
        r.phase_ms.update
    );
    if let Some(ops) = &r.ops {
        print!("{}", ops.table("          "));
    }
}

fn main() -> std::process::ExitCode {
    let (a, json) = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let rows = match step_bench(&a, print) {
        Ok(rows) => rows,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    if let Some(r) = rows.first() {
        println!("{} ({}), driver CUDA {}", r.gpu, r.arch, r.driver_cuda);
    }
    let lines: Vec<String> = rows
        .iter()
        .map(|r| serde_json::to_string(r).unwrap_or_default())
        .collect();
    for l in &lines {
        println!("{l}");
    }
    if let Some(path) = json {
        if let Err(e) = std::fs::write(&path, lines.join("\n") + "\n") {
            eprintln!("error: {path}: {e}");
            return std::process::ExitCode::from(1);
        }
    }
    std::process::ExitCode::SUCCESS
}
