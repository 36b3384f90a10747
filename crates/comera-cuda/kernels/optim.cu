// The update half of a step (comera-optim lib.rs): the global gradient norm and its clip
// factor, computed and applied on the device (no host round trip), then AdamW over every
// parameter tensor in one launch with per-tensor learning rate and weight decay.
//
// Global norm: ||g|| = sqrt(sum_i g_i^2) over all gradients, summed in double: stage 1 each
// block sums a fixed contiguous chunk (grad_sum_squares), stage 2 one block sums the blocks'
// partials (grad_norm_finish). Clip factor c = max_norm / ||g|| if max_norm > 0 and
// ||g|| > max_norm, else 1; c = NaN when ||g|| is not finite (the update then leaves every
// parameter as it was and the host reports the divergence after the step).
//
// AdamW, element-wise with g' = c g (the clip factor read from the device):
//   m <- b1 m + (1 - b1) g',   v <- b2 v + (1 - b2) g' g',
//   w <- w - lr ((m / bc1) / (sqrt(v / bc2) + eps) + decay w),
//   lr = lr_group lr_scale, bc1 = 1 - b1^t, bc2 = 1 - b2^t;
// rank-gate entries at or below the freezing threshold are pruned: not updated, moments zeroed.

// partial[first_partial + blockIdx.x] = sum of g_i^2 over this block's chunk of `per_block`
// elements of g (n elements). Several gradient buffers write disjoint partial ranges.
extern "C" __global__ void grad_sum_squares(const float* __restrict__ g, long long n,
                                            long long per_block, int first_partial,
                                            double* __restrict__ partial) {
    __shared__ double shared[32];
    const long long i0 = blockIdx.x * per_block;
    const long long i1 = min(n, i0 + per_block);
    double s = 0.0;
    for (long long i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
        const double x = (double)g[i];
        s += x * x;
    }
    s = block_sum(s, shared);
    if (threadIdx.x == 0) partial[first_partial + blockIdx.x] = s;
}

// norm_out[0] = ||g||, clip_out[0] = c (see the top). One block.
extern "C" __global__ void __launch_bounds__(1024) grad_norm_finish(const double* __restrict__ partial, int parts,
                                            float max_norm, double* __restrict__ norm_out,
                                            float* __restrict__ clip_out) {
    __shared__ double shared[32];
    double s = 0.0;
    for (int i = threadIdx.x; i < parts; i += blockDim.x) s += partial[i];
    s = block_sum(s, shared);
    if (threadIdx.x == 0) {
        const double norm = sqrt(s);
        norm_out[0] = norm;
        float c = 1.0f;
        if (!isfinite(norm)) {
            c = __int_as_float(0x7fc00000);  // NaN: skip the update
        } else if (max_norm > 0.0f && norm > (double)max_norm) {
            c = (float)((double)max_norm / norm);
        }
        clip_out[0] = c;
    }
}

// The multi-tensor launches' tiles (adamw_update here, rank_objective_grads in rank.cu): block
// b covers elements tile_start[b] .. tile_start[b] + TILE_PER_THREAD * blockDim.x of tensor
// tile_tensor[b], thread t every blockDim.x-th of them from t. The host cuts every tensor into
// such tiles (ops.rs `AdamTable`), so the grid is the tensors' lengths and no more: a grid of
// (longest tensor, tensors) would launch millions of empty blocks beside one large table.
#define TILE_PER_THREAD 8

// One AdamW step over `tensors` parameter tensors laid out in flat buffers w, g, m, v: tensor j
// is elements offset[j] .. offset[j] + len[j]. lr[j] (group rate, before the schedule),
// decay[j], gate[j] (1 for a rank gate: frozen at or below freeze_tau when freeze_tau >= 0).
// step_scalars = (lr_scale, bc1, bc2) for this step, written by the host before the step;
// clip = the factor from grad_norm_finish (or null for 1). Grid: one block per tile (above).
extern "C" __global__ void adamw_update(float* __restrict__ w, const float* __restrict__ g,
                                        float* __restrict__ m, float* __restrict__ v,
                                        const long long* __restrict__ offset,
                                        const long long* __restrict__ len,
                                        const int* __restrict__ tile_tensor,
                                        const long long* __restrict__ tile_start,
                                        const float* __restrict__ lr,
                                        const float* __restrict__ decay,
                                        const int* __restrict__ gate,
                                        const float* __restrict__ step_scalars,
                                        const float* __restrict__ clip, float beta1, float beta2,
                                        float eps, float freeze_tau) {
    const float gs = clip ? clip[0] : 1.0f;
    if (isnan(gs)) return;
    const int j = tile_tensor[blockIdx.x];
    const float step_lr = lr[j] * step_scalars[0];
    const float bc1 = step_scalars[1], bc2 = step_scalars[2];
    for (int r = 0; r < TILE_PER_THREAD; ++r) {
        const long long k = tile_start[blockIdx.x] + (long long)r * blockDim.x + threadIdx.x;
        if (k >= len[j]) return;
        const long long i = offset[j] + k;
        if (gate[j] && freeze_tau >= 0.0f && w[i] <= freeze_tau) {
            m[i] = 0.0f;
            v[i] = 0.0f;
            continue;
        }
        const float gi = g[i] * gs;
        const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        w[i] -= step_lr * ((mi / bc1) / (sqrtf(vi / bc2) + eps) + decay[j] * w[i]);
    }
}

// Gradient accumulation over micro-batches (comera-optim's Stepper::step_accumulated): the
// step's gradient is the mean over every counted row of all its micro-batches,
//   g = Σ_i n_i g_i / Σ_i n_i     (g_i: micro-batch i's mean-loss gradient, n_i its counted rows),
// kept as a running mean in the one gradient buffer, which each backward *adds* to. With
// c = Σ_{j<i} n_j counted so far (acc[1]) and n = n_i (ce[2], this micro-batch's loss):
// before its backward g ← (c/n)·g, after it g ← (n/(c + n))·g, each factor rounded to float as
// the CPU rounds it; no scaling while c = 0 or n = 0 (the CPU skips both there). `after` picks
// the factor. Grid-stride over the n_g floats of g.
extern "C" __global__ void micro_scale_grads(float* __restrict__ g, long long n_g,
                                             const double* __restrict__ acc,
                                             const double* __restrict__ ce, int after) {
    const double c = acc[1], n = ce[2];
    if (c <= 0.0 || n <= 0.0) return;
    const float f = after ? (float)n / (float)(c + n) : (float)c / (float)n;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n_g;
         i += (long long)gridDim.x * blockDim.x)
        g[i] *= f;
}

// After a micro-batch's loss (ce = cross_entropy_reduce's [mean, sum, N, correct]):
// acc = [Σ mean_i·n_i, Σ n_i, Σ correct_i] gains it (the CPU's loss_sum, count, correct).
// One thread.
extern "C" __global__ void micro_add_stats(const double* __restrict__ ce, double* __restrict__ acc) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    acc[0] += ce[0] * ce[2];
    acc[1] += ce[2];
    acc[2] += ce[3];
}

// After the last micro-batch: ce = the step's [mean, sum, N, correct] over all of them, the
// mean as the CPU forms it (Σ mean_i·n_i · (1 / max(N, 1))), which the rank objective then
// reads as the step's loss. One thread.
extern "C" __global__ void micro_finish_stats(const double* __restrict__ acc, double* __restrict__ ce) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    ce[0] = acc[0] * (1.0 / fmax(acc[1], 1.0));
    ce[1] = acc[0];
    ce[2] = acc[1];
    ce[3] = acc[2];
}
