/* ftar_collective.c — the control round of one FTAR collective, whatever
 * data plane moves its bytes, and ftar_allreduce on the ring plane.
 *
 * A call: SYNC for the latest epoch (with quorum), wait for the
 * coordinator's GO; RUN means one attempt of the data plane in that epoch,
 * COMMIT means return the full result this member already holds, a seq out
 * of step is FTAR_ESEQ. An attempt that aborts is reported (ABORT, unless a
 * newer epoch already aborts it) and redone in the next epoch from the
 * input the plane puts back; a full result is remembered, since the
 * coordinator may decide COMMIT. On any failed return the input is back in
 * buf. This is the one place that decides what survivors return.
 *
 * Not here: moving bytes (ftar_ring.c, ftar_dev.c), how the coordinator
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

static int in_members(const peer *mem, int n, uint64_t uid) {
  for (int i = 0; i < n; i++)
    if (mem[i].uid == uid) return i;
  return -1;
}

/* Sends SYNC for the latest epoch and waits for its GO. Returns 0 with
 * *ep/dec/go_seq set, 1 if a newer epoch came first (sync again), or an
 * error code. */
static int sync_epoch(ftar_member *m, uint64_t cur_seq, int full, int fresh, double t_end, uint64_t *ep_out,
                      int *dec, uint64_t *go_seq) {
  int rc = 0;
  pthread_mutex_lock(&m->mu);
  /* quorum, and our own registration visible */
  for (;;) {
    if (m->failed) {
      rc = tr_fail(m->failed, "ftar: %s", m->fail_msg);
      goto out;
    }
    if (in_members(m->ep_mem, m->ep_n, m->uid) >= 0 && m->ep_n >= m->o.min_members) break;
    if (tr_now() >= t_end) {
      rc = tr_fail(FTAR_ETIMEOUT, "ftar: no quorum: %d member(s), need %d", m->ep_n, m->o.min_members);
      goto out;
    }
    ftar_cv_wait(m, t_end);
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

/* The control round of one collective, the data moved by pl: see
 * ftar_internal.h. (buf checks are the caller's.) */
int ftar_collective(ftar_member *m, ftar_plane *pl, size_t n, ftar_op op, uint64_t seq, ftar_result *res) {
  if (!m || !pl || (op != FTAR_SUM && op != FTAR_MEAN) || n > MAX_COUNT)
    return tr_fail(TR_EINVAL, "ftar_allreduce: bad arguments");
  if (m->completed_any && seq <= m->last_seq) {
    if (res) res->seq = m->last_seq + 1;
    return tr_fail(FTAR_ESEQ, "ftar_allreduce: seq %llu does not follow %llu", (unsigned long long)seq,
                   (unsigned long long)m->last_seq);
  }
  if (res) memset(res, 0, sizeof *res);
  double t_end = tr_now() + m->o.timeout;
  int fresh = !m->completed_any, redos = 0, full = 0, rc = 0, full_n = 0;
  uint64_t cur_seq = seq, full_ep = 0, res_ep = 0;
  peer *full_mem = NULL;
  char why[256];
  for (;;) {
    pthread_mutex_lock(&m->mu);
    int failed = m->failed;
    uint64_t latest = m->ep;
    pthread_mutex_unlock(&m->mu);
    if (failed) {
      rc = tr_fail(failed, "ftar: %s", m->fail_msg);
      goto fail;
    }
    if (latest == m->run_ep && m->run_aborted) { /* wait for the epoch that replaces the failed one */
      pthread_mutex_lock(&m->mu);
      while (m->ep == m->run_ep && !m->failed && tr_now() < t_end) ftar_cv_wait(m, t_end);
      int stuck = m->ep == m->run_ep && !m->failed;
      pthread_mutex_unlock(&m->mu);
      if (stuck) {
        rc = tr_fail(FTAR_ETIMEOUT, "ftar: no new epoch after an abort within %.1f s", m->o.timeout);
        goto fail;
      }
      continue;
    }
    if (latest != m->run_ep || m->run_ep == 0) {
      uint64_t ep = 0, go_seq = 0;
      int dec = 0;
      /* leaving run_ep at a collective boundary: close its links now, so
       * peers that started a collective there see EOF and move on too */
      pl->leave_epoch(pl, m);
      int s = sync_epoch(m, cur_seq, full, fresh, t_end, &ep, &dec, &go_seq);
      if (s == 1) continue;
      if (s) {
        rc = s;
        goto fail;
      }
      pl->leave_epoch(pl, m);
      m->run_ep = ep;
      m->run_aborted = 0;
      if (dec == FT_GO_COMMIT && full && go_seq == cur_seq) {
        fill_result(res, full_ep, cur_seq, redos, full_mem, full_n);
        res_ep = full_ep;
        goto done;
      }
      if (dec != FT_GO_RUN || ((!fresh || m->o.strict_seq) && go_seq != cur_seq)) {
        if (res) res->seq = go_seq;
        rc = tr_fail(FTAR_ESEQ, "ftar: seq %llu is out of step with the group (%llu)", (unsigned long long)cur_seq,
                     (unsigned long long)go_seq);
        goto fail;
      }
      if (fresh) cur_seq = go_seq;
      pl->restore(pl, m);
      full = 0;
    }
    if (m->run_n == 1) { /* alone: the input is the result */
      fill_result(res, m->run_ep, cur_seq, redos, m->run_mem, 1);
      res_ep = m->run_ep;
      goto done;
    }
    int got_full = 0, fatal_rc = FTAR_ETIMEOUT;
    why[0] = 0;
    int rr = pl->run(pl, m, cur_seq, t_end, &got_full, &fatal_rc, why, sizeof why);
    if (rr < 0) {
      rc = rr;
      goto fail;
    }
    if (rr == FTAR_PLANE_DONE) {
      fill_result(res, m->run_ep, cur_seq, redos, m->run_mem, m->run_n);
      res_ep = m->run_ep;
      goto done;
    }
    if (rr == FTAR_PLANE_FATAL) {
      ftar_member_log(m, "seq %llu in epoch %llu: %s", (unsigned long long)cur_seq, (unsigned long long)m->run_ep, why);
      pthread_mutex_lock(&m->mu);
      int f = m->failed;
      pthread_mutex_unlock(&m->mu);
      rc = f ? tr_fail(f, "ftar: %s", m->fail_msg) : tr_fail(fatal_rc, "ftar: %s", why);
      goto fail;
    }
    /* aborted: remember a full result (the coordinator may tell us to keep
     * it), report, and go to the next epoch */
    redos++;
    m->st.redos++;
    m->run_aborted = 1;
    ftar_member_log(m, "seq %llu aborted in epoch %llu (%s)%s", (unsigned long long)cur_seq, (unsigned long long)m->run_ep,
         why, got_full ? "; holding the full result" : "");
    if (got_full && !full) {
      full = 1;
      full_ep = m->run_ep;
      full_n = m->run_n;
      if (!full_mem) full_mem = malloc(sizeof(peer) * FTAR_MAX_MEMBERS);
      if (!full_mem) {
        rc = tr_fail(TR_ENOMEM, "ftar_allreduce: out of memory");
        goto fail;
      }
      memcpy(full_mem, m->run_mem, (size_t)m->run_n * sizeof(peer));
    }
    pthread_mutex_lock(&m->mu);
    int known = m->abort_ep > m->run_ep;
    pthread_mutex_unlock(&m->mu);
    if (!known) {
      ftar_hdr h = {.type = FT_ABORT, .epoch = m->run_ep, .seq = cur_seq, .index = (uint32_t)m->slot};
      ftar_ctl_queue(m, 1, &h);
    }
  }
done:
  m->completed_any = 1;
  m->last_seq = cur_seq;
  m->st.collectives++;
  rc = (m->st.collectives > 1 && res_ep != m->last_ep) || redos ? FTAR_RESHAPED : FTAR_OK;
  m->last_ep = res_ep;
  free(full_mem);
  return rc;
fail:
  pl->restore(pl, m);
  free(full_mem);
  return rc;
}


int ftar_allreduce(ftar_member *m, float *buf, size_t n, ftar_op op, uint64_t seq, ftar_result *res) {
  if (!m || (!buf && n) || (op != FTAR_SUM && op != FTAR_MEAN) || n > MAX_COUNT)
    return tr_fail(TR_EINVAL, "ftar_allreduce: bad arguments");
  ftar_plane *pl = ftar_ring_plane_new(buf, n, op);
  if (!pl) {
    if (res) memset(res, 0, sizeof *res);
    return tr_fail(TR_ENOMEM, "ftar_allreduce: out of memory");
  }
  int rc = ftar_collective(m, pl, n, op, seq, res);
  ftar_ring_plane_free(pl);
  return rc;
}
