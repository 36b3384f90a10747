//! `comera verify FILE...`

use comera_refcase::{verify, RefCase};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Reference-case files (safetensors).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Print only failures and the summary.
    #[arg(long)]
    quiet: bool,
}

pub fn run(args: Args) -> anyhow::Result<ExitCode> {
    let (mut ok, mut bad) = (0usize, 0usize);
    for file in &args.files {
        let reports = RefCase::load(file).and_then(|case| verify(&case));
        match reports {
            Err(e) => {
                println!("FAIL {e}");
                bad += 1;
            }
            Ok(reports) => {
                let all = reports.iter().all(|r| r.passed());
                println!("{} {}", if all { "ok  " } else { "FAIL" }, file.display());
                for r in &reports {
                    for c in &r.checks {
                        if !args.quiet || !c.passed() {
                            println!(
                                "  {:<22} {:<28} error {:.2e} (tolerance {:.0e}) {}",
                                r.label,
                                c.name,
                                c.error,
                                c.tolerance,
                                if c.passed() { "ok" } else { "FAIL" }
                            );
                        }
                    }
                }
                if all {
                    ok += 1;
                } else {
                    bad += 1;
                }
            }
        }
    }
    println!("{ok} passed, {bad} failed");
    Ok(if bad == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
