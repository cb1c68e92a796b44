/*
 * quickstart.c — the smallest complete use of libautomagic: fit a linear
 * layer y = W x + b to a fixed random teacher with Automagic3's defaults (no
 * learning rate to tune), updating each parameter the moment its gradient is
 * ready, as a fused backward pass would.
 *
 *   W is (OUT, IN) float32, b is (OUT), data x is (N, IN).
 */
#include <automagic.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#define IN 32
#define OUT 16
#define N 256

static float frand(unsigned *s) { /* xorshift, uniform in [-1, 1) */
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return (float)(*s >> 8) / 8388608.0f - 1.0f;
}

static void on_log(am_log_level level, const char *msg, void *user) {
    (void)user;
    fprintf(stderr, "[automagic %d] %s\n", (int)level, msg);
}

int main(void) {
    static float X[N][IN], Y[N][OUT], W[OUT][IN], b[OUT], Wt[OUT][IN], bt[OUT];
    static float gW[OUT][IN], gb[OUT];
    unsigned seed = 12345;
    am_hparams hp = am_hparams_default();
    am_optimizer *opt = NULL;
    int32_t idW, idb;
    const int64_t shapeW[2] = {OUT, IN}, shapeb[1] = {OUT};
    int step, n, i, o;
    am_status st;

    am_set_log_callback(on_log, NULL);
    for (o = 0; o < OUT; o++) {
        for (i = 0; i < IN; i++) Wt[o][i] = frand(&seed), W[o][i] = 0.1f * frand(&seed);
        bt[o] = frand(&seed), b[o] = 0.0f;
    }
    for (n = 0; n < N; n++) {
        for (i = 0; i < IN; i++) X[n][i] = frand(&seed);
        for (o = 0; o < OUT; o++) {
            float y = bt[o];
            for (i = 0; i < IN; i++) y += Wt[o][i] * X[n][i];
            Y[n][o] = y;
        }
    }

    if ((st = am_optimizer_create(&hp, 42, &opt)) != AM_OK ||
        (st = am_optimizer_add_param(opt, W, AM_DTYPE_FLOAT32, 2, shapeW, &idW)) != AM_OK ||
        (st = am_optimizer_add_param(opt, b, AM_DTYPE_FLOAT32, 1, shapeb, &idb)) != AM_OK) {
        fprintf(stderr, "automagic: %s\n", am_status_string(st));
        am_optimizer_destroy(opt);
        return 1;
    }

    printf("fitting a %dx%d linear layer with Automagic3 (libautomagic %s)\n",
           OUT, IN, am_version_string());
    printf("%6s %12s %12s\n", "step", "mse", "mean lr");
    for (step = 0; step <= 600; step++) {
        double loss = 0.0, lr;
        for (o = 0; o < OUT; o++) {
            gb[o] = 0.0f;
            for (i = 0; i < IN; i++) gW[o][i] = 0.0f;
        }
        for (n = 0; n < N; n++) { /* forward and backward of the MSE */
            for (o = 0; o < OUT; o++) {
                float y = b[o], d;
                for (i = 0; i < IN; i++) y += W[o][i] * X[n][i];
                d = y - Y[n][o];
                loss += (double)d * d / (N * OUT);
                d *= 2.0f / (N * OUT);
                gb[o] += d;
                for (i = 0; i < IN; i++) gW[o][i] += d * X[n][i];
            }
        }
        /* Each parameter is updated as soon as its gradient is complete. */
        if ((st = am_optimizer_update_param(opt, idW, gW, AM_DTYPE_FLOAT32, NULL)) < 0 ||
            (st = am_optimizer_update_param(opt, idb, gb, AM_DTYPE_FLOAT32, NULL)) < 0 ||
            (st = am_optimizer_lr_mean(opt, -1, &lr)) < 0) {
            fprintf(stderr, "quickstart: %s\n", am_status_string(st));
            am_optimizer_destroy(opt);
            return 1;
        }
        /* (a skipped update, AM_SKIPPED_*, is a success: parameter and
         * state are as they were; this example's gradients are finite) */
        if (step % 50 == 0) printf("%6d %12.6f %12.3e\n", step, loss, lr);
    }
    am_optimizer_destroy(opt);
    return 0;
}
