/*
 * kernels_avx512.c — the apply pass of bfloat16/float16 parameters with
 * AVX-512F, 16 elements per vector. That pass is compute-bound on the
 * stochastic rounding (float32 parameters are memory-bound and keep the AVX2
 * kernel), so twice the vector width is worth a kernel of its own. Same bits
 * as kernels_ref.c's ref_apply_rows: every operation is the reference's IEEE
 * float operation on one element (no fused multiply-add: -ffp-contract=off),
 * the noise is am_sr_noise's, the rounding am_sr_bf16/am_sr_f16's.
 * Built with -mavx512f on this file only; kernels_avx2.c uses it when
 * dispatch.c found AVX-512F with the zmm state enabled.
 */
#include "simd.h"

#if defined(__x86_64__) && defined(__AVX512F__)

#include <immintrin.h>

#include "am_bits.h"

#define AM_INLINE static inline __attribute__((always_inline))
#define AM_PREFETCH 512 /* elements ahead, as in kernels_avx2.c */

/* Elements i..i+15 as float32, exactly (bf16: a shift; half: vcvtph2ps). */
AM_INLINE __m512 ld16(const void *base, const int dt, int64_t i) {
    __m256i h;
    if (dt == AM_DTYPE_FLOAT32) return _mm512_loadu_ps((const float *)base + i);
    h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    if (dt == AM_DTYPE_BFLOAT16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* The noise windows of one apply (see rngwin in kernels_avx2.c). */
typedef struct rng512 {
    am_philox_fn gen;
    uint64_t seed;
    uint32_t pid;
    int64_t step, q0, wq0;
    int valid, wvalid;
    uint32_t w[128], ww[128];
} rng512;

/* The 16-bit noise of elements f..f+15 (am_sr_noise), one 32-bit lane each. */
AM_INLINE __m512i rnd16(rng512 *w, int64_t f) {
    if (!w->valid || f < 8 * w->q0 || f + 16 > 8 * (w->q0 + 32)) {
        w->q0 = f >> 3;
        w->gen(w->seed, w->pid, w->step, w->q0, w->w);
        w->valid = 1;
    }
    return _mm512_cvtepu16_epi32(
        _mm256_loadu_si256((const __m256i *)((const uint16_t *)w->w + (f - 8 * w->q0))));
}

/* The 32-bit wide-stream noise of element e (float16 half subnormals). */
static uint32_t wide_word(rng512 *w, int64_t e) {
    if (!w->wvalid || e < 4 * w->wq0 || e >= 4 * (w->wq0 + 32)) {
        w->wq0 = e >> 2;
        w->gen(w->seed, w->pid, w->step, (int64_t)((uint64_t)w->wq0 | AM_SR_WIDE_STREAM), w->ww);
        w->wvalid = 1;
    }
    return w->ww[e - 4 * w->wq0];
}

/* Stores v into 16-bit elements i..i+15, stochastically rounded with the
 * noise of w: the bits of am_store_sr with am_sr_noise. */
AM_INLINE void st16(void *base, const int dt, int64_t i, __m512 v, rng512 *w) {
    const __m512i rnd = rnd16(w, i);
    const __m512i b = _mm512_castps_si512(v);
    const __m512i ab = _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff));
    uint16_t *out = (uint16_t *)base + i;
    if (dt == AM_DTYPE_BFLOAT16) {
        /* finite: (b + rnd16) >> 16; inf: b >> 16; NaN: (b >> 16) | 0x40 */
        const __mmask16 special = _mm512_cmpgt_epu32_mask(ab, _mm512_set1_epi32(0x7f7fffff));
        const __mmask16 isnan = _mm512_cmpgt_epu32_mask(ab, _mm512_set1_epi32(0x7f800000));
        __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(b, _mm512_and_si512(rnd, _mm512_set1_epi32(0xffff))), 16);
        r = _mm512_mask_mov_epi32(r, special, _mm512_srli_epi32(b, 16));
        r = _mm512_mask_or_epi32(r, isnan, r, _mm512_set1_epi32(0x40));
        _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(r));
    } else {
        /* Normal half range: add 13 random bits, truncate; the value is then
         * on the half grid and the round-to-nearest conversion is exact. */
        const __m512i sign = _mm512_andnot_si512(_mm512_set1_epi32(0x7fffffff), b);
        const __mmask16 bad =
            _mm512_cmplt_epu32_mask(ab, _mm512_set1_epi32(0x38800000)) |
            _mm512_cmpgt_epu32_mask(ab, _mm512_set1_epi32(0x7f7fffff));
        __m512i t = _mm512_add_epi32(ab, _mm512_and_si512(rnd, _mm512_set1_epi32(0x1fff)));
        t = _mm512_or_si512(_mm512_and_si512(t, _mm512_set1_epi32(~0x1fff)), sign);
        _mm256_storeu_si256((__m256i *)out,
                            _mm512_cvtps_ph(_mm512_castsi512_ps(t), _MM_FROUND_TO_NEAREST_INT));
        if (bad) { /* rare: half subnormals, zeros, inf, NaN — the scalar
                    * rule, with the wide stream for the subnormal range */
            float vf[16];
            uint32_t rv[16];
            int l;
            _mm512_storeu_ps(vf, v);
            _mm512_storeu_si512((void *)rv, rnd);
            for (l = 0; l < 16; l++)
                if (bad >> l & 1)
                    out[l] = am_sr_f16(vf[l], am_f16_wide(vf[l]) ? wide_word(w, i + l) : rv[l]);
        }
    }
}

typedef struct app {
    __m512 sv, lrv, wdv;
    int unscaled, has_wd;
} app;

/* Elements f..f+15 with factors fac; returns the new polarity bits. */
AM_INLINE unsigned apply16(const app *a, void *p, const int pdt, const void *g,
                           const int gdt, int64_t f, __m512 fac, rng512 *w) {
    __m512 u = _mm512_mul_ps(fac, ld16(g, gdt, f)), pv = ld16(p, pdt, f), t;
    if (!a->unscaled) u = _mm512_div_ps(u, a->sv); /* x / 1 == x exactly */
    t = a->has_wd ? _mm512_add_ps(u, _mm512_mul_ps(a->wdv, pv)) : u;
    st16(p, pdt, f, _mm512_sub_ps(pv, _mm512_mul_ps(a->lrv, t)), w);
    return (unsigned)_mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_GT_OQ);
}

/* ref_apply_rows for a 16-bit parameter, rows of C >= 16 elements. */
AM_INLINE void apply_body(void *p, const int pdt, const void *g, const int gdt,
                          int64_t R, int64_t C, int64_t r0, int64_t r1,
                          const float *rf, const float *cf, float scale,
                          float lr, const am_consts *k, uint64_t seed,
                          uint32_t param_id, int64_t step, uint8_t *pol_row) {
    const int64_t n16 = C & ~(int64_t)15, n64 = C & ~(int64_t)63;
    bitw bw = {pol_row, 0, 0, 0};
    rng512 w;
    app a;
    int64_t r, j;
    a.sv = _mm512_set1_ps(scale);
    a.lrv = _mm512_set1_ps(lr);
    a.wdv = _mm512_set1_ps(k->wd);
    a.unscaled = scale == 1.0f;
    a.has_wd = k->wd != 0.0f;
    w.gen = am_philox32_avx512();
    w.seed = seed;
    w.pid = param_id;
    w.step = step;
    w.q0 = w.wq0 = 0;
    w.valid = w.wvalid = 0;
    for (r = r0; r < r1; r++) {
        const float *cfb = cf + (r / R) * C;
        const __m512 rfv = _mm512_set1_ps(rf[r]);
        const int64_t base = r * C;
#define AM_APPLY16(J)                                                         \
    apply16(&a, p, pdt, g, gdt, base + (J),                                   \
            _mm512_mul_ps(rfv, _mm512_loadu_ps(cfb + (J))), &w)
        for (j = 0; j < n64; j += 64) {
            uint64_t bits;
            _mm_prefetch((const char *)p + (base + j + AM_PREFETCH) * 2, _MM_HINT_T0);
            _mm_prefetch((const char *)g + (base + j + AM_PREFETCH) *
                                               (gdt == AM_DTYPE_FLOAT32 ? 4 : 2),
                         _MM_HINT_T0);
            bits = (uint64_t)AM_APPLY16(j) | (uint64_t)AM_APPLY16(j + 16) << 16 |
                   (uint64_t)AM_APPLY16(j + 32) << 32 | (uint64_t)AM_APPLY16(j + 48) << 48;
            if (pol_row) bw_put64(&bw, bits);
        }
        for (; j < n16; j += 16) {
            unsigned bits = AM_APPLY16(j);
            if (pol_row) bw_put(&bw, bits, 16);
        }
#undef AM_APPLY16
        for (; j < C; j++) {
            int pos = am_apply_one(p, pdt, g, gdt, base + j, rf[r] * cfb[j], scale, lr,
                                   k->wd, seed, param_id, step);
            if (pol_row) bw_put(&bw, (uint32_t)pos, 1);
        }
    }
    if (pol_row) bw_flush(&bw);
}

#define AM_512_CASE(PD, GD)                                                   \
    apply_body(p, PD, g, GD, R, C, r0, r1, rf, cf, scale, lr, k, seed,       \
               param_id, step, pol_row)

/* pdt must be bfloat16 or float16 and C >= 16. */
static void avx512_apply_rows(void *p, int pdt, const void *g, int gdt,
                              int64_t R, int64_t C, int64_t r0, int64_t r1,
                              const float *rf, const float *cf, float scale,
                              float lr, const am_consts *k, uint64_t seed,
                              uint32_t param_id, int64_t step, uint8_t *pol_row) {
    switch ((pdt - 1) * 3 + gdt) {
    case 0: AM_512_CASE(1, 0); break;
    case 1: AM_512_CASE(1, 1); break;
    case 2: AM_512_CASE(1, 2); break;
    case 3: AM_512_CASE(2, 0); break;
    case 4: AM_512_CASE(2, 1); break;
    default: AM_512_CASE(2, 2); break;
    }
    _mm256_zeroupper(); /* see AM_CLEAN_RETURN (simd.h) */
}

am_apply_fn am_avx512_apply16(void) { return avx512_apply_rows; }

#else

am_apply_fn am_avx512_apply16(void) { return NULL; }

#endif
