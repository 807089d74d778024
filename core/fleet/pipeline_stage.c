/* pipeline_stage.c — one pipeline stage's micro-batches: the cut, what
 * crosses it, and the 1F1B schedule with remote autodiff (see
 * pipeline_stage.h). Forward: receive the crossing activations from the
 * previous stage, run this stage's ops, send what crosses the next cut.
 * Backward: receive their gradients, run this stage's ops in reverse, send
 * the gradients of what came in. The loss is the last stage's; it rides
 * back with the gradients so every stage reports it. Called by the one
 * training loop through pipeline_main.c's hooks; one thread.
 */
#include "pipeline_stage.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "adatopk.h"
#include "backend.h"
#include "data.h"
#include "graph_stage.h"
#include "rng.h"
#include "util.h"

/* --- setup --- */

static int stage_of(const pipe_stage *s, int pos) {
  int k = 0;
  while (k + 1 < s->S && pos >= s->cuts[k + 1]) k++;
  return k;
}

static int *tensor_list(const graph *g, int n, int (*fill)(const graph *, int, int, int *, int), int a, int b,
                        int *count) {
  int *ids = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
  int c = ids ? fill(g, a, b, ids, n) : tr_fail(TR_ENOMEM, "out of memory");
  if (c < 0) {
    free(ids);
    return NULL;
  }
  *count = c;
  return ids;
}

static int crossing_fill(const graph *g, int k, int unused, int *ids, int cap) {
  (void)unused;
  return graph_stage_crossing(g, k, ids, cap, NULL);
}

static int64_t elems_of(const graph *g, const int *ids, int n) {
  int64_t e = 0;
  for (int i = 0; i < n; i++) {
    tensor_desc d;
    graph_tensor(g, ids[i], &d);
    e += d.size;
  }
  return e;
}

/* Whether an op of this stage reads parameter t. */
static int reads_param(const pipe_stage *s, int t) {
  for (int pos = s->cuts[s->k]; pos < s->cuts[s->k + 1]; pos++) {
    graph_node_desc nd;
    graph_order_node(s->g, pos, &nd);
    for (int i = 0; i < 3; i++)
      if (nd.in[i] == t) return 1;
  }
  return 0;
}

/* Owners (each parameter's lowest user) and tied parameters (read by more
 * than one op), with their place in the exchange vector. */
static int find_params(pipe_stage *s) {
  int nt = graph_ntensors(s->g), n = graph_norder(s->g);
  if (!(s->owner = calloc((size_t)nt, sizeof(int)))) return tr_fail(TR_ENOMEM, "out of memory");
  int *uses = calloc((size_t)nt, sizeof(int));
  if (!uses) return tr_fail(TR_ENOMEM, "out of memory");
  for (int t = 0; t < nt; t++) s->owner[t] = -1;
  for (int pos = 0; pos < n; pos++) {
    graph_node_desc nd;
    graph_order_node(s->g, pos, &nd);
    for (int i = 0; i < 3; i++) {
      tensor_desc d;
      if (nd.in[i] < 0 || (graph_tensor(s->g, nd.in[i], &d), d.kind != TK_PARAM)) continue;
      if (s->owner[nd.in[i]] < 0) s->owner[nd.in[i]] = stage_of(s, pos);
      uses[nd.in[i]]++;
    }
  }
  int rc = TR_OK;
  /* one sum of squares per tensor id (parameters' only), each stage's
   * compute, each stage's checkpoint vote, the lowest live pipeline (the
   * first stage's view) */
  s->vec_doubles = nt + 2 * s->S + 1;
  for (int t = 0; t < nt && !rc; t++) {
    if (s->owner[t] < 0) s->owner[t] = 0; /* unused: the first stage keeps it */
    if (uses[t] < 2) continue;
    if (s->ntied == PIPE_MAX_TIED) rc = tr_fail(TR_EINVAL, "more than %d tied parameters", PIPE_MAX_TIED);
    else if (uses[t] > PIPE_MAX_USES) rc = tr_fail(TR_EINVAL, "a parameter read by more than %d ops", PIPE_MAX_USES);
    else s->tied[s->ntied++] = (pipe_tied){.p = t};
  }
  free(uses);
  s->own_lo = graph_nparams(s->g);
  s->own_hi = 0;
  for (int t = 0; t < nt; t++) { /* the span of the parameters this stage reads */
    tensor_desc d;
    graph_tensor(s->g, t, &d);
    if (d.kind != TK_PARAM || !reads_param(s, t)) continue;
    if (d.offset < s->own_lo) s->own_lo = d.offset;
    if (d.offset + d.size > s->own_hi) s->own_hi = d.offset + d.size;
  }
  if (s->own_hi < s->own_lo) s->own_lo = s->own_hi = 0;
  for (int pos = 0; pos < n && !rc; pos++) {
    graph_node_desc nd;
    graph_order_node(s->g, pos, &nd);
    for (int j = 0; j < s->ntied; j++)
      for (int i = 0; i < 3; i++)
        if (nd.in[i] == s->tied[j].p) {
          pipe_tied *tp = &s->tied[j];
          tensor_desc d;
          graph_tensor(s->g, tp->p, &d);
          tp->size = d.size;
          tp->vec_off[tp->nuse] = s->vec_floats;
          s->vec_floats += d.size;
          if (stage_of(s, pos) == s->k && !(tp->acc[tp->nuse] = calloc((size_t)d.size, sizeof(float))))
            rc = tr_fail(TR_ENOMEM, "out of memory");
          tp->pos[tp->nuse++] = pos;
          break;
        }
  }
  return rc;
}

int pipe_stage_setup(pipe_stage *s) {
  graph *g = s->g;
  int n = graph_norder(g), nt = graph_ntensors(g), rc;
  if (s->S > n) return tr_fail(TR_EINVAL, "pipeline.stages = %d: the model has only %d ops", s->S, n);
  if (s->cuts[s->S] == 0 && (rc = graph_stage_cut(g, s->S, NULL, NULL, s->cuts, NULL))) return rc; /* no plan given */
  s->lo = s->cuts[s->k];
  s->hi = s->cuts[s->k + 1];
  if (s->k > 0 && !(s->xin = tensor_list(g, nt, crossing_fill, s->lo, 0, &s->nxin))) return TR_ENOMEM;
  if (s->k < s->S - 1 && !(s->xout = tensor_list(g, nt, crossing_fill, s->hi, 0, &s->nxout))) return TR_ENOMEM;
  if (!(s->keep = tensor_list(g, nt, graph_stage_tensors, s->lo, s->hi, &s->nkeep))) return TR_ENOMEM;
  s->xin_n = elems_of(g, s->xin, s->nxin);
  s->xout_n = elems_of(g, s->xout, s->nxout);
  s->keep_n = elems_of(g, s->keep, s->nkeep);
  s->slots = s->S - s->k < s->M ? s->S - s->k : s->M; /* 1F1B: at most this many in flight */
  int64_t bt = (int64_t)s->b * s->T, big = s->xin_n > s->xout_n ? s->xin_n : s->xout_n;
  s->stash = tr_alloc_aligned(sizeof(float) * (size_t)(s->slots * s->keep_n + 1));
  s->buf = malloc(sizeof(float) * (size_t)(big + 1));
  s->mb_tok = malloc(sizeof(int32_t) * (size_t)(s->M * bt));
  s->mb_tgt = malloc(sizeof(int32_t) * (size_t)(s->M * bt));
  s->mb_loss = calloc((size_t)s->M, sizeof(float));
  s->scratch = malloc(sizeof(float) * (size_t)(big + 1));
  s->enc = malloc(adatopk_bytes(big + 1));
  if (s->bwd.on && s->xin_n) s->bwd.residual = calloc((size_t)s->xin_n, sizeof(float));
  if (!s->stash || !s->buf || !s->mb_tok || !s->mb_tgt || !s->mb_loss || !s->scratch || !s->enc ||
      (s->bwd.on && s->xin_n && !s->bwd.residual))
    return tr_fail(TR_ENOMEM, "out of memory");
  s->tok = graph_find(g, "tokens");
  s->tgt = graph_find(g, "targets");
  s->loss = graph_find(g, "loss");
  if ((rc = find_params(s))) return rc;
  size_t vb = sizeof(double) * (size_t)s->vec_doubles + sizeof(float) * (size_t)s->vec_floats;
  if (!(s->vec = malloc(vb))) return tr_fail(TR_ENOMEM, "out of memory");
  for (int j = 0; j < s->ntied; j++) s->tied_n += s->tied[j].size;
  if (!(s->tied_all = malloc(sizeof(float) * (size_t)(s->tied_n + 1)))) return tr_fail(TR_ENOMEM, "out of memory");
  return TR_OK;
}

uint64_t pipe_stage_max_stream(const pipe_stage *s) {
  int64_t big = s->xin_n > s->xout_n ? s->xin_n : s->xout_n;
  return adatopk_bytes(big); /* more than its raw floats, or bf16 */
}

uint64_t pipe_stage_max_message(const pipe_stage *s) {
  uint64_t m = pipe_stage_max_stream(s);
  uint64_t vec = sizeof(double) * (uint64_t)s->vec_doubles + sizeof(float) * (uint64_t)s->vec_floats;
  uint64_t tied = sizeof(float) * (uint64_t)(s->tied_n + 1), params = sizeof(float) * (uint64_t)graph_nparams(s->g);
  if (vec > m) m = vec;
  if (tied > m) m = tied;
  return params > m ? params : m;
}

void pipe_stage_free(pipe_stage *s) {
  free(s->xin);
  free(s->xout);
  free(s->keep);
  tr_free_aligned(s->stash);
  free(s->buf);
  free(s->mb_tok);
  free(s->mb_tgt);
  free(s->mb_loss);
  free(s->owner);
  for (int j = 0; j < s->ntied; j++)
    for (int u = 0; u < s->tied[j].nuse; u++) free(s->tied[j].acc[u]);
  free(s->vec);
  free(s->tied_all);
  free(s->scratch);
  free(s->enc);
  free(s->bwd.residual);
  pl_herald_stop(s->herald); /* it sends on the links */
  s->herald = NULL;
  pl_link_free(s->prev);
  pl_link_free(s->next);
}

/* --- moving tensors --- */

/* Copies tensors ids (their data, or with grad their gradients) into buf,
 * or back out of it (in = 1). */
static void pack(pipe_stage *s, const int *ids, int n, int grad, int in, float *buf) {
  int64_t off = 0;
  for (int i = 0; i < n; i++) {
    tensor_desc d;
    graph_tensor(s->g, ids[i], &d);
    float *p = grad ? graph_grad(s->g, ids[i]) : graph_data(s->g, ids[i]);
    if (in) memcpy(p, buf + off, sizeof(float) * (size_t)d.size);
    else memcpy(buf + off, p, sizeof(float) * (size_t)d.size);
    off += d.size;
  }
}

/* Sends n floats, raw or (AdaTopK) as the top k, k from the link's
 * bandwidth and this stage's compute per micro-batch. */
static int send_floats(pipe_stage *s, pipe_dir *d, pl_link *l, uint32_t kind, int64_t step, int mb, double value,
                       const float *p, int64_t n) {
  pl_header h = {.kind = kind, .step = step, .mb = mb, .value = value, .bytes = sizeof(float) * (uint64_t)n};
  const void *payload = p;
  double density = 1.0;
  if (d->on) {
    int codec;
    int64_t k;
    adatopk_choose(adatopk_density(d->bw, s->hide_s, n, d->floor), d->floor, n, &codec, &k);
    if (codec == ADATOPK_CODEC || codec == ADATOPK_BF16) {
      h.bytes = codec == ADATOPK_CODEC ? adatopk_encode(p, d->residual, n, k, s->scratch, s->enc)
                                       : adatopk_encode_bf16(p, d->residual, n, s->enc);
      h.codec = codec;
      payload = s->enc;
      density = codec == ADATOPK_CODEC ? (double)k / (double)n : 0.5; /* bf16: half the bits of every entry */
    } else {
      density = 1.0;
      if (d->residual) { /* raw this time: what was held back goes along */
        for (int64_t i = 0; i < n; i++) s->scratch[i] = p[i] + d->residual[i];
        memset(d->residual, 0, sizeof(float) * (size_t)n);
        payload = s->scratch;
      }
    }
  }
  double t0 = tr_now();
  int rc = pl_send(l, &h, payload);
  double dt = tr_now() - t0;
  if (!rc && dt > 1e-6) { /* the link's bandwidth, as the sends see it */
    double bw = (double)(h.bytes + sizeof h) / dt;
    d->bw = d->bw > 0 ? 0.7 * d->bw + 0.3 * bw : bw;
  }
  d->density_sum += density;
  d->nsent++;
  d->bytes += h.bytes + sizeof h;
  return rc;
}

/* Receives n floats: raw, or (compression on) in one of AdaTopK's codecs;
 * any other codec, or one with compression off, is an error naming the
 * link. */
static int recv_floats(pipe_stage *s, pl_link *l, uint32_t kind, int64_t step, int mb, int64_t n, float *out,
                       double *value) {
  pl_header h;
  void *p;
  int rc = pl_recv_encoded(l, kind, step, mb, s->timeout, &h, &p);
  if (rc) return rc;
  if (h.codec != 0 && !s->fwd.on && !s->bwd.on)
    rc = tr_fail(TR_EIO, "from %s: message %u (step %lld, micro-batch %d) in codec %d, but compression is off: "
                 "only raw (codec 0) is expected", pl_link_peer(l), h.kind, (long long)step, mb, h.codec);
  else if (h.codec != 0 && (rc = adatopk_decode_any(h.codec, p, h.bytes, out, n))) /* unknown codecs too */
    rc = tr_fail_prefix(rc, "from %s: message %u (step %lld, micro-batch %d)", pl_link_peer(l), h.kind,
                        (long long)step, mb);
  else if (h.codec == 0 && h.bytes != sizeof(float) * (uint64_t)n)
    rc = tr_fail(TR_EIO, "from %s: message %u (step %lld, micro-batch %d) of %llu bytes, expected %lld",
                 pl_link_peer(l), h.kind, (long long)step, mb, (unsigned long long)h.bytes, (long long)n * 4);
  else if (h.codec == 0) memcpy(out, p, h.bytes);
  if (value) *value = h.value;
  free(p);
  return rc;
}

/* Runs f over [lo,hi) and counts the compute. An emulated slower worker
 * (speed < 1: the README's test bed) owes (1/speed - 1) of it, slept off at
 * the end of the pass (settle): the pass takes 1/speed as long, as on a
 * slower device. */
static int timed(pipe_stage *s, int (*f)(graph *, int, int), int lo, int hi) {
  double t0 = tr_now();
  int rc = f(s->g, lo, hi);
  double dt = tr_now() - t0;
  if (s->speed > 0 && s->speed < 1) s->owed += dt * (1.0 / s->speed - 1.0);
  s->compute_s += dt;
  return rc;
}

static void settle(pipe_stage *s) {
  if (s->owed <= 0) return;
  double e = s->owed;
  struct timespec ts = {(time_t)e, (long)((e - (double)(time_t)e) * 1e9)};
  nanosleep(&ts, NULL);
  s->compute_s += e;
  s->owed = 0;
}

static void load_inputs(pipe_stage *s, int mb) {
  size_t bt = (size_t)s->b * (size_t)s->T;
  memcpy(graph_data(s->g, s->tok), s->mb_tok + mb * bt, sizeof(int32_t) * bt);
  memcpy(graph_data(s->g, s->tgt), s->mb_tgt + mb * bt, sizeof(int32_t) * bt);
}

/* --- forward and backward of one micro-batch --- */

int pipe_forward(pipe_stage *s, int64_t step, int mb, int eval, float *loss) {
  int rc = TR_OK;
  uint32_t kind = eval ? PL_EVAL_ACT : PL_ACT;
  if (s->prev) {
    if ((rc = recv_floats(s, s->prev, kind, step, mb, s->xin_n, s->buf, NULL))) return rc;
    pack(s, s->xin, s->nxin, 0, 1, s->buf);
  }
  if ((rc = timed(s, graph_forward_range, s->lo, s->hi))) return rc;
  settle(s);
  if (s->next) {
    pack(s, s->xout, s->nxout, 0, 0, s->buf);
    if ((rc = send_floats(s, &s->fwd, s->next, kind, step, mb, 0, s->buf, s->xout_n))) return rc;
  } else if ((rc = graph_read(s->g, s->loss, loss))) {
    return rc;
  }
  if (!eval) { /* keep what backward reads */
    float *slot = s->stash + (int64_t)(mb % s->slots) * s->keep_n;
    pack(s, s->keep, s->nkeep, 0, 0, slot);
  }
  return TR_OK;
}

/* This stage's ops in reverse; a tied parameter's use accumulates into its
 * own buffer (swapped in around the op). */
static int backward_ops(pipe_stage *s) {
  for (int pos = s->hi - 1; pos >= s->lo; pos--) {
    pipe_tied *use[PIPE_MAX_TIED];
    int which[PIPE_MAX_TIED], nu = 0;
    for (int j = 0; j < s->ntied; j++)
      for (int u = 0; u < s->tied[j].nuse; u++)
        if (s->tied[j].pos[u] == pos) {
          use[nu] = &s->tied[j];
          which[nu++] = u;
        }
    for (int i = 0; i < nu; i++)
      memcpy(graph_grad(s->g, use[i]->p), use[i]->acc[which[i]], sizeof(float) * (size_t)use[i]->size);
    int rc = timed(s, graph_backward_range, pos, pos + 1);
    if (rc) return rc;
    for (int i = 0; i < nu; i++)
      memcpy(use[i]->acc[which[i]], graph_grad(s->g, use[i]->p), sizeof(float) * (size_t)use[i]->size);
  }
  settle(s);
  return TR_OK;
}

static int backward(pipe_stage *s, int64_t step, int mb) {
  pack(s, s->keep, s->nkeep, 0, 1, s->stash + (int64_t)(mb % s->slots) * s->keep_n);
  load_inputs(s, mb);
  graph_zero_act_grads(s->g);
  int rc = TR_OK;
  double loss = s->mb_loss[mb];
  if (s->next) {
    if ((rc = recv_floats(s, s->next, PL_GRAD, step, mb, s->xout_n, s->buf, &loss))) return rc;
    pack(s, s->xout, s->nxout, 1, 1, s->buf);
    s->mb_loss[mb] = (float)loss;
  } else {
    graph_grad(s->g, s->loss)[0] = 1.0f;
  }
  if ((rc = backward_ops(s))) return rc;
  if (s->prev) {
    pack(s, s->xin, s->nxin, 1, 0, s->buf);
    rc = send_floats(s, &s->bwd, s->prev, PL_GRAD, step, mb, loss, s->buf, s->xin_n);
  }
  return rc;
}

/* --- the step: 1F1B --- */

/* The step's micro-batches, drawn in order from the trainer's data stream
 * for this step (one micro-batch = what a lone run draws for its batch). */
static void draw_batches(pipe_stage *s) {
  trainer_state ts;
  trainer_get_state(s->t, &ts);
  rng_t r = {ts.data_rng};
  size_t bt = (size_t)s->b * (size_t)s->T;
  for (int i = 0; i < s->M; i++)
    dataset_batch(trainer_data(s->t), SPLIT_TRAIN, &r, s->b, s->T, s->mb_tok + i * bt, s->mb_tgt + i * bt);
}

static int forward_mb(pipe_stage *s, int64_t step, int mb, double *t) {
  double t0 = tr_now();
  load_inputs(s, mb);
  int rc = pipe_forward(s, step, mb, 0, &s->mb_loss[mb]);
  *t += tr_now() - t0;
  return rc;
}

static int backward_mb(pipe_stage *s, int64_t step, int mb, double *t) {
  double t0 = tr_now();
  int rc = backward(s, step, mb);
  *t += tr_now() - t0;
  return rc;
}

int pipe_compute(void *ud, int64_t next, step_stats *st) {
  pipe_stage *s = ud;
  if (s->pad_ms > 0) {
    struct timespec pad = {s->pad_ms / 1000, (long)(s->pad_ms % 1000) * 1000000L};
    nanosleep(&pad, NULL);
  }
  double t0 = tr_now();
  draw_batches(s);
  memset(st, 0, sizeof *st);
  st->t_data = tr_now() - t0;
  for (int j = 0; j < s->ntied; j++)
    for (int u = 0; u < s->tied[j].nuse; u++)
      if (s->tied[j].acc[u]) memset(s->tied[j].acc[u], 0, sizeof(float) * (size_t)s->tied[j].size);
  s->compute_s = 0;
  s->fwd.density_sum = s->bwd.density_sum = 0;
  s->fwd.nsent = s->bwd.nsent = 0;
  s->fwd.bytes = s->bwd.bytes = 0;
  int warm = s->S - s->k - 1 < s->M ? s->S - s->k - 1 : s->M, rc = TR_OK;
  for (int i = 0; i < warm && !rc; i++) rc = forward_mb(s, next, i, &st->t_fwd);
  for (int i = 0; i + warm < s->M && !rc; i++) { /* steady: one forward, one backward */
    rc = forward_mb(s, next, i + warm, &st->t_fwd);
    if (!rc) rc = backward_mb(s, next, i, &st->t_bwd);
  }
  for (int i = s->M - warm; i < s->M && !rc; i++) rc = backward_mb(s, next, i, &st->t_bwd);
  if (rc) return rc;
  double sum = 0;
  for (int i = 0; i < s->M; i++) sum += s->mb_loss[i];
  st->loss = s->step_loss = (float)(sum / s->M);
  st->tokens = (int64_t)s->M * s->b * s->T;
  st->t_total = tr_now() - t0;
  double per_mb = s->compute_s / s->M; /* what a transfer can hide behind, averaged over steps */
  s->compute_mb = s->compute_mb > 0 ? 0.7 * s->compute_mb + 0.3 * per_mb : per_mb;
  return TR_OK;
}

/* --- the speed probe's workload --- */

int pipe_run_whole(pipe_stage *s) {
  rng_t r;
  rng_seed(&r, (uint64_t)s->cfg->seed + 77);
  dataset_batch(trainer_data(s->t), SPLIT_TRAIN, &r, s->b, s->T, graph_data(s->g, s->tok), graph_data(s->g, s->tgt));
  int n = graph_norder(s->g), rc = timed(s, graph_forward_range, 0, n);
  graph_zero_act_grads(s->g);
  graph_grad(s->g, s->loss)[0] = 1.0f;
  if (!rc) rc = timed(s, graph_backward_range, 0, n);
  settle(s);
  return rc;
}
