// Seeded inverted dropout (comera-layers dropout.rs): the same mask as the CPU engine, bit for bit.
// The mask is a pure function of (seed, step, i):
//   k = mix(seed ^ mix(step + phi)),  u_i = mix(k + (i + 1) phi),  keep_i = (u_i >> 32) >= t,
// mix = SplitMix64's finaliser, phi = 0x9E3779B97F4A7C15, t = round(p 2^32) (from the host).
// Training: y_i = keep_i x_i / (1 - p); backward dx_i = keep_i dy_i / (1 - p), the same kernel.
// The step is read from device memory (`step` points at one u64 the step's graph advances), so
// a captured CUDA graph replays with a new mask every step; nothing is stored for the backward,
// which recomputes the mask.

#define GOLDEN 0x9E3779B97F4A7C15ull

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u64 dropout_key(u64 seed, u64 step) {
    return mix64(seed ^ mix64(step + GOLDEN));
}

__device__ __forceinline__ bool dropout_keep(u64 key, u64 i, u64 threshold) {
    return (mix64(key + (i + 1) * GOLDEN) >> 32) >= threshold;
}

// out_i = keep_i scale in_i (out may alias in). Grid-stride over n.
extern "C" __global__ void dropout_apply(const float* in, float* out, long long n, u64 seed,
                                         const u64* __restrict__ step, u64 threshold,
                                         float scale) {
    const u64 key = dropout_key(seed, *step);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = dropout_keep(key, (u64)i, threshold) ? in[i] * scale : 0.0f;
    }
}

// The residual sum of a post-LN block with its dropped branch: out_i = x_i + keep_i scale b_i.
extern "C" __global__ void dropout_add(const float* __restrict__ x, const float* __restrict__ branch,
                                       float* __restrict__ out, long long n, u64 seed,
                                       const u64* __restrict__ step, u64 threshold, float scale) {
    const u64 key = dropout_key(seed, *step);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = x[i] + (dropout_keep(key, (u64)i, threshold) ? branch[i] * scale : 0.0f);
    }
}

// The mask itself, 1.0 kept / 0.0 dropped (tests compare it with the CPU's Dropout::keep).
extern "C" __global__ void dropout_mask(float* __restrict__ out, long long n, u64 seed,
                                        const u64* __restrict__ step, u64 threshold) {
    const u64 key = dropout_key(seed, *step);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        out[i] = dropout_keep(key, (u64)i, threshold) ? 1.0f : 0.0f;
    }
}

// *step += 1: the last node of a captured step, so the next replay draws the next masks.
extern "C" __global__ void step_advance(u64* step) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *step += 1;
}
