/*
 * update.c — one update of one parameter over caller-owned buffers (SPEC 3),
 * in three phases so that sharded engines can reduce between them:
 *   stats   : pass 1 over g — row/col sums of g*g (factored) or, unfactored,
 *             the sum of u*u; non-finite detection.
 *   moments : new second moments and scale factors in the workspace; pass 2
 *             over g — the sum of u*u (factored only).
 *   finish  : pass 3 — clip, agreement, lr bump, parameter update; the state
 *             is written only here, after every check has passed.
 * am_update of many small matrices (e.g. 3x3 convolutions) runs stats and
 * moments as one sweep instead (run_stats_moments_mats), which writes the
 * new moments over the old and puts the old back if the update is skipped.
 * Work is split into tiles whose results are combined in a fixed order, so
 * the bits never depend on the thread count (internal.h, AM_LANES).
 */
#include "internal.h"

#include "fpenv.h"

#include <math.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

typedef struct upd {
    am_geom g;
    const am_tensor *param, *grad;
    const am_state *state;
    unsigned char *ws;
    am_ws_header *h;
    am_consts k;
    const am_kernels *kt;
    float scale, inv; /* clip divisor (SPEC 3.2) and 1 / scale (apply_rows) */
    am_rng_key key;
    /* am_update's sweep of many small matrices ran (run_stats_moments_mats):
     * the new moments are in the state row/col, the old ones in the
     * workspace's new_row/new_col (put back if the update is skipped), and
     * finish may count the agreement from the sign of g (count_pos) where
     * facmin, a lower bound of every rf[i] * cf[j], shows that u / scale
     * has that sign */
    int mats_sweep;
    float facmin;
    am_state *wstate; /* am_update's state (writable), for that */
    int64_t dim0_total; /* am_update_stats_shard's, for the header; else 0 */
    int64_t noise_off;  /* its first element's index in the whole parameter */
} upd;

#define WS(u, off, T) ((T *)((u)->ws + (u)->g.off))

/* Records the parameter's shape in the workspace header (stats). */
static void header_set_shape(upd *u) {
    const am_shape *s = &u->param->shape;
    int d;
    u->h->numel = u->g.numel;
    u->h->ndim = s->ndim;
    for (d = 0; d < AM_MAX_DIMS; d++) u->h->dims[d] = d < s->ndim ? s->dims[d] : 0;
    u->h->dim0_total = u->dim0_total;
    u->h->noise_off = u->noise_off;
    u->h->row_moment_sum = 0.0;
}

/* 1 when the workspace header holds stage's results for this parameter's
 * shape (moments and finish after the phase before them). */
static int header_matches(const upd *u, int64_t stage) {
    const am_shape *s = &u->param->shape;
    int d;
    if (u->h->stage != stage || u->h->numel != u->g.numel || u->h->ndim != s->ndim) return 0;
    for (d = 0; d < s->ndim; d++)
        if (u->h->dims[d] != s->dims[d]) return 0;
    return 1;
}

static am_status check_state(const am_geom *g, const am_state *s) {
    AM_RETURN_IF(!s, AM_ERR_NULL_POINTER, "state is NULL");
    /* (before the no-op's return: the header refuses step < 0 for every
     * parameter; found by a review, twenty-fourth session) */
    AM_RETURN_IF(s->step < 0, AM_ERR_INVALID_ARGUMENT,
                 "state.step = %lld is negative", (long long)s->step);
    if (g->numel == 0) return AM_OK;
    AM_RETURN_IF(!s->lr, AM_ERR_NULL_POINTER, "state.lr is NULL");
    AM_RETURN_IF(!s->polarity, AM_ERR_NULL_POINTER, "state.polarity is NULL");
    if (g->ndim >= 2) {
        AM_RETURN_IF(!s->row, AM_ERR_NULL_POINTER, "state.row is NULL");
        AM_RETURN_IF(!s->col, AM_ERR_NULL_POINTER, "state.col is NULL");
    } else {
        AM_RETURN_IF(!s->sq, AM_ERR_NULL_POINTER, "state.sq is NULL");
    }
    AM_CHECK(am_check_state_aligned(s, ""));
    /* step is incremented: INT64_MAX would overflow (undefined behaviour). */
    AM_RETURN_IF(s->step == INT64_MAX, AM_ERR_INVALID_ARGUMENT,
                 "state.step = %lld cannot be incremented", (long long)s->step);
    return AM_OK;
}

/* The check of internal.h (am_check_buffers). */
am_status am_check_buffers(const am_state_sizes *sz, const am_tensor *param,
                           const am_tensor *grad, const am_state *state) {
    static const char *const names[7] = {"param data", "state lr", "state polarity",
                                         "state row", "state col", "state sq",
                                         "grad data"};
    const void *p[7];
    uintptr_t lo[7], hi[7];
    int i, j;
    p[0] = param->data;
    p[1] = state->lr;
    p[2] = state->polarity;
    p[3] = state->row;
    p[4] = state->col;
    p[5] = state->sq;
    p[6] = grad->data;
    if (sz->numel == 0) return AM_OK; /* nothing is read or written */
    hi[0] = (uintptr_t)(sz->numel * (int64_t)am_dtype_size(param->dtype));
    hi[1] = (uintptr_t)(4 * sz->lr_count);
    hi[2] = (uintptr_t)sz->polarity_bytes;
    hi[3] = (uintptr_t)(4 * sz->row_count);
    hi[4] = (uintptr_t)(4 * sz->col_count);
    hi[5] = (uintptr_t)(4 * sz->sq_count);
    hi[6] = (uintptr_t)(sz->numel * (int64_t)am_dtype_size(grad->dtype));
    for (i = 0; i < 7; i++) {
        lo[i] = (uintptr_t)p[i];
        hi[i] = p[i] && hi[i] ? lo[i] + hi[i] : lo[i]; /* empty: overlaps nothing */
    }
    for (i = 0; i < 7; i++)
        for (j = i + 1; j < 7; j++)
            AM_RETURN_IF(!(i == 0 && j == 6) && lo[i] < hi[i] && lo[j] < hi[j] &&
                             lo[i] < hi[j] && lo[j] < hi[i],
                         AM_ERR_INVALID_ARGUMENT, "%s and %s share memory", names[i],
                         names[j]);
    return AM_OK;
}

/* Every argument check but the workspace's; fills u->g. Modifies nothing. */
static am_status validate(upd *u, const am_tensor *param, const am_tensor *grad,
                          const am_state *state, const am_hparams *hp) {
    int32_t d;
    AM_RETURN_IF(!param, AM_ERR_NULL_POINTER, "param is NULL");
    AM_RETURN_IF(!grad, AM_ERR_NULL_POINTER, "grad is NULL");
    AM_CHECK(am_geom_init_as(&param->shape, &u->g, "param shape"));
    AM_RETURN_IF(am_dtype_size(param->dtype) == 0, AM_ERR_INVALID_DTYPE,
                 "param dtype %d is not float32, bfloat16 or float16",
                 (int)param->dtype);
    AM_RETURN_IF(am_dtype_size(grad->dtype) == 0, AM_ERR_INVALID_DTYPE,
                 "grad dtype %d is not float32, bfloat16 or float16",
                 (int)grad->dtype);
    AM_RETURN_IF(grad->shape.ndim != param->shape.ndim, AM_ERR_INVALID_SHAPE,
                 "grad has %d dims, param has %d", (int)grad->shape.ndim,
                 (int)param->shape.ndim);
    for (d = 0; d < param->shape.ndim; d++)
        AM_RETURN_IF(grad->shape.dims[d] != param->shape.dims[d],
                     AM_ERR_INVALID_SHAPE,
                     "grad dims[%d] = %lld differs from param's %lld", (int)d,
                     (long long)grad->shape.dims[d],
                     (long long)param->shape.dims[d]);
    AM_CHECK(am_hparams_validate(hp));
    AM_CHECK(check_state(&u->g, state));
    if (u->g.numel > 0) {
        AM_RETURN_IF(!param->data, AM_ERR_NULL_POINTER, "param data is NULL");
        AM_RETURN_IF(!grad->data, AM_ERR_NULL_POINTER, "grad data is NULL");
        AM_CHECK(am_check_aligned(param->data, am_dtype_size(param->dtype), "param data"));
        AM_CHECK(am_check_aligned(grad->data, am_dtype_size(grad->dtype), "grad data"));
    }
    AM_CHECK(am_check_buffers(&u->g.sizes, param, grad, state));
    return AM_OK;
}

am_status am_update_check(const am_tensor *param, const am_tensor *grad,
                          const am_state *state, const am_hparams *hp,
                          int64_t *workspace_bytes) {
    upd u;
    memset(&u, 0, sizeof u);
    AM_CHECK(validate(&u, param, grad, state, hp));
    *workspace_bytes = u.g.sizes.workspace_bytes;
    return AM_OK;
}

/* Every argument check of every phase; fills u. Modifies nothing. */
static am_status prepare(upd *u, const am_tensor *param, const am_tensor *grad,
                         const am_state *state, const am_hparams *hp,
                         void *workspace, size_t workspace_bytes) {
    AM_CHECK(validate(u, param, grad, state, hp));
    AM_RETURN_IF(!workspace, AM_ERR_NULL_POINTER, "workspace is NULL");
    u->ws = am_ws_base(&u->g, workspace, workspace_bytes);
    AM_RETURN_IF(!u->ws, AM_ERR_BUFFER_SIZE,
                 "workspace: %zu bytes given, %lld needed", workspace_bytes,
                 (long long)u->g.sizes.workspace_bytes);
    u->h = (am_ws_header *)u->ws;
    u->param = param;
    u->grad = grad;
    u->state = state;
    u->k = am_consts_from(hp);
    u->kt = am_kernels_get();
    return AM_OK;
}

static size_t esize(am_dtype d) { return am_dtype_size(d); }

/* Element (b, 0, 0) of a factored tensor. */
static const void *mat_ptr(const am_tensor *t, const am_geom *g, int64_t b) {
    return (const char *)t->data + (size_t)(b * g->R * g->C) * esize(t->dtype);
}

static int64_t count_nonfinite(const am_tensor *t, int64_t n) {
    int64_t i, c = 0;
    for (i = 0; i < n; i++) c += !am_isfinite_f32(am_load(t->data, t->dtype, i));
    return c;
}

/* ------------------------------------------------------------ stats ---- */

/* The polarity bits of matrix b, for the agreement count. */
static am_polmap polmap_of(const upd *u, int64_t b) {
    am_polmap pm;
    pm.bits = u->state->polarity;
    pm.r0 = b * u->g.R;
    pm.rows_per_lr = u->g.m / u->g.C;
    pm.lr_bits = 8 * u->g.pol_row_bytes;
    pm.C = u->g.C;
    return pm;
}

/* Pass 1 of a tile: the sums of g*g and the agreement count (the sign of u
 * is that of g, see counts_valid), so that pass 3 reads g once less. */
static void stats_task(void *ctx, int64_t t) {
    upd *u = (upd *)ctx;
    const am_geom *g = &u->g;
    int64_t cb = t % g->ncb, rb = (t / g->ncb) % g->nrb, b = t / (g->ncb * g->nrb);
    int64_t i0 = rb * g->RB, i1 = i0 + g->RB < g->R ? i0 + g->RB : g->R;
    int64_t j0 = cb * g->CB, j1 = j0 + g->CB < g->C ? j0 + g->CB : g->C;
    float *rowdst = g->ncb > 1 ? WS(u, off_rowpart, float) + cb * g->B * g->R
                               : WS(u, off_row_sumsq, float);
    float *coldst = g->nrb > 1 ? WS(u, off_colpart, float) + rb * g->B * g->C
                               : WS(u, off_col_sumsq, float);
    am_polmap pm = polmap_of(u, b);
    am_wsum ws;
    if (g->wsum) {
        ws.row_old = u->state->row + b * g->R;
        ws.nr = WS(u, off_wnr, float) + b * g->R;
        ws.wpart = WS(u, off_wpart, float) + rb * g->B * g->C + b * g->C + j0;
        ws.k = &u->k;
        ws.Cinv = am_inv_count(g->C);
    }
    u->kt->stats_tile(mat_ptr(u->grad, g, b), u->grad->dtype, g->C, i0, i1, j0,
                      j1, rowdst + b * g->R + i0, coldst + b * g->C + j0, &pm,
                      WS(u, off_rowmatch, int32_t) + cb * g->B * g->R + b * g->R + i0,
                      WS(u, off_tile_minpos, float) + t, g->wsum ? &ws : NULL);
}

/* Many small matrices (R*C <= AM_MATS_MAX_ELEMS, each one tile): a task
 * takes a run of whole matrices, a multiple of AM_SUM_GROUP (so of the
 * kernels' 8 and 16) of about AM_FLAT_CHUNK elements, through the batched
 * kernel slots. Each matrix's sums are those of its own tile, so the
 * grouping changes no bit; am_update's sweep sums its tasks' groups of
 * tiles itself (stats_u2_mats_task). */
static int batched(const am_geom *g) { return g->batched; }

static int64_t mats_per_task(const am_geom *g) {
    int64_t n = AM_FLAT_CHUNK / (g->R * g->C) / AM_SUM_GROUP * AM_SUM_GROUP;
    return n < AM_SUM_GROUP ? AM_SUM_GROUP : n;
}

static int64_t mat_tasks(const am_geom *g) {
    return (g->B + mats_per_task(g) - 1) / mats_per_task(g);
}

static void mats_range(const am_geom *g, int64_t t, int64_t *b0, int64_t *b1) {
    int64_t n = mats_per_task(g);
    *b0 = t * n;
    *b1 = *b0 + n < g->B ? *b0 + n : g->B;
}

static void stats_mats_task(void *ctx, int64_t t) {
    upd *u = (upd *)ctx;
    const am_geom *g = &u->g;
    int64_t b0, b1;
    mats_range(g, t, &b0, &b1);
    u->kt->stats_mats(u->grad->data, u->grad->dtype, g->R, g->C, b0, b1,
                      WS(u, off_row_sumsq, float), WS(u, off_col_sumsq, float));
}

/* The new moments and factors of a run of small matrices, then their sums
 * of u^2 (tile index == matrix index: one tile per matrix), while the
 * factors are in cache; every matrix's numbers are its own, so the grouping
 * and the threads change no bit. */
static void moments_u2_mats_task(void *ctx, int64_t t) {
    upd *u = (upd *)ctx;
    const am_geom *g = &u->g;
    int64_t b0, b1;
    mats_range(g, t, &b0, &b1);
    u->kt->moments_mats(g->R, g->C, b0, b1, u->state->row, u->state->col,
                        WS(u, off_row_sumsq, float), WS(u, off_col_sumsq, float), &u->k,
                        WS(u, off_new_row, float), WS(u, off_new_col, float),
                        WS(u, off_rf, float), WS(u, off_cf, float), WS(u, off_rmean, float));
    u->kt->u2_mats(u->grad->data, u->grad->dtype, g->R, g->C, b0, b1,
                   WS(u, off_rf, float), WS(u, off_cf, float),
                   WS(u, off_tile_u2, double) + b0);
}

/* am_update's batched path: the three slots above in one sweep per run of
 * matrices (stats_u2_mats), same bits. The per-matrix sums of u^2 go to a
 * buffer on the stack, AM_SWEEP_MATS matrices at a time, and only their
 * group sums (am_sum_group) to the workspace, group k at tile_u2[k]: 1/64
 * of the bytes, and the groups summed by the threads. */
#define AM_SWEEP_MATS (8 * AM_SUM_GROUP)
static void stats_u2_mats_task(void *ctx, int64_t t) {
    upd *u = (upd *)ctx;
    const am_geom *g = &u->g;
    double u2[AM_SWEEP_MATS];
    float *fmin = WS(u, off_tile_minpos, float) + 2 * t; /* 2 * tasks <= B */
    int64_t b0, b1, c0, k;
    mats_range(g, t, &b0, &b1);
    fmin[0] = fmin[1] = INFINITY;
    for (c0 = b0; c0 < b1; c0 += AM_SWEEP_MATS) {
        const int64_t c1 = c0 + AM_SWEEP_MATS < b1 ? c0 + AM_SWEEP_MATS : b1;
        float fm[2];
        /* the new moments over the old in the state (am_update's state is
         * writable: u->wstate), the old ones into new_row/new_col; the sums
         * of g^2 and the row means are not kept (NULL): nothing reads them */
        u->kt->stats_u2_mats(u->grad->data, u->grad->dtype, g->R, g->C, c0, c1,
                             u->wstate->row, u->wstate->col, &u->k, NULL, NULL,
                             u->wstate->row, u->wstate->col, WS(u, off_rf, float),
                             WS(u, off_cf, float), NULL, u2, fm,
                             WS(u, off_new_row, float), WS(u, off_new_col, float));
        /* the smallest rf and cf of the task (a NaN passed over, as there) */
        if (fm[0] < fmin[0]) fmin[0] = fm[0];
        if (fm[1] < fmin[1]) fmin[1] = fm[1];
        for (k = c0; k < c1; k += AM_SUM_GROUP) /* c0: a multiple of AM_SUM_GROUP */
            WS(u, off_tile_u2, double)[k / AM_SUM_GROUP] = am_sum_group(
                u2 + (k - c0), c1 - k < AM_SUM_GROUP ? c1 - k : AM_SUM_GROUP);
    }
}

static void flat_u2_task(void *ctx, int64_t t) {
    upd *u = (upd *)ctx;
    int64_t e0 = t * AM_FLAT_CHUNK, e1 = e0 + AM_FLAT_CHUNK;
    if (e1 > u->g.numel) e1 = u->g.numel;
    WS(u, off_tile_u2, double)[t] = u->kt->u2_flat(
        u->grad->data, u->grad->dtype, u->state->sq, e0, e1, &u->k);
}

/* dst[x] = sum over p ascending of parts[p][x], parts of stride n. */
static void combine_parts(float *dst, const float *parts, int64_t nparts,
                          int64_t n) {
    int64_t x, p;
    /* part by part (each x's order as above), along the parts' rows */
    for (x = 0; x < n; x++) dst[x] = parts[x];
    for (p = 1; p < nparts; p++)
        for (x = 0; x < n; x++) dst[x] += parts[p * n + x];
}

/* A 2-D shard (am_update_stats_shard): the sum over its rows of the new
 * row moments, as moments_mats forms each (am_moment), for the engine to
 * reduce across the shards into the mean over every row (shard_factors). */
static void shard_row_moment_sum(upd *u) {
    const am_geom *g = &u->g;
    const float *rs = WS(u, off_row_sumsq, float), Cinv = am_inv_count(g->C);
    double s = 0.0;
    int64_t i;
    for (i = 0; i < g->R; i++) s += (double)am_moment(u->state->row[i], rs[i], Cinv, &u->k);
    u->h->row_moment_sum = s;
}

static am_status run_stats(upd *u) {
    const am_geom *g = &u->g;
    int finite = 1;
    u->h->nonfinite = 0;
    u->h->u2_sum = 0.0;
    header_set_shape(u);
    /* Tiles count the agreement; the batched small-matrix slots do not
     * (finish counts there). */
    u->h->counted = g->ndim >= 2 && g->numel > 0 && !batched(g);
    u->h->wsummed = g->ndim >= 2 && g->numel > 0 && g->wsum;
    /* No elements: sums over nothing, 0 (a [5, 0] matrix has rows but no
     * tiles, which would leave its row sums unwritten; an engine reading
     * the view of such a shard gets zeros, not old workspace bytes). */
    if (g->numel == 0) {
        if (g->ndim >= 2) {
            memset(WS(u, off_row_sumsq, float), 0, (size_t)(g->B * g->R) * sizeof(float));
            memset(WS(u, off_col_sumsq, float), 0, (size_t)(g->B * g->C) * sizeof(float));
        }
        u->h->stage = AM_STAGE_STATS;
        return AM_OK;
    }
    if (g->ndim >= 2) {
        int64_t BR = g->B * g->R, x;
        float *rs = WS(u, off_row_sumsq, float);
        if (batched(g))
            am_parallel_for(mat_tasks(g), (double)mats_per_task(g) * (double)(g->R * g->C) * 4.0,
                            stats_mats_task, u);
        else
            am_parallel_for(g->ntiles, (double)g->RB * (double)g->CB * 4.0, stats_task, u);
        if (g->ncb > 1) combine_parts(rs, WS(u, off_rowpart, float), g->ncb, BR);
        if (g->nrb > 1)
            combine_parts(WS(u, off_col_sumsq, float), WS(u, off_colpart, float),
                          g->nrb, g->B * g->C);
        /* A non-finite g makes its row's sum non-finite. */
        for (x = 0; x < BR; x++) finite &= am_isfinite_f32(rs[x]);
        if (u->h->dim0_total && g->ndim == 2) shard_row_moment_sum(u);
    } else {
        am_parallel_for(g->ntiles, AM_FLAT_CHUNK * 12.0, flat_u2_task, u);
        u->h->u2_sum = am_sum_tiles(WS(u, off_tile_u2, double), g->ntiles);
        finite = isfinite(u->h->u2_sum);
    }
    /* Rare path: tell a non-finite gradient from an overflow of g*g. */
    if (!finite) u->h->nonfinite = count_nonfinite(u->grad, g->numel);
    u->h->stage = AM_STAGE_STATS;
    return u->h->nonfinite ? AM_SKIPPED_NONFINITE_GRAD : AM_OK;
}

/* The old moments back into the state (mats_sweep, a skipped update). */
static void restore_moments(upd *u) {
    const am_geom *g = &u->g;
    memcpy(u->wstate->row, WS(u, off_new_row, float), (size_t)(g->B * g->R) * sizeof(float));
    memcpy(u->wstate->col, WS(u, off_new_col, float), (size_t)(g->B * g->C) * sizeof(float));
}

/* am_update's stats and moments phases of many small matrices in one
 * parallel sweep (stats_u2_mats_task): the same results as run_stats then
 * run_moments, except that the new moments are written over the old ones
 * in the state (mats_sweep) and put back if the update is skipped
 * (here, or in run_finish), so that finish need not copy them. */
static am_status run_stats_moments_mats(upd *u) {
    const am_geom *g = &u->g;
    u->mats_sweep = 1;
    u->h->nonfinite = 0;
    header_set_shape(u);
    u->h->counted = 0; /* finish counts (count_pos, or its sweep) */
    u->h->wsummed = 0;
    am_parallel_for(mat_tasks(g), (double)mats_per_task(g) * (double)(g->R * g->C) * 8.0,
                    stats_u2_mats_task, u);
    u->h->u2_sum = am_sum_groups(WS(u, off_tile_u2, double),
                                 (g->ntiles + AM_SUM_GROUP - 1) / AM_SUM_GROUP);
    /* A non-finite g makes the sum of u^2 NaN: its row's sum of squares,
     * new row moment and row mean are non-finite, so its row factor is
     * NaN (inf / inf, NaN / x). Rare path: tell it from an overflow. */
    if (!isfinite(u->h->u2_sum)) u->h->nonfinite = count_nonfinite(u->grad, g->numel);
    if (u->h->nonfinite) {
        restore_moments(u);
        u->h->u2_sum = 0.0;
        u->h->stage = AM_STAGE_STATS;
        return AM_SKIPPED_NONFINITE_GRAD;
    }
    u->h->stage = AM_STAGE_MOMENTS;
    { /* the bound for count_pos: rfmin * cfmin, as counts_valid forms it */
        const float *fmin = WS(u, off_tile_minpos, float);
        float mr = INFINITY, mc = INFINITY;
        int64_t t;
        for (t = 0; t < mat_tasks(g); t++) {
            mr = fmin[2 * t] < mr ? fmin[2 * t] : mr;
            mc = fmin[2 * t + 1] < mc ? fmin[2 * t + 1] : mc;
        }
        u->facmin = mr * mc;
    }
    return AM_OK;
}

/* ---------------------------------------------------------- moments ---- */

static void u2_task(void *ctx, int64_t t) {
    upd *u = (upd *)ctx;
    const am_geom *g = &u->g;
    int64_t cb = t % g->ncb, rb = (t / g->ncb) % g->nrb, b = t / (g->ncb * g->nrb);
    int64_t i0 = rb * g->RB, i1 = i0 + g->RB < g->R ? i0 + g->RB : g->R;
    int64_t j0 = cb * g->CB, j1 = j0 + g->CB < g->C ? j0 + g->CB : g->C;
    WS(u, off_tile_u2, double)[t] = u->kt->u2_tile(
        mat_ptr(u->grad, g, b), u->grad->dtype, g->C, i0, i1, j0, j1,
        WS(u, off_rf, float) + b * g->R, WS(u, off_cf, float) + b * g->C);
}

#if defined(__SSE2__)
/* The largest of the four lanes of v (no NaN among them). */
static float hmax4(__m128 v) {
    float t[4], m;
    _mm_storeu_ps(t, v);
    m = t[0] > t[1] ? t[0] : t[1];
    if (t[2] > m) m = t[2];
    if (t[3] > m) m = t[3];
    return m;
}
#endif

/* The largest magnitude in v[0..n) (factors and moment means, >= 0; +0
 * when n is 0), NaN when one is NaN (SSE2: four at a time, no branch per
 * value; a scalar loop was 2% of a (1024, 16) update). The CUDA plan's
 * am_ck_umax keeps the same. */
static float max_of(const float *v, int64_t n) {
    int64_t i = 0;
    float m = 0.0f;
#if defined(__SSE2__)
    const __m128 sign = _mm_set1_ps(-0.0f);
    __m128 mv = _mm_setzero_ps(), nan = _mm_setzero_ps();
    for (; i + 4 <= n; i += 4) {
        const __m128 x = _mm_andnot_ps(sign, _mm_loadu_ps(v + i));
        nan = _mm_or_ps(nan, _mm_cmpunord_ps(x, x));
        mv = _mm_max_ps(mv, x);
    }
    if (_mm_movemask_ps(nan)) return NAN;
    m = hmax4(mv);
#endif
    for (; i < n; i++) {
        if (v[i] != v[i]) return NAN;
        if (fabsf(v[i]) > m) m = fabsf(v[i]);
    }
    return m;
}

/* One scan of factors v[0..n) and their rows' or columns' float32 sums of
 * g*g: the largest magnitude of all (*all; NaN when one is NaN, as max_of),
 * of those whose sum is not 0 (*nz), and whether a sum is 0 (returned). For
 * am_wsum_usable; SSE2 four at a time (three scans of their own added 7-11%
 * to a (1024, 16) update). */
static int factor_maxima(const float *v, const float *sums, int64_t n, float *all, float *nz) {
    int64_t i = 0;
    float ma = 0.0f, mn = 0.0f;
    int zero = 0;
#if defined(__SSE2__)
    const __m128 sign = _mm_set1_ps(-0.0f), z = _mm_setzero_ps();
    __m128 va = _mm_setzero_ps(), vn = _mm_setzero_ps(), nan = _mm_setzero_ps();
    __m128 zs = _mm_setzero_ps();
    for (; i + 4 <= n; i += 4) {
        const __m128 x = _mm_andnot_ps(sign, _mm_loadu_ps(v + i));
        const __m128 sz = _mm_cmpeq_ps(_mm_loadu_ps(sums + i), z);
        nan = _mm_or_ps(nan, _mm_cmpunord_ps(x, x));
        va = _mm_max_ps(va, x);
        vn = _mm_max_ps(vn, _mm_andnot_ps(sz, x));
        zs = _mm_or_ps(zs, sz);
    }
    if (_mm_movemask_ps(nan)) {
        *all = *nz = NAN;
        return 1;
    }
    zero = _mm_movemask_ps(zs) != 0;
    ma = hmax4(va);
    mn = hmax4(vn);
#endif
    for (; i < n; i++) {
        const float x = fabsf(v[i]);
        if (x != x) {
            *all = *nz = NAN;
            return 1;
        }
        if (x > ma) ma = x;
        if (sums[i] == 0.0f) zero = 1;
        else if (x > mn) mn = x;
    }
    *all = ma;
    *nz = mn;
    return zero;
}

/* 1 when a row or a column whose float32 sum of g*g is 0 holds a nonzero
 * element (squares that underflowed: am_wsum_usable's zero_nz). Reads only
 * those rows and columns, which are usually none. */
static int zero_sums_hold_nonzero(const upd *u) {
    const am_geom *g = &u->g;
    const float *rs = WS(u, off_row_sumsq, float), *cs = WS(u, off_col_sumsq, float);
    const void *d = u->grad->data;
    const int dt = u->grad->dtype;
    int64_t t, k;
    for (t = 0; t < g->B * g->R; t++)
        if (rs[t] == 0.0f)
            for (k = 0; k < g->C; k++)
                if (am_load(d, dt, t * g->C + k) != 0.0f) return 1;
    for (t = 0; t < g->B * g->C; t++)
        if (cs[t] == 0.0f) {
            const int64_t b = t / g->C, j = t - b * g->C;
            for (k = 0; k < g->R; k++)
                if (am_load(d, dt, (b * g->R + k) * g->C + j) != 0.0f) return 1;
        }
    return 0;
}

/* The sum of u*u from the stats pass's W sums (am_wsum, internal.h) into
 * u2_sum; returns 0 (nothing set) when they cannot stand for the pass: not
 * filled, filled from other row sums than the ones the moments came from
 * (an engine reduced row_sumsq between the phases, so the new row moments
 * differ), or am_wsum_usable fails. */
static int u2_from_wsum(upd *u) {
    const am_geom *g = &u->g;
    const float *cf = WS(u, off_cf, float), *rmean = WS(u, off_rmean, float);
    const float *wp = WS(u, off_wpart, float);
    int64_t BC = g->B * g->C, b, j;
    double u2 = 0.0;
    if (!u->h->wsummed ||
        memcmp(WS(u, off_wnr, float), WS(u, off_new_row, float),
               (size_t)(g->B * g->R) * sizeof(float)) != 0)
        return 0;
    for (b = 0; b < g->B; b++) {
        double t = 0.0;
        for (j = 0; j < g->C; j += AM_WSUM_JBLOCK) {
            int64_t j1 = j + AM_WSUM_JBLOCK < g->C ? j + AM_WSUM_JBLOCK : g->C;
            t += am_wsum_block(wp, g->nrb, BC, cf, b * g->C + j, b * g->C + j1);
        }
        u2 += (double)rmean[b] * t;
    }
    {
        float rf_all, rf_nz, cf_all, cf_nz;
        const int zr = factor_maxima(WS(u, off_rf, float), WS(u, off_row_sumsq, float),
                                     g->B * g->R, &rf_all, &rf_nz);
        const int zc = factor_maxima(cf, WS(u, off_col_sumsq, float), BC, &cf_all, &cf_nz);
        if (!am_wsum_usable(u2, rf_all, cf_all, rf_nz, cf_nz, max_of(rmean, g->B), g->numel,
                            (zr || zc) && zero_sums_hold_nonzero(u)))
            return 0;
    }
    u->h->u2_sum = u2;
    return 1;
}

/* A 2-D shard's column moments and factors over every row of the whole
 * matrix (col_sumsq reduced across the shards, dim0_total rows), and its
 * row factors from the mean of every row's moment (row_moment_sum reduced),
 * in place of moments_mats' over the shard's rows: the same formulas as
 * every kernel's (am_moment, am_rsqrt, am_row_factor), O(R + C). */
static void shard_factors(upd *u) {
    const am_geom *g = &u->g;
    const float *cs = WS(u, off_col_sumsq, float), *nr = WS(u, off_new_row, float);
    const float Rinv = am_inv_count(u->h->dim0_total);
    float *nc = WS(u, off_new_col, float), *cf = WS(u, off_cf, float);
    float *rf = WS(u, off_rf, float), *rmean = WS(u, off_rmean, float);
    int64_t i, j;
    for (j = 0; j < g->C; j++) {
        nc[j] = am_moment(u->state->col[j], cs[j], Rinv, &u->k);
        cf[j] = am_rsqrt(nc[j]);
    }
    /* The whole update adds the row moments in float32: a sum past its
     * range (an eps near FLT_MAX / rows) makes its mean inf and the update
     * skipped; so here (the double sum gave a finite mean, and the shards
     * applied what am_update skips; found by a review, thirty-seventh
     * session). Within about rows/2 ulp of FLT_MAX the two sums can round
     * to different sides: the float32 chain rounds at every add. */
    {
        const float s32 = (float)u->h->row_moment_sum;
        rmean[0] = am_isfinite_f32(s32)
                       ? (float)(u->h->row_moment_sum / (double)u->h->dim0_total)
                       : s32 * Rinv;
    }
    for (i = 0; i < g->R; i++) rf[i] = am_row_factor(nr[i], rmean[0]);
}

static am_status run_moments(upd *u) {
    const am_geom *g = &u->g;
    const am_consts *k = &u->k;
    AM_RETURN_IF(!header_matches(u, AM_STAGE_STATS), AM_ERR_INVALID_ARGUMENT,
                 "am_update_moments: workspace does not hold am_update_stats "
                 "results for this parameter (of this shape)");
    if (u->h->nonfinite) {
        /* finish then returns the skip too, not a phase-order error: a
         * sharded engine calls every phase on every shard (a shard whose
         * own gradient is finite learns of another's NaN from the reduced
         * count only here; found by a review, twenty-sixth session) */
        u->h->stage = AM_STAGE_MOMENTS;
        return AM_SKIPPED_NONFINITE_GRAD;
    }
    if (g->ndim >= 2 && g->numel > 0) {
        const float *rs = WS(u, off_row_sumsq, float), *cs = WS(u, off_col_sumsq, float);
        float *nr = WS(u, off_new_row, float), *nc = WS(u, off_new_col, float);
        float *rf = WS(u, off_rf, float), *cf = WS(u, off_cf, float);
        float *rmean = WS(u, off_rmean, float);
        if (batched(g)) {
            am_parallel_for(mat_tasks(g), (double)mats_per_task(g) * (double)(g->R * g->C) * 12.0,
                            moments_u2_mats_task, u);
        } else {
            u->kt->moments_mats(g->R, g->C, 0, g->B, u->state->row, u->state->col,
                                rs, cs, k, nr, nc, rf, cf, rmean);
            if (u->h->dim0_total && g->ndim == 2) shard_factors(u);
            if (u2_from_wsum(u)) {
                u->h->stage = AM_STAGE_MOMENTS;
                return AM_OK;
            }
            am_parallel_for(g->ntiles, (double)g->RB * (double)g->CB * 4.0, u2_task, u);
        }
        u->h->u2_sum = am_sum_tiles(WS(u, off_tile_u2, double), g->ntiles);
    }
    u->h->stage = AM_STAGE_MOMENTS;
    return AM_OK;
}

/* ----------------------------------------------------------- finish ---- */

typedef struct fin {
    upd *u;
    am_state *state;
    int counted; /* the stats pass's counts are this update's agreement */
    int copies;  /* each lr-row's finish copies its matrices' new moments */
    const float *bump; /* NULL, or the lr bump factor of each match count */
    const float *atab; /* with bump: the agreement of each match count */
    int64_t per;       /* lr-rows per finish_lr_rows_task */
} fin;

/* Short lr-rows (at most this many elements, and fewer than half as many
 * as there are lr-rows; e.g. LoRA's (1024, 16) matrices): am_bump_factor of
 * every possible match count is computed once per update instead of once
 * per lr-row (the same function of the same agreement: the same bits). */
#define AM_BUMP_TABLE_MAX 256

/* Lr-row kr's agreement (matches of its m elements) into the workspace,
 * and its lr bumped by it (SPEC 3.4; not on the first update). */
static inline __attribute__((always_inline)) void agree_and_bump(const fin *f, int64_t kr,
                                                                int64_t matches) {
    upd *u = f->u;
    const float a = (float)matches / (float)u->g.m;
    float *lr = f->state->lr + kr;
    WS(u, off_agree, float)[kr] = a;
    if (f->state->step > 0)
        *lr = f->bump ? am_lr_scale(*lr, f->bump[matches], &u->k) : am_lr_bump(*lr, a, &u->k);
}

/* Matches of lr-row kr counted by the stats pass (rows of every column
 * block; integer sums, so the order does not matter). */
static int64_t counted_matches(const upd *u, int64_t kr) {
    const am_geom *g = &u->g;
    const int32_t *rm = WS(u, off_rowmatch, int32_t);
    int64_t rows = g->m / g->C, r, cb, s = 0;
    for (cb = 0; cb < g->ncb; cb++)
        for (r = kr * rows; r < (kr + 1) * rows; r++) s += rm[cb * g->B * g->R + r];
    return s;
}

/* The smallest of v[0..n), NaN when one is NaN, for values >= +0 (factors
 * and smallest positive gradients); a negative value (-0 included) answers
 * NaN too: counts_valid then counts in a pass of its own. The same answer
 * as the unsigned minimum and maximum of the bits (every NaN's bits and a
 * negative value's are above +inf's), the integer loops this replaced: SSE2
 * has no unsigned 32-bit minimum, and their emulation was 10% of a (16,
 * 1024) or (1024, 16) update (LoRA's shapes). Here minps in two chains,
 * and the sign bits of the values and of their NaN tests or-ed together. */
static float min_or_nan(const float *v, int64_t n) {
    float m = INFINITY;
    int bad = 0;
    int64_t i = 0;
#if defined(__SSE2__)
    if (n >= 8) {
        __m128 m0 = _mm_set1_ps(INFINITY), m1 = m0, b = _mm_setzero_ps();
        float l[4];
        int k;
        for (; i + 8 <= n; i += 8) {
            const __m128 x = _mm_loadu_ps(v + i), y = _mm_loadu_ps(v + i + 4);
            m0 = _mm_min_ps(m0, x);
            m1 = _mm_min_ps(m1, y);
            b = _mm_or_ps(b, _mm_or_ps(_mm_or_ps(x, y),
                                       _mm_or_ps(_mm_cmpunord_ps(x, x), _mm_cmpunord_ps(y, y))));
        }
        bad = _mm_movemask_ps(b);
        _mm_storeu_ps(l, _mm_min_ps(m0, m1));
        for (k = 0; k < 4; k++)
            if (l[k] < m) m = l[k];
    }
#endif
    for (; i < n; i++) {
        const float x = v[i];
        if (x != x || signbit(x)) bad = 1;
        if (x < m) m = x;
    }
    return bad ? NAN : m;
}

/* The stats pass counted (g > 0) against the old bits; the SPEC's sign is
 * (u / scale > 0), u = (rf * cf) * g. For g <= 0, u is <= 0 or NaN (rf, cf
 * > 0), never positive; a NaN g skips the update. A positive g gives a
 * positive u / scale unless a product or the division underflows (or a
 * factor is 0 or NaN, from an overflowed moment). Rounded multiplication
 * and division by a positive number are monotonic, so every positive g
 * does when the bound built from the smallest positive g and the smallest
 * factors does: ((rfmin * cfmin) * gmin) / scale > 0, in the kernels' order
 * of operations. The apply multiplies by inv = 1 / scale instead of
 * dividing (am_apply_one) and writes the bits (u * inv > 0): the same bound
 * times inv must be positive too. Otherwise (rare: tiny gradients against a
 * huge scale) finish counts in a separate pass (agree_rows, the SPEC's
 * division) and the apply writes no bits. */
static int counts_valid(const upd *u) {
    const am_geom *g = &u->g;
    float gmin, fac, m;
    if (!u->h->counted) return 0;
    gmin = min_or_nan(WS(u, off_tile_minpos, float), g->ntiles);
    fac = min_or_nan(WS(u, off_rf, float), g->B * g->R) *
          min_or_nan(WS(u, off_cf, float), g->B * g->C);
    m = fac * gmin;
    return m / u->scale > 0.0f && m * u->inv > 0.0f;
}

/* Lr-row kr of finish_lr_rows_task: its agreement and lr bump where the
 * stats pass did not count them (else the task did both), its apply. */
static inline __attribute__((always_inline)) void finish_lr_row(fin *f, int64_t kr) {
    upd *u = f->u;
    const am_geom *g = &u->g;
    int64_t rows = g->m / g->C, r0 = kr * rows, matches = 0;
    const float *rf = WS(u, off_rf, float), *cf = WS(u, off_cf, float);
    uint8_t *pol = f->state->polarity + kr * g->pol_row_bytes;
    uint8_t *wbits = f->counted ? pol : NULL; /* the apply writes the new bits */
    if (!f->counted) {
        int by_sign = 0;
        if (u->mats_sweep) { /* (g > 0) against the old bits, then the bound */
            const size_t es = am_dtype_size(u->grad->dtype);
            float gmin, m;
            matches = u->kt->count_pos((const char *)u->grad->data + (size_t)(r0 * g->C) * es,
                                       u->grad->dtype, g->m, pol, &gmin);
            m = u->facmin * gmin;
            by_sign = m / u->scale > 0.0f && m * u->inv > 0.0f;
        }
        if (by_sign)
            wbits = pol; /* every u / scale (and u * inv) has the sign of g */
        else
            matches = u->kt->agree_rows(u->grad->data, u->grad->dtype, g->R, g->C,
                                        r0, r0 + rows, rf, cf, u->scale, pol);
        agree_and_bump(f, kr, matches);
    }
    u->kt->apply_rows(u->param->data, u->param->dtype, u->grad->data,
                      u->grad->dtype, g->R, g->C, r0, r0 + rows, rf, cf,
                      u->inv, f->state->lr[kr], NULL, &u->k, u->key.seed,
                      u->key.param_id, f->state->step, u->h->noise_off, wbits);
    if (f->copies) { /* whole matrices b0..b1-1 (ndim >= 3) */
        const int64_t b0 = r0 / g->R, nb = rows / g->R;
        memcpy(f->state->row + b0 * g->R, WS(u, off_new_row, float) + b0 * g->R,
               (size_t)(nb * g->R) * sizeof(float));
        memcpy(f->state->col + b0 * g->C, WS(u, off_new_col, float) + b0 * g->C,
               (size_t)(nb * g->C) * sizeof(float));
    }
}

/* Lr-rows a finish_lr_rows_task: AM_BUMP_BLOCK_ROWS, fewer where that
 * would leave fewer than four tasks a thread (which rows a thread runs
 * changes no bits). */
#define AM_BUMP_BLOCK_ROWS 8

static int64_t lr_rows_per_task(int64_t lr_rows) {
    const int64_t per = lr_rows / (4 * (int64_t)am_get_num_threads());
    return per < 1 ? 1 : per > AM_BUMP_BLOCK_ROWS ? AM_BUMP_BLOCK_ROWS : per;
}

/* Lr-rows [blk * f->per, ...) one at a time. Counted agreements are turned
 * into lrs for the whole block first: each bump is a chain of dependent
 * double operations (am_expf, about 50 ns), and the apply of its row waits
 * for it; the chains of a block overlap. One row at a time, 1024x1024
 * bfloat16 and float16 in cache 0.514 -> 0.492 and 0.586 -> 0.566 ns an
 * element, float32 0.337 -> 0.317 (Zen 4, 1 thread; docs/
 * PERFORMANCE_HISTORY.md, twenty-ninth session). The same arithmetic per
 * lr-row, so the same bits. */
static void finish_lr_rows_task(void *ctx, int64_t blk) {
    fin *f = (fin *)ctx;
    const int64_t k0 = blk * f->per,
                  k1 = k0 + f->per < f->u->g.lr_rows ? k0 + f->per : f->u->g.lr_rows;
    int64_t kr;
    if (f->counted)
        for (kr = k0; kr < k1; kr++) agree_and_bump(f, kr, counted_matches(f->u, kr));
    for (kr = k0; kr < k1; kr++) finish_lr_row(f, kr);
}

/* Many short lr-rows, each one matrix row (m == C <= AM_SHORT_ROW, e.g.
 * LoRA's (1024, 16) matrices), counted by the stats pass: a task per block
 * of AM_SHORT_BLOCK elements' lr-rows bumps each lr, then applies the whole
 * block in one apply_rows call with an lr per row (the slot's lrs), instead
 * of a task and a call per lr-row, whose fixed costs were most of the time.
 * The same per-lr-row arithmetic, so the same bits. */
#define AM_SHORT_ROW 256
#define AM_SHORT_BLOCK 4096

/* Long lr-rows of float32 matrices (C >= AM_LONG_ROW_MIN, internal.h): a
 * task and an apply_rows call per AM_LONG_BLOCK_ROWS of them, which the
 * AVX-512 apply runs together (where it gets float32: CPUs with AVX-512
 * and software prefetch off, i.e. AMD): all of them with Zen 4's tuning,
 * those longer than 4096 with Zen 5's (one_row_apply_max in
 * kernels_avx512.c, am_tuning_zen4 in simd.h); the other kernel sets run the
 * rows of a block one at a time, as before; not measured there). From memory,
 * one row at a time re-read the column factors from L2 for each row (C * 4
 * bytes, more than L1 keeps while the row streams pass): 4096x11008
 * float32 finish 15.2-15.9 -> 13.0-13.2 ms at 1 thread. Shorter rows are
 * left one at a time: four interleaved streams of a few KB each defeated
 * the hardware prefetcher (3072x768 float32 1.06-1.15 -> 1.50-1.56 ms). */
#define AM_LONG_BLOCK_ROWS 4
#define AM_LONG_BLOCK_MIN_LR_ROWS 64

static int long_row_blocks(const upd *u) {
    const am_geom *g = &u->g;
    return u->param->dtype == AM_DTYPE_FLOAT32 && g->C >= AM_LONG_ROW_MIN &&
           g->lr_rows >= AM_LONG_BLOCK_MIN_LR_ROWS;
}

static int64_t short_block_rows(const am_geom *g) {
    if (g->C > AM_SHORT_ROW) return AM_LONG_BLOCK_ROWS;
    return AM_SHORT_BLOCK / g->C;
}

static void finish_short_rows_task(void *ctx, int64_t blk) {
    fin *f = (fin *)ctx;
    upd *u = f->u;
    const am_geom *g = &u->g;
    const int64_t per = short_block_rows(g), k0 = blk * per,
                  k1 = k0 + per < g->lr_rows ? k0 + per : g->lr_rows;
    int64_t kr;
    if (f->bump && g->ncb == 1) { /* one count per lr-row, both from tables:
                                   * agree_and_bump with its tests per row
                                   * measured 3-12% slower on (1024, 16),
                                   * (1024, 8) and (1024, 4) */
        const int32_t *rm = WS(u, off_rowmatch, int32_t);
        float *agree = WS(u, off_agree, float), *lr = f->state->lr;
        for (kr = k0; kr < k1; kr++) {
            const int32_t mt = rm[kr];
            agree[kr] = f->atab[mt];
            lr[kr] = am_lr_scale(lr[kr], f->bump[mt], &u->k);
        }
    } else {
        for (kr = k0; kr < k1; kr++) agree_and_bump(f, kr, counted_matches(u, kr));
    }
    u->kt->apply_rows(u->param->data, u->param->dtype, u->grad->data, u->grad->dtype, g->R,
                      g->C, k0, k1, WS(u, off_rf, float), WS(u, off_cf, float), u->inv, 0.0f,
                      f->state->lr + k0, &u->k, u->key.seed, u->key.param_id, f->state->step,
                      u->h->noise_off,
                      f->state->polarity + k0 * g->pol_row_bytes);
}

/* Few, long lr-rows (e.g. a (1, 4096, 4096) parameter): the agreement and
 * the apply of each lr-row are split into chunks of whole matrix rows, a
 * multiple of 8 rows each so that every chunk's polarity bits start on a
 * byte. Match counts are integers (order-free) and the apply is per element,
 * so the bits are those of the unsplit path. */
#define AM_SPLIT_MAX 256            /* chunks in all: counts live on the stack */
#define AM_SPLIT_MIN_ELEMS (1 << 20) /* lr-rows shorter than this are not split */

typedef struct split {
    fin *f;
    int64_t nch, chrows, rows;
    int64_t counts[AM_SPLIT_MAX];
} split;

static void split_range(const split *sp, int64_t t, int64_t *kr, int64_t *r0,
                        int64_t *r1) {
    int64_t c = t % sp->nch, end;
    *kr = t / sp->nch;
    *r0 = *kr * sp->rows + c * sp->chrows;
    end = (*kr + 1) * sp->rows;
    *r1 = *r0 + sp->chrows < end ? *r0 + sp->chrows : end;
}

/* Polarity of chunk rows [r0, ...) of lr-row kr: on a byte (chrows % 8 == 0). */
static uint8_t *split_pol(const split *sp, int64_t kr, int64_t r0) {
    const am_geom *g = &sp->f->u->g;
    return sp->f->state->polarity + kr * g->pol_row_bytes + (r0 - kr * sp->rows) * g->C / 8;
}

static void split_agree_task(void *ctx, int64_t t) {
    split *sp = (split *)ctx;
    upd *u = sp->f->u;
    const am_geom *g = &u->g;
    int64_t kr, r0, r1;
    split_range(sp, t, &kr, &r0, &r1);
    sp->counts[t] = u->kt->agree_rows(
        u->grad->data, u->grad->dtype, g->R, g->C, r0, r1, WS(u, off_rf, float),
        WS(u, off_cf, float), u->scale, split_pol(sp, kr, r0));
}

static void split_apply_task(void *ctx, int64_t t) {
    split *sp = (split *)ctx;
    upd *u = sp->f->u;
    const am_geom *g = &u->g;
    int64_t kr, r0, r1;
    split_range(sp, t, &kr, &r0, &r1);
    u->kt->apply_rows(u->param->data, u->param->dtype, u->grad->data,
                      u->grad->dtype, g->R, g->C, r0, r1, WS(u, off_rf, float),
                      WS(u, off_cf, float), u->inv, sp->f->state->lr[kr], NULL, &u->k,
                      u->key.seed, u->key.param_id, sp->f->state->step, u->h->noise_off,
                      sp->f->counted ? split_pol(sp, kr, r0) : NULL);
}

/* Returns 1 when it did the finish of every lr-row, 0 when the lr-rows are
 * too many or too short to be worth splitting. */
static int finish_split(fin *f) {
    upd *u = f->u;
    const am_geom *g = &u->g;
    int nth = am_get_num_threads();
    int64_t rows = g->m / g->C, per, kr, t;
    split sp;
    /* (in int64_t: am_set_num_threads takes any int) */
    if (nth < 2 || g->lr_rows >= (int64_t)2 * nth || g->m < AM_SPLIT_MIN_ELEMS || rows < 16)
        return 0;
    per = AM_SPLIT_MAX / g->lr_rows; /* chunks per lr-row */
    if (per > (int64_t)4 * nth) per = (int64_t)4 * nth;
    /* More than AM_SPLIT_MAX / 2 lr-rows (possible when nth > 128): no room
     * to split each in two; per == 0 would divide by zero below. */
    if (per < 2) return 0;
    sp.f = f;
    sp.rows = rows;
    sp.chrows = (rows + per - 1) / per;
    sp.chrows = (sp.chrows + 7) / 8 * 8;
    sp.nch = (rows + sp.chrows - 1) / sp.chrows;
    if (sp.nch < 2) return 0;
    if (!f->counted)
        am_parallel_for(g->lr_rows * sp.nch, (double)sp.chrows * (double)g->C * 8.0,
                        split_agree_task, &sp);
    for (kr = 0; kr < g->lr_rows; kr++) {
        int64_t matches = 0;
        if (f->counted) matches = counted_matches(u, kr);
        else
            for (t = 0; t < sp.nch; t++) matches += sp.counts[kr * sp.nch + t];
        agree_and_bump(f, kr, matches);
    }
    am_parallel_for(g->lr_rows * sp.nch, (double)sp.chrows * (double)g->C * 12.0,
                    split_apply_task, &sp);
    return 1;
}

static void finish_flat_task(void *ctx, int64_t t) {
    fin *f = (fin *)ctx;
    upd *u = f->u;
    int64_t e0 = t * AM_FLAT_CHUNK, e1 = e0 + AM_FLAT_CHUNK;
    if (e1 > u->g.numel) e1 = u->g.numel;
    WS(u, off_tile_count, int64_t)[t] = u->kt->finish_flat(
        u->param->data, u->param->dtype, u->grad->data, u->grad->dtype,
        f->state->sq, f->state->lr, f->state->polarity, e0, e1, u->scale,
        &u->k, u->key.seed, u->key.param_id, f->state->step, u->h->noise_off);
}

/* The mean of v[0..n), n > 0, in double: four chains of adds (element t
 * in chain t % 4), combined (c0 + c1) + (c2 + c3). One chain waited on
 * each add: 9% of a (1024, 16) update. With SSE2 the chains are the lanes
 * of two vectors of doubles: the same additions. */
static double mean_of(const float *v, int64_t n) {
    double c0 = 0.0, c1 = 0.0, c2 = 0.0, c3 = 0.0;
    int64_t t = 0;
#if defined(__SSE2__)
    __m128d a = _mm_setzero_pd(), b = _mm_setzero_pd();
    double l[4];
    for (; t + 4 <= n; t += 4) {
        const __m128 x = _mm_loadu_ps(v + t);
        a = _mm_add_pd(a, _mm_cvtps_pd(x));
        b = _mm_add_pd(b, _mm_cvtps_pd(_mm_movehl_ps(x, x)));
    }
    _mm_storeu_pd(l, a);
    _mm_storeu_pd(l + 2, b);
    c0 = l[0];
    c1 = l[1];
    c2 = l[2];
    c3 = l[3];
#endif
    for (; t + 4 <= n; t += 4) {
        c0 += v[t];
        c1 += v[t + 1];
        c2 += v[t + 2];
        c3 += v[t + 3];
    }
    if (t < n) c0 += v[t++];
    if (t < n) c1 += v[t++];
    if (t < n) c2 += v[t];
    return ((c0 + c1) + (c2 + c3)) / (double)n;
}

static am_status run_finish(upd *u, am_state *state, am_report *rep) {
    const am_geom *g = &u->g;
    float bump[AM_BUMP_TABLE_MAX + 1], atab[AM_BUMP_TABLE_MAX + 1];
    fin f;
    float norm, rms;
    double mean_agree = 0.0;
    int64_t t;
    AM_RETURN_IF(!header_matches(u, AM_STAGE_MOMENTS), AM_ERR_INVALID_ARGUMENT,
                 "am_update_finish: workspace does not hold am_update_moments "
                 "results for this parameter (of this shape)");
    if (u->h->nonfinite) return AM_SKIPPED_NONFINITE_GRAD;
    /* (before the no-op of an empty shard, which reports the skip with the
     * others; u2_sum is 0 for a zero-element parameter otherwise) */
    if (!isfinite(u->h->u2_sum)) {
        if (u->mats_sweep) restore_moments(u);
        return AM_SKIPPED_NONFINITE_UPDATE;
    }
    if (g->numel == 0) return AM_OK;
    /* SPEC 3.2, in the reference's order: norm / sqrt(n) / clip, >= 1. */
    norm = (float)sqrt(u->h->u2_sum);
    /* a shard's: the whole parameter's numel (g->m elements per dims[0]) */
    rms = norm / (float)sqrt((double)(u->h->dim0_total ? u->h->dim0_total * g->m : g->numel));
    u->scale = rms / u->k.clip;
    if (!(u->scale >= 1.0f)) u->scale = 1.0f;
    u->inv = 1.0f / u->scale;
    f.u = u;
    f.state = state;
    f.counted = g->ndim >= 2 && counts_valid(u);
    f.copies = 0;
    f.bump = NULL;
    f.atab = NULL;
    f.per = 1;
    if (g->ndim >= 2 && state->step > 0 && g->m <= AM_BUMP_TABLE_MAX &&
        g->lr_rows > 2 * (g->m + 1)) {
        for (t = 0; t <= g->m; t++) {
            atab[t] = (float)t / (float)g->m; /* as agree_and_bump */
            bump[t] = am_bump_factor(atab[t], &u->k);
        }
        f.bump = bump;
        f.atab = atab;
    }
    if (g->ndim >= 2) {
        const float *agree = WS(u, off_agree, float);
        if (!finish_split(&f)) {
            /* Many small matrices: their moments are a good part of the
             * bytes, copied by the threads (ndim >= 3: lr-rows hold whole
             * matrices). */
            f.copies = batched(g) && !u->mats_sweep;
            if (f.counted && !f.copies && g->m == g->C && g->lr_rows >= 2 &&
                (g->C <= AM_SHORT_ROW || long_row_blocks(u))) {
                const int64_t per = short_block_rows(g);
                am_parallel_for((g->lr_rows + per - 1) / per, (double)(per * g->m) * 12.0,
                                finish_short_rows_task, &f);
            } else {
                f.per = lr_rows_per_task(g->lr_rows);
                am_parallel_for((g->lr_rows + f.per - 1) / f.per, (double)(f.per * g->m) * 12.0,
                                finish_lr_rows_task, &f);
            }
        }
        if (!f.copies && !u->mats_sweep) {
            memcpy(state->row, WS(u, off_new_row, float), (size_t)(g->B * g->R) * sizeof(float));
            memcpy(state->col, WS(u, off_new_col, float), (size_t)(g->B * g->C) * sizeof(float));
        }
        mean_agree = mean_of(agree, g->lr_rows);
    } else {
        const int64_t *cnt = WS(u, off_tile_count, int64_t);
        int64_t total = 0;
        am_parallel_for(g->ntiles, AM_FLAT_CHUNK * 20.0, finish_flat_task, &f);
        for (t = 0; t < g->ntiles; t++) total += cnt[t];
        mean_agree = (double)total / (double)g->numel;
    }
    state->step++;
    u->h->stage = AM_STAGE_NONE;
    if (rep) {
        rep->clip_scale = u->scale;
        rep->mean_agreement = (float)mean_agree;
    }
    return AM_OK;
}

/* ------------------------------------------------------------ API ------ */

static void report_init(am_report *rep) {
    if (!rep) return;
    memset(rep, 0, sizeof *rep);
}

static void report_end(am_report *rep, am_status s, const upd *u) {
    if (!rep) return;
    rep->status = s;
    if (u->ws && !am_status_is_error(s)) rep->nonfinite_count = u->h->nonfinite;
    if (s != AM_OK) {
        rep->clip_scale = 0.0f;
        rep->mean_agreement = 0.0f;
    }
}

static am_status update_stats_impl(const am_tensor *param, const am_tensor *grad,
                          const am_state *state, const am_hparams *hp,
                          void *workspace, size_t workspace_bytes) {
    upd u;
    memset(&u, 0, sizeof u);
    AM_CHECK(prepare(&u, param, grad, state, hp, workspace, workspace_bytes));
    return run_stats(&u);
}

static am_status update_stats_shard_impl(const am_tensor *param, const am_tensor *grad,
                                         const am_state *state, const am_hparams *hp,
                                         const am_shard *shard, void *workspace,
                                         size_t workspace_bytes) {
    upd u;
    int64_t per = 1;
    int d;
    memset(&u, 0, sizeof u);
    AM_CHECK(prepare(&u, param, grad, state, hp, workspace, workspace_bytes));
    AM_RETURN_IF(!shard, AM_ERR_NULL_POINTER, "am_update_stats_shard: shard is NULL");
    AM_RETURN_IF(param->shape.ndim == 0, AM_ERR_INVALID_ARGUMENT,
                 "am_update_stats_shard: a 0-D parameter has no dims[0] to split");
    AM_RETURN_IF(shard->dim0_total < param->shape.dims[0], AM_ERR_INVALID_ARGUMENT,
                 "am_update_stats_shard: shard.dim0_total = %lld is smaller than the "
                 "shard's dims[0] = %lld", (long long)shard->dim0_total,
                 (long long)param->shape.dims[0]);
    AM_RETURN_IF(shard->dim0_offset < 0 ||
                     shard->dim0_offset > shard->dim0_total - param->shape.dims[0],
                 AM_ERR_INVALID_ARGUMENT,
                 "am_update_stats_shard: shard.dim0_offset = %lld: the shard's %lld of "
                 "dims[0] must lie within the whole's %lld", (long long)shard->dim0_offset,
                 (long long)param->shape.dims[0], (long long)shard->dim0_total);
    for (d = 1; d < param->shape.ndim; d++) per *= param->shape.dims[d]; /* <= 2^56 */
    AM_RETURN_IF(shard->dim0_total > AM_MAX_NUMEL ||
                     (per > 0 && shard->dim0_total > AM_MAX_NUMEL / per),
                 AM_ERR_INVALID_SHAPE,
                 "am_update_stats_shard: the whole parameter (dims[0] = %lld) would hold "
                 "more than 2^56 elements", (long long)shard->dim0_total);
    u.dim0_total = shard->dim0_total;
    u.noise_off = shard->dim0_offset * per;
    return run_stats(&u);
}

static am_status update_moments_impl(const am_tensor *param, const am_tensor *grad,
                            const am_state *state, const am_hparams *hp,
                            void *workspace, size_t workspace_bytes) {
    upd u;
    memset(&u, 0, sizeof u);
    AM_CHECK(prepare(&u, param, grad, state, hp, workspace, workspace_bytes));
    return run_moments(&u);
}

static am_status update_finish_impl(const am_tensor *param, const am_tensor *grad,
                           am_state *state, const am_hparams *hp,
                           am_rng_key key, void *workspace,
                           size_t workspace_bytes, am_report *report) {
    upd u;
    am_status s;
    memset(&u, 0, sizeof u);
    report_init(report);
    s = prepare(&u, param, grad, state, hp, workspace, workspace_bytes);
    if (!am_status_is_error(s)) {
        u.key = key;
        s = run_finish(&u, state, report);
    }
    report_end(report, s, &u);
    return s;
}

static am_status update_impl(const am_tensor *param, const am_tensor *grad,
                    am_state *state, const am_hparams *hp, am_rng_key key,
                    void *workspace, size_t workspace_bytes,
                    am_report *report) {
    upd u;
    am_status s;
    memset(&u, 0, sizeof u);
    report_init(report);
    s = prepare(&u, param, grad, state, hp, workspace, workspace_bytes);
    if (s == AM_OK && u.g.numel == 0) {
        /* numel 0: nothing to do, nothing changes. */
        if (report) report->status = AM_OK;
        return AM_OK;
    }
    if (s == AM_OK && u.g.ndim >= 2 && batched(&u.g)) {
        u.wstate = state;
        s = run_stats_moments_mats(&u);
    } else {
        if (s == AM_OK) s = run_stats(&u);
        if (s == AM_OK) s = run_moments(&u);
    }
    if (s == AM_OK) {
        u.key = key;
        s = run_finish(&u, state, report);
    }
    if (!am_status_is_error(s)) u.h->stage = AM_STAGE_NONE;
    report_end(report, s, &u);
    return s;
}

/* The public entry points: the impls above in the library's floating-point
 * environment (fpenv.h), the caller's put back after. */
am_status am_update_stats(const am_tensor *param, const am_tensor *grad,
                          const am_state *state, const am_hparams *hp,
                          void *workspace, size_t workspace_bytes) {
    AM_FPENV_RETURN(update_stats_impl(param, grad, state, hp, workspace, workspace_bytes));
}

am_status am_update_stats_shard(const am_tensor *param, const am_tensor *grad,
                                const am_state *state, const am_hparams *hp,
                                const am_shard *shard, void *workspace,
                                size_t workspace_bytes) {
    AM_FPENV_RETURN(update_stats_shard_impl(param, grad, state, hp, shard, workspace,
                                            workspace_bytes));
}

am_status am_update_moments(const am_tensor *param, const am_tensor *grad,
                            const am_state *state, const am_hparams *hp,
                            void *workspace, size_t workspace_bytes) {
    AM_FPENV_RETURN(update_moments_impl(param, grad, state, hp, workspace, workspace_bytes));
}

am_status am_update_finish(const am_tensor *param, const am_tensor *grad,
                           am_state *state, const am_hparams *hp,
                           am_rng_key key, void *workspace,
                           size_t workspace_bytes, am_report *report) {
    AM_FPENV_RETURN(update_finish_impl(param, grad, state, hp, key, workspace,
                                       workspace_bytes, report));
}

am_status am_update(const am_tensor *param, const am_tensor *grad,
                    am_state *state, const am_hparams *hp, am_rng_key key,
                    void *workspace, size_t workspace_bytes,
                    am_report *report) {
    AM_FPENV_RETURN(update_impl(param, grad, state, hp, key, workspace, workspace_bytes,
                                report));
}
