/*
 * dispatch.c — which kernel set runs, how many threads, and am_parallel_for.
 *
 * Kernel choice, once per process (pthread_once, so thread-safe): the AVX2 +
 * F16C set when the library was built with it, cpuid reports AVX2, FMA, F16C
 * and POPCNT, and the OS saves the ymm registers (OSXSAVE + XGETBV); the
 * scalar reference otherwise. AUTOMAGIC_FORCE_SCALAR=1 keeps the reference;
 * AUTOMAGIC_DEBUG=1 logs the chosen set (and why) through the log callback.
 * Software prefetch in the streaming kernels (am_sw_prefetch, simd.h): off
 * on AMD CPUs, on elsewhere; AUTOMAGIC_PREFETCH=0|1 overrides. The AVX-512
 * kernels' tuning (am_tuning_zen4, simd.h): Zen 4's on AMD family 25, Zen
 * 5's elsewhere; AUTOMAGIC_TUNING=zen4|zen5 overrides.
 * FMA is required only as the marker of the Haswell-class feature set the
 * kernels are tuned for; the kernels themselves never fuse (SPEC 5).
 *
 * Threads: am_parallel_for runs serially below AM_PAR_MIN_BYTES of work
 * (measured: see docs/PERFORMANCE.md) and on the pool (parallel.c) above.
 */
#define _POSIX_C_SOURCE 200809L
#include "simd.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

/* Work (bytes touched, as estimated by the caller) below which one thread
 * is faster than waking the pool. Measured with bench/bench.py --threshold
 * on the 2-core development machine (shared, loaded): float32 (64, 1024)
 * updates (~1.3 MB per pass) lost 20% with the pool, (256, 1024) (~5 MB)
 * broke even; see docs/PERFORMANCE.md. AUTOMAGIC_PAR_MIN_BYTES overrides it. */
#define AM_PAR_MIN_BYTES (2.0 * 1024.0 * 1024.0)
static double g_par_min_bytes = AM_PAR_MIN_BYTES;

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static void choose(void);
static void ensure_chosen(void);
static const am_kernels *g_best;            /* best the CPU supports */
static const am_kernels *_Atomic g_current; /* in use */
static atomic_int g_num_threads = 1;

#if defined(__x86_64__) || defined(__i386__)
static unsigned long long xgetbv0(void) {
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

static int detect_avx2(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    /* FMA(12) POPCNT(23) OSXSAVE(27) AVX(28) F16C(29) */
    if ((c & (1u << 12 | 1u << 23 | 1u << 27 | 1u << 28 | 1u << 29)) !=
        (1u << 12 | 1u << 23 | 1u << 27 | 1u << 28 | 1u << 29))
        return 0;
    if ((xgetbv0() & 6u) != 6u) return 0; /* OS saves xmm and ymm */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (b >> 5) & 1u; /* AVX2 */
}

static int detect_avx512(void) {
    unsigned a, b, c, d;
    if (!detect_avx2()) return 0;
    if ((xgetbv0() & 0xE6u) != 0xE6u) return 0; /* opmask, zmm state saved */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (b >> 16 & 1u) && (b >> 30 & 1u); /* AVX-512F and AVX-512BW */
}
#else
static int detect_avx2(void) { return 0; }
static int detect_avx512(void) { return 0; }
#endif

static int g_has_avx2, g_has_avx512, g_is_amd, g_family;
static pthread_once_t g_cpu_once = PTHREAD_ONCE_INIT;
static atomic_int g_sw_prefetch = 1; /* set by choose() */
static atomic_int g_zen4;            /* set by detect() */
/* AUTOMAGIC_TUNING as detect() found it: 0 unset, 1 zen4 or zen5, -1 any
 * other value (ignored, and warned of by ensure_chosen), that value in
 * g_tuning_bad */
static int g_tuning_env;
static const char *g_tuning_bad;

#if defined(__x86_64__) || defined(__i386__)
static int detect_amd(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    return b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u; /* "AuthenticAMD" */
}

/* The CPU family as cpuid leaf 1 gives it (base family, plus the extended
 * family when the base is 15: AMD Zen 4 25, Zen 5 26); 0 when unknown. */
static int detect_family(void) {
    unsigned a, b, c, d, base;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    base = (a >> 8) & 0xfu;
    return (int)(base == 0xfu ? base + ((a >> 20) & 0xffu) : base);
}
#else
static int detect_amd(void) { return 0; }
static int detect_family(void) { return 0; }
#endif

static void detect(void) {
    const char *tun = getenv("AUTOMAGIC_TUNING");
    g_has_avx2 = detect_avx2();
    g_has_avx512 = detect_avx512();
    g_is_amd = detect_amd();
    g_family = detect_family();
    g_tuning_env = !tun || !tun[0] ? 0 : !strcmp(tun, "zen4") || !strcmp(tun, "zen5") ? 1 : -1;
    g_tuning_bad = g_tuning_env < 0 ? tun : NULL;
    atomic_store(&g_zen4, g_tuning_env == 1 ? !strcmp(tun, "zen4") : g_is_amd && g_family == 25);
}

int am_sw_prefetch(void) { return atomic_load_explicit(&g_sw_prefetch, memory_order_relaxed); }

/* (the CPU's detection only, not ensure_chosen: am_kernels_avx2 reads it
 * inside choose's pthread_once) */
int am_tuning_zen4(void) {
    pthread_once(&g_cpu_once, detect);
    return atomic_load_explicit(&g_zen4, memory_order_relaxed);
}

void am_set_tuning_zen4(int on) {
    ensure_chosen();
    atomic_store(&g_zen4, on != 0);
}

void am_set_sw_prefetch(int on) {
    ensure_chosen();
    atomic_store(&g_sw_prefetch, on != 0);
}

int am_cpu_has_avx512(void) {
    pthread_once(&g_cpu_once, detect);
    return g_has_avx512;
}

static char g_debug_msg[512];       /* AUTOMAGIC_DEBUG's message (choose) */
static atomic_int g_debug_pending;  /* 1 until ensure_chosen logs it */
static char g_warn_msg[400];        /* a bad AUTOMAGIC_TUNING or _PAR_MIN_BYTES (choose) */
static int g_warn_pmb;              /* AUTOMAGIC_PAR_MIN_BYTES was refused (choose) */
static atomic_int g_warn_pending;   /* 1 until ensure_chosen logs it */

static void choose(void) {
    const char *force = getenv("AUTOMAGIC_FORCE_SCALAR");
    const char *fport = getenv("AUTOMAGIC_FORCE_PORTABLE");
    const char *dbg = getenv("AUTOMAGIC_DEBUG");
    const char *pmb = getenv("AUTOMAGIC_PAR_MIN_BYTES");
    const char *pf = getenv("AUTOMAGIC_PREFETCH");
    const char *no512 = getenv("AUTOMAGIC_NO_AVX512"); /* (for the message below) */
    const char *why = "no optimised kernels for this CPU";
    pthread_once(&g_cpu_once, detect);
    if (pmb && pmb[0]) {
        /* a whole number of bytes (decimal digits, blanks around them);
         * anything else is ignored with a warning (atof took "abc" and
         * "2MiB" as 0 and 2, which sent every loop to the pool, and "nan"
         * or "inf" turned threading off; found by a review, thirty-fourth
         * session). Read by hand: strtod depends on the locale. */
        const char *q = pmb;
        uint64_t v = 0;
        int digits = 0, ok = 1;
        while (*q == ' ' || *q == '\t') q++;
        for (; *q >= '0' && *q <= '9'; q++, digits++) {
            if (v > ((uint64_t)1 << 60)) ok = 0; /* (more than any traffic) */
            v = v * 10 + (uint64_t)(*q - '0');
        }
        while (*q == ' ' || *q == '\t') q++;
        if (ok && digits && !*q)
            g_par_min_bytes = (double)v;
        else
            g_warn_pmb = 1;
    }
    atomic_store(&g_sw_prefetch, pf && (pf[0] == '0' || pf[0] == '1') ? pf[0] == '1' : !g_is_amd);
    if (g_tuning_env < 0 || g_warn_pmb) {
        int n = 0;
        if (g_tuning_env < 0)
            n = snprintf(g_warn_msg, sizeof g_warn_msg,
                         "automagic: AUTOMAGIC_TUNING='%.40s' is not zen4 or zen5: ignored "
                         "(the CPU's default, %s, is used)%s",
                         g_tuning_bad, atomic_load(&g_zen4) ? "zen4" : "zen5",
                         g_warn_pmb ? "; " : "");
        if (g_warn_pmb && n >= 0 && (size_t)n < sizeof g_warn_msg)
            snprintf(g_warn_msg + n, sizeof g_warn_msg - (size_t)n,
                     "automagic: AUTOMAGIC_PAR_MIN_BYTES='%.40s' is not a whole number of "
                     "bytes: ignored (%.0f is used)",
                     pmb, g_par_min_bytes);
        atomic_store(&g_warn_pending, 1);
    }
    g_best = am_kernels_portable() ? am_kernels_portable() : &am_kernels_ref;
    if (am_kernels_avx2() == NULL)
        why = am_kernels_portable() ? "no x86 AVX2 kernels in this build: the portable vector "
                                      "kernels"
                                    : "library built without AVX2 or portable vector kernels";
    else if (!g_has_avx2)
        why = am_kernels_portable() ? "CPU or OS without AVX2, FMA, F16C: the portable vector "
                                      "kernels"
                                    : "CPU or OS without AVX2, FMA, F16C";
    else {
        g_best = am_kernels_avx2();
        why = g_best != am_kernels_avx2_plain()
                  ? "CPU and OS support AVX2, FMA, F16C; AVX-512F/BW random numbers and "
                    "16-bit parameter apply"
                  : g_has_avx512 ? (no512 && no512[0] == '1'
                                        ? "CPU and OS support AVX2, FMA, F16C; AVX-512F/BW not "
                                          "used (AUTOMAGIC_NO_AVX512=1)"
                                        : "CPU and OS support AVX2, FMA, F16C; AVX-512F/BW not "
                                          "used (library built without those kernels)")
                                 : "CPU and OS support AVX2, FMA, F16C";
    }
    atomic_store(&g_current, g_best);
    if (fport && fport[0] == '1' && am_kernels_portable()) {
        atomic_store(&g_current, am_kernels_portable());
        why = "AUTOMAGIC_FORCE_PORTABLE=1";
    }
    if (force && force[0] == '1') {
        atomic_store(&g_current, &am_kernels_ref);
        why = "AUTOMAGIC_FORCE_SCALAR=1";
    }
    if (dbg && dbg[0] == '1') {
        /* logged by ensure_chosen, after pthread_once returns: a log
         * callback calling into the library from here waited forever on
         * this very pthread_once */
        /* (the AVX-512 kernels' tuning: said only where that set runs) */
        const int a512 = !strcmp(atomic_load(&g_current)->name, "avx2+avx512");
        snprintf(g_debug_msg, sizeof g_debug_msg,
                 "automagic: using %s kernels (%s); software prefetch %s (%s)%s%s%s",
                 atomic_load(&g_current)->name, why,
                 atomic_load(&g_sw_prefetch) ? "on" : "off",
                 pf && (pf[0] == '0' || pf[0] == '1') ? "AUTOMAGIC_PREFETCH"
                 : g_is_amd                           ? "AMD CPU"
                                                      : "not an AMD CPU",
                 !a512                        ? ""
                 : atomic_load(&g_zen4)       ? "; AVX-512 tuning zen4 ("
                                              : "; AVX-512 tuning zen5 (",
                 !a512                        ? ""
                 : g_tuning_env == 1          ? "AUTOMAGIC_TUNING"
                 : g_is_amd && g_family == 25 ? "AMD family 25"
                                              : "not AMD family 25",
                 a512 ? ")" : "");
        atomic_store(&g_debug_pending, 1);
    }
}

/* The kernels chosen (once), then the warning and the debug message, if
 * any, logged by the first caller to see them pending (outside
 * pthread_once: see choose). */
static void ensure_chosen(void) {
    pthread_once(&g_once, choose);
    if (atomic_load_explicit(&g_warn_pending, memory_order_relaxed) &&
        atomic_exchange(&g_warn_pending, 0))
        am_log_global(AM_LOG_WARNING, "%s", g_warn_msg);
    if (atomic_load_explicit(&g_debug_pending, memory_order_relaxed) &&
        atomic_exchange(&g_debug_pending, 0))
        am_log_global(AM_LOG_INFO, "%s", g_debug_msg);
}

int am_cpu_has_avx2(void) {
    pthread_once(&g_cpu_once, detect);
    return g_has_avx2;
}

const am_kernels *am_kernels_get(void) {
    ensure_chosen();
    return atomic_load(&g_current);
}

void am_kernels_select(int which) {
    const am_kernels *portable = am_kernels_portable();
    ensure_chosen();
    atomic_store(&g_current, which == 1   ? &am_kernels_ref
                             : which == 2 ? (portable ? portable : &am_kernels_ref)
                                          : g_best);
}

const char *am_kernel_name(void) { return am_kernels_get()->name; }

am_status am_set_num_threads(int n) {
    AM_RETURN_IF(n < 0, AM_ERR_INVALID_ARGUMENT,
                 "am_set_num_threads: n = %d must be >= 0", n);
    if (n == 0) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        n = online >= 1 ? (int)online : 1;
    }
    atomic_store(&g_num_threads, n);
    return AM_OK;
}

int am_get_num_threads(void) { return atomic_load(&g_num_threads); }

static _Thread_local int g_thread_serial;

int am_set_thread_serial(int on) {
    const int was = g_thread_serial;
    g_thread_serial = on;
    return was;
}

void am_parallel_for(int64_t ntasks, double cost_per_task, am_task_fn fn,
                     void *ctx) {
    int64_t t;
    int n = atomic_load(&g_num_threads);
    ensure_chosen();
    if (n > 1 && ntasks > 1 && !g_thread_serial &&
        cost_per_task * (double)ntasks >= g_par_min_bytes) {
        if (n > ntasks) n = (int)ntasks;
        if (am_pool_run(n, ntasks, fn, ctx)) return;
    }
    for (t = 0; t < ntasks; t++) fn(ctx, t);
}
