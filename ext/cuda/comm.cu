/* comm.cu — the NCCL communicators of FTAR's device data plane: the comm_*
 * functions of the CUDA backend's table (core/tensor/include/backend.h), one communicator
 * per membership epoch (core/ftar/ftar_dev.c creates and drops them).
 *
 * Called through backend.cu's wrappers, which make the device current, by
 * the training thread (the one that drives the compute stream). Nothing
 * here blocks without a bound:
 *   - every communicator is non-blocking (config.blocking = 0): calls may
 *     return ncclInProgress, and then the communicator's state
 *     (ncclCommGetAsyncError) is polled until it is not, before any other
 *     NCCL call or any other work is queued on the stream;
 *   - creation polls until ready or `timeout`, then aborts (ncclCommAbort);
 *   - an all-reduce is queued on the compute stream between two events; a
 *     watchdog polls the end event and the communicator's state: an
 *     asynchronous error (a peer's process exited, a network error) or
 *     `deadline` seconds after the collective started on the device (the
 *     start event completed) aborts the communicator and returns TC_EIO.
 *     The start event keeps the compute queued before the collective out of
 *     its deadline; waiting for the stream to get there is bounded too
 *     (START_SLACK_S or 10 x deadline);
 *   - an aborted communicator fails every call at once; destroy frees it.
 *     A healthy one is finalized (ncclCommFinalize, polled, bounded by
 *     FINALIZE_S, abort past it) and destroyed.
 * Waits poll: a few yields, then sleeps growing to 1 ms.
 * The mean's division is a multiplication by `scale` after the sum, in a
 * kernel of this file (the ring of core/ftar/ftar.c divides: bits may differ).
 *
 * Not here: the id's transport (FTAR's coordinator), the decision what
 * survivors return (core/ftar/ftar.c).
 */
#include <nccl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cuda_internal.h"

static_assert(sizeof(ncclUniqueId) == TR_COMM_ID_BYTES, "backend.h's id is an ncclUniqueId");

#define DEFAULT_S 60.0    /* a timeout or deadline <= 0 */
#define START_SLACK_S 60.0 /* least bound on the stream reaching a collective */
#define FINALIZE_S 10.0   /* bound on finalizing a healthy communicator */

struct tr_comm {
  ncclComm_t comm; /* NULL once aborted */
  int nranks, rank;
  int aborted;
  cudaEvent_t ev_start, ev_done;
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

/* "file:line: what: <NCCL's string> (<NCCL's last error>)" as TC_EIO. */
static int nccl_fail(ncclResult_t r, const char *what, const char *file, int line) {
  return tc_fail(TC_EIO, "%s:%d: %s: %s (%s)", file, line, what, ncclGetErrorString(r), last_error());
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

/* Aborts the communicator: c is dead from now on. Returns TC_EIO with the
 * message. */
__attribute__((format(printf, 2, 3))) static int comm_die(tr_comm *c, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->why, sizeof c->why, fmt, ap);
  va_end(ap);
  if (c->comm) ncclCommAbort(c->comm); /* blocking; the queued collective's kernels quit */
  c->comm = NULL;
  c->aborted = 1;
  return tc_fail(TC_EIO, "%s", c->why);
}

namespace {
/* p[i] *= s; p is (n) */
__global__ void comm_scale_kernel(float *p, size_t n, float s) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] *= s;
}
} // namespace

/* --- the table's functions --- */

int tc_comm_id(uint8_t id[TR_COMM_ID_BYTES]) {
  ncclUniqueId uid;
  ncclResult_t r = ncclGetUniqueId(&uid);
  if (r != ncclSuccess) return NCCL_FAIL(r, "ncclGetUniqueId");
  memcpy(id, &uid, sizeof uid);
  return TC_OK;
}

int tc_comm_create(tr_comm **out, const uint8_t id[TR_COMM_ID_BYTES], int nranks, int rank, double timeout) {
  *out = NULL;
  if (nranks < 1 || rank < 0 || rank >= nranks) return tc_fail(TC_EINVAL, "NCCL communicator: rank %d of %d", rank, nranks);
  if (!(timeout > 0)) timeout = DEFAULT_S;
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
  if (r != ncclSuccess) {
    rc = NCCL_FAIL(r, "creating the NCCL communicator (ncclCommInitRankConfig)");
    goto error;
  }
  if ((rc = tc_check(cudaEventCreateWithFlags(&c->ev_start, cudaEventDisableTiming), "cudaEventCreateWithFlags")) ||
      (rc = tc_check(cudaEventCreateWithFlags(&c->ev_done, cudaEventDisableTiming), "cudaEventCreateWithFlags")))
    goto error;
  *out = c;
  return TC_OK;
error:
  if (c->comm) ncclCommAbort(c->comm); /* a partly initialised one included */
  if (c->ev_start) cudaEventDestroy(c->ev_start);
  if (c->ev_done) cudaEventDestroy(c->ev_done);
  free(c);
  return rc;
}

int tc_comm_allreduce(tr_comm *c, float *buf, size_t n, float scale, double deadline) {
  if (!c || (!buf && n)) return tc_fail(TC_EINVAL, "NCCL all-reduce: bad arguments");
  if (c->aborted) return tc_fail(TC_EIO, "NCCL communicator is aborted: %s", c->why);
  if (!(deadline > 0)) deadline = DEFAULT_S;
  cudaStream_t stream = tc_stream();
  ncclResult_t st = ncclSuccess;
  ncclResult_t r = ncclCommGetAsyncError(c->comm, &st);
  if (r == ncclSuccess && st == ncclInProgress) st = wait_state(c->comm, now_s() + deadline); /* settle first */
  if (r != ncclSuccess || st != ncclSuccess)
    return comm_die(c, "NCCL communicator (rank %d of %d) failed before the all-reduce: %s", c->rank, c->nranks,
                    ncclGetErrorString(r != ncclSuccess ? r : st));
  cudaError_t e = cudaEventRecord(c->ev_start, stream);
  if (e != cudaSuccess) return comm_die(c, "queueing the all-reduce: cudaEventRecord: %s", cudaGetErrorString(e));
  double t0 = now_s();
  r = ncclAllReduce(buf, buf, n, ncclFloat, ncclSum, c->comm, stream);
  if (r == ncclInProgress) r = wait_state(c->comm, t0 + deadline);
  if (r == ncclInProgress)
    return comm_die(c, "NCCL all-reduce (rank %d of %d): not queued within %.2f s", c->rank, c->nranks, deadline);
  if (r != ncclSuccess)
    return comm_die(c, "NCCL all-reduce (rank %d of %d): ncclAllReduce: %s (%s)", c->rank, c->nranks,
                    ncclGetErrorString(r), last_error());
  e = cudaEventRecord(c->ev_done, stream);
  if (e != cudaSuccess) return comm_die(c, "queueing the all-reduce: cudaEventRecord: %s", cudaGetErrorString(e));
  /* watchdog */
  double start_limit = t0 + (START_SLACK_S > 10 * deadline ? START_SLACK_S : 10 * deadline);
  double t_dl = 0; /* deadline, once the collective started on the device */
  int k = 0;
  for (;;) {
    e = cudaEventQuery(c->ev_done);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady)
      return comm_die(c, "NCCL all-reduce (rank %d of %d): %s", c->rank, c->nranks, cudaGetErrorString(e));
    r = ncclCommGetAsyncError(c->comm, &st);
    if (r != ncclSuccess || (st != ncclSuccess && st != ncclInProgress))
      return comm_die(c, "NCCL all-reduce (rank %d of %d): %s (%s): a peer failed or left", c->rank, c->nranks,
                      ncclGetErrorString(r != ncclSuccess ? r : st), last_error());
    double now = now_s();
    if (t_dl == 0) {
      e = cudaEventQuery(c->ev_start);
      if (e == cudaSuccess) {
        t_dl = now + deadline;
      } else if (e != cudaErrorNotReady) {
        return comm_die(c, "NCCL all-reduce (rank %d of %d): %s", c->rank, c->nranks, cudaGetErrorString(e));
      } else if (now > start_limit) {
        return comm_die(c, "NCCL all-reduce (rank %d of %d): the compute stream did not reach it within %.0f s",
                        c->rank, c->nranks, start_limit - t0);
      }
    } else if (now > t_dl) {
      return comm_die(c, "NCCL all-reduce of %zu floats (rank %d of %d) not complete %.2f s after it started: a peer "
                      "died or stalled",
                      n, c->rank, c->nranks, deadline);
    }
    poll_pause(&k);
  }
  if (scale != 1.0f && n) {
    int blocks = (int)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
    comm_scale_kernel<<<blocks, 256, 0, stream>>>(buf, n, scale);
    int rc = tc_check(cudaGetLastError(), "scaling the all-reduce's result");
    if (rc) return rc;
  }
  return TC_OK;
}

void tc_comm_destroy(tr_comm *c) {
  if (!c) return;
  if (c->comm && !c->aborted) {
    ncclResult_t r = ncclCommFinalize(c->comm);
    if (r == ncclSuccess || r == ncclInProgress) r = wait_state(c->comm, now_s() + FINALIZE_S);
    if (r == ncclSuccess) r = ncclCommDestroy(c->comm);
    if (r != ncclSuccess) ncclCommAbort(c->comm); /* finalize failed or hung: free it the hard way */
  } else if (c->comm) {
    ncclCommAbort(c->comm);
  }
  c->comm = NULL;
  if (c->ev_start) cudaEventDestroy(c->ev_start);
  if (c->ev_done) cudaEventDestroy(c->ev_done);
  free(c);
}
