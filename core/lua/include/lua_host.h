/* lua_host.h — the embedded Lua 5.4 VM: creation, the one protected-call
 * helper every C->Lua call goes through, and where transom's Lua files live.
 *
 * A host state has the standard libraries, package.path pointing at
 * transom's lua/ folder (lua/?.lua, lua/?/init.lua) ahead of the system
 * paths, and `require "transom"` (the graph API, lua_graph.c). Job files and
 * policies run in sandboxed environments built in Lua on top of it.
 */
#ifndef TRANSOM_LUA_HOST_H
#define TRANSOM_LUA_HOST_H

#include <lua.h>

/* New VM; NULL with tr_error() set on failure. */
lua_State *lua_host_new(void);
void lua_host_close(lua_State *L);

/* The folder holding transom's Lua files: $TRANSOM_LUA_DIR, else the source
 * tree's lua/ folder compiled in. */
const char *lua_host_dir(void);

/* lua_pcall with a message handler. On error: pops the error, sets tr_error()
 * to its text ("file:line: message"; a table error's .msg field), keeps a
 * traceback in lua_host_traceback(), and returns TR_ELUA. */
int lua_host_pcall(lua_State *L, int nargs, int nresults);
const char *lua_host_traceback(void);

/* lua_host_pcall of a loader that runs a declarative file (a job file, a
 * simulation scenario) and its checker, under a budget: 100 million VM
 * instructions or 2 s of this thread's CPU time. Past it, the error names
 * the file and line the file's own code was at ("the job file ran past its
 * budget ..."; `what` names the file), and is raised again at every
 * instruction inside the file, so a pcall in the file cannot swallow it.
 * Functions the file defined and that are called later go through this
 * too. The caller's hook is restored afterwards. Same returns as
 * lua_host_pcall. */
int lua_host_pcall_file(lua_State *L, const char *path, const char *what, int nargs, int nresults);

/* Bounds the standard library calls that loop in C, where no instruction
 * budget reaches (string.rep, table.move; string.find/match/gmatch/gsub
 * with several any-character repetitions on a long subject): past the
 * bounds they raise an error instead. For VMs that run code under a budget
 * (policies, the REPL); once per VM. lua_bounds.c. */
void lua_host_bound_library(lua_State *L);

/* The body of a C closure that wraps a library function (its upvalue 1):
 * calls it with this call's arguments and returns what it returned. A
 * wrapper checks its bounds, then `return lua_host_call_wrapped(L);`.
 * lua_bounds.c. */
int lua_host_call_wrapped(lua_State *L);

/* Registers the `transom` module (package.preload). lua_graph.c. */
int luaopen_transom(lua_State *L);

#endif
