/* test_runner.c — the library's parallel work on a host's threads
 * (am_set_parallel_runner): am_gomp_runner on a real GNU OpenMP runtime
 * (the system's libgomp, as PyTorch's CPU build loads its own copy) gives
 * the bits of one thread and really runs on several threads; a fork()ed
 * child forgets the runner and uses the library's own pool. Not run under
 * ThreadSanitizer (libgomp's barriers are not instrumented); the runner
 * path itself is covered there by test_threads' own-thread runner. */
#define _GNU_SOURCE
#include <automagic.h>

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "pool_case.h"
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

/* Records which threads ran the work, then runs it through am_gomp_runner. */
typedef struct spy {
    void *gomp_parallel;
    pthread_mutex_t lock;
    pthread_t seen[16];
    int nseen, calls;
    void (*work)(void *);
    void *arg;
} spy;

static void spy_work(void *p) {
    spy *s = (spy *)p;
    int i, known = 0;
    pthread_t me = pthread_self();
    pthread_mutex_lock(&s->lock);
    for (i = 0; i < s->nseen; i++) known |= pthread_equal(s->seen[i], me);
    if (!known && s->nseen < 16) s->seen[s->nseen++] = me;
    pthread_mutex_unlock(&s->lock);
    s->work(s->arg);
}

static void spy_runner(void (*work)(void *), void *arg, unsigned nthreads, void *ctx) {
    spy *s = (spy *)ctx;
    s->calls++;
    s->work = work;
    s->arg = arg;
    am_gomp_runner(spy_work, s, nthreads, s->gomp_parallel);
}

static void *gomp_parallel_address(void) {
    void *h = dlopen("libgomp.so.1", RTLD_NOW | RTLD_LOCAL);
    return h != NULL ? dlsym(h, "GOMP_parallel") : NULL;
}

static void test_runner_gomp_same_bits(void **unused) {
    spy s;
    int c;
    (void)unused;
    memset(&s, 0, sizeof s);
    s.gomp_parallel = gomp_parallel_address();
    if (s.gomp_parallel == NULL) {
        fprintf(stderr, "SKIPPED: no libgomp.so.1 with GOMP_parallel on this machine\n");
        skip();
    }
    pthread_mutex_init(&s.lock, NULL);
    for (c = 0; c < 3; c++) {
        am_shape sh;
        pool_run a, b;
        pool_shape(c, &sh);
        pool_update(&sh, 1, &a);
        assert_int_equal(am_set_parallel_runner(spy_runner, &s), AM_OK);
        pool_update(&sh, 3, &b);
        assert_int_equal(am_set_parallel_runner(NULL, NULL), AM_OK);
        pool_assert_equal(&a, &b, sh.ndim);
        pool_free(&a);
        pool_free(&b);
    }
    assert_true(s.calls > 0);
    assert_true(s.nseen >= 2); /* the team's threads, not only the caller */
    pthread_mutex_destroy(&s.lock);
}

/* ctx NULL: the work runs once, on the calling thread. */
static void count_work(void *p) { (*(int *)p)++; }

static void test_runner_gomp_null_runtime(void **unused) {
    int n = 0;
    (void)unused;
    am_gomp_runner(count_work, &n, 4, NULL);
    assert_int_equal(n, 1);
}

/* After fork() the child must not call the parent's runner. */
static int g_child_calls;

static void counting_runner(void (*work)(void *), void *arg, unsigned nthreads, void *ctx) {
    (void)nthreads;
    (void)ctx;
    g_child_calls++;
    work(arg);
}

static void test_runner_forgotten_after_fork(void **unused) {
    pid_t pid;
    int status = 0;
    (void)unused;
    g_child_calls = 0;
    assert_int_equal(am_set_parallel_runner(counting_runner, NULL), AM_OK);
    pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        am_shape sh;
        pool_run a;
        pool_shape(1, &sh);
        pool_update(&sh, 3, &a);
        pool_free(&a);
        _exit(g_child_calls == 0 ? 0 : 3);
    }
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    /* the parent still has it */
    {
        am_shape sh;
        pool_run a;
        pool_shape(1, &sh);
        pool_update(&sh, 3, &a);
        pool_free(&a);
    }
    assert_int_equal(am_set_parallel_runner(NULL, NULL), AM_OK);
    assert_true(g_child_calls > 0);
}

/* A runner that tries to change the runner from inside (its own call and
 * its work): refused there (it hung: am_set_parallel_runner waited for the
 * job it was part of), the update completes, the runner stays. */
static int g_reset_status[2], g_reset_calls;

typedef struct work_call {
    void (*work)(void *);
    void *arg;
} work_call;

static void resetting_work(void *p) {
    const work_call *w = (const work_call *)p;
    g_reset_status[1] = am_set_parallel_runner(NULL, NULL);
    w->work(w->arg);
}

static void resetting_runner(void (*work)(void *), void *arg, unsigned nthreads, void *ctx) {
    work_call w;
    (void)nthreads;
    (void)ctx;
    g_reset_calls++;
    g_reset_status[0] = am_set_parallel_runner(NULL, NULL);
    w.work = work;
    w.arg = arg;
    resetting_work(&w);
}

static void test_runner_reset_from_inside_refused(void **unused) {
    am_shape sh;
    pool_run a, b;
    (void)unused;
    pool_shape(1, &sh);
    pool_update(&sh, 1, &a); /* one thread: the reference bits */
    assert_int_equal(am_set_parallel_runner(resetting_runner, NULL), AM_OK);
    g_reset_calls = 0;
    g_reset_status[0] = g_reset_status[1] = AM_OK;
    pool_update(&sh, 3, &b);
    assert_true(g_reset_calls > 0);
    assert_int_equal(g_reset_status[0], AM_ERR_INVALID_ARGUMENT);
    assert_int_equal(g_reset_status[1], AM_ERR_INVALID_ARGUMENT);
    pool_assert_equal(&a, &b, sh.ndim);
    g_reset_calls = 0;
    pool_free(&b);
    pool_update(&sh, 3, &b); /* still the runner */
    assert_true(g_reset_calls > 0);
    assert_int_equal(am_set_parallel_runner(NULL, NULL), AM_OK);
    pool_free(&a);
    pool_free(&b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_runner_reset_from_inside_refused),
        cmocka_unit_test(test_runner_gomp_same_bits),
        cmocka_unit_test(test_runner_gomp_null_runtime),
        cmocka_unit_test(test_runner_forgotten_after_fork),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
