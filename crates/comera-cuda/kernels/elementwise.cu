// Element-wise sums and the column reductions (comera-layers elementwise.rs, linear biases).
// Every element is computed on its own; the column sums run in two fixed stages (chunks of
// rows in order, then the chunks in order), so the bits never depend on scheduling.

// out_i = a_i + b_i (out may alias a or b). Grid-stride over n.
extern "C" __global__ void add(const float* a, const float* b, float* out, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = a[i] + b[i];
    }
}

// acc_i += x_i. Grid-stride over n.
extern "C" __global__ void add_into(float* acc, const float* __restrict__ x, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        acc[i] += x[i];
    }
}

// y[r, c] += bias[c] for y (rows, width). Grid-stride over rows * width.
extern "C" __global__ void add_bias_rows(float* __restrict__ y, const float* __restrict__ bias,
                                         long long rows, int width) {
    const long long n = rows * width;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] += bias[i % width];
    }
}

// Stage 1 of a column sum of x (rows, width): partial[c, j] = sum_{rows of chunk c, in order}
// x[r, j]. partial: (chunks, width). Grid: (ceil(width / blockDim.x), chunks).
extern "C" __global__ void column_sum_partials(const float* __restrict__ x, int rows, int width,
                                               int rows_per_chunk,
                                               float* __restrict__ partial) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    const int chunk = blockIdx.y;
    if (j >= width) return;
    const int r0 = chunk * rows_per_chunk;
    const int r1 = min(rows, r0 + rows_per_chunk);
    float s = 0.0f;
    for (int r = r0; r < r1; ++r) s += x[(size_t)r * width + j];
    partial[(size_t)chunk * width + j] = s;
}

// Stage 2: out[j] (+)= sum_{c in order} partial[c stride + j] for j < width (stride >= width:
// LayerNorm's partials hold dgamma and dbeta side by side); `accumulate` adds to out (gradients
// accumulate, as the CPU layers' backward does), else overwrites. Grid: ceil(width / blockDim.x).
extern "C" __global__ void column_sum_finish(const float* __restrict__ partial, int chunks,
                                             int width, int stride, int accumulate,
                                             float* __restrict__ out) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= width) return;
    // Starting from out[j] when accumulating: ((out + p_0) + p_1) + ..., the CPU's order.
    float s = accumulate ? out[j] : 0.0f;
    for (int c = 0; c < chunks; ++c) s += partial[(size_t)c * stride + j];
    out[j] = s;
}

// x (rows, width): columns from .. width of every row set to `value` (the masked-LM head's
// padding logits of a TT decoder wider than the vocabulary, set to -inf: no probability, no
// gradient). Grid-stride over rows * (width - from).
extern "C" __global__ void fill_columns(float* __restrict__ x, long long rows, int width,
                                        int from, float value) {
    const int pad = width - from;
    const long long n = rows * pad;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        x[(i / pad) * width + from + i % pad] = value;
    }
}
