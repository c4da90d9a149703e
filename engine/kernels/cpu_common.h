/* What every CPU kernel of kvrail shares: the team-function convention, bf16 conversions and
 * the AMX tile setup.
 *
 * A kernel is a team function, `void kvrail_X(const struct X_args *args, int tid, int
 * num_threads)`: called by every thread of one team, each doing its share of the work, split
 * by tid. It holds no OpenMP directive (no barrier, no worksharing): a graph may run it on
 * thread 0 alone while the rest of the team waits at the graph's next barrier; work that
 * needs a barrier in the middle is two kernels. Its arguments are one struct of pointers
 * and sizes, mirrored by a ctypes Structure in Python.
 * `kvrail_run` runs one kernel in a fresh team; `kvrail_replay` runs a recorded list of
 * kernels in one team with a barrier after each (`CpuGraph` in cpu_runtime.py): a decode step's
 * hundreds of kernels then cost one call and no fork/join between them.
 */
#ifndef KVRAIL_CPU_COMMON_H
#define KVRAIL_CPU_COMMON_H

#include <stdint.h>
#include <string.h>

typedef void (*kvrail_team_fn)(const void *args, int tid, int num_threads);

/* Element types of tensors passed to kernels (the `dtype` fields of the arg structs). */
enum { KVRAIL_F32 = 0, KVRAIL_BF16 = 1, KVRAIL_FP8_E4M3 = 2 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static inline uint16_t f32_to_bf16(float x) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu))
        return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* The slot of token t of a request whose block table is `blocks`, blocks of 2^shift tokens
 * (block sizes are powers of two: shifts, no division). */
static inline int64_t row_offset(const int32_t *blocks, int shift, int t) {
    return ((int64_t)blocks[t >> shift] << shift) + (t & ((1 << shift) - 1));
}

/* One element of a float32, bfloat16 or fp8 e4m3 array, as the attention kernels read them. */
static inline float load_f32(const float *p) { return *p; }
static inline float load_bf16(const uint16_t *p) { return bf16_to_f32(*p); }

/* e4m3 -> fp32, exact: its 7 magnitude bits moved into fp32's exponent and mantissa give the
 * value times 2^-120 (e4m3 subnormals become fp32 subnormals, which the multiply brings back:
 * exact as long as subnormals are not flushed, which this library never asks for). Integer
 * ops and one multiply, so loops over it stay vectorized (measured, 48 sequences of 4096
 * tokens on one thread: 8% faster than reading bf16; a per-element F16C conversion: 7x
 * slower). */
static inline float load_e4m3(const uint8_t *p) {
    const uint32_t x = *p;
    const uint32_t bits = ((x & 0x80u) << 24) | ((x & 0x7fu) << 20);
    float scaled;
    memcpy(&scaled, &bits, sizeof scaled);
    return scaled * 0x1p120f;
}

/* 2^f for f in [-1/2, 1/2]: Taylor to degree 6 of e^(f ln 2), highest power first (relative
 * error under 2e-7); the vector exps below (exp16, exp8) evaluate it. */
static const float EXP2_POLY[7] = {1.5403530e-4f, 1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f,
                                   2.4022651e-1f, 6.9314718e-1f, 1.0f};

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp(x) for x <= 0, 8 at a time: 2^n 2^f (EXP2_POLY), 2^n built in the exponent bits; x below
 * -87 gives about 0 (not NaN: x may be -inf), so n + 127 stays a normal exponent. */
static inline __m256 exp8(__m256 x) {
    const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)),
                                   _mm256_set1_ps(1.44269504f));
    const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(EXP2_POLY[0]);
    for (int i = 1; i < 7; i++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_POLY[i]));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

/* Rows in vectors of 16 with AVX-512, lanes [0, n) of a row's last vector masked. Masked loads
 * and stores cost more than plain ones (a masked store far more on AMD's cores), so a full
 * vector takes a plain one: on 2 vCPUs of an AVX512-BF16 Zen 5 EPYC, by hand, RMSNorm's
 * AVX-512 rows (cpu_ops.c) over 2048 bf16 rows of 576 with the residual add, inputs from DRAM,
 * took 375-428 us a call with every vector masked, 202 with plain ones where full. The W8A8
 * epilogue's stores, a few per row of sums, showed no difference
 * (`python -m benchmarks.linear_kernels --num-tokens 1,128,2048`, the two trees in turn). */
static inline __mmask16 lanes_below(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

static inline __m512 load16_f32(const float *p, __mmask16 mask) {
    return mask == 0xffff ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask, p);
}

static inline __m512 widen16_bf16(__m256i h) { /* 16 bf16 -> fp32, exactly */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 load16_bf16(const uint16_t *p, __mmask16 mask) {
    return widen16_bf16(mask == 0xffff ? _mm256_loadu_si256((const __m256i *)p)
                                       : _mm256_maskz_loadu_epi16(mask, p));
}

/* 16 elements of a float32 or bfloat16 row from element k, as fp32 (lanes outside `mask` 0) */
static inline __m512 load16_row(const void *x, int dtype, int64_t k, __mmask16 mask) {
    return dtype == KVRAIL_BF16 ? load16_bf16((const uint16_t *)x + k, mask)
                                : load16_f32((const float *)x + k, mask);
}

static inline void store16_f32(float *p, __mmask16 mask, __m512 x) {
    if (mask == 0xffff)
        _mm512_storeu_ps(p, x);
    else
        _mm512_mask_storeu_ps(p, mask, x);
}

static inline void store16_u16(uint16_t *p, __mmask16 mask, __m256i x) {
    if (mask == 0xffff)
        _mm256_storeu_si256((__m256i *)p, x);
    else
        _mm256_mask_storeu_epi16(p, mask, x);
}
#endif

/* With AVX512-BF16, the attention kernels multiply bf16 pairs (vdpbf16ps) and read the cache
 * 32 elements a vector as bf16: loaded as is, or from fp8 e4m3 by moving its bits into a
 * bf16's places. A byte s eeee mmm sign-extended to 16 bits and shifted left by 4 holds the
 * sign at bit 15 and eeee mmm at bits 10..4, where the low exponent bits and the high mantissa
 * bits of a bf16 go; with bits 14..11 (copies of the sign) cleared it is the bf16 of
 * x * E4M3_BF16_UNIT, exactly for every normal e4m3 value (2^-6 .. 448 land on bf16's 2^-126 ..
 * 448 * 2^-120). Subnormal e4m3 values (|x| < 2^-6) land on bf16 subnormals, which vdpbf16ps
 * reads as zero: an error under 2^-6 where a value near 1 already rounds by up to 2^-4, and
 * the cache's scales put a layer's largest |x| near 224; it shows all the same (keys are
 * shifted by their channel means, so many sit near zero): SmolLM2's perplexity with an fp8
 * cache went from 1.0046x to 1.0054x the bf16 cache's (`python -m benchmarks.quality --configs
 * default,fp8-kv`, on a Zen 5 EPYC, the target being 1.01x). So that the products of such small
 * factors stay normal (vdpbf16ps flushes subnormal results too), the other operand, the query
 * or the softmax weights, is multiplied by E4M3_OPERAND_SCALE first (exact: a power of two),
 * and the kernels fold 1 / (E4M3_BF16_UNIT * E4M3_OPERAND_SCALE) = 2^56 into their scales.
 * 3 instructions for 32 values where lookups in a table of the 128 magnitudes took 5 (with
 * VBMI; 7 without); measured in the kernels' comments. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define E4M3_BF16_UNIT 0x1p-120f
#define E4M3_OPERAND_SCALE 0x1p64f

static inline __m512i load32_bf16(const uint16_t *p) { return _mm512_loadu_si512(p); }

static inline __m512i load32_e4m3(const uint8_t *p) {
    const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_and_si512(_mm512_slli_epi16(x, 4), _mm512_set1_epi16((short)0x87f0));
}

/* Lane i: bf16(lo[i]) | bf16(hi[i]) << 16, rounded to nearest even: one vcvtne2ps2bf16 (lo
 * in words 0-15, hi in 16-31) and one vpermw interleaving them. */
static inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                                25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                                18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* The operand that meets cache rows of `elem_size` bytes an element: for fp8, x times
 * E4M3_OPERAND_SCALE (exact, a power of two); else x as it is. In fp32, and as 32 bf16. */
static inline __m512 cache_operand(__m512 x, size_t elem_size) {
    return elem_size == 1 ? _mm512_mul_ps(x, _mm512_set1_ps(E4M3_OPERAND_SCALE)) : x;
}

/* What a kernel multiplies its scores and outputs by to undo cache_operand and the rows' unit. */
static inline float cache_operand_unit(size_t elem_size) {
    return elem_size == 1 ? 1.0f / (E4M3_BF16_UNIT * E4M3_OPERAND_SCALE) : 1.0f;
}

static inline __m512i cache_operand_bf16(__m512i x, size_t elem_size) {
    if (elem_size != 1) return x;
    const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    const __m512 hi =
        _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
    return bf16_pairs(cache_operand(lo, 1), cache_operand(hi, 1));
}

/* exp(x), 16 at a time: 2^n 2^f with f in [-1/2, 1/2] (Taylor to degree 6 of e^(f ln 2), relative
 * error under 2e-7) scaled by vscalefps; x below -87 gives about 0 (not NaN: x may be -inf). */
static inline __m512 exp16(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)),
                                   _mm512_set1_ps(1.44269504f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(EXP2_POLY[0]);
    for (int i = 1; i < 7; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[i]));
    return _mm512_scalef_ps(p, n);
}

#endif

/* Instances of a kernel template DEFINE(NAME, T, LOAD_Q, C, LOAD_C, HEAD_DIM) for head sizes
 * 64 and 128, where the compiler sees constant loop lengths (fully unrolled, no remainder),
 * one for any other size (HEAD_DIM 0: read at run time), and NAME choosing among them. */
#define DEFINE_HEAD_DIM_INSTANCES(DEFINE, NAME, T, LOAD_Q, C, LOAD_C)                             \
DEFINE(NAME##_64, T, LOAD_Q, C, LOAD_C, 64)                                                        \
DEFINE(NAME##_128, T, LOAD_Q, C, LOAD_C, 128)                                                      \
DEFINE(NAME##_any, T, LOAD_Q, C, LOAD_C, 0)                                                        \
static void NAME(const struct kvrail_attention_args *a, int tid, int num_threads) {               \
    if (a->head_dim == 64)                                                                         \
        NAME##_64(a, tid, num_threads);                                                            \
    else if (a->head_dim == 128)                                                                   \
        NAME##_128(a, tid, num_threads);                                                           \
    else                                                                                           \
        NAME##_any(a, tid, num_threads);                                                           \
}

/* Instances of DEFINE(NAME, ..., HEAD_DIM) for head sizes 64 and 128 (constant chunk counts:
 * the chunks stay in registers), and NAME choosing between them: 0 for any other size. */
#define DEFINE_64_AND_128(DEFINE, NAME, ...)                                                       \
DEFINE(NAME##_64, __VA_ARGS__, 64)                                                                 \
DEFINE(NAME##_128, __VA_ARGS__, 128)                                                               \
static int NAME(const struct kvrail_attention_args *a, int tid, int num_threads) {               \
    if (a->head_dim == 64)                                                                         \
        NAME##_64(a, tid, num_threads);                                                            \
    else if (a->head_dim == 128)                                                                   \
        NAME##_128(a, tid, num_threads);                                                           \
    else                                                                                           \
        return 0;                                                                                  \
    return 1;                                                                                      \
}

/* Element i of a float32 or bfloat16 array. */
static inline float load_float(const void *p, int dtype, int64_t i) {
    return dtype == KVRAIL_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_float(void *p, int dtype, int64_t i, float v) {
    if (dtype == KVRAIL_BF16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

static inline int64_t dtype_size(int dtype) { return dtype == KVRAIL_F32 ? 4 : dtype == KVRAIL_BF16 ? 2 : 1; }

/* Arguments of the paged attention kernels (cpu_decode_attention.c, cpu_prefill_attention.c):
 * the Triton kernels' contracts (engine/kernels/decode_attention.py, prefill_attention.py). */
struct kvrail_attention_args {
    const void *q;                   /* [num_tokens, num_heads, head_dim], q_dtype */
    const void *k_cache, *v_cache;   /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const int32_t *block_table;      /* [num_reqs, stride_bt] */
    const int32_t *query_start_loc;  /* [num_reqs + 1] */
    const int32_t *seq_lens;         /* [num_reqs]: cached + this step's tokens */
    const int32_t *req_indices;      /* [num_requests]: the requests attended */
    void *out;                       /* like q, contiguous; only their rows are written */
    int64_t q_dtype, cache_dtype, num_requests, num_heads, num_kv_heads, head_dim, block_size;
    int64_t stride_q;                /* q's token stride: heads and head_dim are contiguous */
    int64_t stride_bt;
    float scale, k_scale, v_scale;   /* fp8 caches hold x / k_scale, x / v_scale */
};

/* AMX (Xeons since Sapphire Rapids): the tile unit the linear and prompt-attention kernels use
 * where the CPU has it. */
#if defined(__AMX_TILE__) && (defined(__AMX_INT8__) || defined(__AMX_BF16__))
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KVRAIL_AMX_TILES 1
#endif
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#define KVRAIL_AMX 1
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define KVRAIL_AMX_BF16 1
#endif

#ifdef KVRAIL_AMX_TILES
/* Linux grants a process the AMX tile state only on request; without it (an older kernel, a
 * hypervisor that hides the state) the first tile instruction raises SIGILL. */
static inline int amx_usable(void) {
    static int usable = -1; /* every thread computes the same answer: the race is benign */
    if (usable < 0)
        usable = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                         18 /* XFEATURE_XTILEDATA */) == 0;
    return usable;
}

struct amx_tile_config {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16]; /* bytes per row of each tile */
    uint8_t rows[16];
};

/* Tiles 0-7 as rows of 64 bytes: tiles 0-5 (sums and A operands) `rows` rows (16, or fewer for
 * a last block of tokens), tiles 6-7 (B operands: 64 int8 k, or 32 bf16 k as pairs) 16. */
static inline void amx_load_config(int rows) {
    struct amx_tile_config config = {.palette_id = 1};
    for (int t = 0; t < 8; t++) {
        config.rows[t] = t < 6 ? rows : 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}
#endif

/* [begin, end) of `n` items for thread `tid` of `num_threads`, in multiples of `unit`. */
static inline void thread_range(int64_t n, int64_t unit, int tid, int num_threads, int64_t *begin,
                                int64_t *end) {
    const int64_t units = (n + unit - 1) / unit;
    *begin = units * tid / num_threads * unit;
    *end = units * (tid + 1) / num_threads * unit;
    if (*end > n) *end = n;
}

#endif
