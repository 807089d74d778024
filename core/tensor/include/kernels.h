/* kernels.h — CPU forward and backward kernels for every op of the graph
 * (the ops are listed in ops.def; the cpu backend's table points at these).
 *
 * Legend: B = batch, T = time (sequence), C = channels, OC = output channels,
 * V = vocabulary, NH = heads, N = B*T rows. All tensors are row-major float32
 * (token ids int32).
 *
 * Accumulation rule: every backward kernel ADDS into its gradient outputs
 * (parameter and activation gradients alike, `+=`). An activation can feed
 * several ops (the residual stream does), so the executor zeroes the
 * activation-gradient arena before a backward pass and the optimizer zeroes
 * parameter gradients after a step. A NULL gradient output means "not
 * needed" (graph inputs have no gradient) and is skipped.
 *
 * Threads: the non-GEMM loops are OpenMP loops; GEMMs go to OpenBLAS. Both use
 * kernels_set_threads(). Results are deterministic for a fixed thread count.
 * Called through the cpu backend's table (backend.c), by the host bf16 ops
 * (kernels_bf16.c) and by the tests.
 */
#ifndef TRANSOM_KERNELS_H
#define TRANSOM_KERNELS_H

#include <stdint.h>

void kernels_set_threads(int n);
int kernels_threads(void);

/* p[0..n) = 0, in parallel. */
void par_zero(float *p, int64_t n);
/* sum of squares of p[0..n) in double, in parallel; deterministic for a
 * fixed thread count (fixed blocks, summed in block order). */
double par_sumsq(const float *p, int64_t n);
/* p[0..n) *= s, in parallel. */
void par_scale(float *p, int64_t n, float s);

/* out (B,T,C) = wte[tok[b,t]] + wpe[t]; wpe may be NULL (no position table). */
void embed_forward(float *out, const int32_t *tok, const float *wte, const float *wpe, int B, int T, int C);
void embed_backward(float *dwte, float *dwpe, const float *dout, const int32_t *tok, int B, int T, int C);

/* out (N,OC) = inp (N,C) @ w^T + bias; w is (OC,C); bias (OC) may be NULL. */
void linear_forward(float *out, const float *inp, const float *w, const float *bias, int N, int C, int OC);
/* dinp (N,C), dw (OC,C), dbias (OC) += ...; any output may be NULL to skip it. */
void linear_backward(float *dinp, float *dw, float *dbias, const float *dout, const float *inp, const float *w,
                     int N, int C, int OC);

/* out (N,C) = (inp - mean) * rstd * w + b; mean, rstd (N) saved for backward. */
void layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *w, const float *b,
                       int N, int C);
void layernorm_backward(float *dinp, float *dw, float *db, const float *dout, const float *inp, const float *w,
                        const float *mean, const float *rstd, int N, int C);

/* GELU, tanh approximation, elementwise over n values. */
void gelu_forward(float *out, const float *inp, int64_t n);
void gelu_backward(float *dinp, const float *inp, const float *dout, int64_t n);

/* out = a + b elementwise over n values. */
void add_forward(float *out, const float *a, const float *b, int64_t n);
void add_backward(float *da, float *db, const float *dout, int64_t n);

/* Causal multi-head self-attention.
 * qkv (B,T,3C) holds q, k, v side by side; out (B,T,C); att (B,NH,T,T) keeps
 * the softmax probabilities for backward; scratch (B,NH,T,T) is backward-only. */
void attention_forward(float *out, float *att, const float *qkv, int B, int T, int C, int NH);
void attention_backward(float *dqkv, float *scratch, const float *dout, const float *qkv, const float *att,
                        int B, int T, int C, int NH);

/* Fused softmax + cross-entropy, mean over the N rows.
 * logits (N,V), targets (N); probs (N,V) saved for backward. Returns the loss.
 * A target outside [0,V) is an input error: its row counts a loss of NaN. */
float crossentropy_forward(float *probs, const float *logits, const int32_t *targets, int N, int V);
/* dlogits (N,V) += dloss * (probs - onehot(targets)) / N */
void crossentropy_backward(float *dlogits, const float *probs, const int32_t *targets, float dloss, int N, int V);

/* --- bf16 activations (kernels_bf16.c): conversions, and the host
 * implementation of backend.h's tr_bf16_ops (widen to fp32, run the kernels
 * above, round what is stored) --- */
float tr_bf16_to_f32(uint16_t h);
uint16_t tr_f32_to_bf16(float f); /* round to nearest even; NaN stays NaN */
void tr_bf16_widen(float *dst, const uint16_t *src, int64_t n);
void tr_bf16_round(uint16_t *dst, const float *src, int64_t n);
struct tr_bf16_ops;
extern const struct tr_bf16_ops kernels_bf16_ops;

#endif
