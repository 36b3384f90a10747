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

// h (rows, r) = core (rows, r) with column j scaled by g(d_j). Grid-stride over rows * r.
extern "C" __global__ void gate_columns(const float* __restrict__ core,
                                        const float* __restrict__ gate, long long rows, int r,
                                        float tau, float* __restrict__ h) {
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
// core_grad += dh. Two kernels: the core (grid-stride over rows r) and the gate (one thread per
// j, rows in order, the CPU's order).
extern "C" __global__ void gated_grads_core(const float* __restrict__ dh,
                                            const float* __restrict__ gate, long long rows,
                                            int r, float tau, float* __restrict__ core_grad) {
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

extern "C" __global__ void gated_grads_gate(const float* __restrict__ dh,
                                            const float* __restrict__ core,
                                            const float* __restrict__ gate, long long rows, int r,
                                            float tau, float* __restrict__ gate_grad) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= r || !(gate[j] > tau)) return;
    float acc = gate_grad[j];
    for (long long row = 0; row < rows; ++row) acc += dh[row * r + j] * core[row * r + j];
    gate_grad[j] = acc;
}
