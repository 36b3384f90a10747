//! Reference cases: safetensors files holding a layer's inputs, parameters, an upstream
//! gradient `dy` and the expected outputs and gradients (SPEC §6), made independently with
//! PyTorch. This crate loads them with every field checked, runs the engine's layer on them and
//! compares each tensor: a tensor passes when
//!   max|got − exp| ≤ tolerance × max(max|exp|, 1e-6).
//!
//! Here: [`RefCase`] (a loaded case, its typed metadata and tensors), [`Check`] and
//! [`Report`] (the comparisons of one run), and [`verify`], which runs every variant a case's
//! `kind` has. Modules (private; their entry points are re-exported here):
//! - `tt_linear`: [`verify_tt_linear`], a TT linear layer's forward and backward on one
//!   contraction path (or the planner's), checking y, dX, every core, gate and bias gradient
//!   and, when the case has them, the size measures;
//! - `ttm_embedding`: [`verify_ttm_embedding`], a TTM embedding's lookup (naive or optimised)
//!   and backward, checking y, every core and gate gradient and the size measures.

mod tt_linear;
mod ttm_embedding;

pub use tt_linear::verify_tt_linear;
pub use ttm_embedding::verify_ttm_embedding;

use comera_layers::{Compressible, Param};
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// Why a reference case could not be used; every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum RefCaseError {
    #[error("{file}: cannot read: {source}")]
    Io {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{file}: not a valid safetensors file: {msg}")]
    Format { file: PathBuf, msg: String },
    #[error("{file}: metadata field `{field}` is missing")]
    MissingMeta { file: PathBuf, field: String },
    #[error("{file}: metadata field `{field}` = {value:?}: expected {expected}")]
    BadMeta {
        file: PathBuf,
        field: String,
        value: String,
        expected: &'static str,
    },
    #[error("{file}: tensor `{name}` is missing")]
    MissingTensor { file: PathBuf, name: String },
    #[error("{file}: tensor `{name}` has shape {got:?}, expected {expected:?}")]
    TensorShape {
        file: PathBuf,
        name: String,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("{file}: tensor `{name}` has dtype {got}, expected {expected}")]
    TensorDtype {
        file: PathBuf,
        name: String,
        got: String,
        expected: &'static str,
    },
    #[error("{file}: kind `{kind}` is not supported yet")]
    Unsupported { file: PathBuf, kind: String },
    #[error("{file}: {msg}")]
    Invalid { file: PathBuf, msg: String },
}

/// A gated chain's (core values, gate values), as the layers' `from_parts` take them.
type ChainValues = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// One tensor of a case.
#[derive(Clone, Debug)]
pub enum TensorData {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

#[derive(Clone, Debug)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: TensorData,
}

/// A loaded reference case.
#[derive(Clone, Debug)]
pub struct RefCase {
    pub file: PathBuf,
    pub metadata: HashMap<String, String>,
    pub tensors: BTreeMap<String, Tensor>,
}

impl RefCase {
    pub fn load(file: &Path) -> Result<RefCase, RefCaseError> {
        let bytes = std::fs::read(file).map_err(|source| RefCaseError::Io {
            file: file.to_path_buf(),
            source,
        })?;
        Self::parse(file, &bytes)
    }

    /// Parses the bytes of a case file (`file` is only used in messages).
    pub fn parse(file: &Path, bytes: &[u8]) -> Result<RefCase, RefCaseError> {
        let fmt = |e: safetensors::SafeTensorError| RefCaseError::Format {
            file: file.to_path_buf(),
            msg: e.to_string(),
        };
        let (_, meta) = SafeTensors::read_metadata(bytes).map_err(fmt)?;
        let metadata = meta.metadata().clone().unwrap_or_default();
        let st = SafeTensors::deserialize(bytes).map_err(fmt)?;
        let mut tensors = BTreeMap::new();
        for (name, view) in st.iter() {
            let raw = view.data();
            let data = match view.dtype() {
                Dtype::F32 => TensorData::F32(
                    raw.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                ),
                Dtype::I64 => TensorData::I64(
                    raw.chunks_exact(8)
                        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                        .collect(),
                ),
                other => {
                    return Err(RefCaseError::TensorDtype {
                        file: file.to_path_buf(),
                        name: name.to_string(),
                        got: format!("{other:?}"),
                        expected: "F32 or I64",
                    })
                }
            };
            tensors.insert(
                name.to_string(),
                Tensor {
                    shape: view.shape().to_vec(),
                    data,
                },
            );
        }
        Ok(RefCase {
            file: file.to_path_buf(),
            metadata,
            tensors,
        })
    }

    /// The case's `kind` metadata.
    pub fn kind(&self) -> Result<&str, RefCaseError> {
        self.meta("kind")
    }

    pub fn meta(&self, field: &str) -> Result<&str, RefCaseError> {
        self.metadata
            .get(field)
            .map(String::as_str)
            .ok_or_else(|| RefCaseError::MissingMeta {
                file: self.file.clone(),
                field: field.into(),
            })
    }

    fn bad_meta(&self, field: &str, expected: &'static str) -> RefCaseError {
        RefCaseError::BadMeta {
            file: self.file.clone(),
            field: field.into(),
            value: self.metadata.get(field).cloned().unwrap_or_default(),
            expected,
        }
    }

    /// A metadata field holding a JSON list of positive integers.
    pub fn meta_usizes(&self, field: &str) -> Result<Vec<usize>, RefCaseError> {
        let s = self.meta(field)?;
        serde_json::from_str::<Vec<usize>>(s)
            .map_err(|_| self.bad_meta(field, "a JSON list of non-negative integers"))
    }

    pub fn meta_usize(&self, field: &str) -> Result<usize, RefCaseError> {
        self.meta(field)?
            .trim()
            .parse()
            .map_err(|_| self.bad_meta(field, "a non-negative integer"))
    }

    pub fn meta_f32(&self, field: &str) -> Result<f32, RefCaseError> {
        let v: f32 = self
            .meta(field)?
            .trim()
            .parse()
            .map_err(|_| self.bad_meta(field, "a number"))?;
        if v.is_finite() && v >= 0.0 {
            Ok(v)
        } else {
            Err(self.bad_meta(field, "a finite non-negative number"))
        }
    }

    fn tensor(&self, name: &str, shape: &[usize]) -> Result<&Tensor, RefCaseError> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| RefCaseError::MissingTensor {
                file: self.file.clone(),
                name: name.into(),
            })?;
        if t.shape != shape {
            return Err(RefCaseError::TensorShape {
                file: self.file.clone(),
                name: name.into(),
                got: t.shape.clone(),
                expected: shape.to_vec(),
            });
        }
        Ok(t)
    }

    /// An f32 tensor that must exist with exactly this shape.
    pub fn f32s(&self, name: &str, shape: &[usize]) -> Result<&[f32], RefCaseError> {
        match &self.tensor(name, shape)?.data {
            TensorData::F32(v) => Ok(v),
            TensorData::I64(_) => Err(RefCaseError::TensorDtype {
                file: self.file.clone(),
                name: name.into(),
                got: "I64".into(),
                expected: "F32",
            }),
        }
    }

    /// An i64 tensor that must exist with exactly this shape.
    pub fn i64s(&self, name: &str, shape: &[usize]) -> Result<&[i64], RefCaseError> {
        match &self.tensor(name, shape)?.data {
            TensorData::I64(v) => Ok(v),
            TensorData::F32(_) => Err(RefCaseError::TensorDtype {
                file: self.file.clone(),
                name: name.into(),
                got: "F32".into(),
                expected: "I64",
            }),
        }
    }

    /// The shape of a tensor, if present (to size inputs such as `x` or `ids`).
    pub fn shape_of(&self, name: &str) -> Result<&[usize], RefCaseError> {
        self.tensors
            .get(name)
            .map(|t| t.shape.as_slice())
            .ok_or_else(|| RefCaseError::MissingTensor {
                file: self.file.clone(),
                name: name.into(),
            })
    }

    /// A gated chain's values: cores `core.1..=K` of `core_shapes` and gates `gate.1..K`
    /// (gate b of length `ranks[b]`), every tensor checked.
    fn chain_values<S: AsRef<[usize]>>(
        &self,
        core_shapes: impl ExactSizeIterator<Item = S>,
        ranks: &[usize],
    ) -> Result<ChainValues, RefCaseError> {
        let k = core_shapes.len();
        let mut cores = Vec::with_capacity(k);
        for (c, shape) in core_shapes.enumerate() {
            cores.push(
                self.f32s(&format!("core.{}", c + 1), shape.as_ref())?
                    .to_vec(),
            );
        }
        let mut gates = Vec::with_capacity(k - 1);
        for (b, &r) in ranks.iter().enumerate().take(k).skip(1) {
            gates.push(self.f32s(&format!("gate.{b}"), &[r])?.to_vec());
        }
        Ok((cores, gates))
    }

    /// Checks the gradient of the i-th (from 1) of `params` against
    /// `expected.<prefix>.<what>.<i>`, which must have the parameter's shape.
    fn check_grads(
        &self,
        prefix: &str,
        what: &str,
        params: &[Param],
        tolerance: f64,
    ) -> Result<Vec<Check>, RefCaseError> {
        params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let name = format!("{prefix}.{what}.{}", i + 1);
                self.check(&name, &p.shape, &p.grad, tolerance)
            })
            .collect()
    }

    /// With `expected.size_l0` in the case: checks a gated chain layer's size measures S and
    /// Ŝ, and the gates' gradient of Ŝ alone (`grad_size_l1.gate.*`), which it leaves in the
    /// gates' gradients.
    fn check_sizes<L: Compressible>(
        &self,
        layer: &mut L,
        gates: fn(&mut L) -> &mut [Param],
        tolerance: f64,
    ) -> Result<Vec<Check>, RefCaseError> {
        if !self.tensors.contains_key("expected.size_l0") {
            return Ok(Vec::new());
        }
        let mut checks = vec![
            self.check("size_l0", &[1], &[layer.size_l0() as f32], tolerance)?,
            self.check("size_l1", &[1], &[layer.size_l1() as f32], tolerance)?,
        ];
        for g in gates(layer).iter_mut() {
            g.grad.fill(0.0);
        }
        layer.accumulate_size_l1_grad(1.0);
        checks.extend(self.check_grads("grad_size_l1", "gate", gates(layer), tolerance)?);
        Ok(checks)
    }

    /// Compares `got` with the case's `expected.<name>` (which must have `shape`).
    pub fn check(
        &self,
        name: &str,
        shape: &[usize],
        got: &[f32],
        tolerance: f64,
    ) -> Result<Check, RefCaseError> {
        let exp = self.f32s(&format!("expected.{name}"), shape)?;
        Ok(Check::new(name, got, exp, tolerance))
    }
}

/// The comparison of one tensor.
#[derive(Clone, Debug)]
pub struct Check {
    pub name: String,
    /// max|got − exp| / max(max|exp|, 1e-6).
    pub error: f64,
    pub tolerance: f64,
}

impl Check {
    pub fn new(name: &str, got: &[f32], exp: &[f32], tolerance: f64) -> Check {
        assert_eq!(
            got.len(),
            exp.len(),
            "{name}: compared tensors differ in length"
        );
        let scale = exp
            .iter()
            .fold(0.0f64, |m, &v| m.max((v as f64).abs()))
            .max(1e-6);
        let diff = got.iter().zip(exp).fold(0.0f64, |m, (&a, &b)| {
            let d = (a as f64 - b as f64).abs();
            if d.is_nan() {
                f64::INFINITY
            } else {
                m.max(d)
            }
        });
        Check {
            name: name.into(),
            error: diff / scale,
            tolerance,
        }
    }

    pub fn passed(&self) -> bool {
        self.error <= self.tolerance
    }
}

/// The checks of one run of a case (one contraction path or lookup).
#[derive(Clone, Debug)]
pub struct Report {
    pub label: String,
    pub checks: Vec<Check>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.checks.iter().all(Check::passed)
    }
}

/// Runs every supported variant of a case (each path, and the planner's choice).
pub fn verify(case: &RefCase) -> Result<Vec<Report>, RefCaseError> {
    match case.kind()? {
        "tt_linear" => {
            let mut reports = Vec::new();
            for path in comera_plan::TtPath::ALL {
                reports.push(verify_tt_linear(case, Some(path))?);
            }
            reports.push(verify_tt_linear(case, None)?);
            Ok(reports)
        }
        "ttm_embedding" => Ok(vec![
            verify_ttm_embedding(case, comera_layers::Lookup::Naive)?,
            verify_ttm_embedding(case, comera_layers::Lookup::Optimized)?,
        ]),
        other => Err(RefCaseError::Unsupported {
            file: case.file.clone(),
            kind: other.into(),
        }),
    }
}
