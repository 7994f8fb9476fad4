// rope.cu - rotary position embedding, forward and backward, in place on the fused qkv buffer.
//
// qkv[B, T, Hq + 2*Hkv, D] (D contiguous; other strides given): only the q and k heads are rotated, v is
// never read. Half-split convention: (x1, x2) = (x[:D/2], x[D/2:]); forward (x1 c - x2 s, x2 c + x1 s),
// backward the transpose (x1 c + x2 s, x2 c - x1 s), cos/sin[t, D/2] fp32. One thread per VEC-wide slice of
// one half of one head of one token (grid-stride): consecutive threads walk the head dim, then the heads,
// so both halves of every head are read and written with 16-byte accesses, once. fp32 math.

template <typename T, int VEC>
__global__ void rope(T* qkv, const float* __restrict__ cosp, const float* __restrict__ sinp, int seq_len,
                     int n_heads, int half, i64 sb, i64 st, i64 sh, i64 scos, i64 total, int inverse) {
    const int nv = half / VEC;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const int jv = (int)(i % nv);
        const i64 rest = i / nv;
        const int h = (int)(rest % n_heads);
        const i64 tok = rest / n_heads;
        const int t = (int)(tok % seq_len);
        const i64 b = tok / seq_len;
        T* p = qkv + b * sb + (i64)t * st + (i64)h * sh + (i64)jv * VEC;
        float x1[VEC], x2[VEC], c[VEC], s[VEC], y1[VEC], y2[VEC];
        load_f32<T, VEC>(p, x1);
        load_f32<T, VEC>(p + half, x2);
        load_floats<VEC>(cosp + (i64)t * scos + (i64)jv * VEC, c);
        load_floats<VEC>(sinp + (i64)t * scos + (i64)jv * VEC, s);
        if (inverse) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                y1[e] = x1[e] * c[e] + x2[e] * s[e];
                y2[e] = x2[e] * c[e] - x1[e] * s[e];
            }
        } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                y1[e] = x1[e] * c[e] - x2[e] * s[e];
                y2[e] = x2[e] * c[e] + x1[e] * s[e];
            }
        }
        store_f32<T, VEC>(p, y1);
        store_f32<T, VEC>(p + half, y2);
    }
}
