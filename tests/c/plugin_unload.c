/*
 * plugin_unload.c — a plugin (a shared object a host dlopen()s and
 * dlclose()s) with the static library linked in: plug_step() updates a
 * 300x300 float32 parameter on two threads and returns at once (its
 * buffers are static: freeing them took long enough for the workers to
 * stop watching). Built as a module for test_plugin_unload.c.
 */
#include <automagic.h>

#define AM_PLUG_N (300 * 300)

int plug_step(void);

static float g_p[AM_PLUG_N], g_g[AM_PLUG_N], g_lr[300], g_row[300], g_col[300];
static uint8_t g_pol[AM_PLUG_N / 8 + 300];
static _Alignas(64) unsigned char g_ws[1 << 20];

int plug_step(void) {
    am_shape shape = {2, {300, 300}};
    am_state_sizes sz;
    am_tensor p, g;
    am_state st = {0};
    am_hparams hp = am_hparams_default();
    am_rng_key key = {1, 0};
    int64_t i;
    am_status rc;
    if (am_state_get_sizes(&shape, &sz) != AM_OK || (size_t)sz.workspace_bytes > sizeof g_ws ||
        sz.polarity_bytes > (int64_t)sizeof g_pol)
        return -100;
    p.dtype = g.dtype = AM_DTYPE_FLOAT32;
    p.shape = g.shape = shape;
    p.data = g_p;
    g.data = g_g;
    st.lr = g_lr;
    st.polarity = g_pol;
    st.row = g_row;
    st.col = g_col;
    for (i = 0; i < sz.numel; i++) g_g[i] = (float)(i % 7) - 3.0f;
    am_set_num_threads(2);
    rc = am_state_init(&shape, &st, 1e-4);
    if (rc == AM_OK) rc = am_update(&p, &g, &st, &hp, key, g_ws, sizeof g_ws, NULL);
    return (int)rc;
}
