//! Typed launches of the kernels: one method per operation, its shapes checked on the host
//! before anything is queued, queued on [`Device::stream`] (nothing waits; a CUDA graph
//! captured from that stream records them). Buffers are cudarc's [`CudaSlice`]s; shapes are in
//! the comments next to them, as in comera-layers.
//!
//! The formulas are in the kernel sources (`kernels/*.cu`); each method names its source.

use crate::device::Device;
use crate::error::{driver, CudaError};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

/// Threads per block of the element-wise and row kernels.
pub const BLOCK: u32 = 256;
/// Most blocks of a grid-stride kernel (enough to fill any current GPU many times over).
const MAX_GRID: u64 = 1 << 16;
/// Elements of a gradient buffer each block of the norm's first stage sums.
pub const GRAD_NORM_PER_BLOCK: usize = 1 << 14;

/// `Shape` error unless `got == expected`.
fn check(name: &'static str, got: usize, expected: usize) -> Result<(), CudaError> {
    if got != expected {
        return Err(CudaError::Shape {
            name,
            expected,
            got,
        });
    }
    Ok(())
}

fn grid_stride(n: usize) -> LaunchConfig {
    let blocks = (n as u64).div_ceil(BLOCK as u64).clamp(1, MAX_GRID) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn grid(x: u32, y: u32, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x.max(1), y.max(1), 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Rows per chunk of the two-stage column sums: the CPU LayerNorm's row blocks
/// (`comera_layers::norm::block_rows`), so that dγ and dβ are summed in the same order.
pub fn rows_per_chunk(rows: usize) -> usize {
    rows.div_ceil(16).max(8)
}

/// Chunks of the two-stage column sums over `rows` rows.
pub fn chunks(rows: usize) -> usize {
    rows.div_ceil(rows_per_chunk(rows))
}

/// round(p·2³²): the dropout keep threshold, computed as the CPU's `Dropout` does.
pub fn dropout_threshold(p: f32) -> u64 {
    (p as f64 * 4_294_967_296.0).round() as u64
}

/// A device null pointer for an optional buffer argument.
const NULL: u64 = 0;

/// Sorted segments of a batch's ids for the deterministic embedding backward
/// (`embedding.cu`): token indices sorted stably by id, where each distinct id's run starts,
/// and the ids themselves. Built on the host once per batch from the host ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segments {
    /// (tokens): token indices, by id, token order within an id.
    pub order: Vec<u32>,
    /// (distinct + 1): segment u is `order[start[u]..start[u + 1]]`.
    pub start: Vec<u32>,
    /// (distinct): the id of segment u, ascending.
    pub ids: Vec<u32>,
    /// (tokens): the segment of token t (its row among the distinct ids).
    pub slot: Vec<u32>,
}

impl Segments {
    pub fn of(ids: &[u32]) -> Segments {
        let mut order: Vec<u32> = (0..ids.len() as u32).collect();
        order.sort_by_key(|&t| ids[t as usize]); // stable: token order within an id
        let (mut start, mut distinct) = (Vec::new(), Vec::new());
        let mut slot = vec![0u32; ids.len()];
        for (s, &t) in order.iter().enumerate() {
            let id = ids[t as usize];
            if distinct.last() != Some(&id) {
                start.push(s as u32);
                distinct.push(id);
            }
            slot[t as usize] = (distinct.len() - 1) as u32;
        }
        start.push(ids.len() as u32);
        Segments {
            order,
            start,
            ids: distinct,
            slot,
        }
    }

    pub fn distinct(&self) -> usize {
        self.ids.len()
    }
}

/// The layout of a TTM table's cores and gates for `ttm_rows` (`embedding.cu`): cores
/// F_k (r_k, v_k, e_k, r_{k+1}) back to back in one buffer, gates of bonds 1..p-1 back to back
/// in another.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TtmLayout {
    /// [p, v.., e.., r_0..r_p, core offsets.., gate offsets..] (the kernel's `meta`).
    pub meta: Vec<i32>,
    /// Floats of each shared chain buffer (two forward, three backward): max_k E_k·r_{k+1}.
    pub chain: usize,
    pub core_len: usize,
    pub gate_len: usize,
    pub dim: usize,
    /// Per core k: (r_k, v_k, e_k, r_{k+1}), its offset in the cores, its gate's offset in the
    /// gates (bond k + 1; `None` for the last core), its slab gradients' offset in a row of
    /// `ttm_slab_grads`' output.
    pub cores: Vec<TtmCore>,
    /// Floats of one distinct id's slab gradients: Σ_k r_k·e_k·r_{k+1}.
    pub slab_total: usize,
}

/// One core of a [`TtmLayout`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TtmCore {
    pub shape: [usize; 4],
    pub offset: usize,
    pub gate_offset: Option<usize>,
    pub slab_offset: usize,
}

impl TtmCore {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// For the TTM backward: per core k, the batch's distinct ids (by their index u among the
/// ascending distinct ids) grouped by their digit k, ascending u within a digit: `order`
/// (distinct) and `start` (v_k + 1), as `segment_sum_rows` reads segments.
pub fn ttm_digit_segments(layout: &TtmLayout, distinct_ids: &[u32]) -> Vec<(Vec<u32>, Vec<u32>)> {
    let p = layout.cores.len();
    let vmodes: Vec<usize> = layout.cores.iter().map(|c| c.shape[1]).collect();
    (0..p)
        .map(|k| {
            let stride: usize = vmodes[k + 1..].iter().product();
            let digit = |id: u32| (id as usize / stride) % vmodes[k];
            let mut start = vec![0u32; vmodes[k] + 1];
            for &id in distinct_ids {
                start[digit(id) + 1] += 1;
            }
            for i in 0..vmodes[k] {
                start[i + 1] += start[i];
            }
            let mut next = start.clone();
            let mut order = vec![0u32; distinct_ids.len()];
            for (u, &id) in distinct_ids.iter().enumerate() {
                let d = digit(id);
                order[next[d] as usize] = u as u32;
                next[d] += 1;
            }
            (order, start)
        })
        .collect()
}

/// Most dynamic shared memory `ttm_rows` / `ttm_slab_grads` may ask for (the default limit
/// without opting in to more).
pub const TTM_SHARED_MAX: usize = 48 << 10;

impl TtmLayout {
    /// `ranks` = [r_0 = 1, r_1, .., r_p = 1].
    pub fn new(
        vocab_modes: &[usize],
        dim_modes: &[usize],
        ranks: &[usize],
    ) -> Result<TtmLayout, CudaError> {
        let p = vocab_modes.len();
        assert!(p > 0 && p <= 16 && dim_modes.len() == p && ranks.len() == p + 1);
        assert!(ranks[0] == 1 && ranks[p] == 1, "TTM end ranks are 1");
        let (mut core_off, mut gate_off) = (Vec::new(), vec![0i32]);
        let (mut core_len, mut gate_len) = (0usize, 0usize);
        let (mut chain, mut rows) = (0usize, 1usize);
        for k in 0..p {
            core_off.push(core_len as i32);
            core_len += ranks[k] * vocab_modes[k] * dim_modes[k] * ranks[k + 1];
            rows *= dim_modes[k];
            chain = chain.max(rows * ranks[k + 1]);
            if k > 0 {
                gate_off.push(gate_len as i32);
                gate_len += ranks[k];
            }
        }
        // The backward holds three chain buffers (A_{k-1}, dA_k, dA_{k-1}), the forward two.
        if 3 * chain * 4 > TTM_SHARED_MAX {
            return Err(CudaError::Shape {
                name: "TTM chain (shared-memory floats of ttm_rows)",
                expected: TTM_SHARED_MAX / 12,
                got: chain,
            });
        }
        let as_i32 = |v: &[usize]| v.iter().map(|&x| x as i32).collect::<Vec<_>>();
        let mut meta = vec![p as i32];
        meta.extend(as_i32(vocab_modes));
        meta.extend(as_i32(dim_modes));
        meta.extend(as_i32(ranks));
        meta.extend(core_off);
        meta.extend(gate_off);
        let mut cores = Vec::with_capacity(p);
        let (mut off, mut goff, mut soff) = (0usize, 0usize, 0usize);
        for k in 0..p {
            let shape = [ranks[k], vocab_modes[k], dim_modes[k], ranks[k + 1]];
            cores.push(TtmCore {
                shape,
                offset: off,
                gate_offset: (k + 1 < p).then_some(goff),
                slab_offset: soff,
            });
            off += shape.iter().product::<usize>();
            if k + 1 < p {
                goff += ranks[k + 1];
            }
            soff += ranks[k] * dim_modes[k] * ranks[k + 1];
        }
        Ok(TtmLayout {
            meta,
            chain,
            core_len,
            gate_len,
            dim: rows,
            cores,
            slab_total: soff,
        })
    }
}

/// AdamW's per-tensor table on the device (`optim.cu`): tensor j is elements
/// `offset[j]..offset[j] + len[j]` of the flat parameter, gradient and moment buffers.
pub struct AdamTable {
    pub offset: CudaSlice<i64>,
    pub len: CudaSlice<i64>,
    pub lr: CudaSlice<f32>,
    pub decay: CudaSlice<f32>,
    pub gate: CudaSlice<i32>,
    /// The multi-tensor launches' tiles: tile b is elements `tile_start[b]` .. + [`TILE`] of
    /// tensor `tile_tensor[b]` (one block of [`BLOCK`] threads each; `optim.cu`).
    pub tile_tensor: CudaSlice<i32>,
    pub tile_start: CudaSlice<i64>,
    tiles: usize,
    tensors: usize,
    total: usize,
}

/// Elements per thread of a multi-tensor tile (`TILE_PER_THREAD` in optim.cu and rank.cu).
pub const TILE_PER_THREAD: usize = 8;

/// Elements of one multi-tensor tile: a block of [`BLOCK`] threads, [`TILE_PER_THREAD`] each.
pub const TILE: usize = TILE_PER_THREAD * BLOCK as usize;

// The engine launches the tiles with its own block size (engine::raw::BLOCK): the same.
const _: () = assert!(BLOCK == crate::engine::raw::BLOCK);

/// The tiles of tensors of these lengths: (tensor, first element) of each, every tensor cut
/// into [`TILE`]-element pieces in order (an empty tensor has none). At least one tile: a
/// table of empty tensors gets tile (0, 0), whose block finds nothing to do.
pub fn adam_tiles(lens: impl Iterator<Item = usize>) -> (Vec<i32>, Vec<i64>) {
    let (mut tensor, mut start) = (Vec::new(), Vec::new());
    for (j, len) in lens.enumerate() {
        for s in (0..len).step_by(TILE) {
            tensor.push(j as i32);
            start.push(s as i64);
        }
    }
    if tensor.is_empty() {
        tensor.push(0);
        start.push(0);
    }
    (tensor, start)
}

impl AdamTable {
    /// Tensors in the table.
    pub fn tensors(&self) -> usize {
        self.tensors
    }

    /// Tiles of the multi-tensor launches (their grid: one block of [`BLOCK`] threads each).
    pub fn tiles(&self) -> usize {
        self.tiles
    }
}

/// One tensor's row of an [`AdamTable`].
#[derive(Clone, Copy, Debug)]
pub struct AdamTensor {
    pub len: usize,
    /// The group learning rate (before the schedule).
    pub lr: f32,
    pub decay: f32,
    pub is_gate: bool,
}

/// AdamW's constants for every step.
#[derive(Clone, Copy, Debug)]
pub struct AdamConsts {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Rank-gate entries at or below this are frozen (`None`: no freezing).
    pub freeze_gates_at: Option<f32>,
}

impl Device {
    fn upload<T: cudarc::driver::DeviceRepr>(&self, v: &[T]) -> Result<CudaSlice<T>, CudaError> {
        self.stream()
            .clone_htod(v)
            .map_err(driver("copying to the device"))
    }

    /// The tensors laid out back to back in the order given.
    pub fn adam_table(&self, tensors: &[AdamTensor]) -> Result<AdamTable, CudaError> {
        let mut offset = Vec::new();
        let mut at = 0i64;
        for t in tensors {
            offset.push(at);
            at += t.len as i64;
        }
        let (tile_tensor, tile_start) = adam_tiles(tensors.iter().map(|t| t.len));
        Ok(AdamTable {
            offset: self.upload(&offset)?,
            len: self.upload(&tensors.iter().map(|t| t.len as i64).collect::<Vec<_>>())?,
            lr: self.upload(&tensors.iter().map(|t| t.lr).collect::<Vec<_>>())?,
            decay: self.upload(&tensors.iter().map(|t| t.decay).collect::<Vec<_>>())?,
            gate: self.upload(&tensors.iter().map(|t| t.is_gate as i32).collect::<Vec<_>>())?,
            tiles: tile_tensor.len(),
            tile_tensor: self.upload(&tile_tensor)?,
            tile_start: self.upload(&tile_start)?,
            tensors: tensors.len(),
            total: at as usize,
        })
    }

    /// `layernorm.cu` forward: x, y (rows, D); gamma, beta (D); mean, rstd (rows).
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_forward(
        &self,
        x: &CudaSlice<f32>,
        gamma: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        eps: f32,
        rows: usize,
        y: &mut CudaSlice<f32>,
        mean: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let dim = gamma.len();
        check("LayerNorm x", x.len(), rows * dim)?;
        check("LayerNorm y", y.len(), rows * dim)?;
        check("LayerNorm beta", beta.len(), dim)?;
        check("LayerNorm mean", mean.len(), rows)?;
        check("LayerNorm rstd", rstd.len(), rows)?;
        let (r, d) = (rows as i32, dim as i32);
        let mut b = self
            .stream()
            .launch_builder(self.kernel("layer_norm_forward"));
        b.arg(x).arg(gamma).arg(beta).arg(&eps).arg(&r).arg(&d);
        b.arg(y).arg(mean).arg(rstd);
        // SAFETY: the argument list matches the kernel's signature; every buffer holds the
        // lengths checked above, which bound the kernel's indexing.
        unsafe { b.launch(grid(rows as u32, 1, BLOCK)) }.map_err(driver("layer_norm_forward"))?;
        Ok(())
    }

    /// Floats of the partial buffer [`Device::layer_norm_backward`] needs: (chunks, 2D).
    pub fn layer_norm_partial_len(rows: usize, dim: usize) -> usize {
        chunks(rows) * 2 * dim
    }

    /// `layernorm.cu` backward: writes dx (rows, D) and *accumulates* dgamma, dbeta (D), from
    /// dy (+ extra) and the forward's x, mean, rstd. `partial`: see
    /// [`Device::layer_norm_partial_len`].
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm_backward(
        &self,
        x: &CudaSlice<f32>,
        dy: &CudaSlice<f32>,
        extra: Option<&CudaSlice<f32>>,
        mean: &CudaSlice<f32>,
        rstd: &CudaSlice<f32>,
        gamma: &CudaSlice<f32>,
        rows: usize,
        dx: &mut CudaSlice<f32>,
        partial: &mut CudaSlice<f32>,
        dgamma: &mut CudaSlice<f32>,
        dbeta: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let dim = gamma.len();
        for (name, len) in [
            ("LayerNorm x", x.len()),
            ("LayerNorm dy", dy.len()),
            ("LayerNorm dx", dx.len()),
        ] {
            check(name, len, rows * dim)?;
        }
        if let Some(e) = extra {
            check("LayerNorm extra", e.len(), rows * dim)?;
        }
        check("LayerNorm mean", mean.len(), rows)?;
        check("LayerNorm rstd", rstd.len(), rows)?;
        check("LayerNorm dgamma", dgamma.len(), dim)?;
        check("LayerNorm dbeta", dbeta.len(), dim)?;
        check(
            "LayerNorm partial",
            partial.len(),
            Self::layer_norm_partial_len(rows, dim),
        )?;
        let (r, d) = (rows as i32, dim as i32);
        let (per, nchunks) = (rows_per_chunk(rows) as i32, chunks(rows) as u32);
        let s = self.stream();
        let mut b = s.launch_builder(self.kernel("layer_norm_backward_dx"));
        b.arg(x).arg(dy);
        match extra {
            Some(e) => b.arg(e),
            None => b.arg(&NULL),
        };
        b.arg(mean)
            .arg(rstd)
            .arg(gamma)
            .arg(&r)
            .arg(&d)
            .arg(&mut *dx);
        // SAFETY: arguments match the kernel; lengths checked above (extra may be null).
        unsafe { b.launch(grid(rows as u32, 1, BLOCK)) }
            .map_err(driver("layer_norm_backward_dx"))?;

        let mut b = s.launch_builder(self.kernel("layer_norm_param_partials"));
        b.arg(x).arg(dy);
        match extra {
            Some(e) => b.arg(e),
            None => b.arg(&NULL),
        };
        b.arg(mean)
            .arg(rstd)
            .arg(&r)
            .arg(&d)
            .arg(&per)
            .arg(&mut *partial);
        let cols = (dim as u32).div_ceil(BLOCK);
        // SAFETY: as above; the grid covers (columns, chunks) of `partial`.
        unsafe { b.launch(grid(cols, nchunks, BLOCK)) }
            .map_err(driver("layer_norm_param_partials"))?;

        let stride = 2 * d;
        for (half, out) in [(0usize, dgamma), (dim, dbeta)] {
            let part = partial.slice(half..);
            let one = 1i32;
            let nc = nchunks as i32;
            let mut b = s.launch_builder(self.kernel("column_sum_finish"));
            b.arg(&part)
                .arg(&nc)
                .arg(&d)
                .arg(&stride)
                .arg(&one)
                .arg(out);
            // SAFETY: `part` starts at column `half` of the (chunks, 2D) partials; the kernel
            // reads columns < D of each row of stride 2D.
            unsafe { b.launch(grid(cols, 1, BLOCK)) }.map_err(driver("column_sum_finish"))?;
        }
        Ok(())
    }

    /// `elementwise.cu`: out = a + b.
    pub fn add(
        &self,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let n = out.len();
        check("add a", a.len(), n)?;
        check("add b", b.len(), n)?;
        let nn = n as i64;
        let mut l = self.stream().launch_builder(self.kernel("add"));
        l.arg(a).arg(b).arg(out).arg(&nn);
        // SAFETY: arguments match the kernel; all three buffers hold n elements.
        unsafe { l.launch(grid_stride(n)) }.map_err(driver("add"))?;
        Ok(())
    }

    /// `elementwise.cu`: acc += x.
    pub fn add_into(&self, acc: &mut CudaSlice<f32>, x: &CudaSlice<f32>) -> Result<(), CudaError> {
        let n = acc.len();
        check("add_into x", x.len(), n)?;
        let nn = n as i64;
        let mut l = self.stream().launch_builder(self.kernel("add_into"));
        l.arg(acc).arg(x).arg(&nn);
        // SAFETY: arguments match the kernel; both buffers hold n elements.
        unsafe { l.launch(grid_stride(n)) }.map_err(driver("add_into"))?;
        Ok(())
    }

    /// `elementwise.cu`: y (rows, W) += bias (W) on every row.
    pub fn add_bias_rows(
        &self,
        y: &mut CudaSlice<f32>,
        bias: &CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let w = bias.len();
        if w == 0 || !y.len().is_multiple_of(w) {
            return Err(CudaError::Shape {
                name: "add_bias_rows y (rows of the bias width)",
                expected: w,
                got: y.len(),
            });
        }
        let (rows, wi) = ((y.len() / w) as i64, w as i32);
        let n = y.len();
        let mut l = self.stream().launch_builder(self.kernel("add_bias_rows"));
        l.arg(y).arg(bias).arg(&rows).arg(&wi);
        // SAFETY: arguments match the kernel; y holds rows·W elements.
        unsafe { l.launch(grid_stride(n)) }.map_err(driver("add_bias_rows"))?;
        Ok(())
    }

    /// Floats of the partial buffer of [`Device::column_sum`]: (chunks, W).
    pub fn column_sum_partial_len(rows: usize, width: usize) -> usize {
        chunks(rows) * width
    }

    /// `elementwise.cu`: out (W) (+)= Σ_rows x (rows, W), e.g. a bias gradient (accumulate).
    pub fn column_sum(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        partial: &mut CudaSlice<f32>,
        accumulate: bool,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let w = out.len();
        check("column_sum x", x.len(), rows * w)?;
        check(
            "column_sum partial",
            partial.len(),
            Self::column_sum_partial_len(rows, w),
        )?;
        let (r, wi, per, nc) = (
            rows as i32,
            w as i32,
            rows_per_chunk(rows) as i32,
            chunks(rows) as i32,
        );
        let cols = (w as u32).div_ceil(BLOCK);
        let s = self.stream();
        let mut l = s.launch_builder(self.kernel("column_sum_partials"));
        l.arg(x).arg(&r).arg(&wi).arg(&per).arg(&mut *partial);
        // SAFETY: arguments match the kernel; lengths checked above.
        unsafe { l.launch(grid(cols, nc as u32, BLOCK)) }.map_err(driver("column_sum_partials"))?;
        let acc = accumulate as i32;
        let mut l = s.launch_builder(self.kernel("column_sum_finish"));
        l.arg(&*partial)
            .arg(&nc)
            .arg(&wi)
            .arg(&wi)
            .arg(&acc)
            .arg(out);
        // SAFETY: as above.
        unsafe { l.launch(grid(cols, 1, BLOCK)) }.map_err(driver("column_sum_finish"))?;
        Ok(())
    }

    /// `gelu.cu`: y = GELU(x).
    pub fn gelu_forward(
        &self,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let n = x.len();
        check("gelu y", y.len(), n)?;
        let nn = n as i64;
        let mut l = self.stream().launch_builder(self.kernel("gelu_forward"));
        l.arg(x).arg(y).arg(&nn);
        // SAFETY: arguments match the kernel; both hold n elements.
        unsafe { l.launch(grid_stride(n)) }.map_err(driver("gelu_forward"))?;
        Ok(())
    }

    /// `gelu.cu`: g = GELU(h + bias), h ← GELU'(h + bias), h and g (rows, W), bias (W).
    pub fn gelu_bias_value_grad(
        &self,
        h: &mut CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        g: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (n, w) = (h.len(), bias.len());
        check("gelu g", g.len(), n)?;
        if w == 0 || !n.is_multiple_of(w) {
            return Err(CudaError::Shape {
                name: "gelu h (rows of the bias width)",
                expected: w,
                got: n,
            });
        }
        let (rows, wi) = ((n / w) as i64, w as i32);
        let mut l = self
            .stream()
            .launch_builder(self.kernel("gelu_bias_value_grad"));
        l.arg(h).arg(bias).arg(g).arg(&rows).arg(&wi);
        // SAFETY: arguments match the kernel; h and g hold rows·W elements.
        unsafe { l.launch(grid_stride(n)) }.map_err(driver("gelu_bias_value_grad"))?;
        Ok(())
    }

    /// `gelu.cu`: dx = dy ⊙ GELU'(x).
    pub fn gelu_backward(
        &self,
        x: &CudaSlice<f32>,
        dy: &CudaSlice<f32>,
        dx: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let n = x.len();
        check("gelu dy", dy.len(), n)?;
        check("gelu dx", dx.len(), n)?;
        let nn = n as i64;
        let mut l = self.stream().launch_builder(self.kernel("gelu_backward"));
        l.arg(x).arg(dy).arg(dx).arg(&nn);
        // SAFETY: arguments match the kernel; all hold n elements.
        unsafe { l.launch(grid_stride(n)) }.map_err(driver("gelu_backward"))?;
        Ok(())
    }

    /// `softmax.cu` forward, in place: scores (B·H, T, T) → P; allow (B, T); stats
    /// (B·H, T, 2) when given.
    #[allow(clippy::too_many_arguments)]
    pub fn softmax_rows_forward(
        &self,
        scores: &mut CudaSlice<f32>,
        allow: &CudaSlice<f32>,
        batch: usize,
        heads: usize,
        seq: usize,
        scale: f32,
        causal: bool,
        stats: Option<&mut CudaSlice<f32>>,
    ) -> Result<(), CudaError> {
        let units = batch * heads;
        check("softmax scores", scores.len(), units * seq * seq)?;
        check("softmax allow", allow.len(), batch * seq)?;
        let (u, h, t, c) = (units as i32, heads as i32, seq as i32, causal as i32);
        let mut l = self
            .stream()
            .launch_builder(self.kernel("softmax_rows_forward"));
        l.arg(scores)
            .arg(allow)
            .arg(&u)
            .arg(&h)
            .arg(&t)
            .arg(&scale)
            .arg(&c);
        match stats {
            Some(st) => {
                check("softmax stats", st.len(), units * seq * 2)?;
                l.arg(st)
            }
            None => l.arg(&NULL),
        };
        let rows = (units * seq) as u32;
        let warps = BLOCK / 32;
        // SAFETY: arguments match the kernel; one warp per row of the checked buffers.
        unsafe { l.launch(grid(rows.div_ceil(warps), 1, BLOCK)) }
            .map_err(driver("softmax_rows_forward"))?;
        Ok(())
    }

    /// `softmax.cu` backward, in place: dp (B·H, T, T) → dS, from P of the same shape.
    pub fn softmax_rows_backward(
        &self,
        probs: &CudaSlice<f32>,
        dp: &mut CudaSlice<f32>,
        units: usize,
        seq: usize,
        scale: f32,
    ) -> Result<(), CudaError> {
        check("softmax probs", probs.len(), units * seq * seq)?;
        check("softmax dp", dp.len(), units * seq * seq)?;
        let (u, t) = (units as i32, seq as i32);
        let mut l = self
            .stream()
            .launch_builder(self.kernel("softmax_rows_backward"));
        l.arg(probs).arg(dp).arg(&u).arg(&t).arg(&scale);
        let rows = (units * seq) as u32;
        // SAFETY: arguments match the kernel; one warp per row of the checked buffers.
        unsafe { l.launch(grid(rows.div_ceil(BLOCK / 32), 1, BLOCK)) }
            .map_err(driver("softmax_rows_backward"))?;
        Ok(())
    }

    /// `dropout.cu`: out = mask ⊙ x / (1 − p) with the mask of (seed, *step) (the backward
    /// is the same call on dy).
    pub fn dropout_apply(
        &self,
        x: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        p: f32,
        seed: u64,
        step: &CudaSlice<u64>,
    ) -> Result<(), CudaError> {
        let n = x.len();
        check("dropout out", out.len(), n)?;
        check("dropout step", step.len(), 1)?;
        let (nn, t, scale) = (n as i64, dropout_threshold(p), 1.0 / (1.0 - p));
        let mut l = self.stream().launch_builder(self.kernel("dropout_apply"));
        l.arg(x)
            .arg(out)
            .arg(&nn)
            .arg(&seed)
            .arg(step)
            .arg(&t)
            .arg(&scale);
        // SAFETY: arguments match the kernel; both buffers hold n elements, step one.
        unsafe { l.launch(grid_stride(n)) }.map_err(driver("dropout_apply"))?;
        Ok(())
    }

    /// `dropout.cu`: out = x + mask ⊙ branch / (1 − p).
    pub fn dropout_add(
        &self,
        x: &CudaSlice<f32>,
        branch: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        p: f32,
        seed: u64,
        step: &CudaSlice<u64>,
    ) -> Result<(), CudaError> {
        let n = x.len();
        check("dropout branch", branch.len(), n)?;
        check("dropout out", out.len(), n)?;
        check("dropout step", step.len(), 1)?;
        let (nn, t, scale) = (n as i64, dropout_threshold(p), 1.0 / (1.0 - p));
        let mut l = self.stream().launch_builder(self.kernel("dropout_add"));
        l.arg(x)
            .arg(branch)
            .arg(out)
            .arg(&nn)
            .arg(&seed)
            .arg(step)
            .arg(&t)
            .arg(&scale);
        // SAFETY: arguments match the kernel; all buffers hold n elements, step one.
        unsafe { l.launch(grid_stride(n)) }.map_err(driver("dropout_add"))?;
        Ok(())
    }

    /// `dropout.cu`: the mask itself (1.0 kept, 0.0 dropped).
    pub fn dropout_mask(
        &self,
        out: &mut CudaSlice<f32>,
        p: f32,
        seed: u64,
        step: &CudaSlice<u64>,
    ) -> Result<(), CudaError> {
        let n = out.len();
        check("dropout step", step.len(), 1)?;
        let (nn, t) = (n as i64, dropout_threshold(p));
        let mut l = self.stream().launch_builder(self.kernel("dropout_mask"));
        l.arg(out).arg(&nn).arg(&seed).arg(step).arg(&t);
        // SAFETY: arguments match the kernel; out holds n elements, step one.
        unsafe { l.launch(grid_stride(n)) }.map_err(driver("dropout_mask"))?;
        Ok(())
    }

    /// `dropout.cu`: *step += 1 on the device.
    pub fn step_advance(&self, step: &mut CudaSlice<u64>) -> Result<(), CudaError> {
        check("step", step.len(), 1)?;
        let mut l = self.stream().launch_builder(self.kernel("step_advance"));
        l.arg(step);
        // SAFETY: arguments match the kernel; one thread writes the one element.
        unsafe { l.launch(grid(1, 1, 32)) }.map_err(driver("step_advance"))?;
        Ok(())
    }

    /// `cross_entropy.cu`: the loss of logits (rows, C) against labels (rows), ignoring
    /// `ignore_index`; writes `out` = [mean loss, loss sum, counted rows, correct] (f64) and,
    /// with `dlogits`, the gradient of the mean loss (rows, C). `count` (1), `row_loss`
    /// (rows, f64), `row_hit` (rows) are scratch.
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy(
        &self,
        logits: &CudaSlice<f32>,
        labels: &CudaSlice<i32>,
        classes: usize,
        ignore_index: Option<i32>,
        dlogits: Option<&mut CudaSlice<f32>>,
        count: &mut CudaSlice<i32>,
        row_loss: &mut CudaSlice<f64>,
        row_hit: &mut CudaSlice<f32>,
        out: &mut CudaSlice<f64>,
    ) -> Result<(), CudaError> {
        let rows = labels.len();
        check("cross-entropy logits", logits.len(), rows * classes)?;
        check("cross-entropy count", count.len(), 1)?;
        check("cross-entropy row_loss", row_loss.len(), rows)?;
        check("cross-entropy row_hit", row_hit.len(), rows)?;
        check("cross-entropy out", out.len(), 4)?;
        // No ignore label: a value no label can have (labels are classes, ≥ 0).
        let ignore = ignore_index.unwrap_or(i32::MIN);
        let (r, c) = (rows as i32, classes as i32);
        let s = self.stream();
        let mut l = s.launch_builder(self.kernel("cross_entropy_count"));
        l.arg(labels).arg(&r).arg(&ignore).arg(&mut *count);
        // SAFETY: arguments match the kernel; labels hold `rows` ints, count one.
        unsafe { l.launch(grid(1, 1, 1024)) }.map_err(driver("cross_entropy_count"))?;
        let write_grad = dlogits.is_some() as i32;
        let mut l = s.launch_builder(self.kernel("cross_entropy_rows"));
        l.arg(logits)
            .arg(labels)
            .arg(&r)
            .arg(&c)
            .arg(&ignore)
            .arg(&*count)
            .arg(&write_grad);
        match dlogits {
            Some(d) => {
                check("cross-entropy dlogits", d.len(), rows * classes)?;
                l.arg(d)
            }
            None => l.arg(&NULL),
        };
        l.arg(&mut *row_loss).arg(&mut *row_hit);
        // SAFETY: arguments match the kernel; one block per row of the checked buffers; the
        // gradient is written only when `dlogits` is given.
        unsafe { l.launch(grid(rows as u32, 1, BLOCK)) }.map_err(driver("cross_entropy_rows"))?;
        let mut l = s.launch_builder(self.kernel("cross_entropy_reduce"));
        l.arg(&*row_loss)
            .arg(&*row_hit)
            .arg(&r)
            .arg(&*count)
            .arg(out);
        // SAFETY: arguments match the kernel; lengths checked above.
        unsafe { l.launch(grid(1, 1, 1024)) }.map_err(driver("cross_entropy_reduce"))?;
        Ok(())
    }

    /// `embedding.cu`: out (tokens, D) = src[slot_t] for src (rows, D). Slots must be < rows
    /// (the host checks ids against the table when it builds the batch).
    pub fn gather_rows(
        &self,
        src: &CudaSlice<f32>,
        slot: &CudaSlice<u32>,
        dim: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let tokens = slot.len();
        check("gather out", out.len(), tokens * dim)?;
        let (t, d) = (tokens as i32, dim as i32);
        let mut l = self.stream().launch_builder(self.kernel("gather_rows"));
        l.arg(src).arg(slot).arg(&t).arg(&d).arg(out);
        // SAFETY: arguments match the kernel; one block per token; slots index rows of src
        // (checked by the caller against the table's rows).
        unsafe { l.launch(grid(tokens as u32, 1, BLOCK)) }.map_err(driver("gather_rows"))?;
        Ok(())
    }

    /// `embedding.cu`: dst[row_u] (+)= Σ_{tokens of segment u, in token order} dy[t], for the
    /// device copy of a [`Segments`] (`order`, `start`) and `dst_row` (a row of dst per segment,
    /// or `None` for row u).
    #[allow(clippy::too_many_arguments)]
    pub fn segment_sum_rows(
        &self,
        dy: &CudaSlice<f32>,
        order: &CudaSlice<u32>,
        start: &CudaSlice<u32>,
        dst_row: Option<&CudaSlice<u32>>,
        dim: usize,
        accumulate: bool,
        dst: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let tokens = order.len();
        let segments = start.len().saturating_sub(1);
        check("segment dy", dy.len(), tokens * dim)?;
        let (sg, d, acc) = (segments as i32, dim as i32, accumulate as i32);
        let mut l = self
            .stream()
            .launch_builder(self.kernel("segment_sum_rows"));
        l.arg(dy).arg(order).arg(start);
        match dst_row {
            Some(rows) => {
                check("segment dst_row", rows.len(), segments)?;
                l.arg(rows)
            }
            None => {
                check("segment dst", dst.len(), segments * dim)?;
                l.arg(&NULL)
            }
        };
        l.arg(&sg).arg(&d).arg(&acc).arg(dst);
        // SAFETY: arguments match the kernel; one block per segment; order/start come from
        // `Segments::of` (indices < tokens), dst rows from the caller's table.
        unsafe { l.launch(grid(segments as u32, 1, BLOCK)) }.map_err(driver("segment_sum_rows"))?;
        Ok(())
    }

    /// `embedding.cu`: rows (count, D) = the TTM table's rows of `ids` (count), for cores and
    /// gates laid out as `layout` says (`meta` its device copy), gate threshold `tau`.
    #[allow(clippy::too_many_arguments)]
    pub fn ttm_rows(
        &self,
        layout: &TtmLayout,
        meta: &CudaSlice<i32>,
        cores: &CudaSlice<f32>,
        gates: &CudaSlice<f32>,
        tau: f32,
        ids: &CudaSlice<u32>,
        rows: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        check("ttm meta", meta.len(), layout.meta.len())?;
        check("ttm cores", cores.len(), layout.core_len)?;
        // A one-core table has no gates; its (unread) gate buffer may hold one dummy value,
        // as cudarc has no zero-length device buffer to pass.
        if !(gates.len() == layout.gate_len || (layout.gate_len == 0 && gates.len() <= 1)) {
            return Err(CudaError::Shape {
                name: "ttm gates",
                expected: layout.gate_len,
                got: gates.len(),
            });
        }
        let count = ids.len();
        check("ttm rows", rows.len(), count * layout.dim)?;
        let (c, chain, every) = (count as i32, layout.chain as i32, 0u64);
        let mut l = self.stream().launch_builder(self.kernel("ttm_rows"));
        l.arg(cores)
            .arg(gates)
            .arg(meta)
            .arg(&tau)
            .arg(ids)
            .arg(&c)
            .arg(&chain)
            .arg(rows)
            .arg(&every);
        let cfg = LaunchConfig {
            shared_mem_bytes: (2 * layout.chain * 4) as u32,
            ..grid(count as u32, 1, BLOCK)
        };
        // SAFETY: arguments match the kernel (`every`: a null `live`, every id computed); the
        // dynamic shared memory holds the two chain buffers `TtmLayout::new` sized (within the
        // 48 KiB default); ids must be < the table's rows (checked by the caller).
        unsafe { l.launch(cfg) }.map_err(driver("ttm_rows"))?;
        Ok(())
    }

    /// `embedding.cu` + `rank.cu`: the TTM table's backward for one batch. From dy (tokens, D)
    /// and the batch's [`Segments`] on the device (`order`, `start`, `distinct` ids), and per
    /// core the digit segments of [`ttm_digit_segments`] on the device: sums dy per distinct id
    /// into `drows` (≥ distinct·D), the slab gradients of each distinct id into `slab_grads`
    /// (≥ distinct·slab_total), then per core the sums over ids sharing a digit into `dh` (≥ the
    /// largest core) and through the gates: *accumulates* `core_grads` (the cores back to
    /// back) and `gate_grads` (the gates back to back), as `TtmEmbedding::backward` does.
    #[allow(clippy::too_many_arguments)]
    pub fn ttm_backward(
        &self,
        layout: &TtmLayout,
        meta: &CudaSlice<i32>,
        cores: &CudaSlice<f32>,
        gates: &CudaSlice<f32>,
        tau: f32,
        dy: &CudaSlice<f32>,
        order: &CudaSlice<u32>,
        start: &CudaSlice<u32>,
        distinct: &CudaSlice<u32>,
        digit_segments: &[(CudaSlice<u32>, CudaSlice<u32>)],
        drows: &mut CudaSlice<f32>,
        slab_grads: &mut CudaSlice<f32>,
        dh: &mut CudaSlice<f32>,
        core_grads: &mut CudaSlice<f32>,
        gate_grads: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let (u, d) = (distinct.len(), layout.dim);
        check("ttm start", start.len(), u + 1)?;
        check("ttm meta", meta.len(), layout.meta.len())?;
        check("ttm cores", cores.len(), layout.core_len)?;
        check("ttm core grads", core_grads.len(), layout.core_len)?;
        check("ttm gates", gates.len(), layout.gate_len)?;
        check("ttm gate grads", gate_grads.len(), layout.gate_len)?;
        check(
            "ttm digit segments",
            digit_segments.len(),
            layout.cores.len(),
        )?;
        for (name, len, need) in [
            ("ttm drows", drows.len(), u * d),
            ("ttm slab grads", slab_grads.len(), u * layout.slab_total),
            (
                "ttm dh",
                dh.len(),
                layout.cores.iter().map(TtmCore::len).max().unwrap_or(0),
            ),
        ] {
            if len < need {
                return Err(CudaError::Shape {
                    name,
                    expected: need,
                    got: len,
                });
            }
        }
        self.segment_sum_rows_into(dy, order, start, d, &mut drows.slice_mut(..u * d))?;
        let s = self.stream();
        let (count, chain, every) = (u as i32, layout.chain as i32, 0u64);
        let total = layout.slab_total as i32;
        {
            let drows_u = drows.slice(..u * d);
            let mut l = s.launch_builder(self.kernel("ttm_slab_grads"));
            l.arg(cores).arg(gates).arg(meta).arg(&tau);
            l.arg(distinct)
                .arg(&count)
                .arg(&chain)
                .arg(&drows_u)
                .arg(&mut *slab_grads)
                .arg(&every);
            let cfg = LaunchConfig {
                shared_mem_bytes: (3 * layout.chain * 4) as u32,
                ..grid(u as u32, 1, BLOCK)
            };
            // SAFETY: arguments match the kernel (`every`: a null `live`, every distinct id
            // computed); three chain buffers of dynamic shared memory
            // (within 48 KiB, checked by `TtmLayout::new`); drows holds u·D and slab_grads
            // u·slab_total floats (checked above); ids are the batch's distinct ids (< the
            // table's rows, checked by the caller).
            unsafe { l.launch(cfg) }.map_err(driver("ttm_slab_grads"))?;
        }
        for (core, (dorder, dstart)) in layout.cores.iter().zip(digit_segments) {
            let [ra, vk, ek, rb] = core.shape;
            check("ttm digit order", dorder.len(), u)?;
            check("ttm digit start", dstart.len(), vk + 1)?;
            let n = core.len();
            let soff = core.slab_offset as i32;
            let [ra_, vk_, ek_, rb_] = core.shape.map(|x| x as i32);
            {
                let mut dhv = dh.slice_mut(..n);
                let mut l = s.launch_builder(self.kernel("ttm_core_grad_sums"));
                l.arg(&*slab_grads)
                    .arg(&total)
                    .arg(&soff)
                    .arg(dorder)
                    .arg(dstart);
                l.arg(&ra_).arg(&vk_).arg(&ek_).arg(&rb_).arg(&mut dhv);
                // SAFETY: arguments match the kernel; dh holds the core's n floats; the digit
                // segments index the u rows of slab_grads.
                unsafe { l.launch(grid_stride(n)) }.map_err(driver("ttm_core_grad_sums"))?;
            }
            let dhv = dh.slice(..n);
            let rows = (ra * vk * ek) as i64;
            let gate_view = core.gate_offset.map(|g| gates.slice(g..g + rb));
            {
                let mut cg = core_grads.slice_mut(core.offset..core.offset + n);
                let mut l = s.launch_builder(self.kernel("gated_grads_core"));
                l.arg(&dhv);
                match &gate_view {
                    Some(g) => l.arg(g),
                    None => l.arg(&NULL),
                };
                l.arg(&rows).arg(&rb_).arg(&tau).arg(&mut cg);
                // SAFETY: arguments match the kernel; dh and the core gradient hold
                // rows·r_{k+1} floats, the gate r_{k+1}.
                unsafe { l.launch(grid_stride(n)) }.map_err(driver("gated_grads_core"))?;
            }
            if let (Some(g), Some(goff)) = (&gate_view, core.gate_offset) {
                let cv = cores.slice(core.offset..core.offset + n);
                let mut gg = gate_grads.slice_mut(goff..goff + rb);
                let mut l = s.launch_builder(self.kernel("gated_grads_gate"));
                l.arg(&dhv)
                    .arg(&cv)
                    .arg(g)
                    .arg(&rows)
                    .arg(&rb_)
                    .arg(&tau)
                    .arg(&mut gg);
                // SAFETY: as above; one thread per gate entry.
                unsafe { l.launch(grid((rb as u32).div_ceil(BLOCK), 1, BLOCK)) }
                    .map_err(driver("gated_grads_gate"))?;
            }
        }
        Ok(())
    }

    /// `segment_sum_rows` into row u of a view (no accumulation): the per-id gradient sums.
    fn segment_sum_rows_into(
        &self,
        dy: &CudaSlice<f32>,
        order: &CudaSlice<u32>,
        start: &CudaSlice<u32>,
        dim: usize,
        dst: &mut cudarc::driver::CudaViewMut<'_, f32>,
    ) -> Result<(), CudaError> {
        let segments = start.len().saturating_sub(1);
        check("segment dy", dy.len(), order.len() * dim)?;
        check("segment dst", dst.len(), segments * dim)?;
        let (sg, d, acc) = (segments as i32, dim as i32, 0i32);
        let mut l = self
            .stream()
            .launch_builder(self.kernel("segment_sum_rows"));
        l.arg(dy)
            .arg(order)
            .arg(start)
            .arg(&NULL)
            .arg(&sg)
            .arg(&d)
            .arg(&acc)
            .arg(dst);
        // SAFETY: arguments match the kernel; dst holds segments·dim floats (checked).
        unsafe { l.launch(grid(segments as u32, 1, BLOCK)) }.map_err(driver("segment_sum_rows"))?;
        Ok(())
    }

    /// `rank.cu`: the backward of h = core·diag(g(gate)) from dh (rows, r): *accumulates*
    /// core_grad (rows, r) and gate_grad (r), active entries only (gates.rs
    /// `accumulate_gated_grads`).
    pub fn gated_grads(
        &self,
        core: &CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        dh: &CudaSlice<f32>,
        tau: f32,
        core_grad: &mut CudaSlice<f32>,
        gate_grad: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let r = gate.len();
        if r == 0 || !core.len().is_multiple_of(r) {
            return Err(CudaError::Shape {
                name: "gated_grads core (rows of the gate length)",
                expected: r,
                got: core.len(),
            });
        }
        check("gated_grads dh", dh.len(), core.len())?;
        check("gated_grads core_grad", core_grad.len(), core.len())?;
        check("gated_grads gate_grad", gate_grad.len(), r)?;
        let (rows, ri) = ((core.len() / r) as i64, r as i32);
        let s = self.stream();
        let mut l = s.launch_builder(self.kernel("gated_grads_core"));
        l.arg(dh)
            .arg(gate)
            .arg(&rows)
            .arg(&ri)
            .arg(&tau)
            .arg(core_grad);
        // SAFETY: arguments match the kernel; lengths checked above.
        unsafe { l.launch(grid_stride(core.len())) }.map_err(driver("gated_grads_core"))?;
        let mut l = s.launch_builder(self.kernel("gated_grads_gate"));
        l.arg(dh)
            .arg(core)
            .arg(gate)
            .arg(&rows)
            .arg(&ri)
            .arg(&tau)
            .arg(gate_grad);
        // SAFETY: as above; one thread per gate entry.
        unsafe { l.launch(grid((r as u32).div_ceil(BLOCK), 1, BLOCK)) }
            .map_err(driver("gated_grads_gate"))?;
        Ok(())
    }

    /// cuBLAS SGEMM in row-major terms (the layout of every comera buffer):
    /// c (m, n) = alpha·op(a)·op(b) + beta·c with op(a) (m, k) and op(b) (k, n); `a` is stored
    /// (m, k), or (k, m) when `trans_a`; `b` (k, n), or (n, k) when `trans_b`. cuBLAS is
    /// column-major, so this asks it for cᵀ = op(b)ᵀ·op(a)ᵀ, which is c read row by row.
    /// Full fp32 (cuBLAS' default math mode, no TF32).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        blas: &cudarc::cublas::CudaBlas,
        (m, n, k): (usize, usize, usize),
        a: &CudaSlice<f32>,
        trans_a: bool,
        b: &CudaSlice<f32>,
        trans_b: bool,
        alpha: f32,
        beta: f32,
        c: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        use cudarc::cublas::{sys::cublasOperation_t as Op, Gemm, GemmConfig};
        check("matmul a", a.len(), m * k)?;
        check("matmul b", b.len(), k * n)?;
        check("matmul c", c.len(), m * n)?;
        let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
        let cfg = GemmConfig {
            transa: op(trans_b),
            transb: op(trans_a),
            m: n as i32,
            n: m as i32,
            k: k as i32,
            alpha,
            lda: (if trans_b { k } else { n }) as i32,
            ldb: (if trans_a { m } else { k }) as i32,
            beta,
            ldc: n as i32,
        };
        // SAFETY: the sizes were checked above against the (m, n, k) and transposes given, and
        // the leading dimensions are those of the row-major buffers seen as column-major.
        unsafe { blas.gemm(cfg, b, a, c) }.map_err(|source| CudaError::Cublas {
            context: "cublasSgemm",
            source,
        })
    }

    /// Floats of the partial buffer of [`Device::grad_norm`] for a gradient of `n` elements.
    pub fn grad_norm_partial_len(n: usize) -> usize {
        n.div_ceil(GRAD_NORM_PER_BLOCK).max(1)
    }

    /// `optim.cu`: norm (1, f64) = ‖g‖ over the flat gradient buffer, clip (1) = the clip
    /// factor for `max_norm` (0: no clipping), NaN when the norm is not finite.
    pub fn grad_norm(
        &self,
        g: &CudaSlice<f32>,
        max_norm: f32,
        partial: &mut CudaSlice<f64>,
        norm: &mut CudaSlice<f64>,
        clip: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let n = g.len();
        let parts = Self::grad_norm_partial_len(n);
        check("grad-norm partial", partial.len(), parts)?;
        check("grad-norm norm", norm.len(), 1)?;
        check("grad-norm clip", clip.len(), 1)?;
        let (nn, per, first) = (n as i64, GRAD_NORM_PER_BLOCK as i64, 0i32);
        let s = self.stream();
        let mut l = s.launch_builder(self.kernel("grad_sum_squares"));
        l.arg(g).arg(&nn).arg(&per).arg(&first).arg(&mut *partial);
        // SAFETY: arguments match the kernel; one block per chunk of GRAD_NORM_PER_BLOCK
        // elements, `parts` partials.
        unsafe { l.launch(grid(parts as u32, 1, BLOCK)) }.map_err(driver("grad_sum_squares"))?;
        let p = parts as i32;
        let mut l = s.launch_builder(self.kernel("grad_norm_finish"));
        l.arg(&*partial).arg(&p).arg(&max_norm).arg(norm).arg(clip);
        // SAFETY: arguments match the kernel; lengths checked above.
        unsafe { l.launch(grid(1, 1, 1024)) }.map_err(driver("grad_norm_finish"))?;
        Ok(())
    }

    /// `optim.cu`: one AdamW step over every tensor of `table` (flat w, g, m, v). `scalars`
    /// (3) = (lr_scale, 1 − β1^t, 1 − β2^t) for this step; `clip` (1) from
    /// [`Device::grad_norm`], or `None` for no clipping.
    #[allow(clippy::too_many_arguments)]
    pub fn adamw_update(
        &self,
        table: &AdamTable,
        consts: AdamConsts,
        w: &mut CudaSlice<f32>,
        g: &CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        scalars: &CudaSlice<f32>,
        clip: Option<&CudaSlice<f32>>,
    ) -> Result<(), CudaError> {
        for (name, len) in [
            ("AdamW w", w.len()),
            ("AdamW g", g.len()),
            ("AdamW m", m.len()),
            ("AdamW v", v.len()),
        ] {
            check(name, len, table.total)?;
        }
        check("AdamW scalars", scalars.len(), 3)?;
        let tau = consts.freeze_gates_at.unwrap_or(-1.0);
        let mut l = self.stream().launch_builder(self.kernel("adamw_update"));
        l.arg(w).arg(g).arg(m).arg(v);
        l.arg(&table.offset)
            .arg(&table.len)
            .arg(&table.tile_tensor)
            .arg(&table.tile_start)
            .arg(&table.lr)
            .arg(&table.decay)
            .arg(&table.gate);
        l.arg(scalars);
        match clip {
            Some(c) => {
                check("AdamW clip", c.len(), 1)?;
                l.arg(c)
            }
            None => l.arg(&NULL),
        };
        l.arg(&consts.beta1)
            .arg(&consts.beta2)
            .arg(&consts.eps)
            .arg(&tau);
        // SAFETY: arguments match the kernel; the table's tensors tile 0..total of the four
        // flat buffers (checked above); each tile lies in its tensor, and threads past the
        // tensor's end return.
        unsafe { l.launch(grid(table.tiles as u32, 1, BLOCK)) }.map_err(driver("adamw_update"))?;
        Ok(())
    }

    /// `rank.cu`: grads += scale·∂Ŝ/∂d for one chain (gates and grads: its bonds back to back,
    /// bond b with `bond_len[b]` entries; modes (K), bonds K − 1 ≤ 64); size (1) = Ŝ.
    #[allow(clippy::too_many_arguments)]
    pub fn rank_size_l1_grad(
        &self,
        gates: &CudaSlice<f32>,
        bond_len: &CudaSlice<i32>,
        modes: &CudaSlice<f64>,
        tau: f32,
        scale: &CudaSlice<f32>,
        grads: &mut CudaSlice<f32>,
        size: &mut CudaSlice<f64>,
    ) -> Result<(), CudaError> {
        let cores = modes.len();
        check("rank bonds", bond_len.len(), cores.saturating_sub(1))?;
        if !(2..=65).contains(&cores) {
            return Err(CudaError::Shape {
                name: "rank chain cores (2..=65)",
                expected: 65,
                got: cores,
            });
        }
        check("rank grads", grads.len(), gates.len())?;
        check("rank scale", scale.len(), 1)?;
        check("rank size", size.len(), 1)?;
        let k = cores as i32;
        let mut l = self
            .stream()
            .launch_builder(self.kernel("rank_size_l1_grad"));
        l.arg(gates)
            .arg(bond_len)
            .arg(modes)
            .arg(&k)
            .arg(&tau)
            .arg(scale)
            .arg(grads)
            .arg(size);
        // SAFETY: arguments match the kernel; bond_len must sum to gates.len() (the caller's
        // layout); at most 64 bonds (checked).
        unsafe { l.launch(grid(1, 1, BLOCK)) }.map_err(driver("rank_size_l1_grad"))?;
        Ok(())
    }

    /// `rank.cu`: h = core ⊙ g(gate) over the core's last axis (rows, r).
    pub fn gate_columns(
        &self,
        core: &CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        tau: f32,
        h: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        let r = gate.len();
        if r == 0 || !core.len().is_multiple_of(r) {
            return Err(CudaError::Shape {
                name: "gate_columns core (rows of the gate length)",
                expected: r,
                got: core.len(),
            });
        }
        check("gate_columns h", h.len(), core.len())?;
        let (rows, ri) = ((core.len() / r) as i64, r as i32);
        let n = core.len();
        let mut l = self.stream().launch_builder(self.kernel("gate_columns"));
        l.arg(core).arg(gate).arg(&rows).arg(&ri).arg(&tau).arg(h);
        // SAFETY: arguments match the kernel; core and h hold rows·r elements.
        unsafe { l.launch(grid_stride(n)) }.map_err(driver("gate_columns"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The multi-tensor tiles cover every element of every tensor exactly once, in tiles of at
    /// most TILE elements inside one tensor, and their number is Σ ⌈len / TILE⌉: a dense word
    /// table beside small tensors costs its own tiles, not the largest tensor's count of
    /// blocks for every tensor.
    #[test]
    fn tiles_cover_each_tensor_once_and_no_more() {
        let lens = [
            0usize,
            1,
            TILE - 1,
            TILE,
            TILE + 1,
            3 * TILE + 5,
            30522 * 768,
        ];
        let (tensor, start) = adam_tiles(lens.iter().copied());
        let want: usize = lens.iter().map(|l| l.div_ceil(TILE)).sum();
        assert_eq!(tensor.len(), want);
        let mut covered = vec![0usize; lens.len()];
        for (&j, &s) in tensor.iter().zip(&start) {
            let (j, s) = (j as usize, s as usize);
            assert_eq!(s, covered[j], "tiles of tensor {j} in order, back to back");
            assert!(s < lens[j]);
            covered[j] = (s + TILE).min(lens[j]);
        }
        assert_eq!(covered.to_vec(), lens.to_vec());
        assert_eq!(adam_tiles([0usize, 0].into_iter()), (vec![0], vec![0]));
    }

    #[test]
    fn segments_keep_token_order_within_an_id() {
        let s = Segments::of(&[5, 2, 5, 9, 2, 5]);
        assert_eq!(s.ids, vec![2, 5, 9]);
        assert_eq!(s.start, vec![0, 2, 5, 6]);
        assert_eq!(s.order, vec![1, 4, 0, 2, 5, 3]);
        assert_eq!(s.slot, vec![1, 0, 1, 2, 0, 1]);
        assert_eq!(Segments::of(&[]).start, vec![0]);
    }

    #[test]
    fn ttm_layout_of_the_paper_table() {
        // BERT's 30522 × 768 table: v = [16, 20, 10, 10], e = [4, 4, 8, 6], rank 32.
        let l = TtmLayout::new(&[16, 20, 10, 10], &[4, 4, 8, 6], &[1, 32, 32, 32, 1]).unwrap();
        assert_eq!(l.dim, 768);
        assert_eq!(l.chain, 4 * 4 * 8 * 32); // E_2·r_3 = 128·32
        assert_eq!(
            l.core_len,
            16 * 4 * 32 + 32 * 20 * 4 * 32 + 32 * 10 * 8 * 32 + 32 * 10 * 6
        );
        assert_eq!(l.gate_len, 96);
        assert_eq!(&l.meta[..5], &[4, 16, 20, 10, 10]);
        // A chain that does not fit in shared memory is refused.
        assert!(TtmLayout::new(&[10, 10], &[128, 64], &[1, 64, 1]).is_err());
    }

    #[test]
    fn ttm_digit_segments_group_ids_by_digit() {
        let l = TtmLayout::new(&[4, 5, 3], &[2, 3, 2], &[1, 3, 3, 1]).unwrap();
        assert_eq!(l.slab_total, 2 * 3 + 3 * 3 * 3 + 3 * 2);
        assert_eq!(l.cores[1].gate_offset, Some(3));
        assert_eq!(l.cores[2].gate_offset, None);
        // ids 7 = (0, 2, 1), 16 = (1, 0, 1), 40 = (2, 3, 1), 44 = (2, 4, 2)
        let segs = ttm_digit_segments(&l, &[7, 16, 40, 44]);
        assert_eq!(segs[0], (vec![0, 1, 2, 3], vec![0, 1, 2, 4, 4]));
        assert_eq!(segs[1], (vec![1, 0, 2, 3], vec![0, 1, 1, 2, 3, 4]));
        assert_eq!(segs[2], (vec![0, 1, 2, 3], vec![0, 0, 3, 4]));
    }

    #[test]
    fn dropout_threshold_is_the_cpus() {
        assert_eq!(dropout_threshold(0.0), 0);
        assert_eq!(dropout_threshold(0.5), 1 << 31);
        assert_eq!(
            dropout_threshold(0.1),
            (0.1f32 as f64 * 4_294_967_296.0).round() as u64
        );
        assert_eq!(rows_per_chunk(4096), 256);
        assert_eq!(rows_per_chunk(3), 8);
        assert_eq!(chunks(4096), 16);
    }
}
