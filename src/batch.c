/*
 * batch.c — am_update_batch: the updates of many parameters in one call,
 * whole parameters spread over the threads.
 *
 * Why: an update reads the gradient once in a pass of its own (the stats
 * pass: the clip needs the factored moments of the whole tensor before any
 * element can move) and then reads it again with the parameter, which it
 * writes. am_update splits each pass of one tensor over every thread, so
 * all cores run the read-only pass at the same time. On the twelfth
 * session's machine (AMD EPYC, Zen 4) memory gives a read-only stream much
 * less than one that also writes (docs/PERFORMANCE_HISTORY.md); with whole
 * parameters on separate threads the passes of different tensors overlap.
 *
 * The split is a function of the items' sizes and the thread count only:
 * a parameter larger than total / (2 * threads) elements ("big") runs
 * first, in item order, with every thread (one tensor that large would
 * leave the other threads idle); the others are assigned largest first,
 * each to the thread with the least work so far (ties: the lowest thread),
 * and each thread runs its parameters in that order, one thread per
 * update. Updates of different parameters are independent and an update's
 * bits do not depend on its thread count, so the result is am_update on
 * each item in turn, bit for bit (test_batch.c).
 *
 * Workspace (am_update_batch_workspace): the schedule (16 bytes per item),
 * then one slot per thread, each the largest item's am_update workspace.
 */
#include "internal.h"

#include "fpenv.h"

#include <stdlib.h>
#include <string.h>

typedef struct sched_entry {
    int64_t numel; /* sort key */
    int64_t item;
    int64_t group; /* thread, or -1 for a big item */
} sched_entry;

typedef struct batch {
    am_batch_item *items;
    sched_entry *sched;
    int64_t n;
    unsigned char *slots;
    size_t slot_bytes;
} batch;

static size_t round64(size_t x) { return (x + 63u) & ~(size_t)63u; }

static int slot_count(int64_t n, int nthreads) {
    return n < (int64_t)nthreads ? (n > 0 ? (int)n : 1) : nthreads;
}

/* Checks item i as am_update would (no workspace); its am_update
 * workspace size in *ws. */
static am_status check_item(const am_batch_item *it, int64_t *ws) {
    AM_RETURN_IF(!it->param, AM_ERR_NULL_POINTER, "param is NULL");
    /* on an error, am_update's message */
    return am_update_check(it->param, it->grad, it->state, it->hp, ws);
}

/* A byte range of a parameter, of its state or of its gradient (grad set),
 * for the overlap check. */
typedef struct span {
    uintptr_t lo, hi;
    int64_t item;
    int grad;
} span;

static int cmp_span(const void *a, const void *b) {
    const span *x = (const span *)a, *y = (const span *)b;
    return (x->lo > y->lo) - (x->lo < y->lo);
}

static void add_span(span *sp, int *k, const void *p, int64_t bytes, int64_t item, int grad) {
    if (p && bytes > 0) {
        sp[*k].lo = (uintptr_t)p;
        sp[*k].hi = (uintptr_t)p + (uintptr_t)bytes;
        sp[*k].item = item;
        sp[*k].grad = grad;
        (*k)++;
    }
}

/* Spans a and b of different items may not share bytes unless both are
 * gradients (only read). */
static int conflict(const span *a, const span *b) {
    return a->item != b->item && !(a->grad && b->grad);
}

/* AM_ERR_INVALID_ARGUMENT when an item's parameter or state shares memory
 * with another item's parameter, state or gradient (updated at the same
 * time they would race; in turn, one would see the other's result).
 * Gradients may share memory with each other; an item's gradient that
 * overlaps its own parameter or state is not looked for here (the header
 * leaves that undefined, as for am_update). The spans sorted by start,
 * each is compared with every earlier one still open: those whose end is
 * past its start (at most one kept per kind: the open span reaching
 * furthest, and the furthest one of another item, so a span nested in one
 * of its own item's spans cannot hide another item's). */
static am_status check_overlap(const am_batch_item *items, int64_t n) {
    enum { PER_ITEM = 8 };
    span *sp;
    int64_t i;
    int k = 0, j;
    if (n < 2) return AM_OK;
    AM_RETURN_IF(n > (int64_t)(0x7fffffff / PER_ITEM), AM_ERR_INVALID_ARGUMENT,
                 "am_update_batch: n = %lld items is too many", (long long)n);
    sp = (span *)malloc(sizeof(span) * (size_t)(n * PER_ITEM));
    AM_RETURN_IF(!sp, AM_ERR_OUT_OF_MEMORY, "am_update_batch: no memory for %lld items",
                 (long long)n);
    for (i = 0; i < n; i++) {
        const am_batch_item *it = &items[i];
        am_state_sizes sz;
        /* reports are written by every item, zero-element ones too: two
         * items writing one report raced on two threads (found by a
         * review, twenty-second session) */
        add_span(sp, &k, it->report, (int64_t)sizeof(am_report), i, 0);
        if (am_state_get_sizes(&it->param->shape, &sz) != AM_OK || sz.numel == 0) continue;
        add_span(sp, &k, it->param->data, sz.numel * (int64_t)am_dtype_size(it->param->dtype), i,
                 0);
        add_span(sp, &k, it->grad->data, sz.numel * (int64_t)am_dtype_size(it->grad->dtype), i, 1);
        add_span(sp, &k, it->state->lr, 4 * sz.lr_count, i, 0);
        add_span(sp, &k, it->state->polarity, sz.polarity_bytes, i, 0);
        add_span(sp, &k, it->state->row, 4 * sz.row_count, i, 0);
        add_span(sp, &k, it->state->col, 4 * sz.col_count, i, 0);
        add_span(sp, &k, it->state->sq, 4 * sz.sq_count, i, 0);
    }
    qsort(sp, (size_t)k, sizeof(span), cmp_span);
    {
        /* open[g][o]: among the spans before j, the one reaching furthest
         * (o = 0) and the one reaching furthest of another item than that
         * one (o = 1), for gradients (g = 1) and the rest (g = 0): any span
         * before j that overlaps j and conflicts with it overlaps one of
         * these four and conflicts with it too */
        const span *open[2][2] = {{NULL, NULL}, {NULL, NULL}};
        for (j = 0; j < k; j++) {
            const span *x = &sp[j];
            int g, o;
            for (g = 0; g < 2; g++)
                for (o = 0; o < 2; o++) {
                    const span *y = open[g][o];
                    if (y && x->lo < y->hi && conflict(x, y)) {
                        const int64_t a = y->item, b = x->item;
                        const int pg = y->grad ? 1 : x->grad ? 2 : 0;
                        free(sp);
                        AM_RETURN_IF(1, AM_ERR_INVALID_ARGUMENT,
                                     "am_update_batch: items %lld and %lld share memory (%s)",
                                     (long long)(a < b ? a : b), (long long)(a < b ? b : a),
                                     pg ? "one's gradient is the other's parameter or state"
                                        : "a parameter, a state buffer or a report");
                    }
                }
            g = x->grad;
            if (!open[g][0] || x->hi > open[g][0]->hi) {
                if (open[g][0] && open[g][0]->item != x->item) open[g][1] = open[g][0];
                open[g][0] = x;
            } else if (x->item != open[g][0]->item && (!open[g][1] || x->hi > open[g][1]->hi)) {
                open[g][1] = x;
            }
        }
    }
    free(sp);
    return AM_OK;
}

/* Checks every item; the largest workspace of one update in *max_ws. */
static am_status check_all(const char *fn, const am_batch_item *items, int64_t n,
                           int64_t *max_ws, int64_t *err_item) {
    int64_t i;
    *max_ws = 0;
    for (i = 0; i < n; i++) {
        int64_t ws = 0;
        am_status s;
        am_log_item(fn, i); /* its messages say "<fn>: item i: " */
        s = check_item(&items[i], &ws);
        am_log_item(NULL, -1);
        if (s != AM_OK) {
            *err_item = i;
            return s;
        }
        if (ws > *max_ws) *max_ws = ws;
    }
    *err_item = -1;
    return AM_OK;
}

/* The workspace of n items at nthreads threads whose largest am_update
 * workspace is max_ws, in *bytes; AM_ERR_INVALID_ARGUMENT when it exceeds
 * SIZE_MAX / 2 (a zero-element item of a huge shape, [2^56, 0] say, needs
 * a huge workspace of its own, and one slot per thread multiplies it). */
static am_status batch_bytes(int64_t n, int nthreads, int64_t max_ws, size_t *bytes) {
    const size_t lim = SIZE_MAX / 2, slots = (size_t)slot_count(n, nthreads);
    const size_t sched = round64(sizeof(sched_entry) * (size_t)(n > 0 ? n : 0));
    const size_t slot = round64((size_t)max_ws);
    AM_RETURN_IF(slot > (lim - sched - 64u) / slots, AM_ERR_INVALID_ARGUMENT,
                 "am_update_batch: the workspace of %lld items at %d threads (%zu slots of "
                 "%lld bytes) would exceed %zu bytes",
                 (long long)n, nthreads, slots, (long long)max_ws, lim);
    *bytes = sched + slots * slot + 64u;
    return AM_OK;
}

am_status am_update_batch_workspace(const am_batch_item *items, int64_t n, int nthreads,
                                    size_t *bytes) {
    int64_t max_ws, err;
    AM_RETURN_IF(!bytes, AM_ERR_NULL_POINTER, "am_update_batch_workspace: bytes is NULL");
    AM_RETURN_IF(n < 0, AM_ERR_INVALID_ARGUMENT, "am_update_batch_workspace: n = %lld < 0",
                 (long long)n);
    AM_RETURN_IF(nthreads < 1, AM_ERR_INVALID_ARGUMENT,
                 "am_update_batch_workspace: nthreads = %d < 1", nthreads);
    AM_RETURN_IF(n > 0 && !items, AM_ERR_NULL_POINTER,
                 "am_update_batch_workspace: items is NULL");
    AM_CHECK(check_all("am_update_batch_workspace", items, n, &max_ws, &err));
    return batch_bytes(n, nthreads, max_ws, bytes);
}

static int cmp_sched(const void *a, const void *b) {
    const sched_entry *x = (const sched_entry *)a, *y = (const sched_entry *)b;
    if (x->numel != y->numel) return x->numel < y->numel ? 1 : -1; /* larger first */
    return (x->item > y->item) - (x->item < y->item);
}

/* More than total / (2 * T) elements: updated on every thread, first. */
static int is_big(int64_t numel, int T, int64_t total) {
    return (double)numel * 2.0 * (double)T > (double)total;
}

static void run_item(am_batch_item *it, void *slot, size_t slot_bytes) {
    it->status = am_update(it->param, it->grad, it->state, it->hp, it->key, slot, slot_bytes,
                           it->report);
}

/* Thread t's parameters, one update at a time on this thread. */
static void batch_task(void *ctx, int64_t t) {
    batch *b = (batch *)ctx;
    unsigned char *slot = b->slots + (size_t)t * b->slot_bytes;
    int64_t k;
    const int was = am_set_thread_serial(1);
    for (k = 0; k < b->n; k++)
        if (b->sched[k].group == t) run_item(&b->items[b->sched[k].item], slot, b->slot_bytes);
    am_set_thread_serial(was);
}

static am_status update_batch_impl(am_batch_item *items, int64_t n, void *workspace,
                                   size_t workspace_bytes) {
    const int nthreads = am_get_num_threads();
    int64_t max_ws, err, i, total = 0;
    int T, t;
    size_t need;
    batch b;
    double load[256];
    am_status s;
    AM_RETURN_IF(n < 0, AM_ERR_INVALID_ARGUMENT, "am_update_batch: n = %lld < 0", (long long)n);
    if (n == 0) return AM_OK;
    AM_RETURN_IF(!items, AM_ERR_NULL_POINTER, "am_update_batch: items is NULL");
    for (i = 0; i < n; i++) items[i].status = AM_ERR_INVALID_ARGUMENT; /* not run */
    s = check_all("am_update_batch", items, n, &max_ws, &err);
    if (s == AM_OK) s = check_overlap(items, n);
    if (s != AM_OK) {
        if (err >= 0) items[err].status = s;
        return s;
    }
    /* the workspace of one slot (one thread): the least that runs */
    s = batch_bytes(n, 1, max_ws, &need);
    if (s != AM_OK) return s;
    AM_RETURN_IF(!workspace, AM_ERR_NULL_POINTER, "am_update_batch: workspace is NULL");
    AM_RETURN_IF(workspace_bytes < need, AM_ERR_BUFFER_SIZE,
                 "am_update_batch: workspace: %zu bytes given, at least %zu needed (one "
                 "thread; am_update_batch_workspace)",
                 workspace_bytes, need);
    b.items = items;
    b.n = n;
    b.sched = (sched_entry *)(((uintptr_t)workspace + 63u) & ~(uintptr_t)63u);
    b.slots = (unsigned char *)b.sched + round64(sizeof(sched_entry) * (size_t)n);
    b.slot_bytes = round64((size_t)max_ws);
    T = slot_count(n, nthreads);
    if (T > (int)(sizeof load / sizeof load[0])) T = (int)(sizeof load / sizeof load[0]);
    /* A workspace sized for fewer threads than now run (another thread may
     * change the count between the caller's am_update_batch_workspace and
     * this call, which am_set_num_threads allows): as many threads as it
     * has slots for; the bits never depend on the thread count. */
    {
        const size_t fit = (workspace_bytes - need) / b.slot_bytes + 1;
        if ((size_t)T > fit) T = (int)fit;
    }
    if (T == 1) { /* in turn, each update on every thread */
        for (i = 0; i < n; i++) run_item(&items[i], b.slots, b.slot_bytes);
        return AM_OK;
    }
    for (i = 0; i < n; i++) {
        am_state_sizes sz;
        am_state_get_sizes(&items[i].param->shape, &sz); /* checked above */
        b.sched[i].numel = sz.numel;
        b.sched[i].item = i;
        total += sz.numel;
    }
    qsort(b.sched, (size_t)n, sizeof(sched_entry), cmp_sched);
    for (t = 0; t < T; t++) load[t] = 0.0;
    for (i = 0; i < n; i++) {
        sched_entry *e = &b.sched[i];
        int best = 0;
        if (is_big(e->numel, T, total)) {
            e->group = -1;
            continue;
        }
        for (t = 1; t < T; t++)
            if (load[t] < load[best]) best = t;
        e->group = best;
        load[best] += (double)e->numel;
    }
    for (i = 0; i < n; i++) { /* big ones first, in item order, on every thread */
        am_state_sizes sz;
        am_state_get_sizes(&items[i].param->shape, &sz);
        if (is_big(sz.numel, T, total)) run_item(&items[i], b.slots, b.slot_bytes);
    }
    am_parallel_for(T, 12.0 * (double)total / (double)T, batch_task, &b);
    return AM_OK;
}

/* In the library's floating-point environment (fpenv.h). */
am_status am_update_batch(am_batch_item *items, int64_t n, void *workspace,
                          size_t workspace_bytes) {
    AM_FPENV_RETURN(update_batch_impl(items, n, workspace, workspace_bytes));
}
