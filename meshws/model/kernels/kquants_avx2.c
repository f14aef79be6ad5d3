/* The K-quants' 8-bit products on AVX2 (and an AVX-512 VNNI build's Q5_K): the same sums, in the same order,
   as the fused loops of `quants.c` and its scalar `q_dots` (a row's result is the same bits on every instruction
   set and in any batch). #included by quants.c.

   A unit's 16 lanes of 4 values live in two 256-bit halves (lanes 0-7, 8-15). With no vpdpbusd, a lane's integer
   dots are vpmaddubsw (unsigned codes times signed activations, two products summed in 16 bits) and vpmaddwd by
   ones (two of those in 32 bits). The 16-bit sums cannot saturate: codes are below 64 (Q4_K's high nibbles are
   shifted down here, not kept at 16 times the code) and activations within +-127, so a pair of chunks' two products
   per 16-bit lane stays within 4 * 63 * 127 = 32004; in 32 bits the dots are exact, as vpdpbusd's. Q4_K's high
   nibbles then take the scale a, not a / 16: float(16 i) * (a / 16) and float(i) * a are the same float32. */

typedef struct {
    __m256 lo, hi; /* lanes 0-7, 8-15 */
} v16;

#ifndef KQUANTS_AVX2_LOOPS /* (an AVX-512 VNNI build has its own) */
static inline float half_fast(const uint8_t *p) { /* (F16C; a NaN's payload may differ from half_to_float's) */
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
#endif

static inline v16 v16_zero(void) { return (v16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }

/* One pair of chunks' exact integer dots, as floats, for one half: codes c0, c1 against activations at q0, q1. */
static inline __m256 pair_dots(__m256i c0, __m256i c1, const int8_t *q0, const int8_t *q1) {
    const __m256i sums = _mm256_add_epi16(_mm256_maddubs_epi16(c0, _mm256_loadu_si256((const __m256i *)q0)),
                                          _mm256_maddubs_epi16(c1, _mm256_loadu_si256((const __m256i *)q1)));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, _mm256_set1_epi16(1)));
}

/* A ROW256 (or ROW256_Q4K) unit: codes[chunk][half], the lanes' scales a01, a23 and b' per 16 values; every row's
   share: v = float(i01) * a01 + float(i23) * a23, v += b' * (sum of q), acc[parity] += v * d, lane by lane. */
static inline __attribute__((always_inline)) void spread_rows2(const __m256i codes[4][2], const v16 a01, const v16 a23,
                                                               const v16 b, const q_row *x, int nr, int64_t k,
                                                               int parity, v16 *acc) {
    for (int r = 0; r < nr; r++) {
        const int8_t *q = x[r].q + k;
        const float *sums = x[r].sums + k / GROUP;
        const __m256 d = _mm256_set1_ps(x[r].scale[k / QK]);
        v16 *into = &acc[2 * r + parity];
        __m256 v = _mm256_mul_ps(pair_dots(codes[0][0], codes[1][0], q, q + 64), a01.lo);
        v = _mm256_fmadd_ps(pair_dots(codes[2][0], codes[3][0], q + 128, q + 192), a23.lo, v);
        v = _mm256_fmadd_ps(b.lo, _mm256_loadu_ps(sums), v);
        into->lo = _mm256_fmadd_ps(v, d, into->lo);
        v = _mm256_mul_ps(pair_dots(codes[0][1], codes[1][1], q + 32, q + 96), a01.hi);
        v = _mm256_fmadd_ps(pair_dots(codes[2][1], codes[3][1], q + 160, q + 224), a23.hi, v);
        v = _mm256_fmadd_ps(b.hi, _mm256_loadu_ps(sums + 8), v);
        into->hi = _mm256_fmadd_ps(v, d, into->hi);
    }
}

static inline float hsum16_lanes(v16 v) { /* `hsum`'s tree: lanes l and l + 8, then + 4, + 2, + 1 */
    const __m256 half = _mm256_add_ps(v.lo, v.hi);
    const __m128 quarter = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
    const __m128 pair = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
}

static inline v16 v16_plus(v16 a, v16 b) { return (v16){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }

/* A ROW256 unit's lane scales from its 16 scales (group g's a) held as lo = g0 g2 g1 g3 | g8 g10 g9 g11 and
   hi = g4 g6 g5 g7 | g12 g14 g13 g15: lane l takes group 2 SUB_ORDER[l / 2] + pair (a01: groups 0 0 4 4 8 8 12 12 |
   2 2 6 6 10 10 14 14; a23: those + 1), each picked within its 128-bit half (lane-crossing picks cost more). */
static inline void spread_groups(__m256 lo, __m256 hi, v16 *a01, v16 *a23) {
    *a01 = (v16){_mm256_shuffle_ps(lo, hi, 0x00), _mm256_shuffle_ps(lo, hi, 0x55)};
    *a23 = (v16){_mm256_shuffle_ps(lo, hi, 0xaa), _mm256_shuffle_ps(lo, hi, 0xff)};
}

/* Groups 0-7 (`half` 0) or 8-15 (1) in order, from `spread_groups`'s lo and hi, and back: the same swap. */
static inline __m256 groups_in_order(__m256 lo, __m256 hi, int half) {
    return _mm256_permute_ps(_mm256_permute2f128_ps(lo, hi, half ? 0x31 : 0x20), 0xd8);
}

/* A Q4_K or Q5_K block's a = d * scale (the first 8 of `order`'s bytes) and b' = -(dmin * min) (the last 8), each
   as `order` picks them from scales s0 .. s7, mins m0 .. m7 (bytes 0-7, 8-15): the 6-bit scales and mins of the 12
   bytes after d and dmin, as `scales_and_mins` unpacks them, then one byte shuffle. */
static inline __attribute__((always_inline)) void k_scales2(const uint8_t *w, __m128i order, __m256 *scales,
                                                            __m256 *mins) {
    const __m128i take_low = _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m128i take_high = _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11);
    const __m128i low_shift = _mm_setr_epi32(0, 0, 0, 4), top_two = _mm_set1_epi8((char)0xc0);
    const __m128i low_mask = _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f);
    const __m128i head = _mm_loadu_si128((const __m128i *)w); /* d, dmin, then the 12 bytes of scales */
    const __m128i six = _mm_or_si128(_mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi8(head, take_low), low_shift),
                                                   low_mask),
                                     _mm_srli_epi32(_mm_and_si128(_mm_shuffle_epi8(head, take_high), top_two), 2));
    const __m128 d = _mm_cvtph_ps(head); /* d, dmin */
    const __m128i picked = _mm_shuffle_epi8(six, order);
    *scales = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(picked)), _mm256_broadcastss_ps(d));
    *mins = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(picked, 8))),
                          _mm256_broadcastss_ps(_mm_xor_ps(_mm_shuffle_ps(d, d, 1), _mm_set1_ps(-0.0f))));
}

/* Q4_K in ROW256_Q4K's order: chunk 0's halves are the low nibbles of bytes 0-15 and the high of 16-31 (groups 0,
   3), then of bytes 32-47 and 48-63 (groups 4, 7); chunk 1 the same bytes' other nibbles (groups 1, 2, 5, 6); chunks
   2 and 3 the next 64 bytes. A lane's scale: quarter p of chunks 0 and 1 is sub-block p, of 2 and 3 sub-block 4 + p;
   a = d * scale, b' = -(dmin * min) of group l's sub-block. */
static inline __attribute__((always_inline)) void q4_K_unit2(int64_t k, int parity, const uint8_t *row, const q_row *x,
                                                             int nr, v16 *acc) {
    const __m256i fifteen = _mm256_set1_epi8(15);
    const uint8_t *w = row + k / QK * 144;
    for (int line = 0; line < 144; line += 64)
        __builtin_prefetch(w + PREFETCH + line, 0, 2);
    /* The scales as s0 s2 s4 s6 | s1 s3 s5 s7 and the mins as m0 m1 m4 m5 | m2 m3 m6 m7, so that each lane's scale
       is picked within its 128-bit half (the six lane-crossing vpermps this replaced took a sizeable share of a lone
       row's time on a Zen 3) */
    __m256 scales, mins;
    k_scales2(w, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 9, 12, 13, 10, 11, 14, 15), &scales, &mins);
    const v16 a01 = {_mm256_permute_ps(scales, 0x00), _mm256_permute_ps(scales, 0x55)};
    const v16 a23 = {_mm256_permute_ps(scales, 0xaa), _mm256_permute_ps(scales, 0xff)};
    const v16 b = {_mm256_unpacklo_ps(mins, mins), _mm256_unpackhi_ps(mins, mins)};
    __m256i codes[4][2];
    for (int half = 0; half < 4; half++) { /* 32 bytes of nibbles: chunk 2 (half / 2), half half % 2 */
        const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * half));
        const __m256i low = _mm256_and_si256(q, fifteen), high = _mm256_and_si256(_mm256_srli_epi16(q, 4), fifteen);
        codes[2 * (half / 2)][half % 2] = _mm256_blend_epi32(low, high, 0xf0);
        codes[2 * (half / 2) + 1][half % 2] = _mm256_permute2x128_si256(low, high, 0x21);
    }
    spread_rows2(codes, a01, a23, b, x, nr, k, parity, acc);
}

/* Codes below 16 << high bits: the nibbles of l (shifted down by l_shift), plus h's bits from bit h_from up, moved to
   bit 4 and kept by `high` (0x30: Q6_K's two, 0x10: Q5_K's one); one shift and one AND each, byte by byte. */
static inline __m256i code_bits(__m256i l, int l_shift, __m256i h, int h_from, char high) {
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(l, l_shift), _mm256_set1_epi8(15));
    const __m256i at_4 = h_from < 4 ? _mm256_slli_epi16(h, 4 - h_from) : _mm256_srli_epi16(h, h_from - 4);
    return _mm256_or_si256(low, _mm256_and_si256(at_4, _mm256_set1_epi8(high)));
}

/* Q6_K in ROW256's order: chunk c's 8-byte group i holds values 8c .. 8c + 7 of sub-block s = SUB_ORDER[i], whose
   low nibbles are at ql + 64 (s / 4) + 32 (s % 2) + 8c (shifted by 4 for s % 4 >= 2) and high bits at
   qh + 32 (s / 4) + 8c (shifted by 2 (s % 4)). So one 32-byte load of ql or qh holds every chunk's 8 bytes of a
   group (8c for c = 0 .. 3); each group's codes are made for all chunks at once, then transposed. a = d * scale,
   b' = -32 a (the codes' offset). */
static inline void transposed(__m256i g0, __m256i g1, __m256i g2, __m256i g3, __m256i codes[4][2], int half) {
    /* g_i's 64-bit element c is chunk c's group i: chunk c's half is (g0[c], g1[c], g2[c], g3[c]) */
    const __m256i t0 = _mm256_unpacklo_epi64(g0, g1), t1 = _mm256_unpackhi_epi64(g0, g1); /* c 0, 2; 1, 3 */
    const __m256i t2 = _mm256_unpacklo_epi64(g2, g3), t3 = _mm256_unpackhi_epi64(g2, g3);
    codes[0][half] = _mm256_permute2x128_si256(t0, t2, 0x20);
    codes[2][half] = _mm256_permute2x128_si256(t0, t2, 0x31);
    codes[1][half] = _mm256_permute2x128_si256(t1, t3, 0x20);
    codes[3][half] = _mm256_permute2x128_si256(t1, t3, 0x31);
}

static inline __attribute__((always_inline)) void q6_K_unit2(int64_t k, int parity, const uint8_t *row, const q_row *x,
                                                             int nr, v16 *acc) {
    const uint8_t *w = row + k / QK * 210;
    for (int line = 0; line < 210; line += 64)
        __builtin_prefetch(w + PREFETCH + line, 0, 2);
    const __m128i scale_bytes = _mm_loadu_si128((const __m128i *)(w + 192));
    const __m256 d = _mm256_set1_ps(half_fast(w + 208));
    /* the 16 scales in `spread_groups`'s order: one byte shuffle */
    const __m128i order = _mm_shuffle_epi8(scale_bytes,
                                           _mm_setr_epi8(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15));
    const __m256 lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(order)), d);
    const __m256 hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(order, 8))), d);
    v16 a01, a23;
    spread_groups(lo, hi, &a01, &a23);
    const __m256 minus_32 = _mm256_set1_ps(-32.0f); /* -(32 a), as -(32 * a): the same float32 */
    const v16 b = {_mm256_mul_ps(groups_in_order(lo, hi, 0), minus_32), _mm256_mul_ps(groups_in_order(lo, hi, 1),
                                                                                       minus_32)};
    const __m256i *at = (const __m256i *)w; /* ql: 4 x 32 bytes, then qh: 2 x 32 */
    const __m256i ql0 = _mm256_loadu_si256(at), ql1 = _mm256_loadu_si256(at + 1), ql2 = _mm256_loadu_si256(at + 2);
    const __m256i ql3 = _mm256_loadu_si256(at + 3), qh0 = _mm256_loadu_si256(at + 4), qh1 = _mm256_loadu_si256(at + 5);
    __m256i codes[4][2];
    /* lanes 0-7: sub-blocks 0, 2, 4, 6; lanes 8-15: 1, 3, 5, 7 */
    transposed(code_bits(ql0, 0, qh0, 0, 0x30), code_bits(ql0, 4, qh0, 4, 0x30),
               code_bits(ql2, 0, qh1, 0, 0x30), code_bits(ql2, 4, qh1, 4, 0x30), codes, 0);
    transposed(code_bits(ql1, 0, qh0, 2, 0x30), code_bits(ql1, 4, qh0, 6, 0x30),
               code_bits(ql3, 0, qh1, 2, 0x30), code_bits(ql3, 4, qh1, 6, 0x30), codes, 1);
    spread_rows2(codes, a01, a23, b, x, nr, k, parity, acc);
}

/* Q5_K in ROW256's order (as Q6_K): sub-block 2j's values 8c .. 8c + 7 are the low nibbles of qs[32j + 8c ..], 2j + 1's
   the high ones, each with bit 4 from bit s of qh[8c ..] (sub-block s); so one 32-byte load of qs holds every
   chunk's group of two sub-blocks, and one of qh their fifth bits. a = d * scale and b' = -(dmin * min) as Q4_K's,
   the sub-blocks' scales picked as s0 s2 s1 s3 | s4 s6 s5 s7 (a lane's sub-block is the same in chunks 0-1 and
   2-3). */
static inline __attribute__((always_inline)) void q5_K_unit2(int64_t k, int parity, const uint8_t *row, const q_row *x,
                                                             int nr, v16 *acc) {
    const uint8_t *w = row + k / QK * 176;
    for (int line = 0; line < 176; line += 64)
        __builtin_prefetch(w + PREFETCH + line, 0, 2);
    __m256 scales, mins;
    k_scales2(w, _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 9, 12, 13, 10, 11, 14, 15), &scales, &mins);
    const v16 a = {_mm256_unpacklo_ps(scales, scales), _mm256_unpackhi_ps(scales, scales)};
    const v16 b = {_mm256_unpacklo_ps(mins, mins), _mm256_unpackhi_ps(mins, mins)};
    const __m256i *qh = (const __m256i *)(w + 16), *qs = qh + 1; /* qh: 32 bytes, then qs: 4 x 32 */
    __m256i codes[4][2];
    for (int half = 0; half < 2; half++) { /* sub-blocks 2j + half */
        __m256i g[4];
        for (int j = 0; j < 4; j++)
            g[j] = code_bits(_mm256_loadu_si256(qs + j), 4 * half, _mm256_loadu_si256(qh), 2 * j + half, 0x10);
        transposed(g[0], g[1], g[2], g[3], codes, half);
    }
    spread_rows2(codes, a, a, b, x, nr, k, parity, acc);
}

/* 2-bit codes (Q2_K's, Q3_K's low bits) of sub-blocks s at bytes 32 (s / 4) + 8c of qs, shifted by 2 (s % 4): one
   32-byte load holds every chunk's group of a sub-block (as Q6_K's). */
static inline __m256i two_bits2(__m256i q, int shift) {
    return _mm256_and_si256(_mm256_srli_epi16(q, shift), _mm256_set1_epi8(3));
}

/* 16 bytes, one per 16-value group in order, as `spread_groups` takes them: g0 g2 g1 g3 g8 g10 g9 g11 | g4 g6 ... */
static inline __m128i in_spread_order(__m128i groups) {
    return _mm_shuffle_epi8(groups, _mm_setr_epi8(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15));
}

static inline __m256 low_floats(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }
static inline __m256 high_floats(__m128i bytes) { return low_floats(_mm_srli_si128(bytes, 8)); }

/* Q2_K: a = d * sc, b' = -(dmin * m) per 16 values; the codes as they are. */
static inline __attribute__((always_inline)) void q2_K_unit2(int64_t k, int parity, const uint8_t *row, const q_row *x,
                                                             int nr, v16 *acc) {
    const uint8_t *w = row + k / QK * 84;
    for (int line = 0; line < 84; line += 64)
        __builtin_prefetch(w + PREFETCH + line, 0, 2);
    const __m128i bytes = in_spread_order(_mm_loadu_si128((const __m128i *)w)), fifteen = _mm_set1_epi8(15);
    const __m128i sc = _mm_and_si128(bytes, fifteen), m = _mm_and_si128(_mm_srli_epi16(bytes, 4), fifteen);
    const __m256 d = _mm256_set1_ps(half_fast(w + 80)), minus_dmin = _mm256_set1_ps(-half_fast(w + 82));
    v16 a01, a23;
    spread_groups(_mm256_mul_ps(low_floats(sc), d), _mm256_mul_ps(high_floats(sc), d), &a01, &a23);
    const __m256 mlo = _mm256_mul_ps(low_floats(m), minus_dmin), mhi = _mm256_mul_ps(high_floats(m), minus_dmin);
    const v16 b = {groups_in_order(mlo, mhi, 0), groups_in_order(mlo, mhi, 1)};
    const __m256i q0 = _mm256_loadu_si256((const __m256i *)(w + 16));
    const __m256i q1 = _mm256_loadu_si256((const __m256i *)(w + 48));
    __m256i codes[4][2]; /* lanes 0-7: sub-blocks 0, 2, 4, 6; lanes 8-15: 1, 3, 5, 7 */
    transposed(two_bits2(q0, 0), two_bits2(q0, 4), two_bits2(q1, 0), two_bits2(q1, 4), codes, 0);
    transposed(two_bits2(q0, 2), two_bits2(q0, 6), two_bits2(q1, 2), two_bits2(q1, 6), codes, 1);
    spread_rows2(codes, a01, a23, b, x, nr, k, parity, acc);
}

/* Q3_K: a = d * (sc - 32), b' = -4a; a code made unsigned is its low bits | (bit s of hmask byte 8c + t) << 2. */
static inline __m256i three_bits2(__m256i q, int shift, __m256i hmask, int s) {
    const __m256i high = s < 2 ? _mm256_slli_epi16(hmask, 2 - s) : _mm256_srli_epi16(hmask, s - 2);
    return _mm256_or_si256(two_bits2(q, shift), _mm256_and_si256(high, _mm256_set1_epi8(4)));
}

static inline __attribute__((always_inline)) void q3_K_unit2(int64_t k, int parity, const uint8_t *row, const q_row *x,
                                                             int nr, v16 *acc) {
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
    const __m128i sc = in_spread_order(_mm_or_si128(low, _mm_slli_epi16(high, 4)));
    const __m256 d = _mm256_set1_ps(half_fast(w + 108)), minus_32 = _mm256_set1_ps(32.0f);
    const __m256 lo = _mm256_mul_ps(_mm256_sub_ps(low_floats(sc), minus_32), d); /* (small integers: exact) */
    const __m256 hi = _mm256_mul_ps(_mm256_sub_ps(high_floats(sc), minus_32), d);
    v16 a01, a23;
    spread_groups(lo, hi, &a01, &a23);
    const __m256 minus_4 = _mm256_set1_ps(-4.0f); /* -(4 a), as -(4 * a): the same float32 */
    const v16 b = {_mm256_mul_ps(groups_in_order(lo, hi, 0), minus_4), _mm256_mul_ps(groups_in_order(lo, hi, 1),
                                                                                      minus_4)};
    const __m256i hm = _mm256_loadu_si256((const __m256i *)w);
    const __m256i q0 = _mm256_loadu_si256((const __m256i *)(w + 32));
    const __m256i q1 = _mm256_loadu_si256((const __m256i *)(w + 64));
    __m256i codes[4][2];
    transposed(three_bits2(q0, 0, hm, 0), three_bits2(q0, 4, hm, 2), three_bits2(q1, 0, hm, 4),
               three_bits2(q1, 4, hm, 6), codes, 0);
    transposed(three_bits2(q0, 2, hm, 1), three_bits2(q0, 6, hm, 3), three_bits2(q1, 2, hm, 5),
               three_bits2(q1, 6, hm, 7), codes, 1);
    spread_rows2(codes, a01, a23, b, x, nr, k, parity, acc);
}

/* One pair of chunks' exact integer dots for codes up to 255 (IQ4_XS's NONLINEAR_U): vpmaddubsw's 16-bit sums of
   such codes could saturate, so each code is split as c + 128 with c = the signed value: sum(c q) by |c| and q's
   sign (two products within +-32258), plus 128 times the sum of the q's, each in 32 bits: the same integers. */
static inline __m256 pair_dots_wide(__m256i c0, __m256i c1, const int8_t *q0, const int8_t *q1) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)q0), x1 = _mm256_loadu_si256((const __m256i *)q1);
    const __m256i one = _mm256_set1_epi16(1), ones = _mm256_set1_epi8(1);
    const __m256i dots = _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c0), _mm256_sign_epi8(x0, c0)), one),
        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c1), _mm256_sign_epi8(x1, c1)), one));
    const __m256i sums = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(ones, x0),
                                                            _mm256_maddubs_epi16(ones, x1)), one);
    return _mm256_cvtepi32_ps(_mm256_add_epi32(dots, _mm256_slli_epi32(sums, 7)));
}

/* IQ4_XS: a = d * (sc - 32) per 32 values, b' = -128 a; signed codes NONLINEAR[q] (`pair_dots_wide` adds the 128).
   Values 8c + t of sub-block s: the low nibbles (c < 2), or high, of bytes 16s + 8 (c % 2) of qs: one 32-byte load
   of qs holds two sub-blocks' bytes, whose 64-bit elements are chunks (0 or 2, 1 or 3) of sub-blocks s and s + 1. */
static inline __attribute__((always_inline)) void iq4_xs_unit2(int64_t k, int parity, const uint8_t *row,
                                                               const q_row *x, int nr, v16 *acc) {
    const uint8_t *w = row + k / QK * 136;
    for (int line = 0; line < 136; line += 64)
        __builtin_prefetch(w + PREFETCH + line, 0, 2);
    uint16_t high2;
    uint32_t low4;
    memcpy(&high2, w + 2, 2);
    memcpy(&low4, w + 4, 4);
    /* sub-block j's scale, twice (its two groups), in `spread_groups`' order: groups 0 2 1 3 8 10 9 11 | 4 6 5 7 ... */
    const __m256i j_lo = _mm256_setr_epi32(0, 1, 0, 1, 4, 5, 4, 5), j_hi = _mm256_setr_epi32(2, 3, 2, 3, 6, 7, 6, 7);
    const __m256 d = _mm256_set1_ps(half_fast(w));
    __m256 half_scales[2];
    for (int h = 0; h < 2; h++) {
        const __m256i j = h ? j_hi : j_lo;
        const __m256i low = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)low4), _mm256_slli_epi32(j, 2)),
                                             _mm256_set1_epi32(15));
        const __m256i high = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(high2), _mm256_slli_epi32(j, 1)),
                                              _mm256_set1_epi32(3));
        const __m256i sc = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 4)), _mm256_set1_epi32(32));
        half_scales[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(sc), d);
    }
    v16 a01, a23;
    spread_groups(half_scales[0], half_scales[1], &a01, &a23);
    const __m256 minus_128 = _mm256_set1_ps(-128.0f);
    const v16 b = {_mm256_mul_ps(groups_in_order(half_scales[0], half_scales[1], 0), minus_128),
                   _mm256_mul_ps(groups_in_order(half_scales[0], half_scales[1], 1), minus_128)};
    const __m128i table = _mm_loadu_si128((const __m128i *)NONLINEAR);
    const __m256i lookup = _mm256_broadcastsi128_si256(table), fifteen = _mm256_set1_epi8(15);
    __m256i g[8][2]; /* sub-block s's chunks: [s][0] holds chunks 0, 2 (low, high nibbles of its first 8 bytes) ... */
    for (int pair = 0; pair < 4; pair++) { /* sub-blocks 2 pair, 2 pair + 1: 32 bytes */
        const __m256i q = _mm256_loadu_si256((const __m256i *)(w + 8 + 32 * pair));
        const __m256i low = _mm256_shuffle_epi8(lookup, _mm256_and_si256(q, fifteen));
        const __m256i high = _mm256_shuffle_epi8(lookup, _mm256_and_si256(_mm256_srli_epi16(q, 4), fifteen));
        /* 64-bit elements: low = (s c0, s c1, s+1 c0, s+1 c1), high = (s c2, s c3, s+1 c2, s+1 c3) */
        g[2 * pair][0] = _mm256_unpacklo_epi64(low, high);     /* (s c0, s c2 | s+1 c0, s+1 c2) */
        g[2 * pair][1] = _mm256_unpackhi_epi64(low, high);     /* (s c1, s c3 | s+1 c1, s+1 c3) */
    }
    /* chunk c's half 0: sub-blocks 0 2 4 6's element c; half 1: 1 3 5 7's */
    __m256i codes[4][2];
    for (int h = 0; h < 2; h++) {
        __m256i s[4][2]; /* sub-block 2i + h: (c0, c2) and (c1, c3) in one register's 128-bit lane h */
        for (int i = 0; i < 4; i++)
            for (int e = 0; e < 2; e++)
                s[i][e] = h ? _mm256_permute2x128_si256(g[2 * i][e], g[2 * i][e], 0x11) : g[2 * i][e];
        for (int c = 0; c < 4; c++) { /* element c % 2 ... */
            const int e = c % 2, upper = c / 2;
            const __m256i ab = _mm256_unpacklo_epi64(upper ? _mm256_srli_si256(s[0][e], 8) : s[0][e],
                                                     upper ? _mm256_srli_si256(s[1][e], 8) : s[1][e]);
            const __m256i cd = _mm256_unpacklo_epi64(upper ? _mm256_srli_si256(s[2][e], 8) : s[2][e],
                                                     upper ? _mm256_srli_si256(s[3][e], 8) : s[3][e]);
            codes[c][h] = _mm256_permute2x128_si256(ab, cd, 0x20);
        }
    }
    for (int r = 0; r < nr; r++) {
        const int8_t *q = x[r].q + k;
        const float *sums = x[r].sums + k / GROUP;
        const __m256 dx = _mm256_set1_ps(x[r].scale[k / QK]);
        v16 *into = &acc[2 * r + parity];
        __m256 v = _mm256_mul_ps(pair_dots_wide(codes[0][0], codes[1][0], q, q + 64), a01.lo);
        v = _mm256_fmadd_ps(pair_dots_wide(codes[2][0], codes[3][0], q + 128, q + 192), a23.lo, v);
        v = _mm256_fmadd_ps(b.lo, _mm256_loadu_ps(sums), v);
        into->lo = _mm256_fmadd_ps(v, dx, into->lo);
        v = _mm256_mul_ps(pair_dots_wide(codes[0][1], codes[1][1], q + 32, q + 96), a01.hi);
        v = _mm256_fmadd_ps(pair_dots_wide(codes[2][1], codes[3][1], q + 160, q + 224), a23.hi, v);
        v = _mm256_fmadd_ps(b.hi, _mm256_loadu_ps(sums + 8), v);
        into->hi = _mm256_fmadd_ps(v, dx, into->hi);
    }
}

/* Q5_K's sums for `width` rows (see `dots_of`); also an AVX-512 VNNI build's Q5_K loop, the same bits. */
static inline __attribute__((always_inline)) void q5_K_dots2(const uint8_t *w, int64_t in, const q_row *x, int width,
                                                             int nr, float *sums) {
    v16 acc[2 * Q_ROWS];
    for (int r = 0; r < 2 * width; r++)
        acc[r] = v16_zero();
    UNITS_IN_PAIRS(q5_K_unit2, in, w, x, width, acc)
    for (int r = 0; r < nr && r < width; r++)
        sums[r] = hsum16_lanes(v16_plus(acc[2 * r], acc[2 * r + 1]));
}

#ifndef KQUANTS_AVX2_LOOPS /* (this file's entry points, where it is the K-quants' loops) */
#define FUSED_DOTS                                                                                                   \
    (1 << LOOP_Q2_K | 1 << LOOP_Q3_K | 1 << LOOP_Q4_K | 1 << LOOP_Q5_K | 1 << LOOP_Q6_K | 1 << LOOP_IQ4_XS)

static inline __attribute__((always_inline)) void dots_of(int loop, const uint8_t *w, const unpacked_row *u, int64_t in,
                                                          const q_row *x, int width, int nr, int64_t padded,
                                                          float *sums) {
    if (loop == LOOP_Q5_K) {
        q5_K_dots2(w, in, x, width, nr, sums);
        return;
    }
    v16 acc[2 * Q_ROWS];
    for (int r = 0; r < 2 * width; r++)
        acc[r] = v16_zero();
    (void)u, (void)padded; /* (only the types `has_fused_dots` names come here) */
    switch (loop) {
    case LOOP_Q2_K: UNITS_IN_PAIRS(q2_K_unit2, in, w, x, width, acc) break;
    case LOOP_Q3_K: UNITS_IN_PAIRS(q3_K_unit2, in, w, x, width, acc) break;
    case LOOP_Q4_K: UNITS_IN_PAIRS(q4_K_unit2, in, w, x, width, acc) break;
    case LOOP_IQ4_XS: UNITS_IN_PAIRS(iq4_xs_unit2, in, w, x, width, acc) break;
    default: UNITS_IN_PAIRS(q6_K_unit2, in, w, x, width, acc) break;
    }
    for (int r = 0; r < nr && r < width; r++)
        sums[r] = hsum16_lanes(v16_plus(acc[2 * r], acc[2 * r + 1]));
}

#define LONE_OUTPUTS 4
static void q_dots_lone(int loop, const uint8_t *w, int64_t row_bytes, int64_t in, const uint8_t *row, int64_t padded,
                        float *sums) {
    const q_row x = row_at(row, padded, ROW256);
    for (int o = 0; o < LONE_OUTPUTS; o++) {
        v16 acc[2] = {v16_zero(), v16_zero()};
        const uint8_t *one = w + o * row_bytes;
        switch (loop) {
        case LOOP_Q2_K: UNITS_IN_PAIRS(q2_K_unit2, in, one, &x, 1, acc) break;
        case LOOP_Q3_K: UNITS_IN_PAIRS(q3_K_unit2, in, one, &x, 1, acc) break;
        case LOOP_Q4_K: UNITS_IN_PAIRS(q4_K_unit2, in, one, &x, 1, acc) break;
        case LOOP_IQ4_XS: UNITS_IN_PAIRS(iq4_xs_unit2, in, one, &x, 1, acc) break;
        case LOOP_Q5_K: q5_K_dots2(one, in, &x, 1, 1, sums + o); continue;
        default: UNITS_IN_PAIRS(q6_K_unit2, in, one, &x, 1, acc) break;
        }
        sums[o] = hsum16_lanes(v16_plus(acc[0], acc[1]));
    }
}
#endif
