/* optim.c — AdamW, clipping, LR schedule (see optim.h). */
#include "optim.h"

#include <math.h>
#include <stdlib.h>

#include "backend.h"
#include "kernels.h"
#include "util.h"

typedef struct {
  int64_t off, size;
  int decay;
} prange;

struct adamw {
  adamw_config cfg;
  int64_t n; /* parameter slab size */
  float *state;
  prange *ranges;
  int nranges;
  int64_t t;
};

adamw *adamw_create(const graph *g, const adamw_config *cfg) {
  adamw *o = calloc(1, sizeof *o);
  if (!o) goto nomem;
  o->cfg = *cfg;
  o->n = graph_nparams(g);
  o->state = tr_alloc_aligned(sizeof(float) * 2 * (size_t)o->n);
  o->ranges = malloc(sizeof(prange) * (size_t)(graph_ntensors(g) + 1));
  if (!o->state || !o->ranges) goto nomem;
  for (int i = 0; i < graph_ntensors(g); i++) {
    tensor_desc d;
    graph_tensor(g, i, &d);
    if (d.kind != TK_PARAM) continue;
    o->ranges[o->nranges++] = (prange){d.offset, d.size, d.decay};
  }
  return o;
nomem:
  adamw_free(o);
  tr_fail(TR_ENOMEM, "out of memory creating the optimizer");
  return NULL;
}

void adamw_free(adamw *o) {
  if (!o) return;
  tr_free_aligned(o->state);
  free(o->ranges);
  free(o);
}

float *adamw_state(adamw *o) { return o->state; }
int64_t adamw_state_size(const adamw *o) { return 2 * o->n; }
int64_t adamw_steps(const adamw *o) { return o->t; }
void adamw_set_steps(adamw *o, int64_t t) { o->t = t; }

void adamw_step(adamw *o, float *params, const float *grads, float lr) {
  adamw_step_on(o, backend_cpu(), params, grads, o->state, lr);
}

void adamw_step_on(adamw *o, const tr_backend *be, float *params, const float *grads, float *mv, float lr) {
  o->t++;
  const float b1 = o->cfg.beta1, b2 = o->cfg.beta2, eps = o->cfg.eps;
  const float c1 = 1.0f - powf(b1, (float)o->t), c2 = 1.0f - powf(b2, (float)o->t);
  float *m = mv, *v = mv + o->n;
  for (int r = 0; r < o->nranges; r++) {
    const int64_t off = o->ranges[r].off;
    const float wd = o->ranges[r].decay ? o->cfg.weight_decay : 0.0f;
    be->adamw(params + off, grads + off, m + off, v + off, o->ranges[r].size, lr, b1, b2, eps, wd, c1, c2);
  }
}

float grad_clip_on(const tr_backend *be, float *g, int64_t n, float max_norm) {
  float norm = (float)sqrt(be->sumsq(g, n));
  if (max_norm > 0.0f && norm > max_norm && isfinite(norm)) be->scale(g, n, max_norm / (norm + 1e-6f));
  return norm;
}

float grad_norm(const float *g, int64_t n) { return (float)sqrt(par_sumsq(g, n)); }

float grad_clip(float *g, int64_t n, float max_norm) { return grad_clip_on(backend_cpu(), g, n, max_norm); }

float lr_at(const lr_schedule *s, int64_t step) {
  if (step < s->warmup_steps) return s->lr * (float)(step + 1) / (float)s->warmup_steps;
  if (step >= s->decay_steps) return s->min_lr;
  double span = (double)(s->decay_steps - s->warmup_steps);
  double frac = span > 0 ? (double)(step - s->warmup_steps) / span : 1.0;
  double coeff = 0.5 * (1.0 + cos(3.141592653589793 * frac));
  return (float)(s->min_lr + coeff * (s->lr - s->min_lr));
}
