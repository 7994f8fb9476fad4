// swiglu.cu - SwiGLU forward (with a fused FP8 absmax) and backward over the fused up+gate GEMM output.
//
// inp[N, 2I] = [up | gate], out[N, I] = up * silu(gate) = up * gate / (1 + exp(-gate)). Element-wise, VEC
// elements (16 bytes) per access, grid-stride over all vectors of out: each input read once, each output
// written once; the backward recomputes sigmoid(gate) instead of loading a saved one. The forward's max|out|
// (of the rounded outputs) is reduced per block (redux.sync + shared memory) and merged by one atomicMax
// on the float bits, so quantizing out for the down projection needs no extra pass over memory.

template <typename T, int VEC>
__global__ void swiglu_fwd(T* __restrict__ out, const T* __restrict__ inp, unsigned* __restrict__ absmax, i64 N,
                           int I) {
    const int nv = I / VEC;
    const i64 total = N * nv;
    unsigned m = 0u;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 row = i / nv;
        const int j = (int)(i - row * nv) * VEC;
        float up[VEC], gate[VEC];
        load_f32<T, VEC>(inp + row * 2 * I + j, up);
        load_f32<T, VEC>(inp + row * 2 * I + I + j, gate);
        Pack<T, VEC> y;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            y.v[e] = from_f32<T>(up[e] * (gate[e] / (1.f + expf(-gate[e]))));
            m = max(m, abs_bits(to_f32(y.v[e])));
        }
        store_pack<T, VEC>(out + row * I + j, y);
    }
    if (absmax != nullptr) block_atomic_max(absmax, m);
}

template <typename T, int VEC>
__global__ void swiglu_bwd(T* __restrict__ dinp, const T* __restrict__ dout, const T* __restrict__ inp,
                           unsigned* __restrict__ absmax, i64 N, int I) {
    const int nv = I / VEC;
    const i64 total = N * nv;
    unsigned m = 0u;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 row = i / nv;
        const int j = (int)(i - row * nv) * VEC;
        float up[VEC], gate[VEC], g[VEC], dup[VEC], dgate[VEC];
        load_f32<T, VEC>(inp + row * 2 * I + j, up);
        load_f32<T, VEC>(inp + row * 2 * I + I + j, gate);
        load_f32<T, VEC>(dout + row * I + j, g);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            const float sig = 1.f / (1.f + expf(-gate[e]));
            // rounded to T here so that max|dinp| is taken of the stored values (store_f32 is then exact)
            dup[e] = to_f32(from_f32<T>(g[e] * (gate[e] * sig)));
            dgate[e] = to_f32(from_f32<T>(g[e] * up[e] * sig * (1.f + gate[e] * (1.f - sig))));
            m = max(m, max(abs_bits(dup[e]), abs_bits(dgate[e])));
        }
        store_f32<T, VEC>(dinp + row * 2 * I + j, dup);
        store_f32<T, VEC>(dinp + row * 2 * I + I + j, dgate);
    }
    if (absmax != nullptr) block_atomic_max(absmax, m);  // the FP8 up+gate GEMM's dy scale, no extra pass
}
