/* kernels_bf16.c — the bf16-activation ops (backend.h, tr_bf16_ops) on the
 * host: the reference the CUDA bf16 kernels are tested against, and the
 * bf16 table of the cpu and emu backends.
 *
 * Each op widens its bf16 inputs to fp32 temporaries, runs the fp32 kernel of
 * kernels.c, and rounds what it stores to bf16 (round to nearest even). A
 * bf16 gradient that is accumulated (`+=`) is widened, accumulated in fp32 by
 * the fp32 kernel, and rounded once. So every sum is an fp32 sum and the
 * only rounding is where a value is stored, as backend.h asks. It is not
 * fast (the temporaries are allocated per call): it exists to be exact.
 */
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "kernels.h"

float tr_bf16_to_f32(tr_bf16 h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

tr_bf16 tr_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (tr_bf16)((u >> 16) | 0x0040u); /* NaN stays a (quiet) NaN */
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest, ties to even */
  return (tr_bf16)(u >> 16);
}

void tr_bf16_widen(float *dst, const tr_bf16 *src, int64_t n) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; i++) dst[i] = tr_bf16_to_f32(src[i]);
}

void tr_bf16_round(tr_bf16 *dst, const float *src, int64_t n) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; i++) dst[i] = tr_f32_to_bf16(src[i]);
}

/* --- temporaries: at most 6 live per op; an allocation failure makes the op
 * a no-op on its outputs (there is no error channel in a kernel; the host
 * is out of memory and the next allocation anywhere reports it) --- */

typedef struct {
  float *p[6];
  int n, failed;
} temps;

static float *tmp(temps *t, int64_t n) {
  float *p = malloc(sizeof(float) * (size_t)(n > 0 ? n : 1));
  if (!p) t->failed = 1;
  t->p[t->n++] = p;
  return p;
}

/* a widened copy of src (NULL stays NULL) */
static float *wide(temps *t, const tr_bf16 *src, int64_t n) {
  if (!src) return NULL;
  float *p = tmp(t, n);
  if (p) tr_bf16_widen(p, src, n);
  return p;
}

static void done(temps *t) {
  for (int i = 0; i < t->n; i++) free(t->p[i]);
}

/* rounds src into dst unless dst is NULL or an allocation failed */
static void store(const temps *t, tr_bf16 *dst, const float *src, int64_t n) {
  if (dst && !t->failed) tr_bf16_round(dst, src, n);
}

static void b_to_bf16(tr_bf16 *dst, const float *src, int64_t n) { tr_bf16_round(dst, src, n); }

static void b_embed_forward(tr_bf16 *out, const int32_t *tok, const float *wte, const float *wpe, int B, int T,
                            int C) {
  temps t = {0};
  int64_t n = (int64_t)B * T * C;
  float *o = tmp(&t, n);
  if (!t.failed) embed_forward(o, tok, wte, wpe, B, T, C);
  store(&t, out, o, n);
  done(&t);
}

static void b_embed_backward(float *dwte, float *dwpe, const tr_bf16 *dout, const int32_t *tok, int B, int T,
                             int C) {
  temps t = {0};
  float *d = wide(&t, dout, (int64_t)B * T * C);
  if (!t.failed) embed_backward(dwte, dwpe, d, tok, B, T, C);
  done(&t);
}

static void b_linear_forward(tr_bf16 *out, const tr_bf16 *inp, const tr_bf16 *w16, const float *bias, int N, int C,
                             int OC) {
  temps t = {0};
  float *x = wide(&t, inp, (int64_t)N * C), *w = wide(&t, w16, (int64_t)OC * C), *o = tmp(&t, (int64_t)N * OC);
  if (!t.failed) linear_forward(o, x, w, bias, N, C, OC);
  store(&t, out, o, (int64_t)N * OC);
  done(&t);
}

static void b_linear_backward(tr_bf16 *dinp, float *dw, float *dbias, const tr_bf16 *dout, const tr_bf16 *inp,
                              const tr_bf16 *w16, int N, int C, int OC) {
  temps t = {0};
  float *d = wide(&t, dout, (int64_t)N * OC), *x = wide(&t, inp, (int64_t)N * C),
        *w = wide(&t, w16, (int64_t)OC * C), *di = wide(&t, dinp, (int64_t)N * C);
  if (!t.failed) linear_backward(di, dw, dbias, d, x, w, N, C, OC);
  store(&t, dinp, di, (int64_t)N * C);
  done(&t);
}

static void b_layernorm_forward(tr_bf16 *out, float *mean, float *rstd, const tr_bf16 *inp, const float *w,
                                const float *b, int N, int C) {
  temps t = {0};
  float *x = wide(&t, inp, (int64_t)N * C), *o = tmp(&t, (int64_t)N * C);
  if (!t.failed) layernorm_forward(o, mean, rstd, x, w, b, N, C);
  store(&t, out, o, (int64_t)N * C);
  done(&t);
}

static void b_layernorm_backward(tr_bf16 *dinp, float *dw, float *db, const tr_bf16 *dout, const tr_bf16 *inp,
                                 const float *w, const float *mean, const float *rstd, int N, int C) {
  temps t = {0};
  int64_t n = (int64_t)N * C;
  float *d = wide(&t, dout, n), *x = wide(&t, inp, n), *di = wide(&t, dinp, n);
  if (!t.failed) layernorm_backward(di, dw, db, d, x, w, mean, rstd, N, C);
  store(&t, dinp, di, n);
  done(&t);
}

static void b_gelu_forward(tr_bf16 *out, const tr_bf16 *inp, int64_t n) {
  temps t = {0};
  float *x = wide(&t, inp, n), *o = tmp(&t, n);
  if (!t.failed) gelu_forward(o, x, n);
  store(&t, out, o, n);
  done(&t);
}

static void b_gelu_backward(tr_bf16 *dinp, const tr_bf16 *inp, const tr_bf16 *dout, int64_t n) {
  temps t = {0};
  float *x = wide(&t, inp, n), *d = wide(&t, dout, n), *di = wide(&t, dinp, n);
  if (!t.failed && di) gelu_backward(di, x, d, n);
  store(&t, dinp, di, n);
  done(&t);
}

static void b_add_forward(tr_bf16 *out, const tr_bf16 *a, const tr_bf16 *b, int64_t n) {
  temps t = {0};
  float *x = wide(&t, a, n), *y = wide(&t, b, n), *o = tmp(&t, n);
  if (!t.failed) add_forward(o, x, y, n);
  store(&t, out, o, n);
  done(&t);
}

/* da and db may be the same buffer (add(x, x)): it is widened once and gets
 * dout twice, as the fp32 kernel does, and is rounded once. */
static void b_add_backward(tr_bf16 *da, tr_bf16 *db, const tr_bf16 *dout, int64_t n) {
  temps t = {0};
  float *d = wide(&t, dout, n), *x = wide(&t, da, n), *y = db == da ? x : wide(&t, db, n);
  if (!t.failed) add_backward(x, y, d, n);
  store(&t, da, x, n);
  if (db != da) store(&t, db, y, n);
  done(&t);
}

static void b_attention_forward(tr_bf16 *out, tr_bf16 *att, const tr_bf16 *qkv, int B, int T, int C, int NH) {
  temps t = {0};
  int64_t natt = (int64_t)B * NH * T * T;
  float *q = wide(&t, qkv, (int64_t)B * T * 3 * C), *o = tmp(&t, (int64_t)B * T * C), *a = tmp(&t, natt);
  if (!t.failed) attention_forward(o, a, q, B, T, C, NH);
  store(&t, out, o, (int64_t)B * T * C);
  store(&t, att, a, natt);
  done(&t);
}

static void b_attention_backward(tr_bf16 *dqkv, tr_bf16 *scratch, const tr_bf16 *dout, const tr_bf16 *qkv,
                                 const tr_bf16 *att, int B, int T, int C, int NH) {
  (void)scratch; /* the fp32 kernel's scratch is an fp32 temporary here */
  temps t = {0};
  int64_t natt = (int64_t)B * NH * T * T;
  float *d = wide(&t, dout, (int64_t)B * T * C), *q = wide(&t, qkv, (int64_t)B * T * 3 * C),
        *a = wide(&t, att, natt), *dq = wide(&t, dqkv, (int64_t)B * T * 3 * C), *s = tmp(&t, natt);
  if (!t.failed && dq) attention_backward(dq, s, d, q, a, B, T, C, NH);
  store(&t, dqkv, dq, (int64_t)B * T * 3 * C);
  done(&t);
}

static void b_crossentropy_forward(float *loss, tr_bf16 *probs, const tr_bf16 *logits, const int32_t *targets, int N,
                                   int V) {
  temps t = {0};
  int64_t n = (int64_t)N * V;
  float *l = wide(&t, logits, n), *p = tmp(&t, n);
  if (!t.failed) loss[0] = crossentropy_forward(p, l, targets, N, V);
  store(&t, probs, p, n);
  done(&t);
}

static void b_crossentropy_backward(tr_bf16 *dlogits, const tr_bf16 *probs, const int32_t *targets,
                                    const float *dloss, int N, int V) {
  temps t = {0};
  int64_t n = (int64_t)N * V;
  float *p = wide(&t, probs, n), *dl = wide(&t, dlogits, n);
  if (!t.failed && dl) crossentropy_backward(dl, p, targets, dloss[0], N, V);
  store(&t, dlogits, dl, n);
  done(&t);
}

const tr_bf16_ops kernels_bf16_ops = {
    .to_bf16 = b_to_bf16,
#define TR_OP(ID, NAME, K, ...) .K##_forward = b_##K##_forward, .K##_backward = b_##K##_backward,
#include "ops.def"
};
