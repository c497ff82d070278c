// tandem's CUDA kernels, compiled with NVRTC at start-up for the device's architecture.
// Activations are f32; weights and K/V are f32 or bf16 (the `_bf16` variants); indices u32.
// Every kernel works on the leading `rows` of buffers sized for the largest step, so the same
// launches (with the same addresses) serve every step of a captured graph.

#include <cuda_bf16.h>

typedef unsigned int u32;

// NVRTC has no <math.h>: infinity from its bit pattern.
#define INFINITY __int_as_float(0x7f800000)

__device__ __forceinline__ float load_f(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float load_f(const __nv_bfloat16* p, long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store_f(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f(__nv_bfloat16* p, long i, float v) { p[i] = __float2bfloat16_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of up to 1024 threads; every thread gets the total. `shared` holds 32 floats.
__device__ float block_sum(float v, float* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    int warps = (blockDim.x + 31) >> 5;
    float t = lane < warps ? shared[lane] : 0.0f;
    return warp_sum(t);
}

// A float's bits mapped so that unsigned order is float order (negative values flipped).
__device__ __forceinline__ u32 ordered_bits(float f) {
    u32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
#define ordered ordered_bits

// ---- embedding, norms, elementwise ---------------------------------------------------------

template <typename T>
__device__ void embed_impl(const T* table, const u32* ids, int dim, float* out) {
    long row = blockIdx.x;
    long src = (long)ids[row] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[row * dim + i] = load_f(table, src + i);
}
extern "C" __global__ void embed_f32(const float* table, const u32* ids, int dim, float* out) {
    embed_impl(table, ids, dim, out);
}
extern "C" __global__ void embed_bf16(const __nv_bfloat16* table, const u32* ids, int dim, float* out) {
    embed_impl(table, ids, dim, out);
}

// One block per row: out = x / rms(x) * w.
extern "C" __global__ void rms_norm(const float* x, const float* w, int dim, float eps, float* out) {
    __shared__ float shared[32];
    long row = blockIdx.x;
    const float* xr = x + row * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, shared);
    float inv = rsqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[row * dim + i] = xr[i] * inv * w[i];
}

// Rotate-half RoPE on the first `rot_heads` heads of each row of a fused QKV activation; one
// thread per rotated pair over the whole step (a decode step is a handful of rows).
extern "C" __global__ void rope(float* qkv, const u32* positions, int rows, int width, int rot_heads,
                                int head_dim, float theta) {
    int half = head_dim / 2;
    long pairs = (long)rot_heads * half;
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (t >= rows * pairs) return;
    long row = t / pairs;
    int h = (int)(t % pairs) / half, i = (int)(t % pairs) % half;
    float pos = (float)positions[row];
    // The exponent is computed in double and rounded once, as a correctly rounded f32
    // powf would (the CPU backend and the references use f32 pow): at positions in the
    // tens of thousands an ulp of inv_freq is visible in the angle.
    float inv_freq = 1.0f / (float)pow((double)theta, (double)((float)(2 * i) / (float)head_dim));
    float s, c;
    sincosf(pos * inv_freq, &s, &c);
    float* head = qkv + row * width + (long)h * head_dim;
    float a = head[i], b = head[i + half];
    head[i] = a * c - b * s;
    head[i + half] = b * c + a * s;
}

extern "C" __global__ void silu_mul(const float* gate_up, long rows, int width, float* out) {
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (t >= rows * width) return;
    long row = t / width;
    int i = (int)(t % width);
    float x = gate_up[row * 2 * width + i];
    out[t] = x / (1.0f + expf(-x)) * gate_up[row * 2 * width + width + i];
}

extern "C" __global__ void gather_rows(const float* x, int dim, const u32* index, float* out) {
    long row = blockIdx.x;
    long src = (long)index[row] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[row * dim + i] = x[src + i];
}

extern "C" __global__ void f32_to_bf16(const float* x, long n, __nv_bfloat16* out) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(x[i]);
}

// ---- K/V cache -----------------------------------------------------------------------------

template <typename T>
__device__ void write_kv_impl(const float* qkv, int rows, int width, int k_off, int v_off, int kv_dim,
                              const u32* slots, T* k, T* v) {
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (t >= (long)rows * kv_dim) return;
    long row = t / kv_dim;
    int i = (int)(t % kv_dim);
    long at = (long)slots[row] * kv_dim + i;
    const float* r = qkv + row * width;
    store_f(k, at, r[k_off + i]);
    store_f(v, at, r[v_off + i]);
}
extern "C" __global__ void write_kv_f32(const float* qkv, int rows, int width, int k_off, int v_off,
                                        int kv_dim, const u32* slots, float* k, float* v) {
    write_kv_impl(qkv, rows, width, k_off, v_off, kv_dim, slots, k, v);
}
extern "C" __global__ void write_kv_bf16(const float* qkv, int rows, int width, int k_off, int v_off,
                                         int kv_dim, const u32* slots, __nv_bfloat16* k, __nv_bfloat16* v) {
    write_kv_impl(qkv, rows, width, k_off, v_off, kv_dim, slots, k, v);
}

// Copies `n` rows of `row_words` 32-bit words between a slot-indexed cache and a dense buffer:
// `to_dense` gathers cache rows `slots[i]` into row i, otherwise scatters row i into them.
extern "C" __global__ void copy_slots(u32* cache, const u32* slots, int n, int row_words, u32* dense,
                                      int to_dense) {
    long i = blockIdx.x;
    if (i >= n) return;
    long c = (long)slots[i] * row_words, d = i * row_words;
    for (int w = threadIdx.x; w < row_words; w += blockDim.x) {
        if (to_dense) dense[d + w] = cache[c + w];
        else cache[c + w] = dense[d + w];
    }
}

// ---- attention -----------------------------------------------------------------------------
//
// One block per (token, kv head, split): the group of query heads sharing that kv head walks
// its share of the token's causal context in the paged cache. Each warp takes every
// `ATTN_WARPS`-th run of `ATTN_UNROLL` keys (their loads issued together, so a warp has
// several cache reads in flight); its lanes split the head dimension; an online softmax per
// query head runs in registers, and the warps merge through shared memory. With one split the
// block writes the output; with several (decode: few tokens, long contexts) each block writes
// its (max, sum, weighted values) to `partial` and `attention_combine` merges the splits.

#define ATTN_WARPS 4
#define ATTN_UNROLL 8

// G query heads per kv head and D = 32 * PL values per head are compile-time constants, so
// every per-head array lives in registers (runtime-indexed arrays would go to local memory).
template <typename T, int G, int PL>
__device__ void attention_impl(const float* qkv, int width, int num_heads, int num_kv_heads,
                               const T* k_cache, const T* v_cache, int block_size,
                               const u32* seq_info, int num_seqs, const u32* tables, int table_stride,
                               float scale, int split_keys, float* partial, float* out) {
    constexpr int D = 32 * PL;
    __shared__ float s_q[G * D];
    __shared__ float s_m[ATTN_WARPS][G];
    __shared__ float s_l[ATTN_WARPS][G];
    __shared__ float s_acc[ATTN_WARPS][G * D];

    int token = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // The token's sequence: the one whose [start, start + len) holds it.
    int seq = 0;
    for (int s = 0; s < num_seqs; ++s) {
        u32 start = seq_info[3 * s], len = seq_info[3 * s + 1];
        if ((u32)token >= start && (u32)token < start + len) { seq = s; break; }
    }
    u32 start = seq_info[3 * seq], cached = seq_info[3 * seq + 2];
    int ctx = (int)(cached + (token - start)) + 1;
    int first = splits > 1 ? split * split_keys : 0;
    int last = splits > 1 ? min(ctx, first + split_keys) : ctx;
    const u32* table = tables + (long)seq * table_stride;
    int kv_dim = num_kv_heads * D;

    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        int g = i / D, d = i % D;
        s_q[i] = qkv[(long)token * width + (long)(kvh * G + g) * D + d] * scale;
    }
    __syncthreads();
    float q[G][PL];
    #pragma unroll
    for (int g = 0; g < G; ++g)
        #pragma unroll
        for (int j = 0; j < PL; ++j) q[g][j] = s_q[g * D + lane + 32 * j];

    float m[G], l[G], acc[G][PL];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY; l[g] = 0.0f;
        #pragma unroll
        for (int j = 0; j < PL; ++j) acc[g][j] = 0.0f;
    }
    for (int base = first + warp * ATTN_UNROLL; base < last; base += ATTN_WARPS * ATTN_UNROLL) {
        float kv[ATTN_UNROLL][PL], vv[ATTN_UNROLL][PL];
        #pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            int key = min(base + u, last - 1);  // past the end: reload the last key, unused
            long slot = (long)table[key / block_size] * block_size + key % block_size;
            const T* kr = k_cache + slot * kv_dim + (long)kvh * D;
            const T* vr = v_cache + slot * kv_dim + (long)kvh * D;
            #pragma unroll
            for (int j = 0; j < PL; ++j) {
                kv[u][j] = load_f(kr, lane + 32 * j);
                vv[u][j] = load_f(vr, lane + 32 * j);
            }
        }
        #pragma unroll
        for (int u = 0; u < ATTN_UNROLL; ++u) {
            if (base + u >= last) break;
            #pragma unroll
            for (int g = 0; g < G; ++g) {
                float dot = 0.0f;
                #pragma unroll
                for (int j = 0; j < PL; ++j) dot += q[g][j] * kv[u][j];
                dot = warp_sum(dot);
                float mn = fmaxf(m[g], dot);
                float corr = __expf(m[g] - mn);
                float p = __expf(dot - mn);
                l[g] = l[g] * corr + p;
                #pragma unroll
                for (int j = 0; j < PL; ++j) acc[g][j] = acc[g][j] * corr + p * vv[u][j];
                m[g] = mn;
            }
        }
    }
    // Merge the warps.
    if (lane == 0) {
        #pragma unroll
        for (int g = 0; g < G; ++g) { s_m[warp][g] = m[g]; s_l[warp][g] = l[g]; }
    }
    __syncthreads();
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        float mt = -INFINITY;
        for (int w = 0; w < ATTN_WARPS; ++w) mt = fmaxf(mt, s_m[w][g]);
        float f = m[g] == -INFINITY ? 0.0f : __expf(m[g] - mt);
        #pragma unroll
        for (int j = 0; j < PL; ++j) s_acc[warp][g * D + lane + 32 * j] = acc[g][j] * f;
        if (lane == 0) s_l[warp][g] = l[g] * f;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        int g = i / D, d = i % D;
        float sum = 0.0f, lt = 0.0f, mt = -INFINITY;
        for (int w = 0; w < ATTN_WARPS; ++w) {
            sum += s_acc[w][i];
            lt += s_l[w][g];
            mt = fmaxf(mt, s_m[w][g]);
        }
        int head = kvh * G + g;
        if (splits == 1) {
            out[(long)token * num_heads * D + (long)head * D + d] = sum / lt;
        } else {
            // partial[token][head][split] = (max, sum, values[D])
            float* p = partial + (((long)token * num_heads + head) * splits + split) * (D + 2);
            if (d == 0) { p[0] = mt; p[1] = lt; }
            p[2 + d] = sum;
        }
    }
}

// attention_<dtype>_g<G>_d<D>: one kernel per cache dtype, group size and head width.
#define ATTENTION(NAME, T, G, PL) \
    extern "C" __global__ void __launch_bounds__(128) NAME( \
            const float* qkv, int width, int num_heads, int num_kv_heads, const T* k, const T* v, \
            int block_size, const u32* seq_info, int num_seqs, const u32* tables, int table_stride, \
            float scale, int split_keys, float* partial, float* out) { \
        attention_impl<T, G, PL>(qkv, width, num_heads, num_kv_heads, k, v, block_size, seq_info, \
                                 num_seqs, tables, table_stride, scale, split_keys, partial, out); \
    }
#define ATTENTION_GROUPS(DT, T, D, PL) \
    ATTENTION(attention_##DT##_g1_d##D, T, 1, PL) ATTENTION(attention_##DT##_g2_d##D, T, 2, PL) \
    ATTENTION(attention_##DT##_g3_d##D, T, 3, PL) ATTENTION(attention_##DT##_g4_d##D, T, 4, PL) \
    ATTENTION(attention_##DT##_g5_d##D, T, 5, PL) ATTENTION(attention_##DT##_g6_d##D, T, 6, PL) \
    ATTENTION(attention_##DT##_g7_d##D, T, 7, PL) ATTENTION(attention_##DT##_g8_d##D, T, 8, PL)
ATTENTION_GROUPS(f32, float, 64, 2)
ATTENTION_GROUPS(f32, float, 128, 4)
ATTENTION_GROUPS(bf16, __nv_bfloat16, 64, 2)
ATTENTION_GROUPS(bf16, __nv_bfloat16, 128, 4)

// Merges the splits of `attention_*`: one block per (token, head), a thread per value.
extern "C" __global__ void attention_combine(const float* partial, int splits, int head_dim, float* out) {
    long token = blockIdx.x;
    int head = blockIdx.y, num_heads = gridDim.y;
    const float* p = partial + ((token * num_heads + head) * splits) * (long)(head_dim + 2);
    float mt = -INFINITY;
    for (int s = 0; s < splits; ++s) mt = fmaxf(mt, p[s * (head_dim + 2)]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.0f, lt = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const float* q = p + s * (head_dim + 2);
            float f = q[0] == -INFINITY ? 0.0f : __expf(q[0] - mt);
            lt += q[1] * f;
            sum += q[2 + d] * f;
        }
        out[(token * num_heads + head) * head_dim + d] = sum / lt;
    }
}

// ---- small-M matmul (decode) ---------------------------------------------------------------
//
// out[r][n] (+)= sum_k x[r][k] * W[n][k] for R <= 8 rows, bf16 W. One warp per output feature:
// the warp streams W's row once with 16-byte loads and applies it to all R activation rows
// (small, served from L1/L2), so weights are read exactly once per call.

template <int R>
__device__ __forceinline__ void gemv_chunk(const float* x, int K, int c, uint4 pack, float* acc) {
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&pack);
    float w[8];
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        float2 f = __bfloat1622float2(w2[j]);
        w[2 * j] = f.x; w[2 * j + 1] = f.y;
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        const float4* xr = reinterpret_cast<const float4*>(x + (long)r * K + c * 8);
        float4 a = xr[0], b = xr[1];
        acc[r] += a.x * w[0] + a.y * w[1] + a.z * w[2] + a.w * w[3]
                + b.x * w[4] + b.y * w[5] + b.z * w[6] + b.w * w[7];
    }
}

// GEMV_UNROLL 16-byte weight loads per lane are issued before any is used, so a warp keeps
// 4 KiB of its row in flight (the loop is otherwise bound by memory latency, not bandwidth).
#define GEMV_UNROLL 8

template <int R>
__device__ void gemv_bf16_impl(const float* x, int K, const __nv_bfloat16* W, int N, float* out,
                               int accumulate) {
    int lane = threadIdx.x & 31;
    int n = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= N) return;
    const uint4* wrow = reinterpret_cast<const uint4*>(W + (long)n * K);
    float acc[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    int chunks = K / 8;
    int c = lane;
    for (; c + 32 * (GEMV_UNROLL - 1) < chunks; c += 32 * GEMV_UNROLL) {
        uint4 pack[GEMV_UNROLL];
        #pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) pack[u] = __ldg(wrow + c + 32 * u);
        #pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) gemv_chunk<R>(x, K, c + 32 * u, pack[u], acc);
    }
    for (; c < chunks; c += 32) gemv_chunk<R>(x, K, c, __ldg(wrow + c), acc);
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        float s = warp_sum(acc[r]);
        if (lane == 0) {
            long at = (long)r * N + n;
            out[at] = accumulate ? out[at] + s : s;
        }
    }
}

#define GEMV(R) \
    extern "C" __global__ void gemv_bf16_##R(const float* x, int K, const __nv_bfloat16* W, int N, \
                                             float* out, int accumulate) { \
        gemv_bf16_impl<R>(x, K, W, N, out, accumulate); \
    }
GEMV(1) GEMV(2) GEMV(3) GEMV(4) GEMV(5) GEMV(6) GEMV(7) GEMV(8)

// ---- sampling ------------------------------------------------------------------------------
//
// One block of 1024 threads per logits row. params[4 * row ..] = temperature, top_k (as bits),
// top_p, and a uniform draw in [0, 1) made on the host from (seed, step). Greedy (temperature
// <= 0 or top_k == 1) takes the first maximum. Otherwise the top-k and top-p cut-offs are found
// by bisection over the logits' ordered bit patterns (counting and summing passes, no sort), and
// the draw walks the surviving candidates in vocabulary order.


// Greedy rows: `best[row]` (zeroed beforehand) becomes the row's maximum as
// (ordered value << 32 | ~index): atomicMax over blocks of a vocabulary slice each keeps the
// largest value and, among equal ones, the first index.
extern "C" __global__ void argmax_partial(const float* logits, int vocab, unsigned long long* best) {
    __shared__ unsigned long long s_key[32];
    long row = blockIdx.x;
    int slice = (vocab + gridDim.y - 1) / gridDim.y;
    int begin = blockIdx.y * slice, end = min(vocab, begin + slice);
    const float* lr = logits + row * vocab;
    unsigned long long key = 0;
    for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
        unsigned long long k = ((unsigned long long)ordered_bits(lr[i]) << 32) | (0xffffffffu - (u32)i);
        key = k > key ? k : key;
    }
    for (int o = 16; o > 0; o >>= 1) {
        unsigned long long other = __shfl_xor_sync(0xffffffffu, key, o);
        key = other > key ? other : key;
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) s_key[warp] = key;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) key = s_key[w] > key ? s_key[w] : key;
        atomicMax(best + row, key);
    }
}

extern "C" __global__ void sample_rows(const float* logits, int vocab, const float* params,
                                       const unsigned long long* greedy, u32* out) {
    __shared__ float shared[32];
    __shared__ float s_best[32];
    __shared__ int s_idx[32];
    __shared__ float s_scan[1024];
    long row = blockIdx.x;
    const float* lr = logits + row * vocab;
    float temperature = params[4 * row];
    int top_k = (int)__float_as_uint(params[4 * row + 1]);
    float top_p = params[4 * row + 2];
    float draw = params[4 * row + 3];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (temperature <= 0.0f || top_k == 1) {
        if (tid == 0) out[row] = 0xffffffffu - (u32)(greedy[row] & 0xffffffffu);
        return;
    }

    // Block argmax (first index on ties).
    float best = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = tid; i < vocab; i += blockDim.x) {
        float v = lr[i];
        if (v > best) { best = v; idx = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ob = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ob > best || (ob == best && oi < idx)) { best = ob; idx = oi; }
    }
    if (lane == 0) { s_best[warp] = best; s_idx[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        int warps = blockDim.x >> 5;
        best = lane < warps ? s_best[lane] : -INFINITY;
        idx = lane < warps ? s_idx[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            if (ob > best || (ob == best && oi < idx)) { best = ob; idx = oi; }
        }
        if (lane == 0) { s_best[0] = best; s_idx[0] = idx; }
    }
    __syncthreads();
    float max_logit = s_best[0];
    float inv_t = 1.0f / temperature;
    float max_s = max_logit * inv_t;

    // Top-k: the largest threshold keeping at least k logits.
    u32 lo = 0, hi = 0xffffffffu;  // answer in [lo, hi]
    if (top_k > 0 && top_k < vocab) {
        while (lo < hi) {
            u32 mid = lo + (hi - lo) / 2 + 1;
            float cnt = 0.0f;
            for (int i = tid; i < vocab; i += blockDim.x) cnt += ordered(lr[i]) >= mid ? 1.0f : 0.0f;
            cnt = block_sum(cnt, shared);
            if (cnt >= (float)top_k) lo = mid; else hi = mid - 1;
        }
    }
    u32 cut = lo;
    float total = 0.0f;
    for (int i = tid; i < vocab; i += blockDim.x)
        if (ordered(lr[i]) >= cut) total += __expf(lr[i] * inv_t - max_s);
    total = block_sum(total, shared);
    // Top-p: the largest threshold whose kept mass reaches top_p.
    if (top_p < 1.0f) {
        u32 plo = cut, phi = 0xffffffffu;
        while (plo < phi) {
            u32 mid = plo + (phi - plo) / 2 + 1;
            float mass = 0.0f;
            for (int i = tid; i < vocab; i += blockDim.x)
                if (ordered(lr[i]) >= mid) mass += __expf(lr[i] * inv_t - max_s);
            mass = block_sum(mass, shared);
            if (mass >= top_p * total) plo = mid; else phi = mid - 1;
        }
        cut = plo;
    }
    // Walk the candidates in vocabulary order: each thread owns a contiguous chunk.
    int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    int begin = tid * chunk, end = min(vocab, begin + chunk);
    float mine = 0.0f;
    for (int i = begin; i < end; ++i)
        if (ordered(lr[i]) >= cut) mine += __expf(lr[i] * inv_t - max_s);
    s_scan[tid] = mine;
    __syncthreads();
    if (tid == 0) {
        float acc = 0.0f;
        for (int t = 0; t < (int)blockDim.x; ++t) { float v = s_scan[t]; s_scan[t] = acc; acc += v; }
        shared[0] = acc;
    }
    __syncthreads();
    float target = draw * shared[0];
    float before = s_scan[tid];
    // The owner is the thread whose prefix range holds the target; ties resolve to the first.
    if (mine > 0.0f && target >= before && target < before + mine) {
        float acc = before;
        int pick = -1, last = -1;
        for (int i = begin; i < end; ++i) {
            if (ordered(lr[i]) < cut) continue;
            last = i;
            acc += __expf(lr[i] * inv_t - max_s);
            if (target < acc) { pick = i; break; }
        }
        out[row] = (u32)(pick >= 0 ? pick : last);
    }
    // Rounding can leave the target at or past the total: take the last candidate.
    if (tid == 0 && !(target < shared[0])) {
        int last = s_idx[0];
        for (int i = vocab - 1; i >= 0; --i)
            if (ordered(lr[i]) >= cut) { last = i; break; }
        out[row] = (u32)last;
    }
}

// ---- prefill attention on tensor cores -----------------------------------------------------
//
// For steps with many new tokens per sequence (prompts), over a bf16 cache. One block of four
// warps per (tile of PF_M queries of one sequence, query head); each warp owns 16 query rows,
// kept in registers as bf16 MMA fragments. The block walks the keys up to its last query's
// position in tiles of PF_N, gathered from the paged cache into shared memory; each warp
// computes its scores S = Q·Kᵀ with `mma.sync` m16n8k16 (bf16 in, f32 accumulation), masks
// them causally, runs an online softmax in registers (a row's four owning lanes exchange
// maxima by shuffles; sums stay per lane until the end), and adds P·V, reusing the score
// registers as the A operand. V's B fragments come transposed out of shared memory with
// `ldmatrix.trans`. Accumulator layout of m16n8k16 (PTX ISA): lane = 4·g + t holds rows g and
// g + 8, columns 2t and 2t + 1.

#define PF_M 64
#define PF_N 64

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low half
    return *reinterpret_cast<u32*>(&v);
}

// d += a · b for one m16n8k16 tile.
__device__ __forceinline__ void mma_bf16(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int D>
__device__ void prefill_attention_impl(const float* qkv, int width, int num_heads, int num_kv_heads,
                                       const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
                                       int block_size, const u32* seq_info, int num_seqs,
                                       const u32* tables, int table_stride, float scale, float* out) {
    constexpr int LD = D + 8;  // padded rows: fragment loads of nearby rows hit different banks
    __shared__ __align__(16) __nv_bfloat16 s_k[PF_N * LD];
    __shared__ __align__(16) __nv_bfloat16 s_v[PF_N * LD];

    // This block's sequence and query tile (a sequence's longest tiles first).
    int t = blockIdx.x, seq = -1;
    for (int s = 0; s < num_seqs; ++s) {
        int tiles = (int)((seq_info[3 * s + 1] + PF_M - 1) / PF_M);
        if (t < tiles) { seq = s; t = tiles - 1 - t; break; }
        t -= tiles;
    }
    if (seq < 0) return;
    u32 start = seq_info[3 * seq], len = seq_info[3 * seq + 1], cached = seq_info[3 * seq + 2];
    int head = blockIdx.y, kvh = head / (num_heads / num_kv_heads);
    int q0 = t * PF_M, nq = min(PF_M, (int)len - q0);
    int keys = (int)cached + q0 + nq;  // the block's last query's context
    const u32* table = tables + (long)seq * table_stride;
    long kv_dim = (long)num_kv_heads * D;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int g = lane >> 2, tq = lane & 3;

    // This lane's two rows (of the tile) and their positions; rows past the prompt are
    // computed on a copy of the last row and never written.
    int ra = warp * 16 + g, rb = ra + 8;
    int pos_a = (int)cached + q0 + ra, pos_b = (int)cached + q0 + rb;
    bool ok_a = ra < nq, ok_b = rb < nq;
    int warp_last = (int)cached + q0 + min(warp * 16 + 15, nq - 1);

    u32 qf[D / 16][4];
    {
        const float* qa = qkv + (long)(start + q0 + min(ra, nq - 1)) * width + (long)head * D;
        const float* qb = qkv + (long)(start + q0 + min(rb, nq - 1)) * width + (long)head * D;
        #pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            int c = ks * 16 + 2 * tq;
            qf[ks][0] = pack_bf16(qa[c] * scale, qa[c + 1] * scale);
            qf[ks][1] = pack_bf16(qb[c] * scale, qb[c + 1] * scale);
            qf[ks][2] = pack_bf16(qa[c + 8] * scale, qa[c + 9] * scale);
            qf[ks][3] = pack_bf16(qb[c + 8] * scale, qb[c + 9] * scale);
        }
    }
    float o[D / 8][4];
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;

    for (int k0 = 0; k0 < keys; k0 += PF_N) {
        __syncthreads();  // every warp is done with the previous tile
        constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
        for (int c = tid; c < PF_N * CHUNKS; c += blockDim.x) {
            int key = c / CHUNKS, part = c % CHUNKS, kk = k0 + key;
            uint4 kz = make_uint4(0, 0, 0, 0), vz = kz;
            if (kk < keys) {
                long slot = (long)table[kk / block_size] * block_size + kk % block_size;
                long at = slot * kv_dim + (long)kvh * D + part * 8;
                kz = *reinterpret_cast<const uint4*>(k_cache + at);
                vz = *reinterpret_cast<const uint4*>(v_cache + at);
            }
            *reinterpret_cast<uint4*>(s_k + key * LD + part * 8) = kz;
            *reinterpret_cast<uint4*>(s_v + key * LD + part * 8) = vz;
        }
        __syncthreads();
        if (k0 > warp_last) continue;  // every key of the tile is after this warp's rows

        float s[PF_N / 8][4];
        #pragma unroll
        for (int j = 0; j < PF_N / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
            const __nv_bfloat16* kr = s_k + (j * 8 + g) * LD + 2 * tq;
            #pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) {
                u32 b0 = *reinterpret_cast<const u32*>(kr + ks * 16);
                u32 b1 = *reinterpret_cast<const u32*>(kr + ks * 16 + 8);
                mma_bf16(s[j], qf[ks], b0, b1);
            }
        }
        // Causal mask, then the tile's row maxima over the row's four lanes.
        float mx_a = -INFINITY, mx_b = -INFINITY;
        #pragma unroll
        for (int j = 0; j < PF_N / 8; ++j) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                int key = k0 + j * 8 + 2 * tq + e;
                if (!ok_a || key > pos_a) s[j][e] = -INFINITY;
                if (!ok_b || key > pos_b) s[j][2 + e] = -INFINITY;
                mx_a = fmaxf(mx_a, s[j][e]);
                mx_b = fmaxf(mx_b, s[j][2 + e]);
            }
        }
        #pragma unroll
        for (int x = 1; x <= 2; x <<= 1) {
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, x));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, x));
        }
        float new_a = fmaxf(m_a, mx_a), new_b = fmaxf(m_b, mx_b);
        float use_a = new_a == -INFINITY ? 0.0f : new_a;  // a row that has seen nothing yet
        float use_b = new_b == -INFINITY ? 0.0f : new_b;
        float corr_a = __expf(m_a - use_a), corr_b = __expf(m_b - use_b);
        m_a = new_a;
        m_b = new_b;
        float sum_a = 0.0f, sum_b = 0.0f;
        #pragma unroll
        for (int j = 0; j < PF_N / 8; ++j) {
            s[j][0] = __expf(s[j][0] - use_a);
            s[j][1] = __expf(s[j][1] - use_a);
            s[j][2] = __expf(s[j][2] - use_b);
            s[j][3] = __expf(s[j][3] - use_b);
            sum_a += s[j][0] + s[j][1];
            sum_b += s[j][2] + s[j][3];
        }
        l_a = l_a * corr_a + sum_a;
        l_b = l_b * corr_b + sum_b;
        #pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            o[n][0] *= corr_a; o[n][1] *= corr_a;
            o[n][2] *= corr_b; o[n][3] *= corr_b;
        }
        // O += P V, 16 keys at a time: two score tiles make one A fragment.
        #pragma unroll
        for (int kk = 0; kk < PF_N / 16; ++kk) {
            u32 pa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                         pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                         pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            // ldmatrix.x4.trans: lanes 0-15 address keys kk*16 + 0..15 at dims n0..n0+7, lanes
            // 16-31 the same keys at n0+8..n0+15; registers 0/1 are the B fragment of
            // columns n0.., 2/3 that of n0+8...
            const __nv_bfloat16* vrow = s_v + (kk * 16 + (lane & 15)) * LD + (lane >> 4) * 8;
            #pragma unroll
            for (int n = 0; n < D / 8; n += 2) {
                u32 b0, b1, b2, b3;
                unsigned addr = (unsigned)__cvta_generic_to_shared(vrow + n * 8);
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                             : "=r"(b0), "=r"(b1), "=r"(b2), "=r"(b3)
                             : "r"(addr));
                mma_bf16(o[n], pa, b0, b1);
                mma_bf16(o[n + 1], pa, b2, b3);
            }
        }
    }
    // Row sums over the row's four lanes, then the output rows.
    #pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, x);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, x);
    }
    long stride = (long)num_heads * D;
    float* oa = out + (long)(start + q0 + ra) * stride + (long)head * D;
    float* ob = out + (long)(start + q0 + rb) * stride + (long)head * D;
    #pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        int c = n * 8 + 2 * tq;
        if (ok_a) { oa[c] = o[n][0] / l_a; oa[c + 1] = o[n][1] / l_a; }
        if (ok_b) { ob[c] = o[n][2] / l_b; ob[c + 1] = o[n][3] / l_b; }
    }
}

#define PREFILL_ATTENTION(D) \
    extern "C" __global__ void __launch_bounds__(128) prefill_attention_bf16_d##D( \
            const float* qkv, int width, int num_heads, int num_kv_heads, const __nv_bfloat16* k, \
            const __nv_bfloat16* v, int block_size, const u32* seq_info, int num_seqs, \
            const u32* tables, int table_stride, float scale, float* out) { \
        prefill_attention_impl<D>(qkv, width, num_heads, num_kv_heads, k, v, block_size, seq_info, \
                                  num_seqs, tables, table_stride, scale, out); \
    }
PREFILL_ATTENTION(64)
PREFILL_ATTENTION(128)
