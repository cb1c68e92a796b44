/*
 * test_plugin_unload.c — a host that dlopen()s a plugin holding the static
 * library (plugin_unload.c), lets it update on two threads and dlclose()s it
 * at once. The pool's workers, watching for the next job in the library's
 * code, crashed when that code was unmapped (37 of 40 runs; found by a
 * review, thirty-third session): src/pin_self.c keeps it mapped. Each try
 * runs in a child process, which must find the plugin still loaded after
 * its dlclose() (dlopen with RTLD_NOLOAD: the check that does not depend on
 * a worker being caught in the act) and exit cleanly.
 */
#define _POSIX_C_SOURCE 200809L /* nanosleep, fork, waitpid */
#include <dlfcn.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

static int one_try(void) {
    void *h = dlopen(AM_TEST_PLUGIN, RTLD_NOW | RTLD_LOCAL);
    int (*step)(void);
    int rc;
    struct timespec pause = {0, 150 * 1000 * 1000};
    if (!h) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 2;
    }
    *(void **)(&step) = dlsym(h, "plug_step");
    if (!step) return 3;
    rc = step();
    if (rc != 0) {
        fprintf(stderr, "plug_step: status %d\n", rc);
        return 4;
    }
    dlclose(h);
    nanosleep(&pause, NULL); /* the workers watch for 100 us, then sleep */
    if (!dlopen(AM_TEST_PLUGIN, RTLD_NOW | RTLD_NOLOAD)) {
        fprintf(stderr, "the plugin was unloaded while the pool's workers live\n");
        return 5;
    }
    return 0;
}

static void test_unload_after_threaded_update(void **st) {
    int i;
    (void)st;
    for (i = 0; i < 10; i++) {
        int status = 0;
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) _exit(one_try());
        assert_int_equal(waitpid(pid, &status, 0), pid);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
            fail_msg("try %d: the child %s %d", i,
                     WIFSIGNALED(status) ? "died of signal" : "exited with",
                     WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unload_after_threaded_update),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
