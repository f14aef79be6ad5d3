/* GGUF's block types, as stored in the file: one table, exact widening, and products with 8-bit activations.
   #included by kernels.c, whose vector macros, `lined` and thread pool (`parallel`) it uses.

   The table (`TYPES`, keyed by ggml's type id; `block_types.py` is its Python twin and a test walks both) gives each
   type's block: how many values and bytes, and `unpack`, which turns up to 256 values (one K-quant super-block, or
   up to eight 32-value blocks) into signed codes c and, per 16 values, a float scale a (and, where the type has
   one, an offset b), so that value = a * c (+ b) with the very float32 operations `gguf.quants.dequantize` does:
     Q4_0  d * (q - 8)          Q4_1  d * q + m          Q5_0  d * (q - 16)      Q5_1  d * q + m
     Q8_0  q * d                Q4_K  (d * sc) * q - (dmin * m)                 Q5_K  likewise, 5-bit q
     Q6_K  (d * sc) * (q - 32)
     Q2_K  (d * sc) * q - (dmin * m), 2-bit q, 4-bit sc and m     Q3_K  (d * (sc - 32)) * (q - 4), 3-bit q
     IQ4_NL  d * K[q]     IQ4_XS  (d * (sc - 32)) * K[q], 6-bit sc per 32 values; K: 16 fixed signed bytes
   (d, m, dmin float16 as float32; sc, m 6-bit; Q6_K's sc a signed byte per 16 values). `widen_values` gives those
   floats bit for bit: a product of float32 weights read from a GGUF (`--dtype float32`) is the product of the
   weights transformers dequantizes.

   The default products (`mw_qlinear`) do what llama.cpp does for its speed: each activation row is quantized to
   signed 8 bits, with one float scale per 32 values for 32-value block types and per 256 for K-quants (round to
   nearest; `quantize_rows`), and a block's codes, made unsigned (u = c + offset), meet it in integer dot products
   (AVX-512 VNNI's vpdpbusd: 4 products a lane, exact in int32; AVX2's K-quant loops: `kquants_avx2.c`), scaled
   in float32: K-quants per 16 values (an offset's share is b' times the sum of the 16 activations; below), the
   32-value types per block (`blocks32.c`). A row's result is the same alone or in any batch and on any thread
   count: each (row, output) pair sums its parts in one order. */

#define QK 256 /* values an unpacked unit holds */
#define GROUP 16 /* values sharing a scale in an unpacked unit */

typedef void (*unpack_fn)(const uint8_t *src, int n, int8_t *codes, float *a, float *b);

/* The product loops written for one type's bytes, per instruction set (`FUSED_DOTS`, `v_shuffled`, `v2_tiles`: what
   a build has). A product path chooses by a row's `loop`, never by a type id. Where a build has no loop for a row's
   `loop` (plain C; LOOP_ANY, a type added with its `unpack` alone), its products take the generic path through
   `unpack`, summed in the loops' order: the same bits, only slower. */
enum {
    LOOP_ANY, LOOP_Q4_0, LOOP_Q4_1, LOOP_Q5_0, LOOP_Q5_1, LOOP_Q8_0, LOOP_Q2_K, LOOP_Q3_K, LOOP_Q4_K, LOOP_Q5_K,
    LOOP_Q6_K, LOOP_IQ4_NL, LOOP_IQ4_XS, LOOPS
};

typedef struct block_type {
    int type; /* ggml's id */
    int elements, bytes; /* a block's */
    int offset; /* added to the codes to make them unsigned for the 8-bit products */
    int has_b; /* value = a * c + b (else a * c, with no addition: -0.0 stays -0.0) */
    int loop; /* LOOP_*: its own product loops, or LOOP_ANY */
    unpack_fn unpack;
} block_type;

static inline float half_to_float(const uint8_t *p) { /* IEEE float16 -> float32, exact (NaN payloads kept) */
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1f)
        bits = sign | 0x7f800000u | (mantissa << 13);
    else if (exponent)
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else if (!mantissa)
        bits = sign;
    else { /* subnormal: normalise */
        int shift = 0;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            shift++;
        }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* -- unpacking, type by type: `n` values (QK for a K-quant; a multiple of 32, at most QK, for the others) ---- */

static void set_groups(float *a, float *b, int first, int count, float av, float bv) {
    for (int g = first; g < first + count; g++) {
        a[g] = av;
        if (b)
            b[g] = bv;
    }
}

static void unpack_q4_0(const uint8_t *src, int n, int8_t *codes, float *a, float *b) {
    (void)b;
    for (int k = 0; k < n / 32; k++, src += 18) {
        set_groups(a, NULL, 2 * k, 2, half_to_float(src), 0.0f);
        for (int i = 0; i < 16; i++) {
            codes[32 * k + i] = (int8_t)((src[2 + i] & 15) - 8);
            codes[32 * k + 16 + i] = (int8_t)((src[2 + i] >> 4) - 8);
        }
    }
}

static void unpack_q4_1(const uint8_t *src, int n, int8_t *codes, float *a, float *b) {
    for (int k = 0; k < n / 32; k++, src += 20) {
        set_groups(a, b, 2 * k, 2, half_to_float(src), half_to_float(src + 2));
#if LANES == 16 && !defined(GENERIC)
        const __m128i q = _mm_loadu_si128((const __m128i *)(src + 4)), low = _mm_set1_epi8(15);
        _mm_storeu_si128((__m128i *)(codes + 32 * k), _mm_and_si128(q, low));
        _mm_storeu_si128((__m128i *)(codes + 32 * k + 16), _mm_and_si128(_mm_srli_epi16(q, 4), low));
#else
        for (int i = 0; i < 16; i++) {
            codes[32 * k + i] = (int8_t)(src[4 + i] & 15);
            codes[32 * k + 16 + i] = (int8_t)(src[4 + i] >> 4);
        }
#endif
    }
}

static void unpack_q5_0(const uint8_t *src, int n, int8_t *codes, float *a, float *b) {
    (void)b;
    for (int k = 0; k < n / 32; k++, src += 22) {
        set_groups(a, NULL, 2 * k, 2, half_to_float(src), 0.0f);
        uint32_t high;
        memcpy(&high, src + 2, 4);
        for (int i = 0; i < 32; i++) {
            int low = i < 16 ? src[6 + i] & 15 : src[6 + i - 16] >> 4;
            codes[32 * k + i] = (int8_t)((low | (int)((high >> i) & 1) << 4) - 16);
        }
    }
}

static void unpack_q5_1(const uint8_t *src, int n, int8_t *codes, float *a, float *b) {
    for (int k = 0; k < n / 32; k++, src += 24) {
        set_groups(a, b, 2 * k, 2, half_to_float(src), half_to_float(src + 2));
        uint32_t high;
        memcpy(&high, src + 4, 4);
        for (int i = 0; i < 32; i++) {
            int low = i < 16 ? src[8 + i] & 15 : src[8 + i - 16] >> 4;
            codes[32 * k + i] = (int8_t)(low | (int)((high >> i) & 1) << 4);
        }
    }
}

static void unpack_q8_0(const uint8_t *src, int n, int8_t *codes, float *a, float *b) {
    (void)b;
    for (int k = 0; k < n / 32; k++, src += 34) {
        set_groups(a, NULL, 2 * k, 2, half_to_float(src), 0.0f);
        memcpy(codes + 32 * k, src + 2, 32);
    }
}

/* A K-quant's eight 6-bit scales and mins, as gguf's `Q4_K.get_scale_min` unpacks them. */
static void scales_and_mins(const uint8_t *s, int *scale, int *min) {
    for (int j = 0; j < 4; j++) {
        scale[j] = s[j] & 63;
        min[j] = s[4 + j] & 63;
        scale[4 + j] = (s[8 + j] & 15) | ((s[j] >> 2) & 0x30);
        min[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
    }
}

static void k_scales(const uint8_t *src, float *a, float *b) {
    const float d = half_to_float(src), dmin = half_to_float(src + 2);
    int scale[8], min[8];
    scales_and_mins(src + 4, scale, min);
    for (int j = 0; j < 8; j++) {
        float dm = dmin * (float)min[j];
        set_groups(a, b, 2 * j, 2, d * (float)scale[j], -dm); /* (d * q) - dm is (d * q) + (-dm), bit for bit */
    }
}

static void unpack_q4_K(const uint8_t *src, int n, int8_t *codes, float *a, float *b) {
    (void)n;
    k_scales(src, a, b);
    const uint8_t *qs = src + 16;
#if LANES == 16 && !defined(GENERIC)
    const __m256i low = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; c++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        _mm256_storeu_si256((__m256i *)(codes + 64 * c), _mm256_and_si256(q, low));
        _mm256_storeu_si256((__m256i *)(codes + 64 * c + 32), _mm256_and_si256(_mm256_srli_epi16(q, 4), low));
    }
#else
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 32; i++) {
            codes[64 * c + i] = (int8_t)(qs[32 * c + i] & 15);
            codes[64 * c + 32 + i] = (int8_t)(qs[32 * c + i] >> 4);
        }
#endif
}

static void unpack_q5_K(const uint8_t *src, int n, int8_t *codes, float *a, float *b) {
    (void)n;
    k_scales(src, a, b);
    const uint8_t *qh = src + 16, *qs = src + 48;
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 32; i++) {
            int low = (qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 15;
            codes[32 * j + i] = (int8_t)(low | ((qh[i] >> j) & 1) << 4);
        }
}

static void unpack_q6_K(const uint8_t *src, int n, int8_t *codes, float *a, float *b) {
    (void)n, (void)b;
    const uint8_t *ql = src, *qh = src + 128;
    const int8_t *scales = (const int8_t *)(src + 192);
    const float d = half_to_float(src + 208);
    for (int g = 0; g < 16; g++)
        a[g] = d * (float)scales[g];
#if LANES == 16 && !defined(GENERIC)
    const __m512i low = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3), bias = _mm512_set1_epi8(32);
    for (int h = 0; h < 2; h++) {
        const __m512i l = _mm512_loadu_si512(ql + 64 * h);
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        const __m512i high01 = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 2), 1);
        const __m512i high23 = _mm512_srli_epi16(high01, 4);
        const __m512i first = _mm512_or_si512(_mm512_and_si512(l, low),
                                              _mm512_slli_epi16(_mm512_and_si512(high01, two), 4));
        const __m512i second = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low),
                                               _mm512_slli_epi16(_mm512_and_si512(high23, two), 4));
        _mm512_storeu_si512(codes + 128 * h, _mm512_sub_epi8(first, bias));
        _mm512_storeu_si512(codes + 128 * h + 64, _mm512_sub_epi8(second, bias));
    }
#else
    for (int h = 0; h < 2; h++)
        for (int r = 0; r < 128; r++) {
            int l = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 15;
            int high = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
            codes[128 * h + r] = (int8_t)((l | high << 4) - 32);
        }
#endif
}

/* Q2_K: 16 bytes of scales (4-bit sc, 4-bit m above it) per 16 values, then 64 bytes of 2-bit codes (value
   128h + 32s + i at bits 2s of byte 32h + i), then d and dmin. */
static void unpack_q2_K(const uint8_t *src, int n, int8_t *codes, float *a, float *b) {
    (void)n;
    const float d = half_to_float(src + 80), dmin = half_to_float(src + 82);
    for (int g = 0; g < 16; g++) {
        a[g] = d * (float)(src[g] & 15);
        b[g] = -(dmin * (float)(src[g] >> 4));
    }
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int i = 0; i < 32; i++)
                codes[128 * h + 32 * s + i] = (int8_t)((src[16 + 32 * h + i] >> (2 * s)) & 3);
}

/* Q3_K: 32 bytes of high bits (value 32b + i at bit b of byte i: set, the code is its low bits; clear, 4 less),
   64 bytes of low 2-bit codes (as Q2_K's), 12 bytes of 6-bit scales less 32 (low nibbles in bytes 0-7, their
   high 2 bits in bytes 8-11), then d. */
static void unpack_q3_K(const uint8_t *src, int n, int8_t *codes, float *a, float *b) {
    (void)n, (void)b;
    const uint8_t *hmask = src, *qs = src + 32, *sc = src + 96;
    const float d = half_to_float(src + 108);
    for (int g = 0; g < 16; g++) {
        const int low = (sc[g % 8] >> (4 * (g / 8))) & 15, high = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
        a[g] = d * (float)((low | high << 4) - 32);
    }
    for (int j = 0; j < 8; j++) /* (value 32j + i: its low bits in qs's half j / 4, shifted by 2 (j % 4)) */
        for (int i = 0; i < 32; i++)
            codes[32 * j + i] = (int8_t)(((qs[32 * (j / 4) + i] >> (2 * (j % 4))) & 3) - 4 + 4 * ((hmask[i] >> j) & 1));
}

/* IQ4_NL's and IQ4_XS's 16 values, and them + 128 (the codes made unsigned) */
static const int8_t NONLINEAR[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const uint8_t NONLINEAR_U[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

static void nonlinear_codes(const uint8_t *qs, int8_t *codes) { /* 32 values: low nibbles of 16 bytes, then high */
#if defined(__SSSE3__) && !defined(GENERIC) /* (the table in a register, looked up 16 at a time) */
    const __m128i table = _mm_loadu_si128((const __m128i *)NONLINEAR), q = _mm_loadu_si128((const __m128i *)qs);
    const __m128i fifteen = _mm_set1_epi8(15);
    _mm_storeu_si128((__m128i *)codes, _mm_shuffle_epi8(table, _mm_and_si128(q, fifteen)));
    _mm_storeu_si128((__m128i *)(codes + 16), _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), fifteen)));
#else
    for (int i = 0; i < 16; i++) {
        codes[i] = NONLINEAR[qs[i] & 15];
        codes[16 + i] = NONLINEAR[qs[i] >> 4];
    }
#endif
}

/* IQ4_NL: d, then 16 bytes of indices into NONLINEAR. */
static void unpack_iq4_nl(const uint8_t *src, int n, int8_t *codes, float *a, float *b) {
    (void)b;
    for (int k = 0; k < n / 32; k++, src += 18) {
        set_groups(a, NULL, 2 * k, 2, half_to_float(src), 0.0f);
        nonlinear_codes(src + 2, codes + 32 * k);
    }
}

/* IQ4_XS: d, the scales' high 2 bits (a little-endian 16-bit word, 2 bits per 32 values), their low nibbles (4
   bytes), then per 32 values 16 bytes of indices into NONLINEAR. */
static void unpack_iq4_xs(const uint8_t *src, int n, int8_t *codes, float *a, float *b) {
    (void)n, (void)b;
    const float d = half_to_float(src);
    const int high = src[2] | src[3] << 8;
    for (int j = 0; j < 8; j++) {
        const int scale = ((src[4 + j / 2] >> (4 * (j % 2))) & 15) | ((high >> (2 * j)) & 3) << 4;
        set_groups(a, NULL, 2 * j, 2, d * (float)(scale - 32), 0.0f);
        nonlinear_codes(src + 8 + 16 * j, codes + 32 * j);
    }
}

#ifdef GENERIC_ROWS /* (a test's build: every row as if added with its `unpack` alone, so the generic paths run) */
#define OWN(loop) LOOP_ANY
#else
#define OWN(loop) loop
#endif

static const block_type TYPES[] = {
    /* type, values, bytes, offset, has_b, loop, unpack */
    {2, 32, 18, 8, 0, OWN(LOOP_Q4_0), unpack_q4_0},
    {3, 32, 20, 0, 1, OWN(LOOP_Q4_1), unpack_q4_1},
    {6, 32, 22, 16, 0, OWN(LOOP_Q5_0), unpack_q5_0},
    {7, 32, 24, 0, 1, OWN(LOOP_Q5_1), unpack_q5_1},
    {8, 32, 34, 128, 0, OWN(LOOP_Q8_0), unpack_q8_0},
    {10, 256, 84, 0, 1, OWN(LOOP_Q2_K), unpack_q2_K},
    {11, 256, 110, 4, 0, OWN(LOOP_Q3_K), unpack_q3_K},
    {12, 256, 144, 0, 1, OWN(LOOP_Q4_K), unpack_q4_K},
    {13, 256, 176, 0, 1, OWN(LOOP_Q5_K), unpack_q5_K},
    {14, 256, 210, 32, 0, OWN(LOOP_Q6_K), unpack_q6_K},
    {20, 32, 18, 128, 0, OWN(LOOP_IQ4_NL), unpack_iq4_nl},
    {23, 256, 136, 128, 0, OWN(LOOP_IQ4_XS), unpack_iq4_xs},
};
#define TYPE_COUNT ((int)(sizeof TYPES / sizeof TYPES[0]))

static const block_type *block_type_of(int type) {
    for (int t = 0; t < TYPE_COUNT; t++)
        if (TYPES[t].type == type)
            return &TYPES[t];
    return NULL;
}

static int is_block_kind(int kind) { return block_type_of(kind) != NULL; }

/* A block type's values and bytes (the Python table checks against this); 0 if this library does not have it. */
int mw_block_type(int type, int64_t *elements, int64_t *bytes) {
    const block_type *t = block_type_of(type);
    if (!t)
        return 0;
    *elements = t->elements;
    *bytes = t->bytes;
    return 1;
}

/* Bytes from a tensor's start to value `at` (at the start of a block). */
static int64_t block_offset(const block_type *t, int64_t at) { return at / t->elements * t->bytes; }

/* One unpacked unit as floats, exactly (a * c, or a * c + b). */
static void exact_values(const int8_t *codes, const float *a, const float *b, int n, int has_b, float *to) {
    for (int g = 0; g < n / GROUP; g++) {
        const int8_t *c = codes + g * GROUP;
        float *out = to + g * GROUP;
#if LANES == 16 && !defined(GENERIC)
        const vec v = vtimes(vset1(a[g]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c))));
        vstore(out, has_b ? vplus(v, vset1(b[g])) : v);
#else
        for (int i = 0; i < GROUP; i++) {
            float v = a[g] * (float)c[i];
            out[i] = has_b ? v + b[g] : v;
        }
#endif
    }
}

/* Values [at, at + count) of a block tensor as float32, exactly; `at` and `count` on block boundaries. */
static void widen_values(const block_type *t, const void *w, int64_t at, int64_t count, float *to) {
    int8_t codes[QK] __attribute__((aligned(64)));
    float a[QK / GROUP], b[QK / GROUP];
    const uint8_t *src = (const uint8_t *)w + block_offset(t, at);
    for (int64_t done = 0; done < count;) {
        int n = count - done < QK ? (int)(count - done) : QK;
        t->unpack(src, n, codes, a, b);
        exact_values(codes, a, b, n, t->has_b, to + done);
        src += n / t->elements * t->bytes;
        done += n;
    }
}

typedef struct {
    const block_type *type;
    const uint8_t *w;
    int64_t row_bytes, cols;
    const int64_t *ids;
    float *out;
    uint16_t *out_bf16; /* or bf16, rounded to nearest even from the exact values */
} widen_job;

static void bf16_bits(uint16_t *to, const float *from, int64_t count);

#define WIDEN_PIECE (8 * QK) /* values of a bf16 row widened at a time, on the stack (no allocation to fail) */

static void widen_units(const void *task, int64_t begin, int64_t end) { /* units: rows */
    const widen_job *j = task;
    float piece[WIDEN_PIECE] __attribute__((aligned(64)));
    for (int64_t r = begin; r < end; r++) {
        const uint8_t *row = j->w + (j->ids ? j->ids[r] : r) * j->row_bytes;
        if (!j->out_bf16) {
            widen_values(j->type, row, 0, j->cols, j->out + r * j->cols);
            continue;
        }
        for (int64_t at = 0; at < j->cols; at += WIDEN_PIECE) { /* (QK is a multiple of every type's block) */
            const int64_t n = j->cols - at < WIDEN_PIECE ? j->cols - at : WIDEN_PIECE;
            widen_values(j->type, row, at, n, piece);
            bf16_bits(j->out_bf16 + r * j->cols + at, piece, n);
        }
    }
}

/* Rows of a block tensor of `cols` values a row, as float32 (`out`) or bfloat16 (`out_bf16`): rows `ids[0..rows)`,
   or [0, rows) without ids. Returns 0, or -1 for a type this library does not have. */
int mw_widen(int type, const void *w, int64_t cols, const int64_t *ids, int64_t rows, float *out, uint16_t *out_bf16,
             int threads) {
    const block_type *t = block_type_of(type);
    if (!t || cols % t->elements)
        return -1;
    widen_job job = {t, w, cols / t->elements * t->bytes, cols, ids, out, out_bf16};
    parallel(widen_units, &job, rows, rows * cols < THREAD_WORK ? 1 : threads);
    return 0;
}

/* -- 8-bit products ------------------------------------------------------------------------------------------

   An activation row of `in` values (`padded`: rounded up to QK, zeros past `in`) is quantized to signed bytes q,
   as llama.cpp quantizes for the same types, in one of three layouts:
     ROW32, for 32-value block types (Q4_0 ... Q8_0): d = max |x| / 127 per 32 values, q = round(x / d), and
       q int8[padded] | d float[padded / 32] | (sum of q) int32[padded / 32] | d * (sum of q) float[padded / 32]
     ROW256 and ROW256_Q4K, for K-quants: one d per 256 values, and
       q int8[padded], in the unit's order (below) | d float[padded / 256] | (sum of q) per 16 values (in order),
       as a float
   A unit's 256 values lie in four chunks of 64, so that a vpdpbusd lane (4 values) lies in one group of values
   sharing a scale, the same group in two chunks at least; its integer dots then add up in int32 before the
   scale. ROW256 spreads them: chunk c holds, for each 32-value sub-block s in SUB_ORDER, its values 8c .. 8c + 7
   (a lane is in the same sub-block in all four chunks, and in the same 16 values in chunks 0 and 1, 2 and 3).
   ROW256_Q4K, for Q4_K alone, follows its nibbles as 64 bytes of them load: chunk c holds 16-value groups
   Q4K_GROUPS[c] (quarter p of chunks 0 and 1 in sub-block p, of chunks 2 and 3 in sub-block 4 + p), so its
   codes need no byte shuffle. A block with a NaN or an infinity gets d = NaN: the row's products are NaN, as a
   float product's. */

#define ROW32 0
#define ROW256 1
#define ROW256_Q4K 2

static const int SUB_ORDER[8] = {0, 2, 4, 6, 1, 3, 5, 7}; /* low nibbles of Q4_K's four 32-byte groups, then high */

/* Q4_K's nibbles, 64 bytes (128 values) loaded at a time: the low nibbles of bytes 0-15 (values 0-15, group 0),
   high of 16-31 (values 48-63, group 3), low of 32-47 (group 4), high of 48-63 (group 7); then the same bytes
   with their halves of 16 swapped (groups 1, 2, 5, 6); then the next 64 bytes. */
static const int Q4K_GROUPS[4][4] = {{0, 3, 4, 7}, {1, 2, 5, 6}, {8, 11, 12, 15}, {9, 10, 13, 14}};

static inline int unit_at(int layout, int p) { /* the value at position p of a unit */
    if (layout == ROW256_Q4K)
        return 16 * Q4K_GROUPS[p / 64][(p % 64) / 16] + p % 16;
    return 32 * SUB_ORDER[(p % 64) / 8] + 8 * (p / 64) + p % 8;
}

static inline int layout_of(const block_type *t) {
    return t->loop == LOOP_Q4_K ? ROW256_Q4K : t->elements == QK ? ROW256 : ROW32;
}
static inline int64_t q8_padded(int64_t in) { return (in + QK - 1) / QK * QK; }
static inline int64_t q8_row_bytes(int64_t in, int layout) {
    const int64_t padded = q8_padded(in);
    return padded + (layout == ROW32 ? padded / 8 : padded / 64) + padded / 4;
}

/* The largest |x| of x[0..n), or NaN if one is not finite. */
static float largest(const float *x, int64_t n) {
    float top = 0.0f;
    int64_t i = 0;
#if LANES == 16 && !defined(GENERIC) /* (a maximum is exact in any order) */
    __m512 tops = _mm512_setzero_ps();
    __mmask16 finite = 0xffff;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_abs_ps(_mm512_loadu_ps(x + i));
        finite &= _mm512_cmp_ps_mask(v, _mm512_set1_ps(FLT_MAX), _CMP_LE_OQ); /* (false for NaN and infinity) */
        tops = _mm512_max_ps(tops, v);
    }
    if (finite != 0xffff)
        return NAN;
    top = _mm512_reduce_max_ps(tops);
#elif !defined(GENERIC)
    __m256 tops = _mm256_setzero_ps();
    int finite = 0xff;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_and_ps(_mm256_loadu_ps(x + i), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
        finite &= _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(FLT_MAX), _CMP_LE_OQ));
        tops = _mm256_max_ps(tops, v);
    }
    if (finite != 0xff)
        return NAN;
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(tops), _mm256_extractf128_ps(tops, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    top = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
#endif
    for (; i < n; i++) {
        float v = fabsf(x[i]);
        if (!isfinite(v))
            return NAN;
        top = v > top ? v : top;
    }
    return top;
}

/* q[0..size) of x[0..n) (zeros past n) for the scale top / 127; the sums of each 16 q's into group_sums. */
static void quantize_block(const float *x, int64_t n, int64_t size, float top, int8_t *q, int *group_sums) {
    float inverse = isfinite(top) && top > 0.0f ? 127.0f / top : 0.0f;
    inverse = inverse <= FLT_MAX ? inverse : FLT_MAX; /* (a top below 127 / FLT_MAX: no infinite scale, whose
                                                         products would turn every value into -127) */
#if LANES == 16 && !defined(GENERIC) /* the loop below, 16 values (a group) at a time: the same rounding, clamp, sums */
    for (int64_t i = 0; i < size; i += GROUP) {
        const __mmask16 live = i + GROUP <= n ? 0xffff : i >= n ? 0 : (__mmask16)((1u << (n - i)) - 1);
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, x + i), _mm512_set1_ps(inverse));
        __m512i c = _mm512_cvttps_epi32(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        c = _mm512_maskz_mov_epi32(live, _mm512_min_epi32(_mm512_max_epi32(c, _mm512_set1_epi32(-127)),
                                                          _mm512_set1_epi32(127))); /* (past n: 0, as below) */
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(c));
        group_sums[i / GROUP] = _mm512_reduce_add_epi32(c);
    }
#elif !defined(GENERIC) /* the same, 8 values at a time */
    for (int64_t i = 0; i < size; i += GROUP) {
        __m256i sum = _mm256_setzero_si256();
        for (int64_t h = i; h < i + GROUP; h += 8) {
            const int64_t live = n - h >= 8 ? 8 : n - h > 0 ? n - h : 0;
            const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)live),
                                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            const __m256 v = _mm256_mul_ps(_mm256_maskload_ps(x + (live ? h : 0), lanes), _mm256_set1_ps(inverse));
            __m256i c = _mm256_cvttps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            c = _mm256_and_si256(lanes, _mm256_min_epi32(_mm256_max_epi32(c, _mm256_set1_epi32(-127)),
                                                          _mm256_set1_epi32(127))); /* (past n: 0, as below) */
            const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
            _mm_storel_epi64((__m128i *)(q + h), _mm_packs_epi16(words, words));
            sum = _mm256_add_epi32(sum, c);
        }
        __m128i total = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        total = _mm_add_epi32(total, _mm_shuffle_epi32(total, _MM_SHUFFLE(1, 0, 3, 2)));
        group_sums[i / GROUP] = _mm_cvtsi128_si32(_mm_add_epi32(total, _mm_shuffle_epi32(total, 1)));
    }
#else
    for (int64_t g = 0; g < size / GROUP; g++)
        group_sums[g] = 0;
    for (int64_t i = 0; i < size; i++) {
        int v = i < n ? (int)nearbyintf(x[i] * inverse) : 0;
        v = v > 127 ? 127 : v < -127 ? -127 : v;
        q[i] = (int8_t)v;
        group_sums[i / GROUP] += v;
    }
#endif
}

static void quantize_row(const float *x, int64_t in, int layout, uint8_t *row) {
    const int64_t padded = q8_padded(in), size = layout == ROW32 ? 32 : QK;
    int8_t *q = (int8_t *)row, natural[QK];
    float *scales = (float *)(row + padded), *sums = scales + (layout == ROW32 ? padded / 32 : padded / QK);
    int32_t *totals = (int32_t *)sums; /* ROW32: a block's sum of codes, then d times it (`shares`) */
    float *shares = sums + padded / 32;
    int group_sums[QK / GROUP];
    for (int64_t k = 0; k < padded; k += size) {
        const int64_t n = in - k < size ? (in - k > 0 ? in - k : 0) : size;
        const float top = largest(x + k, n), d = top / 127.0f;
        if (layout == ROW32) {
            quantize_block(x + k, n, size, top, q + k, group_sums);
            scales[k / 32] = d;
            totals[k / 32] = group_sums[0] + group_sums[1];
            shares[k / 32] = d * (float)totals[k / 32];
        } else {
            quantize_block(x + k, n, size, top, natural, group_sums);
            for (int p = 0; p < QK; p += 8) /* (eight values at a time lie together in every layout) */
                memcpy(q + k + p, natural + unit_at(layout, p), 8);
            scales[k / QK] = d;
            for (int g = 0; g < QK / GROUP; g++)
                sums[k / GROUP + g] = (float)group_sums[g];
        }
    }
}

static uint8_t *quantize_rows(const float *x, int64_t rows, int64_t in, int layout) {
    const int64_t bytes = q8_row_bytes(in, layout);
    uint8_t *q = lined((size_t)(rows * bytes));
    if (q)
        for (int64_t r = 0; r < rows; r++)
            quantize_row(x + r * in, in, layout, q + r * bytes);
    return q;
}

/* A quantized row's parts (either layout). */
typedef struct {
    const int8_t *q;
    const float *scale;    /* ROW32: per 32 values; ROW256: per 256 */
    const float *sums;     /* ROW256: per 16 values; ROW32: per block, d times `totals` */
    const int32_t *totals; /* ROW32: per block, the sum of its codes */
} q_row;

static inline q_row row_at(const uint8_t *row, int64_t padded, int layout) {
    q_row x = {(const int8_t *)row, (const float *)(row + padded), NULL, NULL};
    x.sums = x.scale + (layout == ROW32 ? padded / 32 : padded / QK);
    if (layout == ROW32) {
        x.totals = (const int32_t *)x.sums;
        x.sums += padded / 32;
    }
    return x;
}

/* A K-quant weight row unpacked for the 8-bit products: per unit of QK values, the unsigned codes (spread as its
   activations are), the scale a per 16 values and b' (what the sum of those 16 activations is multiplied by).
   (The 32-value types: `blocks32.c`.) */
typedef struct {
    uint8_t *codes; /* [padded] */
    float *a, *b;   /* [padded / 16] */
} unpacked_row;

static void unpack_row(const block_type *t, const uint8_t *w, int64_t in, unpacked_row *u) {
    const int64_t padded = q8_padded(in);
    const int layout = layout_of(t);
    int8_t natural[QK];
    for (int64_t k = 0; k < padded; k += QK) {
        int n = in - k < QK ? (int)(in - k) : QK;
        int8_t *c = (int8_t *)u->codes + k;
        float *a = u->a + k / GROUP, *b = u->b + k / GROUP;
        t->unpack(w, n, natural, a, b);
        w += n / t->elements * t->bytes;
        for (int g = 0; g < QK / GROUP; g++) {
            if (g >= n / GROUP) { /* past the row's end: nothing */
                a[g] = 0.0f;
                b[g] = 0.0f;
                continue;
            }
            b[g] = t->has_b ? b[g] : -((float)t->offset * a[g]); /* (as the fused loops make it) */
        }
        for (int p = 0; p < QK; p += 8) { /* (eight values at a time lie together in every layout) */
            const int8_t *from = natural + unit_at(layout, p);
            for (int i = 0; i < 8; i++)
                c[p + i] = (int8_t)(uint8_t)((int)from[i] + t->offset);
        }
    }
}

#define Q_ROWS 8 /* activation rows that share one pass over a weight row */
#define PREFETCH 8192 /* bytes ahead of the block read that a fused loop asks for into L2 (a hint: past the end,
                         nothing). Against 2 KiB ahead into L1 only, a 1B decode token's products on a Zen 4 read
                         faster (Q8_0 markedly, Q4_K_M a little); t0 (L1) 8 KiB ahead is no faster */
#define Q_TILE 64 /* outputs a unit of work takes: their weights stay in cache while each group of rows passes */
#define Q_TILE_ONE_GROUP 16 /* or, with one group of rows (nothing to keep in cache), this many: the threads' last
                               units are small, so they finish together */

/* Every product of a K-quant type, for any number of rows, runs the same loop below (a row's sums, and their order,
   are the same alone or in any batch, and on every instruction set): the fused loops of the hot types where they
   are built, else `q_dots` on the unpacked row. Per (row, unit of 256 values), lane by lane (16 lanes of 4 values):
   the integer dots of chunks 0 and 1 summed (i01), of 2 and 3 (i23), exactly; then
   v = float(i01) * a01 + float(i23) * a23 (a lane's scale for its values of each pair of chunks),
   v += b' * (sum of q) of 16-value group `lane` (in order), and acc[unit parity] += v * d;
   then the two accumulators, then their lanes (`hsum`'s tree). The 32-value types: `blocks32.c`. */

/* A lane's scale index (16-value group) in chunks `pair` (0: chunks 0 and 1; 1: 2 and 3) of a unit. */
static inline int lane_group(int layout, int lane, int pair) {
    return layout == ROW256_Q4K ? Q4K_GROUPS[2 * pair][lane / 4] : 2 * SUB_ORDER[lane / 2] + pair;
}

/* A type's loop over a row's units calls its unit twice a pass, for units 2i and 2i + 1: `parity` (k / QK & 1) is
   then a constant in each call, and every accumulator stays in a register. */
#define UNITS_IN_PAIRS(unit, end, ...)                                                                            \
    for (int64_t k = 0; k < (end); k += 2 * QK) {                                                                 \
        unit(k, 0, __VA_ARGS__);                                                                                  \
        if (k + QK < (end))                                                                                       \
            unit(k + QK, 1, __VA_ARGS__);                                                                         \
    }

#if LANES == 16 && defined(__AVX512VNNI__)
static inline __m512 dots(__m512i codes, const int8_t *x) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(x)));
}

static inline __m512 spread_lanes(__m512 a, int pair) { /* lane l: a[lane_group(ROW256, l, pair)] */
    return _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(pair),
                                                  _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 2, 2, 6, 6, 10, 10, 14,
                                                                    14)), a);
}

/* A ROW256 unit: its four chunks' codes, the lanes' scales a01, a23, and b' per 16 values; every row's share. */
static inline __attribute__((always_inline)) void spread_rows(const __m512i *codes, __m512 a01, __m512 a23, __m512 b,
                                                              const q_row *x, int nr, int64_t k, int parity, vec *acc) {
    for (int r = 0; r < nr; r++) {
        const int8_t *q = x[r].q + k;
        const __m512i i01 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[0],
                                                                    _mm512_loadu_si512(q)),
                                                codes[1], _mm512_loadu_si512(q + 64));
        const __m512i i23 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[2],
                                                                    _mm512_loadu_si512(q + 128)),
                                                codes[3], _mm512_loadu_si512(q + 192));
        vec v = vtimes(_mm512_cvtepi32_ps(i01), a01);
        v = vfma(_mm512_cvtepi32_ps(i23), a23, v);
        v = vfma(b, vload(x[r].sums + k / GROUP), v);
        acc[2 * r + parity] = vfma(v, vset1(x[r].scale[k / QK]), acc[2 * r + parity]);
    }
}

/* The unpacked row (`unpack_row`), any K-quant: the same sums as a fused loop of that type would make. */
static inline __attribute__((always_inline)) void unpacked_unit(int64_t k, int parity, const unpacked_row *u,
                                                                const q_row *x, int nr, vec *acc) {
    const vec a = vload(u->a + k / GROUP), b = vload(u->b + k / GROUP);
    const __m512i codes[4] = {_mm512_load_si512(u->codes + k), _mm512_load_si512(u->codes + k + 64),
                              _mm512_load_si512(u->codes + k + 128), _mm512_load_si512(u->codes + k + 192)};
    spread_rows(codes, spread_lanes(a, 0), spread_lanes(a, 1), b, x, nr, k, parity, acc);
}

static inline __attribute__((always_inline)) void unpacked_rows(const unpacked_row *u, int64_t padded, const q_row *x,
                                                                int nr, vec *acc) {
    UNITS_IN_PAIRS(unpacked_unit, padded, u, x, nr, acc)
}

static inline __m512 negated(__m512 v) { /* -v, lane by lane, as the scalar minus (signed zeros too) */
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000u)));
}

static inline float half_fast(const uint8_t *p) { /* (F16C; a NaN's payload may differ from half_to_float's) */
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Q4_K, unpacked in registers in ROW256_Q4K's order: a = d * scale, b' = -(dmin * min), as `unpack_q4_K` and
   `unpack_row` make them. A high nibble is not shifted down: its lanes multiply 16 times the code, and their scale
   is a / 16 (exact: d / 16 is a float32 for every float16 d), which gives the shifted code's products bit for bit. */
static inline __attribute__((always_inline)) void q4_K_unit(int64_t k, int parity, const uint8_t *row, const q_row *x,
                                                            int nr, vec *acc) {
    /* The 8 scales and 8 mins as 16 bytes in vector registers (scalar shifts and inserts took a sizeable share of a
       unit's time): each one's low 6 bits, or low 4 and the 2 high bits from bytes 0-7; then times d (d / 16 for
       the odd sub-blocks, high nibbles) or -dmin. */
    const __m128i take_low = _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m128i take_high = _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11);
    const __m128i low_shift = _mm_setr_epi32(0, 0, 0, 4), top_two = _mm_set1_epi8((char)0xc0);
    const __m128i low_mask = _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f);
    const __m512i times = _mm512_setr_epi32(0, 2, 0, 2, 0, 2, 0, 2, 1, 1, 1, 1, 1, 1, 1, 1);
    /* a lane's sub-block: quarter p of chunks 0 and 1 is in sub-block p, of chunks 2 and 3 in 4 + p; b' per 16 */
    const __m512i scale_01 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i scale_23 = _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7);
    const __m512i min_of_group = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    const __m512i nibbles = _mm512_set_epi64(~0x0f0f0f0f0f0f0f0fLL, ~0x0f0f0f0f0f0f0f0fLL, 0x0f0f0f0f0f0f0f0fLL,
                                             0x0f0f0f0f0f0f0f0fLL, ~0x0f0f0f0f0f0f0f0fLL, ~0x0f0f0f0f0f0f0f0fLL,
                                             0x0f0f0f0f0f0f0f0fLL, 0x0f0f0f0f0f0f0f0fLL); /* low, high, low, high */
    const uint8_t *w = row + k / QK * 144;
    for (int line = 0; line < 144; line += 64) /* (the hardware's prefetch alone left the core idle part of the time) */
        __builtin_prefetch(w + PREFETCH + line, 0, 2);
    const __m128i head = _mm_loadu_si128((const __m128i *)w); /* d, dmin, then the 12 bytes of scales */
    const __m128i low_bits = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi8(head, take_low), low_shift), low_mask);
    const __m128i high_bits = _mm_srli_epi32(_mm_and_si128(_mm_shuffle_epi8(head, take_high), top_two), 2);
    const __m128 d = _mm_cvtph_ps(head); /* d, dmin: then d, -dmin, d / 16 */
    const __m128 ds = _mm_mul_ps(_mm_shuffle_ps(d, d, _MM_SHUFFLE(0, 0, 1, 0)), _mm_setr_ps(1.0f, -1.0f, 0.0625f, 0));
    const vec both = vtimes(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_or_si128(low_bits, high_bits))),
                            _mm512_permutexvar_ps(times, _mm512_castps128_ps512(ds)));
    const __m512i qa = _mm512_loadu_si512(w + 16), qb = _mm512_loadu_si512(w + 80);
    const __m512i codes[4] = {_mm512_and_si512(qa, nibbles),
                              _mm512_and_si512(_mm512_shuffle_i64x2(qa, qa, _MM_SHUFFLE(2, 3, 0, 1)), nibbles),
                              _mm512_and_si512(qb, nibbles),
                              _mm512_and_si512(_mm512_shuffle_i64x2(qb, qb, _MM_SHUFFLE(2, 3, 0, 1)), nibbles)};
    spread_rows(codes, _mm512_permutexvar_ps(scale_01, both), _mm512_permutexvar_ps(scale_23, both),
                _mm512_permutexvar_ps(min_of_group, both), x, nr, k, parity, acc);
}

static inline __attribute__((always_inline)) void fused_q4_K(const uint8_t *row, int64_t in, const q_row *x, int nr,
                                                             vec *acc) {
    UNITS_IN_PAIRS(q4_K_unit, in, row, x, nr, acc)
}

/* Q6_K: a = d * scale per 16 values, b' = -32 a (the codes' offset). Value 32s + 8c + t of a unit: low nibble at
   byte 64 h + 32 (s % 2) + 8c + t of ql, shifted by 4 ((s % 4) / 2); high bits at byte 32 h + 8c + t of qh,
   shifted by 2 (s % 4), with h = s / 4. */
static inline __attribute__((always_inline)) void q6_K_unit(int64_t k, int parity, const uint8_t *row, const q_row *x,
                                                            int nr, vec *acc) {
    const __m512i low = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3);
    /* per 8-byte group k of a chunk (sub-block s = SUB_ORDER[k]): where its ql and qh bytes start, and shifts */
    const long long b32 = 0x2020202020202020LL, b64 = 0x4040404040404040LL, b96 = 0x6060606060606060LL;
    const __m512i ql_at = _mm512_set_epi64(b96, b96, b32, b32, b64, b64, 0, 0); /* (groups 7 .. 0) */
    const __m512i qh_at = _mm512_set_epi64(b32, b32, 0, 0, b32, b32, 0, 0);
    const __m512i ql_shift = _mm512_set_epi64(4, 0, 4, 0, 4, 0, 4, 0);
    const __m512i qh_shift = _mm512_set_epi64(6, 2, 6, 2, 4, 0, 4, 0);
    const __m512i within = _mm512_set1_epi64(0x0706050403020100LL);
    const uint8_t *w = row + k / QK * 210;
    for (int line = 0; line < 210; line += 64)
        __builtin_prefetch(w + PREFETCH + line, 0, 2);
    const vec a = vtimes(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 192)))),
                         vset1(half_fast(w + 208)));
    const __m512i la = _mm512_loadu_si512(w), lb = _mm512_loadu_si512(w + 64), h = _mm512_loadu_si512(w + 128);
    __m512i codes[4];
    for (int c = 0; c < 4; c++) {
        const __m512i offset = _mm512_add_epi8(within, _mm512_set1_epi8((char)(8 * c)));
        const __m512i l = _mm512_permutex2var_epi8(la, _mm512_add_epi8(offset, ql_at), lb);
        const __m512i hi = _mm512_permutexvar_epi8(_mm512_add_epi8(offset, qh_at), h);
        codes[c] = _mm512_or_si512(_mm512_and_si512(_mm512_srlv_epi64(l, ql_shift), low),
                                   _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi64(hi, qh_shift), two), 4));
    }
    spread_rows(codes, spread_lanes(a, 0), spread_lanes(a, 1), negated(vtimes(vset1(32.0f), a)), x, nr, k, parity,
                acc);
}

static inline __attribute__((always_inline)) void fused_q6_K(const uint8_t *row, int64_t in, const q_row *x, int nr,
                                                             vec *acc) {
    UNITS_IN_PAIRS(q6_K_unit, in, row, x, nr, acc)
}

/* Chunk c of a ROW256 unit from 2-bit codes (Q2_K's and Q3_K's low bits): group j of the chunk is sub-block
   s = SUB_ORDER[j], whose values 8c .. 8c + 7 lie at bytes 32 (s / 4) + 8c of `qs` (64 bytes), shifted by 2 (s % 4). */
static inline __m512i two_bit_chunk(__m512i qs, int c) {
    const long long b32 = 0x2020202020202020LL;
    const __m512i at = _mm512_set_epi64(b32, b32, 0, 0, b32, b32, 0, 0); /* (groups 7 .. 0) */
    const __m512i shift = _mm512_set_epi64(6, 2, 6, 2, 4, 0, 4, 0);
    const __m512i within = _mm512_add_epi8(_mm512_set1_epi64(0x0706050403020100LL), _mm512_set1_epi8((char)(8 * c)));
    const __m512i bytes = _mm512_permutexvar_epi8(_mm512_add_epi8(within, at), qs);
    return _mm512_and_si512(_mm512_srlv_epi64(bytes, shift), _mm512_set1_epi8(3));
}

static inline __m512 widened(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)); }

/* Q2_K: a = d * sc, b' = -(dmin * m) per 16 values (`unpack_q2_K`'s), the codes as they are. */
static inline __attribute__((always_inline)) void q2_K_unit(int64_t k, int parity, const uint8_t *row, const q_row *x,
                                                            int nr, vec *acc) {
    const uint8_t *w = row + k / QK * 84;
    for (int line = 0; line < 84; line += 64)
        __builtin_prefetch(w + PREFETCH + line, 0, 2);
    const __m128i scales = _mm_loadu_si128((const __m128i *)w), fifteen = _mm_set1_epi8(15);
    const vec a = vtimes(vset1(half_fast(w + 80)), widened(_mm_and_si128(scales, fifteen)));
    const vec b = negated(vtimes(vset1(half_fast(w + 82)), widened(_mm_and_si128(_mm_srli_epi16(scales, 4), fifteen))));
    const __m512i qs = _mm512_loadu_si512(w + 16);
    const __m512i codes[4] = {two_bit_chunk(qs, 0), two_bit_chunk(qs, 1), two_bit_chunk(qs, 2), two_bit_chunk(qs, 3)};
    spread_rows(codes, spread_lanes(a, 0), spread_lanes(a, 1), b, x, nr, k, parity, acc);
}

/* Q3_K: a = d * (sc - 32), b' = -4a; a code made unsigned is its low bits | its high bit << 2 (value 8c + t of
   sub-block s: bit s of hmask byte 8c + t). */
static inline __attribute__((always_inline)) void q3_K_unit(int64_t k, int parity, const uint8_t *row, const q_row *x,
                                                            int nr, vec *acc) {
    const uint8_t *w = row + k / QK * 110;
    for (int line = 0; line < 110; line += 64)
        __builtin_prefetch(w + PREFETCH + line, 0, 2);
    const __m128i fifteen = _mm_set1_epi8(15), low8 = _mm_loadl_epi64((const __m128i *)(w + 96));
    uint32_t high4;
    memcpy(&high4, w + 104, 4);
    const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(low8, fifteen),
                                           _mm_and_si128(_mm_srli_epi16(low8, 4), fifteen));
    const __m128i high = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)high4), _mm_setr_epi32(0, 2, 4, 6)),
                                       _mm_set1_epi8(3));
    const __m512i scales = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_or_si128(low, _mm_slli_epi16(high, 4))),
                                            _mm512_set1_epi32(32));
    const vec a = vtimes(vset1(half_fast(w + 108)), _mm512_cvtepi32_ps(scales));
    const __m512i qs = _mm512_loadu_si512(w + 32);
    const __m512i hbit_shift = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0); /* SUB_ORDER, groups 7 .. 0 */
    __m512i codes[4];
    for (int c = 0; c < 4; c++) {
        uint64_t mask;
        memcpy(&mask, w + 8 * c, 8);
        const __m512i hbits = _mm512_and_si512(_mm512_srlv_epi64(_mm512_set1_epi64((long long)mask), hbit_shift),
                                               _mm512_set1_epi8(1));
        codes[c] = _mm512_or_si512(two_bit_chunk(qs, c), _mm512_slli_epi16(hbits, 2));
    }
    spread_rows(codes, spread_lanes(a, 0), spread_lanes(a, 1), negated(vtimes(vset1(4.0f), a)), x, nr, k, parity,
                acc);
}

/* IQ4_XS: a = d * (sc - 32) per 32 values, b' = -128a; a code made unsigned is NONLINEAR_U[q], looked up 16 at a
   time. Values 8c + t of sub-block s: the low nibbles (c < 2), or high (c >= 2), of bytes 16s + 8 (c % 2) of qs. */

static inline __attribute__((always_inline)) void iq4_xs_unit(int64_t k, int parity, const uint8_t *row,
                                                              const q_row *x, int nr, vec *acc) {
    const uint8_t *w = row + k / QK * 136;
    for (int line = 0; line < 136; line += 64)
        __builtin_prefetch(w + PREFETCH + line, 0, 2);
    uint16_t high2;
    uint32_t low4;
    memcpy(&high2, w + 2, 2);
    memcpy(&low4, w + 4, 4);
    const __m512i j4 = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28); /* 4 x sub-block */
    const __m512i low = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)low4), j4), _mm512_set1_epi32(15));
    const __m512i high = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(high2), _mm512_srli_epi32(j4, 1)),
                                          _mm512_set1_epi32(3));
    const __m512i scales = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
    const vec a = vtimes(vset1(half_fast(w)), _mm512_cvtepi32_ps(scales));
    const __m512i qa = _mm512_loadu_si512(w + 8), qb = _mm512_loadu_si512(w + 72);
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)NONLINEAR_U));
    const long long at0 = 0x0706050403020100LL;
    /* per group j (sub-block SUB_ORDER[j]): its bytes' start in qs, 16 SUB_ORDER[j] (groups 7 .. 0) */
    const __m512i at = _mm512_add_epi8(_mm512_set_epi64(0x7070707070707070LL, 0x5050505050505050LL,
                                                        0x3030303030303030LL, 0x1010101010101010LL,
                                                        0x6060606060606060LL, 0x4040404040404040LL,
                                                        0x2020202020202020LL, 0), _mm512_set1_epi64(at0));
    __m512i codes[4];
    for (int c = 0; c < 4; c++) {
        const __m512i bytes = _mm512_permutex2var_epi8(qa, _mm512_add_epi8(at, _mm512_set1_epi8((char)(8 * (c % 2)))),
                                                       qb);
        const __m512i nibbles = _mm512_and_si512(c < 2 ? bytes : _mm512_srli_epi16(bytes, 4), _mm512_set1_epi8(15));
        codes[c] = _mm512_shuffle_epi8(table, nibbles);
    }
    spread_rows(codes, spread_lanes(a, 0), spread_lanes(a, 1), negated(vtimes(vset1(128.0f), a)), x, nr, k, parity,
                acc);
}

#define KQUANTS_AVX2_LOOPS 1 /* Q5_K: the AVX2 loop (no VNNI one yet), far faster than unpacking each row */
#include "kquants_avx2.c"

#define FUSED_DOTS                                                                                                   \
    (1 << LOOP_Q2_K | 1 << LOOP_Q3_K | 1 << LOOP_Q4_K | 1 << LOOP_Q5_K | 1 << LOOP_Q6_K | 1 << LOOP_IQ4_XS)
#define VECTOR_UNPACKED 1 /* `unpacked_rows`: the generic path in vectors, as `q_dots_scalar` sums */

/* sums[r] = row r . the weight row w (raw blocks, or `u` unpacked for a type without a fused loop), `width` rows (a
   constant once inlined: each width gets its own accumulators, in registers, rather than one array in memory that
   every call zeroed). */
static inline __attribute__((always_inline)) void dots_of(int loop, const uint8_t *w, const unpacked_row *u, int64_t in,
                                                          const q_row *x, int width, int nr, int64_t padded,
                                                          float *sums) {
    if (loop == LOOP_Q5_K) {
        q5_K_dots2(w, in, x, width, nr, sums);
        return;
    }
    vec acc[2 * Q_ROWS];
    for (int r = 0; r < 2 * width; r++)
        acc[r] = vzero();
    switch (loop) {
    case LOOP_Q2_K: UNITS_IN_PAIRS(q2_K_unit, in, w, x, width, acc) break;
    case LOOP_Q3_K: UNITS_IN_PAIRS(q3_K_unit, in, w, x, width, acc) break;
    case LOOP_Q4_K: fused_q4_K(w, in, x, width, acc); break;
    case LOOP_Q6_K: fused_q6_K(w, in, x, width, acc); break;
    case LOOP_IQ4_XS: UNITS_IN_PAIRS(iq4_xs_unit, in, w, x, width, acc) break;
    default: unpacked_rows(u, padded, x, width, acc); break; /* (LOOP_ANY: `u` is the unpacked row) */
    }
    for (int r = 0; r < nr && r < width; r++) /* (nr <= width: said so that GCC sees every acc was set) */
        sums[r] = hsum(vplus(acc[2 * r], acc[2 * r + 1]));
}

/* A lone row against LONE_OUTPUTS weight rows `row_bytes` apart (a type with a fused loop), one after another:
   sums[o] = row . w_o, each output's arithmetic that of `q_dots` (the same bits). Their `hsum`s come at the end, not
   between one output's units and the next's, so the core runs on into the next row; the rows are read in order, one
   stream from memory (interleaved unit by unit, four streams were much slower). */
#define LONE_OUTPUTS 4
static void q_dots_lone(int loop, const uint8_t *w, int64_t row_bytes, int64_t in, const uint8_t *row, int64_t padded,
                        float *sums) {
    const q_row x = row_at(row, padded, ROW256);
    if (loop == LOOP_Q5_K) {
        for (int o = 0; o < LONE_OUTPUTS; o++)
            q5_K_dots2(w + o * row_bytes, in, &x, 1, 1, sums + o);
        return;
    }
    vec acc[2 * LONE_OUTPUTS];
    for (int o = 0; o < 2 * LONE_OUTPUTS; o++)
        acc[o] = vzero();
#pragma GCC unroll 4
    for (int o = 0; o < LONE_OUTPUTS; o++) {
        const uint8_t *row = w + o * row_bytes;
        switch (loop) {
        case LOOP_Q2_K: UNITS_IN_PAIRS(q2_K_unit, in, row, &x, 1, acc + 2 * o) break;
        case LOOP_Q3_K: UNITS_IN_PAIRS(q3_K_unit, in, row, &x, 1, acc + 2 * o) break;
        case LOOP_Q4_K: UNITS_IN_PAIRS(q4_K_unit, in, row, &x, 1, acc + 2 * o) break;
        case LOOP_IQ4_XS: UNITS_IN_PAIRS(iq4_xs_unit, in, row, &x, 1, acc + 2 * o) break;
        default: UNITS_IN_PAIRS(q6_K_unit, in, row, &x, 1, acc + 2 * o) break;
        }
    }
    for (int o = 0; o < LONE_OUTPUTS; o++)
        sums[o] = hsum(vplus(acc[2 * o], acc[2 * o + 1]));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(GENERIC)
#include "kquants_avx2.c"
#endif

/* Whether a K-quant's products here run its own fused loop on the blocks as stored (FUSED_DOTS: the loops this
   build has); else the generic path, on its row unpacked (`unpack_row`). */
static int has_fused_dots(const block_type *t) {
#if defined(FUSED_DOTS)
    return FUSED_DOTS >> t->loop & 1;
#else
    return (void)t, 0;
#endif
}

#if !defined(VECTOR_UNPACKED)
/* sums[r] = row r . the unpacked weight row: the vector loops' arithmetic, lane by lane in scalar code (16 lanes of
   4 values; `hsum`'s tree). The generic path where no vector loop has it. */
static void q_dots_scalar(const block_type *t, const unpacked_row *u, const uint8_t *const *rows, int nr,
                          int64_t padded, float *sums) {
    const int layout = layout_of(t);
    for (int r = 0; r < nr; r++) {
        const q_row x = row_at(rows[r], padded, ROW256);
        float acc[2][16] = {{0}};
        for (int64_t k = 0; k < padded; k += QK) {
            int dots[4][16];
            for (int c = 0; c < 4; c++)
                for (int l = 0; l < 16; l++) {
                    const int64_t at = k + 64 * c + 4 * l;
                    dots[c][l] = 0;
                    for (int i = 0; i < 4; i++)
                        dots[c][l] += (int)u->codes[at + i] * (int)x.q[at + i];
                }
            for (int l = 0; l < 16; l++) {
                const float *a = u->a + k / GROUP;
                float *into = &acc[k / QK & 1][l];
                float v = (float)(dots[0][l] + dots[1][l]) * a[lane_group(layout, l, 0)];
                v = fmaf((float)(dots[2][l] + dots[3][l]), a[lane_group(layout, l, 1)], v);
                v = fmaf(u->b[k / GROUP + l], x.sums[k / GROUP + l], v);
                *into = fmaf(v, x.scale[k / QK], *into);
            }
        }
        float lanes[16], half[8];
        for (int l = 0; l < 16; l++)
            lanes[l] = acc[0][l] + acc[1][l];
        for (int l = 0; l < 8; l++)
            half[l] = lanes[l] + lanes[l + 8];
        sums[r] = ((half[0] + half[4]) + (half[2] + half[6])) + ((half[1] + half[5]) + (half[3] + half[7]));
    }
}
#endif

/* sums[r] = row r . weight row w (`u`: unpacked, for a type without a fused loop here), for nr <= Q_ROWS rows. */
static void q_dots(const block_type *t, const uint8_t *w, const unpacked_row *u, int64_t in,
                   const uint8_t *const *rows, int nr, int64_t padded, float *sums) {
#if defined(FUSED_DOTS)
#if !defined(VECTOR_UNPACKED)
    if (!has_fused_dots(t)) {
        q_dots_scalar(t, u, rows, nr, padded, sums);
        return;
    }
#endif
    q_row x[Q_ROWS];
    const int width = nr == 1 ? 1 : nr == 2 ? 2 : nr <= 4 ? 4 : 8; /* loops built for these counts only: a group */
    for (int r = 0; r < width; r++) /* of 3 runs as 4, its first row again (those sums dropped) */
        x[r] = row_at(rows[r < nr ? r : 0], padded, ROW256);
    switch (width) {
    case 1: dots_of(t->loop, w, u, in, x, 1, nr, padded, sums); break;
    case 2: dots_of(t->loop, w, u, in, x, 2, nr, padded, sums); break;
    case 4: dots_of(t->loop, w, u, in, x, 4, nr, padded, sums); break;
    default: dots_of(t->loop, w, u, in, x, 8, nr, padded, sums); break;
    }
#else
    (void)w, (void)in;
    q_dots_scalar(t, u, rows, nr, padded, sums);
#endif
}

#if !defined(FUSED_DOTS)
#define LONE_OUTPUTS 4
static void q_dots_lone(int loop, const uint8_t *w, int64_t row_bytes, int64_t in, const uint8_t *row, int64_t padded,
                        float *sums) { /* (no fused loops here: never called) */
    (void)loop, (void)w, (void)row_bytes, (void)in, (void)row, (void)padded, (void)sums;
}
#endif

typedef struct {
    const block_type *type;
    const uint8_t *w, *x; /* weights [out, row_bytes]; quantized rows [rows, x_bytes] */
    int64_t rows, in, out, ldy, row_bytes, x_bytes;
    const float *bias;
    float *y;
    int64_t tile; /* outputs a unit */
} qlinear_job;

/* Units of `tile` outputs: for each group of Q_ROWS rows (in cache), every output of the unit. */
static void qlinear_units(const void *task, int64_t begin, int64_t end) {
    const qlinear_job *j = task;
    const int64_t padded = q8_padded(j->in);
    const int fused = has_fused_dots(j->type);
    uint8_t *buffer = fused ? NULL : lined((size_t)padded + sizeof(float) * 2 * (size_t)(padded / GROUP));
    unpacked_row u = {buffer, (float *)(buffer + padded), (float *)(buffer + padded) + padded / GROUP};
    const int64_t first = begin * j->tile, last = end * j->tile < j->out ? end * j->tile : j->out;
    for (int64_t tile = first; tile < last; tile += j->tile) {
        const int64_t tile_end = tile + j->tile < last ? tile + j->tile : last;
        for (int64_t r0 = 0; r0 < j->rows; r0 += Q_ROWS) {
            const int nr = (int)(j->rows - r0 < Q_ROWS ? j->rows - r0 : Q_ROWS);
            const uint8_t *rows[Q_ROWS];
            for (int r = 0; r < nr; r++)
                rows[r] = j->x + (r0 + r) * j->x_bytes;
            int64_t o = tile;
            for (; nr == 1 && fused && o + LONE_OUTPUTS <= tile_end; o += LONE_OUTPUTS) {
                float sums[LONE_OUTPUTS];
                q_dots_lone(j->type->loop, j->w + o * j->row_bytes, j->row_bytes, j->in, rows[0], padded, sums);
                for (int i = 0; i < LONE_OUTPUTS; i++)
                    j->y[r0 * j->ldy + o + i] = j->bias ? sums[i] + j->bias[o + i] : sums[i];
            }
            for (; o < tile_end; o++) {
                const uint8_t *w = j->w + o * j->row_bytes;
                float sums[Q_ROWS];
                if (!fused)
                    unpack_row(j->type, w, j->in, &u);
                q_dots(j->type, w, &u, j->in, rows, nr, padded, sums);
                for (int r = 0; r < nr; r++)
                    j->y[(r0 + r) * j->ldy + o] = j->bias ? sums[r] + j->bias[o] : sums[r];
            }
        }
    }
    free(buffer);
}

/* Which of a 32-value type's paths a product takes (the same bits on each): what the node chose for its row count
   (`mw_set_direct_rows`), or one of them, to measure it. */
enum { PATH_CHOSEN, PATH_TILES, PATH_DIRECT };

#include "blocks32.c"

/* Quantized rows (`quantize_rows`, in the type's layout) times a block tensor: y[r * ldy + o] = x_r . w_o
   (+ bias[o]). Returns 0, or -1 without memory. */
static int q_product(const block_type *t, const uint8_t *x, int64_t rows, int64_t in, const void *w, const float *bias,
                     float *y, int64_t ldy, int64_t out, int threads, int path) {
    if (layout_of(t) == ROW32)
        return v_product(t, x, rows, in, w, bias, y, ldy, out, threads, path);
    qlinear_job job = {t, w, x, rows, in, out, ldy, in / t->elements * t->bytes, q8_row_bytes(in, layout_of(t)),
                       bias, y, rows <= Q_ROWS ? Q_TILE_ONE_GROUP : Q_TILE};
    const int64_t units = (out + job.tile - 1) / job.tile;
    parallel(qlinear_units, &job, units, rows * in * out < THREAD_WORK ? 1 : threads);
    return 0;
}

/* y = x W^T (+ bias) with the 8-bit products, W a block tensor [out, in] of `type`, on the given path (PATH_*).
   Returns 0, -1 without memory, -2 for a type this library does not have. */
int mw_qlinear_on(const float *x, int64_t rows, int64_t in, const void *w, int type, const float *bias, float *y,
                  int64_t ldy, int64_t out, int threads, int path) {
    const block_type *t = block_type_of(type);
    if (!t || in % t->elements || path < PATH_CHOSEN || path > PATH_DIRECT)
        return -2;
    uint8_t *q = quantize_rows(x, rows, in, layout_of(t));
    if (!q)
        return -1;
    const int failed = q_product(t, q, rows, in, w, bias, y, ldy, out, threads, path);
    free(q);
    return failed;
}

int mw_qlinear(const float *x, int64_t rows, int64_t in, const void *w, int type, const float *bias, float *y,
               int64_t ldy, int64_t out, int threads) {
    return mw_qlinear_on(x, rows, in, w, type, bias, y, ldy, out, threads, PATH_CHOSEN);
}
