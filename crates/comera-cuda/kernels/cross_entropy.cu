// Softmax cross-entropy over integer labels with an ignore label, mean over counted rows
// (comera-layers loss.rs). For logits z (rows, C), labels y (rows), N = #rows with y_r != ignore:
//   m_r = z_{r, argmax}  (the first maximum),  S_r = sum_c exp(z_rc - m_r)  (summed in double),
//   loss_r = m_r + ln S_r - z_{r, y_r},        L = (1/N) sum_{counted r} loss_r,
//   dL/dz_rc = exp(z_rc - m_r) ((float)(1/S_r) (1/N)) - [c = y_r]/N;  0 for ignored rows.
// With N = 0: L = 0 and the gradient is 0. Three kernels, no host round trip: the count, the
// rows (one block each), the fixed-order sum of the row losses.

// count[0] = N. One block.
extern "C" __global__ void __launch_bounds__(1024) cross_entropy_count(const int* __restrict__ labels, int rows,
                                               int ignore_index, int* __restrict__ count) {
    __shared__ int shared[32];
    int c = 0;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) c += labels[r] != ignore_index;
    c = block_sum(c, shared);
    if (threadIdx.x == 0) count[0] = c;
}

struct ArgMax {
    float v;
    int i;
};
struct ArgMaxOp {
    // The larger value; on a tie the smaller index (the CPU's first maximum).
    __device__ __forceinline__ ArgMax operator()(ArgMax a, ArgMax b) const {
        if (b.v > a.v || (b.v == a.v && b.i < a.i)) return b;
        return a;
    }
};

__device__ __forceinline__ ArgMax shfl_xor(ArgMax a, int offset) {
    ArgMax r;
    r.v = __shfl_xor_sync(FULL_MASK, a.v, offset);
    r.i = __shfl_xor_sync(FULL_MASK, a.i, offset);
    return r;
}

// One row per block. Writes row_loss[r] (double; 0 for ignored rows) and row_hit[r] (1 if the
// argmax is the label). With `write_grad`, dlogits (rows, C) gets the gradient (it may alias
// logits: each row is read completely before it is written). count: from cross_entropy_count.
extern "C" __global__ void cross_entropy_rows(const float* logits, const int* __restrict__ labels,
                                              int rows, int classes, int ignore_index,
                                              const int* __restrict__ count, int write_grad,
                                              float* dlogits, double* __restrict__ row_loss,
                                              float* __restrict__ row_hit) {
    __shared__ double shared_d[32];
    __shared__ ArgMax shared_a[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int y = labels[r];
    const float* z = logits + (size_t)r * classes;
    float* d = dlogits + (size_t)r * classes;
    if (y == ignore_index) {
        if (write_grad)
            for (int c = threadIdx.x; c < classes; c += blockDim.x) d[c] = 0.0f;
        if (threadIdx.x == 0) {
            row_loss[r] = 0.0;
            row_hit[r] = 0.0f;
        }
        return;
    }
    // Arg max (first maximum) over the row.
    ArgMax best = {z[0], 0};
    for (int c = threadIdx.x; c < classes; c += blockDim.x) best = ArgMaxOp()(best, ArgMax{z[c], c});
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) best = ArgMaxOp()(best, shfl_xor(best, offset));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) shared_a[warp] = best;
    __syncthreads();
    if (warp == 0) {
        ArgMax w = lane < warps ? shared_a[lane] : shared_a[0];
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) w = ArgMaxOp()(w, shfl_xor(w, offset));
        if (lane == 0) shared_a[0] = w;
    }
    __syncthreads();
    best = shared_a[0];
    const float m = best.v;
    const float zy = z[y];
    double s = 0.0;
    for (int c = threadIdx.x; c < classes; c += blockDim.x) s += (double)expf(z[c] - m);
    s = block_sum(s, shared_d);  // ends with a barrier: every z was read before d is written
    if (write_grad) {
        const int n = count[0];
        const float inv_n = n > 0 ? 1.0f / (float)n : 0.0f;
        const float k = (float)(1.0 / s) * inv_n;
        for (int c = threadIdx.x; c < classes; c += blockDim.x) {
            const float g = expf(z[c] - m) * k;
            d[c] = c == y ? g - inv_n : g;
        }
    }
    if (threadIdx.x == 0) {
        row_loss[r] = (double)m + log(s) - (double)zy;
        row_hit[r] = best.i == y ? 1.0f : 0.0f;
    }
}

// out[0] = L (mean over counted rows, 0 if none), out[1] = sum of row losses, out[2] = N,
// out[3] = correct count; sums in a fixed tree. One block.
extern "C" __global__ void __launch_bounds__(1024) cross_entropy_reduce(const double* __restrict__ row_loss,
                                                const float* __restrict__ row_hit, int rows,
                                                const int* __restrict__ count,
                                                double* __restrict__ out) {
    __shared__ double shared[32];
    double l = 0.0, h = 0.0;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        l += row_loss[r];
        h += (double)row_hit[r];
    }
    l = block_sum(l, shared);
    h = block_sum(h, shared);
    if (threadIdx.x == 0) {
        const int n = count[0];
        out[0] = n > 0 ? l / (double)n : 0.0;
        out[1] = l;
        out[2] = (double)n;
        out[3] = h;
    }
}
