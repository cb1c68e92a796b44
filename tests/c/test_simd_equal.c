/* test_simd_equal.c — the optimised kernels give the scalar reference's bits,
 * for every thread count.
 *
 * 1. Kernel slots, one by one: the AVX2 table against am_kernels_ref on
 *    awkward sizes, offsets and every dtype pair, with software prefetch
 *    on and off (skipped, saying so, when the CPU or the build has no AVX2).
 * 2. Whole updates (3 steps) through am_update: scalar on 1 thread is the
 *    baseline; the best kernels on 1, 2 and 3 threads and the scalar kernels
 *    on 3 threads must reproduce parameter, lr, polarity, second moments and
 *    reports bit for bit. Shapes 0-D..4-D, sizes around every multiple of 8,
 *    multi-tile shapes, a long single lr-row, many small matrices (3x3 and
 *    1x1 convolution weights: the batched slots, threads engaged).
 * 3. The batched small-matrix slots (stats_mats, u2_mats, moments_mats),
 *    AVX2 against the reference, batch lengths around multiples of 8.
 * Randomised data; the seed is printed and AM_TEST_SEED overrides it. */
#include "simd.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t g_seed = 0x5EED5EEDull;

/* ------------------------------------------------------------ data ---- */

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static float rng_unit(uint64_t *s) { /* (-1, 1) */
    return (float)((double)(rng_next(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

/* Gradient-like values: random sign and magnitudes over 8 decades, some
 * exact zeros (polarity treats 0 as not positive). */
static float rand_value(uint64_t *s) {
    uint64_t r = rng_next(s);
    float mag;
    if ((r & 31) == 0) return 0.0f;
    mag = (float)(1.0 + (double)((r >> 8) & 0xffff) / 65536.0);
    mag *= (float)(1e-6 * (double)(1ull << ((r >> 24) % 24)));
    return (r >> 40) & 1 ? mag : -mag;
}

static void fill(void *buf, int dt, int64_t n, uint64_t *s, int param) {
    int64_t i;
    for (i = 0; i < n; i++) {
        /* parameters near zero too: half subnormals take the fallback path */
        float v = param ? (i % 7 == 3 ? rand_value(s) * 1e-3f : rng_unit(s)) : rand_value(s);
        if (dt == AM_DTYPE_FLOAT32) ((float *)buf)[i] = v;
        else if (dt == AM_DTYPE_BFLOAT16) ((uint16_t *)buf)[i] = am_f32_to_bf16_rne(v);
        else ((uint16_t *)buf)[i] = am_f32_to_f16_rne(v);
    }
}

/* Element i of buf (dtype dt) set to x, rounded to nearest. */
static void set_value(void *buf, int dt, int64_t i, float x) {
    if (dt == AM_DTYPE_FLOAT32) ((float *)buf)[i] = x;
    else if (dt == AM_DTYPE_BFLOAT16) ((uint16_t *)buf)[i] = am_f32_to_bf16_rne(x);
    else ((uint16_t *)buf)[i] = am_f32_to_f16_rne(x);
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    assert_non_null(p);
    return p;
}

/* ------------------------------------------- 1. kernel slot by slot ---- */

static const int64_t SIZES[] = {0, 1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 65, 127, 1023, 4097};
#define NSIZES ((int)(sizeof SIZES / sizeof SIZES[0]))

static void check_slots(const am_kernels *a, const am_kernels *b, int64_t C, int gdt,
                        int pdt, uint64_t *s) {
    /* R = 7 rows: the 4-row blocks of the SIMD kernels and their remainder.
     * noff: the noise of a shard's elements is keyed by their index in the
     * whole parameter (am_update_stats_shard); 0, or an offset that is not a
     * multiple of 8 (the noise windows start mid-quad) or is one, by C */
    const int64_t R = 7, j0 = C > 9 ? 5 : 0, n = R * C;
    const int64_t noff = C % 3 == 0 ? 0 : C % 3 == 1 ? 1000003 : 8 * C;
    const size_t gs = am_dtype_size((am_dtype)gdt), ps = am_dtype_size((am_dtype)pdt);
    void *g = xmalloc((size_t)n * gs), *p1 = xmalloc((size_t)n * ps), *p2 = xmalloc((size_t)n * ps);
    float *rp1 = xmalloc(4 * R), *rp2 = xmalloc(4 * R);
    float *cp1 = xmalloc(4 * (size_t)C), *cp2 = xmalloc(4 * (size_t)C);
    float *rf = xmalloc(4 * R), *cf = xmalloc(4 * (size_t)C);
    float *sq1 = xmalloc(4 * (size_t)n), *sq2 = xmalloc(4 * (size_t)n);
    float *lr1 = xmalloc(4 * (size_t)n), *lr2 = xmalloc(4 * (size_t)n);
    uint8_t *pol1 = xmalloc((size_t)n / 8 + 2), *pol2 = xmalloc((size_t)n / 8 + 2);
    uint8_t *pa = xmalloc((size_t)n / 8 + 2), *pb = xmalloc((size_t)n / 8 + 2);
    uint8_t *polr = xmalloc((size_t)(R + 1) / 2 * (size_t)((2 * C + 7) / 8) + 1);
    am_hparams hp = am_hparams_default();
    am_consts k;
    int64_t i, m1, m2;
    hp.weight_decay = (C & 1) ? 0.1 : 0.0;
    k = am_consts_from(&hp);
    fill(g, gdt, n, s, 0);
    fill(p1, pdt, n, s, 1);
    if (n > 3) { /* a NaN and infinities among the parameters: the apply's
                  * special cases (bfloat16 NaN: quiet bit set) */
        set_value(p1, pdt, n / 3, NAN);
        set_value(p1, pdt, n / 2, INFINITY);
        set_value(p1, pdt, n - 1, -INFINITY);
    }
    memcpy(p2, p1, (size_t)n * ps);
    for (i = 0; i < R; i++) rf[i] = 0.5f + rng_unit(s) * 0.25f;
    for (i = 0; i < C; i++) cf[i] = 1e3f * (1.5f + rng_unit(s));
    for (i = 0; i < n; i++) {
        sq1[i] = sq2[i] = rand_value(s) * rand_value(s);
        lr1[i] = lr2[i] = 1e-4f * (1.5f + rng_unit(s));
    }
    for (i = 0; i < n / 8 + 2; i++) pol1[i] = pol2[i] = (uint8_t)rng_next(s);
    for (i = 0; i < (R + 1) / 2 * ((2 * C + 7) / 8) + 1; i++) polr[i] = (uint8_t)rng_next(s);
    /* zeros (not positive: no bit, no minimum) in a vector and in a tail */
    for (i = 0; i < n; i += 11) {
        if (gdt == AM_DTYPE_FLOAT32) ((float *)g)[i] = 0.0f;
        else ((uint16_t *)g)[i] = (uint16_t)((i & 2) ? 0x8000u : 0u);
    }

    if (C - j0 > 0) {
        a->stats_tile(g, gdt, C, 0, R, j0, C, rp1, cp1, NULL, NULL, NULL, NULL);
        b->stats_tile(g, gdt, C, 0, R, j0, C, rp2, cp2, NULL, NULL, NULL, NULL);
        assert_memory_equal(rp1, rp2, 4 * R);
        assert_memory_equal(cp1, cp2, 4 * (size_t)(C - j0));
        { /* the W sums (am_wsum) over 13 rows, from row i0 = 0..3 (3 or 2
           * groups of 4 rows, the next group's stats interleaved with the
           * last's sums, then single rows), the weights from random old
           * moments */
            enum { RW = 13 };
            float row_old[RW], nr1[RW], nr2[RW], *rq1 = xmalloc(4 * RW), *rq2 = xmalloc(4 * RW);
            float *w1 = xmalloc(4 * (size_t)C), *w2 = xmalloc(4 * (size_t)C);
            void *gw = xmalloc((size_t)(RW * C) * gs);
            am_wsum ws1, ws2;
            int64_t i0;
            fill(gw, gdt, RW * C, s, 0);
            for (i = 0; i < RW; i++) row_old[i] = rand_value(s) * rand_value(s);
            am_polmap pmw;
            int32_t mw1[RW], mw2[RW];
            float mpw1, mpw2;
            const int64_t nbw = (RW + 1) / 2 * ((2 * C + 7) / 8) + 1;
            uint8_t *bw = xmalloc((size_t)nbw);
            for (i = 0; i < nbw; i++) bw[i] = (uint8_t)rng_next(s);
            pmw.bits = bw;
            pmw.r0 = 0;
            pmw.rows_per_lr = 2;
            pmw.lr_bits = 8 * ((2 * C + 7) / 8);
            pmw.C = C;
            /* i0 = 0, 2 without the agreement count, 1, 3 with it (the
             * SIMD kernels' other column loop) */
            for (i0 = 0; i0 <= 3; i0++) {
                const am_polmap *pmx = (i0 & 1) ? &pmw : NULL;
                ws1.row_old = ws2.row_old = row_old;
                ws1.k = ws2.k = &k;
                ws1.Cinv = ws2.Cinv = am_inv_count(C);
                ws1.nr = nr1;
                ws2.nr = nr2;
                ws1.wpart = w1;
                ws2.wpart = w2;
                memset(nr1, 0, sizeof nr1);
                memset(nr2, 0, sizeof nr2);
                a->stats_tile(gw, gdt, C, i0, RW, j0, C, rq1, cp1, pmx, mw1, &mpw1, &ws1);
                b->stats_tile(gw, gdt, C, i0, RW, j0, C, rq2, cp2, pmx, mw2, &mpw2, &ws2);
                if (pmx) assert_memory_equal(mw1, mw2, sizeof(int32_t) * (size_t)(RW - i0));
                assert_memory_equal(rq1, rq2, 4 * (size_t)(RW - i0));
                assert_memory_equal(cp1, cp2, 4 * (size_t)(C - j0));
                assert_memory_equal(nr1, nr2, sizeof nr1);
                assert_memory_equal(w1, w2, 4 * (size_t)(C - j0));
            }
            free(bw);
            free(rq1);
            free(rq2);
            free(w1);
            free(w2);
            free(gw);
        }
        {
            double u1 = a->u2_tile(g, gdt, C, 1, R, j0, C, rf, cf);
            double u2 = b->u2_tile(g, gdt, C, 1, R, j0, C, rf, cf);
            assert_memory_equal(&u1, &u2, sizeof u1);
        }
        { /* with the agreement count: lr-rows of 2 matrix rows, so the
           * bits of a row start mid-byte when C % 8 != 0 */
            am_polmap pm;
            int32_t m1r[7], m2r[7];
            float mp1, mp2;
            pm.bits = polr;
            pm.r0 = 0;
            pm.rows_per_lr = 2;
            pm.lr_bits = 8 * ((2 * C + 7) / 8);
            pm.C = C;
            a->stats_tile(g, gdt, C, 1, R, j0, C, rp1, cp1, &pm, m1r, &mp1, NULL);
            b->stats_tile(g, gdt, C, 1, R, j0, C, rp2, cp2, &pm, m2r, &mp2, NULL);
            assert_memory_equal(rp1, rp2, 4 * (size_t)(R - 1));
            assert_memory_equal(cp1, cp2, 4 * (size_t)(C - j0));
            assert_memory_equal(m1r, m2r, sizeof(int32_t) * (size_t)(R - 1));
            assert_memory_equal(&mp1, &mp2, sizeof mp1);
            for (i = 0; i < R - 1; i++) assert_true(m1r[i] >= 0 && m1r[i] <= C - j0);
            if (C - j0 > 9) { /* +inf counts as positive, NaN and -inf do not */
                void *gx = xmalloc((size_t)n * am_dtype_size((am_dtype)gdt));
                memcpy(gx, g, (size_t)n * am_dtype_size((am_dtype)gdt));
                set_value(gx, gdt, 2 * C + j0 + 1, INFINITY);
                set_value(gx, gdt, 3 * C + j0 + 2, NAN);
                set_value(gx, gdt, 4 * C + j0 + 3, -INFINITY);
                set_value(gx, gdt, 5 * C - 4, INFINITY); /* a tail */
                set_value(gx, gdt, 5 * C + j0 + 9, INFINITY);
                /* the NaN next to +inf's bits */
                if (gdt == AM_DTYPE_FLOAT32) ((uint32_t *)gx)[6 * C + j0 + 5] = 0x7f800001u;
                else ((uint16_t *)gx)[6 * C + j0 + 5] = gdt == AM_DTYPE_BFLOAT16 ? 0x7f81u : 0x7c01u;
                a->stats_tile(gx, gdt, C, 1, R, j0, C, rp1, cp1, &pm, m1r, &mp1, NULL);
                b->stats_tile(gx, gdt, C, 1, R, j0, C, rp2, cp2, &pm, m2r, &mp2, NULL);
                assert_memory_equal(m1r, m2r, sizeof(int32_t) * (size_t)(R - 1));
                assert_memory_equal(&mp1, &mp2, sizeof mp1);
                free(gx);
            }
        }
    }
    {
        double u1 = a->u2_flat(g, gdt, sq1, j0, n, &k), u2 = b->u2_flat(g, gdt, sq1, j0, n, &k);
        assert_memory_equal(&u1, &u2, sizeof u1);
        if (n > j0) { /* one overflowing g*g (in a vector or in the tail) */
            float s1 = sq1[n - 1 - (C % 5)];
            sq1[n - 1 - (C % 5)] = INFINITY; /* the new ema is not finite */
            u1 = a->u2_flat(g, gdt, sq1, j0, n, &k);
            u2 = b->u2_flat(g, gdt, sq1, j0, n, &k);
            assert_memory_equal(&u1, &u2, sizeof u1);
            sq1[n - 1 - (C % 5)] = s1;
        }
    }
    if (n > 0) {
        /* an lr-row of the 2 last matrix rows of a (2, R=... ) view: bits
         * start mid-byte when C % 8 != 0 */
        m1 = a->agree_rows(g, gdt, R, C, 1, R, rf, cf, 1.5f, pol1);
        m2 = b->agree_rows(g, gdt, R, C, 1, R, rf, cf, 1.5f, pol2);
        assert_int_equal(m1, m2);
        assert_memory_equal(pol1, pol2, (size_t)n / 8 + 2);
        if (gdt != AM_DTYPE_BFLOAT16) {
            /* NaN gradients whose payload has low bits set (a float32 NaN,
             * or a half one widened): u and the new value are NaNs whose low
             * 16 bits are not zero, where a bfloat16 parameter's rounding
             * must take the NaN rule, not (bits + noise) >> 16 */
            void *gx = xmalloc((size_t)n * gs), *q1 = xmalloc((size_t)n * ps),
                 *q2 = xmalloc((size_t)n * ps);
            memcpy(gx, g, (size_t)n * gs);
            memcpy(q1, p1, (size_t)n * ps);
            memcpy(q2, p1, (size_t)n * ps);
            for (i = C + 3; i < n; i += 37) {
                if (gdt == AM_DTYPE_FLOAT32) ((uint32_t *)gx)[i] = (i & 1) ? 0xffc0f0f1u : 0x7fc0ffffu;
                else ((uint16_t *)gx)[i] = (i & 1) ? 0xfe01u : 0x7c3fu;
            }
            a->apply_rows(q1, pdt, gx, gdt, R, C, 1, R, rf, cf, 1.5f, 3e-3f, NULL, &k, 99, 7, 5, noff, NULL);
            b->apply_rows(q2, pdt, gx, gdt, R, C, 1, R, rf, cf, 1.5f, 3e-3f, NULL, &k, 99, 7, 5, noff, NULL);
            assert_memory_equal(q1, q2, (size_t)n * ps);
            free(gx);
            free(q1);
            free(q2);
        }
        a->apply_rows(p1, pdt, g, gdt, R, C, 1, R, rf, cf, 1.5f, 3e-3f, NULL, &k, 99, 7, 5, noff, NULL);
        b->apply_rows(p2, pdt, g, gdt, R, C, 1, R, rf, cf, 1.5f, 3e-3f, NULL, &k, 99, 7, 5, noff, NULL);
        assert_memory_equal(p1, p2, (size_t)n * ps);
        /* writing the polarity: the bits agree_rows wrote, and nothing
         * past the rows */
        memset(pa, 0x5a, (size_t)n / 8 + 2);
        memset(pb, 0xa5, (size_t)n / 8 + 2);
        a->apply_rows(p1, pdt, g, gdt, R, C, 1, R, rf, cf, 1.5f, 3e-3f, NULL, &k, 99, 7, 7, noff, pa);
        b->apply_rows(p2, pdt, g, gdt, R, C, 1, R, rf, cf, 1.5f, 3e-3f, NULL, &k, 99, 7, 7, noff, pb);
        assert_memory_equal(p1, p2, (size_t)n * ps);
        assert_memory_equal(pa, pol1, (size_t)((R - 1) * C / 8));
        assert_memory_equal(pb, pol1, (size_t)((R - 1) * C / 8));
        if ((R - 1) * C % 8) {
            uint8_t mask = (uint8_t)((1u << ((R - 1) * C % 8)) - 1u);
            int64_t q = (R - 1) * C / 8;
            assert_int_equal(pa[q], (pol1[q] & mask) | (0x5a & ~mask));
            assert_int_equal(pb[q], (pol1[q] & mask) | (0xa5 & ~mask));
            q++;
            assert_int_equal(pa[q], 0x5a);
            assert_int_equal(pb[q], 0xa5);
        }
        /* scale 1: the SIMD path skips the division */
        a->apply_rows(p1, pdt, g, gdt, R, C, 0, R, rf, cf, 1.0f, 3e-3f, NULL, &k, 99, 7, 6, noff, NULL);
        b->apply_rows(p2, pdt, g, gdt, R, C, 0, R, rf, cf, 1.0f, 3e-3f, NULL, &k, 99, 7, 6, noff, NULL);
        assert_memory_equal(p1, p2, (size_t)n * ps);
        { /* each matrix row an lr-row of its own (lrs): the bits of one
           * call per row, its bits from byte r * ((C + 7) / 8) on */
            const int64_t rb = (C + 7) / 8;
            float lrs[7];
            void *p3 = xmalloc((size_t)n * ps);
            uint8_t *q1 = xmalloc((size_t)(R * rb) + 1), *q2 = xmalloc((size_t)(R * rb) + 1),
                    *q3 = xmalloc((size_t)(R * rb) + 1);
            int64_t r;
            assert_true(R <= 7);
            for (r = 0; r < R; r++) lrs[r] = 1e-3f * (float)(r + 1);
            memcpy(p3, p1, (size_t)n * ps);
            memset(q1, 0x5a, (size_t)(R * rb) + 1);
            memset(q2, 0x5a, (size_t)(R * rb) + 1);
            memset(q3, 0x5a, (size_t)(R * rb) + 1);
            a->apply_rows(p1, pdt, g, gdt, R, C, 0, R, rf, cf, 1.5f, 0.5f, lrs, &k, 99, 7, 10, noff, q1);
            b->apply_rows(p2, pdt, g, gdt, R, C, 0, R, rf, cf, 1.5f, 0.5f, lrs, &k, 99, 7, 10, noff, q2);
            for (r = 0; r < R; r++)
                a->apply_rows(p3, pdt, g, gdt, R, C, r, r + 1, rf, cf, 1.5f, lrs[r], NULL, &k,
                              99, 7, 10, noff, q3 + r * rb);
            assert_memory_equal(p1, p2, (size_t)n * ps);
            assert_memory_equal(p1, p3, (size_t)n * ps);
            assert_memory_equal(q1, q3, (size_t)(R * rb) + 1);
            assert_memory_equal(q2, q3, (size_t)(R * rb) + 1);
            free(p3); free(q1); free(q2); free(q3);
        }
        if (pdt == AM_DTYPE_FLOAT16) {
            /* half subnormals and zeros moved by a tiny step: the rounding
             * takes 32 bits of the wide stream there (am_sr_noise) */
            for (i = 0; i < n; i++)
                if (i % 3 != 2)
                    ((uint16_t *)p1)[i] = ((uint16_t *)p2)[i] =
                        (uint16_t)((i % 3 ? 0x8000u : 0u) | (uint16_t)(i % 5 ? 7 * i % 1024 : 0));
            a->apply_rows(p1, pdt, g, gdt, R, C, 0, R, rf, cf, 1.0f, 1e-12f, NULL, &k, 99, 7, 8, noff, NULL);
            b->apply_rows(p2, pdt, g, gdt, R, C, 0, R, rf, cf, 1.0f, 1e-12f, NULL, &k, 99, 7, 8, noff, NULL);
            assert_memory_equal(p1, p2, (size_t)n * ps);
            /* sparse ones (every 97th: the scalar quad of am_wide_word)
             * among runs of 10 (its window), the rest 1.0 */
            for (i = 0; i < n; i++)
                ((uint16_t *)p1)[i] = ((uint16_t *)p2)[i] =
                    i % 97 == 5 || i % 200 / 10 == 5 ? (uint16_t)(i % 4 ? 3 * i % 1024 : 0)
                                                    : (uint16_t)0x3c00u;
            a->apply_rows(p1, pdt, g, gdt, R, C, 0, R, rf, cf, 1.0f, 1e-12f, NULL, &k, 99, 7, 8, noff, NULL);
            b->apply_rows(p2, pdt, g, gdt, R, C, 0, R, rf, cf, 1.0f, 1e-12f, NULL, &k, 99, 7, 8, noff, NULL);
            assert_memory_equal(p1, p2, (size_t)n * ps);
            { /* the largest half moved outward (p = -65504 * sign(g)): the
               * rounding overflows to inf in some elements (no weight
               * decay, which would pull them back, and lr 0.5: a step past
               * the last half's ulp of 32 for every |g| > 0.6, about one
               * element in five, whatever the seed) */
                am_hparams h0 = hp;
                am_consts k0;
                int64_t ninf = 0;
                h0.weight_decay = 0.0;
                k0 = am_consts_from(&h0);
                for (i = 0; i < n; i++)
                    ((uint16_t *)p1)[i] = ((uint16_t *)p2)[i] =
                        am_load(g, gdt, i) > 0.0f ? 0xfbffu : 0x7bffu;
                a->apply_rows(p1, pdt, g, gdt, R, C, 0, R, rf, cf, 1.0f, 0.5f, NULL, &k0, 99, 7, 9, noff, NULL);
                b->apply_rows(p2, pdt, g, gdt, R, C, 0, R, rf, cf, 1.0f, 0.5f, NULL, &k0, 99, 7, 9, noff, NULL);
                assert_memory_equal(p1, p2, (size_t)n * ps);
                for (i = 0; i < n; i++) ninf += (((uint16_t *)p1)[i] & 0x7fffu) == 0x7c00u;
                if (n >= 64) assert_true(ninf > 0);
            }
        }
    }
    {
        int64_t step;
        for (step = 0; step < 2; step++) {
            const float sc = step ? 1.0f : 1.25f; /* 1: no division */
            m1 = a->finish_flat(p1, pdt, g, gdt, sq1, lr1, pol1, 8, n, sc, &k, 42, 3, step, noff);
            m2 = b->finish_flat(p2, pdt, g, gdt, sq2, lr2, pol2, 8, n, sc, &k, 42, 3, step, noff);
            assert_int_equal(m1, m2);
            assert_memory_equal(p1, p2, (size_t)n * ps);
            assert_memory_equal(sq1, sq2, 4 * (size_t)n);
            assert_memory_equal(lr1, lr2, 4 * (size_t)n);
            assert_memory_equal(pol1, pol2, (size_t)n / 8 + 2);
        }
    }
    free(g); free(p1); free(p2); free(rp1); free(rp2); free(cp1); free(cp2);
    free(rf); free(cf); free(sq1); free(sq2); free(lr1); free(lr2); free(pol1); free(pol2);
    free(pa); free(pb); free(polr);
}

static void check_count_pos(const am_kernels *a, const am_kernels *b, uint64_t *s);

/* The portable vector set (kernels_vec.c, what CPUs without AVX2 run: every
 * ARM CPU) against the reference, slot by slot, on every CPU. */
static void test_portable_slots(void **unused) {
    const am_kernels *vec = am_kernels_portable();
    uint64_t s = g_seed;
    int si, gdt, pdt;
    (void)unused;
    if (!vec) {
        print_message("SKIPPED: this compiler built no portable vector kernels\n");
        skip();
    }
    for (si = 0; si < NSIZES; si++)
        for (gdt = 0; gdt < 3; gdt++)
            for (pdt = 0; pdt < 3; pdt++) check_slots(&am_kernels_ref, vec, SIZES[si], gdt, pdt, &s);
    check_count_pos(&am_kernels_ref, vec, &s);
}

static void test_slots(void **unused) {
    const am_kernels *simd = am_kernels_avx2();
    uint64_t s = g_seed;
    const int pf0 = am_sw_prefetch();
    int si, gdt, pdt, pf;
    (void)unused;
    if (!simd || !am_cpu_has_avx2()) {
        print_message("SKIPPED: no AVX2 kernels on this build/CPU; nothing to compare\n");
        skip();
    }
    /* with and without software prefetch (am_sw_prefetch): on an AVX-512
     * CPU, float32 parameters' apply runs in AVX-512 without it */
    for (pf = 1; pf >= 0; pf--) {
        am_set_sw_prefetch(pf);
        for (si = 0; si < NSIZES; si++)
            for (gdt = 0; gdt < 3; gdt++)
                for (pdt = 0; pdt < 3; pdt++)
                    check_slots(&am_kernels_ref, simd, SIZES[si], gdt, pdt, &s);
    }
    {   /* tiles of whole 32-column steps only (n = C - 5 = 128, 160: no tail),
         * whose W sums the AVX-512 stats spread over the next group's rows
         * in quarters */
        static const int64_t whole[] = {133, 165};
        for (si = 0; si < 2; si++)
            for (gdt = 0; gdt < 3; gdt++)
                check_slots(&am_kernels_ref, simd, whole[si], gdt, gdt, &s);
    }
    am_set_sw_prefetch(pf0);
    /* On a CPU with AVX-512 the set in use has AVX-512 parts: the plain
     * AVX2 set (what CPUs without it run) is checked too. */
    if (simd != am_kernels_avx2_plain()) {
        print_message("checked the %s set; now the plain avx2 set\n", simd->name);
        for (si = 0; si < NSIZES; si++)
            for (gdt = 0; gdt < 3; gdt++)
                for (pdt = 0; pdt < 3; pdt++)
                    check_slots(&am_kernels_ref, am_kernels_avx2_plain(), SIZES[si], gdt,
                                pdt, &s);
    } else {
        print_message("checked the %s set (AVX-512 parts not in use on this CPU)\n",
                      simd->name);
    }
}

/* The AVX-512 stats pass prefetches into L1 or into L2 (am_tuning_zen4: by
 * CPU family), and test_slots checks the one this CPU runs: both
 * against the reference here, alone in a copy of the reference set (every
 * tile width: the AVX-512 set sends some to the AVX2 stats). */
static void test_avx512_stats_levels(void **unused) {
    uint64_t s = g_seed;
    int si, gdt, l2;
    (void)unused;
    if (!am_cpu_has_avx512() || !am_avx512_stats(0)) {
        print_message("SKIPPED: no AVX-512 stats on this build/CPU\n");
        skip();
    }
    assert_ptr_not_equal(am_avx512_stats(0), am_avx512_stats(1));
    for (l2 = 0; l2 < 2; l2++) {
        am_kernels t = am_kernels_ref;
        t.stats_tile = am_avx512_stats(l2);
        assert_non_null(t.stats_tile);
        for (si = 0; si < NSIZES; si++)
            for (gdt = 0; gdt < 3; gdt++) check_slots(&am_kernels_ref, &t, SIZES[si], gdt, gdt, &s);
    }
}

/* The batched small-matrix slots (stats_mats, u2_mats, moments_mats) give
 * the reference's bits: matrix shapes inside and outside the vector path's
 * limits, batch lengths around multiples of 8, a start offset, an inf in the
 * gradient. Outputs outside [b0, b1) must stay untouched (sentinels). */
static void check_mats(const am_kernels *a, const am_kernels *b, int64_t R, int64_t C,
                       int64_t B, int gdt, uint64_t *s) {
    const int64_t n = B * R * C, b0 = B > 2 ? 1 : 0;
    const size_t gs = am_dtype_size((am_dtype)gdt);
    void *g = xmalloc((size_t)n * gs);
    float *in[6], *out[2][6];
    double *u[2];
    float *rmean[2];
    am_hparams hp = am_hparams_default();
    am_consts k;
    int64_t i, cnt[6];
    int v, w;
    k = am_consts_from(&hp);
    fill(g, gdt, n, s, 0);
    if (n > 5 && gdt == AM_DTYPE_FLOAT32 && (B & 1)) ((float *)g)[n / 2] = INFINITY;
    /* in: row, col (old moments), rs, cs (sums), rf, cf (factors) */
    cnt[0] = cnt[2] = cnt[4] = B * R;
    cnt[1] = cnt[3] = cnt[5] = B * C;
    for (v = 0; v < 6; v++) {
        in[v] = xmalloc(4 * (size_t)cnt[v]);
        for (i = 0; i < cnt[v]; i++)
            in[v][i] = v < 2 ? fabsf(rand_value(s)) : v < 4 ? fabsf(rand_value(s)) * 3.0f
                                                             : 0.5f + rng_unit(s) * 0.25f;
    }
    /* out: rowsum, colsum, nr, nc, rf, cf */
    for (w = 0; w < 2; w++) {
        for (v = 0; v < 6; v++) {
            out[w][v] = xmalloc(4 * (size_t)cnt[v] + 4);
            memset(out[w][v], 0xA5, 4 * (size_t)cnt[v] + 4);
        }
        u[w] = xmalloc(8 * (size_t)B + 8);
        memset(u[w], 0x5A, 8 * (size_t)B + 8);
    }
    for (w = 0; w < 2; w++) {
        const am_kernels *kt = w ? b : a;
        rmean[w] = xmalloc(4 * (size_t)B + 4);
        memset(rmean[w], 0xA5, 4 * (size_t)B + 4);
        kt->stats_mats(g, gdt, R, C, b0, B, out[w][0], out[w][1]);
        kt->u2_mats(g, gdt, R, C, b0, B, in[4], in[5], u[w]);
        kt->moments_mats(R, C, b0, B, in[0], in[1], in[2], in[3], &k, out[w][2], out[w][3],
                         out[w][4], out[w][5], rmean[w]);
    }
    assert_memory_equal(rmean[0], rmean[1], 4 * (size_t)B + 4);
    for (v = 0; v < 6; v++) assert_memory_equal(out[0][v], out[1][v], 4 * (size_t)cnt[v] + 4);
    assert_memory_equal(u[0], u[1], 8 * (size_t)(B - b0));
    /* untouched past the batch: sentinels */
    {
        uint32_t word;
        memcpy(&word, out[1][0] + cnt[0], 4);
        assert_int_equal(word, 0xA5A5A5A5u);
        if (b0) {
            memcpy(&word, out[1][1], 4);
            assert_int_equal(word, 0xA5A5A5A5u);
        }
    }
    free(g);
    for (v = 0; v < 6; v++) { free(in[v]); free(out[0][v]); free(out[1][v]); }
    free(u[0]); free(u[1]); free(rmean[0]); free(rmean[1]);
}

/* stats_u2_mats of a (scalar reference) and b: the bits of stats_mats,
 * moments_mats and u2_mats of a run one after the other. */
static void check_fused_mats(const am_kernels *a, const am_kernels *b, int64_t R, int64_t C,
                             int64_t B, int gdt, uint64_t *s) {
    const int64_t n = B * R * C, b0 = B > 2 ? 1 : 0;
    const size_t gs = am_dtype_size((am_dtype)gdt);
    const size_t fr = 4 * (size_t)(B * R), fc = 4 * (size_t)(B * C);
    void *g = xmalloc((size_t)n * gs);
    float *row = xmalloc(fr), *col = xmalloc(fc), *o[3][7], fmin[2][2];
    double *u[3];
    am_hparams hp = am_hparams_default();
    am_consts k = am_consts_from(&hp);
    int64_t i;
    int w, v;
    fill(g, gdt, n, s, 0);
    for (i = 0; i < B * R; i++) row[i] = fabsf(rand_value(s));
    for (i = 0; i < B * C; i++) col[i] = fabsf(rand_value(s));
    for (w = 0; w < 3; w++) { /* rs, cs, nr, nc, rf, cf, rmean */
        for (v = 0; v < 7; v++) {
            const size_t bytes = v == 6 ? 4 * (size_t)B : v % 2 ? fc : fr;
            o[w][v] = xmalloc(bytes);
            memset(o[w][v], 0xA5, bytes);
        }
        u[w] = xmalloc(8 * (size_t)B);
        memset(u[w], 0x5A, 8 * (size_t)B);
    }
    for (w = 0; w < 2; w++)
        (w ? b : a)->stats_u2_mats(g, gdt, R, C, b0, B, row, col, &k, o[w][0], o[w][1],
                                   o[w][2], o[w][3], o[w][4], o[w][5], o[w][6], u[w],
                                   fmin[w], NULL, NULL);
    assert_memory_equal(fmin[0], fmin[1], sizeof fmin[0]);
    /* in place, the old moments kept aside, no sums or means; w / 2 == 0:
     * orow + b0 * R and ocol + b0 * C 64-byte aligned (the AVX-512 sweep's
     * streaming stores), 1: 4 bytes past that (its plain stores) */
    for (w = 0; w < 4; w++) {
        float *rowc = xmalloc(fr), *colc = xmalloc(fc);
        float *obase = aligned_alloc(64, (fr + 191) / 64 * 64),
              *cbase = aligned_alloc(64, (fc + 191) / 64 * 64);
        float *orow = obase + (16 - b0 * R % 16) % 16 + w / 2,
              *ocol = cbase + (16 - b0 * C % 16) % 16 + w / 2;
        float *x[5], fm[2];
        double *ux = xmalloc(8 * (size_t)B);
        assert_non_null(obase);
        assert_non_null(cbase);
        memcpy(rowc, row, fr);
        memcpy(colc, col, fc);
        for (v = 0; v < 5; v++) x[v] = xmalloc(v == 4 ? 4 * (size_t)B : v % 2 ? fc : fr);
        (w % 2 ? b : a)->stats_u2_mats(g, gdt, R, C, b0, B, rowc, colc, &k, NULL, NULL, rowc,
                                       colc, x[2], x[3], NULL, ux, fm, orow, ocol);
        assert_memory_equal(rowc, row, 4 * (size_t)(b0 * R)); /* before b0: untouched */
        assert_memory_equal(colc, col, 4 * (size_t)(b0 * C));
        assert_memory_equal(rowc + b0 * R, o[0][2] + b0 * R, 4 * (size_t)((B - b0) * R));
        assert_memory_equal(colc + b0 * C, o[0][3] + b0 * C, 4 * (size_t)((B - b0) * C));
        assert_memory_equal(orow + b0 * R, row + b0 * R, 4 * (size_t)((B - b0) * R));
        assert_memory_equal(ocol + b0 * C, col + b0 * C, 4 * (size_t)((B - b0) * C));
        assert_memory_equal(x[2] + b0 * R, o[0][4] + b0 * R, 4 * (size_t)((B - b0) * R));
        assert_memory_equal(x[3] + b0 * C, o[0][5] + b0 * C, 4 * (size_t)((B - b0) * C));
        assert_memory_equal(ux, u[0], 8 * (size_t)(B - b0));
        assert_memory_equal(fm, fmin[0], sizeof fm);
        free(rowc); free(colc); free(obase); free(cbase); free(ux);
        for (v = 0; v < 5; v++) free(x[v]);
    }
    for (i = b0 * R; i < B * R; i++) assert_true(fmin[0][0] <= o[0][4][i]);
    for (i = b0 * C; i < B * C; i++) assert_true(fmin[0][1] <= o[0][5][i]);
    a->stats_mats(g, gdt, R, C, b0, B, o[2][0], o[2][1]);
    a->moments_mats(R, C, b0, B, row, col, o[2][0], o[2][1], &k, o[2][2], o[2][3], o[2][4],
                    o[2][5], o[2][6]);
    a->u2_mats(g, gdt, R, C, b0, B, o[2][4], o[2][5], u[2]);
    for (w = 1; w < 3; w++) {
        for (v = 0; v < 7; v++)
            assert_memory_equal(o[0][v], o[w][v], v == 6 ? 4 * (size_t)B : v % 2 ? fc : fr);
        assert_memory_equal(u[0], u[w], 8 * (size_t)B);
    }
    free(g); free(row); free(col);
    for (w = 0; w < 3; w++) {
        for (v = 0; v < 7; v++) free(o[w][v]);
        free(u[w]);
    }
}

/* count_pos of a and b: the same matches and smallest positive value, tails
 * of every length, zeros and negative zeros among the values. */
static void check_count_pos(const am_kernels *a, const am_kernels *b, uint64_t *s) {
    static const int64_t ns[] = {1, 7, 31, 32, 33, 64, 100, 297, 1000};
    size_t ni;
    int gdt;
    for (ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
        for (gdt = 0; gdt < 3; gdt++) {
            const int64_t n = ns[ni];
            void *g = xmalloc((size_t)n * 4);
            uint8_t bits[1000 / 8 + 1];
            float ma, mb;
            int64_t i;
            fill(g, gdt, n, s, 0);
            if (n > 5) set_value(g, gdt, 5, -0.0f);
            for (i = 0; i < (int64_t)sizeof bits; i++) bits[i] = (uint8_t)(rng_next(s) >> 7);
            assert_int_equal(a->count_pos(g, gdt, n, bits, &ma), b->count_pos(g, gdt, n, bits, &mb));
            assert_memory_equal(&ma, &mb, sizeof ma);
            free(g);
        }
}

/* The plain AVX2 set (what CPUs without AVX-512 run); the test is skipped
 * when this build or CPU has none. */
static const am_kernels *plain_avx2_or_skip(void) {
    if (!am_kernels_avx2_plain() || !am_cpu_has_avx2()) {
        print_message("SKIPPED: no AVX2 kernels on this build/CPU; nothing to compare\n");
        skip();
    }
    return am_kernels_avx2_plain();
}

/* The plain AVX2 stats of matrices exactly 4, 8, 16 and 32 columns wide
 * (kernels_avx2_narrow.c: 8 rows at a time; both sets use them, and
 * test_updates checks whole updates of such shapes) against the reference
 * slot: row and column sums, agreement counts, the smallest positive
 * element, W sums and new row moments, from rows 0 and 3 of 37 (tails of 5
 * and 2 rows), lr-rows of one matrix row and of three. */
static void test_narrow_stats(void **unused) {
    static const int64_t widths[] = {4, 8, 16, 32};
    enum { R = 37 };
    const am_kernels *a = &am_kernels_ref, *b = plain_avx2_or_skip();
    am_hparams hp = am_hparams_default();
    const am_consts k = am_consts_from(&hp);
    uint64_t s = g_seed ^ 0x6e6172726f77ull;
    int wi, gdt, rpl, i0, cnt, wsum;
    (void)unused;
    for (wi = 0; wi < 4; wi++)
        for (gdt = 0; gdt < 3; gdt++)
            for (rpl = 1; rpl <= 3; rpl += 2) {
                const int64_t C = widths[wi], n = R * C, lrb = 8 * ((rpl * C + 7) / 8);
                const int64_t nbits = (R + rpl - 1) / rpl * lrb / 8 + 8;
                void *g = xmalloc((size_t)n * am_dtype_size((am_dtype)gdt));
                uint8_t *bits = xmalloc((size_t)nbits);
                float row_old[R];
                int64_t i;
                am_polmap pm;
                fill(g, gdt, n, &s, 0);
                for (i = 0; i < n; i += 13) set_value(g, gdt, i, 0.0f); /* not positive */
                for (i = 0; i < nbits; i++) bits[i] = (uint8_t)rng_next(&s);
                for (i = 0; i < R; i++) row_old[i] = rand_value(&s) * rand_value(&s);
                pm.bits = bits;
                pm.r0 = 0;
                pm.rows_per_lr = rpl;
                pm.lr_bits = lrb;
                pm.C = C;
                for (i0 = 0; i0 <= 3; i0 += 3)
                    for (cnt = 0; cnt < 2; cnt++)
                        for (wsum = 0; wsum < 2; wsum++) {
                            float rp[2][R], cp[2][32], nr[2][R], wp[2][32], mp[2] = {0, 0};
                            int32_t m[2][R];
                            am_wsum ws[2];
                            int x;
                            memset(nr, 0, sizeof nr);
                            memset(m, 0, sizeof m);
                            for (x = 0; x < 2; x++) {
                                ws[x].row_old = row_old;
                                ws[x].nr = nr[x];
                                ws[x].wpart = wp[x];
                                ws[x].k = &k;
                                ws[x].Cinv = am_inv_count(C);
                                (x ? b : a)->stats_tile(g, gdt, C, i0, R, 0, C, rp[x], cp[x],
                                                        cnt ? &pm : NULL, m[x], &mp[x],
                                                        wsum ? &ws[x] : NULL);
                            }
                            assert_memory_equal(rp[0], rp[1], 4 * (size_t)(R - i0));
                            assert_memory_equal(cp[0], cp[1], 4 * (size_t)C);
                            if (cnt) {
                                assert_memory_equal(m[0], m[1], 4 * (size_t)(R - i0));
                                assert_memory_equal(&mp[0], &mp[1], sizeof mp[0]);
                            }
                            if (wsum) {
                                assert_memory_equal(nr[0], nr[1], sizeof nr[0]);
                                assert_memory_equal(wp[0], wp[1], 4 * (size_t)C);
                            }
                        }
                free(g);
                free(bits);
            }
}

/* The plain AVX2 apply of lr-rows of 4 elements (two rows a vector) against
 * the reference slot: rows 1..12 of matrices of 3 rows (pairs that start a
 * matrix, pairs across two matrices, an odd last row), each row its own
 * lr, its bits in the low half of its byte and the high half kept. */
static void test_rows4_apply(void **unused) {
    enum { R = 3, NR = 13, C = 4, N = NR * C };
    const am_kernels *a = &am_kernels_ref, *b = plain_avx2_or_skip();
    am_hparams hp = am_hparams_default();
    am_consts k;
    uint64_t s = g_seed ^ 0x726f777334ull;
    float rf[NR], cf[(NR + R - 1) / R * C], lrs[NR];
    int pdt, gdt, wd;
    (void)unused;
    for (wd = 0; wd < 2; wd++)
        for (pdt = 0; pdt < 3; pdt++)
            for (gdt = 0; gdt < 3; gdt++) {
                const size_t ps = am_dtype_size((am_dtype)pdt);
                void *g = xmalloc(N * am_dtype_size((am_dtype)gdt)), *p1 = xmalloc(N * ps),
                     *p2 = xmalloc(N * ps);
                uint8_t q1[NR + 1], q2[NR + 1];
                int i;
                hp.weight_decay = wd ? 0.1 : 0.0;
                k = am_consts_from(&hp);
                fill(g, gdt, N, &s, 0);
                fill(p1, pdt, N, &s, 1);
                memcpy(p2, p1, N * ps);
                for (i = 0; i < NR; i++) {
                    rf[i] = 0.5f + rng_unit(&s) * 0.25f;
                    lrs[i] = 1e-3f * (float)(i + 1);
                }
                for (i = 0; i < (int)(sizeof cf / sizeof cf[0]); i++)
                    cf[i] = 1e3f * (1.5f + rng_unit(&s));
                memset(q1, 0x5a, sizeof q1);
                memset(q2, 0x5a, sizeof q2);
                a->apply_rows(p1, pdt, g, gdt, R, C, 1, NR, rf, cf, 1.5f, 0.5f, lrs + 1, &k, 99,
                              7, 10, 5, q1);
                b->apply_rows(p2, pdt, g, gdt, R, C, 1, NR, rf, cf, 1.5f, 0.5f, lrs + 1, &k, 99,
                              7, 10, 5, q2);
                assert_memory_equal(p1, p2, N * ps);
                assert_memory_equal(q1, q2, sizeof q1);
                free(g);
                free(p1);
                free(p2);
            }
}

/* The plain AVX2 apply of many short lr-rows (apply_rows_short, C = 8, 16,
 * 32; apply_rows4, C = 4): enough rows that the noise window is refilled
 * mid-call (256+ elements), from noise offsets on and off a quad, so a
 * span started shorter than its row reads noise the window does not hold. */
static void test_short_rows_windows(void **unused) {
    static const int64_t widths[] = {4, 8, 16, 32};
    static const int64_t noffs[] = {0, 5, 1000003};
    enum { R = 5, NR = 70 };
    const am_kernels *a = &am_kernels_ref, *b = plain_avx2_or_skip();
    am_hparams hp = am_hparams_default();
    am_consts k;
    uint64_t s = g_seed ^ 0x73686f72ull;
    float rf[NR], cf[(NR + R - 1) / R * 32], lrs[NR];
    size_t wi, ni;
    int pdt;
    (void)unused;
    k = am_consts_from(&hp);
    for (wi = 0; wi < sizeof widths / sizeof widths[0]; wi++)
        for (ni = 0; ni < sizeof noffs / sizeof noffs[0]; ni++)
            for (pdt = 1; pdt < 3; pdt++) {
                const int64_t C = widths[wi], N = NR * C;
                void *g = xmalloc((size_t)N * 4), *p1 = xmalloc((size_t)N * 2),
                     *p2 = xmalloc((size_t)N * 2);
                uint8_t q1[NR * 4 + 1], q2[NR * 4 + 1];
                int64_t i;
                fill(g, AM_DTYPE_FLOAT32, N, &s, 0);
                fill(p1, pdt, N, &s, 1);
                memcpy(p2, p1, (size_t)N * 2);
                for (i = 0; i < NR; i++) {
                    rf[i] = 0.5f + rng_unit(&s) * 0.25f;
                    lrs[i] = 1e-3f * (float)(i % 7 + 1);
                }
                for (i = 0; i < (int64_t)(sizeof cf / sizeof cf[0]); i++)
                    cf[i] = 1e3f * (1.5f + rng_unit(&s));
                memset(q1, 0x5a, sizeof q1);
                memset(q2, 0x5a, sizeof q2);
                a->apply_rows(p1, pdt, g, AM_DTYPE_FLOAT32, R, C, 0, NR, rf, cf, 1.5f, 0.5f, lrs,
                              &k, 99, 7, 10, noffs[ni], q1);
                b->apply_rows(p2, pdt, g, AM_DTYPE_FLOAT32, R, C, 0, NR, rf, cf, 1.5f, 0.5f, lrs,
                              &k, 99, 7, 10, noffs[ni], q2);
                assert_memory_equal(p1, p2, (size_t)N * 2);
                assert_memory_equal(q1, q2, sizeof q1);
                free(g);
                free(p1);
                free(p2);
            }
}

static void test_mats_slots(void **unused) {
    static const int64_t shapes[][2] = {{1, 1}, {3, 3}, {1, 3}, {3, 1}, {2, 5}, {4, 16},
                                        {8, 8}, {7, 9}, {1, 64}, {64, 1}, {9, 8}, {65, 1},
                                        {5, 5}, {7, 7}};
    static const int64_t counts[] = {1, 2, 7, 8, 9, 17, 23, 64};
    const am_kernels *simd = am_kernels_avx2();
    uint64_t s = g_seed ^ 0x3A75;
    size_t si, ci;
    int gdt;
    (void)unused;
    if (!simd || !am_cpu_has_avx2()) {
        print_message("SKIPPED: no AVX2 kernels on this build/CPU; nothing to compare\n");
        skip();
    }
    check_count_pos(&am_kernels_ref, simd, &s);
    if (simd != am_kernels_avx2_plain()) check_count_pos(&am_kernels_ref, am_kernels_avx2_plain(), &s);
    for (si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (ci = 0; ci < sizeof counts / sizeof counts[0]; ci++)
            for (gdt = 0; gdt < 3; gdt++)
            {
                check_mats(&am_kernels_ref, simd, shapes[si][0], shapes[si][1], counts[ci], gdt,
                           &s);
                check_fused_mats(&am_kernels_ref, simd, shapes[si][0], shapes[si][1],
                                 counts[ci], gdt, &s);
            }
}

/* Both vector Philox generators give am_rng_quad's words, counters crossing
 * the 2^32 boundary of the quad index included. */
static void test_philox(void **unused) {
    static const int64_t q0s[] = {0, 1, 5, 1000003, 4294967290ll, (int64_t)1 << 40};
    am_philox_fn gens[2];
    uint32_t out[128];
    int gi, qi, k, w, tested = 0;
    (void)unused;
    gens[0] = am_cpu_has_avx2() ? am_philox32_avx2() : NULL;
    gens[1] = am_cpu_has_avx512() ? am_philox32_avx512() : NULL;
    for (gi = 0; gi < 2; gi++) {
        if (!gens[gi]) continue;
        tested++;
        for (qi = 0; qi < (int)(sizeof q0s / sizeof q0s[0]); qi++) {
            uint64_t seed = g_seed * 0x9E3779B97F4A7C15ull + (uint64_t)qi;
            gens[gi](seed, 77u + (uint32_t)qi, 123456789012ll + qi, q0s[qi], out);
            for (k = 0; k < 32; k++) {
                am_u32x4 ref = am_rng_quad(seed, 77u + (uint32_t)qi, 123456789012ll + qi,
                                           q0s[qi] + k);
                for (w = 0; w < 4; w++) assert_int_equal(out[4 * k + w], ref.v[w]);
            }
        }
    }
    if (!tested) {
        print_message("SKIPPED: no vector Philox on this build/CPU\n");
        skip();
    }
}

/* The sets the edge tests below compare with the reference: the set in use
 * and, on an AVX-512 CPU, the plain AVX2 one (where the CPU has AVX2), and
 * the portable vector set; skips the test when there is none. */
static int sets_to_check(const am_kernels *sets[3]) {
    const am_kernels *simd = am_kernels_avx2();
    int n = 0;
    if (simd && am_cpu_has_avx2()) {
        sets[n++] = simd;
        if (simd != am_kernels_avx2_plain()) sets[n++] = am_kernels_avx2_plain();
    }
    if (am_kernels_portable()) sets[n++] = am_kernels_portable();
    if (!n) {
        print_message("SKIPPED: no vector kernels on this build/CPU; nothing to compare\n");
        skip();
    }
    return n;
}

/* Polarity where u / scale underflows to zero: the SIMD sign test compares
 * u against a threshold instead of dividing; it must match at the edge. */
static void test_agree_underflow(void **unused) {
    const am_kernels *sets[3];
    static const float scales[] = {1.0f, 1.5f, 2.0f, 2.9999998f, 3.0f, 7.25f, 1e30f, 3.4e38f,
                                   INFINITY};
    enum { C = 200 };
    float g[C], rf[C], cf[C];
    uint8_t pa[C / 8 + 1], pb[C / 8 + 1];
    /* the same elements as one row, and as 200 small matrices 1x1, 1x2
     * and 2x1 (the runs of 16 matrices of the AVX-512 set, then the rest) */
    static const int64_t shapes[][3] = {{1, C, 1}, {1, 1, C}, {1, 2, C / 2}, {2, 1, C}};
    int si, j, sh, x;
    const int nsets = sets_to_check(sets);
    (void)unused;
    for (j = 0; j < C; j++) {
        /* k * 2^-149 for small k, both signs, then values near 2^-126 */
        float v = j < 120 ? (float)(j / 2) * 1.40129846e-45f : (float)(j - 119) * 1.1754944e-38f;
        g[j] = (j & 1) ? -v : v;
        cf[j] = rf[j] = 1.0f;
    }
    for (x = 0; x < nsets; x++)
    for (sh = 0; sh < 4; sh++)
        for (si = 0; si < (int)(sizeof scales / sizeof scales[0]); si++) {
            const int64_t R = shapes[sh][0], Cm = shapes[sh][1], rows = shapes[sh][2];
            int64_t ma, mb;
            memset(pa, 0x55, sizeof pa);
            memset(pb, 0x55, sizeof pb);
            ma = am_kernels_ref.agree_rows(g, AM_DTYPE_FLOAT32, R, Cm, 0, rows, rf, cf,
                                           scales[si], pa);
            mb = sets[x]->agree_rows(g, AM_DTYPE_FLOAT32, R, Cm, 0, rows, rf, cf, scales[si],
                                     pb);
            assert_int_equal(ma, mb);
            assert_memory_equal(pa, pb, sizeof pa);
        }
}

/* The same edge in the unfactored finish: u = rsqrt(sq + eps) * g is made
 * tiny by a huge second moment (sq = 1e30: u is about 1e-15 * g), so that
 * u / scale underflows to 0 for some positive u and not for others; the
 * SIMD finish tests u against a threshold and multiplies by 1 / scale. */
static void test_flat_underflow(void **unused) {
    const am_kernels *sets[3];
    static const float scales[] = {1.0f, 1.5f, 2.9999998f, 7.25f, 1e15f, 3.4e38f, INFINITY};
    static const int dts[] = {AM_DTYPE_FLOAT32, AM_DTYPE_BFLOAT16, AM_DTYPE_FLOAT16};
    enum { N = 200 };
    am_hparams hp = am_hparams_default();
    am_consts k;
    float g[N], sq[2][N], lr[2][N], p[2][N];
    uint8_t pol[2][N / 8];
    int si, j, d, v, positive = 0, flushed = 0;
    const int nsets = sets_to_check(sets);
    (void)unused;
    k = am_consts_from(&hp);
    for (j = 0; j < N; j++) {
        /* k * 1e-31 for small k (u near 2^-149 and below), then values
         * with u near 1e-16 .. 1e-14, both signs */
        float x = j < 120 ? (float)(j / 2) * 1e-31f : (float)(j - 119) * 0.02f;
        g[j] = (j & 1) ? -x : x;
    }
    for (d = 0; d < 3 * nsets; d++)
        for (si = 0; si < (int)(sizeof scales / sizeof scales[0]); si++) {
            const am_kernels *best = sets[d / 3];
            int64_t m[2];
            for (v = 0; v < 2; v++) {
                const am_kernels *kt = v ? best : &am_kernels_ref;
                for (j = 0; j < N; j++) {
                    sq[v][j] = 1e30f;
                    lr[v][j] = 1e-6f;
                    p[v][j] = 0.0f; /* +0: the same bits in every dtype */
                }
                memset(pol[v], 0x55, sizeof pol[v]);
                m[v] = kt->finish_flat(p[v], dts[d % 3], g, AM_DTYPE_FLOAT32, sq[v], lr[v],
                                       pol[v], 0, N, scales[si], &k, 11, 2, 1, 0);
            }
            assert_int_equal(m[0], m[1]);
            assert_memory_equal(pol[0], pol[1], sizeof pol[0]);
            assert_memory_equal(sq[0], sq[1], sizeof sq[0]);
            assert_memory_equal(lr[0], lr[1], sizeof lr[0]);
            assert_memory_equal(p[0], p[1], sizeof p[0]);
            /* the case is real: some positive g gives a 0 bit */
            for (j = 0; j < N; j++)
                if (g[j] > 0.0f) {
                    const int bit = (pol[0][j >> 3] >> (j & 7)) & 1;
                    positive += bit;
                    flushed += !bit;
                }
        }
    assert_true(positive > 0 && flushed > 0);
}

/* An lr at 0 (min_lr = 0) bumped by an infinite factor (lr_bump_rate 200:
 * exp(200) is inf, exp(-200) rounds to 0): 0 * inf is NaN, which passed
 * the clamp and turned lr and parameter NaN (found by a review, twenty-
 * fifth session). Every finish must clamp it to min_lr, with the same bits:
 * the scalar reference, the set in use, the plain AVX2 set and the portable
 * one. */
static void test_flat_lr_at_zero(void **unused) {
    const am_kernels *sets[3];
    static const int dts[] = {AM_DTYPE_FLOAT32, AM_DTYPE_BFLOAT16, AM_DTYPE_FLOAT16};
    enum { N = 77 };
    am_hparams hp = am_hparams_default();
    am_consts k;
    float g[N], sq[2][N], lr[2][N], p[2][N];
    uint8_t pol[2][(N + 7) / 8];
    int j, d, v;
    const int nsets = sets_to_check(sets);
    (void)unused;
    hp.min_lr = 0;
    hp.lr_bump_rate = 200;
    k = am_consts_from(&hp);
    assert_true(isinf(k.bump_up) && k.bump_down == 0.0f);
    for (j = 0; j < N; j++) g[j] = (j % 3 ? 0.5f : -0.25f) * (float)(1 + j % 5);
    for (d = 0; d < 3 * nsets; d++) {
        const am_kernels *best = sets[d / 3];
        int64_t m[2];
        for (v = 0; v < 2; v++) {
            const am_kernels *kt = v ? best : &am_kernels_ref;
            for (j = 0; j < N; j++) {
                sq[v][j] = 0.01f;
                lr[v][j] = j % 2 ? 0.0f : 1e-3f; /* at 0, or not */
                p[v][j] = 0.0f;
            }
            /* old bits all 1: g > 0 agrees (its lrs at 0 meet inf), g < 0
             * disagrees (its factor is 0) */
            memset(pol[v], 0xff, sizeof pol[v]);
            m[v] = kt->finish_flat(p[v], dts[d % 3], g, AM_DTYPE_FLOAT32, sq[v], lr[v], pol[v],
                                   0, N, 1.0f, &k, 11, 2, 1, 0);
        }
        assert_int_equal(m[0], m[1]);
        assert_memory_equal(lr[0], lr[1], sizeof lr[0]);
        assert_memory_equal(p[0], p[1], sizeof p[0]);
        for (j = 0; j < N; j++) {
            const float want = g[j] > 0 ? (j % 2 ? 0.0f : (float)hp.max_lr) : 0.0f;
            if (lr[0][j] != want) fail_msg("dtype %d: lr[%d] = %g, want %g", d % 3, j,
                                           (double)lr[0][j], (double)want);
            if (!isfinite(p[0][j])) fail_msg("dtype %d: p[%d] = %g", d % 3, j, (double)p[0][j]);
        }
    }
}

/* Which sum of u*u the moments phase takes (am_wsum_usable): the W sums
 * leave the tile sums of the pass over g untouched, which a pattern written
 * there between the phases shows. A gradient with an all-zero row and an
 * all-zero column must keep the W sums (its zeros lose nothing: the first
 * version of the underflow check sent it to the pass at every step, 17-41%
 * slower; found by a review, twenty-fifth session), as must an all-zero
 * gradient and an ordinary one; tiny nonzero elements in such a row and
 * column (squares that underflow) must take the pass. */
static void test_wsum_choice(void **unused) {
    enum { R = 48, C = 80 };
    am_shape sh = {2, {R, C}};
    am_state_sizes sz;
    am_geom g;
    am_hparams hp = am_hparams_default();
    int c, step;
    (void)unused;
    assert_int_equal(am_state_get_sizes(&sh, &sz), AM_OK);
    assert_int_equal(am_geom_init(&sh, &g), AM_OK);
    for (c = 0; c < 4; c++) {
        float *p = xmalloc(4 * R * C), *gr = xmalloc(4 * R * C);
        float *lr = xmalloc(4 * R), *row = xmalloc(4 * R), *col = xmalloc(4 * C);
        uint8_t *pol = xmalloc((size_t)sz.polarity_bytes);
        void *ws = xmalloc((size_t)sz.workspace_bytes);
        am_state st = {lr, pol, row, col, NULL, 0};
        am_tensor pt = {p, AM_DTYPE_FLOAT32, sh}, gt = {gr, AM_DTYPE_FLOAT32, sh};
        uint64_t rs = g_seed ^ (uint64_t)c;
        int64_t e;
        assert_int_equal(am_state_init(&sh, &st, 1e-4), AM_OK);
        for (e = 0; e < R * C; e++) p[e] = 0.0f;
        for (step = 0; step < 3; step++) {
            unsigned char *base = am_ws_base(&g, ws, (size_t)sz.workspace_bytes);
            double *tiles;
            int untouched = 1;
            int64_t t;
            fill(gr, AM_DTYPE_FLOAT32, R * C, &rs, 1);
            for (e = 0; e < R * C; e++) {
                const int64_t i = e / C, j = e % C;
                if (c == 0) continue;                       /* ordinary */
                if (c == 2) { gr[e] = 0.0f; continue; }     /* all zero */
                if (i == 5 || j == 7)                       /* row 5, column 7 */
                    gr[e] = c == 1 ? 0.0f : ((e & 1) ? -1e-23f : 1e-23f);
            }
            assert_int_equal(am_update_stats(&pt, &gt, &st, &hp, ws, (size_t)sz.workspace_bytes),
                             AM_OK);
            tiles = (double *)(base + g.off_tile_u2);
            for (t = 0; t < g.ntiles; t++) tiles[t] = -7.0;
            assert_int_equal(am_update_moments(&pt, &gt, &st, &hp, ws,
                                               (size_t)sz.workspace_bytes), AM_OK);
            for (t = 0; t < g.ntiles; t++) untouched &= tiles[t] == -7.0;
            if (untouched != (c != 3))
                fail_msg("case %d step %d: the %s was used", c, step,
                         untouched ? "W sums" : "pass over g");
            assert_int_equal(am_update_finish(&pt, &gt, &st, &hp, (am_rng_key){3, 1}, ws,
                                              (size_t)sz.workspace_bytes, NULL), AM_OK);
        }
        free(p); free(gr); free(lr); free(row); free(col); free(pol); free(ws);
    }
}

/* The stats pass counts the agreement with the sign of g (that of u);
 * the SPEC's sign is that of u / scale, which is 0 for a positive u small
 * enough. Shape (2, 19): row 0 holds 1e15 in columns 9 (a vector lane) and
 * 18 (the scalar tail), row 1 holds 1e-32 there and 1 elsewhere, every old
 * bit is 1. Row 1's u at those columns is about 1e-32 * rf (2.4e14) * cf
 * (4.5e-14) = 1.1e-31 and the clip scale about 5e15, so u / scale underflows
 * to 0: both bits become 0, lr-row 1 agrees on 17 of 19 elements and row 0
 * on 19 of 19. Counting (g > 0) would give 19 of 19 for both. Scalar and
 * best kernels, fused-count path and fallback must say the same. */
static void test_counted_agreement_underflow(void **unused) {
    am_shape sh = {2, {2, 19}};
    am_hparams hp = am_hparams_default();
    am_rng_key key = {5, 6};
    float p[38], g[38], lr[2], row[2], col[19];
    uint8_t pol[6];
    am_state st = {lr, pol, row, col, NULL, 0};
    am_tensor pt = {p, AM_DTYPE_FLOAT32, sh}, gt = {g, AM_DTYPE_FLOAT32, sh};
    am_state_sizes sz;
    am_report rep;
    void *ws;
    int scalar, j;
    (void)unused;
    assert_int_equal(am_state_get_sizes(&sh, &sz), AM_OK);
    assert_int_equal(sz.polarity_bytes, 6);
    ws = xmalloc((size_t)sz.workspace_bytes);
    for (scalar = 1; scalar >= 0; scalar--) {
        am_kernels_select(scalar);
        assert_int_equal(am_state_init(&sh, &st, 1e-4), AM_OK);
        memset(pol, 0xff, sizeof pol);
        st.step = 1;
        for (j = 0; j < 19; j++) {
            p[j] = p[19 + j] = 0.5f;
            g[j] = (j == 9 || j == 18) ? 1e15f : 1.0f;
            g[19 + j] = (j == 9 || j == 18) ? 1e-32f : 1.0f;
        }
        assert_int_equal(am_update(&pt, &gt, &st, &hp, key, ws, (size_t)sz.workspace_bytes, &rep),
                         AM_OK);
        assert_true(rep.clip_scale > 1e15f);
        /* lr-row 1 (bytes 3..5): bits 9 and 18 (byte 4 bit 1, byte 5
         * bit 2) are 0 */
        assert_int_equal(pol[0], 0xff);
        assert_int_equal(pol[1], 0xff);
        assert_int_equal(pol[2] & 0x07, 0x07);
        assert_int_equal(pol[3], 0xff);
        assert_int_equal(pol[4], 0xfd);
        assert_int_equal(pol[5] & 0x07, 0x03);
        assert_float_equal(rep.mean_agreement, (float)((1.0 + 17.0 / 19.0) / 2.0), 1e-7);
        assert_true(lr[1] < lr[0]);
    }
    am_kernels_select(0);
    free(ws);
}

/* One lr-row of 1031 x 1023 (over 2^20 elements) on two threads is split in
 * chunks of rows (update.c, finish_split), each counting its agreement when
 * the stats pass's count is not valid: here one positive gradient of 1e-44
 * among values of about 100, whose u / scale underflows to 0. Dropping one
 * chunk's count changed the lr and every later bit on two threads only, and
 * no test saw it (a mutation test, thirty-fourth session): scalar, best on
 * one thread and best on two must agree bit for bit. */
static void test_split_rows_fallback_agreement(void **unused) {
    const am_shape sh = {3, {1, 1031, 1023}};
    static const struct { int scalar, threads; } variants[] = {{1, 1}, {0, 1}, {0, 2}};
    am_state_sizes sz;
    float *p0, *g, *first_p = NULL, *first_lr = NULL;
    uint8_t *pol0, *first_pol = NULL;
    uint64_t s = g_seed ^ 0x5151u;
    int64_t e;
    int v;
    (void)unused;
    assert_int_equal(am_state_get_sizes(&sh, &sz), AM_OK);
    p0 = xmalloc(4 * (size_t)sz.numel);
    g = xmalloc(4 * (size_t)sz.numel);
    pol0 = xmalloc((size_t)sz.polarity_bytes);
    fill(p0, AM_DTYPE_FLOAT32, sz.numel, &s, 1);
    for (e = 0; e < sz.numel; e++) g[e] = (float)(50 + (int)(e % 97)) * ((e * 7 % 5) < 2 ? -1.0f : 1.0f);
    g[777] = 1e-44f;
    for (e = 0; e < sz.polarity_bytes; e++) pol0[e] = (uint8_t)(e * 37 + 11);
    for (v = 0; v < 3; v++) {
        am_hparams hp = am_hparams_default();
        am_rng_key key = {9, 4};
        am_report rep;
        am_state st;
        am_tensor pt = {NULL, AM_DTYPE_FLOAT32, sh}, gt = {g, AM_DTYPE_FLOAT32, sh};
        float *p = xmalloc(4 * (size_t)sz.numel), *lr = xmalloc(4 * (size_t)sz.lr_count),
              *row = xmalloc(4 * (size_t)sz.row_count), *col = xmalloc(4 * (size_t)sz.col_count);
        uint8_t *pol = xmalloc((size_t)sz.polarity_bytes);
        void *ws = xmalloc((size_t)sz.workspace_bytes);
        memcpy(p, p0, 4 * (size_t)sz.numel);
        pt.data = p;
        st.lr = lr; st.polarity = pol; st.row = row; st.col = col; st.sq = NULL;
        assert_int_equal(am_state_init(&sh, &st, 1e-4), AM_OK);
        memcpy(pol, pol0, (size_t)sz.polarity_bytes);
        st.step = 1; /* the lr bump applies */
        am_kernels_select(variants[v].scalar);
        assert_int_equal(am_set_num_threads(variants[v].threads), AM_OK);
        assert_int_equal(am_update(&pt, &gt, &st, &hp, key, ws, (size_t)sz.workspace_bytes, &rep),
                         AM_OK);
        am_kernels_select(0);
        am_set_num_threads(1);
        assert_int_equal((pol[777 >> 3] >> (777 & 7)) & 1, 0); /* u / scale underflowed */
        if (!first_p) {
            first_p = p; first_lr = lr; first_pol = pol;
        } else {
            if (memcmp(first_p, p, 4 * (size_t)sz.numel) || memcmp(first_lr, lr, 4) ||
                memcmp(first_pol, pol, (size_t)sz.polarity_bytes))
                fail_msg("variant %d (threads %d) differs from the scalar path", v,
                         variants[v].threads);
            free(p); free(lr); free(pol);
        }
        free(row); free(col); free(ws);
    }
    free(first_p); free(first_lr); free(first_pol);
    free(p0); free(g); free(pol0);
}

/* The same for many small matrices, whose agreement am_update counts from
 * the sign of g (count_pos) when a bound shows it is the sign of u / scale,
 * and otherwise by the exact sweep. Shape
 * (2, 9, 2, 3): 18 matrices [[1e15, 1, 1], [1e-32, 1, 1]], every old bit 1.
 * Each matrix's u at (1, 0) is about 1e-32 * rf (5e14) * cf (4.5e-14) =
 * 2.2e-31 and the clip scale about 1e16, so u / scale underflows to 0: that
 * bit becomes 0 and 5 of 6 elements agree. Counting (g > 0) without the
 * bound would say 6 of 6. Scalar and best kernels, am_update and the three
 * phases (which sweep) must give the same bits. */
static void test_counted_mats_underflow(void **unused) {
    am_shape sh = {4, {2, 9, 2, 3}};
    am_hparams hp = am_hparams_default();
    am_rng_key key = {5, 6};
    float p[3][108], g[108], lr[3][2], row[3][36], col[3][54];
    uint8_t pol[3][14];
    am_state_sizes sz;
    am_report rep;
    void *ws;
    int v, j;
    (void)unused;
    assert_int_equal(am_state_get_sizes(&sh, &sz), AM_OK);
    assert_int_equal(sz.polarity_bytes, 14);
    ws = xmalloc((size_t)sz.workspace_bytes);
    for (j = 0; j < 108; j++) {
        const int e = j % 6;
        g[j] = e == 0 ? 1e15f : e == 3 ? 1e-32f : 1.0f;
    }
    for (v = 0; v < 3; v++) { /* scalar am_update, best am_update, best phases */
        am_state st = {lr[v], pol[v], row[v], col[v], NULL, 0};
        am_tensor pt = {p[v], AM_DTYPE_FLOAT32, sh}, gt = {g, AM_DTYPE_FLOAT32, sh};
        const size_t wb = (size_t)sz.workspace_bytes;
        am_kernels_select(v == 0);
        assert_int_equal(am_state_init(&sh, &st, 1e-4), AM_OK);
        memset(pol[v], 0xff, sizeof pol[v]);
        st.step = 1;
        for (j = 0; j < 108; j++) p[v][j] = 0.5f;
        if (v < 2) {
            assert_int_equal(am_update(&pt, &gt, &st, &hp, key, ws, wb, &rep), AM_OK);
        } else {
            assert_int_equal(am_update_stats(&pt, &gt, &st, &hp, ws, wb), AM_OK);
            assert_int_equal(am_update_moments(&pt, &gt, &st, &hp, ws, wb), AM_OK);
            assert_int_equal(am_update_finish(&pt, &gt, &st, &hp, key, ws, wb, &rep), AM_OK);
        }
        assert_true(rep.clip_scale > 1e15f);
        assert_float_equal(rep.mean_agreement, (float)(5.0 / 6.0), 1e-6);
        for (j = 0; j < 108; j++) /* bit j of lr-row j / 54 (7 bytes each) */
            assert_int_equal(pol[v][(j / 54) * 7 + (j % 54) / 8] >> (j % 54 % 8) & 1,
                             j % 6 != 3);
        if (v) {
            assert_memory_equal(p[v], p[0], sizeof p[0]);
            assert_memory_equal(lr[v], lr[0], sizeof lr[0]);
            assert_memory_equal(pol[v], pol[0], sizeof pol[0]);
            assert_memory_equal(row[v], row[0], sizeof row[0]);
            assert_memory_equal(col[v], col[0], sizeof col[0]);
        }
    }
    am_kernels_select(0);
    free(ws);
}

/* ---------------------------------------------- 2. whole updates ---- */

#define STEPS 3

typedef struct run_out {
    am_state_sizes sz;
    void *p;
    float *lr, *row, *col, *sq;
    uint8_t *pol;
    am_report rep[STEPS];
} run_out;

/* scalar < 0: leave the kernel choice and the thread count alone. */
static void run_updates_impl(const am_shape *sh, int pdt, int gdt, double wd,
                             int scalar, int threads, run_out *o) {
    am_hparams hp = am_hparams_default();
    am_state st;
    am_tensor pt, gt;
    am_rng_key key = {1234, 9};
    uint64_t s = g_seed ^ (uint64_t)(sh->dims[0] * 131 + sh->ndim * 7 + pdt * 3 + gdt);
    void *ws, *g;
    int step;
    hp.weight_decay = wd;
    hp.lr = 1e-3; /* big enough that bf16/fp16 parameters move */
    assert_int_equal(am_state_get_sizes(sh, &o->sz), AM_OK);
    o->p = xmalloc((size_t)o->sz.numel * am_dtype_size((am_dtype)pdt));
    g = xmalloc((size_t)o->sz.numel * am_dtype_size((am_dtype)gdt));
    o->lr = xmalloc(4 * (size_t)o->sz.lr_count);
    o->pol = xmalloc((size_t)o->sz.polarity_bytes);
    o->row = o->sz.row_count ? xmalloc(4 * (size_t)o->sz.row_count) : NULL;
    o->col = o->sz.col_count ? xmalloc(4 * (size_t)o->sz.col_count) : NULL;
    o->sq = o->sz.sq_count ? xmalloc(4 * (size_t)o->sz.sq_count) : NULL;
    ws = xmalloc((size_t)o->sz.workspace_bytes);
    st.lr = o->lr; st.polarity = o->pol; st.row = o->row; st.col = o->col; st.sq = o->sq;
    assert_int_equal(am_state_init(sh, &st, 1e-3), AM_OK);
    fill(o->p, pdt, o->sz.numel, &s, 1);
    pt.data = o->p; pt.dtype = (am_dtype)pdt; pt.shape = *sh;
    gt.data = g; gt.dtype = (am_dtype)gdt; gt.shape = *sh;
    if (scalar >= 0) {
        am_kernels_select(scalar);
        assert_int_equal(am_set_num_threads(threads), AM_OK);
    }
    for (step = 0; step < STEPS; step++) {
        fill(g, gdt, o->sz.numel, &s, 0);
        am_update(&pt, &gt, &st, &hp, key, ws, (size_t)o->sz.workspace_bytes, &o->rep[step]);
        assert_false(am_status_is_error(o->rep[step].status));
    }
    if (scalar >= 0) {
        am_kernels_select(0);
        am_set_num_threads(1);
    }
    free(g);
    free(ws);
}

static void run_updates(const am_shape *sh, int pdt, int gdt, double wd,
                        int scalar, int threads, run_out *o) {
    run_updates_impl(sh, pdt, gdt, wd, scalar, threads, o);
}

/* run_updates without touching the process-wide kernel choice and thread
 * count (for concurrent callers). */
static void run_updates_keep_threads(const am_shape *sh, int pdt, int gdt, double wd,
                                     run_out *o) {
    run_updates_impl(sh, pdt, gdt, wd, -1, 0, o);
}

static void free_out(run_out *o) {
    free(o->p); free(o->lr); free(o->pol); free(o->row); free(o->col); free(o->sq);
}

static int same(const run_out *a, const run_out *b, int pdt) {
    return memcmp(a->p, b->p, (size_t)a->sz.numel * am_dtype_size((am_dtype)pdt)) == 0 &&
           memcmp(a->lr, b->lr, 4 * (size_t)a->sz.lr_count) == 0 &&
           memcmp(a->pol, b->pol, (size_t)a->sz.polarity_bytes) == 0 &&
           (!a->row || memcmp(a->row, b->row, 4 * (size_t)a->sz.row_count) == 0) &&
           (!a->col || memcmp(a->col, b->col, 4 * (size_t)a->sz.col_count) == 0) &&
           (!a->sq || memcmp(a->sq, b->sq, 4 * (size_t)a->sz.sq_count) == 0) &&
           memcmp(a->rep, b->rep, sizeof a->rep) == 0;
}

/* all_pairs 0: only gdt == pdt (3 of the 9 pairs), for big shapes. */
static void check_shape_pairs(const am_shape *sh, double wd, int all_pairs, int *failures) {
    /* scalar: 0 the best set, 1 the reference, 2 the portable vector set */
    static const struct { int scalar, threads; } variants[] = {{0, 1}, {0, 2}, {0, 3}, {1, 3},
                                                               {2, 1}, {2, 3}};
    static const char *const names[] = {"best", "scalar", "portable"};
    const int nv = (int)(sizeof variants / sizeof variants[0]);
    int pdt, gdt, v;
    for (pdt = 0; pdt < 3; pdt++)
        for (gdt = 0; gdt < 3; gdt++) {
            if (!all_pairs && gdt != pdt) continue;
            run_out base;
            run_updates(sh, pdt, gdt, wd, 1, 1, &base);
            for (v = 0; v < nv; v++) {
                run_out o;
                run_updates(sh, pdt, gdt, wd, variants[v].scalar, variants[v].threads, &o);
                if (!same(&base, &o, pdt)) {
                    int d;
                    (*failures)++;
                    fprintf(stderr, "MISMATCH seed=%llu shape=(", (unsigned long long)g_seed);
                    for (d = 0; d < sh->ndim; d++)
                        fprintf(stderr, "%lld,", (long long)sh->dims[d]);
                    fprintf(stderr, ") pdt=%d gdt=%d wd=%g %s threads=%d vs scalar x1\n", pdt,
                            gdt, wd, names[variants[v].scalar], variants[v].threads);
                }
                free_out(&o);
            }
            free_out(&base);
        }
}

static void check_shape(const am_shape *sh, double wd, int *failures) {
    check_shape_pairs(sh, wd, 1, failures);
}

static am_shape mk(int nd, int64_t a, int64_t b, int64_t c, int64_t d) {
    am_shape sh;
    memset(&sh, 0, sizeof sh);
    sh.ndim = nd;
    sh.dims[0] = a; sh.dims[1] = b; sh.dims[2] = c; sh.dims[3] = d;
    return sh;
}

/* An all-zero row in every matrix beside gradients of +-3e4 (float16
 * gradients reach 65504): the zero row's moment is (1 - beta2) * eps =
 * 1e-33, the row mean about 7e5, so rmean / nr is above float32's range
 * while SPEC's rsqrt(nr / rmean) is finite (about 2e19). The update must be
 * applied, the zero rows unchanged (u = 0, no weight decay), the rest
 * finite, with the same bits on every path: sqrt(rmean / nr) was inf there,
 * u = 0 * inf NaN, and the whole update skipped (found by a review,
 * twenty-fourth session). Shapes for each path: small matrices (scalar
 * sweep, AVX2 and AVX-512 sweeps of 3x3), narrow and wide ones, long rows. */
static void test_zero_row_factor_range(void **unused) {
    const am_shape shapes[] = {mk(2, 5, 1, 0, 0),  mk(2, 4, 8, 0, 0),   mk(2, 64, 64, 0, 0),
                               mk(3, 32, 3, 3, 0), mk(4, 4, 8, 3, 3),   mk(2, 1024, 16, 0, 0),
                               mk(2, 16, 1024, 0, 0), mk(2, 40, 4100, 0, 0), mk(3, 2, 9, 40, 0)};
    static const struct { int scalar, threads; } variants[] = {{1, 1}, {0, 1}, {0, 2}};
    size_t c;
    int dt, v;
    (void)unused;
    for (c = 0; c < sizeof shapes / sizeof shapes[0]; c++)
        for (dt = 0; dt < 3; dt += 2) { /* float32, float16 (parameter and gradient) */
            const am_shape *sh = &shapes[c];
            const int64_t R = sh->dims[sh->ndim - 2], C = sh->dims[sh->ndim - 1];
            const size_t es = am_dtype_size((am_dtype)dt);
            am_state_sizes sz;
            void *first = NULL, *p0, *g;
            int64_t e;
            uint64_t s = g_seed ^ (uint64_t)c;
            assert_int_equal(am_state_get_sizes(sh, &sz), AM_OK);
            p0 = xmalloc((size_t)sz.numel * es);
            g = xmalloc((size_t)sz.numel * es);
            fill(p0, dt, sz.numel, &s, 1);
            for (e = 0; e < sz.numel; e++)
                set_value(g, dt, e, (e / C) % R == 1 ? 0.0f : (e & 1) ? 3e4f : -3e4f);
            for (v = 0; v < 3; v++) {
                am_hparams hp = am_hparams_default();
                am_rng_key key = {7, 3};
                am_report rep;
                am_state st;
                am_tensor pt = {NULL, (am_dtype)dt, *sh}, gt = {g, (am_dtype)dt, *sh};
                void *p = xmalloc((size_t)sz.numel * es), *ws = xmalloc((size_t)sz.workspace_bytes);
                float *lr = xmalloc(4 * (size_t)sz.lr_count), *row = xmalloc(4 * (size_t)sz.row_count),
                      *col = xmalloc(4 * (size_t)sz.col_count);
                uint8_t *pol = xmalloc((size_t)sz.polarity_bytes);
                memcpy(p, p0, (size_t)sz.numel * es);
                pt.data = p;
                st.lr = lr; st.polarity = pol; st.row = row; st.col = col; st.sq = NULL;
                assert_int_equal(am_state_init(sh, &st, 1e-4), AM_OK);
                am_kernels_select(variants[v].scalar);
                assert_int_equal(am_set_num_threads(variants[v].threads), AM_OK);
                if (am_update(&pt, &gt, &st, &hp, key, ws, (size_t)sz.workspace_bytes, &rep) != AM_OK)
                    fail_msg("shape %zu dtype %d variant %d: %s", c, dt, v,
                             am_status_string(rep.status));
                am_kernels_select(0);
                am_set_num_threads(1);
                for (e = 0; e < sz.numel; e++) {
                    const float x = dt ? am_load(p, dt, e) : ((float *)p)[e];
                    const float x0 = dt ? am_load(p0, dt, e) : ((float *)p0)[e];
                    assert_true(isfinite(x));
                    if ((e / C) % R == 1 && x != x0)
                        fail_msg("shape %zu: zero row's element %lld moved", c, (long long)e);
                }
                assert_int_equal(st.step, 1);
                if (!first) first = p;
                else if (memcmp(first, p, (size_t)sz.numel * es) != 0)
                    fail_msg("shape %zu dtype %d: variant %d differs from the scalar path", c, dt, v);
                if (p != first) free(p);
                free(ws); free(lr); free(row); free(col); free(pol);
            }
            free(first); free(p0); free(g);
        }
}

static void test_updates(void **unused) {
    static const int64_t rows[] = {1, 3, 17};
    int failures = 0, si, ri, x;
    am_shape extra[48];
    int nextra = 0;
    (void)unused;
    for (si = 0; si < NSIZES; si++) {
        am_shape sh = mk(1, SIZES[si], 0, 0, 0);
        check_shape(&sh, si & 1 ? 0.1 : 0.0, &failures);
        for (ri = 0; ri < 3; ri++) {
            sh = mk(2, rows[ri], SIZES[si], 0, 0);
            check_shape(&sh, (si + ri) & 1 ? 0.1 : 0.0, &failures);
        }
    }
    extra[nextra++] = mk(0, 0, 0, 0, 0);         /* a scalar parameter */
    extra[nextra++] = mk(1, 70001, 0, 0, 0);     /* 5 flat tiles (serial: < 2 MiB) */
    extra[nextra++] = mk(1, 212987, 0, 0, 0);    /* 13 flat tiles, threads engage */
    extra[nextra++] = mk(2, 130, 129, 0, 0);     /* 3 row blocks */
    extra[nextra++] = mk(2, 2, 40001, 0, 0);     /* 3 column blocks */
    extra[nextra++] = mk(2, 1, 300007, 0, 0);    /* one long lr-row */
    extra[nextra++] = mk(2, 600, 1023, 0, 0);    /* threads engage */
    extra[nextra++] = mk(3, 3, 5, 7, 0);
    extra[nextra++] = mk(3, 7, 1, 9, 0);
    extra[nextra++] = mk(4, 4, 3, 3, 3);
    extra[nextra++] = mk(4, 2, 3, 5, 17);
    extra[nextra++] = mk(4, 64, 33, 3, 3);       /* conv-like, lr-rows of 297 */
    extra[nextra++] = mk(3, 1, 1, 1, 0);
    extra[nextra++] = mk(3, 1, 1031, 1023, 0);   /* one lr-row split in chunks */
    /* many small matrices: the batched slots (update.c, batched()) */
    extra[nextra++] = mk(4, 64, 3, 3, 3);
    extra[nextra++] = mk(4, 512, 512, 1, 1);
    extra[nextra++] = mk(4, 1024, 64, 1, 1);
    extra[nextra++] = mk(4, 13, 7, 1, 5);        /* 91 matrices: a tail of 3 */
    /* 1 x k and k x 1 kernels, 64 matrices an lr-row: the AVX-512 factor
     * window's 16 lanes all used (a mutation test found its last lane
     * unchecked, thirty-fourth session) */
    extra[nextra++] = mk(4, 4, 64, 1, 8);
    extra[nextra++] = mk(4, 4, 64, 5, 1);
    extra[nextra++] = mk(4, 9, 5, 8, 8);         /* R*C = 64, the limit */
    extra[nextra++] = mk(4, 9, 5, 8, 9);         /* R*C = 72: per-matrix tiles */
    /* many short lr-rows: blocks of them per apply call (update.c,
     * finish_short_rows_task), LoRA-like */
    extra[nextra++] = mk(2, 1200, 16, 0, 0);
    extra[nextra++] = mk(2, 3000, 3, 0, 0);
    extra[nextra++] = mk(2, 600, 40, 0, 0);
    extra[nextra++] = mk(2, 520, 256, 0, 0);
    extra[nextra++] = mk(2, 1101, 8, 0, 0);     /* rows of 8: pairs, an odd last row */
    extra[nextra++] = mk(2, 1030, 32, 0, 0);    /* rows of 32: 16 at a time, a tail */
    extra[nextra++] = mk(2, 1037, 4, 0, 0);     /* rows of 4: four a vector, a tail */
    /* narrow matrices whose lr-rows hold many rows (AVX2 stats, 8 rows at
     * a time: each row's polarity found by am_polmap_bit) */
    extra[nextra++] = mk(3, 5, 40, 8, 0);
    extra[nextra++] = mk(3, 3, 33, 4, 0);
    extra[nextra++] = mk(3, 2, 24, 4, 0);   /* lr-rows of 24 rows of 4: the last
                                              * row's bits end the buffer (ASan) */
    extra[nextra++] = mk(3, 2, 20, 16, 0);
    extra[nextra++] = mk(3, 2, 17, 32, 0);
    /* whole rows of whole 32-column steps (the AVX-512 stats' quarters) */
    extra[nextra++] = mk(2, 13, 160, 0, 0);
    extra[nextra++] = mk(2, 9, 256, 0, 0);
    for (x = 0; x < nextra; x++) check_shape(&extra[x], x & 1 ? 0.1 : 0.0, &failures);
    {   /* long float32 rows in blocks of 4 lr-rows (update.c, long_row_blocks):
         * tails of 16 and of single columns and a last block of 3 rows, then
         * whole vectors only; rows of 3072 to 4096 (a, b) the AVX-512 apply
         * takes one at a time with Zen 5's tuning and four at a time with
         * Zen 4's (am_tuning_zen4: both run here, whatever the CPU; a's
         * last block of 3 rows one at a time under both), longer ones (c,
         * d) four at a time (apply_long4); with and without software
         * prefetch (an AVX-512 CPU runs the float32 apply in AVX-512 only
         * without it: avx512x_apply_rows) */
        const int pf0 = am_sw_prefetch(), zen0 = am_tuning_zen4();
        int pf, zen;
        for (zen = 0; zen <= 1; zen++)
            for (pf = 0; pf <= 1; pf++) {
                am_shape a = mk(2, 67, 3100, 0, 0), b = mk(2, 64, 4096, 0, 0);
                am_shape c = mk(2, 67, 4113, 0, 0), d = mk(2, 64, 4160, 0, 0);
                am_set_tuning_zen4(zen);
                am_set_sw_prefetch(pf);
                check_shape(&a, pf ? 0.0 : 0.1, &failures);
                check_shape(&b, pf ? 0.1 : 0.0, &failures);
                if (zen) continue; /* (c and d take the same path under both) */
                check_shape(&c, pf ? 0.0 : 0.1, &failures);
                check_shape(&d, pf ? 0.1 : 0.0, &failures);
            }
        am_set_sw_prefetch(pf0);
        am_set_tuning_zen4(zen0);
    }
    {   /* 65536 3x3 matrices: big enough that every pass engages threads */
        am_shape big = mk(4, 256, 256, 3, 3);
        check_shape_pairs(&big, 0.1, 0, &failures);
    }
    if (failures) fail_msg("%d mismatches (seed %llu)", failures, (unsigned long long)g_seed);
}

/* am_update on different parameters from several user threads at once,
 * each wanting the pool (one gets it, the others run serially): the same
 * bits as one after the other. */
typedef struct conc {
    am_shape sh;
    int pdt;
    run_out out;
} conc;

static void *conc_run(void *arg) {
    conc *c = (conc *)arg;
    run_updates_keep_threads(&c->sh, c->pdt, c->pdt, 0.1, &c->out);
    return NULL;
}

static void test_concurrent_callers(void **unused) {
    enum { N = 4 };
    conc c[N];
    pthread_t th[N];
    int i;
    (void)unused;
    assert_int_equal(am_set_num_threads(2), AM_OK);
    for (i = 0; i < N; i++) {
        c[i].sh = mk(2, 300 + 7 * i, 1031, 0, 0);
        c[i].pdt = i % 3;
        assert_int_equal(pthread_create(&th[i], NULL, conc_run, &c[i]), 0);
    }
    for (i = 0; i < N; i++) assert_int_equal(pthread_join(th[i], NULL), 0);
    for (i = 0; i < N; i++) {
        run_out base;
        run_updates(&c[i].sh, c[i].pdt, c[i].pdt, 0.1, 0, 1, &base);
        assert_true(same(&base, &c[i].out, c[i].pdt));
        free_out(&base);
        free_out(&c[i].out);
    }
    am_set_num_threads(1);
}

int main(void) {
    const char *env = getenv("AM_TEST_SEED");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_philox),
        cmocka_unit_test(test_slots),
        cmocka_unit_test(test_portable_slots),
        cmocka_unit_test(test_avx512_stats_levels),
        cmocka_unit_test(test_narrow_stats),
        cmocka_unit_test(test_rows4_apply),
        cmocka_unit_test(test_short_rows_windows),
        cmocka_unit_test(test_mats_slots),
        cmocka_unit_test(test_agree_underflow),
        cmocka_unit_test(test_flat_underflow),
        cmocka_unit_test(test_flat_lr_at_zero),
        cmocka_unit_test(test_wsum_choice),
        cmocka_unit_test(test_counted_agreement_underflow),
        cmocka_unit_test(test_counted_mats_underflow),
        cmocka_unit_test(test_split_rows_fallback_agreement),
        cmocka_unit_test(test_zero_row_factor_range),
        cmocka_unit_test(test_updates),
        cmocka_unit_test(test_concurrent_callers),
    };
    if (env) g_seed = strtoull(env, NULL, 0);
    printf("test_simd_equal: seed %llu (set AM_TEST_SEED to reproduce), kernels %s\n",
           (unsigned long long)g_seed, am_kernel_name());
    return cmocka_run_group_tests(tests, NULL, NULL);
}
