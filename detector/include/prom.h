/* prom.h — the detector's metrics in Prometheus text exposition format
 * 0.0.4, and a /metrics endpoint on libevent's evhttp.
 *
 * Families (all prefixed transom_, base units, HELP and TYPE lines):
 *   gauges per worker, labelled worker="N": transom_loss, transom_grad_norm,
 *     transom_learning_rate, transom_step_seconds, transom_compute_seconds,
 *     transom_step_phase_seconds{phase="data|forward|backward|allreduce|
 *     optimizer|checkpoint_wait"}, transom_tokens_per_second,
 *     transom_rss_bytes, transom_last_step, transom_heartbeat_age_seconds;
 *   gauges: transom_workers;
 *   counters: transom_steps_total, transom_anomalies_total{kind},
 *     transom_actions_total{action}, transom_rule_errors_total,
 *     transom_policy_reloads_total{result="ok|failed"},
 *     transom_restarts_total (the operator's count, from prom_extra).
 *
 * It does not collect anything itself: it reads the detector.
 * Thread-safety: the detector's thread only (the one running base).
 */
#ifndef TRANSOM_PROM_H
#define TRANSOM_PROM_H

#include <stdint.h>

#include "detector.h"

struct evbuffer;
struct event_base;

/* What the operator knows and the detector does not, filled at each scrape. */
typedef struct {
  int64_t restarts_total;
} prom_extra;

typedef void (*prom_extra_fn)(void *ud, prom_extra *x);

/* Appends the exposition of d (and x, which may be NULL: zeros) to out.
 * Returns 0, or TR_ENOMEM when the buffer cannot grow. */
int prom_render(detector *d, const prom_extra *x, struct evbuffer *out);

typedef struct prom_server prom_server;

/* Binding to port 0 means "any free port": for tests, pass PROM_PORT_ANY. */
#define PROM_PORT_ANY (-1)

/* Serves GET /metrics on host:port (host "127.0.0.1" in transom) from base,
 * rendering d at each request; `extra` (may be NULL) fills prom_extra first.
 * port 0: off: *out = NULL and 0 returned. Other paths answer 404, other
 * methods 405. Returns 0 with *out set, TR_EIO when the address cannot be
 * bound (tr_error() says why), TR_ENOMEM. d and base must outlive the server;
 * free it with prom_server_free before either. */
int prom_serve(struct event_base *base, const char *host, int port, detector *d, prom_extra_fn extra, void *ud,
               prom_server **out);
/* The port it listens on (useful with PROM_PORT_ANY). */
int prom_server_port(const prom_server *s);
/* NULL is a no-op. */
void prom_server_free(prom_server *s);

#endif
