/*
 * kernels_ref.c — the scalar reference kernels. Plain loops, no
 * processor-specific instructions, compiled without fast-math and without
 * floating-point contraction. They define the canonical order of every
 * reduction (see AM_LANES in internal.h): optimised kernels must reproduce
 * their bits exactly. Kept readable forever.
 */
#include "internal.h"

#include <string.h>

static int get_bit(const uint8_t *bits, int64_t q) {
    return (bits[q >> 3] >> (q & 7)) & 1;
}

static void put_bit(uint8_t *bits, int64_t q, int v) {
    uint8_t mask = (uint8_t)(1u << (q & 7));
    if (v) bits[q >> 3] = (uint8_t)(bits[q >> 3] | mask);
    else bits[q >> 3] = (uint8_t)(bits[q >> 3] & ~mask);
}

/* g_mat is (R, C); rowpart is [i1-i0], colpart is [j1-j0]. With pm: the
 * agreement of (g > 0) with the stored bits, per row, and the smallest
 * g > 0 (internal.h). With ws: the W sums, rows in groups of 4 as the SIMD
 * kernels take them (am_wsum). */
static void ref_stats_tile(const void *g_mat, int gdt, int64_t C, int64_t i0,
                           int64_t i1, int64_t j0, int64_t j1, float *rowpart,
                           float *colpart, const am_polmap *pm, int32_t *rowmatch,
                           float *minpos, const am_wsum *ws) {
    float mp = INFINITY, w[4];
    int64_t i, j;
    for (j = j0; j < j1; j++) colpart[j - j0] = 0.0f;
    if (ws)
        for (j = j0; j < j1; j++) ws->wpart[j - j0] = 0.0f;
    for (i = i0; i < i1; i++) {
        float acc[AM_LANES] = {0};
        int32_t match = 0;
        for (j = j0; j < j1; j++) {
            float x = am_load(g_mat, gdt, i * C + j);
            float x2 = x * x;
            acc[(j - j0) % AM_LANES] += x2;
            colpart[j - j0] += x2;
            if (pm) {
                match += (x > 0.0f) == get_bit(pm->bits, am_polmap_bit(pm, i, j));
                if (x > 0.0f && x < mp) mp = x;
            }
        }
        rowpart[i - i0] = am_lanesum_finish(acc);
        if (pm) rowmatch[i - i0] = match;
    }
    if (pm) *minpos = mp;
    if (!ws) return;
    for (i = i0; i < i1;) {
        int nq = i + 4 <= i1 ? 4 : 1, q;
        for (q = 0; q < nq; q++) w[q] = am_wsum_weight(ws, i + q, rowpart[i + q - i0]);
        am_wsum_cols(g_mat, gdt, C, i, nq, j0, j0, j1, w, ws->wpart);
        i += nq;
    }
}

/* u = (rf[i] * cf[j]) * g, as the reference's _approx_sq_grad(...).mul_(g). */
static double ref_u2_tile(const void *g_mat, int gdt, int64_t C, int64_t i0,
                          int64_t i1, int64_t j0, int64_t j1, const float *rf,
                          const float *cf) {
    double total = 0.0;
    int64_t i, j;
    for (i = i0; i < i1; i++) {
        float acc[AM_LANES] = {0};
        for (j = j0; j < j1; j++) {
            float u = (rf[i] * cf[j]) * am_load(g_mat, gdt, i * C + j);
            acc[(j - j0) % AM_LANES] += u * u;
        }
        total += (double)am_lanesum_finish(acc);
    }
    return total;
}

/* The sum of u*u, u = rsqrt(ema(sq, g*g) + eps) * g as the reference's
 * unfactored branch, each term by am_flat_u2. A new sq that overflows (g*g
 * past FLT_MAX) would give u = 0 and store inf in the state forever, and
 * one below -eps (a corrupt state) u = NaN (am_flat_bad); the sum is then
 * NaN, so that the update is skipped as AM_SKIPPED_NONFINITE_UPDATE like
 * the factored path skips it. */
static double ref_u2_flat(const void *g, int gdt, const float *sq, int64_t e0,
                          int64_t e1, const am_consts *k) {
    float acc[AM_LANES] = {0};
    int64_t e;
    int overflow = 0;
    for (e = e0; e < e1; e++) {
        float x = am_load(g, gdt, e);
        float v = am_ema(sq[e], x * x, k);
        overflow |= am_flat_bad(v, k->eps);
        acc[(e - e0) % AM_LANES] += am_flat_u2(x, v, k->eps);
    }
    return overflow ? (double)NAN : (double)am_lanesum_finish(acc);
}

/* Rows [r0, r1) of the (B*R, C) view; r = b*R + i indexes rf, b*C + j cf. */
static int64_t ref_agree_rows(const void *g, int gdt, int64_t R, int64_t C,
                              int64_t r0, int64_t r1, const float *rf,
                              const float *cf, float scale, uint8_t *pol_row) {
    int64_t r, j, matches = 0;
    for (r = r0; r < r1; r++) {
        const float *cfb = cf + (r / R) * C;
        for (j = 0; j < C; j++) {
            float u = ((rf[r] * cfb[j]) * am_load(g, gdt, r * C + j)) / scale;
            int pol = u > 0.0f;
            int64_t q = (r - r0) * C + j;
            matches += pol == get_bit(pol_row, q);
            put_bit(pol_row, q, pol);
        }
    }
    return matches;
}

static void ref_apply_rows(void *p, int pdt, const void *g, int gdt,
                           int64_t R, int64_t C, int64_t r0, int64_t r1,
                           const float *rf, const float *cf, float inv,
                           float lr, const float *lrs, const am_consts *k, uint64_t seed,
                           uint32_t param_id, int64_t step, int64_t noff, uint8_t *pol_row) {
    int64_t r, j;
    for (r = r0; r < r1; r++) {
        const float *cfb = cf + (r / R) * C;
        /* lrs: this row's lr and bits (internal.h) */
        const float lr_r = lrs ? lrs[r - r0] : lr;
        const int64_t q0 = lrs ? (r - r0) * am_lrs_row_bytes(C) * 8 : (r - r0) * C;
        for (j = 0; j < C; j++) {
            int pos = am_apply_one(p, pdt, g, gdt, r * C + j, rf[r] * cfb[j], inv, lr_r,
                                   k->wd, seed, param_id, step, noff);
            if (pol_row) put_bit(pol_row, q0 + j, pos);
        }
    }
}

static int64_t ref_finish_flat(void *p, int pdt, const void *g, int gdt,
                               float *sq, float *lr, uint8_t *pol, int64_t e0,
                               int64_t e1, float scale, const am_consts *k,
                               uint64_t seed, uint32_t param_id, int64_t step, int64_t noff) {
    const float inv = 1.0f / scale;
    int64_t e, matches = 0;
    for (e = e0; e < e1; e++) {
        float x = am_load(g, gdt, e);
        float v = am_ema(sq[e], x * x, k);
        float u = am_rsqrt(v + k->eps) * x; /* before the clip */
        int polv = u / scale > 0.0f;         /* SPEC 3.3's sign of u / scale */
        int match = polv == get_bit(pol, e);
        float w;
        uint32_t rnd = 0;
        sq[e] = v;
        matches += match;
        put_bit(pol, e, polv);
        if (step > 0) lr[e] = am_lr_scale(lr[e], match ? k->bump_up : k->bump_down, k);
        /* the clip as a multiplication, as am_apply_one */
        w = am_apply(am_load(p, pdt, e), u * inv, lr[e], k->wd);
        if (pdt != AM_DTYPE_FLOAT32)
            rnd = am_sr_noise(seed, param_id, step, e + noff, pdt, w);
        am_store_sr(p, pdt, e, w, rnd);
    }
    return matches;
}

/* The batched slots: loops over the per-matrix code above. */
static void ref_stats_mats(const void *g, int gdt, int64_t R, int64_t C,
                           int64_t b0, int64_t b1, float *rowsum,
                           float *colsum) {
    size_t es = am_dtype_size((am_dtype)gdt);
    int64_t b;
    for (b = b0; b < b1; b++)
        ref_stats_tile((const char *)g + (size_t)(b * R * C) * es, gdt, C, 0, R,
                       0, C, rowsum + b * R, colsum + b * C, NULL, NULL, NULL, NULL);
}

static void ref_u2_mats(const void *g, int gdt, int64_t R, int64_t C,
                        int64_t b0, int64_t b1, const float *rf,
                        const float *cf, double *out) {
    size_t es = am_dtype_size((am_dtype)gdt);
    int64_t b;
    for (b = b0; b < b1; b++)
        out[b - b0] = ref_u2_tile((const char *)g + (size_t)(b * R * C) * es,
                                  gdt, C, 0, R, 0, C, rf + b * R, cf + b * C);
}

/* SPEC 3.1 for one matrix: its old moments row[0..R), col[0..C), its sums
 * of squares rs, cs; the new moments nr, nc, factors rf, cf and *rmean. */
static void ref_moments_mat(int64_t R, int64_t C, const float *row, const float *col,
                            const float *rs, const float *cs, const am_consts *k, float *nr,
                            float *nc, float *rf, float *cf, float *rmean) {
    const float Cinv = am_inv_count(C), Rinv = am_inv_count(R);
    float s = 0.0f;
    int64_t i, j;
    for (i = 0; i < R; i++) {
        nr[i] = am_moment(row[i], rs[i], Cinv, k);
        s += nr[i];
    }
    *rmean = s * Rinv;
    for (i = 0; i < R; i++) rf[i] = am_row_factor(nr[i], *rmean);
    for (j = 0; j < C; j++) {
        nc[j] = am_moment(col[j], cs[j], Rinv, k);
        cf[j] = am_rsqrt(nc[j]);
    }
}

static void ref_moments_mats(int64_t R, int64_t C, int64_t b0, int64_t b1,
                             const float *row, const float *col,
                             const float *rs, const float *cs,
                             const am_consts *k, float *nr, float *nc,
                             float *rf, float *cf, float *rmean) {
    int64_t b;
    for (b = b0; b < b1; b++)
        ref_moments_mat(R, C, row + b * R, col + b * C, rs + b * R, cs + b * C, k, nr + b * R,
                        nc + b * C, rf + b * R, cf + b * C, rmean + b);
}

/* Matrix by matrix: its sums, moments and sum of u^2, with the bits of
 * the three slots. NULL rs, cs: the sums go to rf, cf, each read (into nr,
 * nc) before the factor at its place is written (ref_moments_mat). */
static void ref_stats_u2_mats(const void *g, int gdt, int64_t R, int64_t C, int64_t b0,
                              int64_t b1, const float *row, const float *col,
                              const am_consts *k, float *rs, float *cs, float *nr,
                              float *nc, float *rf, float *cf, float *rmean,
                              double *out, float *fmin, float *orow, float *ocol) {
    const size_t es = am_dtype_size((am_dtype)gdt);
    float lmean;
    int64_t b, x;
    if (orow) {
        memcpy(orow + b0 * R, row + b0 * R, (size_t)((b1 - b0) * R) * sizeof(float));
        memcpy(ocol + b0 * C, col + b0 * C, (size_t)((b1 - b0) * C) * sizeof(float));
    }
    for (b = b0; b < b1; b++) {
        const void *gm = (const char *)g + (size_t)(b * R * C) * es;
        float *mrs = (rs ? rs : rf) + b * R, *mcs = (cs ? cs : cf) + b * C;
        ref_stats_tile(gm, gdt, C, 0, R, 0, C, mrs, mcs, NULL, NULL, NULL, NULL);
        ref_moments_mat(R, C, row + b * R, col + b * C, mrs, mcs, k, nr + b * R, nc + b * C,
                        rf + b * R, cf + b * C, rmean ? rmean + b : &lmean);
        out[b - b0] = ref_u2_tile(gm, gdt, C, 0, R, 0, C, rf + b * R, cf + b * C);
    }
    fmin[0] = fmin[1] = INFINITY;
    for (x = b0 * R; x < b1 * R; x++)
        if (rf[x] < fmin[0]) fmin[0] = rf[x];
    for (x = b0 * C; x < b1 * C; x++)
        if (cf[x] < fmin[1]) fmin[1] = cf[x];
}

static int64_t ref_count_pos(const void *g, int gdt, int64_t n, const uint8_t *bits,
                             float *minpos) {
    return am_count_pos_tail(g, gdt, 0, n, bits, 0, INFINITY, minpos);
}

const am_kernels am_kernels_ref = {
    "scalar",         ref_stats_tile, ref_u2_tile,    ref_u2_flat,
    ref_agree_rows,   ref_apply_rows, ref_finish_flat, ref_stats_mats,
    ref_u2_mats,      ref_moments_mats, ref_stats_u2_mats, ref_count_pos,
};
