/*
 * avx2_load.h — the widening load shared by the AVX2 kernel files. Include
 * only from files built with -mavx2 -mf16c, inside their x86-64 guard.
 */
#ifndef AM_AVX2_LOAD_H
#define AM_AVX2_LOAD_H

#include <immintrin.h>
#include <stdint.h>

#include "automagic.h"

/* Elements i..i+7 of a float32/bfloat16/float16 buffer as float32, exactly
 * (bf16 widening is a shift, F16C's half->float is exact). */
static inline __attribute__((always_inline)) __m256 am_ld8(const void *base, const int dt,
                                                           int64_t i) {
    __m128i h;
    if (dt == AM_DTYPE_FLOAT32) return _mm256_loadu_ps((const float *)base + i);
    h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (dt == AM_DTYPE_BFLOAT16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

#endif /* AM_AVX2_LOAD_H */
