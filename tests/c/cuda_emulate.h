/* cuda_emulate.h — the CUDA update's plan (src/cuda/am_cuda_plan.h) run on
 * the CPU: every kernel body in a host loop, in launch order. Shared by
 * test_cuda_emul.c and fuzz/fuzz_equal.c. Include after the plan header. */
#ifndef AM_TEST_CUDA_EMULATE_H
#define AM_TEST_CUDA_EMULATE_H

#include "cuda/am_cuda_plan.h"

/* Thread i of n in the order of this run: ascending, or descending when
 * g_reverse is set. A GPU runs a kernel's threads in no particular order, so
 * the results must not depend on it (no thread reads what another thread of
 * the same kernel writes); running both orders checks that. */
static int g_reverse;

static int64_t order(int64_t i, int64_t n) { return g_reverse ? n - 1 - i : i; }

static void emulate(const am_ck_args *a) {
    int id;
    for (id = 0; id < AM_CK_COUNT_IDS; id++) {
        int64_t n = am_ck_threads(a, id), i, t;
        switch (id) {
        case AM_CK_LANES_G2:
        case AM_CK_LANES_U2:
        case AM_CK_LANES_FLAT:
            for (i = 0; i < n / AM_LANES; i++) {
                float part[AM_LANES];
                int l;
                t = order(i, n / AM_LANES);
                for (l = 0; l < AM_LANES; l++)
                    part[l] = am_ck_lane(a, id, t * AM_LANES + l);
                am_ck_lane_store(a, id, t, am_lanesum_finish(part));
            }
            break;
        case AM_CK_COUNT_FAC:
        case AM_CK_COUNT_FLAT:
            if (a->h->flag)
                for (i = 0; i < n; i++)
                    a->h->nonfinite += (unsigned)am_ck_nonfinite(a, order(i, n));
            break;
        case AM_CK_AGREE:
            if (a->h->status != AM_OK) break;
            for (i = 0; i < n; i++) {
                int64_t kr;
                unsigned m = am_ck_agree(a, order(i, n), &kr);
                a->row_matches[kr] += m;
                a->h->matches += m;
            }
            break;
        case AM_CK_ROW_FINISH:
            /* One block per lr-row on the GPU: agreement of the row, its
             * bump, then its quads (those straddling the row's ends only
             * for the row's own elements). */
            if (a->h->status != AM_OK) break;
            for (i = 0; i < n; i++) {
                int64_t kr = order(i, n), b, q, dummy;
                int64_t lo = kr * a->m, hi = lo + a->m;
                unsigned long long mt = 0;
                for (b = 0; b < a->pol_row_bytes; b++)
                    mt += am_ck_agree(a, kr * a->pol_row_bytes + b, &dummy);
                a->h->matches += mt;
                am_ck_bump(a, kr, mt);
                for (q = lo / 4; 4 * q < hi; q++) am_ck_apply_range(a, q, lo, hi);
            }
            break;
        case AM_CK_FINISH_FLAT:
            if (a->h->status != AM_OK) break;
            for (i = 0; i < n; i++) a->h->matches += am_ck_finish_flat(a, order(i, n));
            break;
        default:
            for (i = 0; i < n; i++) am_ck_elem(a, id, order(i, n));
        }
    }
}

#endif /* AM_TEST_CUDA_EMULATE_H */
