/* job.c — runs the Lua job checker and reads the result into C (job.h),
 * under the declarative-file budget (lua_host_pcall_file): a job file is a
 * declarative table, and one that runs away stops with an error instead of
 * hanging its caller. */
#include "job.h"

#include <lauxlib.h>
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "lua_host.h"
#include "util.h"

/* Every field C reads, once: key, kind ('s' string, 'i' integer, 'n'
 * number), offset, capacity (strings). */
#define S(k) {#k, 's', offsetof(job_config, k), sizeof(((job_config *)0)->k)}
#define I(k) {#k, 'i', offsetof(job_config, k), 0}
#define N(k) {#k, 'n', offsetof(job_config, k), 0}
#define SUB(path, kind, k, cap) {path, kind, offsetof(job_config, k), cap}
#define B(k) {#k, 'b', offsetof(job_config, k), 0}
static const struct {
  const char *key;
  char kind;
  size_t off, cap;
} fields[] = {
    S(name), S(model), S(data), S(run_dir), S(sample_prompt), S(val_data), S(data_format), S(tokenizer),
    S(init_from), I(vocab_size),
    I(n_layer), I(n_head), I(n_embd), I(block_size), I(batch_size),
    I(max_steps), I(warmup_steps), I(lr_decay_steps), I(eval_interval), I(eval_steps),
    I(log_interval), I(sample_tokens), I(seed), I(threads), S(device), S(precision),
    N(lr), N(min_lr), N(weight_decay), N(beta1), N(beta2), N(eps), N(grad_clip), N(temperature),
    SUB("checkpoint.every_steps", 'i', ckpt_every_steps, 0), SUB("checkpoint.keep_last", 'i', ckpt_keep_last, 0),
    SUB("checkpoint.keep_every", 'i', ckpt_keep_every, 0), SUB("checkpoint.map_mb", 'i', ckpt_map_mb, 0),
    SUB("checkpoint.every_seconds", 'n', ckpt_every_seconds, 0),
    SUB("checkpoint.when_busy", 's', ckpt_when_busy, sizeof(((job_config *)0)->ckpt_when_busy)),
    SUB("checkpoint.remote", 's', ckpt_remote, sizeof(((job_config *)0)->ckpt_remote)),
    SUB("checkpoint.remote_rate_mb", 'n', ckpt_remote_rate_mb, 0),
    SUB("pipeline.stages", 'i', pipe_stages, 0), SUB("pipeline.micro_batches", 'i', pipe_micro_batches, 0),
    SUB("pipeline.placement", 's', pipe_placement, sizeof(((job_config *)0)->pipe_placement)),
    SUB("pipeline.compression", 's', pipe_compression, sizeof(((job_config *)0)->pipe_compression)),
    SUB("pipeline.min_density", 'n', pipe_min_density, 0), SUB("pipeline.act_min_density", 'n', pipe_act_min_density, 0),
    SUB("pipeline.lan_mbit", 'n', pipe_lan_mbit, 0), SUB("pipeline.wan_mbit", 'n', pipe_wan_mbit, 0),
    SUB("pipeline.wan_ms", 'n', pipe_wan_ms, 0), SUB("pipeline.probe", 'b', pipe_probe, 0),
    SUB("pipeline.rebuilds", 'i', pipe_rebuilds, 0),
    I(replicas), I(hosts), I(min_replicas), I(max_replicas), I(checksum_interval), I(metrics_port), S(on_failure), S(policies), N(deadline), N(bucket_mb), N(hang_seconds), N(operator_grace), B(detector),
};
#undef S
#undef I
#undef N
#undef SUB
#undef B

/* Pushes cfg[path] where path is "key" or "table.key"; [cfg] -> [cfg, value] */
static void get_path(lua_State *L, const char *path) {
  const char *dot = strchr(path, '.');
  if (!dot) {
    lua_getfield(L, -1, path);
    return;
  }
  lua_pushlstring(L, path, (size_t)(dot - path)); /* [cfg, top] */
  lua_gettable(L, -2);                              /* [cfg, sub] */
  if (lua_istable(L, -1)) lua_getfield(L, -1, dot + 1);
  else lua_pushnil(L);                              /* [cfg, sub, value] */
  lua_remove(L, -2);                                /* [cfg, value] */
}

/* --- loading --- */

static int require_job_module(lua_State *L) {
  lua_getglobal(L, "require");
  lua_pushliteral(L, "transom.job");
  return lua_host_pcall(L, 1, 1); /* [job] */
}

int job_load(lua_State *L, const char *path, const char *const *sets, int nsets, job_config *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->lua_ref = LUA_NOREF;
  int top = lua_gettop(L);
  int rc = require_job_module(L);
  if (rc) return rc;
  lua_getfield(L, -1, "load");      /* [job, load] */
  lua_pushstring(L, path);
  lua_createtable(L, nsets, 0);
  for (int i = 0; i < nsets; i++) {
    lua_pushstring(L, sets[i]);
    lua_rawseti(L, -2, i + 1);
  }
  rc = lua_host_pcall_file(L, path, "job file", 2, 1); /* [job, cfg] */
  if (rc) {
    lua_settop(L, top);
    return rc;
  }
  snprintf(cfg->path, sizeof cfg->path, "%s", path);
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
    get_path(L, fields[i].key);
    char *dst = (char *)cfg + fields[i].off;
    if (fields[i].kind == 's') {
      const char *s = lua_tostring(L, -1);
      if (s && strlen(s) >= fields[i].cap) {
        lua_settop(L, top);
        return tr_fail(TR_EINVAL, "%s: key '%s' is too long (at most %zu bytes)", path, fields[i].key,
                       fields[i].cap - 1);
      }
      snprintf(dst, fields[i].cap, "%s", s ? s : "");
    } else if (fields[i].kind == 'b') {
      *(int *)dst = lua_toboolean(L, -1);
    } else if (fields[i].kind == 'i') {
      *(int64_t *)dst = lua_tointeger(L, -1);
    } else {
      *(double *)dst = lua_tonumber(L, -1);
    }
    lua_pop(L, 1);
  }
  lua_getfield(L, -1, "chaos"); /* [job, cfg, chaos] */
  for (int i = 1; lua_istable(L, -1) && i <= (int)lua_rawlen(L, -1); i++) {
    if (cfg->nchaos == JOB_MAX_CHAOS) {
      lua_settop(L, top);
      return tr_fail(TR_EINVAL, "%s: key 'chaos' has more than %d entries", path, JOB_MAX_CHAOS);
    }
    job_chaos *c = &cfg->chaos[cfg->nchaos++];
    lua_rawgeti(L, -1, i); /* [.., chaos, item] */
    lua_getfield(L, -1, "at_step");
    c->at_step = lua_tointeger(L, -1);
    lua_getfield(L, -2, "replica");
    c->replica = lua_tointeger(L, -1);
    lua_getfield(L, -3, "ms");
    c->ms = lua_tointeger(L, -1);
    lua_getfield(L, -4, "steps");
    c->steps = lua_tointeger(L, -1);
    lua_getfield(L, -5, "fault");
    snprintf(c->fault, sizeof c->fault, "%s", lua_tostring(L, -1) ? lua_tostring(L, -1) : "");
    lua_pop(L, 6);
  }
  lua_pop(L, 1);                                /* [job, cfg] */
  cfg->lua_ref = luaL_ref(L, LUA_REGISTRYINDEX); /* [job] */
  lua_settop(L, top);
  return TR_OK;
}

/* (job.h) through a symlinked project directory getcwd gives the physical one */
const char *job_working_dir(char *buf, size_t n) {
  const char *pwd = getenv("PWD");
  struct stat a, b;
  if (pwd && pwd[0] == '/' && strlen(pwd) < n && !strstr(pwd, "/./") && !strstr(pwd, "/../") &&
      !(strlen(pwd) >= 2 && strcmp(pwd + strlen(pwd) - 2, "/.") == 0) &&
      !(strlen(pwd) >= 3 && strcmp(pwd + strlen(pwd) - 3, "/..") == 0) && stat(pwd, &a) == 0 && stat(".", &b) == 0 &&
      a.st_dev == b.st_dev && a.st_ino == b.st_ino) {
    memcpy(buf, pwd, strlen(pwd) + 1);
    return buf;
  }
  return getcwd(buf, n);
}

char *job_dump(lua_State *L, const job_config *cfg) {
  int top = lua_gettop(L);
  if (require_job_module(L)) return NULL;
  lua_getfield(L, -1, "dump");
  lua_rawgeti(L, LUA_REGISTRYINDEX, cfg->lua_ref);
  char cwd[PATH_MAX];
  if (job_working_dir(cwd, sizeof cwd)) lua_pushstring(L, cwd);
  else lua_pushnil(L); /* (no working directory: the paths stay as given) */
  lua_newtable(L); /* [job, dump, cfg, cwd, caps]: what job_load can read back of each string */
  for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
    if (fields[i].kind == 's') {
      lua_pushinteger(L, (lua_Integer)fields[i].cap - 1);
      lua_setfield(L, -2, fields[i].key);
    }
  if (lua_host_pcall(L, 3, 1)) {
    lua_settop(L, top);
    return NULL;
  }
  char *s = strdup(lua_tostring(L, -1));
  lua_settop(L, top);
  if (!s) tr_fail(TR_ENOMEM, "out of memory");
  return s;
}

const char *job_where(lua_State *L, const job_config *cfg, const char *key, char *buf, size_t n) {
  int top = lua_gettop(L);
  snprintf(buf, n, "%s: key '%s'", cfg->path, key); /* unless the checker knows better */
  /* lua_pcall, not lua_host_pcall: a failure here must not replace the
   * error this prefixes (tr_error) */
  lua_getglobal(L, "require");
  lua_pushliteral(L, "transom.job");
  if (cfg->lua_ref != LUA_NOREF && lua_pcall(L, 1, 1, 0) == LUA_OK && lua_istable(L, -1)) {
    lua_getfield(L, -1, "where");                   /* [job, where] */
    lua_rawgeti(L, LUA_REGISTRYINDEX, cfg->lua_ref); /* [job, where, cfg] */
    lua_pushstring(L, key);
    if (lua_pcall(L, 2, 1, 0) == LUA_OK && lua_type(L, -1) == LUA_TSTRING) snprintf(buf, n, "%s", lua_tostring(L, -1));
  }
  lua_settop(L, top);
  return buf;
}

int job_help(lua_State *L) {
  int top = lua_gettop(L);
  int rc = require_job_module(L);
  if (rc) return rc;
  lua_getfield(L, -1, "help");
  rc = lua_host_pcall(L, 0, 1);
  if (!rc) printf("%s\n", lua_tostring(L, -1));
  lua_settop(L, top);
  return rc;
}
