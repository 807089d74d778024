/* ftar_async.c — an all-reduce that runs while its buffer is still being
 * produced: ftar_allreduce_start / _ready / _wait (ftar.h), the way
 * PyTorch DDP reduces gradient buckets while backward runs.
 *
 * A member keeps one communication thread, started by its first
 * ftar_allreduce_start and joined by ftar_member_free. start hands it the
 * call; the thread waits until the first bucket (the last `bucket` floats
 * of buf) is final, then runs the ordinary collective (ftar_collective.c:
 * SYNC, GO, abort and redo, commit) on the ring plane in bucket mode: each
 * bucket is reduced as soon as the producer's ftar_allreduce_ready says it
 * is final, while the producer writes the rest (through the hierarchical
 * plane, ftar_hier.c, in waves of whole buckets: the cross-host part of a
 * wave runs while the producer writes the next). So the fault rules are
 * those of ftar_allreduce, for the whole buffer: a member lost mid-call
 * aborts the attempt, every bucket reduced so far is put back, and the
 * survivors redo all of them in the next epoch; every member returns the
 * same, complete result with the same contributors.
 *
 * The caller's thread stays the one that runs opts.quorum_wait: while the
 * collective waits for quorum on the communication thread, ftar_allreduce_
 * wait calls it on the caller's thread.
 *
 * A device call (ftar_allreduce_dev_start) runs the same way on the device
 * plane in bucket mode (ftar_dev.c): ready, on the producer's thread,
 * records a mark of the compute stream (be->comm_mark) for the buckets it
 * makes final, and the plane queues each bucket's all-reduce on the
 * backend's communication stream after that mark.
 *
 * Not here: moving bytes (ftar_ring.c, ftar_hier.c, ftar_dev.c), the control round
 * (ftar_collective.c). Called by: the worker's exchange hooks
 * (core/fleet/worker.c), ftar_bench.c, tests.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ftar.h"
#include "ftar_internal.h"
#include "ftar_member_internal.h"
#include "util.h"

enum { A_IDLE = 0, A_QUEUED, A_RUNNING, A_DONE };

/* The member whose communication thread this is (NULL on other threads). */
static _Thread_local ftar_member *tl_comm_of;

struct ftar_async {
  pthread_t th;
  int th_started;
  /* under m->mu */
  int state, quit;
  int qw_pending; /* the collective waits for quorum: the caller should run quorum_wait */
  /* the call: written by the caller before A_QUEUED, read by the thread */
  const tr_backend *be; /* a device call (ftar_allreduce_dev_start), NULL for host memory */
  tr_mark **marks;      /* a device call: the producer's mark per bucket (rd.marks) */
  float *buf;
  size_t n, bucket, nb;
  ftar_op op;
  uint64_t seq;
  ftar_ready rd;
  /* the outcome: written by the thread before A_DONE */
  int rc;
  ftar_result res;
  char err[512];
  double t0, t1;
};

/* Buckets of buf[0..n) that are final when buf[from..n) is (bucket 0 is
 * the last `bucket` floats; the first one, at offset 0, is final only
 * with everything). */
static size_t buckets_ready(const ftar_async *a, size_t from) {
  if (from == 0) return a->nb;
  size_t k = (a->n - from) / a->bucket;
  return k < a->nb ? k : a->nb;
}

/* --- the communication thread --- */

static void run_call(ftar_member *m, ftar_async *a) {
  a->t0 = tr_now();
  a->err[0] = 0;
  ftar_plane *pl = a->be ? ftar_dev_plane_new(m, a->be, a->buf, a->n, a->op, a->bucket, &a->rd)
                        : ftar_host_plane_new(a->buf, a->n, a->op, a->bucket, &a->rd);
  if (!pl) {
    memset(&a->res, 0, sizeof a->res);
    a->rc = tr_fail(TR_ENOMEM, "ftar_allreduce_start: out of memory");
  } else {
    a->rc = ftar_collective(m, pl, a->n, a->op, a->seq, &a->res);
    if (a->be) ftar_dev_plane_free(pl);
    else ftar_host_plane_free(pl);
  }
  if (a->rc < 0) snprintf(a->err, sizeof a->err, "%s", tr_error());
  a->t1 = tr_now();
}

static void *async_main(void *arg) {
  ftar_member *m = arg;
  ftar_async *a = m->async;
  tl_comm_of = m;
  sigset_t ss;
  sigemptyset(&ss);
  sigaddset(&ss, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &ss, NULL);
  pthread_mutex_lock(&m->mu);
  for (;;) {
    while (!a->quit && a->state != A_QUEUED) pthread_cond_wait(&m->cv, &m->mu);
    if (a->quit) break;
    a->state = A_RUNNING;
    /* SYNC once the first bucket exists: the group's ring then starts
     * with every member inside its backward, not before its forward (an
     * empty buffer has no bucket to wait for: nb is 0) */
    while (!a->quit && !m->failed && a->nb && buckets_ready(a, atomic_load(&a->rd.from)) == 0)
      ftar_cv_wait(m, tr_now() + 1);
    pthread_mutex_unlock(&m->mu);
    run_call(m, a);
    pthread_mutex_lock(&m->mu);
    a->state = A_DONE;
    pthread_cond_broadcast(&m->cv);
  }
  pthread_mutex_unlock(&m->mu);
  return NULL;
}

/* --- what the member's other files call --- */

void ftar_quorum_wait(ftar_member *m) {
  ftar_async *a = m->async;
  if (a && tl_comm_of == m) {
    pthread_mutex_lock(&m->mu);
    a->qw_pending = 1;
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->mu);
    return;
  }
  if (m->o.quorum_wait) m->o.quorum_wait(m->o.quorum_ud);
}

int ftar_member_ready_wait(ftar_member *m, const ftar_ready *rd, size_t off, double t_end, uint64_t *abort_ep) {
  pthread_mutex_lock(&m->mu);
  /* an epoch that aborts run_ep's collectives stops the wait, as it stops
   * the ring (ftar_ring.c's ctl_check) */
  while (!m->failed && m->abort_ep <= m->run_ep && atomic_load_explicit(&rd->from, memory_order_acquire) > off &&
         tr_now() < t_end)
    ftar_cv_wait(m, t_end);
  int failed = m->failed, ready = atomic_load_explicit(&rd->from, memory_order_acquire) <= off;
  uint64_t ab = m->abort_ep > m->run_ep ? m->abort_ep : 0;
  pthread_mutex_unlock(&m->mu);
  if (failed) return tr_fail(failed, "ftar: %s", m->fail_msg);
  if (ready) return 0;
  if (ab) {
    *abort_ep = ab;
    return 1;
  }
  return tr_fail(FTAR_ETIMEOUT, "ftar: the buffer was not final within %.1f s", m->o.timeout);
}

/* Frees a device call's marks (a mark covers a run of buckets: once each). */
static void marks_free(ftar_async *a) {
  if (!a->marks) return;
  for (size_t b = 0; b < a->nb; b++)
    if (a->marks[b] && (b == 0 || a->marks[b] != a->marks[b - 1])) a->be->comm_mark_free(a->marks[b]);
  free(a->marks);
  a->marks = NULL;
  a->rd.marks = NULL;
}

int ftar_async_busy(ftar_member *m) {
  ftar_async *a = m->async;
  if (!a) return 0;
  pthread_mutex_lock(&m->mu);
  int busy = a->state != A_IDLE;
  pthread_mutex_unlock(&m->mu);
  return busy;
}

int ftar_async_inflight(ftar_member *m) {
  ftar_async *a = m->async;
  if (!a) return 0;
  pthread_mutex_lock(&m->mu);
  int r = a->state == A_QUEUED || a->state == A_RUNNING;
  pthread_mutex_unlock(&m->mu);
  return r;
}

void ftar_async_free(ftar_member *m) {
  ftar_async *a = m->async;
  if (!a) return;
  if (a->th_started) {
    pthread_mutex_lock(&m->mu);
    int busy = a->state == A_QUEUED || a->state == A_RUNNING;
    a->quit = 1;
    pthread_cond_broadcast(&m->cv);
    pthread_mutex_unlock(&m->mu);
    /* a collective in flight fails (input restored) and the thread ends */
    if (busy) ftar_member_fail(m, FTAR_ECOORD, "the member was freed with a collective in flight");
    pthread_join(a->th, NULL);
  }
  marks_free(a);
  free(a);
  m->async = NULL;
}

/* --- ftar.h --- */

static int async_get(ftar_member *m, ftar_async **out) {
  if (!m->async) {
    ftar_async *a = calloc(1, sizeof *a);
    if (!a) return tr_fail(TR_ENOMEM, "ftar_allreduce_start: out of memory");
    m->async = a;
  }
  ftar_async *a = m->async;
  if (!a->th_started) {
    if (pthread_create(&a->th, NULL, async_main, m) != 0)
      return tr_fail(TR_ENOMEM, "ftar_allreduce_start: cannot start the communication thread");
    a->th_started = 1;
  }
  *out = a;
  return 0;
}

/* Hands the call to the communication thread (be: a device call). */
static int queue_call(ftar_member *m, const tr_backend *be, float *buf, size_t n, ftar_op op, uint64_t seq,
                      size_t bucket) {
  if (ftar_async_busy(m)) return tr_fail(TR_ESTATE, "ftar_allreduce_start: a collective is in flight");
  ftar_async *a = NULL;
  int rc = async_get(m, &a);
  if (rc) return rc;
  size_t B = bucket && bucket < n ? bucket : (n ? n : 1), nb = (n + B - 1) / B;
  tr_mark **marks = NULL;
  if (be && !(marks = calloc(nb + 1, sizeof *marks))) return tr_fail(TR_ENOMEM, "ftar_allreduce_start: out of memory");
  pthread_mutex_lock(&m->mu);
  a->be = be;
  a->marks = a->rd.marks = marks;
  a->buf = buf;
  a->n = n;
  a->op = op;
  a->seq = seq;
  a->bucket = B;
  a->nb = nb;
  a->qw_pending = 0;
  atomic_store(&a->rd.from, n);
  a->state = A_QUEUED;
  pthread_cond_broadcast(&m->cv);
  pthread_mutex_unlock(&m->mu);
  return 0;
}

int ftar_allreduce_start(ftar_member *m, float *buf, size_t n, ftar_op op, uint64_t seq, size_t bucket) {
  if (!m || (!buf && n) || (op != FTAR_SUM && op != FTAR_MEAN))
    return tr_fail(TR_EINVAL, "ftar_allreduce_start: bad arguments");
  return queue_call(m, NULL, buf, n, op, seq, bucket);
}

int ftar_dev_overlaps(const tr_backend *be) { return be && (be->host_memory || ftar_dev_has_overlap(be)); }

int ftar_allreduce_dev_start(ftar_member *m, const tr_backend *be, float *buf, size_t n, ftar_op op, uint64_t seq,
                             size_t bucket) {
  if (!m || !be || (!buf && n) || (op != FTAR_SUM && op != FTAR_MEAN) || n > ((size_t)1 << 40))
    return tr_fail(TR_EINVAL, "ftar_allreduce_dev_start: bad arguments");
  if (be->host_memory) return queue_call(m, NULL, buf, n, op, seq, bucket);
  if (!ftar_dev_has_overlap(be))
    return tr_fail(TR_EINVAL, "ftar_allreduce_dev_start: the %s backend has no overlapped collectives", be->name);
  return queue_call(m, be, buf, n, op, seq, bucket);
}

/* A device call: bucket k_old .. k_new - 1 become final; the compute
 * stream's mark after which they are, in marks[] before `from` says so (a
 * mark that cannot be recorded: the stream is synchronised instead). */
static void mark_buckets(ftar_async *a, size_t k_old, size_t k_new) {
  tr_mark *mk = NULL;
  if (a->be->comm_mark(&mk)) {
    mk = NULL;
    (void)a->be->sync(); /* a failure here fails the collectives that follow too */
  }
  for (size_t b = k_old; b < k_new; b++) a->marks[b] = mk;
}

void ftar_allreduce_ready(ftar_member *m, size_t from) {
  ftar_async *a = m ? m->async : NULL;
  if (!a) return;
  size_t old = atomic_load_explicit(&a->rd.from, memory_order_relaxed); /* we are its only writer */
  if (from >= old) return;
  size_t k_old = buckets_ready(a, old), k_new = buckets_ready(a, from);
  if (a->marks && k_new > k_old) mark_buckets(a, k_old, k_new);
  atomic_store_explicit(&a->rd.from, from, memory_order_release);
  if (k_new == k_old) return;
  /* a bucket became final: wake the ring, or the thread waiting for the first one */
  pthread_mutex_lock(&m->mu);
  pthread_cond_broadcast(&m->cv);
  pthread_mutex_unlock(&m->mu);
  ftar_wake_fd(m->wake[1]);
}

int ftar_allreduce_wait(ftar_member *m, ftar_result *res, double *comm_s) {
  ftar_async *a = m ? m->async : NULL;
  if (!a || !ftar_async_busy(m)) return tr_fail(TR_ESTATE, "ftar_allreduce_wait: no collective was started");
  ftar_allreduce_ready(m, 0);
  pthread_mutex_lock(&m->mu);
  while (a->state != A_DONE) {
    if (a->qw_pending) {
      a->qw_pending = 0;
      pthread_mutex_unlock(&m->mu);
      if (m->o.quorum_wait) m->o.quorum_wait(m->o.quorum_ud);
      pthread_mutex_lock(&m->mu);
      continue;
    }
    ftar_cv_wait(m, tr_now() + 1);
  }
  a->state = A_IDLE;
  pthread_mutex_unlock(&m->mu);
  marks_free(a);
  if (res) *res = a->res;
  if (comm_s) *comm_s = a->t1 - a->t0;
  if (a->rc < 0) return tr_fail(a->rc, "%s", a->err);
  return a->rc;
}
