/* fuzz_api.c — libFuzzer target for the public API's argument handling.
 *
 * The input is a little program: each operation byte picks a call, and the
 * following bytes pick its arguments from valid values, boundary values
 * (0, -1, INT64_MIN/MAX, 2^31, 2^40, NaN, +-Inf, denormals) and raw bits:
 * shapes, dtypes, hyperparameters, step counters, workspace sizes, state
 * contents, gradient values, ids, buffer capacities. Invariants (a
 * violation traps): any status but AM_OK leaves the parameter, gradient and
 * state bytes as they were (the update family may write only workspace and
 * report); AM_OK increments the step exactly when there are elements; every
 * status is a documented value. Allocations are bounded so that valid
 * shapes stay small. */
#include <automagic.h>

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_input.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(c)                                                              \
    do {                                                                      \
        if (!(c)) __builtin_trap();                                           \
    } while (0)

#define MAX_NUMEL 2048
#define MAX_WS (1 << 20)


static int64_t pick_i64(rd *r) {
    uint8_t b = u8(r);
    if (b < 160) return b % 24;
    switch (b % 10) {
    case 0: return -1;
    case 1: return INT64_MIN;
    case 2: return INT64_MAX;
    case 3: return (int64_t)1 << 31;
    case 4: return (int64_t)1 << 40;
    case 5: return 65536;
    case 6: return -(int64_t)(u8(r) + 1);
    case 7: return INT32_MAX;
    default: return (int64_t)u64(r);
    }
}

static double pick_double(rd *r, double normal) {
    uint8_t b = u8(r);
    if (b < 128) return normal;
    switch (b % 14) {
    case 0: return NAN;
    case 1: return INFINITY;
    case 2: return -INFINITY;
    case 3: return 0.0;
    case 4: return -0.0;
    case 5: return 1.0;
    case 6: return -1.0;
    case 7: return 4.9e-324;
    case 8: return 0.999999999;
    case 9: return 1e300;
    case 10: return DBL_MAX;
    case 11: return 1e-45;
    default: {
        uint64_t bits = u64(r);
        double d;
        memcpy(&d, &bits, 8);
        return d;
    }
    }
}

static am_hparams pick_hp(rd *r) {
    am_hparams hp = am_hparams_default();
    hp.lr = pick_double(r, 1e-3);
    hp.min_lr = pick_double(r, hp.min_lr);
    hp.max_lr = pick_double(r, hp.max_lr);
    hp.lr_bump_rate = pick_double(r, hp.lr_bump_rate);
    hp.beta2 = pick_double(r, hp.beta2);
    hp.eps = pick_double(r, hp.eps);
    hp.clip_threshold = pick_double(r, hp.clip_threshold);
    hp.weight_decay = pick_double(r, hp.weight_decay);
    return hp;
}

static am_dtype pick_dtype(rd *r) {
    uint8_t b = u8(r);
    if (b < 240) return (am_dtype)(b % 3);
    return (am_dtype)(b % 2 ? 3 : -1);
}

static void pick_shape(rd *r, am_shape *s) {
    int32_t d;
    uint8_t b = u8(r);
    memset(s, 0, sizeof *s);
    s->ndim = b < 250 ? (int32_t)(b % 5) : (b % 2 ? 9 : -1);
    for (d = 0; d < AM_MAX_DIMS; d++) {
        uint8_t c = u8(r);
        s->dims[d] = c < 200 ? (int64_t)(c % 9) : pick_i64(r);
    }
}

/* Fills n bytes from the input (zeros when it runs out). */
static void fill(rd *r, void *dst, size_t n) {
    size_t k = n < r->n ? n : r->n;
    memcpy(dst, r->p, k);
    memset((unsigned char *)dst + k, 0, n - k);
    r->p += k;
    r->n -= k;
}

static int is_known_status(am_status s) {
    return (s >= AM_OK && s <= AM_SKIPPED_NONFINITE_UPDATE) ||
           (s <= AM_ERR_NULL_POINTER && s >= AM_ERR_DEVICE);
}

/* One call of the update family on caller-owned buffers. */
static void op_update(rd *r) {
    am_shape sh;
    am_state_sizes z;
    am_tensor p, g;
    am_state st, st0;
    am_hparams hp;
    am_rng_key key;
    am_report rep;
    unsigned char *pbuf = NULL, *gbuf = NULL, *sbuf = NULL, *ws = NULL, *snap = NULL;
    size_t pbytes = 0, gbytes = 0, sbytes = 0, wsb = 0;
    am_status s;
    uint8_t how;
    pick_shape(r, &sh);
    memset(&p, 0, sizeof p);
    memset(&st, 0, sizeof st);
    p.dtype = pick_dtype(r);
    p.shape = sh;
    g = p;
    g.dtype = pick_dtype(r);
    if (u8(r) > 240) g.shape.dims[u8(r) % AM_MAX_DIMS] ^= 1; /* mismatched grad */
    hp = pick_hp(r);
    key.seed = u64(r);
    key.param_id = (uint32_t)u64(r);
    how = u8(r);
    if (am_state_get_sizes(&sh, &z) == AM_OK && z.numel <= MAX_NUMEL &&
        z.lr_count <= MAX_NUMEL && z.row_count <= MAX_NUMEL && z.col_count <= MAX_NUMEL &&
        z.workspace_bytes <= MAX_WS) {
        /* each buffer 8-aligned: the caller owes the library aligned floats */
#define AL8(x) (((x) + 7u) & ~(size_t)7u)
        size_t lrb = AL8((size_t)z.lr_count * 4), pb = AL8((size_t)z.polarity_bytes);
        size_t rb = AL8((size_t)z.row_count * 4), cb = AL8((size_t)z.col_count * 4);
        size_t qb = AL8((size_t)z.sq_count * 4);
        pbytes = (size_t)z.numel * 4; /* room for any dtype */
        gbytes = pbytes;
        sbytes = lrb + pb + rb + cb + qb;
        pbuf = (unsigned char *)malloc(pbytes + 1);
        gbuf = (unsigned char *)malloc(gbytes + 1);
        sbuf = (unsigned char *)calloc(1, sbytes + 1); /* alignment gaps defined */
        CHECK(pbuf && gbuf && sbuf);
        fill(r, pbuf, pbytes);
        fill(r, gbuf, gbytes);
        st.lr = (float *)sbuf;
        st.polarity = sbuf + lrb;
        st.row = rb ? (float *)(sbuf + lrb + pb) : NULL;
        st.col = cb ? (float *)(sbuf + lrb + pb + rb) : NULL;
        st.sq = qb ? (float *)(sbuf + lrb + pb + rb + cb) : NULL;
        if (how & 1) {
            fill(r, sbuf, sbytes); /* arbitrary state contents */
            st.step = pick_i64(r);
        } else {
            s = am_state_init(&sh, &st, pick_double(r, 1e-3));
            CHECK(is_known_status(s));
            if (am_status_is_error(s)) memset(sbuf, 0, sbytes);
        }
        if (how & 2) st.polarity = NULL;
        p.data = (how & 4) ? NULL : pbuf;
        g.data = (how & 8) ? NULL : gbuf;
        wsb = (size_t)z.workspace_bytes;
        if (how & 16) wsb = (size_t)((int64_t)wsb - (int64_t)(u8(r) % 80));
        ws = (unsigned char *)malloc(wsb + 64);
        CHECK(ws != NULL);
        memset(ws, 0, wsb + 64);
    } else {
        /* invalid or large shape: tiny buffers and workspace; the call must
         * refuse before touching them */
        static float tiny[4];
        static unsigned char tws[256];
        p.data = g.data = tiny;
        st.lr = st.row = st.col = st.sq = tiny;
        st.polarity = (uint8_t *)tiny;
        st.step = pick_i64(r);
        ws = NULL;
        wsb = 8; /* below any valid workspace: a large valid shape must stop
                    at AM_ERR_BUFFER_SIZE before reading the tiny buffers */
        CHECK(am_update(&p, &g, &st, &hp, key, tws, wsb, &rep) != AM_OK ||
              am_state_get_sizes(&sh, &z) == AM_OK);
        return;
    }
    st0 = st;
    snap = (unsigned char *)malloc(pbytes + gbytes + sbytes + 1);
    CHECK(snap != NULL);
    memcpy(snap, pbuf, pbytes);
    memcpy(snap + pbytes, gbuf, gbytes);
    memcpy(snap + pbytes + gbytes, sbuf, sbytes);
    switch ((how >> 5) % 4) {
    case 0: s = am_update(&p, &g, &st, &hp, key, ws, wsb, (how & 128) ? NULL : &rep); break;
    case 1:
        if (u8(r) & 1) { /* a shard of a parameter of any dims[0] (valid or not) */
            am_shard shard;
            shard.dim0_total = pick_i64(r);
            shard.dim0_offset = pick_i64(r);
            s = am_update_stats_shard(&p, &g, &st, &hp, &shard, ws, wsb);
        } else {
            s = am_update_stats(&p, &g, &st, &hp, ws, wsb);
        }
        if (s == AM_OK) s = am_update_moments(&p, &g, &st, &hp, ws, wsb);
        if (s == AM_OK) s = am_update_finish(&p, &g, &st, &hp, key, ws, wsb, &rep);
        break;
    case 2: s = am_update_moments(&p, &g, &st, &hp, ws, wsb); break; /* out of order */
    default: s = am_update_finish(&p, &g, &st, &hp, key, ws, wsb, &rep); break;
    }
    CHECK(is_known_status(s));
    CHECK(memcmp(snap + pbytes, gbuf, gbytes) == 0); /* grad never written */
    if (s != AM_OK) {
        CHECK(memcmp(snap, pbuf, pbytes) == 0);
        CHECK(memcmp(snap + pbytes + gbytes, sbuf, sbytes) == 0);
        CHECK(st.step == st0.step);
    } else if ((how >> 5) % 4 <= 1) {
        CHECK(st.step == st0.step + (z.numel > 0));
    }
    free(snap);
    free(pbuf);
    free(gbuf);
    free(sbuf);
    free(ws);
}

/* The optimizer object: create, add, update, query, save/load. */
static void op_optimizer(rd *r) {
    am_optimizer *o = NULL;
    am_hparams hp = pick_hp(r);
    static float params[4][MAX_NUMEL];
    float grad[MAX_NUMEL];
    int k, nops;
    am_status s = am_optimizer_create(&hp, u64(r), &o);
    CHECK(is_known_status(s));
    if (s != AM_OK) {
        CHECK(o == NULL);
        return;
    }
    for (k = 0; k < 4; k++) {
        am_shape sh;
        am_state_sizes z;
        int32_t id = -77;
        am_dtype dt = pick_dtype(r);
        pick_shape(r, &sh);
        /* keep allocations small: zero-element shapes can still have many
         * lr-rows or moment rows ([2^31, 0] has 2^31 lrs) */
        if (am_state_get_sizes(&sh, &z) == AM_OK &&
            (z.numel > MAX_NUMEL / 2 || z.lr_count > MAX_NUMEL || z.row_count > MAX_NUMEL ||
             z.col_count > MAX_NUMEL || z.workspace_bytes > MAX_WS))
            continue;
        fill(r, params[k], sizeof params[k]);
        s = am_optimizer_add_param(o, (u8(r) > 250) ? NULL : params[k], dt, sh.ndim,
                                   (u8(r) > 250) ? NULL : sh.dims, &id);
        CHECK(is_known_status(s));
        CHECK(s == AM_OK ? id == am_optimizer_num_params(o) - 1 : id == -77);
    }
    nops = u8(r) % 16;
    for (k = 0; k < nops; k++) {
        int32_t id = (int32_t)(pick_i64(r) % 6);
        uint8_t what = u8(r);
        fill(r, grad, sizeof grad);
        switch (what % 6) {
        case 0:
            CHECK(is_known_status(am_optimizer_update_param(o, id, grad, pick_dtype(r), NULL)));
            break;
        case 1: {
            const void *gs[4] = {grad, grad, (what & 64) ? NULL : grad, grad};
            am_dtype ds[4];
            am_report reps[4];
            int i;
            for (i = 0; i < 4; i++) ds[i] = pick_dtype(r);
            CHECK(is_known_status(am_optimizer_update_all(o, gs, ds, reps)));
            break;
        }
        case 2: {
            float lrs[MAX_NUMEL];
            int64_t cnt = pick_i64(r);
            if (cnt > MAX_NUMEL) cnt = MAX_NUMEL;
            CHECK(is_known_status(am_optimizer_get_lrs(o, id, lrs, cnt)));
            break;
        }
        case 3: {
            double mean;
            am_state st;
            am_shape sh;
            CHECK(is_known_status(am_optimizer_lr_mean(o, id, &mean)));
            CHECK(is_known_status(am_optimizer_get_state(o, id, &st, &sh)));
            (void)am_optimizer_lr_count(o, id);
            (void)am_optimizer_skipped_count(o);
            break;
        }
        case 4: { /* round trip through a checkpoint image */
            size_t n = 0, cap = (size_t)(u8(r)) * 64;
            unsigned char *buf = (unsigned char *)malloc(cap + 1);
            CHECK(buf != NULL);
            s = am_optimizer_save_memory(o, buf, cap, &n);
            CHECK(s == AM_OK || s == AM_ERR_BUFFER_SIZE);
            if (s == AM_OK) CHECK(am_optimizer_load_memory(o, buf, n) == AM_OK);
            free(buf);
            break;
        }
        default: { /* the rest of the input as a checkpoint */
            size_t n = r->n < 4096 ? r->n : 4096;
            CHECK(is_known_status(am_optimizer_load_memory(o, r->p, n)));
            r->p += n;
            r->n -= n;
            break;
        }
        }
    }
    am_optimizer_destroy(o);
}

static void op_misc(rd *r) {
    am_shape sh;
    am_state_sizes z;
    am_workspace_view v;
    unsigned char ws[512];
    am_hparams hp = pick_hp(r);
    int n = (int)(int8_t)u8(r);
    CHECK(is_known_status(am_hparams_validate(&hp)));
    pick_shape(r, &sh);
    CHECK(is_known_status(am_state_get_sizes(&sh, &z)));
    CHECK(is_known_status(am_workspace_view_get(&sh, ws, (size_t)(u8(r)) * 2, &v)));
    (void)am_status_string((am_status)(int8_t)u8(r));
    (void)am_dtype_name(pick_dtype(r));
    (void)am_dtype_size(pick_dtype(r));
    /* thread count: set and restore (process-wide) */
    if (am_set_num_threads(n % 5) == AM_OK) CHECK(am_set_num_threads(1) == AM_OK);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    rd r;
    int ops = 0;
    r.p = data;
    r.n = size;
    while (r.n > 0 && ops++ < 16) {
        switch (u8(&r) % 3) {
        case 0: op_update(&r); break;
        case 1: op_optimizer(&r); break;
        default: op_misc(&r); break;
        }
    }
    return 0;
}
