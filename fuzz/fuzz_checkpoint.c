/* fuzz_checkpoint.c — libFuzzer target for the checkpoint loader.
 *
 * Any input may be loaded. Invariants checked (a violation traps, which the
 * fuzzer reports as a crash): a rejected input leaves the optimizer's whole
 * state byte-identical; an accepted one saves back to an image that loads
 * again to the same state (round trip) and can be trained on; nothing
 * crashes, leaks or reads out of bounds (ASan/UBSan in scripts/fuzz.sh,
 * valgrind and ASan through the replay test in CTest). */
#include "fuzz_model.h"

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(c)                                                              \
    do {                                                                      \
        if (!(c)) __builtin_trap();                                           \
    } while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static fuzz_model m;
    static unsigned char *ref;
    static size_t ref_n;
    unsigned char *img, *img2;
    size_t n, n2;
    am_status st;
    if (!ref) {
        CHECK(fuzz_model_init(&m, 1) == 0);
        fuzz_model_step(&m, 0, 0);
        ref = fuzz_image(m.opt, &ref_n);
        CHECK(ref != NULL);
    }
    st = am_optimizer_load_memory(m.opt, data, size);
    if (am_status_is_error(st)) {
        CHECK(st == AM_ERR_FORMAT || st == AM_ERR_MISMATCH || st == AM_ERR_OUT_OF_MEMORY);
        img = fuzz_image(m.opt, &n);
        CHECK(img && n == ref_n && memcmp(img, ref, n) == 0);
        free(img);
        return 0;
    }
    CHECK(st == AM_OK);
    img = fuzz_image(m.opt, &n);
    CHECK(img != NULL);
    CHECK(am_optimizer_load_memory(m.opt, img, n) == AM_OK);
    img2 = fuzz_image(m.opt, &n2);
    CHECK(img2 && n2 == n && memcmp(img, img2, n) == 0);
    free(img);
    free(img2);
    {   /* the loaded state can be trained on (parameters restored after) */
        static fuzz_model saved;
        memcpy(saved.w32, m.w32, sizeof m.w32);
        memcpy(saved.w16, m.w16, sizeof m.w16);
        fuzz_model_step(&m, 1, 0);
        fuzz_model_step(&m, 2, 1);
        memcpy(m.w32, saved.w32, sizeof m.w32);
        memcpy(m.w16, saved.w16, sizeof m.w16);
    }
    CHECK(am_optimizer_load_memory(m.opt, ref, ref_n) == AM_OK);
    return 0;
}
