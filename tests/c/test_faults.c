/* test_faults.c — faults during training (SPEC 6.2).
 *
 * A small model (linear regression W [8,16] + b [8], a bfloat16 matrix
 * V [4,6] pulled towards a target with bfloat16 gradients, a 0-D scale)
 * trains for 10,000 steps. Run A gets a NaN, +Inf or -Inf in one gradient
 * element of one parameter every 100 steps; run B is clean and simply does
 * not update that parameter at those steps. A must end with finite
 * parameters, 100 skips counted, and parameters and state bit-equal to B.
 * Half the steps go through am_optimizer_update_param, half through
 * am_optimizer_update_all. */
#include <automagic.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STEPS 10000
#define EVERY 100
#define NP 4

typedef struct run {
    am_optimizer *opt;
    float W[8 * 16], b[8], s;  /* float32 */
    uint16_t V[4 * 6];         /* bfloat16 */
} run;

static const int64_t k_numel[NP] = {8 * 16, 8, 4 * 6, 1};

static float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t f2bf(float f) { /* round to nearest even; inputs finite */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void run_init(run *r) {
    am_hparams hp = am_hparams_default();
    const int64_t sW[2] = {8, 16}, sb[1] = {8}, sV[2] = {4, 6};
    int32_t id;
    int i;
    hp.lr = 1e-3;
    hp.max_lr = 3e-2;
    hp.weight_decay = 1e-3;
    memset(r, 0, sizeof *r);
    for (i = 0; i < 8 * 16; i++) r->W[i] = (float)((i * 7) % 11) * 0.05f - 0.25f;
    for (i = 0; i < 24; i++) r->V[i] = f2bf((float)(i % 5) * 0.5f - 1.0f);
    r->s = 0.5f;
    assert_int_equal(am_optimizer_create(&hp, 2024, &r->opt), AM_OK);
    assert_int_equal(am_optimizer_add_param(r->opt, r->W, AM_DTYPE_FLOAT32, 2, sW, &id), AM_OK);
    assert_int_equal(am_optimizer_add_param(r->opt, r->b, AM_DTYPE_FLOAT32, 1, sb, &id), AM_OK);
    assert_int_equal(am_optimizer_add_param(r->opt, r->V, AM_DTYPE_BFLOAT16, 2, sV, &id), AM_OK);
    assert_int_equal(am_optimizer_add_param(r->opt, &r->s, AM_DTYPE_FLOAT32, 0, NULL, &id), AM_OK);
}

/* Gradients at step t of the loss mean_k |s*(W x_k + b) - y_k|^2 / 2 over a
 * batch of 4 (x from a hash of (t, k), y = W* x), plus |V - T|^2 / 2. They
 * depend on the current parameters, so any difference between runs grows. */
static float g_loss;
static void grads(const run *r, int t, float *gW, float *gb, uint16_t *gV, float *gs) {
    int k, i, j;
    memset(gW, 0, sizeof(float) * 128);
    memset(gb, 0, sizeof(float) * 8);
    *gs = 0;
    g_loss = 0;
    for (k = 0; k < 4; k++) {
        float x[16];
        uint32_t h = (uint32_t)t * 2654435761u + (uint32_t)k * 40503u;
        for (j = 0; j < 16; j++) {
            h ^= h >> 15;
            h *= 0x2c1b3c6du;
            h ^= h >> 12;
            x[j] = (float)(h & 0xFFFF) / 32768.0f - 1.0f;
        }
        for (i = 0; i < 8; i++) {
            float z = r->b[i], y = 0, e;
            for (j = 0; j < 16; j++) {
                z += r->W[i * 16 + j] * x[j];
                y += (float)((i + j) % 5 - 2) * 0.1f * x[j];
            }
            e = r->s * z - y;
            g_loss += 0.125f * e * e;
            for (j = 0; j < 16; j++) gW[i * 16 + j] += 0.25f * e * r->s * x[j];
            gb[i] += 0.25f * e * r->s;
            *gs += 0.25f * e * z;
        }
    }
    for (i = 0; i < 24; i++) gV[i] = f2bf(bf2f(r->V[i]) - (float)(i % 3) * 0.25f);
}

/* Poisons one element of one gradient at step t (t % EVERY == EVERY / 2);
 * returns the parameter. */
static int poison(int t, float *gW, float *gb, uint16_t *gV, float *gs) {
    int k = t / EVERY, p = k % NP, e = (int)((k * 7) % k_numel[p]);
    static const float bad[3] = {NAN, INFINITY, -INFINITY};
    static const uint16_t badbf[3] = {0x7FC0, 0x7F80, 0xFF80};
    float v = bad[k % 3];
    switch (p) {
    case 0: gW[e] = v; break;
    case 1: gb[e] = v; break;
    case 2: gV[e] = badbf[k % 3]; break;
    default: *gs = v; break;
    }
    return p;
}

static float train(run *r, int faulty) {
    static float gW[128], gb[8], gs;
    static uint16_t gV[24];
    float first_loss = 0;
    int t, p;
    for (t = 0; t < STEPS; t++) {
        const void *g[NP];
        const am_dtype dt[NP] = {AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT32, AM_DTYPE_BFLOAT16,
                                 AM_DTYPE_FLOAT32};
        int skip = -1;
        am_status expect[NP], st;
        grads(r, t, gW, gb, gV, &gs);
        if (t == 0) first_loss = g_loss;
        g[0] = gW; g[1] = gb; g[2] = gV; g[3] = &gs;
        if (t % EVERY == EVERY / 2) {
            if (faulty) {
                skip = poison(t, gW, gb, gV, &gs);
            } else {
                float cW[128], cb[8], cs;
                uint16_t cV[24];
                skip = poison(t, cW, cb, cV, &cs); /* which one: same choice */
                g[skip] = NULL;
            }
        }
        for (p = 0; p < NP; p++)
            expect[p] = (p == skip && faulty) ? AM_SKIPPED_NONFINITE_GRAD : AM_OK;
        if (t % 2 == 0) {
            for (p = 0; p < NP; p++) {
                if (!g[p]) continue;
                st = am_optimizer_update_param(r->opt, p, g[p], dt[p], NULL);
                if (st != expect[p]) fail_msg("step %d param %d: status %d", t, p, (int)st);
            }
        } else {
            am_report rep[NP];
            st = am_optimizer_update_all(r->opt, g, dt, rep);
            if (st != (skip >= 0 && faulty ? AM_SKIPPED_NONFINITE_GRAD : AM_OK))
                fail_msg("step %d: update_all status %d", t, (int)st);
            for (p = 0; p < NP; p++)
                if (g[p] && rep[p].status != expect[p])
                    fail_msg("step %d param %d: report %d", t, p, (int)rep[p].status);
        }
    }
    grads(r, STEPS, gW, gb, gV, &gs);
    if (!(g_loss < 0.5f * first_loss))
        fail_msg("the model did not train: loss %g -> %g", first_loss, g_loss);
    return g_loss;
}

static void assert_finite(const run *r) {
    int i;
    for (i = 0; i < 128; i++) assert_true(isfinite(r->W[i]));
    for (i = 0; i < 8; i++) assert_true(isfinite(r->b[i]));
    for (i = 0; i < 24; i++) assert_true(isfinite(bf2f(r->V[i])));
    assert_true(isfinite(r->s));
}

static void assert_same_state(const run *a, const run *b) {
    int32_t p;
    for (p = 0; p < NP; p++) {
        am_state x, y;
        am_shape sh;
        am_state_sizes z;
        assert_int_equal(am_optimizer_get_state(a->opt, p, &x, &sh), AM_OK);
        assert_int_equal(am_optimizer_get_state(b->opt, p, &y, NULL), AM_OK);
        assert_int_equal(am_state_get_sizes(&sh, &z), AM_OK);
        assert_int_equal(x.step, y.step);
        assert_memory_equal(x.lr, y.lr, (size_t)z.lr_count * 4);
        assert_memory_equal(x.polarity, y.polarity, (size_t)z.polarity_bytes);
        if (z.row_count) assert_memory_equal(x.row, y.row, (size_t)z.row_count * 4);
        if (z.col_count) assert_memory_equal(x.col, y.col, (size_t)z.col_count * 4);
        if (z.sq_count) assert_memory_equal(x.sq, y.sq, (size_t)z.sq_count * 4);
    }
}

static void test_nonfinite_every_100_steps(void **unused) {
    static run a, b;
    float la, lb;
    int32_t p;
    (void)unused;
    run_init(&a);
    run_init(&b);
    la = train(&a, 1);
    lb = train(&b, 0);
    assert_finite(&a);
    assert_int_equal(am_optimizer_skipped_count(a.opt), STEPS / EVERY);
    assert_int_equal(am_optimizer_skipped_count(b.opt), 0);
    assert_memory_equal(a.W, b.W, sizeof a.W);
    assert_memory_equal(a.b, b.b, sizeof a.b);
    assert_memory_equal(a.V, b.V, sizeof a.V);
    assert_memory_equal(&a.s, &b.s, sizeof a.s);
    assert_same_state(&a, &b);
    assert_memory_equal(&la, &lb, sizeof la);
    for (p = 0; p < NP; p++) {
        am_state st;
        assert_int_equal(am_optimizer_get_state(a.opt, p, &st, NULL), AM_OK);
        assert_int_equal(st.step, STEPS - STEPS / EVERY / NP); /* 25 skips each */
    }
    am_optimizer_destroy(a.opt);
    am_optimizer_destroy(b.opt);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_nonfinite_every_100_steps),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
