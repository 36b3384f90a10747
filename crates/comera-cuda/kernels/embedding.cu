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
// order. Grid: segments blocks, threads over D.
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
//   gate_off_0..gate_off_{p-1}]. The two ping-pong buffers of `chain` floats each (the largest
// E_k r_{k+1}) are dynamic shared memory (2 chain floats). Grid: distinct ids, block any size.
extern "C" __global__ void ttm_rows(const float* __restrict__ cores,
                                    const float* __restrict__ gates,
                                    const int* __restrict__ meta, float tau,
                                    const unsigned int* __restrict__ ids, int count, int chain,
                                    float* __restrict__ rows) {
    extern __shared__ float buf[];
    const int u = blockIdx.x;
    if (u >= count) return;
    const int p = meta[0];
    const int* v = meta + 1;
    const int* e = v + p;
    const int* r = e + p;
    const int* core_off = r + p + 1;
    const int* gate_off = core_off + p;
    // Digits of the id, i_0 slowest (at most 16 cores).
    int digit[16];
    unsigned int rest = ids[u];
    for (int k = p - 1; k >= 0; --k) {
        digit[k] = (int)(rest % (unsigned int)v[k]);
        rest /= (unsigned int)v[k];
    }
    float* prev = buf;
    float* next = buf + chain;
    int rows_prev = 1;  // E_{k-1}: rows of A_{k-1} (1 before the first core, r_0 = 1)
    for (int k = 0; k < p; ++k) {
        const int ra = r[k], ek = e[k], rb = r[k + 1];
        const float* core = cores + core_off[k] + (size_t)digit[k] * ek * rb;  // [a] stride v_k e_k r_{k+1}
        const size_t a_stride = (size_t)v[k] * ek * rb;
        const float* gate = k + 1 < p ? gates + gate_off[k + 1] : 0;
        const int n = rows_prev * ek * rb;
        for (int idx = threadIdx.x; idx < n; idx += blockDim.x) {
            const int b = idx % rb;
            const int c = (idx / rb) % ek;
            const int row = idx / (rb * ek);
            float g = 1.0f;
            if (gate) {
                const float d = gate[b];
                g = d > tau ? d : 0.0f;
            }
            float acc = 0.0f;
            for (int a = 0; a < ra; ++a) {
                const float left = k == 0 ? 1.0f : prev[row * ra + a];
                acc += left * (core[a * a_stride + c * rb + b] * g);
            }
            next[(row * ek + c) * rb + b] = acc;
        }
        __syncthreads();
        float* t = prev;
        prev = next;
        next = t;
        rows_prev *= ek;
    }
    // prev: (D x 1), D = rows_prev.
    float* out = rows + (size_t)u * rows_prev;
    for (int c = threadIdx.x; c < rows_prev; c += blockDim.x) out[c] = prev[c];
}
