/* backend.h — where a graph's tensors live and which kernels run them.
 *
 * A backend is a table of functions: memory (alloc/free/upload/download), the
 * forward and backward kernel of every graph op (ops.def) with the contracts
 * of kernels.h, and the vector kernels the optimizer needs. The graph and the
 * trainer call only this table, so the same graph, job file and fault
 * tolerance run on any backend, chosen at run time by the job's `device`
 * field:
 *
 *   "cpu"   core's kernels on host memory (the default). Device pointers ARE
 *           host pointers (host_memory = 1): nothing is copied.
 *   "emu"   the same kernels behind a device boundary: separate memory,
 *           closed to the host (PROT_NONE) while no call into the table
 *           runs, transfers by memcpy, the optimizer through the table. It runs
 *           the device code paths of the graph, trainer, checkpoints and
 *           collectives on a machine without a GPU (tests use it).
 *   "cuda"  ext/cuda: CUDA kernels, cuBLAS matmuls, NCCL. Built as a plugin,
 *           libtransom_cuda.so, next to the transom binary (TRANSOM_CUDA=AUTO
 *           builds it whenever nvcc is found) and loaded with dlopen on first
 *           use, so a binary built with it still runs where no CUDA driver is.
 *
 * Conventions for every backend:
 *   - Pointers passed to kernels (of graph ops and vector kernels alike) are
 *     the backend's ("device") pointers from alloc(). Kernels are
 *     asynchronous: they are queued in order on the backend's compute
 *     stream; upload/download/sync wait.
 *   - Errors: functions that return int return 0 or a negative TR_* code; the
 *     message is in error(). Kernel launches do not return errors; a failed
 *     launch is reported by the next sync()/download().
 *   - One thread drives a backend's compute stream (the training thread). The
 *     ckpt_* functions are called by the checkpoint engine's copy thread.
 *   - The plugin does not call back into core: it gets everything through
 *     its arguments, and exports exactly one symbol,
 *     `const tr_backend *transom_backend_cuda(int abi)`, returning NULL when
 *     abi != TR_BACKEND_ABI.
 */
#ifndef TRANSOM_BACKEND_H
#define TRANSOM_BACKEND_H

#include <stddef.h>
#include <stdint.h>

/* The number of graph ops (ops.def): the tables below have two members per op. */
enum {
  TR_OP_COUNT = 0
#define TR_OP(...) +1
#include "ops.def"
};

/* The table's layout version; the op count is part of it, so a plugin built
 * from another ops.def is refused rather than called through a shifted
 * table. Bump the 4 when a member's signature changes. */
#define TR_BACKEND_ABI (4 * 1000 + TR_OP_COUNT)

/* bfloat16 storage: the top 16 bits of an IEEE float32. Conversions round to
 * nearest even (NaN stays NaN). */
typedef uint16_t tr_bf16;

typedef struct tr_backend tr_backend;

/* An opaque communicator of one membership epoch (NCCL on cuda, shared
 * memory on emu). */
typedef struct tr_comm tr_comm;
/* An opaque point of the compute stream (a CUDA event): comm_mark. */
typedef struct tr_mark tr_mark;
#define TR_COMM_ID_BYTES 128 /* sizeof(ncclUniqueId) */

struct tr_backend {
  int abi;            /* TR_BACKEND_ABI */
  const char *name;   /* "cpu", "emu", "cuda" */
  int host_memory;    /* 1: device pointers are host pointers (cpu) */

  /* Initialises the backend on device `ordinal` of those visible (-1: the
   * default one) with `threads` host threads for host-side work (0 = all
   * cores). backend_get passes $TRANSOM_LOCAL_RANK, which the operator sets
   * to each worker's slot (else $LOCAL_RANK, $SLURM_LOCALID): one device per
   * replica. 0 or a negative code; a backend with no usable device fails
   * here with a message saying so ("no CUDA device is visible: ..."), and
   * an ordinal past the devices visible is refused (TR_EINVAL): two
   * replicas on one GPU cannot share an NCCL communicator. Idempotent. */
  int (*init)(int ordinal, int threads);
  /* How many devices a process of this host can use (one per replica),
   * without initialising one: > 0; 0 for no limit (emu unless
   * TRANSOM_EMU_DEVICES); or a negative code with error() set (no device,
   * no driver). NULL: no limit (cpu). The operator refuses a job with more
   * replicas than this. */
  int (*devices)(void);
  /* One line: device name, memory, driver/runtime versions. */
  const char *(*describe)(void);
  /* The calling thread's last error message. */
  const char *(*error)(void);

  /* --- memory (bytes; alloc returns zeroed memory or NULL) --- */
  void *(*alloc)(size_t bytes);
  void (*free)(void *p);
  int (*upload)(void *dst, const void *src_host, size_t bytes);   /* waits */
  int (*download)(void *dst_host, const void *src, size_t bytes); /* waits */
  int (*copy)(void *dst, const void *src, size_t bytes);          /* device to device, queued */
  int (*sync)(void); /* waits for every queued kernel; reports a failed one */

  /* --- vector kernels (n elements) --- */
  void (*zero)(float *p, int64_t n);
  /* sum of squares, accumulated in double; waits for the result.
   * Deterministic for a fixed configuration. */
  double (*sumsq)(const float *p, int64_t n);
  void (*scale)(float *p, int64_t n, float s);
  /* AdamW over one parameter range (n elements):
   *   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
   *   p -= lr * ((m / c1) / (sqrt(v / c2) + eps) + wd * p)
   * with c1 = 1 - b1^t, c2 = 1 - b2^t computed by the caller in float. */
  void (*adamw)(float *p, const float *g, float *m, float *v, int64_t n, float lr, float b1, float b2, float eps,
                float wd, float c1, float c2);

  /* --- graph ops: <K>_forward and <K>_backward for every op of ops.def,
   * with the contracts of kernels.h on device pointers (cross_entropy's loss
   * and its gradient are device memory too: loss[0], dloss[0]) --- */
#define TR_ACT float
#define TR_OP(ID, NAME, K, HOST, INS, OUT, AUX, VOCAB, FP, FA, FC, BP, BA, BC) \
  void(*K##_forward) FP;                                                     \
  void(*K##_backward) BP;
#include "ops.def"
#undef TR_ACT

  /* --- level-1 checkpoint copies (called by the checkpoint engine) ---
   * ckpt_pin page-locks a host staging buffer (so device-to-host copies run
   * at full speed and asynchronously); ckpt_unpin undoes it. ckpt_mark is
   * called by the training thread when a snapshot starts: the copies that
   * follow must see every kernel queued before it (a CUDA event on the
   * compute stream). ckpt_copy queues one device-to-host copy on a side
   * stream, after that mark; ckpt_wait waits for all queued copies. Any may
   * be NULL where the backend needs nothing (cpu). */
  int (*ckpt_pin)(void *host, size_t bytes);
  void (*ckpt_unpin)(void *host);
  int (*ckpt_mark)(void);
  int (*ckpt_copy)(void *dst_host, const void *src, size_t bytes);
  int (*ckpt_wait)(void);

  /* --- collectives of one membership epoch (NULL when the backend has none) ---
   * comm_id fills a fresh unique id (rank 0 of an epoch calls it; the id
   * travels to the others through FTAR's coordinator). comm_create joins the
   * communicator of nranks ranks as `rank`; it fails instead of hanging
   * after `timeout` seconds. comm_allreduce sums buf[0..n) in place and
   * scales by `scale` (1/contributors for a mean); the collective is issued
   * non-blocking and a watchdog polls the communicator: when a peer fails or
   * no progress is made for `deadline` seconds (the sum is watched in
   * chunks, so the deadline does not grow with n) it aborts the
   * communicator and returns TR_EIO (the communicator is then dead: destroy
   * it and create the next epoch's). A failure that no new communicator
   * would mend is not TR_EIO: TR_EINVAL where the ranks' set-up is wrong
   * (NCCL refuses two ranks on one GPU), TR_EDEVICE where the device is
   * unusable (a corrupted CUDA context, an abort that hung).
   * comm_destroy frees it: finalize = 0 aborts it at once (an epoch left
   * because a rank failed: finalizing would wait for that rank);
   * finalize = 1 is for a clean shutdown, where every rank destroys its
   * own: NCCL finalizes (waiting for the others, bounded) before it frees. */
  int (*comm_id)(uint8_t id[TR_COMM_ID_BYTES]);
  int (*comm_create)(tr_comm **out, const uint8_t id[TR_COMM_ID_BYTES], int nranks, int rank, double timeout);
  int (*comm_allreduce)(tr_comm *c, float *buf, size_t n, float scale, double deadline);
  void (*comm_destroy)(tr_comm *c, int finalize);

  /* --- overlapped collectives: all-reduces of buckets of gradients while
   * backward still runs (FTAR's ftar_allreduce_dev_start). NULL when the
   * backend has none (all five or none): FTAR then reduces after backward
   * with comm_allreduce. Work queued here runs on the backend's
   * communication stream (one per process, not the compute stream), in the
   * order queued, and is ordered after the compute stream only through
   * marks. comm_mark is called by the thread that drives the compute stream;
   * the others by one other thread at a time (FTAR's communication thread),
   * which may also call comm_create and comm_destroy.
   * comm_mark records the compute stream's current point: work queued after
   * it on the communication stream starts only once every kernel queued
   * before it on the compute stream ran. *out is freed with comm_mark_free,
   * which may come as soon as the last call that was given the mark
   * returned (what was queued after it still waits for it). 0, or a
   * negative code (then *out = NULL).
   * comm_copy queues a device-to-device copy after `after` (NULL: after
   * nothing but the communication stream's earlier work). 0 or TR_EDEVICE /
   * TR_EIO when it could not be queued.
   * comm_allreduce_async queues comm_allreduce's sum and scale of
   * buf[0..n) after `after` (NULL as above) and returns; `deadline` bounds
   * queueing it. comm_wait waits until everything queued on the
   * communication stream is done, with comm_allreduce's watchdog on the
   * collectives queued on c since the last wait (c NULL: only copies were):
   * a peer's failure, or an all-reduce that makes no progress for
   * `deadline` seconds once it started, aborts c (TR_EIO; destroy it as
   * after comm_allreduce). The error codes of both are comm_allreduce's.
   * However it returns, except TR_EDEVICE, nothing it waited for still
   * runs or will run (an aborted collective's kernels have quit): buffers
   * may be copied again. TR_EDEVICE (the device is lost: an abort or the
   * drain after it did not finish in its bound, a corrupted context)
   * promises nothing: the queued work may still run, and nothing may
   * touch the buffers but the process's exit. emu runs all of them at once on the calling thread (its kernels
   * are synchronous: a mark is a token). */
  int (*comm_mark)(tr_mark **out);
  void (*comm_mark_free)(tr_mark *mark);
  int (*comm_copy)(void *dst, const void *src, size_t bytes, const tr_mark *after);
  int (*comm_allreduce_async)(tr_comm *c, float *buf, size_t n, float scale, const tr_mark *after, double deadline);
  int (*comm_wait)(tr_comm *c, double deadline);

  /* bf16 activations with fp32 master weights (job: precision = "bf16");
   * NULL when the backend has none. */
  const struct tr_bf16_ops *bf16;
};

/* The graph ops with activations and activation gradients stored as bf16.
 * Parameters, their gradients and the optimizer stay fp32 (the master
 * weights); matmuls read `w16`, a bf16 shadow of the fp32 parameter slab that
 * the graph refreshes from the master weights (to_bf16) before every forward.
 * Every sum inside a kernel is done in fp32 (cuBLAS: CUBLAS_COMPUTE_32F);
 * values are rounded to bf16 where they are stored. Exceptions kept fp32:
 * layernorm's saved mean and rstd, and the loss. The accumulation rule of
 * kernels.h holds (`+=` into gradients, in fp32 then rounded for bf16 ones;
 * NULL outputs skipped). Same argument order as the fp32 table. */
typedef struct tr_bf16_ops {
  void (*to_bf16)(tr_bf16 *dst, const float *src, int64_t n);
#define TR_ACT tr_bf16
#define TR_OP(ID, NAME, K, HOST, INS, OUT, AUX, VOCAB, FP, FA, FC, BP, BA, BC) \
  void(*K##_forward) FP;                                                     \
  void(*K##_backward) BP;
#include "ops.def"
#undef TR_ACT
} tr_bf16_ops;

/* The backend named `name` ("cpu", "emu", "cuda"), initialised (see init;
 * on device $TRANSOM_LOCAL_RANK when set).
 * NULL with tr_error() set: unknown name, the CUDA plugin missing (built
 * without it) or failing to load, or no device. */
const tr_backend *backend_get(const char *name, int threads);
/* The same without init: the plugin is loaded (a check that a job's device
 * can be used, for a process that will not compute on it). */
const tr_backend *backend_load(const char *name);
/* The emu backend (backend_emu.c), not initialised. */
const tr_backend *backend_emu(void);
/* The host CPU backend (always available, no init needed). */
const tr_backend *backend_cpu(void);
/* Where the CUDA plugin is looked for: $TRANSOM_CUDA_LIB, else
 * libtransom_cuda.so beside the running executable. */
int backend_cuda_path(char *buf, size_t len);

#endif
