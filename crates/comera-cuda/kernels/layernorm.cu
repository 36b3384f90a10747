// LayerNorm over the last dimension (comera-layers norm.rs). For each row x (length D) of a
// (rows, D) buffer:
//   mu = (1/D) sum_i x_i,   var = (1/D) sum_i (x_i - mu)^2   (biased, two passes),
//   r = 1/sqrt(var + eps),  n_i = (x_i - mu) r,              y_i = gamma_i n_i + beta_i.
// Backward with dy' = dy (+ extra, when y also feeds a second consumer) and g_i = gamma_i dy'_i:
//   dx_i = r (g_i - mean_j(g_j) - n_i mean_j(g_j n_j)),
//   dgamma_i += sum_rows dy'_i n_i,   dbeta_i += sum_rows dy'_i.
// One block per row for the row kernels; the parameter gradients in two deterministic stages
// (per chunk of rows, then the chunks in order): layer_norm_param_partials, column_sum_finish.

// x, y: (rows, D); gamma, beta: (D); mean, rstd: (rows). Grid: rows blocks.
extern "C" __global__ void layer_norm_forward(const float* __restrict__ x,
                                              const float* __restrict__ gamma,
                                              const float* __restrict__ beta, float eps,
                                              int rows, int dim, float* __restrict__ y,
                                              float* __restrict__ mean_out,
                                              float* __restrict__ rstd_out) {
    __shared__ float shared[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const float* xr = x + (size_t)row * dim;
    float* yr = y + (size_t)row * dim;
    float s = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) s += xr[i];
    const float mean = block_sum(s, shared) / (float)dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float c = xr[i] - mean;
        ss += c * c;
    }
    const float var = block_sum(ss, shared) / (float)dim;
    const float rstd = 1.0f / sqrtf(var + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        yr[i] = gamma[i] * ((xr[i] - mean) * rstd) + beta[i];
    }
    if (threadIdx.x == 0) {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
}

// dx from x, dy (+ extra, may be null), the saved mean/rstd and gamma. Writes dx (rows, D).
// Grid: rows blocks.
extern "C" __global__ void layer_norm_backward_dx(const float* __restrict__ x,
                                                  const float* __restrict__ dy,
                                                  const float* __restrict__ extra,
                                                  const float* __restrict__ mean_in,
                                                  const float* __restrict__ rstd_in,
                                                  const float* __restrict__ gamma, int rows,
                                                  int dim, float* __restrict__ dx) {
    __shared__ float shared[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const size_t at = (size_t)row * dim;
    const float mean = mean_in[row], rstd = rstd_in[row];
    float sg = 0.0f, sgn = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float d = extra ? dy[at + i] + extra[at + i] : dy[at + i];
        const float n = (x[at + i] - mean) * rstd;
        sg += gamma[i] * d;
        sgn += gamma[i] * d * n;
    }
    const float mean_g = block_sum(sg, shared) / (float)dim;
    const float mean_gn = block_sum(sgn, shared) / (float)dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float d = extra ? dy[at + i] + extra[at + i] : dy[at + i];
        const float n = (x[at + i] - mean) * rstd;
        dx[at + i] = rstd * (gamma[i] * d - mean_g - n * mean_gn);
    }
}

// Stage 1 of dgamma, dbeta: chunk c of `rows_per_chunk` rows, column i:
//   partial[c, i] = sum_{rows of c, in order} dy'_i n_i,   partial[c, D + i] = sum dy'_i.
// partial: (chunks, 2D). Grid: (ceil(D / blockDim.x), chunks).
extern "C" __global__ void layer_norm_param_partials(const float* __restrict__ x,
                                                     const float* __restrict__ dy,
                                                     const float* __restrict__ extra,
                                                     const float* __restrict__ mean_in,
                                                     const float* __restrict__ rstd_in,
                                                     int rows, int dim, int rows_per_chunk,
                                                     float* __restrict__ partial) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const int chunk = blockIdx.y;
    if (i >= dim) return;
    const int r0 = chunk * rows_per_chunk;
    const int r1 = min(rows, r0 + rows_per_chunk);
    float dg = 0.0f, db = 0.0f;
    for (int r = r0; r < r1; ++r) {
        const size_t at = (size_t)r * dim + i;
        const float d = extra ? dy[at] + extra[at] : dy[at];
        const float n = (x[at] - mean_in[r]) * rstd_in[r];
        dg += d * n;
        db += d;
    }
    partial[(size_t)chunk * 2 * dim + i] = dg;
    partial[(size_t)chunk * 2 * dim + dim + i] = db;
}
