/*
 * test_cuda_emul.c — the CUDA update's plan (src/cuda/am_cuda_plan.h) run on
 * the CPU, every kernel body in a host loop in launch order, compared bit for
 * bit with am_update(): parameters, lrs, polarity, moments, step, report.
 *
 * Runs in every CI build, GPU or not. It checks the decomposition of the GPU
 * path (indexing, reduction order, per-element math from am_math.h, skip
 * logic) but not CUDA itself; tests/c/test_cuda.c does that on a GPU.
 *
 * Randomised gradients: the seed is printed; AM_TEST_SEED=<n> replays it.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cuda/am_cuda_plan.h"
#include "cuda_emulate.h"
#include "test_cuda_common.h"

static uint64_t g_seed = 20261202u;

/* One parameter updated by both paths side by side. */
typedef struct pair {
    am_shape shape;
    am_state_sizes sz;
    am_tensor p_cpu, p_emu, grad;
    am_state s_cpu, s_emu;
    int64_t step_emu;
    void *ws_cpu, *ws_emu;
    size_t ws_emu_bytes;
} pair;

static void *xcalloc(int64_t n, size_t sz) {
    void *p = calloc((size_t)(n > 0 ? n : 1), sz);
    assert_non_null(p);
    return p;
}

static void state_alloc(const am_state_sizes *z, am_state *s) {
    s->lr = xcalloc(z->lr_count, sizeof(float));
    s->polarity = xcalloc(z->polarity_bytes, 1);
    s->row = z->row_count ? xcalloc(z->row_count, sizeof(float)) : NULL;
    s->col = z->col_count ? xcalloc(z->col_count, sizeof(float)) : NULL;
    s->sq = z->sq_count ? xcalloc(z->sq_count, sizeof(float)) : NULL;
}

static void state_free(am_state *s) {
    free(s->lr); free(s->polarity); free(s->row); free(s->col); free(s->sq);
}

static void pair_init(pair *q, int ndim, const int64_t *dims, am_dtype pdt,
                      am_dtype gdt) {
    int d;
    int64_t i;
    size_t es = am_dtype_size(pdt);
    memset(q, 0, sizeof *q);
    q->shape.ndim = ndim;
    for (d = 0; d < ndim; d++) q->shape.dims[d] = dims[d];
    assert_int_equal(am_state_get_sizes(&q->shape, &q->sz), AM_OK);
    assert_int_equal(am_cuda_workspace_bytes(&q->shape, &q->ws_emu_bytes), AM_OK);
    q->p_cpu.dtype = q->p_emu.dtype = pdt;
    q->p_cpu.shape = q->p_emu.shape = q->grad.shape = q->shape;
    q->grad.dtype = gdt;
    q->p_cpu.data = xcalloc(q->sz.numel, es);
    q->p_emu.data = xcalloc(q->sz.numel, es);
    q->grad.data = xcalloc(q->sz.numel, am_dtype_size(gdt));
    for (i = 0; i < q->sz.numel; i++) store(q->p_cpu.data, pdt, i, rng_val(0.5f));
    memcpy(q->p_emu.data, q->p_cpu.data, (size_t)q->sz.numel * es);
    state_alloc(&q->sz, &q->s_cpu);
    state_alloc(&q->sz, &q->s_emu);
    assert_int_equal(am_state_init(&q->shape, &q->s_cpu, 1e-3), AM_OK);
    assert_int_equal(am_state_init(&q->shape, &q->s_emu, 1e-3), AM_OK);
    /* previous signs at random, the unused bits past each lr-row's end
     * included: both paths must keep those as they are */
    for (i = 0; i < q->sz.polarity_bytes; i++)
        q->s_cpu.polarity[i] = q->s_emu.polarity[i] = (uint8_t)rng_u32();
    q->ws_cpu = xcalloc(q->sz.workspace_bytes, 1);
    q->ws_emu = xcalloc((int64_t)q->ws_emu_bytes, 1);
}

static void pair_free(pair *q) {
    free(q->p_cpu.data); free(q->p_emu.data); free(q->grad.data);
    state_free(&q->s_cpu); state_free(&q->s_emu);
    free(q->ws_cpu); free(q->ws_emu);
}

static void fill_grad(pair *q, float scale) {
    int64_t i;
    for (i = 0; i < q->sz.numel; i++) store(q->grad.data, q->grad.dtype, i, rng_val(scale));
}

static void assert_same_bytes(const void *x, const void *y, size_t n,
                              const char *what) {
    if (n && memcmp(x, y, n) != 0) {
        size_t i;
        const unsigned char *a = x, *b = y;
        for (i = 0; i < n && a[i] == b[i]; i++) {}
        fail_msg("%s differs at byte %zu (seed %llu)", what, i,
                 (unsigned long long)g_seed);
    }
}

/* One step on both paths, then everything compared. */
static void pair_step(pair *q, const am_hparams *hp, am_rng_key key,
                      am_status expect) {
    am_report rc, re;
    am_ck_args a;
    am_geom g;
    unsigned char *base;
    am_status s;
    memset(&re, 0x5a, sizeof re);
    s = am_update(&q->p_cpu, &q->grad, &q->s_cpu, hp, key, q->ws_cpu,
                  (size_t)q->sz.workspace_bytes, &rc);
    assert_int_equal(s, expect);
    assert_int_equal(am_geom_init(&q->shape, &g), AM_OK);
    base = (unsigned char *)(((uintptr_t)q->ws_emu + AM_CUDA_ALIGN - 1) &
                             ~(uintptr_t)(AM_CUDA_ALIGN - 1));
    q->step_emu = q->s_emu.step;
    am_ck_args_init(&a, &g, &q->p_emu, &q->grad, &q->s_emu, &q->step_emu, hp,
                    key, base, &re);
    if (g.numel > 0) emulate(&a);
    q->s_emu.step = q->step_emu;

    if (g.numel > 0) {
        am_workspace_view v;
        assert_int_equal(re.status, rc.status);
        /* the sum of u*u itself, before the float rounding of the clip
         * scale hides most differences of association (am_sum_tiles) */
        assert_int_equal(am_workspace_view_get(&q->shape, q->ws_cpu,
                                               (size_t)q->sz.workspace_bytes, &v),
                         AM_OK);
        if (rc.status == AM_OK) assert_memory_equal(v.u2_sum, &a.h->u2_sum, sizeof(double));
        assert_int_equal(re.nonfinite_count, rc.nonfinite_count);
        assert_memory_equal(&re.clip_scale, &rc.clip_scale, sizeof(float));
        if (g.ndim < 2)
            assert_memory_equal(&re.mean_agreement, &rc.mean_agreement, sizeof(float));
        else
            assert_true(re.mean_agreement >= rc.mean_agreement - 1e-6f &&
                        re.mean_agreement <= rc.mean_agreement + 1e-6f);
    }
    assert_int_equal(q->s_emu.step, q->s_cpu.step);
    assert_same_bytes(q->p_emu.data, q->p_cpu.data,
                      (size_t)q->sz.numel * am_dtype_size(q->p_cpu.dtype), "param");
    assert_same_bytes(q->s_emu.lr, q->s_cpu.lr, (size_t)q->sz.lr_count * 4, "lr");
    assert_same_bytes(q->s_emu.polarity, q->s_cpu.polarity,
                      (size_t)q->sz.polarity_bytes, "polarity");
    if (q->sz.row_count) {
        assert_same_bytes(q->s_emu.row, q->s_cpu.row, (size_t)q->sz.row_count * 4, "row");
        assert_same_bytes(q->s_emu.col, q->s_cpu.col, (size_t)q->sz.col_count * 4, "col");
    }
    if (q->sz.sq_count)
        assert_same_bytes(q->s_emu.sq, q->s_cpu.sq, (size_t)q->sz.sq_count * 4, "sq");
}

static void run_case(int ndim, const int64_t *dims, am_dtype pdt, am_dtype gdt,
                     double wd, int steps) {
    pair q;
    am_hparams hp = am_hparams_default();
    am_rng_key key;
    int s;
    hp.weight_decay = wd;
    key.seed = g_seed ^ 0x9e3779b97f4a7c15ull;
    key.param_id = 7;
    pair_init(&q, ndim, dims, pdt, gdt);
    for (s = 0; s < steps; s++) {
        /* Alternate small and large gradients so that the clip and both
         * directions of the lr bump are exercised; alternate thread orders. */
        g_reverse = s & 1;
        fill_grad(&q, (s & 1) ? 3.0f : 1e-3f);
        pair_step(&q, &hp, key, AM_OK);
    }
    pair_free(&q);
}

/* ----------------------------------------------------------- tests ----- */

static const am_dtype kDt[3] = {AM_DTYPE_FLOAT32, AM_DTYPE_BFLOAT16, AM_DTYPE_FLOAT16};

static void test_flat_sizes(void **st) {
    static const int64_t sizes[] = {1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 33, 63,
                                    65, 127, 1023, 4097, 2 * 16384 + 5};
    size_t i;
    int d;
    (void)st;
    for (d = 0; d < 3; d++) {
        run_case(0, NULL, kDt[d], kDt[d], 0.0, 3);
        for (i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
            run_case(1, &sizes[i], kDt[d], kDt[(d + (int)i) % 3], i % 2 ? 0.1 : 0.0, 3);
    }
    { /* 66 tiles: the sum of u^2 in GROUP_U2's groups of 64, the last partial */
        static const int64_t many = 65 * (int64_t)AM_FLAT_CHUNK + 3;
        run_case(1, &many, AM_DTYPE_BFLOAT16, AM_DTYPE_FLOAT32, 0.1, 2);
    }
}

static void test_matrices(void **st) {
    /* lr-rows from 1 to 40000 elements: both finish paths (one block per
     * lr-row for 512..8192 elements, separate kernels otherwise). */
    static const int64_t shapes[][2] = {{1, 1}, {3, 5}, {7, 9}, {65, 33}, {1, 40000},
                                        {200, 3}, {129, 17}, {2, 16385}, {1000, 1},
                                        {3, 1501}, {5, 8192}, {9, 512}, {4, 8193}};
    size_t i;
    int d;
    (void)st;
    for (d = 0; d < 3; d++)
        for (i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
            run_case(2, shapes[i], kDt[d], kDt[(d + (int)i) % 3], i % 2 ? 0.1 : 0.0, 4);
}

static void test_nd(void **st) {
    static const int64_t s3[] = {4, 5, 6}, s4[] = {10, 5, 4, 3}, s4b[] = {2, 3, 1, 7},
                         s5[] = {3, 1, 2, 70, 5}, s4c[] = {3, 2, 41, 30},
                         s4d[] = {300, 2, 3, 3}; /* 600 one-matrix tiles */
    int d;
    (void)st;
    for (d = 0; d < 3; d++) {
        run_case(3, s3, kDt[d], AM_DTYPE_FLOAT32, 0.0, 3);
        run_case(4, s4, kDt[d], kDt[d], 0.1, 3);
        run_case(4, s4b, kDt[d], kDt[(d + 1) % 3], 0.0, 3);
        run_case(5, s5, kDt[d], kDt[d], 0.0, 2);
        run_case(4, s4c, kDt[d], kDt[(d + 2) % 3], 0.1, 3); /* lr-rows of 2460 */
        run_case(4, s4d, kDt[d], kDt[d], 0.0, 3);
    }
}

/* A NaN and an overflow of g*g: both paths skip, nothing changes. */
static void test_skips(void **st) {
    static const int64_t m[] = {9, 13}, v[] = {77}, mz[] = {37, 203};
    am_hparams hp = am_hparams_default();
    am_rng_key key = {123, 4};
    pair q;
    int k;
    (void)st;
    for (k = 0; k < 2; k++) {
        pair_init(&q, k ? 1 : 2, k ? v : m, AM_DTYPE_BFLOAT16, AM_DTYPE_FLOAT32);
        fill_grad(&q, 1.0f);
        pair_step(&q, &hp, key, AM_OK);
        fill_grad(&q, 1.0f);
        ((float *)q.grad.data)[5] = (float)NAN;
        pair_step(&q, &hp, key, AM_SKIPPED_NONFINITE_GRAD);
        fill_grad(&q, 1.0f);
        /* Finite, but its square is not: skipped, factored or not. */
        ((float *)q.grad.data)[3] = 3e30f;
        pair_step(&q, &hp, key, AM_SKIPPED_NONFINITE_UPDATE);
        fill_grad(&q, 1.0f);
        pair_step(&q, &hp, key, AM_OK);
        pair_free(&q);
    }
    /* One row's old moment 1e30, the others 0, a tiny gradient: rf * cf
     * overflows while the sum of u*u is modest, so the sum from the W sums
     * is not used (am_wsum_usable, the factors' maxima); both skip
     * (test_nonfinite.c, test_factor_overflow). */
    pair_init(&q, 2, m, AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32);
    fill_grad(&q, 1e-37f);
    q.s_cpu.row[0] = q.s_emu.row[0] = 1e30f;
    pair_step(&q, &hp, key, AM_SKIPPED_NONFINITE_UPDATE);
    pair_free(&q);
    /* A 1-D state with a negative sq (corrupt; am_flat_bad): both skip,
     * then an ordinary step once it is put right (test_nonfinite.c,
     * test_negative_sq) */
    pair_init(&q, 1, v, AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32);
    fill_grad(&q, 1.0f);
    pair_step(&q, &hp, key, AM_OK);
    q.s_cpu.sq[40] = q.s_emu.sq[40] = -1.0f;
    fill_grad(&q, 1.0f);
    pair_step(&q, &hp, key, AM_SKIPPED_NONFINITE_UPDATE);
    q.s_cpu.sq[40] = q.s_emu.sq[40] = 0.0f;
    pair_step(&q, &hp, key, AM_OK);
    pair_free(&q);
    /* min_lr = 0 and an lr bump of 200: a disagreeing step takes lrs to 0,
     * the next agreeing one multiplies 0 by inf; both paths clamp the NaN
     * to min_lr (am_lr_scale), matrix and 1-D, four steps of flipping and
     * holding signs */
    for (k = 0; k < 2; k++) {
        am_hparams hb = am_hparams_default();
        int t;
        hb.min_lr = 0;
        hb.lr_bump_rate = 200;
        pair_init(&q, k ? 1 : 2, k ? v : m, AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32);
        for (t = 0; t < 4; t++) {
            int64_t i;
            fill_grad(&q, 1.0f);
            for (i = 0; i < q.sz.numel; i++) {
                float x = (float)(1 + i % 3) * (t == 0 ? 0.01f : -0.01f);
                store(q.grad.data, AM_DTYPE_FLOAT32, i, x);
            }
            pair_step(&q, &hb, key, AM_OK);
            for (i = 0; i < q.sz.lr_count; i++)
                if (q.s_emu.lr[i] != q.s_emu.lr[i]) fail_msg("step %d: emulated lr NaN", t);
        }
        pair_free(&q);
    }
    /* An all-zero last row and column: the W sums stand (their zeros lose
     * nothing) on both paths, which must decide alike (the plan's maxima
     * over rows and columns of nonzero sums, and its zero_nz flag); then
     * one tiny element there, which sends both to the pass over g. */
    pair_init(&q, 2, mz, AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32);
    for (k = 0; k < 3; k++) {
        int64_t i;
        fill_grad(&q, 1.0f);
        for (i = 0; i < q.sz.numel; i++)
            if (i / mz[1] == mz[0] - 1 || i % mz[1] == mz[1] - 1)
                store(q.grad.data, AM_DTYPE_FLOAT32, i, 0.0f);
        if (k == 2) store(q.grad.data, AM_DTYPE_FLOAT32, q.sz.numel - 1, 3e-24f);
        pair_step(&q, &hp, key, AM_OK);
    }
    pair_free(&q);
    /* Tiny gradients in the last row and column (1e-23: squares 0 in
     * float32), moments at 0: factors near 1e15 there, the u*u the W sums
     * leave out dominates, and both paths must take the pass over g (the
     * factors' maxima in am_wsum_usable) and agree; two steps. */
    pair_init(&q, 2, m, AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32);
    for (k = 0; k < 2; k++) {
        int64_t i;
        fill_grad(&q, 1.0f);
        for (i = 0; i < q.sz.numel; i++)
            if (i / m[1] == m[0] - 1 || i % m[1] == m[1] - 1)
                store(q.grad.data, AM_DTYPE_FLOAT32, i, (i + k) & 1 ? -1e-23f : 1e-23f);
        pair_step(&q, &hp, key, AM_OK);
    }
    pair_free(&q);
    /* eps = 0 and an all-zero first gradient: u = 0 * rsqrt(0) is NaN. */
    hp.eps = 0.0;
    for (k = 0; k < 2; k++) {
        pair_init(&q, k ? 1 : 2, k ? v : m, AM_DTYPE_FLOAT16, AM_DTYPE_FLOAT16);
        pair_step(&q, &hp, key, AM_SKIPPED_NONFINITE_UPDATE);
        pair_free(&q);
    }
}

/* The workspace size query: errors and growth with the shape. */
static void test_workspace_query(void **st) {
    am_shape s;
    size_t a = 0, b = 0;
    (void)st;
    memset(&s, 0, sizeof s);
    assert_int_equal(am_cuda_workspace_bytes(&s, NULL), AM_ERR_NULL_POINTER);
    assert_int_equal(am_cuda_workspace_bytes(NULL, &a), AM_ERR_NULL_POINTER);
    s.ndim = 9;
    assert_int_equal(am_cuda_workspace_bytes(&s, &a), AM_ERR_INVALID_SHAPE);
    s.ndim = 2; s.dims[0] = 10; s.dims[1] = 10;
    assert_int_equal(am_cuda_workspace_bytes(&s, &a), AM_OK);
    s.dims[0] = 50000; s.dims[1] = 4096;
    assert_int_equal(am_cuda_workspace_bytes(&s, &b), AM_OK);
    assert_true(b > a && a > 0);
}

/* This test links the CPU-only library: its CUDA entry points must refuse
 * with AM_ERR_UNSUPPORTED and touch nothing. */
static void test_cpu_library_refuses_cuda(void **st) {
    static const int64_t v[] = {5};
    am_hparams hp = am_hparams_default();
    am_rng_key key = {1, 1};
    int n = -1;
    int64_t step = 0;
    pair q;
    (void)st;
    assert_int_equal(am_cuda_device_count(&n), AM_ERR_UNSUPPORTED);
    assert_int_equal(n, 0);
    pair_init(&q, 1, v, AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32);
    fill_grad(&q, 1.0f);
    assert_int_equal(am_update_cuda(&q.p_emu, &q.grad, &q.s_emu, &step, &hp, key,
                                    q.ws_emu, q.ws_emu_bytes, NULL, NULL),
                     AM_ERR_UNSUPPORTED);
    assert_int_equal(step, 0);
    assert_memory_equal(q.p_emu.data, q.p_cpu.data, 5 * sizeof(float));
    pair_free(&q);
}

int main(void) {
    const char *env = getenv("AM_TEST_SEED");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_workspace_query),
        cmocka_unit_test(test_cpu_library_refuses_cuda),
        cmocka_unit_test(test_flat_sizes),
        cmocka_unit_test(test_matrices),
        cmocka_unit_test(test_nd),
        cmocka_unit_test(test_skips),
    };
    if (env) g_seed = strtoull(env, NULL, 10);
    g_rng = g_seed;
    printf("test_cuda_emul: seed %llu (replay with AM_TEST_SEED=%llu)\n",
           (unsigned long long)g_seed, (unsigned long long)g_seed);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
