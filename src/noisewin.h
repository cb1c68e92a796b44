/*
 * noisewin.h — the stochastic-rounding noise of one apply, as the SIMD
 * kernels (kernels_avx2.c, kernels_avx512.c) read it: a window of Philox
 * quads (am_sr_noise: the 16-bit noise of element e is half-word e of the
 * quads' words), filled by the vector generator between spans of at most 64
 * elements, never inside one, so a span's vector code makes no call (a call
 * clobbers every vector register: the compiler then keeps the span's
 * constants on the stack). float16 values that need the scalar rule (half
 * subnormals, zeros, inf, NaN; in the AVX-512 kernels also values that may
 * overflow, which the AVX2 ones round in the vector code) are set aside
 * while their span is stored and rounded after it (am_noise_fix16). Plain
 * C: no intrinsics.
 */
#ifndef AM_NOISEWIN_H
#define AM_NOISEWIN_H

#include "simd.h"

/* w holds the 16-bit noise of elements [8 * q0, wend) of the whole
 * parameter (the indices the callers pass are the shard's: off is added).
 * An apply walks its elements in ascending order, so only the end of the
 * window is checked, once per span. */
typedef struct am_noisewin {
    am_philox_fn gen;
    uint64_t seed;
    uint32_t pid;
    int64_t step, q0, wend, span0;
    int64_t off;                  /* element f's noise is f + off's (a shard's first) */
    uint64_t fixmask;             /* bit l: element span0 + l is in fv[l] */
    uint32_t w[4 * (32 + 8)];     /* up to 8 quads kept + 32 generated */
    am_widewin wide;
    float fv[64];
} am_noisewin;

/* An empty window for the noise of (seed, param_id, step, noff), filled by
 * gen. */
static inline void am_noise_init(am_noisewin *w, am_philox_fn gen, uint64_t seed,
                                 uint32_t param_id, int64_t step, int64_t noff) {
    w->gen = gen;
    w->off = noff;
    w->seed = seed;
    w->pid = param_id;
    w->step = step;
    w->q0 = 0;
    w->wend = INT64_MIN; /* the first am_noise_need fills it */
    am_widewin_init(&w->wide);
    w->span0 = 0;
    w->fixmask = 0;
}

/* Makes the window hold elements [f, f + 64) (in fact at least 249 from
 * f; f is the whole parameter's index): the quads from f's on that are
 * already there (at most 8, as am_noise_need refills only when fewer than
 * 64 elements are left) move to the front, so no noise is generated twice;
 * the next 32 quads follow them. */
static __attribute__((noinline, unused)) void am_noise_refill(am_noisewin *w, int64_t f) {
    const int64_t q = f >> 3;
    int64_t keep = w->wend / 8 - q; /* quads q.. already generated (wend is a
                                     * multiple of 8; negative: none) */
    if (keep < 0) keep = 0;
    if (keep > 0) memmove(w->w, w->w + 4 * (q - w->q0), (size_t)(16 * keep));
    w->gen(w->seed, w->pid, w->step, q + keep, w->w + 4 * keep);
    w->q0 = q;
    w->wend = 8 * (q + keep + 32);
}

/* Makes the window hold the span [f, f + n), n <= 64, of ascending spans,
 * and starts it: float16 values set aside from here on are its. Nothing for
 * float32 parameters (dt), which are stored unrounded. */
static inline __attribute__((always_inline)) void am_noise_span(am_noisewin *w, const int dt,
                                                                 int64_t f, int64_t n) {
    if (dt == AM_DTYPE_FLOAT32) return;
    if (f + w->off + n > w->wend) am_noise_refill(w, f + w->off);
    w->span0 = f;
}

/* The window's halfword of element f (of the current window). */
static inline const uint16_t *am_noise_at(const am_noisewin *w, int64_t f) {
    return (const uint16_t *)w->w + (f + w->off - 8 * w->q0);
}

/* The scalar rule (am_sr_f16) for the float16 elements set aside in the
 * span just stored, with the wide stream for the half subnormal range. */
static __attribute__((noinline, unused)) void am_noise_fix16(uint16_t *p, am_noisewin *w) {
    uint64_t m = w->fixmask;
    while (m) {
        const int l = __builtin_ctzll(m);
        const int64_t e = w->span0 + l;
        const float v = w->fv[l];
        uint16_t h; /* the window's 16-bit noise of e, by memcpy (its words
                     * are uint32_t: no read through another type) */
        uint32_t rnd;
        memcpy(&h, am_noise_at(w, e), 2);
        rnd = am_f16_wide(v) ? am_wide_word(&w->wide, w->gen, w->seed, w->pid, w->step,
                                            e + w->off)
                             : h;
        p[e] = am_sr_f16(v, rnd);
        m &= m - 1;
    }
    w->fixmask = 0;
}

/* Ends a span of parameter p (dtype dt): the float16 values set aside in
 * it, rounded by the scalar rule (am_noise_fix16). */
static inline __attribute__((always_inline)) void am_noise_end(void *p, const int dt,
                                                                am_noisewin *w) {
    if (dt == AM_DTYPE_FLOAT16 && w->fixmask) am_noise_fix16((uint16_t *)p, w);
}

#endif
