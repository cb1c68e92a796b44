/*
 * kernels_vec.c — the portable vector kernels ("portable"): the passes over
 * matrices (stats_tile, u2_tile, apply_rows), over 1-D tensors (u2_flat,
 * finish_flat) and the sign count (count_pos), written with the GCC/Clang
 * vector extensions in 16-byte vectors (NEON registers on aarch64, SSE2 on
 * x86-64) and no processor-specific code but an IEEE square root. They run
 * where the AVX2 set cannot (every non-x86 CPU, x86 CPUs without AVX2):
 * before, those ran the scalar reference, which reads and widens one
 * element at a time and computes a Philox quad per 16-bit element.
 *
 * Same bits as kernels_ref.c: the reference's AM_LANES = 8 lanes are two
 * vectors (element j0 + j of a row in lane j % 8), every operation is the
 * reference's IEEE float operation on one element (no contraction:
 * -ffp-contract=off), conversions are exact (float16 widened with integer
 * operations and, for its subnormals, one exact subtraction), and the
 * stochastic rounding noise is am_sr_noise's, generated a quad at a time in
 * a loop the compiler vectorises. The batched small matrices' sums and
 * moments (3x3 convolutions) and the fallback agreement sweep keep the
 * reference's slots.
 */
#include "simd.h"

#include <math.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#if defined(__GNUC__) /* GCC and Clang: vector extensions and convertvector */ && \
    (defined(__clang__) || __GNUC__ >= 9)

typedef float v4f __attribute__((vector_size(16)));
typedef int32_t v4i __attribute__((vector_size(16)));
typedef uint32_t v4u __attribute__((vector_size(16)));
typedef uint16_t v4h __attribute__((vector_size(8)));

/* 16-byte vectors, the width of SSE2 and NEON registers: GCC lowered the
 * compares of 32-byte ones to scalar code on both (the stats pass took 2.2
 * ns an element); a group of 8 lanes is two of them, lo (lanes 0-3) and hi
 * (4-7). */
#define AM_VI static inline __attribute__((always_inline))

AM_VI v4f splatf(float x) { return (v4f){x, x, x, x}; }
AM_VI v4u splatu(uint32_t x) { return (v4u){x, x, x, x}; }
AM_VI v4f ldf(const float *a) {
    v4f v;
    memcpy(&v, a, sizeof v);
    return v;
}
AM_VI void stf(float *a, v4f v) { memcpy(a, &v, sizeof v); }
/* mask (all ones / zero lanes) ? a : b */
AM_VI v4f self(v4i mask, v4f a, v4f b) { return (v4f)(((v4i)a & mask) | ((v4i)b & ~mask)); }
AM_VI v4u selu(v4i mask, v4u a, v4u b) { return (a & (v4u)mask) | (b & ~(v4u)mask); }

/* Elements i..i+3 of a float32/bfloat16/float16 buffer as float32, exactly
 * as am_load (am_f16_to_f32 for float16: normals, inf and NaN by moving the
 * bits; a subnormal m * 2^-24 as (1 + m / 1024) * 2^-14 - 2^-14, exact,
 * with no float32 subnormal on the way: a product of one by 2^112, tried
 * first, took 5.8 instead of 4.6 ns an element of a 4096x4096 update whose
 * gradient held 6% half subnormals, on this Zen 5 through SSE2). */
AM_VI v4f ld4(const void *base, const int dt, int64_t i) {
    v4h h;
    v4u w;
    if (dt == AM_DTYPE_FLOAT32) return ldf((const float *)base + i);
    memcpy(&h, (const uint16_t *)base + i, sizeof h);
    w = __builtin_convertvector(h, v4u);
    if (dt == AM_DTYPE_BFLOAT16) return (v4f)(w << 16);
    {
        const v4u em = (w & 0x7fffu) << 13, sign = (w & 0x8000u) << 16;
        const v4u sub = (v4u)((v4f)(em + (113u << 23)) - splatf(0x1p-14f));
        const v4u o = selu((v4i)(em >= splatu(0x7c00u << 13)), em | 0x7f800000u,
                           em + (112u << 23));
        return (v4f)(sign | selu((v4i)(em < splatu(0x400u << 13)), sub, o));
    }
}

/* The 8 bits from bit q of bits (the bytes holding bits q..q+7 only). */
AM_VI uint32_t get8(const uint8_t *bits, int64_t q) {
    const int sh = (int)(q & 7);
    uint32_t v = (uint32_t)bits[q >> 3] >> sh;
    if (sh) v |= (uint32_t)bits[(q >> 3) + 1] << (8 - sh);
    return v & 0xffu;
}

/* Writes the 8 bits m at bit q (the bytes holding bits q..q+7 only). */
AM_VI void put8(uint8_t *bits, int64_t q, uint32_t m) {
    const int sh = (int)(q & 7);
    uint8_t *b = bits + (q >> 3);
    if (!sh) {
        *b = (uint8_t)m;
        return;
    }
    b[0] = (uint8_t)((b[0] & ((1u << sh) - 1u)) | (m << sh));
    b[1] = (uint8_t)((b[1] & ~((1u << sh) - 1u)) | (m >> (8 - sh)));
}

static void put_bit(uint8_t *bits, int64_t q, int v) {
    const uint8_t mask = (uint8_t)(1u << (q & 7));
    if (v) bits[q >> 3] = (uint8_t)(bits[q >> 3] | mask);
    else bits[q >> 3] = (uint8_t)(bits[q >> 3] & ~mask);
}

/* Lanes of two compare results (-1 / 0), lo and hi, as bits 0-7. */
AM_VI uint32_t mask8(v4i lo, v4i hi) {
    const v4u b = ((v4u)lo & (v4u){1, 2, 4, 8}) | ((v4u)hi & (v4u){16, 32, 64, 128});
    uint32_t a[4];
    memcpy(a, &b, sizeof a);
    return (a[0] | a[1]) | (a[2] | a[3]);
}

/* Bits 0-3 and 4-7 of byte as lanes of -1 / 0, lo and hi. */
AM_VI void bits8(uint32_t byte, v4i *lo, v4i *hi) {
    const v4u b8 = splatu(byte), z = splatu(0);
    *lo = (v4i)((b8 & (v4u){1, 2, 4, 8}) != z);
    *hi = (v4i)((b8 & (v4u){16, 32, 64, 128}) != z);
}

/* The agreement of x > 0 with the old bits (lanes of -1 / 0) into mc (-1
 * per match), the smallest x > 0 into mv. */
AM_VI void agree4(v4f x, v4i old, v4i *mc, v4f *mv) {
    const v4i gp = (v4i)(x > splatf(0.0f));
    *mc += (v4i)(gp == old);
    *mv = self(gp & (v4i)(x < *mv), x, *mv);
}

/* The sum of four int32 lanes. */
AM_VI int64_t hsum4(v4i v) {
    int32_t c[4];
    memcpy(c, &v, sizeof c);
    return ((int64_t)c[0] + c[1]) + ((int64_t)c[2] + c[3]);
}

/* The smallest of mp and the four lanes of v (exact in any order). */
AM_VI float hmin4(v4f v, float mp) {
    float m[4];
    int l;
    memcpy(m, &v, sizeof m);
    for (l = 0; l < 4; l++)
        if (m[l] < mp) mp = m[l];
    return mp;
}

/* Two vectors into the 8 lanes a (lo: lanes 0-3). */
AM_VI void spill8(float a[AM_LANES], v4f lo, v4f hi) {
    memcpy(a, &lo, sizeof lo);
    memcpy(a + 4, &hi, sizeof hi);
}

/* ------------------------------------------------------------ stats ---- */

/* Four lanes of a row's stats: x^2 into acc and the column sums at col;
 * with pm (bits: the old bits of these lanes as -1 / 0) the agreement
 * into mc (-1 per match) and the smallest x > 0 into mv. */
AM_VI void stats4(v4f x, float *col, v4f *acc, const int pm, v4i bits, v4i *mc, v4f *mv) {
    const v4f x2 = x * x;
    *acc += x2;
    stf(col, ldf(col) + x2);
    if (pm) agree4(x, bits, mc, mv);
}

/* Row i of the tile: its lane sum of g^2 into *rowsum, g^2 added to
 * colpart; with pm its agreement count (returned) and *mpv, *mp the
 * smallest g > 0 so far (lanes and tail). */
AM_VI int32_t stats_row(const void *g, const int gdt, int64_t C, int64_t i, int64_t j0,
                        int64_t n, float *colpart, const am_polmap *pm, v4f *mpv,
                        float *mp, float *rowsum) {
    const int64_t n8 = n & ~(int64_t)7, base = i * C + j0;
    const int64_t q = pm ? am_polmap_bit(pm, i, j0) : 0;
    v4f alo = splatf(0.0f), ahi = alo, mv = *mpv;
    v4i mc = {0, 0, 0, 0};
    float a[AM_LANES];
    int32_t match = 0;
    int64_t j;
    for (j = 0; j < n8; j += 8) {
        v4i bl = {0, 0, 0, 0}, bh = bl;
        if (pm) bits8(get8(pm->bits, q + j), &bl, &bh); /* the old bits */
        stats4(ld4(g, gdt, base + j), colpart + j, &alo, pm != NULL, bl, &mc, &mv);
        stats4(ld4(g, gdt, base + j + 4), colpart + j + 4, &ahi, pm != NULL, bh, &mc, &mv);
    }
    spill8(a, alo, ahi);
    *mpv = mv;
    for (; j < n; j++) { /* lanes 0.. (j - j0) % 8, as the reference */
        const float x = am_load(g, gdt, base + j), x2 = x * x;
        a[j & 7] += x2;
        colpart[j] += x2;
        if (pm) {
            const int pos = x > 0.0f, bit = (int)((pm->bits[(q + j) >> 3] >> ((q + j) & 7)) & 1);
            match += pos == bit;
            if (pos && x < *mp) *mp = x;
        }
    }
    *rowsum = am_lanesum_finish(a);
    return pm ? match - (int32_t)hsum4(mc) : 0;
}

/* The W sums of rows i..i+nq-1 (am_wsum_cols' order) over the tile's
 * columns, weights w. */
AM_VI void wsum_rows(const void *g, const int gdt, int64_t C, int64_t i, int nq, int64_t j0,
                     int64_t n, const float *w, float *wpart) {
    const int64_t n4 = n & ~(int64_t)3;
    int64_t j;
    int q;
    for (j = 0; j < n4; j += 4) {
        v4f x = ld4(g, gdt, i * C + j0 + j), s = (x * x) * splatf(w[0]);
        for (q = 1; q < nq; q++) {
            x = ld4(g, gdt, (i + q) * C + j0 + j);
            s += (x * x) * splatf(w[q]);
        }
        stf(wpart + j, ldf(wpart + j) + s);
    }
    am_wsum_cols(g, gdt, C, i, nq, j0, j0 + n4, j0 + n, w, wpart);
}

/* The W sums of a group of rows follow its stats at once, while the rows
 * are in the cache (the reference makes them in a loop of its own: the same
 * order per column, groups of 4 rows ascending). */
#define AM_VEC_STATS(GDT)                                                     \
    for (i = i0; i < i1;) {                                                   \
        const int nq = i + 4 <= i1 ? 4 : 1;                                   \
        float w[4];                                                           \
        int q;                                                                \
        for (q = 0; q < nq; q++) {                                            \
            const int32_t m = stats_row(g_mat, GDT, C, i + q, j0, n, colpart, \
                                        pm, &mpv, &mp, &rowpart[i + q - i0]); \
            if (pm) rowmatch[i + q - i0] = m;                                 \
        }                                                                     \
        if (ws) {                                                             \
            for (q = 0; q < nq; q++)                                          \
                w[q] = am_wsum_weight(ws, i + q, rowpart[i + q - i0]);        \
            wsum_rows(g_mat, GDT, C, i, nq, j0, n, w, ws->wpart);             \
        }                                                                     \
        i += nq;                                                              \
    }

static void vec_stats_tile(const void *g_mat, int gdt, int64_t C, int64_t i0, int64_t i1,
                           int64_t j0, int64_t j1, float *rowpart, float *colpart,
                           const am_polmap *pm, int32_t *rowmatch, float *minpos,
                           const am_wsum *ws) {
    const int64_t n = j1 - j0;
    v4f mpv = splatf(INFINITY);
    float mp = INFINITY;
    int64_t i;
    memset(colpart, 0, (size_t)n * sizeof *colpart);
    if (ws) memset(ws->wpart, 0, (size_t)n * sizeof *ws->wpart);
    switch (gdt) { /* the dtype a constant in each loop */
    case AM_DTYPE_FLOAT32: AM_VEC_STATS(AM_DTYPE_FLOAT32); break;
    case AM_DTYPE_BFLOAT16: AM_VEC_STATS(AM_DTYPE_BFLOAT16); break;
    default: AM_VEC_STATS(AM_DTYPE_FLOAT16); break;
    }
    if (pm) *minpos = hmin4(mpv, mp);
}
#undef AM_VEC_STATS

/* --------------------------------------------------------------- u2 ---- */

static double vec_u2_tile(const void *g_mat, int gdt, int64_t C, int64_t i0, int64_t i1,
                          int64_t j0, int64_t j1, const float *rf, const float *cf) {
    const int64_t n8 = (j1 - j0) & ~(int64_t)7;
    double total = 0.0;
    float a[AM_LANES];
    int64_t i, j;
    for (i = i0; i < i1; i++) {
        const v4f rfv = splatf(rf[i]);
        v4f alo = splatf(0.0f), ahi = alo;
        for (j = 0; j < n8; j += 8) {
            const v4f ul = (rfv * ldf(cf + j0 + j)) * ld4(g_mat, gdt, i * C + j0 + j);
            const v4f uh = (rfv * ldf(cf + j0 + j + 4)) * ld4(g_mat, gdt, i * C + j0 + j + 4);
            alo += ul * ul;
            ahi += uh * uh;
        }
        spill8(a, alo, ahi);
        for (j += j0; j < j1; j++) {
            const float u = (rf[i] * cf[j]) * am_load(g_mat, gdt, i * C + j);
            a[(j - j0) & 7] += u * u;
        }
        total += (double)am_lanesum_finish(a);
    }
    return total;
}

/* ------------------------------------------------------------ apply ---- */

/* The 16-bit noise of elements (noise indices) [8 * q0, 8 * (q0 + AM_VQ)):
 * quad q's four words as 16-bit halves, low first (am_sr_noise: element e
 * takes half e % 8 of quad e / 8). */
#define AM_VQ 32

typedef struct vwin {
    int64_t q0, end; /* end: 8 * (q0 + AM_VQ), or INT64_MIN when empty */
    uint16_t h[8 * AM_VQ];
} vwin;

/* Philox4x32-7 (am_philox4x32) of quads q0..q0+AM_VQ-1 as four arrays,
 * each round a loop over the quads that the compiler vectorises (32x32 ->
 * 64-bit multiplies: pmuludq on SSE2, umull on NEON). */
static void vwin_fill(vwin *w, uint64_t seed, uint32_t pid, int64_t step, int64_t q0) {
    uint32_t c0[AM_VQ], c1[AM_VQ], c2[AM_VQ], c3[AM_VQ];
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    int r, k;
    for (k = 0; k < AM_VQ; k++) {
        const uint64_t q = (uint64_t)q0 + (uint64_t)k;
        c0[k] = (uint32_t)q;
        c1[k] = (uint32_t)(q >> 32);
        c2[k] = pid;
        c3[k] = (uint32_t)(uint64_t)step;
    }
    for (r = 0; r < AM_SR_ROUNDS; r++) {
        for (k = 0; k < AM_VQ; k++) {
            const uint64_t p0 = (uint64_t)0xD2511F53u * c0[k];
            const uint64_t p1 = (uint64_t)0xCD9E8D57u * c2[k];
            const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1[k] ^ k0;
            const uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3[k] ^ k1;
            c1[k] = (uint32_t)p1;
            c3[k] = (uint32_t)p0;
            c0[k] = n0;
            c2[k] = n2;
        }
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    for (k = 0; k < AM_VQ; k++) {
        uint16_t *o = w->h + 8 * k;
        o[0] = (uint16_t)c0[k]; o[1] = (uint16_t)(c0[k] >> 16);
        o[2] = (uint16_t)c1[k]; o[3] = (uint16_t)(c1[k] >> 16);
        o[4] = (uint16_t)c2[k]; o[5] = (uint16_t)(c2[k] >> 16);
        o[6] = (uint16_t)c3[k]; o[7] = (uint16_t)(c3[k] >> 16);
    }
    w->q0 = q0;
    w->end = 8 * (q0 + AM_VQ);
}

/* Makes the window hold the noise of elements (noise indices) e..e+n-1,
 * n <= 8. */
AM_VI void vwin_need(vwin *w, uint64_t seed, uint32_t pid, int64_t step, int64_t e, int n) {
    if (e + n > w->end || e < 8 * w->q0) vwin_fill(w, seed, pid, step, e >> 3);
}

AM_VI void vwin_init(vwin *w) {
    w->q0 = 0;
    w->end = INT64_MIN;
}

/* Stores v into element f, rounded as am_store_sr with am_sr_noise (noise
 * index f + noff): the window's 16 bits, or the wide stream for a float16
 * half subnormal (am_f16_wide). */
AM_VI void st1_sr(void *p, const int pdt, int64_t f, float v, vwin *w, uint64_t seed,
                  uint32_t pid, int64_t step, int64_t noff) {
    const int64_t e = f + noff;
    uint32_t rnd;
    if (pdt == AM_DTYPE_FLOAT32) {
        ((float *)p)[f] = v;
        return;
    }
    if (pdt == AM_DTYPE_FLOAT16 && am_f16_wide(v)) {
        rnd = am_sr_noise(seed, pid, step, e, pdt, v);
    } else {
        vwin_need(w, seed, pid, step, e, 1);
        rnd = w->h[e - 8 * w->q0];
    }
    am_store_sr(p, pdt, f, v, rnd);
}

/* am_apply_one with the window's noise. */
AM_VI int apply1(void *p, const int pdt, const void *g, const int gdt, int64_t f, float fac,
                 float inv, float lr, float wd, vwin *w, uint64_t seed, uint32_t pid,
                 int64_t step, int64_t noff) {
    const float u = (fac * am_load(g, gdt, f)) * inv;
    st1_sr(p, pdt, f, am_apply(am_load(p, pdt, f), u, lr, wd), w, seed, pid, step, noff);
    return u > 0.0f;
}

/* The noise of element e..e+3 (in the window), as 32-bit lanes. */
AM_VI v4u vwin_get(const vwin *w, int64_t e) {
    v4h h;
    memcpy(&h, w->h + (e - 8 * w->q0), sizeof h);
    return __builtin_convertvector(h, v4u);
}

/* Stores v into 16-bit elements f..f+3 rounded as am_store_sr with
 * am_sr_noise (noise index f + noff, in the window). float16 lanes outside
 * [2^-14, 65504] in magnitude (subnormals, zeros, larger values, inf, NaN)
 * take the scalar rule, with the wide stream where it applies. */
AM_VI void st4_sr(void *p, const int pdt, int64_t f, v4f v, const vwin *w, uint64_t seed,
                  uint32_t pid, int64_t step, int64_t noff) {
    const v4u b = (v4u)v, ab = b & 0x7fffffffu, rnd = vwin_get(w, f + noff);
    uint16_t *out = (uint16_t *)p + f;
    v4u r;
    v4h h;
    if (pdt == AM_DTYPE_BFLOAT16) {
        r = selu((v4i)(ab > splatu(0x7f800000u)), (b >> 16) | 0x40u, (b + rnd) >> 16);
        h = __builtin_convertvector(r, v4h);
        memcpy(out, &h, sizeof h);
    } else {
        const v4i bad = (v4i)(ab - 0x38800000u > splatu(0x477fe000u - 0x38800000u));
        const v4u t = (ab + (rnd & 0x1fffu)) & ~0x1fffu;
        uint32_t bm[4];
        int l;
        r = ((b >> 16) & 0x8000u) | ((t >> 13) - (112u << 10));
        h = __builtin_convertvector(r, v4h);
        memcpy(out, &h, sizeof h);
        memcpy(bm, &bad, sizeof bm);
        if (bm[0] | bm[1] | bm[2] | bm[3]) {
            float vv[4];
            memcpy(vv, &v, sizeof vv);
            for (l = 0; l < 4; l++)
                if (bm[l])
                    out[l] = am_sr_f16(vv[l], am_sr_noise(seed, pid, step, f + l + noff, pdt,
                                                          vv[l]));
        }
    }
}

/* Four elements from f of the apply: returns u > 0 as lanes of -1 / 0. */
AM_VI v4i apply4(void *p, const int pdt, const void *g, const int gdt, int64_t f, v4f fac,
                 v4f iv, v4f lrv, v4f wdv, const int wd, const vwin *w, uint64_t seed,
                 uint32_t pid, int64_t step, int64_t noff) {
    const v4f u = (fac * ld4(g, gdt, f)) * iv, pv = ld4(p, pdt, f);
    const v4f v = pv - lrv * (wd ? u + wdv * pv : u);
    if (pdt == AM_DTYPE_FLOAT32) stf((float *)p + f, v);
    else st4_sr(p, pdt, f, v, w, seed, pid, step, noff);
    return (v4i)(u > splatf(0.0f));
}

/* apply_body for rows shorter than 8 sharing one lr (not lrs mode): the
 * rows [r0, r1) are one stream of elements, 8 at a time, each with its
 * factor rf[r] * cf[b, j] (made in scalar code: the same product), its bit
 * at its place in the stream. */
AM_VI void apply_narrow(void *p, const int pdt, const void *g, const int gdt, int64_t R,
                        int64_t C, int64_t r0, int64_t r1, const float *rf, const float *cf,
                        float inv, float lr, const am_consts *k, uint64_t seed, uint32_t pid,
                        int64_t step, int64_t noff, uint8_t *pol_row, const int wd) {
    const v4f iv = splatf(inv), wdv = splatf(k->wd), lrv = splatf(lr);
    const int64_t f0 = r0 * C, f1 = r1 * C, n8 = f0 + ((f1 - f0) & ~(int64_t)7);
    int64_t f, r = r0, j = 0; /* the row and column of element f */
    vwin w;
    vwin_init(&w);
    for (f = f0; f < n8; f += 8) {
        float fac[8];
        v4i lo, hi;
        int l;
        for (l = 0; l < 8; l++) {
            fac[l] = rf[r] * cf[(r / R) * C + j];
            if (++j == C) {
                j = 0;
                r++;
            }
        }
        if (pdt != AM_DTYPE_FLOAT32) vwin_need(&w, seed, pid, step, f + noff, 8);
        lo = apply4(p, pdt, g, gdt, f, ldf(fac), iv, lrv, wdv, wd, &w, seed, pid, step, noff);
        hi = apply4(p, pdt, g, gdt, f + 4, ldf(fac + 4), iv, lrv, wdv, wd, &w, seed, pid, step,
                    noff);
        if (pol_row) put8(pol_row, f - f0, mask8(lo, hi));
    }
    for (; f < f1; f++) {
        const int pos = apply1(p, pdt, g, gdt, f, rf[r] * cf[(r / R) * C + j], inv, lr, k->wd,
                               &w, seed, pid, step, noff);
        if (pol_row) put_bit(pol_row, f - f0, pos);
        if (++j == C) {
            j = 0;
            r++;
        }
    }
}

/* apply_rows with the dtypes and the decay test fixed. */
AM_VI void apply_body(void *p, const int pdt, const void *g, const int gdt, int64_t R,
                      int64_t C, int64_t r0, int64_t r1, const float *rf, const float *cf,
                      float inv, float lr, const float *lrs, const am_consts *k,
                      uint64_t seed, uint32_t pid, int64_t step, int64_t noff,
                      uint8_t *pol_row, const int wd) {
    const int64_t C8 = C & ~(int64_t)7;
    const v4f iv = splatf(inv), wdv = splatf(k->wd);
    vwin w;
    int64_t r, j;
    if (C < 8 && !lrs) {
        apply_narrow(p, pdt, g, gdt, R, C, r0, r1, rf, cf, inv, lr, k, seed, pid, step, noff,
                     pol_row, wd);
        return;
    }
    vwin_init(&w);
    for (r = r0; r < r1; r++) {
        const float *cfb = cf + (r / R) * C;
        const float lr_r = lrs ? lrs[r - r0] : lr;
        const int64_t q0 = lrs ? (r - r0) * am_lrs_row_bytes(C) * 8 : (r - r0) * C;
        const int64_t f0 = r * C;
        const v4f rfv = splatf(rf[r]), lrv = splatf(lr_r);
        for (j = 0; j < C8; j += 8) {
            v4i lo, hi;
            if (pdt != AM_DTYPE_FLOAT32) vwin_need(&w, seed, pid, step, f0 + j + noff, 8);
            lo = apply4(p, pdt, g, gdt, f0 + j, rfv * ldf(cfb + j), iv, lrv, wdv, wd, &w, seed,
                        pid, step, noff);
            hi = apply4(p, pdt, g, gdt, f0 + j + 4, rfv * ldf(cfb + j + 4), iv, lrv, wdv, wd,
                        &w, seed, pid, step, noff);
            if (pol_row) put8(pol_row, q0 + j, mask8(lo, hi));
        }
        for (; j < C; j++) {
            const int pos = apply1(p, pdt, g, gdt, f0 + j, rf[r] * cfb[j], inv, lr_r, k->wd, &w,
                                   seed, pid, step, noff);
            if (pol_row) put_bit(pol_row, q0 + j, pos);
        }
    }
}

#define AM_VEC_APPLY(PD, GD)                                                  \
    do {                                                                      \
        if (k->wd != 0.0f)                                                    \
            apply_body(p, PD, g, GD, R, C, r0, r1, rf, cf, inv, lr, lrs, k,   \
                       seed, param_id, step, noff, pol_row, 1);               \
        else                                                                  \
            apply_body(p, PD, g, GD, R, C, r0, r1, rf, cf, inv, lr, lrs, k,   \
                       seed, param_id, step, noff, pol_row, 0);               \
    } while (0)

static void vec_apply_rows(void *p, int pdt, const void *g, int gdt, int64_t R, int64_t C,
                           int64_t r0, int64_t r1, const float *rf, const float *cf,
                           float inv, float lr, const float *lrs, const am_consts *k,
                           uint64_t seed, uint32_t param_id, int64_t step, int64_t noff,
                           uint8_t *pol_row) {
    AM_DTYPE_PAIRS(pdt, gdt, AM_VEC_APPLY);
}
#undef AM_VEC_APPLY

/* ------------------------------------------------- 1-D tensors ---- */

/* IEEE square roots of four lanes (correctly rounded, as sqrtf). */
AM_VI v4f vsqrt(v4f x) {
#if defined(__SSE2__)
    return (v4f)_mm_sqrt_ps((__m128)x);
#elif defined(__aarch64__) && defined(__ARM_NEON)
    return (v4f)vsqrtq_f32((float32x4_t)x);
#else
    return (v4f){sqrtf(x[0]), sqrtf(x[1]), sqrtf(x[2]), sqrtf(x[3])};
#endif
}

/* am_ema(sq, x * x) of four lanes. */
AM_VI v4f ema4(v4f sq, v4f x, const am_consts *k) {
    return sq * splatf(k->beta2) + (x * x) * splatf(k->one_m_beta2);
}

static double vec_u2_flat(const void *g, int gdt, const float *sq, int64_t e0, int64_t e1,
                          const am_consts *k) {
    const int64_t n8 = e0 + ((e1 - e0) & ~(int64_t)7);
    const v4f epsv = splatf(k->eps);
    v4f alo = splatf(0.0f), ahi = alo;
    v4i bad = {0, 0, 0, 0};
    float a[AM_LANES];
    int32_t b[4];
    int64_t e;
    int overflow = 0;
    for (e = e0; e < n8; e += 8) {
        const v4f xl = ld4(g, gdt, e), xh = ld4(g, gdt, e + 4);
        const v4f vl = ema4(ldf(sq + e), xl, k), vh = ema4(ldf(sq + e + 4), xh, k);
        const v4f dl = vl + epsv, dh = vh + epsv;
        /* am_flat_bad: bits of v + eps >= +inf's, unsigned */
        bad |= (v4i)((v4u)dl >= splatu(0x7f800000u)) | (v4i)((v4u)dh >= splatu(0x7f800000u));
        alo += xl * (xl / dl); /* am_flat_u2 */
        ahi += xh * (xh / dh);
    }
    spill8(a, alo, ahi);
    memcpy(b, &bad, sizeof b);
    overflow = (b[0] | b[1] | b[2] | b[3]) != 0;
    for (; e < e1; e++) {
        const float x = am_load(g, gdt, e), v = am_ema(sq[e], x * x, k);
        overflow |= am_flat_bad(v, k->eps);
        a[(e - e0) & 7] += am_flat_u2(x, v, k->eps);
    }
    return overflow ? (double)NAN : (double)am_lanesum_finish(a);
}

/* Four elements from e of the 1-D finish (ref_finish_flat): the new sq,
 * lr (bumped by the agreement of the sign with the old bit, lane mask
 * old), parameter; returns the new bits (u / scale > 0) as -1 / 0. */
AM_VI v4i flat4(void *p, const int pdt, const void *g, const int gdt, float *sq, float *lr,
                int64_t e, v4i old, float scale, float inv, const am_consts *k, int64_t step,
                const vwin *w, uint64_t seed, uint32_t pid, int64_t noff, v4i *match) {
    const v4f x = ld4(g, gdt, e), v = ema4(ldf(sq + e), x, k);
    const v4f u = (splatf(1.0f) / vsqrt(v + splatf(k->eps))) * x; /* am_rsqrt(v + eps) * x */
    const v4i pol = (v4i)(u / splatf(scale) > splatf(0.0f));
    const v4i same = (v4i)(pol == old);
    const v4f pv = ld4(p, pdt, e);
    v4f lv = ldf(lr + e), t;
    stf(sq + e, v);
    *match += same;
    if (step > 0) { /* am_lr_scale(lr, match ? up : down) */
        lv = lv * self(same, splatf(k->bump_up), splatf(k->bump_down));
        lv = self((v4i)(lv >= splatf(k->min_lr)), lv, splatf(k->min_lr));
        lv = self((v4i)(lv > splatf(k->max_lr)), splatf(k->max_lr), lv);
        stf(lr + e, lv);
    }
    t = u * splatf(inv); /* am_apply(p, u * inv, lr, wd) */
    if (k->wd != 0.0f) t = t + splatf(k->wd) * pv;
    t = pv - lv * t;
    if (pdt == AM_DTYPE_FLOAT32) stf((float *)p + e, t);
    else st4_sr(p, pdt, e, t, w, seed, pid, step, noff);
    return pol;
}

static int64_t vec_finish_flat(void *p, int pdt, const void *g, int gdt, float *sq, float *lr,
                               uint8_t *pol, int64_t e0, int64_t e1, float scale,
                               const am_consts *k, uint64_t seed, uint32_t param_id,
                               int64_t step, int64_t noff) {
    const float inv = 1.0f / scale;
    const int64_t n8 = e0 + ((e1 - e0) & ~(int64_t)7);
    v4i mc = {0, 0, 0, 0};
    int64_t e, matches;
    vwin w;
    vwin_init(&w);
    for (e = e0; e < n8; e += 8) { /* e0 % 8 == 0: whole bytes of bits */
        v4i lo, hi;
        bits8(pol[e >> 3], &lo, &hi); /* the old bits */
        if (pdt != AM_DTYPE_FLOAT32) vwin_need(&w, seed, param_id, step, e + noff, 8);
        lo = flat4(p, pdt, g, gdt, sq, lr, e, lo, scale, inv, k, step, &w, seed, param_id, noff,
                   &mc);
        hi = flat4(p, pdt, g, gdt, sq, lr, e + 4, hi, scale, inv, k, step, &w, seed, param_id,
                   noff, &mc);
        pol[e >> 3] = (uint8_t)mask8(lo, hi);
    }
    matches = -hsum4(mc);
    for (; e < e1; e++) { /* ref_finish_flat's element */
        const float x = am_load(g, gdt, e), v = am_ema(sq[e], x * x, k);
        const float u = am_rsqrt(v + k->eps) * x;
        const int polv = u / scale > 0.0f;
        const int match = polv == ((pol[e >> 3] >> (e & 7)) & 1);
        sq[e] = v;
        matches += match;
        put_bit(pol, e, polv);
        if (step > 0) lr[e] = am_lr_scale(lr[e], match ? k->bump_up : k->bump_down, k);
        st1_sr(p, pdt, e, am_apply(am_load(p, pdt, e), u * inv, lr[e], k->wd), &w, seed,
               param_id, step, noff);
    }
    return matches;
}

/* ------------------------------------------ the reference's other slots */

static int64_t vec_agree_rows(const void *g, int gdt, int64_t R, int64_t C, int64_t r0,
                              int64_t r1, const float *rf, const float *cf, float scale,
                              uint8_t *pol_row) {
    return am_kernels_ref.agree_rows(g, gdt, R, C, r0, r1, rf, cf, scale, pol_row);
}

static void vec_stats_mats(const void *g, int gdt, int64_t R, int64_t C, int64_t b0,
                           int64_t b1, float *rowsum, float *colsum) {
    am_kernels_ref.stats_mats(g, gdt, R, C, b0, b1, rowsum, colsum);
}

static void vec_u2_mats(const void *g, int gdt, int64_t R, int64_t C, int64_t b0, int64_t b1,
                        const float *rf, const float *cf, double *out) {
    am_kernels_ref.u2_mats(g, gdt, R, C, b0, b1, rf, cf, out);
}

static void vec_moments_mats(int64_t R, int64_t C, int64_t b0, int64_t b1, const float *row,
                             const float *col, const float *rs, const float *cs,
                             const am_consts *k, float *nr, float *nc, float *rf, float *cf,
                             float *rmean) {
    am_kernels_ref.moments_mats(R, C, b0, b1, row, col, rs, cs, k, nr, nc, rf, cf, rmean);
}

static void vec_stats_u2_mats(const void *g, int gdt, int64_t R, int64_t C, int64_t b0,
                              int64_t b1, const float *row, const float *col,
                              const am_consts *k, float *rs, float *cs, float *nr, float *nc,
                              float *rf, float *cf, float *rmean, double *out, float *fmin,
                              float *orow, float *ocol) {
    am_kernels_ref.stats_u2_mats(g, gdt, R, C, b0, b1, row, col, k, rs, cs, nr, nc, rf, cf,
                                 rmean, out, fmin, orow, ocol);
}

/* am_count_pos_tail from element 0 (bits from bit 0): the agreement of
 * g > 0 with the bits and the smallest g > 0, 8 elements (a byte of bits)
 * at a time. The int32 lanes hold at most AM_COUNT_CHUNK / 4 matches, then
 * go into the int64 count (an lr-row of 2^33 + 8 elements wrapped them: a
 * review, twenty-seventh session). */
#define AM_COUNT_CHUNK ((int64_t)1 << 28)
#define AM_VEC_COUNT(GDT)                                                     \
    for (e = e0; e < e1; e += 8) {                                            \
        v4i lo, hi;                                                           \
        bits8(bits[e >> 3], &lo, &hi);                                        \
        agree4(ld4(g, GDT, e), lo, &mc, &mv);                                 \
        agree4(ld4(g, GDT, e + 4), hi, &mc, &mv);                             \
    }

static int64_t vec_count_pos(const void *g, int gdt, int64_t n, const uint8_t *bits,
                             float *minpos) {
    const int64_t n8 = n & ~(int64_t)7;
    v4f mv = splatf(INFINITY);
    int64_t e = 0, e0, e1, matches = 0;
    for (e0 = 0; e0 < n8; e0 = e1) {
        v4i mc = {0, 0, 0, 0};
        e1 = n8 - e0 > AM_COUNT_CHUNK ? e0 + AM_COUNT_CHUNK : n8;
        switch (gdt) { /* the dtype a constant in each loop */
        case AM_DTYPE_FLOAT32: AM_VEC_COUNT(AM_DTYPE_FLOAT32); break;
        case AM_DTYPE_BFLOAT16: AM_VEC_COUNT(AM_DTYPE_BFLOAT16); break;
        default: AM_VEC_COUNT(AM_DTYPE_FLOAT16); break;
        }
        matches -= hsum4(mc);
    }
    return am_count_pos_tail(g, gdt, e, n, bits, matches, hmin4(mv, INFINITY), minpos);
}
#undef AM_VEC_COUNT
#undef AM_COUNT_CHUNK

static const am_kernels vec_table = {
    "portable",       vec_stats_tile, vec_u2_tile,      vec_u2_flat,
    vec_agree_rows,   vec_apply_rows, vec_finish_flat,  vec_stats_mats,
    vec_u2_mats,      vec_moments_mats, vec_stats_u2_mats, vec_count_pos,
};

const am_kernels *am_kernels_portable(void) { return &vec_table; }

#else /* a compiler without the vector extensions: the reference */

const am_kernels *am_kernels_portable(void) { return NULL; }

#endif
