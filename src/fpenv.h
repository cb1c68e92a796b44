/*
 * fpenv.h — the floating-point environment the library computes in.
 *
 * Every result must be the same bits whatever the thread that computes it
 * (SPEC 5), and rounding must stay unbiased for subnormals. The control
 * register (x86 MXCSR, AArch64 FPCR) is per thread and a caller may have
 * changed it: flush-to-zero and denormals-are-zero (torch.set_flush_denormal,
 * -ffast-math's startup code), another rounding mode, or unmasked exceptions.
 * Pool workers kept the register they were created with, so with FTZ set on
 * the calling thread later the tasks it ran flushed subnormals and the
 * workers' did not: the bits depended on the thread count (seen: polarity of
 * a 1-D update with u around 1e-45). So the library's entry points and every
 * thread's run of tasks set IEEE defaults (round to nearest even, no
 * flushing, exceptions masked) and put the caller's register back after;
 * when it already holds them (the usual case) nothing is written.
 * Elsewhere (no such register known here): nothing is done.
 */
#ifndef AM_FPENV_H
#define AM_FPENV_H

#if defined(__x86_64__) || (defined(__i386__) && defined(__SSE__))
#include <xmmintrin.h>
typedef unsigned int am_fpenv;
#define AM_FPENV_IEEE 0x1F80u /* exceptions masked, round to nearest, no FTZ/DAZ */
static inline am_fpenv am_fpenv_enter(void) {
    const am_fpenv old = _mm_getcsr();
    if ((old & ~0x3Fu) != AM_FPENV_IEEE) _mm_setcsr(AM_FPENV_IEEE); /* (bits 0-5: flags) */
    return old;
}
static inline void am_fpenv_leave(am_fpenv old) {
    if ((old & ~0x3Fu) != AM_FPENV_IEEE) _mm_setcsr(old);
}
#elif defined(__aarch64__)
typedef unsigned long am_fpenv;
/* FPCR: rounding mode 22-23, FZ 24, DN 25, AHP 26, FZ16 19, trap enables
 * 8-12 and 15; IEEE defaults are all of them 0 */
#define AM_FPENV_MASK 0x07C89F00ul
static inline am_fpenv am_fpenv_enter(void) {
    am_fpenv old;
    __asm__ volatile("mrs %0, fpcr" : "=r"(old));
    if (old & AM_FPENV_MASK) {
        const am_fpenv v = old & ~AM_FPENV_MASK;
        __asm__ volatile("msr fpcr, %0" : : "r"(v));
    }
    return old;
}
static inline void am_fpenv_leave(am_fpenv old) {
    if (old & AM_FPENV_MASK) __asm__ volatile("msr fpcr, %0" : : "r"(old));
}
#else
typedef int am_fpenv;
static inline am_fpenv am_fpenv_enter(void) { return 0; }
static inline void am_fpenv_leave(am_fpenv old) { (void)old; }
#endif

/* The body of a public entry point: returns CALL (an am_status expression)
 * evaluated in IEEE defaults, with the caller's environment put back. */
#define AM_FPENV_RETURN(CALL)                                                  \
    do {                                                                       \
        const am_fpenv am_fe_ = am_fpenv_enter();                              \
        const am_status am_s_ = (CALL);                                        \
        am_fpenv_leave(am_fe_);                                                \
        return am_s_;                                                          \
    } while (0)

#endif /* AM_FPENV_H */
