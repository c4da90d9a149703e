/* Paged causal attention for prompts on the CPU (a team kernel, cpu_common.h): flash
 * attention over the paged cache, for fresh prompts and for chunks over cached context alike.
 *
 * Request r's queries (rows query_start_loc[r] .. +q_len of q) sit at positions
 * seq_len - q_len .. seq_len - 1 and attend causally to its first seq_len cached tokens,
 * this step's included (the KV write runs first). Work items are (request, kv head, tile of
 * TILE queries), dealt out to threads in turn; an item keeps its group's query rows, running
 * maxima, sums and outputs in fp32 while tiles of TILE keys stream by: S = Q K^T against the
 * tile's transposed keys (one vector of TILE scores per query row, no horizontal sums), the
 * online softmax, and O += P V. The loops over the keys of a tile and over head_dim are
 * written to vectorize (gcc, -O3 -march=native): AVX-512 or AVX2 alike.
 *
 * Sums are kept in several independent registers (4 over head_dim for a score, head_dim /
 * TILE for an output row): one running sum per row waits on each FMA's latency (measured:
 * 2.5x slower). head_dim must be a multiple of 16, at most 256. The cache holds float32,
 * bfloat16 or fp8 e4m3 with scales (k_scale folds into the query scaling, v_scale into the
 * output); q and out are float32 or bfloat16.
 *
 * Measured, 4 prompts of 128 (512) tokens, 9 query and 3 kv heads of 64, 2 vCPUs: on an
 * AVX512-BF16 EPYC in bf16, 64 (86) GFLOP/s, against 39 (60) for torch's SDPA on the same
 * prompts, unpadded. On an AVX2 EPYC in fp32 (`python -m benchmarks.attention_kernels`,
 * `results/attention_kernels-avx2.md`), tiles of 8 against tiles of 16 (below): prompts 36.8
 * (42.8) GFLOP/s against 8.2 (9.9), a speculative verify step of 5 (8) queries over 400
 * cached tokens 190 (265) us a layer against 700 (1,069); the decode kernel takes 99 us for
 * one query there.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>

#include "cpu_common.h"

/* Keys (and queries) per tile: one vector register of floats. With AVX2, a 16-float vector
 * type made gcc 12 assemble every vector through the stack in 128-bit pieces (perf: most of
 * the kernel's cycles on spills and vpinsrq), so AVX2 tiles hold 8. */
#if defined(__AVX512F__)
#define TILE 16
#else
#define TILE 8
#endif
typedef float vtile __attribute__((vector_size(TILE * 4), aligned(TILE * 4)));
#define MAX_CHUNKS (256 / TILE) /* head_dim <= 256 */

#define DEFINE_PREFILL(NAME, T, LOAD_Q, C, LOAD_C, HEAD_DIM)                                       \
static void NAME(const struct kvrail_attention_args *a, int tid, int num_threads) {       \
    const T *q = a->q;                                                                             \
    const C *k_cache = a->k_cache, *v_cache = a->v_cache;                                          \
    const int num_heads = (int)a->num_heads, num_kv = (int)a->num_kv_heads;                        \
    const int hd = HEAD_DIM ? HEAD_DIM : (int)a->head_dim, group = num_heads / num_kv;             \
    const int rows = TILE * group; /* query rows of an item: TILE tokens x the group's heads */    \
    const int64_t stride_slot = (int64_t)num_kv * hd;                                              \
    const int bs_shift = __builtin_ctz((unsigned)a->block_size); /* 8, 16 or 32 */                 \
    const int bs_mask = (int)a->block_size - 1;                                                    \
    const float q_scale = a->scale * a->k_scale;                                                   \
    float *qf = aligned_alloc(64, sizeof(float) * (size_t)(rows * hd));                            \
    float *o = aligned_alloc(64, sizeof(float) * (size_t)(rows * hd));                             \
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)(hd * TILE)); /* keys, transposed */   \
    float *vf = aligned_alloc(64, sizeof(float) * (size_t)(TILE * hd));                            \
    float *m = malloc(sizeof(float) * (size_t)rows), *l = malloc(sizeof(float) * (size_t)rows);    \
    int64_t item = 0;                                                                              \
    for (int64_t n = 0; n < a->num_requests; n++) {                                                \
        const int req = a->req_indices[n];                                                         \
        const int64_t first = a->query_start_loc[req];                                             \
        const int q_len = (int)(a->query_start_loc[req + 1] - first);                              \
        const int seq_len = a->seq_lens[req], start = seq_len - q_len;                             \
        const int32_t *blocks = a->block_table + req * a->stride_bt;                               \
        for (int g = 0; g < num_kv; g++)                                                           \
            for (int i0 = 0; i0 < q_len; i0 += TILE, item++) {                                     \
                if (item % num_threads != tid) continue;                                           \
                const int nq = q_len - i0 < TILE ? q_len - i0 : TILE;                              \
                /* Row r = i * group + j: query token i0 + i, head g * group + j. */               \
                for (int i = 0; i < nq; i++)                                                       \
                    for (int j = 0; j < group; j++) {                                              \
                        const T *src = q + (first + i0 + i) * a->stride_q + (g * group + j) * hd;  \
                        float *dst = qf + (i * group + j) * hd;                                    \
                        for (int d = 0; d < hd; d++) dst[d] = LOAD_Q(src + d) * q_scale;           \
                    }                                                                              \
                for (int r = 0; r < nq * group; r++) {                                             \
                    m[r] = -FLT_MAX;                                                               \
                    l[r] = 0.0f;                                                                   \
                    for (int d = 0; d < hd; d++) o[r * hd + d] = 0.0f;                             \
                }                                                                                  \
                const int num_keys = start + i0 + nq; /* the last query's context */              \
                for (int t0 = 0; t0 < num_keys; t0 += TILE) {                                      \
                    const int nk = num_keys - t0 < TILE ? num_keys - t0 : TILE;                    \
                    for (int j = 0; j < TILE; j++) {                                               \
                        if (j >= nk) { /* a partial tile: zero keys, masked below */              \
                            for (int d = 0; d < hd; d++) kt[d * TILE + j] = 0.0f;                  \
                            for (int d = 0; d < hd; d++) vf[j * hd + d] = 0.0f;                    \
                            continue;                                                              \
                        }                                                                          \
                        const int t = t0 + j;                                                      \
                        const int64_t slot = ((int64_t)blocks[t >> bs_shift] << bs_shift)          \
                                             + (t & bs_mask);                                      \
                        const C *k = k_cache + slot * stride_slot + g * hd;                        \
                        const C *v = v_cache + slot * stride_slot + g * hd;                        \
                        for (int d = 0; d < hd; d++) kt[d * TILE + j] = LOAD_C(k + d);             \
                        _Pragma("omp simd")                                                        \
                        for (int d = 0; d < hd; d++) vf[j * hd + d] = LOAD_C(v + d);               \
                    }                                                                              \
                    const vtile *ktv = (const vtile *)kt;                                          \
                    for (int r = 0; r < nq * group; r++) {                                         \
                        const float *qr = qf + r * hd;                                             \
                        /* Four independent sums: one chain of FMAs would wait on each. */        \
                        vtile s4[4] = {{0}, {0}, {0}, {0}};                                        \
                        for (int d = 0; d < hd; d += 4)                                            \
                            for (int u = 0; u < 4; u++) s4[u] += qr[d + u] * ktv[d + u];           \
                        const vtile s = (s4[0] + s4[1]) + (s4[2] + s4[3]);                         \
                        /* Keys past this row's position (and past the tile's end) are out. */    \
                        const int seen = start + i0 + r / group - t0 + 1;                          \
                        const int valid = seen < nk ? seen : nk;                                   \
                        if (valid <= 0) continue; /* every key of the tile is ahead */             \
                        float sc[TILE];                                                            \
                        memcpy(sc, &s, sizeof sc);                                                 \
                        float tile_max = -FLT_MAX;                                                 \
                        _Pragma("omp simd reduction(max:tile_max)")                                \
                        for (int j = 0; j < TILE; j++) {                                           \
                            sc[j] = j < valid ? sc[j] : -FLT_MAX; /* exp gives 0 */               \
                            tile_max = sc[j] > tile_max ? sc[j] : tile_max;                        \
                        }                                                                          \
                        const float m_new = tile_max > m[r] ? tile_max : m[r];                     \
                        const float alpha = expf(m[r] - m_new);                                    \
                        float p[TILE], sum = 0.0f;                                                 \
                        /* Unconditional, so that it is one vector expf (libmvec). */             \
                        _Pragma("omp simd reduction(+:sum)")                                       \
                        for (int j = 0; j < TILE; j++) {                                           \
                            p[j] = expf(sc[j] - m_new);                                            \
                            sum += p[j];                                                           \
                        }                                                                          \
                        l[r] = l[r] * alpha + sum;                                                 \
                        m[r] = m_new;                                                              \
                        vtile *orow = (vtile *)(o + r * hd);                                       \
                        const vtile *vv = (const vtile *)vf;                                       \
                        /* Key by key, all of head_dim at once: hd / TILE independent sums. */    \
                        vtile acc[HEAD_DIM ? HEAD_DIM / TILE : MAX_CHUNKS];                        \
                        for (int c = 0; c < hd / TILE; c++) acc[c] = orow[c] * alpha;              \
                        for (int j = 0; j < valid; j++)                                            \
                            for (int c = 0; c < hd / TILE; c++) acc[c] += p[j] * vv[j * (hd / TILE) + c]; \
                        for (int c = 0; c < hd / TILE; c++) orow[c] = acc[c];                      \
                    }                                                                              \
                }                                                                                  \
                for (int i = 0; i < nq; i++)                                                       \
                    for (int j = 0; j < group; j++) {                                              \
                        const int r = i * group + j;                                               \
                        const float inv = a->v_scale / l[r]; /* l > 0: key `pos` is seen */       \
                        const int64_t dst = ((first + i0 + i) * num_heads + g * group + j) * hd;   \
                        for (int d = 0; d < hd; d++)                                               \
                            store_float(a->out, (int)a->q_dtype, dst + d, o[r * hd + d] * inv);    \
                    }                                                                              \
            }                                                                                      \
    }                                                                                              \
    free(qf);                                                                                      \
    free(o);                                                                                       \
    free(kt);                                                                                      \
    free(vf);                                                                                      \
    free(m);                                                                                       \
    free(l);                                                                                       \
}

DEFINE_HEAD_DIM_INSTANCES(DEFINE_PREFILL, prefill_f32, float, load_f32, float, load_f32)
DEFINE_HEAD_DIM_INSTANCES(DEFINE_PREFILL, prefill_bf16, uint16_t, load_bf16, uint16_t, load_bf16)
DEFINE_HEAD_DIM_INSTANCES(DEFINE_PREFILL, prefill_f32_fp8, float, load_f32, uint8_t, load_e4m3)
DEFINE_HEAD_DIM_INSTANCES(DEFINE_PREFILL, prefill_bf16_fp8, uint16_t, load_bf16, uint8_t,
                          load_e4m3)

/* A cache in float holds q's dtype (the launcher checks). */
void kvrail_prefill_attention(const struct kvrail_attention_args *a, int tid,
                              int num_threads) {
    const int bf16 = a->q_dtype == KVRAIL_BF16;
    if (a->cache_dtype == KVRAIL_FP8_E4M3)
        bf16 ? prefill_bf16_fp8(a, tid, num_threads) : prefill_f32_fp8(a, tid, num_threads);
    else
        bf16 ? prefill_bf16(a, tid, num_threads) : prefill_f32(a, tid, num_threads);
}
