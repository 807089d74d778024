/* policy_internal.h — the policy engine's layout, shared by policy.c (VM,
 * sandbox, calls, loading) and policy_watch.c (inotify). Nothing outside
 * core/lua includes it: callers see policy.h. */
#ifndef TRANSOM_POLICY_INTERNAL_H
#define TRANSOM_POLICY_INTERNAL_H

#include <limits.h>
#include <stdint.h>

#include "policy.h"

struct event;

struct policy {
  policy_engine *e;
  policy_opts o;       /* the strings point into the fields below */
  char name[POLICY_NAME];
  char dir[PATH_MAX], fallback_dir[PATH_MAX];
  char path[PATH_MAX]; /* where the version in force came from ("" before the first load) */
  uint64_t hash;       /* of its bytes */
  uint64_t failed_hash;/* bytes that failed last (the watcher does not retry them) */
  int mod_ref;         /* the table in force (registry ref) */
  int wd;              /* inotify watch of dir, -1 when not watched */
  int twd;             /* and of the folder a symlinked file resolves to (-1: none, or dir itself) */
  policy *next;
};

struct policy_engine {
  policy_engine_opts o;
  lua_State *L;
  size_t mem_used, mem_limit;
  int mem_enforce; /* the cap holds only inside policy calls */
  int budget;      /* instructions per call */
  int budget_hit;  /* set by the hook; the sandbox's pcall re-raises while set */
  int dry_run;     /* loading and checking a file */
  int loading;     /* inside policy_reload: no nested reloads */
  policy *policies;/* in the order added */
  /* the watcher */
  struct event_base *base;
  int ino_fd;
  struct event *ino_ev, *debounce_ev;
};

/* policy_watch.c: watch p's folder when the engine is watching. */
int policy_watch_add(policy_engine *e, policy *p);

#endif
