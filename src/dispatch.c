/*
 * dispatch.c — the kernel table in use and the parallel-for seam.
 *
 * The table starts as the scalar reference; optimised kernel sets override
 * slots once the CPU has been checked (none yet: see the Speed issue). The
 * environment variable AUTOMAGIC_FORCE_SCALAR=1 keeps the reference;
 * AUTOMAGIC_DEBUG=1 logs the chosen set through the log callback.
 */
#include "internal.h"

#include <stdlib.h>

static am_kernels g_table;
static int g_table_ready;
static int g_num_threads = 1;

static void choose_table(void) {
    const char *dbg = getenv("AUTOMAGIC_DEBUG");
    g_table = am_kernels_ref;
    if (dbg && dbg[0] == '1')
        am_log(AM_LOG_INFO, "automagic: using %s kernels", g_table.name);
}

const am_kernels *am_kernels_get(void) {
    /* Benign race: every thread computes the same table. Replaced by a
     * once-guard when optimised kernels arrive. */
    if (!g_table_ready) {
        choose_table();
        g_table_ready = 1;
    }
    return &g_table;
}

const char *am_kernel_name(void) { return am_kernels_get()->name; }

am_status am_set_num_threads(int n) {
    AM_RETURN_IF(n < 0, AM_ERR_INVALID_ARGUMENT,
                 "am_set_num_threads: n = %d must be >= 0", n);
    g_num_threads = n == 0 ? 1 : n;
    return AM_OK;
}

int am_get_num_threads(void) { return g_num_threads; }

void am_parallel_for(int64_t ntasks, double cost_per_task, am_task_fn fn,
                     void *ctx) {
    int64_t t;
    (void)cost_per_task;
    for (t = 0; t < ntasks; t++) fn(ctx, t);
}
