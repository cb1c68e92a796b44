/* report.c — progress bar, CSV and summary table (see report.h). */
#include "report.h"

#include <errno.h>
#include <math.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

double dm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void fmt_time(char *out, size_t n, double s) {
    int t = (int)(s + 0.5);
    if (s < 0 || s != s) snprintf(out, n, "--:--");
    else snprintf(out, n, "%02d:%02d", t / 60, t % 60);
}

void dm_progress_begin(dm_progress *p, const char *name, int total, int enabled) {
    p->name = name;
    p->total = total;
    p->enabled = enabled;
    p->tty = isatty(fileno(stderr));
    p->last_decile = 0;
    p->last_draw = 0.0;
}

void dm_progress_update(dm_progress *p, int step, double loss, double lr, double elapsed_s) {
    enum { WIDTH = 24 };
    char bar[WIDTH + 1], el[16], eta[16];
    int i, fill, decile;
    double now;
    if (!p->enabled) return;
    decile = (int)(10LL * step / p->total);
    now = dm_now();
    if (p->tty) {
        if (step != p->total && now - p->last_draw < 0.1) return;
    } else if (decile == p->last_decile && step != p->total) {
        return;
    }
    p->last_draw = now;
    p->last_decile = decile;
    fill = (int)((long long)WIDTH * step / p->total);
    for (i = 0; i < WIDTH; i++) bar[i] = i < fill ? '#' : '.';
    bar[WIDTH] = '\0';
    fmt_time(el, sizeof el, elapsed_s);
    fmt_time(eta, sizeof eta, step ? elapsed_s * (p->total - step) / step : -1.0);
    fprintf(stderr, "%s%-16s [%s] %6d/%d  avg loss %.3f  mean lr %.2e  %s  ETA %s%s",
            p->tty ? "\r" : "", p->name, bar, step, p->total, loss, lr, el, eta,
            p->tty ? "\033[K" : "\n");
    fflush(stderr);
}

void dm_progress_end(dm_progress *p) {
    if (p->enabled && p->tty) fputc('\n', stderr);
}

int dm_write_curves_csv(const char *path, const dm_run_spec *specs, const dm_result *res,
                        int nruns) {
    FILE *f = fopen(path, "w");
    int r, k, t;
    if (!f) return -1;
    fprintf(f, "run,step,train_loss,val_loss,lr_mean,lr_min,lr_p10,lr_p50,lr_p90,lr_max");
    for (k = 0; k < DM_NUM_TENSORS; k++) fprintf(f, ",lr_%s", dm_tensor_names[k]);
    fprintf(f, ",train_seconds\n");
    for (r = 0; r < nruns; r++)
        for (k = 0; k < res[r].npoints; k++) {
            const dm_point *p = &res[r].points[k];
            fprintf(f, "%s,%d,", specs[r].name, p->step);
            if (isnan(p->train_loss)) fprintf(f, ",");
            else fprintf(f, "%.6f,", p->train_loss);
            fprintf(f, "%.6f,%.6e,%.6e,%.6e,%.6e,%.6e,%.6e", p->val_loss, p->lr_mean,
                    p->lr_min, p->lr_p10, p->lr_p50, p->lr_p90, p->lr_max);
            for (t = 0; t < DM_NUM_TENSORS; t++) fprintf(f, ",%.6e", p->lr_tensor[t]);
            fprintf(f, ",%.3f\n", p->elapsed_s);
        }
    if (ferror(f)) { /* (a full disk: every later fprintf failed too) */
        const int e = errno;
        fclose(f);
        errno = e ? e : EIO;
        return -1;
    }
    return fclose(f) == 0 ? 0 : -1;
}

static const char *opt_name(const dm_run_spec *s) {
    return s->opt == DM_OPT_ADAMW ? "AdamW" : "Automagic3";
}

static const char *weights_name(const dm_run_spec *s) {
    switch (s->weights) {
    case DM_W_BF16_SR: return "bf16, stochastic rnd";
    case DM_W_BF16_RTN: return "bf16, round-to-nearest";
    default: return "float32";
    }
}

void dm_print_summary(FILE *f, const dm_run_spec *specs, const dm_result *res, int nruns,
                      const dm_train_opts *o) {
    int r, s;
    double ref_step = 0.0, ref_opt = 0.0;
    for (r = 0; r < nruns; r++) /* ratios against the AdamW float32 run */
        if (specs[r].opt == DM_OPT_ADAMW && specs[r].weights == DM_W_F32) {
            ref_step = res[r].train_s;
            ref_opt = res[r].opt_s;
        }
    fprintf(f, "\n| %-14s | %-10s | %-22s | %-14s | %-10s | %-8s | %-13s | %-15s |\n",
            "run", "optimizer", "weights", "lr at end", "train loss", "val loss",
            "ms/step", "optimizer ms");
    fprintf(f, "|----------------|------------|------------------------|----------------|"
               "------------|----------|---------------|-----------------|\n");
    for (r = 0; r < nruns; r++) {
        char lr[32], st[32], ot[32];
        const dm_point *last = &res[r].points[res[r].npoints - 1];
        const double ms = 1e3 * res[r].train_s / o->steps, oms = 1e3 * res[r].opt_s / o->steps;
        if (specs[r].opt == DM_OPT_ADAMW) snprintf(lr, sizeof lr, "%.3g (fixed)", (double)o->adamw_lr);
        else snprintf(lr, sizeof lr, "%.1e (mean)", last->lr_mean);
        if (ref_step > 0) snprintf(st, sizeof st, "%.2f (x%.2f)", ms, res[r].train_s / ref_step);
        else snprintf(st, sizeof st, "%.2f", ms);
        if (ref_opt > 0) snprintf(ot, sizeof ot, "%.3f (x%.2f)", oms, res[r].opt_s / ref_opt);
        else snprintf(ot, sizeof ot, "%.3f", oms);
        fprintf(f, "| %-14s | %-10s | %-22s | %-14s | %10.4f | %8.4f | %13s | %15s |\n",
                specs[r].name, opt_name(&specs[r]), weights_name(&specs[r]), lr,
                res[r].train_loss, res[r].val_loss, st, ot);
    }
    fprintf(f, "\ntrain loss: mean minibatch loss over the last 10%% of steps; val loss: the "
               "whole validation set.\nms/step: forward + backward + update; optimizer ms: the "
               "update alone; (xN): ratio to the\nAdamW float32 run in this same process (the "
               "machine may be shared: compare ratios).\n");
    for (r = 0; r < nruns; r++)
        if (res[r].skipped)
            fprintf(f, "%s: libautomagic skipped %lld updates (non-finite gradient)\n",
                    specs[r].name, (long long)res[r].skipped);
    fprintf(f, "\nsamples (same random draws for every run):\n");
    for (r = 0; r < nruns; r++) {
        fprintf(f, "  %-14s", specs[r].name);
        for (s = 0; s < DM_SAMPLES; s++) fprintf(f, " %s", res[r].samples[s]);
        fputc('\n', f);
    }
}
