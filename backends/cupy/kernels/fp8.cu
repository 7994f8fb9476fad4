// fp8.cu - per-tensor FP8 quantization (e4m3 / e5m2): row-major, transposed, or both from one read.
//
// s = fp8_max * (1 / absmax) (1 when absmax is 0), q = saturate(x * s) rounded to nearest even, and the
// descale 1 / s is written by one thread (backends/base.py's convention). The scale is computed in every
// thread from the device-side absmax with IEEE (non-flushing) PTX, and x * s likewise, so the bytes equal
// torch's `(x.float() * s).clamp(-max, max).to(float8)` exactly; the conversion itself is the sm_89+
// `cvt.rn.satfinite.{e4m3,e5m2}x2.f32` instruction, two values per instruction.
//   quantize_flat:  grid-stride, VEC inputs (16 bytes) in, VEC bytes out per access.
//   quantize_tiles: a 64x64 tile of x per block, read once with 16-byte loads; the FP8 bytes go to shared
//                   memory transposed and leave as 16-byte rows of out_t[K, M] (both sides coalesced), and,
//                   with a row-major `out`, also straight from registers into out[M, K].

#define TILE 64

template <typename T, int VEC, int FMT>
__device__ __forceinline__ void quantize_vec(const Pack<T, VEC>& p, float s, unsigned char (&b)[VEC]) {
    if constexpr (VEC == 1) {
        b[0] = to_fp8<FMT>(mul_rn(to_f32(p.v[0]), s));
    } else {
#pragma unroll
        for (int e = 0; e < VEC; e += 2) {
            const unsigned short q = fp8x2<FMT>(mul_rn(to_f32(p.v[e]), s), mul_rn(to_f32(p.v[e + 1]), s));
            b[e] = (unsigned char)(q & 0xffu);
            b[e + 1] = (unsigned char)(q >> 8);
        }
    }
}

template <int VEC> __device__ __forceinline__ void store_bytes(fp8* dst, const unsigned char (&b)[VEC]) {
    Pack<unsigned char, VEC> pk;
#pragma unroll
    for (int e = 0; e < VEC; ++e) pk.v[e] = b[e];
    store_pack<unsigned char, VEC>(dst, pk);
}

template <typename T, int VEC, int FMT>
__global__ void quantize_flat(fp8* __restrict__ out, float* __restrict__ descale, const T* __restrict__ x,
                              const float* __restrict__ absmax, i64 n) {
    const float s = fp8_scale<FMT>(absmax);
    if (blockIdx.x == 0 && threadIdx.x == 0) *descale = div_rn(1.f, s);
    const i64 nvec = n / VEC;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += (i64)gridDim.x * blockDim.x) {
        unsigned char b[VEC];
        quantize_vec<T, VEC, FMT>(load_pack<T, VEC>(x + i * VEC), s, b);
        store_bytes<VEC>(out + i * VEC, b);
    }
    if (blockIdx.x == 0) {
        for (i64 t = nvec * VEC + threadIdx.x; t < n; t += blockDim.x) out[t] = to_fp8<FMT>(mul_rn(to_f32(x[t]), s));
    }
}

// x[M, K] -> out_t[K, M] (and out[M, K] when out != nullptr). grid (ceil(M/64), ceil(K/64)), 256 threads.
// VEC > 1 needs K % VEC == 0 and aligned x / out; vec_store (16-byte rows of out_t) needs M % 16 == 0.
template <typename T, int VEC, int FMT>
__global__ void __launch_bounds__(256) quantize_tiles(fp8* __restrict__ out, fp8* __restrict__ out_t,
                                                      float* __restrict__ descale, const T* __restrict__ x,
                                                      const float* __restrict__ absmax, int M, int K, int vec_store) {
    __shared__ __align__(16) unsigned char tile[TILE][TILE + 4];  // tile[k][m]: already transposed
    const float s = fp8_scale<FMT>(absmax);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *descale = div_rn(1.f, s);
    const int m0 = blockIdx.x * TILE, k0 = blockIdx.y * TILE;
    constexpr int VPR = TILE / VEC;  // vectors per tile row
    for (int i = threadIdx.x; i < TILE * VPR; i += blockDim.x) {
        const int r = i / VPR, c = (i % VPR) * VEC;
        const int gm = m0 + r, gk = k0 + c;
        if (gm < M && gk < K) {
            unsigned char b[VEC];
            quantize_vec<T, VEC, FMT>(load_pack<T, VEC>(x + (i64)gm * K + gk), s, b);
#pragma unroll
            for (int e = 0; e < VEC; ++e) tile[c + e][r] = b[e];
            if (out != nullptr) store_bytes<VEC>(out + (i64)gm * K + gk, b);
        }
    }
    __syncthreads();
    constexpr int SPR = TILE / 16;  // 16-byte segments per out_t row of the tile
    for (int i = threadIdx.x; i < TILE * SPR; i += blockDim.x) {
        const int kk = i / SPR, mm = (i % SPR) * 16;
        const int gk = k0 + kk, gm = m0 + mm;
        if (gk >= K || gm >= M) continue;
        fp8* dst = out_t + (i64)gk * M + gm;
        if (vec_store && gm + 16 <= M) {
            const unsigned* src = reinterpret_cast<const unsigned*>(&tile[kk][mm]);
            *reinterpret_cast<uint4*>(dst) = make_uint4(src[0], src[1], src[2], src[3]);
        } else {
            for (int b = 0; b < 16 && gm + b < M; ++b) dst[b] = tile[kk][mm + b];
        }
    }
}
