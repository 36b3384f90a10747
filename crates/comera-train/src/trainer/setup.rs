//! From a config to a [`Setup`]: data prepared, model built (or initialised from another
//! run), memory checked; only then is the run directory opened, so a setup that fails never
//! touches a previous run under `--overwrite`.

use super::report::Reporter;
use super::{available_memory_bytes, LoopSettings, RunSetup, Setup, Start};
use crate::config::ConfigError;
use crate::config::{AnyRunConfig, DistillConfig, DlrmRunConfig, Phase, RunConfig};
use crate::data::{prepare, CorpusData, PreparedData};
use crate::device::{check_run, CudaEncoder, DeviceRun, DeviceStep, RunShape};
use crate::error::{Error, IoContext};
use crate::files::DlrmMeta;
use crate::task::{CtrTask, EncoderData, EncoderTask};
use comera_dlrm::Dlrm;
use comera_layers::Model;
use comera_model::Encoder;
use comera_optim::rank::RankConfig;
use std::sync::Arc;

/// Refuses an encoder config whose training memory in some phase (estimated before anything
/// is allocated, even the data) exceeds what the machine has; warns of ranks no layer can use.
fn check_encoder_fits(cfg: &RunConfig, phases: &[Phase], rep: &mut Reporter) -> crate::Result<()> {
    let lay = cfg.model.validate()?;
    let available = available_memory_bytes();
    for p in phases {
        cfg.model
            .estimate_memory(&lay, p.batch_size, p.seq_len)
            .check(
                available,
                &format!("training at batch {} × {} tokens", p.batch_size, p.seq_len),
            )?;
    }
    for w in &lay.warnings {
        rep.say(format!("warning: {w}"));
    }
    Ok(())
}

/// The encoder's data: a corpus packed for every phase's sequence length (masked LM), or
/// labelled examples tokenised at the model's.
fn encoder_data(
    cfg: &RunConfig,
    phases: &[Phase],
    rep: &mut Reporter,
) -> crate::Result<EncoderData> {
    Ok(if cfg.data.source.is_corpus() {
        let mut corpus = CorpusData::new(&cfg.data, cfg.train.seed)?;
        // Every phase's blocks in one pass over the corpus (or from the cache).
        let seq_lens: Vec<usize> = phases.iter().map(|p| p.seq_len).collect();
        corpus.pack(&seq_lens, &mut |m| rep.say(m))?;
        EncoderData::Mlm(corpus)
    } else {
        if let Some(p) = phases.iter().find(|p| p.seq_len != cfg.model.seq_len) {
            return Err(ConfigError::new(
                "train.phases",
                format!(
                    "seq_len {} differs from model.seq_len {}; only corpus (masked-LM) runs change the sequence length",
                    p.seq_len, cfg.model.seq_len
                ),
            )
            .into());
        }
        let d: PreparedData = prepare(&cfg.data, cfg.model.seq_len, cfg.train.seed)?;
        rep.say(format!("data  {}", d.summary));
        EncoderData::Classify(d)
    })
}

/// The `[distill]` teacher, loaded and checked against the data: the same vocabulary file, and
/// the same labels in the same order for its logits. Its weights' digest and the resolved layer
/// map are recorded in `resolved`; a resumed run (whose config has the digest) refuses a
/// teacher that changed. The teacher runs forward only, so its blocks are recomputed (it keeps
/// just each block's output, which the hidden-state term reads).
fn load_teacher(
    ds: &DistillConfig,
    student: &comera_model::EncoderConfig,
    data: &EncoderData,
    vocab: &std::path::Path,
    resolved: &mut RunConfig,
    rep: &mut Reporter,
) -> crate::Result<(Arc<Encoder>, comera_model::DistillLoss)> {
    let dir = ds.teacher.as_ref().expect("called for a teacher");
    let err = |msg: String| Error::model(format!("distill.teacher: {}: {msg}", dir.display()));
    let (mut teacher, meta) = crate::files::load_model(dir)
        .map_err(|e| Error::model_with(format!("distill.teacher: {}", dir.display()), e))?;
    let sha = crate::inputs::sha256_file(&dir.join(crate::files::MODEL_WEIGHTS))?;
    if let Some(recorded) = &ds.teacher_sha256 {
        if *recorded != sha {
            return Err(err(format!(
                "its weights are not the teacher this run started with (SHA-256 {sha}, the run recorded {recorded})"
            )));
        }
    }
    if let EncoderData::Classify(d) = data {
        if ds.logit_weight > 0.0 && meta.labels != d.label_names {
            return Err(err(format!(
                "the teacher predicts the labels {:?}, this data has {:?}: logit distillation needs the same labels in the same order (fine-tune the teacher on this data first, or set distill.logit_weight = 0)",
                meta.labels, d.label_names
            )));
        }
    }
    let read = |p: &std::path::Path| comera_data::read_regular(p).io(p, "cannot read");
    if read(&meta.vocab)? != read(vocab)? {
        return Err(err(format!(
            "its vocabulary {} is not this run's {}: the teacher must read the same token ids",
            meta.vocab.display(),
            vocab.display()
        )));
    }
    let layers = ds.layer_map(student.layers, teacher.cfg.layers)?;
    let recorded = resolved.distill.as_mut().expect("a [distill] table");
    recorded.teacher_sha256 = Some(sha);
    recorded.layers = layers.iter().map(|&(i, j)| [i, j]).collect();
    teacher.cfg.recompute_blocks = true;
    rep.say(format!(
        "teacher {}: {} layers, d_model {}, {} parameters; loss {}·CE + {}·KL(τ = {}) + {}·MSE over hidden states {:?} (student, teacher)",
        dir.display(),
        teacher.cfg.layers,
        teacher.cfg.d_model,
        teacher.num_params(),
        ds.task_weight,
        ds.logit_weight,
        ds.temperature,
        ds.hidden_weight,
        layers
    ));
    Ok((Arc::new(teacher), ds.loss(layers)))
}

/// An encoder run (classification, or masked LM on a corpus).
pub(super) fn encoder(
    cfg: &RunConfig,
    start: Start,
    rep: &mut Reporter,
) -> crate::Result<Setup<EncoderTask>> {
    let phases = cfg.phases();
    check_encoder_fits(cfg, &phases, rep)?;
    let data = encoder_data(cfg, &phases, rep)?;
    let (mut resolved, vocab) = resolve_for_data(cfg, &data)?;
    let mcfg = resolved.model.clone();
    let teacher = match &cfg.distill {
        Some(ds) if ds.teacher.is_some() => {
            Some(load_teacher(ds, &mcfg, &data, &vocab, &mut resolved, rep)?)
        }
        _ => None,
    };
    // A resumed run keeps writing the config it was created with.
    let config_toml = match start.config_toml() {
        Some(text) => text.to_string(),
        None => resolved.to_toml(),
    };
    if let Some(ck) = start.checkpoint() {
        match ck.config()? {
            AnyRunConfig::Encoder(c) if c.model == mcfg => {}
            _ => return Err(Error::run(format!(
                "{}: the checkpoint's [model] differs from what its run's data gives now (labels or vocabulary changed?)",
                ck.path.display()
            ))),
        }
    }
    let out = cfg.train.out_dir.clone();
    // Everything that can fail is done before the run directory is opened (which, under
    // --overwrite, moves the previous run aside).
    let mut model = Encoder::new(&mcfg, cfg.train.seed)?;
    let mut head_given = false;
    if let (None, Some(dir)) = (start.checkpoint(), &cfg.train.init_from) {
        head_given = init_from_run(&mut model, dir, cfg, &data, teacher.as_ref(), rep)?;
    }
    if let (Some((t, _)), Some(ds)) = (&teacher, &cfg.distill) {
        if !head_given && start.checkpoint().is_none() {
            init_head_from_teacher(&mut model, t, ds, &data, rep);
        }
    }
    if let Some((t, loss)) = &teacher {
        // The checks each state's attachment makes, before the run directory opens.
        loss.check(&model, t)?;
    }
    rep.say(format!(
        "model {} layers, d_model {}: {}",
        mcfg.layers,
        mcfg.d_model,
        mcfg.validate()?.describe()
    ));
    if cfg.galore.is_some() && cfg.rank.enabled {
        rep.say(
            "note  GaLore run: rank gates are trained, but pruned slices are not truncated"
                .to_string(),
        );
    }
    cfg.rank.check_layers(&model).map_err(ConfigError::from)?;
    // Each phase's batch shape as a device plans it: batch (a micro-batch's under gradient
    // accumulation), tokens, masked-LM rows per sequence.
    let micro_batches = cfg.train.accumulate_steps.max(1);
    let shapes: Vec<(usize, usize, usize)> = phases
        .iter()
        .map(|p| {
            let rows = match &data {
                EncoderData::Mlm(d) => d.masker.max_selected_per_row(p.seq_len),
                EncoderData::Classify(_) => 0,
            };
            (p.batch_size / micro_batches, p.seq_len, rows)
        })
        .collect();
    let device = encoder_device(cfg, &shapes, &model, teacher.is_some(), rep)?;
    let (run_dir, resume) = start.open(&out, &config_toml)?;
    let vocab = match &run_dir {
        Some(_) => own_vocab(&out, &vocab)?,
        None => vocab,
    };
    let t = &cfg.train;
    Ok(Setup {
        task: EncoderTask {
            data,
            phases,
            model_cfg: mcfg.clone(),
            vocab,
            seed: t.seed,
            procs: std::cell::RefCell::new(crate::distributed::Processes::world()),
            teacher,
        },
        run: RunSetup {
            model,
            optim: cfg.optim.clone(),
            galore: cfg.galore.clone(),
            rank_cfg: cfg.rank.clone(),
            clip_norm: cfg.optim.clip_norm,
            gate_threshold: mcfg.threshold,
            settings: LoopSettings::new(t.loop_fields(), config_toml),
            resume,
            run_dir,
            device,
        },
    })
}

/// The encoder's step engine on `train.device` when that is not the CPU: what the device does
/// not do yet is refused, the device opened and the step planned there, before the run
/// directory is touched.
fn encoder_device(
    cfg: &RunConfig,
    shapes: &[(usize, usize, usize)],
    model: &Encoder,
    teacher: bool,
    rep: &mut Reporter,
) -> crate::Result<Option<Box<dyn DeviceStep<Encoder>>>> {
    let device = cfg.train.device;
    if !device.is_cuda() {
        return Ok(None);
    }
    check_run(
        device,
        RunShape {
            galore: cfg.galore.is_some(),
            processes: crate::distributed::processes().1,
            teacher,
        },
    )?;
    let rank = comera_optim::rank::RankController::new(&cfg.rank, model);
    let (batch, seq_len, mlm_rows_per_seq) = shapes[0];
    let run = DeviceRun {
        device,
        optim: cfg.optim.clone(),
        batch,
        seq_len,
        seed: cfg.train.seed,
        rank: crate::device::rank_settings(&rank),
        mlm_rows_per_seq,
        later_phases: shapes[1..].to_vec(),
    };
    let engine = CudaEncoder::new(&run, model)?;
    rep.say(format!(
        "device {}: the whole step as one CUDA graph",
        engine.describe()
    ));
    Ok(Some(Box::new(engine)))
}

/// The config as the data resolves it (the labels found, the model's label count) and the
/// vocabulary file; refuses a `model.vocab_size` other than the vocabulary's.
fn resolve_for_data(
    cfg: &RunConfig,
    data: &EncoderData,
) -> crate::Result<(RunConfig, std::path::PathBuf)> {
    let (vocab_size, vocab) = match data {
        EncoderData::Classify(d) => (d.tokenizer.vocab_size(), d.vocab.clone()),
        EncoderData::Mlm(d) => (d.tokenizer.vocab_size(), d.vocab.clone()),
    };
    let mut mcfg = cfg.model.clone();
    if mcfg.vocab_size != vocab_size {
        return Err(ConfigError::new(
            "model.vocab_size",
            format!(
                "{} but the vocabulary {} has {vocab_size} tokens",
                mcfg.vocab_size,
                vocab.display()
            ),
        )
        .into());
    }
    let mut resolved = cfg.clone();
    if let EncoderData::Classify(d) = data {
        mcfg.num_labels = d.label_names.len();
        resolved.data = d.data.clone();
    }
    resolved.model = mcfg;
    Ok((resolved, vocab))
}

/// `train.init_from`: the encoder's body from the run in `dir`, and its classifier head when
/// it was trained on the same labels (whether it was; otherwise what the head will be is
/// said).
fn init_from_run(
    model: &mut Encoder,
    dir: &std::path::Path,
    cfg: &RunConfig,
    data: &EncoderData,
    teacher: Option<&(Arc<Encoder>, comera_model::DistillLoss)>,
    rep: &mut Reporter,
) -> crate::Result<bool> {
    let init_err = |e: crate::error::BoxError| {
        Error::model_with(format!("train.init_from: {}", dir.display()), e)
    };
    let (pre, meta) = crate::files::load_model(dir).map_err(|e| init_err(e.into()))?;
    model.init_body_from(&pre).map_err(|e| init_err(e.into()))?;
    rep.say(format!(
        "init  encoder from {} ({} parameters)",
        dir.display(),
        pre.num_params()
    ));
    // A classifier of the same labels goes on with its head too; of other labels, its
    // head cannot serve this data: a fresh one is trained, and that is said.
    let (EncoderData::Classify(d), comera_model::HeadKind::Classifier) = (data, pre.cfg.head)
    else {
        return Ok(false);
    };
    if meta.labels == d.label_names && model.cfg.head == pre.cfg.head {
        model.init_head_from(&pre).map_err(|e| init_err(e.into()))?;
        rep.say(format!(
            "init  classifier head from {} (the same labels {:?})",
            dir.display(),
            meta.labels
        ));
        return Ok(true);
    }
    // With a teacher of this data's labels the head comes from it (said below).
    let instead = match (teacher, &cfg.distill) {
        (Some((t, _)), Some(ds))
            if ds.init_head && ds.logit_weight > 0.0 && t.cfg.num_labels == d.label_names.len() =>
        {
            "its head is not used"
        }
        _ => "a fresh head is trained on its encoder",
    };
    rep.say(format!(
        "note  {}'s classifier head is for the labels {:?}, this data's are {:?}: {instead}",
        dir.display(),
        meta.labels,
        d.label_names
    ));
    Ok(false)
}

/// `distill.init_head`: a fresh student's classifier head from the teacher's, when the teacher
/// predicts this data's labels and its logits are distilled.
fn init_head_from_teacher(
    model: &mut Encoder,
    teacher: &Encoder,
    ds: &DistillConfig,
    data: &EncoderData,
    rep: &mut Reporter,
) {
    let same_labels = match data {
        EncoderData::Classify(d) => {
            teacher.cfg.num_labels == d.label_names.len() && ds.logit_weight > 0.0
        }
        EncoderData::Mlm(_) => false,
    };
    if !(ds.init_head && same_labels) {
        return;
    }
    let dir = ds.teacher.as_ref().expect("a teacher").display();
    match model.init_head_from(teacher) {
        Ok(()) => rep.say(format!("init  classifier head from the teacher {dir}")),
        Err(e) => rep.say(format!(
            "note  the teacher's head has another layout ({}: {}): the student's head starts fresh",
            e.field, e.msg
        )),
    }
}

/// The run's own copy of the vocabulary in `out`, written once; `model.toml` names it by its
/// place in the run, so a run directory copied elsewhere predicts without the file it was
/// trained from.
fn own_vocab(out: &std::path::Path, vocab: &std::path::Path) -> crate::Result<std::path::PathBuf> {
    let own = out.join(crate::files::RUN_VOCAB);
    if !own.exists() {
        let bytes = comera_data::read_regular(vocab).io(vocab, "cannot read")?;
        crate::files::write_atomic(&own, &bytes)?;
    }
    Ok(std::path::PathBuf::from(crate::files::RUN_VOCAB))
}

/// Refuses a DLRM whose training memory (estimated before the model is built) exceeds what
/// the machine has.
fn check_dlrm_fits(
    cfg: &DlrmRunConfig,
    prepared: &comera_dlrm::data::Prepared,
) -> crate::Result<()> {
    let batch = cfg.train.batch_size;
    let need = cfg
        .dlrm
        .estimate_memory_bytes(prepared.n_dense, &prepared.table_sizes, batch);
    let available = available_memory_bytes();
    if need > available {
        const GIB: f64 = (1u64 << 30) as f64;
        return Err(Error::run(format!(
            "training the DLRM at batch {} needs about {:.1} GiB, but {:.1} GiB are available; reduce dlrm.embedding_dim, dlrm.ttm_rank, the MLP widths or train.batch_size",
            batch,
            need / GIB,
            available / GIB
        )));
    }
    Ok(())
}

/// A DLRM run on click-through data.
pub(super) fn dlrm(
    cfg: &DlrmRunConfig,
    start: Start,
    rep: &mut Reporter,
) -> crate::Result<Setup<CtrTask>> {
    let prepared = comera_dlrm::data::prepare(&cfg.data, cfg.train.seed)
        .map_err(|e| Error::DlrmData(e.into()))?;
    if prepared.valid.is_empty() {
        return Err(Error::data(format!(
            "data: no validation examples (data.valid_fraction = {}, data.max_valid = {}); the run could not be evaluated",
            cfg.data.valid_fraction,
            cfg.data.max_valid
        )));
    }
    rep.say(format!("data  {}", prepared.summary));
    let config_toml = match start.config_toml() {
        Some(text) => text.to_string(),
        None => cfg.to_toml(),
    };
    let t = &cfg.train;
    check_dlrm_fits(cfg, &prepared)?;
    let model = Dlrm::new(
        &cfg.dlrm,
        prepared.n_dense,
        &prepared.field_names,
        &prepared.table_sizes,
        t.seed,
    )
    .map_err(|e| Error::model_with("dlrm", e))?;
    if let Some(r) = &cfg.rank {
        r.check_layers(&model).map_err(ConfigError::from)?;
    }
    let (run_dir, resume) = start.open(&t.out_dir, &config_toml)?;
    rep.say(format!(
        "model DLRM, dim {}, bottom {:?}, top {:?}: {} parameters; tables {} parameters ({} as dense tables, {:.1}x smaller)",
        cfg.dlrm.embedding_dim,
        cfg.dlrm.bottom_mlp,
        cfg.dlrm.top_mlp,
        model.num_params(),
        model.table_params(),
        model.dense_table_params(),
        model.dense_table_params() as f64 / model.table_params() as f64
    ));
    for (name, table) in prepared.field_names.iter().zip(&model.tables) {
        rep.say(format!("      {name}: {}", table.describe()));
    }
    let meta = DlrmMeta {
        run_id: None,
        weights_sha256: None,
        meta_sha256: None,
        kind: "dlrm".into(),
        model: cfg.dlrm.clone(),
        n_dense: prepared.n_dense,
        field_names: prepared.field_names.clone(),
        table_sizes: prepared.table_sizes.clone(),
        tables: Vec::new(),
        epoch: 0,
        step: 0,
    };
    Ok(Setup {
        task: CtrTask {
            train: std::cell::RefCell::new(prepared.train),
            valid: prepared.valid,
            phases: vec![Phase {
                seq_len: 1,
                batch_size: t.batch_size,
                epochs: t.epochs,
                max_steps_per_epoch: Some(t.max_steps_per_epoch),
            }],
            meta,
            seed: t.seed,
            save_model: t.save_model,
            procs: std::cell::RefCell::new(crate::distributed::Processes::world()),
        },
        run: RunSetup {
            model,
            optim: cfg.optim.clone(),
            galore: None,
            rank_cfg: cfg.rank.clone().unwrap_or(RankConfig {
                enabled: false,
                ..RankConfig::default()
            }),
            clip_norm: cfg.optim.clip_norm,
            gate_threshold: cfg.dlrm.gate_threshold,
            settings: LoopSettings::new(t.loop_fields(), config_toml),
            resume,
            run_dir,
            device: None,
        },
    })
}
