/* kernels.cu — the CUDA kernels of the graph ops and the optimizer's vector
 * ops, with their launchers (tk_*, the members of the table; see
 * kernels.cuh and backend.cu).
 *
 * Contracts: core/tensor/include/kernels.h, with the same semantics on device pointers,
 * queued on tc_stream() in call order. Legend: B = batch, T = time,
 * C = channels, OC = output channels, V = vocabulary, NH = heads,
 * hs = C/NH head size, N = B*T rows. Row-major fp32, int32 token ids.
 *
 * Accumulation rule (as kernels.h): every backward kernel ADDS into its
 * gradient outputs, parameter and activation gradients alike (`+=`); a NULL
 * gradient output is skipped.
 *
 * Determinism: every reduction has a fixed shape (fixed grid or one thread,
 * warp or block per output, summed in a fixed order), and cuBLAS is
 * deterministic on one stream, so a fixed device and shape give the same
 * bits on every run. There are no atomics; embed_backward's token-gradient
 * sum, where several positions hold one token, sorts the positions by token
 * (a stable radix sort) and adds them in position order, as the CPU does.
 * Sums are ordered differently from the CPU's, so results match it to fp32
 * rounding, not bitwise (embed_backward excepted).
 *
 * Matmuls: cuBLAS is column-major. A row-major (R,K) matrix is the
 * column-major (K,R) matrix, its transpose, so row-major Y = A B is computed
 * as column-major Y^T = B^T A^T: each call below passes the operands
 * swapped, with a comment giving the row-major product.
 *
 * Nothing here checks shapes (the graph did): pointers must be device
 * pointers of the sizes in kernels.h, and token ids / targets must be in
 * range (the host checks them; crossentropy still never reads outside a row
 * and gives NaN for a bad target, like the CPU).
 */
#include <cub/device/device_radix_sort.cuh>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <math.h>
#include <math_constants.h>
#include <stdint.h>

#include "device.cuh"
#include "kernels.cuh"

enum {
  SUMSQ_BLOCKS = 1024, /* fixed: the order of the sum does not depend on the device */
  SUMSQ_THREADS = 256,
};

/* --- vector ops --- */

void tk_zero(float *p, int64_t n) {
  if (n <= 0 || tc_enter()) return;
  tc_queued(cudaMemsetAsync(p, 0, sizeof(float) * (size_t)n, tc_stream()), "zero (cudaMemsetAsync)");
}

/* part[block] = sum of squares of this block's grid-stride share, in double */
static __global__ void sumsq_partial_kernel(double *part, const float *p, int64_t n) {
  double s = 0.0;
  GRID_STRIDE(i, n) s += (double)p[i] * p[i];
  s = block_reduce(s, SumOp(), 0.0);
  if (threadIdx.x == 0) part[blockIdx.x] = s;
}

/* one block of SUMSQ_BLOCKS threads: out[0] = sum of the partials */
static __global__ void sumsq_final_kernel(double *out, const double *part) {
  double s = block_reduce(part[threadIdx.x], SumOp(), 0.0);
  if (threadIdx.x == 0) out[0] = s;
}

double tk_sumsq(const float *p, int64_t n) {
  if (n <= 0) return 0.0;
  if (tc_enter()) return NAN;
  double *buf = (double *)tc_scratch(TC_SLOT_SUMSQ, sizeof(double) * (SUMSQ_BLOCKS + 1));
  if (!buf) return NAN;
  cudaStream_t st = tc_stream();
  sumsq_partial_kernel<<<SUMSQ_BLOCKS, SUMSQ_THREADS, 0, st>>>(buf, p, n);
  if (tc_queued(cudaSuccess, "sumsq")) return NAN;
  sumsq_final_kernel<<<1, SUMSQ_BLOCKS, 0, st>>>(buf + SUMSQ_BLOCKS, buf);
  if (tc_queued(cudaSuccess, "sumsq")) return NAN;
  double h = NAN;
  cudaError_t e = cudaMemcpyAsync(&h, buf + SUMSQ_BLOCKS, sizeof h, cudaMemcpyDeviceToHost, st);
  if (e == cudaSuccess) e = cudaStreamSynchronize(st);
  if (e != cudaSuccess) {
    tc_queued(e, "sumsq (reading the result)");
    return NAN;
  }
  return h;
}

static __global__ void scale_kernel(float *p, int64_t n, float s) {
  GRID_STRIDE(i, n) p[i] *= s;
}

void tk_scale(float *p, int64_t n, float s) {
  if (n <= 0 || tc_enter()) return;
  scale_kernel<<<ew_blocks(n), EW_THREADS, 0, tc_stream()>>>(p, n, s);
  tc_queued(cudaSuccess, "scale");
}

/* the formula of backend.h (core/tensor/backend.c host_adamw) */
static __global__ void adamw_kernel(float *p, const float *g, float *m, float *v, int64_t n, float lr, float b1,
                                    float b2, float eps, float wd, float c1, float c2) {
  GRID_STRIDE(i, n) {
    float gr = g[i];
    float mi = b1 * m[i] + (1.0f - b1) * gr;
    float vi = b2 * v[i] + (1.0f - b2) * gr * gr;
    m[i] = mi;
    v[i] = vi;
    p[i] -= lr * ((mi / c1) / (sqrtf(vi / c2) + eps) + wd * p[i]);
  }
}

void tk_adamw(float *p, const float *g, float *m, float *v, int64_t n, float lr, float b1, float b2, float eps,
              float wd, float c1, float c2) {
  if (n <= 0 || tc_enter()) return;
  adamw_kernel<<<ew_blocks(n), EW_THREADS, 0, tc_stream()>>>(p, g, m, v, n, lr, b1, b2, eps, wd, c1, c2);
  tc_queued(cudaSuccess, "adamw");
}

/* --- embedding --- */

/* out (B,T,C) = wte[tok[b,t]] + wpe[t] (wpe may be NULL) */
static __global__ void embed_forward_kernel(float *out, const int32_t *tok, const float *wte, const float *wpe,
                                            int T, int C, int64_t n) {
  GRID_STRIDE(i, n) {
    const int c = (int)(i % C);
    const int64_t bt = i / C;
    const float e = wte[(int64_t)tok[bt] * C + c];
    out[i] = wpe ? e + wpe[(bt % T) * C + c] : e;
  }
}

void tk_embed_forward(float *out, const int32_t *tok, const float *wte, const float *wpe, int B, int T, int C) {
  const int64_t n = (int64_t)B * T * C;
  if (n <= 0 || tc_enter()) return;
  embed_forward_kernel<<<ew_blocks(n), EW_THREADS, 0, tc_stream()>>>(out, tok, wte, wpe, T, C, n);
  tc_queued(cudaSuccess, "embed_forward");
}

void tk_embed_backward(float *dwte, float *dwpe, const float *dout, const int32_t *tok, int B, int T, int C) {
  embed_backward_launch(dwte, dwpe, dout, tok, B, T, C, "embed_backward");
}

/* --- linear --- */

/* out (N,OC) = bias broadcast over rows */
static __global__ void bias_fill_kernel(float *out, const float *bias, int OC, int64_t n) {
  GRID_STRIDE(i, n) out[i] = bias[i % OC];
}

void tk_linear_forward(float *out, const float *inp, const float *w, const float *bias, int N, int C, int OC) {
  if (N <= 0 || C <= 0 || OC <= 0 || tc_enter()) return;
  const float one = 1.0f, zero = 0.0f;
  const int64_t n = (int64_t)N * OC;
  /* as the CPU: out = bias, then out += inp w^T */
  if (bias) {
    bias_fill_kernel<<<ew_blocks(n), EW_THREADS, 0, tc_stream()>>>(out, bias, OC, n);
    tc_queued(cudaSuccess, "linear_forward (bias)");
  }
  /* row-major out (N,OC) = inp (N,C) . w^T (C,OC) */
  tc_blas_check(cublasSgemm(tc_blas(), CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, &one, w, C, inp, C, bias ? &one : &zero,
                            out, OC),
                "linear_forward: cublasSgemm");
}

void tk_linear_backward(float *dinp, float *dw, float *dbias, const float *dout, const float *inp, const float *w,
                        int N, int C, int OC) {
  if (N <= 0 || C <= 0 || OC <= 0 || tc_enter()) return;
  const float one = 1.0f;
  if (dinp) /* row-major dinp (N,C) += dout (N,OC) . w (OC,C) */
    tc_blas_check(cublasSgemm(tc_blas(), CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, &one, w, C, dout, OC, &one, dinp, C),
                  "linear_backward (dinp): cublasSgemm");
  if (dw) /* row-major dw (OC,C) += dout^T (OC,N) . inp (N,C) */
    tc_blas_check(cublasSgemm(tc_blas(), CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, &one, inp, C, dout, OC, &one, dw, C),
                  "linear_backward (dw): cublasSgemm");
  if (dbias) { /* dbias (OC) += column sums of dout */
    float *part = (float *)tc_scratch(TC_SLOT_COLSUM, sizeof(float) * (size_t)colsum_slices(N, OC) * (size_t)OC);
    if (part) colsum_add(dbias, part, dout, N, OC, tc_stream());
  }
}

/* --- layernorm (the kernels are device.cuh's, as for bf16) --- */

void tk_layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *w, const float *b,
                          int N, int C) {
  if (N <= 0 || C <= 0 || tc_enter()) return;
  layernorm_forward_kernel<<<row_blocks(N), 32 * ROW_WARPS, 0, tc_stream()>>>(out, mean, rstd, inp, w, b, N, C);
  tc_queued(cudaSuccess, "layernorm_forward");
}

void tk_layernorm_backward(float *dinp, float *dw, float *db, const float *dout, const float *inp, const float *w,
                           const float *mean, const float *rstd, int N, int C) {
  if (N <= 0 || C <= 0 || tc_enter()) return;
  cudaStream_t st = tc_stream();
  if (dinp) {
    layernorm_dinp_kernel<<<row_blocks(N), 32 * ROW_WARPS, 0, st>>>(dinp, dout, inp, w, mean, rstd, N, C);
    tc_queued(cudaSuccess, "layernorm_backward (dinp)");
  }
  if (dw || db) {
    float *part = (float *)tc_scratch(TC_SLOT_COLSUM, sizeof(float) * 2 * (size_t)colsum_slices(N, C) * (size_t)C);
    if (part) layernorm_dparams(dw, db, part, dout, inp, mean, rstd, N, C, st);
  }
}

/* --- GELU (device.cuh) --- */

void tk_gelu_forward(float *out, const float *inp, int64_t n) {
  if (n <= 0 || tc_enter()) return;
  gelu_forward_kernel<<<ew_blocks(n), EW_THREADS, 0, tc_stream()>>>(out, inp, n);
  tc_queued(cudaSuccess, "gelu_forward");
}

void tk_gelu_backward(float *dinp, const float *inp, const float *dout, int64_t n) {
  if (!dinp || n <= 0 || tc_enter()) return;
  gelu_backward_kernel<<<ew_blocks(n), EW_THREADS, 0, tc_stream()>>>(dinp, inp, dout, n);
  tc_queued(cudaSuccess, "gelu_backward");
}

/* --- residual add --- */

void tk_add_forward(float *out, const float *a, const float *b, int64_t n) {
  if (n <= 0 || tc_enter()) return;
  add_forward_kernel<<<ew_blocks(n), EW_THREADS, 0, tc_stream()>>>(out, a, b, n);
  tc_queued(cudaSuccess, "add_forward");
}

void tk_add_backward(float *da, float *db, const float *dout, int64_t n) {
  if ((!da && !db) || n <= 0 || tc_enter()) return;
  add_backward_kernel<<<ew_blocks(n), EW_THREADS, 0, tc_stream()>>>(da, db, dout, n);
  tc_queued(cudaSuccess, "add_backward");
}

/* --- causal self-attention ---
 * The layout kernels (split, merge) are device.cuh's. att (B,NH,T,T) holds
 * the probabilities, exactly 0 above the diagonal (as the CPU). */

/* In place over rows (B*NH*T rows of T): row t of a head keeps softmax of
 * its first t+1 entries and 0 after them. One warp per row. */
static __global__ void causal_softmax_kernel(float *att, int64_t rows, int T) {
  const int64_t r = (int64_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const int t = (int)(r % T);
  float *row = att + r * T;
  float mx = -CUDART_INF_F;
  for (int j = lane; j <= t; j += 32) mx = fmaxf(mx, row[j]);
  mx = warp_reduce(mx, MaxOp());
  float s = 0.0f;
  for (int j = lane; j <= t; j += 32) {
    const float e = expf(row[j] - mx);
    row[j] = e;
    s += e;
  }
  const float inv = 1.0f / warp_reduce(s, SumOp());
  for (int j = lane; j < T; j += 32) row[j] = j <= t ? row[j] * inv : 0.0f;
}

/* In place: datt -> dpreatt = att * (datt - sum(att * datt)) * scale on and
 * below the diagonal, 0 above. One warp per row. */
static __global__ void causal_softmax_backward_kernel(float *d, const float *att, int64_t rows, int T, float scale) {
  const int64_t r = (int64_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const int t = (int)(r % T);
  float *dr = d + r * T;
  const float *ar = att + r * T;
  float dot = 0.0f;
  for (int j = lane; j <= t; j += 32) dot += ar[j] * dr[j];
  dot = warp_reduce(dot, SumOp());
  for (int j = lane; j < T; j += 32) dr[j] = j <= t ? ar[j] * (dr[j] - dot) * scale : 0.0f;
}

void tk_attention_forward(float *out, float *att, const float *qkv, int B, int T, int C, int NH) {
  if (B <= 0 || T <= 0 || C <= 0 || NH <= 0 || tc_enter()) return;
  const int hs = C / NH, BH = B * NH;
  const int64_t n = (int64_t)B * T * C, sh = (int64_t)T * hs, stt = (int64_t)T * T;
  float *s = (float *)tc_scratch(TC_SLOT_ATTN, sizeof(float) * 4 * (size_t)n);
  if (!s) return;
  float *q = s, *k = s + n, *v = s + 2 * n, *y = s + 3 * n; /* each (B,NH,T,hs) */
  cudaStream_t st = tc_stream();
  cublasHandle_t h = tc_blas();
  const float scale = 1.0f / sqrtf((float)hs), one = 1.0f, zero = 0.0f;

  attn_split_qkv_kernel<<<ew_blocks(n), EW_THREADS, 0, st>>>(q, k, v, qkv, T, C, NH, n);
  tc_queued(cudaSuccess, "attention_forward (split)");
  /* per head, row-major att (T,T) = scale * q (T,hs) . k^T (hs,T), by panels
   * of rows [r0,r1) against keys [0,r1): the softmax zeroes the rest */
  const int R = attn_panel_rows(T);
  for (int r0 = 0; r0 < T; r0 += R) {
    const int r1 = T - r0 < R ? T : r0 + R;
    tc_blas_check(cublasSgemmStridedBatched(h, CUBLAS_OP_T, CUBLAS_OP_N, r1, r1 - r0, hs, &scale, k, hs, sh,
                                            q + (int64_t)r0 * hs, hs, sh, &zero, att + (int64_t)r0 * T, T, stt, BH),
                  "attention_forward (q k^T): cublasSgemmStridedBatched");
  }
  causal_softmax_kernel<<<row_blocks((int64_t)BH * T), 32 * ROW_WARPS, 0, st>>>(att, (int64_t)BH * T, T);
  tc_queued(cudaSuccess, "attention_forward (softmax)");
  /* per head, row-major y (T,hs) = att (T,T) . v (T,hs): rows [r0,r1) from keys [0,r1) */
  for (int r0 = 0; r0 < T; r0 += R) {
    const int r1 = T - r0 < R ? T : r0 + R;
    tc_blas_check(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, hs, r1 - r0, r1, &one, v, hs, sh,
                                            att + (int64_t)r0 * T, T, stt, &zero, y + (int64_t)r0 * hs, hs, sh, BH),
                  "attention_forward (att v): cublasSgemmStridedBatched");
  }
  attn_merge_kernel<<<ew_blocks(n), EW_THREADS, 0, st>>>(out, y, T, C, NH, n);
  tc_queued(cudaSuccess, "attention_forward (merge)");
}

/* scratch (B,NH,T,T) holds datt, then dpreatt; dqkv NULL: nothing to do */
void tk_attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv, const float *att, int B,
                           int T, int C, int NH) {
  if (!dqkv || B <= 0 || T <= 0 || C <= 0 || NH <= 0 || tc_enter()) return;
  const int hs = C / NH, BH = B * NH;
  const int64_t n = (int64_t)B * T * C, sh = (int64_t)T * hs, stt = (int64_t)T * T;
  float *s = (float *)tc_scratch(TC_SLOT_ATTN, sizeof(float) * 7 * (size_t)n);
  if (!s) return;
  /* each (B,NH,T,hs) */
  float *q = s, *k = s + n, *v = s + 2 * n, *dy = s + 3 * n, *dq = s + 4 * n, *dk = s + 5 * n, *dv = s + 6 * n;
  float *d = scratch;
  cudaStream_t st = tc_stream();
  cublasHandle_t h = tc_blas();
  const float scale = 1.0f / sqrtf((float)hs), one = 1.0f, zero = 0.0f;

  attn_split_qkv_kernel<<<ew_blocks(n), EW_THREADS, 0, st>>>(q, k, v, qkv, T, C, NH, n);
  tc_queued(cudaSuccess, "attention_backward (split qkv)");
  attn_split_kernel<<<ew_blocks(n), EW_THREADS, 0, st>>>(dy, dout, T, C, NH, n);
  tc_queued(cudaSuccess, "attention_backward (split dout)");
  const int R = attn_panel_rows(T);
  for (int r0 = 0; r0 < T; r0 += R) { /* rows [r0,r1), keys [0,r1): as the forward */
    const int r1 = T - r0 < R ? T : r0 + R;
    /* per head, row-major datt (T,T) = dy (T,hs) . v^T (hs,T) */
    tc_blas_check(cublasSgemmStridedBatched(h, CUBLAS_OP_T, CUBLAS_OP_N, r1, r1 - r0, hs, &one, v, hs, sh,
                                            dy + (int64_t)r0 * hs, hs, sh, &zero, d + (int64_t)r0 * T, T, stt, BH),
                  "attention_backward (datt): cublasSgemmStridedBatched");
  }
  for (int c0 = 0; c0 < T; c0 += R) { /* keys [c0,c1), queries [c0,T) */
    const int c1 = T - c0 < R ? T : c0 + R;
    /* per head, row-major dv (T,hs) = att^T (T,T) . dy (T,hs) */
    tc_blas_check(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_T, hs, c1 - c0, T - c0, &one,
                                            dy + (int64_t)c0 * hs, hs, sh, att + (int64_t)c0 * T + c0, T, stt, &zero,
                                            dv + (int64_t)c0 * hs, hs, sh, BH),
                  "attention_backward (dv): cublasSgemmStridedBatched");
  }
  causal_softmax_backward_kernel<<<row_blocks((int64_t)BH * T), 32 * ROW_WARPS, 0, st>>>(d, att, (int64_t)BH * T, T,
                                                                                        scale);
  tc_queued(cudaSuccess, "attention_backward (softmax)");
  for (int r0 = 0; r0 < T; r0 += R) {
    const int r1 = T - r0 < R ? T : r0 + R;
    /* per head, row-major dq (T,hs) = dpre (T,T) . k (T,hs) (scale is in dpre) */
    tc_blas_check(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, hs, r1 - r0, r1, &one, k, hs, sh,
                                            d + (int64_t)r0 * T, T, stt, &zero, dq + (int64_t)r0 * hs, hs, sh, BH),
                  "attention_backward (dq): cublasSgemmStridedBatched");
  }
  for (int c0 = 0; c0 < T; c0 += R) {
    const int c1 = T - c0 < R ? T : c0 + R;
    /* per head, row-major dk (T,hs) = dpre^T (T,T) . q (T,hs) */
    tc_blas_check(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_T, hs, c1 - c0, T - c0, &one,
                                            q + (int64_t)c0 * hs, hs, sh, d + (int64_t)c0 * T + c0, T, stt, &zero,
                                            dk + (int64_t)c0 * hs, hs, sh, BH),
                  "attention_backward (dk): cublasSgemmStridedBatched");
  }
  attn_merge_add_kernel<<<ew_blocks(n), EW_THREADS, 0, st>>>(dqkv, dq, dk, dv, T, C, NH, n);
  tc_queued(cudaSuccess, "attention_backward (merge)");
}

/* --- fused softmax cross-entropy --- */

/* One block per row: probs = softmax(logits), rowloss = -log probs[target]
 * (NaN for a target outside [0,V), which is never read). */
static __global__ void crossentropy_rows_kernel(float *rowloss, float *probs, const float *logits,
                                                const int32_t *targets, int V) {
  const int64_t n = blockIdx.x;
  const float *l = logits + n * V;
  float *p = probs + n * V;
  float mx = -CUDART_INF_F;
  for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, l[j]);
  mx = block_reduce(mx, MaxOp(), -CUDART_INF_F);
  float s = 0.0f;
  for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(l[j] - mx);
  const float inv = 1.0f / block_reduce(s, SumOp(), 0.0f);
  if (threadIdx.x == 0) { /* p[y] as written below; read before probs is (should it alias logits) */
    const int32_t y = targets[n];
    rowloss[n] = (y >= 0 && y < V) ? -logf(expf(l[y] - mx) * inv) : CUDART_NAN_F;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < V; j += blockDim.x) p[j] = expf(l[j] - mx) * inv;
}

/* one block: loss[0] = mean of the N row losses, summed in double */
static __global__ void crossentropy_mean_kernel(float *loss, const float *rowloss, int N) {
  double s = 0.0;
  for (int i = threadIdx.x; i < N; i += blockDim.x) s += rowloss[i];
  s = block_reduce(s, SumOp(), 0.0);
  if (threadIdx.x == 0) loss[0] = (float)(s / N);
}

void tk_crossentropy_forward(float *loss, float *probs, const float *logits, const int32_t *targets, int N, int V) {
  if (N <= 0 || V <= 0 || tc_enter()) return;
  float *rowloss = (float *)tc_scratch(TC_SLOT_XENT, sizeof(float) * (size_t)N);
  if (!rowloss) return;
  cudaStream_t st = tc_stream();
  crossentropy_rows_kernel<<<(unsigned)N, XENT_THREADS, 0, st>>>(rowloss, probs, logits, targets, V);
  tc_queued(cudaSuccess, "crossentropy_forward (rows)");
  crossentropy_mean_kernel<<<1, 1024, 0, st>>>(loss, rowloss, N);
  tc_queued(cudaSuccess, "crossentropy_forward (mean)");
}

/* dlogits (N,V) += dloss[0] * (probs - onehot(targets)) / N; one block per row */
static __global__ void crossentropy_backward_kernel(float *dlogits, const float *probs, const int32_t *targets,
                                                    const float *dloss, int N, int V) {
  const int64_t n = blockIdx.x;
  const float s = dloss[0] / (float)N;
  const int32_t y = targets[n];
  const float *p = probs + n * V;
  float *d = dlogits + n * V;
  for (int j = threadIdx.x; j < V; j += blockDim.x) d[j] += s * (p[j] - (j == y ? 1.0f : 0.0f));
}

void tk_crossentropy_backward(float *dlogits, const float *probs, const int32_t *targets, const float *dloss, int N,
                              int V) {
  if (!dlogits || N <= 0 || V <= 0 || tc_enter()) return;
  crossentropy_backward_kernel<<<(unsigned)N, XENT_THREADS, 0, tc_stream()>>>(dlogits, probs, targets, dloss, N, V);
  tc_queued(cudaSuccess, "crossentropy_backward");
}
