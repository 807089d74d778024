/* agent.c — `transom agent`: one per host (the torchelastic pattern). It
 * registers with the operator on its workers' port (AGENT name= addr=
 * cores= gpus= slots=), starts the workers the operator places here (SPAWN:
 * `transom worker --operator OP --slot K --threads N`, TRANSOM_HOST set to
 * this host's routable address so the worker advertises it to its peers),
 * kills them when told (KILL), reports every exit with its real wait status
 * (EXITED); STARTED / EXITED / KILL carry the SPAWN's generation (gen=), so
 * neither side takes an older worker of a slot for its newest, heartbeats (HB) every HB_INTERVAL, and every PROBE_INTERVAL
 * sends a link probe (64 KB of padded lines) the operator times. Its death is the host's
 * death: its workers die with it (PR_SET_PDEATHSIG), and the operator
 * counts them lost when its connection closes or its heartbeats lapse.
 *
 * Started by hand, by `srun` (one task per node) or anything else; the
 * operator never needs ssh. The operator lost (its connection closed or
 * reset, or none of our bytes taken for operator_grace seconds, which its
 * WELCOME says): the agent keeps its workers (they wait the same grace for
 * a restarted operator themselves) and registers again with whatever
 * listens at RUN/operator.addr (RUN: --secret-file's directory, where
 * our workers look too) or --operator, naming them (AGENT
 * live=SLOT:GEN:PID,...): a
 * restarted operator (`transom run --resume`) adopts them, another one
 * kills the ones it does not want (KILL). None within the grace: it stops
 * its workers and exits 1. END (the job is over, the operator exits) or
 * SIGTERM / SIGINT: it stops its workers and exits 0, once the lines
 * queued for the operator (the stopped workers' EXITED among them) are
 * taken, STOP_FLUSH_S at most; while it registers (a frozen operator takes
 * the connection and never answers) at once (hello_fd).
 * An operator that stalls (SIGSTOP, a long REPL expression) and resumes
 * within the grace is not lost: once registered, lines go out through a
 * buffer of our own without blocking, and while earlier bytes are still
 * owed (ours, or the socket's send queue: SIOCOUTQ) no heartbeat or probe
 * is added behind them.
 *
 *   transom agent --operator HOST:PORT --secret-file RUN/secret [--name NAME] [--addr ADDR] [--slots N]
 *                 [--cores N]
 * It proves the job's secret on connecting (auth.h) and hands it to its
 * workers (TRANSOM_SECRET).
 *
 * Single-threaded: poll(), sends that never block once registered (the
 * registration's are bounded by REGISTER_SEND_S); SIGCHLD through a self-pipe.
 */
#define _GNU_SOURCE /* PR_SET_PDEATHSIG */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <limits.h>
#include <linux/sockios.h> /* SIOCOUTQ */
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <arpa/inet.h>
#include <unistd.h>

#include "auth.h"
#include "proto.h"
#include "util.h"

int agent_main(int argc, char **argv);

#define HB_INTERVAL AGENT_HB_INTERVAL /* seconds between heartbeats to the operator (proto.h) */
#define PROBE_INTERVAL 2.0 /* seconds between link probes (PROBE_LINES x PROBE_PAD bytes) */
#define PROBE_LINES 16
#define PROBE_PAD 4000
#define AGENT_SLOTS 64
/* A send of the registration (the challenge's answer, AGENT) that makes no
 * progress this long fails it; without it the agent would block in send()
 * for ever, deaf to SIGTERM (SA_RESTART). After WELCOME nothing blocks. */
#define REGISTER_SEND_S 10
/* How long an operator may take none of our bytes before it is lost: its
 * WELCOME's grace= (the job's operator_grace, what its workers wait for a
 * restarted one); this where an operator does not say. */
#define GRACE_DEFAULT_S 60.0
/* Stopped (SIGTERM, SIGINT): how long the agent waits for the operator to
 * take what is queued for it (the grace, when the operator's is shorter). */
#define STOP_FLUSH_S 5.0
/* Bytes for the operator the socket did not take yet: a probe and, behind
 * it, the STARTED/EXITED lines of every slot many times over. */
#define OUT_CAP (PROBE_LINES * (PROBE_PAD + 8) + 64 * 1024)

typedef struct {
  char op[300], name[64], addr[64], self[PATH_MAX];
  int op_port, nslots, cores, gpus;
  char at[300];       /* the operator we are registered with (--operator, or where RUN/operator.addr sent us) */
  int at_port;
  int fd;
  proto_reader rd;
  pid_t pids[AGENT_SLOTS]; /* per worker: its pid */
  int slots[AGENT_SLOTS];  /* and its replica slot */
  unsigned gens[AGENT_SLOTS]; /* and the operator's SPAWN generation (echoed in STARTED / EXITED, named by KILL) */
  int n;
  auth_secret secret; /* the job's: --secret-file, TRANSOM_SECRET or TRANSOM_SECRET_FILE */
  char secret_hex[2 * AUTH_KEY_MAX + 1];
  double grace;       /* seconds the operator may take none of our bytes (its WELCOME's grace=) */
  char out[OUT_CAP];  /* lines for the operator the socket has not taken yet (serve: never blocks) */
  size_t out_len;
  size_t owed;        /* bytes owed at the last look: out_len + the socket's send queue */
  double taken_at;    /* when the operator last took some (or nothing was owed) */
  char lost[160];     /* why the operator is lost (a failed send, the grace run out); "" while it is not */
  char nonce[64];     /* our operator's (its WELCOME's): RUN/operator.addr naming another is a restarted one */
  char file_nonce[64]; /* and the file's when we registered (a stale copy is no restarted operator) */
  int ended;          /* the operator said END: the job is over */
} agent;

static const char agent_usage[] =
    "usage: transom agent --operator HOST:PORT --secret-file RUN/secret [--name NAME] [--addr ADDR] [--slots N]\n"
    "                     [--cores N] [--gpus N]\n"
    "\n"
    "One per host: registers with the operator of a job with `hosts = N` (started\n"
    "with MASTER_ADDR/MASTER_PORT), starts and supervises the replicas it places\n"
    "here, reports their exits. --name: this host's name (default: hostname;\n"
    "letters, digits, '.', '-', '_', at most 63);\n"
    "--addr: the address other hosts reach this one at (default: the local\n"
    "address of the connection to the operator; never loopback when the operator\n"
    "is elsewhere); --slots: replicas this host runs at most (default 1);\n"
    "--cores: cores to share among them (default: all online); --gpus: GPUs it\n"
    "reports (default: the /dev/nvidiaN devices). --secret-file: the\n"
    "job's secret (RUN/secret, made by the operator; or TRANSOM_SECRET=hex,\n"
    "TRANSOM_SECRET_FILE=path): the operator refuses an agent without it.\n"
    "MASTER_ADDR/MASTER_PORT stand in for --operator (srun, one task per node).\n"
    "The operator lost: the workers go on while the agent registers again with a\n"
    "restarted one (`transom run --resume RUN`: at the address RUN/operator.addr\n"
    "names, RUN being --secret-file's directory, else at --operator) for\n"
    "operator_grace seconds, which adopts them.\n"
    "Exit status: 0 stopped (SIGTERM/SIGINT, or the job ended), 1 the operator was lost\n"
    "(none came back within operator_grace) or refused us, 2 usage.\n";

static int pipe_fds[2] = {-1, -1};
static volatile sig_atomic_t stop_sig;
/* The connection being registered (hello), -1 when none: SIGTERM / SIGINT
 * shut it down, so a wait for an operator's answer (30 s at the start, 3 s
 * a try when registering again; a frozen operator's port takes the
 * connection and never answers) ends at once rather than at its timeout.
 * Set before stop_sig is checked and cleared before the descriptor is
 * closed, so the handler never shuts down another file's. */
static volatile sig_atomic_t hello_fd = -1;
static volatile sig_atomic_t hello_cut; /* the handler shut hello_fd down (even after WELCOME came) */

static void on_signal(int sig) {
  int e = errno; /* the interrupted code's, kept from shutdown and write */
  if (sig == SIGTERM || sig == SIGINT) {
    stop_sig = sig;
    if (hello_fd >= 0) {
      shutdown(hello_fd, SHUT_RDWR); /* async-signal-safe */
      hello_cut = 1;
    }
  }
  if (write(pipe_fds[1], "x", 1) < 0) { /* full: a wake-up is pending anyway */
  }
  errno = e;
}

/* NVIDIA devices on this host (/dev/nvidia0, 1, ...): what it reports. */
static int count_gpus(void) {
  glob_t g;
  int n = glob("/dev/nvidia[0-9]*", 0, NULL, &g) == 0 ? (int)g.gl_pathc : 0;
  globfree(&g);
  return n;
}

/* A whole decimal integer in lo..hi into *out; else a usage error naming
 * the flag (atoi took "--slots abc" for 0 and "--slots 2x" for 2). */
static int int_flag(const char *flag, const char *s, int lo, int hi, int *out) {
  long long v;
  if (tr_parse_int(s, lo, hi, &v)) {
    fprintf(stderr, "transom agent: %s '%s' is not an integer in %d..%d\n%s", flag, s, lo, hi, agent_usage);
    return 2;
  }
  *out = (int)v;
  return 0;
}

static int takes_value(const char *flag) {
  static const char *const flags[] = {"--operator", "--name", "--addr", "--slots", "--cores", "--gpus", "--secret-file"};
  for (size_t k = 0; k < sizeof flags / sizeof flags[0]; k++)
    if (strcmp(flag, flags[k]) == 0) return 1;
  return 0;
}

/* A host's name travels in control lines (AGENT name=, the operator's
 * events and hosts.lua), whose values end at a space: the characters of a
 * host name only, and one that fits (not cut short without a word). */
static int host_name_ok(const char *s, size_t cap) {
  size_t n = strlen(s);
  if (n == 0 || n >= cap) return 0;
  for (; *s; s++)
    if (!isalnum((unsigned char)*s) && *s != '.' && *s != '-' && *s != '_') return 0;
  return 1;
}

/* The flags that take an integer, their ranges, and where they go. */
static int int_option(agent *a, const char *flag, const char *v) {
  if (strcmp(flag, "--slots") == 0) return int_flag(flag, v, 1, AGENT_SLOTS, &a->nslots);
  if (strcmp(flag, "--cores") == 0) return int_flag(flag, v, 1, 1 << 20, &a->cores);
  return int_flag(flag, v, 0, 1 << 20, &a->gpus);
}

static int parse(agent *a, int argc, char **argv, int *done) {
  const char *op = NULL;
  char env[300];
  *done = 0;
  a->nslots = 1;
  a->cores = (int)sysconf(_SC_NPROCESSORS_ONLN);
  a->gpus = count_gpus();
  for (int i = 0; i < argc; i++) {
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      fputs(agent_usage, stdout);
      *done = 1;
      return 0;
    } else if (strcmp(argv[i], "--operator") == 0 && v) op = argv[++i];
    else if (strcmp(argv[i], "--name") == 0 && v) {
      if (!host_name_ok(v, sizeof a->name)) {
        fprintf(stderr, "transom agent: --name '%s': a host name is 1 to %zu letters, digits, '.', '-' or '_'\n", v,
                sizeof a->name - 1);
        return 2;
      }
      snprintf(a->name, sizeof a->name, "%s", argv[++i]);
    }
    else if (strcmp(argv[i], "--addr") == 0 && v) snprintf(a->addr, sizeof a->addr, "%s", argv[++i]);
    else if ((strcmp(argv[i], "--slots") == 0 || strcmp(argv[i], "--cores") == 0 || strcmp(argv[i], "--gpus") == 0) && v) {
      if (int_option(a, argv[i], v)) return 2;
      i++;
    } else if (strcmp(argv[i], "--secret-file") == 0 && v) setenv("TRANSOM_SECRET_FILE", argv[++i], 1);
    else if (!v && takes_value(argv[i])) {
      fprintf(stderr, "transom agent: %s needs a value\n%s", argv[i], agent_usage);
      return 2;
    } else {
      fprintf(stderr, "transom agent: unexpected argument '%s'\n%s", argv[i], agent_usage);
      return 2;
    }
  }
  if (!op && getenv("MASTER_ADDR") && getenv("MASTER_PORT")) {
    snprintf(env, sizeof env, "%s:%s", getenv("MASTER_ADDR"), getenv("MASTER_PORT"));
    op = env;
  }
  if (!op || a->cores < 1) { /* cores: the online count, when sysconf fails */
    fprintf(stderr, "transom agent: %s\n%s", !op ? "--operator HOST:PORT is needed" : "--cores must be >= 1",
            agent_usage);
    return 2;
  }
  if (net_split(op, a->op, sizeof a->op, &a->op_port)) {
    fprintf(stderr, "transom agent: %s\n", tr_error());
    return 2;
  }
  if (auth_secret_from_env(&a->secret)) {
    fprintf(stderr, "transom agent: %s\n", tr_error());
    return 2;
  }
  auth_secret_hex(&a->secret, a->secret_hex, sizeof a->secret_hex);
  if (!a->name[0] && gethostname(a->name, sizeof a->name) != 0) snprintf(a->name, sizeof a->name, "host");
  return 0;
}

/* Our address as the operator's host sees us: the connection's local end. */
static void local_addr(agent *a) {
  if (a->addr[0]) return;
  struct sockaddr_in sa;
  socklen_t sl = sizeof sa;
  if (getsockname(a->fd, (struct sockaddr *)&sa, &sl) == 0 && sa.sin_family == AF_INET)
    inet_ntop(AF_INET, &sa.sin_addr, a->addr, sizeof a->addr);
  else snprintf(a->addr, sizeof a->addr, "127.0.0.1");
}

/* --- lines to the operator --- */

/* Bytes the operator has not taken: ours the socket did not take yet, and
 * the socket's send queue (sent and not acknowledged, or not sent: a window
 * closed by an operator that stopped reading). */
static size_t owed(const agent *a) {
  int q = 0;
  if (ioctl(a->fd, SIOCOUTQ, &q) != 0 || q < 0) q = 0;
  return a->out_len + (size_t)q;
}

/* Hands the socket what it takes now, never waiting; an error of the
 * connection (reset, closed, timed out) is the operator lost. */
static void flush(agent *a) {
  size_t done = 0;
  while (done < a->out_len && !a->lost[0]) {
    ssize_t n = send(a->fd, a->out + done, a->out_len - done, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) done += (size_t)n;
    else if (n < 0 && errno == EINTR) continue;
    else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) snprintf(a->lost, sizeof a->lost, "send: %s", strerror(errno));
    else break; /* the socket is full: the rest waits for POLLOUT */
  }
  memmove(a->out, a->out + done, a->out_len - done);
  a->out_len -= done;
}

/* One line to the operator (adds '\n'): queued behind what is owed, sent
 * as far as the socket takes it. Never blocks; a failure marks the operator
 * lost (serve notices). */
static void send_line(agent *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void send_line(agent *a, const char *fmt, ...) {
  if (a->fd < 0 || a->lost[0]) return;
  char line[PROTO_LINE_MAX];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof line - 1, fmt, ap);
  va_end(ap);
  if (n < 0 || n >= (int)sizeof line - 1) return; /* ours, all short */
  line[n++] = '\n';
  if (a->out_len + (size_t)n > sizeof a->out) {
    snprintf(a->lost, sizeof a->lost, "%zu bytes it has not taken", a->out_len);
    return;
  }
  memcpy(a->out + a->out_len, line, (size_t)n);
  a->out_len += (size_t)n;
  flush(a);
  a->owed = owed(a); /* what we added is not the operator taking less */
}

/* The bytes owed now; the operator took some since the last look when
 * they shrank (or none are owed). None taken for the grace: lost. */
static size_t look_owed(agent *a, double now) {
  size_t q = owed(a);
  if (q == 0 || q < a->owed) a->taken_at = now;
  a->owed = q;
  if (now - a->taken_at > a->grace && !a->lost[0])
    snprintf(a->lost, sizeof a->lost, "it took none of our bytes for %.0f s (operator_grace; %zu owed)", a->grace, q);
  return q;
}

/* Stopped: the lines queued for the operator, the stopped workers' EXITED
 * among them, go before the connection closes. It waits until the
 * operator took every byte (ours and the socket's queue), STOP_FLUSH_S at
 * most (the grace if shorter): a stalled operator that goes on meanwhile
 * hears each worker's real exit. (Before, the agent closed at once and what
 * the socket had not taken was dropped: the operator saw the connection
 * close and took the replicas for lost with the host.) */
static void drain(agent *a) {
  double t0 = tr_now(), bound = a->grace < STOP_FLUSH_S ? a->grace : STOP_FLUSH_S;
  size_t q = owed(a), first = q;
  if (q)
    fprintf(stderr, "agent %s: stopping: %zu bytes the operator has not taken; waiting up to %.0f s for it\n", a->name,
            q, bound);
  while (q && !a->lost[0] && tr_now() - t0 < bound) {
    struct pollfd p = {.fd = a->fd, .events = a->out_len ? POLLOUT : 0}; /* none of ours left: its acks */
    if (poll(&p, 1, 50) > 0 && (p.revents & (POLLERR | POLLHUP))) break;      /* the connection is gone */
    flush(a);
    q = owed(a);
  }
  if (q) fprintf(stderr, "agent %s: %zu bytes for the operator dropped (not taken in %.0f s)\n", a->name, q, bound);
  else if (first) fprintf(stderr, "agent %s: the operator took them\n", a->name);
}

/* --- workers --- */

static void start_worker(agent *a, const char *line) {
  int k = (int)proto_int(line, "slot", -1), threads = (int)proto_int(line, "threads", 1);
  unsigned gen = (unsigned)proto_int(line, "gen", 0);
  char log[PATH_MAX], op[320], ks[16], ts[16];
  if (!proto_get(line, "log", log, sizeof log)) snprintf(log, sizeof log, "/dev/null");
  if (k < 0 || a->n == AGENT_SLOTS) {
    send_line(a, "EXITED slot=%d gen=%u pid=0 status=%d", k, gen, 0x100);
    return;
  }
  snprintf(op, sizeof op, "%s:%d", a->at, a->at_port);
  snprintf(ks, sizeof ks, "%d", k);
  snprintf(ts, sizeof ts, "%d", threads);
  fflush(NULL);
  pid_t parent = getpid(), pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* the agent's death is the host's */
    if (getppid() != parent) _exit(127); /* ok-exit: the agent died before the line above */
    int fd = open(log, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) dup2(fd, 1), dup2(fd, 2), close(fd);
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_DFL);
    signal(SIGCHLD, SIG_DFL);
    setenv("TRANSOM_HOST", a->addr, 1);
    if (a->secret.len) setenv("TRANSOM_SECRET", a->secret_hex, 1);
    unsetenv("TRANSOM_SECRET_FILE");
    setenv("TRANSOM_LOCAL_RANK", ks, 1);
    char gs[16]; /* who started it, for its HELLO to a restarted operator: it adopts the worker as ours */
    snprintf(gs, sizeof gs, "%u", gen);
    setenv("TRANSOM_AGENT", a->name, 1);
    setenv("TRANSOM_AGENT_GEN", gs, 1);
    unsetenv("MASTER_ADDR"); /* --operator says where; RANK etc. must not override the slot */
    unsetenv("MASTER_PORT");
    unsetenv("RANK");
    unsetenv("SLURM_PROCID");
    execl(a->self, "transom", "worker", "--operator", op, "--slot", ks, "--threads", ts, (char *)NULL);
    _exit(127); /* ok-exit: exec failed in the child */
  }
  if (pid < 0) {
    send_line(a, "EXITED slot=%d gen=%u pid=0 status=%d", k, gen, 0x100);
    return;
  }
  a->pids[a->n] = pid;
  a->gens[a->n] = gen;
  a->slots[a->n++] = k;
  fprintf(stderr, "agent %s: replica %d started (pid %d)\n", a->name, k, (int)pid);
  send_line(a, "STARTED slot=%d gen=%u pid=%d", k, gen, (int)pid);
}

/* KILL names the worker by slot and SPAWN generation: the operator may ask
 * before our STARTED reached it (it does not know the pid yet). */
static void kill_worker(agent *a, const char *line) {
  int k = (int)proto_int(line, "slot", -1), sig = (int)proto_int(line, "sig", SIGKILL);
  unsigned gen = (unsigned)proto_int(line, "gen", 0);
  if (sig != SIGKILL && sig != SIGTERM && sig != SIGSTOP && sig != SIGCONT) return;
  for (int i = 0; i < a->n; i++)
    if (a->slots[i] == k && a->gens[i] == gen) kill(a->pids[i], sig);
}

static void reap(agent *a) {
  int status;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0)
    for (int i = 0; i < a->n; i++) {
      if (a->pids[i] != pid) continue;
      fprintf(stderr, "agent %s: replica %d (pid %d) exited, status 0x%x\n", a->name, a->slots[i], (int)pid, status);
      send_line(a, "EXITED slot=%d gen=%u pid=%d status=%d", a->slots[i], a->gens[i], (int)pid, status);
      a->pids[i] = a->pids[a->n - 1];
      a->gens[i] = a->gens[a->n - 1];
      a->slots[i] = a->slots[--a->n];
      break;
    }
}

/* Every worker killed (SIGKILL: the operator, not the agent, checkpoints;
 * there is no SIGTERM grace) and reaped, waiting up to 2 s for them. */
static void stop_workers(agent *a) {
  for (int i = 0; i < a->n; i++) kill(a->pids[i], SIGKILL);
  for (int tries = 0; a->n > 0 && tries < 100; tries++) {
    reap(a);
    if (a->n) usleep(20000);
  }
}

/* --- the operator --- */

/* RUN/operator.addr (RUN: the secret file's directory): its address and
 * its writer's nonce (proto.h). 0, or -1 when there is none to read. */
static int run_file(char *addr, size_t an, char *nonce, size_t nn) {
  const char *sf = getenv("TRANSOM_SECRET_FILE");
  char run[PATH_MAX];
  if (!sf || snprintf(run, sizeof run, "%s", sf) >= (int)sizeof run) return -1;
  char *slash = strrchr(run, '/');
  if (slash) *slash = 0;
  else snprintf(run, sizeof run, ".");
  return opaddr_read_nonce(run, addr, an, nonce, nn) == 0 ? 0 : -1;
}

/* Our workers for AGENT live=: SLOT:GEN:PID,... ("" when none). */
static void live_list(const agent *a, char *out, size_t n) {
  size_t len = 0;
  out[0] = 0;
  for (int i = 0; i < a->n && len + 40 < n; i++)
    len += (size_t)snprintf(out + len, n - len, "%s%d:%u:%d", i ? "," : "", a->slots[i], a->gens[i], (int)a->pids[i]);
}

/* hello's registration on a connected a->fd (hello_fd set). */
static int hello_connected(agent *a, const char *op, int port, double answer_s) {
  if (stop_sig) return tr_fail(TR_EIO, "stopped before the operator at %s:%d answered", op, port);
  local_addr(a);
  a->rd = (proto_reader){.fd = a->fd};
  struct timeval tv = {REGISTER_SEND_S, 0};
  if (setsockopt(a->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0)
    return tr_fail(TR_EIO, "setsockopt(SO_SNDTIMEO): %s", strerror(errno));
  if (auth_client(a->fd, &a->secret, answer_s)) {
    char why[512]; /* tr_fail writes the buffer tr_error() reads */
    snprintf(why, sizeof why, "%s", tr_error());
    return tr_fail(TR_EIO, "the operator at %s:%d: %s (is --secret-file RUN/secret given?)", op, port, why);
  }
  char line[PROTO_LINE_MAX], live[PROTO_LINE_MAX - 256];
  live_list(a, live, sizeof live);
  if (proto_send(a->fd, "AGENT name=%s addr=%s cores=%d gpus=%d slots=%d pid=%d%s%s", a->name, a->addr, a->cores,
                 a->gpus, a->nslots, (int)getpid(), live[0] ? " live=" : "", live))
    return tr_fail(TR_EIO, "operator: %s", strerror(errno));
  int rc = proto_read(&a->rd, line, sizeof line, (int)(answer_s * 1000));
  char why[300];
  if (rc > 0 && proto_is(line, "REFUSE") && proto_get(line, "why", why, sizeof why))
    return tr_fail(TR_EIO, "the operator at %s:%d refused us: %s", op, port, why);
  if (rc <= 0 || !proto_is(line, "WELCOME"))
    return tr_fail(TR_EIO, "the operator at %s:%d %s: %s", op, port, rc > 0 ? "refused us" : "did not answer",
                   rc > 0 ? line : "");
  a->grace = proto_num(line, "grace", GRACE_DEFAULT_S);
  if (!(a->grace > 0)) a->grace = GRACE_DEFAULT_S;
  snprintf(a->at, sizeof a->at, "%s", op);
  a->at_port = port;
  proto_get(line, "nonce", a->nonce, sizeof a->nonce);
  char addr[300];
  if (run_file(addr, sizeof addr, a->file_nonce, sizeof a->file_nonce)) a->file_nonce[0] = 0;
  fprintf(stderr, "agent %s: registered with the operator at %s:%d as %s (%d slots, %d cores; grace %.0f s)%s%s\n",
          a->name, op, port, a->addr, a->nslots, a->cores, a->grace, live[0] ? "; our workers: " : "", live);
  return 0;
}

/* Registers with the operator: connects (tries for connect_s seconds),
 * proves the secret, says AGENT (with our live workers), reads WELCOME;
 * each answer waited for answer_s at most, or until SIGTERM / SIGINT
 * (hello_fd). On failure a->fd may be open: forget_operator closes it. */
static int hello(agent *a, const char *op, int port, double connect_s, double answer_s) {
  for (double t0 = tr_now(); (a->fd = net_connect(op, port, 2.0)) < 0;) {
    if (tr_now() - t0 > connect_s || stop_sig) return tr_fail(TR_EIO, "cannot reach the operator at %s:%d", op, port);
    usleep(200000);
  }
  hello_cut = 0;
  hello_fd = a->fd;
  int rc = hello_connected(a, op, port, answer_s);
  hello_fd = -1;
  if (hello_cut) /* a registration the signal cut: a dead connection, not one to serve */
    return tr_fail(TR_EIO, "stopped while registering with the operator at %s:%d", op, port);
  return rc;
}

/* The connection to a lost operator, gone: what was queued for it too. */
static void forget_operator(agent *a) {
  if (a->fd >= 0) close(a->fd);
  a->fd = -1;
  a->out_len = a->owed = 0;
  a->lost[0] = 0;
  a->nonce[0] = 0;
  a->rd = (proto_reader){.fd = -1};
}

/* Reaps what exited (SIGCHLD's self-pipe): with no operator to hear it,
 * the worker is only forgotten. */
static void reap_pending(agent *a, int wait_ms) {
  struct pollfd p = {.fd = pipe_fds[0], .events = POLLIN};
  if (poll(&p, 1, wait_ms) > 0) {
    char buf[64];
    while (read(pipe_fds[0], buf, sizeof buf) > 0) {
    }
  }
  reap(a);
}

/* How often a registered agent looks at RUN/operator.addr. */
#define RUN_LOOK_S 0.25

/* How long one try at a restarted operator waits for each answer. */
#define REJOIN_ANSWER_S 3.0

/* Has an operator started since ours? RUN/operator.addr names another
 * nonce than our operator's WELCOME did (our workers leave it for the new
 * one at once; so do we, instead of waiting for its grace). */
static int operator_replaced(const agent *a) {
  char addr[300], nonce[64];
  return a->nonce[0] && run_file(addr, sizeof addr, nonce, sizeof nonce) == 0 && nonce[0] &&
         strcmp(nonce, a->nonce) != 0 && strcmp(nonce, a->file_nonce) != 0;
}

/* Where a restarted operator may listen other than --operator: the
 * address in RUN/operator.addr (RUN: the secret file's directory), which
 * our workers follow too; 0 when there is one that differs. */
static int run_addr(const agent *a, char *host, size_t n, int *port) {
  char text[300], nonce[64];
  if (run_file(text, sizeof text, nonce, sizeof nonce) || net_split(text, host, n, port)) return -1;
  return strcmp(host, a->op) == 0 && *port == a->op_port ? -1 : 0;
}

/* One try at registering again: at RUN/operator.addr's address if it
 * names another, then at --operator. */
static int rejoin_try(agent *a, double answer_s) {
  char host[300];
  int port;
  if (run_addr(a, host, sizeof host, &port) == 0) {
    if (hello(a, host, port, 0, answer_s) == 0) return 0;
    forget_operator(a);
    if (stop_sig) return TR_EIO;
  }
  return hello(a, a->op, a->op_port, 0, answer_s);
}

/* The operator was lost: our workers go on (they wait for a restarted
 * operator themselves); for the grace we register again, naming them
 * (rejoin_try: RUN/operator.addr's address, then --operator). 0: registered; else given up (or
 * stopped: stop_sig). */
static int rejoin(agent *a, const char *why) {
  fprintf(stderr, "agent %s: lost the operator: %s; keeping our %d worker(s), waiting up to %.0f s for a restarted one\n",
          a->name, why, a->n, a->grace);
  fflush(stderr);
  forget_operator(a);
  double t0 = tr_now();
  char last[512] = "";
  while (!stop_sig) {
    double left = a->grace - (tr_now() - t0);
    if (left <= 0) break;
    if (rejoin_try(a, left < REJOIN_ANSWER_S ? left : REJOIN_ANSWER_S) == 0) {
      fprintf(stderr, "agent %s: registered again after %.1f s\n", a->name, tr_now() - t0);
      return 0;
    }
    forget_operator(a);
    if (stop_sig) break;
    if (strcmp(last, tr_error()) != 0) fprintf(stderr, "agent %s: %s; trying again\n", a->name, tr_error());
    snprintf(last, sizeof last, "%s", tr_error());
    reap_pending(a, 250);
  }
  if (stop_sig) return TR_OK;
  return tr_fail(TR_EIO, "no operator came back within %.0f s (operator_grace)", a->grace);
}

/* The whole lines buffered so far (never waits). */
static void handle_lines(agent *a) {
  char line[PROTO_LINE_MAX];
  proto_reader *r = &a->rd;
  while (memchr(r->buf, '\n', r->len) && proto_read(r, line, sizeof line, 0) > 0) {
    if (proto_is(line, "SPAWN")) start_worker(a, line);
    else if (proto_is(line, "KILL")) kill_worker(a, line);
    else if (proto_is(line, "END")) a->ended = 1;
  }
}

/* A link probe: PROBE_LINES padded lines between PROBE and PROBE_END; the
 * operator times their arrival (operator_hosts.c: a slow link). */
static void probe(agent *a) {
  static char pad[PROBE_PAD + 1];
  if (!pad[0]) memset(pad, 'x', PROBE_PAD);
  send_line(a, "PROBE lines=%d", PROBE_LINES);
  for (int i = 0; i < PROBE_LINES; i++) send_line(a, "PAD p=%s", pad);
  send_line(a, "PROBE_END bytes=%d", PROBE_LINES * (PROBE_PAD + 7));
}

/* Heartbeats and probes go out only when nothing is owed: behind bytes
 * the operator has not taken (a busy link, a stalled operator) they would
 * say nothing new and only pile up. Returns 0 when stopped (a signal, or
 * the operator's END), 1 when the operator is lost (why in a->lost), or an
 * error. */
static int serve(agent *a) {
  double next_hb = 0, next_probe = tr_now() + PROBE_INTERVAL, next_look = 0;
  a->taken_at = tr_now();
  handle_lines(a); /* what came with WELCOME */
  while (!stop_sig && !a->ended) {
    double now = tr_now();
    flush(a);
    size_t q = look_owed(a, now);
    if (now >= next_look) {
      next_look = now + RUN_LOOK_S;
      if (operator_replaced(a)) snprintf(a->lost, sizeof a->lost, "RUN/operator.addr names a restarted operator");
    }
    if (a->lost[0]) return 1;
    if (now >= next_hb) {
      if (q == 0) send_line(a, "HB n=%d", a->n);
      next_hb = now + HB_INTERVAL;
    }
    if (now >= next_probe) {
      if (q == 0) probe(a);
      next_probe = now + PROBE_INTERVAL;
    }
    struct pollfd p[2] = {{.fd = a->fd, .events = POLLIN | (a->out_len ? POLLOUT : 0)},
                          {.fd = pipe_fds[0], .events = POLLIN}};
    if (poll(p, 2, (int)(HB_INTERVAL * 1000)) < 0 && errno != EINTR) return tr_fail(TR_EIO, "poll: %s", strerror(errno));
    if (p[1].revents & POLLIN) {
      char buf[64];
      while (read(pipe_fds[0], buf, sizeof buf) > 0) {
      }
      reap(a);
    }
    if (!(p[0].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    proto_reader *r = &a->rd;
    ssize_t got = recv(a->fd, r->buf + r->len, sizeof r->buf - r->len, MSG_DONTWAIT);
    if (got == 0 || (got < 0 && errno != EINTR && errno != EAGAIN)) {
      snprintf(a->lost, sizeof a->lost, "%s%s", got == 0 ? "it closed the connection" : "recv: ",
               got == 0 ? "" : strerror(errno));
      return 1;
    }
    if (got > 0) r->len += (size_t)got;
    handle_lines(a);
    if (r->len >= PROTO_LINE_MAX) return tr_fail(TR_EFORMAT, "a control line longer than %d bytes", PROTO_LINE_MAX);
  }
  return 0;
}

int agent_main(int argc, char **argv) {
  agent a = {.fd = -1};
  int done, rc = parse(&a, argc, argv, &done);
  if (rc || done) return rc;
  ssize_t sn = readlink("/proc/self/exe", a.self, sizeof a.self - 1);
  if (sn <= 0) return fprintf(stderr, "transom agent: cannot find the transom executable\n"), 1;
  a.self[sn] = 0;
  if (pipe2(pipe_fds, O_NONBLOCK | O_CLOEXEC) != 0) return fprintf(stderr, "transom agent: pipe: %s\n", strerror(errno)), 1;
  struct sigaction sa = {.sa_handler = on_signal, .sa_flags = SA_RESTART | SA_NOCLDSTOP};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGCHLD, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);
  signal(SIGPIPE, SIG_IGN);
  rc = hello(&a, a.op, a.op_port, 60, 30);
  if (rc && stop_sig) { /* stopped before an operator took us: nothing to hand over */
    fprintf(stderr, "agent %s: stopped (%s) before registering with the operator at %s:%d\n", a.name,
            stop_sig == SIGINT ? "SIGINT" : "SIGTERM", a.op, a.op_port);
    forget_operator(&a);
    rc = 0;
  }
  while (!rc && a.fd >= 0 && (rc = serve(&a)) == 1) {
    char why[sizeof a.lost];
    snprintf(why, sizeof why, "%s", a.lost);
    rc = rejoin(&a, why);
    if (!rc && a.fd < 0) break; /* stopped while no operator was there */
  }
  if (rc) fprintf(stderr, "transom agent %s: %s; stopping its workers\n", a.name, tr_error());
  else if (a.ended) fprintf(stderr, "agent %s: the operator ended the job\n", a.name);
  stop_workers(&a);
  if (!rc && a.fd >= 0) drain(&a); /* stopped, not lost: the operator hears what we queued */
  if (a.fd >= 0) close(a.fd);
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  return rc ? 1 : 0;
}
