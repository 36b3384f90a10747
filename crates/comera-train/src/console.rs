//! The terminal's view of a run: an [`Observer`] that shows a progress bar (on a terminal) and
//! the loop's messages on stderr. The CLI installs it; a library user who wants the same output
//! adds it to [`crate::RunOptions::observers`]. The loop itself never prints.
//!
//! On a terminal the bar carries the last logging window's figures and messages print above
//! it; off a terminal (a log file, a batch job) each logging window becomes one line with an
//! estimate of the time left.

use crate::observe::{Control, Event, Observer, Record, TrainRecord};
use indicatif::{ProgressBar, ProgressStyle};
use std::time::Instant;

/// Progress bar and messages on stderr.
pub struct Console {
    /// Show progress (the bar, or window lines off a terminal); messages print either way.
    progress: bool,
    bar: ProgressBar,
    /// The run's step count (None: a streamed run of unknown length) and learning rate.
    total: Option<u64>,
    lr: f32,
    /// When the run (re)started and at which step, for the time left.
    started: Instant,
    start_step: u64,
    /// The phase in progress (1-based) and how many there are.
    phase: usize,
    phases: usize,
}

impl Console {
    /// `progress`: show the bar and the window lines (`--quiet` turns them off).
    pub fn new(progress: bool) -> Console {
        Console {
            progress,
            bar: ProgressBar::hidden(),
            total: None,
            lr: 0.0,
            started: Instant::now(),
            start_step: 0,
            phase: 1,
            phases: 1,
        }
    }

    /// A line above the bar, or on stderr when the bar is hidden.
    fn say(&self, msg: &str) {
        if self.bar.is_hidden() {
            eprintln!("{msg}");
        } else {
            self.bar.println(msg);
        }
    }

    fn started(&mut self, total: Option<u64>, step: u64, lr: f32) {
        (self.total, self.lr, self.start_step) = (total, lr, step);
        self.started = Instant::now();
        self.bar = match (self.progress, total) {
            (false, _) => ProgressBar::hidden(),
            (true, Some(t)) => ProgressBar::new(t),
            (true, None) => ProgressBar::new_spinner(),
        };
        self.bar.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} {msg} [{elapsed_precise}<{eta_precise}]",
            )
            .expect("valid template"),
        );
        self.bar.set_position(step);
    }

    /// The bar's message, and off a terminal a line, for a logging window.
    fn window(&mut self, r: &TrainRecord) {
        let size = match r.size {
            Some(_) => format!(" {:.1}x", r.compression),
            None => String::new(),
        };
        let phase_note = if self.phases > 1 {
            format!(" (phase {})", self.phase)
        } else {
            String::new()
        };
        let (l, a, tps) = (r.loss, r.accuracy, r.tokens_per_s);
        let terms = match &r.loss_terms {
            Some(t) => format!(" (ce {:.4} kl {:.4} mse {:.4})", t.task, t.logits, t.hidden),
            None => String::new(),
        };
        self.bar.set_message(format!(
            "epoch {}{phase_note} loss {l:.4}{terms} acc {a:.3}{size} {tps:.0}/s",
            r.epoch
        ));
        if !(self.progress && self.bar.is_hidden()) {
            return;
        }
        let done = (r.step - self.start_step).max(1) as f64;
        let per_step = self.started.elapsed().as_secs_f64() / done;
        let (of, eta) = match self.total {
            Some(n) => (
                format!("/{n}"),
                format!(
                    " ETA {}",
                    format_secs(per_step * n.saturating_sub(r.step) as f64)
                ),
            ),
            None => (String::new(), String::new()),
        };
        self.say(&format!(
            "step {}{of} epoch {} loss {l:.4} acc {a:.3} lr {:.2e} {tps:.0} tok/s {} params{size}{eta}",
            r.step,
            r.epoch,
            self.lr * r.lr_scale,
            r.params
        ));
    }
}

impl Observer for Console {
    fn on_event(&mut self, event: &Event<'_>) -> Control {
        match event {
            Event::Started { total, step, lr } => self.started(*total, *step, *lr),
            Event::EpochStarted {
                epoch,
                phase,
                phases,
            } => {
                (self.phase, self.phases) = (*phase, *phases);
                // The bar names the epoch (and phase) from its first step.
                self.bar.set_message(if *phases > 1 {
                    format!("epoch {epoch} (phase {phase})")
                } else {
                    format!("epoch {epoch}")
                });
            }
            Event::Record(Record::Train(r)) => self.window(r),
            Event::Step { .. } => self.bar.inc(1),
            Event::TrainingEnded => self.bar.finish_and_clear(),
            Event::Message(m) => self.say(m),
            _ => {}
        }
        Control::Continue
    }
}

/// `1h02m03s`, `2m03s` or `3s`.
fn format_secs(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, s) => format!("{h}h{m:02}m{s:02}s"),
    }
}
