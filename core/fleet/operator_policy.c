/* operator_policy.c — the operator's restart policy: restart.lua on the
 * policy engine (core/lua/policy.h). It loads the file from the job's
 * policies folder (else lua/policies), checks it (both handlers present, no
 * misspelled on_* handler, a dry run of each giving a valid decision), asks
 * it what to do when a replica fails, and when it cannot say (it raised, ran
 * past its instruction budget, returned no valid decision) logs a
 * policy_error and decides by the built-in rule. Its loads and reloads
 * (the watcher, the REPL's reload()) are events in events.jsonl.
 *
 * It does not act on the decision (operator.c schedules replacements) or
 * watch files itself (the engine does, on the operator's event loop, where
 * everything here runs).
 */
#include <lauxlib.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "lua_host.h"
#include "operator_internal.h"
#include "policy.h"
#include "util.h"

/* --- the restart policy (restart.lua on the policy engine) --- */

/* When restart.lua cannot decide (it raised, ran past its budget, returned
 * something that is not a decision), the operator decides as the shipped
 * restart.lua does: replace with an exponential backoff within a bounded
 * number of restarts; every replica gone: restart from the newest
 * checkpoint while the job-wide budget lasts. */
#define FALLBACK_MAX_SLOT 5
#define FALLBACK_MAX_TOTAL 20
#define FALLBACK_BACKOFF 0.2
#define FALLBACK_BACKOFF_MAX 10.0

/* One events.jsonl line with a file and a line, in the detector's form
 * (detector_event_json); failures are printed too. */
static void policy_event(operator_state *o, int failed, const char *kind, int64_t step, int worker, const char *rule,
                         const char *file, int line, const char *detail) {
  detector_event e = {.kind = kind, .step = step, .worker = worker, .rule = rule, .file = file, .line = line,
                      .detail = detail};
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  e.time = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
  char buf[4096];
  int k = detector_event_json(&e, buf, sizeof buf);
  if (o->events && k > 0 && k < (int)sizeof buf) {
    fprintf(o->events, "%s\n", buf);
    fflush(o->events);
  }
  if (!failed) return;
  printf("[operator] %s: %s\n", kind, detail);
  fflush(stdout);
}

static void on_policy_reload(void *ud, const policy_reload_info *r) {
  operator_state *o = ud;
  policy_event(o, !r->ok, r->ok ? "policy_reload" : "policy_reload_failed", -1, -1, NULL, r->path,
               r->ok ? 0 : r->err->line, r->detail);
}

static void on_policy_print(void *ud, const char *text) {
  operator_state *o = ud;
  operator_event(o, o->best_step, -1, "policy_print", "restart.lua: %s", text);
}

/* The decision a handler returned (at idx): "action" or {action = ..,
 * delay = seconds >= 0, detail = ".."}, the action one that fn allows.
 * Returns 0, or -1 with err set. */
static int parse_decision(lua_State *L, int idx, const char *fn, char *action, size_t n, double *delay, char *detail,
                          size_t dn, char *err, size_t en) {
  const char *ok1 = strcmp(fn, "on_failure") == 0 ? "replace" : "restart";
  const char *ok2 = strcmp(fn, "on_failure") == 0 ? "none" : "stop";
  idx = lua_absindex(L, idx);
  *delay = 0;
  detail[0] = 0;
  int t = lua_type(L, idx);
  if (t != LUA_TSTRING && t != LUA_TTABLE) {
    snprintf(err, en, "%s returned a %s; expected \"%s\", \"%s\" or {action = ..., delay = ..., detail = ...}", fn,
             lua_typename(L, t), ok1, ok2);
    return -1;
  }
  if (t == LUA_TTABLE) {
    lua_pushnil(L);
    while (lua_next(L, idx)) { /* [k, v] */
      const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "?";
      int bad = 0;
      if (strcmp(k, "delay") == 0) {
        bad = lua_type(L, -1) != LUA_TNUMBER || !(lua_tonumber(L, -1) >= 0 && lua_tonumber(L, -1) <= 3600);
        if (bad) snprintf(err, en, "%s: delay must be a number of seconds in 0..3600", fn);
        else *delay = lua_tonumber(L, -1);
      } else if (strcmp(k, "detail") == 0) {
        bad = lua_type(L, -1) != LUA_TSTRING;
        if (bad) snprintf(err, en, "%s: detail must be a string", fn);
        else snprintf(detail, dn, "%s", lua_tostring(L, -1));
      } else if (strcmp(k, "action") != 0) {
        bad = 1;
        snprintf(err, en, "%s returned an unknown field '%s' (action, delay, detail)", fn, k);
      }
      lua_pop(L, 1); /* [k] */
      if (bad) {
        lua_pop(L, 1);
        return -1;
      }
    }
    lua_getfield(L, idx, "action"); /* [action] */
  } else {
    lua_pushvalue(L, idx);
  }
  const char *a = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
  int good = a && (strcmp(a, ok1) == 0 || strcmp(a, ok2) == 0);
  if (good) snprintf(action, n, "%s", a);
  else snprintf(err, en, "%s: action must be \"%s\" or \"%s\", got %s%s%s", fn, ok1, ok2, a ? "'" : "",
                a ? a : luaL_typename(L, -1), a ? "'" : "");
  lua_pop(L, 1);
  return good ? 0 : -1;
}

/* Pushes the last n of a ring of cap times (count ever written) as an
 * array, oldest first. */
static void push_times(lua_State *L, const double *ring, int cap, int count) {
  int n = count < cap ? count : cap;
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    lua_pushnumber(L, ring[(count - n + i) % cap]);
    lua_rawseti(L, -2, i + 1);
  }
}

/* What a handler learns of a failure: the ev table. */
typedef struct {
  int slot, sig, code, live, replicas;
  const char *reason;
  int64_t step;
  double time;                       /* seconds since the operator started */
  const double *slot_times, *times; /* restart rings (NULL: none) */
  int slot_restarts, restarts;
} policy_ev;

static void push_policy_event(lua_State *L, const policy_ev *e) {
  lua_createtable(L, 0, 12);
  lua_pushinteger(L, e->slot);
  lua_setfield(L, -2, "slot");
  lua_pushstring(L, e->reason);
  lua_setfield(L, -2, "reason");
  lua_pushinteger(L, e->sig);
  lua_setfield(L, -2, "signal");
  lua_pushinteger(L, e->code);
  lua_setfield(L, -2, "code");
  lua_pushinteger(L, e->step);
  lua_setfield(L, -2, "step");
  lua_pushinteger(L, e->live);
  lua_setfield(L, -2, "live");
  lua_pushinteger(L, e->replicas);
  lua_setfield(L, -2, "replicas");
  lua_pushinteger(L, e->slot_restarts);
  lua_setfield(L, -2, "restarts_slot");
  lua_pushinteger(L, e->restarts);
  lua_setfield(L, -2, "restarts_total");
  lua_pushnumber(L, e->time);
  lua_setfield(L, -2, "time");
  push_times(L, e->slot_times, RESTART_TIMES, e->slot_times ? e->slot_restarts : 0);
  lua_setfield(L, -2, "slot_restart_times");
  push_times(L, e->times, RESTART_TIMES_JOB, e->times ? e->restarts : 0);
  lua_setfield(L, -2, "restart_times");
}

/* The engine's check of a new restart.lua (the table at mod): on_failure and
 * on_all_dead are functions, no other on_* key (a misspelled handler), and
 * each gives a valid decision on a dry run (a replica killed at step 10, one
 * of two, no restarts yet; a scratch state). */
static int check_restart(void *ud, lua_State *L, int mod, int env, policy_err *e) {
  operator_state *o = ud;
  (void)env;
  static const char *const fns[] = {"on_failure", "on_all_dead"};
  const char *file = policy_name(o->restart);
  lua_pushnil(L);
  while (lua_next(L, mod)) { /* [k, v] */
    const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "";
    int bad = strncmp(k, "on_", 3) == 0 && strcmp(k, fns[0]) != 0 && strcmp(k, fns[1]) != 0;
    int line = bad ? policy_fn_line(L, -1) : 0;
    lua_pop(L, 1); /* [k] */
    if (bad) {
      int rc = policy_fail(e, file, line, "unknown handler '%s' (on_failure, on_all_dead)", k);
      lua_pop(L, 1);
      return rc;
    }
  }
  int top = lua_gettop(L), rc = TR_OK;
  for (int i = 0; i < 2 && !rc; i++) {
    if (lua_getfield(L, mod, fns[i]) != LUA_TFUNCTION) { /* [fn] */
      rc = policy_fail(e, file, 0, "%s must be a function(ev, state), is a %s", fns[i], luaL_typename(L, -1));
      break;
    }
    int line = policy_fn_line(L, -1);
    policy_ev dry = {.slot = i == 0 ? 0 : -1, .reason = "killed", .sig = 9, .code = -1, .step = 10,
                     .live = i == 0 ? 1 : 0, .replicas = 2, .time = 10.0};
    push_policy_event(L, &dry); /* [fn, ev] */
    lua_newtable(L);                                                                  /* [fn, ev, state] */
    if ((rc = policy_call(o->pol, 2, 1, e))) {                                         /* [decision] */
      char msg[POLICY_MSG];
      snprintf(msg, sizeof msg, "%s", e->msg);
      snprintf(e->msg, sizeof e->msg, "dry run of %s: %s", fns[i], msg);
      break;
    }
    char action[32], detail[256], err[POLICY_MSG];
    double delay;
    if (parse_decision(L, -1, fns[i], action, sizeof action, &delay, detail, sizeof detail, err, sizeof err) < 0)
      rc = policy_fail(e, file, line, "dry run: %s", err);
    lua_settop(L, top);
  }
  lua_settop(L, top);
  return rc;
}

/* The built-in decision when restart.lua cannot make one. */
static void fallback_decision(operator_state *o, const char *fn, const slot *s, const char *reason, char *action,
                              size_t n, double *delay) {
  int slot_restarts = s ? s->restarts : 0;
  int again = strcmp(reason, "startup_error") != 0; /* it would fail the same way */
  if (strcmp(fn, "on_failure") == 0) {
    int go = again && slot_restarts < FALLBACK_MAX_SLOT && o->restarts_total < FALLBACK_MAX_TOTAL;
    snprintf(action, n, "%s", go ? "replace" : "none");
    *delay = go ? fmin(FALLBACK_BACKOFF_MAX, FALLBACK_BACKOFF * pow(2, slot_restarts)) : 0;
  } else {
    int go = again && o->restarts_total < FALLBACK_MAX_TOTAL;
    snprintf(action, n, "%s", go ? "restart" : "stop");
    *delay = go ? FALLBACK_BACKOFF : 0;
  }
}

int operator_policy_load(operator_state *o) {
  char fallback[PATH_MAX];
  snprintf(fallback, sizeof fallback, "%s/policies", lua_host_dir());
  policy_engine_opts eo = {.on_reload = on_policy_reload, .on_print = on_policy_print, .ud = o};
  if (!(o->pol = policy_engine_new(&eo))) return tr_fail_prefix(TR_ENOMEM, "restart policy");
  lua_State *L = policy_engine_lua(o->pol);
  lua_newtable(L);
  o->state_ref = luaL_ref(L, LUA_REGISTRYINDEX); /* the policy's state: the operator's, across reloads */
  policy_opts po = {.name = "restart.lua",
                    .dir = o->cfg->policies[0] ? o->cfg->policies : fallback,
                    .fallback_dir = fallback,
                    .check = check_restart,
                    .ud = o};
  int rc = (o->restart = policy_add(o->pol, &po)) ? policy_reload(o->restart, 1) : TR_EINVAL;
  if (rc) {
    rc = tr_fail_prefix(rc, "restart policy");
    operator_policy_free(o);
  }
  return rc;
}

int operator_policy_reload(operator_state *o) { return o->restart ? policy_reload(o->restart, 1) : tr_fail(TR_ESTATE, "no restart policy"); }

void operator_policy_free(operator_state *o) {
  policy_engine_free(o->pol); /* the watcher, the VM, the state table */
  o->pol = NULL;
  o->restart = NULL;
  o->hosts_pol = NULL;
}

void operator_policy_call(operator_state *o, const char *fn, const slot *s, const char *reason, int sig, int code, char *action, size_t n,
                 double *delay, char *detail, size_t dn) {
  lua_State *L = policy_engine_lua(o->pol);
  int top = lua_gettop(L);
  char who[32], err[POLICY_MSG];
  snprintf(who, sizeof who, "restart.%s", fn);
  policy_err e;
  memset(&e, 0, sizeof e);
  policy_push(o->restart); /* [M] */
  lua_getfield(L, -1, fn); /* [M, fn] (checked at load: a function) */
  int line = policy_fn_line(L, -1);
  policy_ev ev = {.slot = s ? s->slot : -1, .reason = reason, .sig = sig, .code = code,
                  .step = s ? s->step : o->best_step, .live = operator_live_count(o), .replicas = o->nslots,
                  .time = tr_now() - o->t0, .slot_times = s ? s->restart_at : NULL, .times = o->restart_at,
                  .slot_restarts = s ? s->restarts : 0, .restarts = o->restarts_total};
  push_policy_event(L, &ev);
  lua_rawgeti(L, LUA_REGISTRYINDEX, o->state_ref); /* [M, fn, ev, state] */
  int rc = policy_call(o->pol, 2, 1, &e);          /* [M, decision] */
  if (rc == TR_OK && parse_decision(L, -1, fn, action, n, delay, detail, dn, err, sizeof err) < 0) {
    policy_fail(&e, policy_name(o->restart), line, "%s", err);
    rc = TR_ELUA;
  }
  lua_settop(L, top);
  if (rc == TR_OK) return;
  fallback_decision(o, fn, s, reason, action, n, delay);
  char msg[POLICY_MSG + 128];
  snprintf(msg, sizeof msg, "%s%s; the operator decides instead: %s", e.msg,
           e.budget ? " (stopped by the instruction budget)" : "", action);
  policy_event(o, 1, "policy_error", s ? s->step : o->best_step, s ? s->slot : -1, who,
               policy_path(o->restart), e.line, msg);
  snprintf(detail, dn, "restart.lua failed, built-in fallback");
}
