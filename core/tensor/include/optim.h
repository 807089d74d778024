/* optim.h — AdamW over the parameter slab, gradient-norm clipping, and the
 * learning-rate schedule (linear warm-up, cosine decay to a floor).
 *
 * The optimizer state (first and second moments) is one slab of 2*P floats:
 * m = state[0..P), v = state[P..2P). It is plain state, so the checkpoint
 * engine saves and restores it with the step counter. Weight decay is
 * decoupled (AdamW) and applies only to parameters the graph marks as decayed
 * (by default matrices, not biases or norm gains). Single-threaded callers;
 * the loops inside are parallel.
 */
#ifndef TRANSOM_OPTIM_H
#define TRANSOM_OPTIM_H

#include <stdint.h>

#include "graph.h"

typedef struct {
  float beta1, beta2, eps, weight_decay;
} adamw_config;

typedef struct adamw adamw;

/* Reads the parameter table of a planned graph; the moments live on
 * backend be (NULL: the cpu), zeroed, with a host copy beside them on a
 * device. The optimizer owns both. NULL with tr_error() on failure. */
struct tr_backend;
adamw *adamw_create(const graph *g, const adamw_config *cfg, const struct tr_backend *be);
void adamw_free(adamw *o);

/* One update on the backend's memory: params -= lr * (mhat / (sqrt(vhat) +
 * eps) + wd * params); params and grads are the backend's pointers. On a
 * device it is queued, not waited for. */
void adamw_step(adamw *o, float *params, const float *grads, float lr);

float *adamw_moments(adamw *o);        /* m | v where they live (device memory on a device) */
float *adamw_state(adamw *o);          /* their host copy, 2*P floats (the same memory on the cpu) */
/* Device -> host copy and back (no-ops on a host-memory backend). */
int adamw_pull(adamw *o);
int adamw_push(adamw *o);
int64_t adamw_state_size(const adamw *o);
int64_t adamw_steps(const adamw *o);   /* updates done so far */
void adamw_set_steps(adamw *o, int64_t t);

/* L2 norm of n values (accumulated in double). */
float grad_norm(const float *g, int64_t n);
/* Scales g so its norm is at most max_norm (no-op when max_norm <= 0).
 * Returns the norm before clipping. */
float grad_clip(float *g, int64_t n, float max_norm);
/* The same on a backend's memory. */
float grad_clip_on(const struct tr_backend *be, float *g, int64_t n, float max_norm);

typedef struct {
  float lr, min_lr;
  int64_t warmup_steps, decay_steps;
} lr_schedule;

/* Learning rate for 0-based step: linear warm-up over warmup_steps, cosine
 * from lr to min_lr until decay_steps, then min_lr. */
float lr_at(const lr_schedule *s, int64_t step);

#endif
