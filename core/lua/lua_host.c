/* lua_host.c — VM set-up and the protected-call helper (see lua_host.h). */
#include "lua_host.h"

#include <lauxlib.h>
#include <lualib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    lua_getfield(L, -1, "msg");
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
