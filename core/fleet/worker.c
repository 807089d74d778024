/* worker.c — `transom worker`: one data-parallel replica.
 *
 * Started by the operator (operator.c) or by an external launcher. It
 * connects to the operator, learns the run directory and the FTAR
 * coordinator, builds its trainer (its own data stream: slot), gets its
 * state (fresh, from the newest checkpoint, or from a donor peer while the
 * others keep training), and runs the one training loop (core/train/loop.c)
 * with hooks: the operator's commands, chaos, the FTAR all-reduce (mean) as
 * the exchange, the donor's step boundary, and STEP/EVAL/CKPT lines to the
 * operator.
 *
 * The operator can die: when its connection drops, the replica keeps its
 * state and pauses at its next step boundary; the heartbeat thread (the
 * link thread) looks for a restarted operator (RUN/operator.addr, or
 * MASTER_ADDR/MASTER_PORT under an external launcher) for operator_grace
 * seconds, says HELLO live=1 with its step, re-registers FTAR with the new
 * coordinator and replays its last STEP lines (the operator keeps the ones
 * it lacks); then training goes on. No operator in time: exit status 4,
 * no checkpoint (the newest committed one stays). Sends to the operator are
 * bounded (bound_sends): one it takes nothing of for operator_grace seconds
 * (its host gone silent, or stopped that long) fails, and is the link lost
 * like a closed connection; a shorter stall only pauses the sender. A
 * restarted operator (RUN/operator.addr written anew) ends the link to the
 * old one at once, however alive that looks (a send blocked on it, its
 * buffers still taking bytes): the worker goes to the new one while its
 * adoption window is open (lock_link).
 *
 * The replica with the lowest slot among the contributors of a step is the
 * leader: the only one that writes checkpoints (all replicas hold the same
 * bits). Identity is the slot and the run, never the PID or rank order.
 *
 *   transom worker --operator HOST:PORT --slot K [--threads N]
 *   RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (torchrun) or SLURM_PROCID/
 *   SLURM_NTASKS (srun) stand in for --slot and --operator.
 */
#define _GNU_SOURCE /* POLLRDHUP */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "auth.h"
#include "backend.h"
#include "ckpt.h"
#include "donor.h"
#include "ftar.h"
#include "job.h"
#include "loop.h"
#include "lua_host.h"
#include "proto.h"
#include "step_record.h"
#include "trainer.h"
#include "util.h"

int worker_main(int argc, char **argv);

#define MAX_CHAOS 64
/* STEP lines kept to replay to a restarted operator (the operator drops
 * those metrics.jsonl holds): about 1 MB, more than a stalled operator's
 * socket buffers took before it was replaced (16 lost the steps trained
 * meanwhile from metrics.jsonl). */
#define REPLAY 2048

typedef struct {
  int64_t at; /* the step it fires at; 0: the next one (`transom chaos`) */
  char fault[8];
  int64_t ms, steps;
} chaos;

typedef struct {
  int slot, threads;
  char op_host[256];
  int op_port;
  int opfd;
  proto_reader rd;
  chaos chaos[MAX_CHAOS];
  int nchaos;
  int64_t stop_at; /* finish this step, then stop (0 = no stop asked) */
  int stop_lead;   /* the STOP's lead=: the lowest live slot as the operator stopped (-1: not said) */
  int stop_paused; /* the stop came while the group waited below min_replicas: the step is called off */
  int called_off;  /* a collective came back FTAR_ECANCELED: the group wound down */
  int held_stop;   /* TRANSOM_TEST_LATE_STOP: a STOP held until called_off (held_at, held_lead) */
  int64_t held_at;
  int held_lead;
  int ckpt_now;    /* the operator asked for a checkpoint */
  trainer *t;
  const job_config *cfg;
  ftar_member *fm;
  donor *dn;
  int donor_fd;    /* >= 0 while catching up from a donor */
  pthread_mutex_t send_mu; /* the training and heartbeat threads both write to opfd; guards the link below */
  pthread_cond_t link_cv;  /* the link came back, or the grace ran out */
  int down, gone;          /* the operator connection dropped; no operator came back within the grace */
  double down_since;
  int addr_from_env;       /* MASTER_ADDR/MASTER_PORT: a restarted operator is there too */
  char run[1024];          /* the run directory (RUN/operator.addr) */
  /* opfd and op_nonce change under send_mu and id_mu both; a thread waiting
   * for send_mu reads them under id_mu alone (lock_link) */
  pthread_mutex_t id_mu;
  char file_nonce[64];     /* RUN/operator.addr's nonce when we linked (a stale copy of the file, or the dead
                            * operator's not yet rewritten, is no newer operator) */
  char op_nonce[64];       /* the nonce of the operator we are linked to (its WELCOME's; RUN/operator.addr's second
                            * line names the newest operator's; "": unknown, and a worker that does not see RUN
                            * learns of a restart only when its link fails) */
  atomic_int superseded;   /* a restarted operator was seen: the link to the old one is shut down */
  char me_donor[300];      /* our donor service, host:port, for HELLO live=1 */
  volatile int64_t cur_step; /* the latest step reported (the link thread's HELLO) */
  char **replay;           /* the last REPLAY STEP lines, a ring (malloc'd; NULL: none, or no memory) */
  int64_t *replay_step;    /* and their steps */
  int nreplay;
  pthread_t hb;
  atomic_int hb_stop;
  /* the training thread's phase, for the heartbeat: both under send_mu, so
   * that a heartbeat never pairs one phase with the other's start */
  int in_allreduce;
  double phase_since; /* tr_now() when it entered that phase */
  int64_t slow_until, slow_ms, nan_until;
  int64_t fail_at, fail_ms; /* chaos fail: the step that fails, the error path's extra time */
  int pad_ms; /* TRANSOM_TEST_STEP_MS: every step sleeps this long first (soak tests) */
  auth_secret secret; /* the job's: TRANSOM_SECRET / TRANSOM_SECRET_FILE (the operator or agent sets it) */
  int inflight; /* a bucketed all-reduce of this step runs on FTAR's communication thread */
} worker;

static const char usage[] =
    "usage: transom worker --operator HOST:PORT --slot K [--threads N]\n"
    "\n"
    "One replica of a `transom run` job; the operator starts these itself.\n"
    "Exit status: 0 done, 1 failed, 2 a start-up error that would repeat on\n"
    "every try (the job, its data, its checkpoint), 3 evicted, 4 the operator\n"
    "was lost and none came back within operator_grace seconds.\n"
    "Under an external launcher, torchrun's RANK/MASTER_ADDR/MASTER_PORT or\n"
    "Slurm's SLURM_PROCID (with MASTER_ADDR/MASTER_PORT set to the operator)\n"
    "stand in for --slot and --operator.\n";

static const char *env_any(const char *a, const char *b) {
  const char *v = getenv(a);
  if (v && *v) return v;
  v = b ? getenv(b) : NULL;
  return v && *v ? v : NULL;
}

#define SUPERSEDED "RUN/operator.addr names a restarted operator"

/* The link is down (send_mu held): the training thread pauses at its next
 * step boundary, the link thread looks for a restarted operator. why: what
 * ended it, for the log. */
static void link_down(worker *w, const char *why) {
  if (w->down) return;
  w->down = 1;
  w->down_since = tr_now();
  fprintf(stderr, "worker %d: lost the operator at step %lld (%s); waiting up to %.0f s for a restarted one\n",
          w->slot, (long long)w->cur_step, w->superseded ? SUPERSEDED : why, w->cfg ? w->cfg->operator_grace : 0.0);
  fflush(stderr);
}

/* --- a restarted operator --- */

/* Has an operator started since the one we are linked to? Its
 * RUN/operator.addr replaced ours. A missing file says nothing (a tmp
 * cleaner, a user); one an ended operator rewrote as "ended" names no
 * address to follow: the worker waits for a new operator as it would
 * without the file (proto.c refuses "ended" as an address). send_mu or
 * id_mu held. */
static int operator_replaced(const worker *w) {
  char addr[300], nonce[64];
  if (!w->op_nonce[0] || opaddr_read_nonce(w->run, addr, sizeof addr, nonce, sizeof nonce)) return 0;
  return nonce[0] && strcmp(nonce, w->op_nonce) != 0 && strcmp(nonce, w->file_nonce) != 0;
}

/* The nonce RUN/operator.addr holds now ("" when none): what it says as we
 * link is not news of a newer operator (operator_replaced). */
static void note_file_nonce(worker *w) {
  char addr[300];
  if (opaddr_read_nonce(w->run, addr, sizeof addr, w->file_nonce, sizeof w->file_nonce)) w->file_nonce[0] = 0;
}

/* Ends the link to an operator a restarted one replaced: shut down, a send
 * blocked on it fails now (and the old operator sees us go). id_mu held. */
static void supersede(worker *w) {
  if (w->superseded) return;
  w->superseded = 1;
  shutdown(w->opfd, SHUT_RDWR);
}

/* How often a thread waiting for send_mu looks at RUN/operator.addr. */
#define LINK_LOOK_MS 250

/* Takes send_mu, for any thread. Sends block (bounded by operator_grace,
 * bound_sends) holding it: one blocked on an operator that takes nothing
 * (stopped, hung, its host silent) would keep every other thread here for
 * the whole grace. So the waiters look at RUN/operator.addr meanwhile, and a
 * restarted operator's ends the old link at once. (Before, the worker came
 * back only when the send timed out, long after the new operator's adoption
 * window (2 s): it had started a replacement in the slot, refused the
 * worker, and the worker exited 4 after another grace.) */
static void lock_link(worker *w) {
  for (;;) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += LINK_LOOK_MS * 1000000L;
    until.tv_sec += until.tv_nsec / 1000000000L;
    until.tv_nsec %= 1000000000L;
    if (pthread_mutex_timedlock(&w->send_mu, &until) == 0) return;
    pthread_mutex_lock(&w->id_mu);
    if (operator_replaced(w)) supersede(w);
    pthread_mutex_unlock(&w->id_mu);
  }
}

/* One line to the operator, from either thread. While the link is down
 * nothing is sent (and nothing fails: the replay covers STEP lines). */
#define SEND(w, ...)                                          \
  ({                                                          \
    lock_link(w);                                             \
    int rc_ = (w)->down ? 0 : proto_send((w)->opfd, __VA_ARGS__); \
    if (rc_ && (w)->cfg) { /* once running: a dead operator is waited for */ \
      link_down((w), tr_error());                             \
      rc_ = 0;                                                \
    }                                                         \
    pthread_mutex_unlock(&(w)->send_mu);                      \
    rc_;                                                      \
  })

/* Where a restarted operator listens: MASTER_ADDR/MASTER_PORT under an
 * external launcher, else RUN/operator.addr (written by every operator),
 * else (RUN not on this host: an agent's worker with no shared file
 * system, or the file gone or "ended") --operator's address, where a
 * restarted operator with the same MASTER_PORT listens again. */
static void operator_addr(const worker *w, char *host, size_t n, int *port) {
  char text[300], nonce[64];
  if (!w->addr_from_env && opaddr_read_nonce(w->run, text, sizeof text, nonce, sizeof nonce) == 0 &&
      net_split(text, host, n, port) == 0)
    return;
  snprintf(host, n, "%s", w->op_host);
  *port = w->op_port;
}

/* A send on the operator's connection fd fails once the operator has taken
 * none of its bytes for operator_grace seconds: unacknowledged (its host
 * died silently) or refused by a closed window (it stopped reading) past
 * TCP_USER_TIMEOUT (the connection is aborted), or no room made within
 * SO_SNDTIMEO. The agent gives up on its operator after the same grace.
 * Without them a send could block ~15 minutes (the kernel's retransmissions)
 * holding send_mu, the heartbeat thread waiting behind it. */
static void bound_sends(const worker *w, int fd) {
  double g = w->cfg->operator_grace;
  unsigned ms = g * 1e3 < (double)UINT_MAX ? (unsigned)(g * 1e3) : UINT_MAX;
  struct timeval tv = {(time_t)g, (suseconds_t)((g - (double)(time_t)g) * 1e6)};
  if (setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof ms) != 0 ||
      setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0)
    fprintf(stderr, "worker %d: sends to the operator are not bounded: %s\n", w->slot, strerror(errno));
}

static void agent_words(char *out, size_t n);

/* Our STEP lines after step `logged` (what RUN/metrics.jsonl holds for us,
 * the restarted operator's WELCOME says), oldest first (send_mu held). A
 * failed send is the link lost again: the lines stay for the next one. */
static void replay_steps(worker *w, int64_t logged) {
  int n = w->nreplay < REPLAY ? w->nreplay : REPLAY;
  for (int i = w->nreplay - n; i < w->nreplay; i++) {
    const char *line = w->replay[i % REPLAY];
    if (!line || w->replay_step[i % REPLAY] <= logged) continue;
    if (proto_send(w->opfd, "%s", line)) {
      link_down(w, tr_error());
      return;
    }
  }
}

/* One try at a restarted operator: HELLO live=1 with our step, its WELCOME
 * (the new coordinator), FTAR re-registered, then the link swapped in and
 * our last STEP lines replayed before any new one. 0 when back. */
static int link_try(worker *w) {
  char host[256], line[PROTO_LINE_MAX], coord[300], ch[256];
  int port, cp;
  operator_addr(w, host, sizeof host, &port);
  int fd = net_connect(host, port, 1.0);
  if (fd < 0) return -1;
  bound_sends(w, fd);
  fprintf(stderr, "worker %d: trying the operator at %s:%d\n", w->slot, host, port);
  char me[256];
  gethostname(me, sizeof me);
  proto_reader rd = {.fd = fd};
  if (auth_client(fd, &w->secret, 3.0)) goto fail;
  char by[128];
  agent_words(by, sizeof by);
  if (proto_send(fd, "HELLO slot=%d pid=%d host=%s live=1 step=%lld donor=%s%s", w->slot, (int)getpid(), me,
                 (long long)w->cur_step, w->me_donor[0] ? w->me_donor : "-", by))
    goto fail;
  for (;;) {
    if (proto_read(&rd, line, sizeof line, 3000) <= 0) goto fail; /* a listener nobody accepts on: a dead one */
    if (proto_is(line, "WELCOME")) break;
    if (proto_is(line, "REFUSE")) {
      fprintf(stderr, "worker %d: the operator at %s:%d refused us: %s\n", w->slot, host, port, line);
      goto fail;
    }
  }
  proto_get(line, "coord", coord, sizeof coord);
  if (net_split(coord, ch, sizeof ch, &cp) || (w->fm && ftar_member_reconnect(w->fm, ch, cp, 10.0))) {
    fprintf(stderr, "worker %d: the restarted operator's coordinator %s: %s\n", w->slot, coord, tr_error());
    goto fail;
  }
  lock_link(w);
  pthread_mutex_lock(&w->id_mu);
  if (w->opfd >= 0) close(w->opfd);
  w->opfd = fd;
  /* its own nonce, from its WELCOME: not the file read before we
   * connected, which may still have named the dead one (a restarted
   * operator listens before it writes the file) */
  proto_get(line, "nonce", w->op_nonce, sizeof w->op_nonce);
  note_file_nonce(w);
  w->superseded = 0;
  pthread_mutex_unlock(&w->id_mu);
  w->rd = rd; /* with whatever came after the WELCOME */
  w->down = 0;
  replay_steps(w, proto_int(line, "logged", -1));
  pthread_cond_broadcast(&w->link_cv);
  pthread_mutex_unlock(&w->send_mu);
  fprintf(stderr, "worker %d: adopted by the operator at %s:%d at step %lld\n", w->slot, host, port,
          (long long)w->cur_step);
  fflush(stderr);
  return 0;
fail:
  close(fd);
  return -1;
}

/* The training thread enters a phase (1: the all-reduce, 0: compute). */
static void set_phase(worker *w, int in_allreduce) {
  lock_link(w);
  w->phase_since = tr_now();
  w->in_allreduce = in_allreduce;
  pthread_mutex_unlock(&w->send_mu);
}

/* Liveness, apart from progress: a hung training thread still heartbeats
 * (the detector's "hang"), a stopped or dead process does not ("dead").
 * Also the link's keeper: it notices a dead operator (a hang-up on the
 * connection) and looks for a restarted one while the grace lasts. */
static void *heartbeat_main(void *arg) {
  worker *w = arg;
  while (!w->hb_stop) {
    lock_link(w);
    int down = w->down;
    if (!down) {
      struct pollfd p = {.fd = w->opfd, .events = POLLRDHUP};
      if (poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
        link_down(w, "its connection closed"), down = 1;
      } else if (operator_replaced(w)) { /* the old one may look alive: stopped, its buffers not full yet */
        pthread_mutex_lock(&w->id_mu);
        supersede(w);
        pthread_mutex_unlock(&w->id_mu);
        link_down(w, SUPERSEDED), down = 1;
      }
    }
    double since = w->down_since;
    pthread_mutex_unlock(&w->send_mu);
    if (!down) {
      SEND(w, "HB slot=%d phase=%s for=%.3f", w->slot, w->in_allreduce ? "allreduce" : "compute",
           tr_now() - w->phase_since);
    } else if (tr_now() - since > w->cfg->operator_grace) {
      lock_link(w);
      w->gone = 1;
      pthread_cond_broadcast(&w->link_cv);
      pthread_mutex_unlock(&w->send_mu);
      fprintf(stderr, "worker %d: no operator came back within %.0f s: exiting without a checkpoint\n", w->slot,
              w->cfg->operator_grace);
      ftar_member_abandon(w->fm, "no operator came back"); /* a collective waiting for a coordinator returns */
      break;
    } else if (link_try(w) == 0) {
      continue;
    }
    for (int i = 0; i < (down ? 2 : 5) && !w->hb_stop; i++) usleep(100000);
  }
  return NULL;
}

/* The operator is gone: pause here (a step boundary) until a restarted one
 * adopted us or the grace ran out (send_mu held). */
static int await_operator(worker *w) {
  while (w->down && !w->gone) pthread_cond_wait(&w->link_cv, &w->send_mu);
  if (w->gone)
    return tr_fail(TR_EIO, "the operator was lost at step %lld and none came back within operator_grace (%.0f s)",
                   (long long)w->cur_step, w->cfg->operator_grace);
  return TR_OK;
}

/* The run's last line (DONE): the operator must hear it, and a restarted
 * one too, so while the link is down it waits for one (operator_grace),
 * where SEND would drop it (its replay covers STEP lines only): a replica
 * that finished while its operator was being restarted would otherwise
 * exit unheard, and the new operator find no live replica to adopt. */
static int send_final(worker *w, const char *line) {
  lock_link(w);
  int rc;
  for (;;) {
    if (w->down && !w->gone) {
      fprintf(stderr, "worker %d: the operator is gone: the last line waits for a restarted one\n", w->slot);
      fflush(stderr);
    }
    if ((rc = await_operator(w)) || proto_send(w->opfd, "%s", line) == 0) break;
    link_down(w, tr_error()); /* the send failed: the link thread looks for a restarted operator */
  }
  pthread_mutex_unlock(&w->send_mu);
  return rc;
}

/* Test hook TRANSOM_TEST_DONE_GATE=PATH: the finished replica holds its
 * DONE until PATH exists (60 s at most), so a test can kill the operator
 * between a run's last step and its last line. Unset: nothing. */
static void test_done_gate(const worker *w) {
  const char *gate = getenv("TRANSOM_TEST_DONE_GATE");
  if (!gate || !*gate) return;
  fprintf(stderr, "worker %d: holding DONE until %s exists (test hook)\n", w->slot, gate);
  fflush(stderr);
  for (int i = 0; i < 600 && access(gate, F_OK) != 0; i++) usleep(100000);
}

/* Test hook TRANSOM_TEST_LOSE_STOP=SLOT: that replica never sees the
 * operator's STOP (as if its link had lost it), so a test can check that
 * the others' stop reaches it through FTAR. Unset: nothing. */
static int test_lose_stop(const worker *w) {
  const char *v = getenv("TRANSOM_TEST_LOSE_STOP");
  if (!v || !*v || atoi(v) != w->slot) return 0;
  fprintf(stderr, "worker %d: the operator's STOP dropped (test hook)\n", w->slot);
  return 1;
}

/* Test hook TRANSOM_TEST_LATE_STOP=SLOT: that replica takes the
 * operator's STOP only once its group has wound down without it (a
 * collective called off: the others' stop reached it through FTAR first),
 * so a test can check that a lead whose STOP comes after the wind-down
 * still learns it is the lead (await_stop) and checkpoints. 1: held. */
static int test_late_stop(worker *w, int64_t at, int lead) {
  const char *v = getenv("TRANSOM_TEST_LATE_STOP");
  if (!v || !*v || atoi(v) != w->slot || w->called_off) return 0;
  if (!w->held_stop)
    fprintf(stderr, "worker %d: the operator's STOP held until the group winds down (test hook)\n", w->slot);
  w->held_stop = 1;
  w->held_at = at;
  w->held_lead = lead;
  return 1;
}

/* Reads the operator's commands that are waiting (never blocks, unless the
 * operator is gone and `wait`: then it waits for a restarted one). */
static int poll_commands(worker *w, int wait) {
  char line[PROTO_LINE_MAX];
  if (w->held_stop && w->called_off) { /* the test hook's STOP, now */
    w->held_stop = 0;
    w->stop_at = w->held_at;
    w->stop_lead = w->held_lead;
  }
  for (;;) {
    lock_link(w);
    int rc = w->down ? 0 : proto_read(&w->rd, line, sizeof line, 0);
    if (rc == 0) {
      link_down(w, "its connection closed");
      if (!wait) { /* the link thread looks for a restarted operator */
        pthread_mutex_unlock(&w->send_mu);
        return TR_OK;
      }
      rc = await_operator(w);
      pthread_mutex_unlock(&w->send_mu);
      if (rc) return rc;
      continue;
    }
    int overlong = w->rd.len >= PROTO_LINE_MAX; /* read under send_mu: a relink (link_try) replaces rd */
    pthread_mutex_unlock(&w->send_mu);
    if (rc < 0) return overlong ? rc : TR_OK; /* else nothing waiting */
    if (proto_is(line, "STOP")) {
      if (test_lose_stop(w)) continue;
      int64_t at = proto_int(line, "at", 1);
      int lead = (int)proto_int(line, "lead", -1);
      if (test_late_stop(w, at, lead)) continue;
      w->stop_at = at;
      w->stop_lead = lead;
    } else if (proto_is(line, "CKPT_NOW")) {
      w->ckpt_now = 1;
    } else if (proto_is(line, "SKIP") && w->t) {
      trainer_skip_update(w->t, proto_int(line, "at", -1));
    } else if (proto_is(line, "SET") && w->t) {
      /* applied from an agreed step on, by every replica alike */
      double lr = proto_num(line, "lr", 0);
      if (lr > 0) trainer_set_lr(w->t, proto_int(line, "at", 0), (float)lr);
    } else if (proto_is(line, "CHAOS") && w->nchaos < MAX_CHAOS) {
      chaos *c = &w->chaos[w->nchaos++];
      c->at = proto_int(line, "at", 0);
      proto_get(line, "fault", c->fault, sizeof c->fault);
      c->ms = proto_int(line, "ms", 200);
      c->steps = proto_int(line, "steps", 0);
    }
  }
}

/* Faults injected on purpose (the job's chaos list, `transom chaos`). */
static void apply_chaos(worker *w, int64_t step) {
  for (int i = 0; i < w->nchaos; i++) {
    chaos *c = &w->chaos[i];
    if (c->at == 0) c->at = step; /* a live fault: now */
    if (c->at != step) continue;
    fprintf(stderr, "worker %d: chaos: %s at step %lld\n", w->slot, c->fault, (long long)step);
    fflush(stderr);
    SEND(w, "FIRED slot=%d at=%lld fault=%s", w->slot, (long long)c->at, c->fault);
    if (strcmp(c->fault, "kill") == 0) raise(SIGKILL);
    if (strcmp(c->fault, "hang") == 0) /* the training thread stops; the heartbeat goes on */
      for (;;) sleep(1);
    if (strcmp(c->fault, "bitflip") == 0) { /* silent data corruption in this replica only */
      trainer_buffers b;
      if (trainer_buffers_get(w->t, &b) == 0) { /* never push a mirror that missed the device's state */
        uint32_t bits;
        memcpy(&bits, &b.params[b.n / 2], 4);
        bits ^= 1u << 20;
        memcpy(&b.params[b.n / 2], &bits, 4);
        trainer_buffers_put(w->t);
      }
    }
    if (strcmp(c->fault, "slow") == 0) {
      w->slow_ms = c->ms;
      w->slow_until = c->steps > 0 ? step + c->steps : INT64_MAX;
    }
    if (strcmp(c->fault, "nan") == 0) w->nan_until = step + (c->steps > 0 ? c->steps : 1);
    if (strcmp(c->fault, "fail") == 0) { /* an error in the step, its all-reduce started (hook_exchange) */
      w->fail_at = step;
      w->fail_ms = c->ms;
    }
  }
}

/* " agent=NAME gen=G" when an agent started us (its SPAWN): an operator
 * takes us only as the worker it asked that agent for; "" otherwise. */
static void agent_words(char *out, size_t n) {
  const char *agent = getenv("TRANSOM_AGENT"), *gen = getenv("TRANSOM_AGENT_GEN");
  out[0] = 0;
  if (agent && gen) snprintf(out, n, " agent=%s gen=%s", agent, gen);
}

static int welcome(worker *w, char *line, size_t n) {
  char host[256], by[128];
  gethostname(host, sizeof host);
  agent_words(by, sizeof by);
  int rc = proto_send(w->opfd, "HELLO slot=%d pid=%d host=%s%s", w->slot, (int)getpid(), host, by);
  if (rc) return rc;
  for (;;) {
    rc = proto_read(&w->rd, line, n, 120000);
    if (rc <= 0) return rc ? rc : tr_fail(TR_EIO, "the operator closed the connection");
    if (proto_is(line, "WELCOME")) return TR_OK;
    if (proto_is(line, "REFUSE")) {
      char why[256];
      proto_get(line, "why", why, sizeof why);
      return tr_fail(TR_ESTATE, "the operator refused slot %d: %s", w->slot, why);
    }
  }
}

/* --- the loop's hooks for a replica --- */

static int hook_poll(void *ud, loop_control *c) {
  worker *w = ud;
  int rc = poll_commands(w, 1);
  c->stop_at = w->stop_at;
  c->ckpt_now |= w->ckpt_now;
  w->ckpt_now = 0;
  return rc;
}

static int hook_before_step(void *ud, int64_t next) {
  worker *w = ud;
  apply_chaos(w, next);
  if (next <= w->nan_until) trainer_poison_next(w->t);
  if (next <= w->slow_until && w->slow_ms > 0) usleep((useconds_t)w->slow_ms * 1000);
  if (w->pad_ms > 0) usleep((useconds_t)w->pad_ms * 1000);
  return 0;
}

/* bucket_mb > 0 on host memory, or on a device backend with overlapped
 * collectives (emu, cuda with NCCL): the all-reduce of step `next` starts
 * now and reduces buckets while backward writes the rest
 * (hook_grads_ready; on a device, after a mark of the compute stream).
 * Other backends reduce after backward (hook_exchange). */
static int hook_exchange_start(void *ud, int64_t next) {
  worker *w = ud;
  trainer *t = w->t;
  const tr_backend *be = trainer_backend(t);
  size_t bucket = (size_t)(w->cfg->bucket_mb * (1 << 20) / sizeof(float));
  w->inflight = 0;
  if (!bucket || !ftar_dev_overlaps(be)) return 0;
  int rc = ftar_allreduce_dev_start(w->fm, be, trainer_grads(t), (size_t)trainer_grads_size(t), FTAR_MEAN,
                                    (uint64_t)next, bucket);
  if (rc) return rc;
  w->inflight = 1;
  return 0;
}

static void hook_grads_ready(void *ud, int64_t from) {
  worker *w = ud;
  if (w->inflight) ftar_allreduce_ready(w->fm, (size_t)from);
}

/* The group wound down before the operator's STOP reached us: it comes
 * at about the same time to every replica, and names the one that
 * checkpoints (perhaps us), so wait for it a little (2 s at most). Its
 * link down, we stop without it, and do not checkpoint. */
static void await_stop(worker *w) {
  for (int i = 0; i < 40 && w->stop_at <= 0; i++) {
    if (poll_commands(w, 0)) return;
    if (w->stop_at <= 0) usleep(50 * 1000);
  }
}

/* The gradients of step `next`, all-reduced (mean) in place on the backend
 * through FTAR (finished here when hook_exchange_start started it); a
 * joiner the group outran replays what it missed. */
static int hook_exchange(void *ud, int64_t next, loop_exchange *x) {
  worker *w = ud;
  trainer *t = w->t;
  const tr_backend *be = trainer_backend(t);
  float *g = trainer_grads(t); /* the backend's memory: FTAR moves it with the device's communicator */
  if (next == w->fail_at) { /* chaos fail: with bucket_mb > 0 the buckets are in flight */
    /* not in the all-reduce: heartbeats saying so through the error path
     * would count as a wait for the others (find_hung evicts them) */
    set_phase(w, 0);
    return tr_fail(TR_EIO, "chaos: step %lld failed %s", (long long)next,
                   w->inflight ? "after its all-reduce started" : "before its all-reduce (none in flight)");
  }
  set_phase(w, 1);
  ftar_result res;
  int rc;
  if (w->inflight) {
    w->inflight = 0;
    rc = ftar_allreduce_wait(w->fm, &res, &x->comm_s);
  } else {
    rc = ftar_allreduce_dev(w->fm, be, g, (size_t)trainer_grads_size(t), FTAR_MEAN, (uint64_t)next, &res);
  }
  set_phase(w, 0);
  if (rc == FTAR_ESEQ && w->donor_fd >= 0 && res.seq > (uint64_t)next) {
    /* a joiner whose first collective found the group ahead: the steps it
     * missed come from its donor, then it computes the group's step */
    int applied = donor_catch_up(w->donor_fd, t, (int64_t)res.seq - 1);
    if (applied < 0) return applied;
    fprintf(stderr, "worker %d: the group was at step %llu: replayed %d step(s) from the donor\n", w->slot,
            (unsigned long long)res.seq, applied);
    return LOOP_RECOMPUTE;
  }
  /* the step called off: stop where we are. FTAR_ECANCELED before our
   * STOP: another replica's stop wound the group down */
  if (rc == FTAR_ECANCELED || (w->stop_paused && rc == FTAR_ESEQ)) {
    w->called_off = 1;
    if (w->stop_at <= 0) await_stop(w);
    x->leader = x->snapshots = w->stop_lead == w->slot;
    fprintf(stderr, "worker %d: stopped at step %lld: step %lld could not finish below min_replicas%s%s\n", w->slot,
            (long long)(next - 1), (long long)next, w->stop_at > 0 ? "" : " (the group wound down: the job stops)",
            x->leader ? "; this replica checkpoints it" : "");
    return LOOP_STOPPED;
  }
  if (rc < 0) return rc;
  if (donor_wants(w->dn, next)) { /* a joiner is catching up: keep the reduced gradients for it */
    const float *hg = trainer_grads_host(t);
    if (!hg) return TR_EIO;
    donor_record(w->dn, next, hg);
  }
  x->replicas = res.contributors;
  x->leader = res.contributors <= 1 || res.slots[0] == w->slot;
  if (w->stop_paused) x->leader = w->stop_lead == w->slot; /* a result held, committed as we stop: its
                                                              * lowest contributor may be gone */
  x->epoch = (int64_t)res.epoch;
  x->redos = res.redos;
  return 0;
}

/* The loop failed (a step's compute, say, with an all-reduce started): the
 * group goes on without this replica now, not when the process exits after
 * the final checkpoint; a collective in flight fails with it. */
static void hook_failed(void *ud, int rc) {
  worker *w = ud;
  char why[256];
  snprintf(why, sizeof why, "slot %d's training loop failed (%d): %s", w->slot, rc, tr_error());
  w->inflight = 0;
  if (w->fm) ftar_member_leave(w->fm, why);
}

static int hook_boundary(void *ud, int64_t step) {
  worker *w = ud;
  (void)step;
  donor_boundary(w->dn);
  if (w->donor_fd >= 0) { /* in the ring: the donor can stop recording for us */
    donor_close(w->donor_fd);
    w->donor_fd = -1;
  }
  return 0;
}

/* Test hook TRANSOM_TEST_BAD_STEP=SLOT: that replica sends a STEP line
 * with a negative step before its first real one (the operator must
 * refuse it: it would index before its step ring). Unset: nothing. */
static int test_bad_step(const worker *w) {
  const char *v = getenv("TRANSOM_TEST_BAD_STEP");
  return v && *v && atoi(v) == w->slot;
}

static int hook_report(void *ud, const step_record *r) {
  worker *w = ud;
  char body[PROTO_LINE_MAX - 64];
  if (step_record_line(body, sizeof body, r) < 0) return tr_fail(TR_EINVAL, "step record too long");
  char line[PROTO_LINE_MAX];
  snprintf(line, sizeof line, "STEP slot=%d %s", w->slot, body);
  /* kept for a restarted operator and sent in one hold of the link: a
   * relink in between would replay it and we would send it again */
  lock_link(w);
  char **kept = &w->replay[w->nreplay % REPLAY];
  free(*kept);
  *kept = strdup(line);
  w->replay_step[w->nreplay % REPLAY] = r->step;
  w->nreplay++;
  w->cur_step = r->step;
  if (w->nreplay == 1 && !w->down && test_bad_step(w) &&
      proto_send(w->opfd, "STEP slot=%d step=-1000003 loss=1", w->slot))
    link_down(w, tr_error());
  if (!w->down && proto_send(w->opfd, "%s", line)) link_down(w, tr_error()); /* waited for at the step boundary */
  pthread_mutex_unlock(&w->send_mu);
  return TR_OK;
}

static int hook_eval(void *ud, int64_t step, float val) {
  worker *w = ud;
  return SEND(w, "EVAL slot=%d step=%lld val=%.9g", w->slot, (long long)step, val);
}

static void hook_ckpt_event(void *ud, const ckpt_event *ev) {
  worker *w = ud;
  char what[600];
  proto_escape(ev->ok ? "-" : ev->what, what, sizeof what);
  SEND(w, "CKPT slot=%d step=%lld ok=%d commit_ms=%.1f what=%s", w->slot, (long long)ev->step, ev->ok,
       ev->commit_s * 1e3, what);
}

static void hook_saved(void *ud, int64_t step) {
  worker *w = ud;
  SEND(w, "SAVED slot=%d step=%lld", w->slot, (long long)step);
}

/* --- start-up --- */

/* --slot/--operator, or an external launcher's variables. 0, or the exit
 * status to return (help: 0 via *done). */
static int parse_args(worker *w, int argc, char **argv, int *done) {
  const char *opaddr = NULL;
  *done = 0;
  for (int i = 0; i < argc; i++) {
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(usage, stdout);
      *done = 1;
      return 0;
    } else if (strcmp(argv[i], "--operator") == 0 && i + 1 < argc) {
      opaddr = argv[++i];
    } else if ((strcmp(argv[i], "--slot") == 0 || strcmp(argv[i], "--threads") == 0) && i + 1 < argc) {
      long long v;
      if (tr_parse_int(argv[i + 1], argv[i][2] == 's' ? 0 : 1, 4096, &v)) {
        fprintf(stderr, "transom worker: %s '%s' is not an integer in %d..4096\n", argv[i], argv[i + 1],
                argv[i][2] == 's' ? 0 : 1);
        return 2;
      }
      *(argv[i][2] == 's' ? &w->slot : &w->threads) = (int)v;
      i++;
    } else {
      fprintf(stderr, "transom worker: unexpected argument '%s'\n%s", argv[i], usage);
      return 2;
    }
  }
  const char *rank = env_any("RANK", "SLURM_PROCID"); /* external launchers */
  long long rv;
  if (w->slot < 0 && rank) {
    if (tr_parse_int(rank, 0, 4096, &rv)) {
      fprintf(stderr, "transom worker: RANK / SLURM_PROCID '%s' is not an integer in 0..4096\n", rank);
      return 2;
    }
    w->slot = (int)rv;
  }
  char envaddr[300];
  if (!opaddr && env_any("MASTER_ADDR", NULL) && env_any("MASTER_PORT", NULL)) {
    snprintf(envaddr, sizeof envaddr, "%s:%s", getenv("MASTER_ADDR"), getenv("MASTER_PORT"));
    opaddr = envaddr;
  }
  if (w->slot < 0 || !opaddr) {
    fputs(usage, stderr);
    return 2;
  }
  w->addr_from_env = opaddr == envaddr;
  if (net_split(opaddr, w->op_host, sizeof w->op_host, &w->op_port)) {
    fprintf(stderr, "transom worker: %s\n", tr_error());
    return 2;
  }
  return 0;
}

/* The operator's decisions so far, from the WELCOME line: skipped batches
 * (batch_skips=KEY,KEY, ascending), dropped updates (skips=STEP,STEP) and
 * live learning-rate changes (lr=STEP:VALUE,...). */
static void apply_welcome(trainer *t, const char *line) {
  char sk[1024], lrs[1024], bs[64 * 21];
  int64_t keys[64];
  int nkeys = 0;
  proto_get(line, "batch_skips", bs, sizeof bs);
  for (char *p = bs; *p && nkeys < 64;) {
    char *end;
    long long k = strtoll(p, &end, 10);
    if (end == p) break;
    keys[nkeys++] = k;
    p = *end == ',' ? end + 1 : end;
  }
  if (trainer_set_batch_skips(t, keys, nkeys)) fprintf(stderr, "worker: batch_skips ignored: %s\n", tr_error());
  proto_get(line, "skips", sk, sizeof sk);
  for (char *p = sk; *p;) {
    char *end;
    long long at = strtoll(p, &end, 10);
    if (end == p) break;
    trainer_skip_update(t, at);
    p = *end == ',' ? end + 1 : end;
  }
  proto_get(line, "lr", lrs, sizeof lrs);
  for (char *p = lrs; *p;) {
    char *end;
    long long at = strtoll(p, &end, 10);
    if (*end != ':') break;
    double v = strtod(end + 1, &p);
    trainer_set_lr(t, at, (float)v);
    if (*p == ',') p++;
  }
}

/* Checkpoints: every replica can lead, so every replica has the engine. */
static ckpt_engine *open_ckpt(const job_config *cfg, trainer *t, const char *run) {
  if (cfg->ckpt_every_steps == 0 && cfg->ckpt_every_seconds == 0) return NULL;
  char path[1200];
  snprintf(path, sizeof path, "%s/ckpt", run);
  ckpt_opts o = {path, (size_t)cfg->ckpt_map_mb << 20, (int)cfg->ckpt_keep_last, (int)cfg->ckpt_keep_every,
                 strcmp(cfg->ckpt_when_busy, "skip") == 0 ? CKPT_SKIP : CKPT_COALESCE};
  ckpt_engine *ck = ckpt_open(&o);
  if (ck && trainer_ckpt_attach(t, ck)) {
    ckpt_close(ck);
    return NULL;
  }
  return ck;
}

/* Snapshots a joiner fetches at most before it gives up on its donor. */
#define JOIN_SNAPSHOTS 4

/* Fresh, from the newest checkpoint (or resume_step), or from a donor peer. */
static int get_state(worker *w, ckpt_engine *ck, const char *mode, const char *donor_addr, int64_t resume_step) {
  trainer *t = w->t;
  if (strcmp(mode, "resume") == 0 && ck) {
    char report[2048] = "";
    ckpt_reader *r = ckpt_engine_reader(ck);
    int rc = r ? trainer_ckpt_load(t, r, resume_step, report, sizeof report) : TR_ENOMEM;
    ckpt_reader_close(r);
    if (report[0]) fputs(report, stderr);
    return rc;
  }
  if (strcmp(mode, "join") != 0) return 0;
  char dh[256];
  int dp, rc, applied = TR_ESTATE;
  if ((rc = net_split(donor_addr, dh, sizeof dh, &dp))) return rc;
  /* the group may outrun the donor's gradient history while we load the
   * snapshot (a slow device, a loaded host): then a fresh snapshot, which is
   * closer to the group, until the replay fits */
  for (int attempt = 0; applied == TR_ESTATE && attempt < JOIN_SNAPSHOTS; attempt++) {
    /* a newer snapshot comes over the same session: a new connection
     * would queue behind other joiners of this donor */
    if (attempt > 0) fprintf(stderr, "worker %d: %s; fetching a newer snapshot\n", w->slot, tr_error());
    if ((rc = donor_fetch_snapshot(dh, dp, t, &w->donor_fd, &w->secret))) return rc;
    const char *delay = getenv("TRANSOM_TEST_CATCHUP_DELAY_MS"); /* widens the window for fault tests */
    if (delay && attempt == 0) usleep((useconds_t)atoi(delay) * 1000);
    applied = donor_catch_up(w->donor_fd, t, 0);
  }
  if (applied < 0) return applied;
  trainer_state ts;
  trainer_get_state(t, &ts);
  fprintf(stderr, "worker %d: caught up from %s: at step %lld after replaying %d steps\n", w->slot, donor_addr,
          (long long)ts.step, applied);
  return 0;
}

/* In a collective that waits for quorum (the group below min_replicas):
 * the operator's commands are read here too, and a STOP winds the member
 * down, and through the coordinator every other member, whether or not its
 * own STOP came (the step could not finish before replacements come): the group
 * takes the coordinator's decision on the collective without quorum (a
 * result every survivor may hold, because one of them returned it, is
 * committed, so all end on the same step), runs nothing more, and the loop
 * stops at the last boundary, which the STOP's lead (the lowest live slot)
 * checkpoints. Before, the stop waited for a step that never came until
 * the operator killed the replicas 60 s later, without a final checkpoint.
 * Reading commands mid-step is safe: SKIP, SET and CHAOS name later steps
 * (the operator schedules them a few steps past the best one). The read
 * does not wait for a lost operator. */
static void stop_while_paused(worker *w) {
  if (w->stop_paused || !w->fm || poll_commands(w, 0) || w->stop_at <= 0) return;
  w->stop_paused = 1;
  ftar_member_wind_down(w->fm);
}

/* Below min_replicas a collective waits for quorum in the middle of a step,
 * before its update: the parameters are still those of the last boundary,
 * so a joiner's snapshot request is served from here (the training thread),
 * or the replacement that would restore the quorum could never get one. */
static void on_quorum_wait(void *ud) {
  worker *w = ud;
  donor_boundary(w->dn);
  stop_while_paused(w);
}

/* The address peers reach us at: TRANSOM_HOST (an agent sets it), else the
 * local end of our connection to the operator, the address its host routes
 * to us (loopback only when the operator is on this host). */
static void reachable_addr(worker *w, char *out, size_t n) {
  const char *env = env_any("TRANSOM_HOST", NULL);
  struct sockaddr_in sa;
  socklen_t sl = sizeof sa;
  if (env) snprintf(out, n, "%s", env);
  else if (getsockname(w->opfd, (struct sockaddr *)&sa, &sl) == 0 && sa.sin_family == AF_INET)
    inet_ntop(AF_INET, &sa.sin_addr, out, (socklen_t)n);
  else snprintf(out, n, "127.0.0.1");
}

/* A replica that starts (not joins) waits up to 30 s for the others to
 * register, to start together. One that said HELLO after we were ready is
 * told to join from a ready replica, perhaps us: its snapshot is served
 * meanwhile (we are at our starting boundary), so it joins at our step and
 * we start together. Before, it waited for the snapshot until we gave up
 * waiting and trained alone, 30 s later (an external launcher's workers a
 * moment apart on a loaded machine). */
static void start_together(worker *w) {
  for (double end = tr_now() + 30.0; tr_now() < end;) {
    if (ftar_member_wait(w->fm, (int)w->cfg->replicas, 0.1) != FTAR_ETIMEOUT) return; /* all in, or failed */
    donor_boundary(w->dn);
  }
}

/* Serves joiners, enters FTAR, tells the operator it is ready, starts the
 * heartbeat. me: the address peers reach us at. */
static int enter_ring(worker *w, const char *coord, const char *me, double state_s, int joining) {
  int dport = 0, cp, rc;
  char ch[256];
  w->dn = donor_start(me, w->t, 64, &dport, &w->secret);
  if (!w->dn) return TR_EIO;
  if ((rc = net_split(coord, ch, sizeof ch, &cp))) return rc;
  ftar_member_opts fo;
  ftar_member_opts_default(&fo);
  fo.timeout = 3600; /* below min_replicas training pauses until replacements come */
  fo.deadline = w->cfg->deadline;
  fo.min_members = (int)w->cfg->min_replicas;
  fo.quorum_wait = on_quorum_wait;
  fo.quorum_ud = w;
  fo.data_host = me;
  fo.strict_seq = 1; /* a joiner must enter at exactly its own step */
  fo.survive_coord_loss = 1; /* the operator (its coordinator) may die and come back */
  fo.secret = w->secret.key;
  fo.secret_len = w->secret.len;
  w->fm = ftar_member_create(ch, cp, w->slot, &fo);
  if (!w->fm) return TR_EIO;
  trainer_state ts; /* where training is: no state leaves the device for this */
  trainer_get_state(w->t, &ts);
  w->cur_step = ts.step;
  snprintf(w->me_donor, sizeof w->me_donor, "%s:%d", me, dport);
  rc = SEND(w, "READY slot=%d step=%lld donor=%s:%d state_s=%.3f", w->slot, (long long)ts.step, me, dport, state_s);
  if (rc) return rc;
  w->phase_since = tr_now();
  if (pthread_create(&w->hb, NULL, heartbeat_main, w) != 0) return tr_fail(TR_ENOMEM, "cannot start the heartbeat thread");
  if (!joining) start_together(w);
  return 0;
}

static int train(worker *w, ckpt_engine *ck, const char *run) {
  loop_opts lo = {.t = w->t, .ck = ck, .run_dir = run, .worker = w->slot, .save_on_stop = 1, .replica = 1};
  loop_hooks h = {.ud = w,
                  .poll = hook_poll,
                  .before_step = hook_before_step,
                  .exchange_start = hook_exchange_start,
                  .grads_ready = hook_grads_ready,
                  .exchange = hook_exchange,
                  .boundary = hook_boundary,
                  .report = hook_report,
                  .eval = hook_eval,
                  .ckpt_event = hook_ckpt_event,
                  .saved = hook_saved,
                  .failed = hook_failed};
  loop_result res;
  int rc = loop_run(&lo, &h, &res);
  if (rc) return rc;
  char done[160];
  snprintf(done, sizeof done, "DONE slot=%d step=%lld crc=%08x", w->slot, (long long)res.step,
           trainer_param_crc(w->t));
  test_done_gate(w);
  return send_final(w, done);
}

int worker_main(int argc, char **argv) {
  worker w = {.slot = -1, .opfd = -1, .donor_fd = -1, .stop_lead = -1, .send_mu = PTHREAD_MUTEX_INITIALIZER,
              .link_cv = PTHREAD_COND_INITIALIZER, .id_mu = PTHREAD_MUTEX_INITIALIZER};
  int done, rc = parse_args(&w, argc, argv, &done), exit_code = 1, startup = 0;
  if (rc || done) return rc;
  signal(SIGPIPE, SIG_IGN);
  /* a soak emulates a GPU's step time (long against a recovery) without
   * burning the test machine's cores */
  const char *pad = getenv("TRANSOM_TEST_STEP_MS");
  w.pad_ms = pad ? atoi(pad) : 0;

  char line[PROTO_LINE_MAX], *run = w.run, coord[300], donor_addr[300], mode[16];
  if (!(w.replay = calloc(REPLAY, sizeof *w.replay)) || !(w.replay_step = calloc(REPLAY, sizeof *w.replay_step))) {
    free(w.replay);
    return 1;
  }
  lua_State *L = NULL;
  ckpt_engine *ck = NULL;
  if ((rc = auth_secret_from_env(&w.secret))) goto fail;
  w.opfd = net_connect(w.op_host, w.op_port, 60.0);
  w.rd.fd = w.opfd;
  if (w.opfd < 0 || (rc = auth_client(w.opfd, &w.secret, 30.0)) || (rc = welcome(&w, line, sizeof line))) goto fail;
  proto_get(line, "run", run, sizeof w.run);
  proto_get(line, "nonce", w.op_nonce, sizeof w.op_nonce); /* this operator's: a newer one is a restart */
  note_file_nonce(&w);
  proto_get(line, "coord", coord, sizeof coord);
  proto_get(line, "mode", mode, sizeof mode);
  proto_get(line, "donor", donor_addr, sizeof donor_addr);
  if (!w.threads) w.threads = (int)proto_int(line, "threads", 1);

  /* the job, as the operator resolved it */
  char path[1200], setthreads[32];
  snprintf(path, sizeof path, "%s/job.lua", run);
  snprintf(setthreads, sizeof setthreads, "threads=%d", w.threads);
  const char *sets[] = {setthreads};
  job_config cfg;
  L = lua_host_new();
  /* from here to the state: what fails here fails the same way on every try
   * (the job, its data, the checkpoint), so the operator must not retry */
  startup = 1;
  if (!L || (rc = job_load(L, path, sets, 1, &cfg))) goto fail;
  if (!(w.t = trainer_create(L, &cfg))) goto fail;
  w.cfg = trainer_config(w.t);
  bound_sends(&w, w.opfd);
  trainer_set_slot(w.t, w.slot);
  apply_welcome(w.t, line);
  if (!(ck = open_ckpt(&cfg, w.t, run)) && (cfg.ckpt_every_steps > 0 || cfg.ckpt_every_seconds > 0)) goto fail;
  double t_state = tr_now();
  startup = strcmp(mode, "join") != 0; /* a donor's failure is not deterministic */
  if ((rc = get_state(&w, ck, mode, donor_addr, proto_int(line, "resume_step", -1)))) goto fail;
  startup = 0;
  char me[64];
  reachable_addr(&w, me, sizeof me);
  if ((rc = enter_ring(&w, coord, me, tr_now() - t_state, strcmp(mode, "join") == 0))) goto fail;
  if ((rc = train(&w, ck, run))) goto fail;
  exit_code = 0;
  goto done;
fail:
  fprintf(stderr, "transom worker %d: %s\n", w.slot, tr_error());
  /* chaos fail: a slow error path (a crash dump, a final flush) before the
   * operator hears of it; the loop's failed hook left FTAR already */
  if (w.fail_at > 0 && w.fail_ms > 0) usleep((useconds_t)w.fail_ms * 1000);
  if (w.opfd >= 0) {
    char why[600];
    proto_escape(tr_error(), why, sizeof why);
    SEND(&w, "FAIL slot=%d startup=%d why=%s", w.slot, startup, why);
  }
  /* 5: the device is unusable (TR_EDEVICE): main leaves without the exit
   * handlers, which could wait on it (see core/cli/main.c) */
  exit_code = w.gone ? 4 : rc == FTAR_EEVICTED ? 3 : rc == TR_EDEVICE ? 5 : startup ? 2 : 1;
done:
  if (w.hb) {
    w.hb_stop = 1;
    pthread_join(w.hb, NULL);
  }
  donor_close(w.donor_fd);
  ftar_member_free(w.fm);
  donor_stop(w.dn);
  ckpt_close(ck);
  trainer_free(w.t);
  lua_host_close(L);
  if (w.opfd >= 0) close(w.opfd);
  for (int i = 0; i < REPLAY; i++) free(w.replay[i]);
  free(w.replay);
  free(w.replay_step);
  return exit_code;
}
