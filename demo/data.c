/* data.c — loading the word list and building next-character examples. */
#include "data.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

uint64_t dm_rand_u64(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

double dm_rand_unit(uint64_t *s) {
    return (double)(dm_rand_u64(s) >> 11) * (1.0 / 9007199254740992.0);
}

double dm_rand_normal(uint64_t *s) {
    double u1 = dm_rand_unit(s), u2 = dm_rand_unit(s);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

int dm_token(char c) { return (c >= 'a' && c <= 'z') ? c - 'a' + 1 : 0; }
char dm_char(int token) { return token <= 0 ? '.' : (char)('a' + token - 1); }

/* Keeps line (len characters, no newline) if it is [a-z]{1,DM_MAX_WORD}. */
static int usable(const char *line, size_t len) {
    size_t i;
    if (len == 0 || len > DM_MAX_WORD) return 0;
    for (i = 0; i < len; i++)
        if (line[i] < 'a' || line[i] > 'z') return 0;
    return 1;
}

int dm_words_load(const char *path, dm_words *out, char *err, int errsz) {
    FILE *f = fopen(path, "rb");
    char *buf = NULL, *p, *end;
    long size;
    int64_t n = 0, cap = 0;
    char **w = NULL;
    memset(out, 0, sizeof *out);
    if (!f) {
        snprintf(err, (size_t)errsz, "cannot open data file '%s': %s", path, strerror(errno));
        return -1;
    }
    {   /* read to the end in growing chunks: a pipe (--data <(...)) has no
         * size to ask for, and a directory's ftell was about 2^63 ("out of
         * memory") */
        struct stat st;
        size_t bcap = 0, got;
        if (fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) {
            snprintf(err, (size_t)errsz, "data file '%s' is a directory", path);
            fclose(f);
            return -1;
        }
        size = 0;
        for (;;) {
            if ((size_t)size + 65536 + 1 > bcap) {
                char *grown;
                bcap = bcap ? 2 * bcap : 1 << 20;
                grown = realloc(buf, bcap);
                if (!grown) {
                    snprintf(err, (size_t)errsz, "cannot read data file '%s': out of memory",
                             path);
                    free(buf);
                    fclose(f);
                    return -1;
                }
                buf = grown;
            }
            got = fread(buf + size, 1, bcap - 1 - (size_t)size, f);
            size += (long)got;
            if (got == 0) break;
            if (size > DM_MAX_DATA_BYTES) {
                snprintf(err, (size_t)errsz, "data file '%s' is larger than %ld MiB: a word "
                         "list of that size is not what the demo trains on", path,
                         DM_MAX_DATA_BYTES >> 20);
                free(buf);
                fclose(f);
                return -1;
            }
        }
        if (ferror(f)) {
            snprintf(err, (size_t)errsz, "cannot read data file '%s': %s", path,
                     strerror(errno));
            free(buf);
            fclose(f);
            return -1;
        }
        fclose(f);
    }
    buf[size] = '\0';
    /* Split in place: each kept line becomes a NUL-terminated string. */
    for (p = buf, end = buf + size; p < end;) {
        char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t len = nl ? (size_t)(nl - p) : (size_t)(end - p);
        if (len > 0 && p[len - 1] == '\r') len--;
        if (usable(p, len)) {
            if (n == cap) {
                char **grown;
                cap = cap ? 2 * cap : 1024;
                grown = realloc(w, (size_t)cap * sizeof *w);
                if (!grown) {
                    snprintf(err, (size_t)errsz, "out of memory reading '%s'", path);
                    free(w);
                    free(buf);
                    return -1;
                }
                w = grown;
            }
            p[len] = '\0';
            w[n++] = p;
        }
        p = nl ? nl + 1 : end;
    }
    if (n < 10) {
        snprintf(err, (size_t)errsz,
                 "data file '%s' has %lld usable words (lines of a-z only); need at least 10",
                 path, (long long)n);
        free(w);
        free(buf);
        return -1;
    }
    out->w = w;
    out->n = n;
    out->storage = buf;
    return 0;
}

void dm_words_free(dm_words *w) {
    free(w->w);
    free(w->storage);
    memset(w, 0, sizeof *w);
}

void dm_words_shuffle(dm_words *w, uint64_t seed) {
    int64_t i;
    for (i = w->n - 1; i > 0; i--) {
        int64_t j = (int64_t)(dm_rand_u64(&seed) % (uint64_t)(i + 1));
        char *t = w->w[i];
        w->w[i] = w->w[j];
        w->w[j] = t;
    }
}

int dm_examples_build(const dm_words *w, int64_t begin, int64_t end, int ctx,
                      dm_examples *out) {
    int64_t i, n = 0, k = 0;
    memset(out, 0, sizeof *out);
    for (i = begin; i < end; i++) n += (int64_t)strlen(w->w[i]) + 1;
    out->X = malloc((size_t)(n * ctx));
    out->Y = malloc((size_t)n);
    if (!out->X || !out->Y) {
        dm_examples_free(out);
        return -1;
    }
    out->ctx = ctx;
    out->n = n;
    for (i = begin; i < end; i++) {
        const char *s = w->w[i];
        uint8_t window[DM_MAX_WORD + 1];
        size_t len = strlen(s), j;
        int c;
        memset(window, 0, sizeof window); /* '.' padding */
        for (j = 0; j <= len; j++, k++) {
            for (c = 0; c < ctx; c++) out->X[k * ctx + c] = window[c];
            out->Y[k] = (uint8_t)(j < len ? dm_token(s[j]) : 0);
            /* slide: drop the oldest token, append the one just predicted */
            memmove(window, window + 1, (size_t)(ctx - 1));
            window[ctx - 1] = out->Y[k];
        }
    }
    return 0;
}

void dm_examples_free(dm_examples *e) {
    free(e->X);
    free(e->Y);
    memset(e, 0, sizeof *e);
}
