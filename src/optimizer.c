/* optimizer.c — the optimizer object for C programs: owns every registered
 * parameter's state and one shared workspace per parameter. */
#include "optimizer_internal.h"

#include "fpenv.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void am_force_start_lr(am_hparams *hp) {
    if (hp->lr > 1e-3) {
        am_log(AM_LOG_WARNING, "initial lr %g is very high; forcing to 1e-6 (as the reference)",
               hp->lr);
        hp->lr = 1e-6;
    }
}

am_status am_optimizer_create(const am_hparams *hp, uint64_t seed,
                              am_optimizer **out) {
    am_optimizer *o;
    AM_RETURN_IF(!out, AM_ERR_NULL_POINTER, "am_optimizer_create: out is NULL");
    AM_CHECK(am_hparams_validate(hp));
    o = (am_optimizer *)calloc(1, sizeof *o);
    AM_RETURN_IF(!o, AM_ERR_OUT_OF_MEMORY, "am_optimizer_create: out of memory");
    o->hp = *hp;
    am_force_start_lr(&o->hp);
    o->seed = seed;
    *out = o;
    return AM_OK;
}

void am_optimizer_destroy(am_optimizer *o) {
    int32_t i;
    if (!o) return;
    for (i = 0; i < o->count; i++) {
        free(o->params[i].state_mem);
        free(o->params[i].ws);
    }
    free(o->params);
    free(o);
}

static size_t al64(int64_t bytes) { return ((size_t)bytes + 63u) & ~(size_t)63u; }

am_status am_optimizer_add_param(am_optimizer *o, void *data, am_dtype dtype,
                                 int32_t ndim, const int64_t *shape,
                                 int32_t *out_id) {
    am_param_slot s;
    am_geom g;
    size_t off_pol, off_row, off_col, off_sq, total;
    unsigned char *mem;
    int32_t d;
    AM_RETURN_IF(!o, AM_ERR_NULL_POINTER, "am_optimizer_add_param: opt is NULL");
    AM_RETURN_IF(!out_id, AM_ERR_NULL_POINTER, "am_optimizer_add_param: out_id is NULL");
    AM_RETURN_IF(ndim > 0 && !shape, AM_ERR_NULL_POINTER,
                 "am_optimizer_add_param: shape is NULL with ndim = %d", (int)ndim);
    AM_RETURN_IF(am_dtype_size(dtype) == 0, AM_ERR_INVALID_DTYPE,
                 "am_optimizer_add_param: dtype %d is not float32, bfloat16 or float16",
                 (int)dtype);
    memset(&s, 0, sizeof s);
    AM_RETURN_IF(ndim < 0 || ndim > AM_MAX_DIMS, AM_ERR_INVALID_SHAPE,
                 "am_optimizer_add_param: ndim = %d, must be in [0, %d]",
                 (int)ndim, AM_MAX_DIMS);
    s.t.shape.ndim = ndim;
    for (d = 0; d < ndim; d++) s.t.shape.dims[d] = shape[d];
    AM_CHECK(am_geom_init(&s.t.shape, &g));
    /* (a size above 2^53, possible only with zero elements, was saved but
     * its checkpoint refused by the load: JSON numbers are doubles; found
     * by a review, thirty-second session) */
    for (d = 0; d < ndim; d++)
        AM_RETURN_IF(shape[d] > ((int64_t)1 << 53), AM_ERR_INVALID_SHAPE,
                     "am_optimizer_add_param: shape[%d] = %lld is above 2^53, the largest "
                     "size a checkpoint's header holds exactly",
                     (int)d, (long long)shape[d]);
    AM_RETURN_IF(g.numel > 0 && !data, AM_ERR_NULL_POINTER,
                 "am_optimizer_add_param: data is NULL");
    AM_CHECK(am_check_aligned(data, am_dtype_size(dtype), "am_optimizer_add_param: data"));
    AM_RETURN_IF(o->count == INT32_MAX, AM_ERR_INVALID_ARGUMENT,
                 "am_optimizer_add_param: too many parameters");
    s.t.data = data;
    s.t.dtype = dtype;
    off_pol = al64(g.sizes.lr_count * 4);
    off_row = off_pol + al64(g.sizes.polarity_bytes);
    off_col = off_row + al64(g.sizes.row_count * 4);
    off_sq = off_col + al64(g.sizes.col_count * 4);
    total = off_sq + al64(g.sizes.sq_count * 4);
    if (o->count == o->cap) {
        int32_t ncap = o->cap ? (o->cap > INT32_MAX / 2 ? INT32_MAX : o->cap * 2) : 16;
        am_param_slot *np = (am_param_slot *)realloc(o->params, (size_t)ncap * sizeof *np);
        AM_RETURN_IF(!np, AM_ERR_OUT_OF_MEMORY, "am_optimizer_add_param: out of memory");
        o->params = np;
        o->cap = ncap;
    }
    mem = (unsigned char *)calloc(1, total ? total : 1);
    s.ws_bytes = (size_t)g.sizes.workspace_bytes;
    s.ws = malloc(s.ws_bytes);
    if (!mem || !s.ws) {
        free(mem);
        free(s.ws);
        AM_RETURN_IF(1, AM_ERR_OUT_OF_MEMORY,
                     "am_optimizer_add_param: out of memory for the state of %lld "
                     "elements (%zu bytes: lrs, polarity, moments; %zu of workspace)",
                     (long long)g.numel, total, s.ws_bytes);
    }
    s.state_mem = mem;
    s.st.lr = (float *)mem;
    s.st.polarity = mem + off_pol;
    s.st.row = g.ndim >= 2 ? (float *)(mem + off_row) : NULL;
    s.st.col = g.ndim >= 2 ? (float *)(mem + off_col) : NULL;
    s.st.sq = g.ndim >= 2 ? NULL : (float *)(mem + off_sq);
    {
        am_status st = am_state_init(&s.t.shape, &s.st, o->hp.lr);
        if (am_status_is_error(st)) {
            free(mem);
            free(s.ws);
            return st;
        }
    }
    o->params[o->count] = s;
    *out_id = o->count++;
    return AM_OK;
}

int32_t am_optimizer_num_params(const am_optimizer *o) { return o ? o->count : 0; }

static am_status find(const am_optimizer *o, int32_t id, const char *fn) {
    AM_RETURN_IF(!o, AM_ERR_NULL_POINTER, "%s: opt is NULL", fn);
    AM_RETURN_IF(id < 0 || id >= o->count, AM_ERR_NOT_FOUND,
                 "%s: no parameter with id %d (%d registered)", fn, (int)id,
                 (int)o->count);
    return AM_OK;
}

/* One more skipped update of s, saturating at INT64_MAX: a checkpoint may
 * hold any count >= 0, and one at INT64_MAX overflowed (undefined), then
 * saved a negative count that its own loader refused (found by a review,
 * thirtieth session). */
static void count_skip(am_param_slot *s) {
    if (s->skipped < INT64_MAX) s->skipped++;
}

static am_status update_slot(am_optimizer *o, int32_t id, const void *grad,
                             am_dtype gd, am_report *rep, const char *fn) {
    am_param_slot *s = &o->params[id];
    am_tensor gt = s->t;
    am_rng_key key;
    am_status st;
    gt.data = (void *)grad;
    gt.dtype = gd;
    key.seed = o->seed;
    key.param_id = (uint32_t)id;
    am_log_param(fn, id); /* am_update's messages name fn and the parameter */
    st = am_update(&s->t, &gt, &s->st, &o->hp, key, s->ws, s->ws_bytes, rep);
    am_log_item(NULL, -1);
    if (st == AM_SKIPPED_NONFINITE_GRAD || st == AM_SKIPPED_NONFINITE_UPDATE)
        count_skip(s);
    return st;
}

am_status am_optimizer_update_param(am_optimizer *o, int32_t id,
                                    const void *grad, am_dtype gd,
                                    am_report *rep) {
    AM_CHECK(find(o, id, "am_optimizer_update_param"));
    return update_slot(o, id, grad, gd, rep, "am_optimizer_update_param");
}

/* Elements of a registered parameter (its shape was validated). */
static int64_t slot_numel(const am_param_slot *s) {
    int64_t n = 1;
    int32_t d;
    for (d = 0; d < s->t.shape.ndim; d++) n *= s->t.shape.dims[d];
    return n;
}

/* (a trainer that reallocated its weights had to build a new optimizer
 * and lose the state; a review, thirty-second session) */
am_status am_optimizer_set_param_data(am_optimizer *o, int32_t id, void *data) {
    am_param_slot *s;
    AM_CHECK(find(o, id, "am_optimizer_set_param_data"));
    s = &o->params[id];
    AM_RETURN_IF(slot_numel(s) > 0 && !data, AM_ERR_NULL_POINTER,
                 "am_optimizer_set_param_data: data is NULL for parameter %d", (int)id);
    AM_CHECK(am_check_aligned(data, am_dtype_size(s->t.dtype),
                              "am_optimizer_set_param_data: data"));
    s->t.data = data;
    return AM_OK;
}

/* am_optimizer_update_all's updates (arguments checked) as one
 * am_update_batch call: whole parameters on separate threads, the same
 * bits. Returns 0 (nothing done) when fewer than two parameters have a
 * gradient or the call's buffers cannot be allocated: the caller then
 * updates them one at a time; else 1 with *first_skip set. */
static int update_all_batch(am_optimizer *o, const void *const *grads, const am_dtype *gds,
                            am_report *reps, am_status *first_skip) {
    am_batch_item *items;
    am_tensor *gts;
    int32_t *ids;
    void *ws = NULL;
    size_t bytes = 0;
    int64_t n = 0, k;
    int32_t i;
    int ran = 0;
    for (i = 0; i < o->count; i++) n += grads[i] != NULL;
    if (n < 2) return 0;
    items = (am_batch_item *)calloc((size_t)n, sizeof *items);
    gts = (am_tensor *)calloc((size_t)n, sizeof *gts);
    ids = (int32_t *)calloc((size_t)n, sizeof *ids);
    if (!items || !gts || !ids) goto out;
    for (i = 0, k = 0; i < o->count; i++) {
        if (!grads[i]) continue;
        gts[k] = o->params[i].t;
        gts[k].data = (void *)grads[i];
        gts[k].dtype = gds[i];
        items[k].param = &o->params[i].t;
        items[k].grad = &gts[k];
        items[k].state = &o->params[i].st;
        items[k].hp = &o->hp;
        items[k].key.seed = o->seed;
        items[k].key.param_id = (uint32_t)i;
        items[k].report = reps ? &reps[i] : NULL;
        ids[k++] = i;
    }
    if (am_update_batch_workspace(items, n, am_get_num_threads(), &bytes) != AM_OK ||
        !(ws = malloc(bytes)))
        goto out;
    /* nothing runs unless it returns AM_OK (all checked: the error expected
     * here is parameters sharing memory, tied weights, which the updates
     * one at a time handle: not logged, the caller's fallback is silent) */
    {
        const int was = am_log_mute(1);
        ran = am_update_batch(items, n, ws, bytes) == AM_OK;
        am_log_mute(was);
    }
    if (ran) {
        for (i = 0; i < o->count; i++)
            if (!grads[i] && reps) memset(&reps[i], 0, sizeof reps[i]);
        for (k = 0; k < n; k++) {
            if (items[k].status == AM_SKIPPED_NONFINITE_GRAD ||
                items[k].status == AM_SKIPPED_NONFINITE_UPDATE)
                count_skip(&o->params[ids[k]]);
            if (items[k].status != AM_OK && *first_skip == AM_OK)
                *first_skip = items[k].status;
        }
    }
out:
    free(ws);
    free(items);
    free(gts);
    free(ids);
    return ran;
}

am_status am_optimizer_update_all(am_optimizer *o, const void *const *grads,
                                  const am_dtype *gds, am_report *reps) {
    int32_t i;
    am_status first_skip = AM_OK;
    AM_RETURN_IF(!o, AM_ERR_NULL_POINTER, "am_optimizer_update_all: opt is NULL");
    AM_RETURN_IF(!grads, AM_ERR_NULL_POINTER, "am_optimizer_update_all: grads is NULL");
    AM_RETURN_IF(!gds, AM_ERR_NULL_POINTER,
                 "am_optimizer_update_all: grad_dtypes is NULL");
    for (i = 0; i < o->count; i++) {
        AM_RETURN_IF(grads[i] && am_dtype_size(gds[i]) == 0, AM_ERR_INVALID_DTYPE,
                     "am_optimizer_update_all: grad_dtypes[%d] = %d is invalid",
                     (int)i, (int)gds[i]);
        /* (here, or parameters before i would be updated when am_update
         * refused a misaligned grads[i]) */
        AM_RETURN_IF(grads[i] && slot_numel(&o->params[i]) > 0 &&
                         (uintptr_t)grads[i] % am_dtype_size(gds[i]) != 0,
                     AM_ERR_INVALID_ARGUMENT,
                     "am_optimizer_update_all: grads[%d] %p is not aligned to %zu bytes, "
                     "its element size", (int)i, grads[i], am_dtype_size(gds[i]));
        /* A loaded checkpoint may hold step == INT64_MAX (valid to load, not
         * to increment): refuse here, or parameters before i would already
         * have been updated when am_update refused parameter i. */
        AM_RETURN_IF(grads[i] && o->params[i].st.step == INT64_MAX &&
                         slot_numel(&o->params[i]) > 0,
                     AM_ERR_INVALID_ARGUMENT,
                     "am_optimizer_update_all: parameter %d: step = %lld cannot be "
                     "incremented", (int)i, (long long)o->params[i].st.step);
        /* and a gradient over the parameter's own state (am_update refuses
         * it: here too, before any parameter is updated; a review) */
        if (grads[i]) {
            am_state_sizes sz;
            am_tensor gt = o->params[i].t;
            am_status st;
            gt.data = (void *)grads[i];
            gt.dtype = gds[i];
            am_state_get_sizes(&o->params[i].t.shape, &sz); /* (valid: registered) */
            am_log_param("am_optimizer_update_all", i);
            st = am_check_buffers(&sz, &o->params[i].t, &gt, &o->params[i].st);
            am_log_item(NULL, -1);
            if (st != AM_OK) return st;
        }
    }
    if (am_get_num_threads() > 1 && update_all_batch(o, grads, gds, reps, &first_skip))
        return first_skip;
    for (i = 0; i < o->count; i++) {
        am_status st;
        if (!grads[i]) {
            if (reps) memset(&reps[i], 0, sizeof reps[i]);
            continue;
        }
        st = update_slot(o, i, grads[i], gds[i], reps ? &reps[i] : NULL,
                         "am_optimizer_update_all");
        if (am_status_is_error(st)) return st; /* cannot happen: checked */
        if (st != AM_OK && first_skip == AM_OK) first_skip = st;
    }
    return first_skip;
}

int64_t am_optimizer_lr_count(const am_optimizer *o, int32_t id) {
    am_state_sizes sz;
    if (!o || id < 0 || id >= o->count) return -1;
    if (am_state_get_sizes(&o->params[id].t.shape, &sz) != AM_OK) return -1;
    return sz.lr_count;
}

am_status am_optimizer_get_lrs(const am_optimizer *o, int32_t id, float *out,
                               int64_t count) {
    int64_t n;
    AM_CHECK(find(o, id, "am_optimizer_get_lrs"));
    AM_RETURN_IF(!out, AM_ERR_NULL_POINTER, "am_optimizer_get_lrs: out is NULL");
    n = am_optimizer_lr_count(o, id);
    AM_RETURN_IF(count < n, AM_ERR_BUFFER_SIZE,
                 "am_optimizer_get_lrs: count = %lld, need %lld",
                 (long long)count, (long long)n);
    if (n > 0) memcpy(out, o->params[id].st.lr, (size_t)n * sizeof(float));
    return AM_OK;
}

static double param_lr_mean(const am_optimizer *o, int32_t id) {
    int64_t n = am_optimizer_lr_count(o, id), i;
    double s = 0.0;
    if (n <= 0) return o->hp.lr;
    for (i = 0; i < n; i++) s += o->params[id].st.lr[i];
    return s / (double)n;
}

static am_status lr_mean_impl(const am_optimizer *o, int32_t id, double *out) {
    AM_RETURN_IF(!o, AM_ERR_NULL_POINTER, "am_optimizer_lr_mean: opt is NULL");
    AM_RETURN_IF(!out, AM_ERR_NULL_POINTER, "am_optimizer_lr_mean: out is NULL");
    if (id == -1) {
        /* as the reference: over the parameters that have state there,
         * i.e. that were updated (step > 0) */
        double s = 0.0;
        int32_t i, n = 0;
        for (i = 0; i < o->count; i++)
            if (o->params[i].st.step > 0) {
                s += param_lr_mean(o, i);
                n++;
            }
        *out = n ? s / (double)n : o->hp.lr;
        return AM_OK;
    }
    AM_CHECK(find(o, id, "am_optimizer_lr_mean"));
    *out = param_lr_mean(o, id);
    return AM_OK;
}

/* In IEEE defaults (fpenv.h), as the updates: a loaded lr may be a
 * signaling NaN, whose conversion to double raised SIGFPE for a caller
 * with traps enabled, and a caller's denormals-are-zero read a subnormal lr
 * as 0 (found by a review, fortieth session). */
am_status am_optimizer_lr_mean(const am_optimizer *o, int32_t id, double *out) {
    AM_FPENV_RETURN(lr_mean_impl(o, id, out));
}

int64_t am_optimizer_skipped_count(const am_optimizer *o) {
    int64_t s = 0;
    int32_t i;
    if (!o) return 0;
    for (i = 0; i < o->count; i++) /* (saturated: see count_skip) */
        s = o->params[i].skipped > INT64_MAX - s ? INT64_MAX : s + o->params[i].skipped;
    return s;
}

am_status am_optimizer_get_state(const am_optimizer *o, int32_t id,
                                 am_state *out, am_shape *shape) {
    AM_CHECK(find(o, id, "am_optimizer_get_state"));
    AM_RETURN_IF(!out, AM_ERR_NULL_POINTER, "am_optimizer_get_state: out is NULL");
    *out = o->params[id].st;
    if (shape) *shape = o->params[id].t.shape;
    return AM_OK;
}

am_status am_optimizer_set_hparams(am_optimizer *o, const am_hparams *hp) {
    am_hparams h;
    AM_RETURN_IF(!o, AM_ERR_NULL_POINTER, "am_optimizer_set_hparams: opt is NULL");
    AM_CHECK(am_hparams_validate(hp));
    h = *hp;
    am_force_start_lr(&h);
    o->hp = h;
    return AM_OK;
}

am_status am_optimizer_get_hparams(const am_optimizer *o, am_hparams *hp,
                                   uint64_t *seed) {
    AM_RETURN_IF(!o, AM_ERR_NULL_POINTER, "am_optimizer_get_hparams: opt is NULL");
    if (hp) *hp = o->hp;
    if (seed) *seed = o->seed;
    return AM_OK;
}
