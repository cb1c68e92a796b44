/*
 * automagic.h — the Automagic3 optimizer as a C library.
 *
 * Automagic3 is an Adafactor-style optimizer with one learning rate per output
 * row that tunes itself from the sign agreement of successive updates, and
 * stochastic rounding for bfloat16/float16 weights. The exact math is in
 * SPEC.md (section numbers below refer to it).
 *
 * Two layers:
 *   1. Kernels over caller-owned buffers (am_state_*, am_update*): the caller
 *      owns the parameter, the gradient, every state buffer and a workspace
 *      sized by am_state_get_sizes(). Nothing is allocated on the hot path. The
 *      PyTorch front end and the CUDA path use this layer.
 *   2. An optimizer object for C programs (am_optimizer_*): owns the state of
 *      every registered parameter and updates one parameter the moment its
 *      gradient is ready (the fused-backward pattern), or all of them.
 *
 * Conventions
 *   - Every function that can fail returns an am_status. AM_OK and the
 *     AM_SKIPPED_* values are successes; negative values are errors
 *     (am_status_is_error()).
 *   - An error never modifies any caller buffer, parameter or state, except
 *     what a function's comment names (a workspace, a report, the items'
 *     status fields of am_update_batch).
 *   - Tensors are dense, row-major (C-contiguous). Shapes have 0 to 8 dims,
 *     sizes are int64_t. An update of a parameter with zero elements
 *     changes nothing, but its state and workspace are those its shape
 *     gives (a [2^30, 0] weight has 2^30 rows, each with its lr and row
 *     moment; am_state_get_sizes).
 *   - Nothing here exits, aborts or prints. Messages go to the optional log
 *     callback (am_set_log_callback()).
 *   - Names beginning with am_ and AM_ belong to the library: the static
 *     library (libautomagic.a) also defines internal functions with that
 *     prefix (am_log, am_parallel_for, ...), so a program linking it must
 *     not define its own am_* functions. The shared library exports only
 *     this header's functions.
 *   - The updates compute in IEEE defaults (round to nearest even, no
 *     flush-to-zero or denormals-are-zero, exceptions masked) on every
 *     thread, whatever the caller's floating-point control register holds
 *     (x86 MXCSR, AArch64 FPCR; e.g. after torch.set_flush_denormal(True));
 *     the caller's control settings (rounding, flushing, exception masks)
 *     are as they were on return, while the sticky status flags may record
 *     the update's own inexact or invalid operations (an inf gradient's),
 *     as after any floating-point code. Results do not depend on it.
 *
 * Thread safety: am_update() on different parameters (different buffers) may
 * run concurrently from several threads. One am_optimizer may be used from
 * several threads at once as long as no two threads update the same parameter
 * concurrently and no thread adds parameters, loads a checkpoint into it or
 * destroys it meanwhile (autograd hooks on several threads, each updating
 * its own parameters, are fine). Queries and am_optimizer_save may run
 * concurrently with each other, not with an update of the parameter they
 * read (am_optimizer_lr_mean with id -1, am_optimizer_skipped_count and
 * am_optimizer_save read every parameter: not during any update).
 * am_set_log_callback is a process-wide setting: call it before starting
 * threads. am_set_num_threads is process-wide too, and may be called at any
 * time from any thread (it is atomic, and results never depend on the
 * count); so may am_set_parallel_runner (it waits for a parallel job in
 * progress), except from inside a runner. The log callback itself may
 * be called from several threads at once. Tested under ThreadSanitizer
 * (tests/c/test_threads.c, scripts/test_sanitizers.sh).
 */
#ifndef AUTOMAGIC_H
#define AUTOMAGIC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32) && defined(AM_BUILDING_SHARED)
#define AM_API __declspec(dllexport)
#elif defined(__GNUC__)
#define AM_API __attribute__((visibility("default")))
#else
#define AM_API
#endif

/* ------------------------------------------------------------- version --- */

#define AM_VERSION_MAJOR 0
#define AM_VERSION_MINOR 3
#define AM_VERSION_PATCH 0
#define AM_VERSION_NUMBER \
    (AM_VERSION_MAJOR * 10000 + AM_VERSION_MINOR * 100 + AM_VERSION_PATCH)

/* The library's version as AM_VERSION_NUMBER, for comparing the header one
 * was compiled against with the library one runs against. */
AM_API int am_version_number(void);
/* The library's version as "MAJOR.MINOR.PATCH". Static string, never NULL. */
AM_API const char *am_version_string(void);

/* -------------------------------------------------------------- status --- */

/* Values are fixed forever; new ones are only appended. */
typedef enum am_status {
    AM_OK = 0,
    /* The gradient held a NaN or an infinity: parameter and state are
     * exactly as they were (SPEC 6.2). */
    AM_SKIPPED_NONFINITE_GRAD = 1,
    /* The gradient was finite but the update was not: nothing was changed.
     * Either g*g overflowed float32, or eps = 0 and SPEC 3.1 divides 0 by
     * 0: a row or column of a matrix whose gradient and moment are both
     * still 0, or an element of a 1-D parameter whose gradient and sq are
     * both still 0 (one zero element skips the whole parameter, at every
     * update until one in which no such element is zero: with eps = 0 a
     * bias vector beside a dead unit is never updated; a skipped update
     * stores nothing, so elements that take turns being zero are skipped
     * for ever). Also, where SPEC's
     * left-to-right g * rf * cf stays finite: a row factor times a column
     * factor overflowing float32 (the update computes g * (rf * cf); an
     * all-zero row and an all-zero column of a matrix beside gradients of
     * about 1e7 and more with the default eps, or of about 1 with eps <=
     * 1e-40: skipped at every update while they stay zero; the reference
     * turns the parameter NaN there), and a mean of row moments
     * overflowing (eps near float32's limit), or a 1-D element's new sq
     * plus eps overflowing. Also where a state that
     * holds negative second moments (no update makes one; both checkpoint
     * loaders refuse them) would make the update NaN: a 1-D parameter's sq
     * element whose new value is below -eps, a matrix's row or column
     * moment whose factor is the square root of a negative number. */
    AM_SKIPPED_NONFINITE_UPDATE = 2,

    AM_ERR_NULL_POINTER = -1,    /* a required pointer argument is NULL */
    AM_ERR_INVALID_DTYPE = -2,   /* dtype is not one of am_dtype */
    AM_ERR_INVALID_SHAPE = -3,   /* ndim out of [0, 8], a negative size,
                                    or a product of the nonzero sizes
                                    above 2^56 (sizes would overflow) */
    AM_ERR_INVALID_HPARAM = -4,  /* a hyperparameter outside SPEC 1 */
    AM_ERR_BUFFER_SIZE = -5,     /* a caller buffer is smaller than needed */
    AM_ERR_OUT_OF_MEMORY = -6,
    AM_ERR_NOT_FOUND = -7,       /* no parameter with that id */
    AM_ERR_INVALID_ARGUMENT = -8,/* another argument is out of range */
    AM_ERR_IO = -9,              /* reading or writing a file failed */
    AM_ERR_FORMAT = -10,         /* a file is not a valid checkpoint */
    AM_ERR_MISMATCH = -11,       /* a checkpoint does not match the
                                    registered parameters */
    AM_ERR_UNSUPPORTED = -12,    /* not available in this build, or beyond
                                    a documented limit (a checkpoint's
                                    100 MiB header) */
    AM_ERR_DEVICE = -13          /* the GPU runtime reported an error */
} am_status;

/* Nonzero when s is an error (negative). */
AM_API int am_status_is_error(am_status s);
/* A short English description of s ("invalid hyperparameter", ...). Static
 * string, never NULL; unknown values give "unknown status". */
AM_API const char *am_status_string(am_status s);

/* --------------------------------------------------------------- dtype --- */

typedef enum am_dtype {
    AM_DTYPE_FLOAT32 = 0,
    AM_DTYPE_BFLOAT16 = 1,
    AM_DTYPE_FLOAT16 = 2
} am_dtype;

/* Size in bytes of one element of dtype (4, 2, 2), or 0 for an invalid one. */
AM_API size_t am_dtype_size(am_dtype dtype);
/* "float32", "bfloat16", "float16", or "invalid". Static string. */
AM_API const char *am_dtype_name(am_dtype dtype);

/* ------------------------------------------------------------- logging --- */

typedef enum am_log_level {
    AM_LOG_DEBUG = 0,
    AM_LOG_INFO = 1,
    AM_LOG_WARNING = 2,
    AM_LOG_ERROR = 3
} am_log_level;

/* Receives a message. msg is valid only during the call. */
typedef void (*am_log_fn)(am_log_level level, const char *msg, void *user);

/* Installs a process-wide log callback (NULL: messages are dropped, the
 * default). Error messages describe why a call failed, naming the argument;
 * warnings report things the SPEC says to warn about (an initial lr above 1e-3
 * forced to 1e-6). Not thread-safe with respect to concurrent logging: set it
 * once at start-up. Returns AM_OK. */
AM_API am_status am_set_log_callback(am_log_fn fn, void *user);

/* --------------------------------------------------------- hyperparams --- */

/* SPEC 1. Values are double; the kernels compute in float32, and "finite"
 * below means finite in float32 (at most 3.4028235e38). An update whose
 * applied value overflows float32 (lr * (u + weight_decay * p) beyond
 * 3.4e38: a max_lr or weight_decay near that limit, or parameters near it)
 * writes +-inf into those elements and returns AM_OK, as the reference
 * does: it is not detected (AM_SKIPPED_NONFINITE_UPDATE covers the sums,
 * see there). */
typedef struct am_hparams {
    double lr;             /* initial lr of every row; 0 < lr, finite */
    double min_lr;         /* 0 <= min_lr <= max_lr */
    double max_lr;         /* >= 0, finite */
    double lr_bump_rate;   /* >= 0, finite */
    double beta2;          /* 0 <= beta2 < 1 */
    double eps;            /* >= 0, finite */
    double clip_threshold; /* > 0 (+inf, or beyond float32's range, disables the clip) */
    double weight_decay;   /* >= 0, finite */
} am_hparams;

/* The reference's defaults: lr 1e-6, min_lr 1e-8, max_lr 1e-2,
 * lr_bump_rate 0.1, beta2 0.999, eps 1e-30, clip_threshold 1, weight_decay 0. */
AM_API am_hparams am_hparams_default(void);

/* AM_OK when every field is in its SPEC 1 range, else AM_ERR_INVALID_HPARAM
 * (the log callback names the field) or AM_ERR_NULL_POINTER. lr must also
 * stay positive in float32, the state's precision (lr >= 1.4e-45). An lr
 * above 1e-3 is valid here; am_optimizer_create forces it to 1e-6 (and
 * am_optimizer_load a checkpoint's), am_state_init stores what it is given. */
AM_API am_status am_hparams_validate(const am_hparams *hp);

/* -------------------------------------------------------------- shapes --- */

#define AM_MAX_DIMS 8

/* A dense row-major shape. dims[0] is the output dimension (one lr per
 * dims[0] for ndim >= 2); the last two dims are factored (SPEC 2). */
typedef struct am_shape {
    int32_t ndim;                /* 0..AM_MAX_DIMS */
    int64_t dims[AM_MAX_DIMS];   /* each >= 0; dims[ndim..] ignored */
} am_shape;

/* Sizes, in elements unless named bytes, of one parameter's state and of the
 * workspace one update needs. Filled by am_state_get_sizes(). */
typedef struct am_state_sizes {
    int64_t numel;           /* elements of the parameter */
    int64_t lr_count;        /* float32 per-row lrs: dims[0] (ndim>=2), numel */
    int64_t polarity_bytes;  /* packed sign bits, see am_state */
    int64_t row_count;       /* float32 second-moment rows: prod(dims[:-1]) or 0 */
    int64_t col_count;       /* float32 second-moment cols: prod(dims[:-2])*dims[-1] or 0 */
    int64_t sq_count;        /* float32 unfactored moment (ndim<=1): numel, else 0 */
    int64_t workspace_bytes; /* scratch for one am_update() on the CPU */
} am_state_sizes;

/* Computes the sizes for shape. Returns AM_ERR_NULL_POINTER or
 * AM_ERR_INVALID_SHAPE (out untouched) on bad input. */
AM_API am_status am_state_get_sizes(const am_shape *shape, am_state_sizes *out);

/* ---------------------------------------------------- kernel layer ------ */

/* One parameter's state, in caller-owned buffers sized by am_state_get_sizes().
 *
 * polarity layout: ndim <= 1: bit (i % 8) of byte i / 8 is element i.
 * ndim >= 2: each lr-row (the numel/dims[0] contiguous elements of one output
 * channel) starts on a byte: bit (q % 8) of byte k*ceil(m/8) + q/8 is element
 * q of lr-row k, m = numel/dims[0]. Padding bits are zero. A set bit means the
 * previous update of that element was strictly positive.
 *
 * row/col are NULL for ndim <= 1, sq is NULL for ndim >= 2. */
typedef struct am_state {
    float *lr;          /* [lr_count] */
    uint8_t *polarity;  /* [polarity_bytes] */
    float *row;         /* [row_count]  shape (*B, R) */
    float *col;         /* [col_count]  shape (*B, C) */
    float *sq;          /* [sq_count]   shape S */
    int64_t step;       /* updates applied so far; am_update increments it */
} am_state;

/* Initialises state for a fresh parameter: every lr to initial_lr, polarity,
 * row, col and sq to zero, step to 0. initial_lr must be > 0 and finite in
 * float32, the precision it is stored in (the
 * SPEC's 1e-3 rule is applied by the caller or by am_optimizer_create; this
 * function stores what it is given). Errors: AM_ERR_NULL_POINTER (a buffer the
 * shape needs is NULL), AM_ERR_INVALID_SHAPE, AM_ERR_INVALID_HPARAM,
 * AM_ERR_INVALID_ARGUMENT (a float array not aligned to 4 bytes). */
AM_API am_status am_state_init(const am_shape *shape, am_state *state,
                               double initial_lr);

/* A parameter (or its gradient): data pointer, dtype and shape. data must
 * be aligned to the element size (4 bytes for float32, 2 for bfloat16 and
 * float16; AM_ERR_INVALID_ARGUMENT otherwise), as must a state's float
 * arrays (4 bytes): C compilers and GPUs assume it. The parameter and the
 * state's arrays must not share memory with each other, nor the gradient
 * with the state: the updates refuse that (AM_ERR_INVALID_ARGUMENT,
 * naming the two buffers; am_update_cuda too, by their addresses).
 * A gradient that overlaps its own parameter is not looked for: the result
 * is undefined. A parameter with zero elements is not checked (nothing is
 * read or written). */
typedef struct am_tensor {
    void *data;      /* may be NULL only when numel == 0 */
    am_dtype dtype;
    am_shape shape;
} am_tensor;

/* Randomness of one update (SPEC 5): stochastic rounding noise is a function
 * of (seed, param_id, state step, element index) only (and, for float16, of
 * whether the value is a half subnormal: those take 32 random bits, other
 * values 16; docs/PERFORMANCE.md, "Rounding noise"). */
typedef struct am_rng_key {
    uint64_t seed;
    uint32_t param_id;
} am_rng_key;

/* What one update did. */
typedef struct am_report {
    am_status status;        /* same as the return value of the update */
    float clip_scale;        /* the divisor of SPEC 3.2 (>= 1), 0 if skipped
                                or the parameter has no element */
    float mean_agreement;    /* mean over lr-rows of the agreement fraction;
                                0 if skipped or no element */
    int64_t nonfinite_count; /* non-finite elements seen in the gradient */
} am_report;

/* One whole update of one parameter (SPEC 3): am_update_stats, then
 * am_update_moments, then am_update_finish.
 *
 * param  : the parameter, updated in place (float32, bfloat16 or float16).
 * grad   : its gradient, same shape, any of the three dtypes. Not modified.
 * state  : the parameter's state from am_state_init; step is incremented.
 * hp     : validated hyperparameters (lr is not used here: the state holds the
 *          per-row lrs).
 * key    : randomness key.
 * workspace, workspace_bytes : scratch of at least sizes.workspace_bytes.
 * report : may be NULL.
 *
 * Returns AM_OK; AM_SKIPPED_NONFINITE_GRAD or AM_SKIPPED_NONFINITE_UPDATE
 * (nothing modified); or AM_ERR_NULL_POINTER, AM_ERR_INVALID_DTYPE,
 * AM_ERR_INVALID_SHAPE (param and grad shapes differ, or bad shape),
 * AM_ERR_INVALID_HPARAM, AM_ERR_BUFFER_SIZE (workspace too small),
 * AM_ERR_INVALID_ARGUMENT (state.step < 0, or INT64_MAX: it cannot be
 * incremented; or param, grad or a state array not aligned to its element
 * size, or buffers that share memory, see am_tensor). On any status but AM_OK nothing the caller owns is modified
 * except the workspace and the report. */
AM_API am_status am_update(const am_tensor *param, const am_tensor *grad,
                           am_state *state, const am_hparams *hp,
                           am_rng_key key, void *workspace,
                           size_t workspace_bytes, am_report *report);

/* One parameter's update in am_update_batch: the arguments of am_update,
 * and its status on return. */
typedef struct am_batch_item {
    const am_tensor *param;
    const am_tensor *grad;
    am_state *state;
    const am_hparams *hp;
    am_rng_key key;
    am_report *report; /* may be NULL */
    am_status status;  /* out: what am_update returned for this item */
} am_batch_item;

/* The workspace am_update_batch needs for these items when it runs on
 * nthreads threads (am_get_num_threads() at the call): in *bytes.
 * Returns AM_OK, or the first item's argument error as am_update_batch
 * would (AM_ERR_NULL_POINTER for bytes NULL, whatever n, or items NULL
 * with n > 0,
 * AM_ERR_INVALID_ARGUMENT for n < 0 or nthreads < 1, or when the size
 * would exceed SIZE_MAX / 2: one slot per thread of the largest item's
 * am_update workspace, which a zero-element item of a huge shape such as
 * [2^56, 0] makes huge). */
AM_API am_status am_update_batch_workspace(const am_batch_item *items, int64_t n,
                                           int nthreads, size_t *bytes);

/* The updates of n parameters, with the result of am_update on each item
 * in turn (the same bits), faster on several threads: whole parameters go
 * to separate threads (each update on one thread), so that one thread's
 * pass that only reads the gradient overlaps another's apply, which reads
 * and writes; a parameter larger than a 2 * threads-th of the total runs
 * first, on every thread. The split depends only on the items' sizes and
 * the thread count, never on timing.
 *
 * Every item is checked before anything is updated: an argument error in
 * any item (what am_update would return), two items whose parameters,
 * states or reports share memory, or one's gradient with the other's
 * parameter or state (AM_ERR_INVALID_ARGUMENT; in turn the second would read the
 * first's result, at the same time they would race), a workspace size over
 * SIZE_MAX / 2 (AM_ERR_INVALID_ARGUMENT), a workspace NULL
 * (AM_ERR_NULL_POINTER) or smaller than am_update_batch_workspace says for
 * one thread (AM_ERR_BUFFER_SIZE), or no memory for the sharing check
 * (AM_ERR_OUT_OF_MEMORY) return that error with nothing modified but the
 * items' status fields (the failing item's holds the error, the others
 * AM_ERR_INVALID_ARGUMENT: not run). The items' descriptors (the am_tensor
 * structs and their dims, the am_hparams, the am_state struct) must not lie
 * in memory the batch writes (a parameter, a state buffer, a report): an
 * earlier item's update would change a later item's arguments after the
 * check, and that item then fails with its own status while the call
 * returns AM_OK. items NULL with n > 0:
 * AM_ERR_NULL_POINTER; n < 0: AM_ERR_INVALID_ARGUMENT; n == 0: AM_OK.
 * Otherwise every item is updated and its status set (AM_OK, or a skip
 * for a non-finite gradient, which leaves that item as it was), and the
 * call returns AM_OK. Gradients may share memory (they are only read). A
 * workspace sized for fewer threads than run at the call (another thread
 * may change the count after the caller sized it) is used with as many
 * threads as it has room for: the same bits. */
AM_API am_status am_update_batch(am_batch_item *items, int64_t n, void *workspace,
                                 size_t workspace_bytes);

/* The phases of am_update, for data-parallel engines that shard a parameter
 * and must reduce the small vectors across processes between phases. Each
 * takes the same arguments as am_update and the same workspace, untouched by
 * the caller between calls except through am_workspace_view.
 *
 * am_update_stats   : one pass over grad. Fills the view's row_sumsq and
 *                     col_sumsq (sums of g*g over C and over R, ndim >= 2) and
 *                     nonfinite count; for ndim <= 1 (unfactored) it also
 *                     fills u2_sum, and am_update_moments has nothing to do.
 *                     Returns AM_SKIPPED_NONFINITE_GRAD when the (local)
 *                     gradient has a non-finite element.
 * (a sharded engine all-reduces here what its split needs, see below)
 * am_update_moments : from the (reduced) sums and the state, the new second
 *                     moments and scale factors (kept in the workspace, state
 *                     untouched), then the sum of u*u into the view's u2_sum:
 *                     from column sums am_update_stats kept when its row
 *                     sums are unchanged (rows of at most 16384 elements),
 *                     else one more pass over grad.
 * (all-reduce u2_sum here)
 * am_update_finish  : clip, agreement, lr bump, parameter update; commits the
 *                     new moments, polarity, lrs and step to state. Returns
 *                     AM_SKIPPED_NONFINITE_UPDATE if u2_sum is not finite.
 * A skip is returned by every later phase too (moments and finish after a
 * non-zero nonfinite count, which a sharded engine may learn only from the
 * reduction), so an engine may call every phase on every shard whatever
 * they return, and nothing the caller owns but the workspace changes.
 * The sums are over the tensor the caller passes. am_update_stats serves a
 * split whose shards' moments are their own: k equal dims[0] shards of a
 * 1-D or an ndim >= 3 parameter, where only nonfinite and u2_sum are
 * all-reduced (sums) and the reduced u2_sum is divided by k (the clip's
 * rms divides it by the numel of the tensor passed); reducing row_sumsq or
 * col_sumsq there adds other rows' or matrices' sums (wrong: the header
 * said to until the thirty-third session). A 2-D parameter's rows split,
 * or unequal shards: am_update_stats_shard (below), whose rms divides by
 * the whole parameter's numel, for any split along dims[0].
 * Errors: those of am_update, and AM_ERR_INVALID_ARGUMENT from
 * am_update_moments (am_update_finish) when the workspace does not hold
 * am_update_stats' (am_update_moments') results for a parameter of this
 * shape (phases out of order, or another parameter's workspace), with
 * nothing modified. */
AM_API am_status am_update_stats(const am_tensor *param, const am_tensor *grad,
                                 const am_state *state, const am_hparams *hp,
                                 void *workspace, size_t workspace_bytes);

/* Where a shard lies in its parameter: the tensors passed to the phases hold
 * a contiguous range of the whole parameter's dims[0] (rows of a matrix,
 * whole matrices of an ndim >= 3 weight, elements of a vector); every other
 * dim is the whole parameter's. */
typedef struct am_shard {
    int64_t dim0_total;  /* dims[0] of the whole parameter */
    int64_t dim0_offset; /* where the shard starts along it (0 for the first) */
} am_shard;

/* am_update_stats for one shard of a parameter split along dims[0] across
 * processes (ZeRO-style data parallelism: each process keeps the state of
 * its own rows). The phases then follow SPEC 3 for the whole parameter,
 * with these reductions (sums over the shards) between them:
 *
 *   am_update_stats_shard                     on every shard
 *   all-reduce col_sumsq (2-D), nonfinite, and row_moment_sum (2-D)
 *   am_update_moments                         on every shard
 *   all-reduce u2_sum
 *   am_update_finish                          on every shard
 *
 * Do not reduce row_sumsq: a shard holds whole rows. For a 2-D parameter
 * (rows split) the column moments divide by dim0_total rows and the row
 * factors use the mean of the row moments over all dim0_total rows, from
 * the reduced row_moment_sum; each shard's state holds its own rows (lr,
 * polarity, row moments: shape [rows of the shard]) and a copy of the
 * column moments [C], which stays the same on every shard when every copy
 * starts the same (am_state_init) and every shard runs every update. For
 * ndim >= 3 (whole matrices) and ndim 1 (element ranges) every moment is
 * the shard's own and only u2_sum (and nonfinite) is reduced. The clip's
 * rms divides the reduced u2_sum by the whole parameter's numel, so the
 * shards may differ in size; a shard may be empty (dims[0] = 0: it updates
 * nothing, its step and column moments stay as they were; it still takes
 * part in the reductions, with zeros).
 *
 * Checkpoints and resharding: the whole parameter's state (am_state of the
 * whole shape, what am_update would hold) is the shards' states put end
 * to end in dims[0] order: lr, row moments, and for ndim >= 2 the
 * polarity bytes (each lr-row starts on a byte); sq and the polarity bits
 * of a 1-D shard starting at element e0 are elements and bits e0.. of the
 * whole's; col (2-D: a copy per shard; ndim >= 3: each shard's own
 * matrices, end to end) and step from any non-empty shard. A state so
 * gathered can be split again along other bounds (tested: after every
 * step the shards' states are those slices of am_update's state on the
 * whole, but for the 2-D column moments' summation error, above; and a
 * matrix gathered from 2 shards and split into 3 trains on as the whole).
 *
 * The result is am_update's on the whole parameter within float32
 * summation error: lrs and polarity bits the same (but for an element
 * whose u / scale is within an ulp of underflowing to 0, whose sign bit,
 * and so its lr-row's lr, the clip scale's last bit can decide: seen by a
 * review only with a clip_threshold of 1e-30), row moments (2-D) the
 * same bits; column moments, the row mean and so the update within about
 * R * 2^-24 relative for R rows in all (am_update sums the R row moments
 * in float32, the shards in double, and each column's R squares in
 * another order: 20-400 ulp of a parameter on 1e5-1e6 rows where the
 * clip does not bind; where it binds the row mean's error is one factor
 * of the whole update and cancels; within 2 ulp on the tested shapes).
 * ndim >= 3 and 1-D shards: the same bits, but for the clip scale where
 * the clip binds, which may differ in its last bit (u2_sum is added in
 * another order: seen on 1-D shards whose bounds cut the whole's tiles of
 * 16384 elements, a few hundred of 100,003 float32 elements 1 ulp apart,
 * and within one tile too, 4 of 1,000 elements split 1 + 500 + 499;
 * where the clip does not bind, the same bits). The rounding noise of
 * bfloat16/float16 parameters is keyed by the element's index in the whole
 * parameter (SPEC 5: dim0_offset places it), so every shard passes the
 * whole parameter's key and the noise does not depend on the split.
 *
 * Errors: those of am_update_stats; AM_ERR_NULL_POINTER (shard NULL);
 * AM_ERR_INVALID_ARGUMENT (a 0-D parameter, dim0_total smaller than the
 * shard's dims[0], or dim0_offset outside [0, dim0_total - dims[0]]);
 * AM_ERR_INVALID_SHAPE (the whole parameter's element count above 2^56).
 * Nothing but the workspace is modified. */
AM_API am_status am_update_stats_shard(const am_tensor *param, const am_tensor *grad,
                                       const am_state *state, const am_hparams *hp,
                                       const am_shard *shard, void *workspace,
                                       size_t workspace_bytes);
/* Phase 2 of an update (see am_update_stats above for the three phases,
 * their order and what each leaves in the workspace): the new second
 * moments, factors and sum of u^2, into the workspace. The arguments and
 * errors of am_update_stats; nothing but the workspace is modified. */
AM_API am_status am_update_moments(const am_tensor *param,
                                   const am_tensor *grad,
                                   const am_state *state, const am_hparams *hp,
                                   void *workspace, size_t workspace_bytes);
/* Phase 3 (see am_update_stats above): the lr bump, the apply, the new
 * polarity, second moments and step into param and state, and the report
 * (NULL: none). The arguments and errors of am_update_stats, and key as
 * am_update's; a phase that skipped (a non-finite gradient) makes this one
 * skip too, with state and parameter unchanged. */
AM_API am_status am_update_finish(const am_tensor *param,
                                  const am_tensor *grad, am_state *state,
                                  const am_hparams *hp, am_rng_key key,
                                  void *workspace, size_t workspace_bytes,
                                  am_report *report);

/* Pointers into a workspace for the between-phase reductions. */
typedef struct am_workspace_view {
    float *row_sumsq;           /* [row_count]: sum over C of g*g */
    float *col_sumsq;           /* [col_count]: sum over R of g*g */
    double *u2_sum;             /* [1]: sum of u*u before clipping */
    int64_t *nonfinite;         /* [1]: non-finite gradient elements */
    double *row_moment_sum;     /* [1]: after am_update_stats_shard of a 2-D
                                   shard, the sum over its rows of the new
                                   row moments; 0 after any other stats */
} am_workspace_view;

/* Fills view with pointers into workspace for shape. Errors as
 * am_state_get_sizes, plus AM_ERR_BUFFER_SIZE. */
AM_API am_status am_workspace_view_get(const am_shape *shape, void *workspace,
                                       size_t workspace_bytes,
                                       am_workspace_view *view);

/* -------------------------------------------------------- threading ----- */

/* Sets the number of threads the CPU kernels may use (1 = single-threaded,
 * the default; 0 = the number of online processors; a parallel job runs on
 * at most 257, the caller's thread included, whatever n says, on the
 * library's own pool or a lent runner). Results
 * are bit-identical for every value. Process-wide. Errors:
 * AM_ERR_INVALID_ARGUMENT (n < 0). */
AM_API am_status am_set_num_threads(int n);
/* The thread count last set (>= 1; 0 was replaced by the number of online
 * processors), as given: a parallel job runs on at most 257 threads, on the
 * library's own pool or a runner lent with am_set_parallel_runner. */
AM_API int am_get_num_threads(void);
/* The name of the CPU kernel set in use: "scalar" (the reference),
 * "portable" (vector code for any CPU: non-x86 ones, x86 without AVX2),
 * "avx2" or "avx2+avx512". Static. */
AM_API const char *am_kernel_name(void);

/* A host's thread pool that runs the library's parallel work instead of the
 * library's own pool (a trainer that already keeps threads busy, e.g.
 * PyTorch's OpenMP team, loses time when two pools compete for the cores).
 * When the library has a parallel job it calls
 *     runner(work, arg, nthreads, ctx)
 * from the thread that called am_update. The runner must call work(arg) on
 * up to nthreads threads at the same time (the calling thread may be one of
 * them) and return only after every one of those calls has returned. Any
 * number of calls from 1 to nthreads is correct: work claims tasks from a
 * shared counter until none are left, and the results are bit-identical
 * whichever threads ran which tasks. The library also runs any task left
 * unclaimed on the calling thread after the runner returns. */
typedef void (*am_parallel_runner)(void (*work)(void *arg), void *arg,
                                   unsigned nthreads, void *ctx);

/* Sends the parallel work of every later update to runner (with ctx); NULL
 * returns to the library's own pool. Process-wide; waits for a parallel job
 * in progress to finish. A process that fork()s forgets the runner in the
 * child (the host's pool may not survive the fork) and uses the library's
 * pool there. Returns AM_OK; called from inside a runner (the runner
 * function on the thread the library called it from, or work on any
 * thread), where that wait would never end, it changes nothing and returns
 * AM_ERR_INVALID_ARGUMENT (from the runner function on another thread of
 * the host's it would wait forever: do not). */
AM_API am_status am_set_parallel_runner(am_parallel_runner runner, void *ctx);

/* A ready-made runner for a GNU OpenMP runtime (libgomp, as loaded by
 * PyTorch's CPU build; LLVM's and Intel's runtimes provide the same entry
 * point): ctx must be the address of that runtime's GOMP_parallel, e.g.
 * dlsym(handle, "GOMP_parallel"). The work then runs on the runtime's
 * thread team, as a `#pragma omp parallel num_threads(nthreads)` region in
 * the host would. Pass it to am_set_parallel_runner. */
AM_API void am_gomp_runner(void (*work)(void *arg), void *arg,
                           unsigned nthreads, void *ctx);

/* ---------------------------------------------------- optimizer object -- */

typedef struct am_optimizer am_optimizer;

/* Creates an optimizer. hp is validated (AM_ERR_INVALID_HPARAM); an lr above
 * 1e-3 is forced to 1e-6 with a warning through the log callback, as the
 * reference does. seed keys the stochastic rounding. *out is set only on
 * success. Errors: AM_ERR_NULL_POINTER, AM_ERR_INVALID_HPARAM,
 * AM_ERR_OUT_OF_MEMORY. */
AM_API am_status am_optimizer_create(const am_hparams *hp, uint64_t seed,
                                     am_optimizer **out);

/* Frees the optimizer and all the state it owns (not the parameters).
 * NULL is a no-op. */
AM_API void am_optimizer_destroy(am_optimizer *opt);

/* Registers a parameter: data (updated in place, owned by the caller, must
 * stay valid while the optimizer may update it: until it is destroyed or
 * am_optimizer_set_param_data points the parameter elsewhere), its dtype, ndim and shape
 * (int64_t[ndim]; may be NULL when ndim == 0). Its state is allocated and
 * initialised. *out_id receives the parameter id (0, 1, 2, ... in order of
 * registration), which also keys its randomness. Errors: AM_ERR_NULL_POINTER,
 * AM_ERR_INVALID_DTYPE, AM_ERR_INVALID_SHAPE (as am_state_get_sizes, or a
 * size above 2^53, which a checkpoint's header cannot hold exactly: only a
 * zero-element shape can have one), AM_ERR_OUT_OF_MEMORY,
 * AM_ERR_INVALID_ARGUMENT (INT32_MAX parameters already registered, or data
 * not aligned to the element size). */
AM_API am_status am_optimizer_add_param(am_optimizer *opt, void *data,
                                        am_dtype dtype, int32_t ndim,
                                        const int64_t *shape, int32_t *out_id);

/* Number of registered parameters, or 0 for NULL. */
AM_API int32_t am_optimizer_num_params(const am_optimizer *opt);

/* Points parameter id at data from now on (a trainer that moved or
 * reallocated its weights: same shape and dtype as registered; the state,
 * the step and the randomness key stay). data follows the rules of
 * am_optimizer_add_param: aligned to the element size, NULL only for a
 * zero-element parameter. Errors: AM_ERR_NULL_POINTER (opt, or data with
 * elements), AM_ERR_NOT_FOUND, AM_ERR_INVALID_ARGUMENT (data not aligned);
 * then nothing changes. Not to be called while that parameter is updated. */
AM_API am_status am_optimizer_set_param_data(am_optimizer *opt, int32_t id, void *data);

/* Updates parameter id with grad (same shape, dtype grad_dtype): call it the
 * moment the gradient is ready, then reuse the gradient buffer. report may be
 * NULL. Returns what am_update returns, AM_ERR_NULL_POINTER (opt is NULL) or
 * AM_ERR_NOT_FOUND. */
AM_API am_status am_optimizer_update_param(am_optimizer *opt, int32_t id,
                                           const void *grad,
                                           am_dtype grad_dtype,
                                           am_report *report);

/* Updates every parameter: grads[i] and grad_dtypes[i] for parameter i
 * (grads[i] == NULL skips parameter i: its report, if any, is all zero,
 * status AM_OK). reports: NULL or an array of
 * am_optimizer_num_params() entries. Arguments are all checked before any
 * update. Returns AM_OK when every update was applied, the first AM_SKIPPED_*
 * seen otherwise (the other parameters are still updated), or an error
 * (nothing updated): AM_ERR_NULL_POINTER (opt, grads or grad_dtypes NULL),
 * AM_ERR_INVALID_DTYPE (grad_dtypes[i] invalid for a non-NULL grads[i]),
 * AM_ERR_INVALID_ARGUMENT (a parameter given a gradient has step ==
 * INT64_MAX, which a checkpoint can hold but an update cannot increment, a
 * gradient is not aligned to its element size, or a gradient shares memory
 * with its parameter's state).
 * On more than one thread (am_set_num_threads) the updates run as one
 * am_update_batch call (whole parameters on separate threads; the same
 * bits as one at a time). */
AM_API am_status am_optimizer_update_all(am_optimizer *opt,
                                         const void *const *grads,
                                         const am_dtype *grad_dtypes,
                                         am_report *reports);

/* Copies parameter id's per-row lrs into out (capacity count floats; needs
 * am_optimizer_lr_count()). Errors: AM_ERR_NULL_POINTER, AM_ERR_NOT_FOUND,
 * AM_ERR_BUFFER_SIZE. */
AM_API am_status am_optimizer_get_lrs(const am_optimizer *opt, int32_t id,
                                      float *out, int64_t count);
/* Number of per-row lrs of parameter id, or -1 if there is none. */
AM_API int64_t am_optimizer_lr_count(const am_optimizer *opt, int32_t id);

/* The mean lr of parameter id (id >= 0), or, with id == -1, the mean over
 * the parameters updated at least once (step > 0) of each one's mean lr
 * (the reference's get_avg_learning_rate for one group, which averages the
 * parameters that have state; the optimizer's initial lr when none has
 * been updated). Errors: AM_ERR_NULL_POINTER, AM_ERR_NOT_FOUND. With id -1
 * it reads every parameter's lrs: not concurrently with any update. */
AM_API am_status am_optimizer_lr_mean(const am_optimizer *opt, int32_t id,
                                      double *out);

/* Number of updates skipped for a non-finite gradient or update since
 * creation, summed over parameters (it reads every parameter's count: not
 * concurrently with any update). 0 for NULL. Each parameter's count, and
 * the sum, stop at INT64_MAX (a loaded checkpoint may hold any count). */
AM_API int64_t am_optimizer_skipped_count(const am_optimizer *opt);

/* Read-only access to parameter id's state (pointers owned by the optimizer,
 * valid until it is destroyed) into *out, and its shape into *shape (shape
 * may be NULL). Errors: AM_ERR_NULL_POINTER (opt or out NULL),
 * AM_ERR_NOT_FOUND. */
AM_API am_status am_optimizer_get_state(const am_optimizer *opt, int32_t id,
                                        am_state *out, am_shape *shape);

/* Copies the optimizer's hyperparameters (after the lr > 1e-3 rule, or as a
 * loaded checkpoint set them) into *hp and its seed into *seed; either may
 * be NULL. Errors: AM_ERR_NULL_POINTER (opt is NULL). */
AM_API am_status am_optimizer_get_hparams(const am_optimizer *opt,
                                          am_hparams *hp, uint64_t *seed);

/* Replaces the optimizer's hyperparameters with *hp (its seed stays), e.g.
 * after am_optimizer_load, which sets the checkpoint's: a trainer resuming
 * with another weight_decay or max_lr (the PyTorch front end's rule, SPEC 7,
 * that the constructor's values win) sets them here. Validated as by
 * am_optimizer_create (an lr above 1e-3 is forced to 1e-6 with a warning);
 * the per-row lrs already in the state are kept (hp->lr only starts the
 * parameters registered later). Not concurrently with any update, load or
 * save of the same optimizer. Errors (nothing changed): AM_ERR_NULL_POINTER,
 * AM_ERR_INVALID_HPARAM. */
AM_API am_status am_optimizer_set_hparams(am_optimizer *opt, const am_hparams *hp);

/* --------------------------------------------------------- checkpoints -- */

/* A checkpoint holds the optimizer's whole state: hyperparameters, seed, and
 * for every parameter its dtype and shape, per-row lrs, polarity bits,
 * second moments (row/col or sq), step and skipped-update count. It does not
 * hold the parameters themselves. The file is a safetensors file (Python's
 * safetensors package opens it): tensors "param.<i>.lr", ".polarity",
 * ".row", ".col", ".sq", ".step", ".skipped", and a "__metadata__" string map
 * with the format version, the hyperparameters, the seed and a CRC-32 of the
 * contents. docs/RELIABILITY.md describes it in full.
 *
 * Loading needs an optimizer with the same parameters registered, in the
 * same order, with the same dtypes and shapes. It validates everything
 * (format and version, checksum, every tensor's dtype, shape and offsets,
 * the hyperparameters, step >= 0, no negative lr or moment, zero polarity
 * padding bits) before changing anything: on any error the
 * optimizer is exactly as it was. On success the hyperparameters and seed
 * are the checkpoint's (am_optimizer_set_hparams changes them after), and
 * training continues bit-identically. (A start lr
 * above 1e-3, which no saved optimizer holds, is forced to 1e-6 with a
 * warning, as am_optimizer_create does: parameters registered after the
 * load start from it.)
 *
 * Not to be called while another thread updates, loads into or destroys the
 * same optimizer; saving the same optimizer from several threads at once is
 * safe (different temporary files). */

/* Saves opt to path atomically: the image is written to a new temporary
 * file "<path>.tmp.<pid>.<n>" in the same directory (where the file name is
 * too long for that suffix: "<dir>/.automagic.tmp.<pid>.<n>"), flushed to the disk
 * (fsync), renamed over path, and the directory is fsynced. A process killed
 * meanwhile leaves path as it was (old checkpoint, or absent), possibly with
 * a stale temporary file beside it. The new file's mode is 0666 minus the
 * umask. Errors: AM_ERR_NULL_POINTER, AM_ERR_INVALID_ARGUMENT (path is ""),
 * AM_ERR_OUT_OF_MEMORY, AM_ERR_UNSUPPORTED (so many parameters, about
 * 200,000 at 500-570 header bytes each, that the header would pass the
 * 100 MiB limit loaders enforce),
 * AM_ERR_IO (path is a directory, or a device, FIFO or socket, or a
 * symbolic link to one, which is left as it is; a symbolic link to a regular
 * file is replaced by the new file, its target left as it was; or the log
 * callback says what failed; the temporary file is
 * removed and path is untouched, except when only the final fsync of the
 * directory failed: path then already holds the new checkpoint, whose
 * rename may not survive a power cut).
 * Test hook: with the environment variable AUTOMAGIC_TEST_STALL_SAVE_FD set
 * to an open file descriptor, a save writes half its temporary file, writes
 * one byte to that descriptor and then waits forever (to be killed by a
 * test); never set it otherwise. */
AM_API am_status am_optimizer_save(const am_optimizer *opt, const char *path);

/* The checkpoint image (the same bytes am_optimizer_save writes) into buf.
 * *size receives the image's size. buf == NULL with capacity 0 queries the
 * size only (no image is built and no state read). Errors: AM_ERR_NULL_POINTER (opt or size NULL, or buf NULL
 * with capacity > 0), AM_ERR_BUFFER_SIZE (capacity too small: buf and *size
 * untouched), AM_ERR_OUT_OF_MEMORY, AM_ERR_UNSUPPORTED (as for
 * am_optimizer_save). */
AM_API am_status am_optimizer_save_memory(const am_optimizer *opt, void *buf,
                                          size_t capacity, size_t *size);

/* Loads the checkpoint file at path into opt (see above). Errors:
 * AM_ERR_NULL_POINTER, AM_ERR_IO (cannot open or read, not a regular file:
 * a FIFO or device is refused without waiting on it),
 * AM_ERR_OUT_OF_MEMORY, AM_ERR_FORMAT (not a valid checkpoint: corrupt,
 * truncated, wrong version, invalid values; the checksum is checked before
 * the file is compared with opt, so a damaged file is never called a
 * mismatch), AM_ERR_MISMATCH (intact and valid, but its
 * parameter count, dtypes or shapes differ from opt's; or the file is larger
 * than any checkpoint of opt's parameters can be, refused before it is read:
 * their tensors' bytes plus 8 plus the 100 MiB header limit). The log
 * callback names the first problem found. opt is unchanged on every error. */
AM_API am_status am_optimizer_load(am_optimizer *opt, const char *path);

/* As am_optimizer_load, from the size bytes at image (not kept). */
AM_API am_status am_optimizer_load_memory(am_optimizer *opt,
                                          const void *image, size_t size);

/* ---------------------------------------------------------------- CUDA -- */

/* The update on an NVIDIA GPU (docs/CUDA.md). Same meaning as am_update():
 * the same rounding noise for the same (seed, param_id, step, element), the
 * same lr and polarity decisions, and, because the GPU kernels reduce in the
 * CPU's canonical order with the same float32 operations, bit-identical
 * parameters and state (SPEC 5).
 *
 * Where: am_update_cuda and am_cuda_device_count work in libautomagic_cuda
 * (built when the CMake option AM_CUDA is ON; it also contains the whole CPU
 * API). In libautomagic they return AM_ERR_UNSUPPORTED (but
 * am_cuda_device_count(NULL) is AM_ERR_NULL_POINTER there too).
 * am_cuda_workspace_bytes is host arithmetic and works in both. */

/* Bytes of device workspace one am_update_cuda() of a parameter of this
 * shape needs (alignment slack included). Errors: AM_ERR_NULL_POINTER,
 * AM_ERR_INVALID_SHAPE (out untouched). */
AM_API am_status am_cuda_workspace_bytes(const am_shape *shape, size_t *out);

/* Number of CUDA devices visible to this process into *count (0 when there
 * is no device or no driver: AM_OK; a driver too old for the CUDA runtime
 * the library was built with also gives 0, with a warning through the log
 * callback saying so). Errors: AM_ERR_NULL_POINTER,
 * AM_ERR_DEVICE (the runtime failed otherwise), AM_ERR_UNSUPPORTED (library
 * built without CUDA; *count = 0). */
AM_API am_status am_cuda_device_count(int *count);

/* Queues one whole update of one parameter on a CUDA stream (SPEC 3).
 *
 * param, grad : device data; same shapes and dtypes as am_update.
 * state       : device buffers (lr, polarity, row/col or sq) laid out exactly
 *               as for am_update, so state moves between CPU and GPU by plain
 *               copies. state->step is NOT used: see step.
 * step        : device pointer to the parameter's int64 step count. The
 *               kernels read it (it keys the noise and gates the lr bump) and
 *               increment it when the update is applied, so the host never
 *               has to know whether a step was skipped. Being on the device,
 *               it is not checked (am_update refuses step < 0 or INT64_MAX).
 * hp, key     : as am_update (hp is read on the host, at call time).
 * workspace, workspace_bytes : device scratch of at least
 *               am_cuda_workspace_bytes(); may be shared by updates queued on
 *               the same stream, never by concurrent streams.
 * stream      : a cudaStream_t (NULL: the default stream) of the calling
 *               thread's current device, which must hold every pointer.
 * report      : NULL, or a device pointer, 8-byte aligned (it holds an
 *               int64), to one am_report that the last
 *               kernel fills (status AM_OK / AM_SKIPPED_*, clip_scale,
 *               mean_agreement, nonfinite_count). The caller reads it when it
 *               likes (after synchronising the stream or an event).
 *               mean_agreement is total matches / numel, which equals the
 *               CPU's mean over lr-rows up to float rounding.
 *
 * Nothing is allocated, nothing synchronises, nothing is copied to the host:
 * the call can be captured in a CUDA graph and replayed (each replay is one
 * more step). Before its launches it clears the calling thread's last CUDA
 * error (cudaGetLastError), so that an earlier error is not taken for its
 * own: check your own launches before calling it. A non-finite gradient or update is decided on the device: the
 * parameter and state are then left untouched, the step not incremented and
 * the report says AM_SKIPPED_*; the return value is still AM_OK, which here
 * means "queued".
 *
 * Returns AM_OK (queued; also for numel 0, where no kernel is launched and
 * a report, if given, is zeroed by a cudaMemsetAsync on the stream), or, with nothing queued and nothing modified:
 * AM_ERR_NULL_POINTER, AM_ERR_INVALID_DTYPE, AM_ERR_INVALID_SHAPE,
 * AM_ERR_INVALID_HPARAM, AM_ERR_BUFFER_SIZE (workspace too small),
 * AM_ERR_INVALID_ARGUMENT (param, grad, a state array, step or report not
 * aligned to its element size, or the parameter, gradient and state arrays
 * sharing memory as am_tensor says; step < 0 cannot be checked: it is on
 * the device), AM_ERR_UNSUPPORTED (library without CUDA), AM_ERR_DEVICE (the first launch
 * failed: bad stream, no device, kernel image missing for this GPU; the log
 * callback gets CUDA's message). AM_ERR_DEVICE after the first launch (the
 * runtime failing mid-sequence): nothing is launched after the launch that
 * failed; up to the agreement kernel the plan writes the workspace only
 * (state and parameter as they were), after it the update may be partly
 * applied. Device
 * pointers are not validated: a wrong one is a device fault, as in any CUDA
 * library. */
AM_API am_status am_update_cuda(const am_tensor *param, const am_tensor *grad,
                                const am_state *state, int64_t *step,
                                const am_hparams *hp, am_rng_key key,
                                void *workspace, size_t workspace_bytes,
                                void *stream, am_report *report);

#ifdef __cplusplus
}
#endif

#endif /* AUTOMAGIC_H */
