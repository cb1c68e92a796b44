/*
 * test_phases.c — the three phases of the kernel layer (am_update_stats,
 * am_update_moments, am_update_finish) and the workspace view:
 *   - stats -> moments -> finish gives exactly the bits of am_update, for
 *     every dtype pair;
 *   - the view holds what the header says (row/col sums of g*g, the sum of
 *     u*u before clipping, the non-finite count), checked against plain
 *     double sums (1e-6 relative);
 *   - the documented sharded protocol: a parameter split along dims[0] into
 *     k equal shards (whole matrices per shard for ndim >= 3, element ranges
 *     for ndim 1), with u2_sum all-reduced and divided by k, gives the
 *     unsharded float32 result (lrs and polarity identical, parameters and
 *     moments within 2 ulp).
 */
#include "test_common.h"
#include "internal.h" /* am_lr_bump, am_consts_from: the reference formulas */

static const am_dtype k_dtypes[3] = {AM_DTYPE_FLOAT32, AM_DTYPE_BFLOAT16,
                                     AM_DTYPE_FLOAT16};

static void test_phases_equal_update(void **unused) {
    typedef struct { int32_t ndim; int64_t d[4]; } sc;
    static const sc shapes[] = {{0, {0}}, {1, {37}}, {2, {9, 70}}, {3, {2, 65, 3}}, {4, {3, 1, 4, 5}},
                                /* many small matrices: runs of 8 and a rest,
                                 * lr-rows of 7 and of 1 matrices */
                                {4, {5, 7, 3, 3}}, {3, {20, 2, 5}},
                                /* more than 64 groups of 64 matrices (and a
                                 * partial one): am_update's sweep sums them
                                 * in groups, the phases tile by tile */
                                {4, {67, 65, 3, 3}}, {4, {4161, 1, 1, 1}}};
    uint64_t rs = t_seed() ^ 0xabcu;
    size_t c;
    int a, b, s;
    (void)unused;
    for (c = 0; c < sizeof shapes / sizeof shapes[0]; c++)
        for (a = 0; a < 3; a++)
            for (b = 0; b < 3; b++) {
                am_shape sh = t_shape(shapes[c].ndim, shapes[c].d);
                int64_t n = t_numel(&sh), i;
                size_t pb = (size_t)n * am_dtype_size(k_dtypes[a]);
                void *p1 = t_calloc(n * 4), *p2 = t_calloc(n * 4), *g = t_calloc(n * 4);
                am_tensor t1 = t_tensor(p1, k_dtypes[a], &sh), t2 = t_tensor(p2, k_dtypes[a], &sh);
                am_tensor gt = t_tensor(g, k_dtypes[b], &sh);
                am_hparams hp = am_hparams_default();
                am_rng_key key = {31337, 4};
                am_report r1, r2;
                t_fix f1, f2;
                t_fix_init(&f1, &sh, 1e-3);
                t_fix_init(&f2, &sh, 1e-3);
                for (i = 0; i < n; i++) t_store_random(p1, k_dtypes[a], i, &rs, -3, 1);
                memcpy(p2, p1, pb);
                for (s = 0; s < 3; s++) {
                    for (i = 0; i < n; i++) t_store_random(g, k_dtypes[b], i, &rs, -5, 1);
                    assert_int_equal(am_update(&t1, &gt, &f1.st, &hp, key, f1.ws, f1.ws_bytes, &r1), AM_OK);
                    assert_int_equal(am_update_stats(&t2, &gt, &f2.st, &hp, f2.ws, f2.ws_bytes), AM_OK);
                    assert_int_equal(am_update_moments(&t2, &gt, &f2.st, &hp, f2.ws, f2.ws_bytes), AM_OK);
                    assert_int_equal(am_update_finish(&t2, &gt, &f2.st, &hp, key, f2.ws, f2.ws_bytes, &r2), AM_OK);
                    assert_memory_equal(p1, p2, pb);
                    assert_memory_equal(f1.st.lr, f2.st.lr, (size_t)f1.sz.lr_count * 4);
                    assert_memory_equal(f1.st.polarity, f2.st.polarity, (size_t)f1.sz.polarity_bytes);
                    if (sh.ndim >= 2) {
                        assert_memory_equal(f1.st.row, f2.st.row, (size_t)f1.sz.row_count * 4);
                        assert_memory_equal(f1.st.col, f2.st.col, (size_t)f1.sz.col_count * 4);
                    } else {
                        assert_memory_equal(f1.st.sq, f2.st.sq, (size_t)f1.sz.sq_count * 4);
                    }
                    assert_int_equal(f1.st.step, f2.st.step);
                    assert_memory_equal(&r1, &r2, sizeof r1);
                    { /* the same sum of u*u to the last bit (a float clip
                       * scale hides most differences of the double sum) */
                        am_workspace_view v1, v2;
                        assert_int_equal(am_workspace_view_get(&sh, f1.ws, f1.ws_bytes, &v1), AM_OK);
                        assert_int_equal(am_workspace_view_get(&sh, f2.ws, f2.ws_bytes, &v2), AM_OK);
                        assert_memory_equal(v1.u2_sum, v2.u2_sum, sizeof *v1.u2_sum);
                    }
                }
                t_fix_free(&f1);
                t_fix_free(&f2);
                free(p1);
                free(p2);
                free(g);
            }
}

/* am_update's sweep of many small matrices sums its per-matrix sums of
 * u*u in groups of AM_SUM_GROUP (64), the phases tile by tile with
 * am_sum_tiles: the same sum to the last bit. With eps = 1 (u*u about
 * 1000 g*g for small g) and each matrix's gradient in one binade, rising
 * along each group and from group to group, the per-matrix sums span about
 * 2^100 and their order decides the double additions' rounding: summing a
 * group, or the groups, in reverse order fails here. */
static void test_phases_sum_groups(void **unused) {
    const int64_t d[4] = {67, 65, 3, 3};
    am_shape sh = t_shape(4, d);
    const int64_t n = t_numel(&sh), B = 67 * 65;
    float *p1 = t_calloc(n * 4), *p2 = t_calloc(n * 4), *g = t_calloc(n * 4);
    am_tensor t1 = t_tensor(p1, AM_DTYPE_FLOAT32, &sh), t2 = t_tensor(p2, AM_DTYPE_FLOAT32, &sh);
    am_tensor gt = t_tensor(g, AM_DTYPE_FLOAT32, &sh);
    am_hparams hp = am_hparams_default();
    am_rng_key key = {7, 1};
    am_workspace_view v1, v2;
    uint64_t rs = t_seed() ^ 0x5a2u;
    t_fix f1, f2;
    int64_t b, i;
    int s;
    (void)unused;
    hp.eps = 1.0f;
    t_fix_init(&f1, &sh, 1e-3);
    t_fix_init(&f2, &sh, 1e-3);
    for (i = 0; i < n; i++) t_store_random(p1, AM_DTYPE_FLOAT32, i, &rs, -3, 1);
    memcpy(p2, p1, (size_t)n * 4);
    for (s = 0; s < 2; s++) {
        for (b = 0; b < B; b++) {
            /* rising within each group of 64 (summed in order, the small
             * ones add up before the large ones come), and from group to
             * group */
            const int e = -45 + (int)(b % 64) * 40 / 64 + (int)(b / 64 % 10);
            for (i = 9 * b; i < 9 * b + 9; i++) t_store_random(g, AM_DTYPE_FLOAT32, i, &rs, e, e + 1);
        }
        assert_int_equal(am_update(&t1, &gt, &f1.st, &hp, key, f1.ws, f1.ws_bytes, NULL), AM_OK);
        assert_int_equal(am_update_stats(&t2, &gt, &f2.st, &hp, f2.ws, f2.ws_bytes), AM_OK);
        assert_int_equal(am_update_moments(&t2, &gt, &f2.st, &hp, f2.ws, f2.ws_bytes), AM_OK);
        assert_int_equal(am_update_finish(&t2, &gt, &f2.st, &hp, key, f2.ws, f2.ws_bytes, NULL), AM_OK);
        assert_int_equal(am_workspace_view_get(&sh, f1.ws, f1.ws_bytes, &v1), AM_OK);
        assert_int_equal(am_workspace_view_get(&sh, f2.ws, f2.ws_bytes, &v2), AM_OK);
        assert_memory_equal(v1.u2_sum, v2.u2_sum, sizeof *v1.u2_sum);
        assert_memory_equal(p1, p2, (size_t)n * 4);
    }
    t_fix_free(&f1);
    t_fix_free(&f2);
    free(p1);
    free(p2);
    free(g);
}

/* The view after each phase, against plain double sums. */
static void test_view_contents(void **unused) {
    typedef struct { int32_t ndim; int64_t d[3]; } sc;
    static const sc shapes[] = {{1, {100}}, {2, {7, 19}}, {3, {3, 70, 5}}, {2, {130, 300}}};
    uint64_t rs = t_seed() ^ 0x5eedu;
    size_t c;
    (void)unused;
    for (c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
        am_shape sh = t_shape(shapes[c].ndim, shapes[c].d);
        int64_t n = t_numel(&sh), i, j, bb;
        float *p = (float *)t_calloc(n * 4), *g = (float *)t_calloc(n * 4);
        am_tensor pt = t_tensor(p, AM_DTYPE_FLOAT32, &sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, &sh);
        am_hparams hp = am_hparams_default();
        am_workspace_view v;
        double u2 = 0.0;
        t_fix f;
        t_fix_init(&f, &sh, 1e-3);
        for (i = 0; i < n; i++) {
            t_store_random(p, AM_DTYPE_FLOAT32, i, &rs, -2, 0);
            t_store_random(g, AM_DTYPE_FLOAT32, i, &rs, -6, 0);
        }
        assert_int_equal(am_workspace_view_get(&sh, f.ws, f.ws_bytes, &v), AM_OK);
        assert_int_equal(am_update_stats(&pt, &gt, &f.st, &hp, f.ws, f.ws_bytes), AM_OK);
        assert_int_equal(*v.nonfinite, 0);
        if (sh.ndim >= 2) {
            int64_t B = sh.ndim == 3 ? sh.dims[0] : 1, R = sh.dims[sh.ndim - 2], C = sh.dims[sh.ndim - 1];
            double *rowm = calloc((size_t)(B * R), 8), *colm = calloc((size_t)(B * C), 8), rmean;
            assert_true(rowm && colm);
            for (bb = 0; bb < B; bb++) {
                for (i = 0; i < R; i++)
                    for (j = 0; j < C; j++) {
                        double x = g[(bb * R + i) * C + j];
                        rowm[bb * R + i] += x * x;
                        colm[bb * C + j] += x * x;
                    }
                for (i = 0; i < R; i++)
                    assert_true(fabs(v.row_sumsq[bb * R + i] - rowm[bb * R + i]) <= 1e-6 * rowm[bb * R + i]);
                for (j = 0; j < C; j++)
                    assert_true(fabs(v.col_sumsq[bb * C + j] - colm[bb * C + j]) <= 1e-6 * colm[bb * C + j]);
            }
            assert_int_equal(am_update_moments(&pt, &gt, &f.st, &hp, f.ws, f.ws_bytes), AM_OK);
            /* u2 from fresh state (row = col = 0): row = (1-b2)(mean + eps) */
            for (bb = 0; bb < B; bb++) {
                rmean = 0;
                for (i = 0; i < R; i++) rmean += (1 - hp.beta2) * (rowm[bb * R + i] / C + hp.eps);
                rmean /= R;
                for (i = 0; i < R; i++)
                    for (j = 0; j < C; j++) {
                        double x = g[(bb * R + i) * C + j];
                        double r = (1 - hp.beta2) * (rowm[bb * R + i] / C + hp.eps);
                        double cc = (1 - hp.beta2) * (colm[bb * C + j] / R + hp.eps);
                        double u = x / sqrt(r / rmean) / sqrt(cc);
                        u2 += u * u;
                    }
            }
            free(rowm);
            free(colm);
        } else {
            for (i = 0; i < n; i++) {
                double x = g[i], sq = (1 - hp.beta2) * x * x, u = x / sqrt(sq + hp.eps);
                u2 += u * u;
            }
            assert_true(fabs(*v.u2_sum - u2) <= 1e-6 * u2); /* stats fills it for ndim <= 1 */
            assert_int_equal(am_update_moments(&pt, &gt, &f.st, &hp, f.ws, f.ws_bytes), AM_OK);
        }
        if (!(fabs(*v.u2_sum - u2) <= 1e-6 * u2))
            fail_msg("%s: u2_sum %.9g, reference %.9g", t_shape_str(&sh), *v.u2_sum, u2);
        t_fix_free(&f);
        free(p);
        free(g);
    }
}

/* An engine that changes row_sumsq between stats and moments (it reduced
 * row sums across shards): the sum of u*u follows the changed sums, so
 * moments must not use the W sums stats built from the old ones (update.c,
 * u2_from_wsum); they would be off by 0.7% here. Fresh state. */
static void test_rows_changed_between_phases(void **unused) {
    const int64_t d[2] = {130, 300};
    am_shape sh = t_shape(2, d);
    int64_t n = t_numel(&sh), R = d[0], C = d[1], i, j;
    float *p = (float *)t_calloc(n * 4), *g = (float *)t_calloc(n * 4);
    am_tensor pt = t_tensor(p, AM_DTYPE_FLOAT32, &sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, &sh);
    am_hparams hp = am_hparams_default();
    am_workspace_view v;
    uint64_t rs = t_seed() ^ 0x7e57u;
    double u2 = 0.0, rmean = 0.0, *r = calloc((size_t)R, 8);
    t_fix f;
    (void)unused;
    assert_non_null(r);
    t_fix_init(&f, &sh, 1e-3);
    for (i = 0; i < n; i++) t_store_random(g, AM_DTYPE_FLOAT32, i, &rs, -6, 0);
    assert_int_equal(am_workspace_view_get(&sh, f.ws, f.ws_bytes, &v), AM_OK);
    assert_int_equal(am_update_stats(&pt, &gt, &f.st, &hp, f.ws, f.ws_bytes), AM_OK);
    v.row_sumsq[3] *= 16.0f;
    assert_int_equal(am_update_moments(&pt, &gt, &f.st, &hp, f.ws, f.ws_bytes), AM_OK);
    for (i = 0; i < R; i++) {
        r[i] = (1 - hp.beta2) * ((double)v.row_sumsq[i] / C + hp.eps);
        rmean += r[i] / R;
    }
    for (i = 0; i < R; i++)
        for (j = 0; j < C; j++) {
            double x = g[i * C + j], cc = (1 - hp.beta2) * ((double)v.col_sumsq[j] / R + hp.eps);
            double u = x / sqrt(r[i] / rmean) / sqrt(cc);
            u2 += u * u;
        }
    if (!(fabs(*v.u2_sum - u2) <= 1e-6 * u2))
        fail_msg("u2_sum %.9g, from the changed row sums %.9g", *v.u2_sum, u2);
    t_fix_free(&f);
    free(r);
    free(p);
    free(g);
}

/* k = 2 shards along dims[0]; the engine all-reduces u2_sum and divides by k
 * (header: the rms divides by the numel of the tensor passed). */
static void shard_case(const am_shape *sh) {
    enum { K = 2 };
    int64_t n = t_numel(sh), ns = n / K, i;
    am_shape ssh = *sh;
    float *p = (float *)t_calloc(n * 4), *ps = (float *)t_calloc(n * 4), *g = (float *)t_calloc(n * 4);
    am_hparams hp = am_hparams_default();
    am_rng_key key = {5, 0};
    uint64_t rs = t_seed() ^ 0x5a5au;
    t_fix full, part[K];
    int s, k;
    ssh.dims[0] /= K;
    t_fix_init(&full, sh, 1e-3);
    for (k = 0; k < K; k++) t_fix_init(&part[k], &ssh, 1e-3);
    for (i = 0; i < n; i++) t_store_random(p, AM_DTYPE_FLOAT32, i, &rs, -2, 1);
    memcpy(ps, p, (size_t)n * 4);
    hp.clip_threshold = 0.5; /* make the clip bind, so the reduced u2 matters */
    for (s = 0; s < 4; s++) {
        am_tensor pt = t_tensor(p, AM_DTYPE_FLOAT32, sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, sh);
        am_tensor sp[K], sg[K];
        double total = 0;
        for (i = 0; i < n; i++) t_store_random(g, AM_DTYPE_FLOAT32, i, &rs, -6, 1);
        assert_int_equal(am_update(&pt, &gt, &full.st, &hp, key, full.ws, full.ws_bytes, NULL), AM_OK);
        for (k = 0; k < K; k++) {
            sp[k] = t_tensor(ps + k * ns, AM_DTYPE_FLOAT32, &ssh);
            sg[k] = t_tensor(g + k * ns, AM_DTYPE_FLOAT32, &ssh);
            assert_int_equal(am_update_stats(&sp[k], &sg[k], &part[k].st, &hp, part[k].ws, part[k].ws_bytes), AM_OK);
            assert_int_equal(am_update_moments(&sp[k], &sg[k], &part[k].st, &hp, part[k].ws, part[k].ws_bytes), AM_OK);
        }
        for (k = 0; k < K; k++) {
            am_workspace_view v;
            assert_int_equal(am_workspace_view_get(&ssh, part[k].ws, part[k].ws_bytes, &v), AM_OK);
            total += *v.u2_sum;
        }
        for (k = 0; k < K; k++) {
            am_workspace_view v;
            assert_int_equal(am_workspace_view_get(&ssh, part[k].ws, part[k].ws_bytes, &v), AM_OK);
            *v.u2_sum = total / K;
            assert_int_equal(am_update_finish(&sp[k], &sg[k], &part[k].st, &hp, key, part[k].ws,
                                              part[k].ws_bytes, NULL), AM_OK);
        }
        for (i = 0; i < n; i++) {
            float ulp = nextafterf(fabsf(p[i]), INFINITY) - fabsf(p[i]);
            if (!(fabsf(p[i] - ps[i]) <= 2 * ulp))
                fail_msg("%s step %d: p[%lld] sharded %.9g, whole %.9g", t_shape_str(sh), s,
                         (long long)i, (double)ps[i], (double)p[i]);
        }
        for (k = 0; k < K; k++) {
            int64_t nl = part[k].sz.lr_count, np = part[k].sz.polarity_bytes;
            assert_memory_equal(part[k].st.lr, full.st.lr + k * nl, (size_t)nl * 4);
            assert_memory_equal(part[k].st.polarity, full.st.polarity + k * np, (size_t)np);
            if (sh->ndim >= 2) {
                int64_t nr = part[k].sz.row_count, nc = part[k].sz.col_count;
                assert_memory_equal(part[k].st.row, full.st.row + k * nr, (size_t)nr * 4);
                assert_memory_equal(part[k].st.col, full.st.col + k * nc, (size_t)nc * 4);
            } else {
                assert_memory_equal(part[k].st.sq, full.st.sq + k * ns, (size_t)ns * 4);
            }
        }
    }
    for (k = 0; k < K; k++) t_fix_free(&part[k]);
    t_fix_free(&full);
    free(p);
    free(ps);
    free(g);
}

/* The view of a zero-element parameter after am_update_stats: every sum is
 * over no element, 0, whatever the workspace held (a [5, 0] matrix has five
 * rows, a [3, 0, 4] weight twelve columns; their sums were left unwritten). */
static void test_zero_element_sums(void **unused) {
    const int64_t da[2] = {5, 0}, db[3] = {3, 0, 4};
    const am_shape shapes[2] = {t_shape(2, da), t_shape(3, db)};
    am_hparams hp = am_hparams_default();
    int c;
    int64_t i;
    (void)unused;
    for (c = 0; c < 2; c++) {
        t_fix f;
        am_tensor pt = t_tensor(NULL, AM_DTYPE_FLOAT32, &shapes[c]), gt = pt;
        am_workspace_view v;
        t_fix_init(&f, &shapes[c], 1e-3);
        memset(f.ws, 0x7f, f.ws_bytes);
        assert_int_equal(am_update_stats(&pt, &gt, &f.st, &hp, f.ws, f.ws_bytes), AM_OK);
        assert_int_equal(am_workspace_view_get(&shapes[c], f.ws, f.ws_bytes, &v), AM_OK);
        assert_true(f.sz.row_count + f.sz.col_count > 0);
        for (i = 0; i < f.sz.row_count; i++) assert_true(v.row_sumsq[i] == 0.0f);
        for (i = 0; i < f.sz.col_count; i++) assert_true(v.col_sumsq[i] == 0.0f);
        assert_true(*v.u2_sum == 0.0 && *v.nonfinite == 0);
        assert_int_equal(am_update_moments(&pt, &gt, &f.st, &hp, f.ws, f.ws_bytes), AM_OK);
        assert_int_equal(am_update_finish(&pt, &gt, &f.st, &hp, (am_rng_key){1, 0}, f.ws,
                                          f.ws_bytes, NULL), AM_OK);
        t_fix_free(&f);
    }
}

/* a and b two float32 sums of the same n squares (and eps) in different
 * orders: each within n * 2^-24 of the exact sum, relative. */
static int near_sums(float a, float b, int64_t n) {
    return fabs((double)a - (double)b) <= 2.0 * (double)n * 0x1p-24 * fabs((double)b);
}

/* One step of am_update_stats_shard's protocol over K shards (dims[0]
 * split as rows[]), the reductions done here as an engine's all-reduce
 * would: col_sumsq, nonfinite, row_moment_sum after stats, u2_sum after
 * moments, each shard given the sum of all. Every shard passes the whole
 * parameter's key (its noise is keyed by the whole's element index). Every phase runs on
 * every shard; stats must return want_stats[k] (NULL: AM_OK), moments and
 * finish want_later. */
static void shard_step(const am_tensor *sp, const am_tensor *sg, t_fix *part, int K,
                       const am_hparams *hp, int64_t dim0_total, const am_status *want_stats,
                       am_status want_later) {
    enum { KMAX = 4 };
    am_workspace_view v[KMAX];
    am_shard shard = {dim0_total, 0};
    const int64_t C = sp[0].shape.ndim == 2 ? sp[0].shape.dims[1] : 0;
    double u2 = 0.0, rms = 0.0;
    int64_t nonfinite = 0, j;
    float *cs = (float *)t_calloc(C * 4);
    int k;
    assert_true(K <= KMAX);
    for (k = 0; k < K; k++) {
        assert_int_equal(am_update_stats_shard(&sp[k], &sg[k], &part[k].st, hp, &shard,
                                               part[k].ws, part[k].ws_bytes),
                         want_stats ? want_stats[k] : AM_OK);
        shard.dim0_offset += sp[k].shape.dims[0]; /* the next shard's */
        assert_int_equal(am_workspace_view_get(&sp[k].shape, part[k].ws, part[k].ws_bytes, &v[k]),
                         AM_OK);
        for (j = 0; j < C; j++) cs[j] += v[k].col_sumsq[j];
        nonfinite += *v[k].nonfinite;
        rms += *v[k].row_moment_sum;
    }
    for (k = 0; k < K; k++) {
        if (C) memcpy(v[k].col_sumsq, cs, (size_t)C * 4);
        *v[k].nonfinite = nonfinite;
        *v[k].row_moment_sum = rms;
        assert_int_equal(am_update_moments(&sp[k], &sg[k], &part[k].st, hp, part[k].ws,
                                           part[k].ws_bytes),
                         want_later == AM_SKIPPED_NONFINITE_GRAD ? want_later : AM_OK);
        u2 += *v[k].u2_sum;
    }
    for (k = 0; k < K; k++) {
        const am_rng_key key = {5, 0}; /* the whole parameter's */
        *v[k].u2_sum = u2;
        assert_int_equal(am_update_finish(&sp[k], &sg[k], &part[k].st, hp, key, part[k].ws,
                                          part[k].ws_bytes, NULL), want_later);
    }
    free(cs);
}

/* A parameter split along dims[0] into shards of rows[0..K) (of any sizes,
 * empty ones too) through am_update_stats_shard, against am_update on the
 * whole: lrs, polarity and the shards' own moments identical (for ndim >= 3
 * and 1 all moments are the shards' own), a 2-D matrix's column moments
 * within float32 summation error (its column sums added in another order:
 * 6 ulp seen on 130 rows). Float32 parameters within 2 ulp plus, for a
 * 2-D matrix of R rows, R * 2^-23 of the step's change: am_update sums the
 * R row moments in float32, the shards in double (the row mean, so every
 * row factor; where the clip binds the error is one factor of all and
 * cancels: clip 0.5, else clip off). 16-bit parameters, rounded with the
 * same noise (keyed by the element's index in the whole), within one
 * 16-bit ulp, and in 1% of the elements at most (where the float32 value
 * differs across a rounding threshold; independent noise differs in about
 * half of those that round). An
 * empty shard keeps its state. */
static void dim0_shard_case(const am_shape *sh, const int64_t *rows, int K, am_dtype pdt,
                            int clip) {
    enum { KMAX = 4, STEPS = 4 };
    const size_t es = am_dtype_size(pdt);
    int64_t n = t_numel(sh), per = sh->dims[0] ? n / sh->dims[0] : 0, i, off;
    char *p = (char *)t_calloc(n * (int64_t)es), *ps = (char *)t_calloc(n * (int64_t)es);
    char *pprev = (char *)t_calloc(n * (int64_t)es);
    const double rel = sh->ndim == 2 ? (double)sh->dims[0] * 0x1p-23 : 0.0;
    int64_t ndiff;
    float *g = (float *)t_calloc(n * 4);
    am_shape ssh[KMAX];
    am_tensor sp[KMAX], sg[KMAX];
    am_hparams hp = am_hparams_default();
    uint64_t rs = t_seed() ^ 0x5a17u;
    t_fix full, part[KMAX];
    int s, k;
    assert_true(K <= KMAX);
    t_fix_init(&full, sh, 1e-3);
    for (k = 0, off = 0; k < K; off += rows[k] * per, k++) {
        ssh[k] = *sh;
        ssh[k].dims[0] = rows[k];
        t_fix_init(&part[k], &ssh[k], 1e-3);
        sp[k] = t_tensor(ps + off * (int64_t)es, pdt, &ssh[k]);
        sg[k] = t_tensor(g + off, AM_DTYPE_FLOAT32, &ssh[k]);
    }
    assert_true(off == n);
    for (i = 0; i < n; i++) t_store_random(p, pdt, i, &rs, -2, 1);
    memcpy(ps, p, (size_t)n * es);
    /* the clip binding, so the reduced u2 matters; or off */
    hp.clip_threshold = clip ? 0.5 : INFINITY;
    for (s = 0; s < STEPS; s++) {
        am_tensor pt = t_tensor(p, pdt, sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, sh);
        memcpy(pprev, p, (size_t)n * es);
        for (i = 0; i < n; i++) t_store_random(g, AM_DTYPE_FLOAT32, i, &rs, -6, 1);
        /* an all-zero row (or element) now and then */
        if (s % 2 && n) memset(g + (n / per / 2) * per, 0, (size_t)per * 4);
        assert_int_equal(am_update(&pt, &gt, &full.st, &hp, (am_rng_key){5, 0}, full.ws,
                                   full.ws_bytes, NULL), AM_OK);
        shard_step(sp, sg, part, K, &hp, sh->dims[0], NULL, AM_OK);
        ndiff = 0;
        for (i = 0; i < n; i++) {
            const double a = t_load(p, pdt, i), b = t_load(ps, pdt, i);
            const double d = fabs(a - t_load(pprev, pdt, i));
            const double ulp = pdt == AM_DTYPE_FLOAT32
                                   ? 2.0 * (double)(nextafterf(fabsf((float)a), INFINITY) -
                                                    fabsf((float)a)) + rel * d
                                   : ldexp(1.0, ilogb(fmax(fabs(a), fabs(b))) -
                                                              (pdt == AM_DTYPE_BFLOAT16 ? 7 : 10));
            if (!(fabs(a - b) <= ulp))
                fail_msg("%s dtype %d step %d: p[%lld] sharded %.9g, whole %.9g", t_shape_str(sh),
                         (int)pdt, s, (long long)i, b, a);
            ndiff += a != b;
        }
        if (pdt != AM_DTYPE_FLOAT32 && ndiff > n / 100)
            fail_msg("%s dtype %d step %d: %lld of %lld 16-bit elements differ (the noise is "
                     "not the whole's?)", t_shape_str(sh), (int)pdt, s, (long long)ndiff,
                     (long long)n);
        for (k = 0, off = 0; k < K; off += rows[k], k++) {
            const t_fix *f = &part[k];
            const int64_t nr = f->sz.row_count, nc = f->sz.col_count;
            assert_int_equal(f->st.step, rows[k] ? s + 1 : 0);
            assert_memory_equal(f->st.lr, full.st.lr + off, (size_t)f->sz.lr_count * 4);
            if (sh->ndim >= 2) {
                const int64_t prb = full.sz.polarity_bytes / sh->dims[0];
                assert_memory_equal(f->st.polarity, full.st.polarity + off * prb,
                                    (size_t)f->sz.polarity_bytes);
            } else {
                for (i = 0; i < rows[k]; i++)
                    assert_int_equal((f->st.polarity[i / 8] >> (i % 8)) & 1,
                                     (full.st.polarity[(off + i) / 8] >> ((off + i) % 8)) & 1);
            }
            if (sh->ndim == 1) {
                assert_memory_equal(f->st.sq, full.st.sq + off, (size_t)rows[k] * 4);
            } else if (sh->ndim == 2) {
                assert_memory_equal(f->st.row, full.st.row + off, (size_t)nr * 4);
                for (i = 0; i < nc; i++)
                    if (rows[k] ? !near_sums(f->st.col[i], full.st.col[i], sh->dims[0])
                                : f->st.col[i] != 0.0f)
                        fail_msg("%s step %d shard %d: col[%lld] %.9g, whole %.9g", t_shape_str(sh),
                                 s, k, (long long)i, (double)f->st.col[i], (double)full.st.col[i]);
            } else { /* whole matrices: every moment the shard's own */
                assert_memory_equal(f->st.row, full.st.row + off * (full.sz.row_count / sh->dims[0]),
                                    (size_t)nr * 4);
                assert_memory_equal(f->st.col, full.st.col + off * (full.sz.col_count / sh->dims[0]),
                                    (size_t)nc * 4);
            }
        }
    }
    for (k = 0; k < K; k++) t_fix_free(&part[k]);
    t_fix_free(&full);
    free(p);
    free(ps);
    free(pprev);
    free(g);
}

static void test_dim0_shards(void **unused) {
    typedef struct {
        int32_t ndim;
        int64_t d[4];
        int K;
        int64_t rows[4];
        am_dtype pdt;
        int clip;
    } sc;
    static const sc cases[] = {
        {2, {130, 300}, 2, {50, 80}, AM_DTYPE_FLOAT32, 1},      /* the W sums */
        {2, {130, 300}, 1, {130}, AM_DTYPE_FLOAT32, 1},         /* one shard of all */
        {2, {7, 20000}, 3, {3, 0, 4}, AM_DTYPE_FLOAT32, 1},     /* rows over 16384, an empty shard */
        {2, {200, 48}, 3, {1, 120, 79}, AM_DTYPE_FLOAT32, 1},
        {3, {5, 9, 7}, 2, {2, 3}, AM_DTYPE_FLOAT32, 1},         /* whole matrices */
        {4, {6, 2, 3, 5}, 2, {1, 5}, AM_DTYPE_FLOAT32, 1},
        {1, {100}, 2, {37, 63}, AM_DTYPE_FLOAT32, 1},           /* element ranges */
        {2, {130, 300}, 2, {50, 80}, AM_DTYPE_BFLOAT16, 1},
        {2, {64, 40}, 2, {30, 34}, AM_DTYPE_FLOAT16, 1},
        /* the clip off: the row mean's error shows (a review measured
         * 20-400 ulp on 1e5-1e6 rows against am_update's float32 sum) */
        {2, {130, 300}, 2, {50, 80}, AM_DTYPE_FLOAT32, 0},
        {2, {20000, 4}, 2, {7000, 13000}, AM_DTYPE_FLOAT32, 0}, /* many rows */
        {2, {20000, 4}, 2, {7000, 13000}, AM_DTYPE_FLOAT32, 1},
        {1, {100}, 2, {37, 63}, AM_DTYPE_FLOAT32, 0},
        /* bounds cutting the 16384-element tiles at offsets off the 8-element
         * noise quads: the clip scale's last bit may differ (the header) */
        {1, {100003}, 4, {12345, 3, 50001, 37654}, AM_DTYPE_FLOAT32, 1},
        {1, {100003}, 4, {12345, 3, 50001, 37654}, AM_DTYPE_BFLOAT16, 1},
        {1, {100003}, 4, {12345, 3, 50001, 37654}, AM_DTYPE_FLOAT16, 0},
    };
    size_t c;
    (void)unused;
    for (c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const am_shape sh = t_shape(cases[c].ndim, cases[c].d);
        dim0_shard_case(&sh, cases[c].rows, cases[c].K, cases[c].pdt, cases[c].clip);
    }
}

/* Resharding a 2-D parameter: two steps on shards {10, 27}, their states
 * gathered into the whole's (lr, polarity bytes and row moments end to
 * end, col and step from a non-empty shard: the header's rule), split
 * again as {20, 0, 17} for two more steps: lrs and polarity as am_update's
 * on the whole throughout, float32 parameters within 2 ulp. */
static void test_dim0_reshard(void **unused) {
    const int64_t d[2] = {37, 50}, split[2][3] = {{10, 27, 0}, {20, 0, 17}};
    const int K[2] = {2, 3}, C = 50;
    am_shape sh = t_shape(2, d);
    const int64_t n = t_numel(&sh), prb = (C + 7) / 8;
    float *p = (float *)t_calloc(n * 4), *ps = (float *)t_calloc(n * 4);
    float *g = (float *)t_calloc(n * 4);
    am_hparams hp = am_hparams_default();
    uint64_t rs = t_seed() ^ 0x2e5au;
    t_fix full, whole; /* am_update's; the gathered state */
    int phase, s, k;
    int64_t i;
    (void)unused;
    t_fix_init(&full, &sh, 1e-3);
    t_fix_init(&whole, &sh, 1e-3);
    for (i = 0; i < n; i++) t_store_random(p, AM_DTYPE_FLOAT32, i, &rs, -2, 1);
    memcpy(ps, p, (size_t)n * 4);
    hp.clip_threshold = 0.5;
    for (phase = 0; phase < 2; phase++) {
        t_fix part[3];
        am_shape ssh[3];
        am_tensor sp[3], sg[3];
        int64_t off;
        for (k = 0, off = 0; k < K[phase]; off += split[phase][k], k++) {
            const int64_t r = split[phase][k];
            ssh[k] = sh;
            ssh[k].dims[0] = r;
            t_fix_init(&part[k], &ssh[k], 1e-3);
            sp[k] = t_tensor(ps + off * C, AM_DTYPE_FLOAT32, &ssh[k]);
            sg[k] = t_tensor(g + off * C, AM_DTYPE_FLOAT32, &ssh[k]);
            /* split the gathered state (phase 1; phase 0 starts fresh) */
            if (phase) {
                memcpy(part[k].st.lr, whole.st.lr + off, (size_t)r * 4);
                memcpy(part[k].st.row, whole.st.row + off, (size_t)r * 4);
                memcpy(part[k].st.polarity, whole.st.polarity + off * prb, (size_t)(r * prb));
                memcpy(part[k].st.col, whole.st.col, (size_t)C * 4);
                part[k].st.step = whole.st.step;
            }
        }
        for (s = 0; s < 2; s++) {
            am_tensor pt = t_tensor(p, AM_DTYPE_FLOAT32, &sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, &sh);
            for (i = 0; i < n; i++) t_store_random(g, AM_DTYPE_FLOAT32, i, &rs, -6, 1);
            assert_int_equal(am_update(&pt, &gt, &full.st, &hp, (am_rng_key){5, 0}, full.ws,
                                       full.ws_bytes, NULL), AM_OK);
            shard_step(sp, sg, part, K[phase], &hp, d[0], NULL, AM_OK);
            for (i = 0; i < n; i++) {
                const float ulp = nextafterf(fabsf(p[i]), INFINITY) - fabsf(p[i]);
                if (!(fabsf(p[i] - ps[i]) <= 2.0f * ulp))
                    fail_msg("phase %d step %d: p[%lld] sharded %.9g, whole %.9g", phase, s,
                             (long long)i, (double)ps[i], (double)p[i]);
            }
        }
        /* gather: the whole parameter's state from the shards' */
        for (k = 0, off = 0; k < K[phase]; off += split[phase][k], k++) {
            const int64_t r = split[phase][k];
            memcpy(whole.st.lr + off, part[k].st.lr, (size_t)r * 4);
            memcpy(whole.st.row + off, part[k].st.row, (size_t)r * 4);
            memcpy(whole.st.polarity + off * prb, part[k].st.polarity, (size_t)(r * prb));
            if (r) {
                memcpy(whole.st.col, part[k].st.col, (size_t)C * 4);
                whole.st.step = part[k].st.step;
            }
        }
        assert_memory_equal(whole.st.lr, full.st.lr, (size_t)d[0] * 4);
        assert_memory_equal(whole.st.polarity, full.st.polarity, (size_t)full.sz.polarity_bytes);
        assert_memory_equal(whole.st.row, full.st.row, (size_t)d[0] * 4);
        assert_int_equal(whole.st.step, full.st.step);
        for (k = 0; k < K[phase]; k++) t_fix_free(&part[k]);
    }
    t_fix_free(&full);
    t_fix_free(&whole);
    free(p);
    free(ps);
    free(g);
}

/* A gradient non-finite in one shard: that shard's stats reports it, and
 * once the count is reduced every shard's moments and finish do (finish
 * returned a phase-order error, AM_ERR_INVALID_ARGUMENT, found by a review,
 * twenty-sixth session); an update whose sum of u^2 overflows is skipped
 * by every shard, an empty one too (it returned AM_OK). Nothing changes. */
static void test_dim0_shard_skips(void **unused) {
    const int64_t d[2] = {4, 3}, half[2] = {2, 2}, all[2] = {4, 0};
    const am_status nan_stats[2] = {AM_SKIPPED_NONFINITE_GRAD, AM_OK};
    am_shape sh = t_shape(2, d);
    am_hparams hp = am_hparams_default();
    float p[12], p0[12], g[12];
    int c, k, i;
    (void)unused;
    for (c = 0; c < 3; c++) {
        const int64_t *rows = c == 1 ? all : half;
        am_shape ssh[2];
        am_tensor sp[2], sg[2];
        t_fix part[2];
        t_snap snap[2];
        for (i = 0; i < 12; i++) {
            p[i] = p0[i] = 0.1f * (float)(i + 1);
            g[i] = 0.01f * (float)(i % 5) - 0.02f;
        }
        if (c == 0) g[1] = NAN;     /* in shard 0 */
        else if (c == 1) g[7] = 3e19f; /* g*g overflows float32 */
        else {
            /* The sum of the 4 row moments (each about eps) overflows the
             * float32 sum am_update takes, which skips; the shards summed
             * them in double and applied the update (a review, thirty-
             * seventh session) */
            t_fix whole;
            am_tensor pt = t_tensor(p, AM_DTYPE_FLOAT32, &sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, &sh);
            hp.eps = 1.5e38f;
            hp.beta2 = 0.0;
            t_fix_init(&whole, &sh, 1e-3);
            assert_int_equal(am_update(&pt, &gt, &whole.st, &hp, (am_rng_key){5, 0}, whole.ws,
                                       whole.ws_bytes, NULL),
                             AM_SKIPPED_NONFINITE_UPDATE);
            t_fix_free(&whole);
        }
        for (k = 0; k < 2; k++) {
            const int64_t off = k ? rows[0] * 3 : 0;
            ssh[k] = sh;
            ssh[k].dims[0] = rows[k];
            t_fix_init(&part[k], &ssh[k], 1e-3);
            sp[k] = t_tensor(p + off, AM_DTYPE_FLOAT32, &ssh[k]);
            sg[k] = t_tensor(g + off, AM_DTYPE_FLOAT32, &ssh[k]);
            t_snap_take(&snap[k], &part[k], NULL, 0, NULL, 0);
        }
        if (c == 0)
            shard_step(sp, sg, part, 2, &hp, 4, nan_stats, AM_SKIPPED_NONFINITE_GRAD);
        else
            shard_step(sp, sg, part, 2, &hp, 4, NULL, AM_SKIPPED_NONFINITE_UPDATE);
        assert_memory_equal(p, p0, sizeof p);
        for (k = 0; k < 2; k++) {
            t_snap_check(&snap[k], &part[k], NULL, NULL);
            t_snap_free(&snap[k]);
            t_fix_free(&part[k]);
        }
    }
}

static void test_sharded_protocol(void **unused) {
    const int64_t d1[1] = {64}, d3[3] = {4, 9, 7}, d4[4] = {6, 2, 3, 5};
    const int64_t d3w[3] = {2, 70, 33}; /* tiles with the W sums (am_wsum) */
    am_shape s1 = t_shape(1, d1), s3 = t_shape(3, d3), s4 = t_shape(4, d4);
    am_shape s3w = t_shape(3, d3w);
    (void)unused;
    shard_case(&s1);
    shard_case(&s3);
    shard_case(&s4);
    shard_case(&s3w);
}

/* Each lr-row's bump is am_lr_bump of its agreement, exactly, whether
 * finish computes the factor per lr-row or takes it from its table of every
 * match count (short lr-rows, many of them: AM_BUMP_TABLE_MAX, update.c).
 * The agreement comes from the polarity bits before and after (SPEC 3.3). */
static void test_lr_bump_table(void **unused) {
    typedef struct { int32_t ndim; int64_t d[4]; } sc;
    static const sc shapes[] = {{2, {64, 8}},   {2, {40, 16}},  {2, {600, 256}},
                                {3, {300, 3, 2}}, {2, {8, 300}}, {2, {10, 257}},
                                {2, {4, 1}},    {2, {1024, 3}}, {2, {2048, 16}},
                                {2, {1500, 24}}, {2, {3000, 3}}};
    uint64_t rs = t_seed() ^ 0x7ab1eu;
    size_t c;
    (void)unused;
    for (c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
        am_shape sh = t_shape(shapes[c].ndim, shapes[c].d);
        const int64_t n = t_numel(&sh), rows = sh.dims[0], m = n / rows, rb = (m + 7) / 8;
        float *p = (float *)t_calloc(n * 4), *g = (float *)t_calloc(n * 4), *lr0;
        uint8_t *pol0;
        am_tensor pt = t_tensor(p, AM_DTYPE_FLOAT32, &sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, &sh);
        am_hparams hp = am_hparams_default();
        am_consts k;
        am_rng_key key = {77, 1};
        t_fix f;
        int64_t i, r, q;
        hp.lr_bump_rate = 0.37;
        k = am_consts_from(&hp);
        t_fix_init(&f, &sh, 1e-4);
        assert_int_equal(f.sz.polarity_bytes, rows * rb);
        for (i = 0; i < n; i++) t_store_random(p, AM_DTYPE_FLOAT32, i, &rs, -3, 1);
        for (i = 0; i < n; i++) t_store_random(g, AM_DTYPE_FLOAT32, i, &rs, -5, 1);
        assert_int_equal(am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, NULL), AM_OK);
        lr0 = (float *)t_calloc(rows * 4);
        pol0 = (uint8_t *)t_calloc(rows * rb);
        memcpy(lr0, f.st.lr, (size_t)rows * 4);
        memcpy(pol0, f.st.polarity, (size_t)(rows * rb));
        /* signs mostly kept in the first rows, mostly flipped in the last:
         * agreements over the whole range */
        for (i = 0; i < n; i++) {
            t_store_random(g, AM_DTYPE_FLOAT32, i, &rs, -5, 1);
            if ((int64_t)(t_next(&rs) % (uint64_t)rows) < i / m) g[i] = -g[i];
        }
        assert_int_equal(am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, NULL), AM_OK);
        for (r = 0; r < rows; r++) {
            int64_t matches = 0;
            float want;
            for (q = 0; q < m; q++) {
                const int64_t byte = r * rb + q / 8, bit = q % 8;
                matches += ((pol0[byte] >> bit) & 1) == ((f.st.polarity[byte] >> bit) & 1);
            }
            want = am_lr_bump(lr0[r], (float)matches / (float)m, &k);
            assert_memory_equal(&f.st.lr[r], &want, 4);
        }
        free(p); free(g); free(lr0); free(pol0);
        t_fix_free(&f);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_phases_equal_update),
        cmocka_unit_test(test_phases_sum_groups),
        cmocka_unit_test(test_view_contents),
        cmocka_unit_test(test_sharded_protocol),
        cmocka_unit_test(test_dim0_shards),
        cmocka_unit_test(test_dim0_shard_skips),
        cmocka_unit_test(test_dim0_reshard),
        cmocka_unit_test(test_zero_element_sums),
        cmocka_unit_test(test_rows_changed_between_phases),
        cmocka_unit_test(test_lr_bump_table),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
