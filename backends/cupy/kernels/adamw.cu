// adamw.cu - AdamW over flat shards in one pass, and stochastic rounding fp32 -> bf16.
//
// AdamW: every element is independent, so one grid-stride kernel reads grad, m, v and the weight of record
// (master, or param without one) once - 16-byte loads for fp32, 8-byte for bf16, 4 elements per thread -
// does torch.optim.AdamW's math in fp32 in its operation order, and writes m, v, the record and (with a
// master) the model-dtype param: one pass over optimizer state instead of torch's ~10 element-wise passes.
// The dtype of each tensor (fp32 / bf16) is a run-time flag, uniform over the launch, so one kernel serves
// every combination. bf16 storage of record is written with stochastic rounding, fp32 exactly, param (with
// a master) rounded to nearest.
//
// Random bits: 16 per element from Philox4x32-10 keyed by a per-tensor seed (derive_seed(seed, "m"|"v"|"p")
// on the host, as torch_ref_optim does) at counter index / 4 - a pure function of (seed, tensor, index):
// reproducible and independent of the launch geometry, but not torch's generator, so bf16 results match the
// reference in distribution (unbiased), not bit for bit.

template <int N> __device__ __forceinline__ void ld(const void* p, int bf, i64 first, float (&f)[N]) {
    if (bf) load_f32<bf16, N>((const bf16*)p + first, f);
    else load_f32<float, N>((const float*)p + first, f);
}

template <int N> __device__ __forceinline__ void random_bits(u64 seed, i64 first, unsigned (&r)[N]) {
    if constexpr (N == 4) {  // first % 4 == 0: one Philox call serves the four elements
        const uint4 q = philox4x32_10((u64)first >> 2, seed);
        r[0] = q.x & 0xffffu; r[1] = q.y & 0xffffu; r[2] = q.z & 0xffffu; r[3] = q.w & 0xffffu;
    } else {
#pragma unroll
        for (int e = 0; e < N; ++e) r[e] = random16(seed, first + e);
    }
}

// store f into a tensor of record: bf16 with stochastic rounding (returns the stored values in f), fp32 exact
template <int N> __device__ __forceinline__ void st_record(void* p, int bf, i64 first, float (&f)[N], u64 seed) {
    if (bf) {
        unsigned r[N];
        random_bits<N>(seed, first, r);
        Pack<bf16, N> pk;
#pragma unroll
        for (int e = 0; e < N; ++e) {
            pk.v[e] = sr_bf16(f[e], r[e]);
            f[e] = to_f32(pk.v[e]);
        }
        store_pack<bf16, N>((bf16*)p + first, pk);
    } else {
        store_f32<float, N>((float*)p + first, f);
    }
}

template <int N>
__device__ __forceinline__ void adamw_elems(i64 first, void* param, const void* grad, void* mom, void* var, void* master,
                                            int param_bf, int grad_bf, int m_bf, int v_bf, int master_bf, float gs,
                                            float decay, float beta2, float omb1, float omb2, float bc2_sqrt,
                                            float neg_step, float eps, u64 seed_m, u64 seed_v, u64 seed_p,
                                            int lerp_from_start) {
    void* rec = master != nullptr ? master : param;
    const int rec_bf = master != nullptr ? master_bf : param_bf;
    float g[N], p[N], m[N], v[N];
    ld<N>(grad, grad_bf, first, g);
    ld<N>(rec, rec_bf, first, p);
    ld<N>(mom, m_bf, first, m);
    ld<N>(var, v_bf, first, v);
#pragma unroll
    for (int e = 0; e < N; ++e) {
        const float ge = g[e] * gs;
        p[e] = p[e] * decay;
        // torch.lerp(m, g, w): w < 0.5 -> m + w (g - m), else g - (g - m)(1 - w)
        m[e] = lerp_from_start ? fmaf(omb1, ge - m[e], m[e]) : ge - (ge - m[e]) * (1.f - omb1);
        v[e] = fmaf(omb2 * ge, ge, v[e] * beta2);
        const float denom = sqrtf(v[e]) / bc2_sqrt + eps;
        p[e] = p[e] + neg_step * (m[e] / denom);
    }
    st_record<N>(mom, m_bf, first, m, seed_m);
    st_record<N>(var, v_bf, first, v, seed_v);
    st_record<N>(rec, rec_bf, first, p, seed_p);
    if (master != nullptr) {
        if (param_bf) store_f32<bf16, N>((bf16*)param + first, p);
        else store_f32<float, N>((float*)param + first, p);
    }
}

// VEC = 4 needs every pointer aligned to 4 elements; the < 4 leftover elements are taken by block 0.
template <int VEC>
__global__ void adamw(void* param, const void* grad, void* mom, void* var, void* master, int param_bf, int grad_bf,
                      int m_bf, int v_bf, int master_bf, const float* gscale_ptr, float gscale, i64 n, float decay,
                      float beta2, float omb1, float omb2, float bc2_sqrt, float neg_step, float eps, u64 seed_m,
                      u64 seed_v, u64 seed_p, int lerp_from_start) {
    const float gs = gscale_ptr != nullptr ? *gscale_ptr : gscale;
    const i64 nvec = n / VEC;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += (i64)gridDim.x * blockDim.x) {
        adamw_elems<VEC>(i * VEC, param, grad, mom, var, master, param_bf, grad_bf, m_bf, v_bf, master_bf, gs, decay,
                         beta2, omb1, omb2, bc2_sqrt, neg_step, eps, seed_m, seed_v, seed_p, lerp_from_start);
    }
    if (blockIdx.x == 0) {
        for (i64 t = nvec * VEC + threadIdx.x; t < n; t += blockDim.x) {
            adamw_elems<1>(t, param, grad, mom, var, master, param_bf, grad_bf, m_bf, v_bf, master_bf, gs, decay,
                           beta2, omb1, omb2, bc2_sqrt, neg_step, eps, seed_m, seed_v, seed_p, lerp_from_start);
        }
    }
}

template <int VEC>
__global__ void stochastic_round(bf16* __restrict__ out, const float* __restrict__ inp, i64 n, u64 seed) {
    const i64 nvec = n / VEC;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += (i64)gridDim.x * blockDim.x) {
        float f[VEC];
        load_floats<VEC>(inp + i * VEC, f);
        unsigned r[VEC];
        random_bits<VEC>(seed, i * VEC, r);
        Pack<bf16, VEC> pk;
#pragma unroll
        for (int e = 0; e < VEC; ++e) pk.v[e] = sr_bf16(f[e], r[e]);
        store_pack<bf16, VEC>(out + i * VEC, pk);
    }
    if (blockIdx.x == 0) {
        for (i64 t = nvec * VEC + threadIdx.x; t < n; t += blockDim.x) out[t] = sr_bf16(inp[t], random16(seed, t));
    }
}
