//! `comera devices`: what this machine offers for `--device` — the CPU, and each NVIDIA GPU
//! with what a run on it needs (the driver, NVRTC, cuBLAS), or why there is none.

use comera_cuda::Survey;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Also open each GPU as a run does (a context, the kernels compiled for it, a cuBLAS
    /// handle): exit status 2 unless at least one GPU opened and none failed.
    #[arg(long)]
    open: bool,
    /// One JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let d = comera_train::device::devices(a.open);
    let s = &d.cuda;
    if a.json {
        println!("{}", d.to_json());
    } else {
        print!("{}", table(&d.cpu.name, d.cpu.threads, s));
    }
    let ready = s.gpus.iter().filter(|g| g.ready == Some(true)).count();
    Ok(match a.open && (ready == 0 || ready < s.gpus.len()) {
        true => ExitCode::from(2),
        false => ExitCode::SUCCESS,
    })
}

/// The survey as lines: the CPU, then each GPU (or why there is none), NVRTC and cuBLAS.
fn table(cpu: &str, threads: usize, s: &Survey) -> String {
    let mut out = format!("cpu      {cpu} ({threads} threads)\n");
    let driver = s
        .driver_cuda
        .as_deref()
        .map_or(String::new(), |v| format!(", driver CUDA {v}"));
    if let Some(p) = &s.problem {
        out += &format!("cuda     none: {p}\n");
    }
    for g in &s.gpus {
        let gib = g.memory_bytes as f64 / (1u64 << 30) as f64;
        let state = match (g.ready, &g.problem) {
            (Some(true), _) => "  ready".to_string(),
            (_, Some(p)) => format!("  cannot be used: {p}"),
            _ => String::new(),
        };
        out += &format!(
            "{:<8} {} {} {gib:.1} GiB{driver}{state}\n",
            g.device, g.name, g.arch
        );
    }
    out += &match (&s.nvrtc, &s.nvrtc_problem) {
        (Some(v), None) => format!("nvrtc    {v}\n"),
        (_, Some(p)) => format!("nvrtc    {p}\n"),
        (None, None) => String::new(),
    };
    out += match s.cublas {
        true => "cublas   libcublas.so.13 found\n",
        false => "cublas   libcublas.so.13 not found (install the CUDA 13 toolkit, or `pip install nvidia-cublas` and add its lib folder to LD_LIBRARY_PATH)\n",
    };
    out
}
