//! `comera plot RUN…`: the loss curves of several runs in one figure (training and held-out
//! loss over tokens or steps), e.g. dense vs CoMERA pre-training on the same data.

use comera_train::plot::{plot_panels, Panel, Series};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Run directories (each with a metrics.jsonl).
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// Names in the legend (default: the directories' names).
    #[arg(long, value_delimiter = ',')]
    names: Vec<String>,
    /// The x axis: `tokens` (sequence positions trained on) or `step`.
    #[arg(long, default_value = "tokens")]
    x: String,
    /// Output PNG (new; never inside a run directory).
    #[arg(long, default_value = "runs.png")]
    out: PathBuf,
    /// Replace --out FILE if it is a figure comera drew.
    #[arg(long)]
    overwrite: bool,
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    if a.x != "tokens" && a.x != "step" {
        anyhow::bail!("--x: `{}` is not `tokens` or `step`", a.x);
    }
    if !a.names.is_empty() && a.names.len() != a.runs.len() {
        anyhow::bail!("--names: {} names for {} runs", a.names.len(), a.runs.len());
    }
    comera_train::outputs::check_output_file(
        &a.out,
        "--out",
        a.overwrite,
        comera_train::plot::is_comera_png,
    )?;
    let (mut train, mut valid) = (Vec::new(), Vec::new());
    for (i, run) in a.runs.iter().enumerate() {
        let path = run.join("metrics.jsonl");
        let text = comera_data::read_regular_to_string(&path)
            .map_err(|e| anyhow::anyhow!("{}: cannot read: {e}", path.display()))?;
        let name = a.names.get(i).cloned().unwrap_or_else(|| {
            run.file_name().map_or(run.display().to_string(), |n| {
                n.to_string_lossy().into_owned()
            })
        });
        let (mut t, mut v) = (Vec::new(), Vec::new());
        for (n, line) in text.lines().enumerate() {
            let r: serde_json::Value = serde_json::from_str(line).map_err(|e| {
                anyhow::anyhow!("{}:{}: not a JSON record: {e}", path.display(), n + 1)
            })?;
            let num = |k: &str| r.get(k).and_then(serde_json::Value::as_f64);
            let Some(x) = num(&a.x) else { continue };
            match r.get("kind").and_then(serde_json::Value::as_str) {
                Some("train") => t.extend(num("loss").map(|l| (x, l))),
                Some("eval") => v.extend(num("valid_loss").map(|l| (x, l))),
                _ => {}
            }
        }
        train.push(Series {
            name: name.clone(),
            points: t,
        });
        valid.push(Series { name, points: v });
    }
    if train.iter().chain(&valid).all(|s| s.points.is_empty()) {
        anyhow::bail!(
            "no training or evaluation record has a `{}` field: nothing to plot (try --x step)",
            a.x
        );
    }
    let panel = |title: &str, series| Panel {
        title: title.into(),
        x_label: a.x.clone(),
        y_label: "loss".into(),
        series,
        log_y: false,
        ..Default::default()
    };
    plot_panels(
        &a.out,
        &[panel("training loss", train), panel("held-out loss", valid)],
        1100,
        420,
    )?;
    println!("wrote {}", a.out.display());
    Ok(ExitCode::SUCCESS)
}
