/* Paged decode attention on the CPU: a few query tokens per sequence (one for a decode; a
 * speculative verify step's 1 + drafts), read straight from the paged KV cache through the block
 * table (a team kernel, cpu_common.h).
 *
 * The torch path gathers every sequence's K and V into a padded copy per layer and then
 * runs SDPA over it: three passes over the context. Here each sequence reads its K once
 * (scores), then its V once (weighted sum), block by block, with no copy and no padding.
 * Work is split by query (`next_item`): a token's K (and V) rows of all kv heads are one
 * contiguous run, so each block streams through once and each row serves its GQA group; a
 * request's further queries find its context in L2. With few queries, by kv head instead.
 *
 * Reading the context is what costs (measured: the same work took 27 ms over sequential
 * blocks and 61 ms over scattered ones), so rows two blocks ahead are prefetched while this
 * block is used, and head sizes 64 and 128 get instances where the inner loops have a constant
 * length.
 *
 * The cache holds float32, bfloat16 or fp8 e4m3 (then with per-layer scales: k_scale is
 * folded into the query's scaling, v_scale into the output); q and out are float32 or
 * bfloat16 (a bf16 query reads no fp32 cache). Accumulation is fp32 whatever the storage
 * type; an empty context gives zeros.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

/* Work items: one query of a request and a range of its kv heads. Query i of a request's q_len
 * sits at position seq_len - q_len + i and attends to the context up to it, computed exactly as
 * that token's own decode step computes it (the same code over the same context length): a
 * row's output does not depend on what else its step holds, so a speculative verify step
 * scores its drafts bit for bit as plain decode steps would (and `cpu_backend` sends requests
 * of up to MAX_DECODE_QUERY_LEN queries here). Each thread takes a contiguous run of items
 * holding its share of the step's work (an item weighs its context length times its kv heads,
 * plus one), the item going to the thread whose share holds its middle: dealt out in turn
 * instead, the full workload's contexts left one thread 2.5-8% more work than the other at
 * decode steps 40-180 (computed from its lengths), which the other spent waiting at the
 * barrier. With fewer queries than two per thread, an item is one kv head (each head's sums
 * are its own, so the results are the same), so that one stream's decode uses every thread. */
struct decode_item {
    int64_t n, work;  /* where the walk is: request n of req_indices, work passed */
    int i, g;         /* its query, and the next kv head */
    int req, seq_len; /* the item: request, its query's context length, */
    int g_begin, g_end; /* kv heads [g_begin, g_end), */
    int64_t row;      /* and the query's row of q and out */
    int heads;        /* kv heads per item */
    int64_t total;    /* the step's work */
};

/* The walk's start: before any item, with the step's item size and total work. */
static struct decode_item first_item(const struct kvrail_attention_args *a, int num_threads) {
    int64_t num_queries = 0, total = 0;
    for (int64_t n = 0; n < a->num_requests; n++) {
        const int req = a->req_indices[n];
        const int q_len = (int)(a->query_start_loc[req + 1] - a->query_start_loc[req]);
        num_queries += q_len;
        for (int i = 0; i < q_len; i++) total += a->seq_lens[req] - q_len + 1 + i;
    }
    const int heads = num_queries < 2 * num_threads ? 1 : (int)a->num_kv_heads;
    const int num_kv = (int)a->num_kv_heads, items_per_query = (num_kv + heads - 1) / heads;
    return (struct decode_item){.heads = heads,
                                .total = total * num_kv + num_queries * items_per_query};
}

/* Moves `it` to this thread's next item; 0 when there is none. */
static int next_item(const struct kvrail_attention_args *a, int tid, int num_threads,
                     struct decode_item *it) {
    const int num_kv = (int)a->num_kv_heads;
    for (; it->n < a->num_requests; it->n++, it->i = 0) {
        const int req = a->req_indices[it->n];
        const int64_t first = a->query_start_loc[req];
        const int q_len = (int)(a->query_start_loc[req + 1] - first);
        for (; it->i < q_len; it->i++, it->g = 0)
            while (it->g < num_kv) {
                const int g = it->g, seq_len = a->seq_lens[req] - q_len + 1 + it->i;
                it->g += it->heads;
                const int g_end = it->g < num_kv ? it->g : num_kv;
                const int64_t weight = (int64_t)seq_len * (g_end - g) + 1;
                const int64_t middle = it->work + weight / 2;
                it->work += weight;
                if (middle * num_threads / it->total != tid) continue;
                it->req = req;
                it->row = first + it->i;
                it->seq_len = seq_len;
                it->g_begin = g;
                it->g_end = g_end;
                return 1;
            }
    }
    return 0;
}

/* The longest context among the requests attended: the per-thread score buffers' size. */
static int longest_context(const struct kvrail_attention_args *a) {
    int longest = 0;
    for (int64_t i = 0; i < a->num_requests; i++) {
        const int len = a->seq_lens[a->req_indices[i]];
        longest = len > longest ? len : longest;
    }
    return longest;
}

/* Blocks sit anywhere in the pool, and the hardware prefetcher, which follows sequential runs,
 * stalls at each block boundary; so while pass 1 reads row t of K, it asks for row t of the
 * block two ahead, and for row t of V (for pass 2), both into L2. One row at a time: a whole
 * block asked for at once (96 lines of a bf16 SmolLM2 block) fills the core's miss buffers and
 * the prefetch instructions themselves stall (perf: 24% of the kernel's cycles on them).
 * Measured on the project's 2-vCPU AVX512-BF16 EPYC, 48 sequences of 256-640 tokens, 9 query
 * and 3 kv heads of 64, 30 layers, 2 threads, whole blocks one ahead -> rows two ahead: bf16
 * query and cache (AVX512-BF16 path) 40.9 -> 32.5 ms, fp32 query and cache (AVX-512 path)
 * 69.8 -> 59.0 ms, portable path with a bf16 cache 55.6 -> 37.8 ms. K asked into L2
 * (prefetcht1) rather than L1 (prefetcht0), same machine, 128 decodes over 400 tokens, the two
 * builds in turn in one process: the AVX-512 path with an fp32 cache 29.5 -> 23.6 us a
 * sequence (the AVX512-BF16 path: see there). On the 2-vCPU AVX2 EPYC, the AVX2 path with an
 * fp32 cache, 128 decodes over 400 tokens of 8 layers from DRAM, the library of ac63107 against
 * 6ead788's in turn (`benchmarks.attention_kernels --baseline-ref 6ead788`,
 * `results/attention_kernels-avx2-prefetch.md`): 5.88 -> 4.06 ms a layer (13.4 -> 19.4 GB/s);
 * cache-resident cases within 0.92-1.09x (noise). */
/* always_inline: a prefetch has no effect GCC counts, so a call left out of line is deleted
 * as one without side effects (gcc 12: no prefetch survived). Bytes [begin, end) of a K row
 * (none if NULL) and of a V row (none if NULL). */
static inline __attribute__((always_inline)) void prefetch_row_bytes(const char *k, const char *v,
                                                                     int64_t begin, int64_t end) {
    if (k)
        for (int64_t i = begin; i < end; i += 64) __builtin_prefetch(k + i, 0, 2);
    if (v)
        for (int64_t i = begin; i < end; i += 64) __builtin_prefetch(v + i, 0, 2);
}

static inline __attribute__((always_inline)) void prefetch_rows(
    const struct kvrail_attention_args *a, const int32_t *blocks, int t, int seq_len,
    int64_t row_bytes, int64_t begin, int64_t end) { /* the item's bytes of a row */
    const int block_size = (int)a->block_size, b = t / block_size, o = t - b * block_size;
    const int64_t k_slot = t + 2 * block_size < seq_len ? (int64_t)blocks[b + 2] * block_size + o
                                                         : -1; /* none past the table */
    const char *v = (const char *)a->v_cache + ((int64_t)blocks[b] * block_size + o) * row_bytes;
    prefetch_row_bytes(k_slot < 0 ? NULL : (const char *)a->k_cache + k_slot * row_bytes, v,
                       begin, end);
}

/* Softmax weights of one head's scores, unnormalized, in place (exp(s - max)); returns their
 * sum, which the caller divides by once at the end. */
static inline float softmax_unnormalized(float *scores, int seq_len) {
    float row_max = -FLT_MAX, sum = 0.0f; /* finite: built with -ffast-math */
    for (int t = 0; t < seq_len; t++) row_max = scores[t] > row_max ? scores[t] : row_max;
#pragma omp simd reduction(+ : sum) /* vector expf from libmvec */
    for (int t = 0; t < seq_len; t++) {
        scores[t] = expf(scores[t] - row_max);
        sum += scores[t];
    }
    return sum;
}

#define DEFINE_DECODE(NAME, T, LOAD_Q, C, LOAD_C, HEAD_DIM)                                        \
static void NAME(const struct kvrail_attention_args *a, int tid, int num_threads) {                \
    const T *q = a->q;                                                                             \
    const C *k_cache = a->k_cache, *v_cache = a->v_cache;                                          \
    const int num_heads = (int)a->num_heads, block_size = (int)a->block_size;                      \
    const int hd = HEAD_DIM ? HEAD_DIM : (int)a->head_dim;                                         \
    const int group = num_heads / (int)a->num_kv_heads;                                            \
    const int64_t stride_slot = a->num_kv_heads * hd;                                              \
    const int64_t row_bytes = stride_slot * (int64_t)sizeof(C);                                    \
    const float q_scale = a->scale * a->k_scale;                                                   \
    const int max_seq_len = longest_context(a);                                                    \
    /* Per thread: scores [num_heads][max_seq_len] (+1: never a zero-size malloc), q and acc  */   \
    /* [num_heads][head_dim], each head's softmax sum. */                                          \
    float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)(max_seq_len + 1));         \
    float *qf = malloc(sizeof(float) * (size_t)num_heads * (size_t)hd);                            \
    float *acc = malloc(sizeof(float) * (size_t)num_heads * (size_t)hd);                           \
    float *sums = malloc(sizeof(float) * (size_t)num_heads);                                       \
    for (struct decode_item it = first_item(a, num_threads);                                       \
         next_item(a, tid, num_threads, &it);) {                                                   \
        const int seq_len = it.seq_len, h0 = it.g_begin * group, h1 = it.g_end * group;            \
        const int32_t *blocks = a->block_table + it.req * a->stride_bt;                            \
        const int64_t row = it.row;                                                                \
        for (int j = h0 * hd; j < h1 * hd; j++) {                                                  \
            qf[j] = LOAD_Q(q + row * a->stride_q + j) * q_scale;                                   \
            acc[j] = 0.0f;                                                                         \
        }                                                                                          \
        /* Pass 1: scores = q . k. A token's K rows of all kv heads are one contiguous  */         \
        /* run, so the block is read as a stream and each row serves its GQA group. */             \
        for (int t = 0; t < seq_len; t++) {                                                        \
            prefetch_rows(a, blocks, t, seq_len, row_bytes, it.g_begin * hd * (int64_t)sizeof(C),  \
                          it.g_end * hd * (int64_t)sizeof(C));                                     \
            const C *k = k_cache + ((int64_t)blocks[t / block_size] * block_size                   \
                                    + t % block_size) * stride_slot;                               \
            for (int h = h0; h < h1; h++) {                                                        \
                const C *kh = k + (h / group) * hd;                                                \
                const float *qh = qf + h * hd;                                                     \
                float dot = 0.0f;                                                                  \
                _Pragma("omp simd reduction(+:dot)")                                               \
                for (int d = 0; d < hd; d++) dot += qh[d] * LOAD_C(kh + d);                        \
                scores[(int64_t)h * max_seq_len + t] = dot;                                        \
            }                                                                                      \
        }                                                                                          \
        /* Softmax weights, unnormalized; each head's sum divides once at the end. */              \
        for (int h = h0; h < h1; h++) {                                                            \
            float *sh = scores + (int64_t)h * max_seq_len;                                         \
            const float sum = softmax_unnormalized(sh, seq_len);                                   \
            sums[h] = sum;                                                                         \
        }                                                                                          \
        /* Pass 2: out = sum_t p_t v_t, V streamed the same way as K. */                           \
        for (int t = 0; t < seq_len; t++) {                                                        \
            const C *v = v_cache + ((int64_t)blocks[t / block_size] * block_size                   \
                                    + t % block_size) * stride_slot;                               \
            for (int h = h0; h < h1; h++) {                                                        \
                const C *vh = v + (h / group) * hd;                                                \
                float *ah = acc + h * hd;                                                          \
                const float p = scores[(int64_t)h * max_seq_len + t];                              \
                _Pragma("omp simd")                                                                \
                for (int d = 0; d < hd; d++) ah[d] += p * LOAD_C(vh + d);                          \
            }                                                                                      \
        }                                                                                          \
        for (int h = h0; h < h1; h++) {                                                            \
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

DEFINE_HEAD_DIM_INSTANCES(DEFINE_DECODE, decode_f32, float, load_f32, float, load_f32)
DEFINE_HEAD_DIM_INSTANCES(DEFINE_DECODE, decode_bf16, uint16_t, load_bf16, uint16_t, load_bf16)
DEFINE_HEAD_DIM_INSTANCES(DEFINE_DECODE, decode_f32_bf16, float, load_f32, uint16_t, load_bf16)
DEFINE_HEAD_DIM_INSTANCES(DEFINE_DECODE, decode_f32_fp8, float, load_f32, uint8_t, load_e4m3)
DEFINE_HEAD_DIM_INSTANCES(DEFINE_DECODE, decode_bf16_fp8, uint16_t, load_bf16, uint8_t, load_e4m3)

/* The vector path, for head sizes 64 and 128 (others take the portable one), in AVX-512 or
 * in AVX2 (whichever the build's -march=native has; one template, the vector width a macro):
 * K and V are converted once per kv head rather than once per query head, and CHUNK q.k dot
 * products are summed by one transposing tree instead of CHUNK horizontal sums. Measured on
 * the project's 2-vCPU EPYC, 48 sequences of 256-640 tokens, 9 query and 3 kv heads of 64,
 * 30 layers (KV from DRAM): AVX-512, bf16 cache 51.3 -> 40.3 ms, fp8 cache 55.8 -> 37.9 ms;
 * still under half the memory bandwidth (12.5 of ~30 GB/s), so scores and softmax remain
 * the cost. On the 2-vCPU AVX2 EPYC (benchmarks.attention_kernels, one layer, against the
 * portable path): 128 decodes over 400 tokens from DRAM, fp32 cache 6.1-6.8 -> 6.2-6.5 ms,
 * fp8 cache 12.1-12.7 -> 3.6-4.1 ms; cache-resident, one decode 67-73 -> 58-63 us, a verify
 * step of 5 queries 208-226 -> 149-165 us. */
#if defined(__AVX512F__)
#define CHUNK 16 /* lanes of a vector: tokens per transposing sum, dims per chunk */
#define VEC __m512
#define vec_zero _mm512_setzero_ps
#define vec_set1 _mm512_set1_ps
#define vec_loadu _mm512_loadu_ps
#define vec_storeu _mm512_storeu_ps
#define vec_store _mm512_store_ps
#define vec_mul _mm512_mul_ps
#define vec_fmadd _mm512_fmadd_ps

static inline __m512 vload_f32(const float *p) { return _mm512_loadu_ps(p); }

static inline __m512 vload_bf16(const uint16_t *p) {
    const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
}

#define E4M3_UNIT 1.0f /* vload_e4m3 gives x / E4M3_UNIT */
static inline __m512 vload_e4m3(const uint8_t *p) { /* load_e4m3, 16 at a time */
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
    const __m512i rest = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7f)), 20);
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(sign, rest)),
                         _mm512_set1_ps(0x1p120f));
}

/* r[i] = the sum of v[i]'s 16 lanes: pairs, then quads, then 128-bit blocks transposed. */
static inline __m512 vsum(const __m512 *v) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                                    _mm512_shuffle_f32x4(quads[0], quads[1], 0xee));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xdd));
}

/* Pass 2 (p . V into acc[head][head_dim]) with AVX-512: per kv head, V streams by once while
 * the outputs of up to HEADS_PER_PASS of its query heads stay in registers (4 x head_dim / 16
 * of the 32: independent sums, so the FMAs do not wait on each other). */
#define HEADS_PER_PASS 4
#define DECODE_PASS2(C, VLOAD, HEAD_DIM)                                                           \
    for (int g = g0; g < g1; g++)                                                                  \
        for (int h0 = g * group; h0 < (g + 1) * group; h0 += HEADS_PER_PASS) {                     \
            const int left = (g + 1) * group - h0;                                                 \
            const int nh = left < HEADS_PER_PASS ? left : HEADS_PER_PASS;                          \
            VEC o[HEADS_PER_PASS][HEAD_DIM / CHUNK];                                               \
            for (int j = 0; j < nh; j++)                                                           \
                for (int c = 0; c < nc; c++) o[j][c] = vec_zero();                                 \
            for (int t0 = 0; t0 < seq_len; t0 += block_size) {                                     \
                const C *v = v_cache + (int64_t)blocks[t0 / block_size] * block_size               \
                             * stride_slot + g * hd;                                               \
                const int n = seq_len - t0 < block_size ? seq_len - t0 : block_size;               \
                for (int i = 0; i < n; i++) {                                                      \
                    VEC vc[HEAD_DIM / CHUNK];                                                      \
                    for (int c = 0; c < nc; c++) vc[c] = VLOAD(v + i * stride_slot + c * CHUNK);   \
                    for (int j = 0; j < nh; j++) {                                                 \
                        const VEC p = vec_set1(scores[(h0 + j) * stride_s + t0 + i]);              \
                        for (int c = 0; c < nc; c++) o[j][c] = vec_fmadd(p, vc[c], o[j][c]);       \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            for (int j = 0; j < nh; j++)                                                           \
                for (int c = 0; c < nc; c++) vec_storeu(acc + (h0 + j) * hd + c * CHUNK, o[j][c]); \
        }
#elif defined(__AVX2__) && defined(__FMA__)
#define CHUNK 8
#define VEC __m256
#define vec_zero _mm256_setzero_ps
#define vec_set1 _mm256_set1_ps
#define vec_loadu _mm256_loadu_ps
#define vec_storeu _mm256_storeu_ps
#define vec_store _mm256_store_ps
#define vec_mul _mm256_mul_ps
#define vec_fmadd _mm256_fmadd_ps

static inline __m256 vload_f32(const float *p) { return _mm256_loadu_ps(p); }

static inline __m256 vload_bf16(const uint16_t *p) {
    const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}

/* load_e4m3 / E4M3_UNIT, 8 at a time, through F16C: each byte sign-extended to 16 bits and
 * shifted left by 7 has its sign at bit 15 and its 7 magnitude bits where a half's exponent
 * (bias 15, e4m3's is 7) and mantissa go; bit 14, a copy of the sign, cleared, vcvtph2ps widens
 * it exactly (e4m3 subnormals are half subnormals). 4 instructions where the integer path of
 * load_e4m3 takes 7; the kernels fold E4M3_UNIT into their query and output scales. Measured on
 * the 2-vCPU AVX2 EPYC against the integer path, the two libraries in turn in one process, twice
 * (`benchmarks.attention_kernels --baseline-ref <before>`): 128 decodes over 400 fp8 tokens of 8
 * layers from DRAM 0.61-0.68x the time (2.5 against 4.2 ms a layer, where an fp32 cache takes
 * 5.0: the fp8 path now reads at the fp32 one's rate), one decode 0.70-0.81x. */
#define E4M3_UNIT 0x1p8f
static inline __m256 vload_e4m3(const uint8_t *p) {
    const __m128i x = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(x, 7), _mm_set1_epi16((short)0xbf80)));
}

/* r[i] = the sum of v[i]'s 8 lanes: horizontal adds within 128-bit halves, then the halves. */
static inline __m256 vsum(const __m256 *v) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* Pass 2 (p . V into acc[head][head_dim]) with AVX2: its 16 registers do not hold the outputs
 * of a kv head's query heads (24 for 3 heads of 64), and passes over parts of the head (the
 * AVX-512 way, a few chunks at a time) took 7.4-8.8 ms where this takes 6.2-6.5 (128 decodes
 * over 400 tokens, fp32 cache from DRAM): the outputs accumulate in L1 instead, while each row of
 * V is read once, in order, converted once per kv head. */
#define DECODE_PASS2(C, VLOAD, HEAD_DIM)                                                           \
    for (int j = g0 * group * hd; j < g1 * group * hd; j++) acc[j] = 0.0f;                         \
    for (int t0 = 0; t0 < seq_len; t0 += block_size) {                                             \
        const C *v = v_cache + (int64_t)blocks[t0 / block_size] * block_size * stride_slot;        \
        const int n = seq_len - t0 < block_size ? seq_len - t0 : block_size;                       \
        for (int i = 0; i < n; i++)                                                                \
            for (int g = g0; g < g1; g++) {                                                        \
                VEC vc[HEAD_DIM / CHUNK];                                                          \
                for (int c = 0; c < nc; c++) vc[c] = VLOAD(v + i * stride_slot + g * hd + c * CHUNK); \
                for (int h = g * group; h < (g + 1) * group; h++) {                                \
                    const VEC p = vec_set1(scores[h * stride_s + t0 + i]);                         \
                    float *ah = acc + h * hd;                                                      \
                    for (int c = 0; c < nc; c++)                                                   \
                        vec_storeu(ah + c * CHUNK, vec_fmadd(p, vc[c], vec_loadu(ah + c * CHUNK))); \
                }                                                                                  \
            }                                                                                      \
    }
#endif

#if defined(VEC)

#define DEFINE_DECODE_SIMD(NAME, T, LOAD_Q, C, VLOAD, HEAD_DIM)                                    \
static void NAME(const struct kvrail_attention_args *a, int tid, int num_threads) {                \
    const T *q = a->q;                                                                             \
    const C *k_cache = a->k_cache, *v_cache = a->v_cache;                                          \
    const int num_heads = (int)a->num_heads, num_kv = (int)a->num_kv_heads;                        \
    const int block_size = (int)a->block_size, hd = HEAD_DIM, nc = HEAD_DIM / CHUNK;               \
    const int group = num_heads / num_kv;                                                          \
    const int64_t stride_slot = (int64_t)num_kv * hd;                                              \
    const int64_t row_bytes = stride_slot * (int64_t)sizeof(C);                                    \
    const float unit = sizeof(C) == 1 ? E4M3_UNIT : 1.0f; /* fp8: what VLOAD divided by */         \
    const float q_scale = a->scale * a->k_scale * unit;                                            \
    const int max_seq_len = longest_context(a);                                                    \
    /* Per thread: scores [num_heads][padded length], q, each head's CHUNK partial dots and */     \
    /* its outputs. */                                                                             \
    const int64_t stride_s = (max_seq_len + CHUNK - 1) / CHUNK * CHUNK + CHUNK;                    \
    float *scores = aligned_alloc(64, sizeof(float) * (size_t)(num_heads * stride_s));             \
    float *qf = aligned_alloc(64, sizeof(float) * (size_t)(num_heads * hd));                       \
    VEC *part = aligned_alloc(64, sizeof(VEC) * (size_t)(num_heads * CHUNK));                      \
    float *acc = aligned_alloc(64, sizeof(float) * (size_t)(num_heads * hd));                      \
    for (struct decode_item it = first_item(a, num_threads);                                       \
         next_item(a, tid, num_threads, &it);) {                                                   \
        const int seq_len = it.seq_len, g0 = it.g_begin, g1 = it.g_end;                            \
        const int32_t *blocks = a->block_table + it.req * a->stride_bt;                            \
        const int64_t row = it.row;                                                                \
        for (int j = g0 * group * hd; j < g1 * group * hd; j++)                                    \
            qf[j] = LOAD_Q(q + row * a->stride_q + j) * q_scale;                                   \
        /* Pass 1: scores of CHUNK tokens at a time (positions of a block: no division). */        \
        for (int t0 = 0; t0 < seq_len; t0 += CHUNK) {                                              \
            const int n = seq_len - t0 < CHUNK ? seq_len - t0 : CHUNK;                             \
            for (int i = 0; i < n; i++) {                                                          \
                const int t = t0 + i, b = t / block_size, o = t - b * block_size;                  \
                prefetch_rows(a, blocks, t, seq_len, row_bytes, g0 * hd * (int64_t)sizeof(C),      \
                              g1 * hd * (int64_t)sizeof(C));                                       \
                const C *k = k_cache + ((int64_t)blocks[b] * block_size + o) * stride_slot;        \
                for (int g = g0; g < g1; g++) {                                                    \
                    VEC kc[HEAD_DIM / CHUNK];                                                      \
                    for (int c = 0; c < nc; c++) kc[c] = VLOAD(k + g * hd + c * CHUNK);            \
                    for (int h = g * group; h < (g + 1) * group; h++) {                            \
                        const float *qh = qf + h * hd;                                             \
                        VEC dot = vec_mul(vec_loadu(qh), kc[0]);                                   \
                        for (int c = 1; c < nc; c++)                                               \
                            dot = vec_fmadd(vec_loadu(qh + c * CHUNK), kc[c], dot);                \
                        part[h * CHUNK + i] = dot;                                                 \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            for (int h = g0 * group; h < g1 * group; h++) {                                        \
                for (int i = n; i < CHUNK; i++) part[h * CHUNK + i] = vec_zero();                  \
                vec_store(scores + h * stride_s + t0, vsum(part + h * CHUNK));                     \
            }                                                                                      \
        }                                                                                          \
        /* Softmax weights, unnormalized; each head's sum divides once at the end. */              \
        float inv[num_heads];                                                                      \
        for (int h = g0 * group; h < g1 * group; h++) {                                            \
            float *sh = scores + h * stride_s;                                                     \
            const float sum = softmax_unnormalized(sh, seq_len);                                   \
            inv[h] = seq_len > 0 ? a->v_scale * unit / sum : 0.0f;                                 \
        }                                                                                          \
        DECODE_PASS2(C, VLOAD, HEAD_DIM)                                                           \
        for (int h = g0 * group; h < g1 * group; h++)                                              \
            for (int d = 0; d < hd; d++)                                                           \
                store_float(a->out, (int)a->q_dtype, row * num_heads * hd + h * hd + d,            \
                            acc[h * hd + d] * inv[h]);                                             \
    }                                                                                              \
    free(scores);                                                                                  \
    free(qf);                                                                                      \
    free(part);                                                                                    \
    free(acc);                                                                                     \
}

DEFINE_64_AND_128(DEFINE_DECODE_SIMD, decode_simd_f32, float, load_f32, float, vload_f32)
DEFINE_64_AND_128(DEFINE_DECODE_SIMD, decode_simd_bf16, uint16_t, load_bf16, uint16_t, vload_bf16)
DEFINE_64_AND_128(DEFINE_DECODE_SIMD, decode_simd_f32_bf16, float, load_f32, uint16_t, vload_bf16)
DEFINE_64_AND_128(DEFINE_DECODE_SIMD, decode_simd_f32_fp8, float, load_f32, uint8_t, vload_e4m3)
DEFINE_64_AND_128(DEFINE_DECODE_SIMD, decode_simd_bf16_fp8, uint16_t, load_bf16, uint8_t, vload_e4m3)
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* With a bf16 query and AVX512-BF16, both passes multiply bf16 pairs into fp32 lanes
 * (vdpbf16ps) instead of widening every K and V element to fp32 first. fp8 rows become bf16
 * by shifts (load32_e4m3 of cpu_common.h, which says what that costs in precision): against
 * the lookups in a table of the 128 magnitudes before, on 2 vCPUs of an AVX512-BF16 Zen 5
 * EPYC, both libraries in turn in one process, twice (`python -m benchmarks.attention_kernels
 * --engine-batch 128 --baseline-ref bd34737 --rounds 7`,
 * results/attention_kernels-avx512-fp8-shift.md): 128 decodes over 400 fp8 tokens, 8 layers
 * from DRAM, 0.86x the time (24.4 -> 28.2 GB/s; 0.55x a bf16 cache's time, where it was
 * 0.65x), one decode 0.82-0.89x; bf16 cases 0.99-1.02x (one decode's 1.13x in runs of 10
 * calls, 1.01x of 50: the same code, registers allocated otherwise). On the same machine the
 * full workload with int8 weights and an fp8 cache (`results/throughput-avx512-fp8-shift-ab.md`)
 * took the same time as before (19.3 against 19.2 s): its decode attention was not bound by the
 * conversions there; on the Zen 4 EPYC it was (section 12 of benchmarks/README.md).
 *
 * Pass 1 works on tiles of 16 tokens, the lanes of a vector, so scores need no reduction
 * across lanes per query head: per kv head and 32 dimensions, the tile's 16 rows of 16
 * (k[2i], k[2i+1]) pairs are transposed in groups of 4 rows (two unpack stages, tile_columns)
 * and each group multiplies its GQA group's queries laid out to match (q_columns); the 4 row
 * groups' partial sums meet in one 128-bit-lane transpose per head and tile (tile_scores).
 * The transposes serve every query head of the kv head, and nothing goes through memory
 * between the multiplies and the tile's scores. The softmax runs on vectors of 16 (exp16);
 * its weights enter pass 2 rounded to bf16 (as flash attention's P does), where the rows of
 * two tokens are interleaved (each fp32 lane: v_t[d] p_t + v_t+1[d] p_t+1), so one
 * instruction adds two tokens into 16 outputs; products and sums stay fp32. Row addresses
 * come per tile from the block table by shifts (block sizes are powers of two); the rows of
 * the tile two ahead are prefetched into L2 one kv head's bytes at a time, spread over the
 * tile's work (all at once, they stalled on the core's miss buffers: see prefetch_rows), and
 * the next item's first two tiles during this item's pass 2.
 * Against the kernel before (a reduction tree across lanes per query head, K into L1), on
 * the project's 2-vCPU AVX512-BF16 EPYC, both libraries in turn in one process
 * (`python -m benchmarks.attention_kernels --baseline-ref 6ead788 --prompt-lens 64,128,512
 * --rounds 9`, results/attention_kernels-avx512.md): 128 decodes over 400 tokens, 8 layers
 * from DRAM, 2.52 -> 1.43 ms a layer (15.6 -> 27.6 GB/s, about what the machine reads; fp8
 * cache 2.23 -> 1.33), one decode 15.1 -> 12.0 us (fp8 18.0 -> 15.2), verify steps of 5 (8)
 * queries 48.0 -> 36.5 (74.5 -> 47.6) us. By hand, same machine, 30 layers of 128 x 330 from
 * DRAM, one process: K into L1 (prefetcht0) rather than L2 made this kernel 1.8-1.9x slower;
 * prefetching 8 tiles ahead instead of 2, 41.0 against 34.4 ms (the first commit of this
 * kernel did that by mistake); without the next item's tiles (with that 8-tile distance), 2-8%
 * slower. */
#define HEADS_PER_TILE 4 /* query heads whose 4 row-group sums stay in registers in pass 1 */
#define AHEAD 32 /* tokens between the rows pass 1 reads and those it prefetches: two tiles */
/* Rows of the next item's K that pass 2 asks for when it is another request's: with a bf16
 * cache, up to 512 tokens (192 KB of SmolLM2's, in a 1 MB L2); an fp8 cache's kernel, bound
 * by its table conversions then, lost time to more prefetches than its first two tiles, and
 * with the shifts 1,024 rows were no better (1.02x the time on a Zen 5 EPYC). The same
 * request's next query or kv head gets two tiles: its rows are mostly in cache already.
 * Against two tiles for every item, on the project's 2-vCPU AVX512-BF16 EPYC, both libraries
 * in turn in one process (`python -m benchmarks.attention_kernels --engine-batch 128
 * --baseline-ref 71f9553`, results/attention_kernels-avx512-pass2.md and two more runs): the
 * decode step of an int8 engine, 128 sequences of 330 tokens on average over 30 layers, from
 * its own cache (blocks 90% in order), 0.82-0.91x the time (20-24 GB/s); 128 x 400 in random
 * blocks from DRAM 0.80-0.96x; an fp8 cache 0.97-1.05x. The engine's decode step run eagerly
 * (`benchmarks.profile_step --enforce-eager`, alternating runs): attention 38.0 against 38.3
 * ms on a quiet machine, 50.6 against 56.0 (medians of 3) on a loaded one. */
#define NEXT_ROWS(C) (sizeof(C) == 2 ? 512 : AHEAD)

/* Lane 4l + m of q_columns(q, j): the bf16 pair 4l + j of q's 16 (`q` holds 32 elements).
 * It meets lane 4l + m of tile_columns' r[4k + j]: pair 4l + j of row 4k + m. */
static inline __m512i q_columns(const uint16_t *q, int j) {
    const __m512i idx = _mm512_add_epi32(
        _mm512_set_epi32(12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0, 0), _mm512_set1_epi32(j));
    return _mm512_permutexvar_epi32(idx, _mm512_loadu_si512(q));
}

/* In place, 4 rows of 16 pairs r[0..3]: lane 4l + m of r[j] <- pair 4l + j of row m. */
static inline void tile_columns(__m512i *r) {
    const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
    r[0] = _mm512_unpacklo_epi64(t0, t2);
    r[1] = _mm512_unpackhi_epi64(t0, t2);
    r[2] = _mm512_unpacklo_epi64(t1, t3);
    r[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* Lane 4k + m: the sum of the 4 128-bit lanes' element m of s[k] (row group k's partial
 * sums): the tile's 16 scores in token order. */
static inline __m512 tile_scores(const __m512 *s) {
    const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x44),
                                     _mm512_shuffle_f32x4(s[0], s[1], 0xee));
    const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], 0x44),
                                     _mm512_shuffle_f32x4(s[2], s[3], 0xee));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88),
                         _mm512_shuffle_f32x4(s01, s23, 0xdd));
}

#define DEFINE_DECODE_DPBF16(NAME, C, LOAD32, HEAD_DIM)                                            \
static void NAME(const struct kvrail_attention_args *a, int tid, int num_threads) {                \
    const uint16_t *q = a->q;                                                                      \
    const C *k_cache = a->k_cache, *v_cache = a->v_cache;                                          \
    const int num_heads = (int)a->num_heads, num_kv = (int)a->num_kv_heads;                        \
    const int block_size = (int)a->block_size, shift = __builtin_ctz((unsigned)block_size);        \
    const int hd = HEAD_DIM, nc = HEAD_DIM / 32, group = num_heads / num_kv;                       \
    const int64_t stride_slot = (int64_t)num_kv * hd, head_bytes = hd * (int64_t)sizeof(C);        \
    const float unit = cache_operand_unit(sizeof(C));                                              \
    const __m512 score_scale = _mm512_set1_ps(a->scale * a->k_scale * unit);                       \
    /* Where the stores find output dimensions 0-15 and 16-31 of 32 in o[2c] (0-15) and */         \
    /* o[2c + 1] (16-31): see pass 2. */                                                           \
    const __m512i dims_0_15 =                                                                      \
        _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);                  \
    const __m512i dims_16_31 =                                                                     \
        _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);            \
    const int max_seq_len = longest_context(a);                                                    \
    /* Per thread: scores [num_heads][padded length] in fp32, then as bf16 weights; the */         \
    /* query in pass 1's layout, [num_heads][nc][4] vectors. */                                    \
    const int64_t stride_s = (max_seq_len + 31) / 32 * 32;                                         \
    float *scores = aligned_alloc(64, sizeof(float) * (size_t)(num_heads * stride_s));             \
    uint16_t *weights = aligned_alloc(64, sizeof(uint16_t) * (size_t)(num_heads * stride_s));      \
    __m512i *qv = aligned_alloc(64, sizeof(__m512i) * (size_t)(num_heads * nc * 4));               \
    for (struct decode_item it = first_item(a, num_threads);                                       \
         next_item(a, tid, num_threads, &it);) {                                                   \
        const int seq_len = it.seq_len, g0 = it.g_begin, g1 = it.g_end;                            \
        const int32_t *blocks = a->block_table + it.req * a->stride_bt;                            \
        const uint16_t *qr = q + it.row * a->stride_q;                                             \
        for (int h = g0 * group; h < g1 * group; h++)                                              \
            for (int c = 0; c < nc; c++)                                                           \
                for (int j = 0; j < 4; j++)                                                        \
                    qv[(h * nc + c) * 4 + j] =                                                     \
                        cache_operand_bf16(q_columns(qr + h * hd + c * 32, j), sizeof(C));         \
        /* Pass 1: scores of the tiles of 16 tokens; a short last tile repeats its last row. */    \
        for (int t0 = 0; t0 < seq_len; t0 += 16) {                                                 \
            const int n = seq_len - t0 < 16 ? seq_len - t0 : 16;                                   \
            int64_t slot[16], ahead[16]; /* element offsets of its rows and the rows 2 ahead */    \
            for (int i = 0; i < 16; i++) {                                                         \
                slot[i] = row_offset(blocks, shift, t0 + (i < n ? i : n - 1)) * stride_slot;       \
                const int t = t0 + AHEAD + i;                                                      \
                ahead[i] = t < seq_len ? row_offset(blocks, shift, t) : -1;                        \
            }                                                                                      \
            for (int g = g0; g < g1; g++)                                                          \
                for (int h0 = g * group; h0 < (g + 1) * group; h0 += HEADS_PER_TILE) {             \
                    const int left = (g + 1) * group - h0;                                         \
                    const int nh = left < HEADS_PER_TILE ? left : HEADS_PER_TILE;                  \
                    __m512 s[HEADS_PER_TILE][4]; /* [head][row group]: partial sums */             \
                    _Pragma("GCC unroll 4")                                                        \
                    for (int k = 0; k < 4; k++) {                                                  \
                        for (int m = 4 * k; m < 4 * k + 4 && m < n && h0 == g * group; m++) {      \
                            const C *ka = ahead[m] < 0 ? NULL : k_cache + ahead[m] * stride_slot;  \
                            const C *va = v_cache + slot[m];                                       \
                            prefetch_row_bytes((const char *)ka, (const char *)va, g * head_bytes, \
                                               (g + 1) * head_bytes);                              \
                        } /* this kv head's bytes of the rows, once */                             \
                        /* two sums a head: the multiplies of one wait on each other */            \
                        __m512 acc[HEADS_PER_TILE][2];                                             \
                        _Pragma("GCC unroll 4")                                                    \
                        for (int j = 0; j < HEADS_PER_TILE; j++)                                   \
                            acc[j][0] = acc[j][1] = _mm512_setzero_ps();                           \
                        _Pragma("GCC unroll 4")                                                    \
                        for (int c = 0; c < nc; c++) {                                             \
                            __m512i r[4];                                                          \
                            _Pragma("GCC unroll 4")                                                \
                            for (int m = 0; m < 4; m++)                                            \
                                r[m] = LOAD32(k_cache + slot[4 * k + m] + g * hd + c * 32);        \
                            tile_columns(r);                                                       \
                            _Pragma("GCC unroll 4")                                                \
                            for (int j = 0; j < HEADS_PER_TILE; j++)                               \
                                if (j < nh) {                                                      \
                                    const __m512i *qj = qv + ((h0 + j) * nc + c) * 4;              \
                                    _Pragma("GCC unroll 4")                                        \
                                    for (int m = 0; m < 4; m++)                                    \
                                        acc[j][m & 1] = _mm512_dpbf16_ps(                          \
                                            acc[j][m & 1], (__m512bh)r[m], (__m512bh)qj[m]);       \
                                }                                                                  \
                        }                                                                          \
                        _Pragma("GCC unroll 4")                                                    \
                        for (int j = 0; j < HEADS_PER_TILE; j++)                                   \
                            s[j][k] = _mm512_add_ps(acc[j][0], acc[j][1]);                         \
                    }                                                                              \
                    for (int j = 0; j < nh; j++)                                                   \
                        _mm512_store_ps(scores + (h0 + j) * stride_s + t0,                         \
                                        _mm512_mul_ps(tile_scores(s[j]), score_scale));            \
                }                                                                                  \
        }                                                                                          \
        /* Softmax weights, unnormalized, rounded to bf16, zero past the context (pass 2 */        \
        /* reads them in pairs); each head's sum divides once at the end. */                       \
        float inv[num_heads];                                                                      \
        for (int h = g0 * group; h < g1 * group; h++) {                                            \
            const float *sh = scores + h * stride_s;                                               \
            __m512 row_max = _mm512_set1_ps(-FLT_MAX);                                             \
            for (int t = 0; t < seq_len; t += 16)                                                  \
                row_max = _mm512_mask_max_ps(row_max, lanes_below(seq_len - t), row_max,           \
                                             _mm512_load_ps(sh + t));                              \
            row_max = _mm512_set1_ps(_mm512_reduce_max_ps(row_max));                               \
            __m512 sum = _mm512_setzero_ps();                                                      \
            for (int t = 0; t < seq_len; t += 32) {                                                \
                const __m512 x0 = _mm512_sub_ps(_mm512_load_ps(sh + t), row_max);                  \
                const __m512 x1 = _mm512_sub_ps(_mm512_load_ps(sh + t + 16), row_max);             \
                const __m512 e0 = _mm512_maskz_mov_ps(lanes_below(seq_len - t), exp16(x0));        \
                const __m512 e1 = _mm512_maskz_mov_ps(lanes_below(seq_len - t - 16), exp16(x1));   \
                sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));                                   \
                const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(cache_operand(e1, sizeof(C)),       \
                                                               cache_operand(e0, sizeof(C)));      \
                _mm512_store_si512(weights + h * stride_s + t, w);                                 \
            }                                                                                      \
            inv[h] = seq_len > 0 ? a->v_scale * unit / _mm512_reduce_add_ps(sum) : 0.0f;           \
        }                                                                                          \
        /* This thread's next item: its K (NEXT_ROWS) is asked for a few rows at each of pass */   \
        /* 2's blocks. Pass 1 asks DRAM for this item's V, pass 2 (which reads V from L2) for */   \
        /* the next one's K, so both passes keep misses in flight; with the next item's first */   \
        /* two tiles alone, pass 2 left DRAM idle (measured: see NEXT_ROWS). */                    \
        struct decode_item next = it;                                                              \
        const int next_max = next_item(a, tid, num_threads, &next) == 0 ? 0                        \
                             : next.req == it.req ? AHEAD : NEXT_ROWS(C);                          \
        const int next_rows = next.seq_len < next_max ? next.seq_len : next_max;                   \
        const int32_t *next_blocks = a->block_table + next.req * a->stride_bt;                     \
        const int pass2_blocks = (g1 - g0) * ((group + HEADS_PER_PASS - 1) / HEADS_PER_PASS)       \
                                 * ((seq_len + block_size - 1) / block_size);                      \
        /* (an empty context has no pass 2 to spread them over) */                                 \
        const int next_per_block = next_rows <= AHEAD || pass2_blocks == 0                         \
                                       ? 2                                                         \
                                       : (next_rows + pass2_blocks - 1) / pass2_blocks;            \
        int next_t = 0;                                                                            \
        /* Pass 2: per kv head, V streams by two tokens at a time while up to HEADS_PER_PASS */    \
        /* query heads accumulate in registers. Lane j of o[.][2c] holds dimension */              \
        /* 32c + 8(j/4) + j%4, of o[.][2c+1] that plus 4: how the unpacks interleave; the */       \
        /* stores put them back in order. */                                                       \
        for (int g = g0; g < g1; g++)                                                              \
            for (int h0 = g * group; h0 < (g + 1) * group; h0 += HEADS_PER_PASS) {                 \
                const int left = (g + 1) * group - h0;                                             \
                const int nh = left < HEADS_PER_PASS ? left : HEADS_PER_PASS;                      \
                __m512 o[HEADS_PER_PASS][2 * HEAD_DIM / 32];                                       \
                for (int j = 0; j < nh; j++)                                                       \
                    for (int c = 0; c < 2 * nc; c++) o[j][c] = _mm512_setzero_ps();                \
                for (int t0 = 0; t0 < seq_len; t0 += block_size) {                                 \
                    const C *v = v_cache + row_offset(blocks, shift, t0) * stride_slot + g * hd;   \
                    const int n = seq_len - t0 < block_size ? seq_len - t0 : block_size;           \
                    for (int r = 0; r < next_per_block && next_t < next_rows; r++, next_t++) {     \
                        const int64_t at = row_offset(next_blocks, shift, next_t) * stride_slot;   \
                        prefetch_row_bytes((const char *)(k_cache + at), NULL,                     \
                                           next.g_begin * head_bytes, next.g_end * head_bytes);    \
                    }                                                                              \
                    for (int i = 0; i < n; i += 2) {                                               \
                        __m512i pairs[2 * HEAD_DIM / 32];                                          \
                        for (int c = 0; c < nc; c++) {                                             \
                            const C *vc = v + i * stride_slot + c * 32;                            \
                            const __m512i r0 = LOAD32(vc);                                         \
                            /* past the context a row may hold anything, even NaN: zeros */        \
                            const __m512i r1 = i + 1 < n ? LOAD32(vc + stride_slot)                \
                                                         : _mm512_setzero_si512();                 \
                            pairs[2 * c] = _mm512_unpacklo_epi16(r0, r1);                          \
                            pairs[2 * c + 1] = _mm512_unpackhi_epi16(r0, r1);                      \
                        }                                                                          \
                        for (int j = 0; j < nh; j++) {                                             \
                            uint32_t pw;                                                           \
                            memcpy(&pw, weights + (h0 + j) * stride_s + t0 + i, sizeof pw);        \
                            const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pw);               \
                            for (int c = 0; c < 2 * nc; c++)                                       \
                                o[j][c] = _mm512_dpbf16_ps(o[j][c], (__m512bh)pairs[c], p);        \
                        }                                                                          \
                    }                                                                              \
                }                                                                                  \
                for (int j = 0; j < nh; j++) {                                                     \
                    const __m512 scale = _mm512_set1_ps(inv[h0 + j]);                              \
                    uint16_t *out = (uint16_t *)a->out + (it.row * num_heads + h0 + j) * hd;       \
                    for (int c = 0; c < nc; c++) {                                                 \
                        const __m512 lo = _mm512_mul_ps(o[j][2 * c], scale);                       \
                        const __m512 hi = _mm512_mul_ps(o[j][2 * c + 1], scale);                   \
                        _mm512_storeu_si512(out + c * 32, (__m512i)_mm512_cvtne2ps_pbh(            \
                            _mm512_permutex2var_ps(lo, dims_16_31, hi),                            \
                            _mm512_permutex2var_ps(lo, dims_0_15, hi)));                           \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
    }                                                                                              \
    free(scores);                                                                                  \
    free(weights);                                                                                 \
    free(qv);                                                                                      \
}

DEFINE_64_AND_128(DEFINE_DECODE_DPBF16, decode_dpbf16_bf16, uint16_t, load32_bf16)
DEFINE_64_AND_128(DEFINE_DECODE_DPBF16, decode_dpbf16_fp8, uint8_t, load32_e4m3)
#endif

/* Attend each of `req_indices` to its context. The cache holds q's dtype, bfloat16 under a
 * float32 q, or fp8 (the launcher checks). */
void kvrail_decode_attention(const struct kvrail_attention_args *a, int tid,
                             int num_threads) {
    const int bf16 = a->q_dtype == KVRAIL_BF16;
    const int cache = (int)a->cache_dtype;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    const int pow2_blocks = (a->block_size & (a->block_size - 1)) == 0;
    if (bf16 && pow2_blocks
        && (cache == KVRAIL_FP8_E4M3 ? decode_dpbf16_fp8(a, tid, num_threads)
                                     : decode_dpbf16_bf16(a, tid, num_threads)))
        return;
#endif
#if defined(VEC)
    const int done = cache == KVRAIL_FP8_E4M3 ? (bf16 ? decode_simd_bf16_fp8(a, tid, num_threads)
                                                       : decode_simd_f32_fp8(a, tid, num_threads))
                     : bf16                   ? decode_simd_bf16(a, tid, num_threads)
                     : cache == KVRAIL_BF16   ? decode_simd_f32_bf16(a, tid, num_threads)
                                              : decode_simd_f32(a, tid, num_threads);
    if (done) return;
#endif
    if (cache == KVRAIL_FP8_E4M3)
        bf16 ? decode_bf16_fp8(a, tid, num_threads) : decode_f32_fp8(a, tid, num_threads);
    else if (bf16)
        decode_bf16(a, tid, num_threads);
    else
        cache == KVRAIL_BF16 ? decode_f32_bf16(a, tid, num_threads) : decode_f32(a, tid, num_threads);
}
