// layernorm.cu - LayerNorm with weight and bias (GPT-2's ln_1, ln_2, ln_f): forward (optionally fused with the
// residual add and an FP8 absmax) and backward (deterministic weight and bias gradients).
//
// Layout as rmsnorm.cu: a block of (TX, TY) threads handles TY rows at once, TX threads (a multiple of 32) per row;
// each thread keeps K 16-byte vectors of its row in registers (Pack<T, VEC>, VEC = 8 bf16 or 4 fp32; VEC = 1 when C
// or a pointer is not a 16-byte multiple), so every input is read from memory once and every output written once.
// Row sums are warp shuffles plus one shared-memory step when TX > 32 (row_sum). The host picks TX and K from C.
//
// Forward: residual = round(inp1 + inp2) to the model dtype, and the *rounded* value is what gets normalised, so a
// later layernorm_fwd(residual) (recompute) reproduces out, mean, rstd and absmax bit for bit (same kernel, same
// reduction order). Statistics in fp32: mean = sum(x)/C, then the biased variance from the centred values held in
// registers (sum((x - mean)^2)/C: two reductions, not E[x^2] - mean^2, which cancels), rstd = 1/sqrt(var + eps);
// out = ((x - mean)*rstd)*w + b, rounded once. max|out| of the stored values is reduced per block and merged with
// one atomicMax on the float bits.
//
// Backward: xhat = (x - mean)*rstd, gw = dy*w, dx = rstd*(gw - mean(gw) - xhat*mean(gw*xhat)) (+ dresidual, fused;
// dx may alias it), rounded once; max|dx| of the stored values as in the forward. Weight and bias gradients: block
// b owns the rows [b*rows_per_block, (b+1)*rows_per_block) (a fixed partition, a function of N), each thread sums
// dy*xhat and dy of its columns in fp32 registers, the block's TY row groups are added in a fixed order (shared
// memory) into one partial row each, part[0][b][C] (weight) and part[1][b][C] (bias), and column_sum (reduce.cu) adds
// the P partials per column in a fixed order into dweight / dbias (one rounding each). No atomics for the gradients:
// the same bits on every run.

template <typename T, int VEC, int K>
__global__ void layernorm_fwd(T* __restrict__ out, float* __restrict__ mean, float* __restrict__ rstd, const T* x,
                              const T* x2, T* res, const T* __restrict__ w, const T* __restrict__ b,
                              unsigned* __restrict__ absmax, int N, int C, float eps) {
    __shared__ float red[32];
    const i64 row = (i64)blockIdx.x * blockDim.y + threadIdx.y;
    const bool active = row < N;
    const int nvec = C / VEC;
    Pack<T, VEC> xs[K];
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = k * blockDim.x + threadIdx.x;
        if (active && j < nvec) {
            const i64 off = row * C + (i64)j * VEC;
            xs[k] = load_pack<T, VEC>(x + off);
            if (x2 != nullptr) {
                const Pack<T, VEC> b2 = load_pack<T, VEC>(x2 + off);
#pragma unroll
                for (int e = 0; e < VEC; ++e) xs[k].v[e] = from_f32<T>(to_f32(xs[k].v[e]) + to_f32(b2.v[e]));
                store_pack<T, VEC>(res + off, xs[k]);
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) s += to_f32(xs[k].v[e]);
        }
    }
    const float mu = row_sum(s, red) / (float)C;
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = k * blockDim.x + threadIdx.x;
        if (active && j < nvec) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float xc = to_f32(xs[k].v[e]) - mu;
                ss += xc * xc;
            }
        }
    }
    const float r = 1.f / sqrtf(row_sum(ss, red) / (float)C + eps);
    if (active && threadIdx.x == 0) {
        mean[row] = mu;
        rstd[row] = r;
    }
    unsigned m = 0u;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = k * blockDim.x + threadIdx.x;
        if (active && j < nvec) {
            const Pack<T, VEC> wp = load_pack<T, VEC>(w + (i64)j * VEC);
            const Pack<T, VEC> bp = load_pack<T, VEC>(b + (i64)j * VEC);
            Pack<T, VEC> y;
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                y.v[e] = from_f32<T>(((to_f32(xs[k].v[e]) - mu) * r) * to_f32(wp.v[e]) + to_f32(bp.v[e]));
                m = max(m, abs_bits(to_f32(y.v[e])));
            }
            store_pack<T, VEC>(out + row * C + (i64)j * VEC, y);
        }
    }
    if (absmax != nullptr) block_atomic_max(absmax, m);
}

template <typename T, int VEC, int K>
__global__ void layernorm_bwd(T* dx, float* __restrict__ part, const T* __restrict__ dy, const T* __restrict__ x,
                              const T* __restrict__ w, const float* __restrict__ mean, const float* __restrict__ rstd,
                              const T* dres, unsigned* __restrict__ absmax, int N, int C, int rows_per_block) {
    unsigned m = 0u;  // max|dx| of the stored values (FP8: the dy scale of the projection below)
    extern __shared__ float dw_sm[];  // [TY][2][C], only when TY > 1
    __shared__ float red[32];
    const int nvec = C / VEC;
    Pack<T, VEC> wp[K];
    float dw[K][VEC], db[K][VEC];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = k * blockDim.x + threadIdx.x;
        if (j < nvec) wp[k] = load_pack<T, VEC>(w + (i64)j * VEC);
#pragma unroll
        for (int e = 0; e < VEC; ++e) dw[k][e] = db[k][e] = 0.f;
    }
    const i64 row0 = (i64)blockIdx.x * rows_per_block;
    const int iters = (rows_per_block + blockDim.y - 1) / blockDim.y;
    for (int it = 0; it < iters; ++it) {  // same trip count for every thread: row_sum synchronises the block
        const int rloc = it * blockDim.y + threadIdx.y;
        const i64 row = row0 + rloc;
        const bool active = rloc < rows_per_block && row < N;
        const float mu = active ? mean[row] : 0.f;
        const float rs = active ? rstd[row] : 0.f;
        Pack<T, VEC> xp[K], gp[K];
        float sum_gw = 0.f, sum_gwx = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int j = k * blockDim.x + threadIdx.x;
            if (active && j < nvec) {
                const i64 off = row * C + (i64)j * VEC;
                xp[k] = load_pack<T, VEC>(x + off);
                gp[k] = load_pack<T, VEC>(dy + off);
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    const float xhat = (to_f32(xp[k].v[e]) - mu) * rs;
                    const float g = to_f32(gp[k].v[e]);
                    const float gw = g * to_f32(wp[k].v[e]);
                    dw[k][e] += g * xhat;
                    db[k][e] += g;
                    sum_gw += gw;
                    sum_gwx += gw * xhat;
                }
            }
        }
        const float mean_gw = row_sum(sum_gw, red) / (float)C;
        const float mean_gwx = row_sum(sum_gwx, red) / (float)C;
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
                    const float xhat = (to_f32(xp[k].v[e]) - mu) * rs;
                    const float gw = to_f32(gp[k].v[e]) * to_f32(wp[k].v[e]);
                    o[e] = round_to<T>(rs * (gw - mean_gw - xhat * mean_gwx) + extra[e]);
                    m = max(m, abs_bits(o[e]));
                }
                store_f32<T, VEC>(dx + off, o);
            }
        }
    }
    if (absmax != nullptr) block_atomic_max(absmax, m);  // every thread of the block reaches this
    float* pw = part + (i64)blockIdx.x * C;                // part[0][b]
    float* pb = part + ((i64)gridDim.x + blockIdx.x) * C;  // part[1][b]
    if (blockDim.y == 1) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int j = k * blockDim.x + threadIdx.x;
            if (j < nvec) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    pw[j * VEC + e] = dw[k][e];
                    pb[j * VEC + e] = db[k][e];
                }
            }
        }
        return;
    }
    float* mine = dw_sm + (i64)threadIdx.y * 2 * C;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = k * blockDim.x + threadIdx.x;
        if (j < nvec) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                mine[j * VEC + e] = dw[k][e];
                mine[C + j * VEC + e] = db[k][e];
            }
        }
    }
    __syncthreads();
    for (int c = threadIdx.y * blockDim.x + threadIdx.x; c < 2 * C; c += blockDim.x * blockDim.y) {
        float s = 0.f;
        for (int y = 0; y < (int)blockDim.y; ++y) s += dw_sm[y * 2 * C + c];
        if (c < C) pw[c] = s;
        else pb[c - C] = s;
    }
}
