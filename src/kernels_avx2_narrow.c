/*
 * kernels_avx2_narrow.c — the AVX2 stats pass (stats_body of
 * kernels_avx2.c) of matrices exactly 4, 8, 16 or 32 columns wide, such as
 * LoRA's B matrices (out, rank), 8 rows at a time.
 *
 * stats_body walks rows four at a time and finishes each row in scalar
 * code: its lane sums stored and combined, its moment and W-sum weight
 * divided one at a time, a row of 4 entirely scalar. At these widths that
 * per-row work was most of the pass (1024x4 float32, in cache: 9.95
 * cycles per element; AVX-512's 16-row kernels did 2.57). Here 8 rows are
 * finished together: their lane sums reduced across rows by shuffles in
 * am_lanesum_finish's order, their moments and weights 8 at a time (2.24
 * cycles per element; faster than those AVX-512 kernels, which it replaced:
 * the avx2+avx512 set calls it too).
 *
 * The same operations in the same order per value as stats_body, so the
 * same bits (test_simd_equal): a row's 8 lane sums add its 8-column chunks
 * in order, from 0 (0 + x*x == x*x for every square: never -0, and a NaN
 * stays that NaN); a row of 4 fills lanes 0-3 of its sums and leaves 4-7
 * at 0; columns add their rows in ascending order; each group of 4 rows
 * adds ((t0 + t1) + t2) + t3 to the W sums (internal.h, am_wsum).
 *
 * Built with -mavx2 -mf16c -mpopcnt on this file only.
 */
#include "simd.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__F16C__)

#include <immintrin.h>
#include <stdint.h>

#include "am_bits.h"
#include "avx2_load.h"

#define AM_INLINE static inline __attribute__((always_inline))

/* Bit l: lane l of x is > 0. */
AM_INLINE uint32_t pos8(__m256 x) {
    return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GT_OQ));
}

/* stats_body's running minimum of the positive elements (min_pos there). */
AM_INLINE __m256i min_pos(__m256i mn, __m256 x) {
    return _mm256_min_epu32(mn, _mm256_sub_epi32(_mm256_castps_si256(x),
                                                 _mm256_set1_epi32(1)));
}

/* Lane 0 of each 128-bit block of t = [s04 s15 s26 s37 | ...] (two rows'
 * lane sums folded: a0 + a4, a1 + a5, a2 + a6, a3 + a7) becomes that row's
 * am_lanesum_finish, (s04 + s26) + (s15 + s37). */
AM_INLINE __m256 fold_quads(__m256 t) {
    const __m256 u = _mm256_add_ps(t, _mm256_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm256_add_ps(u, _mm256_permute_ps(u, _MM_SHUFFLE(2, 3, 0, 1)));
}

/* The 8 row sums (lane r: row r) from w[k], rows 2k and 2k + 1 in lane 0
 * of its low and high 128-bit blocks (fold_quads). */
AM_INLINE __m256 gather_rows(const __m256 *w) {
    const __m256 x = _mm256_unpacklo_ps(w[0], w[1]); /* r0 r2 . . | r1 r3 . . */
    const __m256 y = _mm256_unpacklo_ps(w[2], w[3]); /* r4 r6 . . | r5 r7 . . */
    const __m256 z = _mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0));
    return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* The n stored polarity bits from bit (n = 4, 8, 16 or 32), reading only
 * the bytes that hold them: a row of 4 starts at bit 0 or 4 of a byte and
 * never crosses into the next (am_bits8_at would read that byte too, which
 * is past the buffer for the last row of an lr-row of an even number of
 * rows); longer rows start on a byte. */
AM_INLINE uint32_t old_bits(const am_polmap *pm, int64_t bit, const int n) {
    if (n == 4) return (uint32_t)(pm->bits[bit >> 3] >> (bit & 7)) & 0xfu;
    if (n == 8) return am_bits8_at(pm->bits, bit);
    if (n == 16) return am_bits16_at(pm->bits, bit);
    return am_bits32_at(pm->bits, bit);
}

/* Rows i..i+7 of a matrix of N columns (N = 4, 8, 16 or 32, a constant):
 * stats_body's results for them (rowpart, colpart, rowmatch, mn, the W
 * sums and the new row moments). */
AM_INLINE void rows8(const void *g, const int gdt, const int cnt, const int N, int64_t i,
                     int64_t i0, float *rowpart, float *colpart, const am_polmap *pm,
                     int32_t *rowmatch, __m256i *mn, const am_wsum *ws) {
    enum { K = 4 }; /* vectors per row, at most (N = 32) */
    const int nk = N >= 8 ? N / 8 : 1;
    __m256 sq[8][K], w4[4], rs;
    uint32_t pos[8];
    int r, k;
    if (N == 4) { /* two rows a vector: lanes 0-3 row 2k, 4-7 row 2k + 1 */
        __m128 c = _mm_loadu_ps(colpart);
        for (k = 0; k < 4; k++) {
            const __m256 x = am_ld8(g, gdt, (i + 2 * k) * 4);
            if (cnt) {
                const uint32_t m = pos8(x);
                pos[2 * k] = m & 0xfu;
                pos[2 * k + 1] = m >> 4;
                *mn = min_pos(*mn, x);
            }
            sq[k][0] = _mm256_mul_ps(x, x);
            c = _mm_add_ps(c, _mm256_castps256_ps128(sq[k][0]));
            c = _mm_add_ps(c, _mm256_extractf128_ps(sq[k][0], 1));
            /* a row's sums are x0..x3 squared and four zeros: s04 = x0^2 */
            w4[k] = fold_quads(sq[k][0]);
        }
        _mm_storeu_ps(colpart, c);
    } else {
        __m256 c[K], acc[8]; /* acc[r]: row r's 8 lane sums */
        for (k = 0; k < nk; k++) c[k] = _mm256_loadu_ps(colpart + 8 * k);
        for (r = 0; r < 8; r++) {
            if (cnt) pos[r] = 0;
            for (k = 0; k < nk; k++) {
                const __m256 x = am_ld8(g, gdt, (i + r) * N + 8 * k);
                if (cnt) {
                    pos[r] |= pos8(x) << (8 * k);
                    *mn = min_pos(*mn, x);
                }
                sq[r][k] = _mm256_mul_ps(x, x);
                acc[r] = k == 0 ? sq[r][0] : _mm256_add_ps(acc[r], sq[r][k]);
                c[k] = _mm256_add_ps(c[k], sq[r][k]);
            }
        }
        for (k = 0; k < nk; k++) _mm256_storeu_ps(colpart + 8 * k, c[k]);
        for (k = 0; k < 4; k++) { /* rows 2k, 2k + 1 folded, a block each */
            const __m256 lo = _mm256_permute2f128_ps(acc[2 * k], acc[2 * k + 1], 0x20);
            const __m256 hi = _mm256_permute2f128_ps(acc[2 * k], acc[2 * k + 1], 0x31);
            w4[k] = fold_quads(_mm256_add_ps(lo, hi));
        }
    }
    rs = gather_rows(w4);
    _mm256_storeu_ps(rowpart + (i - i0), rs);
    if (cnt) {
        const int64_t q0 = am_polmap_bit(pm, i, 0);
        for (r = 0; r < 8; r++) {
            /* an lr-row per matrix row: its bits lr_bits apart */
            const int64_t qb = pm->rows_per_lr == 1 ? q0 + r * pm->lr_bits
                                                    : am_polmap_bit(pm, i + r, 0);
            rowmatch[i - i0 + r] = N - __builtin_popcount(pos[r] ^ old_bits(pm, qb, N));
        }
    }
    if (ws) { /* am_wsum_weight of each row, then the two groups' W sums */
        const __m256 nr = _mm256_add_ps(
            _mm256_mul_ps(_mm256_loadu_ps(ws->row_old + i), _mm256_set1_ps(ws->k->beta2)),
            _mm256_mul_ps(_mm256_add_ps(_mm256_mul_ps(rs, _mm256_set1_ps(ws->Cinv)),
                                        _mm256_set1_ps(ws->k->eps)),
                          _mm256_set1_ps(ws->k->one_m_beta2)));
        float w[8];
        int q;
        _mm256_storeu_ps(ws->nr + i, nr);
        _mm256_storeu_ps(w, _mm256_div_ps(_mm256_set1_ps(1.0f), nr));
        if (N == 4) {
            __m128 acc = _mm_loadu_ps(ws->wpart);
            for (q = 0; q < 8; q += 4) { /* rows q..q+3: vectors q/2, q/2 + 1 */
                const __m256 a = _mm256_mul_ps(
                    sq[q / 2][0], _mm256_setr_ps(w[q], w[q], w[q], w[q], w[q + 1], w[q + 1],
                                                 w[q + 1], w[q + 1]));
                const __m256 b = _mm256_mul_ps(
                    sq[q / 2 + 1][0],
                    _mm256_setr_ps(w[q + 2], w[q + 2], w[q + 2], w[q + 2], w[q + 3], w[q + 3],
                                   w[q + 3], w[q + 3]));
                __m128 t = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
                t = _mm_add_ps(t, _mm256_castps256_ps128(b));
                acc = _mm_add_ps(acc, _mm_add_ps(t, _mm256_extractf128_ps(b, 1)));
            }
            _mm_storeu_ps(ws->wpart, acc);
        } else {
            for (k = 0; k < nk; k++) {
                __m256 acc = _mm256_loadu_ps(ws->wpart + 8 * k);
                for (q = 0; q < 8; q += 4) {
                    __m256 t = _mm256_mul_ps(sq[q][k], _mm256_set1_ps(w[q]));
                    t = _mm256_add_ps(t, _mm256_mul_ps(sq[q + 1][k], _mm256_set1_ps(w[q + 1])));
                    t = _mm256_add_ps(t, _mm256_mul_ps(sq[q + 2][k], _mm256_set1_ps(w[q + 2])));
                    t = _mm256_add_ps(t, _mm256_mul_ps(sq[q + 3][k], _mm256_set1_ps(w[q + 3])));
                    acc = _mm256_add_ps(acc, t);
                }
                _mm256_storeu_ps(ws->wpart + 8 * k, acc);
            }
        }
    }
}

/* With l2pf (am_sw_prefetch off: AMD), the gradient of each group of 8
 * rows is prefetched AM_NARROW_PREFETCH_BYTES ahead into L2: a narrow
 * matrix is small, and its pages start cold (the LoRA step of 192 16x1024
 * and 1024x16 float32 tensors from cold caches, Zen 4, 1 thread:
 * 2.82-3.25 -> 2.77-3.05 ms, alternated, with a prefetch 4 or 16 KiB
 * ahead no better; twenty-ninth session). */
#define AM_NARROW_PREFETCH_BYTES 8192
#define AM_NARROW_LOOP(GD, CNT, N)                                                          \
    for (; i + 8 <= i1; i += 8) {                                                           \
        const int es_ = (GD) == AM_DTYPE_FLOAT32 ? 4 : 2;                                   \
        if (l2pf) /* (as an integer: the address may lie past the gradient) */             \
            am_prefetch_l2((const char *)((uintptr_t)g + (uintptr_t)(i * N * es_) +          \
                                          AM_NARROW_PREFETCH_BYTES),                        \
                           8 * N * es_);                                                    \
        rows8(g, GD, CNT, N, i, i0, rowpart, colpart, pm, rowmatch, mn, ws);                \
    }
#define AM_NARROW_N(GD, CNT)                                                                \
    switch (C) {                                                                            \
    case 4: AM_NARROW_LOOP(GD, CNT, 4); break;                                              \
    case 8: AM_NARROW_LOOP(GD, CNT, 8); break;                                              \
    case 16: AM_NARROW_LOOP(GD, CNT, 16); break;                                            \
    default: AM_NARROW_LOOP(GD, CNT, 32); break;                                            \
    }
#define AM_NARROW_DT(CNT)                                                                   \
    switch (gdt) {                                                                          \
    case AM_DTYPE_FLOAT32: AM_NARROW_N(AM_DTYPE_FLOAT32, CNT) break;                        \
    case AM_DTYPE_BFLOAT16: AM_NARROW_N(AM_DTYPE_BFLOAT16, CNT) break;                      \
    default: AM_NARROW_N(AM_DTYPE_FLOAT16, CNT) break;                                      \
    }

int64_t am_avx2_stats_narrow(const void *g, int gdt, int64_t C, int64_t i0, int64_t i1,
                             float *rowpart, float *colpart, const am_polmap *pm,
                             int32_t *rowmatch, uint32_t *minbits, const am_wsum *ws) {
    int64_t i = i0;
    const int l2pf = !am_sw_prefetch();
    __m256i m = _mm256_loadu_si256((const __m256i *)minbits), *mn = &m;
    if (C != 4 && C != 8 && C != 16 && C != 32) return i0;
    if (pm) {
        AM_NARROW_DT(1)
    } else {
        AM_NARROW_DT(0)
    }
    _mm256_storeu_si256((__m256i *)minbits, m);
    _mm256_zeroupper(); /* see AM_CLEAN_RETURN (simd.h) */
    return i;
}
#undef AM_NARROW_DT
#undef AM_NARROW_N
#undef AM_NARROW_LOOP

#else /* not built for x86-64 with AVX2 + F16C: never referenced */

typedef int am_kernels_avx2_narrow_unused;

#endif
