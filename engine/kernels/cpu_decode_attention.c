/* Paged decode attention on the CPU: one query token per sequence, read straight from the
 * paged KV cache through the block table.
 *
 * The torch path gathers every sequence's K and V into a padded copy per layer and then
 * runs SDPA over it: three passes over the context. Here each sequence reads its K once
 * (scores), then its V once (weighted sum), block by block, with no copy and no padding.
 * Work is split by sequence: a token's K (and V) rows of all kv heads are one contiguous
 * run, so each block streams through once and each row serves its GQA group.
 *
 * Layouts (contiguous): q, out [num_tokens, num_heads, head_dim]; k_cache, v_cache
 * [num_blocks, block_size, num_kv_heads, head_dim]; block_table [num_reqs, stride_bt] int32;
 * query_start_loc [num_reqs + 1], seq_lens [num_reqs] int32. Requests req_indices[0..n) are
 * processed, each writing row query_start_loc[req] of out; the other rows are not touched.
 * Accumulation is fp32 whatever the storage type; an empty context gives zeros.
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

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                       \
void NAME(T *out, const T *q, const T *k_cache, const T *v_cache, const int32_t *block_table,     \
          const int32_t *query_start_loc, const int32_t *seq_lens, const int32_t *req_indices,    \
          int num_decodes, int num_heads, int num_kv_heads, int head_dim, int block_size,         \
          int64_t stride_bt, int max_seq_len, float scale, int num_threads) {                     \
    const int group = num_heads / num_kv_heads;                                                   \
    const int64_t stride_slot = (int64_t)num_kv_heads * head_dim;                                 \
    _Pragma("omp parallel num_threads(num_threads)")                                              \
    {                                                                                             \
        /* Per thread: scores [num_heads][max_seq_len] (+1: never a zero-size malloc), q and  */  \
        /* acc [num_heads][head_dim], each head's softmax sum. */                                 \
        float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)(max_seq_len + 1));    \
        float *qf = malloc(sizeof(float) * (size_t)num_heads * (size_t)head_dim);                 \
        float *acc = malloc(sizeof(float) * (size_t)num_heads * (size_t)head_dim);                \
        float *sums = malloc(sizeof(float) * (size_t)num_heads);                                  \
        _Pragma("omp for schedule(dynamic, 1)")                                                   \
        for (int i = 0; i < num_decodes; i++) {                                                   \
            const int req = req_indices[i];                                                       \
            const int seq_len = seq_lens[req];                                                    \
            const int32_t *blocks = block_table + req * stride_bt;                                \
            const int64_t row = query_start_loc[req];                                             \
            for (int j = 0; j < num_heads * head_dim; j++) {                                      \
                qf[j] = LOAD(q + row * num_heads * head_dim + j) * scale;                         \
                acc[j] = 0.0f;                                                                    \
            }                                                                                     \
            /* Pass 1: scores = q . k. A token's K rows of all kv heads are one contiguous  */    \
            /* run, so the block is read as a stream and each row serves its GQA group. */        \
            for (int t = 0; t < seq_len; t++) {                                                   \
                const T *k = k_cache + ((int64_t)blocks[t / block_size] * block_size              \
                                        + t % block_size) * stride_slot;                          \
                for (int h = 0; h < num_heads; h++) {                                             \
                    const T *kh = k + (h / group) * head_dim;                                     \
                    const float *qh = qf + h * head_dim;                                          \
                    float dot = 0.0f;                                                             \
                    _Pragma("omp simd reduction(+:dot)")                                          \
                    for (int d = 0; d < head_dim; d++) dot += qh[d] * LOAD(kh + d);               \
                    scores[(int64_t)h * max_seq_len + t] = dot;                                   \
                }                                                                                 \
            }                                                                                     \
            /* Softmax weights, unnormalized; each head's sum divides once at the end. */         \
            for (int h = 0; h < num_heads; h++) {                                                 \
                float *sh = scores + (int64_t)h * max_seq_len;                                    \
                float row_max = -FLT_MAX, sum = 0.0f; /* finite: built with -ffast-math */        \
                for (int t = 0; t < seq_len; t++) row_max = sh[t] > row_max ? sh[t] : row_max;    \
                _Pragma("omp simd reduction(+:sum)") /* vector expf from libmvec */               \
                for (int t = 0; t < seq_len; t++) {                                               \
                    sh[t] = expf(sh[t] - row_max);                                                \
                    sum += sh[t];                                                                 \
                }                                                                                 \
                sums[h] = sum;                                                                    \
            }                                                                                     \
            /* Pass 2: out = sum_t p_t v_t, V streamed the same way as K. */                      \
            for (int t = 0; t < seq_len; t++) {                                                   \
                const T *v = v_cache + ((int64_t)blocks[t / block_size] * block_size              \
                                        + t % block_size) * stride_slot;                          \
                for (int h = 0; h < num_heads; h++) {                                             \
                    const T *vh = v + (h / group) * head_dim;                                     \
                    float *ah = acc + h * head_dim;                                               \
                    const float p = scores[(int64_t)h * max_seq_len + t];                         \
                    _Pragma("omp simd")                                                           \
                    for (int d = 0; d < head_dim; d++) ah[d] += p * LOAD(vh + d);                 \
                }                                                                                 \
            }                                                                                     \
            T *out_row = out + row * num_heads * head_dim;                                        \
            for (int h = 0; h < num_heads; h++) {                                                 \
                const float inv = seq_len > 0 ? 1.0f / sums[h] : 0.0f;                            \
                for (int d = 0; d < head_dim; d++)                                                \
                    out_row[h * head_dim + d] = STORE(acc[h * head_dim + d] * inv);               \
            }                                                                                     \
        }                                                                                         \
        free(scores);                                                                             \
        free(qf);                                                                                 \
        free(acc);                                                                                \
        free(sums);                                                                               \
    }                                                                                             \
}

#define STORE_F32(x) (x)
DEFINE_DECODE(paged_decode_attention_f32, float, load_f32, STORE_F32)
DEFINE_DECODE(paged_decode_attention_bf16, uint16_t, load_bf16, store_bf16)
