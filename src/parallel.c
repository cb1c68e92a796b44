/*
 * parallel.c — a small persistent thread pool behind am_parallel_for.
 *
 * One job at a time: the caller publishes (fn, ctx, ntasks), wakes the
 * workers it wants, runs tasks itself, and waits until every worker has
 * left the job. Tasks are claimed in chunks from an atomic counter, so which
 * thread runs a task varies from run to run — harmless, because tasks write
 * disjoint memory and every reduction order is fixed by the task index
 * (internal.h), never by the thread.
 *
 * A second caller arriving while a job runs (am_update on two parameters
 * from two user threads) does not wait: am_pool_run returns 0 and it runs
 * its tasks serially. Between jobs a worker first watches for the next one
 * for a short while (AM_POOL_SPIN_NS: an update is three or four jobs in a
 * row, and waking a sleeping thread costs tens of microseconds on this kind
 * of machine), then sleeps on a condition variable (the machine may be
 * shared: no long spinning). The caller likewise watches briefly for the
 * workers to finish before it sleeps. After fork() the child has no
 * workers; an atfork handler forgets them so the child starts fresh ones.
 *
 * A host may lend its own threads instead (am_set_parallel_runner): the job
 * is then handed to its runner, whose threads claim tasks from the same
 * counter (PyTorch's front end passes its OpenMP team through
 * am_gomp_runner: with two pools on the same cores, an update right after a
 * torch operation took up to 1.8 times as long).
 */
#define _POSIX_C_SOURCE 200809L
#include "simd.h"

#include "fpenv.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define AM_POOL_MAX 256
/* How long a worker (or the caller) watches before it sleeps. */
#define AM_POOL_SPIN_NS 100000

typedef struct job {
    am_task_fn fn;
    void *ctx;
    int64_t ntasks, chunk;
    int nwant;            /* threads on this job, the caller included */
} job;

static pthread_mutex_t g_busy = PTHREAD_MUTEX_INITIALIZER; /* one caller */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* state below */
/* one per worker: a job wakes only the workers it wants (a broadcast woke
 * every worker the pool ever started, and each watched 100 us for the next
 * job: after am_set_num_threads(64) then 2, 50 small updates took 0.74 s
 * instead of 0.055) */
static pthread_cond_t g_wake[AM_POOL_MAX];
static pthread_cond_t g_done = PTHREAD_COND_INITIALIZER;
static int g_nworkers;       /* started and alive */
static atomic_ullong g_gen;  /* incremented per job (under g_lock) */
static job g_job;
static atomic_int g_active;  /* workers still inside the current job */
static atomic_llong g_next;  /* next unclaimed task */
static pthread_once_t g_atfork_once = PTHREAD_ONCE_INIT;
/* g_gen when worker i was created: a job published before the new thread
 * first takes g_lock must still be seen as new by it. */
static uint64_t g_start_gen[AM_POOL_MAX];
/* The host's runner (am_set_parallel_runner), read and written under g_busy. */
static am_parallel_runner g_runner;
static void *g_runner_ctx;

/* Every thread on a job, in the library's floating-point environment
 * (fpenv.h: a worker or a host runner's thread may hold another). */
static void run_tasks(const job *j) {
    const am_fpenv fe = am_fpenv_enter();
    for (;;) {
        int64_t s = (int64_t)atomic_fetch_add(&g_next, (long long)j->chunk), e, t;
        if (s >= j->ntasks) break;
        e = s + j->chunk < j->ntasks ? s + j->chunk : j->ntasks;
        for (t = s; t < e; t++) j->fn(j->ctx, t);
    }
    am_fpenv_leave(fe);
}

/* Set on a thread while it runs a host runner's call or its work: there
 * am_set_parallel_runner would wait for the job it is part of, forever
 * (found by a review, twenty-second session: a runner that reset the runner
 * before returning hung). */
static _Thread_local int g_in_runner;

static void runner_work(void *arg) {
    const int was = g_in_runner;
    g_in_runner = 1;
    run_tasks((const job *)arg);
    g_in_runner = was;
}

static int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Watches g_gen (without the lock) for up to AM_POOL_SPIN_NS until it
 * differs from old; returns whether it did. */
static int spin_watch_gen(uint64_t old) {
    int64_t t0 = mono_ns();
    int i;
    for (;;) {
        for (i = 0; i < 256; i++)
            if (atomic_load_explicit(&g_gen, memory_order_acquire) != old) return 1;
        if (mono_ns() - t0 > AM_POOL_SPIN_NS) return 0;
    }
}

/* Watches for up to AM_POOL_SPIN_NS until no worker is inside the job. */
static int spin_until_idle(void) {
    int64_t t0 = mono_ns();
    int i;
    for (;;) {
        for (i = 0; i < 256; i++)
            if (atomic_load_explicit(&g_active, memory_order_acquire) == 0) return 1;
        if (mono_ns() - t0 > AM_POOL_SPIN_NS) return 0;
    }
}

static void *worker(void *arg) {
    int idx = (int)(intptr_t)arg;
    uint64_t seen;
    pthread_mutex_lock(&g_lock);
    seen = g_start_gen[idx];
    for (;;) {
        job j;
        if (atomic_load(&g_gen) == seen) {
            /* watch for a next job a short while before sleeping */
            pthread_mutex_unlock(&g_lock);
            spin_watch_gen(seen);
            pthread_mutex_lock(&g_lock);
        }
        /* sleep through jobs that do not want this worker (their
         * publisher does not wake it) until one does */
        while (atomic_load(&g_gen) == seen || idx >= g_job.nwant - 1) {
            seen = atomic_load(&g_gen);
            pthread_cond_wait(&g_wake[idx], &g_lock);
        }
        seen = atomic_load(&g_gen);
        j = g_job;
        pthread_mutex_unlock(&g_lock);
        run_tasks(&j);
        pthread_mutex_lock(&g_lock);
        if (atomic_fetch_sub(&g_active, 1) == 1) pthread_cond_signal(&g_done);
    }
    return NULL;
}

static void atfork_child(void) {
    /* Only the forking thread survives: no workers, nothing running. */
    pthread_mutex_init(&g_busy, NULL);
    pthread_mutex_init(&g_lock, NULL);
    pthread_cond_init(&g_done, NULL); /* (g_wake[i]: when worker i is started) */
    g_nworkers = 0;
    atomic_store(&g_active, 0);
    g_runner = NULL; /* the host's threads may not exist in the child */
    g_runner_ctx = NULL;
}

/* Once per process, before the first worker: the atfork handler, and the
 * library's code kept mapped while workers may run it (pin_self.c). */
static void register_atfork(void) {
    pthread_atfork(NULL, NULL, atfork_child);
    am_pin_self();
}

/* Starts workers until there are want of them (or creation fails). Called
 * with g_busy held and no job running. */
static void grow(int want) {
    pthread_once(&g_atfork_once, register_atfork);
    if (want > AM_POOL_MAX) want = AM_POOL_MAX;
    while (g_nworkers < want) {
        pthread_t th;
        pthread_attr_t attr;
        int rc;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_mutex_lock(&g_lock);
        pthread_cond_init(&g_wake[g_nworkers], NULL);
        g_start_gen[g_nworkers] = atomic_load(&g_gen);
        rc = pthread_create(&th, &attr, worker, (void *)(intptr_t)g_nworkers);
        if (rc == 0) g_nworkers++;
        pthread_mutex_unlock(&g_lock);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
    }
}

/* Threads on a job of ntasks for a wish of nthreads (at most avail), and
 * its chunk: a few chunks per thread balance against claim overhead. */
static job make_job(int nthreads, int avail, int64_t ntasks, am_task_fn fn,
                    void *ctx) {
    job j;
    j.fn = fn;
    j.ctx = ctx;
    j.ntasks = ntasks;
    j.nwant = nthreads < avail ? nthreads : avail;
    if ((int64_t)j.nwant > ntasks) j.nwant = (int)ntasks;
    j.chunk = ntasks / ((int64_t)j.nwant * 4);
    if (j.chunk < 1) j.chunk = 1;
    return j;
}

/* Runs the job on the host's runner; called with g_busy held. */
static void run_on_runner(job *j) {
    const int was = g_in_runner;
    atomic_store(&g_next, 0);
    g_in_runner = 1;
    g_runner(runner_work, j, (unsigned)j->nwant, g_runner_ctx);
    g_in_runner = was;
    run_tasks(j); /* whatever the runner's threads left */
}

int am_pool_run(int nthreads, int64_t ntasks, am_task_fn fn, void *ctx) {
    job j;
    int t;
    if (nthreads < 2 || ntasks < 2) return 0;
    /* at most the pool's workers and the caller, a host's runner too (it
     * was asked for any count: libgomp, asked for 4096 threads under a
     * memory limit, printed an error and exited the process) */
    if (nthreads > AM_POOL_MAX + 1) nthreads = AM_POOL_MAX + 1;
    if (pthread_mutex_trylock(&g_busy) != 0) return 0;
    if (g_runner != NULL) {
        j = make_job(nthreads, nthreads, ntasks, fn, ctx);
        run_on_runner(&j);
        pthread_mutex_unlock(&g_busy);
        return 1;
    }
    grow(nthreads - 1);
    if (g_nworkers == 0) {
        pthread_mutex_unlock(&g_busy);
        return 0;
    }
    j = make_job(nthreads, g_nworkers + 1, ntasks, fn, ctx);
    pthread_mutex_lock(&g_lock);
    g_job = j;
    atomic_store(&g_next, 0);
    atomic_store(&g_active, j.nwant - 1);
    atomic_fetch_add_explicit(&g_gen, 1, memory_order_release);
    for (t = 0; t < j.nwant - 1; t++) pthread_cond_signal(&g_wake[t]);
    pthread_mutex_unlock(&g_lock);
    run_tasks(&j);
    spin_until_idle();
    pthread_mutex_lock(&g_lock);
    while (atomic_load(&g_active) > 0) pthread_cond_wait(&g_done, &g_lock);
    pthread_mutex_unlock(&g_lock);
    pthread_mutex_unlock(&g_busy);
    return 1;
}

am_status am_set_parallel_runner(am_parallel_runner runner, void *ctx) {
    AM_RETURN_IF(g_in_runner, AM_ERR_INVALID_ARGUMENT,
                 "am_set_parallel_runner: called from inside a runner or its work, which "
                 "would wait for the job it is part of; call it between updates");
    pthread_once(&g_atfork_once, register_atfork);
    pthread_mutex_lock(&g_busy);
    g_runner = runner;
    g_runner_ctx = runner != NULL ? ctx : NULL;
    pthread_mutex_unlock(&g_busy);
    return AM_OK;
}

/* GOMP_parallel(fn, data, num_threads, flags): the entry point GCC emits for
 * `#pragma omp parallel` (libgomp manual, "The libgomp ABI"); flags 0 = no
 * proc_bind clause. */
typedef void (*gomp_parallel_fn)(void (*fn)(void *), void *data,
                                 unsigned num_threads, unsigned flags);
_Static_assert(sizeof(gomp_parallel_fn) == sizeof(void *),
               "function and object pointers must have the same size (POSIX)");

void am_gomp_runner(void (*work)(void *arg), void *arg, unsigned nthreads,
                    void *ctx) {
    gomp_parallel_fn f;
    if (ctx == NULL) { /* no runtime given: run here (the caller finishes) */
        work(arg);
        return;
    }
    memcpy(&f, &ctx, sizeof f); /* POSIX: as dlsym's result is used */
    f(work, arg, nthreads, 0);
}
