/*
 * test_cuda.c — am_update_cuda() on a real GPU against am_update() on the
 * CPU: parameters, lrs, polarity, moments, step and report compared bit for
 * bit after every step, for float32/bfloat16/float16, awkward shapes, skipped
 * updates, argument errors and a CUDA-graph capture replayed several times.
 *
 * Without a CUDA device (or without a driver) it prints why and exits 77,
 * which CTest reports as "Skipped". AM_CUDA_TEST_LARGE=1 adds a 1 x 100M and
 * a 50000 x 4096 parameter (scripts/gpu_check.sh sets it).
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
#include <cuda_runtime.h>

#include "cuda/am_cuda_plan.h"
#include "test_cuda_common.h"

static uint64_t g_seed = 20261203u;

#define CU(call)                                                              \
    do {                                                                      \
        cudaError_t e_ = (call);                                              \
        if (e_ != cudaSuccess)                                                \
            fail_msg("%s: %s", #call, cudaGetErrorString(e_));                \
    } while (0)

static void *xcalloc(int64_t n, size_t sz) {
    void *p = calloc((size_t)(n > 0 ? n : 1), sz);
    assert_non_null(p);
    return p;
}

static void *dalloc(int64_t bytes) {
    void *p = NULL;
    CU(cudaMalloc(&p, (size_t)(bytes > 0 ? bytes : 1)));
    return p;
}

/* A parameter on the CPU (reference) and its copy on the GPU. */
typedef struct pair {
    am_shape shape;
    am_state_sizes sz;
    size_t es, gs, ws_dev_bytes;
    am_tensor p_cpu, g_cpu, p_dev, g_dev;
    am_state s_cpu, s_dev;
    int64_t *step_dev;
    am_report *rep_dev;
    void *ws_cpu, *ws_dev;
} pair;

static void pair_init(pair *q, int ndim, const int64_t *dims, am_dtype pdt,
                      am_dtype gdt) {
    int d;
    int64_t i, n;
    memset(q, 0, sizeof *q);
    q->shape.ndim = ndim;
    for (d = 0; d < ndim; d++) q->shape.dims[d] = dims[d];
    assert_int_equal(am_state_get_sizes(&q->shape, &q->sz), AM_OK);
    assert_int_equal(am_cuda_workspace_bytes(&q->shape, &q->ws_dev_bytes), AM_OK);
    n = q->sz.numel;
    q->es = am_dtype_size(pdt);
    q->gs = am_dtype_size(gdt);
    q->p_cpu.dtype = q->p_dev.dtype = pdt;
    q->g_cpu.dtype = q->g_dev.dtype = gdt;
    q->p_cpu.shape = q->p_dev.shape = q->g_cpu.shape = q->g_dev.shape = q->shape;
    q->p_cpu.data = xcalloc(n, q->es);
    q->g_cpu.data = xcalloc(n, q->gs);
    for (i = 0; i < n; i++) store(q->p_cpu.data, pdt, i, rng_val(0.5f));
    q->s_cpu.lr = xcalloc(q->sz.lr_count, 4);
    q->s_cpu.polarity = xcalloc(q->sz.polarity_bytes, 1);
    q->s_cpu.row = q->sz.row_count ? xcalloc(q->sz.row_count, 4) : NULL;
    q->s_cpu.col = q->sz.col_count ? xcalloc(q->sz.col_count, 4) : NULL;
    q->s_cpu.sq = q->sz.sq_count ? xcalloc(q->sz.sq_count, 4) : NULL;
    assert_int_equal(am_state_init(&q->shape, &q->s_cpu, 1e-3), AM_OK);
    q->ws_cpu = xcalloc(q->sz.workspace_bytes, 1);

    q->p_dev.data = dalloc(n * (int64_t)q->es);
    q->g_dev.data = dalloc(n * (int64_t)q->gs);
    q->s_dev.lr = dalloc(q->sz.lr_count * 4);
    q->s_dev.polarity = dalloc(q->sz.polarity_bytes);
    q->s_dev.row = q->sz.row_count ? dalloc(q->sz.row_count * 4) : NULL;
    q->s_dev.col = q->sz.col_count ? dalloc(q->sz.col_count * 4) : NULL;
    q->s_dev.sq = q->sz.sq_count ? dalloc(q->sz.sq_count * 4) : NULL;
    q->step_dev = dalloc(8);
    q->rep_dev = dalloc(sizeof(am_report));
    q->ws_dev = dalloc((int64_t)q->ws_dev_bytes);
    CU(cudaMemcpy(q->p_dev.data, q->p_cpu.data, (size_t)n * q->es, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(q->s_dev.lr, q->s_cpu.lr, (size_t)q->sz.lr_count * 4, cudaMemcpyHostToDevice));
    CU(cudaMemset(q->s_dev.polarity, 0, (size_t)q->sz.polarity_bytes));
    if (q->sz.row_count) {
        CU(cudaMemset(q->s_dev.row, 0, (size_t)q->sz.row_count * 4));
        CU(cudaMemset(q->s_dev.col, 0, (size_t)q->sz.col_count * 4));
    }
    if (q->sz.sq_count) CU(cudaMemset(q->s_dev.sq, 0, (size_t)q->sz.sq_count * 4));
    CU(cudaMemset(q->step_dev, 0, 8));
}

static void pair_free(pair *q) {
    free(q->p_cpu.data); free(q->g_cpu.data); free(q->ws_cpu);
    free(q->s_cpu.lr); free(q->s_cpu.polarity); free(q->s_cpu.row);
    free(q->s_cpu.col); free(q->s_cpu.sq);
    cudaFree(q->p_dev.data); cudaFree(q->g_dev.data); cudaFree(q->ws_dev);
    cudaFree(q->s_dev.lr); cudaFree(q->s_dev.polarity); cudaFree(q->s_dev.row);
    cudaFree(q->s_dev.col); cudaFree(q->s_dev.sq); cudaFree(q->step_dev);
    cudaFree(q->rep_dev);
}

static void fill_grad(pair *q, float scale) {
    int64_t i;
    for (i = 0; i < q->sz.numel; i++) store(q->g_cpu.data, q->g_cpu.dtype, i, rng_val(scale));
    CU(cudaMemcpy(q->g_dev.data, q->g_cpu.data, (size_t)q->sz.numel * q->gs,
                  cudaMemcpyHostToDevice));
}

static void cmp_dev(const void *host, const void *dev, size_t n, const char *what) {
    unsigned char *tmp;
    size_t i;
    if (!n) return;
    tmp = xcalloc((int64_t)n, 1);
    CU(cudaMemcpy(tmp, dev, n, cudaMemcpyDeviceToHost));
    if (memcmp(tmp, host, n) != 0) {
        for (i = 0; i < n && tmp[i] == ((const unsigned char *)host)[i]; i++) {}
        free(tmp);
        fail_msg("%s differs from the CPU at byte %zu of %zu (seed %llu)", what, i,
                 n, (unsigned long long)g_seed);
    }
    free(tmp);
}

/* GPU state == CPU state, bit for bit. */
static void compare(pair *q, const am_report *rc) {
    am_report rd;
    int64_t step;
    CU(cudaDeviceSynchronize());
    CU(cudaMemcpy(&rd, q->rep_dev, sizeof rd, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(&step, q->step_dev, 8, cudaMemcpyDeviceToHost));
    assert_int_equal(step, q->s_cpu.step);
    if (rc) {
        assert_int_equal(rd.status, rc->status);
        assert_int_equal(rd.nonfinite_count, rc->nonfinite_count);
        assert_memory_equal(&rd.clip_scale, &rc->clip_scale, 4);
        assert_true(rd.mean_agreement >= rc->mean_agreement - 1e-6f &&
                    rd.mean_agreement <= rc->mean_agreement + 1e-6f);
    }
    cmp_dev(q->p_cpu.data, q->p_dev.data, (size_t)q->sz.numel * q->es, "param");
    cmp_dev(q->s_cpu.lr, q->s_dev.lr, (size_t)q->sz.lr_count * 4, "lr");
    cmp_dev(q->s_cpu.polarity, q->s_dev.polarity, (size_t)q->sz.polarity_bytes, "polarity");
    cmp_dev(q->s_cpu.row, q->s_dev.row, (size_t)q->sz.row_count * 4, "row");
    cmp_dev(q->s_cpu.col, q->s_dev.col, (size_t)q->sz.col_count * 4, "col");
    cmp_dev(q->s_cpu.sq, q->s_dev.sq, (size_t)q->sz.sq_count * 4, "sq");
}

static am_status gpu_step(pair *q, const am_hparams *hp, am_rng_key key,
                          cudaStream_t s) {
    return am_update_cuda(&q->p_dev, &q->g_dev, &q->s_dev, q->step_dev, hp, key,
                          q->ws_dev, q->ws_dev_bytes, (void *)s, q->rep_dev);
}

static void both_step(pair *q, const am_hparams *hp, am_rng_key key,
                      am_status expect, cudaStream_t s) {
    am_report rc;
    assert_int_equal(am_update(&q->p_cpu, &q->g_cpu, &q->s_cpu, hp, key, q->ws_cpu,
                               (size_t)q->sz.workspace_bytes, &rc), expect);
    assert_int_equal(gpu_step(q, hp, key, s), AM_OK);
    compare(q, &rc);
}

static void run_case(int ndim, const int64_t *dims, am_dtype pdt, am_dtype gdt,
                     double wd, int steps) {
    pair q;
    am_hparams hp = am_hparams_default();
    am_rng_key key;
    cudaStream_t s;
    int k;
    hp.weight_decay = wd;
    key.seed = g_seed * 0x9e3779b97f4a7c15ull;
    key.param_id = 3;
    CU(cudaStreamCreate(&s));
    pair_init(&q, ndim, dims, pdt, gdt);
    for (k = 0; k < steps; k++) {
        fill_grad(&q, (k & 1) ? 3.0f : 1e-3f);
        both_step(&q, &hp, key, AM_OK, s);
    }
    pair_free(&q);
    CU(cudaStreamDestroy(s));
}

static const am_dtype kDt[3] = {AM_DTYPE_FLOAT32, AM_DTYPE_BFLOAT16, AM_DTYPE_FLOAT16};

static void test_shapes(void **st) {
    static const int64_t flat[] = {1, 3, 8, 17, 65, 1023, 4097, 2 * 16384 + 5};
    /* lr-rows of 1 to 70000 elements: both finish paths (one block per
     * lr-row for 512..8192 elements, separate kernels otherwise). */
    static const int64_t mats[][2] = {{1, 1}, {3, 5}, {65, 33}, {1, 40000}, {200, 3},
                                      {129, 17}, {2, 16385}, {1000, 1}, {300, 70000},
                                      {3, 1501}, {2000, 4096}, {9, 512}, {4, 8193}};
    static const int64_t s4[] = {10, 5, 4, 3}, s3[] = {7, 1, 300};
    size_t i;
    int d;
    (void)st;
    for (d = 0; d < 3; d++) {
        run_case(0, NULL, kDt[d], kDt[d], 0.0, 3);
        for (i = 0; i < sizeof flat / sizeof flat[0]; i++)
            run_case(1, &flat[i], kDt[d], kDt[(d + (int)i) % 3], i % 2 ? 0.1 : 0.0, 3);
        for (i = 0; i < sizeof mats / sizeof mats[0]; i++)
            run_case(2, mats[i], kDt[d], kDt[(d + (int)i) % 3], i % 2 ? 0.1 : 0.0, 3);
        run_case(4, s4, kDt[d], kDt[d], 0.1, 3);
        run_case(3, s3, kDt[d], AM_DTYPE_FLOAT32, 0.0, 3);
    }
    { /* more than 64 tiles: the sum of u^2 in GROUP_U2's groups (one tile
       * per 3x3 matrix: 600 and 4096 tiles; a 1-D parameter of 66 tiles) */
        static const int64_t c1[] = {300, 2, 3, 3}, c2[] = {64, 64, 3, 3};
        static const int64_t many = 65 * 16384 + 3;
        run_case(4, c1, AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32, 0.0, 3);
        run_case(4, c2, AM_DTYPE_BFLOAT16, AM_DTYPE_BFLOAT16, 0.1, 3);
        run_case(1, &many, AM_DTYPE_FLOAT16, AM_DTYPE_FLOAT32, 0.0, 2);
    }
}

static void test_skips(void **st) {
    static const int64_t m[] = {9, 13}, v[] = {77};
    am_hparams hp = am_hparams_default();
    am_rng_key key = {99, 1};
    pair q;
    int k;
    (void)st;
    for (k = 0; k < 2; k++) {
        pair_init(&q, k ? 1 : 2, k ? v : m, AM_DTYPE_BFLOAT16, AM_DTYPE_FLOAT32);
        fill_grad(&q, 1.0f);
        both_step(&q, &hp, key, AM_OK, 0);
        fill_grad(&q, 1.0f);
        ((float *)q.g_cpu.data)[5] = (float)NAN;
        CU(cudaMemcpy(q.g_dev.data, q.g_cpu.data, (size_t)q.sz.numel * 4, cudaMemcpyHostToDevice));
        both_step(&q, &hp, key, AM_SKIPPED_NONFINITE_GRAD, 0);
        fill_grad(&q, 1.0f);
        ((float *)q.g_cpu.data)[3] = 3e30f; /* finite, its square is not */
        CU(cudaMemcpy(q.g_dev.data, q.g_cpu.data, (size_t)q.sz.numel * 4, cudaMemcpyHostToDevice));
        both_step(&q, &hp, key, AM_SKIPPED_NONFINITE_UPDATE, 0);
        fill_grad(&q, 1.0f);
        both_step(&q, &hp, key, AM_OK, 0);
        pair_free(&q);
    }
}

/* Bad arguments: an error, nothing queued, nothing modified. */
static void test_errors(void **st) {
    static const int64_t m[] = {4, 6};
    am_hparams hp = am_hparams_default(), bad = hp;
    am_rng_key key = {1, 1};
    am_tensor wrong;
    pair q;
    (void)st;
    pair_init(&q, 2, m, AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32);
    fill_grad(&q, 1.0f);
    assert_int_equal(am_update_cuda(&q.p_dev, &q.g_dev, &q.s_dev, q.step_dev, &hp, key,
                                    q.ws_dev, q.ws_dev_bytes - 300, NULL, q.rep_dev),
                     AM_ERR_BUFFER_SIZE);
    assert_int_equal(am_update_cuda(&q.p_dev, &q.g_dev, &q.s_dev, NULL, &hp, key,
                                    q.ws_dev, q.ws_dev_bytes, NULL, q.rep_dev),
                     AM_ERR_NULL_POINTER);
    bad.beta2 = 1.0;
    assert_int_equal(am_update_cuda(&q.p_dev, &q.g_dev, &q.s_dev, q.step_dev, &bad, key,
                                    q.ws_dev, q.ws_dev_bytes, NULL, q.rep_dev),
                     AM_ERR_INVALID_HPARAM);
    wrong = q.g_dev;
    wrong.shape.dims[1] = 5;
    assert_int_equal(am_update_cuda(&q.p_dev, &wrong, &q.s_dev, q.step_dev, &hp, key,
                                    q.ws_dev, q.ws_dev_bytes, NULL, q.rep_dev),
                     AM_ERR_INVALID_SHAPE);
    wrong = q.g_dev;
    wrong.dtype = (am_dtype)7;
    assert_int_equal(am_update_cuda(&q.p_dev, &wrong, &q.s_dev, q.step_dev, &hp, key,
                                    q.ws_dev, q.ws_dev_bytes, NULL, q.rep_dev),
                     AM_ERR_INVALID_DTYPE);
    compare(&q, NULL); /* nothing changed: still equal to the untouched CPU copy */
    pair_free(&q);
}

/* One update captured in a CUDA graph and replayed: each replay is a step. */
static void test_graph(void **st) {
    static const int64_t m[] = {33, 129}, v[] = {1000};
    am_hparams hp = am_hparams_default();
    am_rng_key key = {5, 9};
    cudaStream_t s;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    pair q;
    int k, r;
    (void)st;
    CU(cudaStreamCreate(&s));
    for (k = 0; k < 2; k++) {
        pair_init(&q, k ? 1 : 2, k ? v : m, AM_DTYPE_BFLOAT16, AM_DTYPE_BFLOAT16);
        CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
        assert_int_equal(gpu_step(&q, &hp, key, s), AM_OK);
        CU(cudaStreamEndCapture(s, &graph));
        CU(cudaGraphInstantiate(&exec, graph, 0));
        for (r = 0; r < 4; r++) {
            am_report rc;
            fill_grad(&q, (r & 1) ? 2.0f : 1e-2f);
            assert_int_equal(am_update(&q.p_cpu, &q.g_cpu, &q.s_cpu, &hp, key, q.ws_cpu,
                                       (size_t)q.sz.workspace_bytes, &rc), AM_OK);
            CU(cudaGraphLaunch(exec, s));
            compare(&q, &rc);
        }
        CU(cudaGraphExecDestroy(exec));
        CU(cudaGraphDestroy(graph));
        pair_free(&q);
    }
    CU(cudaStreamDestroy(s));
}

static void test_large(void **st) {
    static const int64_t wide[] = {1, 100000000}, emb[] = {50000, 4096};
    (void)st;
    if (!getenv("AM_CUDA_TEST_LARGE") || getenv("AM_CUDA_TEST_LARGE")[0] != '1') {
        print_message("test_large: skipped (set AM_CUDA_TEST_LARGE=1)\n");
        skip();
    }
    run_case(2, wide, AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32, 0.0, 2);
    run_case(2, emb, AM_DTYPE_BFLOAT16, AM_DTYPE_BFLOAT16, 0.0, 2);
}

int main(void) {
    const char *env = getenv("AM_TEST_SEED");
    int n = 0;
    am_status s = am_cuda_device_count(&n);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_shapes),
        cmocka_unit_test(test_skips),
        cmocka_unit_test(test_graph),
        cmocka_unit_test(test_large),
    };
    if (s != AM_OK || n == 0) {
        printf("test_cuda: SKIPPED: no CUDA device (%s, %d devices); the CUDA "
               "path is compiled but not exercised here\n", am_status_string(s), n);
        return 77;
    }
    if (env) g_seed = strtoull(env, NULL, 10);
    g_rng = g_seed;
    printf("test_cuda: seed %llu (replay with AM_TEST_SEED=%llu)\n",
           (unsigned long long)g_seed, (unsigned long long)g_seed);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
