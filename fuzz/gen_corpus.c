/* gen_corpus.c — writes the seed corpora (committed under fuzz/corpus/):
 * valid checkpoints of the fuzz model in several states, checkpoints of
 * other models, damaged ones; and deterministic byte programs for the API
 * target. Usage: fuzz_gen_corpus OUT_DIR  (creates OUT_DIR/fuzz_checkpoint
 * and OUT_DIR/fuzz_api, which must exist). */
#define _POSIX_C_SOURCE 200809L
#include "fuzz_model.h"

#include <stdio.h>

static int put(const char *dir, const char *name, const unsigned char *b, size_t n) {
    char path[512];
    FILE *f;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    f = fopen(path, "wb");
    if (!f || fwrite(b, 1, n, f) != n) return 1;
    return fclose(f) != 0;
}

static int put_model(const char *dir, const char *name, const am_optimizer *o) {
    size_t n;
    unsigned char *b = fuzz_image(o, &n);
    int err = !b || put(dir, name, b, n);
    free(b);
    return err;
}

int main(int argc, char **argv) {
    char ck[400], api[400];
    fuzz_model m;
    unsigned char *b;
    size_t n, i;
    int err = 0, k;
    uint64_t x = 0x243F6A8885A308D3ull;
    if (argc != 2) return 2;
    snprintf(ck, sizeof ck, "%s/fuzz_checkpoint", argv[1]);
    snprintf(api, sizeof api, "%s/fuzz_api", argv[1]);
    /* the model in several states */
    if (fuzz_model_init(&m, 1)) return 1;
    err |= put_model(ck, "fresh", m.opt);
    fuzz_model_step(&m, 0, 0);
    err |= put_model(ck, "step1", m.opt);
    for (k = 1; k < 6; k++) fuzz_model_step(&m, k, k == 3);
    err |= put_model(ck, "step5_one_skip", m.opt);
    /* damaged copies of it */
    b = fuzz_image(m.opt, &n);
    if (!b) return 1;
    err |= put(ck, "truncated_half", b, n / 2);
    err |= put(ck, "header_only", b, 8 + (size_t)b[0] + 256u * b[1]);
    b[n - 3] ^= 0x40;
    err |= put(ck, "bad_crc", b, n);
    free(b);
    am_optimizer_destroy(m.opt);
    /* other models: a mismatch */
    {
        am_hparams hp = am_hparams_default();
        am_optimizer *o;
        float w[12] = {0};
        const int64_t s[2] = {3, 4};
        int32_t id;
        if (am_optimizer_create(&hp, 5, &o) != AM_OK) return 1;
        err |= put_model(ck, "no_params", o);
        (void)am_optimizer_add_param(o, w, AM_DTYPE_FLOAT32, 2, s, &id);
        err |= put_model(ck, "other_model", o);
        am_optimizer_destroy(o);
    }
    {
        static const char hdr[] = "{\"__metadata__\":{\"format\":\"automagic.optimizer\"}}";
        unsigned char buf[128];
        memset(buf, 0, 8);
        buf[0] = (unsigned char)(sizeof hdr - 1);
        memcpy(buf + 8, hdr, sizeof hdr - 1);
        err |= put(ck, "metadata_only", buf, 8 + sizeof hdr - 1);
    }
    /* API programs: deterministic pseudo-random bytes of several lengths */
    for (k = 0; k < 24; k++) {
        unsigned char prog[1536];
        char name[32];
        size_t len = 48u + (size_t)k * 61u;
        for (i = 0; i < len; i++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            prog[i] = (unsigned char)(x >> 24);
        }
        prog[0] = (unsigned char)k; /* each operation kind first */
        snprintf(name, sizeof name, "prog%02d", k);
        err |= put(api, name, prog, len);
    }
    return err;
}
