/*
 * am_cuda_launch.h — the CUDA update's launch sequence after AM_CK_INIT, in
 * the order of the AM_CK_* ids, over a launcher L (C++). update_cuda.cu's
 * launcher starts the kernels of kernels.cuh on a stream;
 * tests/c/test_cuda_simt.cpp's runs the same kernels.cuh code on CPU
 * threads, one per CUDA thread, so that the wrappers (shuffles, votes,
 * barriers, atomics) are checked without a GPU, in this very order.
 *
 * L provides, each returning L::error (L::ok() when the launch went well):
 *   template <int ID> elem(a)   am_k_elem<ID>
 *   template <int ID> lanes(a)  am_k_lanes<ID>
 *   count(a, id)                am_k_count for AM_CK_COUNT_FAC/_FLAT
 *   agree(a), row_finish(a), finish_flat(a)
 * A launcher skips a kernel whose thread count (am_ck_threads) is 0.
 */
#ifndef AM_CUDA_LAUNCH_H
#define AM_CUDA_LAUNCH_H

/* The first failed launch's error, or L::ok(): the plan stops there (see
 * update_cuda.cu, launch_plan). */
template <class L>
typename L::error am_cuda_launch_plan(L &l, const am_ck_args &a) {
    typename L::error e;
#define AM_CUDA_STEP(call)                                                    \
    do {                                                                      \
        e = (call);                                                           \
        if (e != L::ok()) return e;                                           \
    } while (0)
    AM_CUDA_STEP(l.template lanes<AM_CK_LANES_G2>(a));
    AM_CUDA_STEP(l.template elem<AM_CK_ROWS>(a));
    AM_CUDA_STEP(l.count(a, AM_CK_COUNT_FAC));
    AM_CUDA_STEP(l.template elem<AM_CK_COLS_RMEAN>(a));
    AM_CUDA_STEP(l.template elem<AM_CK_COLS_FINAL>(a));
    AM_CUDA_STEP(l.template elem<AM_CK_WSUM>(a));
    AM_CUDA_STEP(l.template elem<AM_CK_WSUM_BLOCKS>(a));
    AM_CUDA_STEP(l.template elem<AM_CK_WSUM_U2>(a));
    AM_CUDA_STEP(l.template lanes<AM_CK_LANES_U2>(a));
    AM_CUDA_STEP(l.template elem<AM_CK_TILE_U2>(a));
    AM_CUDA_STEP(l.template lanes<AM_CK_LANES_FLAT>(a));
    AM_CUDA_STEP(l.template elem<AM_CK_GROUP_U2>(a));
    AM_CUDA_STEP(l.template elem<AM_CK_SUM_U2>(a));
    AM_CUDA_STEP(l.count(a, AM_CK_COUNT_FLAT));
    AM_CUDA_STEP(l.template elem<AM_CK_DECIDE>(a));
    AM_CUDA_STEP(l.agree(a));
    AM_CUDA_STEP(l.template elem<AM_CK_BUMP>(a));
    AM_CUDA_STEP(l.template elem<AM_CK_APPLY>(a));
    AM_CUDA_STEP(l.row_finish(a));
    AM_CUDA_STEP(l.template elem<AM_CK_COMMIT>(a));
    AM_CUDA_STEP(l.finish_flat(a));
#undef AM_CUDA_STEP
    return l.template elem<AM_CK_REPORT>(a);
}

#endif /* AM_CUDA_LAUNCH_H */
