/*
 * update_cuda.cu — the public CUDA entry points (include/automagic.h,
 * "CUDA"): argument checks on the host, then the plan of am_cuda_plan.h
 * launched on the caller's stream. No host synchronisation, no allocation,
 * no device-to-host copy: the status of the update stays on the device (the
 * workspace header and the optional device-side report), so a step can be
 * captured in a CUDA graph.
 *
 * Built with --fmad=false, -prec-div=true, -prec-sqrt=true, -ftz=false so
 * every float operation rounds as the CPU's (CMakeLists.txt).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <mutex>

#include <cuda_runtime.h>

extern "C" {
#include "am_cuda_plan.h"
#include "fpenv.h"
}

#include "kernels.cuh"

namespace {

const int64_t kMaxBlocks = (int64_t)1 << 20; /* grid-stride beyond this */

unsigned grid_for(int64_t n) {
    int64_t b = (n + AM_CUDA_BLOCK - 1) / AM_CUDA_BLOCK;
    return (unsigned)(b < kMaxBlocks ? b : kMaxBlocks);
}

unsigned counter_grid(int64_t n) {
    unsigned g = grid_for(n);
    return g < AM_COUNTER_BLOCKS ? g : AM_COUNTER_BLOCKS;
}

template <int ID>
void launch_elem(const am_ck_args &a, cudaStream_t s) {
    int64_t n = am_ck_threads(&a, ID);
    if (n > 0) am_k_elem<ID><<<grid_for(n), AM_CUDA_BLOCK, 0, s>>>(a, n);
}

template <int ID>
void launch_lanes(const am_ck_args &a, cudaStream_t s) {
    int64_t n = am_ck_threads(&a, ID);
    if (n > 0) am_k_lanes<ID><<<grid_for(n), AM_CUDA_BLOCK, 0, s>>>(a, n);
}

/* The flag is usually 0: every block reads it and exits; when set, a
 * grid-stride loop over at most AM_COUNTER_BLOCKS blocks counts. */
void launch_count(const am_ck_args &a, int id, cudaStream_t s) {
    int64_t n = am_ck_threads(&a, id);
    if (n > 0) am_k_count<<<counter_grid(n), AM_CUDA_BLOCK, 0, s>>>(a, n);
}

/* The plan after AM_CK_INIT, in the order of the AM_CK_* ids. */
void launch_plan(const am_ck_args &a, cudaStream_t s) {
    int64_t n;
    launch_lanes<AM_CK_LANES_G2>(a, s);
    launch_elem<AM_CK_ROWS>(a, s);
    launch_count(a, AM_CK_COUNT_FAC, s);
    launch_elem<AM_CK_COLS_RMEAN>(a, s);
    launch_elem<AM_CK_COLS_FINAL>(a, s);
    launch_elem<AM_CK_WSUM>(a, s);
    launch_elem<AM_CK_WSUM_BLOCKS>(a, s);
    launch_elem<AM_CK_WSUM_U2>(a, s);
    launch_lanes<AM_CK_LANES_U2>(a, s);
    launch_elem<AM_CK_TILE_U2>(a, s);
    launch_lanes<AM_CK_LANES_FLAT>(a, s);
    launch_elem<AM_CK_SUM_U2>(a, s);
    launch_count(a, AM_CK_COUNT_FLAT, s);
    launch_elem<AM_CK_DECIDE>(a, s);
    n = am_ck_threads(&a, AM_CK_AGREE);
    if (n > 0) am_k_agree<<<counter_grid(n), AM_CUDA_BLOCK, 0, s>>>(a, n);
    launch_elem<AM_CK_BUMP>(a, s);
    launch_elem<AM_CK_APPLY>(a, s);
    n = am_ck_threads(&a, AM_CK_ROW_FINISH);
    if (n > 0)
        am_k_row_finish<<<(unsigned)(n < kMaxBlocks ? n : kMaxBlocks), AM_CUDA_BLOCK, 0, s>>>(a, n);
    launch_elem<AM_CK_COMMIT>(a, s);
    n = am_ck_threads(&a, AM_CK_FINISH_FLAT);
    if (n > 0) am_k_finish_flat<<<counter_grid(n), AM_CUDA_BLOCK, 0, s>>>(a, n);
    launch_elem<AM_CK_REPORT>(a, s);
}

/* With lazy module loading (the CUDA 12+ default) a kernel is loaded at its
 * first launch. Loading them all at the first update of the process keeps a
 * later CUDA-graph capture from being the first launch of, say, the other
 * finish path. Per process, for the device current at that first call;
 * failures are left to the launches to report. */
template <int ID> void touch_elem() {
    cudaFuncAttributes fa;
    (void)cudaFuncGetAttributes(&fa, am_k_elem<ID>);
}

template <int ID> void touch_lanes() {
    cudaFuncAttributes fa;
    (void)cudaFuncGetAttributes(&fa, am_k_lanes<ID>);
}

void preload_kernels() {
    static std::once_flag once;
    std::call_once(once, [] {
        cudaFuncAttributes fa;
        touch_elem<AM_CK_INIT>();
        touch_lanes<AM_CK_LANES_G2>();
        touch_elem<AM_CK_ROWS>();
        touch_elem<AM_CK_COLS_RMEAN>();
        touch_elem<AM_CK_COLS_FINAL>();
        touch_elem<AM_CK_WSUM>();
        touch_elem<AM_CK_WSUM_BLOCKS>();
        touch_elem<AM_CK_WSUM_U2>();
        touch_lanes<AM_CK_LANES_U2>();
        touch_elem<AM_CK_TILE_U2>();
        touch_lanes<AM_CK_LANES_FLAT>();
        touch_elem<AM_CK_SUM_U2>();
        touch_elem<AM_CK_DECIDE>();
        touch_elem<AM_CK_BUMP>();
        touch_elem<AM_CK_APPLY>();
        touch_elem<AM_CK_COMMIT>();
        touch_elem<AM_CK_REPORT>();
        (void)cudaFuncGetAttributes(&fa, am_k_count);
        (void)cudaFuncGetAttributes(&fa, am_k_agree);
        (void)cudaFuncGetAttributes(&fa, am_k_row_finish);
        (void)cudaFuncGetAttributes(&fa, am_k_finish_flat);
        (void)cudaGetLastError();
    });
}

am_status device_error(cudaError_t e, const char *what) {
    am_log(AM_LOG_ERROR, "%s: CUDA error %d (%s): %s", what, (int)e,
           cudaGetErrorName(e), cudaGetErrorString(e));
    return AM_ERR_DEVICE;
}

/* Every check of am_update's, on host values only (the pointers are device
 * pointers and are never dereferenced here). */
am_status check_args(const am_tensor *param, const am_tensor *grad,
                     const am_state *st, const int64_t *step,
                     const am_hparams *hp, const void *ws, am_geom *g) {
    int32_t d;
    AM_RETURN_IF(!param, AM_ERR_NULL_POINTER, "am_update_cuda: param is NULL");
    AM_RETURN_IF(!grad, AM_ERR_NULL_POINTER, "am_update_cuda: grad is NULL");
    AM_CHECK(am_geom_init(&param->shape, g));
    AM_RETURN_IF(am_dtype_size(param->dtype) == 0, AM_ERR_INVALID_DTYPE,
                 "am_update_cuda: param dtype %d is not float32, bfloat16 or "
                 "float16", (int)param->dtype);
    AM_RETURN_IF(am_dtype_size(grad->dtype) == 0, AM_ERR_INVALID_DTYPE,
                 "am_update_cuda: grad dtype %d is not float32, bfloat16 or "
                 "float16", (int)grad->dtype);
    AM_RETURN_IF(grad->shape.ndim != param->shape.ndim, AM_ERR_INVALID_SHAPE,
                 "am_update_cuda: grad has %d dims, param has %d",
                 (int)grad->shape.ndim, (int)param->shape.ndim);
    for (d = 0; d < param->shape.ndim; d++)
        AM_RETURN_IF(grad->shape.dims[d] != param->shape.dims[d],
                     AM_ERR_INVALID_SHAPE,
                     "am_update_cuda: grad dims[%d] = %lld differs from "
                     "param's %lld", (int)d, (long long)grad->shape.dims[d],
                     (long long)param->shape.dims[d]);
    AM_CHECK(am_hparams_validate(hp));
    AM_RETURN_IF(!st, AM_ERR_NULL_POINTER, "am_update_cuda: state is NULL");
    AM_RETURN_IF(!step, AM_ERR_NULL_POINTER, "am_update_cuda: step is NULL");
    AM_RETURN_IF(!ws, AM_ERR_NULL_POINTER, "am_update_cuda: workspace is NULL");
    if (g->numel == 0) return AM_OK;
    AM_RETURN_IF(!param->data, AM_ERR_NULL_POINTER, "am_update_cuda: param data is NULL");
    AM_RETURN_IF(!grad->data, AM_ERR_NULL_POINTER, "am_update_cuda: grad data is NULL");
    AM_RETURN_IF(!st->lr, AM_ERR_NULL_POINTER, "am_update_cuda: state.lr is NULL");
    AM_RETURN_IF(!st->polarity, AM_ERR_NULL_POINTER,
                 "am_update_cuda: state.polarity is NULL");
    if (g->ndim >= 2) {
        AM_RETURN_IF(!st->row, AM_ERR_NULL_POINTER, "am_update_cuda: state.row is NULL");
        AM_RETURN_IF(!st->col, AM_ERR_NULL_POINTER, "am_update_cuda: state.col is NULL");
    } else {
        AM_RETURN_IF(!st->sq, AM_ERR_NULL_POINTER, "am_update_cuda: state.sq is NULL");
    }
    AM_CHECK(am_check_aligned(param->data, am_dtype_size(param->dtype),
                              "am_update_cuda: param data"));
    AM_CHECK(am_check_aligned(grad->data, am_dtype_size(grad->dtype),
                              "am_update_cuda: grad data"));
    AM_CHECK(am_check_state_aligned(st, "am_update_cuda: "));
    AM_RETURN_IF((uintptr_t)step % sizeof(int64_t) != 0, AM_ERR_INVALID_ARGUMENT,
                 "am_update_cuda: step %p is not aligned to 8 bytes (int64)", (void *)step);
    return AM_OK;
}

} /* namespace */

extern "C" {

am_status am_cuda_device_count(int *count) {
    int n = 0;
    cudaError_t e;
    AM_RETURN_IF(!count, AM_ERR_NULL_POINTER, "am_cuda_device_count: count is NULL");
    e = cudaGetDeviceCount(&n);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) {
        (void)cudaGetLastError();
        /* zero devices, but say why when a GPU may be there: the CUDA
         * runtime is linked statically, so a driver older than the toolkit
         * this was built with cannot run it. The runtime gives the same
         * error when no driver is installed at all, whose version reads 0:
         * no warning then (it said "older" on a machine without a GPU) */
        int driver = 0;
        if (e == cudaErrorInsufficientDriver && cudaDriverGetVersion(&driver) == cudaSuccess &&
            driver > 0)
            am_log(AM_LOG_WARNING,
                   "am_cuda_device_count: %s (the driver is older than the CUDA %d.%d "
                   "runtime this library was built with): no device usable",
                   cudaGetErrorString(e), CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
        *count = 0;
        return AM_OK;
    }
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return device_error(e, "am_cuda_device_count");
    }
    *count = n;
    return AM_OK;
}

static am_status update_cuda_impl(const am_tensor *param, const am_tensor *grad,
                                  const am_state *state, int64_t *step,
                                  const am_hparams *hp, am_rng_key key, void *workspace,
                                  size_t workspace_bytes, void *stream,
                                  am_report *report) {
    am_geom g;
    am_ck_args a;
    cudaStream_t s = (cudaStream_t)stream;
    uintptr_t base;
    size_t need;
    cudaError_t e;
    AM_CHECK(check_args(param, grad, state, step, hp, workspace, &g));
    /* (the last kernel writes it, after the state: a misaligned one faulted
     * after the update was applied) */
    AM_RETURN_IF((uintptr_t)report % 8 != 0, AM_ERR_INVALID_ARGUMENT,
                 "am_update_cuda: report %p is not aligned to 8 bytes", (void *)report);
    need = am_cuda_layout_of(&g).total;
    AM_RETURN_IF(workspace_bytes < need, AM_ERR_BUFFER_SIZE,
                 "am_update_cuda: workspace: %zu bytes given, %zu needed",
                 workspace_bytes, need);
    preload_kernels();
    /* Errors of this library's earlier calls must not be reported as ours. */
    (void)cudaGetLastError();
    if (g.numel == 0) {
        /* Nothing to do; the report (if any) says AM_OK with zeros. */
        if (report) {
            e = cudaMemsetAsync(report, 0, sizeof *report, s);
            if (e != cudaSuccess) return device_error(e, "am_update_cuda");
        }
        return AM_OK;
    }
    base = ((uintptr_t)workspace + (AM_CUDA_ALIGN - 1)) & ~(uintptr_t)(AM_CUDA_ALIGN - 1);
    am_ck_args_init(&a, &g, param, grad, state, step, hp, key,
                    (unsigned char *)base, report);
    /* A bad stream, device or context shows up on the first launch, before
     * anything has been modified. */
    launch_elem<AM_CK_INIT>(a, s);
    e = cudaGetLastError();
    if (e != cudaSuccess) return device_error(e, "am_update_cuda: first launch");
    launch_plan(a, s);
    e = cudaGetLastError();
    if (e != cudaSuccess) return device_error(e, "am_update_cuda");
    return AM_OK;
}

/* The host side in IEEE defaults (fpenv.h), as am_update. */
am_status am_update_cuda(const am_tensor *param, const am_tensor *grad,
                         const am_state *state, int64_t *step,
                         const am_hparams *hp, am_rng_key key, void *workspace,
                         size_t workspace_bytes, void *stream,
                         am_report *report) {
    AM_FPENV_RETURN(update_cuda_impl(param, grad, state, step, hp, key, workspace,
                                     workspace_bytes, stream, report));
}

} /* extern "C" */
