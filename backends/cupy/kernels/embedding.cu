// embedding.cu - embedding forward (row gather) and a deterministic, atomic-free embedding backward.
//
// Forward: out[n] = table[tokens[n]]. A pure copy of bits, done in the widest word W that divides the row
// (16-byte uint4 when rows and pointers allow) by a grid-stride loop over all words of the output: every
// warp moves 512 contiguous bytes per instruction.
//
// Backward: dtable[v] += sum over {n : tokens[n] == v} of dout[n], bit-identical from run to run. The host
// sorts the tokens (stable torch.sort, on the device) and the sorted positions are cut into chunks of CHUNK.
//   emb_bwd_head:     each chunk sums the dout rows of its *first* run (positions holding its first token)
//                     -> head[chunk, C] in fp32.
//   emb_bwd_segments: each chunk walks its positions in order, summing the rows of each run in fp32; a run
//                     that starts in this chunk is owned by it, and when it reaches the chunk's end, the
//                     heads of the following chunks are added while they continue with the same token.
//                     The owner then does a single read-modify-write of dtable[token] (one rounding).
// Every sum has a fixed order (the sorted order, ties by position), no atomics; a token repeated k times
// costs k / CHUNK serial head additions, not k. Threads split the C columns, VEC at a time.

#define CHUNK 32

template <typename W, typename TI>
__global__ void emb_fwd(W* __restrict__ out, const TI* __restrict__ tokens, const W* __restrict__ table,
                        i64 n_words, int row_words) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n_words; i += (i64)gridDim.x * blockDim.x) {
        const i64 row = i / row_words;
        const int col = (int)(i - row * row_words);
        out[i] = table[(i64)tokens[row] * row_words + col];
    }
}

template <typename T, int VEC>
__global__ void emb_bwd_head(float* __restrict__ head, const i64* __restrict__ sorted, const i64* __restrict__ perm,
                             const T* __restrict__ dout, int N, int C) {
    __shared__ i64 tok[CHUNK], src[CHUNK];
    const int chunk = blockIdx.x;
    const int p0 = chunk * CHUNK;
    const int n = min(CHUNK, N - p0);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        tok[i] = sorted[p0 + i];
        src[i] = perm[p0 + i];
    }
    __syncthreads();
    int len = 1;  // length of the first run inside this chunk
    while (len < n && tok[len] == tok[0]) ++len;
    for (int j = threadIdx.x * VEC; j < C; j += blockDim.x * VEC) {
        float acc[VEC], row[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
        for (int i = 0; i < len; ++i) {
            load_f32<T, VEC>(dout + src[i] * C + j, row);
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] += row[e];
        }
        float* h = head + (i64)chunk * C + j;
#pragma unroll
        for (int e = 0; e < VEC; ++e) h[e] = acc[e];
    }
}

template <typename T, int VEC>
__global__ void emb_bwd_segments(T* __restrict__ dtable, const float* __restrict__ head,
                                 const i64* __restrict__ sorted, const i64* __restrict__ perm,
                                 const T* __restrict__ dout, int N, int C, int num_chunks) {
    __shared__ i64 tok[CHUNK], src[CHUNK];
    const int chunk = blockIdx.x;
    const int p0 = chunk * CHUNK;
    const int n = min(CHUNK, N - p0);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        tok[i] = sorted[p0 + i];
        src[i] = perm[p0 + i];
    }
    __syncthreads();
    const i64 before = p0 > 0 ? sorted[p0 - 1] : (i64)-1;
    for (int j = threadIdx.x * VEC; j < C; j += blockDim.x * VEC) {
        float acc[VEC], row[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
        bool owned = tok[0] != before;  // the first run belongs to an earlier chunk when it continues one
        for (int i = 0; i < n; ++i) {
            load_f32<T, VEC>(dout + src[i] * C + j, row);
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] += row[e];
            const bool run_ends = (i == n - 1) || tok[i + 1] != tok[i];
            if (!run_ends) continue;
            if (owned) {
                const i64 t = tok[i];
                if (i == n - 1) {  // the run reaches the chunk's end: add the heads of the chunks it continues into
                    for (int c = chunk + 1; c < num_chunks && sorted[(i64)c * CHUNK] == t; ++c) {
                        load_floats<VEC>(head + (i64)c * C + j, row);
#pragma unroll
                        for (int e = 0; e < VEC; ++e) acc[e] += row[e];
                        if (sorted[min((i64)(c + 1) * CHUNK, (i64)N) - 1] != t) break;  // the run ends inside c
                    }
                }
                T* dst = dtable + t * C + j;
                float cur[VEC];
                load_f32<T, VEC>(dst, cur);
#pragma unroll
                for (int e = 0; e < VEC; ++e) cur[e] += acc[e];
                store_f32<T, VEC>(dst, cur);
            }
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
            owned = true;  // every later run of the chunk starts inside it
        }
    }
}
