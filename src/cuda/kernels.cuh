/*
 * kernels.cuh — the __global__ wrappers around the per-thread bodies of
 * am_cuda_plan.h. Each is a grid-stride loop whose trip count is uniform per
 * block (t0 steps by whole blocks), so warp-wide shuffles and votes inside it
 * always see the full warp. Indices are 64-bit throughout.
 *
 * Only integer atomics are used (polarity matches, non-finite counts), so the
 * results do not depend on the launch geometry or the scheduling.
 */
#ifndef AM_CUDA_KERNELS_CUH
#define AM_CUDA_KERNELS_CUH

#define AM_CUDA_BLOCK 256
#define AM_FULL_MASK 0xffffffffu

#define AM_GRID_LOOP(n)                                                       \
    for (int64_t t0 = (int64_t)blockIdx.x * blockDim.x; t0 < (n);             \
         t0 += (int64_t)gridDim.x * blockDim.x)

/* Lane sums: 8 consecutive threads are the 8 lanes of one (row, block)
 * pair; the shuffle tree adds lanes (l, l+4), then (l, l+2), then (l, l+1),
 * which is am_lanesum_finish: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)). */
template <int ID>
__global__ void __launch_bounds__(AM_CUDA_BLOCK)
am_k_lanes(const am_ck_args a, int64_t n) {
    AM_GRID_LOOP(n) {
        int64_t t = t0 + threadIdx.x;
        float s = t < n ? am_ck_lane(&a, ID, t) : 0.0f;
        s += __shfl_down_sync(AM_FULL_MASK, s, 4, 8);
        s += __shfl_down_sync(AM_FULL_MASK, s, 2, 8);
        s += __shfl_down_sync(AM_FULL_MASK, s, 1, 8);
        if (t < n && (t & 7) == 0) am_ck_lane_store(&a, ID, t >> 3, s);
    }
}

template <int ID>
__global__ void __launch_bounds__(AM_CUDA_BLOCK)
am_k_elem(const am_ck_args a, int64_t n) {
    AM_GRID_LOOP(n) {
        int64_t t = t0 + threadIdx.x;
        if (t < n) am_ck_elem(&a, ID, t);
    }
}

/* Rare path: only runs past its first load when a row sum (factored) or the
 * u*u sum (unfactored) was not finite. */
__global__ void __launch_bounds__(AM_CUDA_BLOCK)
am_k_count(const am_ck_args a, int64_t n) {
    if (!a.h->flag) return;
    AM_GRID_LOOP(n) {
        int64_t t = t0 + threadIdx.x;
        if (t < n && am_ck_nonfinite(&a, t)) atomicAdd(&a.h->nonfinite, 1ull);
    }
}

/* Sums v over the threads of mask that share the same key, one atomicAdd per
 * group (lanes of one warp usually cover one lr-row). */
__device__ __forceinline__ void am_warp_add(unsigned mask,
                                            unsigned long long *dst,
                                            unsigned long long key,
                                            unsigned v) {
    unsigned grp = __match_any_sync(mask, key);
    unsigned sum = __reduce_add_sync(grp, v);
    if ((threadIdx.x & 31) == (unsigned)(__ffs(grp) - 1) && sum)
        atomicAdd(dst, (unsigned long long)sum);
}

__global__ void __launch_bounds__(AM_CUDA_BLOCK)
am_k_agree(const am_ck_args a, int64_t n) {
    if (a.h->status != AM_OK) return;
    AM_GRID_LOOP(n) {
        int64_t t = t0 + threadIdx.x;
        unsigned mask = __ballot_sync(AM_FULL_MASK, t < n);
        if (t < n) {
            int64_t kr = 0;
            unsigned m = am_ck_agree(&a, t, &kr);
            am_warp_add(mask, &a.row_matches[kr], (unsigned long long)kr, m);
            am_warp_add(mask, &a.h->matches, 0ull, m);
        }
    }
}

__global__ void __launch_bounds__(AM_CUDA_BLOCK)
am_k_finish_flat(const am_ck_args a, int64_t n) {
    if (a.h->status != AM_OK) return;
    AM_GRID_LOOP(n) {
        int64_t t = t0 + threadIdx.x;
        unsigned mask = __ballot_sync(AM_FULL_MASK, t < n);
        if (t < n) {
            unsigned m = am_ck_finish_flat(&a, t);
            am_warp_add(mask, &a.h->matches, 0ull, m);
        }
    }
}

#endif /* AM_CUDA_KERNELS_CUH */
