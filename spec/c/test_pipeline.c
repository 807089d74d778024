/* test_pipeline.c — the pipeline's pure parts: the cut search and the
 * crossings of graph_stage.c on a small residual network, and AdaTopK
 * (core/fleet/adatopk.c): exactly the k largest kept, bf16 values, the
 * error feedback that loses nothing over rounds, NaN and Inf never chosen
 * nor kept back (a skipped step clears the feedback), the density
 * controller; the probe server's HELLO check and its short wait for a
 * HELLO (a silent connection is closed, the next one served); a placement
 * policy's answer (read raw, range-checked) and RUN/pipeline-plan on
 * --resume (checked); a link's reader against a hostile peer (a message
 * too large, a flood of small messages or of large ones, a sent_at far
 * ahead or not finite), an unknown codec, and every receiver refusing a
 * codec it does not expect (naming the link); a resume whose stage store
 * was never committed to (its worker killed inside ckpt_open) starts over,
 * and two set-asides of the stores within one second both succeed.
 * White-box: core/fleet's
 * private headers. A few seconds (the probe server's HELLO wait is one).
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <signal.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <lmdb.h>

#include "adatopk.h"
#include "ckpt.h"
#include "check.h"
#include "graph.h"
#include "graph_stage.h"
#include "job.h"
#include "lua_host.h"
#include "pipeline_ckpt.h"
#include "pipeline_link.h"
#include "pipeline_plan.h"
#include "pipeline_probe.h"
#include "pipeline_stage.h"
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

/* --- AdaTopK and non-finite values --- */

static uint32_t enc_k(const unsigned char *enc) {
  uint32_t h[4];
  memcpy(h, enc, sizeof h);
  return h[2];
}

static int all_finite(const float *x, int n) {
  for (int i = 0; i < n; i++)
    if (!isfinite(x[i])) return 0;
  return 1;
}

/* Top-k chooses among the finite entries only and sends exactly the pairs
 * it wrote (a reused buffer's old bytes never go out as entries). */
static void test_topk_nonfinite(void) {
  enum { N = 8 };
  float scratch[N], y[N];
  unsigned char enc[ADATOPK_HEADER + 6 * 16];
  float x[N] = {1, NAN, 3, 4, 5, 6, 7, 8};
  memset(enc, 0xAB, sizeof enc);
  size_t b = adatopk_encode(x, NULL, N, 3, scratch, enc);
  CHECK(b == adatopk_bytes(3) && enc_k(enc) == 3, "%zu bytes, k = %u", b, enc_k(enc));
  CHECK(adatopk_decode(enc, b, y, N) == 0 && y[7] == 8 && y[6] == 7 && y[5] == 6 && y[1] == 0,
        "the 3 largest finite: %s", tr_error());
  float none[4] = {NAN, INFINITY, -INFINITY, NAN};
  memset(enc, 0xAB, sizeof enc);
  b = adatopk_encode(none, NULL, 4, 2, scratch, enc);
  CHECK(b == adatopk_bytes(0) && enc_k(enc) == 0, "nothing finite: no entry (%zu bytes, k = %u)", b, enc_k(enc));
  CHECK(adatopk_decode(enc, b, y, 4) == 0 && y[0] == 0 && y[3] == 0, "decodes to zeros: %s", tr_error());
  /* random mixes: header k = the pairs written, every index in range and
   * once, every value finite */
  rng_t r;
  rng_seed(&r, 3);
  int bad = 0;
  for (int it = 0; it < 20000 && bad < 3; it++) {
    int n = 1 + (int)rng_below(&r, 12), k = 1 + (int)rng_below(&r, (uint64_t)n), finite = 0;
    float v[16], out[16], sc[16];
    for (int i = 0; i < n; i++) {
      uint64_t c = rng_below(&r, 7);
      v[i] = c == 0 ? NAN : c == 1 ? INFINITY : c == 2 ? -INFINITY : (float)rng_below(&r, 5) - 2;
      finite += isfinite(v[i]) != 0;
    }
    memset(enc, 0xAB, sizeof enc);
    b = adatopk_encode(v, NULL, n, k, sc, enc);
    uint32_t m = enc_k(enc), idx[16];
    int ok = m == (uint32_t)(k < finite ? k : finite) && b == adatopk_bytes(m) && adatopk_decode(enc, b, out, n) == 0;
    memcpy(idx, enc + ADATOPK_HEADER, 4 * m);
    for (uint32_t j = 0; ok && j < m; j++) ok = idx[j] < (uint32_t)n && isfinite(v[idx[j]]) && isfinite(out[idx[j]]);
    if (!ok) bad++, fprintf(stderr, "  n=%d k=%d finite=%d: header k=%u, %zu bytes\n", n, k, finite, m, b);
  }
  CHECK(bad == 0, "%d encodings with non-finite entries were wrong", bad);
}

/* Error feedback never keeps a NaN or Inf: one bad gradient does not spoil
 * every later message (bf16: Inf - Inf was NaN for good). */
static void test_feedback_nonfinite(void) {
  enum { N = 8 };
  float res[N] = {0}, y[N], scratch[N];
  unsigned char enc[ADATOPK_HEADER + 6 * N];
  float bad[N] = {1, 2, INFINITY, 4, NAN, 6, 7, 8}, good[N] = {1, 2, 3, 4, 5, 6, 7, 8};
  adatopk_encode_bf16(bad, res, N, enc);
  CHECK(all_finite(res, N), "bf16: the residual after an Inf and a NaN stays finite");
  for (int t = 0; t < 3; t++) {
    size_t b = adatopk_encode_bf16(good, res, N, enc);
    CHECK(adatopk_decode_any(ADATOPK_BF16, enc, b, y, N) == 0 && all_finite(y, N) && fabsf(y[2] - 3) < 0.05f,
          "bf16: message %d after it is finite (y[2] = %g)", t, y[2]);
  }
  memset(res, 0, sizeof res);
  adatopk_encode(bad, res, N, 2, scratch, enc);
  CHECK(all_finite(res, N), "top-k: the residual after an Inf and a NaN stays finite");
  size_t b = adatopk_encode(good, res, N, 8, scratch, enc);
  CHECK(adatopk_decode(enc, b, y, N) == 0 && all_finite(y, N), "top-k: the next message is finite");
  /* a finite value beyond bf16's range goes as the largest bf16, not Inf */
  float big[2] = {3.4e38f, -3.4e38f}, r2[2] = {0};
  b = adatopk_encode_bf16(big, r2, 2, enc);
  CHECK(adatopk_decode_any(ADATOPK_BF16, enc, b, y, 2) == 0 && all_finite(y, 2) && all_finite(r2, 2),
        "bf16 of 3.4e38: %g, residual %g", y[0], r2[0]);
}

/* A step whose global norm is not finite (every stage skips it) also
 * clears the error feedback of the gradients this stage sends back. */
static void test_nonfinite_step(void) {
  graph *g = residual_net(2, 8);
  pipe_stage s;
  memset(&s, 0, sizeof s);
  s.g = g;
  s.S = 2;
  s.k = 1;
  s.M = s.b = s.T = s.R = 1;
  s.bwd.on = 1;
  s.donor_fd = -1;
  CHECK(pipe_stage_setup(&s) == 0 && s.bwd.residual && s.xin_n > 0, "setup: %s", tr_error());
  if (s.bwd.residual) {
    for (int64_t i = 0; i < s.xin_n; i++) s.bwd.residual[i] = 1.0f;
    for (int64_t i = 0; i < graph_nparams(g); i++) graph_grads(g)[i] = NAN;
    loop_exchange x;
    memset(&x, 0, sizeof x);
    CHECK(pipe_exchange(&s, 1, &x) == 0 && !isfinite(s.global_norm), "a NaN step: norm %g (%s)", s.global_norm,
          tr_error());
    int64_t left = 0;
    for (int64_t i = 0; i < s.xin_n; i++) left += s.bwd.residual[i] != 0;
    CHECK(left == 0, "%lld of %lld residual entries kept after a skipped step", (long long)left, (long long)s.xin_n);
  }
  pipe_stage_free(&s);
  graph_free(g);
}

/* --- a placement policy's answer (pipeline_policy.c) --- */

/* Runs the policy `text` on g for 2 stages: 0 with p's cuts and order
 * from it, or the error. */
static int run_policy(lua_State *L, graph *g, const char *text, pipe_plan *p) {
  char path[] = "/tmp/test_pipeline_policy_XXXXXX.lua";
  int fd = mkstemps(path, 4);
  if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text)) return tr_fail(TR_EIO, "a policy file");
  close(fd);
  memset(p, 0, sizeof *p);
  p->S = 2;
  p->M = 2;
  for (int i = 0; i < 2; i++) {
    p->speed[i] = 1;
    p->flops_s[i] = 1e9;
    p->order[i] = i;
    snprintf(p->zone[i], PIPE_ZONE_MAX, "local");
  }
  int rc = graph_stage_cut(g, 2, NULL, NULL, p->cuts, NULL);
  if (!rc) rc = pipe_policy_plan(L, g, path, p);
  unlink(path);
  return rc;
}

/* The answer is read raw: one that is the sandbox itself (its __index
 * raises on an undefined name) is a bad answer naming the file, not a Lua
 * panic that aborts the process. */
static void test_policy_answer(void) {
  graph *g = residual_net(2, 8);
  lua_State *L = lua_host_new();
  pipe_plan p;
  int n = graph_norder(g), rc = run_policy(L, g, "return function(plan) return plan.proposal end", &p);
  CHECK(rc == 0 && p.cuts[0] == 0 && p.cuts[2] == n, "the proposal back: %s", tr_error());
  rc = run_policy(L, g, "return function(plan) return _ENV end", &p);
  CHECK(rc < 0 && strstr(tr_error(), "test_pipeline_policy_") && strstr(tr_error(), "'cuts'"), "_ENV: %s",
        tr_error());
  rc = run_policy(L, g, "return function(plan) return {cuts = _ENV, order = {0, 1}} end", &p);
  CHECK(rc < 0 && strstr(tr_error(), "'cuts'"), "cuts = _ENV: %s", tr_error());
  /* integers are range-checked before they are narrowed to int */
  rc = run_policy(L, g, "return function(plan) return {cuts = {0, 4294967296 + 3, #plan.ops}, order = {0, 1}} end",
                  &p);
  CHECK(rc < 0 && strstr(tr_error(), "cuts[2] = 4294967299"), "a cut of 2^32 + 3: rc %d, %s", rc, tr_error());
  rc = run_policy(L, g, "return function(plan) return {cuts = plan.proposal.cuts, order = {4294967297, 4294967296}} end",
                  &p);
  CHECK(rc < 0 && strstr(tr_error(), "order[1] = 4294967297"), "workers 2^32 + 1, 2^32: rc %d, %s", rc, tr_error());
  rc = run_policy(L, g, "return function(plan) return {cuts = plan.proposal.cuts, order = {-1, 0}} end", &p);
  CHECK(rc < 0 && strstr(tr_error(), "test_pipeline_policy_"), "worker -1: %s", tr_error());
  CHECK(lua_gettop(L) == 0, "the stack as it was: %d", lua_gettop(L));
  lua_host_close(L);
  graph_free(g);
}

/* --- RUN/pipeline-plan on --resume (pipeline_ckpt.c) --- */

/* Restores a pipeline-plan file of `text` for 2 stages and 7 ops. */
static int restore_plan(const char *dir, const char *text, pipe_plan *p) {
  char path[256];
  snprintf(path, sizeof path, "%s/pipeline-plan", dir);
  if (tr_write_file_atomic(path, text, strlen(text))) return -100;
  memset(p, 0, sizeof *p);
  p->S = 2;
  p->cuts[1] = 99; /* untouched on an error */
  int found = 0, rc = pipe_plan_restore(dir, p, 7, &found);
  return found ? rc : -101;
}

/* The saved plan is checked as a policy's answer is: an order that is no
 * permutation (the launcher sent the plan to fd 0, past its tables, or to
 * one worker twice and hung), cuts that do not cover the ops, numbers
 * past int, a stage missing or twice: errors naming the file. */
static void test_plan_restore(void) {
  char dir[] = "/tmp/test_pipeline_plan_XXXXXX";
  CHECK(mkdtemp(dir) != NULL, "mkdtemp");
  pipe_plan p;
  int rc = restore_plan(dir, "PLAN stage=0 cuts=0,3,7 order=1,0\nPLAN stage=1 cuts=0,3,7 order=1,0\n", &p);
  CHECK(rc == 0 && p.cuts[1] == 3 && p.order[0] == 1 && p.order[1] == 0, "a good plan: %s", tr_error());
  const char *bad[] = {
      "PLAN stage=0 cuts=0,3,7 order=1,100000000\nPLAN stage=1 cuts=0,3,7 order=1,100000000\n",
      "PLAN stage=0 cuts=0,3,7 order=1,7\nPLAN stage=1 cuts=0,3,7 order=1,7\n",
      "PLAN stage=0 cuts=0,3,7 order=1,1\nPLAN stage=1 cuts=0,3,7 order=1,1\n",
      "PLAN stage=0 cuts=0,5,3 order=0,1\nPLAN stage=1 cuts=0,5,3 order=0,1\n",
      "PLAN stage=0 cuts=0,3,9 order=0,1\nPLAN stage=1 cuts=0,3,9 order=0,1\n",
      "PLAN stage=0 cuts=1,3,7 order=0,1\nPLAN stage=1 cuts=1,3,7 order=0,1\n",
      "PLAN stage=0 cuts=0,4294967299,7 order=0,1\nPLAN stage=1 cuts=0,4294967299,7 order=0,1\n",
      "PLAN stage=0 cuts=0,3,7,9 order=0,1\nPLAN stage=1 cuts=0,3,7,9 order=0,1\n",
      "PLAN stage=0 cuts=0,3,7 order=0,-1\nPLAN stage=1 cuts=0,3,7 order=0,-1\n",
      "PLAN stage=0 cuts=0,3,7 order=0,1\nPLAN stage=0 cuts=0,3,7 order=0,1\n",
      "PLAN stage=0 cuts=0,3,7 order=0,1\nPLAN stage=1 cuts=0,4,7 order=0,1\n",
      "PLAN stage=0 cuts=0,3,7 order=0,1\nPLAN stage=9 cuts=0,3,7 order=0,1\n",
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    rc = restore_plan(dir, bad[i], &p);
    CHECK(rc < 0 && rc > -100 && strstr(tr_error(), "pipeline-plan") && p.cuts[1] == 99,
          "plan %zu: rc %d, %s", i, rc, tr_error());
  }
  /* the widest plan: 64 stages of a model with 100000 ops (a line of 64
   * five- and six-digit cuts and the order is about 600 bytes: the save's
   * buffer of 400 a stage said "plan line too long" from about 100 ops) */
  memset(&p, 0, sizeof p);
  p.S = PIPE_MAX_STAGES;
  for (int k = 0; k <= p.S; k++) p.cuts[k] = k == p.S ? 100000 : k * 1500;
  for (int k = 0; k < p.S; k++) p.order[k] = p.S - 1 - k;
  CHECK(pipe_plan_save(dir, &p) == 0, "64 stages over 100000 ops are saved: %s", tr_error());
  pipe_plan q;
  memset(&q, 0, sizeof q);
  q.S = PIPE_MAX_STAGES;
  int found = 0;
  rc = pipe_plan_restore(dir, &q, 100000, &found);
  CHECK(rc == 0 && found && memcmp(q.cuts, p.cuts, sizeof p.cuts) == 0 && memcmp(q.order, p.order, sizeof p.order) == 0,
        "and restored the same: rc %d %s", rc, tr_error());
  char path[256];
  snprintf(path, sizeof path, "%s/pipeline-plan", dir);
  remove(path);
  rmdir(dir);
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
static int hello_then_ping(int port, double value, double deadline) {
  int fd = pl_connect("127.0.0.1", port, 5);
  pl_link *l = fd >= 0 ? pl_link_create(fd, "the probe server", 1024, 1024) : NULL;
  if (!l) return -1;
  pl_header hello = {.kind = PL_HELLO, .value = value}, ping = {.kind = PL_PING}, done = {.kind = PL_DONE}, h;
  void *p = NULL;
  int answered = !pl_send(l, &hello, NULL) && !pl_send(l, &ping, NULL) && !pl_recv(l, PL_PONG, 0, -1, deadline, &h, &p);
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
    CHECK(hello_then_ping(port, bad[i], 5) == 0, "a HELLO from worker %g is closed, not served", bad[i]);
  CHECK(hello_then_ping(port, 1, 5) == 1, "worker 1 is served");
  CHECK(hello_then_ping(port, 1, 5) == 0, "worker 1 again is closed");
  CHECK(hello_then_ping(port, 0, 5) == 1, "worker 0 is served");
  CHECK(pipe_probe_serve_join(sv) == 0, "the server ends once both are served: %s", tr_error());
  close(lfd);
}

/* A connection that says nothing (any local process can connect) is
 * closed after the short HELLO wait and the server takes the next one: the
 * lower worker queued behind it is probed well within its own wait. It
 * used to hold the server for the whole probe timeout (hang_seconds), so
 * the real worker's probe timed out first. The 30 s of hello_then_ping
 * are a failure deadline only (the HELLO wait here is 1 s, the probe's 60
 * s: a loaded machine may take seconds to schedule the server). */
static void test_probe_silent(void) {
  job_config cfg;
  memset(&cfg, 0, sizeof cfg);
  static pipe_plan plan;
  plan.S = 2;
  for (int i = 0; i < 2; i++) snprintf(plan.zone[i], PIPE_ZONE_MAX, "local");
  int port = 0, lfd = listen_loopback(&port);
  CHECK(lfd >= 0, "listen");
  int silent = pl_connect("127.0.0.1", port, 5); /* first in the backlog: accepted first */
  CHECK(silent >= 0, "the silent connection: %s", tr_error());
  pipe_probe_ctx c = {.cfg = &cfg, .plan = &plan, .w = 1, .lfd = lfd, .timeout = 60, .hello_timeout = 1};
  pipe_probe_server *sv = pipe_probe_serve(&c);
  CHECK(sv != NULL, "serve: %s", tr_error());
  CHECK(hello_then_ping(port, 0, 30) == 1, "worker 0 is served behind a silent connection");
  char b;
  CHECK(recv(silent, &b, 1, MSG_DONTWAIT) == 0, "the silent connection was closed before worker 0 was served");
  CHECK(pipe_probe_serve_join(sv) == 0, "the server ends once worker 0 is served: %s", tr_error());
  close(silent);
  close(lfd);
}

/* --- a link's reader against a hostile peer (pipeline_link.c) --- */

/* One raw header onto fd, as a peer (or anybody) could write it. */
static int raw_header(int fd, uint32_t kind, uint64_t bytes, double sent_at) {
  pl_header h = {.magic = 0x50495045u, .kind = kind, .sent_at = sent_at, .bytes = bytes};
  return send(fd, &h, sizeof h, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)sizeof h ? 0 : -1;
}

/* A header asking for more than the link's largest message closes the
 * link at once (it was a malloc of up to 64 GiB and a wait for it). */
static void test_link_max_message(void) {
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
  pl_link *l = pl_link_create(sv[0], "a hostile peer", 4096, 4096);
  CHECK(raw_header(sv[1], PL_ACT, (uint64_t)1 << 30, tr_now()) == 0, "send");
  pl_header h;
  void *p = NULL;
  double t0 = tr_now();
  int rc = pl_recv(l, PL_ACT, 0, -1, 2.0, &h, &p);
  CHECK(rc < 0 && strstr(tr_error(), "more than the 4096") && tr_now() - t0 < 1.0, "1 GiB asked: %s (%.1f s)",
        tr_error(), tr_now() - t0);
  free(p);
  pl_link_free(l);
  close(sv[1]);
}

/* --- a grace on a link (pl_link_grace, pl_herald) --- */

typedef struct {
  pl_link *l;
  int ms;
} late_send;

/* Sends PL_ACT (step 7) on l after ms. */
static void *send_late(void *arg) {
  late_send *ls = arg;
  struct timespec ts = {ls->ms / 1000, (long)(ls->ms % 1000) * 1000000};
  nanosleep(&ts, NULL);
  pl_header h = {.kind = PL_ACT, .step = 7, .mb = 0};
  (void)pl_send(ls->l, &h, NULL);
  return NULL;
}

/* Whether a 0.2 s wait on `in` gets the PL_ACT that a thread sends on `out`
 * after ms (longer than the wait: only a grace lets it in). */
static int late_arrives(pl_link *out, pl_link *in, int ms) {
  late_send ls = {out, ms};
  pthread_t th;
  if (pthread_create(&th, NULL, send_late, &ls)) return -1;
  pl_header h;
  void *p = NULL;
  int rc = pl_recv(in, PL_ACT, 7, 0, 0.2, &h, &p);
  free(p);
  pthread_join(th, NULL);
  if (rc) { /* the late message is still to be taken: out of the way of the next case */
    p = NULL;
    pl_recv(in, PL_ACT, 7, 0, 5.0, &h, &p);
    free(p);
  }
  return rc == 0;
}

static int link_pair(pl_link **a, pl_link **b) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) return -1;
  *a = pl_link_create(sv[0], "the other end", 4096, 4096);
  *b = pl_link_create(sv[1], "the other end", 4096, 4096);
  return *a && *b ? 0 : -1;
}

/* A grace the peer announced outlasts a wait's own timeout: a message 0.6
 * s late still arrives within a 0.2 s wait. A malformed grace (NaN,
 * negative, zero) or none widens nothing. The notice itself never reaches
 * the stage. */
static void test_link_grace(void) {
  double graces[] = {5.0, NAN, -5.0, 0.0, -1.0 /* none sent */};
  for (int i = 0; i < 5; i++) {
    pl_link *a = NULL, *b = NULL;
    CHECK(link_pair(&a, &b) == 0, "links: %s", tr_error());
    if (graces[i] != -1.0) CHECK(pl_link_grace(a, graces[i]) == 0, "the notice: %s", tr_error());
    int got = late_arrives(a, b, 600);
    CHECK(got == (i == 0), "grace %g: the late message %s", graces[i], got ? "arrived" : "did not arrive");
    pl_link_free(a);
    pl_link_free(b);
  }
}

/* A herald renews its grace while on: a message 2.6 s late (past one 2 s
 * notice) arrives within a 0.2 s wait; and it passes a grace on down a
 * chain, A -> B -> C, from B's link with A to B's link with C, though B
 * itself is not held; once off (and the last notices over: 2 s a hop),
 * nothing. */
static void test_link_herald(void) {
  pl_link *ab = NULL, *ba = NULL, *bc = NULL, *cb = NULL;
  CHECK(link_pair(&ab, &ba) == 0 && link_pair(&bc, &cb) == 0, "links: %s", tr_error());
  pl_herald *ha = pl_herald_start(ab, NULL, 60), *hb = pl_herald_start(ba, bc, 60);
  CHECK(ha && hb, "heralds");
  pl_herald_on(ha);
  CHECK(late_arrives(ab, ba, 2600), "A held: B's wait on A ended at its own timeout");
  CHECK(late_arrives(bc, cb, 2600), "A held: C's wait on B (which waits on A) ended at its own timeout");
  pl_herald_off(ha);
  struct timespec ts = {4, 600 * 1000 * 1000}; /* A's last notice, and B's last one passed on, are over */
  nanosleep(&ts, NULL);
  CHECK(!late_arrives(bc, cb, 600), "nobody held: C's wait on B still widened");
  pl_herald_stop(ha);
  pl_herald_stop(hb);
  pl_link_free(ab);
  pl_link_free(ba);
  pl_link_free(bc);
  pl_link_free(cb);
}

/* A peer that floods the link meets a bounded queue: the reader stops
 * taking from the socket (the peer's sends block), and nothing is lost.
 * The peer sends until the socket takes nothing more in a round of 50 ms
 * (how much that is depends on the host's socket buffer limits; the
 * reader must hold at most its queue and the message in hand). */
static void test_link_queue_bound(void) {
  enum { N = 100000 };
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
  pl_link *l = pl_link_create(sv[0], "a flooding peer", 64, 64);
  int sent = 0, before = -1;
  for (int round = 0; round < 100 && sent != before && sent < N; round++) {
    before = sent;
    while (sent < N && raw_header(sv[1], PL_PING, 0, 0) == 0) sent++;
    struct timespec ts = {0, 50 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  uint64_t out, in;
  pl_link_bytes(l, &out, &in);
  CHECK(sent > PL_QUEUE_DEPTH + 1 && in <= (uint64_t)(PL_QUEUE_DEPTH + 1) * sizeof(pl_header),
        "%d sent until the socket was full, %llu bytes taken in unread (at most %d messages)", sent,
        (unsigned long long)in, PL_QUEUE_DEPTH + 1);
  int got = 0;
  pl_header h;
  void *p = NULL;
  while (got < sent && pl_recv(l, PL_PING, 0, -1, 2.0, &h, &p) == 0) got++, free(p), p = NULL;
  CHECK(got == sent, "all %d arrive as the stage takes them: %d (%s)", sent, got, tr_error());
  pl_link_free(l);
  close(sv[1]);
}

/* A peer sending N messages of `size` bytes each, blocking (a thread). */
typedef struct {
  int fd, n;
  size_t size;
} flood_args;

static void *flood_main(void *arg) {
  flood_args *a = arg;
  char *payload = calloc(1, a->size);
  pl_header h = {.magic = 0x50495045u, .kind = PL_PING, .bytes = a->size};
  for (int i = 0; i < a->n && payload; i++) {
    h.sent_at = tr_now();
    if (send(a->fd, &h, sizeof h, MSG_NOSIGNAL) != (ssize_t)sizeof h) break;
    size_t off = 0;
    for (ssize_t w; off < a->size && (w = send(a->fd, payload + off, a->size - off, MSG_NOSIGNAL)) > 0;)
      off += (size_t)w;
    if (off < a->size) break;
  }
  free(payload);
  return NULL;
}

/* Large messages meet the queue's byte bound long before its count: the
 * reader holds at most max(64 MiB, 4 x the largest stream message) unread
 * (it took 256 messages of any size: here 128 MiB), and nothing is lost.
 * The peer sends 300 of 512 KiB; the reader is watched until it stops
 * taking (30 s only a failure deadline). largest: the link's largest
 * message, a stage's whole parameter slab say: the bound does not grow
 * with it (it was 4 x the slab, 4 x the model). */
static void test_link_queue_bytes(uint64_t largest) {
  enum { N = 300 };
  const size_t size = 512 * 1024;
  uint64_t bound = PL_QUEUE_MESSAGES * (uint64_t)size > PL_QUEUE_BYTES_MIN ? PL_QUEUE_MESSAGES * (uint64_t)size
                                                                             : PL_QUEUE_BYTES_MIN;
  uint64_t most = bound + (uint64_t)PL_QUEUE_DEPTH * sizeof(pl_header); /* payloads and their headers */
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
  pl_link *l = pl_link_create(sv[0], "a peer sending large messages", largest, size);
  flood_args fa = {sv[1], N, size};
  pthread_t th;
  CHECK(pthread_create(&th, NULL, flood_main, &fa) == 0, "the peer's thread");
  uint64_t out, in = 0, last = 0;
  int still = 0;
  for (double end = tr_now() + 30; tr_now() < end && in <= most && still < 25;) {
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
    pl_link_bytes(l, &out, &in);
    still = in == last && in + size >= bound ? still + 1 : 0; /* full, and taking no more */
    last = in;
  }
  CHECK(in <= most && in + size >= bound, "%llu bytes taken in unread (the bound %llu, and headers)",
        (unsigned long long)in, (unsigned long long)bound);
  int got = 0;
  pl_header h;
  void *p = NULL;
  while (got < N && pl_recv(l, PL_PING, 0, -1, 5.0, &h, &p) == 0) got++, free(p), p = NULL;
  CHECK(got == N, "all %d arrive as the stage takes them: %d (%s)", N, got, tr_error());
  pl_link_free(l); /* first: a peer still sending (a failure above) gets an error, not a wait */
  pthread_join(th, NULL);
  close(sv[1]);
}

/* The emulated latency counts from the peer's sent_at, believed only up to
 * now plus the message's time on the wire: an hour ahead is not an hour's
 * sleep; NaN or Inf closes the link. */
static void test_link_sent_at(void) {
  alarm(30); /* a test that would sleep for the peer's hour fails here */
  const double when[] = {3600, 1e300, INFINITY, NAN};
  for (size_t i = 0; i < sizeof when / sizeof when[0]; i++) {
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
    pl_link *l = pl_link_create(sv[0], "a peer", 64, 64);
    pl_link_shape(l, 0, 0.05);
    raw_header(sv[1], PL_PING, 0, tr_now() + when[i]);
    pl_header h;
    void *p = NULL;
    double t0 = tr_now();
    int rc = pl_recv(l, PL_PING, 0, -1, 2.0, &h, &p), finite = isfinite(tr_now() + when[i]);
    double dt = tr_now() - t0;
    CHECK(dt < 1.0 && (finite ? rc == 0 : rc < 0 && strstr(tr_error(), "sent_at")),
          "sent_at now + %g: rc %d in %.2f s (%s)", when[i], rc, dt, rc ? tr_error() : "");
    free(p);
    pl_link_free(l);
    close(sv[1]);
  }
  alarm(0);
}

/* A codec this build does not know is an error, not decoded as top-k. */
static void test_unknown_codec(void) {
  float x[4] = {1, 2, 3, 4}, y[4], scratch[4];
  unsigned char enc[ADATOPK_HEADER + 6 * 4];
  size_t b = adatopk_encode(x, NULL, 4, 2, scratch, enc);
  CHECK(adatopk_decode_any(ADATOPK_CODEC, enc, b, y, 4) == 0, "top-k decodes: %s", tr_error());
  CHECK(adatopk_decode_any(7, enc, b, y, 4) < 0 && strstr(tr_error(), "codec 7"), "codec 7: %s", tr_error());
}

/* One message onto fd as a peer (or anybody) could write it: a header of
 * kind, step, micro-batch and codec, and bytes of payload. */
static int raw_message(int fd, uint32_t kind, int64_t step, int mb, int codec, const void *payload, uint64_t bytes) {
  pl_header h = {.magic = 0x50495045u, .kind = kind, .step = step, .mb = mb, .codec = codec, .sent_at = tr_now(),
                 .bytes = bytes};
  if (send(fd, &h, sizeof h, MSG_NOSIGNAL) != (ssize_t)sizeof h) return -1;
  return bytes && send(fd, payload, bytes, MSG_NOSIGNAL) != (ssize_t)bytes ? -1 : 0;
}

/* Every receiver refuses a codec it does not expect, naming the link: a
 * message that is never encoded (the exchange vector) in any codec but
 * raw; activations in a codec AdaTopK does not know; activations in one
 * of AdaTopK's with compression off. Only the activations' and gradients'
 * receiver checked the codec, and its error did not say which link. */
static void test_codec_refused(void) {
  int sv[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "socketpair");
  pl_link *l = pl_link_create(sv[0], "stage 2", 64, 64);
  char junk[8] = {0};
  CHECK(raw_message(sv[1], PL_GATHER_UP, 1, 0, 3, junk, sizeof junk) == 0, "send");
  pl_header h;
  void *p = NULL;
  int rc = pl_recv(l, PL_GATHER_UP, 1, -1, 2.0, &h, &p);
  CHECK(rc < 0 && strstr(tr_error(), "stage 2") && strstr(tr_error(), "codec 3"), "the exchange vector in codec 3: %s",
        rc ? tr_error() : "taken");
  free(p);
  pl_link_free(l);
  close(sv[1]);

  /* the middle stage of 3: its activations come from stage 0 */
  graph *g = residual_net(2, 8);
  pipe_stage s;
  memset(&s, 0, sizeof s);
  s.g = g;
  s.S = 3;
  s.k = 1;
  s.M = s.b = s.T = s.R = 1;
  s.fwd.on = s.bwd.on = 1;
  s.donor_fd = -1;
  s.timeout = 2;
  CHECK(pipe_stage_setup(&s) == 0 && s.xin_n > 0, "setup: %s", tr_error());
  int in[2], out[2];
  CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, in) == 0 && socketpair(AF_UNIX, SOCK_STREAM, 0, out) == 0, "socketpairs");
  s.prev = pl_link_create(in[0], "stage 0", pipe_stage_max_message(&s), pipe_stage_max_stream(&s));
  s.next = pl_link_create(out[0], "stage 2", pipe_stage_max_message(&s), pipe_stage_max_stream(&s));
  float loss = 0, *x = calloc((size_t)s.xin_n, sizeof(float));
  unsigned char *enc = malloc(ADATOPK_HEADER + 2 * (size_t)s.xin_n);
  size_t b = adatopk_encode_bf16(x, NULL, s.xin_n, enc);
  CHECK(raw_message(in[1], PL_ACT, 1, 0, 7, enc, b) == 0, "send");
  rc = pipe_forward(&s, 1, 0, 0, &loss);
  CHECK(rc < 0 && strstr(tr_error(), "stage 0") && strstr(tr_error(), "codec 7"), "activations in codec 7: %s",
        rc ? tr_error() : "taken");
  s.fwd.on = s.bwd.on = 0; /* compression = "none": bf16 is not expected either */
  CHECK(raw_message(in[1], PL_ACT, 1, 1, ADATOPK_BF16, enc, b) == 0, "send");
  rc = pipe_forward(&s, 1, 1, 0, &loss);
  CHECK(rc < 0 && strstr(tr_error(), "stage 0") && strstr(tr_error(), "compression is off"),
        "bf16 activations with compression off: %s", rc ? tr_error() : "taken");
  free(x);
  free(enc);
  pipe_stage_free(&s);
  close(in[1]);
  close(out[1]);
  graph_free(g);
}

/* --- a resume's checks of the stage stores, and the set-aside --- */

/* A store at dir holding the steps from..to by every (one tensor). */
static void commit_store(const char *dir, int64_t from, int64_t to, int64_t every) {
  ckpt_opts o = {dir, 0, 100, 0, CKPT_COALESCE};
  ckpt_engine *e = ckpt_open(&o);
  CHECK(e != NULL, "ckpt_open(%s): %s", dir, tr_error());
  if (!e) return;
  float a[64] = {0};
  int64_t d[1] = {64};
  ckpt_register(e, "param/a", CKPT_F32, 1, d, a);
  for (int64_t step = from; step <= to; step += every) {
    a[0] = (float)step;
    ckpt_state st = {.step = step};
    ckpt_snapshot(e, &st);
    ckpt_wait_copy(e);
    ckpt_flush(e);
  }
  ckpt_close(e);
}

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  CHECK(f && fputs(text, f) >= 0, "writing %s", path);
  if (f) fclose(f);
}

/* A launcher killed while stage 1's worker was inside ckpt_open, after
 * LMDB created data.mdb and before the databases' commit (or before LMDB
 * wrote a page, or before data.mdb at all): that store holds no
 * checkpoint, so the resume starts over (it refused, the store
 * "unreadable": MDB_NOTFOUND). */
static void test_resume_never_committed(void) {
  char run[] = "/tmp/test_pipeline_resume_XXXXXX";
  CHECK(mkdtemp(run) != NULL, "mkdtemp");
  char s0[200], s1[200], mdb[240], plan[200];
  snprintf(s0, sizeof s0, "%s/ckpt-stage-0", run);
  snprintf(s1, sizeof s1, "%s/ckpt-stage-1", run);
  snprintf(mdb, sizeof mdb, "%s/data.mdb", s1);
  snprintf(plan, sizeof plan, "%s/pipeline-plan", run);
  write_text(plan, "PLAN stage=0 cuts=0,3,7 order=0,1\nPLAN stage=1 cuts=0,3,7 order=0,1\n");
  commit_store(s0, 3, 6, 3);
  for (int state = 0; state < 3; state++) {
    const char *what[] = {"a directory without data.mdb", "a data.mdb of 0 bytes", "a data.mdb without databases"};
    CHECK(tr_mkdirs(s1) == 0, "mkdir %s", s1);
    if (state == 1) write_text(mdb, "");
    if (state == 2) {
      MDB_env *env;
      int rc = mdb_env_create(&env);
      if (!rc) mdb_env_set_maxdbs(env, 4);
      if (!rc) rc = mdb_env_open(env, s1, 0, 0644);
      mdb_env_close(env);
      CHECK(rc == 0 && access(mdb, F_OK) == 0, "an LMDB environment without databases: %s", mdb_strerror(rc));
    }
    int64_t step = -1;
    int over = -1;
    int rc = pipe_ckpt_resume_check(run, 2, &step, &over);
    CHECK(rc == 0 && step == 0 && over == 1, "stage 1's store is %s: the resume starts over (rc %d, step %lld, "
          "start_over %d: %s)", what[state], rc, (long long)step, over, tr_error());
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", s1);
    CHECK(system(cmd) == 0, "%s", cmd);
  }
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf %s", run);
  CHECK(system(cmd) == 0, "%s", cmd);
}

/* Two starts over within one second: the second set-aside's names are not
 * the first's (they were ckpt-stage-K.abandoned-<second>, and its rename
 * failed after stage 0's store had moved), and nothing is lost. */
static void test_set_aside_twice(void) {
  char run[] = "/tmp/test_pipeline_aside_XXXXXX";
  CHECK(mkdtemp(run) != NULL, "mkdtemp");
  char s[2][200];
  int total = 0;
  for (int round = 0; round < 2; round++) {
    for (int k = 0; k < 2; k++) {
      snprintf(s[k], sizeof s[k], "%s/ckpt-stage-%d", run, k);
      commit_store(s[k], 2, 4 + 2 * round, 2);
    }
    int moved = -1;
    time_t t0 = time(NULL);
    int rc = pipe_ckpt_set_aside(run, 2, &moved);
    CHECK(rc == 0 && moved == 2 * (2 + round), "set-aside %d moves both stores' %d checkpoints (rc %d, moved %d: %s)",
          round + 1, 2 * (2 + round), rc, moved, tr_error());
    CHECK(round == 0 || time(NULL) - t0 <= 1, "(the set-asides ran within a second or two)");
    total += moved;
    for (int k = 0; k < 2; k++) CHECK(access(s[k], F_OK) != 0, "set-aside %d: %s is gone", round + 1, s[k]);
  }
  /* every set-aside directory, with every checkpoint in it */
  char cmd[400];
  snprintf(cmd, sizeof cmd, "ls -d %s/ckpt-stage-*.abandoned-* | wc -l", run);
  FILE *p = popen(cmd, "r");
  int dirs = -1;
  if (p) {
    if (fscanf(p, "%d", &dirs) != 1) dirs = -1;
    pclose(p);
  }
  CHECK(dirs == 4 && total == 10, "4 directories set aside (%d), 10 checkpoints (%d)", dirs, total);
  snprintf(cmd, sizeof cmd, "rm -rf %s", run);
  CHECK(system(cmd) == 0, "%s", cmd);
}

int main(void) {
  test_cuts();
  test_topk();
  test_feedback();
  test_controller();
  test_topk_nonfinite();
  test_feedback_nonfinite();
  test_nonfinite_step();
  test_probe_hello();
  test_probe_silent();
  test_policy_answer();
  test_plan_restore();
  test_link_max_message();
  test_link_grace();
  test_link_herald();
  test_link_queue_bound();
  test_link_queue_bytes(512 * 1024);
  test_link_queue_bytes((uint64_t)32 << 20);
  test_link_sent_at();
  test_unknown_codec();
  test_codec_refused();
  test_resume_never_committed();
  test_set_aside_twice();
  return check_report("test_pipeline");
}
