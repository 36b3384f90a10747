// Shared by every kernel source: the host prepends this file to each .cu before NVRTC compiles
// it (NVRTC has no include path here; the sources include nothing else).
//
// Determinism: no float atomics anywhere. Every reduction is a fixed tree: within a warp a
// butterfly over lane offsets 16, 8, 4, 2, 1 (__shfl_xor_sync; a + b = b + a in IEEE arithmetic,
// so every lane ends with the same bits), then warp 0 combines the warps' results in the same
// butterfly. The result depends on the inputs and the block size only, never on scheduling.
// Kernels are compiled with --fmad=false: a*b + c stays two roundings, as on the CPU engine;
// where the CPU code uses mul_add the kernel writes fmaf.

typedef unsigned long long u64;
typedef unsigned int u32;

#define FULL_MASK 0xffffffffu

template <typename T> struct SumOp {
    __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
template <typename T> struct MaxOp {
    __device__ __forceinline__ T operator()(T a, T b) const { return a > b ? a : b; }
};

// Butterfly over the 32 lanes of a warp: every lane gets op(all lanes), the same bits.
template <typename T, typename Op> __device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = op(v, __shfl_xor_sync(FULL_MASK, v, offset));
    }
    return v;
}

// op over the whole block (blockDim.x a multiple of 32, at most 1024), returned to every thread.
// `shared` holds 32 values of T. `identity` fills the lanes past the last warp. Ends with a
// barrier, so `shared` may be reused right after.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T v, Op op, T identity, T* shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    v = warp_reduce(v, op);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    if (warp == 0) {
        T w = lane < warps ? shared[lane] : identity;
        w = warp_reduce(w, op);
        if (lane == 0) shared[0] = w;
    }
    __syncthreads();
    T total = shared[0];
    __syncthreads();
    return total;
}

template <typename T> __device__ __forceinline__ T block_sum(T v, T* shared) {
    return block_reduce(v, SumOp<T>(), T(0), shared);
}
