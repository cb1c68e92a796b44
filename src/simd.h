/*
 * simd.h — the optimised kernel sets and the thread pool, as seen by
 * dispatch.c and the tests. Nothing here is public API.
 */
#ifndef AM_SIMD_H
#define AM_SIMD_H

#include "internal.h"

#include <math.h>
#include <string.h>

/* How far ahead (elements) the unfactored (1-D) kernels prefetch each of
 * their streams: with only the hardware prefetchers one core reads a
 * stream at about 7 GB/s on the development machine, so the stats pass
 * over g and sq (two streams) ran at 9 GB/s; measured, 16M float32 at 1
 * thread: stats 14.8 -> 11.1 ms (docs/PERFORMANCE_HISTORY.md). */
#define AM_FLAT_PREFETCH 1024

/* Where am_sw_prefetch() is 0, the apply of large matrices still prefetches
 * the parameter and the gradient, into L2 only (prefetcht1), this many bytes
 * of the parameter ahead (of the gradient: the same elements). Zen 4
 * (thirteenth session, same-binary alternation, 4096x4096 at 1 thread):
 * AVX-512 apply 6.3-6.7 -> 5.3-5.7 ms bfloat16, 7.8-8.3 -> 7.0-7.3 float16;
 * AVX2 float32 7.0-7.8 -> 6.4-7.4; 2, 4 and 6 KB ahead alike. Not for the
 * AVX-512 float32 apply of long rows (4096x4096 no better, 11008x4096
 * 3-10% slower) nor the 1-D finish (no gain); since the twenty-ninth
 * session its rows under AM_LONG_ROW_MIN prefetch the parameter (small
 * matrices' rows start cold: LoRA's 16x1024 from cold caches 10-15%
 * faster); docs/PERFORMANCE_HISTORY.md. */
#define AM_L2_PREFETCH_BYTES 4096

#if defined(__x86_64__)
#include <xmmintrin.h>
/* Prefetches into L2 the n bytes from p (n a multiple of 64). Never faults. */
static inline __attribute__((always_inline)) void am_prefetch_l2(const void *p, int n) {
    int b;
    for (b = 0; b < n; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T1);
}
#endif

/* The scalar tail of one row of a SIMD stats_tile (columns nv..n-1 of the
 * tile, base the row's element j0), as the reference's loop: squares into
 * the row's lanes a and the column sums; with cnt, the agreement of
 * (g > 0) with the stored bits from q0 on (match = nv - mism, the vector
 * part's mismatches, plus the tail's matches) and the smallest g > 0 in *mp. */
static inline void am_stats_row_tail(const void *g, int gdt, int cnt, int64_t base,
                                     int64_t nv, int64_t n, float *a, float *colpart,
                                     const uint8_t *bits, int64_t q0, int64_t mism,
                                     int32_t *match, float *mp) {
    int64_t j;
    int32_t m = (int32_t)(nv - mism);
    for (j = nv; j < n; j++) {
        float x = am_load(g, gdt, base + j), x2 = x * x;
        a[j & 7] += x2;
        colpart[j] += x2;
        if (cnt) {
            int64_t q = q0 + j;
            m += (x > 0.0f) == ((bits[q >> 3] >> (q & 7)) & 1);
            if (x > 0.0f && x < *mp) *mp = x;
        }
    }
    if (cnt) *match = m;
}

/* The smallest positive float32 kept by a running unsigned minimum of
 * (bits of x) - 1 (the SIMD stats kernels): best + 1 is that value's bits
 * when it is a positive finite pattern; a wrapped +0 (0), a NaN or a
 * negative value give +inf (none). */
static inline float am_minpos_from_bits(uint32_t best) {
    float f = INFINITY;
    best += 1u;
    if (best != 0u && best < 0x7f800000u) memcpy(&f, &best, 4);
    return f;
}

/* The smallest float t with fl(t / scale) > 0. Division by a positive
 * constant is monotonic, so (u >= t) == (u / scale > 0) for every u, NaN
 * included (both false): the sign test needs no division. scale >= 1 here
 * (update.c); an infinite scale (a tiny clip_threshold) gives NaN. */
static inline float am_pos_threshold(float scale) {
    float t;
    /* u / inf is 0 or NaN, never > 0: a NaN threshold makes u >= t false */
    if (!(scale < INFINITY)) return NAN;
    t = (float)((double)scale * 0x1p-150);
    if (!(t > 0.0f)) t = nextafterf(0.0f, 1.0f);
    while (!(t / scale > 0.0f)) t = nextafterf(t, INFINITY);
    for (;;) {
        float below = nextafterf(t, 0.0f);
        if (below > 0.0f && below / scale > 0.0f) t = below;
        else break;
    }
    return t;
}

/* The AVX2+F16C kernel set (kernels_avx2.c): the reference table with the
 * slots it implements overridden, bit-identical to the reference; on CPUs
 * with AVX-512F and AVX-512BW (unless AUTOMAGIC_NO_AVX512=1) its random numbers,
 * the stats pass, the apply of 16-bit parameters, the finish of
 * unfactored parameters and the small-matrix apply and agreement use
 * AVX-512, and its name is "avx2+avx512".
 * Only valid to call through when am_cpu_has_avx2() is true. NULL when the
 * library was built without it (not x86-64, or a compiler without the
 * intrinsics). */
const am_kernels *am_kernels_avx2(void);

/* The batched small-matrix slots of the AVX2 set (kernels_avx2_mats.c),
 * defined only when that file is built with AVX2 + F16C. */
void am_avx2_stats_mats(const void *g, int gdt, int64_t R, int64_t C,
                        int64_t b0, int64_t b1, float *rowsum, float *colsum);
void am_avx2_u2_mats(const void *g, int gdt, int64_t R, int64_t C, int64_t b0,
                     int64_t b1, const float *rf, const float *cf, double *out);
void am_avx2_moments_mats(int64_t R, int64_t C, int64_t b0, int64_t b1,
                          const float *row, const float *col, const float *rs,
                          const float *cs, const am_consts *k, float *nr,
                          float *nc, float *rf, float *cf, float *rmean);
void am_avx2_stats_u2_mats(const void *g, int gdt, int64_t R, int64_t C, int64_t b0,
                           int64_t b1, const float *row, const float *col,
                           const am_consts *k, float *rs, float *cs, float *nr,
                           float *nc, float *rf, float *cf, float *rmean, double *out,
                           float *fmin, float *orow, float *ocol);

/* Rows i0, i0 + 8, ... (while 8 remain) of the AVX2 stats_tile slot for a
 * tile of whole rows of a matrix exactly C = 4, 8, 16 or 32 columns wide
 * (kernels_avx2_narrow.c), with that slot's arguments (pm NULL: no
 * agreement count), colpart and ws->wpart already zeroed; minbits: the
 * slot's running minimum of the positive elements, 8 unsigned lanes of
 * (bits of x) - 1, updated. Returns the first row not done (i0 for other
 * widths). */
int64_t am_avx2_stats_narrow(const void *g, int gdt, int64_t C, int64_t i0, int64_t i1,
                             float *rowpart, float *colpart, const am_polmap *pm,
                             int32_t *rowmatch, uint32_t *minbits, const am_wsum *ws);

/* Philox words of 32 consecutive quads (SPEC 5): out[4k + w] is word w of
 * am_rng_quad(seed, pid, step, q0 + k), k < 32, w < 4 (128 words). */
typedef void (*am_philox_fn)(uint64_t seed, uint32_t pid, int64_t step,
                             int64_t q0, uint32_t *out);

/* The wide-stream words of one apply (float16 values in the half subnormal
 * range, zeros included: 32 bits of noise each, am_sr_noise). Such values
 * are usually sparse (a weight near zero here and there), where filling a
 * window of 32 quads for each one cost more than its rounding: an element
 * far from the previous one asked for gets its quad from the scalar
 * generator, and one within 32 elements after it (a run of zeros, say)
 * fills a window of 32 quads with the vector generator. Same words either
 * way. */
typedef struct am_widewin {
    int64_t wq0;  /* first quad of ww, when wvalid */
    int64_t sq;   /* the quad in s (-1: none) */
    int64_t last; /* the element asked for last */
    int wvalid;
    uint32_t s[4];
    uint32_t ww[128];
} am_widewin;

static inline void am_widewin_init(am_widewin *w) {
    w->wq0 = 0;
    w->sq = -1;
    w->last = -64;
    w->wvalid = 0;
}

/* The 32-bit wide-stream word of element e (ascending e within an apply). */
static inline uint32_t am_wide_word(am_widewin *w, am_philox_fn gen, uint64_t seed,
                                    uint32_t pid, int64_t step, int64_t e) {
    const int64_t q = e >> 2;
    const int near = e > w->last && e - w->last <= 32;
    w->last = e;
    if (w->wvalid && q >= w->wq0 && q < w->wq0 + 32) return w->ww[e - 4 * w->wq0];
    if (q == w->sq) return w->s[e & 3];
    if (near) {
        w->wq0 = q;
        gen(seed, pid, step, (int64_t)((uint64_t)q | AM_SR_WIDE_STREAM), w->ww);
        w->wvalid = 1;
        return w->ww[e & 3];
    } else {
        const am_u32x4 v = am_rng_quad(seed, pid, step, (int64_t)((uint64_t)q | AM_SR_WIDE_STREAM));
        memcpy(w->s, v.v, sizeof w->s);
        w->sq = q;
        return w->s[e & 3];
    }
}

/* The AVX2 generator (kernels_avx2.c), NULL when not built. */
am_philox_fn am_philox32_avx2(void);

/* The AVX-512F generator (philox_avx512.c), NULL when not built. Only valid
 * to call when am_cpu_has_avx512() is true. */
am_philox_fn am_philox32_avx512(void);

/* The apply_rows slot's signature (internal.h). */
typedef void (*am_apply_fn)(void *p, int pdt, const void *g, int gdt, int64_t R,
                            int64_t C, int64_t r0, int64_t r1, const float *rf,
                            const float *cf, float inv, float lr, const float *lrs,
                            const am_consts *k, uint64_t seed, uint32_t param_id,
                            int64_t step, int64_t noff, uint8_t *pol_row);

/* The AVX-512F/BW apply of bfloat16/float16 parameters (kernels_avx512.c), for
 * pdt != float32 and C >= 16 only; NULL when not built. Only valid to call
 * when am_cpu_has_avx512() is true. */
am_apply_fn am_avx512_apply16(void);

/* An apply over a prefix of rows [r0, r1) of one lr-row (arguments as the
 * apply_rows slot): returns the rows r0.. it did, polarity bits included. */
typedef int64_t (*am_apply_mats_fn)(void *p, int pdt, const void *g, int gdt,
                                    int64_t R, int64_t C, int64_t r0, int64_t r1,
                                    const float *rf, const float *cf, float inv,
                                    float lr, const am_consts *k, uint64_t seed,
                                    uint32_t param_id, int64_t step, int64_t noff, uint8_t *pol_row);

/* The AVX-512F/BW apply of small matrices (R*C <= 64, e.g. 3x3 convolution
 * weights; kernels_avx512.c), any parameter dtype: the runs of 16 whole
 * matrices from r0 on (a multiple of 16*R rows; 0 when r0 is not on a
 * matrix). NULL when not built. Only valid to call when am_cpu_has_avx512()
 * is true. */
am_apply_mats_fn am_avx512_apply_mats(void);

/* The agreement sweep over a prefix of rows [r0, r1) of one lr-row of small
 * matrices (arguments as the agree_rows slot, with the sign threshold thr
 * in place of the scale): returns the rows done, their matches in
 * *matches, polarity bits written. */
typedef int64_t (*am_agree_mats_fn)(const void *g, int gdt, int64_t R, int64_t C,
                                    int64_t r0, int64_t r1, const float *rf,
                                    const float *cf, float thr, uint8_t *pol_row,
                                    int64_t *matches);

/* Its AVX-512F/BW version (kernels_avx512.c): the runs of 16 whole
 * matrices, as am_avx512_apply_mats. NULL when not built. */
am_agree_mats_fn am_avx512_agree_mats(void);

/* The count_pos slot's signature (internal.h) and its AVX-512F/BW version
 * (kernels_avx512.c; NULL when not built). */
typedef int64_t (*am_count_pos_fn)(const void *g, int gdt, int64_t n, const uint8_t *bits,
                                   float *minpos);
am_count_pos_fn am_avx512_count_pos(void);

/* The finish_flat slot's signature (internal.h). */
typedef int64_t (*am_flat_fn)(void *p, int pdt, const void *g, int gdt, float *sq,
                              float *lr, uint8_t *pol, int64_t e0, int64_t e1,
                              float scale, const am_consts *k, uint64_t seed,
                              uint32_t param_id, int64_t step, int64_t noff);

/* The AVX-512F/BW finish of unfactored parameters of every dtype
 * (kernels_avx512.c); NULL when not built. Only valid to call when
 * am_cpu_has_avx512() is true. */
am_flat_fn am_avx512_flat(void);

/* The stats_tile slot's signature (internal.h). */
typedef void (*am_stats_fn)(const void *g_mat, int gdt, int64_t C, int64_t i0, int64_t i1,
                            int64_t j0, int64_t j1, float *rowpart, float *colpart,
                            const am_polmap *pm, int32_t *rowmatch, float *minpos,
                            const am_wsum *ws);

/* The AVX-512F/BW stats_tile (kernels_avx512.c; the agreement counted on
 * the raw bits), any gradient dtype, its gradient prefetched 8 KiB ahead
 * into L2 with l2, else into L1 (am_tuning_zen4; the same bits);
 * NULL when not built. Only valid to call when am_cpu_has_avx512() is
 * true. */
am_stats_fn am_avx512_stats(int l2);

/* The stats_u2_mats slot's signature (internal.h) and its AVX-512F/BW
 * version (kernels_avx512_mats.c: runs of 16 3x3 or 1x1 matrices, the
 * rest by am_avx2_stats_u2_mats); NULL when not built. Only valid to call
 * when am_cpu_has_avx512() is true. */
typedef void (*am_stats_u2_mats_fn)(const void *g, int gdt, int64_t R, int64_t C, int64_t b0,
                                    int64_t b1, const float *row, const float *col,
                                    const am_consts *k, float *rs, float *cs, float *nr,
                                    float *nc, float *rf, float *cf, float *rmean,
                                    double *out, float *fmin, float *orow, float *ocol);
am_stats_u2_mats_fn am_avx512_stats_u2_mats(void);

/* The AVX2 set without any AVX-512 part (for tests: the set in use on CPUs
 * without AVX-512). NULL when not built. */
const am_kernels *am_kernels_avx2_plain(void);

/* 1 when the CPU and the OS support AVX-512F and AVX-512BW (zmm state
 * enabled). */
int am_cpu_has_avx512(void);

/* 1 when the CPU and the OS support AVX2, FMA and F16C with the ymm state
 * enabled (cpuid + xgetbv); checked once, thread-safe. */
int am_cpu_has_avx2(void);

/* 1 when the streaming kernels issue software prefetches into L1 (the
 * process's choice, made with the kernel set). On by default: on the machines of
 * earlier sessions (about 2 GHz, their make not recorded) one core's
 * hardware prefetchers left memory idle, and a 4096x4096 float32 apply
 * went 14.0 -> 10.8 ms with them. Off on AMD CPUs: on Zen 4 (twelfth
 * session) they cost time, the same apply 9.0 -> 7.7 ms without them and
 * 5.9 ms in AVX-512, which runs float32 parameters' apply only when this
 * is 0 (other AMD families follow Zen 4 unmeasured). Where it is 0, the
 * AVX2 stats prefetch the next group of rows into L2 instead, the narrow
 * ones (4-32 columns) 8 KiB ahead, and the AVX-512 apply of 16-bit
 * parameters and of float32 rows under AM_LONG_ROW_MIN prefetches
 * AM_L2_PREFETCH_BYTES ahead into L2. The AVX-512 stats pass does not
 * look at it (am_tuning_zen4).
 * AUTOMAGIC_PREFETCH=0 or 1 overrides the default. Either way, the same
 * bits. */
int am_sw_prefetch(void);

/* 1 when the AVX-512 kernels run Zen 4's tuning, 0 Zen 5's (the process's
 * choice, made once with the CPU's detection; the same bits either way).
 * The two differ where those machines measured differently:
 * - the stats pass prefetches the gradient 8 KiB ahead into L2 (Zen 4)
 *   or into L1 (Zen 5) (kernels_avx512.c, stats_rows; Zen 4, 4096x4096
 *   float32 stats at 1 thread 5.7-6.1 -> 3.8-4.8 ms into L2, 4096x11008
 *   14.6-15.0 -> 8.9-9.3 ms, twenty-eighth session; Zen 5: L1,
 *   twentieth session); am_kernels_avx2 picks the stats kernel by it;
 * - the float32 apply takes rows of 3072 columns or more four at a time
 *   (Zen 4, seventeenth session; re-measured in the twenty-eighth: the
 *   finish of 4096x4096 at 1 thread 6.2-7.8 ms one row at a time against
 *   6.1-6.5, 768x3072 0.74-0.79 against 0.67-0.68) or only rows over
 *   4096 (Zen 5, twentieth session) (kernels_avx512.c,
 *   one_row_apply_max, which reads it at every call);
 * - the float32 apply of 3x3 matrices also prefetches the parameter
 *   18 KiB ahead into L2 (Zen 4, twenty-ninth session: 256x256x3x3 from
 *   cold caches at 1 thread 7-15% faster; Zen 5 unmeasured, left as it
 *   was) (kernels_avx512.c, mats3_prefetch, read at every call).
 * Zen 4's on AMD family 25, Zen 5's elsewhere (Intel unmeasured);
 * AUTOMAGIC_TUNING=zen4 or zen5 overrides (any other value is ignored
 * with a warning through the log callback). */
int am_tuning_zen4(void);

/* For tests: sets am_tuning_zen4(), which the float32 apply's threshold
 * follows at once; the stats kernel chosen with the kernel set stays (not
 * thread-safe with respect to updates running at the same time). */
void am_set_tuning_zen4(int on);

/* For tests and benchmarks: sets am_sw_prefetch() (not thread-safe with
 * respect to updates running at the same time). */
void am_set_sw_prefetch(int on);

/* For tests and benchmarks: 1 selects the scalar reference, 2 the portable
 * vector set (am_kernels_portable; the reference where the compiler has
 * none), 0 the best set the CPU supports (the default, unless
 * AUTOMAGIC_FORCE_SCALAR=1 or AUTOMAGIC_FORCE_PORTABLE=1). Not thread-safe
 * with respect to updates running at the same time. */
void am_kernels_select(int which);

/* The portable vector set (kernels_vec.c: GCC/Clang vector extensions, no
 * processor-specific code), the best set where the AVX2 one cannot run
 * (every non-x86 CPU); NULL when the compiler lacks the extensions. */
const am_kernels *am_kernels_portable(void);

/* CASE(PD, GD) with the parameter and gradient dtypes (pdt, gdt: 0 float32,
 * 1 bfloat16, 2 float16) as constants: a kernel entry point's dispatch to
 * the body instantiated for each of the nine pairs, so the inner loops do
 * not branch on them. CASE may return. */
#define AM_DTYPE_PAIRS(pdt, gdt, CASE)                                        \
    switch ((pdt) * 3 + (gdt)) {                                              \
    case 0: CASE(0, 0); break;                                                \
    case 1: CASE(0, 1); break;                                                \
    case 2: CASE(0, 2); break;                                                \
    case 3: CASE(1, 0); break;                                                \
    case 4: CASE(1, 1); break;                                                \
    case 5: CASE(1, 2); break;                                                \
    case 6: CASE(2, 0); break;                                                \
    case 7: CASE(2, 1); break;                                                \
    default: CASE(2, 2); break;                                               \
    }

/* Returns the value of expr (of type T) from a SIMD kernel entry point with
 * the upper halves of the vector registers zeroed (vzeroupper). Every
 * kernel slot returns through it or ends with _mm256_zeroupper(): the code
 * that calls them (update.c, libm's exp) is plain SSE, and SSE instructions
 * that run while the upper halves are dirty wait on the last vector
 * operation that wrote those registers (measured here: a 12288x192 float32
 * update spent a third of its time in two such stalls per matrix row, in
 * the lr bump's exp and the next row's task; the compiler's own vzeroupper
 * was missing on the path that flushes the polarity bits). Only expanded in
 * the files built with -mavx2 / -mavx512f. */
#define AM_CLEAN_RETURN(T, expr)                                              \
    do {                                                                      \
        T am_ret_ = (expr);                                                   \
        _mm256_zeroupper();                                                   \
        return am_ret_;                                                       \
    } while (0)

/* Element positions in a run of small R x C matrices (the small-matrix
 * factor tables of kernels_avx2.c and kernels_avx512.c): am_run_next writes
 * the flat row (mm * R + i) and the column of matrix mm (mm * C + j) of the
 * next n elements, counting up without a division. */
typedef struct am_runpos {
    int mm, i, j;
} am_runpos;

static inline void am_run_next(am_runpos *pos, int R, int C, int n, int32_t *ri,
                               int32_t *ci) {
    int l;
    for (l = 0; l < n; l++) {
        ri[l] = pos->mm * R + pos->i;
        ci[l] = pos->mm * C + pos->j;
        if (++pos->j == C) {
            pos->j = 0;
            if (++pos->i == R) {
                pos->i = 0;
                pos->mm++;
            }
        }
    }
}

/* Thread pool (parallel.c). am_pool_run runs fn(ctx, t) for t in [0, ntasks)
 * on nthreads threads (the caller included), returns 0 when it could not
 * (pool busy with another caller, or threads unavailable): the caller then
 * runs the tasks itself. */
int am_pool_run(int nthreads, int64_t ntasks, am_task_fn fn, void *ctx);

#endif /* AM_SIMD_H */
