/* ftar_dev.c — FTAR on backend ("device") buffers: the communicator data
 * plane (see ftar_allreduce_dev in ftar.h).
 *
 * The control round (SYNC, GO, redo, who returns what) is
 * ftar_collective.c's ftar_collective, unchanged; this file is a data plane
 * for it (ftar_internal.h). Per member it keeps, in the member (freed with it):
 * the backend, the communicator of one epoch, a device copy of the caller's
 * input, one device float for the commit round, and a host buffer for
 * backends without collectives.
 *
 * One attempt in epoch E (the member is rank r of p, its position in E's
 * ordered list):
 *   1. save the input (first attempt of the call only; be->copy, queued);
 *   2. no communicator for E yet: rank 0 makes an id (be->comm_id) and
 *      offers it to the coordinator; the others wait for it (an aborting
 *      epoch ends the wait); all create the communicator (bounded);
 *   3. all-reduce buf (scale 1/p for a mean), then all-reduce one float: the
 *      commit round. A rank finishes the commit round only once every rank
 *      has entered it, i.e. finished the data all-reduce, so "done" means
 *      every member holds the full result, as after the ring's last token;
 *      a failed commit round still leaves this member holding the full
 *      result (*full), which the coordinator may tell it to return.
 * A failed step destroys the communicator (the backend has aborted it) and
 * reports ABORT; ftar_collective reports it to the coordinator, which
 * publishes epoch+1, restores buf from the copy and runs the next attempt
 * (a copy that fails there fails the member: buf may be half reduced).
 * Except where a retry would fail the same way: the device is unusable
 * (TR_EDEVICE from the backend: a corrupted CUDA context, a communicator
 * abort that hung) or the ranks cannot form a communicator (TR_EINVAL: two
 * ranks on one GPU, which NCCL refuses) gives up the call with that code
 * (FATAL), so that the worker exits (and is replaced, or the job stops)
 * instead of stalling its group epoch after epoch until the call's timeout.
 *
 * Not here: the NCCL calls (ext/cuda/comm.cu), the shared-memory
 * communicator (comm_emu.c). Called by: the trainer, tests.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "ftar.h"
#include "ftar_internal.h"
#include "util.h"

_Static_assert(FTAR_COMMID_LEN == TR_COMM_ID_BYTES, "a COMMID frame carries one communicator id");

#define CREATE_MIN_S 10.0 /* shortest bound on creating a communicator (NCCL init takes a while) */

typedef struct {
  const tr_backend *be;
  tr_comm *comm;
  uint64_t comm_ep; /* epoch of comm */
  int comm_ok;      /* comm's last collective completed (a shutdown now is a clean one) */
  float *save;      /* device: the caller's input */
  size_t save_cap;  /* floats */
  float *token;     /* device: the commit round's float (stays 0) */
  float *host;      /* host staging (backends without collectives) */
  size_t host_cap;
} dev_state;

/* Destroys the communicator: finalize only at a clean shutdown (see
 * dev_state_free); leaving an epoch aborts it, since finalizing would wait
 * for every rank of that epoch, the one that failed included. */
static void comm_drop(dev_state *st, int finalize) {
  if (st->comm) st->be->comm_destroy(st->comm, finalize);
  st->comm = NULL;
  st->comm_ep = 0;
  st->comm_ok = 0;
}

/* The member is freed: a communicator whose last collective completed is
 * finalized (the job ends, every rank frees its own; a rank that leaves
 * alone waits for the others at most the backend's bound, on its way out),
 * any other aborted. */
static void dev_state_free(void *p) {
  dev_state *st = p;
  if (!st) return;
  comm_drop(st, st->comm_ok);
  if (st->save) st->be->free(st->save);
  if (st->token) st->be->free(st->token);
  free(st->host);
  free(st);
}

/* The member's state for be (a member used with another backend before
 * starts afresh). NULL on ENOMEM. */
static dev_state *dev_get(ftar_member *m, const tr_backend *be) {
  dev_state *st = ftar_member_dev_state(m);
  if (st && st->be != be) {
    dev_state_free(st);
    ftar_member_set_dev_state(m, NULL, NULL);
    st = NULL;
  }
  if (!st) {
    st = calloc(1, sizeof *st);
    if (!st) {
      tr_fail(TR_ENOMEM, "ftar_allreduce_dev: out of memory");
      return NULL;
    }
    st->be = be;
    ftar_member_set_dev_state(m, st, dev_state_free);
  }
  return st;
}

/* --- the communicator plane --- */

typedef struct {
  ftar_plane base;
  dev_state *st;
  float *buf;
  size_t n;
  ftar_op op;
  int saved; /* st->save holds this call's input */
  int dirty; /* buf may differ from it */
} dev_plane;

/* Gives up the call with code; why is already written. */
static int plane_fatal(int *fatal_rc, int code) {
  *fatal_rc = code;
  return FTAR_PLANE_FATAL;
}

/* What a failed communicator call ends the attempt with: FATAL where a
 * retry would fail the same way (the device is unusable: TR_EDEVICE; the
 * ranks' set-up is wrong, e.g. two on one GPU: TR_EINVAL), else ABORT (a
 * peer failed: the next epoch's communicator may work). */
static int comm_failed(int rc, int *fatal_rc) {
  if (rc == TR_EDEVICE || rc == TR_EINVAL) return plane_fatal(fatal_rc, rc);
  return FTAR_PLANE_ABORT;
}

/* Makes sure st->comm is the communicator of ri's epoch. FTAR_PLANE_DONE
 * (0) when it is, else ABORT / FATAL with why. */
static int comm_ready(dev_plane *p, ftar_member *m, const ftar_run_info *ri, double t_end, int *fatal_rc,
                      char *why, size_t why_len) {
  dev_state *st = p->st;
  const tr_backend *be = st->be;
  if (st->comm && st->comm_ep == ri->epoch) return FTAR_PLANE_DONE;
  comm_drop(st, 0);
  uint8_t id[TR_COMM_ID_BYTES];
  if (ri->rank == 0) {
    int rc = be->comm_id(id);
    if (rc) {
      snprintf(why, why_len, "%s: making a communicator id: %s", be->name, be->error());
      return plane_fatal(fatal_rc, rc == TR_EDEVICE ? TR_EDEVICE : TR_EIO);
    }
    ftar_member_comm_id_offer(m, ri->epoch, id);
  } else {
    int w = ftar_member_comm_id_wait(m, ri->epoch, id, t_end);
    if (w == 1) {
      snprintf(why, why_len, "epoch %llu was aborted before its communicator id arrived",
               (unsigned long long)ri->epoch);
      return FTAR_PLANE_ABORT;
    }
    if (w < 0) {
      snprintf(why, why_len, "%s", tr_error());
      return plane_fatal(fatal_rc, w);
    }
  }
  double left = t_end - tr_now();
  double bound = ri->deadline * 4 > CREATE_MIN_S ? ri->deadline * 4 : CREATE_MIN_S;
  if (left <= 0) {
    snprintf(why, why_len, "timed out after %.1f s before creating the communicator", ri->timeout);
    return plane_fatal(fatal_rc, FTAR_ETIMEOUT);
  }
  int rc = be->comm_create(&st->comm, id, ri->n, ri->rank, left < bound ? left : bound);
  if (rc) {
    st->comm = NULL;
    snprintf(why, why_len, "creating the communicator of epoch %llu (rank %d of %d): %s",
             (unsigned long long)ri->epoch, ri->rank, ri->n, be->error());
    if (tr_now() >= t_end) return plane_fatal(fatal_rc, FTAR_ETIMEOUT);
    return comm_failed(rc, fatal_rc);
  }
  st->comm_ep = ri->epoch;
  return FTAR_PLANE_DONE;
}

static int dev_plane_run(ftar_plane *pl, ftar_member *m, uint64_t seq, double t_end, int *full, int *fatal_rc,
                         char *why, size_t why_len) {
  dev_plane *p = (dev_plane *)pl;
  dev_state *st = p->st;
  const tr_backend *be = st->be;
  ftar_run_info ri;
  ftar_member_run_info(m, &ri);
  *full = 0;
  if (!p->saved && p->n) {
    if (p->n > st->save_cap) {
      if (st->save) be->free(st->save);
      st->save_cap = 0;
      st->save = be->alloc(p->n * sizeof(float));
      if (!st->save)
        return tr_fail(TR_ENOMEM, "ftar_allreduce_dev: %s: cannot allocate the input copy (%zu floats): %s", be->name,
                       p->n, be->error());
      st->save_cap = p->n;
    }
    int rc = be->copy(st->save, p->buf, p->n * sizeof(float));
    if (rc)
      return tr_fail(rc == TR_EDEVICE ? TR_EDEVICE : TR_EIO, "ftar_allreduce_dev: %s: saving the input: %s", be->name,
                     be->error());
    p->saved = 1;
  }
  if (!st->token && !(st->token = be->alloc(sizeof(float))))
    return tr_fail(TR_ENOMEM, "ftar_allreduce_dev: %s: out of device memory: %s", be->name, be->error());
  int r = comm_ready(p, m, &ri, t_end, fatal_rc, why, why_len);
  if (r != FTAR_PLANE_DONE) return r;
  float scale = p->op == FTAR_MEAN ? 1.0f / (float)ri.n : 1.0f;
  p->dirty = 1;
  st->comm_ok = 0;
  int rc = be->comm_allreduce(st->comm, p->buf, p->n, scale, ri.deadline);
  if (rc) {
    snprintf(why, why_len, "seq %llu, rank %d of %d: %s", (unsigned long long)seq, ri.rank, ri.n, be->error());
    comm_drop(st, 0);
    return comm_failed(rc, fatal_rc);
  }
  *full = 1;
  rc = be->comm_allreduce(st->comm, st->token, 1, 1.0f, ri.deadline);
  if (rc) {
    snprintf(why, why_len, "seq %llu commit round, rank %d of %d: %s", (unsigned long long)seq, ri.rank, ri.n,
             be->error());
    comm_drop(st, 0);
    return comm_failed(rc, fatal_rc);
  }
  st->comm_ok = 1;
  return FTAR_PLANE_DONE;
}

static int dev_plane_restore(ftar_plane *pl, ftar_member *m) {
  (void)m;
  dev_plane *p = (dev_plane *)pl;
  if (!p->saved || !p->dirty) return 0;
  const tr_backend *be = p->st->be;
  int rc = be->copy(p->buf, p->st->save, p->n * sizeof(float));
  if (rc) /* buf may be half reduced: ftar_collective fails the member */
    return tr_fail(rc == TR_EDEVICE ? TR_EDEVICE : TR_EIO, "%s: restoring the input of an aborted collective: %s",
                   be->name, be->error());
  p->dirty = 0;
  return 0;
}

static void dev_plane_leave(ftar_plane *pl, ftar_member *m) {
  (void)m;
  comm_drop(((dev_plane *)pl)->st, 0);
}

/* --- entry --- */

static int has_comm(const tr_backend *be) {
  return be->comm_id && be->comm_create && be->comm_allreduce && be->comm_destroy;
}

int ftar_allreduce_dev(ftar_member *m, const tr_backend *be, float *buf, size_t n, ftar_op op, uint64_t seq,
                       ftar_result *res) {
  if (!m || !be || (!buf && n)) return tr_fail(TR_EINVAL, "ftar_allreduce_dev: bad arguments");
  if (be->host_memory) return ftar_allreduce(m, buf, n, op, seq, res);
  if (n > ((size_t)1 << 40)) return tr_fail(TR_EINVAL, "ftar_allreduce_dev: bad arguments");
  dev_state *st = dev_get(m, be);
  if (!st) return TR_ENOMEM;
  if (!has_comm(be)) { /* through the host and the TCP ring */
    if (n > st->host_cap) {
      float *h = realloc(st->host, n * sizeof(float));
      if (!h) return tr_fail(TR_ENOMEM, "ftar_allreduce_dev: out of memory for %zu floats", n);
      st->host = h;
      st->host_cap = n;
    }
    if (n && be->download(st->host, buf, n * sizeof(float)))
      return tr_fail(TR_EIO, "ftar_allreduce_dev: %s: download: %s", be->name, be->error());
    int rc = ftar_allreduce(m, st->host, n, op, seq, res);
    if (rc >= 0 && n && be->upload(buf, st->host, n * sizeof(float)))
      return tr_fail(TR_EIO, "ftar_allreduce_dev: %s: upload of the result: %s", be->name, be->error());
    return rc;
  }
  dev_plane p = {.base = {dev_plane_run, dev_plane_restore, dev_plane_leave}, .st = st, .buf = buf, .n = n, .op = op};
  return ftar_collective(m, &p.base, n, op, seq, res);
}
