/*
 * optimizer_internal.h — the layout of the optimizer object, shared by
 * optimizer.c (registration, updates) and checkpoint.c (save/load) only.
 */
#ifndef AM_OPTIMIZER_INTERNAL_H
#define AM_OPTIMIZER_INTERNAL_H

#include "internal.h"

typedef struct am_param_slot {
    am_tensor t;          /* data, dtype, shape of the caller's parameter */
    am_state st;          /* buffers below, owned */
    void *state_mem;      /* one allocation for lr, polarity, row, col, sq */
    void *ws;             /* workspace for this parameter (threads may update
                             different parameters at once) */
    size_t ws_bytes;
    int64_t skipped;
} am_param_slot;

struct am_optimizer {
    am_hparams hp;
    uint64_t seed;
    am_param_slot *params;
    int32_t count, cap;
};

/* SPEC 1: a start lr above 1e-3 is forced to 1e-6 with a warning, as the
 * reference does (am_optimizer_create, and a loaded checkpoint's). */
void am_force_start_lr(am_hparams *hp);

#endif /* AM_OPTIMIZER_INTERNAL_H */
