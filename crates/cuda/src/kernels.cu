// tandem's CUDA kernels, compiled with NVRTC at start-up for the device's architecture.
// Activations are f32; weights and K/V are f32 or bf16 (the `_bf16` variants); indices u32.
// Every kernel works on the leading `rows` of buffers sized for the largest step, so the same
// launches (with the same addresses) serve every step of a captured graph.
//
// Every kernel may be launched before the one ahead of it has finished (programmatic
// dependent launch, Hopper on): each calls `pdl_start` before it reads anything earlier
// kernels write and before it returns, so a kernel never ends before the one ahead of it.
// Before that call a kernel may only read what no kernel of the step writes: weights, the
// step's metadata (uploaded before the step) and K/V of earlier steps.

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

// Waits until the previous kernel on the stream has finished and its writes are visible (a
// no-op without a programmatic dependency), then lets the next kernel launch: its blocks take
// only the room this one leaves and wait in their own `pdl_start`.
__device__ __forceinline__ void pdl_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Checks at start-up that launches with programmatic dependencies work here (also in a graph).
extern "C" __global__ void pdl_probe(u32* count) {
    pdl_start();
    if (threadIdx.x == 0) atomicAdd(count, 1u);
}

// ---- embedding, norms, elementwise ---------------------------------------------------------

// The inverse frequency of RoPE pair i: the exponent in double, rounded once, as a correctly
// rounded f32 powf would give (the CPU backend and the references use f32 pow; at positions in
// the tens of thousands an ulp of inv_freq is visible in the angle).
__device__ __forceinline__ float rope_inv_freq(float theta, int i, int head_dim) {
    return 1.0f / (float)pow((double)theta, (double)((float)(2 * i) / (float)head_dim));
}


template <typename T>
__device__ void embed_impl(const T* table, const u32* ids, int dim, float* out) {
    pdl_start();
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

// One block per row: out = x / rms(x) * w (f32 out, or bf16 for a GEMM's input); rows whose
// width is a multiple of 4 move as float4.
__device__ __forceinline__ void store4(float* p, long i, float4 v) { *reinterpret_cast<float4*>(p + i) = v; }
__device__ __forceinline__ void store4(__nv_bfloat16* p, long i, float4 v) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    uint2 packed = make_uint2(*reinterpret_cast<u32*>(&lo), *reinterpret_cast<u32*>(&hi));
    *reinterpret_cast<uint2*>(p + i) = packed;
}
template <typename T>
__device__ void rms_norm_impl(const float* x, const float* w, int dim, float eps, T* out) {
    pdl_start();
    __shared__ float shared[32];
    long row = blockIdx.x;
    const float* xr = x + row * dim;
    float ss = 0.0f;
    if ((dim & 3) == 0) {
        const float4* x4 = reinterpret_cast<const float4*>(xr);
        for (int i = threadIdx.x; i < dim / 4; i += blockDim.x) {
            float4 v = x4[i];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        ss = block_sum(ss, shared);
        float inv = rsqrtf(ss / (float)dim + eps);
        const float4* w4 = reinterpret_cast<const float4*>(w);
        for (int i = threadIdx.x; i < dim / 4; i += blockDim.x) {
            float4 v = x4[i], g = w4[i];
            store4(out, row * dim + 4 * i, make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w));
        }
        return;
    }
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, shared);
    float inv = rsqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) store_f(out, row * dim + i, xr[i] * inv * w[i]);
}
extern "C" __global__ void rms_norm(const float* x, const float* w, int dim, float eps, float* out) {
    rms_norm_impl(x, w, dim, eps, out);
}
extern "C" __global__ void rms_norm_to_bf16(const float* x, const float* w, int dim, float eps,
                                            __nv_bfloat16* out) {
    rms_norm_impl(x, w, dim, eps, out);
}

// Rotate-half RoPE on the first `rot_heads` heads of each row of a fused QKV activation; one
// thread per rotated pair over the whole step (a decode step is a handful of rows).
extern "C" __global__ void rope(float* qkv, const u32* positions, int rows, int width, int rot_heads,
                                int head_dim, float theta) {
    pdl_start();
    int half = head_dim / 2;
    long pairs = (long)rot_heads * half;
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (t >= rows * pairs) return;
    long row = t / pairs;
    int h = (int)(t % pairs) / half, i = (int)(t % pairs) % half;
    float pos = (float)positions[row];
    float s, c;
    sincosf(pos * rope_inv_freq(theta, i, head_dim), &s, &c);
    float* head = qkv + row * width + (long)h * head_dim;
    float a = head[i], b = head[i + half];
    head[i] = a * c - b * s;
    head[i + half] = b * c + a * s;
}

extern "C" __global__ void silu_mul(const float* gate_up, long rows, int width, float* out) {
    pdl_start();
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (t >= rows * width) return;
    long row = t / width;
    int i = (int)(t % width);
    float x = gate_up[row * 2 * width + i];
    out[t] = x / (1.0f + expf(-x)) * gate_up[row * 2 * width + width + i];
}

// silu(gate) · up over bf16 rows of [gate | up], two features a thread, into bf16 (a prompt
// step's MLP between its two GEMMs; `width` is even).
extern "C" __global__ void silu_mul_bf16(const __nv_bfloat16* gate_up, long rows, int width,
                                         __nv_bfloat16* out) {
    pdl_start();
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x, half = width / 2;
    if (t >= rows * half) return;
    long row = t / half;
    int i = 2 * (int)(t % half);
    const __nv_bfloat16* r = gate_up + row * 2 * width;
    float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(r + i));
    float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(r + width + i));
    float a = g.x / (1.0f + __expf(-g.x)) * u.x, b = g.y / (1.0f + __expf(-g.y)) * u.y;
    *reinterpret_cast<__nv_bfloat162*>(out + row * width + i) = __floats2bfloat162_rn(a, b);
}

extern "C" __global__ void gather_rows(const float* x, int dim, const u32* index, float* out) {
    pdl_start();
    long row = blockIdx.x;
    long src = (long)index[row] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[row * dim + i] = x[src + i];
}

extern "C" __global__ void f32_to_bf16(const float* x, long n, __nv_bfloat16* out) {
    pdl_start();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(x[i]);
}

// ---- K/V cache -----------------------------------------------------------------------------

template <typename T>
__device__ void write_kv_impl(const float* qkv, int rows, int width, int k_off, int v_off, int kv_dim,
                              const u32* slots, T* k, T* v) {
    pdl_start();
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

// RoPE and the K/V write in one pass: a thread per (head, pair (i, i + half)) of a row (the
// grid's x), rows on the grid's y (striding past 65,535). Query and key heads are rotated in
// place (attention reads the queries from there); key heads are also stored rotated into the
// cache at the row's slot, and value heads are only stored. A block's frequencies are
// computed once (the double-precision power is the costly part) into shared memory.
template <typename T>
__device__ void rope_write_kv_impl(float* qkv, const u32* positions, int rows, int num_heads,
                                   int num_kv_heads, int head_dim, float theta, const u32* slots, T* k,
                                   T* v) {
    __shared__ float s_freq[128];
    int half = head_dim / 2, heads = num_heads + 2 * num_kv_heads;
    for (int i = threadIdx.x; i < half; i += blockDim.x) s_freq[i] = rope_inv_freq(theta, i, head_dim);
    __syncthreads();
    pdl_start();
    int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= heads * half) return;
    int h = p / half, i = p % half;
    float freq = s_freq[i];
    for (long row = blockIdx.y; row < rows; row += gridDim.y) {
        float* head = qkv + row * heads * head_dim + (long)h * head_dim;
        float a = head[i], b = head[i + half];
        if (h < num_heads + num_kv_heads) {
            float s, c;
            sincosf((float)positions[row] * freq, &s, &c);
            float ra = a * c - b * s, rb = b * c + a * s;
            head[i] = ra;
            head[i + half] = rb;
            a = ra;
            b = rb;
        }
        if (h >= num_heads) {
            int kv = h - num_heads;  // 0 .. 2 * num_kv_heads: keys, then values
            T* dst = kv < num_kv_heads ? k : v;
            long at = (long)slots[row] * num_kv_heads * head_dim + (long)(kv % num_kv_heads) * head_dim;
            store_f(dst, at + i, a);
            store_f(dst, at + i + half, b);
        }
    }
}
extern "C" __global__ void rope_write_kv_f32(float* qkv, const u32* positions, int rows, int num_heads,
                                             int num_kv_heads, int head_dim, float theta,
                                             const u32* slots, float* k, float* v) {
    rope_write_kv_impl(qkv, positions, rows, num_heads, num_kv_heads, head_dim, theta, slots, k, v);
}
extern "C" __global__ void rope_write_kv_bf16(float* qkv, const u32* positions, int rows, int num_heads,
                                              int num_kv_heads, int head_dim, float theta,
                                              const u32* slots, __nv_bfloat16* k, __nv_bfloat16* v) {
    rope_write_kv_impl(qkv, positions, rows, num_heads, num_kv_heads, head_dim, theta, slots, k, v);
}

// Copies `n` rows of `row_words` 32-bit words between a slot-indexed cache and a dense buffer:
// `to_dense` gathers cache rows `slots[i]` into row i, otherwise scatters row i into them.
extern "C" __global__ void copy_slots(u32* cache, const u32* slots, int n, int row_words, u32* dense,
                                      int to_dense) {
    pdl_start();
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
// One block of four warps per (token, kv head, split): the group of G query heads sharing
// that kv head walks its split of the token's causal context in the paged cache. Eight lanes
// share a key's row (coalesced 16-byte loads, CPL chunks each), so a warp reads 4 keys per
// load and its lane groups hold J keys each: KB keys per block pass, every K and V load of a
// pass issued before any is used. Scores reduce over the 8 lanes; the softmax is online per
// pass (the maximum warp-wide, sums and values per lane group), and the warps merge through
// shared memory at the end. The first pass's keys from earlier steps are loaded before
// `pdl_start`, while the kernel writing this step's keys is still running.
//
// With one split the block writes the output. With several (decode: few tokens, long
// contexts) each block writes its (max, sum, weighted values) per head to `partial`, and the
// last block of a (token, kv head) to finish — counted in `counters`, which it sets back to
// zero — merges them: no second kernel.

#define ATTN_WARPS 4

template <typename T> __device__ __forceinline__ void unpack16(uint4 v, float* f);
template <> __device__ __forceinline__ void unpack16<float>(uint4 v, float* f) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
}
template <> __device__ __forceinline__ void unpack16<__nv_bfloat16>(uint4 v, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
    #pragma unroll
    for (int j = 0; j < 4; ++j) {
        float2 p = __bfloat1622float2(h[j]);
        f[2 * j] = p.x; f[2 * j + 1] = p.y;
    }
}

// A key's place in a paged cache. Block sizes are powers of two in practice, and then a shift
// and a mask replace an integer division by a run-time value (tens of instructions per key:
// measurable in prefill attention, which addresses every key chunk of every tile).
__device__ __forceinline__ int key_block(int key, int block_size) {
    return (block_size & (block_size - 1)) == 0 ? key >> (__ffs(block_size) - 1) : key / block_size;
}
__device__ __forceinline__ int key_in_block(int key, int block_size) {
    return (block_size & (block_size - 1)) == 0 ? key & (block_size - 1) : key % block_size;
}

// Loads the K and V rows of keys `wb + kq + 4 j` that lie in [lo, hi). The block-table
// entries are read first, all together (keys past `hi` read that of `hi - 1`), then the rows.
template <typename T, int D, int J, int CPL>
__device__ __forceinline__ void attn_load(uint4 (&kr)[J][CPL], uint4 (&vr)[J][CPL], const T* kc,
                                          const T* vc, const u32* table, int block_size, long kv_dim,
                                          int wb, int lo, int hi, int kq, int dc) {
    if (lo >= hi) return;
    u32 blk[J];
    #pragma unroll
    for (int j = 0; j < J; ++j) blk[j] = table[key_block(min(wb + kq + 4 * j, hi - 1), block_size)];
    #pragma unroll
    for (int j = 0; j < J; ++j) {
        int key = wb + kq + 4 * j;
        if (key >= lo && key < hi) {
            long slot = (long)blk[j] * block_size + key_in_block(key, block_size);
            const uint4* kp = reinterpret_cast<const uint4*>(kc + slot * kv_dim);
            const uint4* vp = reinterpret_cast<const uint4*>(vc + slot * kv_dim);
            #pragma unroll
            for (int cc = 0; cc < CPL; ++cc) {
                kr[j][cc] = kp[dc + 8 * cc];
                vr[j][cc] = vp[dc + 8 * cc];
            }
        }
    }
}

// `decode_rope` (theta > 0; a decode step: every sequence has one new token, at position
// `cached`): the queries come unrotated and are rotated here, and the block whose split holds
// the new position rotates the token's key and writes it and its value into the cache before
// reading its keys (the step's `rope_write_kv`, folded in).
template <typename T, int G, int D>
__device__ void attention_impl(const float* qkv, int width, int num_heads, int num_kv_heads,
                               T* k_cache, T* v_cache, int block_size,
                               const u32* seq_info, int num_seqs, const u32* tables, int table_stride,
                               float scale, int split_keys, float* partial, u32* counters, float* out,
                               const u32* positions, const u32* slots, float decode_rope) {
    constexpr int V16 = 16 / sizeof(T);           // values per 16-byte chunk
    constexpr int CPL = D / V16 / 8;              // chunks per lane of a row
    constexpr int J = CPL >= 4 ? 1 : 4 / CPL;     // keys per lane group per pass
    constexpr int KW = 4 * J, KB = ATTN_WARPS * KW;
    constexpr int VL = CPL * V16;                 // dims per lane
    __shared__ __align__(16) float s_q[G * D];
    __shared__ float s_m[ATTN_WARPS][G];
    __shared__ float s_l[ATTN_WARPS][G];
    __shared__ __align__(16) float s_acc[ATTN_WARPS][G * D];
    __shared__ int s_last;
    __shared__ float s_cos[D / 2], s_sin[D / 2];       // decode_rope: the token's rotation
    __shared__ __align__(16) T s_knew[D], s_vnew[D];    // decode_rope: the token's key and value

    int token = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, kq = lane >> 3, dc = lane & 7;

    // The token's sequence: the one whose [start, start + len) holds it (in a decode step,
    // sequence `token`).
    int seq = min(token, num_seqs - 1);
    if (!((u32)token >= seq_info[3 * seq] && (u32)token < seq_info[3 * seq] + seq_info[3 * seq + 1])) {
        for (int s = 0; s < num_seqs; ++s) {
            u32 start = seq_info[3 * s], len = seq_info[3 * s + 1];
            if ((u32)token >= start && (u32)token < start + len) { seq = s; break; }
        }
    }
    u32 start = seq_info[3 * seq], cached = seq_info[3 * seq + 2];
    int ctx = (int)(cached + (token - start)) + 1;
    int first = split * split_keys;
    int last = min(ctx, first + split_keys);
    const u32* table = tables + (long)seq * table_stride;
    long kv_dim = (long)num_kv_heads * D;
    const T* kc = k_cache + (long)kvh * D;
    const T* vc = v_cache + (long)kvh * D;

    uint4 kr[J][CPL], vr[J][CPL];
    #pragma unroll
    for (int j = 0; j < J; ++j)
        #pragma unroll
        for (int cc = 0; cc < CPL; ++cc) kr[j][cc] = vr[j][cc] = make_uint4(0u, 0u, 0u, 0u);
    // The first pass's keys of earlier steps: no kernel of this step writes them.
    attn_load<T, D, J, CPL>(kr, vr, kc, vc, table, block_size, kv_dim, first + warp * KW, first,
                            min(last, (int)cached), kq, dc);
    constexpr int H = D / 2;
    bool rope = decode_rope > 0.0f;
    if (rope) {
        // The rotation depends on the position only (metadata, not written by any kernel).
        float pos = (float)positions[token];
        for (int j = threadIdx.x; j < H; j += blockDim.x) {
            float sn, cs;
            sincosf(pos * rope_inv_freq(decode_rope, j, D), &sn, &cs);
            s_sin[j] = sn;
            s_cos[j] = cs;
        }
        __syncthreads();
    }
    pdl_start();

    const float* row = qkv + (long)token * width;
    bool holds_new = rope && first <= (int)cached && (int)cached < last;
    if (rope) {
        for (int i = threadIdx.x; i < G * H; i += blockDim.x) {
            int g = i / H, j = i % H;
            float sn = s_sin[j], cs = s_cos[j];
            const float* q = row + (long)(kvh * G + g) * D;
            float a = q[j], b = q[j + H];
            s_q[g * D + j] = (a * cs - b * sn) * scale;
            s_q[g * D + j + H] = (b * cs + a * sn) * scale;
        }
        if (holds_new) {
            // Into the cache, and into shared memory, where this block's passes take it from.
            const float* k = row + (long)(num_heads + kvh) * D;
            const float* v = row + (long)(num_heads + num_kv_heads + kvh) * D;
            long at = (long)slots[token] * kv_dim + (long)kvh * D;
            for (int j = threadIdx.x; j < H; j += blockDim.x) {
                float sn = s_sin[j], cs = s_cos[j];
                float a = k[j], b = k[j + H];
                float ra = a * cs - b * sn, rb = b * cs + a * sn;
                store_f(k_cache, at + j, ra);
                store_f(k_cache, at + j + H, rb);
                store_f(s_knew, j, ra);
                store_f(s_knew, j + H, rb);
            }
            for (int d = threadIdx.x; d < D; d += blockDim.x) {
                store_f(v_cache, at + d, v[d]);
                store_f(s_vnew, d, v[d]);
            }
        }
    } else {
        for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
            int g = i / D, d = i % D;
            s_q[i] = row[(long)(kvh * G + g) * D + d] * scale;
        }
    }
    __syncthreads();  // the queries, and the new key and value (stored by this block), are in

    float m[G], l[G], acc[G][VL];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY; l[g] = 0.0f;
        #pragma unroll
        for (int v = 0; v < VL; ++v) acc[g][v] = 0.0f;
    }
    for (int base = first; base < last; base += KB) {
        int wb = base + warp * KW;
        if (rope) {
            // Earlier keys from the cache (the first pass's are in already), the new one from
            // shared memory.
            if (base != first)
                attn_load<T, D, J, CPL>(kr, vr, kc, vc, table, block_size, kv_dim, wb, base,
                                        min(last, (int)cached), kq, dc);
            if (holds_new) {
                #pragma unroll
                for (int j = 0; j < J; ++j)
                    if (wb + kq + 4 * j == (int)cached) {
                        #pragma unroll
                        for (int cc = 0; cc < CPL; ++cc) {
                            kr[j][cc] = reinterpret_cast<const uint4*>(s_knew)[dc + 8 * cc];
                            vr[j][cc] = reinterpret_cast<const uint4*>(s_vnew)[dc + 8 * cc];
                        }
                    }
            }
        } else if (base == first) {
            // This step's keys (written by the kernel before).
            attn_load<T, D, J, CPL>(kr, vr, kc, vc, table, block_size, kv_dim, wb, (int)cached, last,
                                    kq, dc);
        } else {
            attn_load<T, D, J, CPL>(kr, vr, kc, vc, table, block_size, kv_dim, wb, base, last, kq, dc);
        }
        float s[J][G];
        #pragma unroll
        for (int j = 0; j < J; ++j) {
            float kf[CPL][V16];
            #pragma unroll
            for (int cc = 0; cc < CPL; ++cc) unpack16<T>(kr[j][cc], kf[cc]);
            bool valid = wb + kq + 4 * j < last;
            #pragma unroll
            for (int g = 0; g < G; ++g) {
                float dot = 0.0f;
                #pragma unroll
                for (int cc = 0; cc < CPL; ++cc) {
                    const float4* q4 = reinterpret_cast<const float4*>(s_q + g * D + (dc + 8 * cc) * V16);
                    #pragma unroll
                    for (int e = 0; e < V16 / 4; ++e) {
                        float4 qv = q4[e];
                        dot += qv.x * kf[cc][4 * e] + qv.y * kf[cc][4 * e + 1] + qv.z * kf[cc][4 * e + 2] +
                               qv.w * kf[cc][4 * e + 3];
                    }
                }
                dot += __shfl_xor_sync(0xffffffffu, dot, 1);
                dot += __shfl_xor_sync(0xffffffffu, dot, 2);
                dot += __shfl_xor_sync(0xffffffffu, dot, 4);
                s[j][g] = valid ? dot : -INFINITY;
            }
        }
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = s[0][g];
            #pragma unroll
            for (int j = 1; j < J; ++j) mx = fmaxf(mx, s[j][g]);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
            float mn = fmaxf(m[g], mx);
            float use = mn == -INFINITY ? 0.0f : mn;  // nothing seen yet
            float corr = __expf(m[g] - use);
            float ps = 0.0f;
            #pragma unroll
            for (int j = 0; j < J; ++j) {
                float p = __expf(s[j][g] - use);
                s[j][g] = p;
                ps += p;
            }
            l[g] = l[g] * corr + ps;
            #pragma unroll
            for (int v = 0; v < VL; ++v) acc[g][v] *= corr;
            m[g] = mn;
        }
        #pragma unroll
        for (int j = 0; j < J; ++j) {
            float vf[CPL][V16];
            #pragma unroll
            for (int cc = 0; cc < CPL; ++cc) unpack16<T>(vr[j][cc], vf[cc]);
            #pragma unroll
            for (int g = 0; g < G; ++g)
                #pragma unroll
                for (int cc = 0; cc < CPL; ++cc)
                    #pragma unroll
                    for (int e = 0; e < V16; ++e) acc[g][cc * V16 + e] += s[j][g] * vf[cc][e];
        }
    }
    // The warp's four lane groups hold sums over their own keys: add them up.
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        l[g] += __shfl_xor_sync(0xffffffffu, l[g], 8);
        l[g] += __shfl_xor_sync(0xffffffffu, l[g], 16);
        #pragma unroll
        for (int v = 0; v < VL; ++v) {
            acc[g][v] += __shfl_xor_sync(0xffffffffu, acc[g][v], 8);
            acc[g][v] += __shfl_xor_sync(0xffffffffu, acc[g][v], 16);
        }
    }
    if (kq == 0) {
        #pragma unroll
        for (int g = 0; g < G; ++g)
            #pragma unroll
            for (int cc = 0; cc < CPL; ++cc)
                #pragma unroll
                for (int e = 0; e < V16; ++e) s_acc[warp][g * D + (dc + 8 * cc) * V16 + e] = acc[g][cc * V16 + e];
    }
    if (lane == 0) {
        #pragma unroll
        for (int g = 0; g < G; ++g) { s_m[warp][g] = m[g]; s_l[warp][g] = l[g]; }
    }
    __syncthreads();
    // Merge the warps: a thread per (head, dim).
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        int g = i / D, d = i % D;
        float mt = -INFINITY;
        #pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) mt = fmaxf(mt, s_m[w][g]);
        float sum = 0.0f, lt = 0.0f;
        #pragma unroll
        for (int w = 0; w < ATTN_WARPS; ++w) {
            float f = s_m[w][g] == -INFINITY ? 0.0f : __expf(s_m[w][g] - mt);
            sum += s_acc[w][i] * f;
            lt += s_l[w][g] * f;
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
    if (splits == 1) return;
    // The last split block of this (token, kv head) to finish merges every split.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        u32* count = counters + (long)token * num_kv_heads + kvh;
        bool last_block = atomicAdd(count, 1u) == (u32)(splits - 1);
        if (last_block) *count = 0;  // every other split block is done with it
        s_last = last_block;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        int g = i / D, d = i % D, head = kvh * G + g;
        const float* p = partial + ((long)token * num_heads + head) * splits * (long)(D + 2);
        // One pass, online (unrolled: the loads of several splits are in flight at once).
        float mt = -INFINITY, sum = 0.0f, lt = 0.0f;
        #pragma unroll 8
        for (int s = 0; s < splits; ++s) {
            const float* q = p + s * (D + 2);
            float ms = __ldcg(q), ls = __ldcg(q + 1), vs = __ldcg(q + 2 + d);
            if (ms > -INFINITY) {  // an empty split adds nothing
                float mn = fmaxf(mt, ms);
                float a = __expf(mt - mn), b = __expf(ms - mn);
                lt = lt * a + ls * b;
                sum = sum * a + vs * b;
                mt = mn;
            }
        }
        out[(long)token * num_heads * D + (long)head * D + d] = sum / lt;
    }
}

// attention_<dtype>_g<G>_d<D>: one kernel per cache dtype, group size and head width.
#define ATTENTION(NAME, T, G, D) \
    extern "C" __global__ void __launch_bounds__(128) NAME( \
            const float* qkv, int width, int num_heads, int num_kv_heads, T* k, T* v, \
            int block_size, const u32* seq_info, int num_seqs, const u32* tables, int table_stride, \
            float scale, int split_keys, float* partial, u32* counters, float* out, \
            const u32* positions, const u32* slots, float decode_rope) { \
        attention_impl<T, G, D>(qkv, width, num_heads, num_kv_heads, k, v, block_size, seq_info, \
                                num_seqs, tables, table_stride, scale, split_keys, partial, counters, \
                                out, positions, slots, decode_rope); \
    }
#define ATTENTION_GROUPS(DT, T, D) \
    ATTENTION(attention_##DT##_g1_d##D, T, 1, D) ATTENTION(attention_##DT##_g2_d##D, T, 2, D) \
    ATTENTION(attention_##DT##_g3_d##D, T, 3, D) ATTENTION(attention_##DT##_g4_d##D, T, 4, D) \
    ATTENTION(attention_##DT##_g5_d##D, T, 5, D) ATTENTION(attention_##DT##_g6_d##D, T, 6, D) \
    ATTENTION(attention_##DT##_g7_d##D, T, 7, D) ATTENTION(attention_##DT##_g8_d##D, T, 8, D)
ATTENTION_GROUPS(f32, float, 64)
ATTENTION_GROUPS(f32, float, 128)
ATTENTION_GROUPS(bf16, __nv_bfloat16, 64)
ATTENTION_GROUPS(bf16, __nv_bfloat16, 128)

// ---- Block-FP8 weights ----------------------------------------------------------------------
//
// A block-FP8 weight matrix [rows, cols] is one buffer: its E4M3 codes row-major, padded to 16
// bytes, then one f32 scale per FP8_TILE × FP8_TILE tile ([rows, cols] / FP8_TILE rounded up,
// row-major); a weight is its code × its tile's scale (the checkpoint's `weight_scale_inv`).

#define FP8_TILE 128

// An E4M3 code's value: its sign and 7 exponent/mantissa bits placed where an f32's go make
// the value × 2^-120 (subnormal codes become f32 subnormals), so one exact multiply.
__device__ __forceinline__ float e4m3_value(u32 b) {
    return __uint_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20)) * 0x1p120f;
}

__device__ __forceinline__ const float* fp8_scales(const unsigned char* w, long rows, int cols) {
    return reinterpret_cast<const float*>(w + ((rows * cols + 15) & ~15L));
}

// An 8-byte weight load that bypasses L1.
__device__ __forceinline__ uint2 ld_weights8(const uint2* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// 8 codes × their tile's scale `s`.
__device__ __forceinline__ void unpack_fp8x8(uint2 v, float s, float* f) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[i] = e4m3_value((v.x >> (8 * i)) & 0xffu) * s;
        f[4 + i] = e4m3_value((v.y >> (8 * i)) & 0xffu) * s;
    }
}

// ---- small-M matmul (decode) ---------------------------------------------------------------
//
// out[r][n] (+)= sum_k x[r][k] * W[n][k] for R <= 8 rows, bf16 W. Each warp owns whole output
// features — P weight rows at a time, which share every activation load — and streams their
// rows with 16-byte loads, U per lane per row in a batch; the loop is unrolled by two so one
// batch is in flight while the other is summed. At most two blocks per SM: warp `gw` takes
// features gw, gw + all warps, ... . The first batch is loaded before `pdl_start` (weights are
// never written during a step), so a GEMV is already streaming while the kernel before it
// finishes. Variants: plain (activations from global memory, an optional residual add),
// RMSNorm first (each block normalises the R rows into shared memory), and RMSNorm + SiLU gate
// (P = 2: gate row j and up row `width + j` of a fused gate/up matrix give silu(g) * u).

#define GEMV_WARPS 8

// A 16-byte weight load that bypasses L1 (weights are read once; L1 keeps the activations).
__device__ __forceinline__ uint4 ld_weights(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Where a warp is in its work: item `it / batches` of its own, batch `it % batches` of it.
struct GemvWalk {
    const uint4* w;  // the weights as 16-byte chunks
    int chunks;      // chunks per weight row (K / 8 bf16, K / 16 block-FP8)
    int items;       // output features (P = 1) or gate/up pairs (P = 2)
    int batches;     // batches per item
    int gw, stride;  // this warp's first item, and the step to its next
    int lane;
    const float* scales;  // block-FP8: the tile scales, `tiles` to a row of tiles
    int tiles;
    __device__ __forceinline__ int item(int it) const { return gw + (it / batches) * stride; }
};

// Loads batch `it` of the walk: chunks base + lane + 32 u of rows item + p * items.
template <int P, int U>
__device__ __forceinline__ void gemv_load(uint4 (&pk)[P][U], const GemvWalk& g, int it) {
    int item = g.item(it), base = (it % g.batches) * 32 * U + g.lane;
    #pragma unroll
    for (int p = 0; p < P; ++p) {
        const uint4* row = g.w + (long)(item + p * g.items) * g.chunks;
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            int c = base + 32 * u;
            pk[p][u] = c < g.chunks ? ld_weights(row + c) : make_uint4(0u, 0u, 0u, 0u);
        }
    }
}

// Adds batch `it` (loaded in `pk`) to the sums; after an item's last batch, reduces the warp's
// sums and writes the item: EPI 0 out[r][n] (+)= s, EPI 1 out[r][j] = silu(s_gate) * s_up.
// acc[p][r] += chunk c of weight row p · chunk c of activation row r.
template <int R, int P, int U>
__device__ __forceinline__ void gemv_fma(const uint4 (&pk)[P][U], int u, int c, const float* x, int K,
                                         float (&acc)[P][R]) {
    float w[P][8];
    #pragma unroll
    for (int p = 0; p < P; ++p) unpack16<__nv_bfloat16>(pk[p][u], w[p]);
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        const float4* xr = reinterpret_cast<const float4*>(x + (long)r * K + c * 8);
        float4 a = xr[0], e = xr[1];
        #pragma unroll
        for (int p = 0; p < P; ++p)
            acc[p][r] += a.x * w[p][0] + a.y * w[p][1] + a.z * w[p][2] + a.w * w[p][3] +
                         e.x * w[p][4] + e.y * w[p][5] + e.z * w[p][6] + e.w * w[p][7];
    }
}

// The same for a chunk of 16 block-FP8 codes of weight row `item` (P = 1).
template <int R, int U>
__device__ __forceinline__ void gemv_fma_fp8(const uint4 (&pk)[1][U], int u, int c, const float* x, int K,
                                             float (&acc)[1][R], const GemvWalk& g, int item) {
    float w[16];
    float s = g.scales[(item / FP8_TILE) * g.tiles + (c * 16) / FP8_TILE];
    unpack_fp8x8(make_uint2(pk[0][u].x, pk[0][u].y), s, w);
    unpack_fp8x8(make_uint2(pk[0][u].z, pk[0][u].w), s, w + 8);
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        const float4* xr = reinterpret_cast<const float4*>(x + (long)r * K + c * 16);
        float4 a = xr[0], e = xr[1], f = xr[2], h = xr[3];
        acc[0][r] += a.x * w[0] + a.y * w[1] + a.z * w[2] + a.w * w[3] + e.x * w[4] + e.y * w[5] +
                     e.z * w[6] + e.w * w[7] + f.x * w[8] + f.y * w[9] + f.z * w[10] + f.w * w[11] +
                     h.x * w[12] + h.y * w[13] + h.z * w[14] + h.w * w[15];
    }
}

// Chunk c of weight row item into the sums: bf16 (F 0) or block-FP8 (F 1).
template <int R, int P, int U, int F>
__device__ __forceinline__ void gemv_chunk(const uint4 (&pk)[P][U], int u, int c, const float* x, int K,
                                           float (&acc)[P][R], const GemvWalk& g, int item) {
    if constexpr (F == 1) {
        static_assert(P == 1, "block-FP8 GEMVs take one weight row at a time");
        gemv_fma_fp8<R, U>(pk, u, c, x, K, acc, g, item);
    } else {
        gemv_fma<R, P, U>(pk, u, c, x, K, acc);
    }
}

template <int R, int P, int U, int EPI, int F>
__device__ __forceinline__ void gemv_step(const uint4 (&pk)[P][U], const GemvWalk& g, int it,
                                          const float* x, int K, float (&acc)[P][R], float* out,
                                          int accumulate) {
    int b = it % g.batches, base = b * 32 * U + g.lane;
    int item = g.item(it);
    if (base + 32 * (U - 1) < g.chunks) {
        // A whole batch: no branch between the chunks, so their activation loads issue
        // together instead of one after another.
        #pragma unroll
        for (int u = 0; u < U; ++u) gemv_chunk<R, P, U, F>(pk, u, base + 32 * u, x, K, acc, g, item);
    } else {
        #pragma unroll
        for (int u = 0; u < U; ++u)
            if (base + 32 * u < g.chunks) gemv_chunk<R, P, U, F>(pk, u, base + 32 * u, x, K, acc, g, item);
    }
    if (b != g.batches - 1) return;
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        float s[P];
        #pragma unroll
        for (int p = 0; p < P; ++p) {
            s[p] = warp_sum(acc[p][r]);
            acc[p][r] = 0.0f;
        }
        if (g.lane == 0) {
            long at = (long)r * g.items + item;
            if constexpr (EPI == 1) {
                out[at] = s[0] / (1.0f + expf(-s[0])) * s[1];
            } else {
                out[at] = accumulate ? out[at] + s[0] : s[0];
            }
        }
    }
}

// The walk of this warp over `items` features of a K-wide matrix.
template <int U>
__device__ __forceinline__ GemvWalk gemv_walk(const void* W, int chunks, int items) {
    GemvWalk g;
    g.w = reinterpret_cast<const uint4*>(W);
    g.chunks = chunks;
    g.items = items;
    g.batches = (g.chunks + 32 * U - 1) / (32 * U);
    int warps = blockDim.x >> 5;
    g.gw = blockIdx.x * warps + (threadIdx.x >> 5);
    g.stride = gridDim.x * warps;
    g.lane = threadIdx.x & 31;
    g.scales = nullptr;
    g.tiles = 0;
    return g;
}

// Batches of the walk's items.
__device__ __forceinline__ int gemv_total(const GemvWalk& g) {
    return g.gw < g.items ? ((g.items - 1 - g.gw) / g.stride + 1) * g.batches : 0;
}

// Streams the walk from batch 0 (already in `a`).
template <int R, int P, int U, int EPI, int F = 0>
__device__ __forceinline__ void gemv_stream(const GemvWalk& g, uint4 (&a)[P][U], int total,
                                            const float* x, int K, float* out, int accumulate) {
    float acc[P][R];
    #pragma unroll
    for (int p = 0; p < P; ++p)
        #pragma unroll
        for (int r = 0; r < R; ++r) acc[p][r] = 0.0f;
    uint4 b[P][U];
    for (int it = 0; it < total; it += 2) {
        if (it + 1 < total) gemv_load<P, U>(b, g, it + 1);
        gemv_step<R, P, U, EPI, F>(a, g, it, x, K, acc, out, accumulate);
        if (it + 2 < total) gemv_load<P, U>(a, g, it + 2);
        if (it + 1 < total) gemv_step<R, P, U, EPI, F>(b, g, it + 1, x, K, acc, out, accumulate);
    }
}

template <int R>
__device__ void gemv_bf16_impl(const float* x, int K, const __nv_bfloat16* W, int N, float* out,
                               int accumulate) {
    constexpr int P = 1, U = 8;
    GemvWalk g = gemv_walk<U>(W, K >> 3, N);
    int total = gemv_total(g);
    uint4 a[P][U];
    if (total > 0) gemv_load<P, U>(a, g, 0);
    pdl_start();
    gemv_stream<R, P, U, 0>(g, a, total, x, K, out, accumulate);
}

// The same over a block-FP8 [N, K] matrix (K a multiple of 16): 16 codes a chunk, each scaled by
// its tile's factor as it is summed, so a step reads one byte a weight.
template <int R>
__device__ void gemv_fp8_impl(const float* x, int K, const unsigned char* W, int N, float* out,
                              int accumulate) {
    constexpr int P = 1, U = 8;
    GemvWalk g = gemv_walk<U>(W, K >> 4, N);
    g.scales = fp8_scales(W, N, K);
    g.tiles = (K + FP8_TILE - 1) / FP8_TILE;
    int total = gemv_total(g);
    uint4 a[P][U];
    if (total > 0) gemv_load<P, U>(a, g, 0);
    pdl_start();
    gemv_stream<R, P, U, 0, 1>(g, a, total, x, K, out, accumulate);
}

// RMSNorm of the R rows of x into dynamic shared memory (R * K floats), then the product.
template <int R, int P, int EPI>
__device__ void gemv_norm_impl(const float* x, const float* norm, float eps, int K,
                               const __nv_bfloat16* W, int items, float* out) {
    constexpr int U = 8 / P;
    extern __shared__ float4 s_x4[];
    float* s_x = reinterpret_cast<float*>(s_x4);
    __shared__ float s_inv[R];
    GemvWalk g = gemv_walk<U>(W, K >> 3, items);
    int total = gemv_total(g);
    uint4 a[P][U];
    if (total > 0) gemv_load<P, U>(a, g, 0);
    pdl_start();
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (int i = threadIdx.x; i < R * K / 4; i += blockDim.x) s_x4[i] = x4[i];
    __syncthreads();
    int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int r = warp; r < R; r += warps) {
        float ss = 0.0f;
        for (int i = g.lane; i < K; i += 32) ss += s_x[r * K + i] * s_x[r * K + i];
        ss = warp_sum(ss);
        if (g.lane == 0) s_inv[r] = rsqrtf(ss / (float)K + eps);
    }
    __syncthreads();
    #pragma unroll
    for (int r = 0; r < R; ++r)
        for (int i = threadIdx.x; i < K; i += blockDim.x) s_x[r * K + i] = s_x[r * K + i] * s_inv[r] * norm[i];
    __syncthreads();
    gemv_stream<R, P, U, EPI>(g, a, total, s_x, K, out, 0);
}

#define GEMV(R) \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 2) gemv_bf16_##R( \
            const float* x, int K, const __nv_bfloat16* W, int N, float* out, int accumulate) { \
        gemv_bf16_impl<R>(x, K, W, N, out, accumulate); \
    } \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 2) gemv_norm_bf16_##R( \
            const float* x, const float* norm, float eps, int K, const __nv_bfloat16* W, int N, \
            float* out) { \
        gemv_norm_impl<R, 1, 0>(x, norm, eps, K, W, N, out); \
    } \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 2) gemv_norm_silu_bf16_##R( \
            const float* x, const float* norm, float eps, int K, const __nv_bfloat16* W, int width, \
            float* out) { \
        gemv_norm_impl<R, 2, 1>(x, norm, eps, K, W, width, out); \
    } \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, 2) gemv_fp8_##R( \
            const float* x, int K, const unsigned char* W, int N, float* out, int accumulate) { \
        gemv_fp8_impl<R>(x, K, W, N, out, accumulate); \
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
    pdl_start();
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
    pdl_start();
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
// warps per (KV head, tile of queries of one sequence): its 64·MT rows are the (query, head)
// pairs of the tile's queries and the G query heads sharing the KV head, query-major (row r is
// query r / G of head r % G), so every K/V tile the block loads serves all G heads. Each warp
// owns MT tiles of 16 rows, kept in registers as bf16 MMA fragments. The block walks the keys
// up to its last query's position in tiles of NK, gathered from the paged cache into shared memory by
// `cp.async` one tile ahead of the one being computed (two stages). Each warp computes its
// scores S = Q·Kᵀ with `mma.sync` m16n8k16 (bf16 in, f32 accumulation) — every K fragment,
// read from shared memory with `ldmatrix`, serves the warp's MT row tiles, which halves the
// shared-memory traffic per product at MT = 2 — masks them causally (only tiles that reach
// past a row's position), runs an online softmax in base 2 in registers (a row's four owning
// lanes exchange maxima by shuffles; sums stay per lane until the end), and adds P·V, reusing
// the score registers as the A operand. V's B fragments come transposed out of shared memory
// with `ldmatrix.trans`. Accumulator layout of m16n8k16 (PTX ISA): lane = 4·g + t holds rows
// g and g + 8, columns 2t and 2t + 1. Rows past the tile's queries compute a copy of its last
// query and are never written.

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

// Four 8×8 bf16 matrices from shared memory (`ldmatrix.x4`, transposed with TRANS): lane l
// addresses row l % 8 of matrix l / 8; register i holds this lane's part of matrix i.
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(const __nv_bfloat16* p, u32& r0, u32& r1, u32& r2, u32& r3) {
    unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                     : "r"(addr));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                     : "r"(addr));
}

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 16 bytes global → shared without a register round trip; `valid` false fills zeros.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
    unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::); }

// Rows per block for head width D (four warps of MT row tiles each); the host side mirrors
// it (`prefill_block_rows`).
template <int D> struct PrefillShape;
template <> struct PrefillShape<64> { static constexpr int MT = 2, NK = 64; };
template <> struct PrefillShape<128> { static constexpr int MT = 1, NK = 32; };

// BS: the cache's block size when built for one (the engine's default 16: its addresses then
// need no run-time shifts), 0 for any block size passed at run time.
template <int D, int BS>
__device__ void prefill_attention_impl(const float* qkv, int width, int num_heads, int num_kv_heads,
                                       const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache,
                                       int block_size, const u32* seq_info, int num_seqs,
                                       const u32* tables, int table_stride, float scale, float* out) {
    if (BS > 0) block_size = BS;
    constexpr int MT = PrefillShape<D>::MT, NK = PrefillShape<D>::NK, BM = 64 * MT;
    constexpr int LD = D + 8;  // padded rows: the 8 rows of an ldmatrix hit different banks
    constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
    __shared__ __align__(16) __nv_bfloat16 s_k[2][NK * LD];
    __shared__ __align__(16) __nv_bfloat16 s_v[2][NK * LD];
    pdl_start();

    // This block's sequence and query tile (every KV head of a sequence's longest tiles first).
    int group = num_heads / num_kv_heads, QT = BM / group;  // queries per tile
    int t = blockIdx.y, seq = -1;
    for (int s = 0; s < num_seqs; ++s) {
        int tiles = (int)((seq_info[3 * s + 1] + QT - 1) / QT);
        if (t < tiles) { seq = s; t = tiles - 1 - t; break; }
        t -= tiles;
    }
    if (seq < 0) return;
    u32 start = seq_info[3 * seq], len = seq_info[3 * seq + 1], cached = seq_info[3 * seq + 2];
    int kvh = blockIdx.x;
    int q0 = t * QT, nq = min(QT, (int)len - q0);
    int keys = (int)cached + q0 + nq;  // the block's last query's context
    const u32* table = tables + (long)seq * table_stride;
    long kv_dim = (long)num_kv_heads * D;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int g = lane >> 2, tq = lane & 3;

    // Tile `it` of keys into stage `st`.
    auto load = [&](int it, int st) {
        int k0 = it * NK;
        for (int c = tid; c < NK * CHUNKS; c += blockDim.x) {
            int key = c / CHUNKS, part = c % CHUNKS, kk = k0 + key;
            bool valid = kk < keys;
            long at = 0;
            if (valid) {
                long slot = (long)table[key_block(kk, block_size)] * block_size + key_in_block(kk, block_size);
                at = slot * kv_dim + (long)kvh * D + part * 8;
            }
            cp_async16(&s_k[st][key * LD + part * 8], k_cache + at, valid);
            cp_async16(&s_v[st][key * LD + part * 8], v_cache + at, valid);
        }
    };
    int tiles_k = (keys + NK - 1) / NK;
    load(0, 0);
    cp_async_commit();

    // Rows of this lane: row tile m holds rows warp·16·MT + 16m + g (a) and + 8 (b).
    int warp_row0 = warp * 16 * MT;
    int warp_first = (int)cached + q0 + min(warp_row0 / group, nq - 1);
    int warp_last = (int)cached + q0 + min((warp_row0 + 16 * MT - 1) / group, nq - 1);
    int pos[MT][2];
    u32 qf[MT][D / 16][4];
    const float qs = scale * 1.4426950408889634f;  // softmax in base 2
    #pragma unroll
    for (int m = 0; m < MT; ++m) {
        int row_a = warp_row0 + 16 * m + g, row_b = row_a + 8;
        int qa_i = min(row_a / group, nq - 1), qb_i = min(row_b / group, nq - 1);
        int ha = kvh * group + row_a % group, hb = kvh * group + row_b % group;
        pos[m][0] = (int)cached + q0 + qa_i;
        pos[m][1] = (int)cached + q0 + qb_i;
        const float* qa = qkv + (long)(start + q0 + qa_i) * width + (long)ha * D;
        const float* qb = qkv + (long)(start + q0 + qb_i) * width + (long)hb * D;
        #pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            int c = ks * 16 + 2 * tq;
            float2 a0 = *reinterpret_cast<const float2*>(qa + c), a1 = *reinterpret_cast<const float2*>(qa + c + 8);
            float2 b0 = *reinterpret_cast<const float2*>(qb + c), b1 = *reinterpret_cast<const float2*>(qb + c + 8);
            qf[m][ks][0] = pack_bf16(a0.x * qs, a0.y * qs);
            qf[m][ks][1] = pack_bf16(b0.x * qs, b0.y * qs);
            qf[m][ks][2] = pack_bf16(a1.x * qs, a1.y * qs);
            qf[m][ks][3] = pack_bf16(b1.x * qs, b1.y * qs);
        }
    }
    float o[MT][D / 8][4];
    float mx[MT][2], l[MT][2];
    #pragma unroll
    for (int m = 0; m < MT; ++m) {
        #pragma unroll
        for (int n = 0; n < D / 8; ++n) o[m][n][0] = o[m][n][1] = o[m][n][2] = o[m][n][3] = 0.0f;
        mx[m][0] = mx[m][1] = -INFINITY;
        l[m][0] = l[m][1] = 0.0f;
    }

    for (int it = 0; it < tiles_k; ++it) {
        if (it + 1 < tiles_k) load(it + 1, (it + 1) & 1);
        cp_async_commit();  // an empty group on the last tile keeps the wait count uniform
        cp_async_wait_one();
        __syncthreads();  // tile `it` is in shared memory for every warp
        int k0 = it * NK, st = it & 1;
        if (k0 <= warp_last) {
            float s[MT][NK / 8][4];
            #pragma unroll
            for (int j = 0; j < NK / 8; ++j) {
                #pragma unroll
                for (int m = 0; m < MT; ++m) s[m][j][0] = s[m][j][1] = s[m][j][2] = s[m][j][3] = 0.0f;
                // ldmatrix.x4: lane 8·i + r addresses key j·8 + r at dims 8·i.. of a 32-dim
                // slice: registers 0/1 are the B fragment of k-step 2p, 2/3 that of 2p + 1.
                const __nv_bfloat16* krow = &s_k[st][(j * 8 + (lane & 7)) * LD + (lane >> 3) * 8];
                #pragma unroll
                for (int p = 0; p < D / 32; ++p) {
                    u32 b0, b1, b2, b3;
                    ldmatrix_x4<false>(krow + p * 32, b0, b1, b2, b3);
                    #pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        mma_bf16(s[m][j], qf[m][2 * p], b0, b1);
                        mma_bf16(s[m][j], qf[m][2 * p + 1], b2, b3);
                    }
                }
            }
            bool masked = k0 + NK - 1 > warp_first;  // some key of the tile is after a row
            #pragma unroll
            for (int m = 0; m < MT; ++m) {
                float tile_max[2] = {-INFINITY, -INFINITY};
                #pragma unroll
                for (int j = 0; j < NK / 8; ++j) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        int key = k0 + j * 8 + 2 * tq + (e & 1);
                        if (masked && key > pos[m][e >> 1]) s[m][j][e] = -INFINITY;
                        tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[m][j][e]);
                    }
                }
                float corr[2], use[2];
                #pragma unroll
                for (int r = 0; r < 2; ++r) {
                    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
                    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
                    float nm = fmaxf(mx[m][r], tile_max[r]);
                    use[r] = nm == -INFINITY ? 0.0f : nm;  // a row that has seen nothing yet
                    corr[r] = exp2_approx(mx[m][r] - use[r]);
                    mx[m][r] = nm;
                }
                float sum[2] = {0.0f, 0.0f};
                #pragma unroll
                for (int j = 0; j < NK / 8; ++j) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        s[m][j][e] = exp2_approx(s[m][j][e] - use[e >> 1]);
                        sum[e >> 1] += s[m][j][e];
                    }
                }
                l[m][0] = l[m][0] * corr[0] + sum[0];
                l[m][1] = l[m][1] * corr[1] + sum[1];
                #pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    o[m][n][0] *= corr[0]; o[m][n][1] *= corr[0];
                    o[m][n][2] *= corr[1]; o[m][n][3] *= corr[1];
                }
            }
            // O += P V, 16 keys at a time: two score tiles make one A fragment; each V
            // fragment serves every row tile.
            #pragma unroll
            for (int kk = 0; kk < NK / 16; ++kk) {
                u32 pa[MT][4];
                #pragma unroll
                for (int m = 0; m < MT; ++m) {
                    pa[m][0] = pack_bf16(s[m][2 * kk][0], s[m][2 * kk][1]);
                    pa[m][1] = pack_bf16(s[m][2 * kk][2], s[m][2 * kk][3]);
                    pa[m][2] = pack_bf16(s[m][2 * kk + 1][0], s[m][2 * kk + 1][1]);
                    pa[m][3] = pack_bf16(s[m][2 * kk + 1][2], s[m][2 * kk + 1][3]);
                }
                // ldmatrix.x4.trans: lanes 0-15 address keys kk·16 + 0..15 at dims n0..n0+7,
                // lanes 16-31 the same keys at n0+8..n0+15; registers 0/1 are the B fragment
                // of columns n0.., 2/3 that of n0+8...
                const __nv_bfloat16* vrow = &s_v[st][(kk * 16 + (lane & 15)) * LD + (lane >> 4) * 8];
                #pragma unroll
                for (int n = 0; n < D / 8; n += 2) {
                    u32 b0, b1, b2, b3;
                    ldmatrix_x4<true>(vrow + n * 8, b0, b1, b2, b3);
                    #pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        mma_bf16(o[m][n], pa[m], b0, b1);
                        mma_bf16(o[m][n + 1], pa[m], b2, b3);
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with stage `st` before it is loaded again
    }
    // Row sums over the row's four lanes, then the output rows.
    long stride = (long)num_heads * D;
    #pragma unroll
    for (int m = 0; m < MT; ++m) {
        #pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[m][r] += __shfl_xor_sync(0xffffffffu, l[m][r], 1);
            l[m][r] += __shfl_xor_sync(0xffffffffu, l[m][r], 2);
        }
        int row_a = warp_row0 + 16 * m + g, row_b = row_a + 8;
        int qa_i = row_a / group, qb_i = row_b / group;  // past nq: not a row of this tile
        float inv_a = 1.0f / l[m][0], inv_b = 1.0f / l[m][1];
        float* oa = out + (long)(start + q0 + qa_i) * stride + (long)(kvh * group + row_a % group) * D;
        float* ob = out + (long)(start + q0 + qb_i) * stride + (long)(kvh * group + row_b % group) * D;
        #pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            int c = n * 8 + 2 * tq;
            if (qa_i < nq) *reinterpret_cast<float2*>(oa + c) = make_float2(o[m][n][0] * inv_a, o[m][n][1] * inv_a);
            if (qb_i < nq) *reinterpret_cast<float2*>(ob + c) = make_float2(o[m][n][2] * inv_b, o[m][n][3] * inv_b);
        }
    }
}

#define PREFILL_ATTENTION(D, BS, SUFFIX) \
    extern "C" __global__ void __launch_bounds__(128) prefill_attention_bf16_d##D##SUFFIX( \
            const float* qkv, int width, int num_heads, int num_kv_heads, const __nv_bfloat16* k, \
            const __nv_bfloat16* v, int block_size, const u32* seq_info, int num_seqs, \
            const u32* tables, int table_stride, float scale, float* out) { \
        prefill_attention_impl<D, BS>(qkv, width, num_heads, num_kv_heads, k, v, block_size, \
                                      seq_info, num_seqs, tables, table_stride, scale, out); \
    }
PREFILL_ATTENTION(64, 0, )
PREFILL_ATTENTION(128, 0, )
PREFILL_ATTENTION(64, 16, _b16)
PREFILL_ATTENTION(128, 16, _b16)

// ---- KDA-hybrid family (HybridOps, hybrid.rs) ----------------------------------------------
//
// The formulas are shared/specs/kda.md's and the CPU backend's (cpu_hybrid.rs), in the same
// order of operations where that is cheap (sums in ascending index, `1 / sqrtf`, `expf`), so
// the two backends differ by f32 rounding only.

__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// torch's softplus (beta 1, linear above 20).
__device__ __forceinline__ float softplus_f(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// One sequence of a step for the per-sequence kernels (short_conv, delta_rule): the address of
// its state (a conv window or a delta-rule state), its first row in the step and its rows.
// `SeqEntry` in hybrid.rs writes these; empty sequences are left out of the table.
struct SeqEntry {
    unsigned long long state;
    unsigned long long first;
    unsigned long long rows;
};

// `rows × width` values from src at `src_at` (rows `src_stride` apart) to dst at `dst_at`.
extern "C" __global__ void copy_block(const float* src, long src_at, int src_stride, float* dst, long dst_at,
                                      int dst_stride, int rows, int width) {
    pdl_start();
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (t >= (long)rows * width) return;
    long r = t / width;
    int i = (int)(t % width);
    dst[dst_at + r * dst_stride + i] = src[src_at + r * src_stride + i];
}

extern "C" __global__ void add_assign(float* y, const float* x, long n) {
    pdl_start();
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (t < n) y[t] += x[t];
}

// out = (accumulate ? out : 0) + a0 + ... over the first `count` (<= 8) sources: a collective's
// sum over ranks whose buffers share the device (device_comm.rs).
extern "C" __global__ void sum_ranks(float* out, long n, int count, int accumulate,
                                     const float* a0, const float* a1, const float* a2,
                                     const float* a3, const float* a4, const float* a5,
                                     const float* a6, const float* a7) {
    pdl_start();
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (t >= n) return;
    const float* src[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    float s = accumulate ? out[t] : 0.0f;
    for (int j = 0; j < count; ++j) s += src[j][t];
    out[t] = s;
}

extern "C" __global__ void sigmoid_in_place(float* x, long n) {
    pdl_start();
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (t < n) x[t] = sigmoid_f(x[t]);
}

// One block per row of `dim`: x = x / sqrt(mean(x²) + eps) (· w when w is not null).
template <typename T>
__device__ void rms_norm_in_place_impl(float* x, int dim, const T* w, float eps) {
    pdl_start();
    __shared__ float shared[32];
    float* xr = x + (long)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, shared);
    float r = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) xr[i] = w ? xr[i] * r * load_f(w, i) : xr[i] * r;
}
extern "C" __global__ void rms_norm_in_place_f32(float* x, int dim, const float* w, float eps) {
    rms_norm_in_place_impl(x, dim, w, eps);
}
extern "C" __global__ void rms_norm_in_place_bf16(float* x, int dim, const __nv_bfloat16* w, float eps) {
    rms_norm_in_place_impl(x, dim, w, eps);
}

// One block per row of `dim`: LayerNorm with weight and bias (two passes over the row).
extern "C" __global__ void layer_norm_in_place(float* x, int dim, const float* w, const float* b, float eps) {
    pdl_start();
    __shared__ float shared[32];
    float* xr = x + (long)blockIdx.x * dim;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) sum += xr[i];
    float mean = block_sum(sum, shared) / (float)dim;
    float var = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) var += (xr[i] - mean) * (xr[i] - mean);
    float rs = 1.0f / sqrtf(block_sum(var, shared) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) xr[i] = (xr[i] - mean) * rs * w[i] + b[i];
}

// One block per row of `dim`: x = x · scale / sqrt(Σx² + 1e-6).
extern "C" __global__ void l2_norm_in_place(float* x, int dim, float scale) {
    pdl_start();
    __shared__ float shared[32];
    float* xr = x + (long)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    float r = scale / sqrtf(block_sum(ss, shared) + 1e-6f);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) xr[i] *= r;
}

// KDA's log-decay in place over `rows` rows of `p` channels: f + dt_bias becomes
// -a_h softplus(f), or with `bounded` lower_bound · sigmoid(a_h f); a_h = a[channel / head_dim].
extern "C" __global__ void kda_decay(float* f, long rows, int p, const float* a, const float* dt_bias,
                                     int head_dim, int bounded, float lower_bound) {
    pdl_start();
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (t >= rows * p) return;
    int c = (int)(t % p);
    float x = f[t] + dt_bias[c], ah = a[c / head_dim];
    f[t] = bounded ? lower_bound * sigmoid_f(ah * x) : -ah * softplus_f(x);
}

// KDA's output norm over head rows of `dim` (one block each): RMSNorm(o; w) · sigmoid(gate).
template <typename T>
__device__ void gated_rms_norm_impl(float* o, const float* gate, const T* w, int dim, float eps) {
    pdl_start();
    __shared__ float shared[32];
    long at = (long)blockIdx.x * dim;
    float* orow = o + at;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += orow[i] * orow[i];
    float r = 1.0f / sqrtf(block_sum(ss, shared) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        orow[i] = orow[i] * r * load_f(w, i) * sigmoid_f(gate[at + i]);
}
extern "C" __global__ void gated_rms_norm_f32(float* o, const float* gate, const float* w, int dim, float eps) {
    gated_rms_norm_impl(o, gate, w, dim, eps);
}
extern "C" __global__ void gated_rms_norm_bf16(float* o, const float* gate, const __nv_bfloat16* w, int dim,
                                               float eps) {
    gated_rms_norm_impl(o, gate, w, dim, eps);
}

// silu(gate) · up over rows of [gate | up] (each `inter` wide); with `clamp`, the gate is
// capped at `limit` and up clamped to [-limit, limit] first.
extern "C" __global__ void swiglu(const float* gate_up, long rows, int inter, int clamp, float limit, float* out) {
    pdl_start();
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (t >= rows * inter) return;
    long row = t / inter;
    int i = (int)(t % inter);
    float g = gate_up[row * 2 * inter + i], u = gate_up[row * 2 * inter + inter + i];
    if (clamp) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    out[t] = g * sigmoid_f(g) * u;
}

// y[rows[i]] += weights[i] · src[i] for one expert's rows (distinct: no two blocks share a row).
extern "C" __global__ void scatter_add_rows(float* y, const float* src, const u32* rows, const float* weights,
                                            int dim) {
    pdl_start();
    long i = blockIdx.x;
    long dst = (long)rows[i] * dim;
    float w = weights[i];
    for (int c = threadIdx.x; c < dim; c += blockDim.x) y[dst + c] += w * src[i * dim + c];
}

// out = the bf16 values of block-FP8 matrix w (rounded to nearest even, as the loader's
// dequantisation to bf16 rounds them), 8 a thread (cols a multiple of 8): what products of more
// rows than the grouped expert kernels take read.
extern "C" __global__ void fp8_to_bf16(const unsigned char* w, long rows, int cols, __nv_bfloat16* out) {
    pdl_start();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    int chunks = cols >> 3, tiles = (cols + FP8_TILE - 1) / FP8_TILE;
    if (i >= rows * chunks) return;
    long r = i / chunks;
    int c = (int)(i - r * chunks);
    float f[8];
    unpack_fp8x8(reinterpret_cast<const uint2*>(w + r * cols)[c],
                 fp8_scales(w, rows, cols)[(r / FP8_TILE) * tiles + (c * 8) / FP8_TILE], f);
    __nv_bfloat162 h[4];
    #pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
    reinterpret_cast<uint4*>(out)[i] = *reinterpret_cast<const uint4*>(h);
}

// ---- MoE on the device ----------------------------------------------------------------------
//
// Routing, then the experts as one grouped product: `moe_sort` lists each local expert's
// (token, slot) pairs, `moe_gate_up` and `moe_down` give each expert's weights one pass per
// MOE_ROWS of its pairs (a block per feature tile and chosen expert: the grid's second side is
// at most the step's pairs, and blocks past the experts `moe_sort` listed exit at once), and `moe_combine` adds each token's weighted expert outputs in slot order (no
// atomics: the sums are the same on every run). Pair p = token * k + slot.

#define MOE_MAX_K 32
#define MOE_MAX_GROUPS 64
#define MOE_ROWS 8

// A block per token (MOE_ROUTE_THREADS threads, experts strided over them; e <=
// MOE_ROUTE_MAX): sigmoid scores s, choice on c = s + bias within the best `topk_groups` groups
// (ranked by the sum of their two best c; the rest choose as -inf), the `k` best choices (ties:
// lower index first: k rounds of a block-wide arg-max), weights s / (Σ s + 1e-20 when
// renormalising) * scale, summed in choice order.
#define MOE_ROUTE_THREADS 256
#define MOE_ROUTE_MAX 1024

// Whether candidate (v, i) beats (bv, bi): any candidate beats none (index < 0); then the
// larger value, then the lower index.
__device__ __forceinline__ bool route_beats(float v, int i, float bv, int bi) {
    return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

extern "C" __global__ void __launch_bounds__(MOE_ROUTE_THREADS) moe_route(const float* logits, int rows, int e,
                                                                          const float* bias, int k, int groups,
                                                                          int topk_groups, int renorm, float scale,
                                                                          u32* ids, float* weights) {
    pdl_start();
    __shared__ float choice[MOE_ROUTE_MAX];
    __shared__ unsigned char taken[MOE_ROUTE_MAX];
    __shared__ float group_score[MOE_MAX_GROUPS];
    __shared__ float warp_v[MOE_ROUTE_THREADS / 32];
    __shared__ int warp_i[MOE_ROUTE_THREADS / 32];
    __shared__ u32 chosen[MOE_MAX_K];
    __shared__ unsigned long long kept_groups;
    int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (t >= rows) return;
    const float* l = logits + (long)t * e;
    int per = e / groups;
    for (int i = tid; i < e; i += blockDim.x) {
        choice[i] = sigmoid_f(l[i]) + bias[i];
        taken[i] = 0;
    }
    __syncthreads();
    if (groups > 1 && topk_groups < groups) {
        for (int g = tid; g < groups; g += blockDim.x) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int i = g * per; i < (g + 1) * per; ++i) {
                float c = choice[i];
                if (c > b1) { b2 = b1; b1 = c; } else if (c > b2) { b2 = c; }
            }
            group_score[g] = per > 1 ? b1 + b2 : b1;
        }
        __syncthreads();
        if (tid == 0) {
            unsigned long long kept = 0ull;
            for (int n = 0; n < topk_groups; ++n) {
                int best = -1;
                for (int g = 0; g < groups; ++g)
                    if (!((kept >> g) & 1ull) && (best < 0 || group_score[g] > group_score[best])) best = g;
                kept |= 1ull << best;
            }
            kept_groups = kept;
        }
        __syncthreads();
        for (int i = tid; i < e; i += blockDim.x)
            if (!((kept_groups >> (i / per)) & 1ull)) choice[i] = -INFINITY;
        __syncthreads();
    }
    for (int j = 0; j < k; ++j) {
        float bv = 0.0f;
        int bi = -1;
        for (int i = tid; i < e; i += blockDim.x)
            if (!taken[i] && route_beats(choice[i], i, bv, bi)) { bv = choice[i]; bi = i; }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (route_beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { warp_v[warp] = bv; warp_i[warp] = bi; }
        __syncthreads();
        if (tid == 0) {
            for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
                if (route_beats(warp_v[w], warp_i[w], bv, bi)) { bv = warp_v[w]; bi = warp_i[w]; }
            chosen[j] = (u32)bi;
            taken[bi] = 1;
        }
        __syncthreads();
    }
    if (tid == 0) {
        float sum = 0.0f;
        for (int j = 0; j < k; ++j) sum += sigmoid_f(l[chosen[j]]);
        float norm = renorm ? sum + 1e-20f : 1.0f;
        for (int j = 0; j < k; ++j) {
            ids[(long)t * k + j] = chosen[j];
            weights[(long)t * k + j] = sigmoid_f(l[chosen[j]]) / norm * scale;
        }
    }
}

// One block, a thread per local expert (`experts` <= blockDim.x <= 1024): expert e's pairs, in
// ascending order, are order[offsets[e] .. offsets[e + 1]]; active[0] is how many experts have
// pairs and active[1 ..] lists them in ascending order (the grouped kernels' blocks take one
// each, so a step that chose 8 of 256 experts launches blocks for 8).
extern "C" __global__ void moe_sort(const u32* ids, int pairs, u32 first, int experts, u32* offsets, u32* order,
                                    u32* active) {
    pdl_start();
    __shared__ u32 counts[1024];
    int e = threadIdx.x;
    u32 n = 0;
    if (e < experts)
        for (int p = 0; p < pairs; ++p) n += ids[p] - first == (u32)e;
    counts[e] = n;
    __syncthreads();
    if (e >= experts) return;
    u32 at = 0, rank = 0;
    for (int i = 0; i < e; ++i) {
        at += counts[i];
        rank += counts[i] > 0;
    }
    offsets[e] = at;
    if (n > 0) active[1 + rank] = (u32)e;
    if (e == experts - 1) {
        offsets[experts] = at + n;
        active[0] = rank + (n > 0);
    }
    for (int p = 0; p < pairs && n > 0; ++p)
        if (ids[p] - first == (u32)e) { order[at++] = p; --n; }
}

// Weights 8c .. 8c + 7 of row `row` of an expert's [rows, cols] matrix at `w`, as floats: bf16,
// or block-FP8 (codes, then tile scales: see "Block-FP8 weights").
template <bool FP8>
__device__ __forceinline__ void expert_weights8(const void* w, long rows, int cols, long row, int c, float* f) {
    if constexpr (FP8) {
        const unsigned char* codes = static_cast<const unsigned char*>(w);
        int tiles = (cols + FP8_TILE - 1) / FP8_TILE;
        float s = fp8_scales(codes, rows, cols)[(row / FP8_TILE) * tiles + (c * 8) / FP8_TILE];
        unpack_fp8x8(ld_weights8(reinterpret_cast<const uint2*>(codes + row * cols) + c), s, f);
    } else {
        unpack16<__nv_bfloat16>(ld_weights(static_cast<const uint4*>(w) + row * (cols >> 3) + c), f);
    }
}

// act[p] = swiglu(gate_j · x[p / k], up_j · x[p / k]) for feature j (a warp each) of the
// blockIdx.y-th active expert's pairs; table[e] holds expert e's [2 * inter, K] gate/up matrix.
template <bool FP8>
__device__ __forceinline__ void moe_gate_up_body(const float* x, int K, const unsigned long long* table,
                                                 const u32* offsets, const u32* order, const u32* active,
                                                 int k, int inter, int clamp, float limit, float* act) {
    pdl_start();
    if (blockIdx.y >= active[0]) return;
    int e = (int)active[1 + blockIdx.y], lane = threadIdx.x & 31;
    int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u32 start = offsets[e], n = offsets[e + 1] - start;
    if (j >= inter || n == 0) return;
    int chunks = K >> 3;
    const void* w = reinterpret_cast<const void*>(table[e]);
    for (u32 g0 = 0; g0 < n; g0 += MOE_ROWS) {
        int m = min((u32)MOE_ROWS, n - g0);
        const float* xr[MOE_ROWS];
        #pragma unroll
        for (int r = 0; r < MOE_ROWS; ++r) xr[r] = x + (long)(order[start + g0 + min(r, m - 1)] / k) * K;
        float ag[MOE_ROWS], au[MOE_ROWS];
        #pragma unroll
        for (int r = 0; r < MOE_ROWS; ++r) ag[r] = au[r] = 0.0f;
        #pragma unroll 2
        for (int c = lane; c < chunks; c += 32) {
            float g[8], u[8];
            expert_weights8<FP8>(w, 2L * inter, K, j, c, g);
            expert_weights8<FP8>(w, 2L * inter, K, (long)inter + j, c, u);
            #pragma unroll
            for (int r = 0; r < MOE_ROWS; ++r) {
                if (r < m) {
                    const float4* xv = reinterpret_cast<const float4*>(xr[r] + c * 8);
                    float4 a = xv[0], b = xv[1];
                    ag[r] += a.x * g[0] + a.y * g[1] + a.z * g[2] + a.w * g[3] + b.x * g[4] + b.y * g[5] + b.z * g[6] + b.w * g[7];
                    au[r] += a.x * u[0] + a.y * u[1] + a.z * u[2] + a.w * u[3] + b.x * u[4] + b.y * u[5] + b.z * u[6] + b.w * u[7];
                }
            }
        }
        #pragma unroll
        for (int r = 0; r < MOE_ROWS; ++r) {
            if (r < m) {
                float sg = warp_sum(ag[r]), su = warp_sum(au[r]);
                if (lane == 0) {
                    if (clamp) {
                        sg = fminf(sg, limit);
                        su = fminf(fmaxf(su, -limit), limit);
                    }
                    act[(long)order[start + g0 + r] * inter + j] = sg * sigmoid_f(sg) * su;
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) moe_gate_up(const float* x, int K, const unsigned long long* table,
                                                              const u32* offsets, const u32* order, const u32* active, int k,
                                                              int inter, int clamp, float limit, float* act) {
    moe_gate_up_body<false>(x, K, table, offsets, order, active, k, inter, clamp, limit, act);
}

extern "C" __global__ void __launch_bounds__(128) moe_gate_up_fp8(const float* x, int K, const unsigned long long* table,
                                                                  const u32* offsets, const u32* order, const u32* active, int k,
                                                                  int inter, int clamp, float limit, float* act) {
    moe_gate_up_body<true>(x, K, table, offsets, order, active, k, inter, clamp, limit, act);
}

// out[p] = weights[p] · (down_h · act[p]) for feature h (a warp each) of the blockIdx.y-th
// active expert's pairs; table[e] holds expert e's [hidden, inter] down matrix.
template <bool FP8>
__device__ __forceinline__ void moe_down_body(const float* act, int inter, const unsigned long long* table,
                                              const u32* offsets, const u32* order, const u32* active,
                                              const float* weights, int hidden, float* out) {
    pdl_start();
    if (blockIdx.y >= active[0]) return;
    int e = (int)active[1 + blockIdx.y], lane = threadIdx.x & 31;
    int h = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    u32 start = offsets[e], n = offsets[e + 1] - start;
    if (h >= hidden || n == 0) return;
    int chunks = inter >> 3;
    const void* w = reinterpret_cast<const void*>(table[e]);
    for (u32 g0 = 0; g0 < n; g0 += MOE_ROWS) {
        int m = min((u32)MOE_ROWS, n - g0);
        const float* ar[MOE_ROWS];
        #pragma unroll
        for (int r = 0; r < MOE_ROWS; ++r) ar[r] = act + (long)order[start + g0 + min(r, m - 1)] * inter;
        float acc[MOE_ROWS];
        #pragma unroll
        for (int r = 0; r < MOE_ROWS; ++r) acc[r] = 0.0f;
        #pragma unroll 2
        for (int c = lane; c < chunks; c += 32) {
            float wv[8];
            expert_weights8<FP8>(w, hidden, inter, h, c, wv);
            #pragma unroll
            for (int r = 0; r < MOE_ROWS; ++r) {
                if (r < m) {
                    const float4* av = reinterpret_cast<const float4*>(ar[r] + c * 8);
                    float4 a = av[0], b = av[1];
                    acc[r] += a.x * wv[0] + a.y * wv[1] + a.z * wv[2] + a.w * wv[3] + b.x * wv[4] + b.y * wv[5] + b.z * wv[6] + b.w * wv[7];
                }
            }
        }
        #pragma unroll
        for (int r = 0; r < MOE_ROWS; ++r) {
            if (r < m) {
                float s = warp_sum(acc[r]);
                u32 p = order[start + g0 + r];
                if (lane == 0) out[(long)p * hidden + h] = weights[p] * s;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) moe_down(const float* act, int inter, const unsigned long long* table,
                                                           const u32* offsets, const u32* order, const u32* active,
                                                           const float* weights, int hidden, float* out) {
    moe_down_body<false>(act, inter, table, offsets, order, active, weights, hidden, out);
}

extern "C" __global__ void __launch_bounds__(128) moe_down_fp8(const float* act, int inter, const unsigned long long* table,
                                                               const u32* offsets, const u32* order, const u32* active,
                                                               const float* weights, int hidden, float* out) {
    moe_down_body<true>(act, inter, table, offsets, order, active, weights, hidden, out);
}

// y[t] += Σ over the slots routed to a local expert (ids in [first, first + experts)) of
// out[t * k + slot], in slot order.
extern "C" __global__ void moe_combine(float* y, const float* out, const u32* ids, long rows, int k, u32 first,
                                       int experts, int hidden) {
    pdl_start();
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (i >= rows * hidden) return;
    long t = i / hidden;
    int h = (int)(i % hidden);
    float s = 0.0f;
    for (int j = 0; j < k; ++j) {
        long p = t * k + j;
        if (ids[p] - first < (u32)experts) s += out[p * hidden + h];
    }
    y[i] += s;
}

// ---- MLA over paged latents -----------------------------------------------------------------
//
// A request's MLA cache is blocks of MLA_BLOCK rows (latents `r` wide, rope slots `dr` wide)
// anywhere in device memory; each launch takes a table of the addresses it needs.

#define MLA_BLOCK 16
// Latent widths up to 32 * MLA_LANE_R, rope widths up to 32 * MLA_LANE_ROPE.
#define MLA_LANE_R 16
#define MLA_LANE_ROPE 2
#define MLA_WARPS 4

// A block per new row j: RMSNorm(ckv[j][0..r]) * norm into dst[4j], the rope slot
// ckv[j][r..r+dr] into dst[4j+1], the indexer's key and gate rows into dst[4j+2] and dst[4j+3]
// (a zero address: nothing to write).
extern "C" __global__ void mla_append(const float* ckv, int r, int dr, const float* norm, float eps,
                                      const float* keys, int kw, const float* gate, int gw,
                                      const unsigned long long* dst) {
    pdl_start();
    __shared__ float shared[32];
    long j = blockIdx.x;
    const unsigned long long* d = dst + 4 * j;
    if (d[0] == 0ull) return;
    const float* row = ckv + j * (r + dr);
    float ss = 0.0f;
    for (int i = threadIdx.x; i < r; i += blockDim.x) ss += row[i] * row[i];
    ss = block_sum(ss, shared);
    float inv = rsqrtf(ss / (float)r + eps);
    float* latent = reinterpret_cast<float*>(d[0]);
    for (int i = threadIdx.x; i < r; i += blockDim.x) latent[i] = row[i] * inv * norm[i];
    if (d[1] != 0ull) {
        float* rope = reinterpret_cast<float*>(d[1]);
        for (int i = threadIdx.x; i < dr; i += blockDim.x) rope[i] = row[r + i];
    }
    if (d[2] != 0ull) {
        float* k = reinterpret_cast<float*>(d[2]);
        for (int i = threadIdx.x; i < kw; i += blockDim.x) k[i] = keys[j * kw + i];
    }
    if (d[3] != 0ull) {
        float* g = reinterpret_cast<float*>(d[3]);
        for (int i = threadIdx.x; i < gw; i += blockDim.x) g[i] = gate[j * gw + i];
    }
}

// Absorbed attention of new row t, heads HG·blockIdx.y onwards (HG of them, fewer at the end),
// over the first `visible` tokens of its sequence: scores (q_lat · latent_s + q_rope · rope_s) *
// scale, softmax, and the attended latent o_lat[t][h] = Σ_s p_s latent_s. meta[2t] is the row's
// first entry in `blocks` (latent and rope block addresses, MLA_BLOCK tokens each), meta[2t+1]
// its visible tokens. Each warp takes every MLA_WARPS-th token with a running softmax per head;
// the warps merge at the end. Every head of a row reads the same latents: a block of HG heads
// reads each latent once for all of them, and its HG dot products' warp sums overlap.
template <int HG>
__device__ __forceinline__ void mla_attention_body(
        const float* q_lat, const float* q, int heads, int dn, int dr, int r, float scale, const u32* meta,
        const unsigned long long* blocks, float* o_lat) {
    pdl_start();
    __shared__ float s_m[MLA_WARPS][HG], s_l[MLA_WARPS][HG];
    __shared__ float s_acc[MLA_WARPS][HG][32 * MLA_LANE_R];
    long t = blockIdx.x;
    int h0 = blockIdx.y * HG, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int hn = min(HG, heads - h0);
    u32 first = meta[2 * t], visible = meta[2 * t + 1];
    float qv[HG][MLA_LANE_R], acc[HG][MLA_LANE_R], qrv[HG][MLA_LANE_ROPE], m[HG], l[HG];
    #pragma unroll
    for (int g = 0; g < HG; ++g) {
        // Past the last head the group repeats it (computed, never written).
        int h = h0 + min(g, hn - 1);
        const float* ql = q_lat + (t * heads + h) * (long)r;
        const float* qr = q + (t * heads + h) * (long)(dn + dr) + dn;
        #pragma unroll
        for (int i = 0; i < MLA_LANE_R; ++i) {
            int c = lane + 32 * i;
            qv[g][i] = c < r ? ql[c] : 0.0f;
            acc[g][i] = 0.0f;
        }
        #pragma unroll
        for (int i = 0; i < MLA_LANE_ROPE; ++i) {
            int c = lane + 32 * i;
            qrv[g][i] = c < dr ? qr[c] : 0.0f;
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (u32 s = warp; s < visible; s += MLA_WARPS) {
        const unsigned long long* b = blocks + 2 * (first + s / MLA_BLOCK);
        int in = s % MLA_BLOCK;
        const float* lat = reinterpret_cast<const float*>(b[0]) + (long)in * r;
        float lv[MLA_LANE_R], rv[MLA_LANE_ROPE];
        #pragma unroll
        for (int i = 0; i < MLA_LANE_R; ++i) {
            int c = lane + 32 * i;
            lv[i] = c < r ? lat[c] : 0.0f;
        }
        const float* rope = dr > 0 ? reinterpret_cast<const float*>(b[1]) + (long)in * dr : nullptr;
        #pragma unroll
        for (int i = 0; i < MLA_LANE_ROPE; ++i) {
            int c = lane + 32 * i;
            rv[i] = c < dr ? rope[c] : 0.0f;
        }
        float dot[HG];
        #pragma unroll
        for (int g = 0; g < HG; ++g) {
            float d = 0.0f;
            #pragma unroll
            for (int i = 0; i < MLA_LANE_R; ++i) d += qv[g][i] * lv[i];
            #pragma unroll
            for (int i = 0; i < MLA_LANE_ROPE; ++i) d += qrv[g][i] * rv[i];
            dot[g] = d;
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            #pragma unroll
            for (int g = 0; g < HG; ++g) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], o);
        }
        #pragma unroll
        for (int g = 0; g < HG; ++g) {
            float score = dot[g] * scale;
            float mn = fmaxf(m[g], score);
            float correction = expf(m[g] - mn), p = expf(score - mn);
            l[g] = l[g] * correction + p;
            #pragma unroll
            for (int i = 0; i < MLA_LANE_R; ++i) acc[g][i] = acc[g][i] * correction + p * lv[i];
            m[g] = mn;
        }
    }
    #pragma unroll
    for (int g = 0; g < HG; ++g) {
        if (lane == 0) {
            s_m[warp][g] = m[g];
            s_l[warp][g] = l[g];
        }
        #pragma unroll
        for (int i = 0; i < MLA_LANE_R; ++i) s_acc[warp][g][lane + 32 * i] = acc[g][i];
    }
    __syncthreads();
    for (int g = 0; g < hn; ++g) {
        float mx = -INFINITY;
        for (int w = 0; w < MLA_WARPS; ++w) mx = fmaxf(mx, s_m[w][g]);
        float total = 0.0f;
        for (int w = 0; w < MLA_WARPS; ++w) total += s_m[w][g] == -INFINITY ? 0.0f : s_l[w][g] * expf(s_m[w][g] - mx);
        float* out = o_lat + (t * heads + h0 + g) * (long)r;
        for (int c = threadIdx.x; c < r; c += blockDim.x) {
            float v = 0.0f;
            for (int w = 0; w < MLA_WARPS; ++w)
                if (s_m[w][g] != -INFINITY) v += s_acc[w][g][c] * expf(s_m[w][g] - mx);
            out[c] = v / total;
        }
    }
}

// mla_attention: a head a block; mla_attention_h4: four.
extern "C" __global__ void __launch_bounds__(MLA_WARPS * 32) mla_attention(
        const float* q_lat, const float* q, int heads, int dn, int dr, int r, float scale, const u32* meta,
        const unsigned long long* blocks, float* o_lat) {
    mla_attention_body<1>(q_lat, q, heads, dn, dr, r, scale, meta, blocks, o_lat);
}
extern "C" __global__ void __launch_bounds__(MLA_WARPS * 32) mla_attention_h4(
        const float* q_lat, const float* q, int heads, int dn, int dr, int r, float scale, const u32* meta,
        const unsigned long long* blocks, float* o_lat) {
    mla_attention_body<4>(q_lat, q, heads, dn, dr, r, scale, meta, blocks, o_lat);
}

// mHC residual streams: `n` copies of each row, their merge and their mean. A stream count
// is at most HC_MAX_STREAMS (a thread keeps one column of every stream in registers).
#define HC_MAX_STREAMS 8

extern "C" __global__ void hc_expand(const float* x, long rows, int n, int hidden, float* out) {
    pdl_start();
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (t >= rows * n * hidden) return;
    out[t] = x[t / ((long)n * hidden) * hidden + t % hidden];
}

// mHC collapse, a block per row: the pre weights sigmoid(l_i s0 + b_i) + eps, the post weights
// 2 sigmoid(l_{n+i} s1 + b_{n+i}) and the combine matrix (a row softmax of l s2 + b, + eps, then
// `iters` Sinkhorn passes: columns, then rows and columns) by thread 0; the input
// x = Σ_i pre_i · stream_i by every thread, in stream order.
extern "C" __global__ void hc_collapse(const float* streams, const float* logits, const float* base,
                                       const float* scale, int n, int iters, float eps, int hidden, float* x,
                                       float* post, float* comb) {
    pdl_start();
    __shared__ float s_pre[HC_MAX_STREAMS];
    long t = blockIdx.x;
    const float* l = logits + t * (2 + n) * n;
    if (threadIdx.x == 0) {
        float c[HC_MAX_STREAMS * HC_MAX_STREAMS];
        for (int i = 0; i < n; ++i) {
            s_pre[i] = sigmoid_f(l[i] * scale[0] + base[i]) + eps;
            post[t * n + i] = 2.0f * sigmoid_f(l[n + i] * scale[1] + base[n + i]);
        }
        for (int m = 0; m < n; ++m) {
            int at = 2 * n + m * n;
            float mx = -INFINITY, sum = 0.0f;
            for (int j = 0; j < n; ++j) {
                c[m * n + j] = l[at + j] * scale[2] + base[at + j];
                mx = fmaxf(mx, c[m * n + j]);
            }
            for (int j = 0; j < n; ++j) {
                c[m * n + j] = expf(c[m * n + j] - mx);
                sum += c[m * n + j];
            }
            for (int j = 0; j < n; ++j) c[m * n + j] = c[m * n + j] / sum + eps;
        }
        for (int it = 0; it < max(iters, 1); ++it) {
            if (it > 0)
                for (int m = 0; m < n; ++m) {
                    float sum = 0.0f;
                    for (int j = 0; j < n; ++j) sum += c[m * n + j];
                    sum += eps;
                    for (int j = 0; j < n; ++j) c[m * n + j] /= sum;
                }
            for (int j = 0; j < n; ++j) {
                float sum = 0.0f;
                for (int m = 0; m < n; ++m) sum += c[m * n + j];
                sum += eps;
                for (int m = 0; m < n; ++m) c[m * n + j] /= sum;
            }
        }
        for (int i = 0; i < n * n; ++i) comb[t * n * n + i] = c[i];
    }
    __syncthreads();
    const float* s = streams + t * n * hidden;
    for (int h = threadIdx.x; h < hidden; h += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < n; ++i) acc += s_pre[i] * s[(long)i * hidden + h];
        x[t * hidden + h] = acc;
    }
}

// New stream j = post_j · y + Σ_m comb[m][j] · old stream m, in place: a thread per (row, column).
extern "C" __global__ void hc_merge(float* streams, const float* y, const float* post, const float* comb,
                                    long rows, int n, int hidden) {
    pdl_start();
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (t >= rows * hidden) return;
    long row = t / hidden;
    int i = (int)(t % hidden);
    float* s = streams + row * n * hidden + i;
    const float* c = comb + row * n * n;
    float old[HC_MAX_STREAMS];
    #pragma unroll
    for (int m = 0; m < HC_MAX_STREAMS; ++m) old[m] = m < n ? s[(long)m * hidden] : 0.0f;
    float yv = y[row * hidden + i];
    #pragma unroll
    for (int j = 0; j < HC_MAX_STREAMS; ++j) {
        if (j >= n) break;
        float v = post[row * n + j] * yv;
        #pragma unroll
        for (int m = 0; m < HC_MAX_STREAMS; ++m)
            if (m < n) v += c[m * n + j] * old[m];
        s[(long)j * hidden] = v;
    }
}

extern "C" __global__ void hc_mean(const float* streams, long rows, int n, int hidden, float* out) {
    pdl_start();
    long t = blockIdx.x * (long)blockDim.x + threadIdx.x;
    if (t >= rows * hidden) return;
    long row = t / hidden;
    int i = (int)(t % hidden);
    const float* s = streams + row * n * hidden + i;
    float sum = 0.0f;
    for (int m = 0; m < n; ++m) sum += s[(long)m * hidden];
    out[t] = sum / (float)n;
}

// Depthwise causal convolution (width w <= CONV_MAX_W) + SiLU of each sequence's rows of `pre`
// `[T, p]`, continuing from its window (`[p, w-1]`, oldest first; `SeqEntry::state`). A thread
// per (channel, sequence, chunk of CONV_CHUNK rows) slides the last w-1 inputs through
// registers; the chunk-0 thread of a channel, the only one that reads its window (w-1 <
// CONV_CHUNK), advances the window after reading it, in place in ascending order (new value j
// comes from old value rows + j > j, or from `pre`).
#define CONV_MAX_W 8
#define CONV_CHUNK 16

template <typename T>
__device__ void short_conv_impl(const float* pre, const SeqEntry* seqs, const T* weight, int p, int w,
                                float* out) {
    pdl_start();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    SeqEntry e = seqs[blockIdx.y];
    long n = (long)e.rows, first = (long)e.first, start = (long)blockIdx.z * CONV_CHUNK;
    if (c >= p || start >= n) return;
    float* window = reinterpret_cast<float*>(e.state) + (long)c * (w - 1);
    int hist = w - 1;
    // ext[i]: the window's values, then the sequence's rows.
    float wt[CONV_MAX_W], h[CONV_MAX_W];
    #pragma unroll
    for (int j = 0; j < CONV_MAX_W; ++j) {
        wt[j] = j < hist ? load_f(weight, (long)c * w + j) : 0.0f;
        long i = start + j;
        h[j] = j >= hist ? 0.0f : i < hist ? window[i] : pre[(first + i - hist) * p + c];
    }
    float w_last = load_f(weight, (long)c * w + hist);
    long end = min(n, start + CONV_CHUNK);
    for (long t = start; t < end; ++t) {
        float x = pre[(first + t) * p + c];
        float acc = 0.0f;
        #pragma unroll
        for (int j = 0; j < CONV_MAX_W; ++j)
            if (j < hist) acc += wt[j] * h[j];
        acc += w_last * x;
        #pragma unroll
        for (int j = 0; j < CONV_MAX_W - 1; ++j)
            if (j + 1 < hist) h[j] = h[j + 1];
        #pragma unroll
        for (int j = 0; j < CONV_MAX_W; ++j)
            if (j == hist - 1) h[j] = x;
        out[(first + t) * p + c] = acc * sigmoid_f(acc);
    }
    if (blockIdx.z == 0) {
        for (int j = 0; j < hist; ++j) {
            long i = n + j;
            window[j] = i < hist ? window[i] : pre[(first + i - hist) * p + c];
        }
    }
}
extern "C" __global__ void short_conv_f32(const float* pre, const SeqEntry* seqs, const float* weight, int p,
                                          int w, float* out) {
    short_conv_impl(pre, seqs, weight, p, w, out);
}
extern "C" __global__ void short_conv_bf16(const float* pre, const SeqEntry* seqs, const __nv_bfloat16* weight,
                                           int p, int w, float* out) {
    short_conv_impl(pre, seqs, weight, p, w, out);
}

// The gated delta rule in its recurrent form, for heads of width D (the K and V widths). Per
// token, with S the head's `[K, V]` state and j a V column:
//   S ← exp(g) ⊙ S (rows scaled),  u_j = β (v_j − Σ_k S_kj k_k),  S ← S + k uᵀ,  o_j = Σ_k q_k S_kj.
// A warp owns CW = 4·VQ columns of one head's state across every row: its lanes form a grid of
// KG = 32 / VQ row groups × VQ column quads, each lane keeping R = D / KG consecutive rows of 4
// columns in registers (float4s) from the first token of its sequence to the last, so the
// state is read and written once per launch with 16-byte accesses. The two sums over K are a
// lane's R terms and then a butterfly over the KG row groups (`__shfl_xor_sync`, which leaves
// the same bits in every lane), so warps never wait for each other. A lane reads its rows of k,
// q and g itself (vector loads), one token ahead of the one it computes. A block is WARPS warps
// side by side in V; the grid is (sequence, head, slice of WARPS·CW columns). VQ trades warps
// per head (parallelism at a few sequences) against a warp's contiguous run per row (VQ × 16
// bytes).
// Both DeltaForms run this (hybrid.rs says why).
template <int D, int VQ>
struct DeltaShape {
    static constexpr int KG = 32 / VQ, R = D / KG, CW = 4 * VQ;
    static constexpr int WARPS = D / CW < 4 ? D / CW : 4;
    static_assert(KG <= D && D % KG == 0 && CW <= D, "head width too narrow for VQ");
};

// `N` consecutive floats from `p` (16-byte aligned when N is a multiple of 4, 8-byte when even).
template <int N>
__device__ __forceinline__ void load_run(const float* __restrict__ p, float* x) {
    if (N % 4 == 0) {
        #pragma unroll
        for (int i = 0; i < N; i += 4) {
            float4 t = __ldg(reinterpret_cast<const float4*>(p + i));
            x[i] = t.x, x[i + 1] = t.y, x[i + 2] = t.z, x[i + 3] = t.w;
        }
    } else if (N % 2 == 0) {
        #pragma unroll
        for (int i = 0; i < N; i += 2) {
            float2 t = __ldg(reinterpret_cast<const float2*>(p + i));
            x[i] = t.x, x[i + 1] = t.y;
        }
    } else {
        #pragma unroll
        for (int i = 0; i < N; ++i) x[i] = __ldg(p + i);
    }
}

// One token's inputs as a lane of the delta rule needs them: its R rows of k, q and g, its
// four columns of v, and β.
template <int R>
struct DeltaToken {
    float k[R], q[R], g[R];
    float4 v;
    float beta;
    __device__ __forceinline__ void load(const float* q_, const float* k_, const float* v_, const float* g_,
                                         const float* beta_, long base, long bh, int row0, int col0) {
        load_run<R>(k_ + base + row0, k);
        load_run<R>(q_ + base + row0, q);
        load_run<R>(g_ + base + row0, g);
        v = __ldg(reinterpret_cast<const float4*>(v_ + base + col0));
        beta = __ldg(beta_ + bh);
    }
};

template <int VQ>
__device__ __forceinline__ float4 sum_row_groups(float4 x) {
    #pragma unroll
    for (int o = VQ; o < 32; o <<= 1) {
        x.x += __shfl_xor_sync(0xffffffffu, x.x, o);
        x.y += __shfl_xor_sync(0xffffffffu, x.y, o);
        x.z += __shfl_xor_sync(0xffffffffu, x.z, o);
        x.w += __shfl_xor_sync(0xffffffffu, x.w, o);
    }
    return x;
}

template <int D, int VQ>
__device__ void delta_rule_impl(const float* __restrict__ q, const float* __restrict__ k,
                                const float* __restrict__ v, const float* __restrict__ g,
                                const float* __restrict__ beta, int heads, const SeqEntry* seqs,
                                float* __restrict__ out) {
    using S = DeltaShape<D, VQ>;
    constexpr int R = S::R;
    pdl_start();
    const SeqEntry e = seqs[blockIdx.x];
    const int h = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kg = lane / VQ, row0 = kg * R;
    const int col0 = (blockIdx.z * S::WARPS + warp) * S::CW + (lane % VQ) * 4;
    float* state = reinterpret_cast<float*>(e.state) + (long)h * D * D + (long)row0 * D + col0;
    float4 s[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) s[r] = *reinterpret_cast<const float4*>(state + (long)r * D);
    const long hd = (long)heads * D, first = (long)e.first, last = first + (long)e.rows;
    DeltaToken<R> cur, next;
    cur.load(q, k, v, g, beta, first * hd + (long)h * D, first * heads + h, row0, col0);
    for (long t = first; t < last; ++t) {
        const long base = t * hd + (long)h * D;
        if (t + 1 < last) next.load(q, k, v, g, beta, base + hd, (t + 1) * heads + h, row0, col0);
        float4 p = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            float d = expf(cur.g[r]), kr = cur.k[r];
            s[r].x *= d, s[r].y *= d, s[r].z *= d, s[r].w *= d;
            p.x += s[r].x * kr, p.y += s[r].y * kr, p.z += s[r].z * kr, p.w += s[r].w * kr;
        }
        p = sum_row_groups<VQ>(p);
        const float b = cur.beta;
        const float4 u = make_float4(b * (cur.v.x - p.x), b * (cur.v.y - p.y), b * (cur.v.z - p.z),
                                     b * (cur.v.w - p.w));
        float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            float kr = cur.k[r], qr = cur.q[r];
            s[r].x += kr * u.x, s[r].y += kr * u.y, s[r].z += kr * u.z, s[r].w += kr * u.w;
            o.x += qr * s[r].x, o.y += qr * s[r].y, o.z += qr * s[r].z, o.w += qr * s[r].w;
        }
        o = sum_row_groups<VQ>(o);
        if (kg == 0) *reinterpret_cast<float4*>(out + base + col0) = o;
        cur = next;
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) *reinterpret_cast<float4*>(state + (long)r * D) = s[r];
}

#define DELTA_RULE(NAME, D, VQ) \
    extern "C" __global__ void __launch_bounds__(DeltaShape<D, VQ>::WARPS * 32) NAME( \
            const float* q, const float* k, const float* v, const float* g, const float* beta, int heads, \
            const SeqEntry* seqs, float* out) { \
        delta_rule_impl<D, VQ>(q, k, v, g, beta, heads, seqs, out); \
    }
DELTA_RULE(delta_rule_d16, 16, 4)
DELTA_RULE(delta_rule_d32, 32, 4)
DELTA_RULE(delta_rule_d64, 64, 4)
DELTA_RULE(delta_rule_d128, 128, 4)
// Twice the warps per head, for steps of a few sequences (hybrid.rs picks).
DELTA_RULE(delta_rule_d128_q2, 128, 2)


// ---- the chunked delta rule (prompts; delta_rule.rs) ------------------------------------------
//
// shared/specs/kda.md's chunked form, as the CPU's `chunk_step` computes it, in two kernels per
// round of chunks. `delta_chunk_prep` works on every (chunk, head) at once: the within-chunk
// cumulative log-decay Γ, the β-scaled strictly lower M and the lower Pm (each entry a sum over
// the head width of decays e^{Γr−Γc} ≤ 1, so nothing overflows however strong the gate), the
// forward substitution (I + M) X = X₀ for W and U, and Q ⊙ e^Γ, K ⊙ e^{Γn−Γ} and e^{Γn}, all
// written to a workspace. `delta_chunk_state` then walks each sequence's chunks in order with a
// slice of its state's value columns in shared memory: V' = U − W S, O = (Q ⊙ e^Γ) S + Pm V',
// S ← diag(e^{Γn}) S + (K ⊙ e^{Γn−Γ})ᵀ V'. Rows past a short last chunk are zeros throughout.

#define DC 64
#define DC_THREADS 256
// Row stride of the transposed tiles in `delta_chunk_state` (odd: a warp's transposing
// stores spread over the banks).
#define DCP (DC + 1)

// One chunk of a sequence: its first row in the step and its rows (1..=DC).
struct ChunkItem {
    long first;
    long rows;
};

// A sequence's chunks in a round: its state, its first item and how many.
struct ChunkRun {
    unsigned long long state;
    long item;
    long chunks;
};

// Floats of the workspace per (item, head), at these offsets (`chunk_work_floats` in
// delta_rule.rs): W, U, Q ⊙ e^Γ, K ⊙ e^{Γn−Γ} [DC][D]; Pm [DC][DC]; e^{Γn} [D].
template <int D>
struct ChunkWork {
    static constexpr long W = 0, U = DC * D, QG = 2L * DC * D, KD = 3L * DC * D, PM = 4L * DC * D;
    static constexpr long GL = PM + DC * DC, SIZE = GL + D;
};

template <int D>
__device__ void delta_chunk_prep_impl(const float* __restrict__ q, const float* __restrict__ k,
                                      const float* __restrict__ v, const float* __restrict__ g,
                                      const float* __restrict__ beta, int heads,
                                      const ChunkItem* items, float* __restrict__ work) {
    using WK = ChunkWork<D>;
    extern __shared__ float sm[];
    float* G = sm;            // [DC][D] Γ
    float* K = G + DC * D;    // [DC][D] k, then U
    float* Q = K + DC * D;    // [DC][D] q, then W
    float* M = Q + DC * D;    // [DC][DC]
    float* B = M + DC * DC;   // [DC] β
    pdl_start();
    const ChunkItem it = items[blockIdx.x];
    const int h = blockIdx.y, n = (int)it.rows, t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const long hd = (long)heads * D, at0 = it.first * hd + (long)h * D;
    float* wk = work + ((long)blockIdx.x * heads + h) * WK::SIZE;
    // Rows as float4s, all of a thread's loads issued before any is stored.
    constexpr int NL = DC * D / 4 / DC_THREADS;
    float4 lg[NL], lk[NL], lq[NL];
    #pragma unroll
    for (int j = 0; j < NL; ++j) {
        const int f = t + j * DC_THREADS, r = f / (D / 4), c = (f % (D / 4)) * 4;
        const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const long at = at0 + (long)r * hd + c;
        lg[j] = r < n ? __ldg(reinterpret_cast<const float4*>(g + at)) : z;
        lk[j] = r < n ? __ldg(reinterpret_cast<const float4*>(k + at)) : z;
        lq[j] = r < n ? __ldg(reinterpret_cast<const float4*>(q + at)) : z;
    }
    #pragma unroll
    for (int j = 0; j < NL; ++j) {
        const int f = t + j * DC_THREADS;
        reinterpret_cast<float4*>(G)[f] = lg[j];
        reinterpret_cast<float4*>(K)[f] = lk[j];
        reinterpret_cast<float4*>(Q)[f] = lq[j];
    }
    if (t < DC) B[t] = t < n ? beta[(it.first + t) * heads + h] : 0.0f;
    __syncthreads();
    if (t < D) {
        float acc = 0.0f;
        for (int r = 0; r < n; ++r) {
            acc += G[r * D + t];
            G[r * D + t] = acc;
        }
    }
    __syncthreads();
    // M and Pm, a warp per row: k_c e^{Γr−Γc} dotted with k_r (M, times β_r) and q_r (Pm).
    for (int r = warp; r < DC; r += DC_THREADS / 32) {
        for (int c = 0; c < DC; ++c) {
            float pm = 0.0f, m = 0.0f;
            if (c <= r && r < n) {
                for (int d = lane; d < D; d += 32) {
                    const float kd = K[c * D + d] * __expf(G[r * D + d] - G[c * D + d]);
                    pm += Q[r * D + d] * kd;
                    m += K[r * D + d] * kd;
                }
                pm = warp_sum(pm);
                m = warp_sum(m);
            }
            if (lane == 0) {
                wk[WK::PM + r * DC + c] = pm;
                M[r * DC + c] = c < r ? B[r] * m : 0.0f;
            }
        }
    }
    __syncthreads();
    // Q ⊙ e^Γ and K ⊙ e^{Γn−Γ} out; then W₀ = β e^Γ ⊙ k over q, U₀ = β v over k.
    const float* gl = G + (n - 1) * D;
    for (int i = t; i < DC * D; i += DC_THREADS) {
        const int r = i / D, c = i % D;
        const bool in = r < n;
        const float e = __expf(G[i]);
        wk[WK::QG + i] = Q[i] * e;
        wk[WK::KD + i] = in ? K[i] * __expf(gl[c] - G[i]) : 0.0f;
        Q[i] = B[r] * e * K[i];
        K[i] = in ? B[r] * v[at0 + (long)r * hd + c] : 0.0f;
    }
    if (t < D) wk[WK::GL + t] = __expf(gl[t]);
    __syncthreads();
    // (I + M) X = X₀ by forward substitution, a column of W (t < D) or of U (D ≤ t < 2D) each,
    // held in registers (rows past n stay zero: their X₀ and M rows are).
    if (t < 2 * D) {
        float* col = (t < D ? Q : K) + (t % D);
        float x[DC];
        #pragma unroll
        for (int r = 0; r < DC; ++r) x[r] = col[r * D];
        #pragma unroll
        for (int r = 1; r < DC; ++r) {
            float a0 = 0.0f, a1 = 0.0f;
            #pragma unroll
            for (int c = 0; c < r; ++c) {
                if (c & 1) a1 += M[r * DC + c] * x[c];
                else a0 += M[r * DC + c] * x[c];
            }
            x[r] -= a0 + a1;
        }
        #pragma unroll
        for (int r = 0; r < DC; ++r) col[r * D] = x[r];
    }
    __syncthreads();
    for (int i = t; i < DC * D; i += DC_THREADS) {
        wk[WK::W + i] = Q[i];
        wk[WK::U + i] = K[i];
    }
}

// A `delta_chunk_state` block's share: CW value columns of the state, as NCG float4 groups;
// threads tile a chunk's rows RPT at a time and the state's rows KPT at a time.
template <int D>
struct ChunkCols {
    static constexpr int CW = D < 32 ? D : 32, NCG = CW / 4, RG = DC_THREADS / NCG;
    static constexpr int RPT = DC / RG > 0 ? DC / RG : 1, KPT = D / RG > 0 ? D / RG : 1;
    static constexpr int SHARED = D * CW + DC * CW + 2 * D * DCP + DC * DCP;  // floats
};

// A [DC][D] tile of the workspace as a thread's float4s (all loads issued at once), and its
// stores into shared memory, transposed ([D][DCP]) or as it is.
template <int D>
struct ChunkTile {
    static constexpr int N = DC * D / 4 / DC_THREADS;
    float4 x[N];
    __device__ __forceinline__ void load(const float* src) {
        #pragma unroll
        for (int j = 0; j < N; ++j) x[j] = __ldg(reinterpret_cast<const float4*>(src) + threadIdx.x + j * DC_THREADS);
    }
    __device__ __forceinline__ void store_transposed(float* dst) const {
        #pragma unroll
        for (int j = 0; j < N; ++j) {
            const int f = threadIdx.x + j * DC_THREADS, r = f / (D / 4), c = (f % (D / 4)) * 4;
            dst[(c + 0) * DCP + r] = x[j].x;
            dst[(c + 1) * DCP + r] = x[j].y;
            dst[(c + 2) * DCP + r] = x[j].z;
            dst[(c + 3) * DCP + r] = x[j].w;
        }
    }
    __device__ __forceinline__ void store(float* dst) const {
        #pragma unroll
        for (int j = 0; j < N; ++j) reinterpret_cast<float4*>(dst)[threadIdx.x + j * DC_THREADS] = x[j];
    }
};

// `acc[j] += Σ_kk T[kk][r0 + j] · S[kk][c4..c4+4]` over the D rows of a transposed tile.
template <int D, int CW, int RPT>
__device__ __forceinline__ void chunk_rows_times_state(const float* T, const float* S, int r0, int c4, float4* acc) {
    #pragma unroll 8
    for (int kk = 0; kk < D; ++kk) {
        const float4 s = *reinterpret_cast<const float4*>(S + kk * CW + c4);
        #pragma unroll
        for (int j = 0; j < RPT; ++j) {
            const float w = T[kk * DCP + r0 + j];
            acc[j].x += w * s.x, acc[j].y += w * s.y, acc[j].z += w * s.z, acc[j].w += w * s.w;
        }
    }
}

template <int D>
__device__ void delta_chunk_state_impl(const ChunkItem* items, const ChunkRun* runs, int heads,
                                       const float* __restrict__ work, float* __restrict__ out) {
    using WK = ChunkWork<D>;
    using X = ChunkCols<D>;
    constexpr int CW = X::CW, NCG = X::NCG, RPT = X::RPT, KPT = X::KPT;
    extern __shared__ float sm[];
    float* S = sm;               // [D][CW] the state's columns
    float* VP = S + D * CW;      // [DC][CW] V'
    float* A = VP + DC * CW;     // [D][DCP] Wᵀ; then [DC][D] K ⊙ e^{Γn−Γ}
    float* B = A + D * DCP;      // [D][DCP] (Q ⊙ e^Γ)ᵀ; then the next chunk's Wᵀ
    float* P = B + D * DCP;      // [DC][DCP] Pmᵀ
    pdl_start();
    const ChunkRun run = runs[blockIdx.x];
    const int h = blockIdx.y, t = threadIdx.x, col0 = blockIdx.z * CW;
    const int c4 = (t % NCG) * 4, rg = t / NCG, r0 = rg * RPT, k0 = rg * KPT;
    const bool rows_on = r0 < DC, state_on = k0 < D;
    float* state = reinterpret_cast<float*>(run.state) + (long)h * D * D + col0;
    for (int i = t; i < D * NCG; i += DC_THREADS) {
        const int kk = i / NCG, q4 = (i % NCG) * 4;
        *reinterpret_cast<float4*>(S + kk * CW + q4) = *reinterpret_cast<const float4*>(state + (long)kk * D + q4);
    }
    const long hd = (long)heads * D;
    ChunkTile<D> tile;
    ChunkTile<DC> pm;
    // The first chunk's W and Pm; each later chunk's are loaded during the one before.
    {
        const float* wk = work + (run.item * heads + h) * WK::SIZE;
        tile.load(wk + WK::W);
        pm.load(wk + WK::PM);
        tile.store_transposed(A);
        pm.store_transposed(P);
    }
    for (long ci = 0; ci < run.chunks; ++ci) {
        const long item = run.item + ci;
        const ChunkItem it = items[item];
        const int n = (int)it.rows;
        const float* wk = work + (item * heads + h) * WK::SIZE;
        __syncthreads();
        tile.load(wk + WK::QG);
        // V' = U − W S.
        float4 acc[RPT];
        if (rows_on) {
            #pragma unroll
            for (int j = 0; j < RPT; ++j) acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            chunk_rows_times_state<D, CW, RPT>(A, S, r0, c4, acc);
            #pragma unroll
            for (int j = 0; j < RPT; ++j) {
                const int r = r0 + j;
                const float4 u = __ldg(reinterpret_cast<const float4*>(wk + WK::U + r * D + col0 + c4));
                *reinterpret_cast<float4*>(VP + r * CW + c4) =
                    make_float4(u.x - acc[j].x, u.y - acc[j].y, u.z - acc[j].z, u.w - acc[j].w);
            }
        }
        tile.store_transposed(B);
        __syncthreads();
        tile.load(wk + WK::KD);
        // O = (Q ⊙ e^Γ) S + Pm V'.
        if (rows_on) {
            #pragma unroll
            for (int j = 0; j < RPT; ++j) acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            chunk_rows_times_state<D, CW, RPT>(B, S, r0, c4, acc);
            for (int c = 0; c < n; ++c) {
                const float4 x = *reinterpret_cast<const float4*>(VP + c * CW + c4);
                #pragma unroll
                for (int j = 0; j < RPT; ++j) {
                    const float w = P[c * DCP + r0 + j];
                    acc[j].x += w * x.x, acc[j].y += w * x.y, acc[j].z += w * x.z, acc[j].w += w * x.w;
                }
            }
            #pragma unroll
            for (int j = 0; j < RPT; ++j) {
                const int r = r0 + j;
                if (r < n)
                    *reinterpret_cast<float4*>(out + (it.first + r) * hd + (long)h * D + col0 + c4) = acc[j];
            }
        }
        tile.store(A);
        __syncthreads();
        const bool more = ci + 1 < run.chunks;
        if (more) {
            const float* next = wk + (long)heads * WK::SIZE;
            tile.load(next + WK::W);
            pm.load(next + WK::PM);
        }
        // S ← diag(e^{Γn}) S + (K ⊙ e^{Γn−Γ})ᵀ V'.
        if (state_on) {
            float4 s[KPT];
            #pragma unroll
            for (int j = 0; j < KPT; ++j) {
                const float e = wk[WK::GL + k0 + j];
                s[j] = *reinterpret_cast<const float4*>(S + (k0 + j) * CW + c4);
                s[j].x *= e, s[j].y *= e, s[j].z *= e, s[j].w *= e;
            }
            for (int r = 0; r < n; ++r) {
                const float4 x = *reinterpret_cast<const float4*>(VP + r * CW + c4);
                #pragma unroll
                for (int j = 0; j < KPT; ++j) {
                    const float w = A[r * D + k0 + j];
                    s[j].x += w * x.x, s[j].y += w * x.y, s[j].z += w * x.z, s[j].w += w * x.w;
                }
            }
            #pragma unroll
            for (int j = 0; j < KPT; ++j) *reinterpret_cast<float4*>(S + (k0 + j) * CW + c4) = s[j];
        }
        if (more) {
            // B and P were last read before the sync above; A is read until the next sync.
            tile.store_transposed(B);
            pm.store_transposed(P);
            float* w = A;
            A = B;
            B = w;
        }
    }
    __syncthreads();
    for (int i = t; i < D * NCG; i += DC_THREADS) {
        const int kk = i / NCG, q4 = (i % NCG) * 4;
        *reinterpret_cast<float4*>(state + (long)kk * D + q4) = *reinterpret_cast<const float4*>(S + kk * CW + q4);
    }
}

#define DELTA_CHUNK(D) \
    extern "C" __global__ void __launch_bounds__(DC_THREADS) delta_chunk_prep_d##D( \
            const float* q, const float* k, const float* v, const float* g, const float* beta, int heads, \
            const ChunkItem* items, float* work) { \
        delta_chunk_prep_impl<D>(q, k, v, g, beta, heads, items, work); \
    } \
    extern "C" __global__ void __launch_bounds__(DC_THREADS) delta_chunk_state_d##D( \
            const ChunkItem* items, const ChunkRun* runs, int heads, const float* work, float* out) { \
        delta_chunk_state_impl<D>(items, runs, heads, work, out); \
    }
DELTA_CHUNK(16)
DELTA_CHUNK(32)
DELTA_CHUNK(64)
DELTA_CHUNK(128)
