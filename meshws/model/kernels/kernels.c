/* meshws native kernels, built on first use by `native.py` with the machine's C compiler.

   mw_linear: y[r, o] = scale[o] * sum_k x[r, k] * w[o, k] (+ bias[o]) for float32
   activations x [rows, in] and weights w [out, in] of a kind (ggml's type ids, as GGUF files number them):
     KIND_F32, KIND_F16, KIND_BF16  floats as stored, no scale (a bf16 model's own weights, a GGUF's F16...);
     KIND_INT8  int8, one float scale per output channel (meshws's `--quant int8`; not a ggml type);
     a GGUF block type (`quants.c`: Q4_0 ... Q6_K), its exact float32 values as `gguf` dequantizes them.
   Float and int8 weights are widened to float in registers, so one token's product reads each weight's
   bytes once and nothing else; block weights are widened a tile of outputs at a time into a scratch that
   stays in L1. (A bf16 times a bf16 value is exact in float, so the bf16 kind gives torch's bf16 product
   up to the order of the sums.) y's rows lie `ldy` floats apart.

   Every (row, output) pair sums in the same order whatever the batch: LANES lanes, each a
   fused multiply-add chain over k = lane, lane + LANES, ...; then the lanes pairwise as a
   tree; then the inputs past the last multiple of LANES one by one. So a row's result never
   depends on the rows batched with it, on how outputs are split between threads, or on
   which loop below computed it. (LANES is 16 with AVX-512, else 8: machines differ.) A batch of
   LANES rows or more runs those same chains with rows in vectors (`panel_tile`): each weight is
   read once for LANES rows instead of once per two. */

#define _GNU_SOURCE
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
#define MAX_ROWS 4 /* 32 vector registers: 4 rows x 4 outputs of accumulators */
typedef __m512 vec;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vset1(x) _mm512_set1_ps(x)
#define vplus(a, b) _mm512_add_ps(a, b)
#define vtimes(a, b) _mm512_mul_ps(a, b)
#define widen_u8(v) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)) /* 16 bytes */
/* No panel tiles (`panel_tile`): 4 x 4 dot-product tiles already read 0.5 vectors a multiply-add here, and a panel
   of 24 outputs does not fit L1 once per lane pass (16 rows ran much slower on panels than on tiles). */
#define widen_i8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define widen_bf16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define widen_f16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
#define MAX_ROWS 2 /* 16 vector registers */
typedef __m256 vec;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define vset1(x) _mm256_set1_ps(x)
#define vplus(a, b) _mm256_add_ps(a, b)
#define vtimes(a, b) _mm256_mul_ps(a, b)
#define widen_u8(v) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)) /* the low 8 bytes */
#define PANEL 12 /* outputs of a batch's unit (`panel_rows`), 16 vector registers: 2 x 6 x 8 or 12 x 8 rows */
#define widen_i8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define widen_bf16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define widen_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#else
#define LANES 8
#define MAX_ROWS 2
#define GENERIC 1
#endif

#define KIND_F32 0 /* weights' and caches' kinds, ggml's ids (`native.KINDS`; caches are bf16 or float32) */
#define KIND_F16 1
#define KIND_BF16 30
#define KIND_INT8 100 /* meshws's int8 with a scale per output: no ggml type */
#define KIND_Q8_0 8   /* a cache in ggml's Q8_0 blocks: 32 values as int8 and their float16 scale, 34 bytes */
#define Q8_RUN 64     /* rows of a Q8_0 cache widened at a time (a divisor of the block: a run never spans two) */
#define OUT_TILE 4   /* outputs computed together */
#define ROW_BLOCK 64 /* rows that share one widening of a tile's weights */

typedef struct {
    const float *x;
    const void *w;
    const float *scale, *bias;
    float *y;
    int64_t rows, in, out, o_begin, o_end, ldy;
    int kind;
    atomic_int *failed; /* set when a block tensor's tile found no memory to be widened into */
} job_t;

struct block_type;
static const struct block_type *block_type_of(int type);
static int is_block_kind(int kind);
static void widen_values(const struct block_type *t, const void *w, int64_t at, int64_t count, float *to);
static int64_t block_offset(const struct block_type *t, int64_t at);
static float half_to_float(const uint8_t *p);

/* Bytes of a cache row of `dim` values of `kind`: float32, bfloat16, or Q8_0 blocks (dim a multiple of 32). */
static inline size_t row_bytes(int kind, int64_t dim) {
    return kind == KIND_F32 ? (size_t)dim * 4 : kind == KIND_Q8_0 ? (size_t)dim / 32 * 34 : (size_t)dim * 2;
}

/* IEEE float16 of a float, rounded to nearest even (a Q8_0 block's scale, as ggml stores it). */
static uint16_t float_to_half(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) /* inf, NaN (quiet) */
        return (uint16_t)(sign | 0x7c00u | (magnitude > 0x7f800000u ? 0x200u : 0));
    if (magnitude >= 0x477ff000u) /* rounds past the largest half: inf */
        return (uint16_t)(sign | 0x7c00u);
    if (magnitude < 0x38800000u) { /* a subnormal half (or 0): the value in units of 2^-24, to nearest even */
        const uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
        const int shift = 126 - (int)(magnitude >> 23); /* 14 for 2^-15 .. */
        if (shift > 24)
            return (uint16_t)sign;
        const uint32_t kept = mantissa >> shift, rest = mantissa & ((1u << shift) - 1), half_way = 1u << (shift - 1);
        return (uint16_t)(sign | (kept + (rest > half_way || (rest == half_way && (kept & 1)))));
    }
    const uint32_t rebased = magnitude - 0x38000000u; /* exponent 127 -> 15 */
    const uint32_t kept = rebased >> 13, rest = rebased & 0x1fffu;
    return (uint16_t)(sign | (kept + (rest > 0x1000u || (rest == 0x1000u && (kept & 1)))));
}

/* `bytes` on a cache line's boundary (free() frees it): a vector load that straddles two lines costs two, and a
   16-row product of widened weights or of the fused step's own rows ran measurably slower on malloc's 16 bytes. */
static void *lined(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* Element `index` of weights or a cache row of `kind`, as a float. */
static inline float cache_at(const void *w, int kind, int64_t index) {
    if (kind == KIND_F32)
        return ((const float *)w)[index];
    if (kind == KIND_INT8)
        return (float)((const int8_t *)w)[index];
    if (kind == KIND_F16)
        return half_to_float((const uint8_t *)w + 2 * index);
    uint32_t bits = (uint32_t)((const uint16_t *)w)[index] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The lanes summed pairwise as a tree, written out: a loop here cost a product a sizeable share of its time. */
static inline float reduce(const float *lanes) {
#if LANES == 16
    return (((lanes[0] + lanes[8]) + (lanes[4] + lanes[12])) + ((lanes[2] + lanes[10]) + (lanes[6] + lanes[14])))
         + (((lanes[1] + lanes[9]) + (lanes[5] + lanes[13])) + ((lanes[3] + lanes[11]) + (lanes[7] + lanes[15])));
#else
    return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
#endif
}

#ifndef GENERIC
/* The same tree in registers: halving the vector adds lane i to lane i + LANES / 2, as `reduce` pairs them. */
static inline float hsum(vec v) {
#if LANES == 16
    __m256 half = _mm256_add_ps(_mm512_castps512_ps256(v),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#else
    __m256 half = v;
#endif
    __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
    __m128 pair = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}

#if LANES == 16
/* sums[n] = hsum(v[n]) for 16 vectors at once, bit for bit: each step adds the lanes `hsum` adds (l and l + 8, then
   + 4, + 2, + 1), for 2, 4, 8 and then 16 vectors per instruction: 15 adds where 16 `hsum`s take 64 (a 16-row
   product of 576 inputs spent a sizeable share of its time in them). */
static inline __attribute__((always_inline)) void hsum16(const vec *v, float *sums) {
    vec a[8], b[4], c[2];
    for (int n = 0; n < 8; n++) /* v[2n]'s l + 8 sums in lanes 0-7, v[2n + 1]'s in 8-15 */
        a[n] = vplus(_mm512_shuffle_f32x4(v[2 * n], v[2 * n + 1], 0x44),
                     _mm512_shuffle_f32x4(v[2 * n], v[2 * n + 1], 0xEE));
    for (int n = 0; n < 4; n++) /* quarter g: v[4n + g]'s l + 4 sums */
        b[n] = vplus(_mm512_shuffle_f32x4(a[2 * n], a[2 * n + 1], 0x88),
                     _mm512_shuffle_f32x4(a[2 * n], a[2 * n + 1], 0xDD));
    for (int n = 0; n < 2; n++) /* quarter g: v[8n + g]'s l + 2 sums, then v[8n + 4 + g]'s */
        c[n] = vplus(_mm512_shuffle_ps(b[2 * n], b[2 * n + 1], 0x44), _mm512_shuffle_ps(b[2 * n], b[2 * n + 1], 0xEE));
    vec r = vplus(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD)); /* 4g + j: v[4j + g] */
    vstore(sums, _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r));
}
#endif
#endif

static float finish(float sum, const float *x, const float *wf, const job_t *j, int64_t o, int64_t k) {
    for (; k < j->in; k++)
        sum = fmaf(x[k], wf ? wf[k] : cache_at(j->w, j->kind, o * j->in + k), sum);
    return sum;
}

static void store(const job_t *j, int64_t r, int64_t o, float sum) {
    float v = j->scale ? sum * j->scale[o] : sum;
    j->y[r * j->ldy + o] = j->bias ? v + j->bias[o] : v;
}

#ifndef GENERIC
static inline __attribute__((always_inline)) vec widen(const void *w, int kind, int64_t at) {
    return kind == KIND_INT8   ? widen_i8((const int8_t *)w + at)
           : kind == KIND_BF16 ? widen_bf16((const uint16_t *)w + at)
           : kind == KIND_F16  ? widen_f16((const uint16_t *)w + at)
                               : vload((const float *)w + at);
}
#endif

/* Where weight `at` of `kind` lies, in bytes from the first (a block type's weight: its block's start). */
static inline int64_t weight_offset(int kind, int64_t at) {
    return kind == KIND_BF16 || kind == KIND_F16 ? 2 * at
           : kind == KIND_F32                    ? 4 * at
           : kind == KIND_INT8                   ? at
                                                 : block_offset(block_type_of(kind), at);
}

/* Weights w[at .. at + count) as floats into `to`. */
static void widen_row(float *to, const void *w, int kind, int64_t at, int64_t count) {
    int64_t k = 0;
    if (is_block_kind(kind)) { /* whole blocks: a row of a block tensor */
        widen_values(block_type_of(kind), w, at, count, to);
        return;
    }
#ifndef GENERIC
    for (; k + LANES <= count; k += LANES)
        vstore(to + k, widen(w, kind, at + k));
#endif
    for (; k < count; k++)
        to[k] = cache_at(w, kind, at + k);
}

/* Rows [r0, r0 + nr) by outputs [o0, o0 + no), nr <= MAX_ROWS, no <= OUT_TILE. Weights are read
   in their own kind (`wf` NULL) or from their widened copy `wf` ([no, in] floats). */
static inline __attribute__((always_inline)) void tile(const job_t *j, int64_t r0, int nr, int64_t o0, int no,
                                                       const float *wf, int kind) {
    const int64_t in = j->in, whole = in - in % LANES;
    float sums[MAX_ROWS][OUT_TILE];
#ifndef GENERIC
    vec acc[MAX_ROWS][OUT_TILE];
    for (int i = 0; i < MAX_ROWS; i++)
        for (int c = 0; c < OUT_TILE; c++)
            acc[i][c] = vzero();
    int64_t k = 0;
    for (; k < whole; k += LANES) {
        vec wv[OUT_TILE];
        for (int c = 0; c < no; c++) {
            int64_t at = (o0 + c) * in + k;
            wv[c] = wf ? vload(wf + c * in + k) : widen(j->w, kind, at);
            /* A batch's float32 weights, read in place: the next tile's, a tile ahead, by its first rows (an 8-row
               step measurably faster: the reads overlap the products). */
            if (wf && j->kind == KIND_F32 && r0 % ROW_BLOCK == 0)
                __builtin_prefetch(wf + (c + OUT_TILE) * in + k, 0, 3);
            if (!wf && kind != KIND_F32) /* the next tile's weights, a tile ahead (a hint: past the end, nothing):
                                            bf16 steps faster; float32, a line per vector, slower */
                __builtin_prefetch((const char *)j->w + weight_offset(kind, at + OUT_TILE * in), 0, 3);
        }
        for (int i = 0; i < nr; i++) {
            vec xv = vload(j->x + (r0 + i) * in + k);
            for (int c = 0; c < no; c++)
                acc[i][c] = vfma(xv, wv[c], acc[i][c]);
        }
    }
#if LANES == 16 && MAX_ROWS * OUT_TILE == 16
    if (nr * no > 4) /* (the unused accumulators hold zeros) */
        hsum16(&acc[0][0], &sums[0][0]);
    else
#endif
        for (int i = 0; i < nr; i++)
            for (int c = 0; c < no; c++)
                sums[i][c] = hsum(acc[i][c]);
#else
    float lanes[MAX_ROWS][OUT_TILE][LANES];
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < no; c++)
            for (int l = 0; l < LANES; l++)
                lanes[i][c][l] = 0.0f;
    for (int64_t k = 0; k < whole; k += LANES)
        for (int i = 0; i < nr; i++)
            for (int c = 0; c < no; c++)
                for (int l = 0; l < LANES; l++) {
                    float wv = wf ? wf[c * in + k + l] : cache_at(j->w, kind, (o0 + c) * in + k + l);
                    lanes[i][c][l] = fmaf(j->x[(r0 + i) * in + k + l], wv, lanes[i][c][l]);
                }
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < no; c++)
            sums[i][c] = reduce(lanes[i][c]);
#endif
#if LANES == 16 && OUT_TILE == 4
    if (whole == in && no == OUT_TILE) { /* nothing past the vectors: a row's four outputs scaled and stored at once */
        const __m128 scale = j->scale ? _mm_loadu_ps(j->scale + o0) : _mm_setzero_ps();
        const __m128 bias = j->bias ? _mm_loadu_ps(j->bias + o0) : _mm_setzero_ps();
        for (int i = 0; i < nr; i++) { /* (`store`'s operations, lane by lane) */
            __m128 v = _mm_loadu_ps(sums[i]);
            v = j->scale ? _mm_mul_ps(v, scale) : v;
            _mm_storeu_ps(j->y + (r0 + i) * j->ldy + o0, j->bias ? _mm_add_ps(v, bias) : v);
        }
        return;
    }
#endif
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < no; c++)
            store(j, r0 + i, o0 + c, finish(sums[i][c], j->x + (r0 + i) * in, wf ? wf + c * in : NULL, j, o0 + c, whole));
}

/* Constant-size tiles, so the compiler keeps the accumulators in registers. */
static void decode_tile(const job_t *j, int nr, int64_t o0) {
    if (j->kind == KIND_INT8)
        nr == 1 ? tile(j, 0, 1, o0, OUT_TILE, NULL, KIND_INT8) : tile(j, 0, 2, o0, OUT_TILE, NULL, KIND_INT8);
    else if (j->kind == KIND_BF16)
        nr == 1 ? tile(j, 0, 1, o0, OUT_TILE, NULL, KIND_BF16) : tile(j, 0, 2, o0, OUT_TILE, NULL, KIND_BF16);
    else if (j->kind == KIND_F16)
        nr == 1 ? tile(j, 0, 1, o0, OUT_TILE, NULL, KIND_F16) : tile(j, 0, 2, o0, OUT_TILE, NULL, KIND_F16);
    else
        nr == 1 ? tile(j, 0, 1, o0, OUT_TILE, NULL, KIND_F32) : tile(j, 0, 2, o0, OUT_TILE, NULL, KIND_F32);
}

static void batch_tile(const job_t *j, int64_t r0, int64_t o0, const float *wf) {
    tile(j, r0, MAX_ROWS, o0, OUT_TILE, wf, KIND_F32); /* the kind is not read: weights come from wf */
}

static void run(const job_t *j) {
    const int64_t in = j->in;
    if (j->rows <= 2 && !is_block_kind(j->kind)) { /* a decode step: weights widened in registers, read once */
        for (int64_t o = j->o_begin; o < j->o_end; o += OUT_TILE) {
            int no = (int)(j->o_end - o < OUT_TILE ? j->o_end - o : OUT_TILE);
            if (no == OUT_TILE)
                decode_tile(j, (int)j->rows, o);
            else
                tile(j, 0, (int)j->rows, o, no, NULL, j->kind);
        }
        return;
    }
    /* A tile's weights widened once per block of rows; float32 weights are read where they are (their rows
       [o, o + no) are that tile already: a copy made a float32 batch much slower). */
    float *scratch = j->kind == KIND_F32 ? NULL : lined(sizeof(float) * OUT_TILE * in), *wf = scratch;
    if (!scratch && is_block_kind(j->kind)) { /* (`tile` widens only element kinds in registers) */
        atomic_store(j->failed, 1);
        return;
    }
    for (int64_t block = 0; block < j->rows; block += ROW_BLOCK) {
        int64_t block_end = block + ROW_BLOCK < j->rows ? block + ROW_BLOCK : j->rows;
        for (int64_t o = j->o_begin; o < j->o_end; o += OUT_TILE) {
            int no = (int)(j->o_end - o < OUT_TILE ? j->o_end - o : OUT_TILE);
            if (j->kind == KIND_F32)
                wf = (float *)j->w + o * in;
            else if (wf) {
                for (int c = 0; c < no; c++)
                    widen_row(wf + c * in, j->w, j->kind, (o + c) * in, in);
                /* the next tile's codes, on their way while this one's products run (a hint: past the end, none) */
                const char *next = (const char *)j->w + weight_offset(j->kind, (o + OUT_TILE) * in);
                const int64_t span = weight_offset(j->kind, OUT_TILE * in) + (int64_t)((uintptr_t)next & 63);
                for (int64_t line = 0; line < span; line += 64) /* (every line it touches, the last one too) */
                    __builtin_prefetch(next + line, 0, 2);
            }
            int64_t r = block;
            if (no == OUT_TILE && wf)
                for (; r + MAX_ROWS <= block_end; r += MAX_ROWS)
                    batch_tile(j, r, o, wf);
            for (; r < block_end; r += MAX_ROWS) /* no scratch: the same sums, widening in registers */
                tile(j, r, (int)(block_end - r < MAX_ROWS ? block_end - r : MAX_ROWS), o, no, wf, j->kind);
        }
    }
    free(scratch);
}

#ifdef PANEL /* AVX2: batches on panel tiles */
/* A batch's rows [r0, r0 + RV * LANES) by outputs [o0, o0 + NO), with the rows in vectors and each weight broadcast:
   a tile's accumulators read one x vector per RV * NO multiply-adds where `tile` reads NO + RV. The sums are
   `tile`'s bit for bit: `tile` keeps LANES partial sums per row and output, partial sum l taking k = l, l + LANES,
   ... in turn, then sums them as `hsum` does; here lane l's products run as one pass over k = l, l + LANES, ...
   (x laid out for it by `lay_lanes`: `xl`), and the LANES passes' sums are added as `hsum` adds a vector's lanes,
   one row per vector lane. The tail past the last whole vector of `in` is `finish`'s, as in `tile`. */
static inline __attribute__((always_inline)) void panel_tile(const job_t *j, const float *xl, int64_t r0, int64_t o0,
                                                             const float *wf, const float *next, const int RV,
                                                             const int NO) {
    const int64_t in = j->in, steps = in / LANES, group = RV * LANES, lines = next ? NO * in / 16 : 0;
    vec part[PANEL][2][LANES];
    for (int l = 0; l < LANES; l++) {
        vec acc[2][PANEL];
        for (int v = 0; v < RV; v++)
            for (int c = 0; c < NO; c++)
                acc[v][c] = vzero();
        const float *xs = xl + l * steps * group, *ws = wf + l;
        for (int64_t s = 0; s < steps; s++, xs += group, ws += LANES) {
            int64_t line = 2 * (l * steps + s);
            if (line < lines) { /* the next tile's weights into L2, two lines a step, while this one's products run */
                __builtin_prefetch(next + 16 * line, 0, 2);
                __builtin_prefetch(next + 16 * line + 16, 0, 2);
            }
            vec xv[2];
            for (int v = 0; v < RV; v++)
                xv[v] = vload(xs + v * LANES);
            for (int c = 0; c < NO; c++) {
                vec wv = vset1(ws[c * in]);
                for (int v = 0; v < RV; v++)
                    acc[v][c] = vfma(xv[v], wv, acc[v][c]);
            }
        }
        for (int v = 0; v < RV; v++)
            for (int c = 0; c < NO; c++)
                part[c][v][l] = acc[v][c];
    }
    for (int c = 0; c < NO; c++)
        for (int v = 0; v < RV; v++) {
            vec *p = part[c][v];
            for (int half = LANES / 2; half >= 1; half /= 2) /* hsum's pairs: lane i with lane i + half */
                for (int i = 0; i < half; i++)
                    p[i] = vplus(p[i], p[i + half]);
            float sums[LANES];
            vstore(sums, p[0]);
            for (int i = 0; i < LANES; i++) {
                int64_t r = r0 + v * LANES + i;
                store(j, r, o0 + c, finish(sums[i], j->x + r * in, wf + c * in, j, o0 + c, steps * LANES));
            }
        }
}

/* x's rows [0, rows) by whole groups of RV * LANES rows, lane-major: group g's value for row i, k = s * LANES + l
   at xl[g * group * whole + (l * steps + s) * group + i], whole = steps * LANES. */
static void lay_lanes(float *xl, const float *x, int64_t rows, int64_t in, int64_t group) {
    const int64_t steps = in / LANES;
    for (int64_t g = 0; g + group <= rows; g += group)
        for (int l = 0; l < LANES; l++)
            for (int64_t s = 0; s < steps; s++, xl += group)
                for (int64_t i = 0; i < group; i++)
                    xl[i] = x[(g + i) * in + s * LANES + l];
}

typedef struct {
    job_t job;
    const float *xl; /* `lay_lanes`'s x, rows [0, paired) in groups of 2 * LANES, then one of LANES if `single` */
    int64_t paired;
    int single;
} panel_job;

/* Units of PANEL outputs of a batch: the grouped rows on panel tiles, the rest (fewer than LANES) on `run`. */
static void panel_rows(const void *task, int64_t begin, int64_t end) {
    const panel_job *p = task;
    const job_t *j = &p->job;
    const int64_t in = j->in, o_end = end * PANEL < j->out ? end * PANEL : j->out, whole = in / LANES * LANES;
    float *scratch = j->kind == KIND_F32 ? NULL : malloc(sizeof(float) * PANEL * in);
    int64_t o = begin * PANEL;
    if (j->kind != KIND_F32 && !scratch) { /* no memory for a panel: `run` (a smaller scratch, or it fails) */
        job_t all = *j;
        all.o_begin = o;
        all.o_end = o_end;
        run(&all);
        return;
    }
    for (; o + PANEL <= o_end; o += PANEL) {
        const float *wf = (const float *)j->w + o * in;
        if (scratch) {
            for (int c = 0; c < PANEL; c++)
                widen_row(scratch + c * in, j->w, j->kind, (o + c) * in, in);
            wf = scratch;
        }
        int64_t r = 0;
        /* the next panel's weights, asked for by the first rows (none past this unit's outputs) */
        const float *next = scratch || o + 2 * PANEL > o_end ? NULL : wf + PANEL * in;
        for (; r < p->paired; r += 2 * LANES) {
            panel_tile(j, p->xl + r * whole, r, o, wf, r ? NULL : next, 2, PANEL / 2);
            panel_tile(j, p->xl + r * whole, r, o + PANEL / 2, wf + PANEL / 2 * in,
                       next && !r ? next + PANEL / 2 * in : NULL, 2, PANEL / 2);
        }
        if (p->single)
            panel_tile(j, p->xl + r * whole, r, o, wf, r ? NULL : next, 1, PANEL);
    }
    free(scratch);
    const int64_t grouped = p->paired + (p->single ? LANES : 0);
    job_t rest = *j; /* the rows left over, and the outputs past the last whole panel: `tile`'s sums all the same */
    rest.x += grouped * in;
    rest.y += grouped * j->ldy;
    rest.rows -= grouped;
    rest.o_begin = begin * PANEL;
    rest.o_end = o_end;
    if (rest.rows > 0)
        run(&rest);
    if (o < o_end && grouped > 0) {
        rest = *j;
        rest.rows = grouped;
        rest.o_begin = o;
        rest.o_end = o_end;
        run(&rest);
    }
}
#endif

/* Helper threads, started on first need and kept. `parallel` hands out units by publishing a new
   `ticket`: a generation count and how many threads take part. Helper t < that count and the caller
   take a share of the units left at a time (`next`) until none is left, and count them `done`; the others go back
   to sleep at once (a node whose core share shrank must not keep its extra helpers spinning). The
   caller returns once every unit is done, never waiting for a helper that took none: a helper whose
   core another node's step took delays the call by the units it holds, not by a fixed share (nodes
   on one host lend each other their cores: `cores`). A unit's values do not depend on the thread that
   computes it. A helper that took part spins (yielding its core) for SPIN_NS afterwards, since a
   decode step's products come tens of microseconds apart, then sleeps on `wake`. One call at a time
   uses them (`busy`); a caller that finds them taken computes alone. */

#define MAX_THREADS 64
#define THREAD_WORK 100000 /* multiply-adds below which one thread does it all */
#define SPIN_NS 200000
#define UNIT_SHARES 4 /* a thread takes 1 / (this * threads) of the units left (at least one) */

typedef void (*work_fn)(const void *task, int64_t begin, int64_t end);

static struct {
    pthread_mutex_t busy, sleep;
    pthread_cond_t wake;
    atomic_ullong ticket; /* generation << 32 | threads taking part */
    atomic_ullong next;   /* generation << 32 | the first unit not yet taken */
    atomic_llong done;    /* units computed, this generation */
    int helpers;
    unsigned long long first_ticket[MAX_THREADS];
    work_fn work;
    const void *task;
    int64_t units, threads;
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER, .sleep = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

/* A forked child has none of its parent's helpers (nor a consistent pool): it starts over. */
static void forget_helpers(void) {
    pthread_mutex_init(&pool.busy, NULL);
    pthread_mutex_init(&pool.sleep, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.helpers = 0;
}

__attribute__((constructor)) static void on_load(void) { pthread_atfork(NULL, NULL, forget_helpers); }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Units of `generation`'s work, a share of those left at a time (smaller as fewer are left, so that the threads
   finish together), until none is left. A unit taken is computed before the caller
   can see them all done, so the work, task and sizes read after taking one are that generation's; read before
   (another call's, if it began meanwhile), the compare-exchange fails on the slot that call replaced. */
static void take_units(unsigned long long generation) {
    for (;;) {
        unsigned long long slot = atomic_load_explicit(&pool.next, memory_order_acquire);
        int64_t begin, take;
        do {
            begin = (int64_t)(slot & 0xffffffffu);
            if (slot >> 32 != generation || begin >= pool.units)
                return;
            take = (pool.units - begin) / (UNIT_SHARES * pool.threads);
            take = take < 1 ? 1 : take;
        } while (!atomic_compare_exchange_weak_explicit(&pool.next, &slot, slot + (unsigned long long)take,
                                                        memory_order_acq_rel, memory_order_acquire));
        const int64_t end = begin + take;
        pool.work(pool.task, begin, end);
        atomic_fetch_add_explicit(&pool.done, end - begin, memory_order_release);
    }
}

static void *helper(void *arg) {
    int me = (int)(intptr_t)arg, spin = 0;
    unsigned long long seen = pool.first_ticket[me], ticket;
    for (;;) {
        ticket = atomic_load_explicit(&pool.ticket, memory_order_acquire);
        if (ticket == seen && spin) {
            int64_t until = now_ns() + SPIN_NS;
            while ((ticket = atomic_load_explicit(&pool.ticket, memory_order_acquire)) == seen && now_ns() < until)
                sched_yield();
        }
        if (ticket == seen) {
            pthread_mutex_lock(&pool.sleep);
            while ((ticket = atomic_load_explicit(&pool.ticket, memory_order_acquire)) == seen)
                pthread_cond_wait(&pool.wake, &pool.sleep);
            pthread_mutex_unlock(&pool.sleep);
        }
        seen = ticket;
        int threads = (int)(ticket & 0xffffffffu);
        spin = me < threads;
        if (spin)
            take_units(ticket >> 32);
    }
    return NULL;
}

/* work(task, begin, end) over units [0, units), on up to `threads` threads, each taking a share of the units left at a
   time: a helper that lost its core (another node computes on it) delays the call by the units it holds (an eighth of
   them at most, with two threads), not its share. */
static void parallel(work_fn work, const void *task, int64_t units, int threads) {
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads > units)
        threads = (int)units;
    if (threads < 2 || units >= (1LL << 31) || pthread_mutex_trylock(&pool.busy) != 0) {
        work(task, 0, units);
        return;
    }
    unsigned long long generation = ((atomic_load(&pool.ticket) >> 32) + 1) & 0xffffffffu;
    while (pool.helpers < threads - 1) {
        pthread_t id;
        int me = pool.helpers + 1;
        pool.first_ticket[me] = atomic_load(&pool.ticket);
        if (pthread_create(&id, NULL, helper, (void *)(intptr_t)me) != 0)
            break;
        pthread_detach(id);
        pool.helpers = me;
    }
    if (threads > pool.helpers + 1)
        threads = pool.helpers + 1;
    pool.work = work;
    pool.task = task;
    pool.units = units;
    pool.threads = threads;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    atomic_store_explicit(&pool.next, generation << 32, memory_order_release);
    atomic_store_explicit(&pool.ticket, generation << 32 | (unsigned)threads, memory_order_release);
    pthread_mutex_lock(&pool.sleep);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.sleep);
    take_units(generation);
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < units)
        sched_yield();
    /* None left to take, whatever the next call's units: a late helper that read this generation's slot
       fails to take it from the next call (its compare-exchange sees another slot). */
    atomic_store_explicit(&pool.next, generation << 32 | 0xffffffffu, memory_order_release);
    pthread_mutex_unlock(&pool.busy);
}

static void linear_tiles(const void *task, int64_t begin, int64_t end) {
    job_t part = *(const job_t *)task;
    part.o_begin = begin * OUT_TILE;
    part.o_end = end * OUT_TILE < part.out ? end * OUT_TILE : part.out;
    run(&part);
}

#include "quants.c"

/* threads: how many may compute (the caller's share of the cores). Returns 0, or -1 when a block tensor's tiles
   found no memory to be widened into (y is then not all written). */
int mw_linear(const float *x, int64_t rows, int64_t in, const void *w, int kind, const float *scale, const float *bias,
              float *y, int64_t ldy, int64_t out, int threads) {
    atomic_int failed = 0;
    job_t whole = {x, w, scale, bias, y, rows, in, out, 0, out, ldy, kind, &failed};
#ifdef PANEL
    if (rows >= LANES && in >= LANES) { /* a batch: rows in vectors, weights broadcast (`panel_tile`) */
        panel_job p = {whole, NULL, rows / (2 * LANES) * 2 * LANES, rows % (2 * LANES) >= LANES};
        float *xl = malloc(sizeof(float) * (p.paired + LANES) * in);
        if (xl) {
            lay_lanes(xl, x, p.paired, in, 2 * LANES);
            if (p.single)
                lay_lanes(xl + p.paired * (in / LANES * LANES), x + p.paired * in, LANES, in, LANES);
            p.xl = xl;
            parallel(panel_rows, &p, (out + PANEL - 1) / PANEL, rows * in * out < THREAD_WORK ? 1 : threads);
            free(xl);
            return atomic_load(&failed) ? -1 : 0;
        }
    }
#endif
    parallel(linear_tiles, &whole, (out + OUT_TILE - 1) / OUT_TILE, rows * in * out < THREAD_WORK ? 1 : threads);
    return atomic_load(&failed) ? -1 : 0;
}

static inline float to_bf16(float x) { /* round to nearest even, as torch's .to(bfloat16) (NaN kept NaN) */
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        bits |= 0x00400000u;
    else
        bits += 0x7fffu + ((bits >> 16) & 1u);
    bits &= 0xffff0000u;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* mw_amx_linear: y = x W^T (+ bias) for bfloat16 weights on Intel's AMX tiles, where the CPU has
   them (-march=native turns on __AMX_BF16__) and Linux lets this process use them (`mw_amx`).

   x is float32 [rows, in] holding bfloat16 values (a bf16 model's activations are rounded to
   bf16 before every product), so its conversion to bf16 is exact. The weights come repacked
   once (`native.amx_tiles`): for outputs n0..n0+15 and inputs k0..k0+31, one 1 KiB tile of 16
   lines, line p holding (w[n0 + c, k0 + 2p], w[n0 + c, k0 + 2p + 1]) for c = 0..15, which is
   the pair layout TDPBF16PS multiplies; the four tiles of 64 outputs for inputs k0..k0+31 lie
   side by side, then those for the next 32 inputs, so a group of outputs reads one stream.
   Each output sums its 32-input tiles in input order,
   each tile's pairs as the hardware sums them, in float32: a row's result is the same alone
   or in any batch (the tiles' rows are independent), on any thread count. out % 64 == 0 and
   in % 32 == 0 (the caller checks). A 16-row batch costs little more than one row here: the
   tiles do 16 x 16 x 32 multiply-adds per instruction, where a vector does 16. */

static void bf16_bits(uint16_t *to, const float *from, int64_t count);
static void upper_halves(uint16_t *to, const float *from, int64_t count) __attribute__((unused));

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1
#define AMX_ROWS 16  /* rows of a tile */
#define AMX_K 32     /* bf16 inputs per tile line (64 bytes) */
#define AMX_N 16     /* outputs per tile */
#define AMX_GROUP 4  /* output tiles of a unit: accumulators tmm0..3; x in tmm4, 5, weights in tmm6, 7 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
} tile_config;

typedef struct {
    const uint16_t *x;     /* [padded rows, in] bf16 */
    const uint16_t *tiles; /* the repacked weights */
    float *y;              /* [rows, out] */
    int64_t blocks, in, out, valid; /* valid: the rows of x and y (x is padded to whole tiles with zeros) */
    int rows; /* rows of each tile: 16, or all of a batch of fewer */
} amx_job;

static void amx_configure(int rows) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 4; t++) { /* accumulators: rows x 16 floats */
        config.rows[t] = (uint8_t)rows;
        config.bytes_per_row[t] = AMX_N * 4;
    }
    for (int t = 4; t < 6; t++) { /* x: rows x 32 bf16 (two blocks of rows) */
        config.rows[t] = (uint8_t)rows;
        config.bytes_per_row[t] = AMX_K * 2;
    }
    for (int t = 6; t < 8; t++) { /* weights: 16 pair lines x 16 outputs */
        config.rows[t] = AMX_K / 2;
        config.bytes_per_row[t] = AMX_N * 4;
    }
    _tile_loadconfig(&config);
}

#define TILE (AMX_K * AMX_N) /* bf16 values in a weight tile */
#define AMX_AHEAD 8          /* KiB of weights prefetched ahead of the tiles read */

static inline __attribute__((always_inline)) void amx_zero(void) { /* the four accumulators */
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

static inline void amx_ahead(const uint16_t *w) { /* a hint: the group's tiles AMX_AHEAD KiB on (past the end: none) */
    for (int line = 0; line < AMX_GROUP * TILE * 2; line += 64)
        __builtin_prefetch((const char *)w + AMX_AHEAD * 1024 + line, 0, 3);
}

/* Blocks of rows `block`, `block + 1` by the group's tiles `first`, `first + 1`: each tile loaded serves two products
   (four loads for four, where a block by four tiles takes five, and weights are read from L2 half as often), which
   is what bounds a prompt's products. Each output still sums its chunks in order: the same bits. */
static inline __attribute__((always_inline)) void amx_pass(const amx_job *j, const uint16_t *group, int64_t block,
                                                           int first) {
    const int64_t chunks = j->in / AMX_K;
    const uint16_t *x = j->x + block * AMX_ROWS * j->in;
    amx_zero();
    for (int64_t c = 0; c < chunks; c++) {
        const uint16_t *w = group + (c * AMX_GROUP + first) * TILE;
        if (block == 0 && first == 0) /* later passes find these tiles in L2 */
            amx_ahead(w);
        _tile_loadd(4, x + c * AMX_K, j->in * 2);
        _tile_loadd(6, w, AMX_N * 4);
        _tile_loadd(7, w + TILE, AMX_N * 4);
        _tile_loadd(5, x + AMX_ROWS * j->in + c * AMX_K, j->in * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
}

/* Tile `t` of rows [block, block + 1) stored at output tile `at` of the group: rows past the batch's end (the last
   block's padding) go to a spill, not past y's end. */
#define AMX_STORE(t, block, at)                                                                          \
    do {                                                                                                 \
        float *y_ = j->y + (block) * AMX_ROWS * j->out + unit * AMX_GROUP * AMX_N + (at) * AMX_N;         \
        const int64_t valid_ = j->valid - (block) * AMX_ROWS;                                             \
        if (valid_ >= j->rows)                                                                           \
            _tile_stored(t, y_, j->out * 4);                                                             \
        else {                                                                                           \
            float spill_[AMX_ROWS * AMX_N];                                                              \
            _tile_stored(t, spill_, AMX_N * 4);                                                          \
            for (int64_t r_ = 0; r_ < valid_; r_++)                                                      \
                memcpy(y_ + r_ * j->out, spill_ + r_ * AMX_N, sizeof(float) * AMX_N);                     \
        }                                                                                                \
    } while (0)

/* A lone block of rows by the group's four tiles: one x tile loaded for four products. */
static inline __attribute__((always_inline)) void amx_lone(const amx_job *j, const uint16_t *group, int64_t block) {
    const int64_t chunks = j->in / AMX_K;
    const uint16_t *x = j->x + block * AMX_ROWS * j->in;
    amx_zero();
    for (int64_t c = 0; c < chunks; c++) {
        const uint16_t *w = group + c * AMX_GROUP * TILE;
        if (block == 0)
            amx_ahead(w);
        _tile_loadd(4, x + c * AMX_K, j->in * 2);
        _tile_loadd(6, w, AMX_N * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, w + TILE, AMX_N * 4);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(6, w + 2 * TILE, AMX_N * 4);
        _tile_dpbf16ps(2, 4, 6);
        _tile_loadd(7, w + 3 * TILE, AMX_N * 4);
        _tile_dpbf16ps(3, 4, 7);
    }
}

static void amx_units(const void *task, int64_t begin, int64_t end) { /* units: groups of AMX_GROUP output tiles */
    const amx_job *j = task;
    const int64_t chunks = j->in / AMX_K;
    amx_configure(j->rows);
    for (int64_t unit = begin; unit < end; unit++) {
        const uint16_t *group = j->tiles + unit * chunks * AMX_GROUP * TILE; /* its tiles, in the order read */
        int64_t block = 0;
        for (; block + 1 < j->blocks; block += 2)
            for (int first = 0; first < AMX_GROUP; first += 2) {
                amx_pass(j, group, block, first);
                AMX_STORE(0, block, first);
                AMX_STORE(1, block, first + 1);
                AMX_STORE(2, block + 1, first);
                AMX_STORE(3, block + 1, first + 1);
            }
        if (block < j->blocks) {
            amx_lone(j, group, block);
            AMX_STORE(0, block, 0);
            AMX_STORE(1, block, 1);
            AMX_STORE(2, block, 2);
            AMX_STORE(3, block, 3);
        }
    }
    _tile_release();
}

static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static int amx_allowed;

static void amx_request(void) {
    amx_allowed = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

/* 1 when this process may use the tiles: Linux asks each process to request them once (children inherit it). */
int mw_amx(void) {
    pthread_once(&amx_once, amx_request);
    return amx_allowed;
}

/* `exact`: x holds bf16 values already (to_bf16's outputs), whose upper halves are their bf16 bits; else each is
   rounded to nearest. Returns 0, or -1 without the tiles or without memory (nothing written). */
static int amx_product(const float *x, int64_t rows, int64_t in, const void *tiles, const float *bias, float *y,
                       int64_t out, int exact, int threads) {
    if (!mw_amx() || in % AMX_K || out % (AMX_N * AMX_GROUP) || rows < 1)
        return -1;
    const int64_t padded = rows < AMX_ROWS ? rows : (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    uint16_t *wide = malloc(sizeof(uint16_t) * padded * in);
    if (!wide)
        return -1;
    (exact ? upper_halves : bf16_bits)(wide, x, rows * in);
    memset(wide + rows * in, 0, sizeof(uint16_t) * (padded - rows) * in);
    amx_job job = {wide, tiles, y, padded < AMX_ROWS ? 1 : padded / AMX_ROWS, in, out, rows,
                   (int)(padded < AMX_ROWS ? padded : AMX_ROWS)};
    const int64_t units = out / (AMX_N * AMX_GROUP);
    parallel(amx_units, &job, units, rows * in * out < THREAD_WORK ? 1 : threads);
    if (bias)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t o = 0; o < out; o++)
                y[r * out + o] += bias[o];
    free(wide);
    return 0;
}

int mw_amx_linear(const float *x, int64_t rows, int64_t in, const void *tiles, const float *bias, float *y,
                  int64_t out, int threads) {
    return amx_product(x, rows, in, tiles, bias, y, out, 0, threads);
}
#else
int mw_amx(void) { return 0; }

static int amx_product(const float *x, int64_t rows, int64_t in, const void *tiles, const float *bias, float *y,
                       int64_t out, int exact, int threads) {
    (void)x, (void)rows, (void)in, (void)tiles, (void)bias, (void)y, (void)out, (void)exact, (void)threads;
    return -1;
}

int mw_amx_linear(const float *x, int64_t rows, int64_t in, const void *tiles, const float *bias, float *y,
                  int64_t out, int threads) {
    (void)x, (void)rows, (void)in, (void)tiles, (void)bias, (void)y, (void)out, (void)threads;
    return -1;
}
#endif

/* mw_attend: one query position per row against that row's own cache (a decode step of a batch
   of sessions whose caches differ in length), after writing the row's new key and value there.

   Row r's cache lies in blocks of `block` positions: position p in blocks[first[r] + p / block],
   at p % block. A block is [layers][2][kv_heads][block][dim] of the cache's kind (float32 or
   bfloat16): each layer's keys, then its values; blocks may be shared by several rows' caches
   (a prefix computed once), and only the row's own block is written. Its new key and value
   (new_keys, new_values: [rows, kv_heads, dim], the same kind) go to position at[r] of `layer`;
   it attends to positions low[r] .. at[r]. Queries q and the
   output are float32 [rows, heads, dim]; query head h reads key head h / (heads / kv_heads).
   Scores and softmax are float32: s = scale * q.k (the dot in lanes as above), then
   exp(s - max) summed in position order, and the output sum_t e_t v_t / sum_t e_t. A row's
   result is the same alone or in any batch, on any thread count. */

typedef struct {
    int64_t rows, heads, kv_heads, dim;
    const float *q;
    const void *new_keys, *new_values;
    void *const *blocks;
    const int64_t *first, *low, *at;
    int64_t block, layer;
    int kind;
    float scale;
    float *out;
    atomic_int *failed; /* set when a unit found no memory for its scores (the caller undoes the step) */
} attend_t;

#define STACK_SCORES 4096 /* floats of scores kept on the stack; longer rows take the heap */
#define MLP_ROWS 64 /* rows of a fused step whose MLP runs at once (its gate, up and activations: 3 x inter each) */
#define STACK_WIDE (Q8_RUN * 128) /* floats of widened Q8_0 rows kept on the stack (heads of up to 128 values) */
#define CACHE_AHEAD 8     /* cache rows a key's or value's loop asks for ahead (a hint: past the end, nothing) */

#ifndef GENERIC
#if LANES == 16
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vneg(a) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0x80000000u)))
#define vadd(a, b) _mm512_add_ps(a, b)
#define vdiv(a, b) _mm512_div_ps(a, b)
#define vmin(a, b) _mm512_min_ps(a, b)
#define vmax(a, b) _mm512_max_ps(a, b)
#define vnearest(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vscale2(y, n) _mm512_scalef_ps(y, n) /* y * 2^n, to 0 or inf past the range */
#define vround_bf16(v) _mm512_castsi512_ps(round_bits(_mm512_castps_si512(v)))
static inline __m512i round_bits(__m512i bits) { /* to_bf16 on a vector: the same bits lane by lane */
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    up = _mm512_mask_or_epi32(up, nan, bits, _mm512_set1_epi32(0x00400000));
    return _mm512_and_si512(up, _mm512_set1_epi32((int)0xffff0000u));
}
#else
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vneg(a) _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)) /* the sign flipped, as the scalar -a (NaN included) */
#define vadd(a, b) _mm256_add_ps(a, b)
#define vdiv(a, b) _mm256_div_ps(a, b)
#define vmin(a, b) _mm256_min_ps(a, b)
#define vmax(a, b) _mm256_max_ps(a, b)
#define vnearest(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vscale2(y, n) scale2(y, n)
static inline __m256 pow2(__m256i n) { /* 2^n for a normal power: the exponent field built by hand */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
static inline __m256 scale2(__m256 y, __m256 n) { /* y * 2^n in two halves, each a normal power: 0 or inf past range */
    __m256i whole = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(whole, 1);
    return _mm256_mul_ps(_mm256_mul_ps(y, pow2(half)), pow2(_mm256_sub_epi32(whole, half)));
}
#define vround_bf16(v) _mm256_castsi256_ps(round_bits(_mm256_castps_si256(v)))
static inline __m256i round_bits(__m256i bits) {
    const __m256i sign_off = _mm256_set1_epi32((int)0x80000000u); /* unsigned compare by flipping the sign bit */
    __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_xor_si256(magnitude, sign_off),
                                     _mm256_xor_si256(_mm256_set1_epi32(0x7f800000), sign_off));
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    up = _mm256_blendv_epi8(up, _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000)), nan);
    return _mm256_and_si256(up, _mm256_set1_epi32((int)0xffff0000u));
}
#endif

/* exp on vectors: Cephes' expf polynomial, within an ulp of libm's expf (SiLU's and attention's weights). NaN stays
   NaN: min and max return their second operand on one. */
static inline vec vexp(vec x) {
    x = vmax(vset1(-104.0f), vmin(vset1(89.0f), x));
    vec n = vnearest(vmul(x, vset1(1.44269504088896341f)));
    x = vfma(n, vset1(-0.693359375f), x);
    x = vfma(n, vset1(2.12194440e-4f), x);
    vec p = vset1(1.9875691500e-4f);
    p = vfma(p, x, vset1(1.3981999507e-3f));
    p = vfma(p, x, vset1(8.3334519073e-3f));
    p = vfma(p, x, vset1(4.1665795894e-2f));
    p = vfma(p, x, vset1(1.6666665459e-1f));
    p = vfma(p, x, vset1(5.0000001201e-1f));
    p = vfma(p, vmul(x, x), vadd(x, vset1(1.0f)));
    return vscale2(p, n);
}
#endif

static inline void ahead(const char *p, size_t bytes) { /* a cache row's lines, soon read: a bf16 step gains a little */
    for (size_t b = 0; b < bytes; b += 64)
        __builtin_prefetch(p + b, 0, 3);
}

static float dot(const float *q, const void *k, int kind, int64_t dim) {
    const int64_t whole = dim - dim % LANES;
#ifndef GENERIC
    vec acc = vzero();
    for (int64_t d = 0; d < whole; d += LANES)
        acc = vfma(vload(q + d), kind == KIND_F32 ? vload((const float *)k + d) : widen_bf16((const uint16_t *)k + d), acc);
    float sum = hsum(acc);
#else
    float lanes[LANES];
    for (int l = 0; l < LANES; l++)
        lanes[l] = 0.0f;
    for (int64_t d = 0; d < whole; d += LANES)
        for (int l = 0; l < LANES; l++)
            lanes[l] = fmaf(q[d + l], cache_at(k, kind, d + l), lanes[l]);
    float sum = reduce(lanes);
#endif
    for (int64_t d = whole; d < dim; d++)
        sum = fmaf(q[d], cache_at(k, kind, d), sum);
    return sum;
}

#if LANES == 8 && !defined(GENERIC)
/* Lane j: `hsum`(a[j]), bit for bit (each sum of its tree: lanes l and l + 4, then + 2, then + 1), eight at once. */
static inline __m256 hsum8(const __m256 *a) {
    __m256 h[4], p[2];
    for (int i = 0; i < 4; i++) /* h[i]: lanes l + (l + 4) of a[2i] | of a[2i + 1] */
        h[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    for (int i = 0; i < 2; i++) /* p[i]: (0 + 2, 1 + 3) of a[4i], a[4i + 2] | of a[4i + 1], a[4i + 3] */
        p[i] = _mm256_add_ps(_mm256_shuffle_ps(h[2 * i], h[2 * i + 1], 0x44),
                             _mm256_shuffle_ps(h[2 * i], h[2 * i + 1], 0xee));
    const __m256 f = _mm256_add_ps(_mm256_shuffle_ps(p[0], p[1], 0x88), _mm256_shuffle_ps(p[0], p[1], 0xdd));
    return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)); /* (f: 0 2 4 6 | 1 3 5 7) */
}
#endif

/* Position `pos` of row `row`'s cache in the task's layer: its key (`value` 0) or its value, of key head `head`. */
static inline char *cache_row(const attend_t *a, int64_t row, int value, int64_t head, int64_t pos) {
    char *base = (char *)a->blocks[a->first[row] + pos / a->block];
    return base + ((size_t)((a->layer * 2 + value) * a->kv_heads + head) * (size_t)a->block + (size_t)(pos % a->block))
                      * row_bytes(a->kind, a->dim);
}

/* ggml's Q8_0 rows (`quantize_row_q8_0_ref`): per 32 values d = max |x| / 127, kept as float16, and x / d rounded
   to int8 (0 when d is). `dim` a multiple of 32. */
static void to_q8_0(uint8_t *to, const float *from, int64_t count) {
    for (int64_t b = 0; b < count / 32; b++) {
        const float *x = from + 32 * b;
        uint8_t *block = to + 34 * b;
        float top = 0.0f;
        for (int i = 0; i < 32; i++)
            top = fmaxf(top, fabsf(x[i]));
        const float d = top / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
        const uint16_t half = float_to_half(d);
        memcpy(block, &half, 2);
        for (int i = 0; i < 32; i++) {
            const float q = roundf(x[i] * inverse);
            block[2 + i] = (uint8_t)(int8_t)(q == q ? q : 0.0f); /* (a NaN stays defined: 0) */
        }
    }
}

/* Q8_0 rows widened as gguf dequantizes them: d (the float16 widened) times each int8. */
static void from_q8_0(float *to, const uint8_t *from, int64_t count) {
    for (int64_t b = 0; b < count / 32; b++) {
        const float d = half_to_float(from + 34 * b);
        for (int i = 0; i < 32; i++)
            to[32 * b + i] = d * (float)(int8_t)from[34 * b + 2 + i];
    }
}

int mw_to_q8_0(const float *from, int64_t count, uint8_t *to) {
    if (count % 32)
        return -1;
    to_q8_0(to, from, count);
    return 0;
}

/* q8_0 keys and values are kept turned: each head's values by the orthonormal Walsh-Hadamard matrix of its largest
   power-of-two part (a 64-value head: H64), which spreads one outlier over the head instead of leaving it to set
   the scale of its 32-value block. q.k is the same for turned q and k (H is orthogonal), and the output of
   attention over turned values is turned back with H again (H is its own inverse). One function turns them on
   every path (`mw_decode`, and `lean` around `mw_attend` and torch's attention), so their bits agree. */
static void turn(float *x, int64_t heads, int64_t dim) {
    const int64_t size = dim & -dim;
    const float norm = 1.0f / sqrtf((float)size);
    for (int64_t at = 0; at < heads * dim; at += size) {
        float *v = x + at;
        for (int64_t half = 1; half < size; half *= 2)
            for (int64_t i = 0; i < size; i += 2 * half)
                for (int64_t j = i; j < i + half; j++) {
                    const float a = v[j], b = v[j + half];
                    v[j] = a + b;
                    v[j + half] = a - b;
                }
        for (int64_t i = 0; i < size; i++)
            v[i] *= norm;
    }
}

void mw_turn(float *x, int64_t heads, int64_t dim) { turn(x, heads, dim); }


/* s[t] = scale * dot(q, key t) for the `count` cache rows from `keys`. */
static void key_scores(const float *q, const char *keys, int64_t count, int64_t dim, int kind, float scale, float *s) {
    const size_t stride = (size_t)dim * (kind == KIND_F32 ? 4 : 2);
    for (int64_t t = 0; t < count; t++) {
        ahead(keys + (size_t)(t + CACHE_AHEAD) * stride, stride);
        s[t] = scale * dot(q, keys + (size_t)t * stride, kind, dim);
    }
}

/* Every row's new key and value into its cache, before any row attends: rows of one session at
   consecutive positions (a multi-token step) then each see the keys of the rows before them. */
static void store_rows(const attend_t *a) {
    const size_t bytes = row_bytes(a->kind, a->dim);
    for (int64_t unit = 0; unit < a->rows * a->kv_heads; unit++) {
        const int64_t row = unit / a->kv_heads, head = unit % a->kv_heads;
        memcpy(cache_row(a, row, 0, head, a->at[row]), (const char *)a->new_keys + (size_t)unit * bytes, bytes);
        memcpy(cache_row(a, row, 1, head, a->at[row]), (const char *)a->new_values + (size_t)unit * bytes, bytes);
    }
}

#ifndef GENERIC
/* value[d0 .. d0 + n LANES) += sum_t s[t] v_t[d] over t in order, in n vector registers (a chain through memory
   cost a store and a load per key). */
static inline __attribute__((always_inline)) void weigh_block(float *value, const float *s, const char *v,
                                                              int64_t count, int64_t dim, int kind, int64_t d0, int n) {
    vec acc[4];
    for (int i = 0; i < n; i++)
        acc[i] = vload(value + d0 + i * LANES);
    const size_t stride = (size_t)dim * (kind == KIND_F32 ? 4 : 2);
    for (int64_t t = 0; t < count; t++, v += stride) {
        ahead(v + CACHE_AHEAD * stride + d0 * (stride / dim), (size_t)n * LANES * (stride / dim));
        const vec weight = vset1(s[t]);
        for (int i = 0; i < n; i++)
            acc[i] = vfma(weight, kind == KIND_F32 ? vload((const float *)v + d0 + i * LANES)
                                                   : widen_bf16((const uint16_t *)v + d0 + i * LANES), acc[i]);
    }
    for (int i = 0; i < n; i++)
        vstore(value + d0 + i * LANES, acc[i]);
}

static void weigh_kind(float *value, const float *s, const char *v, int64_t count, int64_t dim, int kind) {
    int64_t d = 0;
    for (; d + 4 * LANES <= dim; d += 4 * LANES)
        weigh_block(value, s, v, count, dim, kind, d, 4);
    for (; d + LANES <= dim; d += LANES)
        weigh_block(value, s, v, count, dim, kind, d, 1);
}
#endif

/* value[d] += sum_t s[t] v_t[d] for the `count` cache rows from `v`: each a fused multiply-add chain over t in order,
   whatever the loop that computes it (a row's blocks in turn go on with the chains). */
static void weigh_values(float *value, const float *s, const char *v, int64_t count, int64_t dim, int kind) {
    int64_t whole = 0;
#ifndef GENERIC
    whole = dim - dim % LANES;
    kind == KIND_F32 ? weigh_kind(value, s, v, count, dim, KIND_F32) : weigh_kind(value, s, v, count, dim, KIND_BF16);
#endif
    const size_t stride = (size_t)dim * (kind == KIND_F32 ? 4 : 2);
    for (int64_t d = whole; d < dim; d++) {
        float sum = value[d];
        for (int64_t t = 0; t < count; t++)
            sum = fmaf(s[t], cache_at(v + t * stride, kind, d), sum);
        value[d] = sum;
    }
}

/* s[t] = exp(s[t] - top) for t < count: `vexp` on vectors (a call of libm's expf a score, with the running total
   kept in memory across it, had been a sizeable share of a long prompt's attention), libm's expf in plain C. */
static void exp_scores(float *s, int64_t count, float top) {
#ifndef GENERIC
    const int64_t whole = count - count % LANES;
    for (int64_t t = 0; t < whole; t += LANES)
        vstore(s + t, vexp(vplus(vload(s + t), vset1(-top))));
    if (whole < count) {
        float part[LANES];
        for (int l = 0; l < LANES; l++)
            part[l] = top; /* (lanes past count: exp(0), never an overflow) */
        memcpy(part, s + whole, sizeof(float) * (size_t)(count - whole));
        vstore(part, vexp(vplus(vload(part), vset1(-top))));
        memcpy(s + whole, part, sizeof(float) * (size_t)(count - whole));
    }
#else
    for (int64_t t = 0; t < count; t++)
        s[t] = expf(s[t] - top);
#endif
}

#if LANES == 8 && !defined(GENERIC)
#define GROUP_DIM 256 /* the widest head the grouped loops below take (their widened rows are on the stack) */
#define GROUP_ROWS 16 /* cache rows of values widened at a time */
#define GROUPED(call) call

/* scores[g stride + t] = scale * dot(q_g, key t) for a key head's `group` query heads (q_g = q + g dim), `dot`'s chains and
   sums: each block of eight keys widened once for all the heads, then scored eight at a time (their chains overlap;
   one key's dependent multiply-adds and lane sum had bound attention by their latency), the lane sums by `hsum8`. */
static void group_scores(const float *q, int64_t group, const char *keys, int64_t count, int64_t dim, int kind,
                         float scale, float *scores, int64_t stride_scores) {
    const size_t stride = (size_t)dim * (kind == KIND_F32 ? 4 : 2);
    float wide[8 * GROUP_DIM];
    int64_t t = 0;
    for (; t + 8 <= count; t += 8) {
        const char *k = keys + (size_t)t * stride;
        ahead(k + CACHE_AHEAD * stride, 8 * stride);
        for (int j = 0; j < 8; j++)
            for (int64_t d = 0; d < dim; d += LANES)
                vstore(wide + j * dim + d, kind == KIND_F32 ? vload((const float *)(k + j * stride) + d)
                                                            : widen_bf16((const uint16_t *)(k + j * stride) + d));
        for (int64_t g = 0; g < group; g++) {
            __m256 acc[8];
            for (int j = 0; j < 8; j++)
                acc[j] = vzero();
            for (int64_t d = 0; d < dim; d += LANES)
                for (int j = 0; j < 8; j++)
                    acc[j] = vfma(vload(q + g * dim + d), vload(wide + j * dim + d), acc[j]);
            vstore(scores + g * stride_scores + t, vtimes(vset1(scale), hsum8(acc)));
        }
    }
    for (; t < count; t++)
        for (int64_t g = 0; g < group; g++)
            scores[g * stride_scores + t] = scale * dot(q + g * dim, keys + (size_t)t * stride, kind, dim);
}

/* value[g][d] += sum_t scores[g stride + t] v_t[d] (as `weigh_values`: one multiply-add chain over t in order per
   value), GROUP_ROWS cache rows widened at a time for all the group's heads; the chains wait in `value` between. */
static void group_values(float *value, const float *scores, int64_t stride_scores, int64_t group, const char *v,
                         int64_t count, int64_t dim, int kind) {
    const size_t stride = (size_t)dim * (kind == KIND_F32 ? 4 : 2);
    float wide[GROUP_ROWS * GROUP_DIM];
    for (int64_t t0 = 0; t0 < count; t0 += GROUP_ROWS) {
        const int64_t n = count - t0 < GROUP_ROWS ? count - t0 : GROUP_ROWS;
        const char *rows = v + (size_t)t0 * stride;
        ahead(rows + GROUP_ROWS * stride, GROUP_ROWS * stride);
        for (int64_t t = 0; t < n; t++)
            for (int64_t d = 0; d < dim; d += LANES)
                vstore(wide + t * dim + d, kind == KIND_F32 ? vload((const float *)(rows + t * stride) + d)
                                                            : widen_bf16((const uint16_t *)(rows + t * stride) + d));
        for (int64_t g = 0; g < group; g++) {
            const float *s = scores + g * stride_scores + t0;
            float *into = value + g * dim;
            int64_t d = 0;
            for (; d + 4 * LANES <= dim; d += 4 * LANES) {
                vec acc[4];
                for (int i = 0; i < 4; i++)
                    acc[i] = vload(into + d + i * LANES);
                for (int64_t t = 0; t < n; t++)
                    for (int i = 0; i < 4; i++)
                        acc[i] = vfma(vset1(s[t]), vload(wide + t * dim + d + i * LANES), acc[i]);
                for (int i = 0; i < 4; i++)
                    vstore(into + d + i * LANES, acc[i]);
            }
            for (; d < dim; d += LANES) {
                vec acc = vload(into + d);
                for (int64_t t = 0; t < n; t++)
                    acc = vfma(vset1(s[t]), vload(wide + t * dim + d), acc);
                vstore(into + d, acc);
            }
        }
    }
}
#else
#define GROUP_DIM 0           /* (no grouped loops in this build) */
#define GROUPED(call) (void)0
#endif

/* The first rows of the row's next block (from `p`, if it attends there) asked for ahead: a block's rows lie apart
   from the last's, where neither the loops' own hints nor the CPU's prefetcher look. */
static inline void next_block(const attend_t *a, int64_t row, int value, int64_t head, int64_t p, int64_t at) {
    if (p <= at)
        ahead(cache_row(a, row, value, head, p), (size_t)(at - p + 1 < CACHE_AHEAD ? at - p + 1 : CACHE_AHEAD)
                                                     * row_bytes(a->kind, a->dim));
}

/* `count` cache rows from `rows` as attention reads them: as stored, or (Q8_0) widened into `into`. */
static const char *widen_rows(const attend_t *a, const char *rows, int64_t count, float *into) {
    if (a->kind != KIND_Q8_0)
        return rows;
    from_q8_0(into, (const uint8_t *)rows, count * a->dim);
    return (const char *)into;
}

static void attend_units(const void *task, int64_t begin, int64_t end) {
    const attend_t *a = task;
    const int64_t dim = a->dim, group = a->heads / a->kv_heads;
    for (int64_t unit = begin; unit < end; unit++) { /* one row's one key head and its query heads */
        const int64_t row = unit / a->kv_heads, head = unit % a->kv_heads;
        const int64_t low = a->low[row], at = a->at[row], count = at - low + 1;
        const int kind = a->kind == KIND_Q8_0 ? KIND_F32 : a->kind; /* Q8_0: each block's rows widened first */
        const int64_t run = a->kind == KIND_Q8_0 && a->block % Q8_RUN == 0 ? Q8_RUN : a->block; /* rows widened at once */
        const size_t wide = a->kind == KIND_Q8_0 ? (size_t)(run * dim) : 0; /* (on the stack where it fits) */
        const size_t need = (size_t)(count * group + dim * group + group) + (wide > STACK_WIDE ? wide : 0);
        float stack[STACK_SCORES], *scores = need <= STACK_SCORES ? stack : malloc(sizeof(float) * need);
        float wide_stack[STACK_WIDE];
        if (!scores) {
            atomic_store(a->failed, 1);
            continue;
        }
        float *value = scores + count * group, *totals = value + dim * group;
        float *widened = wide > STACK_WIDE ? totals + group : wide_stack;
        const float *q = a->q + ((row * a->heads) + head * group) * dim; /* query head g's: q + g dim */
        const int grouped = dim % LANES == 0 && dim <= GROUP_DIM; /* each key and value widened once for the heads */
        for (int64_t p = low, n; p <= at; p += n) { /* the row's blocks in turn */
            n = run - p % run < at - p + 1 ? run - p % run : at - p + 1;
            next_block(a, row, 0, head, p + n, at);
            const char *keys = widen_rows(a, cache_row(a, row, 0, head, p), n, widened);
            if (grouped)
                GROUPED(group_scores(q, group, keys, n, dim, kind, a->scale, scores + (p - low), count));
            else
                for (int64_t g = 0; g < group; g++)
                    key_scores(q + g * dim, keys, n, dim, kind, a->scale, scores + g * count + (p - low));
        }
        for (int64_t g = 0; g < group; g++) {
            float *s = scores + g * count, top = -INFINITY, total = 0.0f;
            for (int64_t t = 0; t < count; t++)
                top = s[t] > top ? s[t] : top;
            exp_scores(s, count, top);
            for (int64_t t = 0; t < count; t++)
                total += s[t];
            totals[g] = total;
        }
        for (int64_t i = 0; i < group * dim; i++)
            value[i] = 0.0f;
        for (int64_t p = low, n; p <= at; p += n) {
            n = run - p % run < at - p + 1 ? run - p % run : at - p + 1;
            next_block(a, row, 1, head, p + n, at);
            const char *values = widen_rows(a, cache_row(a, row, 1, head, p), n, widened);
            if (grouped)
                GROUPED(group_values(value, scores + (p - low), count, group, values, n, dim, kind));
            else
                for (int64_t g = 0; g < group; g++)
                    weigh_values(value + g * dim, scores + g * count + (p - low), values, n, dim, kind);
        }
        for (int64_t g = 0; g < group; g++) {
            float *out = a->out + ((row * a->heads) + head * group + g) * dim;
            for (int64_t d = 0; d < dim; d++)
                out[d] = value[g * dim + d] / totals[g];
        }
        if (scores != stack)
            free(scores);
    }
}

/* Every row's new key and value stored, then every row attended, on as many threads as the work is worth. */
static void attend_rows(const attend_t *a, int threads) {
    int64_t work = 0;
    for (int64_t r = 0; r < a->rows; r++)
        work += (a->at[r] - a->low[r] + 1) * a->heads * a->dim * 2;
    store_rows(a);
    parallel(attend_units, a, a->rows * a->kv_heads, work < THREAD_WORK ? 1 : threads);
}

/* Returns 0, or -1 if some row found no memory (the caller undoes the step: see `decode_rows`). */
int mw_attend(int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, const float *q, const void *new_keys,
               const void *new_values, void *const *blocks, const int64_t *first, int64_t block, int64_t layer,
               const int64_t *low, const int64_t *at, int kind, float scale, float *out, int threads) {
    atomic_int failed = 0;
    attend_t task = {rows, heads, kv_heads, dim, q, new_keys, new_values, blocks, first, low, at, block, layer,
                     kind, scale, out, &failed};
    attend_rows(&task, threads);
    return atomic_load(&failed) ? -1 : 0;
}

/* mw_decode: a Llama-style decode step through all of a shard's layers in one call, for a batch
   of rows each at its own position of its own cache (the lean path's `run_rows`, framework-free).

   Per layer, as transformers' modules compute it: x = rmsnorm(h) * w_in; q, k, v = x Wqkv (one
   matrix, or three: a GGUF's tensors, each with its bias: Qwen2's); Qwen3's per-head RMS norms of
   q and k; rotary on q and k (cos, sin per row: [rows, dim], pairs rotated as `rotate_half` does,
   i and i + dim/2, or with `rope_pairs` 2i and 2i + 1: a GGUF's Llama rows, which llama.cpp keeps
   in that order); the new k, v written to the row's cache and attention as in mw_attend; h += att
   Wo; x = rmsnorm(h) * w_post; h += (silu(x Wg) * x Wu) Wd. With `q8`, products on block weights
   quantize x to 8 bits (`mw_qlinear`), once for q, k and v and once for gate and up; else they are
   exact float32 (`mw_linear`). With `round_bf16` every value torch's bf16 path would
   hold in bfloat16 is rounded to bfloat16 where torch rounds it (each product's output, as its
   reader loads it; each norm, rotary term, activation and sum), so a bf16 model gives its torch
   tokens up to the order of the sums; otherwise all is float32 (SiLU's exp and attention's are `vexp`, within an
   ulp of libm's expf, as torch's own vectorised exp may differ from it by an ulp). The hidden state `h`
   [rows, hidden] is float32 in and out. */

typedef struct {
    const void *w;
    const float *scale, *bias;
    int64_t out, in;
    int kind;
    int _pad;
    const void *tiles; /* bf16 weights repacked for AMX (`mw_amx_linear`), or NULL */
} mw_weight;

typedef struct {
    mw_weight qkv[3]; /* q, k, v as one matrix (the others' `out` 0) or three */
    mw_weight o;
    mw_weight gate_up[2]; /* gate and up, one matrix or two */
    mw_weight down;
    const float *norm_in, *norm_post;
    const float *q_norm, *k_norm; /* per-head RMS norm weights [dim] of q and k (Qwen3), or NULL */
} mw_layer;

#define R(x) (round_bf16 ? to_bf16(x) : (x))

/* SiLU's gate times the up projection, a row at a time: with g = R(gate) and u = R(up), the products' outputs
   rounded as they are read, act = R(R(g / (1 + exp(-g))) * u). The exp is
   Cephes' expf polynomial on vectors (within an ulp of libm's; through scalar expf calls SiLU was a large share of a
   prompt's elementwise time). A row's element i always takes the same lane of the same code, so a
   row's values are the same alone or in any batch; the last `n % LANES` take it through a padded vector. */
#ifndef GENERIC
static inline vec silu_times(vec g, vec u, int round_bf16) { /* g and u as summed: rounded here first */
    if (round_bf16) {
        g = vround_bf16(g);
        u = vround_bf16(u);
    }
    vec s = vdiv(g, vadd(vset1(1.0f), vexp(vmul(g, vset1(-1.0f)))));
    if (round_bf16)
        s = vround_bf16(s);
    s = vmul(s, u);
    return round_bf16 ? vround_bf16(s) : s;
}
#endif

static void silu_row(const float *gate, const float *up, float *act, int64_t n, int round_bf16) {
#ifndef GENERIC
    const int64_t whole = n - n % LANES;
    for (int64_t i = 0; i < whole; i += LANES)
        vstore(act + i, silu_times(vload(gate + i), vload(up + i), round_bf16));
    if (whole < n) {
        float g[LANES] = {0}, u[LANES] = {0}, out[LANES];
        memcpy(g, gate + whole, sizeof(float) * (n - whole));
        memcpy(u, up + whole, sizeof(float) * (n - whole));
        vstore(out, silu_times(vload(g), vload(u), round_bf16));
        memcpy(act + whole, out, sizeof(float) * (n - whole));
    }
#else
    for (int64_t i = 0; i < n; i++) {
        const float g = R(gate[i]);
        act[i] = R(R(g / (1.0f + expf(-g))) * R(up[i]));
    }
#endif
}

/* The elementwise passes between products, on vectors: `vround_bf16` gives `to_bf16`'s bits lane by lane, and
   a sum or product of two floats rounds the same in a lane as in a scalar, so each is exact as the scalar loop. */

static void round_all(float *y, int64_t count) { /* y = to_bf16(y) */
    int64_t i = 0;
#ifndef GENERIC
    for (; i + LANES <= count; i += LANES)
        vstore(y + i, vround_bf16(vload(y + i)));
#endif
    for (; i < count; i++)
        y[i] = to_bf16(y[i]);
}

static void add_into(float *h, const float *add, int64_t count, int round_bf16) { /* h = R(h + R(add)) */
    int64_t i = 0;
#ifndef GENERIC
    for (; i + LANES <= count; i += LANES) {
        vec sum = vadd(vload(h + i), round_bf16 ? vround_bf16(vload(add + i)) : vload(add + i));
        vstore(h + i, round_bf16 ? vround_bf16(sum) : sum);
    }
#endif
    for (; i < count; i++)
        h[i] = R(h[i] + R(add[i]));
}

static void upper_halves(uint16_t *to, const float *from, int64_t count) { /* bf16_bits of bf16 values */
    int64_t i = 0;
#if LANES == 16 && !defined(GENERIC)
    for (; i + LANES <= count; i += LANES)
        _mm256_storeu_si256((__m256i *)(to + i),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(vload(from + i)), 16)));
#endif
    for (; i < count; i++) {
        uint32_t bits;
        memcpy(&bits, from + i, sizeof bits);
        to[i] = (uint16_t)(bits >> 16);
    }
}

static void bf16_bits(uint16_t *to, const float *from, int64_t count) { /* to_bf16's upper halves */
    int64_t i = 0;
#if LANES == 16 && !defined(GENERIC)
    for (; i + LANES <= count; i += LANES)
        _mm256_storeu_si256((__m256i *)(to + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(
                                                     round_bits(_mm512_castps_si512(vload(from + i))), 16)));
#endif
    for (; i < count; i++) {
        float rounded = to_bf16(from[i]);
        uint32_t bits;
        memcpy(&bits, &rounded, sizeof bits);
        to[i] = (uint16_t)(bits >> 16);
    }
}

/* y = R(x) W^T as summed: with `round_bf16`, whoever reads y rounds it to bf16 as it loads it (`add_into`,
   `silu_times`; q, k and v a row at a time, while the row is in L1 for the rotary loop and the cache), where a
   pass of its own over all of y cost a prompt measurable time. x is
   rounded here unless it holds bf16 values already (`rounded`); AMX rounds it as it converts it to bf16.
   Returns 0, or -1 when the AMX product found no memory: the step fails (the caller undoes it) rather than
   summing another way, which would make a row's bits depend on the batch whose size ran out of memory. */
static int product(const mw_weight *parts, int count, float *x, int64_t rows, float *y, int round_bf16, int rounded,
                   int q8, int threads) {
    const mw_weight *w = parts;
    if (count == 1 && w->tiles && round_bf16)
        return amx_product(x, rows, w->in, w->tiles, w->bias, y, w->out, rounded, threads) ? -1 : 0;
    if (round_bf16 && !rounded)
        round_all(x, rows * w->in);
    int64_t ldy = 0;
    for (int p = 0; p < count; p++)
        ldy += parts[p].out;
    uint8_t *quantized[3] = {NULL, NULL, NULL}; /* x in each layout the parts need, quantized once */
    int failed = 0;
    int64_t at = 0; /* where part p's outputs start in a row of y */
    for (int p = 0; p < count && !failed; at += parts[p].out, p++) {
        const mw_weight *part = parts + p;
        if (q8 && is_block_kind(part->kind)) { /* the 8-bit products */
            const block_type *t = block_type_of(part->kind);
            const int layout = layout_of(t);
            if (!quantized[layout] && !(quantized[layout] = quantize_rows(x, rows, part->in, layout)))
                failed = 1;
            else
                failed = q_product(t, quantized[layout], rows, part->in, part->w, part->bias, y + at, ldy, part->out,
                                   threads, PATH_CHOSEN) != 0;
        } else
            failed = mw_linear(x, rows, part->in, part->w, part->kind, part->scale, part->bias, y + at, ldy, part->out,
                               threads) != 0;
    }
    for (int layout = 0; layout < 3; layout++)
        free(quantized[layout]);
    return failed ? -1 : 0;
}

#define NORM_ROWS 8 /* rows whose sums of squares run side by side */

/* x = R(weight * R(h * inverse)) for one row, given its sum of squares. */
static void rms_scale(const float *h, const float *weight, int64_t width, float eps, float squares, float *x,
                      int round_bf16) {
    float inverse = 1.0f / sqrtf(squares / (float)width + eps);
    int64_t i = 0;
#ifndef GENERIC
    for (const vec scale = vset1(inverse); i + LANES <= width; i += LANES) { /* exact, as `add_into` */
        vec scaled = vmul(vload(h + i), scale);
        scaled = vmul(vload(weight + i), round_bf16 ? vround_bf16(scaled) : scaled);
        vstore(x + i, round_bf16 ? vround_bf16(scaled) : scaled);
    }
#endif
    for (; i < width; i++)
        x[i] = R(weight[i] * R(h[i] * inverse));
}

/* Each row's sum of squares is a chain of adds in element order (a row's bits never depend on its batch); a chain
   waits on each add, so NORM_ROWS rows' chains run side by side. */
static void rms_norm(const float *h, const float *weight, int64_t rows, int64_t width, float eps, float *x,
                     int round_bf16) {
    for (int64_t r0 = 0; r0 < rows; r0 += NORM_ROWS) {
        const int n = (int)(rows - r0 < NORM_ROWS ? rows - r0 : NORM_ROWS);
        float squares[NORM_ROWS] = {0};
        const float *row = h + r0 * width;
        if (n == NORM_ROWS)
            for (int64_t i = 0; i < width; i++)
                for (int r = 0; r < NORM_ROWS; r++)
                    squares[r] += row[r * width + i] * row[r * width + i];
        else
            for (int r = 0; r < n; r++)
                for (int64_t i = 0; i < width; i++)
                    squares[r] += row[r * width + i] * row[r * width + i];
        for (int r = 0; r < n; r++)
            rms_scale(row + r * width, weight, width, eps, squares[r], x + (r0 + r) * width, round_bf16);
    }
}

static void rotate(float *x, const float *cos, const float *sin, int64_t dim, int round_bf16, int pairs) {
    const int64_t half = dim / 2;
    int64_t i = 0;
    if (pairs) { /* (x[2i], x[2i + 1]) by angle i, as `rotate_half` turns (x[i], x[i + half]): the same operations */
        for (; i < half; i++) {
            float a = x[2 * i], b = x[2 * i + 1];
            x[2 * i] = R(R(a * cos[i]) + R(-b * sin[i]));
            x[2 * i + 1] = R(R(b * cos[i + half]) + R(a * sin[i + half]));
        }
        return;
    }
#ifndef GENERIC
    for (; i + LANES <= half; i += LANES) { /* exact, as `add_into` */
#define RV(v) (round_bf16 ? vround_bf16(v) : (v))
        const vec a = vload(x + i), b = vload(x + i + half), minus_b = vneg(b);
        const vec first = vadd(RV(vmul(a, vload(cos + i))), RV(vmul(minus_b, vload(sin + i))));
        const vec second = vadd(RV(vmul(b, vload(cos + i + half))), RV(vmul(a, vload(sin + i + half))));
        vstore(x + i, RV(first));
        vstore(x + i + half, RV(second));
#undef RV
    }
#endif
    for (; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = R(R(a * cos[i]) + R(-b * sin[i]));
        x[i + half] = R(R(b * cos[i + half]) + R(a * sin[i + half]));
    }
}

static void to_cache(void *to, int kind, const float *from, int64_t count) {
    if (kind == KIND_F32) {
        memcpy(to, from, sizeof(float) * count);
        return;
    }
    if (kind == KIND_Q8_0) {
        to_q8_0(to, from, count);
        return;
    }
    bf16_bits(to, from, count);
}

/* blocks, first, block: the rows' caches, as for mw_attend; low, at: [rows]. Returns 0, or -1 when
   attention or a product found no memory (the caller undoes the step, as for mw_attend). */
int mw_decode(int64_t rows, int64_t layers, const mw_layer *layer, int64_t width, int64_t heads, int64_t kv_heads,
              int64_t dim, float eps, float scale, int round_bf16, float *h, const float *cos, const float *sin,
              void *const *blocks, const int64_t *first, int64_t block, const int64_t *low,
              const int64_t *at, int cache_kind, int rope_pairs, int q8, int threads) {
    const int qkv_parts = layer[0].qkv[1].out ? 3 : 1, gate_up_parts = layer[0].gate_up[1].out ? 2 : 1;
    const int64_t inter = (layer[0].gate_up[0].out + layer[0].gate_up[1].out) / 2;
    const int64_t q_size = heads * dim, kv_size = kv_heads * dim;
    const int64_t qkv_size = q_size + 2 * kv_size, size = (int64_t)row_bytes(cache_kind, kv_size); /* a row's */
    const int64_t mlp_rows = rows < MLP_ROWS ? rows : MLP_ROWS; /* the MLP's rows at a time: a prompt's chunk of
                                                                  hundreds of rows holds a quarter of the memory */
    const int64_t floats = rows * (width + qkv_size + 2 * q_size + width) + mlp_rows * 3 * inter;
    float *x = lined(sizeof(float) * floats);
    char *fresh = malloc((size_t)(2 * rows * size));
    if (!x || !fresh) {
        free(x);
        free(fresh);
        return -1;
    }
    float *qkv = x + rows * width, *q = qkv + rows * qkv_size, *att = q + rows * q_size;
    float *out = att + rows * q_size, *gate_up = out + rows * width, *act = gate_up + mlp_rows * 2 * inter;
    char *new_keys = fresh, *new_values = fresh + rows * size;
    atomic_int failed = 0;
    for (int64_t l = 0; l < layers && !atomic_load(&failed); l++) {
        const mw_layer *p = layer + l;
        rms_norm(h, p->norm_in, rows, width, eps, x, round_bf16);
        if (product(p->qkv, qkv_parts, x, rows, qkv, round_bf16, 1, q8, threads)) {
            atomic_store(&failed, 1);
            break;
        }
        for (int64_t r = 0; r < rows; r++) {
            float *row = qkv + r * qkv_size;
            if (round_bf16) /* (the product left it as summed) */
                round_all(row, qkv_size);
            if (p->q_norm) /* each head of q and of k normed on its own (Qwen3), before the rotary */
                rms_norm(row, p->q_norm, heads, dim, eps, row, round_bf16);
            if (p->k_norm)
                rms_norm(row + q_size, p->k_norm, kv_heads, dim, eps, row + q_size, round_bf16);
            for (int64_t head = 0; head < heads; head++)
                rotate(row + head * dim, cos + r * dim, sin + r * dim, dim, round_bf16, rope_pairs);
            for (int64_t head = 0; head < kv_heads; head++)
                rotate(row + q_size + head * dim, cos + r * dim, sin + r * dim, dim, round_bf16, rope_pairs);
            if (cache_kind == KIND_Q8_0) /* (q, k and v: heads + 2 * kv_heads heads of dim) */
                turn(row, heads + 2 * kv_heads, dim);
            memcpy(q + r * q_size, row, sizeof(float) * q_size);
            to_cache(new_keys + r * size, cache_kind, row + q_size, kv_size);
            to_cache(new_values + r * size, cache_kind, row + q_size + kv_size, kv_size);
        }
        attend_t task = {rows, heads, kv_heads, dim, q, new_keys, new_values, blocks, first, low, at, block, l,
                         cache_kind, scale, att, &failed};
        attend_rows(&task, threads);
        if (atomic_load(&failed))
            break;
        if (cache_kind == KIND_Q8_0)
            turn(att, rows * heads, dim);
        if (product(&p->o, 1, att, rows, out, round_bf16, 0, q8, threads)) {
            atomic_store(&failed, 1);
            break;
        }
        add_into(h, out, rows * width, round_bf16);
        rms_norm(h, p->norm_post, rows, width, eps, x, round_bf16);
        for (int64_t r0 = 0; r0 < rows && !atomic_load(&failed); r0 += mlp_rows) { /* (a row's bits: the same) */
            const int64_t n = rows - r0 < mlp_rows ? rows - r0 : mlp_rows;
            if (product(p->gate_up, gate_up_parts, x + r0 * width, n, gate_up, round_bf16, 1, q8, threads)) {
                atomic_store(&failed, 1);
                break;
            }
            for (int64_t r = 0; r < n; r++)
                silu_row(gate_up + r * 2 * inter, gate_up + r * 2 * inter + inter, act + r * inter, inter,
                         round_bf16);
            if (product(&p->down, 1, act, n, out + r0 * width, round_bf16, 1, q8, threads))
                atomic_store(&failed, 1);
        }
        if (atomic_load(&failed))
            break;
        add_into(h, out, rows * width, round_bf16);
    }
    free(x);
    free(fresh);
    return atomic_load(&failed) ? -1 : 0;
}
