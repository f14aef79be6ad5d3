/* The 32-value block types' 8-bit products on AVX2 (no AVX-512 VNNI): `blocks32.c`'s sums, in its order, with
   eight outputs to the lanes and the blocks read as they lie (no tile copies: from four rows up a block's codes are
   turned one output to a lane in registers, `v2_tile_rows`). #included by blocks32.c.

   Per block and output, the exact integer i: vpmaddubsw of the block's unsigned codes (Q4_0 ... Q5_1: below 32, so
   a pair of products stays within 16 bits) with the row's codes, vpmaddwd by ones, the 8 partial sums of each of
   eight outputs added into one lane each, plus -offset * (sum of the row's codes); Q8_0's codes are signed bytes,
   so its dot is taken as |c| times q with c's sign (|c| <= 128: within 16 bits too), which is that same integer.
   Then, lane by lane, t = float(i) * (d_w * d_x), t = fmaf(m_w, d_x * (sum of q), t), acc += t: `v_block_rows`'s
   float steps (m_w = 0 for the types without a minimum), so every row gets the bits of the scalar loop. */

/* Rows that share one read of eight outputs' blocks, at most: their codes stay in registers while each row's products
   run (its accumulator spills to L1 past a few rows, which costs less than decoding the codes again). Groups of up to
   4 rows before: 16 and 48 rows of SmolLM2's Q4_1 1536x576 got measurably faster with groups of 16. */
#define V2_ROWS 16
/* From how many rows a product takes tiles (`v2_tile_rows`): on a Zen 3, SmolLM2's Q4_1 1536x576 is level at 3 rows
   and faster on tiles from 4 up, more so with more rows; Q8_0 (its LM head, 49152x576) gains from 4 rows too. */
#define V2_TILE_ROWS 4
/* How far ahead a product asks for its blocks when two threads or more share it: with the memory shared, a read waits
   longer, and one unit ahead (a few KiB) came too late. SmolLM2's Q4_1 decode step, in process, in turns on a 2-core
   AVX2 EPYC: 16 KiB ahead was 0.94-0.96x the time of one unit ahead on two threads, and 1.05x on one thread, which
   keeps one unit. */
#define V2_AHEAD_SHARED 16384

/* A quantized row's int32 and float fields read at any byte address (four codes at once, a block's code sum, its
   scale): no aliasing assumed, no alignment needed. */
typedef int32_t __attribute__((may_alias, aligned(1))) v2_word;
typedef float __attribute__((may_alias, aligned(1))) v2_real;

/* A block's 32 codes in order (value j at byte j), unsigned (c + offset), or Q8_0's signed c; `loop` names the
   layout (the row's LOOP_*: only the five types these loops are written for come here, `v_product`). */
static inline int v2_signed(int loop) { return loop == LOOP_Q8_0 || loop == LOOP_IQ4_NL; } /* codes c, not u */

static inline __m256i v2_codes(int loop, const uint8_t *block) {
    if (loop == LOOP_Q8_0)
        return _mm256_loadu_si256((const __m256i *)(block + 2));
    const int at = loop == LOOP_Q4_1 ? 4 : loop == LOOP_Q5_0 ? 6 : loop == LOOP_Q5_1 ? 8 : 2; /* (the nibbles) */
    const __m128i nibbles = _mm_loadu_si128((const __m128i *)(block + at)), fifteen = _mm_set1_epi8(15);
    __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(nibbles, 4), fifteen), _mm_and_si128(nibbles, fifteen));
    if (loop == LOOP_Q5_0 || loop == LOOP_Q5_1) { /* Q5: bit j of the word before the nibbles: value j's 5th bit */
        uint32_t high;
        memcpy(&high, block + at - 4, 4);
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)high),
                                                   _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                                      0x0303030303030303LL));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    if (loop == LOOP_IQ4_NL) /* (its signed values: the row's sum needs no offset term, as Q8_0's) */
        u = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)NONLINEAR)), u);
    return u;
}

/* The 8 partial sums (32-bit lanes) of one block's products with the row's 32 codes q. */
static inline __m256i v2_dot(int loop, __m256i codes, __m256i q) {
    const __m256i pairs = v2_signed(loop) ? _mm256_maddubs_epi16(_mm256_abs_epi8(codes), _mm256_sign_epi8(q, codes))
                                          : _mm256_maddubs_epi16(codes, q);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* Lane o: the sum of p[o]'s eight lanes (exact in int32, whatever the order): pairs of registers interleaved and
   added, twice, then the 128-bit halves (vphaddd's three micro-ops each made a lone row measurably slower). */
static inline __m256i v2_sum8(const __m256i *p) {
    __m256i a[4], b[2];
    for (int i = 0; i < 4; i++)
        a[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(p[2 * i], p[2 * i + 1]),
                                _mm256_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        b[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(a[2 * i], a[2 * i + 1]),
                                _mm256_unpackhi_epi64(a[2 * i], a[2 * i + 1]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(b[0], b[1], 0x20), _mm256_permute2x128_si256(b[0], b[1], 0x31));
}

static inline __m256 v2_heads(const uint8_t *const *from, int64_t at) { /* eight blocks' float16 at `at`, widened */
    return _mm256_cvtph_ps(_mm_setr_epi16(*(const short *)(from[0] + at), *(const short *)(from[1] + at),
                                          *(const short *)(from[2] + at), *(const short *)(from[3] + at),
                                          *(const short *)(from[4] + at), *(const short *)(from[5] + at),
                                          *(const short *)(from[6] + at), *(const short *)(from[7] + at)));
}

/* Lane o: dword k of c[o] (an 8 x 8 transpose of 32-bit elements): each register holds four codes of every output. */
static inline void v2_transposed(const __m256i *c, __m256i *t) {
    __m256i a[8], b[8];
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm256_unpacklo_epi32(c[2 * i], c[2 * i + 1]);     /* dwords 0, 1 | 4, 5 of c 2i, 2i + 1 */
        a[2 * i + 1] = _mm256_unpackhi_epi32(c[2 * i], c[2 * i + 1]); /* 2, 3 | 6, 7 */
    }
    for (int i = 0; i < 2; i++)
        for (int h = 0; h < 2; h++) { /* dwords 2h (| 4 + 2h) and 2h + 1 (| 5 + 2h) of outputs 4i .. 4i + 3 */
            b[4 * i + 2 * h] = _mm256_unpacklo_epi64(a[4 * i + h], a[4 * i + 2 + h]);
            b[4 * i + 2 * h + 1] = _mm256_unpackhi_epi64(a[4 * i + h], a[4 * i + 2 + h]);
        }
    for (int k = 0; k < 4; k++) {
        t[k] = _mm256_permute2x128_si256(b[k], b[4 + k], 0x20);
        t[4 + k] = _mm256_permute2x128_si256(b[k], b[4 + k], 0x31);
    }
}

/* A row's exact integers for eight outputs from their codes one output to a lane (`v2_transposed`, 4- and 5-bit types,
   not Q8_0): eight vpmaddubsw of the codes with four of the row's codes (q) broadcast, summed in 16 bits (4-bit
   codes: 8 x 2 x 15 x 127 = 30480; 5-bit, in two halves: 4 x 2 x 31 x 127 = 31496), and one vpmaddwd, instead of
   eight vpmaddwd and `v2_sum8`'s additions; the transpose costs a block 24 shuffles, once for all its rows. The same
   integers, so the same bits. */
static inline __m256i v2_tile_dot(int five, const __m256i *lanes, const int8_t *codes) {
    const __m256i ones = _mm256_set1_epi16(1);
    const v2_word *q = (const v2_word *)codes;
    __m256i p[8]; /* summed as a tree, not a chain of seven: a row's latency halves (any order: the same integers) */
    for (int k = 0; k < 8; k++)
        p[k] = _mm256_maddubs_epi16(lanes[k], _mm256_set1_epi32(q[k]));
    const __m256i low = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
    const __m256i high = _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7]));
    return five ? _mm256_add_epi32(_mm256_madd_epi16(low, ones), _mm256_madd_epi16(high, ones))
                : _mm256_madd_epi16(_mm256_add_epi16(low, high), ones);
}

/* `v2_tile_dot` for Q8_0, whose codes are signed: |c| (below 129) times q with c's sign, as `v2_dot` takes it, each
   pair of products within 16 bits but no two pairs, so each of the eight vpmaddubsw goes to 32 bits by itself. */
static inline __m256i v2_q8_tile_dot(const __m256i *magnitudes, const __m256i *signs, const int8_t *codes) {
    const __m256i ones = _mm256_set1_epi16(1);
    const v2_word *q = (const v2_word *)codes;
    __m256i p[8];
    for (int k = 0; k < 8; k++)
        p[k] = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes[k], _mm256_sign_epi8(_mm256_set1_epi32(q[k]),
                                                                                        signs[k])), ones);
    return _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3])),
                            _mm256_add_epi32(_mm256_add_epi32(p[4], p[5]), _mm256_add_epi32(p[6], p[7])));
}

/* Block `at` (bytes in) of eight outputs' rows: its codes (`v2_codes`), and with `ahead`, the next unit's block asked
   for (below). */
static inline __attribute__((always_inline)) void v2_block_codes(int loop, int bytes, const uint8_t *const *from,
                                                                 int64_t at, const uint8_t *ahead, __m256i *codes) {
    for (int line = 0; ahead && line < 8 * bytes; line += 64)
        _mm_prefetch((const char *)ahead + 8 * at + line, _MM_HINT_T0);
    for (int o = 0; o < 8; o++)
        codes[o] = v2_codes(loop, from[o] + at);
}

/* Eight outputs (rows `from`) times nr quantized rows (ROW32, `x`): acc[r], lane o. With `ahead` (the next unit's
   eight rows, which lie together), each block step asks for that unit's next eight blocks' bytes in order: read as
   eight short streams of a few KB, the rows outran the hardware's prefetcher (a lone Q8_0 row from memory reads
   markedly faster with the hint). (Four rows and more: `v2_tile_rows`.) */
static inline __attribute__((always_inline)) void v2_rows(const block_type *t, const uint8_t *const *from,
                                                          int64_t blocks, const q_row *x, int nr, __m256 *acc,
                                                          const uint8_t *ahead) {
    const int loop = t->loop, bytes = t->bytes;
    for (int r = 0; r < nr; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t at = b * bytes;
        __m256i codes[8];
        v2_block_codes(loop, bytes, from, at, ahead, codes);
        const __m256 d = v2_heads(from, at), m = t->has_b ? v2_heads(from, at + 2) : _mm256_setzero_ps();
        for (int r = 0; r < nr; r++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(x[r].q + 32 * b));
            __m256i parts[8];
            for (int o = 0; o < 8; o++)
                parts[o] = v2_dot(loop, codes[o], q);
            __m256i dot = v2_sum8(parts);
            if (!v2_signed(loop))
                dot = _mm256_add_epi32(dot, _mm256_set1_epi32(-t->offset * x[r].totals[b]));
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(x[r].scale[b])));
            v = _mm256_fmadd_ps(m, _mm256_set1_ps(x[r].sums[b]), v);
            acc[r] = _mm256_add_ps(acc[r], v);
        }
    }
}

/* `v2_rows`' tiles for one type's loop, a constant where this is inlined (`v2_tiles`; its sizes from the type's
   row): the offset term only where the type has one, and each row's codes, scale, code sum and d times it read at
   fixed distances from its start (the rows lie `x_bytes` apart) rather than through four pointers a row; a block's
   eight sums added as a tree. A row and block of
   Q4_1 took 46 instructions, now 38, and SmolLM2's Q4_1 1536x576 got measurably faster on a Zen 3, on one thread and
   two, at 6 rows and at 16. Q8_0 here too (`v2_q8_tile_dot`).
   The same integers and float steps in the same order, so the same bits. */
static inline __attribute__((always_inline)) void v2_tile_rows(const int loop, const block_type *t,
                                                               const uint8_t *const *from, int64_t blocks,
                                                               const uint8_t *x, int64_t x_bytes, int64_t padded,
                                                               int nr, __m256 *acc, const uint8_t *ahead) {
    const int bytes = t->bytes, offset = t->offset, minimum = t->has_b;
    const int five = loop == LOOP_Q5_0 || loop == LOOP_Q5_1, q8 = v2_signed(loop);
    const int64_t nb = padded / 32;
    for (int r = 0; r < nr; r++)
        acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t at = b * bytes;
        __m256i codes[8], lanes[8], signs[8];
        v2_block_codes(loop, bytes, from, at, ahead, codes);
        v2_transposed(codes, lanes);
        for (int k = 0; q8 && k < 8; k++) { /* Q8_0, IQ4_NL: |c| and c's sign, one output to a lane */
            signs[k] = lanes[k];
            lanes[k] = _mm256_abs_epi8(lanes[k]);
        }
        const __m256 d = v2_heads(from, at), m = minimum ? v2_heads(from, at + 2) : _mm256_setzero_ps();
        const uint8_t *q = x + 32 * b, *scale = x + padded + 4 * b, *total = scale + 4 * nb, *share = total + 4 * nb;
        for (int64_t r = 0, step = 0; r < nr; r++, step += x_bytes) {
            __m256i dot = q8 ? v2_q8_tile_dot(lanes, signs, (const int8_t *)(q + step))
                             : v2_tile_dot(five, lanes, (const int8_t *)(q + step));
            if (offset && !q8)
                dot = _mm256_add_epi32(dot, _mm256_set1_epi32(-offset * *(const v2_word *)(total + step)));
            const __m256 ds = _mm256_mul_ps(d, _mm256_set1_ps(*(const v2_real *)(scale + step)));
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), ds);
            /* (also where m = 0: 0 times a share that overflowed to inf is NaN, as in the scalar loop) */
            v = _mm256_fmadd_ps(m, _mm256_set1_ps(*(const v2_real *)(share + step)), v);
            acc[r] = _mm256_add_ps(acc[r], v);
        }
    }
}

/* The tiles' loop, one copy per type's loop (a type without one never comes here: `v_product`). */
static void v2_tiles(const block_type *t, const uint8_t *const *from, int64_t blocks, const uint8_t *x,
                     int64_t x_bytes, int64_t padded, int nr, __m256 *acc, const uint8_t *ahead) {
    switch (t->loop) {
    case LOOP_Q4_0: v2_tile_rows(LOOP_Q4_0, t, from, blocks, x, x_bytes, padded, nr, acc, ahead); break;
    case LOOP_Q4_1: v2_tile_rows(LOOP_Q4_1, t, from, blocks, x, x_bytes, padded, nr, acc, ahead); break;
    case LOOP_Q5_0: v2_tile_rows(LOOP_Q5_0, t, from, blocks, x, x_bytes, padded, nr, acc, ahead); break;
    case LOOP_Q5_1: v2_tile_rows(LOOP_Q5_1, t, from, blocks, x, x_bytes, padded, nr, acc, ahead); break;
    case LOOP_Q8_0: v2_tile_rows(LOOP_Q8_0, t, from, blocks, x, x_bytes, padded, nr, acc, ahead); break;
    case LOOP_IQ4_NL: v2_tile_rows(LOOP_IQ4_NL, t, from, blocks, x, x_bytes, padded, nr, acc, ahead); break;
    default: abort(); /* (unreachable: `v_product` sends a type without a loop here down the generic path) */
    }
}

typedef struct {
    const block_type *type;
    const uint8_t *w, *x;
    int64_t rows, in, out, ldy, row_bytes, x_bytes;
    const float *bias;
    float *y;
    int64_t ahead; /* units ahead the next blocks are asked for */
} v2_job;

/* Units of 8 outputs: every group of rows against them, their blocks read once a group. */
static void v2_units(const void *task, int64_t begin, int64_t end) {
    const v2_job *j = task;
    const int64_t blocks = j->in / 32, padded = q8_padded(j->in);
    for (int64_t unit = begin; unit < end; unit++) {
        const int64_t o0 = unit * 8;
        const int n = j->out - o0 < 8 ? (int)(j->out - o0) : 8;
        const uint8_t *from[8];
        for (int o = 0; o < 8; o++) /* (outputs past n read output n - 1 again; their lanes are not stored) */
            from[o] = j->w + (o0 + (o < n ? o : n - 1)) * j->row_bytes;
        float lanes[8];
        for (int64_t r0 = 0, nr = 0; r0 < j->rows; r0 += nr) {
            /* groups of up to 16 rows on tiles (17-19 left: all but 4, so that no group of fewer than 4 is left) and
               the last 1-3 rows straight from the blocks, with one loop each */
            const int64_t left = j->rows - r0;
            nr = left <= V2_ROWS ? left : left < V2_ROWS + V2_TILE_ROWS ? left - V2_TILE_ROWS : V2_ROWS;
            __m256 acc[V2_ROWS];
            /* (one unit ahead: the next unit is this thread's; further: whoever takes it, the block is on its way) */
            const int first = r0 == 0 && (j->ahead > 1 || unit + 1 < end) && o0 + 8 * (j->ahead + 1) <= j->out;
            const uint8_t *ahead = first ? from[0] + 8 * j->ahead * j->row_bytes : NULL;
            if (nr >= V2_TILE_ROWS) {
                v2_tiles(j->type, from, blocks, j->x + r0 * j->x_bytes, j->x_bytes, padded, (int)nr, acc, ahead);
            } else {
                q_row x[V2_TILE_ROWS - 1];
                for (int r = 0; r < nr; r++)
                    x[r] = row_at(j->x + (r0 + r) * j->x_bytes, padded, ROW32);
                switch (nr) {
                case 3: v2_rows(j->type, from, blocks, x, 3, acc, ahead); break;
                case 2: v2_rows(j->type, from, blocks, x, 2, acc, ahead); break;
                default: v2_rows(j->type, from, blocks, x, 1, acc, ahead); break;
                }
            }
            for (int r = 0; r < nr; r++) {
                _mm256_storeu_ps(lanes, acc[r]);
                float *y = j->y + (r0 + r) * j->ldy + o0;
                for (int o = 0; o < n; o++)
                    y[o] = j->bias ? lanes[o] + j->bias[o0 + o] : lanes[o];
            }
        }
    }
}

static int v2_product(const block_type *t, const uint8_t *x, int64_t rows, int64_t in, const void *w,
                      const float *bias, float *y, int64_t ldy, int64_t out, int threads) {
    threads = rows * in * out < THREAD_WORK ? 1 : threads;
    const int64_t row_bytes = in / 32 * t->bytes, shared = V2_AHEAD_SHARED / (8 * row_bytes);
    v2_job job = {t, w, x, rows, in, out, ldy, row_bytes, q8_row_bytes(in, ROW32), bias, y,
                  threads > 1 && shared > 1 ? shared : 1};
    parallel(v2_units, &job, (out + 7) / 8, threads);
    return 0;
}
