/* GGUF's block types, as stored in the file: one table, exact widening, and products with 8-bit activations.
   #included by kernels.c, whose vector macros, `lined` and thread pool (`parallel`) it uses.

   The table (`TYPES`, keyed by ggml's type id; `block_types.py` is its Python twin and a test walks both) gives each
   type's block: how many values and bytes, and `unpack`, which turns up to 256 values (one K-quant super-block, or
   up to eight 32-value blocks) into signed codes c and, per 16 values, a float scale a (and, where the type has
   one, an offset b), so that value = a * c (+ b) with the very float32 operations `gguf.quants.dequantize` does:
     Q4_0  d * (q - 8)          Q4_1  d * q + m          Q5_0  d * (q - 16)      Q5_1  d * q + m
     Q8_0  q * d                Q4_K  (d * sc) * q - (dmin * m)                 Q5_K  likewise, 5-bit q
     Q6_K  (d * sc) * (q - 32)
   (d, m, dmin float16 as float32; sc, m 6-bit; Q6_K's sc a signed byte per 16 values). `widen_values` gives those
   floats bit for bit: a product of float32 weights read from a GGUF (`--dtype float32`) is the product of the
   weights transformers dequantizes.

   The default products (`mw_qlinear`) do what llama.cpp does for its speed: each activation row is quantized to
   signed 8 bits, with one float scale per 32 values for 32-value block types and per 256 for K-quants (round to
   nearest; `quantize_rows`), and a block's codes, made unsigned (u = c + offset), meet it in integer dot products
   (AVX-512 VNNI's vpdpbusd: 4 products a lane, exact in int32), scaled per 16 values in float32; an offset's share
   is b' times the sum of the 16 activations. A row's result is the same alone or in any batch and on any thread
   count: each (row, output) pair sums its units and lanes in one order. */

#define QK 256 /* values an unpacked unit holds */
#define GROUP 16 /* values sharing a scale in an unpacked unit */

typedef void (*unpack_fn)(const uint8_t *src, int n, int8_t *codes, float *a, float *b);

typedef struct block_type {
    int type; /* ggml's id */
    int elements, bytes; /* a block's */
    int offset; /* added to the codes to make them unsigned for the 8-bit products */
    int has_b; /* value = a * c + b (else a * c, with no addition: -0.0 stays -0.0) */
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

static const block_type TYPES[] = {
    /* type, values, bytes, offset, has_b, unpack */
    {2, 32, 18, 8, 0, unpack_q4_0},    {3, 32, 20, 0, 1, unpack_q4_1},    {6, 32, 22, 16, 0, unpack_q5_0},
    {7, 32, 24, 0, 1, unpack_q5_1},    {8, 32, 34, 128, 0, unpack_q8_0},  {12, 256, 144, 0, 1, unpack_q4_K},
    {13, 256, 176, 0, 1, unpack_q5_K}, {14, 256, 210, 32, 0, unpack_q6_K},
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

static void widen_units(const void *task, int64_t begin, int64_t end) { /* units: rows */
    const widen_job *j = task;
    float *row = j->out_bf16 ? lined(sizeof(float) * j->cols) : NULL;
    for (int64_t r = begin; r < end; r++) {
        const int64_t source = j->ids ? j->ids[r] : r;
        float *to = j->out_bf16 ? row : j->out + r * j->cols;
        widen_values(j->type, j->w + source * j->row_bytes, 0, j->cols, to);
        if (j->out_bf16)
            bf16_bits(j->out_bf16 + r * j->cols, row, j->cols);
    }
    free(row);
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
   in one of two layouts, as llama.cpp quantizes for the same types:
     for 32-value block types (Q4_0 ... Q8_0): d = max |x| / 127 per 32 values, q = round(x / d), and
       q int8[padded] | d float[padded / 4], once per 4 values (a vpdpbusd lane) | d * (sum of q) per 16 values
     for K-quants (256-value super-blocks): one d per 256 values, and
       q int8[padded] | d float[padded / 256] | (sum of q) per 16 values, as a float
   A block with a NaN or an infinity gets d = NaN: the row's products are NaN, as a float product's. */

#define ROW32 0
#define ROW256 1

static inline int layout_of(const block_type *t) { return t->elements == QK ? ROW256 : ROW32; }
static inline int64_t q8_padded(int64_t in) { return (in + QK - 1) / QK * QK; }
static inline int64_t q8_row_bytes(int64_t in, int layout) {
    const int64_t padded = q8_padded(in);
    return padded + (layout == ROW32 ? padded : padded / 64) + padded / 4;
}

/* The largest |x| of x[0..n), or NaN if one is not finite. */
static float largest(const float *x, int64_t n) {
    float top = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float v = fabsf(x[i]);
        if (!isfinite(v))
            return NAN;
        top = v > top ? v : top;
    }
    return top;
}

/* q[0..32 or 256) of x[0..n) (zeros past n) with scale d; the sums of each 16 q's into group_sums. */
static void quantize_block(const float *x, int64_t n, int64_t size, float top, int8_t *q, int *group_sums) {
    const float inverse = isfinite(top) && top > 0.0f ? 127.0f / top : 0.0f;
    for (int64_t g = 0; g < size / GROUP; g++)
        group_sums[g] = 0;
    for (int64_t i = 0; i < size; i++) {
        int v = i < n ? (int)nearbyintf(x[i] * inverse) : 0;
        v = v > 127 ? 127 : v < -127 ? -127 : v;
        q[i] = (int8_t)v;
        group_sums[i / GROUP] += v;
    }
}

static void quantize_row(const float *x, int64_t in, int layout, uint8_t *row) {
    const int64_t padded = q8_padded(in), size = layout == ROW32 ? 32 : QK;
    int8_t *q = (int8_t *)row;
    float *scales = (float *)(row + padded), *sums = scales + (layout == ROW32 ? padded / 4 : padded / QK);
    int group_sums[QK / GROUP];
    for (int64_t k = 0; k < padded; k += size) {
        const int64_t n = in - k < size ? (in - k > 0 ? in - k : 0) : size;
        const float top = largest(x + k, n), d = top / 127.0f;
        quantize_block(x + k, n, size, top, q + k, group_sums);
        if (layout == ROW32) {
            for (int l = 0; l < 8; l++)
                scales[k / 4 + l] = d;
            sums[k / GROUP] = d * (float)group_sums[0];
            sums[k / GROUP + 1] = d * (float)group_sums[1];
        } else {
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
    const float *scale; /* ROW32: per 4 values; ROW256: per 256 */
    const float *sums;  /* per 16 values */
} q_row;

static inline q_row row_at(const uint8_t *row, int64_t padded, int layout) {
    q_row x = {(const int8_t *)row, (const float *)(row + padded), NULL};
    x.sums = x.scale + (layout == ROW32 ? padded / 4 : padded / QK);
    return x;
}

/* A weight row unpacked for the 8-bit products: per unit of QK values, the unsigned codes, the scale a per
   16 values, and b' = b - offset * a (what the sum of those 16 activations is multiplied by). */
typedef struct {
    uint8_t *codes; /* [padded] */
    float *a, *b;   /* [padded / 16] */
} unpacked_row;

static void unpack_row(const block_type *t, const uint8_t *w, int64_t in, unpacked_row *u) {
    const int64_t padded = q8_padded(in);
    for (int64_t k = 0; k < padded; k += QK) {
        int n = in - k < QK ? (int)(in - k) : QK;
        int8_t *c = (int8_t *)u->codes + k;
        float *a = u->a + k / GROUP, *b = u->b + k / GROUP;
        t->unpack(w, n, c, a, b);
        w += n / t->elements * t->bytes;
        for (int g = 0; g < QK / GROUP; g++) {
            if (g >= n / GROUP) { /* past the row's end: nothing */
                a[g] = 0.0f;
                b[g] = 0.0f;
                continue;
            }
            b[g] = (t->has_b ? b[g] : 0.0f) - (float)t->offset * a[g];
        }
        memset(c + n, 0, (size_t)(QK - n));
        for (int i = 0; i < n; i++)
            c[i] = (int8_t)(uint8_t)((int)c[i] + t->offset);
    }
}

#define Q_ROWS 4 /* activation rows that share one pass over a weight row */

/* sums[r] = rows[r] . the unpacked weight row, for any type: per 64 values an integer dot lane by lane (4 values a
   lane), scaled; per 16 values the offset b' times the activations' sum. */
static void q_dots(const unpacked_row *u, const uint8_t *const *rows, int nr, int64_t padded, int layout,
                   float *sums) {
    for (int r = 0; r < nr; r++) {
        const q_row x = row_at(rows[r], padded, layout);
        float lanes[16] = {0};
        for (int64_t k = 0; k < padded; k += QK) {
            float unit[16] = {0};
            for (int64_t c = k; c < k + QK; c += 64)
                for (int l = 0; l < 16; l++) {
                    int dot = 0;
                    for (int i = 0; i < 4; i++)
                        dot += (int)u->codes[c + 4 * l + i] * (int)x.q[c + 4 * l + i];
                    const float a = u->a[(c + 4 * l) / GROUP];
                    unit[l] = fmaf((float)dot, layout == ROW32 ? a * x.scale[(c + 4 * l) / 4] : a, unit[l]);
                }
            for (int l = 0; l < 16; l++) {
                unit[l] = fmaf(u->b[k / GROUP + l], x.sums[k / GROUP + l], unit[l]);
                lanes[l] = layout == ROW32 ? lanes[l] + unit[l] : fmaf(unit[l], x.scale[k / QK], lanes[l]);
            }
        }
        float half[8];
        for (int l = 0; l < 8; l++)
            half[l] = lanes[l] + lanes[l + 8];
        sums[r] = ((half[0] + half[4]) + (half[2] + half[6])) + ((half[1] + half[5]) + (half[3] + half[7]));
    }
}

#if LANES == 16 && defined(__AVX512VNNI__)
/* The hot types' products unpack and multiply in registers, for up to Q_ROWS rows at once (a weight row's codes are
   read once for them): what a one-row decode step of a Q4_K_M or Q8_0 file spends its time on. Each sums a
   (row, output) pair in one order, whatever the batch; two chains a row (even and odd chunks of 64), so a step
   does not wait on the one before. */

static inline float half_fast(const uint8_t *p) { /* (F16C; a NaN's payload may differ from half_to_float's) */
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline __m512 dots(__m512i codes, const int8_t *x) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(x)));
}

static inline __m512 lanes_of(__m512 a, int first) { /* lanes 0-7 a[first], 8-15 a[first + 1] */
    return _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(first),
                                                  _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1)), a);
}

static inline __m512 groups_of(__m512 a, int first) { /* lanes 4i..4i+3 a[first + i] */
    return _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(first),
                                                  _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)), a);
}

/* K-quants: a super-block's chunks summed unscaled (acc), then times the row's d for those 256 values. */
static inline __attribute__((always_inline)) void dots_q4_K(const uint8_t *w, int64_t in, const q_row *x, int nr,
                                                            vec *acc) {
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i pick_min = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    for (int64_t k = 0; k < in; k += QK, w += 144) {
        uint32_t s[3];
        memcpy(s, w + 4, 12);
        const uint32_t scale_low = s[0] & 0x3f3f3f3fu, min_low = s[1] & 0x3f3f3f3fu;
        const uint32_t scale_high = (s[2] & 0x0f0f0f0fu) | ((s[0] >> 2) & 0x30303030u);
        const uint32_t min_high = ((s[2] >> 4) & 0x0f0f0f0fu) | ((s[1] >> 2) & 0x30303030u);
        const vec both = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_set_epi32((int)min_high, (int)min_low, (int)scale_high, (int)scale_low))); /* 8 scales, 8 mins */
        const vec a = vtimes(both, vset1(half_fast(w)));
        const vec b = _mm512_permutexvar_ps(pick_min, vtimes(both, vset1(half_fast(w + 2)))); /* dmin * m, per 16 */
        __m512i codes[4];
        for (int c = 0; c < 4; c++) {
            const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(w + 16 + 32 * c)));
            codes[c] = _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xffff0000u, q, 4), low);
        }
        for (int r = 0; r < nr; r++) {
            const int8_t *q = x[r].q + k;
            vec even = vtimes(dots(codes[0], q), lanes_of(a, 0));
            vec odd = vtimes(dots(codes[1], q + 64), lanes_of(a, 2));
            even = vfma(dots(codes[2], q + 128), lanes_of(a, 4), even);
            odd = vfma(dots(codes[3], q + 192), lanes_of(a, 6), odd);
            even = _mm512_fnmadd_ps(b, vload(x[r].sums + k / GROUP), even);
            acc[2 * r + (k / QK & 1)] = vfma(vplus(even, odd), vset1(x[r].scale[k / QK]), acc[2 * r + (k / QK & 1)]);
        }
    }
}

static inline __attribute__((always_inline)) void dots_q6_K(const uint8_t *w, int64_t in, const q_row *x, int nr,
                                                            vec *acc) {
    const __m512i low = _mm512_set1_epi8(15), two = _mm512_set1_epi8(3);
    for (int64_t k = 0; k < in; k += QK, w += 210) {
        const vec a = vtimes(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + 192)))),
                             vset1(half_fast(w + 208)));
        __m512i codes[4];
        for (int h = 0; h < 2; h++) {
            const __m512i l = _mm512_loadu_si512(w + 64 * h);
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(w + 128 + 32 * h));
            const __m512i high01 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
            const __m512i high23 = _mm512_srli_epi16(high01, 4);
            codes[2 * h] = _mm512_or_si512(_mm512_and_si512(l, low),
                                           _mm512_slli_epi16(_mm512_and_si512(high01, two), 4));
            codes[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low),
                                               _mm512_slli_epi16(_mm512_and_si512(high23, two), 4));
        }
        const vec b = vtimes(a, vset1(32.0f)); /* the codes' offset of 32, per 16 values */
        for (int r = 0; r < nr; r++) {
            const int8_t *q = x[r].q + k;
            vec even = vtimes(dots(codes[0], q), groups_of(a, 0));
            vec odd = vtimes(dots(codes[1], q + 64), groups_of(a, 4));
            even = vfma(dots(codes[2], q + 128), groups_of(a, 8), even);
            odd = vfma(dots(codes[3], q + 192), groups_of(a, 12), odd);
            even = _mm512_fnmadd_ps(b, vload(x[r].sums + k / GROUP), even);
            acc[2 * r + (k / QK & 1)] = vfma(vplus(even, odd), vset1(x[r].scale[k / QK]), acc[2 * r + (k / QK & 1)]);
        }
    }
}

/* Q8_0: signed codes meet the activations as |q| and x with q's sign (vpdpbusd takes one side unsigned). */
static inline __attribute__((always_inline)) void dots_q8_0(const uint8_t *w, int64_t in, const q_row *x, int nr,
                                                            vec *acc) {
    for (int64_t k = 0; k < in; k += 64, w += 68) {
        const int two = k + 64 <= in;
        const __m256i q1 = two ? _mm256_loadu_si256((const __m256i *)(w + 36)) : _mm256_setzero_si256();
        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + 2))),
                                             q1, 1);
        const __mmask64 negative = _mm512_movepi8_mask(q);
        const __m512i magnitude = _mm512_abs_epi8(q);
        const vec lanes = _mm512_insertf32x8(vset1(half_fast(w)), _mm256_set1_ps(two ? half_fast(w + 34) : 0.0f), 1);
        for (int r = 0; r < nr; r++) {
            const __m512i xr = two ? _mm512_loadu_si512(x[r].q + k) : _mm512_maskz_loadu_epi8(0xffffffffu, x[r].q + k);
            const __m512i signed_x = _mm512_mask_sub_epi8(xr, negative, _mm512_setzero_si512(), xr);
            const vec scale = two ? vload(x[r].scale + k / 4) : _mm512_maskz_loadu_ps(0x00ff, x[r].scale + k / 4);
            acc[2 * r + (k / 64 & 1)] = vfma(
                _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude, signed_x)),
                vtimes(lanes, scale), acc[2 * r + (k / 64 & 1)]);
        }
    }
}

/* Q4_1, two blocks of 32 a step: the codes d * q, and each block's m times its 32 activations' sum. */
static inline __attribute__((always_inline)) void dots_q4_1(const uint8_t *w, int64_t in, const q_row *x, int nr,
                                                            vec *acc) {
    const __m512i low = _mm512_set1_epi8(15);
    float mins[Q_ROWS] = {0};
    for (int64_t k = 0; k < in; k += 64, w += 40) {
        const int two = k + 64 <= in;
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(w + 4));
        const __m128i q1 = two ? _mm_loadu_si128((const __m128i *)(w + 24)) : _mm_setzero_si128();
        const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1);
        /* bytes [q0 low nibbles, q0 high, q1 low, q1 high] */
        const __m512i spread = _mm512_inserti64x4(_mm512_castsi256_si512(q), _mm256_srli_epi16(q, 4), 1);
        const __m512i codes = _mm512_and_si512(_mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 4, 5, 2, 3, 6, 7),
                                                                        spread), low);
        const float d1 = two ? half_fast(w + 20) : 0.0f, m0 = half_fast(w + 2), m1 = two ? half_fast(w + 22) : 0.0f;
        const vec lanes = _mm512_insertf32x8(vset1(half_fast(w)), _mm256_set1_ps(d1), 1);
        for (int r = 0; r < nr; r++) {
            const __m512i xr = two ? _mm512_loadu_si512(x[r].q + k) : _mm512_maskz_loadu_epi8(0xffffffffu, x[r].q + k);
            const vec scale = two ? vload(x[r].scale + k / 4) : _mm512_maskz_loadu_ps(0x00ff, x[r].scale + k / 4);
            acc[2 * r + (k / 64 & 1)] = vfma(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, xr)),
                                             vtimes(lanes, scale), acc[2 * r + (k / 64 & 1)]);
            const float *sums = x[r].sums + k / GROUP;
            mins[r] = fmaf(m0, sums[0] + sums[1], mins[r]);
            if (two)
                mins[r] = fmaf(m1, sums[2] + sums[3], mins[r]);
        }
    }
    for (int r = 0; r < nr; r++) /* (lane 0 holds the blocks' m terms, added as the last step) */
        acc[2 * r] = _mm512_mask_add_ps(acc[2 * r], 1, acc[2 * r], _mm512_set1_ps(mins[r]));
}

static int has_fused_dots(int type) { return type == 12 || type == 14 || type == 8 || type == 3; }

/* sums[r] = row r . the weight row w, for a type with a fused loop. */
static void fused_q_dots(int type, const uint8_t *w, int64_t in, const uint8_t *const *rows, int nr, int64_t padded,
                         int layout, float *sums) {
    q_row x[Q_ROWS];
    for (int r = 0; r < nr; r++)
        x[r] = row_at(rows[r], padded, layout);
    vec acc[2 * Q_ROWS];
    for (int r = 0; r < 2 * Q_ROWS; r++)
        acc[r] = vzero();
#define FUSED(fn)                                                                                                 \
    switch (nr) {                                                                                                 \
    case 1: fn(w, in, x, 1, acc); break;                                                                          \
    case 2: fn(w, in, x, 2, acc); break;                                                                          \
    case 3: fn(w, in, x, 3, acc); break;                                                                          \
    default: fn(w, in, x, 4, acc); break;                                                                         \
    }
    switch (type) {
    case 12: FUSED(dots_q4_K); break;
    case 14: FUSED(dots_q6_K); break;
    case 8: FUSED(dots_q8_0); break;
    default: FUSED(dots_q4_1); break;
    }
#undef FUSED
    for (int r = 0; r < nr; r++)
        sums[r] = hsum(vplus(acc[2 * r], acc[2 * r + 1]));
}
#else
static int has_fused_dots(int type) { return (void)type, 0; }

static void fused_q_dots(int type, const uint8_t *w, int64_t in, const uint8_t *const *rows, int nr, int64_t padded,
                         int layout, float *sums) {
    (void)type, (void)w, (void)in, (void)rows, (void)nr, (void)padded, (void)layout, (void)sums;
}
#endif

typedef struct {
    const block_type *type;
    const uint8_t *w, *x; /* weights [out, row_bytes]; quantized rows [rows, x_bytes] */
    int64_t rows, in, out, ldy, row_bytes, x_bytes;
    const float *bias;
    float *y;
} qlinear_job;

#define Q_OUTPUTS 8 /* outputs a unit of work takes */

static void qlinear_units(const void *task, int64_t begin, int64_t end) {
    const qlinear_job *j = task;
    const int64_t padded = q8_padded(j->in);
    const int fused = has_fused_dots(j->type->type), layout = layout_of(j->type);
    uint8_t *buffer = fused ? NULL : lined((size_t)padded + sizeof(float) * 2 * (size_t)(padded / GROUP));
    unpacked_row u = {buffer, (float *)(buffer + padded), (float *)(buffer + padded) + padded / GROUP};
    const int64_t last = end * Q_OUTPUTS < j->out ? end * Q_OUTPUTS : j->out;
    for (int64_t o = begin * Q_OUTPUTS; o < last; o++) {
        const uint8_t *w = j->w + o * j->row_bytes;
        if (!fused)
            unpack_row(j->type, w, j->in, &u);
        for (int64_t r0 = 0; r0 < j->rows; r0 += Q_ROWS) {
            const int nr = (int)(j->rows - r0 < Q_ROWS ? j->rows - r0 : Q_ROWS);
            const uint8_t *rows[Q_ROWS];
            float sums[Q_ROWS];
            for (int r = 0; r < nr; r++)
                rows[r] = j->x + (r0 + r) * j->x_bytes;
            if (fused)
                fused_q_dots(j->type->type, w, j->in, rows, nr, padded, layout, sums);
            else
                q_dots(&u, rows, nr, padded, layout, sums);
            for (int r = 0; r < nr; r++)
                j->y[(r0 + r) * j->ldy + o] = j->bias ? sums[r] + j->bias[o] : sums[r];
        }
    }
    free(buffer);
}

/* Quantized rows (`quantize_rows`, in the type's layout) times a block tensor: y[r * ldy + o] = x_r . w_o
   (+ bias[o]). */
static void q_product(const block_type *t, const uint8_t *x, int64_t rows, int64_t in, const void *w, const float *bias,
                      float *y, int64_t ldy, int64_t out, int threads) {
    qlinear_job job = {t, w, x, rows, in, out, ldy, in / t->elements * t->bytes, q8_row_bytes(in, layout_of(t)),
                       bias, y};
    const int64_t units = (out + Q_OUTPUTS - 1) / Q_OUTPUTS;
    parallel(qlinear_units, &job, units, rows * in * out < THREAD_WORK ? 1 : threads);
}

/* y = x W^T (+ bias) with the 8-bit products, W a block tensor [out, in] of `type`. Returns 0, -1 without memory,
   -2 for a type this library does not have. */
int mw_qlinear(const float *x, int64_t rows, int64_t in, const void *w, int type, const float *bias, float *y,
               int64_t ldy, int64_t out, int threads) {
    const block_type *t = block_type_of(type);
    if (!t || in % t->elements)
        return -2;
    uint8_t *q = quantize_rows(x, rows, in, layout_of(t));
    if (!q)
        return -1;
    q_product(t, q, rows, in, w, bias, y, ldy, out, threads);
    free(q);
    return 0;
}
