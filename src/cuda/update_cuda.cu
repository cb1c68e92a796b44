/*
 * update_cuda.cu — the public CUDA entry points (include/automagic.h,
 * "CUDA"): argument checks on the host, then the plan of am_cuda_plan.h
 * launched on the caller's stream. No host synchronisation, no allocation,
 * no device-to-host copy: the status of the update stays on the device (the
 * workspace header and the optional device-side report), so a step can be
 * captured in a CUDA graph.
 *
 * Built with --fmad=false, -prec-div=true, -prec-sqrt=true, -ftz=false so
 * every float operation rounds as the CPU's (cmake/cuda.cmake).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <atomic>
#include <mutex>

#include <cuda_runtime.h>

extern "C" {
#include "am_cuda_plan.h"
#include "fpenv.h"
}

#include "kernels.cuh"
#include "am_cuda_launch.h"

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

/* Each launch's error is checked at once (gpu_launcher): a launch that
 * fails (a kernel that could not be loaded on this device, say, with the
 * memory held by a caching allocator) stops the plan there. Before, the
 * plan went on and the later kernels read sums and factors a previous
 * parameter had left in the workspace, then wrote lr, polarity and moments
 * from them (found by a review, thirty-third session). Every kernel before
 * AM_CK_AGREE writes the workspace only, so a failure there leaves the
 * state and the parameter as they were. */
template <int ID>
cudaError_t launch_elem(const am_ck_args &a, cudaStream_t s) {
    int64_t n = am_ck_threads(&a, ID);
    if (n > 0) am_k_elem<ID><<<grid_for(n), AM_CUDA_BLOCK, 0, s>>>(a, n);
    return cudaGetLastError();
}

template <int ID>
cudaError_t launch_lanes(const am_ck_args &a, cudaStream_t s) {
    int64_t n = am_ck_threads(&a, ID);
    if (n > 0) am_k_lanes<ID><<<grid_for(n), AM_CUDA_BLOCK, 0, s>>>(a, n);
    return cudaGetLastError();
}

/* The flag is usually 0: every block reads it and exits; when set, a
 * grid-stride loop over at most AM_COUNTER_BLOCKS blocks counts. */
cudaError_t launch_count(const am_ck_args &a, int id, cudaStream_t s) {
    int64_t n = am_ck_threads(&a, id);
    if (n > 0) am_k_count<<<counter_grid(n), AM_CUDA_BLOCK, 0, s>>>(a, n);
    return cudaGetLastError();
}

/* The launcher of am_cuda_launch.h: the kernels on stream s, each launch's
 * error checked at once. */
struct gpu_launcher {
    typedef cudaError_t error;
    cudaStream_t s;
    static cudaError_t ok() { return cudaSuccess; }
    template <int ID>
    cudaError_t elem(const am_ck_args &a) { return launch_elem<ID>(a, s); }
    template <int ID>
    cudaError_t lanes(const am_ck_args &a) { return launch_lanes<ID>(a, s); }
    cudaError_t count(const am_ck_args &a, int id) { return launch_count(a, id, s); }
    cudaError_t agree(const am_ck_args &a) {
        int64_t n = am_ck_threads(&a, AM_CK_AGREE);
        if (n > 0) am_k_agree<<<counter_grid(n), AM_CUDA_BLOCK, 0, s>>>(a, n);
        return cudaGetLastError();
    }
    /* one lr-row per block */
    cudaError_t row_finish(const am_ck_args &a) {
        int64_t n = am_ck_threads(&a, AM_CK_ROW_FINISH);
        if (n > 0)
            am_k_row_finish<<<(unsigned)(n < kMaxBlocks ? n : kMaxBlocks), AM_CUDA_BLOCK, 0,
                              s>>>(a, n);
        return cudaGetLastError();
    }
    cudaError_t finish_flat(const am_ck_args &a) {
        int64_t n = am_ck_threads(&a, AM_CK_FINISH_FLAT);
        if (n > 0) am_k_finish_flat<<<counter_grid(n), AM_CUDA_BLOCK, 0, s>>>(a, n);
        return cudaGetLastError();
    }
};

/* The plan after AM_CK_INIT (am_cuda_launch.h); the first launch error, or
 * cudaSuccess. */
cudaError_t launch_plan(const am_ck_args &a, cudaStream_t s) {
    gpu_launcher l;
    l.s = s;
    return am_cuda_launch_plan(l, a);
}

/* With lazy module loading (the CUDA 12+ default) a kernel is loaded at its
 * first launch. Loading them all at the first update on each device keeps a
 * later CUDA-graph capture from being the first launch of, say, the other
 * finish path. Once per device (a module is loaded per device: only the
 * first device was preloaded before), tried again at the next call after a
 * failure; failures are left to the launches to report (each is checked). */
template <int ID> cudaError_t touch_elem() {
    cudaFuncAttributes fa;
    return cudaFuncGetAttributes(&fa, am_k_elem<ID>);
}

template <int ID> cudaError_t touch_lanes() {
    cudaFuncAttributes fa;
    return cudaFuncGetAttributes(&fa, am_k_lanes<ID>);
}

const int kMaxPreloadDevices = 256;

void preload_kernels() {
    static std::atomic<unsigned char> done[kMaxPreloadDevices];
    static std::mutex mu;
    int dev = -1;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxPreloadDevices) {
        (void)cudaGetLastError();
        return;
    }
    if (done[dev].load(std::memory_order_acquire)) return;
    std::lock_guard<std::mutex> lock(mu);
    if (done[dev].load(std::memory_order_relaxed)) return;
    cudaFuncAttributes fa;
    cudaError_t e = cudaSuccess, t;
#define AM_TOUCH(call) if ((t = (call)) != cudaSuccess) e = t
    AM_TOUCH(touch_elem<AM_CK_INIT>());
    AM_TOUCH(touch_lanes<AM_CK_LANES_G2>());
    AM_TOUCH(touch_elem<AM_CK_ROWS>());
    AM_TOUCH(touch_elem<AM_CK_COLS_RMEAN>());
    AM_TOUCH(touch_elem<AM_CK_COLS_FINAL>());
    AM_TOUCH(touch_elem<AM_CK_WSUM>());
    AM_TOUCH(touch_elem<AM_CK_WSUM_BLOCKS>());
    AM_TOUCH(touch_elem<AM_CK_WSUM_U2>());
    AM_TOUCH(touch_lanes<AM_CK_LANES_U2>());
    AM_TOUCH(touch_elem<AM_CK_TILE_U2>());
    AM_TOUCH(touch_lanes<AM_CK_LANES_FLAT>());
    AM_TOUCH(touch_elem<AM_CK_GROUP_U2>());
    AM_TOUCH(touch_elem<AM_CK_SUM_U2>());
    AM_TOUCH(touch_elem<AM_CK_DECIDE>());
    AM_TOUCH(touch_elem<AM_CK_BUMP>());
    AM_TOUCH(touch_elem<AM_CK_APPLY>());
    AM_TOUCH(touch_elem<AM_CK_COMMIT>());
    AM_TOUCH(touch_elem<AM_CK_REPORT>());
    AM_TOUCH(cudaFuncGetAttributes(&fa, am_k_count));
    AM_TOUCH(cudaFuncGetAttributes(&fa, am_k_agree));
    AM_TOUCH(cudaFuncGetAttributes(&fa, am_k_row_finish));
    AM_TOUCH(cudaFuncGetAttributes(&fa, am_k_finish_flat));
#undef AM_TOUCH
    (void)cudaGetLastError();
    if (e == cudaSuccess) done[dev].store(1, std::memory_order_release);
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
    /* Buffers that share memory, as am_update refuses them (addresses only:
     * device pointers are unique under unified addressing). Not looked at
     * until the fortieth session: the kernels raced on them (a review). */
    AM_CHECK(am_check_buffers(&g->sizes, param, grad, st));
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
    e = launch_elem<AM_CK_INIT>(a, s);
    if (e != cudaSuccess) return device_error(e, "am_update_cuda: first launch");
    e = launch_plan(a, s);
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
