/*
 * test_rounding.c — randomness and stochastic rounding (SPEC 5):
 *   - Philox4x32-7 and -10 against the Random123 known-answer vectors;
 *   - chi-square tests of the noise (values, neighbours, steps, parameters)
 *     that pass at 7 rounds and reject 5;
 *   - am_sr_bf16 / am_sr_f16 exactly unbiased over every value of the random
 *     bits they use (where that set is small enough to enumerate);
 *   - statistical unbiasedness (z-test) for bfloat16, float16 normal and
 *     float16 subnormal values, directly and end to end through am_update;
 *   - the noise is keyed by (seed, param id, step, element) as documented;
 *   - determinism: same seed, same bits; different seed, different bf16
 *     results; bits independent of the thread count.
 *
 * z-tests: k round-ups in N independent trials with probability p has mean
 * Np and variance Np(1-p); we require |z| < 5, a two-sided false-failure
 * probability of about 5.7e-7 per test (normal approximation, N >= 10^5).
 */
#include "test_common.h"

#include "am_math.h"

/* ----------------------------------------------------------- Philox ---- */

/* Random123 tests/kat_vectors, the three "philox4x32 7" and three
 * "philox4x32 10" lines: rounds, counter (4 words), key (2 words), expected
 * output (4 words). The official file was not in the stored index; the lines
 * were taken from independent projects that quote it verbatim (citing
 * DEShawResearch/random123 commit 9545ff6 / release 1.14.0) and agree with
 * each other. The noise uses 7 rounds (AM_SR_ROUNDS); the 10-round lines
 * check the same function with Random123's default. */
static void test_philox_kat(void **unused) {
    static const uint32_t kat[6][11] = {
        {7, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000,
         0x5f6fb709, 0x0d893f64, 0x4f121f81, 0x4f730a48},
        {7, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff,
         0x5207ddc2, 0x45165e59, 0x4d8ee751, 0x8c52f662},
        {7, 0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0,
         0x4dfccaba, 0x190a87f0, 0xc47362ba, 0xb6b5242a},
        {10, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000,
         0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {10, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff,
         0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
        {10, 0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0,
         0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1},
    };
    int i, w;
    (void)unused;
    assert_int_equal(AM_SR_ROUNDS, 7);
    for (i = 0; i < 6; i++) {
        am_u32x4 c, r;
        for (w = 0; w < 4; w++) c.v[w] = kat[i][1 + w];
        r = am_philox4x32(c, kat[i][5], kat[i][6], (int)kat[i][0]);
        for (w = 0; w < 4; w++) assert_int_equal(r.v[w], kat[i][7 + w]);
    }
}

/* The documented keying: counter (q lo, q hi, param id, step), key = seed. */
static void test_rng_quad_layout(void **unused) {
    uint64_t seed = 0x0123456789abcdefull;
    am_u32x4 c, a, b;
    (void)unused;
    c.v[0] = 0x9abcdef0u;
    c.v[1] = 0x12345678u;
    c.v[2] = 17;
    c.v[3] = 5;
    a = am_rng_quad(seed, 17, 5, (int64_t)0x123456789abcdef0ll);
    b = am_philox4x32(c, 0x89abcdefu, 0x01234567u, 7);
    assert_memory_equal(&a, &b, sizeof a);
}

/* ------------------------------------------ the noise's statistics ---- */

/* The 16-bit noise of element e (am_sr_noise's layout, bfloat16) from a
 * Philox4x32 with `rounds` rounds. */
static uint32_t noise16(int rounds, uint64_t seed, uint32_t pid, int64_t step, int64_t e) {
    am_u32x4 c, w;
    c.v[0] = (uint32_t)(uint64_t)(e >> 3);
    c.v[1] = (uint32_t)((uint64_t)(e >> 3) >> 32);
    c.v[2] = pid;
    c.v[3] = (uint32_t)(uint64_t)step;
    w = am_philox4x32(c, (uint32_t)seed, (uint32_t)(seed >> 32), rounds);
    return (w.v[(e >> 1) & 3] >> (16 * (e & 1))) & 0xffffu;
}

#define T_NOISE_N ((int64_t)1 << 21)

/* Chi-square of 65536 bins, each expected n / 65536, as a z-score. */
static double chi2_z(const uint32_t *bins, int64_t n) {
    const double ex = (double)n / 65536.0;
    double chi = 0.0;
    int b;
    for (b = 0; b < 65536; b++) chi += ((double)bins[b] - ex) * ((double)bins[b] - ex) / ex;
    return (chi - 65535.0) / sqrt(2.0 * 65535.0);
}

/* The largest |z| of four chi-square tests of the noise (T_NOISE_N values
 * each): the 16-bit values of consecutive elements; the high bytes of
 * neighbouring elements (2e, 2e + 1) as pairs; the high bytes of one
 * element at steps s and s + 1; at parameter ids p and p + 1. */
static double noise_worst_z(int rounds) {
    const uint64_t seed = 0x5eed5eed12345678ull;
    uint32_t *bins = calloc(65536, sizeof *bins);
    double worst = 0.0;
    int64_t e;
    int t;
    assert_non_null(bins);
    for (t = 0; t < 4; t++) {
        double z;
        memset(bins, 0, 65536 * sizeof *bins);
        for (e = 0; e < T_NOISE_N; e++) {
            uint32_t a, b;
            switch (t) {
            case 0: bins[noise16(rounds, seed, 3, 9, e)]++; continue;
            case 1:
                a = noise16(rounds, seed, 3, 9, 2 * e);
                b = noise16(rounds, seed, 3, 9, 2 * e + 1);
                break;
            case 2:
                a = noise16(rounds, seed, 3, 9, e);
                b = noise16(rounds, seed, 3, 10, e);
                break;
            default:
                a = noise16(rounds, seed, 3, 9, e);
                b = noise16(rounds, seed, 4, 9, e);
                break;
            }
            bins[(a >> 8) << 8 | b >> 8]++;
        }
        z = fabs(chi2_z(bins, T_NOISE_N));
        if (z > worst) worst = z;
    }
    free(bins);
    return worst;
}

/* The noise (AM_SR_ROUNDS rounds) passes the four chi-square tests of
 * noise_worst_z at |z| < 5, and so does 6 rounds; the same tests reject
 * Philox4x32 with 5 rounds (|z| in the thousands: they can fail, and 7
 * rounds is two above what they detect). A quick check of the structure
 * the rounding relies on, not a substitute for the BigCrush results behind
 * AM_SR_ROUNDS (am_math.h). */
static void test_noise_statistics(void **unused) {
    const double z7 = noise_worst_z(AM_SR_ROUNDS), z6 = noise_worst_z(6), z5 = noise_worst_z(5);
    (void)unused;
    print_message("[ measured ] noise chi-square, worst |z|: %d rounds %.2f, 6 rounds %.2f, "
                  "5 rounds %.1f\n", AM_SR_ROUNDS, z7, z6, z5);
    if (z7 >= 5.0) fail_msg("Philox4x32-%d noise: chi-square |z| = %.2f", AM_SR_ROUNDS, z7);
    if (z6 >= 5.0) fail_msg("Philox4x32-6 noise: chi-square |z| = %.2f", z6);
    if (z5 < 5.0) fail_msg("the tests no longer reject Philox4x32-5 (|z| = %.2f)", z5);
}

/* ---------------------------------------------- exact unbiasedness ----- */

static double bf16_val(uint16_t h) { return t_bf16_to_double(h); }

/* bfloat16 keeps 16 of float32's bits: over all 2^16 values of the low 16
 * random bits, the sum of the rounded results is exactly 2^16 * x. Checked
 * for normal, float32-subnormal, negative and near-overflow x. */
static void test_sr_bf16_exact(void **unused) {
    static const uint32_t xs[] = {0x3f80a5c3u, 0x3f7f0001u, 0xbf3c1234u, 0x00012345u,
                                  0x80007fffu, 0x7f7e8001u, 0x3a83126fu, 0x00000001u};
    size_t t;
    (void)unused;
    for (t = 0; t < sizeof xs / sizeof xs[0]; t++) {
        float x;
        double sum = 0.0;
        uint32_t r;
        memcpy(&x, &xs[t], 4);
        for (r = 0; r < 65536u; r++) sum += bf16_val(am_sr_bf16(x, r | 0xabcd0000u));
        if (sum != 65536.0 * (double)x)
            fail_msg("bf16 SR of %a: mean %a", (double)x, sum / 65536.0);
    }
}

/* float16 normal range: 13 dropped bits, so over all 2^13 values of the low
 * random bits the mean is exactly x. */
static void test_sr_f16_normal_exact(void **unused) {
    static const float xs[] = {1.0001f, -3.14159f, 6.2e-5f, 1000.3f, 0.0999f, -7.7e-5f, 65000.5f};
    size_t t;
    (void)unused;
    for (t = 0; t < sizeof xs / sizeof xs[0]; t++) {
        double sum = 0.0;
        uint32_t r;
        for (r = 0; r < 8192u; r++) sum += t_f16_to_double(am_sr_f16(xs[t], r));
        if (sum != 8192.0 * (double)xs[t])
            fail_msg("f16 SR of %a: mean %a", (double)xs[t], sum / 8192.0);
    }
}

/* ---------------------------------------------------- z-tests ---------- */

typedef double (*t_round_fn)(float x, uint32_t rnd);
static double rd_bf16(float x, uint32_t rnd) { return bf16_val(am_sr_bf16(x, rnd)); }
static double rd_f16(float x, uint32_t rnd) { return t_f16_to_double(am_sr_f16(x, rnd)); }

/* The reference's float16 trick (add 13 random bits, truncate, convert),
 * which is biased in the float16 subnormal range: used only to show that the
 * z-test below detects a biased rounding. */
static double rd_f16_trick(float x, uint32_t rnd) {
    uint32_t b;
    float t;
    memcpy(&b, &x, 4);
    b = (b + (rnd & 0x1fffu)) & ~0x1fffu;
    memcpy(&t, &b, 4);
    return t_f16_to_double(am_f32_to_f16_rne(t));
}

/* Rounds x n times with Philox words keyed (seed, 11, 0, i) and z-tests the
 * mean of the outcomes against x. */
static double z_of_rounding(float x, t_round_fn fn, uint64_t seed, int64_t n) {
    double lo = 0, hi = 0, p, k = 0;
    int64_t i;
    for (i = 0; i < n; i++) {
        double v = fn(x, am_rng_quad(seed, 11, 0, i >> 2).v[i & 3]);
        if (i == 0) lo = hi = v;
        if (v < lo) lo = v;
        if (v > hi) hi = v;
    }
    /* exactly two outcomes bracketing x (or one, if x is on the grid) */
    if (lo == hi) return lo == (double)x ? 0.0 : 1e9;
    if (!((double)x > lo && (double)x < hi)) return 1e9;
    p = ((double)x - lo) / (hi - lo);
    for (i = 0; i < n; i++) k += fn(x, am_rng_quad(seed, 11, 0, i >> 2).v[i & 3]) == hi;
    return (k - (double)n * p) / sqrt((double)n * p * (1.0 - p));
}

static void test_sr_statistical(void **unused) {
    /* bfloat16; float16 normal; float16 subnormal (around 1e-6, and 3e-8,
     * below the smallest subnormal 2^-24 ~ 5.96e-8); negatives. */
    static const struct { float x; am_dtype dt; } cs[] = {
        {1.00123f, AM_DTYPE_BFLOAT16}, {-0.3337f, AM_DTYPE_BFLOAT16},
        {2.7e-39f, AM_DTYPE_BFLOAT16}, {1.00123f, AM_DTYPE_FLOAT16},
        {-12.345f, AM_DTYPE_FLOAT16}, {1.0e-6f, AM_DTYPE_FLOAT16},
        {-1.234e-6f, AM_DTYPE_FLOAT16}, {3.0e-8f, AM_DTYPE_FLOAT16},
        {1.0e-8f, AM_DTYPE_FLOAT16}, {6.09e-5f, AM_DTYPE_FLOAT16},
    };
    uint64_t seed = t_seed();
    size_t t;
    (void)unused;
    for (t = 0; t < sizeof cs / sizeof cs[0]; t++) {
        double z = z_of_rounding(cs[t].x, cs[t].dt == AM_DTYPE_BFLOAT16 ? rd_bf16 : rd_f16,
                                 seed + t, 200000);
        printf("[ measured ] SR %s of %.6g: z = %.3f (N = 200000, seed %llu)\n",
               am_dtype_name(cs[t].dt), (double)cs[t].x, z,
               (unsigned long long)(seed + t));
        if (!(fabs(z) < 5.0))
            fail_msg("SR %s of %.9g is biased: z = %.3f (seed %llu)",
                     am_dtype_name(cs[t].dt), (double)cs[t].x, z,
                     (unsigned long long)(seed + t));
    }
    /* power: the same test rejects the biased truncation trick at 1e-6 */
    {
        double z = z_of_rounding(1.0e-6f, rd_f16_trick, seed, 200000);
        if (z >= 1e9)
            printf("[ measured ] biased float16 truncation trick at 1e-6: rejected "
                   "(its outcomes do not bracket x: it always rounds to one value)\n");
        else
            printf("[ measured ] biased float16 truncation trick at 1e-6: z = %.1f\n", z);
        assert_true(fabs(z) >= 5.0);
    }
}

/* ---------------------------------------------------- end to end ------- */

/* A 1-D parameter of n equal values p0 with an equal gradient: every element
 * gets the same float32 result v (computed by the float32 path from the same
 * values), which lies between two grid points of the 16-bit dtype. Over
 * several seeds the mean of the 16-bit results must be v (z-test), and each
 * result must equal am_sr_*(v, Philox word of (seed, id, step, element)). */
static void e2e_case(am_dtype dt, uint16_t p0bits, float g0, double lr, uint64_t seed0) {
    enum { N = 25000, RUNS = 8 };
    int64_t d = N, i;
    am_shape sh = t_shape(1, &d);
    am_hparams hp = am_hparams_default();
    float *pf = (float *)t_calloc(N * 4), *g = (float *)t_calloc(N * 4);
    uint16_t *ph = (uint16_t *)t_calloc(N * 2);
    double p0 = dt == AM_DTYPE_BFLOAT16 ? t_bf16_to_double(p0bits) : t_f16_to_double(p0bits);
    double lo = 0, hi = 0, pr, k = 0, z, ntot = 0;
    float v = 0.0f;
    int run;
    hp.lr_bump_rate = 0.0; /* the same lr, hence the same v, at every step */
    for (run = 0; run < RUNS; run++) {
        uint64_t seed = seed0 + (uint64_t)run;
        am_rng_key key;
        t_fix ff, fh;
        am_tensor pft = t_tensor(pf, AM_DTYPE_FLOAT32, &sh), pht = t_tensor(ph, dt, &sh);
        am_tensor gt = t_tensor(g, AM_DTYPE_FLOAT32, &sh);
        key.seed = seed;
        key.param_id = (uint32_t)run * 3u;
        t_fix_init(&ff, &sh, lr);
        t_fix_init(&fh, &sh, lr);
        for (i = 0; i < N; i++) {
            pf[i] = (float)p0;
            ph[i] = p0bits;
            g[i] = g0;
        }
        /* advance step so the key's step varies between runs */
        ff.st.step = fh.st.step = run;
        assert_int_equal(am_update(&pft, &gt, &ff.st, &hp, key, ff.ws, ff.ws_bytes, NULL), AM_OK);
        assert_int_equal(am_update(&pht, &gt, &fh.st, &hp, key, fh.ws, fh.ws_bytes, NULL), AM_OK);
        v = pf[0];
        for (i = 0; i < N; i++) {
            /* the documented layout (SPEC 5, am_sr_noise): 16-bit half
             * i % 8 of quad i / 8; for a float16 value below 2^-14 in
             * magnitude, word i % 4 of quad i / 4 with bit 63 set */
            uint32_t bits, rnd;
            memcpy(&bits, &pf[i], 4);
            rnd = (am_rng_quad(seed, key.param_id, run, i >> 3).v[(i >> 1) & 3] >>
                   (16 * (i & 1))) & 0xffffu;
            if (dt == AM_DTYPE_FLOAT16 && (bits & 0x7fffffffu) < 0x38800000u)
                rnd = am_rng_quad(seed, key.param_id, run,
                                  (int64_t)((uint64_t)(i >> 2) | (1ull << 63))).v[i & 3];
            uint16_t want = dt == AM_DTYPE_BFLOAT16 ? am_sr_bf16(pf[i], rnd) : am_sr_f16(pf[i], rnd);
            double got = dt == AM_DTYPE_BFLOAT16 ? t_bf16_to_double(ph[i]) : t_f16_to_double(ph[i]);
            assert_true(pf[i] == v);
            assert_int_equal(ph[i], want);
            if (run == 0 && i == 0) lo = hi = got;
            if (got < lo) lo = got;
            if (got > hi) hi = got;
        }
        for (i = 0; i < N; i++)
            k += (dt == AM_DTYPE_BFLOAT16 ? t_bf16_to_double(ph[i]) : t_f16_to_double(ph[i])) == hi;
        ntot += N;
        t_fix_free(&ff);
        t_fix_free(&fh);
    }
    if (!((double)v > lo && (double)v < hi))
        fail_msg("%s: float32 result %.9g not strictly between the outcomes %.9g and %.9g",
                 am_dtype_name(dt), (double)v, lo, hi);
    pr = ((double)v - lo) / (hi - lo);
    z = (k - ntot * pr) / sqrt(ntot * pr * (1.0 - pr));
    printf("[ measured ] end-to-end %s: p0 %.6g -> float32 %.9g, P(up) %.4f, "
           "z = %.3f (N = %.0f, seeds %llu..%llu)\n",
           am_dtype_name(dt), p0, (double)v, pr, z, ntot, (unsigned long long)seed0,
           (unsigned long long)(seed0 + RUNS - 1));
    if (!(fabs(z) < 5.0)) fail_msg("end-to-end %s rounding biased: z = %.3f", am_dtype_name(dt), z);
    free(pf);
    free(g);
    free(ph);
}

/* With one element value everywhere, u = +-1 after the clip (clip 1), so the
 * float32 result is p0 -+ lr (to float32 rounding). */
static void test_sr_end_to_end(void **unused) {
    uint64_t seed = t_seed();
    (void)unused;
    /* bf16 1.0, step 0.3 of the spacing 2^-8 below 1 */
    e2e_case(AM_DTYPE_BFLOAT16, 0x3f80, 1.0f, 0.3 * ldexp(1.0, -8), seed);
    /* float16 1.0, step 0.7 of the spacing 2^-11 below 1 */
    e2e_case(AM_DTYPE_FLOAT16, 0x3c00, 0.5f, 0.7 * ldexp(1.0, -11), seed + 100);
    /* float16 subnormal 17 * 2^-24 (~1.01e-6), step 0.37 * 2^-24 */
    e2e_case(AM_DTYPE_FLOAT16, 17, 2.0f, 0.37 * ldexp(1.0, -24), seed + 200);
    /* float16 0 -> 3e-8, below the smallest subnormal */
    e2e_case(AM_DTYPE_FLOAT16, 0, -1.0f, 3e-8, seed + 300);
}

/* ---------------------------------------------------- determinism ------ */

/* Runs 4 updates of a {37, 29} parameter of dtype pdt with seed and thread
 * count; returns param bytes and all state bytes concatenated. */
static unsigned char *run_traj(am_dtype pdt, uint64_t seed, int threads, size_t *len) {
    const int64_t d[2] = {37, 29};
    am_shape sh = t_shape(2, d);
    int64_t n = 37 * 29, i;
    size_t pb = (size_t)n * am_dtype_size(pdt), off;
    void *param = t_calloc(n * 4);
    float *g = (float *)t_calloc(n * 4);
    uint64_t rs = 4242;
    am_hparams hp = am_hparams_default();
    am_tensor pt = t_tensor(param, pdt, &sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, &sh);
    am_rng_key key;
    unsigned char *out;
    t_fix f;
    int s;
    assert_int_equal(am_set_num_threads(threads), AM_OK);
    key.seed = seed;
    key.param_id = 2;
    t_fix_init(&f, &sh, 1e-3);
    for (i = 0; i < n; i++) t_store_random(param, pdt, i, &rs, -3, 0);
    for (s = 0; s < 4; s++) {
        for (i = 0; i < n; i++) t_store_random(g, AM_DTYPE_FLOAT32, i, &rs, -6, 0);
        assert_int_equal(am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, NULL), AM_OK);
    }
    *len = pb + (size_t)(f.sz.lr_count + f.sz.row_count + f.sz.col_count) * 4 +
           (size_t)f.sz.polarity_bytes + 8;
    out = (unsigned char *)malloc(*len);
    assert_non_null(out);
    memcpy(out, param, pb);
    off = pb;
    memcpy(out + off, f.st.lr, (size_t)f.sz.lr_count * 4);
    off += (size_t)f.sz.lr_count * 4;
    memcpy(out + off, f.st.row, (size_t)f.sz.row_count * 4);
    off += (size_t)f.sz.row_count * 4;
    memcpy(out + off, f.st.col, (size_t)f.sz.col_count * 4);
    off += (size_t)f.sz.col_count * 4;
    memcpy(out + off, f.st.polarity, (size_t)f.sz.polarity_bytes);
    off += (size_t)f.sz.polarity_bytes;
    memcpy(out + off, &f.st.step, 8);
    t_fix_free(&f);
    free(param);
    free(g);
    assert_int_equal(am_set_num_threads(1), AM_OK);
    return out;
}

static void test_determinism(void **unused) {
    static const am_dtype dts[3] = {AM_DTYPE_FLOAT32, AM_DTYPE_BFLOAT16, AM_DTYPE_FLOAT16};
    int t;
    (void)unused;
    for (t = 0; t < 3; t++) {
        size_t la, lb, lc, ld, le;
        unsigned char *a = run_traj(dts[t], 1234, 1, &la);
        unsigned char *b = run_traj(dts[t], 1234, 1, &lb);
        unsigned char *c = run_traj(dts[t], 1234, 2, &lc);
        unsigned char *d = run_traj(dts[t], 1234, 0, &ld);
        unsigned char *e = run_traj(dts[t], 1235, 1, &le);
        assert_int_equal(la, lb);
        assert_memory_equal(a, b, la);  /* same seed: identical bits */
        assert_memory_equal(a, c, la);  /* 2 threads */
        assert_memory_equal(a, d, la);  /* all processors */
        if (dts[t] == AM_DTYPE_FLOAT32)
            assert_memory_equal(a, e, la); /* float32 uses no randomness */
        else /* another seed: the 16-bit parameter bits differ */
            assert_true(memcmp(a, e, (size_t)37 * 29 * 2) != 0);
        free(a); free(b); free(c); free(d); free(e);
    }
}

/* The optimizer object keys its noise with (its seed, parameter id): it
 * gives the same bits as the kernel layer with that key. */
static void test_optimizer_matches_kernel(void **unused) {
    const int64_t d[3] = {3, 4, 5};
    am_shape sh = t_shape(3, d);
    uint16_t a[60], b[60], dummy[60];
    float g[60];
    am_hparams hp = am_hparams_default();
    am_optimizer *opt = NULL;
    am_tensor pt = t_tensor(b, AM_DTYPE_BFLOAT16, &sh), gt = t_tensor(g, AM_DTYPE_FLOAT32, &sh);
    am_rng_key key = {777, 1};
    int32_t id0, id1;
    t_fix f;
    int i, s;
    (void)unused;
    for (i = 0; i < 60; i++) a[i] = b[i] = dummy[i] = (uint16_t)(0x3f00 + 5 * i);
    hp.lr = 1e-3;
    assert_int_equal(am_optimizer_create(&hp, 777, &opt), AM_OK);
    assert_int_equal(am_optimizer_add_param(opt, dummy, AM_DTYPE_BFLOAT16, 3, d, &id0), AM_OK);
    assert_int_equal(am_optimizer_add_param(opt, a, AM_DTYPE_BFLOAT16, 3, d, &id1), AM_OK);
    assert_int_equal(id1, 1);
    t_fix_init(&f, &sh, 1e-3);
    for (s = 0; s < 3; s++) {
        for (i = 0; i < 60; i++) g[i] = 0.01f * (float)((i * 7 + s * 3) % 11 - 5);
        assert_int_equal(am_optimizer_update_param(opt, id1, g, AM_DTYPE_FLOAT32, NULL), AM_OK);
        assert_int_equal(am_update(&pt, &gt, &f.st, &hp, key, f.ws, f.ws_bytes, NULL), AM_OK);
        assert_memory_equal(a, b, sizeof a);
    }
    t_fix_free(&f);
    am_optimizer_destroy(opt);
}

/* am_expf (the lr bump's exp, IEEE double operations only, so that CPU and
 * GPU agree) against the C library's double exp rounded to float: within an
 * ulp everywhere checked, and equal on every float of [-2, 2] stepped 2^-16
 * apart and on the edges of the float range (measured when it was written:
 * equal on all 2.2e9 floats of [-12, 12]). */
static void test_expf_portable(void **unused) {
    static const float edges[] = {0.0f, -0.0f, 1e-30f, -1e-30f, 0.6931472f, -0.6931472f,
                                  88.7f, 88.72f, 88.73f, 89.0f, 1e30f, -87.3f, -103.0f,
                                  -103.97f, -104.0f, -1e30f, INFINITY, -INFINITY};
    int64_t i;
    unsigned e;
    (void)unused;
    for (i = -(2 << 16); i <= (2 << 16); i++) {
        const float x = (float)i * 0x1p-16f, a = am_expf(x), c = (float)exp((double)x);
        if (memcmp(&a, &c, 4) != 0) fail_msg("am_expf(%a) = %a, libm %a", x, a, c);
    }
    for (i = 0; i < 200000; i++) { /* (-104, 89) */
        const float x = -104.0f + (float)i * (193.0f / 200000.0f);
        const float a = am_expf(x), c = (float)exp((double)x);
        uint32_t ua, uc;
        memcpy(&ua, &a, 4);
        memcpy(&uc, &c, 4);
        if (ua != uc && ua + 1 != uc && uc + 1 != ua)
            fail_msg("am_expf(%a) = %a, libm %a: more than an ulp apart", x, a, c);
    }
    for (e = 0; e < sizeof edges / sizeof edges[0]; e++) {
        const float a = am_expf(edges[e]), c = (float)exp((double)edges[e]);
        if (memcmp(&a, &c, 4) != 0) fail_msg("am_expf(%a) = %a, libm %a", edges[e], a, c);
    }
    {
        const float nan = am_expf(NAN);
        assert_true(nan != nan);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_philox_kat),
        cmocka_unit_test(test_expf_portable),
        cmocka_unit_test(test_rng_quad_layout),
        cmocka_unit_test(test_noise_statistics),
        cmocka_unit_test(test_sr_bf16_exact),
        cmocka_unit_test(test_sr_f16_normal_exact),
        cmocka_unit_test(test_sr_statistical),
        cmocka_unit_test(test_sr_end_to_end),
        cmocka_unit_test(test_determinism),
        cmocka_unit_test(test_optimizer_matches_kernel),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
