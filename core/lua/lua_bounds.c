/* lua_bounds.c — bounds on the standard library's loops that run in C, for
 * VMs whose code runs under an instruction budget (the policy engines, the
 * operator's REPL).
 *
 * A count hook fires between VM instructions only, never inside a C
 * function, so a budget cannot stop a library call that loops in C: with
 * an empty string, string.rep("", 2^53) copies nothing 2^53 times;
 * table.move({}, 1, 2^40, 1, {}) gets and sets 2^40 absent fields; a
 * pattern with several any-character repetitions (".-.-.-b") backtracks
 * over a long subject for minutes. Any of them in a rule, a policy or a
 * REPL line would hold the operator's event loop for good. Here string.rep
 * refuses a result past REP_MAX_BYTES (which bounds its loop) and, copying
 * nothing, a count past REP_MAX; table.move refuses more than MOVE_MAX
 * elements; and the pattern functions refuse a pattern with k >=
 * 2 any-character repetitions ('.' followed by '-', '*' or '+') on a
 * subject of n bytes when n^k passes PATTERN_MAX_WORK: the matcher's
 * backtracking is bounded by about that many steps. Each refusal is an
 * ordinary Lua error naming the function and the bound. Other patterns
 * (character classes, one any-character repetition) stay unbounded: their
 * backtracking is at most quadratic in the subject.
 *
 * The wrappers replace the functions in the VM's own `string` and `table`
 * tables (the string metatable's __index is that `string`, so method calls
 * such as ("").rep go through them too); the originals are their upvalues.
 */
#include <lauxlib.h>
#include <math.h>
#include <string.h>

#include "lua_host.h"

#define REP_MAX ((lua_Integer)1 << 22)       /* copies */
#define REP_MAX_BYTES ((lua_Integer)64 << 20) /* result */
#define MOVE_MAX ((lua_Integer)1 << 22)      /* elements */
#define PATTERN_MAX_WORK 1e8

/* Calls the wrapped original (upvalue 1) with this call's arguments. */
static int call_original(lua_State *L) {
  int n = lua_gettop(L);
  lua_pushvalue(L, lua_upvalueindex(1));
  lua_insert(L, 1);
  lua_call(L, n, LUA_MULTRET);
  return lua_gettop(L);
}

static int bounded_rep(lua_State *L) {
  size_t len, seplen = 0;
  luaL_checklstring(L, 1, &len);
  lua_Integer n = luaL_checkinteger(L, 2);
  luaL_optlstring(L, 3, "", &seplen);
  if (n > REP_MAX && len + seplen == 0) /* copies of nothing: only the count bounds the loop */
    return luaL_error(L, "string.rep: %I copies is more than %I (a loop in C, which no instruction budget stops)",
                      (LUAI_UACINT)n, (LUAI_UACINT)REP_MAX);
  if (n > 0 && (double)n * (double)(len + seplen) > (double)REP_MAX_BYTES)
    return luaL_error(L, "string.rep: a result of %f bytes is more than %I", (double)n * (double)(len + seplen),
                      (LUAI_UACINT)REP_MAX_BYTES);
  return call_original(L);
}

static int bounded_move(lua_State *L) {
  lua_Integer f = luaL_checkinteger(L, 2), e = luaL_checkinteger(L, 3);
  if (e >= f && (e - f >= MOVE_MAX || e - f < 0)) /* e - f < 0: it wrapped */
    return luaL_error(L, "table.move: %f elements is more than %I (a loop in C, which no instruction budget stops)",
                      (double)e - (double)f + 1, (LUAI_UACINT)MOVE_MAX);
  return call_original(L);
}

/* Any-character repetitions in pattern p: '.' followed by '-', '*' or
 * '+', outside sets and escapes. */
static int any_reps(const char *p, size_t n) {
  int k = 0;
  for (size_t i = 0; i < n; i++) {
    if (p[i] == '%') {
      i++; /* the escaped character */
    } else if (p[i] == '[') { /* a set: up to its closing ']' (a ']' first is a member) */
      i++;
      if (i < n && p[i] == '^') i++;
      if (i < n && p[i] == ']') i++;
      while (i < n && p[i] != ']') i += p[i] == '%' ? 2 : 1;
    } else if (p[i] == '.' && i + 1 < n && (p[i + 1] == '-' || p[i + 1] == '*' || p[i + 1] == '+')) {
      k++;
      i++;
    }
  }
  return k;
}

/* string.find/match/gmatch/gsub: the same, unless the pattern's
 * backtracking could outrun every budget (above). upvalue 2: the name. */
static int bounded_pattern(lua_State *L) {
  size_t slen, plen;
  luaL_checklstring(L, 1, &slen);
  const char *p = luaL_checklstring(L, 2, &plen);
  int plain = strcmp(lua_tostring(L, lua_upvalueindex(2)), "find") == 0 && lua_toboolean(L, 4);
  int k = plain ? 0 : any_reps(p, plen);
  if (k >= 2 && pow((double)slen, k) > PATTERN_MAX_WORK)
    return luaL_error(L,
                      "string.%s: a pattern with %d any-character repetitions ('.-', '.*', '.+') on %d bytes could "
                      "backtrack for minutes in C, which no instruction budget stops: anchor or narrow it, or "
                      "shorten the subject",
                      lua_tostring(L, lua_upvalueindex(2)), k, (int)(slen < 2147483647u ? slen : 2147483647u));
  return call_original(L);
}

/* Replaces lib[name] (lib at the top of the stack) by fn closing over the
 * original (and the name). */
static void wrap(lua_State *L, const char *name, lua_CFunction fn) {
  lua_getfield(L, -1, name);
  lua_pushstring(L, name);
  lua_pushcclosure(L, fn, 2);
  lua_setfield(L, -2, name);
}

void lua_host_bound_library(lua_State *L) {
  if (lua_getfield(L, LUA_REGISTRYINDEX, "transom.bounded") != LUA_TNIL) { /* once per VM */
    lua_pop(L, 1);
    return;
  }
  lua_pop(L, 1);
  if (lua_getglobal(L, "string") == LUA_TTABLE) {
    wrap(L, "rep", bounded_rep);
    static const char *const pat[] = {"find", "match", "gmatch", "gsub", NULL};
    for (int i = 0; pat[i]; i++) wrap(L, pat[i], bounded_pattern);
  }
  lua_pop(L, 1);
  if (lua_getglobal(L, "table") == LUA_TTABLE) wrap(L, "move", bounded_move);
  lua_pop(L, 1);
  lua_pushboolean(L, 1);
  lua_setfield(L, LUA_REGISTRYINDEX, "transom.bounded");
}
