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
 * written to vectorize (gcc, -O3 -march=native): AVX-512 or AVX2 alike. With a bf16 query and
 * AMX-BF16, a variant on the tile unit runs instead (prefill_amx below); with a bf16 query and
 * AVX512-BF16, a transposed variant on bf16 pairs (DEFINE_PREFILL_DPBF16); with an fp32 query and
 * AVX2 (no AVX-512), one in fp32 (DEFINE_PREFILL_AVX2); each for head sizes 64 and 128.
 *
 * Sums are kept in several independent registers (4 over head_dim for a score, head_dim /
 * TILE for an output row): one running sum per row waits on each FMA's latency (measured:
 * 2.5x slower). head_dim must be a multiple of 16, at most 256. The cache holds float32,
 * bfloat16 or fp8 e4m3 with scales (k_scale folds into the query scaling, v_scale into the
 * output); q and out are float32 or bfloat16 (a bf16 query reads no fp32 cache).
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

/* Work items: `tile` query tokens of a request with one kv head's group of query heads, dealt
 * out to threads in turn (request by request, head by head, tile by tile). */
struct prefill_item {
    int64_t n, count;     /* where the walk is: request n of req_indices, items passed */
    int g, i;             /* its next kv head and first query */
    int req, start;       /* the item: request, position of its first query token, */
    int kv_head, q0, nq;  /* kv head, first query and number of queries, */
    int64_t first;        /* and the request's first row of q and out */
};

/* Moves `it` to this thread's next item; 0 when there is none. */
static int next_prefill_item(const struct kvrail_attention_args *a, int tid, int num_threads,
                             int tile, struct prefill_item *it) {
    for (; it->n < a->num_requests; it->n++, it->g = 0) {
        const int req = a->req_indices[it->n];
        const int64_t first = a->query_start_loc[req];
        const int q_len = (int)(a->query_start_loc[req + 1] - first);
        for (; it->g < a->num_kv_heads; it->g++, it->i = 0)
            while (it->i < q_len) {
                const int i0 = it->i;
                it->i += tile;
                if (it->count++ % num_threads != tid) continue;
                it->req = req;
                it->first = first;
                it->start = a->seq_lens[req] - q_len;
                it->kv_head = it->g;
                it->q0 = i0;
                it->nq = q_len - i0 < tile ? q_len - i0 : tile;
                return 1;
            }
    }
    return 0;
}

#define DEFINE_PREFILL(NAME, T, LOAD_Q, C, LOAD_C, HEAD_DIM)                                       \
static void NAME(const struct kvrail_attention_args *a, int tid, int num_threads) {       \
    const T *q = a->q;                                                                             \
    const C *k_cache = a->k_cache, *v_cache = a->v_cache;                                          \
    const int num_heads = (int)a->num_heads, num_kv = (int)a->num_kv_heads;                        \
    const int hd = HEAD_DIM ? HEAD_DIM : (int)a->head_dim, group = num_heads / num_kv;             \
    const int rows = TILE * group; /* query rows of an item: TILE tokens x the group's heads */    \
    const int64_t stride_slot = (int64_t)num_kv * hd;                                              \
    const int bs_shift = __builtin_ctz((unsigned)a->block_size); /* 8, 16 or 32 */                 \
    const float q_scale = a->scale * a->k_scale;                                                   \
    float *qf = aligned_alloc(64, sizeof(float) * (size_t)(rows * hd));                            \
    float *o = aligned_alloc(64, sizeof(float) * (size_t)(rows * hd));                             \
    float *kt = aligned_alloc(64, sizeof(float) * (size_t)(hd * TILE)); /* keys, transposed */   \
    float *vf = aligned_alloc(64, sizeof(float) * (size_t)(TILE * hd));                            \
    float *m = malloc(sizeof(float) * (size_t)rows), *l = malloc(sizeof(float) * (size_t)rows);    \
    for (struct prefill_item it = {0}; next_prefill_item(a, tid, num_threads, TILE, &it);) {       \
        const int64_t first = it.first;                                                            \
        const int start = it.start, g = it.kv_head, i0 = it.q0, nq = it.nq;                        \
        const int32_t *blocks = a->block_table + it.req * a->stride_bt;                            \
        /* Row r = i * group + j: query token i0 + i, head g * group + j. */                       \
        for (int i = 0; i < nq; i++)                                                               \
            for (int j = 0; j < group; j++) {                                                      \
                const T *src = q + (first + i0 + i) * a->stride_q + (g * group + j) * hd;          \
                float *dst = qf + (i * group + j) * hd;                                            \
                for (int d = 0; d < hd; d++) dst[d] = LOAD_Q(src + d) * q_scale;                   \
            }                                                                                      \
        for (int r = 0; r < nq * group; r++) {                                                     \
            m[r] = -FLT_MAX;                                                                       \
            l[r] = 0.0f;                                                                           \
            for (int d = 0; d < hd; d++) o[r * hd + d] = 0.0f;                                     \
        }                                                                                          \
        const int num_keys = start + i0 + nq; /* the last query's context */                       \
        for (int t0 = 0; t0 < num_keys; t0 += TILE) {                                              \
            const int nk = num_keys - t0 < TILE ? num_keys - t0 : TILE;                            \
            for (int j = 0; j < TILE; j++) {                                                       \
                if (j >= nk) { /* a partial tile: zero keys, masked below */                       \
                    for (int d = 0; d < hd; d++) kt[d * TILE + j] = 0.0f;                          \
                    for (int d = 0; d < hd; d++) vf[j * hd + d] = 0.0f;                            \
                    continue;                                                                      \
                }                                                                                  \
                const int t = t0 + j;                                                              \
                const int64_t slot = row_offset(blocks, bs_shift, t);                              \
                const C *k = k_cache + slot * stride_slot + g * hd;                                \
                const C *v = v_cache + slot * stride_slot + g * hd;                                \
                for (int d = 0; d < hd; d++) kt[d * TILE + j] = LOAD_C(k + d);                     \
                _Pragma("omp simd")                                                                \
                for (int d = 0; d < hd; d++) vf[j * hd + d] = LOAD_C(v + d);                       \
            }                                                                                      \
            const vtile *ktv = (const vtile *)kt;                                                  \
            for (int r = 0; r < nq * group; r++) {                                                 \
                const float *qr = qf + r * hd;                                                     \
                /* Four independent sums: one chain of FMAs would wait on each. */                 \
                vtile s4[4] = {{0}, {0}, {0}, {0}};                                                \
                for (int d = 0; d < hd; d += 4)                                                    \
                    for (int u = 0; u < 4; u++) s4[u] += qr[d + u] * ktv[d + u];                   \
                const vtile s = (s4[0] + s4[1]) + (s4[2] + s4[3]);                                 \
                /* Keys past this row's position (and past the tile's end) are out. */             \
                const int seen = start + i0 + r / group - t0 + 1;                                  \
                const int valid = seen < nk ? seen : nk;                                           \
                if (valid <= 0) continue; /* every key of the tile is ahead */                     \
                float sc[TILE];                                                                    \
                memcpy(sc, &s, sizeof sc);                                                         \
                float tile_max = -FLT_MAX;                                                         \
                _Pragma("omp simd reduction(max:tile_max)")                                        \
                for (int j = 0; j < TILE; j++) {                                                   \
                    sc[j] = j < valid ? sc[j] : -FLT_MAX; /* exp gives 0 */                        \
                    tile_max = sc[j] > tile_max ? sc[j] : tile_max;                                \
                }                                                                                  \
                const float m_new = tile_max > m[r] ? tile_max : m[r];                             \
                const float alpha = expf(m[r] - m_new);                                            \
                float p[TILE], sum = 0.0f;                                                         \
                /* Unconditional, so that it is one vector expf (libmvec). */                      \
                _Pragma("omp simd reduction(+:sum)")                                               \
                for (int j = 0; j < TILE; j++) {                                                   \
                    p[j] = expf(sc[j] - m_new);                                                    \
                    sum += p[j];                                                                   \
                }                                                                                  \
                l[r] = l[r] * alpha + sum;                                                         \
                m[r] = m_new;                                                                      \
                vtile *orow = (vtile *)(o + r * hd);                                               \
                const vtile *vv = (const vtile *)vf;                                               \
                /* Key by key, all of head_dim at once: hd / TILE independent sums. */             \
                vtile acc[HEAD_DIM ? HEAD_DIM / TILE : MAX_CHUNKS];                                \
                for (int c = 0; c < hd / TILE; c++) acc[c] = orow[c] * alpha;                      \
                for (int j = 0; j < valid; j++)                                                    \
                    for (int c = 0; c < hd / TILE; c++) acc[c] += p[j] * vv[j * (hd / TILE) + c];  \
                for (int c = 0; c < hd / TILE; c++) orow[c] = acc[c];                              \
            }                                                                                      \
        }                                                                                          \
        for (int i = 0; i < nq; i++)                                                               \
            for (int j = 0; j < group; j++) {                                                      \
                const int r = i * group + j;                                                       \
                const float inv = a->v_scale / l[r]; /* l > 0: key `pos` is seen */                \
                const int64_t dst = ((first + i0 + i) * num_heads + g * group + j) * hd;           \
                for (int d = 0; d < hd; d++)                                                       \
                    store_float(a->out, (int)a->q_dtype, dst + d, o[r * hd + d] * inv);            \
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
DEFINE_HEAD_DIM_INSTANCES(DEFINE_PREFILL, prefill_f32_bf16, float, load_f32, uint16_t, load_bf16)
DEFINE_HEAD_DIM_INSTANCES(DEFINE_PREFILL, prefill_f32_fp8, float, load_f32, uint8_t, load_e4m3)
DEFINE_HEAD_DIM_INSTANCES(DEFINE_PREFILL, prefill_bf16_fp8, uint16_t, load_bf16, uint8_t,
                          load_e4m3)

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* With a bf16 query and AVX512-BF16, the same flash attention runs on bf16 pairs (vdpbf16ps:
 * each fp32 lane adds two products), transposed: a vector holds 16 query rows of one head
 * (the item's tokens), not 16 keys. Then nothing is reduced across lanes: a key's scores are
 * 32 (head_dim 64) vdpbf16ps of the query pairs, transposed once per item, by that key's
 * (k[2i], k[2i+1]) broadcast straight from the cache; the running maxima and sums, the
 * rescaling and the softmax weights are vectors of 16 rows (exp16 of cpu_common.h, no libm
 * call per row); P . V takes the rows' weights of two keys interleaved (rounded to bf16, as flash
 * attention's P is) by (v_t[d], v_t+1[d]) broadcast, 16 outputs of head_dim at a time in
 * registers. Products and sums are fp32. Measured on the project's 2-vCPU AVX512-BF16 EPYC
 * against the fp32 tiles above (`python -m benchmarks.attention_kernels`, the two builds in
 * turn, twice): prompts 4 x 512 67-72 -> 156-162 GFLOP/s, 4 x 128 49-50 -> 74-84; a prompt step
 * of the full workload in int8 (`benchmarks.profile_step --quantization int8 --skip-steps 2`,
 * 2048 tokens): attention 338 -> 155 ms, the step 1,166 -> 955 ms. An item costs 16 rows however
 * few queries it has (5 queries over 400 cached tokens: 113-127 us against 96-146). */
typedef uint32_t u32_alias __attribute__((may_alias)); /* a bf16 pair, read in place */
#define ROWS 16 /* query tokens of an item: the lanes of a vector */
#define KEYS 16 /* keys of a tile */

/* r[i] <- column i of the 16 x 16 matrix whose rows are r[0..15]. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) { /* pairs of rows: (r_i[c], r_i+1[c]) per column pair */
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + b] lane k: rows i..i+3 of column 4k + b */
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int b = 0; b < 4; b++) { /* 128-bit quads of rows 0-7 and 8-15, then all 16 */
        const __m512 lo02 = _mm512_shuffle_f32x4(r[b], r[4 + b], 0x88);
        const __m512 lo13 = _mm512_shuffle_f32x4(r[b], r[4 + b], 0xDD);
        const __m512 hi02 = _mm512_shuffle_f32x4(r[8 + b], r[12 + b], 0x88);
        const __m512 hi13 = _mm512_shuffle_f32x4(r[8 + b], r[12 + b], 0xDD);
        t[b] = _mm512_shuffle_f32x4(lo02, hi02, 0x88);      /* column b */
        t[8 + b] = _mm512_shuffle_f32x4(lo02, hi02, 0xDD);  /* column 8 + b */
        t[4 + b] = _mm512_shuffle_f32x4(lo13, hi13, 0x88);  /* column 4 + b */
        t[12 + b] = _mm512_shuffle_f32x4(lo13, hi13, 0xDD); /* column 12 + b */
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* Stores 32 dimensions of an item's output rows (bf16, row stride `stride`) from o[e], e =
 * 16h + l the V pairs' order (dimension 8(l/4) + 4h + l%4), each a vector of the rows, times
 * `inv`: two 16 x 16 transposes and one interleave per row. Element by element (store_float,
 * the index arithmetic per element) it took 18% of the kernel's cycles on 4 prompts of 512
 * (perf, the 2-vCPU Zen 4 EPYC); this way, same machine, both libraries in turn
 * (`benchmarks.attention_kernels --baseline-ref`, `results/attention_kernels-zen4-store.md`),
 * prompts 4 x 128 0.65x the time (134 -> 208 GFLOP/s), 4 x 512 0.85x (233 -> 274), and the
 * full workload in int8 (`benchmarks.throughput --configs int8 --baseline-ref`,
 * `results/throughput-full-zen4-store.md`) 30.1 -> 28.7 s. */
static inline void store_rows32(const __m512 *o, __m512 inv, uint16_t *out, int64_t stride,
                                int nq) {
    __m512 h0[16], h1[16];
    for (int l = 0; l < 16; l++) {
        h0[l] = _mm512_mul_ps(o[l], inv);
        h1[l] = _mm512_mul_ps(o[16 + l], inv);
    }
    transpose16(h0);
    transpose16(h1);
    /* dimensions 0-15 of the 32: 4 of h0 (h = 0), 4 of h1, ...; 16-31 the same 8 lanes on */
    const __m512i first16 =
        _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i last16 = _mm512_add_epi32(first16, _mm512_set1_epi32(8));
    for (int i = 0; i < nq; i++) {
        const __m512 lo = _mm512_permutex2var_ps(h0[i], first16, h1[i]);
        const __m512 hi = _mm512_permutex2var_ps(h0[i], last16, h1[i]);
        _mm512_storeu_si512(out + i * stride, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
}

#define DEFINE_PREFILL_DPBF16(NAME, C, LOAD32, HEAD_DIM)                                          \
static void NAME(const struct kvrail_attention_args *a, int tid, int num_threads) {        \
    const uint16_t *q = a->q;                                                                      \
    const C *k_cache = a->k_cache, *v_cache = a->v_cache;                                          \
    const int num_heads = (int)a->num_heads, num_kv = (int)a->num_kv_heads;                        \
    const int hd = HEAD_DIM, np = HEAD_DIM / 2, group = num_heads / num_kv;                        \
    const int64_t stride_slot = (int64_t)num_kv * hd;                                              \
    const int bs_shift = __builtin_ctz((unsigned)a->block_size);                                   \
    const float unit = cache_operand_unit(sizeof(C));                                              \
    const __m512 score_scale = _mm512_set1_ps(a->scale * a->k_scale * unit);                       \
    /* Per thread: the item's query pairs transposed, qt[head][pair] (16 rows each), its */     \
    /* outputs ot[head][e] (dimension order of the V pairs), the tile's keys as bf16 and */      \
    /* its V pairs vp[key pair][e], e = 32c + 16h + l for dimension 32c + 8(l/4) + 4h + l%4 */   \
    /* (how vpunpck{l,h}wd interleave two rows); a zero row for keys past the context. */       \
    __m512i *qt = aligned_alloc(64, sizeof(__m512i) * (size_t)(group * np));                        \
    __m512 *ot = aligned_alloc(64, sizeof(__m512) * (size_t)(group * hd));                          \
    __m512 *m = aligned_alloc(64, sizeof(__m512) * (size_t)group);                                  \
    __m512 *l = aligned_alloc(64, sizeof(__m512) * (size_t)group);                                  \
    uint16_t kb[KEYS][HEAD_DIM] __attribute__((aligned(64)));                                      \
    uint32_t vp[KEYS / 2][HEAD_DIM] __attribute__((aligned(64)));                                  \
    static const uint16_t zero_row[HEAD_DIM] __attribute__((aligned(64)));                         \
    for (struct prefill_item it = {0}; next_prefill_item(a, tid, num_threads, ROWS, &it);) {       \
        const int64_t first = it.first;                                                            \
        const int start = it.start, g = it.kv_head, i0 = it.q0, nq = it.nq;                        \
        const int32_t *blocks = a->block_table + it.req * a->stride_bt;                            \
        /* Lane i: query token i0 + i at position start + i0 + i; lanes past nq are */             \
        /* padding (position -1: every key masked; their outputs are not stored). */               \
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,           \
                                               13, 14, 15);                                        \
        const __m512i pos = _mm512_mask_blend_epi32(                                               \
            _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(nq)), _mm512_set1_epi32(-1),           \
            _mm512_add_epi32(lane, _mm512_set1_epi32(start + i0)));                                \
        for (int j = 0; j < group; j++) {                                                          \
            /* 16 pairs of each row (zeros past nq), transposed: lane i of qt[.][p] is row i's */  \
            /* pair p. Gathered a pair at a time before (5.6% of the kernel's cycles, perf, the */ \
            /* Zen 4 EPYC); with these transposes and bf16_pairs' two instructions, same */        \
            /* machine, `benchmarks.attention_kernels --baseline-ref 1629bcc`, prompts 4 x 64 */   \
            /* 0.89x the time, 4 x 128 0.90-0.95x, 4 x 512 0.97-1.02x */                           \
            const uint16_t *qj = q + (first + i0) * a->stride_q + (int64_t)(g * group + j) * hd;   \
            for (int p0 = 0; p0 < np; p0 += 16) {                                                  \
                __m512 r[16];                                                                      \
                for (int i = 0; i < 16; i++) {                                                     \
                    const float *row = (const float *)(qj + i * a->stride_q + 2 * p0);             \
                    r[i] = i < nq ? _mm512_loadu_ps(row) : _mm512_setzero_ps();                    \
                }                                                                                  \
                transpose16(r);                                                                    \
                for (int p = 0; p < 16; p++)                                                       \
                    qt[j * np + p0 + p] =                                                          \
                        cache_operand_bf16(_mm512_castps_si512(r[p]), sizeof(C));                  \
            }                                                                                      \
            m[j] = _mm512_set1_ps(-FLT_MAX);                                                       \
            l[j] = _mm512_setzero_ps();                                                            \
            for (int e = 0; e < hd; e++) ot[j * hd + e] = _mm512_setzero_ps();                     \
        }                                                                                          \
        const int num_keys = start + i0 + nq; /* the last query's context */                       \
        for (int t0 = 0; t0 < num_keys; t0 += KEYS) {                                              \
            const int nk = num_keys - t0 < KEYS ? num_keys - t0 : KEYS;                            \
            const u32_alias *krow[KEYS];                                                           \
            const uint16_t *vrow[KEYS];                                                            \
            for (int t = 0; t < KEYS; t++) {                                                       \
                if (t >= nk) {                                                                     \
                    krow[t] = (const u32_alias *)zero_row;                                         \
                    vrow[t] = zero_row;                                                            \
                    continue;                                                                      \
                }                                                                                  \
                const int key = t0 + t;                                                            \
                const int64_t slot = row_offset(blocks, bs_shift, key);                            \
                const C *k = k_cache + slot * stride_slot + g * hd;                                \
                const C *v = v_cache + slot * stride_slot + g * hd;                                \
                if (sizeof(C) == 2) { /* bf16: read in place */                                    \
                    krow[t] = (const u32_alias *)k;                                                \
                    vrow[t] = (const uint16_t *)v;                                                 \
                } else { /* e4m3: K to bf16 here, V below */                                       \
                    for (int c = 0; c < hd; c += 32)                                               \
                        _mm512_store_si512(kb[t] + c, LOAD32(k + c));                              \
                    krow[t] = (const u32_alias *)kb[t];                                            \
                    vrow[t] = (const uint16_t *)v;                                                 \
                }                                                                                  \
            }                                                                                      \
            for (int t = 0; t < KEYS; t += 2)                                                      \
                for (int c = 0; c < hd; c += 32) {                                                 \
                    const __m512i r0 = t < nk ? LOAD32((const C *)vrow[t] + c)                     \
                                              : _mm512_setzero_si512();                            \
                    const __m512i r1 = t + 1 < nk ? LOAD32((const C *)vrow[t + 1] + c)             \
                                                  : _mm512_setzero_si512();                        \
                    _mm512_store_si512(vp[t / 2] + c, _mm512_unpacklo_epi16(r0, r1));              \
                    _mm512_store_si512(vp[t / 2] + c + 16, _mm512_unpackhi_epi16(r0, r1));         \
                }                                                                                  \
            /* Keys at or past a row's position + 1 are out (and padding rows see none). */        \
            const int masked = t0 + KEYS > start + i0;                                             \
            for (int j = 0; j < group; j++) {                                                      \
                __m512 s[KEYS];                                                                    \
                for (int t = 0; t < KEYS; t++) s[t] = _mm512_setzero_ps();                         \
                for (int p = 0; p < np; p++) {                                                     \
                    const __m512bh qp = (__m512bh)qt[j * np + p];                                  \
                    for (int t = 0; t < KEYS; t++)                                                 \
                        s[t] = _mm512_dpbf16_ps(s[t], qp,                                          \
                                                (__m512bh)_mm512_set1_epi32((int)krow[t][p]));     \
                }                                                                                  \
                __m512 tile_max = m[j];                                                            \
                for (int t = 0; t < KEYS; t++) {                                                   \
                    s[t] = _mm512_mul_ps(s[t], score_scale);                                       \
                    if (masked)                                                                    \
                        s[t] = _mm512_mask_blend_ps(                                               \
                            _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(t0 + t)),               \
                            _mm512_set1_ps(-FLT_MAX), s[t]);                                       \
                    tile_max = _mm512_max_ps(tile_max, s[t]);                                      \
                }                                                                                  \
                const __m512 alpha = exp16(_mm512_sub_ps(m[j], tile_max));                         \
                m[j] = tile_max;                                                                   \
                __m512 sum = _mm512_setzero_ps();                                                  \
                for (int t = 0; t < KEYS; t++) {                                                   \
                    s[t] = exp16(_mm512_sub_ps(s[t], tile_max));                                   \
                    sum = _mm512_add_ps(sum, s[t]);                                                \
                }                                                                                  \
                l[j] = _mm512_fmadd_ps(l[j], alpha, sum);                                          \
                __m512i pw[KEYS / 2];                                                              \
                for (int t = 0; t < KEYS; t += 2)                                                  \
                    pw[t / 2] = bf16_pairs(cache_operand(s[t], sizeof(C)),                         \
                                           cache_operand(s[t + 1], sizeof(C)));                    \
                /* 16 outputs at a time stay in registers over the tile's key pairs. */            \
                for (int e0 = 0; e0 < hd; e0 += 16) {                                              \
                    __m512 o[16];                                                                  \
                    for (int e = 0; e < 16; e++)                                                   \
                        o[e] = _mm512_mul_ps(ot[j * hd + e0 + e], alpha);                          \
                    for (int t = 0; t < KEYS / 2; t++)                                             \
                        for (int e = 0; e < 16; e++)                                               \
                            o[e] = _mm512_dpbf16_ps(                                               \
                                o[e], (__m512bh)pw[t],                                             \
                                (__m512bh)_mm512_set1_epi32((int)vp[t][e0 + e]));                  \
                    for (int e = 0; e < 16; e++) ot[j * hd + e0 + e] = o[e];                       \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int j = 0; j < group; j++) {                                                          \
            /* l > 0 for every real row: its own position's key is seen */                         \
            const __m512 inv = _mm512_div_ps(_mm512_set1_ps(a->v_scale * unit), l[j]);             \
            uint16_t *out = (uint16_t *)a->out + ((first + i0) * num_heads + g * group + j) * hd;  \
            for (int c = 0; c < hd; c += 32)                                                       \
                store_rows32(ot + j * hd + c, inv, out + c, num_heads * hd, nq);                   \
        }                                                                                          \
    }                                                                                              \
    free(qt);                                                                                      \
    free(ot);                                                                                      \
    free(m);                                                                                       \
    free(l);                                                                                       \
}

DEFINE_64_AND_128(DEFINE_PREFILL_DPBF16, prefill_dpbf16_bf16, uint16_t, load32_bf16)
DEFINE_64_AND_128(DEFINE_PREFILL_DPBF16, prefill_dpbf16_fp8, uint8_t, load32_e4m3)

#ifdef KVRAIL_AMX_BF16
/* With AMX-BF16 (and a bf16 query), both products run on the tile unit, and the softmax
 * between them is exact rather than online: an item's scores against all its keys stay in a
 * thread's L2 for the contexts prompt steps see (16 rows x 4 bytes a key: 128 KB at 2,048
 * keys; longer contexts stay correct, read from further out). Per item and query head: S = Q K^T, 64 keys at a
 * time (four 16 x 16 fp32 sum tiles, the query's head_dim / 32 A tiles), stored row by row;
 * each row's maximum, exponentials and sum over the keys it sees (AVX-512, exp16), its weights
 * rounded to bf16 as flash attention's P is; then O = P V, 64 dimensions at a time (four sum
 * tiles, an A tile of 32 keys' weights), scaled by 1 / sum on the way out. The tile unit reads
 * its B operand as pairs along k: the keys transposed into (k[2p], k[2p + 1]) columns, V as
 * (v[2t][d], v[2t + 1][d]) rows. Each thread stages a (request, kv head)'s K and V that way
 * once, as far as its items reach (amx_stage), and its items of that head, tiles of 16 queries
 * in order, reuse them. On 2 vCPUs of an AMX Xeon, cache-resident, against the AVX512-BF16
 * variant above and torch's SDPA over dense tensors (`python -m benchmarks.attention_kernels
 * --prompt-lens 64,128,512,2048 --baseline-ref HEAD`, results/attention_kernels-amx-prefill.md):
 * 4 prompts of 64 / 128 / 512 / 2048 tokens 245 / 401 / 560 / 669 GFLOP/s, against 108 / 134 /
 * 159 / 165 and SDPA's 120 / 195 / 295 / 467; the full workload in bf16 30.3 -> 27.6 s, int8 23.9
 * -> 22.3 s (`benchmarks.throughput --baseline-ref`, results/throughput-full-amx-prefill.md). */
#define AMX_KEYS 64 /* keys per pass of the score tiles: four tiles of 16 */

static inline __m512i load32_cache(const void *p, size_t elem_size) {
    return elem_size == 1 ? load32_e4m3(p) : load32_bf16(p);
}

/* One thread's copy of kv head g of request n (of req_indices), keys [0, keys), as B tiles of
 * 16 rows x 64 bytes: kt[tile of 16 keys][slice s of 32 dimensions][pair p][key] holds the
 * pair (k[32s + 2p], k[32s + 2p + 1]), vp[block of 32 keys][slice of 16 dimensions][key pair
 * t][dimension d] the pair (v[2t][d], v[2t + 1][d]). Keys past `keys`, up to the next multiple
 * of AMX_KEYS, are zeros. */
struct amx_staged {
    int64_t n;
    int g, keys;
    uint32_t *kt, *vp;
};

/* Extends `st` to num_keys keys (from its last partial group of AMX_KEYS). */
static inline __attribute__((always_inline)) void amx_stage(
    struct amx_staged *st, const struct kvrail_attention_args *a, const int32_t *blocks,
    int num_keys, size_t elem_size, int hd) {
    const int bs_shift = __builtin_ctz((unsigned)a->block_size);
    const char *k_cache = a->k_cache, *v_cache = a->v_cache;
    const int from = st->keys & ~(AMX_KEYS - 1);
    const int to = (num_keys + AMX_KEYS - 1) & ~(AMX_KEYS - 1);
    /* vpermt2w indices: words 0-15 (16-31) of two rows interleaved */
    const __m512i first16 = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10,
                                             41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3,
                                             34, 2, 33, 1, 32, 0);
    const __m512i last16 = _mm512_add_epi16(first16, _mm512_set1_epi16(16));
    int64_t offset[AMX_KEYS]; /* bytes from the cache's start to the key's row of head g */
    for (int t0 = from; t0 < to; t0 += AMX_KEYS) {
        for (int t = 0; t < AMX_KEYS; t++)
            offset[t] = t0 + t < num_keys ? (row_offset(blocks, bs_shift, t0 + t) *
                                                 a->num_kv_heads + st->g) * hd * (int64_t)elem_size
                                          : -1;
        for (int t = 0; t < AMX_KEYS; t += 16)
            for (int s = 0; s < hd / 32; s++) {
                __m512 r[16];
                for (int u = 0; u < 16; u++)
                    r[u] = offset[t + u] < 0 ? _mm512_setzero_ps()
                                             : _mm512_castsi512_ps(load32_cache(
                                                   k_cache + offset[t + u] + 32 * s * elem_size,
                                                   elem_size));
                transpose16(r);
                uint32_t *kt = st->kt + ((int64_t)(t0 + t) / 16 * (hd / 32) + s) * 256;
                for (int p = 0; p < 16; p++) _mm512_store_ps((float *)(kt + 16 * p), r[p]);
            }
        for (int t = 0; t < AMX_KEYS; t += 2)
            for (int s = 0; s < hd / 32; s++) {
                __m512i r[2];
                for (int u = 0; u < 2; u++)
                    r[u] = offset[t + u] < 0
                               ? _mm512_setzero_si512()
                               : load32_cache(v_cache + offset[t + u] + 32 * s * elem_size,
                                              elem_size);
                uint32_t *vp = st->vp + ((int64_t)(t0 + t) / 32 * (hd / 16) + 2 * s) * 256 +
                               (t % 32) / 2 * 16;
                _mm512_store_si512(vp, _mm512_permutex2var_epi16(r[0], first16, r[1]));
                _mm512_store_si512(vp + 256, _mm512_permutex2var_epi16(r[0], last16, r[1]));
            }
    }
    st->keys = num_keys;
}

static inline __attribute__((always_inline)) void prefill_amx(
    const struct kvrail_attention_args *a, int tid, int num_threads, size_t elem_size, int hd) {
    const uint16_t *q = a->q;
    uint16_t *out = a->out;
    const int num_heads = (int)a->num_heads, group = num_heads / (int)a->num_kv_heads;
    const float unit = cache_operand_unit(elem_size);
    const __m512 score_scale = _mm512_set1_ps(a->scale * a->k_scale * unit);
    /* Room for the longest context of the call, in keys (a multiple of AMX_KEYS). */
    int64_t cap = AMX_KEYS;
    for (int64_t n = 0; n < a->num_requests; n++) {
        const int64_t len = (a->seq_lens[a->req_indices[n]] + AMX_KEYS - 1) & ~(AMX_KEYS - 1);
        cap = len > cap ? len : cap;
    }
    struct amx_staged st = {.n = -1, .kt = aligned_alloc(64, (size_t)(cap * hd * 2)),
                            .vp = aligned_alloc(64, (size_t)(cap * hd * 2))};
    float *s = aligned_alloc(64, (size_t)(16 * cap * 4));       /* [16][cap] scores */
    uint16_t *pw = aligned_alloc(64, (size_t)(16 * cap * 2));   /* [16][cap] bf16 weights */
    uint16_t qa[4][16][32] __attribute__((aligned(64)));        /* A tiles: head_dim <= 128 */
    float o[16][64] __attribute__((aligned(64)));
    amx_load_config(16);
    for (struct prefill_item it = {0}; next_prefill_item(a, tid, num_threads, 16, &it);) {
        const int start = it.start, i0 = it.q0, nq = it.nq;
        const int num_keys = start + i0 + nq; /* the last query's context */
        const int n32 = (num_keys + 31) & ~31, n64 = (num_keys + 63) & ~63;
        if (st.n != it.n || st.g != it.kv_head) {
            st.n = it.n;
            st.g = it.kv_head;
            st.keys = 0;
        }
        if (st.keys < num_keys)
            amx_stage(&st, a, a->block_table + it.req * a->stride_bt, num_keys, elem_size, hd);
        for (int j = 0; j < group; j++) {
            const int64_t head = (int64_t)it.kv_head * group + j;
            /* Row i of the A tiles: query i0 + i (zeros past nq), 32 dimensions a tile. */
            for (int i = 0; i < 16; i++)
                for (int c = 0; c < hd / 32; c++)
                    _mm512_store_si512(
                        qa[c][i], i < nq ? cache_operand_bf16(
                                               _mm512_loadu_si512(
                                                   q + (it.first + i0 + i) * a->stride_q +
                                                   head * hd + 32 * c),
                                               elem_size)
                                         : _mm512_setzero_si512());
            for (int t0 = 0; t0 < n64; t0 += AMX_KEYS) { /* S = Q K^T */
                const uint32_t *kt = st.kt + (int64_t)t0 / 16 * (hd / 32) * 256;
                const int64_t tile = (hd / 32) * 256; /* dwords between key tiles */
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int c = 0; c < hd / 32; c++) {
                    _tile_loadd(4, qa[c], 64);
                    _tile_loadd(6, kt + c * 256, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_loadd(7, kt + tile + c * 256, 64);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_loadd(6, kt + 2 * tile + c * 256, 64);
                    _tile_dpbf16ps(2, 4, 6);
                    _tile_loadd(7, kt + 3 * tile + c * 256, 64);
                    _tile_dpbf16ps(3, 4, 7);
                }
                _tile_stored(0, s + t0, cap * 4);
                _tile_stored(1, s + t0 + 16, cap * 4);
                _tile_stored(2, s + t0 + 32, cap * 4);
                _tile_stored(3, s + t0 + 48, cap * 4);
            }
            float inv[16]; /* v_scale (and the cache's unit) / the row's sum */
            for (int i = 0; i < 16; i++) { /* query i sees keys [0, start + i0 + i] */
                const float *si = s + i * cap;
                uint16_t *pi = pw + i * cap;
                const int seen = i < nq ? start + i0 + i + 1 : 0;
                __m512 row_max = _mm512_set1_ps(-FLT_MAX);
                for (int t = 0; t < seen; t += 16)
                    row_max = _mm512_mask_max_ps(row_max, lanes_below(seen - t), row_max,
                                                 _mm512_load_ps(si + t));
                const __m512 m = _mm512_mul_ps(_mm512_set1_ps(_mm512_reduce_max_ps(row_max)),
                                               score_scale);
                __m512 sum = _mm512_setzero_ps();
                for (int t = 0; t < n32; t += 16) {
                    const __m512 p = _mm512_maskz_mov_ps(
                        lanes_below(seen - t),
                        exp16(_mm512_fmsub_ps(_mm512_load_ps(si + t), score_scale, m)));
                    sum = _mm512_add_ps(sum, p);
                    _mm256_store_si256((__m256i *)(pi + t),
                                       (__m256i)_mm512_cvtneps_pbh(cache_operand(p, elem_size)));
                }
                inv[i] = seen ? a->v_scale * unit / _mm512_reduce_add_ps(sum) : 0.0f;
            }
            for (int d0 = 0; d0 < hd; d0 += 64) { /* O = P V, dimensions d0 .. d0 + 63 */
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int t0 = 0; t0 < n32; t0 += 32) {
                    const uint32_t *vp = st.vp + ((int64_t)t0 / 32 * (hd / 16) + d0 / 16) * 256;
                    _tile_loadd(4, pw + t0, cap * 2);
                    _tile_loadd(6, vp, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_loadd(7, vp + 256, 64);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_loadd(6, vp + 512, 64);
                    _tile_dpbf16ps(2, 4, 6);
                    _tile_loadd(7, vp + 768, 64);
                    _tile_dpbf16ps(3, 4, 7);
                }
                _tile_stored(0, o[0], 256);
                _tile_stored(1, o[0] + 16, 256);
                _tile_stored(2, o[0] + 32, 256);
                _tile_stored(3, o[0] + 48, 256);
                for (int i = 0; i < nq; i++) {
                    uint16_t *y = out + ((it.first + i0 + i) * num_heads + head) * hd + d0;
                    const __m512 scale = _mm512_set1_ps(inv[i]);
                    for (int c = 0; c < 64; c += 32)
                        _mm512_storeu_si512(
                            y + c, (__m512i)_mm512_cvtne2ps_pbh(
                                       _mm512_mul_ps(_mm512_load_ps(o[i] + c + 16), scale),
                                       _mm512_mul_ps(_mm512_load_ps(o[i] + c), scale)));
                }
            }
        }
    }
    _tile_release();
    free(st.kt);
    free(st.vp);
    free(s);
    free(pw);
}

/* Instances for a bf16 and an fp8 cache: 0 where the tile unit cannot run them. */
#define DEFINE_PREFILL_AMX(NAME, ELEM_SIZE)                                                        \
static int NAME(const struct kvrail_attention_args *a, int tid, int num_threads) {                \
    if (!amx_usable()) return 0;                                                                   \
    if (a->head_dim == 64)                                                                         \
        prefill_amx(a, tid, num_threads, ELEM_SIZE, 64);                                           \
    else if (a->head_dim == 128)                                                                   \
        prefill_amx(a, tid, num_threads, ELEM_SIZE, 128);                                          \
    else                                                                                           \
        return 0;                                                                                  \
    return 1;                                                                                      \
}
DEFINE_PREFILL_AMX(prefill_amx_bf16, 2)
DEFINE_PREFILL_AMX(prefill_amx_fp8, 1)
#endif
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
/* With AVX2 and a float32 query, the same flash attention transposed, as the AVX512-BF16
 * variant above: an item's vectors hold query rows of one head (8 tokens each, two vectors for
 * its 16 tokens), not keys, so nothing is reduced across lanes. Scores of SCORE_KEYS keys x 16
 * rows are 12 independent FMA chains over head_dim (each key's k[d] broadcast from the cache, or
 * from the tile's fp32 copy of an fp8 cache); the running maxima, sums and softmax weights are
 * vectors (exp8 of cpu_common.h, no libm call per row); P . V takes 4 dimensions x 16 rows at a
 * time, 8 chains, over the tile's keys (v_t[d] broadcast). An FMA pairs with 2/3 (scores) or
 * 3/4 (P . V) of a load, where the tiles of 8 keys above broadcast a query element for each
 * one and keep 4 chains.
 * Measured on the project's 2-vCPU AVX2 EPYC against those tiles, the two libraries in turn in
 * one process, twice (`python -m benchmarks.attention_kernels --baseline-ref <before>
 * --prompt-lens 128,512`, `results/attention_kernels-avx2-prefill-transposed.md`): prompts 4 x
 * 512 0.56-0.57x the time (40 -> 70 GFLOP/s), 4 x 128 0.64-0.69x. An item costs 16 rows
 * however few queries it has: 5 queries over 400 cached tokens 1.6-1.7x the time, 8 queries
 * 1.1-1.2x, but the engine sends up to MAX_DECODE_QUERY_LEN (9) queries to the decode kernel. */
#define ROWS 16 /* query tokens of an item: two vectors of 8 */
#define KEYS 24 /* keys of a tile */
/* Keys scored at a time: 6 x 2 accumulators, 2 query vectors and a broadcast of the 16
 * registers. Against 4 keys at a time (tiles of 16, or 32), same machine, the two libraries in
 * turn, 3 runs (`results/attention_kernels-avx2-prefill-6keys.md`): prompts 0.88-0.97x the
 * time (4 x 512 at 71-94 -> 76-107 GFLOP/s as the host's speed moved). */
#define SCORE_KEYS 6

#define DEFINE_PREFILL_AVX2(NAME, C, LOAD_C, HEAD_DIM)                                             \
static void NAME(const struct kvrail_attention_args *a, int tid, int num_threads) {                \
    const float *q = a->q;                                                                         \
    const C *k_cache = a->k_cache, *v_cache = a->v_cache;                                          \
    const int num_heads = (int)a->num_heads, num_kv = (int)a->num_kv_heads;                        \
    const int hd = HEAD_DIM, group = num_heads / num_kv;                                           \
    const int64_t stride_slot = (int64_t)num_kv * hd;                                              \
    const int bs_shift = __builtin_ctz((unsigned)a->block_size);                                   \
    const float q_scale = a->scale * a->k_scale;                                                   \
    /* Per thread: the item's queries transposed, qt[head][d][2] (vector h: tokens 8h..8h+7), */   \
    /* its outputs ot[head][d][2], running maxima and sums m, l[head][2]; the tile's scores */     \
    /* (then weights) of one head, and with an fp8 cache its keys and values in fp32. */           \
    __m256 *qt = aligned_alloc(32, sizeof(__m256) * (size_t)(group * hd * 2));                     \
    __m256 *ot = aligned_alloc(32, sizeof(__m256) * (size_t)(group * hd * 2));                     \
    __m256 *m = aligned_alloc(32, sizeof(__m256) * (size_t)(group * 2));                           \
    __m256 *l = aligned_alloc(32, sizeof(__m256) * (size_t)(group * 2));                           \
    __m256 s[KEYS][2];                                                                             \
    float kf[KEYS][HEAD_DIM] __attribute__((aligned(32)));                                         \
    float vf[KEYS][HEAD_DIM] __attribute__((aligned(32)));                                         \
    static const float zero_row[HEAD_DIM] __attribute__((aligned(32)));                            \
    for (struct prefill_item it = {0}; next_prefill_item(a, tid, num_threads, ROWS, &it);) {       \
        const int64_t first = it.first;                                                            \
        const int start = it.start, g = it.kv_head, i0 = it.q0, nq = it.nq;                        \
        const int32_t *blocks = a->block_table + it.req * a->stride_bt;                            \
        /* Lane i of vector h: query token i0 + 8h + i at position start + i0 + 8h + i; lanes */   \
        /* past nq are padding (position -1: every key masked; their outputs are not stored). */   \
        __m256i pos[2];                                                                            \
        for (int h = 0; h < 2; h++) {                                                              \
            const __m256i lane = _mm256_setr_epi32(8 * h, 8 * h + 1, 8 * h + 2, 8 * h + 3,         \
                                                   8 * h + 4, 8 * h + 5, 8 * h + 6, 8 * h + 7);    \
            pos[h] = _mm256_blendv_epi8(_mm256_set1_epi32(-1),                                     \
                                        _mm256_add_epi32(lane, _mm256_set1_epi32(start + i0)),     \
                                        _mm256_cmpgt_epi32(_mm256_set1_epi32(nq), lane));          \
        }                                                                                          \
        for (int j = 0; j < group; j++) {                                                          \
            float *qj = (float *)(qt + j * hd * 2);                                                \
            for (int i = 0; i < ROWS; i++) {                                                       \
                const float *src = q + (first + i0 + i) * a->stride_q + (g * group + j) * hd;      \
                for (int d = 0; d < hd; d++)                                                       \
                    qj[d * ROWS + i] = i < nq ? src[d] * q_scale : 0.0f;                           \
            }                                                                                      \
            for (int h = 0; h < 2; h++) {                                                          \
                m[j * 2 + h] = _mm256_set1_ps(-FLT_MAX);                                           \
                l[j * 2 + h] = _mm256_setzero_ps();                                                \
            }                                                                                      \
            for (int e = 0; e < hd * 2; e++) ot[j * hd * 2 + e] = _mm256_setzero_ps();             \
        }                                                                                          \
        const int num_keys = start + i0 + nq; /* the last query's context */                       \
        for (int t0 = 0; t0 < num_keys; t0 += KEYS) {                                              \
            const int nk = num_keys - t0 < KEYS ? num_keys - t0 : KEYS;                            \
            const float *krow[KEYS], *vrow[KEYS];                                                  \
            for (int t = 0; t < KEYS; t++) {                                                       \
                if (t >= nk) { /* past the context: zeros, masked below */                         \
                    krow[t] = vrow[t] = zero_row;                                                  \
                    continue;                                                                      \
                }                                                                                  \
                const int key = t0 + t;                                                            \
                const int64_t slot = row_offset(blocks, bs_shift, key);                            \
                const C *k = k_cache + slot * stride_slot + g * hd;                                \
                const C *v = v_cache + slot * stride_slot + g * hd;                                \
                if (sizeof(C) == 4) { /* fp32: read in place */                                    \
                    krow[t] = (const float *)k;                                                    \
                    vrow[t] = (const float *)v;                                                    \
                } else {                                                                           \
                    for (int d = 0; d < hd; d++) kf[t][d] = LOAD_C(k + d);                         \
                    for (int d = 0; d < hd; d++) vf[t][d] = LOAD_C(v + d);                         \
                    krow[t] = kf[t];                                                               \
                    vrow[t] = vf[t];                                                               \
                }                                                                                  \
            }                                                                                      \
            /* Keys at or past a row's position + 1 are out (and padding rows see none). */        \
            const int masked = t0 + KEYS > start + i0;                                             \
            for (int j = 0; j < group; j++) {                                                      \
                const __m256 *qj = qt + j * hd * 2;                                                \
                for (int t = 0; t < KEYS; t += SCORE_KEYS) {                                       \
                    __m256 acc[SCORE_KEYS][2];                                                     \
                    for (int u = 0; u < SCORE_KEYS; u++)                                           \
                        acc[u][0] = acc[u][1] = _mm256_setzero_ps();                               \
                    for (int d = 0; d < hd; d++)                                                   \
                        for (int u = 0; u < SCORE_KEYS; u++) {                                     \
                            const __m256 kd = _mm256_broadcast_ss(krow[t + u] + d);                \
                            acc[u][0] = _mm256_fmadd_ps(qj[2 * d], kd, acc[u][0]);                 \
                            acc[u][1] = _mm256_fmadd_ps(qj[2 * d + 1], kd, acc[u][1]);             \
                        }                                                                          \
                    for (int u = 0; u < SCORE_KEYS; u++) {                                         \
                        s[t + u][0] = acc[u][0];                                                   \
                        s[t + u][1] = acc[u][1];                                                   \
                    }                                                                              \
                }                                                                                  \
                __m256 alpha[2];                                                                   \
                for (int h = 0; h < 2; h++) {                                                      \
                    __m256 tile_max = m[j * 2 + h];                                                \
                    for (int t = 0; t < KEYS; t++) {                                               \
                        if (masked)                                                                \
                            s[t][h] = _mm256_blendv_ps(                                            \
                                _mm256_set1_ps(-FLT_MAX), s[t][h],                                 \
                                _mm256_castsi256_ps(_mm256_cmpgt_epi32(                            \
                                    pos[h], _mm256_set1_epi32(t0 + t - 1))));                      \
                        tile_max = _mm256_max_ps(tile_max, s[t][h]);                               \
                    }                                                                              \
                    alpha[h] = exp8(_mm256_sub_ps(m[j * 2 + h], tile_max));                        \
                    m[j * 2 + h] = tile_max;                                                       \
                    __m256 sum = _mm256_setzero_ps();                                              \
                    for (int t = 0; t < KEYS; t++) {                                               \
                        s[t][h] = exp8(_mm256_sub_ps(s[t][h], tile_max));                          \
                        sum = _mm256_add_ps(sum, s[t][h]);                                         \
                    }                                                                              \
                    l[j * 2 + h] = _mm256_fmadd_ps(l[j * 2 + h], alpha[h], sum);                   \
                }                                                                                  \
                __m256 *oj = ot + j * hd * 2;                                                      \
                for (int d = 0; d < hd; d += 4) {                                                  \
                    __m256 acc[4][2];                                                              \
                    for (int u = 0; u < 4; u++)                                                    \
                        for (int h = 0; h < 2; h++)                                                \
                            acc[u][h] = _mm256_mul_ps(oj[2 * (d + u) + h], alpha[h]);              \
                    for (int t = 0; t < nk; t++)                                                   \
                        for (int u = 0; u < 4; u++) {                                              \
                            const __m256 vd = _mm256_broadcast_ss(vrow[t] + d + u);                \
                            acc[u][0] = _mm256_fmadd_ps(s[t][0], vd, acc[u][0]);                   \
                            acc[u][1] = _mm256_fmadd_ps(s[t][1], vd, acc[u][1]);                   \
                        }                                                                          \
                    for (int u = 0; u < 4; u++)                                                    \
                        for (int h = 0; h < 2; h++) oj[2 * (d + u) + h] = acc[u][h];               \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int j = 0; j < group; j++) {                                                          \
            float res[HEAD_DIM][ROWS] __attribute__((aligned(32)));                                \
            for (int h = 0; h < 2; h++) {                                                          \
                /* l > 0 for every real row: its own position's key is seen */                     \
                const __m256 inv = _mm256_div_ps(_mm256_set1_ps(a->v_scale), l[j * 2 + h]);        \
                for (int d = 0; d < hd; d++)                                                       \
                    _mm256_store_ps(res[d] + 8 * h,                                                \
                                    _mm256_mul_ps(ot[(j * hd + d) * 2 + h], inv));                 \
            }                                                                                      \
            for (int i = 0; i < nq; i++) {                                                         \
                float *dst = (float *)a->out                                                       \
                             + ((first + i0 + i) * num_heads + g * group + j) * hd;                \
                for (int d = 0; d < hd; d++) dst[d] = res[d][i];                                   \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    free(qt);                                                                                      \
    free(ot);                                                                                      \
    free(m);                                                                                       \
    free(l);                                                                                       \
}

DEFINE_64_AND_128(DEFINE_PREFILL_AVX2, prefill_avx2_f32, float, load_f32)
DEFINE_64_AND_128(DEFINE_PREFILL_AVX2, prefill_avx2_bf16, uint16_t, load_bf16)
DEFINE_64_AND_128(DEFINE_PREFILL_AVX2, prefill_avx2_fp8, uint8_t, load_e4m3)
#endif

/* The cache holds q's dtype, bfloat16 under a float32 q, or fp8 (the launcher checks). */
void kvrail_prefill_attention(const struct kvrail_attention_args *a, int tid,
                              int num_threads) {
    const int bf16 = a->q_dtype == KVRAIL_BF16;
    const int cache = (int)a->cache_dtype;
#ifdef KVRAIL_AMX_BF16
    if (bf16 && (cache == KVRAIL_FP8_E4M3 ? prefill_amx_fp8(a, tid, num_threads)
                                          : prefill_amx_bf16(a, tid, num_threads)))
        return;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (bf16 && (cache == KVRAIL_FP8_E4M3 ? prefill_dpbf16_fp8(a, tid, num_threads)
                                          : prefill_dpbf16_bf16(a, tid, num_threads)))
        return;
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    if (!bf16 && (cache == KVRAIL_FP8_E4M3 ? prefill_avx2_fp8(a, tid, num_threads)
                  : cache == KVRAIL_BF16   ? prefill_avx2_bf16(a, tid, num_threads)
                                           : prefill_avx2_f32(a, tid, num_threads)))
        return;
#endif
    if (cache == KVRAIL_FP8_E4M3)
        bf16 ? prefill_bf16_fp8(a, tid, num_threads) : prefill_f32_fp8(a, tid, num_threads);
    else if (bf16)
        prefill_bf16(a, tid, num_threads);
    else
        cache == KVRAIL_BF16 ? prefill_f32_bf16(a, tid, num_threads) : prefill_f32(a, tid, num_threads);
}
