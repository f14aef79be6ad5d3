/* meshws native kernels, built on first use by `native.py` with the machine's C compiler.

   int8_linear: y[r, o] = scale[o] * sum_k x[r, k] * w[o, k] (+ bias[o]) for float32
   activations x [rows, in] and int8 weights w [out, in] (one scale per output channel).
   Weights are widened to float in registers, so one token's product reads a byte per
   weight and nothing else.

   Every (row, output) pair sums in the same order whatever the batch: eight lanes, each
   a fused multiply-add chain over k = lane, lane + 8, ...; then the lanes pairwise
   ((0+4)+(2+6)) + ((1+5)+(3+7)); then the inputs past the last multiple of 8 one by
   one. So a row's result never depends on the rows batched with it, on how the outputs
   are split between threads, or on which loop below computed it. */

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MW_AVX2 1
#else
#define MW_AVX2 0
#endif

#define OUT_TILE 4   /* outputs computed together */
#define ROW_TILE 2   /* rows computed together */
#define ROW_BLOCK 64 /* rows that share one widening of a tile's weights */

typedef struct {
    const float *x;
    const int8_t *w;
    const float *scale, *bias;
    float *y;
    int64_t rows, in, out, o_begin, o_end;
} job_t;

int mw_avx2(void) { return MW_AVX2; }

static float finish(const float lanes[8], const float *x, const float *wf, const int8_t *w, int64_t k, int64_t in) {
    float sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
    for (; k < in; k++)
        sum = fmaf(x[k], wf ? wf[k] : (float)w[k], sum);
    return sum;
}

static void store(const job_t *j, int64_t r, int64_t o, float sum) {
    float v = sum * j->scale[o];
    j->y[r * j->out + o] = j->bias ? v + j->bias[o] : v;
}

/* Rows [r0, r0 + nr) by outputs [o0, o0 + no), nr <= ROW_TILE, no <= OUT_TILE. Weights are read
   from int8 (`wf` NULL) or from their widened copy `wf` ([no, in] floats). */
static inline __attribute__((always_inline)) void tile(const job_t *j, int64_t r0, int nr, int64_t o0, int no, const float *wf) {
    const int64_t in = j->in, whole = in - in % 8;
    float lanes[ROW_TILE][OUT_TILE][8];
#if MW_AVX2
    __m256 acc[ROW_TILE][OUT_TILE];
    for (int i = 0; i < ROW_TILE; i++)
        for (int c = 0; c < OUT_TILE; c++)
            acc[i][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < whole; k += 8) {
        __m256 wv[OUT_TILE];
        for (int c = 0; c < no; c++)
            wv[c] = wf ? _mm256_loadu_ps(wf + c * in + k)
                       : _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                             _mm_loadl_epi64((const __m128i *)(j->w + (o0 + c) * in + k))));
        for (int i = 0; i < nr; i++) {
            __m256 xv = _mm256_loadu_ps(j->x + (r0 + i) * in + k);
            for (int c = 0; c < no; c++)
                acc[i][c] = _mm256_fmadd_ps(xv, wv[c], acc[i][c]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < no; c++)
            _mm256_storeu_ps(lanes[i][c], acc[i][c]);
#else
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < no; c++)
            for (int l = 0; l < 8; l++)
                lanes[i][c][l] = 0.0f;
    for (int64_t k = 0; k < whole; k += 8)
        for (int i = 0; i < nr; i++)
            for (int c = 0; c < no; c++)
                for (int l = 0; l < 8; l++) {
                    float wv = wf ? wf[c * in + k + l] : (float)j->w[(o0 + c) * in + k + l];
                    lanes[i][c][l] = fmaf(j->x[(r0 + i) * in + k + l], wv, lanes[i][c][l]);
                }
#endif
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < no; c++)
            store(j, r0 + i, o0 + c,
                  finish(lanes[i][c], j->x + (r0 + i) * in, wf ? wf + c * in : NULL, j->w + (o0 + c) * in, whole, in));
}

/* The constant-size tiles, so the compiler keeps the accumulators in registers. */
static void tile_1x4(const job_t *j, int64_t r0, int64_t o0, const float *wf) { tile(j, r0, 1, o0, OUT_TILE, wf); }
static void tile_2x4(const job_t *j, int64_t r0, int64_t o0, const float *wf) { tile(j, r0, 2, o0, OUT_TILE, wf); }

static void run(const job_t *j) {
    const int64_t in = j->in;
    if (j->rows <= ROW_TILE) { /* a decode step: weights widened in registers, read once */
        for (int64_t o = j->o_begin; o < j->o_end; o += OUT_TILE) {
            int no = (int)(j->o_end - o < OUT_TILE ? j->o_end - o : OUT_TILE);
            if (no == OUT_TILE)
                j->rows == 2 ? tile_2x4(j, 0, o, NULL) : tile_1x4(j, 0, o, NULL);
            else
                tile(j, 0, (int)j->rows, o, no, NULL);
        }
        return;
    }
    float *wf = malloc(sizeof(float) * OUT_TILE * in); /* a tile's weights widened once per block of rows */
    if (!wf) { /* no scratch: the same sums, widening in registers */
        for (int64_t o = j->o_begin; o < j->o_end; o += OUT_TILE) {
            int no = (int)(j->o_end - o < OUT_TILE ? j->o_end - o : OUT_TILE);
            for (int64_t r = 0; r < j->rows; r += ROW_TILE)
                tile(j, r, (int)(j->rows - r < ROW_TILE ? j->rows - r : ROW_TILE), o, no, NULL);
        }
        return;
    }
    for (int64_t block = 0; block < j->rows; block += ROW_BLOCK) {
        int64_t block_end = block + ROW_BLOCK < j->rows ? block + ROW_BLOCK : j->rows;
        for (int64_t o = j->o_begin; o < j->o_end; o += OUT_TILE) {
            int no = (int)(j->o_end - o < OUT_TILE ? j->o_end - o : OUT_TILE);
            for (int c = 0; c < no; c++)
                for (int64_t k = 0; k < in; k++)
                    wf[c * in + k] = (float)j->w[(o + c) * in + k];
            int64_t r = block;
            if (no == OUT_TILE)
                for (; r + ROW_TILE <= block_end; r += ROW_TILE)
                    tile_2x4(j, r, o, wf);
            for (; r < block_end; r += ROW_TILE)
                tile(j, r, (int)(block_end - r < ROW_TILE ? block_end - r : ROW_TILE), o, no, wf);
        }
    }
    free(wf);
}

static void *run_thread(void *arg) {
    run((const job_t *)arg);
    return NULL;
}

#define MAX_THREADS 64
#define THREAD_WORK 4000000 /* multiply-adds below which one thread does it all (starting one costs ~50 us) */

/* Returns 0, or -1 if a thread could not start (the product is then complete anyway). */
int mw_int8_linear(const float *x, int64_t rows, int64_t in, const int8_t *w, const float *scale,
                   const float *bias, float *y, int64_t out, int threads) {
    int64_t work = rows * in * out;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1 || work < THREAD_WORK) threads = 1;
    int64_t tiles = (out + OUT_TILE - 1) / OUT_TILE;
    if (threads > tiles) threads = (int)tiles;
    job_t jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0}, failed = 0;
    for (int t = 0; t < threads; t++) {
        jobs[t] = (job_t){x, w, scale, bias, y, rows, in, out, 0, 0};
        jobs[t].o_begin = tiles * t / threads * OUT_TILE;
        int64_t end = tiles * (t + 1) / threads * OUT_TILE;
        jobs[t].o_end = end < out ? end : out;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, run_thread, &jobs[t]) == 0;
    run(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else {
            run(&jobs[t]);
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}
