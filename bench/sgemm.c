/* sgemm.c — OpenBLAS cblas_sgemm GFLOP/s for the shapes of transom's GPT step.
 *
 *   gcc -O2 bench/sgemm.c -o sgemm $(pkg-config --cflags --libs openblas)
 *   ./sgemm [threads] [batch*block] [n_embd] [vocab] [n_layer]
 *
 * Defaults: all cores, 768 (12*64), 128, 65, 4 — examples/shakespeare.lua.
 * Each shape runs in timed chunks of about 20 ms (enough calls to fill them),
 * 7 chunks, and the best chunk counts. Row-major, as y = x W^T (forward,
 * NoTrans/Trans), dx = dy W (NoTrans/NoTrans), dW = dy^T x (Trans/NoTrans).
 *
 * Machine-readable lines:
 *   sgemm_768x512x128_gflop_s=  M=768 N=512 K=128 (the MLP up-projection)
 *   sgemm_1024_gflop_s=         square 1024
 *   sgemm_step_mix_gflop_s=     the step's Linear matmuls (forward, dx, dW of
 *                               every layer and the tied head), each weighted
 *                               by how often it runs: total FLOPs / total best time
 */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct {
  const char *what;
  int m, n, k, ta, tb, count;
} shape;

static float *buf(size_t n) {
  float *p = aligned_alloc(64, ((n * sizeof(float)) + 63) / 64 * 64);
  if (!p) {
    fprintf(stderr, "sgemm: out of memory\n");
    exit(1);
  }
  for (size_t i = 0; i < n; i++) p[i] = (float)((i * 2654435761u) % 1000) * 1e-3f - 0.5f;
  return p;
}

/* Best seconds per call over 7 chunks of ~20 ms. */
static double best_time(const shape *s) {
  float *a = buf((size_t)s->m * s->k), *b = buf((size_t)s->k * s->n), *c = buf((size_t)s->m * s->n);
  int lda = s->ta ? s->m : s->k, ldb = s->tb ? s->k : s->n;
  enum CBLAS_TRANSPOSE ta = s->ta ? CblasTrans : CblasNoTrans, tb = s->tb ? CblasTrans : CblasNoTrans;
#define CALL() cblas_sgemm(CblasRowMajor, ta, tb, s->m, s->n, s->k, 1.0f, a, lda, b, ldb, 0.0f, c, s->n)
  for (int i = 0; i < 3; i++) CALL(); /* warm-up: threads, caches */
  int reps = 1;
  for (;;) {
    double t0 = now();
    for (int i = 0; i < reps; i++) CALL();
    double dt = now() - t0;
    if (dt > 0.02 || reps > (1 << 20)) break;
    reps *= 2;
  }
  double best = 1e30;
  for (int r = 0; r < 7; r++) {
    double t0 = now();
    for (int i = 0; i < reps; i++) CALL();
    double dt = (now() - t0) / reps;
    if (dt < best) best = dt;
  }
#undef CALL
  free(a);
  free(b);
  free(c);
  return best;
}

int main(int argc, char **argv) {
  int threads = argc > 1 ? atoi(argv[1]) : 0;
  int M = argc > 2 ? atoi(argv[2]) : 768, C = argc > 3 ? atoi(argv[3]) : 128;
  int V = argc > 4 ? atoi(argv[4]) : 65, L = argc > 5 ? atoi(argv[5]) : 4;
  if (threads > 0) openblas_set_num_threads(threads);
  printf("sgemm: OpenBLAS %s| %d threads\n", openblas_get_config(), openblas_get_num_threads());
  shape step[] = {
      {"attn.c_attn fwd", M, 3 * C, C, 0, 1, L}, {"attn.c_attn dx", M, C, 3 * C, 0, 0, L},
      {"attn.c_attn dW", 3 * C, C, M, 1, 0, L},  {"attn.c_proj fwd", M, C, C, 0, 1, L},
      {"attn.c_proj dx", M, C, C, 0, 0, L},      {"attn.c_proj dW", C, C, M, 1, 0, L},
      {"mlp.c_fc fwd", M, 4 * C, C, 0, 1, L},    {"mlp.c_fc dx", M, C, 4 * C, 0, 0, L},
      {"mlp.c_fc dW", 4 * C, C, M, 1, 0, L},     {"mlp.c_proj fwd", M, C, 4 * C, 0, 1, L},
      {"mlp.c_proj dx", M, 4 * C, C, 0, 0, L},   {"mlp.c_proj dW", C, 4 * C, M, 1, 0, L},
      {"head fwd", M, V, C, 0, 1, 1},            {"head dx", M, C, V, 0, 0, 1},
      {"head dW", V, C, M, 1, 0, 1},
  };
  double flops = 0, secs = 0;
  for (size_t i = 0; i < sizeof step / sizeof step[0]; i++) {
    const shape *s = &step[i];
    double t = best_time(s), f = 2.0 * s->m * s->n * s->k;
    printf("  %-16s M=%-5d N=%-5d K=%-5d %s%s  %7.2f GFLOP/s\n", s->what, s->m, s->n, s->k, s->ta ? "T" : "N",
           s->tb ? "T" : "N", f / t * 1e-9);
    flops += f * s->count;
    secs += t * s->count;
  }
  shape up = {"768x512x128", M, 4 * C, C, 0, 1, 1}, sq = {"1024^3", 1024, 1024, 1024, 0, 0, 1};
  double tu = best_time(&up), ts = best_time(&sq);
  printf("  %-16s M=%-5d N=%-5d K=%-5d NT  %7.2f GFLOP/s\n", "MLP up (brief)", up.m, up.n, up.k,
         2.0 * up.m * up.n * up.k / tu * 1e-9);
  printf("  %-16s M=%-5d N=%-5d K=%-5d NN  %7.2f GFLOP/s\n", "square", sq.m, sq.n, sq.k,
         2.0 * sq.m * sq.n * sq.k / ts * 1e-9);
  printf("sgemm_%dx%dx%d_gflop_s=%.3f\n", up.m, up.n, up.k, 2.0 * up.m * up.n * up.k / tu * 1e-9);
  printf("sgemm_1024_gflop_s=%.3f\n", 2.0 * 1024.0 * 1024.0 * 1024.0 / ts * 1e-9);
  printf("sgemm_step_mix_gflop_s=%.3f\n", flops / secs * 1e-9);
  printf("sgemm_step_mix_ms=%.3f\n", secs * 1e3);
  return 0;
}
