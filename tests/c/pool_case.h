/* pool_case.h — one float32 update large enough to reach the thread pool
 * (or a host's runner), run with a given thread count, and a comparison of
 * two such runs byte for byte. Shared by test_threads.c and test_runner.c;
 * include after cmocka.h. */
#ifndef AM_TEST_POOL_CASE_H
#define AM_TEST_POOL_CASE_H

#include <automagic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Two float32 updates (weight decay 0.1) of a parameter of shape sh with
 * the given thread count; the buffers are kept in r. The shapes of
 * pool_shape are above the threading threshold (2 MiB of work per
 * am_parallel_for, src/dispatch.c): a 1-D of 13 flat tiles (stats
 * 13 * 16384 * 12 B, finish * 20 B), a (600, 1023) matrix (~2.4 MB per
 * pass) and one long lr-row (1, 1031, 1023) whose agree/apply is split in
 * chunks. */
typedef struct pool_run {
    float *p, *g, *lr, *row, *col, *sq;
    uint8_t *pol;
    unsigned char *ws;
    am_state_sizes sz;
} pool_run;

static void pool_update(const am_shape *sh, int threads, pool_run *r) {
    am_hparams hp = am_hparams_default();
    am_tensor pt, gt;
    am_state st;
    am_rng_key key = {11, 2};
    int64_t i;
    int s;
    hp.weight_decay = 0.1;
    assert_int_equal(am_state_get_sizes(sh, &r->sz), AM_OK);
    r->p = (float *)malloc((size_t)r->sz.numel * 4);
    r->g = (float *)malloc((size_t)r->sz.numel * 4);
    r->lr = (float *)malloc((size_t)r->sz.lr_count * 4);
    r->pol = (uint8_t *)malloc((size_t)r->sz.polarity_bytes + 1);
    r->row = (float *)malloc((size_t)r->sz.row_count * 4 + 4);
    r->col = (float *)malloc((size_t)r->sz.col_count * 4 + 4);
    r->sq = (float *)malloc((size_t)r->sz.sq_count * 4 + 4);
    r->ws = (unsigned char *)malloc((size_t)r->sz.workspace_bytes);
    assert_true(r->p && r->g && r->lr && r->pol && r->row && r->col && r->sq && r->ws);
    st.lr = r->lr;
    st.polarity = r->pol;
    st.row = sh->ndim >= 2 ? r->row : NULL;
    st.col = sh->ndim >= 2 ? r->col : NULL;
    st.sq = sh->ndim >= 2 ? NULL : r->sq;
    assert_int_equal(am_state_init(sh, &st, 1e-3), AM_OK);
    for (i = 0; i < r->sz.numel; i++) r->p[i] = (float)(i % 29) * 0.05f - 0.7f;
    pt.data = r->p;
    pt.dtype = AM_DTYPE_FLOAT32;
    pt.shape = *sh;
    gt = pt;
    gt.data = r->g;
    assert_int_equal(am_set_num_threads(threads), AM_OK);
    for (s = 0; s < 2; s++) {
        for (i = 0; i < r->sz.numel; i++)
            r->g[i] = (float)((i * 7 + s * 5) % 23) / 23.0f - 0.45f;
        assert_int_equal(am_update(&pt, &gt, &st, &hp, key, r->ws,
                                   (size_t)r->sz.workspace_bytes, NULL), AM_OK);
    }
    assert_int_equal(am_set_num_threads(1), AM_OK);
}

static void pool_free(pool_run *r) {
    free(r->p); free(r->g); free(r->lr); free(r->pol);
    free(r->row); free(r->col); free(r->sq); free(r->ws);
}

/* The three shapes pool_update is run on: a 1-D of 13 flat tiles, a
 * (600, 1023) matrix and one long lr-row (1, 1031, 1023). */
static void pool_shape(int c, am_shape *sh) {
    static const int32_t nd[3] = {1, 2, 3};
    static const int64_t dims[3][3] = {{13 * 16384 - 5}, {600, 1023}, {1, 1031, 1023}};
    int d;
    memset(sh, 0, sizeof *sh);
    sh->ndim = nd[c];
    for (d = 0; d < nd[c]; d++) sh->dims[d] = dims[c][d];
}

/* Parameter, lr, polarity and second moments equal, byte for byte. */
static void pool_assert_equal(const pool_run *a, const pool_run *b, int ndim) {
    assert_memory_equal(a->p, b->p, (size_t)a->sz.numel * 4);
    assert_memory_equal(a->lr, b->lr, (size_t)a->sz.lr_count * 4);
    assert_memory_equal(a->pol, b->pol, (size_t)a->sz.polarity_bytes);
    if (ndim >= 2) {
        assert_memory_equal(a->row, b->row, (size_t)a->sz.row_count * 4);
        assert_memory_equal(a->col, b->col, (size_t)a->sz.col_count * 4);
    } else {
        assert_memory_equal(a->sq, b->sq, (size_t)a->sz.sq_count * 4);
    }
}

#endif
