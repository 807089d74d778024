/* pipeline_run.c — the launcher of a pipelined `transom run`, and `transom
 * plan` (see pipeline.h).
 *
 * A worker the job puts in a network namespace (pipeline.workers[i].netns,
 * a test host) gets its listening socket made in that namespace (the
 * launcher enters it on its thread for the bind) and runs there.
 * It opens one listening socket per worker itself before any starts (each
 * worker inherits its own and learns the others' ports: no port is ever
 * guessed) and a control socket pair per worker, starts one `transom
 * stage` process per worker, collects their PROBE lines (speed, links),
 * plans (pipeline_plan.c: OP-Fence, even, or a Lua policy), prints the
 * plan and sends each worker its stage, the cuts and the order. Then it
 * waits, reading the workers' control lines (their donors' ports). One
 * pipeline: when a worker fails the others are stopped (SIGTERM, then
 * SIGKILL after a bounded wait) and reaped: no worker outlives the run.
 * Several (replicas): a failure stops that pipeline only; the others train
 * on, and the launcher starts the lost one again (pipeline.rebuilds times):
 * new workers that catch up from a live pipeline's (pipeline_rejoin.c),
 * once one has told its donors' ports. SIGINT or SIGTERM to `transom run`
 * stops it in order: the launcher tells every worker STOP on its control
 * socket, the stages agree on a step in their end-of-step exchange, each
 * checkpoints it and stage 0 saves the weights, every worker says where
 * it stopped and exits 0, and the launcher prints the step (the newest
 * every store holds) and the resume command; nothing is started again
 * after a stop. RUN/events.jsonl, in the operator's format: the launcher
 * writes the start or resume, a stop, the end (worker -1), each stage its
 * checkpoints (pipeline_main.c).
 * `transom plan` does the same up to the plan and then tells the workers
 * to stop.
 */
#define _GNU_SOURCE /* setns */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ftar.h"
#include "graph_stage.h"
#include "lua_host.h"
#include "pipeline.h"
#include "pipeline_ckpt.h"
#include "pipeline_plan.h"
#include "pipeline_probe.h"
#include "trainer.h"
#include "util.h"

#define PIPE_MAX_WORKERS 64 /* pipelines x stages (job.lua checks it) */

/* W = R x S workers: worker w runs in pipeline w / S as the job's worker
 * w % S (its zone, its speed); pipeline 0's workers probe for all. */
typedef struct {
  int S, R, W;
  int lfd[PIPE_MAX_WORKERS], port[PIPE_MAX_WORKERS], ctl[PIPE_MAX_WORKERS], ctl_child[PIPE_MAX_WORKERS];
  pid_t pid[PIPE_MAX_WORKERS];
  int status[PIPE_MAX_WORKERS];
  int donor[PIPE_MAX_WORKERS];        /* a worker's donor port, once it said (0: none yet) */
  /* per pipeline: R reaches PIPE_MAX_WORKERS (stages = 1 with micro-batches is a pipeline job) */
  int lost[PIPE_MAX_WORKERS];          /* pipelines that lost a worker */
  int owed[PIPE_MAX_WORKERS];          /* lost, to be started again once a live pipeline's donors are known */
  int rebuilt[PIPE_MAX_WORKERS];       /* times each was started again */
  int threads;                         /* per worker */
  int64_t rebuilds;                    /* pipeline.rebuilds */
  int64_t resume;                      /* the step every stage loads (0: a fresh start) */
  char self[PATH_MAX];                 /* the transom executable */
  const char *dir;
  ftar_coord *coord[PIPE_MAX_STAGES]; /* R > 1: one FTAR group per stage */
  pipe_plan plan;
  int planned;
  int ckpt;                            /* the job takes checkpoints */
  int stopping;                        /* STOP sent (a signal): no pipeline is started again */
  int64_t stopped_at[PIPE_MAX_WORKERS]; /* the step a worker said it stopped after (0: none) */
  FILE *events;                        /* RUN/events.jsonl (NULL: `transom plan`) */
} launch;

/* One line of RUN/events.jsonl, as the operator writes them ("worker": -1,
 * the launcher's); nothing without the file. */
static void run_event(FILE *ev, int64_t step, const char *kind, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void run_event(FILE *ev, int64_t step, const char *kind, const char *fmt, ...) {
  if (!ev) return;
  char detail[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(detail, sizeof detail, fmt, ap);
  va_end(ap);
  tr_event_line(ev, step, -1, kind, detail);
}

/* SIGINT or SIGTERM to the launcher of a run (0: none yet): wait_all
 * tells the workers to stop. */
static volatile sig_atomic_t stop_signal;
static void on_stop(int sig) {
  if (!stop_signal) stop_signal = sig;
}

/* --- starting the workers --- */

/* Moves this thread into network namespace ns ("": stays); *back: where
 * it came from (for leave_netns; -1: nothing to undo). */
static int enter_netns(const char *ns, int *back) {
  *back = -1;
  if (!ns[0]) return TR_OK;
  char path[300];
  snprintf(path, sizeof path, "/run/netns/%s", ns);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return tr_fail(TR_EIO, "pipeline: network namespace '%s' (%s): %s", ns, path, strerror(errno));
  *back = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
  int rc = *back >= 0 && setns(fd, CLONE_NEWNET) == 0
               ? TR_OK
               : tr_fail(TR_EIO, "pipeline: cannot enter network namespace '%s': %s", ns, strerror(errno));
  close(fd);
  return rc;
}

static void leave_netns(int back) {
  if (back < 0) return;
  setns(back, CLONE_NEWNET);
  close(back);
}

/* A listening socket on loopback, or in namespace ns on all its addresses. */
static int listen_at(const char *ns, int *port) {
  int back, rc = enter_netns(ns, &back);
  if (rc) {
    leave_netns(back);
    return rc;
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(ns[0] ? INADDR_ANY : INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) || listen(fd, PIPE_MAX_STAGES) ||
      getsockname(fd, (struct sockaddr *)&a, &len)) {
    rc = tr_fail(TR_EIO, "pipeline: cannot listen%s%s: %s", ns[0] ? " in namespace " : " on loopback", ns,
                 strerror(errno));
    if (fd >= 0) close(fd);
  }
  leave_netns(back);
  if (rc) return rc;
  *port = ntohs(a.sin_port);
  return fd;
}

static pid_t spawn_worker(const launch *l, int w, int child_ctl, int rejoin) {
  pid_t parent = getpid(), pid = fork();
  if (pid != 0) return pid;
  prctl(PR_SET_PDEATHSIG, SIGTERM); /* a launcher killed with -9 takes its workers along */
  if (getppid() != parent) _exit(1); /* ok-exit: the launcher died before the line above */
  /* Ctrl-C reaches the whole process group: only the launcher acts on it
   * (it tells the stages to stop at a step they agree on); SIGTERM ends a
   * stage at once (stop_some), whatever the launcher inherited */
  signal(SIGINT, SIG_IGN);
  signal(SIGTERM, SIG_DFL);
  int back;
  if (enter_netns(l->plan.netns[w % l->S], &back)) {
    fprintf(stderr, "transom: pipeline worker %d: %s\n", w, tr_error());
    _exit(127); /* ok-exit: the child could not start */
  }
  char ws[16], fds[16], cfd[16], th[16], ports[16 * PIPE_MAX_WORKERS];
  snprintf(ws, sizeof ws, "%d", w);
  snprintf(fds, sizeof fds, "%d", l->lfd[w]);
  snprintf(cfd, sizeof cfd, "%d", child_ctl);
  snprintf(th, sizeof th, "%d", l->threads);
  size_t k = 0;
  for (int i = 0; i < l->W; i++) k += (size_t)snprintf(ports + k, sizeof ports - k, i ? ",%d" : "%d", l->port[i]);
  fcntl(l->lfd[w], F_SETFD, 0); /* these two stay open across exec */
  fcntl(child_ctl, F_SETFD, 0);
  execl(l->self, "transom", "stage", "--run", l->dir, "--worker", ws, "--listen-fd", fds, "--control-fd", cfd,
        "--ports", ports, "--threads", th, rejoin ? "--rejoin" : (char *)NULL, (char *)NULL);
  _exit(127); /* ok-exit: exec failed in the child */
}

static int threads_per_worker(const job_config *cfg, int S) {
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  int total = cfg->threads > 0 ? (int)cfg->threads : (int)(cores > 0 ? cores : 1);
  return total / S > 0 ? total / S : 1;
}

static void coord_log(void *ud, const char *msg) {
  fprintf(stderr, "pipeline stage %d's replicas: %s\n", (int)(intptr_t)ud, msg);
}

/* Worker w's listening socket and control socket pair (every worker of a
 * pipeline listens before any starts: each learns its neighbours' ports). */
static int open_worker(launch *l, int w) {
  int sv[2];
  if ((l->lfd[w] = listen_at(l->plan.netns[w % l->S], &l->port[w])) < 0) return l->lfd[w];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv)) {
    close(l->lfd[w]);
    l->lfd[w] = -1;
    return tr_fail(TR_EIO, "socketpair: %s", strerror(errno));
  }
  if (l->ctl[w] >= 0) close(l->ctl[w]);
  l->ctl[w] = sv[0];
  l->ctl_child[w] = sv[1];
  l->donor[w] = 0;
  return TR_OK;
}

/* Starts worker w (opened); its ends of the sockets stay with it alone. */
static int spawn(launch *l, int w, int rejoin) {
  l->pid[w] = spawn_worker(l, w, l->ctl_child[w], rejoin);
  close(l->ctl_child[w]);
  close(l->lfd[w]);
  l->ctl_child[w] = l->lfd[w] = -1;
  if (l->pid[w] > 0) return TR_OK;
  l->pid[w] = 0;
  return tr_fail(TR_EIO, "pipeline: fork: %s", strerror(errno));
}

static int start(lua_State *L, launch *l, const job_config *cfg) {
  int rc = pipe_plan_from_job(L, cfg, &l->plan); /* the workers' namespaces */
  if (rc) return rc;
  ssize_t sn = readlink("/proc/self/exe", l->self, sizeof l->self - 1);
  if (sn <= 0) return tr_fail(TR_EIO, "cannot find the transom executable");
  l->self[sn] = 0;
  l->threads = threads_per_worker(cfg, l->W);
  ftar_coord_opts co;
  ftar_coord_opts_default(&co);
  co.deadline = cfg->deadline;
  co.log = coord_log;
  for (int k = 0; l->R > 1 && k < l->S; k++)
    if ((co.log_ud = (void *)(intptr_t)k), !(l->coord[k] = ftar_coord_start("127.0.0.1", 0, &co)))
      return tr_fail_prefix(TR_EIO, "pipeline: cannot start stage %d's replica coordinator", k);
  for (int w = 0; w < l->W && !rc; w++) rc = open_worker(l, w);
  for (int w = 0; w < l->W && !rc; w++) rc = spawn(l, w, 0);
  return rc;
}

/* --- the plan --- */

/* The micro-batch graph the stages run, for the planner. */
static int plan_graph(lua_State *L, const job_config *cfg, trainer **t) {
  job_config c = *cfg;
  c.batch_size /= cfg->pipe_micro_batches;
  snprintf(c.device, sizeof c.device, "cpu");
  return (*t = trainer_create(L, &c)) ? TR_OK : TR_EINVAL;
}

/* Without probes: this host's FLOP/s on the graph (one timed forward and
 * backward after a warm-up), times each worker's emulated speed. */
static int nominal_speeds(trainer *t, pipe_plan *p) {
  graph *g = trainer_graph(t);
  int n = graph_norder(g), rc = TR_OK;
  graph_op_cost *c = malloc(sizeof *c * (size_t)n);
  if (!c || graph_stage_costs(g, c)) rc = tr_fail(TR_ENOMEM, "planning: out of memory");
  double flops = 0, dt = 0;
  for (int k = 0; k < n && !rc; k++) flops += c[k].flops;
  free(c);
  step_stats st;
  for (int round = 0; round < 2 && !rc; round++) {
    double t0 = tr_now();
    rc = trainer_compute_grads(t, &st);
    dt = tr_now() - t0;
  }
  for (int w = 0; w < p->S && !rc && dt > 0; w++) p->flops_s[w] = flops / dt * p->speed[w];
  return rc;
}

/* What a PLAN line tells stage k of AdaTopK's start (pipe_plan_adatopk_seed),
 * as " hide=S bw_prev=B bw_next=B" (take_plan in pipeline_main.c reads it). */
static void seed_text(const pipe_plan *p, int k, char *out, size_t n) {
  double hide, prev, next;
  pipe_plan_adatopk_seed(p, k, &hide, &prev, &next);
  snprintf(out, n, " hide=%.9g bw_prev=%.9g bw_next=%.9g", hide, prev, next);
}

/* PROBE lines in, the plan made and printed, PLAN lines out (or stop). */
static int plan_and_send(lua_State *L, launch *l, const job_config *cfg, int stop) {
  trainer *t = NULL;
  int rc = pipe_plan_from_job(L, cfg, &l->plan);
  if (!rc) rc = plan_graph(L, cfg, &t);
  char line[4096];
  for (int w = 0; w < l->W && !rc; w++) { /* one at a time: a probe has the host to itself */
    if (pipe_write_line(l->ctl[w], "GO\n")) rc = tr_fail_prefix(TR_EIO, "pipeline: cannot reach worker %d", w);
    else if ((rc = pipe_read_line(l->ctl[w], line, sizeof line, cfg->hang_seconds * 4)))
      rc = tr_fail_prefix(rc, "pipeline worker %d did not report its probes", w);
    else if (cfg->pipe_probe && w < l->S) rc = pipe_probe_parse(line, &l->plan); /* pipeline 0's */
  }
  l->plan.measured = cfg->pipe_probe;
  if (!rc && !cfg->pipe_probe) rc = nominal_speeds(t, &l->plan);
  if (!rc) rc = pipe_plan_make(L, trainer_graph(t), cfg, &l->plan);
  int saved = 0;
  if (!rc && l->resume) /* the stores fit the run's own cuts */
    rc = pipe_plan_restore(l->dir, &l->plan, graph_norder(trainer_graph(t)), &saved);
  if (!rc && saved) rc = pipe_plan_predict(trainer_graph(t), &l->plan); /* for those cuts (AdaTopK's start) */
  if (!rc && saved) {
    char first[4096];
    if (pipe_plan_line(first, sizeof first, &l->plan, 0) < 0) rc = TR_EINVAL;
    else printf("plan: the run's own, from %s/pipeline-plan (%.*s)\n", l->dir, (int)strcspn(first + 13, "\n"), first + 13);
  } else if (!rc) {
    pipe_plan_print(stdout, trainer_graph(t), &l->plan);
  }
  fflush(stdout);
  if (!rc && !stop && !saved) rc = pipe_plan_save(l->dir, &l->plan);
  l->planned = !rc;
  for (int i = 0; i < l->W && !rc; i++) {
    int p = i / l->S, k = i % l->S, w = p * l->S + l->plan.order[k]; /* pipeline p's stage k */
    char seed[128];
    seed_text(&l->plan, k, seed, sizeof seed);
    if (stop) snprintf(line, sizeof line, "PLAN stop\n");
    else if ((rc = pipe_plan_line(line, sizeof line - 256, &l->plan, k)) < 0) break;
    rc = TR_OK;
    if (!stop) snprintf(line + strlen(line) - 1, 256, " coord=%d resume=%lld%s\n",
                        l->coord[k] ? ftar_coord_port(l->coord[k]) : 0, (long long)l->resume, seed);
    if (pipe_write_line(l->ctl[w], line)) rc = tr_fail_prefix(TR_EIO, "pipeline: cannot reach worker %d", w);
  }
  trainer_free(t);
  return rc;
}

/* --- waiting and stopping --- */

/* Reaps the live workers of pipeline p (-1: all) within `grace` seconds,
 * then SIGTERM, 5 s, SIGKILL. */
static void stop_some(launch *l, int p, double grace) {
  int lo = p < 0 ? 0 : p * l->S, hi = p < 0 ? l->W : lo + l->S;
  for (int round = 0; round < 2; round++) {
    if (round == 1)
      for (int w = lo; w < hi; w++)
        if (l->pid[w] > 0) kill(l->pid[w], SIGTERM);
    double end = tr_now() + (round ? 5.0 : grace);
    for (int live = 1; live;) {
      live = 0;
      for (int w = lo; w < hi; w++)
        if (l->pid[w] > 0 && waitpid(l->pid[w], &l->status[w], WNOHANG) == l->pid[w]) l->pid[w] = 0;
        else if (l->pid[w] > 0) live++;
      if (!live) return;
      if (tr_now() > end) break;
      struct timespec ts = {0, 20 * 1000 * 1000};
      nanosleep(&ts, NULL);
    }
  }
  for (int w = lo; w < hi; w++)
    if (l->pid[w] > 0) {
      kill(l->pid[w], SIGKILL);
      waitpid(l->pid[w], &l->status[w], 0);
      l->pid[w] = 0;
    }
}

static int stage_of_worker(const launch *l, int w) {
  for (int k = 0; l->planned && k < l->S; k++)
    if (l->plan.order[k] == w % l->S) return k;
  return -1;
}

static int failed(int st) { return !WIFEXITED(st) || WEXITSTATUS(st) != 0; }

/* Why pipeline p (-1: any) failed: a worker killed by a signal (the cause;
 * its neighbours only lost their link), else the first that exited
 * non-zero. */
static int failure(const launch *l, int p) {
  int lo = p < 0 ? 0 : p * l->S, hi = p < 0 ? l->W : lo + l->S;
  for (int w = lo; w < hi; w++)
    if (WIFSIGNALED(l->status[w]) && WTERMSIG(l->status[w]) != SIGTERM)
      return tr_fail(TR_EIO, "pipeline stage %d (worker %d) was killed by signal %d", stage_of_worker(l, w), w,
                     WTERMSIG(l->status[w]));
  for (int w = lo; w < hi; w++)
    if (failed(l->status[w]))
      return tr_fail(TR_EIO, "pipeline stage %d (worker %d) exited with status %d", stage_of_worker(l, w), w,
                     WIFEXITED(l->status[w]) ? WEXITSTATUS(l->status[w]) : 128 + WTERMSIG(l->status[w]));
  return TR_OK;
}

/* --- rebuilding a lost pipeline --- */

/* 1 if worker pid has ended but is not reaped yet (looked at, left for
 * wait_all to reap). */
static int ended(pid_t pid) {
  siginfo_t si;
  memset(&si, 0, sizeof si);
  return waitid(P_PID, (id_t)pid, &si, WEXITED | WNOHANG | WNOWAIT) == 0 && si.si_pid == pid;
}

/* A live pipeline other than p whose every worker told its donor's port
 * (-1: none). A worker that ended and waits to be reaped is not live: two
 * pipelines lost at once do not serve each other. */
static int donor_pipeline(const launch *l, int p) {
  for (int q = 0; q < l->R; q++) {
    int ok = q != p && !l->lost[q];
    for (int w = q * l->S; w < (q + 1) * l->S && ok; w++) ok = l->pid[w] > 0 && l->donor[w] > 0 && !ended(l->pid[w]);
    if (ok) return q;
  }
  return -1;
}

/* 1 if a pipeline other than p runs whole but has not told every donor
 * port yet (its workers starting, or rebuilt and not yet in its groups). */
static int donor_pending(const launch *l, int p) {
  for (int q = 0; q < l->R; q++) {
    int ok = q != p && !l->lost[q];
    for (int w = q * l->S; w < (q + 1) * l->S && ok; w++) ok = l->pid[w] > 0 && !ended(l->pid[w]);
    if (ok) return 1;
  }
  return 0;
}

/* Starts pipeline p's workers again (--rejoin): the plan as before, the
 * replicas' coordinator, and the same stage of pipeline q as the donor. */
static int rebuild(launch *l, int p) {
  int q = donor_pipeline(l, p), rc = TR_OK;
  if (q < 0) return tr_fail(TR_ESTATE, "no live pipeline to catch up from");
  l->rebuilt[p]++;
  for (int w = p * l->S; w < (p + 1) * l->S && !rc; w++) rc = open_worker(l, w);
  for (int w = p * l->S; w < (p + 1) * l->S && !rc; w++) rc = spawn(l, w, 1);
  char line[4096];
  for (int k = 0; k < l->S && !rc; k++) {
    int w = p * l->S + l->plan.order[k], d = q * l->S + l->plan.order[k];
    int len = pipe_plan_line(line, sizeof line - 256, &l->plan, k);
    if (len < 0) {
      rc = len;
      break;
    }
    char seed[128];
    seed_text(&l->plan, k, seed, sizeof seed);
    snprintf(line + strlen(line) - 1, 256, " coord=%d donor=%d attempt=%d%s\n", ftar_coord_port(l->coord[k]),
             l->donor[d], l->rebuilt[p], seed);
    if ((rc = pipe_write_line(l->ctl[w], line))) rc = tr_fail_prefix(rc, "pipeline: cannot reach worker %d", w);
  }
  if (rc) {
    stop_some(l, p, 0.0);
    for (int w = p * l->S; w < (p + 1) * l->S; w++) { /* opened, never started */
      if (l->lfd[w] >= 0) close(l->lfd[w]);
      if (l->ctl_child[w] >= 0) close(l->ctl_child[w]);
      l->lfd[w] = l->ctl_child[w] = -1;
    }
    return rc;
  }
  l->lost[p] = 0;
  printf("pipeline %d: started again (%d of %lld); its workers catch up from pipeline %d\n", p, l->rebuilt[p],
         (long long)l->rebuilds, q);
  run_event(l->events, -1, "pipeline_rebuilt", "pipeline %d: started again (%d of %lld); its workers catch up from "
            "pipeline %d", p, l->rebuilt[p], (long long)l->rebuilds, q);
  return TR_OK;
}

/* --- waiting --- */

/* Pipeline p stays lost: a line on stdout and in RUN/events.jsonl. */
static void not_rebuilt(launch *l, int p, const char *why) {
  printf("pipeline %d: not started again: %s\n", p, why);
  run_event(l->events, -1, "pipeline_not_rebuilt", "pipeline %d: not started again: %s", p, why);
}

/* One line from worker w: its donor's port, or (a rebuilt pipeline's
 * first stage) the step it entered at. A closed socket is closed here. */
static void read_control(launch *l, int w) {
  char line[256];
  const char *v;
  if (pipe_read_line(l->ctl[w], line, sizeof line, 1.0)) {
    close(l->ctl[w]);
    l->ctl[w] = -1;
  } else if (strncmp(line, "DONOR ", 6) == 0 && (v = strstr(line, "port="))) {
    l->donor[w] = atoi(v + 5);
  } else if (strncmp(line, "STOPPED ", 8) == 0 && (v = strstr(line, "step="))) {
    l->stopped_at[w] = atoll(v + 5);
  } else if (strncmp(line, "JOINED ", 7) == 0 && (v = strstr(line, "step=")) && w % l->S == l->plan.order[0]) {
    int alive = 0;
    for (int q = 0; q < l->R; q++) alive += !l->lost[q];
    printf("pipeline %d rejoined at step %lld: %d pipelines train\n", w / l->S, (long long)atoll(v + 5), alive);
    fflush(stdout);
    run_event(l->events, atoll(v + 5), "pipeline_rejoined", "pipeline %d rejoined at step %lld: %d pipelines train",
              w / l->S, (long long)atoll(v + 5), alive);
  }
}

/* Worker pid ended with st. 1: the run is over (its only pipeline failed,
 * or every pipeline is lost). Several pipelines: a failure stops that one,
 * the others train on, and it is started again if rebuilds are left. */
static int reaped(launch *l, pid_t pid, int st) {
  int w = 0;
  while (w < l->W && l->pid[w] != pid) w++;
  if (w == l->W) return 0;
  l->pid[w] = 0;
  l->status[w] = st;
  int p = w / l->S, alive = 0;
  if (!failed(st) || l->lost[p]) return 0;
  l->lost[p] = 1;
  for (int q = 0; q < l->R; q++) alive += !l->lost[q];
  if (!alive || l->R == 1) return 1;
  stop_some(l, p, 1.0);
  failure(l, p);
  printf("pipeline %d lost: %s; the other %d pipeline(s) train on\n", p, tr_error(), alive);
  run_event(l->events, -1, "pipeline_lost", "pipeline %d lost: %s; the other %d pipeline(s) train on", p, tr_error(),
            alive);
  if (l->stopping) not_rebuilt(l, p, "the run is stopping");
  else if (WIFEXITED(st) && WEXITSTATUS(st) == PIPE_EXIT_LATE)
    not_rebuilt(l, p, "the live pipelines end before it could enter");
  else if (l->rebuilt[p] >= l->rebuilds) {
    printf("pipeline %d: not started again (pipeline.rebuilds = %lld)\n", p, (long long)l->rebuilds);
    run_event(l->events, -1, "pipeline_not_rebuilt", "pipeline %d: not started again (pipeline.rebuilds = %lld)", p,
              (long long)l->rebuilds);
  } else if (donor_pipeline(l, p) < 0 && donor_pending(l, p)) {
    l->owed[p] = 1;
    printf("pipeline %d: started again once a live pipeline's donors are known\n", p);
  } else if (rebuild(l, p)) not_rebuilt(l, p, tr_error());
  fflush(stdout);
  return 0;
}

/* The lost pipelines owed a rebuild whose donors are now known. */
static void rebuild_owed(launch *l) {
  for (int p = 0; p < l->R; p++)
    if (l->owed[p] && l->stopping) {
      l->owed[p] = 0;
      not_rebuilt(l, p, "the run is stopping");
      fflush(stdout);
    } else if (l->owed[p] && l->lost[p] && donor_pipeline(l, p) >= 0) {
      l->owed[p] = 0;
      if (rebuild(l, p)) not_rebuilt(l, p, tr_error());
      fflush(stdout);
    }
}

/* A stop signal came: every live worker is told STOP (the stages agree
 * on the step themselves). One that cannot be told is gone already: its
 * pipeline is lost as any other. */
static void ask_stop(launch *l) {
  l->stopping = 1;
  printf("stopping (%s): every stage finishes the same step%s\n", stop_signal == SIGINT ? "SIGINT" : "SIGTERM",
         l->ckpt ? " and checkpoints it" : " (checkpoints are off)");
  fflush(stdout);
  for (int w = 0; w < l->W; w++)
    if (l->pid[w] > 0 && l->ctl[w] >= 0) (void)pipe_write_line(l->ctl[w], "STOP\n");
}

/* Waits for every worker, reading their control lines meanwhile. */
static void wait_all(launch *l) {
  for (;;) {
    if (stop_signal && !l->stopping) ask_stop(l);
    struct pollfd pf[PIPE_MAX_WORKERS];
    int who[PIPE_MAX_WORKERS], n = 0, live = 0, st;
    for (int w = 0; w < l->W; w++)
      if (l->ctl[w] >= 0) {
        pf[n] = (struct pollfd){.fd = l->ctl[w], .events = POLLIN};
        who[n++] = w;
      }
    if (poll(pf, (nfds_t)n, 100) > 0)
      for (int i = 0; i < n; i++)
        if (pf[i].revents) read_control(l, who[i]);
    rebuild_owed(l);
    pid_t pid;
    while ((pid = waitpid(-1, &st, WNOHANG)) > 0)
      if (reaped(l, pid, st)) return;
    for (int w = 0; w < l->W; w++) live += l->pid[w] > 0;
    if (!live) return;
  }
}

/* The lines the workers wrote before they exited (a STOPPED line comes
 * just before the exit, perhaps after wait_all's last read). */
static void drain_control(launch *l) {
  for (int w = 0; w < l->W; w++)
    while (l->ctl[w] >= 0) read_control(l, w);
}

/* After a stop: the step the stages stopped after, and what a --resume
 * takes (the newest step every store committed). Nothing when no worker
 * said it stopped (the run reached max_steps first). */
static void report_stop(const launch *l) {
  int64_t at = 0, common = 0;
  const char *sig = stop_signal == SIGINT ? "SIGINT" : "SIGTERM";
  for (int w = 0; w < l->W; w++)
    if (l->stopped_at[w] > at) at = l->stopped_at[w];
  if (at == 0) return;
  if (!l->ckpt) {
    printf("stopped at step %lld (checkpoints are off: nothing to resume from)\n", (long long)at);
    run_event(l->events, at, "stopped", "%s: every stage stopped after step %lld (checkpoints are off)", sig,
              (long long)at);
  } else if (pipe_ckpt_common_step(l->dir, l->S, &common)) {
    printf("stopped at step %lld; its checkpoint stores cannot be read: %s\n", (long long)at, tr_error());
    run_event(l->events, at, "stopped", "%s: every stage stopped after step %lld; the checkpoint stores cannot be "
              "read: %s", sig, (long long)at, tr_error());
  } else if (common == at) {
    printf("stopped at step %lld (checkpointed); resume with: transom run --resume %s\n", (long long)at, l->dir);
    run_event(l->events, at, "stopped", "%s: every stage stopped after step %lld and checkpointed it", sig,
              (long long)at);
  } else {
    printf("stopped at step %lld; the newest step every stage committed is %lld; resume with: transom run --resume "
           "%s\n", (long long)at, (long long)common, l->dir);
    run_event(l->events, at, "stopped", "%s: stopped after step %lld; the newest step every stage committed is %lld",
              sig, (long long)at, (long long)common);
  }
  fflush(stdout);
}

/* *stopped (may be NULL): 1 when the run ended by a stop signal before max_steps. */
static int launch_run(lua_State *L, const job_config *cfg, const char *dir, int stop, int64_t resume,
                      FILE *events, int *stopped) {
  launch l = {.S = (int)cfg->pipe_stages, .R = cfg->replicas > 1 ? (int)cfg->replicas : 1, .dir = dir,
              .rebuilds = cfg->pipe_rebuilds, .resume = resume, .events = events,
              .ckpt = cfg->ckpt_every_steps > 0 || cfg->ckpt_every_seconds > 0};
  l.W = l.S * l.R;
  if (l.W > PIPE_MAX_WORKERS) return tr_fail(TR_EINVAL, "pipeline: %d workers (at most %d)", l.W, PIPE_MAX_WORKERS);
  for (int w = 0; w < l.W; w++) l.lfd[w] = l.ctl[w] = l.ctl_child[w] = -1;
  int rc = start(L, &l, cfg);
  for (int w = 0; w < l.W; w++) {
    if (l.lfd[w] >= 0) close(l.lfd[w]);
    if (l.ctl_child[w] >= 0) close(l.ctl_child[w]);
  }
  if (!rc) rc = plan_and_send(L, &l, cfg, stop);
  if (!rc) wait_all(&l);
  stop_some(&l, -1, rc ? 0.0 : 1.0);
  if (!rc) drain_control(&l); /* not after an error: its reads would replace tr_error() */
  for (int w = 0; w < l.W; w++)
    if (l.ctl[w] >= 0) close(l.ctl[w]);
  for (int k = 0; k < l.S; k++) ftar_coord_free(l.coord[k]);
  if (rc) return rc;
  for (int p = 0; p < l.R; p++) /* done when a pipeline finished whole */
    if (!failure(&l, p)) {
      int64_t at = 0;
      int whole = 0;
      for (int w = 0; w < l.W; w++) at = l.stopped_at[w] > at ? l.stopped_at[w] : at;
      for (int q = 0; q < l.R; q++) whole += !failure(&l, q);
      if (stopped) *stopped = at > 0;
      if (at) report_stop(&l);
      else run_event(events, cfg->max_steps, "finished", "every stage of %d of %d pipeline(s) finished step %lld; "
                     "stage 0 saved the weights", whole, l.R, (long long)cfg->max_steps);
      return TR_OK;
    }
  return failure(&l, -1);
}

/* --resume, before anything is written (pipeline.h): the checks and the
 * step, from pipe_ckpt_resume_check. */
int pipeline_resume_check(const job_config *cfg, const char *dir, pipeline_resume *r) {
  memset(r, 0, sizeof *r);
  return pipe_ckpt_resume_check(dir, (int)cfg->pipe_stages, &r->step, &r->start_over);
}

/* What the checks decided: the records after the step are dropped (the
 * run does those steps again), or, starting over, the stores of the run
 * abandoned are set aside. */
static int resume_apply(const job_config *cfg, const char *dir, const pipeline_resume *r, FILE *ev) {
  int rc = TR_OK, n = 0;
  if (r->step == 0 && r->start_over) rc = pipe_ckpt_set_aside(dir, (int)cfg->pipe_stages, &n);
  if (!rc && r->step == 0) {
    printf("resume: no step committed by every stage in %s/ckpt-stage-*: starting from step 0\n", dir);
    run_event(ev, 0, "resume", "no step committed by every stage in %s/ckpt-stage-*: starting from step 0", dir);
  }
  if (!rc && r->step > 0) rc = pipe_ckpt_truncate_records(dir, r->step, &n);
  if (!rc && r->step > 0) {
    printf("resumed from step %lld (the newest checkpoint every stage committed; %d record line(s) after it "
           "dropped)\n", (long long)r->step, n);
    run_event(ev, r->step, "resume", "resumed from the checkpoint of step %lld, the newest every stage committed; "
              "%d record line(s) after it dropped", (long long)r->step, n);
  }
  return rc;
}

int pipeline_run(lua_State *L, const job_config *cfg, const char *dir, const pipeline_resume *resume, int *stopped) {
  *stopped = 0;
  printf("pipeline: %lld stage(s)%s, %lld micro-batch(es) of %lld sequences, 1F1B over TCP%s\n",
         (long long)cfg->pipe_stages, cfg->replicas > 1 ? " x replicas" : "", (long long)cfg->pipe_micro_batches,
         (long long)(cfg->batch_size / cfg->pipe_micro_batches),
         strcmp(cfg->pipe_compression, "adatopk") == 0 ? ", AdaTopK" : "");
  if (cfg->ckpt_every_steps > 0 || cfg->ckpt_every_seconds > 0)
    printf("pipeline: checkpoints in %s/ckpt-stage-0..%lld, one store per stage\n", dir,
           (long long)cfg->pipe_stages - 1);
  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/events.jsonl", dir);
  FILE *ev = fopen(path, "a");
  if (!ev) return tr_fail(TR_EIO, "cannot open %s: %s", path, strerror(errno));
  tr_log_reserve(ev);
  int rc = resume ? resume_apply(cfg, dir, resume, ev) : TR_OK;
  if (!resume)
    run_event(ev, 0, "start", "%lld stage(s) x %d pipeline(s), %lld micro-batch(es)", (long long)cfg->pipe_stages,
              cfg->replicas > 1 ? (int)cfg->replicas : 1, (long long)cfg->pipe_micro_batches);
  fflush(stdout);
  /* set here, not inherited: a job started in the background by a script
   * has SIGINT ignored */
  struct sigaction sa = {.sa_handler = on_stop, .sa_flags = SA_RESTART};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  if (!rc) rc = launch_run(L, cfg, dir, 0, resume ? resume->step : 0, ev, stopped);
  fclose(ev);
  return rc;
}

/* --- transom plan --- */

static const char plan_usage[] =
    "usage: transom plan JOB.lua [--set key=value]...\n"
    "\n"
    "Prints the pipeline plan of the job (pipeline = {...}): the workers' speeds and links as the\n"
    "probes measure them (pipeline.probe = true: one worker process per stage, as `transom run`\n"
    "starts them, with the job's emulated speeds and links), the bandwidth clusters, which worker\n"
    "runs which stage and which ops, the predicted time per stage and the bytes per link per step.\n";

int pipeline_plan_main(int argc, char **argv) {
  static const char *const value_flags[] = {"--set", NULL};
  const char *job = NULL, *sets[64];
  int nsets = 0;
  for (int i = 0; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) return fputs(plan_usage, stdout), 0;
    if (tr_flag_lacks_value(argc, argv, i, value_flags))
      return fprintf(stderr, "transom plan: %s needs a value (see transom plan --help)\n", argv[i]), 2;
    if (strcmp(argv[i], "--set") == 0 && nsets == 64)
      return fprintf(stderr, "transom plan: at most 64 --set\n"), 2;
    if (strcmp(argv[i], "--set") == 0) sets[nsets++] = argv[++i];
    else if (argv[i][0] != '-' && !job) job = argv[i];
    else return fprintf(stderr, "transom: plan: unknown argument '%s'\n%s", argv[i], plan_usage), 2;
  }
  if (!job) return fputs(plan_usage, stderr), 2;
  lua_State *L = lua_host_new();
  job_config cfg;
  char dir[] = "/tmp/transom-plan-XXXXXX", path[64];
  int rc = L ? job_load(L, job, sets, nsets, &cfg) : TR_ENOMEM;
  char *dump = rc ? NULL : job_dump(L, &cfg);
  if (!rc && !dump) rc = TR_EINVAL; /* job_dump's reason (a path too long once absolute) stays tr_error() */
  else if (!rc && !mkdtemp(dir)) rc = tr_fail(TR_EIO, "plan: cannot prepare a scratch directory: %s", strerror(errno));
  if (!rc) {
    snprintf(path, sizeof path, "%s/job.lua", dir);
    rc = tr_write_file_atomic(path, dump, strlen(dump));
  }
  if (!rc) rc = launch_run(L, &cfg, dir, 1, 0, NULL, NULL);
  if (dump && dir[strlen(dir) - 1] != 'X') {
    remove(path);
    rmdir(dir);
  }
  free(dump);
  if (rc) fprintf(stderr, "transom: %s\n", tr_error());
  lua_host_close(L);
  return rc ? 2 : 0;
}
