/* test_cuda.c — the CUDA backend (ext/cuda) against core's CPU kernels.
 *
 * Every op, forward and backward, runs on both sides with the same random
 * inputs: uploaded, run on the GPU, downloaded, and compared elementwise
 * with the CPU kernel of kernels.h:
 *   |gpu - cpu| <= atol + rtol * max(|gpu|, |cpu|)   (NaN only matches NaN)
 * Gradient outputs are pre-filled with the same random values on both sides
 * (the `+=` rule), NULL outputs are exercised, and the shapes cover sizes
 * below 32, multiples of 32, and past 32 but not multiples of it. Forward
 * outputs start as random garbage on the device, so a kernel that adds into
 * them or leaves part unwritten fails. Tolerances:
 *   EW  atol 1e-5, rtol 1e-4: elementwise ops and short sums (embed, add,
 *       gelu, whose tanhf differs from the CPU's by a few ulp, adamw,
 *       layernorm forward, probabilities, the loss gradient).
 *   RED atol 1e-4, rtol 1e-4: results of long fp32 sums that the GPU adds
 *       in another order than the CPU (GEMMs with K up to 192, column sums
 *       over N = 192 rows, softmax rows, the mean loss). The two orders
 *       differ by up to about K * eps/2 * |terms| ~ 1e-5 absolute, which
 *       1e-5 alone would not cover where a sum cancels to near 0.
 *   Exact: memory round trips, zero, scale (one IEEE multiply), checkpoint
 *       copies; sumsq (a double sum of exact float squares) to 1e-10
 *       relative, and bitwise equal across two calls (determinism).
 * Each comparison prints its worst err/limit, so a run shows the margins.
 *
 * bf16 ops (backend.h, tr_bf16_ops): the cuda table's bf16 ops against the
 * cpu backend's (core/kernels_bf16.c: widen, fp32 kernel, round), on the
 * same bf16 inputs (random fp32 values rounded on the host by a local
 * helper), compared after widening both sides to fp32. bf16 keeps 8
 * significant bits: one unit in the last place (ulp) is at most 2^-7 =
 * 7.8e-3 of the value, and where the two sides round fp32 values that differ
 * by the order of a sum, their bf16 results can differ by that one ulp.
 * Tolerances:
 *   B16_EW  atol 1e-5, rtol 1e-2: bf16 results of elementwise ops and short
 *       sums (embed, add, gelu, softmax probabilities, the loss gradient):
 *       one ulp (rtol), and gelu's tanhf against the CPU's fast tanh where
 *       1 + tanh cancels (atol).
 *   B16_SUM atol 1e-3, rtol 1e-2: bf16 results of long fp32 sums added in
 *       another order (GEMMs with K <= 200, layernorm rows): the fp32
 *       results differ by about K * 2^-24 * sum|terms| < 4e-4 before the
 *       rounding, then one ulp.
 *   B16_GPUROUND atol 2e-2, rtol 2e-2: where the GPU rounds once more than
 *       the reference so its tensor-core matmuls get bf16 operands
 *       (kernels_bf16.cu): linear_forward with a bias (the matmul result is
 *       rounded, then + bias: half an ulp of |inp w| <= 2^-8 * 5 with these
 *       N(0,1) values = 0.02), linear_backward's bf16 dinp (cuBLAS may round
 *       dout w before it adds beta * dinp: half an ulp of |dout w| <= 0.02),
 *       attention's out (att rounded before att v:
 *       <= 2^-9 * max|v| ~ 0.01) and dqkv (the softmax gradient rounded
 *       before the dq, dk matmuls: 2^-9 per term of sum |dpre k|, a few e-3).
 *   F32_TC  atol 1e-3, rtol 1e-3: fp32 parameter gradients from tensor-core
 *       matmuls of bf16 operands (linear dw: exact products, fp32 sums in
 *       another order; the tensor cores' fp32 accumulation may truncate).
 *   The fp32 outputs of sums the GPU orders as the CPU or like its fp32
 *   kernels (embed dwte/dwpe, layernorm mean/rstd/dw/db, dbias, the loss)
 *   keep the fp32 EW/RED tolerances; to_bf16 is compared bitwise (NaN
 *   matching any NaN). Gradient outputs are pre-filled (bf16 ones with bf16
 *   values), forward outputs start as garbage, backward ops run on the
 *   reference's saved forward results on both sides (mean/rstd, att, probs).
 *
 * Paths that only some sizes or data take: elementwise kernels past one
 * grid's worth of elements (a second grid-stride pass), bf16 attention in
 * chunks of heads (the score scratch shrunk by TRANSOM_TEST_ATTN_SCORE_FLOATS,
 * a partial last chunk included), causal attention's matmuls by panels of
 * query rows (TRANSOM_TEST_ATTN_PANEL_ROWS), and embed_backward with long runs of one
 * token (bitwise against the CPU: the same summation order).
 *
 * Without the plugin or without a GPU it prints "test_cuda: SKIP: <why>"
 * and exits 77 (ctest: skipped).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "check.h"
#include "kernels.h"
#include "rng.h"
#include "util.h"

#define EW_ATOL 1e-5
#define EW_RTOL 1e-4
#define RED_ATOL 1e-4
#define RED_RTOL 1e-4
#define B16_EW_ATOL 1e-5
#define B16_EW_RTOL 1e-2
#define B16_SUM_ATOL 1e-3
#define B16_SUM_RTOL 1e-2
#define B16_GPUROUND_ATOL 2e-2
#define B16_GPUROUND_RTOL 2e-2
#define F32_TC_ATOL 1e-3
#define F32_TC_RTOL 1e-3

static const tr_backend *be;
static rng_t R;

/* --- buffers: every host and device buffer of a test, freed by release() --- */

#define MAX_BUFS 512
static void *hbufs[MAX_BUFS], *dbufs[MAX_BUFS];
static int nh, nd;

static void *hkeep(void *p) {
  if (!p || nh == MAX_BUFS) {
    fprintf(stderr, "test_cuda: out of host buffers\n");
    exit(2);
  }
  return hbufs[nh++] = p;
}

static float *hzero(int64_t n) { return hkeep(calloc((size_t)(n ? n : 1), sizeof(float))); }

static float *hrand(int64_t n, float scale) {
  float *p = hzero(n);
  for (int64_t i = 0; i < n; i++) p[i] = scale * rng_normal(&R);
  return p;
}

static float *hdup(const float *src, int64_t n) {
  float *p = hzero(n);
  memcpy(p, src, sizeof(float) * (size_t)n);
  return p;
}

static void *dalloc(size_t bytes) {
  void *p = be->alloc(bytes);
  CHECK(p != NULL, "alloc(%zu): %s", bytes, be->error());
  if (!p || nd == MAX_BUFS) {
    fprintf(stderr, "test_cuda: cannot go on without device memory\n");
    exit(1);
  }
  return dbufs[nd++] = p;
}

/* a device copy of n host floats (NULL stays NULL) */
static float *dput(const float *h, int64_t n) {
  if (!h) return NULL;
  float *d = dalloc(sizeof(float) * (size_t)n);
  int rc = be->upload(d, h, sizeof(float) * (size_t)n);
  CHECK(rc == 0, "upload: %s", be->error());
  return d;
}

static int32_t *dput_i(const int32_t *h, int64_t n) {
  int32_t *d = dalloc(sizeof(int32_t) * (size_t)n);
  int rc = be->upload(d, h, sizeof(int32_t) * (size_t)n);
  CHECK(rc == 0, "upload: %s", be->error());
  return d;
}

/* n device floats pre-filled with random garbage: a forward output must
 * overwrite all of it (a kernel that adds into it, or skips some, fails) */
static float *dgarbage(int64_t n) { return dput(hrand(n, 1), n); }

/* a host copy of n device floats (downloading waits for the queued kernels) */
static float *dget(const float *d, int64_t n) {
  float *h = hzero(n);
  int rc = be->download(h, d, sizeof(float) * (size_t)n);
  CHECK(rc == 0, "download: %s", be->error());
  return h;
}

static void release(void) {
  for (int i = 0; i < nd; i++) be->free(dbufs[i]);
  for (int i = 0; i < nh; i++) free(hbufs[i]);
  nd = nh = 0;
}

/* --- comparison --- */

static void cmp(const char *what, int shape, const float *gpu, const float *cpu, int64_t n, double atol,
                double rtol) {
  int64_t bad = 0;
  double worst = 0;
  for (int64_t i = 0; i < n; i++) {
    double a = gpu[i], c = cpu[i];
    int ok;
    if (isnan(a) || isnan(c)) {
      ok = isnan(a) && isnan(c);
      if (!ok) worst = INFINITY;
    } else {
      double err = fabs(a - c), lim = atol + rtol * fmax(fabs(a), fabs(c));
      ok = err <= lim;
      if (lim > 0 ? err / lim > worst : err > 0) worst = lim > 0 ? err / lim : INFINITY;
    }
    if (!ok) {
      if (bad < 5) fprintf(stderr, "  %s[%lld]: gpu %.9g cpu %.9g\n", what, (long long)i, a, c);
      bad++;
    }
  }
  check_total++;
  if (bad) {
    check_failures++;
    fprintf(stderr, "FAILED %s (shape %d): %lld of %lld off (worst err/limit %.3g)\n", what, shape,
            (long long)bad, (long long)n, worst);
  } else {
    printf("  ok %-40s shape %d  n %-7lld worst err/limit %.3g\n", what, shape, (long long)n, worst);
  }
}

/* --- shapes --- */

typedef struct {
  int B, T, C, NH, OC, V;
} shape;

static const shape shapes[] = {
    {2, 7, 12, 3, 20, 37},     /* N = 14, hs = 4 */
    {3, 64, 128, 4, 200, 515}, /* N = 192, hs = 32 */
    {2, 45, 66, 3, 70, 1031},  /* N = 90, hs = 22: T, C, OC, V past 32 and not multiples of it */
};

/* --- ops --- */

static void test_embed(int si, const shape *s) {
  const int B = s->B, T = s->T, C = s->C, V = s->V, N = B * T;
  int32_t *tok = hkeep(malloc(sizeof(int32_t) * (size_t)N));
  for (int i = 0; i < N; i++) tok[i] = (int32_t)rng_below(&R, (uint64_t)V);
  tok[N - 1] = tok[0]; /* at least one repeated token */
  float *wte = hrand((int64_t)V * C, 1), *wpe = hrand((int64_t)T * C, 1);
  int32_t *d_tok = dput_i(tok, N);
  float *d_wte = dput(wte, (int64_t)V * C), *d_wpe = dput(wpe, (int64_t)T * C);

  for (int with_wpe = 0; with_wpe < 2; with_wpe++) {
    float *out = hzero((int64_t)N * C), *d_out = dgarbage((int64_t)N * C);
    embed_forward(out, tok, wte, with_wpe ? wpe : NULL, B, T, C);
    be->embed_forward(d_out, d_tok, d_wte, with_wpe ? d_wpe : NULL, B, T, C);
    cmp(with_wpe ? "embed_forward out" : "embed_forward out (wpe NULL)", si, dget(d_out, (int64_t)N * C), out,
        (int64_t)N * C, EW_ATOL, EW_RTOL);
  }

  float *dout = hrand((int64_t)N * C, 1);
  float *d_dout = dput(dout, (int64_t)N * C);
  for (int with_wpe = 0; with_wpe < 2; with_wpe++) {
    float *dwte = hrand((int64_t)V * C, 1), *dwpe = hrand((int64_t)T * C, 1);
    float *d_dwte = dput(dwte, (int64_t)V * C), *d_dwpe = dput(dwpe, (int64_t)T * C);
    embed_backward(dwte, with_wpe ? dwpe : NULL, dout, tok, B, T, C);
    be->embed_backward(d_dwte, with_wpe ? d_dwpe : NULL, d_dout, d_tok, B, T, C);
    cmp(with_wpe ? "embed_backward dwte" : "embed_backward dwte (dwpe NULL)", si, dget(d_dwte, (int64_t)V * C), dwte,
        (int64_t)V * C, EW_ATOL, EW_RTOL);
    /* with dwpe NULL, both keep the pre-filled values */
    cmp(with_wpe ? "embed_backward dwpe" : "embed_backward dwpe (untouched)", si, dget(d_dwpe, (int64_t)T * C), dwpe,
        (int64_t)T * C, EW_ATOL, EW_RTOL);
  }
}

static void test_linear(int si, const shape *s) {
  const int N = s->B * s->T, C = s->C, OC = s->OC;
  float *inp = hrand((int64_t)N * C, 1), *w = hrand((int64_t)OC * C, 1.0f / sqrtf((float)C)), *bias = hrand(OC, 1);
  float *d_inp = dput(inp, (int64_t)N * C), *d_w = dput(w, (int64_t)OC * C), *d_bias = dput(bias, OC);

  for (int with_bias = 0; with_bias < 2; with_bias++) {
    float *out = hzero((int64_t)N * OC), *d_out = dgarbage((int64_t)N * OC);
    linear_forward(out, inp, w, with_bias ? bias : NULL, N, C, OC);
    be->linear_forward(d_out, d_inp, d_w, with_bias ? d_bias : NULL, N, C, OC);
    cmp(with_bias ? "linear_forward out" : "linear_forward out (bias NULL)", si, dget(d_out, (int64_t)N * OC), out,
        (int64_t)N * OC, RED_ATOL, RED_RTOL);
  }

  float *dout = hrand((int64_t)N * OC, 1);
  float *d_dout = dput(dout, (int64_t)N * OC);
  /* case 0: all outputs; 1: dinp NULL; 2: dw and dbias NULL */
  static const char *names[3][3] = {
      {"linear_backward dinp", "linear_backward dw", "linear_backward dbias"},
      {"linear_backward dinp (untouched)", "linear_backward dw (dinp NULL)", "linear_backward dbias (dinp NULL)"},
      {"linear_backward dinp (dw NULL)", "linear_backward dw (untouched)", "linear_backward dbias (untouched)"},
  };
  for (int k = 0; k < 3; k++) {
    float *dinp = hrand((int64_t)N * C, 1), *dw = hrand((int64_t)OC * C, 1), *dbias = hrand(OC, 1);
    float *d_dinp = dput(dinp, (int64_t)N * C), *d_dw = dput(dw, (int64_t)OC * C), *d_dbias = dput(dbias, OC);
    int skip_dinp = k == 1, skip_dw = k == 2;
    linear_backward(skip_dinp ? NULL : dinp, skip_dw ? NULL : dw, skip_dw ? NULL : dbias, dout, inp, w, N, C, OC);
    be->linear_backward(skip_dinp ? NULL : d_dinp, skip_dw ? NULL : d_dw, skip_dw ? NULL : d_dbias, d_dout, d_inp, d_w,
                        N, C, OC);
    cmp(names[k][0], si, dget(d_dinp, (int64_t)N * C), dinp, (int64_t)N * C, RED_ATOL, RED_RTOL);
    cmp(names[k][1], si, dget(d_dw, (int64_t)OC * C), dw, (int64_t)OC * C, RED_ATOL, RED_RTOL);
    cmp(names[k][2], si, dget(d_dbias, OC), dbias, OC, RED_ATOL, RED_RTOL);
  }
}

static void test_layernorm(int si, const shape *s) {
  const int N = s->B * s->T, C = s->C;
  float *inp = hrand((int64_t)N * C, 2), *w = hrand(C, 0.1f), *b = hrand(C, 0.1f);
  for (int i = 0; i < N * C; i++) inp[i] += 0.5f; /* a mean away from 0 */
  for (int c = 0; c < C; c++) w[c] += 1.0f;
  float *out = hzero((int64_t)N * C), *mean = hzero(N), *rstd = hzero(N);
  float *d_inp = dput(inp, (int64_t)N * C), *d_w = dput(w, C), *d_b = dput(b, C);
  float *d_out = dgarbage((int64_t)N * C), *d_mean = dgarbage(N), *d_rstd = dgarbage(N);
  layernorm_forward(out, mean, rstd, inp, w, b, N, C);
  be->layernorm_forward(d_out, d_mean, d_rstd, d_inp, d_w, d_b, N, C);
  cmp("layernorm_forward out", si, dget(d_out, (int64_t)N * C), out, (int64_t)N * C, EW_ATOL, EW_RTOL);
  cmp("layernorm_forward mean", si, dget(d_mean, N), mean, N, EW_ATOL, EW_RTOL);
  cmp("layernorm_forward rstd", si, dget(d_rstd, N), rstd, N, EW_ATOL, EW_RTOL);

  /* backward from the CPU's mean and rstd on both sides */
  float *dout = hrand((int64_t)N * C, 1);
  float *d_dout = dput(dout, (int64_t)N * C);
  be->upload(d_mean, mean, sizeof(float) * (size_t)N);
  be->upload(d_rstd, rstd, sizeof(float) * (size_t)N);
  for (int skip_dinp = 0; skip_dinp < 2; skip_dinp++) {
    float *dinp = hrand((int64_t)N * C, 1), *dw = hrand(C, 1), *db = hrand(C, 1);
    float *d_dinp = dput(dinp, (int64_t)N * C), *d_dw = dput(dw, C), *d_db = dput(db, C);
    /* the CPU kernel needs dw and db; only dinp may be NULL here */
    layernorm_backward(skip_dinp ? NULL : dinp, dw, db, dout, inp, w, mean, rstd, N, C);
    be->layernorm_backward(skip_dinp ? NULL : d_dinp, d_dw, d_db, d_dout, d_inp, d_w, d_mean, d_rstd, N, C);
    cmp(skip_dinp ? "layernorm_backward dinp (untouched)" : "layernorm_backward dinp", si,
        dget(d_dinp, (int64_t)N * C), dinp, (int64_t)N * C, RED_ATOL, RED_RTOL);
    cmp(skip_dinp ? "layernorm_backward dw (dinp NULL)" : "layernorm_backward dw", si, dget(d_dw, C), dw, C, RED_ATOL,
        RED_RTOL);
    cmp(skip_dinp ? "layernorm_backward db (dinp NULL)" : "layernorm_backward db", si, dget(d_db, C), db, C, RED_ATOL,
        RED_RTOL);
  }
  /* the GPU also skips NULL dw and db: dinp alone, against the first case's */
  {
    float *dinp = hrand((int64_t)N * C, 1), *dw = hrand(C, 1), *db = hrand(C, 1);
    float *d_dinp = dput(dinp, (int64_t)N * C);
    layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, C);
    be->layernorm_backward(d_dinp, NULL, NULL, d_dout, d_inp, d_w, d_mean, d_rstd, N, C);
    cmp("layernorm_backward dinp (dw, db NULL)", si, dget(d_dinp, (int64_t)N * C), dinp, (int64_t)N * C, RED_ATOL,
        RED_RTOL);
  }
}

static void test_gelu(int si, const shape *s) {
  const int64_t n = (int64_t)s->B * s->T * 4 * s->C;
  float *inp = hrand(n, 2), *out = hzero(n);
  float *d_inp = dput(inp, n), *d_out = dgarbage(n);
  gelu_forward(out, inp, n);
  be->gelu_forward(d_out, d_inp, n);
  cmp("gelu_forward out", si, dget(d_out, n), out, n, EW_ATOL, EW_RTOL);

  float *dout = hrand(n, 1), *dinp = hrand(n, 1);
  float *d_dout = dput(dout, n), *d_dinp = dput(dinp, n);
  gelu_backward(dinp, inp, dout, n);
  be->gelu_backward(d_dinp, d_inp, d_dout, n);
  be->gelu_backward(NULL, d_inp, d_dout, n); /* skipped */
  cmp("gelu_backward dinp", si, dget(d_dinp, n), dinp, n, EW_ATOL, EW_RTOL);
}

static void test_add(int si, const shape *s) {
  const int64_t n = (int64_t)s->B * s->T * s->C;
  float *a = hrand(n, 1), *b = hrand(n, 1), *out = hzero(n);
  float *d_a = dput(a, n), *d_b = dput(b, n), *d_out = dgarbage(n);
  add_forward(out, a, b, n);
  be->add_forward(d_out, d_a, d_b, n);
  cmp("add_forward out", si, dget(d_out, n), out, n, EW_ATOL, EW_RTOL);

  float *dout = hrand(n, 1);
  float *d_dout = dput(dout, n);
  static const char *names[3][2] = {{"add_backward da", "add_backward db"},
                                    {"add_backward da (untouched)", "add_backward db (da NULL)"},
                                    {"add_backward da (db NULL)", "add_backward db (untouched)"}};
  for (int k = 0; k < 3; k++) {
    float *da = hrand(n, 1), *db = hrand(n, 1);
    float *d_da = dput(da, n), *d_db = dput(db, n);
    add_backward(k == 1 ? NULL : da, k == 2 ? NULL : db, dout, n);
    be->add_backward(k == 1 ? NULL : d_da, k == 2 ? NULL : d_db, d_dout, n);
    cmp(names[k][0], si, dget(d_da, n), da, n, EW_ATOL, EW_RTOL);
    cmp(names[k][1], si, dget(d_db, n), db, n, EW_ATOL, EW_RTOL);
  }
  /* add(x, x): one gradient buffer gets dout twice */
  float *dx = hrand(n, 1);
  float *d_dx = dput(dx, n);
  add_backward(dx, dx, dout, n);
  be->add_backward(d_dx, d_dx, d_dout, n);
  cmp("add_backward da == db", si, dget(d_dx, n), dx, n, EW_ATOL, EW_RTOL);
}

static void test_attention(int si, const shape *s) {
  const int B = s->B, T = s->T, C = s->C, NH = s->NH;
  const int64_t nqkv = (int64_t)B * T * 3 * C, nout = (int64_t)B * T * C, natt = (int64_t)B * NH * T * T;
  float *qkv = hrand(nqkv, 1), *out = hzero(nout), *att = hzero(natt);
  float *d_qkv = dput(qkv, nqkv), *d_out = dgarbage(nout);
  float *d_att = dgarbage(natt); /* all of it written, zeros above the diagonal included */
  attention_forward(out, att, qkv, B, T, C, NH);
  be->attention_forward(d_out, d_att, d_qkv, B, T, C, NH);
  cmp("attention_forward out", si, dget(d_out, nout), out, nout, RED_ATOL, RED_RTOL);
  float *gatt = dget(d_att, natt);
  cmp("attention_forward att", si, gatt, att, natt, RED_ATOL, RED_RTOL);
  int64_t nonzero = 0;
  for (int64_t bh = 0; bh < (int64_t)B * NH; bh++)
    for (int t = 0; t < T; t++)
      for (int t2 = t + 1; t2 < T; t2++) nonzero += gatt[(bh * T + t) * T + t2] != 0.0f;
  CHECK(nonzero == 0, "attention_forward: %lld entries of att above the diagonal are not exactly 0",
        (long long)nonzero);

  /* backward from the CPU's att on both sides */
  be->upload(d_att, att, sizeof(float) * (size_t)natt);
  float *dout = hrand(nout, 1), *dqkv = hrand(nqkv, 1), *scratch = hzero(natt);
  float *d_dout = dput(dout, nout), *d_dqkv = dput(dqkv, nqkv), *d_scratch = dgarbage(natt);
  attention_backward(dqkv, scratch, dout, qkv, att, B, T, C, NH);
  be->attention_backward(d_dqkv, d_scratch, d_dout, d_qkv, d_att, B, T, C, NH);
  be->attention_backward(NULL, d_scratch, d_dout, d_qkv, d_att, B, T, C, NH); /* nothing to do */
  cmp("attention_backward dqkv", si, dget(d_dqkv, nqkv), dqkv, nqkv, RED_ATOL, RED_RTOL);
}

static void test_crossentropy(int si, const shape *s) {
  const int N = s->B * s->T, V = s->V;
  const int64_t n = (int64_t)N * V;
  float *logits = hrand(n, 2), *probs = hzero(n);
  int32_t *tg = hkeep(malloc(sizeof(int32_t) * (size_t)N));
  for (int i = 0; i < N; i++) tg[i] = (int32_t)rng_below(&R, (uint64_t)V);
  float *d_logits = dput(logits, n), *d_probs = dgarbage(n), *d_loss = dgarbage(1);
  int32_t *d_tg = dput_i(tg, N);
  float loss = crossentropy_forward(probs, logits, tg, N, V);
  be->crossentropy_forward(d_loss, d_probs, d_logits, d_tg, N, V);
  cmp("crossentropy_forward loss", si, dget(d_loss, 1), &loss, 1, RED_ATOL, RED_RTOL);
  cmp("crossentropy_forward probs", si, dget(d_probs, n), probs, n, EW_ATOL, EW_RTOL);

  const float dloss = 1.7f;
  float *dlogits = hrand(n, 1);
  float *d_dlogits = dput(dlogits, n), *d_dloss = dput(&dloss, 1);
  crossentropy_backward(dlogits, probs, tg, dloss, N, V);
  be->crossentropy_backward(d_dlogits, d_probs, d_tg, d_dloss, N, V);
  cmp("crossentropy_backward dlogits", si, dget(d_dlogits, n), dlogits, n, EW_ATOL, EW_RTOL);

  /* targets outside [0,V): NaN loss on both */
  tg[0] = -1;
  tg[N / 2] = V;
  be->upload(d_tg, tg, sizeof(int32_t) * (size_t)N);
  loss = crossentropy_forward(probs, logits, tg, N, V);
  be->crossentropy_forward(d_loss, d_probs, d_logits, d_tg, N, V);
  float *gl = dget(d_loss, 1);
  CHECK(isnan(loss) && isnan(gl[0]), "bad target: cpu loss %g, gpu loss %g (both should be NaN)", loss, gl[0]);
}

/* --- bf16 ops: host bf16 buffers, rounded here (not by the reference) --- */

static tr_bf16 f2bf(float f) { /* round to nearest even; NaN stays a NaN */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (tr_bf16)((u >> 16) | 0x0040u);
  return (tr_bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float bf2f(tr_bf16 h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static int bf_isnan(tr_bf16 h) { return (h & 0x7fffu) > 0x7f80u; }

static tr_bf16 *h16(int64_t n) { return hkeep(calloc((size_t)(n ? n : 1), sizeof(tr_bf16))); }

/* the bf16 rounding of n host floats */
static tr_bf16 *hround(const float *f, int64_t n) {
  tr_bf16 *p = h16(n);
  for (int64_t i = 0; i < n; i++) p[i] = f2bf(f[i]);
  return p;
}

static tr_bf16 *hdup16(const tr_bf16 *src, int64_t n) {
  tr_bf16 *p = h16(n);
  memcpy(p, src, sizeof(tr_bf16) * (size_t)n);
  return p;
}

static float *hwide(const tr_bf16 *h, int64_t n) {
  float *p = hzero(n);
  for (int64_t i = 0; i < n; i++) p[i] = bf2f(h[i]);
  return p;
}

static tr_bf16 *dput16(const tr_bf16 *h, int64_t n) {
  tr_bf16 *d = dalloc(sizeof(tr_bf16) * (size_t)n);
  int rc = be->upload(d, h, sizeof(tr_bf16) * (size_t)n);
  CHECK(rc == 0, "upload: %s", be->error());
  return d;
}

static tr_bf16 *dgarbage16(int64_t n) { return dput16(hround(hrand(n, 1), n), n); }

static tr_bf16 *dget16(const tr_bf16 *d, int64_t n) {
  tr_bf16 *h = h16(n);
  int rc = be->download(h, d, sizeof(tr_bf16) * (size_t)n);
  CHECK(rc == 0, "download: %s", be->error());
  return h;
}

/* the device bf16 result against the host one, both widened */
static void cmp16(const char *what, int shape, const tr_bf16 *d_gpu, const tr_bf16 *cpu, int64_t n, double atol,
                  double rtol) {
  cmp(what, shape, hwide(dget16(d_gpu, n), n), hwide(cpu, n), n, atol, rtol);
}

static const tr_bf16_ops *gb, *cb; /* the cuda table's bf16 ops, the cpu reference's */

/* to_bf16: bitwise against the reference, specials included */
static void test_bf16_to(void) {
  const int64_t n = 100003;
  float *x = hrand(n, 1);
  for (int64_t i = 0; i < n; i += 7) x[i] *= 1e30f;  /* large */
  for (int64_t i = 3; i < n; i += 11) x[i] *= 1e-39f; /* subnormal */
  const uint32_t special[] = {
      0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u, /* inf, -inf, NaNs (one signalling) */
      0x7f7fffffu, 0xff7fffffu,                                         /* FLT_MAX: rounds to inf */
      0x3f808000u, 0x3f818000u, 0xbf808000u, /* ties: to even, down then up */
      0x3f808001u, 0x3f807fffu,              /* just past, just short of a tie */
      0x00000001u, 0x80008000u, 0x00000000u, 0x80000000u,
  };
  for (size_t i = 0; i < sizeof special / sizeof special[0]; i++) memcpy(&x[i * 5 + 1], &special[i], sizeof(float));
  tr_bf16 *want = h16(n), *d_out = dgarbage16(n);
  float *d_x = dput(x, n);
  cb->to_bf16(want, x, n);
  gb->to_bf16(d_out, d_x, n);
  tr_bf16 *got = dget16(d_out, n);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i++) {
    if (got[i] == want[i] || (bf_isnan(got[i]) && bf_isnan(want[i]))) continue;
    if (bad++ < 5) fprintf(stderr, "  to_bf16[%lld] of %.9g: gpu 0x%04x cpu 0x%04x\n", (long long)i, x[i], got[i], want[i]);
  }
  CHECK(bad == 0, "bf16 to_bf16: %lld of %lld differ", (long long)bad, (long long)n);
  if (!bad) printf("  ok %-40s n %lld, bitwise\n", "bf16 to_bf16", (long long)n);
}

static void test_bf16_embed(int si, const shape *s) {
  const int B = s->B, T = s->T, C = s->C, V = s->V, N = B * T;
  int32_t *tok = hkeep(malloc(sizeof(int32_t) * (size_t)N));
  for (int i = 0; i < N; i++) tok[i] = (int32_t)rng_below(&R, (uint64_t)V);
  tok[N - 1] = tok[0]; /* at least one repeated token */
  float *wte = hrand((int64_t)V * C, 1), *wpe = hrand((int64_t)T * C, 1);
  int32_t *d_tok = dput_i(tok, N);
  float *d_wte = dput(wte, (int64_t)V * C), *d_wpe = dput(wpe, (int64_t)T * C);

  for (int with_wpe = 0; with_wpe < 2; with_wpe++) {
    tr_bf16 *out = h16((int64_t)N * C), *d_out = dgarbage16((int64_t)N * C);
    cb->embed_forward(out, tok, wte, with_wpe ? wpe : NULL, B, T, C);
    gb->embed_forward(d_out, d_tok, d_wte, with_wpe ? d_wpe : NULL, B, T, C);
    cmp16(with_wpe ? "bf16 embed_forward out" : "bf16 embed_forward out (wpe NULL)", si, d_out, out, (int64_t)N * C,
          B16_EW_ATOL, B16_EW_RTOL);
  }

  tr_bf16 *dout = hround(hrand((int64_t)N * C, 1), (int64_t)N * C);
  tr_bf16 *d_dout = dput16(dout, (int64_t)N * C);
  for (int with_wpe = 0; with_wpe < 2; with_wpe++) {
    float *dwte = hrand((int64_t)V * C, 1), *dwpe = hrand((int64_t)T * C, 1);
    float *d_dwte = dput(dwte, (int64_t)V * C), *d_dwpe = dput(dwpe, (int64_t)T * C);
    cb->embed_backward(dwte, with_wpe ? dwpe : NULL, dout, tok, B, T, C);
    gb->embed_backward(d_dwte, with_wpe ? d_dwpe : NULL, d_dout, d_tok, B, T, C);
    cmp(with_wpe ? "bf16 embed_backward dwte" : "bf16 embed_backward dwte (dwpe NULL)", si,
        dget(d_dwte, (int64_t)V * C), dwte, (int64_t)V * C, EW_ATOL, EW_RTOL);
    cmp(with_wpe ? "bf16 embed_backward dwpe" : "bf16 embed_backward dwpe (untouched)", si,
        dget(d_dwpe, (int64_t)T * C), dwpe, (int64_t)T * C, EW_ATOL, EW_RTOL);
  }
}

static void test_bf16_linear(int si, const shape *s) {
  const int N = s->B * s->T, C = s->C, OC = s->OC;
  tr_bf16 *inp = hround(hrand((int64_t)N * C, 1), (int64_t)N * C);
  tr_bf16 *w = hround(hrand((int64_t)OC * C, 1.0f / sqrtf((float)C)), (int64_t)OC * C);
  float *bias = hrand(OC, 1);
  tr_bf16 *d_inp = dput16(inp, (int64_t)N * C), *d_w = dput16(w, (int64_t)OC * C);
  float *d_bias = dput(bias, OC);

  for (int with_bias = 0; with_bias < 2; with_bias++) {
    tr_bf16 *out = h16((int64_t)N * OC), *d_out = dgarbage16((int64_t)N * OC);
    cb->linear_forward(out, inp, w, with_bias ? bias : NULL, N, C, OC);
    gb->linear_forward(d_out, d_inp, d_w, with_bias ? d_bias : NULL, N, C, OC);
    if (with_bias)
      cmp16("bf16 linear_forward out", si, d_out, out, (int64_t)N * OC, B16_GPUROUND_ATOL, B16_GPUROUND_RTOL);
    else
      cmp16("bf16 linear_forward out (bias NULL)", si, d_out, out, (int64_t)N * OC, B16_SUM_ATOL, B16_SUM_RTOL);
  }

  tr_bf16 *dout = hround(hrand((int64_t)N * OC, 1), (int64_t)N * OC);
  tr_bf16 *d_dout = dput16(dout, (int64_t)N * OC);
  /* case 0: all outputs; 1: dinp NULL; 2: dw and dbias NULL */
  static const char *names[3][3] = {
      {"bf16 linear_backward dinp", "bf16 linear_backward dw", "bf16 linear_backward dbias"},
      {"bf16 linear_backward dinp (untouched)", "bf16 linear_backward dw (dinp NULL)",
       "bf16 linear_backward dbias (dinp NULL)"},
      {"bf16 linear_backward dinp (dw NULL)", "bf16 linear_backward dw (untouched)",
       "bf16 linear_backward dbias (untouched)"},
  };
  for (int k = 0; k < 3; k++) {
    tr_bf16 *dinp = hround(hrand((int64_t)N * C, 1), (int64_t)N * C);
    float *dw = hrand((int64_t)OC * C, 1), *dbias = hrand(OC, 1);
    tr_bf16 *d_dinp = dput16(dinp, (int64_t)N * C);
    float *d_dw = dput(dw, (int64_t)OC * C), *d_dbias = dput(dbias, OC);
    int skip_dinp = k == 1, skip_dw = k == 2;
    cb->linear_backward(skip_dinp ? NULL : dinp, skip_dw ? NULL : dw, skip_dw ? NULL : dbias, dout, inp, w, N, C, OC);
    gb->linear_backward(skip_dinp ? NULL : d_dinp, skip_dw ? NULL : d_dw, skip_dw ? NULL : d_dbias, d_dout, d_inp, d_w,
                        N, C, OC);
    /* dinp += dout w with a bf16 dinp: cuBLAS may round dout w to bf16 before it adds beta * dinp (seen on
     * an H200, CUDA 13.0, OC = 200), one rounding more than the reference: GPUROUND */
    cmp16(names[k][0], si, d_dinp, dinp, (int64_t)N * C, B16_GPUROUND_ATOL, B16_GPUROUND_RTOL);
    cmp(names[k][1], si, dget(d_dw, (int64_t)OC * C), dw, (int64_t)OC * C, F32_TC_ATOL, F32_TC_RTOL);
    cmp(names[k][2], si, dget(d_dbias, OC), dbias, OC, RED_ATOL, RED_RTOL);
  }
}

static void test_bf16_layernorm(int si, const shape *s) {
  const int N = s->B * s->T, C = s->C;
  float *x = hrand((int64_t)N * C, 2), *w = hrand(C, 0.1f), *b = hrand(C, 0.1f);
  for (int i = 0; i < N * C; i++) x[i] += 0.5f; /* a mean away from 0 */
  for (int c = 0; c < C; c++) w[c] += 1.0f;
  tr_bf16 *inp = hround(x, (int64_t)N * C), *out = h16((int64_t)N * C);
  float *mean = hzero(N), *rstd = hzero(N);
  tr_bf16 *d_inp = dput16(inp, (int64_t)N * C), *d_out = dgarbage16((int64_t)N * C);
  float *d_w = dput(w, C), *d_b = dput(b, C), *d_mean = dgarbage(N), *d_rstd = dgarbage(N);
  cb->layernorm_forward(out, mean, rstd, inp, w, b, N, C);
  gb->layernorm_forward(d_out, d_mean, d_rstd, d_inp, d_w, d_b, N, C);
  cmp16("bf16 layernorm_forward out", si, d_out, out, (int64_t)N * C, B16_SUM_ATOL, B16_SUM_RTOL);
  cmp("bf16 layernorm_forward mean", si, dget(d_mean, N), mean, N, EW_ATOL, EW_RTOL);
  cmp("bf16 layernorm_forward rstd", si, dget(d_rstd, N), rstd, N, EW_ATOL, EW_RTOL);

  /* backward from the reference's mean and rstd on both sides */
  tr_bf16 *dout = hround(hrand((int64_t)N * C, 1), (int64_t)N * C);
  tr_bf16 *d_dout = dput16(dout, (int64_t)N * C);
  be->upload(d_mean, mean, sizeof(float) * (size_t)N);
  be->upload(d_rstd, rstd, sizeof(float) * (size_t)N);
  for (int skip_dinp = 0; skip_dinp < 2; skip_dinp++) {
    tr_bf16 *dinp = hround(hrand((int64_t)N * C, 1), (int64_t)N * C);
    float *dw = hrand(C, 1), *db = hrand(C, 1);
    tr_bf16 *d_dinp = dput16(dinp, (int64_t)N * C);
    float *d_dw = dput(dw, C), *d_db = dput(db, C);
    /* the reference needs dw and db; only dinp may be NULL here */
    cb->layernorm_backward(skip_dinp ? NULL : dinp, dw, db, dout, inp, w, mean, rstd, N, C);
    gb->layernorm_backward(skip_dinp ? NULL : d_dinp, d_dw, d_db, d_dout, d_inp, d_w, d_mean, d_rstd, N, C);
    cmp16(skip_dinp ? "bf16 layernorm_backward dinp (untouched)" : "bf16 layernorm_backward dinp", si, d_dinp, dinp,
          (int64_t)N * C, B16_SUM_ATOL, B16_SUM_RTOL);
    cmp(skip_dinp ? "bf16 layernorm_backward dw (dinp NULL)" : "bf16 layernorm_backward dw", si, dget(d_dw, C), dw, C,
        RED_ATOL, RED_RTOL);
    cmp(skip_dinp ? "bf16 layernorm_backward db (dinp NULL)" : "bf16 layernorm_backward db", si, dget(d_db, C), db, C,
        RED_ATOL, RED_RTOL);
  }
  /* the GPU also skips NULL dw and db: dinp alone */
  {
    tr_bf16 *dinp = hround(hrand((int64_t)N * C, 1), (int64_t)N * C);
    float *dw = hrand(C, 1), *db = hrand(C, 1);
    tr_bf16 *d_dinp = dput16(dinp, (int64_t)N * C);
    cb->layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, C);
    gb->layernorm_backward(d_dinp, NULL, NULL, d_dout, d_inp, d_w, d_mean, d_rstd, N, C);
    cmp16("bf16 layernorm_backward dinp (dw, db NULL)", si, d_dinp, dinp, (int64_t)N * C, B16_SUM_ATOL, B16_SUM_RTOL);
  }
}

static void test_bf16_gelu(int si, const shape *s) {
  const int64_t n = (int64_t)s->B * s->T * 4 * s->C;
  tr_bf16 *inp = hround(hrand(n, 2), n), *out = h16(n);
  tr_bf16 *d_inp = dput16(inp, n), *d_out = dgarbage16(n);
  cb->gelu_forward(out, inp, n);
  gb->gelu_forward(d_out, d_inp, n);
  cmp16("bf16 gelu_forward out", si, d_out, out, n, B16_EW_ATOL, B16_EW_RTOL);

  tr_bf16 *dout = hround(hrand(n, 1), n), *dinp = hround(hrand(n, 1), n);
  tr_bf16 *d_dout = dput16(dout, n), *d_dinp = dput16(dinp, n);
  cb->gelu_backward(dinp, inp, dout, n);
  gb->gelu_backward(d_dinp, d_inp, d_dout, n);
  gb->gelu_backward(NULL, d_inp, d_dout, n); /* skipped */
  cmp16("bf16 gelu_backward dinp", si, d_dinp, dinp, n, B16_EW_ATOL, B16_EW_RTOL);
}

static void test_bf16_add(int si, const shape *s) {
  const int64_t n = (int64_t)s->B * s->T * s->C;
  tr_bf16 *a = hround(hrand(n, 1), n), *b = hround(hrand(n, 1), n), *out = h16(n);
  tr_bf16 *d_a = dput16(a, n), *d_b = dput16(b, n), *d_out = dgarbage16(n);
  cb->add_forward(out, a, b, n);
  gb->add_forward(d_out, d_a, d_b, n);
  cmp16("bf16 add_forward out", si, d_out, out, n, B16_EW_ATOL, B16_EW_RTOL);

  tr_bf16 *dout = hround(hrand(n, 1), n);
  tr_bf16 *d_dout = dput16(dout, n);
  static const char *names[3][2] = {{"bf16 add_backward da", "bf16 add_backward db"},
                                    {"bf16 add_backward da (untouched)", "bf16 add_backward db (da NULL)"},
                                    {"bf16 add_backward da (db NULL)", "bf16 add_backward db (untouched)"}};
  for (int k = 0; k < 3; k++) {
    tr_bf16 *da = hround(hrand(n, 1), n), *db = hround(hrand(n, 1), n);
    tr_bf16 *d_da = dput16(da, n), *d_db = dput16(db, n);
    cb->add_backward(k == 1 ? NULL : da, k == 2 ? NULL : db, dout, n);
    gb->add_backward(k == 1 ? NULL : d_da, k == 2 ? NULL : d_db, d_dout, n);
    cmp16(names[k][0], si, d_da, da, n, B16_EW_ATOL, B16_EW_RTOL);
    cmp16(names[k][1], si, d_db, db, n, B16_EW_ATOL, B16_EW_RTOL);
  }
  /* add(x, x): dout twice in fp32, rounded once, on both sides (exact) */
  tr_bf16 *dx = hround(hrand(n, 1), n);
  tr_bf16 *d_dx = dput16(dx, n);
  cb->add_backward(dx, dx, dout, n);
  gb->add_backward(d_dx, d_dx, d_dout, n);
  cmp16("bf16 add_backward da == db", si, d_dx, dx, n, 0, 0);
}

static void test_bf16_attention(int si, const shape *s) {
  const int B = s->B, T = s->T, C = s->C, NH = s->NH;
  const int64_t nqkv = (int64_t)B * T * 3 * C, nout = (int64_t)B * T * C, natt = (int64_t)B * NH * T * T;
  tr_bf16 *qkv = hround(hrand(nqkv, 1), nqkv), *out = h16(nout), *att = h16(natt);
  tr_bf16 *d_qkv = dput16(qkv, nqkv), *d_out = dgarbage16(nout);
  tr_bf16 *d_att = dgarbage16(natt); /* all of it written, zeros above the diagonal included */
  cb->attention_forward(out, att, qkv, B, T, C, NH);
  gb->attention_forward(d_out, d_att, d_qkv, B, T, C, NH);
  cmp16("bf16 attention_forward out", si, d_out, out, nout, B16_GPUROUND_ATOL, B16_GPUROUND_RTOL);
  tr_bf16 *gatt = dget16(d_att, natt);
  cmp("bf16 attention_forward att", si, hwide(gatt, natt), hwide(att, natt), natt, B16_EW_ATOL, B16_EW_RTOL);
  int64_t nonzero = 0;
  for (int64_t bh = 0; bh < (int64_t)B * NH; bh++)
    for (int t = 0; t < T; t++)
      for (int t2 = t + 1; t2 < T; t2++) nonzero += gatt[(bh * T + t) * T + t2] != 0;
  CHECK(nonzero == 0, "bf16 attention_forward: %lld entries of att above the diagonal are not +0",
        (long long)nonzero);

  /* backward from the reference's att on both sides */
  be->upload(d_att, att, sizeof(tr_bf16) * (size_t)natt);
  tr_bf16 *dout = hround(hrand(nout, 1), nout), *dqkv = hround(hrand(nqkv, 1), nqkv), *scratch = h16(natt);
  tr_bf16 *d_dout = dput16(dout, nout), *d_dqkv = dput16(dqkv, nqkv), *d_scratch = dgarbage16(natt);
  cb->attention_backward(dqkv, scratch, dout, qkv, att, B, T, C, NH);
  gb->attention_backward(d_dqkv, d_scratch, d_dout, d_qkv, d_att, B, T, C, NH);
  gb->attention_backward(NULL, d_scratch, d_dout, d_qkv, d_att, B, T, C, NH); /* nothing to do */
  cmp16("bf16 attention_backward dqkv", si, d_dqkv, dqkv, nqkv, B16_GPUROUND_ATOL, B16_GPUROUND_RTOL);
}

static void test_bf16_crossentropy(int si, const shape *s) {
  const int N = s->B * s->T, V = s->V;
  const int64_t n = (int64_t)N * V;
  tr_bf16 *logits = hround(hrand(n, 2), n), *probs = h16(n);
  int32_t *tg = hkeep(malloc(sizeof(int32_t) * (size_t)N));
  for (int i = 0; i < N; i++) tg[i] = (int32_t)rng_below(&R, (uint64_t)V);
  tr_bf16 *d_logits = dput16(logits, n), *d_probs = dgarbage16(n);
  float *d_loss = dgarbage(1);
  int32_t *d_tg = dput_i(tg, N);
  float loss = NAN;
  cb->crossentropy_forward(&loss, probs, logits, tg, N, V);
  gb->crossentropy_forward(d_loss, d_probs, d_logits, d_tg, N, V);
  cmp("bf16 crossentropy_forward loss", si, dget(d_loss, 1), &loss, 1, RED_ATOL, RED_RTOL);
  cmp16("bf16 crossentropy_forward probs", si, d_probs, probs, n, B16_EW_ATOL, B16_EW_RTOL);

  /* backward from the reference's probs on both sides */
  be->upload(d_probs, probs, sizeof(tr_bf16) * (size_t)n);
  const float dloss = 1.7f;
  tr_bf16 *dlogits = hround(hrand(n, 1), n);
  tr_bf16 *d_dlogits = dput16(dlogits, n);
  float *d_dloss = dput(&dloss, 1);
  cb->crossentropy_backward(dlogits, probs, tg, &dloss, N, V);
  gb->crossentropy_backward(d_dlogits, d_probs, d_tg, d_dloss, N, V);
  gb->crossentropy_backward(NULL, d_probs, d_tg, d_dloss, N, V); /* skipped */
  cmp16("bf16 crossentropy_backward dlogits", si, d_dlogits, dlogits, n, B16_EW_ATOL, B16_EW_RTOL);

  /* targets outside [0,V): NaN loss on both */
  tg[0] = -1;
  tg[N / 2] = V;
  be->upload(d_tg, tg, sizeof(int32_t) * (size_t)N);
  tr_bf16 *probs2 = hdup16(probs, n);
  cb->crossentropy_forward(&loss, probs2, logits, tg, N, V);
  gb->crossentropy_forward(d_loss, d_probs, d_logits, d_tg, N, V);
  float *gl = dget(d_loss, 1);
  CHECK(isnan(loss) && isnan(gl[0]), "bf16 bad target: cpu loss %g, gpu loss %g (both should be NaN)", loss, gl[0]);
}

/* --- sizes and data that take other paths --- */

/* Past EW_MAX_BLOCKS x EW_THREADS elements (65536 x 256, device.cuh) the
 * grid-stride loops of the elementwise kernels take a second pass: every
 * element of the tail must still be done once. */
static void test_big(void) {
  const int64_t n = ((int64_t)65536 * 256) + 12345;
  float *x = hrand(n, 1), *y = hrand(n, 1);
  float *d_x = dput(x, n), *d_y = dput(y, n);
  float *out = hzero(n), *d_out = dgarbage(n);
  add_forward(out, x, y, n);
  be->add_forward(d_out, d_x, d_y, n);
  cmp("big add_forward (second grid-stride pass)", 0, dget(d_out, n), out, n, 0, 0);
  gelu_forward(out, x, n);
  be->gelu_forward(d_out, d_x, n);
  cmp("big gelu_forward", 0, dget(d_out, n), out, n, EW_ATOL, EW_RTOL);
  float *s = hdup(x, n);
  par_scale(s, n, 0.37f);
  be->scale(d_x, n, 0.37f);
  cmp("big scale", 0, dget(d_x, n), s, n, 0, 0);
  double cs = par_sumsq(s, n), gs = be->sumsq(d_x, n);
  CHECK(fabs(gs - cs) <= 1e-10 * cs, "big sumsq: gpu %.17g cpu %.17g", gs, cs);
  tr_bf16 *w16 = hkeep(malloc(sizeof(tr_bf16) * (size_t)n)), *d_w16 = dalloc(sizeof(tr_bf16) * (size_t)n);
  tr_bf16_round(w16, s, n);
  be->bf16->to_bf16(d_w16, d_x, n);
  tr_bf16 *g16 = hkeep(malloc(sizeof(tr_bf16) * (size_t)n));
  CHECK(be->download(g16, d_w16, sizeof(tr_bf16) * (size_t)n) == 0, "download: %s", be->error());
  CHECK(memcmp(g16, w16, sizeof(tr_bf16) * (size_t)n) == 0, "big to_bf16 differs from the host rounding");
}

/* embed_backward sorts positions by token and sums each token's run in
 * position order (no atomics): long runs of one token (one block walks a
 * run of thousands) give the CPU's bits, fp32 and bf16. C = 200: two
 * column blocks of EMBED_THREADS, the second partial. */
static void test_embed_runs(void) {
  const int B = 4, T = 1024, C = 200, V = 50, N = B * T;
  int32_t *tok = hkeep(malloc(sizeof(int32_t) * (size_t)N));
  for (int i = 0; i < N; i++) tok[i] = i < 3000 ? 7 : (i / 250) % 2 ? 3 : 41; /* one run of 3000, then runs of 250 */
  int32_t *d_tok = dput_i(tok, N);
  float *dout = hrand((int64_t)N * C, 1), *dwte = hrand((int64_t)V * C, 1), *dwpe = hrand((int64_t)T * C, 1);
  float *d_dout = dput(dout, (int64_t)N * C), *d_dwte = dput(dwte, (int64_t)V * C), *d_dwpe = dput(dwpe, (int64_t)T * C);
  embed_backward(dwte, dwpe, dout, tok, B, T, C);
  be->embed_backward(d_dwte, d_dwpe, d_dout, d_tok, B, T, C);
  cmp("embed_backward dwte, long runs of one token", 0, dget(d_dwte, (int64_t)V * C), dwte, (int64_t)V * C, 0, 0);
  cmp("embed_backward dwpe, long runs of one token", 0, dget(d_dwpe, (int64_t)T * C), dwpe, (int64_t)T * C, EW_ATOL,
      EW_RTOL);
  if (!be->bf16) return;
  tr_bf16 *dout16 = hkeep(malloc(sizeof(tr_bf16) * (size_t)N * C));
  tr_bf16_round(dout16, dout, (int64_t)N * C);
  tr_bf16 *d_dout16 = dalloc(sizeof(tr_bf16) * (size_t)N * C);
  CHECK(be->upload(d_dout16, dout16, sizeof(tr_bf16) * (size_t)N * C) == 0, "upload: %s", be->error());
  float *dwte2 = hrand((int64_t)V * C, 1);
  float *d_dwte2 = dput(dwte2, (int64_t)V * C);
  backend_cpu()->bf16->embed_backward(dwte2, NULL, dout16, tok, B, T, C);
  be->bf16->embed_backward(d_dwte2, NULL, d_dout16, d_tok, B, T, C);
  cmp("bf16 embed_backward dwte, long runs of one token", 0, dget(d_dwte2, (int64_t)V * C), dwte2, (int64_t)V * C, 0,
      0);
}

/* --- vector ops --- */

static void test_vector_ops(void) {
  const int64_t n = 100003;
  float *x = hrand(n, 1);
  float *d_x = dput(x, n);

  double cs = par_sumsq(x, n), gs = be->sumsq(d_x, n), gs2 = be->sumsq(d_x, n);
  CHECK(fabs(gs - cs) <= 1e-10 * cs, "sumsq: gpu %.17g cpu %.17g", gs, cs);
  CHECK(memcmp(&gs, &gs2, sizeof gs) == 0, "sumsq not deterministic: %.17g then %.17g", gs, gs2);
  double small = be->sumsq(d_x, 5), csmall = par_sumsq(x, 5);
  CHECK(fabs(small - csmall) <= 1e-12 * csmall, "sumsq (n=5): gpu %.17g cpu %.17g", small, csmall);
  CHECK(be->sumsq(d_x, 0) == 0.0, "sumsq of nothing is not 0");
  printf("  ok-ish sumsq: gpu %.17g cpu %.17g\n", gs, cs);

  float *y = hdup(x, n);
  par_scale(y, n, 0.37f);
  be->scale(d_x, n, 0.37f);
  cmp("scale", 0, dget(d_x, n), y, n, 0, 0);

  be->zero(d_x, n - 1); /* the last element stays */
  float *z = hzero(n);
  z[n - 1] = y[n - 1];
  cmp("zero", 0, dget(d_x, n), z, n, 0, 0);

  /* AdamW against the cpu backend's (the formula of backend.h) */
  const int64_t m = 1001;
  float *p = hrand(m, 1), *g = hrand(m, 1), *mo = hrand(m, 0.1f), *v = hrand(m, 0.01f);
  for (int64_t i = 0; i < m; i++) v[i] = v[i] * v[i] + 1e-6f; /* second moments are >= 0 */
  float *d_p = dput(p, m), *d_g = dput(g, m), *d_m = dput(mo, m), *d_v = dput(v, m);
  const float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f;
  const float c1 = 1.0f - powf(b1, 3.0f), c2 = 1.0f - powf(b2, 3.0f);
  backend_cpu()->adamw(p, g, mo, v, m, lr, b1, b2, eps, wd, c1, c2);
  be->adamw(d_p, d_g, d_m, d_v, m, lr, b1, b2, eps, wd, c1, c2);
  cmp("adamw p", 0, dget(d_p, m), p, m, EW_ATOL, EW_RTOL);
  cmp("adamw m", 0, dget(d_m, m), mo, m, EW_ATOL, EW_RTOL);
  cmp("adamw v", 0, dget(d_v, m), v, m, EW_ATOL, EW_RTOL);
}

/* --- memory --- */

static void test_memory(void) {
  /* alloc returns zeroed memory; alloc(0) is a real pointer */
  uint8_t *d0 = dalloc(0);
  CHECK(d0 != NULL, "alloc(0) returned NULL");
  const size_t bytes = 1001; /* not a multiple of 4 */
  uint8_t *da = dalloc(bytes), *db = dalloc(bytes);
  uint8_t *h = hkeep(malloc(bytes)), *back = hkeep(malloc(bytes));
  memset(back, 0xAB, bytes);
  CHECK(be->download(back, da, bytes) == 0, "download: %s", be->error());
  size_t nz = 0;
  for (size_t i = 0; i < bytes; i++) nz += back[i] != 0;
  CHECK(nz == 0, "alloc: %zu of %zu bytes not zeroed", nz, bytes);

  for (size_t i = 0; i < bytes; i++) h[i] = (uint8_t)rng_u64(&R);
  CHECK(be->upload(da, h, bytes) == 0, "upload: %s", be->error());
  CHECK(be->download(back, da, bytes) == 0, "download: %s", be->error());
  CHECK(memcmp(h, back, bytes) == 0, "upload/download round trip differs");
  CHECK(be->copy(db, da, bytes) == 0, "copy: %s", be->error());
  memset(back, 0, bytes);
  CHECK(be->download(back, db, bytes) == 0, "download: %s", be->error());
  CHECK(memcmp(h, back, bytes) == 0, "device-to-device copy differs");
  CHECK(be->upload(da, h, 0) == 0 && be->download(back, da, 0) == 0 && be->copy(db, da, 0) == 0,
        "zero-byte transfers: %s", be->error());
  CHECK(be->sync() == 0, "sync: %s", be->error());
}

/* --- level-1 checkpoint copies: mark on this thread, copy and wait on another --- */

typedef struct {
  void *dst;
  const void *src;
  size_t bytes;
  int rc_copy, rc_wait;
} copy_job;

static void *copy_thread(void *arg) {
  copy_job *j = arg;
  j->rc_copy = be->ckpt_copy(j->dst, j->src, j->bytes);
  j->rc_wait = be->ckpt_wait();
  if (j->rc_copy || j->rc_wait) fprintf(stderr, "copy thread: %s\n", be->error());
  return NULL;
}

static void test_ckpt(void) {
  /* the copy reads the first n floats of a big buffer, after enough queued
   * work on it (a few ms) that a copy not ordered after the mark would
   * start early and read the values from before the last scale */
  const int64_t n = 4099, big = (int64_t)1 << 24;
  const size_t bytes = sizeof(float) * (size_t)n, staged = (bytes + 4095) / 4096 * 4096;
  float *stage = aligned_alloc(4096, staged);
  CHECK(stage != NULL, "aligned_alloc");
  if (!stage) return;
  memset(stage, 0, staged);
  CHECK(be->ckpt_pin(stage, staged) == 0, "ckpt_pin: %s", be->error());

  float *x = hrand(n, 1), *want = hdup(x, n);
  for (int64_t i = 0; i < n; i++) want[i] *= 2.0f;
  float *d_x = dalloc(sizeof(float) * (size_t)big);
  CHECK(be->upload(d_x, x, sizeof(float) * (size_t)n) == 0, "upload: %s", be->error());
  for (int i = 0; i < 50; i++) be->scale(d_x, big, 1.0f);
  be->scale(d_x, big, 2.0f); /* queued last: the copy must see it */
  CHECK(be->ckpt_mark() == 0, "ckpt_mark: %s", be->error());

  copy_job j = {stage, d_x, bytes, -1, -1};
  pthread_t th;
  CHECK(pthread_create(&th, NULL, copy_thread, &j) == 0, "pthread_create");
  pthread_join(th, NULL);
  CHECK(j.rc_copy == 0 && j.rc_wait == 0, "ckpt_copy %d, ckpt_wait %d", j.rc_copy, j.rc_wait);
  cmp("ckpt_copy (after scale, from another thread)", 0, stage, want, n, 0, 0);

  be->ckpt_unpin(stage);
  free(stage);
}

int main(void) {
  be = backend_get("cuda", 0);
  if (!be) {
    printf("test_cuda: SKIP: %s\n", tr_error());
    return 77;
  }
  printf("test_cuda: %s\n", be->describe());
  kernels_set_threads(1); /* the CPU reference */
  rng_seed(&R, 20240611);

  test_memory();
  release();
  test_vector_ops();
  release();
  test_ckpt();
  release();
  for (int si = 0; si < (int)(sizeof shapes / sizeof shapes[0]); si++) {
    const shape *s = &shapes[si];
    printf("shape %d: B=%d T=%d C=%d NH=%d OC=%d V=%d\n", si, s->B, s->T, s->C, s->NH, s->OC, s->V);
    test_embed(si, s);
    release();
    test_linear(si, s);
    release();
    test_layernorm(si, s);
    release();
    test_gelu(si, s);
    release();
    test_add(si, s);
    release();
    test_attention(si, s);
    release();
    test_crossentropy(si, s);
    release();
  }
  gb = be->bf16;
  cb = backend_cpu()->bf16;
  CHECK(gb != NULL && cb != NULL, "bf16 ops missing: cuda %p, cpu %p", (const void *)gb, (const void *)cb);
  if (gb && cb) {
    printf("bf16 ops:\n");
    test_bf16_to();
    release();
    for (int si = 0; si < (int)(sizeof shapes / sizeof shapes[0]); si++) {
      const shape *s = &shapes[si];
      printf("bf16, shape %d: B=%d T=%d C=%d NH=%d OC=%d V=%d\n", si, s->B, s->T, s->C, s->NH, s->OC, s->V);
      test_bf16_embed(si, s);
      release();
      test_bf16_linear(si, s);
      release();
      test_bf16_layernorm(si, s);
      release();
      test_bf16_gelu(si, s);
      release();
      test_bf16_add(si, s);
      release();
      test_bf16_attention(si, s);
      release();
      test_bf16_crossentropy(si, s);
      release();
    }
    /* the bf16 attention's fp32 score scratch goes by chunks of heads (256
     * MiB of scores each): shrunk by the test hook, so these shapes take
     * one chunk, several whole ones, and whole ones plus a partial one */
    setenv("TRANSOM_TEST_ATTN_SCORE_FLOATS", "8192", 1);
    for (int si = 0; si < (int)(sizeof shapes / sizeof shapes[0]); si++) {
      const shape *s = &shapes[si];
      const int64_t per = (int64_t)s->T * s->T, ch = 8192 / per < 1 ? 1 : 8192 / per;
      printf("bf16 attention in chunks of %lld of %d heads, shape %d\n", (long long)ch, s->B * s->NH, si);
      test_bf16_attention(si, s);
      release();
    }
    unsetenv("TRANSOM_TEST_ATTN_SCORE_FLOATS");
  }
  /* causal attention's matmuls by panels of query rows (device.cuh: T >= 256
   * takes them): 5 rows makes these shapes take 2, 13 and 9 panels (a short
   * last one in the first two); bf16 also with its scores in chunks of heads */
  setenv("TRANSOM_TEST_ATTN_PANEL_ROWS", "5", 1);
  for (int si = 0; si < (int)(sizeof shapes / sizeof shapes[0]); si++) {
    const shape *s = &shapes[si];
    printf("attention in panels of 5 rows, shape %d\n", si);
    test_attention(si, s);
    release();
    if (gb && cb) {
      test_bf16_attention(si, s);
      release();
      setenv("TRANSOM_TEST_ATTN_SCORE_FLOATS", "8192", 1);
      test_bf16_attention(si, s);
      release();
      unsetenv("TRANSOM_TEST_ATTN_SCORE_FLOATS");
    }
  }
  unsetenv("TRANSOM_TEST_ATTN_PANEL_ROWS");
  printf("big tensors, long token runs:\n");
  test_big();
  release();
  test_embed_runs();
  release();
  CHECK(be->sync() == 0, "sync at the end: %s", be->error());
  return check_report("test_cuda");
}
