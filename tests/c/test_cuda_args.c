/*
 * test_cuda_args.c — am_update_cuda's argument checks, which run on the host
 * before anything touches a device: runs with or without a GPU (the
 * pointers below are host addresses standing in for device ones; every case
 * is refused before the first CUDA call, so none is dereferenced).
 *
 * Buffers that share memory are refused as am_update refuses them (until
 * the fortieth session am_update_cuda did not look: its kernels raced on
 * them; found by a review).
 */
#include <automagic.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

static char g_msg[512];

static void log_fn(am_log_level level, const char *msg, void *user) {
    (void)level;
    (void)user;
    strncpy(g_msg, msg, sizeof g_msg - 1);
}

/* One 6x8 float32 update whose buffers sit in one host arena: the
 * parameter at 0, the gradient at 256, lr at 512, polarity at 576, row at
 * 640, col at 704, step at 768 (each case moves one of them onto another). */
typedef struct fake {
    _Alignas(64) unsigned char arena[4096];
    am_tensor p, g;
    am_state st;
    int64_t *step;
} fake;

static void fake_init(fake *f) {
    const am_shape sh = {2, {6, 8}};
    memset(f, 0, sizeof *f);
    f->p.data = f->arena;
    f->p.dtype = AM_DTYPE_FLOAT32;
    f->p.shape = sh;
    f->g = f->p;
    f->g.data = f->arena + 256;
    f->st.lr = (float *)(f->arena + 512);
    f->st.polarity = f->arena + 576;
    f->st.row = (float *)(f->arena + 640);
    f->st.col = (float *)(f->arena + 704);
    f->step = (int64_t *)(f->arena + 768);
}

static am_status run(fake *f) {
    am_hparams hp = am_hparams_default();
    am_rng_key key = {1, 2};
    size_t need = 0;
    assert_int_equal(am_cuda_workspace_bytes(&f->p.shape, &need), AM_OK);
    g_msg[0] = 0;
    return am_update_cuda(&f->p, &f->g, &f->st, f->step, &hp, key, f->arena + 1024,
                          need, NULL, NULL);
}

static void test_shared_memory_refused(void **unused) {
    fake f;
    (void)unused;
    am_set_log_callback(log_fn, NULL);
    fake_init(&f);
    f.st.lr = (float *)(f.arena + 4 * 40); /* inside the parameter's 192 bytes */
    assert_int_equal(run(&f), AM_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(g_msg, "param data and state lr share memory"));
    fake_init(&f);
    f.st.col = (float *)(f.arena + 256 + 4 * 10); /* inside the gradient */
    assert_int_equal(run(&f), AM_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(g_msg, "state col and grad data share memory"));
    fake_init(&f);
    f.st.row = (float *)(f.arena + 704 - 8); /* row's 6 floats run into col */
    assert_int_equal(run(&f), AM_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(g_msg, "state row and state col share memory"));
    fake_init(&f);
    f.st.polarity = f.arena + 512 + 20; /* inside lr (6 floats) */
    assert_int_equal(run(&f), AM_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(g_msg, "state lr and state polarity share memory"));
    am_set_log_callback(NULL, NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shared_memory_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
