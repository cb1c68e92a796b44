/*
 * pin_self.c — keeps the object that holds the library's code mapped for as
 * long as the thread pool's workers may run it.
 *
 * The workers are detached and live between jobs (parallel.c), watching for
 * the next job in the library's own code: a dlclose() that unmapped that
 * code crashed them. libautomagic.so is linked -z nodelete (CMakeLists.txt);
 * the static library linked into a plugin (a .so that a host dlopen()s and
 * dlclose()s) had no such guard: SIGSEGV in a worker in 37 of 40 runs of a
 * host that closed the plugin right after its first threaded update (found
 * by a review, thirty-third session). Before the first worker starts, the
 * object holding this code is marked not unloadable (RTLD_NODELETE, through
 * a dlopen with RTLD_NOLOAD that never loads anything and whose handle is
 * never closed). The main program is never unloaded: its dlopen by name
 * finds nothing, harmlessly. A fully static program (gcc -static) gets the
 * linker's warning that dlopen in a static program needs glibc's shared
 * libraries at run time (there dladdr finds nothing and the pin does
 * nothing); building the library with -DAM_NO_PIN=ON leaves the pin out.
 */
#define _GNU_SOURCE /* dladdr and Dl_info (glibc) */
#include "internal.h"

#if (defined(__unix__) || defined(__APPLE__)) && !defined(AM_NO_PIN)
#include <dlfcn.h>
#endif

#if (defined(__unix__) || defined(__APPLE__)) && defined(RTLD_NODELETE) && \
    defined(RTLD_NOLOAD) && !defined(AM_NO_PIN)
static const char am_pin_anchor = 0; /* an address inside this object */

void am_pin_self(void) {
    Dl_info info;
    if (dladdr(&am_pin_anchor, &info) && info.dli_fname && info.dli_fname[0])
        (void)dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD | RTLD_NODELETE);
}
#else
void am_pin_self(void) {}
#endif
