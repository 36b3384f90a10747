// The encoder step's glue kernels (comera-model encoder, comera-layers attention.rs and
// activation.rs).
//
// heads_permute: attention's per-head layout for cuBLAS' strided batches. Rows (N = B T, width
// `row_stride`) hold head h of a sequence in columns col_off + h dh .. col_off + (h+1) dh; the
// head layout is (B, H, T, dh), unit u = b H + h contiguous (T x dh):
//   heads[((b H + h) T + t) dh + i] = rows[(b T + t) row_stride + col_off + h dh + i]
// to_heads != 0 copies rows -> heads, else heads -> rows (only the head columns are written).
// Grid-stride over B H T dh elements, i fastest (coalesced on both sides for dh >= 32).
extern "C" __global__ void heads_permute(const float* __restrict__ src, float* __restrict__ dst,
                                         int batch, int seq, int heads, int dh, int row_stride,
                                         int col_off, int to_heads) {
    const long long n = (long long)batch * heads * seq * dh;
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n;
         e += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(e % dh);
        long long r = e / dh;
        const int t = (int)(r % seq);
        r /= seq;
        const int h = (int)(r % heads);
        const int b = (int)(r / heads);
        const long long row = ((long long)b * seq + t) * row_stride + col_off + (long long)h * dh + i;
        if (to_heads) {
            dst[e] = src[row];
        } else {
            dst[row] = src[e];
        }
    }
}

// The pooler's activation (activation.rs Tanh): y = tanh(x).
extern "C" __global__ void tanh_forward(const float* __restrict__ x, float* __restrict__ y,
                                        long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] = tanhf(x[i]);
    }
}

// Its backward from the pre-activation x, in place on the gradient: d <- d (1 - tanh(x)^2).
extern "C" __global__ void tanh_backward(const float* __restrict__ x, float* __restrict__ d,
                                         long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float y = tanhf(x[i]);
        d[i] = d[i] * (1.0f - y * y);
    }
}
