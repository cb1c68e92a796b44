/*
 * model.h — a character-level MLP language model (Bengio et al. 2003, as in
 * karpathy's makemore), forward and backward written by hand.
 *
 *   X (B, K) tokens  -> emb lookup      -> x      (B, K*E)
 *   x                -> x W1^T + b1     -> hpre   (B, H)
 *   hpre             -> tanh            -> h      (B, H)
 *   h                -> h W2^T + b2     -> logits (B, V)
 *   logits, Y (B)    -> softmax + NLL   -> loss   (scalar, mean over B)
 *
 * Parameters (all float32, one contiguous block, in this order):
 *   emb (V, E), W1 (H, K*E), b1 (H), W2 (V, H), b2 (V)
 * Weights are (out, in) like torch.nn.Linear, so Automagic3 keeps one lr per
 * output unit (and one per character for emb).
 */
#ifndef DM_MODEL_H
#define DM_MODEL_H

#include <stdint.h>

#define DM_NUM_TENSORS 5

typedef struct dm_config {
    int V; /* vocabulary */
    int K; /* context length */
    int E; /* embedding size */
    int H; /* hidden units */
} dm_config;

/* Where each tensor lives inside a parameter-sized block. */
typedef struct dm_layout {
    int64_t offset[DM_NUM_TENSORS];
    int32_t ndim[DM_NUM_TENSORS];
    int64_t shape[DM_NUM_TENSORS][2];
    int64_t total;
} dm_layout;

extern const char *const dm_tensor_names[DM_NUM_TENSORS];

void dm_layout_init(const dm_config *c, dm_layout *l);

/* Activations for a batch of up to B examples (owned, malloc'd). */
typedef struct dm_acts {
    int B;
    float *x;      /* (B, K*E) */
    float *h;      /* (B, H) tanh output (hpre is not kept: dtanh = 1 - h^2) */
    float *probs;  /* (B, V) softmax */
    float *dx;     /* (B, K*E) */
    float *dh;     /* (B, H) */
    float *dlogits;/* (B, V) */
    double *nll;   /* (B) per-example loss, summed serially for determinism */
} dm_acts;

int dm_acts_alloc(const dm_config *c, int B, dm_acts *a);
void dm_acts_free(dm_acts *a);

/* Fills params with the initial weights, from seed: emb ~ N(0, 1),
 * W1 ~ N(0, 1) * (5/3)/sqrt(K*E) (Kaiming for tanh), b1 = 0,
 * W2 ~ N(0, 1) * 0.1/sqrt(H) (a near-uniform first prediction), b2 = 0. */
void dm_model_init(const dm_config *c, const dm_layout *l, float *params, uint64_t seed);

/* Forward over B examples X (B, K), Y (B); returns the mean NLL.
 * Y may be NULL (probs only, returns 0). */
double dm_forward(const dm_config *c, const dm_layout *l, const float *params,
                  const uint8_t *X, const uint8_t *Y, int B, dm_acts *a);

/* Backward of the last dm_forward (which needs Y): writes every element of
 * grads (same layout as params) with d(mean NLL)/d(param). */
void dm_backward(const dm_config *c, const dm_layout *l, const float *params,
                 const uint8_t *X, const uint8_t *Y, int B, dm_acts *a, float *grads);

/* Samples one word (at most maxlen letters, NUL-terminated into out) by
 * drawing each next character from the softmax. Returns its length. */
int dm_sample(const dm_config *c, const dm_layout *l, const float *params,
              dm_acts *a, uint64_t *rng, char *out, int maxlen);

#endif /* DM_MODEL_H */
