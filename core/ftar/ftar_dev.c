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
 * Bucket mode (ftar_allreduce_dev_start, on the member's communication
 * thread, ftar_async.c): the same attempt, bucket after bucket from the
 * end of buf as the producer makes them final. Each bucket waits for the
 * producer's mark of the compute stream, then on the backend's
 * communication stream its input is copied (first attempt) and it is
 * all-reduced, watched to its end before the next one is queued; the
 * commit round follows the last bucket. An epoch that aborts while a
 * bucket waits for its producer ends the attempt there (as it stops the
 * ring), rather than after a collective queued into the dead epoch's
 * communicator. An abort copies back only the
 * buckets it touched (the producer may be writing the others), on the
 * communication stream behind the aborted collective.
 *
 * Not here: the NCCL calls (ext/cuda/comm.cu), the shared-memory
 * communicator (comm_emu.c), the communication thread (ftar_async.c).
 * Called by: the trainer, ftar_async.c, tests.
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

/* The device buffers of a collective of n floats: the input copy (at least
 * n) and the commit round's float. 0 or TR_ENOMEM. */
static int dev_buffers(dev_state *st, size_t n) {
  const tr_backend *be = st->be;
  if (n > st->save_cap) {
    if (st->save) be->free(st->save);
    st->save_cap = 0;
    st->save = be->alloc(n * sizeof(float));
    if (!st->save)
      return tr_fail(TR_ENOMEM, "ftar_allreduce_dev: %s: cannot allocate the input copy (%zu floats): %s", be->name, n,
                     be->error());
    st->save_cap = n;
  }
  if (!st->token && !(st->token = be->alloc(sizeof(float))))
    return tr_fail(TR_ENOMEM, "ftar_allreduce_dev: %s: out of device memory: %s", be->name, be->error());
  return 0;
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
static int comm_ready(dev_state *st, ftar_member *m, const ftar_run_info *ri, double t_end, int *fatal_rc,
                      char *why, size_t why_len) {
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
  int rc = dev_buffers(st, p->n);
  if (rc) return rc;
  if (!p->saved && p->n) {
    rc = be->copy(st->save, p->buf, p->n * sizeof(float));
    if (rc)
      return tr_fail(rc == TR_EDEVICE ? TR_EDEVICE : TR_EIO, "ftar_allreduce_dev: %s: saving the input: %s", be->name,
                     be->error());
    p->saved = 1;
  }
  int r = comm_ready(st, m, &ri, t_end, fatal_rc, why, why_len);
  if (r != FTAR_PLANE_DONE) return r;
  float scale = p->op == FTAR_MEAN ? 1.0f / (float)ri.n : 1.0f;
  p->dirty = 1;
  st->comm_ok = 0;
  rc = be->comm_allreduce(st->comm, p->buf, p->n, scale, ri.deadline);
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

/* --- the communicator plane in bucket mode (ftar_allreduce_dev_start) --- */

typedef struct {
  ftar_plane base;
  dev_state *st;
  float *buf;
  size_t n, B, nb; /* nb buckets of B floats from the end of buf (ftar_ring.c's geometry) */
  ftar_op op;
  const ftar_ready *rd;
  uint8_t *saved; /* per bucket: st->save holds its input (made by this call's first attempt) */
  uint8_t *dirty; /* per bucket: an all-reduce was queued on it since the last restore */
} bucket_plane;

static size_t bk_off(const bucket_plane *p, size_t b) {
  size_t hi = p->n - b * p->B;
  return hi > p->B ? hi - p->B : 0;
}
static size_t bk_len(const bucket_plane *p, size_t b) {
  size_t hi = p->n - b * p->B;
  return hi > p->B ? p->B : hi;
}

/* An attempt ends after work was queued: the communicator is aborted (the
 * queued collectives quit) so that the restore's copies can follow. */
static int bucket_failed(bucket_plane *p, int rc, int *fatal_rc) {
  comm_drop(p->st, 0);
  return comm_failed(rc, fatal_rc);
}

/* Reduces bucket b once its producer is done with it: on the communication
 * stream, after the producer's mark, the copy of its input (first attempt)
 * and its all-reduce, watched to its end (comm_wait) before the next bucket
 * is queued: at most one collective of the communicator is outstanding, as
 * in dev_plane_run, so an abort never finds a queue of collectives that
 * have not started. The compute stream runs on meanwhile: that is the
 * overlap. FTAR_PLANE_DONE (0) when reduced, else ABORT / FATAL with why,
 * or a negative code (the input copy could not be queued). */
static int bucket_queue(bucket_plane *p, ftar_member *m, size_t b, float scale, const ftar_run_info *ri,
                        double t_end, int *fatal_rc, char *why, size_t why_len) {
  dev_state *st = p->st;
  const tr_backend *be = st->be;
  size_t off = bk_off(p, b), len = bk_len(p, b);
  uint64_t ab = 0;
  int rc = ftar_member_ready_wait(m, p->rd, off, t_end, &ab);
  if (rc == 1) { /* the epoch is over: into its communicator now, this bucket would wait for the dead */
    snprintf(why, why_len, "epoch %llu aborts epoch %llu while bucket %zu waited for the producer",
             (unsigned long long)ab, (unsigned long long)ri->epoch, b);
    comm_drop(st, 0);
    return FTAR_PLANE_ABORT;
  }
  if (rc) {
    snprintf(why, why_len, "waiting for bucket %zu of the producer: %s", b, tr_error());
    comm_drop(st, 0);
    return plane_fatal(fatal_rc, rc);
  }
  const tr_mark *mark = p->rd->marks ? p->rd->marks[b] : NULL;
  if (!p->saved[b]) {
    rc = be->comm_copy(st->save + off, p->buf + off, len * sizeof(float), mark);
    if (rc) {
      comm_drop(st, 0);
      return tr_fail(rc == TR_EDEVICE ? TR_EDEVICE : TR_EIO, "ftar_allreduce_dev: %s: saving bucket %zu: %s",
                     be->name, b, be->error());
    }
    p->saved[b] = 1;
  }
  p->dirty[b] = 1;
  rc = be->comm_allreduce_async(st->comm, p->buf + off, len, scale, mark, ri->deadline);
  if (!rc) rc = be->comm_wait(st->comm, ri->deadline);
  if (rc) {
    snprintf(why, why_len, "bucket %zu of %zu, rank %d of %d: %s", b, p->nb, ri->rank, ri->n, be->error());
    return bucket_failed(p, rc, fatal_rc);
  }
  return FTAR_PLANE_DONE;
}

/* One attempt: every bucket as it becomes final, then (all reduced) the
 * commit round, as dev_plane_run. */
static int bucket_plane_run(ftar_plane *pl, ftar_member *m, uint64_t seq, double t_end, int *full, int *fatal_rc,
                            char *why, size_t why_len) {
  bucket_plane *p = (bucket_plane *)pl;
  dev_state *st = p->st;
  const tr_backend *be = st->be;
  ftar_run_info ri;
  ftar_member_run_info(m, &ri);
  *full = 0;
  int rc = dev_buffers(st, p->n);
  if (rc) return rc;
  int r = comm_ready(st, m, &ri, t_end, fatal_rc, why, why_len);
  if (r != FTAR_PLANE_DONE) return r;
  float scale = p->op == FTAR_MEAN ? 1.0f / (float)ri.n : 1.0f;
  st->comm_ok = 0;
  for (size_t b = 0; b < p->nb; b++) {
    r = bucket_queue(p, m, b, scale, &ri, t_end, fatal_rc, why, why_len);
    if (r != FTAR_PLANE_DONE) return r;
  }
  *full = 1;
  rc = be->comm_allreduce_async(st->comm, st->token, 1, 1.0f, NULL, ri.deadline);
  if (!rc) rc = be->comm_wait(st->comm, ri.deadline);
  if (rc) {
    snprintf(why, why_len, "seq %llu commit round, rank %d of %d: %s", (unsigned long long)seq, ri.rank, ri.n,
             be->error());
    return bucket_failed(p, rc, fatal_rc);
  }
  st->comm_ok = 1;
  return FTAR_PLANE_DONE;
}

/* Puts back the buckets that were touched (only those: the producer may
 * still be writing the others), on the communication stream, after the
 * aborted collectives, and waits for the copies. */
static int bucket_plane_restore(ftar_plane *pl, ftar_member *m) {
  bucket_plane *p = (bucket_plane *)pl;
  const tr_backend *be = p->st->be;
  int any = 0, rc = 0;
  for (size_t b = 0; b < p->nb && !rc; b++) {
    if (!p->dirty[b]) continue;
    size_t off = bk_off(p, b);
    rc = be->comm_copy(p->buf + off, p->st->save + off, bk_len(p, b) * sizeof(float), NULL);
    any = 1;
  }
  if (!rc && any) {
    ftar_run_info ri;
    ftar_member_run_info(m, &ri);
    rc = be->comm_wait(NULL, ri.deadline);
  }
  if (rc) /* buf may be half reduced: ftar_collective fails the member */
    return tr_fail(rc == TR_EDEVICE ? TR_EDEVICE : TR_EIO, "%s: restoring the input of an aborted collective: %s",
                   be->name, be->error());
  memset(p->dirty, 0, p->nb);
  return 0;
}

static void bucket_plane_leave(ftar_plane *pl, ftar_member *m) {
  (void)m;
  comm_drop(((bucket_plane *)pl)->st, 0);
}

int ftar_dev_has_overlap(const tr_backend *be) {
  return be->comm_id && be->comm_create && be->comm_allreduce && be->comm_destroy && be->comm_mark &&
         be->comm_mark_free && be->comm_copy && be->comm_allreduce_async && be->comm_wait;
}

ftar_plane *ftar_dev_plane_new(ftar_member *m, const tr_backend *be, float *buf, size_t n, ftar_op op, size_t bucket,
                               const ftar_ready *rd) {
  dev_state *st = dev_get(m, be);
  if (!st) return NULL;
  bucket_plane *p = calloc(1, sizeof *p);
  if (!p) goto oom;
  p->base = (ftar_plane){bucket_plane_run, bucket_plane_restore, bucket_plane_leave};
  p->st = st;
  p->buf = buf;
  p->n = n;
  p->op = op;
  p->rd = rd;
  p->B = bucket && bucket < n ? bucket : (n ? n : 1);
  p->nb = (n + p->B - 1) / p->B;
  p->saved = calloc(p->nb + 1, 2);
  if (!p->saved) goto oom;
  p->dirty = p->saved + p->nb;
  return &p->base;
oom:
  free(p);
  tr_fail(TR_ENOMEM, "ftar_allreduce_dev_start: out of memory");
  return NULL;
}

void ftar_dev_plane_free(ftar_plane *pl) {
  bucket_plane *p = (bucket_plane *)pl;
  if (!p) return;
  free(p->saved);
  free(p);
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
  /* as ftar_allreduce: the communication thread may be inside ftar_collective
   * on m, with this member's dev_state and communicator */
  if (ftar_async_busy(m)) return tr_fail(TR_ESTATE, "ftar_allreduce_dev: a started collective was not waited for");
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
