/*
 * philox_avx512.c — Philox4x32-7 (AM_SR_ROUNDS, am_math.h) for 32
 * consecutive quads with AVX-512F: the stochastic-rounding noise of the AVX2
 * kernels (kernels_avx2.c) on CPUs that have AVX-512 (the generator is most
 * of the cost of a bf16/fp16 update). Same words as am_rng_quad; only
 * integer operations, so no rounding question arises. Built with -mavx512f
 * on this file only; dispatch.c checks the CPU and the OS (zmm state) before
 * it is used.
 *
 * Layout: one Philox instance per 64-bit lane, its 32-bit word in the low
 * half. _mm512_mul_epu32 multiplies exactly those low halves, so the upper
 * halves may hold garbage between rounds and no shuffles are needed.
 */
#include "simd.h"

#if defined(__x86_64__) && defined(__AVX512F__)

#include <immintrin.h>

/* Quads q0..q0+31 as four independent chains of eight instances: the
 * chains hide the multiply latency of each other. out: 128 words. */
static void philox32_avx512(uint64_t seed, uint32_t pid, int64_t step,
                            int64_t q0, uint32_t *out) {
    const __m512i M0 = _mm512_set1_epi64(0xD2511F53), M1 = _mm512_set1_epi64(0xCD9E8D57);
    const __m512i lane = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i ilo = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11);
    const __m512i ihi = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
    __m512i c0[4], c1[4], c2[4], c3[4];
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    int r, ch;
    for (ch = 0; ch < 4; ch++) {
        __m512i q = _mm512_add_epi64(_mm512_set1_epi64((long long)(q0 + 8 * ch)), lane);
        c0[ch] = q;
        c1[ch] = _mm512_srli_epi64(q, 32);
        c2[ch] = _mm512_set1_epi64(pid);
        c3[ch] = _mm512_set1_epi64((uint32_t)(uint64_t)step);
    }
    for (r = 0; r < AM_SR_ROUNDS - 1; r++) {
        const __m512i K0 = _mm512_set1_epi64(k0), K1 = _mm512_set1_epi64(k1);
        for (ch = 0; ch < 4; ch++) {
            __m512i p0 = _mm512_mul_epu32(c0[ch], M0), p1 = _mm512_mul_epu32(c2[ch], M1);
            /* n0 = hi(p1) ^ c1 ^ k0, n2 = hi(p0) ^ c3 ^ k1 (0x96: a ^ b ^ c).
             * hi(p1) is moved down by a dword swap (vpshufd, port 5) and
             * hi(p0) by a shift (port 0, with the multiplies): the upper
             * halves are don't-cares, and the two ports share the work (one
             * round of a chain: 3 cycles instead of 4, measured in cache) */
            c0[ch] = _mm512_ternarylogic_epi64(_mm512_shuffle_epi32(p1, _MM_PERM_CDAB),
                                               c1[ch], K0, 0x96);
            c2[ch] = _mm512_ternarylogic_epi64(_mm512_srli_epi64(p0, 32), c3[ch], K1, 0x96);
            c1[ch] = p1;
            c3[ch] = p0;
        }
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    {
        /* the last round gives the output pairs directly: a holds words 0
         * and 1 of each quad (n0 in the low half, lo(p1) in the high one),
         * b words 2 and 3 (n2, lo(p0)). Both products' dwords are swapped;
         * the XOR is done on the low dwords only (mask 0x5555) and the high
         * ones keep the swapped lo(p) */
        const __m512i K0 = _mm512_set1_epi64(k0), K1 = _mm512_set1_epi64(k1);
        for (ch = 0; ch < 4; ch++) {
            __m512i p0 = _mm512_mul_epu32(c0[ch], M0), p1 = _mm512_mul_epu32(c2[ch], M1);
            __m512i a = _mm512_mask_ternarylogic_epi32(_mm512_shuffle_epi32(p1, _MM_PERM_CDAB),
                                                      0x5555, c1[ch], K0, 0x96);
            __m512i b = _mm512_mask_ternarylogic_epi32(_mm512_shuffle_epi32(p0, _MM_PERM_CDAB),
                                                      0x5555, c3[ch], K1, 0x96);
            _mm512_storeu_si512((void *)(out + 32 * ch), _mm512_permutex2var_epi64(a, ilo, b));
            _mm512_storeu_si512((void *)(out + 32 * ch + 16), _mm512_permutex2var_epi64(a, ihi, b));
        }
    }
}

am_philox_fn am_philox32_avx512(void) { return philox32_avx512; }

#else

am_philox_fn am_philox32_avx512(void) { return NULL; }

#endif
