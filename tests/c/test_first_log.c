/* test_first_log.c — the process-wide messages of the library's first use
 * (AUTOMAGIC_DEBUG=1's kernel choice; the warning of a bad AUTOMAGIC_TUNING
 * or AUTOMAGIC_PAR_MIN_BYTES) when that first use is
 * am_optimizer_update_all on two threads, which mutes its batch's messages:
 * both were lost for the life of the process, and on one thread they named
 * parameter 0 (found by a review, thirty-fourth session). A bad
 * AUTOMAGIC_PAR_MIN_BYTES ("abc") was taken as 0 by atof. Its own process:
 * the environment is read once, at the first use. */
#define _POSIX_C_SOURCE 200809L
#include <automagic.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char g_info[600], g_warning[600];
static int g_infos, g_warnings;

static void log_cb(am_log_level lvl, const char *msg, void *user) {
    (void)user;
    if (lvl == AM_LOG_INFO) {
        g_infos++;
        snprintf(g_info, sizeof g_info, "%s", msg);
    }
    if (lvl == AM_LOG_WARNING) {
        g_warnings++;
        snprintf(g_warning, sizeof g_warning, "%s", msg);
    }
}

static void test_first_use_in_a_muted_batch_logs(void **unused) {
    static float w[64 * 64], b[64], gw[64 * 64], gb[64];
    const int64_t sw[2] = {64, 64}, sb[1] = {64};
    const void *grads[2] = {gw, gb};
    const am_dtype gdt[2] = {AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32};
    am_hparams hp = am_hparams_default();
    am_optimizer *o;
    int32_t id;
    int i;
    (void)unused;
    setenv("AUTOMAGIC_DEBUG", "1", 1);
    setenv("AUTOMAGIC_TUNING", "zen9", 1);
    setenv("AUTOMAGIC_PAR_MIN_BYTES", "abc", 1);
    assert_int_equal(am_set_log_callback(log_cb, NULL), AM_OK);
    assert_int_equal(am_set_num_threads(2), AM_OK);
    for (i = 0; i < 64 * 64; i++) gw[i] = (float)(i % 7) * 0.1f - 0.3f;
    for (i = 0; i < 64; i++) gb[i] = (float)(i % 5) * 0.1f - 0.2f;
    assert_int_equal(am_optimizer_create(&hp, 1, &o), AM_OK);
    assert_int_equal(am_optimizer_add_param(o, w, AM_DTYPE_FLOAT32, 2, sw, &id), AM_OK);
    assert_int_equal(am_optimizer_add_param(o, b, AM_DTYPE_FLOAT32, 1, sb, &id), AM_OK);
    assert_int_equal(am_optimizer_update_all(o, grads, gdt, NULL), AM_OK);
    assert_int_equal(am_optimizer_update_all(o, grads, gdt, NULL), AM_OK);
    assert_int_equal(g_infos, 1);
    if (strncmp(g_info, "automagic: using ", 17) != 0)
        fail_msg("the debug message reads \"%s\"", g_info);
    assert_int_equal(g_warnings, 1);
    if (strncmp(g_warning, "automagic: AUTOMAGIC_TUNING='zen9'", 34) != 0)
        fail_msg("the warning reads \"%s\"", g_warning);
    if (!strstr(g_warning, "AUTOMAGIC_PAR_MIN_BYTES='abc' is not a whole number of bytes: "
                           "ignored (2097152 is used)"))
        fail_msg("the warning reads \"%s\"", g_warning);
    am_optimizer_destroy(o);
    am_set_log_callback(NULL, NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_first_use_in_a_muted_batch_logs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
