/* operator_internal.h — the operator's state, shared by operator.c (the
 * loop, spawning, supervision), operator_policy.c (the restart policy) and
 * operator_repl.c (the control socket and the attach REPL). Not for other modules: they use operator.h. Everything
 * here lives on the operator's event-loop thread. */
#ifndef TRANSOM_OPERATOR_INTERNAL_H
#define TRANSOM_OPERATOR_INTERNAL_H

#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <lua.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "auth.h"
#include "detector.h"
#include "ftar.h"
#include "job.h"
#include "policy.h"
#include "prom.h"
#include "proto.h"
#include "step_record.h"

#define MAX_SLOTS 256
#define STEP_RING 256

typedef enum { SLOT_EMPTY, SLOT_STARTING, SLOT_RUNNING, SLOT_DONE, SLOT_DEAD, SLOT_WAITING } slot_state;
extern const char *slot_names[];

typedef struct operator_state operator_state;
struct conn; /* a connection to the workers' port (operator.c) */

/* Restart times kept for the restart policy's windows: a slot's last, the
 * job's last. */
#define RESTART_TIMES 32
#define RESTART_TIMES_JOB 128

typedef struct {
  operator_state *o;
  int slot;
  slot_state state;
  pid_t pid;
  struct bufferevent *bev;
  char mode[16];        /* start | resume | join */
  char donor[64];       /* its donor service, host:port */
  int64_t step;
  int restarts;
  double restart_at[RESTART_TIMES]; /* when its last restarts were (seconds since the operator started), a ring */
  struct event *timer;  /* pending replacement */
  double started, ready_at;
  uint32_t crc;
  int done;
  int64_t resume_step; /* -1: newest checkpoint; else newest at or before (a rollback) */
  int in_allreduce;     /* from its heartbeat: waiting in the all-reduce */
  double phase_for;     /* seconds in that phase, as of its last heartbeat */
  step_record last; /* its latest step report */
  int adopted;      /* a live worker of a previous operator (not our child: its connection is its life) */
  int64_t logged;   /* the last step metrics.jsonl holds for it (a replay drops what is older) */
  int64_t replayed_to; /* adopted: the step it said HELLO at; its STEP lines up to it are a replay */
  int host;         /* the agent's host it runs on (operator_hosts.c), -1: this host (our child) */
  int last_host;    /* the host it last failed on: a replacement goes elsewhere first */
  int unplaced;     /* waiting for a free slot on a healthy host */
  unsigned gen;     /* its latest SPAWN to an agent: the agent's STARTED / EXITED / KILL name it, so an older
                       worker's late word is never taken for the new one's */
  const char *lost; /* why it is gone when no exit status says it ("host_lost") */
  char agent[64];   /* adopted before its agent registered again: that agent's name (its gen in gen), until the
                       agent names it (operator_hosts.c, claim_live); "" otherwise */
  int ours;         /* this operator started, placed or adopted a worker for it: a HELLO live=1 for it now is
                       from a worker it already let go (replaced, fenced): refused */
  int in_ring;      /* a member of the FTAR group's latest epoch */
  int stepped;      /* reported a step since it was ready (a joiner that did not may be a step behind) */
} slot;

/* A host with a `transom agent` (operator_hosts.c). */
#define MAX_HOSTS 64
#define HOST_FAILS 16
typedef struct {
  char name[64], addr[64];
  int cores, gpus, nslots, used;
  int alive, cordoned;
  struct bufferevent *bev; /* the agent's connection */
  double last_heard;       /* tr_now() */
  double fail_at[HOST_FAILS]; /* its failures (seconds since the operator started), a ring */
  int nfail;
  double cordoned_at;
  int cordoned_by_hand;    /* cordon(h) from attach: only uncordon(h) lifts it, never hosts.lua */
  double probe_t0;         /* tr_now() when its link probe's first line came; 0: none under way */
  double link_Bps;         /* its link's rate to us, from the last probe (bytes/s; 0: none yet) */
  int slow_probes;         /* probes in a row far below the fastest host's */
  int slow_named;          /* the slow_link anomaly was raised (once until it recovers) */
} host_rec;

typedef struct {
  int64_t step;
  int count, expect;
  double loss, ms, tok_s;
} step_acc;

struct operator_state {
  job_config *cfg;
  lua_State *L;
  const char *dir, *self;
  struct event_base *base;
  ftar_coord *coord;
  struct evconnlistener *lis, *ctl;
  struct ctl_conn *ctl_conns; /* the attached control clients (operator_repl.c) */
  int port, threads, nslots;
  slot slots[MAX_SLOTS];
  FILE *metrics, *events, *coord_log;
  /* auth_refused events: at most AUTH_EVENTS_BURST per AUTH_EVENTS_WINDOW s, the rest counted (operator.c) */
  double auth_ev_window;
  int auth_ev_n, auth_ev_dropped;
  policy_engine *pol;        /* the restart policy's engine: its own VM, watched */
  policy *restart;           /* restart.lua */
  int state_ref;             /* the policy's state table (in pol's VM), kept across reloads */
  int restarts_total, restart_all_pending, stopping, finished, exit_code;
  double restart_at[RESTART_TIMES_JOB]; /* every slot's restarts and full restarts, a ring (times as a slot's) */
  int64_t best_step, stop_at, last_ckpt;
  int stop_lead; /* at a stop: the lowest running slot, which checkpoints a step called off below min_replicas */
  char adv_host[256]; /* the coordinator's address as workers see it */
  int *chaos_fired;
  step_acc acc[STEP_RING];
  double t0, lost_s;
  int width;
  /* state every (re)started replica must get, in WELCOME */
  int64_t batch_skips[64]; /* batch keys no replica draws again (rollbacks past a bad batch), ascending */
  int nbatch_skips;
  char lr_changes[1024];  /* "STEP:LR,STEP:LR" */
  char skips[1024];       /* "STEP,STEP": updates every replica drops */
  int rollback_pending;
  int64_t rollback_step; /* its target: the checkpoints after it are dropped before the replicas restart */
  detector *det;          /* Eagle Eye: rules and policies over the replicas' metrics */
  prom_server *prom;
  struct event *tick;
  struct event *ev_chld, *ev_term, *ev_int; /* SIGCHLD, SIGTERM, SIGINT */
  int resume;             /* started by --resume, from a committed checkpoint */
  int from_scratch;       /* started by --resume, but nothing was committed: from step 0 */
  int restarted;          /* started by --resume: live workers of the previous operator may be adopted */
  int adopting;           /* the adoption window is open: nothing spawned, the coordinator held */
  double adopt_t0;
  struct event *adopt_ev;
  host_rec hosts[MAX_HOSTS];  /* agents that registered, alive or not (operator_hosts.c) */
  int nhosts;
  struct conn *conns;         /* every connection to the workers' port not yet freed (operator.c) */
  int placing;                /* cfg->hosts agents came: replicas are placed on them */
  policy *hosts_pol;          /* hosts.lua (cordon / uncordon), on pol's engine */
  int hosts_state_ref;
  double hosts_policy_at;     /* when hosts.lua last looked at the cordoned hosts */
  double hosts_tick_at;       /* when hosts_tick last ran: a larger gap is our loop stalled */
  /* aborted epochs without progress (operator.c, watch_aborts): a member
   * its peers cannot reach makes every collective abort again */
  int64_t abort_step;
  int aborts;
  double abort_t0;
  unsigned char abort_reporters[MAX_SLOTS];
  char nonce[40];             /* this operator's, random: the second line of the RUN/operator.addr it wrote
                                 ("": none written yet) */
  double addr_looked;         /* when it was last looked at (operator.c, superseded) */
  int superseded;             /* another operator took the run over: this one stands down */
  int ctl_made;               /* this operator created RUN/control.sock (operator_ctl_listen) */
  char superseded_by[300];    /* where that one listens (RUN/operator.addr), for messages */
  auth_secret secret;         /* the job's (RUN/secret): every connection to our ports proves it */
  char secret_hex[2 * AUTH_KEY_MAX + 1];
};


/* operator.c */
void operator_event(operator_state *o, int64_t step, int worker, const char *kind, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
int operator_live_count(operator_state *o);
/* Whether an operator started since has taken the run over (RUN/operator.addr
 * looked at now): it stands down (operator.c, superseded). */
int operator_superseded(operator_state *o);
/* Counts a restart of slot s (NULL: every replica restarted at once). */
void operator_count_restart(operator_state *o, slot *s);
/* operator_policy.c: the restart policy, restart.lua from the job's
 * policies folder (else lua/policies, also when that folder lacks it) on a
 * policy engine of its own, checked and dry-run. Needs o->cfg, writes its load to o->events.
 * TR_ELUA/TR_EIO with tr_error() naming restart.lua:LINE; nothing is left
 * allocated then. Hot reload: policy_watch(o->pol, base). */
int operator_policy_load(operator_state *o);
/* Reloads restart.lua now (the REPL's reload()). 0 when in force; else the
 * previous version stays and an event (policy_reload_failed) says why. */
int operator_policy_reload(operator_state *o);
void operator_policy_free(operator_state *o);
/* Asks restart.lua's fn ("on_failure" | "on_all_dead") about slot s (NULL:
 * none) failing; the decision lands in action ("replace"/"none",
 * "restart"/"stop"), delay (seconds) and detail. When the policy raises, runs
 * past its instruction budget or returns no valid decision, a
 * "policy_error" event names file:line and the operator's built-in rule
 * decides (replace with backoff within 5 restarts per slot, 20 per job). */
void operator_policy_call(operator_state *o, const char *fn, const slot *s, const char *reason, int sig, int code, char *action, size_t n,
                 double *delay, char *detail, size_t dn);
void operator_spawn(operator_state *o, int k, const char *mode);
void operator_stop_all(operator_state *o, const char *why);
/* Newest committed checkpoint at or before step on either level: the local
 * store and checkpoint.remote (read-only looks), in *found (-1: none).
 * Returns 0, or an error when a store that exists cannot be listed (a
 * damaged list of checkpoints is not an empty one). */
int operator_newest_checkpoint(operator_state *o, int64_t step, int64_t *found);
/* Kills every replica and restarts them all from the newest checkpoint at or
 * before step; with skip_step > step, no replica draws the batch of step
 * skip_step again (the steps before it keep their batches). */
void operator_rollback_all(operator_state *o, int64_t step, int64_t skip_step, const char *why);

/* operator.c: a slot's worker exited with status (a wait status: local
 * child, or what its agent reported); the restart policy decides. */
void operator_slot_exited(operator_state *o, slot *s, int status);
/* Sends sig to slot s's worker: kill() for our child, KILL to its agent. */
/* The slot has a process we started or adopted (an agent's worker counts from its SPAWN on). */
int operator_slot_has_process(const slot *s);
void operator_kill_slot(operator_state *o, slot *s, int sig);
/* Starts every slot (a fresh job or a resume). */
void operator_spawn_all(operator_state *o);

/* operator_hosts.c: agents, placement, cordons (hosts.lua). */
/* One line on an agent's connection (AGENT, STARTED, EXITED, HB); *host is
 * the connection's host (-1 before AGENT). */
void hosts_line(operator_state *o, int *host, struct bufferevent *bev, const char *line);
/* The agent's connection closed: the host is lost. */
void hosts_conn_closed(operator_state *o, int h);
/* Places slot k on a healthy host with a free slot (spares first, not the
 * host it just failed on) and asks its agent to start it; none free: the
 * slot waits (unplaced) until one is. */
void hosts_place(operator_state *o, int k, const char *mode);
/* Every tick: silent agents are lost hosts (after a stall of our own loop,
 * every agent gets a fresh lapse); hosts.lua may uncordon; the unplaced
 * slots are placed where they now fit. */
void hosts_tick(operator_state *o);
/* The end of an adoption window: slot s's worker, named by its agent
 * (AGENT live=) but never adopted itself, is killed and its host slot freed. */
void hosts_unclaim(operator_state *o, slot *s);
/* The job is over: every agent is told (END), so it exits now instead of
 * waiting operator_grace for a restarted operator. */
void hosts_end(operator_state *o);
/* A worker on host h failed (counted for hosts.lua). */
void hosts_failure(operator_state *o, int h, const char *reason);
/* hosts.lua on the restart policy's engine; TR_ELUA naming file:line. */
int hosts_policy_load(operator_state *o);
/* By hand (attach's cordon/uncordon): cordons (on = 1) or uncordons every
 * host whose name or address is `name` (agents may share an address). A
 * hand cordon stays until uncordoned by hand: hosts.lua cannot lift it.
 * Returns how many hosts matched, or -1 when none did. */
int hosts_cordon(operator_state *o, const char *name, int on, const char *why);

/* operator_repl.c: the control socket RUN/control.sock */
struct evconnlistener *operator_ctl_listen(operator_state *o);
/* Closes the control socket and every client still attached (at exit). */
void operator_ctl_close(operator_state *o);

#endif
