/* pipeline_policy.c — a Lua placement policy overriding OP-Fence
 * (pipeline.placement = "file.lua"). The file runs sandboxed (the
 * declarative sandbox of transom.schema: no io, no os, undefined globals
 * are errors) and returns a function, called once with
 *
 *   plan = { stages, micro_batches,
 *            workers = { {worker = 0, speed =, zone =, gflops =}, ... },
 *            mbit = { [i][j] },               -- workers i, j from 1; 0 = unlimited
 *            ops = { {name =, gflop =, out_mb =}, ... },   -- the op order
 *            proposal = { cuts = {...}, order = {...} } }  -- OP-Fence's
 *
 * and returns { cuts = {0, c1, ..., #ops}, order = {worker of stage 0, ...} }
 * (workers and cut positions count from 0, as `transom plan` prints them),
 * plain tables: the answer is read raw (no metamethod runs).
 * The answer is checked; a bad one is an error naming the file, and so is
 * a policy that runs past the declarative-file budget (lua_host.h: 100
 * million instructions or 2 s of CPU). Lua
 * composes the plan, C computed every number it sees.
 */
#include <lauxlib.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "graph_stage.h"
#include "lua_host.h"
#include "pipeline_plan.h"
#include "util.h"

static void int_list(lua_State *L, const int *v, int n) {
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    lua_pushinteger(L, v[i]);
    lua_rawseti(L, -2, i + 1);
  }
}

/* [..] -> [.., plan] */
static int push_plan(lua_State *L, const graph *g, const pipe_plan *p) {
  int n = graph_norder(g);
  graph_op_cost *c = malloc(sizeof *c * (size_t)n);
  if (!c || graph_stage_costs(g, c)) {
    free(c);
    return tr_fail(TR_ENOMEM, "planning: out of memory");
  }
  lua_createtable(L, 0, 6);
  lua_pushinteger(L, p->S);
  lua_setfield(L, -2, "stages");
  lua_pushinteger(L, p->M);
  lua_setfield(L, -2, "micro_batches");
  lua_createtable(L, p->S, 0); /* workers */
  for (int i = 0; i < p->S; i++) {
    lua_createtable(L, 0, 4);
    lua_pushinteger(L, i);
    lua_setfield(L, -2, "worker");
    lua_pushnumber(L, p->speed[i]);
    lua_setfield(L, -2, "speed");
    lua_pushstring(L, p->zone[i]);
    lua_setfield(L, -2, "zone");
    lua_pushnumber(L, p->flops_s[i] / 1e9);
    lua_setfield(L, -2, "gflops");
    lua_rawseti(L, -2, i + 1);
  }
  lua_setfield(L, -2, "workers");
  lua_createtable(L, p->S, 0); /* mbit */
  for (int i = 0; i < p->S; i++) {
    lua_createtable(L, p->S, 0);
    for (int j = 0; j < p->S; j++) {
      lua_pushnumber(L, p->bw[i][j] * 8 / 1e6);
      lua_rawseti(L, -2, j + 1);
    }
    lua_rawseti(L, -2, i + 1);
  }
  lua_setfield(L, -2, "mbit");
  lua_createtable(L, n, 0); /* ops */
  for (int k = 0; k < n; k++) {
    graph_node_desc nd;
    graph_order_node(g, k, &nd);
    lua_createtable(L, 0, 3);
    lua_pushstring(L, nd.name);
    lua_setfield(L, -2, "name");
    lua_pushnumber(L, c[k].flops / 1e9);
    lua_setfield(L, -2, "gflop");
    lua_pushnumber(L, c[k].out_bytes / 1e6);
    lua_setfield(L, -2, "out_mb");
    lua_rawseti(L, -2, k + 1);
  }
  lua_setfield(L, -2, "ops");
  lua_createtable(L, 0, 2); /* proposal */
  int_list(L, p->cuts, p->S + 1);
  lua_setfield(L, -2, "cuts");
  int_list(L, p->order, p->S);
  lua_setfield(L, -2, "order");
  lua_setfield(L, -2, "proposal");
  free(c);
  return TR_OK;
}

/* Reads answer[key] (a list of n integers) into v. [answer] unchanged.
 * Raw access only: this runs outside a protected call, and a metamethod
 * of the policy's (the sandbox's own __index, if it answers _ENV) would
 * raise an error with nothing to catch it. */
static int read_list(lua_State *L, const char *path, const char *key, int *v, int n) {
  lua_pushstring(L, key);
  lua_rawget(L, -2); /* [answer, answer[key]] */
  int ok = lua_type(L, -1) == LUA_TTABLE && lua_rawlen(L, -1) == (lua_Unsigned)n;
  for (int i = 0; ok && i < n; i++) {
    lua_rawgeti(L, -1, i + 1);
    lua_Integer x = lua_tointeger(L, -1);
    ok = lua_isinteger(L, -1);
    lua_pop(L, 1);
    if (ok && (x < 0 || x > INT_MAX)) { /* checked before narrowing: 2^32 + 13 is not 13 */
      lua_pop(L, 1);
      return tr_fail(TR_EINVAL, "%s: the policy's answer has %s[%d] = %lld (not in 0..%d)", path, key, i + 1,
                     (long long)x, INT_MAX);
    }
    v[i] = (int)x;
  }
  lua_pop(L, 1);
  return ok ? TR_OK : tr_fail(TR_EINVAL, "%s: the policy's answer needs '%s', a list of %d integers", path, key, n);
}

int pipe_policy_plan(lua_State *L, const graph *g, const char *path, pipe_plan *p) {
  int top = lua_gettop(L), rc;
  lua_getglobal(L, "require");
  lua_pushliteral(L, "transom.schema");
  if ((rc = lua_host_pcall(L, 1, 1))) goto done; /* [schema] */
  if (luaL_loadfilex(L, path, "t")) {           /* [schema, chunk] */
    rc = tr_fail(TR_EINVAL, "placement policy: %s", lua_tostring(L, -1));
    goto done;
  }
  lua_getfield(L, -2, "sandbox");
  if ((rc = lua_host_pcall(L, 0, 1))) goto done; /* [schema, chunk, env] */
  lua_setupvalue(L, -2, 1);                       /* _ENV */
  if ((rc = lua_host_pcall_file(L, path, "placement policy", 0, 1))) goto done; /* [schema, fn] */
  if (!lua_isfunction(L, -1)) {
    rc = tr_fail(TR_EINVAL, "%s: a placement policy returns function(plan)", path);
    goto done;
  }
  if ((rc = push_plan(L, g, p)) || (rc = lua_host_pcall_file(L, path, "placement policy", 1, 1)))
    goto done; /* [schema, answer] */
  if (lua_type(L, -1) != LUA_TTABLE) {
    rc = tr_fail(TR_EINVAL, "%s: the policy must return {cuts = ..., order = ...}", path);
    goto done;
  }
  if (!(rc = read_list(L, path, "cuts", p->cuts, p->S + 1)) && !(rc = read_list(L, path, "order", p->order, p->S)))
    rc = pipe_plan_check(path, p->cuts, p->order, p->S, graph_norder(g));
done:
  lua_settop(L, top);
  return rc;
}
