/* test_dynamic.c — the shared library loaded with dlopen(), as a plugin
 * host or an interpreter loads it:
 *   - unloaded with dlclose() after an update on two threads, then loaded
 *     again, three times: the pool's workers outlive a job, so unmapping
 *     the library under them crashed the process (SIGSEGV); it is marked
 *     not unloadable (-z nodelete, CMakeLists.txt);
 *   - with AUTOMAGIC_DEBUG=1 the first update logs which kernels run, and a
 *     log callback that calls back into the library (am_kernel_name) must
 *     not deadlock: the message was logged inside the pthread_once that
 *     chooses the kernels, which the callback's call waited on forever;
 *     the same for the warning of an unrecognised AUTOMAGIC_TUNING, logged
 *     once.
 * An alarm fails the test instead of hanging. The library's path comes
 * from CMake (AM_SHARED_LIBRARY). */
#define _POSIX_C_SOURCE 200809L
#include <automagic.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct api {
    void *h;
    am_status (*set_num_threads)(int);
    am_status (*get_sizes)(const am_shape *, am_state_sizes *);
    am_status (*state_init)(const am_shape *, am_state *, double);
    am_hparams (*hparams_default)(void);
    am_status (*update)(const am_tensor *, const am_tensor *, am_state *, const am_hparams *,
                        am_rng_key, void *, size_t, am_report *);
    am_status (*set_log_callback)(am_log_fn, void *);
    const char *(*kernel_name)(void);
} api;

#define SYM(a, field, name)                                    \
    do {                                                       \
        void *s_ = dlsym((a)->h, name);                        \
        assert_non_null(s_);                                   \
        memcpy(&(a)->field, &s_, sizeof s_); /* POSIX dlsym */ \
    } while (0)

static void load(api *a) {
    a->h = dlopen(AM_SHARED_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    if (!a->h) fail_msg("dlopen(%s): %s", AM_SHARED_LIBRARY, dlerror());
    SYM(a, set_num_threads, "am_set_num_threads");
    SYM(a, get_sizes, "am_state_get_sizes");
    SYM(a, state_init, "am_state_init");
    SYM(a, hparams_default, "am_hparams_default");
    SYM(a, update, "am_update");
    SYM(a, set_log_callback, "am_set_log_callback");
    SYM(a, kernel_name, "am_kernel_name");
}

/* Three updates of a (512, 4096) float32 parameter on two threads: above
 * the pool's threshold, so its workers run (and stay, watching). */
static void updates(const api *a) {
    am_shape sh = {2, {512, 4096}};
    am_state_sizes sz;
    am_state st;
    am_tensor pt, gt;
    am_hparams hp = a->hparams_default();
    am_rng_key key = {5, 1};
    float *p, *g;
    void *ws;
    int64_t i;
    int s;
    assert_int_equal(a->get_sizes(&sh, &sz), AM_OK);
    p = (float *)malloc((size_t)sz.numel * 4);
    g = (float *)malloc((size_t)sz.numel * 4);
    st.lr = (float *)malloc((size_t)sz.lr_count * 4);
    st.polarity = (uint8_t *)malloc((size_t)sz.polarity_bytes);
    st.row = (float *)malloc((size_t)sz.row_count * 4);
    st.col = (float *)malloc((size_t)sz.col_count * 4);
    st.sq = NULL;
    ws = malloc((size_t)sz.workspace_bytes);
    assert_true(p && g && st.lr && st.polarity && st.row && st.col && ws);
    assert_int_equal(a->state_init(&sh, &st, 1e-4), AM_OK);
    for (i = 0; i < sz.numel; i++) {
        p[i] = (float)(i % 13) * 0.01f;
        g[i] = (float)(i % 7) * 0.1f - 0.3f;
    }
    pt.data = p;
    pt.dtype = AM_DTYPE_FLOAT32;
    pt.shape = sh;
    gt = pt;
    gt.data = g;
    assert_int_equal(a->set_num_threads(2), AM_OK);
    for (s = 0; s < 3; s++)
        assert_int_equal(a->update(&pt, &gt, &st, &hp, key, ws, (size_t)sz.workspace_bytes,
                                   NULL), AM_OK);
    free(p); free(g); free(st.lr); free(st.polarity); free(st.row); free(st.col); free(ws);
}

static api g_api;
static int g_logged, g_warned;
static char g_name[64];

static void reentrant_log(am_log_level lvl, const char *msg, void *user) {
    (void)user;
    if (lvl == AM_LOG_WARNING && strstr(msg, "AUTOMAGIC_TUNING='bogus' is not zen4 or zen5")) {
        g_warned++; /* the bad value's warning, also outside pthread_once */
        strncpy(g_name, g_api.kernel_name(), sizeof g_name - 1);
    }
    if (strstr(msg, "using")) {
        /* back into the library from the callback */
        strncpy(g_name, g_api.kernel_name(), sizeof g_name - 1);
        g_logged++;
    }
}

static void test_debug_log_callback_may_call_the_library(void **unused) {
    (void)unused;
    setenv("AUTOMAGIC_DEBUG", "1", 1); /* before the library's first use */
    setenv("AUTOMAGIC_TUNING", "bogus", 1); /* warned of once, then ignored */
    load(&g_api);
    assert_int_equal(g_api.set_log_callback(reentrant_log, NULL), AM_OK);
    alarm(120);
    updates(&g_api);
    alarm(0);
    assert_int_equal(g_logged, 1);
    assert_int_equal(g_warned, 1);
    assert_string_equal(g_name, g_api.kernel_name());
    assert_int_equal(g_api.set_log_callback(NULL, NULL), AM_OK);
    assert_int_equal(dlclose(g_api.h), 0);
}

static void test_unload_after_threads(void **unused) {
    int round;
    (void)unused;
    alarm(120);
    for (round = 0; round < 3; round++) {
        api a;
        load(&a);
        updates(&a);
        assert_int_equal(dlclose(a.h), 0);
        {
            struct timespec ts = {0, 20000000}; /* the workers go on watching meanwhile */
            nanosleep(&ts, NULL);
        }
    }
    alarm(0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_debug_log_callback_may_call_the_library),
        cmocka_unit_test(test_unload_after_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
