/* Paged decode attention on the CPU: one query token per sequence, read straight from the
 * paged KV cache through the block table (a team kernel, cpu_common.h).
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
 * The cache holds float32, bfloat16 or fp8 e4m3 (then with per-layer scales: k_scale is
 * folded into the query's scaling, v_scale into the output); q and out are float32 or
 * bfloat16. Accumulation is fp32 whatever the storage type; an empty context gives zeros.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

static inline float load_f32(const float *p) { return *p; }
static inline float load_bf16(const uint16_t *p) { return bf16_to_f32(*p); }

/* e4m3 -> fp32, exact: the 7 magnitude bits shifted into an fp16's exponent and mantissa
 * give the value times 2^-8 (subnormals included), F16C widens it. */
static inline float load_e4m3(const uint8_t *p) {
    const uint16_t half = (uint16_t)(((*p & 0x80) << 8) | ((*p & 0x7f) << 7));
#if defined(__F16C__)
    return _cvtsh_ss(half) * 256.0f;
#else
    const int exponent = (half >> 10) & 0x1f, mantissa = half & 0x3ff;
    const float magnitude = exponent ? ldexpf(1.0f + mantissa / 1024.0f, exponent - 15)
                                     : ldexpf(mantissa / 1024.0f, -14);
    return (half & 0x8000 ? -magnitude : magnitude) * 256.0f;
#endif
}

/* Blocks sit anywhere in the pool, and the hardware prefetcher, which follows sequential
 * runs, stalls at each block boundary. */
static inline void prefetch_block(const void *block, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)block + i, 0, 3);
}

struct kvrail_decode_attention_args {
    const void *q;                   /* [num_tokens, num_heads, head_dim], q_dtype */
    const void *k_cache, *v_cache;   /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const int32_t *block_table;      /* [num_reqs, stride_bt] */
    const int32_t *query_start_loc;  /* [num_reqs + 1] */
    const int32_t *seq_lens;         /* [num_reqs] */
    const int32_t *req_indices;      /* [num_decodes]: the requests attended */
    void *out;                       /* like q; row query_start_loc[req] of each is written */
    int64_t q_dtype, cache_dtype, num_decodes, num_heads, num_kv_heads, head_dim, block_size;
    int64_t stride_q;                /* q's token stride: heads and head_dim are contiguous */
    int64_t stride_bt;
    float scale, k_scale, v_scale;
};

#define DEFINE_DECODE(NAME, T, LOAD_Q, C, LOAD_C, HEAD_DIM)                                        \
static void NAME(const struct kvrail_decode_attention_args *a, int tid, int num_threads) {        \
    const T *q = a->q;                                                                             \
    const C *k_cache = a->k_cache, *v_cache = a->v_cache;                                          \
    const int num_heads = (int)a->num_heads, block_size = (int)a->block_size;                      \
    const int hd = HEAD_DIM ? HEAD_DIM : (int)a->head_dim;                                         \
    const int group = num_heads / (int)a->num_kv_heads;                                            \
    const int64_t stride_slot = a->num_kv_heads * hd;                                              \
    const int64_t block_bytes = block_size * stride_slot * (int64_t)sizeof(C);                     \
    const float q_scale = a->scale * a->k_scale;                                                   \
    int max_seq_len = 0;                                                                           \
    for (int64_t i = 0; i < a->num_decodes; i++) {                                                 \
        const int len = a->seq_lens[a->req_indices[i]];                                            \
        max_seq_len = len > max_seq_len ? len : max_seq_len;                                       \
    }                                                                                              \
    /* Per thread: scores [num_heads][max_seq_len] (+1: never a zero-size malloc), q and acc  */  \
    /* [num_heads][head_dim], each head's softmax sum. */                                         \
    float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)(max_seq_len + 1));        \
    float *qf = malloc(sizeof(float) * (size_t)num_heads * (size_t)hd);                            \
    float *acc = malloc(sizeof(float) * (size_t)num_heads * (size_t)hd);                           \
    float *sums = malloc(sizeof(float) * (size_t)num_heads);                                       \
    /* Requests dealt out in turn: contexts of random lengths even out across threads. */        \
    for (int64_t i = tid; i < a->num_decodes; i += num_threads) {                                 \
        const int req = a->req_indices[i];                                                         \
        const int seq_len = a->seq_lens[req];                                                      \
        const int32_t *blocks = a->block_table + req * a->stride_bt;                               \
        const int64_t row = a->query_start_loc[req];                                               \
        for (int j = 0; j < num_heads * hd; j++) {                                                 \
            qf[j] = LOAD_Q(q + row * a->stride_q + j) * q_scale;                                   \
            acc[j] = 0.0f;                                                                         \
        }                                                                                          \
        /* Pass 1: scores = q . k. A token's K rows of all kv heads are one contiguous  */         \
        /* run, so the block is read as a stream and each row serves its GQA group. */             \
        for (int t = 0; t < seq_len; t++) {                                                        \
            if (t % block_size == 0) { /* the next block of K, or the first of V */                \
                const int next = t / block_size + 1;                                               \
                prefetch_block(next * block_size < seq_len                                         \
                               ? k_cache + (int64_t)blocks[next] * block_size * stride_slot        \
                               : v_cache + (int64_t)blocks[0] * block_size * stride_slot,          \
                               block_bytes);                                                       \
            }                                                                                      \
            const C *k = k_cache + ((int64_t)blocks[t / block_size] * block_size                   \
                                    + t % block_size) * stride_slot;                               \
            for (int h = 0; h < num_heads; h++) {                                                  \
                const C *kh = k + (h / group) * hd;                                                \
                const float *qh = qf + h * hd;                                                     \
                float dot = 0.0f;                                                                  \
                _Pragma("omp simd reduction(+:dot)")                                               \
                for (int d = 0; d < hd; d++) dot += qh[d] * LOAD_C(kh + d);                        \
                scores[(int64_t)h * max_seq_len + t] = dot;                                        \
            }                                                                                      \
        }                                                                                          \
        /* Softmax weights, unnormalized; each head's sum divides once at the end. */              \
        for (int h = 0; h < num_heads; h++) {                                                      \
            float *sh = scores + (int64_t)h * max_seq_len;                                         \
            float row_max = -FLT_MAX, sum = 0.0f; /* finite: built with -ffast-math */             \
            for (int t = 0; t < seq_len; t++) row_max = sh[t] > row_max ? sh[t] : row_max;         \
            _Pragma("omp simd reduction(+:sum)") /* vector expf from libmvec */                    \
            for (int t = 0; t < seq_len; t++) {                                                    \
                sh[t] = expf(sh[t] - row_max);                                                     \
                sum += sh[t];                                                                      \
            }                                                                                      \
            sums[h] = sum;                                                                         \
        }                                                                                          \
        /* Pass 2: out = sum_t p_t v_t, V streamed the same way as K. */                           \
        for (int t = 0; t < seq_len; t++) {                                                        \
            const int next = t / block_size + 1;                                                   \
            if (t % block_size == 0 && next * block_size < seq_len)                                \
                prefetch_block(v_cache + (int64_t)blocks[next] * block_size * stride_slot,         \
                               block_bytes);                                                       \
            const C *v = v_cache + ((int64_t)blocks[t / block_size] * block_size                   \
                                    + t % block_size) * stride_slot;                               \
            for (int h = 0; h < num_heads; h++) {                                                  \
                const C *vh = v + (h / group) * hd;                                                \
                float *ah = acc + h * hd;                                                          \
                const float p = scores[(int64_t)h * max_seq_len + t];                              \
                _Pragma("omp simd")                                                                \
                for (int d = 0; d < hd; d++) ah[d] += p * LOAD_C(vh + d);                          \
            }                                                                                      \
        }                                                                                          \
        for (int h = 0; h < num_heads; h++) {                                                      \
            const float inv = seq_len > 0 ? a->v_scale / sums[h] : 0.0f;                           \
            for (int d = 0; d < hd; d++)                                                           \
                store_float(a->out, (int)a->q_dtype, row * num_heads * hd + h * hd + d,            \
                            acc[h * hd + d] * inv);                                                \
        }                                                                                          \
    }                                                                                              \
    free(scores);                                                                                  \
    free(qf);                                                                                      \
    free(acc);                                                                                     \
    free(sums);                                                                                    \
}

/* Instances for the common head sizes, where the compiler sees a constant vector length
 * (fully unrolled inner loops, no remainder), and one for any other size. */
#define DEFINE_HEAD_SIZES(NAME, T, LOAD_Q, C, LOAD_C)                                              \
DEFINE_DECODE(NAME##_64, T, LOAD_Q, C, LOAD_C, 64)                                                 \
DEFINE_DECODE(NAME##_128, T, LOAD_Q, C, LOAD_C, 128)                                               \
DEFINE_DECODE(NAME##_any, T, LOAD_Q, C, LOAD_C, 0)                                                 \
static void NAME(const struct kvrail_decode_attention_args *a, int tid, int num_threads) {        \
    if (a->head_dim == 64)                                                                         \
        NAME##_64(a, tid, num_threads);                                                            \
    else if (a->head_dim == 128)                                                                   \
        NAME##_128(a, tid, num_threads);                                                           \
    else                                                                                           \
        NAME##_any(a, tid, num_threads);                                                           \
}

DEFINE_HEAD_SIZES(decode_f32, float, load_f32, float, load_f32)
DEFINE_HEAD_SIZES(decode_bf16, uint16_t, load_bf16, uint16_t, load_bf16)
DEFINE_HEAD_SIZES(decode_f32_fp8, float, load_f32, uint8_t, load_e4m3)
DEFINE_HEAD_SIZES(decode_bf16_fp8, uint16_t, load_bf16, uint8_t, load_e4m3)

/* Attend each of `req_indices` to its context. A cache in float holds q's dtype (the
 * launcher checks). */
void kvrail_decode_attention(const struct kvrail_decode_attention_args *a, int tid,
                             int num_threads) {
    const int bf16 = a->q_dtype == KVRAIL_BF16;
    if (a->cache_dtype == KVRAIL_FP8_E4M3)
        bf16 ? decode_bf16_fp8(a, tid, num_threads) : decode_f32_fp8(a, tid, num_threads);
    else
        bf16 ? decode_bf16(a, tid, num_threads) : decode_f32(a, tid, num_threads);
}
