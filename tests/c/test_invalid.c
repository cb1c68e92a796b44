/*
 * test_invalid.c — every invalid argument of every public function returns
 * its documented status, logs a message, and leaves every caller buffer
 * byte-for-byte as it was (the workspace and the report excepted, as the
 * header allows). Also the small pure functions: status strings, dtype
 * size/name, version.
 */
#include <limits.h>

#include "test_common.h"

T_ERROR_LOG_FIXTURE()

/* ------------------------------------------------------ hparams -------- */

static void test_hparams(void **unused) {
    static const struct { size_t off; const char *name; double bad[7]; int nbad; } cs[] = {
        {offsetof(am_hparams, lr), "lr", {0.0, -1e-6, NAN, INFINITY, -INFINITY, 1e-50, 1e39}, 7},
        {offsetof(am_hparams, min_lr), "min_lr", {-1e-9, NAN, 0.5, INFINITY, 0, 0, 0}, 4},
        {offsetof(am_hparams, max_lr), "max_lr", {NAN, INFINITY, 1e-9, -1.0, 1e39, 0, 0}, 5},
        /* beyond float32's range (the kernels' precision): rounds to inf */
        {offsetof(am_hparams, lr_bump_rate), "lr_bump_rate", {-0.1, NAN, INFINITY, 1e39, 0, 0, 0}, 4},
        {offsetof(am_hparams, beta2), "beta2", {-0.1, 1.0, 1.5, NAN, INFINITY, 0, 0}, 5},
        {offsetof(am_hparams, eps), "eps", {-1e-30, NAN, INFINITY, 1e39, 0, 0, 0}, 4},
        {offsetof(am_hparams, clip_threshold), "clip_threshold", {0.0, -1.0, NAN, -INFINITY, 0, 0, 0}, 4},
        {offsetof(am_hparams, weight_decay), "weight_decay", {-0.1, NAN, INFINITY, 1e39, 0, 0, 0}, 4},
    };
    size_t c;
    int b;
    am_hparams hp = am_hparams_default(), ok;
    (void)unused;
    /* the documented defaults */
    assert_true(hp.lr == 1e-6 && hp.min_lr == 1e-8 && hp.max_lr == 1e-2 &&
                hp.lr_bump_rate == 0.1 && hp.beta2 == 0.999 && hp.eps == 1e-30 &&
                hp.clip_threshold == 1.0 && hp.weight_decay == 0.0);
    assert_int_equal(am_hparams_validate(&hp), AM_OK);
    EXPECT_ERR(am_hparams_validate(NULL), AM_ERR_NULL_POINTER);
    /* the edges of the valid ranges */
    ok = hp;
    ok.min_lr = 0; ok.lr_bump_rate = 0; ok.beta2 = 0; ok.eps = 0; ok.weight_decay = 0;
    assert_int_equal(am_hparams_validate(&ok), AM_OK);
    ok.min_lr = ok.max_lr; ok.lr = 1.0; /* > 1e-3 is valid here */
    assert_int_equal(am_hparams_validate(&ok), AM_OK);
    ok.clip_threshold = INFINITY; /* SPEC: > 0; +inf disables the clip */
    assert_int_equal(am_hparams_validate(&ok), AM_OK);
    ok.lr = 1.5e-45; /* float32's smallest subnormal, 1.4e-45, after rounding */
    assert_int_equal(am_hparams_validate(&ok), AM_OK);
    /* float32's largest finite value is valid for every "finite" field */
    ok.max_lr = ok.lr_bump_rate = ok.eps = ok.weight_decay = 3.4028234e38;
    assert_int_equal(am_hparams_validate(&ok), AM_OK);
    ok.clip_threshold = 1e39; /* rounds to +inf: disables the clip, as +inf */
    assert_int_equal(am_hparams_validate(&ok), AM_OK);
    for (c = 0; c < sizeof cs / sizeof cs[0]; c++)
        for (b = 0; b < cs[c].nbad; b++) {
            am_hparams bad = hp;
            memcpy((char *)&bad + cs[c].off, &cs[c].bad[b], sizeof(double));
            EXPECT_ERR(am_hparams_validate(&bad), AM_ERR_INVALID_HPARAM);
            /* the message names the field */
            if (!strstr(g_log.msg, cs[c].name))
                fail_msg("%s = %g: message '%s' does not name it", cs[c].name, cs[c].bad[b],
                         g_log.msg);
        }
}

/* The largest valid lr_bump_rate (finite in float32): the lrs stay in
 * [min_lr, max_lr] at every agreement (an agreement of exactly one half
 * multiplies the rate by 0: with a rate beyond float32's range, accepted
 * until the twenty-second session, that was 0 * inf = NaN), and the
 * parameters finite. (A max_lr near float32's limit is valid too, but its
 * updates overflow: the header says so at am_hparams.) */
static void test_extreme_valid_hparams(void **unused) {
    const int64_t d[2] = {4, 8};
    am_shape sh = t_shape(2, d);
    t_fix f;
    float p[32], g[32];
    am_tensor pt = t_tensor(p, AM_DTYPE_FLOAT32, &sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, &sh);
    am_hparams hp = am_hparams_default();
    int i, step;
    (void)unused;
    hp.lr_bump_rate = 3.4028234e38;
    t_fix_init(&f, &sh, 1e-3);
    for (i = 0; i < 32; i++) p[i] = 0.1f * (float)(i % 7);
    for (step = 0; step < 4; step++) {
        /* row 0 agrees exactly half the time at step 1 (4 of its 8 signs
         * flip), the others all or never */
        for (i = 0; i < 32; i++) {
            const int r = i / 8, j = i % 8;
            const float sgn = r == 0 ? (step % 2 && j < 4 ? -1.0f : 1.0f)
                                     : (r == 1 ? 1.0f : (step % 2 ? -1.0f : 1.0f));
            g[i] = sgn * 0.01f * (float)(1 + j);
        }
        assert_int_equal(am_update(&pt, &gt, &f.st, &hp, (am_rng_key){1, 0}, f.ws, f.ws_bytes,
                                   NULL),
                         AM_OK);
        for (i = 0; i < 4; i++)
            if (!(f.st.lr[i] >= (float)hp.min_lr && f.st.lr[i] <= (float)hp.max_lr))
                fail_msg("step %d: lr[%d] = %g", step, i, (double)f.st.lr[i]);
        for (i = 0; i < 32; i++)
            if (!isfinite(p[i])) fail_msg("step %d: p[%d] = %g", step, i, (double)p[i]);
    }
    t_fix_free(&f);
}

/* min_lr = 0 and lr_bump_rate 200, both valid: a disagreeing update's
 * exp(-200) takes the lr to 0, the next agreeing one's exp(200) is inf, and
 * 0 * inf = NaN passed the clamp: lr and parameter NaN for good under AM_OK
 * (found by a review, twenty-fifth session). The lr stays at min_lr (0),
 * the parameter finite; a (3, 8) matrix (lr per row) and a 1-D (21). */
static void test_lr_bump_from_zero(void **unused) {
    const int64_t dm[2] = {3, 8}, dv[1] = {21};
    am_shape shapes[2];
    int c;
    (void)unused;
    shapes[0] = t_shape(2, dm);
    shapes[1] = t_shape(1, dv);
    for (c = 0; c < 2; c++) {
        t_fix f;
        float p[24], g[24];
        const int64_t n = c ? 21 : 24, nlr = c ? 21 : 3;
        am_tensor pt = t_tensor(p, AM_DTYPE_FLOAT32, &shapes[c]);
        am_tensor gt = t_tensor(g, AM_DTYPE_FLOAT32, &shapes[c]);
        am_hparams hp = am_hparams_default();
        int i, step;
        hp.min_lr = 0;
        hp.lr_bump_rate = 200;
        t_fix_init(&f, &shapes[c], 1e-3);
        for (i = 0; i < n; i++) p[i] = 0.5f;
        for (step = 0; step < 4; step++) {
            /* signs: +, -, -, - : step 1 disagrees (lr -> 0), 2 and 3 agree */
            for (i = 0; i < n; i++) g[i] = (step ? -0.01f : 0.01f) * (float)(1 + i % 4);
            assert_int_equal(am_update(&pt, &gt, &f.st, &hp, (am_rng_key){1, 0}, f.ws,
                                       f.ws_bytes, NULL),
                             AM_OK);
            for (i = 0; i < nlr; i++)
                if (!(f.st.lr[i] == (step == 0 ? 1e-3f : 0.0f)))
                    fail_msg("shape %d step %d: lr[%d] = %g", c, step, i, (double)f.st.lr[i]);
            for (i = 0; i < n; i++)
                if (!isfinite(p[i])) fail_msg("shape %d step %d: p[%d] = %g", c, step, i, (double)p[i]);
        }
        t_fix_free(&f);
    }
}

/* ------------------------------------------------------- shapes -------- */

/* Bad shapes, shared by every function that takes one. */
static int bad_shape(int i, am_shape *s) {
    memset(s, 0, sizeof *s);
    switch (i) {
    case 0: s->ndim = -1; return 1;
    case 1: s->ndim = 9; return 1;
    case 2: s->ndim = 1; s->dims[0] = -1; return 1;
    case 3: s->ndim = 3; s->dims[0] = 2; s->dims[1] = -5; s->dims[2] = 3; return 1;
    case 4: s->ndim = 2; s->dims[0] = INT64_MAX / 2; s->dims[1] = 4; return 1;
    case 5: s->ndim = 4; s->dims[0] = s->dims[1] = s->dims[2] = s->dims[3] = 1ll << 20; return 1;
    case 6: s->ndim = 1; s->dims[0] = INT64_MAX; return 1;
    default: return 0;
    }
}

static void test_state_get_sizes(void **unused) {
    am_shape s;
    am_state_sizes out, pattern;
    int i;
    (void)unused;
    memset(&pattern, 0x5A, sizeof pattern);
    out = pattern;
    EXPECT_ERR(am_state_get_sizes(NULL, &out), AM_ERR_NULL_POINTER);
    s = t_shape(0, NULL);
    EXPECT_ERR(am_state_get_sizes(&s, NULL), AM_ERR_NULL_POINTER);
    for (i = 0; bad_shape(i, &s); i++) {
        EXPECT_ERR(am_state_get_sizes(&s, &out), AM_ERR_INVALID_SHAPE);
        assert_memory_equal(&out, &pattern, sizeof out);
    }
    /* valid: sizes as documented */
    {
        const int64_t d[4] = {10, 5, 4, 3};
        s = t_shape(4, d);
        assert_int_equal(am_state_get_sizes(&s, &out), AM_OK);
        assert_int_equal(out.numel, 600);
        assert_int_equal(out.lr_count, 10);
        assert_int_equal(out.polarity_bytes, 10 * 8); /* ceil(60/8) per lr-row */
        assert_int_equal(out.row_count, 10 * 5 * 4);
        assert_int_equal(out.col_count, 10 * 5 * 3);
        assert_int_equal(out.sq_count, 0);
        assert_true(out.workspace_bytes > 0);
        s = t_shape(1, d);
        assert_int_equal(am_state_get_sizes(&s, &out), AM_OK);
        assert_true(out.numel == 10 && out.lr_count == 10 && out.polarity_bytes == 2 &&
                    out.row_count == 0 && out.col_count == 0 && out.sq_count == 10);
        s = t_shape(0, d);
        assert_int_equal(am_state_get_sizes(&s, &out), AM_OK);
        assert_true(out.numel == 1 && out.lr_count == 1 && out.polarity_bytes == 1 &&
                    out.sq_count == 1);
        s.ndim = 8;
        for (i = 0; i < 8; i++) s.dims[i] = 2;
        assert_int_equal(am_state_get_sizes(&s, &out), AM_OK);
        assert_int_equal(out.numel, 256);
    }
}

static void test_state_init(void **unused) {
    const int64_t d[2] = {4, 5};
    am_shape sh = t_shape(2, d), bs;
    t_fix f;
    t_snap snap;
    am_state st;
    static const double bad_lr[] = {0.0, -1.0, NAN, INFINITY, 1e-50};
    size_t i;
    int b;
    (void)unused;
    t_fix_init(&f, &sh, 0.25);
    f.st.polarity[0] = 0x5; /* make the state non-trivial */
    f.st.row[1] = 3.0f;
    f.st.step = 9;
    t_snap_take(&snap, &f, NULL, 0, NULL, 0);
    EXPECT_ERR(am_state_init(&sh, NULL, 1e-3), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_state_init(NULL, &f.st, 1e-3), AM_ERR_NULL_POINTER);
    for (b = 0; bad_shape(b, &bs); b++) EXPECT_ERR(am_state_init(&bs, &f.st, 1e-3), AM_ERR_INVALID_SHAPE);
    for (i = 0; i < sizeof bad_lr / sizeof bad_lr[0]; i++)
        EXPECT_ERR(am_state_init(&sh, &f.st, bad_lr[i]), AM_ERR_INVALID_HPARAM);
    for (b = 0; b < 4; b++) {
        st = f.st;
        if (b == 0) st.lr = NULL;
        if (b == 1) st.polarity = NULL;
        if (b == 2) st.row = NULL;
        if (b == 3) st.col = NULL;
        EXPECT_ERR(am_state_init(&sh, &st, 1e-3), AM_ERR_NULL_POINTER);
    }
    /* a float array not aligned to 4 bytes: refused, nothing written (the
     * arrays are long enough for the shifted view) */
    for (b = 0; b < 3; b++) {
        float **fp[3];
        st = f.st;
        fp[0] = &st.lr; fp[1] = &st.row; fp[2] = &st.col;
        *fp[b] = (float *)((char *)*fp[b] + 2);
        EXPECT_ERR(am_state_init(&sh, &st, 1e-3), AM_ERR_INVALID_ARGUMENT);
        if (!strstr(g_log.msg, "not aligned")) fail_msg("message '%s'", g_log.msg);
    }
    t_snap_check(&snap, &f, NULL, NULL);
    t_snap_free(&snap);
    t_fix_free(&f);
    /* unfactored: sq is required */
    {
        int64_t n = 7;
        am_shape s1 = t_shape(1, &n);
        t_fix_init(&f, &s1, 1e-3);
        st = f.st;
        st.sq = NULL;
        EXPECT_ERR(am_state_init(&s1, &st, 1e-3), AM_ERR_NULL_POINTER);
        /* a valid init sets everything as documented */
        f.st.sq[3] = 5.0f;
        f.st.polarity[0] = 0xff;
        f.st.step = 3;
        assert_int_equal(am_state_init(&s1, &f.st, 2e-4), AM_OK);
        for (i = 0; i < 7; i++) assert_true(f.st.lr[i] == 2e-4f && f.st.sq[i] == 0.0f);
        assert_int_equal(f.st.polarity[0], 0);
        assert_int_equal(f.st.step, 0);
        t_fix_free(&f);
    }
}

/* --------------------------------------------------- kernel layer ------ */

/* which: 0 am_update, 1 am_update_stats, 2 am_update_moments,
 * 3 am_update_finish, 4 am_update_stats_shard (a shard of a parameter
 * twice as long along dims[0], valid where the shape is). */
static am_status call_phase(int which, const am_tensor *p, const am_tensor *g,
                            am_state *st, const am_hparams *hp, void *ws, size_t wsb,
                            am_report *rep) {
    am_rng_key key = {42, 0};
    am_shard shard = {0, 0};
    if (p && p->shape.ndim > 0) /* (bad shapes hold huge dims) */
        shard.dim0_total = p->shape.dims[0] <= INT64_MAX / 2 ? 2 * p->shape.dims[0] : INT64_MAX;
    switch (which) {
    case 0: return am_update(p, g, st, hp, key, ws, wsb, rep);
    case 1: return am_update_stats(p, g, st, hp, ws, wsb);
    case 2: return am_update_moments(p, g, st, hp, ws, wsb);
    case 4: return am_update_stats_shard(p, g, st, hp, &shard, ws, wsb);
    default: return am_update_finish(p, g, st, hp, key, ws, wsb, rep);
    }
}

/* am_update_stats_shard's own argument errors, with nothing modified. */
static void stats_shard_invalid(const am_shape *sh) {
    int64_t n = t_numel(sh), i;
    float *p = (float *)t_calloc(n * 4), *g = (float *)t_calloc(n * 4);
    am_hparams hp = am_hparams_default();
    am_tensor pt = t_tensor(p, AM_DTYPE_FLOAT32, sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, sh);
    am_shard shard = {0, 0};
    t_fix f;
    t_snap snap;
    t_fix_init(&f, sh, 1e-3);
    for (i = 0; i < n; i++) g[i] = 0.03f * (float)(i % 7) - 0.1f;
    t_snap_take(&snap, &f, p, (size_t)n * 4, g, (size_t)n * 4);
    EXPECT_ERR(am_update_stats_shard(&pt, &gt, &f.st, &hp, NULL, f.ws, f.ws_bytes),
               AM_ERR_NULL_POINTER);
    if (sh->ndim == 0) {
        shard.dim0_total = 1;
        EXPECT_ERR(am_update_stats_shard(&pt, &gt, &f.st, &hp, &shard, f.ws, f.ws_bytes),
                   AM_ERR_INVALID_ARGUMENT);
        if (!strstr(g_log.msg, "0-D")) fail_msg("message '%s'", g_log.msg);
    } else {
        shard.dim0_total = sh->dims[0] - 1;
        EXPECT_ERR(am_update_stats_shard(&pt, &gt, &f.st, &hp, &shard, f.ws, f.ws_bytes),
                   AM_ERR_INVALID_ARGUMENT);
        if (!strstr(g_log.msg, "dim0_total")) fail_msg("message '%s'", g_log.msg);
        shard.dim0_total = INT64_MIN;
        EXPECT_ERR(am_update_stats_shard(&pt, &gt, &f.st, &hp, &shard, f.ws, f.ws_bytes),
                   AM_ERR_INVALID_ARGUMENT);
        shard.dim0_total = (n / sh->dims[0]) > 1 ? ((int64_t)1 << 56) / (n / sh->dims[0]) + 1
                                                 : ((int64_t)1 << 56) + 1;
        EXPECT_ERR(am_update_stats_shard(&pt, &gt, &f.st, &hp, &shard, f.ws, f.ws_bytes),
                   AM_ERR_INVALID_SHAPE);
        shard.dim0_total = INT64_MAX;
        EXPECT_ERR(am_update_stats_shard(&pt, &gt, &f.st, &hp, &shard, f.ws, f.ws_bytes),
                   AM_ERR_INVALID_SHAPE);
        /* the shard's rows must lie within the whole's */
        shard.dim0_total = 3 * sh->dims[0];
        shard.dim0_offset = -1;
        EXPECT_ERR(am_update_stats_shard(&pt, &gt, &f.st, &hp, &shard, f.ws, f.ws_bytes),
                   AM_ERR_INVALID_ARGUMENT);
        if (!strstr(g_log.msg, "dim0_offset")) fail_msg("message '%s'", g_log.msg);
        shard.dim0_offset = 2 * sh->dims[0] + 1;
        EXPECT_ERR(am_update_stats_shard(&pt, &gt, &f.st, &hp, &shard, f.ws, f.ws_bytes),
                   AM_ERR_INVALID_ARGUMENT);
        shard.dim0_offset = INT64_MIN;
        EXPECT_ERR(am_update_stats_shard(&pt, &gt, &f.st, &hp, &shard, f.ws, f.ws_bytes),
                   AM_ERR_INVALID_ARGUMENT);
        shard.dim0_offset = 2 * sh->dims[0]; /* the last rows */
        assert_int_equal(am_update_stats_shard(&pt, &gt, &f.st, &hp, &shard, f.ws, f.ws_bytes),
                         AM_OK);
        shard.dim0_offset = 0;
        /* the largest whole parameter is accepted */
        shard.dim0_total = ((int64_t)1 << 56) / (n / sh->dims[0]);
        assert_int_equal(am_update_stats_shard(&pt, &gt, &f.st, &hp, &shard, f.ws, f.ws_bytes),
                         AM_OK);
    }
    t_snap_check(&snap, &f, p, g);
    t_snap_free(&snap);
    t_fix_free(&f);
    free(p);
    free(g);
}

/* Every invalid argument of am_update and of each phase, on a factored and
 * an unfactored parameter with non-trivial state; buffers unchanged after. */
static void update_invalid(const am_shape *sh) {
    int64_t n = t_numel(sh), i;
    float *p = (float *)t_calloc(n * 4), *g = (float *)t_calloc(n * 4);
    am_hparams hp = am_hparams_default();
    am_tensor pt = t_tensor(p, AM_DTYPE_FLOAT32, sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, sh);
    t_fix f;
    t_snap snap;
    int which, b;
    t_fix_init(&f, sh, 1e-3);
    for (i = 0; i < n; i++) {
        p[i] = 0.1f * (float)(i % 13) - 0.6f;
        g[i] = 0.03f * (float)(i % 7) - 0.1f;
    }
    assert_int_equal(call_phase(0, &pt, &gt, &f.st, &hp, f.ws, f.ws_bytes, NULL), AM_OK);
    assert_int_equal(call_phase(0, &pt, &gt, &f.st, &hp, f.ws, f.ws_bytes, NULL), AM_OK);
    t_snap_take(&snap, &f, p, (size_t)n * 4, g, (size_t)n * 4);
    for (which = 0; which < 5; which++) {
        am_tensor bp, bg;
        am_state bst;
        am_hparams bh;
        am_report rep;
        am_state *stp = &f.st;
        /* NULL pointers */
        EXPECT_ERR(call_phase(which, NULL, &gt, stp, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_NULL_POINTER);
        EXPECT_ERR(call_phase(which, &pt, NULL, stp, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_NULL_POINTER);
        EXPECT_ERR(call_phase(which, &pt, &gt, NULL, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_NULL_POINTER);
        EXPECT_ERR(call_phase(which, &pt, &gt, stp, NULL, f.ws, f.ws_bytes, &rep), AM_ERR_NULL_POINTER);
        EXPECT_ERR(call_phase(which, &pt, &gt, stp, &hp, NULL, f.ws_bytes, &rep), AM_ERR_NULL_POINTER);
        bp = pt; bp.data = NULL;
        EXPECT_ERR(call_phase(which, &bp, &gt, stp, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_NULL_POINTER);
        bg = gt; bg.data = NULL;
        EXPECT_ERR(call_phase(which, &pt, &bg, stp, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_NULL_POINTER);
        for (b = 0; b < 5; b++) {
            bst = f.st;
            if (b == 0) bst.lr = NULL;
            if (b == 1) bst.polarity = NULL;
            if (b == 2) { if (sh->ndim < 2) continue; bst.row = NULL; }
            if (b == 3) { if (sh->ndim < 2) continue; bst.col = NULL; }
            if (b == 4) { if (sh->ndim >= 2) continue; bst.sq = NULL; }
            EXPECT_ERR(call_phase(which, &pt, &gt, &bst, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_NULL_POINTER);
        }
        /* dtypes */
        for (b = 0; b < 3; b++) {
            int bad = b == 0 ? 3 : b == 1 ? -1 : 1000;
            bp = pt; bp.dtype = (am_dtype)bad;
            EXPECT_ERR(call_phase(which, &bp, &gt, stp, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_INVALID_DTYPE);
            bg = gt; bg.dtype = (am_dtype)bad;
            EXPECT_ERR(call_phase(which, &pt, &bg, stp, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_INVALID_DTYPE);
        }
        /* shapes: bad param shape, grad shape != param shape */
        for (b = 0; bad_shape(b, &bp.shape); b++) {
            bp.data = p; bp.dtype = AM_DTYPE_FLOAT32;
            bg = gt; bg.shape = bp.shape;
            EXPECT_ERR(call_phase(which, &bp, &bg, stp, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_INVALID_SHAPE);
            /* the message names the parameter's shape (two shapes are passed) */
            if (!strstr(g_log.msg, "param shape")) fail_msg("message '%s'", g_log.msg);
        }
        bg = gt; bg.shape.ndim = sh->ndim + 1; bg.shape.dims[sh->ndim] = 1; /* same numel */
        EXPECT_ERR(call_phase(which, &pt, &bg, stp, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_INVALID_SHAPE);
        if (sh->ndim >= 2) {
            bg = gt; bg.shape.dims[0] = sh->dims[1]; bg.shape.dims[1] = sh->dims[0]; /* transposed */
            EXPECT_ERR(call_phase(which, &pt, &bg, stp, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_INVALID_SHAPE);
        }
        if (sh->ndim >= 1) {
            bg = gt; bg.shape.dims[sh->ndim - 1] -= 1;
            EXPECT_ERR(call_phase(which, &pt, &bg, stp, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_INVALID_SHAPE);
        }
        /* hyperparameters (one per field) */
        for (b = 0; b < 8; b++) {
            bh = hp;
            if (b == 0) bh.lr = NAN;
            if (b == 1) bh.min_lr = -1;
            if (b == 2) bh.max_lr = INFINITY;
            if (b == 3) bh.lr_bump_rate = -1;
            if (b == 4) bh.beta2 = 1.0;
            if (b == 5) bh.eps = NAN;
            if (b == 6) bh.clip_threshold = 0;
            if (b == 7) bh.weight_decay = INFINITY;
            EXPECT_ERR(call_phase(which, &pt, &gt, stp, &bh, f.ws, f.ws_bytes, &rep), AM_ERR_INVALID_HPARAM);
        }
        /* workspace too small, by one byte and by a lot */
        EXPECT_ERR(call_phase(which, &pt, &gt, stp, &hp, f.ws, f.ws_bytes - 1, &rep), AM_ERR_BUFFER_SIZE);
        EXPECT_ERR(call_phase(which, &pt, &gt, stp, &hp, f.ws, 0, &rep), AM_ERR_BUFFER_SIZE);
        /* negative step */
        bst = f.st;
        bst.step = -1;
        EXPECT_ERR(call_phase(which, &pt, &gt, &bst, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_INVALID_ARGUMENT);
        bst.step = INT64_MIN;
        EXPECT_ERR(call_phase(which, &pt, &gt, &bst, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_INVALID_ARGUMENT);
        /* buffers not aligned to their element size (read anyway before the
         * twenty-fifth session: undefined behaviour, UBSan's report) */
        bp = pt; bp.data = (char *)p + 1;
        EXPECT_ERR(call_phase(which, &bp, &gt, stp, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_INVALID_ARGUMENT);
        if (!strstr(g_log.msg, "param data")) fail_msg("message '%s'", g_log.msg);
        bg = gt; bg.data = (char *)g + 2;
        EXPECT_ERR(call_phase(which, &pt, &bg, stp, &hp, f.ws, f.ws_bytes, &rep), AM_ERR_INVALID_ARGUMENT);
        if (!strstr(g_log.msg, "grad data")) fail_msg("message '%s'", g_log.msg);
        for (b = 0; b < 4; b++) {
            float *const *fp[4];
            bst = f.st;
            fp[0] = &bst.lr; fp[1] = &bst.row; fp[2] = &bst.col; fp[3] = &bst.sq;
            if (!*fp[b]) continue;
            *(float **)fp[b] = (float *)((char *)*fp[b] + 2);
            EXPECT_ERR(call_phase(which, &pt, &gt, &bst, &hp, f.ws, f.ws_bytes, &rep),
                       AM_ERR_INVALID_ARGUMENT);
            if (!strstr(g_log.msg, "state.")) fail_msg("message '%s'", g_log.msg);
        }
        /* buffers that share memory: a state array inside the parameter,
         * two state arrays on one buffer, the gradient over the state (a
         * trainer's arena with a wrong offset was updated silently; found
         * by a review, thirty-second session) */
        if (f.sz.numel > 0 && f.sz.lr_count > 0) {
            bst = f.st;
            bst.lr = (float *)p;
            EXPECT_ERR(call_phase(which, &pt, &gt, &bst, &hp, f.ws, f.ws_bytes, &rep),
                       AM_ERR_INVALID_ARGUMENT);
            if (!strstr(g_log.msg, "param data and state lr share memory"))
                fail_msg("message '%s'", g_log.msg);
            bg = gt;
            bg.data = f.st.lr;
            EXPECT_ERR(call_phase(which, &pt, &bg, stp, &hp, f.ws, f.ws_bytes, &rep),
                       AM_ERR_INVALID_ARGUMENT);
            if (!strstr(g_log.msg, "state lr and grad data share memory"))
                fail_msg("message '%s'", g_log.msg);
        }
        if (f.sz.row_count > 0 && f.sz.col_count > 0) {
            bst = f.st;
            bst.col = bst.row;
            EXPECT_ERR(call_phase(which, &pt, &gt, &bst, &hp, f.ws, f.ws_bytes, &rep),
                       AM_ERR_INVALID_ARGUMENT);
            if (!strstr(g_log.msg, "state row and state col share memory"))
                fail_msg("message '%s'", g_log.msg);
        }
        /* the report of a failed update says so */
        if (which == 0 || which == 3) {
            memset(&rep, 0x77, sizeof rep);
            EXPECT_ERR(call_phase(which, &pt, &gt, stp, NULL, f.ws, f.ws_bytes, &rep), AM_ERR_NULL_POINTER);
            assert_int_equal(rep.status, AM_ERR_NULL_POINTER);
        }
        t_snap_check(&snap, &f, p, g);
    }
    /* phases out of order: moments or finish on a fresh workspace, finish
     * right after stats, moments/finish with another parameter's results */
    memset(f.ws, 0, f.ws_bytes);
    EXPECT_ERR(call_phase(2, &pt, &gt, &f.st, &hp, f.ws, f.ws_bytes, NULL), AM_ERR_INVALID_ARGUMENT);
    EXPECT_ERR(call_phase(3, &pt, &gt, &f.st, &hp, f.ws, f.ws_bytes, NULL), AM_ERR_INVALID_ARGUMENT);
    assert_int_equal(call_phase(1, &pt, &gt, &f.st, &hp, f.ws, f.ws_bytes, NULL), AM_OK);
    EXPECT_ERR(call_phase(3, &pt, &gt, &f.st, &hp, f.ws, f.ws_bytes, NULL), AM_ERR_INVALID_ARGUMENT);
    t_snap_check(&snap, &f, p, g);
    if (n > 1) {
        /* stats of a smaller parameter (same ndim) in this workspace */
        am_shape small = *sh;
        am_tensor sp, sg;
        small.dims[sh->ndim - 1] -= 1;
        sp = t_tensor(p, AM_DTYPE_FLOAT32, &small);
        sg = t_tensor(g, AM_DTYPE_FLOAT32, &small);
        assert_int_equal(call_phase(1, &sp, &sg, &f.st, &hp, f.ws, f.ws_bytes, NULL), AM_OK);
        EXPECT_ERR(call_phase(2, &pt, &gt, &f.st, &hp, f.ws, f.ws_bytes, NULL), AM_ERR_INVALID_ARGUMENT);
        t_snap_check(&snap, &f, p, g);
    }
    if (sh->ndim >= 2 && sh->dims[sh->ndim - 1] != sh->dims[sh->ndim - 2]) {
        /* stats of the same elements in another shape (the last two dims
         * swapped: the same numel) in a workspace then given to moments and
         * finish with this shape: refused (its sums are another layout's) */
        am_shape sw = *sh;
        am_tensor swp, swg;
        t_fix f3;
        int64_t d = sw.dims[sw.ndim - 1];
        unsigned char *ws;
        size_t wb;
        sw.dims[sw.ndim - 1] = sw.dims[sw.ndim - 2];
        sw.dims[sw.ndim - 2] = d;
        t_fix_init(&f3, &sw, 1e-3);
        wb = f3.ws_bytes > f.ws_bytes ? f3.ws_bytes : f.ws_bytes;
        ws = (unsigned char *)t_calloc((int64_t)wb);
        swp = t_tensor(p, AM_DTYPE_FLOAT32, &sw);
        swg = t_tensor(g, AM_DTYPE_FLOAT32, &sw);
        assert_int_equal(call_phase(1, &swp, &swg, &f3.st, &hp, ws, wb, NULL), AM_OK);
        g_log.count = 0;
        EXPECT_ERR(call_phase(2, &pt, &gt, &f.st, &hp, ws, wb, NULL), AM_ERR_INVALID_ARGUMENT);
        assert_non_null(strstr(g_log.msg, "of this shape"));
        /* moments done in that shape, finish in this one */
        assert_int_equal(call_phase(2, &swp, &swg, &f3.st, &hp, ws, wb, NULL), AM_OK);
        EXPECT_ERR(call_phase(3, &pt, &gt, &f.st, &hp, ws, wb, NULL), AM_ERR_INVALID_ARGUMENT);
        t_snap_check(&snap, &f, p, g);
        free(ws);
        t_fix_free(&f3);
    }
    /* and the documented order works, giving exactly what am_update gives */
    {
        t_fix f2;
        float *p2 = (float *)t_dup(p, (size_t)n * 4);
        am_tensor pt2 = t_tensor(p2, AM_DTYPE_FLOAT32, sh);
        t_fix_init(&f2, sh, 1e-3);
        f2.st.step = f.st.step;
        memcpy(f2.st.lr, f.st.lr, (size_t)f.sz.lr_count * 4);
        memcpy(f2.st.polarity, f.st.polarity, (size_t)f.sz.polarity_bytes);
        if (sh->ndim >= 2) {
            memcpy(f2.st.row, f.st.row, (size_t)f.sz.row_count * 4);
            memcpy(f2.st.col, f.st.col, (size_t)f.sz.col_count * 4);
        } else {
            memcpy(f2.st.sq, f.st.sq, (size_t)f.sz.sq_count * 4);
        }
        assert_int_equal(call_phase(1, &pt, &gt, &f.st, &hp, f.ws, f.ws_bytes, NULL), AM_OK);
        assert_int_equal(call_phase(2, &pt, &gt, &f.st, &hp, f.ws, f.ws_bytes, NULL), AM_OK);
        assert_int_equal(call_phase(3, &pt, &gt, &f.st, &hp, f.ws, f.ws_bytes, NULL), AM_OK);
        assert_int_equal(call_phase(0, &pt2, &gt, &f2.st, &hp, f2.ws, f2.ws_bytes, NULL), AM_OK);
        assert_memory_equal(p, p2, (size_t)n * 4);
        assert_memory_equal(f.st.lr, f2.st.lr, (size_t)f.sz.lr_count * 4);
        assert_memory_equal(f.st.polarity, f2.st.polarity, (size_t)f.sz.polarity_bytes);
        assert_int_equal(f.st.step, f2.st.step);
        free(p2);
        t_fix_free(&f2);
    }
    t_snap_free(&snap);
    t_fix_free(&f);
    free(p);
    free(g);
}

/* A zero-element parameter's buffers are not checked for sharing memory:
 * nothing is read or written (a [4, 0] weight whose state arrays all point
 * at one dummy buffer was an update that changed nothing before the check
 * came, and stays one; a review, thirty-second session). */
static void test_zero_elements_share_a_dummy(void **unused) {
    static float dummy[16];
    static unsigned char ws[1 << 16];
    const int64_t d[2] = {4, 0};
    am_tensor p, g;
    am_state st;
    am_hparams hp = am_hparams_default();
    am_rng_key key = {1, 0};
    am_state_sizes sz;
    (void)unused;
    memset(&p, 0, sizeof p);
    p.dtype = AM_DTYPE_FLOAT32;
    p.shape = t_shape(2, d);
    g = p;
    memset(&st, 0, sizeof st);
    st.lr = dummy;
    st.polarity = (uint8_t *)dummy;
    st.row = dummy;
    st.col = dummy;
    assert_int_equal(am_state_get_sizes(&p.shape, &sz), AM_OK);
    assert_true(sz.lr_count > 0 && sz.row_count > 0);
    assert_true(sz.workspace_bytes <= (int64_t)sizeof ws);
    assert_int_equal(am_update(&p, &g, &st, &hp, key, ws, sizeof ws, NULL), AM_OK);
    assert_int_equal(st.step, 0);
}

static void test_update_invalid(void **unused) {
    const int64_t d2[2] = {6, 9}, d1[1] = {11}, d4[4] = {3, 1, 4, 5};
    am_shape s2 = t_shape(2, d2), s1 = t_shape(1, d1), s0 = t_shape(0, d1), s4 = t_shape(4, d4);
    (void)unused;
    update_invalid(&s2);
    update_invalid(&s1);
    update_invalid(&s0);
    update_invalid(&s4);
    stats_shard_invalid(&s2);
    stats_shard_invalid(&s1);
    stats_shard_invalid(&s0);
    stats_shard_invalid(&s4);
}

static void test_workspace_view(void **unused) {
    const int64_t d[2] = {3, 4};
    am_shape sh = t_shape(2, d), bs;
    am_state_sizes sz;
    am_workspace_view v, pattern;
    void *ws;
    int b;
    (void)unused;
    assert_int_equal(am_state_get_sizes(&sh, &sz), AM_OK);
    ws = t_calloc(sz.workspace_bytes);
    memset(&pattern, 0x33, sizeof pattern);
    v = pattern;
    EXPECT_ERR(am_workspace_view_get(&sh, ws, (size_t)sz.workspace_bytes, NULL), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_workspace_view_get(&sh, NULL, (size_t)sz.workspace_bytes, &v), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_workspace_view_get(NULL, ws, (size_t)sz.workspace_bytes, &v), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_workspace_view_get(&sh, ws, (size_t)sz.workspace_bytes - 1, &v), AM_ERR_BUFFER_SIZE);
    for (b = 0; bad_shape(b, &bs); b++)
        EXPECT_ERR(am_workspace_view_get(&bs, ws, (size_t)sz.workspace_bytes, &v), AM_ERR_INVALID_SHAPE);
    assert_memory_equal(&v, &pattern, sizeof v);
    assert_int_equal(am_workspace_view_get(&sh, ws, (size_t)sz.workspace_bytes, &v), AM_OK);
    /* the pointers lie inside the workspace */
    assert_true((char *)v.row_sumsq >= (char *)ws &&
                (char *)(v.row_sumsq + 3) <= (char *)ws + sz.workspace_bytes);
    assert_true((char *)(v.col_sumsq + 4) <= (char *)ws + sz.workspace_bytes);
    free(ws);
}

static void test_threads(void **unused) {
    (void)unused;
    EXPECT_ERR(am_set_num_threads(-1), AM_ERR_INVALID_ARGUMENT);
    assert_int_equal(am_set_num_threads(2), AM_OK);
    EXPECT_ERR(am_set_num_threads(-5), AM_ERR_INVALID_ARGUMENT);
    assert_int_equal(am_set_num_threads(0), AM_OK);
    assert_true(am_get_num_threads() >= 1);
    assert_int_equal(am_set_num_threads(1), AM_OK);
    assert_int_equal(am_get_num_threads(), 1);
    {
        /* any count is accepted, INT_MAX too: an update's arithmetic on it
         * (twice and four times the count, in int) overflowed, undefined
         * behaviour that the sanitizer build reports; a small matrix runs
         * on one thread whatever the count (no pool of 2^31 threads) */
        const int64_t d[2] = {8, 8};
        am_shape sh = t_shape(2, d);
        t_fix f;
        float p[64], g[64];
        am_tensor pt = t_tensor(p, AM_DTYPE_FLOAT32, &sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, &sh);
        am_hparams hp = am_hparams_default();
        int i;
        for (i = 0; i < 64; i++) {
            p[i] = 0.1f * (float)(i % 7);
            g[i] = 0.01f * (float)(i % 5 - 2);
        }
        t_fix_init(&f, &sh, 1e-3);
        assert_int_equal(am_set_num_threads(INT_MAX), AM_OK);
        assert_int_equal(am_update(&pt, &gt, &f.st, &hp, (am_rng_key){1, 0}, f.ws, f.ws_bytes,
                                   NULL),
                         AM_OK);
        assert_int_equal(am_set_num_threads(1), AM_OK);
        t_fix_free(&f);
    }
    assert_non_null(am_kernel_name());
    assert_true(strlen(am_kernel_name()) > 0);
}

/* ---------------------------------------------------- small pure ------- */

static void test_status_dtype_version(void **unused) {
    static const am_status all[] = {
        AM_OK, AM_SKIPPED_NONFINITE_GRAD, AM_SKIPPED_NONFINITE_UPDATE,
        AM_ERR_NULL_POINTER, AM_ERR_INVALID_DTYPE, AM_ERR_INVALID_SHAPE,
        AM_ERR_INVALID_HPARAM, AM_ERR_BUFFER_SIZE, AM_ERR_OUT_OF_MEMORY,
        AM_ERR_NOT_FOUND, AM_ERR_INVALID_ARGUMENT, AM_ERR_IO, AM_ERR_FORMAT,
        AM_ERR_MISMATCH, AM_ERR_UNSUPPORTED, AM_ERR_DEVICE};
    size_t i, j;
    char buf[32];
    (void)unused;
    /* values are fixed forever */
    assert_int_equal(AM_OK, 0);
    assert_int_equal(AM_SKIPPED_NONFINITE_GRAD, 1);
    assert_int_equal(AM_SKIPPED_NONFINITE_UPDATE, 2);
    for (i = 3; i < sizeof all / sizeof all[0]; i++) assert_int_equal((int)all[i], -(int)(i - 2));
    for (i = 0; i < sizeof all / sizeof all[0]; i++) {
        const char *s = am_status_string(all[i]);
        assert_non_null(s);
        assert_true(strlen(s) > 0);
        assert_string_not_equal(s, "unknown status");
        assert_int_equal(am_status_is_error(all[i]) != 0, (int)all[i] < 0);
        for (j = 0; j < i; j++) assert_string_not_equal(s, am_status_string(all[j]));
    }
    assert_string_equal(am_status_string((am_status)3), "unknown status");
    assert_string_equal(am_status_string((am_status)-14), "unknown status");
    assert_string_equal(am_status_string((am_status)123456), "unknown status");
    assert_int_equal(am_dtype_size(AM_DTYPE_FLOAT32), 4);
    assert_int_equal(am_dtype_size(AM_DTYPE_BFLOAT16), 2);
    assert_int_equal(am_dtype_size(AM_DTYPE_FLOAT16), 2);
    assert_int_equal(am_dtype_size((am_dtype)3), 0);
    assert_int_equal(am_dtype_size((am_dtype)-1), 0);
    assert_string_equal(am_dtype_name(AM_DTYPE_FLOAT32), "float32");
    assert_string_equal(am_dtype_name(AM_DTYPE_BFLOAT16), "bfloat16");
    assert_string_equal(am_dtype_name(AM_DTYPE_FLOAT16), "float16");
    assert_string_equal(am_dtype_name((am_dtype)3), "invalid");
    assert_string_equal(am_dtype_name((am_dtype)-7), "invalid");
    assert_int_equal(am_version_number(), AM_VERSION_NUMBER);
    snprintf(buf, sizeof buf, "%d.%d.%d", AM_VERSION_MAJOR, AM_VERSION_MINOR, AM_VERSION_PATCH);
    assert_string_equal(am_version_string(), buf);
    assert_int_equal(AM_VERSION_NUMBER, AM_VERSION_MAJOR * 10000 + AM_VERSION_MINOR * 100 + AM_VERSION_PATCH);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_status_dtype_version),
        cmocka_unit_test(test_hparams),
        cmocka_unit_test(test_extreme_valid_hparams),
        cmocka_unit_test(test_lr_bump_from_zero),
        cmocka_unit_test(test_state_get_sizes),
        cmocka_unit_test(test_state_init),
        cmocka_unit_test(test_zero_elements_share_a_dummy),
        cmocka_unit_test(test_update_invalid),
        cmocka_unit_test(test_workspace_view),
        cmocka_unit_test(test_threads),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
