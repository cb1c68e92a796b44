/*
 * am_bits.h — the packed polarity writer shared by the SIMD kernel files:
 * appends sign bits (bit 0 of a byte first) at any bit alignment and counts
 * how many equal the bits they replace; and readers of stored bits at any
 * alignment. Plain C, no intrinsics.
 */
#ifndef AM_BITS_H
#define AM_BITS_H

#include <stdint.h>
#include <string.h>

typedef struct bitw {
    uint8_t *p;       /* next byte to write */
    uint64_t buf;     /* pending bits, n of them */
    int n;
    int64_t matches;
} bitw;

/* Appends the k <= 32 low bits of bits. */
static inline void bw_put(bitw *w, uint32_t bits, int k) {
    w->buf |= (uint64_t)bits << w->n;
    w->n += k;
    while (w->n >= 8) {
        uint8_t nb = (uint8_t)w->buf, ob = *w->p;
        w->matches += 8 - __builtin_popcount((unsigned)(nb ^ ob));
        *w->p++ = nb;
        w->buf >>= 8;
        w->n -= 8;
    }
}

/* Appends 64 bits at once (any bit alignment; n < 8 before and after). */
/* always inlined: a call per 64 elements cost ~6% of a bfloat16 apply, and
 * a call in a kernel loop makes the compiler keep its vectors in memory */
static inline __attribute__((always_inline)) void bw_put64(bitw *w, uint64_t bits) {
    uint64_t out = w->buf | (bits << w->n), old;
    memcpy(&old, w->p, 8);
    w->matches += 64 - __builtin_popcountll(out ^ old);
    memcpy(w->p, &out, 8);
    w->p += 8;
    w->buf = w->n ? bits >> (64 - w->n) : 0;
}

/* Writes the pending bits, leaving the rest of their byte as it was. */
static inline void bw_flush(bitw *w) {
    if (w->n > 0) {
        uint8_t mask = (uint8_t)((1u << w->n) - 1u), ob = *w->p;
        w->matches += w->n - __builtin_popcount((unsigned)((w->buf ^ ob) & mask));
        *w->p = (uint8_t)((ob & ~mask) | (w->buf & mask));
        w->n = 0;
    }
}

/* 8 stored bits starting at bit q (any alignment; reads only bytes that
 * hold some of those bits). */
static inline unsigned am_bits8_at(const uint8_t *bits, int64_t q) {
    const uint8_t *p = bits + (q >> 3);
    const int s = (int)(q & 7);
    return s ? ((unsigned)p[0] | (unsigned)p[1] << 8) >> s & 0xffu : p[0];
}

/* Writes the pending bits, then goes on at byte p (a row of its own
 * bits: the apply_rows slot's lrs mode, internal.h). */
static inline void bw_restart(bitw *w, uint8_t *p) {
    bw_flush(w);
    w->p = p;
    w->buf = 0;
}

/* 16 stored bits starting at bit q (any alignment; reads only bytes that
 * hold some of those bits). */
static inline unsigned am_bits16_at(const uint8_t *bits, int64_t q) {
    const uint8_t *p = bits + (q >> 3);
    const int s = (int)(q & 7);
    const unsigned w = (unsigned)p[0] | (unsigned)p[1] << 8;
    return s ? (w | (unsigned)p[2] << 16) >> s & 0xffffu : w;
}

/* 32 stored bits starting at bit q (any alignment; reads only bytes that
 * hold some of those bits). */
static inline uint32_t am_bits32_at(const uint8_t *bits, int64_t q) {
    const uint8_t *p = bits + (q >> 3);
    const int s = (int)(q & 7);
    uint32_t w;
    memcpy(&w, p, 4);
    return s ? w >> s | (uint32_t)p[4] << (32 - s) : w;
}

#endif /* AM_BITS_H */
