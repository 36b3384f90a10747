//! The device seam's host side, without a GPU: the CPU engine put behind [`DeviceStep`] (its
//! own model and optimiser, reached only through the seam's copies, as a GPU's would be), and
//! a whole rank-adaptive run through the loop against the same run on the CPU. The run holds
//! the gates for its first steps, switches to the late stage, truncates several times, logs
//! every step, evaluates and checkpoints; every one of those reads the host model. Whatever
//! the loop forgot to copy back or to send to the device (a stale gate for the switch's size,
//! a truncation the device did not see, the hold or the stage not passed on) makes the two
//! runs part; they must agree bit for bit: the metrics log and the model file. And the same run
//! stopped on the seam (its checkpoint written from the seam's copies) and resumed on the CPU
//! is that run again.

use super::{run, setup, Reporter, Start};
use crate::config::RunConfig;
use crate::device::{DeviceError, DeviceStats, DeviceStep};
use comera_cuda::engine::{Micro, RankSettings, RankStep};
use comera_layers::ParamKind;
use comera_model::{Encoder, EncoderState};
use comera_optim::rank::{RankConfig, RankController, Stage};
use comera_optim::{Decay, Optimizer, Schedule, Stepper};
use std::path::Path;

/// The CPU engine behind the seam: the loop's host model and optimiser are not its own.
struct CpuBehindTheSeam {
    model: Encoder,
    optim: comera_optim::AdamWConfig,
    clip_norm: f32,
    stepper: Option<Stepper>,
    st: Option<EncoderState>,
    /// The batch shape the loop last set ([`DeviceStep::set_shape`]): every step's batch must
    /// have it, as a device's plan would need.
    shape: Option<(usize, usize)>,
    labels: Vec<usize>,
    mask: Vec<u32>,
    /// The open accumulated step's micro-batches as handed over: where each sits, and its
    /// ids, types, mask and labels.
    micro: Vec<(Micro, HostBatch)>,
}

/// A classifier batch's ids, types, mask and labels, copied.
type HostBatch = (Vec<u32>, Vec<u32>, Vec<u32>, Vec<usize>);

impl CpuBehindTheSeam {
    fn stepper(&mut self) -> &mut Stepper {
        self.stepper
            .as_mut()
            .expect("set_rank_schedule comes first (Loop::new)")
    }

    fn new(model: Encoder, optim: comera_optim::AdamWConfig, clip_norm: f32) -> Self {
        CpuBehindTheSeam {
            model,
            optim,
            clip_norm,
            stepper: None,
            st: None,
            shape: None,
            labels: Vec::new(),
            mask: Vec::new(),
            micro: Vec::new(),
        }
    }

    /// The batch in `st`, checked against the shape the loop set, as the fake's own copy.
    fn host_batch(&mut self, st: &EncoderState, what: &str) -> HostBatch {
        let batch = st.classifier_batch().expect("a classifier batch");
        let (b, n) = (batch.labels.len(), batch.ids.len());
        assert_eq!(
            self.shape,
            Some((b, n / b)),
            "{what}: a batch of another shape than the loop set"
        );
        crate::device::classifier_words(&batch, &mut self.mask, &mut self.labels);
        (
            batch.ids.to_vec(),
            batch.types.to_vec(),
            self.mask.clone(),
            self.labels.clone(),
        )
    }

    /// `batch` loaded into the fake's own state (made at the loop's shape on first use).
    fn load_own(&mut self, (ids, types, mask, labels): &HostBatch) -> EncoderState {
        let (b, t) = self.shape.expect("set_shape comes first");
        let model = &self.model;
        let mut own = self
            .st
            .take()
            .unwrap_or_else(|| model.state_for(b, t, 0).unwrap());
        own.load(ids, types, mask, labels).unwrap();
        own
    }
}

/// The host's schedule inputs for `step` given to `stepper`.
fn take_host_inputs(stepper: &mut Stepper, step: u64, lr_scale: f32, rank: Option<RankStep>) {
    // The run's schedule is constant: the host's scale is the stepper's own.
    assert_eq!(lr_scale, stepper.schedule.scale(step), "step {step}");
    if let Some(r) = rank {
        let c = &mut stepper.rank;
        c.cfg.gates_after_steps = if r.hold { u64::MAX } else { 0 };
        (c.stage, c.target_size) = match r.late_target {
            Some(s0) => (Stage::Late, Some(s0)),
            None => (Stage::Early, None),
        };
    }
}

/// A CPU step's report as a device gives it back.
fn device_stats(report: &comera_optim::StepReport, active: bool) -> DeviceStats {
    let o = report.objective;
    DeviceStats {
        loss: report.stats.loss,
        correct: report.stats.correct,
        count: report.stats.count,
        grad_norm: report.grad_norm,
        objective: active.then_some(comera_cuda::engine::DeviceObjective {
            size: o.size,
            size_l1: o.size_l1,
            branch: match o.branch {
                comera_optim::rank::Branch::Early => comera_cuda::engine::DeviceBranch::Early,
                comera_optim::rank::Branch::Loss => comera_cuda::engine::DeviceBranch::Loss,
                comera_optim::rank::Branch::Size => comera_cuda::engine::DeviceBranch::Size,
            },
            w_loss: o.w_loss,
            w_size: o.w_size,
        }),
    }
}

fn adam(o: &Optimizer) -> &comera_optim::AdamW {
    match o {
        Optimizer::AdamW(a) => a,
        Optimizer::GaLore(_) => unreachable!("no GaLore here"),
    }
}

impl DeviceStep<Encoder> for CpuBehindTheSeam {
    fn describe(&self) -> String {
        "the CPU behind the device seam".into()
    }

    fn step(
        &mut self,
        st: &EncoderState,
        step: u64,
        lr_scale: f32,
        rank: Option<RankStep>,
    ) -> Result<DeviceStats, DeviceError> {
        assert!(
            self.micro.is_empty(),
            "step {step}: an accumulated step is open"
        );
        let batch = self.host_batch(st, &format!("step {step}"));
        let mut own = self.load_own(&batch);
        let stepper = self.stepper.as_mut().unwrap();
        take_host_inputs(stepper, step, lr_scale, rank);
        let report = stepper.step(&mut self.model, &mut own, step).unwrap();
        self.st = Some(own);
        Ok(device_stats(&report, rank.is_some()))
    }

    fn accumulate(&mut self, st: &EncoderState, micro: Micro) -> Result<(), DeviceError> {
        if micro.index == 0 {
            // A step left open (its data ended) is dropped.
            self.micro.clear();
        }
        assert_eq!(micro.index, self.micro.len(), "micro-batches in order");
        let batch = self.host_batch(st, &format!("micro-batch {micro:?}"));
        self.micro.push((micro, batch));
        Ok(())
    }

    fn apply_accumulated(
        &mut self,
        step: u64,
        lr_scale: f32,
        rank: Option<RankStep>,
    ) -> Result<DeviceStats, DeviceError> {
        let micro = std::mem::take(&mut self.micro);
        let k = micro.len() as u64;
        for (i, (m, _)) in micro.iter().enumerate() {
            assert_eq!(
                m.dropout_step,
                step * k + i as u64,
                "step {step}: the CPU's dropout step for micro-batch {i}"
            );
        }
        let mut batches = micro.iter().map(|(_, b)| b);
        let mut own = self.load_own(batches.next().expect("a micro-batch"));
        let mut rest: Vec<&HostBatch> = batches.collect();
        rest.reverse();
        let stepper = self.stepper.as_mut().unwrap();
        take_host_inputs(stepper, step, lr_scale, rank);
        let mut load_next = |own: &mut EncoderState| {
            let (ids, types, mask, labels) = rest.pop().expect("k micro-batches");
            own.load(ids, types, mask, labels).unwrap();
            Ok(true)
        };
        let report = stepper
            .step_accumulated(&mut self.model, &mut own, step, k as usize, &mut load_next)
            .unwrap();
        self.st = Some(own);
        Ok(device_stats(&report, rank.is_some()))
    }

    fn copy_to_host(
        &mut self,
        model: &mut Encoder,
        optimizer: &mut Optimizer,
    ) -> Result<(), DeviceError> {
        model.clone_from(&self.model);
        let own = adam(&self.stepper().optimizer).clone();
        if let Optimizer::AdamW(a) = optimizer {
            (a.m, a.v, a.t) = (own.m, own.v, own.t);
        }
        Ok(())
    }

    fn copy_gates_to_host(&mut self, model: &mut Encoder) -> Result<(), DeviceError> {
        let mut gates = Vec::new();
        self.model.visit_params_mut(&mut |p| {
            if p.kind == ParamKind::RankGate {
                gates.push(p.value.clone());
            }
        });
        let mut gates = gates.into_iter();
        model.visit_params_mut(&mut |p| {
            if p.kind == ParamKind::RankGate {
                p.value = gates.next().unwrap();
            }
        });
        Ok(())
    }

    fn copy_from_host(
        &mut self,
        model: &Encoder,
        optimizer: &Optimizer,
    ) -> Result<(), DeviceError> {
        self.model.clone_from(model);
        let host = adam(optimizer).clone();
        if let Some(s) = self.stepper.as_mut() {
            s.optimizer = Optimizer::AdamW(host);
        }
        Ok(())
    }

    fn set_shape(&mut self, _model: &Encoder, st: &EncoderState) -> Result<(), DeviceError> {
        let shape = (st.batch(), st.seq_len());
        if self.shape != Some(shape) {
            // A new plan: the state for the new shape is made at the next step.
            self.st = None;
            self.shape = Some(shape);
        }
        Ok(())
    }

    fn set_rank_schedule(
        &mut self,
        model: &Encoder,
        settings: Option<RankSettings>,
    ) -> Result<(), DeviceError> {
        let Some(s) = settings else {
            panic!("this test runs the rank schedule");
        };
        let cfg = RankConfig {
            gamma: s.gamma,
            beta: s.beta,
            rho_loss: s.rho_loss,
            rho_size: s.rho_size,
            target_loss: s.target_loss,
            size_weight: s.size_weight,
            layer_prefix: s.layer_prefix.clone(),
            min_rank: s.min_rank,
            normalise_gates: s.normalise_gates,
            ..RankConfig::default()
        };
        let mut rc = RankController::new(&cfg, model);
        rc.s_ref = s.s_ref;
        let optimizer = Optimizer::new(self.optim.clone(), None, &mut self.model);
        let schedule = Schedule {
            warmup: 0,
            total: u64::MAX,
            decay: Decay::Constant,
        };
        let threshold = model.cfg.threshold;
        self.stepper = Some(Stepper::new(
            optimizer,
            rc,
            schedule,
            self.clip_norm,
            threshold,
        ));
        Ok(())
    }
}

/// A small rank-adaptive classifier run on sentiment-like texts in `dir`.
fn config(dir: &Path, out: &str) -> RunConfig {
    let words = [
        "the", "film", "was", "plot", "acting", "and", "really", "quite", "story",
    ];
    let mut vocab = vec![
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "great", "bad",
    ];
    vocab.extend(words);
    std::fs::write(dir.join("vocab.txt"), vocab.join("\n") + "\n").unwrap();
    let mut rows = vec!["sentence\tlabel".to_string()];
    for i in 0..160usize {
        let key = if i % 2 == 0 { "good" } else { "bad" };
        let body: Vec<&str> = (0..3 + i % 5)
            .map(|k| words[(i * 7 + k * 3) % words.len()])
            .collect();
        let label = if i % 2 == 0 { "pos" } else { "neg" };
        rows.push(format!(
            "{} {key} {}\t{label}",
            body.join(" "),
            words[i % 9]
        ));
    }
    std::fs::write(dir.join("train.tsv"), rows.join("\n") + "\n").unwrap();
    let d = dir.display();
    let text = format!(
        r#"
[data]
source = "tsv"
train = "{d}/train.tsv"
text_a = "sentence"
label = "label"
labels = ["neg", "pos"]
vocab = "{d}/vocab.txt"
valid_fraction = 0.2

[model]
vocab_size = {v}
seq_len = 12
d_model = 16
heads = 2
ffn = 32
layers = 1
dropout = 0.1
tt_linear = true
ttm_embedding = true
attn_tt = {{ in_modes = [4, 4], out_modes = [4, 4], rank = 4 }}
ffn_up_tt = {{ in_modes = [4, 4], out_modes = [8, 4], rank = 4 }}
ffn_down_tt = {{ in_modes = [8, 4], out_modes = [4, 4], rank = 4 }}
word_ttm = {{ vocab_modes = [3, 6], dim_modes = [4, 4], rank = 4 }}

[optim]
lr_cores = 0.01
lr_gates = 0.1
lr_other = 0.01
clip_norm = 1.0

[rank]
enabled = true
gamma = 1.0
truncate_every = 5
late_after_steps = 20
target_ratio = 0.5
gates_after_steps = 3
normalise_gates = false

[train]
epochs = 3
batch_size = 16
warmup_steps = 0
decay = "constant"
log_every = 1
checkpoint_every = 7
out_dir = "{d}/{out}"
"#,
        v = vocab.len()
    );
    RunConfig::from_toml(&dir.join("run.toml"), &text).unwrap()
}

/// `cfg`'s run, its steps on the CPU behind the seam when `seam`; the run's metrics log and
/// model file.
fn run_once(cfg: &RunConfig, seam: bool) -> (String, Vec<u8>) {
    run_once_unread(cfg, seam);
    read_run(cfg)
}

/// `cfg`'s run, its steps on the CPU behind the seam when `seam`.
fn run_once_unread(cfg: &RunConfig, seam: bool) {
    let mut rep = Reporter::new(Vec::new());
    rayon::scope(|_| {
        let mut s = setup::encoder(cfg, Start::Fresh(false), &mut rep).unwrap();
        if seam {
            s.run.device = Some(Box::new(CpuBehindTheSeam::new(
                s.run.model.clone(),
                s.run.optim.clone(),
                s.run.clip_norm,
            )));
        }
        run::run(s, rep).unwrap();
    });
}

/// `cfg`'s run stopped on the seam after `steps` steps (its checkpoint written from the seam's
/// copies) and resumed on the CPU to its end: its metrics log and model file.
fn stopped_on_the_seam_resumed_on_the_cpu(mut cfg: RunConfig, steps: u64) -> (String, Vec<u8>) {
    cfg.train.stop_after_steps = steps;
    run_once_unread(&cfg, true);
    super::resume(&cfg.train.out_dir).unwrap();
    read_run(&cfg)
}

/// The run's metrics log (without its timings) and model file.
fn read_run(cfg: &RunConfig) -> (String, Vec<u8>) {
    let out = &cfg.train.out_dir;
    // Timings differ from run to run: drop them from the records compared.
    let log = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let log = log
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            if let Some(o) = v.as_object_mut() {
                for k in ["tokens_per_s", "ms_per_step", "seconds", "peak_rss_bytes"] {
                    o.remove(k);
                }
            }
            v.to_string()
        })
        .collect::<Vec<_>>()
        .join("\n");
    (log, std::fs::read(out.join("model.safetensors")).unwrap())
}

#[test]
fn a_rank_adaptive_run_through_the_device_seam_is_the_cpu_run_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("comera-seam-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (cpu, seam) = (config(&dir, "cpu"), config(&dir, "seam"));
    let (cpu_log, cpu_model) = run_once(&cpu, false);
    let (seam_log, seam_model) = run_once(&seam, true);
    let count = |log: &str, kind: &str| log.matches(&format!("\"kind\":\"{kind}\"")).count();
    assert!(
        count(&cpu_log, "truncate") >= 2,
        "the run truncates: {cpu_log}"
    );
    assert_eq!(count(&cpu_log, "stage"), 1, "the run switches: {cpu_log}");
    for (c, s) in cpu_log.lines().zip(seam_log.lines()) {
        assert_eq!(c, s, "the seam's run parts from the CPU's");
    }
    assert_eq!(cpu_log.lines().count(), seam_log.lines().count());
    assert!(cpu_model == seam_model, "model files differ");
    // Stopped on the seam after a truncation and the switch, resumed on the CPU from the
    // checkpoint the seam's state was copied into: the CPU run again.
    let (half_log, half_model) = stopped_on_the_seam_resumed_on_the_cpu(config(&dir, "half"), 23);
    assert_eq!(half_log, cpu_log, "stopped on the seam, resumed on the CPU");
    assert!(
        half_model == cpu_model,
        "model files differ after the resume"
    );
    // The switch by a plateau of S instead (the controller reads S at each window's end, here
    // steps 12 and 23, between the truncations), with few log lines (each of which copies the
    // gates back).
    let plateau = |out: &str| {
        let mut c = config(&dir, out);
        (
            c.rank.late_after_steps,
            c.rank.plateau_steps,
            c.rank.plateau_tol,
        ) = (0, 11, 0.1);
        c.train.log_every = 50;
        c
    };
    let (cpu_log, cpu_model) = run_once(&plateau("cpu-plateau"), false);
    let (seam_log, seam_model) = run_once(&plateau("seam-plateau"), true);
    assert_eq!(count(&cpu_log, "stage"), 1, "the run switches: {cpu_log}");
    assert_eq!(seam_log, cpu_log, "the plateau run through the seam");
    assert!(cpu_model == seam_model, "model files differ (plateau)");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run of two phases (batch 16, then 8) through the seam: the loop sets the device's shape
/// when the run starts and when it enters the second phase (the fake refuses a batch of
/// another shape than the last one set), and the run is the CPU's bit for bit; stopped on the
/// seam inside the second phase and resumed on the CPU, it is that run again.
#[test]
fn a_run_of_two_phases_through_the_device_seam_is_the_cpu_run_bit_for_bit() {
    use comera_run::config::Phase;
    let dir = std::env::temp_dir().join(format!("comera-seam-phases-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let phased = |out: &str| {
        let mut c = config(&dir, out);
        c.train.phases = vec![
            Phase {
                seq_len: 12,
                batch_size: 16,
                epochs: 2,
                max_steps_per_epoch: None,
            },
            Phase {
                seq_len: 12,
                batch_size: 8,
                epochs: 1,
                max_steps_per_epoch: None,
            },
        ];
        c
    };
    let (cpu_log, cpu_model) = run_once(&phased("cpu"), false);
    let (seam_log, seam_model) = run_once(&phased("seam"), true);
    // 128 training examples: 2 epochs of 8 steps at batch 16, then one of 16 at batch 8,
    // each step logged.
    let steps = cpu_log.matches("\"kind\":\"train\"").count();
    assert_eq!(steps, 32, "both phases ran: {cpu_log}");
    assert_eq!(seam_log, cpu_log, "the two-phase run through the seam");
    assert!(cpu_model == seam_model, "model files differ (phases)");
    let (half_log, half_model) = stopped_on_the_seam_resumed_on_the_cpu(phased("half"), 20);
    assert_eq!(
        half_log, cpu_log,
        "stopped on the seam in phase 2, resumed on the CPU"
    );
    assert!(
        half_model == cpu_model,
        "model files differ after the resume (phases)"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Gradient accumulation through the seam (`train.accumulate_steps = 2`, batch 16 as two
/// micro-batches of 8): the loop hands the device each micro-batch with the CPU's dropout
/// step (the fake checks it) and then the update, and the rank-adaptive run (truncations, the
/// switch, checkpoints) is the CPU's bit for bit; stopped on the seam and resumed on the CPU,
/// it is that run again. A streamed epoch that ends inside a step drops it on both (the fake
/// drops the open micro-batches when the next step starts).
#[test]
fn an_accumulated_run_through_the_device_seam_is_the_cpu_run_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("comera-seam-accum-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let accumulated = |out: &str| {
        let mut c = config(&dir, out);
        c.train.accumulate_steps = 2;
        c
    };
    let (cpu_log, cpu_model) = run_once(&accumulated("cpu"), false);
    let (seam_log, seam_model) = run_once(&accumulated("seam"), true);
    // 128 training examples: 3 epochs of 8 steps of 16 (two micro-batches of 8), each logged.
    let steps = cpu_log.matches("\"kind\":\"train\"").count();
    assert_eq!(steps, 24, "every step ran: {cpu_log}");
    let count = |log: &str, kind: &str| log.matches(&format!("\"kind\":\"{kind}\"")).count();
    assert!(count(&cpu_log, "truncate") >= 2, "the run truncates");
    // Not the unaccumulated run: the micro-batches' dropout steps and weights make it another.
    let (plain_log, _) = run_once(&config(&dir, "plain"), false);
    assert_ne!(plain_log, cpu_log, "accumulation changes the run");
    assert_eq!(seam_log, cpu_log, "the accumulated run through the seam");
    assert!(cpu_model == seam_model, "model files differ (accumulation)");
    let (half_log, half_model) = stopped_on_the_seam_resumed_on_the_cpu(accumulated("half"), 13);
    assert_eq!(half_log, cpu_log, "stopped on the seam, resumed on the CPU");
    assert!(
        half_model == cpu_model,
        "model files differ after the resume (accumulation)"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
