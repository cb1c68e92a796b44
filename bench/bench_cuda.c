/*
 * bench_cuda.c — GPU benchmark of am_update_cuda, as ratios measured in the
 * same run: achieved bandwidth of one update against the device's measured
 * device-to-device copy bandwidth.
 *
 * Traffic counted per update ("3-pass bytes"): the update needs the whole
 * gradient three times (row/col statistics, then the sum of u*u, then the
 * apply, each needing the previous pass's result), the parameter read and
 * written, the polarity bits read and written, and for unfactored parameters
 * sq and lr read and written. Row/col state is O(rows + cols), ignored.
 *
 * Usage: bench_cuda [--quick]   Output: one JSON object per line on stdout
 * (scripts/gpu_check.sh collects them), a table on stderr.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

#include "automagic.h"

#define CU(call)                                                              \
    do {                                                                      \
        cudaError_t e_ = (call);                                              \
        if (e_ != cudaSuccess) {                                              \
            fprintf(stderr, "bench_cuda: %s: %s\n", #call,                    \
                    cudaGetErrorString(e_));                                  \
            exit(1);                                                          \
        }                                                                     \
    } while (0)

static uint64_t g_rng = 12345;

static uint32_t rng_u32(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(g_rng >> 33);
}

/* Random float32 or bfloat16 data (high half of a float32) on the device. */
static void *dev_random(int64_t n, am_dtype dt, float scale) {
    size_t es = am_dtype_size(dt);
    void *h = malloc((size_t)n * es), *d = NULL;
    int64_t i;
    if (!h) { fprintf(stderr, "bench_cuda: out of host memory\n"); exit(1); }
    for (i = 0; i < n; i++) {
        float v = ((float)(rng_u32() & 0xffffff) / 16777216.0f - 0.5f) * scale;
        if (dt == AM_DTYPE_FLOAT32) ((float *)h)[i] = v;
        else { uint32_t u; memcpy(&u, &v, 4); ((uint16_t *)h)[i] = (uint16_t)(u >> 16); }
    }
    CU(cudaMalloc(&d, (size_t)n * es));
    CU(cudaMemcpy(d, h, (size_t)n * es, cudaMemcpyHostToDevice));
    free(h);
    return d;
}

static double copy_bandwidth(size_t bytes, int iters) {
    void *a, *b;
    cudaEvent_t e0, e1;
    float ms;
    int i;
    CU(cudaMalloc(&a, bytes));
    CU(cudaMalloc(&b, bytes));
    CU(cudaMemset(a, 1, bytes));
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    CU(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
    CU(cudaEventRecord(e0, 0));
    for (i = 0; i < iters; i++) CU(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
    CU(cudaEventRecord(e1, 0));
    CU(cudaEventSynchronize(e1));
    CU(cudaEventElapsedTime(&ms, e0, e1));
    CU(cudaFree(a));
    CU(cudaFree(b));
    return 2.0 * (double)bytes * iters / (ms * 1e-3); /* read + write */
}

typedef struct bcase { const char *name; int ndim; int64_t dims[4]; am_dtype dt; } bcase;

static void run(const bcase *c, double copy_bw, int iters) {
    am_shape s;
    am_state_sizes z;
    am_state st;
    am_tensor p, g;
    am_hparams hp = am_hparams_default();
    am_rng_key key = {1, 0};
    size_t wsb;
    void *ws;
    int64_t *step;
    am_report *rep, hrep;
    cudaStream_t str;
    cudaEvent_t e0, e1;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    float ms_eager, ms_graph;
    double bytes, es;
    int i, d;
    float *lr_h;

    memset(&s, 0, sizeof s);
    s.ndim = c->ndim;
    for (d = 0; d < c->ndim; d++) s.dims[d] = c->dims[d];
    if (am_state_get_sizes(&s, &z) != AM_OK || am_cuda_workspace_bytes(&s, &wsb) != AM_OK) {
        fprintf(stderr, "bench_cuda: bad shape\n");
        exit(1);
    }
    es = (double)am_dtype_size(c->dt);
    p.dtype = g.dtype = c->dt;
    p.shape = g.shape = s;
    p.data = dev_random(z.numel, c->dt, 1.0f);
    g.data = dev_random(z.numel, c->dt, 0.01f);
    memset(&st, 0, sizeof st);
    lr_h = malloc((size_t)z.lr_count * 4);
    for (i = 0; i < z.lr_count; i++) lr_h[i] = 1e-4f;
    CU(cudaMalloc((void **)&st.lr, (size_t)z.lr_count * 4));
    CU(cudaMemcpy(st.lr, lr_h, (size_t)z.lr_count * 4, cudaMemcpyHostToDevice));
    free(lr_h);
    CU(cudaMalloc((void **)&st.polarity, (size_t)z.polarity_bytes));
    CU(cudaMemset(st.polarity, 0, (size_t)z.polarity_bytes));
    if (z.row_count) {
        CU(cudaMalloc((void **)&st.row, (size_t)z.row_count * 4));
        CU(cudaMalloc((void **)&st.col, (size_t)z.col_count * 4));
        CU(cudaMemset(st.row, 0, (size_t)z.row_count * 4));
        CU(cudaMemset(st.col, 0, (size_t)z.col_count * 4));
    } else {
        CU(cudaMalloc((void **)&st.sq, (size_t)z.sq_count * 4));
        CU(cudaMemset(st.sq, 0, (size_t)z.sq_count * 4));
    }
    CU(cudaMalloc((void **)&step, 8));
    CU(cudaMemset(step, 0, 8));
    CU(cudaMalloc((void **)&rep, sizeof *rep));
    CU(cudaMalloc(&ws, wsb));
    CU(cudaStreamCreate(&str));
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));

#define STEP() am_update_cuda(&p, &g, &st, step, &hp, key, ws, wsb, (void *)str, rep)
    for (i = 0; i < 3; i++)
        if (STEP() != AM_OK) { fprintf(stderr, "bench_cuda: update failed\n"); exit(1); }
    CU(cudaEventRecord(e0, str));
    for (i = 0; i < iters; i++) (void)STEP();
    CU(cudaEventRecord(e1, str));
    CU(cudaEventSynchronize(e1));
    CU(cudaEventElapsedTime(&ms_eager, e0, e1));
    CU(cudaStreamBeginCapture(str, cudaStreamCaptureModeGlobal));
    (void)STEP();
    CU(cudaStreamEndCapture(str, &graph));
    CU(cudaGraphInstantiate(&exec, graph, 0));
    CU(cudaGraphLaunch(exec, str));
    CU(cudaEventRecord(e0, str));
    for (i = 0; i < iters; i++) CU(cudaGraphLaunch(exec, str));
    CU(cudaEventRecord(e1, str));
    CU(cudaEventSynchronize(e1));
    CU(cudaEventElapsedTime(&ms_graph, e0, e1));
    CU(cudaMemcpy(&hrep, rep, sizeof hrep, cudaMemcpyDeviceToHost));
#undef STEP
    ms_eager /= (float)iters;
    ms_graph /= (float)iters;
    bytes = (double)z.numel * (3.0 * es + 2.0 * es) + 2.0 * (double)z.polarity_bytes;
    if (z.sq_count) bytes += 16.0 * (double)z.numel; /* sq and lr, read + write */
    {
        double bw = bytes / (ms_graph * 1e-3);
        fprintf(stderr, "%-22s %-8s %10.3f ms eager %10.3f ms graph  %7.1f GB/s  %5.1f%% of copy bw  (status %d)\n",
                c->name, am_dtype_name(c->dt), ms_eager, ms_graph, bw / 1e9,
                100.0 * bw / copy_bw, (int)hrep.status);
        printf("{\"case\": \"%s\", \"dtype\": \"%s\", \"numel\": %lld, \"ms_eager\": %.5f, "
               "\"ms_graph\": %.5f, \"bytes_3pass\": %.0f, \"gbps_graph\": %.2f, "
               "\"copy_gbps\": %.2f, \"fraction_of_copy_bw\": %.4f, \"status\": %d}\n",
               c->name, am_dtype_name(c->dt), (long long)z.numel, ms_eager, ms_graph,
               bytes, bw / 1e9, copy_bw / 1e9, bw / copy_bw, (int)hrep.status);
        fflush(stdout);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaFree(p.data); cudaFree(g.data); cudaFree(st.lr); cudaFree(st.polarity);
    cudaFree(st.row); cudaFree(st.col); cudaFree(st.sq); cudaFree(step);
    cudaFree(rep); cudaFree(ws);
    cudaStreamDestroy(str);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
}

int main(int argc, char **argv) {
    static const bcase cases[] = {
        {"flat 1M", 1, {1 << 20, 0}, AM_DTYPE_FLOAT32},
        {"flat 16M", 1, {1 << 24, 0}, AM_DTYPE_FLOAT32},
        {"flat 64M", 1, {1 << 26, 0}, AM_DTYPE_FLOAT32},
        {"matrix 1024x1024", 2, {1024, 1024}, AM_DTYPE_FLOAT32},
        {"matrix 4096x4096", 2, {4096, 4096}, AM_DTYPE_FLOAT32},
        {"matrix 8192x8192", 2, {8192, 8192}, AM_DTYPE_FLOAT32},
        {"embedding 50000x4096", 2, {50000, 4096}, AM_DTYPE_FLOAT32},
        {"row 1x100M", 2, {1, 100000000}, AM_DTYPE_FLOAT32},
        {"flat 16M", 1, {1 << 24, 0}, AM_DTYPE_BFLOAT16},
        {"matrix 4096x4096", 2, {4096, 4096}, AM_DTYPE_BFLOAT16},
        {"matrix 8192x8192", 2, {8192, 8192}, AM_DTYPE_BFLOAT16},
        {"embedding 50000x4096", 2, {50000, 4096}, AM_DTYPE_BFLOAT16},
        {"row 1x100M", 2, {1, 100000000}, AM_DTYPE_BFLOAT16},
        {"tiny 64x64", 2, {64, 64}, AM_DTYPE_BFLOAT16},
        /* a convolution weight: one tile per 3x3 matrix (262144 tiles) */
        {"conv 512x512x3x3", 4, {512, 512, 3, 3}, AM_DTYPE_FLOAT32},
        {"conv 512x512x3x3", 4, {512, 512, 3, 3}, AM_DTYPE_BFLOAT16},
    };
    int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    int n = 0;
    size_t i;
    struct cudaDeviceProp prop;
    double bw;
    if (am_cuda_device_count(&n) != AM_OK || n == 0) {
        fprintf(stderr, "bench_cuda: no CUDA device\n");
        return 77;
    }
    CU(cudaGetDeviceProperties(&prop, 0));
    bw = copy_bandwidth((size_t)1 << 30, quick ? 5 : 20);
    fprintf(stderr, "device: %s; device-to-device copy: %.1f GB/s\n", prop.name, bw / 1e9);
    printf("{\"device\": \"%s\", \"copy_gbps\": %.2f}\n", prop.name, bw / 1e9);
    for (i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run(&cases[i], bw, quick ? 3 : 20);
    return 0;
}
