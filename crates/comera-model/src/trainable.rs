//! The encoder as a [`Trainable`] model: the same forward/backward with either head
//! (classifier or masked LM), so the one training step drives both.

use crate::{Encoder, EncoderState};
use comera_layers::{
    Compressible, EmbeddingError, MemoryBreakdown, Model, Param, StepStats, Trainable,
};

impl Model for Encoder {
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        Encoder::visit_params_mut(self, f)
    }
    fn visit_params_par(&mut self, f: &(dyn Fn(usize, &mut Param) + Sync)) {
        Encoder::visit_params_par(self, f)
    }
    fn params(&self) -> Vec<&Param> {
        Encoder::params(self)
    }
    fn visit_compressible(&self, f: &mut dyn FnMut(&dyn Compressible)) {
        Encoder::visit_compressible(self, f)
    }
    fn visit_compressible_mut(&mut self, f: &mut dyn FnMut(&mut dyn Compressible)) {
        Encoder::visit_compressible_mut(self, f)
    }
    fn num_params(&self) -> usize {
        Encoder::num_params(self)
    }
    fn dense_equivalent_params(&self) -> usize {
        Encoder::dense_equivalent_params(self)
    }
}

impl Trainable for Encoder {
    type State = EncoderState;
    type Error = EmbeddingError;

    fn forward(
        &self,
        st: &mut EncoderState,
        train: bool,
        step: u64,
    ) -> Result<StepStats, EmbeddingError> {
        Encoder::forward(self, st, train, step)
    }

    fn backward(&mut self, st: &mut EncoderState) {
        Encoder::backward(self, st)
    }

    fn bytes(&self, st: &EncoderState) -> MemoryBreakdown {
        let params = 4 * Encoder::num_params(self);
        MemoryBreakdown {
            params,
            grads: params,
            state: st.bytes(),
        }
    }
}
