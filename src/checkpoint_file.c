/*
 * checkpoint_file.c — checkpoints on disk (POSIX): an atomic save and a
 * whole-file load. The format itself is in checkpoint.c.
 *
 * Save never leaves a partial file under the final name: the image goes to
 * "<path>.tmp.<pid>.<n>" (or, for a file name too long for that suffix,
 * "<dir>/.automagic.tmp.<pid>.<n>") in the same directory (so rename cannot
 * cross file systems), is flushed to the disk (fsync), then renamed over path, and the
 * directory is fsynced so the rename itself survives a power cut. A process
 * killed at any point leaves either the old checkpoint or the new one under
 * path (plus, at worst, a stale .tmp file).
 */
#define _POSIX_C_SOURCE 200809L
#include "checkpoint_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

/* Writes all of buf; 0 on success, else errno. */
static int write_all(int fd, const unsigned char *buf, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, buf, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        buf += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Test hook, for the kill-during-save test only: when the environment names
 * a file descriptor in AUTOMAGIC_TEST_STALL_SAVE_FD, save writes half of the
 * image, writes one byte to that descriptor, and waits to be killed. The
 * test then knows the process is in the middle of a save without any timing
 * assumption. */
static void test_stall_hook(void) {
    const char *s = getenv("AUTOMAGIC_TEST_STALL_SAVE_FD");
    char *end;
    long fd;
    if (!s || !*s) return;
    fd = strtol(s, &end, 10);
    if (*end || fd < 0) return;
    if (write((int)fd, "s", 1) != 1) return;
    for (;;) pause();
}

/* The directory holding path, opened for its fsync after the rename: here,
 * before anything is written, so that nothing after the rename can fail
 * but that fsync (its name's malloc came after the rename, and a failure
 * there reported "writing failed" with the new checkpoint in place; found
 * by a review, twenty-third session). Returns the descriptor, or -1 with
 * *err: ENOMEM (nothing may be written then) or open's errno (the save
 * goes on and reports the directory as not synced, as before). */
static int open_dir(const char *path, int *err) {
    const char *slash = strrchr(path, '/');
    size_t n = !slash ? 1 : slash == path ? 1 : (size_t)(slash - path);
    char *dir = (char *)malloc(n + 1);
    int fd;
    if (!dir) {
        *err = ENOMEM;
        return -1;
    }
    if (!slash) dir[0] = '.';
    else memcpy(dir, path, n);
    dir[n] = '\0';
    fd = open(dir, O_RDONLY | O_CLOEXEC);
    *err = fd < 0 ? errno : 0;
    free(dir);
    return fd;
}

/* fsync of that directory; file systems that cannot (EINVAL) are not an
 * error. Allocates nothing. */
static int sync_dir(int dfd, int open_err) {
    if (dfd < 0) return open_err;
    if (fsync(dfd) != 0 && errno != EINVAL) return errno;
    return 0;
}

am_status am_optimizer_save(const am_optimizer *o, const char *path) {
    unsigned char *img = NULL;
    size_t n = 0, plen;
    char *tmp;
    int fd = -1, err = 0, k, dfd, derr;
    am_status st;
    AM_RETURN_IF(!o, AM_ERR_NULL_POINTER, "am_optimizer_save: opt is NULL");
    AM_RETURN_IF(!path, AM_ERR_NULL_POINTER, "am_optimizer_save: path is NULL");
    AM_RETURN_IF(!*path, AM_ERR_INVALID_ARGUMENT, "am_optimizer_save: path is empty");
    {   /* named as such: "dir/" was "writing dir/ failed: Not a directory"
         * (the rename's error; found by a review, twenty-fourth session).
         * A device, FIFO or socket is refused, as the load refuses it: the
         * rename replaced it with a regular file (/dev/null, which a
         * trainer may pass to turn checkpoints off, as root; found by a
         * review, thirty-second session). A symbolic link to a regular
         * file (or to nothing) is replaced by the checkpoint (the rename
         * replaces the link, not its target); one to a directory or a
         * device is refused like them (it was replaced: thirty-fourth
         * session's review). */
        struct stat sb, tb;
        const int there = lstat(path, &sb) == 0;
        const int link = there && S_ISLNK(sb.st_mode);
        if (link && stat(path, &tb) == 0) sb = tb; /* what the link names */
        AM_RETURN_IF(there && S_ISDIR(sb.st_mode), AM_ERR_IO,
                     "am_optimizer_save: %s is a directory%s", path,
                     link ? " (through a symbolic link)" : "");
        AM_RETURN_IF(there && !S_ISREG(sb.st_mode) && !S_ISLNK(sb.st_mode), AM_ERR_IO,
                     "am_optimizer_save: %s is not a regular file (a device, FIFO or "
                     "socket%s): left as it is, nothing saved", path,
                     link ? ", through a symbolic link" : "");
    }
    plen = strlen(path);
    tmp = (char *)malloc(plen + 48);
    AM_RETURN_IF(!tmp, AM_ERR_OUT_OF_MEMORY, "am_optimizer_save: out of memory");
    dfd = open_dir(path, &derr);
    if (dfd < 0 && derr == ENOMEM) {
        free(tmp);
        AM_RETURN_IF(1, AM_ERR_OUT_OF_MEMORY, "am_optimizer_save: out of memory");
    }
    st = am_ck_serialize(o, &img, &n);
    if (st != AM_OK) {
        if (dfd >= 0) close(dfd);
        free(tmp);
        return st;
    }
    /* O_EXCL: never write into a file another saver is writing. A file name
     * near the system's limit (NAME_MAX, 255 bytes on Linux) leaves no room
     * for the suffix: then a short name in the same directory,
     * "<dir>/.automagic.tmp.<pid>.<n>" (found by a review, twenty-second
     * session: such a path could not be saved to). O_CLOEXEC: a program
     * another thread started meanwhile (fork and exec) kept a writable
     * descriptor of what becomes the checkpoint (a review, fortieth
     * session). */
    for (k = 0; k < 1000 && fd < 0; k++) {
        snprintf(tmp, plen + 48, "%s.tmp.%ld.%d", path, (long)getpid(), k);
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd < 0 && errno == ENAMETOOLONG) {
            const char *slash = strrchr(path, '/');
            const int dl = slash ? (int)(slash - path + 1) : 0;
            snprintf(tmp, plen + 48, "%.*s.automagic.tmp.%ld.%d", dl, path, (long)getpid(), k);
            fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        }
        if (fd < 0 && errno != EEXIST) break;
    }
    if (fd < 0) {
        err = errno;
        if (dfd >= 0) close(dfd);
        free(img);
        am_log(AM_LOG_ERROR, "am_optimizer_save: cannot create %s: %s", tmp, strerror(err));
        free(tmp);
        return AM_ERR_IO;
    }
    err = write_all(fd, img, n / 2);
    if (!err) test_stall_hook();
    if (!err) err = write_all(fd, img + n / 2, n - n / 2);
    if (!err && fsync(fd) != 0) err = errno;
    if (close(fd) != 0 && !err) err = errno;
    if (!err && rename(tmp, path) != 0) err = errno;
    free(img);
    if (err) {
        if (dfd >= 0) close(dfd);
        (void)unlink(tmp);
        am_log(AM_LOG_ERROR, "am_optimizer_save: writing %s failed: %s", path, strerror(err));
        free(tmp);
        return AM_ERR_IO;
    }
    free(tmp);
    err = sync_dir(dfd, derr);
    if (dfd >= 0) close(dfd);
    /* (the log callback may allocate: the checkpoint is in place either way) */
    AM_RETURN_IF(err, AM_ERR_IO,
                 "am_optimizer_save: %s was saved, but its directory could not be "
                 "fsynced (%s): the rename may not survive a power cut",
                 path, strerror(err));
    return AM_OK;
}

am_status am_optimizer_load(am_optimizer *o, const char *path) {
    FILE *f;
    struct stat sb;
    int fd, fl;
    unsigned char *buf;
    size_t n;
    am_status st;
    AM_RETURN_IF(!o, AM_ERR_NULL_POINTER, "am_optimizer_load: opt is NULL");
    AM_RETURN_IF(!path, AM_ERR_NULL_POINTER, "am_optimizer_load: path is NULL");
    /* O_NONBLOCK: opening a FIFO for reading would wait for a writer
     * (forever) before the check below could refuse it; a regular file
     * reads the same either way, and the flag is cleared before reading */
    fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    AM_RETURN_IF(fd < 0, AM_ERR_IO, "am_optimizer_load: cannot open %s: %s", path,
                 strerror(errno));
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size < 0 ||
        (uint64_t)sb.st_size > (uint64_t)SIZE_MAX - 1) {
        close(fd);
        AM_RETURN_IF(1, AM_ERR_IO, "am_optimizer_load: %s is not a readable regular file",
                     path);
    }
    /* A file larger than any checkpoint of this optimizer (another
     * optimizer's, a model's weights): refused before it is read into
     * memory (a 3 GiB file under a 2 GiB memory limit was read first and
     * failed with AM_ERR_OUT_OF_MEMORY) */
    {
        const uint64_t most = am_ck_max_image(o);
        if ((uint64_t)sb.st_size > most) {
            close(fd);
            AM_RETURN_IF(1, AM_ERR_MISMATCH,
                         "am_optimizer_load: %s is %lld bytes; a checkpoint of this "
                         "optimizer's %d parameters has at most %llu",
                         path, (long long)sb.st_size, (int)am_optimizer_num_params(o),
                         (unsigned long long)most);
        }
    }
    fl = fcntl(fd, F_GETFL);
    f = fl == -1 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) == -1 ? NULL : fdopen(fd, "rb");
    if (!f) {
        const int e = errno;
        close(fd);
        AM_RETURN_IF(1, AM_ERR_IO, "am_optimizer_load: cannot read %s: %s", path, strerror(e));
    }
    n = (size_t)sb.st_size;
    buf = (unsigned char *)malloc(n ? n : 1);
    if (!buf) {
        fclose(f);
        AM_RETURN_IF(1, AM_ERR_OUT_OF_MEMORY, "am_optimizer_load: out of memory for %zu bytes",
                     n);
    }
    if (fread(buf, 1, n, f) != n || fgetc(f) != EOF) {
        fclose(f);
        free(buf);
        AM_RETURN_IF(1, AM_ERR_IO, "am_optimizer_load: reading %s failed (changed while read?)",
                     path);
    }
    fclose(f);
    st = am_optimizer_load_memory(o, buf, n);
    free(buf);
    return st;
}
