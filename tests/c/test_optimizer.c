/*
 * test_optimizer.c — the optimizer object (am_optimizer_*): its documented
 * behaviour (ids, lrs and their means, the 1e-3 rule, update_all) and every
 * invalid argument, with parameters, state and output buffers checked
 * unchanged afterwards.
 */
#include "test_common.h"

T_ERROR_LOG_FIXTURE()

/* Two registered parameters (a {3,4} float32 matrix, a {5} bfloat16 vector)
 * after one update each, and a copy of everything they own. */
typedef struct t_opt {
    am_optimizer *opt;
    float w[12];
    uint16_t b[5];
    float g[12];
    uint16_t gb[5];
    int32_t id0, id1;
} t_opt;

static void t_opt_make(t_opt *o) {
    const int64_t d0[2] = {3, 4}, d1[1] = {5};
    am_hparams hp = am_hparams_default();
    int i;
    memset(o, 0, sizeof *o);
    hp.lr = 1e-3;
    for (i = 0; i < 12; i++) {
        o->w[i] = 0.1f * (float)i - 0.5f;
        o->g[i] = 0.02f * (float)(i % 5) - 0.03f;
    }
    for (i = 0; i < 5; i++) {
        o->b[i] = (uint16_t)(0x3f80 + 3 * i);
        o->gb[i] = (uint16_t)(0xbc00 + 17 * i); /* bf16 negatives */
    }
    assert_int_equal(am_optimizer_create(&hp, 99, &o->opt), AM_OK);
    assert_int_equal(am_optimizer_add_param(o->opt, o->w, AM_DTYPE_FLOAT32, 2, d0, &o->id0), AM_OK);
    assert_int_equal(am_optimizer_add_param(o->opt, o->b, AM_DTYPE_BFLOAT16, 1, d1, &o->id1), AM_OK);
    assert_int_equal(o->id0, 0);
    assert_int_equal(o->id1, 1);
    assert_int_equal(am_optimizer_update_param(o->opt, o->id0, o->g, AM_DTYPE_FLOAT32, NULL), AM_OK);
    assert_int_equal(am_optimizer_update_param(o->opt, o->id1, o->gb, AM_DTYPE_BFLOAT16, NULL), AM_OK);
}

/* Everything the optimizer and the caller own, as bytes. */
typedef struct t_osnap {
    float w[12];
    uint16_t b[5];
    unsigned char st[2][256];
    int64_t step[2];
    int32_t nparams;
    int64_t skipped;
} t_osnap;

static void t_osnap_take(const t_opt *o, t_osnap *s) {
    int32_t id;
    memset(s, 0, sizeof *s);
    memcpy(s->w, o->w, sizeof s->w);
    memcpy(s->b, o->b, sizeof s->b);
    for (id = 0; id < 2; id++) {
        am_state st;
        am_shape sh;
        am_state_sizes sz;
        size_t off = 0;
        assert_int_equal(am_optimizer_get_state(o->opt, id, &st, &sh), AM_OK);
        assert_int_equal(am_state_get_sizes(&sh, &sz), AM_OK);
        memcpy(s->st[id] + off, st.lr, (size_t)sz.lr_count * 4);
        off += (size_t)sz.lr_count * 4;
        memcpy(s->st[id] + off, st.polarity, (size_t)sz.polarity_bytes);
        off += (size_t)sz.polarity_bytes;
        if (sz.row_count) memcpy(s->st[id] + off, st.row, (size_t)sz.row_count * 4);
        off += (size_t)sz.row_count * 4;
        if (sz.col_count) memcpy(s->st[id] + off, st.col, (size_t)sz.col_count * 4);
        off += (size_t)sz.col_count * 4;
        if (sz.sq_count) memcpy(s->st[id] + off, st.sq, (size_t)sz.sq_count * 4);
        off += (size_t)sz.sq_count * 4;
        assert_true(off <= sizeof s->st[id]);
        s->step[id] = st.step;
    }
    s->nparams = am_optimizer_num_params(o->opt);
    s->skipped = am_optimizer_skipped_count(o->opt);
}

static void check_same(const t_osnap *a, const t_opt *o) {
    t_osnap b;
    t_osnap_take(o, &b);
    assert_memory_equal(a, &b, sizeof b);
}

static void test_optimizer_api(void **unused) {
    t_opt o;
    am_hparams hp = am_hparams_default();
    am_optimizer *opt = NULL;
    float lrs[5];
    double mean, m0, m1;
    am_state st;
    am_shape sh;
    int32_t id;
    int i;
    (void)unused;
    /* no parameters: lr_mean(-1) is the initial lr; NULL-safe queries */
    hp.lr = 2e-4;
    assert_int_equal(am_optimizer_create(&hp, 1, &opt), AM_OK);
    assert_int_equal(am_optimizer_num_params(opt), 0);
    assert_int_equal(am_optimizer_lr_mean(opt, -1, &mean), AM_OK);
    assert_true(mean == 2e-4);
    am_optimizer_destroy(opt);
    am_optimizer_destroy(NULL);
    assert_int_equal(am_optimizer_num_params(NULL), 0);
    assert_int_equal(am_optimizer_skipped_count(NULL), 0);
    /* an initial lr above 1e-3 is forced to 1e-6 with a warning */
    hp.lr = 0.5;
    g_log.count = 0;
    assert_int_equal(am_optimizer_create(&hp, 1, &opt), AM_OK);
    assert_int_equal(g_log.count, 1);
    assert_int_equal(g_log.level, AM_LOG_WARNING);
    {
        float w[3] = {1, 2, 3};
        int64_t d = 3;
        assert_int_equal(am_optimizer_add_param(opt, w, AM_DTYPE_FLOAT32, 1, &d, &id), AM_OK);
        assert_int_equal(am_optimizer_get_lrs(opt, id, lrs, 3), AM_OK);
        for (i = 0; i < 3; i++) assert_true(lrs[i] == 1e-6f);
    }
    am_optimizer_destroy(opt);
    /* two parameters: counts, lrs, means, state read-back */
    t_opt_make(&o);
    assert_int_equal(am_optimizer_num_params(o.opt), 2);
    assert_int_equal(am_optimizer_lr_count(o.opt, 0), 3);
    assert_int_equal(am_optimizer_lr_count(o.opt, 1), 5);
    assert_int_equal(am_optimizer_get_lrs(o.opt, 1, lrs, 5), AM_OK);
    assert_int_equal(am_optimizer_lr_mean(o.opt, 0, &m0), AM_OK);
    assert_int_equal(am_optimizer_lr_mean(o.opt, 1, &m1), AM_OK);
    mean = 0;
    for (i = 0; i < 5; i++) mean += lrs[i];
    assert_true(fabs(m1 - mean / 5) <= 1e-15);
    assert_int_equal(am_optimizer_lr_mean(o.opt, -1, &mean), AM_OK);
    assert_true(fabs(mean - (m0 + m1) / 2) <= 1e-15);
    {
        /* lr_mean(-1) over the parameters updated so far, as the
         * reference's get_avg_learning_rate averages those with state (a
         * parameter never updated was averaged in at its initial lr) */
        am_optimizer *u = NULL;
        float w0[12] = {0}, w1[5] = {0}, g0[12];
        const int64_t d0[2] = {3, 4}, d1 = 5;
        const void *gr[2] = {g0, NULL};
        const am_dtype gd[2] = {AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32};
        double a, b;
        am_hparams h2 = am_hparams_default();
        h2.lr = 1e-4;
        for (i = 0; i < 12; i++) g0[i] = (float)(i % 5) - 2.0f;
        assert_int_equal(am_optimizer_create(&h2, 1, &u), AM_OK);
        assert_int_equal(am_optimizer_add_param(u, w0, AM_DTYPE_FLOAT32, 2, d0, &id), AM_OK);
        assert_int_equal(am_optimizer_add_param(u, w1, AM_DTYPE_FLOAT32, 1, &d1, &id), AM_OK);
        assert_int_equal(am_optimizer_lr_mean(u, -1, &a), AM_OK);
        assert_true(a == 1e-4); /* none updated: the initial lr */
        for (i = 0; i < 3; i++) assert_int_equal(am_optimizer_update_all(u, gr, gd, NULL), AM_OK);
        assert_int_equal(am_optimizer_lr_mean(u, -1, &a), AM_OK);
        assert_int_equal(am_optimizer_lr_mean(u, 0, &b), AM_OK);
        assert_true(a == b && b != (double)1e-4f); /* bumped: no longer the initial lr */
        am_optimizer_destroy(u);
    }
    assert_int_equal(am_optimizer_get_state(o.opt, 0, &st, &sh), AM_OK);
    assert_int_equal(sh.ndim, 2);
    assert_true(sh.dims[0] == 3 && sh.dims[1] == 4);
    assert_int_equal(st.step, 1);
    assert_non_null(st.row);
    assert_null(st.sq);
    assert_int_equal(am_optimizer_get_state(o.opt, 1, &st, NULL), AM_OK); /* shape may be NULL */
    assert_null(st.row);
    assert_non_null(st.sq);
    /* update_all: NULL grads skip a parameter; reports per parameter */
    {
        const void *grads[2] = {NULL, o.gb};
        am_dtype gds[2] = {AM_DTYPE_FLOAT32, AM_DTYPE_BFLOAT16};
        am_report reps[2];
        float w_before[12];
        memcpy(w_before, o.w, sizeof w_before);
        memset(reps, 0x55, sizeof reps);
        assert_int_equal(am_optimizer_update_all(o.opt, grads, gds, reps), AM_OK);
        assert_memory_equal(o.w, w_before, sizeof w_before);
        assert_int_equal(reps[1].status, AM_OK);
        assert_int_equal(am_optimizer_get_state(o.opt, 0, &st, NULL), AM_OK);
        assert_int_equal(st.step, 1);
        assert_int_equal(am_optimizer_get_state(o.opt, 1, &st, NULL), AM_OK);
        assert_int_equal(st.step, 2);
        grads[0] = o.g;
        assert_int_equal(am_optimizer_update_all(o.opt, grads, gds, NULL), AM_OK);
        assert_int_equal(am_optimizer_get_state(o.opt, 0, &st, NULL), AM_OK);
        assert_int_equal(st.step, 2);
    }
    am_optimizer_destroy(o.opt);
}

static void test_optimizer_invalid(void **unused) {
    t_opt o;
    t_osnap s;
    am_hparams hp = am_hparams_default(), bad = am_hparams_default();
    am_optimizer *opt = (am_optimizer *)&o; /* sentinel: must stay */
    am_optimizer *const sentinel = opt;
    const int64_t d2[2] = {2, 2}, dneg[2] = {2, -2}, dbig[2] = {INT64_MAX / 2, 8};
    float buf[4] = {1, 2, 3, 4}, lrs[8], lrs_pattern[8];
    int32_t id = 1234;
    double mean = 7.0;
    am_state st, st_pattern;
    am_report rep;
    (void)unused;
    /* create */
    EXPECT_ERR(am_optimizer_create(&hp, 1, NULL), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_optimizer_create(NULL, 1, &opt), AM_ERR_NULL_POINTER);
    bad.beta2 = 1.0;
    EXPECT_ERR(am_optimizer_create(&bad, 1, &opt), AM_ERR_INVALID_HPARAM);
    bad = hp;
    bad.lr = NAN;
    EXPECT_ERR(am_optimizer_create(&bad, 1, &opt), AM_ERR_INVALID_HPARAM);
    assert_ptr_equal(opt, sentinel);

    t_opt_make(&o);
    t_osnap_take(&o, &s);
    /* add_param */
    EXPECT_ERR(am_optimizer_add_param(NULL, buf, AM_DTYPE_FLOAT32, 2, d2, &id), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_optimizer_add_param(o.opt, buf, AM_DTYPE_FLOAT32, 2, d2, NULL), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_optimizer_add_param(o.opt, buf, AM_DTYPE_FLOAT32, 2, NULL, &id), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_optimizer_add_param(o.opt, NULL, AM_DTYPE_FLOAT32, 2, d2, &id), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_optimizer_add_param(o.opt, buf, (am_dtype)3, 2, d2, &id), AM_ERR_INVALID_DTYPE);
    EXPECT_ERR(am_optimizer_add_param(o.opt, buf, (am_dtype)-1, 2, d2, &id), AM_ERR_INVALID_DTYPE);
    EXPECT_ERR(am_optimizer_add_param(o.opt, buf, AM_DTYPE_FLOAT32, -1, d2, &id), AM_ERR_INVALID_SHAPE);
    EXPECT_ERR(am_optimizer_add_param(o.opt, buf, AM_DTYPE_FLOAT32, 9, d2, &id), AM_ERR_INVALID_SHAPE);
    EXPECT_ERR(am_optimizer_add_param(o.opt, buf, AM_DTYPE_FLOAT32, 2, dneg, &id), AM_ERR_INVALID_SHAPE);
    EXPECT_ERR(am_optimizer_add_param(o.opt, buf, AM_DTYPE_FLOAT32, 2, dbig, &id), AM_ERR_INVALID_SHAPE);
    /* data not aligned to its element size */
    EXPECT_ERR(am_optimizer_add_param(o.opt, (char *)buf + 2, AM_DTYPE_FLOAT32, 2, d2, &id),
               AM_ERR_INVALID_ARGUMENT);
    EXPECT_ERR(am_optimizer_add_param(o.opt, (char *)buf + 1, AM_DTYPE_BFLOAT16, 2, d2, &id),
               AM_ERR_INVALID_ARGUMENT);
    assert_int_equal(id, 1234);
    check_same(&s, &o);
    /* out of memory: 2^46 float32 elements need 2^48 bytes of lrs alone,
     * more than any 64-bit user address space (so no overcommit setting can
     * grant it) */
    {
        const int64_t huge[1] = {(int64_t)1 << 46};
        EXPECT_ERR(am_optimizer_add_param(o.opt, buf, AM_DTYPE_FLOAT32, 1, huge, &id),
                   AM_ERR_OUT_OF_MEMORY);
        assert_int_equal(id, 1234);
        check_same(&s, &o);
    }
    /* update_param: unknown ids, NULL grad, bad grad dtype */
    EXPECT_ERR(am_optimizer_update_param(NULL, 0, o.g, AM_DTYPE_FLOAT32, &rep), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_optimizer_update_param(o.opt, -1, o.g, AM_DTYPE_FLOAT32, &rep), AM_ERR_NOT_FOUND);
    EXPECT_ERR(am_optimizer_update_param(o.opt, 2, o.g, AM_DTYPE_FLOAT32, &rep), AM_ERR_NOT_FOUND);
    EXPECT_ERR(am_optimizer_update_param(o.opt, INT32_MAX, o.g, AM_DTYPE_FLOAT32, &rep), AM_ERR_NOT_FOUND);
    EXPECT_ERR(am_optimizer_update_param(o.opt, 0, NULL, AM_DTYPE_FLOAT32, &rep), AM_ERR_NULL_POINTER);
    if (strncmp(g_log.msg, "am_optimizer_update_param: parameter 0: ", 40) != 0)
        fail_msg("the message does not name the call and the parameter: %s", g_log.msg);
    /* and only those messages: a later error of another call has no prefix */
    EXPECT_ERR(am_optimizer_get_lrs(o.opt, 2, lrs, 8), AM_ERR_NOT_FOUND);
    if (strstr(g_log.msg, "parameter 0: "))
        fail_msg("a later message keeps the prefix: %s", g_log.msg);
    EXPECT_ERR(am_optimizer_update_param(o.opt, 0, o.g, (am_dtype)5, &rep), AM_ERR_INVALID_DTYPE);
    check_same(&s, &o);
    /* update_all: checked before any update (parameter 0 untouched although
     * its own arguments are fine) */
    {
        const void *grads[2] = {o.g, o.gb};
        am_dtype gds[2] = {AM_DTYPE_FLOAT32, (am_dtype)9};
        am_report reps[2];
        EXPECT_ERR(am_optimizer_update_all(NULL, grads, gds, reps), AM_ERR_NULL_POINTER);
        EXPECT_ERR(am_optimizer_update_all(o.opt, NULL, gds, reps), AM_ERR_NULL_POINTER);
        EXPECT_ERR(am_optimizer_update_all(o.opt, grads, NULL, reps), AM_ERR_NULL_POINTER);
        EXPECT_ERR(am_optimizer_update_all(o.opt, grads, gds, reps), AM_ERR_INVALID_DTYPE);
        check_same(&s, &o);
        /* a misaligned gradient for parameter 1: parameter 0 untouched */
        gds[1] = AM_DTYPE_BFLOAT16;
        grads[1] = (const char *)o.gb + 1;
        EXPECT_ERR(am_optimizer_update_all(o.opt, grads, gds, reps), AM_ERR_INVALID_ARGUMENT);
        check_same(&s, &o);
        /* a gradient over its parameter's own state: refused before any
         * parameter is updated (am_update refuses it; update_all updated
         * parameter 0 first: a review, thirty-second session) */
        {
            am_state st1;
            assert_int_equal(am_optimizer_get_state(o.opt, 1, &st1, NULL), AM_OK);
            grads[1] = st1.sq;
            gds[1] = AM_DTYPE_BFLOAT16;
            EXPECT_ERR(am_optimizer_update_all(o.opt, grads, gds, reps), AM_ERR_INVALID_ARGUMENT);
            if (!strstr(g_log.msg, "parameter 1: state sq and grad data share memory"))
                fail_msg("message: %s", g_log.msg);
            check_same(&s, &o);
            grads[1] = (const char *)o.gb + 1;
        }
        EXPECT_ERR(am_optimizer_update_param(o.opt, 1, grads[1], AM_DTYPE_BFLOAT16, &rep),
                   AM_ERR_INVALID_ARGUMENT);
        /* am_update's message names the function and the parameter (it
         * named neither: found by a review, thirty-second session) */
        if (strncmp(g_log.msg, "am_optimizer_update_param: parameter 1: ", 40) != 0)
            fail_msg("the message does not name the call and the parameter: %s", g_log.msg);
        check_same(&s, &o);
    }
    /* get_lrs */
    memset(lrs_pattern, 0x42, sizeof lrs_pattern);
    memcpy(lrs, lrs_pattern, sizeof lrs);
    EXPECT_ERR(am_optimizer_get_lrs(NULL, 0, lrs, 8), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_optimizer_get_lrs(o.opt, 2, lrs, 8), AM_ERR_NOT_FOUND);
    EXPECT_ERR(am_optimizer_get_lrs(o.opt, -1, lrs, 8), AM_ERR_NOT_FOUND);
    EXPECT_ERR(am_optimizer_get_lrs(o.opt, 0, NULL, 8), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_optimizer_get_lrs(o.opt, 1, lrs, 4), AM_ERR_BUFFER_SIZE);
    EXPECT_ERR(am_optimizer_get_lrs(o.opt, 0, lrs, -1), AM_ERR_BUFFER_SIZE);
    assert_memory_equal(lrs, lrs_pattern, sizeof lrs);
    /* lr_count, lr_mean */
    assert_int_equal(am_optimizer_lr_count(NULL, 0), -1);
    assert_int_equal(am_optimizer_lr_count(o.opt, 2), -1);
    assert_int_equal(am_optimizer_lr_count(o.opt, -1), -1);
    EXPECT_ERR(am_optimizer_lr_mean(NULL, 0, &mean), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_optimizer_lr_mean(o.opt, 0, NULL), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_optimizer_lr_mean(o.opt, 2, &mean), AM_ERR_NOT_FOUND);
    EXPECT_ERR(am_optimizer_lr_mean(o.opt, -2, &mean), AM_ERR_NOT_FOUND);
    assert_true(mean == 7.0);
    /* get_state */
    memset(&st_pattern, 0x24, sizeof st_pattern);
    st = st_pattern;
    EXPECT_ERR(am_optimizer_get_state(NULL, 0, &st, NULL), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_optimizer_get_state(o.opt, 0, NULL, NULL), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_optimizer_get_state(o.opt, 2, &st, NULL), AM_ERR_NOT_FOUND);
    EXPECT_ERR(am_optimizer_get_state(o.opt, -1, &st, NULL), AM_ERR_NOT_FOUND);
    assert_memory_equal(&st, &st_pattern, sizeof st);
    check_same(&s, &o);
    /* set_hparams: NULLs and an invalid set change nothing; a valid one is
     * what get_hparams gives, its lr > 1e-3 forced to 1e-6, the seed and
     * every state kept; the next update uses it (weight decay) */
    {
        am_hparams h0, h1, hs = am_hparams_default();
        uint64_t seed = 0;
        float w_before[12], w_plain[12];
        assert_int_equal(am_optimizer_get_hparams(o.opt, &h0, NULL), AM_OK);
        EXPECT_ERR(am_optimizer_set_hparams(NULL, &hs), AM_ERR_NULL_POINTER);
        EXPECT_ERR(am_optimizer_set_hparams(o.opt, NULL), AM_ERR_NULL_POINTER);
        hs.beta2 = 1.0;
        EXPECT_ERR(am_optimizer_set_hparams(o.opt, &hs), AM_ERR_INVALID_HPARAM);
        assert_int_equal(am_optimizer_get_hparams(o.opt, &h1, &seed), AM_OK);
        assert_memory_equal(&h0, &h1, sizeof h0);
        assert_true(seed == 99);
        check_same(&s, &o);
        hs = am_hparams_default();
        hs.lr = 0.5;
        hs.weight_decay = 0.25;
        assert_int_equal(am_optimizer_set_hparams(o.opt, &hs), AM_OK);
        assert_int_equal(am_optimizer_get_hparams(o.opt, &h1, &seed), AM_OK);
        assert_true(h1.lr == 1e-6 && h1.weight_decay == 0.25 && seed == 99);
        check_same(&s, &o);
        /* the same update with and without the decay differ */
        memcpy(w_before, o.w, sizeof w_before);
        {
            t_opt q;
            t_opt_make(&q);
            memcpy(q.w, w_before, sizeof q.w);
            assert_int_equal(am_optimizer_update_param(q.opt, 0, q.g, AM_DTYPE_FLOAT32, NULL),
                             AM_OK);
            memcpy(w_plain, q.w, sizeof w_plain);
            am_optimizer_destroy(q.opt);
        }
        assert_int_equal(am_optimizer_update_param(o.opt, 0, o.g, AM_DTYPE_FLOAT32, NULL), AM_OK);
        assert_true(memcmp(o.w, w_plain, sizeof w_plain) != 0);
    }
    am_optimizer_destroy(o.opt);
}

/* am_optimizer_set_param_data: the updates move the new buffer and keep
 * the state, as an optimizer that never moved it; refusals change nothing. */
static void test_set_param_data(void **unused) {
    t_opt a, b;
    float moved[13], old[12];
    float *const mv = moved + 1; /* 4-byte aligned, and mv + 0.5 elements is not */
    (void)unused;
    t_opt_make(&a);
    t_opt_make(&b);
    memcpy(mv, a.w, sizeof a.w);
    memcpy(old, a.w, sizeof a.w);
    assert_int_equal(am_optimizer_set_param_data(a.opt, a.id0, mv), AM_OK);
    EXPECT_ERR(am_optimizer_set_param_data(NULL, 0, mv), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_optimizer_set_param_data(a.opt, 2, mv), AM_ERR_NOT_FOUND);
    EXPECT_ERR(am_optimizer_set_param_data(a.opt, -1, mv), AM_ERR_NOT_FOUND);
    EXPECT_ERR(am_optimizer_set_param_data(a.opt, 0, NULL), AM_ERR_NULL_POINTER);
    EXPECT_ERR(am_optimizer_set_param_data(a.opt, 0, (char *)mv + 2), AM_ERR_INVALID_ARGUMENT);
    assert_int_equal(am_optimizer_update_param(a.opt, a.id0, a.g, AM_DTYPE_FLOAT32, NULL), AM_OK);
    assert_int_equal(am_optimizer_update_param(b.opt, b.id0, b.g, AM_DTYPE_FLOAT32, NULL), AM_OK);
    assert_memory_equal(mv, b.w, sizeof b.w);  /* the new buffer, as if never moved */
    assert_memory_equal(a.w, old, sizeof old); /* the old one left alone */
    assert_memory_not_equal(mv, old, sizeof old);
    {
        am_state sa, sb;
        assert_int_equal(am_optimizer_get_state(a.opt, 0, &sa, NULL), AM_OK);
        assert_int_equal(am_optimizer_get_state(b.opt, 0, &sb, NULL), AM_OK);
        assert_int_equal(sa.step, 2);
        assert_int_equal(sb.step, 2);
        assert_memory_equal(sa.lr, sb.lr, 3 * sizeof(float));
    }
    am_optimizer_destroy(a.opt);
    am_optimizer_destroy(b.opt);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_optimizer_api),
        cmocka_unit_test(test_optimizer_invalid),
        cmocka_unit_test(test_set_param_data),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
