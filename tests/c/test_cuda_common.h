/* test_cuda_common.h — random test values shared by test_cuda.c (GPU against
 * CPU) and test_cuda_emul.c (the CUDA plan emulated on the CPU). Each test
 * file sets g_rng from its own seed. */
#ifndef AM_TEST_CUDA_COMMON_H
#define AM_TEST_CUDA_COMMON_H

#include <automagic.h>
#include <stdint.h>

#include "am_math.h"

static uint64_t g_rng;

/* A 64-bit LCG: cheap, reproducible from the printed seed. */
static uint32_t rng_u32(void) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(g_rng >> 33);
}

/* Roughly normal values of magnitude ~scale, some exact zeros. */
static float rng_val(float scale) {
    float s = 0.0f;
    int i;
    if (rng_u32() % 17 == 0) return 0.0f;
    for (i = 0; i < 4; i++) s += (float)(rng_u32() & 0xffff) / 65536.0f - 0.5f;
    return s * scale;
}

/* Stores v into element i of a buffer of dtype dt (16-bit: round to nearest). */
static void store(void *buf, am_dtype dt, int64_t i, float v) {
    if (dt == AM_DTYPE_FLOAT32) ((float *)buf)[i] = v;
    else if (dt == AM_DTYPE_BFLOAT16) ((uint16_t *)buf)[i] = am_f32_to_bf16_rne(v);
    else ((uint16_t *)buf)[i] = am_f32_to_f16_rne(v);
}

#endif /* AM_TEST_CUDA_COMMON_H */
