/* fuzz_model.h — the model the checkpoint fuzzer loads into, shared by the
 * target and by the seed-corpus generator: awkward shapes (0-D, odd 1-D,
 * 2-D, 3-D with padded polarity rows, empty) in all three dtypes. */
#ifndef AM_FUZZ_MODEL_H
#define AM_FUZZ_MODEL_H

#include <automagic.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FM_NP 5
#define FM_MAXN 64

typedef struct fuzz_model {
    am_optimizer *opt;
    float w32[FM_NP][FM_MAXN];
    uint16_t w16[FM_NP][FM_MAXN];
} fuzz_model;

static const int32_t fm_ndim[FM_NP] = {0, 1, 2, 3, 2};
static const int64_t fm_dims[FM_NP][3] = {{0}, {13}, {3, 10}, {2, 3, 5}, {0, 4}};
static const am_dtype fm_dt[FM_NP] = {AM_DTYPE_FLOAT32, AM_DTYPE_BFLOAT16,
                                      AM_DTYPE_FLOAT32, AM_DTYPE_FLOAT16,
                                      AM_DTYPE_FLOAT32};

/* 0 on success. */
static int fuzz_model_init(fuzz_model *m, uint64_t seed) {
    am_hparams hp = am_hparams_default();
    int p, i;
    int32_t id;
    memset(m, 0, sizeof *m);
    hp.lr = 1e-3;
    if (am_optimizer_create(&hp, seed, &m->opt) != AM_OK) return -1;
    for (p = 0; p < FM_NP; p++) {
        for (i = 0; i < FM_MAXN; i++) {
            m->w32[p][i] = (float)(i % 7) * 0.25f - 0.75f;
            m->w16[p][i] = (uint16_t)(0x3c00u + (unsigned)(i * 37 % 512));
        }
        if (am_optimizer_add_param(m->opt,
                                   fm_dt[p] == AM_DTYPE_FLOAT32 ? (void *)m->w32[p]
                                                                : (void *)m->w16[p],
                                   fm_dt[p], fm_ndim[p], fm_dims[p], &id) != AM_OK)
            return -1;
    }
    return 0;
}

/* One update of every parameter with gradients derived from k. */
static void fuzz_model_step(fuzz_model *m, int k, int poison) {
    float g[FM_MAXN];
    int p, i;
    for (p = 0; p < FM_NP; p++) {
        for (i = 0; i < FM_MAXN; i++)
            g[i] = (float)(((i + 3) * (p + 5) * (k + 7)) % 29) / 29.0f - 0.5f;
        if (poison && p == 2) g[4] = 1.0f / 0.0f;
        (void)am_optimizer_update_param(m->opt, p, g, AM_DTYPE_FLOAT32, NULL);
    }
}

/* The checkpoint image of o (malloc'd), or NULL. */
static unsigned char *fuzz_image(const am_optimizer *o, size_t *n) {
    unsigned char *b;
    if (am_optimizer_save_memory(o, NULL, 0, n) != AM_OK) return NULL;
    b = (unsigned char *)malloc(*n ? *n : 1);
    if (b && am_optimizer_save_memory(o, b, *n, n) != AM_OK) {
        free(b);
        return NULL;
    }
    return b;
}

#endif /* AM_FUZZ_MODEL_H */
