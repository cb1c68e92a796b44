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
 * in one vpermw (a widening move plus a shift would be two instructions). */
static inline __attribute__((always_inline)) __m512i am_widen_idx(void) {
    return _mm512_set_epi16(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8,
                            7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
}

/* Elements i..i+15 of a float32/bfloat16/float16 buffer as float32, exactly
 * (bf16: the bits moved up 16; half: vcvtph2ps). */
static inline __attribute__((always_inline)) __m512 am_ld16(const void *base, const int dt,
                                                            int64_t i) {
    __m256i h;
    if (dt == AM_DTYPE_FLOAT32) return _mm512_loadu_ps((const float *)base + i);
    h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    if (dt == AM_DTYPE_BFLOAT16)
        return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(
            0xAAAAAAAAu, am_widen_idx(), _mm512_castsi256_si512(h)));
    return _mm512_cvtph_ps(h);
}

#endif /* AM_AVX512_LOAD_H */
