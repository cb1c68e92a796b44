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
 * u*u sum (unfactored) was not finite. One atomic per warp (the warp's
 * count of non-finite elements; an all-NaN gradient took one per element
 * on one address before). */
__global__ void __launch_bounds__(AM_CUDA_BLOCK)
am_k_count(const am_ck_args a, int64_t n) {
    if (!a.h->flag) return;
    AM_GRID_LOOP(n) {
        int64_t t = t0 + threadIdx.x;
        const unsigned bad = __ballot_sync(AM_FULL_MASK, t < n && am_ck_nonfinite(&a, t));
        if ((threadIdx.x & 31) == 0 && bad)
            atomicAdd(&a.h->nonfinite, (unsigned long long)__popc(bad));
    }
}

/* Sums v over the threads of mask that share the same key, one atomicAdd per
 * group (used when a block's threads cover several lr-rows). */
__device__ __forceinline__ void am_warp_add(unsigned mask,
                                            unsigned long long *dst,
                                            unsigned long long key,
                                            unsigned v) {
    unsigned grp = __match_any_sync(mask, key);
#if __CUDA_ARCH__ >= 800
    unsigned sum = __reduce_add_sync(grp, v);
#else
    /* sm_75 (T4, RTX 20xx) has no __reduce_add_sync: every lane of mask
     * reads every lane's v and adds those of its group (integers: the same
     * sum in any order) */
    unsigned sum = 0;
    int l;
    for (l = 0; l < 32; l++) {
        const unsigned x = __shfl_sync(mask, v, l);
        if ((grp >> l) & 1u) sum += x;
    }
#endif
    if ((threadIdx.x & 31) == (unsigned)(__ffs(grp) - 1) && sum)
        atomicAdd(dst, (unsigned long long)sum);
}

/* Sum of v over the block, valid in thread 0. Every thread must call it. */
__device__ __forceinline__ unsigned long long am_block_sum(unsigned long long v) {
    __shared__ unsigned long long part[AM_CUDA_BLOCK / 32];
    unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5, i;
    unsigned long long s = 0;
    for (i = 16; i > 0; i >>= 1) v += __shfl_down_sync(AM_FULL_MASK, v, i);
    __syncthreads(); /* part[] free from a previous call */
    if (lane == 0) part[w] = v;
    __syncthreads();
    if (threadIdx.x == 0)
        for (i = 0; i < blockDim.x / 32; i++) s += part[i];
    return s;
}

/* Blocks for the kernels with a per-block counter: enough to fill an H200
 * (132 SMs x 8 blocks of 256) while keeping same-address atomics few. */
#define AM_COUNTER_BLOCKS 2048

/* Polarity bytes: matches per lr-row and in total. When the whole block
 * covers one lr-row (the common case for long rows, and the only case of a
 * 1 x N parameter) it is reduced in the block: one atomic per block per
 * counter; otherwise warp groups of equal lr-row add their sums. */
__global__ void __launch_bounds__(AM_CUDA_BLOCK)
am_k_agree(const am_ck_args a, int64_t n) {
    __shared__ int64_t kr0;
    unsigned long long total = 0;
    if (a.h->status != AM_OK) return;
    AM_GRID_LOOP(n) {
        int64_t t = t0 + threadIdx.x, kr = -1;
        unsigned m = 0;
        int valid = t < n, uniform;
        if (valid) m = am_ck_agree(&a, t, &kr);
        total += m;
        if (threadIdx.x == 0) kr0 = kr; /* t0 < n: thread 0 is valid */
        __syncthreads();
        uniform = __syncthreads_and(!valid || kr == kr0);
        if (uniform) {
            unsigned long long s = am_block_sum(m);
            if (threadIdx.x == 0 && s) atomicAdd(&a.row_matches[kr0], s);
        } else {
            unsigned mask = __ballot_sync(AM_FULL_MASK, valid);
            if (valid) am_warp_add(mask, &a.row_matches[kr], (unsigned long long)kr, m);
        }
        __syncthreads(); /* kr0 is rewritten next iteration */
    }
    total = am_block_sum(total);
    if (threadIdx.x == 0 && total) atomicAdd(&a.h->matches, total);
}

/* One lr-row per block (grid-stride over lr-rows): the agreement of the row
 * (block sum of matches), its lr bump by thread 0, then its quads. */
__global__ void __launch_bounds__(AM_CUDA_BLOCK)
am_k_row_finish(const am_ck_args a, int64_t n) {
    unsigned long long total = 0;
    if (a.h->status != AM_OK) return;
    for (int64_t kr = blockIdx.x; kr < n; kr += gridDim.x) {
        const int64_t b0 = kr * a.pol_row_bytes, b1 = b0 + a.pol_row_bytes;
        const int64_t lo = kr * a.m, hi = lo + a.m;
        unsigned long long mt = 0, s;
        int64_t t, dummy;
        for (t = b0 + threadIdx.x; t < b1; t += blockDim.x) mt += am_ck_agree(&a, t, &dummy);
        s = am_block_sum(mt);
        if (threadIdx.x == 0) {
            total += s;
            am_ck_bump(&a, kr, s);
        }
        __syncthreads(); /* the bumped lr[kr] is visible to the block */
        for (t = lo / 4 + threadIdx.x; 4 * t < hi; t += blockDim.x)
            am_ck_apply_range(&a, t, lo, hi);
    }
    if (threadIdx.x == 0 && total) atomicAdd(&a.h->matches, total);
}

__global__ void __launch_bounds__(AM_CUDA_BLOCK)
am_k_finish_flat(const am_ck_args a, int64_t n) {
    unsigned long long total = 0;
    if (a.h->status != AM_OK) return;
    AM_GRID_LOOP(n) {
        int64_t t = t0 + threadIdx.x;
        if (t < n) total += am_ck_finish_flat(&a, t);
    }
    total = am_block_sum(total);
    if (threadIdx.x == 0 && total) atomicAdd(&a.h->matches, total);
}

#endif /* AM_CUDA_KERNELS_CUH */
