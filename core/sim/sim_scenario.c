/* sim_scenario.c — runs the scenario checker (lua/transom/sim.lua) and reads
 * the result into C (sim_scenario.h). Does not simulate (sim.c) or print
 * (sim_cli.c). */
#include "sim_scenario.h"

#include <lauxlib.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "lua_host.h"
#include "util.h"

/* Every number C reads from a resolved scenario, once: its key in the flat
 * table sim.resolve returns, integer or not, and where it goes. */
#define I(k, f) {k, 1, offsetof(sim_config, f)}
#define N(k, f) {k, 0, offsetof(sim_config, f)}
static const struct {
  const char *key;
  int integer;
  size_t off;
} fields[] = {
    I("job.replicas", replicas), I("job.gpus_per_replica", gpus_per_replica), I("job.gpus_per_host", gpus_per_host),
    I("job.min_replicas", min_replicas), I("job.steps", steps), N("job.step_s", step_s),
    N("job.degraded_step_s", degraded_step_s), N("job.startup_s", startup_s),
    N("failures.per_gpu_hour", per_gpu_hour), N("failures.hardware_fraction", hardware_fraction),
    N("failures.every_s", every_s), N("failures.detect_s", detect_s),
    I("checkpoint.every_steps", ckpt_every_steps), N("checkpoint.stall_s", ckpt_stall_s),
    N("checkpoint.write_s", ckpt_write_s), N("checkpoint.load_s", load_s),
    N("replace.redo_s", redo_s), N("replace.delay_s", delay_s), N("replace.backoff", backoff),
    N("replace.delay_max_s", delay_max_s), N("replace.start_s", start_s), N("replace.catchup_s", catchup_s),
    N("replace.join_s", join_s), N("restart_all.restart_s", restart_s),
    N("hosts.spare_fraction", spare_fraction), N("hosts.repair_s", repair_s),
};
#undef I
#undef N

static int require_sim_module(lua_State *L) {
  lua_getglobal(L, "require");
  lua_pushliteral(L, "transom.sim");
  return lua_host_pcall(L, 1, 1); /* [sim] */
}

/* t[key] as an integer (0 when absent); [.., t] stays. */
static int64_t int_field(lua_State *L, const char *key) {
  lua_getfield(L, -1, key);
  int64_t v = lua_tointeger(L, -1);
  lua_pop(L, 1);
  return v;
}

/* --- loading --- */

/* The checked table's sweep, sensitivity and reference lists; [.., scn]. */
static int read_extras(lua_State *L, sim_scenario *s) {
  s->seeds = int_field(L, "seeds");
  lua_getfield(L, -1, "name"); /* [scn, name] */
  snprintf(s->name, sizeof s->name, "%s", lua_tostring(L, -1) ? lua_tostring(L, -1) : "");
  lua_pop(L, 1);
  lua_getfield(L, -1, "sweep"); /* [scn, sweep] */
  if (lua_istable(L, -1)) {
    lua_getfield(L, -1, "gpus"); /* [scn, sweep, gpus] */
    int n = (int)lua_rawlen(L, -1);
    if (n > SIM_MAX_SWEEP) return tr_fail(TR_EINVAL, "%s: sweep.gpus has more than %d entries", s->path, SIM_MAX_SWEEP);
    for (int i = 0; i < n; i++) {
      lua_rawgeti(L, -1, i + 1);
      s->sweep[s->nsweep++] = lua_tointeger(L, -1);
      lua_pop(L, 1);
    }
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  lua_getfield(L, -1, "sensitivity"); /* [scn, sens] */
  if (lua_istable(L, -1)) {
    s->sens_gpus = int_field(L, "gpus");
    lua_getfield(L, -1, "factor");
    s->sens_factor = lua_tonumber(L, -1);
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  lua_getfield(L, -1, "reference"); /* [scn, refs] */
  int n = lua_istable(L, -1) ? (int)lua_rawlen(L, -1) : 0;
  if (n > SIM_MAX_REFS) return tr_fail(TR_EINVAL, "%s: reference has more than %d entries", s->path, SIM_MAX_REFS);
  for (int i = 0; i < n; i++) {
    sim_reference *r = &s->refs[s->nrefs++];
    lua_rawgeti(L, -1, i + 1); /* [scn, refs, ref] */
    r->gpus = int_field(L, "gpus");
    lua_getfield(L, -1, "ettr");
    r->ettr = lua_tonumber(L, -1);
    lua_getfield(L, -2, "mode");
    r->mode = strcmp(lua_tostring(L, -1), "replace") == 0 ? SIM_REPLACE : SIM_RESTART_ALL;
    lua_getfield(L, -3, "label");
    snprintf(r->label, sizeof r->label, "%s", lua_tostring(L, -1));
    lua_pop(L, 4);
  }
  lua_pop(L, 1);
  return TR_OK;
}

int sim_scenario_load(lua_State *L, const char *path, const char *const *sets, int nsets, sim_scenario *s) {
  memset(s, 0, sizeof *s);
  s->lua_ref = LUA_NOREF;
  snprintf(s->path, sizeof s->path, "%s", path);
  int top = lua_gettop(L);
  int rc = require_sim_module(L);
  if (rc) return rc;
  lua_getfield(L, -1, "load"); /* [sim, load] */
  lua_pushstring(L, path);
  lua_createtable(L, nsets, 0);
  for (int i = 0; i < nsets; i++) {
    lua_pushstring(L, sets[i]);
    lua_rawseti(L, -2, i + 1);
  }
  rc = lua_host_pcall_file(L, path, "scenario", 2, 1); /* [sim, scn] */
  if (!rc) rc = read_extras(L, s);
  if (!rc) s->lua_ref = luaL_ref(L, LUA_REGISTRYINDEX); /* [sim] */
  lua_settop(L, top);
  return rc;
}

void sim_scenario_free(lua_State *L, sim_scenario *s) {
  if (s->lua_ref != LUA_NOREF) luaL_unref(L, LUA_REGISTRYINDEX, s->lua_ref);
  s->lua_ref = LUA_NOREF;
}

/* --- resolving --- */

/* The chaos list of a resolved table; [.., flat]. */
static int read_chaos(lua_State *L, const sim_scenario *s, sim_config *c) {
  lua_getfield(L, -1, "chaos"); /* [flat, chaos] */
  int n = (int)lua_rawlen(L, -1);
  if (n > SIM_MAX_CHAOS) {
    lua_pop(L, 1);
    return tr_fail(TR_EINVAL, "%s: failures.chaos has more than %d entries", s->path, SIM_MAX_CHAOS);
  }
  for (int i = 0; i < n; i++) {
    lua_rawgeti(L, -1, i + 1); /* [flat, chaos, item] */
    c->chaos[i].at_step = int_field(L, "at_step");
    c->chaos[i].replica = int_field(L, "replica");
    lua_pop(L, 1);
    if (c->chaos[i].replica >= c->replicas) {
      lua_pop(L, 1);
      return tr_fail(TR_EINVAL, "%s: failures.chaos[%d]: replica %lld does not exist (%lld replicas)", s->path, i + 1,
                     (long long)c->chaos[i].replica, (long long)c->replicas);
    }
  }
  c->nchaos = n;
  lua_pop(L, 1);
  return TR_OK;
}

int sim_scenario_resolve(lua_State *L, const sim_scenario *s, int64_t gpus, sim_config *c) {
  memset(c, 0, sizeof *c);
  int top = lua_gettop(L);
  int rc = require_sim_module(L);
  if (rc) return rc;
  lua_getfield(L, -1, "resolve");                    /* [sim, resolve] */
  lua_rawgeti(L, LUA_REGISTRYINDEX, s->lua_ref);      /* [sim, resolve, scn] */
  if (gpus > 0) lua_pushinteger(L, gpus);
  else lua_pushnil(L);                                /* [sim, resolve, scn, gpus] */
  rc = lua_host_pcall_file(L, s->path, "scenario", 2, 1); /* [sim, flat] */
  if (rc) goto done;
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
    lua_getfield(L, -1, fields[i].key);
    char *dst = (char *)c + fields[i].off;
    if (fields[i].integer) *(int64_t *)dst = lua_tointeger(L, -1);
    else *(double *)dst = lua_tonumber(L, -1);
    lua_pop(L, 1);
  }
  rc = read_chaos(L, s, c);
done:
  lua_settop(L, top);
  return rc;
}

int sim_scenario_help(lua_State *L) {
  int top = lua_gettop(L);
  int rc = require_sim_module(L);
  if (rc) return rc;
  lua_getfield(L, -1, "help");
  rc = lua_host_pcall(L, 0, 1);
  if (!rc) printf("%s\n", lua_tostring(L, -1));
  lua_settop(L, top);
  return rc;
}
