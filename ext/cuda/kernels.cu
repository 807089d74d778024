/* kernels.cu — the CUDA kernels of the graph ops and the optimizer's vector
 * ops, with their launchers (tk_*, the members of the table; see
 * kernels.cuh and backend.cu).
 *
 * Contracts: core/kernels.h, with the same semantics on device pointers,
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

#include "kernels.cuh"

#define FULL_MASK 0xffffffffu
#define GELU_K 0.7978845608028654f /* sqrt(2/pi), as kernels.c */
#define LN_EPS 1e-5f               /* as kernels.c */

enum {
  EW_THREADS = 256,      /* elementwise kernels */
  EW_MAX_BLOCKS = 65536, /* grid-stride loops cover the rest */
  ROW_WARPS = 8,         /* row kernels: one warp per row, 8 rows per block */
  XENT_THREADS = 512,    /* crossentropy: one block per row of V */
  SUMSQ_BLOCKS = 1024,   /* fixed: the order of the sum does not depend on the device */
  SUMSQ_THREADS = 256,
  EMBED_THREADS = 128,
};

/* i runs over [0,n) for every thread of the grid */
#define GRID_STRIDE(i, n)                                                                   \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (int64_t)(n);       \
       i += (int64_t)gridDim.x * blockDim.x)

static unsigned ew_blocks(int64_t n) {
  int64_t b = (n + EW_THREADS - 1) / EW_THREADS;
  return (unsigned)(b < (int64_t)EW_MAX_BLOCKS ? b : (int64_t)EW_MAX_BLOCKS);
}

static unsigned row_blocks(int64_t rows) { return (unsigned)((rows + ROW_WARPS - 1) / ROW_WARPS); }

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

/* --- reductions (fixed order: all lanes of a warp get the same bits, since
 *     each butterfly step adds the same two values, commutatively) --- */

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

/* Every thread of the block gets the result. blockDim.x must be a multiple
 * of 32 (at most 1024), and every thread of the block must call it. */
template <typename T, typename Op> static __device__ T block_reduce(T v, Op op, T identity) {
  __shared__ T part[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_reduce(v, op);
  __syncthreads(); /* part may still be read by a previous call */
  if (lane == 0) part[warp] = v;
  __syncthreads();
  v = lane < nwarps ? part[lane] : identity;
  return warp_reduce(v, op);
}

/* dst[m] += sum over n of src[n*M + m], for m < M: a block of 32x32
 * threads per 32 columns, rows split by threadIdx.y, partial sums added in
 * y order. Used for the bias gradient. */
static __global__ void colsum_add_kernel(float *dst, const float *src, int N, int M) {
  __shared__ float part[32][33];
  const int m = blockIdx.x * 32 + threadIdx.x;
  float s = 0.0f;
  if (m < M)
    for (int n = threadIdx.y; n < N; n += 32) s += src[(int64_t)n * M + m];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && m < M) {
    float t = 0.0f;
    for (int y = 0; y < 32; y++) t += part[y][threadIdx.x];
    dst[m] += t;
  }
}

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

/* the formula of backend.h (core/backend.c host_adamw) */
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

/* dwpe (T,C) += sum over b of dout[b,t,:], b in order (as the CPU) */
static __global__ void embed_dwpe_kernel(float *dwpe, const float *dout, int B, int64_t TC) {
  GRID_STRIDE(i, TC) {
    float acc = dwpe[i];
    for (int b = 0; b < B; b++) acc += dout[(int64_t)b * TC + i];
    dwpe[i] = acc;
  }
}

static __global__ void iota_kernel(int32_t *p, int n) {
  GRID_STRIDE(i, n) p[i] = (int32_t)i;
}

/* One block per entry of the token-sorted positions; the first entry of each
 * run of one token adds the run's dout rows into that token's row of dwte,
 * in position order (the sort is stable): the CPU's order, so the same bits. */
static __global__ void embed_dwte_kernel(float *dwte, const float *dout, const int32_t *keys, const int32_t *pos,
                                         int n, int C) {
  const int i = blockIdx.x;
  const int32_t key = keys[i];
  if (i > 0 && keys[i - 1] == key) return;
  float *dst = dwte + (int64_t)key * C;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = dst[c];
    for (int j = i; j < n && keys[j] == key; j++) acc += dout[(int64_t)pos[j] * C + c];
    dst[c] = acc;
  }
}

void tk_embed_backward(float *dwte, float *dwpe, const float *dout, const int32_t *tok, int B, int T, int C) {
  const int n = B * T; /* positions */
  if (n <= 0 || C <= 0 || tc_enter()) return;
  cudaStream_t st = tc_stream();
  if (dwpe) {
    const int64_t TC = (int64_t)T * C;
    embed_dwpe_kernel<<<ew_blocks(TC), EW_THREADS, 0, st>>>(dwpe, dout, B, TC);
    tc_queued(cudaSuccess, "embed_backward (dwpe)");
  }
  if (!dwte) return;
  /* positions sorted by token: keys (n), their positions (n), iota (n),
   * then the radix sort's own temporary storage */
  size_t temp_bytes = 0;
  cudaError_t e = cub::DeviceRadixSort::SortPairs(NULL, temp_bytes, tok, (int32_t *)NULL, (const int32_t *)NULL,
                                                  (int32_t *)NULL, n, 0, 32, st);
  if (e != cudaSuccess) {
    tc_queued(e, "embed_backward (radix sort size)");
    return;
  }
  const size_t ib = align256(sizeof(int32_t) * (size_t)n);
  char *s = (char *)tc_scratch(TC_SLOT_EMBED, 3 * ib + temp_bytes);
  if (!s) return;
  int32_t *keys = (int32_t *)s, *pos = (int32_t *)(s + ib), *iota = (int32_t *)(s + 2 * ib);
  void *temp = s + 3 * ib;
  iota_kernel<<<ew_blocks(n), EW_THREADS, 0, st>>>(iota, n);
  tc_queued(cudaSuccess, "embed_backward (iota)");
  e = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, tok, keys, (const int32_t *)iota, pos, n, 0, 32, st);
  if (e != cudaSuccess) {
    tc_queued(e, "embed_backward (radix sort)");
    return;
  }
  embed_dwte_kernel<<<(unsigned)n, EMBED_THREADS, 0, st>>>(dwte, dout, keys, pos, n, C);
  tc_queued(cudaSuccess, "embed_backward (dwte)");
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
    colsum_add_kernel<<<(unsigned)((OC + 31) / 32), dim3(32, 32), 0, tc_stream()>>>(dbias, dout, N, OC);
    tc_queued(cudaSuccess, "linear_backward (dbias)");
  }
}

/* --- layernorm: one warp per row --- */

static __global__ void layernorm_forward_kernel(float *out, float *mean, float *rstd, const float *inp,
                                                const float *w, const float *b, int N, int C) {
  const int n = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (n >= N) return; /* the whole warp */
  const float *x = inp + (int64_t)n * C;
  float *o = out + (int64_t)n * C;
  float s = 0.0f;
  for (int c = lane; c < C; c += 32) s += x[c];
  const float m = warp_reduce(s, SumOp()) / (float)C;
  float v = 0.0f;
  for (int c = lane; c < C; c += 32) {
    float d = x[c] - m;
    v += d * d;
  }
  v = warp_reduce(v, SumOp()) / (float)C;
  const float r = 1.0f / sqrtf(v + LN_EPS);
  for (int c = lane; c < C; c += 32) o[c] = (x[c] - m) * r * w[c] + b[c];
  if (lane == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}

void tk_layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *w, const float *b,
                          int N, int C) {
  if (N <= 0 || C <= 0 || tc_enter()) return;
  layernorm_forward_kernel<<<row_blocks(N), 32 * ROW_WARPS, 0, tc_stream()>>>(out, mean, rstd, inp, w, b, N, C);
  tc_queued(cudaSuccess, "layernorm_forward");
}

/* dinp (N,C) += ..., one warp per row */
static __global__ void layernorm_dinp_kernel(float *dinp, const float *dout, const float *inp, const float *w,
                                             const float *mean, const float *rstd, int N, int C) {
  const int n = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (n >= N) return;
  const float *x = inp + (int64_t)n * C, *d = dout + (int64_t)n * C;
  float *dx = dinp + (int64_t)n * C;
  const float m = mean[n], s = rstd[n];
  float a = 0.0f, an = 0.0f; /* sums of dnorm and dnorm * norm */
  for (int c = lane; c < C; c += 32) {
    float norm = (x[c] - m) * s;
    float dnorm = w[c] * d[c];
    a += dnorm;
    an += dnorm * norm;
  }
  const float dnorm_mean = warp_reduce(a, SumOp()) / (float)C;
  const float dnorm_norm_mean = warp_reduce(an, SumOp()) / (float)C;
  for (int c = lane; c < C; c += 32) {
    float norm = (x[c] - m) * s;
    float dnorm = w[c] * d[c];
    dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
  }
}

/* dw (C) += sum over rows of norm * dout, db (C) += sum over rows of dout;
 * 32x32 threads per 32 channels, as colsum_add_kernel. Either may be NULL. */
static __global__ void layernorm_dparams_kernel(float *dw, float *db, const float *dout, const float *inp,
                                                const float *mean, const float *rstd, int N, int C) {
  __shared__ float pw[32][33], pb[32][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float sw = 0.0f, sb = 0.0f;
  if (c < C)
    for (int n = threadIdx.y; n < N; n += 32) {
      const int64_t i = (int64_t)n * C + c;
      const float d = dout[i];
      sw += (inp[i] - mean[n]) * rstd[n] * d;
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

void tk_layernorm_backward(float *dinp, float *dw, float *db, const float *dout, const float *inp, const float *w,
                           const float *mean, const float *rstd, int N, int C) {
  if (N <= 0 || C <= 0 || tc_enter()) return;
  cudaStream_t st = tc_stream();
  if (dinp) {
    layernorm_dinp_kernel<<<row_blocks(N), 32 * ROW_WARPS, 0, st>>>(dinp, dout, inp, w, mean, rstd, N, C);
    tc_queued(cudaSuccess, "layernorm_backward (dinp)");
  }
  if (dw || db) {
    layernorm_dparams_kernel<<<(unsigned)((C + 31) / 32), dim3(32, 32), 0, st>>>(dw, db, dout, inp, mean, rstd, N,
                                                                                  C);
    tc_queued(cudaSuccess, "layernorm_backward (dw, db)");
  }
}

/* --- GELU (tanh form, the constants of kernels.c) --- */

static __global__ void gelu_forward_kernel(float *out, const float *inp, int64_t n) {
  GRID_STRIDE(i, n) {
    const float x = inp[i];
    out[i] = 0.5f * x * (1.0f + tanhf(GELU_K * (x + 0.044715f * x * x * x)));
  }
}

static __global__ void gelu_backward_kernel(float *dinp, const float *inp, const float *dout, int64_t n) {
  GRID_STRIDE(i, n) {
    const float x = inp[i];
    const float u = GELU_K * (x + 0.044715f * x * x * x);
    const float th = tanhf(u);
    const float sech2 = 1.0f - th * th;
    const float g = 0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_K * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] += g * dout[i];
  }
}

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

static __global__ void add_forward_kernel(float *out, const float *a, const float *b, int64_t n) {
  GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}

/* da and db may be NULL, or the same buffer (then it gets dout twice, as on the CPU) */
static __global__ void add_backward_kernel(float *da, float *db, const float *dout, int64_t n) {
  GRID_STRIDE(i, n) {
    const float d = dout[i];
    if (da) da[i] += d;
    if (db) db[i] += d;
  }
}

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
 * q, k, v of each head are gathered from qkv (B,T,3C) into contiguous
 * (B,NH,T,hs) scratch, so each product is one strided-batched sgemm over
 * the B*NH heads; results are scattered back to (B,T,C). att (B,NH,T,T)
 * holds the probabilities, exactly 0 above the diagonal (as the CPU). */

/* q, k, v (B,NH,T,hs) = the three thirds of qkv (B,T,3C) */
static __global__ void attn_split_qkv_kernel(float *q, float *k, float *v, const float *qkv, int T, int C, int NH,
                                             int64_t n) {
  const int hs = C / NH;
  GRID_STRIDE(i, n) { /* i = ((b*NH + h)*T + t)*hs + d */
    const int d = (int)(i % hs);
    const int64_t bht = i / hs;
    const int t = (int)(bht % T);
    const int64_t bh = bht / T;
    const int h = (int)(bh % NH);
    const int64_t b = bh / NH;
    const float *src = qkv + (b * T + t) * 3 * C + h * hs + d;
    q[i] = src[0];
    k[i] = src[C];
    v[i] = src[2 * C];
  }
}

/* dst (B,NH,T,hs) = src (B,T,C) */
static __global__ void attn_split_kernel(float *dst, const float *src, int T, int C, int NH, int64_t n) {
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
static __global__ void attn_merge_kernel(float *out, const float *y, int T, int C, int NH, int64_t n) {
  const int hs = C / NH;
  GRID_STRIDE(i, n) { /* i = (b*T + t)*C + h*hs + d */
    const int c = (int)(i % C);
    const int64_t bt = i / C;
    const int t = (int)(bt % T);
    const int64_t b = bt / T;
    out[i] = y[((b * NH + c / hs) * T + t) * hs + c % hs];
  }
}

/* the three thirds of dqkv (B,T,3C) += dq, dk, dv (B,NH,T,hs) */
static __global__ void attn_merge_add_kernel(float *dqkv, const float *dq, const float *dk, const float *dv, int T,
                                             int C, int NH, int64_t n) {
  const int hs = C / NH;
  GRID_STRIDE(i, n) { /* i = (b*T + t)*C + h*hs + d */
    const int c = (int)(i % C);
    const int64_t bt = i / C;
    const int t = (int)(bt % T);
    const int64_t b = bt / T;
    const int64_t j = ((b * NH + c / hs) * T + t) * hs + c % hs;
    float *dst = dqkv + bt * 3 * C + c;
    dst[0] += dq[j];
    dst[C] += dk[j];
    dst[2 * C] += dv[j];
  }
}

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
  /* per head, row-major att (T,T) = scale * q (T,hs) . k^T (hs,T) */
  tc_blas_check(cublasSgemmStridedBatched(h, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, &scale, k, hs, sh, q, hs, sh, &zero,
                                          att, T, stt, BH),
                "attention_forward (q k^T): cublasSgemmStridedBatched");
  causal_softmax_kernel<<<row_blocks((int64_t)BH * T), 32 * ROW_WARPS, 0, st>>>(att, (int64_t)BH * T, T);
  tc_queued(cudaSuccess, "attention_forward (softmax)");
  /* per head, row-major y (T,hs) = att (T,T) . v (T,hs) */
  tc_blas_check(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, &one, v, hs, sh, att, T, stt, &zero,
                                          y, hs, sh, BH),
                "attention_forward (att v): cublasSgemmStridedBatched");
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
  /* per head, row-major datt (T,T) = dy (T,hs) . v^T (hs,T) */
  tc_blas_check(cublasSgemmStridedBatched(h, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, &one, v, hs, sh, dy, hs, sh, &zero,
                                          d, T, stt, BH),
                "attention_backward (datt): cublasSgemmStridedBatched");
  /* per head, row-major dv (T,hs) = att^T (T,T) . dy (T,hs) */
  tc_blas_check(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, &one, dy, hs, sh, att, T, stt, &zero,
                                          dv, hs, sh, BH),
                "attention_backward (dv): cublasSgemmStridedBatched");
  causal_softmax_backward_kernel<<<row_blocks((int64_t)BH * T), 32 * ROW_WARPS, 0, st>>>(d, att, (int64_t)BH * T, T,
                                                                                        scale);
  tc_queued(cudaSuccess, "attention_backward (softmax)");
  /* per head, row-major dq (T,hs) = dpre (T,T) . k (T,hs) (scale is in dpre) */
  tc_blas_check(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, &one, k, hs, sh, d, T, stt, &zero,
                                          dq, hs, sh, BH),
                "attention_backward (dq): cublasSgemmStridedBatched");
  /* per head, row-major dk (T,hs) = dpre^T (T,T) . q (T,hs) */
  tc_blas_check(cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, &one, q, hs, sh, d, T, stt, &zero,
                                          dk, hs, sh, BH),
                "attention_backward (dk): cublasSgemmStridedBatched");
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
