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
 * memory; faster).
 *
 * Otherwise it is the cpu backend: the same kernels in the same order, so a
 * run on emu gives the bits of a run on cpu. The wrappers of the graph ops
 * (open the memory, call the cpu table, close it) are generated from ops.def.
 */
#include <pthread.h>
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

static void enter(void) {
  pthread_mutex_lock(&mu);
  if (depth++ == 0 && guarded()) protect_all(PROT_READ | PROT_WRITE);
  pthread_mutex_unlock(&mu);
}

static void leave(void) {
  pthread_mutex_lock(&mu);
  if (--depth == 0 && guarded()) protect_all(PROT_NONE);
  pthread_mutex_unlock(&mu);
}

/* --- memory --- */

static void *e_alloc(size_t bytes) {
  pthread_mutex_lock(&mu);
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

static int e_memcpy(void *dst, const void *src, size_t bytes) {
  enter();
  if (bytes) memcpy(dst, src, bytes);
  leave();
  return TR_OK;
}

static int e_sync(void) { return TR_OK; }
static int e_init(int ordinal, int threads) { return cpu()->init(ordinal, threads); }
static const char *e_describe(void) {
  return "emulated device: host CPU kernels behind a device boundary (device memory closed to the host)";
}
static const char *e_error(void) { return tr_error(); }

/* --- every kernel: the cpu backend's, with the memory open --- */

#define WRAP(ret, name, params, args) \
  static ret e_##name params {        \
    enter();                          \
    ret r = cpu()->name args;         \
    leave();                          \
    return r;                         \
  }
#define WRAPV(name, params, args) \
  static void e_##name params {   \
    enter();                      \
    cpu()->name args;             \
    leave();                      \
  }
#define WRAPB(name, params, args) /* bf16 table */ \
  static void eb_##name params {                   \
    enter();                                       \
    cpu()->bf16->name args;                        \
    leave();                                       \
  }

WRAPV(zero, (float *p, int64_t n), (p, n))
WRAP(double, sumsq, (const float *p, int64_t n), (p, n))
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

static int e_comm_allreduce(tr_comm *c, float *buf, size_t n, float scale, double deadline) {
  enter();
  int rc = emu_comm_allreduce(c, buf, n, scale, deadline);
  leave();
  return rc;
}

static const tr_backend emu_backend = {
    .abi = TR_BACKEND_ABI, .name = "emu", .host_memory = 0,
    .init = e_init, .describe = e_describe, .error = e_error,
    .alloc = e_alloc, .free = e_free, .upload = e_memcpy, .download = e_memcpy, .copy = e_memcpy, .sync = e_sync,
    .zero = e_zero, .sumsq = e_sumsq, .scale = e_scale, .adamw = e_adamw,
#define TR_OP(ID, NAME, K, ...) .K##_forward = e_##K##_forward, .K##_backward = e_##K##_backward,
#include "ops.def"
    .ckpt_mark = e_ckpt_nothing, .ckpt_copy = e_memcpy, .ckpt_wait = e_ckpt_nothing,
    .comm_id = emu_comm_id, .comm_create = emu_comm_create, .comm_allreduce = e_comm_allreduce,
    .comm_destroy = emu_comm_destroy,
    .bf16 = &emu_bf16,
};

const tr_backend *backend_emu(void) { return &emu_backend; }
