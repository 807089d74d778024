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
  const tr_backend *be;
  float *state; /* host copy of m | v (the moments themselves on a host-memory backend) */
  float *dmv;   /* the moments in device memory (NULL on a host-memory backend) */
  prange *ranges;
  int nranges;
  int64_t t;
};

adamw *adamw_create(const graph *g, const adamw_config *cfg, const tr_backend *be) {
  adamw *o = calloc(1, sizeof *o);
  if (!o) goto nomem;
  o->cfg = *cfg;
  o->n = graph_nparams(g);
  o->be = be ? be : backend_cpu();
  o->state = tr_alloc_aligned(sizeof(float) * 2 * (size_t)o->n);
  if (!o->be->host_memory && !(o->dmv = o->be->alloc(sizeof(float) * 2 * (size_t)o->n))) { /* zeroed */
    tr_fail(TR_ENOMEM, "out of %s memory for the optimizer state", o->be->name);
    adamw_free(o);
    return NULL;
  }
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
  if (o->dmv) o->be->free(o->dmv);
  tr_free_aligned(o->state);
  free(o->ranges);
  free(o);
}

float *adamw_state(adamw *o) { return o->state; }
float *adamw_moments(adamw *o) { return o->dmv ? o->dmv : o->state; }

int adamw_pull(adamw *o) {
  if (!o->dmv || !o->be->download(o->state, o->dmv, sizeof(float) * 2 * (size_t)o->n)) return TR_OK;
  return tr_fail(TR_EIO, "copying the optimizer state from the %s device: %s", o->be->name, o->be->error());
}

int adamw_push(adamw *o) {
  if (!o->dmv || !o->be->upload(o->dmv, o->state, sizeof(float) * 2 * (size_t)o->n)) return TR_OK;
  return tr_fail(TR_EIO, "copying the optimizer state to the %s device: %s", o->be->name, o->be->error());
}
int64_t adamw_state_size(const adamw *o) { return 2 * o->n; }
int64_t adamw_steps(const adamw *o) { return o->t; }
void adamw_set_steps(adamw *o, int64_t t) { o->t = t; }

void adamw_step(adamw *o, float *params, const float *grads, float lr) {
  o->t++;
  const tr_backend *be = o->be;
  float *mv = adamw_moments(o);
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
