//! The one training loop, read top to bottom in [`run`] and [`Loop::epoch`]: for each epoch of
//! each phase, for each batch: load it, take the step ([`comera_optim::Stepper`]), let the rank
//! schedule act (stage switch, truncation: [`comera_optim::rank::RankController::after_step`]),
//! log the window when due, evaluate when due (early stopping), checkpoint when due, stop when
//! asked. Each concern is one method of [`Loop`] below, in that order.
//!
//! Exact resume: everything the loop carries from step to step is either in the checkpoint's
//! [`Progress`] or rebuilt from the metrics log, and a resumed epoch replays its data order up
//! to the checkpoint, so a resumed run takes bit for bit the steps of one never stopped.

use super::report::{mean_ranks, write_rank_report, Reporter};
use super::{median, peak_rss_bytes, LoopSettings, RunSetup, Setup, TrainSummary};
use crate::checkpoint::{self, Progress};
use crate::config::Phase;
use crate::device::DeviceStep;
use crate::error::Error;
use crate::observe::{
    EarlyStopRecord, EvalRecord, Event, Record, StageRecord, TrainRecord, TruncateRecord,
};
use crate::run_dir::RunDir;
use crate::task::{EpochBatches, EvalStats, Task};
use comera_layers::{LossTerms, Model, StepStats, Trainable};
use comera_optim::rank::{self, Branch, RankController, RankEvent, Stage};
use comera_optim::{Optimizer, Schedule, StepReport, Stepper};
use std::time::{Duration, Instant};

/// The batch state of a task's model.
type State<T> = <<T as Task>::Model as Trainable>::State;

/// Runs `setup` to its end (or to a stop) and reports.
pub(super) fn run<T: Task>(setup: Setup<T>, rep: Reporter) -> crate::Result<TrainSummary> {
    let Setup { mut task, run } = setup;
    let epochs = plan_epochs(&mut task, run.settings.train.accumulate_steps)?;
    let mut lp = Loop::start(&task, run, epochs, rep)?;
    let end = match lp.finished_training()? {
        true => End::Completed,
        false => lp.epochs()?,
    };
    lp.finish(end)
}

/// How the training ended.
#[derive(Clone, Copy, PartialEq, Eq)]
enum End {
    /// Every epoch ran.
    Completed,
    /// Stopped by `train.stop_after_steps`, a signal or an observer (resumable).
    Stopped,
    /// Early stopping ended the run (the best model is in `best/`).
    EarlyStopped,
}

/// Everything the loop carries between steps, besides the task (borrowed, so an epoch's batches
/// can borrow it while the loop's methods change the rest).
struct Loop<'t, T: Task> {
    task: &'t T,
    model: T::Model,
    stepper: Stepper,
    /// The batch state, planned for phase `st_phase`'s micro-batch shape.
    st: State<T>,
    st_phase: usize,
    cfg: LoopSettings,
    run_dir: Option<RunDir>,
    run_id: String,
    phases: Vec<Phase>,
    /// Each epoch's phase and step count (None: a streamed epoch of unknown length).
    epochs: Vec<(usize, Option<usize>)>,
    /// Sequence positions (or examples) per step of each phase.
    tokens_per_step: Vec<u64>,
    /// The checkpointed part of the loop's state.
    prog: Progress,
    rep: Reporter,
    /// When this process started, and the seconds of the run before it (a resumed run).
    t0: Instant,
    base_seconds: f64,
    /// The logging window: its steps, their collective time (s) and its start.
    window: (usize, f64, Instant),
    /// Wall time of each step of this process (ms).
    step_ms: Vec<f64>,
    /// The best validation score (AUC, or accuracy) and its epoch; the last evaluation.
    best: (f64, usize),
    final_valid: EvalStats,
    /// Whether this process writes the run directory (process 0 of a data-parallel run).
    writer: bool,
    rank_active: bool,
    initial_params: usize,
    /// Whether the run resumed from a checkpoint.
    resumed: bool,
    /// The step engine on a device (None: the CPU's), and whether the host model and
    /// optimiser hold what the device holds (false after a device step until
    /// [`Loop::host_current`] copies it back).
    device: Option<Box<dyn DeviceStep<T::Model>>>,
    host_in_step: bool,
}

impl<'t, T: Task> Loop<'t, T> {
    /// The model (with a resumed run's checkpoint loaded), optimiser, rank schedule, batch
    /// state and metrics log, ready for the first step.
    fn start(
        task: &'t T,
        setup: RunSetup<T::Model>,
        epochs: Vec<(usize, Option<usize>)>,
        mut rep: Reporter,
    ) -> crate::Result<Loop<'t, T>> {
        let RunSetup {
            mut model,
            optim,
            galore,
            rank_cfg,
            clip_norm,
            gate_threshold,
            settings: cfg,
            resume,
            run_dir,
            mut device,
        } = setup;
        let t0 = Instant::now();
        let initial_params = model.num_params();
        // The learning rate shown in log lines: the TT cores' (the rest scale alike).
        let lr_cores = optim.lr_cores;
        let total = total_steps(&epochs);
        let rank_cfg = resolve_rank_schedule(rank_cfg, total)?;
        let ck = resume.as_ref();
        let (optimizer, rank, prog) =
            restore(&mut model, optim, galore, &rank_cfg, ck, device.as_mut())?;
        rep.model_size(&model);
        let phases = task.phases().to_vec();
        let schedule = lr_schedule(
            &cfg.train,
            &rank_cfg,
            total,
            epochs.len(),
            resume.is_none(),
            &mut rep,
        );
        let mut stepper = Stepper::new(optimizer, rank, schedule, clip_norm, gate_threshold);
        if let Some(dev) = device.as_mut() {
            // The schedule as the run has it now (a resumed run's, from its checkpoint).
            dev.set_rank_schedule(&model, crate::device::rank_settings(&stepper.rank))?;
        }
        // Data-parallel (several processes): process 0 alone writes the run directory.
        stepper.data_parallel =
            crate::distributed::collective().map(comera_optim::DataParallel::new);
        let writer = crate::distributed::is_writer();
        let st_phase = epochs.get(prog.epoch).map_or(phases.len() - 1, |e| e.0);
        let st = task.state(
            &model,
            &micro_phase(&phases[st_phase], cfg.train.accumulate_steps),
        )?;
        if let Some(dev) = device.as_mut() {
            // Planned for the first phase; a run resumed in a later one steps at its shape.
            dev.set_shape(&model, &st)?;
        }
        let resumed = resume.is_some();
        if resumed && prog.epoch >= epochs.len() {
            refuse_finished(&cfg.train.out_dir, epochs.len(), prog.step)?;
        }
        let best = match writer {
            true => rep.open_log(
                &cfg.train.out_dir.join("metrics.jsonl"),
                resume.map(|_| prog.step),
            )?,
            false => (f64::NEG_INFINITY, 0),
        };
        rep.event(&Event::Started {
            total,
            step: prog.step,
            lr: lr_cores,
        });
        Ok(Loop {
            task,
            rank_active: stepper.rank.active(),
            stepper,
            st,
            st_phase,
            run_id: run_dir
                .as_ref()
                .map_or_else(String::new, |d| d.identity.id.clone()),
            run_dir,
            tokens_per_step: phases
                .iter()
                .map(|p| (p.batch_size * task.tokens_per_example(p)) as u64)
                .collect(),
            phases,
            epochs,
            base_seconds: prog.seconds,
            prog,
            rep,
            t0,
            window: (0, 0.0, Instant::now()),
            step_ms: Vec::new(),
            best,
            final_valid: EvalStats::default(),
            writer,
            initial_params,
            resumed,
            model,
            cfg,
            device,
            host_in_step: true,
        })
    }

    /// A run whose last checkpoint is its end, killed before its final report, only finishes
    /// its report (after evaluating again). ([`refuse_finished`] refused one that ended.)
    fn finished_training(&mut self) -> crate::Result<bool> {
        if !self.resumed || self.prog.epoch < self.epochs.len() {
            return Ok(false);
        }
        self.rep
            .say("the run had finished training; writing its final report".into());
        let phase = micro_phase(&self.phases[self.st_phase], self.cfg.train.accumulate_steps);
        self.final_valid = self.task.evaluate(&self.model, &mut self.st, &phase)?;
        Ok(true)
    }

    /// Every epoch from the checkpoint's on, until one ends the run.
    fn epochs(&mut self) -> crate::Result<End> {
        for epoch in self.prog.epoch..self.epochs.len() {
            if let Some(end) = self.epoch(epoch)? {
                return Ok(end);
            }
        }
        Ok(End::Completed)
    }

    /// One epoch (0-based): its steps, then its evaluation, model files and checkpoint.
    /// Returns how the run ended, if it did.
    fn epoch(&mut self, epoch: usize) -> crate::Result<Option<End>> {
        let (ph, per_epoch) = self.epochs[epoch];
        self.enter_phase(ph, epoch)?;
        let meta = self.task.model_meta(&self.model, epoch, self.prog.step)?;
        // What the task sees: batches of the micro-batch size (the phase's, without accumulation).
        let micro = micro_phase(&self.phases[ph], self.cfg.train.accumulate_steps);
        let task = self.task;
        let mut batches = task.epoch(&micro, epoch)?;
        // Resuming inside an epoch: replay its data order up to the checkpoint.
        for _ in 0..self.prog.batch_in_epoch * self.cfg.train.accumulate_steps {
            batches.next_into(&mut self.st)?;
        }
        let mut i = self.prog.batch_in_epoch;
        while per_epoch.is_none_or(|n| i < n) {
            if !batches.next_into(&mut self.st)? {
                break;
            }
            i += 1;
            let epoch_end = per_epoch == Some(i);
            // A streamed epoch that ends inside an accumulated step drops it.
            let Some(r) = self.step(&mut batches, epoch, i)? else {
                break;
            };
            self.rank_events(epoch + 1, epoch_end)?;
            if self.rank_active {
                crate::distributed::check_same_ranks(
                    &mut self.stepper,
                    &self.model,
                    self.prog.step,
                )?;
            }
            self.count(r.stats);
            if self
                .prog
                .step
                .is_multiple_of(self.cfg.train.log_every as u64)
            {
                self.log_window(&r, epoch, ph)?;
            }
            self.rep.event(&Event::Step {
                step: self.prog.step,
            });
            if epoch_end {
                break;
            }
            // Evaluations come before the step's checkpoint: a checkpoint at step s implies
            // that the evaluation at s is in the log (and in early stopping's state).
            if self.cfg.train.eval_every > 0
                && self.prog.step.is_multiple_of(self.cfg.train.eval_every)
            {
                let seconds = self.seconds();
                if self.evaluate(epoch + 1, &micro, false, seconds)? {
                    self.stop_early_inside_epoch(&meta, seconds)?;
                    return Ok(Some(End::EarlyStopped));
                }
            }
            let stop = self.stop_due();
            if stop || self.checkpoint_due() {
                self.prog.seconds = self.seconds();
                self.checkpoint(&meta)?;
            }
            if stop {
                return Ok(Some(End::Stopped));
            }
        }
        drop(batches);
        if per_epoch.is_none() {
            // A streamed epoch ends when its data does: the epoch-end rank events run now.
            self.rank_events(epoch + 1, true)?;
        }
        self.end_epoch(epoch, &micro)
    }

    /// At an epoch's start: the batch state for its phase (rebuilt when the phase changes).
    fn enter_phase(&mut self, ph: usize, epoch: usize) -> crate::Result<()> {
        let phase = &self.phases[ph];
        if ph != self.st_phase {
            let micro = micro_phase(phase, self.cfg.train.accumulate_steps);
            self.st = self.task.state(&self.model, &micro)?;
            self.st_phase = ph;
            if let Some(dev) = self.device.as_mut() {
                dev.set_shape(&self.model, &self.st)?;
            }
            self.rep.say(format!(
                "phase {}: seq_len {}, batch {}",
                ph + 1,
                phase.seq_len,
                phase.batch_size
            ));
        }
        self.rep.event(&Event::EpochStarted {
            epoch: epoch + 1,
            phase: ph + 1,
            phases: self.phases.len(),
        });
        Ok(())
    }

    /// One step on the loaded batch (and, under accumulation, the micro-batches after it);
    /// `i` is the batch's 1-based index in the epoch. None: the data ended inside the step.
    fn step(
        &mut self,
        batches: &mut T::Epoch<'t>,
        epoch: usize,
        i: usize,
    ) -> crate::Result<Option<StepReport>> {
        let ts = Instant::now();
        let in_epoch = |e| Error::run_with(format!("epoch {}", epoch + 1), e);
        let r = match self.device.as_mut() {
            Some(dev) => {
                let step = self.prog.step;
                let mut load_next = |st: &mut _| batches.next_into(st);
                let r = device_step(
                    dev.as_mut(),
                    &mut self.stepper,
                    &mut self.model,
                    &mut self.st,
                    (step, self.cfg.train.accumulate_steps),
                    &mut load_next,
                )
                .map_err(|e| match e {
                    Error::Step(e) => in_epoch(e),
                    e => e,
                })?;
                self.host_in_step = false;
                match r {
                    Some(r) => r,
                    None => return Ok(None),
                }
            }
            None => {
                let mut load_next = |st: &mut _| batches.next_into(st).map_err(Into::into);
                match self.stepper.step_accumulated(
                    &mut self.model,
                    &mut self.st,
                    self.prog.step,
                    self.cfg.train.accumulate_steps,
                    &mut load_next,
                ) {
                    Err(comera_optim::StepError::EndOfData) => return Ok(None),
                    r => r.map_err(in_epoch)?,
                }
            }
        };
        self.step_ms.push(ts.elapsed().as_secs_f64() * 1e3);
        self.window.1 += r.comm.as_secs_f64();
        self.prog.step += 1;
        self.prog.batch_in_epoch = i;
        Ok(Some(r))
    }

    /// After a step: what the rank schedule did (stage switch, truncation), recorded and told.
    fn rank_events(&mut self, epoch: usize, epoch_end: bool) -> crate::Result<()> {
        let step = self.prog.step;
        if self.device.is_some() && self.stepper.rank.reads_model_after(step, epoch_end) {
            self.host_current()?;
        }
        let events = self
            .stepper
            .after_step(&mut self.model, step, epoch, epoch_end);
        if let Some(dev) = self.device.as_mut() {
            if events
                .iter()
                .any(|e| matches!(e, RankEvent::Truncated { .. }))
            {
                // The truncated model and its cut moments onto the device, which plans its
                // step again at the new ranks.
                dev.copy_from_host(&self.model, &self.stepper.optimizer)?;
            }
        }
        for event in events {
            match event {
                RankEvent::LateStage {
                    size,
                    target_size,
                    ranks,
                } => {
                    self.rep.record(Record::Stage(StageRecord {
                        stage: "late".into(),
                        epoch,
                        step,
                        size,
                        target_size: Some(target_size),
                        ranks: ranks.clone(),
                    }))?;
                    self.rep.say(format!(
                        "step {step}: late stage, size {size:.0} → target {target_size:.0}"
                    ));
                    self.prog.ranks_switch = Some(ranks);
                }
                RankEvent::Truncated { layers, ranks } => {
                    self.rep.record(Record::Truncate(TruncateRecord {
                        epoch,
                        step,
                        params: self.model.num_params(),
                        compression: self.rep.ratio(&self.model),
                        ranks,
                        layers,
                    }))?;
                }
            }
        }
        Ok(())
    }

    /// Adds a step's loss and accuracy to the epoch's and the window's sums.
    fn count(&mut self, s: StepStats) {
        let p = &mut self.prog;
        p.ep_loss += s.loss * s.count as f64;
        p.ep_correct += s.correct;
        p.ep_count += s.count;
        p.win_loss += s.loss * s.count as f64;
        if let Some(t) = &s.terms {
            let w = p.win_terms.get_or_insert_with(Default::default);
            w.add_scaled(t, s.count as f64);
        }
        p.win_correct += s.correct;
        p.win_count += s.count;
        self.window.0 += 1;
    }

    /// A logging window ends: its `train` record (means over the window), then a new window.
    fn log_window(&mut self, r: &StepReport, epoch: usize, ph: usize) -> crate::Result<()> {
        let (steps, comm, start) = self.window;
        let secs = start.elapsed().as_secs_f64();
        let steps = steps.max(1) as f64;
        let p = &self.prog;
        let mut rec = TrainRecord {
            epoch: epoch + 1,
            step: p.step,
            tokens: self.tokens_at(p.step),
            loss: p.win_loss / p.win_count as f64,
            accuracy: p.win_correct as f64 / p.win_count as f64,
            lr_scale: r.lr_scale,
            grad_norm: r.grad_norm,
            tokens_per_s: self.tokens_per_step[ph] as f64 * steps / secs,
            ms_per_step: secs * 1e3 / steps,
            params: self.model.num_params(),
            compression: self.rep.ratio(&self.model),
            processes: None,
            allreduce_bytes_per_step: None,
            comm_ms_per_step: None,
            size: None,
            size_l1: None,
            branch: None,
            mean_ranks: None,
            loss_terms: p.win_terms.map(|t| {
                let mut mean = LossTerms::default();
                mean.add_scaled(&t, 1.0 / p.win_count as f64);
                mean
            }),
        };
        if let Some(dp) = &self.stepper.data_parallel {
            rec.processes = Some(crate::distributed::processes().1);
            rec.allreduce_bytes_per_step = Some(dp.bytes_per_step);
            rec.comm_ms_per_step = Some(comm * 1e3 / steps);
        }
        if self.rank_active {
            let branch = match r.objective.branch {
                Branch::Early => "early",
                Branch::Loss => "late-loss",
                Branch::Size => "late-size",
            };
            rec.size = Some(r.objective.size);
            rec.size_l1 = Some(r.objective.size_l1);
            rec.branch = Some(branch.into());
            if let (Some(dev), false) = (self.device.as_mut(), self.host_in_step) {
                // The active ranks are the gates' on the device.
                dev.copy_gates_to_host(&mut self.model)?;
            }
            rec.mean_ranks = Some(mean_ranks(&rank::layer_ranks(&self.model)));
        }
        self.rep.record(Record::Train(rec))?;
        let p = &mut self.prog;
        (p.win_loss, p.win_correct, p.win_count) = (0.0, 0, 0);
        p.win_terms = None;
        self.window = (0, 0.0, Instant::now());
        Ok(())
    }

    /// One evaluation on the held-out data (1-based `epoch`, in progress or at its end): its
    /// `eval` record and line, the best score, and early stopping's bookkeeping. Returns
    /// whether early stopping ends the run.
    fn evaluate(
        &mut self,
        epoch: usize,
        phase: &Phase,
        epoch_end: bool,
        seconds: f64,
    ) -> crate::Result<bool> {
        self.host_current()?;
        let valid = self.task.evaluate(&self.model, &mut self.st, phase)?;
        // Training figures over the epoch so far.
        let p = &self.prog;
        let n = p.ep_count.max(1) as f64;
        let (tl, ta) = (p.ep_loss / n, p.ep_correct as f64 / n);
        self.rep.record(Record::Eval(EvalRecord {
            epoch,
            step: p.step,
            tokens: self.tokens_at(p.step),
            train_loss: tl,
            train_accuracy: ta,
            valid_loss: valid.loss,
            valid_accuracy: valid.accuracy,
            valid_perplexity: valid.loss.exp(),
            valid_auc: valid.auc,
            valid_macro_f1: valid.classes.as_ref().map(|c| c.macro_f1),
            seconds,
            peak_rss_bytes: Some(peak_rss_bytes()),
        }))?;
        let auc = valid.auc.map_or(String::new(), |a| format!(" AUC {a:.4}"));
        let (vl, va) = (valid.loss, valid.accuracy);
        self.rep.say(if epoch_end {
            format!("epoch {epoch}: train loss {tl:.4} acc {ta:.4} | valid loss {vl:.4}{auc} acc {va:.4}")
        } else {
            format!(
                "step {} (epoch {epoch}): valid loss {vl:.4}{auc} acc {va:.4}",
                self.prog.step
            )
        });
        if let Some(c) = valid.classes.as_ref().filter(|c| c.collapsed) {
            self.rep.say(format!(
                "warning: every validation example is predicted as one class (accuracy {va:.4}, the majority class's share {:.4}): the model has collapsed to one answer",
                c.majority
            ));
        }
        let score = valid.auc.unwrap_or(valid.accuracy);
        if score > self.best.0 {
            self.best = (score, epoch);
        }
        let stop = self.early_stopping(&valid, epoch, epoch_end);
        self.final_valid = valid;
        stop
    }

    /// Early stopping after an evaluation: on an improvement of the watched metric the model
    /// is written to `best/` (with the run's `config.toml`, so every command reads it as a run
    /// directory); after `patience` evaluations without one, an `early_stop` record. Returns
    /// whether to stop.
    fn early_stopping(
        &mut self,
        valid: &EvalStats,
        epoch: usize,
        epoch_end: bool,
    ) -> crate::Result<bool> {
        let Some(es) = self.cfg.train.early_stopping.clone() else {
            return Ok(false);
        };
        let value = es.value(valid).ok_or_else(|| {
            crate::config::ConfigError::new(
                "train.early_stopping.metric",
                "valid_auc needs a binary task; this one reports no AUC (use valid_loss or valid_accuracy)",
            )
        })?;
        let p = &mut self.prog;
        if es.improves(value, p.best_metric) {
            (p.best_metric, p.evals_since_best) = (Some(value), 0);
            if self.writer {
                let best = self.cfg.train.out_dir.join(super::BEST_DIR);
                let epochs_done = if epoch_end { epoch } else { epoch - 1 };
                let meta = self.task.model_meta(&self.model, epochs_done, p.step)?;
                crate::files::save_model_files(
                    &best,
                    &self.model.params(),
                    &meta,
                    Some(&self.run_id),
                )?;
                crate::files::write_atomic(
                    &best.join("config.toml"),
                    self.cfg.config_toml.as_bytes(),
                )?;
                // The best model is a model directory of its own: with the run's vocabulary.
                let vocab = self.cfg.train.out_dir.join(crate::files::RUN_VOCAB);
                let best_vocab = best.join(crate::files::RUN_VOCAB);
                if vocab.exists() && !best_vocab.exists() {
                    let bytes = comera_data::read_regular(&vocab)
                        .map_err(|e| crate::Error::io(&vocab, "cannot read", e))?;
                    crate::files::write_atomic(&best_vocab, &bytes)?;
                }
            }
            return Ok(false);
        }
        p.evals_since_best += 1;
        if p.evals_since_best < es.patience {
            return Ok(false);
        }
        let (step, best) = (p.step, p.best_metric.unwrap_or(f64::NAN));
        self.rep.record(Record::EarlyStop(EarlyStopRecord {
            epoch,
            step,
            metric: es.metric,
            best,
            patience: es.patience,
        }))?;
        self.rep.say(format!(
            "early stop at step {step}: {} has not improved on {best:.4} in {} evaluations; the best model is in {}",
            serde_json::to_value(es.metric)?.as_str().unwrap_or("metric"),
            es.patience,
            self.cfg.train.out_dir.join(super::BEST_DIR).display()
        ));
        Ok(true)
    }

    /// Early stopping inside an epoch ends the run there: model files, and a checkpoint that
    /// says the run is over (resume reports it finished).
    fn stop_early_inside_epoch(&mut self, meta: &str, seconds: f64) -> crate::Result<()> {
        self.save_model_files(meta)?;
        (self.prog.epoch, self.prog.batch_in_epoch) = (self.epochs.len(), 0);
        self.prog.seconds = seconds;
        self.checkpoint(meta)?;
        self.plots();
        Ok(())
    }

    /// An epoch's end: its evaluation, model files and checkpoint (the next epoch starts from a
    /// clean slate). Returns how the run ended, if it did.
    fn end_epoch(&mut self, epoch: usize, micro: &Phase) -> crate::Result<Option<End>> {
        if self.prog.ep_count == 0 {
            return Err(Error::run(format!(
                "epoch {}: no full batch of {} examples in the training data",
                epoch + 1,
                self.phases[self.epochs[epoch].0].batch_size
            )));
        }
        if let Some(note) = self.task.epoch_note() {
            self.rep.say(format!("data  {note}"));
        }
        let seconds = self.seconds();
        let stop_early = self.evaluate(epoch + 1, micro, true, seconds)?;
        let meta = self
            .task
            .model_meta(&self.model, epoch + 1, self.prog.step)?;
        self.save_model_files(&meta)?;
        // An early stop ends the run at this checkpoint.
        let next = if stop_early {
            self.epochs.len()
        } else {
            epoch + 1
        };
        let p = &mut self.prog;
        (p.epoch, p.batch_in_epoch) = (next, 0);
        (p.ep_loss, p.ep_correct, p.ep_count) = (0.0, 0, 0);
        p.seconds = seconds;
        self.checkpoint(&meta)?;
        self.plots();
        if stop_early {
            return Ok(Some(End::EarlyStopped));
        }
        let more = epoch + 1 < self.epochs.len();
        Ok((self.stop_due() && more).then_some(End::Stopped))
    }

    /// A stop asked for (`train.stop_after_steps`, a first SIGINT/SIGTERM, an observer) ends
    /// the run after the step, with a checkpoint at it.
    fn stop_due(&self) -> bool {
        let step = self.prog.step;
        (self.cfg.train.stop_after_steps > 0 && step >= self.cfg.train.stop_after_steps)
            || crate::interrupt::requested().is_some()
            || self.rep.stop_asked
    }

    fn checkpoint_due(&self) -> bool {
        self.cfg.train.checkpoint_every > 0
            && self
                .prog
                .step
                .is_multiple_of(self.cfg.train.checkpoint_every)
    }

    /// A checkpoint of the run now, holding the model's `model.toml` (`meta`: its kind and
    /// shape; truncated ranks are read from the tensors' shapes when it is loaded).
    fn checkpoint(&mut self, meta: &str) -> crate::Result<()> {
        if !self.writer {
            return Ok(());
        }
        self.host_current()?;
        let state = self.stepper.optimizer.state(&mut self.model);
        let run = checkpoint::RunState {
            run_id: &self.run_id,
            config_toml: &self.cfg.config_toml,
            model_toml: meta,
            progress: &self.prog,
            rank: &self.stepper.rank,
        };
        let path = checkpoint::save(
            &self.cfg.train.out_dir,
            &run,
            &self.model,
            &state,
            self.cfg.train.keep_checkpoints,
        )?;
        // The run it replaced (--overwrite) is deleted once this one can be resumed.
        self.run_dir.as_ref().map_or(Ok(()), RunDir::keep_new_run)?;
        self.rep.event(&Event::Checkpoint {
            step: self.prog.step,
            path: &path,
        });
        Ok(())
    }

    /// The device's parameters and moments into the host model and optimiser, if a device
    /// step ran since they were last copied (before whatever reads the host model).
    fn host_current(&mut self) -> crate::Result<()> {
        if let (Some(dev), false) = (self.device.as_mut(), self.host_in_step) {
            dev.copy_to_host(&mut self.model, &mut self.stepper.optimizer)?;
            self.host_in_step = true;
        }
        Ok(())
    }

    /// The model files of the run directory (tasks that save them; process 0 only).
    fn save_model_files(&self, meta: &str) -> crate::Result<()> {
        if self.task.saves_model() && self.writer {
            crate::files::save_model_files(
                &self.cfg.train.out_dir,
                &self.model.params(),
                meta,
                Some(&self.run_id),
            )?;
        }
        Ok(())
    }

    fn plots(&mut self) {
        if self.writer {
            let loss_name = self.task.loss_name();
            self.rep
                .plots(&self.cfg.train.out_dir, self.rank_active, loss_name);
        }
    }

    /// Seconds of training so far, over every sitting of the run.
    fn seconds(&self) -> f64 {
        self.base_seconds + self.t0.elapsed().as_secs_f64()
    }

    /// Sequence positions (or examples) seen before step `s`.
    fn tokens_at(&self, s: u64) -> u64 {
        let mut left = s;
        let mut tokens = 0;
        for &(ph, n) in &self.epochs {
            let k = left.min(n.map_or(u64::MAX, |n| n as u64));
            tokens += k * self.tokens_per_step[ph];
            left -= k;
        }
        tokens
    }

    /// The end: `ranks.md` (a rank-adaptive run that was not stopped), `report.json`, the
    /// previous run's removal under `--overwrite`, and the summary.
    fn finish(mut self, end: End) -> crate::Result<TrainSummary> {
        self.host_current()?;
        self.rep.event(&Event::TrainingEnded);
        let stopped = end == End::Stopped;
        let ranks_end = rank::layer_ranks(&self.model);
        let stage = match self.stepper.rank.stage {
            Stage::Early => "early",
            Stage::Late => "late",
        };
        if self.rank_active && !stopped && self.writer {
            write_rank_report(
                &self.cfg.train.out_dir,
                &self.prog,
                &ranks_end,
                stage,
                self.initial_params,
                &self.model,
                &mut self.rep,
            )?;
        }
        let med = median(&mut self.step_ms);
        let batch_size = self.phases.last().map_or(0, |p| p.batch_size);
        let bytes = self.model.bytes(&self.st);
        let mut summary = TrainSummary {
            out_dir: self.cfg.train.out_dir.clone(),
            epochs: self.epochs.len(),
            steps: self.prog.step,
            batch_size,
            phase_batch_sizes: self.phases.iter().map(|p| p.batch_size).collect(),
            tokens: self.tokens_at(self.prog.step),
            final_valid: self.final_valid.clone(),
            best_valid: self.best.0,
            best_epoch: self.best.1,
            majority_accuracy: self.task.majority_accuracy(),
            params: self.model.num_params(),
            initial_params: self.initial_params,
            dense_params: self.rep.dense_params,
            seconds: self.seconds(),
            median_step_ms: med,
            examples_per_s: if med > 0.0 {
                batch_size as f64 / (med / 1e3)
            } else {
                0.0
            },
            peak_rss_bytes: peak_rss_bytes(),
            machine: super::Machine {
                gpu: self.device.as_ref().map(|d| d.describe()),
                ..super::Machine::this()
            },
            param_bytes: bytes.params + bytes.grads,
            optimizer_bytes: self.stepper.optimizer.bytes(),
            state_bytes: bytes.state,
            ranks_start: std::mem::take(&mut self.prog.ranks_start),
            ranks_switch: self.prog.ranks_switch.take(),
            ranks_end,
            rank_active: self.rank_active,
            rank_stage: stage.into(),
            stopped,
            interrupted: crate::interrupt::requested().filter(|_| stopped),
            early_stopped: end == End::EarlyStopped,
            extra: self.task.report_extra(&self.model, &self.st),
        };
        if let Some(dp) = &self.stepper.data_parallel {
            crate::distributed::report(&mut summary, dp, &self.step_ms);
        }
        if self.writer {
            crate::files::write_atomic(
                &self.cfg.train.out_dir.join("report.json"),
                serde_json::to_string_pretty(&summary)?.as_bytes(),
            )?;
        }
        self.run_dir.as_ref().map_or(Ok(()), RunDir::keep_new_run)?;
        self.rep.event(&Event::Finished(&summary));
        Ok(summary)
    }
}

/// The run's length in steps: known when every epoch's is (streamed data gives none).
/// One step on a device ([`DeviceStep`]) on the batch loaded in `st`, reported as the CPU's
/// stepper reports its steps: the learning-rate scale from the stepper's schedule; the rank
/// objective's figures from the device's step when the schedule is active (the host's
/// controller gives the device its inputs), else from the host's controller (which then only
/// restates the loss and the constant gates' size); the step's time as its first phase (the
/// device runs it as one graph).
fn device_step<M: Trainable>(
    dev: &mut dyn DeviceStep<M>,
    stepper: &mut Stepper,
    model: &mut M,
    st: &mut M::State,
    (step, micro_batches): (u64, usize),
    load_next: &mut dyn FnMut(&mut M::State) -> crate::Result<bool>,
) -> crate::Result<Option<StepReport>> {
    let t0 = Instant::now();
    let lr_scale = stepper.schedule.scale(step);
    let rank_step = crate::device::rank_step(&stepper.rank, step);
    let s = if micro_batches <= 1 {
        dev.step(st, step, lr_scale, rank_step)?
    } else {
        // The CPU's `Stepper::step_accumulated` on the device: micro-batch i (the first is
        // loaded) with dropout step step·k + i; the step is dropped if the data ends inside it.
        for index in 0..micro_batches {
            if index > 0 && !load_next(st)? {
                return Ok(None);
            }
            let dropout_step = step * micro_batches as u64 + index as u64;
            dev.accumulate(
                st,
                comera_cuda::engine::Micro {
                    index,
                    dropout_step,
                },
            )?;
        }
        dev.apply_accumulated(step, lr_scale, rank_step)?
    };
    for (what, value) in [("loss", s.loss), ("gradient norm", s.grad_norm)] {
        if !value.is_finite() {
            return Err(comera_optim::StepError::diverged(what, value, step).into());
        }
    }
    let objective = match s.objective {
        Some(o) => crate::device::objective(s.loss, o),
        None => stepper.rank.apply(model, s.loss, step),
    };
    Ok(Some(StepReport {
        stats: StepStats {
            loss: s.loss,
            correct: s.correct,
            count: s.count,
            terms: None,
        },
        objective,
        grad_norm: s.grad_norm,
        lr_scale,
        phases: [t0.elapsed(), Duration::ZERO, Duration::ZERO],
        comm: Duration::ZERO,
        // The CPU pool does not take part in a device step.
        pool_idle: Duration::ZERO,
    }))
}

fn total_steps(epochs: &[(usize, Option<usize>)]) -> Option<u64> {
    epochs
        .iter()
        .map(|e| e.1.map(|n| n as u64))
        .sum::<Option<u64>>()
}

/// The rank schedule with fractions of the run made step counts, now that its length (`total`
/// steps, unknown for streamed data) is known.
fn resolve_rank_schedule(
    rank_cfg: rank::RankConfig,
    total: Option<u64>,
) -> crate::Result<rank::RankConfig> {
    Ok(match total {
        Some(total) => rank_cfg.resolved(total),
        None if rank_cfg.enabled && rank_cfg.has_fractions() => {
            return Err(crate::config::ConfigError::new(
                "rank",
                "late_after_fraction / gates_after_fraction need the run's length, which streamed data does not give before the run; set late_after_epochs / gates_after_steps",
            )
            .into())
        }
        None => rank_cfg,
    })
}

/// The learning rate's schedule over `total` steps; a fresh run (not resumed) is warned of a
/// warm-up or a rank schedule that does not fit its length.
fn lr_schedule(
    train: &crate::config::LoopFields,
    rank_cfg: &rank::RankConfig,
    total: Option<u64>,
    epochs: usize,
    fresh: bool,
    rep: &mut Reporter,
) -> Schedule {
    if let Some(total) = total.filter(|_| rank_cfg.enabled && fresh) {
        for w in rank_schedule_warnings(rank_cfg, total, epochs) {
            rep.say(w);
        }
    }
    let (warmup, warmup_warning) = warmup_for_run(train.warmup_steps, total);
    if let Some(w) = warmup_warning.filter(|_| fresh) {
        rep.say(w);
    }
    Schedule {
        warmup,
        total: total.unwrap_or(u64::MAX),
        decay: train.decay,
    }
}

/// The warm-up the learning-rate schedule uses for a run of `total` steps: `warmup_steps`, or,
/// when that is not shorter than the run (its learning rate would never reach its peak), a
/// tenth of the run, with a warning that says so.
fn warmup_for_run(warmup_steps: u64, total: Option<u64>) -> (u64, Option<String>) {
    match total {
        Some(total) if warmup_steps > 0 && warmup_steps >= total => {
            let clamped = total / 10;
            (
                clamped,
                Some(format!(
                    "warning: train.warmup_steps = {warmup_steps} is not shorter than the run ({total} steps): the learning rate would never reach its peak; warming up over {clamped} steps (a tenth of the run) instead"
                )),
            )
        }
        _ => (warmup_steps, None),
    }
}

/// Refuses to resume a run that ended cleanly (its `report.json` says it was not stopped),
/// before anything in its directory is touched.
fn refuse_finished(out: &std::path::Path, epochs: usize, steps: u64) -> crate::Result<()> {
    let ended = comera_data::read_regular_to_string(&out.join("report.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|r| r["stopped"] == false);
    if ended {
        return Err(Error::run(format!(
            "{}: the run finished ({epochs} epochs, {steps} steps); nothing to resume. To train it further: comera train --resume {} --extend-epochs N",
            out.display(),
            out.display()
        )));
    }
    Ok(())
}

/// The optimiser and the rank schedule, fresh or as `resume` left them (the checkpoint's
/// possibly truncated ranks are loaded first: the optimiser's state follows them), and the
/// progress to go on from; a device engine gets the checkpoint's state too.
fn restore<M: Trainable>(
    model: &mut M,
    optim: comera_optim::AdamWConfig,
    galore: Option<comera_optim::GaLoreConfig>,
    rank_cfg: &comera_optim::rank::RankConfig,
    resume: Option<&checkpoint::Checkpoint>,
    device: Option<&mut Box<dyn DeviceStep<M>>>,
) -> crate::Result<(Optimizer, RankController, Progress)> {
    if let Some(ck) = resume {
        ck.load_params(model)?;
    }
    let mut optimizer = Optimizer::new(optim, galore, model);
    Ok(match resume {
        Some(ck) => {
            optimizer
                .restore(&ck.optimizer, &mut |n, b| ck.opt_fill(n, b), model)
                .map_err(|e| Error::run_with(ck.path.display().to_string(), e))?;
            if let Some(dev) = device {
                // The checkpoint's parameters, moments and step count, onto the device.
                dev.copy_from_host(model, &optimizer)?;
            }
            (optimizer, ck.rank.clone(), ck.progress.clone())
        }
        None => {
            let rank = RankController::new(rank_cfg, model);
            let prog = Progress {
                ranks_start: rank::layer_ranks(model),
                ..Progress::default()
            };
            (optimizer, rank, prog)
        }
    })
}

/// Each epoch's phase index and step count (None: a streamed epoch of unknown length), with
/// `accumulate` micro-batches a step; epochs are numbered across phases.
fn plan_epochs<T: Task>(
    task: &mut T,
    accumulate: usize,
) -> crate::Result<Vec<(usize, Option<usize>)>> {
    let phases = task.phases().to_vec();
    let mut epochs = Vec::new();
    for (i, ph) in phases.iter().enumerate() {
        let full = task
            .batches_per_epoch(&micro_phase(ph, accumulate))?
            .map(|n| n / accumulate);
        let per_epoch = match (ph.max_steps_per_epoch.unwrap_or(0), full) {
            (0, f) => f,
            (m, Some(f)) => Some(m.min(f)),
            (m, None) => Some(m),
        };
        epochs.extend(std::iter::repeat_n((i, per_epoch), ph.epochs));
    }
    Ok(epochs)
}

/// The phase as the task sees it under gradient accumulation: batches of the micro-batch size.
fn micro_phase(phase: &Phase, accumulate: usize) -> Phase {
    Phase {
        batch_size: phase.batch_size / accumulate,
        ..phase.clone()
    }
}

/// Settings of the rank schedule that cannot take effect in a run of `total` steps over
/// `epochs` epochs, each a warning naming its field: a gate hold to the run's end (the gates
/// never train, no rank shrinks), a stage switch after the last epoch.
fn rank_schedule_warnings(rank: &rank::RankConfig, total: u64, epochs: usize) -> Vec<String> {
    let mut out = Vec::new();
    if rank.gates_after_steps >= total {
        out.push(format!(
            "warning: rank.gates_after_steps = {} holds the gates for the whole run ({total} steps): no rank will shrink; set it below {total} (e.g. {})",
            rank.gates_after_steps,
            total / 10
        ));
    }
    if rank.late_after_epochs > 0 && rank.late_after_epochs >= epochs && rank.plateau_steps == 0 {
        out.push(format!(
            "warning: rank.late_after_epochs = {} is not before the run's last epoch ({epochs} epochs): the late stage will not start",
            rank.late_after_epochs
        ));
    }
    if rank.late_after_steps >= total && rank.plateau_steps == 0 {
        out.push(format!(
            "warning: rank.late_after_steps = {} is not before the run's end ({total} steps): the late stage will not start",
            rank.late_after_steps
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{rank_schedule_warnings, warmup_for_run};
    use comera_optim::rank::RankConfig;

    #[test]
    fn a_hold_or_a_switch_past_the_run_is_a_warning_naming_the_field() {
        let cfg = RankConfig {
            gates_after_steps: 320,
            late_after_epochs: 3,
            ..RankConfig::default()
        };
        let w = rank_schedule_warnings(&cfg, 168, 3);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("rank.gates_after_steps = 320") && w[0].contains("168 steps"));
        assert!(w[1].contains("rank.late_after_epochs = 3"));
        assert!(rank_schedule_warnings(&cfg, 3180, 5).is_empty());
        // Fractions resolve inside any run: no warning, whatever its length.
        let frac = RankConfig {
            gates_after_fraction: 0.1,
            late_after_fraction: 0.2,
            ..RankConfig::default()
        };
        for total in [10, 168, 3180] {
            let r = frac.resolved(total);
            assert!(r.gates_after_steps < r.late_after_steps && r.late_after_steps < total);
            assert!(rank_schedule_warnings(&r, total, 1).is_empty());
        }
        let late = RankConfig {
            late_after_steps: 200,
            ..RankConfig::default()
        };
        let w = rank_schedule_warnings(&late, 168, 3);
        assert!(w[0].contains("rank.late_after_steps = 200"), "{w:?}");
    }

    #[test]
    fn a_warmup_not_shorter_than_the_run_is_a_tenth_of_it_with_a_warning() {
        let (w, said) = warmup_for_run(100, Some(9));
        assert_eq!(w, 0);
        let said = said.expect("a warning");
        assert!(said.starts_with("warning: train.warmup_steps = 100") && said.contains("9 steps"));
        let (w, said) = warmup_for_run(100, Some(100));
        assert_eq!((w, said.is_some()), (10, true));
        assert_eq!(warmup_for_run(100, Some(101)), (100, None));
        assert_eq!(warmup_for_run(0, Some(5)), (0, None));
        // A streamed run (length unknown) keeps its warm-up.
        assert_eq!(warmup_for_run(100, None), (100, None));
    }
}
