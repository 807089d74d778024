/* prom.c — Prometheus text exposition (format 0.0.4) of the detector's
 * metrics and counters, and the /metrics endpoint (libevent evhttp). Reads
 * the detector's series store and counters (detector_internal.h); collects
 * nothing itself. Runs on the detector's thread (see prom.h).
 */
#include "prom.h"

#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "detector_internal.h"
#include "util.h"

/* --- rendering --- */

static void put_value(struct evbuffer *out, double v) {
  if (isnan(v)) evbuffer_add_printf(out, "NaN\n");
  else if (isinf(v)) evbuffer_add_printf(out, v > 0 ? "+Inf\n" : "-Inf\n");
  else evbuffer_add_printf(out, "%.12g\n", v);
}

/* Label values: \ " and newline escaped. */
static void put_label(struct evbuffer *out, const char *s) {
  for (; *s; s++) {
    if (*s == '\\') evbuffer_add(out, "\\\\", 2);
    else if (*s == '"') evbuffer_add(out, "\\\"", 2);
    else if (*s == '\n') evbuffer_add(out, "\\n", 2);
    else evbuffer_add(out, s, 1);
  }
}

static void family(struct evbuffer *out, const char *name, const char *type, const char *help) {
  evbuffer_add_printf(out, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* One per-worker gauge from the latest value of metric m (scale: unit change). */
/* Gauges and step phases, from the metric table (detector.h, which extends
 * the step record's): a metric with a gauge name is its own family, one
 * with a phase is a label of transom_step_phase_seconds. */
static const struct {
  const char *gauge, *phase, *help;
  int metric;
} metric_defs[] = {
#define PROM_DEF(id, name, help, prom, phase) {prom, phase, help, DET_M_##id},
    DETECTOR_METRICS(PROM_DEF)
#undef PROM_DEF
};
#define NDEFS (sizeof metric_defs / sizeof metric_defs[0])

int prom_render(detector *d, const prom_extra *x, struct evbuffer *out) {
  const series_store *s = d->real.s;
  int W = d->real.max_workers;
  size_t before = evbuffer_get_length(out);
  for (size_t g = 0; g < NDEFS; g++) {
    if (!metric_defs[g].gauge[0]) continue;
    family(out, metric_defs[g].gauge, "gauge", metric_defs[g].help);
    for (int w = 0; w < W; w++)
      if (series_len(s, w)) {
        evbuffer_add_printf(out, "%s{worker=\"%d\"} ", metric_defs[g].gauge, w);
        put_value(out, series_value(s, w, metric_defs[g].metric, 0));
      }
  }
  family(out, "transom_step_phase_seconds", "gauge", "Time of each phase of the worker's latest step.");
  for (int w = 0; w < W; w++)
    if (series_len(s, w))
      for (size_t p = 0; p < NDEFS; p++) {
        if (!metric_defs[p].phase[0]) continue;
        evbuffer_add_printf(out, "transom_step_phase_seconds{worker=\"%d\",phase=\"%s\"} ", w, metric_defs[p].phase);
        put_value(out, series_value(s, w, metric_defs[p].metric, 0));
      }
  family(out, "transom_last_step", "gauge", "The newest step the worker reported.");
  for (int w = 0; w < W; w++)
    if (series_len(s, w)) evbuffer_add_printf(out, "transom_last_step{worker=\"%d\"} %lld\n", w, (long long)series_step(s, w, 0));
  family(out, "transom_heartbeat_age_seconds", "gauge", "Seconds since the worker's last heartbeat, at the last detector tick.");
  for (int w = 0; w < W; w++)
    if (series_known(s, w) && !isnan(d->real.hb[w])) {
      evbuffer_add_printf(out, "transom_heartbeat_age_seconds{worker=\"%d\"} ", w);
      put_value(out, fmax(0, d->real.now - d->real.hb[w]));
    }
  int known = 0;
  for (int w = 0; w < W; w++) known += series_known(s, w);
  family(out, "transom_workers", "gauge", "Workers the detector knows (reporting steps or heartbeats).");
  evbuffer_add_printf(out, "transom_workers %d\n", known);

  family(out, "transom_steps_total", "counter", "Worker steps observed by the detector.");
  evbuffer_add_printf(out, "transom_steps_total %lld\n", (long long)d->steps_total);
  family(out, "transom_anomalies_total", "counter", "Anomalies raised by the rules, by kind.");
  for (int i = 0; i < d->nkinds; i++) {
    evbuffer_add_printf(out, "transom_anomalies_total{kind=\"");
    put_label(out, d->kinds[i].kind);
    evbuffer_add_printf(out, "\"} %lld\n", (long long)d->kinds[i].n);
  }
  family(out, "transom_actions_total", "counter", "Actions chosen by the policies, by action.");
  for (int a = 0; a < DET_ACT_COUNT; a++)
    evbuffer_add_printf(out, "transom_actions_total{action=\"%s\"} %lld\n", detector_action_name((detector_action_kind)a),
                        (long long)d->actions_total[a]);
  family(out, "transom_rule_errors_total", "counter", "Rule and policy calls that failed (error, budget, bad result).");
  evbuffer_add_printf(out, "transom_rule_errors_total %lld\n", (long long)d->rule_errors_total);
  family(out, "transom_policy_reloads_total", "counter", "Policy file loads, by result.");
  evbuffer_add_printf(out, "transom_policy_reloads_total{result=\"ok\"} %lld\n", (long long)d->reloads_total);
  evbuffer_add_printf(out, "transom_policy_reloads_total{result=\"failed\"} %lld\n", (long long)d->reload_failures_total);
  family(out, "transom_restarts_total", "counter", "Replica restarts by the operator.");
  evbuffer_add_printf(out, "transom_restarts_total %lld\n", (long long)(x ? x->restarts_total : 0));
  if (evbuffer_get_length(out) == before) return tr_fail(TR_ENOMEM, "prom_render: out of memory");
  return TR_OK;
}

/* --- the server --- */

struct prom_server {
  struct evhttp *http;
  detector *d;
  prom_extra_fn extra;
  void *ud;
  int port;
};

static void metrics_cb(struct evhttp_request *req, void *arg) {
  prom_server *s = arg;
  struct evbuffer *body = evbuffer_new();
  if (!body) {
    evhttp_send_error(req, HTTP_INTERNAL, "out of memory");
    return;
  }
  prom_extra x = {0};
  if (s->extra) s->extra(s->ud, &x);
  if (prom_render(s->d, &x, body) != TR_OK) {
    evbuffer_free(body);
    evhttp_send_error(req, HTTP_INTERNAL, "out of memory");
    return;
  }
  evhttp_add_header(evhttp_request_get_output_headers(req), "Content-Type", "text/plain; version=0.0.4; charset=utf-8");
  evhttp_send_reply(req, HTTP_OK, "OK", body);
  evbuffer_free(body);
}

static void other_cb(struct evhttp_request *req, void *arg) {
  (void)arg;
  evhttp_send_error(req, HTTP_NOTFOUND, "only /metrics here");
}

int prom_serve(struct event_base *base, const char *host, int port, detector *d, prom_extra_fn extra, void *ud,
               prom_server **out) {
  *out = NULL;
  if (port == 0) return TR_OK; /* off */
  if (port < PROM_PORT_ANY || port > 65535) return tr_fail(TR_EINVAL, "metrics port %d out of range", port);
  prom_server *s = calloc(1, sizeof *s);
  if (!s) return tr_fail(TR_ENOMEM, "prom_serve: out of memory");
  s->d = d;
  s->extra = extra;
  s->ud = ud;
  s->http = evhttp_new(base);
  if (!s->http) {
    free(s);
    return tr_fail(TR_ENOMEM, "prom_serve: evhttp_new failed");
  }
  evhttp_set_allowed_methods(s->http, EVHTTP_REQ_GET | EVHTTP_REQ_HEAD);
  evhttp_set_cb(s->http, "/metrics", metrics_cb, s);
  evhttp_set_gencb(s->http, other_cb, s);
  struct evhttp_bound_socket *h =
      evhttp_bind_socket_with_handle(s->http, host ? host : "127.0.0.1", (ev_uint16_t)(port < 0 ? 0 : port));
  if (!h) {
    int rc = tr_fail(TR_EIO, "cannot serve metrics on %s:%d: %s", host ? host : "127.0.0.1", port < 0 ? 0 : port,
                     strerror(errno));
    evhttp_free(s->http);
    free(s);
    return rc;
  }
  struct sockaddr_storage sa;
  socklen_t sl = sizeof sa;
  if (getsockname(evhttp_bound_socket_get_fd(h), (struct sockaddr *)&sa, &sl) == 0)
    s->port = sa.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&sa)->sin6_port)
                                       : ntohs(((struct sockaddr_in *)&sa)->sin_port);
  *out = s;
  return TR_OK;
}

int prom_server_port(const prom_server *s) { return s ? s->port : 0; }

void prom_server_free(prom_server *s) {
  if (!s) return;
  evhttp_free(s->http);
  free(s);
}
