/* detector_lua.c — the detector's policy files on the policy engine
 * (core/lua/policy.c): rules.lua and actions.lua registered there with the
 * detector's checks (shapes, dry runs on a synthetic world) and commits,
 * the `state` global, print() as "rule_print" events, reloads as
 * "policy_reload" / "policy_reload_failed" events; and parsing what rules
 * and policies return.
 *
 * The VM, the sandbox, the instruction budget, the memory limit, loading
 * and swapping files, and inotify are the engine's. It does not run ticks or
 * decide what happens to an anomaly (detector.c) or build the views
 * (detector_views.c). Everything runs on the detector's thread.
 */
#include <lauxlib.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "detector_internal.h"
#include "lua_host.h"
#include "util.h"

#define DRY_STEPS 24 /* steps of the dry runs' synthetic worker */

int det_call(detector *d, int nargs, int nresults, policy_err *e) { return policy_call(d->eng, nargs, nresults, e); }

/* --- parsing what rules and policies return --- */

static int get_int(lua_State *L, int i, int64_t *out) {
  if (lua_isinteger(L, i)) {
    *out = (int64_t)lua_tointeger(L, i);
    return 1;
  }
  if (lua_type(L, i) == LUA_TNUMBER) {
    double x = lua_tonumber(L, i);
    if (isfinite(x) && x == floor(x) && fabs(x) < 9e18) {
      *out = (int64_t)x;
      return 1;
    }
  }
  return 0;
}

/* Copies the string or number at i into buf; 0 if it is neither. */
static int get_str(lua_State *L, int i, char *buf, size_t n) {
  int t = lua_type(L, i);
  if (t != LUA_TSTRING && t != LUA_TNUMBER) return 0;
  lua_pushvalue(L, i); /* a copy: tolstring converts numbers in place */
  snprintf(buf, n, "%s", lua_tostring(L, -1));
  lua_pop(L, 1);
  return 1;
}

static int one_anomaly(detector *d, int idx, const char *rule, int worker, int64_t wstep, int store, char *err,
                       size_t en) {
  lua_State *L = d->L;
  det_pending p;
  memset(&p, 0, sizeof p);
  snprintf(p.rule, sizeof p.rule, "%s", rule);
  snprintf(p.severity, sizeof p.severity, "warning");
  p.worker = worker;
  p.step = wstep;
  lua_pushnil(L);
  while (lua_next(L, idx)) { /* [k, v] */
    const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
    int64_t iv;
    int ok = 1;
    if (!k) {
      snprintf(err, en, "an anomaly has a %s key; expected kind, worker, step, severity, detail", luaL_typename(L, -2));
      ok = 0;
    } else if (strcmp(k, "kind") == 0) {
      size_t len = 0;
      if (lua_type(L, -1) != LUA_TSTRING || (lua_tolstring(L, -1, &len), len == 0) || len >= DET_NAME) {
        snprintf(err, en, "anomaly.kind must be a non-empty string shorter than %d bytes", DET_NAME);
        ok = 0;
      } else {
        snprintf(p.kind, sizeof p.kind, "%s", lua_tostring(L, -1));
      }
    } else if (strcmp(k, "worker") == 0) {
      if (!get_int(L, -1, &iv) || iv < -1 || iv >= d->real.max_workers) {
        snprintf(err, en, "anomaly.worker must be a worker id or -1 (the fleet)");
        ok = 0;
      } else {
        p.worker = (int)iv;
      }
    } else if (strcmp(k, "step") == 0) {
      if (!get_int(L, -1, &iv)) {
        snprintf(err, en, "anomaly.step must be an integer");
        ok = 0;
      } else {
        p.step = iv;
      }
    } else if (strcmp(k, "severity") == 0) {
      if (!get_str(L, -1, p.severity, sizeof p.severity)) {
        snprintf(err, en, "anomaly.severity must be a string");
        ok = 0;
      }
    } else if (strcmp(k, "detail") == 0) {
      if (!get_str(L, -1, p.detail, sizeof p.detail)) {
        snprintf(err, en, "anomaly.detail must be a string");
        ok = 0;
      }
    } else {
      snprintf(err, en, "an anomaly has an unknown field '%s' (kind, worker, step, severity, detail)", k);
      ok = 0;
    }
    lua_pop(L, 1); /* [k] */
    if (!ok) {
      lua_pop(L, 1);
      return -1;
    }
  }
  if (!p.kind[0]) {
    snprintf(err, en, "an anomaly has no kind");
    return -1;
  }
  if (store) {
    if (d->npend < DET_TICK_MAX) d->pend[d->npend++] = p;
    else d->dropped++;
  }
  return 0;
}

int det_collect(detector *d, int idx, const char *rule, int worker, int64_t wstep, int store, char *err, size_t en) {
  lua_State *L = d->L;
  idx = lua_absindex(L, idx);
  int t = lua_type(L, idx);
  if (t == LUA_TNIL || (t == LUA_TBOOLEAN && !lua_toboolean(L, idx))) return 0;
  if (t != LUA_TTABLE) {
    snprintf(err, en, "rule '%s' returned a %s; expected nil, an anomaly {kind=...} or a list of them", rule,
             lua_typename(L, t));
    return -1;
  }
  lua_pushliteral(L, "kind");
  int single = lua_rawget(L, idx) != LUA_TNIL;
  lua_pop(L, 1);
  if (single) return one_anomaly(d, idx, rule, worker, wstep, store, err, en) < 0 ? -1 : 1;
  lua_Integer len = (lua_Integer)lua_rawlen(L, idx), entries = 0;
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    entries++;
    lua_pop(L, 1);
  }
  if (entries != len) {
    snprintf(err, en, "rule '%s' returned a table that is neither an anomaly (it has no 'kind') nor a list", rule);
    return -1;
  }
  for (lua_Integer i = 1; i <= len; i++) {
    if (lua_rawgeti(L, idx, i) != LUA_TTABLE) {
      snprintf(err, en, "rule '%s': element %d of the list is a %s, expected an anomaly", rule, (int)i,
               luaL_typename(L, -1));
      lua_pop(L, 1);
      return -1;
    }
    int rc = one_anomaly(d, lua_gettop(L), rule, worker, wstep, store, err, en);
    lua_pop(L, 1);
    if (rc < 0) return -1;
  }
  return (int)len;
}

int det_parse_action(lua_State *L, int idx, detector_action *a, char *detail, size_t dn, char *err, size_t en) {
  idx = lua_absindex(L, idx);
  a->action = DET_ACT_IGNORE;
  a->worker = INT_MIN; /* unset: the caller fills the defaults */
  a->step = INT64_MIN;
  detail[0] = 0;
  int t = lua_type(L, idx);
  if (t == LUA_TNIL) return 0;
  if (t == LUA_TSTRING) {
    int k = detector_action_index(lua_tostring(L, idx));
    if (k < 0) {
      snprintf(err, en, "unknown action '%s' (ignore, alert, evict, rollback, skip_update, checkpoint_now)",
               lua_tostring(L, idx));
      return -1;
    }
    a->action = (detector_action_kind)k;
    return 0;
  }
  if (t != LUA_TTABLE) {
    snprintf(err, en, "a policy returned a %s; expected an action name, {action=...} or nil", lua_typename(L, t));
    return -1;
  }
  int have_action = 0;
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "?";
    int64_t iv;
    int ok = 1;
    if (strcmp(k, "action") == 0) {
      int ai = lua_type(L, -1) == LUA_TSTRING ? detector_action_index(lua_tostring(L, -1)) : -1;
      if (ai < 0) {
        snprintf(err, en, "unknown action '%s' (ignore, alert, evict, rollback, skip_update, checkpoint_now)",
                 lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : luaL_typename(L, -1));
        ok = 0;
      } else {
        a->action = (detector_action_kind)ai;
        have_action = 1;
      }
    } else if (strcmp(k, "worker") == 0) {
      if (!get_int(L, -1, &iv) || iv < -1 || iv > INT_MAX) {
        snprintf(err, en, "action.worker must be a worker id or -1");
        ok = 0;
      } else {
        a->worker = (int)iv;
      }
    } else if (strcmp(k, "step") == 0) {
      if (!get_int(L, -1, &iv)) {
        snprintf(err, en, "action.step must be an integer");
        ok = 0;
      } else {
        a->step = iv;
      }
    } else if (strcmp(k, "detail") == 0) {
      if (!get_str(L, -1, detail, dn)) {
        snprintf(err, en, "action.detail must be a string");
        ok = 0;
      }
    } else {
      snprintf(err, en, "an action has an unknown field '%s' (action, worker, step, detail)", k);
      ok = 0;
    }
    lua_pop(L, 1);
    if (!ok) {
      lua_pop(L, 1);
      return -1;
    }
  }
  if (!have_action) {
    snprintf(err, en, "an action table has no 'action'");
    return -1;
  }
  return 0;
}

/* --- checking and adopting policy files (the engine's check and commit) --- */

static int cmp_rule(const void *a, const void *b) { return strcmp(((const det_rule *)a)->name, ((const det_rule *)b)->name); }

/* A dry call failed: prefix its message, keep its position. */
static int dry_failed(policy_err *e, const char *what) {
  char msg[DET_MSG];
  snprintf(msg, sizeof msg, "%s", e->msg);
  snprintf(e->msg, sizeof e->msg, "dry run of %s: %s", what, msg);
  return TR_ELUA;
}

/* Dry runs must not touch the real state through the global either: env.state
 * is a scratch table while they run. */
static void set_env_state(detector *d, lua_State *L, int env, int real) {
  lua_pushliteral(L, "state");
  if (real) lua_rawgeti(L, LUA_REGISTRYINDEX, d->state_ref);
  else lua_newtable(L);
  lua_rawset(L, env);
}

/* rules.lua returned the table at t: every value a function(w, fleet, state)
 * named by a string, each dry-run on the synthetic world (a worker with a
 * few steady steps and a worker with none); the sorted list is staged for
 * commit_rules. */
static int check_rules(void *ud, lua_State *L, int t, int env, policy_err *e) {
  detector *d = ud;
  const char *file = policy_name(d->files[DET_FILE_RULES]);
  det_rule *nr = d->staged;
  int n = 0;
  d->nstaged = 0;
  lua_pushnil(L);
  while (lua_next(L, t)) { /* [.., k, v] */
    if (lua_type(L, -2) != LUA_TSTRING) {
      int rc = policy_fail(e, file, 0, "the returned table has a %s key; rules are named by strings", luaL_typename(L, -2));
      lua_pop(L, 2);
      return rc;
    }
    const char *name = lua_tostring(L, -2);
    if (!lua_isfunction(L, -1)) {
      int rc = policy_fail(e, file, 0, "rule '%s' is a %s, expected a function(w, fleet, state)", name, luaL_typename(L, -1));
      lua_pop(L, 2);
      return rc;
    }
    if (n == DET_MAX_RULES || strlen(name) >= DET_NAME) {
      lua_pop(L, 2);
      return policy_fail(e, file, 0, "at most %d rules with names shorter than %d bytes", DET_MAX_RULES, DET_NAME);
    }
    memset(&nr[n], 0, sizeof nr[n]);
    snprintf(nr[n].name, sizeof nr[n].name, "%s", name);
    nr[n].fn_ref = LUA_NOREF;
    n++;
    lua_pop(L, 1);
  }
  qsort(nr, (size_t)n, sizeof nr[0], cmp_rule);
  int rc = TR_OK, top = lua_gettop(L);
  set_env_state(d, L, env, 0);
  for (int i = 0; i < n && !rc; i++) {
    for (int w = 0; w < 2 && !rc; w++) {
      lua_getfield(L, t, nr[i].name);
      det_push_view(d, &d->dry, w);
      det_push_fleet(d, &d->dry);
      lua_newtable(L); /* a scratch state */
      d->cur_rule = nr[i].name;
      char what[DET_NAME + 32];
      snprintf(what, sizeof what, "rule '%s'", nr[i].name);
      if ((rc = det_call(d, 3, 1, e))) {
        dry_failed(e, what);
        break;
      }
      char err[DET_MSG];
      if (det_collect(d, -1, nr[i].name, w, w ? -1 : DRY_STEPS, 0, err, sizeof err) < 0) {
        lua_getfield(L, t, nr[i].name);
        rc = policy_fail(e, file, policy_fn_line(L, lua_gettop(L)), "dry run: %s", err);
      }
      lua_settop(L, top);
    }
  }
  set_env_state(d, L, env, 1);
  if (rc == TR_OK) d->nstaged = n;
  return rc;
}

/* The checked rules replace the ones in force (a disabled rule comes back). */
static void commit_rules(void *ud, lua_State *L, int t) {
  detector *d = ud;
  for (int i = 0; i < d->nrules; i++) luaL_unref(L, LUA_REGISTRYINDEX, d->rules[i].fn_ref);
  for (int i = 0; i < d->nstaged; i++) {
    lua_getfield(L, t, d->staged[i].name);
    d->staged[i].fn_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    d->rules[i] = d->staged[i];
  }
  d->nrules = d->nstaged;
  d->nstaged = 0;
}

/* Pushes the synthetic anomaly a dry run hands a policy. */
static void push_dry_anomaly(lua_State *L, const char *kind, int worker) {
  lua_createtable(L, 0, 7);
  lua_pushstring(L, kind);
  lua_setfield(L, -2, "kind");
  lua_pushinteger(L, worker);
  lua_setfield(L, -2, "worker");
  lua_pushinteger(L, DRY_STEPS);
  lua_setfield(L, -2, "step");
  lua_pushliteral(L, "warning");
  lua_setfield(L, -2, "severity");
  lua_pushliteral(L, "dry run");
  lua_setfield(L, -2, "detail");
  lua_pushstring(L, kind);
  lua_setfield(L, -2, "rule");
  lua_pushnumber(L, 0);
  lua_setfield(L, -2, "time");
}

/* actions.lua returned the table at t: anomaly kind (or "default") -> an
 * action name or a function(anomaly, state, fleet), each function dry-run on
 * a worker's anomaly and the fleet's. decide() reads the table in force
 * through policy_push: no commit. */
static int check_actions(void *ud, lua_State *L, int t, int env, policy_err *e) {
  detector *d = ud;
  const char *file = policy_name(d->files[DET_FILE_ACTIONS]);
  int rc = TR_OK;
  set_env_state(d, L, env, 0);
  lua_pushnil(L);
  while (!rc && lua_next(L, t)) { /* [.., k, v] */
    int v = lua_gettop(L);
    if (lua_type(L, -2) != LUA_TSTRING) {
      rc = policy_fail(e, file, 0, "the returned table has a %s key; expected anomaly kinds", luaL_typename(L, -2));
    } else if (lua_type(L, v) == LUA_TSTRING) {
      if (detector_action_index(lua_tostring(L, v)) < 0)
        rc = policy_fail(e, file, 0,
                         "%s = '%s': unknown action (ignore, alert, evict, rollback, skip_update, checkpoint_now)",
                         lua_tostring(L, -2), lua_tostring(L, v));
    } else if (lua_isfunction(L, v)) {
      const char *kind = lua_tostring(L, -2);
      for (int w = 0; w >= -1 && !rc; w--) { /* a worker's anomaly and the fleet's */
        lua_pushvalue(L, v);
        push_dry_anomaly(L, strcmp(kind, "default") == 0 ? "dry_run" : kind, w);
        lua_newtable(L);
        det_push_fleet(d, &d->dry);
        char what[DET_NAME + 32];
        snprintf(what, sizeof what, "policy '%s'", kind);
        d->cur_rule = kind;
        if ((rc = det_call(d, 3, 1, e))) {
          dry_failed(e, what);
          break;
        }
        detector_action a;
        char detail[DET_DETAIL], err[DET_MSG];
        if (det_parse_action(L, -1, &a, detail, sizeof detail, err, sizeof err) < 0)
          rc = policy_fail(e, file, policy_fn_line(L, v), "dry run of policy '%s': %s", kind, err);
        lua_pop(L, 1);
      }
    } else {
      rc = policy_fail(e, file, 0, "%s is a %s; expected an action name or a function(anomaly, state, fleet)",
                       lua_tostring(L, -2), luaL_typename(L, v));
    }
    lua_pop(L, 1); /* [.., k] */
    if (rc) lua_pop(L, 1);
  }
  set_env_state(d, L, env, 1);
  return rc;
}

/* --- the engine's callbacks --- */

/* A new file's top level gets a scratch `state`: it runs before its
 * checks, and a file they refuse must leave the state in force untouched.
 * The checks hand the real one (kept across reloads) to the file's
 * functions when they pass. */
static void init_env(void *ud, lua_State *L, int env) {
  set_env_state(ud, L, env, 0);
}

/* print() from a rule or policy: a "rule_print" event, at most DET_PRINTS a tick. */
static void on_print(void *ud, const char *text) {
  detector *d = ud;
  if (d->prints >= DET_PRINTS) return;
  d->prints++;
  detector_event e = {.type = DET_EV_PRINT, .kind = "rule_print", .step = -1, .worker = d->cur_worker,
                      .rule = d->cur_rule, .detail = text};
  det_emit(d, &e);
}

static void on_reload(void *ud, const policy_reload_info *r) {
  detector *d = ud;
  char detail[DET_MSG + 160];
  const char *text = r->detail;
  if (r->ok && r->p == d->files[DET_FILE_RULES]) {
    int k = snprintf(detail, sizeof detail, "%s in force: %d rules (", r->name, d->nrules);
    for (int i = 0; i < d->nrules && k < (int)sizeof detail; i++)
      k += snprintf(detail + k, sizeof detail - (size_t)k, "%s%s", i ? ", " : "", d->rules[i].name);
    if (k < (int)sizeof detail) snprintf(detail + k, sizeof detail - (size_t)k, ")");
    text = detail;
  }
  if (r->p) {
    if (r->ok) d->reloads_total++;
    else d->reload_failures_total++;
  }
  detector_event ev = {.type = r->ok ? DET_EV_RELOAD : DET_EV_RELOAD_FAILED,
                       .kind = r->ok ? "policy_reload" : "policy_reload_failed",
                       .step = -1,
                       .worker = -1,
                       .file = r->path,
                       .line = r->ok ? 0 : r->err->line,
                       .detail = text};
  det_emit(d, &ev);
}

/* The watcher saw a change: reload what changed, unless a tick or reload is
 * running (callbacks then). */
static void on_change(void *ud) {
  detector *d = ud;
  if (d->busy) return;
  d->busy = 1;
  policy_engine_reload(d->eng, 0); /* failures are events; the version in force stays */
  d->busy = 0;
}

int det_reload(detector *d, int force) { return policy_engine_reload(d->eng, force); }

int detector_watch(detector *d, struct event_base *base) { return policy_watch(d->eng, base); }

void detector_unwatch(detector *d) { policy_unwatch(d->eng); }

/* --- set-up --- */

/* The dry runs' world: worker 0 with DRY_STEPS steady steps (past every
 * warm-up) and a checksum at the last (heartbeat fresh), worker 1 known but
 * without a step or a heartbeat. */
static int dry_world_init(det_world *W) {
  W->max_workers = 2;
  W->now = 100;
  W->s = series_create(2, DET_M_COUNT, 32, 0.05);
  W->hb = malloc(2 * sizeof(double));
  W->first_seen = malloc(2 * sizeof(double));
  if (!W->s || !W->hb || !W->first_seen) return tr_fail(TR_ENOMEM, "detector: out of memory");
  for (int i = 1; i <= DRY_STEPS; i++) {
    double v[DET_M_COUNT] = {0};
    v[DET_M_LOSS] = 2.0 - 0.01 * i;
    v[DET_M_GRAD_NORM] = 1.0 + 0.01 * (i % 3);
    v[DET_M_LR] = 1e-3;
    v[DET_M_STEP_S] = 0.1;
    v[DET_M_DATA_S] = 0.01;
    v[DET_M_FORWARD_S] = 0.03;
    v[DET_M_BACKWARD_S] = 0.04;
    v[DET_M_ALLREDUCE_S] = 0.01;
    v[DET_M_OPTIMIZER_S] = 0.01;
    v[DET_M_TOKENS_PER_S] = 1e4;
    v[DET_M_RSS_BYTES] = 1e8;
    v[DET_M_COMPUTE_S] = 0.09;
    series_push(W->s, 0, i, 70 + i, v);
  }
  series_push_checksum(W->s, 0, DRY_STEPS, 0x12345678u);
  series_touch(W->s, 1);
  W->hb[0] = 99.5;
  W->first_seen[0] = 70;
  W->hb[1] = NAN;
  W->first_seen[1] = 99;
  return TR_OK;
}


int det_lua_init(detector *d) {
  policy_engine_opts eo = {.budget = d->o.budget,
                           .mem_limit = d->o.mem_limit,
                           .debounce_ms = d->o.debounce_ms,
                           .on_reload = on_reload,
                           .on_print = on_print,
                           .on_change = on_change,
                           .ud = d};
  d->eng = policy_engine_new(&eo);
  if (!d->eng) return tr_fail_prefix(TR_EINVAL, "detector");
  lua_State *L = d->L = policy_engine_lua(d->eng);
  det_views_init(L);
  lua_newtable(L);
  d->state_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_newtable(L);
  d->views_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  static const char *const names[DET_NFILES] = {"rules.lua", "actions.lua"};
  for (int i = 0; i < DET_NFILES; i++) {
    policy_opts po = {.name = names[i],
                      .dir = d->policy_dir,
                      .fallback_dir = d->fallback_dir,
                      .init_env = init_env,
                      .check = i == DET_FILE_RULES ? check_rules : check_actions,
                      .commit = i == DET_FILE_RULES ? commit_rules : NULL,
                      .ud = d};
    if (!(d->files[i] = policy_add(d->eng, &po))) return TR_ENOMEM;
  }
  return dry_world_init(&d->dry);
}

void det_lua_close(detector *d) {
  policy_engine_free(d->eng); /* the VM, and every ref into it */
  d->eng = NULL;
  d->L = NULL;
  series_free(d->dry.s);
  free(d->dry.hb);
  free(d->dry.first_seen);
}
