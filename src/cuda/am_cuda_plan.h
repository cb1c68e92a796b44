/*
 * am_cuda_plan.h — the CUDA update as a sequence of data-parallel "kernels",
 * each a per-thread body that is plain C11 and CUDA C++ at once.
 *
 * Why this shape: the same bodies run on the GPU (update_cuda.cu wraps each
 * in a __global__ grid-stride loop) and on the CPU (tests/c/test_cuda_emul.c
 * runs every body in a host loop, in the same order, and compares the result
 * bit for bit with am_update()). So the indexing, the reduction order and the
 * per-element math of the CUDA path are checked in every CI run, on machines
 * without a GPU. What the host emulation cannot check is CUDA itself (warp
 * shuffles, launch limits, device memory): that is scripts/gpu_check.sh.
 *
 * Reduction order = the canonical order of kernels_ref.c / internal.h, so the
 * GPU result is bit-identical to the CPU's (SPEC 5):
 *   - row sums of g*g (and of u*u): per (row, column block of AM_COL_BLOCK),
 *     8 lane chains (element j goes to lane (j - j0) % 8, each lane summed in
 *     ascending j), combined as am_lanesum_finish; column blocks combined in
 *     ascending order.
 *   - column sums of g*g: per (row block, column), ascending rows from 0.0f;
 *     row blocks combined in ascending order.
 *   - u*u: when the tiles hold whole rows, from the W sums (am_wsum in
 *     internal.h: per (row block, column) a float chain over the rows in
 *     groups of 4, per (matrix, block of AM_WSUM_JBLOCK columns) a double
 *     chain, then one chain over those); otherwise, or when am_wsum_usable
 *     fails, per tile (b, row block, col block) the double sum over its
 *     rows ascending of the (double) lane sums, tiles summed in ascending
 *     order.
 *   - the mean of the new row moments: one ascending float chain per matrix b.
 *   - polarity matches: integers (order-free; atomics on integers only).
 * No float is ever accumulated with an atomic, so results are run-to-run and
 * launch-geometry independent.
 *
 * Everything a step needs lives in the caller's state and workspace; the
 * state is written only by the last kernels, and only when the device-side
 * status is AM_OK, so a skipped update leaves it untouched without the host
 * ever looking at the status (no synchronisation: CUDA-graph capturable).
 */
#ifndef AM_CUDA_PLAN_H
#define AM_CUDA_PLAN_H

#include "internal.h"

/* ------------------------------------------------------- workspace ----- */

/* Device-side header at the start of the (256-aligned) workspace. */
typedef struct am_cuda_ws_header {
    double u2_sum;                /* sum of u*u before clipping */
    unsigned long long nonfinite; /* non-finite gradient elements */
    unsigned long long matches;   /* polarity matches, whole tensor */
    float scale;                  /* clip divisor of SPEC 3.2 (>= 1) */
    int32_t status;               /* am_status of this update */
    int32_t flag;                 /* nonzero: count the non-finite elements */
    uint32_t rf_max, cf_max;      /* the largest row and column factors' bits */
    uint32_t rfnz_max, cfnz_max;  /* the same over rows/columns whose g*g sum is not 0 */
    int32_t zero_nz;              /* such a row/column with a zero sum holds a nonzero g */
    uint32_t rmean_max;           /* the largest row-moment mean's bits (all >= 0:
                                   * their bits order as they do; NaN's above inf) */
    int32_t u2_pass;              /* the W sums cannot give u2: the lanes do */
} am_cuda_ws_header;

#define AM_CUDA_ALIGN 256

/* Workspace offsets (bytes from the aligned base) for one parameter. */
typedef struct am_cuda_layout {
    size_t row_sumsq, col_sumsq, rowpart, colpart, new_row, new_col;
    size_t rf, cf, rmean, agree, rowu2, tile_u2, group_u2, row_matches, wrow, wpart, wblock;
    size_t total; /* bytes the caller must provide (alignment slack included) */
} am_cuda_layout;

static inline size_t am_cuda_take(size_t *cur, int64_t n, size_t sz) {
    size_t off = *cur;
    *cur += ((size_t)n * sz + (AM_CUDA_ALIGN - 1)) & ~(size_t)(AM_CUDA_ALIGN - 1);
    return off;
}

/* Groups of AM_SUM_GROUP tiles summed by AM_CK_GROUP_U2; 0 when the tiles
 * are summed in one chain (at most one group). */
AM_HD int64_t am_ck_ngroups(int64_t ntiles) {
    return ntiles > AM_SUM_GROUP ? (ntiles + AM_SUM_GROUP - 1) / AM_SUM_GROUP : 0;
}

/* Column blocks of AM_WSUM_JBLOCK in a row of C. */
AM_HD int64_t am_ck_njb(int64_t C) { return (C + AM_WSUM_JBLOCK - 1) / AM_WSUM_JBLOCK; }

static inline am_cuda_layout am_cuda_layout_of(const am_geom *g) {
    am_cuda_layout L;
    size_t cur = AM_CUDA_ALIGN; /* the header */
    memset(&L, 0, sizeof L);
    if (g->ndim >= 2) {
        int64_t BR = g->B * g->R, BC = g->B * g->C;
        L.row_sumsq = am_cuda_take(&cur, BR, sizeof(float));
        L.col_sumsq = am_cuda_take(&cur, BC, sizeof(float));
        L.rowpart = am_cuda_take(&cur, g->ncb > 1 ? g->ncb * BR : 0, sizeof(float));
        L.colpart = am_cuda_take(&cur, g->nrb > 1 ? g->nrb * BC : 0, sizeof(float));
        L.new_row = am_cuda_take(&cur, BR, sizeof(float));
        L.new_col = am_cuda_take(&cur, BC, sizeof(float));
        L.rf = am_cuda_take(&cur, BR, sizeof(float));
        L.cf = am_cuda_take(&cur, BC, sizeof(float));
        L.rmean = am_cuda_take(&cur, g->B, sizeof(float));
        L.agree = am_cuda_take(&cur, g->lr_rows, sizeof(float));
        L.rowu2 = am_cuda_take(&cur, g->ncb * BR, sizeof(double));
        L.tile_u2 = am_cuda_take(&cur, g->ntiles, sizeof(double));
        L.group_u2 = am_cuda_take(&cur, am_ck_ngroups(g->ntiles), sizeof(double));
        L.row_matches = am_cuda_take(&cur, g->lr_rows, sizeof(unsigned long long));
        L.wrow = am_cuda_take(&cur, g->wsum ? BR : 0, sizeof(float));
        L.wpart = am_cuda_take(&cur, g->wsum ? g->nrb * BC : 0, sizeof(float));
        L.wblock = am_cuda_take(&cur, g->wsum ? g->B * am_ck_njb(g->C) : 0, sizeof(double));
    } else {
        L.tile_u2 = am_cuda_take(&cur, g->ntiles, sizeof(double));
        L.group_u2 = am_cuda_take(&cur, am_ck_ngroups(g->ntiles), sizeof(double));
    }
    L.total = cur + AM_CUDA_ALIGN; /* the caller's pointer need not be aligned */
    return L;
}

/* --------------------------------------------------------- arguments --- */

/* lr-rows of AM_CK_FUSE_MIN..AM_CK_FUSE_MAX elements are finished one per
 * block (AM_CK_ROW_FINISH): the row's gradient, read twice, stays in L1/L2
 * between the reads (8192 float32 = 32 KiB; a thousand such blocks in flight
 * fit an H200's L2), and shorter rows would leave most of a block idle.
 * Tuning choices, not format ones: results do not depend on them. */
#define AM_CK_FUSE_MIN 512
#define AM_CK_FUSE_MAX 8192

/* Everything every kernel reads, passed by value to each launch. Pointers
 * are device pointers on the GPU, host pointers in the emulation. */
typedef struct am_ck_args {
    void *p;              /* parameter, dtype pdt, numel elements */
    const void *g;        /* gradient, dtype gdt */
    float *lr;            /* [lr_rows] */
    uint8_t *pol;         /* [lr_rows * pol_row_bytes] or [ceil(numel/8)] */
    float *row, *col;     /* [B*R], [B*C] (factored) */
    float *sq;            /* [numel] (unfactored) */
    int64_t *step;        /* [1] the parameter's step, incremented on AM_OK */
    am_report *report;    /* [1] or NULL */
    am_cuda_ws_header *h;
    float *row_sumsq, *col_sumsq, *rowpart, *colpart, *new_row, *new_col;
    float *rf, *cf, *rmean, *agree;
    double *rowu2, *tile_u2;
    double *group_u2;     /* [ngroups] sums of AM_SUM_GROUP tiles (GROUP_U2) */
    int64_t ngroups;      /* am_ck_ngroups(ntiles) */
    unsigned long long *row_matches;
    float *wrow;          /* [B*R] the rows' weights 1 / nr (wsum) */
    float *wpart;         /* [nrb * B*C] the W sums of the tiles (wsum) */
    double *wblock;       /* [B * njb] their weighted column-block sums */
    int64_t njb;          /* column blocks of AM_WSUM_JBLOCK */
    int32_t wsum;         /* u2 from the W sums unless u2_pass (am_wsum) */
    int64_t numel, lr_rows, m, B, R, C, RB, nrb, ncb, ntiles, pol_row_bytes;
    int32_t ndim, pdt, gdt;
    int32_t fuse_rows;    /* ROW_FINISH instead of AGREE, BUMP, APPLY */
    uint32_t param_id;
    uint64_t seed;
    am_consts k;
} am_ck_args;

/* Kernel ids, in the order the plan launches them. */
enum {
    AM_CK_INIT = 0,        /* zero the header and per-lr-row counters */
    AM_CK_LANES_G2,        /* row lane sums of g*g       (lanes kernel) */
    AM_CK_ROWS,            /* row sums, non-finite flag, new row moments */
    AM_CK_COUNT_FAC,       /* count non-finite gradient elements if flagged */
    AM_CK_COLS_RMEAN,      /* column sums of g*g per row block; in the first
                              B threads, the mean of the new row moments */
    AM_CK_COLS_FINAL,      /* column sums, new column moments, factors */
    AM_CK_WSUM,            /* W sums per (row block, column) (am_wsum) */
    AM_CK_WSUM_BLOCKS,     /* their cf^2-weighted sums per column block */
    AM_CK_WSUM_U2,         /* u2 from them, or u2_pass when unusable */
    AM_CK_LANES_U2,        /* row lane sums of u*u (lanes kernel); with
                              the W sums, only when u2_pass */
    AM_CK_TILE_U2,         /* per-tile double sums of u*u (same) */
    AM_CK_LANES_FLAT,      /* unfactored: tile lane sums (lanes kernel) */
    AM_CK_GROUP_U2,        /* sums of AM_SUM_GROUP tiles' u*u (am_sum_tiles'
                              groups), one thread each, when more than one */
    AM_CK_SUM_U2,          /* total u*u; factored: also DECIDE's work;
                              unfactored: flag if not finite */
    AM_CK_COUNT_FLAT,      /* as COUNT_FAC, for unfactored parameters */
    AM_CK_DECIDE,          /* status and clip scale (unfactored) */
    AM_CK_AGREE,           /* new polarity bytes, matches per lr-row */
    AM_CK_BUMP,            /* agreement and lr bump per lr-row */
    AM_CK_APPLY,           /* parameter update, one quad of elements each */
    AM_CK_ROW_FINISH,      /* lr-rows of at most AM_CK_FUSE_MAX elements:
                              AGREE, BUMP and APPLY of one lr-row per block,
                              its second read of g served by the caches */
    AM_CK_COMMIT,          /* new row/col moments into the state */
    AM_CK_FINISH_FLAT,     /* unfactored finish, one polarity byte each */
    AM_CK_REPORT,          /* report and step */
    AM_CK_COUNT_IDS
};

/* How many threads each kernel runs for this update; 0: not launched. */
static inline int64_t am_ck_threads(const am_ck_args *a, int id) {
    int64_t BR = a->B * a->R, BC = a->B * a->C;
    int64_t mx = BR > BC ? BR : BC;
    int fac = a->ndim >= 2;
    switch (id) {
    case AM_CK_INIT: return fac ? (a->lr_rows > 1 ? a->lr_rows : 1) : 1;
    case AM_CK_LANES_G2: return fac ? BR * a->ncb * AM_LANES : 0;
    case AM_CK_ROWS: return fac ? BR : 0;
    case AM_CK_COUNT_FAC: return fac ? a->numel : 0;
    case AM_CK_COLS_RMEAN: return fac ? a->B + a->nrb * BC : 0;
    case AM_CK_COLS_FINAL: return fac ? mx : 0;
    case AM_CK_WSUM: return fac && a->wsum ? a->nrb * BC : 0;
    case AM_CK_WSUM_BLOCKS: return fac && a->wsum ? a->B * a->njb : 0;
    case AM_CK_WSUM_U2: return fac && a->wsum ? 1 : 0;
    case AM_CK_LANES_U2: return fac ? BR * a->ncb * AM_LANES : 0;
    case AM_CK_TILE_U2: return fac ? a->ntiles : 0;
    case AM_CK_LANES_FLAT: return fac ? 0 : a->ntiles * AM_LANES;
    case AM_CK_GROUP_U2: return a->ngroups;
    case AM_CK_SUM_U2: return 1;
    case AM_CK_COUNT_FLAT: return fac ? 0 : a->numel;
    case AM_CK_DECIDE: return fac ? 0 : 1;
    case AM_CK_AGREE: return fac && !a->fuse_rows ? a->lr_rows * a->pol_row_bytes : 0;
    case AM_CK_BUMP: return fac && !a->fuse_rows ? a->lr_rows : 0;
    case AM_CK_APPLY: return fac && !a->fuse_rows ? (a->numel + 3) / 4 : 0;
    case AM_CK_ROW_FINISH: return fac && a->fuse_rows ? a->lr_rows : 0;
    case AM_CK_COMMIT: return fac ? mx : 0;
    case AM_CK_FINISH_FLAT: return fac ? 0 : (a->numel + 7) / 8;
    case AM_CK_REPORT: return 1;
    }
    return 0;
}

/* ------------------------------------------------------- lane sums ----- */

/* Unrolling a sequential chain keeps its order (the adds stay dependent) but
 * lets the GPU issue the next loads before the adds: memory-level
 * parallelism for the long chains the canonical order imposes. The deep
 * unroll is for the chains one thread runs alone (a matrix's row-moment
 * mean, the row sums' combination of column blocks): a review estimated
 * the 50000 x 4096 embedding's mean at 0.9-1.9 ms with 8 loads in flight,
 * against about 1.6 ms for its whole update (not measured: no GPU yet);
 * ptxas: the same registers (COLS_RMEAN 63 -> 62), no spills. */
#ifdef __CUDA_ARCH__
#define AM_CK_UNROLL _Pragma("unroll 8")
#define AM_CK_UNROLL_DEEP _Pragma("unroll 32")
#else
#define AM_CK_UNROLL
#define AM_CK_UNROLL_DEEP
#endif

/* internal.h's am_wsum_block, bit for bit, column by column: each W[y] its
 * own chain over the row blocks (the same adds in the same order), then
 * added to its chain s[y % 4] as there. The CPU goes row block by row block
 * over an array of the 64 W[y] (cache lines read along their rows); here
 * that array went to local memory (512 bytes of stack) and one thread of
 * WSUM_BLOCKS, of which a 4096 x 4096 matrix has 64, made 4096 dependent
 * read-modify-writes with about 4 loads in flight: by a review's estimate
 * 0.15 ms, three times the whole update at full bandwidth (thirty-seventh
 * session; not measured: no GPU yet). Each chain here is nrb loads, unrolled
 * 32 deep (ptxas, sm_90: 32 registers, a 24-byte stack with 20 bytes of
 * spills, where the array took 512; unrolled 8: 40 registers, no spill). */
AM_HD double am_ck_wsum_block(const float *wpart, int64_t nrb, int64_t BC, const float *cf,
                              int64_t y0, int64_t y1) {
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    int64_t y, p;
    for (y = y0; y < y1; y++) {
        const float *col = wpart + y;
        double w = (double)col[0], c, t;
        AM_CK_UNROLL_DEEP
        for (p = 1; p < nrb; p++) w += (double)col[p * BC];
        c = (double)cf[y];
        t = (c * c) * w;
        switch ((y - y0) & 3) {
        case 0: s0 += t; break;
        case 1: s1 += t; break;
        case 2: s2 += t; break;
        default: s3 += t; break;
        }
    }
    return (s0 + s1) + (s2 + s3);
}

/* a / b for a, b >= 0: 32-bit division when both fit (a GPU divides 64-bit
 * integers in software, several times slower). */
AM_HD int64_t am_ck_div(int64_t a, int64_t b) {
    if ((((uint64_t)a | (uint64_t)b) >> 32) == 0) return (int64_t)((uint32_t)a / (uint32_t)b);
    return a / b;
}

/* *dst = max(*dst, v), unsigned: on the GPU an integer atomic (order-free;
 * read first, so that few of the threads write once the maximum settles),
 * in the host emulation's sequential loop a plain store. */
AM_HD void am_ck_umax(uint32_t *dst, uint32_t v) {
    v &= 0x7fffffffu; /* |x| (max_of's too: a -0 would order above everything) */
#ifdef __CUDA_ARCH__
    if (v > *(volatile uint32_t *)dst) atomicMax((unsigned int *)dst, (unsigned int)v);
#else
    if (v > *dst) *dst = v;
#endif
}

/* The float whose bits am_ck_umax kept: the largest of values >= 0 (the
 * bits of a NaN order above every other: NaN, which am_wsum_usable refuses). */
AM_HD float am_ck_ufloat(uint32_t u) { return am_bits_f32(u); }

/* One lane of one (row, column block) of the lanes kernels, thread t:
 * x = t / 8 is the (row, block) pair, t % 8 the lane. Returns the lane's
 * sequential float sum; 0 for the unused lanes of a short block. */
AM_HD float am_ck_lane(const am_ck_args *a, int id, int64_t t) {
    int64_t x = t >> 3, lane = t & 7, j, j0, j1;
    float acc = 0.0f;
    if (id == AM_CK_LANES_FLAT) {
        /* As ref_u2_flat: a new sq that is not finite (g*g overflowed) or
         * below -eps (am_flat_bad) makes the sum NaN, so that the update is
         * skipped. */
        int ovf = 0;
        j0 = x * AM_FLAT_CHUNK;
        j1 = j0 + AM_FLAT_CHUNK < a->numel ? j0 + AM_FLAT_CHUNK : a->numel;
        AM_CK_UNROLL
        for (j = j0 + lane; j < j1; j += AM_LANES) {
            float v = am_load(a->g, a->gdt, j);
            float s = am_ema(a->sq[j], v * v, &a->k);
            ovf |= am_flat_bad(s, a->k.eps);
            acc += am_flat_u2(v, s, a->k.eps);
        }
        if (ovf) acc = am_bits_f32(0x7fc00000u); /* NaN */
    } else {
        int64_t r = am_ck_div(x, a->ncb), cb = x - r * a->ncb, base = r * a->C;
        j0 = cb * AM_COL_BLOCK;
        j1 = j0 + AM_COL_BLOCK < a->C ? j0 + AM_COL_BLOCK : a->C;
        if (id == AM_CK_LANES_G2) {
            AM_CK_UNROLL
        for (j = j0 + lane; j < j1; j += AM_LANES) {
                float v = am_load(a->g, a->gdt, base + j);
                acc += v * v;
            }
        } else if (a->wsum && !a->h->u2_pass) {
            return 0.0f; /* u2 came from the W sums (nothing stored) */
        } else {
            const float rfr = a->rf[r];
            const float *cfb = a->cf + am_ck_div(r, a->R) * a->C;
            AM_CK_UNROLL
        for (j = j0 + lane; j < j1; j += AM_LANES) {
                float u = (rfr * cfb[j]) * am_load(a->g, a->gdt, base + j);
                acc += u * u;
            }
        }
    }
    return acc;
}

/* Stores the combined lane sum s (am_lanesum_finish order) of pair x. */
AM_HD void am_ck_lane_store(const am_ck_args *a, int id, int64_t x, float s) {
    if (id == AM_CK_LANES_FLAT) {
        a->tile_u2[x] = (double)s;
    } else {
        int64_t r = am_ck_div(x, a->ncb), cb = x - r * a->ncb, BR = a->B * a->R;
        if (id == AM_CK_LANES_G2) {
            if (a->ncb > 1) a->rowpart[cb * BR + r] = s;
            else a->row_sumsq[r] = s;
        } else if (!a->wsum || a->h->u2_pass) {
            a->rowu2[cb * BR + r] = (double)s;
        }
    }
}

/* ------------------------------------------------- the other bodies ---- */

AM_HD int am_ck_bit(const uint8_t *bits, int64_t q) {
    return (bits[q >> 3] >> (q & 7)) & 1;
}

/* Word i of a Philox block, selected without indexing (an indexed local
 * array would live in local memory on the GPU). */
AM_HD uint32_t am_ck_word(const am_u32x4 *r, int64_t i) {
    i &= 3;
    return i == 0 ? r->v[0] : i == 1 ? r->v[1] : i == 2 ? r->v[2] : r->v[3];
}

/* The 16-bit noise of element f from the quad f / 8 that holds it
 * (am_sr_noise). */
AM_HD uint32_t am_ck_noise16(const am_u32x4 *r, int64_t f) {
    return (am_ck_word(r, f >> 1) >> (16 * (f & 1))) & 0xffffu;
}

/* The noise of element f of value v, from the 16-bit quad r of f / 8 and,
 * for a float16 half subnormal, the wide-stream quad *wide of f / 4,
 * computed here on first use (*have). */
AM_HD uint32_t am_ck_noise(const am_ck_args *a, int64_t step, const am_u32x4 *r,
                           am_u32x4 *wide, int *have, int64_t f, float v) {
    if (a->pdt == AM_DTYPE_FLOAT16 && am_f16_wide(v)) {
        if (!*have) {
            *wide = am_rng_quad(a->seed, a->param_id, step,
                                (int64_t)((uint64_t)(f >> 2) | AM_SR_WIDE_STREAM));
            *have = 1;
        }
        return am_ck_word(wide, f);
    }
    return am_ck_noise16(r, f);
}

/* Walks consecutive flat elements of a factored parameter, keeping the
 * matrix row r, column j and the column-factor row base without dividing
 * per element. */
typedef struct am_ck_pos {
    int64_t r, j;
    const float *cfb; /* cf + (r / R) * C */
} am_ck_pos;

AM_HD am_ck_pos am_ck_pos_at(const am_ck_args *a, int64_t f) {
    am_ck_pos p;
    p.r = am_ck_div(f, a->C);
    p.j = f - p.r * a->C;
    p.cfb = a->cf + am_ck_div(p.r, a->R) * a->C;
    return p;
}

AM_HD void am_ck_pos_next(const am_ck_args *a, am_ck_pos *p) {
    if (++p->j == a->C) {
        p->j = 0;
        p->r++;
        p->cfb = a->cf + am_ck_div(p->r, a->R) * a->C;
    }
}

/* Factored u at pos p, gradient element f (SPEC 3.1 then 3.2), as
 * ref_agree_rows: ((rf[r] * cf[b, j]) * g) / scale. */
AM_HD float am_ck_u(const am_ck_args *a, const am_ck_pos *p, int64_t f, float scale) {
    return ((a->rf[p->r] * p->cfb[p->j]) * am_load(a->g, a->gdt, f)) / scale;
}

/* Polarity byte t of a factored parameter: the 8 (or fewer) elements of one
 * lr-row it covers. Writes the new byte, returns the number of matches and
 * the lr-row in *kr. */
AM_HD unsigned am_ck_agree(const am_ck_args *a, int64_t t, int64_t *kr) {
    int64_t row = am_ck_div(t, a->pol_row_bytes), q0 = (t - row * a->pol_row_bytes) * 8;
    int64_t q1 = q0 + 8 < a->m ? q0 + 8 : a->m, q, f = row * a->m + q0;
    unsigned nb = 0, old = a->pol[t], mask = (1u << (unsigned)(q1 - q0)) - 1u;
    unsigned same, n = 0;
    float scale = a->h->scale;
    am_ck_pos pos = am_ck_pos_at(a, f);
    for (q = q0; q < q1; q++, f++) {
        nb |= (unsigned)(am_ck_u(a, &pos, f, scale) > 0.0f) << (q - q0);
        am_ck_pos_next(a, &pos);
    }
    same = ~(nb ^ old) & mask;
    while (same) { n += same & 1u; same >>= 1; }
    /* bits past the lr-row's end kept, as the CPU's bit writer keeps them */
    a->pol[t] = (uint8_t)((old & ~mask) | nb);
    *kr = row;
    return n;
}

/* Elements [max(4t, lo), min(4t + 4, hi)) of a factored parameter (one
 * Philox call for the quad). */
AM_HD void am_ck_apply_range(const am_ck_args *a, int64_t t, int64_t lo, int64_t hi) {
    int64_t f0 = 4 * t > lo ? 4 * t : lo, f1 = 4 * t + 4 < hi ? 4 * t + 4 : hi, f;
    int64_t kr = am_ck_div(f0, a->m), qk = f0 - kr * a->m;
    am_u32x4 rnd = {{0, 0, 0, 0}};
    const float inv = 1.0f / a->h->scale;
    int64_t step = *a->step;
    am_ck_pos pos = am_ck_pos_at(a, f0);
    am_u32x4 wide = {{0, 0, 0, 0}};
    int have_wide = 0; /* the wide quad is quad t of that stream */
    /* two threads compute the same quad of 16-bit noise (8 elements), each
     * uses its half */
    if (a->pdt != AM_DTYPE_FLOAT32) rnd = am_rng_quad(a->seed, a->param_id, step, t >> 1);
    for (f = f0; f < f1; f++) {
        /* u * (1 / scale), as am_apply_one: the agreement (am_ck_agree)
         * keeps the SPEC's division */
        float u = ((a->rf[pos.r] * pos.cfb[pos.j]) * am_load(a->g, a->gdt, f)) * inv;
        float v = am_apply(am_load(a->p, a->pdt, f), u, a->lr[kr], a->k.wd);
        uint32_t nz = a->pdt != AM_DTYPE_FLOAT32
                          ? am_ck_noise(a, step, &rnd, &wide, &have_wide, f, v) : 0u;
        am_store_sr(a->p, a->pdt, f, v, nz);
        am_ck_pos_next(a, &pos);
        if (++qk == a->m) { qk = 0; kr++; }
    }
}

/* Agreement of lr-row kr from its matches, and its lr bump (SPEC 3.3-3.4). */
AM_HD void am_ck_bump(const am_ck_args *a, int64_t kr, unsigned long long matches) {
    float ag = (float)matches / (float)a->m;
    a->agree[kr] = ag;
    if (*a->step > 0) a->lr[kr] = am_lr_bump(a->lr[kr], ag, &a->k);
}

/* Unfactored finish of polarity byte t (elements 8t..8t+7), as
 * ref_finish_flat. Returns the matches. */
AM_HD unsigned am_ck_finish_flat(const am_ck_args *a, int64_t t) {
    int64_t e0 = 8 * t, e1 = e0 + 8 < a->numel ? e0 + 8 : a->numel, e;
    unsigned nb = 0, old = a->pol[t], n = 0;
    const float scale = a->h->scale, inv = 1.0f / scale;
    int64_t step = *a->step;
    am_u32x4 rnd = {{0, 0, 0, 0}}, wide = {{0, 0, 0, 0}};
    int have_wide = 0;
    uint32_t nz = 0;
    for (e = e0; e < e1; e++) {
        float x = am_load(a->g, a->gdt, e);
        float v = am_ema(a->sq[e], x * x, &a->k);
        float u = am_rsqrt(v + a->k.eps) * x; /* before the clip */
        unsigned polv = u / scale > 0.0f;
        unsigned match = polv == ((old >> (e - e0)) & 1u);
        float lr = a->lr[e], w;
        a->sq[e] = v;
        n += match;
        nb |= polv << (e - e0);
        if (step > 0) {
            lr = am_lr_scale(lr, match ? a->k.bump_up : a->k.bump_down, &a->k);
            a->lr[e] = lr;
        }
        w = am_apply(am_load(a->p, a->pdt, e), u * inv, lr, a->k.wd);
        if (a->pdt != AM_DTYPE_FLOAT32) {
            /* elements 8t..8t+7: one quad of 16-bit noise; the wide quad
             * changes every 4 elements */
            if (e == e0) rnd = am_rng_quad(a->seed, a->param_id, step, t);
            if ((e & 3) == 0) have_wide = 0;
            nz = am_ck_noise(a, step, &rnd, &wide, &have_wide, e, w);
        }
        am_store_sr(a->p, a->pdt, e, w, nz);
    }
    /* bits past the tensor's end kept, as the CPU keeps them */
    a->pol[t] = (uint8_t)((old & ~((1u << (e1 - e0)) - 1u)) | nb);
    return n;
}

/* The status of the update and the clip scale (SPEC 3.2, 6.2). */
AM_HD void am_ck_decide(const am_ck_args *a) {
    am_cuda_ws_header *h = a->h;
    float norm, rms, scale;
    if (h->nonfinite) { h->status = AM_SKIPPED_NONFINITE_GRAD; return; }
    if (!isfinite(h->u2_sum)) { h->status = AM_SKIPPED_NONFINITE_UPDATE; return; }
    /* In the reference's order: norm / sqrt(n) / clip, at least 1. */
    norm = (float)sqrt(h->u2_sum);
    rms = norm / (float)sqrt((double)a->numel);
    scale = rms / a->k.clip;
    if (!(scale >= 1.0f)) scale = 1.0f;
    h->scale = scale;
    h->status = AM_OK;
}

/* Every kernel but the lanes ones, COUNT_*, AGREE and FINISH_FLAT: thread t. Kernels
 * after DECIDE do nothing unless the status is AM_OK. */
AM_HD void am_ck_elem(const am_ck_args *a, int id, int64_t t) {
    am_cuda_ws_header *h = a->h;
    int64_t BR = a->B * a->R, BC = a->B * a->C, i, p;
    switch (id) {
    case AM_CK_INIT:
        if (t == 0) {
            h->u2_sum = 0.0;
            h->nonfinite = 0;
            h->matches = 0;
            h->scale = 0.0f;
            h->status = AM_OK;
            h->flag = 0;
            h->rf_max = h->cf_max = h->rmean_max = 0;
            h->rfnz_max = h->cfnz_max = 0;
            h->zero_nz = 0;
            h->u2_pass = 0;
        }
        if (a->ndim >= 2 && t < a->lr_rows) a->row_matches[t] = 0;
        break;
    case AM_CK_ROWS: {
        float s = a->row_sumsq[t];
        if (a->ncb > 1) {
            s = a->rowpart[t];
            AM_CK_UNROLL_DEEP /* (ncb is 6104 for a 1 x 100M row) */
            for (p = 1; p < a->ncb; p++) s += a->rowpart[p * BR + t];
            a->row_sumsq[t] = s;
        }
        /* A non-finite g makes its row's sum non-finite. */
        if (!am_isfinite_f32(s)) h->flag = 1;
        a->new_row[t] = am_moment(a->row[t], s, am_inv_count(a->C), &a->k);
        if (a->wsum) a->wrow[t] = 1.0f / a->new_row[t]; /* am_wsum_weight */
        break;
    }
    case AM_CK_COLS_RMEAN:
        if (t < a->B) {
            /* One sequential chain of R adds per matrix (the canonical
             * order): it runs while the other threads stream the column
             * sums, which hides most of its latency. */
            float s = 0.0f;
            AM_CK_UNROLL_DEEP
            for (i = 0; i < a->R; i++) s += a->new_row[t * a->R + i];
            a->rmean[t] = s * am_inv_count(a->R);
            am_ck_umax(&h->rmean_max, am_f32_bits(a->rmean[t]));
        } else {
            int64_t c = t - a->B;
            int64_t rb = am_ck_div(c, BC), y = c - rb * BC, b = am_ck_div(y, a->C);
            int64_t j = y - b * a->C;
            int64_t i0 = rb * a->RB, i1 = i0 + a->RB < a->R ? i0 + a->RB : a->R;
            const int64_t base = b * a->R * a->C + j;
            float s = 0.0f;
            AM_CK_UNROLL
            for (i = i0; i < i1; i++) {
                float v = am_load(a->g, a->gdt, base + i * a->C);
                s += v * v;
            }
            if (a->nrb > 1) a->colpart[rb * BC + y] = s;
            else a->col_sumsq[y] = s;
        }
        break;
    case AM_CK_COLS_FINAL:
        if (t < BC) {
            float s = a->col_sumsq[t], nc;
            if (a->nrb > 1) {
                s = a->colpart[t];
                for (p = 1; p < a->nrb; p++) s += a->colpart[p * BC + t];
                a->col_sumsq[t] = s;
            }
            nc = am_moment(a->col[t], s, am_inv_count(a->R), &a->k);
            a->new_col[t] = nc;
            a->cf[t] = am_rsqrt(nc);
            am_ck_umax(&h->cf_max, am_f32_bits(a->cf[t])); /* (a max: order-free) */
            if (s != 0.0f) am_ck_umax(&h->cfnz_max, am_f32_bits(a->cf[t]));
        }
        if (t < BR) {
            a->rf[t] = am_row_factor(a->new_row[t], a->rmean[am_ck_div(t, a->R)]);
            am_ck_umax(&h->rf_max, am_f32_bits(a->rf[t]));
            if (a->row_sumsq[t] != 0.0f) am_ck_umax(&h->rfnz_max, am_f32_bits(a->rf[t]));
        }
        break;
    case AM_CK_WSUM: {
        /* one (row block, column) of a tile's W sums, as stats_tile */
        int64_t rb = am_ck_div(t, BC), y = t - rb * BC, b = am_ck_div(y, a->C);
        int64_t j = y - b * a->C;
        int64_t i0 = rb * a->RB, i1 = i0 + a->RB < a->R ? i0 + a->RB : a->R;
        const int64_t base = b * a->R * a->C + j;
        const float *w = a->wrow + b * a->R, *rsum = a->row_sumsq + b * a->R;
        const int czero = a->col_sumsq[y] == 0.0f;
        float s = 0.0f;
        int nz = 0; /* a nonzero g in a row or column whose sum of g*g is 0 */
        for (i = i0; i + 4 <= i1; i += 4) {
            float x0 = am_load(a->g, a->gdt, base + i * a->C);
            float x1 = am_load(a->g, a->gdt, base + (i + 1) * a->C);
            float x2 = am_load(a->g, a->gdt, base + (i + 2) * a->C);
            float x3 = am_load(a->g, a->gdt, base + (i + 3) * a->C);
            float q = (x0 * x0) * w[i];
            q += (x1 * x1) * w[i + 1];
            q += (x2 * x2) * w[i + 2];
            q += (x3 * x3) * w[i + 3];
            s += q;
            nz |= (x0 != 0.0f && (czero || rsum[i] == 0.0f)) |
                  (x1 != 0.0f && (czero || rsum[i + 1] == 0.0f)) |
                  (x2 != 0.0f && (czero || rsum[i + 2] == 0.0f)) |
                  (x3 != 0.0f && (czero || rsum[i + 3] == 0.0f));
        }
        for (; i < i1; i++) {
            float x = am_load(a->g, a->gdt, base + i * a->C);
            s += (x * x) * w[i];
            nz |= x != 0.0f && (czero || rsum[i] == 0.0f);
        }
        a->wpart[rb * BC + y] = s;
        /* every thread that sets it stores the same 1: order-free */
        if (nz) h->zero_nz = 1;
        break;
    }
    case AM_CK_WSUM_BLOCKS: {
        int64_t b = am_ck_div(t, a->njb), jb = t - b * a->njb;
        int64_t y0 = b * a->C + jb * AM_WSUM_JBLOCK;
        int64_t y1 = y0 + AM_WSUM_JBLOCK < (b + 1) * a->C ? y0 + AM_WSUM_JBLOCK : (b + 1) * a->C;
        a->wblock[t] = am_ck_wsum_block(a->wpart, a->nrb, BC, a->cf, y0, y1);
        break;
    }
    case AM_CK_WSUM_U2: {
        double u2 = 0.0;
        int64_t b, jb;
        for (b = 0; b < a->B; b++) {
            double s = 0.0;
            for (jb = 0; jb < a->njb; jb++) s += a->wblock[b * a->njb + jb];
            u2 += (double)a->rmean[b] * s;
        }
        if (am_wsum_usable(u2, am_ck_ufloat(h->rf_max), am_ck_ufloat(h->cf_max),
                           am_ck_ufloat(h->rfnz_max), am_ck_ufloat(h->cfnz_max),
                           am_ck_ufloat(h->rmean_max), a->numel, h->zero_nz))
            h->u2_sum = u2;
        else h->u2_pass = 1;
        break;
    }
    case AM_CK_GROUP_U2: {
        if (a->wsum && !h->u2_pass) break; /* (u2 from the W sums) */
        const int64_t k0 = t * AM_SUM_GROUP;
        const int64_t n = a->ntiles - k0 < AM_SUM_GROUP ? a->ntiles - k0 : AM_SUM_GROUP;
        a->group_u2[t] = am_sum_group(a->tile_u2 + k0, n);
        break;
    }
    case AM_CK_TILE_U2: {
        if (a->wsum && !h->u2_pass) break;
        int64_t cb = t % a->ncb, rb = (t / a->ncb) % a->nrb, b = t / (a->ncb * a->nrb);
        int64_t i0 = rb * a->RB, i1 = i0 + a->RB < a->R ? i0 + a->RB : a->R;
        const double *src = a->rowu2 + cb * BR + b * a->R;
        double s = 0.0;
        AM_CK_UNROLL
        for (i = i0; i < i1; i++) s += src[i];
        a->tile_u2[t] = s;
        break;
    }
    case AM_CK_SUM_U2: {
        double s = 0.0;
        if (a->wsum && !h->u2_pass) { /* u2_sum set by AM_CK_WSUM_U2 */
            am_ck_decide(a);
            break;
        }
        /* (the same bits: am_sum_groups; one thread summed every tile, a
         * chain of 262144 for a 512x512x3x3 weight, where this one is 64
         * times shorter; found by a review, thirty-third session) */
        s = a->ngroups ? am_sum_groups(a->group_u2, a->ngroups)
                       : am_sum_tiles(a->tile_u2, a->ntiles);
        h->u2_sum = s;
        if (a->ndim >= 2) am_ck_decide(a); /* non-finite elements already counted */
        else if (!isfinite(s)) h->flag = 1;
        break;
    }
    case AM_CK_DECIDE:
        am_ck_decide(a);
        break;
    case AM_CK_BUMP:
        if (h->status == AM_OK) am_ck_bump(a, t, a->row_matches[t]);
        break;
    case AM_CK_APPLY:
        if (h->status == AM_OK) am_ck_apply_range(a, t, 0, a->numel);
        break;
    case AM_CK_COMMIT:
        if (h->status != AM_OK) break;
        if (t < BR) a->row[t] = a->new_row[t];
        if (t < BC) a->col[t] = a->new_col[t];
        break;
    case AM_CK_REPORT: {
        int ok = h->status == AM_OK;
        if (a->report) {
            a->report->status = (am_status)h->status;
            a->report->clip_scale = ok ? h->scale : 0.0f;
            a->report->mean_agreement =
                ok ? (float)((double)h->matches / (double)a->numel) : 0.0f;
            a->report->nonfinite_count = (int64_t)h->nonfinite;
        }
        if (ok) *a->step += 1;
        break;
    }
    default:
        break;
    }
}

/* Non-finite test of element t for AM_CK_COUNT_*. */
AM_HD int am_ck_nonfinite(const am_ck_args *a, int64_t t) {
    return !am_isfinite_f32(am_load(a->g, a->gdt, t));
}

/* --------------------------------------------------------- the plan ---- */

/* Builds the arguments from validated inputs. ws_base: the workspace aligned
 * to AM_CUDA_ALIGN. Host code only (no device access). */
static inline void am_ck_args_init(am_ck_args *a, const am_geom *g,
                                   const am_tensor *param,
                                   const am_tensor *grad, const am_state *st,
                                   int64_t *step, const am_hparams *hp,
                                   am_rng_key key, unsigned char *ws_base,
                                   am_report *report) {
    am_cuda_layout L = am_cuda_layout_of(g);
    memset(a, 0, sizeof *a);
    a->p = param->data;
    a->g = grad->data;
    a->pdt = (int32_t)param->dtype;
    a->gdt = (int32_t)grad->dtype;
    a->lr = st->lr;
    a->pol = st->polarity;
    a->row = st->row;
    a->col = st->col;
    a->sq = st->sq;
    a->step = step;
    a->report = report;
    a->h = (am_cuda_ws_header *)ws_base;
#define AM_WSP(T, off) ((T *)(ws_base + L.off))
    if (g->ndim >= 2) {
        a->row_sumsq = AM_WSP(float, row_sumsq);
        a->col_sumsq = AM_WSP(float, col_sumsq);
        a->rowpart = AM_WSP(float, rowpart);
        a->colpart = AM_WSP(float, colpart);
        a->new_row = AM_WSP(float, new_row);
        a->new_col = AM_WSP(float, new_col);
        a->rf = AM_WSP(float, rf);
        a->cf = AM_WSP(float, cf);
        a->rmean = AM_WSP(float, rmean);
        a->agree = AM_WSP(float, agree);
        a->rowu2 = AM_WSP(double, rowu2);
        a->row_matches = AM_WSP(unsigned long long, row_matches);
        a->wrow = AM_WSP(float, wrow);
        a->wpart = AM_WSP(float, wpart);
        a->wblock = AM_WSP(double, wblock);
    }
    a->tile_u2 = AM_WSP(double, tile_u2);
    a->group_u2 = AM_WSP(double, group_u2);
#undef AM_WSP
    a->numel = g->numel;
    a->lr_rows = g->lr_rows;
    a->m = g->m;
    a->B = g->B;
    a->R = g->R;
    a->C = g->C;
    a->RB = g->RB;
    a->nrb = g->nrb;
    a->ncb = g->ncb;
    a->ntiles = g->ntiles;
    a->ngroups = am_ck_ngroups(g->ntiles);
    a->pol_row_bytes = g->pol_row_bytes;
    a->ndim = g->ndim;
    a->wsum = g->ndim >= 2 && g->wsum;
    a->njb = g->ndim >= 2 ? am_ck_njb(g->C) : 0;
    a->fuse_rows = g->ndim >= 2 && g->m >= AM_CK_FUSE_MIN && g->m <= AM_CK_FUSE_MAX;
    a->param_id = key.param_id;
    a->seed = key.seed;
    a->k = am_consts_from(hp);
}

#endif /* AM_CUDA_PLAN_H */
