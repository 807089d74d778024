/* operator_repl.c — the operator's control socket, RUN/control.sock
 * (mode 0600; the peer's uid is checked with SO_PEERCRED, others are refused).
 *
 * One line per request:
 *   chaos FAULT SLOT     inject a fault (`transom chaos`)
 *   status               one line per replica
 *   lua CODE             evaluate CODE in the operator's Lua VM (`transom
 *                        attach`): the reply is the output lines, then a line
 *                        "\001" (done), "\001ERR" (error) or "\002" (CODE is
 *                        incomplete: send more lines)
 *
 * The REPL runs in the operator's own VM, in an environment that sees the
 * globals plus the job's controls: workers(), metrics(w), events(n),
 * evict(w), checkpoint(), rollback(step), set("lr", x), reload(), help().
 * Each evaluation has an instruction budget, so a runaway expression is
 * stopped and the job goes on; errors are reported, never fatal. Several
 * clients may attach at once; each has its own pending input. Runs on the
 * operator's loop thread.
 *
 * operator_probe (operator.h) is this socket's client side for `transom
 * run`: before a run starts in a directory, is an operator alive there?
 */
#define _GNU_SOURCE /* struct ucred */
#include <event2/buffer.h>
#include <errno.h>
#include <lauxlib.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "lua_host.h"
#include "operator.h"
#include "operator_internal.h"
#include "util.h"

/* x 1e6 instructions per evaluation: the REPL runs on the operator's loop,
 * which also serves the replicas' heartbeats; keep a runaway short */
#define REPL_BUDGET_HOOKS 20

typedef struct ctl_conn {
  operator_state *o;
  struct bufferevent *bev;
  char *pending; /* an incomplete chunk so far */
  int env_ref;
  struct ctl_conn *prev, *next; /* o->ctl_conns: freed with the operator if still attached */
} ctl_conn;

static void conn_free(ctl_conn *c) {
  if (c->prev) c->prev->next = c->next;
  else c->o->ctl_conns = c->next;
  if (c->next) c->next->prev = c->prev;
  if (c->env_ref && c->env_ref != LUA_NOREF) luaL_unref(c->o->L, LUA_REGISTRYINDEX, c->env_ref);
  free(c->pending);
  bufferevent_free(c->bev);
  free(c);
}

/* --- chaos and status --- */

static void do_chaos(operator_state *o, struct evbuffer *out, const char *fault, int k) {
  int by_line = strcmp(fault, "slow") == 0 || strcmp(fault, "nan") == 0 || strcmp(fault, "fail") == 0;
  if (!by_line && strcmp(fault, "kill") != 0 && strcmp(fault, "hang") != 0) {
    evbuffer_add_printf(out, "error: unknown fault '%s' (kill, hang, slow, nan, fail)\n", fault);
    return;
  }
  if (k < 0 || k >= o->nslots) {
    evbuffer_add_printf(out, "error: no replica %d: the job's replicas are slots 0..%d\n", k, o->nslots - 1);
    return;
  }
  slot *s = &o->slots[k];
  if (!operator_slot_has_process(s) && !s->bev) {
    evbuffer_add_printf(out, "error: replica %d is not running\n", k);
  } else if (strcmp(fault, "kill") == 0 || strcmp(fault, "hang") == 0) {
    operator_event(o, s->step, k, "chaos", "%s replica %d (from transom chaos)", fault, k);
    if (operator_slot_has_process(s)) operator_kill_slot(o, s, strcmp(fault, "kill") == 0 ? SIGKILL : SIGSTOP);
    evbuffer_add_printf(out, "ok\n");
  } else if (by_line && !s->bev) {
    evbuffer_add_printf(out, "error: replica %d is not connected yet (try again)\n", k);
  } else { /* by line, at=0: the worker's next step (the step we know of may be behind it) */
    operator_event(o, s->step, k, "chaos", "%s replica %d (from transom chaos)", fault, k);
    evbuffer_add_printf(bufferevent_get_output(s->bev), "CHAOS at=0 fault=%s ms=200 steps=0\n", fault);
    evbuffer_add_printf(out, "ok\n");
  }
}

/* --- the REPL's functions (upvalue 1: the operator; 2: the connection) --- */

static operator_state *get_op(lua_State *L) { return lua_touserdata(L, lua_upvalueindex(1)); }

static int check_slot(lua_State *L, operator_state *o, int arg) {
  lua_Integer k = luaL_checkinteger(L, arg);
  if (k < 0 || k >= o->nslots)
    return luaL_argerror(L, arg, lua_pushfstring(L, "no replica %d: the job's replicas are slots 0..%d", (int)k,
                                                 o->nslots - 1));
  return (int)k;
}

static void set_num(lua_State *L, const char *k, double v) {
  lua_pushnumber(L, v);
  lua_setfield(L, -2, k);
}

/* --- tables for people ---
 * Controls return plain Lua tables (`#workers()`, `metrics(0).loss` work);
 * a metatable's __columns (the keys, in order) asks the REPL to print one as
 * an aligned table: a list of rows, or (__vertical) one record as key/value
 * lines. */

static void as_table(lua_State *L, const char *const *cols, int vertical) {
  lua_createtable(L, 0, 2); /* [t, mt] */
  lua_newtable(L);
  for (int i = 0; cols[i]; i++) {
    lua_pushstring(L, cols[i]);
    lua_rawseti(L, -2, i + 1);
  }
  lua_setfield(L, -2, "__columns");
  lua_pushboolean(L, vertical);
  lua_setfield(L, -2, "__vertical");
  lua_setmetatable(L, -2); /* [t] */
}

static int l_workers(lua_State *L) {
  operator_state *o = get_op(L);
  lua_createtable(L, o->nslots, 0);
  for (int i = 0; i < o->nslots; i++) {
    slot *s = &o->slots[i];
    lua_createtable(L, 0, 6);
    lua_pushinteger(L, i);
    lua_setfield(L, -2, "slot");
    lua_pushstring(L, slot_names[s->state]);
    lua_setfield(L, -2, "state");
    lua_pushinteger(L, s->pid);
    lua_setfield(L, -2, "pid");
    lua_pushinteger(L, s->step);
    lua_setfield(L, -2, "step");
    lua_pushinteger(L, s->restarts);
    lua_setfield(L, -2, "restarts");
    lua_pushstring(L, s->mode);
    lua_setfield(L, -2, "mode");
    lua_pushstring(L, s->host >= 0 ? o->hosts[s->host].name : o->cfg->hosts > 0 ? "-" : "local");
    lua_setfield(L, -2, "host");
    lua_rawseti(L, -2, i + 1);
  }
  static const char *const cols[] = {"slot", "state", "pid", "step", "restarts", "mode", "host", NULL};
  as_table(L, cols, 0);
  return 1;
}

/* hosts(): the agents' hosts: name, addr, alive, cordoned, slots, used, failures. */
static int l_hosts(lua_State *L) {
  operator_state *o = get_op(L);
  lua_createtable(L, o->nhosts, 0);
  for (int i = 0; i < o->nhosts; i++) {
    const host_rec *h = &o->hosts[i];
    lua_createtable(L, 0, 8);
    lua_pushstring(L, h->name);
    lua_setfield(L, -2, "name");
    lua_pushstring(L, h->addr);
    lua_setfield(L, -2, "addr");
    lua_pushboolean(L, h->alive);
    lua_setfield(L, -2, "alive");
    lua_pushboolean(L, h->cordoned);
    lua_setfield(L, -2, "cordoned");
    lua_pushinteger(L, h->nslots);
    lua_setfield(L, -2, "slots");
    lua_pushinteger(L, h->used);
    lua_setfield(L, -2, "used");
    lua_pushinteger(L, h->cores);
    lua_setfield(L, -2, "cores");
    lua_pushinteger(L, h->gpus);
    lua_setfield(L, -2, "gpus");
    lua_pushinteger(L, h->nfail);
    lua_setfield(L, -2, "failures");
    lua_pushnumber(L, h->link_Bps * 8 / 1e6);
    lua_setfield(L, -2, "link_mbit");
    lua_rawseti(L, -2, i + 1);
  }
  static const char *const cols[] = {"name", "addr", "alive", "cordoned", "slots", "used", "cores", "gpus", "failures",
                                     "link_mbit", NULL};
  as_table(L, cols, 0);
  return 1;
}

/* cordon(name) / uncordon(name): by host name or address, every host that
 * matches (an event each). A hand cordon stays until uncordon(name). */
static int cordon_common(lua_State *L, int on) {
  operator_state *o = get_op(L);
  const char *name = luaL_checkstring(L, 1);
  if (hosts_cordon(o, name, on, "from attach") < 0) return luaL_argerror(L, 1, "no such host");
  lua_pushboolean(L, 1);
  return 1;
}
static int l_cordon(lua_State *L) { return cordon_common(L, 1); }
static int l_uncordon(lua_State *L) { return cordon_common(L, 0); }

/* Pushes slot s's latest step record, keys as in metrics.jsonl. */
static void push_record(lua_State *L, const slot *s) {
  const step_record *r = &s->last;
  lua_createtable(L, 0, 24);
#define R_INT(name, help)  \
  lua_pushinteger(L, r->name); \
  lua_setfield(L, -2, #name);
  STEP_COUNTERS(R_INT)
#undef R_INT
#define R_NUM(ID, name, help, prom, phase) set_num(L, #name, r->name);
  STEP_METRICS(R_NUM)
#undef R_NUM
  lua_pushinteger(L, s->step); /* what the operator knows, also before a first record */
  lua_setfield(L, -2, "step");
  lua_pushinteger(L, s->slot);
  lua_setfield(L, -2, "worker");
}

/* metrics(w): replica w's latest step record (one table, printed as
 * key/value lines); metrics(): every replica's, one row each. */
static int l_metrics(lua_State *L) {
  operator_state *o = get_op(L);
  if (lua_isnoneornil(L, 1)) {
    lua_createtable(L, o->nslots, 0);
    for (int i = 0; i < o->nslots; i++) {
      push_record(L, &o->slots[i]);
      lua_rawseti(L, -2, i + 1);
    }
    static const char *const cols[] = {"worker", "step", "loss", "grad_norm", "lr", "step_s", "tokens_per_s",
                                       "replicas", "epoch", NULL};
    as_table(L, cols, 0);
    return 1;
  }
  push_record(L, &o->slots[check_slot(L, o, 1)]);
  static const char *const all[] = {
#define R_NAME(ID, name, help, prom, phase) #name,
      STEP_METRICS(R_NAME)
#undef R_NAME
#define C_NAME(name, help) #name,
      STEP_COUNTERS(C_NAME)
#undef C_NAME
      NULL};
  as_table(L, all, 1);
  return 1;
}

static int l_events(lua_State *L) {
  operator_state *o = get_op(L);
  lua_Integer n = luaL_optinteger(L, 1, 10);
  char path[4200];
  snprintf(path, sizeof path, "%s/events.jsonl", o->dir);
  fflush(o->events);
  size_t len;
  char *text = tr_read_file(path, &len);
  lua_newtable(L);
  if (!text) return 1;
  int count = 0;
  for (size_t i = 0; i < len; i++) count += text[i] == '\n';
  int skip = count > n ? count - (int)n : 0, k = 0, idx = 1;
  for (char *line = text; *line;) {
    char *nl = strchr(line, '\n');
    if (!nl) break;
    if (k++ >= skip) {
      lua_pushlstring(L, line, (size_t)(nl - line));
      lua_rawseti(L, -2, idx++);
    }
    line = nl + 1;
  }
  free(text);
  return 1;
}

static int l_evict(lua_State *L) {
  operator_state *o = get_op(L);
  slot *s = &o->slots[check_slot(L, o, 1)];
  if (!operator_slot_has_process(s)) return luaL_error(L, "replica %d is not running", s->slot);
  operator_event(o, s->step, s->slot, "evict", "replica %d evicted from the REPL", s->slot);
  operator_kill_slot(o, s, SIGKILL);
  lua_pushboolean(L, 1);
  return 1;
}

static int l_checkpoint(lua_State *L) {
  operator_state *o = get_op(L);
  int n = 0;
  for (int i = 0; i < o->nslots; i++)
    if (o->slots[i].bev && o->slots[i].state == SLOT_RUNNING) {
      evbuffer_add_printf(bufferevent_get_output(o->slots[i].bev), "CKPT_NOW\n");
      n++;
    }
  if (!n) return luaL_error(L, "no replica is running");
  operator_event(o, o->best_step, -1, "checkpoint_now", "asked from the REPL; the leader checkpoints its next step");
  lua_pushboolean(L, 1);
  return 1;
}

static int l_rollback(lua_State *L) {
  operator_state *o = get_op(L);
  lua_Integer step = luaL_optinteger(L, 1, o->best_step);
  if (step < 0) return luaL_argerror(L, 1, "step must be >= 0");
  int64_t target;
  if (operator_newest_checkpoint(o, step, &target)) return luaL_error(L, "%s", tr_error());
  if (target < 0) return luaL_error(L, "no committed checkpoint at or before step %d", (int)step);
  operator_rollback_all(o, target, step + 1, "asked from the REPL");
  lua_pushinteger(L, target);
  return 1;
}

static int l_set(lua_State *L) {
  operator_state *o = get_op(L);
  const char *name = luaL_checkstring(L, 1);
  lua_Number v = luaL_checknumber(L, 2);
  if (strcmp(name, "lr") != 0) return luaL_argerror(L, 1, "only 'lr' can be changed while the job runs");
  if (!(v > 0)) return luaL_argerror(L, 2, "lr must be > 0");
  int64_t at = o->best_step + 3; /* far enough that every replica gets it in time */
  size_t k = strlen(o->lr_changes);
  if (k + 48 >= sizeof o->lr_changes) return luaL_error(L, "too many learning-rate changes in this run");
  snprintf(o->lr_changes + k, sizeof o->lr_changes - k, "%s%lld:%.9g", k ? "," : "", (long long)at, v);
  for (int i = 0; i < o->nslots; i++)
    if (o->slots[i].bev) evbuffer_add_printf(bufferevent_get_output(o->slots[i].bev), "SET at=%lld lr=%.9g\n",
                                             (long long)at, v);
  operator_event(o, o->best_step, -1, "set", "lr = %g from step %lld (from the REPL)", v, (long long)at);
  char num[32], *e;
  snprintf(num, sizeof num, "%.3e", v); /* 5.000e-04 -> 5e-4 */
  if ((e = strchr(num, 'e'))) {
    char *z = e;
    while (z > num && z[-1] == '0') z--;
    if (z > num && z[-1] == '.') z--;
    int x = atoi(e + 1);
    snprintf(z, sizeof num - (size_t)(z - num), "e%d", x);
    if (x == 0) *z = 0;
  }
  lua_pushfstring(L, "lr %s from step %I (every replica, at the same step)", num, (lua_Integer)at);
  return 1;
}

/* Every policy file, through the policy engine: each failure is an event
 * (policy_reload_failed, file and line) and leaves the old version in force. */
static int l_reload(lua_State *L) {
  operator_state *o = get_op(L);
  char first[1024] = "";
  if (o->det && detector_reload(o->det) != 0) snprintf(first, sizeof first, "%s", tr_error());
  if (operator_policy_reload(o) != 0 && !first[0]) snprintf(first, sizeof first, "%s", tr_error());
  if (first[0]) return luaL_error(L, "reload failed, the previous policy stays: %s", first);
  lua_pushboolean(L, 1);
  return 1;
}

static int l_series(lua_State *L) {
  operator_state *o = get_op(L);
  int w = check_slot(L, o, 1);
  if (!o->det || detector_push_worker(o->det, L, w, (int)luaL_optinteger(L, 2, 20))) lua_pushnil(L);
  return 1;
}

static int l_anomalies(lua_State *L) {
  operator_state *o = get_op(L);
  if (!o->det || detector_push_anomalies(o->det, L, (int)luaL_optinteger(L, 1, 10))) lua_newtable(L);
  static const char *const cols[] = {"step", "worker", "rule", "kind", "severity", "action", "detail", NULL};
  as_table(L, cols, 0);
  return 1;
}

/* The client whose line is being evaluated: print writes to it. Not an
 * upvalue of print: a client may keep print (or a function calling it) in a
 * global that outlives its connection, and another client call it later. */
static ctl_conn *evaluating;

static int l_print(lua_State *L) {
  if (!evaluating) return luaL_error(L, "print: no attached client is evaluating");
  struct evbuffer *out = bufferevent_get_output(evaluating->bev);
  int n = lua_gettop(L);
  for (int i = 1; i <= n; i++) {
    evbuffer_add_printf(out, "%s%s", i > 1 ? "\t" : "", luaL_tolstring(L, i, NULL));
    lua_pop(L, 1); /* a C function has 20 free slots: one string at a time */
  }
  evbuffer_add_printf(out, "\n");
  return 0;
}

static int l_help(lua_State *L) {
  lua_pushliteral(L,
                  "workers()          replicas: slot, state, pid, step, restarts, mode\n"
                  "metrics()          every replica's latest step, a row each\n"
                  "metrics(w)         replica w's latest step: loss, grad_norm, lr, step_s, tokens_per_s, ...\n"
                  "series(w, n)       the detector's view of replica w: its last n values of every metric\n"
                  "anomalies(n)       the last n anomalies the rules raised\n"
                  "events(n)          the last n lines of events.jsonl\n"
                  "evict(w)           kill replica w; the restart policy replaces it\n"
                  "checkpoint()       the leader checkpoints its next step\n"
                  "rollback(step)     every replica reloads the newest checkpoint at or before step,\n"
                  "                   never drawing the batch of step + 1 again\n"
                  "set('lr', x)       peak learning rate x from a step every replica agrees on\n"
                  "reload()           reload the policies: restart.lua, rules.lua, actions.lua\n"
                  "                   (a file that fails to load leaves the old one in force)\n"
                  "hosts()            the agents' hosts: name, addr, alive, cordoned, slots, used, cores, gpus, failures\n"
                  "cordon(h)          place no replica on host h (name, or address: every host at it) until uncordon(h)\n"
                  "uncordon(h)        lift a cordon: host h takes replicas again (its hosts.lua may cordon it anew)\n"
                  "Any Lua works (tables come back as tables: metrics(0).loss); a bare control name\n"
                  "calls it (help, workers); TAB completes names; history is kept in RUN/attach_history;\n"
                  "^D detaches; the job goes on either way.");
  return 1;
}

static void bound_coroutines(lua_State *L);

static void make_env(ctl_conn *c) {
  lua_State *L = c->o->L;
  lua_newtable(L);                        /* [env] */
  lua_newtable(L);                        /* [env, mt] */
  lua_pushglobaltable(L);
  lua_setfield(L, -2, "__index");
  lua_setmetatable(L, -2);                /* [env] */
  static const luaL_Reg fns[] = {{"workers", l_workers},       {"metrics", l_metrics}, {"events", l_events},
                                 {"evict", l_evict},           {"checkpoint", l_checkpoint},
                                 {"rollback", l_rollback},     {"set", l_set},         {"reload", l_reload},
                                 {"print", l_print},           {"help", l_help},       {"series", l_series},
                                 {"anomalies", l_anomalies},   {"hosts", l_hosts},     {"cordon", l_cordon},
                                 {"uncordon", l_uncordon},     {NULL, NULL}};
  lua_pushlightuserdata(L, c->o);
  luaL_setfuncs(L, fns, 1);               /* [env] */
  c->env_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  lua_host_bound_library(L); /* string.rep and co. loop in C, out of the budget's reach */
  bound_coroutines(L);
}

/* --- evaluation --- */

static int hook_count;
static lua_State *evaluating_L; /* the thread the expression runs in */
static void budget_hook(lua_State *L, lua_Debug *ar) {
  (void)ar;
  if (++hook_count <= REPL_BUDGET_HOOKS) return;
  /* from now on at every instruction, in this thread and the expression's
   * own (hooks are per thread: a coroutine's spent budget must stop its
   * resumer too): a pcall in the expression may catch the error, but the
   * code after it stops at once again */
  lua_sethook(L, budget_hook, LUA_MASKCOUNT, 1);
  if (evaluating_L && evaluating_L != L) lua_sethook(evaluating_L, budget_hook, LUA_MASKCOUNT, 1);
  luaL_error(L, "stopped: the expression ran past its instruction budget");
}

/* coroutine.create and coroutine.wrap, refused once an expression spent
 * its budget: a new thread copies its creator's hook with a fresh count,
 * so a loop that catches the error and makes coroutines would get another
 * budget for each. Outside an evaluation (the job's own Lua) they are the
 * originals' (upvalue 1). */
static int bounded_cocreate(lua_State *L) {
  if (evaluating && hook_count > REPL_BUDGET_HOOKS)
    return luaL_error(L, "stopped: the expression ran past its instruction budget");
  return lua_host_call_wrapped(L);
}

static void bound_coroutines(lua_State *L) {
  static int done;
  if (done) return;
  if (lua_getglobal(L, "coroutine") != LUA_TTABLE) {
    lua_pop(L, 1);
    return;
  }
  static const char *const fns[] = {"create", "wrap", NULL};
  for (int i = 0; fns[i]; i++) {
    lua_getfield(L, -1, fns[i]);
    lua_pushcclosure(L, bounded_cocreate, 1);
    lua_setfield(L, -2, fns[i]);
  }
  lua_pop(L, 1);
  done = 1;
}

/* Renders value at idx for the REPL (tables one level deep, keys sorted by
 * insertion order of lua_next). */
static void render(lua_State *L, int idx, struct evbuffer *out, int depth) {
  idx = lua_absindex(L, idx);
  if (!lua_istable(L, idx) || depth > 2) {
    const char *s = luaL_tolstring(L, idx, NULL);
    evbuffer_add_printf(out, lua_type(L, idx) == LUA_TSTRING && depth ? "\"%s\"" : "%s", s);
    lua_pop(L, 1);
    return;
  }
  evbuffer_add_printf(out, "{");
  int first = 1;
  lua_pushnil(L);
  while (lua_next(L, idx)) {
    evbuffer_add_printf(out, first ? " " : ", ");
    first = 0;
    if (lua_type(L, -2) == LUA_TSTRING) evbuffer_add_printf(out, "%s = ", lua_tostring(L, -2));
    render(L, -1, out, depth + 1);
    lua_pop(L, 1);
  }
  evbuffer_add_printf(out, first ? "}" : " }");
}

/* One cell's text: numbers short (4 significant digits, large ones whole),
 * nil as "-", long strings cut. */
static void cell_text(lua_State *L, int idx, char *buf, size_t cap) {
  if (lua_isnil(L, idx)) snprintf(buf, cap, "-");
  else if (lua_isinteger(L, idx)) snprintf(buf, cap, "%lld", (long long)lua_tointeger(L, idx));
  else if (lua_type(L, idx) == LUA_TNUMBER) {
    double v = lua_tonumber(L, idx);
    snprintf(buf, cap, v >= 1e4 || v <= -1e4 ? "%.0f" : "%.4g", v);
  } else {
    snprintf(buf, cap, "%s", luaL_tolstring(L, idx, NULL));
    lua_pop(L, 1);
  }
}

#define CELL 72
/* Prints a table marked by as_table: rows under a header, or (vertical)
 * key/value lines, columns aligned. The table is at idx, its columns list
 * at cols. */
static void render_table(lua_State *L, int idx, int cols, int vertical, struct evbuffer *out) {
  int nc = (int)lua_rawlen(L, cols), nr = vertical ? 1 : (int)lua_rawlen(L, idx);
  /* Lua's memory, not malloc's: a row's __index may raise (a longjmp out
   * of here), and the collector frees it then */
  char(*cell)[CELL] = lua_newuserdatauv(L, (size_t)(nr + 1) * (size_t)nc * CELL + 1, 0);
  int *w = lua_newuserdatauv(L, ((size_t)nc + 1) * sizeof *w, 0); /* [.., cell, w] */
  memset(cell, 0, (size_t)(nr + 1) * (size_t)nc * CELL);
  memset(w, 0, ((size_t)nc + 1) * sizeof *w);
  for (int c = 0; c < nc; c++) {
    lua_rawgeti(L, cols, c + 1);                    /* [.., name] */
    int named = lua_type(L, -1) == LUA_TSTRING;     /* a column that is not a name shows "?" and no values */
    snprintf(cell[c], CELL, "%s", named ? lua_tostring(L, -1) : "?");
    for (int r = 0; r < nr; r++) {
      if (vertical) lua_pushvalue(L, idx);
      else lua_rawgeti(L, idx, r + 1);              /* [.., name, row] */
      if (named && lua_istable(L, -1)) lua_getfield(L, -1, lua_tostring(L, -2));
      else lua_pushnil(L);                          /* [.., name, row, value] */
      cell_text(L, -1, cell[(r + 1) * nc + c], CELL);
      lua_pop(L, 2);
    }
    lua_pop(L, 1);
    for (int r = 0; r <= nr; r++) {
      int len = (int)strlen(cell[r * nc + c]);
      if (len > w[vertical ? r : c] && (vertical ? r < 2 : 1)) w[vertical ? r : c] = len;
    }
  }
  if (vertical) { /* key  value */
    for (int c = 0; c < nc; c++) evbuffer_add_printf(out, "%-*s  %s\n", w[0], cell[c], cell[nc + c]);
  } else if (nr == 0) {
    evbuffer_add_printf(out, "(none)\n");
  } else {
    for (int r = 0; r <= nr; r++)
      for (int c = 0; c < nc; c++) {
        if (c + 1 < nc) evbuffer_add_printf(out, "%-*s  ", w[c], cell[r * nc + c]);
        else evbuffer_add_printf(out, "%s\n", cell[r * nc + c]);
      }
  }
  lua_pop(L, 2); /* cell, w */
}

/* Prints one value the REPL returned: a marked table aligned, on lines of
 * its own (returns 1), anything else inline as render() writes it (0). */
static int render_value(lua_State *L, int idx, struct evbuffer *out) {
  idx = lua_absindex(L, idx);
  if (lua_istable(L, idx) && lua_getmetatable(L, idx)) { /* [.., mt] */
    lua_pushliteral(L, "__columns");                     /* raw: a metatable's own __index is not ours to run */
    lua_rawget(L, -2);                                   /* [.., mt, cols] */
    lua_pushliteral(L, "__vertical");
    lua_rawget(L, -3);                                   /* [.., mt, cols, vertical] */
    int vertical = lua_toboolean(L, -1);
    if (lua_istable(L, -2)) {
      render_table(L, idx, lua_absindex(L, -2), vertical, out);
      lua_pop(L, 3);
      return 1;
    }
    lua_pop(L, 3);
  }
  render(L, idx, out, 0);
  return 0;
}

/* Writes the values an expression returned (arguments 2..) into the
 * evbuffer at argument 1; run through lua_host_pcall. */
static int render_results(lua_State *L) {
  struct evbuffer *out = lua_touserdata(L, 1);
  int n = lua_gettop(L), inline_open = 0; /* values on one line, tab-separated; tables on lines of their own */
  for (int i = 2; i <= n; i++) {
    if (inline_open && lua_istable(L, i)) evbuffer_add_printf(out, "\n"), inline_open = 0;
    else if (inline_open) evbuffer_add_printf(out, "\t");
    inline_open = !render_value(L, i, out);
  }
  if (inline_open) evbuffer_add_printf(out, "\n");
  return 0;
}

/* The controls a bare name calls ("help" runs help()). */
static const char *const bare_calls[] = {"help", "workers", "metrics", "anomalies", "events", "checkpoint",
                                         "reload", "hosts", NULL};

static int is_bare_call(const char *code) {
  while (*code == ' ') code++;
  size_t n = strspn(code, "abcdefghijklmnopqrstuvwxyz_");
  if (!n || code[n + strspn(code + n, " ")] != 0) return 0;
  for (int i = 0; bare_calls[i]; i++)
    if (strlen(bare_calls[i]) == n && strncmp(code, bare_calls[i], n) == 0) return 1;
  return 0;
}

static void repl_eval(ctl_conn *c, const char *line) {
  lua_State *L = c->o->L;
  struct evbuffer *out = bufferevent_get_output(c->bev);
  if (!c->env_ref) make_env(c);
  size_t plen = c->pending ? strlen(c->pending) : 0;
  char *code = malloc(plen + strlen(line) + 2);
  if (!code) return;
  sprintf(code, "%s%s%s", plen ? c->pending : "", plen ? "\n" : "", line);
  int top = lua_gettop(L);
  /* an expression first ("1+1" prints 2), then a statement; a bare
   * control name is a call */
  lua_pushfstring(L, is_bare_call(code) ? "return %s()" : "return %s", code);
  int rc = luaL_loadbuffer(L, lua_tostring(L, -1), lua_rawlen(L, -1), "=attach");
  lua_remove(L, -2);
  if (rc != LUA_OK) {
    lua_pop(L, 1);
    rc = luaL_loadbuffer(L, code, strlen(code), "=attach");
  }
  if (rc == LUA_ERRSYNTAX && strstr(lua_tostring(L, -1), "<eof>")) { /* incomplete: wait for more */
    free(c->pending);
    c->pending = code;
    lua_settop(L, top);
    evbuffer_add_printf(out, "\002\n");
    return;
  }
  free(c->pending);
  c->pending = NULL;
  free(code);
  if (rc != LUA_OK) {
    evbuffer_add_printf(out, "%s\n\001ERR\n", lua_tostring(L, -1));
    lua_settop(L, top);
    return;
  }
  lua_rawgeti(L, LUA_REGISTRYINDEX, c->env_ref);
  lua_setupvalue(L, -2, 1); /* _ENV */
  struct evbuffer *shown = evbuffer_new();
  hook_count = 0;
  evaluating = c;
  evaluating_L = L;
  lua_sethook(L, budget_hook, LUA_MASKCOUNT, 1000000);
  rc = shown ? lua_host_pcall(L, 0, LUA_MULTRET) : tr_fail(TR_ENOMEM, "out of memory");
  if (!rc) { /* the values are shown under the same budget and protection: __tostring, __index are the user's */
    int n = lua_gettop(L) - top;
    lua_pushcfunction(L, render_results);
    lua_pushlightuserdata(L, shown);
    lua_rotate(L, top + 1, 2); /* [.., render_results, shown, values...] */
    rc = lua_host_pcall(L, n + 1, 0);
  }
  lua_sethook(L, NULL, 0, 0);
  evaluating = NULL;
  evaluating_L = NULL;
  if (rc) evbuffer_add_printf(out, "error: %s\n\001ERR\n", tr_error());
  else evbuffer_add_buffer(out, shown), evbuffer_add_printf(out, "\001\n");
  if (shown) evbuffer_free(shown);
  lua_settop(L, top);
}

/* --- the socket --- */

static void ctl_drained(struct bufferevent *bev, void *arg);
static void ctl_event(struct bufferevent *bev, short what, void *arg);

static void ctl_read(struct bufferevent *bev, void *arg) {
  ctl_conn *c = arg;
  operator_state *o = c->o;
  char *line;
  size_t n;
  struct evbuffer *out = bufferevent_get_output(bev);
  if (operator_superseded(o)) { /* no attach, chaos or status from one that stands down */
    evbuffer_add_printf(out, "error: this operator was superseded by the one at %s\n", o->superseded_by);
    evbuffer_drain(bufferevent_get_input(bev), evbuffer_get_length(bufferevent_get_input(bev)));
    bufferevent_disable(bev, EV_READ);
    bufferevent_setcb(bev, NULL, ctl_drained, ctl_event, c); /* closed once the reply is out */
    return;
  }
  while ((line = evbuffer_readln(bufferevent_get_input(bev), &n, EVBUFFER_EOL_LF))) {
    char fault[16] = "";
    int k = -1;
    if (strncmp(line, "lua ", 4) == 0 || strcmp(line, "lua") == 0) {
      repl_eval(c, line[3] ? line + 4 : "");
    } else if (sscanf(line, "chaos %15s %d", fault, &k) == 2) { /* do_chaos checks both */
      do_chaos(o, out, fault, k);
    } else if (strcmp(line, "status") == 0) {
      for (int i = 0; i < o->nslots; i++)
        evbuffer_add_printf(out, "replica %d: %s pid %d step %lld restarts %d\n", i, slot_names[o->slots[i].state],
                            (int)o->slots[i].pid, (long long)o->slots[i].step, o->slots[i].restarts);
    } else {
      evbuffer_add_printf(out, "error: expected 'chaos FAULT SLOT', 'status' or 'lua CODE'\n");
    }
    free(line);
  }
  if (evbuffer_get_length(bufferevent_get_input(bev)) > 65536) conn_free(c); /* a line that never ends */
}

static void ctl_drained(struct bufferevent *bev, void *arg) {
  (void)bev;
  conn_free(arg); /* closed by the client; its last replies are out */
}

static void ctl_event(struct bufferevent *bev, short what, void *arg) {
  ctl_conn *c = arg;
  if (what & BEV_EVENT_ERROR) {
    conn_free(c);
  } else if (what & BEV_EVENT_EOF) { /* the client is done: flush the replies, then close */
    if (evbuffer_get_length(bufferevent_get_output(bev)) == 0) conn_free(c);
    else bufferevent_setcb(bev, NULL, ctl_drained, ctl_event, c);
  }
}

static void ctl_accept(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int len, void *arg) {
  (void)l;
  (void)sa;
  (void)len;
  operator_state *o = arg;
  struct ucred cred;
  socklen_t cl = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 || cred.uid != getuid()) {
    operator_event(o, o->best_step, -1, "attach_refused", "a client of uid %d was refused", (int)cred.uid);
    close(fd); /* only the job's own user */
    return;
  }
  ctl_conn *c = calloc(1, sizeof *c);
  struct bufferevent *bev = c ? bufferevent_socket_new(o->base, fd, BEV_OPT_CLOSE_ON_FREE) : NULL;
  if (!bev) {
    free(c);
    close(fd);
    return;
  }
  c->o = o;
  c->bev = bev;
  c->next = o->ctl_conns;
  if (c->next) c->next->prev = c;
  o->ctl_conns = c;
  bufferevent_setcb(bev, ctl_read, NULL, ctl_event, c);
  bufferevent_enable(bev, EV_READ | EV_WRITE);
}

struct evconnlistener *operator_ctl_listen(operator_state *o) {
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (snprintf(sa.sun_path, sizeof sa.sun_path, "%s/control.sock", o->dir) >= (int)sizeof sa.sun_path) return NULL;
  unlink(sa.sun_path);
  mode_t old = umask(0177); /* the socket is created 0600 */
  struct evconnlistener *l = evconnlistener_new_bind(o->base, ctl_accept, o, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC, 16,
                                                     (struct sockaddr *)&sa, sizeof sa);
  umask(old);
  return l;
}

/* --- the probe: a live operator, before a run starts in its directory --- */

#define PROBE_MORE_S 10.0 /* a live but slow operator (a loop blocked a while) is waited for this long more */

operator_presence operator_probe(const char *dir, double timeout_s, int *pid, int *uid) {
  *pid = 0;
  *uid = -1;
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  if (snprintf(sa.sun_path, sizeof sa.sun_path, "%s/control.sock", dir) >= (int)sizeof sa.sun_path) return OPERATOR_NONE;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return OPERATOR_NONE;
  operator_presence p = OPERATOR_NONE;
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    if (errno == EAGAIN) p = OPERATOR_SILENT; /* its backlog is full: a listener that accepts nothing */
    else if (errno == EACCES || errno == EPERM) { /* another user's socket (0600) */
      struct stat st;
      if (stat(sa.sun_path, &st) == 0) *uid = (int)st.st_uid;
      p = OPERATOR_REFUSED;
    }
    close(fd);
    return p;
  }
  p = OPERATOR_SILENT;
  struct ucred cred;
  socklen_t cl = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0) {
    *pid = (int)cred.pid;
    *uid = (int)cred.uid;
  }
  static const char ask[] = "status\n";
  char got[64];
  ssize_t sent = send(fd, ask, sizeof ask - 1, MSG_NOSIGNAL);
  if (sent < 0 && (errno == EPIPE || errno == ECONNRESET)) { /* closed before our request: as a close unanswered */
    if (*uid >= 0 && *uid != (int)getuid()) p = OPERATOR_REFUSED; /* another user's: ctl_accept closes */
    else if (*pid > 0 && tr_proc_state(*pid) != 0) p = OPERATOR_REFUSED;
  }
  if (sent == (ssize_t)(sizeof ask - 1)) {
    double until = tr_now() + timeout_s, more = 1;
    for (double left = timeout_s;; left = until - tr_now()) {
      if (left <= 0) { /* no answer yet: stopped or gone is silent; running (slow) gets PROBE_MORE_S more, once */
        char st = *pid > 0 ? tr_proc_state(*pid) : 'R'; /* a pid we cannot see: as a running one */
        if (!more || st == 0 || st == 'T' || st == 't' || st == 'Z' || st == 'X') break;
        more = 0;
        until = tr_now() + PROBE_MORE_S;
        continue;
      }
      struct pollfd pf = {.fd = fd, .events = POLLIN};
      int n = poll(&pf, 1, (int)(left * 1e3) + 1);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) break;
      if (n == 0) continue;
      ssize_t r = recv(fd, got, sizeof got, 0);
      if (r < 0 && (errno == ECONNRESET || errno == EPIPE)) r = 0; /* closed with our request unread: a close too */
      if (r > 0) p = OPERATOR_ANSWERS;
      if (r == 0 && *uid >= 0 && *uid != (int)getuid()) p = OPERATOR_REFUSED; /* another user's: ctl_accept closes */
      else if (r == 0 && *pid > 0 && tr_proc_state(*pid) != 0) p = OPERATOR_REFUSED; /* closed unanswered by a live one */
      if (r >= 0 || (errno != EINTR && errno != EAGAIN)) break; /* 0 from one now gone: silent (dying) */
    }
  }
  close(fd);
  return p;
}

void operator_ctl_close(operator_state *o) {
  if (o->ctl) evconnlistener_free(o->ctl);
  o->ctl = NULL;
  while (o->ctl_conns) conn_free(o->ctl_conns);
}
