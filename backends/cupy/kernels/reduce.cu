// reduce.cu - device-side reductions: absolute max (FP8 scaling), sum of squares (global norm) and the per-column
// sum of partial rows (the deterministic weight gradients of the norms).
//
// The first two stream the tensor once with 16-byte loads in a grid-stride loop (the VEC-aligned body; the < VEC
// leftover elements are taken by block 0), keep per-thread partials in registers, and reduce the block
// with warp shuffles (redux.sync for the max) plus one shared-memory step.
//   absmax_kernel:  one atomicMax per block on the fp32 bits of |x| (order-free, so exact and
//                   deterministic); the host zeroes the output first.
//   sumsq_partial + finish_sum: P blocks (P a function of n only) each write one fp32 partial; one block
//                   adds the P partials in a fixed order into out (accumulate). No atomics: the same bits
//                   on every run and every GPU type.
//   column_sum:     out[C] += sum_p part[p, C] over the fp32 partial rows that rmsnorm_bwd, layernorm_bwd and
//                   qk_norm_bwd write (one per block over a fixed partition of the rows), in a fixed order, one
//                   rounding into out's dtype. No atomics either.

template <typename T, int VEC>
__global__ void absmax_kernel(unsigned* __restrict__ out, const T* __restrict__ x, i64 n) {
    const i64 nvec = n / VEC;
    unsigned m = 0u;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += (i64)gridDim.x * blockDim.x) {
        const Pack<T, VEC> p = load_pack<T, VEC>(x + i * VEC);
#pragma unroll
        for (int e = 0; e < VEC; ++e) m = max(m, abs_bits(to_f32(p.v[e])));
    }
    if (blockIdx.x == 0) {
        for (i64 t = nvec * VEC + threadIdx.x; t < n; t += blockDim.x) m = max(m, abs_bits(to_f32(x[t])));
    }
    block_atomic_max(out, m);
}

template <typename T, int VEC>
__global__ void sumsq_partial(float* __restrict__ part, const T* __restrict__ x, i64 n) {
    const i64 nvec = n / VEC;
    float acc[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < nvec; i += (i64)gridDim.x * blockDim.x) {
        float v[VEC];
        load_f32<T, VEC>(x + i * VEC, v);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] += v[e] * v[e];
    }
    if (blockIdx.x == 0) {
        for (i64 t = nvec * VEC + threadIdx.x; t < n; t += blockDim.x) {
            const float v = to_f32(x[t]);
            acc[0] += v * v;
        }
    }
    float s = 0.f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) s += acc[e];
    s = block_sum(s);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}

__global__ void finish_sum(float* __restrict__ out, const float* __restrict__ part, int P) {
    float v = 0.f;
    for (int i = threadIdx.x; i < P; i += blockDim.x) v += part[i];
    v = block_sum(v);
    if (threadIdx.x == 0) *out += v;
}

// out[C] += sum_p part[p, C]: block (32, 32), 32 columns per block, partial rows strided by 32, then a fixed
// order over the 32 strands; one rounding into out's dtype.
template <typename T>
__global__ void column_sum(T* __restrict__ out, const float* __restrict__ part, int P, int C) {
    __shared__ float sm[32][33];
    const int col = blockIdx.x * 32 + threadIdx.x;
    float s = 0.f;
    if (col < C) {
#pragma unroll 4
        for (int p = threadIdx.y; p < P; p += 32) s += part[(i64)p * C + col];
    }
    sm[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && col < C) {
        float t = 0.f;
        for (int y = 0; y < 32; ++y) t += sm[y][threadIdx.x];
        out[col] = from_f32<T>(to_f32(out[col]) + t);
    }
}
