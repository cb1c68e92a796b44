/* test_badinput_optimizer.c — the bad-input matrix of the optimizer object:
 * every am_optimizer_* function against NULL pointers, bad ids, invalid
 * dtypes, negative/overflowing/unallocatable shapes, invalid
 * hyperparameters, short buffers, bad paths and bad checkpoint images. Each
 * row gives its documented status, and neither the optimizer (its whole
 * checkpoint image: hyperparameters, seed, every state buffer and counter)
 * nor any byte of the caller's memory (parameters, gradients, output
 * arguments) changes. */
#define _POSIX_C_SOURCE 200809L
#include <automagic.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "test_image.h"
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Everything the caller owns. */
typedef struct ctx {
    am_optimizer *opt;
    am_optimizer *new_opt;
    float W[35];       /* param 0: float32 [5, 7] */
    uint16_t b[7];     /* param 1: bfloat16 [7] */
    float gW[35], gb[7];
    const void *grads[2];
    am_dtype gds[2];
    int32_t id;
    float lrs[8];
    double mean;
    am_state st;
    am_shape sh;
    am_hparams hp, hp_out;
    uint64_t seed;
    unsigned char buf[64];
    size_t size;
    int64_t shape[3];
    char path[96], dir[64];
} ctx;

static ctx g_c;
static unsigned char *g_other; /* a checkpoint of another model */
static size_t g_other_n;

static void ctx_init(ctx *c) {
    const int64_t sW[2] = {5, 7}, sb[1] = {7};
    int i, s;
    memset(c, 0, sizeof *c);
    snprintf(c->dir, sizeof c->dir, "/tmp/am_bad_XXXXXX");
    assert_non_null(mkdtemp(c->dir));
    c->hp = am_hparams_default();
    for (i = 0; i < 35; i++) {
        c->W[i] = (float)(i % 6) * 0.2f - 0.5f;
        c->gW[i] = (float)(i % 4) - 1.5f;
    }
    for (i = 0; i < 7; i++) {
        c->b[i] = (uint16_t)(0x3f80u + (unsigned)i);
        c->gb[i] = (float)i - 3.0f;
    }
    assert_int_equal(am_optimizer_create(&c->hp, 11, &c->opt), AM_OK);
    assert_int_equal(am_optimizer_add_param(c->opt, c->W, AM_DTYPE_FLOAT32, 2, sW, &c->id), AM_OK);
    assert_int_equal(am_optimizer_add_param(c->opt, c->b, AM_DTYPE_BFLOAT16, 1, sb, &c->id), AM_OK);
    c->grads[0] = c->gW;
    c->grads[1] = c->gb;
    c->gds[0] = c->gds[1] = AM_DTYPE_FLOAT32;
    for (s = 0; s < 2; s++)
        assert_int_equal(am_optimizer_update_all(c->opt, c->grads, c->gds, NULL), AM_OK);
    c->new_opt = (am_optimizer *)(uintptr_t)0x5a5a; /* sentinel: never written */
    c->id = 12345;
    memset(c->lrs, 0xA5, sizeof c->lrs);
    c->mean = -7.0;
    c->seed = 99;
    memset(c->buf, 0xC3, sizeof c->buf);
    c->size = 4242;
    c->shape[0] = 3;
    c->shape[1] = 4;
    c->shape[2] = 5;
    snprintf(c->path, sizeof c->path, "%s/ckpt", c->dir);
}

#define NUL AM_ERR_NULL_POINTER
#define DTY AM_ERR_INVALID_DTYPE
#define SHP AM_ERR_INVALID_SHAPE
#define HPR AM_ERR_INVALID_HPARAM
#define BUF AM_ERR_BUFFER_SIZE
#define OOM AM_ERR_OUT_OF_MEMORY
#define NFD AM_ERR_NOT_FOUND
#define ARG AM_ERR_INVALID_ARGUMENT
#define IO AM_ERR_IO
#define FMT AM_ERR_FORMAT
#define MIS AM_ERR_MISMATCH

/* X(id, status, setup statement, call) — setup mutates the caller's
 * arguments (c) before the snapshot is taken. */
#define ROWS(X)                                                                           \
    X(CREATE_HP_NULL, NUL, , am_optimizer_create(NULL, 1, &c->new_opt))                   \
    X(CREATE_OUT_NULL, NUL, , am_optimizer_create(&c->hp, 1, NULL))                        \
    X(CREATE_BETA2_1, HPR, c->hp.beta2 = 1, am_optimizer_create(&c->hp, 1, &c->new_opt))   \
    X(CREATE_LR_NAN, HPR, c->hp.lr = NAN, am_optimizer_create(&c->hp, 1, &c->new_opt))     \
    X(CREATE_LR_NEG, HPR, c->hp.lr = -1, am_optimizer_create(&c->hp, 1, &c->new_opt))      \
    X(CREATE_EPS_INF, HPR, c->hp.eps = INFINITY,                                           \
      am_optimizer_create(&c->hp, 1, &c->new_opt))                                         \
    X(CREATE_MIN_GT_MAX, HPR, c->hp.min_lr = 1,                                            \
      am_optimizer_create(&c->hp, 1, &c->new_opt))                                         \
    X(ADD_OPT_NULL, NUL, , am_optimizer_add_param(NULL, c->W, 0, 2, c->shape, &c->id))     \
    X(ADD_ID_NULL, NUL, , am_optimizer_add_param(c->opt, c->W, 0, 2, c->shape, NULL))      \
    X(ADD_SHAPE_NULL, NUL, , am_optimizer_add_param(c->opt, c->W, 0, 2, NULL, &c->id))     \
    X(ADD_DATA_NULL, NUL, , am_optimizer_add_param(c->opt, NULL, 0, 2, c->shape, &c->id))  \
    X(ADD_DTYPE_3, DTY, , am_optimizer_add_param(c->opt, c->W, (am_dtype)3, 2, c->shape,   \
                                                 &c->id))                                  \
    X(ADD_DTYPE_NEG, DTY, , am_optimizer_add_param(c->opt, c->W, (am_dtype)-1, 2,          \
                                                   c->shape, &c->id))                      \
    X(ADD_NDIM_NEG, SHP, , am_optimizer_add_param(c->opt, c->W, 0, -1, c->shape, &c->id))  \
    X(ADD_NDIM_9, SHP, , am_optimizer_add_param(c->opt, c->W, 0, 9, c->shape, &c->id))     \
    X(ADD_DIM_NEG, SHP, c->shape[1] = -4,                                                  \
      am_optimizer_add_param(c->opt, c->W, 0, 2, c->shape, &c->id))                        \
    X(ADD_DIM_INT64MIN, SHP, c->shape[0] = INT64_MIN,                                      \
      am_optimizer_add_param(c->opt, c->W, 0, 3, c->shape, &c->id))                        \
    X(ADD_DIM_OVERFLOW, SHP, (c->shape[0] = (int64_t)1 << 40, c->shape[1] = c->shape[0]),  \
      am_optimizer_add_param(c->opt, c->W, 0, 3, c->shape, &c->id))                        \
    X(ADD_UNALLOCATABLE, OOM, (c->shape[0] = (int64_t)1 << 28, c->shape[1] = c->shape[0]), \
      am_optimizer_add_param(c->opt, c->W, 0, 2, c->shape, &c->id))                        \
    X(UPD_OPT_NULL, NUL, , am_optimizer_update_param(NULL, 0, c->gW, 0, NULL))             \
    X(UPD_ID_NEG, NFD, , am_optimizer_update_param(c->opt, -1, c->gW, 0, NULL))            \
    X(UPD_ID_COUNT, NFD, , am_optimizer_update_param(c->opt, 2, c->gW, 0, NULL))           \
    X(UPD_ID_MAX, NFD, , am_optimizer_update_param(c->opt, INT32_MAX, c->gW, 0, NULL))     \
    X(UPD_ID_MIN, NFD, , am_optimizer_update_param(c->opt, INT32_MIN, c->gW, 0, NULL))     \
    X(UPD_GRAD_NULL, NUL, , am_optimizer_update_param(c->opt, 0, NULL, 0, NULL))           \
    X(UPD_DTYPE_7, DTY, , am_optimizer_update_param(c->opt, 0, c->gW, (am_dtype)7, NULL))  \
    X(ALL_OPT_NULL, NUL, , am_optimizer_update_all(NULL, c->grads, c->gds, NULL))          \
    X(ALL_GRADS_NULL, NUL, , am_optimizer_update_all(c->opt, NULL, c->gds, NULL))          \
    X(ALL_DTYPES_NULL, NUL, , am_optimizer_update_all(c->opt, c->grads, NULL, NULL))       \
    X(ALL_SECOND_DTYPE_BAD, DTY, c->gds[1] = (am_dtype)9, /* param 0 not updated either */ \
      am_optimizer_update_all(c->opt, c->grads, c->gds, NULL))                             \
    X(LRS_OPT_NULL, NUL, , am_optimizer_get_lrs(NULL, 0, c->lrs, 8))                       \
    X(LRS_OUT_NULL, NUL, , am_optimizer_get_lrs(c->opt, 0, NULL, 8))                       \
    X(LRS_ID_BAD, NFD, , am_optimizer_get_lrs(c->opt, 5, c->lrs, 8))                       \
    X(LRS_COUNT_0, BUF, , am_optimizer_get_lrs(c->opt, 0, c->lrs, 0))                      \
    X(LRS_COUNT_SHORT, BUF, , am_optimizer_get_lrs(c->opt, 1, c->lrs, 6))                  \
    X(LRS_COUNT_NEG, BUF, , am_optimizer_get_lrs(c->opt, 0, c->lrs, -1))                   \
    X(LRS_COUNT_MIN, BUF, , am_optimizer_get_lrs(c->opt, 0, c->lrs, INT64_MIN))            \
    X(MEAN_OPT_NULL, NUL, , am_optimizer_lr_mean(NULL, 0, &c->mean))                       \
    X(MEAN_OUT_NULL, NUL, , am_optimizer_lr_mean(c->opt, 0, NULL))                         \
    X(MEAN_ID_NEG2, NFD, , am_optimizer_lr_mean(c->opt, -2, &c->mean))                     \
    X(MEAN_ID_COUNT, NFD, , am_optimizer_lr_mean(c->opt, 2, &c->mean))                     \
    X(MEAN_ID_MIN, NFD, , am_optimizer_lr_mean(c->opt, INT32_MIN, &c->mean))               \
    X(STATE_OPT_NULL, NUL, , am_optimizer_get_state(NULL, 0, &c->st, &c->sh))              \
    X(STATE_OUT_NULL, NUL, , am_optimizer_get_state(c->opt, 0, NULL, &c->sh))              \
    X(STATE_ID_BAD, NFD, , am_optimizer_get_state(c->opt, 2, &c->st, &c->sh))              \
    X(STATE_ID_NEG, NFD, , am_optimizer_get_state(c->opt, -1, &c->st, &c->sh))             \
    X(HP_OPT_NULL, NUL, , am_optimizer_get_hparams(NULL, &c->hp_out, &c->seed))            \
    X(SAVE_OPT_NULL, NUL, , am_optimizer_save(NULL, c->path))                              \
    X(SAVE_PATH_NULL, NUL, , am_optimizer_save(c->opt, NULL))                              \
    X(SAVE_PATH_EMPTY, ARG, , am_optimizer_save(c->opt, ""))                               \
    X(SAVE_NO_DIR, IO, strcat(c->path, "/x/y"), am_optimizer_save(c->opt, c->path))        \
    X(SAVE_ONTO_DIR, IO, snprintf(c->path, sizeof c->path, "%s", c->dir),                 \
      am_optimizer_save(c->opt, c->path))                                                  \
    X(SMEM_OPT_NULL, NUL, , am_optimizer_save_memory(NULL, c->buf, 64, &c->size))          \
    X(SMEM_SIZE_NULL, NUL, , am_optimizer_save_memory(c->opt, c->buf, 64, NULL))           \
    X(SMEM_BUF_NULL, NUL, , am_optimizer_save_memory(c->opt, NULL, 64, &c->size))          \
    X(SMEM_SHORT, BUF, , am_optimizer_save_memory(c->opt, c->buf, 64, &c->size))           \
    X(SMEM_ONE_BYTE, BUF, , am_optimizer_save_memory(c->opt, c->buf, 1, &c->size))         \
    X(LOAD_OPT_NULL, NUL, , am_optimizer_load(NULL, c->path))                              \
    X(LOAD_PATH_NULL, NUL, , am_optimizer_load(c->opt, NULL))                              \
    X(LOAD_MISSING, IO, , am_optimizer_load(c->opt, c->path))                              \
    X(LOAD_DIR, IO, , am_optimizer_load(c->opt, c->dir))                                   \
    X(LMEM_OPT_NULL, NUL, , am_optimizer_load_memory(NULL, c->buf, 64))                    \
    X(LMEM_IMAGE_NULL, NUL, , am_optimizer_load_memory(c->opt, NULL, 64))                  \
    X(LMEM_EMPTY, FMT, , am_optimizer_load_memory(c->opt, c->buf, 0))                      \
    X(LMEM_GARBAGE, FMT, , am_optimizer_load_memory(c->opt, c->buf, 64))                   \
    X(LMEM_HUGE_HEADER, FMT, memset(c->buf, 0xFF, 8),                                      \
      am_optimizer_load_memory(c->opt, c->buf, 64))                                        \
    X(LMEM_NOT_JSON, FMT, (memset(c->buf, 0, 8), c->buf[0] = 8, memcpy(c->buf + 8, "{\"a\":", 5)), \
      am_optimizer_load_memory(c->opt, c->buf, 16))                                        \
    X(LMEM_OTHER_MODEL, MIS, , am_optimizer_load_memory(c->opt, g_other, g_other_n))

#define AS_ENUM(id, st, setup, call) R_##id,
enum { ROWS(AS_ENUM) R_COUNT };
#define AS_NAME(id, st, setup, call) #id,
static const char *const k_name[R_COUNT] = {ROWS(AS_NAME)};
#define AS_WANT(id, st, setup, call) st,
static const am_status k_want[R_COUNT] = {ROWS(AS_WANT)};

static void setup_row(ctx *c, int r) {
    switch (r) {
#define AS_SETUP(id, st, setup, call) case R_##id: setup; break;
        ROWS(AS_SETUP)
    }
    (void)c;
}

static am_status call_row(ctx *c, int r) {
    switch (r) {
#define AS_CALL(id, st, setup, call) case R_##id: return call;
        ROWS(AS_CALL)
    }
    return AM_OK;
}


static void test_optimizer_matrix(void **unused) {
    static ctx before;
    int r;
    (void)unused;
    {   /* a valid checkpoint of a model with other shapes */
        am_optimizer *o;
        am_hparams hp = am_hparams_default();
        const int64_t s[2] = {7, 5};
        float w[35] = {0};
        int32_t id;
        assert_int_equal(am_optimizer_create(&hp, 1, &o), AM_OK);
        assert_int_equal(am_optimizer_add_param(o, w, AM_DTYPE_FLOAT32, 2, s, &id), AM_OK);
        assert_int_equal(am_optimizer_add_param(o, w, AM_DTYPE_BFLOAT16, 2, s, &id), AM_OK);
        g_other = t_image(o, &g_other_n);
        am_optimizer_destroy(o);
    }
    for (r = 0; r < R_COUNT; r++) {
        ctx *c = &g_c;
        size_t n0, n1;
        unsigned char *i0, *i1;
        am_status got;
        int32_t np;
        ctx_init(c);
        setup_row(c, r);
        memcpy(&before, c, sizeof before);
        i0 = t_image(c->opt, &n0);
        np = am_optimizer_num_params(c->opt);
        got = call_row(c, r);
        if (got != k_want[r])
            fail_msg("%s: status %d (%s), expected %d (%s)", k_name[r], (int)got,
                     am_status_string(got), (int)k_want[r], am_status_string(k_want[r]));
        if (memcmp(&before, c, sizeof before) != 0)
            fail_msg("%s: the caller's memory changed", k_name[r]);
        i1 = t_image(c->opt, &n1);
        if (n0 != n1 || memcmp(i0, i1, n0) != 0 || np != am_optimizer_num_params(c->opt))
            fail_msg("%s: the optimizer changed", k_name[r]);
        free(i0);
        free(i1);
        am_optimizer_destroy(c->opt);
        rmdir(c->dir);
    }
    print_message("optimizer object: %d cases\n", R_COUNT);
    free(g_other);
}

/* Functions answering with values: defined answers for bad input. */
static void test_optimizer_value_functions(void **unused) {
    ctx *c = &g_c;
    (void)unused;
    ctx_init(c);
    assert_int_equal(am_optimizer_num_params(NULL), 0);
    assert_int_equal(am_optimizer_lr_count(NULL, 0), -1);
    assert_int_equal(am_optimizer_lr_count(c->opt, -1), -1);
    assert_int_equal(am_optimizer_lr_count(c->opt, 2), -1);
    assert_int_equal(am_optimizer_lr_count(c->opt, INT32_MIN), -1);
    assert_int_equal(am_optimizer_lr_count(c->opt, 0), 5);
    assert_int_equal(am_optimizer_lr_count(c->opt, 1), 7);
    assert_int_equal(am_optimizer_skipped_count(NULL), 0);
    assert_int_equal(am_optimizer_get_hparams(c->opt, NULL, NULL), AM_OK);
    assert_int_equal(am_optimizer_get_state(c->opt, 1, &c->st, NULL), AM_OK);
    am_optimizer_destroy(NULL);
    am_optimizer_destroy(c->opt);
    rmdir(c->dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_optimizer_matrix),
        cmocka_unit_test(test_optimizer_value_functions),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
