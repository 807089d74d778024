/* loop.c — the one training loop (see loop.h): the step's phases in order,
 * checkpoint timing, evaluation and the final save. It knows nothing of
 * FTAR, the operator or the terminal: those are hooks (core/fleet/worker.c,
 * core/cli/run.c).
 */
#include "loop.h"

#include <string.h>

#include "util.h"

typedef struct {
  const loop_opts *o;
  const loop_hooks *h;
  const job_config *cfg;
  loop_control ctl;
  int64_t step, last_snap;
  double last_snap_time;
  int leader;
  int writer; /* snapshots (loop_exchange.snapshots) */
  int owed;   /* a snapshot wanted at an agreed step was not agreed on: still wanted */
  int agreed_stop; /* the exchange agreed to stop after L->step (loop_exchange.stop) */
} loop_state;

#define HOOK(L, name, ...) ((L)->h->name ? (L)->h->name((L)->h->ud, __VA_ARGS__) : 0)

/* --- checkpoints --- */

static void drain_ckpt(loop_state *L) {
  ckpt_event ev;
  while (L->o->ck && ckpt_poll(L->o->ck, &ev))
    if (L->h->ckpt_event) L->h->ckpt_event(L->h->ud, &ev);
}

/* A snapshot that fails to start is a failed checkpoint, not a failed run:
 * training goes on and older checkpoints stay. One the engine deferred or
 * skipped (busy, or pacing) is not counted as taken: a deferred one is
 * taken when ckpt_pending says so, and the end snapshots what is left. */
static void snapshot(loop_state *L) {
  ckpt_state s;
  trainer_ckpt_state(L->o->t, &s);
  int rc = ckpt_snapshot(L->o->ck, &s);
  if (rc < 0 && L->h->ckpt_event) {
    ckpt_event ev = {.step = L->step, .ok = 0};
    snprintf(ev.what, sizeof ev.what, "%s", tr_error());
    L->h->ckpt_event(L->h->ud, &ev);
  }
  if (rc == 0 || rc < 0) {
    L->last_snap = L->step;
    L->last_snap_time = tr_now();
  }
}

static int stop_reached(const loop_state *L) {
  return L->ctl.stop || L->agreed_stop || (L->ctl.stop_at > 0 && L->step >= L->ctl.stop_at);
}

/* Due at step `step` by steps, by seconds, on request, at a stop or at
 * the end, or a deferred (coalesced) one the engine can take now. */
static int checkpoint_due(const loop_state *L, int64_t step) {
  const job_config *c = L->cfg;
  return (c->ckpt_every_steps > 0 && step % c->ckpt_every_steps == 0) || L->ctl.ckpt_now ||
         (c->ckpt_every_seconds > 0 && tr_now() - L->last_snap_time >= c->ckpt_every_seconds) ||
         step == c->max_steps || L->ctl.stop || (L->ctl.stop_at > 0 && step >= L->ctl.stop_at) ||
         ckpt_pending(L->o->ck);
}

/* Only the writer (the leader, or a pipeline stage's lowest live replica)
 * snapshots: every replica holds the same bits. Where the exchange agreed
 * on the step (x->ckpt_agreed: a pipeline, whose stages must hold the same
 * steps, each in its own store) that decides, on every stage alike; a
 * wish not agreed on (another stage's engine was busy) stays for the next
 * step. Otherwise each decides on its own clock. */
static void checkpoint_tick(loop_state *L, const loop_exchange *x) {
  int due = x->ckpt_agreed >= 0 ? x->ckpt_agreed : checkpoint_due(L, L->step);
  if (x->ckpt_agreed >= 0) L->owed = x->ckpt_want && !x->ckpt_agreed;
  L->ctl.ckpt_now = 0;
  if (!L->o->ck || !L->writer) return;
  if (due) snapshot(L);
}

/* --- one step --- */

static int exchange(loop_state *L, step_stats *st, loop_exchange *x) {
  memset(x, 0, sizeof *x);
  x->replicas = 1;
  x->leader = 1;
  x->snapshots = -1;
  x->ckpt_agreed = -1;
  if (!L->h->exchange) return x->snapshots = 1, 0;
  x->ckpt_want = L->o->ck && (L->owed || checkpoint_due(L, L->step + 1));
  x->ckpt_ready = ckpt_ready(L->o->ck);
  double t0 = tr_now();
  int rc = L->h->exchange(L->h->ud, L->step + 1, x);
  if (x->snapshots < 0) x->snapshots = x->leader;
  x->allreduce_s = tr_now() - t0;
  if (x->comm_s < x->allreduce_s) x->comm_s = x->allreduce_s; /* it ran at least while the step waited */
  (void)st;
  return rc;
}

static void fill_record(const loop_state *L, const step_stats *st, const loop_exchange *x, double wall,
                        step_record *r) {
  memset(r, 0, sizeof *r);
  r->step = L->step;
  r->worker = L->o->worker;
  r->replicas = x->replicas;
  r->epoch = x->epoch;
  r->redos = x->redos;
  r->leader = x->leader;
  r->skipped = st->skipped;
  r->loss = st->loss;
  r->grad_norm = st->grad_norm;
  r->lr = st->lr;
  r->step_s = wall;
  r->data_s = st->t_data;
  r->forward_s = st->t_fwd;
  r->backward_s = st->t_bwd;
  r->allreduce_s = x->allreduce_s;
  r->comm_s = x->comm_s;
  r->optimizer_s = st->t_opt;
  r->ckpt_wait_s = st->t_ckpt_wait;
  r->tokens_per_s = wall > 0 ? (double)st->tokens / wall : 0;
  r->rss_bytes = (double)tr_current_rss();
  int64_t every = L->cfg->checksum_interval;
  if (every > 0 && L->step % every == 0) {
    r->checksum = trainer_param_crc(L->o->t);
    r->has_checksum = 1;
  }
}

/* Computes, exchanges and applies step L->step + 1. Returns 0,
 * LOOP_RECOMPUTE (state changed under it: start the step again),
 * LOOP_STOPPED (the step called off, nothing applied) or an error. */
static int one_step(loop_state *L, step_stats *st, loop_exchange *x, double *wall) {
  trainer *t = L->o->t;
  double t0 = tr_now();
  int rc = HOOK(L, before_step, L->step + 1);
  if (!rc) rc = HOOK(L, exchange_start, L->step + 1);
  if (!rc) rc = L->h->compute ? L->h->compute(L->h->ud, L->step + 1, st) : trainer_compute_grads(t, st);
  if (!rc) rc = exchange(L, st, x);
  if (rc) return rc;
  st->t_ckpt_wait = ckpt_wait_copy(L->o->ck); /* parameters are about to change */
  if ((rc = trainer_apply_grads(t, st))) return rc;
  *wall = tr_now() - t0;
  L->step = st->step;
  L->agreed_stop = x->stop;
  L->leader = x->leader;
  L->writer = x->snapshots;
  return HOOK(L, boundary, L->step);
}

static int after_step(loop_state *L, const step_stats *st, const loop_exchange *x, double wall) {
  const job_config *c = L->cfg;
  checkpoint_tick(L, x);
  drain_ckpt(L);
  int rc = 0;
  if ((L->leader || L->h->evaluate) &&
      ((c->eval_interval > 0 && L->step % c->eval_interval == 0) || L->step == c->max_steps)) {
    float val;
    rc = L->h->evaluate ? L->h->evaluate(L->h->ud, L->step, &val) : trainer_eval(L->o->t, &val);
    if (rc || (L->leader && (rc = HOOK(L, eval, L->step, val)))) return rc;
  }
  step_record r;
  fill_record(L, st, x, wall, &r);
  return HOOK(L, report, &r);
}

/* --- the end --- */

/* The last state is always checkpointed (a stop or the end resumes
 * exactly), everything flushed, and the weights saved: at the end, at a
 * stop where the caller asks (save_on_stop), and at a stop the exchange
 * agreed on (every process is at the same step). */
static int finish(loop_state *L, int rc) {
  const loop_opts *o = L->o;
  if (o->ck && L->writer && L->last_snap != L->step && (!rc || (o->save_on_stop && !o->replica))) {
    ckpt_wait_copy(o->ck);
    ckpt_flush(o->ck); /* the writer free and no pacing rest: this snapshot is taken, not deferred */
    snapshot(L);
  }
  ckpt_flush(o->ck);
  ckpt_wait_remote(o->ck); /* the newest checkpoint on the remote level too, its event in the log */
  drain_ckpt(L);
  int done = L->step >= L->cfg->max_steps;
  if (!rc && L->leader && (done || o->save_on_stop || L->agreed_stop)) {
    if ((rc = trainer_save(o->t, o->run_dir))) return tr_fail_prefix(rc, "saving weights");
    if (L->h->saved) L->h->saved(L->h->ud, L->step);
  }
  return rc;
}

int loop_run(const loop_opts *o, const loop_hooks *h, loop_result *res) {
  trainer_state ts;
  trainer_get_state(o->t, &ts);
  loop_state L = {.o = o, .h = h, .cfg = trainer_config(o->t), .step = ts.step, .last_snap = ts.step,
                  .last_snap_time = tr_now(), .leader = h->exchange == NULL, /* with peers: known after an exchange */
                  .writer = h->exchange == NULL};
  int rc = h->grads_ready ? trainer_set_grads_ready(o->t, h->grads_ready, h->ud) : 0;
  while (!rc && L.step < L.cfg->max_steps) {
    if ((rc = HOOK(&L, poll, &L.ctl)) || stop_reached(&L)) break;
    step_stats st = {0};
    loop_exchange x;
    double wall = 0;
    rc = one_step(&L, &st, &x, &wall);
    if (rc == LOOP_RECOMPUTE) { /* a joiner replayed what it missed: go on from there */
      trainer_get_state(o->t, &ts);
      L.step = ts.step;
      rc = 0;
      continue;
    }
    if (rc == LOOP_STOPPED) { /* the step called off: stop at the last boundary, its writer checkpoints it */
      trainer_get_state(o->t, &ts);
      L.step = ts.step;
      L.ctl.stop = 1;
      L.leader = x.leader;
      L.writer = x.snapshots;
      rc = 0;
      break;
    }
    if (rc || (rc = after_step(&L, &st, &x, wall))) break;
  }
  if (h->grads_ready) trainer_set_grads_ready(o->t, NULL, NULL);
  if (rc && h->failed) h->failed(h->ud, rc); /* before finish: its flush may take a while */
  rc = finish(&L, rc);
  res->step = L.step;
  res->stopped = L.step < L.cfg->max_steps && stop_reached(&L);
  res->leader = L.leader;
  res->last_snapshot = L.last_snap;
  return rc;
}
