/*
 * checkpoint_internal.h — shared by the checkpoint files only: the
 * checksum's canonical items, locale-independent number text, and
 * little-endian copies (checkpoint_text.c); the image builder (checkpoint.c).
 */
#ifndef AM_CHECKPOINT_INTERNAL_H
#define AM_CHECKPOINT_INTERNAL_H

#include "optimizer_internal.h"

#include <stddef.h>
#include <stdint.h>

/* The checksum's canonical items: one string per metadata entry
 * ("m:key=value") and per tensor ("t:name:dtype:[dims]"), each tensor's
 * item followed by its bytes as stored in the file. Sorted by string, so the
 * sum does not depend on the order of the header or of the data section
 * (a file rewritten by another safetensors writer still verifies) while
 * every byte stays attributed to its name. */
typedef struct ck_item {
    char *s;
    const unsigned char *data;
    size_t len;
} ck_item;

typedef struct ck_items {
    ck_item *v;
    size_t n, cap;
    int oom;
} ck_items;

/* Appends an item: the printf-formatted string, then (for tensors) len bytes
 * at data (not copied: must outlive the checksum). Sets it->oom on failure. */
void am_ck_items_add(ck_items *it, const unsigned char *data, size_t len,
                     const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;
void am_ck_items_free(ck_items *it);
/* CRC-32 (zlib) over the items sorted by string: each string with its NUL,
 * then its bytes. Sorts it->v. */
uint32_t am_ck_checksum(ck_items *it);

/* "[3,4]" for dims {3, 4}, "[]" for ndim 0; cap >= 8 * 21 + 3. */
void am_ck_dims_str(char *buf, size_t cap, int32_t ndim, const int64_t *dims);
/* Parses what am_ck_dims_str writes; 0 on anything else. */
int am_ck_parse_dims(const char *s, int32_t *ndim, int64_t *dims);
/* "%.17g" with '.' whatever the locale (exact round trip). */
void am_ck_fmt_double(char *buf, size_t cap, double v);
/* The whole string as a double ('.' decimal point); 0 on failure. */
int am_ck_parse_double(const char *s, double *out);
/* Strict decimal uint64: digits only, no leading zero, no overflow. */
int am_ck_parse_u64(const char *s, uint64_t *out);
/* Copies n elements of elem bytes, byte-reversing each on a big-endian host
 * (the file is little-endian). */
void am_ck_copy_le(void *dst, const void *src, int64_t n, size_t elem);

/* checkpoint.c: the whole checkpoint image of o in one malloc'd buffer
 * (*out, *out_len; the caller frees it). AM_ERR_OUT_OF_MEMORY, or
 * AM_ERR_UNSUPPORTED when the header would pass the loaders' 100 MiB limit. */
am_status am_ck_serialize(const am_optimizer *o, unsigned char **out,
                          size_t *out_len);

/* checkpoint.c: the most bytes a checkpoint of o's parameters can have (its
 * tensors' bytes, the 8-byte length, the loaders' 100 MiB header limit):
 * a larger file cannot load, so am_optimizer_load refuses it unread.
 * UINT64_MAX when out of memory. */
uint64_t am_ck_max_image(const am_optimizer *o);

#endif /* AM_CHECKPOINT_INTERNAL_H */
