/* fuzz_equal.c — libFuzzer target: every kernel set, thread count and way
 * of calling gives the scalar reference's bits (issue 3: "bit-identical
 * whatever the thread count and whatever the path"; SPEC 5).
 *
 * The input picks a shape (sizes around the kernels' boundaries: vector
 * widths, 32-column steps, the 16384-column tile, the 64-element batched
 * small matrices; up to 70,000 elements, or 1,200,000 for the inputs whose
 * first byte asks: 64 long float32 rows, lr-rows of 2^20 split across
 * threads), the parameter and gradient dtypes, valid
 * hyperparameters, a state (fresh, or any valid contents: lrs anywhere,
 * moments >= 0 including zeros and subnormals, any polarity, any step),
 * the distribution of the parameter and of each step's gradient (ordinary,
 * tiny, huge, zero rows and columns, raw bits with NaN and inf, ...) and
 * 1-3 steps. The baseline runs am_update with the scalar set on one
 * thread; then the same steps run
 *   - with the best set (AVX-512 or AVX2 here) on 1-4 threads, with the
 *     Zen 4 / Zen 5 tuning and software prefetch as the input says,
 *   - as the three phases (am_update_stats, _moments, _finish),
 *   - in am_update_batch beside a small second parameter,
 *   - with the portable vector set,
 *   - with the scalar set on several threads,
 *   - through the CUDA update's plan emulated on the CPU (src/cuda's
 *     kernel bodies in launch order, tests/c/cuda_emulate.h), its threads
 *     in ascending or descending order,
 * and the parameter, every state array, the step, the status and the
 * report must be the baseline's, bit for bit (a difference traps; the
 * CUDA path's mean_agreement of a factored parameter within 1e-6, as
 * documented in include/automagic.h). Run the process with
 * AUTOMAGIC_NO_AVX512=1 to make the AVX2 set the best, FUZZ_EQUAL_TRACE=1
 * to print each input's shape and dtypes. LLVMFuzzerInitialize sets
 * AUTOMAGIC_PAR_MIN_BYTES=1 (unless set), so that updates of a few KB take
 * the threaded loops too. */
#define _POSIX_C_SOURCE 200809L
#include "simd.h"
#include "cuda/am_cuda_plan.h"
#include "../tests/c/cuda_emulate.h"

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_input.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(c)                                                              \
    do {                                                                      \
        if (!(c)) {                                                           \
            fprintf(stderr, "fuzz_equal: %s (line %d) failed\n", #c, __LINE__); \
            __builtin_trap();                                                 \
        }                                                                     \
    } while (0)

/* Elements of an update: MAX_NUMEL mostly, BIG_NUMEL for the inputs whose
 * first byte asks for it (the paths of many long rows: the float32 long-row
 * blocks need 64 lr-rows of 3072 or more; one lr-row of 2^20 elements or
 * more is split across threads). */
#define MAX_NUMEL 70000
#define BIG_NUMEL 1200000
#define MAX_STEPS 3

/* ------------------------------------------------------------- input --- */

/* Sizes at the kernels' boundaries. */
static const int64_t SIZES[] = {1,    2,    3,    4,    5,     7,     8,     9,    15,   16,
                                17,   31,   32,   33,   63,    64,    65,    127,  128,  129,
                                255,  256,  257,  511,  1023,  1024,  1025,  2047, 3071, 3072,
                                3073, 4095, 4096, 4097, 16383, 16384, 16385, 16415, 1048577};
#define NSIZES ((int)(sizeof SIZES / sizeof SIZES[0]))

static int64_t pick_size(rd *r, int big) {
    const uint8_t b = u8(r);
    unsigned lo, mid, hi;
    if (b < 200) return SIZES[b % NSIZES];
    lo = u8(r); /* one read a statement: the order is the input's */
    mid = u8(r);
    if (!big) return 1 + (int64_t)(lo | mid << 8) % 20000;
    hi = u8(r);
    return 1 + (int64_t)(lo | mid << 8 | hi << 16) % (BIG_NUMEL - 1);
}

static double pick_from(rd *r, const double *menu, int n) {
    uint8_t b = u8(r);
    if (b < 240) return menu[b % n];
    {
        uint64_t bits = u64(r);
        double d;
        memcpy(&d, &bits, 8);
        return d; /* anything: validated below */
    }
}

static am_hparams pick_hp(rd *r) {
    static const double lr[] = {1e-6, 1e-3, 1e-8, 3e-4, 1e-2, 1.4e-45, 1e-30};
    static const double min_lr[] = {1e-8, 0.0, 1e-6, 1e-45};
    static const double max_lr[] = {1e-2, 1e-3, 1.0, 0.1, 1e-8, 1e30};
    static const double bump[] = {0.1, 0.0, 0.5, 1.0, 1e-7, 10.0};
    static const double beta2[] = {0.999, 0.0, 0.5, 0.9, 0.999999999};
    static const double eps[] = {1e-30, 0.0, 1e-10, 1e-3, 1e-45, 1e30};
    static const double clip[] = {1.0, INFINITY, 1e-3, 1e-30, 100.0, 1e40};
    static const double wd[] = {0.0, 0.0, 0.01, 0.1, 1.0, 1e-30};
#define PICK(m) pick_from(r, m, (int)(sizeof m / sizeof m[0]))
    am_hparams hp = am_hparams_default();
    hp.lr = PICK(lr);
    hp.min_lr = PICK(min_lr);
    hp.max_lr = PICK(max_lr);
    hp.lr_bump_rate = PICK(bump);
    hp.beta2 = PICK(beta2);
    hp.eps = PICK(eps);
    hp.clip_threshold = PICK(clip);
    hp.weight_decay = PICK(wd);
#undef PICK
    return hp;
}

/* ------------------------------------------------------------- data ---- */

static uint64_t mix(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* A value of distribution mode m (0..9): signed, over several decades. */
static float draw(uint64_t *s, int m) {
    uint64_t x = mix(s);
    float sign = (x >> 63) ? -1.0f : 1.0f;
    float unit = (float)((x >> 40) & 0xffffff) * (1.0f / 16777216.0f); /* [0, 1) */
    int dec = (int)((x >> 32) & 255);
    switch (m) {
    case 0: return sign * unit * powf(10.0f, -(float)(dec % 9)); /* 1 .. 1e-9 */
    case 1: return sign * unit;                                   /* (-1, 1) */
    case 2: return sign * bits_f32((uint32_t)(x & 0x00ffffffu));  /* subnormals, tiny normals */
    case 3: return sign * (1.0f + unit) * powf(10.0f, 15.0f + (float)(dec % 6)); /* 1e15 .. 2e20 */
    case 4: return 0.0f;
    case 5: return unit < 0.05f ? 0.0f : sign * unit;             /* zeros in places */
    case 6: return 0.25f;                                         /* constant, positive */
    case 7: return bits_f32((uint32_t)x);                         /* anything, NaN and inf too */
    case 8: return sign * (1.0f + unit) * 6e-8f * (float)(1 + dec % 1000); /* float16 edge */
    default: return sign * (1.0f + unit) * 6.0e4f;               /* near float16's max */
    }
}

static void put(void *buf, am_dtype dt, int64_t i, float v) {
    if (dt == AM_DTYPE_FLOAT32) ((float *)buf)[i] = v;
    else if (dt == AM_DTYPE_BFLOAT16) ((uint16_t *)buf)[i] = am_f32_to_bf16_rne(v);
    else ((uint16_t *)buf)[i] = am_f32_to_f16_rne(v);
}

/* Gradient (or parameter) values of mode m. Mode 10: rows and columns of
 * zeros (dead units) among ordinary values, as the matrix's R x C view. */
static void fill_values(void *buf, am_dtype dt, int64_t n, int64_t cols, int m,
                        uint64_t seed) {
    uint64_t s = seed;
    int64_t i;
    uint64_t zr = mix(&s), zc = mix(&s);
    for (i = 0; i < n; i++) {
        float v;
        if (m == 10) {
            int64_t row = cols ? i / cols : i, col = cols ? i % cols : 0;
            v = ((uint64_t)row * 0x9E37u + zr) % 5 == 0 || ((uint64_t)col * 0x85EBu + zc) % 7 == 0
                    ? 0.0f
                    : draw(&s, 1);
        } else {
            v = draw(&s, m);
        }
        put(buf, dt, i, v);
    }
}

/* A moment of mode m: valid (>= 0 and finite). */
static float moment(uint64_t *s, int m) {
    float v = draw(s, m >= 2 && m <= 4 ? m : 0); /* tiny, huge, zero, else ordinary */
    v = fabsf(v);
    return isfinite(v) ? v : 0.0f;
}

/* ------------------------------------------------------------ a run ---- */

typedef struct bufs {
    am_state_sizes z;
    void *p;
    float *lr, *row, *col, *sq;
    uint8_t *pol;
    int64_t step;
    am_status st[MAX_STEPS];
    am_report rep[MAX_STEPS];
} bufs;

static void *xalloc(size_t n) {
    void *p = calloc(1, n ? n : 1);
    CHECK(p != NULL);
    return p;
}

static void bufs_alloc(bufs *b, const am_state_sizes *z, am_dtype pdt) {
    memset(b, 0, sizeof *b);
    b->z = *z;
    b->p = xalloc((size_t)z->numel * am_dtype_size(pdt));
    b->lr = (float *)xalloc(4 * (size_t)z->lr_count);
    b->pol = (uint8_t *)xalloc((size_t)z->polarity_bytes);
    b->row = z->row_count ? (float *)xalloc(4 * (size_t)z->row_count) : NULL;
    b->col = z->col_count ? (float *)xalloc(4 * (size_t)z->col_count) : NULL;
    b->sq = z->sq_count ? (float *)xalloc(4 * (size_t)z->sq_count) : NULL;
}

static void bufs_copy(bufs *d, const bufs *s, am_dtype pdt) {
    const am_state_sizes *z = &s->z;
    memcpy(d->p, s->p, (size_t)z->numel * am_dtype_size(pdt));
    memcpy(d->lr, s->lr, 4 * (size_t)z->lr_count);
    memcpy(d->pol, s->pol, (size_t)z->polarity_bytes);
    if (s->row) memcpy(d->row, s->row, 4 * (size_t)z->row_count);
    if (s->col) memcpy(d->col, s->col, 4 * (size_t)z->col_count);
    if (s->sq) memcpy(d->sq, s->sq, 4 * (size_t)z->sq_count);
    d->step = s->step;
}

static void bufs_free(bufs *b) {
    free(b->p); free(b->lr); free(b->pol); free(b->row); free(b->col); free(b->sq);
}

/* near_agreement: the report's mean_agreement within 1e-6 (the CUDA path's
 * factored parameters), else bit for bit. */
static void bufs_same(const bufs *a, const bufs *b, am_dtype pdt, int nsteps,
                      int near_agreement) {
    const am_state_sizes *z = &a->z;
    int k;
    CHECK(memcmp(a->p, b->p, (size_t)z->numel * am_dtype_size(pdt)) == 0);
    CHECK(memcmp(a->lr, b->lr, 4 * (size_t)z->lr_count) == 0);
    CHECK(memcmp(a->pol, b->pol, (size_t)z->polarity_bytes) == 0);
    CHECK(!a->row || memcmp(a->row, b->row, 4 * (size_t)z->row_count) == 0);
    CHECK(!a->col || memcmp(a->col, b->col, 4 * (size_t)z->col_count) == 0);
    CHECK(!a->sq || memcmp(a->sq, b->sq, 4 * (size_t)z->sq_count) == 0);
    CHECK(a->step == b->step);
    for (k = 0; k < nsteps; k++) {
        CHECK(a->st[k] == b->st[k]);
        CHECK(a->rep[k].status == b->rep[k].status);
        CHECK(memcmp(&a->rep[k].clip_scale, &b->rep[k].clip_scale, 4) == 0);
        if (near_agreement)
            CHECK(fabsf(a->rep[k].mean_agreement - b->rep[k].mean_agreement) <= 1e-6f);
        else
            CHECK(memcmp(&a->rep[k].mean_agreement, &b->rep[k].mean_agreement, 4) == 0);
        CHECK(a->rep[k].nonfinite_count == b->rep[k].nonfinite_count);
    }
}

/* What one input asks for. */
typedef struct job {
    am_shape sh;
    am_dtype pdt, gdt;
    am_hparams hp;
    am_rng_key key;
    int nsteps;
    int gmode[MAX_STEPS];
    uint64_t gseed[MAX_STEPS];
    void *g[MAX_STEPS];
    int64_t cols; /* the factored view's columns (for zero rows/columns) */
} job;

static am_state view(bufs *b) {
    am_state st;
    st.lr = b->lr; st.polarity = b->pol; st.row = b->row; st.col = b->col; st.sq = b->sq;
    st.step = b->step;
    return st;
}

enum { WAY_UPDATE, WAY_PHASES, WAY_BATCH, WAY_CUDA };

/* The second item of a batch: a small bfloat16 (3, 5) parameter, checked
 * against its own scalar run. */
typedef struct side {
    uint16_t p[15], g[15];
    float lr[3], row[3], col[5];
    uint8_t pol[3];
    am_state st;
    am_tensor pt, gt;
    am_report rep;
} side;

static void side_init(side *s, uint64_t seed) {
    uint64_t x = seed;
    int i;
    memset(s, 0, sizeof *s);
    s->pt.dtype = s->gt.dtype = AM_DTYPE_BFLOAT16;
    s->pt.shape.ndim = s->gt.shape.ndim = 2;
    s->pt.shape.dims[0] = s->gt.shape.dims[0] = 3;
    s->pt.shape.dims[1] = s->gt.shape.dims[1] = 5;
    s->pt.data = s->p;
    s->gt.data = s->g;
    for (i = 0; i < 15; i++) {
        s->p[i] = am_f32_to_bf16_rne(draw(&x, 1));
        s->g[i] = am_f32_to_bf16_rne(draw(&x, 0));
    }
    s->st.lr = s->lr; s->st.polarity = s->pol; s->st.row = s->row; s->st.col = s->col;
    CHECK(am_state_init(&s->pt.shape, &s->st, 1e-3) == AM_OK);
}

/* Runs the job's steps on b with the kernel set `set` (0 best, 1 scalar,
 * 2 portable) on `threads` threads, the way `way`. */
static void run(const job *j, bufs *b, int set, int threads, int way, int batch_side_first) {
    am_tensor pt, gt;
    am_state st = view(b);
    size_t wsb = (size_t)b->z.workspace_bytes;
    void *ws;
    int k;
    side sd, ref; /* the batch's second item, and the same on its own */
    am_kernels_select(set);
    CHECK(am_set_num_threads(threads) == AM_OK);
    pt.data = b->p; pt.dtype = j->pdt; pt.shape = j->sh;
    gt.dtype = j->gdt; gt.shape = j->sh;
    if (way == WAY_BATCH) {
        am_batch_item probe[2];
        memset(probe, 0, sizeof probe);
        side_init(&sd, j->key.seed);
        side_init(&ref, j->key.seed);
        probe[0].param = &pt; probe[0].grad = &gt; probe[0].state = &st; probe[0].hp = &j->hp;
        probe[1].param = &sd.pt; probe[1].grad = &sd.gt; probe[1].state = &sd.st;
        probe[1].hp = &j->hp;
        gt.data = j->g[0];
        CHECK(am_update_batch_workspace(probe, 2, threads, &wsb) == AM_OK);
    }
    if (way == WAY_CUDA) {
        CHECK(am_cuda_workspace_bytes(&j->sh, &wsb) == AM_OK);
        wsb += AM_CUDA_ALIGN;
    }
    ws = xalloc(wsb);
    for (k = 0; k < j->nsteps; k++) {
        am_report *rep = &b->rep[k];
        gt.data = j->g[k];
        memset(rep, 0, sizeof *rep);
        if (way == WAY_UPDATE) {
            b->st[k] = am_update(&pt, &gt, &st, &j->hp, j->key, ws, wsb, rep);
        } else if (way == WAY_CUDA) {
            am_geom g;
            am_ck_args a;
            int64_t step = st.step;
            unsigned char *base = (unsigned char *)(((uintptr_t)ws + AM_CUDA_ALIGN - 1) &
                                                    ~(uintptr_t)(AM_CUDA_ALIGN - 1));
            CHECK(am_geom_init(&j->sh, &g) == AM_OK);
            am_ck_args_init(&a, &g, &pt, &gt, &st, &step, &j->hp, j->key, base, rep);
            g_reverse = (batch_side_first + k) & 1;
            emulate(&a);
            st.step = step;
            b->st[k] = rep->status;
        } else if (way == WAY_PHASES) {
            am_status s = am_update_stats(&pt, &gt, &st, &j->hp, ws, wsb);
            am_status s2 = am_update_moments(&pt, &gt, &st, &j->hp, ws, wsb);
            am_status s3 = am_update_finish(&pt, &gt, &st, &j->hp, j->key, ws, wsb, rep);
            /* a skip is returned by every later phase too */
            CHECK(s == AM_OK || s == s2);
            CHECK(s2 == AM_OK || s2 == s3);
            b->st[k] = s3;
        } else {
            am_batch_item it[2];
            am_batch_item *mine = &it[batch_side_first ? 1 : 0];
            am_batch_item *other = &it[batch_side_first ? 0 : 1];
            memset(it, 0, sizeof it);
            mine->param = &pt; mine->grad = &gt; mine->state = &st; mine->hp = &j->hp;
            mine->key = j->key; mine->report = rep;
            other->param = &sd.pt; other->grad = &sd.gt; other->state = &sd.st;
            other->hp = &j->hp; other->key = j->key; other->key.param_id ^= 1u;
            other->report = &sd.rep;
            CHECK(am_update_batch(it, 2, ws, wsb) == AM_OK);
            b->st[k] = mine->status;
            {   /* the side item against its own scalar run, step by step */
                uint8_t wsr[4096];
                am_state_sizes zz;
                CHECK(am_state_get_sizes(&ref.pt.shape, &zz) == AM_OK);
                CHECK((size_t)zz.workspace_bytes <= sizeof wsr);
                am_kernels_select(1);
                (void)am_update(&ref.pt, &ref.gt, &ref.st, &j->hp, other->key, wsr,
                                (size_t)zz.workspace_bytes, &ref.rep);
                CHECK(memcmp(ref.p, sd.p, sizeof ref.p) == 0);
                CHECK(memcmp(ref.lr, sd.lr, sizeof ref.lr) == 0);
                CHECK(memcmp(ref.pol, sd.pol, sizeof ref.pol) == 0);
                CHECK(memcmp(ref.row, sd.row, sizeof ref.row) == 0);
                CHECK(memcmp(ref.col, sd.col, sizeof ref.col) == 0);
                CHECK(ref.st.step == sd.st.step);
                CHECK(ref.rep.status == sd.rep.status && other->status == sd.rep.status);
                CHECK(memcmp(&ref.rep.clip_scale, &sd.rep.clip_scale, 4) == 0);
                CHECK(memcmp(&ref.rep.mean_agreement, &sd.rep.mean_agreement, 4) == 0);
                CHECK(ref.rep.nonfinite_count == sd.rep.nonfinite_count);
                am_kernels_select(set);
            }
        }
        CHECK(rep->status == b->st[k]);
    }
    b->step = st.step;
    free(ws);
}

/* ------------------------------------------------------------ target --- */

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    setenv("AUTOMAGIC_PAR_MIN_BYTES", "1", 0);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    rd r;
    job j;
    bufs base, init, o;
    am_state st;
    uint8_t how, smode, pmode, tune, knobs;
    uint64_t dseed;
    int64_t i;
    int k, v, big;
    int64_t limit;
    static int initialised, zen4_default, prefetch_default;
    if (!initialised) { /* (the replay driver has no LLVMFuzzerInitialize call) */
        LLVMFuzzerInitialize(NULL, NULL);
        zen4_default = am_tuning_zen4();
        prefetch_default = am_sw_prefetch();
        initialised = 1;
    }
    r.p = data;
    r.n = size;
    memset(&j, 0, sizeof j);

    /* shape */
    {
        const uint8_t b = u8(&r);
        j.sh.ndim = (int32_t)(b % 5);
        big = (b / 5) % 8 == 7;
    }
    limit = big ? BIG_NUMEL : MAX_NUMEL;
    for (k = 0; k < j.sh.ndim; k++) j.sh.dims[k] = pick_size(&r, big);
    if (j.sh.ndim >= 3 && (u8(&r) & 1)) { /* convolution weights: 3x3 or 1x1 */
        int64_t ks = (u8(&r) & 1) ? 3 : 1;
        j.sh.dims[j.sh.ndim - 1] = j.sh.dims[j.sh.ndim - 2] = ks;
    }
    j.pdt = (am_dtype)(u8(&r) % 3);
    j.gdt = (am_dtype)(u8(&r) % 3);
    j.hp = pick_hp(&r);
    if (j.hp.min_lr > j.hp.max_lr) { /* menus that disagree: swap */
        double t = j.hp.min_lr;
        j.hp.min_lr = j.hp.max_lr;
        j.hp.max_lr = t;
    }
    if (am_hparams_validate(&j.hp) != AM_OK) return 0;
    {   /* too many elements: fewer along dims[0], then along dims[1] */
        int64_t rest = 1;
        for (k = 1; k < j.sh.ndim; k++) rest *= j.sh.dims[k];
        if (j.sh.ndim >= 2 && rest > limit) {
            j.sh.dims[1] = 1 + j.sh.dims[1] % 7;
            for (rest = 1, k = 1; k < j.sh.ndim; k++) rest *= j.sh.dims[k];
        }
        if (j.sh.ndim >= 1 && rest <= limit && j.sh.dims[0] * rest > limit)
            j.sh.dims[0] = limit / rest;
    }
    j.key.seed = u64(&r);
    j.key.param_id = (uint32_t)u64(&r);
    how = u8(&r);
    smode = u8(&r);
    pmode = u8(&r);
    tune = u8(&r);
    knobs = u8(&r);
    dseed = u64(&r);
    j.nsteps = 1 + (int)(how % MAX_STEPS);
    for (k = 0; k < j.nsteps; k++) {
        j.gmode[k] = u8(&r) % 11;
        j.gseed[k] = dseed + 0x100000001b3ull * (uint64_t)(k + 1);
    }
    {
        am_state_sizes z;
        if (am_state_get_sizes(&j.sh, &z) != AM_OK || z.numel > limit || z.numel == 0)
            return 0;
        j.cols = j.sh.ndim >= 2 ? j.sh.dims[j.sh.ndim - 1] : 0;
        for (k = 0; k < j.nsteps; k++) {
            j.g[k] = xalloc((size_t)z.numel * am_dtype_size(j.gdt));
            fill_values(j.g[k], j.gdt, z.numel, j.cols, j.gmode[k], j.gseed[k]);
        }
        bufs_alloc(&init, &z, j.pdt);
        bufs_alloc(&base, &z, j.pdt);
        bufs_alloc(&o, &z, j.pdt);
    }

    /* the starting parameter and state */
    fill_values(init.p, j.pdt, init.z.numel, j.cols, pmode % 11 == 7 ? 1 : pmode % 11,
                dseed ^ 0xabcdefull);
    st = view(&init);
    CHECK(am_state_init(&j.sh, &st, j.hp.lr) == AM_OK);
    init.step = 0;
    if (smode & 1) { /* any valid state */
        uint64_t s = dseed ^ 0x5151ull;
        int mm = (smode >> 1) % 5; /* moments: ordinary, tiny, huge, zero */
        for (i = 0; i < init.z.lr_count; i++) {
            uint64_t x = mix(&s);
            init.lr[i] = (x & 7) == 0 ? 0.0f : (float)((double)(x >> 11) * 0x1p-53 * 2e-2);
        }
        for (i = 0; i < init.z.polarity_bytes; i++) init.pol[i] = (uint8_t)mix(&s);
        for (i = 0; i < init.z.row_count; i++) init.row[i] = moment(&s, mm);
        for (i = 0; i < init.z.col_count; i++) init.col[i] = moment(&s, mm);
        for (i = 0; i < init.z.sq_count; i++) init.sq[i] = moment(&s, mm);
        /* padding bits zero (am_state): re-mask through the layout */
        {
            int64_t lrows = init.z.lr_count, m = init.z.numel / (lrows ? lrows : 1);
            if (j.sh.ndim >= 2) {
                int64_t per = (m + 7) / 8, q;
                for (q = 0; q < lrows; q++)
                    if (m % 8) init.pol[q * per + per - 1] &= (uint8_t)((1u << (m % 8)) - 1);
            } else if (init.z.numel % 8) {
                init.pol[init.z.polarity_bytes - 1] &= (uint8_t)((1u << (init.z.numel % 8)) - 1);
            }
        }
        init.step = (smode & 64) ? (int64_t)(mix(&s) >> 2) : (int64_t)(smode >> 3);
    }

    if (getenv("FUZZ_EQUAL_TRACE")) /* what an input runs (to read a corpus) */
        fprintf(stderr, "ran ndim=%d numel=%lld pdt=%d gdt=%d steps=%d\n", (int)j.sh.ndim,
                (long long)init.z.numel, (int)j.pdt, (int)j.gdt, j.nsteps);
    /* baseline: scalar, one thread, am_update */
    am_set_tuning_zen4(zen4_default);
    am_set_sw_prefetch(prefetch_default);
    bufs_copy(&base, &init, j.pdt);
    run(&j, &base, 1, 1, WAY_UPDATE, 0);

    /* the variants */
    for (v = 0; v < 6; v++) {
        static const int set_of[6] = {0, 0, 0, 2, 1, 0};
        static const int way_of[6] = {WAY_UPDATE, WAY_PHASES, WAY_BATCH,
                                      WAY_UPDATE, WAY_UPDATE, WAY_CUDA};
        int threads = 1 + (int)((tune >> (2 * (v % 4))) & 3);
        if (v == 4) threads = 3;
        am_set_tuning_zen4((knobs >> v) & 1);
        am_set_sw_prefetch((knobs >> (v + 3)) & 1);
        bufs_copy(&o, &init, j.pdt);
        run(&j, &o, set_of[v], threads, way_of[v], (how >> 7) & 1);
        bufs_same(&base, &o, j.pdt, j.nsteps, way_of[v] == WAY_CUDA && j.sh.ndim >= 2);
    }
    am_kernels_select(0);
    am_set_num_threads(1);
    am_set_tuning_zen4(zen4_default);
    am_set_sw_prefetch(prefetch_default);

    for (k = 0; k < j.nsteps; k++) free(j.g[k]);
    bufs_free(&init);
    bufs_free(&base);
    bufs_free(&o);
    return 0;
}
