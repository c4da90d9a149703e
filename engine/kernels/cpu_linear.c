/* Linear layers on the CPU: out[M, N] = x[M, K] @ W[N, K]^T (+ bias), optionally followed by
 * SiLU-and-multiply of column pairs (the MLP's gate and up projections in one call).
 *
 * Three kernels, one per weight format:
 *
 * - W8A8 (`kvrail_linear_w8a8`): int8 weights, symmetric per output channel, and int8
 *   activations quantized per token inside the call (scale = max|x| / 127), int32
 *   accumulation, both scales applied in the epilogue. Weights are packed at load into
 *   panels of 16 output columns holding groups of 4 consecutive k: one 64-byte vector is
 *   16 columns x 4 k, exactly what AVX512-VNNI's vpdpbusd multiplies by a broadcast group of
 *   4 activations. vpdpbusd takes unsigned activations, so they are stored as q + 128 and the
 *   epilogue subtracts 128 * sum_k w[n][k] (precomputed per column at packing).
 *   A register tile is up to 6 rows x 4 panels (24 zmm accumulators); each thread owns a
 *   contiguous range of panels, so at M = 1 every weight byte is streamed once, by one
 *   thread, in order, and at large M a 4-panel slice (64 x K bytes) stays in L2 while every
 *   row passes over it.
 * - Packed bf16 (`kvrail_linear_bf16_packed`, AVX512-BF16): bf16 weights packed as the int8
 *   ones are, pairs of k where int8 has groups of 4, multiplied by vdpbf16ps against a
 *   broadcast pair of activations; for every M, the weights' only copy.
 * - Float (`kvrail_linear_float`): plain [N, K] weights (the layout torch's own matmul
 *   reads, so nothing is stored twice), for small M only (float32, and bf16 on CPUs without
 *   AVX512-BF16), where oneDNN's matmul streams the weights at half the memory bandwidth
 *   (measured: 21 GB/s at M = 1). Each output is a dot product along k, tiles of up to 6 rows
 *   x 4 columns, reduced horizontally once per tile.
 *
 * With AMX-INT8 (Xeons since Sapphire Rapids), blocks of 32 (or 16) rows x 2 panels run on
 * the tile unit instead: a B tile is 16 consecutive groups of a panel as packed (16 rows of
 * 64 bytes: 64 k x 16 columns), an A tile 16 tokens x 64 k, and one tdpbusd adds
 * 16 x 16 x 64 products. Rows past the last multiple of 16 take the vector path. Integer sums are
 * exact either way and share one epilogue, so both paths give identical outputs. With
 * AMX-BF16 the packed bf16 panels are B tiles as well (16 pairs of k x 16 columns), for
 * every row: fp32 sums of bf16 products round by the order they are added in, and one order
 * for every M keeps a row's outputs independent of the batch.
 *
 * Without AVX512-VNNI, AVX2 multiplies the int8 panels through int16 (vpmaddwd); without
 * either, and for the float kernel's bf16 (which only CPUs without AVX512-BF16 run), the same
 * loops run in portable C (what gcc vectorizes for the machine), so every machine computes the
 * same results.
 */
#include <math.h>
#include <stdlib.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

#define PANEL 16 /* output columns per packed int8 panel: one vector of 16 int32 sums */
#define KGROUP 4 /* k per group inside a panel: the 4 bytes one int32 lane of vpdpbusd sums */
#define MAX_MR 6 /* rows per register tile */
#define MAX_NT 4 /* panels per register tile */

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* NEXT_TILE: a thread streams its weights a tile at a time, each tile's panels (or, in the float
 * kernel, its rows) side by side, so the hardware prefetcher, which follows a run and stops at
 * page boundaries, starts over at every tile. So while a tile's first rows multiply its weights
 * from DRAM, each weight line read asks for the line at the same place of the thread's next
 * tile, into L2 (prefetcht1; the float kernel asked for it into L1 before, where the requests
 * held the core's few L1 miss buffers, as in cpu_decode_attention.c). In the packed kernels rows
 * after a tile's first find it in L2 and ask for nothing (the float kernel, at most 8 rows, asks
 * in each of its row tiles). The W8A8 tiles ask only with 3+ rows (W8A8_NEXT_TILE_ROWS): the
 * AVX2 tile's 1-2 rows take one pass in order over a panel (3+ rows two, reading each line
 * twice), which the hardware prefetcher kept up with, and the requests cost 10% (by hand, W8A8
 * M = 1 built without AVX-512 on a Zen 4); the VNNI tile's 1 row took 1.07-1.09x the time and 2
 * rows 1.03x on an AMX Xeon (family 6 model 167, three runs of the benchmark below at M = 1-3,
 * results/linear_kernels-amx-next-tile*.md; 3 rows 1.01x, and 4+ rows go to its tile unit),
 * where on the Zen 4 1 row took 0.99x. On 2 vCPUs of a Zen 4 EPYC, SmolLM2-135M's 121 linears
 * with a weight of their own each, replayed as one CPU graph as decode steps run them, against
 * the library before in turn (`python -m benchmarks.linear_kernels --per-layer-weights --graph
 * --num-tokens 1,6 --baseline-ref <before>`, results/linear_kernels-zen4-next-tile*.md): the
 * float kernel in fp32 0.72x the time at M = 1 and 0.58x at M = 6 (a verify step of 5 drafts);
 * W8A8 on fp32 activations 0.99x and 0.71x, on bf16 ones 0.99x and 0.93x; packed bf16 0.97x and
 * 0.98x; M = 128 0.97-1.01x. By hand the same pass gained more on a busier spell (W8A8 at M = 6
 * 0.70x in bf16): the further DRAM's latency, the more a request ahead saves. Single stream
 * (`python -m benchmarks.latency --dtype float32 --baseline-ref <before>`,
 * results/latency-zen4-next-tile-f32.md) 36.2 -> 52.5 tok/s in fp32; bf16 and int8 within their
 * rounds' spread. On the AMX Xeon the float kernel in fp32 took 0.98x and 1.00x at M = 1 and 6
 * (results/linear_kernels-amx-next-tile-f32.md). Always inlined (a macro): a prefetch has no
 * effect gcc counts. */
#define prefetch_l2(p) __builtin_prefetch((const void *)(p), 0, 2)
#define W8A8_NEXT_TILE_ROWS 3 /* the fewest rows of a W8A8 tile that asks (NEXT_TILE) */

/* One token's activations -> int8 (stored + 128) and its scale. k in [K, k_padded) gets 0.
 * Loops are written per dtype, without branches, so that they vectorize. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* With AVX-512, 16 activations a vector, two passes over the row (max, then quantize; rounding
 * to nearest even as nearbyintf does): on 2 vCPUs of an AMX Xeon, 2048 bf16 rows of 576 took
 * 115 us, against 178 as gcc vectorized the loops below (about one element a cycle). The +128
 * as a byte xor after a saturating narrowing, no clamp: on 2 vCPUs of an AVX512-BF16 Zen 5
 * EPYC, a 2048-token prompt step's quantization in int8 (`python -m benchmarks.profile_step
 * --quantization int8 --skip-steps 2 --steps 4`, the two trees in turn, twice) 14.3-15.7 ->
 * 10.6-11.9 ms. The maximum runs on four accumulators over full vectors, a masked vector only
 * at the end, each dtype its own instance: with one accumulator every vmaxps waited on the
 * last (4 cycles), and the dtype and mask tests stayed inside the loops. On 2 vCPUs of an AMX
 * Xeon, the two libraries in turn, three times each: 2048 bf16 rows of 576 in cache 100-116 ->
 * 83-86 us, of 1536 258-286 -> 230-234 us; in an int8 engine's 2048-token prompt steps
 * (`profile_step` as above, twice each) 24.1-26.5 -> 20.6-24.3 ms, medians 24.6 -> 22.5. */
static inline __m128i quantize16(__m512 x, __m512 inv) { /* q + 128 of 16 activations */
    /* |x| <= max, so |q| <= 127 without a clamp (the narrowing saturates all the same) */
    const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(x, inv),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm_xor_si128(_mm512_cvtsepi32_epi8(q), _mm_set1_epi8((char)0x80)); /* q ^ 0x80 */
}

static inline __attribute__((always_inline)) void quantize_row_as(
    const void *x, int dtype, int64_t K, int64_t k_padded, uint8_t *xq, float *x_scale) {
    __m512 m0 = _mm512_setzero_ps(), m1 = m0, m2 = m0, m3 = m0;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        m0 = _mm512_max_ps(m0, _mm512_abs_ps(load16_row(x, dtype, k, 0xffff)));
        m1 = _mm512_max_ps(m1, _mm512_abs_ps(load16_row(x, dtype, k + 16, 0xffff)));
        m2 = _mm512_max_ps(m2, _mm512_abs_ps(load16_row(x, dtype, k + 32, 0xffff)));
        m3 = _mm512_max_ps(m3, _mm512_abs_ps(load16_row(x, dtype, k + 48, 0xffff)));
    }
    for (; k < K; k += 16)
        m0 = _mm512_max_ps(m0, _mm512_abs_ps(load16_row(x, dtype, k, lanes_below(K - k))));
    const float m =
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
    const __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
    for (k = 0; k + 16 <= K; k += 16)
        _mm_storeu_si128((__m128i *)(xq + k), quantize16(load16_row(x, dtype, k, 0xffff), inv));
    if (k < K) {
        const __mmask16 mask = lanes_below(K - k);
        _mm_mask_storeu_epi8(xq + k, mask, quantize16(load16_row(x, dtype, k, mask), inv));
    }
    memset(xq + K, 128, (size_t)(k_padded - K));
    *x_scale = m / 127.0f;
}

static void quantize_row(const void *x, int dtype, int64_t K, int64_t k_padded, uint8_t *xq,
                         float *x_scale) {
    if (dtype == KVRAIL_BF16)
        quantize_row_as(x, KVRAIL_BF16, K, k_padded, xq, x_scale);
    else
        quantize_row_as(x, KVRAIL_F32, K, k_padded, xq, x_scale);
}
#else
static void quantize_row(const void *x, int dtype, int64_t K, int64_t k_padded, uint8_t *xq,
                         float *x_scale) {
    float row[K];
    if (dtype == KVRAIL_BF16) {
        const uint16_t *xb = x;
#pragma omp simd
        for (int64_t k = 0; k < K; k++) row[k] = bf16_to_f32(xb[k]);
    } else {
        memcpy(row, x, sizeof(float) * K);
    }
    float amax = 0.0f;
#pragma omp simd reduction(max : amax)
    for (int64_t k = 0; k < K; k++) amax = fmaxf(amax, fabsf(row[k]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
#pragma omp simd
    for (int64_t k = 0; k < K; k++)
        xq[k] = (uint8_t)((int)fminf(fmaxf(nearbyintf(row[k] * inv), -127.0f), 127.0f) + 128);
    for (int64_t k = K; k < k_padded; k++) xq[k] = 128;
    *x_scale = amax / 127.0f;
}
#endif

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
/* AVX2 has no u8 x s8 dot product that cannot saturate (vpmaddubsw saturates its int16 pair sums),
 * so bytes are widened to int16 and multiplied by vpmaddwd, exact in int32: 16 products an
 * instruction, 2 a cycle on Zen 3 (as vpmaddubsw and vfmadd231ps), but 1.4-1.6 a cycle with the
 * vpaddd that accumulates each: about 1.5x the fp32 FMA's products, not 2x (by hand, 2026-12-07,
 * benchmarks/README.md's Zen 3 paragraphs). A tile's activations are widened once per chunk of k
 * into `xw`, so a broadcast is one load; each weight vector (4 columns x 4 k) is widened once for
 * all its rows. 6 rows x 2 vectors: 12 accumulators, 2 weights, an activation and a product fill
 * the 16 registers. Measured on a 2-vCPU AVX2 EPYC (`python -m benchmarks.linear_kernels`, the 121
 * matmuls of a SmolLM2 pass, `results/linear_kernels-avx2-w8a8tile.md`), against the previous tile
 * of 2 rows that widened the weights for every row pair and an activation at every broadcast
 * (`results/linear_kernels-avx2.md`, the same machine kind): M = 64 152 -> 79 ms, M = 256 574 ->
 * 412 ms (torch fp32 there: 153 and 578 ms), M = 1 about the same (9.2 ms). */
#define AVX2_KCHUNK 2048 /* k per chunk of widened activations (6 rows: 24 KiB of stack) */
/* raw[i * MAX_NT * 4 + v] += sums of row i of `xw` against weight vector v < nv of `wg`, over
 * ng groups of 4 k: nv = 2, half a panel, for tiles of 3-6 rows; nv = 4, the whole group of
 * 64 bytes, for 1-2 rows, so that each weight line is read by one pass, not two. Measured on
 * the 2-vCPU AVX2 EPYC, single-stream int8 decode (`benchmarks.latency --systems
 * kvrail-int8,baseline-int8 --baseline-ref 7c9153a --rounds 4`, a slow, shared day): 71.4 ->
 * 75.9 tok/s, 1.06x, every round faster (1.04-1.10x). */
static inline __attribute__((always_inline)) void w8a8_vectors_avx2(const int16_t *xw,
                                                                    const int8_t *wg, int64_t ng,
                                                                    int mr, int nv, int64_t next,
                                                                    __m256i *raw) {
    __m256i s[MAX_MR][4];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) s[i][v] = raw[i * MAX_NT * 4 + v];
    for (int64_t g = 0; g < ng; g++) {
        __m256i b[4];
        if (next) prefetch_l2(wg + g * 64 + next);
        for (int v = 0; v < nv; v++)
            b[v] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wg + g * 64 + v * 16)));
        for (int i = 0; i < mr; i++) {
            int64_t four;
            memcpy(&four, xw + i * AVX2_KCHUNK + g * KGROUP, sizeof four);
            __m256i a = _mm256_set1_epi64x(four);
            /* keeps gcc 12 from hoisting all 6 broadcasts, which spilled 9 accumulators */
            __asm__ volatile("" : "+x"(a));
            for (int v = 0; v < nv; v++) {
                s[i][v] = _mm256_add_epi32(s[i][v], _mm256_madd_epi16(a, b[v]));
                __asm__ volatile("" : "+x"(s[i][v]));
            }
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < nv; v++) raw[i * MAX_NT * 4 + v] = s[i][v];
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* The tile's accumulators named one by one (c<row><panel>), each row and panel kept by the
 * tile's shape (constants once inlined, `w8a8_dispatch`): as an array, gcc 12 keeps only part
 * of it in registers and stores the rest every k group (measured on the 6 x 4 tile: 21% of the
 * VNNI peak at M = 256; the smaller tiles, M % 6 rows and M = 2..5, stored every one). */
#define W8A8_ZERO(i) __m512i c##i##0 = _mm512_setzero_si512(), c##i##1 = c##i##0, \
                             c##i##2 = c##i##0, c##i##3 = c##i##0;
#define W8A8_ROW(i)                                                                            \
    if (mr > i) {                                                                              \
        int32_t four;                                                                          \
        memcpy(&four, xq + i * stride_xq + g * KGROUP, sizeof four);                           \
        const __m512i a = _mm512_set1_epi32(four);                                             \
        c##i##0 = _mm512_dpbusd_epi32(c##i##0, a, b0);                                         \
        if (nt > 1) c##i##1 = _mm512_dpbusd_epi32(c##i##1, a, b1);                             \
        if (nt > 2) c##i##2 = _mm512_dpbusd_epi32(c##i##2, a, b2);                             \
        if (nt > 3) c##i##3 = _mm512_dpbusd_epi32(c##i##3, a, b3);                             \
    }
#define W8A8_STORE(i)                                                                          \
    if (mr > i) {                                                                              \
        const __m512i row[MAX_NT] = {c##i##0, c##i##1, c##i##2, c##i##3};                      \
        for (int j = 0; j < nt; j++)                                                           \
            _mm512_storeu_si512((void *)(acc + (i * MAX_NT + j) * PANEL), row[j]);             \
    }
#endif

/* Integer dot products of an mr x nt tile: acc[i][j * PANEL + c] = sum_k xq[i][k] w[c][k].
 * `next`: bytes from w to the thread's next tile, whose lines it asks L2 for (NEXT_TILE), or 0. */
static inline __attribute__((always_inline)) void w8a8_tile(const uint8_t *xq, int64_t stride_xq,
                                                            const int8_t *w, int64_t panel_bytes,
                                                            int64_t num_groups, int mr, int nt,
                                                            int64_t next, int32_t *acc) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    W8A8_ZERO(0) W8A8_ZERO(1) W8A8_ZERO(2) W8A8_ZERO(3) W8A8_ZERO(4) W8A8_ZERO(5)
    for (int64_t g = 0; g < num_groups; g++) {
        __m512i b[MAX_NT];
        for (int j = 0; j < MAX_NT; j++) {
            if (j >= nt) break;
            if (next) prefetch_l2(w + j * panel_bytes + g * 64 + next);
            b[j] = _mm512_loadu_si512((const void *)(w + j * panel_bytes + g * 64));
        }
        const __m512i b0 = b[0], b1 = b[nt > 1], b2 = b[nt > 2 ? 2 : 0], b3 = b[nt > 3 ? 3 : 0];
        W8A8_ROW(0) W8A8_ROW(1) W8A8_ROW(2) W8A8_ROW(3) W8A8_ROW(4) W8A8_ROW(5)
    }
    W8A8_STORE(0) W8A8_STORE(1) W8A8_STORE(2) W8A8_STORE(3) W8A8_STORE(4) W8A8_STORE(5)
#elif defined(__AVX2__)
    /* Partial sums per (row, panel, quarter): quarter q holds columns 4q..4q+3, lane pairs
     * (k 0+1, k 2+3) of each; they are added once, after the last group (vphaddd). */
    __m256i raw[MAX_MR][MAX_NT][4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++)
            for (int q = 0; q < 4; q++) raw[i][j][q] = _mm256_setzero_si256();
    int16_t xw[MAX_MR * AVX2_KCHUNK] __attribute__((aligned(32)));
    for (int64_t g0 = 0; g0 < num_groups; g0 += AVX2_KCHUNK / KGROUP) {
        const int64_t ng = num_groups - g0 < AVX2_KCHUNK / KGROUP ? num_groups - g0
                                                                  : AVX2_KCHUNK / KGROUP;
        for (int i = 0; i < mr; i++)
            for (int64_t k = 0; k < ng * KGROUP; k += 16)
                _mm256_store_si256((__m256i *)(xw + i * AVX2_KCHUNK + k),
                                   _mm256_cvtepu8_epi16(_mm_loadu_si128(
                                       (const __m128i *)(xq + i * stride_xq + g0 * KGROUP + k))));
        const int nv = mr <= 2 ? 4 : 2;
        for (int j = 0; j < nt; j++)
            for (int h = 0; h < 4 / nv; h++)
                w8a8_vectors_avx2(xw, w + j * panel_bytes + g0 * 64 + h * nv * 16, ng, mr, nv,
                                  h == 0 ? next : 0, &raw[0][j][nv * h]);
    }
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nt; j++)
            for (int h = 0; h < 2; h++) {
                const __m256i pairs = _mm256_hadd_epi32(raw[i][j][2 * h], raw[i][j][2 * h + 1]);
                _mm256_storeu_si256((__m256i *)(acc + (i * MAX_NT + j) * PANEL + 8 * h),
                                    _mm256_permutevar8x32_epi32(pairs, order));
            }
#else
    for (int i = 0; i < mr; i++)
        for (int c = 0; c < nt * PANEL; c++) acc[i * MAX_NT * PANEL + c] = 0;
    for (int64_t g = 0; g < num_groups; g++)
        for (int j = 0; j < nt; j++) {
            const int8_t *wg = w + j * panel_bytes + g * 64;
            for (int i = 0; i < mr; i++) {
                const uint8_t *a = xq + i * stride_xq + g * KGROUP;
                int32_t *s = acc + (i * MAX_NT + j) * PANEL;
#pragma omp simd
                for (int c = 0; c < PANEL; c++)
                    s[c] += a[0] * wg[c * 4] + a[1] * wg[c * 4 + 1] + a[2] * wg[c * 4 + 2] +
                            a[3] * wg[c * 4 + 3];
            }
        }
#endif
}

/* STREAM_OUT: an output read once, later, by another kernel (the LM head's logits, which the
 * sampler reads after the whole product) is written with non-temporal stores: whole lines
 * straight to memory, with no read for ownership and no cache line taken. Its rows (SmolLM2's
 * 49,152 logits) are a multiple of 4 KiB apart, so stored as usual they also share their cache
 * sets. On 2 vCPUs of an AMX Xeon (family 6 model 167), the LM head and its argmax after 64 MB
 * of other writes (`python -m benchmarks.linear_kernels --logits`,
 * results/linear_kernels-amx-logits.md), streamed against stored: packed bf16 with fp32 logits
 * 0.66x the time at 128 and 256 rows, W8A8 with bf16 logits 0.67x at 128 and 0.41x at 256, 0.95x
 * at 64 and 0.95-1.04x at 1-32 (`Linear.streams_out` streams 8 MiB and more). By hand, rows
 * padded 64 bytes off their 4 KiB multiple instead gained 0.89x at 128 rows. In the engine, a
 * decode step of 128 requests (`python -m benchmarks.profile_step --attention-backends cpu
 * [--quantization int8] --num-requests 128 --input-len 64:512 --output-len 64:256 --skip-steps
 * 60 --steps 10`, before and after): bf16 (two runs each way) the LM head 12.6-15.3 -> 9.7-10.3
 * ms, its argmax 1.1 -> 1.5 ms, the step 108.0-110.7 -> 105.6-109.2 ms; int8 the LM head 5.9 ->
 * 3.3 ms, the step 98.2 -> 95.6 ms. Only the AVX-512 epilogues stream (store_panels); the others
 * store as usual. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define stream_fence() _mm_sfence() /* the streamed lines visible before the team's barrier */
#else
#define stream_fence() ((void)0)
#endif

/* Store n values of a row (vectorizes: no dtype branch inside the loop). */
static inline void store_row(void *out, int dtype, int64_t offset, const float *y, int n) {
    if (dtype == KVRAIL_BF16) {
        uint16_t *o = (uint16_t *)out + offset;
#pragma omp simd
        for (int c = 0; c < n; c++) o[c] = f32_to_bf16(y[c]);
    } else {
        memcpy((float *)out + offset, y, sizeof(float) * n);
    }
}

/* Dequantize an mr x nt tile of sums and store it; with silu_mul, panel pairs (gate, up)
 * produce one panel of silu(gate) * up at output column (panel / 2) * PANEL. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* With AVX-512 a row's panels stay in registers from the sums to the store, 16 columns a
 * vector, and bf16 comes from vcvtneps2bf16 (round to nearest even, as f32_to_bf16; fp32
 * subnormals become zero). The loops over arrays that gcc made of it (256-bit, a NaN test per
 * element, the outputs through the stack) took more time than the tile unit's products. With
 * the row blocks of kvrail_linear_w8a8 and the AVX-512 quantize_row, on 2 vCPUs of an AMX Xeon
 * (`python -m benchmarks.linear_kernels`, `results/linear_kernels-amx-w8a8.md`), SmolLM2-135M's
 * 121 linears at M = 2048 went from 312 to 231 ms (torch's bf16 matmul: 254), M = 64 from 10.4
 * to 9.5 ms. SiLU is g * sigmoid(g) from exp16 of -|g| (<= 0: no overflow), inline: through
 * libmvec's 16-wide expf (a call, the gate through memory) the MLP's gate_up projection ran
 * at 0.8x the int8 rate of the other projections; against that, on the 2-vCPU AVX512-BF16
 * EPYC, both libraries in turn in one process: gate_up 0.81x the time at M = 2048 and 0.86x
 * at M = 128, a forward pass's linears 0.89x and 0.93x. */
static inline __m512 silu_mul16(__m512 gate, __m512 up) {
    const __m512 e = exp16(_mm512_abs_ps(gate) * -1.0f); /* exp(-|g|) <= 1: no overflow */
    const __m512 s = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    const __mmask16 negative = _mm512_cmp_ps_mask(gate, _mm512_setzero_ps(), _CMP_LT_OQ);
    return _mm512_mul_ps(_mm512_mul_ps(gate, _mm512_mask_mul_ps(s, negative, s, e)), up);
}

/* One row of a tile's outputs, y[j] the 16 columns of panel `panel` + j (with silu_mul, pairs
 * (gate, up) give one output panel each), stored at element `offset` of `out` on; with
 * `stream`, whole aligned vectors around the caches (STREAM_OUT). */
static inline void store_panels(__m512 *y, int nt, int64_t panel, int64_t N, int silu_mul,
                                void *out, int out_dtype, int stream, int64_t offset) {
    const int num_out = silu_mul ? nt / 2 : nt; /* output panels */
    const int64_t first = (silu_mul ? panel / 2 : panel) * PANEL;
    if (silu_mul)
        for (int j = 0; j < num_out; j++) y[j] = silu_mul16(y[2 * j], y[2 * j + 1]);
    for (int j = 0; j < num_out; j++) {
        const int64_t column = first + j * PANEL;
        const __mmask16 mask = lanes_below(N - column);
        const int bf16 = out_dtype == KVRAIL_BF16;
        char *at = (char *)out + (offset + column) * (bf16 ? 2 : 4);
        if (stream && mask == 0xffff && ((uintptr_t)at & (bf16 ? 31 : 63)) == 0) {
            if (bf16)
                _mm256_stream_si256((__m256i *)at, (__m256i)_mm512_cvtneps_pbh(y[j]));
            else
                _mm512_stream_ps((float *)at, y[j]);
        } else if (bf16) {
            store16_u16((uint16_t *)at, mask, (__m256i)_mm512_cvtneps_pbh(y[j]));
        } else {
            store16_f32((float *)at, mask, y[j]);
        }
    }
}

static inline void w8a8_epilogue(const int32_t *acc, int mr, int nt, int64_t panel, int64_t N,
                                 const float *x_scale, const float *w_scale, const int32_t *w_comp,
                                 const float *bias, int silu_mul, void *out, int out_dtype,
                                 int stream, int64_t stride_out) {
    __m512i comp[MAX_NT];
    __m512 scale[MAX_NT], b[MAX_NT];
    for (int j = 0; j < nt; j++) {
        comp[j] = _mm512_loadu_si512(w_comp + (panel + j) * PANEL);
        scale[j] = _mm512_loadu_ps(w_scale + (panel + j) * PANEL);
        b[j] = bias ? _mm512_loadu_ps(bias + (panel + j) * PANEL) : _mm512_setzero_ps();
    }
    for (int i = 0; i < mr; i++) {
        const int32_t *row = acc + i * MAX_NT * PANEL;
        const __m512 xs = _mm512_set1_ps(x_scale[i]);
        __m512 y[MAX_NT];
        for (int j = 0; j < nt; j++) {
            const __m512i sums = _mm512_sub_epi32(_mm512_loadu_si512(row + j * PANEL), comp[j]);
            y[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(xs, scale[j]), b[j]);
        }
        store_panels(y, nt, panel, N, silu_mul, out, out_dtype, stream, i * stride_out);
    }
}
#else
#if defined(__AVX2__) && defined(__FMA__)
/* silu(gate) * up, 8 at a time, as silu_mul16 does it. An AVX2 build (-march=x86-64-v3) of
 * this file on the 2-vCPU AVX512-BF16 EPYC: through libmvec's expf, the gate_up shape took
 * 1.13x the time of the same product without SiLU at M = 2048; this and that build in turn in
 * one process, gate_up 0.90x the time at M = 2048, 0.94x at M = 128 (fp32 outputs within
 * 1e-6 of each other). */
static inline __m256 silu_mul8(__m256 gate, __m256 up) {
    const __m256 e = exp8(_mm256_or_ps(gate, _mm256_set1_ps(-0.0f))); /* exp(-|g|) <= 1 */
    const __m256 s = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    const __m256 negative = _mm256_cmp_ps(gate, _mm256_setzero_ps(), _CMP_LT_OQ);
    return _mm256_mul_ps(_mm256_mul_ps(gate, _mm256_blendv_ps(s, _mm256_mul_ps(s, e), negative)),
                         up);
}
#endif

static inline void w8a8_epilogue(const int32_t *acc, int mr, int nt, int64_t panel, int64_t N,
                                 const float *x_scale, const float *w_scale, const int32_t *w_comp,
                                 const float *bias, int silu_mul, void *out, int out_dtype,
                                 int stream, int64_t stride_out) {
    (void)stream; /* stores as usual (STREAM_OUT) */
    const int width = nt * PANEL;
    const int32_t *comp = w_comp + panel * PANEL;
    const float *scale = w_scale + panel * PANEL;
    float b[MAX_NT * PANEL] = {0};
    if (bias) memcpy(b, bias + panel * PANEL, sizeof(float) * width);
    for (int i = 0; i < mr; i++) {
        const int32_t *row = acc + i * MAX_NT * PANEL;
        float y[MAX_NT * PANEL];
#pragma omp simd
        for (int c = 0; c < width; c++) y[c] = (float)(row[c] - comp[c]) * x_scale[i] * scale[c] + b[c];
        if (!silu_mul) {
            const int64_t first = panel * PANEL;
            store_row(out, out_dtype, i * stride_out + first, y, first + width <= N ? width : (int)(N - first));
            continue;
        }
        float z[MAX_NT / 2 * PANEL];
        for (int j = 0; j < nt; j += 2) {
            const float *gate = y + j * PANEL, *up = y + (j + 1) * PANEL;
#if defined(__AVX2__) && defined(__FMA__)
            for (int c = 0; c < PANEL; c += 8)
                _mm256_storeu_ps(z + j / 2 * PANEL + c,
                                 silu_mul8(_mm256_loadu_ps(gate + c), _mm256_loadu_ps(up + c)));
#else
#pragma omp simd
            for (int c = 0; c < PANEL; c++) z[j / 2 * PANEL + c] = gate[c] / (1.0f + expf(-gate[c])) * up[c];
#endif
        }
        const int64_t first = panel / 2 * PANEL;
        const int n = nt / 2 * PANEL;
        store_row(out, out_dtype, i * stride_out + first, z, first + n <= N ? n : (int)(N - first));
    }
}
#endif

static inline __attribute__((always_inline)) void w8a8_block(
    const uint8_t *xq, int64_t stride_xq, const int8_t *w, int64_t panel_bytes, int64_t num_groups,
    int mr, int nt, int64_t next, int64_t panel, int64_t N, const float *x_scale,
    const float *w_scale, const int32_t *w_comp, const float *bias, int silu_mul, void *out,
    int out_dtype, int stream, int64_t stride_out) {
    int32_t acc[MAX_MR * MAX_NT * PANEL] __attribute__((aligned(64)));
    w8a8_tile(xq, stride_xq, w, panel_bytes, num_groups, mr, nt, next, acc);
    w8a8_epilogue(acc, mr, nt, panel, N, x_scale, w_scale, w_comp, bias, silu_mul, out, out_dtype,
                  stream, stride_out);
}

/* Constant tile shapes, so each instance keeps its accumulators in registers. */
#define W8A8_CASE(MR, NT)                                                                         \
    case MR * 8 + NT:                                                                             \
        w8a8_block(xq, stride_xq, w, panel_bytes, num_groups, MR, NT, next, panel, N, x_scale,    \
                   w_scale, w_comp, bias, silu_mul, out, out_dtype, stream, stride_out);          \
        break;
#define W8A8_CASES(MR) W8A8_CASE(MR, 1) W8A8_CASE(MR, 2) W8A8_CASE(MR, 3) W8A8_CASE(MR, 4)

static void w8a8_dispatch(const uint8_t *xq, int64_t stride_xq, const int8_t *w,
                          int64_t panel_bytes, int64_t num_groups, int mr, int nt, int64_t next,
                          int64_t panel, int64_t N, const float *x_scale, const float *w_scale,
                          const int32_t *w_comp, const float *bias, int silu_mul, void *out,
                          int out_dtype, int stream, int64_t stride_out) {
    switch (mr * 8 + nt) {
        W8A8_CASES(1) W8A8_CASES(2) W8A8_CASES(3) W8A8_CASES(4) W8A8_CASES(5) W8A8_CASES(6)
    }
}

#ifdef KVRAIL_AMX_TILES
/* The W8A8 and packed bf16 kernels' tiles: blocks of rows x 2 panels. Tiles 0-3
 * (amx_load_config): sums for (row half, panel); 4-5: A of each row half; 6-7: B of each panel. */
#define AMX_TILE_ROWS 16 /* tokens per A tile */
#define AMX_ROWS 32      /* rows per AMX block: two A tiles; a last block may hold one */
#define AMX_M_BLOCK 256  /* rows whose activations stay in L2 while every panel passes */

/* The next block of a tile kernel's chunk of rows [.., m1), from row m: *mt tiles (1 or 2) of
 * the returned rows each, 16 or the chunk's last few; the tiles are configured for them when
 * that changes (*rows: the rows configured). */
static inline int amx_next_block(int64_t m, int64_t m1, int *rows, int *mt) {
    const int tile_rows = m1 - m < AMX_TILE_ROWS ? (int)(m1 - m) : AMX_TILE_ROWS;
    *mt = m1 - m < AMX_ROWS ? 1 : 2;
    if (tile_rows != *rows) amx_load_config(*rows = tile_rows);
    return tile_rows;
}

/* NAME(x, stride_x, w, panel_elems, K, mt, nt, acc): acc[i][j * PANEL + c] (row stride
 * MAX_NT * PANEL) = sums of rows 0..16 mt - 1 of x (row stride stride_x elements) against nt
 * panels (mt, nt: 1 or 2) from w, panels panel_elems apart, K a multiple of K_STEP: one tile
 * row of x is K_STEP elements, and a B tile is K_STEP k of a panel as packed (16 rows of 64
 * bytes, `w + k * PANEL`). DP multiplies tiles (tdpbusd, tdpbf16ps). */
#define DEFINE_AMX_BLOCK(NAME, TX, TW, TACC, K_STEP, DP)                                          \
static void NAME(const TX *x, int64_t stride_x, const TW *w, int64_t panel_elems, int64_t K,     \
                 int mt, int nt, TACC *acc) {                                                     \
    const int64_t stride_a = stride_x * (int64_t)sizeof(TX);                                      \
    _tile_zero(0);                                                                                \
    _tile_zero(1);                                                                                \
    _tile_zero(2);                                                                                \
    _tile_zero(3);                                                                                \
    for (int64_t k = 0; k < K; k += K_STEP) {                                                     \
        _tile_loadd(4, x + k, stride_a);                                                          \
        _tile_loadd(6, w + k * PANEL, 64);                                                        \
        DP(0, 4, 6);                                                                              \
        if (nt == 2) {                                                                            \
            _tile_loadd(7, w + panel_elems + k * PANEL, 64);                                      \
            DP(1, 4, 7);                                                                          \
        }                                                                                         \
        if (mt == 2) {                                                                            \
            _tile_loadd(5, x + AMX_TILE_ROWS * stride_x + k, stride_a);                           \
            DP(2, 5, 6);                                                                          \
            if (nt == 2) DP(3, 5, 7);                                                             \
        }                                                                                         \
    }                                                                                             \
    const int64_t stride_acc = MAX_NT * PANEL * sizeof(TACC);                                     \
    TACC *lower = acc + AMX_TILE_ROWS * MAX_NT * PANEL;                                           \
    _tile_stored(0, acc, stride_acc);                                                             \
    if (nt == 2) _tile_stored(1, acc + PANEL, stride_acc);                                        \
    if (mt == 2) _tile_stored(2, lower, stride_acc);                                              \
    if (mt == 2 && nt == 2) _tile_stored(3, lower + PANEL, stride_acc);                           \
}
#endif

#ifdef KVRAIL_AMX
#define AMX_K 64    /* k per tile step: one 64-byte tile row */
/* Steps of this many tokens and more take the tiles. A 16-row block holds 16 x 64 bytes of
 * activations; a last block of fewer rows gets tiles of that many (tdpbusd's cost follows the
 * rows). On 2 vCPUs of an AMX Xeon, SmolLM2-135M's 121 linears (`python -m
 * benchmarks.linear_kernels --num-tokens 1,2,3,4,5,6,8,16,24,130`, the two builds in turn,
 * twice), vector path -> tiles for the rows that were left to it: M = 4 4.5-4.7 -> 4.4 ms,
 * M = 5 5.3-5.4 -> 4.4-4.8, M = 6 4.8-4.9 -> 4.4, M = 8 5.3-5.6 -> 4.6-4.8, M = 24 6.7-7.1 ->
 * 6.5, M = 130 17.6-23 -> 16.0-16.8 (the last rows now use each pair's weights while they are
 * in L1, where the vector path streamed them all again); M = 1-3 are as fast or faster on the
 * vector path (M = 1 3.7-3.8 against 4.2-4.4, M = 2 3.9-4.1 against 4.1-4.4). */
#define AMX_MIN_ROWS 4

/* The int8 tiles: groups of 4 k in a 32-bit lane, k_padded a multiple of AMX_K
 * (cpu_linear.pack_int8). */
DEFINE_AMX_BLOCK(w8a8_amx_block, uint8_t, int8_t, int32_t, AMX_K, _tile_dpbusd)
#endif

struct kvrail_quantize_rows_args {
    const void *x;            /* [num_tokens, in_features], row stride stride_x */
    uint8_t *x_q;             /* [num_tokens, k_padded]: q + 128 */
    float *x_scale;           /* [num_tokens]: max|x| / 127 */
    int64_t x_dtype, num_tokens, in_features, stride_x, k_padded;
};

/* Per-token int8 activations for kvrail_linear_w8a8, which runs after it (a separate kernel:
 * every row must be quantized before any thread multiplies). */
void kvrail_quantize_rows(const struct kvrail_quantize_rows_args *a, int tid, int num_threads) {
    int64_t begin, end;
    thread_range(a->num_tokens, 1, tid, num_threads, &begin, &end);
    for (int64_t m = begin; m < end; m++)
        quantize_row((const char *)a->x + m * a->stride_x * dtype_size(a->x_dtype), a->x_dtype,
                     a->in_features, a->k_padded, a->x_q + m * a->k_padded, a->x_scale + m);
}

struct kvrail_w8a8_args {
    const uint8_t *x_q;       /* [num_tokens, k_padded] from kvrail_quantize_rows */
    const float *x_scale;     /* [num_tokens] */
    const int8_t *w_packed;   /* [num_panels][k_padded / 4][16][4] (cpu_linear.pack_int8) */
    const float *w_scale;     /* [num_panels * 16], per packed column */
    const int32_t *w_comp;    /* [num_panels * 16], 128 * sum_k w */
    const float *bias;        /* [num_panels * 16] or NULL */
    void *out;                /* [num_tokens, out_features], row stride stride_out */
    int64_t out_dtype, num_tokens, num_panels, k_padded;
    int64_t silu_mul;         /* panel 2p gate, 2p + 1 up: out = silu(gate) * up */
    int64_t out_features, stride_out;
    int64_t stream_out;       /* out is written around the caches (STREAM_OUT) */
};

/* out = dequant(x_q w^T): every thread multiplies all rows by its range of panels. */
void kvrail_linear_w8a8(const struct kvrail_w8a8_args *a, int tid, int num_threads) {
    const int64_t M = a->num_tokens, k_padded = a->k_padded;
    const int64_t panel_bytes = k_padded * PANEL, num_groups = k_padded / KGROUP;
    const int64_t out_size = dtype_size(a->out_dtype);
    int64_t begin, end;
    /* gate/up pairs stay in one thread's range */
    thread_range(a->num_panels, a->silu_mul ? 2 : 1, tid, num_threads, &begin, &end);
#ifdef KVRAIL_AMX
    /* Tiles from AMX_MIN_ROWS rows up: blocks of 32 and 16 rows, then the last M % 16 in tiles
     * of that many rows (integer sums are exact on either unit: the same outputs). */
    const int64_t amx_rows = M >= AMX_MIN_ROWS && k_padded % AMX_K == 0 && amx_usable() ? M : 0;
    /* Blocks of AMX_M_BLOCK rows, each over all of the thread's panels, a pair at a time:
     * the block's activations stay in L2 while each pair's weights sit in L1 for all its rows,
     * and the block's outputs are written row by row across the thread's columns. */
    for (int64_t m0 = 0; m0 < amx_rows; m0 += AMX_M_BLOCK) {
        const int64_t m1 = m0 + AMX_M_BLOCK < amx_rows ? m0 + AMX_M_BLOCK : amx_rows;
        int rows = 0, mt; /* the tiles' configured rows */
        /* pairs of panels: with silu_mul, a (gate, up) pair, as the range starts even */
        for (int64_t p = begin; p < end; p += 2) {
            const int nt = end - p < 2 ? (int)(end - p) : 2;
            for (int64_t m = m0; m < m1;) {
                const int tile_rows = amx_next_block(m, m1, &rows, &mt);
                int32_t acc[AMX_ROWS * MAX_NT * PANEL] __attribute__((aligned(64)));
                w8a8_amx_block(a->x_q + m * k_padded, k_padded, a->w_packed + p * panel_bytes,
                               panel_bytes, k_padded, mt, nt, acc);
                w8a8_epilogue(acc, mt * tile_rows, nt, p, a->out_features, a->x_scale + m,
                              a->w_scale, a->w_comp, a->bias, (int)a->silu_mul,
                              (char *)a->out + m * a->stride_out * out_size, (int)a->out_dtype,
                              (int)a->stream_out, a->stride_out);
                m += mt * tile_rows;
            }
        }
    }
#else
    const int64_t amx_rows = 0;
#endif
    for (int64_t p = begin; p < end; p += MAX_NT) {
        const int nt = end - p < MAX_NT ? (int)(end - p) : MAX_NT;
        const int64_t next = p + MAX_NT < end ? MAX_NT * panel_bytes : 0; /* NEXT_TILE */
        for (int64_t m = amx_rows; m < M; m += MAX_MR) {
            const int mr = M - m < MAX_MR ? (int)(M - m) : MAX_MR;
            w8a8_dispatch(a->x_q + m * k_padded, k_padded, a->w_packed + p * panel_bytes,
                          panel_bytes, num_groups, mr, nt,
                          m == amx_rows && mr >= W8A8_NEXT_TILE_ROWS ? next : 0, p,
                          a->out_features, a->x_scale + m, a->w_scale, a->w_comp, a->bias,
                          (int)a->silu_mul, (char *)a->out + m * a->stride_out * out_size,
                          (int)a->out_dtype, (int)a->stream_out, a->stride_out);
        }
    }
#ifdef KVRAIL_AMX
    if (amx_rows) _tile_release();
#endif
    if (a->stream_out) stream_fence();
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* bf16 weights packed as the int8 ones are, in panels of 16 output columns, with pairs of
 * consecutive k where int8 has groups of 4: one 64-byte vector is 16 columns x 2 k, what
 * vdpbf16ps multiplies by a broadcast pair of activations into 16 fp32 sums. Tiles of up to 6
 * rows x 4 panels, each thread a contiguous range of panels, as in kvrail_linear_w8a8; no sum
 * is reduced across lanes (the dot-product tiles of kvrail_linear_float reduce 24 per tile).
 * A row's sums are added in the same order whatever the tile's shape, so a row's outputs do
 * not depend on M. Against oneDNN's bf16 matmul (torch 2.13) and the dot-product tiles on 2
 * vCPUs of an AVX512-BF16 Zen 4 EPYC, SmolLM2-135M's 121 linears with a weight of their own
 * each, from DRAM (`python -m benchmarks.linear_kernels --per-layer-weights`,
 * results/linear_kernels-zen4-packed.md): see cpu_float_kernel_max_tokens. */
#define PAIR_ZERO(i) __m512 c##i##0 = _mm512_setzero_ps(), c##i##1 = c##i##0, c##i##2 = c##i##0, \
                             c##i##3 = c##i##0;
/* Row i's pair g of activations (`bytes` of it: of an odd K the last "pair" is one element
 * and a zero). */
#define PAIR_ROW(i, bytes)                                                                     \
    if (mr > i) {                                                                              \
        int32_t two = 0;                                                                       \
        memcpy(&two, x + i * stride_x + 2 * g, bytes);                                         \
        const __m512bh a = (__m512bh)_mm512_set1_epi32(two);                                   \
        c##i##0 = _mm512_dpbf16_ps(c##i##0, a, b0);                                            \
        if (nt > 1) c##i##1 = _mm512_dpbf16_ps(c##i##1, a, b1);                                \
        if (nt > 2) c##i##2 = _mm512_dpbf16_ps(c##i##2, a, b2);                                \
        if (nt > 3) c##i##3 = _mm512_dpbf16_ps(c##i##3, a, b3);                                \
    }
/* Pair g of the nt panels against every row's pair g. */
#define PAIR_STEP(bytes)                                                                       \
    {                                                                                          \
        __m512bh w_pairs[MAX_NT];                                                              \
        for (int j = 0; j < MAX_NT; j++) {                                                     \
            if (j >= nt) break;                                                                \
            if (next) prefetch_l2(w + j * panel_elems + g * 32 + next);                        \
            w_pairs[j] = (__m512bh)_mm512_loadu_si512(w + j * panel_elems + g * 32);           \
        }                                                                                      \
        const __m512bh b0 = w_pairs[0], b1 = w_pairs[nt > 1], b2 = w_pairs[nt > 2 ? 2 : 0],   \
                       b3 = w_pairs[nt > 3 ? 3 : 0];                                           \
        PAIR_ROW(0, bytes) PAIR_ROW(1, bytes) PAIR_ROW(2, bytes) PAIR_ROW(3, bytes)            \
        PAIR_ROW(4, bytes) PAIR_ROW(5, bytes)                                                  \
    }
#define PAIR_STORE(i)                                                                          \
    if (mr > i) {                                                                              \
        __m512 y[MAX_NT] = {c##i##0, c##i##1, c##i##2, c##i##3};                               \
        for (int j = 0; j < nt; j++) y[j] = _mm512_add_ps(y[j], b[j]);                         \
        store_panels(y, nt, panel, N, silu_mul, out, out_dtype, stream, i * stride_out);       \
    }

/* Rows 0..mr-1 of x against nt panels from `panel` on: sums, bias, activation, stores. `next`:
 * elements from w to the thread's next tile, whose lines it asks L2 for (NEXT_TILE), or 0. */
static inline __attribute__((always_inline)) void pair_tile(
    const uint16_t *x, int64_t stride_x, const uint16_t *w, int64_t panel_elems,
    int64_t num_pairs, int odd, int mr, int nt, int64_t next, int64_t panel, int64_t N,
    const float *bias, int silu_mul, void *out, int out_dtype, int stream, int64_t stride_out) {
    PAIR_ZERO(0) PAIR_ZERO(1) PAIR_ZERO(2) PAIR_ZERO(3) PAIR_ZERO(4) PAIR_ZERO(5)
    int64_t g = 0;
    for (; g < num_pairs; g++) PAIR_STEP(4)
    if (odd) PAIR_STEP(2)
    __m512 b[MAX_NT];
    for (int j = 0; j < nt; j++)
        b[j] = bias ? _mm512_loadu_ps(bias + (panel + j) * PANEL) : _mm512_setzero_ps();
    PAIR_STORE(0) PAIR_STORE(1) PAIR_STORE(2) PAIR_STORE(3) PAIR_STORE(4) PAIR_STORE(5)
}

#define PAIR_CASE(MR, NT)                                                                      \
    case MR * 8 + NT:                                                                          \
        pair_tile(x, stride_x, w, panel_elems, num_pairs, odd, MR, NT, next, panel, N, bias,    \
                  silu_mul, out, out_dtype, stream, stride_out);                               \
        break;
#define PAIR_CASES(MR) PAIR_CASE(MR, 1) PAIR_CASE(MR, 2) PAIR_CASE(MR, 3) PAIR_CASE(MR, 4)

static void pair_dispatch(const uint16_t *x, int64_t stride_x, const uint16_t *w,
                          int64_t panel_elems, int64_t num_pairs, int odd, int mr, int nt,
                          int64_t next, int64_t panel, int64_t N, const float *bias, int silu_mul,
                          void *out, int out_dtype, int stream, int64_t stride_out) {
    switch (mr * 8 + nt) {
        PAIR_CASES(1) PAIR_CASES(2) PAIR_CASES(3) PAIR_CASES(4) PAIR_CASES(5) PAIR_CASES(6)
    }
}

struct kvrail_bf16_packed_args {
    const uint16_t *x;        /* [num_tokens, in_features] bf16, row stride stride_x */
    const uint16_t *w_packed; /* [num_panels][k_padded / 2][16][2] (cpu_linear.pack_bf16): */
                              /* k_padded = in_features rounded up to even, zeros past it */
    const float *bias;        /* [num_panels * 16] or NULL */
    void *out;                /* [num_tokens, out_features], row stride stride_out */
    int64_t out_dtype, num_tokens, num_panels, in_features;
    int64_t silu_mul;         /* panel 2p gate, 2p + 1 up: out = silu(gate) * up */
    int64_t out_features, stride_x, stride_out;
    int64_t stream_out;       /* out is written around the caches (STREAM_OUT) */
};

#ifdef KVRAIL_AMX_BF16
/* With AMX-BF16 the packed panels are the tile unit's B operand as they lie: a k step of 32 is
 * 16 pairs x 16 columns, 16 rows of 64 bytes (`w + k * PANEL` of a panel), and the A operand
 * is 16 tokens' rows of x, 32 k each, read in place. Blocks of 32 (or 16, or a last few) rows
 * x 2 panels, as the W8A8 tiles run; one tdpbf16ps adds 16 x 16 x 32 products in fp32. Each
 * row's sums are added in one order whatever the block holds (a tile row is its token's
 * alone), so decode and verify steps round alike, and every M takes the tiles (a K that is
 * not a multiple of 32, the vector path). On 2 vCPUs of an AMX Xeon, SmolLM2-135M's 121
 * linears with weights of their own from DRAM (`python -m benchmarks.linear_kernels
 * --per-layer-weights`, results/linear_kernels-amx-packed.md), against oneDNN's bf16 matmul:
 * 0.52x its time at M = 1-5, 0.55-0.62x at 16-64, 0.82x at 128, 0.91x at 256, 1.47x at 2048
 * (without the SiLU-and-multiply pass oneDNN's output still needs). Replacing oneDNN above
 * 16 tokens and the float kernel's tiles over plain weights below (W the A operand): in a
 * 2048-token prompt step the linears and SiLU-and-multiply 397 -> 216 ms (`profile_step
 * --skip-steps 2 --steps 4`), a bf16 decode step of 128 requests 127.7 -> 100.6 ms, now one
 * graph (`python -m benchmarks.profile_step --attention-backends cpu --num-requests 128
 * --input-len 64:512 --output-len 64:256 --skip-steps 60 --steps 10`), single-stream decode
 * 92.0 -> 99.5 tok/s (`benchmarks.latency --baseline-ref 37cbec7`,
 * results/latency-amx-packed.md). */
#define AMX_BF16_K 32 /* k per tile step: 32 bf16, one 64-byte tile row */

DEFINE_AMX_BLOCK(bf16_amx_block, uint16_t, uint16_t, float, AMX_BF16_K, _tile_dpbf16ps)

/* Rows [0, M) of kvrail_linear_bf16_packed on the tile unit, panels [begin, end). */
static void linear_bf16_packed_amx(const struct kvrail_bf16_packed_args *a, int64_t begin,
                                   int64_t end) {
    const int64_t M = a->num_tokens, K = a->in_features, panel_elems = K * PANEL;
    const int64_t out_size = dtype_size(a->out_dtype);
    for (int64_t m0 = 0; m0 < M; m0 += AMX_M_BLOCK) {
        const int64_t m1 = m0 + AMX_M_BLOCK < M ? m0 + AMX_M_BLOCK : M;
        int rows = 0, mt; /* the tiles' configured rows */
        for (int64_t p = begin; p < end; p += 2) {
            const int nt = end - p < 2 ? (int)(end - p) : 2;
            __m512 b[2];
            for (int j = 0; j < nt; j++)
                b[j] = a->bias ? _mm512_loadu_ps(a->bias + (p + j) * PANEL) : _mm512_setzero_ps();
            for (int64_t m = m0; m < m1;) {
                const int tile_rows = amx_next_block(m, m1, &rows, &mt);
                float acc[AMX_ROWS * MAX_NT * PANEL] __attribute__((aligned(64)));
                bf16_amx_block(a->x + m * a->stride_x, a->stride_x, a->w_packed + p * panel_elems,
                               panel_elems, K, mt, nt, acc);
                char *out = (char *)a->out + m * a->stride_out * out_size;
                for (int i = 0; i < mt * tile_rows; i++) {
                    __m512 y[MAX_NT];
                    for (int j = 0; j < nt; j++)
                        y[j] = _mm512_add_ps(_mm512_load_ps(acc + i * MAX_NT * PANEL + j * PANEL),
                                             b[j]);
                    store_panels(y, nt, p, a->out_features, (int)a->silu_mul, out,
                                 (int)a->out_dtype, (int)a->stream_out, i * a->stride_out);
                }
                m += mt * tile_rows;
            }
        }
    }
    _tile_release();
}
#endif

/* out = x w^T (+ bias): every thread multiplies all rows by its range of panels. */
void kvrail_linear_bf16_packed(const struct kvrail_bf16_packed_args *a, int tid,
                               int num_threads) {
    const int64_t M = a->num_tokens, K = a->in_features, panel_elems = (K + K % 2) * PANEL;
    const int64_t out_size = dtype_size(a->out_dtype);
    int64_t begin, end;
    thread_range(a->num_panels, a->silu_mul ? 2 : 1, tid, num_threads, &begin, &end);
#ifdef KVRAIL_AMX_BF16
    if (K % AMX_BF16_K == 0 && amx_usable())
        linear_bf16_packed_amx(a, begin, end);
    else
#endif
        for (int64_t p = begin; p < end; p += MAX_NT) {
            const int nt = end - p < MAX_NT ? (int)(end - p) : MAX_NT;
            const int64_t next = p + MAX_NT < end ? MAX_NT * panel_elems : 0; /* NEXT_TILE */
            for (int64_t m = 0; m < M; m += MAX_MR) {
                const int mr = M - m < MAX_MR ? (int)(M - m) : MAX_MR;
                pair_dispatch(a->x + m * a->stride_x, a->stride_x, a->w_packed + p * panel_elems,
                              panel_elems, K / 2, (int)(K % 2), mr, nt, m ? 0 : next, p,
                              a->out_features, a->bias, (int)a->silu_mul,
                              (char *)a->out + m * a->stride_out * out_size, (int)a->out_dtype,
                              (int)a->stream_out, a->stride_out);
            }
        }
    if (a->stream_out) stream_fence();
}
#endif

/* Float linear for small M over plain [N, K] weights (row stride K): a dot product per
 * output along k, tiles of up to 6 rows x 4 columns. silu_mul: W holds [gate; up]
 * (2 N rows), out[m][n] = silu(x.gate_n) * (x.up_n). */
#define DOT_TILE 4 /* columns of a tile; rows too, but where a vector tile takes more */
#define MAX_DOT_ROWS 6 /* the most rows of any tile (buffers) */
#if defined(__AVX2__) && defined(__FMA__)
#define F32_DOT_ROWS 6 /* dot_tile_f32_avx2: 6 rows x 2 columns of accumulators */
#else
#define F32_DOT_ROWS DOT_TILE
#endif

static inline float dot_generic_f32(const float *a, const float *b, int64_t K) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; k++) s += a[k] * b[k];
    return s;
}

static inline float dot_generic_bf16(const uint16_t *a, const uint16_t *b, int64_t K) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < K; k++) s += bf16_to_f32(a[k]) * bf16_to_f32(b[k]);
    return s;
}

#if defined(__AVX2__) && defined(__FMA__)
/* sums[i][j] = x[i] . w[j] for a tile in fp32 with AVX2 FMA, weight rows two at a time (12
 * accumulators, an x row and two weight vectors fit the 16 ymm registers): each weight
 * vector is loaded once for all mr rows. The portable loop below did one dot product per
 * (row, column), so a multi-row step (a speculative verify step: 1 + k rows) cost nearly mr
 * single-row ones: 2 AVX2 cores, SmolLM2-135M's linear layers in fp32
 * (`benchmarks.linear_kernels`), M = 4 took 2.19x and M = 8 3.52x the time of M = 1; with
 * this tile 1.31x and 2.13x (M = 5: 1.50x; `results/linear_kernels-avx2-f32tile.md`).
 * The accumulators named one by one (c<row><column>), kept by the tile's shape (constants once
 * inlined, `dot_tile_f32_dispatch`): as arrays, gcc 12 stored most
 * shapes' accumulators to the stack every k step. */
#define F32_ZERO(i) __m256 c##i##0 = _mm256_setzero_ps(), c##i##1 = c##i##0;
#define F32_ROW(i)                                                                             \
    if (mr > i) {                                                                              \
        __m256 a = _mm256_loadu_ps(x + i * stride_x + k);                                      \
        /* keeps gcc 12 from loading every row's x up front (16 registers) */                  \
        __asm__ volatile("" : "+x"(a));                                                        \
        c##i##0 = _mm256_fmadd_ps(a, b0, c##i##0);                                             \
        if (nj > 1) c##i##1 = _mm256_fmadd_ps(a, b1, c##i##1);                                 \
    }
#define F32_SUMS(i)                                                                            \
    if (mr > i) {                                                                              \
        sums[i * DOT_TILE] = hsum8_dot_tail(c##i##0, x + i * stride_x, w_rows[0], k, K);       \
        if (nj > 1)                                                                            \
            sums[i * DOT_TILE + 1] = hsum8_dot_tail(c##i##1, x + i * stride_x, w_rows[1], k, K); \
    }

/* The lane sum of acc plus the products of k in [k_end, K) (K % 8 of them). */
static inline float hsum8_dot_tail(__m256 acc, const float *x, const float *w, int64_t k_end,
                                   int64_t K) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    float s = _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
    for (int64_t t = k_end; t < K; t++) s += x[t] * w[t];
    return s;
}

/* nj (1 or 2) columns of a tile. */
static inline __attribute__((always_inline)) void dot_pair_f32_avx2(const float *x,
                                                                    int64_t stride_x,
                                                                    const float *const *w_rows,
                                                                    int mr, int nj, int64_t K,
                                                                    float *sums) {
    F32_ZERO(0) F32_ZERO(1) F32_ZERO(2) F32_ZERO(3) F32_ZERO(4) F32_ZERO(5)
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        prefetch_l2(w_rows[0] + DOT_TILE * K + k); /* NEXT_TILE: the next tile's row */
        const __m256 b0 = _mm256_loadu_ps(w_rows[0] + k);
        __m256 b1 = b0;
        if (nj > 1) {
            prefetch_l2(w_rows[1] + DOT_TILE * K + k);
            b1 = _mm256_loadu_ps(w_rows[1] + k);
        }
        F32_ROW(0) F32_ROW(1) F32_ROW(2) F32_ROW(3) F32_ROW(4) F32_ROW(5)
    }
    F32_SUMS(0) F32_SUMS(1) F32_SUMS(2) F32_SUMS(3) F32_SUMS(4) F32_SUMS(5)
}

static inline __attribute__((always_inline)) void dot_tile_f32_avx2(const float *x,
                                                                    int64_t stride_x,
                                                                    const float *const *w_rows,
                                                                    int mr, int nr, int64_t K,
                                                                    float *sums) {
    dot_pair_f32_avx2(x, stride_x, w_rows, mr, nr < 2 ? nr : 2, K, sums);
    if (nr > 2) dot_pair_f32_avx2(x, stride_x, w_rows + 2, mr, nr - 2, K, sums + 2);
}
#define F32_TILE(MR, NR)                                                                        \
    case MR * 8 + NR:                                                                           \
        dot_tile_f32_avx2(x, stride_x, w_rows, MR, NR, K, sums);                                \
        break;
#define F32_TILES(MR) F32_TILE(MR, 1) F32_TILE(MR, 2) F32_TILE(MR, 3) F32_TILE(MR, 4)

static void dot_tile_f32_dispatch(const float *x, int64_t stride_x, const float *const *w_rows,
                                  int mr, int nr, int64_t K, float *sums) {
    switch (mr * 8 + nr) {
        F32_TILES(1) F32_TILES(2) F32_TILES(3) F32_TILES(4) F32_TILES(5) F32_TILES(6)
    }
}
#endif

static void dot_tile(const void *x, int dtype, int64_t stride_x, const void *const *w_rows,
                     int mr, int nr, int64_t K, float *sums) {
#if defined(__AVX2__) && defined(__FMA__)
    if (dtype == KVRAIL_F32) {
        dot_tile_f32_dispatch(x, stride_x, (const float *const *)w_rows, mr, nr, K, sums);
        return;
    }
#endif
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++)
            sums[i * DOT_TILE + j] =
                dtype == KVRAIL_BF16
                    ? dot_generic_bf16((const uint16_t *)x + i * stride_x,
                                           (const uint16_t *)w_rows[j], K)
                        : dot_generic_f32((const float *)x + i * stride_x,
                                          (const float *)w_rows[j], K);
}

struct kvrail_float_linear_args {
    const void *x;      /* [num_tokens, in_features], row stride stride_x */
    const void *w;      /* [num_rows, in_features], contiguous, x's dtype */
    const float *bias;  /* [num_rows] or NULL */
    void *out;          /* [num_tokens, out_features], row stride stride_out */
    int64_t dtype, num_tokens, in_features, stride_x;
    int64_t silu_mul;   /* rows are [gate; up]: out = silu(x gate^T) * (x up^T) */
    int64_t out_features, stride_out;
    int64_t out_dtype;  /* out's: x's, or float32 (the sums as they are) */
};

/* out = x w^T (+ bias) for small M; every thread takes a range of 4-column tiles. */
void kvrail_linear_float(const struct kvrail_float_linear_args *a, int tid, int num_threads) {
    const int64_t K = a->in_features, N = a->out_features, M = a->num_tokens;
    const int64_t esize = dtype_size(a->dtype);
    int64_t begin, end;
    thread_range(N, DOT_TILE, tid, num_threads, &begin, &end);
    /* Rows in tiles as even as the row limit allows: a 1-row remainder tile has too few
     * accumulators to hide the FMA latency. fp32 on a 2-vCPU AVX2 EPYC, the 121 linears of a
     * SmolLM2 pass (`python -m benchmarks.linear_kernels`,
     * `results/linear_kernels-avx2-f32rows.md`), tiles of at most 4 rows -> at most 6, even:
     * M = 5 (a speculative verify step of k = 4) 42.4 -> 22.8 ms, M = 7 50.2 -> 31.6 ms,
     * M = 4 21.6 -> 19.8 ms, M = 1 16.5 -> 15.6 ms. */
    const int max_rows = a->dtype == KVRAIL_F32 ? F32_DOT_ROWS : DOT_TILE;
    const int num_tiles = (int)((M + max_rows - 1) / max_rows);
    const int tile_rows = num_tiles ? (int)((M + num_tiles - 1) / num_tiles) : 1;
    for (int64_t n0 = begin; n0 < end; n0 += DOT_TILE) {
        const int nr = end - n0 < DOT_TILE ? (int)(end - n0) : DOT_TILE;
        const void *gate_rows[DOT_TILE], *up_rows[DOT_TILE];
        for (int j = 0; j < nr; j++) {
            gate_rows[j] = (const char *)a->w + (n0 + j) * K * esize;
            up_rows[j] = (const char *)a->w + (N + n0 + j) * K * esize;
        }
        for (int64_t m0 = 0; m0 < M; m0 += tile_rows) {
            const int mr = M - m0 < tile_rows ? (int)(M - m0) : tile_rows;
            const void *xm = (const char *)a->x + m0 * a->stride_x * esize;
            float sums[MAX_DOT_ROWS * DOT_TILE], ups[MAX_DOT_ROWS * DOT_TILE];
            dot_tile(xm, (int)a->dtype, a->stride_x, gate_rows, mr, nr, K, sums);
            if (a->silu_mul) dot_tile(xm, (int)a->dtype, a->stride_x, up_rows, mr, nr, K, ups);
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++) {
                    float y = sums[i * DOT_TILE + j];
                    if (a->silu_mul) {
                        float u = ups[i * DOT_TILE + j];
                        if (a->bias) y += a->bias[n0 + j], u += a->bias[N + n0 + j];
                        y = silu(y) * u;
                    } else if (a->bias) {
                        y += a->bias[n0 + j];
                    }
                    store_float(a->out, (int)a->out_dtype, (m0 + i) * a->stride_out + n0 + j, y);
                }
        }
    }
}
