// common.cuh - device helpers shared by every kernel of the CuPy backend.
//
// backends/cupy/_runtime.py prepends this text to each .cu file before NVRTC sees it (so the kernel cache
// key covers it), and nothing here includes a CUDA toolkit header: NVRTC on a bare machine may not find
// cuda_bf16.h / cuda_fp8.h. bf16 is therefore an `unsigned short` bit pattern with our own conversions and
// FP8 is an `unsigned char` produced by the sm_89+ `cvt.rn.satfinite` PTX instruction (or, on older GPUs or
// with -DLLMQ_SOFT_FP8, by integer round-to-nearest-even on the fp32 bits).
//
// CuPy compiles with -ftz=true (subnormals flushed in fp32 arithmetic). That is harmless for everything
// toleranced; the few operations that must match torch bit for bit (the FP8 scale, x * scale) use inline
// PTX without .ftz.

typedef unsigned short bf16;  // the upper 16 bits of an fp32
typedef unsigned char fp8;    // e4m3 (FMT 0) or e5m2 (FMT 1) bit pattern
typedef long long i64;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu

// ------------------------------------------------------------------ bf16 <-> fp32
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __uint_as_float(((unsigned)x) << 16); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) {
#if __CUDA_ARCH__ >= 800
    bf16 r;  // hardware round-to-nearest-even, keeps subnormals, nan -> canonical nan
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
    return r;
#else
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x0040u);  // quiet the nan, keep the sign
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);                   // round to nearest, ties to even
#endif
}

// round an fp32 value through T and back (what storing and re-loading it gives)
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_f32(from_f32<T>(x)); }

// ------------------------------------------------------------------ 16-byte vectors
// Pack<T, N>: N elements loaded / stored as one access (16 bytes when N * sizeof(T) == 16). Callers
// guarantee the alignment (the host picks N = 1 when a pointer or a row length is not a multiple).
template <typename T, int N> struct alignas(sizeof(T) * N) Pack { T v[N]; };

template <typename T, int N> __device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
    return *reinterpret_cast<const Pack<T, N>*>(p);
}
template <typename T, int N> __device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
    *reinterpret_cast<Pack<T, N>*>(p) = v;
}
template <typename T, int N> __device__ __forceinline__ void load_f32(const T* p, float (&f)[N]) {
    Pack<T, N> pk = load_pack<T, N>(p);
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = to_f32(pk.v[i]);
}
template <typename T, int N> __device__ __forceinline__ void store_f32(T* p, const float (&f)[N]) {
    Pack<T, N> pk;
#pragma unroll
    for (int i = 0; i < N; ++i) pk.v[i] = from_f32<T>(f[i]);
    store_pack<T, N>(p, pk);
}
// N fp32 values as float4 loads (16-byte alignment suffices, also for N = 8)
template <int N> __device__ __forceinline__ void load_floats(const float* p, float (&f)[N]) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int q = 0; q < N / 4; ++q) {
            const float4 v = reinterpret_cast<const float4*>(p)[q];
            f[4 * q] = v.x; f[4 * q + 1] = v.y; f[4 * q + 2] = v.z; f[4 * q + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) f[i] = p[i];
    }
}

// ------------------------------------------------------------------ reductions
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Absolute maxima are kept as the fp32 bit patterns of |x|: non-negative floats order like unsigned ints,
// and a nan (0x7fc00000 after clearing the sign) compares above inf, so it propagates like torch's amax.
__device__ __forceinline__ unsigned abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

__device__ __forceinline__ unsigned warp_max_u32(unsigned v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_max_sync(FULL_MASK, v);
#else
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
#endif
}

// Block-wide max of `v` (1-D or 2-D block, any size that is a multiple of 32), then one atomicMax into *out
// by thread 0 (skipped when it cannot raise the stored value). *out must start at 0 (the host zeroes it).
__device__ __forceinline__ void block_atomic_max(unsigned* out, unsigned v) {
    __shared__ unsigned red_max[32];
    const int tid = threadIdx.x + threadIdx.y * blockDim.x;
    const int nwarps = (blockDim.x * blockDim.y) >> 5;
    v = warp_max_u32(v);
    if ((tid & 31) == 0) red_max[tid >> 5] = v;
    __syncthreads();
    if (tid < 32) {
        v = tid < nwarps ? red_max[tid] : 0u;
        v = warp_max_u32(v);
        if (tid == 0 && v > 0u && v > *((volatile unsigned*)out)) atomicMax(out, v);
    }
}

// Sum over the TX = blockDim.x threads of one row group (threadIdx.y); every thread of the group gets the
// total. TX is a multiple of 32, so warps never straddle groups; the cross-warp order is fixed.
// `red` is shared scratch of >= 32 floats; all threads of the block must call this together.
__device__ __forceinline__ float row_sum(float v, float* red) {
    v = warp_sum(v);
    const int wpr = blockDim.x >> 5;  // warps per row group
    if (wpr == 1) return v;
    const int tid = threadIdx.x + threadIdx.y * blockDim.x;
    __syncthreads();  // red may still be read by a previous call
    if ((tid & 31) == 0) red[tid >> 5] = v;
    __syncthreads();
    const float* mine = red + threadIdx.y * wpr;
    float s = 0.f;
    for (int w = 0; w < wpr; ++w) s += mine[w];
    return s;
}

// Sum over a group of G lanes (G a power of two <= 32; groups are the aligned lane ranges [g*G, g*G + G) of a
// warp); every lane of the group gets the same total (an xor butterfly: the two lanes of each pair add the same two
// values, and fp32 addition commutes). All 32 lanes of the warp must call it (inactive lanes with 0).
__device__ __forceinline__ float group_sum(float v, int G) {
    for (int o = G >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Block sum (1-D block, multiple of 32 threads) in a fixed order; result valid in thread 0.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float red_sum[32];
    const int tid = threadIdx.x;
    v = warp_sum(v);
    if ((tid & 31) == 0) red_sum[tid >> 5] = v;
    __syncthreads();
    if (tid < 32) {
        v = tid < (int)(blockDim.x >> 5) ? red_sum[tid] : 0.f;
        v = warp_sum(v);
    }
    return v;
}

// ------------------------------------------------------------------ exact fp32 ops (no flush-to-zero)
__device__ __forceinline__ float mul_rn(float a, float b) {
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}
__device__ __forceinline__ float div_rn(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// ------------------------------------------------------------------ FP8
// FMT 0 = e4m3 (float8_e4m3fn: max 448, no inf), FMT 1 = e5m2 (max 57344).
template <int FMT> struct Fp8Format;
template <> struct Fp8Format<0> { static constexpr float MAX = 448.f; static constexpr int MAN = 3, BIAS = 7, MAXCODE = 0x7e; };
template <> struct Fp8Format<1> { static constexpr float MAX = 57344.f; static constexpr int MAN = 2, BIAS = 15, MAXCODE = 0x7b; };

// Software fp32 -> FP8: saturate to +-max, round to nearest even, nan -> 0x7f (with its sign).
template <int FMT> __device__ __forceinline__ unsigned soft_fp8(float x) {
    typedef Fp8Format<FMT> F;
    const unsigned u = __float_as_uint(x);
    const unsigned sign = (u >> 24) & 0x80u;
    const unsigned a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7fu;
    const float f = __uint_as_float(a);
    if (f >= F::MAX) return sign | F::MAXCODE;
    const float min_normal = __uint_as_float((unsigned)(127 + 1 - F::BIAS) << 23);
    unsigned code;
    if (f < min_normal) {  // subnormal: |x| in units of the smallest subnormal, rounded to an integer (RNE)
        const float q = f * __uint_as_float((unsigned)(127 + F::BIAS + F::MAN - 1) << 23);
        code = (unsigned)__float2int_rn(q);
    } else {  // normal: round the fp32 mantissa to MAN bits (a carry may bump the exponent), rebias
        const int shift = 23 - F::MAN;
        const unsigned rb = (a + (1u << (shift - 1)) - 1u + ((a >> shift) & 1u)) >> shift;
        code = rb - ((unsigned)(127 - F::BIAS) << F::MAN);
    }
    return sign | min(code, (unsigned)F::MAXCODE);
}

// Two fp32 -> two FP8 bytes, saturating, round to nearest even: low byte = `lo`, high byte = `hi`.
template <int FMT> __device__ __forceinline__ unsigned short fp8x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 890 && !defined(LLMQ_SOFT_FP8)
    unsigned short r;
    if (FMT == 0) asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    else asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (unsigned short)(soft_fp8<FMT>(lo) | (soft_fp8<FMT>(hi) << 8));
#endif
}
template <int FMT> __device__ __forceinline__ fp8 to_fp8(float x) { return (fp8)(fp8x2<FMT>(x, 0.f) & 0xffu); }

// The per-tensor scale of backends/base.py's FP8 convention, from the device-side absmax:
// s = fp8_max * (1 / amax), each step IEEE-rounded (how torch evaluates `fp8_max / amax_tensor`), 1 if amax <= 0.
template <int FMT> __device__ __forceinline__ float fp8_scale(const float* absmax) {
    const float a = *absmax;
    return a > 0.f ? mul_rn(Fp8Format<FMT>::MAX, div_rn(1.f, a)) : 1.f;
}

// ------------------------------------------------------------------ counter-based random bits
// Philox4x32 with 10 rounds (Salmon et al., SC'11): 128 random bits that are a pure function of a 64-bit
// key and a 128-bit counter, so stochastic rounding is reproducible whatever the launch geometry.
__device__ __forceinline__ uint4 philox4x32_10(u64 counter, u64 key) {
    unsigned c0 = (unsigned)counter, c1 = (unsigned)(counter >> 32), c2 = 0u, c3 = 0u;
    unsigned k0 = (unsigned)key, k1 = (unsigned)(key >> 32);
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const unsigned lo0 = 0xD2511F53u * c0, hi0 = __umulhi(0xD2511F53u, c0);
        const unsigned lo1 = 0xCD9E8D57u * c2, hi1 = __umulhi(0xCD9E8D57u, c2);
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return make_uint4(c0, c1, c2, c3);
}

// 16 random bits for element `idx`: word idx % 4 of Philox(key, idx / 4).
__device__ __forceinline__ unsigned random16(u64 key, i64 idx) {
    const uint4 r = philox4x32_10((u64)idx >> 2, key);
    const int w = (int)(idx & 3);
    return (w == 0 ? r.x : w == 1 ? r.y : w == 2 ? r.z : r.w) & 0xffffu;
}

// Stochastic rounding fp32 -> bf16 with 16 random bits r (see backends/torch_ref_optim.py for why adding r
// below the kept bits and truncating is unbiased). inf/nan pass through; finite values saturate at max bf16.
__device__ __forceinline__ bf16 sr_bf16(float x, unsigned r) {
    const unsigned u = __float_as_uint(x);
    const unsigned mag = u & 0x7fffffffu;
    if (mag >= 0x7f800000u) return from_f32<bf16>(x);
    const unsigned rounded = min((mag + r) & 0xffff0000u, 0x7f7f0000u);
    return (bf16)(((u ^ mag) | rounded) >> 16);
}
