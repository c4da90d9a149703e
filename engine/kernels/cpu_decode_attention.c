/* Paged decode attention on the CPU: one query token per sequence, read straight from the
 * paged KV cache through the block table.
 *
 * The torch path gathers every sequence's K and V into a padded copy per layer and then
 * runs SDPA over it: three passes over the context. Here each sequence reads its K once
 * (scores), then its V once (weighted sum), block by block, with no copy and no padding.
 * Work is split by sequence: a token's K (and V) rows of all kv heads are one contiguous
 * run, so each block streams through once and each row serves its GQA group.
 *
 * Reading the context is what costs (measured: the same work took 27 ms over sequential
 * blocks and 61 ms over scattered ones), so the next block is prefetched while this one is
 * used, and head sizes 64 and 128 get instances where the inner loops have a constant length.
 *
 * Layouts (contiguous): q, out [num_tokens, num_heads, head_dim]; k_cache, v_cache
 * [num_blocks, block_size, num_kv_heads, head_dim]; block_table [num_reqs, stride_bt] int32;
 * query_start_loc [num_reqs + 1], seq_lens [num_reqs] int32. Requests req_indices[0..n) are
 * processed, each writing row query_start_loc[req] of out; the other rows are not touched.
 * Accumulation is fp32 whatever the storage type; an empty context gives zeros.
 *
 * The cache is in q's type, or in fp8 e4m3 (one byte per value) with per-layer scales: the
 * keys' scale is folded into `scale` by the caller (q.k_stored * scale * k_scale) and the
 * values' scale `v_scale` into the final normalization; it is 1 for the other caches.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float load_f32(const float *p) { return *p; }

static inline float load_bf16(const uint16_t *p) {
    uint32_t bits = (uint32_t)(*p) << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static inline uint16_t store_bf16(float x) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu))
        return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* fp8 e4m3 ("fn": no infinities) -> fp32, exact. Its exponent and mantissa bits, moved into
 * fp32's fields, make 2^-120 times the value (an fp32 subnormal for an e4m3 subnormal), and
 * one multiply rescales it. This needs subnormals not flushed to zero: the library never sets
 * that mode (see cpu_decode_attention.py); torch.set_flush_denormal(True) would read e4m3
 * subnormals as 0. Measured on 48 sequences of 4096 tokens (SmolLM2 heads, one thread): 8%
 * faster than a bf16 cache, where a decode avoiding fp32 subnormals (two cases and a select)
 * was 15% slower. The NaN codes 0x7f/0xff would read as +-480; writes saturate at 448. */
static inline float load_fp8_e4m3(const uint8_t *p) {
    const uint32_t x = *p;
    const uint32_t bits = ((x & 0x80u) << 24) | ((x & 0x7fu) << 20);
    float scaled;
    memcpy(&scaled, &bits, sizeof scaled);
    return scaled * 0x1p120f;
}

/* Blocks sit anywhere in the pool, and the hardware prefetcher, which follows sequential
 * runs, stalls at each block boundary. */
static inline void prefetch_block(const void *block, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)block + i, 0, 3);
}

/* T: q and out (LOAD, STORE); KV_T: the cache (LOAD_KV). */
#define DEFINE_DECODE(NAME, T, LOAD, STORE, KV_T, LOAD_KV, HEAD_DIM)                               \
static void NAME(T *out, const T *q, const KV_T *k_cache, const KV_T *v_cache,                     \
                 const int32_t *block_table, const int32_t *query_start_loc,                       \
                 const int32_t *seq_lens, const int32_t *req_indices, int num_decodes,             \
                 int num_heads, int num_kv_heads, int head_dim, int block_size,                    \
                 int64_t stride_bt, int max_seq_len, float scale, float v_scale,                   \
                 int num_threads) {                                                                \
    const int hd = HEAD_DIM ? HEAD_DIM : head_dim;                                                 \
    const int group = num_heads / num_kv_heads;                                                    \
    const int64_t stride_slot = (int64_t)num_kv_heads * hd;                                        \
    const int64_t block_bytes = block_size * stride_slot * (int64_t)sizeof(KV_T);                  \
    _Pragma("omp parallel num_threads(num_threads)")                                               \
    {                                                                                              \
        /* Per thread: scores [num_heads][max_seq_len] (+1: never a zero-size malloc), q and  */   \
        /* acc [num_heads][head_dim], each head's softmax sum. */                                  \
        float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)(max_seq_len + 1));     \
        float *qf = malloc(sizeof(float) * (size_t)num_heads * (size_t)hd);                        \
        float *acc = malloc(sizeof(float) * (size_t)num_heads * (size_t)hd);                       \
        float *sums = malloc(sizeof(float) * (size_t)num_heads);                                   \
        _Pragma("omp for schedule(dynamic, 1)")                                                    \
        for (int i = 0; i < num_decodes; i++) {                                                    \
            const int req = req_indices[i];                                                        \
            const int seq_len = seq_lens[req];                                                     \
            const int32_t *blocks = block_table + req * stride_bt;                                 \
            const int64_t row = query_start_loc[req];                                              \
            for (int j = 0; j < num_heads * hd; j++) {                                             \
                qf[j] = LOAD(q + row * num_heads * hd + j) * scale;                                \
                acc[j] = 0.0f;                                                                     \
            }                                                                                      \
            /* Pass 1: scores = q . k. A token's K rows of all kv heads are one contiguous  */     \
            /* run, so the block is read as a stream and each row serves its GQA group. */         \
            for (int t = 0; t < seq_len; t++) {                                                    \
                if (t % block_size == 0) { /* the next block of K, or the first of V */            \
                    const int next = t / block_size + 1;                                           \
                    prefetch_block(next * block_size < seq_len                                     \
                                   ? k_cache + (int64_t)blocks[next] * block_size * stride_slot    \
                                   : v_cache + (int64_t)blocks[0] * block_size * stride_slot,      \
                                   block_bytes);                                                   \
                }                                                                                  \
                const KV_T *k = k_cache + ((int64_t)blocks[t / block_size] * block_size            \
                                        + t % block_size) * stride_slot;                           \
                for (int h = 0; h < num_heads; h++) {                                              \
                    const KV_T *kh = k + (h / group) * hd;                                         \
                    const float *qh = qf + h * hd;                                                 \
                    float dot = 0.0f;                                                              \
                    _Pragma("omp simd reduction(+:dot)")                                           \
                    for (int d = 0; d < hd; d++) dot += qh[d] * LOAD_KV(kh + d);                   \
                    scores[(int64_t)h * max_seq_len + t] = dot;                                    \
                }                                                                                  \
            }                                                                                      \
            /* Softmax weights, unnormalized; each head's sum divides once at the end. */          \
            for (int h = 0; h < num_heads; h++) {                                                  \
                float *sh = scores + (int64_t)h * max_seq_len;                                     \
                float row_max = -FLT_MAX, sum = 0.0f; /* finite: built with -ffast-math */         \
                for (int t = 0; t < seq_len; t++) row_max = sh[t] > row_max ? sh[t] : row_max;     \
                _Pragma("omp simd reduction(+:sum)") /* vector expf from libmvec */                \
                for (int t = 0; t < seq_len; t++) {                                                \
                    sh[t] = expf(sh[t] - row_max);                                                 \
                    sum += sh[t];                                                                  \
                }                                                                                  \
                sums[h] = sum;                                                                     \
            }                                                                                      \
            /* Pass 2: out = sum_t p_t v_t, V streamed the same way as K. */                       \
            for (int t = 0; t < seq_len; t++) {                                                    \
                const int next = t / block_size + 1;                                               \
                if (t % block_size == 0 && next * block_size < seq_len)                            \
                    prefetch_block(v_cache + (int64_t)blocks[next] * block_size * stride_slot,     \
                                   block_bytes);                                                   \
                const KV_T *v = v_cache + ((int64_t)blocks[t / block_size] * block_size            \
                                        + t % block_size) * stride_slot;                           \
                for (int h = 0; h < num_heads; h++) {                                              \
                    const KV_T *vh = v + (h / group) * hd;                                         \
                    float *ah = acc + h * hd;                                                      \
                    const float p = scores[(int64_t)h * max_seq_len + t];                          \
                    _Pragma("omp simd")                                                            \
                    for (int d = 0; d < hd; d++) ah[d] += p * LOAD_KV(vh + d);                     \
                }                                                                                  \
            }                                                                                      \
            T *out_row = out + row * num_heads * hd;                                               \
            for (int h = 0; h < num_heads; h++) {                                                  \
                const float inv = seq_len > 0 ? v_scale / sums[h] : 0.0f;                          \
                for (int d = 0; d < hd; d++)                                                       \
                    out_row[h * hd + d] = STORE(acc[h * hd + d] * inv);                            \
            }                                                                                      \
        }                                                                                          \
        free(scores);                                                                              \
        free(qf);                                                                                  \
        free(acc);                                                                                 \
        free(sums);                                                                                \
    }                                                                                              \
}

#define STORE_F32(x) (x)

/* Instances for the common head sizes, where the compiler sees a constant vector length
 * (fully unrolled inner loops, no remainder), and one for any other size; the exported
 * entry points pick one by head_dim. */
#define DEFINE_DISPATCH(NAME, T, LOAD, STORE, KV_T, LOAD_KV)                                       \
DEFINE_DECODE(NAME##_64, T, LOAD, STORE, KV_T, LOAD_KV, 64)                                        \
DEFINE_DECODE(NAME##_128, T, LOAD, STORE, KV_T, LOAD_KV, 128)                                      \
DEFINE_DECODE(NAME##_any, T, LOAD, STORE, KV_T, LOAD_KV, 0)                                        \
void NAME(T *out, const T *q, const KV_T *k_cache, const KV_T *v_cache,                            \
          const int32_t *block_table, const int32_t *query_start_loc, const int32_t *seq_lens,     \
          const int32_t *req_indices, int num_decodes, int num_heads, int num_kv_heads,            \
          int head_dim, int block_size, int64_t stride_bt, int max_seq_len, float scale,           \
          float v_scale, int num_threads) {                                                        \
    void (*fn)(T *, const T *, const KV_T *, const KV_T *, const int32_t *, const int32_t *,       \
               const int32_t *, const int32_t *, int, int, int, int, int, int64_t, int, float,     \
               float, int) = head_dim == 64 ? NAME##_64                                            \
                             : head_dim == 128 ? NAME##_128 : NAME##_any;                          \
    fn(out, q, k_cache, v_cache, block_table, query_start_loc, seq_lens, req_indices,              \
       num_decodes, num_heads, num_kv_heads, head_dim, block_size, stride_bt, max_seq_len,         \
       scale, v_scale, num_threads);                                                               \
}

DEFINE_DISPATCH(paged_decode_attention_f32, float, load_f32, STORE_F32, float, load_f32)
DEFINE_DISPATCH(paged_decode_attention_bf16, uint16_t, load_bf16, store_bf16, uint16_t, load_bf16)
/* fp8 e4m3 cache, q and out in the model dtype. */
DEFINE_DISPATCH(paged_decode_attention_f32_fp8, float, load_f32, STORE_F32, uint8_t, load_fp8_e4m3)
DEFINE_DISPATCH(paged_decode_attention_bf16_fp8, uint16_t, load_bf16, store_bf16, uint8_t,
                load_fp8_e4m3)
