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
 * reductions, no atomics, embed_backward's token sum through a stable sort.
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
#include <string.h>

#include "kernels.cuh"

typedef __nv_bfloat16 bf16;

#define FULL_MASK 0xffffffffu
#define GELU_K 0.7978845608028654f /* sqrt(2/pi), as kernels.c */
#define LN_EPS 1e-5f               /* as kernels.c */

enum {
  EW_THREADS = 256,      /* as kernels.cu */
  EW_MAX_BLOCKS = 65536,
  ROW_WARPS = 8,
  XENT_THREADS = 512,
  EMBED_THREADS = 128,
};

/* fp32 scratch of attention's scores / datt: at most this many floats, so
 * the heads go through in chunks (one head at least) */
static const int64_t ATTN_SCORE_FLOATS = (int64_t)1 << 26; /* 256 MiB */

#define GRID_STRIDE(i, n)                                                                   \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (int64_t)(n);       \
       i += (int64_t)gridDim.x * blockDim.x)

static unsigned ew_blocks(int64_t n) {
  int64_t b = (n + EW_THREADS - 1) / EW_THREADS;
  return (unsigned)(b < (int64_t)EW_MAX_BLOCKS ? b : (int64_t)EW_MAX_BLOCKS);
}

static unsigned row_blocks(int64_t rows) { return (unsigned)((rows + ROW_WARPS - 1) / ROW_WARPS); }

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

/* tr_bf16 (uint16_t bits) as CUDA's bf16 type: same size and bits */
static inline bf16 *dv(tr_bf16 *p) { return reinterpret_cast<bf16 *>(p); }
static inline const bf16 *dv(const tr_bf16 *p) { return reinterpret_cast<const bf16 *>(p); }

static __device__ __forceinline__ float f32(bf16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ bf16 rn(float x) { return __float2bfloat16_rn(x); }

/* --- reductions (as kernels.cu) --- */

struct SumOp {
  template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <typename T, typename Op> static __device__ __forceinline__ T warp_reduce(T v, Op op) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}

/* Every thread of the block gets the result; every thread must call it. */
template <typename T, typename Op> static __device__ T block_reduce(T v, Op op, T identity) {
  __shared__ T part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_reduce(v, op);
  __syncthreads();
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < nwarps ? part[lane] : identity;
  return warp_reduce(v, op);
}

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

/* dwpe (T,C) += sum over b of dout[b,t,:], b in order (as the CPU) */
static __global__ void embed_dwpe_kernel(float *dwpe, const bf16 *dout, int B, int64_t TC) {
  GRID_STRIDE(i, TC) {
    float acc = dwpe[i];
    for (int b = 0; b < B; b++) acc += f32(dout[(int64_t)b * TC + i]);
    dwpe[i] = acc;
  }
}

static __global__ void iota_kernel(int32_t *p, int n) {
  GRID_STRIDE(i, n) p[i] = (int32_t)i;
}

/* as kernels.cu: the first entry of each run of one token in the
 * token-sorted positions adds the run's dout rows, in position order */
static __global__ void embed_dwte_kernel(float *dwte, const bf16 *dout, const int32_t *keys, const int32_t *pos,
                                         int n, int C) {
  const int i = blockIdx.x;
  const int32_t key = keys[i];
  if (i > 0 && keys[i - 1] == key) return;
  float *dst = dwte + (int64_t)key * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = dst[c];
    for (int j = i; j < n && keys[j] == key; j++) acc += f32(dout[(int64_t)pos[j] * C + c]);
    dst[c] = acc;
  }
}

static void tb_embed_backward(float *dwte, float *dwpe, const tr_bf16 *dout_, const int32_t *tok, int B, int T,
                              int C) {
  const int n = B * T; /* positions */
  if (n <= 0 || C <= 0 || tc_enter()) return;
  const bf16 *dout = dv(dout_);
  cudaStream_t st = tc_stream();
  if (dwpe) {
    const int64_t TC = (int64_t)T * C;
    embed_dwpe_kernel<<<ew_blocks(TC), EW_THREADS, 0, st>>>(dwpe, dout, B, TC);
    tc_queued(cudaSuccess, "bf16 embed_backward (dwpe)");
  }
  if (!dwte) return;
  size_t temp_bytes = 0;
  cudaError_t e = cub::DeviceRadixSort::SortPairs(NULL, temp_bytes, tok, (int32_t *)NULL, (const int32_t *)NULL,
                                                  (int32_t *)NULL, n, 0, 32, st);
  if (e != cudaSuccess) {
    tc_queued(e, "bf16 embed_backward (radix sort size)");
    return;
  }
  const size_t ib = align256(sizeof(int32_t) * (size_t)n);
  char *s = (char *)tc_scratch(TC_SLOT_EMBED, 3 * ib + temp_bytes);
  if (!s) return;
  int32_t *keys = (int32_t *)s, *pos = (int32_t *)(s + ib), *iota = (int32_t *)(s + 2 * ib);
  void *temp = s + 3 * ib;
  iota_kernel<<<ew_blocks(n), EW_THREADS, 0, st>>>(iota, n);
  tc_queued(cudaSuccess, "bf16 embed_backward (iota)");
  e = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, tok, keys, (const int32_t *)iota, pos, n, 0, 32, st);
  if (e != cudaSuccess) {
    tc_queued(e, "bf16 embed_backward (radix sort)");
    return;
  }
  embed_dwte_kernel<<<(unsigned)n, EMBED_THREADS, 0, st>>>(dwte, dout, keys, pos, n, C);
  tc_queued(cudaSuccess, "bf16 embed_backward (dwte)");
}

/* --- linear --- */

/* out (N,OC) = round(out + bias), bias broadcast over rows */
static __global__ void bias_add_kernel(bf16 *out, const float *bias, int OC, int64_t n) {
  GRID_STRIDE(i, n) out[i] = rn(f32(out[i]) + bias[i % OC]);
}

/* dst[m] += sum over n of src[n*M + m] (as kernels.cu's colsum_add_kernel) */
static __global__ void colsum_add_kernel(float *dst, const bf16 *src, int N, int M) {
  __shared__ float part[32][33];
  const int m = blockIdx.x * 32 + threadIdx.x;
  float s = 0.0f;
  if (m < M)
    for (int n = threadIdx.y; n < N; n += 32) s += f32(src[(int64_t)n * M + m]);
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && m < M) {
    float t = 0.0f;
    for (int y = 0; y < 32; y++) t += part[y][threadIdx.x];
    dst[m] += t;
  }
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
    colsum_add_kernel<<<(unsigned)((OC + 31) / 32), dim3(32, 32), 0, tc_stream()>>>(dbias, dv(dout), N, OC);
    tc_queued(cudaSuccess, "bf16 linear_backward (dbias)");
  }
}

/* --- layernorm: one warp per row (as kernels.cu) --- */

static __global__ void layernorm_forward_kernel(bf16 *out, float *mean, float *rstd, const bf16 *inp, const float *w,
                                                const float *b, int N, int C) {
  const int n = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (n >= N) return; /* the whole warp */
  const bf16 *x = inp + (int64_t)n * C;
  bf16 *o = out + (int64_t)n * C;
  float s = 0.0f;
  for (int c = lane; c < C; c += 32) s += f32(x[c]);
  const float m = warp_reduce(s, SumOp()) / (float)C;
  float v = 0.0f;
  for (int c = lane; c < C; c += 32) {
    float d = f32(x[c]) - m;
    v += d * d;
  }
  v = warp_reduce(v, SumOp()) / (float)C;
  const float r = 1.0f / sqrtf(v + LN_EPS);
  for (int c = lane; c < C; c += 32) o[c] = rn((f32(x[c]) - m) * r * w[c] + b[c]);
  if (lane == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}

static void tb_layernorm_forward(tr_bf16 *out, float *mean, float *rstd, const tr_bf16 *inp, const float *w,
                                 const float *b, int N, int C) {
  if (N <= 0 || C <= 0 || tc_enter()) return;
  layernorm_forward_kernel<<<row_blocks(N), 32 * ROW_WARPS, 0, tc_stream()>>>(dv(out), mean, rstd, dv(inp), w, b, N,
                                                                              C);
  tc_queued(cudaSuccess, "bf16 layernorm_forward");
}

/* dinp (N,C) += ..., one warp per row */
static __global__ void layernorm_dinp_kernel(bf16 *dinp, const bf16 *dout, const bf16 *inp, const float *w,
                                             const float *mean, const float *rstd, int N, int C) {
  const int n = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (n >= N) return;
  const bf16 *x = inp + (int64_t)n * C, *d = dout + (int64_t)n * C;
  bf16 *dx = dinp + (int64_t)n * C;
  const float m = mean[n], s = rstd[n];
  float a = 0.0f, an = 0.0f; /* sums of dnorm and dnorm * norm */
  for (int c = lane; c < C; c += 32) {
    float norm = (f32(x[c]) - m) * s;
    float dnorm = w[c] * f32(d[c]);
    a += dnorm;
    an += dnorm * norm;
  }
  const float dnorm_mean = warp_reduce(a, SumOp()) / (float)C;
  const float dnorm_norm_mean = warp_reduce(an, SumOp()) / (float)C;
  for (int c = lane; c < C; c += 32) {
    float norm = (f32(x[c]) - m) * s;
    float dnorm = w[c] * f32(d[c]);
    dx[c] = rn(f32(dx[c]) + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s);
  }
}

/* dw, db (C) += sums over rows; 32x32 threads per 32 channels. Either may be NULL. */
static __global__ void layernorm_dparams_kernel(float *dw, float *db, const bf16 *dout, const bf16 *inp,
                                                const float *mean, const float *rstd, int N, int C) {
  __shared__ float pw[32][33], pb[32][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float sw = 0.0f, sb = 0.0f;
  if (c < C)
    for (int n = threadIdx.y; n < N; n += 32) {
      const int64_t i = (int64_t)n * C + c;
      const float d = f32(dout[i]);
      sw += (f32(inp[i]) - mean[n]) * rstd[n] * d;
      sb += d;
    }
  pw[threadIdx.y][threadIdx.x] = sw;
  pb[threadIdx.y][threadIdx.x] = sb;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float tw = 0.0f, tb = 0.0f;
    for (int y = 0; y < 32; y++) {
      tw += pw[y][threadIdx.x];
      tb += pb[y][threadIdx.x];
    }
    if (dw) dw[c] += tw;
    if (db) db[c] += tb;
  }
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
    layernorm_dparams_kernel<<<(unsigned)((C + 31) / 32), dim3(32, 32), 0, st>>>(dw, db, dv(dout), dv(inp), mean,
                                                                                  rstd, N, C);
    tc_queued(cudaSuccess, "bf16 layernorm_backward (dw, db)");
  }
}

/* --- GELU (tanh form, as kernels.cu) --- */

static __global__ void gelu_forward_kernel(bf16 *out, const bf16 *inp, int64_t n) {
  GRID_STRIDE(i, n) {
    const float x = f32(inp[i]);
    out[i] = rn(0.5f * x * (1.0f + tanhf(GELU_K * (x + 0.044715f * x * x * x))));
  }
}

static __global__ void gelu_backward_kernel(bf16 *dinp, const bf16 *inp, const bf16 *dout, int64_t n) {
  GRID_STRIDE(i, n) {
    const float x = f32(inp[i]);
    const float u = GELU_K * (x + 0.044715f * x * x * x);
    const float th = tanhf(u);
    const float sech2 = 1.0f - th * th;
    const float g = 0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_K * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] = rn(f32(dinp[i]) + g * f32(dout[i]));
  }
}

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

static __global__ void add_forward_kernel(bf16 *out, const bf16 *a, const bf16 *b, int64_t n) {
  GRID_STRIDE(i, n) out[i] = rn(f32(a[i]) + f32(b[i]));
}

/* da and db may be NULL, or the same buffer (then it gets dout twice, each add rounded) */
static __global__ void add_backward_kernel(bf16 *da, bf16 *db, const bf16 *dout, int64_t n) {
  GRID_STRIDE(i, n) {
    const float d = f32(dout[i]);
    if (da) da[i] = rn(f32(da[i]) + d);
    if (db) db[i] = rn(f32(db[i]) + d);
  }
}

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
 * As kernels.cu: q, k, v gathered into (B,NH,T,hs) bf16 scratch, one
 * strided-batched matmul over the heads per product, results scattered back
 * to (B,T,C). The scores and datt are fp32, in plugin scratch, a chunk of
 * heads at a time; att is bf16, exactly 0 above the diagonal. */

/* q, k, v (B,NH,T,hs) = the three thirds of qkv (B,T,3C) */
static __global__ void attn_split_qkv_kernel(bf16 *q, bf16 *k, bf16 *v, const bf16 *qkv, int T, int C, int NH,
                                             int64_t n) {
  const int hs = C / NH;
  GRID_STRIDE(i, n) { /* i = ((b*NH + h)*T + t)*hs + d */
    const int d = (int)(i % hs);
    const int64_t bht = i / hs;
    const int t = (int)(bht % T);
    const int64_t bh = bht / T;
    const int h = (int)(bh % NH);
    const int64_t b = bh / NH;
    const bf16 *src = qkv + (b * T + t) * 3 * C + h * hs + d;
    q[i] = src[0];
    k[i] = src[C];
    v[i] = src[2 * C];
  }
}

/* dst (B,NH,T,hs) = src (B,T,C) */
static __global__ void attn_split_kernel(bf16 *dst, const bf16 *src, int T, int C, int NH, int64_t n) {
  const int hs = C / NH;
  GRID_STRIDE(i, n) { /* i = (b*T + t)*C + h*hs + d */
    const int c = (int)(i % C);
    const int64_t bt = i / C;
    const int t = (int)(bt % T);
    const int64_t b = bt / T;
    dst[((b * NH + c / hs) * T + t) * hs + c % hs] = src[i];
  }
}

/* out (B,T,C) = y (B,NH,T,hs) */
static __global__ void attn_merge_kernel(bf16 *out, const bf16 *y, int T, int C, int NH, int64_t n) {
  const int hs = C / NH;
  GRID_STRIDE(i, n) { /* i = (b*T + t)*C + h*hs + d */
    const int c = (int)(i % C);
    const int64_t bt = i / C;
    const int t = (int)(bt % T);
    const int64_t b = bt / T;
    out[i] = y[((b * NH + c / hs) * T + t) * hs + c % hs];
  }
}

/* the three thirds of dqkv (B,T,3C) += dq, dk, dv (B,NH,T,hs, fp32), each rounded once */
static __global__ void attn_merge_add_kernel(bf16 *dqkv, const float *dq, const float *dk, const float *dvv, int T,
                                             int C, int NH, int64_t n) {
  const int hs = C / NH;
  GRID_STRIDE(i, n) { /* i = (b*T + t)*C + h*hs + d */
    const int c = (int)(i % C);
    const int64_t bt = i / C;
    const int t = (int)(bt % T);
    const int64_t b = bt / T;
    const int64_t j = ((b * NH + c / hs) * T + t) * hs + c % hs;
    bf16 *dst = dqkv + bt * 3 * C + c;
    dst[0] = rn(f32(dst[0]) + dq[j]);
    dst[C] = rn(f32(dst[C]) + dk[j]);
    dst[2 * C] = rn(f32(dst[2 * C]) + dvv[j]);
  }
}

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

/* heads per chunk of the fp32 score scratch */
static int attn_chunk(int BH, int T) {
  int64_t c = ATTN_SCORE_FLOATS / ((int64_t)T * T);
  if (c < 1) c = 1;
  return c < BH ? (int)c : BH;
}

static void tb_attention_forward(tr_bf16 *out, tr_bf16 *att_, const tr_bf16 *qkv, int B, int T, int C, int NH) {
  if (B <= 0 || T <= 0 || C <= 0 || NH <= 0 || tc_enter()) return;
  const int hs = C / NH, BH = B * NH, chunk = attn_chunk(BH, T);
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
    /* per head, row-major score (T,T) = scale * q (T,hs) . k^T (hs,T), fp32 */
    gemm_batched("bf16 attention_forward (q k^T): cublasGemmStridedBatchedEx", CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs,
                 scale, k + h0 * sh, hs, sh, q + h0 * sh, hs, sh, 0.0f, score, CUDA_R_32F, T, stt, nh);
    causal_softmax_kernel<<<row_blocks((int64_t)nh * T), 32 * ROW_WARPS, 0, st>>>(att + h0 * stt, score,
                                                                                 (int64_t)nh * T, T);
    tc_queued(cudaSuccess, "bf16 attention_forward (softmax)");
  }
  /* per head, row-major y (T,hs) = att (T,T) . v (T,hs) */
  gemm_batched("bf16 attention_forward (att v): cublasGemmStridedBatchedEx", CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, 1.0f,
               v, hs, sh, att, T, stt, 0.0f, y, CUDA_R_16BF, hs, sh, BH);
  attn_merge_kernel<<<ew_blocks(n), EW_THREADS, 0, st>>>(dv(out), y, T, C, NH, n);
  tc_queued(cudaSuccess, "bf16 attention_forward (merge)");
}

/* scratch (B,NH,T,T) bf16 receives dpreatt; dqkv NULL: nothing to do */
static void tb_attention_backward(tr_bf16 *dqkv, tr_bf16 *scratch, const tr_bf16 *dout, const tr_bf16 *qkv,
                                  const tr_bf16 *att_, int B, int T, int C, int NH) {
  if (!dqkv || B <= 0 || T <= 0 || C <= 0 || NH <= 0 || tc_enter()) return;
  const int hs = C / NH, BH = B * NH, chunk = attn_chunk(BH, T);
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
    /* per head, row-major datt (T,T) = dy (T,hs) . v^T (hs,T), fp32 */
    gemm_batched("bf16 attention_backward (datt): cublasGemmStridedBatchedEx", CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs,
                 1.0f, v + h0 * sh, hs, sh, dy + h0 * sh, hs, sh, 0.0f, datt, CUDA_R_32F, T, stt, nh);
    causal_softmax_backward_kernel<<<row_blocks((int64_t)nh * T), 32 * ROW_WARPS, 0, st>>>(
        d + h0 * stt, datt, att + h0 * stt, (int64_t)nh * T, T, scale);
    tc_queued(cudaSuccess, "bf16 attention_backward (softmax)");
  }
  /* per head, row-major dv (T,hs) = att^T (T,T) . dy (T,hs) */
  gemm_batched("bf16 attention_backward (dv): cublasGemmStridedBatchedEx", CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, 1.0f, dy,
               hs, sh, att, T, stt, 0.0f, dvv, CUDA_R_32F, hs, sh, BH);
  /* per head, row-major dq (T,hs) = dpre (T,T) . k (T,hs) (scale is in dpre) */
  gemm_batched("bf16 attention_backward (dq): cublasGemmStridedBatchedEx", CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, 1.0f, k,
               hs, sh, d, T, stt, 0.0f, dq, CUDA_R_32F, hs, sh, BH);
  /* per head, row-major dk (T,hs) = dpre^T (T,T) . q (T,hs) */
  gemm_batched("bf16 attention_backward (dk): cublasGemmStridedBatchedEx", CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, 1.0f, q,
               hs, sh, d, T, stt, 0.0f, dk, CUDA_R_32F, hs, sh, BH);
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

/* --- the table --- */

static tr_bf16_ops make_bf16_table(void) {
  tr_bf16_ops t;
  memset(&t, 0, sizeof t);
  t.to_bf16 = tb_to_bf16;
  t.embed_forward = tb_embed_forward;
  t.embed_backward = tb_embed_backward;
  t.linear_forward = tb_linear_forward;
  t.linear_backward = tb_linear_backward;
  t.layernorm_forward = tb_layernorm_forward;
  t.layernorm_backward = tb_layernorm_backward;
  t.gelu_forward = tb_gelu_forward;
  t.gelu_backward = tb_gelu_backward;
  t.add_forward = tb_add_forward;
  t.add_backward = tb_add_backward;
  t.attention_forward = tb_attention_forward;
  t.attention_backward = tb_attention_backward;
  t.crossentropy_forward = tb_crossentropy_forward;
  t.crossentropy_backward = tb_crossentropy_backward;
  return t;
}

const tr_bf16_ops *tk_bf16_ops(void) {
  static const tr_bf16_ops table = make_bf16_table();
  return &table;
}
