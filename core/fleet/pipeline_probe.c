/* pipeline_probe.c — the workload estimator's measurements, taken by each
 * stage worker at start, before the plan (see pipeline.h):
 *
 *   speed    the worker's FLOP/s on the job's own model: one forward and
 *            backward of the whole micro-batch graph to warm up, one timed
 *            (an emulated slow worker is slow here too), divided into the
 *            graph's FLOPs (graph_stage_costs);
 *   links    to every other worker: 3 pings (the least round trip / 2 is
 *            the latency), then a bulk transfer (64 KiB, and 512 KiB when
 *            that was quick) acknowledged by the peer: bandwidth = bytes /
 *            (time - round trip). Worker w probes the workers above it and
 *            a thread serves the ones below, so every pair is measured once
 *            and nobody waits on anybody in a cycle.
 *
 * The result is the PROBE line the launcher plans from.
 */
#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "graph_stage.h"
#include "pipeline_plan.h"
#include "pipeline_probe.h"
#include "util.h"

/* --- speed --- */

int pipe_probe_speed(pipe_stage *s, double *flops_s) {
  graph *g = s->g;
  int n = graph_norder(g), rc = TR_OK;
  graph_op_cost *c = malloc(sizeof *c * (size_t)n);
  if (!c || graph_stage_costs(g, c)) {
    free(c);
    return tr_fail(TR_ENOMEM, "probe: out of memory");
  }
  double flops = 0;
  for (int k = 0; k < n; k++) flops += c[k].flops;
  free(c);
  double t = 0;
  for (int round = 0; round < 4 && !rc; round++) { /* a warm-up, then the least of three */
    s->compute_s = 0;
    rc = pipe_run_whole(s);
    if (round == 1 || (round > 1 && s->compute_s < t)) t = s->compute_s;
  }
  graph_zero_grad(g); /* the probe's gradients are no step's */
  *flops_s = t > 0 ? flops / t : 0;
  return rc;
}

/* --- links --- */

#define PROBE_BULK_MAX (512 * 1024) /* the larger bulk transfer: the most a probe message carries */

struct pipe_probe_server {
  const pipe_probe_ctx *c;
  pthread_t th;
  int rc;
  char err[256];
};

static void shape(const pipe_probe_ctx *c, pl_link *l, int peer) {
  double rate, delay;
  pipe_link_emulation(c->cfg, c->plan->zone[c->w], c->plan->zone[peer], &rate, &delay);
  pl_link_shape(l, rate, delay);
}

/* Which lower worker a HELLO names: its value must be a whole number in
 * 0..w-1 that this server has not served yet (any local process can
 * connect, and the value indexes the plan's zones). -1 (why in `why`) for
 * anything else. */
static int hello_worker(const pipe_probe_ctx *c, const pl_header *h, const unsigned char *served, char *why,
                        size_t n) {
  double v = h->value;
  if (!isfinite(v) || v != floor(v) || v < 0 || v >= c->w) {
    snprintf(why, n, "its HELLO names worker %g, not one of the lower workers 0..%d", v, c->w - 1);
    return -1;
  }
  if (served[(int)v]) {
    snprintf(why, n, "its HELLO names worker %d, already served", (int)v);
    return -1;
  }
  return (int)v;
}

/* One probing connection. TR_OK: a lower worker probed its link (marked in
 * served); 1: a connection that did not say HELLO as a lower worker not
 * served yet (closed, logged: the server waits for the next); or an error. */
static int serve_one(const pipe_probe_ctx *c, unsigned char *served) {
  int fd = pl_accept(c->lfd, c->timeout), rc, peer = -1;
  char from[64] = "?", why[160];
  struct sockaddr_in a;
  socklen_t alen = sizeof a;
  if (fd >= 0 && getpeername(fd, (struct sockaddr *)&a, &alen) == 0 && a.sin_family == AF_INET)
    snprintf(from, sizeof from, "%s:%d", inet_ntoa(a.sin_addr), ntohs(a.sin_port));
  pl_link *l = fd >= 0 ? pl_link_create(fd, "a probing worker", PROBE_BULK_MAX, PROBE_BULK_MAX) : NULL;
  if (!l) return TR_EIO;
  pl_header h;
  void *p = NULL;
  /* a short wait: a connection that stays silent is closed and the next
   * one taken (a real prober says HELLO at once; one waiting behind a
   * silent one must not wait out hang_seconds) */
  double hello = c->hello_timeout > 0 ? c->hello_timeout : PIPE_PROBE_HELLO_S;
  if (hello > c->timeout) hello = c->timeout;
  if (pl_recv(l, PL_HELLO, 0, -1, hello, &h, &p)) snprintf(why, sizeof why, "no HELLO (%s)", tr_error());
  else peer = hello_worker(c, &h, served, why, sizeof why);
  if (peer < 0) {
    fprintf(stderr, "transom stage worker %d: probe: closed a connection from %s: %s\n", c->w, from, why);
    rc = 1;
    goto done;
  }
  shape(c, l, peer);
  for (;;) {
    free(p);
    p = NULL;
    if ((rc = pl_recv(l, 0, 0, -1, c->timeout, &h, &p)) || h.kind == PL_DONE) break;
    pl_header r = {.kind = h.kind == PL_PING ? PL_PONG : PL_ACK};
    if ((rc = pl_send(l, &r, NULL))) break;
  }
  if (!rc) served[peer] = 1;
done:
  free(p);
  pl_link_free(l);
  return rc;
}

/* Serves each of the workers 0..w-1 once; a connection that is none of
 * them is closed and not counted, up to PIPE_MAX_STAGES of those. */
static void *serve_main(void *arg) {
  pipe_probe_server *sv = arg;
  unsigned char served[PIPE_MAX_STAGES] = {0};
  int done = 0, rejected = 0;
  while (done < sv->c->w && !sv->rc) {
    int r = serve_one(sv->c, served);
    if (r == 0) done++;
    else if (r < 0) sv->rc = r;
    else if (++rejected > PIPE_MAX_STAGES)
      sv->rc = tr_fail(TR_EIO, "probe: %d connections that were none of the lower workers", rejected);
  }
  if (sv->rc) snprintf(sv->err, sizeof sv->err, "%s", tr_error());
  return NULL;
}

static int exchange(pl_link *l, uint32_t kind, uint32_t reply, const void *payload, uint64_t bytes, double timeout) {
  pl_header h = {.kind = kind, .bytes = bytes}, r;
  void *p = NULL;
  int rc = pl_send(l, &h, payload);
  if (!rc) rc = pl_recv(l, reply, 0, -1, timeout, &r, &p);
  free(p);
  return rc;
}

static int probe_peer(const pipe_probe_ctx *c, int j, const char *bulk, double *bw, double *lat) {
  int fd = pl_connect(c->plan->addr[j], c->ports[j], c->timeout), rc = TR_OK;
  pl_link *l = fd >= 0 ? pl_link_create(fd, "a probed worker", PROBE_BULK_MAX, PROBE_BULK_MAX) : NULL;
  if (!l) return TR_EIO;
  shape(c, l, j);
  pl_header hello = {.kind = PL_HELLO, .value = c->w};
  double rtt = 1e9;
  rc = pl_send(l, &hello, NULL);
  for (int i = 0; i < 3 && !rc; i++) {
    double t0 = tr_now();
    rc = exchange(l, PL_PING, PL_PONG, NULL, 0, c->timeout);
    if (tr_now() - t0 < rtt) rtt = tr_now() - t0;
  }
  uint64_t size = 64 * 1024;
  double t = 0;
  for (int i = 0; i < 2 && !rc; i++) {
    double t0 = tr_now();
    rc = exchange(l, PL_BULK, PL_ACK, bulk, size, c->timeout);
    t = tr_now() - t0;
    if (t > 0.05) break;
    size = PROBE_BULK_MAX;
  }
  double wire = t - rtt;
  *bw = wire > 1e-6 ? (double)size / wire : 0; /* 0: faster than we can tell (unlimited) */
  *lat = rtt / 2;
  pl_header done = {.kind = PL_DONE};
  if (!rc) rc = pl_send(l, &done, NULL);
  pl_link_free(l);
  return rc;
}

pipe_probe_server *pipe_probe_serve(const pipe_probe_ctx *c) {
  pipe_probe_server *sv = calloc(1, sizeof *sv);
  if (!sv) return tr_fail(TR_ENOMEM, "probe: out of memory"), NULL;
  sv->c = c;
  if (pthread_create(&sv->th, NULL, serve_main, sv)) {
    free(sv);
    tr_fail(TR_EIO, "probe: cannot start a thread");
    return NULL;
  }
  return sv;
}

int pipe_probe_serve_join(pipe_probe_server *sv) {
  if (!sv) return TR_OK;
  pthread_join(sv->th, NULL);
  int rc = sv->rc ? tr_fail(sv->rc, "probe: serving a lower worker: %s", sv->err) : TR_OK;
  free(sv);
  return rc;
}

int pipe_probe_links(const pipe_probe_ctx *c, double *bw, double *lat) {
  char *bulk = calloc(PROBE_BULK_MAX, 1);
  if (!bulk) return tr_fail(TR_ENOMEM, "probe: out of memory");
  int rc = TR_OK;
  for (int j = c->w + 1; j < c->plan->S && !rc; j++) rc = probe_peer(c, j, bulk, &bw[j], &lat[j]);
  free(bulk);
  return rc;
}

int pipe_probe_line(char *out, size_t n, int w, int S, double flops_s, const double *bw, const double *lat) {
  size_t k = (size_t)snprintf(out, n, "PROBE worker=%d flops=%.6g links=", w, flops_s);
  for (int j = w + 1; j < S && k < n; j++)
    k += (size_t)snprintf(out + k, n - k, "%s%d:%.6g:%.6g", j > w + 1 ? "," : "", j, bw[j], lat[j]);
  if (k < n) k += (size_t)snprintf(out + k, n - k, "\n");
  return k < n ? (int)k : tr_fail(TR_EINVAL, "probe line too long");
}

int pipe_probe_parse(const char *line, pipe_plan *p) {
  const char *ws = strstr(line, "worker="), *fs = strstr(line, "flops="), *ls = strstr(line, "links=");
  if (strncmp(line, "PROBE ", 6) != 0 || !ws || !fs || !ls) return tr_fail(TR_EIO, "a bad probe line: %.80s", line);
  int w = atoi(ws + 7);
  if (w < 0 || w >= p->S) return tr_fail(TR_EIO, "a probe line from worker %d", w);
  p->flops_s[w] = strtod(fs + 6, NULL);
  for (const char *q = ls + 6; *q && *q != '\n';) {
    char *end;
    int j = (int)strtol(q, &end, 10);
    if (end == q || *end != ':' || j <= w || j >= p->S) return tr_fail(TR_EIO, "a bad probe line: %.80s", line);
    double b = strtod(end + 1, &end);
    double l = *end == ':' ? strtod(end + 1, &end) : 0;
    p->bw[w][j] = p->bw[j][w] = b;
    p->lat[w][j] = p->lat[j][w] = l;
    q = *end == ',' ? end + 1 : end;
  }
  return TR_OK;
}
