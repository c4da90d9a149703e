/* The model's small ops on the CPU, as team kernels (cpu_common.h): the embedding lookup,
 * RMSNorm with the residual add, rotary embedding in place, SiLU-and-multiply, the KV cache
 * write, and the argmax of logit rows (greedy sampling). Each is one pass over its rows, split
 * by thread; torch runs each of them as 3-10 separate ops with a temporary in between
 * (measured: 7.4 ms of "small ops" and Python glue per single-stream decode step of
 * SmolLM2-135M, against 14.5 ms of matmuls).
 * Rounding follows the PyTorch references in engine/kernels/ (e.g. the residual sum and the
 * normalized value are rounded to the activation dtype, as HF's RMSNorm does).
 */
#include <math.h>
#include <stdlib.h>

#include "cpu_common.h"

struct kvrail_embedding_args {
    const int64_t *ids;       /* [num_tokens] */
    const void *weight;       /* [vocab, hidden] float rows, or a packed LM head */
    const float *row_scale;   /* int8: [>= vocab] scale of each row; else NULL */
    const float *col_scale;   /* int8: [hidden] multiplier of each column, or NULL */
    void *out;                /* [num_tokens, hidden], contiguous */
    int64_t weight_dtype;     /* KVRAIL_F32 / KVRAIL_BF16, or packed in panels of 16 rows:
                                 -1 int8 in groups of 4 columns (cpu_linear.pack_int8), -2 bf16
                                 in pairs (cpu_linear.pack_bf16) */
    int64_t out_dtype, num_tokens, hidden, k_padded, vocab;
};

void kvrail_embedding(const struct kvrail_embedding_args *a, int tid, int num_threads) {
    int64_t begin, end;
    thread_range(a->num_tokens, 1, tid, num_threads, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
        int64_t id = a->ids[t];
        /* Ids are validated at admission; a stray one must still not read outside the table. */
        id = id < 0 ? 0 : (id >= a->vocab ? a->vocab - 1 : id);
        const int64_t out_row = t * a->hidden;
        if (a->weight_dtype >= 0) {
            for (int64_t k = 0; k < a->hidden; k++)
                store_float(a->out, (int)a->out_dtype, out_row + k,
                            load_float(a->weight, (int)a->weight_dtype, id * a->hidden + k));
            continue;
        }
        const int64_t c = id % 16;
        if (a->weight_dtype == -2) {
            const uint16_t *panel = (const uint16_t *)a->weight + (id / 16) * a->k_padded * 16;
            for (int64_t k = 0; k < a->hidden; k++)
                store_float(a->out, (int)a->out_dtype, out_row + k,
                            bf16_to_f32(panel[(k / 2) * 32 + c * 2 + k % 2]));
            continue;
        }
        const int8_t *panel = (const int8_t *)a->weight + (id / 16) * a->k_padded * 16;
        for (int64_t k = 0; k < a->hidden; k++) {
            float v = panel[(k / 4) * 64 + c * 4 + k % 4] * a->row_scale[id];
            if (a->col_scale) v *= a->col_scale[k];
            store_float(a->out, (int)a->out_dtype, out_row + k, v);
        }
    }
}

struct kvrail_rms_norm_args {
    const void *x;            /* [num_tokens, num_heads, hidden]: strides stride_x, stride_xh, 1 */
    const void *residual;     /* [num_tokens, hidden] (num_heads == 1), or NULL */
    const void *weight;       /* [hidden], weight_dtype */
    void *out;                /* [num_tokens, num_heads, hidden], contiguous rows of hidden */
    void *residual_out;       /* x + residual (may be `residual` itself); unused without it */
    int64_t dtype, weight_dtype, num_tokens, num_heads, hidden;
    int64_t stride_x, stride_xh, stride_residual, stride_out, stride_residual_out;
    float eps;
};

/* A row of n elements as fp32, and back (rounded to bf16 as store_float does): the dtype is
 * chosen once per row, so the loops vectorize. */
static void load_row(const void *p, int dtype, int64_t offset, int64_t n, float *dst) {
    if (dtype == KVRAIL_BF16) {
        const uint16_t *src = (const uint16_t *)p + offset;
#pragma omp simd
        for (int64_t k = 0; k < n; k++) dst[k] = bf16_to_f32(src[k]);
    } else {
        memcpy(dst, (const float *)p + offset, sizeof(float) * (size_t)n);
    }
}

static void store_row(void *p, int dtype, int64_t offset, int64_t n, const float *src) {
    if (dtype == KVRAIL_BF16) {
        uint16_t *dst = (uint16_t *)p + offset;
#pragma omp simd
        for (int64_t k = 0; k < n; k++) dst[k] = f32_to_bf16(src[k]);
    } else {
        memcpy((float *)p + offset, src, sizeof(float) * (size_t)n);
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* A bf16 row with AVX512-BF16: the loops below in registers, 16 lanes a vector, each rounding
 * one vcvtneps2bf16 (nearest even, as f32_to_bf16; fp32 subnormals become zero) where they
 * take integer arithmetic on fp32 copies of the row. On 2 vCPUs of an AVX512-BF16 Zen 5 EPYC,
 * a prompt step of 2048 tokens of the full workload in int8 (`python -m benchmarks.profile_step
 * --quantization int8 --skip-steps 2 --steps 4`, the two trees in turn, twice): RMSNorm 18.2-18.5
 * -> 8.3-10.6 ms a step; by hand, 2048 rows of 576 with the residual add from DRAM, 251-275 ->
 * 133-140 us a call. */
static void rms_norm_row_bf16(const uint16_t *x, const uint16_t *residual, const float *weight,
                              int64_t n, float eps, uint16_t *out, uint16_t *residual_out) {
    __m512 sum_sq = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += 16) {
        const __mmask16 mask = lanes_below(n - k);
        __m512 v = load16_bf16(x + k, mask);
        if (residual) { /* the sum, rounded to bf16, is the next residual */
            const __m256i sum = (__m256i)_mm512_cvtneps_pbh(
                _mm512_add_ps(v, load16_bf16(residual + k, mask)));
            store16_u16(residual_out + k, mask, sum);
            v = widen16_bf16(sum);
        }
        sum_sq = _mm512_fmadd_ps(v, v, sum_sq);
    }
    const __m512 rstd =
        _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sum_sq) / (float)n + eps));
    const uint16_t *row = residual ? residual_out : x;
    for (int64_t k = 0; k < n; k += 16) {
        const __mmask16 mask = lanes_below(n - k);
        const __m512 normed = widen16_bf16(
            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(load16_bf16(row + k, mask), rstd)));
        const __m512 y = _mm512_mul_ps(normed, load16_f32(weight + k, mask));
        store16_u16(out + k, mask, (__m256i)_mm512_cvtneps_pbh(y));
    }
}
#endif

/* Each (token, head) row normalized on its own: num_heads > 1 is Qwen3's q/k norm. A row's
 * result depends on nothing but the row (one loop order, vectorized the same way whatever
 * the batch: a verify step's rows equal those of plain decode steps). The loops work on fp32
 * copies of the row; with a dtype test per element they did not vectorize (measured on 2 vCPUs
 * of an AMX Xeon, 128 bf16 rows of 576 with the residual add: 88 -> 48 us a call, 5.4 -> 2.9
 * ms of a SmolLM2-135M decode step's 61 norms). */
void kvrail_rms_norm(const struct kvrail_rms_norm_args *a, int tid, int num_threads) {
    const int dtype = (int)a->dtype;
    const int64_t n = a->hidden;
    int64_t begin, end;
    thread_range(a->num_tokens, 1, tid, num_threads, &begin, &end);
    if (begin >= end) return;
    float row[n], other[n], weight[n];
    load_row(a->weight, (int)a->weight_dtype, 0, n, weight);
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (dtype == KVRAIL_BF16) {
        for (int64_t t = begin; t < end; t++)
            for (int64_t h = 0; h < a->num_heads; h++)
                rms_norm_row_bf16(
                    (const uint16_t *)a->x + t * a->stride_x + h * a->stride_xh,
                    a->residual ? (const uint16_t *)a->residual + t * a->stride_residual : NULL,
                    weight, n, a->eps, (uint16_t *)a->out + t * a->stride_out + h * n,
                    a->residual ? (uint16_t *)a->residual_out + t * a->stride_residual_out : NULL);
        return;
    }
#endif
    for (int64_t t = begin; t < end; t++)
        for (int64_t h = 0; h < a->num_heads; h++) {
            load_row(a->x, dtype, t * a->stride_x + h * a->stride_xh, n, row);
            if (a->residual) { /* the sum, rounded to the dtype, is the next residual */
                load_row(a->residual, dtype, t * a->stride_residual, n, other);
#pragma omp simd
                for (int64_t k = 0; k < n; k++) {
                    row[k] += other[k];
                    if (dtype == KVRAIL_BF16) row[k] = bf16_to_f32(f32_to_bf16(row[k]));
                }
                store_row(a->residual_out, dtype, t * a->stride_residual_out, n, row);
            }
            float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
            for (int64_t k = 0; k < n; k++) sum_sq += row[k] * row[k];
            const float rstd = 1.0f / sqrtf(sum_sq / (float)n + a->eps);
#pragma omp simd
            for (int64_t k = 0; k < n; k++) {
                float normed = row[k] * rstd;
                if (dtype == KVRAIL_BF16) normed = bf16_to_f32(f32_to_bf16(normed));
                other[k] = normed * weight[k];
            }
            store_row(a->out, dtype, t * a->stride_out + h * n, n, other);
        }
}

struct kvrail_rotary_args {
    const int64_t *positions;     /* [num_tokens] */
    void *q;                      /* [num_tokens, num_q_heads, head_dim], rotated in place */
    void *k;                      /* [num_tokens, num_k_heads, head_dim], rotated in place */
    const float *cos_sin_cache;   /* [max_position, head_dim]: cos, then sin (rotary.py) */
    int64_t dtype, num_tokens, num_q_heads, num_k_heads, head_dim;
    int64_t stride_qt, stride_qh, stride_kt, stride_kh;
};

/* The products are fused explicitly: left to the compiler (gcc 12), one of them was fused in
 * one version of the loop and the other in another, and which version ran depended on the
 * token's place in the call (its run-time checks), so a row's rotation could differ by a
 * rounding between a verify step and a decode step. */
static void rotate_heads(void *x, int dtype, int64_t base, int64_t num_heads, int64_t stride_h,
                         int64_t half, const float *cos, const float *sin) {
    for (int64_t h = 0; h < num_heads; h++) {
        const int64_t row = base + h * stride_h;
#pragma omp simd
        for (int64_t d = 0; d < half; d++) {
            const float x1 = load_float(x, dtype, row + d), x2 = load_float(x, dtype, row + half + d);
            store_float(x, dtype, row + d, fmaf(x1, cos[d], -(x2 * sin[d])));
            store_float(x, dtype, row + half + d, fmaf(x2, cos[d], x1 * sin[d]));
        }
    }
}

/* Neox-style rotary embedding (rotary.py's contract). */
void kvrail_rotary(const struct kvrail_rotary_args *a, int tid, int num_threads) {
    const int64_t half = a->head_dim / 2;
    int64_t begin, end;
    thread_range(a->num_tokens, 1, tid, num_threads, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
        const float *cos = a->cos_sin_cache + a->positions[t] * a->head_dim, *sin = cos + half;
        rotate_heads(a->q, (int)a->dtype, t * a->stride_qt, a->num_q_heads, a->stride_qh, half,
                     cos, sin);
        rotate_heads(a->k, (int)a->dtype, t * a->stride_kt, a->num_k_heads, a->stride_kh, half,
                     cos, sin);
    }
}

struct kvrail_silu_and_mul_args {
    const void *x;  /* [num_tokens, 2 * width]: gate then up */
    void *out;      /* [num_tokens, width] */
    int64_t dtype, num_tokens, width, stride_x, stride_out;
};

/* On fp32 copies of the row, as rms_norm, so that expf vectorizes (libmvec): with a dtype test
 * per element it ran one expf at a time (measured on 2 vCPUs of an AMX Xeon, a bf16 prompt
 * step of 2048 tokens of SmolLM2-135M: 89 ms of its 30 calls). */
void kvrail_silu_and_mul(const struct kvrail_silu_and_mul_args *a, int tid, int num_threads) {
    const int dtype = (int)a->dtype;
    const int64_t n = a->width;
    int64_t begin, end;
    thread_range(a->num_tokens, 1, tid, num_threads, &begin, &end);
    if (begin >= end) return;
    float gate[n], up[n];
    for (int64_t t = begin; t < end; t++) {
        load_row(a->x, dtype, t * a->stride_x, n, gate);
        load_row(a->x, dtype, t * a->stride_x + n, n, up);
#pragma omp simd
        for (int64_t k = 0; k < n; k++) {
            float silu = gate[k] / (1.0f + expf(-gate[k]));
            /* Rounded before the multiply, as `F.silu(gate) * up` does. */
            if (dtype == KVRAIL_BF16) silu = bf16_to_f32(f32_to_bf16(silu));
            gate[k] = silu * up[k];
        }
        store_row(a->out, dtype, t * a->stride_out, n, gate);
    }
}

/* float -> fp8 e4m3 (finite variant: no infinities, 0x7f is NaN), round to nearest even,
 * saturating at +-448 as the KV cache's writers do. Integer ops and selects only, so a loop of
 * it vectorizes (-ffast-math would also fold a float NaN test away): a normal's mantissa is
 * rounded to 3 bits in place, a carry moving into the exponent; below 2^-6 the code is
 * round(|x| 2^9), the subnormal steps (8 is the smallest normal's code). Element by element with
 * branches, an int8 run of the full workload with an fp8 cache spent 3.2% of its time here on
 * the 2-vCPU AVX512-BF16 Zen 4 EPYC (perf, one process). */
static inline uint8_t f32_to_e4m3(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint32_t sign = (bits >> 24) & 0x80u, magnitude = bits & 0x7fffffffu;
    const int32_t normal =
        (int32_t)((magnitude + 0x7ffffu + ((magnitude >> 20) & 1u)) >> 20) - ((127 - 7) << 3);
    float a;
    memcpy(&a, &magnitude, sizeof a);
    int32_t code = magnitude < 0x3c800000u /* 2^-6 */ ? (int32_t)nearbyintf(a * 512.0f) : normal;
    code = code > 0x7e ? 0x7e : code;
    code = magnitude > 0x7f800000u ? 0x7f : code;
    return (uint8_t)(sign | (uint32_t)code);
}

struct kvrail_write_kv_args {
    const void *k, *v;            /* [num_tokens, num_kv_heads, head_dim], strided rows */
    void *k_cache, *v_cache;      /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const int64_t *slot_mapping;  /* [num_tokens]; a negative slot writes nothing */
    const float *k_shift;         /* [num_kv_heads, head_dim], or NULL: zero */
    int64_t dtype, cache_dtype, num_tokens, num_kv_heads, head_dim;
    int64_t stride_kt, stride_kh, stride_vt, stride_vh;
    float k_scale, v_scale;       /* fp8 caches store (x - shift) / scale */
};

static void write_head(const void *src, int dtype, int64_t src_row, void *cache, int cache_dtype,
                       int64_t dst_row, int64_t head_dim, const float *shift, float scale) {
    float row[head_dim];
    load_row(src, dtype, src_row, head_dim, row);
    if (cache_dtype != KVRAIL_FP8_E4M3) {
        store_row(cache, cache_dtype, dst_row, head_dim, row);
        return;
    }
    uint8_t *dst = (uint8_t *)cache + dst_row;
    if (shift)
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) dst[d] = f32_to_e4m3((row[d] - shift[d]) / scale);
    else
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) dst[d] = f32_to_e4m3(row[d] / scale);
}

/* A cache in the activations' dtype takes a token's rows as they are: one copy of all its kv
 * heads, which sit together in the token's row of the fused qkv projection. Element by element
 * through write_head, an int8 prompt step of 2048 tokens spent 31 ms of its 1,022 here, now 2.8
 * (`benchmarks.profile_step --num-requests 128 --input-len 64:512 --output-len 64:256
 * --quantization int8 --attention-backends cpu --enforce-eager --skip-steps 2 --steps 3`, the
 * AVX512-BF16 EPYC). */
void kvrail_write_kv(const struct kvrail_write_kv_args *a, int tid, int num_threads) {
    const int64_t slot_size = a->num_kv_heads * a->head_dim;
    const int64_t size = dtype_size(a->dtype), row_bytes = slot_size * size;
    const int copy = a->cache_dtype == a->dtype && !a->k_shift && a->stride_kh == a->head_dim
                     && a->stride_vh == a->head_dim;
    int64_t begin, end;
    thread_range(a->num_tokens, 1, tid, num_threads, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
        const int64_t slot = a->slot_mapping[t];
        if (slot < 0) continue;
        if (copy) {
            memcpy((char *)a->k_cache + slot * row_bytes,
                   (const char *)a->k + t * a->stride_kt * size, (size_t)row_bytes);
            memcpy((char *)a->v_cache + slot * row_bytes,
                   (const char *)a->v + t * a->stride_vt * size, (size_t)row_bytes);
            continue;
        }
        for (int64_t h = 0; h < a->num_kv_heads; h++) {
            const int64_t dst = slot * slot_size + h * a->head_dim;
            write_head(a->k, (int)a->dtype, t * a->stride_kt + h * a->stride_kh, a->k_cache,
                       (int)a->cache_dtype, dst, a->head_dim,
                       a->k_shift ? a->k_shift + h * a->head_dim : NULL, a->k_scale);
            write_head(a->v, (int)a->dtype, t * a->stride_vt + h * a->stride_vh, a->v_cache,
                       (int)a->cache_dtype, dst, a->head_dim, NULL, a->v_scale);
        }
    }
}

struct kvrail_argmax_rows_args {
    const void *x;     /* [num_rows, width], row stride stride_x */
    int64_t *out;      /* [num_rows]: each row's first maximum */
    int64_t dtype, num_rows, width, stride_x;
};

/* Each row's first maximum, as torch's `max(dim=-1).indices` gives it (a NaN counts as the
 * largest value: the first NaN wins). torch's CPU `max` took 5.3 ms over 128 bf16 rows of
 * 49,152 logits (a greedy decode step's sampling, 2 threads of the AVX512-BF16 EPYC).
 *
 * With AVX-512, two passes over the row as it lies: its maximum (vmaxps; NaNs noted apart by
 * an integer test of their bits, which -ffast-math cannot fold away), then the first lane
 * equal to it (an IEEE compare: -0 equals +0, as in torch's) or, if the row has one, the first
 * NaN. On 2 vCPUs of the AVX512-BF16 Zen 4 EPYC, against the integer passes below, the two
 * libraries in turn in one process (by hand, each row rewritten before each call as the LM
 * head leaves it, 21 calls each, twice): 128 bf16 rows of 49,152 0.33-0.35x the time (0.46-0.55
 * against 1.38-1.59 ms), 1 row 0.34-0.48x, 128 fp32 rows 0.43-0.52x; in a decode step of 128
 * requests (`python -m benchmarks.profile_step --quantization int8 --num-requests 128
 * --input-len 64:512 --output-len 64:256 --attention-backends cpu --skip-steps 30 --steps
 * 20`) 1.28 -> 0.47 ms. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
static inline __mmask16 nan16(__m512 v) {
    const __m512i magnitude =
        _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff));
    return _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
}

static inline __attribute__((always_inline)) int64_t argmax_row_as(const void *x, int dtype,
                                                                    int64_t n) {
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    __mmask16 nan = 0;
    int64_t k = 0;
    for (; k + 64 <= n; k += 64) { /* four maxima: each vmaxps waits on its own last */
        const __m512 v0 = load16_row(x, dtype, k, 0xffff);
        const __m512 v1 = load16_row(x, dtype, k + 16, 0xffff);
        const __m512 v2 = load16_row(x, dtype, k + 32, 0xffff);
        const __m512 v3 = load16_row(x, dtype, k + 48, 0xffff);
        nan |= nan16(v0) | nan16(v1) | nan16(v2) | nan16(v3);
        m0 = _mm512_max_ps(m0, v0);
        m1 = _mm512_max_ps(m1, v1);
        m2 = _mm512_max_ps(m2, v2);
        m3 = _mm512_max_ps(m3, v3);
    }
    for (; k < n; k += 16) {
        const __mmask16 lanes = lanes_below(n - k);
        const __m512 v = load16_row(x, dtype, k, lanes);
        nan |= nan16(v) & lanes;
        m0 = _mm512_mask_max_ps(m0, lanes, m0, v);
    }
    const __m512 best = _mm512_set1_ps(
        _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3))));
    for (k = 0; k < n; k += 16) {
        const __mmask16 lanes = lanes_below(n - k);
        const __m512 v = load16_row(x, dtype, k, lanes);
        const __mmask16 hit = (nan ? nan16(v) : _mm512_cmp_ps_mask(v, best, _CMP_EQ_OQ)) & lanes;
        if (hit) return k + __builtin_ctz(hit);
    }
    return 0;
}

void kvrail_argmax_rows(const struct kvrail_argmax_rows_args *a, int tid, int num_threads) {
    int64_t begin, end;
    thread_range(a->num_rows, 1, tid, num_threads, &begin, &end);
    for (int64_t r = begin; r < end; r++) {
        const void *x = (const char *)a->x + r * a->stride_x * dtype_size((int)a->dtype);
        a->out[r] = a->dtype == KVRAIL_BF16 ? argmax_row_as(x, KVRAIL_BF16, a->width)
                                            : argmax_row_as(x, KVRAIL_F32, a->width);
    }
}
#else
/* Without AVX-512, floats become integers of the same order (sign-magnitude bits to two's
 * complement; -0 as +0, every NaN the largest), so the passes are integer max reductions that
 * vectorize and that -ffast-math (no infinities, no NaNs) cannot reorder: the row's maximum,
 * then the first chunk that holds it, then the index inside that chunk (1.1 ms for the 128
 * rows above, on the same EPYC, before the AVX-512 passes). */
#define ARGMAX_CHUNK 64
static inline int32_t order_key(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits = bits == 0x80000000u ? 0u : bits;
    const int32_t key = (int32_t)(bits ^ (uint32_t)((int32_t)bits >> 31 & 0x7fffffff));
    return (bits & 0x7fffffffu) > 0x7f800000u ? INT32_MAX : key;
}

void kvrail_argmax_rows(const struct kvrail_argmax_rows_args *a, int tid, int num_threads) {
    const int64_t n = a->width;
    int64_t begin, end;
    thread_range(a->num_rows, 1, tid, num_threads, &begin, &end);
    if (begin >= end) return;
    /* On the heap: a row of a 256k vocabulary is 2 MB here, more than a thread's stack. */
    float *row = malloc(sizeof(float) * (size_t)n);
    int32_t *key = malloc(sizeof(int32_t) * (size_t)n);
    for (int64_t r = begin; r < end; r++) {
        load_row(a->x, (int)a->dtype, r * a->stride_x, n, row);
        int32_t best = INT32_MIN;
#pragma omp simd reduction(max : best)
        for (int64_t k = 0; k < n; k++) {
            key[k] = order_key(row[k]);
            best = key[k] > best ? key[k] : best;
        }
        int64_t index = 0;
        for (int64_t k0 = 0; k0 < n; k0 += ARGMAX_CHUNK) {
            const int64_t k1 = n - k0 < ARGMAX_CHUNK ? n : k0 + ARGMAX_CHUNK;
            int32_t chunk_max = INT32_MIN;
#pragma omp simd reduction(max : chunk_max)
            for (int64_t k = k0; k < k1; k++) chunk_max = key[k] > chunk_max ? key[k] : chunk_max;
            if (chunk_max != best) continue;
            for (index = k0; key[index] != best; index++) {}
            break;
        }
        a->out[r] = index;
    }
    free(row);
    free(key);
}
#endif
