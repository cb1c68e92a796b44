/*
 * test_cuda_simt.cpp — the CUDA update's kernels (src/cuda/kernels.cuh), as
 * written, run on the CPU: one thread per CUDA thread, the blocks of a
 * launch one after another, __syncthreads as a barrier, the warp intrinsics
 * (shuffles, ballot, match, reduce) as rendezvous of the lanes of their
 * mask, atomics under a lock; launched in am_cuda_launch.h's order, the one
 * update_cuda.cu launches. Compared bit for bit with am_update on the CPU:
 * parameter, lrs, polarity, moments, step, report.
 *
 * tests/c/test_cuda_emul.c checks the plan's per-thread bodies; this checks
 * the wrappers around them (the lane shuffle tree, the agreement kernel's
 * whole-block and per-warp paths, the fused row finish, the non-finite
 * count, the 1-D finish) without a GPU. Grids are capped at a few blocks so
 * that every grid-stride loop runs several times (argument 1: 3 unless
 * given), and run in order, reversed or odd blocks first (argument 2: CTest
 * runs all three). Built twice: for sm_90
 * (__reduce_add_sync) and for the sm_75 fallback of am_warp_add.
 * The elementwise kernels (am_k_elem: `if (t < n) body(t)`) run as plain
 * loops, as in test_cuda_emul.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <condition_variable>
#include <map>
#include <mutex>

extern "C" {
#include "cuda/am_cuda_plan.h"
#include "test_cuda_common.h"
}

/* ------------------------------------------- the CUDA model on threads -- */

struct simt_dim {
    unsigned x;
};
static thread_local simt_dim threadIdx, blockIdx;
static simt_dim blockDim, gridDim;

/* (each build leaves one stub unused: sm_90 has no __shfl_sync call, the
 * sm_75 fallback no __reduce_add_sync; clang warns about it) */
#define AM_SIMT_FN static inline __attribute__((unused))

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static /* one block runs at a time */

static pthread_barrier_t g_block_barrier;

AM_SIMT_FN void __syncthreads() { pthread_barrier_wait(&g_block_barrier); }

/* 1 when p holds on every thread of the block. t0 clears the count before
 * the first barrier; everyone has read it before the last, so the next
 * call's clearing cannot overtake a read. */
static int g_and_false;
static std::mutex g_and_mutex;
AM_SIMT_FN int __syncthreads_and(int p) {
    int r;
    if (threadIdx.x == 0) g_and_false = 0;
    __syncthreads();
    if (!p) {
        std::lock_guard<std::mutex> lock(g_and_mutex);
        g_and_false++;
    }
    __syncthreads();
    {
        std::lock_guard<std::mutex> lock(g_and_mutex);
        r = g_and_false == 0;
    }
    __syncthreads();
    return r;
}

/* One warp-collective call of the lanes of mask: each lane posts its value,
 * the last one to arrive completes it, every lane copies all values, the
 * last one to leave frees the slot (a later call with the same mask waits
 * for that). Calls with other masks (subgroups) proceed independently. */
struct collective {
    uint64_t v[32];
    unsigned arrived = 0, left = 0;
    bool complete = false;
};
struct warp_state {
    std::mutex m;
    std::condition_variable cv;
    std::map<unsigned, collective> open;
};
#define AM_SIMT_WARPS 8 /* AM_CUDA_BLOCK / 32, checked below */
static warp_state g_warps[AM_SIMT_WARPS];

static void exchange(unsigned mask, uint64_t mine, uint64_t all[32]) {
    const unsigned lane = threadIdx.x & 31, n = (unsigned)__builtin_popcount(mask);
    warp_state &w = g_warps[threadIdx.x >> 5];
    if (!((mask >> lane) & 1u)) {
        fprintf(stderr, "test_cuda_simt: lane %u calls a warp collective with mask %08x "
                        "that leaves it out (undefined on a GPU)\n", lane, mask);
        abort();
    }
    std::unique_lock<std::mutex> lock(w.m);
    w.cv.wait(lock, [&] {
        auto it = w.open.find(mask);
        return it == w.open.end() || !it->second.complete;
    });
    collective &c = w.open[mask];
    c.v[lane] = mine;
    if (++c.arrived == n) {
        c.complete = true;
        w.cv.notify_all();
    } else {
        w.cv.wait(lock, [&] { return c.complete; });
    }
    memcpy(all, c.v, sizeof c.v);
    if (++c.left == n) {
        w.open.erase(mask);
        w.cv.notify_all();
    }
}

static uint64_t shfl_down(unsigned mask, uint64_t v, unsigned d, int width) {
    uint64_t all[32];
    const unsigned lane = threadIdx.x & 31;
    exchange(mask, v, all);
    /* past the end of its width-segment a lane keeps its own value */
    return (lane % (unsigned)width) + d < (unsigned)width ? all[lane + d] : all[lane];
}
AM_SIMT_FN float __shfl_down_sync(unsigned mask, float v, unsigned d, int width = 32) {
    uint32_t b, r;
    float f;
    memcpy(&b, &v, 4);
    r = (uint32_t)shfl_down(mask, b, d, width);
    memcpy(&f, &r, 4);
    return f;
}
AM_SIMT_FN unsigned long long __shfl_down_sync(unsigned mask, unsigned long long v, unsigned d,
                                           int width = 32) {
    return shfl_down(mask, v, d, width);
}
AM_SIMT_FN unsigned __shfl_sync(unsigned mask, unsigned v, int src) {
    uint64_t all[32];
    exchange(mask, v, all);
    return (unsigned)all[src & 31];
}
AM_SIMT_FN unsigned __ballot_sync(unsigned mask, int p) {
    uint64_t all[32];
    unsigned r = 0;
    exchange(mask, p != 0, all);
    for (int l = 0; l < 32; l++)
        if (((mask >> l) & 1u) && all[l]) r |= 1u << l;
    return r;
}
AM_SIMT_FN unsigned __match_any_sync(unsigned mask, unsigned long long key) {
    uint64_t all[32];
    unsigned r = 0;
    exchange(mask, key, all);
    for (int l = 0; l < 32; l++)
        if (((mask >> l) & 1u) && all[l] == key) r |= 1u << l;
    return r;
}
AM_SIMT_FN unsigned __reduce_add_sync(unsigned mask, unsigned v) {
    uint64_t all[32];
    unsigned s = 0;
    exchange(mask, v, all);
    for (int l = 0; l < 32; l++)
        if ((mask >> l) & 1u) s += (unsigned)all[l];
    return s;
}
AM_SIMT_FN int __ffs(unsigned x) { return __builtin_ffs((int)x); }
AM_SIMT_FN int __popc(unsigned x) { return __builtin_popcount(x); }

static std::mutex g_atomic_mutex;
AM_SIMT_FN unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) {
    std::lock_guard<std::mutex> lock(g_atomic_mutex);
    const unsigned long long old = *p;
    *p = old + v;
    return old;
}

/* (only kernels.cuh sees the architecture: am_cuda_plan.h's unroll pragma
 * is for nvcc) */
#define __CUDA_ARCH__ AM_SIMT_ARCH
#include "cuda/kernels.cuh"
#undef __CUDA_ARCH__
#include "cuda/am_cuda_launch.h"
static_assert(AM_CUDA_BLOCK / 32 == AM_SIMT_WARPS, "one warp_state per warp");

/* ---------------------------------------------------------- launches ---- */

typedef void (*kernel_fn)(const am_ck_args, int64_t);

/* AM_CUDA_BLOCK workers, one per CUDA thread of a block, kept for every
 * launch (creating them per block was most of the run time): the main
 * thread sets the block's job, and each worker runs it between the start
 * and done barriers. */
static pthread_t g_workers[AM_CUDA_BLOCK];
static pthread_barrier_t g_start, g_done;
static struct {
    kernel_fn f;
    const am_ck_args *a;
    int64_t n;
    unsigned block;
    int quit;
} g_job;

static void *simt_worker(void *p) {
    threadIdx.x = (unsigned)(uintptr_t)p;
    for (;;) {
        pthread_barrier_wait(&g_start);
        if (g_job.quit) return NULL;
        blockIdx.x = g_job.block;
        g_job.f(*g_job.a, g_job.n);
        pthread_barrier_wait(&g_done);
    }
}

static void pool_start(void) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 << 10);
    pthread_barrier_init(&g_block_barrier, NULL, AM_CUDA_BLOCK);
    pthread_barrier_init(&g_start, NULL, AM_CUDA_BLOCK + 1);
    pthread_barrier_init(&g_done, NULL, AM_CUDA_BLOCK + 1);
    for (unsigned t = 0; t < AM_CUDA_BLOCK; t++)
        if (pthread_create(&g_workers[t], &attr, simt_worker, (void *)(uintptr_t)t) != 0) {
            fprintf(stderr, "test_cuda_simt: pthread_create failed\n");
            abort();
        }
    pthread_attr_destroy(&attr);
}

static void pool_stop(void) {
    g_job.quit = 1;
    pthread_barrier_wait(&g_start);
    for (unsigned t = 0; t < AM_CUDA_BLOCK; t++) pthread_join(g_workers[t], NULL);
    pthread_barrier_destroy(&g_start);
    pthread_barrier_destroy(&g_done);
    pthread_barrier_destroy(&g_block_barrier);
}

static unsigned g_max_blocks = 3;

/* The order the blocks of a launch (and the threads of an elementwise
 * kernel) run in: 0 in order, 1 reversed, 2 odd blocks first. A GPU runs
 * them in any order and at once: a block that read another's writes of
 * the same launch would give other bits in another order. */
static int g_order = 0;

static unsigned block_at(unsigned i, unsigned grid) {
    if (g_order == 1) return grid - 1 - i;
    if (g_order == 2) return i < grid / 2 ? 2 * i + 1 : 2 * (i - grid / 2);
    return i;
}

/* The blocks of one launch, one after another. */
static int launch(kernel_fn f, unsigned grid, const am_ck_args &a, int64_t n) {
    if (n <= 0) return 0;
    if (grid > g_max_blocks) grid = g_max_blocks;
    blockDim.x = AM_CUDA_BLOCK;
    gridDim.x = grid;
    for (unsigned i = 0; i < grid; i++) {
        const unsigned b = block_at(i, grid);
        g_job.f = f;
        g_job.a = &a;
        g_job.n = n;
        g_job.block = b;
        pthread_barrier_wait(&g_start);
        pthread_barrier_wait(&g_done);
    }
    return 0;
}

static unsigned blocks_for(int64_t n) { return (unsigned)((n + AM_CUDA_BLOCK - 1) / AM_CUDA_BLOCK); }

/* am_cuda_launch.h's launcher on CPU threads; launches cannot fail. */
struct simt_launcher {
    typedef int error;
    static int ok() { return 0; }
    template <int ID>
    int elem(const am_ck_args &a) {
        const int64_t n = am_ck_threads(&a, ID);
        if (g_order != 0)
            for (int64_t t = n - 1; t >= 0; t--) am_ck_elem(&a, ID, t);
        else
            for (int64_t t = 0; t < n; t++) am_ck_elem(&a, ID, t);
        return 0;
    }
    template <int ID>
    int lanes(const am_ck_args &a) {
        const int64_t n = am_ck_threads(&a, ID);
        return launch(am_k_lanes<ID>, blocks_for(n), a, n);
    }
    int count(const am_ck_args &a, int id) {
        const int64_t n = am_ck_threads(&a, id);
        return launch(am_k_count, blocks_for(n), a, n);
    }
    int agree(const am_ck_args &a) {
        const int64_t n = am_ck_threads(&a, AM_CK_AGREE);
        return launch(am_k_agree, blocks_for(n), a, n);
    }
    int row_finish(const am_ck_args &a) {
        const int64_t n = am_ck_threads(&a, AM_CK_ROW_FINISH);
        return launch(am_k_row_finish, n < g_max_blocks ? (unsigned)n : g_max_blocks, a, n);
    }
    int finish_flat(const am_ck_args &a) {
        const int64_t n = am_ck_threads(&a, AM_CK_FINISH_FLAT);
        return launch(am_k_finish_flat, blocks_for(n), a, n);
    }
};

/* ----------------------------------------------------------- the test --- */

/* steps updates of a parameter of this shape and dtypes through am_update
 * and through the kernels; a NaN gradient element at nan_at in step 1
 * (nan_at >= 0). Returns the number of steps that differed. */
static int run(int ndim, const int64_t *dims, am_dtype pdt, am_dtype gdt, int steps,
               int64_t nan_at) {
    am_shape sh;
    am_state_sizes z;
    am_geom geo;
    size_t cuda_ws, es, gs;
    am_tensor pc, pe, g;
    am_state sc, se;
    am_hparams hp = am_hparams_default();
    am_rng_key key = {77, 5};
    void *wsc, *wse;
    int bad = 0, d, s;
    memset(&sh, 0, sizeof sh);
    sh.ndim = ndim;
    for (d = 0; d < ndim; d++) sh.dims[d] = dims[d];
    if (am_state_get_sizes(&sh, &z) != AM_OK || am_cuda_workspace_bytes(&sh, &cuda_ws) != AM_OK ||
        am_geom_init(&sh, &geo) != AM_OK) {
        fprintf(stderr, "test_cuda_simt: sizes refused\n");
        return 1;
    }
    es = am_dtype_size(pdt);
    gs = am_dtype_size(gdt);
    memset(&pc, 0, sizeof pc);
    pc.dtype = pdt;
    pc.shape = sh;
    pe = pc;
    g = pc;
    g.dtype = gdt;
    pc.data = calloc((size_t)z.numel, es);
    pe.data = calloc((size_t)z.numel, es);
    g.data = calloc((size_t)z.numel, gs);
    for (int64_t i = 0; i < z.numel; i++) store(pc.data, pdt, i, rng_val(0.5f));
    memcpy(pe.data, pc.data, (size_t)z.numel * es);
    am_state *both[2] = {&sc, &se};
    for (am_state *st : both) {
        memset(st, 0, sizeof *st);
        st->lr = (float *)calloc((size_t)z.lr_count, 4);
        st->polarity = (uint8_t *)calloc((size_t)z.polarity_bytes + 1, 1);
        st->row = z.row_count ? (float *)calloc((size_t)z.row_count, 4) : NULL;
        st->col = z.col_count ? (float *)calloc((size_t)z.col_count, 4) : NULL;
        st->sq = z.sq_count ? (float *)calloc((size_t)z.sq_count, 4) : NULL;
        am_state_init(&sh, st, 1e-3);
    }
    for (int64_t i = 0; i < z.polarity_bytes; i++) sc.polarity[i] = se.polarity[i] = (uint8_t)rng_u32();
    wsc = calloc((size_t)z.workspace_bytes, 1);
    wse = calloc(cuda_ws + AM_CUDA_ALIGN, 1);
    hp.weight_decay = 0.1;
    for (s = 0; s < steps; s++) {
        am_report rc, re;
        am_ck_args a;
        simt_launcher l;
        int64_t step = se.step;
        unsigned char *base =
            (unsigned char *)(((uintptr_t)wse + (AM_CUDA_ALIGN - 1)) & ~(uintptr_t)(AM_CUDA_ALIGN - 1));
        const char *what = NULL;
        am_status st;
        /* small gradients, then large ones: lrs move both ways */
        for (int64_t i = 0; i < z.numel; i++) store(g.data, gdt, i, rng_val((s & 1) ? 3.0f : 1e-3f));
        if (nan_at >= 0 && s == 1) store(g.data, gdt, nan_at, NAN);
        st = am_update(&pc, &g, &sc, &hp, key, wsc, (size_t)z.workspace_bytes, &rc);
        memset(&re, 0x5a, sizeof re);
        am_ck_args_init(&a, &geo, &pe, &g, &se, &step, &hp, key, base, &re);
        l.elem<AM_CK_INIT>(a);
        am_cuda_launch_plan(l, a);
        se.step = step;
        if (re.status != st) what = "status";
        else if (step != sc.step) what = "step";
        else if (memcmp(pc.data, pe.data, (size_t)z.numel * es)) what = "parameter";
        else if (memcmp(sc.lr, se.lr, (size_t)z.lr_count * 4)) what = "lr";
        else if (memcmp(sc.polarity, se.polarity, (size_t)z.polarity_bytes)) what = "polarity";
        else if (z.row_count && (memcmp(sc.row, se.row, (size_t)z.row_count * 4) ||
                                 memcmp(sc.col, se.col, (size_t)z.col_count * 4)))
            what = "row/col moments";
        else if (z.sq_count && memcmp(sc.sq, se.sq, (size_t)z.sq_count * 4)) what = "sq";
        else if (re.nonfinite_count != rc.nonfinite_count) what = "nonfinite_count";
        else if (memcmp(&re.clip_scale, &rc.clip_scale, sizeof(float))) what = "clip_scale";
        /* a factored parameter's mean agreement is total matches / numel on
         * the GPU, within 1e-6 of the CPU's mean over lr-rows (docs/CUDA.md) */
        else if (ndim < 2 ? memcmp(&re.mean_agreement, &rc.mean_agreement, sizeof(float)) != 0
                          : !(re.mean_agreement >= rc.mean_agreement - 1e-6f &&
                              re.mean_agreement <= rc.mean_agreement + 1e-6f))
            what = "mean_agreement";
        if (what) {
            printf("  differs: ndim %d dims[0] %lld dims[-1] %lld, dtypes %d/%d, step %d: %s\n",
                   ndim, (long long)dims[0], (long long)dims[ndim - 1], (int)pdt, (int)gdt, s,
                   what);
            bad++;
        }
    }
    free(pc.data);
    free(pe.data);
    free(g.data);
    for (am_state *st : both) {
        free(st->lr);
        free(st->polarity);
        free(st->row);
        free(st->col);
        free(st->sq);
    }
    free(wsc);
    free(wse);
    return bad;
}

int main(int argc, char **argv) {
    static const am_dtype F32 = AM_DTYPE_FLOAT32, BF16 = AM_DTYPE_BFLOAT16,
                          F16 = AM_DTYPE_FLOAT16;
    static const struct {
        int ndim;
        int64_t dims[4];
        am_dtype p, g;
        int steps;
        int64_t nan_at;
        const char *why;
    } cases[] = {
        {2, {3, 700}, BF16, F32, 3, 17, "row finish, grid-stride over lr-rows; a NaN"},
        {2, {40, 33}, F16, F16, 3, -1, "agreement: blocks over several lr-rows (per warp)"},
        {2, {2, 9000}, F32, BF16, 2, -1, "agreement: whole blocks in one lr-row"},
        {1, {3000}, BF16, F32, 3, 5, "1-D finish and count"},
        {2, {1, 600}, F16, F32, 2, -1, "one row"},
        {3, {3, 5, 130}, F32, F32, 3, 100, "3-D; the factored count"},
        {2, {300, 5}, BF16, BF16, 3, -1, "lr-rows of 5 across warps"},
        {2, {1, 70000}, BF16, BF16, 2, 69999, "a long row; NaN at the end"},
        {2, {17, 9001}, F16, F32, 2, -1, "odd sizes"},
        {4, {5, 3, 3, 3}, F32, F16, 3, -1, "3x3 convolution"},
        {2, {1000, 3}, BF16, F32, 3, 2999, "narrow; NaN in the last element"},
        /* lr-rows not a multiple of 4 or 8 in the fused row finish: a quad,
         * and a block of rounding noise, shared by two lr-rows */
        {2, {5, 513}, F16, F32, 3, -1, "fused row finish, rows of 513, float16"},
        {2, {4, 1501}, BF16, BF16, 3, -1, "fused row finish, rows of 1501, bfloat16"},
        {3, {2, 7, 111}, F16, F16, 3, -1, "fused 3-D, lr-rows of 777, float16"},
        {2, {7, 13}, F16, BF16, 3, -1, "per-warp agreement, rows of 13, float16"},
        {2, {3, 8195}, BF16, F32, 2, -1, "unfused rows of 8195, bfloat16"},
        {1, {16389}, F16, F16, 3, -1, "1-D, two tiles and an odd tail, float16"},
    };
    int bad = 0;
    size_t i;
    g_rng = 12345;
    if (argc > 1) g_max_blocks = (unsigned)atoi(argv[1]);
    if (argc > 2) g_order = atoi(argv[2]);
    if (g_max_blocks < 1 || g_order < 0 || g_order > 2) {
        fprintf(stderr, "usage: test_cuda_simt [max blocks >= 1 [order: 0 in order, 1 "
                        "reversed, 2 odd blocks first]]\n");
        return 2;
    }
    pool_start();
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const int b = run(cases[i].ndim, cases[i].dims, cases[i].p, cases[i].g, cases[i].steps,
                          cases[i].nan_at);
        printf("%s: %s (%s, %u blocks, order %d)\n", b ? "DIFFERS" : "same", cases[i].why,
               AM_SIMT_ARCH >= 800 ? "sm_80+" : "sm_75", g_max_blocks, g_order);
        bad += b;
    }
    pool_stop();
    printf(bad ? "test_cuda_simt: %d steps differ\n" : "test_cuda_simt: all the same\n", bad);
    return bad ? 1 : 0;
}
