/* backend.cu — the CUDA backend plugin: the device, its streams, memory,
 * level-1 checkpoint copies, errors and the table (see core/tensor/include/backend.h).
 *
 * core/tensor/backend.c dlopens libtransom_cuda.so and calls the one exported
 * symbol, transom_backend_cuda(TR_BACKEND_ABI), then init(). The kernels of
 * the graph and vector ops are in kernels.cu, the NCCL collectives in
 * comm.cu; this file owns what they share (cuda_internal.h, kernels.cuh):
 *
 *   - one device, chosen at init; every entry point that another thread may
 *     call (memory, sync, ckpt_* from the checkpoint engine's copy thread,
 *     comm_* and the kernels from the training thread) makes it current
 *     first, since CUDA's current device is per host thread;
 *   - the compute stream (non-blocking) with the cuBLAS handle bound to it,
 *     a side stream for checkpoint copies, ordered after the compute
 *     stream by an event (ckpt_mark), and a communication stream for the
 *     overlapped collectives (comm_mark .. comm_wait: FTAR's communication
 *     thread queues a bucket's copy and NCCL all-reduce there after an
 *     event that the training thread recorded on the compute stream);
 *   - errors: a thread-local message (error()), and one deferred error for
 *     queued work, which has no return value: sync/upload/download/copy
 *     report it;
 *   - a lost device: a CUDA error that corrupts the context (an illegal
 *     address, a device assert, ECC, ...: tc_sticky's list, the errors
 *     whose documentation says the process must be relaunched), or a
 *     communicator abort that did not return in its bound (comm.cu), makes
 *     every later call fail at once with TC_EDEVICE and the first reason,
 *     without touching the device (a free or a sync could wait for ever on
 *     a hung stream): the worker gives up and is replaced.
 *
 * Matmuls are plain fp32 by default (cuBLAS's default math mode; TF32 is
 * not used). TRANSOM_CUDA_TF32=1 in the environment at init lets cuBLAS
 * use TF32 tensor cores (CUBLAS_TF32_TENSOR_OP_MATH): faster, about 1e-3
 * relative error per product, so results no longer match the CPU backend
 * to fp32 tolerances. describe() says which mode is on. The bf16 ops
 * (kernels_bf16.cu) multiply bf16 on tensor cores with fp32 accumulation;
 * CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION keeps their split-K
 * reductions in fp32 too where the output is bf16 (it changes nothing for
 * fp32 outputs).
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "kernels.cuh"

/* --- state (set once by init, under init_mu) --- */

static pthread_mutex_t init_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_ready;          /* init succeeded */
static int g_dev = -1;       /* the device ordinal */
static cudaStream_t g_stream; /* compute: kernels, cuBLAS, memory ops, collectives */
static cudaStream_t g_side;   /* checkpoint copies */
static cudaEvent_t g_mark;    /* recorded on g_stream by ckpt_mark */
static cudaStream_t g_comm;   /* overlapped collectives (comm_copy, comm_allreduce_async) */
static cublasHandle_t g_blas;
static char g_describe[512] = "CUDA backend (not initialised)";

/* scratch of the kernels (training thread only) */
static void *g_scratch[TC_NSLOTS];
static size_t g_scratch_cap[TC_NSLOTS];

/* --- errors --- */

static thread_local char t_err[512];

int tc_fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(t_err, sizeof t_err, fmt, ap);
  va_end(ap);
  return code;
}

/* The lost device: set once, never cleared (see the top of this file). */
static pthread_mutex_t lost_mu = PTHREAD_MUTEX_INITIALIZER;
static volatile int g_lost;
static char g_lost_msg[512];

int tc_device_lost(const char *fmt, ...) {
  char msg[400];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&lost_mu);
  if (!g_lost) {
    snprintf(g_lost_msg, sizeof g_lost_msg, "the CUDA device is unusable in this process: %s (replace the process)",
             msg);
    __atomic_store_n(&g_lost, 1, __ATOMIC_RELEASE);
  }
  tc_fail(TC_EDEVICE, "%s", g_lost_msg);
  pthread_mutex_unlock(&lost_mu);
  return TC_EDEVICE;
}

/* TC_EDEVICE with the first reason when the device is lost, else 0. */
static int lost_check(void) {
  if (!__atomic_load_n(&g_lost, __ATOMIC_ACQUIRE)) return TC_OK;
  pthread_mutex_lock(&lost_mu);
  tc_fail(TC_EDEVICE, "%s", g_lost_msg);
  pthread_mutex_unlock(&lost_mu);
  return TC_EDEVICE;
}

int tc_sticky(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchTimeout:
    case cudaErrorAssert:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorLaunchFailure:
    case cudaErrorECCUncorrectable:
    case cudaErrorNvlinkUncorrectable:
    case cudaErrorContained:
    case cudaErrorTensorMemoryLeak:
    case cudaErrorMpsClientTerminated:
    case cudaErrorExternalDevice:
    case cudaErrorContextIsDestroyed:
    case cudaErrorCudartUnloading:
      return 1;
    default:
      return 0;
  }
}

int tc_check(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return TC_OK;
  if (tc_sticky(e)) return tc_device_lost("%s: %s", what, cudaGetErrorString(e));
  (void)cudaGetLastError(); /* clear a non-sticky error, so no later call reports it again */
  return tc_fail(TC_EIO, "%s: %s", what, cudaGetErrorString(e));
}

static const char *cu_error(void) { return t_err[0] ? t_err : "no error"; }
const char *tc_last_error(void) { return cu_error(); }

/* The deferred error of queued work (first one wins until reported). */
static pthread_mutex_t defer_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_defer_code;
static char g_defer_msg[512];

void tc_defer(int code, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  tc_fail(code, "%s", msg);
  pthread_mutex_lock(&defer_mu);
  if (!g_defer_code) {
    g_defer_code = code;
    memcpy(g_defer_msg, msg, sizeof msg);
  }
  pthread_mutex_unlock(&defer_mu);
}

/* Reports (as the calling thread's error) the deferred error, leaving it
 * for sync, upload or download to report too. */
static int peek_deferred(void) {
  pthread_mutex_lock(&defer_mu);
  int code = g_defer_code;
  if (code) tc_fail(code, "%s", g_defer_msg);
  pthread_mutex_unlock(&defer_mu);
  return code;
}

/* Reports (as the calling thread's error) and clears the deferred error. */
static int take_deferred(void) {
  pthread_mutex_lock(&defer_mu);
  int code = g_defer_code;
  if (code) tc_fail(code, "%s", g_defer_msg);
  g_defer_code = 0;
  pthread_mutex_unlock(&defer_mu);
  return code;
}

int tc_queued(cudaError_t e, const char *what) {
  if (e == cudaSuccess) e = cudaGetLastError();
  else (void)cudaGetLastError();
  if (e == cudaSuccess) return TC_OK;
  int code = tc_sticky(e) ? tc_device_lost("%s: %s", what, cudaGetErrorString(e)) : TC_EIO;
  tc_defer(code, "%s: %s", what, cudaGetErrorString(e));
  return code;
}

void tc_blas_check(cublasStatus_t s, const char *what) {
  if (s != CUBLAS_STATUS_SUCCESS) tc_defer(TC_EIO, "%s: %s", what, cublasGetStatusString(s));
}

/* --- what kernels.cu and comm.cu borrow --- */

cudaStream_t tc_stream(void) { return g_stream; }
cudaStream_t tc_comm_stream(void) { return g_comm; }
cublasHandle_t tc_blas(void) { return g_blas; }

/* Current device for this thread; errors returned (not deferred). A lost
 * device fails at once. */
static int enter(void) {
  if (!g_ready) return tc_fail(TC_ESTATE, "the CUDA backend is not initialised");
  int rc = lost_check();
  return rc ? rc : tc_check(cudaSetDevice(g_dev), "cudaSetDevice");
}

int tc_set_device(void) { return g_ready ? tc_check(cudaSetDevice(g_dev), "cudaSetDevice") : TC_ESTATE; }

int tc_probe(void) {
  int rc = lost_check();
  if (rc) return rc;
  cudaError_t e = cudaStreamQuery(g_stream);
  if (e == cudaSuccess || e == cudaErrorNotReady) return TC_OK;
  return tc_sticky(e) ? tc_device_lost("cudaStreamQuery: %s", cudaGetErrorString(e)) : TC_OK;
}

int tc_enter(void) {
  int rc = enter();
  if (rc) tc_defer(rc, "%s", t_err);
  return rc;
}

void *tc_scratch(int slot, size_t bytes) {
  if (bytes <= g_scratch_cap[slot]) return g_scratch[slot];
  /* Queued kernels may still use the old buffer: wait for them. */
  cudaError_t e = cudaStreamSynchronize(g_stream);
  if (e != cudaSuccess) {
    tc_queued(e, "cudaStreamSynchronize (growing a scratch buffer)");
    return NULL;
  }
  if (g_scratch[slot]) (void)cudaFree(g_scratch[slot]);
  g_scratch[slot] = NULL;
  g_scratch_cap[slot] = 0;
  size_t want = bytes + bytes / 4; /* headroom: shapes grow a little at a time */
  void *p = NULL;
  e = cudaMalloc(&p, want);
  if (e != cudaSuccess) {
    tc_queued(e, "cudaMalloc (a scratch buffer of the CUDA kernels)");
    return NULL;
  }
  g_scratch[slot] = p;
  g_scratch_cap[slot] = want;
  return p;
}

/* --- init and describe --- */

#ifndef TRANSOM_CUDA_ARCHS
#define TRANSOM_CUDA_ARCHS "?"
#endif

namespace {
__global__ void arch_probe_kernel(void) {}
} // namespace

/* Does the plugin hold code this device can run (a cubin of its family or
 * PTX it can compile)? A kernel's attributes load its image: no image is
 * cudaErrorNoKernelImageForDevice (or InvalidDeviceFunction). Refused at
 * init, naming the architectures built, rather than at the first kernel. */
static int check_arch(int dev, const cudaDeviceProp *prop) {
  cudaFuncAttributes fa;
  cudaError_t e = cudaFuncGetAttributes(&fa, arch_probe_kernel);
  if (e == cudaSuccess) return TC_OK;
  if (tc_sticky(e)) return tc_check(e, "cudaFuncGetAttributes");
  (void)cudaGetLastError();
  return tc_fail(TC_EINVAL,
                 "cuda:%d %s is sm_%d%d, and this plugin has no code it can run (built for %s, "
                 "CMAKE_CUDA_ARCHITECTURES): rebuild with -DCMAKE_CUDA_ARCHITECTURES=%d%d (%s)",
                 dev, prop->name, prop->major, prop->minor, TRANSOM_CUDA_ARCHS, prop->major, prop->minor,
                 cudaGetErrorString(e));
}

/* The devices visible, without initialising one. 0 or TC_EIO. */
static int device_count(int *count) {
  *count = 0;
  cudaError_t e = cudaGetDeviceCount(count);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return tc_fail(TC_EIO, "no CUDA device is visible (cudaGetDeviceCount: %s)", cudaGetErrorString(e));
  }
  if (*count <= 0) return tc_fail(TC_EIO, "no CUDA device is visible (cudaGetDeviceCount: 0 devices)");
  return TC_OK;
}

static int init_locked(int ordinal) {
  int count = 0, dev, rc, tf32, rt = 0, drv = 0;
  const char *env;
  cublasStatus_t bs;
  cudaStream_t stream = NULL, side = NULL, comm = NULL;
  cudaEvent_t mark = NULL;
  cublasHandle_t blas = NULL;
  cudaDeviceProp prop;

  if (g_ready) {
    if (ordinal >= 0 && ordinal != g_dev)
      return tc_fail(TC_ESTATE, "the CUDA backend is already initialised on device %d (asked for %d)", g_dev,
                     ordinal);
    return enter();
  }
  if ((rc = device_count(&count))) return rc;
  /* -1: device 0 of those visible; else the replica's own (the operator
   * passes each worker's slot): two replicas on one GPU cannot share an
   * NCCL communicator ("duplicate GPU") and would fail every epoch, so a
   * slot past the devices is refused here, at start, not retried */
  if (ordinal >= count) {
    env = getenv("CUDA_VISIBLE_DEVICES");
    return tc_fail(TC_EINVAL,
                   "replica slot %d has no GPU of its own: %d CUDA device(s) are visible (CUDA_VISIBLE_DEVICES=%s); "
                   "one GPU per replica: run at most %d replicas on this host",
                   ordinal, count, env ? env : "(unset)", count);
  }
  dev = ordinal < 0 ? 0 : ordinal;

  if ((rc = tc_check(cudaSetDevice(dev), "cudaSetDevice"))) goto error;
  if ((rc = tc_check(cudaGetDeviceProperties(&prop, dev), "cudaGetDeviceProperties"))) goto error;
  if ((rc = check_arch(dev, &prop))) goto error;
  if ((rc = tc_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags")))
    goto error;
  if ((rc = tc_check(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking), "cudaStreamCreateWithFlags")))
    goto error;
  if ((rc = tc_check(cudaEventCreateWithFlags(&mark, cudaEventDisableTiming), "cudaEventCreateWithFlags")))
    goto error;
  if ((rc = tc_check(cudaStreamCreateWithFlags(&comm, cudaStreamNonBlocking), "cudaStreamCreateWithFlags")))
    goto error;
  if ((bs = cublasCreate(&blas)) != CUBLAS_STATUS_SUCCESS) {
    blas = NULL;
    rc = tc_fail(TC_EIO, "cublasCreate: %s", cublasGetStatusString(bs));
    goto error;
  }
  env = getenv("TRANSOM_CUDA_TF32");
  tf32 = env && strcmp(env, "1") == 0;
  if ((bs = cublasSetStream(blas, stream)) != CUBLAS_STATUS_SUCCESS ||
      (bs = cublasSetMathMode(blas, (cublasMath_t)((tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH) |
                                                   CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION))) !=
          CUBLAS_STATUS_SUCCESS) {
    rc = tc_fail(TC_EIO, "cuBLAS setup: %s", cublasGetStatusString(bs));
    goto error;
  }
  (void)cudaRuntimeGetVersion(&rt);
  (void)cudaDriverGetVersion(&drv);
  snprintf(g_describe, sizeof g_describe,
           "cuda:%d %s, %.1f GiB, sm_%d%d, %d SMs; CUDA runtime %d.%d, driver %d.%d; %s matmuls; %s", dev, prop.name,
           (double)prop.totalGlobalMem / (1024.0 * 1024.0 * 1024.0), prop.major, prop.minor,
           prop.multiProcessorCount, rt / 1000, rt % 1000 / 10, drv / 1000, drv % 1000 / 10,
           tf32 ? "TF32" : "fp32",
#ifdef TRANSOM_HAVE_NCCL
           "NCCL collectives"
#else
           "no NCCL (built without it): replicas all-reduce through the host"
#endif
  );
  g_dev = dev;
  g_stream = stream;
  g_side = side;
  g_mark = mark;
  g_comm = comm;
  g_blas = blas;
  g_ready = 1;
  return TC_OK;

error:
  if (blas) (void)cublasDestroy(blas);
  if (comm) (void)cudaStreamDestroy(comm);
  if (mark) (void)cudaEventDestroy(mark);
  if (side) (void)cudaStreamDestroy(side);
  if (stream) (void)cudaStreamDestroy(stream);
  (void)cudaGetLastError();
  return rc;
}

/* threads: host-side work stays in core; the plugin's work runs on the device. */
static int cu_init(int ordinal, int threads) {
  (void)threads;
  pthread_mutex_lock(&init_mu);
  int rc = init_locked(ordinal);
  pthread_mutex_unlock(&init_mu);
  return rc;
}

static const char *cu_describe(void) { return g_describe; }

/* The operator asks before it starts any replica: one GPU each. */
static int cu_devices(void) {
  int count, rc = device_count(&count);
  return rc ? rc : count;
}

/* --- memory --- */

static void *cu_alloc(size_t bytes) {
  void *p = NULL;
  if (enter()) return NULL;
  if (bytes == 0) bytes = 1; /* NULL means failure: hand out a real (256-byte aligned) block */
  if (tc_check(cudaMalloc(&p, bytes), "cudaMalloc")) return NULL;
  if (tc_check(cudaMemsetAsync(p, 0, bytes, g_stream), "cudaMemsetAsync") ||
      tc_check(cudaStreamSynchronize(g_stream), "cudaStreamSynchronize (zeroing a new allocation)")) {
    (void)cudaFree(p);
    return NULL;
  }
  return p;
}

/* Kernels still queued may use p, and so may checkpoint copies on the side
 * stream: both finish first (cudaFree also waits for the device, but that
 * is an implementation detail). An error here (a failed kernel) is left for
 * sync to report; p is freed regardless. */
static void cu_free(void *p) {
  if (!p || enter()) return; /* a lost device: nothing is freed, the process is on its way out */
  (void)tc_check(cudaStreamSynchronize(g_stream), "cudaStreamSynchronize (before a free)");
  /* and the checkpoint copies queued on the side stream, which may read p */
  (void)tc_check(cudaStreamSynchronize(g_side), "cudaStreamSynchronize (checkpoint copies, before a free)");
  /* and the overlapped collectives' copies (FTAR waits for its collectives before it frees) */
  (void)tc_check(cudaStreamSynchronize(g_comm), "cudaStreamSynchronize (communication stream, before a free)");
  if (cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
}

/* Waits for the compute stream; reports a deferred error, then e. */
static int finish(cudaError_t e, const char *what) {
  if (e == cudaSuccess) e = cudaStreamSynchronize(g_stream);
  int rc = take_deferred();
  if (rc) {
    (void)cudaGetLastError();
    return rc;
  }
  return tc_check(e, what);
}

static int cu_upload(void *dst, const void *src_host, size_t bytes) {
  int rc = enter();
  if (rc) return rc;
  if (bytes == 0) return finish(cudaSuccess, "upload");
  return finish(cudaMemcpyAsync(dst, src_host, bytes, cudaMemcpyHostToDevice, g_stream), "upload (cudaMemcpyAsync)");
}

static int cu_download(void *dst_host, const void *src, size_t bytes) {
  int rc = enter();
  if (rc) return rc;
  if (bytes == 0) return finish(cudaSuccess, "download");
  return finish(cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, g_stream),
                "download (cudaMemcpyAsync)");
}

/* Queued; does not wait. Refuses to queue after a failed kernel (its
 * result may be what we would copy), without clearing that error: a copy's
 * caller may only log it, and sync must still report it. */
static int cu_copy(void *dst, const void *src, size_t bytes) {
  int rc = enter();
  if (rc) return rc;
  if ((rc = peek_deferred())) return rc;
  if (bytes == 0) return TC_OK;
  return tc_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, g_stream), "copy (cudaMemcpyAsync)");
}

static int cu_sync(void) {
  int rc = enter();
  if (rc) return rc;
  if ((rc = finish(cudaSuccess, "cudaStreamSynchronize"))) return rc;
  return tc_check(cudaGetLastError(), "a queued kernel");
}

/* --- level-1 checkpoint copies --- */

/* Copy thread (or whoever owns the staging buffer). */
static int cu_ckpt_pin(void *host, size_t bytes) {
  int rc = enter();
  if (rc) return rc;
  if (!host || bytes == 0) return TC_OK;
  return tc_check(cudaHostRegister(host, bytes, cudaHostRegisterDefault), "cudaHostRegister (pinning a staging buffer)");
}

static void cu_ckpt_unpin(void *host) {
  if (!host || enter()) return;
  if (cudaHostUnregister(host) != cudaSuccess) (void)cudaGetLastError();
}

/* Training thread: the copies queued after this see every kernel queued before it. */
static int cu_ckpt_mark(void) {
  int rc = enter();
  if (rc) return rc;
  return tc_check(cudaEventRecord(g_mark, g_stream), "ckpt_mark (cudaEventRecord)");
}

/* Copy thread: waits (on the side stream, not the host) for the latest mark.
 * Before any mark the copy is ordered after nothing. */
static int cu_ckpt_copy(void *dst_host, const void *src, size_t bytes) {
  int rc = enter();
  if (rc) return rc;
  if (bytes == 0) return TC_OK;
  if ((rc = tc_check(cudaStreamWaitEvent(g_side, g_mark, 0), "ckpt_copy (cudaStreamWaitEvent)"))) return rc;
  return tc_check(cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, g_side),
                  "ckpt_copy (cudaMemcpyAsync)");
}

/* Copy thread: waits for every queued checkpoint copy. */
static int cu_ckpt_wait(void) {
  int rc = enter();
  if (rc) return rc;
  return tc_check(cudaStreamSynchronize(g_side), "ckpt_wait (cudaStreamSynchronize)");
}

/* --- collectives: comm.cu, called with the device current (built with
 * NCCL only; without, the table has none and FTAR goes through the host) --- */
#ifdef TRANSOM_HAVE_NCCL

static int cu_comm_id(uint8_t id[TR_COMM_ID_BYTES]) {
  int rc = enter();
  return rc ? rc : tc_comm_id(id);
}

static int cu_comm_create(tr_comm **out, const uint8_t id[TR_COMM_ID_BYTES], int nranks, int rank, double timeout) {
  int rc = enter();
  return rc ? rc : tc_comm_create(out, id, nranks, rank, timeout);
}

static int cu_comm_allreduce(tr_comm *c, float *buf, size_t n, float scale, double deadline) {
  int rc = enter();
  return rc ? rc : tc_comm_allreduce(c, buf, n, scale, deadline);
}

static void cu_comm_destroy(tr_comm *c, int finalize) {
  if (!c) return;
  if (enter() == TC_EDEVICE) { /* nothing may touch a lost device (an abort could hang): free the host state */
    tc_comm_forget(c);
    return;
  }
  tc_comm_destroy(c, finalize); /* also after another failure of enter(): comm.cu frees what it can */
}

/* --- overlapped collectives (backend.h): marks of the compute stream, and
 * work on the communication stream ordered after them --- */

/* Training thread: a fresh event recorded on the compute stream (the mark
 * is the event). */
static int cu_comm_mark(tr_mark **out) {
  *out = NULL;
  int rc = enter();
  if (rc) return rc;
  cudaEvent_t ev;
  if ((rc = tc_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "comm_mark (cudaEventCreateWithFlags)")))
    return rc;
  if ((rc = tc_check(cudaEventRecord(ev, g_stream), "comm_mark (cudaEventRecord)"))) {
    (void)cudaEventDestroy(ev);
    return rc;
  }
  *out = (tr_mark *)(void *)ev;
  return TC_OK;
}

/* Work already queued after the event still waits for it (CUDA releases a
 * pending event once it completes). A lost device: left alone. */
static void cu_comm_mark_free(tr_mark *mark) {
  if (!mark || enter()) return;
  if (cudaEventDestroy((cudaEvent_t)(void *)mark) != cudaSuccess) (void)cudaGetLastError();
}

/* Communication thread: a device-to-device copy on the communication stream. */
static int cu_comm_copy(void *dst, const void *src, size_t bytes, const tr_mark *after) {
  int rc = enter();
  if (rc) return rc;
  if (after && (rc = tc_check(cudaStreamWaitEvent(g_comm, (cudaEvent_t)(void *)after, 0),
                              "comm_copy (cudaStreamWaitEvent)")))
    return rc;
  if (bytes == 0) return TC_OK;
  return tc_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, g_comm), "comm_copy (cudaMemcpyAsync)");
}

static int cu_comm_allreduce_async(tr_comm *c, float *buf, size_t n, float scale, const tr_mark *after,
                                   double deadline) {
  int rc = enter();
  return rc ? rc : tc_comm_allreduce_async(c, buf, n, scale, after, deadline);
}

static int cu_comm_wait(tr_comm *c, double deadline) {
  int rc = enter();
  return rc ? rc : tc_comm_wait(c, deadline);
}
#endif

/* --- the table (its graph-op entries generated from ops.def: a launcher
 * that no file defines fails the link, see CMakeLists.txt) --- */

static tr_backend make_table(void) {
  tr_backend t;
  memset(&t, 0, sizeof t);
  t.abi = TR_BACKEND_ABI;
  t.name = "cuda";
  t.host_memory = 0;
  t.init = cu_init;
  t.devices = cu_devices;
  t.describe = cu_describe;
  t.error = cu_error;
  t.alloc = cu_alloc;
  t.free = cu_free;
  t.upload = cu_upload;
  t.download = cu_download;
  t.copy = cu_copy;
  t.sync = cu_sync;
  t.zero = tk_zero;
  t.sumsq = tk_sumsq;
  t.scale = tk_scale;
  t.adamw = tk_adamw;
#define TR_OP(ID, NAME, K, ...)   \
  t.K##_forward = tk_##K##_forward; \
  t.K##_backward = tk_##K##_backward;
#include "ops.def"
  t.bf16 = tk_bf16_ops();
  t.ckpt_pin = cu_ckpt_pin;
  t.ckpt_unpin = cu_ckpt_unpin;
  t.ckpt_mark = cu_ckpt_mark;
  t.ckpt_copy = cu_ckpt_copy;
  t.ckpt_wait = cu_ckpt_wait;
#ifdef TRANSOM_HAVE_NCCL
  t.comm_id = cu_comm_id;
  t.comm_create = cu_comm_create;
  t.comm_allreduce = cu_comm_allreduce;
  t.comm_destroy = cu_comm_destroy;
  t.comm_mark = cu_comm_mark;
  t.comm_mark_free = cu_comm_mark_free;
  t.comm_copy = cu_comm_copy;
  t.comm_allreduce_async = cu_comm_allreduce_async;
  t.comm_wait = cu_comm_wait;
#endif
  return t;
}

/* The plugin's one exported symbol (core/tensor/backend.c looks it up with dlsym).
 * The table is built once (a function-local static: thread-safe). */
extern "C" __attribute__((visibility("default"))) const tr_backend *transom_backend_cuda(int abi) {
  static const tr_backend table = make_table();
  return abi == TR_BACKEND_ABI ? &table : NULL;
}
