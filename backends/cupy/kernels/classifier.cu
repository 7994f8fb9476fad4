// classifier.cu - fused cross-entropy over a chunk of LM-head logits: loss per row, dlogits in place.
//
// One block (up to 1024 threads) per row of logits[n, V] (V ~ 152k). Pass 1 streams the row once with
// 16-byte loads; every thread keeps an online-softmax pair (running max m, sum of exp(x - m) rescaled when
// m grows), the pairs are merged across the warp with shuffles and across warps through shared memory:
// lse = m + log(sum). loss = lse - x[target] (the target's logit is read by thread 0 before anything is
// overwritten). Pass 2 re-reads the row (mostly from L2) and overwrites it with
// dloss * (exp(x - lse) - onehot(target)). Rows whose target is -100 get loss 0 and, without being read,
// an all-zero gradient. fp32 throughout; the logits are rounded once, when written back.

__device__ __forceinline__ void merge_softmax(float& m, float& s, float om, float os) {
    const float nm = fmaxf(m, om);
    s = (m == nm ? s : s * __expf(m - nm)) + (om == nm ? os : os * __expf(om - nm));
    m = nm;
}

template <typename T, int VEC, typename TI>
__global__ void __launch_bounds__(1024) classifier(T* logits, float* __restrict__ losses,
                                                   const TI* __restrict__ targets, int V, i64 stride, float dloss,
                                                   int write_dlogits) {
    __shared__ float sm_m[32], sm_s[32];
    __shared__ float sm_lse;
    const i64 row = blockIdx.x;
    T* base = logits + row * stride;
    const i64 tgt = (i64)targets[row];
    const int nv = V / VEC;
    if (tgt == -100) {
        if (threadIdx.x == 0) losses[row] = 0.f;
        if (write_dlogits) {
            Pack<T, VEC> z;
#pragma unroll
            for (int e = 0; e < VEC; ++e) z.v[e] = from_f32<T>(0.f);
            for (int j = threadIdx.x; j < nv; j += blockDim.x) store_pack<T, VEC>(base + (i64)j * VEC, z);
        }
        return;
    }
    float x_t = 0.f;
    if (threadIdx.x == 0) x_t = to_f32(base[tgt]);
    const float NEG_INF = __int_as_float(0xff800000);
    float m = NEG_INF, s = 0.f;
    for (int j = threadIdx.x; j < nv; j += blockDim.x) {
        float v[VEC];
        load_f32<T, VEC>(base + (i64)j * VEC, v);
        float vm = v[0];
#pragma unroll
        for (int e = 1; e < VEC; ++e) vm = fmaxf(vm, v[e]);
        if (vm > m) {
            s *= __expf(m - vm);
            m = vm;
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) s += __expf(v[e] - m);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) merge_softmax(m, s, __shfl_xor_sync(FULL_MASK, m, o), __shfl_xor_sync(FULL_MASK, s, o));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        sm_m[warp] = m;
        sm_s[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        m = lane < nw ? sm_m[lane] : NEG_INF;
        s = lane < nw ? sm_s[lane] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) merge_softmax(m, s, __shfl_xor_sync(FULL_MASK, m, o), __shfl_xor_sync(FULL_MASK, s, o));
        if (lane == 0) {
            const float lse = m + logf(s);
            sm_lse = lse;
            losses[row] = lse - x_t;
        }
    }
    __syncthreads();
    if (!write_dlogits) return;
    const float lse = sm_lse;
    for (int j = threadIdx.x; j < nv; j += blockDim.x) {
        float v[VEC];
        load_f32<T, VEC>(base + (i64)j * VEC, v);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
            float p = __expf(v[e] - lse);
            if ((i64)j * VEC + e == tgt) p -= 1.f;
            v[e] = p * dloss;
        }
        store_f32<T, VEC>(base + (i64)j * VEC, v);
    }
}
