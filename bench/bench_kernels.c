/*
 * bench_kernels.c — times am_update on one parameter per case and a
 * STREAM-style triad with the same thread count, five times right before
 * the case and once before each timed update, so the fraction of bandwidth
 * is a ratio of the best of each, measured under the same conditions.
 *
 * Usage: bench_kernels [--threads N] [--scalar] [--no-evict] [--phases]
 *                      [--min-time SEC] [--min-reps N] CASE...
 *   CASE is "DIMS:DTYPE", DIMS like 4096x4096 or
 *   16777216, DTYPE one of f32 bf16 f16 (gradient has the parameter's dtype).
 * Prints one JSON object per line (the driver bench/bench.py parses them).
 * --phases runs each update as its three phases (am_update_stats, _moments,
 * _finish: the same work as am_update) and adds the minimum time of each,
 * to see which pass costs what.
 *
 * Timing: each case runs one warm-up update, then repeats until min-time
 * seconds and min-reps updates have passed; the minimum and the median are
 * reported (the machine is shared: the minimum is the least disturbed run).
 * Before each timed update the caches are flushed (see evict; --no-evict
 * keeps them warm).
 */
#define _POSIX_C_SOURCE 200809L
#include "simd.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* CPU seconds of every thread of the process: on a shared machine, wall
 * time includes time the scheduler gave to others; this does not. Linux
 * adds a worker thread's time late (at its next tick or sleep), so with
 * several threads one short update reads low: bench.py shows it for one
 * thread only. */
static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* ------------------------------------------------------------ triad ---- */

#define TRIAD_N (1 << 24)          /* 64 MiB per array, 3 arrays */
#define TRIAD_CHUNK (1 << 16)

typedef struct triad {
    float *a, *b, *c;
    float s;
} triad;

/* One chunk of the triad: a fixed count and restrict pointers, so that the
 * compiler vectorises it at any optimisation level (with the pointers read
 * through the struct and a variable count, -O2 left it scalar). */
static void triad_chunk(float *restrict a, const float *restrict b, const float *restrict c,
                        float s) {
    int64_t i;
    for (i = 0; i < TRIAD_CHUNK; i++) a[i] = b[i] + s * c[i];
}

#if defined(__x86_64__) && defined(__GNUC__)
/* The same loop compiled for AVX2 and FMA, as the kernels are (an SSE2
 * build of it measured 5-35% less bandwidth at one thread: a lower bound
 * flattered every fraction); chosen at run time. */
__attribute__((target("avx2,fma"))) static void triad_chunk_avx2(float *restrict a,
                                                                 const float *restrict b,
                                                                 const float *restrict c,
                                                                 float s) {
    int64_t i;
    for (i = 0; i < TRIAD_CHUNK; i++) a[i] = b[i] + s * c[i];
}
#endif

static void triad_task(void *ctx, int64_t t) {
    triad *tr = (triad *)ctx;
    const int64_t i0 = t * TRIAD_CHUNK;
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        triad_chunk_avx2(tr->a + i0, tr->b + i0, tr->c + i0, tr->s);
        return;
    }
#endif
    triad_chunk(tr->a + i0, tr->b + i0, tr->c + i0, tr->s);
}

/* One triad, in GB/s of the bytes memory really moves: 16 per element (two
 * reads, one write, and the write-allocate read of the written line, since
 * these are ordinary stores). The traffic model counts the kernels' real
 * bytes too (their parameter is read, then written in place: no
 * write-allocate), so the fraction compares like with like. (Until the
 * nineteenth session the triad was credited STREAM's 12 bytes: every
 * fraction was 4/3 too high, and float32 read over 100% of its "bound".) */
static double triad_once(triad *tr) {
    double t0 = now();
    am_parallel_for(TRIAD_N / TRIAD_CHUNK, TRIAD_CHUNK * 16.0, triad_task, tr);
    return 16.0 * TRIAD_N / (now() - t0) / 1e9;
}

/* Best of 5 triads. */
static double run_triad(triad *tr) {
    double best = 0.0;
    int r;
    for (r = 0; r < 5; r++) {
        const double gbs = triad_once(tr);
        if (gbs > best) best = gbs;
    }
    return best;
}

/* ----------------------------------------------------------- evict ---- */

/* Written before every timed update (untimed) so that each update starts
 * with its tensors out of the caches, as in training, where forward and
 * backward touch everything else between two updates of a tensor. Larger
 * than this machine's last-level cache as seen by one VM (measured: triad
 * bandwidth drops to the DRAM level above ~100 MB). glibc's memset of this
 * size uses non-temporal stores, which leave a small tensor in the cache
 * (docs/PERFORMANCE_HISTORY.md); the triad run before each timed update (ordinary
 * stores over 192 MiB) is what evicts it. */
#define EVICT_BYTES ((size_t)256 << 20)
static unsigned char *g_evict;
static int g_do_evict = 1;
static int g_phases = 0;

static void evict(void) {
    static unsigned char v;
    if (!g_do_evict) return;
    memset(g_evict, ++v, EVICT_BYTES);
}

/* -------------------------------------------------------- one case ---- */

/* Bytes per element of one update under the traffic model
 * (docs/PERFORMANCE.md), parameter and gradient of element size es:
 * factored, the gradient is read 2x when the library's tiles hold whole
 * rows (stats with the agreement count and the sum of u*u, then the apply;
 * C <= 16384) and for many small matrices (am_update's fused sweep, then
 * finish), else 3x (a pass of its own for the sum of u*u); parameter read +
 * written once, polarity bits read + written; many small matrices also
 * read and write their row and column moments (8 (R + C) / (R C) bytes
 * per element: 5.33 for 3x3, 16 for 1x1), which the O(rows + cols) of
 * large matrices leaves out. Unfactored: g 2x, p read + written, sq read
 * 2x + written, lr read + written, polarity. */
static double model_bytes(const am_shape *sh, size_t es) {
    if (sh->ndim >= 2) {
        int64_t R = sh->dims[sh->ndim - 2], C = sh->dims[sh->ndim - 1], B = 1;
        int d;
        for (d = 0; d < sh->ndim - 2; d++) B *= sh->dims[d];
        if (B > 1 && R <= 64 && R * C <= 64) /* the batched path */
            return 4.0 * (double)es + 0.25 + 8.0 * (double)(R + C) / (double)(R * C);
        return (C <= 16384 ? 2.0 : 3.0) * (double)es + 2.0 * (double)es + 0.25;
    }
    return 2.0 * (double)es + 2.0 * (double)es + 12.0 + 8.0 + 0.25;
}

static int parse_case(const char *arg, am_shape *sh, am_dtype *dt) {
    char buf[256], *colon, *tok, *save = NULL;
    memset(sh, 0, sizeof *sh);
    if (strlen(arg) >= sizeof buf) return 0;
    strcpy(buf, arg);
    colon = strchr(buf, ':');
    if (!colon) return 0;
    *colon = 0;
    if (!strcmp(colon + 1, "f32")) *dt = AM_DTYPE_FLOAT32;
    else if (!strcmp(colon + 1, "bf16")) *dt = AM_DTYPE_BFLOAT16;
    else if (!strcmp(colon + 1, "f16")) *dt = AM_DTYPE_FLOAT16;
    else return 0;
    for (tok = strtok_r(buf, "x", &save); tok; tok = strtok_r(NULL, "x", &save)) {
        if (sh->ndim >= AM_MAX_DIMS) return 0;
        sh->dims[sh->ndim++] = strtoll(tok, NULL, 10);
    }
    return sh->ndim > 0;
}

static void fill(void *buf, am_dtype dt, int64_t n, uint64_t seed, float scale) {
    int64_t i;
    uint64_t s = seed;
    for (i = 0; i < n; i++) {
        float v;
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        v = scale * ((float)(int32_t)(s >> 32) * (1.0f / 2147483648.0f));
        if (dt == AM_DTYPE_FLOAT32) ((float *)buf)[i] = v;
        else if (dt == AM_DTYPE_BFLOAT16) ((uint16_t *)buf)[i] = am_f32_to_bf16_rne(v);
        else ((uint16_t *)buf)[i] = am_f32_to_f16_rne(v);
    }
}

/* size rounded up to a multiple of 64, as aligned_alloc requires */
static void *alloc64(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

static int run_case(const char *arg, double min_time, int min_reps, triad *tr) {
    am_shape sh;
    am_dtype dt;
    am_state_sizes sz;
    am_state st;
    am_tensor pt, gt;
    am_hparams hp = am_hparams_default();
    am_rng_key key = {1, 0};
    double times[4096], cpu[4096], t_start, triad_gbs, bytes;
    double ph_min[3] = {1e30, 1e30, 1e30};
    void *p, *g, *ws;
    int reps = 0, d;
    size_t es;
    if (!parse_case(arg, &sh, &dt) || am_state_get_sizes(&sh, &sz) != AM_OK) {
        fprintf(stderr, "bench_kernels: bad case '%s' (want DIMS:f32|bf16|f16)\n", arg);
        return 1;
    }
    es = am_dtype_size(dt);
    /* 64-byte aligned, as PyTorch's CPU allocator aligns tensors */
    p = alloc64((size_t)sz.numel * es);
    g = alloc64((size_t)sz.numel * es);
    st.lr = malloc(4 * (size_t)sz.lr_count);
    st.polarity = malloc((size_t)sz.polarity_bytes + 1);
    st.row = sz.row_count ? malloc(4 * (size_t)sz.row_count) : NULL;
    st.col = sz.col_count ? malloc(4 * (size_t)sz.col_count) : NULL;
    st.sq = sz.sq_count ? malloc(4 * (size_t)sz.sq_count) : NULL;
    ws = malloc((size_t)sz.workspace_bytes);
    if (!p || !g || !st.lr || !st.polarity || !ws) {
        fprintf(stderr, "bench_kernels: out of memory for '%s'\n", arg);
        return 1;
    }
    am_state_init(&sh, &st, 1e-6);
    fill(p, dt, sz.numel, 1, 0.05f);
    fill(g, dt, sz.numel, 2, 1e-3f);
    pt.data = p; pt.dtype = dt; pt.shape = sh;
    gt.data = g; gt.dtype = dt; gt.shape = sh;
    triad_gbs = run_triad(tr);
    am_update(&pt, &gt, &st, &hp, key, ws, (size_t)sz.workspace_bytes, NULL); /* warm-up */
    t_start = now();
    while (reps < (int)(sizeof times / sizeof times[0]) &&
           (reps < min_reps || now() - t_start < min_time)) {
        double t0, c0, tg;
        /* one triad before each timed update: the best triad and the best
         * update come from the same stretch of time on this shared machine */
        tg = triad_once(tr);
        if (tg > triad_gbs) triad_gbs = tg;
        evict();
        t0 = now();
        c0 = cpu_now();
        am_status s;
        if (g_phases) {
            double t1, t2;
            s = am_update_stats(&pt, &gt, &st, &hp, ws, (size_t)sz.workspace_bytes);
            t1 = now();
            if (s == AM_OK) s = am_update_moments(&pt, &gt, &st, &hp, ws, (size_t)sz.workspace_bytes);
            t2 = now();
            if (s == AM_OK)
                s = am_update_finish(&pt, &gt, &st, &hp, key, ws, (size_t)sz.workspace_bytes, NULL);
            if (t1 - t0 < ph_min[0]) ph_min[0] = t1 - t0;
            if (t2 - t1 < ph_min[1]) ph_min[1] = t2 - t1;
            if (now() - t2 < ph_min[2]) ph_min[2] = now() - t2;
        } else {
            s = am_update(&pt, &gt, &st, &hp, key, ws, (size_t)sz.workspace_bytes, NULL);
        }
        times[reps] = now() - t0;
        cpu[reps++] = cpu_now() - c0;
        if (am_status_is_error(s)) {
            fprintf(stderr, "bench_kernels: am_update failed: %s\n", am_status_string(s));
            return 1;
        }
    }
    qsort(times, (size_t)reps, sizeof times[0], cmp_double);
    qsort(cpu, (size_t)reps, sizeof cpu[0], cmp_double);
    bytes = model_bytes(&sh, es);
    printf("{\"kind\": \"update\", \"case\": \"%s\", \"shape\": [", arg);
    for (d = 0; d < sh.ndim; d++) printf("%s%lld", d ? ", " : "", (long long)sh.dims[d]);
    printf("], \"dtype\": \"%s\", \"threads\": %d, \"kernels\": \"%s\", \"numel\": %lld, "
           "\"reps\": %d, \"sec_min\": %.9g, \"sec_median\": %.9g, \"cpu_sec_min\": %.9g, "
           "\"model_bytes_per_elem\": %.4g, \"triad_gbs\": %.6g, \"evict\": %d}\n",
           am_dtype_name(dt), am_get_num_threads(), am_kernel_name(), (long long)sz.numel,
           reps, times[0], times[reps / 2], cpu[0], bytes, triad_gbs, g_do_evict);
    if (g_phases)
        printf("{\"kind\": \"phases\", \"case\": \"%s\", \"threads\": %d, "
               "\"stats_sec_min\": %.9g, \"moments_sec_min\": %.9g, \"finish_sec_min\": %.9g}\n",
               arg, am_get_num_threads(), ph_min[0], ph_min[1], ph_min[2]);
    fflush(stdout);
    free(p); free(g); free(st.lr); free(st.polarity); free(st.row); free(st.col);
    free(st.sq); free(ws);
    return 0;
}

int main(int argc, char **argv) {
    int threads = 1, min_reps = 3, i, rc = 0;
    double min_time = 1.0;
    triad tr;
    for (i = 1; i < argc && !strncmp(argv[i], "--", 2); i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--scalar")) am_kernels_select(1);
        else if (!strcmp(argv[i], "--no-evict")) g_do_evict = 0;
        else if (!strcmp(argv[i], "--phases")) g_phases = 1;
        else if (!strcmp(argv[i], "--min-time") && i + 1 < argc) min_time = atof(argv[++i]);
        else if (!strcmp(argv[i], "--min-reps") && i + 1 < argc) min_reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "bench_kernels: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (am_set_num_threads(threads) != AM_OK) return 2;
    tr.a = malloc(sizeof(float) * TRIAD_N);
    tr.b = malloc(sizeof(float) * TRIAD_N);
    tr.c = malloc(sizeof(float) * TRIAD_N);
    tr.s = 1.0001f;
    g_evict = malloc(EVICT_BYTES);
    if (!tr.a || !tr.b || !tr.c || !g_evict) return 1;
    fill(tr.a, AM_DTYPE_FLOAT32, TRIAD_N, 3, 1.0f);
    fill(tr.b, AM_DTYPE_FLOAT32, TRIAD_N, 4, 1.0f);
    fill(tr.c, AM_DTYPE_FLOAT32, TRIAD_N, 5, 1.0f);
    for (; i < argc; i++) rc |= run_case(argv[i], min_time, min_reps, &tr);
    free(tr.a); free(tr.b); free(tr.c); free(g_evict);
    return rc;
}
