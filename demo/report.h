/*
 * report.h — what the demo shows: a progress bar on stderr while a run
 * trains, then the summary table, the curves as CSV, and generated samples.
 */
#ifndef DM_REPORT_H
#define DM_REPORT_H

#include <stdio.h>

#include "train.h"

/* Monotonic seconds. */
double dm_now(void);

typedef struct dm_progress {
    const char *name;
    int total, enabled, tty, last_decile;
    double last_draw;
} dm_progress;

/* A bar redrawn in place (\r) at most 10 times a second when stderr is a
 * terminal; a plain line every 10% otherwise (logs, CI). enabled = 0: silent. */
void dm_progress_begin(dm_progress *p, const char *name, int total, int enabled);
/* loss: what to show (the caller passes a running mean); lr: the mean lr. */
void dm_progress_update(dm_progress *p, int step, double loss, double lr, double elapsed_s);
void dm_progress_end(dm_progress *p);

/* Writes the curves of every run as CSV (one row per run and curve point).
 * Returns 0 or -1 (errno set). */
int dm_write_curves_csv(const char *path, const dm_run_spec *specs, const dm_result *res,
                        int nruns);

/* Prints the summary table (and the samples) to f. */
void dm_print_summary(FILE *f, const dm_run_spec *specs, const dm_result *res, int nruns,
                      const dm_train_opts *o);

#endif /* DM_REPORT_H */
