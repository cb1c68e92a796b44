/*
 * test_demo_gradcheck.c — the demo's hand-written backward pass against
 * central finite differences of its forward pass, on every parameter of a
 * small model; plus the pieces the demo's comparison relies on (bfloat16
 * round-to-nearest, the AdamW step, the next-character examples).
 *
 * Randomised: the seed is printed; AM_TEST_SEED=<n> replays one.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adamw.h"
#include "data.h"
#include "model.h"
#include "train.h"

static uint64_t g_seed = 20261202;

enum { B = 6 };
static const dm_config CFG = {DM_VOCAB, 3, 5, 7}; /* V, K, E, H */

typedef struct fixture {
    dm_layout l;
    dm_acts a;
    float *params, *grads;
    uint8_t X[B * 3], Y[B];
} fixture;

static void fixture_init(fixture *f, uint64_t seed) {
    int64_t i;
    dm_layout_init(&CFG, &f->l);
    f->params = malloc((size_t)f->l.total * sizeof(float));
    f->grads = malloc((size_t)f->l.total * sizeof(float));
    assert_non_null(f->params);
    assert_non_null(f->grads);
    assert_int_equal(dm_acts_alloc(&CFG, B, &f->a), 0);
    dm_model_init(&CFG, &f->l, f->params, seed);
    /* Biases start at 0 and W2 small in the demo; make every term matter. */
    for (i = 0; i < f->l.total; i++) f->params[i] += (float)(0.3 * dm_rand_normal(&seed));
    for (i = 0; i < B * CFG.K; i++) f->X[i] = (uint8_t)(dm_rand_u64(&seed) % DM_VOCAB);
    f->X[0] = f->X[1] = 5; /* a token repeated in one context: scatter-add */
    for (i = 0; i < B; i++) f->Y[i] = (uint8_t)(dm_rand_u64(&seed) % DM_VOCAB);
}

static void fixture_free(fixture *f) {
    free(f->params);
    free(f->grads);
    dm_acts_free(&f->a);
}

/* Central difference of the mean loss along parameter i. */
static double numeric_grad(fixture *f, int64_t i, float h) {
    const float keep = f->params[i];
    double up, down;
    f->params[i] = keep + h;
    up = dm_forward(&CFG, &f->l, f->params, f->X, f->Y, B, &f->a);
    f->params[i] = keep - h;
    down = dm_forward(&CFG, &f->l, f->params, f->X, f->Y, B, &f->a);
    f->params[i] = keep;
    /* the step actually taken, in float32 */
    return (up - down) / ((double)(keep + h) - (double)(keep - h));
}

/* Number of parameters whose analytic gradient is off from the numeric one
 * by more than atol + rtol * |numeric|; the worst one is reported. */
static int count_mismatches(fixture *f, const float *grads, double *worst) {
    int64_t i;
    int bad = 0;
    *worst = 0.0;
    for (i = 0; i < f->l.total; i++) {
        const double num = numeric_grad(f, i, 1e-2f), ana = grads[i];
        const double err = fabs(num - ana), tol = 2e-4 + 2e-3 * fabs(num);
        if (err / tol > *worst) *worst = err / tol;
        if (err > tol) bad++;
    }
    return bad;
}

static void test_backward_matches_finite_differences(void **unused) {
    fixture f;
    double worst;
    int bad;
    (void)unused;
    fixture_init(&f, g_seed);
    dm_forward(&CFG, &f.l, f.params, f.X, f.Y, B, &f.a);
    dm_backward(&CFG, &f.l, f.params, f.X, f.Y, B, &f.a, f.grads);
    bad = count_mismatches(&f, f.grads, &worst);
    printf("gradcheck: %lld parameters, worst error / tolerance = %.3f\n",
           (long long)f.l.total, worst);
    assert_int_equal(bad, 0);
    fixture_free(&f);
}

/* The check itself must be able to fail: a gradient off by 5% in one
 * element of each tensor is caught. */
static void test_gradcheck_detects_a_wrong_gradient(void **unused) {
    fixture f;
    double worst;
    int t, bad;
    (void)unused;
    fixture_init(&f, g_seed);
    dm_forward(&CFG, &f.l, f.params, f.X, f.Y, B, &f.a);
    dm_backward(&CFG, &f.l, f.params, f.X, f.Y, B, &f.a, f.grads);
    for (t = 0; t < DM_NUM_TENSORS; t++) { /* the largest gradient of each tensor */
        int64_t i, end = t + 1 < DM_NUM_TENSORS ? f.l.offset[t + 1] : f.l.total, arg = f.l.offset[t];
        for (i = f.l.offset[t]; i < end; i++)
            if (fabsf(f.grads[i]) > fabsf(f.grads[arg])) arg = i;
        f.grads[arg] *= 1.05f;
    }
    bad = count_mismatches(&f, f.grads, &worst);
    assert_int_equal(bad, DM_NUM_TENSORS);
    fixture_free(&f);
}

/* Forward values are a proper distribution, and a uniform model gives
 * loss log(V). */
static void test_forward_uniform_loss(void **unused) {
    fixture f;
    int64_t i;
    double loss;
    (void)unused;
    fixture_init(&f, g_seed);
    for (i = f.l.offset[3]; i < f.l.total; i++) f.params[i] = 0.0f; /* W2, b2 */
    loss = dm_forward(&CFG, &f.l, f.params, f.X, f.Y, B, &f.a);
    assert_true(fabs(loss - log((double)DM_VOCAB)) < 1e-6);
    fixture_free(&f);
}

static void test_results_do_not_depend_on_batch_split(void **unused) {
    /* dm_eval in batches of 2 and of 6 gives the same mean loss */
    fixture f;
    dm_examples e;
    dm_acts small;
    double l6, l2;
    (void)unused;
    fixture_init(&f, g_seed);
    e.ctx = CFG.K;
    e.n = B;
    e.X = f.X;
    e.Y = f.Y;
    assert_int_equal(dm_acts_alloc(&CFG, 2, &small), 0);
    l6 = dm_eval(&CFG, &f.l, f.params, &e, B, &f.a);
    l2 = dm_eval(&CFG, &f.l, f.params, &e, B, &small);
    assert_true(fabs(l6 - l2) < 1e-12);
    dm_acts_free(&small);
    fixture_free(&f);
}

static void test_bf16_round_to_nearest_even(void **unused) {
    (void)unused;
    assert_int_equal(dm_bf16_from_f32_rtn(1.0f), 0x3F80);
    assert_int_equal(dm_bf16_from_f32_rtn(1.0f + 0x1p-8f), 0x3F80);          /* tie: to even */
    assert_int_equal(dm_bf16_from_f32_rtn(1.0f + 3 * 0x1p-8f), 0x3F82);      /* tie: to even */
    assert_int_equal(dm_bf16_from_f32_rtn(1.0f + 0x1p-8f + 0x1p-20f), 0x3F81); /* above half */
    assert_int_equal(dm_bf16_from_f32_rtn(-2.0f), 0xC000);
    assert_true(dm_f32_from_bf16(0x3F81) == 1.0f + 0x1p-7f);
    assert_true(isnan(dm_f32_from_bf16(dm_bf16_from_f32_rtn(NAN))));
}

static void test_adamw_first_step(void **unused) {
    /* step 1: m_hat = g and v_hat = g^2, so p -= lr * g / (|g| + eps)
     * after the decoupled decay p *= 1 - lr * wd. */
    float p[3] = {0.5f, -1.0f, 2.0f};
    const float g[3] = {0.25f, -3.0f, 1e-3f};
    dm_adamw o;
    int i;
    (void)unused;
    assert_int_equal(dm_adamw_init(&o, 3, 1e-2f), 0);
    dm_adamw_step(&o, p, g);
    for (i = 0; i < 3; i++) {
        const float p0 = i == 0 ? 0.5f : i == 1 ? -1.0f : 2.0f;
        const double want = p0 * (1.0 - 1e-2 * 0.01) - 1e-2 * g[i] / (fabs(g[i]) + 1e-8);
        assert_true(fabs(p[i] - want) < 1e-6);
    }
    dm_adamw_free(&o);
}

static void test_examples_of_a_word(void **unused) {
    char w0[] = "ab", w1[] = "c";
    char *list[2] = {w0, w1};
    dm_words words = {list, 2, NULL};
    dm_examples e;
    /* "ab" with 3 context tokens: ... -> a, ..a -> b, .ab -> '.' */
    const uint8_t X[] = {0, 0, 0, 0, 0, 1, 0, 1, 2, 0, 0, 0, 0, 0, 3};
    const uint8_t Y[] = {1, 2, 0, 3, 0};
    (void)unused;
    assert_int_equal(dm_examples_build(&words, 0, 2, 3, &e), 0);
    assert_int_equal(e.n, 5);
    assert_memory_equal(e.X, X, sizeof X);
    assert_memory_equal(e.Y, Y, sizeof Y);
    dm_examples_free(&e);
}

static void test_words_load_filters_and_reports(void **unused) {
    char path[] = "/tmp/am_demo_wordsXXXXXX", err[256];
    const char text[] = "apple\nAachen\nbanana's\r\ncherry\r\n\nx\nzebra";
    dm_words w;
    FILE *f;
    int fd;
    (void)unused;
    fd = mkstemp(path);
    assert_true(fd >= 0);
    f = fdopen(fd, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    /* 4 usable words: fewer than 10 is an error naming the file */
    assert_int_equal(dm_words_load(path, &w, err, sizeof err), -1);
    assert_non_null(strstr(err, "4 usable words"));
    assert_non_null(strstr(err, path));
    f = fopen(path, "a");
    fputs("\none\ntwo\nthree\nfour\nfive\nsix\n", f);
    fclose(f);
    assert_int_equal(dm_words_load(path, &w, err, sizeof err), 0);
    assert_int_equal(w.n, 10);
    assert_string_equal(w.w[0], "apple");
    assert_string_equal(w.w[1], "cherry"); /* \r stripped, capitals and ' dropped */
    assert_string_equal(w.w[3], "zebra");
    dm_words_free(&w);
    remove(path);
    assert_int_equal(dm_words_load(path, &w, err, sizeof err), -1);
    assert_non_null(strstr(err, "cannot open data file"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_backward_matches_finite_differences),
        cmocka_unit_test(test_gradcheck_detects_a_wrong_gradient),
        cmocka_unit_test(test_forward_uniform_loss),
        cmocka_unit_test(test_results_do_not_depend_on_batch_split),
        cmocka_unit_test(test_bf16_round_to_nearest_even),
        cmocka_unit_test(test_adamw_first_step),
        cmocka_unit_test(test_examples_of_a_word),
        cmocka_unit_test(test_words_load_filters_and_reports),
    };
    const char *env = getenv("AM_TEST_SEED");
    if (env) g_seed = strtoull(env, NULL, 10);
    printf("test_demo_gradcheck: seed %llu (replay with AM_TEST_SEED=%llu)\n",
           (unsigned long long)g_seed, (unsigned long long)g_seed);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
