/*
 * kernels_avx2.c — AVX2 + F16C kernels, bit-identical to kernels_ref.c.
 *
 * How the bits stay identical:
 *   - every lane sum keeps the reference's 8 lanes: a 256-bit vector holds
 *     lanes 0..7 of the span, element j of a span in lane (j - j0) % 8, and
 *     the tail (< 8 elements) is added to the stored lanes in scalar code
 *     before am_lanesum_finish combines them in the canonical order;
 *   - column sums are vectorised across columns, each column still summed
 *     over rows in ascending order;
 *   - no fused multiply-add (the file is built with -mavx2 -mf16c only, and
 *     -ffp-contract=off), IEEE sqrt/div (1/sqrt is am_rsqrt, not rsqrt_ps);
 *   - conversions: bf16 widening is a shift, F16C's half->float is exact,
 *     stochastic rounding adds the same Philox words (SPEC 5) and falls back
 *     to am_sr_f16 per lane outside the normal half range.
 * Per-element dtypes are compile-time constants inside each kernel body
 * (always-inlined bodies behind a switch), so the inner loops do not branch.
 * Built only for x86-64; dispatch.c checks the CPU before using it.
 */
#include "simd.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__F16C__)

#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "am_bits.h"
#include "avx2_load.h"
#include "noisewin.h"

#define AM_INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------ loads/stores ---- */

/* Software prefetch distance, elements ahead of the parameter stream. */
#define AM_PREFETCH 512

AM_INLINE int64_t esize(const int dt) { return dt == AM_DTYPE_FLOAT32 ? 4 : 2; }


/* ------------------------------------------------------------ Philox ---- */

/* am_rng_quad for quads q0..q0+31, written as 128 words: out[4k + w] is
 * word w of quad q0 + k. One Philox instance per 64-bit lane, its 32-bit
 * words in the low halves (_mm256_mul_epu32 reads exactly those, so the
 * upper halves may hold garbage between rounds); four independent chains of
 * four instances at a time hide the multiply latency. */
static void philox_16(uint64_t seed, uint32_t pid, int64_t step, int64_t q0,
                      uint32_t *out) {
    const __m256i M0 = _mm256_set1_epi64x(0xD2511F53), M1 = _mm256_set1_epi64x(0xCD9E8D57);
    const __m256i lo32 = _mm256_set1_epi64x(0xffffffff);
    const __m256i lane = _mm256_setr_epi64x(0, 1, 2, 3);
    __m256i c0[4], c1[4], c2[4], c3[4];
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    int r, ch;
    for (ch = 0; ch < 4; ch++) {
        __m256i q = _mm256_add_epi64(_mm256_set1_epi64x((long long)(q0 + 4 * ch)), lane);
        c0[ch] = q;
        c1[ch] = _mm256_srli_epi64(q, 32);
        c2[ch] = _mm256_set1_epi64x(pid);
        c3[ch] = _mm256_set1_epi64x((uint32_t)(uint64_t)step);
    }
    for (r = 0; r < AM_SR_ROUNDS; r++) {
        const __m256i K0 = _mm256_set1_epi64x(k0), K1 = _mm256_set1_epi64x(k1);
        for (ch = 0; ch < 4; ch++) {
            __m256i p0 = _mm256_mul_epu32(c0[ch], M0), p1 = _mm256_mul_epu32(c2[ch], M1);
            c0[ch] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p1, 32), c1[ch]), K0);
            c2[ch] = _mm256_xor_si256(_mm256_xor_si256(_mm256_srli_epi64(p0, 32), c3[ch]), K1);
            c1[ch] = p1;
            c3[ch] = p0;
        }
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    for (ch = 0; ch < 4; ch++) {
        /* a: words 0,1 of each quad; b: words 2,3; interleave a0 b0 a1 b1.. */
        __m256i a = _mm256_or_si256(_mm256_and_si256(c0[ch], lo32), _mm256_slli_epi64(c1[ch], 32));
        __m256i b = _mm256_or_si256(_mm256_and_si256(c2[ch], lo32), _mm256_slli_epi64(c3[ch], 32));
        __m256i l = _mm256_unpacklo_epi64(a, b), h = _mm256_unpackhi_epi64(a, b);
        _mm256_storeu_si256((__m256i *)(out + 16 * ch), _mm256_permute2x128_si256(l, h, 0x20));
        _mm256_storeu_si256((__m256i *)(out + 16 * ch + 8), _mm256_permute2x128_si256(l, h, 0x31));
    }
}

static void philox32_avx2(uint64_t seed, uint32_t pid, int64_t step,
                          int64_t q0, uint32_t *out) {
    philox_16(seed, pid, step, q0, out);
    philox_16(seed, pid, step, q0 + 16, out + 64);
}

/* The generator in use: AVX-512 when the CPU has it (set once by
 * am_kernels_avx2, before any kernel runs), AVX2 otherwise. */
static am_philox_fn g_philox = philox32_avx2;

/* The rounding noise of one apply (am_sr_noise): am_noisewin (noisewin.h),
 * filled by g_philox between spans, never inside one. */
typedef am_noisewin rngwin;

/* The 16-bit noise of elements f..f+7, one 32-bit lane per element; the
 * window holds them (am_noise_span). */
AM_INLINE __m256i rnd8(const rngwin *w, int64_t f) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)am_noise_at(w, f)));
}

static void rng_init(rngwin *w, uint64_t seed, uint32_t pid, int64_t step, int64_t off) {
    am_noise_init(w, g_philox, seed, pid, step, off);
}

/* Stores v into elements i..i+7, stochastically rounded with the noise of
 * w for 16-bit types (w unused for float32); same bits as am_store_sr with
 * am_sr_noise. */
AM_INLINE void st8(void *base, const int dt, int64_t i, __m256 v, rngwin *w) {
    __m256i b, r, rnd;
    if (dt == AM_DTYPE_FLOAT32) {
        _mm256_storeu_ps((float *)base + i, v);
        return;
    }
    rnd = rnd8(w, i);
    b = _mm256_castps_si256(v);
    if (dt == AM_DTYPE_BFLOAT16) {
        /* finite and inf: (b + rnd16) >> 16 (an infinity's low 16 bits are
         * zero, so the noise never reaches its high half); NaN:
         * (b >> 16) | 0x40, in the rare branch. rnd holds 16 bits. */
        const __m256 isnan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
        r = _mm256_add_epi32(b, rnd);
        if (!_mm256_testz_ps(isnan, isnan))
            r = _mm256_blendv_epi8(r, _mm256_or_si256(b, _mm256_set1_epi32(0x00400000)),
                                   _mm256_castps_si256(isnan));
        r = _mm256_srli_epi32(r, 16);
        _mm_storeu_si128((__m128i *)((uint16_t *)base + i),
                         _mm_packus_epi32(_mm256_castsi256_si128(r),
                                          _mm256_extracti128_si256(r, 1)));
    } else {
        /* Normal half range: add 13 random bits, truncate, then the value is
         * on the half grid and F16C's round-to-nearest converts it exactly
         * (or overflows to inf exactly as am_f32_to_f16_rne does). The bits
         * are added to the signed pattern (|b| + 0x1fff stays below the sign
         * bit); bad: |b| outside [2^-14, max float], one signed compare
         * after shifting the range's start to INT32_MIN. */
        const __m256i ab = _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff));
        __m256i t = _mm256_add_epi32(b, _mm256_and_si256(rnd, _mm256_set1_epi32(0x1fff)));
        const __m256i bad = _mm256_cmpgt_epi32(
            _mm256_add_epi32(ab, _mm256_set1_epi32((int32_t)(0x80000000u - 0x38800000u))),
            _mm256_set1_epi32((int32_t)(0x80000000u + (0x7f7fffffu - 0x38800000u))));
        __m128i h;
        t = _mm256_and_si256(t, _mm256_set1_epi32(~0x1fff));
        h = _mm256_cvtps_ph(_mm256_castsi256_ps(t), _MM_FROUND_TO_NEAREST_INT);
        if (!_mm256_testz_si256(bad, bad)) {
            /* Rare: half subnormals, zeros, inf, NaN — set aside, rounded
             * by the scalar rule after the span (am_noise_end) */
            _mm256_storeu_ps(w->fv + (i - w->span0), v);
            w->fixmask |= (uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(bad))
                          << (i - w->span0);
        }
        _mm_storeu_si128((__m128i *)((uint16_t *)base + i), h);
    }
}

/* ------------------------------------------------------------ stats ---- */

/* The running minimum of the positive elements of x, kept as the smallest
 * unsigned (bits of x) - 1: +0 becomes 0xffffffff and every negative value
 * (-0 included) at least 0x7fffffff, so positive values, whose bit order is
 * their order, win over them (two integer operations; a blend against +inf
 * costs three on recent Intel cores). See minpos_of for the way back. */
AM_INLINE __m256i min_pos(__m256i mn, __m256 x) {
    return _mm256_min_epu32(mn, _mm256_sub_epi32(_mm256_castps_si256(x),
                                                 _mm256_set1_epi32(1)));
}

/* The smallest positive element recorded by min_pos, +inf when none: a
 * result past +inf's bits is a NaN (never positive), 0 a wrapped +0, and
 * 0x80000000 and above negative. */
static float minpos_of(__m256i mn) {
    uint32_t v[8], best = 0xffffffffu;
    int l;
    _mm256_storeu_si256((__m256i *)v, mn);
    for (l = 0; l < 8; l++)
        if (v[l] < best) best = v[l];
    return am_minpos_from_bits(best);
}

/* Bit l: lane l of x is > 0. */
AM_INLINE uint32_t pos8(__m256 x) {
    return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
}

/* Columns j..j+7 of the four rows of stats_body: squares into the row
 * accumulators (each row its 8 lanes) and into the column sums (rows in
 * ascending order); with cnt, each row's sign bits go to bit 8 * v of
 * nb[] and the positive values to the running minimum. */
#define AM_STATS4(J, V)                                                       \
    do {                                                                      \
        __m256 x0 = am_ld8(g, gdt, b0 + (J)), x1 = am_ld8(g, gdt, b1 + (J));  \
        __m256 x2 = am_ld8(g, gdt, b2 + (J)), x3 = am_ld8(g, gdt, b3 + (J));  \
        __m256 c = _mm256_loadu_ps(colpart + (J));                            \
        if (cnt) {                                                            \
            nb[0] |= pos8(x0) << (8 * (V));                                   \
            nb[1] |= pos8(x1) << (8 * (V));                                   \
            nb[2] |= pos8(x2) << (8 * (V));                                   \
            nb[3] |= pos8(x3) << (8 * (V));                                   \
            mn = min_pos(min_pos(min_pos(min_pos(mn, x0), x1), x2), x3);      \
        }                                                                     \
        x0 = _mm256_mul_ps(x0, x0);                                           \
        x1 = _mm256_mul_ps(x1, x1);                                           \
        x2 = _mm256_mul_ps(x2, x2);                                           \
        x3 = _mm256_mul_ps(x3, x3);                                           \
        a0 = _mm256_add_ps(a0, x0);                                           \
        a1 = _mm256_add_ps(a1, x1);                                           \
        a2 = _mm256_add_ps(a2, x2);                                           \
        a3 = _mm256_add_ps(a3, x3);                                           \
        c = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c, x0), x1), x2), x3); \
        _mm256_storeu_ps(colpart + (J), c);                                   \
    } while (0)

/* Columns per chunk of stats_body's interleaving of a group's stats and
 * the previous group's W sums (a multiple of 32). */
#define AM_WSUM_CHUNK 128

/* Tile columns J..J+7 of the W sums of the group of nq rows (4 or 1, a
 * constant) whose first element (column j0) is at flat index pb, row
 * weights wv (am_wsum, internal.h). */
AM_INLINE void wsum8(const void *g, const int gdt, int64_t C, int64_t pb, int64_t J,
                     const int nq, const __m256 *wv, float *wpart) {
    __m256 x = am_ld8(g, gdt, pb + J), s = _mm256_mul_ps(_mm256_mul_ps(x, x), wv[0]);
    if (nq == 4) {
        x = am_ld8(g, gdt, pb + C + J);
        s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_mul_ps(x, x), wv[1]));
        x = am_ld8(g, gdt, pb + 2 * C + J);
        s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_mul_ps(x, x), wv[2]));
        x = am_ld8(g, gdt, pb + 3 * C + J);
        s = _mm256_add_ps(s, _mm256_mul_ps(_mm256_mul_ps(x, x), wv[3]));
    }
    _mm256_storeu_ps(wpart + J, _mm256_add_ps(_mm256_loadu_ps(wpart + J), s));
}

/* The W sums of the group of nq rows from row i over tile columns
 * j0..j0+n-1 in one sweep. */
AM_INLINE void wsum_rows(const void *g, const int gdt, int64_t C, int64_t i, const int nq,
                         int64_t j0, int64_t n, const float *w, float *wpart) {
    const int64_t nv = n & ~(int64_t)7;
    __m256 wv[4];
    int64_t j;
    int q;
    for (q = 0; q < nq; q++) wv[q] = _mm256_set1_ps(w[q]);
    for (j = 0; j < nv; j += 8) wsum8(g, gdt, C, i * C + j0, j, nq, wv, wpart);
    am_wsum_cols(g, gdt, C, i, nq, j0, j0 + nv, j0 + n, w, wpart);
}

/* Four rows at a time: four load streams and four row chains (one core
 * reads memory measurably faster with several streams in flight); each
 * column still adds its rows in ascending order. cnt (a constant): also
 * count the agreement of (g > 0) with the stored bits, 32 columns of a row
 * per read of the bits and per popcount (internal.h, stats_tile). */
AM_INLINE void stats_body(const void *g, const int gdt, const int cnt, int64_t C,
                          int64_t i0, int64_t i1, int64_t j0, int64_t j1,
                          float *rowpart, float *colpart, const am_polmap *pm,
                          int32_t *rowmatch, float *minpos, const am_wsum *ws) {
    int64_t n = j1 - j0, nv = n & ~(int64_t)7, i, j;
    const uint8_t *bits = cnt ? pm->bits : NULL;
    __m256i mn = _mm256_set1_epi32(-1);
    float mp = INFINITY, mv, w[4];
    __m256 wv[4];
    /* W sums of a group of 4 rows are added while the next group streams
     * in (pi: its first row, -1 when none is pending), so that memory is
     * never idle during them; a group's sums still all precede the next's */
    int64_t pi = -1, pb = 0, jc, je;
    float *const wpart = ws ? ws->wpart : NULL;
    const int l2pf = !am_sw_prefetch(); /* the next rows into L2 only (simd.h) */
    for (j = 0; j < n; j++) colpart[j] = 0.0f;
    if (ws)
        for (j = 0; j < n; j++) wpart[j] = 0.0f;
    i = i0;
    if (n == C && (C == 4 || C == 8 || C == 16 || C == 32)) { /* 8 rows at a time */
        uint32_t mb[8];
        _mm256_storeu_si256((__m256i *)mb, mn);
        i = am_avx2_stats_narrow(g, gdt, C, i0, i1, rowpart, colpart, cnt ? pm : NULL,
                                 rowmatch, mb, ws);
        mn = _mm256_loadu_si256((const __m256i *)mb);
    }
    for (; i + 4 <= i1; i += 4) {
        const int64_t b0 = i * C + j0, b1 = b0 + C, b2 = b1 + C, b3 = b2 + C;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        float a[4][AM_LANES];
        int64_t q0[4] = {0, 0, 0, 0}, mism[4] = {0, 0, 0, 0};
        uint32_t nb[4];
        int q;
        const int pf = i + 8 <= i1;
        const size_t es = esize(gdt), rs = (size_t)C * es;
        if (cnt)
            for (q = 0; q < 4; q++) q0[q] = am_polmap_bit(pm, i + q, j0);
        for (jc = 0; jc < nv; jc = je) {
            /* a chunk of columns, then the pending group's W sums over the
             * same columns (separate loops: the registers of one) */
            je = jc + AM_WSUM_CHUNK < nv ? jc + AM_WSUM_CHUNK : nv;
            for (j = jc; cnt && j + 32 <= je; j += 32) {
                nb[0] = nb[1] = nb[2] = nb[3] = 0;
                AM_STATS4(j, 0);
                AM_STATS4(j + 8, 1);
                AM_STATS4(j + 16, 2);
                AM_STATS4(j + 24, 3);
                if (pf) { /* the next group's rows: twice the streams in flight,
                           * which one core needed to read memory at full
                           * speed on earlier machines; into L2 only where
                           * am_sw_prefetch is off (Zen 4, twelfth session:
                           * into L1 no faster than none, into L2 faster;
                           * docs/PERFORMANCE_HISTORY.md). The AVX-512 stats read
                           * one row at a time instead (stats_rows there). */
                    const char *nx = (const char *)g + (size_t)(b3 + C + j) * es;
                    for (q = 0; q < 4; q++) {
                        if (l2pf) {
                            am_prefetch_l2(nx + q * rs, 32 * (int)es);
                        } else {
                            _mm_prefetch(nx + q * rs, _MM_HINT_T0);
                            if (es == 4) _mm_prefetch(nx + q * rs + 64, _MM_HINT_T0);
                        }
                    }
                }
                for (q = 0; q < 4; q++)
                    mism[q] += __builtin_popcount(nb[q] ^ am_bits32_at(bits, q0[q] + j));
            }
            for (; j < je; j += 8) {
                nb[0] = nb[1] = nb[2] = nb[3] = 0;
                AM_STATS4(j, 0);
                if (cnt)
                    for (q = 0; q < 4; q++)
                        mism[q] += __builtin_popcount(nb[q] ^ am_bits8_at(bits, q0[q] + j));
            }
            if (pi >= 0)
                for (j = jc; j < je; j += 8) wsum8(g, gdt, C, pb, j, 4, wv, wpart);
        }
        if (pi >= 0) am_wsum_cols(g, gdt, C, pi, 4, j0, j0 + nv, j0 + n, w, wpart);
        _mm256_storeu_ps(a[0], a0);
        _mm256_storeu_ps(a[1], a1);
        _mm256_storeu_ps(a[2], a2);
        _mm256_storeu_ps(a[3], a3);
        for (q = 0; q < 4; q++) {
            am_stats_row_tail(g, gdt, cnt, (i + q) * C + j0, nv, n, a[q], colpart, bits,
                           q0[q], mism[q], cnt ? rowmatch + (i + q - i0) : NULL, &mp);
            rowpart[i + q - i0] = am_lanesum_finish(a[q]);
        }
        if (ws) {
            for (q = 0; q < 4; q++) {
                w[q] = am_wsum_weight(ws, i + q, rowpart[i + q - i0]);
                wv[q] = _mm256_set1_ps(w[q]);
            }
            pi = i;
            pb = b0;
        }
    }
    if (pi >= 0) wsum_rows(g, gdt, C, pi, 4, j0, n, w, wpart);
    for (; i < i1; i++) {
        const int64_t base = i * C + j0;
        const int64_t q0 = cnt ? am_polmap_bit(pm, i, j0) : 0;
        __m256 acc = _mm256_setzero_ps();
        float a[AM_LANES];
        int64_t mism = 0;
        for (j = 0; j < nv; j += 8) {
            __m256 x = am_ld8(g, gdt, base + j);
            __m256 x2 = _mm256_mul_ps(x, x);
            if (cnt) {
                mism += __builtin_popcount(pos8(x) ^ am_bits8_at(bits, q0 + j));
                mn = min_pos(mn, x);
            }
            acc = _mm256_add_ps(acc, x2);
            _mm256_storeu_ps(colpart + j, _mm256_add_ps(_mm256_loadu_ps(colpart + j), x2));
        }
        _mm256_storeu_ps(a, acc);
        am_stats_row_tail(g, gdt, cnt, base, nv, n, a, colpart, bits, q0, mism,
                       cnt ? rowmatch + (i - i0) : NULL, &mp);
        rowpart[i - i0] = am_lanesum_finish(a);
        if (ws) {
            w[0] = am_wsum_weight(ws, i, rowpart[i - i0]);
            wsum_rows(g, gdt, C, i, 1, j0, n, w, wpart);
        }
    }
    if (cnt) {
        mv = minpos_of(mn);
        if (mv < mp) mp = mv;
        *minpos = mp;
    }
}
#undef AM_STATS4

#define AM_STATS_CASE(GD)                                                     \
    do {                                                                      \
        if (pm) stats_body(g, GD, 1, C, i0, i1, j0, j1, rowpart, colpart, pm, rowmatch, minpos, ws); \
        else stats_body(g, GD, 0, C, i0, i1, j0, j1, rowpart, colpart, NULL, NULL, NULL, ws); \
    } while (0)

static void avx2_stats_tile(const void *g, int gdt, int64_t C, int64_t i0,
                            int64_t i1, int64_t j0, int64_t j1, float *rowpart,
                            float *colpart, const am_polmap *pm, int32_t *rowmatch,
                            float *minpos, const am_wsum *ws) {
    switch (gdt) {
    case AM_DTYPE_FLOAT32: AM_STATS_CASE(0); break;
    case AM_DTYPE_BFLOAT16: AM_STATS_CASE(1); break;
    default: AM_STATS_CASE(2); break;
    }
    _mm256_zeroupper(); /* see AM_CLEAN_RETURN (simd.h) */
}
#undef AM_STATS_CASE

/* ------------------------------------------------------------ u2 ---- */

/* Four rows at a time: four independent load streams and accumulator
 * chains; each row keeps its own 8 lanes and rows are added to the total
 * in ascending order, as the reference does. */
AM_INLINE double u2_tile_body(const void *g, const int gdt, int64_t C, int64_t i0,
                              int64_t i1, int64_t j0, int64_t j1, const float *rf,
                              const float *cf) {
    int64_t n = j1 - j0, nv = n & ~(int64_t)7, i, j;
    const float *cfj = cf + j0;
    double total = 0.0;
    for (i = i0; i + 4 <= i1; i += 4) {
        const int64_t b0 = i * C + j0, b1 = b0 + C, b2 = b1 + C, b3 = b2 + C;
        const __m256 r0 = _mm256_set1_ps(rf[i]), r1 = _mm256_set1_ps(rf[i + 1]);
        const __m256 r2 = _mm256_set1_ps(rf[i + 2]), r3 = _mm256_set1_ps(rf[i + 3]);
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        float a[4][AM_LANES];
        int q;
        for (j = 0; j < nv; j += 8) {
            const __m256 c = _mm256_loadu_ps(cfj + j);
            __m256 u0 = _mm256_mul_ps(_mm256_mul_ps(r0, c), am_ld8(g, gdt, b0 + j));
            __m256 u1 = _mm256_mul_ps(_mm256_mul_ps(r1, c), am_ld8(g, gdt, b1 + j));
            __m256 u2 = _mm256_mul_ps(_mm256_mul_ps(r2, c), am_ld8(g, gdt, b2 + j));
            __m256 u3 = _mm256_mul_ps(_mm256_mul_ps(r3, c), am_ld8(g, gdt, b3 + j));
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(u0, u0));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(u1, u1));
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(u2, u2));
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(u3, u3));
        }
        _mm256_storeu_ps(a[0], a0);
        _mm256_storeu_ps(a[1], a1);
        _mm256_storeu_ps(a[2], a2);
        _mm256_storeu_ps(a[3], a3);
        for (q = 0; q < 4; q++) {
            for (j = nv; j < n; j++) {
                float u = (rf[i + q] * cfj[j]) * am_load(g, gdt, (i + q) * C + j0 + j);
                a[q][j & 7] += u * u;
            }
            total += (double)am_lanesum_finish(a[q]);
        }
    }
    for (; i < i1; i++) {
        const int64_t base = i * C + j0;
        const __m256 rfv = _mm256_set1_ps(rf[i]);
        __m256 acc = _mm256_setzero_ps();
        float a[AM_LANES];
        for (j = 0; j < nv; j += 8) {
            __m256 u = _mm256_mul_ps(_mm256_mul_ps(rfv, _mm256_loadu_ps(cfj + j)),
                                     am_ld8(g, gdt, base + j));
            acc = _mm256_add_ps(acc, _mm256_mul_ps(u, u));
        }
        _mm256_storeu_ps(a, acc);
        for (j = nv; j < n; j++) {
            float u = (rf[i] * cfj[j]) * am_load(g, gdt, base + j);
            a[j & 7] += u * u;
        }
        total += (double)am_lanesum_finish(a);
    }
    return total;
}

static double avx2_u2_tile(const void *g, int gdt, int64_t C, int64_t i0,
                           int64_t i1, int64_t j0, int64_t j1, const float *rf,
                           const float *cf) {
    switch (gdt) {
    case AM_DTYPE_FLOAT32: AM_CLEAN_RETURN(double, u2_tile_body(g, 0, C, i0, i1, j0, j1, rf, cf));
    case AM_DTYPE_BFLOAT16: AM_CLEAN_RETURN(double, u2_tile_body(g, 1, C, i0, i1, j0, j1, rf, cf));
    default: AM_CLEAN_RETURN(double, u2_tile_body(g, 2, C, i0, i1, j0, j1, rf, cf));
    }
}

/* The new sq = ema(sq, g*g), lanes as the reference. */
AM_INLINE __m256 flat_v(__m256 x, __m256 sqv, const am_consts *k) {
    return _mm256_add_ps(_mm256_mul_ps(sqv, _mm256_set1_ps(k->beta2)),
                         _mm256_mul_ps(_mm256_mul_ps(x, x), _mm256_set1_ps(k->one_m_beta2)));
}

/* u = rsqrt(ema(sq, g*g) + eps) * g (before the clip), lanes as the
 * reference; the new sq in *vout. */
AM_INLINE __m256 flat_u(__m256 x, __m256 sqv, const am_consts *k, __m256 *vout) {
    __m256 v = flat_v(x, sqv, k);
    __m256 r = _mm256_div_ps(_mm256_set1_ps(1.0f),
                             _mm256_sqrt_ps(_mm256_add_ps(v, _mm256_set1_ps(k->eps))));
    *vout = v;
    return _mm256_mul_ps(r, x);
}

/* NaN where an element's new ema(sq, g*g) is bad (am_flat_bad: not finite,
 * g*g overflowed, or below -eps): the update is then skipped, as in the
 * reference kernel. */
AM_INLINE double u2_flat_body(const void *g, const int gdt, const float *sq,
                              int64_t e0, int64_t e1, const am_consts *k) {
    const __m256i expo = _mm256_set1_epi32(0x7f800000);
    const __m256 eps = _mm256_set1_ps(k->eps);
    __m256 acc = _mm256_setzero_ps(), d;
    __m256i bad = _mm256_setzero_si256();
    float a[AM_LANES];
    int64_t e = e0;
    int overflow;
    const int pf = am_sw_prefetch();
    for (; e + 8 <= e1; e += 8) {
        const __m256 x = am_ld8(g, gdt, e);
        if (pf && (e & 15) == 0) { /* one line of sq per two vectors */
            _mm_prefetch((const char *)(sq + e + AM_FLAT_PREFETCH), _MM_HINT_T0);
            _mm_prefetch((const char *)g + (e + AM_FLAT_PREFETCH) * esize(gdt), _MM_HINT_T0);
        }
        d = _mm256_add_ps(flat_v(x, _mm256_loadu_ps(sq + e), k), eps);
        /* am_flat_u2 */
        acc = _mm256_add_ps(acc, _mm256_mul_ps(x, _mm256_div_ps(x, d)));
        /* am_flat_bad: bits of v + eps >= +inf's, unsigned (max == bits) */
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(
                                       _mm256_max_epu32(_mm256_castps_si256(d), expo),
                                       _mm256_castps_si256(d)));
    }
    _mm256_storeu_ps(a, acc);
    overflow = !_mm256_testz_si256(bad, bad);
    for (; e < e1; e++) {
        float x = am_load(g, gdt, e);
        float vv = am_ema(sq[e], x * x, k);
        overflow |= am_flat_bad(vv, k->eps);
        a[(e - e0) & 7] += am_flat_u2(x, vv, k->eps);
    }
    return overflow ? (double)NAN : (double)am_lanesum_finish(a);
}

static double avx2_u2_flat(const void *g, int gdt, const float *sq, int64_t e0,
                           int64_t e1, const am_consts *k) {
    switch (gdt) {
    case AM_DTYPE_FLOAT32: AM_CLEAN_RETURN(double, u2_flat_body(g, 0, sq, e0, e1, k));
    case AM_DTYPE_BFLOAT16: AM_CLEAN_RETURN(double, u2_flat_body(g, 1, sq, e0, e1, k));
    default: AM_CLEAN_RETURN(double, u2_flat_body(g, 2, sq, e0, e1, k));
    }
}

/* ----------------------------------------------------------- finish ---- */

/* Narrow matrices (C < 16: conv kernels, e.g. C = 3): rows are too short
 * for vectors, so the lr-row's rows [r0, r1) are walked as one flat stream
 * f = r0*C .. r1*C, with the factor rf[r] * cf[b, j] of each element made in
 * scalar code (the same product the reference rounds). */
#define AM_SMALL_C 16

typedef struct facwalk {
    const float *rf, *cfb;
    int64_t r, r1, i, j, R, C;
    float fr;
} facwalk;

static void fw_init(facwalk *w, const float *rf, const float *cf, int64_t R,
                    int64_t C, int64_t r0, int64_t r1) {
    w->rf = rf;
    w->cfb = cf + (r0 / R) * C;
    w->r = r0;
    w->r1 = r1;
    w->i = r0 % R;
    w->j = 0;
    w->R = R;
    w->C = C;
    w->fr = r0 < r1 ? rf[r0] : 0.0f;
}

/* The factor of the next element of the stream. */
AM_INLINE float fw_next(facwalk *w) {
    float fac = w->fr * w->cfb[w->j];
    if (++w->j == w->C) {
        w->j = 0;
        if (++w->r < w->r1) w->fr = w->rf[w->r];
        if (++w->i == w->R) {
            w->i = 0;
            w->cfb += w->C;
        }
    }
    return fac;
}

AM_INLINE __m256 fw_next8(facwalk *w) {
    float fac[8];
    int l;
    for (l = 0; l < 8; l++) fac[l] = fw_next(w);
    return _mm256_loadu_ps(fac);
}

/* Faster factors for runs of whole small matrices (R*C <= 64, e.g. 3x3):
 * 8 matrices are 8*R*C elements = R*C vectors, and the (row, column) of
 * lane l of vector v repeats from one group of 8 matrices to the next, so
 * the rf and cf indices of every vector are tabulated once per call and the
 * factors gathered: the same product rf[r] * cf[b, j] as fw_next. Covers
 * rows [r0, r0 + rows) with rows a multiple of 8*R; facwalk does the rest. */
typedef struct facfast {
    const float *rfb, *cfb;
    int64_t R, C;
    int n, v;
    __m256i ri[AM_MATS_MAX_ELEMS], ci[AM_MATS_MAX_ELEMS];
} facfast;

/* Returns the rows it covers (0 when the start is not on a matrix or the
 * matrices are too big). */
static int64_t ff_init(facfast *w, const float *rf, const float *cf, int64_t R,
                       int64_t C, int64_t r0, int64_t r1) {
    int32_t ri[8], ci[8];
    am_runpos pos = {0, 0, 0};
    int v;
    if (R * C > AM_MATS_MAX_ELEMS || r0 % R != 0 || r1 - r0 < 8 * R) return 0;
    w->rfb = rf + r0;
    w->cfb = cf + (r0 / R) * C;
    w->R = R;
    w->C = C;
    w->n = (int)(R * C);
    w->v = 0;
    for (v = 0; v < w->n; v++) { /* elements 8 v .. 8 v + 7 of the run */
        am_run_next(&pos, (int)R, (int)C, 8, ri, ci);
        w->ri[v] = _mm256_loadu_si256((const __m256i *)ri);
        w->ci[v] = _mm256_loadu_si256((const __m256i *)ci);
    }
    return (r1 - r0) / (8 * R) * (8 * R);
}

AM_INLINE __m256 ff_next8(facfast *w) {
    __m256 fac = _mm256_mul_ps(_mm256_i32gather_ps(w->rfb, w->ri[w->v], 4),
                               _mm256_i32gather_ps(w->cfb, w->ci[w->v], 4));
    if (++w->v == w->n) {
        w->v = 0;
        w->rfb += 8 * w->R;
        w->cfb += 8 * w->C;
    }
    return fac;
}

AM_INLINE int64_t agree_small(const void *g, const int gdt, int64_t R,
                              int64_t C, int64_t r0, int64_t r1,
                              const float *rf, const float *cf, float scale,
                              uint8_t *pol_row) {
    const __m256 tv = _mm256_set1_ps(am_pos_threshold(scale));
    const int64_t f1 = r1 * C;
    bitw w = {pol_row, 0, 0, 0};
    facwalk fw;
    facfast ff;
    int64_t f = r0 * C, fast = ff_init(&ff, rf, cf, R, C, r0, r1);
    const int64_t ffend = (r0 + fast) * C;
    fw_init(&fw, rf, cf, R, C, r0 + fast, r1);
    for (; f + 8 <= f1; f += 8) {
        __m256 fac = f < ffend ? ff_next8(&ff) : fw_next8(&fw);
        __m256 u = _mm256_mul_ps(fac, am_ld8(g, gdt, f));
        bw_put(&w, (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(u, tv, _CMP_GE_OQ)), 8);
    }
    for (; f < f1; f++) {
        float u = (fw_next(&fw) * am_load(g, gdt, f)) / scale;
        bw_put(&w, u > 0.0f, 1);
    }
    bw_flush(&w);
    return w.matches;
}

AM_INLINE int64_t agree_body(const void *g, const int gdt, int64_t R,
                             int64_t C, int64_t r0, int64_t r1,
                             const float *rf, const float *cf, float scale,
                             uint8_t *pol_row) {
    const __m256 tv = _mm256_set1_ps(am_pos_threshold(scale));
    const int64_t nv = C & ~(int64_t)7, n64 = C & ~(int64_t)63;
    bitw w = {pol_row, 0, 0, 0};
    int64_t r, j;
    for (r = r0; r < r1; r++) {
        const float *cfb = cf + (r / R) * C;
        const __m256 rfv = _mm256_set1_ps(rf[r]);
        const int64_t base = r * C;
#define AM_POL8(J)                                                            \
    ((uint64_t)(uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(                    \
        _mm256_mul_ps(_mm256_mul_ps(rfv, _mm256_loadu_ps(cfb + (J))),         \
                      am_ld8(g, gdt, base + (J))),                               \
        tv, _CMP_GE_OQ)))
        for (j = 0; j < n64; j += 64) {
            uint64_t bits;
            _mm_prefetch((const char *)g + (base + j + AM_PREFETCH) * esize(gdt), _MM_HINT_T0);
            _mm_prefetch((const char *)g + (base + j + 32 + AM_PREFETCH) * esize(gdt), _MM_HINT_T0);
            bits = AM_POL8(j) | AM_POL8(j + 8) << 8 | AM_POL8(j + 16) << 16 |
                            AM_POL8(j + 24) << 24 | AM_POL8(j + 32) << 32 |
                            AM_POL8(j + 40) << 40 | AM_POL8(j + 48) << 48 |
                            AM_POL8(j + 56) << 56;
            bw_put64(&w, bits);
        }
        for (; j < nv; j += 8) bw_put(&w, (uint32_t)AM_POL8(j), 8);
#undef AM_POL8
        for (; j < C; j++) {
            float u = ((rf[r] * cfb[j]) * am_load(g, gdt, base + j)) / scale;
            bw_put(&w, u > 0.0f, 1);
        }
    }
    bw_flush(&w);
    return w.matches;
}

static int64_t avx2_agree_rows(const void *g, int gdt, int64_t R, int64_t C,
                               int64_t r0, int64_t r1, const float *rf,
                               const float *cf, float scale, uint8_t *pol_row) {
    if (C < AM_SMALL_C) switch (gdt) {
        case AM_DTYPE_FLOAT32: AM_CLEAN_RETURN(int64_t, agree_small(g, 0, R, C, r0, r1, rf, cf, scale, pol_row));
        case AM_DTYPE_BFLOAT16: AM_CLEAN_RETURN(int64_t, agree_small(g, 1, R, C, r0, r1, rf, cf, scale, pol_row));
        default: AM_CLEAN_RETURN(int64_t, agree_small(g, 2, R, C, r0, r1, rf, cf, scale, pol_row));
        }
    switch (gdt) {
    case AM_DTYPE_FLOAT32: AM_CLEAN_RETURN(int64_t, agree_body(g, 0, R, C, r0, r1, rf, cf, scale, pol_row));
    case AM_DTYPE_BFLOAT16: AM_CLEAN_RETURN(int64_t, agree_body(g, 1, R, C, r0, r1, rf, cf, scale, pol_row));
    default: AM_CLEAN_RETURN(int64_t, agree_body(g, 2, R, C, r0, r1, rf, cf, scale, pol_row));
    }
}

/* p - lr * (u + wd * p), the wd == 0 case without the add (am_apply). */
AM_INLINE __m256 apply8(__m256 p, __m256 u, __m256 lrv, __m256 wdv, int has_wd) {
    __m256 t = has_wd ? _mm256_add_ps(u, _mm256_mul_ps(wdv, p)) : u;
    return _mm256_sub_ps(p, _mm256_mul_ps(lrv, t));
}

/* One vector of apply_body: elements f..f+7 of the row whose factors are
 * rfv * cfv, iv = 1 / clip scale; returns the sign bits of u (the new
 * polarity). */
AM_INLINE uint32_t apply_vec(void *p, const int pdt, const void *g, const int gdt,
                             int64_t f, __m256 fac, __m256 iv, int unscaled,
                             __m256 lrv, __m256 wdv, int has_wd, rngwin *w) {
    __m256 u = _mm256_mul_ps(fac, am_ld8(g, gdt, f)), v;
    if (!unscaled) u = _mm256_mul_ps(u, iv); /* x * 1 == x exactly */
    v = apply8(am_ld8(p, pdt, f), u, lrv, wdv, has_wd);
    st8(p, pdt, f, v, w);
    return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(u, _mm256_setzero_ps(), _CMP_GT_OQ));
}

/* The short-row applies' prefetch from element base (once per 64
 * elements, as apply_body's): into L1 AM_PREFETCH elements ahead, or into
 * L2 AM_L2_PREFETCH_BYTES of the parameter ahead where software prefetch
 * is off (simd.h). */
AM_INLINE void short_prefetch(const void *p, const void *g, int64_t base, int64_t es,
                              int64_t ges, int pf, int64_t l2ahead) {
    if (pf) {
        _mm_prefetch((const char *)p + (base + AM_PREFETCH) * es, _MM_HINT_T0);
        _mm_prefetch((const char *)g + (base + AM_PREFETCH) * ges, _MM_HINT_T0);
    } else {
        am_prefetch_l2((const char *)p + (base + l2ahead) * es, 64 * (int)es);
        am_prefetch_l2((const char *)g + (base + l2ahead) * ges, 64 * (int)ges);
    }
}

/* apply_body's lrs mode for rows of 8, 16 or 32 elements (e.g. LoRA's
 * (1024, 16) on CPUs without AVX-512): C / 8 vectors per row, the row's bits
 * stored as C / 8 whole bytes (am_lrs_row_bytes) without the bit writer,
 * the column factors' matrix followed from row to row instead of a
 * division per row, the prefetch of apply_body once per 64 elements. The
 * same per-element operations: the same bits. */
AM_INLINE void apply_rows_short(void *p, const int pdt, const void *g, const int gdt, int64_t R,
                                const int64_t C, int64_t r0, int64_t r1, const float *rf,
                                const float *cf, __m256 iv, int unscaled, const float *lrs,
                                __m256 wdv, int has_wd, uint8_t *pol_row, rngwin *w) {
    const int pf = am_sw_prefetch();
    const int64_t es = (int64_t)esize(pdt), ges = (int64_t)esize(gdt);
    const int64_t l2ahead = AM_L2_PREFETCH_BYTES / es;
    const float *cfb = cf + (r0 / R) * C;
    int64_t r, bend = (r0 / R + 1) * R;
    for (r = r0; r < r1; r++) {
        const int64_t base = r * C;
        const __m256 rfv = _mm256_set1_ps(rf[r]), lrv = _mm256_set1_ps(lrs[r - r0]);
        uint32_t bits;
        int v;
        if ((base & 63) == 0) /* as apply_body's 64-element blocks */
            short_prefetch(p, g, base, es, ges, pf, l2ahead);
        am_noise_span(w, pdt, base, C);
        bits = apply_vec(p, pdt, g, gdt, base, _mm256_mul_ps(rfv, _mm256_loadu_ps(cfb)), iv,
                         unscaled, lrv, wdv, has_wd, w);
        for (v = 1; v < C / 8; v++)
            bits |= apply_vec(p, pdt, g, gdt, base + 8 * v,
                              _mm256_mul_ps(rfv, _mm256_loadu_ps(cfb + 8 * v)), iv, unscaled,
                              lrv, wdv, has_wd, w)
                    << (8 * v);
        am_noise_end(p, pdt, w);
        if (pol_row) memcpy(pol_row + (r - r0) * (C / 8), &bits, (size_t)(C / 8));
        if (r + 1 == bend) { /* the next matrix's column factors */
            cfb += C;
            bend += R;
        }
    }
}

/* apply_rows_short for rows of 4 (C == 4, e.g. LoRA's (1024, 4)): two rows
 * a vector, each with its own rf and lr, its 4 bits in the low half of its
 * own byte (the high half kept, as the bit writer keeps it). Returns the
 * first row not done (r1, or r1 - 1 when an odd row is left). */
AM_INLINE int64_t apply_rows4(void *p, const int pdt, const void *g, const int gdt, int64_t R,
                              int64_t r0, int64_t r1, const float *rf, const float *cf,
                              __m256 iv, int unscaled, const float *lrs, __m256 wdv,
                              int has_wd, uint8_t *pol_row, rngwin *w) {
    const int pf = am_sw_prefetch();
    const int64_t es = (int64_t)esize(pdt), ges = (int64_t)esize(gdt);
    const int64_t l2ahead = AM_L2_PREFETCH_BYTES / es;
    const float *cfb = cf + (r0 / R) * 4;
    int64_t r, bend = (r0 / R + 1) * R;
    for (r = r0; r + 2 <= r1; r += 2) {
        const int64_t base = r * 4;
        const __m128 cfa = _mm_loadu_ps(cfb);
        __m256 fac, lrv;
        uint32_t bits;
        if (r + 1 == bend) { /* row r + 1 starts the next matrix */
            cfb += 4;
            bend += R;
        }
        fac = _mm256_mul_ps(
            _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(rf[r])),
                                 _mm_set1_ps(rf[r + 1]), 1),
            _mm256_insertf128_ps(_mm256_castps128_ps256(cfa), _mm_loadu_ps(cfb), 1));
        lrv = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(lrs[r - r0])),
                                   _mm_set1_ps(lrs[r + 1 - r0]), 1);
        if ((base & 63) == 0) /* as apply_body's 64-element blocks */
            short_prefetch(p, g, base, es, ges, pf, l2ahead);
        am_noise_span(w, pdt, base, 8);
        bits = apply_vec(p, pdt, g, gdt, base, fac, iv, unscaled, lrv, wdv, has_wd, w);
        am_noise_end(p, pdt, w);
        if (pol_row) {
            uint8_t *b = pol_row + (r - r0);
            b[0] = (uint8_t)((b[0] & 0xf0u) | (bits & 0xfu));
            b[1] = (uint8_t)((b[1] & 0xf0u) | (bits >> 4 & 0xfu));
        }
        if (r + 2 == bend) { /* row r + 2 starts the next matrix */
            cfb += 4;
            bend += R;
        }
    }
    return r;
}

AM_INLINE void apply_body(void *p, const int pdt, const void *g, const int gdt,
                          int64_t R, int64_t C, int64_t r0, int64_t r1,
                          const float *rf, const float *cf, float inv,
                          float lr, const float *lrs, const am_consts *k, uint64_t seed,
                          uint32_t param_id, int64_t step, int64_t noff, uint8_t *pol_row) {
    const __m256 iv = _mm256_set1_ps(inv);
    __m256 lrv = _mm256_set1_ps(lr);
    const __m256 wdv = _mm256_set1_ps(k->wd);
    const int has_wd = k->wd != 0.0f, unscaled = inv == 1.0f;
    const int64_t nv = C & ~(int64_t)7, n64 = C & ~(int64_t)63;
    const int pf = am_sw_prefetch();
    const int64_t l2ahead = AM_L2_PREFETCH_BYTES / (int64_t)esize(pdt);
    bitw bw = {pol_row, 0, 0, 0};
    rngwin w;
    int64_t r, j;
    rng_init(&w, seed, param_id, step, noff);
    if (lrs && (C == 8 || C == 16 || C == 32)) {
        apply_rows_short(p, pdt, g, gdt, R, C, r0, r1, rf, cf, iv, unscaled, lrs, wdv, has_wd,
                         pol_row, &w);
        return;
    }
    r = r0;
    if (lrs && C == 4) /* pairs of rows; an odd last row below */
        r = apply_rows4(p, pdt, g, gdt, R, r0, r1, rf, cf, iv, unscaled, lrs, wdv, has_wd,
                        pol_row, &w);
    for (; r < r1; r++) {
        const float *cfb = cf + (r / R) * C;
        const __m256 rfv = _mm256_set1_ps(rf[r]);
        const int64_t base = r * C;
        if (lrs) { /* a row of its own lr and bits (internal.h) */
            lr = lrs[r - r0];
            lrv = _mm256_set1_ps(lr);
            if (pol_row) bw_restart(&bw, pol_row + (r - r0) * am_lrs_row_bytes(C));
        }
#define AM_APPLY_VEC(J)                                                       \
    apply_vec(p, pdt, g, gdt, base + (J),                                     \
              _mm256_mul_ps(rfv, _mm256_loadu_ps(cfb + (J))), iv, unscaled,   \
              lrv, wdv, has_wd, &w)
        for (j = 0; j < n64; j += 64) {
            uint64_t bits = 0;
            int v;
            /* Software prefetch: 16-bit parameters (compute-bound: the
             * out-of-order window does not reach far enough ahead) AM_PREFETCH
             * elements ahead in the same streams; float32 (memory-bound, where
             * that costs time) the same columns of the next matrix row: two
             * more streams in flight, which one core needs to read memory at
             * full speed (measured, 4096x4096 apply 14.0 -> 10.8 ms at 1
             * thread, 8.2 -> 6.5 ms at 2; docs/PERFORMANCE_HISTORY.md). Where
             * am_sw_prefetch is off (AMD), into L2 only, further ahead in
             * the same streams (AM_L2_PREFETCH_BYTES; Zen 4 running these
             * kernels: 4096x4096 float32 apply 7.0-7.8 -> 6.4-7.4 ms at 1
             * thread, the previous and this binary alternated). */
            if (pf && pdt != AM_DTYPE_FLOAT32) {
                _mm_prefetch((const char *)p + (base + j + AM_PREFETCH) * (int64_t)esize(pdt), _MM_HINT_T0);
                _mm_prefetch((const char *)g + (base + j + AM_PREFETCH) * (int64_t)esize(gdt), _MM_HINT_T0);
            } else if (pf) {
                const char *np = (const char *)p + (base + C + j) * 4;
                const char *ng = (const char *)g + (base + C + j) * (int64_t)esize(gdt);
                int l;
                for (l = 0; l < 4; l++) {
                    _mm_prefetch(np + 64 * l, _MM_HINT_T0);
                    if (gdt == AM_DTYPE_FLOAT32 || l < 2) _mm_prefetch(ng + 64 * l, _MM_HINT_T0);
                }
            } else { /* AM_L2_PREFETCH_BYTES of p ahead, into L2 (simd.h) */
                am_prefetch_l2((const char *)p + (base + j + l2ahead) * esize(pdt),
                               64 * (int)esize(pdt));
                am_prefetch_l2((const char *)g + (base + j + l2ahead) * esize(gdt),
                               64 * (int)esize(gdt));
            }
            am_noise_span(&w, pdt, base + j, 64);
            for (v = 0; v < 8; v++) bits |= (uint64_t)AM_APPLY_VEC(j + 8 * v) << (8 * v);
            am_noise_end(p, pdt, &w);
            if (pol_row) bw_put64(&bw, bits);
        }
        for (; j < nv; j += 8) {
            uint32_t bits;
            am_noise_span(&w, pdt, base + j, 8);
            bits = AM_APPLY_VEC(j);
            am_noise_end(p, pdt, &w);
            if (pol_row) bw_put(&bw, bits, 8);
        }
#undef AM_APPLY_VEC
        for (; j < C; j++) {
            int pos = am_apply_one(p, pdt, g, gdt, base + j, rf[r] * cfb[j], inv, lr,
                                   k->wd, seed, param_id, step, noff);
            if (pol_row) bw_put(&bw, (uint32_t)pos, 1);
        }
    }
    if (pol_row) bw_flush(&bw);
}

AM_INLINE void apply_small(void *p, const int pdt, const void *g, const int gdt,
                           int64_t R, int64_t C, int64_t r0, int64_t r1,
                           const float *rf, const float *cf, float inv,
                           float lr, const am_consts *k, uint64_t seed,
                           uint32_t param_id, int64_t step, int64_t noff, uint8_t *pol_row) {
    /* one lr for rows [r0, r1): with lrs, AM_APPLY_CASE calls it row by row */
    const __m256 iv = _mm256_set1_ps(inv), lrv = _mm256_set1_ps(lr);
    const __m256 wdv = _mm256_set1_ps(k->wd);
    const int has_wd = k->wd != 0.0f, unscaled = inv == 1.0f;
    const int64_t f1 = r1 * C;
    bitw bw = {pol_row, 0, 0, 0};
    facwalk fw;
    facfast ff;
    rngwin w;
    int64_t f = r0 * C, fast = ff_init(&ff, rf, cf, R, C, r0, r1);
    const int64_t ffend = (r0 + fast) * C;
    rng_init(&w, seed, param_id, step, noff);
    fw_init(&fw, rf, cf, R, C, r0 + fast, r1);
    for (; f + 8 <= f1; f += 8) {
        __m256 fac = f < ffend ? ff_next8(&ff) : fw_next8(&fw);
        uint32_t bits;
        am_noise_span(&w, pdt, f, 8);
        bits = apply_vec(p, pdt, g, gdt, f, fac, iv, unscaled, lrv, wdv, has_wd, &w);
        am_noise_end(p, pdt, &w);
        if (pol_row) bw_put(&bw, bits, 8);
    }
    for (; f < f1; f++) {
        int pos = am_apply_one(p, pdt, g, gdt, f, fw_next(&fw), inv, lr, k->wd, seed,
                               param_id, step, noff);
        if (pol_row) bw_put(&bw, (uint32_t)pos, 1);
    }
    if (pol_row) bw_flush(&bw);
}

#define AM_APPLY_CASE(PD, GD)                                                 \
    if (C < 8 && C != 4 && lrs) { /* (rows of 4: apply_body, in pairs) */     \
        int64_t r_;                                                           \
        for (r_ = r0; r_ < r1; r_++)                                          \
            apply_small(p, PD, g, GD, R, C, r_, r_ + 1, rf, cf, inv,          \
                        lrs[r_ - r0], k, seed, param_id, step, noff,          \
                        pol_row ? pol_row + (r_ - r0) * am_lrs_row_bytes(C) : NULL); \
    } else if (C < AM_SMALL_C && !lrs)                                        \
        apply_small(p, PD, g, GD, R, C, r0, r1, rf, cf, inv, lr, k, seed,     \
                    param_id, step, noff, pol_row);                           \
    else                                                                      \
        apply_body(p, PD, g, GD, R, C, r0, r1, rf, cf, inv, lr, lrs, k, seed, \
                   param_id, step, noff, pol_row)

static void avx2_apply_rows(void *p, int pdt, const void *g, int gdt,
                            int64_t R, int64_t C, int64_t r0, int64_t r1,
                            const float *rf, const float *cf, float inv,
                            float lr, const float *lrs, const am_consts *k, uint64_t seed,
                            uint32_t param_id, int64_t step, int64_t noff, uint8_t *pol_row) {
    AM_DTYPE_PAIRS(pdt, gdt, AM_APPLY_CASE);
    _mm256_zeroupper(); /* see AM_CLEAN_RETURN (simd.h) */
}

/* The constants of finish_flat_body. */
typedef struct flatk {
    __m256 tv, iv, wdv, up, down, lo, hi;
    __m256i lanebit;
    int has_wd, unscaled;
} flatk;

/* Elements e..e+7 of finish_flat_body (e % 8 == 0: the vector owns one
 * whole polarity byte); returns their matches. */
AM_INLINE int flat_vec(void *p, const int pdt, const void *g, const int gdt, float *sq,
                       float *lr, uint8_t *pol, int64_t e, const flatk *c, const am_consts *k,
                       int64_t step, rngwin *w) {
    __m256 v, lrv;
    __m256 u = flat_u(am_ld8(g, gdt, e), _mm256_loadu_ps(sq + e), k, &v);
    unsigned pb, mb;
    pb = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(u, c->tv, _CMP_GE_OQ));
    if (!c->unscaled) u = _mm256_mul_ps(u, c->iv); /* x * 1 == x exactly */
    mb = ~(pb ^ pol[e >> 3]) & 0xffu;
    _mm256_storeu_ps(sq + e, v);
    pol[e >> 3] = (uint8_t)pb;
    lrv = _mm256_loadu_ps(lr + e);
    if (step > 0) {
        __m256i mm = _mm256_and_si256(_mm256_set1_epi32((int)mb), c->lanebit);
        __m256 match = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mm, c->lanebit));
        lrv = _mm256_mul_ps(lrv, _mm256_blendv_ps(c->down, c->up, match));
        lrv = _mm256_blendv_ps(lrv, c->lo, _mm256_cmp_ps(lrv, c->lo, _CMP_NGE_UQ)); /* NaN: min_lr (am_lr_scale) */
        lrv = _mm256_blendv_ps(lrv, c->hi, _mm256_cmp_ps(lrv, c->hi, _CMP_GT_OQ));
        _mm256_storeu_ps(lr + e, lrv);
    }
    st8(p, pdt, e, apply8(am_ld8(p, pdt, e), u, lrv, c->wdv, c->has_wd), w);
    return __builtin_popcount(mb);
}

AM_INLINE int64_t finish_flat_body(void *p, const int pdt, const void *g,
                                   const int gdt, float *sq, float *lr,
                                   uint8_t *pol, int64_t e0, int64_t e1,
                                   float scale, const am_consts *k,
                                   uint64_t seed, uint32_t param_id,
                                   int64_t step, int64_t noff) {
    /* the SPEC's sign of u / scale as u >= tv; the apply's u * (1 / scale)
     * (as ref_finish_flat) */
    flatk c;
    int64_t e = e0, matches = 0;
    rngwin w;
    c.tv = _mm256_set1_ps(am_pos_threshold(scale));
    c.iv = _mm256_set1_ps(1.0f / scale);
    c.wdv = _mm256_set1_ps(k->wd);
    c.up = _mm256_set1_ps(k->bump_up);
    c.down = _mm256_set1_ps(k->bump_down);
    c.lo = _mm256_set1_ps(k->min_lr);
    c.hi = _mm256_set1_ps(k->max_lr);
    c.lanebit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    c.has_wd = k->wd != 0.0f;
    c.unscaled = scale == 1.0f;
    rng_init(&w, seed, param_id, step, noff);
    /* e0 % 8 == 0; spans of 64, then of 8 */
    for (; e + 64 <= e1; e += 64) {
        int v;
        am_noise_span(&w, pdt, e, 64);
        for (v = 0; v < 8; v++)
            matches += flat_vec(p, pdt, g, gdt, sq, lr, pol, e + 8 * v, &c, k, step, &w);
        am_noise_end(p, pdt, &w);
    }
    for (; e + 8 <= e1; e += 8) {
        am_noise_span(&w, pdt, e, 8);
        matches += flat_vec(p, pdt, g, gdt, sq, lr, pol, e, &c, k, step, &w);
        am_noise_end(p, pdt, &w);
    }
    if (e < e1) { /* the tail of the tensor: the reference's loop (SSE code) */
        _mm256_zeroupper();
        matches += am_kernels_ref.finish_flat(p, pdt, g, gdt, sq, lr, pol, e, e1, scale, k,
                                              seed, param_id, step, noff);
    }
    return matches;
}

#define AM_FLAT_CASE(PD, GD)                                                  \
    AM_CLEAN_RETURN(int64_t, finish_flat_body(p, PD, g, GD, sq, lr, pol, e0, e1, scale, \
                                     k, seed, param_id, step, noff))

static int64_t avx2_finish_flat(void *p, int pdt, const void *g, int gdt,
                                float *sq, float *lr, uint8_t *pol, int64_t e0,
                                int64_t e1, float scale, const am_consts *k,
                                uint64_t seed, uint32_t param_id, int64_t step, int64_t noff) {
    AM_DTYPE_PAIRS(pdt, gdt, AM_FLAT_CASE);
}

/* The count_pos slot (internal.h): 32 elements, one word of stored bits,
 * per step; four chains for the smallest positive value. */
static int64_t avx2_count_pos(const void *g, int gdt, int64_t n, const uint8_t *bits,
                              float *minpos) {
    const __m256 zero = _mm256_setzero_ps(), inf = _mm256_set1_ps(INFINITY);
    __m256 mn[4] = {inf, inf, inf, inf};
    float lanes[8], mp = INFINITY;
    int64_t e, mism = 0;
    int q;
    for (e = 0; e + 32 <= n; e += 32) {
        uint32_t pos = 0, old;
        for (q = 0; q < 4; q++) {
            const __m256 x = am_ld8(g, gdt, e + 8 * q);
            const __m256 gt = _mm256_cmp_ps(x, zero, _CMP_GT_OQ);
            pos |= (uint32_t)_mm256_movemask_ps(gt) << (8 * q);
            mn[q] = _mm256_min_ps(mn[q], _mm256_blendv_ps(inf, x, gt));
        }
        memcpy(&old, bits + e / 8, 4);
        mism += __builtin_popcount(pos ^ old);
    }
    _mm256_storeu_ps(lanes, _mm256_min_ps(_mm256_min_ps(mn[0], mn[1]),
                                          _mm256_min_ps(mn[2], mn[3])));
    _mm256_zeroupper(); /* before the scalar code (simd.h, AM_CLEAN_RETURN) */
    for (q = 0; q < 8; q++)
        if (lanes[q] < mp) mp = lanes[q];
    return am_count_pos_tail(g, gdt, e, n, bits, e - mism, mp, minpos);
}

static const am_kernels avx2_table = {
    "avx2",          avx2_stats_tile, avx2_u2_tile,     avx2_u2_flat,
    avx2_agree_rows, avx2_apply_rows, avx2_finish_flat,
    am_avx2_stats_mats, am_avx2_u2_mats, am_avx2_moments_mats,
    am_avx2_stats_u2_mats, avx2_count_pos,
};

/* The AVX-512F/BW apply of 16-bit parameters and of small matrices (set
 * once by am_kernels_avx2). */
static am_apply_fn g_apply16;
static am_apply_mats_fn g_apply_mats;

static void avx512x_apply_rows(void *p, int pdt, const void *g, int gdt,
                               int64_t R, int64_t C, int64_t r0, int64_t r1,
                               const float *rf, const float *cf, float inv,
                               float lr, const float *lrs, const am_consts *k, uint64_t seed,
                               uint32_t param_id, int64_t step, int64_t noff, uint8_t *pol_row) {
    /* every callee returns with vzeroupper (AM_CLEAN_RETURN, simd.h) */
    if (lrs && (C == 8 || C == 4) && r1 - r0 >= 16 / C && r0 / R == (r1 - 1) / R) {
        /* rows of 8 or 4 with an lr each (e.g. LoRA's (1024, 8)), in one
         * matrix: two or four a vector in AVX-512, the last few here */
        const int64_t per = 16 / C, even = (r1 - r0) / per * per;
        g_apply16(p, pdt, g, gdt, R, C, r0, r0 + even, rf, cf, inv, lr, lrs, k, seed,
                  param_id, step, noff, pol_row);
        if (even < r1 - r0)
            avx2_apply_rows(p, pdt, g, gdt, R, C, r0 + even, r1, rf, cf, inv, lr, lrs + even,
                            k, seed, param_id, step, noff, pol_row ? pol_row + even : NULL);
        return;
    }
    if (C >= AM_SMALL_C || lrs) {
        /* float32 too when software prefetch is off (am_sw_prefetch) */
        if (C >= AM_SMALL_C && (pdt != AM_DTYPE_FLOAT32 || !am_sw_prefetch()))
            g_apply16(p, pdt, g, gdt, R, C, r0, r1, rf, cf, inv, lr, lrs, k, seed, param_id,
                      step, noff, pol_row);
        else
            avx2_apply_rows(p, pdt, g, gdt, R, C, r0, r1, rf, cf, inv, lr, lrs, k, seed,
                            param_id, step, noff, pol_row);
        return;
    }
    { /* small matrices: runs of 16 in AVX-512, then the rest */
        const int64_t done = g_apply_mats(p, pdt, g, gdt, R, C, r0, r1, rf, cf, inv,
                                          lr, k, seed, param_id, step, noff, pol_row);
        if (pol_row) pol_row += done * C / 8; /* done * C: a multiple of 16 */
        r0 += done;
    }
    if (r0 < r1)
        avx2_apply_rows(p, pdt, g, gdt, R, C, r0, r1, rf, cf, inv, lr, NULL, k, seed,
                        param_id, step, noff, pol_row);
}

/* The AVX-512 agreement sweep of small matrices (set with g_apply16). */
static am_agree_mats_fn g_agree_mats;

static int64_t avx512x_agree_rows(const void *g, int gdt, int64_t R, int64_t C,
                                  int64_t r0, int64_t r1, const float *rf,
                                  const float *cf, float scale, uint8_t *pol_row) {
    int64_t matches = 0;
    if (C < AM_SMALL_C) { /* small matrices: runs of 16 in AVX-512, then the rest */
        const int64_t done = g_agree_mats(g, gdt, R, C, r0, r1, rf, cf,
                                          am_pos_threshold(scale), pol_row, &matches);
        pol_row += done * C / 8; /* done * C: a multiple of 16 */
        r0 += done;
        if (r0 == r1) return matches;
    }
    return matches + avx2_agree_rows(g, gdt, R, C, r0, r1, rf, cf, scale, pol_row);
}

/* The AVX-512 finish of unfactored parameters (set with g_apply16). */
static am_flat_fn g_flat512;

static int64_t avx512x_finish_flat(void *p, int pdt, const void *g, int gdt, float *sq,
                                   float *lr, uint8_t *pol, int64_t e0, int64_t e1,
                                   float scale, const am_consts *k, uint64_t seed,
                                   uint32_t param_id, int64_t step, int64_t noff) {
    /* returns with vzeroupper (AM_CLEAN_RETURN, simd.h) */
    return g_flat512(p, pdt, g, gdt, sq, lr, pol, e0, e1, scale, k, seed, param_id, step, noff);
}

/* The AVX-512 stats (set with g_apply16). */
static am_stats_fn g_stats512;

static void avx512x_stats_tile(const void *g, int gdt, int64_t C, int64_t i0, int64_t i1,
                               int64_t j0, int64_t j1, float *rowpart, float *colpart,
                               const am_polmap *pm, int32_t *rowmatch, float *minpos,
                               const am_wsum *ws) {
    /* returns with vzeroupper (AM_CLEAN_RETURN, simd.h) */
    /* Here: tiles below 16 columns (the AVX-512 stats would be all scalar
     * tail; 8 columns a vector here: 7.8 -> 4.6 cycles/elem in cache) and
     * matrices exactly 4, 8, 16 or 32 columns wide (e.g. LoRA's (1024, r)),
     * 8 rows at a time (kernels_avx2_narrow.c). Those replaced AVX-512
     * kernels doing 16 rows at a time: in cache, 1024 x 4, 8, 16, 32
     * float32, whole updates alternated in one process, 0.92-0.96 of their
     * time (fifteenth session, Zen 4). */
    if (j1 - j0 < 16 || (j1 - j0 == C && (C == 16 || C == 32)))
        avx2_stats_tile(g, gdt, C, i0, i1, j0, j1, rowpart, colpart, pm, rowmatch, minpos,
                        ws);
    else
        g_stats512(g, gdt, C, i0, i1, j0, j1, rowpart, colpart, pm, rowmatch, minpos, ws);
}

/* The AVX-512 sweep of 3x3 and 1x1 matrices (set with g_apply16). */
static am_stats_u2_mats_fn g_su512;

static void avx512x_stats_u2_mats(const void *g, int gdt, int64_t R, int64_t C, int64_t b0,
                                  int64_t b1, const float *row, const float *col,
                                  const am_consts *k, float *rs, float *cs, float *nr,
                                  float *nc, float *rf, float *cf, float *rmean, double *out,
                                  float *fmin, float *orow, float *ocol) {
    /* returns with vzeroupper (AM_CLEAN_RETURN, simd.h) */
    g_su512(g, gdt, R, C, b0, b1, row, col, k, rs, cs, nr, nc, rf, cf, rmean, out, fmin,
            orow, ocol);
}

/* The AVX-512 count_pos (set with g_apply16). */
static am_count_pos_fn g_count512;

static int64_t avx512x_count_pos(const void *g, int gdt, int64_t n, const uint8_t *bits,
                                 float *minpos) {
    /* returns with vzeroupper (AM_CLEAN_RETURN, simd.h) */
    return g_count512(g, gdt, n, bits, minpos);
}

static const am_kernels avx512x_table = {
    "avx2+avx512",   avx512x_stats_tile, avx2_u2_tile,     avx2_u2_flat,
    avx512x_agree_rows, avx512x_apply_rows, avx512x_finish_flat,
    am_avx2_stats_mats, am_avx2_u2_mats, am_avx2_moments_mats,
    avx512x_stats_u2_mats, avx512x_count_pos,
};

am_philox_fn am_philox32_avx2(void) { return philox32_avx2; }

static int no_avx512(void) {
    const char *e = getenv("AUTOMAGIC_NO_AVX512");
    return e && e[0] == '1';
}

const am_kernels *am_kernels_avx2(void) {
    /* Called from dispatch.c's pthread_once before any kernel runs. */
    if (!am_cpu_has_avx512() || no_avx512()) return &avx2_table;
    g_apply16 = am_avx512_apply16();
    g_flat512 = am_avx512_flat();
    g_apply_mats = am_avx512_apply_mats();
    g_agree_mats = am_avx512_agree_mats();
    g_stats512 = am_avx512_stats(am_tuning_zen4());
    g_count512 = am_avx512_count_pos();
    g_su512 = am_avx512_stats_u2_mats();
    if (!g_apply16 || !g_flat512 || !g_apply_mats || !g_agree_mats || !g_stats512 ||
        !g_count512 || !g_su512 || !am_philox32_avx512())
        return &avx2_table;
    g_philox = am_philox32_avx512(); /* only with the whole AVX-512 set */
    return &avx512x_table;
}

const am_kernels *am_kernels_avx2_plain(void) { return &avx2_table; }

#else /* not built for x86-64 with AVX2 + F16C */

const am_kernels *am_kernels_avx2(void) { return NULL; }
const am_kernels *am_kernels_avx2_plain(void) { return NULL; }
am_philox_fn am_philox32_avx2(void) { return NULL; }

#endif
