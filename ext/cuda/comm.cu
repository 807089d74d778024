/* comm.cu — the NCCL communicators of FTAR's device data plane: the comm_*
 * functions of the CUDA backend's table (core/tensor/include/backend.h), one communicator
 * per membership epoch (core/ftar/ftar_dev.c creates and drops them).
 *
 * Called through backend.cu's wrappers, which make the device current, by
 * the training thread (the one that drives the compute stream) for
 * comm_allreduce, and by FTAR's communication thread for the overlapped
 * all-reduces (comm_allreduce_async / comm_wait: buckets of gradients
 * reduced while backward runs); either may create and destroy
 * communicators, one at a time. Nothing here blocks without a bound:
 *   - every communicator is non-blocking (config.blocking = 0): calls may
 *     return ncclInProgress, and then the communicator's state
 *     (ncclCommGetAsyncError) is polled until it is not, before any other
 *     NCCL call or any other work is queued on the stream;
 *   - creation polls until ready or `timeout`, then aborts. Connections are
 *     made then, not by the first all-reduce: NCCL_RUNTIME_CONNECT=0 (set
 *     at the first id or communicator unless the environment says
 *     otherwise) connects every peer during init, and a one-float warm-up
 *     all-reduce on the communication stream (not behind the compute
 *     stream's work), bounded by what is left of `timeout`, runs the first
 *     collective's set-up, so that no deadline below pays for either;
 *   - an all-reduce is cut into chunks of CHUNK_FLOATS, each queued on the
 *     compute stream between two events, one after the other; a watchdog
 *     polls the chunk's end event and the communicator's state: an
 *     asynchronous error (a peer's process exited, a network error) or a
 *     chunk not done `deadline` seconds after it started on the device (its
 *     start event completed) aborts the communicator and returns TC_EIO. So
 *     the deadline means "no progress for `deadline` s", as on the CPU ring,
 *     whatever the size. The start event keeps the compute queued before
 *     the collective out of the first chunk's deadline; waiting for the
 *     stream to get there is bounded too (START_SLACK_S or 10 x deadline);
 *   - an overlapped all-reduce (comm_allreduce_async) is queued the same way
 *     on the communication stream, after cudaStreamWaitEvent on the
 *     caller's mark (an event the training thread recorded on the compute
 *     stream once the bucket's last gradient kernel was queued), its chunks'
 *     events kept; comm_wait watches them one by one as above (a chunk's
 *     deadline runs from its start event, so the compute stream's backward
 *     before the mark is not counted), then drains the communication stream
 *     (the scaling kernel, copies). After an abort it still drains it (the
 *     aborted kernels quit), bounded, so that the caller may copy the
 *     input back behind it; a stream that does not drain loses the device;
 *   - aborting (ncclCommAbort, which NCCL leaves blocking even for a
 *     non-blocking communicator, and which has been seen to hang) runs on a
 *     helper thread and is waited for ABORT_S: past it the device is
 *     declared lost (TC_EDEVICE, backend.cu) and the worker is replaced;
 *   - a CUDA error that corrupts the context (an illegal address, ...), met
 *     by the watchdog or probed after an NCCL error, is TC_EDEVICE too: a
 *     retry in a new epoch could only fail again;
 *   - an aborted communicator fails every call at once. Destroying one
 *     aborts it, except at a clean shutdown (finalize = 1: every rank is
 *     destroying its own), where it is finalized (ncclCommFinalize, polled,
 *     bounded by FINALIZE_S, aborted past it) and destroyed: finalizing
 *     waits for every rank, so an epoch left because a rank died must not.
 * The id's bootstrap root: ncclGetUniqueId starts a thread (with a listening
 * socket) in the process that makes the id, which exits only once every
 * rank of the communicator has checked in. An epoch that aborts before all
 * ranks joined leaves it waiting for ever. Ids made here whose communicator
 * did not come up here are counted; at MAX_OPEN_ROOTS the next id is
 * refused with TC_EDEVICE, so the worker is replaced (freeing them) before
 * they pile up.
 * Waits poll: a few yields, then sleeps growing to 1 ms.
 * The mean's division is a multiplication by `scale` after the sum, in a
 * kernel of this file (the ring of core/ftar/ftar.c divides: bits may differ).
 *
 * Not here: the id's transport (FTAR's coordinator), the decision what
 * survivors return and the buckets (core/ftar/ftar_collective.c,
 * ftar_dev.c), the marks and the communication stream (backend.cu).
 */
#include <nccl.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_internal.h"

static_assert(sizeof(ncclUniqueId) == TR_COMM_ID_BYTES, "backend.h's id is an ncclUniqueId");

#define DEFAULT_S 60.0     /* a timeout or deadline <= 0 */
#define START_SLACK_S 60.0 /* least bound on the stream reaching a collective */
#define FINALIZE_S 10.0    /* bound on finalizing a healthy communicator at shutdown */
#define ABORT_S 20.0       /* bound on ncclCommAbort; past it the device is lost */
#define CHUNK_FLOATS ((size_t)8 << 20) /* 32 MiB: the unit of progress the deadline watches */
#define MAX_OPEN_ROOTS 16  /* bootstrap roots left waiting by aborted epochs before the process is replaced */

/* A chunk of an overlapped all-reduce queued on the communication stream
 * and not waited for yet: its start and end events. */
typedef struct {
  cudaEvent_t start, done;
  size_t n;
} pend_op;

struct tr_comm {
  ncclComm_t comm; /* NULL once aborted */
  int nranks, rank;
  int aborted;
  cudaEvent_t ev_start, ev_done;
  float *warm;   /* device: the warm-up float */
  pend_op *pend; /* overlapped chunks queued since the last tc_comm_wait (events kept for reuse) */
  int npend, cap_pend;
  char why[384]; /* why it was aborted, repeated by later calls */
};

/* --- small helpers --- */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* One polling step: yield 32 times, then sleep 20 us doubling to 1 ms. */
static void poll_pause(int *k) {
  if (*k < 32) {
    (*k)++;
    sched_yield();
    return;
  }
  long ns = 20000L << (*k - 32 < 6 ? *k - 32 : 6);
  if (ns > 1000000L) ns = 1000000L;
  (*k)++;
  struct timespec ts = {0, ns};
  nanosleep(&ts, NULL);
}

/* NCCL's last error message, or a placeholder. */
static const char *last_error(void) {
  const char *last = ncclGetLastError(NULL);
  return last && *last ? last : "no detail; NCCL_DEBUG=WARN says more";
}

/* Usage errors (a duplicate GPU, mismatched versions or arguments) fail
 * every retry the same way: TC_EINVAL; the rest TC_EIO. */
static int nccl_code(ncclResult_t r) { return r == ncclInvalidUsage || r == ncclInvalidArgument ? TC_EINVAL : TC_EIO; }

/* "file:line: what: <NCCL's string> (<NCCL's last error>)". */
static int nccl_fail(ncclResult_t r, const char *what, const char *file, int line) {
  return tc_fail(nccl_code(r), "%s:%d: %s: %s (%s)", file, line, what, ncclGetErrorString(r), last_error());
}
#define NCCL_FAIL(r, what) nccl_fail((r), (what), __FILE__, __LINE__)

/* Polls the communicator's state until it is not ncclInProgress or t_end
 * passes (then ncclInProgress). */
static ncclResult_t wait_state(ncclComm_t comm, double t_end) {
  int k = 0;
  for (;;) {
    ncclResult_t st = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm, &st);
    if (r != ncclSuccess) return r;
    if (st != ncclInProgress) return st;
    if (now_s() > t_end) return ncclInProgress;
    poll_pause(&k);
  }
}

/* NCCL_RUNTIME_CONNECT=0 before NCCL reads it (the first id or init),
 * unless the environment already chose. */
static void set_connect_at_init(void) { setenv("NCCL_RUNTIME_CONNECT", "0", 0); }
static void connect_at_init(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, set_connect_at_init);
}

/* --- aborting, bounded --- */

typedef struct {
  ncclComm_t comm;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int done, refs; /* refs: the helper and the waiter; the last one frees */
} abort_job;

static void abort_job_put(abort_job *j) {
  pthread_mutex_lock(&j->mu);
  int last = --j->refs == 0;
  pthread_mutex_unlock(&j->mu);
  if (!last) return;
  pthread_cond_destroy(&j->cv);
  pthread_mutex_destroy(&j->mu);
  free(j);
}

static void *abort_main(void *arg) {
  abort_job *j = (abort_job *)arg;
  (void)tc_set_device(); /* NCCL frees device memory: the right device, even if lost */
  (void)ncclCommAbort(j->comm);
  pthread_mutex_lock(&j->mu);
  j->done = 1;
  pthread_cond_signal(&j->cv);
  pthread_mutex_unlock(&j->mu);
  abort_job_put(j);
  return NULL;
}

/* ncclCommAbort(comm) on a helper thread, waited for at most ABORT_S: 0, or
 * TC_EDEVICE (the device declared lost; the helper is left behind). */
static int abort_bounded(ncclComm_t comm) {
  abort_job *j = (abort_job *)calloc(1, sizeof *j);
  pthread_condattr_t ca;
  pthread_t th;
  pthread_attr_t ta;
  if (!j || pthread_condattr_init(&ca) != 0) {
    free(j);
    (void)ncclCommAbort(comm); /* no memory for a helper: unbounded, as before */
    return TC_OK;
  }
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_mutex_init(&j->mu, NULL);
  pthread_cond_init(&j->cv, &ca);
  pthread_condattr_destroy(&ca);
  j->comm = comm;
  j->refs = 2;
  pthread_attr_init(&ta);
  pthread_attr_setdetachstate(&ta, PTHREAD_CREATE_DETACHED);
  int started = pthread_create(&th, &ta, abort_main, j) == 0;
  pthread_attr_destroy(&ta);
  if (!started) {
    j->refs = 1;
    abort_job_put(j);
    (void)ncclCommAbort(comm);
    return TC_OK;
  }
  struct timespec end;
  clock_gettime(CLOCK_MONOTONIC, &end);
  end.tv_sec += (time_t)ABORT_S;
  pthread_mutex_lock(&j->mu);
  while (!j->done && pthread_cond_timedwait(&j->cv, &j->mu, &end) == 0) {
  }
  int done = j->done;
  pthread_mutex_unlock(&j->mu);
  abort_job_put(j);
  if (done) return TC_OK;
  return tc_device_lost("ncclCommAbort did not return within %.0f s", ABORT_S);
}

/* Aborts the communicator: c is dead from now on. Returns TC_EIO with the
 * message, or TC_EDEVICE when the abort hung or the context is corrupted. */
__attribute__((format(printf, 2, 3))) static int comm_die(tr_comm *c, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->why, sizeof c->why, fmt, ap);
  va_end(ap);
  int rc = c->comm ? abort_bounded(c->comm) : TC_OK; /* the queued collective's kernels quit */
  c->comm = NULL;
  c->aborted = 1;
  if (!rc) rc = tc_probe(); /* an NCCL error may be a CUDA one that corrupted the context */
  if (rc) {
    char lost[512];
    snprintf(lost, sizeof lost, "%s", tc_last_error());
    return tc_fail(TC_EDEVICE, "%s; %s", c->why, lost);
  }
  return tc_fail(TC_EIO, "%s", c->why);
}

/* comm_die for a CUDA error e met while watching: a context-corrupting one
 * loses the device first. */
static int cuda_die(tr_comm *c, cudaError_t e, const char *what) {
  if (tc_sticky(e)) tc_device_lost("%s: %s", what, cudaGetErrorString(e));
  else (void)cudaGetLastError();
  return comm_die(c, "NCCL all-reduce (rank %d of %d): %s: %s", c->rank, c->nranks, what, cudaGetErrorString(e));
}

/* --- bootstrap roots of the ids made here --- */

static pthread_mutex_t roots_mu = PTHREAD_MUTEX_INITIALIZER;
static ncclUniqueId g_roots[MAX_OPEN_ROOTS]; /* ids made here whose communicator did not come up here */
static int g_nroots;

/* Records a new root; TC_EDEVICE when too many are open already. */
static int root_open(const ncclUniqueId *id) {
  pthread_mutex_lock(&roots_mu);
  int n = g_nroots;
  if (n < MAX_OPEN_ROOTS) g_roots[g_nroots++] = *id;
  pthread_mutex_unlock(&roots_mu);
  if (n < MAX_OPEN_ROOTS) return TC_OK;
  return tc_fail(TC_EDEVICE,
                 "%d NCCL bootstrap threads (each with a listening socket) wait for ever for ranks of aborted epochs "
                 "that never joined; this process must be replaced to free them",
                 n);
}

/* The communicator of id came up: every rank checked in with its root. */
static void root_done(const ncclUniqueId *id) {
  pthread_mutex_lock(&roots_mu);
  for (int i = 0; i < g_nroots; i++)
    if (memcmp(&g_roots[i], id, sizeof *id) == 0) {
      g_roots[i] = g_roots[--g_nroots];
      break;
    }
  pthread_mutex_unlock(&roots_mu);
}

namespace {
/* p[i] *= s; p is (n) */
__global__ void comm_scale_kernel(float *p, size_t n, float s) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] *= s;
}
} // namespace

/* --- one watched collective --- */

/* Watches a collective queued between events start and done: done, or the
 * communicator aborted (comm_die's code) when the stream does not reach it
 * by start_limit, a peer fails, or it is not done `deadline` s after it
 * started on the device. */
static int watch(tr_comm *c, cudaEvent_t start, cudaEvent_t done, size_t n, double deadline, double start_limit,
                 double t0) {
  ncclResult_t st = ncclSuccess, r;
  double t_dl = 0; /* the deadline, once the chunk started on the device */
  int k = 0;
  for (;;) {
    cudaError_t e = cudaEventQuery(done);
    if (e == cudaSuccess) return TC_OK;
    if (e != cudaErrorNotReady) return cuda_die(c, e, "waiting for it (cudaEventQuery)");
    r = ncclCommGetAsyncError(c->comm, &st);
    if (r != ncclSuccess || (st != ncclSuccess && st != ncclInProgress))
      return comm_die(c, "NCCL all-reduce (rank %d of %d): %s (%s): a peer failed or left", c->rank, c->nranks,
                      ncclGetErrorString(r != ncclSuccess ? r : st), last_error());
    double now = now_s();
    if (t_dl == 0) {
      e = cudaEventQuery(start);
      if (e == cudaSuccess) {
        t_dl = now + deadline;
      } else if (e != cudaErrorNotReady) {
        return cuda_die(c, e, "waiting for it to start (cudaEventQuery)");
      } else if (now > start_limit) {
        return comm_die(c, "NCCL all-reduce (rank %d of %d): the stream did not reach it within %.0f s", c->rank,
                        c->nranks, start_limit - t0);
      }
    } else if (now > t_dl) {
      return comm_die(c, "NCCL all-reduce of %zu floats (rank %d of %d): no progress for %.2f s: a peer died or "
                      "stalled",
                      n, c->rank, c->nranks, deadline);
    }
    poll_pause(&k);
  }
}

/* Queues ncclAllReduce of buf[0..n) on stream between events start and
 * done: 0, or the communicator aborted (comm_die's code). */
static int queue_between(tr_comm *c, float *buf, size_t n, cudaStream_t stream, cudaEvent_t start, cudaEvent_t done,
                         double deadline) {
  cudaError_t e = cudaEventRecord(start, stream);
  if (e != cudaSuccess) return cuda_die(c, e, "queueing the all-reduce (cudaEventRecord)");
  double t0 = now_s();
  ncclResult_t r = ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, c->comm, stream);
  if (r == ncclInProgress) r = wait_state(c->comm, t0 + deadline);
  if (r == ncclInProgress)
    return comm_die(c, "NCCL all-reduce (rank %d of %d): not queued within %.2f s", c->rank, c->nranks, deadline);
  if (r != ncclSuccess)
    return comm_die(c, "NCCL all-reduce (rank %d of %d): ncclAllReduce: %s (%s)", c->rank, c->nranks,
                    ncclGetErrorString(r), last_error());
  e = cudaEventRecord(done, stream);
  if (e != cudaSuccess) return cuda_die(c, e, "queueing the all-reduce (cudaEventRecord)");
  return TC_OK;
}

/* All-reduces buf[0..n) (n <= CHUNK_FLOATS) in place on stream, watched
 * (see watch). */
static int allreduce_watched(tr_comm *c, float *buf, size_t n, cudaStream_t stream, double deadline,
                             double start_limit) {
  double t0 = now_s();
  int rc = queue_between(c, buf, n, stream, c->ev_start, c->ev_done, deadline);
  return rc ? rc : watch(c, c->ev_start, c->ev_done, n, deadline, start_limit, t0);
}

/* buf[0..n) *= scale on stream (nothing for scale 1). */
static int scale_on(float *buf, size_t n, float scale, cudaStream_t stream) {
  if (scale == 1.0f || !n) return TC_OK;
  int blocks = (int)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
  comm_scale_kernel<<<blocks, 256, 0, stream>>>(buf, n, scale);
  return tc_check(cudaGetLastError(), "scaling the all-reduce's result");
}

/* Settles a non-blocking communicator before new work: 0, or aborted. */
static int settle(tr_comm *c, double deadline) {
  ncclResult_t st = ncclSuccess;
  ncclResult_t r = ncclCommGetAsyncError(c->comm, &st);
  if (r == ncclSuccess && st == ncclInProgress) st = wait_state(c->comm, now_s() + deadline);
  if (r != ncclSuccess || st != ncclSuccess)
    return comm_die(c, "NCCL communicator (rank %d of %d) failed before the all-reduce: %s", c->rank, c->nranks,
                    ncclGetErrorString(r != ncclSuccess ? r : st));
  return TC_OK;
}

/* --- the table's functions --- */

int tc_comm_id(uint8_t id[TR_COMM_ID_BYTES]) {
  connect_at_init();
  ncclUniqueId uid;
  ncclResult_t r = ncclGetUniqueId(&uid);
  if (r != ncclSuccess) return NCCL_FAIL(r, "ncclGetUniqueId");
  int rc = root_open(&uid);
  if (rc) return rc; /* (this id's root is one more; the process is replaced now) */
  memcpy(id, &uid, sizeof uid);
  return TC_OK;
}

/* Frees c's host and device state; aborts its communicator if any (bounded). */
static int comm_free(tr_comm *c) {
  int rc = c->comm ? abort_bounded(c->comm) : TC_OK;
  c->comm = NULL;
  if (c->ev_start) (void)cudaEventDestroy(c->ev_start);
  if (c->ev_done) (void)cudaEventDestroy(c->ev_done);
  if (c->warm) (void)cudaFree(c->warm);
  for (int i = 0; i < c->cap_pend; i++) {
    if (c->pend[i].start) (void)cudaEventDestroy(c->pend[i].start);
    if (c->pend[i].done) (void)cudaEventDestroy(c->pend[i].done);
  }
  free(c->pend);
  free(c);
  return rc;
}

int tc_comm_create(tr_comm **out, const uint8_t id[TR_COMM_ID_BYTES], int nranks, int rank, double timeout) {
  *out = NULL;
  if (nranks < 1 || rank < 0 || rank >= nranks) return tc_fail(TC_EINVAL, "NCCL communicator: rank %d of %d", rank, nranks);
  if (!(timeout > 0)) timeout = DEFAULT_S;
  connect_at_init();
  tr_comm *c = (tr_comm *)calloc(1, sizeof *c);
  if (!c) return tc_fail(TC_ENOMEM, "NCCL communicator: out of memory");
  c->nranks = nranks;
  c->rank = rank;
  double t_end = now_s() + timeout;
  ncclUniqueId uid;
  memcpy(&uid, id, sizeof uid);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  int rc;
  ncclResult_t r = ncclCommInitRankConfig(&c->comm, nranks, uid, rank, &cfg);
  if (r != ncclSuccess && r != ncclInProgress) {
    rc = NCCL_FAIL(r, "ncclCommInitRankConfig");
    goto error;
  }
  r = wait_state(c->comm, t_end);
  if (r == ncclInProgress) {
    rc = tc_fail(TC_EIO, "NCCL communicator (rank %d of %d) not ready within %.1f s: a rank did not join", rank,
                 nranks, timeout);
    goto error;
  }
  if (r != ncclSuccess) { /* ncclInvalidUsage: e.g. two ranks on one GPU, which no retry mends */
    rc = NCCL_FAIL(r, "creating the NCCL communicator (ncclCommInitRankConfig)");
    goto error;
  }
  root_done(&uid); /* every rank checked in: the root (here or elsewhere) is gone */
  if ((rc = tc_check(cudaEventCreateWithFlags(&c->ev_start, cudaEventDisableTiming), "cudaEventCreateWithFlags")) ||
      (rc = tc_check(cudaEventCreateWithFlags(&c->ev_done, cudaEventDisableTiming), "cudaEventCreateWithFlags")) ||
      (rc = tc_check(cudaMalloc(&c->warm, sizeof(float)), "cudaMalloc (the warm-up float)")) ||
      (rc = tc_check(cudaMemsetAsync(c->warm, 0, sizeof(float), tc_comm_stream()), "cudaMemsetAsync")))
    goto error;
  { /* the first collective's set-up, inside the creation's bound */
    double left = t_end - now_s();
    if (left < 1.0) left = 1.0;
    rc = allreduce_watched(c, c->warm, 1, tc_comm_stream(), left, now_s() + left);
    if (rc) {
      char why[512];
      snprintf(why, sizeof why, "%s", tc_last_error());
      rc = tc_fail(rc, "NCCL communicator (rank %d of %d): the warm-up all-reduce: %s", rank, nranks, why);
      goto error;
    }
  }
  *out = c;
  return TC_OK;
error: {
  char why[512];
  snprintf(why, sizeof why, "%s", tc_last_error());
  int rc2 = comm_free(c); /* a partly initialised communicator included */
  if (rc2) return tc_fail(rc2, "%s; %s", why, tc_last_error());
  return tc_fail(rc, "%s", why);
}
}

int tc_comm_allreduce(tr_comm *c, float *buf, size_t n, float scale, double deadline) {
  if (!c || (!buf && n)) return tc_fail(TC_EINVAL, "NCCL all-reduce: bad arguments");
  if (c->aborted) return tc_fail(TC_EIO, "NCCL communicator is aborted: %s", c->why);
  if (!(deadline > 0)) deadline = DEFAULT_S;
  int rc = settle(c, deadline);
  if (rc) return rc;
  double start_limit = now_s() + (START_SLACK_S > 10 * deadline ? START_SLACK_S : 10 * deadline);
  size_t off = 0;
  do { /* one chunk at least: n = 0 is still a collective every rank takes part in */
    size_t len = n - off < CHUNK_FLOATS ? n - off : CHUNK_FLOATS;
    rc = allreduce_watched(c, buf + off, len, tc_stream(), deadline, start_limit);
    if (rc) return rc;
    off += len;
    start_limit = now_s() + START_SLACK_S; /* the next chunk follows at once: the stream is there */
  } while (off < n);
  return scale_on(buf, n, scale, tc_stream());
}

/* --- overlapped all-reduces on the communication stream --- */

/* The next pending slot of c, its events made on first use: NULL with
 * error() set when out of memory or events. */
static pend_op *pend_push(tr_comm *c) {
  if (c->npend == c->cap_pend) {
    int cap = c->cap_pend ? 2 * c->cap_pend : 16;
    pend_op *np = (pend_op *)realloc(c->pend, (size_t)cap * sizeof *np);
    if (!np) {
      tc_fail(TC_ENOMEM, "NCCL all-reduce: out of memory");
      return NULL;
    }
    memset(np + c->cap_pend, 0, (size_t)(cap - c->cap_pend) * sizeof *np);
    c->pend = np;
    c->cap_pend = cap;
  }
  pend_op *o = &c->pend[c->npend];
  if (!o->start && tc_check(cudaEventCreateWithFlags(&o->start, cudaEventDisableTiming), "cudaEventCreateWithFlags"))
    return NULL;
  if (!o->done && tc_check(cudaEventCreateWithFlags(&o->done, cudaEventDisableTiming), "cudaEventCreateWithFlags"))
    return NULL;
  c->npend++;
  return o;
}

int tc_comm_allreduce_async(tr_comm *c, float *buf, size_t n, float scale, const tr_mark *after, double deadline) {
  if (!c || (!buf && n)) return tc_fail(TC_EINVAL, "NCCL all-reduce: bad arguments");
  if (c->aborted) return tc_fail(TC_EIO, "NCCL communicator is aborted: %s", c->why);
  if (!(deadline > 0)) deadline = DEFAULT_S;
  int rc = settle(c, deadline);
  if (rc) return rc;
  cudaStream_t s = tc_comm_stream();
  if (after) {
    cudaError_t e = cudaStreamWaitEvent(s, (cudaEvent_t)(void *)after, 0);
    if (e != cudaSuccess) return cuda_die(c, e, "ordering it after the compute stream (cudaStreamWaitEvent)");
  }
  size_t off = 0;
  do { /* one chunk at least, as tc_comm_allreduce */
    size_t len = n - off < CHUNK_FLOATS ? n - off : CHUNK_FLOATS;
    pend_op *o = pend_push(c);
    if (!o) return comm_die(c, "NCCL all-reduce (rank %d of %d): %s", c->rank, c->nranks, tc_last_error());
    o->n = len;
    if ((rc = queue_between(c, buf + off, len, s, o->start, o->done, deadline))) return rc;
    off += len;
  } while (off < n);
  return scale_on(buf, n, scale, s);
}

/* Waits for what the communication stream holds now, bounded by limit:
 * 0, or TC_EIO (not done by then) / a CUDA error's code. */
static int drain(double limit, const char *what) {
  cudaEvent_t ev;
  int rc = tc_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  if (rc) return rc;
  rc = tc_check(cudaEventRecord(ev, tc_comm_stream()), "cudaEventRecord (communication stream)");
  int k = 0;
  while (!rc) {
    cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) rc = tc_check(e, what);
    else if (now_s() > limit) rc = tc_fail(TC_EIO, "%s: not done within its bound", what);
    else poll_pause(&k);
  }
  (void)cudaEventDestroy(ev);
  return rc;
}

int tc_comm_wait(tr_comm *c, double deadline) {
  if (!(deadline > 0)) deadline = DEFAULT_S;
  double slack = START_SLACK_S > 10 * deadline ? START_SLACK_S : 10 * deadline;
  int rc = TC_OK;
  if (c && c->aborted && c->npend) rc = tc_fail(TC_EIO, "NCCL communicator is aborted: %s", c->why);
  for (int i = 0; c && !rc && i < c->npend; i++) {
    double t0 = now_s();
    rc = watch(c, c->pend[i].start, c->pend[i].done, c->pend[i].n, deadline, t0 + slack, t0);
  }
  if (c) c->npend = 0;
  /* the rest (scaling, copies), or what an abort left: its kernels quit */
  if (rc == TC_EDEVICE) return rc; /* nothing may touch a lost device */
  if (rc) {
    char why[512];
    snprintf(why, sizeof why, "%s", tc_last_error());
    int rd = drain(now_s() + slack, "draining the communication stream after an abort");
    if (rd) return tc_device_lost("%s; %s", why, tc_last_error());
    return tc_fail(rc, "%s", why);
  }
  rc = drain(now_s() + slack + deadline, "waiting for the communication stream");
  if (rc && c) return comm_die(c, "NCCL all-reduce (rank %d of %d): %s", c->rank, c->nranks, tc_last_error());
  return rc;
}

void tc_comm_destroy(tr_comm *c, int finalize) {
  if (!c) return;
  if (c->comm && !c->aborted && finalize) { /* a clean shutdown: every rank is here too */
    ncclResult_t r = ncclCommFinalize(c->comm);
    if (r == ncclSuccess || r == ncclInProgress) r = wait_state(c->comm, now_s() + FINALIZE_S);
    if (r == ncclSuccess) r = ncclCommDestroy(c->comm);
    if (r == ncclSuccess) c->comm = NULL; /* else finalize failed or hung: comm_free aborts it */
  }
  (void)comm_free(c); /* a hung abort loses the device: the next call says so */
}

void tc_comm_forget(tr_comm *c) {
  if (!c) return;
  free(c->pend);
  free(c); /* the device is lost: leave its NCCL and CUDA state to the process's end */
}
