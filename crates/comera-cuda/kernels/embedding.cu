// Embedding lookups and their deterministic backward (comera-layers embedding.rs,
// ttm_embedding.rs).
//
// Forward, dense table: out[t] = table[id_t] (gather_rows with slot = ids).
// Forward, TTM table: each distinct id's row once (ttm_rows, one block per distinct id), then
// out[t] = rows[slot_t] (gather_rows with the token -> distinct-id slot).
// Backward: the host sorts the batch's token indices stably by id once per batch (index
// bookkeeping, uploaded with the ids), giving segments of equal ids in token order. Then
//   dst[row_u] (+)= sum_{s in segment u, in order} dy[order_s]   (segment_sum_rows),
// the same additions in the same order as the CPU's `grad[id] += dy[t]` over tokens: for the
// dense table the same bits, with no atomics.

// out (tokens, D) = src[slot_t] for src (rows, D). Grid: tokens blocks, threads over D.
extern "C" __global__ void gather_rows(const float* __restrict__ src,
                                       const unsigned int* __restrict__ slot, int tokens, int dim,
                                       float* __restrict__ out) {
    const int t = blockIdx.x;
    if (t >= tokens) return;
    const float* s = src + (size_t)slot[t] * dim;
    float* o = out + (size_t)t * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) o[c] = s[c];
}

// dy (tokens, D); order (tokens): token indices sorted stably by id; seg_start (segments + 1):
// segment u is order[seg_start[u] .. seg_start[u+1]]; dst_row (segments) or null (row u).
// dst[dst_row_u, c] = (accumulate ? dst[dst_row_u, c] : 0) + dy[order_s, c] over the segment in
// order. Grid: segments blocks, threads over D. An empty segment that accumulates leaves its row
// untouched (it returns at once): padded segments may name a row that a real segment adds to,
// and must not race with it by writing back what they read.
extern "C" __global__ void segment_sum_rows(const float* __restrict__ dy,
                                            const unsigned int* __restrict__ order,
                                            const unsigned int* __restrict__ seg_start,
                                            const unsigned int* __restrict__ dst_row,
                                            int segments, int dim, int accumulate,
                                            float* __restrict__ dst) {
    const int u = blockIdx.x;
    if (u >= segments) return;
    const size_t row = dst_row ? dst_row[u] : (unsigned int)u;
    float* d = dst + row * dim;
    const unsigned int s0 = seg_start[u], s1 = seg_start[u + 1];
    if (accumulate && s0 == s1) return;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
        float acc = accumulate ? d[c] : 0.0f;
        for (unsigned int s = s0; s < s1; ++s) acc += dy[(size_t)order[s] * dim + c];
        d[c] = acc;
    }
}

// TTM rows. Cores F_k (r_k, v_k, e_k, r_{k+1}) at cores + core_off[k] (r_0 = r_p = 1), gates
// on bonds 1..p-1 at gates + gate_off[k] (length r_k, k = 1..p-1; gate_off[0] unused), the
// thresholded gate g(d) = d if d > tau else 0. Id i has digits (i_0..i_{p-1}) over v, i_0
// slowest; with slab_k(i)[a, c, b] = F_k[a, i, c, b] g_{k+1}[b] (no gate after the last core):
//   A_0 = slab_0(i_0)  (e_0 x r_1),
//   A_k[(c', c), b] = sum_{a, ascending} A_{k-1}[c', a] slab_k(i_k)[a, c, b]  (E_k x r_{k+1}),
// and E[i] = A_{p-1}[:, 0] (row-major over (c_0..c_{p-1}), c_0 slowest).
// meta (int32): [p, v_0..v_{p-1}, e_0..e_{p-1}, r_0..r_p, core_off_0..core_off_{p-1},
//   gate_off_0..gate_off_{p-1}].

struct TtmMeta {
    int p;
    const int* v;
    const int* e;
    const int* r;
    const int* core_off;
    const int* gate_off;
};

__device__ __forceinline__ TtmMeta ttm_meta(const int* meta) {
    TtmMeta m;
    m.p = meta[0];
    m.v = meta + 1;
    m.e = m.v + m.p;
    m.r = m.e + m.p;
    m.core_off = m.r + m.p + 1;
    m.gate_off = m.core_off + m.p;
    return m;
}

// Digits of an id, i_0 slowest (at most 16 cores).
__device__ __forceinline__ void ttm_digits(const TtmMeta& m, unsigned int id, int* digit) {
    for (int k = m.p - 1; k >= 0; --k) {
        digit[k] = (int)(id % (unsigned int)m.v[k]);
        id /= (unsigned int)m.v[k];
    }
}

// The gated slab entry slab_k(i)[a, c, b].
__device__ __forceinline__ float ttm_slab(const TtmMeta& m, const float* cores, const float* gates,
                                          float tau, int k, int i, int a, int c, int b) {
    const int ek = m.e[k], rb = m.r[k + 1];
    const float f = cores[m.core_off[k] + (((size_t)a * m.v[k] + i) * ek + c) * rb + b];
    if (k + 1 == m.p) return f;
    const float d = gates[m.gate_off[k + 1] + b];
    return f * (d > tau ? d : 0.0f);
}

// A_{last} of the chain over cores 0..last into one of the two buffers (ping-pong), returned.
// rows_out = E_last. With last = -1: A = [1] (1 x 1) in `x`. All threads of the block call it.
__device__ float* ttm_chain(const TtmMeta& m, const float* cores, const float* gates, float tau,
                            const int* digit, int last, float* x, float* y, int* rows_out) {
    float* prev = x;
    float* next = y;
    if (last < 0) {
        if (threadIdx.x == 0) x[0] = 1.0f;
        __syncthreads();
        *rows_out = 1;
        return x;
    }
    int rows_prev = 1;  // E_{k-1} (1 before the first core, r_0 = 1)
    for (int k = 0; k <= last; ++k) {
        const int ra = m.r[k], ek = m.e[k], rb = m.r[k + 1];
        const int n = rows_prev * ek * rb;
        for (int idx = threadIdx.x; idx < n; idx += blockDim.x) {
            const int b = idx % rb;
            const int c = (idx / rb) % ek;
            const int row = idx / (rb * ek);
            float acc = 0.0f;
            for (int a = 0; a < ra; ++a) {
                const float left = k == 0 ? 1.0f : prev[row * ra + a];
                acc += left * ttm_slab(m, cores, gates, tau, k, digit[k], a, c, b);
            }
            next[idx] = acc;
        }
        __syncthreads();
        float* t = prev;
        prev = next;
        next = t;
        rows_prev *= ek;
    }
    *rows_out = rows_prev;
    return prev;
}

// rows (count, D) = the table's rows of ids (count). Dynamic shared memory: two buffers of
// `chain` floats (the largest E_k r_{k+1}). Grid: count blocks, any block size. With `live`
// (may be null), only the first live[0] ids are computed: a captured step's grid is fixed at
// the batch's N tokens, and the batch's distinct ids, written to device memory with each
// batch, are fewer; the rows past them are never read.
extern "C" __global__ void ttm_rows(const float* __restrict__ cores,
                                    const float* __restrict__ gates,
                                    const int* __restrict__ meta, float tau,
                                    const unsigned int* __restrict__ ids, int count, int chain,
                                    float* __restrict__ rows, const int* __restrict__ live) {
    extern __shared__ float buf[];
    const int u = blockIdx.x;
    if (u >= count || (live && u >= live[0])) return;
    const TtmMeta m = ttm_meta(meta);
    int digit[16];
    ttm_digits(m, ids[u], digit);
    int dim;
    const float* a = ttm_chain(m, cores, gates, tau, digit, m.p - 1, buf, buf + chain, &dim);
    float* out = rows + (size_t)u * dim;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) out[c] = a[c];
}

// Backward, stage 1: for distinct id u with row gradient dE_u = drows[u] (D), the gradient of
// each slab of its chain, dslab_k[a, c, b] = sum_{c', ascending} A_{k-1}[c', a] dA_k[(c', c), b],
// with dA_{p-1} = dE_u and dA_{k-1}[c', a] = sum_{c, b ascending} dA_k[(c', c), b] slab_k[a, c, b].
// slab_grads (count, S), S = sum_k r_k e_k r_{k+1}, core k's slab at offset sum_{j<k} r_j e_j r_{j+1},
// layout (a, c, b). Dynamic shared memory: three buffers of `chain` floats. Grid: count blocks.
// `live` as in ttm_rows: the slab gradients past the first live[0] ids are not computed (the
// per-digit sums read only the batch's distinct ids').
extern "C" __global__ void ttm_slab_grads(const float* __restrict__ cores,
                                          const float* __restrict__ gates,
                                          const int* __restrict__ meta, float tau,
                                          const unsigned int* __restrict__ ids, int count,
                                          int chain, const float* __restrict__ drows,
                                          float* __restrict__ slab_grads,
                                          const int* __restrict__ live) {
    extern __shared__ float buf[];
    const int u = blockIdx.x;
    if (u >= count || (live && u >= live[0])) return;
    const TtmMeta m = ttm_meta(meta);
    int digit[16];
    ttm_digits(m, ids[u], digit);
    int slab_total = 0, dim = 1;
    for (int k = 0; k < m.p; ++k) {
        slab_total += m.r[k] * m.e[k] * m.r[k + 1];
        dim *= m.e[k];
    }
    float* bufs[3] = {buf, buf + chain, buf + 2 * chain};
    int da = 2;  // bufs[da] holds dA_k
    for (int c = threadIdx.x; c < dim; c += blockDim.x) bufs[da][c] = drows[(size_t)u * dim + c];
    __syncthreads();
    int slab_off = slab_total;
    for (int k = m.p - 1; k >= 0; --k) {
        const int ra = m.r[k], ek = m.e[k], rb = m.r[k + 1];
        slab_off -= ra * ek * rb;
        const int x = (da + 1) % 3, y = (da + 2) % 3;
        int rows_prev;
        const float* a_prev =
            ttm_chain(m, cores, gates, tau, digit, k - 1, bufs[x], bufs[y], &rows_prev);
        const float* d = bufs[da];
        float* out = slab_grads + (size_t)u * slab_total + slab_off;
        for (int idx = threadIdx.x; idx < ra * ek * rb; idx += blockDim.x) {
            const int b = idx % rb;
            const int c = (idx / rb) % ek;
            const int a = idx / (rb * ek);
            float acc = 0.0f;
            for (int cp = 0; cp < rows_prev; ++cp) acc += a_prev[cp * ra + a] * d[(cp * ek + c) * rb + b];
            out[idx] = acc;
        }
        if (k > 0) {
            // dA_{k-1} into the chain buffer that does not hold A_{k-1}.
            const int free_buf = a_prev == bufs[x] ? y : x;
            float* dprev = bufs[free_buf];
            for (int idx = threadIdx.x; idx < rows_prev * ra; idx += blockDim.x) {
                const int a = idx % ra;
                const int cp = idx / ra;
                float acc = 0.0f;
                for (int c = 0; c < ek; ++c)
                    for (int b = 0; b < rb; ++b)
                        acc += d[(cp * ek + c) * rb + b] * ttm_slab(m, cores, gates, tau, k, digit[k], a, c, b);
                dprev[idx] = acc;
            }
            __syncthreads();
            da = free_buf;
        }
    }
}

// Backward, stage 2, one core k: dh (r_k, v_k, e_k, r_{k+1}) = the summed slab gradients,
//   dh[a, i, c, b] = sum_{u in segment i, in order} slab_grads[u, slab_off + (a e_k + c) r_{k+1} + b],
// segment i = order[start[i] .. start[i+1]]: the distinct ids whose digit k is i, ascending.
// Gates are applied afterwards (gated_grads_core / gated_grads_gate in rank.cu).
// Grid-stride over the core's elements.
extern "C" __global__ void ttm_core_grad_sums(const float* __restrict__ slab_grads,
                                              int slab_total, int slab_off,
                                              const unsigned int* __restrict__ order,
                                              const unsigned int* __restrict__ start, int ra,
                                              int vk, int ek, int rb, float* __restrict__ dh) {
    const long long n = (long long)ra * vk * ek * rb;
    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < n;
         idx += (long long)gridDim.x * blockDim.x) {
        const int b = (int)(idx % rb);
        const int c = (int)((idx / rb) % ek);
        const int i = (int)((idx / ((long long)rb * ek)) % vk);
        const int a = (int)(idx / ((long long)rb * ek * vk));
        const int at = slab_off + (a * ek + c) * rb + b;
        float acc = 0.0f;
        for (unsigned int s = start[i]; s < start[i + 1]; ++s)
            acc += slab_grads[(size_t)order[s] * slab_total + at];
        dh[idx] = acc;
    }
}
