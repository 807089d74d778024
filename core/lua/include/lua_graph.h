/* lua_graph.h — hand-over of a Lua-built graph to C (see lua_graph.c). */
#ifndef TRANSOM_LUA_GRAPH_H
#define TRANSOM_LUA_GRAPH_H

#include <lua.h>

#include "graph.h"

/* Takes ownership of the graph behind the graph userdata at idx: the Lua
 * handle becomes dead (its methods raise) and the caller frees the graph with
 * graph_free. NULL if idx is not a live graph handle. */
graph *lua_graph_take(lua_State *L, int idx);

#endif
