/* test_batch.c — am_update_batch gives am_update's bits on each item in turn.
 *
 * 1. A GPT-like list of parameters (one big matrix that runs on every
 *    thread, matrices, 3x3 weights, 1-D and 0-D tensors, an empty one), in
 *    every dtype, three steps, on 1, 2, 3 and 4 threads: parameters, states,
 *    reports and statuses equal to am_update called in turn on 1 thread.
 * 2. A non-finite gradient skips its item only (status, item unchanged).
 * 3. Errors: an invalid item, two items sharing a parameter or a state
 *    buffer, a workspace too small: the error, the item's status, a log
 *    message, and nothing modified.
 * 4. am_optimizer_update_all on 2 threads (one batch) against 1.
 * Randomised data; AM_TEST_SEED replays it. */
#include "test_common.h"

T_ERROR_LOG_FIXTURE()

enum { NP = 12 };

typedef struct set {
    am_shape shape[NP];
    am_dtype pdt[NP], gdt[NP];
    t_fix fix[NP];
    void *p[NP], *g[NP];
    am_tensor pt[NP], gt[NP];
    am_report rep[NP];
    am_status st[NP];
    am_hparams hp;
    int n;
} set;

/* item 0 is more than total / (2 * threads) elements at 2 to 4 threads */
static const struct {
    int32_t ndim;
    int64_t dims[4];
} SHAPES[NP] = {
    {2, {300, 520}}, {2, {96, 130}}, {2, {130, 96}}, {4, {17, 9, 3, 3}},
    {2, {64, 33}},   {1, {777}},     {1, {4096}},    {0, {0}},
    {2, {1, 1000}},  {3, {5, 7, 9}}, {1, {0}},       {2, {40, 40}},
};

static size_t esz(am_dtype d) { return am_dtype_size(d); }

static void set_init(set *s, uint64_t seed, am_dtype pd, am_dtype gd) {
    int i;
    int64_t e;
    uint64_t r = seed;
    memset(s, 0, sizeof *s);
    s->n = NP;
    s->hp = am_hparams_default();
    s->hp.weight_decay = 0.01;
    for (i = 0; i < NP; i++) {
        int64_t n;
        s->shape[i] = t_shape(SHAPES[i].ndim, SHAPES[i].dims);
        s->pdt[i] = i % 3 == 0 ? pd : (am_dtype)((pd + i) % 3);
        s->gdt[i] = i % 2 == 0 ? gd : s->pdt[i];
        t_fix_init(&s->fix[i], &s->shape[i], 1e-4);
        n = s->fix[i].sz.numel;
        s->p[i] = t_calloc(n * (int64_t)esz(s->pdt[i]));
        s->g[i] = t_calloc(n * (int64_t)esz(s->gdt[i]));
        for (e = 0; e < n; e++) {
            t_store_random(s->p[i], s->pdt[i], e, &r, -6, 0);
            t_store_random(s->g[i], s->gdt[i], e, &r, -12, -4);
        }
        s->pt[i] = t_tensor(s->p[i], s->pdt[i], &s->shape[i]);
        s->gt[i] = t_tensor(s->g[i], s->gdt[i], &s->shape[i]);
    }
}

static void set_free(set *s) {
    int i;
    for (i = 0; i < NP; i++) {
        t_fix_free(&s->fix[i]);
        free(s->p[i]);
        free(s->g[i]);
    }
}

static am_rng_key key_of(int i) {
    am_rng_key k;
    memset(&k, 0, sizeof k);
    k.seed = 0x1234u;
    k.param_id = (uint32_t)(100 + i);
    return k;
}

static void items_of(set *s, am_batch_item *it) {
    int i;
    for (i = 0; i < s->n; i++) {
        memset(&it[i], 0, sizeof it[i]);
        it[i].param = &s->pt[i];
        it[i].grad = &s->gt[i];
        it[i].state = &s->fix[i].st;
        it[i].hp = &s->hp;
        it[i].key = key_of(i);
        it[i].report = &s->rep[i];
    }
}

static void same_sets(const set *a, const set *b) {
    int i;
    for (i = 0; i < NP; i++) {
        const am_state_sizes *z = &a->fix[i].sz;
        if (z->numel)
            assert_memory_equal(a->p[i], b->p[i], (size_t)z->numel * esz(a->pdt[i]));
        assert_int_equal(a->fix[i].st.step, b->fix[i].st.step);
        assert_memory_equal(a->fix[i].st.lr, b->fix[i].st.lr, (size_t)z->lr_count * 4);
        assert_memory_equal(a->fix[i].st.polarity, b->fix[i].st.polarity,
                            (size_t)z->polarity_bytes);
        if (z->row_count) {
            assert_memory_equal(a->fix[i].st.row, b->fix[i].st.row, (size_t)z->row_count * 4);
            assert_memory_equal(a->fix[i].st.col, b->fix[i].st.col, (size_t)z->col_count * 4);
        }
        if (z->sq_count)
            assert_memory_equal(a->fix[i].st.sq, b->fix[i].st.sq, (size_t)z->sq_count * 4);
        assert_int_equal(a->st[i], b->st[i]);
        assert_int_equal(a->rep[i].status, b->rep[i].status);
        assert_memory_equal(&a->rep[i].clip_scale, &b->rep[i].clip_scale, sizeof(float));
        assert_memory_equal(&a->rep[i].mean_agreement, &b->rep[i].mean_agreement,
                            sizeof(float));
    }
}

/* Three steps of each item in turn, on 1 thread (the baseline). */
static void run_in_turn(set *s) {
    int step, i;
    am_set_num_threads(1);
    for (step = 0; step < 3; step++)
        for (i = 0; i < s->n; i++)
            s->st[i] = am_update(&s->pt[i], &s->gt[i], &s->fix[i].st, &s->hp,
                                 key_of(i),
                                 s->fix[i].ws, s->fix[i].ws_bytes, &s->rep[i]);
}

/* The updates at `threads` threads with a workspace sized for `sized_for`
 * threads (fewer: another thread changed the count after the caller sized
 * it; the batch runs on as many threads as the workspace has slots for). */
static void run_batch_sized(set *s, int threads, int sized_for) {
    am_batch_item it[NP];
    size_t bytes = 0;
    void *ws;
    int step, i;
    am_set_num_threads(threads);
    items_of(s, it);
    assert_int_equal(am_update_batch_workspace(it, s->n, sized_for, &bytes), AM_OK);
    ws = t_calloc((int64_t)bytes);
    for (step = 0; step < 3; step++) {
        assert_int_equal(am_update_batch(it, s->n, ws, bytes), AM_OK);
        for (i = 0; i < s->n; i++) s->st[i] = it[i].status;
    }
    free(ws);
    am_set_num_threads(1);
}

static void run_batch(set *s, int threads) { run_batch_sized(s, threads, threads); }

static void test_same_bits(void **unused) {
    static const am_dtype dts[3] = {AM_DTYPE_FLOAT32, AM_DTYPE_BFLOAT16, AM_DTYPE_FLOAT16};
    const uint64_t seed = t_seed();
    int d, threads;
    (void)unused;
    for (d = 0; d < 3; d++)
        for (threads = 1; threads <= 4; threads++) {
            set *a = malloc(sizeof(set)), *b = malloc(sizeof(set));
            int i;
            assert_non_null(a);
            assert_non_null(b);
            set_init(a, seed + (uint64_t)d, dts[d], dts[(d + 1) % 3]);
            set_init(b, seed + (uint64_t)d, dts[d], dts[(d + 1) % 3]);
            run_in_turn(a);
            /* at 3 and 4 threads, also a workspace sized for fewer */
            run_batch_sized(b, threads, threads > 2 ? threads - 1 - d % 2 : threads);
            for (i = 0; i < NP; i++) assert_int_equal(a->st[i], AM_OK);
            same_sets(a, b);
            set_free(a);
            set_free(b);
            free(a);
            free(b);
        }
}

static void test_nonfinite_item(void **unused) {
    set *a = malloc(sizeof(set)), *b = malloc(sizeof(set));
    t_snap snap;
    const int bad = 4;
    (void)unused;
    assert_non_null(a);
    assert_non_null(b);
    set_init(a, t_seed() + 7, AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32);
    set_init(b, t_seed() + 7, AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32);
    ((float *)a->g[bad])[5] = NAN; /* item 4's gradient is float32 */
    ((float *)b->g[bad])[5] = NAN;
    assert_int_equal(a->gdt[bad], AM_DTYPE_FLOAT32);
    t_snap_take(&snap, &b->fix[bad], b->p[bad],
                (size_t)b->fix[bad].sz.numel * esz(b->pdt[bad]), NULL, 0);
    run_in_turn(a);
    run_batch(b, 2);
    assert_int_equal(b->st[bad], AM_SKIPPED_NONFINITE_GRAD);
    t_snap_check(&snap, &b->fix[bad], b->p[bad], NULL);
    assert_int_equal(b->st[0], AM_OK);
    same_sets(a, b);
    t_snap_free(&snap);
    set_free(a);
    set_free(b);
    free(a);
    free(b);
}

/* Everything of every item as before, and the statuses as documented. */
static void expect_rejected(set *s, am_batch_item *it, void *ws, size_t bytes, am_status want,
                            int culprit, const char *words) {
    t_snap snap[NP];
    int i;
    for (i = 0; i < NP; i++)
        t_snap_take(&snap[i], &s->fix[i], s->p[i],
                    (size_t)s->fix[i].sz.numel * esz(s->pdt[i]), NULL, 0);
    g_log.count = 0;
    assert_int_equal(am_update_batch(it, s->n, ws, bytes), want);
    assert_true(g_log.count > 0);
    assert_non_null(strstr(g_log.msg, words));
    for (i = 0; i < NP; i++) {
        t_snap_check(&snap[i], &s->fix[i], s->p[i], NULL);
        t_snap_free(&snap[i]);
        assert_int_equal(it[i].status, i == culprit ? want : AM_ERR_INVALID_ARGUMENT);
    }
}

static void test_errors(void **unused) {
    set *s = malloc(sizeof(set));
    am_batch_item it[NP];
    size_t bytes = 0, small = 0;
    void *ws;
    am_tensor wrong, alias, inner;
    am_state shared, own;
    (void)unused;
    assert_non_null(s);
    set_init(s, t_seed() + 11, AM_DTYPE_BFLOAT16, AM_DTYPE_FLOAT32);
    am_set_num_threads(2);
    items_of(s, it);
    assert_int_equal(am_update_batch_workspace(it, s->n, 2, &bytes), AM_OK);
    assert_int_equal(am_update_batch_workspace(it, s->n, 1, &small), AM_OK);
    assert_true(small < bytes);
    ws = t_calloc((int64_t)bytes);
    /* item 6: gradient of another shape */
    wrong = s->gt[5];
    it[6].grad = &wrong;
    expect_rejected(s, it, ws, bytes, AM_ERR_INVALID_SHAPE, 6, "am_update_batch: item 6: ");
    /* the workspace query names the item too (it had am_update's message
     * alone: which of the items was meant was not said) */
    g_log.count = 0;
    assert_int_equal(am_update_batch_workspace(it, s->n, 2, &small), AM_ERR_INVALID_SHAPE);
    assert_non_null(strstr(g_log.msg, "am_update_batch_workspace: item 6: "));
    assert_non_null(strstr(g_log.msg, "dims"));
    items_of(s, it);
    /* items 2 and 9 share a state buffer */
    shared = s->fix[9].st;
    shared.lr = s->fix[2].st.lr;
    it[9].state = &shared;
    assert_true(s->fix[2].sz.lr_count >= s->fix[9].sz.lr_count);
    expect_rejected(s, it, ws, bytes, AM_ERR_INVALID_ARGUMENT, -1, "items 2 and 9 share");
    items_of(s, it);
    /* two items writing one report (they raced on two threads) */
    {
        am_report shared_rep;
        it[3].report = &shared_rep;
        it[7].report = &shared_rep;
        expect_rejected(s, it, ws, bytes, AM_ERR_INVALID_ARGUMENT, -1, "items 3 and 7 share");
    }
    items_of(s, it);
    /* the same parameter twice */
    it[11].param = &s->pt[1];
    it[11].grad = &s->gt[1];
    it[11].state = &s->fix[1].st;
    expect_rejected(s, it, ws, bytes, AM_ERR_INVALID_ARGUMENT, -1, "items 1 and 11 share");
    items_of(s, it);
    /* item 4's gradient is item 2's parameter: in turn item 4 would read
     * item 2's result, on two threads at the same time as it is written */
    alias = s->gt[4];
    alias.data = s->p[2];
    it[4].grad = &alias;
    assert_true(s->fix[2].sz.numel * (int64_t)esz(s->pdt[2]) >=
                s->fix[4].sz.numel * (int64_t)esz(s->gdt[4]));
    expect_rejected(s, it, ws, bytes, AM_ERR_INVALID_ARGUMENT, -1,
                    "items 2 and 4 share memory (one's gradient");
    items_of(s, it);
    /* item 0's lrs inside its own parameter: refused by am_update's own
     * check (since the thirty-second session), as item 0 */
    own = s->fix[0].st;
    own.lr = (float *)s->p[0] + 8;
    it[0].state = &own;
    expect_rejected(s, it, ws, bytes, AM_ERR_INVALID_ARGUMENT, 0,
                    "item 0: param data and state lr share memory");
    items_of(s, it);
    /* item 0's report inside its own parameter (a report is not checked
     * against its own item's buffers), item 5's parameter inside it too,
     * after it: once found only by comparing each buffer with its
     * neighbour in address order, which is item 0's report */
    it[0].report = (am_report *)((char *)s->p[0] + 64);
    inner = s->pt[5];
    inner.data = (char *)s->p[0] + 4096;
    it[5].param = &inner;
    assert_true(4096 + s->fix[5].sz.numel * (int64_t)esz(s->pdt[5]) <=
                s->fix[0].sz.numel * (int64_t)esz(s->pdt[0]));
    assert_true(64 + sizeof(am_report) <= 4096);
    expect_rejected(s, it, ws, bytes, AM_ERR_INVALID_ARGUMENT, -1, "items 0 and 5 share");
    items_of(s, it);
    /* item 2's parameter inside its own gradient's range but running past
     * it, item 4's gradient over the start of that parameter: item 4's
     * gradient ends before item 2's, whose gradient (its own, allowed) is
     * the buffer reaching furthest when item 2's parameter comes */
    {
        const int64_t g2 = s->fix[2].sz.numel * (int64_t)esz(s->gdt[2]),
                      g4 = s->fix[4].sz.numel * (int64_t)esz(s->gdt[4]);
        char *buf = t_calloc(3 * g2);
        am_tensor p2 = s->pt[2], gr2 = s->gt[2], gr4 = s->gt[4];
        assert_true(g4 > 4096 && 4096 + g4 < g2);
        gr2.data = buf;
        p2.data = buf + 8192;
        gr4.data = buf + 4096;
        it[2].param = &p2;
        it[2].grad = &gr2;
        it[4].grad = &gr4;
        expect_rejected(s, it, ws, bytes, AM_ERR_INVALID_ARGUMENT, -1,
                        "items 2 and 4 share memory (one's gradient");
        free(buf);
    }
    items_of(s, it);
    /* less than one thread's workspace (the workspace for fewer threads
     * than run is used with fewer: test_same_bits) */
    expect_rejected(s, it, ws, small - 1, AM_ERR_BUFFER_SIZE, -1, "at least");
    /* NULL arguments */
    assert_int_equal(am_update_batch(NULL, 3, ws, bytes), AM_ERR_NULL_POINTER);
    assert_int_equal(am_update_batch(it, -1, ws, bytes), AM_ERR_INVALID_ARGUMENT);
    assert_int_equal(am_update_batch(it, 0, NULL, 0), AM_OK);
    assert_int_equal(am_update_batch_workspace(it, s->n, 0, &bytes), AM_ERR_INVALID_ARGUMENT);
    assert_int_equal(am_update_batch_workspace(it, s->n, 2, NULL), AM_ERR_NULL_POINTER);
    /* and, all arguments right, it runs */
    assert_int_equal(am_update_batch(it, s->n, ws, bytes), AM_OK);
    assert_int_equal(it[0].status, AM_OK);
    am_set_num_threads(1);
    free(ws);
    set_free(s);
    free(s);
}

/* A zero-element parameter of a huge shape needs a huge am_update
 * workspace of its own; one slot of it per thread once overflowed size_t
 * (a small size returned, then a crash in the update): now an error. */
static void test_workspace_overflow(void **unused) {
    enum { NI = 9 }; /* 9 slots at 9 threads: over 2^63 bytes */
    const int64_t dz[2] = {(int64_t)1 << 56, 0}, dr[2] = {8, 8};
    am_shape sz0 = t_shape(2, dz), sr = t_shape(2, dr);
    am_state_sizes zs;
    am_tensor zp = t_tensor(NULL, AM_DTYPE_FLOAT32, &sz0), rp[NI], rg[NI];
    am_state zst;
    am_hparams hp = am_hparams_default();
    am_batch_item it[NI];
    t_fix f[NI];
    float *p = t_calloc(NI * 64 * 4), *g = t_calloc(64 * 4);
    size_t bytes = 12345;
    int i;
    (void)unused;
    assert_int_equal(am_state_get_sizes(&sz0, &zs), AM_OK);
    assert_true(zs.workspace_bytes > ((int64_t)1 << 60));
    memset(&zst, 0, sizeof zst);
    memset(it, 0, sizeof it);
    it[0].param = &zp;
    it[0].grad = &zp;
    it[0].state = &zst;
    it[0].hp = &hp;
    for (i = 1; i < NI; i++) {
        t_fix_init(&f[i], &sr, 1e-4);
        rp[i] = t_tensor(p + 64 * i, AM_DTYPE_FLOAT32, &sr);
        rg[i] = t_tensor(g, AM_DTYPE_FLOAT32, &sr);
        it[i].param = &rp[i];
        it[i].grad = &rg[i];
        it[i].state = &f[i].st;
        it[i].hp = &hp;
    }
    g_log.count = 0;
    assert_int_equal(am_update_batch_workspace(it, NI, NI, &bytes), AM_ERR_INVALID_ARGUMENT);
    assert_int_equal(bytes, 12345); /* untouched */
    assert_non_null(strstr(g_log.msg, "would exceed"));
    /* one thread: one slot, representable */
    assert_int_equal(am_update_batch_workspace(it, NI, 1, &bytes), AM_OK);
    assert_true(bytes >= (size_t)zs.workspace_bytes);
    /* the batch needs one slot at least (then as many as fit): refused */
    am_set_num_threads(NI);
    g_log.count = 0;
    assert_int_equal(am_update_batch(it, NI, p, 64), AM_ERR_BUFFER_SIZE);
    assert_non_null(strstr(g_log.msg, "at least"));
    for (i = 0; i < NI * 64; i++) assert_true(p[i] == 0.0f); /* nothing ran */
    am_set_num_threads(1);
    for (i = 1; i < NI; i++) t_fix_free(&f[i]);
    free(p);
    free(g);
}

/* Weight tying: one buffer registered twice. On 2 threads update_all's
 * batch is refused (the items share memory) and it updates them one at a
 * time: the bits of 1 thread, and nothing logged (an ERROR from the refused
 * batch was logged at every call). */
static void tied_run(int threads, float *p, float *q, int64_t *nlog) {
    const int64_t d[2] = {64, 64}, d1[1] = {4096};
    am_hparams hp = am_hparams_default();
    am_optimizer *o = NULL;
    float *g = t_calloc(4096 * 4);
    int32_t id;
    int i;
    for (i = 0; i < 4096; i++) {
        p[i] = 0.01f * (float)(i % 11);
        q[i] = 0.0f;
        g[i] = 1e-3f * (float)((i % 5) - 2);
    }
    am_set_num_threads(threads);
    assert_int_equal(am_optimizer_create(&hp, 3, &o), AM_OK);
    assert_int_equal(am_optimizer_add_param(o, p, AM_DTYPE_FLOAT32, 2, d, &id), AM_OK);
    assert_int_equal(am_optimizer_add_param(o, p, AM_DTYPE_FLOAT32, 2, d, &id), AM_OK);
    assert_int_equal(am_optimizer_add_param(o, q, AM_DTYPE_FLOAT32, 1, d1, &id), AM_OK);
    g_log.count = 0;
    for (i = 0; i < 3; i++) {
        const void *gr[3] = {g, g, g};
        const am_dtype gd[3] = {AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32};
        assert_int_equal(am_optimizer_update_all(o, gr, gd, NULL), AM_OK);
    }
    *nlog = g_log.count;
    am_optimizer_destroy(o);
    am_set_num_threads(1);
    free(g);
}

static void test_tied_weights_update_all(void **unused) {
    float *p1 = t_calloc(4096 * 4), *q1 = t_calloc(4096 * 4);
    float *p2 = t_calloc(4096 * 4), *q2 = t_calloc(4096 * 4);
    int64_t n1 = -1, n2 = -1;
    (void)unused;
    tied_run(1, p1, q1, &n1);
    tied_run(2, p2, q2, &n2);
    assert_memory_equal(p1, p2, 4096 * 4);
    assert_memory_equal(q1, q2, 4096 * 4);
    assert_int_equal(n1, 0);
    assert_int_equal(n2, 0);
    free(p1);
    free(q1);
    free(p2);
    free(q2);
}

/* am_optimizer_update_all on 2 threads (one batch) against 1 (in turn):
 * the same parameters, lrs, skip count and reports. */
static void optimizer_run(int threads, float *w0, uint16_t *w1, float *w2, int64_t *skipped,
                          am_report *reps) {
    static const int64_t s0[2] = {300, 200}, s1[2] = {64, 48}, s2[1] = {999};
    am_optimizer *o = NULL;
    float g0[300 * 200], g2[999];
    uint16_t g1[64 * 48];
    const void *grads[3] = {g0, g1, g2};
    const am_dtype gds[3] = {AM_DTYPE_FLOAT32, AM_DTYPE_BFLOAT16, AM_DTYPE_FLOAT32};
    am_hparams hp = am_hparams_default();
    uint64_t r = 99;
    int32_t id;
    int step, i;
    am_set_num_threads(threads);
    assert_int_equal(am_optimizer_create(&hp, 5, &o), AM_OK);
    assert_int_equal(am_optimizer_add_param(o, w0, AM_DTYPE_FLOAT32, 2, s0, &id), AM_OK);
    assert_int_equal(am_optimizer_add_param(o, w1, AM_DTYPE_BFLOAT16, 2, s1, &id), AM_OK);
    assert_int_equal(am_optimizer_add_param(o, w2, AM_DTYPE_FLOAT32, 1, s2, &id), AM_OK);
    for (step = 0; step < 3; step++) {
        for (i = 0; i < 300 * 200; i++) t_store_random(g0, AM_DTYPE_FLOAT32, i, &r, -12, -4);
        for (i = 0; i < 64 * 48; i++) t_store_random(g1, AM_DTYPE_BFLOAT16, i, &r, -12, -4);
        for (i = 0; i < 999; i++) t_store_random(g2, AM_DTYPE_FLOAT32, i, &r, -12, -4);
        if (step == 1) g2[7] = NAN; /* parameter 2 skips this step */
        assert_int_equal(am_optimizer_update_all(o, grads, gds, reps),
                         step == 1 ? AM_SKIPPED_NONFINITE_GRAD : AM_OK);
    }
    *skipped = am_optimizer_skipped_count(o);
    am_optimizer_destroy(o);
    am_set_num_threads(1);
}

static void test_optimizer_update_all(void **unused) {
    static float a0[300 * 200], b0[300 * 200], a2[999], b2[999];
    static uint16_t a1[64 * 48], b1[64 * 48];
    am_report ra[3], rb[3];
    int64_t sa, sb;
    uint64_t r = t_seed();
    int i;
    (void)unused;
    for (i = 0; i < 300 * 200; i++) t_store_random(a0, AM_DTYPE_FLOAT32, i, &r, -6, 0);
    for (i = 0; i < 64 * 48; i++) t_store_random(a1, AM_DTYPE_BFLOAT16, i, &r, -6, 0);
    for (i = 0; i < 999; i++) t_store_random(a2, AM_DTYPE_FLOAT32, i, &r, -6, 0);
    memcpy(b0, a0, sizeof a0);
    memcpy(b1, a1, sizeof a1);
    memcpy(b2, a2, sizeof a2);
    optimizer_run(1, a0, a1, a2, &sa, ra);
    optimizer_run(2, b0, b1, b2, &sb, rb);
    assert_memory_equal(a0, b0, sizeof a0);
    assert_memory_equal(a1, b1, sizeof a1);
    assert_memory_equal(a2, b2, sizeof a2);
    assert_int_equal(sa, 1);
    assert_int_equal(sb, 1);
    for (i = 0; i < 3; i++) {
        assert_int_equal(ra[i].status, rb[i].status);
        assert_memory_equal(&ra[i].clip_scale, &rb[i].clip_scale, sizeof(float));
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_same_bits),
        cmocka_unit_test(test_nonfinite_item),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_workspace_overflow),
        cmocka_unit_test(test_tied_weights_update_all),
        cmocka_unit_test(test_optimizer_update_all),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
