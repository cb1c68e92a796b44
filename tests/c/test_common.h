/*
 * test_common.h — helpers shared by the C unit tests: state buffers for a
 * shape (caller-owned, as a kernel-layer user would hold them), byte-for-byte
 * snapshots of everything an update may touch, shapes, a seeded generator for
 * test data, independent 16-bit float decoders, and a log-message catcher.
 *
 * Everything is static inline so that a test that uses only part of it still
 * compiles warning-free.
 */
#ifndef AM_TEST_COMMON_H
#define AM_TEST_COMMON_H

#include <automagic.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ seeds ---- */

/* The seed of the randomised cases: AM_TEST_SEED from the environment, or a
 * fixed default, printed once so a failure can be replayed. */
static inline uint64_t t_seed(void) {
    static int printed;
    static uint64_t seed = 20261202u;
    if (!printed) {
        const char *e = getenv("AM_TEST_SEED");
        if (e && *e) seed = strtoull(e, NULL, 0);
        printf("[ seed     ] AM_TEST_SEED=%llu\n", (unsigned long long)seed);
        fflush(stdout);
        printed = 1;
    }
    return seed;
}

/* splitmix64: test data only (the library's randomness is Philox). */
static inline uint64_t t_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static inline double t_unif(uint64_t *s) {
    return (double)(t_next(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

/* ----------------------------------------------------------- shapes ---- */

static inline am_shape t_shape(int32_t ndim, const int64_t *dims) {
    am_shape s;
    int32_t d;
    memset(&s, 0, sizeof s);
    s.ndim = ndim;
    for (d = 0; d < ndim && d < AM_MAX_DIMS; d++) s.dims[d] = dims[d];
    return s;
}

static inline int64_t t_numel(const am_shape *s) {
    int64_t n = 1;
    int32_t d;
    for (d = 0; d < s->ndim; d++) n *= s->dims[d];
    return n;
}

static inline const char *t_shape_str(const am_shape *s) {
    static char buf[160];
    int32_t d;
    size_t len;
    snprintf(buf, sizeof buf, "{");
    for (d = 0; d < s->ndim; d++) {
        len = strlen(buf);
        snprintf(buf + len, sizeof buf - len, "%s%lld", d ? "," : "",
                 (long long)s->dims[d]);
    }
    len = strlen(buf);
    snprintf(buf + len, sizeof buf - len, "}");
    return buf;
}

/* ------------------------------------------------ 16-bit decoders ------ */

/* Written from the IEEE 754 binary16 definition, independent of the
 * library's converters. */
static inline double t_f16_to_double(uint16_t h) {
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 31) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexp((double)m, -24);
    else v = ldexp(1.0 + m / 1024.0, e - 15);
    return s ? -v : v;
}

/* bfloat16 is the top half of a binary32. */
static inline double t_bf16_to_double(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return (double)f;
}

static inline double t_load(const void *base, am_dtype dt, int64_t i) {
    if (dt == AM_DTYPE_FLOAT32) return (double)((const float *)base)[i];
    if (dt == AM_DTYPE_BFLOAT16) return t_bf16_to_double(((const uint16_t *)base)[i]);
    return t_f16_to_double(((const uint16_t *)base)[i]);
}

/* A random value of dtype dt with magnitude in about [2^lo, 2^hi), stored at
 * element i. Built from bits, so every value is exactly representable and
 * no converter is involved. lo, hi within the dtype's normal range. */
static inline void t_store_random(void *base, am_dtype dt, int64_t i,
                                  uint64_t *s, int lo, int hi) {
    uint64_t r = t_next(s);
    int sign = (int)(r & 1), e = lo + (int)((r >> 1) % (uint64_t)(hi - lo));
    uint32_t man = (uint32_t)(r >> 20);
    if (dt == AM_DTYPE_FLOAT32) {
        uint32_t u = ((uint32_t)sign << 31) | ((uint32_t)(e + 127) << 23) |
                     (man & 0x7fffffu);
        memcpy((float *)base + i, &u, 4);
    } else if (dt == AM_DTYPE_BFLOAT16) {
        ((uint16_t *)base)[i] = (uint16_t)((sign << 15) | ((e + 127) << 7) |
                                           (man & 0x7f));
    } else {
        ((uint16_t *)base)[i] = (uint16_t)((sign << 15) | ((e + 15) << 10) |
                                           (man & 0x3ff));
    }
}

/* --------------------------------------------------- state buffers ----- */

/* One parameter's caller-owned buffers. Every buffer has at least 64 bytes
 * so that a pointer is never NULL by accident; the am_state points only at
 * the ones the shape needs (row/col NULL for ndim <= 1, sq NULL otherwise,
 * as the header documents). */
typedef struct t_fix {
    am_shape shape;
    am_state_sizes sz;
    am_state st;
    void *ws;
    size_t ws_bytes;
} t_fix;

static inline void *t_calloc(int64_t bytes) {
    void *p = calloc(1, (size_t)(bytes > 64 ? bytes : 64));
    assert_non_null(p);
    return p;
}

static inline void t_fix_init(t_fix *f, const am_shape *shape, double lr) {
    memset(f, 0, sizeof *f);
    f->shape = *shape;
    assert_int_equal(am_state_get_sizes(shape, &f->sz), AM_OK);
    f->st.lr = (float *)t_calloc(f->sz.lr_count * 4);
    f->st.polarity = (uint8_t *)t_calloc(f->sz.polarity_bytes);
    if (shape->ndim >= 2) {
        f->st.row = (float *)t_calloc(f->sz.row_count * 4);
        f->st.col = (float *)t_calloc(f->sz.col_count * 4);
    } else {
        f->st.sq = (float *)t_calloc(f->sz.sq_count * 4);
    }
    f->ws_bytes = (size_t)f->sz.workspace_bytes;
    f->ws = t_calloc((int64_t)f->ws_bytes);
    assert_int_equal(am_state_init(shape, &f->st, lr), AM_OK);
}

static inline void t_fix_free(t_fix *f) {
    free(f->st.lr);
    free(f->st.polarity);
    free(f->st.row);
    free(f->st.col);
    free(f->st.sq);
    free(f->ws);
    memset(f, 0, sizeof *f);
}

static inline am_tensor t_tensor(void *data, am_dtype dt, const am_shape *s) {
    am_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dt;
    t.shape = *s;
    return t;
}

/* ------------------------------------------------------- snapshots ----- */

/* Copies of every byte an update may modify: the parameter, the gradient,
 * the state struct and each state buffer. */
typedef struct t_snap {
    void *param, *grad;
    size_t param_bytes, grad_bytes;
    am_state st;
    void *lr, *pol, *row, *col, *sq;
    size_t lr_b, pol_b, row_b, col_b, sq_b;
} t_snap;

static inline void *t_dup(const void *p, size_t n) {
    void *q;
    if (!p || n == 0) return NULL;
    q = malloc(n);
    assert_non_null(q);
    memcpy(q, p, n);
    return q;
}

static inline void t_snap_take(t_snap *s, const t_fix *f, const void *param,
                               size_t param_bytes, const void *grad,
                               size_t grad_bytes) {
    memset(s, 0, sizeof *s);
    s->param_bytes = param_bytes;
    s->grad_bytes = grad_bytes;
    s->param = t_dup(param, param_bytes);
    s->grad = t_dup(grad, grad_bytes);
    s->st = f->st;
    s->lr_b = (size_t)f->sz.lr_count * 4;
    s->pol_b = (size_t)f->sz.polarity_bytes;
    s->row_b = (size_t)f->sz.row_count * 4;
    s->col_b = (size_t)f->sz.col_count * 4;
    s->sq_b = (size_t)f->sz.sq_count * 4;
    s->lr = t_dup(f->st.lr, s->lr_b);
    s->pol = t_dup(f->st.polarity, s->pol_b);
    s->row = t_dup(f->st.row, s->row_b);
    s->col = t_dup(f->st.col, s->col_b);
    s->sq = t_dup(f->st.sq, s->sq_b);
}

/* Fails unless everything is byte-for-byte as when s was taken. */
static inline void t_snap_check(const t_snap *s, const t_fix *f,
                                const void *param, const void *grad) {
    if (s->param_bytes) assert_memory_equal(s->param, param, s->param_bytes);
    if (s->grad_bytes) assert_memory_equal(s->grad, grad, s->grad_bytes);
    assert_memory_equal(&s->st, &f->st, sizeof s->st);
    if (s->lr_b) assert_memory_equal(s->lr, f->st.lr, s->lr_b);
    if (s->pol_b) assert_memory_equal(s->pol, f->st.polarity, s->pol_b);
    if (s->row_b) assert_memory_equal(s->row, f->st.row, s->row_b);
    if (s->col_b) assert_memory_equal(s->col, f->st.col, s->col_b);
    if (s->sq_b) assert_memory_equal(s->sq, f->st.sq, s->sq_b);
}

static inline void t_snap_free(t_snap *s) {
    free(s->param);
    free(s->grad);
    free(s->lr);
    free(s->pol);
    free(s->row);
    free(s->col);
    free(s->sq);
    memset(s, 0, sizeof *s);
}

/* ------------------------------------------------------------- log ----- */

/* The last message the library logged, to check that errors name the
 * offending argument. */
typedef struct t_logbuf {
    char msg[512];
    int count;
    am_log_level level;
} t_logbuf;

static inline void t_log_fn(am_log_level level, const char *msg, void *user) {
    t_logbuf *b = (t_logbuf *)user;
    snprintf(b->msg, sizeof b->msg, "%s", msg);
    b->level = level;
    b->count++;
}

/* Defines, in the test file that uses it, g_log (a t_logbuf), and the cmocka
 * group setup/teardown that install it as the library's log callback and
 * remove it. EXPECT_ERR(call, want) then checks a status and that the call
 * logged a fresh error message. */
#define T_ERROR_LOG_FIXTURE()                                                  \
    static t_logbuf g_log;                                                     \
    static int setup(void **unused) {                                          \
        (void)unused;                                                          \
        am_set_log_callback(t_log_fn, &g_log);                                 \
        return 0;                                                              \
    }                                                                          \
    static int teardown(void **unused) {                                       \
        (void)unused;                                                          \
        am_set_log_callback(NULL, NULL);                                       \
        return 0;                                                              \
    }

#define EXPECT_ERR(call, want)                                                 \
    do {                                                                       \
        int c0_ = g_log.count;                                                 \
        am_status s_ = (call);                                                 \
        if (s_ != (want))                                                      \
            fail_msg("%s: got %d (%s), want %d", #call, (int)s_,               \
                     am_status_string(s_), (int)(want));                       \
        if (g_log.count == c0_) fail_msg("%s: no error message logged", #call); \
    } while (0)

#endif /* AM_TEST_COMMON_H */
