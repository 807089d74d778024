/* backend.c — the cpu backend and the loader of the CUDA plugin (see
 * backend.h); the emu backend is backend_emu.c. The cpu table's graph-op
 * entries are generated from ops.def (its HOST column names the kernels). */
#include "backend.h"

#include <dlfcn.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kernels.h"
#include "util.h"

/* --- core's kernels on host memory --- */

static int host_init(int ordinal, int threads) {
  (void)ordinal;
  if (threads <= 0) threads = (int)sysconf(_SC_NPROCESSORS_ONLN);
  kernels_set_threads(threads);
  return TR_OK;
}
static const char *cpu_describe(void) { return "host CPU (OpenBLAS + OpenMP)"; }
static const char *host_error(void) { return tr_error(); }

static void *host_alloc(size_t bytes) { return tr_alloc_aligned(bytes ? bytes : 64); }
static void host_free(void *p) { tr_free_aligned(p); }
static int host_memcpy(void *dst, const void *src, size_t bytes) {
  if (bytes) memcpy(dst, src, bytes);
  return TR_OK;
}
static int host_sync(void) { return TR_OK; }

static void host_adamw(float *p, const float *g, float *m, float *v, int64_t n, float lr, float b1, float b2,
                       float eps, float wd, float c1, float c2) {
#pragma omp parallel for schedule(static) if (n > 16384)
  for (int64_t i = 0; i < n; i++) {
    float gr = g[i];
    float mi = b1 * m[i] + (1.0f - b1) * gr;
    float vi = b2 * v[i] + (1.0f - b2) * gr * gr;
    m[i] = mi;
    v[i] = vi;
    p[i] -= lr * ((mi / c1) / (sqrtf(vi / c2) + eps) + wd * p[i]);
  }
}

/* cross_entropy under the table's contract (ops.def): the loss is written to
 * and its gradient read from memory; kernels.h's return and take them. */
static void host_crossentropy_forward(float *loss, float *probs, const float *logits, const int32_t *targets, int N,
                                      int V) {
  loss[0] = crossentropy_forward(probs, logits, targets, N, V);
}
static void host_crossentropy_backward(float *dlogits, const float *probs, const int32_t *targets, const float *dloss,
                                       int N, int V) {
  crossentropy_backward(dlogits, probs, targets, dloss[0], N, V);
}

static const tr_backend cpu_backend = {
    .abi = TR_BACKEND_ABI, .name = "cpu", .host_memory = 1,
    .init = host_init, .describe = cpu_describe, .error = host_error,
    .alloc = host_alloc, .free = host_free, .upload = host_memcpy, .download = host_memcpy, .copy = host_memcpy,
    .sync = host_sync,
    .zero = par_zero, .sumsq = par_sumsq, .scale = par_scale, .adamw = host_adamw,
#define TR_OP(ID, NAME, K, HOST, ...) .K##_forward = HOST##_forward, .K##_backward = HOST##_backward,
#include "ops.def"
    .bf16 = &kernels_bf16_ops,
};

const tr_backend *backend_cpu(void) { return &cpu_backend; }

/* --- the CUDA plugin --- */

int backend_cuda_path(char *buf, size_t len) {
  const char *env = getenv("TRANSOM_CUDA_LIB");
  if (env && *env) {
    snprintf(buf, len, "%s", env);
    return TR_OK;
  }
  char exe[4096];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n <= 0) return tr_fail(TR_EIO, "cannot find the running executable (/proc/self/exe)");
  exe[n] = 0;
  char *slash = strrchr(exe, '/');
  if (slash) *slash = 0;
  snprintf(buf, len, "%s/libtransom_cuda.so", exe);
  return TR_OK;
}

/* The first op of ops.def the table has no kernel for (a NULL member), or
 * NULL: the plugin's tables are generated from ops.def, this checks it. */
static const char *missing_op(const tr_backend *be) {
  const tr_bf16_ops *b = be->bf16;
#define TR_OP(ID, NAME, K, ...) \
  if (!be->K##_forward || !be->K##_backward || (b && (!b->K##_forward || !b->K##_backward))) return #NAME;
#include "ops.def"
  return b && !b->to_bf16 ? "to_bf16" : NULL;
}

static pthread_mutex_t load_mu = PTHREAD_MUTEX_INITIALIZER;
static const tr_backend *cuda_backend;

static const tr_backend *load_cuda(void) {
  if (cuda_backend) return cuda_backend;
  char path[4200];
  if (backend_cuda_path(path, sizeof path)) return NULL;
  if (access(path, F_OK) != 0) {
    tr_fail(TR_EINVAL,
            "device = \"cuda\": %s does not exist: this transom was built without the CUDA backend "
            "(it is built when CMake finds nvcc; TRANSOM_CUDA=OFF leaves it out)",
            path);
    return NULL;
  }
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    tr_fail(TR_EIO, "device = \"cuda\": cannot load %s: %s", path, dlerror());
    return NULL;
  }
  const tr_backend *(*get)(int) = (const tr_backend *(*)(int))dlsym(h, "transom_backend_cuda");
  const tr_backend *be = get ? get(TR_BACKEND_ABI) : NULL;
  if (!be) {
    tr_fail(TR_EIO, "device = \"cuda\": %s is not a transom backend of ABI %d", path, TR_BACKEND_ABI);
    dlclose(h);
    return NULL;
  }
  const char *missing = missing_op(be);
  if (missing) {
    tr_fail(TR_EIO, "device = \"cuda\": %s has no kernel for the op '%s'", path, missing);
    dlclose(h);
    return NULL;
  }
  cuda_backend = be; /* stays loaded for the life of the process */
  return be;
}

const tr_backend *backend_get(const char *name, int threads) {
  const tr_backend *be = backend_load(name);
  if (!be) return NULL;
  /* the replica's GPU on its host: the operator's slot, else what an outside
   * launcher says (torchrun's LOCAL_RANK, Slurm's SLURM_LOCALID) */
  const char *lr = getenv("TRANSOM_LOCAL_RANK");
  if (!lr || !*lr) lr = getenv("LOCAL_RANK");
  if (!lr || !*lr) lr = getenv("SLURM_LOCALID");
  int ordinal = lr && *lr ? atoi(lr) : -1;
  if (be->init(ordinal < 0 ? -1 : ordinal, threads)) {
    char why[512]; /* be->error() may be tr_error()'s own buffer */
    snprintf(why, sizeof why, "%s", be->error());
    tr_fail(TR_EIO, "device = \"%s\": %s", name, why);
    return NULL;
  }
  return be;
}

const tr_backend *backend_load(const char *name) {
  const tr_backend *be = NULL;
  if (strcmp(name, "cpu") == 0) be = &cpu_backend;
  else if (strcmp(name, "emu") == 0) be = backend_emu();
  else if (strcmp(name, "cuda") == 0) {
    pthread_mutex_lock(&load_mu);
    be = load_cuda();
    pthread_mutex_unlock(&load_mu);
    if (!be) return NULL;
  } else {
    tr_fail(TR_EINVAL, "unknown device '%s' (cpu, cuda, emu)", name);
    return NULL;
  }
  return be;
}
