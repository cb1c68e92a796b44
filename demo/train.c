/* train.c — one training run (see train.h). */
#include "train.h"

#include <automagic.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "adamw.h"
#include "report.h"

uint16_t dm_bf16_from_f32_rtn(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round half to even on the dropped 16 bits */
    return (uint16_t)(u >> 16);
}

float dm_f32_from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

double dm_eval(const dm_config *c, const dm_layout *l, const float *params,
               const dm_examples *e, int64_t n, dm_acts *a) {
    double sum = 0.0;
    int64_t i;
    for (i = 0; i < n; i += a->B) {
        int b = (int)(n - i < a->B ? n - i : a->B);
        sum += dm_forward(c, l, params, e->X + i * e->ctx, e->Y + i, b, a) * b;
    }
    return sum / (double)n;
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Fills the lr fields of pt from opt (lrs has room for every lr). */
static void lr_stats(const am_optimizer *opt, const dm_layout *l, float *lrs, dm_point *pt) {
    int64_t n = 0, k;
    int32_t id;
    double mean;
    for (id = 0; id < am_optimizer_num_params(opt); id++) {
        int64_t cnt = am_optimizer_lr_count(opt, id);
        am_optimizer_lr_mean(opt, id, &pt->lr_tensor[id]);
        if (l->ndim[id] != 2) continue; /* percentiles over matrix rows only */
        am_optimizer_get_lrs(opt, id, lrs + n, cnt);
        n += cnt;
    }
    qsort(lrs, (size_t)n, sizeof *lrs, cmp_float);
    am_optimizer_lr_mean(opt, -1, &mean);
    pt->lr_mean = mean;
    pt->lr_min = lrs[0];
    pt->lr_max = lrs[n - 1];
    k = n - 1;
    pt->lr_p10 = lrs[(int64_t)(0.1 * (double)k + 0.5)];
    pt->lr_p50 = lrs[(int64_t)(0.5 * (double)k + 0.5)];
    pt->lr_p90 = lrs[(int64_t)(0.9 * (double)k + 0.5)];
    }

/* Everything one run allocates, freed in one place. */
typedef struct run_buffers {
    float *params;     /* (P) float32 weights, or the float32 copy of bf16 ones */
    float *grads;      /* (P) */
    uint16_t *bf16;    /* (P) bfloat16 weights, bf16 runs only */
    uint8_t *bx, *by;  /* (B, K), (B) the current batch */
    float *lrs;        /* every per-row lr, for percentiles */
    dm_acts acts;
    am_optimizer *am;
    dm_adamw adamw;
} run_buffers;

static void buffers_free(run_buffers *b) {
    free(b->params);
    free(b->grads);
    free(b->bf16);
    free(b->bx);
    free(b->by);
    free(b->lrs);
    dm_acts_free(&b->acts);
    am_optimizer_destroy(b->am);
    dm_adamw_free(&b->adamw);
}

/* Creates the Automagic3 optimizer with its defaults over the weights the
 * spec trains: the bfloat16 block for SR, else the float32 one. */
static int setup_automagic(const dm_layout *l, const dm_run_spec *spec, uint64_t seed,
                           run_buffers *b, char *err, int errsz) {
    am_hparams hp = am_hparams_default();
    am_status st = am_optimizer_create(&hp, seed, &b->am);
    int t;
    for (t = 0; st == AM_OK && t < DM_NUM_TENSORS; t++) {
        int32_t id;
        void *data = spec->weights == DM_W_BF16_SR ? (void *)(b->bf16 + l->offset[t])
                                                   : (void *)(b->params + l->offset[t]);
        am_dtype dt = spec->weights == DM_W_BF16_SR ? AM_DTYPE_BFLOAT16 : AM_DTYPE_FLOAT32;
        st = am_optimizer_add_param(b->am, data, dt, l->ndim[t], l->shape[t], &id);
    }
    if (st != AM_OK) {
        snprintf(err, (size_t)errsz, "libautomagic: %s", am_status_string(st));
        return -1;
    }
    return 0;
}

int dm_train(const dm_config *c, const dm_examples *train, const dm_examples *val,
             const dm_run_spec *spec, const dm_train_opts *o, dm_result *res, char *err,
             int errsz) {
    dm_layout l;
    run_buffers b;
    dm_progress bar;
    const int B = o->batch, K = c->K;
    const int bf16 = spec->weights != DM_W_F32;
    int64_t i, P;
    uint64_t batch_rng = o->seed ^ 0xB47C4ull, sample_rng = o->seed ^ 0x5A3913ull;
    double window = 0.0, tail = 0.0, ema = 0.0, t_start;
    int step, nwin = 0, ntail = 0, s, t, maxpts;
    /* the last tenth of the steps, at least one (fewer than 10 steps gave
     * an empty tail: a NaN train loss) */
    const int tail_from = o->steps - (o->steps >= 10 ? o->steps / 10 : 1);
    int eval_b = B > 4096 ? B : 4096;

    memset(res, 0, sizeof *res);
    memset(&b, 0, sizeof b);
    dm_layout_init(c, &l);
    P = l.total;
    maxpts = o->steps / o->eval_every + 2;
    b.params = malloc((size_t)P * sizeof(float));
    b.grads = malloc((size_t)P * sizeof(float));
    b.bf16 = bf16 ? malloc((size_t)P * sizeof(uint16_t)) : NULL;
    b.bx = malloc((size_t)B * K);
    b.by = malloc((size_t)B);
    b.lrs = malloc((size_t)P * sizeof(float));
    res->points = calloc((size_t)maxpts, sizeof(dm_point));
    if (!b.params || !b.grads || (bf16 && !b.bf16) || !b.bx || !b.by || !b.lrs ||
        !res->points || dm_acts_alloc(c, eval_b, &b.acts) != 0) {
        snprintf(err, (size_t)errsz, "out of memory");
        buffers_free(&b);
        dm_result_free(res);
        return -1;
    }
    dm_model_init(c, &l, b.params, o->seed);
    if (bf16) /* the bf16 runs start from the float32 init rounded to nearest */
        for (i = 0; i < P; i++) b.params[i] = dm_f32_from_bf16(b.bf16[i] = dm_bf16_from_f32_rtn(b.params[i]));
    if (spec->opt == DM_OPT_AUTOMAGIC3) {
        if (setup_automagic(&l, spec, o->seed, &b, err, errsz) != 0) {
            buffers_free(&b);
            dm_result_free(res);
            return -1;
        }
    } else if (dm_adamw_init(&b.adamw, P, o->adamw_lr) != 0) {
        snprintf(err, (size_t)errsz, "out of memory");
        buffers_free(&b);
        dm_result_free(res);
        return -1;
    }

    dm_progress_begin(&bar, spec->name, o->steps, o->progress);
    t_start = dm_now();
    for (step = 0; step <= o->steps; step++) {
        double loss;
        if (step % o->eval_every == 0 || step == o->steps) { /* a curve point */
            dm_point *pt = &res->points[res->npoints++];
            double t_eval = dm_now();
            pt->step = step;
            pt->train_loss = nwin ? window / nwin : NAN;
            pt->val_loss = dm_eval(c, &l, b.params, val, o->val_subset, &b.acts);
            if (b.am) {
                lr_stats(b.am, &l, b.lrs, pt);
            } else {
                pt->lr_mean = pt->lr_min = pt->lr_p10 = pt->lr_p50 = pt->lr_p90 =
                    pt->lr_max = o->adamw_lr;
                for (t = 0; t < DM_NUM_TENSORS; t++) pt->lr_tensor[t] = o->adamw_lr;
            }
            pt->elapsed_s = res->train_s;
            window = 0.0;
            nwin = 0;
            t_start += dm_now() - t_eval; /* evaluation is not training time */
        }
        if (step == o->steps) break;

        for (s = 0; s < B; s++) { /* a random batch, the same for every run */
            int64_t j = (int64_t)(dm_rand_u64(&batch_rng) % (uint64_t)train->n);
            memcpy(b.bx + s * K, train->X + j * K, (size_t)K);
            b.by[s] = train->Y[j];
        }
        loss = dm_forward(c, &l, b.params, b.bx, b.by, B, &b.acts);
        dm_backward(c, &l, b.params, b.bx, b.by, B, &b.acts, b.grads);

        {
            double t1 = dm_now();
            if (b.am) {
                for (t = 0; t < DM_NUM_TENSORS; t++) {
                    am_status st = am_optimizer_update_param(b.am, t, b.grads + l.offset[t],
                                                             AM_DTYPE_FLOAT32, NULL);
                    if (am_status_is_error(st)) {
                        dm_progress_end(&bar);
                        snprintf(err, (size_t)errsz, "libautomagic update of %s: %s",
                                 dm_tensor_names[t], am_status_string(st));
                        buffers_free(&b);
                        dm_result_free(res);
                        return -1;
                    }
                }
            } else {
                dm_adamw_step(&b.adamw, b.params, b.grads);
            }
            if (spec->weights == DM_W_BF16_RTN)
                for (i = 0; i < P; i++) b.bf16[i] = dm_bf16_from_f32_rtn(b.params[i]);
            if (bf16) /* the next forward sees exactly the stored bf16 weights */
                for (i = 0; i < P; i++) b.params[i] = dm_f32_from_bf16(b.bf16[i]);
            res->opt_s += dm_now() - t1;
        }
        res->train_s = dm_now() - t_start;
        window += loss;
        nwin++;
        if (step >= tail_from) {
            tail += loss;
            ntail++;
        }
        {
            double lr = o->adamw_lr;
            if (b.am) am_optimizer_lr_mean(b.am, -1, &lr);
            /* the bar shows a running mean (about the last 50 steps), not one noisy batch */
            ema = step == 0 ? loss : 0.98 * ema + 0.02 * loss;
            dm_progress_update(&bar, step + 1, ema, lr, res->train_s);
        }
    }
    dm_progress_end(&bar);

    res->train_loss = ntail ? tail / ntail : NAN;
    res->val_loss = dm_eval(c, &l, b.params, val, val->n, &b.acts);
    res->skipped = b.am ? am_optimizer_skipped_count(b.am) : 0;
    for (s = 0; s < DM_SAMPLES; s++)
        dm_sample(c, &l, b.params, &b.acts, &sample_rng, res->samples[s], DM_MAX_WORD);
    buffers_free(&b);
    return 0;
}

void dm_result_free(dm_result *r) {
    free(r->points);
    r->points = NULL;
    r->npoints = 0;
}
