/* operator_hosts.c — the operator's hosts: the `transom agent`s that
 * registered (one per machine, agent.c), where replicas are placed, and
 * which hosts are cordoned.
 *
 *   - An agent says AGENT name= addr= cores= gpus= slots= on the workers'
 *     port (WELCOME grace= tells it operator_grace: how long it waits on
 *     us, stalled, before it gives up on us); it heartbeats (HB) and
 *     reports STARTED/EXITED (the real wait status) for the workers it
 *     starts on our SPAWN. Its connection closing, or its heartbeats
 *     lapsing past 2 x deadline (at least 4 heartbeats; a cut link, a dead
 *     machine; judged from when our loop last ran: a stall of ours loses
 *     no host), is the host lost: its replicas are evicted from FTAR at
 *     once (their epoch goes stale: fenced), their control connections
 *     closed, and each fails with reason "host_lost" for the restart policy.
 *   - Placement: a free slot on a healthy (alive, not cordoned) host; spares
 *     (hosts with no replica) first, the host the slot just failed on last.
 *     No room: the slot waits (unplaced) until an agent registers, a host is
 *     uncordoned or a slot frees.
 *   - hosts.lua (lua/policies, or the job's policies folder; on the restart
 *     policy's engine) sees every failure on a host and decides to cordon
 *     it, and once a second per cordoned host whether to trust it again.
 *     `transom attach`: hosts(), cordon(name), uncordon(name) (by name or
 *     address: every host matching); a hand cordon only uncordon lifts.
 *
 * It does not decide on replacements (the restart policy does, in
 * operator.c) or start processes itself. Everything runs on the operator's
 * event loop.
 */
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <lauxlib.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "ftar.h"
#include "lua_host.h"
#include "operator_internal.h"
#include "policy.h"
#include "proto.h"
#include "util.h"

/* Heartbeats of an agent may lapse this many deadlines before its host is
 * lost, and never fewer than HOST_LAPSE_BEATS heartbeat intervals: a short
 * deadline (below the agents' fixed interval) must not lose every host
 * between two heartbeats. */
#define HOST_LAPSE_DEADLINES 2.0
#define HOST_LAPSE_BEATS 4.0

static double lapse_s(operator_state *o) {
  double by_deadline = HOST_LAPSE_DEADLINES * o->cfg->deadline, by_beats = HOST_LAPSE_BEATS * AGENT_HB_INTERVAL;
  return by_deadline > by_beats ? by_deadline : by_beats;
}

static int alive_hosts(operator_state *o) {
  int n = 0;
  for (int i = 0; i < o->nhosts; i++) n += o->hosts[i].alive;
  return n;
}

/* Closes a connection without freeing it: its event callback sees EOF and
 * frees it (so no callback is left pointing at freed memory). */
static void close_conn(struct bufferevent *bev) {
  if (bev) shutdown(bufferevent_getfd(bev), SHUT_RDWR);
}

/* --- hosts.lua --- */

static void push_host_ev(lua_State *L, operator_state *o, const host_rec *h, const char *reason) {
  lua_createtable(L, 0, 9);
  lua_pushstring(L, h->name);
  lua_setfield(L, -2, "host");
  lua_pushstring(L, h->addr);
  lua_setfield(L, -2, "addr");
  lua_pushstring(L, reason);
  lua_setfield(L, -2, "reason");
  lua_pushboolean(L, h->cordoned);
  lua_setfield(L, -2, "cordoned");
  lua_pushboolean(L, h->alive);
  lua_setfield(L, -2, "alive");
  lua_pushnumber(L, tr_now() - o->t0);
  lua_setfield(L, -2, "time");
  lua_pushnumber(L, h->cordoned_at);
  lua_setfield(L, -2, "cordoned_at");
  lua_pushboolean(L, h->cordoned && h->cordoned_by_hand);
  lua_setfield(L, -2, "cordoned_by_hand");
  int n = h->nfail < HOST_FAILS ? h->nfail : HOST_FAILS;
  lua_createtable(L, n, 0);
  for (int i = 0; i < n; i++) {
    lua_pushnumber(L, h->fail_at[(h->nfail - n + i) % HOST_FAILS]);
    lua_rawseti(L, -2, i + 1);
  }
  lua_setfield(L, -2, "failure_times");
}

/* The decision at idx: "cordon" | "uncordon" | "none" or {action=, detail=}. */
static int parse_host_decision(lua_State *L, int idx, char *action, size_t n, char *detail, size_t dn) {
  idx = lua_absindex(L, idx);
  detail[0] = 0;
  if (lua_type(L, idx) == LUA_TTABLE) {
    lua_getfield(L, idx, "detail");
    if (lua_type(L, -1) == LUA_TSTRING) snprintf(detail, dn, "%s", lua_tostring(L, -1));
    lua_pop(L, 1);
    lua_getfield(L, idx, "action");
  } else {
    lua_pushvalue(L, idx);
  }
  const char *a = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : "";
  int ok = strcmp(a, "cordon") == 0 || strcmp(a, "uncordon") == 0 || strcmp(a, "none") == 0;
  if (ok) snprintf(action, n, "%s", a);
  lua_pop(L, 1);
  return ok ? 0 : -1;
}

/* Cordons or uncordons one host, by hand or by hosts.lua, with an event. */
static void set_cordon(operator_state *o, host_rec *h, int on, int by_hand, const char *why) {
  h->cordoned = on;
  h->cordoned_by_hand = on && by_hand;
  h->cordoned_at = on ? tr_now() - o->t0 : 0;
  operator_event(o, o->best_step, -1, on ? "cordon" : "uncordon", "host %s (%s) %s: %s", h->name, h->addr,
                 on ? "cordoned: no replica is placed there" : "trusted again", why && *why ? why : "by hand");
}

/* Asks hosts.lua about host h; acts on the decision (a hand cordon stays). */
static void ask_policy(operator_state *o, int h, const char *reason) {
  if (!o->hosts_pol) return;
  lua_State *L = policy_engine_lua(o->pol);
  int top = lua_gettop(L);
  policy_err e;
  memset(&e, 0, sizeof e);
  policy_push(o->hosts_pol);          /* [M] */
  lua_getfield(L, -1, "on_host");     /* [M, fn] (checked at load) */
  int line = policy_fn_line(L, -1);
  push_host_ev(L, o, &o->hosts[h], reason);
  lua_rawgeti(L, LUA_REGISTRYINDEX, o->hosts_state_ref); /* [M, fn, ev, state] */
  char action[16] = "none", detail[256] = "";
  int rc = policy_call(o->pol, 2, 1, &e); /* [M, decision] */
  if (!rc && parse_host_decision(L, -1, action, sizeof action, detail, sizeof detail) < 0) {
    policy_fail(&e, "hosts.lua", line, "on_host: the decision must be \"cordon\", \"uncordon\" or \"none\"");
    rc = TR_ELUA;
  }
  lua_settop(L, top);
  if (rc) {
    operator_event(o, o->best_step, -1, "policy_error", "%s%s; host %s left as it is", e.msg,
                   e.budget ? " (stopped by the instruction budget)" : "", o->hosts[h].name);
    return;
  }
  host_rec *r = &o->hosts[h];
  if (strcmp(action, "cordon") == 0 && !r->cordoned) set_cordon(o, r, 1, 0, detail);
  if (strcmp(action, "uncordon") == 0 && r->cordoned && !r->cordoned_by_hand) set_cordon(o, r, 0, 0, detail);
}

static int check_hosts(void *ud, lua_State *L, int mod, int env, policy_err *e) {
  operator_state *o = ud;
  (void)env;
  if (lua_getfield(L, mod, "on_host") != LUA_TFUNCTION) { /* [fn] */
    int rc = policy_fail(e, "hosts.lua", 0, "on_host must be a function(ev, state), is a %s", luaL_typename(L, -1));
    lua_pop(L, 1);
    return rc;
  }
  int line = policy_fn_line(L, -1);
  host_rec dry = {.name = "dry-run", .addr = "127.0.0.1", .alive = 1, .nfail = 1};
  push_host_ev(L, o, &dry, "killed"); /* [fn, ev] */
  lua_newtable(L);                    /* [fn, ev, state] */
  int rc = policy_call(o->pol, 2, 1, e); /* [decision] */
  if (rc) return rc;
  char action[16], detail[256];
  if (parse_host_decision(L, -1, action, sizeof action, detail, sizeof detail) < 0)
    rc = policy_fail(e, "hosts.lua", line, "dry run: on_host must return \"cordon\", \"uncordon\" or \"none\"");
  lua_pop(L, 1);
  return rc;
}

int hosts_policy_load(operator_state *o) {
  char fallback[PATH_MAX];
  snprintf(fallback, sizeof fallback, "%s/policies", lua_host_dir());
  lua_State *L = policy_engine_lua(o->pol);
  lua_newtable(L);
  o->hosts_state_ref = luaL_ref(L, LUA_REGISTRYINDEX);
  policy_opts po = {.name = "hosts.lua",
                    .dir = o->cfg->policies[0] ? o->cfg->policies : fallback,
                    .fallback_dir = fallback,
                    .check = check_hosts,
                    .ud = o};
  int rc = (o->hosts_pol = policy_add(o->pol, &po)) ? policy_reload(o->hosts_pol, 1) : TR_EINVAL;
  return rc ? tr_fail_prefix(rc, "hosts policy") : TR_OK;
}

int hosts_cordon(operator_state *o, const char *name, int on, const char *why) {
  int n = 0;
  for (int i = 0; i < o->nhosts; i++) {
    host_rec *h = &o->hosts[i];
    if (strcmp(h->name, name) != 0 && strcmp(h->addr, name) != 0) continue;
    set_cordon(o, h, on, 1, why);
    n++;
  }
  return n ? n : -1;
}

void hosts_failure(operator_state *o, int h, const char *reason) {
  host_rec *r = &o->hosts[h];
  if (strcmp(reason, "startup_error") == 0) return; /* the job's fault, not the host's */
  r->fail_at[r->nfail++ % HOST_FAILS] = tr_now() - o->t0;
  ask_policy(o, h, reason);
}

/* --- placement --- */

/* The best host for slot s, or -1: alive, not cordoned, a free slot; not
 * the host it just failed on, then a spare (no replica), then the least
 * used. */
static int pick_host(operator_state *o, const slot *s) {
  int best = -1;
  long best_score = 0;
  for (int i = 0; i < o->nhosts; i++) {
    const host_rec *h = &o->hosts[i];
    if (!h->alive || h->cordoned || !h->bev || h->used >= h->nslots) continue;
    long score = (i == s->last_host ? 0 : 1000000L) + (h->used == 0 ? 10000L : 0) + (h->nslots - h->used) * 10L;
    if (best < 0 || score > best_score) best = i, best_score = score;
  }
  return best;
}

void hosts_place(operator_state *o, int k, const char *mode) {
  slot *s = &o->slots[k];
  snprintf(s->mode, sizeof s->mode, "%s", mode);
  s->ours = 1;
  if (s->state == SLOT_WAITING) hosts_unclaim(o, s); /* a worker its agent named and we did not adopt */
  int h = pick_host(o, s);
  if (h < 0) {
    if (!s->unplaced)
      operator_event(o, o->best_step, k, "unplaced", "replica %d waits for a free slot on a healthy host (%d alive)",
                     k, alive_hosts(o));
    s->unplaced = 1;
    s->state = SLOT_WAITING;
    return;
  }
  host_rec *r = &o->hosts[h];
  char log[PATH_MAX], esc[PATH_MAX * 3];
  snprintf(log, sizeof log, "%s/worker-%d.log", o->dir, k);
  proto_escape(log, esc, sizeof esc);
  int threads = o->cfg->threads > 0 ? (int)o->cfg->threads : r->cores / (r->nslots > 0 ? r->nslots : 1);
  s->gen++;
  evbuffer_add_printf(bufferevent_get_output(r->bev), "SPAWN slot=%d gen=%u threads=%d log=%s\n", k, s->gen,
                      threads > 0 ? threads : 1, esc);
  s->host = h;
  r->used++;
  s->pid = 0;
  s->adopted = 0;
  s->agent[0] = 0;
  s->done = 0;
  s->unplaced = 0;
  s->state = SLOT_STARTING;
  s->started = tr_now();
  operator_event(o, o->best_step, k, "spawn", "replica %d placed on host %s (%s, %s%s)", k, r->name, r->addr, mode,
                 h == s->last_host ? ", where it failed last: no other host has room" : "");
}

/* --- link probes: a slow link --- */

/* A host's link is slow when its probes come in SLOW_FACTOR times slower
 * than the fastest other host's, SLOW_PROBES times in a row, and below
 * SLOW_ABS bytes/s (fast links differ by noise, a loaded machine's
 * scheduling included: the absolute bound keeps those out). */
#define SLOW_FACTOR 10.0
#define SLOW_PROBES 2
#define SLOW_ABS 12.5e6 /* 100 Mbit/s */

static void on_probe_end(operator_state *o, int h, double bytes) {
  host_rec *r = &o->hosts[h];
  if (r->probe_t0 <= 0 || bytes <= 0) return;
  double dt = tr_now() - r->probe_t0;
  r->probe_t0 = 0;
  r->link_Bps = bytes / (dt > 1e-6 ? dt : 1e-6);
  double best = 0;
  int fastest = -1;
  for (int i = 0; i < o->nhosts; i++)
    if (i != h && o->hosts[i].alive && o->hosts[i].link_Bps > best) best = o->hosts[i].link_Bps, fastest = i;
  int slow = fastest >= 0 && r->link_Bps < SLOW_ABS && r->link_Bps * SLOW_FACTOR < best;
  r->slow_probes = slow ? r->slow_probes + 1 : 0;
  if (!slow) r->slow_named = 0;
  if (r->slow_probes < SLOW_PROBES || r->slow_named) return;
  r->slow_named = 1;
  int k = -1;
  for (int i = 0; i < o->nslots; i++)
    if (o->slots[i].host == h) k = i;
  operator_event(o, o->best_step, k, "anomaly",
                 "slow_link: host %s (%s): %.2f MB/s to the operator, %.0fx below host %s's (%d probes in a row)%s", r->name,
                 r->addr, r->link_Bps / 1e6, best / r->link_Bps, o->hosts[fastest].name, r->slow_probes,
                 k >= 0 ? ": its replicas straggle every all-reduce" : "");
}

/* --- the agents' lines --- */

/* AGENT live=SLOT:GEN:PID,...: the workers an agent kept while it had no
 * operator (ours died, or the link to us broke). Each becomes its slot's
 * worker on host h where we may take it: in our adoption window a slot
 * nobody holds yet (its own HELLO live=1 follows), or a slot whose worker
 * we adopted before its agent came back (it named this agent and
 * generation). Any other we did not start and will not have (replaced
 * meanwhile, fenced while its host was cut off): KILL. Returns how many
 * were kept. */
static int claim_live(operator_state *o, int h, const char *live) {
  host_rec *r = &o->hosts[h];
  int kept = 0, k, pid, used;
  unsigned gen;
  for (const char *p = live; *p && sscanf(p, "%d:%u:%d%n", &k, &gen, &pid, &used) == 3;) {
    p += used + (p[used] == ',');
    slot *s = k >= 0 && k < o->nslots ? &o->slots[k] : NULL;
    int waiting = s && o->adopting && s->state == SLOT_WAITING && !s->ours && s->host < 0;
    int named = s && s->adopted && s->host < 0 && (s->state == SLOT_RUNNING || s->state == SLOT_DONE) &&
                strcmp(s->agent, r->name) == 0 && s->gen == gen;
    if (!waiting && !named) {
      evbuffer_add_printf(bufferevent_get_output(r->bev), "KILL slot=%d gen=%u sig=%d\n", k, gen, SIGKILL);
      operator_event(o, o->best_step, s ? k : -1, "stale_worker",
                     "host %s kept a worker for replica %d (pid %d) that is not this operator's: killed", r->name, k,
                     pid);
      if (s && !s->adopted && s->host < 0 && s->gen < gen) s->gen = gen; /* our next SPAWN there is newer */
      continue;
    }
    kept++;
    if (s->state == SLOT_DONE) { /* finished: it only exits now, nothing to track */
      s->agent[0] = 0;
      continue;
    }
    s->host = h;
    r->used++;
    s->gen = gen;
    s->pid = pid;
    s->agent[0] = 0; /* (not ours until its HELLO: adopt() checks it is the one named here) */
    s->unplaced = 0;
  }
  return kept;
}

void hosts_unclaim(operator_state *o, slot *s) {
  if (s->host < 0) return;
  host_rec *r = &o->hosts[s->host];
  if (r->bev) evbuffer_add_printf(bufferevent_get_output(r->bev), "KILL slot=%d gen=%u sig=%d\n", s->slot, s->gen, SIGKILL);
  operator_event(o, o->best_step, s->slot, "stale_worker",
                 "host %s kept a worker for replica %d (pid %d) that never came back to us itself: killed", r->name,
                 s->slot, (int)s->pid);
  r->used--;
  s->host = -1;
  s->pid = 0;
}

void hosts_end(operator_state *o) {
  for (int i = 0; i < o->nhosts; i++) {
    struct bufferevent *bev = o->hosts[i].bev;
    if (!o->hosts[i].alive || !bev) continue;
    struct evbuffer *out = bufferevent_get_output(bev);
    evutil_socket_t fd = bufferevent_getfd(bev);
    evbuffer_add_printf(out, "END\n");
    /* now, the connections close right after; libevent keeps the start of
     * a bufferevent's output frozen outside its own writes: thawed for it */
    evbuffer_unfreeze(out, 1);
    (void)evbuffer_write(out, fd);
    evbuffer_freeze(out, 1);
    /* the agent's unread bytes (a heartbeat, a probe) would turn our close
     * into a reset, which may drop END before the agent reads it: read
     * them, and end our side in order */
    char sink[4096];
    for (int n = 0; n < 64 && recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; n++) {
    }
    shutdown(fd, SHUT_WR);
  }
}

static void on_agent(operator_state *o, int *hp, struct bufferevent *bev, const char *line) {
  struct evbuffer *out = bufferevent_get_output(bev);
  char name[64], addr[64];
  if (o->cfg->hosts == 0) {
    evbuffer_add_printf(out, "REFUSE why=this%%20job%%20runs%%20on%%20one%%20host%%20(hosts%%20=%%200)\n");
    return;
  }
  if (!proto_get(line, "name", name, sizeof name) || !proto_get(line, "addr", addr, sizeof addr)) {
    evbuffer_add_printf(out, "REFUSE why=AGENT%%20needs%%20name%%20and%%20addr\n");
    return;
  }
  int h = -1;
  for (int i = 0; i < o->nhosts; i++)
    if (strcmp(o->hosts[i].name, name) == 0) h = i;
  if (h >= 0 && o->hosts[h].alive) {
    evbuffer_add_printf(out, "REFUSE why=host%%20name%%20in%%20use\n");
    return;
  }
  if (h < 0 && o->nhosts == MAX_HOSTS) {
    evbuffer_add_printf(out, "REFUSE why=too%%20many%%20hosts\n");
    return;
  }
  if (h < 0) h = o->nhosts++;
  host_rec *r = &o->hosts[h];
  snprintf(r->name, sizeof r->name, "%s", name);
  snprintf(r->addr, sizeof r->addr, "%s", addr);
  r->cores = (int)proto_int(line, "cores", 1);
  r->gpus = (int)proto_int(line, "gpus", 0);
  r->nslots = (int)proto_int(line, "slots", 1);
  r->used = 0;
  r->alive = 1;
  r->bev = bev;
  r->last_heard = tr_now();
  *hp = h;
  /* grace: how long the agent waits on us when we take none of its bytes
   * (stopped, a long REPL expression) before it gives up on us */
  evbuffer_add_printf(out, "WELCOME host=%s grace=%g nonce=%s\n", name, o->cfg->operator_grace, o->nonce);
  char live[PROTO_LINE_MAX], kept[64] = "";
  if (proto_get(line, "live", live, sizeof live)) {
    int n = claim_live(o, h, live);
    snprintf(kept, sizeof kept, "; %d worker(s) it kept are ours", n);
  }
  operator_event(o, o->best_step, -1, "host_joined", "host %s (%s): %d cores, %d GPUs, %d slots%s%s", name, addr,
                 r->cores, r->gpus, r->nslots, r->cordoned ? " (cordoned)" : "", kept);
  if (!o->placing && alive_hosts(o) >= o->cfg->hosts && !o->stopping) {
    o->placing = 1;
    if (!o->adopting) operator_spawn_all(o); /* else the adoption window's end starts them */
  }
}

/* A worker the agent started exited: status is its wait status. */
static void on_exited(operator_state *o, int h, const char *line) {
  int k = (int)proto_int(line, "slot", -1);
  pid_t pid = (pid_t)proto_int(line, "pid", 0);
  if (k < 0 || k >= o->nslots) return;
  slot *s = &o->slots[k];
  if (s->host != h || proto_int(line, "gen", -1) != (int64_t)s->gen) return; /* an older worker of the slot */
  if (s->pid != pid && s->pid != 0 && pid != 0) return;
  if (s->state == SLOT_WAITING) { /* named by its agent (claim_live), gone before its HELLO: no longer worth waiting for */
    o->hosts[h].used--;
    s->host = -1;
    s->pid = 0;
    return;
  }
  if (s->state != SLOT_STARTING && s->state != SLOT_RUNNING) return;
  s->pid = 0;
  /* its connection stays to operator_slot_exited: the lines already here
   * (its STEPs, DONE) are handled before its exit, as for a local worker */
  operator_slot_exited(o, s, (int)proto_int(line, "status", 0x100));
}

void hosts_line(operator_state *o, int *hp, struct bufferevent *bev, const char *line) {
  if (proto_is(line, "AGENT")) {
    if (*hp < 0) on_agent(o, hp, bev, line);
    return;
  }
  int h = *hp;
  if (h < 0 || o->hosts[h].bev != bev) return; /* a lost host's late words */
  o->hosts[h].last_heard = tr_now();
  if (proto_is(line, "PROBE")) {
    o->hosts[h].probe_t0 = tr_now();
  } else if (proto_is(line, "PROBE_END")) {
    on_probe_end(o, h, proto_num(line, "bytes", 0));
  } else if (proto_is(line, "STARTED")) {
    int k = (int)proto_int(line, "slot", -1);
    if (k >= 0 && k < o->nslots && o->slots[k].host == h && o->slots[k].pid == 0 &&
        proto_int(line, "gen", -1) == (int64_t)o->slots[k].gen)
      o->slots[k].pid = (pid_t)proto_int(line, "pid", 0);
  } else if (proto_is(line, "EXITED")) {
    on_exited(o, h, line);
  }
}

/* --- lost hosts --- */

static void host_lost(operator_state *o, int h, const char *why) {
  host_rec *r = &o->hosts[h];
  if (!r->alive) return;
  r->alive = 0;
  close_conn(r->bev);
  r->bev = NULL;
  int n = 0;
  for (int i = 0; i < o->nslots; i++) n += o->slots[i].host == h;
  operator_event(o, o->best_step, -1, "host_lost", "host %s (%s) lost: %s; %d replica(s) on it", r->name, r->addr, why,
                 n);
  if (!o->stopping) hosts_failure(o, h, "host_lost");
  for (int i = 0; i < o->nslots; i++) {
    slot *s = &o->slots[i];
    if (s->host != h) continue;
    /* fenced: out of the membership now (its epoch is stale), no control line heard from it again */
    if (o->coord) ftar_coord_evict(o->coord, i);
    if (s->bev) close_conn(s->bev), s->bev = NULL;
    s->pid = 0;
    if (s->state == SLOT_STARTING || s->state == SLOT_RUNNING) {
      s->lost = "host_lost";
      operator_slot_exited(o, s, SIGKILL); /* a wait status: killed by signal 9 */
    } else {
      r->used--, s->last_host = h, s->host = -1;
    }
  }
}

void hosts_conn_closed(operator_state *o, int h) { host_lost(o, h, "its agent's connection closed"); }

/* The operator's tick runs every 0.25 s (operator.c); a gap past this much
 * is our loop stalled (SIGSTOP, a long REPL expression). */
#define TICK_STALL_S 0.5

void hosts_tick(operator_state *o) {
  double now = tr_now(), gap = o->hosts_tick_at > 0 ? now - o->hosts_tick_at : 0;
  o->hosts_tick_at = now;
  /* the agents' lines sat unread while we stalled (and this tick may run
   * before they are read): that time is not their silence, as the FTAR
   * coordinator judges its members. Only the stall beyond TICK_STALL_S is
   * taken off, so a loop that merely lags still loses a dead host. */
  if (gap > TICK_STALL_S)
    for (int i = 0; i < o->nhosts; i++)
      if (o->hosts[i].alive) o->hosts[i].last_heard = fmin(now, o->hosts[i].last_heard + gap - TICK_STALL_S);
  for (int i = 0; i < o->nhosts; i++)
    if (o->hosts[i].alive && now - o->hosts[i].last_heard > lapse_s(o)) {
      char why[96];
      snprintf(why, sizeof why, "no word from its agent for %.1f s", now - o->hosts[i].last_heard);
      host_lost(o, i, why);
    }
  if (o->stopping) return;
  if (now - o->hosts_policy_at >= 1.0) {
    o->hosts_policy_at = now;
    for (int i = 0; i < o->nhosts; i++)
      if (o->hosts[i].cordoned) ask_policy(o, i, "tick");
  }
  for (int i = 0; i < o->nslots; i++) {
    slot *s = &o->slots[i];
    int backoff = s->timer && evtimer_pending(s->timer, NULL); /* its replacement's timer places it */
    if (s->unplaced && s->state == SLOT_WAITING && !backoff && !o->adopting) hosts_place(o, i, s->mode);
  }
}
