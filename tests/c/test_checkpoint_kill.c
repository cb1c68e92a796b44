/* test_checkpoint_kill.c — a process killed (SIGKILL) in the middle of a
 * save leaves the previous checkpoint loadable and byte-identical.
 *
 * No timing: the child saves with AUTOMAGIC_TEST_STALL_SAVE_FD naming a
 * pipe; the library writes half of its temporary file, signals the pipe and
 * waits. The parent reads the signal, checks that the half-written temporary
 * file is really there (and, where /proc shows it, that the child's
 * descriptor of it is close-on-exec), kills the child and loads the
 * checkpoint. */
#define _POSIX_C_SOURCE 200809L
#include <automagic.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "test_image.h"
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

static char g_dir[64];


static unsigned char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    unsigned char *b;
    long len;
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    len = ftell(f);
    fseek(f, 0, SEEK_SET);
    b = (unsigned char *)malloc((size_t)len + 1);
    assert_int_equal(fread(b, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    *n = (size_t)len;
    return b;
}

/* The temporary file's size, or -1 when there is none. */
static long tmp_file_size(char *name, size_t cap) {
    DIR *d = opendir(g_dir);
    struct dirent *e;
    long size = -1;
    while (d && (e = readdir(d)) != NULL)
        if (strstr(e->d_name, ".tmp.")) {
            struct stat sb;
            snprintf(name, cap, "%s/%s", g_dir, e->d_name);
            if (stat(name, &sb) == 0) size = (long)sb.st_size;
        }
    if (d) closedir(d);
    return size;
}

/* Whether process pid's descriptor of file name is close-on-exec (1), is
 * not (0), or cannot be told here (-1: no /proc, or no such descriptor).
 * Without it a program another thread of the saving process started while
 * a save ran (fork and exec, system()) kept a writable descriptor of what
 * becomes the checkpoint (found by a review, fortieth session). */
static int fd_cloexec(pid_t pid, const char *name) {
    char dir[64], link[512], target[512], info[640], line[128];
    DIR *d;
    struct dirent *e;
    int found = -1;
    snprintf(dir, sizeof dir, "/proc/%ld/fd", (long)pid);
    d = opendir(dir);
    while (d && found < 0 && (e = readdir(d)) != NULL) {
        ssize_t len;
        FILE *f;
        snprintf(link, sizeof link, "%s/%s", dir, e->d_name);
        len = readlink(link, target, sizeof target - 1);
        if (len <= 0) continue;
        target[len] = 0;
        if (strcmp(target, name) != 0) continue;
        snprintf(info, sizeof info, "/proc/%ld/fdinfo/%s", (long)pid, e->d_name);
        f = fopen(info, "r");
        while (f && fgets(line, sizeof line, f))
            if (!strncmp(line, "flags:", 6))
                found = (strtol(line + 6, NULL, 8) & O_CLOEXEC) != 0;
        if (f) fclose(f);
    }
    if (d) closedir(d);
    return found;
}

static void train(am_optimizer *o, float *g, int steps) {
    int s, i;
    for (s = 0; s < steps; s++) {
        for (i = 0; i < 4096; i++) g[i] = (float)((i * 31 + s * 7) % 17) - 8.0f;
        assert_int_equal(am_optimizer_update_param(o, 0, g, AM_DTYPE_FLOAT32, NULL), AM_OK);
    }
}

static void test_kill_during_save(void **unused) {
    static float w[4096], g[4096];
    const int64_t shape[2] = {64, 64};
    am_hparams hp = am_hparams_default();
    am_optimizer *o;
    int32_t id;
    char path[128], tmpname[512];
    unsigned char *old_img, *file_before, *file_after, *loaded;
    size_t n_old, n_fb, n_fa, n_l;
    int fds[2], status, cloexec;
    char c;
    pid_t pid;
    long partial;
    (void)unused;
    snprintf(g_dir, sizeof g_dir, "/tmp/am_kill_XXXXXX");
    assert_non_null(mkdtemp(g_dir));
    snprintf(path, sizeof path, "%s/ckpt.safetensors", g_dir);
    hp.lr = 1e-3;
    assert_int_equal(am_optimizer_create(&hp, 5, &o), AM_OK);
    assert_int_equal(am_optimizer_add_param(o, w, AM_DTYPE_FLOAT32, 2, shape, &id), AM_OK);
    train(o, g, 3);
    assert_int_equal(am_optimizer_save(o, path), AM_OK);
    old_img = t_image(o, &n_old);
    file_before = read_file(path, &n_fb);
    assert_int_equal(n_fb, n_old);
    assert_memory_equal(file_before, old_img, n_old);

    /* The child trains on and saves over the same path; killed midway. */
    assert_int_equal(pipe(fds), 0);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        char fdstr[16];
        close(fds[0]);
        train(o, g, 5);
        snprintf(fdstr, sizeof fdstr, "%d", fds[1]);
        setenv("AUTOMAGIC_TEST_STALL_SAVE_FD", fdstr, 1);
        am_optimizer_save(o, path); /* stalls in the hook */
        _exit(3);                   /* reached only if the hook is broken */
    }
    close(fds[1]);
    assert_int_equal(read(fds[0], &c, 1), 1);
    close(fds[0]);
    partial = tmp_file_size(tmpname, sizeof tmpname);
    assert_true(partial > 0);
    assert_true((size_t)partial < n_old); /* really half-written */
    cloexec = fd_cloexec(pid, tmpname); /* (asserted once the child is gone) */
    assert_int_equal(kill(pid, SIGKILL), 0);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    if (cloexec < 0)
        print_message("the saving child's descriptors cannot be read (no /proc?): "
                      "close-on-exec not checked\n");
    else
        assert_int_equal(cloexec, 1);

    /* The checkpoint is the old one, byte for byte, and loads. */
    file_after = read_file(path, &n_fa);
    assert_int_equal(n_fa, n_fb);
    assert_memory_equal(file_after, file_before, n_fb);
    train(o, g, 2); /* move the state on, so the load visibly restores it */
    assert_int_equal(am_optimizer_load(o, path), AM_OK);
    loaded = t_image(o, &n_l);
    assert_int_equal(n_l, n_old);
    assert_memory_equal(loaded, old_img, n_old);
    /* The half-written temporary file is not a checkpoint. */
    assert_true(am_status_is_error(am_optimizer_load(o, tmpname)));
    unlink(tmpname);

    /* A save that completes replaces it. */
    train(o, g, 1);
    assert_int_equal(am_optimizer_save(o, path), AM_OK);
    free(file_after);
    file_after = read_file(path, &n_fa);
    free(loaded);
    loaded = t_image(o, &n_l);
    assert_int_equal(n_fa, n_l);
    assert_memory_equal(file_after, loaded, n_l);
    assert_int_equal(tmp_file_size(tmpname, sizeof tmpname), -1);

    unlink(path);
    rmdir(g_dir);
    free(old_img);
    free(file_before);
    free(file_after);
    free(loaded);
    am_optimizer_destroy(o);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kill_during_save),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
