/* detector_lua.c — the Lua side of the detector: its VM (memory limit,
 * instruction-budget hook, the protected call every rule and policy goes
 * through), the sandbox the policy files run in, parsing what rules and
 * policies return, and loading/checking/swapping rules.lua and actions.lua.
 *
 * It does not run ticks or decide what happens to an anomaly (detector.c),
 * build the views (detector_views.c) or watch files (detector_watch.c).
 * Everything runs on the detector's thread.
 */
#include <lauxlib.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "detector_internal.h"
#include "lua_host.h"
#include "util.h"

#define DRY_STEPS 24 /* steps of the dry runs' synthetic worker */


/* --- the VM: memory limit, budget hook, protected call --- */

/* realloc/free like Lua's default allocator (the state is created with that
 * one and switched over), counting bytes; refuses to grow past mem_limit while
 * a rule or policy runs. */
static void *limited_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  detector *d = ud;
  size_t old = ptr ? osize : 0;
  if (nsize == 0) {
    free(ptr);
    d->mem_used -= old;
    return NULL;
  }
  if (d->mem_enforce && nsize > old && d->mem_used - old + nsize > d->mem_limit) return NULL;
  void *p = realloc(ptr, nsize);
  if (p) d->mem_used = d->mem_used - old + nsize;
  return p;
}

/* The count hook: the running rule is past its budget. The error names the
 * line it was on; the sandbox's pcall cannot swallow it (budget_hit). */
static void budget_hook(lua_State *L, lua_Debug *ar) {
  (void)ar;
  detector *d = det_of(L);
  d->budget_hit = 1;
  lua_Debug here;
  if (lua_getstack(L, 0, &here) && lua_getinfo(L, "Sl", &here) && here.currentline > 0)
    lua_pushfstring(L, "%s:%d: instruction budget of %d exceeded", here.short_src, here.currentline, d->budget);
  else
    lua_pushfstring(L, "instruction budget of %d exceeded", d->budget);
  lua_error(L);
}

/* "rules.lua:12: msg" -> file "rules.lua", line 12. When the message has no
 * position (an error raised with a table, out of memory), the innermost
 * policy-file frame of the traceback gives the line. */
static void err_parse(det_err *e, const char *msg, const char *tb) {
  snprintf(e->msg, sizeof e->msg, "%s", msg && *msg ? msg : "(no message)");
  e->file[0] = 0;
  e->line = 0;
  const char *c = strchr(e->msg, ':');
  if (c && c > e->msg && (size_t)(c - e->msg) < sizeof e->file && c[1] >= '0' && c[1] <= '9' && !memchr(e->msg, ' ', (size_t)(c - e->msg))) {
    char *end;
    long line = strtol(c + 1, &end, 10);
    if (*end == ':') {
      memcpy(e->file, e->msg, (size_t)(c - e->msg));
      e->file[c - e->msg] = 0;
      e->line = (int)line;
      return;
    }
  }
  static const char *const names[] = {"rules.lua:", "actions.lua:"};
  const char *best = NULL;
  int which = 0;
  for (int i = 0; i < 2 && tb; i++) {
    const char *p = strstr(tb, names[i]);
    if (p && (!best || p < best)) best = p, which = i;
  }
  if (best) {
    snprintf(e->file, sizeof e->file, "%.*s", (int)strlen(names[which]) - 1, names[which]);
    e->line = atoi(best + strlen(names[which]));
  }
}

int det_call(detector *d, int nargs, int nresults, det_err *e) {
  lua_State *L = d->L;
  d->budget_hit = 0;
  lua_sethook(L, budget_hook, LUA_MASKCOUNT, d->budget);
  d->mem_enforce = 1;
  int rc = lua_host_pcall(L, nargs, nresults);
  d->mem_enforce = 0;
  lua_sethook(L, NULL, 0, 0);
  if (rc == TR_OK) return TR_OK;
  err_parse(e, tr_error(), lua_host_traceback());
  e->budget = d->budget_hit;
  d->budget_hit = 0;
  return rc;
}

/* --- the sandbox --- */

/* pcall for policy files: like the real one, except that running out of
 * instructions or memory cannot be caught. */
static int sb_pcall(lua_State *L) {
  detector *d = det_of(L);
  luaL_checkany(L, 1);
  int status = lua_pcall(L, lua_gettop(L) - 1, LUA_MULTRET, 0);
  if (status != LUA_OK && (d->budget_hit || status == LUA_ERRMEM)) return lua_error(L);
  lua_pushboolean(L, status == LUA_OK);
  lua_insert(L, 1);
  return lua_gettop(L);
}

/* print(...) -> a "rule_print" event (at most DET_PRINTS a tick; silent in dry runs). */
static int sb_print(lua_State *L) {
  detector *d = det_of(L);
  if (d->dry_run || d->prints >= DET_PRINTS) return 0;
  d->prints++;
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  int n = lua_gettop(L);
  for (int i = 1; i <= n; i++) {
    if (i > 1) luaL_addchar(&b, '\t');
    luaL_tolstring(L, i, NULL);
    luaL_addvalue(&b);
  }
  luaL_pushresult(&b);
  detector_event e = {.type = DET_EV_PRINT, .kind = "rule_print", .step = -1, .worker = d->cur_worker,
                      .rule = d->cur_rule, .detail = lua_tostring(L, -1)};
  det_emit(d, &e);
  return 0;
}

static int sb_undefined(lua_State *L) {
  return luaL_error(L, "undefined global '%s'", lua_type(L, 2) == LUA_TSTRING ? lua_tostring(L, 2) : luaL_typename(L, 2));
}

/* Pushes a fresh sandbox environment: the safe base functions, copies of
 * math/string/table/utf8, os.time/os.clock, the guarded pcall, print, the
 * detector's `state`; reading any other global raises. */
static void push_env(detector *d) {
  lua_State *L = d->L;
  static const char *const base[] = {"assert", "error", "ipairs", "next", "pairs", "select", "tonumber",
                                     "tostring", "type", "rawequal", "rawlen", "rawget", "_VERSION", NULL};
  static const char *const libs[] = {"math", "string", "table", "utf8", NULL};
  lua_newtable(L); /* [env] */
  for (int i = 0; base[i]; i++) {
    lua_getglobal(L, base[i]);
    lua_setfield(L, -2, base[i]);
  }
  for (int i = 0; libs[i]; i++) {
    lua_newtable(L);         /* [env, copy] */
    lua_getglobal(L, libs[i]); /* [env, copy, lib] */
    lua_pushnil(L);
    while (lua_next(L, -2)) { /* [env, copy, lib, k, v] */
      lua_pushvalue(L, -2);   /* [env, copy, lib, k, v, k] */
      lua_insert(L, -2);      /* [env, copy, lib, k, k, v] */
      lua_settable(L, -5);    /* [env, copy, lib, k] */
    }
    lua_pop(L, 1); /* [env, copy] */
    if (strcmp(libs[i], "string") == 0) {
      lua_pushnil(L);
      lua_setfield(L, -2, "dump");
    }
    lua_setfield(L, -2, libs[i]); /* [env] */
  }
  lua_newtable(L);        /* [env, os'] */
  lua_getglobal(L, "os"); /* [env, os', os] */
  lua_getfield(L, -1, "time");
  lua_setfield(L, -3, "time");
  lua_getfield(L, -1, "clock");
  lua_setfield(L, -3, "clock");
  lua_pop(L, 1);
  lua_setfield(L, -2, "os"); /* [env] */
  lua_pushcfunction(L, sb_pcall);
  lua_setfield(L, -2, "pcall");
  lua_pushcfunction(L, sb_print);
  lua_setfield(L, -2, "print");
  lua_rawgeti(L, LUA_REGISTRYINDEX, d->state_ref);
  lua_setfield(L, -2, "state");
  lua_pushvalue(L, -1);
  lua_setfield(L, -2, "_G");
  lua_createtable(L, 0, 2); /* [env, meta] */
  lua_pushcfunction(L, sb_undefined);
  lua_setfield(L, -2, "__index");
  lua_pushboolean(L, 0);
  lua_setfield(L, -2, "__metatable");
  lua_setmetatable(L, -2); /* [env] */
}

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

/* --- loading policy files --- */

static uint64_t fnv1a(const void *p, size_t n) {
  const unsigned char *s = p;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
  return h;
}

static int cmp_rule(const void *a, const void *b) { return strcmp(((const det_rule *)a)->name, ((const det_rule *)b)->name); }

/* Line where the function at idx is defined, 0 if not a Lua function. */
static int fn_line(lua_State *L, int idx) {
  lua_Debug ar;
  lua_pushvalue(L, idx);
  if (!lua_getinfo(L, ">S", &ar)) return 0;
  return ar.linedefined > 0 ? ar.linedefined : 0;
}

static int fail_at(det_err *e, const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int fail_at(det_err *e, const char *file, int line, const char *fmt, ...) {
  char msg[DET_MSG];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (line > 0) snprintf(e->msg, sizeof e->msg, "%s:%d: %s", file, line, msg);
  else snprintf(e->msg, sizeof e->msg, "%s: %s", file, msg);
  snprintf(e->file, sizeof e->file, "%s", file);
  e->line = line;
  return TR_ELUA;
}

/* A dry call failed: prefix its message, keep its position. */
static int dry_failed(det_err *e, const char *what) {
  char msg[DET_MSG];
  snprintf(msg, sizeof msg, "%s", e->msg);
  snprintf(e->msg, sizeof e->msg, "dry run of %s: %s", what, msg);
  return TR_ELUA;
}

/* The rules table is at index t (its env at env). Checks it, dry-runs each
 * rule on the synthetic world, and on success swaps the rules in. */
static int check_rules(detector *d, int t, const char *file, det_err *e) {
  lua_State *L = d->L;
  det_rule nr[DET_MAX_RULES];
  int n = 0;
  lua_pushnil(L);
  while (lua_next(L, t)) { /* [.., k, v] */
    if (lua_type(L, -2) != LUA_TSTRING) {
      lua_pop(L, 2);
      return fail_at(e, file, 0, "the returned table has a %s key; rules are named by strings", luaL_typename(L, -2));
    }
    const char *name = lua_tostring(L, -2);
    if (!lua_isfunction(L, -1)) {
      int rc = fail_at(e, file, 0, "rule '%s' is a %s, expected a function(w, fleet, state)", name, luaL_typename(L, -1));
      lua_pop(L, 2);
      return rc;
    }
    if (n == DET_MAX_RULES || strlen(name) >= DET_NAME) {
      lua_pop(L, 2);
      return fail_at(e, file, 0, "at most %d rules with names shorter than %d bytes", DET_MAX_RULES, DET_NAME);
    }
    memset(&nr[n], 0, sizeof nr[n]);
    snprintf(nr[n].name, sizeof nr[n].name, "%s", name);
    nr[n].fn_ref = LUA_NOREF;
    n++;
    lua_pop(L, 1);
  }
  qsort(nr, (size_t)n, sizeof nr[0], cmp_rule);
  /* dry runs: a worker with a few steady steps and a worker with none */
  int rc = TR_OK;
  d->dry_run = 1;
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
        rc = fail_at(e, file, fn_line(L, lua_gettop(L)), "dry run: %s", err);
        lua_pop(L, 1);
      }
      lua_pop(L, 1);
    }
  }
  d->dry_run = 0;
  if (rc) return rc;
  /* swap in */
  for (int i = 0; i < d->nrules; i++) luaL_unref(L, LUA_REGISTRYINDEX, d->rules[i].fn_ref);
  for (int i = 0; i < n; i++) {
    lua_getfield(L, t, nr[i].name);
    nr[i].fn_ref = luaL_ref(L, LUA_REGISTRYINDEX);
    d->rules[i] = nr[i];
  }
  d->nrules = n;
  return TR_OK;
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

static int check_actions(detector *d, int t, const char *file, det_err *e) {
  lua_State *L = d->L;
  int rc = TR_OK;
  d->dry_run = 1;
  lua_pushnil(L);
  while (!rc && lua_next(L, t)) { /* [.., k, v] */
    int v = lua_gettop(L);
    if (lua_type(L, -2) != LUA_TSTRING) {
      rc = fail_at(e, file, 0, "the returned table has a %s key; expected anomaly kinds", luaL_typename(L, -2));
    } else if (lua_type(L, v) == LUA_TSTRING) {
      if (detector_action_index(lua_tostring(L, v)) < 0)
        rc = fail_at(e, file, 0, "%s = '%s': unknown action (ignore, alert, evict, rollback, skip_update, checkpoint_now)",
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
          rc = fail_at(e, file, fn_line(L, v), "dry run of policy '%s': %s", kind, err);
        lua_pop(L, 1);
      }
    } else {
      rc = fail_at(e, file, 0, "%s is a %s; expected an action name or a function(anomaly, state, fleet)",
                   lua_tostring(L, -2), luaL_typename(L, v));
    }
    lua_pop(L, 1); /* [.., k] */
    if (rc) lua_pop(L, 1);
  }
  d->dry_run = 0;
  if (rc) return rc;
  luaL_unref(L, LUA_REGISTRYINDEX, d->actions_ref);
  lua_pushvalue(L, t);
  d->actions_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  return TR_OK;
}

/* Compiles buf in a fresh sandbox, runs it, checks and dry-runs what it
 * returns; swaps it in only if all of that worked. */
static int load_one(detector *d, int which, const char *buf, size_t len, det_err *e) {
  lua_State *L = d->L;
  det_file *f = &d->files[which];
  int top = lua_gettop(L), rc;
  char chunk[DET_NAME + 2];
  snprintf(chunk, sizeof chunk, "@%s", f->name);
  if (luaL_loadbufferx(L, buf, len, chunk, "t") != LUA_OK) { /* [chunk | msg] */
    err_parse(e, lua_tostring(L, -1), NULL);
    lua_settop(L, top);
    return TR_ELUA;
  }
  push_env(d);              /* [chunk, env] */
  lua_pushvalue(L, -1);     /* [chunk, env, env] */
  lua_setupvalue(L, -3, 1); /* _ENV of the chunk: [chunk, env] */
  lua_insert(L, -2);        /* [env, chunk] */
  int env = lua_gettop(L) - 1;
  d->cur_rule = f->name;
  d->dry_run = 1; /* top-level prints of a file being loaded are not events */
  rc = det_call(d, 0, 1, e); /* [env, result] */
  d->dry_run = 0;
  if (rc) {
    lua_settop(L, top);
    return rc;
  }
  if (!lua_istable(L, -1)) {
    rc = fail_at(e, f->name, 0, "must return a table, returned a %s", luaL_typename(L, -1));
    lua_settop(L, top);
    return rc;
  }
  /* dry runs must not touch the real state through the global either */
  lua_newtable(L);
  lua_setfield(L, env, "state");
  rc = which == DET_FILE_RULES ? check_rules(d, lua_gettop(L), f->name, e) : check_actions(d, lua_gettop(L), f->name, e);
  lua_rawgeti(L, LUA_REGISTRYINDEX, d->state_ref);
  lua_setfield(L, env, "state");
  if (rc == TR_OK) {
    luaL_unref(L, LUA_REGISTRYINDEX, f->env_ref);
    lua_pushvalue(L, env);
    f->env_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  }
  lua_settop(L, top);
  lua_gc(L, LUA_GCCOLLECT, 0); /* drop the old version's closures now, not at the next cycle */
  return rc;
}

static void reload_event(detector *d, det_file *f, const char *path, int ok, const det_err *e, int at_create) {
  char detail[DET_MSG + 160];
  if (ok && f == &d->files[DET_FILE_RULES]) {
    int k = snprintf(detail, sizeof detail, "%s in force: %d rules (", f->name, d->nrules);
    for (int i = 0; i < d->nrules && k < (int)sizeof detail; i++)
      k += snprintf(detail + k, sizeof detail - (size_t)k, "%s%s", i ? ", " : "", d->rules[i].name);
    if (k < (int)sizeof detail) snprintf(detail + k, sizeof detail - (size_t)k, ")");
  } else if (ok) {
    snprintf(detail, sizeof detail, "%s in force", f->name);
  } else if (at_create || !f->path[0]) {
    snprintf(detail, sizeof detail, "%s", e->msg);
  } else {
    snprintf(detail, sizeof detail, "%s; the previous version stays in force", e->msg);
  }
  detector_event ev = {.type = ok ? DET_EV_RELOAD : DET_EV_RELOAD_FAILED,
                       .kind = ok ? "policy_reload" : "policy_reload_failed",
                       .step = -1,
                       .worker = -1,
                       .file = path,
                       .line = ok ? 0 : e->line,
                       .detail = detail};
  det_emit(d, &ev);
}

static int reload_file(detector *d, int which, int force, int at_create) {
  det_file *f = &d->files[which];
  char path[PATH_MAX];
  struct stat st;
  det_err e;
  memset(&e, 0, sizeof e);
  snprintf(path, sizeof path, "%s/%s", d->policy_dir, f->name);
  if (stat(path, &st) != 0) {
    if (at_create) snprintf(path, sizeof path, "%s/%s", d->fallback_dir, f->name);
    else if (strcmp(path, f->path) != 0) return TR_OK; /* in force from the fallback folder: nothing here to load */
  }
  size_t len;
  char *buf = tr_read_file(path, &len);
  if (!buf) {
    snprintf(e.msg, sizeof e.msg, "%s", tr_error());
    d->reload_failures_total++;
    reload_event(d, f, path, 0, &e, at_create);
    return tr_fail(TR_EIO, "%s", e.msg);
  }
  uint64_t h = fnv1a(buf, len);
  if (!force && !at_create && ((h == f->hash && strcmp(path, f->path) == 0) || h == f->failed_hash)) {
    free(buf);
    return TR_OK; /* unchanged, or the same bytes that already failed */
  }
  int rc = load_one(d, which, buf, len, &e);
  free(buf);
  if (rc == TR_OK) {
    f->hash = h;
    f->failed_hash = 0;
    snprintf(f->path, sizeof f->path, "%s", path);
    d->reloads_total++;
    reload_event(d, f, path, 1, &e, at_create);
    return TR_OK;
  }
  f->failed_hash = h;
  d->reload_failures_total++;
  reload_event(d, f, path, 0, &e, at_create);
  return tr_fail(TR_ELUA, "%s (%s)", e.msg, path);
}

int det_reload(detector *d, int force, int at_create) {
  int rc = TR_OK;
  char first[DET_MSG + PATH_MAX];
  first[0] = 0;
  for (int i = 0; i < DET_NFILES; i++) {
    int r = reload_file(d, i, force, at_create);
    if (r && !rc) {
      rc = r;
      snprintf(first, sizeof first, "%s", tr_error());
    }
  }
  return rc ? tr_fail(rc, "%s", first) : TR_OK;
}

/* --- VM set-up --- */

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
  lua_State *L = lua_host_new();
  if (!L) return TR_ENOMEM;
  d->L = L;
  *(detector **)lua_getextraspace(L) = d;
  d->mem_used = (size_t)lua_gc(L, LUA_GCCOUNT, 0) * 1024 + (size_t)lua_gc(L, LUA_GCCOUNTB, 0);
  lua_setallocf(L, limited_alloc, d);
  det_views_init(L);
  lua_newtable(L);
  d->state_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_newtable(L);
  d->views_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  d->actions_ref = LUA_NOREF;
  for (int i = 0; i < DET_NFILES; i++) d->files[i].env_ref = LUA_NOREF;
  return dry_world_init(&d->dry);
}

void det_lua_close(detector *d) {
  if (d->L) lua_host_close(d->L);
  d->L = NULL;
  series_free(d->dry.s);
  free(d->dry.hb);
  free(d->dry.first_seen);
}
