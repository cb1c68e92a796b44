/*
 * internal.h — what the library's C files share and nothing else sees:
 * the geometry of a parameter (lr-rows, factored matrices, the tile grid that
 * fixes the reduction order), the workspace layout, the kernel table, the
 * parallel-for seam and the error helpers.
 */
#ifndef AM_INTERNAL_H
#define AM_INTERNAL_H

#include "automagic.h"
#include "am_math.h"

#include <stddef.h>
#include <stdint.h>

/* ----------------------------------------------------------- errors ---- */

/* Logs through the user's callback (printf-style); no-op without one. */
void am_log(am_log_level level, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* am_log for a process-wide message (the kernel choice, a bad environment
 * variable): neither muted nor prefixed with the calling thread's item or
 * parameter (am_log_mute, am_log_item). */
void am_log_global(am_log_level level, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Mutes (on = 1) or unmutes am_log on the calling thread; returns the
 * previous setting. For a call whose failure the caller handles itself
 * (am_optimizer_update_all's batch, refused for shared memory, falls back
 * to one update at a time). */
int am_log_mute(int on);

/* Names the item (index >= 0; -1: none) that the calling thread's next
 * messages are about: am_log prefixes them "<fn>: item <index>: " (fn a
 * string literal). The batch's checks run am_update's, whose messages did
 * not say which item they meant. */
void am_log_item(const char *fn, int64_t index);
/* The same for a registered parameter: "<fn>: parameter <id>: " (the
 * optimizer's updates run am_update, whose messages named neither the
 * function called nor the parameter). */
void am_log_param(const char *fn, int64_t id);

/* Returns status err with a message naming the problem when cond holds. */
#define AM_RETURN_IF(cond, err, ...)                                          \
    do {                                                                      \
        if (cond) {                                                           \
            am_log(AM_LOG_ERROR, __VA_ARGS__);                                \
            return (err);                                                     \
        }                                                                     \
    } while (0)

#define AM_CHECK(expr)                                                        \
    do {                                                                      \
        am_status am_check_s_ = (expr);                                       \
        if (am_status_is_error(am_check_s_)) return am_check_s_;              \
    } while (0)

/* --------------------------------------------------------- geometry ---- */

/* Fixed reduction blocking. The order of every floating-point reduction is a
 * function of the shape only (never of threads or SIMD width), so every path
 * gives the same bits. Changing these changes results: they are part of the
 * format of the computation. */
#define AM_LANES 8           /* lane sums: element j goes to lane j % 8 */
#define AM_COL_BLOCK 16384   /* columns per tile */
#define AM_ROW_BLOCK_MIN 64  /* rows per tile: max(64, ceil(R / 64)) */
#define AM_FLAT_CHUNK 16384  /* elements per tile when ndim <= 1 */

/* The most elements, counting nonzero dims only, a shape may describe (a
 * bound that keeps every derived size representable; am_geom_init). */
#define AM_MAX_NUMEL ((int64_t)1 << 56)

typedef struct am_geom {
    int32_t ndim;
    int64_t numel;
    int64_t lr_rows;      /* dims[0] (ndim >= 2) or numel */
    int64_t m;            /* elements per lr-row (1 when ndim <= 1) */
    int64_t B, R, C;      /* factored view (*B, R, C); ndim >= 2 */
    int64_t RB, nrb;      /* rows per tile, row blocks */
    int64_t CB, ncb;      /* cols per tile, col blocks */
    int64_t ntiles;       /* B*nrb*ncb, or ceil(numel / AM_FLAT_CHUNK) */
    int64_t pol_row_bytes;/* bytes of polarity per lr-row (ndim >= 2) */
    am_state_sizes sizes;
    /* workspace layout: byte offsets from the 64-aligned base */
    size_t off_row_sumsq, off_col_sumsq, off_rowpart, off_colpart;
    size_t off_new_row, off_new_col, off_rf, off_cf, off_rmean;
    size_t off_tile_u2, off_tile_count, off_agree;
    size_t off_rowmatch, off_tile_minpos; /* agreement counted in pass 1 */
    /* The sum of u*u from pass 1 (am_wsum below): when wsum is set, the
     * tiles' row-weighted column sums [nrb][B*C] (float) and the new row
     * moments pass 1 weighted with [B*R]. */
    int batched; /* many small matrices (R*C <= AM_MATS_MAX_ELEMS, each one
                  * tile): the batched kernel slots (update.c) */
    int wsum;
    size_t off_wpart, off_wnr;
} am_geom;

/* Fills g from shape; AM_ERR_NULL_POINTER / AM_ERR_INVALID_SHAPE, the
 * message naming the shape "shape" (am_geom_init) or what (e.g. "param
 * shape": am_update takes two shapes). */
am_status am_geom_init(const am_shape *shape, am_geom *g);
am_status am_geom_init_as(const am_shape *shape, am_geom *g, const char *what);

/* AM_ERR_INVALID_ARGUMENT, the message naming what ("param data",
 * "state.lr"), when p is not a multiple of align bytes (the element's size:
 * a misaligned float is undefined behaviour in C and a fault on a GPU; it
 * was accepted and read anyway, found by a review, twenty-fifth session);
 * AM_OK otherwise, NULL included. */
am_status am_check_aligned(const void *p, size_t align, const char *what);

/* am_check_aligned of a state's float arrays (lr, row, col, sq), prefix
 * naming the caller ("" or "am_update_cuda: "). */
am_status am_check_state_aligned(const am_state *s, const char *prefix);

/* The header at the start of the workspace. */
typedef struct am_ws_header {
    double u2_sum;
    int64_t nonfinite;
    int64_t stage;      /* AM_STAGE_*: guards against phases out of order */
    int64_t numel;      /* shape check between phases */
    int64_t counted;    /* 1: stats counted the agreement (rowmatch) */
    int64_t wsummed;    /* 1: stats filled the am_wsum sums (wpart, wnr) */
    int64_t ndim;       /* the shape stats ran on: checked by the later */
    int64_t dims[AM_MAX_DIMS]; /* phases (the same numel is not enough) */
    int64_t dim0_total; /* am_update_stats_shard: the whole dims[0]; else 0 */
    int64_t noise_off;  /* its first element's index in the whole; else 0 */
    double row_moment_sum; /* 2-D shard: sum of its new row moments */
} am_ws_header;

enum { AM_STAGE_NONE = 0, AM_STAGE_STATS = 0x5157A7, AM_STAGE_MOMENTS = 0x5157A8 };

/* The workspace base aligned up to 64 bytes, or NULL if the buffer is too
 * small for g. */
unsigned char *am_ws_base(const am_geom *g, void *ws, size_t bytes);

/* Where the polarity bit of element (i, j) of one matrix lives: lr-rows
 * start on a byte, and an lr-row holds rows_per_lr whole matrix rows. */
typedef struct am_polmap {
    const uint8_t *bits;  /* the tensor's polarity */
    int64_t r0;           /* global row index (b*R) of the matrix's row 0 */
    int64_t rows_per_lr;  /* matrix rows per lr-row (m / C) */
    int64_t lr_bits;      /* 8 * pol_row_bytes */
    int64_t C;
} am_polmap;

/* Bit index of element (i, j) of the matrix. */
static inline int64_t am_polmap_bit(const am_polmap *pm, int64_t i, int64_t j) {
    int64_t r = pm->r0 + i, kr = r / pm->rows_per_lr;
    return kr * pm->lr_bits + (r - kr * pm->rows_per_lr) * pm->C + j;
}

/* The sum of u*u without a pass of its own. With u = (rf[i] * cf[j]) * g
 * and rf[i]^2 = rmean / nr[i] (SPEC 3.1), the sum over a matrix is
 *   sum_ij u^2 = rmean * sum_j cf[j]^2 * W[j],  W[j] = sum_i g[i,j]^2 / nr[i],
 * and W needs only the new row moments nr, which pass 1 (stats) knows as
 * soon as a row's sum of squares is complete: when a tile holds whole rows
 * (ncb == 1), stats computes nr[i] and w[i] = 1 / nr[i] for each row and
 * adds the row's (g*g) * w[i] to the tile's W sums, reading the row again
 * from the cache instead of from memory in a pass of its own. The result is
 * the SPEC's sum within float32 rounding (rf^2 is not exactly rmean / nr),
 * the same on every path because its order is fixed here:
 *   - a tile's sums wpart[j] (float, from 0): its rows from i0 in groups
 *     of 4 while 4 remain, each group adding ((t0 + t1) + t2) + t3,
 *     t = (g * g) * w[i]; then each remaining row alone, adding t;
 *   - W[b, j] = (double) wpart of row block 0, + (double) wpart of row
 *     block 1, ... (ascending);
 *   - per matrix b, column blocks of AM_WSUM_JBLOCK: S = (S0 + S1) + (S2 +
 *     S3), Sq = sum over the block's j with (j - block start) % 4 == q,
 *     ascending (from 0.0), of ((double) cf * (double) cf) * W (four chains
 *     of adds, not one: one waited on each add, 10% of a (16, 1024)
 *     update); T_b = sum of
 *     its blocks' S ascending (from 0.0); u2 = sum over b ascending (from
 *     0.0) of (double) rmean[b] * T_b.
 * update.c (and the CUDA plan) use it only when am_wsum_usable holds, and
 * otherwise run the pass over g as before, so the update is skipped exactly
 * when that pass would skip it (its sums overflow). */
#define AM_WSUM_JBLOCK 64

typedef struct am_wsum {
    const float *row_old; /* the state's row moments of the tile's matrix, by i */
    float *nr;            /* out: the new row moments, by i */
    float *wpart;         /* out: [j1 - j0], the tile's sums */
    const am_consts *k;
    float Cinv;           /* am_inv_count(C) */
} am_wsum;

/* Row i's new moment (as moments_mats: am_moment), stored in ws->nr[i];
 * returns its weight 1 / nr. */
static inline float am_wsum_weight(const am_wsum *ws, int64_t i, float rs) {
    float nr = am_moment(ws->row_old[i], rs, ws->Cinv, ws->k);
    ws->nr[i] = nr;
    return 1.0f / nr;
}

/* Columns [ja, jb) of the group of nq rows (4 or 1) from row i (tile
 * columns from j0), in the order above. */
static inline void am_wsum_cols(const void *g, int gdt, int64_t C, int64_t i, int nq,
                                int64_t j0, int64_t ja, int64_t jb, const float *w,
                                float *wpart) {
    int64_t j;
    int q;
    for (j = ja; j < jb; j++) {
        float x = am_load(g, gdt, i * C + j), s = (x * x) * w[0];
        for (q = 1; q < nq; q++) {
            x = am_load(g, gdt, (i + q) * C + j);
            s += (x * x) * w[q];
        }
        wpart[j - j0] += s;
    }
}

/* S of columns [y0, y1) of the (B*C) vectors, y1 - y0 <= AM_WSUM_JBLOCK: W
 * combined over the nrb row blocks' parts (stride BC) and weighted by cf^2. */
AM_HD double am_wsum_block(const float *wpart, int64_t nrb, int64_t BC, const float *cf,
                           int64_t y0, int64_t y1) {
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0, w[AM_WSUM_JBLOCK];
    int64_t y, p, n = y1 - y0;
    /* W[y] row block by row block (each y's order as above), so that the
     * parts are read along their rows, not down their columns */
    for (y = 0; y < n; y++) w[y] = (double)wpart[y0 + y];
    for (p = 1; p < nrb; p++)
        for (y = 0; y < n; y++) w[y] += (double)wpart[p * BC + y0 + y];
    for (y = 0; y + 4 <= n; y += 4) { /* four named chains: an array indexed
                                        * by y % 4 went through memory */
        const double c0 = (double)cf[y0 + y], c1 = (double)cf[y0 + y + 1];
        const double c2 = (double)cf[y0 + y + 2], c3 = (double)cf[y0 + y + 3];
        s0 += (c0 * c0) * w[y];
        s1 += (c1 * c1) * w[y + 1];
        s2 += (c2 * c2) * w[y + 2];
        s3 += (c3 * c3) * w[y + 3];
    }
    for (; y < n; y++) {
        const double c = (double)cf[y0 + y];
        const double t = (c * c) * w[y];
        if ((y & 3) == 0) s0 += t;
        else if ((y & 3) == 1) s1 += t;
        else s2 += t;
    }
    return (s0 + s1) + (s2 + s3);
}

/* A factor at or above this (or NaN) sends the sum to the pass over g. */
#define AM_WSUM_FAC_MAX 1152921504606846976.0f /* 2^60 */
/* A sum at or above this (or not finite) does too. */
#define AM_WSUM_U2_MAX 1267650600228229401496703205376.0 /* 2^100 */

/* Whether the u2 from the W sums can stand for the pass's, given the
 * largest row factor and column factor of the update (rf_max, cf_max), the
 * largest of those rows and columns whose float32 sum of g*g is not 0
 * (rfnz_max, cfnz_max), the largest row-moment mean (rmean_max; NaN where
 * one is NaN), numel, and zero_nz: whether a row or column whose sum of g*g
 * is 0 holds a nonzero gradient element:
 *   - u2 finite and below 2^100, and every factor below 2^60: then every
 *     u*u is about its share of u2 and rf * cf < 2^120, so no operation of
 *     the pass overflows and it would not have skipped the update either;
 *   - and what the W sums can lose is below float32 rounding of u2. A term
 *     (g*g) * w, w = 1 / nr = rf^2 / rmean, loses up to 2^-150 absolute
 *     where g*g or the term is subnormal, as do the float sums: at most
 *     3 * 2^-150 * (w + 1) per element, times rmean * cf^2 in u2. An exact
 *     0 loses nothing, so rows and columns whose elements are all 0 do not
 *     count, and those whose sum of squares is 0 are all 0 unless zero_nz;
 *     the rest lose at most numel * 2^-148 * (rfnz_max^2 + rmean_max) *
 *     cfnz_max^2. A gradient element below 2^-63 (its square subnormal or
 *     0) whose row and column moments are tiny has a huge u that the W sums
 *     left out: its u2 came out of the clip and the update was millions of
 *     times too large (g = [[1, 1e-23], [1e-23, 1e-23]]: clip 15.8 instead
 *     of 7.9e7; found by a randomized review, twenty-fifth session). The
 *     pass over g runs then. (The first version of this check bounded with
 *     every row and column, so a gradient with an all-zero row and an
 *     all-zero column, dead units on both sides, took the pass at every
 *     step: 17-41% slower updates, found by a review the same session.)
 * Maxima and zero tests are exact whatever the order, so every path decides
 * alike. */
AM_HD int am_wsum_usable(double u2, float rf_max, float cf_max, float rfnz_max,
                         float cfnz_max, float rmean_max, int64_t numel, int zero_nz) {
    double lost;
    if (!(rf_max < AM_WSUM_FAC_MAX && cf_max < AM_WSUM_FAC_MAX)) return 0;
    if (!(u2 >= 0.0 && u2 < AM_WSUM_U2_MAX) || zero_nz) return 0;
    lost = (double)numel * 0x1p-148 *
           ((double)rfnz_max * (double)rfnz_max + (double)rmean_max) *
           ((double)cfnz_max * (double)cfnz_max);
    return lost <= u2 * 0x1p-24;
}

/* count_pos (the kernel slot below) over elements e..n-1 one by one, given
 * the matches m and smallest positive value mp of elements 0..e-1 (the
 * scalar reference: e = 0; a SIMD version: its vector part); returns the
 * matches, the smallest positive value in *minpos. */
static inline int64_t am_count_pos_tail(const void *g, int gdt, int64_t e, int64_t n,
                                        const uint8_t *bits, int64_t m, float mp,
                                        float *minpos) {
    for (; e < n; e++) {
        const float x = am_load(g, gdt, e);
        const int pos = x > 0.0f;
        m += pos == ((bits[e >> 3] >> (e & 7)) & 1);
        if (pos && x < mp) mp = x;
    }
    *minpos = mp;
    return m;
}

/* ------------------------------------------------------ kernel table ---- */

/* The per-tile work of an update. Every slot always holds a valid function:
 * the table is filled with the scalar reference first, then optimised
 * kernels override the slots they implement (am_kernels_init). An override
 * must return bit-identical results. g/p point at element 0 of the tensor;
 * dtypes are am_dtype values. */
/* Polarity bytes of one matrix row of C elements that is an lr-row of its
 * own (the apply_rows slot's lrs mode below): whole bytes per row. */
static inline int64_t am_lrs_row_bytes(int64_t C) { return (C + 7) / 8; }

/* float32 matrices whose rows are at least this long reach the apply_rows
 * slot in blocks of rows with an lr each (lrs mode; update.c,
 * finish_short_rows_task), which the AVX-512 apply runs four rows at a
 * time (all of them on Zen 4, those longer than 4096 on Zen 5:
 * one_row_apply_max, kernels_avx512.c): each column factor loaded once for four rows
 * (docs/PERFORMANCE_HISTORY.md, seventeenth and twentieth sessions). */
#define AM_LONG_ROW_MIN 3072

typedef struct am_kernels {
    const char *name;

    /* Factored stats for one tile of matrix b (rows [i0,i1), cols [j0,j1)),
     * g_mat pointing at that matrix's element (0,0), C its row length:
     * rowpart[i-i0] = lanesum(g[i,j0:j1]^2); colpart[j-j0] = sum over i
     * ascending of g[i,j]^2. When pm is not NULL the tile also counts the
     * agreement of the gradient's sign with the stored polarity:
     * rowmatch[i-i0] = #{j in [j0,j1) : (g > 0) == old bit of (i, j)}, and
     * *minpos = the smallest g > 0 of the tile (+inf when none), from which
     * finish tells whether (g > 0) is the SPEC's (u / scale > 0) for every
     * element (update.c, counts_valid). When ws is not NULL the tile also
     * fills ws->nr and ws->wpart (am_wsum above) from its rows' sums. */
    void (*stats_tile)(const void *g_mat, int gdt, int64_t C, int64_t i0,
                       int64_t i1, int64_t j0, int64_t j1, float *rowpart,
                       float *colpart, const struct am_polmap *pm,
                       int32_t *rowmatch, float *minpos, const am_wsum *ws);

    /* Sum of u^2 over one tile, u = (rf[i]*cf[j]) * g: over rows ascending,
     * (double) lanesum over the row's columns. rf/cf are the matrix's
     * factors (indexed by i and j). */
    double (*u2_tile)(const void *g_mat, int gdt, int64_t C, int64_t i0,
                      int64_t i1, int64_t j0, int64_t j1, const float *rf,
                      const float *cf);

    /* Unfactored (ndim <= 1) sum of u^2 over elements [e0, e1):
     * (double) lanesum of u^2, u = rsqrt(ema(sq, g*g) + eps) * g; NaN when
     * a new ema(sq, g*g) is not finite (the update is then skipped). */
    double (*u2_flat)(const void *g, int gdt, const float *sq, int64_t e0,
                      int64_t e1, const am_consts *k);

    /* Agreement of one lr-row of a factored parameter: its elements are
     * matrix rows [r0, r1) (global row index r = b*R + i); compares
     * pol = (u/scale > 0) with the stored bits starting at pol_row (bit 0 is
     * the lr-row's first element), writes the new bits, returns matches. */
    int64_t (*agree_rows)(const void *g, int gdt, int64_t R, int64_t C,
                          int64_t r0, int64_t r1, const float *rf,
                          const float *cf, float scale, uint8_t *pol_row);

    /* Applies p -= lr*(u*inv + wd*p) over matrix rows [r0, r1) of one
     * lr-row, inv = 1 / clip scale (am_apply_one), stochastic rounding keyed
     * by flat element index plus noff (the whole parameter's index of a
     * shard's first element: am_update_stats_shard; else 0). When pol_row
     * is not NULL it also writes the new polarity bits (u*inv > 0) there,
     * bit 0 being element (r0, 0).
     * lrs: NULL, or each matrix row r is an lr-row of its own with lr
     * lrs[r - r0] (lr unused), its bits from byte (r - r0) *
     * am_lrs_row_bytes(C) of pol_row on (many short lr-rows in one call: run_finish). */
    void (*apply_rows)(void *p, int pdt, const void *g, int gdt, int64_t R,
                       int64_t C, int64_t r0, int64_t r1, const float *rf,
                       const float *cf, float inv, float lr, const float *lrs,
                       const am_consts *k, uint64_t seed, uint32_t param_id,
                       int64_t step, int64_t noff, uint8_t *pol_row);

    /* Unfactored finish over elements [e0, e1) (e0 % 8 == 0): new sq,
     * polarity, per-element lr (bumped when step > 0 by up/down factor
     * semantics of am_lr_bump), parameter (noise keyed as apply_rows').
     * Returns matches. */
    int64_t (*finish_flat)(void *p, int pdt, const void *g, int gdt,
                           float *sq, float *lr, uint8_t *pol, int64_t e0,
                           int64_t e1, float scale, const am_consts *k,
                           uint64_t seed, uint32_t param_id, int64_t step, int64_t noff);

    /* Batched slots for many small matrices (e.g. 65536 3x3 matrices of a
     * (256, 256, 3, 3) conv weight), where per-matrix calls cost more than
     * the work. Each is defined as its per-matrix loop over matrices
     * [b0, b1) of the (B, R, C) view (the reference does exactly that), so
     * batching changes no bit. g points at element 0 of the tensor; every
     * float array is tensor-wide (indexed by b*R + i or b*C + j).
     *
     * stats_mats: for matrices whose only tile is the whole matrix
     * (nrb == ncb == 1): stats_tile(matrix b, 0, R, 0, C, rowsum + b*R,
     * colsum + b*C). */
    void (*stats_mats)(const void *g, int gdt, int64_t R, int64_t C,
                       int64_t b0, int64_t b1, float *rowsum, float *colsum);

    /* u2_mats: out[b - b0] = u2_tile(matrix b, 0, R, 0, C, rf + b*R,
     * cf + b*C), same tiling condition as stats_mats. */
    void (*u2_mats)(const void *g, int gdt, int64_t R, int64_t C, int64_t b0,
                    int64_t b1, const float *rf, const float *cf, double *out);

    /* moments_mats: the new second moments and factors of matrices
     * [b0, b1) from the row/col sums of g^2 (rs, cs) and the old moments
     * (row, col), SPEC 3.1 as am_math.h forms it: nr = am_moment(row, rs,
     * 1/C), rmean[b] = (sum over i ascending of nr) * (1/R), rf =
     * am_row_factor(nr, rmean) (sqrt(rmean / nr)), nc = am_moment(col, cs,
     * 1/R), cf = am_rsqrt(nc). */
    void (*moments_mats)(int64_t R, int64_t C, int64_t b0, int64_t b1,
                         const float *row, const float *col, const float *rs,
                         const float *cs, const am_consts *k, float *nr,
                         float *nc, float *rf, float *cf, float *rmean);

    /* stats_u2_mats: stats_mats (into rs, cs), then moments_mats from those
     * sums, then u2_mats (into out[b - b0]) over matrices [b0, b1), with
     * their bits; am_update runs it instead of the three when no engine
     * works between the phases (the elements are read once for all three).
     * fmin[0], fmin[1]: the smallest rf and cf of the range (a NaN factor
     * may be passed over: it makes u^2 NaN, and the update is skipped).
     * nr may be row and nc col (the new moments written over the old);
     * orow and ocol, when not NULL, first receive the old ones (b*R + i,
     * b*C + j as row and col). rs, cs and rmean may be NULL: not written
     * (am_update reads none of them). */
    void (*stats_u2_mats)(const void *g, int gdt, int64_t R, int64_t C, int64_t b0,
                          int64_t b1, const float *row, const float *col,
                          const am_consts *k, float *rs, float *cs, float *nr,
                          float *nc, float *rf, float *cf, float *rmean, double *out,
                          float *fmin, float *orow, float *ocol);

    /* count_pos: how many of (g[e] > 0), e < n, equal the stored bits
     * 0..n-1 of bits (bit 0 of byte 0 first; only read), and in *minpos
     * the smallest g > 0 (+inf when none): the agreement of an lr-row of
     * many small matrices when a bound (finish_lr_row in update.c)
     * shows that u / scale has the sign of g there. */
    int64_t (*count_pos)(const void *g, int gdt, int64_t n, const uint8_t *bits,
                         float *minpos);
} am_kernels;

/* Matrices of at most this many elements (R*C) take the batched path
 * (stats_mats, u2_mats) in update.c; bigger ones are tiled per matrix. */
#define AM_MATS_MAX_ELEMS 64

/* The scalar reference table (always available). */
extern const am_kernels am_kernels_ref;
/* The table in use; chosen once, thread-safely, on first call. */
const am_kernels *am_kernels_get(void);

/* Lane combine of an 8-lane sum: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)),
 * the order an AVX 256-bit horizontal add produces. The canonical combine
 * of every path; inline, since the kernels call it once per row (a call
 * per row of 16 elements was 10% of a (1024, 16) update). */
static inline float am_lanesum_finish(const float a[AM_LANES]) {
    float s04 = a[0] + a[4], s26 = a[2] + a[6];
    float s15 = a[1] + a[5], s37 = a[3] + a[7];
    return (s04 + s26) + (s15 + s37);
}

/* -------------------------------------------------------- parallel ---- */

/* Runs fn(ctx, t) for every t in [0, ntasks). Tasks must write disjoint
 * memory. Serial or threaded depending on am_set_num_threads; the result of
 * the program must not depend on which. cost_per_task: approximate bytes
 * touched per task, to decide whether threads are worth it. */
typedef void (*am_task_fn)(void *ctx, int64_t task);
void am_parallel_for(int64_t ntasks, double cost_per_task, am_task_fn fn,
                     void *ctx);

/* Marks the object holding the library's code not unloadable (the pool's
 * workers run it between jobs; src/pin_self.c). */
void am_pin_self(void);

/* 1 makes every am_parallel_for of the calling thread run serially until
 * it is set back to 0 (am_update_batch's tasks, each one update on one
 * thread). Returns the previous setting. */
int am_set_thread_serial(int on);

/* AM_ERR_INVALID_ARGUMENT, naming the two, when two of the buffers an
 * update writes (the parameter, the state's arrays) share memory, or the
 * gradient shares memory with the state: the update would read what it
 * has just written (found by a review, thirty-second session: a trainer's
 * arena with a wrong offset was updated silently). A gradient overlapping
 * its own parameter is left undefined (the header), not looked for; with
 * zero elements nothing is read or written: AM_OK. sz: the shape's sizes;
 * the pointers of the arrays the shape needs are not NULL. */
am_status am_check_buffers(const am_state_sizes *sz, const am_tensor *param,
                           const am_tensor *grad, const am_state *state);

/* am_update's argument checks without the workspace: AM_OK and the
 * workspace size in *workspace_bytes, or the error am_update would
 * return (with its message). Modifies nothing. */
am_status am_update_check(const am_tensor *param, const am_tensor *grad,
                          const am_state *state, const am_hparams *hp,
                          int64_t *workspace_bytes);

/* Derived float32 constants of hp. */
am_consts am_consts_from(const am_hparams *hp);

#endif /* AM_INTERNAL_H */
