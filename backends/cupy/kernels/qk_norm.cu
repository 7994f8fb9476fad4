// qk_norm.cu - Qwen3's QK-norm: a per-head RMSNorm of the query and key heads of the fused qkv buffer, forward and
// backward (deterministic weight gradients).
//
// qkv[N, Hq + 2*Hkv, D] (the QKV GEMM's output, before RoPE): the H = Hq + Hkv query and key head vectors of each
// token are R = N*H "head rows" of D values. Head row r is head h = r % H of token n = r / H: at n*stride_tok + h*D
// in qkv (stride_tok = (Hq + 2*Hkv)*D, so the rows are strided), at r*D in saved[N, H, D] and at r in rstd[N, H].
// Value heads are never read or written. The weight of a row is wq[D] for h < Hq and wk[D] otherwise.
//
// Layout: a group of G lanes (G a power of two <= 32, an aligned part of one warp) owns one head row, each lane K
// 16-byte vectors of it (Pack<T, VEC>: VEC = 8 bf16 or 4 fp32; VEC = 1 when D or a pointer is not a 16-byte
// multiple) in registers, so every value is read once and written once; a row's sums are xor-shuffle reductions
// over its group (group_sum: no shared memory, no __syncthreads). A 1-D block of blockDim.x threads holds
// blockDim.x / G groups. The host picks K (the fewest of 1, 2, 4, 8 with 32*K vectors >= D/VEC) and G.
//
// Forward: saved = x (the loaded bits), rstd = 1/sqrt(mean(x^2) + eps) in fp32, y = (x*rstd)*w rounded once into
// qkv in place. Recompute runs the same kernel on the same input: the same bits.
//
// Backward (in place on dqkv's q/k heads): g = dy, xhat = x*rstd, gw = g*w, dx = rstd*(gw - xhat*mean(gw*xhat)),
// rounded once. Weight gradients: block b owns the head rows [b*rows_per_block, (b+1)*rows_per_block) (a fixed
// partition, a function of R); each lane sums g*xhat of its columns in fp32 registers, separately for query and key
// rows, the block's groups are added in a fixed order (shared memory) into one partial row per weight,
// part[0][b][D] (q) and part[1][b][D] (k), and column_sum (reduce.cu) adds the P partials per column in a fixed
// order into dq_weight / dk_weight (one rounding each). No atomics: the same bits on every run.

template <typename T, int VEC, int K>
__global__ void qk_norm_fwd(T* qkv, T* __restrict__ saved, float* __restrict__ rstd, const T* __restrict__ wq,
                            const T* __restrict__ wk, int R, int H, int Hq, i64 stride_tok, int D, int G, float eps) {
    const int lane = threadIdx.x & (G - 1);
    const i64 r = (i64)blockIdx.x * (blockDim.x / G) + threadIdx.x / G;
    const bool active = r < R;
    const int nvec = D / VEC;
    const i64 tok = r / H;
    const int h = (int)(r - tok * H);
    T* row = qkv + tok * stride_tok + (i64)h * D;
    Pack<T, VEC> xs[K];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = k * G + lane;
        if (active && j < nvec) {
            xs[k] = load_pack<T, VEC>(row + (i64)j * VEC);
            store_pack<T, VEC>(saved + r * D + (i64)j * VEC, xs[k]);
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float f = to_f32(xs[k].v[e]);
                ss += f * f;
            }
        }
    }
    ss = group_sum(ss, G);  // every lane of the warp takes part
    if (!active) return;
    const float rs = 1.f / sqrtf(ss / (float)D + eps);
    if (lane == 0) rstd[r] = rs;
    const T* w = h < Hq ? wq : wk;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = k * G + lane;
        if (j < nvec) {
            const Pack<T, VEC> wp = load_pack<T, VEC>(w + (i64)j * VEC);
            Pack<T, VEC> y;
#pragma unroll
            for (int e = 0; e < VEC; ++e) y.v[e] = from_f32<T>((to_f32(xs[k].v[e]) * rs) * to_f32(wp.v[e]));
            store_pack<T, VEC>(row + (i64)j * VEC, y);
        }
    }
}

template <typename T, int VEC, int K>
__global__ void qk_norm_bwd(T* dqkv, float* __restrict__ part, const T* __restrict__ saved,
                            const float* __restrict__ rstd, const T* __restrict__ wq, const T* __restrict__ wk, int R,
                            int H, int Hq, i64 stride_tok, int D, int G, int rows_per_block) {
    extern __shared__ float dw_sm[];  // [groups][2][D], only when a block has more than one group
    const int lane = threadIdx.x & (G - 1);
    const int grp = threadIdx.x / G;
    const int groups = blockDim.x / G;
    const int nvec = D / VEC;
    Pack<T, VEC> wqp[K], wkp[K];
    float dwq[K][VEC], dwk[K][VEC];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = k * G + lane;
        if (j < nvec) {
            wqp[k] = load_pack<T, VEC>(wq + (i64)j * VEC);
            wkp[k] = load_pack<T, VEC>(wk + (i64)j * VEC);
        }
#pragma unroll
        for (int e = 0; e < VEC; ++e) dwq[k][e] = dwk[k][e] = 0.f;
    }
    const i64 row0 = (i64)blockIdx.x * rows_per_block;
    const int iters = (rows_per_block + groups - 1) / groups;
    for (int it = 0; it < iters; ++it) {  // the same trip count on every lane: group_sum needs the whole warp
        const int rloc = it * groups + grp;
        const i64 r = row0 + rloc;
        const bool active = rloc < rows_per_block && r < R;
        const i64 tok = r / H;
        const int h = (int)(r - tok * H);
        const bool is_q = h < Hq;
        T* row = dqkv + tok * stride_tok + (i64)h * D;
        const float rs = active ? rstd[r] : 0.f;
        Pack<T, VEC> xp[K], gp[K];
        float dot = 0.f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int j = k * G + lane;
            if (active && j < nvec) {
                xp[k] = load_pack<T, VEC>(saved + r * D + (i64)j * VEC);
                gp[k] = load_pack<T, VEC>(row + (i64)j * VEC);
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    const float xhat = to_f32(xp[k].v[e]) * rs;
                    const float g = to_f32(gp[k].v[e]);
                    if (is_q) dwq[k][e] += g * xhat;
                    else dwk[k][e] += g * xhat;
                    dot += (g * to_f32(is_q ? wqp[k].v[e] : wkp[k].v[e])) * xhat;
                }
            }
        }
        dot = group_sum(dot, G) / (float)D;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int j = k * G + lane;
            if (active && j < nvec) {
                Pack<T, VEC> o;
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    const float xhat = to_f32(xp[k].v[e]) * rs;
                    const float gw = to_f32(gp[k].v[e]) * to_f32(is_q ? wqp[k].v[e] : wkp[k].v[e]);
                    o.v[e] = from_f32<T>(rs * (gw - xhat * dot));
                }
                store_pack<T, VEC>(row + (i64)j * VEC, o);
            }
        }
    }
    float* pq = part + (i64)blockIdx.x * D;                 // part[0][b]
    float* pk = part + ((i64)gridDim.x + blockIdx.x) * D;   // part[1][b]
    if (groups == 1) {
#pragma unroll
        for (int k = 0; k < K; ++k) {
            const int j = k * G + lane;
            if (j < nvec) {
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    pq[j * VEC + e] = dwq[k][e];
                    pk[j * VEC + e] = dwk[k][e];
                }
            }
        }
        return;
    }
    float* mine = dw_sm + (i64)grp * 2 * D;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int j = k * G + lane;
        if (j < nvec) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                mine[j * VEC + e] = dwq[k][e];
                mine[D + j * VEC + e] = dwk[k][e];
            }
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < 2 * D; c += blockDim.x) {  // groups added in a fixed order
        float s = 0.f;
        for (int y = 0; y < groups; ++y) s += dw_sm[y * 2 * D + c];
        if (c < D) pq[c] = s;
        else pk[c - D] = s;
    }
}
