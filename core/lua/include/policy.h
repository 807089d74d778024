/* policy.h — the one policy engine: every Lua policy file transom runs
 * (the detector's rules.lua and actions.lua, the operator's restart.lua) is
 * loaded, sandboxed, called and hot-reloaded here.
 *
 *   policy_engine_new(opts)        a Lua VM of its own: memory cap, budget
 *   policy_add(e, {name, dir, fallback_dir, init_env, check, commit})
 *   policy_reload(p, force)        read -> compile into a fresh sandbox -> run
 *        |                         -> check (caller: shape, dry runs)
 *        |                         -> commit (caller adopts it) -> on_reload
 *        |  any failure: the version in force stays; on_reload says why
 *   policy_push(p) + args; policy_call(e, ...)   budget, memory cap, {msg, file, line}
 *   policy_watch(e, base)          inotify on the files' folders, debounced:
 *                                  a changed file goes through policy_reload
 *
 * The sandbox each file runs in (a fresh table per load): assert, error,
 * ipairs, next, pairs, select, tonumber, tostring, type, rawequal, rawlen,
 * rawget, _VERSION, _G (the sandbox itself); copies of math, string (no
 * dump), table, utf8; os.time and os.clock; a pcall that cannot catch the
 * budget or out-of-memory; print (to on_print, silent while loading and in
 * dry runs); whatever the caller's init_env adds. Not there: io, os.execute
 * and the rest of os, require, package, load, loadfile, dofile, debug,
 * collectgarbage, coroutine, setmetatable, getmetatable, rawset, xpcall.
 * Globals are strict: reading an undefined one or assigning one that does
 * not exist raises "FILE:LINE: undefined global 'x'" (a file keeps its
 * helpers in locals).
 *
 * What it does not do: decide what a policy's result means (the caller
 * parses it), keep policy state across reloads (the caller keeps its state
 * tables in the engine's registry and hands them in), write events (the
 * caller turns on_reload into its events.jsonl line). It never exits the
 * process; Lua errors come back as policy_err.
 *
 * Who calls it: detector/ (detector_lua.c: rules.lua, actions.lua) and the
 * operator (core/fleet/operator.c: restart.lua).
 *
 * Thread-safety: an engine and its policies belong to one thread (the
 * operator's event loop); every callback runs on it, inside the engine call
 * that caused it (policy_reload, policy_call, the watcher).
 */
#ifndef TRANSOM_POLICY_H
#define TRANSOM_POLICY_H

#include <lua.h>
#include <stddef.h>

struct event_base;

#define POLICY_MSG 512 /* error messages, bytes with the NUL */
#define POLICY_NAME 48 /* policy file names ("restart.lua") */

typedef struct policy_engine policy_engine;
typedef struct policy policy;

/* An error out of Lua, structured. msg is "file:line: message" when the
 * position is known; file and line repeat it (from the message, else from the
 * innermost frame of a policy file in the traceback). */
typedef struct {
  char msg[POLICY_MSG];
  char file[POLICY_NAME]; /* chunk name ("rules.lua"), "" when unknown */
  int line;               /* 0 when unknown */
  int budget;             /* stopped by the instruction budget */
} policy_err;

/* What one load of a policy file came to (on_reload). Strings and err are
 * valid during the callback only. */
typedef struct {
  const policy *p;       /* NULL: the watcher lost the folder (path) */
  const char *name;      /* "restart.lua"; NULL when p is NULL */
  const char *path;      /* the file read */
  int ok;                /* 1: this version is in force now */
  int first;             /* nothing was in force before (the first load) */
  const policy_err *err; /* !ok: why (line 0 when not about a line) */
  const char *detail;    /* ready-made text: "restart.lua in force", or err->msg
                            plus "; the previous version stays in force" */
} policy_reload_info;

/* --- the engine --- */

typedef struct {
  long budget;      /* Lua instructions per policy_call; 0: 200000 (1000..INT_MAX) */
  size_t mem_limit; /* bytes the engine's VM may hold while a policy runs; 0: 64 MiB (>= 1 MiB) */
  int debounce_ms;  /* watcher: quiet time before reloading; 0: 200 */
  /* Callbacks, all optional, all on the engine's thread. */
  void (*on_reload)(void *ud, const policy_reload_info *r); /* log it to events.jsonl */
  void (*on_print)(void *ud, const char *text);             /* print() outside loads and dry runs */
  void (*on_change)(void *ud); /* the watcher saw a file change; NULL: policy_engine_reload(e, 0) */
  void *ud;                    /* passed back; the caller owns it */
} policy_engine_opts;

/* A new engine with its own VM (lua_host_new: the standard libraries the
 * sandboxes copy from, nothing of it reachable from a policy). NULL with
 * tr_error() set on bad options (TR_EINVAL) or no memory. */
policy_engine *policy_engine_new(const policy_engine_opts *o);
/* Stops the watcher, closes the VM (every ref into it dies), frees the
 * policies. Call before event_base_free of the base given to policy_watch.
 * NULL is a no-op. Not from a callback. */
void policy_engine_free(policy_engine *e);

/* The engine's VM: push functions and arguments here for policy_call. Its
 * extra space belongs to the engine (see policy_engine_ud). */
lua_State *policy_engine_lua(policy_engine *e);
/* opts.ud of the engine that owns L (for C functions policies call). */
void *policy_engine_ud(lua_State *L);
long policy_engine_budget(const policy_engine *e);
/* 1 while a file is being loaded and checked (its top level and the dry
 * runs): print() is silent then, and a check may want to know. */
int policy_engine_dry_run(const policy_engine *e);

/* The protected call every policy function goes through: lua_pcall with
 * lua_host_pcall's traceback, the instruction budget (a count hook; the
 * sandbox's pcall cannot swallow it) and the memory cap on. On error pops
 * the error, fills err, sets tr_error() and returns TR_ELUA; the VM stays
 * usable. Stack effect as lua_pcall. */
int policy_call(policy_engine *e, int nargs, int nresults, policy_err *err);

/* --- policy files --- */

typedef struct {
  const char *name;         /* file name in dir, and the chunk name in messages: "restart.lua" */
  const char *dir;          /* where it is read (and watched) */
  const char *fallback_dir; /* the first load takes the file from here when dir lacks it; NULL: none */
  /* Adds the caller's globals to a fresh sandbox (table at env; use
   * lua_rawset/lua_setfield before the engine seals it). Optional. */
  void (*init_env)(void *ud, lua_State *L, int env);
  /* Validates what the file returned (a table at mod; its sandbox at env):
   * shapes, and dry runs through policy_call. Returns 0, or TR_ELUA with err
   * filled (policy_fail). Must leave the stack as it found it. Optional. */
  int (*check)(void *ud, lua_State *L, int mod, int env, policy_err *err);
  /* The new version passed: adopt it (take refs out of mod). Cannot fail.
   * Optional: policy_push reaches the table in force anyway. */
  void (*commit)(void *ud, lua_State *L, int mod);
  void *ud; /* passed back to the three; the caller owns it */
} policy_opts;

/* Registers a policy file; loads nothing. The strings are copied. The
 * policy belongs to e (freed with it). NULL with tr_error() on bad options
 * (a name that is not a plain file name, too long) or no memory. If e is
 * watching, the file's folder is watched too. */
policy *policy_add(policy_engine *e, const policy_opts *o);

/* Loads p from dir (the first load: from fallback_dir when dir lacks it):
 * the file is compiled ("t" only) into a fresh sandbox, run under the budget,
 * must return a table, passes check, then commit; only then does it replace
 * the version in force. Without force a file whose bytes did not change (or
 * are the bytes that failed last time) is skipped. Either way but skipped,
 * on_reload says what happened. Returns 0 when the file as written is in
 * force (or was skipped), TR_EIO (unreadable) or TR_ELUA (tr_error():
 * "restart.lua:7: ... (PATH)") otherwise; a failure never takes away the
 * version in force. TR_ESTATE from inside a check or commit. */
int policy_reload(policy *p, int force);
/* policy_reload on every policy of e; returns the first failure (tr_error()
 * names it), having tried them all. */
int policy_engine_reload(policy_engine *e, int force);

/* Pushes the table in force (nil before the first successful load) onto
 * the engine's VM; returns its Lua type. */
int policy_push(const policy *p);
const char *policy_name(const policy *p);
/* Where the version in force came from, "" before the first load. */
const char *policy_path(const policy *p);

/* For checks: fills err with "file:line: message" (line <= 0: "file:
 * message") and returns TR_ELUA. */
int policy_fail(policy_err *err, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Line where the Lua function at idx is defined, 0 if it is not one. */
int policy_fn_line(lua_State *L, int idx);

/* --- hot reload --- */

/* Watches the folders of e's policies with inotify on base (IN_CLOSE_WRITE |
 * IN_MOVED_TO | IN_CREATE, so editors that write a temporary file and
 * rename it are seen); debounce_ms after the last change to a policy file
 * (or a queue overflow) calls on_change, else policy_engine_reload(e, 0). A
 * folder that goes away is an on_reload with p NULL. base must outlive the
 * watch. TR_EIO when inotify fails, TR_ESTATE when already watching. */
int policy_watch(policy_engine *e, struct event_base *base);
void policy_unwatch(policy_engine *e);

#endif
