/*
 * zero_mpi.c — data-parallel training over MPI with the optimizer state
 * sharded across the processes (ZeRO stage 1), through the kernel layer's
 * phases and am_update_stats_shard.
 *
 * The model is quickstart.c's linear layer y = W x + b, W (OUT, IN), fitted
 * to a random teacher. Each process computes the gradient of its own slice
 * of every batch; the gradients are summed across processes (all-reduce);
 * then each process updates only its own rows of W and elements of b, with
 * the optimizer state of those rows only, and the updated rows are gathered
 * back to every process. The reductions the sharded update needs between its
 * phases are, per parameter, the column sums of a matrix (IN floats) and
 * three scalars (two for a vector).
 *
 * Rank 0 also keeps a replica updated by am_update on the whole parameters
 * with the same gradients, and checks after every step that the sharded
 * training gives the same parameters (within float32 rounding: the sums are
 * added in another order) and the same per-row learning rates. At one step
 * a NaN enters the gradient of a row that one process owns: every process
 * must skip that update (the others learn of it from the reduced count).
 *
 *   mpirun -np 3 ./zero_mpi          exit status 0 when every check held
 */
#include <automagic.h>
#include <mpi.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define IN 64
#define OUT 50
#define N 240 /* samples per batch, split across the processes */
#define STEPS 40
#define NAN_STEP 20 /* a NaN in W's gradient, row NAN_ROW */
#define NAN_ROW 45

/* One parameter: the whole of it on every process, this process's shard
 * of its dims[0] (rows of W, elements of b) and the shard's state. */
typedef struct sharded {
    float *data, *grad;  /* whole parameter and its summed gradient */
    am_shape whole, part;
    int64_t per;         /* elements per dims[0] index */
    int64_t row0;        /* this shard's first dims[0] index */
    am_state st;
    void *ws;
    size_t ws_bytes;
    am_tensor pt, gt;    /* the shard's rows of data and grad */
    int *counts, *displs; /* elements of every shard, for the gather */
    int *lcounts, *ldispls; /* lrs of every shard (dims[0] indices) */
} sharded;

static int g_rank, g_size;

static void die(const char *what, am_status s) {
    fprintf(stderr, "rank %d: %s: %s (%d)\n", g_rank, what, am_status_string(s), (int)s);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static void check(am_status s, const char *what) {
    if (am_status_is_error(s)) die(what, s);
}

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    if (!p) die("out of memory", AM_ERR_OUT_OF_MEMORY);
    return p;
}

/* The rows of dims[0] = total that rank r owns: an even split, the first
 * total % size ranks one more. */
static void split(int64_t total, int r, int64_t *row0, int64_t *rows) {
    int64_t base = total / g_size, extra = total % g_size;
    *rows = base + (r < extra);
    *row0 = r * base + (r < extra ? r : extra);
}

static void sharded_init(sharded *s, int ndim, const int64_t *dims, double lr) {
    am_state_sizes sz;
    int64_t n = 1, rows;
    int d, r;
    memset(s, 0, sizeof *s);
    s->whole.ndim = ndim;
    for (d = 0; d < ndim; d++) {
        s->whole.dims[d] = dims[d];
        n *= dims[d];
    }
    s->per = n / dims[0];
    s->data = xcalloc((size_t)n, sizeof(float));
    s->grad = xcalloc((size_t)n, sizeof(float));
    split(dims[0], g_rank, &s->row0, &rows);
    s->part = s->whole;
    s->part.dims[0] = rows;
    check(am_state_get_sizes(&s->part, &sz), "am_state_get_sizes");
    s->st.lr = xcalloc((size_t)sz.lr_count, sizeof(float));
    s->st.polarity = xcalloc((size_t)sz.polarity_bytes, 1);
    if (ndim >= 2) {
        s->st.row = xcalloc((size_t)sz.row_count, sizeof(float));
        s->st.col = xcalloc((size_t)sz.col_count, sizeof(float));
    } else {
        s->st.sq = xcalloc((size_t)sz.sq_count, sizeof(float));
    }
    check(am_state_init(&s->part, &s->st, lr), "am_state_init");
    s->ws_bytes = (size_t)sz.workspace_bytes;
    s->ws = xcalloc(s->ws_bytes, 1);
    s->pt.data = s->data + s->row0 * s->per;
    s->pt.dtype = AM_DTYPE_FLOAT32;
    s->pt.shape = s->part;
    s->gt = s->pt;
    s->gt.data = s->grad + s->row0 * s->per;
    s->counts = xcalloc((size_t)g_size, sizeof(int));
    s->displs = xcalloc((size_t)g_size, sizeof(int));
    s->lcounts = xcalloc((size_t)g_size, sizeof(int));
    s->ldispls = xcalloc((size_t)g_size, sizeof(int));
    for (r = 0; r < g_size; r++) {
        int64_t r0, nr;
        split(dims[0], r, &r0, &nr);
        s->counts[r] = (int)(nr * s->per);
        s->displs[r] = (int)(r0 * s->per);
        s->lcounts[r] = (int)nr;
        s->ldispls[r] = (int)r0;
    }
}

static void sharded_free(sharded *s) {
    free(s->data); free(s->grad); free(s->st.lr); free(s->st.polarity);
    free(s->st.row); free(s->st.col); free(s->st.sq); free(s->ws);
    free(s->counts); free(s->displs); free(s->lcounts); free(s->ldispls);
}

/* One sharded update of every parameter (its grad already summed), then
 * the updated rows gathered to every process; finish's status of each
 * parameter into status[]. A skip (a non-finite gradient) is returned by
 * every process's moments and finish once nonfinite is reduced, and every
 * process must take part in every reduction: every phase runs whatever the
 * one before returned, and a skip is not an error. */
static void sharded_update(sharded *ps, int np, const am_hparams *hp, uint64_t seed,
                           am_status *status) {
    am_workspace_view v[4];
    int i;
    for (i = 0; i < np; i++) {
        const am_shard shard = {ps[i].whole.dims[0], ps[i].row0};
        check(am_update_stats_shard(&ps[i].pt, &ps[i].gt, &ps[i].st, hp, &shard, ps[i].ws,
                                    ps[i].ws_bytes), "am_update_stats_shard");
        check(am_workspace_view_get(&ps[i].part, ps[i].ws, ps[i].ws_bytes, &v[i]),
              "am_workspace_view_get");
        /* a 2-D shard: the column sums and the sum of the row moments */
        if (ps[i].whole.ndim == 2) {
            MPI_Allreduce(MPI_IN_PLACE, v[i].col_sumsq, (int)ps[i].whole.dims[1], MPI_FLOAT,
                          MPI_SUM, MPI_COMM_WORLD);
            MPI_Allreduce(MPI_IN_PLACE, v[i].row_moment_sum, 1, MPI_DOUBLE, MPI_SUM,
                          MPI_COMM_WORLD);
        }
        MPI_Allreduce(MPI_IN_PLACE, v[i].nonfinite, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
        check(am_update_moments(&ps[i].pt, &ps[i].gt, &ps[i].st, hp, ps[i].ws, ps[i].ws_bytes),
              "am_update_moments");
        MPI_Allreduce(MPI_IN_PLACE, v[i].u2_sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
        {
            /* the whole parameter's key: the rounding noise of 16-bit
             * weights is keyed by the element's index in the whole */
            const am_rng_key key = {seed, (uint32_t)i};
            status[i] = am_update_finish(&ps[i].pt, &ps[i].gt, &ps[i].st, hp, key, ps[i].ws,
                                         ps[i].ws_bytes, NULL);
            check(status[i], "am_update_finish");
        }
        MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_FLOAT, ps[i].data, ps[i].counts, ps[i].displs,
                       MPI_FLOAT, MPI_COMM_WORLD);
    }
}

static float frand(unsigned *s) { /* xorshift, uniform in [-1, 1) */
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return (float)(*s >> 8) / 8388608.0f - 1.0f;
}

/* Rank 0's replica: whole parameters, am_update on each. */
typedef struct replica {
    float *data;
    am_state st;
    am_state_sizes sz;
    void *ws;
} replica;

static void replica_init(replica *r, const sharded *s, double lr) {
    check(am_state_get_sizes(&s->whole, &r->sz), "am_state_get_sizes");
    r->data = xcalloc((size_t)r->sz.numel, sizeof(float));
    memcpy(r->data, s->data, (size_t)r->sz.numel * sizeof(float));
    r->st.lr = xcalloc((size_t)r->sz.lr_count, sizeof(float));
    r->st.polarity = xcalloc((size_t)r->sz.polarity_bytes, 1);
    r->st.row = r->sz.row_count ? xcalloc((size_t)r->sz.row_count, sizeof(float)) : NULL;
    r->st.col = r->sz.col_count ? xcalloc((size_t)r->sz.col_count, sizeof(float)) : NULL;
    r->st.sq = r->sz.sq_count ? xcalloc((size_t)r->sz.sq_count, sizeof(float)) : NULL;
    check(am_state_init(&s->whole, &r->st, lr), "am_state_init");
    r->ws = xcalloc((size_t)r->sz.workspace_bytes, 1);
}

static void replica_free(replica *r) {
    free(r->data); free(r->st.lr); free(r->st.polarity); free(r->st.row);
    free(r->st.col); free(r->st.sq); free(r->ws);
}

/* Every shard's lrs, in dims[0] order, into lrs on rank 0. */
static void gather_lrs(const sharded *s, float *lrs) {
    MPI_Gatherv(s->st.lr, (int)s->part.dims[0], MPI_FLOAT, lrs, s->lcounts, s->ldispls,
                MPI_FLOAT, 0, MPI_COMM_WORLD);
}

/* The replica's update of parameter param_id with the same gradient (its status in *status);
 * returns the largest difference from the sharded parameter relative to
 * its largest magnitude, and counts the lrs (lrs: every shard's, gathered)
 * that differ. */
static double replica_step(replica *r, const sharded *s, uint32_t param_id, const float *lrs,
                           const am_hparams *hp, int *lr_diff, am_status *status) {
    am_tensor pt = {r->data, AM_DTYPE_FLOAT32, s->whole}, gt = {s->grad, AM_DTYPE_FLOAT32, s->whole};
    double dmax = 0.0, amax = 0.0;
    int64_t i;
    /* the sharded update's key (seed 1, parameter param_id): with 16-bit
     * weights the two would round with the same noise */
    *status = am_update(&pt, &gt, &r->st, hp, (am_rng_key){1, param_id}, r->ws,
                        (size_t)r->sz.workspace_bytes, NULL);
    check(*status, "am_update");
    for (i = 0; i < r->sz.numel; i++) {
        dmax = fmax(dmax, fabs((double)r->data[i] - (double)s->data[i]));
        amax = fmax(amax, fabs((double)r->data[i]));
    }
    for (i = 0; i < s->whole.dims[0]; i++) *lr_diff += r->st.lr[i] != lrs[i];
    return amax > 0.0 ? dmax / amax : dmax;
}

int main(int argc, char **argv) {
    static float X[N][IN], Y[N][OUT], Wt[OUT][IN], bt[OUT];
    const int64_t dW[2] = {OUT, IN}, db[1] = {OUT};
    am_hparams hp = am_hparams_default();
    sharded ps[2];
    replica rep[2];
    unsigned seed = 12345;
    int64_t n0, nn;
    static float lrs[OUT];
    am_status status[2], rstatus;
    int step, n, i, o, lr_diff = 0, failed = 0, skipped = 0;
    double worst = 0.0, loss0 = 0.0, loss = 0.0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    if (g_size > OUT) {
        if (g_rank == 0) fprintf(stderr, "zero_mpi: at most %d processes\n", OUT);
        MPI_Finalize();
        return 2;
    }
    hp.lr = 1e-3;
    sharded_init(&ps[0], 2, dW, hp.lr);
    sharded_init(&ps[1], 1, db, hp.lr);
    /* teacher, data and start: the same on every process (same seed) */
    for (o = 0; o < OUT; o++) {
        for (i = 0; i < IN; i++) Wt[o][i] = frand(&seed);
        bt[o] = frand(&seed);
    }
    for (n = 0; n < N; n++)
        for (i = 0; i < IN; i++) X[n][i] = frand(&seed);
    for (n = 0; n < N; n++)
        for (o = 0; o < OUT; o++) {
            float y = bt[o];
            for (i = 0; i < IN; i++) y += Wt[o][i] * X[n][i];
            Y[n][o] = y;
        }
    for (i = 0; i < OUT * IN; i++) ps[0].data[i] = 0.1f * frand(&seed);
    if (g_rank == 0) {
        replica_init(&rep[0], &ps[0], hp.lr);
        replica_init(&rep[1], &ps[1], hp.lr);
    }
    split(N, g_rank, &n0, &nn); /* this process's samples */
    for (step = 0; step < STEPS; step++) {
        double l = 0.0;
        memset(ps[0].grad, 0, sizeof(float) * OUT * IN);
        memset(ps[1].grad, 0, sizeof(float) * OUT);
        /* forward and backward of the mean squared error over the batch */
        for (n = (int)n0; n < n0 + nn; n++)
            for (o = 0; o < OUT; o++) {
                float y = ps[1].data[o], e;
                for (i = 0; i < IN; i++) y += ps[0].data[o * IN + i] * X[n][i];
                e = y - Y[n][o];
                l += (double)e * e / N;
                for (i = 0; i < IN; i++) ps[0].grad[o * IN + i] += 2.0f * e * X[n][i] / N;
                ps[1].grad[o] += 2.0f * e / N;
            }
        /* one process's contribution turns an element of row NAN_ROW
         * into NaN; the sum carries it to every process */
        if (step == NAN_STEP && g_rank == 1 % g_size) ps[0].grad[NAN_ROW * IN + 3] = NAN;
        MPI_Allreduce(MPI_IN_PLACE, ps[0].grad, OUT * IN, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Allreduce(MPI_IN_PLACE, ps[1].grad, OUT, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Allreduce(MPI_IN_PLACE, &l, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
        sharded_update(ps, 2, &hp, 1, status);
        if (status[0] != (step == NAN_STEP ? AM_SKIPPED_NONFINITE_GRAD : AM_OK) ||
            status[1] != AM_OK) {
            fprintf(stderr, "FAIL: rank %d step %d: statuses %d %d\n", g_rank, step,
                    (int)status[0], (int)status[1]);
            failed = 1;
        }
        skipped += status[0] == AM_SKIPPED_NONFINITE_GRAD;
        if (step == 0) loss0 = l;
        loss = l;
        for (i = 0; i < 2; i++) {
            gather_lrs(&ps[i], lrs);
            if (g_rank == 0) {
                const double d = replica_step(&rep[i], &ps[i], (uint32_t)i, lrs, &hp, &lr_diff, &rstatus);
                worst = fmax(worst, d);
                if (rstatus != status[i]) {
                    fprintf(stderr, "FAIL: step %d: the whole update returned %d, the shards %d\n",
                            step, (int)rstatus, (int)status[i]);
                    failed = 1;
                }
            }
        }
        if (g_rank == 0) {
            if (step % 10 == 0 || step == STEPS - 1)
                printf("step %2d  loss %.5f  sharded vs whole: max rel diff %.2e\n", step, l,
                       worst);
        }
    }
    if (g_rank == 0) {
        /* float32 rounding of sums added in another order, over 40 steps */
        if (!(worst <= 1e-5)) {
            fprintf(stderr, "FAIL: sharded parameters differ from the whole update by %.3g\n",
                    worst);
            failed = 1;
        }
        if (lr_diff) {
            fprintf(stderr, "FAIL: %d per-row lrs differ from the whole update's\n", lr_diff);
            failed = 1;
        }
        if (!(loss < 0.5 * loss0)) {
            fprintf(stderr, "FAIL: loss %.5f did not halve from %.5f\n", loss, loss0);
            failed = 1;
        }
        printf("%d processes, %d steps (%d skipped): %s\n", g_size, STEPS, skipped,
               failed ? "FAILED" : "ok");
        replica_free(&rep[0]);
        replica_free(&rep[1]);
    }
    sharded_free(&ps[0]);
    sharded_free(&ps[1]);
    MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Finalize();
    return failed;
}
