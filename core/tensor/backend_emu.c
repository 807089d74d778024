/* backend_emu.c — the emu backend (backend.h): core's CPU kernels behind a
 * device boundary that is enforced, so that tests on a machine without a GPU
 * catch what only a GPU would otherwise show.
 *
 * Every allocation is its own anonymous mapping, kept PROT_NONE while no
 * call into this table is running: host code that reads or writes "device"
 * memory directly (instead of through upload/download/copy or a kernel)
 * faults at once, as it would on a GPU, instead of silently working. Calls
 * in flight are counted (the checkpoint engine's copy thread calls in
 * concurrently with the training thread); the memory is opened at the first
 * and closed after the last. TRANSOM_EMU_GUARD=0 turns the guard off (plain
 * memory; faster; none of the checks below).
 *
 * The other direction too: every pointer a kernel, a transfer or the
 * communicator is given as device memory must lie in one of these
 * allocations. A host pointer there (which a GPU would meet with an illegal
 * address) does not run; it corrupts the emulated device for good, as an
 * illegal address corrupts a CUDA context: every later call fails with
 * TR_EDEVICE and the message naming the first bad pointer (sync, upload,
 * download, copy and the communicator report it; kernels do not run; alloc
 * returns NULL). Only a new process recovers.
 *
 * TRANSOM_EMU_DEVICES=N emulates N visible devices, for the one-device-
 * per-replica rule of cuda: init refuses an ordinal >= N, devices() says N,
 * and the communicator refuses two ranks on one emulated device as NCCL
 * refuses two ranks on one GPU (comm_emu.c). Unset: no limit, no check.
 *
 * The communicator (comm_emu.c) stands in for NCCL; the overlapped
 * collectives (comm_mark .. comm_wait) run at once on the calling thread,
 * since emu's kernels ran when they were called: a mark is a token.
 *
 * Otherwise it is the cpu backend: the same kernels in the same order, so a
 * run on emu gives the bits of a run on cpu. The wrappers of the graph ops
 * (check the pointers, open the memory, call the cpu table, close it) are
 * generated from ops.def.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "backend.h"
#include "comm_emu.h"
#include "util.h"

typedef struct {
  void *p;
  size_t n;
} region;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static region *regs;
static int nregs, capregs;
static int depth;      /* calls in flight */
static int guard = -1; /* -1: not read yet */
static int lost;       /* an illegal address was met: the emulated device is corrupted for good */
static char lost_msg[300];
static int g_dev = -1; /* the emulated device: init's ordinal (0 for -1) */

static const tr_backend *cpu(void) { return backend_cpu(); }

static int guarded(void) { /* with mu held */
  if (guard < 0) {
    const char *e = getenv("TRANSOM_EMU_GUARD");
    guard = !(e && strcmp(e, "0") == 0);
  }
  return guard;
}

static void protect_all(int prot) { /* with mu held */
  for (int i = 0; i < nregs; i++) mprotect(regs[i].p, regs[i].n, prot);
}

static void leave(void) {
  pthread_mutex_lock(&mu);
  if (--depth == 0 && guarded()) protect_all(PROT_NONE);
  pthread_mutex_unlock(&mu);
}

/* --- illegal addresses: the sticky device error --- */

/* p lies in an allocation (or is NULL, or nothing is tracked). With mu held. */
static int on_device(const void *p) {
  if (!p || !guarded()) return 1;
  const uint8_t *q = p;
  for (int i = 0; i < nregs; i++)
    if (q >= (const uint8_t *)regs[i].p && q < (const uint8_t *)regs[i].p + regs[i].n) return 1;
  return 0;
}

/* The device is lost: TR_EDEVICE with the first illegal address's message. */
static int lost_fail(void) { return tr_fail(TR_EDEVICE, "%s", lost_msg); }

/* Checks what `what` takes as device memory (n pointers) with mu held; the
 * first one outside every allocation loses the device. 0, or TR_EDEVICE
 * (the device was or is now lost). */
static int check_ptrs(const char *what, const void *const *ptrs, int n) {
  for (int i = 0; i < n && !lost; i++)
    if (!on_device(ptrs[i])) {
      lost = 1;
      snprintf(lost_msg, sizeof lost_msg,
               "emu: illegal address: %s was given %p as device memory (argument %d), which no device allocation "
               "holds (a host pointer?); the emulated device is unusable from now on, as a CUDA context is after "
               "an illegal address",
               what, ptrs[i], i + 1);
    }
  return lost ? lost_fail() : TR_OK;
}

/* Opens the memory for a call that takes device pointers (n of them):
 * returns 0 when it may run, else TR_EDEVICE (the memory is opened all the
 * same: leave() follows either way). */
static int enter_with(const char *what, const void *const *ptrs, int n) {
  pthread_mutex_lock(&mu);
  int rc = check_ptrs(what, ptrs, n);
  if (depth++ == 0 && guarded()) protect_all(PROT_READ | PROT_WRITE);
  pthread_mutex_unlock(&mu);
  return rc;
}

/* The device pointers of an argument list: pointers as they are, numbers
 * as NULL (the ops' other arguments are int and int64_t, the vector
 * kernels' also float). EMU_PTRS(a, b, ...) is an initializer list. */
#define EMU_PTR(x) _Generic((x), int: (const void *)0, long: (const void *)0, float: (const void *)0, \
                            default: (const void *)(uintptr_t)(x))
#define EMU_NARGS(...) EMU_NARGS_(__VA_ARGS__, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define EMU_NARGS_(a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, n, ...) n
#define EMU_CAT(a, b) EMU_CAT_(a, b)
#define EMU_CAT_(a, b) a##b
#define EMU_P1(a) EMU_PTR(a)
#define EMU_P2(a, ...) EMU_PTR(a), EMU_P1(__VA_ARGS__)
#define EMU_P3(a, ...) EMU_PTR(a), EMU_P2(__VA_ARGS__)
#define EMU_P4(a, ...) EMU_PTR(a), EMU_P3(__VA_ARGS__)
#define EMU_P5(a, ...) EMU_PTR(a), EMU_P4(__VA_ARGS__)
#define EMU_P6(a, ...) EMU_PTR(a), EMU_P5(__VA_ARGS__)
#define EMU_P7(a, ...) EMU_PTR(a), EMU_P6(__VA_ARGS__)
#define EMU_P8(a, ...) EMU_PTR(a), EMU_P7(__VA_ARGS__)
#define EMU_P9(a, ...) EMU_PTR(a), EMU_P8(__VA_ARGS__)
#define EMU_P10(a, ...) EMU_PTR(a), EMU_P9(__VA_ARGS__)
#define EMU_P11(a, ...) EMU_PTR(a), EMU_P10(__VA_ARGS__)
#define EMU_P12(a, ...) EMU_PTR(a), EMU_P11(__VA_ARGS__)
#define EMU_PTRS(...) {EMU_CAT(EMU_P, EMU_NARGS(__VA_ARGS__))(__VA_ARGS__)}
#define EMU_COUNT(arr) ((int)(sizeof(arr) / sizeof((arr)[0])))

/* --- memory --- */

static void *e_alloc(size_t bytes) {
  pthread_mutex_lock(&mu);
  if (lost) {
    lost_fail();
    pthread_mutex_unlock(&mu);
    return NULL;
  }
  if (!guarded()) {
    pthread_mutex_unlock(&mu);
    return tr_alloc_aligned(bytes ? bytes : 64);
  }
  size_t page = (size_t)sysconf(_SC_PAGESIZE), n = (bytes + page - 1) / page * page;
  if (n == 0) n = page;
  void *p = NULL;
  if (nregs == capregs) {
    int cap = capregs ? 2 * capregs : 64;
    region *nr = realloc(regs, sizeof *nr * (size_t)cap);
    if (!nr) goto out;
    regs = nr;
    capregs = cap;
  }
  p = mmap(NULL, n, depth > 0 ? PROT_READ | PROT_WRITE : PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    p = NULL;
    goto out;
  }
  regs[nregs++] = (region){p, n}; /* anonymous mappings are zeroed, as alloc promises */
out:
  pthread_mutex_unlock(&mu);
  return p;
}

static void e_free(void *p) {
  if (!p) return;
  pthread_mutex_lock(&mu);
  if (!guarded()) {
    pthread_mutex_unlock(&mu);
    tr_free_aligned(p);
    return;
  }
  for (int i = 0; i < nregs; i++)
    if (regs[i].p == p) {
      munmap(p, regs[i].n);
      regs[i] = regs[--nregs];
      break;
    }
  pthread_mutex_unlock(&mu);
}

/* A transfer: `dev` lists the sides that are device memory. */
static int transfer(const char *what, void *dst, const void *src, size_t bytes, int dst_dev, int src_dev) {
  const void *ptrs[2] = {dst_dev ? dst : NULL, src_dev ? src : NULL};
  int rc = enter_with(what, ptrs, 2);
  if (!rc && bytes) memcpy(dst, src, bytes);
  leave();
  return rc;
}
static int e_upload(void *dst, const void *src, size_t bytes) { return transfer("upload", dst, src, bytes, 1, 0); }
static int e_download(void *dst, const void *src, size_t bytes) {
  return transfer("download", dst, src, bytes, 0, 1);
}
static int e_copy(void *dst, const void *src, size_t bytes) { return transfer("copy", dst, src, bytes, 1, 1); }
static int e_ckpt_copy(void *dst, const void *src, size_t bytes) {
  return transfer("ckpt_copy", dst, src, bytes, 0, 1);
}

/* Reports the sticky error, as cudaStreamSynchronize does. */
static int e_sync(void) {
  pthread_mutex_lock(&mu);
  int rc = lost ? lost_fail() : TR_OK;
  pthread_mutex_unlock(&mu);
  return rc;
}

/* TRANSOM_EMU_DEVICES: the emulated devices visible, 0 when unset (no limit). */
static int emu_devices(void) {
  const char *e = getenv("TRANSOM_EMU_DEVICES");
  return e && *e ? atoi(e) : 0;
}

static int e_init(int ordinal, int threads) {
  int n = emu_devices();
  if (n > 0 && ordinal >= n)
    return tr_fail(TR_EINVAL,
                   "replica slot %d has no device of its own: %d emulated device(s) are visible "
                   "(TRANSOM_EMU_DEVICES); one device per replica, as on cuda",
                   ordinal, n);
  g_dev = ordinal < 0 ? 0 : ordinal;
  return cpu()->init(ordinal, threads);
}

static int e_devices(void) { return emu_devices() > 0 ? emu_devices() : 0; }
static const char *e_describe(void) {
  return "emulated device: host CPU kernels behind a device boundary (device memory closed to the host)";
}
static const char *e_error(void) { return tr_error(); }

/* --- every kernel: the cpu backend's, with the memory open --- */

/* A kernel on a lost device, or given a host pointer, does not run. */
#define WRAPV(name, params, args)                             \
  static void e_##name params {                               \
    const void *ptrs_[] = EMU_PTRS args;                      \
    if (!enter_with(#name, ptrs_, EMU_COUNT(ptrs_))) cpu()->name args; \
    leave();                                                  \
  }
#define WRAPB(name, params, args) /* bf16 table */            \
  static void eb_##name params {                              \
    const void *ptrs_[] = EMU_PTRS args;                      \
    if (!enter_with("bf16 " #name, ptrs_, EMU_COUNT(ptrs_))) cpu()->bf16->name args; \
    leave();                                                  \
  }

WRAPV(zero, (float *p, int64_t n), (p, n))
/* NaN when it cannot run (the cuda backend's sumsq gives NaN on an error too) */
static double e_sumsq(const float *p, int64_t n) {
  const void *ptrs[] = {p};
  double r = enter_with("sumsq", ptrs, 1) ? NAN : cpu()->sumsq(p, n);
  leave();
  return r;
}
WRAPV(scale, (float *p, int64_t n, float s), (p, n, s))
WRAPV(adamw,
      (float *p, const float *g, float *m, float *v, int64_t n, float lr, float b1, float b2, float eps, float wd,
       float c1, float c2),
      (p, g, m, v, n, lr, b1, b2, eps, wd, c1, c2))
WRAPB(to_bf16, (tr_bf16 * d, const float *s, int64_t n), (d, s, n))

/* the graph ops (ops.def): e_<K>_* over the fp32 table, eb_<K>_* over bf16 */
#define TR_ACT float
#define TR_OP(ID, NAME, K, HOST, INS, OUT, AUX, VOCAB, FP, FA, FC, BP, BA, BC) \
  WRAPV(K##_forward, FP, FA)                                                 \
  WRAPV(K##_backward, BP, BA)
#include "ops.def"
#undef TR_ACT
#define TR_ACT tr_bf16
#define TR_OP(ID, NAME, K, HOST, INS, OUT, AUX, VOCAB, FP, FA, FC, BP, BA, BC) \
  WRAPB(K##_forward, FP, FA)                                                 \
  WRAPB(K##_backward, BP, BA)
#include "ops.def"
#undef TR_ACT

static const tr_bf16_ops emu_bf16 = {
    .to_bf16 = eb_to_bf16,
#define TR_OP(ID, NAME, K, ...) .K##_forward = eb_##K##_forward, .K##_backward = eb_##K##_backward,
#include "ops.def"
};

/* --- level-1 checkpoint copies (the engine's copy thread) and the communicator --- */

static int e_ckpt_nothing(void) { return TR_OK; }

static int e_comm_id(uint8_t id[TR_COMM_ID_BYTES]) {
  int rc = e_sync();
  return rc ? rc : emu_comm_id(id);
}

static int e_comm_create(tr_comm **out, const uint8_t id[TR_COMM_ID_BYTES], int nranks, int rank, double timeout) {
  *out = NULL;
  int rc = e_sync();
  /* the device each rank is on, checked like NCCL's duplicate GPU (-1: no emulated devices, no check) */
  return rc ? rc : emu_comm_create_on(out, id, nranks, rank, timeout, emu_devices() > 0 ? g_dev : -1);
}

static int e_comm_allreduce(tr_comm *c, float *buf, size_t n, float scale, double deadline) {
  const void *ptrs[] = {buf};
  int rc = enter_with("comm_allreduce", ptrs, 1);
  if (!rc) rc = emu_comm_allreduce(c, buf, n, scale, deadline);
  leave();
  return rc;
}

/* The overlapped collectives: emu's kernels ran when they were called, so
 * a mark is a token and everything runs at once on the calling thread. */
static char emu_mark_token;

static int e_comm_mark(tr_mark **out) {
  *out = (tr_mark *)(void *)&emu_mark_token;
  return e_sync();
}

static void e_comm_mark_free(tr_mark *mark) { (void)mark; }

static int e_comm_copy(void *dst, const void *src, size_t bytes, const tr_mark *after) {
  (void)after;
  return transfer("comm_copy", dst, src, bytes, 1, 1);
}

static int e_comm_allreduce_async(tr_comm *c, float *buf, size_t n, float scale, const tr_mark *after,
                                  double deadline) {
  (void)after;
  return e_comm_allreduce(c, buf, n, scale, deadline);
}

/* Nothing is left to wait for: a failure was returned by the call that met it. */
static int e_comm_wait(tr_comm *c, double deadline) {
  (void)c;
  (void)deadline;
  return e_sync();
}

static const tr_backend emu_backend = {
    .abi = TR_BACKEND_ABI, .name = "emu", .host_memory = 0,
    .init = e_init, .devices = e_devices, .describe = e_describe, .error = e_error,
    .alloc = e_alloc, .free = e_free, .upload = e_upload, .download = e_download, .copy = e_copy, .sync = e_sync,
    .zero = e_zero, .sumsq = e_sumsq, .scale = e_scale, .adamw = e_adamw,
#define TR_OP(ID, NAME, K, ...) .K##_forward = e_##K##_forward, .K##_backward = e_##K##_backward,
#include "ops.def"
    .ckpt_mark = e_ckpt_nothing, .ckpt_copy = e_ckpt_copy, .ckpt_wait = e_sync,
    .comm_id = e_comm_id, .comm_create = e_comm_create, .comm_allreduce = e_comm_allreduce,
    .comm_destroy = emu_comm_destroy,
    .comm_mark = e_comm_mark, .comm_mark_free = e_comm_mark_free, .comm_copy = e_comm_copy,
    .comm_allreduce_async = e_comm_allreduce_async, .comm_wait = e_comm_wait,
    .bf16 = &emu_bf16,
};

const tr_backend *backend_emu(void) { return &emu_backend; }
