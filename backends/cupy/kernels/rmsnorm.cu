// rmsnorm.cu - RMSNorm forward (optionally fused with the residual add and an FP8 absmax) and backward.
//
// Layout: a block of (TX, TY) threads handles TY rows at once, TX threads (a multiple of 32) per row; each
// thread keeps K 16-byte vectors of its row in registers (Pack<T, VEC>, VEC = 8 bf16 or 4 fp32), so every
// input is read from memory exactly once and every output written once. The row's sum of squares is a
// warp-shuffle reduction (plus one shared-memory step when TX > 32). The host picks TX and K from C.
//
// Forward: residual = round(inp1 + inp2) to the model dtype, and the *rounded* value is what gets
// normalised, so a later rmsnorm_fwd(residual) (recompute) reproduces out bit for bit (same kernel, same
// reduction order). rstd = 1/sqrt(mean(x^2) + eps) in fp32; out = (x * rstd) * w. max|out| (of the rounded
// output) is reduced per block and merged with one atomicMax on the float bits.
//
// Backward: dinp = rstd * (g*w - xhat * mean(g*w*xhat)) (+ dresidual, fused; dinp may alias it) and, for
// dweight, each block accumulates sum_rows g * xhat of its rows in fp32 registers and writes one partial
// row; column_sum (reduce.cu) adds the partials in a fixed order into dweight. No atomics: deterministic.

template <typename T, int VEC, int K>
__global__ void rmsnorm_fwd(T* __restrict__ out, float* __restrict__ rstd, const T* x,
                            const T* x2, T* res, const T* __restrict__ w,
                            unsigned* __restrict__ absmax, int N, int C, float eps) {
    __shared__ float red[32];
    const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    const bool active = row < N;
    const int nvec = C / VEC;
    Pack<T, VEC> xs[K];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = k * blockDim.x + threadIdx.x;
        if (active && j < nvec) {
            const i64 off = row * C + (i64)j * VEC;
            xs[k] = load_pack<T, VEC>(x + off);
            if (x2 != nullptr) {
                const Pack<T, VEC> b = load_pack<T, VEC>(x2 + off);
#pragma unroll
                for (int e = 0; e < VEC; ++e) xs[k].v[e] = from_f32<T>(to_f32(xs[k].v[e]) + to_f32(b.v[e]));
                store_pack<T, VEC>(res + off, xs[k]);
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float f = to_f32(xs[k].v[e]);
                ss += f * f;
            }
        }
    }
    ss = row_sum(ss, red);
    const float r = 1.f / sqrtf(ss / (float)C + eps);
    if (active && threadIdx.x == 0) rstd[row] = r;
    unsigned m = 0u;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = k * blockDim.x + threadIdx.x;
        if (active && j < nvec) {
            const Pack<T, VEC> wp = load_pack<T, VEC>(w + (i64)j * VEC);
            Pack<T, VEC> y;
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                y.v[e] = from_f32<T>((to_f32(xs[k].v[e]) * r) * to_f32(wp.v[e]));
                m = max(m, abs_bits(to_f32(y.v[e])));
            }
            store_pack<T, VEC>(out + row * C + (i64)j * VEC, y);
        }
    }
    if (absmax != nullptr) block_atomic_max(absmax, m);
}

template <typename T, int VEC, int K>
__global__ void rmsnorm_bwd(T* dx, float* __restrict__ dw_part, const T* __restrict__ dy, const T* __restrict__ x,
                            const T* __restrict__ w, const float* __restrict__ rstd, const T* dres,
                            unsigned* __restrict__ absmax, int N, int C, int rows_per_block) {
    unsigned m = 0u;  // max|dx| of the stored values (FP8: the dy scale of the projection below)
    extern __shared__ float dw_sm[];  // [TY][C], only when TY > 1
    __shared__ float red[32];
    const int nvec = C / VEC;
    Pack<T, VEC> wp[K];
    float dw[K][VEC];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = k * blockDim.x + threadIdx.x;
        if (j < nvec) wp[k] = load_pack<T, VEC>(w + (i64)j * VEC);
#pragma unroll
        for (int e = 0; e < VEC; ++e) dw[k][e] = 0.f;
    }
    const i64 row0 = (i64)blockIdx.x * rows_per_block;
    const int iters = (rows_per_block + blockDim.y - 1) / blockDim.y;
    for (int it = 0; it < iters; ++it) {  // same trip count for every thread: row_sum synchronises the block
        const int rloc = it * blockDim.y + threadIdx.y;
        const i64 row = row0 + rloc;
        const bool active = rloc < rows_per_block && row < N;
        const float rs = active ? rstd[row] : 0.f;
        Pack<T, VEC> xp[K], gp[K];
        float dot = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int j = k * blockDim.x + threadIdx.x;
            if (active && j < nvec) {
                const i64 off = row * C + (i64)j * VEC;
                xp[k] = load_pack<T, VEC>(x + off);
                gp[k] = load_pack<T, VEC>(dy + off);
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    const float xhat = to_f32(xp[k].v[e]) * rs;
                    const float g = to_f32(gp[k].v[e]);
                    dw[k][e] += g * xhat;
                    dot += (g * to_f32(wp[k].v[e])) * xhat;
                }
            }
        }
        dot = row_sum(dot, red) / (float)C;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int j = k * blockDim.x + threadIdx.x;
            if (active && j < nvec) {
                const i64 off = row * C + (i64)j * VEC;
                float extra[VEC];
                if (dres != nullptr) {
                    load_f32<T, VEC>(dres + off, extra);
                } else {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) extra[e] = 0.f;
                }
                float o[VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    const float xhat = to_f32(xp[k].v[e]) * rs;
                    const float gw = to_f32(gp[k].v[e]) * to_f32(wp[k].v[e]);
                    o[e] = to_f32(from_f32<T>(rs * (gw - xhat * dot) + extra[e]));
                    m = max(m, abs_bits(o[e]));
                }
                store_f32<T, VEC>(dx + off, o);
            }
        }
    }
    if (absmax != nullptr) block_atomic_max(absmax, m);  // every thread of the block reaches this
    float* part = dw_part + (i64)blockIdx.x * C;
    if (blockDim.y == 1) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int j = k * blockDim.x + threadIdx.x;
            if (j < nvec) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) part[j * VEC + e] = dw[k][e];
            }
        }
        return;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = k * blockDim.x + threadIdx.x;
        if (j < nvec) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) dw_sm[threadIdx.y * C + j * VEC + e] = dw[k][e];
        }
    }
    __syncthreads();
    for (int c = threadIdx.y * blockDim.x + threadIdx.x; c < C; c += blockDim.x * blockDim.y) {
        float s = 0.f;
        for (int y = 0; y < (int)blockDim.y; ++y) s += dw_sm[y * C + c];
        part[c] = s;
    }
}
