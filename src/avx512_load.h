/*
 * avx512_load.h — the widening load shared by the AVX-512 kernel files.
 * Include only from files built with -mavx512f -mavx512bw, inside their
 * x86-64 guard.
 */
#ifndef AM_AVX512_LOAD_H
#define AM_AVX512_LOAD_H

#include <immintrin.h>
#include <stdint.h>

#include "automagic.h"

/* Word w of a zmm taken from word (w >> 1) of the source: with the even words
 * zeroed, 16 bfloat16 values become their float32 bit patterns (value << 16)
 * in one vpermw. The stats pass widens its 32 gradient values a step this
 * way (kernels_avx512.c, widen32_bf16); am_ld16 below does not (see there). */
static inline __attribute__((always_inline)) __m512i am_widen_idx(void) {
    return _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8,
                            7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
}

/* Elements i..i+15 of a float32/bfloat16/float16 buffer as float32, exactly
 * (bf16: the bits moved up 16; half: vcvtph2ps). bfloat16 is widened with a
 * zero extension and a shift (vpmovzxwd, vpslld) rather than the one masked
 * vpermw of am_widen_idx: on Zen 5 (twenty-first session, builds alternated)
 * the bfloat16 4096x4096 finish in cache 2.85-3.32 against 3.09-3.57 ms,
 * whole updates from memory 4.63-5.13 against 4.88-5.60 ms (4096x11008
 * 12.31-12.67 against 12.66-13.49); the stats pass's widen32_bf16 measured the
 * other way (1.51-1.64 ms with vpermw against 1.59-1.72), so it keeps it. */
static inline __attribute__((always_inline)) __m512 am_ld16(const void *base, const int dt,
                                                            int64_t i) {
    __m256i h;
    if (dt == AM_DTYPE_FLOAT32) return _mm512_loadu_ps((const float *)base + i);
    h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    if (dt == AM_DTYPE_BFLOAT16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

#endif /* AM_AVX512_LOAD_H */
