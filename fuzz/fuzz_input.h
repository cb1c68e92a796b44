/* fuzz_input.h — reading a fuzzer's input as a stream of bytes, shared by
 * fuzz_api.c and fuzz_equal.c: past its end every byte reads as 0, so a
 * short input is a valid program whose missing choices take their first
 * (default) value. */
#ifndef AM_FUZZ_INPUT_H
#define AM_FUZZ_INPUT_H

#include <stddef.h>
#include <stdint.h>

typedef struct rd {
    const uint8_t *p;
    size_t n;
} rd;

static uint8_t u8(rd *r) {
    if (!r->n) return 0;
    r->n--;
    return *r->p++;
}

static uint64_t u64(rd *r) {
    uint64_t v = 0;
    int i;
    for (i = 0; i < 8; i++) v = (v << 8) | u8(r);
    return v;
}

#endif /* AM_FUZZ_INPUT_H */
