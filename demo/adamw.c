/* adamw.c — the AdamW baseline (see adamw.h). */
#include "adamw.h"

#include <math.h>
#include <stdlib.h>

int dm_adamw_init(dm_adamw *o, int64_t n, float lr) {
    o->lr = lr;
    o->beta1 = 0.9f;
    o->beta2 = 0.999f;
    o->eps = 1e-8f;
    o->weight_decay = 0.01f;
    o->n = n;
    o->t = 0;
    o->m = calloc((size_t)n, sizeof(float));
    o->v = calloc((size_t)n, sizeof(float));
    if (!o->m || !o->v) {
        dm_adamw_free(o);
        return -1;
    }
    return 0;
}

void dm_adamw_free(dm_adamw *o) {
    free(o->m);
    free(o->v);
    o->m = o->v = NULL;
}

void dm_adamw_step(dm_adamw *o, float *params, const float *grads) {
    int64_t i;
    float bc1, bc2;
    o->t++;
    bc1 = 1.0f - powf(o->beta1, (float)o->t);
    bc2 = 1.0f - powf(o->beta2, (float)o->t);
    for (i = 0; i < o->n; i++) {
        float g = grads[i];
        float m = o->m[i] = o->beta1 * o->m[i] + (1.0f - o->beta1) * g;
        float v = o->v[i] = o->beta2 * o->v[i] + (1.0f - o->beta2) * g * g;
        float p = params[i] * (1.0f - o->lr * o->weight_decay);
        params[i] = p - o->lr * (m / bc1) / (sqrtf(v / bc2) + o->eps);
    }
}
