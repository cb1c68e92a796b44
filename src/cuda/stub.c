/* stub.c — the CUDA entry points of libautomagic (the CPU-only library):
 * they answer AM_ERR_UNSUPPORTED. The working versions are in
 * libautomagic_cuda (update_cuda.cu), built when AM_CUDA is ON. */
#include "internal.h"

am_status am_cuda_device_count(int *count) {
    AM_RETURN_IF(!count, AM_ERR_NULL_POINTER, "am_cuda_device_count: count is NULL");
    *count = 0;
    am_log(AM_LOG_ERROR, "am_cuda_device_count: this libautomagic has no CUDA "
                         "support (use libautomagic_cuda)");
    return AM_ERR_UNSUPPORTED;
}

am_status am_update_cuda(const am_tensor *param, const am_tensor *grad,
                         const am_state *state, int64_t *step,
                         const am_hparams *hp, am_rng_key key, void *workspace,
                         size_t workspace_bytes, void *stream,
                         am_report *report) {
    (void)param; (void)grad; (void)state; (void)step; (void)hp; (void)key;
    (void)workspace; (void)workspace_bytes; (void)stream; (void)report;
    am_log(AM_LOG_ERROR, "am_update_cuda: this libautomagic has no CUDA "
                         "support (use libautomagic_cuda)");
    return AM_ERR_UNSUPPORTED;
}
