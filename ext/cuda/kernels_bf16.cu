/* kernels_bf16.cu — the bf16-activation ops of the CUDA backend (backend.h,
 * tr_bf16_ops): the table that tk_bf16_ops() returns and backend.cu puts in
 * its `bf16` member.
 *
 * Contracts: backend.h's tr_bf16_ops over kernels.h's. Activations and their
 * gradients are bf16 (__nv_bfloat16, the bits of tr_bf16); parameters, their
 * gradients, layernorm's mean/rstd and the loss are fp32; matmul weights are
 * the bf16 shadow `w16`. Every sum is an fp32 sum (cuBLAS: CUBLAS_COMPUTE_32F,
 * and backend.cu disallows reduced-precision split-K reductions); a value is
 * rounded to bf16 (round to nearest even) where it is stored. A bf16 `+=`
 * gradient is read, widened, added to in fp32 and rounded once (cuBLAS does
 * the same with beta = 1 and a bf16 C). NULL gradient outputs are skipped.
 *
 * The reference is core/kernels_bf16.c (widen, fp32 kernel, round). The
 * kernels here round at the same points, except where a tensor-core matmul
 * needs both operands in bf16:
 *   - linear_forward with a bias: the matmul's bf16 result, then + bias and
 *     rounded again (two roundings: at most half a bf16 ulp of the matmul
 *     result more than the reference);
 *   - attention_forward: out = att v with att the stored bf16 probabilities
 *     (the reference multiplies by its fp32 probabilities);
 *   - attention_backward: dq, dk from the softmax gradient rounded to bf16
 *     (kept in the caller's `scratch`, which is bf16 (B,NH,T,T)).
 * The pre-softmax scores and datt stay fp32 (plugin scratch, by chunks of
 * heads so it stays bounded); dq, dk, dv are fp32 until added into dqkv.
 *
 * Launch discipline as kernels.cu: each launcher makes the device current
 * (tc_enter), queues on tc_stream(), and defers a launch or cuBLAS error
 * (tc_queued, tc_blas_check). Determinism as kernels.cu: fixed-shape
 * reductions, no atomic adds (embed_backward's token sum goes through a
 * stable sort; its one atomicMin finds a run's end, whatever the order).
 * The small helpers below (grid-stride loop, warp and block reductions, the
 * launch sizes) are copies of kernels.cu's, which keeps them static.
 */
#include <cub/device/device_radix_sort.cuh>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <math_constants.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "device.cuh"
#include "kernels.cuh"

typedef __nv_bfloat16 bf16;

/* fp32 scratch of attention's scores / datt: at most this many floats, so
 * the heads go through in chunks (one head at least) */
static const int64_t ATTN_SCORE_FLOATS = (int64_t)1 << 26; /* 256 MiB */

/* tr_bf16 (uint16_t bits) as CUDA's bf16 type: same size and bits */
static inline bf16 *dv(tr_bf16 *p) { return reinterpret_cast<bf16 *>(p); }
static inline const bf16 *dv(const tr_bf16 *p) { return reinterpret_cast<const bf16 *>(p); }

static __device__ __forceinline__ float f32(bf16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ bf16 rn(float x) { return __float2bfloat16_rn(x); }

/* --- matmuls: bf16 A and B, fp32 compute and scale, C bf16 or fp32 --- */

static void gemm(const char *what, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, float alpha,
                 const bf16 *A, int lda, const bf16 *B, int ldb, float beta, void *C, cudaDataType ct, int ldc) {
  tc_blas_check(cublasGemmEx(tc_blas(), ta, tb, m, n, k, &alpha, A, CUDA_R_16BF, lda, B, CUDA_R_16BF, ldb, &beta, C,
                             ct, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                what);
}

static void gemm_batched(const char *what, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                         float alpha, const bf16 *A, int lda, long long sa, const bf16 *B, int ldb, long long sb,
                         float beta, void *C, cudaDataType ct, int ldc, long long sc, int batch) {
  tc_blas_check(cublasGemmStridedBatchedEx(tc_blas(), ta, tb, m, n, k, &alpha, A, CUDA_R_16BF, lda, sa, B,
                                           CUDA_R_16BF, ldb, sb, &beta, C, ct, ldc, sc, batch, CUBLAS_COMPUTE_32F,
                                           CUBLAS_GEMM_DEFAULT),
                what);
}

/* --- conversion --- */

static __global__ void to_bf16_kernel(bf16 *dst, const float *src, int64_t n) {
  GRID_STRIDE(i, n) dst[i] = rn(src[i]);
}

static void tb_to_bf16(tr_bf16 *dst, const float *src, int64_t n) {
  if (n <= 0 || tc_enter()) return;
  to_bf16_kernel<<<ew_blocks(n), EW_THREADS, 0, tc_stream()>>>(dv(dst), src, n);
  tc_queued(cudaSuccess, "bf16 to_bf16");
}

/* --- embedding --- */

/* out (B,T,C) = wte[tok[b,t]] + wpe[t] in fp32, rounded (wpe may be NULL) */
static __global__ void embed_forward_kernel(bf16 *out, const int32_t *tok, const float *wte, const float *wpe, int T,
                                            int C, int64_t n) {
  GRID_STRIDE(i, n) {
    const int c = (int)(i % C);
    const int64_t bt = i / C;
    const float e = wte[(int64_t)tok[bt] * C + c];
    out[i] = rn(wpe ? e + wpe[(bt % T) * C + c] : e);
  }
}

static void tb_embed_forward(tr_bf16 *out, const int32_t *tok, const float *wte, const float *wpe, int B, int T,
                             int C) {
  const int64_t n = (int64_t)B * T * C;
  if (n <= 0 || tc_enter()) return;
  embed_forward_kernel<<<ew_blocks(n), EW_THREADS, 0, tc_stream()>>>(dv(out), tok, wte, wpe, T, C, n);
  tc_queued(cudaSuccess, "bf16 embed_forward");
}

static void tb_embed_backward(float *dwte, float *dwpe, const tr_bf16 *dout, const int32_t *tok, int B, int T,
                              int C) {
  embed_backward_launch(dwte, dwpe, dv(dout), tok, B, T, C, "bf16 embed_backward");
}

/* --- linear --- */

/* out (N,OC) = round(out + bias), bias broadcast over rows */
static __global__ void bias_add_kernel(bf16 *out, const float *bias, int OC, int64_t n) {
  GRID_STRIDE(i, n) out[i] = rn(f32(out[i]) + bias[i % OC]);
}

static void tb_linear_forward(tr_bf16 *out_, const tr_bf16 *inp, const tr_bf16 *w16, const float *bias, int N, int C,
                              int OC) {
  if (N <= 0 || C <= 0 || OC <= 0 || tc_enter()) return;
  bf16 *out = dv(out_);
  /* row-major out (N,OC) = inp (N,C) . w^T (C,OC) */
  gemm("bf16 linear_forward: cublasGemmEx", CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, 1.0f, dv(w16), C, dv(inp), C, 0.0f,
       out, CUDA_R_16BF, OC);
  if (bias) {
    const int64_t n = (int64_t)N * OC;
    bias_add_kernel<<<ew_blocks(n), EW_THREADS, 0, tc_stream()>>>(out, bias, OC, n);
    tc_queued(cudaSuccess, "bf16 linear_forward (bias)");
  }
}

static void tb_linear_backward(tr_bf16 *dinp, float *dw, float *dbias, const tr_bf16 *dout, const tr_bf16 *inp,
                               const tr_bf16 *w16, int N, int C, int OC) {
  if (N <= 0 || C <= 0 || OC <= 0 || tc_enter()) return;
  if (dinp) /* row-major dinp (N,C) += dout (N,OC) . w (OC,C); bf16 C, beta 1 */
    gemm("bf16 linear_backward (dinp): cublasGemmEx", CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, 1.0f, dv(w16), C, dv(dout),
         OC, 1.0f, dv(dinp), CUDA_R_16BF, C);
  if (dw) /* row-major dw (OC,C) += dout^T (OC,N) . inp (N,C); fp32 C, beta 1 */
    gemm("bf16 linear_backward (dw): cublasGemmEx", CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, 1.0f, dv(inp), C, dv(dout),
         OC, 1.0f, dw, CUDA_R_32F, C);
  if (dbias) { /* dbias (OC) += column sums of dout */
    float *part = (float *)tc_scratch(TC_SLOT_COLSUM, sizeof(float) * (size_t)colsum_slices(N, OC) * (size_t)OC);
    if (part) colsum_add(dbias, part, dv(dout), N, OC, tc_stream());
  }
}

/* --- layernorm (the kernels are device.cuh's) --- */

static void tb_layernorm_forward(tr_bf16 *out, float *mean, float *rstd, const tr_bf16 *inp, const float *w,
                                 const float *b, int N, int C) {
  if (N <= 0 || C <= 0 || tc_enter()) return;
  layernorm_forward_kernel<<<row_blocks(N), 32 * ROW_WARPS, 0, tc_stream()>>>(dv(out), mean, rstd, dv(inp), w, b, N,
                                                                              C);
  tc_queued(cudaSuccess, "bf16 layernorm_forward");
}

static void tb_layernorm_backward(tr_bf16 *dinp, float *dw, float *db, const tr_bf16 *dout, const tr_bf16 *inp,
                                  const float *w, const float *mean, const float *rstd, int N, int C) {
  if (N <= 0 || C <= 0 || tc_enter()) return;
  cudaStream_t st = tc_stream();
  if (dinp) {
    layernorm_dinp_kernel<<<row_blocks(N), 32 * ROW_WARPS, 0, st>>>(dv(dinp), dv(dout), dv(inp), w, mean, rstd, N,
                                                                    C);
    tc_queued(cudaSuccess, "bf16 layernorm_backward (dinp)");
  }
  if (dw || db) {
    float *part = (float *)tc_scratch(TC_SLOT_COLSUM, sizeof(float) * 2 * (size_t)colsum_slices(N, C) * (size_t)C);
    if (part) layernorm_dparams(dw, db, part, dv(dout), dv(inp), mean, rstd, N, C, st);
  }
}

/* --- GELU (device.cuh) --- */

static void tb_gelu_forward(tr_bf16 *out, const tr_bf16 *inp, int64_t n) {
  if (n <= 0 || tc_enter()) return;
  gelu_forward_kernel<<<ew_blocks(n), EW_THREADS, 0, tc_stream()>>>(dv(out), dv(inp), n);
  tc_queued(cudaSuccess, "bf16 gelu_forward");
}

static void tb_gelu_backward(tr_bf16 *dinp, const tr_bf16 *inp, const tr_bf16 *dout, int64_t n) {
  if (!dinp || n <= 0 || tc_enter()) return;
  gelu_backward_kernel<<<ew_blocks(n), EW_THREADS, 0, tc_stream()>>>(dv(dinp), dv(inp), dv(dout), n);
  tc_queued(cudaSuccess, "bf16 gelu_backward");
}

/* --- residual add --- */

static void tb_add_forward(tr_bf16 *out, const tr_bf16 *a, const tr_bf16 *b, int64_t n) {
  if (n <= 0 || tc_enter()) return;
  add_forward_kernel<<<ew_blocks(n), EW_THREADS, 0, tc_stream()>>>(dv(out), dv(a), dv(b), n);
  tc_queued(cudaSuccess, "bf16 add_forward");
}

static void tb_add_backward(tr_bf16 *da, tr_bf16 *db, const tr_bf16 *dout, int64_t n) {
  if ((!da && !db) || n <= 0 || tc_enter()) return;
  add_backward_kernel<<<ew_blocks(n), EW_THREADS, 0, tc_stream()>>>(dv(da), dv(db), dv(dout), n);
  tc_queued(cudaSuccess, "bf16 add_backward");
}

/* --- causal self-attention ---
 * As kernels.cu: q, k, v gathered into (B,NH,T,hs) bf16 scratch,
 * strided-batched matmuls over the heads per panel of rows (device.cuh's
 * attn_panel_rows), results scattered back to (B,T,C). The scores and datt are fp32, in plugin scratch, a chunk of
 * heads at a time; att is bf16, exactly 0 above the diagonal. */

/* rows (a whole number of heads, T rows each) of fp32 scores: row t of a
 * head keeps softmax of its first t+1 entries, rounded into att, and 0
 * after them. The scores are overwritten. One warp per row. */
static __global__ void causal_softmax_kernel(bf16 *att, float *score, int64_t rows, int T) {
  const int64_t r = (int64_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const int t = (int)(r % T);
  float *row = score + r * T;
  bf16 *a = att + r * T;
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
  for (int j = lane; j < T; j += 32) a[j] = rn(j <= t ? row[j] * inv : 0.0f);
}

/* rows as above: dpre = att * (datt - sum(att * datt)) * scale on and below
 * the diagonal, 0 above, from fp32 datt, rounded into dpre. One warp per row. */
static __global__ void causal_softmax_backward_kernel(bf16 *dpre, const float *datt, const bf16 *att, int64_t rows,
                                                      int T, float scale) {
  const int64_t r = (int64_t)blockIdx.x * ROW_WARPS + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const int t = (int)(r % T);
  const float *dr = datt + r * T;
  const bf16 *ar = att + r * T;
  bf16 *out = dpre + r * T;
  float dot = 0.0f;
  for (int j = lane; j <= t; j += 32) dot += f32(ar[j]) * dr[j];
  dot = warp_reduce(dot, SumOp());
  for (int j = lane; j < T; j += 32) out[j] = rn(j <= t ? f32(ar[j]) * (dr[j] - dot) * scale : 0.0f);
}

/* heads per chunk of the fp32 score scratch. TRANSOM_TEST_ATTN_SCORE_FLOATS
 * (a test hook) makes the scratch that small, so that test_cuda's small
 * shapes go through several chunks and a partial last one. */
static int attn_chunk(int BH, int T) {
  const char *e = getenv("TRANSOM_TEST_ATTN_SCORE_FLOATS");
  int64_t floats = e && atoll(e) > 0 ? atoll(e) : ATTN_SCORE_FLOATS;
  int64_t c = floats / ((int64_t)T * T);
  if (c < 1) c = 1;
  return c < BH ? (int)c : BH;
}

static void tb_attention_forward(tr_bf16 *out, tr_bf16 *att_, const tr_bf16 *qkv, int B, int T, int C, int NH) {
  if (B <= 0 || T <= 0 || C <= 0 || NH <= 0 || tc_enter()) return;
  const int hs = C / NH, BH = B * NH, chunk = attn_chunk(BH, T), R = attn_panel_rows(T);
  const int64_t n = (int64_t)B * T * C, sh = (int64_t)T * hs, stt = (int64_t)T * T;
  const size_t hb = align256(sizeof(bf16) * (size_t)n);
  char *s = (char *)tc_scratch(TC_SLOT_ATTN, 4 * hb + sizeof(float) * (size_t)(chunk * stt));
  if (!s) return;
  /* q, k, v, y (B,NH,T,hs) bf16; score (chunk,T,T) fp32 */
  bf16 *q = (bf16 *)s, *k = (bf16 *)(s + hb), *v = (bf16 *)(s + 2 * hb), *y = (bf16 *)(s + 3 * hb);
  float *score = (float *)(s + 4 * hb);
  bf16 *att = dv(att_);
  cudaStream_t st = tc_stream();
  const float scale = 1.0f / sqrtf((float)hs);

  attn_split_qkv_kernel<<<ew_blocks(n), EW_THREADS, 0, st>>>(q, k, v, dv(qkv), T, C, NH, n);
  tc_queued(cudaSuccess, "bf16 attention_forward (split)");
  for (int h0 = 0; h0 < BH; h0 += chunk) {
    const int nh = BH - h0 < chunk ? BH - h0 : chunk;
    /* per head, row-major score (T,T) = scale * q (T,hs) . k^T (hs,T), fp32, by panels of rows
     * [r0,r1) against keys [0,r1) (device.cuh): the softmax zeroes the rest */
    for (int r0 = 0; r0 < T; r0 += R) {
      const int r1 = T - r0 < R ? T : r0 + R;
      gemm_batched("bf16 attention_forward (q k^T): cublasGemmStridedBatchedEx", CUBLAS_OP_T, CUBLAS_OP_N, r1,
                   r1 - r0, hs, scale, k + h0 * sh, hs, sh, q + h0 * sh + (int64_t)r0 * hs, hs, sh, 0.0f,
                   score + (int64_t)r0 * T, CUDA_R_32F, T, stt, nh);
    }
    causal_softmax_kernel<<<row_blocks((int64_t)nh * T), 32 * ROW_WARPS, 0, st>>>(att + h0 * stt, score,
                                                                                 (int64_t)nh * T, T);
    tc_queued(cudaSuccess, "bf16 attention_forward (softmax)");
  }
  /* per head, row-major y (T,hs) = att (T,T) . v (T,hs): rows [r0,r1) from keys [0,r1) */
  for (int r0 = 0; r0 < T; r0 += R) {
    const int r1 = T - r0 < R ? T : r0 + R;
    gemm_batched("bf16 attention_forward (att v): cublasGemmStridedBatchedEx", CUBLAS_OP_N, CUBLAS_OP_N, hs, r1 - r0,
                 r1, 1.0f, v, hs, sh, att + (int64_t)r0 * T, T, stt, 0.0f, y + (int64_t)r0 * hs, CUDA_R_16BF, hs, sh,
                 BH);
  }
  attn_merge_kernel<<<ew_blocks(n), EW_THREADS, 0, st>>>(dv(out), y, T, C, NH, n);
  tc_queued(cudaSuccess, "bf16 attention_forward (merge)");
}

/* scratch (B,NH,T,T) bf16 receives dpreatt; dqkv NULL: nothing to do */
static void tb_attention_backward(tr_bf16 *dqkv, tr_bf16 *scratch, const tr_bf16 *dout, const tr_bf16 *qkv,
                                  const tr_bf16 *att_, int B, int T, int C, int NH) {
  if (!dqkv || B <= 0 || T <= 0 || C <= 0 || NH <= 0 || tc_enter()) return;
  const int hs = C / NH, BH = B * NH, chunk = attn_chunk(BH, T), R = attn_panel_rows(T);
  const int64_t n = (int64_t)B * T * C, sh = (int64_t)T * hs, stt = (int64_t)T * T;
  const size_t hb = align256(sizeof(bf16) * (size_t)n), fb = align256(sizeof(float) * (size_t)n);
  char *s = (char *)tc_scratch(TC_SLOT_ATTN, 4 * hb + 3 * fb + sizeof(float) * (size_t)(chunk * stt));
  if (!s) return;
  /* q, k, v, dy (B,NH,T,hs) bf16; dq, dk, dv (B,NH,T,hs) fp32; datt (chunk,T,T) fp32 */
  bf16 *q = (bf16 *)s, *k = (bf16 *)(s + hb), *v = (bf16 *)(s + 2 * hb), *dy = (bf16 *)(s + 3 * hb);
  float *dq = (float *)(s + 4 * hb), *dk = (float *)(s + 4 * hb + fb), *dvv = (float *)(s + 4 * hb + 2 * fb);
  float *datt = (float *)(s + 4 * hb + 3 * fb);
  bf16 *d = dv(scratch);
  const bf16 *att = dv(att_);
  cudaStream_t st = tc_stream();
  const float scale = 1.0f / sqrtf((float)hs);

  attn_split_qkv_kernel<<<ew_blocks(n), EW_THREADS, 0, st>>>(q, k, v, dv(qkv), T, C, NH, n);
  tc_queued(cudaSuccess, "bf16 attention_backward (split qkv)");
  attn_split_kernel<<<ew_blocks(n), EW_THREADS, 0, st>>>(dy, dv(dout), T, C, NH, n);
  tc_queued(cudaSuccess, "bf16 attention_backward (split dout)");
  for (int h0 = 0; h0 < BH; h0 += chunk) {
    const int nh = BH - h0 < chunk ? BH - h0 : chunk;
    /* per head, row-major datt (T,T) = dy (T,hs) . v^T (hs,T), fp32: rows [r0,r1), keys [0,r1) */
    for (int r0 = 0; r0 < T; r0 += R) {
      const int r1 = T - r0 < R ? T : r0 + R;
      gemm_batched("bf16 attention_backward (datt): cublasGemmStridedBatchedEx", CUBLAS_OP_T, CUBLAS_OP_N, r1,
                   r1 - r0, hs, 1.0f, v + h0 * sh, hs, sh, dy + h0 * sh + (int64_t)r0 * hs, hs, sh, 0.0f,
                   datt + (int64_t)r0 * T, CUDA_R_32F, T, stt, nh);
    }
    causal_softmax_backward_kernel<<<row_blocks((int64_t)nh * T), 32 * ROW_WARPS, 0, st>>>(
        d + h0 * stt, datt, att + h0 * stt, (int64_t)nh * T, T, scale);
    tc_queued(cudaSuccess, "bf16 attention_backward (softmax)");
  }
  for (int c0 = 0; c0 < T; c0 += R) { /* keys [c0,c1), queries [c0,T) */
    const int c1 = T - c0 < R ? T : c0 + R;
    const int64_t o = (int64_t)c0 * T + c0;
    /* per head, row-major dv (T,hs) = att^T (T,T) . dy (T,hs) */
    gemm_batched("bf16 attention_backward (dv): cublasGemmStridedBatchedEx", CUBLAS_OP_N, CUBLAS_OP_T, hs, c1 - c0,
                 T - c0, 1.0f, dy + (int64_t)c0 * hs, hs, sh, att + o, T, stt, 0.0f, dvv + (int64_t)c0 * hs,
                 CUDA_R_32F, hs, sh, BH);
    /* per head, row-major dk (T,hs) = dpre^T (T,T) . q (T,hs) */
    gemm_batched("bf16 attention_backward (dk): cublasGemmStridedBatchedEx", CUBLAS_OP_N, CUBLAS_OP_T, hs, c1 - c0,
                 T - c0, 1.0f, q + (int64_t)c0 * hs, hs, sh, d + o, T, stt, 0.0f, dk + (int64_t)c0 * hs, CUDA_R_32F,
                 hs, sh, BH);
  }
  for (int r0 = 0; r0 < T; r0 += R) { /* rows [r0,r1), keys [0,r1) */
    const int r1 = T - r0 < R ? T : r0 + R;
    /* per head, row-major dq (T,hs) = dpre (T,T) . k (T,hs) (scale is in dpre) */
    gemm_batched("bf16 attention_backward (dq): cublasGemmStridedBatchedEx", CUBLAS_OP_N, CUBLAS_OP_N, hs, r1 - r0,
                 r1, 1.0f, k, hs, sh, d + (int64_t)r0 * T, T, stt, 0.0f, dq + (int64_t)r0 * hs, CUDA_R_32F, hs, sh,
                 BH);
  }
  attn_merge_add_kernel<<<ew_blocks(n), EW_THREADS, 0, st>>>(dv(dqkv), dq, dk, dvv, T, C, NH, n);
  tc_queued(cudaSuccess, "bf16 attention_backward (merge)");
}

/* --- fused softmax cross-entropy --- */

/* One block per row: probs = round(softmax(logits)) and rowloss = -log of the
 * fp32 probability of the target (NaN for a target outside [0,V)). */
static __global__ void crossentropy_rows_kernel(float *rowloss, bf16 *probs, const bf16 *logits,
                                                const int32_t *targets, int V) {
  const int64_t n = blockIdx.x;
  const bf16 *l = logits + n * V;
  bf16 *p = probs + n * V;
  float mx = -CUDART_INF_F;
  for (int j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, f32(l[j]));
  mx = block_reduce(mx, MaxOp(), -CUDART_INF_F);
  float s = 0.0f;
  for (int j = threadIdx.x; j < V; j += blockDim.x) s += expf(f32(l[j]) - mx);
  const float inv = 1.0f / block_reduce(s, SumOp(), 0.0f);
  if (threadIdx.x == 0) { /* read before probs is written (should it alias logits) */
    const int32_t y = targets[n];
    rowloss[n] = (y >= 0 && y < V) ? -logf(expf(f32(l[y]) - mx) * inv) : CUDART_NAN_F;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < V; j += blockDim.x) p[j] = rn(expf(f32(l[j]) - mx) * inv);
}

/* one block: loss[0] = mean of the N row losses, summed in double */
static __global__ void crossentropy_mean_kernel(float *loss, const float *rowloss, int N) {
  double s = 0.0;
  for (int i = threadIdx.x; i < N; i += blockDim.x) s += rowloss[i];
  s = block_reduce(s, SumOp(), 0.0);
  if (threadIdx.x == 0) loss[0] = (float)(s / N);
}

static void tb_crossentropy_forward(float *loss, tr_bf16 *probs, const tr_bf16 *logits, const int32_t *targets, int N,
                                    int V) {
  if (N <= 0 || V <= 0 || tc_enter()) return;
  float *rowloss = (float *)tc_scratch(TC_SLOT_XENT, sizeof(float) * (size_t)N);
  if (!rowloss) return;
  cudaStream_t st = tc_stream();
  crossentropy_rows_kernel<<<(unsigned)N, XENT_THREADS, 0, st>>>(rowloss, dv(probs), dv(logits), targets, V);
  tc_queued(cudaSuccess, "bf16 crossentropy_forward (rows)");
  crossentropy_mean_kernel<<<1, 1024, 0, st>>>(loss, rowloss, N);
  tc_queued(cudaSuccess, "bf16 crossentropy_forward (mean)");
}

/* dlogits (N,V) += dloss[0] * (probs - onehot(targets)) / N; one block per row */
static __global__ void crossentropy_backward_kernel(bf16 *dlogits, const bf16 *probs, const int32_t *targets,
                                                    const float *dloss, int N, int V) {
  const int64_t n = blockIdx.x;
  const float s = dloss[0] / (float)N;
  const int32_t y = targets[n];
  const bf16 *p = probs + n * V;
  bf16 *d = dlogits + n * V;
  for (int j = threadIdx.x; j < V; j += blockDim.x) d[j] = rn(f32(d[j]) + s * (f32(p[j]) - (j == y ? 1.0f : 0.0f)));
}

static void tb_crossentropy_backward(tr_bf16 *dlogits, const tr_bf16 *probs, const int32_t *targets,
                                     const float *dloss, int N, int V) {
  if (!dlogits || N <= 0 || V <= 0 || tc_enter()) return;
  crossentropy_backward_kernel<<<(unsigned)N, XENT_THREADS, 0, tc_stream()>>>(dv(dlogits), dv(probs), targets, dloss,
                                                                             N, V);
  tc_queued(cudaSuccess, "bf16 crossentropy_backward");
}

/* --- the table (its graph-op entries generated from ops.def) --- */

static tr_bf16_ops make_bf16_table(void) {
  tr_bf16_ops t;
  memset(&t, 0, sizeof t);
  t.to_bf16 = tb_to_bf16;
#define TR_OP(ID, NAME, K, ...)   \
  t.K##_forward = tb_##K##_forward; \
  t.K##_backward = tb_##K##_backward;
#include "ops.def"
  return t;
}

const tr_bf16_ops *tk_bf16_ops(void) {
  static const tr_bf16_ops table = make_bf16_table();
  return &table;
}
