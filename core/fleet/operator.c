/* operator.c — `transom run` with replicas > 1: the operator (after
 * TRANSOM's TOL and FT-HSDP). It hosts the FTAR coordinator on its libevent
 * loop, spawns one `transom worker` per replica slot, supervises them, and
 * keeps the job training through failures:
 *
 *   - a replica that exits, crashes or is killed: the survivors go on (FTAR
 *     drops it and redoes the step among them); the restart policy
 *     (operator_policy.c: restart.lua in the job's policies folder, else
 *     lua/policies, on the policy engine: sandboxed, budgeted, hot-reloaded)
 *     decides on a replacement, which catches up from a healthy donor and
 *     joins at a step boundary;
 *   - every replica gone: all restart from the newest committed checkpoint;
 *   - on_failure = "restart_all": the torchrun baseline (stop everything,
 *     reload the last checkpoint), for comparison;
 *   - SIGTERM/SIGINT: every replica finishes the same step, the leader
 *     checkpoints it and saves its weights, exit 0; `--resume` carries on;
 *   - the operator itself killed: its workers wait operator_grace seconds;
 *     `--resume` started again adopts them (HELLO live=1: they keep their
 *     state and step, no checkpoint reload) during an adoption window in
 *     which its new coordinator holds epochs until they re-registered, and
 *     starts only the slots with no live worker (join, else resume);
 *     RUN/operator.addr says where this operator listens; an operator
 *     that finds it written by another (it was stopped or hung while a
 *     --resume took over) stands down (superseded);
 *   - chaos: the job's fault list, and `transom chaos RUN FAULT SLOT` over
 *     RUN/control.sock.
 *
 * Logs: metrics.jsonl (one line per replica per step), events.jsonl (every
 * failure, decision and membership change), worker-K.log (each replica's
 * stderr). Single-threaded: everything runs on the event loop.
 */
#define _GNU_SOURCE /* struct ucred, SO_PEERCRED */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <fcntl.h>
#include <lauxlib.h>
#include <limits.h>
#include <math.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ckpt.h"
#include "ftar.h"
#include "job.h"
#include "lua_host.h"
#include "operator.h"
#include "policy.h"
#include "proto.h"
#include "trainer.h"
#include "util.h"

#include "operator_internal.h"

const char *slot_names[] = {"empty", "starting", "running", "done", "dead", "waiting"};

/* --- logs --- */

void operator_event(operator_state *o, int64_t step, int worker, const char *kind, const char *fmt, ...) {
  char detail[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  tr_event_line(o->events, step, worker, kind, detail);
  if (strcmp(kind, "checkpoint") != 0 && strcmp(kind, "membership") != 0)
    printf("[operator] %s: %s (step %lld)\n", kind, detail, (long long)step);
  fflush(stdout);
}

void operator_count_restart(operator_state *o, slot *s) {
  double now = tr_now() - o->t0;
  if (s) s->restart_at[s->restarts++ % RESTART_TIMES] = now;
  o->restart_at[o->restarts_total++ % RESTART_TIMES_JOB] = now;
}

int operator_live_count(operator_state *o) {
  int n = 0;
  for (int i = 0; i < o->nslots; i++) n += o->slots[i].state == SLOT_STARTING || o->slots[i].state == SLOT_RUNNING;
  return n;
}

/* --- superseded: an operator started since this one --- */

#define SUPERSEDE_LOOK_S 0.1 /* RUN/operator.addr is looked at no more often than this */

/* Whether an operator started since this one has taken the run over:
 * RUN/operator.addr exists and names another operator (its second line,
 * the nonce, is not ours: a newer operator's address, or "ended" by one
 * that has ended since). That happens when this one was stopped or hung (a
 * `--resume` takes over an operator that does not answer on
 * RUN/control.sock): the new one adopted our workers (they follow the
 * file) or started their slots. So this one stands down the moment it
 * runs again: a "superseded" event, and the loop ends with nothing
 * spawned, stopped or checkpointed, no metrics line written and no
 * failure handled. Every callback that would act on the job asks first
 * (the tick, worker lines and hang-ups, child exits, membership changes,
 * signals, spawns): after a stop, whichever runs first finds it. A file
 * that is missing (a tmp cleaner, a scratch purge, a user removed it) or
 * cannot be read says nothing: a healthy sole operator never stands down
 * for it. */
static int superseded(operator_state *o) {
  if (o->superseded) return 1;
  double now = tr_now();
  if (!o->nonce[0] || now - o->addr_looked < SUPERSEDE_LOOK_S) return 0;
  o->addr_looked = now;
  char by[300], nonce[64];
  if (opaddr_read_nonce(o->dir, by, sizeof by, nonce, sizeof nonce) != 0 || strcmp(nonce, o->nonce) == 0) return 0;
  o->superseded = 1;
  snprintf(o->superseded_by, sizeof o->superseded_by, "%s", strcmp(by, "ended") != 0 ? by : "(it has ended)");
  if (strcmp(by, "ended") != 0)
    operator_event(o, o->best_step, -1, "superseded", "superseded by the operator at %s (RUN/operator.addr): this "
                   "one exits, starting, stopping and checkpointing nothing", by);
  else
    operator_event(o, o->best_step, -1, "superseded", "superseded: an operator started since took the run over and "
                   "has ended (RUN/operator.addr): this one exits, starting, stopping and checkpointing nothing");
  event_base_loopbreak(o->base);
  return 1;
}

/* superseded, with the file looked at now whatever the cache says: for
 * the callbacks that would take a worker leaving us for the new operator
 * for a failure (a hang-up, a child exit, a membership change, an evict,
 * a spawn), where the 0.1 s window is enough to act on a stale answer. */
static int superseded_now(operator_state *o) {
  o->addr_looked = -1e9;
  return superseded(o);
}

int operator_superseded(operator_state *o) { return superseded_now(o); }

/* A fresh nonce for this operator's RUN/operator.addr. */
static void make_nonce(operator_state *o) {
  unsigned char b[12];
  if (getrandom(b, sizeof b, GRND_NONBLOCK) != (ssize_t)sizeof b) { /* unlikely: pid and time then */
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ ((uint64_t)getpid() << 20);
    for (size_t i = 0; i < sizeof b; i++) b[i] = (unsigned char)(x >> (8 * (i % 8))) ^ (unsigned char)i;
  }
  for (size_t i = 0; i < sizeof b; i++) snprintf(o->nonce + 2 * i, 3, "%02x", b[i]);
}

/* --- spawning --- */

void operator_spawn(operator_state *o, int k, const char *mode) {
  slot *s = &o->slots[k];
  if (superseded_now(o)) return; /* the operator that replaced us starts the slots */
  s->ours = 1;
  if (o->cfg->hosts > 0) { /* the agents start them */
    hosts_place(o, k, mode);
    return;
  }
  char log[PATH_MAX], addr[64], slotstr[16], threads[16];
  snprintf(log, sizeof log, "%s/worker-%d.log", o->dir, k);
  snprintf(addr, sizeof addr, "127.0.0.1:%d", o->port);
  snprintf(slotstr, sizeof slotstr, "%d", k);
  snprintf(threads, sizeof threads, "%d", o->threads);
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    signal(SIGINT, SIG_IGN); /* Ctrl-C goes to the operator, which stops the workers in order */
    setenv("TRANSOM_LOCAL_RANK", slotstr, 1); /* a GPU each: device slot % visible devices (backend.h) */
    setenv("TRANSOM_SECRET", o->secret_hex, 1);
    execl(o->self, "transom", "worker", "--operator", addr, "--slot", slotstr, "--threads", threads, (char *)NULL);
    _exit(127); /* ok-exit: exec failed in the child */
  }
  if (pid < 0) {
    operator_event(o, o->best_step, k, "spawn_failed", "fork: %s", strerror(errno));
    s->state = SLOT_DEAD;
    return;
  }
  s->pid = pid;
  s->host = -1;
  s->adopted = 0;
  s->agent[0] = 0;
  s->state = SLOT_STARTING;
  s->started = tr_now();
  s->done = 0;
  snprintf(s->mode, sizeof s->mode, "%s", mode);
  operator_event(o, o->best_step, k, "spawn", "replica %d started (pid %d, %s)", k, (int)pid, mode);
}

int operator_slot_has_process(const slot *s) {
  return s->pid > 0 || (s->host >= 0 && (s->state == SLOT_STARTING || s->state == SLOT_RUNNING));
}

void operator_kill_slot(operator_state *o, slot *s, int sig) {
  if (s->host >= 0) { /* by SPAWN generation: the agent's STARTED (the pid) may not have reached us yet */
    host_rec *h = &o->hosts[s->host];
    if (h->bev && operator_slot_has_process(s))
      evbuffer_add_printf(bufferevent_get_output(h->bev), "KILL slot=%d gen=%u sig=%d\n", s->slot, s->gen, sig);
  } else if (s->pid > 0) {
    kill(s->pid, sig);
  }
}

/* A running replica to catch up from: the one furthest ahead. */
static const slot *pick_donor(operator_state *o, int except) {
  const slot *best = NULL;
  for (int i = 0; i < o->nslots; i++) {
    const slot *s = &o->slots[i];
    if (i == except || s->state != SLOT_RUNNING || !s->donor[0]) continue;
    if (!best || s->step > best->step) best = s;
  }
  return best;
}

static void replace_cb(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  slot *s = arg;
  operator_state *o = s->o;
  if (o->stopping || o->finished || s->state != SLOT_WAITING) return;
  if (o->adopting) { /* a worker of the previous operator may still claim the slot: after the window */
    struct timeval tv = {0, 200000};
    evtimer_add(s->timer, &tv);
    return;
  }
  operator_count_restart(o, s);
  operator_spawn(o, s->slot, pick_donor(o, s->slot) ? "join" : "resume");
}

static void schedule(operator_state *o, slot *s, double delay) {
  if (!s->timer) s->timer = evtimer_new(o->base, replace_cb, s);
  struct timeval tv = {(time_t)delay, (suseconds_t)((delay - (time_t)delay) * 1e6)};
  s->state = SLOT_WAITING;
  evtimer_add(s->timer, &tv);
}

static void restart_everything(operator_state *o, double delay) {
  for (int i = 0; i < o->nslots; i++) schedule(o, &o->slots[i], delay);
}

/* --- failures --- */

/* Did a replica finish every step? */
static int any_done(const operator_state *o) {
  for (int i = 0; i < o->nslots; i++)
    if (o->slots[i].state == SLOT_DONE) return 1;
  return 0;
}

/* The job is over once no replica runs or starts, and none waits for a
 * replacement, unless one already finished every step: a replacement due
 * after the survivors finished would only resume at the last step (and wait
 * for peers that are gone), so its timer is cancelled. */
static void check_finished(operator_state *o) {
  /* while a resumed operator adopts, a replica that finished (its DONE held
   * for the new operator) is no reason to stop: the others may still be on
   * their way back; adopt_tick decides when the window closes */
  if (o->adopting && !o->stopping) return;
  int done = 0;
  for (int i = 0; i < o->nslots; i++) {
    slot_state st = o->slots[i].state;
    if (st == SLOT_STARTING || st == SLOT_RUNNING) return;
    done |= st == SLOT_DONE;
  }
  for (int i = 0; i < o->nslots; i++) {
    slot *s = &o->slots[i];
    if (s->state != SLOT_WAITING) continue;
    if (!done && !(s->unplaced && o->stopping)) return; /* (unplaced: no host came in time) */
    if (s->timer) evtimer_del(s->timer);
    s->state = SLOT_DEAD;
    if (done)
      operator_event(o, o->best_step, s->slot, "replacement_cancelled",
                     "replica %d not replaced: the others finished step %lld", s->slot, (long long)o->best_step);
  }
  o->finished = 1;
  event_base_loopexit(o->base, NULL);
}

static void slot_conn_close(operator_state *o, slot *s);
static void rollback_restart(operator_state *o);
static void rollback_drop(operator_state *o);

void operator_slot_exited(operator_state *o, slot *s, int status) {
  int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0, code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (s->bev) slot_conn_close(o, s);
  s->pid = 0;
  s->donor[0] = 0;
  if (o->det) detector_worker_gone(o->det, s->slot);
  int on_host = s->host; /* its agent's slot is free again */
  if (s->host >= 0) {
    o->hosts[s->host].used--;
    s->last_host = s->host;
    s->host = -1;
  }
  if (s->done && code == 0) {
    s->state = SLOT_DONE;
    check_finished(o);
    return;
  }
  s->state = SLOT_DEAD;
  /* exit status 2: a start-up error that repeats on every try (worker.c) */
  const char *reason = s->lost ? s->lost : sig ? "killed" : code == 3 ? "evicted" : code == 2 ? "startup_error" : "exited";
  int counted = s->lost != NULL; /* a lost host counted its failure once, not per replica */
  s->lost = NULL;
  if (on_host >= 0 && !o->stopping && !counted) hosts_failure(o, on_host, reason);
  if (o->stopping) {
    if (o->rollback_pending && operator_live_count(o) == 0) { /* stopped mid-rollback: its target still holds */
      o->rollback_pending = 0;
      rollback_drop(o);
    }
    check_finished(o);
    return;
  }
  if (o->rollback_pending) { /* every replica was stopped on purpose */
    if (operator_live_count(o) == 0) rollback_restart(o);
    return;
  }
  operator_event(o, s->step, s->slot, "replica_failed", "replica %d %s (%s %d) at step %lld; %d live", s->slot, reason,
            sig ? "signal" : "exit code", sig ? sig : code, (long long)s->step, operator_live_count(o));
  if (any_done(o)) { /* the others finished every step: nothing is left to train, nothing to restart */
    operator_event(o, o->best_step, s->slot, "replacement_cancelled",
                   "replica %d not replaced: the others finished step %lld", s->slot, (long long)o->best_step);
    check_finished(o);
    return;
  }
  if (strcmp(o->cfg->on_failure, "restart_all") == 0) {
    /* the torchrun way: everything stops and reloads the last checkpoint */
    if (!o->restart_all_pending) {
      o->restart_all_pending = 1;
      operator_count_restart(o, NULL);
      operator_event(o, s->step, -1, "restart_all", "stopping every replica to restart from the newest checkpoint");
      for (int i = 0; i < o->nslots; i++)
        if (operator_slot_has_process(&o->slots[i])) operator_kill_slot(o, &o->slots[i], SIGKILL);
    }
    if (operator_live_count(o) == 0) {
      o->restart_all_pending = 0;
      for (int i = 0; i < o->nslots; i++) o->slots[i].state = SLOT_DEAD;
      restart_everything(o, 0.0);
    }
    return;
  }
  char action[32], detail[256];
  double delay;
  if (operator_live_count(o) == 0) {
    operator_policy_call(o, "on_all_dead", s, reason, sig, code, action, sizeof action, &delay, detail, sizeof detail);
    operator_event(o, s->step, -1, "all_replicas_dead", "policy: %s%s%s", action, detail[0] ? ": " : "", detail);
    if (strcmp(action, "restart") == 0) {
      operator_count_restart(o, NULL);
      restart_everything(o, delay);
    } else {
      o->exit_code = 1;
      check_finished(o);
    }
    return;
  }
  operator_policy_call(o, "on_failure", s, reason, sig, code, action, sizeof action, &delay, detail, sizeof detail);
  operator_event(o, s->step, s->slot, "policy", "on_failure -> %s%s%s (delay %.2f s)", action, detail[0] ? ": " : "",
            detail, delay);
  if (strcmp(action, "replace") == 0) schedule(o, s, delay);
  else check_finished(o);
}

int operator_newest_checkpoint(operator_state *o, int64_t step, int64_t *found) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/ckpt", o->dir);
  const char *remote = o->cfg->ckpt_remote;
  char mdb[PATH_MAX + 16];
  *found = -1;
  snprintf(mdb, sizeof mdb, "%s/data.mdb", path);
  int local = access(mdb, F_OK) == 0;
  ckpt_reader *r = local ? ckpt_reader_open(path) : NULL; /* the local level, and the remote one beside it */
  if (local && !r) return tr_fail_prefix(TR_EIO, "the checkpoint store %s", path); /* there, but unreadable */
  if (r && remote[0] && ckpt_reader_set_remote(r, remote)) {
    ckpt_reader_close(r);
    r = NULL;
  }
  if (!r && remote[0]) r = ckpt_reader_open(remote); /* no local store (lost, moved aside): the remote alone */
  if (!r) return TR_OK; /* no store at all */
  int64_t steps[4096];
  int n = ckpt_reader_steps(r, steps, 4096);
  for (int i = 0; i < n; i++)
    if (steps[i] <= step && steps[i] > *found) *found = steps[i];
  ckpt_reader_close(r);
  return n < 0 ? tr_fail_prefix(n, "the checkpoints in %s", path) : TR_OK;
}

/* --- Eagle Eye: the detector's events and actions --- */

static void det_event(void *ud, const detector_event *e) {
  operator_state *o = ud;
  char buf[4096];
  int n = detector_event_json(e, buf, sizeof buf);
  if (n > 0 && n < (int)sizeof buf) {
    fprintf(o->events, "%s\n", buf);
    fflush(o->events);
  }
  if (e->type == DET_EV_ANOMALY || e->type == DET_EV_RELOAD_FAILED || e->type == DET_EV_RULE_ERROR) {
    printf("[detector] %s%s%s: %s (worker %d, step %lld)\n", e->kind, e->anomaly ? " " : "",
           e->anomaly ? e->anomaly : "", e->detail ? e->detail : "", e->worker, (long long)e->step);
    fflush(stdout);
  }
}

static void det_action(void *ud, const detector_action *a) {
  operator_state *o = ud;
  const char *why = a->cause ? a->cause->kind : "detector";
  switch (a->action) {
    case DET_ACT_EVICT:
      if (superseded_now(o)) break; /* the worker is the new operator's */
      if (a->worker >= 0 && a->worker < o->nslots && operator_slot_has_process(&o->slots[a->worker])) {
        operator_event(o, o->best_step, a->worker, "evict", "replica %d evicted: %s", a->worker, why);
        operator_kill_slot(o, &o->slots[a->worker], SIGKILL); /* also ends a stopped (SIGSTOP) process */
      }
      break;
    case DET_ACT_ROLLBACK: {
      int64_t target;
      if (operator_newest_checkpoint(o, a->step, &target)) {
        operator_event(o, o->best_step, -1, "rollback_refused", "%s: %s", why, tr_error());
        break;
      }
      if (target < 0) {
        operator_event(o, o->best_step, -1, "rollback_refused", "%s: no checkpoint at or before step %lld", why,
                  (long long)a->step);
        break;
      }
      /* the anomaly's batch, if it came after the checkpoint; else the one after the rollback's step */
      int64_t bad = a->cause && a->cause->step > target ? a->cause->step : a->step + 1;
      operator_rollback_all(o, target, bad, why);
      break;
    }
    case DET_ACT_SKIP_UPDATE: {
      /* the update of a->step, if it is far enough ahead for every replica
       * to get the word in time; else (the default: the anomaly's own
       * update, already applied) the next one they can all agree on */
      int64_t at = o->best_step + 3; /* SKIP at=N drops the update that makes step N + 1 */
      if (a->step - 1 > at) at = a->step - 1;
      size_t k = strlen(o->skips);
      if (k + 24 < sizeof o->skips) snprintf(o->skips + k, sizeof o->skips - k, "%s%lld", k ? "," : "", (long long)at);
      for (int i = 0; i < o->nslots; i++)
        if (o->slots[i].bev) evbuffer_add_printf(bufferevent_get_output(o->slots[i].bev), "SKIP at=%lld\n", (long long)at);
      operator_event(o, o->best_step, a->worker, "skip_update", "%s: every replica drops the update of step %lld", why,
                (long long)at + 1);
      break;
    }
    case DET_ACT_CHECKPOINT_NOW:
      for (int i = 0; i < o->nslots; i++)
        if (o->slots[i].bev) evbuffer_add_printf(bufferevent_get_output(o->slots[i].bev), "CKPT_NOW\n");
      break;
    default: /* alert: the event is the alert */
      break;
  }
}

/* A hung training thread stalls every replica (they wait for it in the
 * all-reduce) while its heartbeat lives, so no per-replica "no progress"
 * rule can tell which one it is. The heartbeats can: the culprit is the one
 * still computing after hang_seconds while the others have waited in the
 * all-reduce past the deadline. Only what a heartbeat said counts (its
 * `for`, as of when it came): a stopped process sends none, so its time
 * stops growing and it can never pass for hung (it is dead). */
static void find_hung(operator_state *o) {
  int waiting = 0;
  for (int i = 0; i < o->nslots; i++) {
    slot *s = &o->slots[i];
    waiting += s->state == SLOT_RUNNING && s->in_allreduce && s->phase_for > o->cfg->deadline;
  }
  if (!waiting) return;
  for (int i = 0; i < o->nslots; i++) {
    slot *s = &o->slots[i];
    double busy = s->phase_for;
    if (s->state != SLOT_RUNNING || s->in_allreduce || !operator_slot_has_process(s) || busy < o->cfg->hang_seconds)
      continue;
    operator_event(o, s->step, i, "anomaly",
              "hang: replica %d has computed step %lld for %.1f s while %d replica(s) wait for it in the all-reduce",
              i, (long long)s->step + 1, busy, waiting);
    if (superseded_now(o)) return; /* the workers are the new operator's */
    operator_event(o, s->step, i, "evict", "replica %d evicted: hang", i);
    operator_kill_slot(o, s, SIGKILL);
    s->in_allreduce = 1; /* once */
  }
}

static void auth_refused_flush(operator_state *o, double now);

static void tick_cb(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  operator_state *o = arg;
  if (superseded(o)) return;
  if (o->cfg->hosts > 0) hosts_tick(o);
  auth_refused_flush(o, tr_now());
  if (o->stopping) return;
  if (o->det) detector_tick(o->det, tr_now());
  find_hung(o);
}

static void prom_extra_cb(void *ud, prom_extra *x) { x->restarts_total = ((operator_state *)ud)->restarts_total; }

static int start_detector(operator_state *o) {
  detector_opts d = {0};
  d.policy_dir = o->cfg->policies[0] ? o->cfg->policies : NULL;
  d.max_workers = o->nslots;
  d.on_event = det_event;
  d.on_action = det_action;
  d.ud = o;
  o->det = detector_create(&d);
  if (!o->det) return tr_fail_prefix(TR_ELUA, "detector");
  if (detector_watch(o->det, o->base))
    operator_event(o, 0, -1, "watch_failed", "policies are not watched (reload() from attach still works): %s", tr_error());
  int rc = prom_serve(o->base, "127.0.0.1", (int)o->cfg->metrics_port, o->det, prom_extra_cb, o, &o->prom);
  if (rc) return tr_fail_prefix(rc, "metrics_port %lld", (long long)o->cfg->metrics_port);
  return TR_OK;
}

/* Every replica of a rollback has stopped: the checkpoints after its
 * target belong to the timeline it abandons (a later resume, or the next
 * rollback, would load them: the state the rollback threw away), so they
 * are dropped, in both levels, before the replicas restart at the target.
 * None of the replicas writes now. */
static void rollback_drop(operator_state *o) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/ckpt", o->dir);
  int64_t first = -1;
  ckpt_level failed;
  int n = ckpt_store_drop_after(path, o->cfg->ckpt_remote, o->rollback_step, &first, &failed);
  if (n < 0 && failed == CKPT_LEVEL_REMOTE) /* the local store's went first */
    operator_event(o, o->best_step, -1, "rollback_drop_failed",
                   "dropping the checkpoints after step %lld failed in the remote level (checkpoint.remote): they "
                   "stay there (a later resume may load them); the local store's were dropped: %s",
                   (long long)o->rollback_step, tr_error());
  else if (n < 0) /* nothing was dropped */
    operator_event(o, o->best_step, -1, "rollback_drop_failed",
                   "dropping the checkpoints after step %lld failed in the local store: they stay%s (a later "
                   "resume may load them): %s",
                   (long long)o->rollback_step,
                   o->cfg->ckpt_remote[0] ? " in both levels (the remote was not tried)" : "", tr_error());
  else if (n > 0)
    operator_event(o, o->best_step, -1, "checkpoints_dropped",
                   "%d checkpoint(s) after step %lld dropped (from step %lld): the rollback abandoned them", n,
                   (long long)o->rollback_step, (long long)first);
}

static void rollback_restart(operator_state *o) {
  o->rollback_pending = 0;
  rollback_drop(o);
  for (int i = 0; i < o->nslots; i++) operator_spawn(o, i, "resume");
}

/* Every replica reloads the newest checkpoint at or before step; with
 * skip_step > step, the batch that step skip_step drew is never drawn again
 * (the steps before it keep theirs, the ones from it on draw the next). */
void operator_rollback_all(operator_state *o, int64_t step, int64_t skip_step, const char *why) {
  if (o->stopping || o->rollback_pending) return;
  o->rollback_pending = 1;
  o->rollback_step = step;
  if (o->det) detector_rewind(o->det, step); /* its steps come again: so may their anomalies (a REPL rollback too) */
  for (int i = 0; i < o->nslots; i++) o->slots[i].resume_step = step;
  char skipped[96] = "";
  if (skip_step > step) {
    int64_t key = batch_key(skip_step - 1, o->batch_skips, o->nbatch_skips);
    int n = o->nbatch_skips, at = n;
    while (at > 0 && o->batch_skips[at - 1] > key) at--;
    if (n < (int)(sizeof o->batch_skips / sizeof o->batch_skips[0])) {
      memmove(o->batch_skips + at + 1, o->batch_skips + at, sizeof(int64_t) * (size_t)(n - at));
      o->batch_skips[at] = key;
      o->nbatch_skips++;
      snprintf(skipped, sizeof skipped, " and skips the batch of step %lld", (long long)skip_step);
    } else {
      snprintf(skipped, sizeof skipped, " (no more batches can be skipped: the batch of step %lld stays)",
               (long long)skip_step);
    }
  }
  operator_event(o, o->best_step, -1, "rollback",
            "%s: every replica reloads the newest checkpoint at or before step %lld%s", why, (long long)step, skipped);
  for (int i = 0; i < o->nslots; i++) {
    slot *s = &o->slots[i];
    if (s->timer) evtimer_del(s->timer);
    if (operator_slot_has_process(s)) operator_kill_slot(o, s, SIGKILL);
    else if (s->state == SLOT_WAITING) s->state = SLOT_DEAD;
  }
  if (operator_live_count(o) == 0) rollback_restart(o);
}

static void sigchld_cb(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  operator_state *o = arg;
  if (superseded_now(o)) return; /* our children are the new operator's workers now */
  int status;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0)
    for (int i = 0; i < o->nslots; i++)
      if (o->slots[i].pid == pid && o->slots[i].host < 0) operator_slot_exited(o, &o->slots[i], status);
}

static void kill_stragglers(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  operator_state *o = arg;
  for (int i = 0; i < o->nslots; i++) {
    slot *s = &o->slots[i];
    if (operator_slot_has_process(s)) operator_kill_slot(o, s, SIGKILL);
    if (s->host >= 0 && (s->state == SLOT_STARTING || s->state == SLOT_RUNNING)) {
      /* its agent may be unreachable: the stop does not wait for its word */
      operator_event(o, s->step, i, "stop_timeout", "replica %d on host %s did not stop in time; given up", i,
                     o->hosts[s->host].name);
      s->state = SLOT_DEAD;
      s->pid = 0;
    }
  }
  check_finished(o);
}

/* Who checkpoints a step called off below min_replicas: the lowest running
 * member of the group's latest epoch that has trained a step since it was
 * ready (a joiner that has not may stop a step behind), else the lowest
 * running member; -1: none. */
static int pick_stop_lead(const operator_state *o) {
  int any = -1;
  for (int i = 0; i < o->nslots; i++) {
    const slot *s = &o->slots[i];
    if (s->state != SLOT_RUNNING || !s->in_ring) continue;
    if (s->stepped) return i;
    if (any < 0) any = i;
  }
  return any;
}

/* The STOP every replica gets (now, or as it becomes ready). */
static void send_stop(const operator_state *o, struct bufferevent *bev) {
  evbuffer_add_printf(bufferevent_get_output(bev), "STOP at=%lld lead=%d\n", (long long)o->stop_at, o->stop_lead);
}

void operator_stop_all(operator_state *o, const char *why) {
  if (o->stopping) return;
  o->stopping = 1;
  o->stop_at = o->best_step + 1;
  o->stop_lead = pick_stop_lead(o);
  int ring_n = 0;
  for (int i = 0; i < o->nslots; i++) ring_n += o->slots[i].in_ring;
  if (o->cfg->min_replicas > 1 && ring_n < (int)o->cfg->min_replicas) { /* its pending step never finishes */
    char who[64];
    if (o->stop_lead >= 0) snprintf(who, sizeof who, "replica %d checkpoints it", o->stop_lead);
    else snprintf(who, sizeof who, "no replica of the group is running to checkpoint it");
    operator_event(o, o->best_step, -1, "stopping",
                   "%s: the replicas wait below min_replicas: they call their pending step off and stop at the "
                   "last one they finished, %s",
                   why, who);
  } else
    operator_event(o, o->best_step, -1, "stopping", "%s: every replica finishes step %lld, the leader checkpoints it",
                   why, (long long)o->stop_at);
  for (int i = 0; i < o->nslots; i++) {
    slot *s = &o->slots[i];
    if (s->timer) evtimer_del(s->timer);
    if (s->state == SLOT_WAITING) s->state = SLOT_DEAD;
    if (s->state == SLOT_STARTING && strcmp(s->mode, "join") == 0 && operator_slot_has_process(s)) {
      /* still catching up: it holds nothing of its own, and it would come
       * into a group that stops (below min_replicas: a step behind it) */
      operator_event(o, s->step, i, "replacement_cancelled", "replica %d was catching up: stopped with the job", i);
      operator_kill_slot(o, s, SIGKILL);
    }
    if (s->bev) send_stop(o, s->bev);
  }
  struct timeval tv = {60, 0};
  event_base_once(o->base, -1, EV_TIMEOUT, kill_stragglers, o, &tv);
  check_finished(o);
}

static void sigterm_cb(evutil_socket_t fd, short what, void *arg) {
  (void)what;
  if (superseded(arg)) return; /* the workers are the new operator's: no stop, no checkpoint */
  operator_stop_all(arg, fd == SIGINT ? "SIGINT" : "SIGTERM");
}

/* --- worker connections --- */

/* Sends the slot's chaos entries not yet fired. An entry counts as fired
 * when the worker says it injected it (FIRED), so one sent to a process that
 * died first (a rollback, another fault) goes to the next one. */
static void send_chaos(operator_state *o, slot *s) {
  for (int i = 0; o->cfg->nchaos > 0 && i < o->cfg->nchaos; i++) {
    const job_chaos *c = &o->cfg->chaos[i];
    if (o->chaos_fired[i] || c->replica != s->slot || c->at_step <= s->step) continue;
    evbuffer_add_printf(bufferevent_get_output(s->bev), "CHAOS at=%lld fault=%s ms=%lld steps=%lld\n",
                        (long long)c->at_step, c->fault, (long long)c->ms, (long long)c->steps);
  }
}

/* The detector's view of a step: the same fields (its metrics extend the
 * step record's). */
static void observe_step(operator_state *o, const step_record *r) {
  detector_sample ds = {0};
#define D_NUM(ID, name, help, prom, phase) ds.name = r->name;
  STEP_METRICS(D_NUM)
#undef D_NUM
  ds.checksum = r->checksum;
  ds.has_checksum = r->has_checksum;
  ds.time = tr_now();
  detector_observe(o->det, (int)r->worker, r->step, &ds);
  detector_heartbeat(o->det, (int)r->worker, ds.time);
}

/* A worker's STEP line: metrics.jsonl, the detector, the fleet's log line
 * once every replica reported the step. */
static void on_step(operator_state *o, slot *s, const char *line) {
  step_record r;
  char sv[32];
  int ok = proto_get(line, "step", sv, sizeof sv);
  if (ok) {
    step_record_parse(line, &r);
    ok = r.step >= 0; /* a negative step would index before the step ring */
  }
  if (!ok) {
    operator_event(o, o->best_step, s->slot, "bad_line", "replica %d sent a STEP line without a step >= 0; ignored",
                   s->slot);
    return;
  }
  r.worker = s->slot; /* the connection says who it is */
  if (s->adopted && r.step <= s->logged) return; /* replayed, and the previous operator logged it */
  if (s->adopted && r.step <= s->replayed_to) { /* replayed: for the record only (the detector's history, the
                                                 * console's lines went with the previous operator) */
    step_record_json(o->metrics, &r);
    fflush(o->metrics);
    return;
  }
  s->step = r.step;
  s->stepped = 1;
  s->last = r;
  if (r.step > o->best_step) o->best_step = r.step;
  step_record_json(o->metrics, &r);
  if (o->det) observe_step(o, &r);
  step_acc *a = &o->acc[r.step % STEP_RING];
  if (a->step != r.step) memset(a, 0, sizeof *a), a->step = r.step;
  a->count++;
  a->loss += r.loss;
  a->ms = r.step_s * 1e3 > a->ms ? r.step_s * 1e3 : a->ms;
  a->tok_s += r.tokens_per_s;
  a->expect = (int)(r.replicas > 0 ? r.replicas : 1);
  if (a->count == a->expect && o->det) detector_tick(o->det, tr_now()); /* every replica has reported the step */
  if (a->count == a->expect && (r.step % o->cfg->log_interval == 0 || r.step == o->cfg->max_steps)) {
    printf("step %*lld/%lld | loss %.4f | replicas %d | %.1f ms | %.0f tok/s\n", o->width, (long long)r.step,
           (long long)o->cfg->max_steps, a->loss / a->count, a->count, a->ms, a->tok_s);
    fflush(stdout);
  }
  fflush(o->metrics);
}

/* The pid a HELLO live=1 names, where it is ours to kill: a worker on
 * this machine (a previous operator's child). An agent's worker (agent=)
 * is its agent's to kill; an external one on another host (host= is not
 * our host name) has a pid of another machine: 0. */
static pid_t adopted_pid(const char *line) {
  char host[256], me[256] = "";
  if (proto_get(line, "agent", host, sizeof host)) return 0;
  if (proto_get(line, "host", host, sizeof host) && (gethostname(me, sizeof me) != 0 || strcmp(host, me) != 0)) return 0;
  return (pid_t)proto_int(line, "pid", 0);
}

/* HELLO live=1: a worker of a previous operator, holding its state and
 * step. It is running from here on: no checkpoint reload, nothing started
 * for its slot. Refused when the slot already has a worker. An agent's
 * worker (agent= gen=) is that agent's once it registers again and names
 * it (operator_hosts.c, claim_live); until then the connection is its
 * life. */
static slot *adopt(operator_state *o, slot *s, struct bufferevent *bev, const char *line) {
  struct evbuffer *out = bufferevent_get_output(bev);
  char agent[sizeof s->agent] = "";
  unsigned gen = (unsigned)proto_int(line, "gen", 0);
  proto_get(line, "agent", agent, sizeof agent);
  int claimed = s->host >= 0; /* its agent came first: it must be the worker that agent named */
  if (s->state == SLOT_STARTING || s->state == SLOT_RUNNING || o->stopping || o->finished ||
      (claimed && (strcmp(agent, o->hosts[s->host].name) != 0 || gen != s->gen))) {
    evbuffer_add_printf(out, "REFUSE why=slot%%20has%%20a%%20worker\n");
    return NULL;
  }
  if (s->ours) { /* we started or adopted one since: this one was let go (its state is stale) */
    evbuffer_add_printf(out, "REFUSE why=this%%20operator%%20has%%20started%%20the%%20slot%%20anew\n");
    return NULL;
  }
  if (s->timer) evtimer_del(s->timer);
  s->bev = bev;
  if (!claimed) {
    s->pid = adopted_pid(line);
    snprintf(s->agent, sizeof s->agent, "%s", agent);
    if (agent[0]) s->gen = gen;
  }
  s->adopted = 1;
  s->ours = 1;
  s->unplaced = 0;
  s->done = 0;
  s->state = SLOT_RUNNING;
  s->step = s->replayed_to = proto_int(line, "step", 0);
  s->started = s->ready_at = tr_now();
  proto_get(line, "donor", s->donor, sizeof s->donor);
  if (strcmp(s->donor, "-") == 0) s->donor[0] = 0;
  snprintf(s->mode, sizeof s->mode, "adopt");
  if (s->step > o->best_step) o->best_step = s->step;
  char run[PATH_MAX * 3];
  proto_escape(o->dir, run, sizeof run); /* a run directory may hold a space */
  /* logged: the worker replays its STEP lines after it (metrics.jsonl has the rest) */
  evbuffer_add_printf(out, "WELCOME run=%s coord=%s:%d mode=adopt nonce=%s logged=%lld\n", run, o->adv_host,
                      ftar_coord_port(o->coord), o->nonce, (long long)s->logged);
  operator_event(o, s->step, s->slot, "adopted",
                 "replica %d adopted at step %lld (pid %d%s%s): live state, no checkpoint reload", s->slot,
                 (long long)s->step, (int)proto_int(line, "pid", 0), agent[0] ? " on host " : "", agent);
  send_chaos(o, s);
  return s;
}

/* HELLO: a worker claims its slot; WELCOME tells it the run, the
 * coordinator, how to get its state (start, resume, join a donor) and the
 * decisions every replica must share. Returns the slot, or NULL (refused). */
static slot *on_hello(operator_state *o, struct bufferevent *bev, const char *line) {
  struct evbuffer *out = bufferevent_get_output(bev);
  int k = (int)proto_int(line, "slot", -1);
  if (k < 0 || k >= o->nslots) {
    evbuffer_add_printf(out, "REFUSE why=no%%20such%%20slot\n");
    return NULL;
  }
  slot *s = &o->slots[k];
  if (s->bev && s->bev != bev) {
    evbuffer_add_printf(out, "REFUSE why=slot%%20in%%20use\n");
    return NULL;
  }
  if (proto_int(line, "live", 0)) return adopt(o, s, bev, line);
  char agent[64];
  if (proto_get(line, "agent", agent, sizeof agent) && /* an agent's worker: the one we asked that agent for */
      (s->host < 0 || strcmp(o->hosts[s->host].name, agent) != 0 || proto_int(line, "gen", -1) != (int64_t)s->gen)) {
    evbuffer_add_printf(out, "REFUSE why=not%%20started%%20by%%20this%%20operator\n");
    return NULL;
  }
  s->bev = bev;
  s->ours = 1;
  if (s->pid <= 0 && s->host < 0) { /* started by an external launcher */
    s->pid = 0;
    s->state = SLOT_STARTING;
    s->started = tr_now();
    const slot *d = pick_donor(o, k);
    snprintf(s->mode, sizeof s->mode, "%s", d ? "join" : o->best_step > 0 ? "resume" : "start");
  }
  const slot *d = strcmp(s->mode, "join") == 0 ? pick_donor(o, k) : NULL;
  if (strcmp(s->mode, "join") == 0 && !d) snprintf(s->mode, sizeof s->mode, "resume");
  char batches[64 * 21] = "";
  for (int i = 0, n = 0; i < o->nbatch_skips; i++)
    n += snprintf(batches + n, sizeof batches - (size_t)n, "%s%lld", i ? "," : "", (long long)o->batch_skips[i]);
  char run[PATH_MAX * 3];
  proto_escape(o->dir, run, sizeof run); /* a run directory may hold a space */
  evbuffer_add_printf(out, "WELCOME run=%s coord=%s:%d mode=%s donor=%s threads=%d batch_skips=%s "
                      "resume_step=%lld nonce=%s lr=%s skips=%s\n",
                      run, o->adv_host, ftar_coord_port(o->coord), s->mode, d ? d->donor : "-", o->threads,
                      batches, (long long)s->resume_step, o->nonce, o->lr_changes, o->skips);
  s->resume_step = -1; /* a rollback's target applies to the start it asked for only */
  if (d)
    operator_event(o, o->best_step, k, "replica_joining", "replica %d catches up from replica %d (at step %lld)", k,
                   d->slot, (long long)d->step);
  return s;
}

static void on_ready(operator_state *o, slot *s, struct bufferevent *bev, const char *line) {
  proto_get(line, "donor", s->donor, sizeof s->donor);
  s->step = proto_int(line, "step", 0);
  s->state = SLOT_RUNNING;
  s->stepped = 0;
  s->ready_at = tr_now();
  operator_event(o, s->step, s->slot, "replica_ready",
                 "replica %d ready at step %lld (%s, state in %.2f s, %.2f s since spawn)", s->slot,
                 (long long)s->step, s->mode, proto_num(line, "state_s", 0), s->ready_at - s->started);
  send_chaos(o, s);
  if (o->stopping) send_stop(o, bev);
}

static void on_heartbeat(operator_state *o, slot *s, const char *line) {
  char ph[16];
  proto_get(line, "phase", ph, sizeof ph);
  s->in_allreduce = strcmp(ph, "allreduce") == 0;
  s->phase_for = proto_num(line, "for", 0);
  if (o->det) detector_heartbeat(o->det, s->slot, tr_now());
}

static void on_eval(operator_state *o, const char *line) {
  int64_t step = proto_int(line, "step", 0);
  double val = proto_num(line, "val", NAN);
  fprintf(o->metrics, "{\"step\":%lld,\"val_loss\":%.9g}\n", (long long)step, val);
  fflush(o->metrics);
  printf("step %*lld/%lld | val loss %.4f\n", o->width, (long long)step, (long long)o->cfg->max_steps, val);
  fflush(stdout);
}

static void on_ckpt(operator_state *o, slot *s, const char *line) {
  int64_t step = proto_int(line, "step", 0);
  if (!proto_int(line, "ok", 0)) {
    char what[600];
    proto_get(line, "what", what, sizeof what);
    operator_event(o, step, s->slot, "checkpoint_failed", "%s", what);
    return;
  }
  if (step > o->last_ckpt) o->last_ckpt = step;
  operator_event(o, step, s->slot, "checkpoint", "committed by replica %d in %.1f ms", s->slot,
                 proto_num(line, "commit_ms", 0));
}

/* One line from a worker; *sp is the connection's slot (NULL before HELLO). */
static void handle_line(operator_state *o, slot **sp, struct bufferevent *bev, const char *line) {
  slot *s = *sp;
  if (proto_is(line, "HELLO")) {
    if (s && proto_int(line, "slot", -1) != s->slot) { /* one connection speaks for one slot */
      evbuffer_add_printf(bufferevent_get_output(bev), "REFUSE why=this%%20connection%%20is%%20slot%%20%d\n", s->slot);
      return;
    }
    slot *k = on_hello(o, bev, line);
    if (k) *sp = k;
  } else if (!s) {
    return; /* nothing else before HELLO */
  } else if (proto_is(line, "READY")) {
    on_ready(o, s, bev, line);
  } else if (proto_is(line, "STEP")) {
    on_step(o, s, line);
  } else if (proto_is(line, "FIRED")) {
    for (int i = 0; i < o->cfg->nchaos; i++)
      if (o->cfg->chaos[i].replica == s->slot && o->cfg->chaos[i].at_step == proto_int(line, "at", -1))
        o->chaos_fired[i] = 1;
  } else if (proto_is(line, "HB")) {
    on_heartbeat(o, s, line);
  } else if (proto_is(line, "EVAL")) {
    on_eval(o, line);
  } else if (proto_is(line, "CKPT")) {
    on_ckpt(o, s, line);
  } else if (proto_is(line, "DONE")) {
    char crc[16];
    proto_get(line, "crc", crc, sizeof crc);
    s->crc = (uint32_t)strtoul(crc, NULL, 16);
    s->done = 1;
    s->step = proto_int(line, "step", s->step);
  } else if (proto_is(line, "FAIL")) {
    char why[600];
    proto_get(line, "why", why, sizeof why);
    operator_event(o, s->step, s->slot, "replica_error", "%s", why);
  }
}

/* A connection to the workers' port (a worker's or an agent's), from
 * accept_cb until conn_free; every one is on o->conns, so that teardown
 * frees those still open when the loop ends (agents stay connected to the
 * end, a connection we closed may not have seen its EOF yet). */
typedef struct conn {
  operator_state *o;
  struct bufferevent *bev;
  struct conn *prev, *next; /* o->conns */
  slot *s;
  int host; /* an agent's connection: its host; else -1 */
  int authed; /* it answered our challenge with the job secret */
  uint8_t ch[AUTH_CHALLENGE];
  char peer[64];
} conn;

/* Frees a connection and its bufferevent (closing the socket), off o->conns. */
static void conn_free(conn *c) {
  if (c->prev) c->prev->next = c->next;
  else c->o->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  bufferevent_free(c->bev);
  free(c);
}

/* Refused connections are events, but a scanner or a misconfigured client
 * retrying in a loop must not flood events.jsonl: at most AUTH_EVENTS_BURST
 * of them per AUTH_EVENTS_WINDOW seconds; the others are counted and said in
 * one line when the window ends (auth_refused_flush, every tick). */
#define AUTH_EVENTS_BURST 5
#define AUTH_EVENTS_WINDOW 10.0

static void auth_refused_flush(operator_state *o, double now) {
  if (now - o->auth_ev_window < AUTH_EVENTS_WINDOW) return;
  if (o->auth_ev_dropped > 0)
    operator_event(o, o->best_step, -1, "auth_refused",
                   "%d more connection(s) refused in %.0f s, not logged one by one (at most %d per %.0f s)",
                   o->auth_ev_dropped, now - o->auth_ev_window, AUTH_EVENTS_BURST, AUTH_EVENTS_WINDOW);
  o->auth_ev_window = now;
  o->auth_ev_n = o->auth_ev_dropped = 0;
}

static void auth_refused(operator_state *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void auth_refused(operator_state *o, const char *fmt, ...) {
  auth_refused_flush(o, tr_now());
  if (o->auth_ev_n >= AUTH_EVENTS_BURST) {
    o->auth_ev_dropped++;
    return;
  }
  o->auth_ev_n++;
  char detail[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  operator_event(o, o->best_step, -1, "auth_refused", "%s", detail);
}

/* An honest client answers the challenge at once (auth_client is the first
 * thing a worker or agent does); a connection that has not within this many
 * seconds is closed, so that silent connections cannot pile up and hold the
 * operator's descriptors. */
static double auth_answer_s(const operator_state *o) { return fmax(5.0, 2.0 * o->cfg->deadline); }

/* The first AUTH_MAC bytes of a connection: the answer to our challenge.
 * Returns 1 when it proved the secret (its answer timeout cleared), 0 while
 * it is incomplete, -1 when wrong (an auth_refused event; the caller closes). */
static int conn_auth(conn *c, struct bufferevent *bev, struct evbuffer *in) {
  if (c->authed) return 1;
  if (evbuffer_get_length(in) < AUTH_MAC) return 0;
  uint8_t mac[AUTH_MAC];
  evbuffer_remove(in, mac, sizeof mac);
  if (auth_verify(&c->o->secret, c->ch, mac)) {
    bufferevent_set_timeouts(bev, NULL, NULL); /* a replica may be quiet for long */
    return c->authed = 1;
  }
  auth_refused(c->o, "a connection from %s to the workers' port did not prove the job secret; closed", c->peer);
  return -1;
}

static void conn_gone(conn *c, struct bufferevent *bev);

static void conn_read(struct bufferevent *bev, void *arg) {
  conn *c = arg;
  if (superseded(c->o)) return; /* lines the new operator gets too (a replay): no metrics written twice */
  struct evbuffer *in = bufferevent_get_input(bev);
  char *line;
  size_t n;
  int ok = conn_auth(c, bev, in);
  if (ok <= 0) {
    if (ok < 0) conn_free(c);
    return;
  }
  while ((line = evbuffer_readln(in, &n, EVBUFFER_EOL_LF))) {
    if (!c->s && (c->host >= 0 || proto_is(line, "AGENT"))) hosts_line(c->o, &c->host, bev, line);
    else if (!c->s || c->s->bev == bev) handle_line(c->o, &c->s, bev, line);
    /* else: a connection its slot no longer has (an agent-hosted worker's,
     * after the agent reported its exit): its late lines would land on the
     * slot's next worker */
    free(line);
  }
  if (evbuffer_get_length(in) > PROTO_LINE_MAX) { /* a line that never ends */
    operator_event(c->o, c->o->best_step, c->s ? c->s->slot : -1, "protocol_error", "control line too long; closing");
    if (!superseded_now(c->o)) conn_gone(c, bev); /* (an agent's host forgot it too: before, only the slot did) */
  }
}

static void conn_event(struct bufferevent *bev, short what, void *arg) {
  conn *c = arg;
  if (superseded_now(c->o)) return; /* a worker that left us for the new operator: no failure */
  if ((what & BEV_EVENT_TIMEOUT) && !c->authed) /* only an unproven connection has a timeout */
    auth_refused(c->o, "a connection from %s to the workers' port sent no answer to the challenge in %.0f s; closed",
                 c->peer, auth_answer_s(c->o));
  else if (!(what & (BEV_EVENT_EOF | BEV_EVENT_ERROR))) return;
  conn_gone(c, bev);
}

/* The connection ends (closed by the peer, or by us): an agent's host and a
 * worker's slot forget it before it is freed, so nothing writes to it later. */
static void conn_gone(conn *c, struct bufferevent *bev) {
  if (c->host >= 0 && c->o->hosts[c->host].bev == bev) {
    c->o->hosts[c->host].bev = NULL;
    hosts_conn_closed(c->o, c->host);
  }
  slot *s = c->s;
  if (s && s->bev == bev) {
    s->bev = NULL;
    /* external or adopted: the connection is its life (an agent's worker: the agent reports its exit),
     * also before it was ready (an external one has no exit we would hear otherwise) */
    int external = s->host < 0 && (s->pid == 0 || s->adopted);
    if (external && (s->state == SLOT_RUNNING || (s->state == SLOT_STARTING && s->pid == 0))) {
      if (s->adopted && !s->done && s->pid > 0) kill(s->pid, SIGKILL); /* not our child: make sure it is gone */
      s->state = s->done ? SLOT_DONE : SLOT_DEAD;
      if (!s->done) operator_slot_exited(c->o, s, 0x100 /* exit code 1 */);
      else check_finished(c->o);
    }
  }
  conn_free(c);
}

/* A worker's connection, closed by us once its process exited. Its last
 * lines (STEP, CKPT, DONE, FAIL) may still sit in the socket: the exit and
 * those lines become ready in one pass of the loop, the exit may be handled
 * first (a loop that stalled meanwhile: a long REPL expression), and a
 * replica that finished would be taken for one that failed. They are read
 * and handled first, up to EOF (bounded all the same): for a local worker
 * that is all it wrote; for one on an agent's host (its exit reported by
 * the agent, on another connection) all that has arrived. libevent freezes
 * the end of the input outside its read callback: thawed for each read. */
#define DRAIN_MAX (16 << 20)
static void slot_conn_close(operator_state *o, slot *s) {
  struct bufferevent *bev = s->bev;
  bufferevent_data_cb rcb = NULL;
  void *arg = NULL;
  bufferevent_getcb(bev, &rcb, NULL, NULL, &arg);
  conn *c = rcb == conn_read ? arg : NULL;
  if (c && c->s != s) { /* not this slot's own connection: its owner frees it */
    s->bev = NULL;
    return;
  }
  if (c && c->authed) {
    struct evbuffer *in = bufferevent_get_input(bev);
    evutil_socket_t fd = bufferevent_getfd(bev);
    size_t drained = 0;
    for (;;) {
      char *line;
      size_t n;
      while (s->bev == bev && (line = evbuffer_readln(in, &n, EVBUFFER_EOL_LF))) {
        handle_line(o, &c->s, bev, line);
        free(line);
      }
      if (s->bev != bev || evbuffer_get_length(in) > PROTO_LINE_MAX) break;
      if (drained > DRAIN_MAX) {
        operator_event(o, o->best_step, s->slot, "protocol_error",
                       "replica %d: more than %d MiB unread after its exit; the rest dropped", s->slot,
                       DRAIN_MAX >> 20);
        break;
      }
      evbuffer_unfreeze(in, 0);
      int got = evbuffer_read(in, fd, -1);
      evbuffer_freeze(in, 0);
      if (got <= 0) break;
      drained += (size_t)got;
    }
  }
  if (s->bev != bev) return; /* a line's handling closed it already */
  s->bev = NULL;
  if (c) conn_free(c);
  else bufferevent_free(bev);
}

static void accept_cb(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int len, void *arg) {
  (void)l;
  (void)len;
  operator_state *o = arg;
  struct bufferevent *bev = bufferevent_socket_new(o->base, fd, BEV_OPT_CLOSE_ON_FREE);
  conn *c = calloc(1, sizeof *c);
  if (!bev || !c) {
    if (bev) bufferevent_free(bev);
    free(c);
    return;
  }
  c->o = o;
  c->bev = bev;
  c->next = o->conns;
  if (o->conns) o->conns->prev = c;
  o->conns = c;
  c->host = -1;
  c->authed = o->secret.len == 0;
  if (sa && sa->sa_family == AF_INET)
    inet_ntop(AF_INET, &((struct sockaddr_in *)sa)->sin_addr, c->peer, sizeof c->peer);
  else snprintf(c->peer, sizeof c->peer, "?");
  if (!c->authed) { /* first thing: the challenge; nothing is read before its answer */
    double t = auth_answer_s(o);
    struct timeval tv = {(time_t)t, (suseconds_t)((t - (time_t)t) * 1e6)};
    auth_challenge(c->ch);
    evbuffer_add(bufferevent_get_output(bev), c->ch, sizeof c->ch);
    bufferevent_set_timeouts(bev, &tv, NULL);
  }
  bufferevent_setcb(bev, conn_read, NULL, conn_event, c);
  bufferevent_enable(bev, EV_READ | EV_WRITE);
}

/* --- FTAR membership --- */

/* Aborted epochs with no step done in between, this many (and for at
 * least LIVELOCK_DEADLINES deadlines), mean a member the others cannot reach
 * (a wrong advertised address, a one-way link): it is evicted. */
#define LIVELOCK_ABORTS 5
#define LIVELOCK_DEADLINES 2.0

typedef struct {
  operator_state *o;
  int slot;
} evict_req;

static void evict_unreachable(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  evict_req *r = arg;
  operator_state *o = r->o;
  slot *s = &o->slots[r->slot];
  free(r);
  if (superseded_now(o) || o->stopping || (s->state != SLOT_RUNNING && s->state != SLOT_STARTING)) return;
  operator_event(o, o->best_step, s->slot, "evict", "replica %d evicted: unreachable", s->slot);
  ftar_coord_evict(o->coord, s->slot);
  operator_kill_slot(o, s, SIGKILL);
}

/* The member no reporter of the aborts is: the one the others fail to
 * reach; among several, the newest (a replacement that came with a bad
 * address). Every member reported: the newest. */
static int unreachable_suspect(operator_state *o, const ftar_change *c) {
  int best = -1, quiet = 0;
  for (int i = 0; i < c->n_members; i++) {
    int k = c->slots[i];
    if (k < 0 || k >= o->nslots) continue;
    int q = !o->abort_reporters[k];
    if (best < 0 || q > quiet || (q == quiet && o->slots[k].ready_at > o->slots[best].ready_at)) best = k, quiet = q;
  }
  return best;
}

static void watch_aborts(operator_state *o, const ftar_change *c) {
  double now = tr_now();
  if (c->kind != FTAR_CHANGE_ABORTED) return;
  if (o->aborts == 0 || o->best_step > o->abort_step) { /* the first abort since a step was done */
    o->aborts = 0;
    o->abort_step = o->best_step;
    o->abort_t0 = now;
    memset(o->abort_reporters, 0, sizeof o->abort_reporters);
  }
  o->aborts++;
  if (c->slot >= 0 && c->slot < MAX_SLOTS) o->abort_reporters[c->slot] = 1;
  if (o->aborts < LIVELOCK_ABORTS || now - o->abort_t0 < LIVELOCK_DEADLINES * o->cfg->deadline || o->stopping) return;
  int k = unreachable_suspect(o, c);
  if (k < 0) return;
  char by[256] = "";
  for (int i = 0, n = 0; i < o->nslots && n + 8 < (int)sizeof by; i++)
    if (o->abort_reporters[i]) n += snprintf(by + n, sizeof by - (size_t)n, "%s%d", n ? "," : "", i);
  const slot *s = &o->slots[k];
  operator_event(o, o->best_step, k, "anomaly",
                 "unreachable: replica %d (%s) - %d aborted epochs in %.1f s without a step done since step %lld, "
                 "reported by replica(s) [%s]",
                 k, s->host >= 0 ? o->hosts[s->host].name : "this host", o->aborts, now - o->abort_t0,
                 (long long)o->abort_step, by);
  o->aborts = 0;
  memset(o->abort_reporters, 0, sizeof o->abort_reporters);
  evict_req *r = malloc(sizeof *r);
  struct timeval tv = {0, 0};
  if (r) *r = (evict_req){o, k};
  if (r && event_base_once(o->base, -1, EV_TIMEOUT, evict_unreachable, r, &tv) != 0) free(r);
}

static void on_change(void *ud, const ftar_change *c) {
  operator_state *o = ud;
  if (superseded_now(o)) return;
  watch_aborts(o, c);
  static const char *kinds[] = {"join", "closed", "lapsed", "evicted", "aborted", "wound down"};
  _Static_assert(sizeof kinds / sizeof kinds[0] == FTAR_CHANGE_WOUND_DOWN + 1, "a name for every ftar_change_kind");
  char list[512] = "";
  size_t k = 0;
  for (int i = 0; i < c->n_members && k + 8 < sizeof list; i++)
    k += (size_t)snprintf(list + k, sizeof list - k, i ? ",%d" : "%d", c->slots[i]);
  operator_event(o, o->best_step, c->slot, "membership", "epoch %llu: %s slot %d; members [%s]",
            (unsigned long long)c->epoch, kinds[c->kind], c->slot, list);
  for (int i = 0; i < o->nslots; i++) o->slots[i].in_ring = 0;
  for (int i = 0; i < c->n_members; i++)
    if (c->slots[i] >= 0 && c->slots[i] < o->nslots) o->slots[c->slots[i]].in_ring = 1;
  int finishing = 0;
  for (int i = 0; i < o->nslots; i++) finishing |= o->slots[i].done;
  /* a member lost (not one still missing at the start) */
  if (c->kind != FTAR_CHANGE_JOIN && c->kind != FTAR_CHANGE_WOUND_DOWN && c->n_members < (int)o->cfg->min_replicas &&
      !o->stopping && !finishing &&
      !o->rollback_pending)
    operator_event(o, o->best_step, -1, "paused", "%d live replicas < min_replicas %lld: waiting for replacements",
              c->n_members, (long long)o->cfg->min_replicas);
}

static void coord_log(void *ud, const char *msg) {
  operator_state *o = ud;
  if (strstr(msg, "did not prove the job secret")) auth_refused(o, "coordinator: %s", msg);
  if (o->coord_log) {
    fprintf(o->coord_log, "%.3f %s\n", tr_now() - o->t0, msg);
    fflush(o->coord_log);
  }
}

/* --- entry --- */

/* --- the run --- */

/* metrics.jsonl, events.jsonl, coordinator.log, then the restart policy
 * (after the logs: its load is an event). */
static int open_logs(operator_state *o, int resume) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/metrics.jsonl", o->dir);
  o->metrics = fopen(path, resume ? "a" : "w");
  snprintf(path, sizeof path, "%s/events.jsonl", o->dir);
  o->events = fopen(path, "a");
  tr_log_reserve(o->events);
  snprintf(path, sizeof path, "%s/coordinator.log", o->dir);
  o->coord_log = fopen(path, "a");
  if (!o->metrics || !o->events) return tr_fail(TR_EIO, "cannot open the logs in %s", o->dir);
  int rc = operator_policy_load(o);
  if (!rc && o->cfg->hosts > 0) rc = hosts_policy_load(o);
  return rc;
}

int operator_check_env(const job_config *cfg, const char *hosts_from) {
  const char *maddr = getenv("MASTER_ADDR"), *mp = getenv("MASTER_PORT");
  long long port;
  if (cfg->hosts > 0 && !(maddr && *maddr))
    return tr_fail(TR_EINVAL, "%s: key 'hosts': hosts = %lld needs MASTER_ADDR, the address the agents reach this "
                   "operator at (and MASTER_PORT, the port they are told)", hosts_from, (long long)cfg->hosts);
  if (mp && tr_parse_int(mp, 0, 65535, &port))
    return tr_fail(TR_EINVAL, "MASTER_PORT '%s' is not a port number (0..65535)", mp);
  return TR_OK;
}

/* The FTAR coordinator and the workers' control port. Under an external
 * launcher both must be reachable from other nodes: they listen on every
 * address, the coordinator advertised as MASTER_ADDR, the port MASTER_PORT. */
static int start_listeners(operator_state *o) {
  ftar_coord_opts co;
  ftar_coord_opts_default(&co);
  co.deadline = o->cfg->deadline;
  co.on_change = on_change;
  co.ud = o;
  co.log = coord_log;
  co.log_ud = o;
  co.secret = o->secret.key;
  co.secret_len = o->secret.len;
  const char *maddr = getenv("MASTER_ADDR"), *mp = getenv("MASTER_PORT");
  long long port = 0;
  int rc = operator_check_env(o->cfg, o->cfg->path); /* transom run checked it before writing anything */
  if (rc) return rc;
  if (mp) tr_parse_int(mp, 0, 65535, &port);
  snprintf(o->adv_host, sizeof o->adv_host, "%s", maddr && *maddr ? maddr : "127.0.0.1");
  o->coord = ftar_coord_create(o->base, maddr && *maddr ? "0.0.0.0" : "127.0.0.1", 0, &co);
  if (!o->coord) return tr_fail_prefix(TR_EIO, "coordinator");
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  sa.sin_addr.s_addr = htonl(mp ? INADDR_ANY : INADDR_LOOPBACK);
  o->lis = evconnlistener_new_bind(o->base, accept_cb, o, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC | LEV_OPT_REUSEABLE, 64,
                                   (struct sockaddr *)&sa, sizeof sa);
  if (!o->lis) return tr_fail(TR_EIO, "cannot listen for workers: %s", strerror(errno));
  socklen_t sl = sizeof sa;
  getsockname(evconnlistener_get_fd(o->lis), (struct sockaddr *)&sa, &sl);
  o->port = ntohs(sa.sin_port);
  o->ctl = operator_ctl_listen(o);
  o->ctl_made = o->ctl != NULL; /* RUN/control.sock is ours to remove */
  /* test hook TRANSOM_TEST_ADDR_DELAY_MS: listening, RUN/operator.addr not
   * yet ours for this long (a worker looking for us meanwhile reads the
   * dead operator's file, reaches us at the same address, and must still
   * take us for the new one). Unset: nothing. */
  const char *delay = getenv("TRANSOM_TEST_ADDR_DELAY_MS");
  if (delay && atoi(delay) > 0 && atoi(delay) <= 10000) usleep((useconds_t)atoi(delay) * 1000);
  /* where waiting workers of a killed operator find the next one */
  char path[PATH_MAX], addr[300];
  char nonce[sizeof o->nonce];
  make_nonce(o);
  snprintf(nonce, sizeof nonce, "%s", o->nonce);
  o->nonce[0] = 0; /* known once written */
  int n = snprintf(addr, sizeof addr, "%s:%d\n%s\n", o->adv_host, o->port, nonce);
  snprintf(path, sizeof path, "%s/operator.addr", o->dir);
  rc = tr_write_file_atomic(path, addr, (size_t)n);
  if (!rc) snprintf(o->nonce, sizeof o->nonce, "%s", nonce); /* ours: another one's is a takeover (superseded) */
  return rc;
}

/* --resume: the newest checkpoint (o->last_ckpt; -1: none, a run killed
 * before its first). A local store LMDB refuses, or whose list cannot be
 * read, is moved aside where a remote level holds the checkpoints (as
 * transom run does for one process); without one the resume stops,
 * naming it: never a start from step 0 over checkpoints it could not read
 * (which would also truncate metrics.jsonl). */
static int resume_store(operator_state *o) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/ckpt", o->dir);
  if (o->cfg->ckpt_remote[0] && ckpt_store_damaged(path)) {
    char aside[PATH_MAX + 32];
    snprintf(aside, sizeof aside, "%s.damaged-%lld", path, (long long)time(NULL));
    if (rename(path, aside) == 0)
      fprintf(stderr, "transom: the checkpoint store %s is damaged; moved to %s: the remote level %s still holds the "
              "checkpoints\n", path, aside, o->cfg->ckpt_remote);
  }
  int rc = operator_newest_checkpoint(o, INT64_MAX, &o->last_ckpt);
  return rc ? tr_fail_prefix(rc, "resume") : TR_OK;
}

/* The loop, its policy watcher, the listeners, the detector, the signals. */
static int start(operator_state *o) {
  /* a run killed before its first checkpoint resumes from step 0 */
  int rc;
  o->restarted = o->resume;
  o->last_ckpt = 0;
  if (o->resume && (rc = resume_store(o))) return rc; /* never "from scratch" over a store that cannot be read */
  o->from_scratch = o->resume && o->last_ckpt < 0;
  if (o->from_scratch) o->resume = 0;
  if (o->last_ckpt < 0) o->last_ckpt = 0;
  rc = open_logs(o, o->restarted); /* from scratch: truncated once no worker was adopted */
  if (rc) return rc;
  o->base = event_base_new();
  if (!o->base) return tr_fail(TR_ENOMEM, "cannot create the event loop");
  if (policy_watch(o->pol, o->base))
    operator_event(o, 0, -1, "watch_failed", "restart.lua is not watched (reload() from attach still works): %s",
                   tr_error());
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/secret", o->dir);
  if ((rc = auth_secret_make(path, &o->secret))) return rc;
  auth_secret_hex(&o->secret, o->secret_hex, sizeof o->secret_hex);
  if ((rc = start_listeners(o))) return rc;
  if (o->cfg->detector && (rc = start_detector(o))) return rc;
  if (!(o->tick = event_new(o->base, -1, EV_PERSIST, tick_cb, o))) return tr_fail(TR_ENOMEM, "out of memory");
  struct timeval tv = {0, 250000};
  evtimer_add(o->tick, &tv);
  o->ev_chld = evsignal_new(o->base, SIGCHLD, sigchld_cb, o);
  o->ev_term = evsignal_new(o->base, SIGTERM, sigterm_cb, o);
  o->ev_int = evsignal_new(o->base, SIGINT, sigterm_cb, o);
  evsignal_add(o->ev_chld, NULL);
  evsignal_add(o->ev_term, NULL);
  evsignal_add(o->ev_int, NULL);
  signal(SIGPIPE, SIG_IGN);
  return 0;
}

/* Every slot, and its worker unless an external launcher starts them. */
void operator_spawn_all(operator_state *o) {
  const char *mode = o->resume ? "resume" : "start";
  int external = getenv("TRANSOM_EXTERNAL_WORKERS") != NULL;
  if (o->cfg->hosts > 0 && !o->placing) { /* hosts_line starts them once the agents came */
    operator_event(o, 0, -1, "waiting_for_hosts", "%d replicas wait for %lld agents (transom agent --operator %s:%d)",
                   o->nslots, (long long)o->cfg->hosts, o->adv_host, o->port);
    return;
  }
  operator_event(o, 0, -1, o->resume ? "resume" : "start", "%d replicas", o->nslots);
  for (int i = 0; i < o->nslots; i++) {
    snprintf(o->slots[i].mode, sizeof o->slots[i].mode, "%s", mode);
    if (!external) operator_spawn(o, i, mode);
  }
}

/* --- adoption: live workers of a killed operator --- */

#define ADOPT_WINDOW 2.0   /* seconds a restarted operator listens for live workers before starting any */
#define ADOPT_REGISTER 10.0 /* and then at most this long for the adopted to re-register with FTAR */

/* The last step metrics.jsonl holds per worker: what a replay may skip. */
static void load_logged(operator_state *o) {
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/metrics.jsonl", o->dir);
  size_t len;
  char *text = tr_read_file(path, &len);
  for (int i = 0; i < o->nslots; i++) o->slots[i].logged = -1;
  for (char *line = text; line && *line;) {
    char *nl = strchr(line, '\n');
    long long st, wk;
    if (nl && sscanf(line, "{\"step\":%lld,\"worker\":%lld,", &st, &wk) == 2 && wk >= 0 && wk < o->nslots &&
        st > o->slots[wk].logged)
      o->slots[wk].logged = st;
    line = nl ? nl + 1 : line + strlen(line);
  }
  free(text);
}

/* The window closes when every slot is adopted, or after ADOPT_WINDOW; then
 * (once the adopted re-registered with FTAR, bounded) the coordinator
 * publishes one epoch with all of them, and the slots with no live worker
 * start: join from a live donor, else (nobody adopted) the plain resume. */
static void adopt_tick(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  operator_state *o = arg;
  if (superseded(o)) return;
  double t = tr_now() - o->adopt_t0;
  int adopted = 0, running = 0; /* an adopted replica may have finished already (its DONE came with the adoption) */
  int named = 0; /* slots whose agent named a live worker that has not said HELLO yet: worth waiting for */
  for (int i = 0; i < o->nslots; i++) {
    const slot *s = &o->slots[i];
    running += s->adopted && s->state == SLOT_RUNNING;
    adopted += s->adopted && (s->state == SLOT_RUNNING || s->state == SLOT_DONE);
    named += s->state == SLOT_WAITING && !s->adopted && s->host >= 0;
  }
  if (t < ADOPT_WINDOW && adopted < o->nslots) return;
  if (named && t < ADOPT_WINDOW + ADOPT_REGISTER) return;
  if (ftar_coord_registered(o->coord) < running && t < ADOPT_WINDOW + ADOPT_REGISTER) return;
  evtimer_del(o->adopt_ev);
  o->adopting = 0;
  ftar_coord_hold(o->coord, 0);
  for (int i = 0; i < o->nslots; i++) /* named by its agent, never back itself: started anew below */
    if (o->slots[i].state == SLOT_WAITING && !o->slots[i].adopted) hosts_unclaim(o, &o->slots[i]);
  if (adopted) o->placing = 1; /* the slots are started one by one below, never all again (an agent coming later) */
  if (o->stopping) {
    check_finished(o);
    return;
  }
  if (adopted && running < adopted) { /* some came back finished: nothing is left to train, nothing to start */
    operator_event(o, o->best_step, -1, "adoption", "%d of %d replicas adopted live at step %lld (%d finished)",
                   adopted, o->nslots, (long long)o->best_step, adopted - running);
    check_finished(o);
    return;
  }
  if (!adopted) {
    for (int i = 0; i < o->nslots; i++)
      if (o->slots[i].state == SLOT_WAITING) o->slots[i].state = SLOT_EMPTY;
    if (o->from_scratch) {
      operator_event(o, 0, -1, "resume", "no committed checkpoint in %s/ckpt: starting from step 0", o->dir);
      fflush(o->metrics);
      if (ftruncate(fileno(o->metrics), 0) != 0)
        operator_event(o, 0, -1, "metrics_error", "cannot truncate metrics.jsonl: %s", strerror(errno));
    }
    operator_spawn_all(o);
    return;
  }
  operator_event(o, o->best_step, -1, "adoption", "%d of %d replicas adopted live at step %lld; %d to start", adopted,
                 o->nslots, (long long)o->best_step, o->nslots - adopted);
  for (int i = 0; i < o->nslots; i++) {
    slot *s = &o->slots[i];
    if (s->state != SLOT_WAITING || (s->timer && evtimer_pending(s->timer, NULL))) continue;
    if (getenv("TRANSOM_EXTERNAL_WORKERS")) { /* the launcher starts them; they say HELLO */
      s->state = SLOT_EMPTY;
      continue;
    }
    operator_spawn(o, i, pick_donor(o, i) ? "join" : "resume");
  }
}

/* --resume: wait for live workers first (they poll RUN/operator.addr). */
static void start_adoption(operator_state *o) {
  load_logged(o);
  o->adopting = 1;
  o->adopt_t0 = tr_now();
  for (int i = 0; i < o->nslots; i++) o->slots[i].state = SLOT_WAITING;
  ftar_coord_hold(o->coord, 1);
  o->adopt_ev = event_new(o->base, -1, EV_PERSIST, adopt_tick, o);
  struct timeval tv = {0, 100000};
  if (o->adopt_ev) {
    evtimer_add(o->adopt_ev, &tv);
    return;
  }
  o->adopting = 0; /* no window: start them all */
  ftar_coord_hold(o->coord, 0);
  for (int i = 0; i < o->nslots; i++) o->slots[i].state = SLOT_EMPTY;
  operator_spawn_all(o);
}

/* Do the finished replicas hold the same parameters? And what the run did. */
static void verdict(operator_state *o) {
  double wall = tr_now() - o->t0;
  int done = 0, agree = 1;
  uint32_t crc0 = 0;
  for (int i = 0; i < o->nslots; i++) {
    slot *s = &o->slots[i];
    if (s->state != SLOT_DONE) continue;
    if (!done++) crc0 = s->crc;
    else if (s->crc != crc0) agree = 0;
  }
  if (done > 1) {
    if (agree)
      operator_event(o, o->best_step, -1, "replicas_agree", "%d replicas finished with parameter crc32c %08x", done,
                     crc0);
    else operator_event(o, o->best_step, -1, "replicas_differ", "replicas finished with different parameters");
  }
  if (o->stopping)
    printf("operator: stopped at step %lld (checkpointed) | %d restarts | %.1f s\nresume with: transom run --resume %s\n",
           (long long)o->last_ckpt, o->restarts_total, wall, o->dir);
  else
    printf("operator: finished at step %lld | %d replicas finished | %d restarts | %.1f s\n", (long long)o->best_step,
           done, o->restarts_total, wall);
}

/* Frees what start() made, whatever it got to. */
static void teardown(operator_state *o) {
  /* First, while the base lives (superseded_now may break its loop) and
   * before the control socket closes (a --resume probing in between would
   * find no operator and start): whether a newer operator took over, asked
   * afresh; if not, our control.sock goes and RUN/operator.addr says
   * "ended", not removed: an operator stopped while this one took over
   * finds it (superseded) when it runs again, where a missing file says
   * nothing; workers find no address in it. If that write fails the file
   * keeps our address and nonce, which a stopped older one also reads as
   * superseded. */
  char path[PATH_MAX];
  if (o->base && o->nonce[0]) superseded_now(o);
  snprintf(path, sizeof path, "%s/control.sock", o->dir);
  if (o->ctl_made && !o->superseded) unlink(path); /* superseded: both are the new operator's; none made: another's */
  if (o->nonce[0] && !o->superseded) {
    char ended[64];
    int n = snprintf(ended, sizeof ended, "ended\n%s\n", o->nonce);
    snprintf(path, sizeof path, "%s/operator.addr", o->dir);
    (void)tr_write_file_atomic(path, ended, (size_t)n);
  }
  if (o->base && !o->superseded) hosts_end(o); /* the agents exit now (superseded: they are the new one's) */
  while (o->conns) conn_free(o->conns); /* the agents' and workers' still open: before the base they live on */
  for (int i = 0; i < o->nhosts; i++) o->hosts[i].bev = NULL;
  for (int i = 0; i < o->nslots; i++) o->slots[i].bev = NULL;
  for (int i = 0; i < o->nslots; i++)
    if (o->slots[i].timer) event_free(o->slots[i].timer);
  if (o->tick) event_free(o->tick);
  if (o->adopt_ev) event_free(o->adopt_ev); /* an event is freed before its base: event_del reads the base */
  prom_server_free(o->prom);
  detector_destroy(o->det);
  if (o->ev_chld) event_free(o->ev_chld);
  if (o->ev_term) event_free(o->ev_term);
  if (o->ev_int) event_free(o->ev_int);
  operator_ctl_close(o);
  if (o->lis) evconnlistener_free(o->lis);
  ftar_coord_free(o->coord);
  operator_policy_free(o); /* its watcher, before the base */
  if (o->base) event_base_free(o->base);
  if (o->metrics) fclose(o->metrics);
  if (o->events) auth_refused_flush(o, o->auth_ev_window + AUTH_EVENTS_WINDOW); /* what the last window held back */
  if (o->events) fclose(o->events);
  if (o->coord_log) fclose(o->coord_log);
  free(o->chaos_fired);
}

int operator_run(lua_State *L, job_config *cfg, const char *dir, int resume, int start_gate, int *stopped) {
  *stopped = 0;
  operator_state o = {.cfg = cfg, .L = L, .dir = dir, .exit_code = 0, .resume = resume};
  char self[PATH_MAX];
  ssize_t sn = readlink("/proc/self/exe", self, sizeof self - 1);
  if (sn <= 0) return tr_fail(TR_EIO, "cannot find the transom executable");
  self[sn] = 0;
  o.self = self;
  o.nslots = (int)cfg->replicas;
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  o.threads = cfg->threads > 0 ? (int)cfg->threads : (int)(cores / o.nslots > 1 ? cores / o.nslots : 1);
  o.width = snprintf(NULL, 0, "%lld", (long long)cfg->max_steps);
  o.chaos_fired = calloc((size_t)cfg->nchaos + 1, sizeof(int));
  int rc = o.chaos_fired ? start(&o) : tr_fail(TR_ENOMEM, "out of memory");
  if (start_gate >= 0) close(start_gate); /* a probe finds us on RUN/control.sock now */
  if (rc) {
    teardown(&o);
    return rc;
  }
  printf("operator: %d replicas x %d threads | on_failure %s | min_replicas %lld | workers at %s:%d | control "
         "%s/control.sock\n",
         o.nslots, o.threads, cfg->on_failure, (long long)cfg->min_replicas, o.adv_host, o.port, dir);
  fflush(stdout);
  o.t0 = tr_now();
  for (int i = 0; i < o.nslots; i++) {
    o.slots[i].o = &o;
    o.slots[i].slot = i;
    o.slots[i].resume_step = -1;
    o.slots[i].host = o.slots[i].last_host = -1;
  }
  if (o.restarted) start_adoption(&o);
  else operator_spawn_all(&o);
  event_base_dispatch(o.base);
  if (o.superseded) {
    teardown(&o);
    return tr_fail(TR_ESTATE, "superseded by an operator started later with --resume: it carries the run on");
  }
  verdict(&o);
  teardown(&o);
  if (!o.stopping && o.best_step < cfg->max_steps && o.exit_code == 0) o.exit_code = 1;
  *stopped = o.stopping;
  return o.exit_code ? tr_fail(TR_ESTATE, "the job did not finish (step %lld of %lld)", (long long)o.best_step,
                               (long long)cfg->max_steps)
                     : TR_OK;
}
