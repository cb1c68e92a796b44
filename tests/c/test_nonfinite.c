/*
 * test_nonfinite.c — gradients the SPEC singles out: non-finite elements
 * (SPEC 6.2: parameter, every state buffer and step exactly unchanged, the
 * status and count reported), finite gradients whose update is not finite,
 * all-zero gradients, and parameters with zero elements (a no-op).
 */
#include "test_common.h"

/* the kernel sets (dispatch.c): 0 the best, 1 the scalar reference, 2 the
 * portable vector set */
void am_kernels_select(int which);

static const am_dtype k_dtypes[3] = {AM_DTYPE_FLOAT32, AM_DTYPE_BFLOAT16,
                                     AM_DTYPE_FLOAT16};

enum { BAD_NAN, BAD_PINF, BAD_NINF };

/* Writes a NaN / +Inf / -Inf of dtype dt at element i. */
static void put_bad(void *g, am_dtype dt, int64_t i, int kind) {
    if (dt == AM_DTYPE_FLOAT32) {
        float v = kind == BAD_NAN ? NAN : kind == BAD_PINF ? INFINITY : -INFINITY;
        ((float *)g)[i] = v;
    } else if (dt == AM_DTYPE_BFLOAT16) {
        ((uint16_t *)g)[i] = kind == BAD_NAN ? 0x7fc1 : kind == BAD_PINF ? 0x7f80 : 0xff80;
    } else {
        ((uint16_t *)g)[i] = kind == BAD_NAN ? 0x7e01 : kind == BAD_PINF ? 0x7c00 : 0xfc00;
    }
}

typedef struct t_case { int32_t ndim; int64_t d[8]; } t_case;

static const t_case k_shapes[] = {
    {0, {0}}, {1, {1}}, {1, {17}}, {1, {4097}}, {2, {1, 1}}, {2, {17, 1}},
    {2, {1, 17}}, {2, {33, 65}}, {3, {3, 1, 7}}, {4, {10, 5, 4, 3}},
    {2, {2, 16385}}, {4, {4, 9, 3, 3}}, {4, {17, 2, 1, 1}}, /* runs of 16 matrices */
};
#define N_SHAPES (sizeof k_shapes / sizeof k_shapes[0])

/* Takes the parameter and state through two ordinary updates first, so that
 * "unchanged" is checked against non-trivial state (step 2, moments and
 * polarity set, lrs bumped). */
static void warm_up(t_fix *f, void *param, am_dtype pdt, void *grad, am_dtype gdt,
                    const am_hparams *hp, uint64_t *rs) {
    am_tensor pt = t_tensor(param, pdt, &f->shape), gt = t_tensor(grad, gdt, &f->shape);
    am_rng_key key = {7, 1};
    int64_t n = t_numel(&f->shape), i;
    int s;
    for (s = 0; s < 2; s++) {
        for (i = 0; i < n; i++) t_store_random(grad, gdt, i, rs, -4, 1);
        assert_int_equal(am_update(&pt, &gt, &f->st, hp, key, f->ws, f->ws_bytes, NULL),
                         AM_OK);
    }
}

/* One, several, and every-kind non-finite elements, at the first, a middle
 * and the last position, for every dtype pair and shape; through am_update
 * and through the phases (am_update_stats must already report it). */
static void test_nonfinite_grad_kernel(void **unused) {
    uint64_t rs = t_seed();
    am_hparams hp = am_hparams_default();
    size_t c;
    int a, b, kind, where;
    long cases = 0;
    (void)unused;
    for (c = 0; c < N_SHAPES; c++)
        for (a = 0; a < 3; a++)
            for (b = 0; b < 3; b++) {
                am_shape sh = t_shape(k_shapes[c].ndim, k_shapes[c].d);
                int64_t n = t_numel(&sh), i;
                size_t pbytes = (size_t)n * am_dtype_size(k_dtypes[a]);
                size_t gbytes = (size_t)n * am_dtype_size(k_dtypes[b]);
                void *param = t_calloc(n * 4), *grad = t_calloc(n * 4);
                am_tensor pt = t_tensor(param, k_dtypes[a], &sh);
                am_tensor gt = t_tensor(grad, k_dtypes[b], &sh);
                t_fix f;
                t_fix_init(&f, &sh, 1e-3);
                for (i = 0; i < n; i++) t_store_random(param, k_dtypes[a], i, &rs, -3, 1);
                warm_up(&f, param, k_dtypes[a], grad, k_dtypes[b], &hp, &rs);
                for (kind = 0; kind < 4; kind++)
                    for (where = 0; where < 3; where++) {
                        am_rng_key key = {99, 1};
                        am_report rep;
                        am_workspace_view view;
                        t_snap snap;
                        int64_t pos = where == 0 ? 0 : where == 1 ? n / 2 : n - 1;
                        int64_t expect = 1;
                        am_status st;
                        for (i = 0; i < n; i++)
                            t_store_random(grad, k_dtypes[b], i, &rs, -4, 1);
                        if (kind < 3) {
                            put_bad(grad, k_dtypes[b], pos, kind);
                        } else if (n >= 3) { /* all three kinds at once */
                            put_bad(grad, k_dtypes[b], 0, BAD_NAN);
                            put_bad(grad, k_dtypes[b], n / 2, BAD_PINF);
                            put_bad(grad, k_dtypes[b], n - 1, BAD_NINF);
                            expect = 3;
                        } else {
                            put_bad(grad, k_dtypes[b], 0, BAD_NINF);
                        }
                        t_snap_take(&snap, &f, param, pbytes, grad, gbytes);
                        memset(&rep, 0xAB, sizeof rep);
                        st = am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, &rep);
                        if (st != AM_SKIPPED_NONFINITE_GRAD)
                            fail_msg("%s %s/%s kind %d at %lld: status %d", t_shape_str(&sh),
                                     am_dtype_name(k_dtypes[a]), am_dtype_name(k_dtypes[b]),
                                     kind, (long long)pos, (int)st);
                        assert_int_equal(rep.status, AM_SKIPPED_NONFINITE_GRAD);
                        assert_int_equal(rep.nonfinite_count, expect);
                        assert_true(rep.clip_scale == 0.0f && rep.mean_agreement == 0.0f);
                        t_snap_check(&snap, &f, param, grad);
                        /* the phases: stats already says so, and counts */
                        assert_int_equal(am_update_stats(&pt, &gt, &f.st, &hp, f.ws, f.ws_bytes),
                                         AM_SKIPPED_NONFINITE_GRAD);
                        assert_int_equal(am_workspace_view_get(&sh, f.ws, f.ws_bytes, &view), AM_OK);
                        assert_int_equal(*view.nonfinite, expect);
                        assert_int_equal(am_update_moments(&pt, &gt, &f.st, &hp, f.ws, f.ws_bytes),
                                         AM_SKIPPED_NONFINITE_GRAD);
                        /* finish after a skipped moments has nothing to finish:
                         * whatever it returns, it must not apply anything */
                        assert_int_not_equal(am_update_finish(&pt, &gt, &f.st, &hp, key, f.ws,
                                                              f.ws_bytes, &rep),
                                             AM_OK);
                        t_snap_check(&snap, &f, param, grad);
                        t_snap_free(&snap);
                        cases++;
                    }
                t_fix_free(&f);
                free(param);
                free(grad);
            }
    printf("[ measured ] %ld non-finite gradient cases, all skipped with nothing changed\n",
           cases);
}

/* A sharded engine whose local shard is finite but another shard's is not:
 * after the all-reduce it writes the reduced count into the view, and
 * am_update_moments must then skip with nothing changed. */
static void test_nonfinite_reduced(void **unused) {
    const int64_t d[2] = {6, 10};
    am_shape sh = t_shape(2, d);
    am_hparams hp = am_hparams_default();
    float p[60], g[60];
    am_tensor pt = t_tensor(p, AM_DTYPE_FLOAT32, &sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, &sh);
    am_workspace_view view;
    t_snap snap;
    t_fix f;
    int i;
    (void)unused;
    for (i = 0; i < 60; i++) {
        p[i] = 0.01f * (float)i;
        g[i] = 0.02f * (float)(i % 7) - 0.05f;
    }
    t_fix_init(&f, &sh, 1e-3);
    t_snap_take(&snap, &f, p, sizeof p, g, sizeof g);
    assert_int_equal(am_update_stats(&pt, &gt, &f.st, &hp, f.ws, f.ws_bytes), AM_OK);
    assert_int_equal(am_workspace_view_get(&sh, f.ws, f.ws_bytes, &view), AM_OK);
    assert_int_equal(*view.nonfinite, 0);
    *view.nonfinite = 2; /* the all-reduced count */
    assert_int_equal(am_update_moments(&pt, &gt, &f.st, &hp, f.ws, f.ws_bytes),
                     AM_SKIPPED_NONFINITE_GRAD);
    t_snap_check(&snap, &f, p, g);
    t_snap_free(&snap);
    t_fix_free(&f);
}

/* The optimizer object: the skip is reported, counted, and leaves the
 * parameter and its state (read back through am_optimizer_get_state)
 * unchanged; update_all reports the skip and still updates the others. */
static void test_nonfinite_grad_optimizer(void **unused) {
    const int64_t dims[2] = {4, 6};
    am_hparams hp = am_hparams_default();
    am_optimizer *opt = NULL;
    uint16_t w16[24], g16[24], w16_before[24];
    float w[24], g[24], w_before[24];
    int32_t id0, id1;
    am_state st0, st0_before;
    am_shape sh;
    float lr_before[4], row_before[4], col_before[6];
    uint8_t pol_before[4];
    am_report rep, reps[2];
    const void *grads[2];
    am_dtype gds[2] = {AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT16};
    int i;
    (void)unused;
    /* an lr large enough that the bfloat16 parameter (ulp 2^-14 near
     * 2^-7) moves for certain, not with a probability of ~lr / ulp */
    hp.lr = 1e-3;
    for (i = 0; i < 24; i++) {
        w[i] = 0.1f * (float)(i - 12);
        w16[i] = (uint16_t)(0x3c00 + i); /* float16 near 1 */
        g[i] = 0.01f * (float)(i % 5 - 2) + 0.001f;
        g16[i] = (uint16_t)(0x2000 + 3 * i);
    }
    assert_int_equal(am_optimizer_create(&hp, 5, &opt), AM_OK);
    assert_int_equal(am_optimizer_add_param(opt, w, AM_DTYPE_FLOAT32, 2, dims, &id0), AM_OK);
    assert_int_equal(am_optimizer_add_param(opt, w16, AM_DTYPE_BFLOAT16, 2, dims, &id1), AM_OK);
    assert_int_equal(am_optimizer_update_param(opt, id0, g, AM_DTYPE_FLOAT32, &rep), AM_OK);
    assert_int_equal(am_optimizer_update_param(opt, id0, g, AM_DTYPE_FLOAT32, &rep), AM_OK);
    assert_int_equal(am_optimizer_get_state(opt, id0, &st0, &sh), AM_OK);
    st0_before = st0;
    memcpy(lr_before, st0.lr, sizeof lr_before);
    memcpy(row_before, st0.row, sizeof row_before);
    memcpy(col_before, st0.col, sizeof col_before);
    memcpy(pol_before, st0.polarity, sizeof pol_before);
    memcpy(w_before, w, sizeof w);
    g[7] = NAN;
    assert_int_equal(am_optimizer_update_param(opt, id0, g, AM_DTYPE_FLOAT32, &rep),
                     AM_SKIPPED_NONFINITE_GRAD);
    assert_int_equal(rep.nonfinite_count, 1);
    assert_int_equal(am_optimizer_skipped_count(opt), 1);
    assert_memory_equal(w, w_before, sizeof w);
    assert_int_equal(am_optimizer_get_state(opt, id0, &st0, &sh), AM_OK);
    assert_int_equal(st0.step, 2);
    assert_memory_equal(&st0, &st0_before, sizeof st0);
    assert_memory_equal(st0.lr, lr_before, sizeof lr_before);
    assert_memory_equal(st0.row, row_before, sizeof row_before);
    assert_memory_equal(st0.col, col_before, sizeof col_before);
    assert_memory_equal(st0.polarity, pol_before, sizeof pol_before);
    /* update_all: parameter 0 skipped (-Inf), parameter 1 updated */
    g[7] = -INFINITY;
    grads[0] = g;
    grads[1] = g16;
    memcpy(w16_before, w16, sizeof w16);
    assert_int_equal(am_optimizer_update_all(opt, grads, gds, reps), AM_SKIPPED_NONFINITE_GRAD);
    assert_int_equal(reps[0].status, AM_SKIPPED_NONFINITE_GRAD);
    assert_int_equal(reps[0].nonfinite_count, 1);
    assert_int_equal(reps[1].status, AM_OK);
    assert_memory_equal(w, w_before, sizeof w);
    assert_true(memcmp(w16, w16_before, sizeof w16) != 0);
    assert_int_equal(am_optimizer_get_state(opt, id1, &st0, &sh), AM_OK);
    assert_int_equal(st0.step, 1);
    assert_int_equal(am_optimizer_skipped_count(opt), 2);
    am_optimizer_destroy(opt);
}

/* A finite gradient whose update is not finite: g*g overflows float32 in a
 * factored parameter (the row mean becomes inf/inf), and eps = 0 with an
 * all-zero gradient (0/0). Both are AM_SKIPPED_NONFINITE_UPDATE with nothing
 * changed; nonfinite_count is 0 (the gradient itself was finite). Both
 * cases factored and unfactored, and for many small matrices (15 of 1x1:
 * am_update writes their new moments over the old and must put those back). */
static void test_nonfinite_update(void **unused) {
    const int64_t d2[2] = {3, 5}, d1[1] = {9}, d3[3] = {15, 1, 1};
    am_hparams hp = am_hparams_default(), hp0 = am_hparams_default();
    int which;
    (void)unused;
    hp0.eps = 0.0;
    /* which: 0 overflow factored, 1 eps = 0 factored, 2 eps = 0 unfactored,
     * 3 overflow unfactored (1-D), 4 overflow 0-D, 5 overflow and 6 eps = 0
     * many small matrices */
    for (which = 0; which < 7; which++) {
        am_shape sh = which <= 1   ? t_shape(2, d2)
                      : which >= 5 ? t_shape(3, d3)
                                   : t_shape(which == 4 ? 0 : 1, d1);
        int64_t n = t_numel(&sh), i;
        float p[15], g[15];
        am_tensor pt = t_tensor(p, AM_DTYPE_FLOAT32, &sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, &sh);
        am_rng_key key = {1, 0};
        am_report rep;
        t_snap snap;
        t_fix f;
        int overflow = which == 0 || (which >= 3 && which <= 5);
        t_fix_init(&f, &sh, 1e-3);
        for (i = 0; i < n; i++) {
            p[i] = 0.25f * (float)(i + 1);
            g[i] = 0.5f - 0.1f * (float)i;
        }
        /* overflow: after one ordinary step; eps = 0: from fresh (zero) state */
        if (overflow)
            assert_int_equal(am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, NULL), AM_OK);
        for (i = 0; i < n; i++) g[i] = overflow ? ((i & 1) ? 3e38f : -2e30f) : 0.0f;
        if (which == 3) /* one element overflows, the rest are ordinary */
            for (i = 0; i < n; i++) g[i] = i == 4 ? 3e38f : 0.1f;
        t_snap_take(&snap, &f, p, sizeof(float) * (size_t)n, g, sizeof(float) * (size_t)n);
        assert_int_equal(am_update(&pt, &gt, &f.st, overflow ? &hp : &hp0, key, f.ws, f.ws_bytes, &rep),
                         AM_SKIPPED_NONFINITE_UPDATE);
        assert_int_equal(rep.status, AM_SKIPPED_NONFINITE_UPDATE);
        assert_int_equal(rep.nonfinite_count, 0);
        t_snap_check(&snap, &f, p, g);
        t_snap_free(&snap);
        t_fix_free(&f);
    }
}

/* A 1-D (or 0-D) parameter whose state holds a negative sq element (a
 * corrupt state; no update makes one, both checkpoint loaders refuse it):
 * where the new sq is below -eps the update would be NaN, while the clip's
 * sum stayed finite, so NaN was written into the parameter (found by a
 * review, thirtieth session). Skipped as AM_SKIPPED_NONFINITE_UPDATE,
 * nothing changed, with every kernel set, the bad element in a vector
 * body and in a tail; through the phases too. */
static void test_negative_sq(void **unused) {
    static const int64_t lens[] = {1, 9, 17, 4097};
    am_hparams hp = am_hparams_default();
    uint64_t rs = t_seed() ^ 91u;
    int set, a;
    size_t c;
    (void)unused;
    for (set = 0; set < 3; set++) {
        am_kernels_select(set);
        for (c = 0; c < sizeof lens / sizeof lens[0]; c++)
            for (a = 0; a < 3; a++) {
                const int64_t n = lens[c];
                const int64_t at[3] = {0, n / 2, n - 1};
                am_shape sh = t_shape(n == 1 ? 0 : 1, &n);
                void *p = t_calloc(n * 4), *g = t_calloc(n * 4);
                am_tensor pt = t_tensor(p, k_dtypes[a], &sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, &sh);
                am_rng_key key = {5, 3};
                am_report rep;
                int w;
                for (w = 0; w < 3; w++) {
                    t_snap snap;
                    t_fix f;
                    int64_t i;
                    t_fix_init(&f, &sh, 1e-3);
                    for (i = 0; i < n; i++) {
                        t_store_random(p, k_dtypes[a], i, &rs, -2, 2);
                        t_store_random(g, AM_DTYPE_FLOAT32, i, &rs, -4, 1);
                    }
                    assert_int_equal(am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, NULL),
                                     AM_OK);
                    f.st.sq[at[w]] = -1.0f;
                    t_snap_take(&snap, &f, p, (size_t)n * am_dtype_size(k_dtypes[a]), g,
                                (size_t)n * 4);
                    assert_int_equal(am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, &rep),
                                     AM_SKIPPED_NONFINITE_UPDATE);
                    assert_int_equal(rep.nonfinite_count, 0);
                    t_snap_check(&snap, &f, p, g);
                    /* the phases: the gradient is finite, u2_sum is not,
                     * the finish skips (as for an overflow) */
                    assert_int_equal(am_update_stats(&pt, &gt, &f.st, &hp, f.ws, f.ws_bytes),
                                     AM_OK);
                    assert_int_equal(am_update_moments(&pt, &gt, &f.st, &hp, f.ws, f.ws_bytes),
                                     AM_OK);
                    assert_int_equal(am_update_finish(&pt, &gt, &f.st, &hp, key, f.ws,
                                                      f.ws_bytes, NULL),
                                     AM_SKIPPED_NONFINITE_UPDATE);
                    t_snap_check(&snap, &f, p, g);
                    /* a sq of -eps / 2 with a zero gradient: v + eps > 0, an
                     * ordinary (finite) update */
                    f.st.sq[at[w]] = -0.5f * (float)hp.eps;
                    ((float *)g)[at[w]] = 0.0f;
                    assert_int_equal(am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, NULL),
                                     AM_OK);
                    t_snap_free(&snap);
                    t_fix_free(&f);
                }
                free(p);
                free(g);
            }
    }
    am_kernels_select(0);
}

/* A row factor past float range's square root: one row's old moment is
 * 1e30 and the others' 0, the gradient tiny (1e-37), so rf of the small rows
 * is about 1e28 and rf * cf overflows float32 (cf about 3e16), while the
 * true sum of u*u is modest. The pass over g sees u = inf and skips the
 * update; the sum from the stats pass (am_wsum) would not, and the apply's
 * u = (rf * cf) * g would write infinities: am_wsum_usable sends such
 * factors to the pass (update.c, u2_from_wsum). Nothing changes. */
static void test_factor_overflow(void **unused) {
    const int64_t d2[2] = {8, 64};
    am_shape sh = t_shape(2, d2);
    int64_t n = t_numel(&sh), i;
    float p[512], g[512];
    am_tensor pt = t_tensor(p, AM_DTYPE_FLOAT32, &sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, &sh);
    am_hparams hp = am_hparams_default();
    am_rng_key key = {1, 0};
    am_report rep;
    t_snap snap;
    t_fix f;
    (void)unused;
    t_fix_init(&f, &sh, 1e-3);
    for (i = 0; i < n; i++) {
        p[i] = 0.25f * (float)(i + 1);
        g[i] = (i & 1) ? 1e-37f : -2e-37f;
    }
    f.st.row[0] = 1e30f;
    t_snap_take(&snap, &f, p, sizeof p, g, sizeof g);
    assert_int_equal(am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, &rep),
                     AM_SKIPPED_NONFINITE_UPDATE);
    assert_int_equal(rep.nonfinite_count, 0);
    t_snap_check(&snap, &f, p, g);
    t_snap_free(&snap);
    t_fix_free(&f);
}

/* All-zero gradient (default eps): status OK, step advances, polarity all
 * zero (zero is not positive), moments move by the eps term only, and with
 * weight_decay = 0 every parameter bit is unchanged (u = 0 exactly) for every
 * dtype pair. With weight decay the parameter shrinks: p - lr*wd*p. */
static void test_zero_grad(void **unused) {
    typedef struct { int32_t ndim; int64_t d[4]; } sc;
    static const sc shapes[] = {{0, {0}}, {1, {13}}, {2, {5, 7}}, {3, {2, 3, 4}}, {4, {10, 5, 4, 3}}};
    uint64_t rs = t_seed() ^ 77u;
    size_t c;
    int a, b;
    (void)unused;
    for (c = 0; c < sizeof shapes / sizeof shapes[0]; c++)
        for (a = 0; a < 3; a++)
            for (b = 0; b < 3; b++) {
                am_shape sh = t_shape(shapes[c].ndim, shapes[c].d);
                int64_t n = t_numel(&sh), i;
                size_t pbytes = (size_t)n * am_dtype_size(k_dtypes[a]);
                void *param = t_calloc(n * 4), *grad = t_calloc(n * 4), *before;
                am_tensor pt = t_tensor(param, k_dtypes[a], &sh), gt = t_tensor(grad, k_dtypes[b], &sh);
                am_hparams hp = am_hparams_default();
                am_rng_key key = {3, 2};
                am_report rep;
                t_fix f;
                t_fix_init(&f, &sh, 1e-3);
                for (i = 0; i < n; i++) t_store_random(param, k_dtypes[a], i, &rs, -2, 2);
                before = t_dup(param, pbytes);
                warm_up(&f, param, k_dtypes[a], grad, k_dtypes[b], &hp, &rs);
                memcpy(before, param, pbytes);
                memset(grad, 0, (size_t)n * 4);
                assert_int_equal(am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, &rep), AM_OK);
                assert_int_equal(f.st.step, 3);
                assert_true(rep.clip_scale == 1.0f);
                assert_memory_equal(param, before, pbytes);
                for (i = 0; i < f.sz.polarity_bytes; i++) assert_int_equal(f.st.polarity[i], 0);
                /* zero polarity now matches zero polarity: agreement 1 */
                assert_int_equal(am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, &rep), AM_OK);
                assert_true(rep.mean_agreement == 1.0f);
                assert_memory_equal(param, before, pbytes);
                if (k_dtypes[a] == AM_DTYPE_FLOAT32) {
                    /* weight decay alone: p - lr*(0 + wd*p), in float32 */
                    hp.weight_decay = 0.5;
                    assert_int_equal(am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, &rep), AM_OK);
                    for (i = 0; i < n; i++) {
                        float p0 = ((float *)before)[i], lr = f.st.lr[sh.ndim >= 2 ? i / (n / sh.dims[0]) : i];
                        float want = p0 - lr * (0.5f * p0);
                        assert_true(((float *)param)[i] == want);
                    }
                }
                free(before);
                t_fix_free(&f);
                free(param);
                free(grad);
            }
}

/* numel 0 ({0}, {0,5}, {5,0}, {3,0,2}): OK and nothing changes, not even the
 * step; data pointers may be NULL. Also through the optimizer object. */
static void test_numel_zero(void **unused) {
    typedef struct { int32_t ndim; int64_t d[3]; } sc;
    static const sc shapes[] = {{1, {0}}, {2, {0, 5}}, {2, {5, 0}}, {3, {3, 0, 2}}};
    size_t c;
    (void)unused;
    for (c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
        am_shape sh = t_shape(shapes[c].ndim, shapes[c].d);
        am_hparams hp = am_hparams_default();
        am_rng_key key = {1, 1};
        am_report rep;
        t_fix f;
        t_snap snap;
        float dummy = 1.5f;
        am_tensor pt = t_tensor(NULL, AM_DTYPE_BFLOAT16, &sh), gt = t_tensor(NULL, AM_DTYPE_FLOAT16, &sh);
        am_optimizer *opt = NULL;
        int32_t id = -1;
        double mean = 0;
        t_fix_init(&f, &sh, 1e-4);
        assert_int_equal(f.sz.numel, 0);
        f.st.step = 4;
        t_snap_take(&snap, &f, NULL, 0, NULL, 0);
        assert_int_equal(am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, &rep), AM_OK);
        assert_int_equal(rep.status, AM_OK);
        t_snap_check(&snap, &f, NULL, NULL);
        pt.data = &dummy;
        gt.data = &dummy;
        assert_int_equal(am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, &rep), AM_OK);
        assert_true(dummy == 1.5f);
        t_snap_check(&snap, &f, NULL, NULL);
        /* a no-op, but a negative step is still refused, as the header says
         * (it was accepted for zero elements) */
        f.st.step = -7;
        assert_int_equal(am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, &rep),
                         AM_ERR_INVALID_ARGUMENT);
        f.st.step = 4;
        t_snap_free(&snap);
        t_fix_free(&f);

        assert_int_equal(am_optimizer_create(&hp, 1, &opt), AM_OK);
        assert_int_equal(am_optimizer_add_param(opt, NULL, AM_DTYPE_FLOAT32, sh.ndim, sh.dims, &id), AM_OK);
        assert_int_equal(am_optimizer_update_param(opt, id, NULL, AM_DTYPE_FLOAT32, &rep), AM_OK);
        assert_int_equal(am_optimizer_lr_count(opt, id), sh.ndim >= 2 ? sh.dims[0] : 0);
        assert_int_equal(am_optimizer_lr_mean(opt, id, &mean), AM_OK);
        am_optimizer_destroy(opt);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_nonfinite_grad_kernel),
        cmocka_unit_test(test_nonfinite_reduced),
        cmocka_unit_test(test_nonfinite_grad_optimizer),
        cmocka_unit_test(test_nonfinite_update),
        cmocka_unit_test(test_negative_sq),
        cmocka_unit_test(test_factor_overflow),
        cmocka_unit_test(test_zero_grad),
        cmocka_unit_test(test_numel_zero),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
