/* workspace.c — am_cuda_workspace_bytes: host arithmetic only, so it is in
 * every build (a CPU-only program can size a buffer for a GPU process). */
#include "am_cuda_plan.h"

am_status am_cuda_workspace_bytes(const am_shape *shape, size_t *out) {
    am_geom g;
    AM_RETURN_IF(!out, AM_ERR_NULL_POINTER, "am_cuda_workspace_bytes: out is NULL");
    AM_CHECK(am_geom_init(shape, &g));
    *out = am_cuda_layout_of(&g).total;
    return AM_OK;
}
