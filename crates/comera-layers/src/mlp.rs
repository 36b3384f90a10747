//! A multi-layer perceptron: dense layers with ReLU between them (and after the last one when
//! asked), as DLRM's bottom and top MLPs use.
//!
//! Forward, for layers l = 0..L−1 with a_{−1} = x:
//!   a_l = ReLU(a_{l−1}·W_l + b_l)      (no ReLU on the last layer unless `relu_last`)
//! Backward, from ∂L/∂a_{L−1} written into [`Mlp::output_grad`]:
//!   d_l ← d_l ⊙ [a_l > 0] where a ReLU was applied; Linear backward gives ∂W_l, ∂b_l and
//!   d_{l−1} (or dx for l = 0, when asked).
//! ReLU's output is kept, so its mask costs no extra buffer.

use crate::linear::LinearWorkspace;
use crate::{Layer, Linear, Param};
use comera_tensor::init;

/// A stack of dense layers with ReLU after each (after the last one too when `relu_last`).
#[derive(Clone, Debug)]
pub struct Mlp {
    pub layers: Vec<Linear>,
    pub relu_last: bool,
}

/// Per-batch buffers of an [`Mlp`]: each layer's output (after its ReLU) and its gradient,
/// `batch × out_features(l)` each.
#[derive(Debug)]
pub struct MlpState {
    ws: Vec<LinearWorkspace>,
    acts: Vec<Vec<f32>>,
    dacts: Vec<Vec<f32>>,
}

impl MlpState {
    /// The last layer's output.
    pub fn output(&self) -> &[f32] {
        self.acts.last().expect("an MLP has a layer")
    }

    /// Bytes held by the activation and gradient buffers.
    pub fn bytes(&self) -> usize {
        let v = |b: &[Vec<f32>]| b.iter().map(Vec::capacity).sum::<usize>();
        4 * (v(&self.acts) + v(&self.dacts))
    }
}

impl Mlp {
    /// Layers `widths[0] → widths[1] → … → widths[last]`, named `{name}.{l}`.
    pub fn new(name: &str, widths: &[usize], relu_last: bool, rng: &mut init::Rng) -> Mlp {
        let layers = widths
            .windows(2)
            .enumerate()
            .map(|(l, w)| Linear::new(&format!("{name}.{l}"), w[0], w[1], rng))
            .collect();
        Mlp { layers, relu_last }
    }

    pub fn state(&self, batch: usize) -> MlpState {
        let acts: Vec<Vec<f32>> = self
            .layers
            .iter()
            .map(|l| vec![0.0; batch * l.out_features()])
            .collect();
        MlpState {
            ws: self.layers.iter().map(|l| l.workspace(batch)).collect(),
            dacts: acts.clone(),
            acts,
        }
    }

    fn relu_at(&self, l: usize) -> bool {
        l + 1 < self.layers.len() || self.relu_last
    }

    pub fn forward(&self, st: &mut MlpState, x: &[f32]) {
        for l in 0..self.layers.len() {
            let (prev, cur) = st.acts.split_at_mut(l);
            let input = if l == 0 { x } else { &prev[l - 1][..] };
            self.layers[l].forward(&mut st.ws[l], input, &mut cur[0]);
            if self.relu_at(l) {
                relu_in_place(&mut cur[0]);
            }
        }
    }

    /// The last layer's output.
    pub fn output<'a>(&self, st: &'a MlpState) -> &'a [f32] {
        st.acts.last().expect("an MLP has a layer")
    }

    /// The last layer's output gradient (to be written before `backward`).
    pub fn output_grad<'a>(&self, st: &'a mut MlpState) -> &'a mut [f32] {
        st.dacts.last_mut().expect("an MLP has a layer")
    }

    /// The last layer's output and its gradient buffer at once (a loss reads one and writes
    /// the other).
    pub fn output_and_grad<'a>(&self, st: &'a mut MlpState) -> (&'a [f32], &'a mut [f32]) {
        (
            st.acts.last().expect("an MLP has a layer"),
            st.dacts.last_mut().expect("an MLP has a layer"),
        )
    }

    /// From the output gradient in [`Mlp::output_grad`], accumulates parameter gradients and
    /// writes `dx` when given. Clobbers the state's gradient buffers.
    pub fn backward(&mut self, st: &mut MlpState, x: &[f32], mut dx: Option<&mut [f32]>) {
        for l in (0..self.layers.len()).rev() {
            if self.relu_at(l) {
                relu_backward_in_place(&st.acts[l], &mut st.dacts[l]);
            }
            let (dprev, dcur) = st.dacts.split_at_mut(l);
            let input = if l == 0 { x } else { &st.acts[l - 1][..] };
            let d_in = if l == 0 {
                dx.as_deref_mut()
            } else {
                Some(&mut dprev[l - 1][..])
            };
            self.layers[l].backward(&mut st.ws[l], input, &dcur[0], d_in);
        }
    }

    pub fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        for l in &mut self.layers {
            l.visit_params_mut(f);
        }
    }

    pub fn params(&self) -> Vec<&Param> {
        self.layers.iter().flat_map(|l| l.params()).collect()
    }

    pub fn num_params(&self) -> usize {
        self.layers.iter().map(|l| l.num_params()).sum()
    }
}

/// ReLU forward in place: y ← max(y, 0).
pub fn relu_in_place(y: &mut [f32]) {
    for v in y {
        *v = v.max(0.0);
    }
}

/// ReLU backward in place: d ← d ⊙ [y > 0], y the ReLU's output.
pub fn relu_backward_in_place(y: &[f32], d: &mut [f32]) {
    for (g, &v) in d.iter_mut().zip(y) {
        if v <= 0.0 {
            *g = 0.0;
        }
    }
}
