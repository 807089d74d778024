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
 * run on emu gives the bits of a run on cpu.
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
WRAPV(embed_forward, (float *o, const int32_t *tok, const float *wte, const float *wpe, int B, int T, int C),
      (o, tok, wte, wpe, B, T, C))
WRAPV(embed_backward, (float *dwte, float *dwpe, const float *d, const int32_t *tok, int B, int T, int C),
      (dwte, dwpe, d, tok, B, T, C))
WRAPV(linear_forward, (float *o, const float *x, const float *w, const float *b, int N, int C, int OC),
      (o, x, w, b, N, C, OC))
WRAPV(linear_backward,
      (float *dx, float *dw, float *db, const float *d, const float *x, const float *w, int N, int C, int OC),
      (dx, dw, db, d, x, w, N, C, OC))
WRAPV(layernorm_forward,
      (float *o, float *mean, float *rstd, const float *x, const float *w, const float *b, int N, int C),
      (o, mean, rstd, x, w, b, N, C))
WRAPV(layernorm_backward,
      (float *dx, float *dw, float *db, const float *d, const float *x, const float *w, const float *mean,
       const float *rstd, int N, int C),
      (dx, dw, db, d, x, w, mean, rstd, N, C))
WRAPV(gelu_forward, (float *o, const float *x, int64_t n), (o, x, n))
WRAPV(gelu_backward, (float *dx, const float *x, const float *d, int64_t n), (dx, x, d, n))
WRAPV(add_forward, (float *o, const float *a, const float *b, int64_t n), (o, a, b, n))
WRAPV(add_backward, (float *da, float *db, const float *d, int64_t n), (da, db, d, n))
WRAPV(attention_forward, (float *o, float *att, const float *qkv, int B, int T, int C, int NH),
      (o, att, qkv, B, T, C, NH))
WRAPV(attention_backward,
      (float *dqkv, float *s, const float *d, const float *qkv, const float *att, int B, int T, int C, int NH),
      (dqkv, s, d, qkv, att, B, T, C, NH))
WRAPV(crossentropy_forward, (float *loss, float *p, const float *l, const int32_t *t, int N, int V),
      (loss, p, l, t, N, V))
WRAPV(crossentropy_backward, (float *dl, const float *p, const int32_t *t, const float *dloss, int N, int V),
      (dl, p, t, dloss, N, V))

WRAPB(to_bf16, (tr_bf16 * d, const float *s, int64_t n), (d, s, n))
WRAPB(embed_forward, (tr_bf16 * o, const int32_t *tok, const float *wte, const float *wpe, int B, int T, int C),
      (o, tok, wte, wpe, B, T, C))
WRAPB(embed_backward, (float *dwte, float *dwpe, const tr_bf16 *d, const int32_t *tok, int B, int T, int C),
      (dwte, dwpe, d, tok, B, T, C))
WRAPB(linear_forward, (tr_bf16 * o, const tr_bf16 *x, const tr_bf16 *w, const float *b, int N, int C, int OC),
      (o, x, w, b, N, C, OC))
WRAPB(linear_backward,
      (tr_bf16 * dx, float *dw, float *db, const tr_bf16 *d, const tr_bf16 *x, const tr_bf16 *w, int N, int C,
       int OC),
      (dx, dw, db, d, x, w, N, C, OC))
WRAPB(layernorm_forward,
      (tr_bf16 * o, float *mean, float *rstd, const tr_bf16 *x, const float *w, const float *b, int N, int C),
      (o, mean, rstd, x, w, b, N, C))
WRAPB(layernorm_backward,
      (tr_bf16 * dx, float *dw, float *db, const tr_bf16 *d, const tr_bf16 *x, const float *w, const float *mean,
       const float *rstd, int N, int C),
      (dx, dw, db, d, x, w, mean, rstd, N, C))
WRAPB(gelu_forward, (tr_bf16 * o, const tr_bf16 *x, int64_t n), (o, x, n))
WRAPB(gelu_backward, (tr_bf16 * dx, const tr_bf16 *x, const tr_bf16 *d, int64_t n), (dx, x, d, n))
WRAPB(add_forward, (tr_bf16 * o, const tr_bf16 *a, const tr_bf16 *b, int64_t n), (o, a, b, n))
WRAPB(add_backward, (tr_bf16 * da, tr_bf16 *db, const tr_bf16 *d, int64_t n), (da, db, d, n))
WRAPB(attention_forward, (tr_bf16 * o, tr_bf16 *att, const tr_bf16 *qkv, int B, int T, int C, int NH),
      (o, att, qkv, B, T, C, NH))
WRAPB(attention_backward,
      (tr_bf16 * dqkv, tr_bf16 *s, const tr_bf16 *d, const tr_bf16 *qkv, const tr_bf16 *att, int B, int T, int C,
       int NH),
      (dqkv, s, d, qkv, att, B, T, C, NH))
WRAPB(crossentropy_forward, (float *loss, tr_bf16 *p, const tr_bf16 *l, const int32_t *t, int N, int V),
      (loss, p, l, t, N, V))
WRAPB(crossentropy_backward, (tr_bf16 * dl, const tr_bf16 *p, const int32_t *t, const float *dloss, int N, int V),
      (dl, p, t, dloss, N, V))

static const tr_bf16_ops emu_bf16 = {
    .to_bf16 = eb_to_bf16, .embed_forward = eb_embed_forward, .embed_backward = eb_embed_backward,
    .linear_forward = eb_linear_forward, .linear_backward = eb_linear_backward,
    .layernorm_forward = eb_layernorm_forward, .layernorm_backward = eb_layernorm_backward,
    .gelu_forward = eb_gelu_forward, .gelu_backward = eb_gelu_backward, .add_forward = eb_add_forward,
    .add_backward = eb_add_backward, .attention_forward = eb_attention_forward,
    .attention_backward = eb_attention_backward, .crossentropy_forward = eb_crossentropy_forward,
    .crossentropy_backward = eb_crossentropy_backward,
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
    .embed_forward = e_embed_forward, .embed_backward = e_embed_backward,
    .linear_forward = e_linear_forward, .linear_backward = e_linear_backward,
    .layernorm_forward = e_layernorm_forward, .layernorm_backward = e_layernorm_backward,
    .gelu_forward = e_gelu_forward, .gelu_backward = e_gelu_backward,
    .add_forward = e_add_forward, .add_backward = e_add_backward,
    .attention_forward = e_attention_forward, .attention_backward = e_attention_backward,
    .crossentropy_forward = e_crossentropy_forward, .crossentropy_backward = e_crossentropy_backward,
    .ckpt_mark = e_ckpt_nothing, .ckpt_copy = e_memcpy, .ckpt_wait = e_ckpt_nothing,
    .comm_id = emu_comm_id, .comm_create = emu_comm_create, .comm_allreduce = e_comm_allreduce,
    .comm_destroy = emu_comm_destroy,
    .bf16 = &emu_bf16,
};

const tr_backend *backend_emu(void) { return &emu_backend; }
