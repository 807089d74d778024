/* cuda_internal.h — what the files of the CUDA plugin share (not core's API).
 *
 * backend.cu owns the device, the compute stream, the cuBLAS handle and the
 * thread-local error message; comm.cu (NCCL) uses them. Both are compiled by
 * nvcc into libtransom_cuda.so; nothing here is exported.
 */
#ifndef TRANSOM_CUDA_INTERNAL_H
#define TRANSOM_CUDA_INTERNAL_H

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"

/* The compute stream: every kernel, cuBLAS call and (comm_allreduce)
 * collective is queued on it. */
cudaStream_t tc_stream(void);
/* The communication stream: the overlapped collectives (comm_copy,
 * comm_allreduce_async) and every communicator's warm-up. */
cudaStream_t tc_comm_stream(void);
/* Sets the calling thread's error message; returns code (a TR_* value). */
int tc_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The calling thread's error message (error()). */
const char *tc_last_error(void);
/* TR_EIO with "what: <cuda error string>" when e != cudaSuccess, else 0;
 * TC_EDEVICE (and the device lost) when e corrupts the context. */
int tc_check(cudaError_t e, const char *what);
/* 1 when e leaves the CUDA context corrupted ("the process must be
 * terminated and relaunched": every later call returns it). */
int tc_sticky(cudaError_t e);
/* Marks the device lost for good (printf-style reason; the first one
 * stays): every later call of the plugin fails at once with TC_EDEVICE.
 * Returns TC_EDEVICE, with error() set. Any thread. */
int tc_device_lost(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Makes the init device current for the calling thread, lost or not (a
 * helper thread that must still free what it can). */
int tc_set_device(void);
/* TC_EDEVICE when the device is lost or the compute stream holds an error
 * that corrupts the context, else 0 (a peer's failure is not ours). */
int tc_probe(void);

/* comm.cu: the NCCL functions of the table (see backend.h). */
int tc_comm_id(uint8_t id[TR_COMM_ID_BYTES]);
int tc_comm_create(tr_comm **out, const uint8_t id[TR_COMM_ID_BYTES], int nranks, int rank, double timeout);
int tc_comm_allreduce(tr_comm *c, float *buf, size_t n, float scale, double deadline);
void tc_comm_destroy(tr_comm *c, int finalize);
int tc_comm_allreduce_async(tr_comm *c, float *buf, size_t n, float scale, const tr_mark *after, double deadline);
int tc_comm_wait(tr_comm *c, double deadline);
/* Frees c's host memory only (its device is lost: nothing may touch it). */
void tc_comm_forget(tr_comm *c);

/* TR_* codes (util.h values; the plugin does not include core's util.h). */
enum { TC_OK = 0, TC_ENOMEM = -1, TC_EINVAL = -2, TC_EIO = -3, TC_ESTATE = -6, TC_EDEVICE = -7 };

#endif
