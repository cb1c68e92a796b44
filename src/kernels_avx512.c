/*
 * kernels_avx512.c — the passes that are compute-bound, with AVX-512F/BW,
 * 16 elements per vector: the factored apply (apply_rows) of
 * bfloat16/float16 parameters, whose stochastic rounding dominates it
 * (float32 parameters too where software prefetch is off, see
 * am_sw_prefetch in simd.h; elsewhere they keep the AVX2 kernels),
 * the unfactored finish (finish_flat) of every dtype (its square roots and
 * divisions, and the rounding of 16-bit ones), and the apply and
 * agreement sweep of small matrices (C < 16, R*C <= 64: convolution
 * weights) in every dtype, where the per-element factors dominate. Same
 * bits as kernels_ref.c: every operation is the reference's IEEE float
 * operation on one element (no fused multiply-add: -ffp-contract=off), the
 * noise is am_sr_noise's, the rounding am_sr_bf16/am_sr_f16's. Built with
 * -mavx512f -mavx512bw on this file only; kernels_avx2.c uses it when
 * dispatch.c found AVX-512F and AVX-512BW with the zmm state enabled.
 */
#include "simd.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__)

#include <immintrin.h>

#include "am_bits.h"
#include "avx512_load.h"
#include "noisewin.h"

#define AM_INLINE static inline __attribute__((always_inline))
#define AM_NOINLINE __attribute__((noinline))
#define AM_PREFETCH 512 /* elements ahead, as in kernels_avx2.c */
/* stats_rows' prefetch distance (Zen 5, 4096x4096 float32 stats at 1
 * thread: 1 KiB 3.87 ms, 4 KiB 2.66, 8 KiB 2.28-2.31, 16 and 32 KiB
 * 2.29-2.32; Zen 4 with the prefetch into L2: 4 KiB 4.8-5.2 ms, 8 KiB
 * 3.8-4.8, 16 KiB 4.8-5.0) */
#define AM_STATS_PREFETCH_BYTES 8192

/* Word w < 16 taken from word 2w + 1: the high halves of 16 32-bit lanes. */
AM_INLINE __m512i high_idx(void) {
    return _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
                            31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
}

/* The noise window of one apply: am_noisewin (noisewin.h). */
typedef am_noisewin rng512;

/* The 16-bit noise of elements f..f+15 (am_sr_noise), one 32-bit lane each;
 * the window holds them (am_noise_span). */
AM_INLINE __m512i rnd16(const rng512 *w, int64_t f) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)am_noise_at(w, f)));
}

/* Stores v into 16-bit elements i..i+15, stochastically rounded with the
 * noise of w: the bits of am_store_sr with am_sr_noise. */
AM_INLINE void st16(void *base, const int dt, int64_t i, __m512 v, rng512 *w) {
    const __m512i b = _mm512_castps_si512(v);
    uint16_t *out = (uint16_t *)base + i;
    __m512i rnd;
    if (dt == AM_DTYPE_FLOAT32) { /* no rounding (the small-matrix apply) */
        _mm512_storeu_ps((float *)base + i, v);
        return;
    }
    rnd = rnd16(w, i);
    if (dt == AM_DTYPE_BFLOAT16) {
        /* finite and inf: (b + rnd16) >> 16 (an infinity's low 16 bits are
         * zero, so the noise never reaches its high half); NaN:
         * (b >> 16) | 0x40. rnd holds 16 bits (rnd16). */
        const __mmask16 isnan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        __m512i r = _mm512_add_epi32(b, rnd);
        if (isnan)
            r = _mm512_mask_or_epi32(r, isnan, b, _mm512_set1_epi32(0x00400000));
        _mm256_storeu_si256((__m256i *)out,
                            _mm512_castsi512_si256(_mm512_permutexvar_epi16(high_idx(), r)));
    } else {
        /* Half normal range, |b| in [2^-14, 65504]: add 13 random bits and
         * convert rounding toward zero, which drops exactly those 13 bits
         * there. The bits are added to the signed pattern: |b| + 0x1fff
         * stays below 65536's pattern, so the sign and the exponent range
         * are kept. bad: |b| outside that range (half subnormals, zeros,
         * values that may overflow to inf, inf, NaN), one unsigned compare
         * after a shift of the range to 0. */
        const __m512i ab = _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff));
        const __mmask16 bad = _mm512_cmpgt_epu32_mask(
            _mm512_sub_epi32(ab, _mm512_set1_epi32(0x38800000)),
            _mm512_set1_epi32(0x477fe000 - 0x38800000));
        const __m512i t = _mm512_add_epi32(b, _mm512_and_si512(rnd, _mm512_set1_epi32(0x1fff)));
        _mm256_storeu_si256((__m256i *)out,
                            _mm512_cvtps_ph(_mm512_castsi512_ps(t),
                                            _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC));
        if (bad) { /* rare: rounded after the span (am_noise_fix16) */
            _mm512_storeu_ps(w->fv + (i - w->span0), v);
            w->fixmask |= (uint64_t)bad << (i - w->span0);
        }
    }
}

/* st16 of a bfloat16 parameter without the NaN test: (b + rnd16) >> 16 for
 * every lane. Right for every value but NaN; the caller tests its vectors
 * for NaN afterwards and stores those again with st16. */
AM_INLINE void st16_bf16_nonan(void *base, int64_t i, __m512 v, const rng512 *w) {
    const __m512i r = _mm512_add_epi32(_mm512_castps_si512(v), rnd16(w, i));
    _mm256_storeu_si256((__m256i *)((uint16_t *)base + i),
                        _mm512_castsi512_si256(_mm512_permutexvar_epi16(high_idx(), r)));
}

/* The new value of elements f..f+15 with factors fac; *pos: their new
 * polarity bits. scaled and wd are constants in every instance (see
 * apply_mode): the multiplication by iv (1 / clip scale, see apply_rows in
 * internal.h) is skipped when it is 1 (x * 1 == x exactly), the decay term
 * when wd is 0. */
AM_INLINE __m512 apply16_value(const void *p, const int pdt, const void *g, const int gdt,
                               int64_t f, __m512 fac, __m512 iv, __m512 lrv, __m512 wdv,
                               const int scaled, const int wd, unsigned *pos) {
    __m512 u = _mm512_mul_ps(fac, am_ld16(g, gdt, f)), pv = am_ld16(p, pdt, f), t;
    if (scaled) u = _mm512_mul_ps(u, iv);
    t = wd ? _mm512_add_ps(u, _mm512_mul_ps(wdv, pv)) : u;
    *pos = (unsigned)_mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_GT_OQ);
    return _mm512_sub_ps(pv, _mm512_mul_ps(lrv, t));
}

/* Elements f..f+15 updated and stored (st16); returns their polarity bits. */
AM_INLINE unsigned apply16(void *p, const int pdt, const void *g, const int gdt,
                           int64_t f, __m512 fac, __m512 iv, __m512 lrv, __m512 wdv,
                           const int scaled, const int wd, rng512 *w) {
    unsigned pos;
    st16(p, pdt, f, apply16_value(p, pdt, g, gdt, f, fac, iv, lrv, wdv, scaled, wd, &pos), w);
    return pos;
}

/* apply16 for a bfloat16 parameter, its value stored without the NaN test
 * (st16_bf16_nonan) and returned in *vo for the span's test. */
AM_INLINE unsigned apply16_bf(void *p, const void *g, const int gdt, int64_t f, __m512 fac,
                              __m512 iv, __m512 lrv, __m512 wdv, const int scaled,
                              const int wd, const rng512 *w, __m512 *vo) {
    unsigned pos;
    *vo = apply16_value(p, AM_DTYPE_BFLOAT16, g, gdt, f, fac, iv, lrv, wdv, scaled, wd, &pos);
    st16_bf16_nonan(p, f, *vo, w);
    return pos;
}

/* ------------------------------------------------------------ stats ---- */

/* Word w of a zmm taken from word 16 + (w >> 1) of the source (see
 * am_widen_idx): the upper 16 bfloat16 values of 32. */
AM_INLINE __m512i widen_idx_hi(void) {
    return _mm512_set_epi16(31, 31, 30, 30, 29, 29, 28, 28, 27, 27, 26, 26, 25, 25, 24, 24,
                            23, 23, 22, 22, 21, 21, 20, 20, 19, 19, 18, 18, 17, 17, 16, 16);
}

/* 32 raw bfloat16 values as two vectors of float32, exactly. */
AM_INLINE void widen32_bf16(__m512i raw, __m512 *lo, __m512 *hi) {
    *lo = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, am_widen_idx(), raw));
    *hi = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, widen_idx_hi(), raw));
}

/* acc + x[0..7] + x[8..15], in that order: 16 columns into a row's 8 lanes
 * as the reference adds them. */
AM_INLINE __m256 add16(__m256 acc, __m512 x) {
    acc = _mm256_add_ps(acc, _mm512_castps512_ps256(x));
    return _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

/* A group of nq rows (4 or 1) from row i whose W sums (am_wsum, internal.h)
 * are to be added: weights w, and wv broadcast. */
typedef struct wgroup {
    int64_t i;
    float w[4];
    __m512 wv[4];
    float *wpart;
} wgroup;

/* Elements idx..idx+31 of a gradient of dtype gdt as two vectors of
 * float32, exactly; raw (16-bit types) gets the loaded words. */
AM_INLINE void ld32(const void *g, const int gdt, int64_t idx, __m512 *lo, __m512 *hi,
                    __m512i *raw) {
    if (gdt == AM_DTYPE_FLOAT32) {
        *lo = _mm512_loadu_ps((const float *)g + idx);
        *hi = _mm512_loadu_ps((const float *)g + idx + 16);
    } else if (gdt == AM_DTYPE_FLOAT16) {
        /* each half converted from memory: no extract of the upper half */
        *raw = _mm512_loadu_si512((const void *)((const uint16_t *)g + idx));
        *lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)g + idx)));
        *hi = _mm512_cvtph_ps(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)g + idx + 16)));
    } else {
        *raw = _mm512_loadu_si512((const void *)((const uint16_t *)g + idx));
        widen32_bf16(*raw, lo, hi);
    }
}

/* Tile columns j..j+31 of the W sums of group wg (as wsum8 of
 * kernels_avx2.c): each row's (g * g) * w added in row order. */
AM_INLINE void wsum32(const void *g, const int gdt, int64_t C, int64_t j0, int64_t j,
                      const int nq, const wgroup *wg) {
    __m512 slo = _mm512_setzero_ps(), shi = slo;
    __m512i raw;
    int q;
    for (q = 0; q < nq; q++) {
        __m512 lo, hi;
        ld32(g, gdt, (wg->i + q) * C + j0 + j, &lo, &hi, &raw);
        lo = _mm512_mul_ps(_mm512_mul_ps(lo, lo), wg->wv[q]);
        hi = _mm512_mul_ps(_mm512_mul_ps(hi, hi), wg->wv[q]);
        if (q == 0) {
            slo = lo;
            shi = hi;
        } else {
            slo = _mm512_add_ps(slo, lo);
            shi = _mm512_add_ps(shi, hi);
        }
    }
    _mm512_storeu_ps(wg->wpart + j, _mm512_add_ps(_mm512_loadu_ps(wg->wpart + j), slo));
    _mm512_storeu_ps(wg->wpart + j + 16,
                     _mm512_add_ps(_mm512_loadu_ps(wg->wpart + j + 16), shi));
}

/* wsum32 for tile columns j..j+15. */
AM_INLINE void wsum16(const void *g, const int gdt, int64_t C, int64_t j0, int64_t j,
                      const int nq, const wgroup *wg) {
    __m512 s = _mm512_setzero_ps();
    int q;
    for (q = 0; q < nq; q++) {
        __m512 x = am_ld16(g, gdt, (wg->i + q) * C + j0 + j);
        x = _mm512_mul_ps(_mm512_mul_ps(x, x), wg->wv[q]);
        s = q == 0 ? x : _mm512_add_ps(s, x);
    }
    _mm512_storeu_ps(wg->wpart + j, _mm512_add_ps(_mm512_loadu_ps(wg->wpart + j), s));
}

/* The W sums of group wg (nq rows, a constant) over tile columns j from on
 * (j0..j0+n-1 in all): 16 columns a vector while 16 are left, then the
 * scalar rest. */
AM_INLINE void wsum_tail(const void *g, const int gdt, int64_t C, const int nq, int64_t j0,
                         int64_t j, int64_t n, const wgroup *wg) {
    if (n - j >= 16) {
        wsum16(g, gdt, C, j0, j, nq, wg);
        j += 16;
    }
    am_wsum_cols(g, gdt, C, wg->i, nq, j0, j0 + j, j0 + n, wg->w, wg->wpart);
}

/* The W sums of group wg (nq rows, a constant) over tile columns
 * j0..j0+n-1 in one sweep. */
AM_INLINE void wsum_rows(const void *g, const int gdt, int64_t C, const int nq, int64_t j0,
                         int64_t n, const wgroup *wg) {
    const int64_t n32 = n & ~(int64_t)31;
    int64_t j;
    for (j = 0; j < n32; j += 32) wsum32(g, gdt, C, j0, j, nq, wg);
    wsum_tail(g, gdt, C, nq, j0, n32, n, wg);
}

/* The signs of 32 gradient elements from their bits (float32: a and b,
 * 16 each; 16-bit types: a holds all 32): bit l is 1 when element l is >
 * 0, i.e. when its bits - 1 (unsigned) are below +inf's bits; the running
 * minimum of those differences goes into *mn, its smallest one belonging to
 * the smallest positive value (+0 wraps to all ones, negatives are above
 * +inf's bits; minpos_of). */
AM_INLINE uint32_t pos_mask32(const int gdt, __m512i a, __m512i b, __m512i *mn) {
    if (gdt == AM_DTYPE_FLOAT32) {
        const __m512i one = _mm512_set1_epi32(1), lim = _mm512_set1_epi32(0x7f800000);
        const __m512i dl = _mm512_sub_epi32(a, one), dh = _mm512_sub_epi32(b, one);
        *mn = _mm512_min_epu32(*mn, _mm512_min_epu32(dl, dh));
        return (uint32_t)_mm512_cmplt_epu32_mask(dl, lim) |
               (uint32_t)_mm512_cmplt_epu32_mask(dh, lim) << 16;
    } else {
        const __m512i d = _mm512_sub_epi16(a, _mm512_set1_epi16(1));
        const __m512i lim =
            _mm512_set1_epi16((short)(gdt == AM_DTYPE_BFLOAT16 ? 0x7f80 : 0x7c00));
        *mn = _mm512_min_epu16(*mn, d);
        return (uint32_t)_mm512_cmplt_epu16_mask(d, lim);
    }
}

/* pos_mask32 for the 16 gradient elements from idx: bit l is 1 when
 * element l is > 0; the running minimum as there. */
AM_INLINE uint32_t pos_mask16(const void *g, const int gdt, int64_t idx, __m512i *mn) {
    if (gdt == AM_DTYPE_FLOAT32) {
        const __m512i d = _mm512_sub_epi32(
            _mm512_loadu_si512((const void *)((const float *)g + idx)), _mm512_set1_epi32(1));
        *mn = _mm512_min_epu32(*mn, d);
        return (uint32_t)_mm512_cmplt_epu32_mask(d, _mm512_set1_epi32(0x7f800000));
    } else {
        /* 16 words in the low half; the high half's zeros wrap to all ones,
         * above every positive value: no bit, no effect on the minimum */
        const __m512i raw = _mm512_zextsi256_si512(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)g + idx)));
        return pos_mask32(gdt, raw, raw, mn);
    }
}

/* The gradient's prefetch at pf: into L2 with l2 (Zen 4's tuning,
 * am_tuning_zen4 in simd.h), else into L1. */
AM_INLINE void stats_prefetch(const char *pf, const int gdt, const int l2) {
    if (l2) {
        _mm_prefetch(pf, _MM_HINT_T1);
        if (gdt == AM_DTYPE_FLOAT32) _mm_prefetch(pf + 64, _MM_HINT_T1);
    } else {
        _mm_prefetch(pf, _MM_HINT_T0);
        if (gdt == AM_DTYPE_FLOAT32) _mm_prefetch(pf + 64, _MM_HINT_T0);
    }
}

/* One 32-column step of stats_rows at tile column j (row element base +
 * j), its gradient prefetched at pf (into L2 with l2). */
AM_INLINE void stats_step32(const void *g, const int gdt, const int cnt, const int l2,
                            int64_t base, int64_t j, const char *pf, const uint8_t *bits,
                            int64_t q, const int al, __m256 *acc, int64_t *mism, __m512i *mn,
                            float *colpart) {
    __m512 lo, hi;
    __m512i raw;
    stats_prefetch(pf, gdt, l2);
    ld32(g, gdt, base + j, &lo, &hi, &raw);
    if (cnt) {
        const uint32_t pos =
            gdt == AM_DTYPE_FLOAT32
                ? pos_mask32(gdt, _mm512_castps_si512(lo), _mm512_castps_si512(hi), mn)
                : pos_mask32(gdt, raw, raw, mn);
        uint32_t old;
        if (al) memcpy(&old, bits + (q >> 3), 4);
        else old = am_bits32_at(bits, q);
        *mism += __builtin_popcount(pos ^ old);
    }
    lo = _mm512_mul_ps(lo, lo);
    hi = _mm512_mul_ps(hi, hi);
    *acc = add16(add16(*acc, lo), hi);
    _mm512_storeu_ps(colpart + j, _mm512_add_ps(_mm512_loadu_ps(colpart + j), lo));
    _mm512_storeu_ps(colpart + j + 16, _mm512_add_ps(_mm512_loadu_ps(colpart + j + 16), hi));
}

/* Steps j..je-1 (multiples of 32) of stats_rows, the prefetch of step j at
 * pfb + j * es; with wsum (a constant) the W sums of pend at each. */
AM_INLINE void stats_span(const void *g, const int gdt, const int cnt, const int l2, int64_t C,
                          int64_t j0, int64_t base, int64_t j, int64_t je, uintptr_t pfb,
                          const uint8_t *bits, int64_t q0, __m256 *acc, int64_t *mism,
                          __m512i *mn, float *colpart, const int wsum, const int al,
                          const wgroup *pend) {
    const uintptr_t es = gdt == AM_DTYPE_FLOAT32 ? 4 : 2;
    __m256 a = *acc;
    __m512i m = *mn;
    int64_t mm = 0;
    for (; j < je; j += 32) {
        stats_step32(g, gdt, cnt, l2, base, j, (const char *)(pfb + (uintptr_t)j * es),
                     bits, q0 + j, al, &a, &mm, &m, colpart);
        if (wsum) wsum32(g, gdt, C, j0, j, 4, pend);
    }
    *acc = a;
    *mn = m;
    *mism += mm;
}

/* Row i of stats_body, 32 columns per step. With cnt, the agreement is
 * counted on the raw bits: a gradient element is > 0 exactly when 1 <= bits
 * <= bits of +inf, i.e. when the unsigned bits - 1 is below +inf's bits
 * (lim); the same bits - 1 keep the running minimum of the positive values
 * in *mn (16-bit lanes for 16-bit types, 32-bit for float32; their order is
 * their bits' order; +0 wraps to all ones, negatives are above +inf's bits).
 * When pend is not NULL, the W sums of that group of 4 rows are added over
 * the steps at tile columns [wa, wb) (and the columns past the last whole
 * step when wtail), so that memory never idles during them. The gradient
 * is prefetched AM_STATS_PREFETCH_BYTES ahead (into L2 with l2: Zen 4's
 * tuning, am_tuning_zen4 in simd.h; into L1 otherwise), past the row's end into the
 * tile's next row (where tiles are whole rows, as for every matrix up to
 * AM_COL_BLOCK columns, that is the next bytes: one stream). One row at a
 * time with that prefetch replaced four rows interleaved with the next four
 * prefetched (Zen 5, twentieth session, runs alternated in one session:
 * the stats of 4096x4096 float32 at 1 thread 2.95-3.0 -> 2.28 ms,
 * 11008x4096 8.06 -> 6.27 ms, bfloat16 4096x4096 1.80 -> 1.52-1.54 ms; 2
 * threads 1.64 -> 1.50-1.51 ms; tiles narrower than their matrix,
 * 1024x28672 float32 4.37 -> 3.91 ms, bfloat16 2.52 -> 2.53; docs/
 * PERFORMANCE_HISTORY.md). */
AM_INLINE void stats_rows(const void *g, const int gdt, const int cnt, const int l2, int64_t C,
                          int64_t i, int64_t j0, int64_t n, float *rowpart, float *colpart,
                          const am_polmap *pm, int32_t *rowmatch, __m512i *mn, float *mp,
                          const wgroup *pend, int64_t wa, int64_t wb, const int wtail) {
    const int64_t n32 = n & ~(int64_t)31, base = i * C + j0;
    const size_t es = gdt == AM_DTYPE_FLOAT32 ? 4 : 2;
    const uint8_t *bits = cnt ? pm->bits : NULL;
    const int64_t q0 = cnt ? am_polmap_bit(pm, i, j0) : 0;
    /* The prefetch: AM_STATS_PREFETCH_BYTES ahead in the row, then on in
     * the next row of the tile (where the tile is narrower than the matrix,
     * C - n elements further on). As integers: the addresses may lie past
     * the gradient (a prefetch never faults). */
    const uintptr_t g0 = (uintptr_t)g + (uintptr_t)base * es;
    const uintptr_t rowb = (uintptr_t)n * es, gap = (uintptr_t)(C - n) * es;
    __m256 acc = _mm256_setzero_ps();
    int64_t mism = 0, j;
    float a[AM_LANES];
    if (gdt != AM_DTYPE_FLOAT32) {
        /* 16-bit gradients: spans of steps with the same W-sum flag and
         * prefetch offset (from jx on the prefetch is past the row's end,
         * in the tile's next row), with aligned stored bits read whole */
        const int64_t ahead = (int64_t)(AM_STATS_PREFETCH_BYTES / es);
        int64_t jx = n - ahead > 0 ? (n - ahead + 31) & ~(int64_t)31 : 0;
        if (jx > n32) jx = n32;
        j = 0;
        while (j < n32) {
            int64_t e = n32;
            const int w = pend && j >= wa && j < wb;
            const uintptr_t pfb = g0 + AM_STATS_PREFETCH_BYTES + (j >= jx ? gap : 0);
            if (j < jx && jx < e) e = jx;
            if (pend && j < wa && wa < e) e = wa;
            if (pend && j < wb && wb < e) e = wb;
#define AM_SPAN(W, AL)                                                                    \
    stats_span(g, gdt, cnt, l2, C, j0, base, j, e, pfb, bits, q0, &acc, &mism, mn, colpart, \
               W, AL, pend)
            if (!cnt || (q0 & 7) == 0) {
                if (w) AM_SPAN(1, 1);
                else AM_SPAN(0, 1);
            } else {
                if (w) AM_SPAN(1, 0);
                else AM_SPAN(0, 0);
            }
#undef AM_SPAN
            j = e;
        }
    } else {
        /* float32: one loop (the spans above were slower from memory here:
         * docs/PERFORMANCE_HISTORY.md, twenty-second session) */
        for (j = 0; j < n32; j += 32) {
            uintptr_t off = (uintptr_t)j * es + AM_STATS_PREFETCH_BYTES;
            if (off >= rowb) off += gap;
            stats_step32(g, gdt, cnt, l2, base, j, (const char *)(g0 + off), bits, q0 + j,
                         0, &acc, &mism, mn, colpart);
            if (pend && j >= wa && j < wb) wsum32(g, gdt, C, j0, j, 4, pend);
        }
    }
    if (pend && wtail) wsum_tail(g, gdt, C, 4, j0, n32, n, pend);
    if (n - n32 >= 16) { /* 16 more columns (e.g. C = 16, LoRA's B matrices) */
        __m512 x;
        if (cnt)
            mism += __builtin_popcount(pos_mask16(g, gdt, base + j, mn) ^
                                       am_bits16_at(bits, q0 + j));
        x = am_ld16(g, gdt, base + j);
        x = _mm512_mul_ps(x, x);
        acc = add16(acc, x);
        _mm512_storeu_ps(colpart + j, _mm512_add_ps(_mm512_loadu_ps(colpart + j), x));
        j += 16;
    }
    _mm256_storeu_ps(a, acc);
    am_stats_row_tail(g, gdt, cnt, base, j, n, a, colpart, bits, q0, mism,
                      cnt ? rowmatch : NULL, mp);
    *rowpart = am_lanesum_finish(a);
}

/* The smallest positive value recorded by stats_rows in mn (+inf when
 * none): the smallest lane, + 1, is a positive finite value's bits when it
 * is below +inf's bits. */
static float minpos_of(__m512i mn, int gdt) {
    if (gdt == AM_DTYPE_FLOAT32) {
        uint32_t v[16], best = 0xffffffffu, l;
        _mm512_storeu_si512((void *)v, mn);
        for (l = 0; l < 16; l++)
            if (v[l] < best) best = v[l];
        return am_minpos_from_bits(best);
    } else {
        uint16_t v[32];
        uint32_t best = 0xffffu, l;
        _mm512_storeu_si512((void *)v, mn);
        for (l = 0; l < 32; l++)
            if (v[l] < best) best = v[l];
        best += 1u; /* 1..0x10000 */
        if (best < (gdt == AM_DTYPE_BFLOAT16 ? 0x7f80u : 0x7c00u)) {
            const uint16_t h = (uint16_t)best;
            return am_load(&h, gdt, 0);
        }
        return INFINITY;
    }
}

/* The stats_tile slot (internal.h), any gradient dtype. */
AM_INLINE void stats_body(const void *g, const int gdt, const int cnt, const int l2, int64_t C,
                          int64_t i0, int64_t i1, int64_t j0, int64_t j1, float *rowpart,
                          float *colpart,
                          const am_polmap *pm, int32_t *rowmatch, float *minpos,
                          const am_wsum *ws) {
    const int64_t n = j1 - j0;
    __m512i mn = _mm512_set1_epi32(-1);
    float mp = INFINITY;
    int64_t i, j;
    /* wg's W sums wait for the next group's stats, a quarter of its
     * columns during each of its rows (wq: a multiple of 32) */
    int q, pending = 0;
    const int64_t n32 = n & ~(int64_t)31, wq = (n32 / 32 + 3) / 4 * 32;
    wgroup wg;
    for (j = 0; j < n; j++) colpart[j] = 0.0f;
    if (ws) {
        wg.wpart = ws->wpart;
        for (j = 0; j < n; j++) ws->wpart[j] = 0.0f;
    }
    for (i = i0; i + 4 <= i1; i += 4) {
        for (q = 0; q < 4; q++)
            stats_rows(g, gdt, cnt, l2, C, i + q, j0, n, rowpart + (i + q - i0), colpart, pm,
                       cnt ? rowmatch + (i + q - i0) : NULL, &mn, &mp, pending ? &wg : NULL,
                       q * wq, q == 3 ? n32 : (q + 1) * wq, q == 3);
        if (ws) {
            for (q = 0; q < 4; q++) {
                wg.w[q] = am_wsum_weight(ws, i + q, rowpart[i + q - i0]);
                wg.wv[q] = _mm512_set1_ps(wg.w[q]);
            }
            wg.i = i;
            pending = 1;
        }
    }
    if (pending) wsum_rows(g, gdt, C, 4, j0, n, &wg);
    for (; i < i1; i++) {
        stats_rows(g, gdt, cnt, l2, C, i, j0, n, rowpart + (i - i0), colpart, pm,
                   cnt ? rowmatch + (i - i0) : NULL, &mn, &mp, NULL, 0, 0, 0);
        if (ws) {
            wg.w[0] = am_wsum_weight(ws, i, rowpart[i - i0]);
            wg.wv[0] = _mm512_set1_ps(wg.w[0]);
            wg.i = i;
            wsum_rows(g, gdt, C, 1, j0, n, &wg);
        }
    }
    if (cnt) {
        const float x = minpos_of(mn, gdt);
        *minpos = x < mp ? x : mp;
    }
}

#define AM_STATS_CASE(GD, L2)                                                              \
    do {                                                                                   \
        if (pm)                                                                            \
            stats_body(g, GD, 1, L2, C, i0, i1, j0, j1, rowpart, colpart, pm, rowmatch,    \
                       minpos, ws);                                                        \
        else                                                                               \
            stats_body(g, GD, 0, L2, C, i0, i1, j0, j1, rowpart, colpart, NULL, NULL, NULL, \
                       ws);                                                                \
    } while (0)

/* The slot twice: its gradient prefetched into L1 and into L2. */
#define AM_STATS_FN(NAME, L2)                                                              \
    static void NAME(const void *g, int gdt, int64_t C, int64_t i0, int64_t i1, int64_t j0, \
                     int64_t j1, float *rowpart, float *colpart, const am_polmap *pm,      \
                     int32_t *rowmatch, float *minpos, const am_wsum *ws) {                \
        switch (gdt) {                                                                     \
        case AM_DTYPE_FLOAT32: AM_STATS_CASE(0, L2); break;                                \
        case AM_DTYPE_BFLOAT16: AM_STATS_CASE(1, L2); break;                               \
        default: AM_STATS_CASE(2, L2); break;                                              \
        }                                                                                  \
        _mm256_zeroupper(); /* see AM_CLEAN_RETURN (simd.h) */                             \
    }
AM_STATS_FN(avx512_stats_l1, 0)
AM_STATS_FN(avx512_stats_l2, 1)
#undef AM_STATS_FN
#undef AM_STATS_CASE

am_stats_fn am_avx512_stats(int l2) { return l2 ? avx512_stats_l2 : avx512_stats_l1; }

/* Runs MODE(scaled, wd) with the two flags as constants: scaled when the
 * clip scale is not 1, wd when the decay is not 0 (see apply_mode). */
#define AM_WITH_MODES(scale, k, MODE)                                         \
    do {                                                                      \
        if ((scale) != 1.0f) {                                                \
            if ((k)->wd != 0.0f) MODE(1, 1);                                  \
            else MODE(1, 0);                                                  \
        } else {                                                              \
            if ((k)->wd != 0.0f) MODE(0, 1);                                  \
            else MODE(0, 0);                                                  \
        }                                                                     \
    } while (0)

/* The short-row applies' steps before the 16 elements from base (apply_rows16,
 * apply_rows8, apply_rows4): their noise in the window (16-bit parameters),
 * and once per 64 elements (at64) apply_mode's prefetch. Macros, not an
 * inline function: one measured 3-6% slower on (1024, 16) and (1024, 8),
 * alternated in one process. */
#define AM_SHORT_SPAN_VARS                                                    \
    const int pf = am_sw_prefetch(), es = pdt == AM_DTYPE_FLOAT32 ? 4 : 2;    \
    const int ges = gdt == AM_DTYPE_FLOAT32 ? 4 : 2;                          \
    const int64_t l2ahead = AM_L2_PREFETCH_BYTES / es
#define AM_SHORT_SPAN(at64)                                                   \
    do {                                                                      \
        am_noise_span(w, pdt, base, 16);                                      \
        if (at64) {                                                           \
            if (pf) {                                                         \
                _mm_prefetch((const char *)p + (base + AM_PREFETCH) * es, _MM_HINT_T0); \
                _mm_prefetch((const char *)g + (base + AM_PREFETCH) * ges, _MM_HINT_T0); \
            } else { /* as apply_mode's */                                    \
                am_prefetch_l2((const char *)p + (base + l2ahead) * es, 64 * es); \
                if (pdt != AM_DTYPE_FLOAT32)                                  \
                    am_prefetch_l2((const char *)g + (base + l2ahead) * ges, 64 * ges); \
            }                                                                 \
        }                                                                     \
    } while (0)

/* apply_mode's lrs mode for rows of 16 elements (C == 16): one apply16 per
 * row, its 16 bits stored as two bytes (each row's bits start on a byte:
 * am_lrs_row_bytes), without the bit writer, which cost more than the
 * arithmetic at this length. bend: the end of row r0's matrix, cfb its
 * column factors. The same per-element operations: the same bits. */
AM_INLINE void apply_rows16(void *p, const int pdt, const void *g, const int gdt, int64_t r0,
                            int64_t r1, int64_t bend, int64_t R, const float *rf,
                            const float *cfb, __m512 iv, const float *lrs, __m512 wdv,
                            uint8_t *pol_row, const int scaled, const int wd, rng512 *w) {
    AM_SHORT_SPAN_VARS;
    __m512 cfv = _mm512_loadu_ps(cfb);
    int64_t r;
    for (r = r0; r < r1; r++) {
        const int64_t base = r * 16;
        uint16_t bits;
        AM_SHORT_SPAN((r & 3) == 0);
        bits = (uint16_t)apply16(p, pdt, g, gdt, base,
                                 _mm512_mul_ps(_mm512_set1_ps(rf[r]), cfv), iv,
                                 _mm512_set1_ps(lrs[r - r0]), wdv, scaled, wd, w);
        if (pol_row) memcpy(pol_row + 2 * (r - r0), &bits, 2);
        am_noise_end(p, pdt, w);
        if (r + 1 == bend && r + 1 < r1) { /* the next matrix's column factors */
            cfb += 16;
            cfv = _mm512_loadu_ps(cfb);
            bend += R;
        }
    }
}

/* [a x 8 | b x 8]. */
AM_INLINE __m512 pair8(float a, float b) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(a)),
                                               _mm256_castps_pd(_mm256_set1_ps(b)), 1));
}

/* apply_rows16 for rows of 8 elements (C == 8, r1 - r0 even, all in one
 * matrix: cfb its column factors), two rows per apply16: the factors and
 * lrs of each row in its half of the vector, the two rows' bits a byte
 * each (am_lrs_row_bytes). */
AM_INLINE void apply_rows8(void *p, const int pdt, const void *g, const int gdt, int64_t r0,
                           int64_t r1, const float *rf, const float *cfb, __m512 iv,
                           const float *lrs, __m512 wdv, uint8_t *pol_row, const int scaled,
                           const int wd, rng512 *w) {
    AM_SHORT_SPAN_VARS;
    const __m512 cfv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(
        _mm256_loadu_ps(cfb)))); /* (AVX-512F: the f32x8 forms need DQ) */
    int64_t r;
    for (r = r0; r < r1; r += 2) {
        const int64_t base = r * 8;
        const __m512 rfv = pair8(rf[r], rf[r + 1]), lrv = pair8(lrs[r - r0], lrs[r - r0 + 1]);
        uint16_t bits;
        AM_SHORT_SPAN((r & 7) == 0);
        bits = (uint16_t)apply16(p, pdt, g, gdt, base, _mm512_mul_ps(rfv, cfv), iv, lrv, wdv,
                                 scaled, wd, w);
        if (pol_row) memcpy(pol_row + (r - r0), &bits, 2);
        am_noise_end(p, pdt, w);
    }
}

/* apply_rows8 for rows of 4 elements (C == 4, r1 - r0 a multiple of 4,
 * all in one matrix), four rows per apply16: each row's factor and lr in
 * its 128-bit block; each row's 4 bits in the low half of its own byte
 * (am_lrs_row_bytes), the high half kept as it was (bw_flush keeps it). */
AM_INLINE void apply_rows4(void *p, const int pdt, const void *g, const int gdt, int64_t r0,
                           int64_t r1, const float *rf, const float *cfb, __m512 iv,
                           const float *lrs, __m512 wdv, uint8_t *pol_row, const int scaled,
                           const int wd, rng512 *w) {
    AM_SHORT_SPAN_VARS;
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512 cfv = _mm512_broadcast_f32x4(_mm_loadu_ps(cfb));
    int64_t r;
    for (r = r0; r < r1; r += 4) {
        const int64_t base = r * 4;
        const __m512 rfv = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(rf + r)));
        const __m512 lrv =
            _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(lrs + (r - r0))));
        unsigned bits;
        AM_SHORT_SPAN((r & 15) == 0);
        bits = apply16(p, pdt, g, gdt, base, _mm512_mul_ps(rfv, cfv), iv, lrv, wdv, scaled, wd, w);
        if (pol_row) { /* row q's 4 bits into the low half of byte q */
            const uint32_t nib = (bits & 0xfu) | (bits & 0xf0u) << 4 | (bits & 0xf00u) << 8 |
                                 (bits & 0xf000u) << 12;
            uint32_t old;
            memcpy(&old, pol_row + (r - r0), 4);
            old = (old & 0xf0f0f0f0u) | nib;
            memcpy(pol_row + (r - r0), &old, 4);
        }
        am_noise_end(p, pdt, w);
    }
}

/* apply_mode's lrs mode for four rows r..r+3 of a float32 parameter in one
 * matrix (C > one_row_apply_max()): 64 columns of each row in
 * turn, the four vectors of column factors loaded once for the four rows
 * (one row at a time re-read them from L2 for every row); each row's bits
 * start on a byte (am_lrs_row_bytes), 8 bytes per 64 columns, then its
 * tail as apply_mode. The same per-element operations: the same bits. */
AM_INLINE void apply_long4(float *p, const void *g, const int gdt, int64_t r, int64_t r0,
                           int64_t C, const float *rf, const float *cfb, float inv,
                           const float *lrs, const am_consts *k, uint64_t seed,
                           uint32_t param_id, int64_t step, int64_t noff, uint8_t *pol_row,
                           const int scaled, const int wd, rng512 *w) {
    const int64_t n16 = C & ~(int64_t)15, n64 = C & ~(int64_t)63, rb = am_lrs_row_bytes(C);
    const __m512 iv = _mm512_set1_ps(inv), wdv = _mm512_set1_ps(k->wd);
    __m512 rfq[4], lrq[4];
    int64_t j;
    int q;
    for (q = 0; q < 4; q++) {
        rfq[q] = _mm512_set1_ps(rf[r + q]);
        lrq[q] = _mm512_set1_ps(lrs[r - r0 + q]);
    }
    for (j = 0; j < n64; j += 64) {
        const __m512 c0 = _mm512_loadu_ps(cfb + j), c1 = _mm512_loadu_ps(cfb + j + 16),
                     c2 = _mm512_loadu_ps(cfb + j + 32), c3 = _mm512_loadu_ps(cfb + j + 48);
        for (q = 0; q < 4; q++) {
            const int64_t f = (r + q) * C + j;
#define AM_LONG16(D, CV)                                                      \
    apply16(p, AM_DTYPE_FLOAT32, g, gdt, f + (D), _mm512_mul_ps(rfq[q], CV), iv, lrq[q], \
            wdv, scaled, wd, w)
            const uint64_t bits = (uint64_t)AM_LONG16(0, c0) | (uint64_t)AM_LONG16(16, c1) << 16 |
                                  (uint64_t)AM_LONG16(32, c2) << 32 |
                                  (uint64_t)AM_LONG16(48, c3) << 48;
#undef AM_LONG16
            if (pol_row) memcpy(pol_row + (r - r0 + q) * rb + j / 8, &bits, 8);
        }
    }
    for (q = 0; q < 4; q++) { /* the tails: 16 columns at a time, then one */
        const int64_t base = (r + q) * C;
        bitw bw = {pol_row ? pol_row + (r - r0 + q) * rb + n64 / 8 : NULL, 0, 0, 0};
        for (j = n64; j < n16; j += 16) {
            const unsigned bits =
                apply16(p, AM_DTYPE_FLOAT32, g, gdt, base + j,
                        _mm512_mul_ps(rfq[q], _mm512_loadu_ps(cfb + j)), iv, lrq[q], wdv,
                        scaled, wd, w);
            if (pol_row) bw_put(&bw, bits, 16);
        }
        for (; j < C; j++) {
            const int pos = am_apply_one(p, AM_DTYPE_FLOAT32, g, gdt, base + j,
                                         rf[r + q] * cfb[j], inv, lrs[r - r0 + q], k->wd,
                                         seed, param_id, step, noff);
            if (pol_row) bw_put(&bw, (uint32_t)pos, 1);
        }
        if (pol_row) bw_flush(&bw);
    }
}

/* Float32 rows up to this long are applied one at a time, not by
 * apply_long4: their column factors stay in L1 (16 KiB) beside the two
 * streams, while four rows interleaved are eight short streams (Zen 5,
 * twentieth session, runs alternated in one session: the finish of
 * 4096x4096 float32 at 1 thread 4.6 -> 3.9 ms, 11008x4096 12.8 -> 10.9 ms;
 * 4096x11008 stays with apply_long4, 10.4 against 11.3 ms one at a time).
 * On Zen 4 (am_tuning_zen4) rows of 3072 or more go four at a time, as
 * the seventeenth session chose there (twenty-eighth session, alternated
 * builds, 1 thread: the finish of 4096x4096 6.2-7.8 -> 6.1-6.5 ms,
 * 11008x4096 16.5-18.1 -> 15.6-16.1, 768x3072 0.74-0.79 -> 0.67-0.68). */
AM_INLINE int64_t one_row_apply_max(void) { return am_tuning_zen4() ? 3071 : 4096; }

/* ref_apply_rows for a 16-bit parameter, rows of C >= 16 elements, with the
 * clip multiplication (scaled) and the decay (wd) fixed: the loop holds no test
 * of them and keeps its constants in registers. */
AM_INLINE void apply_mode(void *p, const int pdt, const void *g, const int gdt,
                          int64_t R, int64_t C, int64_t r0, int64_t r1,
                          const float *rf, const float *cf, float inv, float lr,
                          const float *lrs, const am_consts *k, uint64_t seed,
                          uint32_t param_id, int64_t step, int64_t noff, uint8_t *pol_row,
                          const int scaled, const int wd, rng512 *w) {
    const int64_t n16 = C & ~(int64_t)15, n64 = C & ~(int64_t)63;
    const __m512 iv = _mm512_set1_ps(inv), wdv = _mm512_set1_ps(k->wd);
    __m512 lrv = _mm512_set1_ps(lr);
    const float wdf = k->wd;
    const int pf = am_sw_prefetch(), es = pdt == AM_DTYPE_FLOAT32 ? 4 : 2;
    const int ges = gdt == AM_DTYPE_FLOAT32 ? 4 : 2;
    const int64_t l2ahead = AM_L2_PREFETCH_BYTES / es;
    /* the parameter's L2 prefetch below: 16-bit parameters, and float32
     * rows shorter than AM_LONG_ROW_MIN (internal.h; longer ones measured
     * 3-10% slower with it, simd.h) */
    const int l2p = pdt != AM_DTYPE_FLOAT32 || C < AM_LONG_ROW_MIN;
    bitw bw = {pol_row, 0, 0, 0};
    int64_t r, j, bend = (r0 / R + 1) * R; /* the end of row r's matrix */
    const float *cfb = cf + (r0 / R) * C;
    if (lrs && C == 4) { /* e.g. LoRA's (1024, 4); as for C == 8 below */
        apply_rows4(p, pdt, g, gdt, r0, r1, rf, cfb, iv, lrs, wdv, pol_row, scaled, wd, w);
        return;
    }
    if (lrs && C == 8) { /* e.g. LoRA's (1024, 8); as avx512x_apply_rows
                          * (kernels_avx2.c) sends them: pairs in one matrix */
        apply_rows8(p, pdt, g, gdt, r0, r1, rf, cfb, iv, lrs, wdv, pol_row, scaled, wd, w);
        return;
    }
    if (lrs && C == 16) { /* e.g. LoRA's (1024, 16): a row is one vector */
        apply_rows16(p, pdt, g, gdt, r0, r1, bend, R, rf, cfb, iv, lrs, wdv, pol_row,
                     scaled, wd, w);
        return;
    }
    r = r0;
    if (lrs && pdt == AM_DTYPE_FLOAT32 && C > one_row_apply_max() && (r1 - 1) / R == r0 / R)
        for (; r + 4 <= r1; r += 4) /* long float32 rows, four at a time */
            apply_long4((float *)p, g, gdt, r, r0, C, rf, cfb, inv, lrs, k, seed, param_id,
                        step, noff, pol_row, scaled, wd, w);
    for (; r < r1; r++) {
        const __m512 rfv = _mm512_set1_ps(rf[r]);
        const int64_t base = r * C;
        if (lrs) { /* a row of its own lr and bits (internal.h) */
            lr = lrs[r - r0];
            lrv = _mm512_set1_ps(lr);
            if (pol_row) bw_restart(&bw, pol_row + (r - r0) * am_lrs_row_bytes(C));
        }
#define AM_APPLY16(J)                                                         \
    apply16(p, pdt, g, gdt, base + (J),                                       \
            _mm512_mul_ps(rfv, _mm512_loadu_ps(cfb + (J))), iv, lrv, wdv,     \
            scaled, wd, w)
#define AM_APPLY16BF(J, V)                                                    \
    apply16_bf(p, g, gdt, base + (J),                                         \
               _mm512_mul_ps(rfv, _mm512_loadu_ps(cfb + (J))), iv, lrv, wdv,  \
               scaled, wd, w, &(V))
        for (j = 0; j < n64; j += 64) {
            uint64_t bits;
            am_noise_span(w, pdt, base + j, 64);
            if (pf) { /* am_sw_prefetch (simd.h) */
                _mm_prefetch((const char *)p + (base + j + AM_PREFETCH) * es, _MM_HINT_T0);
                _mm_prefetch((const char *)g + (base + j + AM_PREFETCH) * ges, _MM_HINT_T0);
            } else if (l2p) {
                /* AM_L2_PREFETCH_BYTES of p ahead (simd.h), and of g for
                 * 16-bit parameters. float32 rows under AM_LONG_ROW_MIN
                 * too since the twenty-ninth session: a small matrix's
                 * rows start cold (LoRA's 16x1024 from cold caches
                 * 0.90-0.99 -> 0.77-0.81 ns an element on Zen 4; 3072x768,
                 * 1024x1024 and 768x2304, whose streams the hardware
                 * prefetcher follows, within the noise) */
                am_prefetch_l2((const char *)p + (base + j + l2ahead) * es, 64 * es);
                if (pdt != AM_DTYPE_FLOAT32)
                    am_prefetch_l2((const char *)g + (base + j + l2ahead) * ges, 64 * ges);
            }
            if (pdt == AM_DTYPE_BFLOAT16) {
                /* the four vectors' NaN test in two compares (unordered:
                 * either operand NaN) and one test of both masks; the rare
                 * span with a NaN is stored again by st16, whose NaN rule
                 * it needs (the other lanes get the same bits again) */
                __m512 v0, v1, v2, v3;
                bits = (uint64_t)AM_APPLY16BF(j, v0) | (uint64_t)AM_APPLY16BF(j + 16, v1) << 16 |
                       (uint64_t)AM_APPLY16BF(j + 32, v2) << 32 |
                       (uint64_t)AM_APPLY16BF(j + 48, v3) << 48;
                if (__builtin_expect(!_mm512_kortestz(_mm512_cmp_ps_mask(v0, v1, _CMP_UNORD_Q),
                                                      _mm512_cmp_ps_mask(v2, v3, _CMP_UNORD_Q)),
                                     0)) {
                    st16(p, AM_DTYPE_BFLOAT16, base + j, v0, w);
                    st16(p, AM_DTYPE_BFLOAT16, base + j + 16, v1, w);
                    st16(p, AM_DTYPE_BFLOAT16, base + j + 32, v2, w);
                    st16(p, AM_DTYPE_BFLOAT16, base + j + 48, v3, w);
                }
            } else
                bits = (uint64_t)AM_APPLY16(j) | (uint64_t)AM_APPLY16(j + 16) << 16 |
                       (uint64_t)AM_APPLY16(j + 32) << 32 | (uint64_t)AM_APPLY16(j + 48) << 48;
            if (pol_row) bw_put64(&bw, bits);
            am_noise_end(p, pdt, w);
        }
        for (; j < n16; j += 16) {
            unsigned bits;
            am_noise_span(w, pdt, base + j, 16);
            bits = AM_APPLY16(j);
            if (pol_row) bw_put(&bw, bits, 16);
            am_noise_end(p, pdt, w);
        }
#undef AM_APPLY16
#undef AM_APPLY16BF
        for (; j < C; j++) {
            int pos = am_apply_one(p, pdt, g, gdt, base + j, rf[r] * cfb[j], inv, lr,
                                   wdf, seed, param_id, step, noff);
            if (pol_row) bw_put(&bw, (uint32_t)pos, 1);
        }
        if (r + 1 == bend) { /* the next matrix's column factors */
            cfb += C;
            bend += R;
        }
    }
    if (pol_row) bw_flush(&bw);
}

AM_INLINE void apply_body(void *p, const int pdt, const void *g, const int gdt,
                          int64_t R, int64_t C, int64_t r0, int64_t r1,
                          const float *rf, const float *cf, float inv,
                          float lr, const float *lrs, const am_consts *k, uint64_t seed,
                          uint32_t param_id, int64_t step, int64_t noff, uint8_t *pol_row) {
    rng512 w;
    am_noise_init(&w, am_philox32_avx512(), seed, param_id, step, noff);
#define AM_MODE(S, W)                                                         \
    apply_mode(p, pdt, g, gdt, R, C, r0, r1, rf, cf, inv, lr, lrs, k, seed,   \
               param_id, step, noff, pol_row, S, W, &w)
    AM_WITH_MODES(inv, k, AM_MODE);
#undef AM_MODE
}

#define AM_512_CASE(PD, GD)                                                   \
    apply_body(p, PD, g, GD, R, C, r0, r1, rf, cf, inv, lr, lrs, k, seed,     \
               param_id, step, noff, pol_row)

/* C >= 16, any dtypes (kernels_avx2.c sends float32 parameters here only
 * when software prefetch is off: am_sw_prefetch, simd.h). */
static void avx512_apply_rows(void *p, int pdt, const void *g, int gdt,
                              int64_t R, int64_t C, int64_t r0, int64_t r1,
                              const float *rf, const float *cf, float inv,
                              float lr, const float *lrs, const am_consts *k, uint64_t seed,
                              uint32_t param_id, int64_t step, int64_t noff, uint8_t *pol_row) {
    AM_DTYPE_PAIRS(pdt, gdt, AM_512_CASE);
    _mm256_zeroupper(); /* see AM_CLEAN_RETURN (simd.h) */
}

am_apply_fn am_avx512_apply16(void) { return avx512_apply_rows; }

/* Factors of runs of 16 whole small matrices (R*C <= 64, e.g. 3x3
 * convolution weights), as ff_init/ff_next8 in kernels_avx2.c with 16
 * lanes: a run is 16*R*C elements = R*C vectors, and the (row, column) of
 * lane l of vector v repeats from one run to the next. Element e of a run
 * (matrix e / (R*C), flat row e / C) takes rf[e / C] * cf[C * (e / (R*C)) +
 * e % C], the reference's product. For every shape with C < 16 and R*C <=
 * 64 the 16 lanes of a vector use at most 16 consecutive rf values and 16
 * consecutive cf values (checked for each vector when the tables are
 * built), so each vector loads that window of each (masked to the values it
 * uses: nothing past them is read) and picks its lanes with one permute
 * instead of a gather; window offsets, index vectors and masks are
 * tabulated once per call. */
typedef struct ffwin {
    int32_t off;   /* window start, relative to the run's start */
    __mmask16 use; /* the window's floats read */
} ffwin;

/* The tables of one matrix shape (they depend on R and C only). */
typedef struct ff16tab {
    int64_t R, C; /* 0, 0: not built */
    int ok;       /* every vector's windows fit (always for C < 16) */
    __m512i ri[AM_MATS_MAX_ELEMS], ci[AM_MATS_MAX_ELEMS];
    ffwin rw[AM_MATS_MAX_ELEMS], cw[AM_MATS_MAX_ELEMS];
} ff16tab;

typedef struct ff16 {
    const float *rfb, *cfb;
    int64_t R, C;
    int n, v;
    const ff16tab *t;
} ff16;

/* The window of one vector's indices idx (from their smallest to their
 * largest), the permute's index vector and the window's mask; 0 when they
 * span more than 16 floats. */
static int ff16_win(const int32_t *idx, __m512i *out, ffwin *win) {
    int32_t rel[16], lo = idx[0], hi = idx[0];
    int l, span;
    for (l = 1; l < 16; l++) {
        if (idx[l] < lo) lo = idx[l];
        if (idx[l] > hi) hi = idx[l];
    }
    span = hi - lo + 1;
    if (span > 16) return 0;
    for (l = 0; l < 16; l++) rel[l] = idx[l] - lo;
    *out = _mm512_loadu_si512((const void *)rel);
    win->off = lo;
    win->use = (__mmask16)(span == 16 ? 0xffffu : (1u << span) - 1u);
    return 1;
}

/* The tables of shape (R, C), R*C <= AM_MATS_MAX_ELEMS, built once per
 * thread and shape: one call per lr-row used to build them again (4-7% of
 * a 256x256x3x3 update in cache, perf). */
static const ff16tab *ff16_tables(int64_t R, int64_t C) {
    static _Thread_local ff16tab tab;
    int32_t ri[16], ci[16];
    am_runpos pos = {0, 0, 0};
    int v;
    if (tab.R == R && tab.C == C) return &tab;
    tab.ok = 1;
    for (v = 0; v < (int)(R * C) && tab.ok; v++) { /* elements 16 v .. 16 v + 15 of a run */
        am_run_next(&pos, (int)R, (int)C, 16, ri, ci);
        tab.ok = ff16_win(ri, &tab.ri[v], &tab.rw[v]) && ff16_win(ci, &tab.ci[v], &tab.cw[v]);
    }
    tab.R = R;
    tab.C = C;
    return &tab;
}

/* The rows [r0, r0 + returned) it covers: a multiple of 16*R, 0 when r0 is
 * not on a matrix, the matrices are too big or fewer than 16 are left. */
static AM_NOINLINE int64_t ff16_init(ff16 *w, const float *rf, const float *cf, int64_t R,
                         int64_t C, int64_t r0, int64_t r1) {
    w->rfb = rf + r0;
    w->cfb = cf + (r0 / R) * C;
    w->R = R;
    w->C = C;
    w->n = (int)(R * C);
    w->v = 0;
    if (R * C > AM_MATS_MAX_ELEMS || r0 % R != 0 || r1 - r0 < 16 * R) return 0;
    w->t = ff16_tables(R, C);
    if (!w->t->ok) return 0; /* never for C < 16, R*C <= 64 (see above) */
    return (r1 - r0) / (16 * R) * (16 * R);
}

/* The 16 values base[win.off + idx[l]] (the window's masked floats only). */
AM_INLINE __m512 ff16_pick(const float *base, const ffwin *win, __m512i idx) {
    return _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(win->use, base + win->off));
}

AM_INLINE __m512 ff16_next(ff16 *w) {
    const int v = w->v;
    const __m512 fac = _mm512_mul_ps(ff16_pick(w->rfb, &w->t->rw[v], w->t->ri[v]),
                                     ff16_pick(w->cfb, &w->t->cw[v], w->t->ci[v]));
    if (++w->v == w->n) {
        w->v = 0;
        w->rfb += 16 * w->R;
        w->cfb += 16 * w->C;
    }
    return fac;
}

/* The factors rf[i] * cf[j] of the 16 elements 16v.. of a run of 16 3x3
 * matrices, from the run's 48 rf (r) and 48 cf (c) values: element E is
 * (matrix E / 9, row E % 9 / 3, column E % 3); a vector's elements use at
 * most 9 consecutive values of each, all within floats 0..31 or 16..47, so
 * one two-source permute picks each (tables below, base 0 or 16). */
#define AM_E(v, l) (16 * (v) + (l))
#define AM_HI(v) (3 * ((16 * (v) + 15) / 9) + 2)
#define AM_BASE(v) (AM_HI(v) > 31 ? 16 : 0)
#define AM_RI(v, l) (3 * (AM_E(v, l) / 9) + AM_E(v, l) % 9 / 3 - AM_BASE(v))
#define AM_CI(v, l) (3 * (AM_E(v, l) / 9) + AM_E(v, l) % 3 - AM_BASE(v))
#define AM_IDX16(M, v)                                                                 \
    {M(v, 0), M(v, 1), M(v, 2),  M(v, 3),  M(v, 4),  M(v, 5),  M(v, 6),  M(v, 7),    \
     M(v, 8), M(v, 9), M(v, 10), M(v, 11), M(v, 12), M(v, 13), M(v, 14), M(v, 15)}
#define AM_IDX9(M)                                                                     \
    {AM_IDX16(M, 0), AM_IDX16(M, 1), AM_IDX16(M, 2), AM_IDX16(M, 3), AM_IDX16(M, 4),   \
     AM_IDX16(M, 5), AM_IDX16(M, 6), AM_IDX16(M, 7), AM_IDX16(M, 8)}
static const int32_t fac3_ri[9][16] __attribute__((aligned(64))) = AM_IDX9(AM_RI);
static const int32_t fac3_ci[9][16] __attribute__((aligned(64))) = AM_IDX9(AM_CI);

AM_INLINE __m512 fac3(const __m512 *r, const __m512 *c, const int v) {
    const int h = AM_BASE(v) / 16;
    return _mm512_mul_ps(
        _mm512_permutex2var_ps(r[h], _mm512_load_si512((const void *)fac3_ri[v]), r[h + 1]),
        _mm512_permutex2var_ps(c[h], _mm512_load_si512((const void *)fac3_ci[v]), c[h + 1]));
}
#undef AM_IDX9
#undef AM_IDX16
#undef AM_CI
#undef AM_RI
#undef AM_BASE
#undef AM_HI
#undef AM_E

/* The parameter and the 48 rf and cf of the run of 16 3x3 matrices from
 * element f into the caches, AM_APPLY3_AHEAD runs before the apply needs
 * them: the parameter is read nowhere else, so from memory (caches flushed
 * between updates, or a large weight) the apply waited on it. Measured
 * (this and the previous version side by side): 0.94-0.97 of the update's
 * time from memory, 256x256x3x3 and 1280x1280x3x3; 0.99-1.01 in cache; 2
 * runs ahead gained less, 8 no more. Addresses as integers: past the end
 * of the arrays near the last runs (a prefetch never faults). */
#define AM_APPLY3_AHEAD 4
/* With far (Zen 4's tuning, float32 parameters): the parameter also
 * AM_APPLY3_FAR runs (18 KiB) ahead into L2, where the prefetch into L1
 * above (2.3 KiB ahead) is too close to hide the memory's latency. Zen 4,
 * 1 thread, from cold caches, ns an element (two libraries alternated,
 * three rounds): 256x256x3x3 float32 1.14-1.27 -> 0.98-1.06,
 * 1280x1280x3x3 1.26-1.31 -> 1.22-1.25; 16 runs ahead 0.97-1.05 and
 * 1.21-1.27, 64 runs 1.00-1.09; the gradient prefetched too (it comes
 * from the L3, read by the sweep just before) no better. 16-bit
 * parameters: no gain (bfloat16 1.05-1.26 -> 1.07-1.13, float16
 * 1.14-1.19 -> 1.17-1.22), not taken. */
#define AM_APPLY3_FAR 32
AM_INLINE void mats3_prefetch(const void *p, const int pdt, int64_t f, const float *rb,
                              const float *cb, const int far) {
    const uintptr_t pe = pdt == AM_DTYPE_FLOAT32 ? 4 : 2, ahead = AM_APPLY3_AHEAD;
    const uintptr_t pp = (uintptr_t)p + ((uintptr_t)f + 144 * ahead) * pe;
    const uintptr_t rp = (uintptr_t)rb + 192 * ahead, cp = (uintptr_t)cb + 192 * ahead;
    uintptr_t o;
    for (o = 0; o < 144 * pe; o += 64) _mm_prefetch((const char *)(pp + o), _MM_HINT_T0);
    for (o = 0; o < 192; o += 64) {
        _mm_prefetch((const char *)(rp + o), _MM_HINT_T0);
        _mm_prefetch((const char *)(cp + o), _MM_HINT_T0);
    }
    if (far) {
        const uintptr_t fp = (uintptr_t)p + ((uintptr_t)f + 144 * AM_APPLY3_FAR) * pe;
        for (o = 0; o < 144 * pe; o += 64) _mm_prefetch((const char *)(fp + o), _MM_HINT_T1);
    }
}

/* The apply of an lr-row of small matrices (C < 16), walked as one flat
 * stream of 16-element vectors: the runs of 16 whole matrices ff16_init
 * covers, polarity included (a multiple of 16 bits, so the caller's rest
 * starts on a byte). Returns the rows done. */
AM_INLINE int64_t mats_mode(void *p, const int pdt, const void *g, const int gdt,
                            int64_t R, int64_t C, int64_t r0, int64_t r1,
                            const float *rf, const float *cf, float inv, float lr,
                            const am_consts *k, uint8_t *pol_row, const int scaled,
                            const int wd, rng512 *w) {
    const __m512 iv = _mm512_set1_ps(inv), lrv = _mm512_set1_ps(lr),
                 wdv = _mm512_set1_ps(k->wd);
    ff16 ff;
    const int64_t rows = ff16_init(&ff, rf, cf, R, C, r0, r1), f0 = r0 * C;
    const int64_t f1 = (r0 + rows) * C;
    int64_t f;
    if (rows == 0) return 0;
    /* 16 bits on a 16-bit boundary (no match count: count_pos or the
     * agreement sweep counted them), bit 0 of a byte first */
#define AM_VEC(F, FAC)                                                                     \
    do {                                                                                   \
        uint16_t bits_;                                                                    \
        am_noise_span(w, pdt, F, 16);                                                      \
        bits_ = (uint16_t)apply16(p, pdt, g, gdt, F, FAC, iv, lrv, wdv, scaled, wd, w);    \
        if (pol_row) memcpy(pol_row + ((F)-f0) / 8, &bits_, 2);                           \
        am_noise_end(p, pdt, w);                                                           \
    } while (0)
    if (R == 3 && C == 3) { /* runs of 16 matrices: 144 elements, 48 rf and cf */
        const float *rb = rf + r0, *cb = cf + r0; /* cf of matrix r0 / 3: (r0 / 3) * 3 */
        const int far = pdt == AM_DTYPE_FLOAT32 && am_tuning_zen4();
        for (f = f0; f < f1; f += 144, rb += 48, cb += 48) {
            mats3_prefetch(p, pdt, f, rb, cb, far);
            const __m512 r[3] = {_mm512_loadu_ps(rb), _mm512_loadu_ps(rb + 16),
                                 _mm512_loadu_ps(rb + 32)};
            const __m512 c[3] = {_mm512_loadu_ps(cb), _mm512_loadu_ps(cb + 16),
                                 _mm512_loadu_ps(cb + 32)};
            AM_VEC(f, fac3(r, c, 0));
            AM_VEC(f + 16, fac3(r, c, 1));
            AM_VEC(f + 32, fac3(r, c, 2));
            AM_VEC(f + 48, fac3(r, c, 3));
            AM_VEC(f + 64, fac3(r, c, 4));
            AM_VEC(f + 80, fac3(r, c, 5));
            AM_VEC(f + 96, fac3(r, c, 6));
            AM_VEC(f + 112, fac3(r, c, 7));
            AM_VEC(f + 128, fac3(r, c, 8));
        }
    } else if (R == 1 && C == 1) { /* element e: rf[e] * cf[e] */
        for (f = f0; f < f1; f += 16)
            AM_VEC(f, _mm512_mul_ps(_mm512_loadu_ps(rf + f), _mm512_loadu_ps(cf + f)));
    } else {
        for (f = f0; f < f1; f += 16) AM_VEC(f, ff16_next(&ff));
    }
#undef AM_VEC
    return rows;
}

AM_INLINE int64_t mats_body(void *p, const int pdt, const void *g, const int gdt,
                            int64_t R, int64_t C, int64_t r0, int64_t r1,
                            const float *rf, const float *cf, float inv, float lr,
                            const am_consts *k, uint64_t seed, uint32_t param_id,
                            int64_t step, int64_t noff, uint8_t *pol_row) {
    rng512 w;
    am_noise_init(&w, am_philox32_avx512(), seed, param_id, step, noff);
    int64_t rows = 0;
#define AM_MODE(S, W)                                                         \
    rows = mats_mode(p, pdt, g, gdt, R, C, r0, r1, rf, cf, inv, lr, k, pol_row, S, W, &w)
    AM_WITH_MODES(inv, k, AM_MODE);
#undef AM_MODE
    return rows;
}

#define AM_MATS512_CASE(PD, GD)                                               \
    AM_CLEAN_RETURN(int64_t, mats_body(p, PD, g, GD, R, C, r0, r1, rf, cf, inv, lr, k, \
                                       seed, param_id, step, noff, pol_row))

static int64_t avx512_apply_mats(void *p, int pdt, const void *g, int gdt, int64_t R,
                                 int64_t C, int64_t r0, int64_t r1, const float *rf,
                                 const float *cf, float inv, float lr,
                                 const am_consts *k, uint64_t seed, uint32_t param_id,
                                 int64_t step, int64_t noff, uint8_t *pol_row) {
    AM_DTYPE_PAIRS(pdt, gdt, AM_MATS512_CASE);
}

am_apply_mats_fn am_avx512_apply_mats(void) { return avx512_apply_mats; }

/* The agreement sweep of an lr-row of small matrices (agree_small in
 * kernels_avx2.c with 16 lanes): the runs of 16 whole matrices from r0 on,
 * their new polarity bits written and compared with the old ones; the sign
 * test is u >= thr (am_pos_threshold of the clip scale). Returns the rows
 * done, their matches in *matches. */
AM_INLINE int64_t agree_mats_body(const void *g, const int gdt, int64_t R, int64_t C,
                                  int64_t r0, int64_t r1, const float *rf,
                                  const float *cf, float thr, uint8_t *pol_row,
                                  int64_t *matches) {
    const __m512 tv = _mm512_set1_ps(thr);
    bitw bw = {pol_row, 0, 0, 0};
    ff16 ff;
    const int64_t rows = ff16_init(&ff, rf, cf, R, C, r0, r1), f1 = (r0 + rows) * C;
    int64_t f;
    *matches = 0;
    if (rows == 0) return 0;
    for (f = r0 * C; f < f1; f += 16) {
        const __m512 u = _mm512_mul_ps(ff16_next(&ff), am_ld16(g, gdt, f));
        bw_put(&bw, (uint32_t)_mm512_cmp_ps_mask(u, tv, _CMP_GE_OQ), 16);
    }
    *matches = bw.matches;
    return rows;
}

static int64_t avx512_agree_mats(const void *g, int gdt, int64_t R, int64_t C,
                                 int64_t r0, int64_t r1, const float *rf,
                                 const float *cf, float thr, uint8_t *pol_row,
                                 int64_t *matches) {
    switch (gdt) {
    case AM_DTYPE_FLOAT32:
        AM_CLEAN_RETURN(int64_t, agree_mats_body(g, 0, R, C, r0, r1, rf, cf, thr, pol_row,
                                                 matches));
    case AM_DTYPE_BFLOAT16:
        AM_CLEAN_RETURN(int64_t, agree_mats_body(g, 1, R, C, r0, r1, rf, cf, thr, pol_row,
                                                 matches));
    default:
        AM_CLEAN_RETURN(int64_t, agree_mats_body(g, 2, R, C, r0, r1, rf, cf, thr, pol_row,
                                                 matches));
    }
}

am_agree_mats_fn am_avx512_agree_mats(void) { return avx512_agree_mats; }

/* The count_pos slot (internal.h), 32 elements per step on their bits, as
 * stats_rows counts: g > 0 exactly when its bits - 1 (unsigned) are below
 * +inf's bits, and the smallest such difference belongs to the smallest
 * positive value (minpos_of). */
AM_INLINE int64_t count_pos_body(const void *g, const int gdt, int64_t n, const uint8_t *bits,
                                 float *minpos) {
    const size_t es = gdt == AM_DTYPE_FLOAT32 ? 4 : 2;
    __m512i mn = _mm512_set1_epi32(-1);
    int64_t e, mism = 0;
    for (e = 0; e + 32 <= n; e += 32) {
        const char *x = (const char *)g + (size_t)e * es;
        const __m512i a = _mm512_loadu_si512((const void *)x);
        const uint32_t pos =
            pos_mask32(gdt, a,
                       es == 4 ? _mm512_loadu_si512((const void *)(x + 64)) : a, &mn);
        uint32_t old;
        memcpy(&old, bits + e / 8, 4);
        mism += __builtin_popcount(pos ^ old);
    }
    return am_count_pos_tail(g, gdt, e, n, bits, e - mism, minpos_of(mn, gdt), minpos);
}

static int64_t avx512_count_pos(const void *g, int gdt, int64_t n, const uint8_t *bits,
                                float *minpos) {
    switch (gdt) {
    case AM_DTYPE_FLOAT32: AM_CLEAN_RETURN(int64_t, count_pos_body(g, 0, n, bits, minpos));
    case AM_DTYPE_BFLOAT16: AM_CLEAN_RETURN(int64_t, count_pos_body(g, 1, n, bits, minpos));
    default: AM_CLEAN_RETURN(int64_t, count_pos_body(g, 2, n, bits, minpos));
    }
}

am_count_pos_fn am_avx512_count_pos(void) { return avx512_count_pos; }

/* The SPEC's constants of flat_mode, in vectors. */
typedef struct flatk {
    __m512 tv, iv, wdv, up, down, lo, hi, b2, omb2, eps, one;
} flatk;

/* Elements e..e+15 of ref_finish_flat (e % 8 == 0: the vector owns two
 * whole polarity bytes), stored with the noise of the span w holds; returns
 * how many of their polarity bits agreed. */
AM_INLINE int flat16(void *p, const int pdt, const void *g, const int gdt, float *sq,
                     float *lr, uint8_t *pol, int64_t e, const flatk *c, int64_t step,
                     const int pf, const int scaled, const int wd, rng512 *w) {
    const __m512 x = am_ld16(g, gdt, e);
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(sq + e), c->b2),
                                   _mm512_mul_ps(_mm512_mul_ps(x, x), c->omb2));
    __m512 u = _mm512_mul_ps(_mm512_div_ps(c->one, _mm512_sqrt_ps(_mm512_add_ps(v, c->eps))), x);
    __m512 lrv = _mm512_loadu_ps(lr + e), pv, t;
    uint16_t pb, mb, old;
    if (pf) { /* am_sw_prefetch (simd.h) */
        _mm_prefetch((const char *)(sq + e + AM_FLAT_PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)(lr + e + AM_FLAT_PREFETCH), _MM_HINT_T0);
        _mm_prefetch((const char *)p + (e + AM_FLAT_PREFETCH) * (pdt == AM_DTYPE_FLOAT32 ? 4 : 2), _MM_HINT_T0);
        _mm_prefetch((const char *)g + (e + AM_FLAT_PREFETCH) * (gdt == AM_DTYPE_FLOAT32 ? 4 : 2), _MM_HINT_T0);
    }
    pb = (uint16_t)_mm512_cmp_ps_mask(u, c->tv, _CMP_GE_OQ);
    if (scaled) u = _mm512_mul_ps(u, c->iv);
    memcpy(&old, pol + (e >> 3), 2);
    mb = (uint16_t)~(pb ^ old);
    memcpy(pol + (e >> 3), &pb, 2);
    _mm512_storeu_ps(sq + e, v);
    if (step > 0) {
        lrv = _mm512_mul_ps(lrv, _mm512_mask_blend_ps(mb, c->down, c->up));
        lrv = _mm512_mask_mov_ps(lrv, _mm512_cmp_ps_mask(lrv, c->lo, _CMP_NGE_UQ), c->lo); /* NaN: min_lr */
        lrv = _mm512_mask_mov_ps(lrv, _mm512_cmp_ps_mask(lrv, c->hi, _CMP_GT_OQ), c->hi);
        _mm512_storeu_ps(lr + e, lrv);
    }
    pv = am_ld16(p, pdt, e);
    t = wd ? _mm512_add_ps(u, _mm512_mul_ps(c->wdv, pv)) : u;
    st16(p, pdt, e, _mm512_sub_ps(pv, _mm512_mul_ps(lrv, t)), w);
    return __builtin_popcount(mb);
}

/* ref_finish_flat (e0 % 8 == 0), 16 elements per vector: the same IEEE
 * operations per element as the reference (ema, 1 / sqrt, the sign test,
 * the clip's multiplication, the lr bump and clamp, the apply), the same
 * noise and rounding as apply16 for 16-bit parameters. Every stream is
 * prefetched AM_FLAT_PREFETCH elements ahead (16M elements, 2 threads:
 * 15.3 -> 13.1 ms float32, 14.4 -> 12.1 ms bfloat16). scaled and wd as in
 * apply_mode. Spans of 64 elements, as apply_mode's: no call inside one
 * (the noise window is filled, and float16 values set aside are rounded,
 * between spans), so the loop's constants stay in registers. */
AM_INLINE int64_t flat_mode(void *p, const int pdt, const void *g, const int gdt,
                            float *sq, float *lr, uint8_t *pol, int64_t e0,
                            int64_t e1, float scale, const am_consts *k, uint64_t seed,
                            uint32_t param_id, int64_t step, int64_t noff, const int scaled,
                            const int wd, rng512 *w) {
    /* the SPEC's sign of u / scale as u >= tv; the apply's u * (1 / scale)
     * (as ref_finish_flat) */
    const flatk c = {_mm512_set1_ps(am_pos_threshold(scale)), _mm512_set1_ps(1.0f / scale),
                     _mm512_set1_ps(k->wd), _mm512_set1_ps(k->bump_up),
                     _mm512_set1_ps(k->bump_down), _mm512_set1_ps(k->min_lr),
                     _mm512_set1_ps(k->max_lr), _mm512_set1_ps(k->beta2),
                     _mm512_set1_ps(k->one_m_beta2), _mm512_set1_ps(k->eps),
                     _mm512_set1_ps(1.0f)};
    const int pf = am_sw_prefetch();
    int64_t e = e0, matches = 0;
#define AM_FLAT16(E) flat16(p, pdt, g, gdt, sq, lr, pol, (E), &c, step, pf, scaled, wd, w)
    for (; e + 64 <= e1; e += 64) {
        am_noise_span(w, pdt, e, 64);
        matches += AM_FLAT16(e) + AM_FLAT16(e + 16) + AM_FLAT16(e + 32) + AM_FLAT16(e + 48);
        am_noise_end(p, pdt, w);
    }
    for (; e + 16 <= e1; e += 16) {
        am_noise_span(w, pdt, e, 16);
        matches += AM_FLAT16(e);
        am_noise_end(p, pdt, w);
    }
#undef AM_FLAT16
    if (e < e1) { /* the last 1..15 elements: the reference's loop (SSE code) */
        _mm256_zeroupper();
        matches += am_kernels_ref.finish_flat(p, pdt, g, gdt, sq, lr, pol, e, e1, scale,
                                              k, seed, param_id, step, noff);
    }
    return matches;
}

AM_INLINE int64_t flat_body(void *p, const int pdt, const void *g, const int gdt,
                            float *sq, float *lr, uint8_t *pol, int64_t e0, int64_t e1,
                            float scale, const am_consts *k, uint64_t seed,
                            uint32_t param_id, int64_t step, int64_t noff) {
    rng512 w;
    am_noise_init(&w, am_philox32_avx512(), seed, param_id, step, noff);
    int64_t matches = 0;
#define AM_MODE(S, W)                                                         \
    matches = flat_mode(p, pdt, g, gdt, sq, lr, pol, e0, e1, scale, k, seed,  \
                        param_id, step, noff, S, W, &w)
    AM_WITH_MODES(scale, k, AM_MODE);
#undef AM_MODE
    return matches;
}

#define AM_FLAT512_CASE(PD, GD)                                               \
    AM_CLEAN_RETURN(int64_t, flat_body(p, PD, g, GD, sq, lr, pol, e0, e1, scale, k, \
                                       seed, param_id, step, noff))

/* Every pdt (float32 is stored unrounded). */
static int64_t avx512_finish_flat(void *p, int pdt, const void *g, int gdt, float *sq,
                                  float *lr, uint8_t *pol, int64_t e0, int64_t e1,
                                  float scale, const am_consts *k, uint64_t seed,
                                  uint32_t param_id, int64_t step, int64_t noff) {
    AM_DTYPE_PAIRS(pdt, gdt, AM_FLAT512_CASE);
}

am_flat_fn am_avx512_flat(void) { return avx512_finish_flat; }

#else

am_apply_fn am_avx512_apply16(void) { return NULL; }
am_stats_fn am_avx512_stats(int l2) {
    (void)l2;
    return NULL;
}
am_apply_mats_fn am_avx512_apply_mats(void) { return NULL; }
am_agree_mats_fn am_avx512_agree_mats(void) { return NULL; }
am_count_pos_fn am_avx512_count_pos(void) { return NULL; }
am_flat_fn am_avx512_flat(void) { return NULL; }

#endif
