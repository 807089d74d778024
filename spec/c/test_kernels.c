/* test_kernels.c — every op's backward against central finite differences.
 *
 * For an op f with output y, the scalar L = sum(y * R) with a fixed random R
 * has dL/dy = R, so the op's backward run with dout = R must give dL/dx for
 * every input x; the numeric gradient is (L(x+h) - L(x-h)) / 2h with L
 * accumulated in double. Shapes are random per op (seeded). Tolerances:
 * |analytic - numeric| <= 5e-4 + 5e-3 * max(|analytic|, |numeric|), with
 * h = 1e-2 (float32 kernels: smaller h drowns in rounding error).
 */
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "check.h"
#include "kernels.h"
#include "rng.h"

#define H 1e-2
#define ATOL 5e-4
#define RTOL 5e-3

static rng_t R;

static float *rand_buf(int64_t n, float scale) {
  float *p = malloc(sizeof(float) * (size_t)n);
  for (int64_t i = 0; i < n; i++) p[i] = scale * rng_normal(&R);
  return p;
}
static float *zeros(int64_t n) { return calloc((size_t)n, sizeof(float)); }
static float *nans(int64_t n) {
  float *p = malloc(sizeof(float) * (size_t)n);
  for (int64_t i = 0; i < n; i++) p[i] = NAN;
  return p;
}
static int rnd(int lo, int hi) { return lo + (int)rng_below(&R, (uint64_t)(hi - lo + 1)); }

/* The op under test, as a closure over its buffers. */
typedef struct op_case op_case;
struct op_case {
  void (*forward)(op_case *c);
  float *out;
  int64_t nout;
  float *weights; /* R */
};

static double loss_of(op_case *c) {
  c->forward(c);
  double L = 0;
  for (int64_t i = 0; i < c->nout; i++) L += (double)c->out[i] * c->weights[i];
  return L;
}

/* numeric dL/dx for every element of x (x is perturbed in place and restored) */
static double *numeric_grad(op_case *c, float *x, int64_t n) {
  double *g = malloc(sizeof(double) * (size_t)n);
  for (int64_t i = 0; i < n; i++) {
    float keep = x[i];
    x[i] = keep + (float)H;
    double lp = loss_of(c);
    x[i] = keep - (float)H;
    double lm = loss_of(c);
    x[i] = keep;
    g[i] = (lp - lm) / (2 * H);
  }
  return g;
}

static void check_grad(const char *what, op_case *c, float *x, const float *analytic, int64_t n) {
  double *num = numeric_grad(c, x, n);
  grad_compare(what, analytic, num, (int)n, ATOL, RTOL);
  free(num);
}

/* --- linear --- */
static int lN, lC, lOC;
static float *lx, *lw, *lb;
static void linear_fwd(op_case *c) { linear_forward(c->out, lx, lw, lb, lN, lC, lOC); }

static void test_linear(int with_bias) {
  lN = rnd(1, 7);
  lC = rnd(1, 9);
  lOC = rnd(1, 8);
  lx = rand_buf((int64_t)lN * lC, 1);
  lw = rand_buf((int64_t)lOC * lC, 1);
  lb = with_bias ? rand_buf(lOC, 1) : NULL;
  op_case c = {linear_fwd, zeros((int64_t)lN * lOC), (int64_t)lN * lOC, rand_buf((int64_t)lN * lOC, 1)};
  float *dx = zeros((int64_t)lN * lC), *dw = zeros((int64_t)lOC * lC), *db = zeros(lOC);
  linear_backward(dx, dw, with_bias ? db : NULL, c.weights, lx, lw, lN, lC, lOC);
  check_grad("linear dinp", &c, lx, dx, (int64_t)lN * lC);
  check_grad("linear dw", &c, lw, dw, (int64_t)lOC * lC);
  if (with_bias) check_grad("linear dbias", &c, lb, db, lOC);
  free(lx), free(lw), free(lb), free(c.out), free(c.weights), free(dx), free(dw), free(db);
}

/* --- layernorm --- */
static int nN, nC;
static float *nx, *nw, *nb, *nmean, *nrstd;
static void ln_fwd(op_case *c) { layernorm_forward(c->out, nmean, nrstd, nx, nw, nb, nN, nC); }

static void test_layernorm(void) {
  nN = rnd(1, 6);
  nC = rnd(2, 12);
  nx = rand_buf((int64_t)nN * nC, 1);
  nw = rand_buf(nC, 1);
  nb = rand_buf(nC, 1);
  nmean = zeros(nN);
  nrstd = zeros(nN);
  op_case c = {ln_fwd, zeros((int64_t)nN * nC), (int64_t)nN * nC, rand_buf((int64_t)nN * nC, 1)};
  ln_fwd(&c);
  float *dx = zeros((int64_t)nN * nC), *dw = zeros(nC), *db = zeros(nC);
  layernorm_backward(dx, dw, db, c.weights, nx, nw, nmean, nrstd, nN, nC);
  check_grad("layernorm dinp", &c, nx, dx, (int64_t)nN * nC);
  check_grad("layernorm dw", &c, nw, dw, nC);
  check_grad("layernorm db", &c, nb, db, nC);
  free(nx), free(nw), free(nb), free(nmean), free(nrstd), free(c.out), free(c.weights), free(dx), free(dw), free(db);
}

/* --- gelu, add --- */
static int64_t en;
static float *ea, *eb;
static void gelu_fwd(op_case *c) { gelu_forward(c->out, ea, en); }
static void add_fwd(op_case *c) { add_forward(c->out, ea, eb, en); }

static void test_elementwise(void) {
  en = rnd(1, 50);
  ea = rand_buf(en, 2);
  eb = rand_buf(en, 2);
  op_case g = {gelu_fwd, zeros(en), en, rand_buf(en, 1)};
  float *da = zeros(en), *db = zeros(en);
  gelu_backward(da, ea, g.weights, en);
  check_grad("gelu dinp", &g, ea, da, en);
  /* GELU against the closed form at a few points */
  float x[4] = {-3.0f, -0.5f, 0.0f, 1.5f}, y[4];
  gelu_forward(y, x, 4);
  for (int i = 0; i < 4; i++) {
    double ref = 0.5 * x[i] * (1 + tanh(0.7978845608028654 * (x[i] + 0.044715 * x[i] * x[i] * x[i])));
    CHECK(fabs(y[i] - ref) < 1e-6, "gelu(%g) = %.9g, expected %.9g", x[i], y[i], ref);
  }
  op_case a = {add_fwd, zeros(en), en, rand_buf(en, 1)};
  memset(da, 0, sizeof(float) * (size_t)en);
  add_backward(da, db, a.weights, en);
  check_grad("add da", &a, ea, da, en);
  check_grad("add db", &a, eb, db, en);
  free(ea), free(eb), free(g.out), free(g.weights), free(a.out), free(a.weights), free(da), free(db);
}

/* add(x, x): one gradient buffer is both da and db and gets dout twice.
 * The host bf16 kernel (the reference of the CUDA bf16 ones) must do the
 * same: widen once, add twice in fp32, round once; exact. */
static void test_add_aliased_bf16(void) {
  const tr_bf16_ops *b = &kernels_bf16_ops;
  int64_t n = rnd(1, 300);
  float *g = rand_buf(n, 1), *d = rand_buf(n, 1), *want = malloc(sizeof(float) * (size_t)n);
  uint16_t *g16 = malloc(sizeof(uint16_t) * (size_t)n), *d16 = malloc(sizeof(uint16_t) * (size_t)n);
  tr_bf16_round(g16, g, n);
  tr_bf16_round(d16, d, n);
  tr_bf16_widen(want, g16, n);
  tr_bf16_widen(d, d16, n);
  add_backward(want, want, d, n); /* the fp32 kernel: want += d twice */
  b->add_backward(g16, g16, d16, n);
  int bad = 0;
  for (int64_t i = 0; i < n; i++)
    if (g16[i] != tr_f32_to_bf16(want[i]) && bad++ < 5)
      fprintf(stderr, "  bf16 add_backward(x, x)[%lld] = %g, want %g\n", (long long)i, tr_bf16_to_f32(g16[i]),
              tr_bf16_to_f32(tr_f32_to_bf16(want[i])));
  CHECK(bad == 0, "bf16 add_backward with da == db: %d of %lld gradients wrong (the gradient must be added twice)",
        bad, (long long)n);
  free(g), free(d), free(want), free(g16), free(d16);
}

/* --- embedding (gradient w.r.t. the tables) --- */
static int mB, mT, mC, mV;
static int32_t *mtok;
static float *mwte, *mwpe;
static void embed_fwd(op_case *c) { embed_forward(c->out, mtok, mwte, mwpe, mB, mT, mC); }

static void test_embed(void) {
  mB = rnd(1, 3);
  mT = rnd(1, 5);
  mC = rnd(1, 6);
  mV = rnd(2, 5); /* small V: repeated tokens exercise accumulation */
  mtok = malloc(sizeof(int32_t) * (size_t)(mB * mT));
  for (int i = 0; i < mB * mT; i++) mtok[i] = (int32_t)rng_below(&R, (uint64_t)mV);
  mwte = rand_buf((int64_t)mV * mC, 1);
  mwpe = rand_buf((int64_t)mT * mC, 1);
  int64_t n = (int64_t)mB * mT * mC;
  op_case c = {embed_fwd, zeros(n), n, rand_buf(n, 1)};
  float *dwte = zeros((int64_t)mV * mC), *dwpe = zeros((int64_t)mT * mC);
  embed_backward(dwte, dwpe, c.weights, mtok, mB, mT, mC);
  check_grad("embed dwte", &c, mwte, dwte, (int64_t)mV * mC);
  check_grad("embed dwpe", &c, mwpe, dwpe, (int64_t)mT * mC);
  free(mtok), free(mwte), free(mwpe), free(c.out), free(c.weights), free(dwte), free(dwpe);
}

/* --- attention --- */
static int aB, aT, aC, aNH;
static float *aqkv, *aatt;
static void att_fwd(op_case *c) { attention_forward(c->out, aatt, aqkv, aB, aT, aC, aNH); }

/* A random attention shape with T in [tlo, thi] and its input qkv; the
 * element counts of qkv, out and att (all heads). */
static void att_shape(int tlo, int thi, int64_t *nq, int64_t *no, int64_t *na) {
  aB = rnd(1, 2);
  aT = rnd(tlo, thi);
  aNH = rnd(1, 3);
  aC = aNH * rnd(1, 4);
  *nq = (int64_t)aB * aT * 3 * aC, *no = (int64_t)aB * aT * aC, *na = (int64_t)aB * aNH * aT * aT;
  aqkv = rand_buf(*nq, 1);
}

static void test_attention(void) {
  int64_t nq, no, na;
  att_shape(1, 6, &nq, &no, &na);
  aatt = zeros(na);
  float *scratch = zeros(na);
  op_case c = {att_fwd, zeros(no), no, rand_buf(no, 1)};
  att_fwd(&c);
  /* causality: each att row sums to 1 over t2 <= t and is 0 after */
  int causal = 1;
  for (int bh = 0; bh < aB * aNH; bh++)
    for (int t = 0; t < aT; t++) {
      double s = 0;
      for (int t2 = 0; t2 < aT; t2++) {
        float a = aatt[((int64_t)bh * aT + t) * aT + t2];
        if (t2 > t && a != 0.0f) causal = 0;
        s += a;
      }
      if (fabs(s - 1) > 1e-5) causal = 0;
    }
  CHECK(causal, "attention rows must be causal softmax distributions (B=%d T=%d NH=%d)", aB, aT, aNH);
  float *dqkv = zeros(nq);
  attention_backward(dqkv, scratch, c.weights, aqkv, aatt, aB, aT, aC, aNH);
  check_grad("attention dqkv", &c, aqkv, dqkv, nq);
  free(aqkv), free(aatt), free(scratch), free(c.out), free(c.weights), free(dqkv);
}

/* Causal attention by panels of query rows (kernels.c, ATTN_PANEL): panels
 * of 2 rows on T = 5..9 (a short last panel for odd T) pass the same
 * gradient check, and give what one panel (the whole products) gives, up
 * to the order of fp32 sums. */
static void test_attention_panels(void) {
  setenv("TRANSOM_TEST_ATTN_PANEL_ROWS", "2", 1);
  int64_t nq, no, na;
  att_shape(5, 9, &nq, &no, &na);
  /* outputs and scratch start as NaN: an element read before it is written shows */
  aatt = nans(na);
  float *scratch = nans(na), *dq2 = zeros(nq), *out1 = nans(no), *att1 = nans(na), *dq1 = zeros(nq);
  op_case c = {att_fwd, nans(no), no, rand_buf(no, 1)};
  att_fwd(&c);
  attention_backward(dq2, scratch, c.weights, aqkv, aatt, aB, aT, aC, aNH);
  check_grad("attention dqkv, panels of 2 rows", &c, aqkv, dq2, nq);
  att_fwd(&c); /* check_grad left its last perturbation's att */
  for (int64_t i = 0; i < na; i++) scratch[i] = NAN;
  setenv("TRANSOM_TEST_ATTN_PANEL_ROWS", "0", 1);
  attention_forward(out1, att1, aqkv, aB, aT, aC, aNH);
  attention_backward(dq1, scratch, c.weights, aqkv, att1, aB, aT, aC, aNH);
  double worst = 0;
  for (int64_t i = 0; i < no; i++) worst = fmax(worst, fabs(c.out[i] - out1[i]) / (1e-5 + 1e-4 * fabs(out1[i])));
  for (int64_t i = 0; i < na; i++) worst = fmax(worst, fabs(aatt[i] - att1[i]) / (1e-5 + 1e-4 * fabs(att1[i])));
  for (int64_t i = 0; i < nq; i++) worst = fmax(worst, fabs(dq2[i] - dq1[i]) / (1e-5 + 1e-4 * fabs(dq1[i])));
  CHECK(worst <= 1, "panels of 2 rows vs one panel (T=%d): out, att and dqkv differ by %g of 1e-5 + 1e-4 |x|", aT,
        worst);
  unsetenv("TRANSOM_TEST_ATTN_PANEL_ROWS");
  free(aqkv), free(aatt), free(scratch), free(c.out), free(c.weights), free(dq2), free(out1), free(att1), free(dq1);
}

/* --- cross-entropy --- */
static int xN, xV;
static float *xlog, *xprobs;
static int32_t *xtgt;
static void xent_fwd(op_case *c) { c->out[0] = crossentropy_forward(xprobs, xlog, xtgt, xN, xV); }

static void test_crossentropy(void) {
  xN = rnd(1, 6);
  xV = rnd(2, 10);
  xlog = rand_buf((int64_t)xN * xV, 2);
  xprobs = zeros((int64_t)xN * xV);
  xtgt = malloc(sizeof(int32_t) * (size_t)xN);
  for (int i = 0; i < xN; i++) xtgt[i] = (int32_t)rng_below(&R, (uint64_t)xV);
  float w = 0.7f, out = 0;
  op_case c = {xent_fwd, &out, 1, &w};
  xent_fwd(&c);
  float *dl = zeros((int64_t)xN * xV);
  crossentropy_backward(dl, xprobs, xtgt, w, xN, xV);
  check_grad("cross_entropy dlogits", &c, xlog, dl, (int64_t)xN * xV);
  /* uniform logits: the loss is log V */
  memset(xlog, 0, sizeof(float) * (size_t)xN * xV);
  float L = crossentropy_forward(xprobs, xlog, xtgt, xN, xV);
  CHECK(fabsf(L - logf((float)xV)) < 1e-5f, "uniform logits: loss %g, expected log(%d) = %g", L, xV, logf((float)xV));
  /* a target outside the vocabulary is reported as NaN, never read out of bounds */
  xtgt[0] = xV;
  CHECK(isnan(crossentropy_forward(xprobs, xlog, xtgt, xN, xV)), "out-of-range target must give NaN");
  free(xlog), free(xprobs), free(xtgt), free(dl);
}

int main(void) {
  for (int threads = 1; threads <= 2; threads++) {
    kernels_set_threads(threads);
    rng_seed(&R, 42 + (uint64_t)threads);
    for (int rep = 0; rep < 6; rep++) {
      test_linear(rep % 2);
      test_layernorm();
      test_elementwise();
      test_add_aliased_bf16();
      test_embed();
      test_attention();
      test_attention_panels();
      test_crossentropy();
    }
  }
  return check_report("test_kernels");
}
