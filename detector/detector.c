/* detector.c — the detector's engine (see detector.h): life cycle, what the
 * operator feeds in, the tick (every rule over every worker, dedup, policy,
 * callbacks), events and their JSON form, and the copies the REPL reads.
 *
 * The Lua VM, sandbox, loading and the inotify watcher are the policy
 * engine's (core/lua/policy.c); the detector's checks and dry runs live in
 * detector_lua.c, the views in detector_views.c, the Prometheus output in
 * prom.c. Single thread: the operator's event loop.
 */
#include <lauxlib.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "detector_internal.h"
#include "lua_host.h"
#include "util.h"

/* --- names --- */

static const char *const metric_names[] = {
#define DETECTOR_METRIC_NAME(id, name, help, prom, phase) #name,
    DETECTOR_METRICS(DETECTOR_METRIC_NAME)
#undef DETECTOR_METRIC_NAME
};

static const char *const action_names[DET_ACT_COUNT] = {"ignore",      "alert",        "evict",
                                                        "rollback",    "skip_update",  "checkpoint_now"};

const char *detector_metric_name(int metric) { return metric >= 0 && metric < DET_M_COUNT ? metric_names[metric] : NULL; }

int detector_metric_index(const char *name) {
  if (!name) return -1;
  for (int i = 0; i < DET_M_COUNT; i++)
    if (strcmp(name, metric_names[i]) == 0) return i;
  return -1;
}

const char *detector_action_name(detector_action_kind a) {
  return (int)a >= 0 && a < DET_ACT_COUNT ? action_names[a] : "?";
}

int detector_action_index(const char *name) {
  if (!name) return -1;
  for (int i = 0; i < DET_ACT_COUNT; i++)
    if (strcmp(name, action_names[i]) == 0) return i;
  return -1;
}

/* --- events --- */

double det_wall_time(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

void det_emit(detector *d, detector_event *e) {
  if (e->time == 0) e->time = det_wall_time();
  if (d->o.on_event) d->o.on_event(d->o.ud, e);
}

/* Appends to buf like snprintf at offset *k, keeping *k as the length needed. */
static void put(char *buf, size_t n, size_t *k, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void put(char *buf, size_t n, size_t *k, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int w = vsnprintf(*k < n ? buf + *k : NULL, *k < n ? n - *k : 0, fmt, ap);
  va_end(ap);
  if (w > 0) *k += (size_t)w;
}

static void put_str(char *buf, size_t n, size_t *k, const char *key, const char *s) {
  if (!s) return;
  put(buf, n, k, ",\"%s\":\"", key);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') put(buf, n, k, "\\%c", c);
    else if (c == '\n') put(buf, n, k, "\\n");
    else if (c == '\t') put(buf, n, k, "\\t");
    else if (c < 0x20) put(buf, n, k, "\\u%04x", c);
    else put(buf, n, k, "%c", c);
  }
  put(buf, n, k, "\"");
}

int detector_event_json(const detector_event *e, char *buf, size_t n) {
  size_t k = 0;
  if (n) buf[0] = 0;
  put(buf, n, &k, "{\"time\":%.3f,\"step\":%lld,\"worker\":%d", e->time, (long long)e->step, e->worker);
  put_str(buf, n, &k, "kind", e->kind);
  put_str(buf, n, &k, "rule", e->rule);
  put_str(buf, n, &k, "anomaly", e->anomaly);
  put_str(buf, n, &k, "severity", e->severity);
  put_str(buf, n, &k, "action", e->action);
  put_str(buf, n, &k, "file", e->file);
  if (e->line > 0) put(buf, n, &k, ",\"line\":%d", e->line);
  put_str(buf, n, &k, "detail", e->detail ? e->detail : "");
  put(buf, n, &k, "}");
  return (int)k;
}

/* --- life cycle --- */

void detector_opts_default(detector_opts *o) { memset(o, 0, sizeof *o); }

detector *detector_create(const detector_opts *o) {
  detector_opts def;
  if (!o) {
    detector_opts_default(&def);
    o = &def;
  }
  detector *d = calloc(1, sizeof *d);
  if (!d) {
    tr_fail(TR_ENOMEM, "detector: out of memory");
    return NULL;
  }
  d->o = *o;
  int workers = o->max_workers ? o->max_workers : 256, history = o->history ? o->history : 256;
  long budget = o->budget ? o->budget : 200000;
  size_t mem_limit = o->mem_limit ? o->mem_limit : (size_t)64 << 20;
  if (o->debounce_ms <= 0) d->o.debounce_ms = 200;
  if (budget < 1000 || budget > INT_MAX || mem_limit < (1u << 20) || workers < 1 || workers > 65536) {
    tr_fail(TR_EINVAL, "detector: bad options (budget %ld: 1000..%d; mem_limit >= 1 MiB; max_workers 1..65536)",
            budget, INT_MAX);
    goto error;
  }
  d->o.budget = budget;
  d->o.mem_limit = mem_limit;
  const char *dir = lua_host_dir();
  if (o->policy_dir) snprintf(d->policy_dir, sizeof d->policy_dir, "%s", o->policy_dir);
  else snprintf(d->policy_dir, sizeof d->policy_dir, "%s/policies", dir);
  if (o->fallback_dir) snprintf(d->fallback_dir, sizeof d->fallback_dir, "%s", o->fallback_dir);
  else snprintf(d->fallback_dir, sizeof d->fallback_dir, "%s/policies", dir);
  d->o.policy_dir = d->policy_dir;
  d->o.fallback_dir = d->fallback_dir;
  d->real.max_workers = workers;
  d->real.s = series_create(workers, DET_M_COUNT, history, o->ewma_alpha > 0 ? o->ewma_alpha : 0.05);
  if (!d->real.s) goto error;
  d->real.hb = malloc(sizeof(double) * (size_t)workers);
  d->real.first_seen = malloc(sizeof(double) * (size_t)workers);
  if (!d->real.hb || !d->real.first_seen) {
    tr_fail(TR_ENOMEM, "detector: out of memory");
    goto error;
  }
  for (int i = 0; i < workers; i++) d->real.hb[i] = d->real.first_seen[i] = NAN;
  if (det_lua_init(d)) goto error;
  d->busy = 1;
  int rc = det_reload(d, 1);
  d->busy = 0;
  if (rc) goto error;
  return d;
error:
  detector_destroy(d); /* keeps tr_error() */
  return NULL;
}

void detector_destroy(detector *d) {
  if (!d || d->busy) return;
  det_lua_close(d); /* the watcher too */
  series_free(d->real.s);
  free(d->real.hb);
  free(d->real.first_seen);
  free(d);
}

/* --- input --- */

static int check_worker(const detector *d, int worker) {
  if (worker < 0 || worker >= d->real.max_workers)
    return tr_fail(TR_EINVAL, "detector: worker %d out of range 0..%d", worker, d->real.max_workers - 1);
  return TR_OK;
}

int detector_observe(detector *d, int worker, int64_t step, const detector_sample *s) {
  int rc = check_worker(d, worker);
  if (rc) return rc;
  if (!s) return tr_fail(TR_EINVAL, "detector_observe: no sample");
  double v[DET_M_COUNT];
#define DETECTOR_SAMPLE_COPY(id, name, help, prom, phase) v[DET_M_##id] = s->name;
  DETECTOR_METRICS(DETECTOR_SAMPLE_COPY)
#undef DETECTOR_SAMPLE_COPY
  v[DET_M_COMPUTE_S] = s->step_s - (isfinite(s->allreduce_s) ? s->allreduce_s : 0);
  double t = s->time > 0 ? s->time : tr_now();
  if ((rc = series_push(d->real.s, worker, step, t, v))) return rc;
  if (s->has_checksum && (rc = series_push_checksum(d->real.s, worker, step, s->checksum))) return rc;
  if (isnan(d->real.first_seen[worker])) d->real.first_seen[worker] = t;
  d->steps_total++;
  return TR_OK;
}

int detector_heartbeat(detector *d, int worker, double now) {
  int rc = check_worker(d, worker);
  if (rc || (rc = series_touch(d->real.s, worker))) return rc;
  d->real.hb[worker] = now;
  if (isnan(d->real.first_seen[worker])) d->real.first_seen[worker] = now;
  return TR_OK;
}

int detector_worker_gone(detector *d, int worker) {
  int rc = check_worker(d, worker);
  if (rc) return rc;
  series_reset(d->real.s, worker);
  d->real.hb[worker] = d->real.first_seen[worker] = NAN;
  int any = 0; /* a worker still known */
  for (int w = 0; w < d->real.max_workers && !any; w++) any = !isnan(d->real.first_seen[w]);
  /* a replacement may raise the same anomalies again; once every worker is
   * gone (a restart from a checkpoint: its steps come again), the
   * fleet-wide ones (worker -1) too */
  for (int i = 0; i < d->seen_len; i++)
    if (d->seen[i].worker == worker || (!any && d->seen[i].worker == -1)) d->seen[i].worker = INT_MIN;
  return TR_OK;
}

void detector_rewind(detector *d, int64_t step) {
  for (int w = 0; w < d->real.max_workers; w++) series_rewind(d->real.s, w, step);
  for (int i = 0; i < d->seen_len; i++)
    if (d->seen[i].step > step) d->seen[i].worker = INT_MIN;
}

/* --- the tick --- */

static uint64_t key_of(const char *rule, const char *kind) {
  uint64_t h = 1469598103934665603ull;
  for (const char *s = rule; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  h = (h ^ 0xff) * 1099511628211ull;
  for (const char *s = kind; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

/* 1 if (rule, kind, worker, step) was reported already; else remembers it. */
static int seen_before(detector *d, const det_pending *p) {
  uint64_t key = key_of(p->rule, p->kind);
  for (int i = 0; i < d->seen_len; i++)
    if (d->seen[i].key == key && d->seen[i].worker == p->worker && d->seen[i].step == p->step) return 1;
  d->seen[d->seen_head].key = key;
  d->seen[d->seen_head].worker = p->worker;
  d->seen[d->seen_head].step = p->step;
  d->seen_head = (d->seen_head + 1) % DET_DEDUP;
  if (d->seen_len < DET_DEDUP) d->seen_len++;
  return 0;
}

static void count_kind(detector *d, const char *kind) {
  for (int i = 0; i < d->nkinds; i++)
    if (strcmp(d->kinds[i].kind, kind) == 0) {
      d->kinds[i].n++;
      return;
    }
  if (d->nkinds < DET_MAX_KINDS - 1) {
    snprintf(d->kinds[d->nkinds].kind, DET_NAME, "%s", kind);
    d->kinds[d->nkinds++].n = 1;
    return;
  }
  if (d->nkinds == DET_MAX_KINDS - 1) snprintf(d->kinds[d->nkinds++].kind, DET_NAME, "other");
  d->kinds[DET_MAX_KINDS - 1].n++;
}

/* A rule or policy call failed: an event, once per distinct message in a row. */
static void call_failed(detector *d, det_rule *r, const char *who, int worker, int64_t step, const policy_err *e) {
  d->rule_errors_total++;
  if (r) {
    r->failed_this_tick = 1;
    if (strcmp(r->last_err, e->msg) == 0) return;
    snprintf(r->last_err, sizeof r->last_err, "%s", e->msg);
  }
  char detail[DET_MSG + 64];
  snprintf(detail, sizeof detail, "%s%s", e->msg, e->budget ? " (stopped by the instruction budget)" : "");
  const char *path = policy_path(d->files[strncmp(e->file, "actions", 7) == 0 ? DET_FILE_ACTIONS : DET_FILE_RULES]);
  detector_event ev = {.type = DET_EV_RULE_ERROR, .kind = "rule_error", .step = step, .worker = worker,
                       .rule = who, .file = path[0] ? path : NULL, .line = e->line, .detail = detail};
  det_emit(d, &ev);
}

/* Runs one rule over every known worker into d->pend. */
static void run_rule(detector *d, det_rule *r) {
  lua_State *L = d->L;
  int top = lua_gettop(L), over = 0;
  r->failed_this_tick = 0;
  for (int w = 0; w < d->real.max_workers && !over; w++) {
    if (!series_known(d->real.s, w)) continue;
    int64_t wstep = series_len(d->real.s, w) ? series_step(d->real.s, w, 0) : -1;
    lua_rawgeti(L, LUA_REGISTRYINDEX, r->fn_ref);
    det_push_worker_view(d, w);
    det_push_fleet_view(d);
    lua_rawgeti(L, LUA_REGISTRYINDEX, d->state_ref);
    d->cur_rule = r->name;
    d->cur_worker = w;
    policy_err e;
    if (det_call(d, 3, 1, &e)) {
      call_failed(d, r, r->name, w, wstep, &e);
      over = e.budget;
    } else {
      char err[DET_MSG];
      if (det_collect(d, -1, r->name, w, wstep, 1, err, sizeof err) < 0) {
        memset(&e, 0, sizeof e);
        snprintf(e.file, sizeof e.file, "rules.lua");
        snprintf(e.msg, sizeof e.msg, "%s", err);
        call_failed(d, r, r->name, w, wstep, &e);
      }
    }
    lua_settop(L, top);
  }
  r->over_budget = over ? r->over_budget + 1 : 0;
  if (r->over_budget >= DET_OVER_BUDGET_OFF) {
    r->disabled = 1;
    char detail[DET_MSG];
    snprintf(detail, sizeof detail,
             "rule '%s' disabled: over its instruction budget (%d) in %d ticks in a row; it comes back when "
             "rules.lua is reloaded",
             r->name, (int)policy_engine_budget(d->eng), DET_OVER_BUDGET_OFF);
    detector_event ev = {.type = DET_EV_RULE_ERROR, .kind = "rule_error", .step = -1, .worker = -1,
                         .rule = r->name, .file = policy_path(d->files[DET_FILE_RULES]), .detail = detail};
    det_emit(d, &ev);
  }
  if (!r->failed_this_tick) r->last_err[0] = 0;
}

/* Pushes the anomaly as a plain table for a policy function. */
static void push_anomaly(lua_State *L, const detector_anomaly *a) {
  lua_createtable(L, 0, 7);
  lua_pushstring(L, a->kind);
  lua_setfield(L, -2, "kind");
  lua_pushinteger(L, a->worker);
  lua_setfield(L, -2, "worker");
  lua_pushinteger(L, a->step);
  lua_setfield(L, -2, "step");
  lua_pushstring(L, a->severity);
  lua_setfield(L, -2, "severity");
  lua_pushstring(L, a->detail);
  lua_setfield(L, -2, "detail");
  lua_pushstring(L, a->rule);
  lua_setfield(L, -2, "rule");
  lua_pushnumber(L, a->time);
  lua_setfield(L, -2, "time");
}

/* actions.lua decides: actions[kind], else actions.default, else "alert". */
static void decide(detector *d, const detector_anomaly *a, detector_action *act, char *detail, size_t dn) {
  lua_State *L = d->L;
  int top = lua_gettop(L);
  char who[DET_NAME + 16];
  snprintf(who, sizeof who, "actions.%s", a->kind);
  policy_push(d->files[DET_FILE_ACTIONS]); /* [actions] */
  lua_pushstring(L, a->kind);
  if (lua_rawget(L, -2) == LUA_TNIL) { /* [actions, nil] */
    lua_pop(L, 1);
    lua_pushliteral(L, "default");
    lua_rawget(L, -2);
    snprintf(who, sizeof who, "actions.default");
  }
  act->action = DET_ACT_ALERT;
  act->worker = INT_MIN;
  act->step = INT64_MIN;
  detail[0] = 0;
  policy_err e;
  memset(&e, 0, sizeof e);
  if (lua_isfunction(L, -1)) { /* [actions, fn] */
    push_anomaly(L, a);
    lua_rawgeti(L, LUA_REGISTRYINDEX, d->state_ref);
    det_push_fleet_view(d);
    d->cur_rule = who;
    d->cur_worker = a->worker;
    if (det_call(d, 3, 1, &e)) {
      call_failed(d, NULL, who, a->worker, a->step, &e);
      snprintf(detail, dn, "policy failed, alerting instead");
    } else if (det_parse_action(L, -1, act, detail, dn, e.msg, sizeof e.msg) < 0) {
      snprintf(e.file, sizeof e.file, "actions.lua");
      call_failed(d, NULL, who, a->worker, a->step, &e);
      act->action = DET_ACT_ALERT;
      snprintf(detail, dn, "policy returned a bad action, alerting instead");
    }
  } else if (lua_type(L, -1) == LUA_TSTRING) {
    int k = detector_action_index(lua_tostring(L, -1));
    act->action = k >= 0 ? (detector_action_kind)k : DET_ACT_ALERT;
  }
  lua_settop(L, top);
  if (act->worker == INT_MIN) act->worker = act->action == DET_ACT_ROLLBACK ? -1 : a->worker; /* rollback: everyone */
  if (act->step == INT64_MIN) act->step = act->action == DET_ACT_ROLLBACK && a->step > 0 ? a->step - 1 : a->step;
  act->detail = detail;
  act->cause = a;
}

static int handle(detector *d, const det_pending *p) {
  if (seen_before(d, p)) return 0;
  d->anomalies_total++;
  count_kind(d, p->kind);
  detector_anomaly a = {.time = det_wall_time(), .step = p->step, .worker = p->worker, .rule = p->rule,
                        .kind = p->kind, .severity = p->severity, .detail = p->detail};
  detector_event ev = {.type = DET_EV_ANOMALY, .kind = "anomaly", .time = a.time, .step = a.step,
                       .worker = a.worker, .rule = a.rule, .anomaly = a.kind, .severity = a.severity,
                       .detail = a.detail};
  det_emit(d, &ev);
  if (d->o.on_anomaly) d->o.on_anomaly(d->o.ud, &a);
  detector_action act;
  char detail[DET_DETAIL];
  decide(d, &a, &act, detail, sizeof detail);
  d->actions_total[act.action]++;
  det_record *r = &d->recent[d->recent_head];
  r->time = a.time;
  r->step = a.step;
  r->worker = a.worker;
  snprintf(r->rule, sizeof r->rule, "%s", a.rule);
  snprintf(r->kind, sizeof r->kind, "%s", a.kind);
  snprintf(r->severity, sizeof r->severity, "%s", a.severity);
  snprintf(r->detail, sizeof r->detail, "%s", a.detail);
  snprintf(r->action, sizeof r->action, "%s", detector_action_name(act.action));
  d->recent_head = (d->recent_head + 1) % DET_RECENT;
  if (d->recent_len < DET_RECENT) d->recent_len++;
  char adetail[DET_DETAIL + 64];
  if (act.action == DET_ACT_ROLLBACK)
    snprintf(adetail, sizeof adetail, "to the newest checkpoint at or before step %lld%s%s", (long long)act.step,
             detail[0] ? ": " : "", detail);
  else
    snprintf(adetail, sizeof adetail, "%s", detail);
  detector_event av = {.type = DET_EV_ACTION, .kind = "action", .step = act.step, .worker = act.worker,
                       .rule = a.rule, .anomaly = a.kind, .action = detector_action_name(act.action),
                       .detail = adetail};
  det_emit(d, &av);
  if (act.action != DET_ACT_IGNORE && d->o.on_action) d->o.on_action(d->o.ud, &act);
  return 1;
}

/* Ticks come at least every second (detector.h); a longer gap than this is
 * the host's own loop stalled (SIGSTOP, a long REPL expression). */
#define DET_STALL_S 2.0

int detector_tick(detector *d, double now) {
  if (d->busy) return tr_fail(TR_ESTATE, "detector_tick: called from a detector callback");
  d->busy = 1;
  /* the heartbeats that came while the host stalled sit unread (and the
   * first tick after it may run before they are read: from a STEP's
   * handling): that time is not the workers' silence, as the FTAR
   * coordinator judges its members. Only the gap beyond DET_STALL_S is
   * taken off, so a host that merely lags still finds a dead worker. */
  double gap = d->real.now > 0 ? now - d->real.now : 0;
  if (gap > DET_STALL_S)
    for (int w = 0; w < d->real.max_workers; w++)
      if (!isnan(d->real.hb[w])) d->real.hb[w] = fmin(now, d->real.hb[w] + gap - DET_STALL_S);
  d->real.now = now;
  d->npend = d->dropped = 0;
  d->prints = 0;
  for (int i = 0; i < d->nrules; i++)
    if (!d->rules[i].disabled) run_rule(d, &d->rules[i]);
  if (d->dropped) {
    char detail[128];
    snprintf(detail, sizeof detail, "%d anomalies dropped: more than %d in one tick", d->dropped, DET_TICK_MAX);
    detector_event ev = {.type = DET_EV_RULE_ERROR, .kind = "rule_error", .step = -1, .worker = -1, .detail = detail};
    det_emit(d, &ev);
  }
  int fresh = 0;
  for (int i = 0; i < d->npend; i++) fresh += handle(d, &d->pend[i]);
  d->busy = 0;
  return fresh;
}

int detector_reload(detector *d) {
  if (d->busy) return tr_fail(TR_ESTATE, "detector_reload: called from a detector callback");
  d->busy = 1;
  int rc = det_reload(d, 1);
  d->busy = 0;
  return rc;
}

/* --- read-only copies (REPL) --- */

int detector_push_worker(detector *d, lua_State *L, int worker, int n) {
  const series_store *s = d->real.s;
  if (worker < 0 || worker >= d->real.max_workers || !series_known(s, worker)) {
    lua_pushnil(L);
    return tr_fail(TR_EINVAL, "no worker %d", worker);
  }
  int len = series_len(s, worker);
  if (n <= 0 || n > len) n = len;
  double now = d->real.now, hb = d->real.hb[worker];
  double last = len ? series_time(s, worker, 0) : d->real.first_seen[worker];
  lua_createtable(L, 0, 12); /* [w] */
  lua_pushinteger(L, worker);
  lua_setfield(L, -2, "id");
  if (len) {
    lua_pushinteger(L, series_step(s, worker, 0));
    lua_setfield(L, -2, "step");
  }
  lua_pushinteger(L, len);
  lua_setfield(L, -2, "n");
  lua_pushinteger(L, series_total(s, worker));
  lua_setfield(L, -2, "total");
  if (!isnan(hb)) {
    lua_pushnumber(L, now - hb);
    lua_setfield(L, -2, "heartbeat_age");
  }
  if (!isnan(last)) {
    lua_pushnumber(L, now - last);
    lua_setfield(L, -2, "progress_age");
  }
  if (!isnan(last) && !isnan(hb)) {
    lua_pushnumber(L, hb > last ? hb - last : 0);
    lua_setfield(L, -2, "live_stall");
  }
  int64_t ckstep;
  uint32_t crc;
  if (series_checksum(s, worker, &ckstep, &crc)) {
    lua_pushinteger(L, crc);
    lua_setfield(L, -2, "checksum");
    lua_pushinteger(L, ckstep);
    lua_setfield(L, -2, "checksum_step");
  }
  lua_createtable(L, 0, DET_M_COUNT); /* [w, latest] */
  lua_createtable(L, 0, DET_M_COUNT); /* [w, latest, ewma] */
  lua_createtable(L, 0, DET_M_COUNT + 1); /* [w, latest, ewma, series] */
  for (int m = 0; m < DET_M_COUNT; m++) {
    if (len) {
      lua_pushnumber(L, series_value(s, worker, m, 0));
      lua_setfield(L, -4, metric_names[m]);
    }
    const ewma *e = series_ewma(s, worker, m);
    lua_createtable(L, 0, 2);
    lua_pushnumber(L, e && e->n ? e->mean : NAN);
    lua_setfield(L, -2, "mean");
    lua_pushnumber(L, e && e->n ? ewma_std(e) : NAN);
    lua_setfield(L, -2, "std");
    lua_setfield(L, -3, metric_names[m]);
    lua_createtable(L, n, 0);
    for (int k = 0; k < n; k++) {
      lua_pushnumber(L, series_value(s, worker, m, n - 1 - k));
      lua_rawseti(L, -2, k + 1);
    }
    lua_setfield(L, -2, metric_names[m]);
  }
  lua_createtable(L, n, 0);
  for (int k = 0; k < n; k++) {
    lua_pushinteger(L, series_step(s, worker, n - 1 - k));
    lua_rawseti(L, -2, k + 1);
  }
  lua_setfield(L, -2, "step");
  lua_setfield(L, -4, "series"); /* [w, latest, ewma] */
  lua_setfield(L, -3, "ewma");   /* [w, latest] */
  lua_setfield(L, -2, "latest"); /* [w] */
  return TR_OK;
}

int detector_push_fleet(detector *d, lua_State *L) {
  series_store *s = d->real.s;
  lua_createtable(L, 0, 8); /* [f] */
  lua_pushnumber(L, d->real.now);
  lua_setfield(L, -2, "now");
  lua_newtable(L); /* [f, ids] */
  int size = 0, have = 0;
  int64_t mx = 0, mn = 0;
  for (int w = 0; w < d->real.max_workers; w++) {
    if (!series_known(s, w)) continue;
    lua_pushinteger(L, w);
    lua_rawseti(L, -2, ++size);
    if (!series_len(s, w)) continue;
    int64_t st = series_step(s, w, 0);
    if (!have++ || st > mx) mx = st;
    if (have == 1 || st < mn) mn = st;
  }
  lua_setfield(L, -2, "workers");
  lua_pushinteger(L, size);
  lua_setfield(L, -2, "size");
  if (have) {
    lua_pushinteger(L, mx);
    lua_setfield(L, -2, "step");
    lua_pushinteger(L, mn);
    lua_setfield(L, -2, "min_step");
  }
  static const char *const aggs[] = {"median", "p90", "mean"};
  for (int a = 0; a < 3; a++) {
    lua_createtable(L, 0, DET_M_COUNT);
    for (int m = 0; m < DET_M_COUNT; m++) {
      double v = a == 0 ? series_fleet_median(s, m, -1) : a == 1 ? series_fleet_percentile(s, m, 90, -1)
                                                                 : series_fleet_mean(s, m, -1);
      lua_pushnumber(L, v);
      lua_setfield(L, -2, metric_names[m]);
    }
    lua_setfield(L, -2, aggs[a]);
  }
  return TR_OK;
}

int detector_push_anomalies(detector *d, lua_State *L, int n) {
  if (n <= 0 || n > d->recent_len) n = d->recent_len;
  lua_createtable(L, n, 0);
  for (int k = 0; k < n; k++) {
    int i = (d->recent_head - n + k + DET_RECENT) % DET_RECENT;
    const det_record *r = &d->recent[i];
    lua_createtable(L, 0, 8);
    lua_pushnumber(L, r->time);
    lua_setfield(L, -2, "time");
    lua_pushinteger(L, r->step);
    lua_setfield(L, -2, "step");
    lua_pushinteger(L, r->worker);
    lua_setfield(L, -2, "worker");
    lua_pushstring(L, r->rule);
    lua_setfield(L, -2, "rule");
    lua_pushstring(L, r->kind);
    lua_setfield(L, -2, "kind");
    lua_pushstring(L, r->severity);
    lua_setfield(L, -2, "severity");
    lua_pushstring(L, r->detail);
    lua_setfield(L, -2, "detail");
    lua_pushstring(L, r->action);
    lua_setfield(L, -2, "action");
    lua_rawseti(L, -2, k + 1);
  }
  return TR_OK;
}

int64_t detector_steps_total(const detector *d) { return d->steps_total; }
int64_t detector_anomalies_total(const detector *d) { return d->anomalies_total; }
int64_t detector_actions_total(const detector *d, detector_action_kind a) {
  return (int)a >= 0 && a < DET_ACT_COUNT ? d->actions_total[a] : 0;
}
