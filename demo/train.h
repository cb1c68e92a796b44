/*
 * train.h — one training run of the character MLP with one optimizer and one
 * weight format, recording the curves the demo prints, saves and plots.
 */
#ifndef DM_TRAIN_H
#define DM_TRAIN_H

#include <stdint.h>

#include "data.h"
#include "model.h"

typedef enum dm_opt_kind { DM_OPT_AUTOMAGIC3 = 0, DM_OPT_ADAMW = 1 } dm_opt_kind;

/* How the weights are stored between steps. The forward and backward always
 * compute in float32 (from an exact float32 copy of bfloat16 weights).
 *   F32      : float32 weights, updated in place.
 *   BF16_SR  : bfloat16 weights given to libautomagic as AM_DTYPE_BFLOAT16: it
 *              computes the update in float32 and rounds stochastically.
 *   BF16_RTN : the same update computed by libautomagic on the float32 copy,
 *              then rounded to the nearest bfloat16 (ties to even) by the demo,
 *              as a plain bfloat16 training loop without stochastic rounding
 *              would. */
typedef enum dm_weights { DM_W_F32 = 0, DM_W_BF16_SR = 1, DM_W_BF16_RTN = 2 } dm_weights;

typedef struct dm_run_spec {
    const char *name;  /* short id used in the CSV ("automagic3", ...) */
    dm_opt_kind opt;
    dm_weights weights;
} dm_run_spec;

typedef struct dm_train_opts {
    int steps;
    int batch;
    int eval_every;     /* steps between curve points */
    int val_subset;     /* validation examples used for curve points */
    uint64_t seed;      /* init, batch order, sampling, rounding noise */
    float adamw_lr;
    int progress;       /* draw the progress bar on stderr */
} dm_train_opts;

/* One curve point. train_loss: mean minibatch loss since the last point.
 * val_loss: on the first val_subset validation examples.
 * lr_mean: libautomagic's mean lr (mean over tensors of each tensor's mean).
 * lr_min..lr_max: percentiles over the per-row lrs of the three matrices
 * (emb, W1, W2: one lr per output row). lr_tensor: each tensor's mean lr
 * (b1, b2 have one lr per element). AdamW reports its constant lr in all. */
typedef struct dm_point {
    int step;
    double train_loss, val_loss;
    double lr_mean, lr_min, lr_p10, lr_p50, lr_p90, lr_max;
    double lr_tensor[DM_NUM_TENSORS];
    double elapsed_s;
} dm_point;

#define DM_SAMPLES 6

typedef struct dm_result {
    dm_point *points;          /* owned */
    int npoints;
    double val_loss;           /* on the whole validation set, at the end */
    double train_loss;         /* mean minibatch loss over the last 10% of steps */
    double train_s;            /* wall time of the training steps (no evaluation) */
    double opt_s;              /* of which in the optimizer update */
    int64_t skipped;           /* updates libautomagic skipped (non-finite) */
    char samples[DM_SAMPLES][DM_MAX_WORD + 1];
} dm_result;

/* Trains a fresh model (the same initial weights and batches for every spec
 * with the same seed). Returns 0, or -1 with a message in err. */
int dm_train(const dm_config *c, const dm_examples *train, const dm_examples *val,
             const dm_run_spec *spec, const dm_train_opts *o, dm_result *res, char *err,
             int errsz);
void dm_result_free(dm_result *r);

/* Mean NLL of the model over examples [0, n) of e, in batches of acts->B. */
double dm_eval(const dm_config *c, const dm_layout *l, const float *params,
               const dm_examples *e, int64_t n, dm_acts *a);

/* bfloat16 <-> float32. bf16_from_f32_rtn rounds to nearest, ties to even. */
uint16_t dm_bf16_from_f32_rtn(float f);
float dm_f32_from_bf16(uint16_t b);

#endif /* DM_TRAIN_H */
