/* sim.c — the discrete-event simulation behind sim_run (the model is in
 * sim.h). It knows nothing of Lua, files or printing: sim_scenario.c turns
 * a scenario file into a sim_config, sim_cli.c runs and reports.
 *
 * Time moves from one happening to the next: the earliest of an event in
 * the queue (a failure, a step of a replica's or the job's recovery, a host
 * back from repair), the end of a stall, or a progress milestone (a
 * checkpoint step, a chaos step, the last step) reached at the current step
 * rate. Between them the state is constant, so advance() can book the
 * interval to progress or to the one cause that holds training up.
 */
#include "sim.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "rng.h"
#include "util.h"

#define SIM_HORIZON 100.0 /* give up at this multiple of the fault-free time */
#define SIM_MAX_BLOCKS 64

const char *sim_cause_name(sim_cause c) {
  static const char *names[SIM_NCAUSE] = {
      [SIM_STARTUP] = "startup",       [SIM_DETECT] = "detection",       [SIM_REDO] = "survivors' redo",
      [SIM_JOIN] = "join",             [SIM_CKPT] = "checkpoint stalls", [SIM_RESTART] = "restart",
      [SIM_LOAD] = "checkpoint load",  [SIM_SPARE] = "waiting for spares", [SIM_PAUSED] = "paused",
      [SIM_REWORK] = "rework",         [SIM_DEGRADED] = "degraded steps",
  };
  return (unsigned)c < SIM_NCAUSE ? names[c] : "?";
}

/* --- the event queue: a binary heap on (time, insertion order) --- */

enum ev_kind { EV_FAIL, EV_SLOT, EV_JOB, EV_HOST };

typedef struct {
  double t;
  uint64_t seq; /* equal times pop in insertion order */
  int kind;
  int64_t slot;
  uint64_t gen; /* EV_SLOT, EV_JOB: stale when the chain's gen moved on */
} event;

typedef struct {
  event *a;
  size_t n, cap;
  uint64_t seq;
} heap;

static int ev_before(const event *x, const event *y) { return x->t < y->t || (x->t == y->t && x->seq < y->seq); }

static int heap_push(heap *h, double t, int kind, int64_t slot, uint64_t gen) {
  if (h->n == h->cap) {
    size_t cap = h->cap ? 2 * h->cap : 64;
    event *a = realloc(h->a, cap * sizeof *a);
    if (!a) return tr_fail(TR_ENOMEM, "sim: out of memory (event queue)");
    h->a = a;
    h->cap = cap;
  }
  size_t i = h->n++;
  h->a[i] = (event){t, h->seq++, kind, slot, gen};
  while (i > 0 && ev_before(&h->a[i], &h->a[(i - 1) / 2])) {
    event tmp = h->a[i];
    h->a[i] = h->a[(i - 1) / 2];
    h->a[(i - 1) / 2] = tmp;
    i = (i - 1) / 2;
  }
  return TR_OK;
}

static event heap_pop(heap *h) {
  event top = h->a[0];
  h->a[0] = h->a[--h->n];
  for (size_t i = 0;;) {
    size_t l = 2 * i + 1, r = l + 1, m = i;
    if (l < h->n && ev_before(&h->a[l], &h->a[m])) m = l;
    if (r < h->n && ev_before(&h->a[r], &h->a[m])) m = r;
    if (m == i) break;
    event tmp = h->a[i];
    h->a[i] = h->a[m];
    h->a[m] = tmp;
    i = m;
  }
  return top;
}

/* --- state --- */

/* A replica's recovery chain (replace mode). */
enum slot_phase { SLOT_LIVE, SLOT_DETECTING, SLOT_DELAY, SLOT_WAIT_HOST, SLOT_START, SLOT_CATCHUP };
/* The whole job's (restart-all, or replace with every replica down). */
enum job_phase { JOB_UP, JOB_DETECTING, JOB_WAIT_HOST, JOB_RESTART, JOB_LOAD };

typedef struct {
  int phase;
  uint64_t gen;
  int64_t restarts;  /* replacements so far: the policy's backoff exponent */
  int wants_host;    /* a hardware failure not yet given a spare */
} slot_state;

typedef struct {
  double p, w; /* progress and weighted progress at the snapshot */
  double end;  /* writing: when it commits */
  int valid;
} snapshot;

typedef struct {
  int64_t slot; /* -1: the job */
  uint64_t gen;
} waiter;

typedef struct {
  const sim_config *c;
  sim_mode mode;
  sim_result *r;
  rng_t fail_rng, chaos_rng;
  heap q;
  double t;
  double p;          /* steps done, continuous */
  double w;          /* steps weighted by live / replicas (goodput) */
  int64_t live;
  slot_state *slots;
  int job_phase;
  uint64_t job_gen;
  int64_t job_hosts; /* hosts the job-wide restart still needs */
  struct {
    double end;
    int cause;
  } blk[SIM_MAX_BLOCKS]; /* stalls: segment i runs from blk[i-1].end to blk[i].end */
  int nblk;
  double next_ckpt;
  snapshot done, writing, queued;
  int64_t pool; /* spare hosts on hand */
  waiter *wait;
  size_t whead, wn, wcap;
  int chaos_next;
  int64_t periodic_k;
} sim_state;

static double uniform01(rng_t *g) { return (double)(rng_u64(g) >> 11) * 0x1.0p-53; }

static double exp_draw(rng_t *g, double rate) { return -log1p(-uniform01(g)) / rate; }

/* --- stalls: survivors' detection and redo, joins, checkpoints, start-up --- */

/* Training is held up until `end` for `cause`; overlapping stalls merge,
 * and only the part past the stalls already booked counts for the new cause. */
static void block_until(sim_state *s, double end, int cause) {
  if (s->nblk > 0 && end <= s->blk[s->nblk - 1].end) return;
  if (end <= s->t) return;
  if (s->nblk == SIM_MAX_BLOCKS) {
    s->blk[s->nblk - 1].end = end;
    return;
  }
  s->blk[s->nblk].end = end;
  s->blk[s->nblk].cause = cause;
  s->nblk++;
}

static void blocks_expire(sim_state *s) {
  int k = 0;
  while (k < s->nblk && s->blk[k].end <= s->t) k++;
  if (k == 0) return;
  memmove(s->blk, s->blk + k, (size_t)(s->nblk - k) * sizeof s->blk[0]);
  s->nblk -= k;
}

/* --- checkpoints --- */

/* Commits every write that finished by now; a queued snapshot starts
 * writing when the one before it is done. */
static void ckpt_settle(sim_state *s) {
  while (s->writing.valid && s->writing.end <= s->t) {
    s->done = s->writing;
    s->writing.valid = 0;
    if (s->queued.valid) {
      s->writing = s->queued;
      s->writing.end = s->done.end + s->c->ckpt_write_s;
      s->queued.valid = 0;
    }
  }
}

static void ckpt_snapshot(sim_state *s) {
  ckpt_settle(s);
  snapshot snap = {s->p, s->w, 0, 1};
  if (s->writing.valid) {
    s->queued = snap; /* coalesce: replaces the one waiting */
  } else {
    snap.end = s->t + s->c->ckpt_write_s;
    s->writing = snap;
  }
  block_until(s, s->t + s->c->ckpt_stall_s, SIM_CKPT);
  s->next_ckpt += (double)s->c->ckpt_every_steps;
}

static double ckpt_after(const sim_config *c, double p) {
  if (c->ckpt_every_steps <= 0) return INFINITY;
  double k = (double)c->ckpt_every_steps;
  return (floor(p / k + 1e-9) + 1) * k;
}

/* --- hosts --- */

static int wait_push(sim_state *s, int64_t slot, uint64_t gen) {
  if (s->whead + s->wn == s->wcap) {
    if (s->whead > 0) {
      memmove(s->wait, s->wait + s->whead, s->wn * sizeof *s->wait);
      s->whead = 0;
    } else {
      size_t cap = s->wcap ? 2 * s->wcap : 64;
      waiter *a = realloc(s->wait, cap * sizeof *a);
      if (!a) return tr_fail(TR_ENOMEM, "sim: out of memory (spare queue)");
      s->wait = a;
      s->wcap = cap;
    }
  }
  s->wait[s->whead + s->wn++] = (waiter){slot, gen};
  return TR_OK;
}

/* A failed host goes to repair and comes back as a spare. */
static int host_failed(sim_state *s) { return heap_push(&s->q, s->t + s->c->repair_s, EV_HOST, 0, 0); }

/* --- a replica's recovery (replace mode) --- */

static int slot_schedule(sim_state *s, int64_t i, double after) {
  return heap_push(&s->q, s->t + after, EV_SLOT, i, s->slots[i].gen);
}

static int slot_start(sim_state *s, int64_t i) {
  s->slots[i].phase = SLOT_START;
  return slot_schedule(s, i, s->c->start_s);
}

static int slot_step(sim_state *s, int64_t i) {
  slot_state *sl = &s->slots[i];
  const sim_config *c = s->c;
  switch (sl->phase) {
  case SLOT_DETECTING: { /* the policy's delay before the replacement */
    double d = c->delay_s * pow(c->backoff, (double)sl->restarts);
    if (c->delay_max_s > 0 && d > c->delay_max_s) d = c->delay_max_s;
    sl->restarts++;
    sl->phase = SLOT_DELAY;
    return slot_schedule(s, i, d);
  }
  case SLOT_DELAY:
    if (!sl->wants_host) return slot_start(s, i);
    if (s->pool > 0) {
      s->pool--;
      sl->wants_host = 0;
      return slot_start(s, i);
    }
    sl->phase = SLOT_WAIT_HOST;
    return wait_push(s, i, sl->gen);
  case SLOT_START:
    sl->phase = SLOT_CATCHUP;
    return slot_schedule(s, i, c->catchup_s);
  case SLOT_CATCHUP: /* enters the ring: the survivors stall for the new epoch */
    sl->phase = SLOT_LIVE;
    s->live++;
    s->r->replacements++;
    block_until(s, s->t + c->join_s, SIM_JOIN);
    return TR_OK;
  default:
    return TR_OK;
  }
}

/* --- the whole job's restart --- */

static int job_schedule(sim_state *s, double after) { return heap_push(&s->q, s->t + after, EV_JOB, -1, s->job_gen); }

static int job_restart_phase(sim_state *s) {
  s->job_phase = JOB_RESTART;
  return job_schedule(s, s->c->restart_s);
}

static int job_step(sim_state *s) {
  const sim_config *c = s->c;
  switch (s->job_phase) {
  case JOB_DETECTING: {
    int64_t take = s->job_hosts < s->pool ? s->job_hosts : s->pool;
    s->pool -= take;
    s->job_hosts -= take;
    if (s->job_hosts == 0) return job_restart_phase(s);
    s->job_phase = JOB_WAIT_HOST;
    return wait_push(s, -1, s->job_gen);
  }
  case JOB_RESTART:
    s->job_phase = JOB_LOAD;
    return job_schedule(s, c->load_s);
  case JOB_LOAD: /* every replica up again at the checkpoint's step */
    s->job_phase = JOB_UP;
    s->live = c->replicas;
    for (int64_t i = 0; i < c->replicas; i++) s->slots[i].phase = SLOT_LIVE;
    s->r->restarts++;
    return TR_OK;
  default:
    return TR_OK;
  }
}

/* Everything stops and goes back to the newest committed checkpoint.
 * `hosts` spare hosts are needed before the restart can begin. */
static int job_fail(sim_state *s, int64_t hosts) {
  const sim_config *c = s->c;
  if (s->job_phase == JOB_UP) {
    ckpt_settle(s);
    double back = s->done.valid ? s->done.p : 0, wback = s->done.valid ? s->done.w : 0;
    double rework = s->p - back;
    s->r->rework_steps += (int64_t)llround(rework);
    s->r->lost_s[SIM_REWORK] += rework * c->step_s;
    s->p = back;
    s->w = wback;
    s->writing.valid = s->queued.valid = 0; /* the writer died with the job */
    s->next_ckpt = ckpt_after(c, s->p);
    s->nblk = 0;
    s->live = 0;
    for (int64_t i = 0; i < c->replicas; i++) {
      s->slots[i].gen++;
      s->slots[i].phase = SLOT_DETECTING; /* down until the job restarts */
      s->slots[i].wants_host = 0;
    }
  }
  s->job_gen++;
  s->job_hosts += hosts;
  s->job_phase = JOB_DETECTING;
  return job_schedule(s, c->detect_s);
}

/* --- failures --- */

static int replica_fail(sim_state *s, int64_t i, int hw) {
  const sim_config *c = s->c;
  slot_state *sl = &s->slots[i];
  if (sl->phase == SLOT_LIVE) {
    s->live--;
    if (s->live == 0) { /* every replica down: restart from the checkpoint */
      int64_t hosts = hw;
      for (int64_t k = 0; k < c->replicas; k++) hosts += s->slots[k].phase != SLOT_LIVE && s->slots[k].wants_host;
      return job_fail(s, hosts);
    }
    block_until(s, s->t + c->detect_s, SIM_DETECT);
    block_until(s, s->t + c->detect_s + c->redo_s, SIM_REDO);
  }
  int still_wants = sl->phase == SLOT_DETECTING || sl->phase == SLOT_DELAY || sl->phase == SLOT_WAIT_HOST;
  sl->wants_host = (still_wants && sl->wants_host) || hw;
  sl->gen++;
  sl->phase = SLOT_DETECTING;
  return slot_schedule(s, i, c->detect_s);
}

static int failure(sim_state *s, int64_t slot, int hw) {
  s->r->failures++;
  s->r->hw_failures += hw;
  int rc = hw ? host_failed(s) : TR_OK;
  if (rc) return rc;
  if (s->mode == SIM_RESTART_ALL || s->job_phase != JOB_UP) return job_fail(s, hw);
  return replica_fail(s, slot, hw);
}

static int next_failure(sim_state *s) {
  const sim_config *c = s->c;
  double rate = c->per_gpu_hour * (double)(c->replicas * c->gpus_per_replica) / 3600.0;
  return rate > 0 ? heap_push(&s->q, s->t + exp_draw(&s->fail_rng, rate), EV_FAIL, 0, 0) : TR_OK;
}

static int on_event(sim_state *s, event e) {
  const sim_config *c = s->c;
  switch (e.kind) {
  case EV_FAIL: {
    int rc;
    if (e.slot < 0) { /* periodic: every every_s, replicas in turn */
      int64_t k = s->periodic_k++;
      if ((rc = heap_push(&s->q, (double)(k + 2) * c->every_s, EV_FAIL, -1, 0))) return rc;
      return failure(s, k % c->replicas, uniform01(&s->chaos_rng) < c->hardware_fraction);
    }
    int64_t slot = (int64_t)rng_below(&s->fail_rng, (uint64_t)c->replicas);
    int hw = uniform01(&s->fail_rng) < c->hardware_fraction;
    if ((rc = next_failure(s))) return rc;
    return failure(s, slot, hw);
  }
  case EV_SLOT:
    return e.gen == s->slots[e.slot].gen ? slot_step(s, e.slot) : TR_OK;
  case EV_JOB:
    return e.gen == s->job_gen ? job_step(s) : TR_OK;
  case EV_HOST: /* a host back from repair: to the first still waiting */
    s->pool++;
    while (s->wn > 0 && s->pool > 0) {
      waiter wt = s->wait[s->whead++];
      s->wn--;
      if (wt.slot < 0) {
        if (wt.gen != s->job_gen || s->job_phase != JOB_WAIT_HOST) continue;
        s->pool--;
        if (--s->job_hosts == 0) return job_restart_phase(s);
        s->whead--, s->wn++; /* still waiting: stays first */
        continue;
      }
      slot_state *sl = &s->slots[wt.slot];
      if (wt.gen != sl->gen || sl->phase != SLOT_WAIT_HOST) continue;
      s->pool--;
      sl->wants_host = 0;
      return slot_start(s, wt.slot);
    }
    return TR_OK;
  default:
    return TR_OK;
  }
}

/* --- time and progress --- */

static int paused(const sim_state *s) { return s->live < s->c->min_replicas; }

static double step_time(const sim_state *s) {
  return s->live == s->c->replicas ? s->c->step_s : s->c->degraded_step_s;
}

/* Training now? (the job up, enough replicas, no stall) */
static int running(const sim_state *s) { return s->job_phase == JOB_UP && !paused(s) && s->nblk == 0; }

static int job_cause(const sim_state *s) {
  switch (s->job_phase) {
  case JOB_DETECTING: return SIM_DETECT;
  case JOB_WAIT_HOST: return SIM_SPARE;
  case JOB_RESTART: return SIM_RESTART;
  default: return SIM_LOAD;
  }
}

/* Moves time forward by dt, in which nothing changes, booking it. */
static void advance(sim_state *s, double dt) {
  if (!(dt > 0)) return;
  sim_result *r = s->r;
  if (s->job_phase != JOB_UP) r->lost_s[job_cause(s)] += dt;
  else if (paused(s)) r->lost_s[SIM_PAUSED] += dt;
  else if (s->nblk > 0) r->lost_s[s->blk[0].cause] += dt;
  else {
    double st = step_time(s), dp = dt / st;
    s->p += dp;
    s->w += dp * (double)s->live / (double)s->c->replicas;
    r->lost_s[SIM_DEGRADED] += dt - dp * s->c->step_s;
  }
  s->t += dt;
}

/* The next progress milestone: a checkpoint, a chaos step, the end. */
static double next_milestone(const sim_state *s) {
  double m = (double)s->c->steps;
  if (s->next_ckpt < m) m = s->next_ckpt;
  if (s->chaos_next < s->c->nchaos) {
    double at = (double)(s->c->chaos[s->chaos_next].at_step - 1);
    if (at < m) m = at;
  }
  return m;
}

/* At a milestone: the checkpoint first (it follows the step), then a chaos
 * failure (it comes before the next step), as the training loop orders them. */
static int on_milestone(sim_state *s, double m) {
  const sim_config *c = s->c;
  s->p = m;
  if (m >= (double)c->steps) return TR_OK;
  if (m == s->next_ckpt) ckpt_snapshot(s);
  while (s->chaos_next < c->nchaos && (double)(c->chaos[s->chaos_next].at_step - 1) <= m) {
    const sim_chaos *k = &c->chaos[s->chaos_next++];
    int rc = failure(s, k->replica, uniform01(&s->chaos_rng) < c->hardware_fraction);
    if (rc || !running(s)) return rc;
  }
  return TR_OK;
}

/* --- the run --- */

static int check_config(const sim_config *c) {
  if (c->replicas < 1 || c->gpus_per_replica < 1 || c->gpus_per_host < 1 || c->steps < 1)
    return tr_fail(TR_EINVAL, "sim: replicas, gpus_per_replica, gpus_per_host and steps must be >= 1");
  if (c->min_replicas < 1 || c->min_replicas > c->replicas)
    return tr_fail(TR_EINVAL, "sim: min_replicas must be in 1..replicas");
  if (!(c->step_s > 0) || !(c->degraded_step_s > 0))
    return tr_fail(TR_EINVAL, "sim: step_s and degraded_step_s must be > 0");
  if (!(c->hardware_fraction >= 0 && c->hardware_fraction <= 1))
    return tr_fail(TR_EINVAL, "sim: hardware_fraction must be in 0..1");
  if (c->nchaos < 0 || c->nchaos > SIM_MAX_CHAOS) return tr_fail(TR_EINVAL, "sim: at most %d chaos entries", SIM_MAX_CHAOS);
  const double costs[] = {c->startup_s, c->per_gpu_hour, c->every_s, c->detect_s, c->redo_s, c->delay_s,
                          c->backoff, c->delay_max_s, c->start_s, c->catchup_s, c->join_s, c->restart_s,
                          c->load_s, c->ckpt_stall_s, c->ckpt_write_s, c->spare_fraction, c->repair_s};
  for (size_t i = 0; i < sizeof costs / sizeof costs[0]; i++)
    if (!(costs[i] >= 0) || !isfinite(costs[i])) return tr_fail(TR_EINVAL, "sim: times and rates must be finite and >= 0");
  for (int i = 0; i < c->nchaos; i++) {
    if (c->chaos[i].at_step < 1 || c->chaos[i].replica < 0 || c->chaos[i].replica >= c->replicas)
      return tr_fail(TR_EINVAL, "sim: chaos[%d]: at_step must be >= 1 and replica in 0..%lld", i + 1,
                     (long long)c->replicas - 1);
    if (i > 0 && c->chaos[i].at_step < c->chaos[i - 1].at_step)
      return tr_fail(TR_EINVAL, "sim: chaos entries must be in step order");
  }
  return TR_OK;
}

static int run_loop(sim_state *s) {
  const sim_config *c = s->c;
  double horizon = SIM_HORIZON * ((double)c->steps * c->step_s + c->startup_s) + 1.0;
  int rc = TR_OK;
  while (!rc && s->p < (double)c->steps) {
    if (s->t > horizon) return TR_OK;
    blocks_expire(s);
    double t_blk = s->job_phase == JOB_UP && s->nblk > 0 ? s->blk[0].end : INFINITY;
    double t_ev = s->q.n ? s->q.a[0].t : INFINITY;
    double m = next_milestone(s), t_ms = INFINITY;
    if (running(s)) t_ms = m <= s->p ? s->t : s->t + (m - s->p) * step_time(s);
    if (t_blk <= t_ms && t_blk <= t_ev && t_blk < INFINITY) {
      advance(s, t_blk - s->t);
      s->t = t_blk;
    } else if (t_ms <= t_ev && t_ms < INFINITY) {
      advance(s, t_ms - s->t);
      s->t = t_ms;
      rc = on_milestone(s, m);
    } else if (t_ev < INFINITY) {
      advance(s, t_ev - s->t);
      s->t = t_ev;
      rc = on_event(s, heap_pop(&s->q));
    } else {
      return tr_fail(TR_ESTATE, "sim: nothing left to happen at step %.0f (no spare host will ever come back?)", s->p);
    }
  }
  if (!rc) s->r->finished = 1;
  return rc;
}

int sim_run(const sim_config *c, sim_mode mode, uint64_t seed, sim_result *out) {
  int rc = check_config(c);
  if (rc) return rc;
  sim_result r;
  memset(&r, 0, sizeof r);
  sim_state s;
  memset(&s, 0, sizeof s);
  s.c = c;
  s.mode = mode;
  s.r = &r;
  rng_seed(&s.fail_rng, seed * 2 + 1);
  rng_seed(&s.chaos_rng, seed * 2 + 2);
  s.slots = calloc((size_t)c->replicas, sizeof *s.slots);
  if (!s.slots) return tr_fail(TR_ENOMEM, "sim: out of memory (%lld replicas)", (long long)c->replicas);
  s.live = c->replicas;
  s.next_ckpt = ckpt_after(c, 0);
  int64_t hosts = c->replicas * ((c->gpus_per_replica + c->gpus_per_host - 1) / c->gpus_per_host);
  s.pool = r.spares = llround(c->spare_fraction * (double)hosts);
  block_until(&s, c->startup_s, SIM_STARTUP);
  if ((rc = next_failure(&s))) goto done;
  if (c->every_s > 0 && (rc = heap_push(&s.q, c->every_s, EV_FAIL, -1, 0))) goto done;
  if ((rc = run_loop(&s))) goto done;
  r.wall_s = s.t;
  r.useful_s = s.p * c->step_s;
  r.ettr = r.wall_s > 0 ? r.useful_s / r.wall_s : 1.0;
  r.goodput = r.wall_s > 0 ? s.w * c->step_s / r.wall_s : 1.0;
  *out = r;
done:
  free(s.slots);
  free(s.q.a);
  free(s.wait);
  return rc;
}
