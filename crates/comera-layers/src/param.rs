//! Trainable parameters: a named tensor with its gradient and the optimiser group it belongs to.

/// Which optimiser group a parameter belongs to (SPEC §3: TT cores, rank gates and everything
/// else each get their own learning rate).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParamKind {
    TtCore,
    RankGate,
    Other,
}

/// A parameter tensor (row-major `value`, same-shaped `grad`).
#[derive(Clone, Debug)]
pub struct Param {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: ParamKind,
    pub value: Vec<f32>,
    pub grad: Vec<f32>,
}

impl Param {
    /// A parameter holding `value`; the gradient starts at zero.
    pub fn new(
        name: impl Into<String>,
        shape: &[usize],
        kind: ParamKind,
        value: Vec<f32>,
    ) -> Param {
        let n: usize = shape.iter().product();
        assert_eq!(
            value.len(),
            n,
            "parameter value length must match its shape"
        );
        Param {
            name: name.into(),
            shape: shape.to_vec(),
            kind,
            grad: vec![0.0; n],
            value,
        }
    }

    /// A zero-filled parameter.
    pub fn zeros(name: impl Into<String>, shape: &[usize], kind: ParamKind) -> Param {
        let n: usize = shape.iter().product();
        Param::new(name, shape, kind, vec![0.0; n])
    }

    pub fn len(&self) -> usize {
        self.value.len()
    }

    pub fn is_empty(&self) -> bool {
        self.value.is_empty()
    }
}
