//! Every trainable tensor of a plan in four flat device buffers — values, gradients and
//! AdamW's two moments — each tensor at a fixed offset, under the CPU model's name and shape
//! (the seam for checkpoints, evaluation and export: the run format stays host tensors with
//! the same names on both devices).

use super::raw::Buf;
use crate::device::Device;
use crate::error::CudaError;
use crate::ops::{AdamTable, AdamTensor};
use comera_layers::{Param, ParamKind};
use std::collections::HashMap;

/// One tensor of a [`ParamArena`].
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: ParamKind,
    /// Offset (floats) in the flat buffers.
    pub offset: usize,
    pub len: usize,
}

/// Parameters (w), gradients (g) and AdamW moments (m, v), flat, same layout; plus the
/// tensors' table.
pub struct ParamArena {
    pub tensors: Vec<Tensor>,
    index: HashMap<String, usize>,
    pub w: Buf<f32>,
    /// Gradients and moments: `total` floats each, or one unused float in an arena without
    /// gradients (an inference plan's; [`ParamArena::g`] is then 0, and moments are refused).
    pub g: Buf<f32>,
    pub m: Buf<f32>,
    pub v: Buf<f32>,
    total: usize,
    grads: bool,
}

/// Floats of each tensor rounded up to this, so that every tensor starts 128-byte aligned
/// (cuBLAS and vector loads prefer it; the padding is zero and never read as a tensor).
const ALIGN: usize = 32;

impl ParamArena {
    /// Lays out `params` (name, shape, kind) back to back in the order given, zeroed; with
    /// `grads`, their gradients and AdamW moments too (a training plan), else the values only.
    pub fn new(
        dev: &Device,
        params: &[(String, Vec<usize>, ParamKind)],
        grads: bool,
    ) -> Result<Self, CudaError> {
        let (tensors, at) = ParamArena::layout(params)?;
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        let other = if grads { at } else { 0 };
        dev.ensure_fits("the model's parameters", Self::device_bytes(at, grads))?;
        Ok(ParamArena {
            tensors,
            index,
            w: Buf::zeros(dev, at)?,
            g: Buf::zeros(dev, other)?,
            m: Buf::zeros(dev, other)?,
            v: Buf::zeros(dev, other)?,
            total: at,
            grads,
        })
    }

    /// Bytes [`ParamArena::new`] allocates for `floats` per flat buffer, with `grads` or not.
    pub fn device_bytes(floats: usize, grads: bool) -> usize {
        let f = Buf::<f32>::zeros_bytes;
        f(floats) + 3 * f(if grads { floats } else { 0 })
    }

    /// Whether the arena holds gradients and moments (a training plan's).
    pub fn has_grads(&self) -> bool {
        self.grads
    }

    fn no_grads(&self, what: &str) -> CudaError {
        CudaError::Plan(format!(
            "{what} of a plan for inference only (it holds no gradients or moments)"
        ))
    }

    /// Where [`ParamArena::new`] puts each tensor, and the floats of each flat buffer (host
    /// only: no device needed). A name given twice is an error.
    pub fn layout(
        params: &[(String, Vec<usize>, ParamKind)],
    ) -> Result<(Vec<Tensor>, usize), CudaError> {
        let mut tensors: Vec<Tensor> = Vec::with_capacity(params.len());
        let mut names = std::collections::HashSet::new();
        let mut at = 0usize;
        for (name, shape, kind) in params {
            let len: usize = shape.iter().product();
            if !names.insert(name.as_str()) {
                return Err(CudaError::Plan(format!("parameter `{name}` appears twice")));
            }
            tensors.push(Tensor {
                name: name.clone(),
                shape: shape.clone(),
                kind: *kind,
                offset: at,
                len,
            });
            at += len.div_ceil(ALIGN) * ALIGN;
        }
        Ok((tensors, at))
    }

    /// Floats of each flat buffer (with the alignment padding).
    pub fn total(&self) -> usize {
        self.total
    }

    /// The tensor named `name`.
    pub fn get(&self, name: &str) -> Result<&Tensor, CudaError> {
        self.index
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| CudaError::Plan(format!("the plan has no parameter `{name}`")))
    }

    /// The value's address of tensor `name`.
    pub fn w(&self, name: &str) -> u64 {
        let t = self.get(name).expect("a tensor the plan laid out");
        self.w.at(t.offset, t.len)
    }

    /// The gradient's address of tensor `name` (0 in an arena without gradients: an
    /// inference plan, which launches no backward).
    pub fn g(&self, name: &str) -> u64 {
        let t = self.get(name).expect("a tensor the plan laid out");
        match self.grads {
            true => self.g.at(t.offset, t.len),
            false => 0,
        }
    }

    /// Copies every host parameter into the tensor of its name: names and shapes must match
    /// one to one (a missing, extra or differently shaped tensor is an error naming it, and
    /// nothing is half-copied: everything is checked before the copy). Moments and gradients
    /// are zeroed (a fresh optimiser; moments are uploaded with [`ParamArena::upload_moments`]).
    pub fn upload(&mut self, dev: &Device, params: &[&Param]) -> Result<(), CudaError> {
        self.check_names(params.iter().map(|p| (p.name.as_str(), p.shape.as_slice())))?;
        let mut host = vec![0.0f32; self.total];
        for p in params {
            let t = self.get(&p.name)?;
            host[t.offset..t.offset + t.len].copy_from_slice(&p.value);
        }
        let s = dev.stream();
        let err = || crate::error::driver("uploading parameters");
        s.memcpy_htod(&host, self.w.slice_mut()).map_err(err())?;
        if self.grads {
            let zero = vec![0.0f32; self.total];
            s.memcpy_htod(&zero, self.g.slice_mut()).map_err(err())?;
            s.memcpy_htod(&zero, self.m.slice_mut()).map_err(err())?;
            s.memcpy_htod(&zero, self.v.slice_mut()).map_err(err())?;
        }
        Ok(())
    }

    /// Sets AdamW's moments of tensor `name` (resuming a run: the CPU optimiser's state by
    /// parameter name).
    pub fn upload_moments(
        &mut self,
        dev: &Device,
        name: &str,
        m: &[f32],
        v: &[f32],
    ) -> Result<(), CudaError> {
        if !self.grads {
            return Err(self.no_grads("AdamW moments"));
        }
        let t = self.get(name)?.clone();
        if m.len() != t.len || v.len() != t.len {
            return Err(CudaError::Plan(format!(
                "moments of `{name}`: {} and {} values for a tensor of {}",
                m.len(),
                v.len(),
                t.len
            )));
        }
        let s = dev.stream();
        let err = || crate::error::driver("uploading AdamW moments");
        let range = t.offset..t.offset + t.len;
        s.memcpy_htod(m, &mut self.m.slice_mut().slice_mut(range.clone()))
            .map_err(err())?;
        s.memcpy_htod(v, &mut self.v.slice_mut().slice_mut(range))
            .map_err(err())?;
        Ok(())
    }

    /// Whether `params` are this arena's tensors, by name and in order, with some shapes
    /// changed: a model whose ranks were truncated since the plan was built, which a new
    /// plan takes (anything else, such as another model, is for [`ParamArena::upload`] to
    /// refuse by name).
    pub fn reshaped(&self, params: &[&Param]) -> bool {
        params.len() == self.tensors.len()
            && params
                .iter()
                .zip(&self.tensors)
                .all(|(p, t)| p.name == t.name)
            && params
                .iter()
                .zip(&self.tensors)
                .any(|(p, t)| p.shape != t.shape)
    }

    fn check_names<'a>(
        &self,
        given: impl Iterator<Item = (&'a str, &'a [usize])>,
    ) -> Result<(), CudaError> {
        let mut seen = vec![false; self.tensors.len()];
        for (name, shape) in given {
            let i = *self.index.get(name).ok_or_else(|| {
                CudaError::Plan(format!("parameter `{name}` is not in the device plan"))
            })?;
            let t = &self.tensors[i];
            if t.shape != shape {
                return Err(CudaError::Plan(format!(
                    "parameter `{name}`: shape {shape:?}, the device plan's {:?}",
                    t.shape
                )));
            }
            seen[i] = true;
        }
        if let Some(i) = seen.iter().position(|s| !s) {
            return Err(CudaError::Plan(format!(
                "parameter `{}` of the device plan was not given",
                self.tensors[i].name
            )));
        }
        Ok(())
    }

    /// The whole flat buffer `which` (values, gradients or a moment) on the host.
    pub fn download_flat(&self, dev: &Device, which: Which) -> Result<Vec<f32>, CudaError> {
        if which != Which::Value && !self.grads {
            return Err(self.no_grads("the gradients or moments"));
        }
        let buf = match which {
            Which::Value => &self.w,
            Which::Grad => &self.g,
            Which::M => &self.m,
            Which::V => &self.v,
        };
        dev.stream()
            .clone_dtoh(buf.slice())
            .map_err(crate::error::driver("downloading parameters"))
    }

    /// Copies every tensor's value (and, with `grads`, its gradient) back into the host
    /// parameter of its name, through `visit` (e.g. `Encoder::visit_params_mut`): names and
    /// shapes must match as for [`ParamArena::upload`].
    pub fn download(
        &self,
        dev: &Device,
        grads: bool,
        visit: impl FnOnce(&mut dyn FnMut(&mut Param)),
    ) -> Result<(), CudaError> {
        let w = self.download_flat(dev, Which::Value)?;
        let g = if grads {
            Some(self.download_flat(dev, Which::Grad)?)
        } else {
            None
        };
        let mut err = None;
        let mut seen = 0usize;
        visit(&mut |p: &mut Param| {
            if err.is_some() {
                return;
            }
            match self.get(&p.name) {
                Ok(t) if t.shape == p.shape => {
                    p.value.copy_from_slice(&w[t.offset..t.offset + t.len]);
                    if let Some(g) = &g {
                        p.grad.copy_from_slice(&g[t.offset..t.offset + t.len]);
                    }
                    seen += 1;
                }
                Ok(t) => {
                    err = Some(CudaError::Plan(format!(
                        "parameter `{}`: shape {:?}, the device plan's {:?}",
                        p.name, p.shape, t.shape
                    )))
                }
                Err(e) => err = Some(e),
            }
        });
        if let Some(e) = err {
            return Err(e);
        }
        if seen != self.tensors.len() {
            return Err(CudaError::Plan(format!(
                "{seen} host parameters for the device plan's {}",
                self.tensors.len()
            )));
        }
        Ok(())
    }

    /// AdamW's per-tensor table for learning rates by group (`lr(kind)`), no weight decay
    /// (the authors' setting) unless `decay(kind)` says otherwise; gates marked as gates.
    pub fn adam_table(
        &self,
        dev: &Device,
        lr: impl Fn(ParamKind) -> f32,
        decay: impl Fn(ParamKind) -> f32,
    ) -> Result<AdamTable, CudaError> {
        // The table's tensors tile the flat buffers: each takes its padded length (the padding
        // is zero and its gradient zero, so AdamW leaves it zero).
        let rows: Vec<AdamTensor> = self
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let end = self.tensors.get(i + 1).map_or(self.total, |n| n.offset);
                AdamTensor {
                    len: end - t.offset,
                    lr: lr(t.kind),
                    decay: decay(t.kind),
                    is_gate: t.kind == ParamKind::RankGate,
                }
            })
            .collect();
        dev.adam_table(&rows)
    }
}

/// Which flat buffer of a [`ParamArena`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    Value,
    Grad,
    M,
    V,
}
