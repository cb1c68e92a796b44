/*
 * am_math.h — per-element math shared by the CPU kernels and the CUDA
 * kernels, so that both compute the same bits (SPEC 3, 5).
 *
 * Everything here is a static inline function on plain integers and floats:
 * dtype conversion, Philox4x32-7, stochastic rounding, the SPEC 3 formulas.
 * The CPU build compiles it without fast-math and with -ffp-contract=off, and
 * the canonical math never uses fused multiply-add, so every path (scalar,
 * SIMD, CUDA with --fmad=false) rounds the same way.
 */
#ifndef AM_MATH_H
#define AM_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define AM_HD static __host__ __device__ __forceinline__
#else
#define AM_HD static inline
#endif

/* ------------------------------------------------------- bit casts ------ */

AM_HD uint32_t am_f32_bits(float x) {
#ifdef __CUDA_ARCH__
    return (uint32_t)__float_as_uint(x);
#else
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
#endif
}

AM_HD float am_bits_f32(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
#endif
}

/* Finite test on the bits, immune to -ffast-math style assumptions. */
AM_HD int am_isfinite_f32(float x) {
    return (am_f32_bits(x) & 0x7f800000u) != 0x7f800000u;
}

/* ------------------------------------------------- dtype conversion ----- */

/* bfloat16 is the high half of a float32: widening is exact. */
AM_HD float am_bf16_to_f32(uint16_t h) { return am_bits_f32((uint32_t)h << 16); }

/* IEEE half -> float32, exact for every input (subnormals, inf, NaN). */
AM_HD float am_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1fu) return am_bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp != 0) return am_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
    /* subnormal: man * 2^-24, exact in float32 */
    float v = (float)man * 5.9604644775390625e-8f;
    return sign ? -v : v;
}

/* float32 -> IEEE half, round to nearest even (used for values already on
 * the half grid after stochastic rounding, and by tests and demos). */
AM_HD uint16_t am_f32_to_f16_rne(float x) {
    uint32_t b = am_f32_bits(x);
    uint16_t sign = (uint16_t)((b >> 16) & 0x8000u);
    uint32_t ab = b & 0x7fffffffu;
    if (ab >= 0x7f800000u) /* inf or NaN */
        return (uint16_t)(sign | 0x7c00u | (ab > 0x7f800000u ? 0x200u : 0u));
    if (ab >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 */
    if (ab >= 0x38800000u) { /* normal half: |x| >= 2^-14 */
        uint32_t r = ab + 0xfffu + ((ab >> 13) & 1u) - (112u << 23);
        return (uint16_t)(sign | (r >> 13));
    }
    /* subnormal half: round |x| * 2^24 to nearest even integer */
    {
        float y = am_bits_f32(ab) * 16777216.0f; /* exact */
        uint32_t k = (uint32_t)y;                /* floor, y < 1024 */
        float frac = y - (float)k;
        if (frac > 0.5f || (frac == 0.5f && (k & 1u))) k++;
        return (uint16_t)(sign | k);
    }
}

/* float32 -> bfloat16, round to nearest even (NaN stays NaN). */
AM_HD uint16_t am_f32_to_bf16_rne(float x) {
    uint32_t b = am_f32_bits(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40u);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

/* ----------------------------------------------------- Philox4x32 ----- */
/* Salmon et al., "Parallel random numbers: as easy as 1, 2, 3" (SC11);
 * constants as in Random123, whose default of 10 rounds its authors call
 * "a considerable safety margin over the minimum number of rounds with no
 * known statistical flaws"; no flaw is known at 7 (Random123 ships
 * known-answer vectors for 7 and 10; Huawei's Ascend PhiloxRandom defaults
 * to 7). The noise uses 7 (AM_SR_ROUNDS; README "Differences"): the
 * generator is most of the cost of a 16-bit update, and 7 rounds make it
 * 30% cheaper (docs/PERFORMANCE_HISTORY.md, eighth session). test_rounding.c's
 * chi-square tests reject 5 rounds and pass 6 and 7. */
#define AM_SR_ROUNDS 7

typedef struct am_u32x4 { uint32_t v[4]; } am_u32x4;

/* Philox4x32-R: `rounds` rounds on counter c with key (k0, k1). */
AM_HD am_u32x4 am_philox4x32(am_u32x4 c, uint32_t k0, uint32_t k1, int rounds) {
    int r;
    for (r = 0; r < rounds; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c.v[0];
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c.v[2];
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        am_u32x4 n;
        n.v[0] = hi1 ^ c.v[1] ^ k0;
        n.v[1] = lo1;
        n.v[2] = hi0 ^ c.v[3] ^ k1;
        n.v[3] = lo0;
        c = n;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c;
}

/* The four random words for elements 4q..4q+3 of one update (SPEC 5):
 * counter (q lo, q hi, param id, step), key = seed. Element e uses word e%4. */
AM_HD am_u32x4 am_rng_quad(uint64_t seed, uint32_t param_id, int64_t step,
                           int64_t q) {
    am_u32x4 c;
    c.v[0] = (uint32_t)(uint64_t)q;
    c.v[1] = (uint32_t)((uint64_t)q >> 32);
    c.v[2] = param_id;
    c.v[3] = (uint32_t)(uint64_t)step;
    return am_philox4x32(c, (uint32_t)seed, (uint32_t)(seed >> 32), AM_SR_ROUNDS);
}

/* The stochastic-rounding noise of element e of a 16-bit parameter
 * (dtype 1 bfloat16, 2 float16) whose float32 value is x, SPEC 5.
 * 16 random bits suffice wherever the rounding drops at most 16 bits:
 * bfloat16 everywhere (it drops exactly 16 of float32's bits) and float16 in
 * its normal range (13 bits). There one Philox call serves 8 elements: quad
 * e / 8, 16-bit half e % 8 of its 128 bits (word (e / 2) % 4, the low half
 * for even e). float16 values in the half subnormal range (|x| < 2^-14, zero
 * included) need 32 bits: word e % 4 of quad e / 4 of a second stream, the
 * quads whose index has bit 63 set (AM_SR_WIDE_STREAM; element quad indices
 * never reach it). Seen as an array of 16-bit values in memory order, the
 * quads q0, q0+1, ... give the noise of consecutive elements, which is what
 * the vector kernels load. */
#define AM_SR_WIDE_STREAM ((uint64_t)1 << 63)

/* 1 when a float16 rounding of x uses 32 random bits (see am_sr_f16). */
AM_HD int am_f16_wide(float x) { return (am_f32_bits(x) & 0x7fffffffu) < 0x38800000u; }

AM_HD uint32_t am_sr_noise(uint64_t seed, uint32_t param_id, int64_t step,
                           int64_t e, int dtype, float x) {
    am_u32x4 w;
    if (dtype == 2 && am_f16_wide(x))
        return am_rng_quad(seed, param_id, step,
                           (int64_t)((uint64_t)(e >> 2) | AM_SR_WIDE_STREAM)).v[e & 3];
    w = am_rng_quad(seed, param_id, step, e >> 3);
    return (w.v[(e >> 1) & 3] >> (16 * (e & 1))) & 0xffffu;
}

/* ---------------------------------------------- stochastic rounding ----- */

/* bfloat16 <- x, rounding up (away from zero in magnitude order of the bit
 * pattern) with probability equal to the dropped fraction. bfloat16 shares
 * float32's exponent range, so adding 16 random bits below the kept mantissa
 * and truncating is exact and unbiased everywhere, subnormals included. */
AM_HD uint16_t am_sr_bf16(float x, uint32_t rnd) {
    uint32_t b = am_f32_bits(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40u);
    if ((b & 0x7fffffffu) == 0x7f800000u) return (uint16_t)(b >> 16);
    b += rnd & 0xffffu;
    return (uint16_t)(b >> 16);
}

/* IEEE half <- x, unbiased. Normal half range (|x| >= 2^-14): add 13 random
 * bits below the kept mantissa and truncate (the reference's trick). Half
 * subnormal range: the half grid is uniform with spacing 2^-24 while float32's
 * spacing shrinks, so the trick is biased there; instead round |x|*2^24 up
 * with probability equal to its fractional part, compared against 32 random
 * bits (exact for |x| >= 2^-32; below that the probability is quantised to
 * 2^-32). Values past the largest half round up to infinity like IEEE. */
AM_HD uint16_t am_sr_f16(float x, uint32_t rnd) {
    uint32_t b = am_f32_bits(x);
    uint32_t ab = b & 0x7fffffffu;
    uint16_t sign = (uint16_t)((b >> 16) & 0x8000u);
    if (ab >= 0x7f800000u) return am_f32_to_f16_rne(x);
    if (ab >= 0x38800000u) {
        uint32_t t = (ab + (rnd & 0x1fffu)) & ~0x1fffu;
        return (uint16_t)(sign | am_f32_to_f16_rne(am_bits_f32(t)));
    }
    {
        float y = am_bits_f32(ab) * 16777216.0f; /* exact: |x| * 2^24 < 1024 */
        uint32_t k = (uint32_t)y;                /* floor */
        float frac = y - (float)k;               /* exact, in [0, 1) */
        uint32_t thr = (uint32_t)(frac * 4294967296.0f); /* floor(frac*2^32) */
        if (rnd < thr) k++;
        return (uint16_t)(sign | k); /* k == 1024 is 2^-14, the smallest normal */
    }
}

/* ------------------------------------------------ SPEC 3 formulas ------- */

/* The float32 constants of one update, derived once from the double
 * hyperparameters the same way on every path. */
typedef struct am_consts {
    float beta2;       /* (float)beta2 */
    float one_m_beta2; /* (float)(1 - beta2) */
    float eps;
    float clip;
    float wd;
    float min_lr, max_lr;
    float bump;        /* lr_bump_rate */
    float bump_up;     /* am_expf(bump): the factor for agreement 1 */
    float bump_down;   /* am_expf(-bump): the factor for agreement 0 */
} am_consts;

/* EMA of SPEC 3.1: beta2*old + (1-beta2)*x, rounded after each operation. */
AM_HD float am_ema(float old, float x, const am_consts *k) {
    float t = old * k->beta2;
    float s = x * k->one_m_beta2;
    return t + s;
}

AM_HD float am_rsqrt(float x) { return 1.0f / sqrtf(x); }

/* 1 / n for the means of SPEC 3.1 (mean_C, mean_R): the means are taken as
 * sum * (1 / n), within an ulp of sum / n, so that the many small matrices
 * of a convolution weight (six means and a row mean per 3x3 matrix) do not
 * wait on the divider; every path (scalar, SIMD, the CUDA plan) does the
 * same. */
AM_HD float am_inv_count(int64_t n) { return 1.0f / (float)n; }

/* A new second moment of SPEC 3.1 from a sum of squares over n elements:
 * ema(old, sum * (1 / n) + eps), inv_n = am_inv_count(n). */
AM_HD float am_moment(float old, float sum, float inv_n, const am_consts *k) {
    return am_ema(old, sum * inv_n + k->eps, k);
}

/* Where rmean / nr overflows float32 the row factor is taken from the
 * quotient scaled by 2^-64, its root scaled back by 2^32 (am_row_factor). */
#define AM_RF_DOWN (1.0f / 18446744073709551616.0f) /* 2^-64 */
#define AM_RF_UP 4294967296.0f                      /* 2^32 */
#define AM_FLT_MAX 3.40282347e+38f

/* A row factor of SPEC 3.1, rsqrt(nr / rmean), as sqrt(rmean / nr): one
 * division and one square root instead of two divisions and a square root,
 * within an ulp, with the same infinities and NaNs (nr = 0 < rmean: inf;
 * both 0 or both inf: NaN; nr = inf > rmean: 0). Where rmean / nr is above
 * float32's range but nr / rmean is not below it (an all-zero row, nr =
 * (1 - beta2) * eps = 1e-33, beside gradients of 2e4 and more: float16
 * gradients reach 65504), SPEC's rsqrt is finite: sqrt(rmean / nr) was
 * inf, the zero row's u = 0 * inf NaN, and the whole update skipped (found
 * by a review, twenty-fourth session). There the quotient is taken scaled
 * by 2^-64 and the root scaled back by 2^32: exact scalings (rmean * 2^-64
 * stays normal when the quotient overflows, the scaled quotient too), so
 * the value is the correctly rounded root of the correctly rounded
 * quotient, as in a wider exponent range; infinite only past 2^64 times
 * float32's largest value (SPEC's rsqrt is inf from about 7e44 on). The
 * SIMD paths compute the same (rf_v in the kernels' files). */
AM_HD float am_row_factor(float nr, float rmean) {
    const float q = rmean / nr;
    if (!(q > AM_FLT_MAX)) return sqrtf(q);
    return sqrtf((rmean * AM_RF_DOWN) / nr) * AM_RF_UP;
}

/* The sum of a parameter's per-tile sums of u*u (in tile order): groups of
 * AM_SUM_GROUP consecutive tiles are summed in order, then the group sums
 * in order. The same association on every path (CPU threads, SIMD sets,
 * the CUDA plan). A single chain of adds waits for each add: a
 * (256, 256, 3, 3) weight has 65536 tiles (one per matrix), 0.13 ms at
 * ~2 GHz; here four groups run side by side. n <= AM_SUM_GROUP gives the
 * plain sum in order. */
#define AM_SUM_GROUP 64
AM_HD double am_sum_tiles(const double *v, int64_t n) {
    double total = 0.0;
    int64_t k = 0, i;
    for (; k + 4 * AM_SUM_GROUP <= n; k += 4 * AM_SUM_GROUP) {
        double a = 0.0, b = 0.0, c = 0.0, d = 0.0;
        for (i = 0; i < AM_SUM_GROUP; i++) {
            a += v[k + i];
            b += v[k + AM_SUM_GROUP + i];
            c += v[k + 2 * AM_SUM_GROUP + i];
            d += v[k + 3 * AM_SUM_GROUP + i];
        }
        total += a;
        total += b;
        total += c;
        total += d;
    }
    for (; k < n; k += AM_SUM_GROUP) {
        const int64_t e = k + AM_SUM_GROUP < n ? k + AM_SUM_GROUP : n;
        double a = 0.0;
        for (i = k; i < e; i++) a += v[i];
        total += a;
    }
    return total;
}

/* v[0..n-1] added in order from 0.0: one group of am_sum_tiles when n <=
 * AM_SUM_GROUP. */
AM_HD double am_sum_group(const double *v, int64_t n) {
    double a = 0.0;
    int64_t i;
    for (i = 0; i < n; i++) a += v[i];
    return a;
}

/* am_sum_tiles of n tiles from its ceil(n / AM_SUM_GROUP) group sums
 * (am_sum_group of each group in tile order): the same bits, as that is
 * how it combines them, in order from 0.0. */
AM_HD double am_sum_groups(const double *s, int64_t ngroups) {
    return am_sum_group(s, ngroups);
}

/* One unfactored element's term of the sum of u*u (SPEC 3.2), u = rsqrt(v +
 * eps) * x: x * (x / (v + eps)), one division where u * u takes a square
 * root and two (the 1-D stats pass is bound by the divider), and within an
 * ulp of x*x / (v + eps) where u * u is within about three. Tiny x (x*x
 * underflows) keeps its term, as u * u does; 0 * inf and 0 / 0 give NaN
 * exactly where u * u does (eps = 0, v = 0). */
AM_HD float am_flat_u2(float x, float v, float eps) { return x * (x / (v + eps)); }

/* Whether an unfactored element's new sq v makes the update skipped
 * (AM_SKIPPED_NONFINITE_UPDATE): v + eps is not a finite number >= +0, by
 * its bits (one unsigned compare, the same in every kernel). That is v not
 * finite (g*g overflowed), or v + eps < 0, where u = rsqrt(v + eps) * g is
 * NaN while am_flat_u2 is a finite negative number that no sum would show
 * (a state whose sq holds a negative value, which no update makes and both
 * checkpoint loaders refuse: such a state wrote NaN into the parameter,
 * found by a review, thirtieth session), or v + eps overflowing (eps near
 * float32's limit). -0 never arises: v is never -0 (its second term is >=
 * +0 and the sum of -0 and +0 is +0). */
AM_HD int am_flat_bad(float v, float eps) { return am_f32_bits(v + eps) >= 0x7f800000u; }

/* SPEC 3.5 in float32: p - lr * (u + wd * p). */
AM_HD float am_apply(float p, float u, float lr, float wd) {
    float t = (wd != 0.0f) ? u + wd * p : u;
    return p - lr * t;
}

/* exp(x) for the lr bump, rounded once to float: within an ulp of the true
 * value, and the same bits on every CPU and on the GPU. The math library's
 * exp is not that: CUDA's double exp is within 1 ulp, glibc's nearly
 * correctly rounded, so the two can round to different floats near a
 * rounding midpoint (a review found no such input for lr_bump_rate 0.1, but
 * other rates were open). Here only IEEE double operations, whose results
 * are the same everywhere (no fused multiply-add: -ffp-contract=off on the
 * host, --fmad=false on the device), plus floor and ldexp, which are exact:
 * x = n ln2 + r with ln2 in two parts (the high part's 32 bits make n * hi
 * exact), |r| <= ln2 / 2, and exp(r) by its Taylor series to r^13 / 13!
 * (the next term is below 2^-57 of the result). */
AM_HD float am_expf(float x) {
    const double xd = (double)x;
    double n, r, p;
    int k;
    if (xd != xd) return x;                  /* NaN */
    if (xd > 89.0) return INFINITY;          /* e^88.73 is past FLT_MAX */
    if (xd < -104.0) return 0.0f;            /* below half the smallest subnormal */
    n = floor(xd * 1.4426950408889634 + 0.5); /* nearest integer to x / ln2 */
    r = (xd - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
    p = 1.0 / 6227020800.0; /* 1/13! */
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    k = (int)n;
    return (float)ldexp(p, k);
}

/* SPEC 3.4: lr * exp((2a - 1) * bump), clamped to [min_lr, max_lr], where
 * a = matches / m is the agreement fraction of the lr-row. A NaN product
 * (0 * inf: an lr at min_lr = 0 when lr_bump_rate > ~88.7 makes the factor
 * inf) is min_lr: it had passed the clamp and turned the parameter and its
 * stored lr NaN under AM_OK. Every path clamps so (the SIMD 1-D finishes
 * with a not-greater-or-equal compare). */
AM_HD float am_lr_scale(float lr, float factor, const am_consts *k) {
    float v = lr * factor;
    if (!(v >= k->min_lr)) v = k->min_lr;
    if (v > k->max_lr) v = k->max_lr;
    return v;
}

/* exp((2a - 1) * bump) of SPEC 3.4 for agreement a. */
AM_HD float am_bump_factor(float agreement, const am_consts *k) {
    float d = agreement * 2.0f - 1.0f;
    return am_expf(d * k->bump);
}

AM_HD float am_lr_bump(float lr, float agreement, const am_consts *k) {
    return am_lr_scale(lr, am_bump_factor(agreement, k), k);
}

/* Loads element i of a float32/bfloat16/float16 buffer as float32. dtype is
 * 0, 1 or 2 as in am_dtype. */
AM_HD float am_load(const void *base, int dtype, int64_t i) {
    if (dtype == 0) return ((const float *)base)[i];
    if (dtype == 1) return am_bf16_to_f32(((const uint16_t *)base)[i]);
    return am_f16_to_f32(((const uint16_t *)base)[i]);
}

/* Stores v into element i, stochastically rounded with rnd for 16-bit types. */
AM_HD void am_store_sr(void *base, int dtype, int64_t i, float v, uint32_t rnd) {
    if (dtype == 0) ((float *)base)[i] = v;
    else if (dtype == 1) ((uint16_t *)base)[i] = am_sr_bf16(v, rnd);
    else ((uint16_t *)base)[i] = am_sr_f16(v, rnd);
}

/* One element of the factored apply (SPEC 3.2, 3.5, 5): u = (fac * g) * inv
 * with fac = rf[row] * cf[col] and inv = 1 / clip scale (the SPEC's division
 * within an ulp; a division per element cost 13-15% of the compute-bound
 * 16-bit apply), p = p - lr * (u + wd * p) rounded with the element's noise.
 * Returns the new polarity bit (u > 0), the SPEC's (u / scale > 0) whenever
 * finish uses it (counts_valid, update.c). The noise is that of element
 * f + noff of the whole parameter (noff: a shard's first element, else 0).
 * The scalar reference's loop and the SIMD kernels' tails. */
AM_HD int am_apply_one(void *p, int pdt, const void *g, int gdt, int64_t f,
                       float fac, float inv, float lr, float wd,
                       uint64_t seed, uint32_t param_id, int64_t step, int64_t noff) {
    float u = (fac * am_load(g, gdt, f)) * inv;
    float v = am_apply(am_load(p, pdt, f), u, lr, wd);
    uint32_t rnd = pdt != 0 ? am_sr_noise(seed, param_id, step, f + noff, pdt, v) : 0u;
    am_store_sr(p, pdt, f, v, rnd);
    return u > 0.0f;
}

#endif /* AM_MATH_H */
