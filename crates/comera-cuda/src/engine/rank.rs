//! The rank schedule's part of a step on the device (SPEC §3; the CPU's
//! `comera_optim::rank::RankController::apply` and `project`): inside the captured step, with
//! no host round trip, the late stage's weights read the step's loss where the device left it.
//!
//! After the backward pass ([`RankPlan::record_objective`], `rank.cu`):
//!
//! ```text
//! S, Ŝ            = Σ over the chains in rank.layer_prefix (per chain: Σ_k s_k·a_{k−1}·a_k)
//! (w_L, w_S)      = hold: (1, 0) | early: (1, γ) | late: the loss or the size branch
//! g               = hold: 0 on the gates | else: w_L·g, and + 2β·G on the cores
//! g_gate         += size_weight·w_S/S_ref · ∂Ŝ/∂d          (active entries of the chains in the prefix)
//! ```
//!
//! then clipping and AdamW (pruned gate entries frozen, as the CPU's `freeze_gates_at`), and
//! after the update ([`RankPlan::record_project`]) every bond keeps `min_rank` active entries
//! and moves its scale into its left core (`normalise_gates`).
//!
//! What stays on the host, between steps: the stage switch and its target S0, the hold
//! (`gates_after_steps`) — both reach the device as the per-step [`RankStep`] — and the
//! physical truncation of pruned slices, after which the session plans the step again at
//! the new ranks ([`super::EncoderSession::resume`]).
//!
//! The chains are read off the CPU model (`Encoder::visit_compressible`, the CPU's order, so
//! S and Ŝ are summed in the CPU's order) and located in the parameter arena by name.

use super::arena::ParamArena;
use super::raw::{grid, launch, Buf, BLOCK};
use crate::device::Device;
use crate::error::CudaError;
use crate::ops::AdamTable;
use comera_layers::ParamKind;
use comera_model::Encoder;

/// The rank schedule's settings that hold for a whole run (the CPU's `RankConfig` and the
/// controller's S_ref).
#[derive(Clone, Debug, PartialEq)]
pub struct RankSettings {
    /// γ, the early stage's weight of Ŝ/S_ref.
    pub gamma: f64,
    /// β, the weight of Σ‖G‖² over the cores.
    pub beta: f64,
    /// ρ_L, ρ_S: the late stage's regularising weights.
    pub rho_loss: f64,
    pub rho_size: f64,
    /// L0, the late stage's target loss.
    pub target_loss: f64,
    /// Multiplies the size term's gradient in both stages.
    pub size_weight: f64,
    /// S_ref: the TT/TTM size at the start (the unit of Ŝn).
    pub s_ref: f64,
    /// Only the chains whose layer names start with this feel the size terms and count in S.
    pub layer_prefix: String,
    /// Every bond keeps at least this many active entries (≥ 1 on the device).
    pub min_rank: usize,
    pub normalise_gates: bool,
}

impl RankSettings {
    /// The early stage at weight `gamma` over every TT/TTM layer of `enc`, the rest at
    /// comera's defaults (`RankConfig::default()`: β 0, ρ 0.1 / 0.01, L0 0.8, min_rank 1,
    /// normalised gates), S_ref = `enc`'s size now; None when `enc` has no TT/TTM layer. For
    /// the step benchmark, whose step is the authors' CE + γ·rank loss.
    pub fn early_stage(enc: &Encoder, gamma: f64) -> Option<RankSettings> {
        let mut s_ref = 0.0;
        enc.visit_compressible(&mut |l| s_ref += l.size_l0());
        (s_ref > 0.0).then(|| RankSettings {
            gamma,
            beta: 0.0,
            rho_loss: 0.1,
            rho_size: 0.01,
            target_loss: 0.8,
            size_weight: 1.0,
            s_ref,
            layer_prefix: String::new(),
            min_rank: 1,
            normalise_gates: true,
        })
    }
}

/// What the host decides between steps and the device reads in the next one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RankStep {
    /// The gates are held (`step < gates_after_steps`): their gradients are zeroed and no
    /// size term acts.
    pub hold: bool,
    /// The late stage's target S0, once the late stage has begun (None: the early stage).
    pub late_target: Option<f64>,
}

impl RankStep {
    /// The early stage, gates not held.
    pub const EARLY: RankStep = RankStep {
        hold: false,
        late_target: None,
    };
}

/// `rank_objective`'s params for step inputs `r` under `s` (the order `rank.cu` reads).
fn params_of(s: &RankSettings, r: RankStep) -> [f64; 9] {
    [
        r.hold as u8 as f64,
        r.late_target.is_some() as u8 as f64,
        r.late_target.unwrap_or(0.0),
        s.s_ref,
        s.gamma,
        s.rho_loss,
        s.rho_size,
        s.target_loss,
        s.size_weight,
    ]
}

/// Which term drove a device step (the CPU's `Branch`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceBranch {
    Early,
    Loss,
    Size,
}

/// A device step's objective (the CPU's `Objective` without the loss).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceObjective {
    /// S: the exact surviving parameters of the chains in the prefix (before the update).
    pub size: f64,
    /// Ŝ.
    pub size_l1: f64,
    pub branch: DeviceBranch,
    pub w_loss: f64,
    pub w_size: f64,
}

/// The gated chains of a model as the kernels read them (host side; see `rank.cu`): chain c
/// has cores `core0[c] ..` (`cores[c]` of them) and bonds `bond0[c] ..` (one fewer).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChainTable {
    pub names: Vec<String>,
    pub core0: Vec<i32>,
    pub cores: Vec<i32>,
    pub bond0: Vec<i32>,
    pub in_prefix: Vec<i32>,
    /// s_k of every core: the product of its middle axes (n_c or m_c of a TT core, v_k·e_k of
    /// a TTM core).
    pub mode: Vec<f64>,
    /// Per bond: its gate's offset and length in the arena, and its left core's offset and
    /// rows (of `bond_len` entries).
    pub gate_off: Vec<i64>,
    pub bond_len: Vec<i32>,
    pub left_off: Vec<i64>,
    pub left_rows: Vec<i64>,
}

/// The longest bond `rank_project` takes (its shared flags).
const MAX_BOND: usize = 1024;

impl ChainTable {
    /// The chains of `enc`'s TT/TTM layers in the CPU's order, located in `arena`'s tensors
    /// (`{layer}.core.{k}`, `{layer}.gate.{b}`). A dead layer (`rank.min_rank = 0`: a bond
    /// without an active entry) is a chain like the others, as on the CPU: its dead bond
    /// measures 0 in S and Ŝ, takes no gradient from Ŝ (only active entries do), and the
    /// projection revives nothing on it (`min_rank` 0) and skips its normalisation (no gate
    /// above the threshold).
    pub fn of(
        enc: &Encoder,
        tensors: &[super::Tensor],
        prefix: &str,
    ) -> Result<ChainTable, CudaError> {
        let find = |name: &str| {
            tensors
                .iter()
                .find(|t| t.name == name)
                .ok_or_else(|| CudaError::Plan(format!("the plan has no parameter `{name}`")))
        };
        let mut layers = Vec::new();
        enc.visit_compressible(&mut |l| layers.push((l.layer_name().to_string(), l.ranks())));
        let mut t = ChainTable::default();
        for (name, ranks) in layers {
            let k = ranks.len() - 1;
            t.core0.push(t.mode.len() as i32);
            t.cores.push(k as i32);
            t.bond0.push(t.gate_off.len() as i32);
            t.in_prefix.push(name.starts_with(prefix) as i32);
            let mut cores = Vec::with_capacity(k);
            for c in 0..k {
                let core = find(&format!("{name}.core.{}", c + 1))?;
                let (r_in, r_out) = (ranks[c], ranks[c + 1]);
                if core.shape.first() != Some(&r_in) || core.shape.last() != Some(&r_out) {
                    return Err(CudaError::Plan(format!(
                        "`{}` has shape {:?}, the layer's ranks say [{r_in}, …, {r_out}]",
                        core.name, core.shape
                    )));
                }
                t.mode.push((core.len / (r_in * r_out)) as f64);
                cores.push(core);
            }
            for b in 1..k {
                let gate = find(&format!("{name}.gate.{b}"))?;
                let left = cores[b - 1];
                if gate.len != ranks[b] || gate.len > MAX_BOND {
                    return Err(CudaError::Plan(format!(
                        "`{}` has {} entries (rank {}, at most {MAX_BOND} on the device)",
                        gate.name, gate.len, ranks[b]
                    )));
                }
                t.gate_off.push(gate.offset as i64);
                t.bond_len.push(gate.len as i32);
                t.left_off.push(left.offset as i64);
                t.left_rows.push((left.len / gate.len) as i64);
            }
            t.names.push(name);
        }
        Ok(t)
    }

    pub fn chains(&self) -> usize {
        self.cores.len()
    }

    pub fn bonds(&self) -> usize {
        self.gate_off.len()
    }
}

/// The device half of the rank schedule for one plan. See the module doc.
pub struct RankPlan {
    settings: RankSettings,
    tau: f32,
    chains: usize,
    bonds: usize,
    core0: Buf<i32>,
    cores: Buf<i32>,
    bond0: Buf<i32>,
    in_prefix: Buf<i32>,
    mode: Buf<f64>,
    gate_off: Buf<i64>,
    bond_len: Buf<i32>,
    left_off: Buf<i64>,
    left_rows: Buf<i64>,
    /// Per tensor of the arena: 0 other, 1 core, 2 gate (`rank_objective_grads`).
    kind: Buf<i32>,
    /// Per bond, where its gate starts in `gates` (the bonds' running lengths), and every
    /// bond's gate back to back ([`RankPlan::gates`]).
    gate_pos: Buf<i32>,
    gates: Buf<f32>,
    /// `{layer}.gate.{b}` and the length of every bond's gate, in the table's order.
    gate_names: Vec<(String, usize)>,
    bond_l1: Buf<f64>,
    /// Per chain: S, Ŝ.
    size: Buf<f64>,
    /// The host's per-step inputs and the run's settings (`rank_objective`'s `params`).
    params: Buf<f64>,
    /// [S, Ŝ, branch, w_L, w_S] of the last step.
    objective: Buf<f64>,
    /// [w_L, size_weight·w_S/S_ref, hold] as floats, for the gradient kernels.
    scales: Buf<f32>,
}

impl RankPlan {
    /// Bytes [`RankPlan::new`] allocates for `enc` laid out as `tensors`.
    pub fn device_bytes(
        enc: &Encoder,
        tensors: &[super::Tensor],
        settings: &RankSettings,
    ) -> Result<usize, CudaError> {
        let t = ChainTable::of(enc, tensors, &settings.layer_prefix)?;
        let (i32s, i64s) = (Buf::<i32>::copy_bytes, Buf::<i64>::copy_bytes);
        let gates: i32 = t.bond_len.iter().sum();
        Ok(i32s(t.core0.len())
            + i32s(t.cores.len())
            + i32s(t.bond0.len())
            + i32s(t.in_prefix.len())
            + Buf::<f64>::copy_bytes(t.mode.len())
            + i64s(t.gate_off.len())
            + i32s(t.bond_len.len())
            + i64s(t.left_off.len())
            + i64s(t.left_rows.len())
            + i32s(tensors.len())
            + i32s(t.bonds())
            + Buf::<f32>::zeros_bytes(gates as usize)
            + Buf::<f64>::zeros_bytes(t.bonds())
            + Buf::<f64>::zeros_bytes(2 * t.chains())
            + Buf::<f64>::copy_bytes(params_of(settings, RankStep::EARLY).len())
            + Buf::<f64>::zeros_bytes(5)
            + Buf::<f32>::zeros_bytes(3))
    }

    /// The rank schedule of `enc` over `arena` (its tensors in the model's order), gates
    /// thresholded at `tau`.
    pub fn new(
        dev: &Device,
        enc: &Encoder,
        arena: &ParamArena,
        tau: f32,
        settings: RankSettings,
    ) -> Result<RankPlan, CudaError> {
        if settings.s_ref.is_nan() || settings.s_ref <= 0.0 {
            return Err(CudaError::Plan(format!(
                "S_ref {} (the TT/TTM size at the start) must be positive",
                settings.s_ref
            )));
        }
        let t = ChainTable::of(enc, &arena.tensors, &settings.layer_prefix)?;
        if t.chains() == 0 {
            return Err(CudaError::Plan(
                "the rank schedule on a model without TT/TTM layers".into(),
            ));
        }
        let kind: Vec<i32> = arena
            .tensors
            .iter()
            .map(|tn| match tn.kind {
                ParamKind::Other => 0,
                ParamKind::TtCore => 1,
                ParamKind::RankGate => 2,
            })
            .collect();
        let mut gate_pos = Vec::with_capacity(t.bonds());
        let mut gate_names = Vec::with_capacity(t.bonds());
        let mut at = 0;
        for (c, name) in t.names.iter().enumerate() {
            for b in 1..t.cores[c] {
                let len = t.bond_len[t.bond0[c] as usize + b as usize - 1];
                gate_pos.push(at);
                at += len;
                gate_names.push((format!("{name}.gate.{b}"), len as usize));
            }
        }
        let up_i32 = |v: &[i32]| Buf::copy_from_host(dev, v);
        let up_i64 = |v: &[i64]| Buf::copy_from_host(dev, v);
        Ok(RankPlan {
            tau,
            chains: t.chains(),
            bonds: t.bonds(),
            core0: up_i32(&t.core0)?,
            cores: up_i32(&t.cores)?,
            bond0: up_i32(&t.bond0)?,
            in_prefix: up_i32(&t.in_prefix)?,
            mode: Buf::copy_from_host(dev, &t.mode)?,
            gate_off: up_i64(&t.gate_off)?,
            bond_len: up_i32(&t.bond_len)?,
            left_off: up_i64(&t.left_off)?,
            left_rows: up_i64(&t.left_rows)?,
            kind: up_i32(&kind)?,
            gate_pos: up_i32(&gate_pos)?,
            gates: Buf::zeros(dev, at as usize)?,
            gate_names,
            bond_l1: Buf::zeros(dev, t.bonds())?,
            size: Buf::zeros(dev, 2 * t.chains())?,
            params: Buf::copy_from_host(dev, &params_of(&settings, RankStep::EARLY))?,
            objective: Buf::zeros(dev, 5)?,
            scales: Buf::zeros(dev, 3)?,
            settings,
        })
    }

    /// The step's inputs, copied to the device before the step (`rank_objective`'s params).
    /// Until the first call the plan runs the early stage.
    pub fn set_step(&mut self, dev: &Device, r: RankStep) -> Result<(), CudaError> {
        dev.stream()
            .memcpy_htod(&params_of(&self.settings, r), self.params.slice_mut())
            .map_err(crate::error::driver(
                "copying the rank schedule's step inputs",
            ))
    }

    /// Queues the objective (module doc) after the backward pass: reads the gates and the
    /// step's mean loss (`loss`, a device f64), rewrites the gradients.
    pub fn record_objective(
        &self,
        dev: &Device,
        arena: &ParamArena,
        table: &AdamTable,
        loss: u64,
    ) -> Result<(), CudaError> {
        let (w, g) = (arena.w.ptr(), arena.g.ptr());
        let (core0, cores, bond0, pre, mode) = (
            self.core0.ptr(),
            self.cores.ptr(),
            self.bond0.ptr(),
            self.in_prefix.ptr(),
            self.mode.ptr(),
        );
        let (goff, blen, l1, size) = (
            self.gate_off.ptr(),
            self.bond_len.ptr(),
            self.bond_l1.ptr(),
            self.size.ptr(),
        );
        let (params, obj, scales, kind) = (
            self.params.ptr(),
            self.objective.ptr(),
            self.scales.ptr(),
            self.kind.ptr(),
        );
        let (chains, tau) = (self.chains as i32, self.tau);
        let beta2 = (2.0 * self.settings.beta) as f32;
        let (off, len, tiles, starts) = (
            super::encoder::raw_ptr(&table.offset, dev),
            super::encoder::raw_ptr(&table.len, dev),
            super::encoder::raw_ptr(&table.tile_tensor, dev),
            super::encoder::raw_ptr(&table.tile_start, dev),
        );
        // SAFETY: the table's offsets lie in the arena (built from its tensors in `new`); the
        // chain, bond and per-tensor arrays have the lengths `new` uploaded (chains, bonds,
        // cores, tensors), bond_l1 one per bond, size two per chain, params 9, objective 5,
        // scales 3; `loss` is the plan's f64 loss; the AdamW table tiles the arena.
        unsafe {
            launch(
                dev,
                "rank_chain_sizes",
                grid(self.chains as u32, 1, 32),
                &[
                    &w, &core0, &cores, &bond0, &mode, &goff, &blen, &tau, &l1, &size,
                ],
            )?;
            launch(
                dev,
                "rank_objective",
                grid(1, 1, 32),
                &[&size, &pre, &chains, &loss, &params, &obj, &scales],
            )?;
            launch(
                dev,
                "rank_objective_grads",
                grid(table.tiles() as u32, 1, BLOCK),
                &[&w, &g, &off, &len, &tiles, &starts, &kind, &scales, &beta2],
            )?;
            launch(
                dev,
                "rank_size_grads",
                grid(self.chains as u32, 1, 64),
                &[
                    &w, &g, &core0, &cores, &bond0, &pre, &mode, &goff, &blen, &l1, &scales, &tau,
                ],
            )
        }
    }

    /// Queues the projection after AdamW: `min_rank` active entries per bond, then the gates'
    /// normalisation into their left cores.
    pub fn record_project(
        &self,
        dev: &Device,
        arena: &ParamArena,
        clip: u64,
    ) -> Result<(), CudaError> {
        let w = arena.w.ptr();
        let (goff, blen, loff, lrows) = (
            self.gate_off.ptr(),
            self.bond_len.ptr(),
            self.left_off.ptr(),
            self.left_rows.ptr(),
        );
        let min_rank = self.settings.min_rank.min(MAX_BOND) as i32;
        let normalise = self.settings.normalise_gates as i32;
        // compress.rs keep_min_rank's floor.
        let floor = if self.tau > 0.0 { 2.0 * self.tau } else { 1e-3 };
        if self.bonds == 0 {
            // Chains of one core each (a TTM table of one vocabulary mode): no gate to project.
            return Ok(());
        }
        // SAFETY: one block per bond; every bond's gate and left core lie in the arena at the
        // offsets and lengths `ChainTable::of` read from its tensors; bonds ≤ MAX_BOND entries;
        // clip is the plan's one-float clip factor.
        unsafe {
            launch(
                dev,
                "rank_project",
                grid(self.bonds as u32, 1, BLOCK),
                &[
                    &w, &goff, &blen, &loff, &lrows, &self.tau, &min_rank, &normalise, &floor,
                    &clip,
                ],
            )
        }
    }

    /// Every gate's values by name (`{layer}.gate.{b}`), gathered on the device and copied in
    /// one transfer (waits for the stream): the host's view of the active ranks between
    /// steps, without the rest of the arena.
    pub fn gates(
        &self,
        dev: &Device,
        arena: &ParamArena,
    ) -> Result<Vec<(&str, Vec<f32>)>, CudaError> {
        let (w, goff, blen, pos, out) = (
            arena.w.ptr(),
            self.gate_off.ptr(),
            self.bond_len.ptr(),
            self.gate_pos.ptr(),
            self.gates.ptr(),
        );
        if self.bonds > 0 {
            // SAFETY: one block per bond; each gate lies in the arena (`ChainTable::of`) and
            // `gates` holds the bonds' lengths back to back at `gate_pos`.
            unsafe {
                launch(
                    dev,
                    "rank_gather_gates",
                    grid(self.bonds as u32, 1, 64),
                    &[&w, &goff, &blen, &pos, &out],
                )?;
            }
        }
        let all = dev
            .stream()
            .clone_dtoh(self.gates.slice())
            .map_err(crate::error::driver("reading the gates"))?;
        let mut at = 0;
        Ok(self
            .gate_names
            .iter()
            .map(|(name, len)| {
                let v = all[at..at + len].to_vec();
                at += len;
                (name.as_str(), v)
            })
            .collect())
    }

    /// The last step's objective (waits for the stream).
    pub fn objective(&self, dev: &Device) -> Result<DeviceObjective, CudaError> {
        let o = dev
            .stream()
            .clone_dtoh(self.objective.slice())
            .map_err(crate::error::driver("reading the step's objective"))?;
        Ok(DeviceObjective {
            size: o[0],
            size_l1: o[1],
            branch: match o[2] as u8 {
                1 => DeviceBranch::Loss,
                2 => DeviceBranch::Size,
                _ => DeviceBranch::Early,
            },
            w_loss: o[3],
            w_size: o[4],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use comera_model::config::{LayerTt, Rank, TtmConfig};
    use comera_model::EncoderConfig;

    /// A small TT/TTM classifier (the GPU step test's shapes, one block).
    fn encoder() -> Encoder {
        let cfg = EncoderConfig {
            vocab_size: 200,
            seq_len: 16,
            d_model: 32,
            heads: 4,
            ffn: 64,
            layers: 1,
            num_labels: 3,
            attn_tt: LayerTt::uniform(&[4, 8], &[8, 4], 3),
            ffn_up_tt: LayerTt::uniform(&[4, 8], &[8, 8], 3),
            ffn_down_tt: LayerTt::uniform(&[8, 8], &[4, 8], 3),
            word_ttm: TtmConfig {
                vocab_modes: vec![5, 8, 5],
                dim_modes: vec![2, 4, 4],
                rank: Rank::Uniform(4),
            },
            ..EncoderConfig::default()
        };
        Encoder::new(&cfg, 3).unwrap()
    }

    fn tensors(enc: &Encoder) -> Vec<super::super::Tensor> {
        let params: Vec<_> = enc
            .params()
            .iter()
            .map(|p| (p.name.clone(), p.shape.clone(), p.kind))
            .collect();
        ParamArena::layout(&params).unwrap().0
    }

    /// The kernels read every chain through this table: its modes must give the layer's own
    /// S (every gate is active at initialisation, so S = Σ_k s_k·r_{k−1}·r_k), each bond must
    /// point at its gate and its left core in the arena, and the prefix must pick the chains.
    #[test]
    fn the_chain_table_locates_every_gated_chain_in_the_arena() {
        let enc = encoder();
        let tensors = tensors(&enc);
        let table = ChainTable::of(&enc, &tensors, "encoder.").unwrap();
        let mut layers = Vec::new();
        enc.visit_compressible(&mut |l| {
            layers.push((l.layer_name().to_string(), l.ranks(), l.size_l0()))
        });
        assert_eq!(layers.len(), 7, "the TTM table and six TT layers");
        assert_eq!(table.chains(), 7);
        let named = |name: &str| tensors.iter().find(|t| t.name == name).unwrap();
        for (c, (name, ranks, size)) in layers.iter().enumerate() {
            assert_eq!(table.names[c], *name);
            assert_eq!(
                table.in_prefix[c] == 1,
                name.starts_with("encoder."),
                "{name}"
            );
            let (k0, kc, b0) = (
                table.core0[c] as usize,
                table.cores[c] as usize,
                table.bond0[c] as usize,
            );
            assert_eq!(kc + 1, ranks.len(), "{name}");
            let s: f64 = (0..kc)
                .map(|k| table.mode[k0 + k] * (ranks[k] * ranks[k + 1]) as f64)
                .sum();
            assert_eq!(s, *size, "{name}: S from the table's modes");
            for i in 0..kc - 1 {
                let (b, gate, left) = (
                    b0 + i,
                    named(&format!("{name}.gate.{}", i + 1)),
                    named(&format!("{name}.core.{}", i + 1)),
                );
                assert_eq!(table.gate_off[b], gate.offset as i64, "{}", gate.name);
                assert_eq!(table.bond_len[b] as usize, ranks[i + 1], "{}", gate.name);
                assert_eq!(table.left_off[b], left.offset as i64, "{}", left.name);
                assert_eq!(
                    table.left_rows[b] as usize * ranks[i + 1],
                    left.len,
                    "{}",
                    left.name
                );
            }
        }
        assert_eq!(
            table.bonds(),
            layers.iter().map(|l| l.1.len() - 2).sum::<usize>()
        );
    }

    /// A layer with a bond that has no active entry (a dead chain, `rank.min_rank = 0`) is in
    /// the table like any other, at its place in the CPU's order.
    #[test]
    fn a_dead_layer_is_a_chain_like_the_others() {
        let mut enc = encoder();
        let live = ChainTable::of(&enc, &tensors(&enc), "").unwrap();
        enc.visit_params_mut(&mut |p| {
            if p.name == "encoder.0.ffn.down.gate.1" {
                p.value.fill(0.0);
            }
        });
        let mut dead = 0;
        enc.visit_compressible(&mut |l| dead += l.is_dead() as usize);
        assert_eq!(dead, 1);
        let t = ChainTable::of(&enc, &tensors(&enc), "").unwrap();
        assert_eq!((t.chains(), t.bonds()), (live.chains(), live.bonds()));
        assert_eq!(t.gate_off, live.gate_off);
    }
}
