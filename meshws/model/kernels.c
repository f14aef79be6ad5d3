/* meshws native kernels, built on first use by `native.py` with the machine's C compiler.

   mw_linear: y[r, o] = scale[o] * sum_k x[r, k] * w[o, k] (+ bias[o]) for float32
   activations x [rows, in] and int8 weights w [out, in] with one float scale per output
   channel. Weights are widened to float in registers, so one token's product reads a byte
   per weight and nothing else.

   Every (row, output) pair sums in the same order whatever the batch: LANES lanes, each a
   fused multiply-add chain over k = lane, lane + LANES, ...; then the lanes pairwise as a
   tree; then the inputs past the last multiple of LANES one by one. So a row's result never
   depends on the rows batched with it, on how outputs are split between threads, or on
   which loop below computed it. (LANES is 16 with AVX-512, else 8: machines differ.) */

#define _GNU_SOURCE
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
#define widen_i8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define widen_bf16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
#define MAX_ROWS 2 /* 16 vector registers */
typedef __m256 vec;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define widen_i8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define widen_bf16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#else
#define LANES 8
#define MAX_ROWS 2
#define GENERIC 1
#endif

#define KIND_BF16 1 /* attention caches' dtypes (`native.KINDS`) */
#define KIND_F32 2
#define OUT_TILE 4   /* outputs computed together */
#define ROW_BLOCK 64 /* rows that share one widening of a tile's weights */

typedef struct {
    const float *x;
    const int8_t *w;
    const float *scale, *bias;
    float *y;
    int64_t rows, in, out, o_begin, o_end;
} job_t;

/* Element `index` of a cache row, float32 or bfloat16 (`KIND_F32`, `KIND_BF16`). */
static inline float cache_at(const void *w, int kind, int64_t index) {
    if (kind == KIND_F32)
        return ((const float *)w)[index];
    uint32_t bits = (uint32_t)((const uint16_t *)w)[index] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The lanes summed pairwise as a tree, written out: a loop here cost a fifth of a product's time. */
static inline float reduce(const float *lanes) {
#if LANES == 16
    return (((lanes[0] + lanes[8]) + (lanes[4] + lanes[12])) + ((lanes[2] + lanes[10]) + (lanes[6] + lanes[14])))
         + (((lanes[1] + lanes[9]) + (lanes[5] + lanes[13])) + ((lanes[3] + lanes[11]) + (lanes[7] + lanes[15])));
#else
    return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
#endif
}

static float finish(const float *lanes, const float *x, const float *wf, const job_t *j, int64_t o, int64_t k) {
    float sum = reduce(lanes);
    for (; k < j->in; k++)
        sum = fmaf(x[k], wf ? wf[k] : (float)j->w[o * j->in + k], sum);
    return sum;
}

static void store(const job_t *j, int64_t r, int64_t o, float sum) {
    float v = sum * j->scale[o];
    j->y[r * j->out + o] = j->bias ? v + j->bias[o] : v;
}

/* Weights w[0 .. count) as floats into `to`. */
static void widen_row(float *to, const int8_t *w, int64_t count) {
    int64_t k = 0;
#ifndef GENERIC
    for (; k + LANES <= count; k += LANES)
        vstore(to + k, widen_i8(w + k));
#endif
    for (; k < count; k++)
        to[k] = (float)w[k];
}

/* Rows [r0, r0 + nr) by outputs [o0, o0 + no), nr <= MAX_ROWS, no <= OUT_TILE. Weights are read
   as int8 (`wf` NULL) or from their widened copy `wf` ([no, in] floats). */
static inline __attribute__((always_inline)) void tile(const job_t *j, int64_t r0, int nr, int64_t o0, int no,
                                                       const float *wf) {
    const int64_t in = j->in, whole = in - in % LANES;
    float lanes[MAX_ROWS][OUT_TILE][LANES];
#ifndef GENERIC
    vec acc[MAX_ROWS][OUT_TILE];
    for (int i = 0; i < MAX_ROWS; i++)
        for (int c = 0; c < OUT_TILE; c++)
            acc[i][c] = vzero();
    for (int64_t k = 0; k < whole; k += LANES) {
        vec wv[OUT_TILE];
        for (int c = 0; c < no; c++) {
            int64_t at = (o0 + c) * in + k;
            wv[c] = wf ? vload(wf + c * in + k) : widen_i8(j->w + at);
        }
        for (int i = 0; i < nr; i++) {
            vec xv = vload(j->x + (r0 + i) * in + k);
            for (int c = 0; c < no; c++)
                acc[i][c] = vfma(xv, wv[c], acc[i][c]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < no; c++)
            vstore(lanes[i][c], acc[i][c]);
#else
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < no; c++)
            for (int l = 0; l < LANES; l++)
                lanes[i][c][l] = 0.0f;
    for (int64_t k = 0; k < whole; k += LANES)
        for (int i = 0; i < nr; i++)
            for (int c = 0; c < no; c++)
                for (int l = 0; l < LANES; l++) {
                    float wv = wf ? wf[c * in + k + l] : (float)j->w[(o0 + c) * in + k + l];
                    lanes[i][c][l] = fmaf(j->x[(r0 + i) * in + k + l], wv, lanes[i][c][l]);
                }
#endif
    for (int i = 0; i < nr; i++)
        for (int c = 0; c < no; c++)
            store(j, r0 + i, o0 + c, finish(lanes[i][c], j->x + (r0 + i) * in, wf ? wf + c * in : NULL, j, o0 + c, whole));
}

/* Constant-size tiles, so the compiler keeps the accumulators in registers. */
static void decode_tile(const job_t *j, int nr, int64_t o0) {
    nr == 1 ? tile(j, 0, 1, o0, OUT_TILE, NULL) : tile(j, 0, 2, o0, OUT_TILE, NULL);
}

static void batch_tile(const job_t *j, int64_t r0, int64_t o0, const float *wf) {
    tile(j, r0, MAX_ROWS, o0, OUT_TILE, wf);
}

static void run(const job_t *j) {
    const int64_t in = j->in;
    if (j->rows <= 2) { /* a decode step: weights widened in registers, read once */
        for (int64_t o = j->o_begin; o < j->o_end; o += OUT_TILE) {
            int no = (int)(j->o_end - o < OUT_TILE ? j->o_end - o : OUT_TILE);
            if (no == OUT_TILE)
                decode_tile(j, (int)j->rows, o);
            else
                tile(j, 0, (int)j->rows, o, no, NULL);
        }
        return;
    }
    float *wf = malloc(sizeof(float) * OUT_TILE * in); /* a tile's weights widened once per block of rows */
    for (int64_t block = 0; block < j->rows; block += ROW_BLOCK) {
        int64_t block_end = block + ROW_BLOCK < j->rows ? block + ROW_BLOCK : j->rows;
        for (int64_t o = j->o_begin; o < j->o_end; o += OUT_TILE) {
            int no = (int)(j->o_end - o < OUT_TILE ? j->o_end - o : OUT_TILE);
            if (wf)
                for (int c = 0; c < no; c++)
                    widen_row(wf + c * in, j->w + (o + c) * in, in);
            int64_t r = block;
            if (no == OUT_TILE && wf)
                for (; r + MAX_ROWS <= block_end; r += MAX_ROWS)
                    batch_tile(j, r, o, wf);
            for (; r < block_end; r += MAX_ROWS) /* no scratch: the same sums, widening in registers */
                tile(j, r, (int)(block_end - r < MAX_ROWS ? block_end - r : MAX_ROWS), o, no, wf);
        }
    }
    free(wf);
}

/* Helper threads, started on first need and kept. `parallel` hands out a range of units by
   publishing a new `ticket`: a generation count and how many threads take part. Helper t < that
   count computes its share and counts `remaining` down; the others go back to sleep at once
   (a node whose core share shrank must not keep its extra helpers spinning). A helper that
   took part spins (yielding its core) for SPIN_NS after its share, since a decode step's
   products come tens of microseconds apart, then sleeps on `wake`. One call at a time uses
   them (`busy`); a caller that finds them taken computes alone. */

#define MAX_THREADS 64
#define THREAD_WORK 100000 /* multiply-adds below which one thread does it all */
#define SPIN_NS 200000

typedef void (*work_fn)(const void *task, int64_t begin, int64_t end);

static struct {
    pthread_mutex_t busy, sleep;
    pthread_cond_t wake;
    atomic_ullong ticket; /* generation << 32 | threads taking part */
    atomic_int remaining;
    int helpers;
    unsigned long long first_ticket[MAX_THREADS];
    work_fn work;
    const void *task;
    int64_t units;
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

static void share(int t, int threads) {
    pool.work(pool.task, pool.units * t / threads, pool.units * (t + 1) / threads);
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
        if (spin) { /* the caller waits for this share before it publishes another ticket */
            share(me, threads);
            atomic_fetch_sub_explicit(&pool.remaining, 1, memory_order_release);
        }
    }
    return NULL;
}

/* work(task, begin, end) over units [0, units), split evenly over up to `threads` threads. */
static void parallel(work_fn work, const void *task, int64_t units, int threads) {
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads > units)
        threads = (int)units;
    if (threads < 2 || pthread_mutex_trylock(&pool.busy) != 0) {
        work(task, 0, units);
        return;
    }
    unsigned long long generation = (atomic_load(&pool.ticket) >> 32) + 1;
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
    atomic_store_explicit(&pool.remaining, threads - 1, memory_order_relaxed);
    atomic_store_explicit(&pool.ticket, generation << 32 | (unsigned)threads, memory_order_release);
    pthread_mutex_lock(&pool.sleep);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.sleep);
    share(0, threads);
    while (atomic_load_explicit(&pool.remaining, memory_order_acquire) > 0)
        sched_yield();
    pthread_mutex_unlock(&pool.busy);
}

static void linear_tiles(const void *task, int64_t begin, int64_t end) {
    job_t part = *(const job_t *)task;
    part.o_begin = begin * OUT_TILE;
    part.o_end = end * OUT_TILE < part.out ? end * OUT_TILE : part.out;
    run(&part);
}

/* threads: how many may compute (the caller's share of the cores). */
void mw_linear(const float *x, int64_t rows, int64_t in, const int8_t *w, const float *scale, const float *bias,
               float *y, int64_t out, int threads) {
    job_t whole = {x, w, scale, bias, y, rows, in, out, 0, out};
    parallel(linear_tiles, &whole, (out + OUT_TILE - 1) / OUT_TILE, rows * in * out < THREAD_WORK ? 1 : threads);
}

/* mw_attend: one query position per row against that row's own cache (a decode step of a batch
   of sessions whose caches differ in length), after writing the row's new key and value there.

   Row r's cache is keys[r], values[r]: [kv_heads, capacity[r], dim] of the cache's kind (float32
   or bfloat16). Its new key and value (new_keys, new_values: [rows, kv_heads, dim], the same
   kind) go to position at[r]; it attends to positions low[r] .. at[r]. Queries q and the
   output are float32 [rows, heads, dim]; query head h reads key head h / (heads / kv_heads).
   Scores and softmax are float32: s = scale * q.k (the dot in lanes as above), then
   exp(s - max) summed in position order, and the output sum_t e_t v_t / sum_t e_t. A row's
   result is the same alone or in any batch, on any thread count. */

typedef struct {
    int64_t rows, heads, kv_heads, dim;
    const float *q;
    const void *new_keys, *new_values;
    void *const *keys, *const *values;
    const int64_t *capacity, *low, *at;
    int kind;
    float scale;
    float *out;
    atomic_int *failed; /* set when a unit found no memory for its scores (its cache is left as it was) */
} attend_t;

#define STACK_SCORES 4096 /* floats of scores kept on the stack; longer rows take the heap */

static float dot(const float *q, const void *k, int kind, int64_t dim) {
    const int64_t whole = dim - dim % LANES;
    float lanes[LANES];
#ifndef GENERIC
    vec acc = vzero();
    for (int64_t d = 0; d < whole; d += LANES)
        acc = vfma(vload(q + d), kind == KIND_F32 ? vload((const float *)k + d) : widen_bf16((const uint16_t *)k + d), acc);
    vstore(lanes, acc);
#else
    for (int l = 0; l < LANES; l++)
        lanes[l] = 0.0f;
    for (int64_t d = 0; d < whole; d += LANES)
        for (int l = 0; l < LANES; l++)
            lanes[l] = fmaf(q[d + l], cache_at(k, kind, d + l), lanes[l]);
#endif
    float sum = reduce(lanes);
    for (int64_t d = whole; d < dim; d++)
        sum = fmaf(q[d], cache_at(k, kind, d), sum);
    return sum;
}

static void attend_units(const void *task, int64_t begin, int64_t end) {
    const attend_t *a = task;
    const int64_t dim = a->dim, group = a->heads / a->kv_heads;
    const size_t size = a->kind == KIND_F32 ? 4 : 2;
    for (int64_t unit = begin; unit < end; unit++) { /* one row's one key head and its query heads */
        const int64_t row = unit / a->kv_heads, head = unit % a->kv_heads;
        const int64_t low = a->low[row], at = a->at[row], count = at - low + 1;
        const size_t need = (size_t)(count * group + dim);
        float stack[STACK_SCORES], *scores = need <= STACK_SCORES ? stack : malloc(sizeof(float) * need);
        if (!scores) {
            atomic_store(a->failed, 1);
            continue;
        }
        char *keys = (char *)a->keys[row] + (size_t)(head * a->capacity[row]) * dim * size;
        char *values = (char *)a->values[row] + (size_t)(head * a->capacity[row]) * dim * size;
        memcpy(keys + (size_t)at * dim * size, (const char *)a->new_keys + (size_t)unit * dim * size, dim * size);
        memcpy(values + (size_t)at * dim * size, (const char *)a->new_values + (size_t)unit * dim * size, dim * size);
        float *value = scores + count * group;
        for (int64_t g = 0; g < group; g++) {
            const float *q = a->q + ((row * a->heads) + head * group + g) * dim;
            float *s = scores + g * count, top = -INFINITY, total = 0.0f;
            for (int64_t t = 0; t < count; t++) {
                s[t] = a->scale * dot(q, keys + (size_t)(low + t) * dim * size, a->kind, dim);
                top = s[t] > top ? s[t] : top;
            }
            for (int64_t t = 0; t < count; t++) {
                s[t] = expf(s[t] - top);
                total += s[t];
            }
            for (int64_t d = 0; d < dim; d++)
                value[d] = 0.0f;
            for (int64_t t = 0; t < count; t++) {
                const char *v = values + (size_t)(low + t) * dim * size;
                if (a->kind == KIND_F32)
                    for (int64_t d = 0; d < dim; d++)
                        value[d] = fmaf(s[t], ((const float *)v)[d], value[d]);
                else
                    for (int64_t d = 0; d < dim; d++)
                        value[d] = fmaf(s[t], cache_at(v, KIND_BF16, d), value[d]);
            }
            float *out = a->out + ((row * a->heads) + head * group + g) * dim;
            for (int64_t d = 0; d < dim; d++)
                out[d] = value[d] / total;
        }
        if (scores != stack)
            free(scores);
    }
}

/* Returns 0, or -1 if some row found no memory (the caller undoes the step: see `decode_rows`). */
int mw_attend(int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim, const float *q, const void *new_keys,
               const void *new_values, void *const *keys, void *const *values, const int64_t *capacity,
               const int64_t *low, const int64_t *at, int kind, float scale, float *out, int threads) {
    atomic_int failed = 0;
    attend_t task = {rows, heads, kv_heads, dim, q, new_keys, new_values, keys, values, capacity, low, at,
                     kind, scale, out, &failed};
    int64_t work = 0;
    for (int64_t r = 0; r < rows; r++)
        work += (at[r] - low[r] + 1) * heads * dim * 2;
    parallel(attend_units, &task, rows * kv_heads, work < THREAD_WORK ? 1 : threads);
    return atomic_load(&failed) ? -1 : 0;
}
