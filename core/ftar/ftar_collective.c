/* ftar_collective.c — the control round of one FTAR collective, whatever
 * data plane moves its bytes, and ftar_allreduce on the host-memory plane
 * (the hierarchical plane of ftar_hier.c, which runs the flat ring when the
 * epoch has no hierarchy to use).
 *
 * A call: SYNC for the latest epoch (with quorum), wait for the
 * coordinator's GO; RUN means one attempt of the data plane in that epoch,
 * COMMIT means return the full result this member already holds, a seq out
 * of step is FTAR_ESEQ. An attempt that aborts is reported (ABORT, unless a
 * newer epoch already aborts it) and redone in the next epoch from the
 * input the plane puts back; a full result is remembered, since the
 * coordinator may decide COMMIT. On any failed return the input is back in
 * buf, or the member has failed for good (the plane could not put it back).
 * A member wound down (ftar_member_wind_down, or the coordinator's WIND
 * when another member did) syncs without quorum, takes a COMMIT as usual
 * and returns FTAR_ECANCELED on the coordinator's CANCEL. Once it has taken
 * a decision of a winding group (GO flagged FTF_WIND: no member of that
 * epoch runs anything in it), a call it starts returns FTAR_ECANCELED at
 * once; before that, its calls sync as usual (the coordinator's epoch at
 * the wind-down's boundary makes them).
 * This is the one place that decides what survivors return.
 *
 * Not here: moving bytes (ftar_ring.c, ftar_hier.c, ftar_dev.c), how the coordinator
 * decides (ftar_coord.c), the control thread (ftar_control.c).
 * Called by: users of ftar_allreduce, and ftar_dev.c's ftar_allreduce_dev
 * through ftar_collective (ftar_internal.h).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "ftar.h"
#include "ftar_internal.h"
#include "ftar_member_internal.h"
#include "ftar_wire.h"
#include "util.h"

#define MAX_COUNT ((size_t)1 << 40)

/* --- epochs and results --- */

static int in_members(const peer *mem, int n, uint64_t uid) {
  for (int i = 0; i < n; i++)
    if (mem[i].uid == uid) return i;
  return -1;
}

/* Sends SYNC for the latest epoch and waits for its GO. Returns 0 with
 * *ep/dec/wind/go_seq set, 1 if a newer epoch came first (sync again), or an
 * error code. */
static int sync_epoch(ftar_member *m, uint64_t cur_seq, int full, int fresh, double t_end, uint64_t *ep_out,
                      int *dec, int *wind, uint64_t *go_seq) {
  int rc = 0;
  pthread_mutex_lock(&m->mu);
  /* quorum, and our own registration visible */
  for (;;) {
    if (m->failed) {
      rc = tr_fail(m->failed, "ftar: %s", m->fail_msg);
      goto out;
    }
    /* winding down: the decision on the collective in flight needs no quorum */
    if (in_members(m->ep_mem, m->ep_n, m->uid) >= 0 && (m->ep_n >= m->o.min_members || m->winding)) break;
    if (tr_now() >= t_end) {
      rc = tr_fail(FTAR_ETIMEOUT, "ftar: no quorum: %d member(s), need %d", m->ep_n, m->o.min_members);
      goto out;
    }
    ftar_cv_wait(m, t_end);
    if (m->o.quorum_wait) {
      pthread_mutex_unlock(&m->mu);
      ftar_quorum_wait(m);
      pthread_mutex_lock(&m->mu);
    }
  }
  uint64_t ep = m->ep;
  m->sync_n = m->ep_n;
  memcpy(m->sync_mem, m->ep_mem, (size_t)m->ep_n * sizeof m->ep_mem[0]);
  ftar_hdr h = {.type = FT_SYNC,
                .epoch = ep,
                .seq = cur_seq,
                .flags = (uint16_t)((full ? FTF_FULL : 0) | (fresh ? FTF_FRESH : 0)),
                .index = (uint32_t)m->slot};
  pthread_mutex_unlock(&m->mu);
  ftar_ctl_queue(m, 0, &h);
  pthread_mutex_lock(&m->mu);
  for (;;) {
    if (m->failed) {
      rc = tr_fail(m->failed, "ftar: %s", m->fail_msg);
      goto out;
    }
    /* a GO for our epoch counts even if a newer epoch followed it: the
     * others may already run on it (an aborting epoch stops us at once) */
    if (m->go_ep == ep) {
      *ep_out = ep;
      *dec = m->go_dec;
      *wind = m->go_wind;
      *go_seq = m->go_seq;
      m->run_n = m->sync_n;
      memcpy(m->run_mem, m->sync_mem, (size_t)m->sync_n * sizeof m->sync_mem[0]);
      m->run_r = in_members(m->run_mem, m->run_n, m->uid);
      goto out;
    }
    if (m->ep != ep) {
      rc = 1;
      goto out;
    }
    if (tr_now() >= t_end) {
      rc = tr_fail(FTAR_ETIMEOUT, "ftar: no decision from the coordinator for epoch %llu within %.1f s",
                   (unsigned long long)ep, m->o.timeout);
      goto out;
    }
    ftar_cv_wait(m, t_end);
  }
out:
  pthread_mutex_unlock(&m->mu);
  return rc;
}

static void fill_result(ftar_result *res, uint64_t ep, uint64_t seq, int redos, const peer *mem, int n) {
  if (!res) return;
  res->epoch = ep;
  res->seq = seq;
  res->redos = redos;
  res->contributors = n;
  for (int i = 0; i < n; i++) res->slots[i] = mem[i].slot;
}

/* --- one call: the phases of ftar_collective --- */

/* What one call carries from phase to phase. */
typedef struct {
  ftar_result *res; /* the caller's (may be NULL) */
  double t_end;     /* the call's bound: opts.timeout from its start */
  uint64_t seq;     /* the collective's seq (a fresh member adopts the group's) */
  int fresh;        /* the member never completed a collective */
  int redos;        /* attempts aborted in this call */
  int full;         /* an aborted attempt left the full result in buf ... */
  uint64_t full_ep; /* ... in this epoch, */
  int full_n;       /* with these contributors */
  peer *full_mem;   /* (allocated on the first such abort) */
  uint64_t res_ep;  /* the epoch of the result returned */
  int unrestored;   /* the input could not be put back: the member has failed */
} call;

/* What a phase tells the loop of ftar_collective (or a negative code). */
enum {
  STEP_NEXT = 0,  /* go on with this call's next phase */
  STEP_DONE = 1,  /* the result is in buf and res: return it */
  STEP_AGAIN = 2, /* start over with the latest epoch */
};

/* Argument and seq checks (buf checks are the caller's). */
static int check_call(ftar_member *m, ftar_plane *pl, size_t n, ftar_op op, uint64_t seq, ftar_result *res) {
  if (!m || !pl || (op != FTAR_SUM && op != FTAR_MEAN) || n > MAX_COUNT)
    return tr_fail(TR_EINVAL, "ftar_allreduce: bad arguments");
  if (m->completed_any && seq <= m->last_seq) {
    if (res) res->seq = m->last_seq + 1;
    return tr_fail(FTAR_ESEQ, "ftar_allreduce: seq %llu does not follow %llu", (unsigned long long)seq,
                   (unsigned long long)m->last_seq);
  }
  return 0;
}

/* After an abort in run_ep: waits for the epoch that replaces it. */
static int await_replacement(ftar_member *m, double t_end) {
  pthread_mutex_lock(&m->mu);
  while (m->ep == m->run_ep && !m->failed && tr_now() < t_end) ftar_cv_wait(m, t_end);
  int stuck = m->ep == m->run_ep && !m->failed;
  pthread_mutex_unlock(&m->mu);
  if (stuck) return tr_fail(FTAR_ETIMEOUT, "ftar: no new epoch after an abort within %.1f s", m->o.timeout);
  return 0;
}

/* Puts the caller's input back (pl->restore). When that fails, buf may
 * hold a partly reduced sum: a redo would reduce it again and return a
 * wrong result as a good one, so the member fails for good instead
 * (every later call fails with the same code). 0 or that code. */
static int restore_input(ftar_member *m, ftar_plane *pl) {
  int rc = pl->restore(pl, m);
  if (!rc) return 0;
  char why[400];
  snprintf(why, sizeof why, "the input could not be put back for a redo: %s", tr_error());
  ftar_member_log(m, "%s", why);
  ftar_member_fail(m, rc, why);
  return tr_fail(rc, "ftar: %s", why);
}

/* Leaves run_ep at a collective boundary, syncs the latest epoch and takes
 * the coordinator's decision: COMMIT of the full result held (STEP_DONE),
 * RUN (STEP_NEXT, buf holds the input again), a newer epoch first
 * (STEP_AGAIN), a seq out of step (FTAR_ESEQ), or CANCEL, the group wound
 * down (FTAR_ECANCELED). */
static int enter_epoch(ftar_member *m, ftar_plane *pl, call *c) {
  uint64_t ep = 0, go_seq = 0;
  int dec = 0, wind = 0;
  /* close run_ep's links now, so peers that started a collective there see
   * EOF and move on too */
  pl->leave_epoch(pl, m);
  int s = sync_epoch(m, c->seq, c->full, c->fresh, c->t_end, &ep, &dec, &wind, &go_seq);
  if (s == 1) return STEP_AGAIN;
  if (s) return s;
  pl->leave_epoch(pl, m);
  m->run_ep = ep;
  m->run_aborted = 0;
  m->wound |= wind; /* no member runs anything in this epoch: later calls are called off at once */
  if (dec == FT_GO_COMMIT && c->full && go_seq == c->seq) {
    fill_result(c->res, c->full_ep, c->seq, c->redos, c->full_mem, c->full_n);
    c->res_ep = c->full_ep;
    return STEP_DONE;
  }
  int cancel = dec == FT_GO_CANCEL;
  if ((dec != FT_GO_RUN && !cancel) || ((!c->fresh || m->o.strict_seq) && go_seq != c->seq)) {
    if (c->res) c->res->seq = go_seq;
    return tr_fail(FTAR_ESEQ, "ftar: seq %llu is out of step with the group (%llu)", (unsigned long long)c->seq,
                   (unsigned long long)go_seq);
  }
  /* the group winds down: what would run does not (after the seq check: a
   * joiner the group committed a step ahead of first catches up to it). A
   * RUN runs even if this member wound down since it synced: the
   * coordinator decided it for every member before it knew. */
  if (cancel) /* the caller restores the input */
    return tr_fail(FTAR_ECANCELED, "ftar: wound down: seq %llu not run", (unsigned long long)c->seq);
  if (c->fresh) c->seq = go_seq;
  int rr = restore_input(m, pl);
  if (rr) {
    c->unrestored = 1;
    return rr;
  }
  c->full = 0;
  return STEP_NEXT;
}

/* An attempt failed for good: the control link's failure if there is one,
 * else the plane's code. */
static int report_fatal(ftar_member *m, const call *c, const char *why, int fatal_rc) {
  ftar_member_log(m, "seq %llu in epoch %llu: %s", (unsigned long long)c->seq, (unsigned long long)m->run_ep, why);
  pthread_mutex_lock(&m->mu);
  int f = m->failed;
  pthread_mutex_unlock(&m->mu);
  return f ? tr_fail(f, "ftar: %s", m->fail_msg) : tr_fail(fatal_rc, "ftar: %s", why);
}

/* An attempt aborted: remember a full result (the coordinator may tell us
 * to keep it), report the abort, and go to the next epoch (STEP_AGAIN). */
static int record_abort(ftar_member *m, call *c, int got_full, const char *why) {
  c->redos++;
  m->st.redos++;
  m->run_aborted = 1;
  ftar_member_log(m, "seq %llu aborted in epoch %llu (%s)%s", (unsigned long long)c->seq,
                  (unsigned long long)m->run_ep, why, got_full ? "; holding the full result" : "");
  if (got_full && !c->full) {
    c->full = 1;
    c->full_ep = m->run_ep;
    c->full_n = m->run_n;
    if (!c->full_mem) c->full_mem = malloc(sizeof(peer) * FTAR_MAX_MEMBERS);
    if (!c->full_mem) return tr_fail(TR_ENOMEM, "ftar_allreduce: out of memory");
    memcpy(c->full_mem, m->run_mem, (size_t)m->run_n * sizeof(peer));
  }
  pthread_mutex_lock(&m->mu);
  int known = m->abort_ep > m->run_ep;
  pthread_mutex_unlock(&m->mu);
  if (!known) {
    ftar_hdr h = {.type = FT_ABORT, .epoch = m->run_ep, .seq = c->seq, .index = (uint32_t)m->slot};
    ftar_ctl_queue(m, 1, &h);
  }
  return STEP_AGAIN;
}

/* One attempt in run_ep: STEP_DONE, STEP_AGAIN (aborted), or a code. */
static int run_attempt(ftar_member *m, ftar_plane *pl, call *c) {
  if (m->run_n == 1) { /* alone: the input is the result */
    fill_result(c->res, m->run_ep, c->seq, c->redos, m->run_mem, 1);
    c->res_ep = m->run_ep;
    return STEP_DONE;
  }
  int got_full = 0, fatal_rc = FTAR_ETIMEOUT;
  char why[256];
  why[0] = 0;
  int rr = pl->run(pl, m, c->seq, c->t_end, &got_full, &fatal_rc, why, sizeof why);
  if (rr < 0) return rr;
  if (rr == FTAR_PLANE_DONE) {
    fill_result(c->res, m->run_ep, c->seq, c->redos, m->run_mem, m->run_n);
    c->res_ep = m->run_ep;
    return STEP_DONE;
  }
  if (rr == FTAR_PLANE_FATAL) return report_fatal(m, c, why, fatal_rc);
  return record_abort(m, c, got_full, why);
}

/* The call completed: the member's last seq and epoch, and what to return. */
static int finish_call(ftar_member *m, call *c) {
  m->completed_any = 1;
  m->last_seq = c->seq;
  m->st.collectives++;
  int rc = (m->st.collectives > 1 && c->res_ep != m->last_ep) || c->redos ? FTAR_RESHAPED : FTAR_OK;
  m->last_ep = c->res_ep;
  free(c->full_mem);
  return rc;
}

/* The control round of one collective, the data moved by pl: see
 * ftar_internal.h. */
int ftar_collective(ftar_member *m, ftar_plane *pl, size_t n, ftar_op op, uint64_t seq, ftar_result *res) {
  int rc = check_call(m, pl, n, op, seq, res);
  if (rc) return rc;
  if (res) memset(res, 0, sizeof *res);
  if (m->wound) return tr_fail(FTAR_ECANCELED, "ftar: wound down: seq %llu not run", (unsigned long long)seq);
  call c = {.res = res, .t_end = tr_now() + m->o.timeout, .seq = seq, .fresh = !m->completed_any};
  for (;;) {
    pthread_mutex_lock(&m->mu);
    int failed = m->failed;
    uint64_t latest = m->ep, from = m->ep_from;
    pthread_mutex_unlock(&m->mu);
    if (failed) {
      rc = tr_fail(failed, "ftar: %s", m->fail_msg);
      break;
    }
    if (latest == m->run_ep && m->run_aborted) {
      if ((rc = await_replacement(m, c.t_end))) break;
      continue;
    }
    rc = STEP_NEXT;
    /* a join at a chosen seq: collectives before it finish in run_ep */
    if (m->run_ep == 0 || (latest != m->run_ep && (seq >= from || m->run_aborted))) rc = enter_epoch(m, pl, &c);
    if (rc == STEP_NEXT) rc = run_attempt(m, pl, &c);
    if (rc == STEP_DONE) return finish_call(m, &c);
    if (rc < 0) break;
  }
  int rr = c.unrestored ? 0 : restore_input(m, pl);
  free(c.full_mem);
  return rr ? rr : rc;
}

/* --- ftar_allreduce: the collective on the host-memory plane --- */

int ftar_allreduce(ftar_member *m, float *buf, size_t n, ftar_op op, uint64_t seq, ftar_result *res) {
  if (!m || (!buf && n) || (op != FTAR_SUM && op != FTAR_MEAN) || n > MAX_COUNT)
    return tr_fail(TR_EINVAL, "ftar_allreduce: bad arguments");
  if (ftar_async_busy(m)) return tr_fail(TR_ESTATE, "ftar_allreduce: a started collective was not waited for");
  ftar_plane *pl = ftar_host_plane_new(buf, n, op, 0, NULL);
  if (!pl) {
    if (res) memset(res, 0, sizeof *res);
    return tr_fail(TR_ENOMEM, "ftar_allreduce: out of memory");
  }
  int rc = ftar_collective(m, pl, n, op, seq, res);
  ftar_host_plane_free(pl);
  return rc;
}
