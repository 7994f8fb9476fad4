// gelu.cu - GELU with the tanh approximation (GPT-2's MLP activation, HF's "gelu_new"): forward and backward, each
// with a fused FP8 absmax.
//
// out = 0.5 x (1 + tanh(k (x + c x^3))), k = sqrt(2/pi), c = 0.044715, in fp32 in the order the torch default of
// backends/base.py writes it (tanhf: CUDA's accurate tanh, not the tanh.approx instruction), rounded once to the
// model dtype. The backward recomputes the tanh from the forward input instead of loading a saved one:
// dinp = dout * (0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3c x^2)).
//
// Element-wise over the flat tensors (contiguous, n elements): VEC elements (16 bytes) per access when n is a
// multiple of VEC and every pointer is 16-byte aligned (else VEC = 1), grid-stride over the vectors, each input
// read once and each output written once. max|output| of the stored (rounded) values is reduced per block and
// merged by one atomicMax on the float bits, so quantizing the output for an FP8 GEMM (the down projection's input
// in the forward, the up projection's dy in the backward) needs no extra pass over memory.

#define GELU_K 0.7978845608028654f        // sqrt(2 / pi)
#define GELU_C 0.044715f
#define GELU_3C ((float)(3.0 * 0.044715))  // as torch evaluates the Python constant 3.0 * 0.044715

__device__ __forceinline__ float gelu_tanh_of(float x) {
    return tanhf(GELU_K * (x + GELU_C * x * x * x));
}

template <typename T, int VEC>
__global__ void gelu_fwd(T* __restrict__ out, const T* __restrict__ inp, unsigned* __restrict__ absmax, i64 n) {
    const i64 nvec = n / VEC;
    unsigned m = 0u;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += (i64)gridDim.x * blockDim.x) {
        float x[VEC], y[VEC];
        load_f32<T, VEC>(inp + i * VEC, x);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            y[e] = round_to<T>(0.5f * x[e] * (1.f + gelu_tanh_of(x[e])));
            m = max(m, abs_bits(y[e]));
        }
        store_f32<T, VEC>(out + i * VEC, y);
    }
    if (absmax != nullptr) block_atomic_max(absmax, m);
}

template <typename T, int VEC>
__global__ void gelu_bwd(T* __restrict__ dinp, const T* __restrict__ dout, const T* __restrict__ inp,
                         unsigned* __restrict__ absmax, i64 n) {
    const i64 nvec = n / VEC;
    unsigned m = 0u;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += (i64)gridDim.x * blockDim.x) {
        float x[VEC], g[VEC], d[VEC];
        load_f32<T, VEC>(inp + i * VEC, x);
        load_f32<T, VEC>(dout + i * VEC, g);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const float t = gelu_tanh_of(x[e]);
            const float grad = 0.5f * (1.f + t) + 0.5f * x[e] * (1.f - t * t) * GELU_K * (1.f + GELU_3C * x[e] * x[e]);
            d[e] = round_to<T>(g[e] * grad);  // rounded here so that max|dinp| is taken of the stored values
            m = max(m, abs_bits(d[e]));
        }
        store_f32<T, VEC>(dinp + i * VEC, d);
    }
    if (absmax != nullptr) block_atomic_max(absmax, m);  // the FP8 up projection's dy scale, no extra pass
}
