/* kernels.c — CPU kernels for graph ops (see kernels.h for the legend and the
 * accumulation rule: every backward kernel adds, `+=`, into its gradients).
 *
 * One thread pool: OpenMP. OpenBLAS runs single-threaded inside each call
 * and the matmuls are split across OpenMP threads by blocks of output rows
 * (two pools spinning for two cores made steps 1.5x slower; see the README's
 * performance notes). Everything else is a plain loop, parallel where rows
 * are independent; parameter-gradient reductions that would race across rows
 * are parallel over channels instead, so every sum runs in a fixed order and
 * the same thread count gives the same bits.
 */
#include "kernels.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

static int n_threads = 1;

void kernels_set_threads(int n) {
  if (n < 1) n = 1;
  n_threads = n;
  omp_set_num_threads(n);
  openblas_set_num_threads(1);
}

int kernels_threads(void) { return n_threads; }

/* Loops smaller than this run on one thread: forking costs more. */
#define PAR_MIN 16384

/* --- whole-buffer helpers --- */

void par_zero(float *p, int64_t n) {
#pragma omp parallel if (n > (1 << 16) && n_threads > 1)
  {
    int nt = omp_get_num_threads(), id = omp_get_thread_num();
    int64_t lo = n * id / nt, hi = n * (id + 1) / nt;
    memset(p + lo, 0, sizeof(float) * (size_t)(hi - lo));
  }
}

#define SUMSQ_BLOCKS 64 /* fixed, so the sum's order does not depend on threads */

double par_sumsq(const float *p, int64_t n) {
  double part[SUMSQ_BLOCKS];
#pragma omp parallel for schedule(static) if (n > (1 << 16) && n_threads > 1)
  for (int b = 0; b < SUMSQ_BLOCKS; b++) {
    int64_t lo = n * b / SUMSQ_BLOCKS, hi = n * (b + 1) / SUMSQ_BLOCKS;
    double s = 0.0;
    for (int64_t i = lo; i < hi; i++) s += (double)p[i] * p[i];
    part[b] = s;
  }
  double s = 0.0;
  for (int b = 0; b < SUMSQ_BLOCKS; b++) s += part[b];
  return s;
}

void par_scale(float *p, int64_t n, float s) {
#pragma omp parallel for simd schedule(static) if (parallel : n > (1 << 16) && n_threads > 1)
  for (int64_t i = 0; i < n; i++) p[i] *= s;
}

/* --- embedding --- */

void embed_forward(float *out, const int32_t *tok, const float *wte, const float *wpe, int B, int T, int C) {
#pragma omp parallel for schedule(static) if ((int64_t)B * T * C > PAR_MIN)
  for (int bt = 0; bt < B * T; bt++) {
    int t = bt % T;
    float *o = out + (int64_t)bt * C;           /* o is (C) */
    const float *e = wte + (int64_t)tok[bt] * C;
    if (wpe) {
      const float *p = wpe + (int64_t)t * C;
      for (int c = 0; c < C; c++) o[c] = e[c] + p[c];
    } else {
      memcpy(o, e, sizeof(float) * (size_t)C);
    }
  }
}

void embed_backward(float *dwte, float *dwpe, const float *dout, const int32_t *tok, int B, int T, int C) {
  /* Several positions can hold the same token: each thread owns a block of
   * channels, so no two threads touch the same gradient element. */
#pragma omp parallel if ((int64_t)B * T * C > PAR_MIN)
  {
    int nt = omp_get_num_threads(), id = omp_get_thread_num();
    int lo = C * id / nt, hi = C * (id + 1) / nt;
    for (int bt = 0; bt < B * T; bt++) {
      const float *d = dout + (int64_t)bt * C;
      float *e = dwte + (int64_t)tok[bt] * C;
      for (int c = lo; c < hi; c++) e[c] += d[c];
      if (dwpe) {
        float *p = dwpe + (int64_t)(bt % T) * C;
        for (int c = lo; c < hi; c++) p[c] += d[c];
      }
    }
  }
}

/* --- linear (matmul + bias) --- */

/* Splits [0,n) into per-thread blocks of whole rows. */
#define ROW_BLOCK(n, lo, hi)                                  \
  int nt_ = omp_get_num_threads(), id_ = omp_get_thread_num(); \
  int lo = (int)((int64_t)(n) * id_ / nt_), hi = (int)((int64_t)(n) * (id_ + 1) / nt_)

static int par_for(int64_t work) { return work > 32768 && n_threads > 1; }

void linear_forward(float *out, const float *inp, const float *w, const float *bias, int N, int C, int OC) {
  /* out (N,OC) = inp (N,C) . w^T (C,OC): each thread its block of rows */
#pragma omp parallel if (par_for((int64_t)N * C * OC))
  {
    ROW_BLOCK(N, lo, hi);
    if (hi > lo) {
      float beta = 0.0f;
      if (bias) {
        for (int n = lo; n < hi; n++) memcpy(out + (int64_t)n * OC, bias, sizeof(float) * (size_t)OC);
        beta = 1.0f;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, hi - lo, OC, C, 1.0f, inp + (int64_t)lo * C, C, w, C,
                  beta, out + (int64_t)lo * OC, OC);
    }
  }
}

void linear_backward(float *dinp, float *dw, float *dbias, const float *dout, const float *inp, const float *w,
                     int N, int C, int OC) {
#pragma omp parallel if (par_for((int64_t)N * C * OC))
  {
    if (dinp) { /* dinp (N,C) += dout (N,OC) . w (OC,C), by blocks of rows of N */
      ROW_BLOCK(N, lo, hi);
      if (hi > lo)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, hi - lo, C, OC, 1.0f, dout + (int64_t)lo * OC, OC, w,
                    C, 1.0f, dinp + (int64_t)lo * C, C);
    }
    ROW_BLOCK(OC, lo, hi);
    if (dw && hi > lo) /* dw (OC,C) += dout^T (OC,N) . inp (N,C), by blocks of rows of OC */
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, hi - lo, C, N, 1.0f, dout + lo, OC, inp, C, 1.0f,
                  dw + (int64_t)lo * C, C);
    if (dbias) /* column sums, walking rows in memory order */
      for (int n = 0; n < N; n++) {
        const float *d = dout + (int64_t)n * OC;
        for (int o = lo; o < hi; o++) dbias[o] += d[o];
      }
  }
}

/* --- layernorm --- */

#define LN_EPS 1e-5f

void layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *w, const float *b,
                       int N, int C) {
#pragma omp parallel for schedule(static) if ((int64_t)N * C > PAR_MIN)
  for (int n = 0; n < N; n++) {
    const float *x = inp + (int64_t)n * C;
    float *o = out + (int64_t)n * C;
    float m = 0.0f;
#pragma omp simd reduction(+ : m)
    for (int c = 0; c < C; c++) m += x[c];
    m /= (float)C;
    float v = 0.0f;
#pragma omp simd reduction(+ : v)
    for (int c = 0; c < C; c++) {
      float d = x[c] - m;
      v += d * d;
    }
    v /= (float)C;
    float s = 1.0f / sqrtf(v + LN_EPS);
    for (int c = 0; c < C; c++) o[c] = (x[c] - m) * s * w[c] + b[c];
    mean[n] = m;
    rstd[n] = s;
  }
}

void layernorm_backward(float *dinp, float *dw, float *db, const float *dout, const float *inp, const float *w,
                        const float *mean, const float *rstd, int N, int C) {
  /* input gradient: rows are independent */
#pragma omp parallel for schedule(static) if (dinp && (int64_t)N * C > PAR_MIN)
  for (int n = 0; n < (dinp ? N : 0); n++) {
    const float *x = inp + (int64_t)n * C, *d = dout + (int64_t)n * C;
    float *dx = dinp + (int64_t)n * C;
    float m = mean[n], s = rstd[n];
    float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_norm_mean)
    for (int c = 0; c < C; c++) {
      float norm = (x[c] - m) * s;
      float dnorm = w[c] * d[c];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= (float)C;
    dnorm_norm_mean /= (float)C;
    for (int c = 0; c < C; c++) {
      float norm = (x[c] - m) * s;
      float dnorm = w[c] * d[c];
      dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  }
  /* parameter gradients: reduce over rows, each thread its channels */
#pragma omp parallel if ((int64_t)N * C > PAR_MIN)
  {
    int nt = omp_get_num_threads(), id = omp_get_thread_num();
    int lo = C * id / nt, hi = C * (id + 1) / nt;
    for (int n = 0; n < N; n++) {
      const float *x = inp + (int64_t)n * C, *d = dout + (int64_t)n * C;
      float m = mean[n], s = rstd[n];
      for (int c = lo; c < hi; c++) {
        dw[c] += (x[c] - m) * s * d[c];
        db[c] += d[c];
      }
    }
  }
}

/* --- GELU (tanh form) --- */

#define GELU_K 0.7978845608028654f /* sqrt(2/pi) */

/* exp(x) for x <= 0 in plain arithmetic, so GELU loops vectorize: x =
 * k ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 polynomial, 2^k through the
 * exponent bits. Relative error about 2e-7 (float rounding). */
static inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  float k = (x * 1.44269504f + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5*2^23 */
  float r = x - k * 0.693359375f + k * 2.12194440e-4f; /* ln2 split for exactness */
  float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666418f +
            r * (0.00833335519f + r * 0.00138873165f)))));
  float kc = k >= -126.0f ? k : -126.0f; /* NaN x: a NaN k would make the cast undefined; p carries the NaN */
  int32_t bits = ((int32_t)kc + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

/* tanh through exp_nonpos: libm's tanhf was 28% of a step. */
static inline float fast_tanh(float u) {
  float e = exp_nonpos(-2.0f * fabsf(u));
  float t = (1.0f - e) / (1.0f + e);
  return copysignf(t, u);
}

void gelu_forward(float *out, const float *inp, int64_t n) {
#pragma omp parallel for simd schedule(static) if (parallel : n > PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    float x = inp[i];
    out[i] = 0.5f * x * (1.0f + fast_tanh(GELU_K * (x + 0.044715f * x * x * x)));
  }
}

void gelu_backward(float *dinp, const float *inp, const float *dout, int64_t n) {
  if (!dinp) return;
#pragma omp parallel for simd schedule(static) if (parallel : n > PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    float x = inp[i];
    float u = GELU_K * (x + 0.044715f * x * x * x);
    float th = fast_tanh(u);
    float sech2 = 1.0f - th * th;
    float g = 0.5f * (1.0f + th) + 0.5f * x * sech2 * GELU_K * (1.0f + 3.0f * 0.044715f * x * x);
    dinp[i] += g * dout[i];
  }
}

/* --- residual add --- */

void add_forward(float *out, const float *a, const float *b, int64_t n) {
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
  for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

void add_backward(float *da, float *db, const float *dout, int64_t n) {
  for (int k = 0; k < 2; k++) {
    float *d = k == 0 ? da : db;
    if (!d) continue;
#pragma omp parallel for schedule(static) if (n > PAR_MIN)
    for (int64_t i = 0; i < n; i++) d[i] += dout[i];
  }
}

/* --- causal self-attention --- */

/* The matmuls skip what the causal mask zeroes: query rows go by panels of
 * ATTN_PANEL; rows [r0,r1) need keys [0,r1) only (q k^T, att v, datt, dq),
 * and keys [c0,c1) queries [c0,T) only (dv, dk): P panels do (P+1)/2P of
 * the whole products' work. T <= ATTN_PANEL: one panel. (ext/cuda does the
 * same with its own panel sizes.) TRANSOM_TEST_ATTN_PANEL_ROWS (a test and
 * bench hook) sets the rows, 0 for one panel whatever T. */
#define ATTN_PANEL 64

static int attn_panel(int T) {
  const char *e = getenv("TRANSOM_TEST_ATTN_PANEL_ROWS");
  int r = e && *e ? atoi(e) : ATTN_PANEL;
  return r <= 0 || r > T ? T : r;
}

/* Row t of a head's (T,T) scores: softmax of its first t+1 entries in
 * place, 0 after them. exp_nonpos (max subtracted: every argument <= 0) so
 * the loops vectorize; the sum in simd lanes, a fixed order per build. */
__attribute__((noinline)) /* compiled on its own: its loops vectorize whatever the caller */
static void causal_softmax_row(float *row, int t, int T) {
  float mx = -INFINITY, sum = 0.0f;
  for (int j = 0; j <= t; j++) mx = row[j] > mx ? row[j] : mx;
#pragma omp simd
  for (int j = 0; j <= t; j++) row[j] = exp_nonpos(row[j] - mx);
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j <= t; j++) sum += row[j];
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int j = 0; j <= t; j++) row[j] *= inv;
  for (int j = t + 1; j < T; j++) row[j] = 0.0f;
}

/* Row t of the scaled softmax backward, in place over datt:
 * dpre = att * (datt - sum(att * datt)) * scale on and below the diagonal,
 * 0 after it. */
__attribute__((noinline)) static void causal_softmax_backward_row(float *dr, const float *ar, int t, int T,
                                                                  float scale) {
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int j = 0; j <= t; j++) dot += ar[j] * dr[j];
#pragma omp simd
  for (int j = 0; j <= t; j++) dr[j] = ar[j] * (dr[j] - dot) * scale;
  for (int j = t + 1; j < T; j++) dr[j] = 0.0f;
}

/* Per (b,h): att (T,T) = softmax(mask(q k^T * scale)); out = att v. The
 * q, k, v of one head are (T,hs) views with row stride 3C into qkv, so each
 * product is sgemms on views; the masked upper triangle of att is exactly 0. */
void attention_forward(float *out, float *att, const float *qkv, int B, int T, int C, int NH) {
  const int hs = C / NH, C3 = 3 * C, P = attn_panel(T);
  const float scale = 1.0f / sqrtf((float)hs);
#pragma omp parallel for collapse(2) schedule(static) if (par_for((int64_t)B * NH * T * T * hs))
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      const float *q = qkv + (int64_t)b * T * C3 + h * hs, *k = q + C, *v = q + 2 * C;
      float *a = att + ((int64_t)b * NH + h) * T * T; /* a is (T,T) */
      float *o = out + (int64_t)b * T * C + h * hs;
      for (int r0 = 0; r0 < T; r0 += P) {
        const int r1 = T - r0 < P ? T : r0 + P;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, r1, hs, scale, q + (int64_t)r0 * C3, C3, k,
                    C3, 0.0f, a + (int64_t)r0 * T, T);
        for (int t = r0; t < r1; t++) causal_softmax_row(a + (int64_t)t * T, t, T);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, hs, r1, 1.0f, a + (int64_t)r0 * T, T, v, C3,
                    0.0f, o + (int64_t)r0 * C, C);
      }
    }
  }
}

void attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv, const float *att,
                        int B, int T, int C, int NH) {
  const int hs = C / NH, C3 = 3 * C, P = attn_panel(T);
  const float scale = 1.0f / sqrtf((float)hs);
  if (!dqkv) return;
  /* Each (b,h) pair owns disjoint slices of dqkv and of scratch. */
#pragma omp parallel for collapse(2) schedule(static) if (par_for((int64_t)B * NH * T * T * hs))
  for (int b = 0; b < B; b++) {
    for (int h = 0; h < NH; h++) {
      const int64_t base = (int64_t)b * T * C3 + h * hs;
      const float *q = qkv + base, *k = q + C, *v = q + 2 * C;
      float *dq = dqkv + base, *dk = dq + C, *dv = dq + 2 * C;
      const float *a = att + ((int64_t)b * NH + h) * T * T;
      float *d = scratch + ((int64_t)b * NH + h) * T * T; /* datt, then dpreatt: (T,T) */
      const float *dO = dout + (int64_t)b * T * C + h * hs;
      for (int r0 = 0; r0 < T; r0 += P) {
        const int r1 = T - r0 < P ? T : r0 + P;
        /* datt = dout v^T, rows [r0,r1) against keys [0,r1) */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r1 - r0, r1, hs, 1.0f, dO + (int64_t)r0 * C, C, v, C3,
                    0.0f, d + (int64_t)r0 * T, T);
        /* softmax backward, scaled: dpre = att * (datt - sum(att*datt)) * scale */
        for (int t = r0; t < r1; t++) causal_softmax_backward_row(d + (int64_t)t * T, a + (int64_t)t * T, t, T, scale);
        /* dq += dpre k, rows [r0,r1) from keys [0,r1) */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, hs, r1, 1.0f, d + (int64_t)r0 * T, T, k, C3,
                    1.0f, dq + (int64_t)r0 * C3, C3);
      }
      for (int c0 = 0; c0 < T; c0 += P) {
        const int c1 = T - c0 < P ? T : c0 + P;
        const int64_t o = (int64_t)c0 * T + c0;
        /* dv += att^T dout, dk += dpre^T q: keys [c0,c1) from queries [c0,T) */
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, c1 - c0, hs, T - c0, 1.0f, a + o, T,
                    dO + (int64_t)c0 * C, C, 1.0f, dv + (int64_t)c0 * C3, C3);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, c1 - c0, hs, T - c0, 1.0f, d + o, T,
                    q + (int64_t)c0 * C3, C3, 1.0f, dk + (int64_t)c0 * C3, C3);
      }
    }
  }
}

/* --- fused softmax cross-entropy --- */

float crossentropy_forward(float *probs, const float *logits, const int32_t *targets, int N, int V) {
  double total = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : total) if ((int64_t)N * V > PAR_MIN)
  for (int n = 0; n < N; n++) {
    const float *l = logits + (int64_t)n * V;
    float *p = probs + (int64_t)n * V;
    float mx = -INFINITY;
    for (int v = 0; v < V; v++)
      if (l[v] > mx) mx = l[v];
    float sum = 0.0f;
    for (int v = 0; v < V; v++) {
      p[v] = expf(l[v] - mx);
      sum += p[v];
    }
    float inv = 1.0f / sum;
    for (int v = 0; v < V; v++) p[v] *= inv;
    int32_t y = targets[n];
    total += (y >= 0 && y < V) ? -logf(p[y]) : NAN;
  }
  return (float)(total / N);
}

void crossentropy_backward(float *dlogits, const float *probs, const int32_t *targets, float dloss, int N, int V) {
  float s = dloss / (float)N;
#pragma omp parallel for schedule(static) if ((int64_t)N * V > PAR_MIN)
  for (int n = 0; n < N; n++) {
    const float *p = probs + (int64_t)n * V;
    float *d = dlogits + (int64_t)n * V;
    int32_t y = targets[n];
    for (int v = 0; v < V; v++) d[v] += s * (p[v] - (v == y ? 1.0f : 0.0f));
  }
}
