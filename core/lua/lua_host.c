/* lua_host.c — VM set-up and the protected-call helper (see lua_host.h). */
#include "lua_host.h"

#include <lauxlib.h>
#include <lualib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util.h"

static _Thread_local char traceback_buf[4096];

const char *lua_host_dir(void) {
  const char *env = getenv("TRANSOM_LUA_DIR");
  return env && *env ? env : TRANSOM_LUA_DIR;
}

lua_State *lua_host_new(void) {
  lua_State *L = luaL_newstate();
  if (!L) {
    tr_fail(TR_ENOMEM, "cannot create a Lua state");
    return NULL;
  }
  luaL_openlibs(L);
  /* package.path = lua/?.lua;lua/?/init.lua;<system> */
  lua_getglobal(L, "package");                         /* [package] */
  lua_getfield(L, -1, "path");                         /* [package, path] */
  lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;%s", lua_host_dir(), lua_host_dir(), lua_tostring(L, -1));
  lua_setfield(L, -3, "path");                         /* [package, path] */
  lua_pop(L, 1);                                       /* [package] */
  lua_getfield(L, -1, "preload");                      /* [package, preload] */
  lua_pushcfunction(L, luaopen_transom);
  lua_setfield(L, -2, "transom");
  lua_pop(L, 2);                                       /* [] */
  return L;
}

void lua_host_close(lua_State *L) {
  if (L) lua_close(L);
}

static int msgh(lua_State *L) {
  /* Keep table errors (structured {msg=...}) as they are; add a traceback to
   * string errors in the side buffer. */
  const char *msg = lua_tostring(L, 1);
  luaL_traceback(L, L, msg, 1);
  snprintf(traceback_buf, sizeof traceback_buf, "%s", lua_tostring(L, -1));
  lua_pop(L, 1);
  return 1;
}

int lua_host_pcall(lua_State *L, int nargs, int nresults) {
  int base = lua_gettop(L) - nargs;
  lua_pushcfunction(L, msgh);
  lua_insert(L, base);
  traceback_buf[0] = 0;
  int rc = lua_pcall(L, nargs, nresults, base);
  lua_remove(L, base);
  if (rc == LUA_OK) return TR_OK;
  if (lua_istable(L, -1)) {
    lua_pushliteral(L, "msg"); /* raw: the error's own __index would run unprotected here */
    lua_rawget(L, -2);
    tr_fail(TR_ELUA, "%s", lua_isstring(L, -1) ? lua_tostring(L, -1) : "(error table without msg)");
    lua_pop(L, 2);
  } else {
    const char *m = lua_tostring(L, -1);
    tr_fail(TR_ELUA, "%s", m ? m : "(error object is not a string)");
    lua_pop(L, 1);
  }
  return TR_ELUA;
}

const char *lua_host_traceback(void) { return traceback_buf; }

/* --- the declarative-file budget --- */

/* Loading and checking a job file (or a simulation scenario) takes well
 * under a million VM instructions (examples/fortunes.lua: 30 thousand; a
 * misspelled key and its "did you mean": 150 thousand) and a few
 * milliseconds. The budget,
 * FILE_BUDGET instructions or FILE_BUDGET_CPU_S seconds of this thread's CPU
 * time, whichever comes first, stops a loop that never ends, in the job
 * file or in the checker (job.lua) that a huge file drives; the time bound
 * catches loops whose instructions are each expensive (an error raised and
 * caught in every iteration took 12 s for 100 million instructions). Once
 * the budget is spent the hook fires at every instruction and raises again
 * in the job file's own code, so a pcall inside the file cannot catch the
 * error for good, while the checker's handler runs on to report it. Memory
 * is not capped here: the allocator's failure is the limit ("not enough
 * memory", an error like any other). */
#define FILE_BUDGET 100000000L
#define FILE_BUDGET_CPU_S 2.0
#define FILE_BUDGET_STEP 10000

static _Thread_local struct {
  long left;
  double cpu_end;   /* thread CPU time at which the budget is spent */
  const char *path; /* the file: its functions' source is "@" .. path */
  const char *what; /* "job file", "scenario": for the message */
} budget;

static double thread_cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void budget_hook(lua_State *L, lua_Debug *ar) {
  int in_file = lua_getinfo(L, "S", ar) && ar->source[0] == '@' && strcmp(ar->source + 1, budget.path) == 0;
  if (budget.left > 0) {
    budget.left -= FILE_BUDGET_STEP;
    if (budget.left > 0 && thread_cpu_s() < budget.cpu_end) return;
    budget.left = 0;
    lua_sethook(L, budget_hook, LUA_MASKCOUNT, 1);
  } else if (!in_file) {
    return;
  }
  if (in_file) luaL_where(L, 0); /* "path:line: " of the running function (level 0 in a hook) */
  else lua_pushfstring(L, "%s: ", budget.path);
  lua_pushfstring(L, "the %s ran past its budget (%d million instructions or %d seconds)", budget.what,
                  (int)(FILE_BUDGET / 1000000), (int)FILE_BUDGET_CPU_S);
  lua_concat(L, 2);
  lua_error(L);
}

int lua_host_pcall_file(lua_State *L, const char *path, const char *what, int nargs, int nresults) {
  lua_Hook old = lua_gethook(L);
  int old_mask = lua_gethookmask(L), old_count = lua_gethookcount(L);
  budget.left = FILE_BUDGET;
  budget.cpu_end = thread_cpu_s() + FILE_BUDGET_CPU_S;
  budget.path = path;
  budget.what = what;
  lua_sethook(L, budget_hook, LUA_MASKCOUNT, FILE_BUDGET_STEP);
  int rc = lua_host_pcall(L, nargs, nresults);
  lua_sethook(L, old, old_mask, old_count);
  budget.path = NULL;
  return rc;
}
