/*
 * kernels_avx512_mats.c — the stats_u2_mats slot (internal.h) of 3x3 and
 * 1x1 matrices (convolution weights) with AVX-512F: 16 matrices at once,
 * one per vector lane, as kernels_avx2_mats.c does 8 with AVX2, and with
 * the same operations in the same order per lane, so the same bits.
 *
 * The AVX2 sweep spends most of its time moving numbers between memory
 * order and lane order (gathers for the elements, permutes and blends for
 * the three rows and columns of each matrix). Here two-source permutes
 * (vpermt2ps) do it: the 144 elements of 16 3x3 matrices are 48 row
 * triples, so a stride-3 de-interleave of the elements gives, for each
 * column j, the 48 values g[m][i][j] in (m, i) order, and a second
 * stride-3 de-interleave of those gives g[.][i][j] in lane order; each
 * de-interleave of 48 floats is 2 permutes per output vector. The per-
 * matrix rows and columns (3 floats each) go in and out the same way.
 *
 * From memory (a large weight, or caches flushed between updates) the
 * sweep waits on its loads: each run prefetches the elements and moments
 * of the run AM_SU_AHEAD runs on, and the old moments kept aside for a
 * skipped update (orow, ocol: read only then) are written with streaming
 * stores, which neither read those lines first nor push anything out of
 * the caches. Measured (this and the previous version loaded side by side,
 * alternating), 1 and 2 threads, from memory and in cache: 256x256x3x3 and
 * 1280x1280x3x3 float32 0.92-0.95 of the time, 512x512x1x1 0.87-0.91
 * (docs/PERFORMANCE_HISTORY.md).
 *
 * Sums of squares start from +0 in the reference (acc[] = {0}); x + 0 == x
 * for every x >= +0 and every NaN, so those additions of zero are left out
 * here (a sum of squares is never -0).
 *
 * Built with -mavx512f -mavx512bw on this file only.
 */
#include "simd.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__)

#include <immintrin.h>
#include <stdint.h>

#include "avx512_load.h"

#define AM_INLINE static inline __attribute__((always_inline))
#define AM_SU_AHEAD 16 /* runs of 16 matrices ahead (4, 8, 16 tried: 16 best) */

/* Lane l of output j of a stride-3 de-interleave of 48 floats (A, B, D):
 * D1 picks position 3l + j from (A, B) when it is there, D2 keeps that
 * lane or takes position 3l + j - 32 from D. */
#define AM_D1(j, l) ((3 * (l) + (j)) < 32 ? 3 * (l) + (j) : 0)
#define AM_D2(j, l) ((3 * (l) + (j)) < 32 ? (l) : 16 + 3 * (l) + (j)-32)
/* Lane l of output vector K of the inverse (interleave of v0, v1, v2):
 * position p = 16K + l is lane p / 3 of v(p % 3); I1 takes v0 and v1, I2
 * keeps that lane or takes v2. */
#define AM_P(K, l) (16 * (K) + (l))
#define AM_I1(K, l) (AM_P(K, l) % 3 < 2 ? AM_P(K, l) / 3 + 16 * (AM_P(K, l) % 3) : 0)
#define AM_I2(K, l) (AM_P(K, l) % 3 == 2 ? 16 + AM_P(K, l) / 3 : (l))
#define AM_ROW16(M, x)                                                                  \
    {M(x, 0), M(x, 1), M(x, 2),  M(x, 3),  M(x, 4),  M(x, 5),  M(x, 6),  M(x, 7),    \
     M(x, 8), M(x, 9), M(x, 10), M(x, 11), M(x, 12), M(x, 13), M(x, 14), M(x, 15)}

static const int32_t deint_idx[3][2][16] __attribute__((aligned(64))) = {
    {AM_ROW16(AM_D1, 0), AM_ROW16(AM_D2, 0)},
    {AM_ROW16(AM_D1, 1), AM_ROW16(AM_D2, 1)},
    {AM_ROW16(AM_D1, 2), AM_ROW16(AM_D2, 2)},
};
static const int32_t inter_idx[3][2][16] __attribute__((aligned(64))) = {
    {AM_ROW16(AM_I1, 0), AM_ROW16(AM_I2, 0)},
    {AM_ROW16(AM_I1, 1), AM_ROW16(AM_I2, 1)},
    {AM_ROW16(AM_I1, 2), AM_ROW16(AM_I2, 2)},
};

/* Output vector o of three (o < 3), each lane picked from the 48 floats of
 * a[0..2] by two two-source permutes with the index pair idx[o]. */
AM_INLINE void perm48(const __m512 *a, const int32_t (*idx)[2][16], __m512 *out) {
    int o;
    for (o = 0; o < 3; o++) {
        const __m512i i1 = _mm512_load_si512((const void *)idx[o][0]),
                      i2 = _mm512_load_si512((const void *)idx[o][1]);
        out[o] = _mm512_permutex2var_ps(_mm512_permutex2var_ps(a[0], i1, a[1]), i2, a[2]);
    }
}

/* out[j] lane l = (a[0], a[1], a[2]) as 48 floats, position 3l + j. */
AM_INLINE void deint3(const __m512 *a, __m512 *out) { perm48(a, deint_idx, out); }

/* The inverse of deint3: out as 48 floats, position p = lane p / 3 of
 * v[p % 3]. */
AM_INLINE void inter3(const __m512 *v, __m512 *out) { perm48(v, inter_idx, out); }

/* v[x] lane m = a[m*N + x], x < N (N = 1 or 3): the rows (or columns) of
 * 16 matrices in lane order; raw gets the 16*N floats as loaded. */
AM_INLINE void get_rows(const float *a, const int N, __m512 *raw, __m512 *v) {
    int x;
    for (x = 0; x < N; x++) raw[x] = _mm512_loadu_ps(a + 16 * x);
    if (N == 1) v[0] = raw[0];
    else deint3(raw, v);
}

/* a[m*N + x] = lane m of v[x], x < N. */
AM_INLINE void put_rows(float *a, const int N, const __m512 *v) {
    __m512 o[3];
    int x;
    if (N == 1) {
        _mm512_storeu_ps(a, v[0]);
        return;
    }
    inter3(v, o);
    for (x = 0; x < 3; x++) _mm512_storeu_ps(a + 16 * x, o[x]);
}

/* t[e] lane m = element e of matrix b + m (N*N elements each). */
AM_INLINE void load_t(const void *g, const int gdt, const int N, int64_t b, __m512 *t) {
    __m512 x[9], c[9];
    int q, j;
    for (q = 0; q < N * N; q++) x[q] = am_ld16(g, gdt, b * N * N + 16 * q);
    if (N == 1) {
        t[0] = x[0];
        return;
    }
    /* c[3j + K]: the 48 values g[m][i][j] of column j, (m, i) order */
    for (q = 0; q < 3; q++) {
        __m512 o[3];
        deint3(x + 3 * q, o);
        for (j = 0; j < 3; j++) c[3 * j + q] = o[j];
    }
    for (j = 0; j < 3; j++) {
        __m512 o[3];
        int i;
        deint3(c + 3 * j, o);
        for (i = 0; i < 3; i++) t[3 * i + j] = o[i];
    }
}

/* am_row_factor of 16 rows: sqrt(mean / nr), from the quotient scaled by
 * 2^-64 where it overflows (rare: a branch). */
AM_INLINE __m512 rf_v(__m512 mean, __m512 nr) {
    const __m512 q = _mm512_div_ps(mean, nr);
    const __mmask16 big = _mm512_cmp_ps_mask(q, _mm512_set1_ps(AM_FLT_MAX), _CMP_GT_OQ);
    __m512 r = _mm512_sqrt_ps(q);
    if (big)
        r = _mm512_mask_mul_ps(
            r, big,
            _mm512_sqrt_ps(_mm512_div_ps(_mm512_mul_ps(mean, _mm512_set1_ps(AM_RF_DOWN)), nr)),
            _mm512_set1_ps(AM_RF_UP));
    return r;
}

/* am_lanesum_finish of a row's lane accumulators when only the first N (1
 * or 3) can be nonzero (the others +0, left out: see the top). */
AM_INLINE __m512 rowsum(const __m512 *a, const int N) {
    return N == 1 ? a[0] : _mm512_add_ps(_mm512_add_ps(a[0], a[2]), a[1]);
}

/* The elements and moments of the run of 16 N x N matrices from b: into
 * the caches (a prefetch never faults, past the end included). */
AM_INLINE void prefetch_run(const void *g, const int gdt, const int N, int64_t b,
                            const float *row, const float *col) {
    const uintptr_t es = gdt == AM_DTYPE_FLOAT32 ? 4 : 2, gb = (uintptr_t)(16 * N * N) * es;
    /* addresses as integers: they may lie past the arrays' ends */
    const uintptr_t gp = (uintptr_t)g + (uintptr_t)(b * N * N) * es;
    const uintptr_t rp = (uintptr_t)row + (uintptr_t)(b * N) * 4,
                    cp = (uintptr_t)col + (uintptr_t)(b * N) * 4;
    uintptr_t o;
    for (o = 0; o < gb; o += 64) _mm_prefetch((const char *)(gp + o), _MM_HINT_T0);
    for (o = 0; o < (uintptr_t)(64 * N); o += 64) {
        _mm_prefetch((const char *)(rp + o), _MM_HINT_T0);
        _mm_prefetch((const char *)(cp + o), _MM_HINT_T0);
    }
}

/* stats_u2_8 of kernels_avx2_mats.c for the 16 N x N matrices b..b+15;
 * nt: orow + b*N and ocol + b*N are 64-byte aligned (streaming stores). */
AM_INLINE void su16(const void *g, const int gdt, const int N, int64_t b, const float *row,
                    const float *col, const am_consts *k, float *rs, float *cs, float *nr,
                    float *nc, float *rf, float *cf, float *rmean, double *out, __m512 *mr,
                    __m512 *mc, float *orow, float *ocol, const int nt) {
    const __m512 inv = _mm512_set1_ps(am_inv_count(N)), eps = _mm512_set1_ps(k->eps);
    const __m512 b2 = _mm512_set1_ps(k->beta2), omb = _mm512_set1_ps(k->one_m_beta2);
    __m512 t[9], sq[9], rows[3], cols[3], rawr[3], rawc[3], v[3], oc[3], rfv[3], cfv[3], s,
        mean;
    __m512d lo = _mm512_setzero_pd(), hi = lo; /* set by row 0 */
    int i, j;
    prefetch_run(g, gdt, N, b + 16 * AM_SU_AHEAD, row, col);
    /* the old moments first: nr may be row and nc col */
    get_rows(row + b * N, N, rawr, v);
    get_rows(col + b * N, N, rawc, oc);
    if (orow)
        for (i = 0; i < N; i++) {
            if (nt) {
                _mm512_stream_ps(orow + b * N + 16 * i, rawr[i]);
                _mm512_stream_ps(ocol + b * N + 16 * i, rawc[i]);
            } else {
                _mm512_storeu_ps(orow + b * N + 16 * i, rawr[i]);
                _mm512_storeu_ps(ocol + b * N + 16 * i, rawc[i]);
            }
        }
    load_t(g, gdt, N, b, t);
    /* sums_v: rows over j (lane accumulators), columns over i ascending */
    for (i = 0; i < N * N; i++) sq[i] = _mm512_mul_ps(t[i], t[i]);
    for (i = 0; i < N; i++) rows[i] = rowsum(sq + N * i, N);
    for (j = 0; j < N; j++) {
        cols[j] = sq[j];
        for (i = 1; i < N; i++) cols[j] = _mm512_add_ps(cols[j], sq[N * i + j]);
    }
    if (rs) put_rows(rs + b * N, N, rows);
    if (cs) put_rows(cs + b * N, N, cols);
    /* moments_v: am_moment, the row mean, am_row_factor, am_rsqrt */
    s = _mm512_setzero_ps();
    for (i = 0; i < N; i++) {
        const __m512 x = _mm512_add_ps(_mm512_mul_ps(rows[i], inv), eps);
        v[i] = _mm512_add_ps(_mm512_mul_ps(v[i], b2), _mm512_mul_ps(x, omb));
        s = _mm512_add_ps(s, v[i]);
    }
    mean = _mm512_mul_ps(s, inv);
    if (rmean) _mm512_storeu_ps(rmean + b, mean);
    for (i = 0; i < N; i++) rfv[i] = rf_v(mean, v[i]);
    put_rows(nr + b * N, N, v);
    put_rows(rf + b * N, N, rfv);
    for (j = 0; j < N; j++) {
        const __m512 x = _mm512_add_ps(_mm512_mul_ps(cols[j], inv), eps);
        v[j] = _mm512_add_ps(_mm512_mul_ps(oc[j], b2), _mm512_mul_ps(x, omb));
        cfv[j] = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_sqrt_ps(v[j]));
    }
    put_rows(nc + b * N, N, v);
    put_rows(cf + b * N, N, cfv);
    /* u2_v: u = (rf * cf) * g; each row's sum of u^2 added in double, rows
     * in order (the total starts at 0.0: left out as above) */
    for (i = 0; i < N; i++) {
        __m512 a[3];
        for (j = 0; j < N; j++) {
            const __m512 u = _mm512_mul_ps(_mm512_mul_ps(rfv[i], cfv[j]), t[N * i + j]);
            a[j] = _mm512_mul_ps(u, u);
        }
        s = rowsum(a, N);
        {
            const __m512d sl = _mm512_cvtps_pd(_mm512_castps512_ps256(s));
            const __m512d sh = _mm512_cvtps_pd(
                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
            lo = i ? _mm512_add_pd(lo, sl) : sl;
            hi = i ? _mm512_add_pd(hi, sh) : sh;
        }
    }
    _mm512_storeu_pd(out, lo);
    _mm512_storeu_pd(out + 8, hi);
    for (i = 0; i < N; i++) {
        *mr = _mm512_min_ps(rfv[i], *mr);
        *mc = _mm512_min_ps(cfv[i], *mc);
    }
}

/* The stats_u2_mats slot: runs of 16 3x3 or 1x1 matrices here, everything
 * else (other shapes, the last matrices) by the AVX2 sweep. */
static void avx512_stats_u2_mats(const void *g, int gdt, int64_t R, int64_t C, int64_t b0,
                                 int64_t b1, const float *row, const float *col,
                                 const am_consts *k, float *rs, float *cs, float *nr,
                                 float *nc, float *rf, float *cf, float *rmean, double *out,
                                 float *fmin, float *orow, float *ocol) {
    int64_t b = b0;
    __m512 mr = _mm512_set1_ps(INFINITY), mc = mr;
    float lr[16], lc[16];
    int l;
    /* a run is 64 * R bytes of moments: aligned at b0, aligned at every run */
    const int nt = orow && !(((uintptr_t)(orow + b0 * R) | (uintptr_t)(ocol + b0 * C)) & 63);
    if (R == C && (R == 1 || R == 3)) {
#define AM_SU_LOOP(GD, N)                                                                  \
    for (; b + 16 <= b1; b += 16)                                                          \
        su16(g, GD, N, b, row, col, k, rs, cs, nr, nc, rf, cf, rmean, out + (b - b0), &mr, \
             &mc, orow, ocol, nt)
#define AM_SU_DT(N)                                                                        \
    switch (gdt) {                                                                         \
    case AM_DTYPE_FLOAT32: AM_SU_LOOP(AM_DTYPE_FLOAT32, N); break;                         \
    case AM_DTYPE_BFLOAT16: AM_SU_LOOP(AM_DTYPE_BFLOAT16, N); break;                       \
    default: AM_SU_LOOP(AM_DTYPE_FLOAT16, N); break;                                       \
    }
        if (R == 3) {
            AM_SU_DT(3)
        } else {
            AM_SU_DT(1)
        }
#undef AM_SU_LOOP
#undef AM_SU_DT
    }
    /* streaming stores are weakly ordered: done before this task is */
    if (nt) _mm_sfence();
    _mm512_storeu_ps(lr, mr);
    _mm512_storeu_ps(lc, mc);
    _mm256_zeroupper(); /* before other code (simd.h, AM_CLEAN_RETURN) */
    fmin[0] = fmin[1] = INFINITY;
    if (b < b1)
        am_avx2_stats_u2_mats(g, gdt, R, C, b, b1, row, col, k, rs, cs, nr, nc, rf, cf,
                              rmean, out + (b - b0), fmin, orow, ocol);
    for (l = 0; l < 16; l++) {
        if (lr[l] < fmin[0]) fmin[0] = lr[l];
        if (lc[l] < fmin[1]) fmin[1] = lc[l];
    }
}

am_stats_u2_mats_fn am_avx512_stats_u2_mats(void) { return avx512_stats_u2_mats; }

#else

am_stats_u2_mats_fn am_avx512_stats_u2_mats(void) { return NULL; }

#endif
