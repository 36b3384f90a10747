// GELU, the exact-erf form BERT uses (comera-layers activation.rs):
//   y = x Phi(x) = x (1 + erf(x / sqrt 2)) / 2,
//   dy/dx = Phi(x) + x phi(x),  phi(x) = exp(-x^2 / 2) / sqrt(2 pi).
// erf by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7), the CPU engine's formula:
//   z = |x| / sqrt 2, t = 1 / (1 + p z), erf(z) = 1 - t P(t) exp(-z^2), odd in x;
// exp(-z^2) = exp(-x^2 / 2) is the exp that phi needs too. Polynomials in fmaf, as the CPU's
// mul_add.

#define INV_SQRT_2 0.70710678118654752f
#define INV_SQRT_2PI 0.3989423f

__device__ __forceinline__ void gelu_cdf_pdf(float x, float* cdf, float* pdf) {
    const float P = 0.3275911f;
    const float A0 = 0.2548296f, A1 = -0.28449674f, A2 = 1.4214138f, A3 = -1.4531521f,
                A4 = 1.0614054f;
    const float z = fabsf(x * INV_SQRT_2);
    const float t = 1.0f / fmaf(P, z, 1.0f);
    const float poly = t * fmaf(fmaf(fmaf(fmaf(A4, t, A3), t, A2), t, A1), t, A0);
    const float e = expf(-0.5f * x * x);
    const float erf = copysignf(fmaf(-poly, e, 1.0f), x);
    *cdf = fmaf(erf, 0.5f, 0.5f);
    *pdf = INV_SQRT_2PI * e;
}

// y = GELU(x) (y may alias x). Grid-stride over n.
extern "C" __global__ void gelu_forward(const float* x, float* y, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float cdf, pdf;
        const float v = x[i];
        gelu_cdf_pdf(v, &cdf, &pdf);
        y[i] = v * cdf;
    }
}

// h (rows, width): g = GELU(h + bias) and h <- GELU'(h + bias), one Phi/phi per value (the
// forward of a linear layer's output with its bias, keeping the derivative for the backward).
extern "C" __global__ void gelu_bias_value_grad(float* __restrict__ h,
                                                const float* __restrict__ bias,
                                                float* __restrict__ g, long long rows,
                                                int width) {
    const long long n = rows * width;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float cdf, pdf;
        const float v = h[i] + bias[i % width];
        gelu_cdf_pdf(v, &cdf, &pdf);
        g[i] = v * cdf;
        h[i] = fmaf(v, pdf, cdf);
    }
}

// dx = dy * GELU'(x), x the forward's input (dx may alias dy). Grid-stride over n.
extern "C" __global__ void gelu_backward(const float* __restrict__ x, const float* dy, float* dx,
                                         long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float cdf, pdf;
        const float v = x[i];
        gelu_cdf_pdf(v, &cdf, &pdf);
        dx[i] = dy[i] * fmaf(v, pdf, cdf);
    }
}
