/*
 * checkpoint.c — the optimizer object's state as a safetensors file image:
 * building it (save) and validating + committing it (load). Writing the
 * image to disk atomically is in checkpoint_file.c.
 *
 * Image (docs/RELIABILITY.md has the full description):
 *   [8 bytes] N, little-endian uint64: length of the JSON header
 *   [N bytes] JSON header, padded with spaces so the data starts 8-aligned
 *   [rest]    data section: the tensors back to back, little-endian
 * Header: {"__metadata__": {string: string}, "param.<i>.<field>":
 * {"dtype", "shape", "data_offsets": [begin, end]}, ...} where field is
 * lr (F32, one per lr-row: shape (dims[0]) for ndim >= 2, else the param's
 * shape), polarity (U8 [polarity_bytes]), row (F32, dims[:-1]) and col (F32,
 * dims[:-2] + dims[-1:]) for ndim >= 2, sq (F32, the param's shape) for
 * ndim <= 1, step and skipped (I64, shape []).
 * The metadata holds the format name and version, the hyperparameters
 * (%.17g, exact), the seed, each parameter's dtype and shape, and a CRC-32
 * (zlib) over a canonical list of every metadata entry and every tensor's
 * name, dtype, shape and bytes (see ck_item), so a flipped bit anywhere is
 * caught.
 *
 * Loading parses into temporary buffers and validates everything before the
 * first byte of the optimizer is written; the commit itself cannot fail.
 */
#include "optimizer_internal.h"
#include "checkpoint_internal.h"
#include "fpenv.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK_FORMAT_NAME "automagic.optimizer"
#define CK_FORMAT_VERSION "1"
/* As the safetensors reference implementation: refuse absurd headers. */
#define CK_MAX_HEADER ((uint64_t)100 << 20)

enum { F_LR, F_POL, F_ROW, F_COL, F_SQ, F_STEP, F_SKIPPED, F_COUNT };
static const char *const k_field[F_COUNT] = {"lr",  "polarity", "row", "col",
                                             "sq",  "step",     "skipped"};
static const char *const k_hp_name[8] = {
    "lr", "min_lr", "max_lr", "lr_bump_rate", "beta2", "eps",
    "clip_threshold", "weight_decay"};

/* One tensor of the image: what it must be, and where it is. */
typedef struct ck_tensor {
    int present;         /* the field exists for this parameter's ndim */
    const char *dtype;   /* "F32", "U8", "I64" */
    size_t elem;         /* bytes per element */
    int32_t ndim;
    int64_t dims[AM_MAX_DIMS];
    int64_t count;       /* elements */
    size_t begin, end;   /* byte range in the file's data section */
    int seen;            /* load: found in the header */
} ck_tensor;

static double *hp_field(am_hparams *hp, int k) {
    double *f[8];
    f[0] = &hp->lr; f[1] = &hp->min_lr; f[2] = &hp->max_lr;
    f[3] = &hp->lr_bump_rate; f[4] = &hp->beta2; f[5] = &hp->eps;
    f[6] = &hp->clip_threshold; f[7] = &hp->weight_decay;
    return f[k];
}

/* The tensors of one parameter of shape s (valid: it was registered). */
static void param_tensors(const am_shape *s, ck_tensor t[F_COUNT]) {
    am_state_sizes z;
    int32_t d, n = s->ndim;
    memset(t, 0, sizeof(ck_tensor) * F_COUNT);
    (void)am_state_get_sizes(s, &z);
    for (d = 0; d < F_COUNT; d++) {
        t[d].dtype = "F32";
        t[d].elem = 4;
    }
    t[F_LR].present = t[F_POL].present = 1;
    t[F_STEP].present = t[F_SKIPPED].present = 1;
    t[F_POL].dtype = "U8";
    t[F_POL].elem = 1;
    t[F_POL].ndim = 1;
    t[F_POL].dims[0] = z.polarity_bytes;
    t[F_STEP].dtype = t[F_SKIPPED].dtype = "I64";
    t[F_STEP].elem = t[F_SKIPPED].elem = 8;
    if (n >= 2) {
        t[F_LR].ndim = 1;
        t[F_LR].dims[0] = s->dims[0];
        t[F_ROW].present = t[F_COL].present = 1;
        t[F_ROW].ndim = t[F_COL].ndim = n - 1;
        for (d = 0; d < n - 1; d++) t[F_ROW].dims[d] = s->dims[d];
        for (d = 0; d < n - 2; d++) t[F_COL].dims[d] = s->dims[d];
        t[F_COL].dims[n - 2] = s->dims[n - 1];
    } else {
        t[F_SQ].present = 1;
        t[F_LR].ndim = t[F_SQ].ndim = n;
        for (d = 0; d < n; d++) t[F_LR].dims[d] = t[F_SQ].dims[d] = s->dims[d];
    }
    for (d = 0; d < F_COUNT; d++) {
        int32_t k;
        t[d].count = 1;
        for (k = 0; k < t[d].ndim; k++) t[d].count *= t[d].dims[k];
    }
}

/* The checksum's items (ck_item), as the writer and the loader's
 * verify_checksum both make them: a metadata entry, and a tensor entry
 * named name with its len bytes at data. */
static void meta_item(ck_items *it, const char *key, const char *val) {
    am_ck_items_add(it, NULL, 0, "m:%s=%s", key, val);
}

static void tensor_entry_item(ck_items *it, const char *name, const char *dtype, int32_t ndim,
                              const int64_t *dims, const unsigned char *data, size_t len) {
    char ds[8 * 21 + 3];
    am_ck_dims_str(ds, sizeof ds, ndim, dims);
    am_ck_items_add(it, data, len, "t:%s:%s:%s", name, dtype, ds);
}

/* data: the tensor's bytes in the file (t->end - t->begin of them). */
static void tensor_item(ck_items *it, int32_t p, int f, const ck_tensor *t,
                        const unsigned char *data) {
    char name[48];
    snprintf(name, sizeof name, "param.%d.%s", (int)p, k_field[f]);
    tensor_entry_item(it, name, t->dtype, t->ndim, t->dims, data, t->end - t->begin);
}

/* ------------------------------------------------------------- layout -- */

/* The tensors of every parameter ([count * F_COUNT], index p*F_COUNT + f),
 * laid out back to back by element size, largest first, so that every
 * tensor is naturally aligned (the data section starts 8-aligned): I64, then
 * F32, then U8. NULL when out of memory. */
static ck_tensor *plan_layout(const am_optimizer *o, size_t *data_len) {
    static const size_t order[3] = {8, 4, 1};
    size_t n = (size_t)o->count * F_COUNT, at = 0, k;
    ck_tensor *t = (ck_tensor *)calloc(n ? n : 1, sizeof *t);
    int32_t p;
    int pass;
    if (!t) return NULL;
    for (p = 0; p < o->count; p++)
        param_tensors(&o->params[p].t.shape, t + (size_t)p * F_COUNT);
    for (pass = 0; pass < 3; pass++)
        for (k = 0; k < n; k++) {
            if (!t[k].present || t[k].elem != order[pass]) continue;
            t[k].begin = at;
            at += (size_t)t[k].count * t[k].elem;
            t[k].end = at;
        }
    *data_len = at;
    return t;
}

uint64_t am_ck_max_image(const am_optimizer *o) {
    size_t data = 0;
    ck_tensor *t = plan_layout(o, &data);
    if (!t) return UINT64_MAX; /* (out of memory: no bound; the load will say) */
    free(t);
    return 8 + CK_MAX_HEADER + (uint64_t)data;
}

static const void *field_src(const am_param_slot *s, int f) {
    switch (f) {
    case F_LR: return s->st.lr;
    case F_POL: return s->st.polarity;
    case F_ROW: return s->st.row;
    case F_COL: return s->st.col;
    case F_SQ: return s->st.sq;
    case F_STEP: return &s->st.step;
    default: return &s->skipped;
    }
}

/* -------------------------------------------------------------- save --- */

/* One metadata entry. */
typedef struct ck_meta {
    char key[40];
    char val[8 * 21 + 3];
} ck_meta;

static size_t build_meta(const am_optimizer *o, ck_meta *m) {
    size_t n = 0;
    int k;
    int32_t p;
    am_hparams hp = o->hp;
#define META(K, ...)                                                          \
    do {                                                                      \
        snprintf(m[n].key, sizeof m[n].key, "%s", K);                         \
        snprintf(m[n].val, sizeof m[n].val, __VA_ARGS__);                     \
        n++;                                                                  \
    } while (0)
    META("format", "%s", CK_FORMAT_NAME);
    META("format_version", "%s", CK_FORMAT_VERSION);
    META("library_version", "%s", am_version_string());
    META("num_params", "%d", (int)o->count);
    META("seed", "%llu", (unsigned long long)o->seed);
#undef META
    for (k = 0; k < 8; k++) {
        snprintf(m[n].key, sizeof m[n].key, "hp.%s", k_hp_name[k]);
        am_ck_fmt_double(m[n].val, sizeof m[n].val, *hp_field(&hp, k));
        n++;
    }
    for (p = 0; p < o->count; p++) {
        const am_tensor *t = &o->params[p].t;
        snprintf(m[n].key, sizeof m[n].key, "param.%d.dtype", (int)p);
        snprintf(m[n].val, sizeof m[n].val, "%s", am_dtype_name(t->dtype));
        n++;
        snprintf(m[n].key, sizeof m[n].key, "param.%d.shape", (int)p);
        am_ck_dims_str(m[n].val, sizeof m[n].val, t->shape.ndim, t->shape.dims);
        n++;
    }
    return n;
}

#define CK_FIXED_META 13 /* format..seed (5) + 8 hyperparameters */

static cJSON *raw_int(int64_t v) {
    char buf[24];
    snprintf(buf, sizeof buf, "%lld", (long long)v);
    return cJSON_CreateRaw(buf);
}

/* Adds one tensor entry to root; 0 on allocation failure. */
static int add_tensor_json(cJSON *root, int32_t p, int f, const ck_tensor *t) {
    char name[48];
    cJSON *e = cJSON_CreateObject(), *shape, *offs;
    int32_t d;
    int ok = e != NULL;
    snprintf(name, sizeof name, "param.%d.%s", (int)p, k_field[f]);
    if (!ok) return 0;
    /* cJSON copies the key: that allocation may fail, leaving e unattached
     * (a header missing this tensor, saved as if whole; found by a review's
     * allocation-failure sweep, thirty-fourth session). */
    if (!cJSON_AddItemToObject(root, name, e)) {
        cJSON_Delete(e);
        return 0;
    }
    ok = cJSON_AddStringToObject(e, "dtype", t->dtype) != NULL;
    shape = cJSON_AddArrayToObject(e, "shape");
    offs = cJSON_AddArrayToObject(e, "data_offsets");
    ok = ok && shape && offs;
    for (d = 0; ok && d < t->ndim; d++) {
        cJSON *v = raw_int(t->dims[d]);
        ok = v && cJSON_AddItemToArray(shape, v);
    }
    if (ok) {
        cJSON *b = raw_int((int64_t)t->begin), *en = raw_int((int64_t)t->end);
        ok = b && en;
        if (ok) {
            cJSON_AddItemToArray(offs, b);
            cJSON_AddItemToArray(offs, en);
        } else {
            cJSON_Delete(b);
            cJSON_Delete(en);
        }
    }
    return ok;
}

/* The image, or with size_only its size alone (*out untouched): the header
 * is built with a checksum of the same length, and no state buffer is
 * read, so a size query neither copies the whole state nor races with an
 * update (found by a review, twenty-second session). */
static am_status serialize(const am_optimizer *o, unsigned char **out, size_t *out_len,
                           const int size_only) {
    size_t data_len = 0, nmeta, i, k, hlen, pad, total;
    ck_tensor *t = plan_layout(o, &data_len);
    ck_meta *meta = (ck_meta *)calloc(CK_FIXED_META + 2 * (size_t)o->count, sizeof *meta);
    unsigned char *img = NULL, *data = NULL;
    ck_items items;
    cJSON *root = NULL, *mj;
    char *json = NULL, crc[24];
    int ok;
    memset(&items, 0, sizeof items);
    ok = t && meta;
    if (ok && !size_only) {
        data = (unsigned char *)malloc(data_len ? data_len : 1);
        ok = data != NULL;
    }
    if (ok) {
        nmeta = build_meta(o, meta);
        for (i = 0; !size_only && i < (size_t)o->count * F_COUNT; i++) {
            if (!t[i].present) continue;
            am_ck_copy_le(data + t[i].begin,
                          field_src(&o->params[i / F_COUNT], (int)(i % F_COUNT)),
                          t[i].count, t[i].elem);
            tensor_item(&items, (int32_t)(i / F_COUNT), (int)(i % F_COUNT), &t[i],
                        data + t[i].begin);
        }
        for (k = 0; !size_only && k < nmeta; k++)
            meta_item(&items, meta[k].key, meta[k].val);
        snprintf(crc, sizeof crc, "crc32:%08lx",
                 size_only ? 0ul : (unsigned long)am_ck_checksum(&items));
        ok = !items.oom && (root = cJSON_CreateObject()) != NULL &&
             (mj = cJSON_AddObjectToObject(root, "__metadata__")) != NULL;
        for (k = 0; ok && k < nmeta; k++)
            ok = cJSON_AddStringToObject(mj, meta[k].key, meta[k].val) != NULL;
        ok = ok && cJSON_AddStringToObject(mj, "checksum", crc) != NULL;
        for (i = 0; ok && i < (size_t)o->count * F_COUNT; i++)
            if (t[i].present)
                ok = add_tensor_json(root, (int32_t)(i / F_COUNT), (int)(i % F_COUNT), &t[i]);
        ok = ok && (json = cJSON_PrintUnformatted(root)) != NULL;
    }
    if (ok) {
        hlen = strlen(json);
        pad = (8 - (8 + hlen) % 8) % 8; /* data starts 8-aligned */
        if ((uint64_t)(hlen + pad) > CK_MAX_HEADER) {
            /* a file no loader would accept: refuse to write it */
            cJSON_free(json);
            cJSON_Delete(root);
            am_ck_items_free(&items);
            free(data);
            free(meta);
            free(t);
            AM_RETURN_IF(1, AM_ERR_UNSUPPORTED,
                         "checkpoint: %d parameters need a header above 100 MiB",
                         (int)o->count);
        }
        total = 8 + hlen + pad + data_len;
        if (size_only) {
            *out_len = total;
        } else {
            /* the data grows into the image (moved up past the header in
             * place): one copy of the state beside it, not two (a second
             * buffer for the image held the state twice: a review measured
             * +1.95x the state at a save, thirty-fifth session) */
            img = (unsigned char *)realloc(data, total);
            ok = img != NULL;
            if (ok) data = NULL;
        }
    }
    if (ok && !size_only) {
        uint64_t h = (uint64_t)(hlen + pad);
        if (data_len) memmove(img + 8 + hlen + pad, img, data_len);
        for (k = 0; k < 8; k++) img[k] = (unsigned char)(h >> (8 * k));
        memcpy(img + 8, json, hlen);
        memset(img + 8 + hlen, ' ', pad);
        *out = img;
        *out_len = total;
    }
    cJSON_free(json);
    cJSON_Delete(root);
    am_ck_items_free(&items);
    free(data);
    free(meta);
    free(t);
    AM_RETURN_IF(!ok, AM_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    return AM_OK;
}

am_status am_ck_serialize(const am_optimizer *o, unsigned char **out,
                          size_t *out_len) {
    return serialize(o, out, out_len, 0);
}

am_status am_optimizer_save_memory(const am_optimizer *o, void *buf,
                                   size_t capacity, size_t *size) {
    unsigned char *img;
    size_t n;
    AM_RETURN_IF(!o, AM_ERR_NULL_POINTER, "am_optimizer_save_memory: opt is NULL");
    AM_RETURN_IF(!size, AM_ERR_NULL_POINTER, "am_optimizer_save_memory: size is NULL");
    AM_RETURN_IF(!buf && capacity > 0, AM_ERR_NULL_POINTER,
                 "am_optimizer_save_memory: buf is NULL with capacity %zu", capacity);
    if (!buf) { /* the size only */
        AM_CHECK(serialize(o, &img, &n, 1));
        *size = n;
        return AM_OK;
    }
    AM_CHECK(am_ck_serialize(o, &img, &n));
    if (capacity < n) {
        free(img);
        AM_RETURN_IF(1, AM_ERR_BUFFER_SIZE,
                     "am_optimizer_save_memory: capacity %zu, need %zu", capacity, n);
    }
    memcpy(buf, img, n);
    free(img);
    *size = n;
    return AM_OK;
}

/* --------------------------------------------------------------- load --- */

static const char *const k_fixed_meta[CK_FIXED_META + 1] = {
    "format", "format_version", "library_version", "num_params", "seed",
    "hp.lr", "hp.min_lr", "hp.max_lr", "hp.lr_bump_rate", "hp.beta2",
    "hp.eps", "hp.clip_threshold", "hp.weight_decay", "checksum"};
enum { M_FORMAT, M_VERSION, M_LIBVER, M_NUM, M_SEED, M_HP0, M_CHECKSUM = 13 };

/* Parses "param.<i>." at the start of s (i < count, no leading zeros);
 * returns the rest or NULL. */
static const char *parse_param_prefix(const char *s, int32_t count, int32_t *p) {
    uint64_t v = 0;
    int digits = 0;
    if (strncmp(s, "param.", 6) != 0) return NULL;
    s += 6;
    if (s[0] == '0' && s[1] >= '0' && s[1] <= '9') return NULL;
    while (*s >= '0' && *s <= '9' && digits < 11) v = v * 10 + (uint64_t)(*s++ - '0'), digits++;
    if (!digits || *s != '.' || v >= (uint64_t)count) return NULL;
    *p = (int32_t)v;
    return s + 1;
}

/* A JSON number that is a whole number in [0, 2^53]. */
static int json_size(const cJSON *j, uint64_t *out) {
    double v;
    if (!cJSON_IsNumber(j)) return 0;
    v = j->valuedouble;
    if (!(v >= 0 && v <= 9007199254740992.0) || v != floor(v)) return 0;
    *out = (uint64_t)v;
    return 1;
}

static int cmp_begin(const void *a, const void *b) {
    const ck_tensor *x = *(const ck_tensor *const *)a, *y = *(const ck_tensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* Working set of one load; everything freed at the end. */
typedef struct ck_load {
    const unsigned char *data; /* the file's data section */
    size_t dlen;
    ck_tensor *t;              /* expected tensors, file offsets once seen */
    const char *meta[CK_FIXED_META + 1];
    const char **pmeta;        /* [count * 2]: dtype, shape strings */
    am_hparams hp;
    uint64_t seed;
} ck_load;

#define CK_FAIL(st, ...)                                                      \
    do {                                                                      \
        am_log(AM_LOG_ERROR, "checkpoint: " __VA_ARGS__);                     \
        return (st);                                                          \
    } while (0)

/* The metadata key k_fixed_meta[k], a string, into L->meta[k]. */
static am_status meta_string(const cJSON *meta, int k, ck_load *L) {
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(meta, k_fixed_meta[k]);
    if (!cJSON_IsString(c) || !c->valuestring)
        CK_FAIL(AM_ERR_FORMAT, "metadata key %s is missing", k_fixed_meta[k]);
    L->meta[k] = c->valuestring;
    return AM_OK;
}

/* What the file is comes first, so that a wrong file is named as such
 * rather than by its first odd key (or its checksum: another version may
 * sum otherwise). */
static am_status load_format(const cJSON *meta, ck_load *L) {
    AM_CHECK(meta_string(meta, M_FORMAT, L));
    AM_CHECK(meta_string(meta, M_VERSION, L));
    if (strcmp(L->meta[M_FORMAT], CK_FORMAT_NAME) != 0)
        CK_FAIL(AM_ERR_FORMAT, "format is \"%s\", not \"%s\"", L->meta[M_FORMAT],
                CK_FORMAT_NAME);
    if (strcmp(L->meta[M_VERSION], CK_FORMAT_VERSION) != 0)
        CK_FAIL(AM_ERR_FORMAT, "format_version %s is not supported (this library reads %s)",
                L->meta[M_VERSION], CK_FORMAT_VERSION);
    return AM_OK;
}

/* The file's tensor entry c as the checksum reads it, appended to it: a
 * string dtype, a shape of at most AM_MAX_DIMS sizes, data_offsets [b, e]
 * inside the data. */
static am_status checksum_entry(const cJSON *c, const ck_load *L, ck_items *it) {
    const char *name = c->string ? c->string : "?";
    const cJSON *dt, *sh, *of, *d;
    int64_t dims[AM_MAX_DIMS];
    int32_t n = 0;
    uint64_t v, b = 0, e = 0;
    if (!c->string || !cJSON_IsObject(c)) CK_FAIL(AM_ERR_FORMAT, "%s is not an object", name);
    dt = cJSON_GetObjectItemCaseSensitive(c, "dtype");
    sh = cJSON_GetObjectItemCaseSensitive(c, "shape");
    of = cJSON_GetObjectItemCaseSensitive(c, "data_offsets");
    if (!cJSON_IsString(dt) || !dt->valuestring)
        CK_FAIL(AM_ERR_FORMAT, "%s: dtype is missing or not a string", name);
    if (!cJSON_IsArray(sh)) CK_FAIL(AM_ERR_FORMAT, "%s: shape is missing or not an array", name);
    for (d = sh->child; d; d = d->next) {
        if (n == AM_MAX_DIMS || !json_size(d, &v))
            CK_FAIL(AM_ERR_FORMAT, "%s: shape is not a list of at most %d sizes", name,
                    AM_MAX_DIMS);
        dims[n++] = (int64_t)v;
    }
    if (!cJSON_IsArray(of) || cJSON_GetArraySize(of) != 2 || !json_size(of->child, &b) ||
        !json_size(of->child->next, &e) || b > e || e > L->dlen)
        CK_FAIL(AM_ERR_FORMAT, "%s: data_offsets are not [begin, end] inside the %zu data bytes",
                name, L->dlen);
    tensor_entry_item(it, name, dt->valuestring, n, dims, L->data + b, (size_t)(e - b));
    return AM_OK;
}

/* The checksum of the file's own contents, as the writer computed it (the
 * canonical items of ck_item: every metadata entry but the checksum, every
 * tensor entry's name, dtype, shape and bytes), read from the header alone,
 * not from the registered parameters, against the checksum the file gives.
 * So a damaged file is called corrupt before it is compared with the
 * optimizer: a flipped bit in a shape or in num_params was reported as a
 * mismatch, "another registered" (found by a review, twenty-fourth
 * session). Every file this library writes can be read so; an entry that
 * cannot (checksum_entry, a metadata value that is not a string) is
 * damage too, named here (when it was left to the checks after this, a
 * second damaged byte elsewhere made the file a mismatch again; found by a
 * second review). */
static am_status verify_checksum(const cJSON *root, const cJSON *meta, const ck_load *L) {
    ck_items it;
    const cJSON *c, *given;
    char crc[24];
    am_status st = AM_OK;
    memset(&it, 0, sizeof it);
    given = cJSON_GetObjectItemCaseSensitive(meta, k_fixed_meta[M_CHECKSUM]);
    if (!cJSON_IsString(given) || !given->valuestring)
        CK_FAIL(AM_ERR_FORMAT, "metadata key %s is missing", k_fixed_meta[M_CHECKSUM]);
    for (c = meta->child; st == AM_OK && c; c = c->next) {
        if (!c->string || !cJSON_IsString(c) || !c->valuestring) {
            am_log(AM_LOG_ERROR, "checkpoint: metadata %s is not a string",
                   c->string ? c->string : "?");
            st = AM_ERR_FORMAT;
        } else if (strcmp(c->string, k_fixed_meta[M_CHECKSUM]) != 0) {
            meta_item(&it, c->string, c->valuestring);
        }
    }
    for (c = root->child; st == AM_OK && c; c = c->next)
        if (!c->string || strcmp(c->string, "__metadata__") != 0) st = checksum_entry(c, L, &it);
    if (st == AM_OK && it.oom) {
        am_log(AM_LOG_ERROR, "checkpoint: out of memory");
        st = AM_ERR_OUT_OF_MEMORY;
    }
    if (st == AM_OK)
        snprintf(crc, sizeof crc, "crc32:%08lx", (unsigned long)am_ck_checksum(&it));
    am_ck_items_free(&it);
    if (st != AM_OK) return st;
#ifndef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
    if (strcmp(crc, given->valuestring) != 0)
        CK_FAIL(AM_ERR_FORMAT, "checksum is %s, the contents give %s: the file is corrupt",
                given->valuestring, crc);
#else
    /* Fuzzing builds only (scripts/fuzz.sh): a random mutation almost never
     * keeps the CRC right, so the checks behind it would go unexplored. */
#endif
    return AM_OK;
}

/* The metadata: every key known, present once, a string; parameter count,
 * dtypes, shapes, hyperparameters and seed valid (format and version:
 * load_format). */
static am_status load_meta(const am_optimizer *o, const cJSON *meta, ck_load *L) {
    const cJSON *c;
    int32_t p;
    int k;
    uint64_t v;
    AM_CHECK(meta_string(meta, M_NUM, L));
    if (!am_ck_parse_u64(L->meta[M_NUM], &v))
        CK_FAIL(AM_ERR_FORMAT, "num_params \"%s\" is not a count", L->meta[M_NUM]);
    if (v != (uint64_t)o->count)
        CK_FAIL(AM_ERR_MISMATCH, "the file has %s parameters, the optimizer %d",
                L->meta[M_NUM], (int)o->count);
    memset(L->meta, 0, sizeof L->meta);
    for (c = meta->child; c; c = c->next) {
        const char *key = c->string, *rest;
        const char **slot = NULL;
        if (!key || !cJSON_IsString(c) || !c->valuestring)
            CK_FAIL(AM_ERR_FORMAT, "metadata %s is not a string", key ? key : "?");
        for (k = 0; k <= CK_FIXED_META; k++)
            if (strcmp(key, k_fixed_meta[k]) == 0) slot = &L->meta[k];
        if (!slot && (rest = parse_param_prefix(key, o->count, &p)) != NULL) {
            if (strcmp(rest, "dtype") == 0) slot = &L->pmeta[2 * p];
            if (strcmp(rest, "shape") == 0) slot = &L->pmeta[2 * p + 1];
        }
        if (!slot) CK_FAIL(AM_ERR_FORMAT, "unknown metadata key \"%s\"", key);
        if (*slot) CK_FAIL(AM_ERR_FORMAT, "metadata key %s appears twice", key);
        *slot = c->valuestring;
    }
    for (k = 0; k <= CK_FIXED_META; k++)
        if (!L->meta[k]) CK_FAIL(AM_ERR_FORMAT, "metadata key %s is missing", k_fixed_meta[k]);
    for (p = 0; p < o->count; p++) {
        const am_tensor *pt = &o->params[p].t;
        am_shape s;
        int32_t d, same;
        if (!L->pmeta[2 * p] || !L->pmeta[2 * p + 1])
            CK_FAIL(AM_ERR_FORMAT, "param.%d.dtype or .shape is missing", (int)p);
        if (strcmp(L->pmeta[2 * p], am_dtype_name(pt->dtype)) != 0)
            CK_FAIL(AM_ERR_MISMATCH, "param.%d is %s in the file, %s registered",
                    (int)p, L->pmeta[2 * p], am_dtype_name(pt->dtype));
        if (!am_ck_parse_dims(L->pmeta[2 * p + 1], &s.ndim, s.dims))
            CK_FAIL(AM_ERR_FORMAT, "param.%d.shape \"%s\" is not a shape", (int)p,
                    L->pmeta[2 * p + 1]);
        same = s.ndim == pt->shape.ndim;
        for (d = 0; same && d < s.ndim; d++) same = s.dims[d] == pt->shape.dims[d];
        if (!same) {
            char reg[AM_MAX_DIMS * 21 + 3];
            am_ck_dims_str(reg, sizeof reg, pt->shape.ndim, pt->shape.dims);
            CK_FAIL(AM_ERR_MISMATCH, "param.%d has shape %s in the file, %s registered",
                    (int)p, L->pmeta[2 * p + 1], reg);
        }
    }
    for (k = 0; k < 8; k++)
        if (!am_ck_parse_double(L->meta[M_HP0 + k], hp_field(&L->hp, k)))
            CK_FAIL(AM_ERR_FORMAT, "%s = \"%s\" is not a number", k_fixed_meta[M_HP0 + k],
                    L->meta[M_HP0 + k]);
    if (am_hparams_validate(&L->hp) != AM_OK)
        CK_FAIL(AM_ERR_FORMAT, "the hyperparameters are invalid (see the previous message)");
    if (!am_ck_parse_u64(L->meta[M_SEED], &L->seed))
        CK_FAIL(AM_ERR_FORMAT, "seed \"%s\" is not an unsigned 64-bit integer", L->meta[M_SEED]);
    return AM_OK;
}

/* One tensor entry {"dtype", "shape", "data_offsets"} against t. */
static am_status load_entry(const cJSON *e, const char *name, ck_tensor *t, size_t dlen) {
    const cJSON *c, *dt = NULL, *sh = NULL, *of = NULL;
    uint64_t b, en, v;
    int32_t n = 0;
    int same = 1;
    if (!cJSON_IsObject(e)) CK_FAIL(AM_ERR_FORMAT, "%s is not an object", name);
    for (c = e->child; c; c = c->next) {
        const cJSON **slot = NULL;
        if (c->string && strcmp(c->string, "dtype") == 0) slot = &dt;
        if (c->string && strcmp(c->string, "shape") == 0) slot = &sh;
        if (c->string && strcmp(c->string, "data_offsets") == 0) slot = &of;
        if (!slot || *slot) CK_FAIL(AM_ERR_FORMAT, "%s: unexpected or repeated key", name);
        *slot = c;
    }
    if (!dt || !sh || !of) CK_FAIL(AM_ERR_FORMAT, "%s: dtype, shape or data_offsets missing", name);
    if (!cJSON_IsString(dt) || strcmp(dt->valuestring, t->dtype) != 0)
        CK_FAIL(AM_ERR_FORMAT, "%s: dtype must be %s", name, t->dtype);
    if (!cJSON_IsArray(sh)) CK_FAIL(AM_ERR_FORMAT, "%s: shape is not an array", name);
    for (c = sh->child; c; c = c->next, n++) {
        if (!json_size(c, &v)) CK_FAIL(AM_ERR_FORMAT, "%s: shape holds a non-size", name);
        if (n >= t->ndim || v != (uint64_t)t->dims[n]) same = 0;
    }
    if (!same || n != t->ndim)
        CK_FAIL(AM_ERR_MISMATCH, "%s: shape differs from the registered parameter's", name);
    if (!cJSON_IsArray(of) || cJSON_GetArraySize(of) != 2 || !json_size(of->child, &b) ||
        !json_size(of->child->next, &en))
        CK_FAIL(AM_ERR_FORMAT, "%s: data_offsets must be [begin, end]", name);
    if (b > en || en > dlen || en - b != (uint64_t)t->count * t->elem)
        CK_FAIL(AM_ERR_FORMAT, "%s: data_offsets [%llu, %llu] do not fit (%zu data bytes)",
                name, (unsigned long long)b, (unsigned long long)en, dlen);
    t->begin = (size_t)b;
    t->end = (size_t)en;
    t->seen = 1;
    return AM_OK;
}

/* Every tensor entry of the header; then all present, tiling the data. */
static am_status load_tensors(const am_optimizer *o, const cJSON *root, ck_load *L) {
    const cJSON *c;
    size_t n = (size_t)o->count * F_COUNT, k, m = 0, at = 0;
    ck_tensor **byoff;
    int metas = 0;
    for (c = root->child; c; c = c->next) {
        const char *rest;
        int32_t p;
        int f;
        if (c->string && strcmp(c->string, "__metadata__") == 0) {
            if (metas++) CK_FAIL(AM_ERR_FORMAT, "__metadata__ appears twice");
            continue;
        }
        rest = c->string ? parse_param_prefix(c->string, o->count, &p) : NULL;
        for (f = 0; rest && f < F_COUNT; f++)
            if (strcmp(rest, k_field[f]) == 0) break;
        if (!rest || f == F_COUNT || !L->t[(size_t)p * F_COUNT + (size_t)f].present)
            CK_FAIL(AM_ERR_FORMAT, "unexpected tensor \"%s\"", c->string ? c->string : "?");
        if (L->t[(size_t)p * F_COUNT + (size_t)f].seen)
            CK_FAIL(AM_ERR_FORMAT, "tensor %s appears twice", c->string);
        AM_CHECK(load_entry(c, c->string, &L->t[(size_t)p * F_COUNT + (size_t)f], L->dlen));
    }
    byoff = (ck_tensor **)malloc((n ? n : 1) * sizeof *byoff);
    AM_RETURN_IF(!byoff, AM_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    for (k = 0; k < n; k++) {
        if (!L->t[k].present) continue;
        if (!L->t[k].seen) {
            free(byoff);
            CK_FAIL(AM_ERR_FORMAT, "tensor param.%d.%s is missing", (int)(k / F_COUNT),
                    k_field[k % F_COUNT]);
        }
        byoff[m++] = &L->t[k];
    }
    /* As safetensors requires: the tensors cover the data without gaps. */
    qsort(byoff, m, sizeof *byoff, cmp_begin);
    for (k = 0; k < m && byoff[k]->begin == at; k++) at = byoff[k]->end;
    free(byoff);
    if (k != m || at != L->dlen)
        CK_FAIL(AM_ERR_FORMAT, "the tensors do not tile the %zu data bytes", L->dlen);
    return AM_OK;
}

/* Checks every value of the file's data (little-endian, maybe unaligned),
 * a piece at a time through a small host-order buffer: the state is not
 * decoded whole beside the file (that copy made a load take twice the
 * state beside the optimizer's own: a review, thirty-fifth session). */
static am_status load_values(const am_optimizer *o, ck_load *L) {
    int32_t p;
    for (p = 0; p < o->count; p++) {
        ck_tensor *t = &L->t[(size_t)p * F_COUNT];
        int f;
        am_geom g;
        int64_t rows, m, rb, r, i, i0;
        const uint8_t *pol;
        for (f = 0; f < F_COUNT; f++) {
            if (!t[f].present) continue;
            if (t[f].elem == 4) {
                /* lrs are clamped to [min_lr >= 0, max_lr] and moments are
                 * averages of squares: never negative. NaN and +inf are
                 * accepted: hyperparameters beyond float32's range (max_lr,
                 * lr_bump_rate; accepted until the twenty-second session)
                 * could produce them, and a state the optimizer held must
                 * always load again. */
                float x[1024];
                for (i0 = 0; i0 < t[f].count; i0 += 1024) {
                    const int64_t n = t[f].count - i0 < 1024 ? t[f].count - i0 : 1024;
                    am_ck_copy_le(x, L->data + t[f].begin + 4 * (size_t)i0, n, 4);
                    for (i = 0; i < n; i++)
                        if (x[i] < 0)
                            CK_FAIL(AM_ERR_FORMAT, "param.%d.%s[%lld] = %g is negative",
                                    (int)p, k_field[f], (long long)(i0 + i), (double)x[i]);
                }
            } else if (t[f].elem == 8) {
                int64_t v;
                am_ck_copy_le(&v, L->data + t[f].begin, 1, 8);
                if (v < 0)
                    CK_FAIL(AM_ERR_FORMAT, "param.%d.%s = %lld is negative", (int)p,
                            k_field[f], (long long)v);
            }
        }
        /* Padding bits of each lr-row's last polarity byte must be zero. */
        (void)am_geom_init(&o->params[p].t.shape, &g);
        rows = g.ndim >= 2 ? g.lr_rows : 1;
        m = g.ndim >= 2 ? g.m : g.numel;
        rb = g.ndim >= 2 ? g.pol_row_bytes : g.sizes.polarity_bytes;
        pol = L->data + t[F_POL].begin;
        for (r = 0; m % 8 != 0 && r < rows; r++)
            if (pol[r * rb + rb - 1] & (uint8_t)(0xFFu << (m % 8)))
                CK_FAIL(AM_ERR_FORMAT, "param.%d.polarity: padding bits of row %lld are set",
                        (int)p, (long long)r);
    }
    return AM_OK;
}

/* Cannot fail: every value was checked. From the file's data straight into
 * the state. */
static void commit(am_optimizer *o, const ck_load *L) {
    int32_t p;
    o->hp = L->hp;
    /* a file we did not write may hold a start lr create would have forced
     * (the parameters registered later start from it) */
    am_force_start_lr(&o->hp);
    o->seed = L->seed;
    for (p = 0; p < o->count; p++) {
        am_param_slot *s = &o->params[p];
        const ck_tensor *t = &L->t[(size_t)p * F_COUNT];
        const unsigned char *b = L->data;
        am_ck_copy_le(s->st.lr, b + t[F_LR].begin, t[F_LR].count, 4);
        am_ck_copy_le(s->st.polarity, b + t[F_POL].begin, t[F_POL].count, 1);
        if (t[F_ROW].present) am_ck_copy_le(s->st.row, b + t[F_ROW].begin, t[F_ROW].count, 4);
        if (t[F_COL].present) am_ck_copy_le(s->st.col, b + t[F_COL].begin, t[F_COL].count, 4);
        if (t[F_SQ].present) am_ck_copy_le(s->st.sq, b + t[F_SQ].begin, t[F_SQ].count, 4);
        am_ck_copy_le(&s->st.step, b + t[F_STEP].begin, 1, 8);
        am_ck_copy_le(&s->skipped, b + t[F_SKIPPED].begin, 1, 8);
    }
}

static am_status load_image(am_optimizer *o, const unsigned char *img, size_t size,
                            ck_load *L, cJSON **root, char **hdr) {
    uint64_t hlen = 0;
    const char *end = NULL;
    const cJSON *meta;
    int k;
    if (size < 8) CK_FAIL(AM_ERR_FORMAT, "%zu bytes is too short", size);
    for (k = 7; k >= 0; k--) hlen = (hlen << 8) | img[k];
    if (hlen > CK_MAX_HEADER || hlen > size - 8)
        CK_FAIL(AM_ERR_FORMAT, "header length %llu does not fit the %zu-byte file",
                (unsigned long long)hlen, size);
    L->data = img + 8 + hlen;
    L->dlen = size - 8 - (size_t)hlen;
    *hdr = (char *)malloc((size_t)hlen + 1);
    AM_RETURN_IF(!*hdr, AM_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    memcpy(*hdr, img + 8, (size_t)hlen);
    (*hdr)[hlen] = '\0';
    /* JSON allows no control bytes but its whitespace (space, tab, LF, CR),
     * and the padding after the object is spaces; cJSON would skip any
     * byte below 0x21 as whitespace (a NUL or a flipped bit in the padding
     * loaded, which safetensors refuses). */
    {
        uint64_t q;
        for (q = 0; q < hlen; q++) {
            const unsigned char c = (unsigned char)(*hdr)[q];
            if (c < 0x20 && c != '\t' && c != '\n' && c != '\r')
                CK_FAIL(AM_ERR_FORMAT, "the header holds a control byte 0x%02x at offset %llu",
                        (unsigned)c, (unsigned long long)(8 + q));
        }
    }
    /* A NUL inside the header would end parsing early: require the end. */
    *root = cJSON_ParseWithLengthOpts(*hdr, (size_t)hlen + 1, &end, 1);
    if (!*root || end != *hdr + hlen || !cJSON_IsObject(*root))
        CK_FAIL(AM_ERR_FORMAT, "the header is not a JSON object");
    meta = cJSON_GetObjectItemCaseSensitive(*root, "__metadata__");
    if (!cJSON_IsObject(meta)) CK_FAIL(AM_ERR_FORMAT, "__metadata__ is missing");
    {
        size_t our_len; /* (the file's own offsets are what the load reads) */
        L->t = plan_layout(o, &our_len);
    }
    L->pmeta = (const char **)calloc(2 * (size_t)o->count + 1, sizeof *L->pmeta);
    AM_RETURN_IF(!L->t || !L->pmeta, AM_ERR_OUT_OF_MEMORY, "checkpoint: out of memory");
    /* In this order: what the file is; whether it is intact; whether it
     * matches the optimizer and holds valid values. */
    AM_CHECK(load_format(meta, L));
    AM_CHECK(verify_checksum(*root, meta, L));
    AM_CHECK(load_meta(o, meta, L));
    AM_CHECK(load_tensors(o, *root, L));
    return load_values(o, L);
}

static am_status load_memory_impl(am_optimizer *o, const void *image, size_t size) {
    ck_load L;
    cJSON *root = NULL;
    char *hdr = NULL;
    am_status st;
    AM_RETURN_IF(!o, AM_ERR_NULL_POINTER, "am_optimizer_load_memory: opt is NULL");
    AM_RETURN_IF(!image, AM_ERR_NULL_POINTER, "am_optimizer_load_memory: image is NULL");
    memset(&L, 0, sizeof L);
    st = load_image(o, (const unsigned char *)image, size, &L, &root, &hdr);
    if (st == AM_OK) commit(o, &L);
    cJSON_Delete(root);
    free(hdr);
    free(L.t);
    free(L.pmeta);
    return st;
}

/* In IEEE defaults (fpenv.h): the value checks compare NaN moments, which
 * must load, and a caller with floating-point traps enabled got SIGFPE. */
am_status am_optimizer_load_memory(am_optimizer *o, const void *image, size_t size) {
    AM_FPENV_RETURN(load_memory_impl(o, image, size));
}
