/* device.cuh — the device-side pieces kernels.cu (fp32) and kernels_bf16.cu
 * (bf16 activations) share: launch shapes, the grid-stride loop, the
 * fixed-order reductions, element loads and stores that widen to / round
 * from fp32, and the attention layout kernels, templated on the element
 * type (float or __nv_bfloat16). Plugin-internal.
 */
#ifndef TRANSOM_CUDA_DEVICE_CUH
#define TRANSOM_CUDA_DEVICE_CUH

#include <cub/device/device_radix_sort.cuh>
#include <cuda_bf16.h>
#include <stddef.h>
#include <stdlib.h> /* getenv: attn_panel_rows */
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
  EMBED_THREADS = 128,
};

/* i runs over [0,n) for every thread of the grid */
#define GRID_STRIDE(i, n)                                                                   \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (int64_t)(n);       \
       i += (int64_t)gridDim.x * blockDim.x)

static inline unsigned ew_blocks(int64_t n) {
  int64_t b = (n + EW_THREADS - 1) / EW_THREADS;
  return (unsigned)(b < (int64_t)EW_MAX_BLOCKS ? b : (int64_t)EW_MAX_BLOCKS);
}

static inline unsigned row_blocks(int64_t rows) { return (unsigned)((rows + ROW_WARPS - 1) / ROW_WARPS); }

static inline size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

/* Causal attention's matmuls skip what the mask zeroes. The (T,T) scores go
 * by panels of this many query rows: rows [r0,r1) need keys [0,r1) only
 * (q k^T, att v, datt, dq), and keys [c0,c1) queries [c0,T) only (dv, dk),
 * so P panels do (P+1)/2P of the full products' work. At least 128 rows a
 * panel (smaller matmuls lose more to tiling than the mask saves), at most
 * 16 panels; T < 256 takes one. TRANSOM_TEST_ATTN_PANEL_ROWS (a test hook)
 * sets the rows, so that test_cuda's small shapes take several panels (0:
 * one panel, the whole products). */
static inline int attn_panel_rows(int T) {
  const char *e = getenv("TRANSOM_TEST_ATTN_PANEL_ROWS");
  if (e && *e) { /* as core's kernels.c: 0 (or more than T) = one panel */
    const int r = atoi(e);
    return r <= 0 || r > T ? T : r;
  }
  if (T < 256) return T;
  const int r = ((T + 15) / 16 + 7) & ~7; /* a multiple of 8: panels' bf16 offsets stay 16-byte aligned */
  return r > 128 ? r : 128;
}

/* --- elements: loads widen to fp32, stores round to nearest (even) --- */

static __device__ __forceinline__ float ld(float x) { return x; }
static __device__ __forceinline__ float ld(__nv_bfloat16 x) { return __bfloat162float(x); }
static __device__ __forceinline__ void st(float *p, float x) { *p = x; }
static __device__ __forceinline__ void st(__nv_bfloat16 *p, float x) { *p = __float2bfloat16_rn(x); }

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

/* --- kernels whose activations are E (float or bf16): every sum in fp32,
 *     a stored E rounded once (st); for float, ld/st are plain loads and
 *     stores, so the fp32 table runs exactly these kernels --- */

/* Column sums over N rows (the bias and layernorm parameter gradients): a
 * block of 32x32 threads per 32 columns and slice of rows (blockIdx.y), rows
 * split by threadIdx.y, partial sums added in y order. With one slice the
 * block adds into dst; with several each writes its slice's sums to fp32
 * partials that colsum_finish_kernel adds up in slice order, so the result
 * does not depend on scheduling. Slices give the GPU enough blocks: one per
 * 32 columns left 24 blocks for C = 768. */
enum { COLSUM_BLOCKS = 512, COLSUM_MIN_ROWS = 64 };

static inline int colsum_slices(int N, int M) {
  const int cols = (M + 31) / 32, most = (N + COLSUM_MIN_ROWS - 1) / COLSUM_MIN_ROWS;
  int s = (COLSUM_BLOCKS + cols - 1) / cols;
  if (s > most) s = most;
  return s < 1 ? 1 : s;
}

/* the rows [*n0, *n1) of this block's slice */
static __device__ __forceinline__ void colsum_rows(int N, int *n0, int *n1) {
  const int per = (N + (int)gridDim.y - 1) / (int)gridDim.y;
  *n0 = (int)blockIdx.y * per;
  *n1 = *n0 + per < N ? *n0 + per : N;
}

/* dst[m] += sum over n of src[n*M + m] (one slice), or part[slice*M + m] =
 * the slice's sum (several) */
template <typename E>
static __global__ void colsum_add_kernel(float *dst, float *part, const E *src, int N, int M) {
  __shared__ float sh[32][33];
  const int m = blockIdx.x * 32 + threadIdx.x;
  int n0, n1;
  colsum_rows(N, &n0, &n1);
  float s = 0.0f;
  if (m < M)
    for (int n = n0 + threadIdx.y; n < n1; n += 32) s += ld(src[(int64_t)n * M + m]);
  sh[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && m < M) {
    float t = 0.0f;
    for (int y = 0; y < 32; y++) t += sh[y][threadIdx.x];
    if (gridDim.y == 1)
      dst[m] += t;
    else
      part[(int64_t)blockIdx.y * M + m] = t;
  }
}

/* dst[m] += sum over slices of part[slice*M + m], in slice order; dst NULL: nothing */
static __global__ void colsum_finish_kernel(float *dst, const float *part, int slices, int M) {
  if (!dst) return;
  GRID_STRIDE(m, M) {
    float t = 0.0f;
    for (int y = 0; y < slices; y++) t += part[(int64_t)y * M + m];
    dst[m] += t;
  }
}

/* dst (M) += column sums of src (N,M); part is scratch of colsum_slices(N, M)
 * * M floats (unused for one slice) */
template <typename E> static void colsum_add(float *dst, float *part, const E *src, int N, int M, cudaStream_t st) {
  const int slices = colsum_slices(N, M);
  colsum_add_kernel<<<dim3((unsigned)((M + 31) / 32), (unsigned)slices), dim3(32, 32), 0, st>>>(dst, part, src, N, M);
  tc_queued(cudaSuccess, "column sums");
  if (slices > 1) {
    colsum_finish_kernel<<<ew_blocks(M), EW_THREADS, 0, st>>>(dst, part, slices, M);
    tc_queued(cudaSuccess, "column sums (slices)");
  }
}

/* layernorm: one warp per row; mean and rstd fp32 */
template <typename E>
static __global__ void layernorm_forward_kernel(E *out, float *mean, float *rstd, const E *inp, const float *w,
                                                const float *b, int N, int C) {
  const int n = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (n >= N) return; /* the whole warp */
  const E *x = inp + (int64_t)n * C;
  E *o = out + (int64_t)n * C;
  float s = 0.0f;
  for (int c = lane; c < C; c += 32) s += ld(x[c]);
  const float m = warp_reduce(s, SumOp()) / (float)C;
  float v = 0.0f;
  for (int c = lane; c < C; c += 32) {
    float d = ld(x[c]) - m;
    v += d * d;
  }
  v = warp_reduce(v, SumOp()) / (float)C;
  const float r = 1.0f / sqrtf(v + LN_EPS);
  for (int c = lane; c < C; c += 32) st(&o[c], (ld(x[c]) - m) * r * w[c] + b[c]);
  if (lane == 0) {
    mean[n] = m;
    rstd[n] = r;
  }
}

/* dinp (N,C) += ..., one warp per row */
template <typename E>
static __global__ void layernorm_dinp_kernel(E *dinp, const E *dout, const E *inp, const float *w, const float *mean,
                                             const float *rstd, int N, int C) {
  const int n = blockIdx.x * ROW_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (n >= N) return;
  const E *x = inp + (int64_t)n * C, *d = dout + (int64_t)n * C;
  E *dx = dinp + (int64_t)n * C;
  const float m = mean[n], s = rstd[n];
  float a = 0.0f, an = 0.0f; /* sums of dnorm and dnorm * norm */
  for (int c = lane; c < C; c += 32) {
    float norm = (ld(x[c]) - m) * s;
    float dnorm = w[c] * ld(d[c]);
    a += dnorm;
    an += dnorm * norm;
  }
  const float dnorm_mean = warp_reduce(a, SumOp()) / (float)C;
  const float dnorm_norm_mean = warp_reduce(an, SumOp()) / (float)C;
  for (int c = lane; c < C; c += 32) {
    float norm = (ld(x[c]) - m) * s;
    float dnorm = w[c] * ld(d[c]);
    st(&dx[c], ld(dx[c]) + (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s);
  }
}

/* dw (C) += sum over rows of norm * dout, db (C) += sum over rows of dout;
 * by blocks of 32 channels and slices of rows, as colsum_add_kernel: several
 * slices write part[slice*C + c] (dw) and part[(slices + slice)*C + c] (db)
 * for colsum_finish_kernel. Either may be NULL. */
template <typename E>
static __global__ void layernorm_dparams_kernel(float *dw, float *db, float *part, const E *dout, const E *inp,
                                                const float *mean, const float *rstd, int N, int C) {
  __shared__ float pw[32][33], pb[32][33];
  const int c = blockIdx.x * 32 + threadIdx.x;
  int n0, n1;
  colsum_rows(N, &n0, &n1);
  float sw = 0.0f, sb = 0.0f;
  if (c < C)
    for (int n = n0 + threadIdx.y; n < n1; n += 32) {
      const int64_t i = (int64_t)n * C + c;
      const float d = ld(dout[i]);
      sw += (ld(inp[i]) - mean[n]) * rstd[n] * d;
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
    if (gridDim.y == 1) {
      if (dw) dw[c] += tw;
      if (db) db[c] += tb;
    } else {
      part[(int64_t)blockIdx.y * C + c] = tw;
      part[((int64_t)gridDim.y + blockIdx.y) * C + c] = tb;
    }
  }
}

/* the launcher: part is scratch of 2 * colsum_slices(N, C) * C floats */
template <typename E>
static void layernorm_dparams(float *dw, float *db, float *part, const E *dout, const E *inp, const float *mean,
                              const float *rstd, int N, int C, cudaStream_t st) {
  const int slices = colsum_slices(N, C);
  layernorm_dparams_kernel<<<dim3((unsigned)((C + 31) / 32), (unsigned)slices), dim3(32, 32), 0, st>>>(
      dw, db, part, dout, inp, mean, rstd, N, C);
  tc_queued(cudaSuccess, "layernorm_backward (dw, db)");
  if (slices > 1) {
    colsum_finish_kernel<<<ew_blocks(C), EW_THREADS, 0, st>>>(dw, part, slices, C);
    colsum_finish_kernel<<<ew_blocks(C), EW_THREADS, 0, st>>>(db, part + (int64_t)slices * C, slices, C);
    tc_queued(cudaSuccess, "layernorm_backward (dw, db slices)");
  }
}

/* GELU, tanh form, the constants of kernels.c */
template <typename E> static __global__ void gelu_forward_kernel(E *out, const E *inp, int64_t n) {
  GRID_STRIDE(i, n) {
    const float x = ld(inp[i]);
    st(&out[i], 0.5f * x * (1.0f + tanhf(GELU_K * (x + 0.044715f * x * x * x))));
  }
}

template <typename E> static __global__ void gelu_backward_kernel(E *dinp, const E *inp, const E *dout, int64_t n) {
  GRID_STRIDE(i, n) {
    const float x = ld(inp[i]);
    const float u = GELU_K * (x + 0.044715f * x * x * x);
    const float th = tanhf(u);
    const float sech2 = 1.0f - th * th;
    const float g = 0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_K * (1.0f + 3.0f * 0.044715f * x * x);
    st(&dinp[i], ld(dinp[i]) + g * ld(dout[i]));
  }
}

/* residual add */
template <typename E> static __global__ void add_forward_kernel(E *out, const E *a, const E *b, int64_t n) {
  GRID_STRIDE(i, n) st(&out[i], ld(a[i]) + ld(b[i]));
}

/* da and db may be NULL, or the same buffer (add(x, x)): then it gets dout
 * twice, added in fp32 as (g + d) + d like the CPU, and is stored (rounded,
 * for bf16) once, like the host bf16 reference */
template <typename E> static __global__ void add_backward_kernel(E *da, E *db, const E *dout, int64_t n) {
  GRID_STRIDE(i, n) {
    const float d = ld(dout[i]);
    if (da && da == db) {
      st(&da[i], ld(da[i]) + d + d);
      continue;
    }
    if (da) st(&da[i], ld(da[i]) + d);
    if (db) st(&db[i], ld(db[i]) + d);
  }
}

/* --- causal self-attention's layouts ---
 * q, k, v of each head are gathered from qkv (B,T,3C) into contiguous
 * (B,NH,T,hs) scratch, so each product is a strided-batched matmul over
 * the B*NH heads (per panel of rows: attn_panel_rows); results are
 * scattered back to (B,T,C). Pure copies, but
 * for merge_add, which adds in fp32 and stores once. */

/* q, k, v (B,NH,T,hs) = the three thirds of qkv (B,T,3C) */
template <typename E>
static __global__ void attn_split_qkv_kernel(E *q, E *k, E *v, const E *qkv, int T, int C, int NH, int64_t n) {
  const int hs = C / NH;
  GRID_STRIDE(i, n) { /* i = ((b*NH + h)*T + t)*hs + d */
    const int d = (int)(i % hs);
    const int64_t bht = i / hs;
    const int t = (int)(bht % T);
    const int64_t bh = bht / T;
    const int h = (int)(bh % NH);
    const int64_t b = bh / NH;
    const E *src = qkv + (b * T + t) * 3 * C + h * hs + d;
    q[i] = src[0];
    k[i] = src[C];
    v[i] = src[2 * C];
  }
}

/* dst (B,NH,T,hs) = src (B,T,C) */
template <typename E> static __global__ void attn_split_kernel(E *dst, const E *src, int T, int C, int NH, int64_t n) {
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
template <typename E> static __global__ void attn_merge_kernel(E *out, const E *y, int T, int C, int NH, int64_t n) {
  const int hs = C / NH;
  GRID_STRIDE(i, n) { /* i = (b*T + t)*C + h*hs + d */
    const int c = (int)(i % C);
    const int64_t bt = i / C;
    const int t = (int)(bt % T);
    const int64_t b = bt / T;
    out[i] = y[((b * NH + c / hs) * T + t) * hs + c % hs];
  }
}

/* the three thirds of dqkv (B,T,3C) += dq, dk, dv (B,NH,T,hs): each sum in
 * fp32, stored once */
template <typename E, typename G>
static __global__ void attn_merge_add_kernel(E *dqkv, const G *dq, const G *dk, const G *dv, int T, int C, int NH,
                                             int64_t n) {
  const int hs = C / NH;
  GRID_STRIDE(i, n) { /* i = (b*T + t)*C + h*hs + d */
    const int c = (int)(i % C);
    const int64_t bt = i / C;
    const int t = (int)(bt % T);
    const int64_t b = bt / T;
    const int64_t j = ((b * NH + c / hs) * T + t) * hs + c % hs;
    E *dst = dqkv + bt * 3 * C + c;
    st(dst, ld(dst[0]) + ld(dq[j]));
    st(dst + C, ld(dst[C]) + ld(dk[j]));
    st(dst + 2 * C, ld(dst[2 * C]) + ld(dv[j]));
  }
}

/* --- the embedding's gradient (dout fp32 or bf16; dwte, dwpe fp32) --- */

/* dwpe (T,C) += sum over b of dout[b,t,:], b in order (as the CPU) */
template <typename E> static __global__ void embed_dwpe_kernel(float *dwpe, const E *dout, int B, int64_t TC) {
  GRID_STRIDE(i, TC) {
    float acc = dwpe[i];
    for (int b = 0; b < B; b++) acc += ld(dout[(int64_t)b * TC + i]);
    dwpe[i] = acc;
  }
}

static __global__ void iota_kernel(int32_t *p, int n) {
  GRID_STRIDE(i, n) p[i] = (int32_t)i;
}

/* A block per entry of the token-sorted positions and EMBED_THREADS
 * columns (blockIdx.y); the first entry of each run of one token adds the
 * run's dout rows into that token's row of dwte, in position order (the sort
 * is stable): the CPU's order, so the same bits. The block finds the run's
 * end first, together, so that the sum's loop has a known bound and its loads
 * are not each behind a load of the next key (a run of the space byte is
 * ~15% of a batch of text). */
template <typename E>
static __global__ void embed_dwte_kernel(float *dwte, const E *dout, const int32_t *keys, const int32_t *pos, int n,
                                         int C) {
  __shared__ int end;
  const int i = blockIdx.x;
  const int32_t key = keys[i];
  if (i > 0 && keys[i - 1] == key) return; /* the whole block */
  if (threadIdx.x == 0) end = n;
  __syncthreads();
  for (int j = i + 1 + (int)threadIdx.x; j < n; j += blockDim.x)
    if (keys[j] != key) { /* sorted: each thread's first other key; the least is the end */
      atomicMin(&end, j);
      break;
    }
  __syncthreads();
  const int e = end, c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float *dst = dwte + (int64_t)key * C;
  float acc = dst[c];
  for (int j = i; j < e; j++) acc += ld(dout[(int64_t)pos[j] * C + c]);
  dst[c] = acc;
}

/* The launcher of both tables' embed_backward: dwpe by a column loop, dwte
 * by sorting the positions by token (no atomics). `what` names the op in
 * deferred errors. */
template <typename E>
static void embed_backward_launch(float *dwte, float *dwpe, const E *dout, const int32_t *tok, int B, int T, int C,
                                  const char *what) {
  const int n = B * T; /* positions */
  if (n <= 0 || C <= 0 || tc_enter()) return;
  cudaStream_t stream = tc_stream();
  if (dwpe) {
    const int64_t TC = (int64_t)T * C;
    embed_dwpe_kernel<<<ew_blocks(TC), EW_THREADS, 0, stream>>>(dwpe, dout, B, TC);
    tc_queued(cudaSuccess, what);
  }
  if (!dwte) return;
  /* positions sorted by token: keys (n), their positions (n), iota (n),
   * then the radix sort's own temporary storage */
  size_t temp_bytes = 0;
  cudaError_t e = cub::DeviceRadixSort::SortPairs(NULL, temp_bytes, tok, (int32_t *)NULL, (const int32_t *)NULL,
                                                  (int32_t *)NULL, n, 0, 32, stream);
  if (e != cudaSuccess) {
    tc_queued(e, what);
    return;
  }
  const size_t ib = align256(sizeof(int32_t) * (size_t)n);
  char *s = (char *)tc_scratch(TC_SLOT_EMBED, 3 * ib + temp_bytes);
  if (!s) return;
  int32_t *keys = (int32_t *)s, *pos = (int32_t *)(s + ib), *iota = (int32_t *)(s + 2 * ib);
  void *temp = s + 3 * ib;
  iota_kernel<<<ew_blocks(n), EW_THREADS, 0, stream>>>(iota, n);
  tc_queued(cudaSuccess, what);
  e = cub::DeviceRadixSort::SortPairs(temp, temp_bytes, tok, keys, (const int32_t *)iota, pos, n, 0, 32, stream);
  if (e != cudaSuccess) {
    tc_queued(e, what);
    return;
  }
  embed_dwte_kernel<<<dim3((unsigned)n, (unsigned)((C + EMBED_THREADS - 1) / EMBED_THREADS)), EMBED_THREADS, 0,
                      stream>>>(dwte, dout, keys, pos, n, C);
  tc_queued(cudaSuccess, what);
}

#endif
