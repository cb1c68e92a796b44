/* state.c — initial state of a parameter (SPEC 2). */
#include "internal.h"

#include "fpenv.h"

#include <math.h>
#include <string.h>

static am_status state_init_impl(const am_shape *shape, am_state *state,
                                 double initial_lr) {
    am_geom g;
    int64_t i;
    AM_RETURN_IF(!state, AM_ERR_NULL_POINTER, "am_state_init: state is NULL");
    AM_CHECK(am_geom_init(shape, &g));
    /* in float32, the state's precision: neither 0 nor infinite there
     * (1e300 was stored as +inf) */
    AM_RETURN_IF(!(initial_lr > 0) || !isfinite(initial_lr) ||
                     !((float)initial_lr > 0) || !isfinite((float)initial_lr),
                 AM_ERR_INVALID_HPARAM,
                 "am_state_init: initial_lr = %g must be > 0 and finite in float32 "
                 "(from 1.4e-45 to 3.4e38)",
                 initial_lr);
    AM_RETURN_IF(g.sizes.lr_count > 0 && !state->lr, AM_ERR_NULL_POINTER,
                 "am_state_init: state.lr is NULL");
    AM_RETURN_IF(g.sizes.polarity_bytes > 0 && !state->polarity,
                 AM_ERR_NULL_POINTER, "am_state_init: state.polarity is NULL");
    AM_RETURN_IF(g.sizes.row_count > 0 && !state->row, AM_ERR_NULL_POINTER,
                 "am_state_init: state.row is NULL");
    AM_RETURN_IF(g.sizes.col_count > 0 && !state->col, AM_ERR_NULL_POINTER,
                 "am_state_init: state.col is NULL");
    AM_RETURN_IF(g.sizes.sq_count > 0 && !state->sq, AM_ERR_NULL_POINTER,
                 "am_state_init: state.sq is NULL");
    AM_CHECK(am_check_state_aligned(state, "am_state_init: "));
    for (i = 0; i < g.sizes.lr_count; i++) state->lr[i] = (float)initial_lr;
    if (g.sizes.polarity_bytes)
        memset(state->polarity, 0, (size_t)g.sizes.polarity_bytes);
    if (g.sizes.row_count)
        memset(state->row, 0, (size_t)g.sizes.row_count * sizeof(float));
    if (g.sizes.col_count)
        memset(state->col, 0, (size_t)g.sizes.col_count * sizeof(float));
    if (g.sizes.sq_count)
        memset(state->sq, 0, (size_t)g.sizes.sq_count * sizeof(float));
    state->step = 0;
    return AM_OK;
}

/* In IEEE defaults (fpenv.h; see am_hparams_validate). */
am_status am_state_init(const am_shape *shape, am_state *state, double initial_lr) {
    AM_FPENV_RETURN(state_init_impl(shape, state, initial_lr));
}
