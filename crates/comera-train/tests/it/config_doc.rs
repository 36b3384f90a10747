//! `configs/reviews-small.toml` is the documentation of the run config: it must parse to
//! exactly the built-in default of `comera train` (so its values are the real defaults) and it
//! must mention every field a run config has (so no field goes undocumented).

use comera_optim::galore::GaLoreConfig;
use comera_train::config::{EarlyStopping, Phase, RunConfig, StopMetric, StopMode};
use std::path::{Path, PathBuf};

fn documented() -> (PathBuf, String) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/reviews-small.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    (path, text)
}

#[test]
fn the_documented_config_is_the_builtin_default() {
    let (path, text) = documented();
    let parsed = RunConfig::from_toml(&path, &text).unwrap();
    let builtin = RunConfig::builtin();
    // Table by table first, for a readable failure.
    assert_eq!(parsed.data, builtin.data, "[data]");
    assert_eq!(parsed.model, builtin.model, "[model]");
    assert_eq!(parsed.optim, builtin.optim, "[optim]");
    assert_eq!(parsed.train, builtin.train, "[train]");
    assert_eq!(parsed.rank, builtin.rank, "[rank]");
    assert_eq!(parsed, builtin);
}

/// Lines of the documented file by section: the section a line is in is the last header
/// (`[x]` or `[[x]]`, commented out or not) above it.
fn sections(text: &str) -> Vec<(String, String)> {
    let mut section = String::new();
    let mut out = Vec::new();
    for line in text.lines() {
        let l = line.trim_start_matches('#').trim();
        // A header: `[a.b]` or `[[a.b]]`, perhaps with a trailing comment.
        let name = l.trim_start_matches('[');
        let end = name.find(']').unwrap_or(0);
        let rest = name[end..].trim_start_matches(']').trim();
        let is_name = |c: char| c.is_ascii_lowercase() || c == '_' || c == '.';
        if l.starts_with('[')
            && end > 0
            && name[..end].chars().all(is_name)
            && (rest.is_empty() || rest.starts_with('#'))
        {
            section = name[..end].to_string();
            continue;
        }
        out.push((section.clone(), l.to_string()));
    }
    out
}

/// Every (section, key) of a JSON object, nested objects as dotted sections.
fn keys(v: &serde_json::Value, section: &str, out: &mut Vec<(String, String)>) {
    let serde_json::Value::Object(map) = v else {
        return;
    };
    for (k, v) in map {
        match v {
            serde_json::Value::Object(_) => {
                let s = if section.is_empty() {
                    k.clone()
                } else {
                    format!("{section}.{k}")
                };
                keys(v, &s, out);
            }
            // A table array (train.phases): its entries' keys under its own header.
            serde_json::Value::Array(a) if a.iter().all(|e| e.is_object()) && !a.is_empty() => {
                for e in a {
                    keys(e, &format!("{section}.{k}"), out);
                }
            }
            _ => out.push((section.to_string(), k.clone())),
        }
    }
}

#[test]
fn the_documented_config_mentions_every_field() {
    let (_, text) = documented();
    let lines = sections(&text);
    // The built-in default with every optional part present, so their keys are listed too.
    let mut full = RunConfig::builtin();
    full.galore = Some(GaLoreConfig::default());
    let mut distill = comera_train::config::DistillConfig::with_teacher("runs/t".into());
    distill.teacher_sha256 = Some("0".repeat(64));
    full.distill = Some(distill);
    full.train.init_from = Some("runs/x".into());
    full.model.attn_tt.tt = Some(true);
    full.model.ffn_up_tt.tt = Some(false);
    full.model.ffn_down_tt.tt = Some(true);
    let pooler = comera_model::LayerTt {
        tt: Some(true),
        ..comera_model::LayerTt::uniform(&[8, 4, 4], &[4, 4, 8], 8)
    };
    full.model.pooler_tt = Some(pooler.clone());
    full.model.classifier_tt = Some(pooler);
    full.train.accumulate_steps = 2;
    full.train.early_stopping = Some(EarlyStopping {
        patience: 3,
        metric: StopMetric::ValidLoss,
        mode: Some(StopMode::Min),
        min_delta: 0.0,
    });
    full.train.phases = vec![Phase {
        seq_len: 32,
        batch_size: 8,
        epochs: 1,
        max_steps_per_epoch: Some(0),
    }];
    let mut all = Vec::new();
    keys(&serde_json::to_value(&full).unwrap(), "", &mut all);
    assert!(all.len() > 60, "{} fields", all.len());
    let missing: Vec<String> = all
        .iter()
        .filter(|(section, key)| {
            !lines.iter().any(|(s, l)| {
                s == section
                    && l.strip_prefix(key.as_str())
                        .is_some_and(|rest| rest.trim_start().starts_with('='))
            })
        })
        .map(|(s, k)| format!("[{s}] {k}"))
        .collect();
    assert!(
        missing.is_empty(),
        "configs/reviews-small.toml does not document: {missing:?}"
    );
}

/// Saved configs carry the decimals people wrote (`dropout = 0.1`, not the f32 widened to
/// `0.10000000149011612`) and read back as the same config.
#[test]
fn configs_are_written_with_the_shortest_decimals_that_read_back() {
    let cfg = RunConfig::builtin();
    let text = cfg.to_toml();
    for line in ["dropout = 0.1\n", "lr_cores = 0.001\n", "beta2 = 0.999\n"] {
        assert!(text.contains(line), "no `{}` in\n{text}", line.trim());
    }
    // An f32 needs at most 9 significant digits; its widening to f64 shows 16-17.
    for line in text.lines() {
        let Some((_, value)) = line.split_once(" = ") else {
            continue;
        };
        if value.parse::<f64>().is_err() || !value.contains('.') {
            continue;
        }
        let mantissa = value.split(['e', 'E']).next().unwrap();
        let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
        let significant = digits.trim_start_matches('0').trim_end_matches('0');
        assert!(significant.len() <= 9, "f32 noise: {line}");
    }
    let back = RunConfig::from_toml(Path::new("<saved>"), &text).unwrap();
    assert_eq!(back, cfg);
}

/// The header of the documented file lists every field whose default in a user's file (its
/// table's default) differs from the built-in run's value, so a reader knows what to copy.
#[test]
fn the_documented_config_names_the_defaults_that_differ() {
    let (path, text) = documented();
    let header: String = text
        .lines()
        .take_while(|l| !l.starts_with('['))
        .collect::<Vec<_>>()
        .join(" ");
    let empty = RunConfig::from_toml(&path, "").unwrap();
    let mut a = Vec::new();
    keys(
        &serde_json::to_value(RunConfig::builtin()).unwrap(),
        "",
        &mut a,
    );
    let value = |v: &serde_json::Value, s: &str, k: &str| -> serde_json::Value {
        s.split('.')
            .fold(v, |v, part| &v[part])
            .get(k)
            .cloned()
            .unwrap_or_default()
    };
    let builtin = serde_json::to_value(RunConfig::builtin()).unwrap();
    let default = serde_json::to_value(&empty).unwrap();
    let mut differ = Vec::new();
    for (s, k) in &a {
        if value(&builtin, s, k) != value(&default, s, k) {
            differ.push(format!("{s}.{k}"));
        }
    }
    assert!(!differ.is_empty());
    for d in &differ {
        let named = if d.starts_with("model.") {
            header.contains("[model]")
        } else {
            header.contains(d.as_str())
        };
        assert!(
            named,
            "`{d}` differs from its table's default but the header does not say so"
        );
    }
}

/// Per-layer choices read from TOML: a kind's `tt`, per-bond rank lists, TT pooler and
/// classifier tables; bad ranks are refused naming the field and what was expected.
#[test]
fn per_layer_choices_parse_and_bad_ranks_name_the_field() {
    let (path, text) = documented();
    let with = |extra: &str, table: &str| {
        // Appended keys land in the last table of the file; put them under their own header.
        format!("{text}\n[{table}]\n{extra}\n")
    };
    let mixed = text.replace(
        "[model.attn_tt]      # Q, K, V and output projections: d_model -> d_model\nin_modes = [8, 4, 4]\nout_modes = [4, 4, 8]\nrank = 16\n",
        "[model.attn_tt]\nin_modes = [8, 4, 4]\nout_modes = [4, 4, 8]\nrank = [8, 16, 16, 16, 8]\ntt = false\n",
    );
    assert_ne!(mixed, text, "the documented attention table moved");
    let cfg = RunConfig::from_toml(&path, &mixed).unwrap();
    assert_eq!(
        cfg.model.attn_tt.rank,
        comera_model::Rank::PerBond(vec![8, 16, 16, 16, 8])
    );
    let lay = cfg.model.validate().unwrap();
    assert!(lay.attn.is_none() && lay.ffn_up.is_some());
    // Saved and read back alike.
    let back = RunConfig::from_toml(Path::new("<saved>"), &cfg.to_toml()).unwrap();
    assert_eq!(back, cfg);
    let pooler = with(
        "in_modes = [8, 4, 4]\nout_modes = [4, 4, 8]\nrank = 4",
        "model.pooler_tt",
    );
    let cfg = RunConfig::from_toml(&path, &pooler).unwrap();
    assert!(cfg.model.validate().unwrap().pooler.is_some());
    for (rank, expected) in [
        ("-3", "a rank (a positive integer"),
        ("\"big\"", "a rank (a positive integer"),
        ("[8, 16]", "2 ranks given, but 6 cores"),
        ("0", "model.pooler_tt.rank: must be at least 1"),
    ] {
        let bad = with(
            &format!("in_modes = [8, 4, 4]\nout_modes = [4, 4, 8]\nrank = {rank}"),
            "model.pooler_tt",
        );
        let e = RunConfig::from_toml(&path, &bad).unwrap_err();
        let e = comera_train::error::Chain(&e).to_string();
        assert!(e.contains(expected), "rank = {rank}: {e}");
        assert!(e.contains("rank"), "rank = {rank}: {e}");
    }
}
