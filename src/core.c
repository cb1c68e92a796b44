/* core.c — version, status strings, dtypes, logging, hyperparameters. */
#include "internal.h"

#include "fpenv.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int am_version_number(void) { return AM_VERSION_NUMBER; }

#define AM_STR2(x) #x
#define AM_STR(x) AM_STR2(x)
const char *am_version_string(void) {
    return AM_STR(AM_VERSION_MAJOR) "." AM_STR(AM_VERSION_MINOR) "." AM_STR(
        AM_VERSION_PATCH);
}

int am_status_is_error(am_status s) { return (int)s < 0; }

const char *am_status_string(am_status s) {
    switch (s) {
    case AM_OK: return "ok";
    case AM_SKIPPED_NONFINITE_GRAD: return "skipped: non-finite gradient";
    case AM_SKIPPED_NONFINITE_UPDATE: return "skipped: non-finite update";
    case AM_ERR_NULL_POINTER: return "null pointer argument";
    case AM_ERR_INVALID_DTYPE: return "invalid dtype";
    case AM_ERR_INVALID_SHAPE: return "invalid shape";
    case AM_ERR_INVALID_HPARAM: return "invalid hyperparameter";
    case AM_ERR_BUFFER_SIZE: return "buffer too small";
    case AM_ERR_OUT_OF_MEMORY: return "out of memory";
    case AM_ERR_NOT_FOUND: return "no such parameter";
    case AM_ERR_INVALID_ARGUMENT: return "invalid argument";
    case AM_ERR_IO: return "input/output error";
    case AM_ERR_FORMAT: return "invalid checkpoint format";
    case AM_ERR_MISMATCH: return "checkpoint does not match the parameters";
    case AM_ERR_UNSUPPORTED: return "not supported (by this build, or beyond a documented limit)";
    case AM_ERR_DEVICE: return "device error";
    }
    return "unknown status";
}

size_t am_dtype_size(am_dtype dtype) {
    switch (dtype) {
    case AM_DTYPE_FLOAT32: return 4;
    case AM_DTYPE_BFLOAT16:
    case AM_DTYPE_FLOAT16: return 2;
    }
    return 0;
}

const char *am_dtype_name(am_dtype dtype) {
    switch (dtype) {
    case AM_DTYPE_FLOAT32: return "float32";
    case AM_DTYPE_BFLOAT16: return "bfloat16";
    case AM_DTYPE_FLOAT16: return "float16";
    }
    return "invalid";
}

static am_log_fn g_log_fn;
static void *g_log_user;

am_status am_set_log_callback(am_log_fn fn, void *user) {
    g_log_fn = fn;
    g_log_user = user;
    return AM_OK;
}

static _Thread_local int g_log_muted;
static _Thread_local const char *g_log_fn_name;
static _Thread_local int64_t g_log_index = -1;
static _Thread_local const char *g_log_what = "item";

void am_log_item(const char *fn, int64_t index) {
    g_log_fn_name = fn;
    g_log_index = index;
    g_log_what = "item";
}

void am_log_param(const char *fn, int64_t id) {
    g_log_fn_name = fn;
    g_log_index = id;
    g_log_what = "parameter";
}

int am_log_mute(int on) {
    const int was = g_log_muted;
    g_log_muted = on;
    return was;
}

/* A message longer than the stack buffer (a long path: the reason after it
 * was cut off at 511 bytes; found by a review, twenty-fourth session) is
 * formatted again into the heap; if that fails, the cut one ends in "...".
 * ctx: prefixed with the calling thread's item or parameter. */
static void log_v(am_log_level level, int ctx, const char *fmt, va_list ap) {
    char buf[512], *big = NULL;
    va_list again;
    int n;
    am_log_fn fn = g_log_fn;
    int pre = 0;
    if (!fn) return;
    if (ctx && g_log_index >= 0)
        pre = snprintf(buf, sizeof buf, "%s: %s %lld: ", g_log_fn_name, g_log_what,
                       (long long)g_log_index);
    va_copy(again, ap);
    n = pre + vsnprintf(buf + pre, sizeof buf - (size_t)pre, fmt, ap);
    if (n >= (int)sizeof buf) {
        big = (char *)malloc((size_t)n + 1);
        if (big) {
            memcpy(big, buf, (size_t)pre);
            vsnprintf(big + pre, (size_t)(n - pre) + 1, fmt, again);
        } else {
            memcpy(buf + sizeof buf - 4, "...", 4);
        }
    }
    va_end(again);
    fn(level, big ? big : buf, g_log_user);
    free(big);
}

void am_log(am_log_level level, const char *fmt, ...) {
    va_list ap;
    if (g_log_muted) return;
    va_start(ap, fmt);
    log_v(level, 1, fmt, ap);
    va_end(ap);
}

/* (the kernel choice's messages were lost for good when the first update
 * was a muted batch, and named one parameter otherwise; found by a review,
 * thirty-fourth session) */
void am_log_global(am_log_level level, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    log_v(level, 0, fmt, ap);
    va_end(ap);
}

am_hparams am_hparams_default(void) {
    am_hparams hp;
    hp.lr = 1e-6;
    hp.min_lr = 1e-8;
    hp.max_lr = 1e-2;
    hp.lr_bump_rate = 0.1;
    hp.beta2 = 0.999;
    hp.eps = 1e-30;
    hp.clip_threshold = 1.0;
    hp.weight_decay = 0.0;
    return hp;
}

#define AM_HP_CHECK(ok, name, val, rule)                                      \
    AM_RETURN_IF(!(ok), AM_ERR_INVALID_HPARAM,                                \
                 "invalid hyperparameter %s = %g: must be %s", name, val, rule)

static am_status validate_impl(const am_hparams *hp) {
    AM_RETURN_IF(!hp, AM_ERR_NULL_POINTER, "hparams is NULL");
    /* Written so that NaN fails every test. */
    /* Finite means finite in float32, the kernels' precision: a value
     * that rounds to infinity there made the update write inf/NaN into the
     * parameter (weight_decay) or its lrs (lr_bump_rate, max_lr) while
     * returning AM_OK (found by a review, twenty-second session). */
    AM_HP_CHECK(hp->lr > 0 && isfinite((float)hp->lr), "lr", hp->lr,
                "> 0 and finite in float32 (at most 3.4028235e38)");
    /* the state holds lrs in float32: one that rounds to 0 there would be
     * refused by every am_state_init, i.e. every parameter added */
    AM_HP_CHECK((float)hp->lr > 0, "lr", hp->lr,
                "at least float32's smallest positive value, 1.4e-45 (it rounds to 0)");
    AM_HP_CHECK(hp->max_lr >= 0 && isfinite((float)hp->max_lr), "max_lr", hp->max_lr,
                ">= 0 and finite in float32 (at most 3.4028235e38)");
    AM_HP_CHECK(hp->min_lr >= 0 && hp->min_lr <= hp->max_lr, "min_lr",
                hp->min_lr, ">= 0 and <= max_lr");
    AM_HP_CHECK(hp->lr_bump_rate >= 0 && isfinite((float)hp->lr_bump_rate),
                "lr_bump_rate", hp->lr_bump_rate,
                ">= 0 and finite in float32 (at most 3.4028235e38)");
    AM_HP_CHECK(hp->beta2 >= 0 && hp->beta2 < 1, "beta2", hp->beta2,
                "in [0, 1)");
    AM_HP_CHECK(hp->eps >= 0 && isfinite((float)hp->eps), "eps", hp->eps,
                ">= 0 and finite in float32 (at most 3.4028235e38)");
    /* +inf is allowed: it disables clipping (so does any value beyond
     * float32's range, which rounds to +inf). */
    AM_HP_CHECK(hp->clip_threshold > 0, "clip_threshold", hp->clip_threshold,
                "> 0");
    AM_HP_CHECK(hp->weight_decay >= 0 && isfinite((float)hp->weight_decay),
                "weight_decay", hp->weight_decay,
                ">= 0 and finite in float32 (at most 3.4028235e38)");
    return AM_OK;
}

am_consts am_consts_from(const am_hparams *hp) {
    am_consts k;
    k.beta2 = (float)hp->beta2;
    k.one_m_beta2 = (float)(1.0 - hp->beta2);
    k.eps = (float)hp->eps;
    k.clip = (float)hp->clip_threshold;
    k.wd = (float)hp->weight_decay;
    k.min_lr = (float)hp->min_lr;
    k.max_lr = (float)hp->max_lr;
    k.bump = (float)hp->lr_bump_rate;
    k.bump_up = am_expf(1.0f * k.bump);
    k.bump_down = am_expf(-1.0f * k.bump);
    return k;
}

/* In IEEE defaults (fpenv.h): a caller with floating-point traps enabled
 * (feenableexcept) got SIGFPE from the comparisons of a NaN or the float
 * conversion of a huge lr instead of AM_ERR_INVALID_HPARAM. */
am_status am_hparams_validate(const am_hparams *hp) {
    AM_FPENV_RETURN(validate_impl(hp));
}
