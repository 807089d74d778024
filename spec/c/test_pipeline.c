/* test_pipeline.c — the pipeline's pure parts: the cut search and the
 * crossings of graph_stage.c on a small residual network, and AdaTopK
 * (core/fleet/adatopk.c): exactly the k largest kept, bf16 values, the
 * error feedback that loses nothing over rounds, the density controller.
 * White-box: adatopk.h is core/fleet's private header. Milliseconds.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <sys/socket.h>
#include <unistd.h>

#include "adatopk.h"
#include "check.h"
#include "graph.h"
#include "graph_stage.h"
#include "job.h"
#include "pipeline_link.h"
#include "pipeline_plan.h"
#include "pipeline_probe.h"
#include "rng.h"
#include "util.h"

/* x -> [linear -> gelu -> add x] x L -> linear: a residual chain whose
 * block boundaries carry one (B,C) tensor and whose insides carry two. */
static graph *residual_net(int L, int C) {
  graph *g = graph_create();
  int64_t d[2] = {8, C}, wd[2] = {C, C};
  int x = graph_input(g, "x", 2, d, DT_F32);
  char name[32];
  for (int l = 0; l < L; l++) {
    snprintf(name, sizeof name, "w%d", l);
    int w = graph_param(g, name, 2, wd, INIT_NORMAL, 0.1f, -1);
    x = graph_add(g, x, graph_gelu(g, graph_linear(g, x, w, -1)));
  }
  int64_t hd[2] = {4, C};
  int head = graph_param(g, "head", 2, hd, INIT_NORMAL, 0.1f, -1);
  graph_output(g, "out", graph_linear(g, x, head, -1));
  graph_plan(g, 1);
  return g;
}

static void test_cuts(void) {
  const int L = 4, C = 16;
  graph *g = residual_net(L, C);
  int n = graph_norder(g); /* 3 per block + head */
  CHECK(n == 3 * L + 1, "%d ops", n);
  int64_t bytes;
  int ids[8];
  CHECK(graph_stage_crossing(g, 3, ids, 8, &bytes) == 1 && bytes == 4 * 8 * C, "a block boundary carries x only: %lld",
        (long long)bytes);
  CHECK(graph_stage_crossing(g, 1, ids, 8, &bytes) == 1, "the first block's x is an input: every stage has it");
  CHECK(graph_stage_crossing(g, 4, ids, 8, &bytes) == 2, "inside a block: x and the linear's output");
  int cuts[3];
  double cost;
  CHECK(graph_stage_cut(g, 2, NULL, NULL, cuts, &cost) == 0 && cuts[0] == 0 && cuts[2] == n, "two stages");
  /* equal speeds: the four blocks split 2 + 2 (the head is small) at a boundary */
  CHECK(cuts[1] == 6, "cut at %d", cuts[1]);
  /* the first worker 3x faster: it takes 3 of the 4 blocks */
  double speed[2] = {3.0, 1.0};
  CHECK(graph_stage_cut(g, 2, speed, NULL, cuts, &cost) == 0 && cuts[1] == 9, "fast first: cut at %d", cuts[1]);
  /* a slow link: the least bytes win among cuts that cost the same compute */
  double bw[1] = {1.0};
  CHECK(graph_stage_cut(g, 2, NULL, bw, cuts, &cost) == 0 && cuts[1] % 3 == 0, "slow link: a boundary, %d", cuts[1]);
  CHECK(graph_stage_cut(g, n + 1, NULL, NULL, cuts, NULL) < 0, "more stages than ops is an error");
  graph_free(g);
}

static void test_topk(void) {
  enum { N = 1000 };
  float x[N], y[N], scratch[N];
  unsigned char enc[ADATOPK_HEADER + 6 * N];
  rng_t r;
  rng_seed(&r, 7);
  for (int i = 0; i < N; i++) x[i] = rng_normal(&r);
  int64_t k = 50;
  size_t b = adatopk_encode(x, NULL, N, k, scratch, enc);
  CHECK(b == adatopk_bytes(k), "%zu bytes", b);
  CHECK(adatopk_decode(enc, b, y, N) == 0, "decode: %s", tr_error());
  /* the kept ones are exactly those at or above the k-th magnitude */
  float a[N];
  for (int i = 0; i < N; i++) a[i] = fabsf(x[i]);
  int kept = 0, wrong = 0;
  float kth = 0;
  for (int i = 0; i < N; i++) { /* the k-th largest, slowly */
    int above = 0;
    for (int j = 0; j < N; j++) above += a[j] > a[i];
    if (above == k - 1) kth = a[i];
  }
  for (int i = 0; i < N; i++) {
    if (y[i] != 0) {
      kept++;
      wrong += a[i] < kth || fabsf(y[i] - x[i]) > fabsf(x[i]) / 256; /* bf16: 8 bits of mantissa */
    }
  }
  CHECK(kept == k && wrong == 0, "kept %d (want %lld), %d wrong", kept, (long long)k, wrong);
  CHECK(adatopk_decode(enc, b - 1, y, N) < 0, "a short message is an error");
  CHECK(adatopk_decode(enc, b, y, N + 1) < 0, "a message of another size is an error");
}

/* Error feedback: sending the same gradient R times at 5% density, the
 * receiver's sum approaches R * x: what was held back is sent later. */
static void test_feedback(void) {
  enum { N = 400, R = 200 };
  float x[N], y[N], res[N] = {0}, sum[N] = {0}, scratch[N];
  unsigned char enc[ADATOPK_HEADER + 6 * N];
  rng_t r;
  rng_seed(&r, 11);
  for (int i = 0; i < N; i++) x[i] = rng_normal(&r);
  for (int t = 0; t < R; t++) {
    size_t b = adatopk_encode(x, res, N, N / 20, scratch, enc);
    adatopk_decode(enc, b, y, N);
    for (int i = 0; i < N; i++) sum[i] += y[i];
  }
  double err = 0, norm = 0, lost = 0;
  for (int i = 0; i < N; i++) {
    err += fabs(sum[i] + res[i] - R * (double)x[i]); /* nothing lost: sent + held back = all */
    lost += fabs(sum[i] - R * (double)x[i]);
    norm += fabs(R * (double)x[i]);
  }
  CHECK(err / norm < 1e-4, "sent + residual = all, relative error %g", err / norm);
  CHECK(lost / norm < 0.1, "after %d rounds the receiver has all but %.3f of it", R, lost / norm);
}

static void test_controller(void) {
  int64_t n = 1 << 16;
  CHECK(adatopk_density(0, 0.01, n, 0.01) == 1.0, "unknown bandwidth: keep all");
  double fast = adatopk_density(1e9, 0.01, n, 0.01), slow = adatopk_density(1e6, 0.01, n, 0.01);
  CHECK(fast == 1.0, "a fast link keeps all: %g", fast);
  CHECK(slow < fast && slow >= 0.01, "a slow link keeps less: %g", slow);
  CHECK(adatopk_density(1e3, 0.01, n, 0.05) == 0.05, "never below the floor");
  /* the budget: half the compute, at the bandwidth */
  double d = adatopk_density(1.25e6, 0.1, n, 0.001);
  CHECK(fabs(d - (1.25e6 * 0.05 - ADATOPK_HEADER) / (6.0 * n)) < 1e-12, "density %g", d);
}

/* --- the probe server (pipeline_probe.c) --- */

/* A listening socket on loopback: the fd, its port in *port. */
static int listen_loopback(int *port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, 16) ||
      getsockname(fd, (struct sockaddr *)&a, &len))
    return -1;
  *port = ntohs(a.sin_port);
  return fd;
}

/* Connects to the probe server as worker `value` says (HELLO), pings:
 * 1 the server answered (PONG; then DONE), 0 it closed the connection. */
static int hello_then_ping(int port, double value) {
  int fd = pl_connect("127.0.0.1", port, 5);
  pl_link *l = fd >= 0 ? pl_link_create(fd, "the probe server") : NULL;
  if (!l) return -1;
  pl_header hello = {.kind = PL_HELLO, .value = value}, ping = {.kind = PL_PING}, done = {.kind = PL_DONE}, h;
  void *p = NULL;
  int answered = !pl_send(l, &hello, NULL) && !pl_send(l, &ping, NULL) && !pl_recv(l, PL_PONG, 0, -1, 5, &h, &p);
  free(p);
  if (answered) pl_send(l, &done, NULL);
  pl_link_free(l);
  return answered;
}

/* Worker 2's server answers workers 0 and 1, once each; a HELLO naming
 * anything else (its value indexes the plan's zones) is a connection
 * closed, and the server still serves the real ones. */
static void test_probe_hello(void) {
  job_config cfg;
  memset(&cfg, 0, sizeof cfg);
  static pipe_plan plan;
  plan.S = 3;
  for (int i = 0; i < 3; i++) snprintf(plan.zone[i], PIPE_ZONE_MAX, "local");
  int port = 0, lfd = listen_loopback(&port);
  CHECK(lfd >= 0, "listen");
  pipe_probe_ctx c = {.cfg = &cfg, .plan = &plan, .w = 2, .lfd = lfd, .timeout = 5};
  pipe_probe_server *sv = pipe_probe_serve(&c);
  CHECK(sv != NULL, "serve: %s", tr_error());
  const double bad[] = {5, 2, -1, 0.5, 1e9, NAN, INFINITY};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    CHECK(hello_then_ping(port, bad[i]) == 0, "a HELLO from worker %g is closed, not served", bad[i]);
  CHECK(hello_then_ping(port, 1) == 1, "worker 1 is served");
  CHECK(hello_then_ping(port, 1) == 0, "worker 1 again is closed");
  CHECK(hello_then_ping(port, 0) == 1, "worker 0 is served");
  CHECK(pipe_probe_serve_join(sv) == 0, "the server ends once both are served: %s", tr_error());
  close(lfd);
}

int main(void) {
  test_cuts();
  test_topk();
  test_feedback();
  test_controller();
  test_probe_hello();
  return check_report("test_pipeline");
}
