/* detector_views.c — the read-only views rules and policies see: a worker
 * view (userdata: latest values, ages, checksums as fields; statistics
 * computed in C as methods) and the fleet view (aggregates across workers).
 * Writes raise, and so does reading a field that does not exist.
 *
 * Views read the data live (no copies per tick); the real world's views are
 * created once per worker and cached in the registry. The dry runs of a
 * reload get views of the synthetic world. It does not evaluate rules
 * (detector.c) or load them (detector_lua.c). Detector's thread only.
 */
#include <lauxlib.h>
#include <limits.h>
#include <math.h>
#include <string.h>

#include "detector_internal.h"

#define WORKER_VIEW_MT "transom.detector.worker_view"
#define FLEET_VIEW_MT "transom.detector.fleet_view"

detector *det_of(lua_State *L) { return policy_engine_ud(L); }

/* A worker view: userdata pointing at a world and a worker id. It holds no
 * resources (no __gc): the detector closes its VM before freeing the worlds,
 * so a view never outlives what it points at. */
typedef struct {
  det_world *w;
  int id;
} wview;

typedef struct {
  det_world *w;
} fview;

static wview *check_wview(lua_State *L, int i) { return luaL_checkudata(L, i, WORKER_VIEW_MT); }
static fview *check_fview(lua_State *L, int i) { return luaL_checkudata(L, i, FLEET_VIEW_MT); }

static int check_metric(lua_State *L, int i) {
  const char *name = luaL_checkstring(L, i);
  int m = detector_metric_index(name);
  if (m < 0) return luaL_argerror(L, i, lua_pushfstring(L, "unknown metric '%s'", name));
  return m;
}

static int opt_count(lua_State *L, int i) {
  lua_Integer n = luaL_optinteger(L, i, 0);
  return n < 0 ? 0 : n > INT_MAX ? INT_MAX : (int)n;
}

void det_push_view(detector *d, det_world *W, int id) {
  lua_State *L = d->L;
  if (W == &d->real) {
    lua_rawgeti(L, LUA_REGISTRYINDEX, d->views_ref); /* [views] */
    if (lua_rawgeti(L, -1, id + 1) != LUA_TNIL) {    /* [views, view] */
      lua_remove(L, -2);
      return;
    }
    lua_pop(L, 1); /* [views] */
  }
  wview *v = lua_newuserdatauv(L, sizeof *v, 0);
  v->w = W;
  v->id = id;
  luaL_setmetatable(L, WORKER_VIEW_MT);
  if (W == &d->real) {        /* [views, view] */
    lua_pushvalue(L, -1);
    lua_rawseti(L, -3, id + 1);
    lua_remove(L, -2);        /* [view] */
  }
}

void det_push_fleet(detector *d, det_world *W) {
  lua_State *L = d->L;
  if (W == &d->real) {
    lua_rawgeti(L, LUA_REGISTRYINDEX, d->views_ref);
    if (lua_getfield(L, -1, "fleet") != LUA_TNIL) {
      lua_remove(L, -2);
      return;
    }
    lua_pop(L, 1);
  }
  fview *v = lua_newuserdatauv(L, sizeof *v, 0);
  v->w = W;
  luaL_setmetatable(L, FLEET_VIEW_MT);
  if (W == &d->real) {
    lua_pushvalue(L, -1);
    lua_setfield(L, -3, "fleet");
    lua_remove(L, -2);
  }
}

void det_push_worker_view(detector *d, int w) { det_push_view(d, &d->real, w); }
void det_push_fleet_view(detector *d) { det_push_fleet(d, &d->real); }

static void push_num_or_nil(lua_State *L, double v, int have) {
  if (have) lua_pushnumber(L, v);
  else lua_pushnil(L);
}

static int view_newindex(lua_State *L) {
  return luaL_error(L, "detector views are read-only (assigning '%s')",
                    lua_type(L, 2) == LUA_TSTRING ? lua_tostring(L, 2) : luaL_typename(L, 2));
}

/* w:value(metric [, ago]) -> number | nil */
static int wv_value(lua_State *L) {
  wview *v = check_wview(L, 1);
  int m = check_metric(L, 2), ago = opt_count(L, 3);
  push_num_or_nil(L, series_value(v->w->s, v->id, m, ago), ago < series_len(v->w->s, v->id));
  return 1;
}

/* w:step_at(ago) -> integer | nil */
static int wv_step_at(lua_State *L) {
  wview *v = check_wview(L, 1);
  int ago = opt_count(L, 2);
  if (ago < series_len(v->w->s, v->id)) lua_pushinteger(L, series_step(v->w->s, v->id, ago));
  else lua_pushnil(L);
  return 1;
}

/* w:ewma(metric) -> mean, std (NaN when nothing finite was seen) */
static int wv_ewma(lua_State *L) {
  wview *v = check_wview(L, 1);
  const ewma *e = series_ewma(v->w->s, v->id, check_metric(L, 2));
  lua_pushnumber(L, e && e->n ? e->mean : NAN);
  lua_pushnumber(L, e && e->n ? ewma_std(e) : NAN);
  return 2;
}

/* w:z(metric) -> z-score of the latest value against the EWMA before it */
static int wv_z(lua_State *L) {
  wview *v = check_wview(L, 1);
  lua_pushnumber(L, series_z(v->w->s, v->id, check_metric(L, 2)));
  return 1;
}

/* w:median / mad / mean(metric [, n]); w:percentile(metric, p [, n]) over the last n (all kept when 0) */
static int wv_median(lua_State *L) {
  wview *v = check_wview(L, 1);
  lua_pushnumber(L, series_median(v->w->s, v->id, check_metric(L, 2), opt_count(L, 3)));
  return 1;
}
static int wv_mad(lua_State *L) {
  wview *v = check_wview(L, 1);
  lua_pushnumber(L, series_mad(v->w->s, v->id, check_metric(L, 2), opt_count(L, 3)));
  return 1;
}
static int wv_mean(lua_State *L) {
  wview *v = check_wview(L, 1);
  lua_pushnumber(L, series_mean(v->w->s, v->id, check_metric(L, 2), opt_count(L, 3)));
  return 1;
}
static int wv_percentile(lua_State *L) {
  wview *v = check_wview(L, 1);
  int m = check_metric(L, 2);
  double p = luaL_checknumber(L, 3);
  lua_pushnumber(L, series_percentile(v->w->s, v->id, m, p, opt_count(L, 4)));
  return 1;
}

/* w:run_above(metric, threshold) -> how many latest observations in a row exceed it */
static int wv_run_above(lua_State *L) {
  wview *v = check_wview(L, 1);
  int m = check_metric(L, 2);
  lua_pushinteger(L, series_run_above(v->w->s, v->id, m, luaL_checknumber(L, 3)));
  return 1;
}

/* w:series(metric [, n]) -> {values, oldest first}; w:steps([n]) -> {steps} */
static int wv_series(lua_State *L) {
  wview *v = check_wview(L, 1);
  int m = check_metric(L, 2), len = series_len(v->w->s, v->id), n = opt_count(L, 3);
  if (n == 0 || n > len) n = len;
  lua_createtable(L, n, 0);
  for (int k = 0; k < n; k++) {
    lua_pushnumber(L, series_value(v->w->s, v->id, m, n - 1 - k));
    lua_rawseti(L, -2, k + 1);
  }
  return 1;
}
static int wv_steps(lua_State *L) {
  wview *v = check_wview(L, 1);
  int len = series_len(v->w->s, v->id), n = opt_count(L, 2);
  if (n == 0 || n > len) n = len;
  lua_createtable(L, n, 0);
  for (int k = 0; k < n; k++) {
    lua_pushinteger(L, series_step(v->w->s, v->id, n - 1 - k));
    lua_rawseti(L, -2, k + 1);
  }
  return 1;
}

/* w:checksum_at(step) -> integer | nil */
static int wv_checksum_at(lua_State *L) {
  wview *v = check_wview(L, 1);
  uint32_t crc;
  if (series_checksum_at(v->w->s, v->id, luaL_checkinteger(L, 2), &crc)) lua_pushinteger(L, crc);
  else lua_pushnil(L);
  return 1;
}

static int wv_tostring(lua_State *L) {
  wview *v = check_wview(L, 1);
  if (series_len(v->w->s, v->id))
    lua_pushfstring(L, "worker view %d (step %I)", v->id, (lua_Integer)series_step(v->w->s, v->id, 0));
  else
    lua_pushfstring(L, "worker view %d (no step yet)", v->id);
  return 1;
}

/* How long a worker is known to have been alive without progressing: from
 * its last step (or first sight) to its latest heartbeat. Unlike
 * progress_age it stops growing when the process stops (SIGSTOP, death), so
 * a frozen process never looks like a hung training thread. */
static double live_stall(double hb, double last) { return hb > last ? hb - last : 0; }

/* Fields: id, step, n, total, time, now, progress_age, heartbeat_age,
 * live_stall, checksum, checksum_step, and every metric's latest value; nil when there
 * is nothing yet. Any other name raises (a misspelled field is an error). */
static int wv_index(lua_State *L) {
  wview *v = check_wview(L, 1);
  const char *k = luaL_checkstring(L, 2);
  lua_pushvalue(L, 2);
  if (lua_rawget(L, lua_upvalueindex(1)) != LUA_TNIL) return 1; /* a method */
  lua_pop(L, 1);
  det_world *W = v->w;
  int id = v->id, n = series_len(W->s, id);
  int m = detector_metric_index(k);
  if (m >= 0) {
    push_num_or_nil(L, series_value(W->s, id, m, 0), n > 0);
    return 1;
  }
  int64_t ckstep;
  uint32_t crc;
  int have_ck = series_checksum(W->s, id, &ckstep, &crc);
  double hb = W->hb[id], last = n ? series_time(W->s, id, 0) : W->first_seen[id];
  if (strcmp(k, "id") == 0) lua_pushinteger(L, id);
  else if (strcmp(k, "step") == 0) {
    if (n) lua_pushinteger(L, series_step(W->s, id, 0));
    else lua_pushnil(L);
  } else if (strcmp(k, "n") == 0) lua_pushinteger(L, n);
  else if (strcmp(k, "total") == 0) lua_pushinteger(L, series_total(W->s, id));
  else if (strcmp(k, "time") == 0) push_num_or_nil(L, series_time(W->s, id, 0), n > 0);
  else if (strcmp(k, "now") == 0) lua_pushnumber(L, W->now);
  else if (strcmp(k, "progress_age") == 0) push_num_or_nil(L, W->now - last, !isnan(last));
  else if (strcmp(k, "heartbeat_age") == 0) push_num_or_nil(L, W->now - hb, !isnan(hb));
  else if (strcmp(k, "live_stall") == 0) push_num_or_nil(L, live_stall(hb, last), !isnan(hb) && !isnan(last));
  else if (strcmp(k, "checksum") == 0) {
    if (have_ck) lua_pushinteger(L, crc);
    else lua_pushnil(L);
  } else if (strcmp(k, "checksum_step") == 0) {
    if (have_ck) lua_pushinteger(L, ckstep);
    else lua_pushnil(L);
  } else
    return luaL_error(L, "worker view has no field '%s'", k);
  return 1;
}

static const luaL_Reg wview_methods[] = {
    {"value", wv_value},   {"step_at", wv_step_at},       {"ewma", wv_ewma},       {"z", wv_z},
    {"median", wv_median}, {"mad", wv_mad},               {"mean", wv_mean},       {"percentile", wv_percentile},
    {"run_above", wv_run_above}, {"series", wv_series},   {"steps", wv_steps},     {"checksum_at", wv_checksum_at},
    {NULL, NULL}};

/* fleet:median / mad / mean(metric [, exclude]); fleet:percentile(metric, p [, exclude])
 * over the latest value of every known worker, leaving out worker `exclude`. */
static int opt_exclude(lua_State *L, int i) { return (int)luaL_optinteger(L, i, -1); }
static int fv_median(lua_State *L) {
  fview *v = check_fview(L, 1);
  int m = check_metric(L, 2);
  lua_pushnumber(L, series_fleet_median(v->w->s, m, opt_exclude(L, 3)));
  return 1;
}
static int fv_mad(lua_State *L) {
  fview *v = check_fview(L, 1);
  int m = check_metric(L, 2);
  lua_pushnumber(L, series_fleet_mad(v->w->s, m, opt_exclude(L, 3)));
  return 1;
}
static int fv_mean(lua_State *L) {
  fview *v = check_fview(L, 1);
  int m = check_metric(L, 2);
  lua_pushnumber(L, series_fleet_mean(v->w->s, m, opt_exclude(L, 3)));
  return 1;
}
static int fv_percentile(lua_State *L) {
  fview *v = check_fview(L, 1);
  int m = check_metric(L, 2);
  double p = luaL_checknumber(L, 3);
  lua_pushnumber(L, series_fleet_percentile(v->w->s, m, p, opt_exclude(L, 4)));
  return 1;
}

/* fleet:ids() -> {known worker ids, ascending} */
static int fv_ids(lua_State *L) {
  fview *v = check_fview(L, 1);
  lua_newtable(L);
  int k = 0;
  for (int w = 0; w < v->w->max_workers; w++)
    if (series_known(v->w->s, w)) {
      lua_pushinteger(L, w);
      lua_rawseti(L, -2, ++k);
    }
  return 1;
}

/* fleet:worker(id) -> view | nil */
static int fv_worker(lua_State *L) {
  fview *v = check_fview(L, 1);
  lua_Integer id = luaL_checkinteger(L, 2);
  if (id < 0 || id >= v->w->max_workers || !series_known(v->w->s, (int)id)) {
    lua_pushnil(L);
    return 1;
  }
  det_push_view(det_of(L), v->w, (int)id);
  return 1;
}

/* fleet:checksums(step) -> {[worker] = crc}, n, complete
 * complete: no known worker that reports checksums is still short of step. */
static int fv_checksums(lua_State *L) {
  fview *v = check_fview(L, 1);
  lua_Integer step = luaL_checkinteger(L, 2);
  lua_newtable(L);
  int n = 0, complete = 1;
  for (int w = 0; w < v->w->max_workers; w++) {
    if (!series_known(v->w->s, w)) continue;
    uint32_t crc;
    int64_t last;
    if (series_checksum_at(v->w->s, w, step, &crc)) {
      lua_pushinteger(L, crc);
      lua_rawseti(L, -2, w);
      n++;
    } else if (series_checksum(v->w->s, w, &last, &crc) && last < step) {
      complete = 0;
    }
  }
  lua_pushinteger(L, n);
  lua_pushboolean(L, complete);
  return 3;
}

static int fv_tostring(lua_State *L) {
  check_fview(L, 1);
  lua_pushliteral(L, "fleet view");
  return 1;
}

/* Fields: now, step (newest step of any worker), min_step, size (known
 * workers), progress_age (since the newest observation of any worker). */
static int fv_index(lua_State *L) {
  fview *v = check_fview(L, 1);
  const char *k = luaL_checkstring(L, 2);
  lua_pushvalue(L, 2);
  if (lua_rawget(L, lua_upvalueindex(1)) != LUA_TNIL) return 1;
  lua_pop(L, 1);
  det_world *W = v->w;
  int size = 0, have = 0;
  int64_t mx = 0, mn = 0;
  double newest = NAN;
  for (int w = 0; w < W->max_workers; w++) {
    if (!series_known(W->s, w)) continue;
    size++;
    if (!series_len(W->s, w)) continue;
    int64_t s = series_step(W->s, w, 0);
    double t = series_time(W->s, w, 0);
    if (!have++ || s > mx) mx = s;
    if (have == 1 || s < mn) mn = s;
    if (isnan(newest) || t > newest) newest = t;
  }
  if (strcmp(k, "now") == 0) lua_pushnumber(L, W->now);
  else if (strcmp(k, "size") == 0) lua_pushinteger(L, size);
  else if (strcmp(k, "step") == 0) {
    if (have) lua_pushinteger(L, mx);
    else lua_pushnil(L);
  } else if (strcmp(k, "min_step") == 0) {
    if (have) lua_pushinteger(L, mn);
    else lua_pushnil(L);
  } else if (strcmp(k, "progress_age") == 0) push_num_or_nil(L, W->now - newest, have);
  else
    return luaL_error(L, "fleet view has no field '%s'", k);
  return 1;
}

static const luaL_Reg fview_methods[] = {{"median", fv_median},   {"mad", fv_mad},       {"mean", fv_mean},
                                         {"percentile", fv_percentile}, {"ids", fv_ids}, {"worker", fv_worker},
                                         {"checksums", fv_checksums}, {NULL, NULL}};

static void new_view_mt(lua_State *L, const char *name, const luaL_Reg *methods, lua_CFunction index,
                        lua_CFunction tostring) {
  luaL_newmetatable(L, name); /* [mt] */
  lua_newtable(L);            /* [mt, methods] */
  luaL_setfuncs(L, methods, 0);
  lua_pushcclosure(L, index, 1); /* [mt, index] */
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, view_newindex);
  lua_setfield(L, -2, "__newindex");
  lua_pushcfunction(L, tostring);
  lua_setfield(L, -2, "__tostring");
  lua_pushliteral(L, "read-only view");
  lua_setfield(L, -2, "__metatable");
  lua_pop(L, 1); /* [] */
}

void det_views_init(lua_State *L) {
  new_view_mt(L, WORKER_VIEW_MT, wview_methods, wv_index, wv_tostring);
  new_view_mt(L, FLEET_VIEW_MT, fview_methods, fv_index, fv_tostring);
}
