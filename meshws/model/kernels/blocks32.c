/* 8-bit products of the 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL): sixteen outputs at once.
   #included by quants.c (its block table, activation rows and `parallel`).

   Each (row, output) pair sums block after block, in this order and nothing else:
     i = (sum of the block's 32 code products u * q) - offset * (sum of its q)     exact, in int32
     t = float(i) * (d_w * d_x);  t = fmaf(m_w, d_x * (sum of q), t);  acc = acc + t
   then y = acc (+ bias). u = c + offset are the block's codes made unsigned (the type's `offset`), d_w its scale
   and m_w its minimum (0 for types without one); d_x and the sum of q are the activation block's (`quantize_row`).
   That is llama.cpp's own arithmetic for these types. The integer sum is exact whichever way its products are
   grouped, so any layout that keeps one output's blocks apart gives the same bits. Two layouts do:

   * Tiles, for batches (`v_lay`, `v_rows`): a unit of work takes 16 outputs and lays their blocks out lane by lane
     once (`v_tile`: per block, 8 vectors of 16 lanes x 4 codes, and the 16 scales and minima), then runs every row
     of the batch against them: a vpdpbusd per 4 codes of 16 outputs, the row's 4 codes broadcast, and per block a
     few float operations for 16 outputs at once. A 16-row decode wave of SmolLM2 (Q4_1 layers, Q8_0 LM head)
     got much faster than with what this replaced: one row per weight row with horizontal sums, which read each
     row's codes once per 8 rows and summed 16 lanes per output.
   * Straight from the blocks, for a lone row or a few (`v_direct`, `v_direct_q8`): laying out a tile costs one
     row more than its products. The rows' blocks are read as they lie and each output's block sums brought into
     lanes afterwards, so a lone SmolLM2 step is no slower than before the tiles.
   `v_direct_below` says where one gives way to the other. AVX2 builds run the same sums with eight outputs to the
   lanes, from the blocks as they lie (`blocks32_avx2.c`); plain C builds lane by lane in scalar code: the same bits
   on every instruction set, for a row alone or in any batch, on any thread count. */

#define V_OUT 16  /* outputs a tile holds: one per lane */
#define V_ROWS 8  /* rows that pass over a tile's block together (their accumulators stay in registers) */
#define V_PANEL 11 /* lanes a row takes a block in a group of rows (`v_panel`) */
#define V_SPREAD 64 /* bytes of a row's codes a block, spread as `v_direct` reads them (`v_spread`) */

typedef struct {
    uint8_t *codes;  /* [blocks][8][V_OUT][4]: vector g of a block holds values 4g .. 4g + 3 of each output */
    float *d, *m;    /* [blocks][V_OUT] */
} v_tile;

static int64_t v_tile_bytes(int64_t blocks) { return blocks * (8 * V_OUT * 4 + 2 * V_OUT * (int64_t)sizeof(float)); }

static v_tile v_tile_at(uint8_t *buffer, int64_t blocks) {
    v_tile tile = {buffer, (float *)(buffer + blocks * 8 * V_OUT * 4), NULL};
    tile.m = tile.d + blocks * V_OUT;
    return tile;
}

/* The tile of outputs w[0 .. n) (rows `row_bytes` apart), any 32-value type, through its `unpack`. */
static void v_lay_any(const block_type *t, const uint8_t *w, int64_t row_bytes, int n, int64_t blocks, v_tile *tile) {
    int8_t codes[QK];
    float a[QK / GROUP], b[QK / GROUP];
    memset(tile->codes, 0, (size_t)(blocks * 8 * V_OUT * 4));
    memset(tile->d, 0, sizeof(float) * (size_t)(2 * blocks * V_OUT));
    for (int o = 0; o < n; o++)
        for (int64_t k = 0; k < blocks; k += 8) {
            const int count = blocks - k < 8 ? (int)(blocks - k) : 8;
            t->unpack(w + o * row_bytes + k * t->bytes, 32 * count, codes, a, b);
            for (int i = 0; i < count; i++) {
                uint8_t *to = tile->codes + (k + i) * 8 * V_OUT * 4 + 4 * o;
                for (int g = 0; g < 8; g++)
                    for (int v = 0; v < 4; v++)
                        to[g * V_OUT * 4 + v] = (uint8_t)((int)codes[32 * i + 4 * g + v] + t->offset);
                tile->d[(k + i) * V_OUT + o] = a[2 * i];
                tile->m[(k + i) * V_OUT + o] = t->has_b ? b[2 * i] : 0.0f;
            }
        }
}

#if LANES == 16 && defined(__AVX512VNNI__)
/* 16 x 16 lanes transposed in place (r[i] lane j <-> r[j] lane i): at each step, within every block of 2s x 2s
   lanes, the top-right s x s block swaps with the bottom-left one (64 two-register permutes in all, unrolled so
   that the 16 registers stay registers). `swaps`: `v_tables.swaps`. */
static inline __attribute__((always_inline)) void v_transpose(__m512i *r, const int32_t (*swaps)[16]) {
#pragma GCC unroll 4
    for (int step = 0, s = 8; s >= 1; step++, s /= 2)
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            if (!(i & s)) {
                const __m512i a = r[i], b = r[i + s];
                r[i] = _mm512_permutex2var_epi32(a, _mm512_loadu_si512(swaps[2 * step]), b);
                r[i + s] = _mm512_permutex2var_epi32(a, _mm512_loadu_si512(swaps[2 * step + 1]), b);
            }
}

static int v_shuffled(const block_type *t) { /* the types `v_lay` and `v_direct` read as stored */
    return t->loop == LOOP_Q4_0 || t->loop == LOOP_Q4_1 || t->loop == LOOP_Q8_0 || t->loop == LOOP_IQ4_NL;
}

static int v_head(const block_type *t) { return t->loop == LOOP_Q4_1 ? 4 : 2; } /* Q4_1's d and m, or a d; then codes */

/* The permutes `v_lay` takes, made once (`v_tables_once`, by the first product on tiles: `v_product`): built on
   each call, their scalar stores stalled the vector loads that read them, a measurable share of laying out a tile
   (and the unrolled transpose another). Not made as the library loads: that code is built for this CPU's vectors. */
static struct {
    int32_t swaps[8][16];                      /* `v_transpose`'s, two a step */
    uint8_t take[3][64], heads[3][64];         /* per type (Q4_0, Q4_1, Q8_0): where a pass's codes and heads lie */
    int32_t pair[16];                          /* lanes 4 o + b of two packed registers: outputs 0-7 */
} v_tables;

static int v_table(const block_type *t) { /* (IQ4_NL's blocks lie as Q4_0's) */
    return t->loop == LOOP_Q4_0 || t->loop == LOOP_IQ4_NL ? 0 : t->loop == LOOP_Q4_1 ? 1 : 2;
}

/* A nibble type's codes made unsigned: as they are, or IQ4_NL's looked up (`table`: NONLINEAR_U in each quarter). */
static inline __m512i v_nibbles(int nonlinear, __m512i nibbles, __m512i table) {
    return nonlinear ? _mm512_shuffle_epi8(table, nibbles) : nibbles;
}

static pthread_once_t v_tables_once = PTHREAD_ONCE_INIT;

static void v_make_tables(void) {
    for (int step = 0, s = 8; s >= 1; step++, s /= 2)
        for (int j = 0; j < 16; j++) {
            v_tables.swaps[2 * step][j] = j & s ? 16 + j - s : j;
            v_tables.swaps[2 * step + 1][j] = j & s ? 16 + j : j + s;
        }
    const int types[3] = {2, 3, 8};
    for (int k = 0; k < 3; k++) {
        const block_type *t = block_type_of(types[k]);
        const int q8 = t->loop == LOOP_Q8_0, per = q8 ? 2 : 4, codes_at = v_head(t);
        for (int i = 0; i < 64; i++) {
            v_tables.take[k][i] = (uint8_t)(q8 ? i / 32 * t->bytes + codes_at + i % 32 :
                                                 i / 16 * t->bytes + codes_at + i % 16);
            v_tables.heads[k][i] = (uint8_t)(i < 4 * per ? i / 4 * t->bytes + i % 4 : 0); /* (a pass's first 64) */
        }
    }
    for (int o = 0; o < 16; o++)
        v_tables.pair[o] = o < 8 ? 4 * (o % 4) + (o / 4) * 16 : 0;
}

/* Q4_0, Q4_1 and Q8_0 laid out from plain loads: per output, a pass's codes (4 blocks of 16 bytes of nibbles, or 2
   of 32 codes) gathered into one register with a byte permute, 16 outputs' registers transposed; then the heads
   (d, and Q4_1's m) likewise, four outputs to a register. Nibbles: byte j of a block holds value j (low) and
   j + 16 (high). Meanwhile `next_bytes` of a later unit's rows (`next`) are fetched into L2. */
static void v_lay(const block_type *t, const uint8_t *w, int64_t row_bytes, int n, int64_t blocks, v_tile *tile,
                  const uint8_t *next, int64_t next_bytes) {
    if (!v_shuffled(t)) {
        v_lay_any(t, w, row_bytes, n, blocks, tile);
        return;
    }
    const int bytes = t->bytes, q8 = t->loop == LOOP_Q8_0, per = q8 ? 2 : 4, table = v_table(t);
    const __m512i codes_from = _mm512_loadu_si512(v_tables.take[table]);
    const __m512i heads_from = _mm512_loadu_si512(v_tables.heads[table]);
    const __m512i pair = _mm512_loadu_si512(v_tables.pair);
    const __m512i nibble = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    const int nl = t->loop == LOOP_IQ4_NL;
    const __m512i lookup = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)NONLINEAR_U));
    const int64_t lines = (next_bytes + 63) / 64, passes = (blocks + per - 1) / per;
    const int64_t per_pass = (lines + passes - 1) / passes;
    for (int64_t b0 = 0; b0 < blocks; b0 += per) {
        const int count = blocks - b0 < per ? (int)(blocks - b0) : per, span = count * bytes;
        for (int64_t line = b0 / per * per_pass; line < (b0 / per + 1) * per_pass && line < lines; line++)
            __builtin_prefetch(next + 64 * line, 0, 2); /* (16 rows a pass apart: the hardware's prefetch lags) */
        const __mmask64 near = span >= 64 ? ~0ULL : (1ULL << span) - 1, far = span > 64 ? (1ULL << (span - 64)) - 1 : 0;
        const uint8_t *from = w + b0 * bytes;
        __m512i c[16];
#pragma GCC unroll 16
        for (int o = 0; o < 16; o++)
            c[o] = o < n ? _mm512_permutex2var_epi8(_mm512_maskz_loadu_epi8(near, from + o * row_bytes), codes_from,
                                                    _mm512_maskz_loadu_epi8(far, from + o * row_bytes + 64)) :
                _mm512_setzero_si512();
        v_transpose(c, v_tables.swaps); /* c[j]: dword j of every output's pass */
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) { /* (unrolled, with i known: c stays in registers) */
            if (i >= count)
                break;
            __m512i *to = (__m512i *)(tile->codes + (b0 + i) * 8 * V_OUT * 4);
            if (q8 && i < 2) /* (a Q8_0 pass holds two blocks) */
                for (int g = 0; g < 8; g++)
                    _mm512_store_si512(to + g, _mm512_xor_si512(c[8 * i + g], flip));
            else if (!q8)
                for (int g = 0; g < 4; g++) {
                    _mm512_store_si512(to + g, v_nibbles(nl, _mm512_and_si512(c[4 * i + g], nibble), lookup));
                    _mm512_store_si512(to + 4 + g, v_nibbles(nl, _mm512_and_si512(_mm512_srli_epi32(c[4 * i + g], 4),
                                                                                   nibble), lookup));
                }
        }
        __m512i packed[4]; /* the heads of outputs 4k .. 4k + 3: lane 4 o + b */
        for (int k = 0; k < 4; k++) {
            packed[k] = _mm512_setzero_si512();
            for (int o = 0; o < 4 && 4 * k + o < n; o++)
                packed[k] = _mm512_inserti32x4(packed[k], _mm512_castsi512_si128(_mm512_permutexvar_epi8(
                    heads_from, _mm512_maskz_loadu_epi8(near, from + (4 * k + o) * row_bytes))), o);
        }
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            if (i >= count)
                break;
            const __m512i at = _mm512_add_epi32(pair, _mm512_set1_epi32(i));
            const __m512i head = _mm512_inserti64x4(_mm512_permutex2var_epi32(packed[0], at, packed[1]),
                                                    _mm512_castsi512_si256(_mm512_permutex2var_epi32(packed[2], at,
                                                                                                     packed[3])), 1);
            _mm512_store_ps(tile->d + (b0 + i) * V_OUT, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head)));
            _mm512_store_ps(tile->m + (b0 + i) * V_OUT, t->loop == LOOP_Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(
                _mm512_srli_epi32(head, 16))) : _mm512_setzero_ps());
        }
    }
}

/* A lone row of a nibble type (Q4_0, Q4_1) against 16 outputs read straight from their blocks (no tile: laying
   one out costs a lone row more than its products). Four outputs share a register, one 128-bit quarter each: a
   block's first 16 bytes as they lie, head included, and then its last nibbles; the row's codes are spread to
   match (`v_spread`: zeros against the heads and whatever follows a block), so each quarter's vpdpbusd lanes sum
   parts of its output's block, and three in-lane transposing adds give every output's exact block sum. The lanes
   then hold outputs 0, 4, 8, 12, 1, 5, ... (lane 4q + i: output 4i + q), their scales too, so the float steps are
   the tile's, lane by lane; the lanes are put back in order at the end. */

/* A row's codes spread per block (V_SPREAD bytes) as `v_direct` meets them: the low then high nibbles' values of
   a block's first 16 bytes (none against its head), then of its next `head` bytes. */
static void v_spread(const block_type *t, const int8_t *q, int64_t blocks, int8_t *to) {
    const int head = v_head(t);
    for (int64_t b = 0; b < blocks; b++, q += 32, to += V_SPREAD) {
        memset(to, 0, V_SPREAD);
        for (int j = head; j < 16; j++) { /* bytes head .. 15: nibbles of values j - head and j - head + 16 */
            to[j] = q[j - head];
            to[16 + j] = q[j - head + 16];
        }
        for (int j = 0; j < head; j++) { /* bytes 16 .. 16 + head: values 16 - head + j and 32 - head + j */
            to[32 + j] = q[16 - head + j];
            to[48 + j] = q[32 - head + j];
        }
    }
}

static inline __m512i v_quads(const uint8_t *const *from, int64_t at, __mmask16 keep) { /* 16 bytes of 4 outputs */
    __m512i v = _mm512_castsi128_si512(_mm_maskz_loadu_epi8(keep, from[0] + at));
    for (int i = 1; i < 4; i++)
        v = _mm512_inserti32x4(v, _mm_maskz_loadu_epi8(keep, from[i] + at), i);
    return v;
}

static inline __m512i v_gather_lanes(__m512i s0, __m512i s1, __m512i s2, __m512i s3) { /* quarter q: s_i's lane 0 */
    return _mm512_unpacklo_epi64(_mm512_unpacklo_epi32(s0, s1), _mm512_unpacklo_epi32(s2, s3));
}

static inline __m512i v_sum_lanes(__m512i s0, __m512i s1, __m512i s2, __m512i s3) { /* quarter q: sums of s_i's */
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(s0, s1), _mm512_unpackhi_epi32(s0, s1));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(s2, s3), _mm512_unpackhi_epi32(s2, s3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}

/* Eight columns of a [16][stride] table of int32 (from `at`) as registers: column b's lane o is at[o * stride + b].
   Rows o and o + 8 share a register, then an 8 x 8 transpose within each half. */
static inline __attribute__((always_inline)) void v_columns(const int32_t *at, int64_t stride, __m512i *column) {
    __m512i r[8], t[8];
    for (int o = 0; o < 8; o++)
        r[o] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(at + o * stride))),
                                  _mm256_loadu_si256((const __m256i *)(at + (o + 8) * stride)), 1);
    for (int o = 0; o < 8; o += 2) {
        t[o] = _mm512_unpacklo_epi32(r[o], r[o + 1]);
        t[o + 1] = _mm512_unpackhi_epi32(r[o], r[o + 1]);
    }
    for (int o = 0; o < 8; o += 4) {
        r[o] = _mm512_unpacklo_epi64(t[o], t[o + 2]);
        r[o + 1] = _mm512_unpackhi_epi64(t[o], t[o + 2]);
        r[o + 2] = _mm512_unpacklo_epi64(t[o + 1], t[o + 3]);
        r[o + 3] = _mm512_unpackhi_epi64(t[o + 1], t[o + 3]);
    }
    const __m512i low = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
    const __m512i high = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
    for (int i = 0; i < 4; i++) { /* r[i]: columns i (128-bit lanes 0, 2) and i + 4 (lanes 1, 3) of rows 0-3 ... */
        column[i] = _mm512_permutex2var_epi64(r[i], low, r[i + 4]);
        column[i + 4] = _mm512_permutex2var_epi64(r[i], high, r[i + 4]);
    }
}

/* Q8_0 for a lone row: each output's row read in order (as the hardware's prefetch likes it), eight blocks at a
   time: their codes in four registers of two blocks (32 codes each, as they lie) against the row's codes, the
   two registers' quarters of one block added (quarter b: block b's four partial sums), each quarter summed, and
   the eight block sums kept (`sums`, [16][blocks rounded up to 8]) with the eight d (`heads`); then block by block
   the 16 outputs' sums and d are gathered into lanes (from L1) for the tile's float steps. */
static void v_direct_q8(const uint8_t *w, int64_t row_bytes, int n, int64_t blocks, const int8_t *q,
                        const int32_t *panel, const float *bias, float *y, int32_t *sums, int32_t *heads) {
    const int64_t stride = (blocks + 7) / 8 * 8;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    int16_t first[32] = {0}, second[32] = {0}; /* words: block b's d at word 17 b of the unit (b < 4: z0:z1) */
    for (int b = 0; b < 4; b++) {
        first[b] = (int16_t)(17 * b);
        second[4 + b] = (int16_t)(17 * (b + 4) - 64);
    }
    const __m512i heads_low = _mm512_loadu_si512(first), heads_high = _mm512_loadu_si512(second);
    const __m512i picks = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int o = 0; o < n; o++) {
        const uint8_t *u = w + o * row_bytes;
        for (int64_t k = 0; k < blocks; k += 8, u += 272) {
            const int count = blocks - k < 8 ? (int)(blocks - k) : 8;
            __builtin_prefetch(u + PREFETCH, 0, 2);
            __builtin_prefetch(u + PREFETCH + 64, 0, 2);
            __builtin_prefetch(u + PREFETCH + 128, 0, 2);
            __builtin_prefetch(u + PREFETCH + 192, 0, 2);
            __builtin_prefetch(u + PREFETCH + 256, 0, 2);
            __m512i z[4], d[4];
            for (int c = 0; c < 4; c++) {
                const int64_t left = 34 * count - 64 * c;
                z[c] = _mm512_maskz_loadu_epi8(left >= 64 ? ~0ULL : left <= 0 ? 0 : (1ULL << left) - 1, u + 64 * c);
                const __m256i one = 2 * c < count ? _mm256_loadu_si256((const __m256i *)(u + 68 * c + 2)) :
                    _mm256_setzero_si256();
                const __m256i two = 2 * c + 1 < count ? _mm256_loadu_si256((const __m256i *)(u + 68 * c + 36)) :
                    _mm256_setzero_si256();
                d[c] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(
                    _mm512_inserti64x4(_mm512_castsi256_si512(one), two, 1), flip),
                    _mm512_loadu_si512(q + 32 * k + 64 * c));
            }
            __m512i e[2];
            for (int j = 0; j < 2; j++) {
                e[j] = _mm512_add_epi32(_mm512_shuffle_i32x4(d[2 * j], d[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                        _mm512_shuffle_i32x4(d[2 * j], d[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
                e[j] = _mm512_add_epi32(e[j], _mm512_shuffle_epi32(e[j], _MM_PERM_BADC));
                e[j] = _mm512_add_epi32(e[j], _mm512_shuffle_epi32(e[j], _MM_PERM_CDAB));
            }
            _mm256_storeu_si256((__m256i *)(sums + o * stride + k),
                                _mm512_castsi512_si256(_mm512_permutex2var_epi32(e[0], picks, e[1])));
            _mm256_storeu_si256((__m256i *)(heads + o * stride + k), _mm512_castsi512_si256(_mm512_cvtepu16_epi32(
                _mm512_castsi512_si256(_mm512_mask_blend_epi16(0xf0, _mm512_permutex2var_epi16(z[0], heads_low, z[1]),
                                                               _mm512_permutex2var_epi16(z[2], heads_high, z[3]))))));
        }
    }
    for (int o = n; o < 16; o++) /* (lanes of no output: zeros) */
        for (int64_t k = 0; k < stride; k++)
            sums[o * stride + k] = heads[o * stride + k] = 0;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < blocks; k += 8) {
        __m512i dots[8], ds[8];
        v_columns(sums + k, stride, dots);
        v_columns(heads + k, stride, ds);
        for (int b = 0; b < 8 && k + b < blocks; b++) {
            const int32_t *p = panel + (k + b) * V_PANEL;
            float dx, share;
            memcpy(&dx, p + 9, 4);
            memcpy(&share, p + 10, 4);
            const __m512 scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(ds[b]));
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dots[b], _mm512_set1_epi32(p[8]))),
                                     _mm512_mul_ps(scale, _mm512_set1_ps(dx)));
            t = _mm512_fmadd_ps(_mm512_setzero_ps(), _mm512_set1_ps(share), t);
            acc = _mm512_add_ps(acc, t);
        }
    }
    const __mmask16 live = n >= V_OUT ? 0xffff : (__mmask16)((1u << n) - 1);
    _mm512_mask_storeu_ps(y, live, bias ? _mm512_add_ps(acc, _mm512_maskz_loadu_ps(live, bias)) : acc);
}

/* y[o] (o < n) = the row (spread codes `spread`, and its panel of one row: totals, d, shares) . output o (+ bias);
   meanwhile the next unit's rows (`next`, `next_bytes`) are fetched. */
static void v_direct(const block_type *t, const uint8_t *w, int64_t row_bytes, int n, int64_t blocks,
                     const int8_t *spread, const int32_t *panel, const float *bias, float *y, const uint8_t *next,
                     int64_t next_bytes) {
    const int64_t lines = (next_bytes + 63) / 64, per_block = (lines + blocks - 1) / blocks;
    const uint8_t *rows[16];
    for (int o = 0; o < 16; o++) /* (outputs past n read output n - 1 again; their lanes are not stored) */
        rows[o] = w + (o < n ? o : n - 1) * row_bytes;
    const __mmask16 second = (__mmask16)((1u << v_head(t)) - 1); /* a block's last nibbles */
    const __m512i nibble = _mm512_set1_epi8(15);
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)NONLINEAR_U));
    const int nl = t->loop == LOOP_IQ4_NL; /* (its head's looked-up nibbles meet the spread row's zeros) */
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, spread += V_SPREAD, panel += V_PANEL) {
        const int64_t at = b * t->bytes;
        for (int64_t line = b * per_block; line < (b + 1) * per_block && line < lines; line++)
            __builtin_prefetch(next + 64 * line, 0, 0); /* (16 rows a block apart: the hardware's prefetch lags) */
        const __m512i x0 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)spread));
        const __m512i x1 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(spread + 16)));
        const __m512i x2 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(spread + 32)));
        const __m512i x3 = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(spread + 48)));
        __m512i sums[4], heads[4];
        for (int k = 0; k < 4; k++) {
            const uint8_t *const *four = rows + 4 * k;
            const __m512i a = v_quads(four, at, 0xffff), c = v_quads(four, at + 16, second);
            heads[k] = a;
            __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v_nibbles(nl, _mm512_and_si512(a, nibble), table),
                                            x0);
            s = _mm512_dpbusd_epi32(s, v_nibbles(nl, _mm512_and_si512(_mm512_srli_epi32(a, 4), nibble), table), x1);
            s = _mm512_dpbusd_epi32(s, v_nibbles(nl, _mm512_and_si512(c, nibble), table), x2);
            sums[k] = _mm512_dpbusd_epi32(s, v_nibbles(nl, _mm512_and_si512(_mm512_srli_epi32(c, 4), nibble), table),
                                          x3);
        }
        const __m512i dot = _mm512_add_epi32(v_sum_lanes(sums[0], sums[1], sums[2], sums[3]),
                                             _mm512_set1_epi32(panel[8]));
        const __m512i h = v_gather_lanes(heads[0], heads[1], heads[2], heads[3]);
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h));
        const __m512 m = t->loop == LOOP_Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16))) :
            _mm512_setzero_ps();
        const float *scale = (const float *)panel + 9, *share = scale + 1;
        __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(scale[0])));
        v = _mm512_fmadd_ps(m, _mm512_set1_ps(share[0]), v);
        acc = _mm512_add_ps(acc, v);
    }
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __mmask16 live = n >= V_OUT ? 0xffff : (__mmask16)((1u << n) - 1);
    acc = _mm512_permutexvar_ps(order, acc); /* lane o: output o */
    _mm512_mask_storeu_ps(y, live, bias ? _mm512_add_ps(acc, _mm512_maskz_loadu_ps(live, bias)) : acc);
}

/* sum + u . (*q in every lane), the broadcast folded into the vpdpbusd (GCC otherwise broadcasts with an
   instruction of its own, one per product: a third more vector work in `v_rows`). */
static inline __attribute__((always_inline)) __m512i v_dot_broadcast(__m512i sum, __m512i u, const int32_t *q) {
    __asm__("vpdpbusd {%2%{1to16%}, %1, %0|%0, %1, %2%{1to16%}}" : "+v"(sum) : "v"(u), "m"(*q)); /* (AT&T|Intel) */
    return sum;
}

/* acc[r] (lane o: output o) = the sums of the panel's rows (`v_panel`) with the tile's outputs. */
static inline __attribute__((always_inline)) void v_rows(const v_tile *tile, int64_t blocks, const int32_t *panel,
                                                         int nr, __m512 *acc) {
    for (int r = 0; r < nr; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++, panel += V_PANEL * nr) {
        const __m512i *codes = (const __m512i *)(tile->codes + b * 8 * V_OUT * 4);
        __m512i dot[V_ROWS];
        for (int r = 0; r < nr; r++)
            dot[r] = _mm512_set1_epi32(panel[8 * nr + r]);
        for (int g = 0; g < 8; g++) {
            const __m512i u = _mm512_load_si512(codes + g);
            for (int r = 0; r < nr; r++)
                dot[r] = v_dot_broadcast(dot[r], u, panel + g * nr + r);
        }
        const __m512 d = _mm512_load_ps(tile->d + b * V_OUT), m = _mm512_load_ps(tile->m + b * V_OUT);
        const float *scale = (const float *)panel + 9 * nr, *share = scale + nr;
        for (int r = 0; r < nr; r++) {
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, _mm512_set1_ps(scale[r])));
            t = _mm512_fmadd_ps(m, _mm512_set1_ps(share[r]), t);
            acc[r] = _mm512_add_ps(acc[r], t);
        }
    }
}

/* The panel's nr rows (nr <= V_ROWS) times the tile: y[r * ldy + o] for its n outputs (+ bias[o]). */
static void v_block_rows(const v_tile *tile, int64_t blocks, const int32_t *panel, int nr, int n, const float *bias,
                         float *y, int64_t ldy) {
    __m512 acc[V_ROWS];
    switch (nr) { /* loops built for 8, 4, 2 and 1 rows: the caller hands out groups of those sizes */
    case 8: v_rows(tile, blocks, panel, 8, acc); break;
    case 4: v_rows(tile, blocks, panel, 4, acc); break;
    case 2: v_rows(tile, blocks, panel, 2, acc); break;
    default: v_rows(tile, blocks, panel, 1, acc); break;
    }
    const __mmask16 live = n >= V_OUT ? 0xffff : (__mmask16)((1u << n) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(live, bias) : _mm512_setzero_ps();
    for (int r = 0; r < nr; r++)
        _mm512_mask_storeu_ps(y + r * ldy, live, bias ? _mm512_add_ps(acc[r], add) : acc[r]);
}
#else
static void v_lay(const block_type *t, const uint8_t *w, int64_t row_bytes, int n, int64_t blocks, v_tile *tile,
                  const uint8_t *next, int64_t next_bytes) {
    (void)next, (void)next_bytes;
    v_lay_any(t, w, row_bytes, n, blocks, tile);
}

static void v_block_rows(const v_tile *tile, int64_t blocks, const int32_t *panel, int nr, int n, const float *bias,
                         float *y, int64_t ldy) {
    for (int r = 0; r < nr; r++)
        for (int o = 0; o < n; o++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                const int32_t *p = panel + b * V_PANEL * nr;
                const uint8_t *u = tile->codes + b * 8 * V_OUT * 4 + 4 * o;
                int32_t dot = p[8 * nr + r];
                for (int g = 0; g < 8; g++) {
                    int8_t q[4];
                    memcpy(q, p + g * nr + r, 4);
                    for (int v = 0; v < 4; v++)
                        dot += (int32_t)u[g * V_OUT * 4 + v] * (int32_t)q[v];
                }
                const float *scale = (const float *)p + 9 * nr, *share = scale + nr;
                float t = (float)dot * (tile->d[b * V_OUT + o] * scale[r]);
                t = fmaf(tile->m[b * V_OUT + o], share[r], t);
                acc = acc + t;
            }
            y[r * ldy + o] = bias ? acc + bias[o] : acc;
        }
}
#endif

#if !(LANES == 16 && defined(__AVX512VNNI__)) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) \
    && !defined(GENERIC)
#define V2_PRODUCT 1 /* eight outputs to the lanes, straight from the blocks, for any number of rows */
#include "blocks32_avx2.c"
#endif

/* A group of nr rows (8, 4, 2 or 1) as the loops read them, block after block: each 4 codes of the block for every
   row in turn (8 x nr lanes), then -offset * (sum of its codes), d and d * (sum of its codes) of each row. */
static void v_panel(const uint8_t *rows, int64_t x_bytes, int nr, int64_t in, int offset, int32_t *panel) {
    const int64_t padded = q8_padded(in), blocks = in / 32;
    for (int r = 0; r < nr; r++) {
        const q_row x = row_at(rows + r * x_bytes, padded, ROW32);
        for (int64_t b = 0; b < blocks; b++) {
            int32_t *p = panel + b * V_PANEL * nr;
            for (int g = 0; g < 8; g++)
                memcpy(p + g * nr + r, x.q + 32 * b + 4 * g, 4);
            p[8 * nr + r] = -offset * x.totals[b];
            memcpy(p + 9 * nr + r, x.scale + b, 4);
            memcpy(p + 10 * nr + r, x.sums + b, 4);
        }
    }
}

typedef struct {
    const block_type *type;
    const uint8_t *w;
    const int32_t *panels; /* the rows' groups (`v_panel`), one after the other */
    int direct;            /* each row straight from the blocks (`v_direct`, `v_direct_q8`), not on tiles */
    const int8_t *spread;  /* for `v_direct`: each row's spread codes */
    const int8_t *codes;   /* for `v_direct_q8`: the quantized rows (`quantize_rows`), x_bytes apart */
    int64_t rows, in, out, ldy, row_bytes, x_bytes;
    const float *bias;
    float *y;
} v_job;

static inline int v_group(int64_t left) { return left >= V_ROWS ? V_ROWS : left >= 4 ? 4 : left >= 2 ? 2 : 1; }

/* Units of V_OUT outputs: their tile laid out once, then every group of rows against it; or each row straight from
   the blocks (`v_direct`). */
static void v_units(const void *task, int64_t begin, int64_t end) {
    const v_job *j = task;
    const int64_t blocks = j->in / 32;
    const int64_t stride = (blocks + 7) / 8 * 8; /* (`v_direct_q8`'s block sums and d, 16 rows of them) */
    uint8_t *buffer = lined((size_t)(j->direct ? 16 * 8 * stride : v_tile_bytes(blocks)));
    if (!buffer)
        abort(); /* (a few KiB per thread: nothing else could go on either) */
    v_tile tile = v_tile_at(buffer, blocks);
    for (int64_t unit = begin; unit < end; unit++) {
        const int64_t o0 = unit * V_OUT;
        const int n = j->out - o0 < V_OUT ? (int)(j->out - o0) : V_OUT;
        const float *bias = j->bias ? j->bias + o0 : NULL;
        const uint8_t *next = j->w + (o0 + V_OUT) * j->row_bytes; /* the next unit's rows, read soon */
#if LANES == 16 && defined(__AVX512VNNI__)
        if (j->direct) {
            const int64_t ahead = unit + 1 < end ? (j->out - o0 - V_OUT < V_OUT ? j->out - o0 - V_OUT : V_OUT) : 0;
            for (int64_t r = 0; r < j->rows; r++)
                if (j->type->loop == LOOP_Q8_0)
                    v_direct_q8(j->w + o0 * j->row_bytes, j->row_bytes, n, blocks, j->codes + r * j->x_bytes,
                                j->panels + r * blocks * V_PANEL, bias, j->y + r * j->ldy + o0, (int32_t *)buffer,
                                (int32_t *)buffer + 16 * stride);
                else
                    v_direct(j->type, j->w + o0 * j->row_bytes, j->row_bytes, n, blocks,
                             j->spread + r * blocks * V_SPREAD, j->panels + r * blocks * V_PANEL, bias,
                             j->y + r * j->ldy + o0, next, r ? 0 : ahead * j->row_bytes);
            continue;
        }
#endif
        /* a tile's layout fetches the unit after next into L2 (16 rows read a pass at a time outrun the hardware's
           prefetch; one unit ahead into L1 left a 16-row SmolLM2 wave slower) */
        const int64_t later = j->out - o0 - 2 * V_OUT < V_OUT ? j->out - o0 - 2 * V_OUT : V_OUT;
        v_lay(j->type, j->w + o0 * j->row_bytes, j->row_bytes, n, blocks, &tile, next + V_OUT * j->row_bytes,
              later > 0 ? later * j->row_bytes : 0); /* (past this thread's share of units too: the threads take a
              few at a time, and stopping at the share's end left a 16-row wave slower) */
        const int32_t *panel = j->panels;
        for (int64_t r0 = 0; r0 < j->rows;) {
            const int nr = v_group(j->rows - r0);
            v_block_rows(&tile, blocks, panel, nr, n, bias, j->y + r0 * j->ldy + o0, j->ldy);
            panel += blocks * V_PANEL * nr;
            r0 += nr;
        }
    }
    free(buffer);
}

/* Below how many rows a product runs straight from the blocks rather than on tiles (the same bits either way), by
   type id (Q4_0, Q4_1, Q8_0). A node measures its own at start (`mw_set_direct_rows`, from `paths.choose_paths`);
   these defaults were measured so with two threads on a Zen 4 (SmolLM2's shapes: Q4_1 1536 x 576, Q8_0 49152 x 576):
   one row is faster straight from the blocks, two rows on tiles (the times: docs/performance.md). (Before the
   tiles' layout got cheaper, direct won up to two rows of Q4_1 and three of Q8_0.) */
static int v_below[LOOPS] = {[LOOP_Q4_0] = 2, [LOOP_Q4_1] = 2, [LOOP_Q8_0] = 2, [LOOP_IQ4_NL] = 2};

static int v_direct_below(const block_type *t) {
#if LANES == 16 && defined(__AVX512VNNI__)
    return t && v_shuffled(t) ? __atomic_load_n(&v_below[t->loop], __ATOMIC_RELAXED) : 0; /* (set while others run) */
#else
    return (void)t, 0; /* (the lane-by-lane loops have tiles only) */
#endif
}

/* How many rows of a 32-value type's product run straight from the blocks (below that, tiles); 0: tiles always
   (another type, or a build without AVX-512 VNNI). For /health. */
int mw_direct_rows(int type) {
    const int below = v_direct_below(block_type_of(type));
    return below ? below - 1 : 0;
}

/* Sets how many rows of `type` run straight from the blocks (what a node measured to be faster there); returns
   what `mw_direct_rows` says now (0 where this build or type has no such path). Set before products run. */
int mw_set_direct_rows(int type, int rows) {
    const block_type *t = block_type_of(type);
    if (v_direct_below(t) && rows >= 0 && rows < 64)
        __atomic_store_n(&v_below[t->loop], rows + 1, __ATOMIC_RELAXED);
    return mw_direct_rows(type);
}

/* Quantized ROW32 rows times a 32-value block tensor: y[r * ldy + o] = x_r . w_o (+ bias[o]). Returns -1 without
   memory. */
static int v_product(const block_type *t, const uint8_t *x, int64_t rows, int64_t in, const void *w,
                     const float *bias, float *y, int64_t ldy, int64_t out, int threads, int path) {
#ifdef V2_PRODUCT
    if (t->loop != LOOP_ANY) /* (a type without AVX2 loops: the lane-by-lane tiles below) */
        return v2_product(t, x, rows, in, w, bias, y, ldy, out, threads);
#endif
    const int64_t x_bytes = q8_row_bytes(in, ROW32), blocks = in / 32;
    const int below = v_direct_below(t); /* (0: no direct path here) */
    const int direct = below && (path == PATH_DIRECT || (path == PATH_CHOSEN && rows < below));
#if LANES == 16 && defined(__AVX512VNNI__)
    if (!direct)
        pthread_once(&v_tables_once, v_make_tables); /* (`v_lay`'s, once per process: not on each unit's way) */
#endif
    int32_t *panels = lined(sizeof(int32_t) * (size_t)(rows * blocks * V_PANEL));
    const int spreads = direct && t->loop != LOOP_Q8_0; /* (`v_direct`'s; Q8_0's lone rows read `x` as it is) */
    int8_t *spread = spreads ? lined((size_t)(rows * blocks * V_SPREAD)) : NULL;
    if (!panels || (spreads && !spread)) {
        free(panels);
        free(spread);
        return -1;
    }
    for (int64_t r0 = 0; r0 < rows;) {
        const int nr = direct ? 1 : v_group(rows - r0);
        v_panel(x + r0 * x_bytes, x_bytes, nr, in, t->offset, panels + r0 * blocks * V_PANEL);
#if LANES == 16 && defined(__AVX512VNNI__)
        if (spreads)
            v_spread(t, (const int8_t *)(x + r0 * x_bytes), blocks, spread + r0 * blocks * V_SPREAD);
#endif
        r0 += nr;
    }
    v_job job = {t, w, panels, direct, spread, (const int8_t *)x, rows, in, out, ldy, blocks * t->bytes, x_bytes, bias,
                 y};
    parallel(v_units, &job, (out + V_OUT - 1) / V_OUT, rows * in * out < THREAD_WORK ? 1 : threads);
    free(panels);
    free(spread);
    return 0;
}
