//! What a training run tells the world: typed records, events and observers.
//!
//! - [`Record`]: one type per kind of line in `metrics.jsonl` (`train`, `eval`, `early_stop`,
//!   `stage`, `truncate`, `ranks`), written and read back by the same type (`kind` names the
//!   variant), so a resumed run, a plot and a library user read them typed.
//! - [`Event`]: what the loop emits as it goes: each record, each checkpoint written, lines
//!   meant for people, and the end of the run.
//! - [`Observer`]: receives every event and answers [`Control::Continue`] or [`Control::Stop`]
//!   (the run then stops after the step, with a checkpoint, like a first Ctrl-C: resumable).
//!   The loop itself writes the metrics log and the plots; observers are for everything else
//!   (a notebook's progress, a logger, one's own early stopping). An observer must not print
//!   for the library: it is the front end's choice.
//!
//! Training a tiny run from Rust, with an observer that counts events and stops the run after
//! three steps; the run directory is then an ordinary stopped run that `resume` continues:
//!
//! ```
//! use comera_train::observe::{Control, Event, Observer, Record};
//! use comera_train::{AnyRunConfig, RunOptions};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = std::env::temp_dir().join(format!("comera-doc-observer-{}", std::process::id()));
//! # let _ = std::fs::remove_dir_all(&dir);
//! std::fs::create_dir_all(&dir)?;
//! // A tiny labelled data set and its vocabulary.
//! std::fs::write(dir.join("vocab.txt"), "[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\ngood\nbad\nthe\ndress\n")?;
//! let mut tsv = String::from("sentence\tlabel\n");
//! for i in 0..40 {
//!     tsv += if i % 2 == 0 { "the good dress\tpos\n" } else { "the bad dress\tneg\n" };
//! }
//! std::fs::write(dir.join("train.tsv"), tsv)?;
//! let config = format!(
//!     r#"
//! [data]
//! source = "tsv"
//! train = "{d}/train.tsv"
//! text_a = "sentence"
//! label = "label"
//! labels = ["neg", "pos"]
//! vocab = "{d}/vocab.txt"
//! valid_fraction = 0.25
//! [model]
//! vocab_size = 9
//! seq_len = 8
//! d_model = 16
//! heads = 2
//! ffn = 32
//! layers = 1
//! tt_linear = true
//! ttm_embedding = false
//! attn_tt = {{ in_modes = [4, 4], out_modes = [4, 4], rank = 3 }}
//! ffn_up_tt = {{ in_modes = [4, 4], out_modes = [4, 8], rank = 3 }}
//! ffn_down_tt = {{ in_modes = [4, 8], out_modes = [4, 4], rank = 3 }}
//! [train]
//! epochs = 2
//! batch_size = 4
//! log_every = 1
//! out_dir = "{d}/run"
//! "#,
//!     d = dir.display()
//! );
//! std::fs::write(dir.join("run.toml"), config)?;
//! let AnyRunConfig::Encoder(cfg) = AnyRunConfig::from_file(&dir.join("run.toml"))? else {
//!     unreachable!("an encoder config")
//! };
//!
//! /// Counts the events and stops the run at step 3.
//! struct StopAtThree {
//!     events: usize,
//! }
//! impl Observer for StopAtThree {
//!     fn on_event(&mut self, event: &Event<'_>) -> Control {
//!         self.events += 1;
//!         match event {
//!             Event::Record(Record::Train(r)) if r.step >= 3 => Control::Stop,
//!             _ => Control::Continue,
//!         }
//!     }
//! }
//! let counter = std::sync::Arc::new(std::sync::Mutex::new(StopAtThree { events: 0 }));
//! let opts = RunOptions {
//!     observers: vec![Box::new(counter.clone())],
//!     ..RunOptions::default()
//! };
//! let summary = comera_train::train(&cfg, opts)?;
//! assert!(summary.stopped && summary.steps == 3);
//! assert!(counter.lock().unwrap().events >= 4); // three train records and a checkpoint
//! // A valid, resumable run: `resume` continues it to its end.
//! let done = comera_train::resume(&dir.join("run"))?;
//! assert!(!done.stopped && done.steps > 3);
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok(())
//! # }
//! ```

use std::path::Path;

pub use comera_run::records::{
    read_metrics, EarlyStopRecord, EvalRecord, RanksRecord, Record, StageRecord, TrainRecord,
    TruncateRecord,
};

/// What the loop tells its observers.
#[derive(Debug)]
#[non_exhaustive]
pub enum Event<'a> {
    /// Training starts (or resumes) at `step`, of `total` steps (None: a streamed run of
    /// unknown length); `lr` is the TT cores' base learning rate (records carry its scale).
    Started {
        total: Option<u64>,
        step: u64,
        lr: f32,
    },
    /// An epoch (1-based) starts, in phase `phase` (1-based) of `phases`.
    EpochStarted {
        epoch: usize,
        phase: usize,
        phases: usize,
    },
    /// A step was taken (`step`: steps done so far).
    Step { step: u64 },
    /// A record, as written to `metrics.jsonl`.
    Record(&'a Record),
    /// A checkpoint was written after `step` (the run can be resumed from there).
    Checkpoint { step: u64, path: &'a Path },
    /// A line meant for people (a phase change, the late stage, an early stop), as the CLI
    /// shows it above its progress bar.
    Message(&'a str),
    /// No more steps: what follows is the run's final report.
    TrainingEnded,
    /// The run ended (finished, stopped or stopped early); the summary is also what the call
    /// returns.
    Finished(&'a comera_run::records::TrainSummary),
}

/// An observer's answer to an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    Continue,
    /// Stop after the current step, with a checkpoint (the run is resumable).
    Stop,
}

/// Receives the events of a run ([`crate::RunOptions::observers`]).
pub trait Observer: Send {
    fn on_event(&mut self, event: &Event<'_>) -> Control;
}

/// An observer shared with its owner (to read what it gathered after the run).
impl<O: Observer> Observer for std::sync::Arc<std::sync::Mutex<O>> {
    fn on_event(&mut self, event: &Event<'_>) -> Control {
        match self.lock() {
            Ok(mut o) => o.on_event(event),
            Err(poisoned) => poisoned.into_inner().on_event(event),
        }
    }
}

/// A closure as an observer.
impl<F: FnMut(&Event<'_>) -> Control + Send> Observer for F {
    fn on_event(&mut self, event: &Event<'_>) -> Control {
        self(event)
    }
}
