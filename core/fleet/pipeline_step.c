/* pipeline_step.c — what a pipeline stage does around its micro-batches
 * (see pipeline_stage.h): the end of a step (tied gradients combined, the
 * mean over micro-batches, the global gradient norm and clipping, all the
 * same on every stage), evaluation through the stages, and the final gather
 * of the parameters into the first stage, which saves them.
 *
 * The end of a step is one all-gather along the chain: an "exchange vector"
 * holds one sum of squares per parameter (filled by its owner), each
 * stage's compute per micro-batch (AdaTopK hides transfers behind the
 * slowest), each stage's vote (a checkpoint wanted, its engine busy: a
 * snapshot is taken by every stage at a step some stage wants one and none
 * is busy, so every store holds the same steps; asked to stop: every stage
 * stops after the step some stage was asked at, and snapshots it), the
 * lowest live pipeline (filled by the first stage, from its
 * replicas' all-reduce of the step: the pipeline whose stages write the
 * checkpoints, so every stage learns it, those that average nothing too)
 * and one accumulator per use of a tied parameter (filled by the stage of
 * the use).
 * It travels from the last stage to the first, each stage writing its
 * entries, then back down whole. Every stage then computes the same tied
 * gradients and the same norm from the same numbers in the same order, so
 * the stages apply identical updates to what they share, and the result
 * does not depend on the number of stages (the test: pipeline_spec.lua).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "data.h"
#include "pipeline_stage.h"
#include "rng.h"
#include "util.h"

/* --- the exchange vector --- */

static double *vec_sums(pipe_stage *s) { return (double *)s->vec; }
static float *vec_tied(pipe_stage *s) { return (float *)(s->vec + sizeof(double) * (size_t)s->vec_doubles); }
static double *vec_lowest(pipe_stage *s) { return vec_sums(s) + s->vec_doubles - 1; }
static size_t vec_bytes(const pipe_stage *s) {
  return sizeof(double) * (size_t)s->vec_doubles + sizeof(float) * (size_t)s->vec_floats;
}

static int is_tied(const pipe_stage *s, int t) {
  for (int j = 0; j < s->ntied; j++)
    if (s->tied[j].p == t) return 1;
  return 0;
}

/* A fixed-order sum of squares: the same numbers give the same bits. */
static double sumsq(const float *p, int64_t n) {
  double a = 0;
  for (int64_t i = 0; i < n; i++) a += (double)p[i] * (double)p[i];
  return a;
}

/* This stage's entries: its untied parameters' sums of squares (gradients
 * already averaged), its tied uses' accumulators. */
static void fill_vector(pipe_stage *s) {
  for (int t = 0; t < graph_ntensors(s->g); t++) {
    tensor_desc d;
    graph_tensor(s->g, t, &d);
    if (d.kind == TK_PARAM && s->owner[t] == s->k && !is_tied(s, t))
      vec_sums(s)[t] = sumsq(graph_grad(s->g, t), d.size);
  }
  vec_sums(s)[graph_ntensors(s->g) + s->k] = s->compute_mb; /* AdaTopK's budget: the slowest stage's */
  vec_sums(s)[graph_ntensors(s->g) + s->S + s->k] = s->vote;
  if (s->k == 0) *vec_lowest(s) = s->lowest_seen;
  for (int j = 0; j < s->ntied; j++)
    for (int u = 0; u < s->tied[j].nuse; u++)
      if (s->tied[j].acc[u])
        memcpy(vec_tied(s) + s->tied[j].vec_off[u], s->tied[j].acc[u], sizeof(float) * (size_t)s->tied[j].size);
}

static int gather_chain(pipe_stage *s, int64_t step) {
  size_t n = vec_bytes(s);
  pl_header h;
  void *p = NULL;
  int rc = TR_OK;
  memset(s->vec, 0, n);
  if (s->next) { /* up: the later stages' entries */
    if ((rc = pl_recv(s->next, PL_GATHER_UP, step, -1, s->timeout, &h, &p))) return rc;
    if (h.bytes == n) memcpy(s->vec, p, n);
    free(p);
    if (h.bytes != n) return tr_fail(TR_EIO, "the exchange vector from the next stage has the wrong size");
  }
  fill_vector(s);
  if (s->prev) {
    pl_header u = {.kind = PL_GATHER_UP, .step = step, .bytes = n};
    if ((rc = pl_send(s->prev, &u, s->vec))) return rc;
    if ((rc = pl_recv(s->prev, PL_GATHER_DOWN, step, -1, s->timeout, &h, &p))) return rc;
    if (h.bytes == n) memcpy(s->vec, p, n);
    free(p);
    if (h.bytes != n) return tr_fail(TR_EIO, "the exchange vector from the previous stage has the wrong size");
  }
  if (s->next) {
    pl_header d = {.kind = PL_GATHER_DOWN, .step = step, .bytes = n};
    rc = pl_send(s->next, &d, s->vec);
  }
  double lowest = *vec_lowest(s); /* the first stage's view, for every stage alike */
  if (!rc && !(lowest >= 0 && lowest < s->R && lowest == floor(lowest)))
    return tr_fail(TR_EIO, "stage %d: the exchange vector names pipeline %g as the lowest live one (of %d)", s->k,
                   lowest, s->R);
  if (!rc) s->lowest = (int)lowest;
  return rc;
}

/* --- replicas of the stage (pipelines x replicas) --- */

/* With replicas, the stage's herald (pl_herald), from its first exchange:
 * every stage has one, so a grace is passed on along the whole chain (also
 * through a stage that averages nothing itself). Held at most as long as
 * the group's timeout and a heartbeat's lapse. */
static void herald_ensure(pipe_stage *s) {
  if (s->fm && !s->herald && (s->prev || s->next))
    s->herald = pl_herald_start(s->prev, s->next, 2 * s->cfg->hang_seconds + s->cfg->deadline);
}

/* One FTAR all-reduce (mean) with the same stage of the other pipelines.
 * It may wait for a replica that waits on a hung mate of its own
 * pipeline: meanwhile our herald tells our pipeline mates we are alive
 * (pl_herald), or they gave up on us first and the healthy pipeline was
 * lost too. Without a herald (no thread) the mates wait as before. */
static int mean_of(pipe_stage *s, float *buf, int64_t n, uint64_t seq, loop_exchange *x) {
  pl_herald_on(s->herald);
  ftar_result res;
  int rc = ftar_allreduce(s->fm, buf, (size_t)n, FTAR_MEAN, seq, &res);
  pl_herald_off(s->herald);
  if (rc == FTAR_ESEQ && s->join_step > 0 && seq / PIPE_SEQ_PER_STEP == (uint64_t)s->join_step)
    return tr_fail(rc, "stage %d: its replicas were past step %lld (at step %lld) when this rebuilt pipeline "
                   "registered to enter there (the launcher tries again further ahead)", s->k,
                   (long long)s->join_step, (long long)(res.seq / PIPE_SEQ_PER_STEP));
  if (rc < 0) return tr_fail_prefix(rc, "stage %d's replicas", s->k);
  x->replicas = res.contributors;
  x->epoch = (int64_t)res.epoch;
  x->redos += res.redos;
  s->lowest_seen = res.slots[0];
  return TR_OK;
}

/* The gradients of this stage's parameters averaged over the pipelines:
 * each pipeline ran its own micro-batches (its own data slot). The tied
 * ones are averaged later, once, by the first stage (combine_tied).
 * Without replicas nothing moves. */
static int replicas_mean(pipe_stage *s, int64_t step, float *grads, int64_t n, loop_exchange *x) {
  x->replicas = 1;
  x->epoch = 0;
  x->redos = 0;
  if (!s->fm) return TR_OK;
  uint64_t seq = (uint64_t)step * PIPE_SEQ_PER_STEP;
  (void)n; /* only the span this stage's parameters cover: the rest is zero here */
  if (s->own_hi > s->own_lo) return mean_of(s, grads + s->own_lo, s->own_hi - s->own_lo, seq, x);
  float none = 0; /* a first stage that reads no parameter still learns the lowest live pipeline */
  return s->k == 0 ? mean_of(s, &none, 1, seq, x) : TR_OK;
}

/* --- the end of a step --- */

/* The tied gradients: the sum of the uses in op order, then the mean over
 * micro-batches, into the gradient slab; their sums of squares into the
 * vector. With replicas, the first stage alone averages them over the
 * pipelines (one FTAR group: every stage of a pipeline gets the same
 * replicas' mean, even at the step a pipeline is lost) and sends them down
 * the chain. One more float rides along: this pipeline's stop vote (*stop),
 * whose mean over the pipelines is above 0 when any pipeline was asked; so
 * every pipeline stops after the same step, although the launcher's STOP
 * reaches each at its own step (also for a model with no tied weights:
 * then the float alone). */
static int combine_tied(pipe_stage *s, float inv, int64_t step, loop_exchange *x, int *stop) {
  float *all = s->tied_all;
  for (int j = 0, off = 0; j < s->ntied; off += (int)s->tied[j].size, j++) {
    pipe_tied *tp = &s->tied[j];
    float *sum = all + off;
    memcpy(sum, vec_tied(s) + tp->vec_off[0], sizeof(float) * (size_t)tp->size);
    for (int u = 1; u < tp->nuse; u++) {
      const float *a = vec_tied(s) + tp->vec_off[u];
      for (int64_t i = 0; i < tp->size; i++) sum[i] += a[i];
    }
    for (int64_t i = 0; i < tp->size; i++) sum[i] *= inv;
  }
  int rc = TR_OK;
  if (s->fm) {
    pl_header h;
    void *p = NULL;
    uint64_t seq = (uint64_t)step * PIPE_SEQ_PER_STEP + 1, bytes = 4 * (uint64_t)(s->tied_n + 1);
    all[s->tied_n] = *stop ? 1.0f : 0.0f;
    loop_exchange tx = *x; /* the record keeps the first collective's replicas and epoch, as every stage's */
    if (s->k == 0 && !(rc = mean_of(s, all, s->tied_n + 1, seq, &tx))) x->redos = tx.redos;
    else if (!(rc = pl_recv(s->prev, PL_TIED, step, -1, s->timeout, &h, &p)) && h.bytes == bytes)
      memcpy(all, p, h.bytes);
    else if (!rc) rc = tr_fail(TR_EIO, "the tied gradients from the previous stage have the wrong size");
    free(p);
    pl_header d = {.kind = PL_TIED, .step = step, .bytes = bytes};
    if (!rc && s->next) rc = pl_send(s->next, &d, all);
    if (!rc) *stop = all[s->tied_n] > 0;
  }
  for (int j = 0, off = 0; j < s->ntied && !rc; off += (int)s->tied[j].size, j++) {
    vec_sums(s)[s->tied[j].p] = sumsq(all + off, s->tied[j].size);
    memcpy(graph_grad(s->g, s->tied[j].p), all + off, sizeof(float) * (size_t)s->tied[j].size);
  }
  return rc;
}

int pipe_exchange(void *ud, int64_t next, loop_exchange *x) {
  pipe_stage *s = ud;
  const tr_backend *be = graph_backend(s->g);
  float *grads = graph_grads(s->g);
  int64_t n = graph_nparams(s->g);
  float inv = 1.0f / (float)s->M;
  be->scale(grads, n, inv); /* the mean over micro-batches (the tied ones' slots are overwritten below) */
  s->vote = (x->ckpt_want ? 1 : 0) | (x->ckpt_ready ? 0 : 2) | (s->stop_asked ? 4 : 0);
  herald_ensure(s);
  int rc = replicas_mean(s, next, grads, n, x);
  if (!rc) rc = gather_chain(s, next);
  if (rc) return rc;
  int want = 0, busy = 0, stop = 0; /* a snapshot this step: some stage wants one (or a stop) and every
                                       * stage's engine is ready; a stop: some stage was asked (of any
                                       * pipeline: combine_tied) */
  for (int k = 0; k < s->S; k++) {
    int v = (int)vec_sums(s)[graph_ntensors(s->g) + s->S + k];
    want |= v & 1;
    busy |= v & 2;
    stop |= v & 4;
  }
  if ((rc = combine_tied(s, inv, next, x, &stop))) return rc;
  double total = 0;
  for (int t = 0; t < graph_ntensors(s->g); t++) {
    tensor_desc d;
    graph_tensor(s->g, t, &d);
    if (d.kind == TK_PARAM) total += vec_sums(s)[t];
  }
  float norm = (float)sqrt(total);
  s->hide_s = 0;
  for (int k = 0; k < s->S; k++) {
    double c = vec_sums(s)[graph_ntensors(s->g) + k];
    if (c > s->hide_s) s->hide_s = c;
  }
  if (!isfinite(norm)) { /* every stage skips the update (trainer_apply_grads) */
    grads[0] = norm;
    /* and AdaTopK's error feedback forgets the step: what it held back came
     * from the same bad gradients */
    if (s->bwd.residual) memset(s->bwd.residual, 0, sizeof(float) * (size_t)s->xin_n);
  } else if (s->clip > 0 && norm > (float)s->clip) be->scale(grads, n, (float)s->clip / (norm + 1e-6f));
  s->global_norm = norm;
  x->ckpt_agreed = (want || stop) && !busy; /* busy at a stop: the loop's finish snapshots it, on every stage */
  x->stop = stop != 0;
  if (stop) s->stop_step = next;
  x->leader = s->k == 0 && s->p == s->lowest;
  x->snapshots = s->p == s->lowest; /* every stage into its own store */
  pipe_donor_record(s, next, grads); /* what a rebuilt pipeline's worker replays */
  return TR_OK;
}

/* --- evaluation --- */

/* The validation loss through the stages: eval_steps x micro_batches
 * batches of one micro-batch (as many sequences as a lone run's
 * evaluation), the same batches every time; the last stage's mean comes
 * back to the first. */
int pipe_evaluate(void *ud, int64_t step, float *val_loss) {
  pipe_stage *s = ud;
  rng_t r;
  rng_seed(&r, (uint64_t)s->cfg->seed * 2654435761u + 2);
  int64_t nb = s->cfg->eval_steps * s->M;
  double sum = 0, dsum = s->fwd.density_sum;
  int nsent = s->fwd.nsent;
  uint64_t bytes = s->fwd.bytes; /* the step's record counts training traffic only */
  for (int64_t i = 0; i < nb; i++) {
    dataset_batch(trainer_data(s->t), SPLIT_VAL, &r, s->b, s->T, graph_data(s->g, s->tok), graph_data(s->g, s->tgt));
    float loss = 0;
    int rc = pipe_forward(s, step, (int)i, 1, &loss);
    if (rc) return rc;
    sum += loss;
  }
  s->fwd.density_sum = dsum;
  s->fwd.nsent = nsent;
  s->fwd.bytes = bytes;
  double v = sum / (double)nb;
  if (s->next) {
    pl_header h;
    void *p;
    int rc = pl_recv(s->next, PL_EVAL_LOSS, step, -1, s->timeout, &h, &p);
    if (rc) return rc;
    free(p);
    v = h.value;
  }
  if (s->prev) {
    pl_header h = {.kind = PL_EVAL_LOSS, .step = step, .value = v};
    int rc = pl_send(s->prev, &h, NULL);
    if (rc) return rc;
  }
  *val_loss = (float)v;
  return TR_OK;
}

/* --- the end: every parameter into the first stage --- */

/* The loop failed: the FTAR group (pipelines x replicas) goes on without
 * this stage at once (pipeline_stage.h). */
void pipe_failed(void *ud, int rc) {
  pipe_stage *s = ud;
  char why[256];
  snprintf(why, sizeof why, "stage %d's training loop failed (%d): %s", s->k, rc, tr_error());
  if (s->fm) ftar_member_leave(s->fm, why);
}

/* After the last step (or the step every stage agreed to stop after) each
 * stage takes, from the whole slab the next stage sends, the parameters
 * owned further down the chain, and passes its own slab up: the first
 * stage ends with every owner's values and saves them.
 * The copies of a tied parameter must agree bit for bit (every stage
 * applies the same tied gradient): a difference is an error. */
int pipe_boundary(void *ud, int64_t step) {
  pipe_stage *s = ud;
  int rc = pipe_donor_boundary(s, step);
  if (rc || (step != s->cfg->max_steps && step != s->stop_step)) return rc;
  float *params = graph_params(s->g);
  size_t bytes = sizeof(float) * (size_t)graph_nparams(s->g);
  if (s->next) {
    pl_header h;
    void *p;
    if ((rc = pl_recv(s->next, PL_PARAMS, step, -1, s->timeout, &h, &p))) return rc;
    if (h.bytes != bytes) rc = tr_fail(TR_EIO, "the parameters from the next stage have the wrong size");
    for (int j = 0; j < s->ntied && !rc; j++) { /* every stage updates a tied parameter alike: same bits */
      tensor_desc d;
      graph_tensor(s->g, s->tied[j].p, &d);
      if (memcmp(params + d.offset, (float *)p + d.offset, sizeof(float) * (size_t)d.size))
        rc = tr_fail(TR_ESTATE, "the tied parameter '%s' differs between stages %d and %d", d.name, s->k, s->k + 1);
    }
    for (int t = 0; t < graph_ntensors(s->g) && !rc; t++) {
      tensor_desc d;
      graph_tensor(s->g, t, &d);
      if (d.kind == TK_PARAM && s->owner[t] > s->k)
        memcpy(params + d.offset, (float *)p + d.offset, sizeof(float) * (size_t)d.size);
    }
    free(p);
  }
  if (!rc && s->prev) {
    pl_header h = {.kind = PL_PARAMS, .step = step, .bytes = bytes};
    rc = pl_send(s->prev, &h, params);
  }
  return rc;
}
