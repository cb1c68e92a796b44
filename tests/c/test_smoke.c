/* test_smoke.c — the library links, reports its version, and one update of a
 * small matrix through the optimizer object changes the parameter. */
#include <automagic.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <string.h>

static void test_version(void **unused) {
    (void)unused;
    assert_int_equal(am_version_number(), AM_VERSION_NUMBER);
    assert_string_equal(am_version_string(), "0.3.0");
}

static void test_one_update(void **unused) {
    float w[6] = {1, -2, 3, -4, 5, -6}, g[6] = {0.5f, 0.5f, -0.5f, 0.5f, -1, 1};
    float before[6];
    const int64_t shape[2] = {2, 3};
    am_hparams hp = am_hparams_default();
    am_optimizer *opt = NULL;
    int32_t id = -1;
    am_report rep;
    int i;
    (void)unused;
    memcpy(before, w, sizeof w);
    assert_int_equal(am_optimizer_create(&hp, 7, &opt), AM_OK);
    assert_int_equal(am_optimizer_add_param(opt, w, AM_DTYPE_FLOAT32, 2, shape, &id), AM_OK);
    assert_int_equal(id, 0);
    assert_int_equal(am_optimizer_update_param(opt, id, g, AM_DTYPE_FLOAT32, &rep), AM_OK);
    assert_int_equal(rep.status, AM_OK);
    for (i = 0; i < 6; i++) {
        /* lr 1e-6 and |u| <= clip: a tiny move against the gradient sign */
        float d = w[i] - before[i];
        assert_true(d != 0.0f);
        assert_true((d < 0) == (g[i] > 0));
        assert_true(d < 1e-5f && d > -1e-5f);
    }
    am_optimizer_destroy(opt);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_version),
        cmocka_unit_test(test_one_update),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
