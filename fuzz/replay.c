/* replay.c — feeds files to a libFuzzer target without libFuzzer, so the
 * committed corpus (and any crash file) runs in the normal test suite with
 * any compiler, under ASan or valgrind.
 * Usage: <target>_replay FILE_OR_DIR...   Fails when nothing was replayed. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static long g_count;

static int replay_file(const char *path) {
    FILE *f = fopen(path, "rb");
    unsigned char *buf;
    long n;
    if (!f) {
        fprintf(stderr, "replay: cannot open %s\n", path);
        return 1;
    }
    if (fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return 1;
    }
    /* exactly n bytes, so ASan sees any read past the input */
    buf = (unsigned char *)malloc(n ? (size_t)n : 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fclose(f);
        free(buf);
        fprintf(stderr, "replay: cannot read %s\n", path);
        return 1;
    }
    fclose(f);
    LLVMFuzzerTestOneInput(buf, (size_t)n);
    free(buf);
    g_count++;
    return 0;
}

static int cmp(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int replay_path(const char *path) {
    struct stat sb;
    DIR *d;
    struct dirent *e;
    char **names = NULL;
    size_t n = 0, cap = 0, i;
    int err = 0;
    if (stat(path, &sb) != 0) {
        fprintf(stderr, "replay: %s does not exist\n", path);
        return 1;
    }
    if (!S_ISDIR(sb.st_mode)) return replay_file(path);
    d = opendir(path);
    if (!d) return 1;
    while ((e = readdir(d)) != NULL) {
        size_t len;
        if (e->d_name[0] == '.') continue;
        if (n == cap) {
            char **nn;
            cap = cap ? cap * 2 : 64;
            nn = (char **)realloc(names, cap * sizeof *names);
            if (!nn) break;
            names = nn;
        }
        len = strlen(path) + strlen(e->d_name) + 2;
        names[n] = (char *)malloc(len);
        if (!names[n]) break;
        snprintf(names[n], len, "%s/%s", path, e->d_name);
        n++;
    }
    closedir(d);
    if (n) qsort(names, n, sizeof *names, cmp); /* same order every run */
    for (i = 0; i < n; i++) {
        err |= replay_path(names[i]);
        free(names[i]);
    }
    free(names);
    return err;
}

int main(int argc, char **argv) {
    int i, err = 0;
    for (i = 1; i < argc; i++) err |= replay_path(argv[i]);
    printf("replayed %ld inputs\n", g_count);
    return err || g_count == 0;
}
