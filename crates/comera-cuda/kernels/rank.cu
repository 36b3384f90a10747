// Rank-gate pieces of the rank-adaptive objective (comera-layers gates.rs, SPEC section 3).
// A chain of K cores with mode sizes s_1..s_K and gates d on its K-1 inner bonds; the
// thresholded gate g(d) = d if d > tau else 0. With a_0 = a_K = 1 and a_k = sum_j g(d_kj)
// (summed in double, in index order, as the CPU):
//   S_hat = sum_k s_k a_{k-1} a_k,
//   dS_hat/dd_kj = s_k a_{k-1} + s_{k+1} a_{k+1} for an active entry (d_kj > tau), else 0.
// And the gating of a core: h[.., j] = core[.., j] g(d_j) over the core's last (bond) axis.

// One chain per block: gates (the chain's bonds back to back, bond b has bond_len[b] entries),
// modes (K), grads laid out as gates: grads += scale[0] dS_hat/dd (scale read from the device:
// the late stage's weight depends on the current loss). size_out[0] = S_hat. Bonds at most 64.
extern "C" __global__ void rank_size_l1_grad(const float* __restrict__ gates,
                                             const int* __restrict__ bond_len,
                                             const double* __restrict__ modes, int cores,
                                             float tau, const float* __restrict__ scale,
                                             float* __restrict__ grads,
                                             double* __restrict__ size_out) {
    __shared__ double a[66];
    __shared__ int start[65];
    const int bonds = cores - 1;
    if (threadIdx.x == 0) {
        a[0] = 1.0;
        int s = 0;
        for (int b = 0; b < bonds; ++b) {
            start[b] = s;
            double sum = 0.0;
            for (int j = 0; j < bond_len[b]; ++j) {
                const float d = gates[s + j];
                sum += (double)(d > tau ? d : 0.0f);
            }
            a[b + 1] = sum;
            s += bond_len[b];
        }
        start[bonds] = s;
        a[cores] = 1.0;
        double size = 0.0;
        for (int k = 0; k < cores; ++k) size += modes[k] * a[k] * a[k + 1];
        if (size_out) size_out[0] = size;
    }
    __syncthreads();
    const float sc = scale[0];
    for (int b = 0; b < bonds; ++b) {
        // Bond b + 1 (1-based) sits between cores b and b + 1 (0-based).
        const int k = b + 1;
        const double da = modes[k - 1] * a[k - 1] + modes[k] * a[k + 1];
        for (int j = threadIdx.x; j < bond_len[b]; j += blockDim.x) {
            if (gates[start[b] + j] > tau) grads[start[b] + j] += sc * (float)da;
        }
    }
}

// h (rows, r) = core (rows, r) with column j scaled by g(d_j); this block's grid-stride share of
// rows * r (blockIdx.x, gridDim.x).
__device__ void gate_columns_of(const float* __restrict__ core, const float* __restrict__ gate,
                                long long rows, int r, float tau, float* __restrict__ h) {
    const long long n = rows * r;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float d = gate[i % r];
        h[i] = core[i] * (d > tau ? d : 0.0f);
    }
}

// The backward of h = core diag(g(d)) (gates.rs accumulate_gated_grads), from dh (rows, r):
//   core_grad[.., j] += dh[.., j] d_j  and  gate_grad[j] += sum_{rows, in order} dh[.., j] core[.., j]
// for active entries j (d_j > tau) only. Without a gate (the last core of a chain, gate null):
// core_grad += dh. Two parts: the core (grid-stride over rows r) and the gate (one thread per
// j, rows in order, the CPU's order).
__device__ void gated_grads_core_of(const float* __restrict__ dh, const float* __restrict__ gate,
                                    long long rows, int r, float tau,
                                    float* __restrict__ core_grad) {
    const long long n = rows * r;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        if (!gate) {
            core_grad[i] += dh[i];
        } else {
            const float d = gate[i % r];
            if (d > tau) core_grad[i] += dh[i] * d;
        }
    }
}

__device__ void gated_grads_gate_of(const float* __restrict__ dh, const float* __restrict__ core,
                                    const float* __restrict__ gate, long long rows, int r,
                                    float tau, float* __restrict__ gate_grad) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= r || !(gate[j] > tau)) return;
    float acc = gate_grad[j];
    for (long long row = 0; row < rows; ++row) acc += dh[row * r + j] * core[row * r + j];
    gate_grad[j] = acc;
}

// One core (a TT layer gating its own cores, engine/tt.rs TtLayer::gate and gated_grads).
extern "C" __global__ void gate_columns(const float* __restrict__ core,
                                        const float* __restrict__ gate, long long rows, int r,
                                        float tau, float* __restrict__ h) {
    gate_columns_of(core, gate, rows, r, tau, h);
}

extern "C" __global__ void gated_grads_core(const float* __restrict__ dh,
                                            const float* __restrict__ gate, long long rows,
                                            int r, float tau, float* __restrict__ core_grad) {
    gated_grads_core_of(dh, gate, rows, r, tau, core_grad);
}

extern "C" __global__ void gated_grads_gate(const float* __restrict__ dh,
                                            const float* __restrict__ core,
                                            const float* __restrict__ gate, long long rows, int r,
                                            float tau, float* __restrict__ gate_grad) {
    gated_grads_gate_of(dh, core, gate, rows, r, tau, gate_grad);
}

// The same three for every gated core of a plan at once (engine/tt.rs GateTable): entry
// e = blockIdx.y is a core of rows[e] × r[e] floats whose value, gradient, gate, gate gradient,
// H and dH are at the addresses core[e], core_grad[e], gate[e], gate_grad[e], h[e], dh[e]. The
// same device functions as one core's, so the results are theirs bit for bit; the x extent
// covers the largest core (grid-stride beyond).
extern "C" __global__ void gate_columns_table(const unsigned long long* __restrict__ core,
                                              const unsigned long long* __restrict__ gate,
                                              const long long* __restrict__ rows,
                                              const int* __restrict__ r, float tau,
                                              const unsigned long long* __restrict__ h) {
    const int e = blockIdx.y;
    gate_columns_of((const float*)core[e], (const float*)gate[e], rows[e], r[e], tau,
                    (float*)h[e]);
}

extern "C" __global__ void gated_grads_core_table(const unsigned long long* __restrict__ dh,
                                                  const unsigned long long* __restrict__ gate,
                                                  const long long* __restrict__ rows,
                                                  const int* __restrict__ r, float tau,
                                                  const unsigned long long* __restrict__ core_grad) {
    const int e = blockIdx.y;
    gated_grads_core_of((const float*)dh[e], (const float*)gate[e], rows[e], r[e], tau,
                        (float*)core_grad[e]);
}

extern "C" __global__ void gated_grads_gate_table(const unsigned long long* __restrict__ dh,
                                                  const unsigned long long* __restrict__ core,
                                                  const unsigned long long* __restrict__ gate,
                                                  const long long* __restrict__ rows,
                                                  const int* __restrict__ r, float tau,
                                                  const unsigned long long* __restrict__ gate_grad) {
    const int e = blockIdx.y;
    gated_grads_gate_of((const float*)dh[e], (const float*)core[e], (const float*)gate[e],
                        rows[e], r[e], tau, (float*)gate_grad[e]);
}

// ---------------------------------------------------------------------------------------------
// The rank schedule inside the captured step (comera-optim rank.rs: RankController::apply and
// project), over every gated chain of a model at once. The chains come from a table the plan
// builds once (engine/rank.rs), in the CPU's visit order:
//   chain c: cores core0[c] .. core0[c] + cores[c], bonds bond0[c] .. bond0[c] + cores[c] - 1,
//            in_prefix[c] (whether rank.layer_prefix selects it);
//   core k:  mode[k] = s_k (its middle axes' product, double);
//   bond b:  gate offset gate_off[b] and length bond_len[b] (= r) in the parameter arena, and
//            its left core (the one whose last axis it gates): left_off[b], left_rows[b] rows
//            of r entries.
// w and g are the arena's values and gradients. Sums are in double and in index order, as
// the CPU's; gate values g(d) = d if d > tau else 0.

// Per chain (one block each; thread 0, the CPU's order): bond_l1[b] = sum_j g(d_bj) (the a_k
// of S_hat), size[2c] = S = sum_k s_k a0_{k-1} a0_k with a0 = active counts, size[2c + 1] =
// S_hat = sum_k s_k a_{k-1} a_k; a_0 = a_K = 1.
extern "C" __global__ void rank_chain_sizes(const float* __restrict__ w,
                                            const int* __restrict__ core0,
                                            const int* __restrict__ cores,
                                            const int* __restrict__ bond0,
                                            const double* __restrict__ mode,
                                            const long long* __restrict__ gate_off,
                                            const int* __restrict__ bond_len, float tau,
                                            double* __restrict__ bond_l1,
                                            double* __restrict__ size) {
    if (threadIdx.x != 0) return;
    const int c = blockIdx.x, k0 = core0[c], kc = cores[c], b0 = bond0[c];
    double s0 = 0.0, s1 = 0.0, prev0 = 1.0, prev1 = 1.0;
    for (int k = 0; k < kc; ++k) {
        double a0 = 1.0, a1 = 1.0;
        if (k + 1 < kc) {
            const int b = b0 + k;
            const float* d = w + gate_off[b];
            a0 = 0.0;
            a1 = 0.0;
            for (int j = 0; j < bond_len[b]; ++j) {
                if (d[j] > tau) {
                    a0 += 1.0;
                    a1 += (double)d[j];
                }
            }
            bond_l1[b] = a1;
        }
        s0 += mode[k0 + k] * prev0 * a0;
        s1 += mode[k0 + k] * prev1 * a1;
        prev0 = a0;
        prev1 = a1;
    }
    size[2 * c] = s0;
    size[2 * c + 1] = s1;
}

// The stage's objective weights (one thread). params (double, written by the host before the
// step): [0] hold (1: the gates are held, RankController::apply's `step < gates_after_steps`),
// [1] late (1: the late stage with its target), [2] S0, [3] S_ref, [4] gamma, [5] rho_L,
// [6] rho_S, [7] L0, [8] size_weight. loss: the step's mean data loss (cross_entropy.cu).
//   S, S_hat = sums over the chains in the prefix, in order;
//   hold:  w_L = 1, w_S = 0 (the gates' gradients are zeroed);
//   early: w_L = 1, w_S = gamma;
//   late:  l = max(L, 1e-12), z = max(S, 1); (L - L0)/l >= (S - S0)/z
//          ? (w_L, w_S) = (1/l + rho_L, rho_S) (the loss branch)
//          : (w_L, w_S) = (rho_L, S_ref/z + rho_S) (the size branch).
// obj = [S, S_hat, branch (0 early, 1 loss, 2 size), w_L, w_S]; scales (float) = [w_L,
// size_weight w_S / S_ref, hold].
extern "C" __global__ void rank_objective(const double* __restrict__ size,
                                          const int* __restrict__ in_prefix, int chains,
                                          const double* __restrict__ loss,
                                          const double* __restrict__ params,
                                          double* __restrict__ obj, float* __restrict__ scales) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    double s = 0.0, s1 = 0.0;
    for (int c = 0; c < chains; ++c) {
        if (in_prefix[c]) {
            s += size[2 * c];
            s1 += size[2 * c + 1];
        }
    }
    const double L = loss[0];
    double wl = 1.0, ws = 0.0, branch = 0.0;
    const bool hold = params[0] != 0.0;
    if (!hold) {
        if (params[1] != 0.0) {
            const double l = fmax(L, 1e-12), z = fmax(s, 1.0);
            const double f_loss = (L - params[7]) / l, f_size = (s - params[2]) / z;
            if (f_loss >= f_size) {
                wl = 1.0 / l + params[5];
                ws = params[6];
                branch = 1.0;
            } else {
                wl = params[5];
                ws = params[3] / z + params[6];
                branch = 2.0;
            }
        } else {
            ws = params[4];
        }
    }
    obj[0] = s;
    obj[1] = s1;
    obj[2] = branch;
    obj[3] = wl;
    obj[4] = ws;
    scales[0] = (float)wl;
    scales[1] = (float)(params[8] * ws / params[3]);
    scales[2] = hold ? 1.0f : 0.0f;
}

// The objective's element-wise part over every tensor of the arena (AdamW's table: tensor j is
// elements offset[j] .. offset[j] + len[j]; kind[j] 0 other, 1 TT/TTM core, 2 rank gate):
//   hold:  g = 0 on the gates, the rest unchanged;
//   else:  g = w_L g (when w_L != 1), then on the cores g = g + 2 beta w (beta2 = 2 beta, when
//          nonzero).
// Grid: one block per tile of the AdamW table, thread t every blockDim.x-th of the tile's
// TILE_PER_THREAD · blockDim.x elements (optim.cu's tiles; the same constant as there and as
// ops.rs's TILE_PER_THREAD).
#define TILE_PER_THREAD 8
extern "C" __global__ void rank_objective_grads(const float* __restrict__ w, float* __restrict__ g,
                                                const long long* __restrict__ offset,
                                                const long long* __restrict__ len,
                                                const int* __restrict__ tile_tensor,
                                                const long long* __restrict__ tile_start,
                                                const int* __restrict__ kind,
                                                const float* __restrict__ scales, float beta2) {
    const int j = tile_tensor[blockIdx.x];
    const bool hold = scales[2] != 0.0f;
    if (hold && kind[j] != 2) return;
    const float wl = scales[0];
    for (int r = 0; r < TILE_PER_THREAD; ++r) {
        const long long k = tile_start[blockIdx.x] + (long long)r * blockDim.x + threadIdx.x;
        if (k >= len[j]) return;
        const long long i = offset[j] + k;
        if (hold) {
            g[i] = 0.0f;
            continue;
        }
        if (wl != 1.0f) g[i] *= wl;
        if (kind[j] == 1 && beta2 != 0.0f) g[i] += beta2 * w[i];
    }
}

// grad += ws dS_hat/dd on the active entries of every bond of the chains in the prefix (one
// block per chain; ws = scales[1], nothing when 0): for bond i of a chain of K cores (between
// its cores i and i + 1), dS_hat/dd = s_i a_i + s_{i+1} a_{i+2} in the 1-based a of
// rank_size_l1_grad, a = 1 past the chain's ends, added as ws (float)da.
extern "C" __global__ void rank_size_grads(const float* __restrict__ w, float* __restrict__ g,
                                           const int* __restrict__ core0,
                                           const int* __restrict__ cores,
                                           const int* __restrict__ bond0,
                                           const int* __restrict__ in_prefix,
                                           const double* __restrict__ mode,
                                           const long long* __restrict__ gate_off,
                                           const int* __restrict__ bond_len,
                                           const double* __restrict__ bond_l1,
                                           const float* __restrict__ scales, float tau) {
    const int c = blockIdx.x;
    const float ws = scales[1];
    if (!in_prefix[c] || ws == 0.0f) return;
    const int k0 = core0[c], bonds = cores[c] - 1, b0 = bond0[c];
    for (int i = 0; i < bonds; ++i) {
        const double before = i > 0 ? bond_l1[b0 + i - 1] : 1.0;
        const double after = i + 1 < bonds ? bond_l1[b0 + i + 1] : 1.0;
        const double da = mode[k0 + i] * before + mode[k0 + i + 1] * after;
        const float v = ws * (float)da;
        const long long off = gate_off[b0 + i];
        for (int j = threadIdx.x; j < bond_len[b0 + i]; j += blockDim.x) {
            if (w[off + j] > tau) g[off + j] += v;
        }
    }
}

// Rust's f32::total_cmp as an integer order: a > b in total order iff key(a) > key(b).
__device__ __forceinline__ int total_key(float x) {
    const int i = __float_as_int(x);
    return i ^ ((i >> 31) & 0x7fffffff);
}

// After AdamW, per bond (one block each; compress.rs keep_min_rank, then normalise_gates):
// 1. min_rank: with k = min(min_rank, r) and fewer than k entries above tau, the k largest
//    entries (ties: the lower index first) that are at or below tau are set to `floor`
//    (2 tau, or 1e-3 when tau = 0).
// 2. normalise (when `normalise` != 0): m = max(0, max_j d_j); unless m <= tau or |m - 1| <
//    1e-6, every active entry d_j -> d_j / m and column j of the left core -> m * column j
//    (left_rows rows of r), which leaves the product core diag(g(d)) unchanged.
// Nothing when the step's clip factor is NaN (a non-finite gradient norm: AdamW skipped the
// update and the host reports the divergence; the CPU leaves the parameters alone then too).
// r <= 1024 (checked by the plan).
extern "C" __global__ void rank_project(float* __restrict__ w,
                                        const long long* __restrict__ gate_off,
                                        const int* __restrict__ bond_len,
                                        const long long* __restrict__ left_off,
                                        const long long* __restrict__ left_rows, float tau,
                                        int min_rank, int normalise, float floor,
                                        const float* __restrict__ clip) {
    __shared__ unsigned char active[1024];
    __shared__ float m_shared;
    if (isnan(clip[0])) return;
    const int b = blockIdx.x, r = bond_len[b];
    float* d = w + gate_off[b];
    if (threadIdx.x == 0) {
        const int k = min_rank < r ? min_rank : r;
        int alive = 0;
        for (int j = 0; j < r; ++j) {
            active[j] = 0;  // here: chosen by min_rank
            alive += d[j] > tau;
        }
        if (alive < k) {
            for (int n = 0; n < k; ++n) {
                int best = -1;
                for (int j = 0; j < r; ++j) {
                    if (!active[j] && (best < 0 || total_key(d[j]) > total_key(d[best]))) best = j;
                }
                active[best] = 1;
                if (!(d[best] > tau)) d[best] = floor;
            }
        }
        float m = 0.0f;
        for (int j = 0; j < r; ++j) m = fmaxf(m, d[j]);
        const bool skip = !normalise || !(m > tau) || fabsf(m - 1.0f) < 1e-6f;
        m_shared = skip ? 0.0f : m;
        for (int j = 0; j < r; ++j) {
            active[j] = !skip && d[j] > tau;
            if (active[j]) d[j] /= m;
        }
    }
    __syncthreads();
    const float m = m_shared;
    if (m == 0.0f) return;
    float* core = w + left_off[b];
    const long long n = left_rows[b] * (long long)r;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
        if (active[i % r]) core[i] *= m;
    }
}

// The gates of every bond, back to back (one block per bond): out[pos[b] + j] = d_bj, pos the
// bonds' running lengths. For the host's view of the active ranks between steps, without
// copying the whole arena.
extern "C" __global__ void rank_gather_gates(const float* __restrict__ w,
                                             const long long* __restrict__ gate_off,
                                             const int* __restrict__ bond_len,
                                             const int* __restrict__ pos,
                                             float* __restrict__ out) {
    const int b = blockIdx.x;
    for (int j = threadIdx.x; j < bond_len[b]; j += blockDim.x) {
        out[pos[b] + j] = w[gate_off[b] + j];
    }
}
