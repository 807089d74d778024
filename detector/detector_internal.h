/* detector_internal.h — the detector's layout, shared by detector.c (the
 * engine), detector_lua.c (its policy files on the policy engine: checks,
 * dry runs, parsing results), detector_views.c (the read-only views) and
 * prom.c (the exposition). Nothing outside detector/ includes it: the
 * operator sees only detector.h. The VM, sandbox, budget, loading and
 * inotify are the policy engine's (core/lua/policy.c).
 */
#ifndef TRANSOM_DETECTOR_INTERNAL_H
#define TRANSOM_DETECTOR_INTERNAL_H

#include <limits.h>
#include <lua.h>
#include <stdint.h>

#include "detector.h"
#include "policy.h"
#include "stats.h"

#define DET_MAX_RULES 64   /* rule functions in rules.lua */
#define DET_NAME 48        /* rule and anomaly-kind names, bytes with the NUL */
#define DET_SEV 16
#define DET_DETAIL 256     /* anomaly details are cut to this */
#define DET_MSG POLICY_MSG /* error messages */
#define DET_RECENT 256     /* anomalies kept for the REPL */
#define DET_DEDUP 1024     /* (rule, kind, worker, step) identities remembered */
#define DET_MAX_KINDS 64   /* anomaly kinds counted separately for Prometheus */
#define DET_TICK_MAX 256   /* anomalies one tick can raise */
#define DET_PRINTS 20      /* print() lines per tick */
#define DET_OVER_BUDGET_OFF 3 /* ticks in a row over budget before a rule is disabled */

enum { DET_FILE_RULES, DET_FILE_ACTIONS, DET_NFILES };

/* What the views look at: the real fleet, or the small synthetic one the
 * dry runs of a reload use. */
typedef struct {
  series_store *s;
  double *hb;         /* (max_workers) last heartbeat; NAN: none */
  double *first_seen; /* (max_workers) first heartbeat or observation; NAN: unknown */
  int max_workers;
  double now;
} det_world;

typedef struct {
  char name[DET_NAME];
  int fn_ref;
  int over_budget;        /* ticks in a row the rule ran out of budget */
  int disabled;           /* until its file is reloaded */
  int failed_this_tick;
  char last_err[DET_MSG]; /* the last error reported, to report each distinct one once */
} det_rule;


typedef struct {
  char rule[DET_NAME], kind[DET_NAME], severity[DET_SEV], detail[DET_DETAIL];
  int worker;
  int64_t step;
} det_pending;

typedef struct {
  double time;
  int64_t step;
  int worker;
  char rule[DET_NAME], kind[DET_NAME], severity[DET_SEV], detail[DET_DETAIL], action[DET_SEV];
} det_record;

struct detector {
  detector_opts o;
  char policy_dir[PATH_MAX], fallback_dir[PATH_MAX];
  policy_engine *eng; /* the VM, sandbox, budget, loading, watching */
  policy *files[DET_NFILES]; /* rules.lua, actions.lua */
  lua_State *L;      /* the engine's VM */
  int busy;          /* inside tick / reload: callbacks may be running */
  int prints;        /* print() lines this tick */
  const char *cur_rule; /* the rule or policy being called (print() names it) */
  int cur_worker;
  det_world real, dry;
  int nrules;
  det_rule rules[DET_MAX_RULES];
  det_rule staged[DET_MAX_RULES]; /* rules.lua being loaded: checked, not yet in force */
  int nstaged;
  int state_ref, views_ref; /* registry refs */
  /* (rule, kind, worker, step) identities already reported */
  struct {
    uint64_t key;
    int worker;
    int64_t step;
  } seen[DET_DEDUP];
  int seen_head, seen_len;
  det_record recent[DET_RECENT];
  int recent_head, recent_len;
  /* counters (Prometheus) */
  int64_t steps_total, anomalies_total, rule_errors_total, reloads_total, reload_failures_total;
  int64_t actions_total[DET_ACT_COUNT];
  struct {
    char kind[DET_NAME];
    int64_t n;
  } kinds[DET_MAX_KINDS]; /* the last one is "other" once full */
  int nkinds;
  det_pending pend[DET_TICK_MAX];
  int npend, dropped;
};

/* --- detector.c --- */
/* Sends an event to on_event, stamping the wall-clock time. */
void det_emit(detector *d, detector_event *e);
double det_wall_time(void);

/* --- detector_views.c --- */
/* The detector a Lua state belongs to (the policy engine's ud). */
detector *det_of(lua_State *L);
/* Creates the view metatables in L's registry. */
void det_views_init(lua_State *L);
/* Push a view of worker id / the fleet in world W (the real world's are cached). */
void det_push_view(detector *d, det_world *W, int id);
void det_push_fleet(detector *d, det_world *W);
void det_push_worker_view(detector *d, int w);
void det_push_fleet_view(detector *d);

/* --- detector_lua.c --- */
/* The policy engine (budget, memory limit from d->o) with rules.lua and
 * actions.lua registered, the view metatables, `state`, the dry world. */
int det_lua_init(detector *d);
void det_lua_close(detector *d);
/* Reloads the policy files: force = every file, else only those whose bytes
 * changed. The first load takes a missing file from fallback_dir. */
int det_reload(detector *d, int force);
/* A rule or policy call (policy_call on the detector's engine). */
int det_call(detector *d, int nargs, int nresults, policy_err *e);
/* Parses what a rule returned (at stack index idx) into d->pend (store) or
 * just checks it. Returns the number of anomalies or -1 with err set. */
int det_collect(detector *d, int idx, const char *rule, int worker, int64_t wstep, int store, char *err, size_t n);
/* Parses a policy's result at idx into *a (action, worker, step, detail). */
int det_parse_action(lua_State *L, int idx, detector_action *a, char *detail, size_t dn, char *err, size_t en);

#endif
