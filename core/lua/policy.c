/* policy.c — the policy engine (see policy.h): its VM (memory cap, the
 * instruction-budget hook, the protected call every policy function goes
 * through), the sandbox policy files run in, and loading, checking and
 * swapping a file in, keeping the old version on any failure.
 *
 * It does not watch files (policy_watch.c), parse what a policy returns or
 * dry-run it (the caller's check: detector/detector_lua.c,
 * core/fleet/operator.c), or write events (the caller's on_reload). Every
 * function runs on the engine's thread.
 */
#include <lauxlib.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "lua_host.h"
#include "policy_internal.h"
#include "util.h"

static policy_engine *engine_of(lua_State *L) { return *(policy_engine **)lua_getextraspace(L); }

void *policy_engine_ud(lua_State *L) { return engine_of(L)->o.ud; }

lua_State *policy_engine_lua(policy_engine *e) { return e->L; }

long policy_engine_budget(const policy_engine *e) { return e->budget; }

int policy_engine_dry_run(const policy_engine *e) { return e->dry_run; }

const char *policy_name(const policy *p) { return p->name; }

const char *policy_path(const policy *p) { return p->path; }

/* --- the VM: memory cap, budget hook, protected call --- */

/* realloc/free like Lua's default allocator (the state is created with that
 * one and switched over), counting bytes; refuses to grow past mem_limit while
 * a policy runs. */
static void *limited_alloc(void *ud, void *ptr, size_t osize, size_t nsize) {
  policy_engine *e = ud;
  size_t old = ptr ? osize : 0;
  if (nsize == 0) {
    free(ptr);
    e->mem_used -= old;
    return NULL;
  }
  if (e->mem_enforce && nsize > old && e->mem_used - old + nsize > e->mem_limit) return NULL;
  void *p = realloc(ptr, nsize);
  if (p) e->mem_used = e->mem_used - old + nsize;
  return p;
}

/* The count hook: the running policy is past its budget. The error names the
 * line it was on; the sandbox's pcall cannot swallow it (budget_hit). */
static void budget_hook(lua_State *L, lua_Debug *ar) {
  (void)ar;
  policy_engine *e = engine_of(L);
  e->budget_hit = 1;
  lua_Debug here;
  if (lua_getstack(L, 0, &here) && lua_getinfo(L, "Sl", &here) && here.currentline > 0)
    lua_pushfstring(L, "%s:%d: instruction budget of %d exceeded", here.short_src, here.currentline, e->budget);
  else
    lua_pushfstring(L, "instruction budget of %d exceeded", e->budget);
  lua_error(L);
}

/* "rules.lua:12: msg" -> file "rules.lua", line 12. When the message has no
 * position (an error raised with a table, out of memory), the innermost
 * frame of one of the engine's policy files in the traceback gives it. */
static void err_parse(policy_engine *e, policy_err *err, const char *msg, const char *tb) {
  snprintf(err->msg, sizeof err->msg, "%s", msg && *msg ? msg : "(no message)");
  err->file[0] = 0;
  err->line = 0;
  const char *c = strchr(err->msg, ':');
  if (c && c > err->msg && (size_t)(c - err->msg) < sizeof err->file && c[1] >= '0' && c[1] <= '9' &&
      !memchr(err->msg, ' ', (size_t)(c - err->msg))) {
    char *end;
    long line = strtol(c + 1, &end, 10);
    if (*end == ':') {
      memcpy(err->file, err->msg, (size_t)(c - err->msg));
      err->file[c - err->msg] = 0;
      err->line = (int)line;
      return;
    }
  }
  const char *best = NULL;
  const policy *which = NULL;
  for (const policy *p = e->policies; p && tb; p = p->next) {
    char key[POLICY_NAME + 2];
    snprintf(key, sizeof key, "%s:", p->name);
    const char *at = strstr(tb, key);
    if (at && (!best || at < best)) best = at, which = p;
  }
  if (best) {
    snprintf(err->file, sizeof err->file, "%s", which->name);
    err->line = atoi(best + strlen(which->name) + 1);
  }
}

int policy_call(policy_engine *e, int nargs, int nresults, policy_err *err) {
  lua_State *L = e->L;
  e->budget_hit = 0;
  lua_sethook(L, budget_hook, LUA_MASKCOUNT, e->budget);
  e->mem_enforce = 1;
  int rc = lua_host_pcall(L, nargs, nresults);
  e->mem_enforce = 0;
  lua_sethook(L, NULL, 0, 0);
  if (rc == TR_OK) return TR_OK;
  err_parse(e, err, tr_error(), lua_host_traceback());
  err->budget = e->budget_hit;
  e->budget_hit = 0;
  return tr_fail(TR_ELUA, "%s", err->msg);
}

/* --- the sandbox --- */

/* pcall for policy files: like the real one, except that running out of
 * instructions or memory cannot be caught. */
static int sb_pcall(lua_State *L) {
  policy_engine *e = engine_of(L);
  luaL_checkany(L, 1);
  int status = lua_pcall(L, lua_gettop(L) - 1, LUA_MULTRET, 0);
  if (status != LUA_OK && (e->budget_hit || status == LUA_ERRMEM)) return lua_error(L);
  lua_pushboolean(L, status == LUA_OK);
  lua_insert(L, 1);
  return lua_gettop(L);
}

/* print(...) -> on_print (silent while loading and in dry runs). */
static int sb_print(lua_State *L) {
  policy_engine *e = engine_of(L);
  if (e->dry_run || !e->o.on_print) return 0;
  int n = lua_gettop(L); /* before luaL_buffinit, which may push a placeholder */
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  for (int i = 1; i <= n; i++) {
    if (i > 1) luaL_addchar(&b, '\t');
    luaL_tolstring(L, i, NULL);
    luaL_addvalue(&b);
  }
  luaL_pushresult(&b);
  e->o.on_print(e->o.ud, lua_tostring(L, -1));
  return 0;
}

/* __index and __newindex of a sandbox: a global that does not exist. Level 1
 * of the error position is the policy code that touched it. */
static int sb_undefined(lua_State *L) {
  return luaL_error(L, "undefined global '%s'", lua_type(L, 2) == LUA_TSTRING ? lua_tostring(L, 2) : luaL_typename(L, 2));
}

/* Pushes a fresh sandbox for p: the safe base functions, copies of
 * math/string/table/utf8, os.time/os.clock, the guarded pcall, print, the
 * caller's globals; then sealed: reading or assigning any other global
 * raises. */
static void push_env(policy *p) {
  lua_State *L = p->e->L;
  static const char *const base[] = {"assert", "error", "ipairs", "next", "pairs", "select", "tonumber",
                                     "tostring", "type", "rawequal", "rawlen", "rawget", "_VERSION", NULL};
  static const char *const libs[] = {"math", "string", "table", "utf8", NULL};
  lua_newtable(L); /* [env] */
  for (int i = 0; base[i]; i++) {
    lua_getglobal(L, base[i]);
    lua_setfield(L, -2, base[i]);
  }
  for (int i = 0; libs[i]; i++) {
    lua_newtable(L);           /* [env, copy] */
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
  lua_pushvalue(L, -1);
  lua_setfield(L, -2, "_G");
  if (p->o.init_env) p->o.init_env(p->o.ud, L, lua_gettop(L));
  lua_createtable(L, 0, 3); /* [env, meta] */
  lua_pushcfunction(L, sb_undefined);
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, sb_undefined);
  lua_setfield(L, -2, "__newindex");
  lua_pushboolean(L, 0);
  lua_setfield(L, -2, "__metatable");
  lua_setmetatable(L, -2); /* [env] */
}

/* --- the engine --- */

policy_engine *policy_engine_new(const policy_engine_opts *o) {
  policy_engine_opts def;
  if (!o) {
    memset(&def, 0, sizeof def);
    o = &def;
  }
  long budget = o->budget ? o->budget : 200000;
  size_t mem_limit = o->mem_limit ? o->mem_limit : (size_t)64 << 20;
  if (budget < 1000 || budget > INT_MAX || mem_limit < (1u << 20)) {
    tr_fail(TR_EINVAL, "policy engine: bad options (budget %ld: 1000..%d; mem_limit >= 1 MiB)", budget, INT_MAX);
    return NULL;
  }
  policy_engine *e = calloc(1, sizeof *e);
  if (!e) {
    tr_fail(TR_ENOMEM, "policy engine: out of memory");
    return NULL;
  }
  e->o = *o;
  if (e->o.debounce_ms <= 0) e->o.debounce_ms = 200;
  e->budget = (int)budget;
  e->mem_limit = mem_limit;
  e->ino_fd = -1;
  e->L = lua_host_new();
  if (!e->L) {
    free(e);
    return NULL;
  }
  lua_host_bound_library(e->L); /* before any sandbox copies string and table */
  *(policy_engine **)lua_getextraspace(e->L) = e;
  e->mem_used = (size_t)lua_gc(e->L, LUA_GCCOUNT, 0) * 1024 + (size_t)lua_gc(e->L, LUA_GCCOUNTB, 0);
  lua_setallocf(e->L, limited_alloc, e);
  return e;
}

void policy_engine_free(policy_engine *e) {
  if (!e) return;
  policy_unwatch(e);
  lua_host_close(e->L);
  for (policy *p = e->policies, *next; p; p = next) {
    next = p->next;
    free(p);
  }
  free(e);
}

/* --- policy files --- */

policy *policy_add(policy_engine *e, const policy_opts *o) {
  if (!o || !o->name || !*o->name || strchr(o->name, '/') || strlen(o->name) >= POLICY_NAME || !o->dir ||
      strlen(o->dir) + strlen(o->name) + 2 > PATH_MAX ||
      (o->fallback_dir && strlen(o->fallback_dir) + strlen(o->name) + 2 > PATH_MAX)) {
    tr_fail(TR_EINVAL, "policy_add: a file name (no '/', < %d bytes) and a folder are needed", POLICY_NAME);
    return NULL;
  }
  policy *p = calloc(1, sizeof *p);
  if (!p) {
    tr_fail(TR_ENOMEM, "policy_add: out of memory");
    return NULL;
  }
  p->e = e;
  p->o = *o;
  snprintf(p->name, sizeof p->name, "%s", o->name);
  snprintf(p->dir, sizeof p->dir, "%s", o->dir);
  if (o->fallback_dir) snprintf(p->fallback_dir, sizeof p->fallback_dir, "%s", o->fallback_dir);
  p->o.name = p->name;
  p->o.dir = p->dir;
  p->o.fallback_dir = o->fallback_dir ? p->fallback_dir : NULL;
  p->mod_ref = LUA_NOREF;
  p->wd = p->twd = -1;
  if (e->ino_fd >= 0 && policy_watch_add(e, p)) {
    free(p);
    return NULL;
  }
  policy **tail = &e->policies;
  while (*tail) tail = &(*tail)->next;
  *tail = p;
  return p;
}

int policy_push(const policy *p) { return lua_rawgeti(p->e->L, LUA_REGISTRYINDEX, p->mod_ref); }

int policy_fail(policy_err *err, const char *file, int line, const char *fmt, ...) {
  char msg[POLICY_MSG];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (line > 0) snprintf(err->msg, sizeof err->msg, "%s:%d: %s", file, line, msg);
  else snprintf(err->msg, sizeof err->msg, "%s: %s", file, msg);
  snprintf(err->file, sizeof err->file, "%s", file);
  err->line = line;
  err->budget = 0;
  return TR_ELUA;
}

int policy_fn_line(lua_State *L, int idx) {
  lua_Debug ar;
  lua_pushvalue(L, idx);
  if (!lua_getinfo(L, ">S", &ar)) return 0;
  return ar.linedefined > 0 ? ar.linedefined : 0;
}

static uint64_t fnv1a(const void *b, size_t n) {
  const unsigned char *s = b;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
  return h;
}

/* Compiles buf into a fresh sandbox, runs it, checks what it returns;
 * commits it only if all of that worked. */
static int load_one(policy *p, const char *buf, size_t len, policy_err *err) {
  policy_engine *e = p->e;
  lua_State *L = e->L;
  int top = lua_gettop(L), rc;
  char chunk[POLICY_NAME + 2];
  snprintf(chunk, sizeof chunk, "@%s", p->name);
  if (luaL_loadbufferx(L, buf, len, chunk, "t") != LUA_OK) { /* [chunk | msg] */
    err_parse(e, err, lua_tostring(L, -1), NULL);
    lua_settop(L, top);
    return TR_ELUA;
  }
  push_env(p);              /* [chunk, env] */
  lua_pushvalue(L, -1);     /* [chunk, env, env] */
  lua_setupvalue(L, -3, 1); /* _ENV of the chunk: [chunk, env] */
  lua_insert(L, -2);        /* [env, chunk] */
  int env = lua_gettop(L) - 1;
  rc = policy_call(e, 0, 1, err); /* [env, result] */
  if (rc) goto done;
  if (!lua_istable(L, -1)) {
    rc = policy_fail(err, p->name, 0, "must return a table, returned a %s", luaL_typename(L, -1));
    goto done;
  }
  int mod = lua_gettop(L);
  if (p->o.check && (rc = p->o.check(p->o.ud, L, mod, env, err))) goto done;
  lua_settop(L, mod);
  if (p->o.commit) p->o.commit(p->o.ud, L, mod);
  lua_settop(L, mod);
  luaL_unref(L, LUA_REGISTRYINDEX, p->mod_ref);
  p->mod_ref = luaL_ref(L, LUA_REGISTRYINDEX); /* pops mod */
done:
  lua_settop(L, top);
  lua_gc(L, LUA_GCCOLLECT, 0); /* drop the old version's (or the refused one's) closures now */
  return rc;
}

static void report(policy *p, const char *path, int ok, int first, const policy_err *err) {
  policy_engine *e = p->e;
  if (!e->o.on_reload) return;
  char detail[POLICY_MSG + 64];
  if (ok) snprintf(detail, sizeof detail, "%s in force", p->name);
  else if (first) snprintf(detail, sizeof detail, "%s", err->msg);
  else snprintf(detail, sizeof detail, "%s; the previous version stays in force", err->msg);
  policy_reload_info r = {.p = p, .name = p->name, .path = path, .ok = ok, .first = first, .err = ok ? NULL : err,
                          .detail = detail};
  e->o.on_reload(e->o.ud, &r);
}

int policy_reload(policy *p, int force) {
  policy_engine *e = p->e;
  if (e->loading) return tr_fail(TR_ESTATE, "policy_reload: %s is being loaded", p->name);
  char path[PATH_MAX];
  struct stat st;
  policy_err err;
  memset(&err, 0, sizeof err);
  int first = !p->path[0];
  snprintf(path, sizeof path, "%s/%s", p->dir, p->name);
  if (stat(path, &st) != 0) {
    if (first && p->fallback_dir[0]) snprintf(path, sizeof path, "%s/%s", p->fallback_dir, p->name);
    else if (!first && strcmp(path, p->path) != 0) return TR_OK; /* in force from the fallback: nothing here */
  }
  size_t len;
  char *buf = tr_read_file(path, &len);
  if (!buf) {
    snprintf(err.msg, sizeof err.msg, "%s", tr_error());
    snprintf(err.file, sizeof err.file, "%s", p->name);
    report(p, path, 0, first, &err);
    return tr_fail(TR_EIO, "%s", err.msg);
  }
  uint64_t h = fnv1a(buf, len);
  if (!force && !first && ((h == p->hash && strcmp(path, p->path) == 0) || h == p->failed_hash)) {
    free(buf);
    return TR_OK; /* unchanged, or the same bytes that already failed */
  }
  e->loading = e->dry_run = 1; /* the top level and the checks: print() is silent */
  int rc = load_one(p, buf, len, &err);
  e->loading = e->dry_run = 0;
  free(buf);
  if (rc == TR_OK) {
    p->hash = h;
    p->failed_hash = 0;
    snprintf(p->path, sizeof p->path, "%s", path);
    report(p, path, 1, first, NULL);
    return TR_OK;
  }
  p->failed_hash = h;
  report(p, path, 0, first, &err);
  return tr_fail(TR_ELUA, "%s (%s)", err.msg, path);
}

int policy_engine_reload(policy_engine *e, int force) {
  int rc = TR_OK;
  char first[POLICY_MSG + PATH_MAX];
  first[0] = 0;
  for (policy *p = e->policies; p; p = p->next) {
    int r = policy_reload(p, force);
    if (r && !rc) {
      rc = r;
      snprintf(first, sizeof first, "%s", tr_error());
    }
  }
  return rc ? tr_fail(rc, "%s", first) : TR_OK;
}
