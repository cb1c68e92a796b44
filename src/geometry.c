/* geometry.c — shapes, state sizes and the workspace layout. */
#include "internal.h"

#include <string.h>


static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Adds n items of size sz at 64-byte alignment; returns the offset. */
static size_t take(size_t *cursor, int64_t n, size_t sz) {
    size_t off = *cursor;
    *cursor += ((size_t)n * sz + 63u) & ~(size_t)63u;
    return off;
}

am_status am_geom_init(const am_shape *shape, am_geom *g) {
    return am_geom_init_as(shape, g, "shape");
}

am_status am_geom_init_as(const am_shape *shape, am_geom *g, const char *what) {
    int64_t n = 1, bound = 1;
    int32_t d;
    size_t cur = sizeof(am_ws_header);
    AM_RETURN_IF(!shape, AM_ERR_NULL_POINTER, "%s is NULL", what);
    AM_RETURN_IF(shape->ndim < 0 || shape->ndim > AM_MAX_DIMS,
                 AM_ERR_INVALID_SHAPE, "%s: ndim = %d, must be in [0, %d]", what,
                 (int)shape->ndim, AM_MAX_DIMS);
    for (d = 0; d < shape->ndim; d++) {
        int64_t s = shape->dims[d];
        AM_RETURN_IF(s < 0, AM_ERR_INVALID_SHAPE,
                     "%s: dims[%d] = %lld is negative", what, (int)d, (long long)s);
        /* Every derived count (B, R, C, B*R, lr-rows, tiles) is at most the
         * product of the nonzero dims, and the workspace needs under 64
         * bytes per unit of it: bounding that product by 2^56 keeps every
         * size representable, also for zero-element shapes such as
         * [0, 2^62] whose other dims would otherwise overflow. */
        AM_RETURN_IF(s > 0 && bound > AM_MAX_NUMEL / s, AM_ERR_INVALID_SHAPE,
                     "%s: too large at dims[%d] (the product of the nonzero "
                     "dims must be at most 2^56)", what, (int)d);
        if (s > 0) bound *= s;
        n *= s;
    }
    memset(g, 0, sizeof *g);
    g->ndim = shape->ndim;
    g->numel = n;
    cur = (cur + 63u) & ~(size_t)63u;
    if (shape->ndim >= 2) {
        int64_t B = 1;
        for (d = 0; d < shape->ndim - 2; d++) B *= shape->dims[d];
        g->B = B;
        g->R = shape->dims[shape->ndim - 2];
        g->C = shape->dims[shape->ndim - 1];
        g->lr_rows = shape->dims[0];
        g->m = g->lr_rows ? n / g->lr_rows : 0;
        g->RB = g->R / 64 + (g->R % 64 != 0);
        if (g->RB < AM_ROW_BLOCK_MIN) g->RB = AM_ROW_BLOCK_MIN;
        g->nrb = g->R ? cdiv(g->R, g->RB) : 0;
        g->CB = AM_COL_BLOCK;
        g->ncb = g->C ? cdiv(g->C, g->CB) : 0;
        g->ntiles = B * g->nrb * g->ncb;
        g->pol_row_bytes = cdiv(g->m, 8);
        g->sizes.lr_count = g->lr_rows;
        g->sizes.polarity_bytes = g->lr_rows * g->pol_row_bytes;
        g->sizes.row_count = B * g->R;
        g->sizes.col_count = B * g->C;
        g->off_row_sumsq = take(&cur, B * g->R, sizeof(float));
        g->off_col_sumsq = take(&cur, B * g->C, sizeof(float));
        g->off_rowpart = take(&cur, g->ncb > 1 ? g->ncb * B * g->R : 0, sizeof(float));
        g->off_colpart = take(&cur, g->nrb > 1 ? g->nrb * B * g->C : 0, sizeof(float));
        g->off_new_row = take(&cur, B * g->R, sizeof(float));
        g->off_new_col = take(&cur, B * g->C, sizeof(float));
        g->off_rf = take(&cur, B * g->R, sizeof(float));
        g->off_cf = take(&cur, B * g->C, sizeof(float));
        g->off_rmean = take(&cur, B, sizeof(float));
        g->off_tile_u2 = take(&cur, g->ntiles, sizeof(double));
        g->off_agree = take(&cur, g->lr_rows, sizeof(float));
        g->off_rowmatch = take(&cur, g->ncb * B * g->R, sizeof(int32_t));
        g->off_tile_minpos = take(&cur, g->ntiles, sizeof(float));
        g->batched = g->nrb == 1 && g->ncb == 1 && B > 1 &&
                     g->R * g->C <= AM_MATS_MAX_ELEMS;
        /* Whole rows per tile, and not the batched small-matrix path. */
        g->wsum = g->ncb == 1 && !g->batched;
        g->off_wpart = take(&cur, g->wsum ? g->nrb * B * g->C : 0, sizeof(float));
        g->off_wnr = take(&cur, g->wsum ? B * g->R : 0, sizeof(float));
    } else {
        g->lr_rows = n;
        g->m = 1;
        g->ntiles = cdiv(n, AM_FLAT_CHUNK);
        g->sizes.lr_count = n;
        g->sizes.polarity_bytes = cdiv(n, 8);
        g->sizes.sq_count = n;
        g->off_tile_u2 = take(&cur, g->ntiles, sizeof(double));
        g->off_tile_count = take(&cur, g->ntiles, sizeof(int64_t));
    }
    g->sizes.numel = n;
    /* + 64: the caller's pointer need not be aligned. */
    g->sizes.workspace_bytes = (int64_t)cur + 64;
    return AM_OK;
}

am_status am_state_get_sizes(const am_shape *shape, am_state_sizes *out) {
    am_geom g;
    AM_RETURN_IF(!out, AM_ERR_NULL_POINTER, "am_state_get_sizes: out is NULL");
    AM_CHECK(am_geom_init(shape, &g));
    *out = g.sizes;
    return AM_OK;
}

unsigned char *am_ws_base(const am_geom *g, void *ws, size_t bytes) {
    uintptr_t p = (uintptr_t)ws;
    uintptr_t a = (p + 63u) & ~(uintptr_t)63u;
    if (!ws || bytes < (size_t)g->sizes.workspace_bytes) return NULL;
    return (unsigned char *)a;
}

am_status am_workspace_view_get(const am_shape *shape, void *workspace,
                                size_t workspace_bytes,
                                am_workspace_view *view) {
    am_geom g;
    unsigned char *base;
    am_ws_header *h;
    AM_RETURN_IF(!view, AM_ERR_NULL_POINTER, "am_workspace_view_get: view is NULL");
    AM_RETURN_IF(!workspace, AM_ERR_NULL_POINTER,
                 "am_workspace_view_get: workspace is NULL");
    AM_CHECK(am_geom_init(shape, &g));
    base = am_ws_base(&g, workspace, workspace_bytes);
    AM_RETURN_IF(!base, AM_ERR_BUFFER_SIZE,
                 "workspace: %zu bytes given, %lld needed", workspace_bytes,
                 (long long)g.sizes.workspace_bytes);
    h = (am_ws_header *)base;
    view->row_sumsq = g.ndim >= 2 ? (float *)(base + g.off_row_sumsq) : NULL;
    view->col_sumsq = g.ndim >= 2 ? (float *)(base + g.off_col_sumsq) : NULL;
    view->u2_sum = &h->u2_sum;
    view->nonfinite = &h->nonfinite;
    view->row_moment_sum = &h->row_moment_sum;
    return AM_OK;
}

am_status am_check_aligned(const void *p, size_t align, const char *what) {
    AM_RETURN_IF(align > 1 && (uintptr_t)p % align != 0, AM_ERR_INVALID_ARGUMENT,
                 "%s %p is not aligned to %zu bytes, its element size", what, p, align);
    return AM_OK;
}

am_status am_check_state_aligned(const am_state *s, const char *prefix) {
    const float *a[4];
    static const char *const name[4] = {"state.lr", "state.row", "state.col", "state.sq"};
    int i;
    a[0] = s->lr; a[1] = s->row; a[2] = s->col; a[3] = s->sq;
    for (i = 0; i < 4; i++)
        AM_RETURN_IF((uintptr_t)a[i] % sizeof(float) != 0, AM_ERR_INVALID_ARGUMENT,
                     "%s%s %p is not aligned to 4 bytes (float32)", prefix, name[i],
                     (const void *)a[i]);
    return AM_OK;
}
