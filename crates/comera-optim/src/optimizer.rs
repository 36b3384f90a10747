//! The optimiser a run uses — [`AdamW`], or [`GaLore`] for dense matrices (AdamW for the rest)
//! — behind one type, which also owns its checkpoint state ([`Optimizer::state`] /
//! [`Optimizer::restore`]) and follows truncations ([`Optimizer::retain`]).
//!
//! Checkpoint state is a set of named tensors (`m/<param>`, `v/<param>`, and for GaLore's
//! projected matrices `p/<param>` with the projected `m`/`v`) plus JSON scalars (`kind`, Adam's
//! step count `t`, GaLore's refresh counters).

use crate::galore::ParamState;
use crate::{AdamW, AdamWConfig, GaLore, GaLoreConfig};
use comera_layers::{Model, Retained};
use serde_json::json;

/// An optimiser's state as named tensors and JSON scalars. The values are the optimiser's own
/// buffers, borrowed: a checkpoint of a dense paper-sized model writes 533 MB of moments, which
/// a copy would add to the run's peak memory.
#[derive(Clone, Debug, Default)]
pub struct OptState<'a> {
    pub scalars: serde_json::Value,
    /// (name, shape, values), in parameter order.
    pub tensors: Vec<(String, Vec<usize>, &'a [f32])>,
}

/// Restoring an optimiser from a checkpoint failed.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("the checkpoint's optimiser is `{found}`, the run's config asks for {expected}")]
    Kind {
        found: String,
        expected: &'static str,
    },
    #[error("optimizer `{0}` is missing")]
    MissingScalar(&'static str),
    #[error("optimiser tensor `{name}`")]
    Tensor {
        name: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Fills a buffer from the checkpoint tensor of that name (its length must match).
pub type TensorSource<'a> =
    dyn FnMut(&str, &mut [f32]) -> Result<(), Box<dyn std::error::Error + Send + Sync>> + 'a;

/// AdamW, or GaLore (AdamW for the parameters it does not project).
pub enum Optimizer {
    AdamW(AdamW),
    GaLore(Box<GaLore>),
}

impl Optimizer {
    /// GaLore when `galore` is given, else AdamW, with state sized for `model`'s parameters.
    pub fn new(cfg: AdamWConfig, galore: Option<GaLoreConfig>, model: &mut dyn Model) -> Self {
        match galore {
            Some(g) => {
                Optimizer::GaLore(Box::new(GaLore::new(cfg, g, |f| model.visit_params_mut(f))))
            }
            None => Optimizer::AdamW(AdamW::new(cfg, |f| model.visit_params_mut(f))),
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Optimizer::AdamW(_) => "adamw",
            Optimizer::GaLore(_) => "galore",
        }
    }

    /// Whether truncation of pruned rank slices can follow this optimiser (GaLore's projected
    /// state cannot be cut, so GaLore runs train gates but never truncate).
    pub fn supports_truncation(&self) -> bool {
        matches!(self, Optimizer::AdamW(_))
    }

    /// Freezes rank-gate entries at or below `threshold` (pruned slices are not updated and
    /// their moments are zeroed, so momentum cannot revive them). AdamW only.
    pub fn freeze_gates_at(&mut self, threshold: f32) {
        if let Optimizer::AdamW(o) = self {
            o.freeze_gates_at = Some(threshold);
        }
    }

    /// One update; see [`AdamW::step`] and [`GaLore::step`].
    pub fn step(&mut self, lr_scale: f32, grad_scale: f32, model: &mut dyn Model) {
        match self {
            Optimizer::AdamW(o) => o.step_par(lr_scale, grad_scale, model),
            Optimizer::GaLore(o) => o.step(lr_scale, grad_scale, |f| model.visit_params_mut(f)),
        }
    }

    /// Bytes of optimiser state.
    pub fn bytes(&self) -> usize {
        match self {
            Optimizer::AdamW(o) => o.bytes(),
            Optimizer::GaLore(o) => o.bytes(),
        }
    }

    /// Cuts the moments of truncated parameters (AdamW; GaLore runs are not truncated).
    pub fn retain(&mut self, changed: &[Retained], model: &mut dyn Model) {
        if let Optimizer::AdamW(o) = self {
            o.retain(changed, |f| model.visit_params_mut(f));
        }
    }

    /// The state a checkpoint saves: tensors in parameter order, named after the parameters.
    pub fn state(&self, model: &mut dyn Model) -> OptState<'_> {
        let mut tensors = Vec::new();
        let mut i = 0;
        let scalars = match self {
            Optimizer::AdamW(o) => {
                model.visit_params_mut(&mut |p| {
                    tensors.push((format!("m/{}", p.name), p.shape.clone(), &o.m[i][..]));
                    tensors.push((format!("v/{}", p.name), p.shape.clone(), &o.v[i][..]));
                    i += 1;
                });
                json!({"kind": "adamw", "t": o.t})
            }
            Optimizer::GaLore(o) => {
                let mut projected = serde_json::Map::new();
                model.visit_params_mut(&mut |p| {
                    match &o.state[i] {
                        ParamState::Adam { m, v } => {
                            tensors.push((format!("m/{}", p.name), vec![m.len()], &m[..]));
                            tensors.push((format!("v/{}", p.name), vec![v.len()], &v[..]));
                        }
                        ParamState::Projected(pr) => {
                            let (a, b) = pr.projected_shape();
                            let n = &pr.name;
                            tensors.push((
                                format!("p/{n}"),
                                vec![pr.p.len() / pr.rank, pr.rank],
                                &pr.p[..],
                            ));
                            tensors.push((format!("m/{n}"), vec![a, b], &pr.m[..a * b]));
                            tensors.push((format!("v/{n}"), vec![a, b], &pr.v[..a * b]));
                            projected.insert(n.clone(), json!([pr.refreshes, pr.refreshed_at]));
                        }
                    }
                    i += 1;
                });
                json!({"kind": "galore", "t": o.t, "refresh_steps": o.refresh_steps, "svd_fallbacks": o.svd_fallbacks, "projected": projected})
            }
        };
        OptState { scalars, tensors }
    }

    /// Restores [`Optimizer::state`] (a fresh optimiser for the same model): `scalars` as
    /// saved, `tensor` fills a buffer from the saved tensor of a name.
    pub fn restore(
        &mut self,
        scalars: &serde_json::Value,
        tensor: &mut TensorSource<'_>,
        model: &mut dyn Model,
    ) -> Result<(), RestoreError> {
        let kind = scalars["kind"].as_str().unwrap_or("");
        let num = |k: &'static str| scalars[k].as_u64().ok_or(RestoreError::MissingScalar(k));
        let mut fill = |name: String, buf: &mut [f32]| {
            tensor(&name, buf).map_err(|source| RestoreError::Tensor { name, source })
        };
        let mut err = None;
        let mut i = 0;
        match self {
            Optimizer::AdamW(o) if kind == "adamw" => {
                o.t = num("t")?;
                model.visit_params_mut(&mut |p| {
                    if err.is_none() {
                        err = fill(format!("m/{}", p.name), &mut o.m[i])
                            .and_then(|_| fill(format!("v/{}", p.name), &mut o.v[i]))
                            .err();
                    }
                    i += 1;
                });
            }
            Optimizer::GaLore(o) if kind == "galore" => {
                (o.t, o.refresh_steps, o.svd_fallbacks) =
                    (num("t")?, num("refresh_steps")?, num("svd_fallbacks")?);
                let state = &mut o.state;
                model.visit_params_mut(&mut |p| {
                    if err.is_some() {
                        return;
                    }
                    err = match &mut state[i] {
                        ParamState::Adam { m, v } => fill(format!("m/{}", p.name), m)
                            .and_then(|_| fill(format!("v/{}", p.name), v))
                            .err(),
                        ParamState::Projected(pr) => {
                            let (a, b) = pr.projected_shape();
                            let n = pr.name.clone();
                            let counts = &scalars["projected"][&n];
                            pr.refreshes = counts[0].as_u64().unwrap_or(0);
                            pr.refreshed_at = counts[1].as_u64().unwrap_or(0);
                            fill(format!("p/{n}"), &mut pr.p)
                                .and_then(|_| fill(format!("m/{n}"), &mut pr.m[..a * b]))
                                .and_then(|_| fill(format!("v/{n}"), &mut pr.v[..a * b]))
                                .err()
                        }
                    };
                    i += 1;
                });
            }
            _ => {
                return Err(RestoreError::Kind {
                    found: kind.to_string(),
                    expected: match self {
                        Optimizer::AdamW(_) => "adamw",
                        Optimizer::GaLore(_) => "galore (a [galore] table)",
                    },
                })
            }
        }
        err.map_or(Ok(()), Err)
    }
}
