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
 * nothing, a count past REP_MAX; table.move and table.concat refuse more
 * than MOVE_MAX elements; and the pattern functions refuse a pattern with
 * k >= 2 repetitions that backtrack against each other (backtracking_reps:
 * repeated '.', or the same item repeated twice in a row) on a subject of
 * n bytes when n^k passes PATTERN_MAX_WORK: the matcher's backtracking is
 * bounded by about that many steps. Each refusal is an ordinary Lua error
 * naming the function and the bound. Not bounded: repetitions of different
 * but overlapping classes in a row (%w*%a*%w*b), which backtrack the same
 * way; a complete bound would take a matcher of our own that counts its
 * steps.
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

int lua_host_call_wrapped(lua_State *L) {
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
  return lua_host_call_wrapped(L);
}

static int bounded_concat(lua_State *L) {
  luaL_checktype(L, 1, LUA_TTABLE);
  lua_Integer i = luaL_optinteger(L, 3, 1), j = lua_isnoneornil(L, 4) ? luaL_len(L, 1) : luaL_checkinteger(L, 4);
  if (j >= i && (j - i >= MOVE_MAX || j - i < 0))
    return luaL_error(L, "table.concat: %f elements is more than %I (a loop in C, which no instruction budget stops)",
                      (double)j - (double)i + 1, (LUAI_UACINT)MOVE_MAX);
  return lua_host_call_wrapped(L);
}

static int bounded_move(lua_State *L) {
  lua_Integer f = luaL_checkinteger(L, 2), e = luaL_checkinteger(L, 3);
  if (e >= f && (e - f >= MOVE_MAX || e - f < 0)) /* e - f < 0: it wrapped */
    return luaL_error(L, "table.move: %f elements is more than %I (a loop in C, which no instruction budget stops)",
                      (double)e - (double)f + 1, (LUAI_UACINT)MOVE_MAX);
  return lua_host_call_wrapped(L);
}

/* The end of the single-character item at p[i] (a literal, '.', %x or a
 * [set]). */
static size_t item_end(const char *p, size_t n, size_t i) {
  if (p[i] == '%') return i + 2 <= n ? i + 2 : n;
  if (p[i] != '[') return i + 1;
  i++; /* a set: up to its closing ']' (a ']' first is a member) */
  if (i < n && p[i] == '^') i++;
  if (i < n && p[i] == ']') i++;
  while (i < n && p[i] != ']') i += p[i] == '%' ? 2 : 1;
  return i < n ? i + 1 : n;
}

/* Repetitions in pattern p that backtrack against each other: every
 * repeated '.' (an item followed by '-', '*' or '+'), and every item of a
 * run of two or more repetitions of the same item ("a-a-", "%a*%a*",
 * "[a]+[a]+"; captures between them do not separate them). Repetitions of
 * different classes (%S+%s+) are not counted: disjoint ones cannot
 * backtrack against each other; overlapping different ones (%w*%a*) can,
 * and are not bounded here. */
static int backtracking_reps(const char *p, size_t n) {
  int k = 0, run = 0;
  const char *prev = NULL;
  size_t prev_len = 0;
  for (size_t i = 0; i < n;) {
    if (p[i] == '(' || p[i] == ')' || p[i] == '^' || (p[i] == '$' && i + 1 == n)) {
      i++;
      continue;
    }
    size_t e = item_end(p, n, i);
    int rep = e < n && (p[e] == '-' || p[e] == '*' || p[e] == '+');
    if (rep) {
      int same = prev && prev_len == e - i && memcmp(prev, p + i, prev_len) == 0;
      if (p[i] == '.' && e == i + 1) k++;
      else if (same) k += run == 1 ? 2 : 1; /* the run's first counts once it has a second */
      run = same ? run + 1 : 1;
      prev = p + i;
      prev_len = e - i;
      e++;
    } else {
      prev = NULL;
      run = 0;
    }
    i = e;
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
  int k = plain ? 0 : backtracking_reps(p, plen);
  if (k >= 2 && pow((double)slen, k) > PATTERN_MAX_WORK)
    return luaL_error(L,
                      "string.%s: a pattern with %d repetitions that backtrack against each other ('.-', or the "
                      "same item repeated twice in a row) on %d bytes could backtrack for minutes in C, which no "
                      "instruction budget stops: anchor or narrow it, or shorten the subject",
                      lua_tostring(L, lua_upvalueindex(2)), k, (int)(slen < 2147483647u ? slen : 2147483647u));
  return lua_host_call_wrapped(L);
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
  if (lua_getglobal(L, "table") == LUA_TTABLE) {
    wrap(L, "move", bounded_move);
    wrap(L, "concat", bounded_concat);
  }
  lua_pop(L, 1);
  lua_pushboolean(L, 1);
  lua_setfield(L, LUA_REGISTRYINDEX, "transom.bounded");
}
