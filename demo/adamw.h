/*
 * adamw.h — AdamW (Loshchilov & Hutter 2019) in C, the baseline the demo
 * compares Automagic3 against. Same defaults as torch.optim.AdamW except lr,
 * which the caller chooses: betas (0.9, 0.999), eps 1e-8, weight_decay 0.01.
 */
#ifndef DM_ADAMW_H
#define DM_ADAMW_H

#include <stdint.h>

typedef struct dm_adamw {
    float lr, beta1, beta2, eps, weight_decay;
    int64_t n, t;
    float *m; /* (n) first moment */
    float *v; /* (n) second moment */
} dm_adamw;

/* Zeroed moments for n parameters; returns 0 or -1 (out of memory). */
int dm_adamw_init(dm_adamw *o, int64_t n, float lr);
void dm_adamw_free(dm_adamw *o);

/* One step over the flat float32 params (n) with grads (n), as
 * torch.optim.AdamW computes it: p *= 1 - lr*wd; m, v EMAs;
 * p -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps). */
void dm_adamw_step(dm_adamw *o, float *params, const float *grads);

#endif /* DM_ADAMW_H */
