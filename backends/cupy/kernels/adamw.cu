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
//
// e4m3 first moment (--opt-m-dtype e4m3; the format is backends/fp8_moment.py's): m is [n] bytes of
// float8_e4m3fn, read as unsigned char, with m_scale [ceil(n/256)] fp32 power-of-two scales, one per block of
// 256 elements counted from element 0 of the call. Same kernel, `adamw<VEC>`, taking the other path when
// m_scale is not null (so one instantiation list serves both; the e4m3 body is `adamw_e4m3m_tiles`). There a
// block of 256 threads owns a tile of 1024 elements = 4 whole scale blocks per grid-stride iteration; thread
// t takes elements 4t..4t+3 (16-byte fp32 / 8-byte bf16 / 4-byte m accesses, coalesced; VEC = 1 loads them
// one by one when a pointer is not aligned to 4 elements), so a scale block is two whole warps. It reads the
// old m as (integer-decoded e4m3) * old scale, does the same fp32 AdamW math as the fp32/bf16 path, takes the
// new block absmax (warp max, then the two warps through shared memory), the new scale 2^k by integer
// arithmetic on its bits, and stores m * 2^-k stochastically rounded to the e4m3 grid (sr_e4m3: 16 random
// bits, the same Philox words that m would use as bf16) and encoded exactly as bytes, plus the new scale.
// Elements past n (the partial last block) read as 0, so they never raise a block's absmax, and are not
// written. The scale exponent is at least -117 (fp8_moment.K_MIN), so every nonzero stored value is at least
// 2^-126, a normal float that -ftz never flushes, and the power-of-two scalings use mul_rn; every e4m3 step is
// exact bit arithmetic (as in backends/triton/adamw_fp8m.py), so the stored m is one of the two e4m3
// neighbours of the fp32 update.

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

// torch.optim.AdamW's step for one element, all fp32, in its operation order (g is the unscaled gradient)
__device__ __forceinline__ void adam_step(float g, float& p, float& m, float& v, float gs, float decay, float beta2,
                                          float omb1, float omb2, float bc2_sqrt, float neg_step, float eps,
                                          int lerp_from_start) {
    const float ge = g * gs;
    p = p * decay;
    // torch.lerp(m, g, w): w < 0.5 -> m + w (g - m), else g - (g - m)(1 - w)
    m = lerp_from_start ? fmaf(omb1, ge - m, m) : ge - (ge - m) * (1.f - omb1);
    v = fmaf(omb2 * ge, ge, v * beta2);
    const float denom = sqrtf(v) / bc2_sqrt + eps;
    p = p + neg_step * (m / denom);
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
    for (int e = 0; e < N; ++e)
        adam_step(g[e], p[e], m[e], v[e], gs, decay, beta2, omb1, omb2, bc2_sqrt, neg_step, eps, lerp_from_start);
    st_record<N>(mom, m_bf, first, m, seed_m);
    st_record<N>(var, v_bf, first, v, seed_v);
    st_record<N>(rec, rec_bf, first, p, seed_p);
    if (master != nullptr) {
        if (param_bf) store_f32<bf16, N>((bf16*)param + first, p);
        else store_f32<float, N>((float*)param + first, p);
    }
}

// ------------------------------------------------------------------ e4m3 first moment (fp8_moment.py)
#define M8_BLOCK 256                 // elements per scale
#define M8_TILE 1024                 // elements per tile: 256 threads x 4, i.e. 4 scale blocks
#define M8_MIN_NORMAL 0x3c800000u    // fp32 bits of 2^-6, e4m3's smallest normal

// e4m3 byte -> fp32 value (exact): normal 2^(e-7) (1 + mant/8) built as fp32 bits, subnormal mant * 2^-9
__device__ __forceinline__ float e4m3_decode(unsigned c) {
    const unsigned e = (c >> 3) & 0xfu, mant = c & 7u;
    const float mag = e != 0u ? __uint_as_float(((e + 120u) << 23) | (mant << 20)) : (float)mant * (1.f / 512.f);
    return (c & 0x80u) ? -mag : mag;
}

// fp32 value already on the e4m3 grid (|q| <= 448) -> its byte (exact; no conversion instruction needed)
__device__ __forceinline__ unsigned e4m3_encode(float q) {
    const unsigned bits = __float_as_uint(q), mag = bits & 0x7fffffffu;
    const unsigned code = mag >= M8_MIN_NORMAL ? ((((mag >> 23) - 120u) << 3) | ((mag >> 20) & 7u))
                                               : (unsigned)(__uint_as_float(mag) * 512.f);  // integer 0..7
    return code | ((bits >> 24) & 0x80u);
}

// fp32 y (|y| <= 448) -> fp32 on the e4m3 grid, stochastically rounded with 16 random bits r
// (fp8_moment.sr_e4m3): normals add r << 4 to the magnitude bits and clear the 20 bits e4m3 drops;
// subnormals (a fixed step of 2^-9) take floor(|y| 2^9 + r 2^-16) 2^-9.
__device__ __forceinline__ float sr_e4m3(float y, unsigned r) {
    const unsigned bits = __float_as_uint(y), mag = bits & 0x7fffffffu;
    const float out = mag >= M8_MIN_NORMAL
        ? __uint_as_float((mag + (r << 4)) & 0xfff00000u)
        : floorf(mul_rn(__uint_as_float(mag), 512.f) + (float)r * (1.f / 65536.f)) * (1.f / 512.f);
    return __uint_as_float(__float_as_uint(out) | (bits & 0x80000000u));
}

// fp32 bits of a block's absmax (>= 0, finite) -> k of its scale 2^k, the smallest k with absmax / 2^k <= 448
// (fp8_moment.block_scales): absmax = f 2^E, f in [1, 2): k = E - 8 if f <= 1.75 else E - 7, at least -117
__device__ __forceinline__ int e4m3_block_exponent(unsigned absmax_bits) {
    const int e = (int)((absmax_bits >> 23) & 0xffu) - 127;
    return max((absmax_bits & 0x7fffffu) <= 0x600000u ? e - 8 : e - 7, -117);
}

// Four consecutive elements first..first+3 (first % 4 == 0), `cnt` of them inside the shard: one access when
// VEC == 4 and all four are, else element by element; the others read as 0.
template <int VEC> __device__ __forceinline__ void ld4(const void* p, int bf, i64 first, int cnt, float (&f)[4]) {
    if (VEC == 4 && cnt == 4) {
        ld<4>(p, bf, first, f);
        return;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        f[e] = 0.f;
        if (e < cnt) f[e] = bf ? to_f32(((const bf16*)p)[first + e]) : ((const float*)p)[first + e];
    }
}

// store four consecutive values into a tensor of record: bf16 with stochastic rounding (bits r, the stored
// values returned in f), fp32 exact; as ld4, one access or element by element
template <int VEC>
__device__ __forceinline__ void st4_record(void* p, int bf, i64 first, int cnt, float (&f)[4], const unsigned (&r)[4]) {
    if (bf) {
#pragma unroll
        for (int e = 0; e < 4; ++e) f[e] = to_f32(sr_bf16(f[e], r[e]));  // exact: a bf16 value
    }
    if (VEC == 4 && cnt == 4) {
        if (bf) store_f32<bf16, 4>((bf16*)p + first, f);
        else store_f32<float, 4>((float*)p + first, f);
        return;
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        if (e < cnt) {
            if (bf) ((bf16*)p)[first + e] = from_f32<bf16>(f[e]);
            else ((float*)p)[first + e] = f[e];
        }
    }
}

// The e4m3-m path of `adamw` (see the file comment). Called by all 256 threads of every block (it syncs).
template <int VEC>
__device__ __forceinline__ void adamw_e4m3m_tiles(void* param, const void* grad, unsigned char* mom, float* m_scale,
                                                  void* var, void* master, int param_bf, int grad_bf, int v_bf,
                                                  int master_bf, float gs, i64 n, float decay, float beta2,
                                                  float omb1, float omb2, float bc2_sqrt, float neg_step, float eps,
                                                  u64 seed_m, u64 seed_v, u64 seed_p, int lerp_from_start) {
    __shared__ unsigned warp_absmax[2][8];  // [iteration parity][warp]: one __syncthreads per tile suffices
    void* rec = master != nullptr ? master : param;
    const int rec_bf = master != nullptr ? master_bf : param_bf;
    const int warp = threadIdx.x >> 5;
    const i64 tiles = (n + M8_TILE - 1) / M8_TILE;
    int parity = 0;
    for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x, parity ^= 1) {  // uniform over the block
        const i64 first = tile * M8_TILE + 4 * (i64)threadIdx.x;
        const i64 blk = first / M8_BLOCK;  // this thread's scale block: tile * 4 + threadIdx.x / 64
        const int cnt = (int)max((i64)0, min((i64)4, n - first));
        float g[4], p[4], m[4], v[4];
        ld4<VEC>(grad, grad_bf, first, cnt, g);
        ld4<VEC>(rec, rec_bf, first, cnt, p);
        ld4<VEC>(var, v_bf, first, cnt, v);
        unsigned code[4] = {0u, 0u, 0u, 0u};
        if (VEC == 4 && cnt == 4) {
            const unsigned w = *reinterpret_cast<const unsigned*>(mom + first);  // 4 bytes, little-endian
#pragma unroll
            for (int e = 0; e < 4; ++e) code[e] = (w >> (8 * e)) & 0xffu;
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) if (e < cnt) code[e] = mom[first + e];
        }
        const float old_scale = cnt > 0 ? m_scale[blk] : 0.f;
        unsigned amax = 0u;  // fp32 bits of max |new m| (non-negative floats order as unsigned ints)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            m[e] = mul_rn(e4m3_decode(code[e]), old_scale);  // exact (no flush of tiny products)
            adam_step(g[e], p[e], m[e], v[e], gs, decay, beta2, omb1, omb2, bc2_sqrt, neg_step, eps,
                      lerp_from_start);
            if (e < cnt) amax = max(amax, abs_bits(m[e]));
        }
        // v and the weights need no block-wide value: stored first, so only m stays live across the barrier
        unsigned r[4];
        if (v_bf) random_bits<4>(seed_v, first, r);
        st4_record<VEC>(var, v_bf, first, cnt, v, r);
        if (rec_bf) random_bits<4>(seed_p, first, r);
        st4_record<VEC>(rec, rec_bf, first, cnt, p, r);
        if (master != nullptr) {
            if (VEC == 4 && cnt == 4) {
                if (param_bf) store_f32<bf16, 4>((bf16*)param + first, p);
                else store_f32<float, 4>((float*)param + first, p);
            } else {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if (e < cnt) {
                        if (param_bf) ((bf16*)param)[first + e] = from_f32<bf16>(p[e]);
                        else ((float*)param)[first + e] = p[e];
                    }
                }
            }
        }
        // block absmax: a scale block is warps 2j and 2j + 1 (threads 64j .. 64j + 63)
        amax = warp_max_u32(amax);
        if ((threadIdx.x & 31) == 0) warp_absmax[parity][warp] = amax;
        __syncthreads();
        amax = max(warp_absmax[parity][warp & ~1], warp_absmax[parity][warp | 1]);
        const int k = e4m3_block_exponent(amax);
        const float inv_scale = __uint_as_float((unsigned)(127 - k) << 23);  // 2^-k, exact
        random_bits<4>(seed_m, first, r);
        unsigned word = 0u;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            code[e] = e4m3_encode(sr_e4m3(mul_rn(m[e], inv_scale), r[e]));
            word |= code[e] << (8 * e);
        }
        if (VEC == 4 && cnt == 4) {
            *reinterpret_cast<unsigned*>(mom + first) = word;
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) if (e < cnt) mom[first + e] = (unsigned char)code[e];
        }
        // every reader of the old scale passed the __syncthreads above
        if ((threadIdx.x & 63) == 0 && cnt > 0) m_scale[blk] = __uint_as_float((unsigned)(k + 127) << 23);
    }
}

// VEC = 4 needs every pointer aligned to 4 elements; the < 4 leftover elements are taken by block 0.
// With m_scale (an e4m3 m): the tile path above, launched with 256 threads per block (m_bf is unused).
// The launch bounds keep the occupancy each instantiation had before the e4m3 path joined it (ptxas: 93 -> 82
// registers for VEC = 4, 38 -> 39 for VEC = 1, at sm_90, no spills): without them the merged kernel takes
// 110 / 96 registers, which would cut the scalar fp32/bf16 path from 6 blocks per SM to 2.
template <int VEC>
__global__ void __launch_bounds__(256, VEC == 1 ? 6 : 2)
adamw(void* param, const void* grad, void* mom, float* m_scale, void* var, void* master, int param_bf, int grad_bf,
      int m_bf, int v_bf, int master_bf, const float* gscale_ptr, float gscale, i64 n, float decay, float beta2,
      float omb1, float omb2, float bc2_sqrt, float neg_step, float eps, u64 seed_m, u64 seed_v, u64 seed_p,
      int lerp_from_start) {
    const float gs = gscale_ptr != nullptr ? *gscale_ptr : gscale;
    if (m_scale != nullptr) {
        adamw_e4m3m_tiles<VEC>(param, grad, (unsigned char*)mom, m_scale, var, master, param_bf, grad_bf, v_bf,
                               master_bf, gs, n, decay, beta2, omb1, omb2, bc2_sqrt, neg_step, eps, seed_m, seed_v,
                               seed_p, lerp_from_start);
        return;
    }
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
