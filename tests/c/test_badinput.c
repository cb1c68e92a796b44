/* test_badinput.c — the bad-input matrix of the kernel layer: every public
 * function that takes caller buffers, against every kind of bad argument
 * (NULL pointers, zero/huge sizes, negative/overflowing/mismatched shapes,
 * invalid dtypes, non-finite or out-of-range hyperparameters, negative or
 * exhausted step counters), on a factored (2-D) and an unfactored (1-D)
 * parameter. Each row gives the documented status, and every byte the
 * caller owns is as before (the update family may write its workspace and
 * report, as documented; nothing else). The optimizer object's matrix is in
 * test_badinput_optimizer.c. */
#include <automagic.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* Everything the caller owns, in one block, so one memcmp covers it. */
typedef struct owned {
    float param[35], grad[35];
    float lr[35], row[8], col[8], sq[35];
    uint8_t pol[40];
    am_tensor p, g;
    am_state st;
    am_hparams hp;
    am_shape shape;
    am_state_sizes sizes;
    am_workspace_view view;
    double initial_lr;
    int threads;
} owned;

/* Workspace and report: the update family may write these. */
typedef struct scratch {
    _Alignas(64) unsigned char ws[16384];
    size_t ws_bytes;
    void *wsp;
    am_report rep;
} scratch;

/* Which pointer arguments are passed as NULL, and the scalar arguments. */
typedef struct args {
    int null_param, null_grad, null_state, null_hp, null_shape, null_out;
    int null_report;
} args;

enum fn {
    F_UPDATE, F_STATS, F_MOMENTS, F_FINISH, /* the update family */
    F_VALIDATE, F_SIZES, F_INIT, F_VIEW, F_THREADS, F_COUNT
};
static const char *const k_fn[F_COUNT] = {
    "am_update", "am_update_stats", "am_update_moments", "am_update_finish",
    "am_hparams_validate", "am_state_get_sizes", "am_state_init",
    "am_workspace_view_get", "am_set_num_threads"};

enum mut {
    M_NONE,
    M_NULL_PARAM, M_NULL_GRAD, M_NULL_STATE, M_NULL_HP, M_NULL_WS, M_NULL_SHAPE,
    M_NULL_OUT, M_NULL_PARAM_DATA, M_NULL_GRAD_DATA, M_NULL_LR, M_NULL_POL,
    M_NULL_ROW, M_NULL_COL, M_NULL_SQ, M_NULL_REPORT,
    M_PARAM_DTYPE_3, M_PARAM_DTYPE_NEG, M_GRAD_DTYPE_99,
    M_NDIM_NEG, M_NDIM_9, M_NDIM_INTMAX, M_DIM_NEG, M_DIM_INT64MIN, M_DIM_OVERFLOW,
    M_GRAD_DIM_DIFF, M_GRAD_NDIM_DIFF, M_GRAD_DIM_NEG,
    M_HP_LR_0, M_HP_LR_NEG, M_HP_LR_NAN, M_HP_LR_INF, M_HP_MINLR_NEG,
    M_HP_MINLR_GT_MAX, M_HP_MINLR_NAN, M_HP_MAXLR_NAN, M_HP_MAXLR_INF,
    M_HP_BUMP_NEG, M_HP_BUMP_NAN, M_HP_BUMP_INF, M_HP_BETA2_1, M_HP_BETA2_NEG,
    M_HP_BETA2_NAN, M_HP_EPS_NEG, M_HP_EPS_NAN, M_HP_EPS_INF, M_HP_CLIP_0,
    M_HP_CLIP_NEG, M_HP_CLIP_NAN, M_HP_WD_NEG, M_HP_WD_NAN, M_HP_WD_INF,
    M_WS_0, M_WS_SHORT, M_STEP_NEG, M_STEP_MIN, M_STEP_MAX,
    M_ILR_0, M_ILR_NEG, M_ILR_NAN, M_ILR_INF, M_ILR_UNDERFLOW,
    M_THREADS_NEG, M_THREADS_MIN, M_NO_PREVIOUS_PHASE,
    M_COUNT
};

/* Mutation names for messages (same order as enum mut). */
static const char *const k_mut[M_COUNT] = {
    "none", "null_param", "null_grad", "null_state", "null_hp", "null_ws", "null_shape",
    "null_out", "null_param_data", "null_grad_data", "null_lr", "null_pol", "null_row",
    "null_col", "null_sq", "null_report", "param_dtype_3", "param_dtype_neg",
    "grad_dtype_99", "ndim_neg", "ndim_9", "ndim_intmax", "dim_neg", "dim_int64min",
    "dim_overflow", "grad_dim_diff", "grad_ndim_diff", "grad_dim_neg", "hp_lr_0",
    "hp_lr_neg", "hp_lr_nan", "hp_lr_inf", "hp_minlr_neg", "hp_minlr_gt_max",
    "hp_minlr_nan", "hp_maxlr_nan", "hp_maxlr_inf", "hp_bump_neg", "hp_bump_nan",
    "hp_bump_inf", "hp_beta2_1", "hp_beta2_neg", "hp_beta2_nan", "hp_eps_neg",
    "hp_eps_nan", "hp_eps_inf", "hp_clip_0", "hp_clip_neg", "hp_clip_nan", "hp_wd_neg",
    "hp_wd_nan", "hp_wd_inf", "ws_0", "ws_short", "step_neg", "step_min", "step_max",
    "ilr_0", "ilr_neg", "ilr_nan", "ilr_inf", "ilr_underflow", "threads_neg",
    "threads_min", "no_previous_phase",
};

typedef struct world {
    owned o;
    scratch s;
    args a;
    int ndim;
} world;

static void world_init(world *w, int ndim) {
    int i;
    memset(w, 0, sizeof *w);
    w->ndim = ndim;
    for (i = 0; i < 35; i++) {
        w->o.param[i] = (float)(i % 9) * 0.25f - 1.0f;
        w->o.grad[i] = (float)(i % 5) * 0.5f - 1.0f;
    }
    w->o.shape.ndim = ndim;
    if (ndim == 2) {
        w->o.shape.dims[0] = 5;
        w->o.shape.dims[1] = 7;
    } else {
        w->o.shape.dims[0] = 35;
    }
    w->o.p.data = w->o.param;
    w->o.p.dtype = AM_DTYPE_FLOAT32;
    w->o.p.shape = w->o.shape;
    w->o.g = w->o.p;
    w->o.g.data = w->o.grad;
    w->o.st.lr = w->o.lr;
    w->o.st.polarity = w->o.pol;
    w->o.st.row = ndim == 2 ? w->o.row : NULL;
    w->o.st.col = ndim == 2 ? w->o.col : NULL;
    w->o.st.sq = ndim == 2 ? NULL : w->o.sq;
    w->o.hp = am_hparams_default();
    w->o.initial_lr = 1e-3;
    assert_int_equal(am_state_init(&w->o.shape, &w->o.st, 1e-3), AM_OK);
    /* a state that has seen updates: nonzero moments, polarity, step */
    w->s.wsp = w->s.ws;
    w->s.ws_bytes = sizeof w->s.ws;
    for (i = 0; i < 3; i++)
        assert_int_equal(am_update(&w->o.p, &w->o.g, &w->o.st, &w->o.hp,
                                   (am_rng_key){1, 0}, w->s.ws, w->s.ws_bytes, NULL),
                         AM_OK);
    assert_int_equal(am_state_get_sizes(&w->o.shape, &w->o.sizes), AM_OK);
    assert_true(w->o.sizes.workspace_bytes <= (int64_t)sizeof w->s.ws);
    w->o.threads = am_get_num_threads();
}

/* Applies mutation m; returns 0 when m does not apply to this world. */
static int mutate(world *w, int m) {
    owned *o = &w->o;
    am_hparams *hp = &o->hp;
    switch (m) {
    case M_NONE: return 1;
    case M_NULL_PARAM: w->a.null_param = 1; return 1;
    case M_NULL_GRAD: w->a.null_grad = 1; return 1;
    case M_NULL_STATE: w->a.null_state = 1; return 1;
    case M_NULL_HP: w->a.null_hp = 1; return 1;
    case M_NULL_WS: w->s.wsp = NULL; return 1;
    case M_NULL_SHAPE: w->a.null_shape = 1; return 1;
    case M_NULL_OUT: w->a.null_out = 1; return 1;
    case M_NULL_REPORT: w->a.null_report = 1; return 1;
    case M_NULL_PARAM_DATA: o->p.data = NULL; return 1;
    case M_NULL_GRAD_DATA: o->g.data = NULL; return 1;
    case M_NULL_LR: o->st.lr = NULL; return 1;
    case M_NULL_POL: o->st.polarity = NULL; return 1;
    case M_NULL_ROW: o->st.row = NULL; return w->ndim == 2;
    case M_NULL_COL: o->st.col = NULL; return w->ndim == 2;
    case M_NULL_SQ: o->st.sq = NULL; return w->ndim == 1;
    case M_PARAM_DTYPE_3: o->p.dtype = (am_dtype)3; return 1;
    case M_PARAM_DTYPE_NEG: o->p.dtype = (am_dtype)-1; return 1;
    case M_GRAD_DTYPE_99: o->g.dtype = (am_dtype)99; return 1;
    case M_NDIM_NEG: o->shape.ndim = o->p.shape.ndim = o->g.shape.ndim = -1; return 1;
    case M_NDIM_9: o->shape.ndim = o->p.shape.ndim = o->g.shape.ndim = 9; return 1;
    case M_NDIM_INTMAX:
        o->shape.ndim = o->p.shape.ndim = o->g.shape.ndim = INT32_MAX;
        return 1;
    case M_DIM_NEG: o->shape.dims[0] = o->p.shape.dims[0] = o->g.shape.dims[0] = -5; return 1;
    case M_DIM_INT64MIN:
        o->shape.dims[0] = o->p.shape.dims[0] = o->g.shape.dims[0] = INT64_MIN;
        return 1;
    case M_DIM_OVERFLOW: /* 2^40 * 7 * ... or 2^62 alone: numel * 16 overflows */
        o->shape.dims[0] = o->p.shape.dims[0] = o->g.shape.dims[0] =
            w->ndim == 2 ? ((int64_t)1 << 60) : INT64_MAX;
        return 1;
    case M_GRAD_DIM_DIFF: o->g.shape.dims[w->ndim - 1] += 1; return 1;
    case M_GRAD_NDIM_DIFF:
        o->g.shape.ndim = w->ndim == 2 ? 1 : 2;
        o->g.shape.dims[0] = w->ndim == 2 ? 35 : 5;
        o->g.shape.dims[1] = 7;
        return 1;
    case M_GRAD_DIM_NEG: o->g.shape.dims[0] = -o->g.shape.dims[0]; return 1;
    case M_HP_LR_0: hp->lr = 0; return 1;
    case M_HP_LR_NEG: hp->lr = -1e-3; return 1;
    case M_HP_LR_NAN: hp->lr = NAN; return 1;
    case M_HP_LR_INF: hp->lr = INFINITY; return 1;
    case M_HP_MINLR_NEG: hp->min_lr = -1e-8; return 1;
    case M_HP_MINLR_GT_MAX: hp->min_lr = 0.5; hp->max_lr = 0.1; return 1;
    case M_HP_MINLR_NAN: hp->min_lr = NAN; return 1;
    case M_HP_MAXLR_NAN: hp->max_lr = NAN; return 1;
    case M_HP_MAXLR_INF: hp->max_lr = INFINITY; return 1;
    case M_HP_BUMP_NEG: hp->lr_bump_rate = -0.1; return 1;
    case M_HP_BUMP_NAN: hp->lr_bump_rate = NAN; return 1;
    case M_HP_BUMP_INF: hp->lr_bump_rate = INFINITY; return 1;
    case M_HP_BETA2_1: hp->beta2 = 1.0; return 1;
    case M_HP_BETA2_NEG: hp->beta2 = -0.5; return 1;
    case M_HP_BETA2_NAN: hp->beta2 = NAN; return 1;
    case M_HP_EPS_NEG: hp->eps = -1e-30; return 1;
    case M_HP_EPS_NAN: hp->eps = NAN; return 1;
    case M_HP_EPS_INF: hp->eps = INFINITY; return 1;
    case M_HP_CLIP_0: hp->clip_threshold = 0; return 1;
    case M_HP_CLIP_NEG: hp->clip_threshold = -1; return 1;
    case M_HP_CLIP_NAN: hp->clip_threshold = NAN; return 1;
    case M_HP_WD_NEG: hp->weight_decay = -0.1; return 1;
    case M_HP_WD_NAN: hp->weight_decay = NAN; return 1;
    case M_HP_WD_INF: hp->weight_decay = INFINITY; return 1;
    case M_WS_0: w->s.ws_bytes = 0; return 1;
    case M_WS_SHORT: w->s.ws_bytes = (size_t)o->sizes.workspace_bytes - 1; return 1;
    case M_STEP_NEG: o->st.step = -1; return 1;
    case M_STEP_MIN: o->st.step = INT64_MIN; return 1;
    case M_STEP_MAX: o->st.step = INT64_MAX; return 1; /* cannot be incremented */
    case M_ILR_0: o->initial_lr = 0; return 1;
    case M_ILR_NEG: o->initial_lr = -1e-3; return 1;
    case M_ILR_NAN: o->initial_lr = NAN; return 1;
    case M_ILR_INF: o->initial_lr = INFINITY; return 1;
    case M_ILR_UNDERFLOW: o->initial_lr = 1e-60; return 1; /* 0 as float32 */
    case M_THREADS_NEG: o->threads = -1; return 1;
    case M_THREADS_MIN: o->threads = INT32_MIN; return 1;
    case M_NO_PREVIOUS_PHASE: return 1; /* handled by call() */
    }
    return 0;
}

static am_status call(world *w, int f, int m) {
    owned *o = &w->o;
    args *a = &w->a;
    const am_tensor *p = a->null_param ? NULL : &o->p, *g = a->null_grad ? NULL : &o->g;
    am_state *st = a->null_state ? NULL : &o->st;
    const am_hparams *hp = a->null_hp ? NULL : &o->hp;
    const am_shape *sh = a->null_shape ? NULL : &o->shape;
    am_report *rep = a->null_report ? NULL : &w->s.rep;
    am_rng_key key = {7, 3};
    switch (f) {
    case F_UPDATE: return am_update(p, g, st, hp, key, w->s.wsp, w->s.ws_bytes, rep);
    case F_STATS: return am_update_stats(p, g, st, hp, w->s.wsp, w->s.ws_bytes);
    case F_MOMENTS: return am_update_moments(p, g, st, hp, w->s.wsp, w->s.ws_bytes);
    case F_FINISH:
        return am_update_finish(p, g, st, hp, key, w->s.wsp, w->s.ws_bytes, rep);
    case F_VALIDATE: return am_hparams_validate(hp);
    case F_SIZES: return am_state_get_sizes(sh, a->null_out ? NULL : &o->sizes);
    case F_INIT: return am_state_init(sh, st, o->initial_lr);
    case F_VIEW:
        return am_workspace_view_get(sh, w->s.wsp, w->s.ws_bytes,
                                     a->null_out ? NULL : &o->view);
    case F_THREADS: return am_set_num_threads(o->threads);
    }
    (void)m;
    return AM_OK;
}

/* Runs the phases before f on the unmutated world, so that f itself is
 * what sees the bad argument. */
static void run_previous_phases(world *w, int f) {
    if (f == F_MOMENTS || f == F_FINISH)
        assert_int_equal(am_update_stats(&w->o.p, &w->o.g, &w->o.st, &w->o.hp, w->s.ws,
                                         w->s.ws_bytes), AM_OK);
    if (f == F_FINISH)
        assert_int_equal(am_update_moments(&w->o.p, &w->o.g, &w->o.st, &w->o.hp, w->s.ws,
                                           w->s.ws_bytes), AM_OK);
}

typedef struct mrow {
    int m;
    am_status want;
} mrow;

#define NUL AM_ERR_NULL_POINTER
#define DTY AM_ERR_INVALID_DTYPE
#define SHP AM_ERR_INVALID_SHAPE
#define HPR AM_ERR_INVALID_HPARAM
#define BUF AM_ERR_BUFFER_SIZE
#define ARG AM_ERR_INVALID_ARGUMENT

/* The update family: the same table for all four entry points. */
static const mrow k_update_rows[] = {
    {M_NONE, AM_OK}, {M_NULL_REPORT, AM_OK},
    {M_NULL_PARAM, NUL}, {M_NULL_GRAD, NUL}, {M_NULL_STATE, NUL}, {M_NULL_HP, NUL},
    {M_NULL_WS, NUL}, {M_NULL_PARAM_DATA, NUL}, {M_NULL_GRAD_DATA, NUL},
    {M_NULL_LR, NUL}, {M_NULL_POL, NUL}, {M_NULL_ROW, NUL}, {M_NULL_COL, NUL},
    {M_NULL_SQ, NUL},
    {M_PARAM_DTYPE_3, DTY}, {M_PARAM_DTYPE_NEG, DTY}, {M_GRAD_DTYPE_99, DTY},
    {M_NDIM_NEG, SHP}, {M_NDIM_9, SHP}, {M_NDIM_INTMAX, SHP}, {M_DIM_NEG, SHP},
    {M_DIM_INT64MIN, SHP}, {M_DIM_OVERFLOW, SHP}, {M_GRAD_DIM_DIFF, SHP},
    {M_GRAD_NDIM_DIFF, SHP}, {M_GRAD_DIM_NEG, SHP},
    {M_HP_LR_0, HPR}, {M_HP_LR_NEG, HPR}, {M_HP_LR_NAN, HPR}, {M_HP_LR_INF, HPR},
    {M_HP_MINLR_NEG, HPR}, {M_HP_MINLR_GT_MAX, HPR}, {M_HP_MINLR_NAN, HPR},
    {M_HP_MAXLR_NAN, HPR}, {M_HP_MAXLR_INF, HPR}, {M_HP_BUMP_NEG, HPR},
    {M_HP_BUMP_NAN, HPR}, {M_HP_BUMP_INF, HPR}, {M_HP_BETA2_1, HPR},
    {M_HP_BETA2_NEG, HPR}, {M_HP_BETA2_NAN, HPR}, {M_HP_EPS_NEG, HPR},
    {M_HP_EPS_NAN, HPR}, {M_HP_EPS_INF, HPR}, {M_HP_CLIP_0, HPR}, {M_HP_CLIP_NEG, HPR},
    {M_HP_CLIP_NAN, HPR}, {M_HP_WD_NEG, HPR}, {M_HP_WD_NAN, HPR}, {M_HP_WD_INF, HPR},
    {M_WS_0, BUF}, {M_WS_SHORT, BUF},
    {M_STEP_NEG, ARG}, {M_STEP_MIN, ARG}, {M_STEP_MAX, ARG},
};

/* The other kernel-layer functions: (function, mutation, status). */
typedef struct frow {
    int f, m;
    am_status want;
} frow;

static const frow k_other_rows[] = {
    {F_VALIDATE, M_NONE, AM_OK}, {F_VALIDATE, M_NULL_HP, NUL},
    {F_VALIDATE, M_HP_LR_0, HPR}, {F_VALIDATE, M_HP_LR_NEG, HPR},
    {F_VALIDATE, M_HP_LR_NAN, HPR}, {F_VALIDATE, M_HP_LR_INF, HPR},
    {F_VALIDATE, M_HP_MINLR_NEG, HPR}, {F_VALIDATE, M_HP_MINLR_GT_MAX, HPR},
    {F_VALIDATE, M_HP_MINLR_NAN, HPR}, {F_VALIDATE, M_HP_MAXLR_NAN, HPR},
    {F_VALIDATE, M_HP_MAXLR_INF, HPR}, {F_VALIDATE, M_HP_BUMP_NEG, HPR},
    {F_VALIDATE, M_HP_BUMP_NAN, HPR}, {F_VALIDATE, M_HP_BUMP_INF, HPR},
    {F_VALIDATE, M_HP_BETA2_1, HPR}, {F_VALIDATE, M_HP_BETA2_NEG, HPR},
    {F_VALIDATE, M_HP_BETA2_NAN, HPR}, {F_VALIDATE, M_HP_EPS_NEG, HPR},
    {F_VALIDATE, M_HP_EPS_NAN, HPR}, {F_VALIDATE, M_HP_EPS_INF, HPR},
    {F_VALIDATE, M_HP_CLIP_0, HPR}, {F_VALIDATE, M_HP_CLIP_NEG, HPR},
    {F_VALIDATE, M_HP_CLIP_NAN, HPR}, {F_VALIDATE, M_HP_WD_NEG, HPR},
    {F_VALIDATE, M_HP_WD_NAN, HPR}, {F_VALIDATE, M_HP_WD_INF, HPR},
    {F_SIZES, M_NONE, AM_OK}, {F_SIZES, M_NULL_SHAPE, NUL}, {F_SIZES, M_NULL_OUT, NUL},
    {F_SIZES, M_NDIM_NEG, SHP}, {F_SIZES, M_NDIM_9, SHP}, {F_SIZES, M_NDIM_INTMAX, SHP},
    {F_SIZES, M_DIM_NEG, SHP}, {F_SIZES, M_DIM_INT64MIN, SHP},
    {F_SIZES, M_DIM_OVERFLOW, SHP},
    {F_INIT, M_NULL_SHAPE, NUL}, {F_INIT, M_NULL_STATE, NUL}, {F_INIT, M_NULL_LR, NUL},
    {F_INIT, M_NULL_POL, NUL}, {F_INIT, M_NULL_ROW, NUL}, {F_INIT, M_NULL_COL, NUL},
    {F_INIT, M_NULL_SQ, NUL}, {F_INIT, M_NDIM_NEG, SHP}, {F_INIT, M_NDIM_9, SHP},
    {F_INIT, M_DIM_NEG, SHP}, {F_INIT, M_DIM_OVERFLOW, SHP}, {F_INIT, M_ILR_0, HPR},
    {F_INIT, M_ILR_NEG, HPR}, {F_INIT, M_ILR_NAN, HPR}, {F_INIT, M_ILR_INF, HPR},
    {F_INIT, M_ILR_UNDERFLOW, HPR},
    {F_VIEW, M_NONE, AM_OK}, {F_VIEW, M_NULL_SHAPE, NUL}, {F_VIEW, M_NULL_WS, NUL},
    {F_VIEW, M_NULL_OUT, NUL}, {F_VIEW, M_WS_0, BUF}, {F_VIEW, M_WS_SHORT, BUF},
    {F_VIEW, M_NDIM_NEG, SHP}, {F_VIEW, M_NDIM_9, SHP}, {F_VIEW, M_DIM_NEG, SHP},
    {F_VIEW, M_DIM_OVERFLOW, SHP},
    {F_THREADS, M_THREADS_NEG, ARG}, {F_THREADS, M_THREADS_MIN, ARG},
    /* phases out of order: a fresh workspace holds no earlier results */
    {F_MOMENTS, M_NO_PREVIOUS_PHASE, ARG}, {F_FINISH, M_NO_PREVIOUS_PHASE, ARG},
};

/* One row: fresh world, mutation, call, status and bytes. */
static int run_row(int ndim, int f, int m, am_status want) {
    static world w;
    static owned before;
    am_status got;
    int update_family = f <= F_FINISH, threads_before;
    world_init(&w, ndim);
    threads_before = am_get_num_threads();
    if (m == M_NO_PREVIOUS_PHASE)
        memset(w.s.ws, 0, sizeof w.s.ws);
    else
        run_previous_phases(&w, f);
    if (!mutate(&w, m)) return 0;
    memcpy(&before, &w.o, sizeof before);
    {
        static scratch sbefore;
        memcpy(&sbefore, &w.s, sizeof sbefore);
        got = call(&w, f, m);
        if (!update_family || am_status_is_error(got)) {
            /* workspace: only the update family may write it */
            if (!update_family && memcmp(&sbefore, &w.s, sizeof sbefore) != 0)
                fail_msg("%s, %s, ndim %d: workspace modified", k_fn[f], k_mut[m], ndim);
        }
    }
    if (got != want)
        fail_msg("%s, %s, ndim %d: status %d (%s), expected %d (%s)", k_fn[f], k_mut[m],
                 ndim, (int)got, am_status_string(got), (int)want, am_status_string(want));
    if (got == AM_OK && (f == F_UPDATE || f == F_FINISH)) {
        /* a successful update moves the parameter and the step */
        if (w.o.st.step != before.st.step + 1)
            fail_msg("%s, %s: step not incremented", k_fn[f], k_mut[m]);
        return 1;
    }
    if (f == F_SIZES || f == F_VIEW) {
        if (got == AM_OK) return 1; /* filled its output, as it should */
    }
    if (got == AM_OK && f == F_VALIDATE) return 1;
    if (memcmp(&before, &w.o, sizeof before) != 0)
        fail_msg("%s, %s, ndim %d: caller memory modified (status %d)", k_fn[f], k_mut[m],
                 ndim, (int)got);
    if (f == F_THREADS && am_get_num_threads() != threads_before)
        fail_msg("am_set_num_threads changed the thread count on error");
    return 1;
}

static void test_update_family_matrix(void **unused) {
    int f, ndim, n = 0;
    size_t r;
    (void)unused;
    for (ndim = 1; ndim <= 2; ndim++)
        for (f = F_UPDATE; f <= F_FINISH; f++)
            for (r = 0; r < sizeof k_update_rows / sizeof *k_update_rows; r++)
                n += run_row(ndim, f, k_update_rows[r].m, k_update_rows[r].want);
    print_message("update family: %d (function, bad argument, shape) cases\n", n);
    assert_true(n > 400);
}

static void test_other_functions_matrix(void **unused) {
    int ndim, n = 0;
    size_t r;
    (void)unused;
    for (ndim = 1; ndim <= 2; ndim++)
        for (r = 0; r < sizeof k_other_rows / sizeof *k_other_rows; r++)
            n += run_row(ndim, k_other_rows[r].f, k_other_rows[r].m, k_other_rows[r].want);
    print_message("other kernel-layer functions: %d cases\n", n);
    assert_true(n > 100);
}

/* Zero sizes are valid and change nothing: numel 0 in any position, data
 * NULL, every phase in order, through the optimizer as well. */
static void test_zero_sizes(void **unused) {
    static const int64_t dims[4][3] = {{0}, {0, 7}, {5, 0}, {2, 0, 3}};
    static const int32_t nd[4] = {1, 2, 2, 3};
    int k;
    (void)unused;
    for (k = 0; k < 4; k++) {
        am_tensor p, g;
        am_state st;
        am_state_sizes z;
        am_hparams hp = am_hparams_default();
        am_rng_key key = {1, 1};
        float lr[8], row[8], col[8];
        uint8_t pol[8];
        _Alignas(64) unsigned char ws[4096];
        am_optimizer *o;
        int32_t id;
        memset(&p, 0, sizeof p);
        p.dtype = AM_DTYPE_BFLOAT16;
        p.shape.ndim = nd[k];
        memcpy(p.shape.dims, dims[k], sizeof dims[k]);
        g = p;
        assert_int_equal(am_state_get_sizes(&p.shape, &z), AM_OK);
        assert_int_equal(z.numel, 0);
        assert_true(z.workspace_bytes <= (int64_t)sizeof ws);
        memset(&st, 0, sizeof st);
        st.lr = lr;
        st.polarity = pol;
        st.row = row;
        st.col = col;
        st.sq = NULL;
        if (nd[k] < 2) {
            st.row = st.col = NULL;
            st.sq = row;
        }
        assert_int_equal(am_state_init(&p.shape, &st, 1e-4), AM_OK);
        assert_int_equal(am_update(&p, &g, &st, &hp, key, ws, sizeof ws, NULL), AM_OK);
        assert_int_equal(am_update_stats(&p, &g, &st, &hp, ws, sizeof ws), AM_OK);
        assert_int_equal(am_update_moments(&p, &g, &st, &hp, ws, sizeof ws), AM_OK);
        assert_int_equal(am_update_finish(&p, &g, &st, &hp, key, ws, sizeof ws, NULL), AM_OK);
        assert_int_equal(st.step, 0);
        assert_int_equal(am_optimizer_create(&hp, 1, &o), AM_OK);
        assert_int_equal(am_optimizer_add_param(o, NULL, AM_DTYPE_FLOAT32, nd[k], dims[k], &id),
                         AM_OK);
        assert_int_equal(am_optimizer_update_param(o, id, NULL, AM_DTYPE_FLOAT32, NULL), AM_OK);
        am_optimizer_destroy(o);
    }
}

/* Functions that return values, not statuses: defined answers for bad
 * input. */
static void test_value_functions(void **unused) {
    (void)unused;
    assert_string_equal(am_status_string((am_status)12345), "unknown status");
    assert_string_equal(am_status_string((am_status)-12345), "unknown status");
    assert_true(am_status_is_error((am_status)-100));
    assert_false(am_status_is_error((am_status)100));
    assert_int_equal(am_dtype_size((am_dtype)3), 0);
    assert_int_equal(am_dtype_size((am_dtype)-1), 0);
    assert_string_equal(am_dtype_name((am_dtype)3), "invalid");
    assert_string_equal(am_dtype_name((am_dtype)-7), "invalid");
    assert_int_equal(am_set_log_callback(NULL, NULL), AM_OK);
    assert_non_null(am_kernel_name());
    assert_non_null(am_version_string());
    assert_int_equal(am_set_num_threads(1), AM_OK);
    assert_int_equal(am_get_num_threads(), 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_update_family_matrix),
        cmocka_unit_test(test_other_functions_matrix),
        cmocka_unit_test(test_zero_sizes),
        cmocka_unit_test(test_value_functions),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
