/*
 * model.c — the MLP's layers, one function per operation (llm.c style),
 * shapes in comments. Plain loops; OpenMP splits the batch or the output
 * rows when available, never a reduction, so the result does not depend on
 * the thread count.
 */
#include "model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "data.h"

/* Threads only for loops worth it (a parallel region costs microseconds;
 * sampling and the tests run batches of 1 to 6). */
#define DM_MIN_PARALLEL_WORK 100000
#ifdef _OPENMP
#define DM_PARALLEL_FOR _Pragma("omp parallel for schedule(static) if(work >= DM_MIN_PARALLEL_WORK)")
#else
#define DM_PARALLEL_FOR
#endif

const char *const dm_tensor_names[DM_NUM_TENSORS] = {"emb", "W1", "b1", "W2", "b2"};

void dm_layout_init(const dm_config *c, dm_layout *l) {
    int64_t rows[DM_NUM_TENSORS] = {c->V, c->H, c->H, c->V, c->V};
    int64_t cols[DM_NUM_TENSORS] = {c->E, (int64_t)c->K * c->E, 0, c->H, 0};
    int64_t off = 0;
    int i;
    for (i = 0; i < DM_NUM_TENSORS; i++) {
        l->offset[i] = off;
        l->ndim[i] = cols[i] ? 2 : 1;
        l->shape[i][0] = rows[i];
        l->shape[i][1] = cols[i];
        off += rows[i] * (cols[i] ? cols[i] : 1);
    }
    l->total = off;
}

int dm_acts_alloc(const dm_config *c, int B, dm_acts *a) {
    size_t KE = (size_t)c->K * (size_t)c->E, b = (size_t)B;
    a->B = B;
    a->x = malloc(b * KE * sizeof(float));
    a->dx = malloc(b * KE * sizeof(float));
    a->h = malloc(b * (size_t)c->H * sizeof(float));
    a->dh = malloc(b * (size_t)c->H * sizeof(float));
    a->probs = malloc(b * (size_t)c->V * sizeof(float));
    a->dlogits = malloc(b * (size_t)c->V * sizeof(float));
    a->nll = malloc(b * sizeof(double));
    if (!a->x || !a->dx || !a->h || !a->dh || !a->probs || !a->dlogits || !a->nll) {
        dm_acts_free(a);
        return -1;
    }
    return 0;
}

void dm_acts_free(dm_acts *a) {
    free(a->x);
    free(a->dx);
    free(a->h);
    free(a->dh);
    free(a->probs);
    free(a->dlogits);
    free(a->nll);
    memset(a, 0, sizeof *a);
}

void dm_model_init(const dm_config *c, const dm_layout *l, float *params, uint64_t seed) {
    double scale[DM_NUM_TENSORS] = {1.0, (5.0 / 3.0) / sqrt((double)c->K * c->E), 0.0,
                                    0.1 / sqrt((double)c->H), 0.0};
    int t;
    int64_t i, n;
    for (t = 0; t < DM_NUM_TENSORS; t++) {
        float *p = params + l->offset[t];
        n = (t + 1 < DM_NUM_TENSORS ? l->offset[t + 1] : l->total) - l->offset[t];
        for (i = 0; i < n; i++) p[i] = (float)(scale[t] * dm_rand_normal(&seed));
    }
}

/* ------------------------------------------------------------ layers --- */

/* x (B, K*E) = concat over k of emb[X[b, k]]; emb is (V, E). */
static void embed_forward(float *x, const float *emb, const uint8_t *X, int B, int K, int E) {
    int b, k;
    for (b = 0; b < B; b++)
        for (k = 0; k < K; k++)
            memcpy(x + ((size_t)b * K + k) * E, emb + (size_t)X[b * K + k] * E,
                   (size_t)E * sizeof(float));
}

/* demb (V, E) = 0, then += dx rows scattered back to their tokens. Serial:
 * different examples hit the same rows. */
static void embed_backward(float *demb, const float *dx, const uint8_t *X, int B, int K,
                           int V, int E) {
    int b, k, e;
    memset(demb, 0, (size_t)V * E * sizeof(float));
    for (b = 0; b < B; b++)
        for (k = 0; k < K; k++) {
            float *d = demb + (size_t)X[b * K + k] * E;
            const float *s = dx + ((size_t)b * K + k) * E;
            for (e = 0; e < E; e++) d[e] += s[e];
        }
}

/* out (B, OC) = inp (B, C) @ w^T + bias; w is (OC, C), bias (OC).
 * Four partial sums: the dot is latency-bound otherwise (no reassociation
 * is allowed to the compiler: -fno-fast-math). */
static void matmul_forward(float *out, const float *inp, const float *w, const float *bias,
                           int B, int C, int OC) {
    const int64_t work = (int64_t)B * C * OC;
    int b;
    (void)work; /* unused without OpenMP */
    DM_PARALLEL_FOR
    for (b = 0; b < B; b++) {
        const float *x = inp + (size_t)b * C;
        int o;
        for (o = 0; o < OC; o++) {
            const float *wr = w + (size_t)o * C;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            int i = 0;
            for (; i + 4 <= C; i += 4) {
                s0 += x[i] * wr[i];
                s1 += x[i + 1] * wr[i + 1];
                s2 += x[i + 2] * wr[i + 2];
                s3 += x[i + 3] * wr[i + 3];
            }
            for (; i < C; i++) s0 += x[i] * wr[i];
            out[(size_t)b * OC + o] = bias[o] + ((s0 + s1) + (s2 + s3));
        }
    }
}

/* Given dout (B, OC): dinp (B, C) = dout @ w (may be NULL: not needed),
 * dw (OC, C) = dout^T @ inp, dbias (OC) = sum over B of dout. */
static void matmul_backward(float *dinp, float *dw, float *dbias, const float *dout,
                            const float *inp, const float *w, int B, int C, int OC) {
    const int64_t work = (int64_t)B * C * OC;
    int b, o;
    (void)work;
    if (dinp) {
        DM_PARALLEL_FOR
        for (b = 0; b < B; b++) {
            float *d = dinp + (size_t)b * C;
            int i, oo;
            memset(d, 0, (size_t)C * sizeof(float));
            for (oo = 0; oo < OC; oo++) {
                const float g = dout[(size_t)b * OC + oo];
                const float *wr = w + (size_t)oo * C;
                for (i = 0; i < C; i++) d[i] += g * wr[i];
            }
        }
    }
    DM_PARALLEL_FOR
    for (o = 0; o < OC; o++) {
        float *d = dw + (size_t)o * C, db = 0.0f;
        int i, bb;
        memset(d, 0, (size_t)C * sizeof(float));
        for (bb = 0; bb < B; bb++) {
            const float g = dout[(size_t)bb * OC + o];
            const float *x = inp + (size_t)bb * C;
            for (i = 0; i < C; i++) d[i] += g * x[i];
            db += g;
        }
        dbias[o] = db;
    }
}

/* h = tanh(h), in place, (B, H). */
static void tanh_forward(float *h, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) h[i] = tanhf(h[i]);
}

/* dh *= 1 - h^2, in place: d tanh(z)/dz = 1 - tanh(z)^2. */
static void tanh_backward(float *dh, const float *h, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) dh[i] *= 1.0f - h[i] * h[i];
}

/* probs (B, V) = softmax(logits) in place (max subtracted for range);
 * nll[b] = -log probs[b, Y[b]] when Y is given. */
static void softmax_nll_forward(float *probs, double *nll, const uint8_t *Y, int B, int V) {
    const int64_t work = (int64_t)B * V * 20; /* expf is ~20 multiply-adds */
    int b;
    (void)work;
    DM_PARALLEL_FOR
    for (b = 0; b < B; b++) {
        float *p = probs + (size_t)b * V, mx = p[0], sum = 0.0f;
        int v;
        for (v = 1; v < V; v++) mx = p[v] > mx ? p[v] : mx;
        for (v = 0; v < V; v++) {
            p[v] = expf(p[v] - mx);
            sum += p[v];
        }
        for (v = 0; v < V; v++) p[v] /= sum;
        if (Y) nll[b] = -log((double)p[Y[b]]);
    }
}

/* dlogits (B, V) = (probs - onehot(Y)) / B: the gradient of the mean NLL. */
static void softmax_nll_backward(float *dlogits, const float *probs, const uint8_t *Y, int B,
                                 int V) {
    int b, v;
    const float inv = 1.0f / (float)B;
    for (b = 0; b < B; b++)
        for (v = 0; v < V; v++) {
            float p = probs[(size_t)b * V + v] - (v == Y[b] ? 1.0f : 0.0f);
            dlogits[(size_t)b * V + v] = p * inv;
        }
}

/* ----------------------------------------------------------- the net --- */

double dm_forward(const dm_config *c, const dm_layout *l, const float *params,
                  const uint8_t *X, const uint8_t *Y, int B, dm_acts *a) {
    const int KE = c->K * c->E;
    double loss = 0.0;
    int b;
    embed_forward(a->x, params + l->offset[0], X, B, c->K, c->E);
    matmul_forward(a->h, a->x, params + l->offset[1], params + l->offset[2], B, KE, c->H);
    tanh_forward(a->h, (int64_t)B * c->H);
    /* logits are written into probs and normalised there */
    matmul_forward(a->probs, a->h, params + l->offset[3], params + l->offset[4], B, c->H, c->V);
    softmax_nll_forward(a->probs, a->nll, Y, B, c->V);
    if (!Y) return 0.0;
    for (b = 0; b < B; b++) loss += a->nll[b]; /* serial: same sum for any thread count */
    return loss / B;
}

void dm_backward(const dm_config *c, const dm_layout *l, const float *params,
                 const uint8_t *X, const uint8_t *Y, int B, dm_acts *a, float *grads) {
    const int KE = c->K * c->E;
    softmax_nll_backward(a->dlogits, a->probs, Y, B, c->V);
    matmul_backward(a->dh, grads + l->offset[3], grads + l->offset[4], a->dlogits, a->h,
                    params + l->offset[3], B, c->H, c->V);
    tanh_backward(a->dh, a->h, (int64_t)B * c->H);
    matmul_backward(a->dx, grads + l->offset[1], grads + l->offset[2], a->dh, a->x,
                    params + l->offset[1], B, KE, c->H);
    embed_backward(grads + l->offset[0], a->dx, X, B, c->K, c->V, c->E);
}

int dm_sample(const dm_config *c, const dm_layout *l, const float *params, dm_acts *a,
              uint64_t *rng, char *out, int maxlen) {
    uint8_t ctx[64];
    int n = 0, v, k;
    memset(ctx, 0, sizeof ctx);
    for (;;) {
        double u, acc = 0.0;
        dm_forward(c, l, params, ctx, NULL, 1, a);
        u = dm_rand_unit(rng);
        for (v = 0; v < c->V - 1; v++) {
            acc += a->probs[v];
            if (u < acc) break;
        }
        if (v == 0 || n == maxlen) break;
        out[n++] = dm_char(v);
        for (k = 0; k + 1 < c->K; k++) ctx[k] = ctx[k + 1];
        ctx[c->K - 1] = (uint8_t)v;
    }
    out[n] = '\0';
    return n;
}
