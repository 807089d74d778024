/* test_policy.c — the one policy engine (core/lua/policy.c) and the
 * operator's restart policy on it (core/fleet/operator_policy.c).
 *
 * The engine on its own: the sandbox is sealed (no io, os.execute, require,
 * load, dofile, ...; binary chunks refused); reading or assigning an
 * undefined global is an error naming file:line; an endless loop, also one
 * wrapped in pcall, is stopped by the instruction budget and the VM goes on;
 * the memory cap holds and pcall cannot swallow it; errors come back as
 * {msg, file, line}; a reload goes load -> check -> commit and any failure
 * (syntax, runtime, a refusing check, a dry run over budget) keeps the old
 * version with an on_reload naming the line; unchanged bytes are skipped; the
 * fallback folder serves the first load; inotify picks up a rename-save.
 *
 * The restart policy (white-box: operator_internal.h, no workers spawned): a
 * restart.lua with a misspelled global, at the top level or in a handler, or
 * a misspelled handler is refused at load with restart.lua:LINE; an endless
 * loop in on_failure is stopped by the budget, events.jsonl gets a
 * policy_error naming the line, and the operator falls back to replacing
 * the replica; a hot-reloaded restart.lua changes the decision; a broken save
 * keeps the old one in force with a policy_reload_failed event; the policy's
 * state survives reloads. Event loops run bounded.
 *
 * The host cordons (operator_hosts.c with the shipped hosts.lua): cordon by
 * address takes every host at it; a hand cordon outlasts trust_after, a
 * policy cordon does not; uncordon by name or address lifts it.
 */
#include <event2/event.h>
#include <lauxlib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "lua_host.h"
#include "operator_internal.h"
#include "policy.h"
#include "util.h"

static char tdir[512];

static void write_file(const char *dir, const char *name, const char *text, size_t len) {
  char path[1024], tmp[1100];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  snprintf(tmp, sizeof tmp, "%s/.%s.tmp", dir, name);
  FILE *f = fopen(tmp, "wb");
  if (!f || fwrite(text, 1, len, f) != len || fclose(f) != 0) {
    fprintf(stderr, "cannot write %s\n", tmp);
    exit(1); /* ok-exit: test set-up */
  }
  rename(tmp, path); /* an editor's rename-save */
}

static void put(const char *dir, const char *name, const char *text) { write_file(dir, name, text, strlen(text)); }

static void subdir(char *out, size_t n, const char *name) {
  snprintf(out, n, "%s/%s", tdir, name);
  if (tr_mkdirs(out)) {
    fprintf(stderr, "%s\n", tr_error());
    exit(1); /* ok-exit: test set-up */
  }
}

/* 1-based line of the first occurrence of needle in text. */
static int line_of(const char *text, const char *needle) {
  const char *at = strstr(text, needle);
  int line = 1;
  for (const char *p = text; at && p < at; p++) line += *p == '\n';
  return at ? line : -1;
}

/* --- what the engine reports --- */

typedef struct {
  int ok, first, line;
  char name[64], path[1024], detail[1024];
} cap_reload;

#define CAP_MAX 64
static cap_reload reloads[CAP_MAX];
static int nreloads;
static char printed[256];

static void on_reload(void *ud, const policy_reload_info *r) {
  (void)ud;
  if (nreloads == CAP_MAX) return;
  cap_reload *c = &reloads[nreloads++];
  c->ok = r->ok;
  c->first = r->first;
  c->line = r->ok ? 0 : r->err->line;
  snprintf(c->name, sizeof c->name, "%s", r->name ? r->name : "");
  snprintf(c->path, sizeof c->path, "%s", r->path);
  snprintf(c->detail, sizeof c->detail, "%s", r->detail);
}

static void on_print(void *ud, const char *text) {
  (void)ud;
  snprintf(printed, sizeof printed, "%s", text);
}

static const cap_reload *last_reload(void) { return nreloads ? &reloads[nreloads - 1] : NULL; }

static policy_engine *engine(long budget, size_t mem) {
  policy_engine_opts o = {.budget = budget, .mem_limit = mem, .debounce_ms = 50, .on_reload = on_reload,
                          .on_print = on_print};
  policy_engine *e = policy_engine_new(&o);
  if (!e) fprintf(stderr, "policy_engine_new: %s\n", tr_error());
  return e;
}

/* Calls M[fn](arg) and returns its integer result (-1 on error, err filled). */
static long long call_int(policy_engine *e, policy *p, const char *fn, long long arg, policy_err *err) {
  lua_State *L = policy_engine_lua(e);
  int top = lua_gettop(L);
  policy_push(p);
  lua_getfield(L, -1, fn);
  lua_pushinteger(L, arg);
  long long r = -1;
  if (policy_call(e, 1, 1, err) == 0) r = lua_isinteger(L, -1) ? (long long)lua_tointeger(L, -1) : -2;
  lua_settop(L, top);
  return r;
}

/* M.version of the table in force, -1 if none. */
static long long version(policy *p, policy_engine *e) {
  lua_State *L = policy_engine_lua(e);
  int top = lua_gettop(L);
  long long v = -1;
  if (policy_push(p) == LUA_TTABLE && lua_getfield(L, -1, "version") == LUA_TNUMBER) v = lua_tointeger(L, -1);
  lua_settop(L, top);
  return v;
}

/* --- the sandbox and strict globals --- */

typedef struct {
  char buf[4096];
  size_t n;
} dump_buf;

static int dump_writer(lua_State *L, const void *b, size_t n, void *ud) {
  (void)L;
  dump_buf *d = ud;
  if (d->n + n > sizeof d->buf) return 1;
  memcpy(d->buf + d->n, b, n);
  d->n += n;
  return 0;
}

static void test_sandbox(void) {
  char dir[600];
  subdir(dir, sizeof dir, "sandbox");
  nreloads = 0;
  policy_engine *e = engine(0, 0);
  policy_opts po = {.name = "t.lua", .dir = dir};
  policy *p = e ? policy_add(e, &po) : NULL;
  CHECK(p != NULL, "policy_add: %s", tr_error());
  if (!p) return;
  const char *probe =
      "local M = {}\n"
      "local holes = {}\n"
      "for _, name in ipairs({'io', 'require', 'load', 'loadstring', 'dofile', 'loadfile', 'package', 'debug',\n"
      "                       'collectgarbage', 'coroutine', 'setmetatable', 'getmetatable', 'rawset', 'xpcall'}) do\n"
      "  if rawget(_G, name) ~= nil then holes[#holes + 1] = name end\n"
      "end\n"
      "if os.execute ~= nil or os.getenv ~= nil or os.remove ~= nil then holes[#holes + 1] = 'os' end\n"
      "if type(os.time) ~= 'function' or type(os.clock) ~= 'function' then holes[#holes + 1] = 'os.time' end\n"
      "if string.dump ~= nil then holes[#holes + 1] = 'string.dump' end\n"
      "local ok, err = pcall(function() return io end)\n"
      "if ok or not err:find(\"t.lua:10: undefined global 'io'\", 1, true) then holes[#holes + 1] = 'read' end\n"
      "ok, err = pcall(function() helper = 1 end)\n"
      "if ok or not err:find(\"t.lua:12: undefined global 'helper'\", 1, true) then holes[#holes + 1] = 'write' end\n"
      "math.floor = nil -- a copy: the host's math is untouched\n"
      "print('quiet while loading')\n"
      "M.holes = table.concat(holes, ' ')\n"
      "function M.say(x) print('said', x) return 1 end\n"
      "return M\n";
  put(dir, "t.lua", probe);
  CHECK(policy_reload(p, 1) == 0, "probe loads: %s", tr_error());
  const cap_reload *r = last_reload();
  CHECK(r && r->ok && r->first && strstr(r->detail, "t.lua in force"), "on_reload: in force");
  lua_State *L = policy_engine_lua(e);
  policy_push(p);
  lua_getfield(L, -1, "holes");
  CHECK(lua_isstring(L, -1) && strcmp(lua_tostring(L, -1), "") == 0, "sandbox sealed: holes '%s'", lua_tostring(L, -1));
  lua_pop(L, 2);
  CHECK(printed[0] == 0, "print() is silent while loading");
  policy_err err;
  CHECK(call_int(e, p, "say", 7, &err) == 1 && strcmp(printed, "said\t7") == 0, "print() reaches on_print: '%s'",
        printed);
  lua_getglobal(L, "math");
  lua_getfield(L, -1, "floor");
  CHECK(lua_isfunction(L, -1), "the host's math.floor untouched");
  lua_pop(L, 2);

  /* strict globals at load: the message and on_reload name file and line */
  put(dir, "t.lua", "local M = {}\nM.version = 1\nreturn M\n");
  CHECK(policy_reload(p, 0) == 0, "a good version");
  nreloads = 0;
  put(dir, "t.lua", "local M = {}\n\nlocal limit = max_restart * 2\nreturn M\n");
  int rc = policy_reload(p, 0);
  r = last_reload();
  CHECK(rc == TR_ELUA && strstr(tr_error(), "t.lua:3: undefined global 'max_restart'"), "misspelled read: %s",
        tr_error());
  CHECK(r && !r->ok && !r->first && r->line == 3 && strstr(r->detail, "previous version stays in force"),
        "on_reload names line 3: %d %s", r ? r->line : -1, r ? r->detail : "-");
  put(dir, "t.lua", "local M = {}\nM.version = 2\n\nfunction helper() end\nreturn M\n");
  rc = policy_reload(p, 0);
  CHECK(rc == TR_ELUA && strstr(tr_error(), "t.lua:4: undefined global 'helper'"), "assigning a global: %s",
        tr_error());
  put(dir, "t.lua", "return { r = function() return require('os') end, version = 3 }\n");
  CHECK(policy_reload(p, 0) == 0, "a file only mentioning require loads (nothing checks r)");
  CHECK(call_int(e, p, "r", 0, &err) == -1 && strstr(err.msg, "t.lua:1: undefined global 'require'") &&
            err.line == 1 && strcmp(err.file, "t.lua") == 0,
        "require is absent at call time: %s (%s:%d)", err.msg, err.file, err.line);
  /* a binary chunk is refused ("t" mode only) */
  dump_buf b = {.n = 0};
  luaL_loadstring(L, "return { version = 9 }");
  CHECK(lua_dump(L, dump_writer, &b, 1) == 0 && b.n > 4, "dumped a binary chunk");
  lua_pop(L, 1);
  write_file(dir, "t.lua", b.buf, b.n);
  rc = policy_reload(p, 0);
  CHECK(rc == TR_ELUA && strstr(tr_error(), "binary"), "binary chunk refused: %s", tr_error());
  CHECK(version(p, e) == 3, "the version in force stays: %lld", version(p, e));
  put(dir, "t.lua", "return 42\n");
  CHECK(policy_reload(p, 0) == TR_ELUA && strstr(tr_error(), "must return a table"), "not a table: %s", tr_error());
  policy_engine_free(e);
}

/* --- budget, memory, structured errors --- */

static void test_budget_memory(void) {
  char dir[600];
  subdir(dir, sizeof dir, "budget");
  const char *src =
      "local M = {}\n"
      "function M.spin(x)\n"
      "  while true do end\n"
      "end\n"
      "function M.sneaky(x)\n"
      "  while true do pcall(function() while true do end end) end\n"
      "end\n"
      "function M.double(x) return 2 * x end\n"
      "function M.hog(x) local s = string.rep('x', 1 << 26) return #s end\n"
      "function M.hog_in_pcall(x) local ok = pcall(string.rep, 'x', 1 << 26) return ok and 1 or 0 end\n"
      "function M.plain(x)\n"
      "  error('no position', 0)\n"
      "end\n"
      "function M.tbl(x)\n"
      "  error({ code = 1 })\n"
      "end\n"
      "function M.crep(x) return #string.rep('', 1 << 53) end\n"
      "function M.crep_method(x) return #(''):rep(1 << 53) end\n"
      "function M.cmove(x) return #table.move({}, 1, 1 << 40, 1, {}) end\n"
      "function M.cfind(x) return (('a'):rep(1500):find('.-.-.-b')) or 0 end\n"
      "function M.cfind2(x) return (('a'):rep(1500):find('%a*(%a*)%a*b')) or 0 end\n"
      "function M.cconcat(x) return #table.concat({}, '', 1, 1 << 40) end\n"
      "function M.fine(x) return #string.rep('ab', 1000, ',') + (('key=value'):find('(.-)=(.*)')) + "
      "#(('w1 w2 w3 '):rep(200):match('^(%S+)%s+(%S+)%s+(%S+)')) - 2 end\n"
      "return M\n";
  put(dir, "b.lua", src);
  policy_engine *e = engine(20000, (size_t)8 << 20);
  policy_opts po = {.name = "b.lua", .dir = dir};
  policy *p = e ? policy_add(e, &po) : NULL;
  CHECK(p && policy_reload(p, 1) == 0, "loads: %s", tr_error());
  if (!p) return;
  CHECK(policy_engine_budget(e) == 20000, "budget");
  policy_err err;
  double t0 = tr_now();
  long long r = call_int(e, p, "spin", 0, &err);
  CHECK(r == -1 && err.budget && err.line == 3 && strstr(err.msg, "b.lua:3: instruction budget of 20000 exceeded"),
        "an endless loop is stopped at b.lua:3: %s", err.msg);
  r = call_int(e, p, "sneaky", 0, &err);
  CHECK(r == -1 && err.budget && err.line == 6, "a loop around pcall cannot swallow the budget: %s", err.msg);
  double el = tr_now() - t0;
  CHECK(call_int(e, p, "double", 21, &err) == 42, "the VM goes on after the budget");
  CHECK(call_int(e, p, "hog", 0, &err) == -1 && strstr(err.msg, "not enough memory") && !err.budget,
        "the memory cap holds: %s", err.msg);
  CHECK(call_int(e, p, "hog_in_pcall", 0, &err) == -1 && strstr(err.msg, "not enough memory"),
        "pcall cannot swallow the memory cap: %s", err.msg);
  CHECK(call_int(e, p, "double", 4, &err) == 8, "the VM goes on after the memory cap");
  CHECK(call_int(e, p, "plain", 0, &err) == -1 && strcmp(err.file, "b.lua") == 0 && err.line == 12,
        "an error without a position gets one from the traceback: %s:%d (%s)", err.file, err.line, err.msg);
  CHECK(call_int(e, p, "tbl", 0, &err) == -1 && strcmp(err.file, "b.lua") == 0 && err.line == 15,
        "a table error too: %s:%d (%s)", err.file, err.line, err.msg);
  /* loops inside C library functions, where a count hook never fires:
   * refused up front (an alarm turns a regression into a failure, not a
   * hang) */
  alarm(60);
  static const char *const cloops[][2] = {{"crep", "string.rep"},   {"crep_method", "string.rep"},
                                          {"cmove", "table.move"},   {"cfind", "backtrack"},
                                          {"cfind2", "backtrack"},   {"cconcat", "table.concat"}};
  for (int i = 0; i < 6; i++) {
    double t1 = tr_now();
    r = call_int(e, p, cloops[i][0], 0, &err);
    CHECK(r == -1 && strstr(err.msg, cloops[i][1]) && tr_now() - t1 < 5, "M.%s is refused (%s) in %.2f s: %s",
          cloops[i][0], cloops[i][1], tr_now() - t1, err.msg);
  }
  alarm(0);
  r = call_int(e, p, "fine", 0, &err);
  CHECK(r == 2999 + 1, "ordinary rep and patterns still work: %lld %s", r, r == -1 ? err.msg : "");
  printf("budget: two endless loops stopped in %.1f ms (20000 instructions)\n", el * 1e3);
  policy_engine_free(e);

  policy_engine_opts bad = {.budget = 10};
  CHECK(policy_engine_new(&bad) == NULL && strstr(tr_error(), "budget"), "a budget of 10 refused: %s", tr_error());
}

/* --- reload: check, commit, the old version kept --- */

static int commits;

/* A check: M.version is a number and M.f(1), a dry run, returns a number. */
static int check_versioned(void *ud, lua_State *L, int mod, int env, policy_err *err) {
  policy_engine *e = ud;
  (void)env;
  int top = lua_gettop(L), rc = TR_OK;
  if (lua_getfield(L, mod, "version") != LUA_TNUMBER) {
    rc = policy_fail(err, "v.lua", 0, "version must be a number");
  } else if (lua_getfield(L, mod, "f") != LUA_TFUNCTION) {
    rc = policy_fail(err, "v.lua", 0, "f must be a function");
  } else {
    int line = policy_fn_line(L, -1);
    lua_pushinteger(L, 1);
    CHECK(policy_engine_dry_run(e), "dry-run flag on during the check");
    if ((rc = policy_call(e, 1, 1, err)) == 0 && !lua_isnumber(L, -1))
      rc = policy_fail(err, "v.lua", line, "dry run: f returned a %s", luaL_typename(L, -1));
  }
  lua_settop(L, top);
  return rc;
}

static void commit_count(void *ud, lua_State *L, int mod) {
  (void)ud;
  (void)L;
  (void)mod;
  commits++;
}

static void test_reload(void) {
  char dir[600], fb[600];
  subdir(dir, sizeof dir, "reload");
  subdir(fb, sizeof fb, "fallback");
  nreloads = 0;
  commits = 0;
  policy_engine *e = engine(20000, 0);
  policy_opts po = {.name = "v.lua", .dir = dir, .fallback_dir = fb, .check = check_versioned,
                    .commit = commit_count, .ud = e};
  policy *p = e ? policy_add(e, &po) : NULL;
  if (!p) return;
  CHECK(policy_push(p) == LUA_TNIL, "nothing in force before the first load");
  lua_pop(policy_engine_lua(e), 1);
  /* the first load: dir lacks it, the fallback has it */
  put(fb, "v.lua", "return { version = 1, f = function(x) return x end }\n");
  CHECK(policy_reload(p, 0) == 0 && version(p, e) == 1 && strstr(policy_path(p), "/fallback/v.lua"),
        "first load from the fallback: %s", policy_path(p));
  CHECK(policy_reload(p, 0) == 0 && nreloads == 1, "nothing in dir: nothing reloaded");
  put(dir, "v.lua", "return { version = 2, f = function(x) return x + 1 end }\n");
  CHECK(policy_reload(p, 0) == 0 && version(p, e) == 2 && strstr(policy_path(p), "/reload/v.lua"),
        "the file appears in dir: it takes over");
  CHECK(commits == 2, "commit ran per version in force (%d)", commits);
  int before = nreloads;
  CHECK(policy_reload(p, 0) == 0 && nreloads == before, "unchanged bytes skipped");
  CHECK(policy_reload(p, 1) == 0 && nreloads == before + 1 && commits == 3, "force reloads anyway");

  /* the check refuses */
  put(dir, "v.lua", "return { version = 'three', f = function(x) return x end }\n");
  CHECK(policy_reload(p, 0) == TR_ELUA && strstr(tr_error(), "v.lua: version must be a number"), "check refuses: %s",
        tr_error());
  CHECK(version(p, e) == 2 && commits == 3, "old version in force, no commit");
  before = nreloads;
  CHECK(policy_reload(p, 0) == 0 && nreloads == before, "the same failing bytes are not retried without force");
  /* the dry run fails at a line */
  const char *dry = "return { version = 4,\n  f = function(x)\n    return nil\n  end }\n";
  put(dir, "v.lua", dry);
  CHECK(policy_reload(p, 0) == TR_ELUA && last_reload()->line == 2 && strstr(tr_error(), "v.lua:2: dry run"),
        "dry run refused at the function's line: %s", tr_error());
  /* the dry run never ends */
  put(dir, "v.lua", "return { version = 5,\n  f = function(x)\n    while true do end\n  end }\n");
  CHECK(policy_reload(p, 0) == TR_ELUA && last_reload()->line == 3 && strstr(tr_error(), "instruction budget"),
        "an endless dry run is stopped and refused: %s", tr_error());
  /* a syntax error */
  put(dir, "v.lua", "return { version = 6,\n  f = function(x)\n    return x +\n  end }\n");
  CHECK(policy_reload(p, 0) == TR_ELUA && last_reload()->line == 4, "syntax error at line 4 (%d): %s",
        last_reload()->line, tr_error());
  CHECK(version(p, e) == 2 && commits == 3, "after four refusals version 2 is in force");
  /* a file that went away: the old one stays */
  char path[700];
  snprintf(path, sizeof path, "%s/v.lua", dir);
  unlink(path);
  CHECK(policy_reload(p, 0) == TR_EIO && version(p, e) == 2, "a deleted file: TR_EIO, the old version stays");
  policy_engine_free(e);
}

/* --- inotify --- */

static void loop_stop(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  event_base_loopexit(arg, NULL);
}

static void spin_loop(struct event_base *base, double seconds) {
  struct timeval tv = {(time_t)seconds, (suseconds_t)((seconds - (time_t)seconds) * 1e6)};
  struct event *ev = evtimer_new(base, loop_stop, base);
  evtimer_add(ev, &tv);
  event_base_dispatch(base);
  event_free(ev);
}

/* Runs base until `want` more on_reload calls came or `bound` seconds passed. */
static int wait_reloads(struct event_base *base, int want, double bound) {
  int start = nreloads;
  double t0 = tr_now();
  while (nreloads - start < want && tr_now() - t0 < bound) spin_loop(base, 0.02);
  return nreloads - start;
}

static void test_watch(void) {
  char dir[600];
  subdir(dir, sizeof dir, "watch");
  nreloads = 0;
  policy_engine *e = engine(0, 0);
  struct event_base *base = event_base_new();
  policy_opts po = {.name = "w.lua", .dir = dir};
  policy *p = e ? policy_add(e, &po) : NULL;
  if (!p || !base) return;
  put(dir, "w.lua", "return { version = 1 }\n");
  CHECK(policy_reload(p, 1) == 0, "loads");
  CHECK(policy_watch(e, base) == 0, "watch: %s", tr_error());
  CHECK(policy_watch(e, base) == TR_ESTATE, "twice refused");
  policy_opts po2 = {.name = "w2.lua", .dir = dir};
  policy *p2 = policy_add(e, &po2); /* added while watching: watched too */
  put(dir, "w2.lua", "return { version = 10 }\n");
  CHECK(p2 && wait_reloads(base, 1, 5) == 1 && version(p2, e) == 10, "a policy added while watching is loaded");
  double t0 = tr_now();
  put(dir, "w.lua", "return { version = 2 }\n");
  CHECK(wait_reloads(base, 1, 5) == 1 && version(p, e) == 2, "a rename-save is in force");
  printf("watch: in force %.0f ms after the save (debounce 50 ms)\n", (tr_now() - t0) * 1e3);
  put(dir, "w.lua", "return { version = 3,\n  x = = 1 }\n");
  CHECK(wait_reloads(base, 1, 5) == 1 && !last_reload()->ok && last_reload()->line == 2 && version(p, e) == 2,
        "a broken save keeps version 2 (line %d)", last_reload()->line);
  put(dir, "notes.txt", "hello\n");
  CHECK(wait_reloads(base, 1, 0.3) == 0, "unrelated files ignored");
  /* a policy file that is a symlink into another folder (a repository
   * checkout): an edit there is seen */
  char repo[600], link[1300], target[1300];
  subdir(repo, sizeof repo, "watch-repo");
  put(repo, "l.lua", "return { version = 20 }\n");
  snprintf(link, sizeof link, "%s/l.lua", dir);
  snprintf(target, sizeof target, "%s/l.lua", repo);
  policy_opts pl = {.name = "l.lua", .dir = dir};
  policy *p3 = policy_add(e, &pl);
  CHECK(p3 && symlink(target, link) == 0 && wait_reloads(base, 1, 5) == 1 && version(p3, e) == 20,
        "a symlinked policy is loaded (version %lld)", p3 ? version(p3, e) : -1);
  put(repo, "l.lua", "return { version = 21 }\n");
  CHECK(wait_reloads(base, 1, 5) == 1 && version(p3, e) == 21,
        "an edit of a symlinked policy's target, in its own folder, is in force (version %lld)", version(p3, e));
  /* a Kubernetes ConfigMap mount: c.lua -> ..data/c.lua, ..data ->
   * ..<stamp>; an update writes ..<stamp2> and renames only ..data */
  char cm[600], a[700], b[700], path[1400], to[1400];
  subdir(cm, sizeof cm, "watch-cm");
  snprintf(a, sizeof a, "%s/..2026_a", cm);
  snprintf(b, sizeof b, "%s/..2026_b", cm);
  CHECK(tr_mkdirs(a) == 0 && tr_mkdirs(b) == 0, "configmap folders");
  put(a, "c.lua", "return { version = 30 }\n");
  snprintf(path, sizeof path, "%s/..data", cm);
  CHECK(symlink("..2026_a", path) == 0, "..data");
  snprintf(path, sizeof path, "%s/c.lua", cm);
  CHECK(symlink("..data/c.lua", path) == 0, "c.lua -> ..data/c.lua");
  policy_opts pc = {.name = "c.lua", .dir = cm};
  policy *p4 = policy_add(e, &pc);
  CHECK(p4 && policy_reload(p4, 1) == 0 && version(p4, e) == 30, "the ConfigMap's policy loads");
  put(b, "c.lua", "return { version = 31 }\n");
  snprintf(path, sizeof path, "%s/..data_tmp", cm);
  snprintf(to, sizeof to, "%s/..data", cm);
  CHECK(symlink("..2026_b", path) == 0 && rename(path, to) == 0, "the ConfigMap update's swap");
  CHECK(wait_reloads(base, 1, 5) >= 1 && version(p4, e) == 31, "a ConfigMap update is in force (version %lld)",
        version(p4, e));
  policy_engine_free(e); /* before the base */
  event_base_free(base);
}

/* --- the operator's restart policy --- */

static char *shipped_restart(void) {
  char path[1024];
  snprintf(path, sizeof path, "%s/policies/restart.lua", lua_host_dir());
  size_t n;
  char *s = tr_read_file(path, &n);
  if (!s) {
    fprintf(stderr, "%s\n", tr_error());
    exit(1); /* ok-exit: test set-up */
  }
  return s;
}

/* The shipped text with one substring replaced (the caller frees). */
static char *patched(const char *from, const char *to) {
  char *s = shipped_restart();
  char *at = strstr(s, from);
  if (!at) {
    fprintf(stderr, "'%s' not in restart.lua\n", from);
    exit(1); /* ok-exit: test set-up */
  }
  size_t n = strlen(s) - strlen(from) + strlen(to) + 1;
  char *out = malloc(n);
  snprintf(out, n, "%.*s%s%s", (int)(at - s), s, to, at + strlen(from));
  free(s);
  return out;
}

static char events_path[700];

static int count_in_events(const char *needle) {
  size_t n;
  char *s = tr_read_file(events_path, &n);
  int k = 0;
  for (const char *p = s; p && (p = strstr(p, needle)); p++) k++;
  free(s);
  return k;
}

/* The line of events.jsonl holding needle (static buffer; "" if none). */
static const char *event_line(const char *needle) {
  static char line[2048];
  line[0] = 0;
  FILE *f = fopen(events_path, "r");
  while (f && fgets(line, sizeof line, f))
    if (strstr(line, needle)) break;
    else line[0] = 0;
  if (f) fclose(f);
  return line;
}

typedef struct {
  char action[32], detail[256];
  double delay;
} decision;

static decision decide(operator_state *o, const char *fn, int slot) {
  decision d;
  operator_policy_call(o, fn, slot >= 0 ? &o->slots[slot] : NULL, "killed", 9, -1, d.action, sizeof d.action, &d.delay,
              d.detail, sizeof d.detail);
  return d;
}

/* Runs base until slot 1's on_failure decides `action` or bound seconds pass. */
static decision wait_decision(struct event_base *base, operator_state *o, const char *action, double bound) {
  double t0 = tr_now();
  decision d = decide(o, "on_failure", 1);
  while (strcmp(d.action, action) != 0 && tr_now() - t0 < bound) {
    spin_loop(base, 0.02);
    d = decide(o, "on_failure", 1);
  }
  return d;
}

static void test_restart_policy(void) {
  char dir[600];
  subdir(dir, sizeof dir, "policies");
  snprintf(events_path, sizeof events_path, "%s/events.jsonl", tdir);
  job_config *cfg = calloc(1, sizeof *cfg);
  operator_state *o = calloc(1, sizeof *o);
  if (!cfg || !o) return;
  snprintf(cfg->policies, sizeof cfg->policies, "%s", dir);
  o->cfg = cfg;
  o->nslots = 2;
  o->events = fopen(events_path, "w");
  for (int i = 0; i < 2; i++) {
    o->slots[i].slot = i;
    o->slots[i].state = SLOT_RUNNING;
    o->slots[i].step = 100;
  }
  o->slots[1].state = SLOT_DEAD; /* the one that failed */

  /* refused at load, naming restart.lua and the line */
  char *bad = patched("local delay = math.min(M.backoff_max,", "local delay = math.min(M.backof_max or backof_max,");
  int bad_line = line_of(bad, "backof_max");
  put(dir, "restart.lua", bad);
  free(bad);
  char want[64];
  snprintf(want, sizeof want, "restart.lua:%d: undefined global 'backof_max'", bad_line);
  CHECK(operator_policy_load(o) == TR_ELUA && strstr(tr_error(), want) && o->pol == NULL,
        "a misspelled global in on_failure is refused at load (dry run): %s", tr_error());
  CHECK(strstr(event_line("policy_reload_failed"), "restart.lua") && strstr(event_line("policy_reload_failed"), "\"line\""),
        "events.jsonl says why: %s", event_line("policy_reload_failed"));
  printf("restart policy, misspelled global: %s\n", tr_error());
  bad = patched("local M = {}\n", "local M = {}\nM.max_total = max_restarts_total\n");
  snprintf(want, sizeof want, "restart.lua:%d: undefined global 'max_restarts_total'", line_of(bad, "M.max_total"));
  put(dir, "restart.lua", bad);
  free(bad);
  CHECK(operator_policy_load(o) == TR_ELUA && strstr(tr_error(), want), "a misspelled global at the top level: %s",
        tr_error());
  bad = patched("function M.on_all_dead(", "function M.on_all_ded(");
  put(dir, "restart.lua", bad);
  CHECK(operator_policy_load(o) == TR_ELUA && strstr(tr_error(), "unknown handler 'on_all_ded'") &&
            strstr(tr_error(), "restart.lua:") ,
        "a misspelled handler: %s", tr_error());
  free(bad);

  /* the shipped policy; the job's folder lacks it at first: lua/policies serves */
  char path[700];
  snprintf(path, sizeof path, "%s/restart.lua", dir);
  unlink(path);
  CHECK(operator_policy_load(o) == 0, "shipped restart.lua from the fallback: %s", tr_error());
  if (!o->pol) return;
  decision d = decide(o, "on_failure", 1);
  CHECK(strcmp(d.action, "replace") == 0 && d.delay > 0.19 && d.delay < 0.21, "shipped: replace after 0.2 s (%s %g)",
        d.action, d.delay);
  d = decide(o, "on_all_dead", -1);
  CHECK(strcmp(d.action, "restart") == 0, "shipped on_all_dead: restart (%s)", d.action);
  /* its limits (README: exponential backoff, at most 5 per slot and 20 per job) */
  for (int k = 0; k <= 5; k++) {
    o->slots[1].restarts = o->restarts_total = 0;
    for (int i = 0; i < k; i++) operator_count_restart(o, &o->slots[1]); /* just now */
    d = decide(o, "on_failure", 1);
    if (k < 5)
      CHECK(strcmp(d.action, "replace") == 0 && d.delay > 0.2 * (1 << k) - 1e-9 && d.delay < 0.2 * (1 << k) + 1e-9,
            "shipped, slot restarted %d times: replace after %g s (%s %g)", k, 0.2 * (1 << k), d.action, d.delay);
    else
      CHECK(strcmp(d.action, "none") == 0 && strstr(d.detail, "slot 1 failed too often"),
            "shipped, slot restarted 5 times: given up (%s: %s)", d.action, d.detail);
  }
  o->slots[1].restarts = o->restarts_total = 0;
  for (int i = 0; i < 19; i++) operator_count_restart(o, &o->slots[0]); /* the other slot */
  d = decide(o, "on_failure", 1);
  CHECK(strcmp(d.action, "replace") == 0, "shipped, 19 restarts in the job: replace (%s)", d.action);
  operator_count_restart(o, NULL);
  d = decide(o, "on_failure", 1);
  CHECK(strcmp(d.action, "none") == 0 && strstr(d.detail, "job-wide restart budget spent"),
        "shipped, 20 restarts in the job: none (%s: %s)", d.action, d.detail);
  d = decide(o, "on_all_dead", -1);
  CHECK(strcmp(d.action, "stop") == 0 && strstr(d.detail, "job-wide restart budget spent"),
        "shipped on_all_dead, 20 restarts in the job: stop (%s: %s)", d.action, d.detail);
  o->restarts_total = o->slots[0].restarts = 0;

  /* the limits count restarts within the last hour: five long ago do not
   * count (nor double the backoff), five within it give the slot up */
  o->t0 = tr_now() - 7200; /* the operator started two hours ago */
  for (int i = 0; i < 5; i++) operator_count_restart(o, &o->slots[1]);
  for (int i = 0; i < 5; i++) o->slots[1].restart_at[i] = o->restart_at[i] = 100.0 + i;
  d = decide(o, "on_failure", 1);
  CHECK(strcmp(d.action, "replace") == 0 && d.delay > 0.19 && d.delay < 0.21,
        "5 restarts two hours ago: replace after 0.2 s (%s %g %s)", d.action, d.delay, d.detail);
  for (int i = 0; i < 5; i++) o->slots[1].restart_at[i] = o->restart_at[i] = 7000.0 + i;
  d = decide(o, "on_failure", 1);
  CHECK(strcmp(d.action, "none") == 0 && strstr(d.detail, "failed too often"),
        "5 restarts in the last hour: the slot is given up (%s %s)", d.action, d.detail);
  o->slots[1].restarts = o->restarts_total = 0;
  o->t0 = 0;

  struct event_base *base = event_base_new();
  CHECK(policy_watch(o->pol, base) == 0, "watching %s: %s", dir, tr_error());

  /* hot reload: the saved file changes the decision; state survives reloads */
  char *none = patched("  local delay = math.min(",
                       "  state.calls = (state.calls or 0) + 1\n"
                       "  if ev.slot == 1 then return { action = 'none', detail = 'hot v1 call ' .. state.calls } end\n"
                       "  local delay = math.min(");
  put(dir, "restart.lua", none);
  d = wait_decision(base, o, "none", 5);
  CHECK(strcmp(d.action, "none") == 0 && strstr(d.detail, "hot v1"), "hot reload changed the decision: %s (%s)",
        d.action, d.detail);
  CHECK(count_in_events("\"kind\":\"policy_reload\"") >= 1, "a policy_reload event");
  char *v2 = patched("  local delay = math.min(",
                     "  state.calls = (state.calls or 0) + 1\n"
                     "  if ev.slot == 1 then return { action = 'none', detail = 'hot v2 call ' .. state.calls } end\n"
                     "  local delay = math.min(");
  put(dir, "restart.lua", v2);
  double t0 = tr_now();
  while (!strstr(d.detail, "hot v2") && tr_now() - t0 < 5) {
    spin_loop(base, 0.02);
    d = decide(o, "on_failure", 1);
  }
  int calls = -1;
  const char *c = strstr(d.detail, "call ");
  if (c) calls = atoi(c + 5);
  CHECK(strstr(d.detail, "hot v2") && calls >= 2, "state kept across the reload: %s", d.detail);

  /* a broken save: the old version stays, policy_reload_failed names the line */
  int failed_before = count_in_events("policy_reload_failed");
  char *broken = patched("local M = {}\n", "local M = {}\nM.backoff_first = = 1\n");
  int broken_line = line_of(broken, "= = 1");
  put(dir, "restart.lua", broken);
  free(broken);
  t0 = tr_now();
  while (count_in_events("policy_reload_failed") == failed_before && tr_now() - t0 < 5) spin_loop(base, 0.02);
  snprintf(want, sizeof want, "\"line\":%d", broken_line);
  const char *fl = event_line("previous version stays in force");
  CHECK(count_in_events("policy_reload_failed") == failed_before + 1 && strstr(fl, want) && strstr(fl, "restart.lua"),
        "broken save, %s: %s", want, fl);
  d = decide(o, "on_failure", 1);
  CHECK(strcmp(d.action, "none") == 0 && strstr(d.detail, "hot v2"), "the old version is in force: %s", d.detail);

  /* an endless loop in on_failure (not in its dry run): the budget stops it,
   * the operator falls back to replacing the replica */
  char *loop = patched("  local delay = math.min(",
                       "  if ev.restarts_total >= 1 then\n    while true do end\n  end\n  local delay = math.min(");
  int loop_line = line_of(loop, "    while true do end");
  put(dir, "restart.lua", loop);
  free(loop);
  d = wait_decision(base, o, "replace", 5);
  CHECK(strcmp(d.action, "replace") == 0, "the looping version loaded (its dry run has no restarts)");
  o->restarts_total = 1;
  o->slots[1].restarts = 1;
  t0 = tr_now();
  d = decide(o, "on_failure", 1);
  double el = tr_now() - t0;
  CHECK(strcmp(d.action, "replace") == 0 && d.delay > 0.39 && d.delay < 0.41 && strstr(d.detail, "fallback"),
        "stopped by the budget, fallback: %s after %g s (%s)", d.action, d.delay, d.detail);
  snprintf(want, sizeof want, "\"line\":%d", loop_line);
  const char *pe = event_line("\"kind\":\"policy_error\"");
  CHECK(strstr(pe, "instruction budget") && strstr(pe, want) && strstr(pe, "restart.lua") &&
            strstr(pe, "\"rule\":\"restart.on_failure\""),
        "policy_error names restart.lua:%d: %s", loop_line, pe);
  printf("restart policy: an endless on_failure stopped in %.1f ms, fallback replace\n", el * 1e3);
  o->restarts_total = 20;
  d = decide(o, "on_failure", 1);
  CHECK(strcmp(d.action, "none") == 0, "the fallback's restart budget: none after 20 (%s)", d.action);
  o->restarts_total = 1;
  d = decide(o, "on_failure", 0);
  CHECK(strcmp(d.action, "replace") == 0 && d.delay > 0.19 && d.delay < 0.21 && strstr(d.detail, "fallback"),
        "slot 0 (no restarts yet): the fallback replaces after 0.2 s (%s %g)", d.action, d.delay);

  /* a bad decision is a policy_error too, with the fallback */
  char *garbage = patched("return { action = \"replace\", delay = delay }",
                          "return { action = \"replace\", delay = delay, dealy = 1 }");
  put(dir, "restart.lua", garbage);
  free(garbage);
  t0 = tr_now();
  failed_before = count_in_events("policy_reload_failed");
  while (count_in_events("policy_reload_failed") == failed_before && tr_now() - t0 < 5) spin_loop(base, 0.02);
  CHECK(strstr(event_line("unknown field 'dealy'"), "policy_reload_failed") != NULL,
        "a misspelled decision field is refused by the dry run: %s", event_line("dealy"));

  operator_policy_free(o);
  event_base_free(base);
  free(none);
  free(v2);
  fclose(o->events);
  free(o);
  free(cfg);
}

/* The operator's cordons (operator_hosts.c) with the shipped hosts.lua:
 * cordon by address takes every host at it; a hand cordon outlasts
 * trust_after (hosts.lua's ticks leave it), a policy cordon does not; a
 * hand uncordon lifts it. The clock is moved by moving o->t0 back. */
static void test_hosts_cordon(void) {
  char dir[600];
  subdir(dir, sizeof dir, "hosts-policies"); /* empty: lua/policies serves */
  snprintf(events_path, sizeof events_path, "%s/hosts-events.jsonl", tdir);
  job_config *cfg = calloc(1, sizeof *cfg);
  operator_state *o = calloc(1, sizeof *o);
  if (!cfg || !o) return;
  snprintf(cfg->policies, sizeof cfg->policies, "%s", dir);
  o->cfg = cfg;
  o->events = fopen(events_path, "w");
  o->t0 = tr_now();
  const char *names[] = {"h1", "h2", "h3"}, *addrs[] = {"10.0.0.5", "10.0.0.5", "10.0.0.6"};
  for (int i = 0; i < 3; i++) { /* not alive: no agent to lose by heartbeats */
    snprintf(o->hosts[i].name, sizeof o->hosts[i].name, "%s", names[i]);
    snprintf(o->hosts[i].addr, sizeof o->hosts[i].addr, "%s", addrs[i]);
    o->hosts[i].nslots = 1;
  }
  o->nhosts = 3;
  CHECK(operator_policy_load(o) == 0 && hosts_policy_load(o) == 0, "shipped restart.lua and hosts.lua: %s", tr_error());
  if (!o->pol) return;
  CHECK(hosts_cordon(o, "10.0.0.5", 1, "from attach") == 2, "cordon by address: both hosts at it");
  CHECK(o->hosts[0].cordoned && o->hosts[1].cordoned && !o->hosts[2].cordoned, "h1, h2 cordoned; h3 not");
  CHECK(count_in_events("host h1 (10.0.0.5) cordoned") == 1 && count_in_events("host h2 (10.0.0.5) cordoned") == 1,
        "an event for each");
  CHECK(hosts_cordon(o, "10.0.0.9", 1, "from attach") == -1, "no host at an unknown address");
  for (int k = 0; k < 2; k++) hosts_failure(o, 2, "killed"); /* h3: two failures, hosts.lua cordons it */
  CHECK(o->hosts[2].cordoned && !o->hosts[2].cordoned_by_hand, "h3 cordoned by the policy");
  o->t0 -= 2 * 1800 + 1; /* an hour later: past the shipped trust_after */
  o->hosts_policy_at = 0;
  hosts_tick(o);
  CHECK(!o->hosts[2].cordoned, "the policy's cordon of h3 is lifted after trust_after");
  CHECK(o->hosts[0].cordoned && o->hosts[1].cordoned, "the hand cordons of h1, h2 stay");
  CHECK(count_in_events("\"kind\":\"uncordon\"") == 1, "one uncordon event (h3's)");
  CHECK(hosts_cordon(o, "h1", 0, "from attach") == 1 && !o->hosts[0].cordoned && o->hosts[1].cordoned,
        "uncordon by name: h1 only");
  CHECK(hosts_cordon(o, "10.0.0.5", 0, "from attach") == 2 && !o->hosts[1].cordoned, "uncordon by address: h2 too");
  operator_policy_free(o);
  fclose(o->events);
  free(o);
  free(cfg);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  snprintf(tdir, sizeof tdir, "%s/transom-policy-XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
  if (!mkdtemp(tdir)) {
    perror("mkdtemp");
    return 1;
  }
  double t0 = tr_now();
  test_sandbox();
  test_budget_memory();
  test_reload();
  test_watch();
  test_restart_policy();
  test_hosts_cordon();
  char cmd[700];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", tdir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tdir);
  printf("test_policy: %.2f s\n", tr_now() - t0);
  return check_report("test_policy");
}
