/* test_threads.c — concurrency, as include/automagic.h promises: several
 * threads updating different parameters of one optimizer at once (autograd
 * may run hooks on several threads), and several threads updating through
 * the kernel layer on their own buffers, give bit-identical results to a
 * serial run; concurrent saves of one optimizer are safe. The sanitizer
 * script runs this under ThreadSanitizer. */
#define _POSIX_C_SOURCE 200809L
#include <automagic.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "pool_case.h"
#include "test_image.h"
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NT 4      /* threads */
#define PER 2     /* parameters per thread */
#define NP (NT * PER)
#define STEPS 60

static const int32_t k_ndim[NP] = {2, 1, 3, 0, 2, 1, 2, 4};
static const int64_t k_dims[NP][4] = {{17, 9}, {33}, {2, 5, 7}, {0}, {1, 40}, {8}, {6, 6},
                                      {2, 2, 3, 5}};
static const am_dtype k_dt[NP] = {AM_DTYPE_FLOAT32, AM_DTYPE_BFLOAT16, AM_DTYPE_FLOAT16,
                                  AM_DTYPE_FLOAT32, AM_DTYPE_BFLOAT16, AM_DTYPE_FLOAT32,
                                  AM_DTYPE_FLOAT16, AM_DTYPE_FLOAT32};
#define MAXN 160

typedef struct world {
    am_optimizer *opt;
    float w32[NP][MAXN];
    uint16_t w16[NP][MAXN];
} world;

static int64_t numel(int p) {
    int64_t n = 1;
    int d;
    for (d = 0; d < k_ndim[p]; d++) n *= k_dims[p][d];
    return n;
}

static void world_init(world *w) {
    am_hparams hp = am_hparams_default();
    int p, i;
    int32_t id;
    hp.lr = 1e-3;
    memset(w, 0, sizeof *w);
    assert_int_equal(am_optimizer_create(&hp, 77, &w->opt), AM_OK);
    for (p = 0; p < NP; p++) {
        for (i = 0; i < MAXN; i++) {
            w->w32[p][i] = (float)((i * 5 + p) % 9) * 0.125f - 0.5f;
            w->w16[p][i] = (uint16_t)(k_dt[p] == AM_DTYPE_BFLOAT16 ? 0x3f80u + (unsigned)(i % 64)
                                                                   : 0x3c00u + (unsigned)(i % 64));
        }
        assert_int_equal(am_optimizer_add_param(w->opt,
                                                k_dt[p] == AM_DTYPE_FLOAT32 ? (void *)w->w32[p]
                                                                            : (void *)w->w16[p],
                                                k_dt[p], k_ndim[p], k_dims[p], &id),
                         AM_OK);
    }
}

/* Gradient of parameter p at step s (a NaN at some steps: skipped). */
static void grad(float *g, int p, int s) {
    int i;
    for (i = 0; i < MAXN; i++)
        g[i] = (float)(((i + 1) * (p + 3) * (s + 7)) % 23) / 23.0f - 0.45f;
    if (s % 17 == 5) g[(p + s) % numel(p)] = NAN;
}

static int one_step(am_optimizer *o, int p, int s) {
    float g[MAXN];
    am_status st;
    grad(g, p, s);
    st = am_optimizer_update_param(o, p, g, AM_DTYPE_FLOAT32, NULL);
    return st == ((s % 17 == 5 && numel(p) > 0) ? AM_SKIPPED_NONFINITE_GRAD : AM_OK);
}

typedef struct job {
    world *w;
    int t;
    int ok;
    pthread_barrier_t *bar;
} job;

static void *worker(void *arg) {
    job *j = (job *)arg;
    int s, k;
    j->ok = 1;
    pthread_barrier_wait(j->bar);
    for (s = 0; s < STEPS; s++)
        for (k = 0; k < PER; k++) j->ok &= one_step(j->w->opt, j->t + NT * k, s);
    return NULL;
}


static void test_threads_update_different_params(void **unused) {
    static world par, ser;
    pthread_t th[NT];
    job jobs[NT];
    pthread_barrier_t bar;
    int t, s, p;
    size_t na, nb;
    unsigned char *ia, *ib;
    (void)unused;
    world_init(&par);
    world_init(&ser);
    assert_int_equal(pthread_barrier_init(&bar, NULL, NT), 0);
    for (t = 0; t < NT; t++) {
        jobs[t].w = &par;
        jobs[t].t = t;
        jobs[t].bar = &bar;
        assert_int_equal(pthread_create(&th[t], NULL, worker, &jobs[t]), 0);
    }
    for (s = 0; s < STEPS; s++)
        for (p = 0; p < NP; p++) assert_true(one_step(ser.opt, p, s));
    for (t = 0; t < NT; t++) {
        assert_int_equal(pthread_join(th[t], NULL), 0);
        assert_true(jobs[t].ok);
    }
    pthread_barrier_destroy(&bar);
    assert_memory_equal(par.w32, ser.w32, sizeof par.w32);
    assert_memory_equal(par.w16, ser.w16, sizeof par.w16);
    ia = t_image(par.opt, &na);
    ib = t_image(ser.opt, &nb);
    assert_int_equal(na, nb);
    assert_memory_equal(ia, ib, na); /* lrs, polarity, moments, steps, skips */
    assert_true(am_optimizer_skipped_count(par.opt) > 0);
    free(ia);
    free(ib);
    am_optimizer_destroy(par.opt);
    am_optimizer_destroy(ser.opt);
}

/* Kernel layer: each thread owns a parameter, its state and workspace. */
typedef struct kjob {
    float p[64 * 48], g[64 * 48], lr[64], row[64], col[48];
    uint8_t pol[64 * 6];
    unsigned char ws[1 << 16];
    am_state st;
    int ok;
    pthread_barrier_t *bar;
} kjob;

static void kjob_init(kjob *k) {
    am_shape sh;
    int i;
    sh.ndim = 2;
    sh.dims[0] = 64;
    sh.dims[1] = 48;
    for (i = 0; i < 64 * 48; i++) k->p[i] = (float)(i % 13) * 0.1f - 0.6f;
    k->st.lr = k->lr;
    k->st.polarity = k->pol;
    k->st.row = k->row;
    k->st.col = k->col;
    k->st.sq = NULL;
    assert_int_equal(am_state_init(&sh, &k->st, 1e-3), AM_OK);
}

static void *kworker(void *arg) {
    kjob *k = (kjob *)arg;
    am_tensor pt, gt;
    am_hparams hp = am_hparams_default();
    am_rng_key key;
    int s, i;
    pt.data = k->p;
    pt.dtype = AM_DTYPE_FLOAT32;
    pt.shape.ndim = 2;
    pt.shape.dims[0] = 64;
    pt.shape.dims[1] = 48;
    gt = pt;
    gt.data = k->g;
    key.seed = 3;
    key.param_id = 0;
    k->ok = 1;
    if (k->bar) pthread_barrier_wait(k->bar);
    for (s = 0; s < 40; s++) {
        for (i = 0; i < 64 * 48; i++) k->g[i] = (float)((i * 7 + s * 3) % 19) / 19.0f - 0.5f;
        k->ok &= am_update(&pt, &gt, &k->st, &hp, key, k->ws, sizeof k->ws, NULL) == AM_OK;
    }
    return NULL;
}

static void test_threads_kernel_layer(void **unused) {
    static kjob jobs[NT], ref;
    pthread_t th[NT];
    pthread_barrier_t bar;
    int t;
    (void)unused;
    assert_int_equal(pthread_barrier_init(&bar, NULL, NT), 0);
    kjob_init(&ref);
    ref.bar = NULL;
    kworker(&ref);
    assert_true(ref.ok);
    for (t = 0; t < NT; t++) {
        kjob_init(&jobs[t]);
        jobs[t].bar = &bar;
        assert_int_equal(pthread_create(&th[t], NULL, kworker, &jobs[t]), 0);
    }
    for (t = 0; t < NT; t++) {
        assert_int_equal(pthread_join(th[t], NULL), 0);
        assert_true(jobs[t].ok);
        assert_memory_equal(jobs[t].p, ref.p, sizeof ref.p);
        assert_memory_equal(jobs[t].lr, ref.lr, sizeof ref.lr);
        assert_memory_equal(jobs[t].pol, ref.pol, sizeof ref.pol);
        assert_memory_equal(jobs[t].row, ref.row, sizeof ref.row);
        assert_memory_equal(jobs[t].col, ref.col, sizeof ref.col);
    }
    pthread_barrier_destroy(&bar);
}

/* Several threads save one optimizer to the same path and to their own. */
typedef struct sjob {
    const am_optimizer *o;
    char path[2][96];
    int ok;
    pthread_barrier_t *bar;
} sjob;

static void *sworker(void *arg) {
    sjob *j = (sjob *)arg;
    int r;
    pthread_barrier_wait(j->bar);
    j->ok = 1;
    for (r = 0; r < 5; r++) {
        j->ok &= am_optimizer_save(j->o, j->path[0]) == AM_OK;
        j->ok &= am_optimizer_save(j->o, j->path[1]) == AM_OK;
    }
    return NULL;
}

static void test_threads_concurrent_saves(void **unused) {
    static world w;
    sjob jobs[NT];
    pthread_t th[NT];
    pthread_barrier_t bar;
    char dir[64];
    int t, s, p;
    size_t n;
    unsigned char *img;
    (void)unused;
    world_init(&w);
    for (s = 0; s < 3; s++)
        for (p = 0; p < NP; p++) one_step(w.opt, p, s);
    snprintf(dir, sizeof dir, "/tmp/am_thr_XXXXXX");
    assert_non_null(mkdtemp(dir));
    assert_int_equal(pthread_barrier_init(&bar, NULL, NT), 0);
    for (t = 0; t < NT; t++) {
        jobs[t].o = w.opt;
        jobs[t].bar = &bar;
        snprintf(jobs[t].path[0], sizeof jobs[t].path[0], "%s/shared", dir);
        snprintf(jobs[t].path[1], sizeof jobs[t].path[1], "%s/own%d", dir, t);
        assert_int_equal(pthread_create(&th[t], NULL, sworker, &jobs[t]), 0);
    }
    for (t = 0; t < NT; t++) {
        assert_int_equal(pthread_join(th[t], NULL), 0);
        assert_true(jobs[t].ok);
    }
    pthread_barrier_destroy(&bar);
    img = t_image(w.opt, &n);
    for (t = 0; t <= NT; t++) {
        const char *path = t == NT ? jobs[0].path[0] : jobs[t].path[1];
        FILE *f = fopen(path, "rb");
        unsigned char *b = (unsigned char *)malloc(n + 1);
        assert_non_null(f);
        assert_int_equal(fread(b, 1, n + 1, f), n);
        fclose(f);
        assert_memory_equal(b, img, n);
        free(b);
        assert_int_equal(am_optimizer_load(w.opt, path), AM_OK);
        unlink(path);
    }
    assert_int_equal(rmdir(dir), 0); /* no temporary file left behind */
    free(img);
    am_optimizer_destroy(w.opt);
}

/* The worker pool itself (parallel.c), so that ThreadSanitizer sees it:
 * the parameters above are far below the threading threshold (2 MiB of
 * work per am_parallel_for, src/dispatch.c), so no update there reaches the
 * pool; pool_case.h's shapes do. Three threads must give the bits of one. */
static void test_threads_pool_same_bits(void **unused) {
    int c;
    (void)unused;
    for (c = 0; c < 3; c++) {
        am_shape sh;
        pool_run a, b;
        pool_shape(c, &sh);
        pool_update(&sh, 1, &a);
        pool_update(&sh, 3, &b);
        pool_assert_equal(&a, &b, sh.ndim);
        pool_free(&a);
        pool_free(&b);
    }
}

/* A host runner on its own threads (am_set_parallel_runner): it calls
 * work(arg) on nthreads - 1 new threads and on the caller, then joins. */
typedef struct spawn_stats {
    int calls;
    unsigned max_threads;
} spawn_stats;

typedef struct spawn_arg {
    void (*work)(void *);
    void *arg;
} spawn_arg;

static void *spawn_thread(void *p) {
    spawn_arg *a = (spawn_arg *)p;
    a->work(a->arg);
    return NULL;
}

static void spawn_runner(void (*work)(void *), void *arg, unsigned nthreads,
                         void *ctx) {
    spawn_stats *st = (spawn_stats *)ctx;
    pthread_t th[8];
    spawn_arg a;
    unsigned i, n = nthreads > 8 ? 8 : nthreads;
    st->calls++;
    if (nthreads > st->max_threads) st->max_threads = nthreads;
    a.work = work;
    a.arg = arg;
    for (i = 1; i < n; i++) assert_int_equal(pthread_create(&th[i], NULL, spawn_thread, &a), 0);
    work(arg);
    for (i = 1; i < n; i++) assert_int_equal(pthread_join(th[i], NULL), 0);
}

/* A runner that runs nothing: the library must finish the job itself. */
static void lazy_runner(void (*work)(void *), void *arg, unsigned nthreads, void *ctx) {
    (void)work;
    (void)arg;
    (void)nthreads;
    (*(int *)ctx)++;
}

static void test_threads_host_runner_same_bits(void **unused) {
    int c, lazy_calls = 0;
    (void)unused;
    for (c = 0; c < 3; c++) {
        am_shape sh;
        pool_run a, b, d;
        spawn_stats st = {0, 0};
        pool_shape(c, &sh);
        pool_update(&sh, 1, &a);
        assert_int_equal(am_set_parallel_runner(spawn_runner, &st), AM_OK);
        pool_update(&sh, 3, &b);
        assert_int_equal(am_set_parallel_runner(lazy_runner, &lazy_calls), AM_OK);
        pool_update(&sh, 3, &d);
        assert_int_equal(am_set_parallel_runner(NULL, NULL), AM_OK);
        assert_true(st.calls > 0); /* the work went through the runner */
        assert_int_equal(st.max_threads, 3);
        pool_assert_equal(&a, &b, sh.ndim);
        pool_assert_equal(&a, &d, sh.ndim);
        pool_free(&a);
        pool_free(&b);
        pool_free(&d);
    }
    assert_true(lazy_calls > 0);
}

/* A runner is asked for at most as many threads as the library's own pool
 * would use (its 256 workers and the caller): it was asked for any count
 * (libgomp, asked for 100000 threads, may fail to create them and exit). */
static void test_threads_runner_count_capped(void **unused) {
    spawn_stats st = {0, 0};
    am_shape sh;
    pool_run a;
    (void)unused;
    pool_shape(1, &sh);
    assert_int_equal(am_set_parallel_runner(spawn_runner, &st), AM_OK);
    assert_int_equal(am_set_num_threads(100000), AM_OK);
    {   /* pool_update sets its own count: run one update at 100000 */
        am_hparams hp = am_hparams_default();
        pool_update(&sh, 1, &a);
        assert_int_equal(am_set_num_threads(100000), AM_OK);
        {
            am_tensor pt = {a.p, AM_DTYPE_FLOAT32, sh}, gt = {a.g, AM_DTYPE_FLOAT32, sh};
            am_state st2 = {a.lr, a.pol, a.row, a.col, NULL, 2};
            am_rng_key key = {11, 2};
            assert_int_equal(am_update(&pt, &gt, &st2, &hp, key, a.ws,
                                       (size_t)a.sz.workspace_bytes, NULL), AM_OK);
        }
    }
    assert_int_equal(am_set_num_threads(1), AM_OK);
    assert_int_equal(am_set_parallel_runner(NULL, NULL), AM_OK);
    assert_true(st.calls > 0);
    assert_true(st.max_threads >= 2 && st.max_threads <= 257);
    pool_free(&a);
}

/* The caller's floating-point control register set to flush subnormals
 * (FTZ/DAZ on x86, as torch.set_flush_denormal(True) does; FZ on AArch64)
 * after the pool's workers exist: every thread computes in the library's
 * own IEEE environment, so the bits are those of a run without flushing, at
 * every thread count, and the caller's register is left as it set it.
 * (Before: the tasks the caller ran flushed and the workers' did not: the
 * polarity depended on the thread count.) u is about 1e-45 here. */
#if defined(__x86_64__)
#include <xmmintrin.h>
static unsigned long fp_get(void) { return _mm_getcsr(); }
static void fp_set(unsigned long v) { _mm_setcsr((unsigned)v); }
#define FP_FLUSH 0x8040ul
#elif defined(__aarch64__)
static unsigned long fp_get(void) {
    unsigned long v;
    __asm__ volatile("mrs %0, fpcr" : "=r"(v));
    return v;
}
static void fp_set(unsigned long v) { __asm__ volatile("msr fpcr, %0" : : "r"(v)); }
#define FP_FLUSH (1ul << 24)
#endif

#ifdef FP_FLUSH
typedef struct tiny_run {
    float p[1 << 18], g[1 << 18], lr[1 << 18], sq[1 << 18];
    uint8_t pol[1 << 15];
    unsigned char ws[1 << 16];
} tiny_run;

static void tiny_update(tiny_run *r, int threads) {
    am_shape sh = {1, {1 << 18}};
    am_state_sizes sz;
    am_state st = {r->lr, r->pol, NULL, NULL, r->sq, 0};
    am_tensor pt = {r->p, AM_DTYPE_FLOAT32, sh}, gt = {r->g, AM_DTYPE_FLOAT32, sh};
    am_hparams hp = am_hparams_default();
    am_rng_key key = {1, 0};
    int i;
    hp.eps = 1e30;
    assert_int_equal(am_state_get_sizes(&sh, &sz), AM_OK);
    assert_true(sz.workspace_bytes <= (int64_t)sizeof r->ws);
    assert_int_equal(am_state_init(&sh, &st, 1e-6), AM_OK);
    for (i = 0; i < (1 << 18); i++) {
        r->g[i] = (i & 1) ? 1e-30f : 1e-20f;
        r->p[i] = 0.5f;
    }
    assert_int_equal(am_set_num_threads(threads), AM_OK);
    assert_int_equal(am_update(&pt, &gt, &st, &hp, key, r->ws, sizeof r->ws, NULL), AM_OK);
    assert_int_equal(am_set_num_threads(1), AM_OK);
}

static void test_threads_caller_flushes_subnormals(void **unused) {
    static tiny_run a, b, c;
    unsigned long before;
    int k;
    (void)unused;
    tiny_update(&a, 2); /* the workers exist, created without flushing */
    before = fp_get();
    fp_set(before | FP_FLUSH);
    if (fp_get() != (before | FP_FLUSH)) {
        /* valgrind keeps no flush-to-zero mode (it reads back as off):
         * nothing to test there; native, ASan, TSan and qemu runs test it */
        fp_set(before);
        print_message("flush-to-zero cannot be set here (valgrind?): not tested\n");
        skip();
    }
    for (k = 0; k < 2; k++) {
        tiny_run *r = k ? &c : &b;
        tiny_update(r, k ? 2 : 1);
        assert_true(fp_get() == (before | FP_FLUSH)); /* the caller's, put back */
        assert_memory_equal(a.pol, r->pol, sizeof a.pol);
        assert_memory_equal(a.p, r->p, sizeof a.p);
        assert_memory_equal(a.sq, r->sq, sizeof a.sq);
        assert_memory_equal(a.lr, r->lr, sizeof a.lr);
    }
    fp_set(before);
    { /* u is subnormal: without the pinning a flushing caller gets other bits */
        int pos = 0, i;
        for (i = 0; i < (int)sizeof a.pol; i++) pos |= a.pol[i];
        assert_true(pos != 0);
    }
}
#endif

int main(void) {
    const struct CMUnitTest tests[] = {
#ifdef FP_FLUSH
        cmocka_unit_test(test_threads_caller_flushes_subnormals),
#endif
        cmocka_unit_test(test_threads_update_different_params),
        cmocka_unit_test(test_threads_kernel_layer),
        cmocka_unit_test(test_threads_concurrent_saves),
        cmocka_unit_test(test_threads_pool_same_bits),
        cmocka_unit_test(test_threads_host_runner_same_bits),
        cmocka_unit_test(test_threads_runner_count_capped),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
