/* lua_graph.c — the `transom` Lua module: the graph-building API.
 *
 * Lua composes, C computes: these functions add nodes to a C graph (graph.c)
 * and check shapes; no Lua runs while a step executes. The inspection and
 * execution methods (plan, set, get, forward, backward) exist for tests and
 * the REPL, at whole-graph granularity.
 *
 *   local g = transom.graph()
 *   local tok = g:input("tokens", {B, T}, "int32")
 *   local w = g:param("w", {OC, C}, {init = "normal", std = 0.02})
 *   local y = g:linear(x, w, b)          -- y is a tensor handle
 *
 * Misuse (wrong shapes, a tensor of another graph, a bad option) raises a Lua
 * error at the caller's file:line. A graph handle owns its graph until C takes
 * it (lua_graph_take); a taken handle raises on use.
 */
#include <lauxlib.h>
#include <lua.h>
#include <stdint.h>
#include <string.h>

#include "version.h"
#include "graph.h"
#include "lua_graph.h"
#include "lua_host.h"
#include "util.h"

#define GRAPH_MT "transom.graph"
#define TENSOR_MT "transom.tensor"

typedef struct {
  graph *g; /* NULL once taken by C or closed */
} lgraph;

typedef struct {
  int id;
} ltensor; /* user value 1: its lgraph userdata */

/* --- checks --- */

static lgraph *check_lgraph(lua_State *L, int idx) {
  lgraph *lg = luaL_checkudata(L, idx, GRAPH_MT);
  if (!lg->g) luaL_error(L, "this graph was handed to the trainer or closed");
  return lg;
}

/* Checks that arg idx is a tensor of the graph at index 1; returns its id.
 * nil is allowed (returns -1) when optional. */
static int check_tensor_arg(lua_State *L, int idx, int optional) {
  if (optional && lua_isnoneornil(L, idx)) return -1;
  ltensor *t = luaL_testudata(L, idx, TENSOR_MT);
  if (!t) return luaL_typeerror(L, idx, "tensor");
  lua_getiuservalue(L, idx, 1); /* [.., owner] */
  int same = lua_rawequal(L, -1, 1);
  lua_pop(L, 1);
  if (!same) return luaL_argerror(L, idx, "tensor belongs to another graph");
  return t->id;
}

static void push_tensor(lua_State *L, int id) {
  ltensor *t = lua_newuserdatauv(L, sizeof *t, 1); /* [.., t] */
  t->id = id;
  lua_pushvalue(L, 1);                              /* [.., t, graph] */
  lua_setiuservalue(L, -2, 1);                      /* [.., t] */
  luaL_setmetatable(L, TENSOR_MT);
}

/* Pushes the tensor for a builder result, or raises the builder's error. */
static int result(lua_State *L, int id) {
  if (id < 0) return luaL_error(L, "%s", tr_error());
  push_tensor(L, id);
  return 1;
}

static int read_shape(lua_State *L, int idx, int64_t *dim) {
  luaL_checktype(L, idx, LUA_TTABLE);
  int n = (int)lua_rawlen(L, idx);
  if (n > GRAPH_MAX_DIMS) luaL_argerror(L, idx, "too many dimensions (at most 4)");
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, idx, i + 1);
    int ok;
    lua_Integer v = lua_tointegerx(L, -1, &ok);
    lua_pop(L, 1);
    if (!ok || v < 1) {
      lua_pushfstring(L, "shape[%d] must be a positive integer", i + 1);
      luaL_argerror(L, idx, lua_tostring(L, -1));
    }
    dim[i] = v;
  }
  return n;
}

/* --- transom.graph() and builder methods --- */

static int l_graph_new(lua_State *L) {
  lgraph *lg = lua_newuserdatauv(L, sizeof *lg, 0);
  lg->g = NULL;
  luaL_setmetatable(L, GRAPH_MT);
  lg->g = graph_create();
  if (!lg->g) return luaL_error(L, "%s", tr_error());
  return 1;
}

static int l_input(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  const char *name = luaL_checkstring(L, 2);
  int64_t dim[GRAPH_MAX_DIMS];
  int nd = read_shape(L, 3, dim);
  static const char *const dts[] = {"float32", "int32", NULL};
  int dt = luaL_checkoption(L, 4, "float32", dts);
  return result(L, graph_input(lg->g, name, nd, dim, dt == 0 ? DT_F32 : DT_I32));
}

static int l_param(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  const char *name = luaL_checkstring(L, 2);
  int64_t dim[GRAPH_MAX_DIMS];
  int nd = read_shape(L, 3, dim);
  param_init init = INIT_NORMAL;
  float std = 0.02f;
  int decay = -1;
  if (!lua_isnoneornil(L, 4)) {
    luaL_checktype(L, 4, LUA_TTABLE);
    lua_pushnil(L);
    while (lua_next(L, 4)) { /* [.., key, value] */
      const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : "?";
      if (strcmp(k, "init") == 0) {
        const char *v = luaL_checkstring(L, -1);
        if (strcmp(v, "normal") == 0) init = INIT_NORMAL;
        else if (strcmp(v, "zeros") == 0) init = INIT_ZEROS;
        else if (strcmp(v, "ones") == 0) init = INIT_ONES;
        else return luaL_error(L, "param '%s': init must be 'normal', 'zeros' or 'ones', not '%s'", name, v);
      } else if (strcmp(k, "std") == 0) {
        if (!lua_isnumber(L, -1)) return luaL_error(L, "param '%s': std must be a number", name);
        std = (float)lua_tonumber(L, -1);
      } else if (strcmp(k, "decay") == 0) {
        if (!lua_isboolean(L, -1)) return luaL_error(L, "param '%s': decay must be a boolean", name);
        decay = lua_toboolean(L, -1);
      } else {
        return luaL_error(L, "param '%s': unknown option '%s' (known: init, std, decay)", name, k);
      }
      lua_pop(L, 1);
    }
  }
  return result(L, graph_param(lg->g, name, nd, dim, init, std, decay));
}

/* --- the ops: one binding l_<name> per op of ops.def (graph_<name>) --- */

static int l_embed(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  return result(L, graph_embed(lg->g, check_tensor_arg(L, 2, 0), check_tensor_arg(L, 3, 0), check_tensor_arg(L, 4, 1)));
}

static int l_linear(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  return result(L, graph_linear(lg->g, check_tensor_arg(L, 2, 0), check_tensor_arg(L, 3, 0), check_tensor_arg(L, 4, 1)));
}

static int l_layernorm(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  return result(L, graph_layernorm(lg->g, check_tensor_arg(L, 2, 0), check_tensor_arg(L, 3, 0),
                                   check_tensor_arg(L, 4, 0)));
}

static int l_gelu(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  return result(L, graph_gelu(lg->g, check_tensor_arg(L, 2, 0)));
}

static int l_add(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  return result(L, graph_add(lg->g, check_tensor_arg(L, 2, 0), check_tensor_arg(L, 3, 0)));
}

static int l_attention(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  int qkv = check_tensor_arg(L, 2, 0);
  lua_Integer nh = luaL_checkinteger(L, 3);
  if (nh < 1 || nh > 65536) return luaL_argerror(L, 3, "heads must be in 1..65536");
  return result(L, graph_attention(lg->g, qkv, (int)nh));
}

static int l_cross_entropy(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  return result(L, graph_cross_entropy(lg->g, check_tensor_arg(L, 2, 0), check_tensor_arg(L, 3, 0)));
}

static int l_output(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  const char *name = luaL_checkstring(L, 2);
  return result(L, graph_output(lg->g, name, check_tensor_arg(L, 3, 0)));
}

/* --- inspection and execution (tests, REPL) --- */

static int l_plan(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  int with_grad = lua_isnoneornil(L, 2) ? 1 : lua_toboolean(L, 2);
  if (graph_plan(lg->g, with_grad)) return luaL_error(L, "%s", tr_error());
  return 0;
}

static int l_init(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  if (!graph_planned(lg->g)) return luaL_error(L, "plan the graph first");
  graph_init_params(lg->g, (uint64_t)luaL_optinteger(L, 2, 1337));
  return 0;
}

static int l_nparams(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  int64_t n = 0;
  for (int i = 0; i < graph_ntensors(lg->g); i++) {
    tensor_desc d;
    graph_tensor(lg->g, i, &d);
    if (d.kind == TK_PARAM) n += d.size;
  }
  lua_pushinteger(L, n);
  return 1;
}

static int l_nnodes(lua_State *L) {
  lua_pushinteger(L, graph_nnodes(check_lgraph(L, 1)->g));
  return 1;
}

static int tensor_data_arg(lua_State *L, lgraph *lg, tensor_desc *d) {
  int id = check_tensor_arg(L, 2, 0);
  if (!graph_planned(lg->g)) return luaL_error(L, "plan the graph first");
  graph_tensor(lg->g, id, d);
  return id;
}

/* g:set(t, {values...}) — fills an input or parameter */
static int l_set(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  tensor_desc d;
  int id = tensor_data_arg(L, lg, &d);
  luaL_checktype(L, 3, LUA_TTABLE);
  if ((int64_t)lua_rawlen(L, 3) != d.size)
    return luaL_error(L, "set: '%s' has %d elements, got %d values", d.name, (int)d.size, (int)lua_rawlen(L, 3));
  void *p = graph_data(lg->g, id);
  if (!p) return luaL_error(L, "set: '%s' has no storage (not used by any output)", d.name);
  for (int64_t i = 0; i < d.size; i++) {
    lua_rawgeti(L, 3, i + 1);
    if (!lua_isnumber(L, -1)) return luaL_error(L, "set: value %d is not a number", (int)i + 1);
    if (d.dtype == DT_I32) {
      int ok;
      lua_Integer v = lua_tointegerx(L, -1, &ok); /* floats only when integral */
      if (!ok || v < INT32_MIN || v > INT32_MAX)
        return luaL_error(L, "set: value %d (%s) of int32 '%s' is not a 32-bit integer", (int)i + 1,
                          lua_tostring(L, -1), d.name);
      ((int32_t *)p)[i] = (int32_t)v;
    } else {
      ((float *)p)[i] = (float)lua_tonumber(L, -1);
    }
    lua_pop(L, 1);
  }
  return 0;
}

/* g:get(t [, "grad"]) — a table of the values (or gradients) */
static int l_get(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  tensor_desc d;
  int id = tensor_data_arg(L, lg, &d);
  int want_grad = lua_isstring(L, 3) && strcmp(lua_tostring(L, 3), "grad") == 0;
  const void *p = want_grad ? (const void *)graph_grad(lg->g, id) : graph_data(lg->g, id);
  if (!p) return luaL_error(L, "get: '%s' has no %s", d.name, want_grad ? "gradient" : "storage");
  lua_createtable(L, (int)d.size, 0);
  for (int64_t i = 0; i < d.size; i++) {
    if (d.dtype == DT_I32 && !want_grad) lua_pushinteger(L, ((const int32_t *)p)[i]);
    else lua_pushnumber(L, ((const float *)p)[i]);
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static int l_forward(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  if (graph_forward(lg->g)) return luaL_error(L, "%s", tr_error());
  return 0;
}

static int l_backward(lua_State *L) {
  lgraph *lg = check_lgraph(L, 1);
  int id = check_tensor_arg(L, 2, 0);
  graph_zero_grad(lg->g);
  if (graph_backward(lg->g, id)) return luaL_error(L, "%s", tr_error());
  return 0;
}

static int l_graph_close(lua_State *L) {
  lgraph *lg = luaL_checkudata(L, 1, GRAPH_MT);
  graph_free(lg->g);
  lg->g = NULL;
  return 0;
}

static int l_graph_tostring(lua_State *L) {
  lgraph *lg = luaL_checkudata(L, 1, GRAPH_MT);
  if (!lg->g) lua_pushliteral(L, "transom.graph (closed)");
  else lua_pushfstring(L, "transom.graph (%d tensors, %d ops)", graph_ntensors(lg->g), graph_nnodes(lg->g));
  return 1;
}

/* --- tensor handles --- */

static ltensor *check_ltensor(lua_State *L, int idx, lgraph **lg) {
  ltensor *t = luaL_checkudata(L, idx, TENSOR_MT);
  lua_getiuservalue(L, idx, 1);
  *lg = lua_touserdata(L, -1);
  lua_pop(L, 1);
  if (!*lg || !(*lg)->g) luaL_error(L, "the tensor's graph was handed to the trainer or closed");
  return t;
}

static int l_tensor_shape(lua_State *L) {
  lgraph *lg;
  ltensor *t = check_ltensor(L, 1, &lg);
  tensor_desc d;
  graph_tensor(lg->g, t->id, &d);
  lua_createtable(L, d.ndim, 0);
  for (int i = 0; i < d.ndim; i++) {
    lua_pushinteger(L, d.dim[i]);
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static int l_tensor_name(lua_State *L) {
  lgraph *lg;
  ltensor *t = check_ltensor(L, 1, &lg);
  tensor_desc d;
  graph_tensor(lg->g, t->id, &d);
  lua_pushstring(L, d.name);
  return 1;
}

static int l_tensor_tostring(lua_State *L) {
  lgraph *lg;
  ltensor *t = luaL_checkudata(L, 1, TENSOR_MT);
  lua_getiuservalue(L, 1, 1);
  lg = lua_touserdata(L, -1);
  lua_pop(L, 1);
  if (!lg || !lg->g) {
    lua_pushliteral(L, "transom.tensor (graph gone)");
    return 1;
  }
  tensor_desc d;
  graph_tensor(lg->g, t->id, &d);
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  lua_pushfstring(L, "tensor '%s' (", d.name);
  luaL_addvalue(&b);
  for (int i = 0; i < d.ndim; i++) {
    lua_pushfstring(L, i ? ",%I" : "%I", (lua_Integer)d.dim[i]);
    luaL_addvalue(&b);
  }
  luaL_addstring(&b, d.dtype == DT_I32 ? ") int32" : ") float32");
  luaL_pushresult(&b);
  return 1;
}

/* --- registration --- */

static const luaL_Reg graph_methods[] = {
    {"input", l_input},         {"param", l_param},
#define TR_OP(ID, NAME, ...) {#NAME, l_##NAME}, /* every op of ops.def: g:<name>(...) */
#include "ops.def"
    {"output", l_output},       {"plan", l_plan},           {"init", l_init},
    {"nparams", l_nparams},     {"nnodes", l_nnodes},       {"set", l_set},
    {"get", l_get},             {"forward", l_forward},     {"backward", l_backward},
    {"close", l_graph_close},   {NULL, NULL}};

static const luaL_Reg graph_meta[] = {
    {"__gc", l_graph_close}, {"__close", l_graph_close}, {"__tostring", l_graph_tostring}, {NULL, NULL}};

static const luaL_Reg tensor_methods[] = {{"shape", l_tensor_shape}, {"name", l_tensor_name}, {NULL, NULL}};

static const luaL_Reg module_funcs[] = {{"graph", l_graph_new}, {NULL, NULL}};

int luaopen_transom(lua_State *L) {
  luaL_newmetatable(L, GRAPH_MT);  /* [mt] */
  luaL_setfuncs(L, graph_meta, 0);
  luaL_newlib(L, graph_methods);   /* [mt, methods] */
  lua_setfield(L, -2, "__index");  /* [mt] */
  lua_pop(L, 1);
  luaL_newmetatable(L, TENSOR_MT); /* [mt] */
  lua_pushcfunction(L, l_tensor_tostring);
  lua_setfield(L, -2, "__tostring");
  luaL_newlib(L, tensor_methods);
  lua_setfield(L, -2, "__index");
  lua_pop(L, 1);
  luaL_newlib(L, module_funcs);    /* [transom] */
  lua_pushliteral(L, TRANSOM_VERSION);
  lua_setfield(L, -2, "version");
  return 1;
}

graph *lua_graph_take(lua_State *L, int idx) {
  lgraph *lg = luaL_testudata(L, idx, GRAPH_MT);
  if (!lg || !lg->g) return NULL;
  graph *g = lg->g;
  lg->g = NULL;
  return g;
}
