//! What the loop tells the world: each record to `metrics.jsonl`, to the plots' curves and to
//! the observers; lines meant for people as [`Event::Message`]s; the plots and `ranks.md`.

use crate::checkpoint::Progress;
use crate::error::{Chain, Error};
use crate::files::MetricsLog;
use crate::observe::{Control, Event, Observer, RanksRecord, Record};
use crate::plot::{plot_panels, Panel, Series};
use comera_layers::Model;
use comera_optim::rank::{self, LayerRanks};
use std::path::Path;

/// The loop's voice: the metrics log (None until opened, and on the processes of a
/// data-parallel run that do not write), the plots' curves and the observers.
pub(super) struct Reporter {
    log: Option<MetricsLog>,
    pub(super) curves: Curves,
    /// Parameters of the model's dense equivalent (the unit of compression figures).
    pub(super) dense_params: usize,
    observers: Vec<Box<dyn Observer>>,
    /// Whether an observer asked to stop (the loop stops after the step, with a checkpoint).
    pub(super) stop_asked: bool,
}

impl Reporter {
    pub(super) fn new(observers: Vec<Box<dyn Observer>>) -> Reporter {
        Reporter {
            log: None,
            curves: Curves::default(),
            dense_params: 0,
            observers,
            stop_asked: false,
        }
    }

    /// Opens the metrics log: a fresh one, or a resumed run's, cut back to the checkpoint's
    /// `step` (its records go to the curves). Returns the best validation score so far (AUC,
    /// or accuracy) and its epoch.
    pub(super) fn open_log(
        &mut self,
        path: &Path,
        resumed_at: Option<u64>,
    ) -> crate::Result<(f64, usize)> {
        let mut best = (f64::NEG_INFINITY, 0);
        let Some(step) = resumed_at else {
            self.log = Some(MetricsLog::create(path)?);
            return Ok(best);
        };
        for r in metrics_up_to(path, step)? {
            if let Record::Eval(e) = &r {
                if e.score() > best.0 {
                    best = (e.score(), e.epoch);
                }
            }
            self.curves.add(&r);
        }
        self.log = Some(MetricsLog::append(path)?);
        Ok(best)
    }

    /// Writes a record to the metrics log and the curves, and tells the observers.
    pub(super) fn record(&mut self, r: Record) -> crate::Result<()> {
        self.curves.add(&r);
        if let Some(log) = &mut self.log {
            log.write(&serde_json::to_value(&r)?)?;
        }
        self.event(&Event::Record(&r));
        Ok(())
    }

    /// Tells every observer; a `Stop` from any is kept for the loop's next stop check.
    pub(super) fn event(&mut self, e: &Event<'_>) {
        for o in &mut self.observers {
            if o.on_event(e) == Control::Stop {
                self.stop_asked = true;
            }
        }
    }

    /// A line meant for people ([`Event::Message`]).
    pub(super) fn say(&mut self, msg: String) {
        self.event(&Event::Message(&msg));
    }

    /// Takes the model's dense-equivalent size (for [`Reporter::ratio`]) and says its size.
    pub(super) fn model_size(&mut self, model: &dyn Model) {
        self.dense_params = model.dense_equivalent_params();
        self.say(format!(
            "      {} parameters ({} dense, {:.1}x compression)",
            model.num_params(),
            self.dense_params,
            self.ratio(model)
        ));
    }

    /// The whole model's compression against its dense equivalent.
    pub(super) fn ratio(&self, model: &dyn Model) -> f64 {
        self.dense_params as f64 / model.num_params() as f64
    }

    /// `curves.png`, and `ranks.png` for a rank-adaptive run; a plot that cannot be written
    /// is a warning, not an error.
    pub(super) fn plots(&mut self, out: &Path, rank_active: bool, loss_name: &str) {
        if let Err(e) = self.curves.plot(&out.join("curves.png"), loss_name) {
            self.say(format!("warning: plot not written: {}", Chain(&e)));
        }
        if rank_active {
            if let Err(e) = self.curves.plot_ranks(&out.join("ranks.png"), loss_name) {
                self.say(format!("warning: plot not written: {}", Chain(&e)));
            }
        }
    }
}

/// whole history).
#[derive(Default)]
pub(super) struct Curves {
    train_loss: Vec<(f64, f64)>,
    valid_loss: Vec<(f64, f64)>,
    train_acc: Vec<(f64, f64)>,
    valid_acc: Vec<(f64, f64)>,
    /// Validation AUC of a binary task (empty otherwise).
    valid_auc: Vec<(f64, f64)>,
    /// Compression of the whole model over steps.
    model_ratio: Vec<(f64, f64)>,
    /// Per layer: mean active rank over its bonds, over steps.
    ranks: Vec<(String, Vec<(f64, f64)>)>,
    /// The step at which the rank schedule switched to its late stage.
    late_from: Option<f64>,
}

impl Curves {
    /// Takes in one metrics record.
    pub(super) fn add(&mut self, r: &Record) {
        match r {
            Record::Train(t) => {
                let step = t.step as f64;
                self.train_loss.push((step, t.loss));
                self.train_acc.push((step, t.accuracy));
                self.model_ratio.push((step, t.compression));
                for (name, &v) in t.mean_ranks.iter().flatten() {
                    match self.ranks.iter_mut().find(|(n, _)| n == name) {
                        Some((_, pts)) => pts.push((step, v)),
                        None => self.ranks.push((name.clone(), vec![(step, v)])),
                    }
                }
            }
            Record::Stage(st) => self.late_from = Some(st.step as f64),
            Record::Eval(e) => {
                let step = e.step as f64;
                self.valid_loss.push((step, e.valid_loss));
                self.valid_acc.push((step, e.valid_accuracy));
                if let Some(a) = e.valid_auc {
                    self.valid_auc.push((step, a));
                }
            }
            _ => {}
        }
    }

    /// Rank evolution, compression and loss over steps, the stage switch marked.
    fn plot_ranks(&self, path: &Path, loss_name: &str) -> crate::Result<()> {
        let marks: Vec<(f64, String)> = self
            .late_from
            .map(|x| (x, "late stage".to_string()))
            .into_iter()
            .collect();
        let rank_series = self.ranks.iter().map(|(n, p)| series(n, p)).collect();
        let compression = vec![series("whole model", &self.model_ratio)];
        let panels = [
            panel("mean active rank per layer", "rank", rank_series, false),
            panel(
                "compression of the whole model",
                "dense / trainable parameters",
                compression,
                true,
            ),
            self.loss_panel(loss_name),
        ]
        .map(|p| Panel {
            marks: marks.clone(),
            ..p
        });
        plot_panels(path, &panels, 1300, 380)?;
        Ok(())
    }

    /// Loss and accuracy (and AUC for a binary task) over steps.
    fn plot(&self, path: &Path, loss_name: &str) -> crate::Result<()> {
        let accuracy = vec![
            series("train", &self.train_acc),
            series("valid", &self.valid_acc),
        ];
        let mut panels = vec![
            self.loss_panel(loss_name),
            panel("accuracy", "accuracy", accuracy, false),
        ];
        if !self.valid_auc.is_empty() {
            let auc = vec![series("valid", &self.valid_auc)];
            panels.push(panel("validation AUC", "AUC", auc, false));
        }
        let width = 450 * panels.len() as u32;
        plot_panels(path, &panels, width, 360)?;
        Ok(())
    }

    fn loss_panel(&self, loss_name: &str) -> Panel {
        let loss = vec![
            series("train", &self.train_loss),
            series("valid", &self.valid_loss),
        ];
        panel("loss", loss_name, loss, false)
    }
}

fn series(name: &str, points: &[(f64, f64)]) -> Series {
    Series {
        name: name.into(),
        points: points.to_vec(),
    }
}

/// A panel over steps.
fn panel(title: &str, y_label: &str, series: Vec<Series>, log_y: bool) -> Panel {
    Panel {
        title: title.into(),
        x_label: "step".into(),
        y_label: y_label.into(),
        series,
        log_y,
        ..Default::default()
    }
}

/// Rewrites the metrics log without records after `step` (written after the checkpoint a run
/// resumes from), and without the final `ranks` record (written again when the run ends), and
/// returns the kept records.
fn metrics_up_to(path: &Path, step: u64) -> crate::Result<Vec<Record>> {
    let text = match comera_data::read_regular_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(Error::io(path, "cannot read", e)),
    };
    let mut kept = Vec::new();
    let mut out = String::new();
    for line in text.lines() {
        // A line cut short by a kill is dropped like a later one.
        let Ok(v) = serde_json::from_str::<Record>(line) else {
            continue;
        };
        if v.step() <= step && !matches!(v, Record::Ranks(_)) {
            out.push_str(line);
            out.push('\n');
            kept.push(v);
        }
    }
    crate::files::write_atomic(path, out.as_bytes())?;
    Ok(kept)
}

/// Mean active rank per layer (for the metrics log and the rank plot).
pub(super) fn mean_ranks(layers: &[LayerRanks]) -> std::collections::BTreeMap<String, f64> {
    layers
        .iter()
        .map(|l| {
            let mean = l.ranks.iter().sum::<usize>() as f64 / l.ranks.len().max(1) as f64;
            (l.name.clone(), mean)
        })
        .collect()
}

/// `ranks.md` and the final `ranks` record of a rank-adaptive run.
pub(super) fn write_rank_report(
    out: &Path,
    prog: &Progress,
    ranks_end: &[LayerRanks],
    stage: &str,
    initial_params: usize,
    model: &dyn Model,
    rep: &mut Reporter,
) -> crate::Result<()> {
    let mut points: Vec<(&str, &[LayerRanks])> = vec![("start", &prog.ranks_start)];
    if let Some(r) = &prog.ranks_switch {
        points.push(("after early stage", r));
    }
    points.push(("end", ranks_end));
    let table = rank::rank_table(&points);
    let dense = rep.dense_params;
    let text = format!(
        "# Ranks of the TT/TTM layers\n\nStage at the end: {stage}.\n\n{table}Whole model (the TT/TTM layers with every dense layer, embedding, norm and bias): {initial_params} → {} parameters; compression vs its dense equivalent ({dense}) {:.1}× → {:.1}×.\n",
        model.num_params(),
        dense as f64 / initial_params as f64,
        rep.ratio(model)
    );
    crate::files::write_atomic(&out.join("ranks.md"), text.as_bytes())?;
    rep.record(Record::Ranks(RanksRecord {
        step: prog.step,
        start: prog.ranks_start.clone(),
        switch: prog.ranks_switch.clone(),
        end: ranks_end.to_vec(),
    }))
}
