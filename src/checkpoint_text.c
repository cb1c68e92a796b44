/*
 * checkpoint_text.c — the small pieces of the checkpoint format that are
 * not about the optimizer: the checksum over canonical items, number text
 * that does not depend on the C locale, and little-endian copies.
 */
#include "checkpoint_internal.h"

#include <fenv.h>
#include <locale.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

void am_ck_items_add(ck_items *it, const unsigned char *data, size_t len,
                      const char *fmt, ...) {
    va_list ap;
    int n;
    char *s;
    if (it->oom) return;
    va_start(ap, fmt);
    n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (it->n == it->cap) {
        size_t nc = it->cap ? it->cap * 2 : 64;
        ck_item *nv = (ck_item *)realloc(it->v, nc * sizeof *nv);
        if (!nv) { it->oom = 1; return; }
        it->v = nv;
        it->cap = nc;
    }
    s = n >= 0 ? (char *)malloc((size_t)n + 1) : NULL;
    if (!s) { it->oom = 1; return; }
    va_start(ap, fmt);
    vsnprintf(s, (size_t)n + 1, fmt, ap);
    va_end(ap);
    it->v[it->n].s = s;
    it->v[it->n].data = data;
    it->v[it->n].len = len;
    it->n++;
}

void am_ck_items_free(ck_items *it) {
    size_t i;
    for (i = 0; i < it->n; i++) free(it->v[i].s);
    free(it->v);
}

static int cmp_item(const void *a, const void *b) {
    return strcmp(((const ck_item *)a)->s, ((const ck_item *)b)->s);
}

/* "[3,4]" for dims {3, 4}; "[]" for ndim 0. buf holds >= 8*21+3 chars. */
void am_ck_dims_str(char *buf, size_t cap, int32_t ndim, const int64_t *dims) {
    size_t at = 0;
    int32_t d;
    buf[at++] = '[';
    for (d = 0; d < ndim; d++)
        at += (size_t)snprintf(buf + at, cap - at, d ? ",%lld" : "%lld",
                               (long long)dims[d]);
    snprintf(buf + at, cap - at, "]");
}

static uLong crc_bytes(uLong c, const unsigned char *p, size_t len) {
    while (len > 0) { /* zlib takes uInt lengths */
        uInt chunk = len > 0x40000000u ? 0x40000000u : (uInt)len;
        c = crc32(c, p, chunk);
        p += chunk;
        len -= chunk;
    }
    return c;
}

/* CRC-32 (zlib) over the sorted items: each string with its NUL, then its
 * tensor bytes. */
uint32_t am_ck_checksum(ck_items *it) {
    uLong c = crc32(0L, Z_NULL, 0);
    size_t i;
    qsort(it->v, it->n, sizeof *it->v, cmp_item);
    for (i = 0; i < it->n; i++) {
        c = crc_bytes(c, (const unsigned char *)it->v[i].s, strlen(it->v[i].s) + 1);
        c = crc_bytes(c, it->v[i].data, it->v[i].len);
    }
    return (uint32_t)c;
}

/* Number text must not depend on the caller's locale nor on its rounding
 * mode: printf and strtod follow both. The locale's decimal point may be
 * several bytes (U+066B in ps_AF.UTF-8 and fa_IR: two), and glibc's strtod
 * and printf round by the x87 control word, which the library's entry
 * points do not reset (fpenv.h resets MXCSR only): a checkpoint loaded under
 * fesetround(FE_DOWNWARD) got hyperparameters 1 ulp off (both found by a
 * review, twenty-second session). So the whole floating-point environment
 * is set to round-to-nearest around each conversion and put back after. */
static const char *decimal_point(size_t *len) {
    const char *dp = localeconv()->decimal_point;
    if (!dp || !*dp) dp = ".";
    *len = strlen(dp);
    return dp;
}

/* Locale-independent "%.17g": the decimal point is always '.'. */
void am_ck_fmt_double(char *buf, size_t cap, double v) {
    size_t dl;
    const char *dp = decimal_point(&dl);
    char *q;
    fenv_t env;
    const int saved = fegetenv(&env) == 0;
    if (saved) fesetround(FE_TONEAREST);
    snprintf(buf, cap, "%.17g", v);
    if (saved) fesetenv(&env);
    if (strcmp(dp, ".") != 0 && (q = strstr(buf, dp)) != NULL) {
        *q = '.'; /* one decimal point at most: the rest moves up */
        memmove(q + 1, q + dl, strlen(q + dl) + 1);
    }
}

int am_ck_parse_double(const char *s, double *out) {
    char buf[96], *end;
    size_t dl;
    const char *dp = decimal_point(&dl);
    size_t n = strlen(s), i, k = 0;
    fenv_t env;
    int saved;
    if (n == 0 || n >= 64) return 0;
    for (i = 0; i < n; i++) {
        if (s[i] == '.') {
            if (k + dl >= sizeof buf) return 0;
            memcpy(buf + k, dp, dl);
            k += dl;
        } else {
            /* the locale's own decimal point is not ours: refused */
            if (strcmp(dp, ".") != 0 && (unsigned char)s[i] == (unsigned char)dp[0]) return 0;
            /* every byte checked: many '.' of a longer decimal point wrote
             * past buf (a reviewer's ASan run, a crafted header under
             * ps_AF.UTF-8) */
            if (k + 1 >= sizeof buf) return 0;
            buf[k++] = s[i];
        }
    }
    buf[k] = '\0';
    if (buf[0] == ' ' || buf[0] == '\t' || buf[0] == '\n') return 0;
    saved = fegetenv(&env) == 0;
    if (saved) fesetround(FE_TONEAREST);
    *out = strtod(buf, &end);
    if (saved) fesetenv(&env);
    return *end == '\0';
}

/* Strict decimal: digits only, no sign, no leading zero, no overflow. */
int am_ck_parse_u64(const char *s, uint64_t *out) {
    uint64_t v = 0;
    if (!*s || (s[0] == '0' && s[1])) return 0;
    for (; *s; s++) {
        unsigned dgt;
        if (*s < '0' || *s > '9') return 0;
        dgt = (unsigned)(*s - '0');
        if (v > (UINT64_MAX - dgt) / 10) return 0;
        v = v * 10 + dgt;
    }
    *out = v;
    return 1;
}

/* Parses "[d0,d1,...]" as written by dims_str. */
int am_ck_parse_dims(const char *s, int32_t *ndim, int64_t *dims) {
    int32_t n = 0;
    if (*s++ != '[') return 0;
    if (*s == ']') {
        *ndim = 0;
        return s[1] == '\0';
    }
    for (;;) {
        char num[24];
        size_t k = 0;
        uint64_t v;
        while (*s >= '0' && *s <= '9' && k < sizeof num - 1) num[k++] = *s++;
        num[k] = '\0';
        if (n == AM_MAX_DIMS || !am_ck_parse_u64(num, &v) || v > (uint64_t)INT64_MAX)
            return 0;
        dims[n++] = (int64_t)v;
        if (*s == ']') break;
        if (*s++ != ',') return 0;
    }
    *ndim = n;
    return s[1] == '\0';
}

/* ------------------------------------------------------ little endian -- */

static int host_is_le(void) {
    const uint16_t one = 1;
    return *(const unsigned char *)&one == 1;
}

/* Copies n elements of size elem, reversing each element's bytes on a
 * big-endian host (the file is little-endian). */
void am_ck_copy_le(void *dst, const void *src, int64_t n, size_t elem) {
    if (n <= 0) return;
    if (elem == 1 || host_is_le()) {
        memcpy(dst, src, (size_t)n * elem);
    } else {
        unsigned char *d = (unsigned char *)dst;
        const unsigned char *s = (const unsigned char *)src;
        int64_t i;
        size_t b;
        for (i = 0; i < n; i++, d += elem, s += elem)
            for (b = 0; b < elem; b++) d[b] = s[elem - 1 - b];
    }
}
