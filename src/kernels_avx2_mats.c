/*
 * kernels_avx2_mats.c — AVX2 batched kernels for many small matrices (the
 * stats_mats, u2_mats and moments_mats slots of internal.h, and
 * stats_u2_mats, the three in one sweep), bit-identical to the reference's
 * per-matrix loops.
 *
 * A (256, 256, 3, 3) conv weight is 65536 matrices of 3x3: per-matrix calls
 * and O(R + C) scalar loops cost far more than the 9 elements. Here 8
 * consecutive matrices are processed at once, one matrix per vector lane:
 * their 8*R*C contiguous elements are widened to float32 in a buffer and
 * transposed with gathers so that vector e holds element e of each of the 8
 * matrices (per-row and per-column arrays likewise; with 3 rows or columns
 * through permutes, load3t/store3t). Every lane then performs exactly the
 * scalar reference's operations for its own matrix, in the same order (the
 * 8 lane accumulators of a row become 8 vectors, am_lanesum_finish is applied
 * vector-wise, column sums run over rows ascending, the double total of u^2
 * adds the row sums in order), with IEEE add/mul/div/sqrt and no FMA, so
 * the bits are those of the reference. Matrices beyond a multiple of 8, and
 * shapes too big for the buffers, go through the reference code itself.
 * Built with -mavx2 -mf16c on this file only.
 */
#include "simd.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__F16C__)

#include <immintrin.h>

#include "avx2_load.h"

#define AM_INLINE static inline __attribute__((always_inline))
#define MAXD 64 /* R, C <= MAXD and R*C <= AM_MATS_MAX_ELEMS here */


/* t[e] = element e of matrices b..b+7 (lane m = matrix b + m), n = R*C. */
AM_INLINE void load_t(const void *g, const int gdt, int64_t n, int64_t b,
                      __m256 *t) {
    float buf[8 * AM_MATS_MAX_ELEMS];
    const __m256i idx = _mm256_mullo_epi32(_mm256_set1_epi32((int)n),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    int64_t e;
    for (e = 0; e < 8 * n; e += 8) _mm256_storeu_ps(buf + e, am_ld8(g, gdt, b * n + e));
    for (e = 0; e < n; e++) t[e] = _mm256_i32gather_ps(buf + e, idx, 4);
}

/* The 3-row (or 3-column) case of gather_rows and scatter_rows, the
 * factors and moments of 3x3 convolution weights: the 24 floats of 8
 * matrices move as 3 vectors through permutes and blends (lane l of
 * vector i is a[3l + i]) instead of 3 gathers or 24 scalar stores. */
#define AM_P(x, i) _mm256_permutevar8x32_ps(x, i)
AM_INLINE void load3t(const float *a, __m256 *v) {
    const __m256 A = _mm256_loadu_ps(a), B = _mm256_loadu_ps(a + 8),
                 D = _mm256_loadu_ps(a + 16);
    const __m256i i0 = _mm256_setr_epi32(0, 3, 6, 1, 4, 7, 2, 5),
                  i1 = _mm256_setr_epi32(1, 4, 7, 2, 5, 0, 3, 6),
                  i2 = _mm256_setr_epi32(2, 5, 0, 3, 6, 1, 4, 7);
    v[0] = _mm256_blend_ps(_mm256_blend_ps(AM_P(A, i0), AM_P(B, i0), 0x38), AM_P(D, i0), 0xC0);
    v[1] = _mm256_blend_ps(_mm256_blend_ps(AM_P(A, i1), AM_P(B, i1), 0x18), AM_P(D, i1), 0xE0);
    v[2] = _mm256_blend_ps(_mm256_blend_ps(AM_P(A, i2), AM_P(B, i2), 0x1C), AM_P(D, i2), 0xE0);
}

AM_INLINE void store3t(float *a, const __m256 *v) {
    const __m256i i0 = _mm256_setr_epi32(0, 0, 0, 1, 1, 1, 2, 2),
                  i1 = _mm256_setr_epi32(2, 3, 3, 3, 4, 4, 4, 5),
                  i2 = _mm256_setr_epi32(5, 5, 6, 6, 6, 7, 7, 7);
    _mm256_storeu_ps(a, _mm256_blend_ps(_mm256_blend_ps(AM_P(v[0], i0), AM_P(v[1], i0), 0x92),
                                        AM_P(v[2], i0), 0x24));
    _mm256_storeu_ps(a + 8, _mm256_blend_ps(_mm256_blend_ps(AM_P(v[0], i1), AM_P(v[1], i1), 0x24),
                                            AM_P(v[2], i1), 0x49));
    _mm256_storeu_ps(a + 16, _mm256_blend_ps(_mm256_blend_ps(AM_P(v[0], i2), AM_P(v[1], i2), 0x49),
                                             AM_P(v[2], i2), 0x92));
}
#undef AM_P

/* v[x] for lane m = a[m*stride + x], x < cnt (8 runs of stride floats). */
AM_INLINE void gather_rows(const float *a, int64_t stride, int64_t cnt, __m256 *v) {
    const __m256i idx = _mm256_mullo_epi32(_mm256_set1_epi32((int)stride),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    int64_t x;
    if (stride == 3 && cnt == 3) {
        load3t(a, v);
        return;
    }
    for (x = 0; x < cnt; x++) v[x] = _mm256_i32gather_ps(a + x, idx, 4);
}

/* a[m*stride + x] = lane m of v[x], x < cnt. */
AM_INLINE void scatter_rows(float *a, int64_t stride, int64_t cnt, const __m256 *v) {
    float tmp[8];
    int64_t x;
    int m;
    if (stride == 3 && cnt == 3) {
        store3t(a, v);
        return;
    }
    for (x = 0; x < cnt; x++) {
        _mm256_storeu_ps(tmp, v[x]);
        for (m = 0; m < 8; m++) a[m * stride + x] = tmp[m];
    }
}

/* am_lanesum_finish, one sum per vector lane. */
AM_INLINE __m256 lanesum_v(const __m256 *a) {
    __m256 s04 = _mm256_add_ps(a[0], a[4]), s26 = _mm256_add_ps(a[2], a[6]);
    __m256 s15 = _mm256_add_ps(a[1], a[5]), s37 = _mm256_add_ps(a[3], a[7]);
    return _mm256_add_ps(_mm256_add_ps(s04, s26), _mm256_add_ps(s15, s37));
}

/* Common conv kernels get bodies with constant R and C (the compiler keeps
 * the per-element vectors in registers); others the generic body. X is a
 * macro taking (R, C). */
#define AM_SHAPES(X)                                                          \
    if (R == 1 && C == 1) { X(1, 1); }                                        \
    else if (R == 3 && C == 3) { X(3, 3); }                                   \
    else if (R == 5 && C == 5) { X(5, 5); }                                   \
    else if (R == 7 && C == 7) { X(7, 7); }                                   \
    else { X(R, C); }

static int fits(int64_t R, int64_t C) {
    return R <= MAXD && C <= MAXD && R * C <= AM_MATS_MAX_ELEMS;
}

/* ------------------------------------------------------------ stats ---- */

/* Row and column sums of g*g of 8 transposed matrices (t, from load_t). */
AM_INLINE void sums_v(const __m256 *t, int64_t R, int64_t C, __m256 *rows, __m256 *cols) {
    int64_t i, j;
    for (j = 0; j < C; j++) cols[j] = _mm256_setzero_ps();
    for (i = 0; i < R; i++) {
        __m256 acc[AM_LANES];
        int l;
        for (l = 0; l < AM_LANES; l++) acc[l] = _mm256_setzero_ps();
        for (j = 0; j < C; j++) {
            __m256 x = t[i * C + j], x2 = _mm256_mul_ps(x, x);
            acc[j % AM_LANES] = _mm256_add_ps(acc[j % AM_LANES], x2);
            cols[j] = _mm256_add_ps(cols[j], x2);
        }
        rows[i] = lanesum_v(acc);
    }
}

AM_INLINE void stats8(const void *g, const int gdt, int64_t R, int64_t C,
                      int64_t b, float *rowsum, float *colsum) {
    __m256 t[AM_MATS_MAX_ELEMS], col[MAXD], rows[MAXD];
    load_t(g, gdt, R * C, b, t);
    sums_v(t, R, C, rows, col);
    scatter_rows(rowsum + b * R, R, R, rows);
    scatter_rows(colsum + b * C, C, C, col);
}

void am_avx2_stats_mats(const void *g, int gdt, int64_t R, int64_t C,
                        int64_t b0, int64_t b1, float *rowsum, float *colsum) {
    int64_t b = b0;
    if (fits(R, C)) {
#define AM_STATS_LOOP(GD, RR, CC)                                             \
    for (; b + 8 <= b1; b += 8) stats8(g, GD, RR, CC, b, rowsum, colsum)
#define AM_STATS_DT(RR, CC)                                                   \
    switch (gdt) {                                                            \
    case AM_DTYPE_FLOAT32: AM_STATS_LOOP(0, RR, CC); break;                   \
    case AM_DTYPE_BFLOAT16: AM_STATS_LOOP(1, RR, CC); break;                  \
    default: AM_STATS_LOOP(2, RR, CC); break;                                 \
    }
        AM_SHAPES(AM_STATS_DT)
#undef AM_STATS_LOOP
#undef AM_STATS_DT
    }
    _mm256_zeroupper(); /* before the scalar code (simd.h, AM_CLEAN_RETURN) */
    if (b < b1) am_kernels_ref.stats_mats(g, gdt, R, C, b, b1, rowsum, colsum);
}

/* --------------------------------------------------------------- u2 ---- */

/* The sums of u^2 of 8 transposed matrices (t) with factors rfv, cfv into
 * out[0..7]. */
AM_INLINE void u2_v(const __m256 *t, int64_t R, int64_t C, const __m256 *rfv,
                    const __m256 *cfv, double *out) {
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    int64_t i, j;
    for (i = 0; i < R; i++) {
        __m256 acc[AM_LANES], s;
        int l;
        for (l = 0; l < AM_LANES; l++) acc[l] = _mm256_setzero_ps();
        for (j = 0; j < C; j++) {
            __m256 u = _mm256_mul_ps(_mm256_mul_ps(rfv[i], cfv[j]), t[i * C + j]);
            acc[j % AM_LANES] = _mm256_add_ps(acc[j % AM_LANES], _mm256_mul_ps(u, u));
        }
        s = lanesum_v(acc);
        lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(s)));
        hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(s, 1)));
    }
    _mm256_storeu_pd(out, lo);
    _mm256_storeu_pd(out + 4, hi);
}

AM_INLINE void u2_8(const void *g, const int gdt, int64_t R, int64_t C,
                    int64_t b, const float *rf, const float *cf, double *out) {
    __m256 t[AM_MATS_MAX_ELEMS], rfv[MAXD], cfv[MAXD];
    load_t(g, gdt, R * C, b, t);
    gather_rows(rf + b * R, R, R, rfv);
    gather_rows(cf + b * C, C, C, cfv);
    u2_v(t, R, C, rfv, cfv, out);
}

void am_avx2_u2_mats(const void *g, int gdt, int64_t R, int64_t C, int64_t b0,
                     int64_t b1, const float *rf, const float *cf, double *out) {
    int64_t b = b0;
    if (fits(R, C)) {
#define AM_U2_LOOP(GD, RR, CC)                                                \
    for (; b + 8 <= b1; b += 8) u2_8(g, GD, RR, CC, b, rf, cf, out + (b - b0))
#define AM_U2_DT(RR, CC)                                                      \
    switch (gdt) {                                                            \
    case AM_DTYPE_FLOAT32: AM_U2_LOOP(0, RR, CC); break;                      \
    case AM_DTYPE_BFLOAT16: AM_U2_LOOP(1, RR, CC); break;                     \
    default: AM_U2_LOOP(2, RR, CC); break;                                    \
    }
        AM_SHAPES(AM_U2_DT)
#undef AM_U2_LOOP
#undef AM_U2_DT
    }
    _mm256_zeroupper(); /* before the scalar code (simd.h, AM_CLEAN_RETURN) */
    if (b < b1) am_kernels_ref.u2_mats(g, gdt, R, C, b, b1, rf, cf, out + (b - b0));
}

/* ---------------------------------------------------------- moments ---- */

/* ema(old, x) = old*beta2 + x*(1 - beta2), as am_ema. */
AM_INLINE __m256 ema_v(__m256 old, __m256 x, const am_consts *k) {
    return _mm256_add_ps(_mm256_mul_ps(old, _mm256_set1_ps(k->beta2)),
                         _mm256_mul_ps(x, _mm256_set1_ps(k->one_m_beta2)));
}

/* am_row_factor of 8 rows: sqrt(mean / nr), from the quotient scaled by
 * 2^-64 where it overflows (rare: a branch). */
AM_INLINE __m256 rf_v(__m256 mean, __m256 nr) {
    const __m256 q = _mm256_div_ps(mean, nr);
    const __m256 big = _mm256_cmp_ps(q, _mm256_set1_ps(AM_FLT_MAX), _CMP_GT_OQ);
    __m256 r = _mm256_sqrt_ps(q);
    if (_mm256_movemask_ps(big)) {
        const __m256 s = _mm256_mul_ps(
            _mm256_sqrt_ps(_mm256_div_ps(_mm256_mul_ps(mean, _mm256_set1_ps(AM_RF_DOWN)), nr)),
            _mm256_set1_ps(AM_RF_UP));
        r = _mm256_blendv_ps(r, s, big);
    }
    return r;
}

/* 1 / sqrt(x), IEEE (as am_rsqrt). */
AM_INLINE __m256 rsqrt_v(__m256 x) {
    return _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_sqrt_ps(x));
}

/* The new moments and factors of 8 matrices from their sums of g*g (rows,
 * cols as vectors), stored; the factors also into rfv, cfv. */
AM_INLINE void moments_v(int64_t R, int64_t C, int64_t b, const float *row,
                         const float *col, const __m256 *rows, const __m256 *cols,
                         const am_consts *k, float *nr, float *nc, float *rf,
                         float *cf, float *rmean, __m256 *rfv, __m256 *cfv) {
    __m256 v[MAXD];
    /* am_moment, am_row_factor */
    const __m256 Cinv = _mm256_set1_ps(am_inv_count(C)), Rinv = _mm256_set1_ps(am_inv_count(R));
    const __m256 eps = _mm256_set1_ps(k->eps);
    __m256 s = _mm256_setzero_ps(), mean;
    int64_t i, j;
    gather_rows(row + b * R, R, R, v);
    for (i = 0; i < R; i++) {
        v[i] = ema_v(v[i], _mm256_add_ps(_mm256_mul_ps(rows[i], Cinv), eps), k);
        s = _mm256_add_ps(s, v[i]);
    }
    mean = _mm256_mul_ps(s, Rinv);
    if (rmean) _mm256_storeu_ps(rmean + b, mean);
    for (i = 0; i < R; i++) rfv[i] = rf_v(mean, v[i]);
    scatter_rows(nr + b * R, R, R, v);
    scatter_rows(rf + b * R, R, R, rfv);
    gather_rows(col + b * C, C, C, v);
    for (j = 0; j < C; j++) {
        v[j] = ema_v(v[j], _mm256_add_ps(_mm256_mul_ps(cols[j], Rinv), eps), k);
        cfv[j] = rsqrt_v(v[j]);
    }
    scatter_rows(nc + b * C, C, C, v);
    scatter_rows(cf + b * C, C, C, cfv);
}

AM_INLINE void moments8(int64_t R, int64_t C, int64_t b, const float *row,
                        const float *col, const float *rs, const float *cs,
                        const am_consts *k, float *nr, float *nc, float *rf,
                        float *cf, float *rmean) {
    __m256 w[MAXD], x[MAXD], rfv[MAXD], cfv[MAXD];
    gather_rows(rs + b * R, R, R, w);
    gather_rows(cs + b * C, C, C, x);
    moments_v(R, C, b, row, col, w, x, k, nr, nc, rf, cf, rmean, rfv, cfv);
}

/* One matrix's new moments and factors, as ref_moments_mat (the same
 * operations, so the same bits) 8 elements at a time; the row mean's sum
 * stays one chain in row order. For the matrices too big for moments8:
 * scalar, the square roots and divisions of a (16, 1024) matrix's columns
 * were 26% of its update. */
static void moments_one(int64_t R, int64_t C, const float *row, const float *col,
                        const float *rs, const float *cs, const am_consts *k, float *nr,
                        float *nc, float *rf, float *cf, float *rmean) {
    const float Cinv = am_inv_count(C), Rinv = am_inv_count(R);
    const __m256 Cv = _mm256_set1_ps(Cinv), Rv = _mm256_set1_ps(Rinv);
    const __m256 eps = _mm256_set1_ps(k->eps);
    __m256 mean;
    float s = 0.0f;
    int64_t i, j;
    for (i = 0; i + 8 <= R; i += 8)
        _mm256_storeu_ps(nr + i, ema_v(_mm256_loadu_ps(row + i),
                                       _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(rs + i), Cv),
                                                     eps), k));
    for (; i < R; i++) nr[i] = am_moment(row[i], rs[i], Cinv, k);
    for (i = 0; i < R; i++) s += nr[i];
    *rmean = s * Rinv;
    mean = _mm256_set1_ps(*rmean);
    for (i = 0; i + 8 <= R; i += 8)
        _mm256_storeu_ps(rf + i, rf_v(mean, _mm256_loadu_ps(nr + i)));
    for (; i < R; i++) rf[i] = am_row_factor(nr[i], *rmean);
    for (j = 0; j + 8 <= C; j += 8) {
        const __m256 v = ema_v(_mm256_loadu_ps(col + j),
                               _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(cs + j), Rv), eps), k);
        _mm256_storeu_ps(nc + j, v);
        _mm256_storeu_ps(cf + j, rsqrt_v(v));
    }
    for (; j < C; j++) {
        nc[j] = am_moment(col[j], cs[j], Rinv, k);
        cf[j] = am_rsqrt(nc[j]);
    }
}

void am_avx2_moments_mats(int64_t R, int64_t C, int64_t b0, int64_t b1,
                          const float *row, const float *col, const float *rs,
                          const float *cs, const am_consts *k, float *nr,
                          float *nc, float *rf, float *cf, float *rmean) {
    int64_t b = b0;
    if (R <= MAXD && C <= MAXD) {
#define AM_MOM(RR, CC)                                                        \
    for (; b + 8 <= b1; b += 8)                                               \
        moments8(RR, CC, b, row, col, rs, cs, k, nr, nc, rf, cf, rmean)
        AM_SHAPES(AM_MOM)
#undef AM_MOM
    }
    if (R * C >= 64) /* scalar below: the call and the tails would cost more */
        for (; b < b1; b++)
            moments_one(R, C, row + b * R, col + b * C, rs + b * R, cs + b * C, k,
                        nr + b * R, nc + b * C, rf + b * R, cf + b * C, rmean + b);
    _mm256_zeroupper(); /* before the scalar code (simd.h, AM_CLEAN_RETURN) */
    if (b < b1)
        am_kernels_ref.moments_mats(R, C, b, b1, row, col, rs, cs, k, nr, nc, rf,
                                    cf, rmean);
}

/* ------------------------------------------------------ stats + u2 ---- */

/* stats8, moments8 and u2_8 of the same 8 matrices with the elements, the
 * sums and the factors kept in registers: one transpose of g instead of
 * two, no round trip of the sums and factors through memory. The same
 * operations in the same order as the three, so the same bits. (Counting
 * the agreement here too, so that finish could skip its sweep, was
 * measured: the bit transposes cost more than the AVX-512 sweep.) */
AM_INLINE void stats_u2_8(const void *g, const int gdt, int64_t R, int64_t C, int64_t b,
                          const float *row, const float *col, const am_consts *k,
                          float *rs, float *cs, float *nr, float *nc, float *rf,
                          float *cf, float *rmean, double *out, __m256 *mr, __m256 *mc,
                          float *orow, float *ocol) {
    __m256 t[AM_MATS_MAX_ELEMS], cols[MAXD], rows[MAXD], rfv[MAXD], cfv[MAXD];
    int64_t x;
    if (orow) { /* the old moments, before nr and nc may overwrite them */
        memcpy(orow + b * R, row + b * R, (size_t)(8 * R) * sizeof(float));
        memcpy(ocol + b * C, col + b * C, (size_t)(8 * C) * sizeof(float));
    }
    load_t(g, gdt, R * C, b, t);
    sums_v(t, R, C, rows, cols);
    if (rs) scatter_rows(rs + b * R, R, R, rows);
    if (cs) scatter_rows(cs + b * C, C, C, cols);
    moments_v(R, C, b, row, col, rows, cols, k, nr, nc, rf, cf, rmean, rfv, cfv);
    u2_v(t, R, C, rfv, cfv, out);
    for (x = 0; x < R; x++) *mr = _mm256_min_ps(rfv[x], *mr);
    for (x = 0; x < C; x++) *mc = _mm256_min_ps(cfv[x], *mc);
}

void am_avx2_stats_u2_mats(const void *g, int gdt, int64_t R, int64_t C, int64_t b0,
                           int64_t b1, const float *row, const float *col,
                           const am_consts *k, float *rs, float *cs, float *nr,
                           float *nc, float *rf, float *cf, float *rmean, double *out,
                           float *fmin, float *orow, float *ocol) {
    int64_t b = b0;
    __m256 mr = _mm256_set1_ps(INFINITY), mc = mr;
    float lr[8], lc[8], rest[2] = {INFINITY, INFINITY};
    int l;
    if (fits(R, C)) {
#define AM_SU_LOOP(GD, RR, CC)                                                \
    for (; b + 8 <= b1; b += 8)                                               \
        stats_u2_8(g, GD, RR, CC, b, row, col, k, rs, cs, nr, nc, rf, cf, rmean, \
                   out + (b - b0), &mr, &mc, orow, ocol)
#define AM_SU_DT(RR, CC)                                                      \
    switch (gdt) {                                                            \
    case AM_DTYPE_FLOAT32: AM_SU_LOOP(0, RR, CC); break;                      \
    case AM_DTYPE_BFLOAT16: AM_SU_LOOP(1, RR, CC); break;                     \
    default: AM_SU_LOOP(2, RR, CC); break;                                    \
    }
        AM_SHAPES(AM_SU_DT)
#undef AM_SU_LOOP
#undef AM_SU_DT
    }
    _mm256_storeu_ps(lr, mr);
    _mm256_storeu_ps(lc, mc);
    _mm256_zeroupper(); /* before the scalar code (simd.h, AM_CLEAN_RETURN) */
    if (b < b1)
        am_kernels_ref.stats_u2_mats(g, gdt, R, C, b, b1, row, col, k, rs, cs, nr, nc, rf,
                                     cf, rmean, out + (b - b0), rest, orow, ocol);
    fmin[0] = rest[0];
    fmin[1] = rest[1];
    for (l = 0; l < 8; l++) {
        if (lr[l] < fmin[0]) fmin[0] = lr[l];
        if (lc[l] < fmin[1]) fmin[1] = lc[l];
    }
}

#else /* not built for x86-64 with AVX2 + F16C: never referenced */

typedef int am_kernels_avx2_mats_unused;

#endif
