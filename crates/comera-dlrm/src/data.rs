//! Where a DLRM run's batches come from: an in-memory set shuffled each epoch (MovieLens,
//! Adult), a Criteo file streamed in file order, or the synthetic Criteo generator.

use crate::config::{CtrDataConfig, CtrSource};
use comera_data::ctr::{
    load_adult, load_movielens, shuffle, CatMapping, CriteoReader, CriteoSpec, CtrBatch, CtrData,
    CtrError, SynthCriteo, SynthSpec, UnknownMapping, CRITEO_CATS, CRITEO_DENSE,
};
use comera_data::{default_cache_dir, fetch, FetchError};
use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;

/// Why a DLRM run's data cannot be prepared or read; the fetch and CTR errors name the data
/// set or file, the others the `[data]` field.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error(transparent)]
    Fetch(#[from] FetchError),
    #[error(transparent)]
    Ctr(#[from] CtrError),
    /// `data.mapping` names no mapping (the message is whole: no source chain).
    #[error("data.mapping: {0}")]
    Mapping(UnknownMapping),
    /// A `[data]` field missing or unusable for the source.
    #[error("data.{field}: {reason}")]
    Field { field: &'static str, reason: String },
}

/// The training stream.
// One per run: the size difference between variants costs nothing worth a Box.
#[allow(clippy::large_enum_variant)]
pub enum TrainSource {
    Memory {
        data: CtrData,
        order: Vec<usize>,
        pos: usize,
    },
    Criteo {
        path: PathBuf,
        spec: CriteoSpec,
        reader: Option<CriteoReader<BufReader<File>>>,
        /// Malformed rows seen in earlier epochs' passes.
        malformed_before: u64,
    },
    Synthetic {
        spec: SynthSpec,
        cspec: CriteoSpec,
        gen: Option<SynthCriteo>,
        rows: usize,
        produced: usize,
    },
}

impl TrainSource {
    /// Rewinds for epoch `epoch` (0-based): a new shuffle, a reopened file, a new stream.
    pub fn start_epoch(&mut self, epoch: usize, seed: u64) -> Result<(), CtrError> {
        match self {
            TrainSource::Memory { order, pos, .. } => {
                for (i, o) in order.iter_mut().enumerate() {
                    *o = i;
                }
                shuffle(order, seed.wrapping_add(epoch as u64));
                *pos = 0;
            }
            TrainSource::Criteo {
                path,
                spec,
                reader,
                malformed_before,
            } => {
                if let Some(r) = reader.take() {
                    *malformed_before += r.malformed.count;
                }
                *reader = Some(CriteoReader::open(path, spec.clone())?);
            }
            TrainSource::Synthetic {
                spec,
                gen,
                produced,
                ..
            } => {
                *gen = Some(SynthCriteo::with_stream(spec.clone(), epoch as u64 + 1)?);
                *produced = 0;
            }
        }
        Ok(())
    }

    /// Fills the next full batch; `false` when the epoch has no full batch left.
    pub fn next_batch(&mut self, batch: &mut CtrBatch) -> Result<bool, CtrError> {
        match self {
            TrainSource::Memory { data, order, pos } => {
                if *pos + batch.batch > order.len() {
                    return Ok(false);
                }
                for j in 0..batch.batch {
                    batch.set_from(j, data, order[*pos + j]);
                }
                *pos += batch.batch;
                Ok(true)
            }
            TrainSource::Criteo { reader, .. } => {
                let r = reader.as_mut().expect("start_epoch opens the file");
                r.read_batch(batch)
            }
            TrainSource::Synthetic {
                cspec,
                gen,
                rows,
                produced,
                ..
            } => {
                if *produced + batch.batch > *rows {
                    return Ok(false);
                }
                gen.as_mut()
                    .expect("start_epoch makes the generator")
                    .fill_batch(cspec, batch);
                *produced += batch.batch;
                Ok(true)
            }
        }
    }

    /// Full batches per epoch when known in advance (not for a streamed file).
    pub fn steps_per_epoch(&self, batch: usize) -> Option<usize> {
        match self {
            TrainSource::Memory { data, .. } => Some(data.len() / batch),
            TrainSource::Criteo { .. } => None,
            TrainSource::Synthetic { rows, .. } => Some(rows / batch),
        }
    }

    /// The malformed-row report of a streamed file (None for other sources).
    pub fn malformed_summary(&self) -> Option<String> {
        match self {
            TrainSource::Criteo {
                reader,
                malformed_before,
                path,
                ..
            } => Some(match reader {
                Some(r) => r.malformed.summary(),
                None => format!(
                    "{}: {malformed_before} malformed rows in earlier passes",
                    path.display()
                ),
            }),
            _ => None,
        }
    }
}

/// A run's data.
pub struct Prepared {
    pub train: TrainSource,
    pub valid: CtrData,
    pub n_dense: usize,
    pub field_names: Vec<String>,
    pub table_sizes: Vec<usize>,
    pub summary: String,
}

fn criteo_sizes(cfg: &CtrDataConfig) -> Vec<usize> {
    if cfg.table_sizes.is_empty() {
        SynthSpec::criteo_like_sizes(cfg.total_rows)
    } else {
        cfg.table_sizes.clone()
    }
}

fn cap(d: CtrData, max: usize) -> CtrData {
    if max == 0 || d.len() <= max {
        d
    } else {
        d.subset(&(0..max).collect::<Vec<_>>())
    }
}

/// Loads or opens the configured data.
pub fn prepare(cfg: &CtrDataConfig, seed: u64) -> Result<Prepared, DataError> {
    let cache = cfg.cache_dir.clone().unwrap_or_else(default_cache_dir);
    let in_memory = |all: CtrData, what: &str| -> Prepared {
        let (train, valid) = all.split(cfg.valid_fraction, seed);
        let (train, valid) = (cap(train, cfg.max_train), cap(valid, cfg.max_valid));
        let summary = format!(
            "{what}: {} train / {} valid examples, positive rate {:.3} / {:.3}; fields {:?} with table sizes {:?}; dense features {:?}",
            train.len(),
            valid.len(),
            train.positive_rate(),
            valid.positive_rate(),
            train.field_names,
            train.table_sizes,
            train.dense_names
        );
        Prepared {
            n_dense: train.n_dense(),
            field_names: train.field_names.clone(),
            table_sizes: train.table_sizes.clone(),
            summary,
            valid,
            train: TrainSource::Memory {
                order: (0..train.len()).collect(),
                data: train,
                pos: 0,
            },
        }
    };
    match cfg.source {
        CtrSource::Movielens => {
            let inter = fetch("ml-100k-inter", &cache)?;
            let user = fetch("ml-100k-user", &cache)?;
            let item = fetch("ml-100k-item", &cache)?;
            let all = load_movielens(&inter, &user, &item, cfg.click_threshold, cfg.max_malformed)?;
            Ok(in_memory(
                all,
                "MovieLens-100K (click = rating ≥ threshold)",
            ))
        }
        CtrSource::Adult => {
            let path = fetch("adult", &cache)?;
            let all = load_adult(&path, "income")?;
            Ok(in_memory(all, "Adult (label income > 50K)"))
        }
        CtrSource::Criteo => {
            let Some(train) = cfg.train.clone() else {
                return Err(DataError::Field {
                    field: "train",
                    reason: "missing".into(),
                });
            };
            let Some(valid_path) = cfg.valid.clone() else {
                return Err(DataError::Field {
                    field: "valid",
                    reason: "the criteo source needs a validation file (streamed training data is not split)".into(),
                });
            };
            let spec = CriteoSpec {
                table_sizes: criteo_sizes(cfg),
                mapping: cfg
                    .mapping
                    .parse::<CatMapping>()
                    .map_err(DataError::Mapping)?,
                max_malformed: cfg.max_malformed,
            };
            let mut vr = CriteoReader::open(&valid_path, spec.clone())?;
            let valid = vr.read_all(cfg.max_valid)?;
            let summary = format!(
                "Criteo files: train {} (streamed), valid {} ({} rows, positive rate {:.3}; {}); table sizes {:?}",
                train.display(),
                valid_path.display(),
                valid.len(),
                valid.positive_rate(),
                vr.malformed.summary(),
                spec.table_sizes
            );
            let (dn, cn) = CriteoSpec::names();
            Ok(Prepared {
                n_dense: dn.len(),
                field_names: cn,
                table_sizes: spec.table_sizes.clone(),
                summary,
                valid,
                train: TrainSource::Criteo {
                    path: train,
                    spec,
                    reader: None,
                    malformed_before: 0,
                },
            })
        }
        CtrSource::Synthetic => {
            let sizes = criteo_sizes(cfg);
            let spec = SynthSpec {
                table_sizes: sizes.clone(),
                zipf_s: cfg.zipf_s,
                missing: cfg.missing,
                seed,
            };
            let cspec = CriteoSpec {
                table_sizes: sizes.clone(),
                mapping: CatMapping::Modulo,
                max_malformed: 0,
            };
            let valid = SynthCriteo::with_stream(spec.clone(), u64::MAX)?
                .generate(&cspec, cfg.synthetic_valid);
            let summary = format!(
                "synthetic Criteo: {} train examples per epoch, {} valid (positive rate {:.3}); 26 tables, {} rows in total, Zipf s = {}: {:?}",
                cfg.synthetic_train,
                valid.len(),
                valid.positive_rate(),
                sizes.iter().sum::<usize>(),
                cfg.zipf_s,
                sizes
            );
            let (dn, cn) = CriteoSpec::names();
            debug_assert_eq!((dn.len(), cn.len()), (CRITEO_DENSE, CRITEO_CATS));
            Ok(Prepared {
                n_dense: dn.len(),
                field_names: cn,
                table_sizes: sizes,
                summary,
                valid,
                train: TrainSource::Synthetic {
                    spec,
                    cspec,
                    gen: None,
                    rows: cfg.synthetic_train,
                    produced: 0,
                },
            })
        }
    }
}
