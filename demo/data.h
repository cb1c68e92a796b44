/*
 * data.h — a word list turned into next-character examples.
 *
 * Alphabet: token 0 is '.', the word boundary; tokens 1..26 are 'a'..'z'.
 * Only lines that are entirely lowercase ASCII letters are kept (the Debian
 * list also holds proper nouns and possessives such as "Aachen's").
 *
 * Each word w of length L gives L+1 examples: the ctx previous tokens (padded
 * with '.' at the start) predict the next one, the last example predicts '.'.
 */
#ifndef DM_DATA_H
#define DM_DATA_H

#include <stdint.h>

#define DM_VOCAB 27   /* '.', a..z */
#define DM_MAX_WORD 64 /* longer lines are skipped */
/* A word list larger than this is refused (Debian's wamerican is 1 MB):
 * --data /dev/zero read until memory ran out. */
#define DM_MAX_DATA_BYTES ((long)64 << 20)

/* A list of words, each a NUL-terminated lowercase string. */
typedef struct dm_words {
    char **w;       /* [n] */
    int64_t n;
    char *storage;  /* owns the strings */
} dm_words;

/* Examples: X is (n, ctx) tokens, Y is (n) next tokens. */
typedef struct dm_examples {
    int ctx;
    int64_t n;
    uint8_t *X;  /* (n, ctx) */
    uint8_t *Y;  /* (n) */
} dm_examples;

/* Reads path and keeps the [a-z]+ lines. Returns 0, or -1 with a message in
 * err (errsz bytes) when the file cannot be read or holds fewer than 10
 * usable words. */
int dm_words_load(const char *path, dm_words *out, char *err, int errsz);
void dm_words_free(dm_words *w);

/* Shuffles the words with seed (Fisher-Yates); the caller then takes the
 * first words for training and the last ones for validation. */
void dm_words_shuffle(dm_words *w, uint64_t seed);

/* Builds the examples of words[begin, end). Returns 0 or -1 (out of memory). */
int dm_examples_build(const dm_words *w, int64_t begin, int64_t end, int ctx,
                      dm_examples *out);
void dm_examples_free(dm_examples *e);

/* Token of a character ('.' for anything not a..z) and back. */
int dm_token(char c);
char dm_char(int token);

/* splitmix64: the demo's only random source (init, batches, sampling). */
uint64_t dm_rand_u64(uint64_t *s);
/* Uniform in [0, 1). */
double dm_rand_unit(uint64_t *s);
/* Standard normal (Box-Muller). */
double dm_rand_normal(uint64_t *s);

#endif /* DM_DATA_H */
