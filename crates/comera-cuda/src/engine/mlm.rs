//! The masked-LM head on the device (comera-model's `mlm_head.rs`), on the R rows of the last
//! hidden states H (N × D) that a batch selects (at most R; the rest padded):
//!
//! ```text
//! X = H[s] (R × D);   T = LN(GELU(X·W_t + b_t));   Z = T·W_o + b_o (R × V′)
//! W_o: a layer of its own (dense or TT, V′ ≥ V: the padding logits set to −∞) or tied, Eᵀ
//! backward from ∂Z:  ∂T = ∂Z·W_oᵀ (tied: ∂Z·E, ∂E += ∂Zᵀ·T, ∂b_o += 1ᵀ·∂Z)
//!                    ∂pre = GELU'(pre) ⊙ LN'ᵀ ∂T;   ∂X = ∂pre·W_tᵀ;   ∂H[s] = ∂X
//! ```
//!
//! The loss over Z is the plan's cross-entropy with the ignore label (`IGNORE_INDEX`): the
//! padded rows carry it, so they count nowhere and get a zero gradient. They are gathered from
//! row 0 (the CPU zeroes them instead): whatever they hold, ∂Z = 0 on them makes every
//! gradient they touch add exactly zero, and the scatter back skips them (empty segments).

use super::arena::ParamArena;
use super::encoder::{column_sum, gather_rows, segment_sum_rows, Lin, Ln, Segs};
use super::raw::{grid_stride, launch, Buf, Gemm};
use super::tt::Slot;
use crate::device::Device;
use crate::error::CudaError;
use crate::ops;
use comera_model::mlm_head::{MlmDecoder, MlmHead};
use comera_model::EncoderConfig;
use cudarc::cublas::CudaBlas;

/// The output projection on the device.
enum Decoder {
    Own(Lin),
    /// The dense word table E (V × D) transposed, and the head's bias (V).
    Tied {
        table: Slot,
        bias: Slot,
        partial: Buf<f32>,
    },
}

/// The masked-LM head's plan for R rows. See the module doc.
pub(super) struct MlmPlan {
    /// R: the rows the head has room for.
    pub rows: usize,
    /// V: labels are below it.
    pub vocab: usize,
    /// V′ ≥ V: the logits' width.
    pub width: usize,
    d: usize,
    transform: Lin,
    ln: Ln,
    decoder: Decoder,
    /// The batch's selected positions, ascending, padded with 0 to R (`load_mlm`).
    pub sel: Buf<u32>,
    /// The scatter back's segments: order 0..R (fixed), starts 0..=S padded with S.
    sel_order: Buf<u32>,
    pub sel_start: Buf<u32>,
    x: Buf<f32>,    // R × D: H[s]
    pre: Buf<f32>,  // R × D: X·W_t + b_t
    act: Buf<f32>,  // R × D: GELU(pre)
    t: Buf<f32>,    // R × D: LN(act)
    dt: Buf<f32>,   // R × D
    dpre: Buf<f32>, // R × D
    dx: Buf<f32>,   // R × D
}

impl MlmPlan {
    /// The head `h` of a model of config `cfg` for `rows` selected rows; a tied projection
    /// reads the dense word table `table` (None for a TTM table, which a tied head cannot use).
    pub fn new(
        dev: &Device,
        arena: &ParamArena,
        h: &MlmHead,
        cfg: &EncoderConfig,
        rows: usize,
        table: Option<Slot>,
    ) -> Result<MlmPlan, CudaError> {
        let (d, eps, tau) = (cfg.d_model, cfg.ln_eps, cfg.threshold);
        let transform = Lin::dense(dev, arena, &h.transform, "mlm.transform", rows)?;
        let decoder = match &h.decoder {
            MlmDecoder::Own(l) => Decoder::Own(Lin::new(dev, arena, l, "mlm.decoder", rows, tau)?),
            MlmDecoder::Tied { .. } => {
                let table = table.ok_or_else(|| {
                    CudaError::Plan("a tied masked-LM decoder needs a dense word table".into())
                })?;
                Decoder::Tied {
                    table,
                    bias: Slot {
                        w: arena.w("mlm.decoder.bias"),
                        g: arena.g("mlm.decoder.bias"),
                    },
                    partial: Buf::zeros(dev, ops::chunks(rows) * h.vocab)?,
                }
            }
        };
        let z = |len: usize| Buf::<f32>::zeros(dev, len);
        let rd = rows * d;
        let order: Vec<u32> = (0..rows as u32).collect();
        Ok(MlmPlan {
            rows,
            vocab: h.vocab,
            width: h.width(),
            d,
            transform,
            ln: Ln::new(dev, arena, "mlm.ln", rows, d, eps)?,
            decoder,
            sel: Buf::zeros(dev, rows)?,
            sel_order: Buf::copy_from_host(dev, &order)?,
            sel_start: Buf::zeros(dev, rows + 1)?,
            x: z(rd)?,
            pre: z(rd)?,
            act: z(rd)?,
            t: z(rd)?,
            dt: z(rd)?,
            dpre: z(rd)?,
            dx: z(rd)?,
        })
    }

    /// Bytes [`MlmPlan::new`] allocates for head `h` on `rows` rows of `d`.
    pub fn device_bytes(h: &MlmHead, d: usize, rows: usize) -> usize {
        let (f, u) = (Buf::<f32>::zeros_bytes, Buf::<u32>::zeros_bytes);
        let decoder = match &h.decoder {
            MlmDecoder::Own(l) => Lin::device_bytes(l, rows),
            MlmDecoder::Tied { .. } => f(ops::chunks(rows) * h.vocab),
        };
        Lin::dense_bytes(&h.transform, rows)
            + decoder
            + Ln::device_bytes(rows, d)
            + u(rows)
            + Buf::<u32>::copy_bytes(rows)
            + u(rows + 1)
            + 7 * f(rows * d)
    }

    /// The head's TT layers' gated cores (a TT decoder's; the transform is dense).
    pub fn gated_cores(&self) -> Vec<super::tt::GatedCore> {
        match &self.decoder {
            Decoder::Own(l) => l.gated_cores(),
            Decoder::Tied { .. } => Vec::new(),
        }
    }

    /// Z (R × V′) into `logits` from the hidden states `hidden` (N × D).
    pub fn forward(
        &self,
        dev: &Device,
        blas: &CudaBlas,
        hidden: u64,
        logits: u64,
    ) -> Result<(), CudaError> {
        let (r, d) = (self.rows, self.d);
        let (sel, x, pre, act, t) = (
            self.sel.ptr(),
            self.x.ptr(),
            self.pre.ptr(),
            self.act.ptr(),
            self.t.ptr(),
        );
        // sel holds R positions below N (padded with 0).
        gather_rows(dev, d, hidden, sel, r, x)?;
        self.transform.forward(dev, blas, x, pre)?;
        let rd = (r * d) as i64;
        // SAFETY: pre and act hold R·D floats.
        unsafe { launch(dev, "gelu_forward", grid_stride(r * d), &[&pre, &act, &rd])? };
        self.ln.forward(dev, act, t)?;
        match &self.decoder {
            Decoder::Own(l) => l.forward(dev, blas, t, logits)?,
            Decoder::Tied { table, bias, .. } => {
                let (v, ri) = (self.vocab as i32, r as i64);
                // SAFETY: t holds R·D floats, the table V·D, logits R·V, the bias V.
                unsafe {
                    Gemm::new(r, self.vocab, d, false, true).run(blas, t, table.w, logits)?;
                    launch(
                        dev,
                        "add_bias_rows",
                        grid_stride(r * self.vocab),
                        &[&logits, &bias.w, &ri, &v],
                    )?;
                }
            }
        }
        if self.width > self.vocab {
            let (rr, w, from, inf) = (
                r as i64,
                self.width as i32,
                self.vocab as i32,
                f32::NEG_INFINITY,
            );
            // SAFETY: logits hold R·V′ floats; columns V..V′ of each row.
            unsafe {
                launch(
                    dev,
                    "fill_columns",
                    grid_stride(r * (self.width - self.vocab)),
                    &[&logits, &rr, &w, &from, &inf],
                )?;
            }
        }
        Ok(())
    }

    /// From ∂Z (`dlogits`, R × V′): the head's gradients (a tied projection's into the word
    /// table's), then ∂L/∂H written into `dh` (N × D, zeroed here; the selected rows get ∂X).
    pub fn backward(
        &self,
        dev: &Device,
        blas: &CudaBlas,
        dlogits: u64,
        dh: u64,
        n: usize,
    ) -> Result<(), CudaError> {
        let (r, d) = (self.rows, self.d);
        let (dt, t) = (self.dt.ptr(), self.t.ptr());
        match &self.decoder {
            Decoder::Own(l) => l.backward(dev, blas, t, dlogits, Some((dt, false)))?,
            Decoder::Tied {
                table,
                bias,
                partial,
            } => {
                let v = self.vocab;
                // SAFETY: ∂Z holds R·V floats, the table and its gradient V·D, t and dt R·D.
                unsafe {
                    Gemm::new(r, d, v, false, false).run(blas, dlogits, table.w, dt)?;
                    Gemm::new(v, d, r, true, false)
                        .acc()
                        .run(blas, dlogits, t, table.g)?;
                }
                column_sum(dev, dlogits, r, v, partial.ptr(), bias.g)?;
            }
        }
        let (act, pre, dpre, x, dx) = (
            self.act.ptr(),
            self.pre.ptr(),
            self.dpre.ptr(),
            self.x.ptr(),
            self.dx.ptr(),
        );
        self.ln.backward(dev, act, dt, 0, dpre)?;
        let rd = (r * d) as i64;
        // SAFETY: pre, dpre and dt hold R·D floats (dt is free again: ∂pre goes there).
        unsafe {
            launch(
                dev,
                "gelu_backward",
                grid_stride(r * d),
                &[&pre, &dpre, &dt, &rd],
            )?
        };
        self.transform
            .backward(dev, blas, x, dt, Some((dx, false)))?;
        // SAFETY: dh holds N·D floats.
        unsafe { super::raw::zero(dev, dh, n * d)? };
        // R segments of one row each (0..=S, then empty ones that touch nothing) into the
        // selected rows, which are distinct.
        let segs = Segs {
            order: self.sel_order.ptr(),
            start: self.sel_start.ptr(),
            dst_row: self.sel.ptr(),
            segments: r,
        };
        segment_sum_rows(dev, d, dx, segs, true, dh)
    }
}
