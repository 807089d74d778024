/* detector.h — the detector (TRANSOM's Eagle Eye): per-worker metric series,
 * Lua anomaly rules, Lua policies that turn anomalies into actions, hot
 * reload of both, and read-only views for the REPL.
 *
 * Who calls it: the operator (core/fleet/operator.c), on its libevent thread.
 *
 *   observe / heartbeat / worker_gone      the operator feeds what workers say
 *        |
 *   detector_tick(now)                     every rule over every known worker
 *        |   rules.lua: rule(w, fleet, state) -> anomalies {kind, worker, severity, detail, step}
 *        v
 *   dedup (rule, kind, worker, step) ---> on_anomaly, on_event("anomaly")
 *        |   actions.lua: actions[kind] = "evict" | function(anomaly, state, fleet) -> action
 *        v
 *   on_action, on_event("action")          the operator carries it out
 *
 * Rules and policies are Lua files in the policy directory (rules.lua,
 * actions.lua; the shipped ones are lua/policies/). They are loaded, called
 * and hot-reloaded by the policy engine (core/lua/include/policy.h), on a
 * VM of the detector's own, each file in a fresh sandboxed environment: no
 * io, os (but os.time/os.clock), load, dofile, require, package, debug,
 * collectgarbage, coroutine; reading or assigning an undefined global raises
 * an error that names it; every call runs under an instruction budget (a
 * count hook) and the VM under a memory limit. `state` (a global and the
 * last argument) is a table the detector keeps across calls and reloads.
 *
 * What it does not do: act. Evicting, rolling back, skipping an update and
 * checkpointing are the operator's, through on_action. It never exits the
 * process; Lua errors become events.
 *
 * Thread-safety: a detector belongs to one thread (the operator's event
 * loop); no function may be called from two threads. Callbacks run on that
 * thread, inside detector_tick / detector_reload / the watcher. From a
 * callback the operator may call detector_observe, detector_heartbeat,
 * detector_worker_gone and detector_rewind; detector_tick, detector_reload and
 * detector_destroy return TR_ESTATE there (destroy: not allowed at all).
 *
 * Clock: every `now` and sample time is in seconds on one monotonic clock
 * chosen by the caller (tr_now() in transom); the detector only subtracts
 * them. Event timestamps (detector_event.time) are wall-clock (CLOCK_REALTIME),
 * like the rest of events.jsonl.
 *
 * How the operator embeds it (core/fleet/operator.c):
 *   start:    detector_create(&o) with o.policy_dir = the job's policies folder
 *             (NULL: lua/policies), o.on_event writing detector_event_json() + "\n"
 *             to events.jsonl, o.on_action carrying actions out; then
 *             detector_watch(d, base); prom_serve(base, "127.0.0.1",
 *             metrics_port, d, ...); a 1 s timer calling detector_tick(d, tr_now()).
 *   STEP:     detector_observe(d, slot, step, &sample) (ms -> seconds,
 *             crc -> checksum/has_checksum, time = tr_now()); once every replica
 *             has reported the step: detector_tick(d, tr_now()).
 *   HB:       (a line from the worker's heartbeat thread) detector_heartbeat(d, slot, tr_now()).
 *   exit:     a replica exits, is killed or evicted: detector_worker_gone(d, slot).
 *   rollback: after every replica reloaded checkpoint step S: detector_rewind(d, S).
 *   REPL:     metrics(w) -> detector_push_worker, events(n) ->
 *             detector_push_anomalies, reload() -> detector_reload.
 *   end:      prom_server_free, detector_destroy, then event_base_free.
 */
#ifndef TRANSOM_DETECTOR_H
#define TRANSOM_DETECTOR_H

#include <lua.h>
#include <stddef.h>
#include <stdint.h>

#include "step_record.h"

struct event_base;

/* --- metrics --- */

/* The per-step metrics: the step record's (step_record.h, one table for the
 * STEP line, metrics.jsonl and these) plus compute_s, which the detector
 * derives: step_s - allreduce_s, the time a replica spends on its own work
 * (a slow replica makes every other one wait in the all-reduce, so their
 * step_s rise too; compute_s does not). The sample struct, the series
 * store, the Lua views and the Prometheus output all come from it:
 * X(ENUM, field/Lua name, help, Prometheus gauge or "", Prometheus phase or ""). */
#define DETECTOR_METRICS(X) \
  STEP_METRICS(X)           \
  X(COMPUTE_S, compute_s, "step time without the all-reduce wait", "transom_compute_seconds", "")

#define DETECTOR_METRIC_ENUM(id, name, help, prom, phase) DET_M_##id,
typedef enum { DETECTOR_METRICS(DETECTOR_METRIC_ENUM) DET_M_COUNT } detector_metric;
#undef DETECTOR_METRIC_ENUM

/* "loss", "step_s", ...; NULL out of range. */
const char *detector_metric_name(int metric);
/* The metric's index, -1 when name is not one. */
int detector_metric_index(const char *name);

/* One step of one worker. Times are seconds. A field that was not measured
 * is 0 (a zero-initialized sample is valid); NaN/Inf only for values that
 * really are (a NaN loss is what nan_or_inf_loss looks for). compute_s is
 * ignored: the detector derives it. */
typedef struct {
#define DETECTOR_SAMPLE_FIELD(id, name, help, prom, phase) double name;
  DETECTOR_METRICS(DETECTOR_SAMPLE_FIELD)
#undef DETECTOR_SAMPLE_FIELD
  uint32_t checksum; /* parameter checksum (crc32c), meaningful when has_checksum */
  int has_checksum;
  double time;       /* when the operator received it (the `now` clock); 0 = tr_now() */
} detector_sample;

/* --- what comes out --- */

typedef enum {
  DET_ACT_IGNORE,
  DET_ACT_ALERT,          /* log it, nothing else */
  DET_ACT_EVICT,          /* kill worker and let the restart policy replace it */
  DET_ACT_ROLLBACK,       /* every replica reloads the newest checkpoint at or before step */
  DET_ACT_SKIP_UPDATE,    /* drop the optimizer update of step (worker -1: on every replica) */
  DET_ACT_CHECKPOINT_NOW, /* snapshot as soon as possible */
  DET_ACT_COUNT
} detector_action_kind;

/* "ignore", "alert", "evict", "rollback", "skip_update", "checkpoint_now". */
const char *detector_action_name(detector_action_kind a);
/* -1 when name is not an action. */
int detector_action_index(const char *name);

/* An anomaly a rule raised. Strings are valid during the callback only. */
typedef struct {
  double time;          /* wall clock */
  int64_t step;         /* the step it is about (-1: none) */
  int worker;           /* -1: the fleet as a whole */
  const char *rule;     /* the rule function's name in rules.lua */
  const char *kind;     /* what the rule says it is ("straggler", ...) */
  const char *severity; /* "info" | "warning" | "critical" (free text from the rule) */
  const char *detail;
} detector_anomaly;

/* An action the policy chose. Strings and cause are valid during the callback only. */
typedef struct {
  detector_action_kind action;
  int worker;                    /* the target (evict, skip_update); -1: all replicas (rollback default) */
  int64_t step;                  /* rollback: newest checkpoint at or before it (default: anomaly step - 1);
                                    skip_update: the step whose update to drop; else the anomaly's step */
  const char *detail;            /* from the policy, or "" */
  const detector_anomaly *cause;
} detector_action;

typedef enum {
  DET_EV_ANOMALY,       /* "anomaly" */
  DET_EV_ACTION,        /* "action" */
  DET_EV_RULE_ERROR,    /* "rule_error": a rule or policy call raised, ran past its budget, or returned garbage */
  DET_EV_RELOAD,        /* "policy_reload": a file was (re)loaded and is in force */
  DET_EV_RELOAD_FAILED, /* "policy_reload_failed": it was not; the previous version stays in force */
  DET_EV_PRINT,         /* "rule_print": print() from a rule or policy */
} detector_event_type;

/* One line of events.jsonl. Strings are valid during the callback only; NULL
 * when they do not apply. */
typedef struct {
  detector_event_type type;
  const char *kind;     /* the type's name above */
  double time;          /* wall clock */
  int64_t step;
  int worker;
  const char *rule;     /* rule (or "actions.<kind>" for a policy function) */
  const char *anomaly;  /* the anomaly's kind */
  const char *severity;
  const char *action;   /* action name */
  const char *file;     /* path of the policy file concerned */
  int line;             /* line in it, 0 when unknown */
  const char *detail;
} detector_event;

/* Formats e as one JSON object without a newline: {"time":..,"step":..,
 * "worker":..,"kind":"..", then rule, anomaly, severity, action, file, line
 * when set, "detail":".."}. Returns the length it needed (like snprintf);
 * truncated output is still NUL-terminated but not valid JSON. */
int detector_event_json(const detector_event *e, char *buf, size_t n);

/* --- life cycle --- */

typedef struct {
  const char *policy_dir;   /* rules.lua and actions.lua, watched. NULL: lua_host_dir()/policies */
  const char *fallback_dir; /* where detector_create takes a file policy_dir lacks.
                               NULL: lua_host_dir()/policies */
  int max_workers;          /* worker ids 0..max_workers-1; 0: 256 */
  int history;              /* observations kept per worker (2..65536); 0: 256 */
  double ewma_alpha;        /* smoothing of the EWMAs; 0: 0.05 */
  long budget;              /* Lua instructions per rule/policy call; 0: 200000 */
  size_t mem_limit;         /* bytes the detector's Lua VM may hold; 0: 64 MiB */
  int debounce_ms;          /* watcher: quiet time before reloading; 0: 200 */
  /* Callbacks, all optional (NULL), all on the caller's thread. */
  void (*on_event)(void *ud, const detector_event *e);     /* write it to events.jsonl */
  void (*on_anomaly)(void *ud, const detector_anomaly *a);
  void (*on_action)(void *ud, const detector_action *a);   /* never called for "ignore" */
  void *ud;                 /* passed back to the callbacks; the caller owns it */
} detector_opts;

typedef struct detector detector;

/* Fills o with the defaults above (all zero/NULL). */
void detector_opts_default(detector_opts *o);

/* Creates a detector with its own Lua VM and loads rules.lua and actions.lua
 * (from policy_dir, else fallback_dir), each checked as detector_reload does.
 * The strings in o are copied; o need not outlive the call. Returns NULL with
 * tr_error() set ("rules.lua:12: ...") when a file is missing, fails to load
 * or fails its check, or on bad options / no memory. Free with
 * detector_destroy. Loading emits DET_EV_RELOAD events through o->on_event. */
detector *detector_create(const detector_opts *o);
/* Stops the watcher and frees everything. Call before event_base_free of the
 * base given to detector_watch. NULL is a no-op. Not from a callback. */
void detector_destroy(detector *d);

/* --- input --- */

/* Records worker's metrics for step (a replica reports each step once; a
 * repeat after a rollback is a new observation). No allocation except the
 * first time a worker id is seen. TR_EINVAL for a worker out of range,
 * TR_ENOMEM. */
int detector_observe(detector *d, int worker, int64_t step, const detector_sample *s);
/* worker is alive at now (its heartbeat thread, not its training thread).
 * TR_EINVAL for a worker out of range. */
int detector_heartbeat(detector *d, int worker, double now);
/* worker is gone (exited, killed, evicted): its series, heartbeat and
 * checksums are forgotten; a replacement with the same id starts afresh
 * and may raise the anomalies it raised again; once every worker is gone,
 * the fleet-wide ones (worker -1) too. Returns TR_EINVAL for a worker out
 * of range. */
int detector_worker_gone(detector *d, int worker);
/* A rollback to step happened: observations and checksums after step are
 * dropped and anomalies about later steps may fire again. */
void detector_rewind(detector *d, int64_t step);

/* --- evaluation --- */

/* Runs every rule over every known worker at time now, then the policy over
 * each new anomaly, calling the callbacks. Call it after each fleet step
 * (when every replica has reported it) and on a timer (1 s), so hangs and
 * lost heartbeats are seen when no step arrives. A gap of more than 2 s
 * since the previous tick is the caller's loop stalled: what came meanwhile
 * sits unread, so the gap beyond 2 s does not count in any heartbeat's age
 * (no worker is dead for the caller's own silence). A rule that raises or runs
 * past its budget is an event (once per distinct message), is skipped for the
 * rest of this tick, and after 3 ticks in a row over budget is disabled until
 * its file is reloaded; the tick goes on. Returns the number of new
 * anomalies (>= 0), TR_ESTATE from a callback. */
int detector_tick(detector *d, double now);

/* --- policies --- */

/* Reloads rules.lua and actions.lua from policy_dir now, whether changed or
 * not. Each file is compiled into a fresh sandboxed environment, must return
 * a table (rules: name -> function; actions: anomaly kind or "default" ->
 * action name or function), and every function gets a dry call on synthetic
 * views (an empty worker and a worker with a few steady steps); only if all
 * of that works does it replace the version in force. Either way an event
 * says what happened (DET_EV_RELOAD, or DET_EV_RELOAD_FAILED with file, line
 * and message). Returns 0 when every file is in force as written, TR_ELUA or
 * TR_EIO (tr_error() names the first failing file:line) otherwise; a failure
 * never leaves the detector without rules. TR_ESTATE from a callback. */
int detector_reload(detector *d);

/* Watches policy_dir with inotify on base (IN_CLOSE_WRITE | IN_MOVED_TO |
 * IN_CREATE, so editors that write a temporary file and rename it are seen)
 * and reloads a changed rules.lua / actions.lua debounce_ms after the last
 * change. Files whose bytes did not change are not reloaded. base must outlive
 * the detector (or call detector_unwatch first). TR_EIO when inotify fails,
 * TR_ESTATE when already watching. */
int detector_watch(detector *d, struct event_base *base);
void detector_unwatch(detector *d);

/* --- read-only access (REPL, Prometheus) --- */

/* Push onto L (any Lua state, e.g. the REPL's; not necessarily the
 * detector's) a plain table copied from the detector, so it stays valid
 * after the detector changes or goes; the table belongs to L. Each pushes
 * exactly one value. They allocate in L, so call them where L's errors are
 * caught (from a lua_CFunction the REPL registers, e.g. metrics(w)).
 * Detector's thread only; not from inside a detector callback's Lua call.
 *
 * detector_push_worker: {id, step, n, total, heartbeat_age, progress_age,
 *   checksum, checksum_step, latest = {loss = .., ...},
 *   ewma = {loss = {mean, std}, ...}, series = {step = {..}, loss = {..}, ...}}
 *   holding the last n observations (n <= 0: all kept), oldest first; ages
 *   against the last `now` the detector saw. Pushes nil and returns TR_EINVAL
 *   when worker is unknown. */
int detector_push_worker(detector *d, lua_State *L, int worker, int n);
/* {now, step, min_step, size, workers = {ids}, median = {metric = ..},
 *  p90 = {..}, mean = {..}} over the latest value of every known worker. */
int detector_push_fleet(detector *d, lua_State *L);
/* The last n anomalies (n <= 0: all kept, up to 256), oldest first:
 * {{time, step, worker, rule, kind, severity, detail, action}, ...}. */
int detector_push_anomalies(detector *d, lua_State *L, int n);

/* Counters since creation: steps observed, anomalies, actions of a kind
 * (prom.h exposes these and more). Detector's thread. */
int64_t detector_steps_total(const detector *d);
int64_t detector_anomalies_total(const detector *d);
int64_t detector_actions_total(const detector *d, detector_action_kind a);

#endif
