/* test_detector.c — the detector (detector/): statistics against hand
 * computations; every shipped rule firing on synthetic observations that
 * mimic its fault (NaN loss, a 5x straggler, a hang with a live heartbeat, a
 * lost heartbeat, a flipped checksum, a loss spike, an exploding gradient)
 * and staying quiet on a clean, noisy 500-step run of 4 replicas; the
 * policies' actions; hot reload (a rewritten policy changes behaviour; a
 * syntax error and a runtime error leave the old version in force with an
 * event naming file and line); an endless loop stopped by the instruction
 * hook; the sandbox; inotify picking up editor-style saves; Prometheus output
 * through a live /metrics (checked by promtool when installed); `transom
 * plot` (when gnuplot is installed); the REPL's read-only copies.
 *
 * Time is synthetic (the `now` passed in), so nothing here depends on the
 * machine's speed; detection latencies are printed in steps / simulated
 * seconds. Only the inotify and HTTP cases run an event loop, bounded.
 */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/event.h>
#include <event2/http.h>
#include <lauxlib.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "detector.h"
#include "lua_host.h"
#include "prom.h"
#include "stats.h"
#include "util.h"

int plot_main(int argc, char **argv);

/* --- capture of what the detector says --- */

#define CAP_MAX 4096
typedef struct {
  detector_event_type type;
  char kind[32], rule[64], anomaly[64], action[32], file[512], detail[600];
  int line, worker;
  long long step;
} cap_event;

typedef struct {
  detector_action_kind action;
  int worker;
  long long step;
  char kind[64];
} cap_action;

static cap_event events[CAP_MAX];
static int nevents;
static cap_action actions[CAP_MAX];
static int nactions;
static int nanomalies;
static detector *reentry_d; /* a detector_tick from inside a callback must be refused */
static int reentry_rc = 1;

static void on_event(void *ud, const detector_event *e) {
  (void)ud;
  if (getenv("DETECTOR_TEST_VERBOSE")) {
    char buf[2048];
    detector_event_json(e, buf, sizeof buf);
    fprintf(stderr, "  event %s\n", buf);
  }
  if (nevents == CAP_MAX) return;
  cap_event *c = &events[nevents++];
  memset(c, 0, sizeof *c);
  c->type = e->type;
  snprintf(c->kind, sizeof c->kind, "%s", e->kind ? e->kind : "");
  snprintf(c->rule, sizeof c->rule, "%s", e->rule ? e->rule : "");
  snprintf(c->anomaly, sizeof c->anomaly, "%s", e->anomaly ? e->anomaly : "");
  snprintf(c->action, sizeof c->action, "%s", e->action ? e->action : "");
  snprintf(c->file, sizeof c->file, "%s", e->file ? e->file : "");
  snprintf(c->detail, sizeof c->detail, "%s", e->detail ? e->detail : "");
  c->line = e->line;
  c->worker = e->worker;
  c->step = (long long)e->step;
}

static void on_anomaly(void *ud, const detector_anomaly *a) {
  (void)ud;
  (void)a;
  nanomalies++;
  if (reentry_d) reentry_rc = detector_tick(reentry_d, 0);
}

static void on_action(void *ud, const detector_action *a) {
  (void)ud;
  if (nactions == CAP_MAX) return;
  cap_action *c = &actions[nactions++];
  c->action = a->action;
  c->worker = a->worker;
  c->step = (long long)a->step;
  snprintf(c->kind, sizeof c->kind, "%s", a->cause->kind);
}

static void cap_reset(void) { nevents = nactions = nanomalies = 0; }

/* The first anomaly event of kind (and worker, unless -2), or NULL. */
static const cap_event *find_anomaly(const char *kind, int worker) {
  for (int i = 0; i < nevents; i++)
    if (events[i].type == DET_EV_ANOMALY && strcmp(events[i].anomaly, kind) == 0 &&
        (worker == -2 || events[i].worker == worker))
      return &events[i];
  return NULL;
}

static int count_anomalies(const char *kind) {
  int n = 0;
  for (int i = 0; i < nevents; i++) n += events[i].type == DET_EV_ANOMALY && (!kind || strcmp(events[i].anomaly, kind) == 0);
  return n;
}

static const cap_event *find_event(detector_event_type t, const char *needle) {
  for (int i = 0; i < nevents; i++)
    if (events[i].type == t && (!needle || strstr(events[i].detail, needle))) return &events[i];
  return NULL;
}

static int count_events(detector_event_type t) {
  int n = 0;
  for (int i = 0; i < nevents; i++) n += events[i].type == t;
  return n;
}

static const cap_action *find_action(detector_action_kind a, const char *kind) {
  for (int i = 0; i < nactions; i++)
    if (actions[i].action == a && (!kind || strcmp(actions[i].kind, kind) == 0)) return &actions[i];
  return NULL;
}

/* --- a policy folder with copies of the shipped files --- */

static char pdir[512];

static void write_file(const char *dir, const char *name, const char *text) {
  char path[1024], tmp[1100];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  snprintf(tmp, sizeof tmp, "%s/.%s.tmp", dir, name);
  FILE *f = fopen(tmp, "w");
  if (!f || fputs(text, f) < 0 || fclose(f) != 0) {
    fprintf(stderr, "cannot write %s\n", tmp);
    exit(1); /* ok-exit: test set-up */
  }
  rename(tmp, path);
}

static char *shipped(const char *name) {
  char path[1024];
  snprintf(path, sizeof path, "%s/policies/%s", TRANSOM_LUA_DIR, name);
  size_t n;
  char *s = tr_read_file(path, &n);
  if (!s) {
    fprintf(stderr, "%s\n", tr_error());
    exit(1); /* ok-exit: test set-up */
  }
  return s;
}

/* Shipped text with one substring replaced (the caller frees). */
static char *patched(const char *name, const char *from, const char *to) {
  char *s = shipped(name);
  char *at = strstr(s, from);
  if (!at) {
    fprintf(stderr, "'%s' not in %s\n", from, name);
    exit(1); /* ok-exit: test set-up */
  }
  size_t n = strlen(s) - strlen(from) + strlen(to) + 1;
  char *out = malloc(n);
  snprintf(out, n, "%.*s%s%s", (int)(at - s), s, to, at + strlen(from));
  free(s);
  return out;
}

static void reset_policies(void) {
  char *r = shipped("rules.lua"), *a = shipped("actions.lua");
  write_file(pdir, "rules.lua", r);
  write_file(pdir, "actions.lua", a);
  free(r);
  free(a);
}

static detector *make(long budget, size_t mem_limit) {
  detector_opts o;
  detector_opts_default(&o);
  o.policy_dir = pdir;
  o.fallback_dir = pdir;
  o.max_workers = 16;
  o.history = 128;
  o.budget = budget;
  o.mem_limit = mem_limit;
  o.debounce_ms = 100;
  o.on_event = on_event;
  o.on_anomaly = on_anomaly;
  o.on_action = on_action;
  detector *d = detector_create(&o);
  if (!d) fprintf(stderr, "detector_create: %s\n", tr_error());
  return d;
}

/* --- a synthetic fleet --- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double urand(void) { /* xorshift64*, [0,1) */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (double)((rng_state * 2685821657736338717ull) >> 11) / 9007199254740992.0;
}
static double gauss(void) {
  double u = urand(), v = urand();
  return sqrt(-2 * log(u + 1e-300)) * cos(2 * M_PI * v);
}

/* A healthy step of worker w: falling, noisy loss; noisy gradient norm;
 * step time with jitter, where the all-reduce absorbs the differences. */
static detector_sample healthy(int64_t step, double t) {
  detector_sample s = {0};
  s.loss = 0.8 + 3.2 * exp(-step / 150.0) + 0.03 * gauss();
  s.grad_norm = 0.6 + 1.5 * exp(-step / 80.0) + 0.08 * fabs(gauss());
  s.lr = 6e-4 * (step < 50 ? step / 50.0 : 0.5 * (1 + cos(M_PI * step / 500.0)));
  s.data_s = 0.004 + 0.001 * urand();
  s.forward_s = 0.030 * (1 + 0.2 * urand());
  s.backward_s = 0.060 * (1 + 0.2 * urand());
  s.optimizer_s = 0.008;
  s.allreduce_s = 0.010 + 0.01 * urand();
  s.ckpt_wait_s = step % 100 == 0 ? 0.05 : 0;
  s.step_s = s.data_s + s.forward_s + s.backward_s + s.optimizer_s + s.allreduce_s + s.ckpt_wait_s;
  s.tokens_per_s = 4096 / s.step_s;
  s.rss_bytes = 5e8 + 1e5 * step;
  s.time = t;
  return s;
}

#define DT 0.25 /* simulated seconds per step */

/* Steps [from, to] for workers 0..n-1 (all healthy), heartbeats, a tick each step. */
static void run_clean(detector *d, int n, int64_t from, int64_t to, double *t) {
  for (int64_t s = from; s <= to; s++) {
    *t += DT;
    for (int w = 0; w < n; w++) {
      detector_sample x = healthy(s, *t);
      if (s % 10 == 0) x.has_checksum = 1, x.checksum = 0xC0FFEE00u + (uint32_t)s;
      detector_observe(d, w, s, &x);
      detector_heartbeat(d, w, *t);
    }
    detector_tick(d, *t);
  }
}

/* --- stats --- */

static void test_stats(void) {
  double x[] = {5, 1, 4, 2, 3, NAN, INFINITY}, scratch[64];
  CHECK(stats_median(x, 7, scratch) == 3, "median %g", stats_median(x, 7, scratch));
  double y[] = {1, 2, 3, 4};
  CHECK(stats_median(y, 4, scratch) == 2.5, "even median");
  CHECK(fabs(stats_percentile(y, 4, 90, scratch) - 3.7) < 1e-12, "p90 %g", stats_percentile(y, 4, 90, scratch));
  CHECK(stats_percentile(y, 4, 0, scratch) == 1 && stats_percentile(y, 4, 100, scratch) == 4, "p0/p100");
  double m[] = {1, 1, 2, 2, 4, 6, 9}; /* median 2, |dev| = 1 1 0 0 2 4 7 -> MAD 1 */
  CHECK(stats_mad(m, 7, scratch) == 1, "mad %g", stats_mad(m, 7, scratch));
  double same[64];
  for (int i = 0; i < 64; i++) same[i] = 7;
  CHECK(stats_median(same, 64, scratch) == 7 && stats_mad(same, 64, scratch) == 0, "constant series");
  CHECK(isnan(stats_median(x + 5, 2, scratch)), "only non-finite -> NaN");
  CHECK(stats_mean(x, 7) == 3, "mean skips non-finite");
  CHECK(stats_z(3, 1, 0) == HUGE_VAL && stats_z(1, 1, 0) == 0 && stats_z(3, 1, 2) == 1, "z");

  ewma e;
  ewma_init(&e, 0.1);
  for (int i = 0; i < 2000; i++) ewma_push(&e, i % 2 ? 11 : 9); /* mean 10, sd 1 */
  CHECK(fabs(e.mean - 10) < 0.2 && fabs(ewma_std(&e) - 1) < 0.15, "ewma mean %g std %g", e.mean, ewma_std(&e));
  ewma_push(&e, NAN);
  CHECK(e.n == 2000, "ewma ignores NaN");
  CHECK(ewma_z(&e, 20) > 8, "ewma z %g", ewma_z(&e, 20));

  series_store *s = series_create(4, 2, 8, 0.1);
  CHECK(s != NULL, "series_create");
  if (!s) return;
  for (int i = 1; i <= 20; i++) {
    double v[2] = {i, 100.0 + i};
    series_push(s, 1, i, i * 0.5, v);
  }
  CHECK(series_len(s, 1) == 8 && series_total(s, 1) == 20, "ring holds 8 of 20");
  CHECK(series_step(s, 1, 0) == 20 && series_step(s, 1, 7) == 13 && series_step(s, 1, 8) == -1, "ring order");
  CHECK(series_median(s, 1, 0, 0) == 16.5, "window median %g", series_median(s, 1, 0, 0));
  CHECK(series_median(s, 1, 0, 3) == 19, "last-3 median");
  double out[8];
  CHECK(series_copy(s, 1, 0, 3, out) == 3 && out[0] == 18 && out[2] == 20, "copy oldest first");
  CHECK(series_run_above(s, 1, 0, 17.5) == 3, "run_above %d", series_run_above(s, 1, 0, 17.5));
  for (int w = 0; w < 4; w++) {
    double v[2] = {w == 3 ? 50 : 1 + w, 0};
    if (w != 1) series_push(s, w, 21, 11, v);
  }
  /* latest values: w0 1, w1 20, w2 3, w3 50 */
  CHECK(series_fleet_median(s, 0, -1) == 11.5, "fleet median %g", series_fleet_median(s, 0, -1));
  CHECK(series_fleet_median(s, 0, 3) == 3, "fleet median without 3: %g", series_fleet_median(s, 0, 3));
  series_push_checksum(s, 2, 10, 0xabc);
  series_push_checksum(s, 2, 20, 0xdef);
  uint32_t crc;
  int64_t cs;
  CHECK(series_checksum_at(s, 2, 10, &crc) && crc == 0xabc, "checksum at 10");
  CHECK(series_checksum(s, 2, &cs, &crc) && cs == 20 && crc == 0xdef, "latest checksum");
  series_rewind(s, 1, 15);
  CHECK(series_step(s, 1, 0) == 15 && series_len(s, 1) == 3, "rewind to 15: len %d", series_len(s, 1));
  series_rewind(s, 2, 15);
  CHECK(!series_checksum_at(s, 2, 20, &crc) && series_checksum_at(s, 2, 10, &crc), "rewind drops checksums");
  series_reset(s, 1);
  CHECK(!series_known(s, 1) && series_len(s, 1) == 0, "reset");
  CHECK(series_push(s, 4, 1, 0, out) == TR_EINVAL, "worker out of range");
  series_free(s);
}

/* --- the rules on synthetic faults --- */

static void test_clean_run(void) {
  reset_policies();
  cap_reset();
  detector *d = make(0, 0);
  CHECK(d != NULL, "create");
  if (!d) return;
  double t = 0;
  double t0 = tr_now();
  run_clean(d, 4, 1, 500, &t);
  double el = tr_now() - t0;
  CHECK(count_anomalies(NULL) == 0, "clean 500-step run: %d anomalies (first: %s)", count_anomalies(NULL),
        nevents && count_anomalies(NULL) ? find_anomaly(events[0].anomaly, -2)->detail : "");
  for (int i = 0; i < nevents; i++)
    if (events[i].type == DET_EV_ANOMALY)
      fprintf(stderr, "  unexpected: %s worker %d step %lld: %s\n", events[i].anomaly, events[i].worker,
              events[i].step, events[i].detail);
  CHECK(count_events(DET_EV_RULE_ERROR) == 0, "no rule errors");
  CHECK(detector_steps_total(d) == 2000, "steps_total %lld", (long long)detector_steps_total(d));
  printf("clean run: 4 workers x 500 steps, 0 anomalies; %.1f us per observe+tick of a step (7 rules x 4 workers)\n",
         el / 500 * 1e6);
  detector_destroy(d);
}

static void test_nan(void) {
  reset_policies();
  cap_reset();
  detector *d = make(0, 0);
  if (!d) return;
  double t = 0;
  run_clean(d, 4, 1, 50, &t);
  t += DT;
  for (int w = 0; w < 4; w++) {
    detector_sample x = healthy(51, t);
    if (w == 2) x.loss = NAN;
    detector_observe(d, w, 51, &x);
    detector_heartbeat(d, w, t);
  }
  int fresh = detector_tick(d, t);
  const cap_event *a = find_anomaly("nan_or_inf_loss", 2);
  CHECK(fresh == 1 && a && a->step == 51, "NaN at step 51 detected at the same tick (fresh %d)", fresh);
  const cap_action *act = find_action(DET_ACT_ROLLBACK, "nan_or_inf_loss");
  CHECK(act && act->step == 50 && act->worker == -1, "rollback to step 50, all replicas");
  detector_tick(d, t + 0.5);
  detector_tick(d, t + 1.0);
  CHECK(count_anomalies("nan_or_inf_loss") == 1, "reported once, not at every tick");
  CHECK(count_anomalies(NULL) == 1, "nothing else fired (%d)", count_anomalies(NULL));
  printf("nan_or_inf_loss: injected at step 51, detected at step 51 (latency 0 steps), action rollback to step %lld\n",
         act ? act->step : -1);
  /* a rollback: step 51 again after the rewind is a new occurrence */
  detector_rewind(d, 50);
  detector_sample x = healthy(51, t + 2);
  x.loss = INFINITY;
  detector_observe(d, 2, 51, &x);
  detector_tick(d, t + 2);
  CHECK(count_anomalies("nan_or_inf_loss") == 2, "after a rewind it fires again");
  detector_destroy(d);
}

/* One worker's own compute time 5x the others' from step 31; with `wait`
 * the others' step time rises too (they wait in the all-reduce). */
static void test_straggler(int wait) {
  reset_policies();
  cap_reset();
  detector *d = make(0, 0);
  if (!d) return;
  double t = 0;
  run_clean(d, 4, 1, 30, &t);
  int64_t detected = -1;
  for (int64_t s = 31; s <= 45; s++) {
    t += DT;
    detector_sample xs[4];
    for (int w = 0; w < 4; w++) xs[w] = healthy(s, t);
    double slow_compute = 5 * (xs[1].step_s - xs[1].allreduce_s);
    xs[1].step_s = slow_compute + 0.002;
    xs[1].allreduce_s = 0.002;
    if (wait)
      for (int w = 0; w < 4; w++)
        if (w != 1) {
          double own = xs[w].step_s - xs[w].allreduce_s;
          xs[w].allreduce_s = slow_compute - own + 0.002;
          xs[w].step_s = own + xs[w].allreduce_s;
        }
    for (int w = 0; w < 4; w++) {
      detector_observe(d, w, s, &xs[w]);
      detector_heartbeat(d, w, t);
    }
    detector_tick(d, t);
    if (detected < 0 && find_anomaly("straggler", 1)) detected = s;
  }
  CHECK(detected == 35, "straggler detected at step %lld (slow from 31, m = 5)", (long long)detected);
  CHECK(find_anomaly("straggler", 0) == NULL && find_anomaly("straggler", 2) == NULL &&
            find_anomaly("straggler", 3) == NULL,
        "only the slow worker is a straggler");
  const cap_action *ev = find_action(DET_ACT_EVICT, "straggler");
  CHECK(ev && ev->worker == 1 && ev->step == 37, "evicted after 3 reports, at step %lld", ev ? ev->step : -1);
  CHECK(find_action(DET_ACT_ALERT, "straggler") != NULL, "alerts before the eviction");
  printf("straggler (%s): slow from step 31, detected at step %lld (%lld steps), evicted at step %lld\n",
         wait ? "others wait in the all-reduce" : "others unaffected", (long long)detected, (long long)detected - 30,
         ev ? ev->step : -1);
  /* the eviction happened: the replacement starts clean */
  detector_worker_gone(d, 1);
  cap_reset();
  run_clean(d, 4, 46, 60, &t);
  CHECK(count_anomalies(NULL) == 0, "replacement is not a straggler");
  detector_destroy(d);
}

static void test_hang(void) {
  reset_policies();
  cap_reset();
  detector *d = make(0, 0);
  if (!d) return;
  double t = 0;
  run_clean(d, 3, 1, 20, &t);
  double stuck_at = t; /* worker 0 makes no more steps; its heartbeat goes on */
  double detected = -1;
  for (int64_t s = 21; s <= 400 && detected < 0; s++) {
    t += DT;
    for (int w = 0; w < 3; w++) {
      if (w) {
        detector_sample x = healthy(s, t);
        detector_observe(d, w, s, &x);
      }
      detector_heartbeat(d, w, t);
    }
    detector_tick(d, t);
    const cap_event *a = find_anomaly("hang", 0);
    if (a) detected = t;
  }
  double lat = detected - stuck_at;
  CHECK(detected > 0 && lat > 60 && lat <= 61, "hang detected %.2f s after the last step (T = 60)", lat);
  CHECK(find_action(DET_ACT_EVICT, "hang") && find_action(DET_ACT_EVICT, "hang")->worker == 0, "hang -> evict 0");
  CHECK(find_anomaly("dead", -2) == NULL, "not dead: the heartbeat lives");
  printf("hang: detected %.2f s after worker 0's last step (T = 60 s, ticks every %.2f s)\n", lat, DT);
  detector_destroy(d);

  /* every replica stalls (heartbeats alive): a fleet-wide hang, no eviction */
  cap_reset();
  d = make(0, 0);
  if (!d) return;
  t = 0;
  run_clean(d, 3, 1, 20, &t);
  for (int i = 0; i < 300; i++) { /* a timer tick each 0.25 s, heartbeats only */
    t += DT;
    for (int w = 0; w < 3; w++) detector_heartbeat(d, w, t);
    detector_tick(d, t);
  }
  CHECK(find_anomaly("hang", -1) != NULL, "fleet stall reported as worker -1");
  CHECK(count_anomalies("hang") == 1, "once (%d)", count_anomalies("hang"));
  CHECK(find_action(DET_ACT_EVICT, NULL) == NULL && find_action(DET_ACT_ALERT, "hang") != NULL, "stall -> alert");
  detector_destroy(d);
}

static void test_dead(void) {
  reset_policies();
  cap_reset();
  detector *d = make(0, 0);
  if (!d) return;
  double t = 0;
  run_clean(d, 4, 1, 20, &t);
  double lost = t, detected = -1;
  for (int64_t s = 21; s <= 200 && detected < 0; s++) { /* worker 3: no step, no heartbeat */
    t += DT;
    for (int w = 0; w < 3; w++) {
      detector_sample x = healthy(s, t);
      detector_observe(d, w, s, &x);
      detector_heartbeat(d, w, t);
    }
    detector_tick(d, t);
    if (find_anomaly("dead", 3)) detected = t;
  }
  double lat = detected - lost;
  CHECK(detected > 0 && lat > 15 && lat <= 16, "dead detected %.2f s after the last heartbeat (T = 15)", lat);
  CHECK(find_anomaly("hang", 3) == NULL, "a dead worker is not reported as hung");
  /* the shipped policy evicts a replica without a heartbeat: a stopped
   * (SIGSTOP) process never exits by itself */
  CHECK(nactions == 1 && find_action(DET_ACT_EVICT, "dead") != NULL, "dead -> evict (%d actions)", nactions);
  int logged = 0;
  for (int i = 0; i < nevents; i++) logged += events[i].type == DET_EV_ACTION && strcmp(events[i].action, "evict") == 0;
  CHECK(logged == 1, "the evict decision is an event");
  printf("dead: detected %.2f s after worker 3's last heartbeat (T = 15 s)\n", lat);
  detector_destroy(d);
}

/* The host's own loop stalled 30 s (the operator SIGSTOPped): its first
 * tick after it runs before the heartbeats that came meanwhile are read.
 * That is not 30 s of the workers' silence (before: every one dead and
 * evicted); a worker silent before the stall and after it is still found
 * dead, and a host whose ticks only lag (2.5 s apart) still finds it. */
static void test_host_stalled(void) {
  reset_policies();
  cap_reset();
  detector *d = make(0, 0);
  if (!d) return;
  double t = 0;
  run_clean(d, 3, 1, 20, &t);
  double silent_from = t; /* worker 2: nothing from here on */
  for (int i = 0; i < 40; i++) { /* 10 s; then the host stops for 30 s */
    t += DT;
    for (int w = 0; w < 2; w++) detector_heartbeat(d, w, t);
    detector_tick(d, t);
  }
  t += 30;
  detector_tick(d, t);
  CHECK(find_anomaly("dead", 0) == NULL && find_anomaly("dead", 1) == NULL, "no worker dead for the host's stall");
  CHECK(find_anomaly("dead", 2) == NULL, "worker 2: 10 s silent before the stall, under DEAD_T");
  double detected = -1;
  for (int i = 1; i <= 20 && detected < 0; i++) { /* 2.5 s ticks: a lagging host */
    t += 2.5;
    for (int w = 0; w < 2; w++) detector_heartbeat(d, w, t);
    detector_tick(d, t);
    if (find_anomaly("dead", 2)) detected = t;
  }
  CHECK(detected > 0, "worker 2 found dead after the stall, on ticks 2.5 s apart");
  CHECK(find_anomaly("dead", 0) == NULL && find_anomaly("dead", 1) == NULL, "the others never dead");
  printf("host stalled 30 s: no worker dead for it; one silent 10 s before it dead %.1f s after it\n",
         detected - (silent_from + 40));
  detector_destroy(d);
}

/* The SIGSTOP race: a frozen process's last STEP line at t refreshed its
 * heartbeat, one more heartbeat came at t + 0.4 s, then silence. With
 * HANG_T and DEAD_T equal (3 s) the hang rule once saw "no step for 3 s,
 * heartbeat not yet lapsed" and called it hung. It must be dead, never hung,
 * whatever the thresholds. Ticks every 0.05 s to hit every window. */
static void test_stopped_is_dead_not_hung(void) {
  char *r = shipped("rules.lua"), *a = shipped("actions.lua");
  char *h = strstr(r, "local HANG_T = "), *dd = strstr(r, "local DEAD_T = ");
  CHECK(h && dd, "rules.lua sets HANG_T and DEAD_T");
  if (!h || !dd) return;
  memcpy(h + strlen("local HANG_T = "), "3 ", 2); /* "60" -> "3 " */
  memcpy(dd + strlen("local DEAD_T = "), "3 ", 2); /* "15" -> "3 " */
  write_file(pdir, "rules.lua", r);
  write_file(pdir, "actions.lua", a);
  free(r);
  free(a);
  cap_reset();
  detector *d = make(0, 0);
  if (!d) return;
  double t = 0;
  run_clean(d, 2, 1, 20, &t);
  t += DT; /* worker 1's last step, and its line refreshes the heartbeat */
  for (int w = 0; w < 2; w++) {
    detector_sample x = healthy(21, t);
    detector_observe(d, w, 21, &x);
    detector_heartbeat(d, w, t);
  }
  double last_hb = t + 0.4, detected = -1;
  int64_t s = 22;
  for (int i = 1; i <= 200; i++) { /* 10 s */
    double now = t + 0.05 * i;
    if (i == 8) detector_heartbeat(d, 1, last_hb); /* arrives at t + 0.4 */
    if (i % 5 == 0) { /* worker 0 goes on, a step every 0.25 s */
      detector_sample x = healthy(s, now);
      detector_observe(d, 0, s++, &x);
    }
    detector_heartbeat(d, 0, now);
    detector_tick(d, now);
    if (detected < 0 && find_anomaly("dead", 1)) detected = now;
  }
  double lat = detected - last_hb;
  CHECK(find_anomaly("hang", 1) == NULL && find_anomaly("hang", -1) == NULL, "a stopped worker is never hung");
  CHECK(detected > 0 && lat > 3 && lat <= 3.1, "dead %.2f s after its last heartbeat (T = 3)", lat);
  printf("stopped after a step (HANG_T = DEAD_T = 3 s): dead %.2f s after the last heartbeat, %d hang report(s)\n", lat,
         count_anomalies("hang"));
  detector_destroy(d);
  reset_policies();
}

static void test_divergence(void) {
  reset_policies();
  cap_reset();
  detector *d = make(0, 0);
  if (!d) return;
  double t = 0;
  run_clean(d, 3, 1, 39, &t);
  t += DT;
  for (int w = 0; w < 2; w++) { /* step 40: workers 0 and 1 agree; 2 has not reported yet */
    detector_sample x = healthy(40, t);
    x.has_checksum = 1;
    x.checksum = 0x1234;
    detector_observe(d, w, 40, &x);
  }
  detector_tick(d, t);
  CHECK(count_anomalies("divergence") == 0, "not before every replica reported the step");
  detector_sample x = healthy(40, t);
  x.has_checksum = 1;
  x.checksum = 0x1234 ^ (1u << 7); /* a flipped bit */
  detector_observe(d, 2, 40, &x);
  detector_tick(d, t);
  const cap_event *a = find_anomaly("divergence", 2);
  CHECK(a && a->step == 40 && count_anomalies("divergence") == 1, "worker 2 diverged at step 40");
  const cap_action *ev = find_action(DET_ACT_EVICT, "divergence");
  CHECK(ev && ev->worker == 2, "the minority is evicted");
  printf("divergence: checksum flipped at step 40, detected at step 40 (within one checksum interval), evict worker %d\n",
         ev ? ev->worker : -9);
  detector_destroy(d);

  /* two replicas that disagree: no majority -> the fleet rolls back */
  cap_reset();
  d = make(0, 0);
  if (!d) return;
  t = 0;
  run_clean(d, 2, 1, 19, &t);
  for (int w = 0; w < 2; w++) {
    detector_sample y = healthy(20, t + DT);
    y.has_checksum = 1;
    y.checksum = 100 + (uint32_t)w;
    detector_observe(d, w, 20, &y);
  }
  detector_tick(d, t + DT);
  CHECK(find_anomaly("divergence", -1) != NULL && count_anomalies("divergence") == 1, "no majority: fleet anomaly");
  const cap_action *rb = find_action(DET_ACT_ROLLBACK, "divergence");
  CHECK(rb && rb->step == 19, "no majority -> rollback to 19");
  detector_destroy(d);
}

static void test_spike_and_grad(void) {
  reset_policies();
  cap_reset();
  detector *d = make(0, 0);
  if (!d) return;
  double t = 0;
  run_clean(d, 4, 1, 100, &t);
  t += DT;
  for (int w = 0; w < 4; w++) {
    detector_sample x = healthy(101, t);
    if (w == 0) x.loss *= 3;
    if (w == 3) x.grad_norm *= 100;
    detector_observe(d, w, 101, &x);
    detector_heartbeat(d, w, t);
  }
  detector_tick(d, t);
  const cap_event *sp = find_anomaly("loss_spike", 0);
  CHECK(sp && sp->step == 101, "loss spike on worker 0 at step 101");
  CHECK(find_action(DET_ACT_ALERT, "loss_spike") != NULL, "loss_spike -> alert");
  CHECK(find_anomaly("grad_explosion", 3) != NULL, "gradient explosion on worker 3");
  const cap_action *sk = find_action(DET_ACT_SKIP_UPDATE, "grad_explosion");
  CHECK(sk && sk->worker == 3 && sk->step == 101, "grad_explosion -> skip_update of step 101");
  CHECK(count_anomalies(NULL) == 2, "nothing else (%d)", count_anomalies(NULL));
  printf("loss_spike: 3x loss at step 101 detected at step 101: %s\n", sp ? sp->detail : "-");
  detector_destroy(d);
}

/* --- hot reload --- */

static void spike(detector *d, int w, int64_t s, double *t) {
  *t += DT;
  for (int k = 0; k < 4; k++) {
    detector_sample x = healthy(s, *t);
    if (k == w) x.loss *= 4;
    detector_observe(d, k, s, &x);
    detector_heartbeat(d, k, *t);
  }
  detector_tick(d, *t);
}

static void test_reload(void) {
  reset_policies();
  cap_reset();
  detector *d = make(0, 0);
  if (!d) return;
  double t = 0;
  run_clean(d, 4, 1, 60, &t);
  spike(d, 0, 61, &t);
  CHECK(find_action(DET_ACT_ALERT, "loss_spike") && !find_action(DET_ACT_CHECKPOINT_NOW, NULL), "before: alert");

  /* 1. a rewritten policy changes behaviour */
  char *a2 = patched("actions.lua", "A.loss_spike = \"alert\"", "A.loss_spike = \"checkpoint_now\"");
  write_file(pdir, "actions.lua", a2);
  free(a2);
  cap_reset();
  CHECK(detector_reload(d) == 0, "reload: %s", tr_error());
  CHECK(find_event(DET_EV_RELOAD, "actions.lua in force") != NULL, "reload event");
  run_clean(d, 4, 62, 80, &t);
  spike(d, 1, 81, &t);
  CHECK(find_action(DET_ACT_CHECKPOINT_NOW, "loss_spike") != NULL, "after the edit: checkpoint_now");

  /* 2. a syntax error: the edited policy stays in force, the event names file and line */
  char *bad = patched("actions.lua", "A.grad_explosion = \"skip_update\"", "A.grad_explosion = = \"skip_update\"");
  int bad_line = 1;
  for (const char *p = bad; p < strstr(bad, "= = "); p++) bad_line += *p == '\n';
  write_file(pdir, "actions.lua", bad);
  free(bad);
  cap_reset();
  int rc = detector_reload(d);
  const cap_event *f = find_event(DET_EV_RELOAD_FAILED, NULL);
  CHECK(rc == TR_ELUA && f, "syntax error refused (rc %d)", rc);
  CHECK(f && strstr(f->file, "actions.lua") && f->line == bad_line, "event names actions.lua:%d (got %s:%d)",
        bad_line, f ? f->file : "-", f ? f->line : -1);
  CHECK(f && strstr(f->detail, "previous version stays in force"), "event says the old version stays: %s",
        f ? f->detail : "-");
  CHECK(strstr(tr_error(), "actions.lua:") != NULL, "tr_error names the file: %s", tr_error());
  run_clean(d, 4, 82, 100, &t);
  spike(d, 2, 101, &t);
  CHECK(find_action(DET_ACT_CHECKPOINT_NOW, "loss_spike") != NULL, "the edited policy still in force");
  printf("reload, syntax error: %s\n", f ? f->detail : "-");

  /* 3. a runtime error in a rule (only on a worker without steps: the dry run finds it) */
  char *r3 = patched("rules.lua", "return R\n",
                     "function R.fragile(w)\n  if w.loss > 100 then return { kind = 'huge' } end\nend\nreturn R\n");
  int r3_line = 1;
  for (const char *p = r3; p < strstr(r3, "  if w.loss > 100"); p++) r3_line += *p == '\n';
  write_file(pdir, "rules.lua", r3);
  free(r3);
  cap_reset();
  rc = detector_reload(d);
  f = find_event(DET_EV_RELOAD_FAILED, NULL);
  CHECK(rc == TR_ELUA && f && strstr(f->file, "rules.lua") && f->line == r3_line,
        "runtime error refused with rules.lua:%d (got %s:%d: %s)", r3_line, f ? f->file : "-", f ? f->line : -1,
        f ? f->detail : "-");
  CHECK(f && strstr(f->detail, "dry run of rule 'fragile'"), "the event says which rule: %s", f ? f->detail : "-");
  printf("reload, runtime error: %s\n", f ? f->detail : "-");
  /* 4. a runtime error at load time (an undefined global at the top level) */
  char *r4 = patched("rules.lua", "local R = {}\n", "local R = {}\nlocal threshold = THRESHOLD * 2\n");
  write_file(pdir, "rules.lua", r4);
  free(r4);
  cap_reset();
  rc = detector_reload(d);
  f = find_event(DET_EV_RELOAD_FAILED, "undefined global 'THRESHOLD'");
  CHECK(rc == TR_ELUA && f && f->line > 0, "top-level error refused with a line (%d)", f ? f->line : -1);
  /* the old rules still work */
  cap_reset();
  t += DT;
  detector_sample x = healthy(102, t);
  x.loss = NAN;
  detector_observe(d, 0, 102, &x);
  detector_tick(d, t);
  CHECK(find_anomaly("nan_or_inf_loss", 0) != NULL, "previous rules still in force");
  CHECK(find_anomaly("huge", -2) == NULL, "the refused rule does not run");

  /* 5. state survives reloads (with actions.lua repaired first) */
  char *fixed = patched("actions.lua", "A.loss_spike = \"alert\"", "A.loss_spike = \"checkpoint_now\"");
  write_file(pdir, "actions.lua", fixed);
  free(fixed);
  char *r5 = patched("rules.lua", "return R\n",
                     "function R.counter(w, fleet, state)\n  if w.id == 0 then state.count = (state.count or 0) + 1 end\n"
                     "  if state.count == 3 then return { kind = 'third_tick' } end\n"
                     "  if state.count == 6 then return { kind = 'sixth_tick' } end\nend\nreturn R\n");
  write_file(pdir, "rules.lua", r5);
  CHECK(detector_reload(d) == 0, "counter rule loads: %s", tr_error());
  cap_reset();
  detector_tick(d, t);
  detector_tick(d, t);
  CHECK(detector_reload(d) == 0, "reload again");
  detector_tick(d, t);
  CHECK(find_anomaly("third_tick", 0) != NULL, "state carried across a reload");

  /* 6. a refused file's top level cannot touch the state in force */
  char *r6 = patched("rules.lua", "return R\n",
                     "state.count = -1000\n"
                     "function R.broken(w) return { kind = UNDEFINED_KIND } end\nreturn R\n");
  write_file(pdir, "rules.lua", r6);
  free(r6);
  CHECK(detector_reload(d) == TR_ELUA, "the broken rules.lua is refused");
  cap_reset();
  for (int i = 0; i < 3; i++) detector_tick(d, t);
  CHECK(find_anomaly("sixth_tick", 0) != NULL, "the rule in force counted on: the refused file's state.count = "
                                               "-1000 went to a scratch table");
  write_file(pdir, "rules.lua", r5);
  free(r5);
  detector_destroy(d);
}

/* A restart of every replica from a checkpoint (restart_all, all dead):
 * their steps come again, and so may a fleet-wide anomaly (worker -1), not
 * only the per-worker ones. */
static void test_fleet_anomaly_after_restart(void) {
  char *r = patched("rules.lua", "return R\n",
                    "function R.fleet_mark(w)\n"
                    "  if w.id == 0 and w.step == 8 then return { kind = 'fleet_mark', worker = -1, step = 8 } end\n"
                    "end\nreturn R\n");
  write_file(pdir, "rules.lua", r);
  free(r);
  cap_reset();
  detector *d = make(0, 0);
  if (!d) return;
  double t = 0;
  run_clean(d, 2, 1, 8, &t);
  CHECK(count_anomalies("fleet_mark") == 1, "the fleet-wide anomaly at step 8 (%d)", count_anomalies("fleet_mark"));
  detector_worker_gone(d, 0);
  CHECK(count_anomalies("fleet_mark") == 1, "one replica gone: still once");
  detector_worker_gone(d, 1);
  run_clean(d, 2, 6, 10, &t); /* both restarted from a checkpoint at step 5 */
  CHECK(count_anomalies("fleet_mark") == 2, "after every replica restarted it is raised again (%d)",
        count_anomalies("fleet_mark"));
  detector_destroy(d);
  reset_policies();
}

/* --- runaway rules, sandbox, memory --- */

static void test_budget(void) {
  char *r = patched("rules.lua", "return R\n",
                    "function R.spin(w)\n  if w.step and w.step >= 30 then\n    while true do end\n  end\nend\n"
                    "function R.sneaky(w)\n  if w.step and w.step >= 30 then\n"
                    "    while true do pcall(function() while true do end end) end\n  end\nend\nreturn R\n");
  int spin_line = 1;
  for (const char *p = r; p < strstr(r, "    while true do end"); p++) spin_line += *p == '\n';
  write_file(pdir, "rules.lua", r);
  free(r);
  char *a = shipped("actions.lua");
  write_file(pdir, "actions.lua", a);
  free(a);
  cap_reset();
  detector *d = make(20000, 0);
  CHECK(d != NULL, "a rule that loops only from step 30 passes its dry run");
  if (!d) return;
  double t = 0;
  run_clean(d, 2, 1, 29, &t);
  CHECK(count_events(DET_EV_RULE_ERROR) == 0, "no errors before step 30");
  double t0 = tr_now();
  run_clean(d, 2, 30, 31, &t);
  double el = tr_now() - t0;
  const cap_event *e = NULL;
  for (int i = 0; i < nevents && !e; i++)
    if (events[i].type == DET_EV_RULE_ERROR && strcmp(events[i].rule, "spin") == 0) e = &events[i];
  char where[64];
  snprintf(where, sizeof where, "rules.lua:%d:", spin_line);
  CHECK(e && e->line == spin_line && strstr(e->detail, where) && strstr(e->detail, "instruction budget"),
        "the loop is stopped, the event names %s (%d: %s)", where, e ? e->line : -1, e ? e->detail : "-");
  int sneaky = 0;
  for (int i = 0; i < nevents; i++) sneaky += events[i].type == DET_EV_RULE_ERROR && !strcmp(events[i].rule, "sneaky");
  CHECK(sneaky >= 1, "a loop around pcall cannot swallow the budget");
  /* later ticks still work: a NaN is still found */
  t += DT;
  detector_sample x = healthy(32, t);
  x.loss = NAN;
  detector_observe(d, 1, 32, &x);
  detector_tick(d, t);
  CHECK(find_anomaly("nan_or_inf_loss", 1) != NULL, "other rules keep working");
  CHECK(find_event(DET_EV_RULE_ERROR, "disabled") != NULL, "disabled after 3 ticks over budget");
  int before = count_events(DET_EV_RULE_ERROR);
  run_clean(d, 2, 33, 40, &t);
  CHECK(count_events(DET_EV_RULE_ERROR) == before, "a disabled rule costs nothing more");
  printf("budget: 2 runaway rules stopped (budget 20000 instructions); 2 ticks with them took %.1f ms\n", el * 1e3);
  detector_destroy(d);
}

static void test_sandbox(void) {
  const char *probe =
      "local R = {}\n"
      "local holes = {}\n"
      "for _, name in ipairs({'io', 'require', 'load', 'loadstring', 'dofile', 'loadfile', 'package', 'debug',\n"
      "                       'collectgarbage', 'coroutine', 'setmetatable', 'getmetatable', 'rawset'}) do\n"
      "  if rawget(_G, name) ~= nil then holes[#holes + 1] = name end\n"
      "end\n"
      "if os.execute ~= nil or os.getenv ~= nil or os.remove ~= nil then holes[#holes + 1] = 'os' end\n"
      "if type(os.time) ~= 'function' or type(os.clock) ~= 'function' then holes[#holes + 1] = 'os.time' end\n"
      "if string.dump ~= nil then holes[#holes + 1] = 'string.dump' end\n"
      "local ok, err = pcall(function() return io end)\n"
      "if ok or not err:find(\"undefined global 'io'\") then holes[#holes + 1] = 'undefined-read' end\n"
      "math.floor = nil -- a copy: the host's math is untouched\n"
      "function R.probe(w, fleet)\n"
      "  if w.id ~= 0 then return nil end\n"
      "  local ok1, e1 = pcall(function() w.loss = 1 end)\n"
      "  local ok2, e2 = pcall(function() fleet.size = 3 end)\n"
      "  local ok3, e3 = pcall(function() return w.losss end)\n"
      "  local ok4 = pcall(function() return w:median('no_such_metric') end)\n"
      "  if ok1 or not e1:find('read%-only') then holes[#holes + 1] = 'worker view writable' end\n"
      "  if ok2 or not e2:find('read%-only') then holes[#holes + 1] = 'fleet view writable' end\n"
      "  if ok3 or not e3:find(\"no field 'losss'\") then holes[#holes + 1] = 'misspelled field' end\n"
      "  if ok4 then holes[#holes + 1] = 'unknown metric' end\n"
      "  if #holes > 0 then return { kind = 'sandbox_hole', detail = table.concat(holes, ' ') } end\n"
      "  return { kind = 'sandbox_ok', detail = 'sealed' }\n"
      "end\n"
      "return R\n";
  write_file(pdir, "rules.lua", probe);
  char *a = shipped("actions.lua");
  write_file(pdir, "actions.lua", a);
  free(a);
  cap_reset();
  detector *d = make(0, 0);
  CHECK(d != NULL, "probe rules load: %s", d ? "" : tr_error());
  if (!d) return;
  double t = 0;
  run_clean(d, 2, 1, 1, &t);
  const cap_event *hole = find_anomaly("sandbox_hole", -2);
  CHECK(find_anomaly("sandbox_ok", 0) != NULL && !hole, "sandbox sealed%s%s", hole ? ": " : "",
        hole ? hole->detail : "");
  detector_destroy(d);

  /* a file that reaches for io at load time is refused, naming the line */
  write_file(pdir, "rules.lua", "local R = {}\n\nlocal f = io.open('/etc/passwd')\nreturn R\n");
  cap_reset();
  d = make(0, 0);
  CHECK(d == NULL && strstr(tr_error(), "rules.lua:3: undefined global 'io'"), "io at load: %s", tr_error());
  detector_destroy(d);
  write_file(pdir, "rules.lua", "return { r = function(w) return os.execute('true') end }\n");
  d = make(0, 0);
  CHECK(d == NULL && strstr(tr_error(), "rules.lua:1:"), "os.execute is absent: %s", tr_error());
  detector_destroy(d);
  write_file(pdir, "rules.lua", "return { r = function(w) return require('os') end }\n");
  d = make(0, 0);
  CHECK(d == NULL && strstr(tr_error(), "undefined global 'require'"), "require is absent: %s", tr_error());
  detector_destroy(d);
  write_file(pdir, "rules.lua", "return { r = function(w) return load('return 1')() end }\n");
  d = make(0, 0);
  CHECK(d == NULL && strstr(tr_error(), "undefined global 'load'"), "load is absent: %s", tr_error());
  detector_destroy(d);
  /* bad shapes: a rule that is not a function, an action that does not exist */
  write_file(pdir, "rules.lua", "return { r = 3 }\n");
  d = make(0, 0);
  CHECK(d == NULL && strstr(tr_error(), "rule 'r' is a number"), "non-function rule: %s", tr_error());
  detector_destroy(d);
  reset_policies();
  write_file(pdir, "actions.lua", "return { straggler = 'evict', hang = 'evikt' }\n");
  d = make(0, 0);
  CHECK(d == NULL && strstr(tr_error(), "unknown action"), "misspelled action: %s", tr_error());
  detector_destroy(d);
  write_file(pdir, "actions.lua", "return { straggler = function(a) return { action = 'evict', wrker = 1 } end }\n");
  d = make(0, 0);
  CHECK(d == NULL && strstr(tr_error(), "unknown field 'wrker'"), "misspelled action field: %s", tr_error());
  detector_destroy(d);
  write_file(pdir, "rules.lua", "return { r = function(w) return { knd = 'x' } end }\n");
  reset_policies();
  write_file(pdir, "rules.lua", "return { r = function(w) return { kind = 'x', severty = 'info' } end }\n");
  d = make(0, 0);
  CHECK(d == NULL && strstr(tr_error(), "unknown field 'severty'"), "misspelled anomaly field: %s", tr_error());
  detector_destroy(d);
  reset_policies();
}

static void test_memory_limit(void) {
  char *r = patched("rules.lua", "return R\n",
                    "function R.hog(w)\n  if w.step and w.step >= 30 then local s = string.rep('x', 1 << 25) end\nend\n"
                    "return R\n");
  write_file(pdir, "rules.lua", r);
  free(r);
  cap_reset();
  detector *d = make(0, (size_t)16 << 20);
  CHECK(d != NULL, "create with 16 MiB");
  if (!d) return;
  double t = 0;
  run_clean(d, 2, 1, 31, &t);
  CHECK(find_event(DET_EV_RULE_ERROR, "not enough memory") != NULL,
        "a 32 MiB string (under string.rep's own bound, over the 16 MiB cap) is refused");
  cap_reset();
  t += DT;
  detector_sample x = healthy(32, t);
  x.loss = NAN;
  detector_observe(d, 0, 32, &x);
  detector_tick(d, t);
  CHECK(find_anomaly("nan_or_inf_loss", 0) != NULL, "the detector goes on");
  detector_destroy(d);
  reset_policies();
}

static void test_misc(void) {
  reset_policies();
  cap_reset();
  detector *d = make(0, 0);
  if (!d) return;
  double t = 0;
  run_clean(d, 3, 1, 30, &t);
  /* callbacks may not re-enter tick */
  reentry_d = d;
  t += DT;
  detector_sample x = healthy(31, t);
  x.loss = NAN;
  detector_observe(d, 0, 31, &x);
  detector_tick(d, t);
  reentry_d = NULL;
  CHECK(reentry_rc == TR_ESTATE, "tick from a callback refused (%d)", reentry_rc);
  CHECK(detector_observe(d, 99, 1, &x) == TR_EINVAL && detector_heartbeat(d, -1, 0) == TR_EINVAL, "bad worker ids");

  /* the REPL's copies, in another Lua state */
  lua_State *L = lua_host_new();
  CHECK(detector_push_worker(d, L, 0, 10) == 0 && lua_istable(L, -1), "push_worker");
  lua_getfield(L, -1, "step");
  CHECK(lua_tointeger(L, -1) == 31, "worker step");
  lua_getfield(L, -2, "series");
  lua_getfield(L, -1, "loss");
  CHECK(lua_rawlen(L, -1) == 10, "10 losses");
  lua_settop(L, 0);
  CHECK(detector_push_worker(d, L, 9, 0) == TR_EINVAL && lua_isnil(L, -1), "unknown worker -> nil");
  lua_settop(L, 0);
  CHECK(detector_push_fleet(d, L) == 0, "push_fleet");
  lua_getfield(L, -1, "size");
  CHECK(lua_tointeger(L, -1) == 3, "fleet size");
  lua_getfield(L, -2, "median");
  lua_getfield(L, -1, "step_s");
  CHECK(lua_tonumber(L, -1) > 0.05 && lua_tonumber(L, -1) < 0.2, "fleet median step time %g", lua_tonumber(L, -1));
  lua_settop(L, 0);
  CHECK(detector_push_anomalies(d, L, 5) == 0 && lua_rawlen(L, -1) == 1, "one anomaly kept");
  lua_rawgeti(L, -1, 1);
  lua_getfield(L, -1, "action");
  CHECK(strcmp(lua_tostring(L, -1), "rollback") == 0, "anomaly record has its action");
  lua_close(L);

  /* events as JSON lines */
  detector_event e = {.kind = "anomaly", .time = 1.5, .step = 7, .worker = 2, .rule = "r\"q", .detail = "a\nb\\"};
  char buf[256];
  int n = detector_event_json(&e, buf, sizeof buf);
  CHECK(n == (int)strlen(buf) &&
            strcmp(buf, "{\"time\":1.500,\"step\":7,\"worker\":2,\"kind\":\"anomaly\",\"rule\":\"r\\\"q\",\"detail\":"
                        "\"a\\nb\\\\\"}") == 0,
        "json: %s", buf);
  char small[10];
  CHECK(detector_event_json(&e, small, sizeof small) == n && strlen(small) == 9, "truncates safely");
  detector_destroy(d);
}

/* --- inotify --- */

typedef struct {
  struct event_base *base;
  int want_reloads;
} loop_ctx;

static void loop_stop(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  event_base_loopexit(arg, NULL);
}

/* Runs base until `want` more reload events arrived or `bound` seconds passed. */
static int wait_reloads(struct event_base *base, int want, double bound) {
  int start = count_events(DET_EV_RELOAD) + count_events(DET_EV_RELOAD_FAILED);
  double t0 = tr_now();
  while (count_events(DET_EV_RELOAD) + count_events(DET_EV_RELOAD_FAILED) - start < want && tr_now() - t0 < bound) {
    struct timeval tv = {0, 20000};
    struct event *ev = evtimer_new(base, loop_stop, base);
    evtimer_add(ev, &tv);
    event_base_dispatch(base);
    event_free(ev);
  }
  return count_events(DET_EV_RELOAD) + count_events(DET_EV_RELOAD_FAILED) - start;
}

static void test_watch(void) {
  reset_policies();
  cap_reset();
  detector *d = make(0, 0);
  struct event_base *base = event_base_new();
  if (!d || !base) return;
  CHECK(detector_watch(d, base) == 0, "watch: %s", tr_error());
  CHECK(detector_watch(d, base) == TR_ESTATE, "twice refused");
  double t = 0;
  run_clean(d, 4, 1, 60, &t);

  /* an editor's rename-save: write a temporary file, rename it over actions.lua */
  char *a2 = patched("actions.lua", "A.loss_spike = \"alert\"", "A.loss_spike = \"checkpoint_now\"");
  char tmp[1024], path[1024];
  snprintf(tmp, sizeof tmp, "%s/actions.lua.swp~", pdir);
  snprintf(path, sizeof path, "%s/actions.lua", pdir);
  FILE *f = fopen(tmp, "w");
  fputs(a2, f);
  fclose(f);
  free(a2);
  cap_reset();
  double t0 = tr_now();
  rename(tmp, path);
  int got = wait_reloads(base, 1, 10);
  double lat = tr_now() - t0;
  CHECK(got == 1 && find_event(DET_EV_RELOAD, "actions.lua in force"), "rename-save reloaded (%d events)", got);
  spike(d, 0, 61, &t);
  CHECK(find_action(DET_ACT_CHECKPOINT_NOW, "loss_spike") != NULL, "new behaviour after the rename-save");
  printf("watch: a rename-save was in force %.0f ms later (debounce 100 ms)\n", lat * 1e3);

  /* move-away-and-create (vim with backupcopy=no), written in three bursts: one reload */
  char *a3 = patched("actions.lua", "A.loss_spike = \"alert\"", "A.loss_spike = \"ignore\"");
  char bak[1024];
  snprintf(bak, sizeof bak, "%s/actions.lua~", pdir);
  cap_reset();
  rename(path, bak);
  f = fopen(path, "w");
  size_t half = strlen(a3) / 2;
  fwrite(a3, 1, half, f);
  fflush(f);
  fwrite(a3 + half, 1, strlen(a3) - half, f);
  fclose(f);
  unlink(bak);
  free(a3);
  got = wait_reloads(base, 1, 10);
  CHECK(got >= 1 && find_event(DET_EV_RELOAD, "actions.lua in force"), "create-save reloaded");
  printf("watch: create-save gave %d reload event(s)\n", count_events(DET_EV_RELOAD));

  /* a broken save through the watcher: the event names the line, the old stays */
  cap_reset();
  write_file(pdir, "rules.lua", "local R = {}\nfunction R.x(w)\n  return w.step +\nend\nreturn R\n");
  got = wait_reloads(base, 1, 10);
  const cap_event *fe = find_event(DET_EV_RELOAD_FAILED, NULL);
  CHECK(got == 1 && fe && fe->line == 4 && strstr(fe->file, "rules.lua"), "broken save: %s:%d %s",
        fe ? fe->file : "-", fe ? fe->line : -1, fe ? fe->detail : "-");
  cap_reset();
  t += DT;
  detector_sample x = healthy(62, t);
  x.loss = NAN;
  detector_observe(d, 3, 62, &x);
  detector_tick(d, t);
  CHECK(find_anomaly("nan_or_inf_loss", 3) != NULL, "old rules in force after the broken save");
  /* an unrelated file changing does not reload */
  cap_reset();
  write_file(pdir, "notes.txt", "hello\n");
  wait_reloads(base, 1, 0.5); /* a late reload would only make this pass wrongly, never fail */
  CHECK(count_events(DET_EV_RELOAD) == 0, "unrelated files ignored");
  detector_destroy(d); /* before the base */
  event_base_free(base);
  reset_policies();
}

/* --- Prometheus --- */

typedef struct {
  struct event_base *base;
  int code;
  char *body;
} http_ctx;

static void http_done(struct evhttp_request *req, void *arg) {
  http_ctx *c = arg;
  if (req) {
    c->code = evhttp_request_get_response_code(req);
    struct evbuffer *b = evhttp_request_get_input_buffer(req);
    size_t n = evbuffer_get_length(b);
    c->body = malloc(n + 1);
    evbuffer_remove(b, c->body, n);
    c->body[n] = 0;
  }
  event_base_loopexit(c->base, NULL);
}

static int http_get(struct event_base *base, int port, const char *path, http_ctx *c) {
  memset(c, 0, sizeof *c);
  c->base = base;
  struct evhttp_connection *conn = evhttp_connection_base_new(base, NULL, "127.0.0.1", (ev_uint16_t)port);
  struct evhttp_request *req = evhttp_request_new(http_done, c);
  evhttp_add_header(evhttp_request_get_output_headers(req), "Host", "127.0.0.1");
  evhttp_make_request(conn, req, EVHTTP_REQ_GET, path);
  struct timeval tv = {5, 0};
  event_base_loopexit(base, &tv); /* bound */
  event_base_dispatch(base);
  evhttp_connection_free(conn);
  return c->code;
}

static void test_prom(void) {
  reset_policies();
  cap_reset();
  detector *d = make(0, 0);
  struct event_base *base = event_base_new();
  if (!d || !base) return;
  double t = 0;
  run_clean(d, 3, 1, 40, &t);
  t += DT;
  detector_sample x = healthy(41, t);
  x.loss = NAN; /* NaN must render as NaN */
  detector_observe(d, 2, 41, &x);
  detector_tick(d, t);
  prom_server *off = (prom_server *)1;
  CHECK(prom_serve(base, "127.0.0.1", 0, d, NULL, NULL, &off) == 0 && off == NULL, "port 0 = off");
  prom_server *srv = NULL;
  CHECK(prom_serve(base, "127.0.0.1", PROM_PORT_ANY, d, NULL, NULL, &srv) == 0 && srv, "serve: %s", tr_error());
  if (!srv) return;
  http_ctx c;
  int code = http_get(base, prom_server_port(srv), "/metrics", &c);
  CHECK(code == 200 && c.body, "GET /metrics -> %d", code);
  if (c.body) {
    CHECK(strstr(c.body, "# TYPE transom_steps_total counter\ntransom_steps_total 121\n") != NULL, "steps_total");
    CHECK(strstr(c.body, "transom_loss{worker=\"2\"} NaN\n") != NULL, "NaN rendered");
    CHECK(strstr(c.body, "transom_anomalies_total{kind=\"nan_or_inf_loss\"} 1\n") != NULL, "anomalies by kind");
    CHECK(strstr(c.body, "transom_actions_total{action=\"rollback\"} 1\n") != NULL, "actions by action");
    CHECK(strstr(c.body, "# HELP transom_rss_bytes ") && strstr(c.body, "transom_step_phase_seconds{worker=\"0\",phase=\"forward\"}"),
          "units and phases");
    const char *promtool = access("/usr/bin/promtool", X_OK) == 0 ? "/usr/bin/promtool" : NULL;
    if (!promtool && system("command -v promtool >/dev/null 2>&1") == 0) promtool = "promtool";
    if (promtool) {
      char file[600], cmd[1400];
      snprintf(file, sizeof file, "%s/metrics.txt", pdir);
      FILE *f = fopen(file, "w");
      fputs(c.body, f);
      fclose(f);
      snprintf(cmd, sizeof cmd, "%s check metrics < %s", promtool, file);
      int rc = system(cmd);
      CHECK(rc == 0, "promtool check metrics failed (%d) on:\n%s", rc, c.body);
      printf("prometheus: promtool check metrics accepts the live /metrics (%zu bytes)\n", strlen(c.body));
      unlink(file);
    } else {
      CHECK(!getenv("TRANSOM_REQUIRE_PROMTOOL"), "promtool required but missing");
      printf("prometheus: SKIPPED promtool check (promtool not installed: detector/test_deps.sh installs it)\n");
    }
    free(c.body);
  }
  code = http_get(base, prom_server_port(srv), "/other", &c);
  CHECK(code == 404, "other paths 404 (%d)", code);
  free(c.body);
  prom_server_free(srv);
  detector_destroy(d);
  event_base_free(base);
}

/* --- transom plot --- */

static void test_plot(void) {
  if (system("command -v gnuplot >/dev/null 2>&1") != 0) {
    CHECK(!getenv("TRANSOM_REQUIRE_GNUPLOT"), "gnuplot required but missing");
    printf("plot: SKIPPED (gnuplot not installed: detector/test_deps.sh installs gnuplot-nox)\n");
    return;
  }
  char run[600], path[700];
  snprintf(run, sizeof run, "%s/run", pdir);
  mkdir(run, 0755);
  snprintf(path, sizeof path, "%s/metrics.jsonl", run);
  FILE *f = fopen(path, "w");
  for (int s = 1; s <= 200; s++) {
    for (int w = 0; w < 2; w++)
      fprintf(f, "{\"step\":%d,\"worker\":%d,\"loss\":%.4f,\"grad_norm\":1,\"step_s\":%.5f,\"tokens_per_s\":1000}\n", s, w,
              s == 120 && w == 1 ? NAN : 3 * exp(-s / 50.0) + 0.5, w == 1 && s > 150 ? 0.250 : 0.050);
    if (s % 50 == 0) fprintf(f, "{\"step\":%d,\"val_loss\":%.4f}\n", s, 3 * exp(-s / 50.0) + 0.6);
  }
  fclose(f);
  snprintf(path, sizeof path, "%s/events.jsonl", run);
  f = fopen(path, "w");
  fprintf(f, "{\"time\":1.0,\"step\":120,\"worker\":1,\"kind\":\"anomaly\",\"rule\":\"nan_or_inf_loss\",\"detail\":\"x\"}\n");
  fprintf(f, "{\"time\":1.0,\"step\":119,\"worker\":-1,\"kind\":\"action\",\"action\":\"rollback\",\"detail\":\"x\"}\n");
  fprintf(f, "{\"time\":2.0,\"step\":160,\"worker\":1,\"kind\":\"replica_failed\",\"detail\":\"killed\"}\n");
  fprintf(f, "{\"time\":0.5,\"step\":0,\"worker\":-1,\"kind\":\"start\",\"detail\":\"3 replicas\"}\n");
  fclose(f);
  char out[700];
  snprintf(out, sizeof out, "%s/run.png", run);
  char *argv[] = {run, "-o", out, NULL};
  int rc = plot_main(3, argv);
  size_t n = 0;
  char *png = tr_read_file(out, &n);
  CHECK(rc == 0 && png && n > 1000 && memcmp(png, "\x89PNG", 4) == 0, "plot wrote a PNG (%zu bytes, rc %d)", n, rc);
  free(png);
  /* single-replica metrics (no "worker"), and a missing run */
  snprintf(path, sizeof path, "%s/metrics.jsonl", run);
  f = fopen(path, "w");
  for (int s = 1; s <= 20; s++) fprintf(f, "{\"step\":%d,\"loss\":%.3f,\"lr\":0.001,\"step_s\":0.040}\n", s, 4.0 - s * 0.1);
  fclose(f);
  unlink(out);
  char *argv2[] = {run, NULL};
  char def[700];
  snprintf(def, sizeof def, "%s/run.png", run);
  CHECK(plot_main(1, argv2) == 0 && access(def, F_OK) == 0, "single replica, default output name");
  char missing[700];
  snprintf(missing, sizeof missing, "%s/nope", pdir);
  char *argv3[] = {missing, NULL};
  CHECK(plot_main(1, argv3) == 1, "missing run -> 1");
  char *argv4[] = {NULL};
  CHECK(plot_main(0, argv4) == 2, "no run -> usage");
  unlink(def);
  snprintf(path, sizeof path, "%s/metrics.jsonl", run);
  unlink(path);
  snprintf(path, sizeof path, "%s/events.jsonl", run);
  unlink(path);
  rmdir(run);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  snprintf(pdir, sizeof pdir, "%s/transom-detector-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  if (!mkdtemp(pdir)) {
    perror("mkdtemp");
    return 1;
  }
  double t0 = tr_now();
  test_stats();
  test_clean_run();
  test_nan();
  test_straggler(1);
  test_straggler(0);
  test_hang();
  test_dead();
  test_host_stalled();
  test_stopped_is_dead_not_hung();
  test_divergence();
  test_spike_and_grad();
  test_reload();
  test_fleet_anomaly_after_restart();
  test_budget();
  test_sandbox();
  test_memory_limit();
  test_misc();
  test_watch();
  test_prom();
  test_plot();
  char cmd[700];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", pdir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", pdir);
  printf("test_detector: %.2f s\n", tr_now() - t0);
  return check_report("test_detector");
}
