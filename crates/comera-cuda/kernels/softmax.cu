// The masked softmax of attention rows and its backward (comera-layers attention.rs). The scores
// S = Q K^T (unscaled; cuBLAS writes them) are (units = B H, T, T), unit u = b H + h. With
// s = 1/sqrt(head dim) and the allowed keys A(b, i) = { j : allow[b, j] != 0, and j <= i if
// causal }:
//   P_ij = exp(s S_ij - s m_i) / sum_{k in A} exp(s S_ik - s m_i) for j in A, 0 otherwise,
//   m_i = max_{j in A} S_ij; a row with no allowed key is all zeros.
// Backward, in place on dP: dS_ij = s P_ij (dP_ij - sum_k P_ik dP_ik).
// One warp per row: lane l takes j = l, l + 32, ...; the row sums and maxima are warp
// butterflies (fixed order, see common.cuh).

#define NEG_INF (-__int_as_float(0x7f800000))

// scores (units, T, T) -> P in place; allow (B, T); stats (units, T, 2) = (m_i, 1/sum) when not
// null (a backward that recomputes P reads them). Grid: ceil(units T / (blockDim.x / 32)).
extern "C" __global__ void softmax_rows_forward(float* __restrict__ scores,
                                                const float* __restrict__ allow, int units,
                                                int heads, int seq, float scale, int causal,
                                                float* __restrict__ stats) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (long long)units * seq) return;
    const int i = (int)(row % seq);
    const int b = (int)(row / seq) / heads;
    const float* al = allow + (size_t)b * seq;
    float* p = scores + (size_t)row * seq;
    const int len = causal ? i + 1 : seq;
    float m = NEG_INF;
    for (int j = lane; j < len; j += 32) {
        const float v = al[j] != 0.0f ? p[j] : NEG_INF;
        m = v > m ? v : m;
    }
    m = warp_reduce(m, MaxOp<float>());
    if (m == NEG_INF) {
        for (int j = lane; j < seq; j += 32) p[j] = 0.0f;
        if (stats && lane == 0) {
            stats[2 * row] = m;
            stats[2 * row + 1] = 0.0f;
        }
        return;
    }
    const float shift = scale * m;
    float sum = 0.0f;
    for (int j = lane; j < seq; j += 32) {
        float e = 0.0f;
        if (j < len && al[j] != 0.0f) e = expf(scale * p[j] - shift);
        p[j] = e;
        sum += e;
    }
    sum = warp_reduce(sum, SumOp<float>());
    const float inv = 1.0f / sum;
    for (int j = lane; j < seq; j += 32) p[j] *= inv;
    if (stats && lane == 0) {
        stats[2 * row] = m;
        stats[2 * row + 1] = inv;
    }
}

// dp (units, T, T) <- dS in place, from P (units, T, T). Grid as the forward.
extern "C" __global__ void softmax_rows_backward(const float* __restrict__ probs,
                                                 float* __restrict__ dp, int units, int seq,
                                                 float scale) {
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= (long long)units * seq) return;
    const float* p = probs + (size_t)row * seq;
    float* d = dp + (size_t)row * seq;
    float dot = 0.0f;
    for (int j = lane; j < seq; j += 32) dot += p[j] * d[j];
    dot = warp_reduce(dot, SumOp<float>());
    for (int j = lane; j < seq; j += 32) d[j] = scale * p[j] * (d[j] - dot);
}
