/*
 * main.c — amdemo: trains a character-level MLP language model on a real word
 * list, from scratch and entirely in C, four times under the same budget:
 *
 *   automagic3      Automagic3 (libautomagic) with its defaults, float32 weights
 *   adamw           AdamW written in C at a fixed lr (default 3e-3), float32
 *   automagic3-sr   Automagic3, bfloat16 weights, stochastic rounding (libautomagic)
 *   automagic3-rtn  Automagic3, bfloat16 weights, the same update rounded to nearest
 *
 * Every run starts from the same weights and sees the same batches. Prints a
 * progress bar, then a summary table and samples; writes curves.csv and
 * summary.txt into the output directory (demo/plot.py draws them).
 */
#include <automagic.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "data.h"
#include "model.h"
#include "report.h"
#include "train.h"

#define DEFAULT_DATA "/usr/share/dict/words"

typedef struct args {
    int steps, batch, threads, ctx, embed, hidden, quiet;
    uint64_t seed;
    double adamw_lr, val_frac;
    const char *data, *out, *runs;
} args;

static void usage(FILE *f, const char *prog) {
    fprintf(f,
            "usage: %s [options]\n"
            "Trains a character-level MLP language model on a word list with Automagic3\n"
            "(libautomagic) and with AdamW, in float32 and in bfloat16.\n\n"
            "  -n, --steps N      training steps per run (default 8000)\n"
            "  -d, --data FILE    word list, one word per line; lines of a-z only are used\n"
            "                     (default " DEFAULT_DATA ", Debian package wamerican)\n"
            "  -t, --threads N    threads for the model and libautomagic (0 = all cores;\n"
            "                     default 1: the model is small); results do not depend on it\n"
            "  -s, --seed N       seed of the split, init, batches, rounding (default 1)\n"
            "  -o, --out DIR      output directory, created if absent (default demo_out;\n"
            "                     scripts/demo.sh passes out/demo)\n"
            "  -b, --batch N      minibatch size (default 128)\n"
            "      --adamw-lr X   AdamW learning rate (default 3e-3)\n"
            "      --context N    previous characters seen (default 4, at most 16)\n"
            "      --embed N      embedding size (default 16)\n"
            "      --hidden N     hidden units (default 192)\n"
            "      --val-frac X   fraction of words held out for validation (default 0.1)\n"
            "  -r, --runs LIST    comma-separated subset of: automagic3, adamw,\n"
            "                     automagic3-sr, automagic3-rtn (default: all four)\n"
            "  -q, --quiet        no progress bar\n"
            "  -h, --help         this help\n",
            prog);
}

/* Parses a whole-string integer in [lo, hi]; 0 or -1 with a message. */
static int parse_int(const char *opt, const char *s, long long lo, long long hi,
                     long long *out) {
    char *end;
    long long v;
    errno = 0;
    v = strtoll(s, &end, 10);
    if (errno || end == s || *end != '\0' || v < lo || v > hi) {
        fprintf(stderr, "amdemo: --%s expects an integer in [%lld, %lld], got '%s'\n", opt, lo,
                hi, s);
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_double(const char *opt, const char *s, double lo, double hi, double *out) {
    char *end;
    double v;
    errno = 0;
    v = strtod(s, &end);
    if (errno || end == s || *end != '\0' || !(v > lo) || !(v < hi)) {
        fprintf(stderr, "amdemo: --%s expects a number in (%g, %g), got '%s'\n", opt, lo, hi,
                s);
        return -1;
    }
    *out = v;
    return 0;
}

/* Returns 0 to run, 1 after --help, -1 on a bad option (message printed). */
static int parse_args(int argc, char **argv, args *a) {
    enum { OPT_ADAMW_LR = 256, OPT_CONTEXT, OPT_EMBED, OPT_HIDDEN, OPT_VAL_FRAC };
    static const struct option longopts[] = {
        {"steps", required_argument, NULL, 'n'},   {"data", required_argument, NULL, 'd'},
        {"threads", required_argument, NULL, 't'}, {"seed", required_argument, NULL, 's'},
        {"out", required_argument, NULL, 'o'},     {"batch", required_argument, NULL, 'b'},
        {"adamw-lr", required_argument, NULL, OPT_ADAMW_LR},
        {"context", required_argument, NULL, OPT_CONTEXT},
        {"embed", required_argument, NULL, OPT_EMBED},
        {"hidden", required_argument, NULL, OPT_HIDDEN},
        {"val-frac", required_argument, NULL, OPT_VAL_FRAC},
        {"runs", required_argument, NULL, 'r'},
        {"quiet", no_argument, NULL, 'q'},         {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0}};
    long long v;
    int c, help = 0;
    a->steps = 8000;
    a->batch = 128;
    a->threads = 1;
    a->ctx = 4;
    a->embed = 16;
    a->hidden = 192;
    a->quiet = 0;
    a->seed = 1;
    a->adamw_lr = 3e-3;
    a->val_frac = 0.1;
    a->data = DEFAULT_DATA;
    a->out = "demo_out";
    a->runs = NULL;
    opterr = 0; /* our own messages */
    while ((c = getopt_long(argc, argv, ":n:d:t:s:o:b:r:qh", longopts, NULL)) != -1) {
        switch (c) {
        case 'n': if (parse_int("steps", optarg, 1, 100000000, &v)) return -1; a->steps = (int)v; break;
        case 't': if (parse_int("threads", optarg, 0, 1024, &v)) return -1; a->threads = (int)v; break;
        case 's': if (parse_int("seed", optarg, 0, LLONG_MAX, &v)) return -1; a->seed = (uint64_t)v; break;
        case 'b': if (parse_int("batch", optarg, 1, 65536, &v)) return -1; a->batch = (int)v; break;
        case OPT_CONTEXT: if (parse_int("context", optarg, 1, 16, &v)) return -1; a->ctx = (int)v; break;
        case OPT_EMBED: if (parse_int("embed", optarg, 1, 1024, &v)) return -1; a->embed = (int)v; break;
        case OPT_HIDDEN: if (parse_int("hidden", optarg, 1, 16384, &v)) return -1; a->hidden = (int)v; break;
        case OPT_ADAMW_LR: if (parse_double("adamw-lr", optarg, 0.0, 1.0, &a->adamw_lr)) return -1; break;
        case OPT_VAL_FRAC: if (parse_double("val-frac", optarg, 0.0, 1.0, &a->val_frac)) return -1; break;
        case 'd': a->data = optarg; break;
        case 'o': a->out = optarg; break;
        case 'r': a->runs = optarg; break;
        case 'q': a->quiet = 1; break;
        case 'h': help = 1; break; /* after the other arguments are checked */
        /* a short option is named by optopt (inside a cluster such as -xq,
         * argv[optind - 1] is another argument); a long one by its word
         * (optopt holds its short letter when it is missing its value) */
        case ':':
            if (strncmp(argv[optind - 1], "--", 2) == 0)
                fprintf(stderr, "amdemo: option '%s' needs a value\n", argv[optind - 1]);
            else fprintf(stderr, "amdemo: option '-%c' needs a value\n", optopt);
            return -1;
        default:
            /* a long option given a value it takes none of (--quiet=1):
             * optopt holds its letter, the argument its word */
            if (optopt && strncmp(argv[optind - 1], "--", 2) == 0 &&
                strchr(argv[optind - 1], '=') != NULL)
                fprintf(stderr, "amdemo: option '%s' takes no value (try --help)\n",
                        argv[optind - 1]);
            else if (optopt)
                fprintf(stderr, "amdemo: unknown option '-%c' (try --help)\n", optopt);
            else /* (getopt_long does not tell an abbreviation of two from none) */
                fprintf(stderr, "amdemo: unknown or ambiguous option '%s' (try --help)\n",
                        argv[optind - 1]);
            return -1;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "amdemo: unexpected argument '%s' (try --help)\n", argv[optind]);
        return -1;
    }
    if (help) { /* (-h extra printed the help and ignored extra) */
        usage(stdout, argv[0]);
        return 1;
    }
    return 0;
}

/* Marks in sel[] the specs named in the comma-separated list (NULL: all).
 * Returns the number selected, or -1 with a message for an unknown name. */
static int select_runs(const char *list, const dm_run_spec *specs, int n, int *sel) {
    const char *p = list;
    int i, count = 0;
    for (i = 0; i < n; i++) sel[i] = list == NULL;
    if (!list) return n;
    for (;;) { /* every item, an empty last one too ("adamw," was taken) */
        size_t len = strcspn(p, ",");
        for (i = 0; i < n; i++)
            if (strlen(specs[i].name) == len && strncmp(specs[i].name, p, len) == 0) break;
        if (i == n) {
            fprintf(stderr, "amdemo: --runs: unknown run '%.*s' (known: automagic3, adamw, "
                            "automagic3-sr, automagic3-rtn)\n", (int)len, p);
            return -1;
        }
        sel[i] = 1;
        p += len;
        if (*p != ',') break;
        p++;
    }
    for (i = 0; i < n; i++) count += sel[i]; /* >= 1: each item named a run */
    return count;
}

/* mkdir -p: creates path and any missing parent. 0, or -1 with a message. */
static int make_dir(const char *path) {
    char buf[4096];
    struct stat st;
    size_t i, n = strlen(path);
    if (n == 0 || n >= sizeof buf) {
        fprintf(stderr, "amdemo: --out: bad directory name '%s'\n", path);
        return -1;
    }
    memcpy(buf, path, n + 1);
    for (i = 1; i <= n; i++) {
        if (buf[i] != '/' && buf[i] != '\0') continue;
        buf[i] = '\0';
        if (mkdir(buf, 0777) != 0 && errno != EEXIST) {
            fprintf(stderr, "amdemo: cannot create output directory '%s': %s\n", buf,
                    strerror(errno));
            return -1;
        }
        buf[i] = path[i];
    }
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode)) {
        fprintf(stderr, "amdemo: cannot create output directory '%s': %s\n", path,
                stat(path, &st) == 0 ? "a file of that name exists" : strerror(errno));
        return -1;
    }
    return 0;
}

/* 0 when a file can be created in dir, else -1 with a message: found before
 * training (a write-protected directory was found after all of it). */
static int check_writable(const char *dir) {
    char probe[4200];
    int fd;
    snprintf(probe, sizeof probe, "%s/.amdemo-probe-XXXXXX", dir);
    fd = mkstemp(probe);
    if (fd < 0) {
        fprintf(stderr, "amdemo: cannot write in output directory '%s': %s\n", dir,
                strerror(errno));
        return -1;
    }
    close(fd);
    unlink(probe);
    return 0;
}

static int is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* Writes curves.csv and summary.txt beside their final names, then renames
 * them over: a failed write (a full disk) leaves the previous files as they
 * were, no truncated one, and is reported once, naming the file. 0 or -1. */
static int write_results(const char *dir, const dm_run_spec *chosen, const dm_result *res,
                         int nrun, const dm_train_opts *o) {
    char csv[4200], sum[4200], csv_t[4300], sum_t[4300];
    const char *failed = NULL;
    FILE *f;
    int e = 0;
    snprintf(csv, sizeof csv, "%s/curves.csv", dir);
    snprintf(sum, sizeof sum, "%s/summary.txt", dir);
    snprintf(csv_t, sizeof csv_t, "%s.tmp", csv);
    snprintf(sum_t, sizeof sum_t, "%s.tmp", sum);
    if (dm_write_curves_csv(csv_t, chosen, res, nrun) != 0) {
        failed = csv;
        e = errno;
    } else if ((f = fopen(sum_t, "w")) == NULL) {
        failed = sum;
        e = errno;
    } else {
        dm_print_summary(f, chosen, res, nrun, o);
        e = ferror(f) ? (errno ? errno : EIO) : 0;
        if (fclose(f) != 0 && e == 0) e = errno;
        if (e) failed = sum;
    }
    /* a final name that is a directory makes its rename fail: found before
     * either rename, so that curves.csv is not replaced when summary.txt
     * cannot be (both are in one directory: other rename failures hit the
     * first as well) */
    if (!failed && is_dir(csv)) failed = csv, e = EISDIR;
    if (!failed && is_dir(sum)) failed = sum, e = EISDIR;
    if (!failed && rename(csv_t, csv) != 0) failed = csv, e = errno;
    if (!failed && rename(sum_t, sum) != 0) failed = sum, e = errno;
    if (failed) {
        unlink(csv_t);
        unlink(sum_t);
        fprintf(stderr, "amdemo: cannot write '%s': %s\n", failed, strerror(e));
        return -1;
    }
    return 0;
}

static void on_log(am_log_level level, const char *msg, void *user) {
    (void)user;
    if (level >= AM_LOG_WARNING) fprintf(stderr, "\nlibautomagic: %s\n", msg);
}

int main(int argc, char **argv) {
    static const dm_run_spec specs[] = {
        {"automagic3", DM_OPT_AUTOMAGIC3, DM_W_F32},
        {"adamw", DM_OPT_ADAMW, DM_W_F32},
        {"automagic3-sr", DM_OPT_AUTOMAGIC3, DM_W_BF16_SR},
        {"automagic3-rtn", DM_OPT_AUTOMAGIC3, DM_W_BF16_RTN},
    };
    enum { NRUNS = sizeof specs / sizeof specs[0] };
    dm_result res[NRUNS];
    dm_run_spec chosen[NRUNS];
    int sel[NRUNS], nrun = 0;
    args a;
    dm_words words;
    dm_examples train, val;
    dm_config cfg;
    dm_train_opts o;
    dm_layout lay;
    char err[512];
    int64_t n_val;
    int r, rc = parse_args(argc, argv, &a);
    FILE *f;

    if (rc > 0) { /* --help: its text written, or exit code 1 as for any failed output */
        if (fflush(stdout) != 0 || ferror(stdout)) {
            fprintf(stderr, "amdemo: writing the standard output failed\n");
            return 1;
        }
        return 0;
    }
    if (rc < 0) return 2;
    if (select_runs(a.runs, specs, NRUNS, sel) < 0) return 2;
    for (r = 0; r < NRUNS; r++)
        if (sel[r]) chosen[nrun++] = specs[r];
    if (dm_words_load(a.data, &words, err, sizeof err) != 0) {
        fprintf(stderr, "amdemo: %s\n", err);
        return 2;
    }
    if (make_dir(a.out) != 0 || check_writable(a.out) != 0) {
        dm_words_free(&words);
        return 2;
    }
    am_set_log_callback(on_log, NULL);
    if (a.threads == 0) { /* all online processors */
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        a.threads = n > 0 ? (int)n : 1;
    }
    am_set_num_threads(a.threads);
#ifdef _OPENMP
    omp_set_num_threads(a.threads);
#endif
    dm_words_shuffle(&words, a.seed);
    n_val = (int64_t)(a.val_frac * (double)words.n);
    if (n_val < 1) n_val = 1;
    if (n_val >= words.n) n_val = words.n - 1;
    cfg.V = DM_VOCAB;
    cfg.K = a.ctx;
    cfg.E = a.embed;
    cfg.H = a.hidden;
    if (dm_examples_build(&words, 0, words.n - n_val, cfg.K, &train) != 0 ||
        dm_examples_build(&words, words.n - n_val, words.n, cfg.K, &val) != 0) {
        fprintf(stderr, "amdemo: out of memory building the examples\n");
        return 1;
    }
    dm_layout_init(&cfg, &lay);
    o.steps = a.steps;
    o.batch = a.batch;
    o.eval_every = a.steps >= 50 ? a.steps / 50 : 1;
    o.val_subset = (int)(val.n < 4096 ? val.n : 4096);
    o.seed = a.seed;
    o.adamw_lr = (float)a.adamw_lr;
    o.progress = !a.quiet;

    printf("amdemo: libautomagic %s (%s kernels, %d threads); model: %d threads%s\n",
           am_version_string(), am_kernel_name(), am_get_num_threads(), a.threads,
#ifdef _OPENMP
           ""
#else
           " asked, 1 used (built without OpenMP)"
#endif
    );
    printf("data: %s: %lld words of a-z, %lld train / %lld validation words, %lld / %lld "
           "next-character examples\n",
           a.data, (long long)words.n, (long long)(words.n - n_val), (long long)n_val,
           (long long)train.n, (long long)val.n);
    printf("model: context %d chars -> embedding %d -> %d tanh -> %d-way softmax, %lld "
           "parameters; %d steps of batch %d per run, seed %llu\n\n",
           cfg.K, cfg.E, cfg.H, cfg.V, (long long)lay.total, o.steps, o.batch,
           (unsigned long long)a.seed);
    fflush(stdout);

    memset(res, 0, sizeof res);
    for (r = 0; r < nrun; r++) {
        if (!a.quiet) fprintf(stderr, "run %d of %d:\n", r + 1, nrun);
        if (dm_train(&cfg, &train, &val, &chosen[r], &o, &res[r], err, sizeof err) != 0) {
            fprintf(stderr, "amdemo: run %s: %s\n", chosen[r].name, err);
            rc = 1;
            break;
        }
    }
    if (rc == 0) {
        dm_print_summary(stdout, chosen, res, nrun, &o);
        if (write_results(a.out, chosen, res, nrun, &o) != 0) {
            rc = 1;
        } else {
            const char *tell = getenv("AMDEMO_OUT_DIR_FILE");
            printf("\nwrote %s/curves.csv and %s/summary.txt\n", a.out, a.out);
            /* scripts/demo.sh learns here where the results are (parsing the
             * options again in bash missed forms getopt_long takes) */
            if (tell && tell[0] && (f = fopen(tell, "w")) != NULL) {
                fputs(a.out, f);
                if (fclose(f) != 0) rc = 1;
            }
        }
    }
    /* a failed write to standard output (a full disk, a closed pipe) */
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "amdemo: writing the standard output failed\n");
        if (rc == 0) rc = 1;
    }
    for (r = 0; r < NRUNS; r++) dm_result_free(&res[r]);
    dm_examples_free(&train);
    dm_examples_free(&val);
    dm_words_free(&words);
    return rc;
}
