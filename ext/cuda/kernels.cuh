/* kernels.cuh — what backend.cu and kernels.cu share (plugin-internal, not
 * core's API; nothing here is exported).
 *
 * kernels.cu holds the device kernels and one launcher per op of the table
 * (tk_*, the signatures of tr_backend's members). backend.cu owns what the
 * launchers borrow: the current device, the compute stream (tc_stream, in
 * cuda_internal.h), the cuBLAS handle, the plugin's cached scratch buffers
 * and the deferred error.
 *
 * Launchers return nothing (backend.h: a failed launch is reported by the
 * next sync()/download()), so a launch error, a cuBLAS error or a scratch
 * buffer that cannot grow is recorded with tc_defer and the op is skipped;
 * sync, upload, download and copy report it. Launchers are called by the
 * training thread only (the one thread that drives the compute stream).
 */
#ifndef TRANSOM_CUDA_KERNELS_CUH
#define TRANSOM_CUDA_KERNELS_CUH

#include <cublas_v2.h>

#include "cuda_internal.h"

/* --- from backend.cu --- */

/* The cuBLAS handle, bound to tc_stream(). */
cublasHandle_t tc_blas(void);
/* Makes the init device current for the calling thread (the CUDA current
 * device is per host thread). 0, or TC_EIO with the error also deferred. */
int tc_enter(void);
/* Records the error of queued work for the next sync/upload/download/copy
 * to report (the first one wins until reported); also sets error(). */
void tc_defer(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Defers e (or, when e is cudaSuccess, the launch error that
 * cudaGetLastError holds) as "what: <cuda error string>". Returns 0, or
 * TC_EIO when there was an error. */
int tc_queued(cudaError_t e, const char *what);
/* Defers a cuBLAS failure. */
void tc_blas_check(cublasStatus_t s, const char *what);

/* Device scratch, one buffer per slot, grown on demand (the stream is
 * synchronised before a buffer is replaced) and kept for the life of the
 * process. NULL (error deferred) when it cannot grow. */
enum { TC_SLOT_ATTN, TC_SLOT_XENT, TC_SLOT_SUMSQ, TC_SLOT_EMBED, TC_SLOT_COLSUM, TC_NSLOTS };
void *tc_scratch(int slot, size_t bytes);

/* --- kernels.cu: the launchers of the table (contracts: backend.h, kernels.h) --- */

void tk_zero(float *p, int64_t n);
double tk_sumsq(const float *p, int64_t n);
void tk_scale(float *p, int64_t n, float s);
void tk_adamw(float *p, const float *g, float *m, float *v, int64_t n, float lr, float b1, float b2, float eps,
              float wd, float c1, float c2);

/* the graph ops: tk_<K>_forward, tk_<K>_backward for every op of ops.def */
#define TR_ACT float
#define TR_OP(ID, NAME, K, HOST, INS, OUT, AUX, VOCAB, FP, FA, FC, BP, BA, BC) \
  void tk_##K##_forward FP;                                                  \
  void tk_##K##_backward BP;
#include "ops.def"
#undef TR_ACT

/* --- kernels_bf16.cu: backend.h's tr_bf16_ops (bf16 activations, fp32 master
 * weights), launchers with the same discipline as the tk_* above --- */
const tr_bf16_ops *tk_bf16_ops(void);

#endif
