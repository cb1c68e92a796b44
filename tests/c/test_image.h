/* test_image.h — the checkpoint image of an optimizer (am_optimizer_save_memory)
 * as a malloc'ed buffer, for tests that compare whole optimizer states byte
 * for byte. Include after <cmocka.h>. */
#ifndef AM_TEST_IMAGE_H
#define AM_TEST_IMAGE_H

#include <automagic.h>
#include <stdlib.h>

/* Returns the image (free() it) and its size in *n; fails the test on error. */
static unsigned char *t_image(const am_optimizer *o, size_t *n) {
    unsigned char *b;
    assert_int_equal(am_optimizer_save_memory(o, NULL, 0, n), AM_OK);
    b = (unsigned char *)malloc(*n);
    assert_non_null(b);
    assert_int_equal(am_optimizer_save_memory(o, b, *n, n), AM_OK);
    return b;
}

#endif
