/* test_ftar.c — FTAR, the fault-tolerant all-reduce: wire format, in-process
 * API, and fault-injection scenarios with real rank processes.
 *
 * The coordinator runs in this process (ftar_coord_start, its log captured
 * so reasons can be checked); ranks are `transom ftar-bench rank` processes
 * (the transom binary next to this test, or $TRANSOM_BIN), whose
 * machine-readable lines are parsed here. Every rank checks its results
 * element by element (--verify: inputs are small integers, so sums are
 * exact) and reports ok=0 on the first mismatch; this file checks
 * contributors, timing and membership. Scenarios:
 *   sizes     2, 3, 4 ranks, 1 element .. 64 MiB (odd sizes), sum and mean
 *   kill      kill -9 one of 3 ranks mid 16 MiB all-reduce: survivors finish
 *             the redo, exact over survivors, while the victim stays down (the
 *             victim signals itself at a data frame of collective 6,
 *             TRANSOM_TEST_FTAR_FAULT, so the redo path runs every time)
 *   stop      the same with SIGSTOP (detected through the heartbeat deadline)
 *             (both also with 2 ranks: the fault lands mid two-member
 *             exchange, the survivor redoes alone from its restored input)
 *   join_at   a member registered to enter at seq 20 (opts.join_seq): the
 *             group runs 11..19 without waiting for it, 20.. with it; a seq
 *             the group has passed gets FTAR_ESEQ and the group's seq
 *   join_cancel  a member lost while a joiner waits for its seq: the
 *             survivor goes on without it, the joiner is removed, a second
 *             registration meanwhile is refused
 *   join      after a kill, a new rank registers and takes part in the very
 *             next collective of the survivors
 *   garbage   random bytes, oversized lengths, bad checksums, truncated and
 *             stale frames to a rank's data port and to the coordinator: the
 *             ranks never notice (no epoch change), reasons are logged
 *   hier      members on fake hosts (--data-host 127.0.0.K): 2 hosts x 2,
 *             2 x 3 + 1 lone member, 3 hosts; exact sums and means, that
 *             the hierarchical plane ran (ftar-hier line) over the right
 *             links (shared memory within a host, TCP only between
 *             leaders, no cross-host bytes from the others), --flat on the
 *             same hosts, a bucketed call; kill -9 of a non-leader (phase
 *             1) and of a leader (phase 2), of the middle of a 3-member
 *             broadcast chain (phase 3), SIGSTOP of either, kill -9 with
 *             buckets in flight: the survivors
 *             redo, exact over the survivors; kill -9 of the end of a
 *             broadcast chain: COMMIT or redo, alike on every survivor
 *   closing   the coordinator evicts a member and is freed at once: the
 *             member still gets the BYE (FTAR_EEVICTED, "evicted by the
 *             host"), not a lost coordinator; a refused registration whose
 *             peer keeps sending after the REJECT is closed all the same
 *   stores    the shared-memory ring in process: bytes intact through
 *             wraps with plain, non-temporal and learned stores; the
 *             learning follows what its consumer reports and probes the
 *             other kind; nonsense reports steer nothing; exact sums with
 *             each kind between rank processes
 *   soak      1000 back-to-back small collectives (run from the sanitizer
 *             build, LeakSanitizer checks every rank process at exit)
 * FTAR_TEST_ONLY=hier runs only the hier cases (closing: the closing ones,
 * grid: the grid's, wire: the
 * wire format and every CRC path, stores: the shared-memory ring's kinds of
 * stores (in process, and exact sums with each), waves: the hierarchy's waves with a host
 * alone and MEAN, also part of hier).
 * The deadline is 1.5 s here. TRANSOM_LONG=1 repeats kill/stop more times.
 * TRANSOM_TIME_SCALE (check.h) stretches this file's own waits and the
 * slack over the deadline that kill/stop allow; TRANSOM_TEST_SMALL caps the
 * sizes at 65537 elements and the kill/stop collectives at 1 MiB (the
 * ThreadSanitizer pass: the threads meet the same way at any size).
 */
#define _GNU_SOURCE /* pthread_timedjoin_np */
#include <dirent.h>
#include <errno.h>
#include <event2/event.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "ftar.h"
#include "ftar_internal.h"        /* ftar_member_fail */
#include "ftar_member_internal.h" /* a frame queued for the control thread: test_leave_backlog */
#include "ftar_wire.h"
#include "rng.h"
#include "util.h"

extern char **environ;

#define DEADLINE 1.5
#define MAXP 8
/* test_grid's fault frames (see there) for 4 ranks at 4194304 and 262144 floats */
#define GRID_F_BIG 2, 40, 56, 70
#define GRID_F_SMALL 2, 5, 8, 10

static char transom_bin[PATH_MAX];
static int verbose;
static double tscale = 1; /* TRANSOM_TIME_SCALE */

/* seconds of this file's own waiting, stretched for a slow build */
static double T(double seconds) { return seconds * tscale; }

/* --- captured coordinator log --- */

static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static char coord_log[1 << 16];
static size_t coord_log_len;
static int changes[8];

static void coord_log_fn(void *ud, const char *msg) {
  (void)ud;
  pthread_mutex_lock(&log_mu);
  size_t n = strlen(msg);
  if (coord_log_len + n + 2 < sizeof coord_log) {
    memcpy(coord_log + coord_log_len, msg, n);
    coord_log_len += n;
    coord_log[coord_log_len++] = '\n';
    coord_log[coord_log_len] = 0;
  }
  pthread_mutex_unlock(&log_mu);
  if (verbose) fprintf(stderr, "  coord: %s\n", msg);
}

static void coord_change_fn(void *ud, const ftar_change *c) {
  (void)ud;
  pthread_mutex_lock(&log_mu);
  if ((unsigned)c->kind < 8) changes[c->kind]++;
  pthread_mutex_unlock(&log_mu);
}

static int coord_log_has(const char *needle) {
  pthread_mutex_lock(&log_mu);
  int r = strstr(coord_log, needle) != NULL;
  pthread_mutex_unlock(&log_mu);
  return r;
}

/* A check on the coordinator's log failed: show the log, or the failure
 * is a guess next time. */
static void coord_log_dump(const char *what) {
  pthread_mutex_lock(&log_mu);
  fprintf(stderr, "  %s: the coordinator's log:\n%s", what, coord_log);
  pthread_mutex_unlock(&log_mu);
}

static ftar_coord *coord_start(void) {
  pthread_mutex_lock(&log_mu);
  coord_log_len = 0;
  coord_log[0] = 0;
  memset(changes, 0, sizeof changes);
  pthread_mutex_unlock(&log_mu);
  ftar_coord_opts o;
  ftar_coord_opts_default(&o);
  o.deadline = DEADLINE;
  o.log = coord_log_fn;
  o.on_change = coord_change_fn;
  ftar_coord *c = ftar_coord_start("127.0.0.1", 0, &o);
  CHECK(c != NULL, "coordinator: %s", tr_error());
  return c;
}

/* --- rank processes --- */

typedef struct {
  int slot, rc, contrib, redos, ok;
  unsigned long long seq, epoch;
  size_t count;
  char slots[128];
  double t0, t1;
} result;

typedef struct {
  int slot;
  pid_t pid;
  int out, err; /* pipes, -1 once closed */
  int in;       /* the rank's stdin (--control-stdin), -1 if closed */
  char ob[16384];
  size_t olen;
  char *eb; /* captured stderr */
  size_t elen, ecap;
  result *res;
  int nres, rcap;
  int port, ready, done, errors;
  long rejected, collectives, shm_links, tcp_links, shm_streamed;
  long hier_collectives, grid_collectives, waves, cross_bytes; /* the ftar-hier line; -1 until it came */
  int exited, status;
} proc;

static void on_line(proc *p, char *line) {
  result r;
  if (sscanf(line,
             "ftar-result slot=%d seq=%llu count=%zu rc=%d epoch=%llu contrib=%d redos=%d slots=%127s ok=%d t0=%lf "
             "t1=%lf",
             &r.slot, &r.seq, &r.count, &r.rc, &r.epoch, &r.contrib, &r.redos, r.slots, &r.ok, &r.t0, &r.t1) == 11) {
    if (p->nres == p->rcap) {
      p->rcap = p->rcap ? 2 * p->rcap : 64;
      p->res = realloc(p->res, (size_t)p->rcap * sizeof *p->res);
    }
    p->res[p->nres++] = r;
  } else if (sscanf(line, "ftar-ready slot=%*d port=%d", &p->port) == 1) {
    p->ready = 1;
  } else if (strncmp(line, "ftar-error", 10) == 0) {
    p->errors++;
    fprintf(stderr, "  rank %d: %s\n", p->slot, line);
  } else if (strncmp(line, "ftar-done", 9) == 0) {
    p->done = 1;
    const char *q = strstr(line, "rejected=");
    if (q) p->rejected = atol(q + 9);
    q = strstr(line, "collectives=");
    if (q) p->collectives = atol(q + 12);
    q = strstr(line, "shm_links=");
    if (q) p->shm_links = atol(q + 10);
    q = strstr(line, "tcp_links=");
    if (q) p->tcp_links = atol(q + 10);
    q = strstr(line, "shm_streamed=");
    if (q) p->shm_streamed = atol(q + 13);
  } else if (strncmp(line, "ftar-hier", 9) == 0) {
    const char *q = strstr(line, "hier_collectives=");
    if (q) p->hier_collectives = atol(q + 17);
    q = strstr(line, "grid_collectives=");
    if (q) p->grid_collectives = atol(q + 17);
    q = strstr(line, "waves=");
    if (q) p->waves = atol(q + 6);
    q = strstr(line, "cross_bytes=");
    if (q) p->cross_bytes = atol(q + 12);
  }
  if (verbose) fprintf(stderr, "  [%d] %s\n", p->slot, line);
}

static void append_err(proc *p, const char *b, size_t n) {
  if (p->elen + n + 1 > p->ecap) {
    size_t cap = p->ecap ? p->ecap * 2 : 65536;
    while (cap < p->elen + n + 1) cap *= 2;
    if (cap > (8u << 20)) return; /* enough */
    p->eb = realloc(p->eb, cap);
    p->ecap = cap;
  }
  memcpy(p->eb + p->elen, b, n);
  p->elen += n;
  p->eb[p->elen] = 0;
  if (verbose) fwrite(b, 1, n, stderr);
}

static int spawn(proc *p, int slot, char **args) {
  memset(p, 0, sizeof *p);
  p->slot = slot;
  p->hier_collectives = p->grid_collectives = p->waves = p->cross_bytes = -1;
  int o[2], e[2], in[2];
  if (pipe(o) || pipe(e) || pipe(in)) return -1;
  fcntl(in[1], F_SETFD, FD_CLOEXEC);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, in[0], 0);
  posix_spawn_file_actions_adddup2(&fa, o[1], 1);
  posix_spawn_file_actions_adddup2(&fa, e[1], 2);
  int fds[6] = {o[0], o[1], e[0], e[1], in[0], in[1]};
  for (int i = 0; i < 6; i++) posix_spawn_file_actions_addclose(&fa, fds[i]);
  char *argv[64];
  int k = 0;
  argv[k++] = transom_bin;
  argv[k++] = "ftar-bench";
  argv[k++] = "rank";
  for (int i = 0; args[i] && k < 63; i++) argv[k++] = args[i];
  argv[k] = NULL;
  int rc = posix_spawn(&p->pid, transom_bin, &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(o[1]);
  close(e[1]);
  close(in[0]);
  p->out = o[0];
  p->err = e[0];
  p->in = in[1];
  if (rc) {
    close(in[1]);
    p->in = -1;
    close(o[0]);
    close(e[0]);
    p->out = p->err = -1;
    p->exited = 1;
    CHECK(0, "posix_spawn %s: %s", transom_bin, strerror(rc));
    return -1;
  }
  return 0;
}

/* Reads whatever the processes printed, for up to ms milliseconds. */
static void pump(proc *ps, int n, int ms) {
  struct pollfd pf[2 * MAXP];
  proc *who[2 * MAXP];
  int isout[2 * MAXP], np = 0;
  for (int i = 0; i < n; i++) {
    if (ps[i].out >= 0) {
      pf[np] = (struct pollfd){.fd = ps[i].out, .events = POLLIN};
      who[np] = &ps[i];
      isout[np++] = 1;
    }
    if (ps[i].err >= 0) {
      pf[np] = (struct pollfd){.fd = ps[i].err, .events = POLLIN};
      who[np] = &ps[i];
      isout[np++] = 0;
    }
  }
  if (np == 0) {
    usleep((useconds_t)ms * 1000);
    return;
  }
  if (poll(pf, (nfds_t)np, ms) <= 0) return;
  for (int k = 0; k < np; k++) {
    if (!pf[k].revents) continue;
    proc *p = who[k];
    if (isout[k]) {
      ssize_t r = read(p->out, p->ob + p->olen, sizeof p->ob - 1 - p->olen);
      if (r <= 0) {
        close(p->out);
        p->out = -1;
        continue;
      }
      p->olen += (size_t)r;
      p->ob[p->olen] = 0;
      char *s = p->ob, *nl;
      while ((nl = strchr(s, '\n'))) {
        *nl = 0;
        on_line(p, s);
        s = nl + 1;
      }
      p->olen = strlen(s);
      memmove(p->ob, s, p->olen + 1);
      if (p->olen == sizeof p->ob - 1) p->olen = 0;
    } else {
      char b[8192];
      ssize_t r = read(p->err, b, sizeof b);
      if (r <= 0) {
        close(p->err);
        p->err = -1;
        continue;
      }
      append_err(p, b, (size_t)r);
    }
  }
}

typedef int (*cond_fn)(proc *ps, int n, void *arg);

static int wait_until(proc *ps, int n, cond_fn f, void *arg, double seconds) {
  double end = tr_now() + seconds;
  while (!f(ps, n, arg)) {
    if (tr_now() > end) return 0;
    pump(ps, n, 20);
  }
  return 1;
}

static int each_has_results(proc *ps, int n, void *arg) {
  int want = *(int *)arg;
  for (int i = 0; i < n; i++)
    if (ps[i].nres < want) return 0;
  return 1;
}

/* Waits for every process to close its output and exit; kills the ones
 * still running after `seconds` (a failure). */
static void finish(proc *ps, int n, double seconds) {
  double end = tr_now() + seconds;
  for (;;) {
    int open = 0;
    for (int i = 0; i < n; i++) open += ps[i].out >= 0 || ps[i].err >= 0;
    if (!open || tr_now() > end) break;
    pump(ps, n, 50);
  }
  for (int i = 0; i < n; i++) {
    if (ps[i].exited) continue;
    for (;;) {
      pid_t w = waitpid(ps[i].pid, &ps[i].status, WNOHANG);
      if (w == ps[i].pid) break;
      if (tr_now() > end) {
        CHECK(0, "rank %d did not exit within %.0f s; killing it", ps[i].slot, seconds);
        kill(ps[i].pid, SIGKILL);
        waitpid(ps[i].pid, &ps[i].status, 0);
        break;
      }
      usleep(10000);
    }
    ps[i].exited = 1;
  }
  for (int i = 0; i < n; i++) {
    if (ps[i].out >= 0) close(ps[i].out);
    if (ps[i].err >= 0) close(ps[i].err);
    if (ps[i].in >= 0) close(ps[i].in);
    ps[i].out = ps[i].err = ps[i].in = -1;
  }
}

/* Tells ranks started with --control-stdin to stop after seq q. */
static void tell_until(proc *ps, int n, unsigned long long q) {
  char line[64];
  int len = snprintf(line, sizeof line, "until-seq %llu\n", q);
  for (int i = 0; i < n; i++)
    if (ps[i].in >= 0) {
      ssize_t w = write(ps[i].in, line, (size_t)len);
      (void)w;
    }
}

static int exited_ok(const proc *p) { return WIFEXITED(p->status) && WEXITSTATUS(p->status) == 0; }

static void proc_free(proc *ps, int n) {
  for (int i = 0; i < n; i++) {
    free(ps[i].res);
    free(ps[i].eb);
    ps[i].res = NULL;
    ps[i].eb = NULL;
  }
}

/* Builds "--flag value" argument lists without fuss. */
typedef struct {
  char *v[64];
  char store[64][64];
  int n;
} args;

static void arg(args *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void arg(args *a, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(a->store[a->n], sizeof a->store[a->n], fmt, ap);
  va_end(ap);
  a->v[a->n] = a->store[a->n];
  a->n++;
  a->v[a->n] = NULL;
}

/* A rank of an exact-sums run: all p in, each count reduced with op and
 * checked element by element; bucket > 0: reduced while it is written. */
static void verify_args(args *a, int p, const char *counts, const char *op, size_t bucket) {
  arg(a, "--wait");
  arg(a, "%d", p);
  arg(a, "--counts");
  arg(a, "%s", counts);
  arg(a, "--op");
  arg(a, "%s", op);
  arg(a, "--verify");
  if (bucket) {
    arg(a, "--bucket");
    arg(a, "%zu", bucket);
    arg(a, "--produce-us");
    arg(a, "20");
  }
}

static void rank_args(args *a, int port, int slot) {
  a->n = 0;
  arg(a, "--coord");
  arg(a, "127.0.0.1:%d", port);
  arg(a, "--slot");
  arg(a, "%d", slot);
  arg(a, "--timeout");
  arg(a, "%.0f", T(30));
}

static void slots_expected(char *out, size_t n, const int *slots, int k) {
  size_t off = 0;
  out[0] = 0;
  for (int i = 0; i < k; i++) off += (size_t)snprintf(out + off, n - off, "%s%d", i ? "," : "", slots[i]);
}

/* --- unit: wire format --- */

/* Every CRC path this CPU has (AVX-512 and AVX2 folding, SSE4.2 + AVX2, table), the
 * plain CRC and both fused passes (plain and non-temporal stores), against the table CRC and a plain copy /
 * add: lengths around the paths' block sizes, odd offsets, a running value. */
static void test_crc_paths(const uint8_t *b, size_t big) {
  size_t lens[] = {0, 3, 8, 252, 256, 1020, 1024, 1028, 1280, 1536, 4096, 8191, 65536, 65540, 100000};
  size_t nmax = 100000 + 128;
  uint8_t *d = malloc(nmax);
  float *dst = malloc(nmax), *ref = malloc(nmax), *save = malloc(nmax);
  int top = tr_crc32c_level(3), mism = 0;
  for (int lv = top; lv >= 0; lv--) {
    CHECK(tr_crc32c_level(lv) == lv, "crc32c path %d available", lv);
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
      for (size_t off = 0; off < 12; off++) { /* every byte offset: plain and copy; floats 4-aligned */
        size_t len = lens[li];
        if (off + len + 8 > big) continue;
        const uint8_t *src = b + off;
        uint32_t want = tr_crc32c_sw(0x5a5a5a5au, src, len);
        int bad = tr_crc32c(0x5a5a5a5au, src, len) != want;
        bad |= tr_crc32c_copy(0x5a5a5a5au, d + 1 + off % 7, src, len) != want || memcmp(d + 1 + off % 7, src, len) != 0;
        /* non-temporal: from dst's first 64-byte boundary, so every misalignment */
        uint8_t *dn = d + (li + off * 5) % 64; /* all 64 over the lengths (1024 up) that reach it */
        bad |= tr_crc32c_copy_nt(0x5a5a5a5au, dn, src, len) != want || memcmp(dn, src, len) != 0;
        if (off % 4) {
          if (bad && !mism) fprintf(stderr, "  crc32c path %d wrong at len %zu off %zu\n", lv, len, off);
          mism += bad;
          continue;
        }
        size_t n = len / 4;
        const float *fs = (const float *)(const void *)(b + 8 + off); /* 4-aligned: b is malloc'd */
        uint32_t fwant = tr_crc32c_sw(7, fs, n * 4);
        for (int nt = 0; nt < 2; nt++) { /* the non-temporal save at every float misalignment */
          float *sv = nt ? save + (li + off) % 16 : save;
          for (size_t k = 0; k < n; k++) dst[k] = ref[k] = (float)(k % 97) * 0.25f - 3.0f;
          bad |= (nt ? tr_crc32c_reduce_nt : tr_crc32c_reduce)(7, dst, sv, fs, n) != fwant;
          for (size_t k = 0; k < n; k++) {
            float sk;
            memcpy(&sk, b + 8 + off + 4 * k, 4);
            float sum = ref[k] + sk;
            if (memcmp(&dst[k], &sum, 4) != 0 || sv[k] != ref[k]) bad = 1;
          }
        }
        if (bad && !mism) fprintf(stderr, "  crc32c path %d wrong at len %zu off %zu\n", lv, len, off);
        mism += bad;
      }
  }
  CHECK(mism == 0, "crc32c paths differ from the table (or copy / add wrong) in %d cases", mism);
  tr_crc32c_level(3);
  free(d);
  free(dst);
  free(ref);
  free(save);
}

/* --- the shared-memory ring in one process: stores, tags, the choice --- */

/* A producer's ring (a) mapped as its consumer (b) through /proc/self/fd,
 * as a CONNECT would offer it. 0 on success. */
static int shm_pair(ftar_links *a, ftar_links *b, uint32_t size, int stores) {
  memset(a, 0, sizeof *a);
  memset(b, 0, sizeof *b);
  a->down_shm.memfd = b->up_shm.memfd = a->down_fd = b->up_fd = -1;
  if (ftar_shm_create(a, size, stores) != 0) return -1;
  uint8_t pay[FTAR_CONNECT_LEN] = {0};
  ftw_put32(pay + 8, (uint32_t)getpid());
  ftw_put32(pay + 12, (uint32_t)a->down_shm.memfd);
  ftw_put32(pay + 16, size);
  ftw_put64(pay + 24, a->down_shm.h->token);
  if (ftar_shm_attach(b, pay) != 0) return -1;
  a->down_shm.active = 1;
  return 0;
}

static void shm_unpair(ftar_links *a, ftar_links *b) {
  ftar_shm_unmap(&b->up_shm);
  ftar_shm_unmap(&a->down_shm);
}

/* Pushes n bytes of src through the ring (written in pieces of at most
 * piece bytes) into dst, consuming as it goes. 0 if every byte came out. */
static uint64_t shm_streamed; /* what shm_pump's writes stored non-temporally */

static int shm_pump(ftar_links *a, ftar_links *b, const uint8_t *src, uint8_t *dst, size_t n, size_t piece) {
  size_t in = 0, out = 0;
  for (int guard = 0; out < n && guard < 1000000; guard++) {
    if (in < n) {
      struct iovec iov = {(void *)(src + in), n - in < piece ? n - in : piece};
      ssize_t w = ftar_shm_write(a, &iov, 1, &shm_streamed);
      if (w < 0) return -1;
      in += (size_t)w;
    }
    size_t k;
    int bad = 0;
    const uint8_t *p = ftar_shm_peek(b, &k, &bad);
    if (bad) return -1;
    if (k > n - out) return -1; /* more than was written */
    if (k) {
      memcpy(dst + out, p, k);
      ftar_shm_consume(b, k);
      out += k;
    }
  }
  return out == n && memcmp(src, dst, n) == 0 ? 0 : -1;
}

/* The tag (0 plain, 1 non-temporal stores) the consumer sees at its next byte. */
static int shm_tag_next(const ftar_links *b) {
  const shm_link *S = &b->up_shm;
  unsigned sh = 14;
  while ((S->size >> sh) > SHM_TAGS) sh++;
  return atomic_load(&S->h->tag[(S->pos >> sh) & ((S->size >> sh) - 1)]);
}

static void test_shm_stores(void) {
  size_t n = (size_t)5 << 20; /* five times the ring: it wraps, at odd offsets */
  uint8_t *src = malloc(n), *dst = malloc(n);
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < n; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    src[i] = (uint8_t)x;
  }
  ftar_links a, b;
  /* every kind of stores, pieces of odd sizes: the bytes arrive intact */
  const int kinds[] = {0, 1, -1};
  const size_t pieces[] = {40, 4099, 65576, 300001};
  for (int ki = 0; ki < 3; ki++)
    for (int pi = 0; pi < 4; pi++) {
      if (shm_pair(&a, &b, 1u << 20, kinds[ki]) != 0) {
        CHECK(0, "shm ring pair (stores %d)", kinds[ki]);
        continue;
      }
      memset(dst, 0, n);
      size_t len = pieces[pi] == 40 ? 100000 : n - 13; /* 40-byte pieces: headers alone, not 5 MiB of them */
      shm_streamed = 0;
      CHECK(shm_pump(&a, &b, src + 13, dst, len, pieces[pi]) == 0,
            "shm ring, stores %d, pieces of %zu: %zu bytes through intact", kinds[ki], pieces[pi], len);
      /* small pieces are always copied plainly; big ones as asked (learning: some of each) */
      if (pieces[pi] >= 4099 && kinds[ki] >= 0)
        CHECK(kinds[ki] ? shm_streamed > len / 2 : shm_streamed == 0,
              "shm ring, stores %d, pieces of %zu: %llu bytes stored non-temporally", kinds[ki], pieces[pi],
              (unsigned long long)shm_streamed);
      shm_unpair(&a, &b);
    }
  /* the ring's size: the default, rounded up, capped */
  CHECK(shm_pair(&a, &b, 4u << 20, 1) == 0 && b.up_shm.size == (4u << 20), "a 4 MiB ring maps at its size");
  shm_unpair(&a, &b);

  /* the choice: the consumer's reduce pass says which stores cost it less;
   * where it says so strongly, the producer follows it whichever way */
  for (int want = 0; want < 2; want++) {
    if (shm_pair(&a, &b, 1u << 20, -1) != 0) {
      CHECK(0, "shm ring pair (learning)");
      continue;
    }
    int tags[2] = {0, 0}, picked = -1;
    for (int round = 0; round < 64; round++) {
      size_t len = 65536 + 40;
      struct iovec iov = {src, len};
      if (ftar_shm_write(&a, &iov, 1, &shm_streamed) != (ssize_t)len) break;
      int t = shm_tag_next(&b);
      tags[t & 1]++;
      /* reduce "took": 1 ms for the kind not wanted, 1 us for the other */
      ftar_shm_read_took(&b, len, t == want ? 1e-6 : 1e-3);
      ftar_shm_consume(&b, len);
      picked = a.down_shm.stream;
    }
    CHECK(tags[0] >= 4 && tags[1] >= 4, "learning stores: both kinds tried first (plain %d, non-temporal %d)", tags[0],
          tags[1]);
    CHECK(picked == want, "learning stores: the producer keeps the kind its consumer reads faster (%d, wanted %d)",
          picked, want);
    /* a STORE_TRIAL_EVERY later, copies try the other kind again */
    a.down_shm.next_trial = 0;
    struct iovec iov = {src, 65536};
    CHECK(ftar_shm_write(&a, &iov, 1, &shm_streamed) == 65536 && shm_tag_next(&b) == !want,
          "learning stores: a probe of the other kind after a while");
    shm_unpair(&a, &b);
  }

  /* a consumer that publishes nonsense (NaN, negative, huge) steers
   * nothing: the producer goes by its own copies, and the bytes stay whole */
  if (shm_pair(&a, &b, 1u << 20, -1) != 0) {
    CHECK(0, "shm ring pair (nonsense rates)");
  } else {
    const uint64_t junk[] = {0x7ff8000000000001ull, 0xbff0000000000000ull, 0x7fefffffffffffffull, 0};
    for (int i = 0; i < 4; i++) {
      atomic_store(&a.down_shm.h->read_rate[0], junk[i]);
      atomic_store(&a.down_shm.h->read_rate[1], junk[(i + 1) % 4]);
      memset(dst, 0, n);
      CHECK(shm_pump(&a, &b, src, dst, (size_t)2 << 20, 65576) == 0, "nonsense read rates %d: bytes intact", i);
    }
    shm_unpair(&a, &b);
  }
  free(src);
  free(dst);
}

static void test_wire(void) {
  CHECK(tr_crc32c(0, "123456789", 9) == 0xE3069283u, "crc32c check value");
  CHECK(tr_crc32c_sw(0, "123456789", 9) == 0xE3069283u, "crc32c (table) check value");
  size_t big = 200000;
  uint8_t *b = malloc(big);
  uint64_t x = 88172645463325252ull;
  for (size_t i = 0; i < big; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b[i] = (uint8_t)x;
  }
  int mism = 0;
  size_t lens[] = {0, 1, 7, 8, 9, 255, 256, 767, 768, 769, 4096, 24575, 24576, 24577, 65536, 100003, 199990};
  for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++)
    for (size_t off = 0; off < 9; off += 3) {
      uint32_t hw = tr_crc32c(0, b + off, lens[li]), sw = tr_crc32c_sw(0, b + off, lens[li]);
      if (hw != sw) {
        if (!mism) fprintf(stderr, "  crc32c mismatch at len %zu off %zu: %08x vs %08x\n", lens[li], off, hw, sw);
        mism++;
      }
      /* running value: crc(a||b) == crc(crc(a), b) */
      size_t cut = lens[li] / 3;
      if (tr_crc32c(tr_crc32c(0, b + off, cut), b + off + cut, lens[li] - cut) != hw) mism++;
    }
  CHECK(mism == 0, "hardware and table CRC32C differ in %d cases", mism);
  test_crc_paths(b, big);
  free(b);

  ftar_hdr h = {.type = FT_DATA, .flags = 3, .epoch = 0x1122334455667788ull, .seq = 42, .index = 7, .len = 8,
                .aux = 9};
  uint8_t enc[FTAR_HDR], pay[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  ftar_frame_build(enc, &h, pay);
  ftar_hdr d;
  ftar_hdr_decode(enc, &d);
  CHECK(d.magic == FTAR_MAGIC && d.type == FT_DATA && d.epoch == h.epoch && d.seq == 42 && d.index == 7 &&
            d.len == 8 && d.aux == 9 && d.crc == h.crc,
        "header round trip");
  CHECK(ftar_frame_crc(enc, pay, 8) == d.crc, "frame crc verifies");
  pay[3] ^= 1;
  CHECK(ftar_frame_crc(enc, pay, 8) != d.crc, "a flipped payload bit changes the crc");
  char why[200];
  CHECK(ftar_hdr_check(&d, 8, why, sizeof why) == 0, "valid header accepted: %s", why);
  d.len = 9;
  CHECK(ftar_hdr_check(&d, 8, why, sizeof why) != 0 && strstr(why, "beyond"), "DATA longer than expected: %s", why);
  d.len = 0xffffffffu;
  d.type = FT_EPOCH;
  CHECK(ftar_hdr_check(&d, 8, why, sizeof why) != 0, "huge EPOCH refused");
  d.type = 999;
  d.len = 0;
  CHECK(ftar_hdr_check(&d, 8, why, sizeof why) != 0 && strstr(why, "unknown"), "unknown type: %s", why);
  d.type = FT_DATA;
  d.magic = 0x12345678;
  CHECK(ftar_hdr_check(&d, 8, why, sizeof why) != 0 && strstr(why, "magic"), "bad magic: %s", why);
}

/* --- in-process API --- */

typedef struct {
  ftar_member *m;
  int slot, rc, n;
  float *buf;
} thr_arg;

/* 20 collectives starting at seq 2, op by seq parity; slots 0 and 1 */
static void *thr_allreduce(void *p) {
  thr_arg *a = p;
  uint64_t seq = 2;
  for (int it = 0; it < 20 && !a->rc; it++) {
    ftar_op op = seq % 2 ? FTAR_MEAN : FTAR_SUM;
    for (int i = 0; i < a->n; i++) a->buf[i] = (float)((a->slot + 1) * (i % 3 + 1));
    ftar_result r;
    int rc = ftar_allreduce(a->m, a->buf, (size_t)a->n, op, seq, &r);
    if (rc < 0) {
      a->rc = rc;
      break;
    }
    for (int i = 0; i < a->n; i++) {
      float want = (float)(3 * (i % 3 + 1)); /* (0+1) + (1+1) */
      if (op == FTAR_MEAN) want /= 2.0f;
      if (a->buf[i] != want || r.contributors != 2 || r.seq != seq) {
        a->rc = -100;
        break;
      }
    }
    seq = r.seq + 1;
  }
  return NULL;
}

typedef struct {
  ftar_member *m;
  uint64_t seq;
  int n, slot, rc;
  float *buf;
  ftar_result res;
} thr_one;

/* one SUM collective of n ones */
static void *thr_once(void *p) {
  thr_one *a = p;
  for (int i = 0; i < a->n; i++) a->buf[i] = 1.0f;
  a->rc = ftar_allreduce(a->m, a->buf, (size_t)a->n, FTAR_SUM, a->seq, &a->res);
  return NULL;
}

static void test_api(void) {
  ftar_coord *c = coord_start();
  if (!c) return;
  int port = ftar_coord_port(c);
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = 10;
  ftar_member *a = ftar_member_create("127.0.0.1", port, 0, &mo);
  CHECK(a != NULL, "member create: %s", tr_error());
  if (!a) {
    ftar_coord_free(c);
    return;
  }
  /* alone: a copy-free no-op */
  float v[5] = {1, 2, 3, 4, 5};
  ftar_result r;
  int rc = ftar_allreduce(a, v, 5, FTAR_MEAN, 1, &r);
  CHECK(rc == FTAR_OK && r.contributors == 1 && r.slots[0] == 0 && v[0] == 1 && v[4] == 5,
        "single member: rc %d contributors %d", rc, r.contributors);
  CHECK(ftar_allreduce(a, v, 5, FTAR_SUM, 1, &r) == FTAR_ESEQ, "seq must increase");
  CHECK(ftar_allreduce(a, NULL, 5, FTAR_SUM, 2, &r) == TR_EINVAL, "NULL buffer refused");
  /* a second member with the same slot is refused */
  ftar_member *dup = ftar_member_create("127.0.0.1", port, 0, &mo);
  CHECK(dup == NULL && strstr(tr_error(), "in use"), "duplicate slot refused: %s", tr_error());
  ftar_member_free(dup);
  /* two members on two threads */
  ftar_member *b = ftar_member_create("127.0.0.1", port, 1, &mo);
  CHECK(b != NULL, "second member: %s", tr_error());
  if (b) {
    CHECK(ftar_member_wait(a, 2, 5) == 0, "wait for 2 members: %s", tr_error());
    uint64_t ep;
    int slots[4];
    CHECK(ftar_coord_members(c, &ep, slots, 4) == 2 && slots[0] == 0 && slots[1] == 1, "coordinator members");
    /* a's previous seq was 1, b is fresh: both go on at seq 2 */
    thr_arg ta = {.m = a, .slot = 0, .n = 1001}, tb = {.m = b, .slot = 1, .n = 1001};
    ta.buf = malloc(1001 * sizeof(float));
    tb.buf = malloc(1001 * sizeof(float));
    pthread_t t1, t2;
    pthread_create(&t1, NULL, thr_allreduce, &ta);
    pthread_create(&t2, NULL, thr_allreduce, &tb);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    CHECK(ta.rc == 0, "two in-process members: a: %d", ta.rc);
    CHECK(tb.rc == 0, "two in-process members: b: %d", tb.rc);
    free(ta.buf);
    free(tb.buf);
    /* eviction: b gets FTAR_EEVICTED, a goes on alone */
    CHECK(ftar_coord_evict(c, 1) == 0, "evict request");
    double end = tr_now() + T(5);
    uint64_t seq = 100;
    do {
      rc = ftar_allreduce(b, v, 5, FTAR_SUM, seq++, &r);
      if (rc == FTAR_EEVICTED) break;
      usleep(20000);
    } while (tr_now() < end);
    CHECK(rc == FTAR_EEVICTED, "evicted member gets FTAR_EEVICTED (got %d: %s)", rc, tr_error());
    CHECK(coord_log_has("evicting slot 1"), "eviction logged");
    ftar_member_free(b);
    /* strict_seq: a joiner with the wrong seq gets FTAR_ESEQ and the group's
     * seq, stays a member (a waits for it), and enters with that seq */
    ftar_member_opts so = mo;
    so.strict_seq = 1;
    ftar_member *j = ftar_member_create("127.0.0.1", port, 2, &so);
    CHECK(j != NULL, "strict joiner: %s", tr_error());
    if (j) {
      thr_one one = {.m = a, .seq = 22, .n = 333, .slot = 0};
      one.buf = calloc(333, sizeof(float));
      pthread_t th;
      pthread_create(&th, NULL, thr_once, &one);
      float jb[333];
      for (int i = 0; i < 333; i++) jb[i] = 3.0f;
      ftar_result jr;
      rc = ftar_allreduce(j, jb, 333, FTAR_SUM, 5, &jr);
      CHECK(rc == FTAR_ESEQ && jr.seq == 22 && jb[0] == 3.0f, "strict joiner told the group's seq: rc %d seq %llu",
            rc, (unsigned long long)jr.seq);
      rc = ftar_allreduce(j, jb, 333, FTAR_SUM, jr.seq, &jr);
      pthread_join(th, NULL);
      CHECK(rc >= 0 && jr.contributors == 2 && jb[0] == 4.0f && jb[332] == 4.0f, "strict joiner entered: rc %d %g", rc,
            (double)jb[0]);
      CHECK(one.rc >= 0 && one.res.contributors == 2 && one.buf[0] == 4.0f, "the group waited for it: rc %d",
            one.rc);
      free(one.buf);
      ftar_member_free(j);
    }
  }
  pthread_mutex_lock(&log_mu);
  int joins = changes[FTAR_CHANGE_JOIN], evicts = changes[FTAR_CHANGE_EVICTED];
  pthread_mutex_unlock(&log_mu);
  CHECK(joins == 3 && evicts == 1, "on_change saw %d joins, %d evictions", joins, evicts);
  ftar_member_free(a);
  ftar_coord_free(c);
}

/* --- a join at a chosen seq (opts.join_seq) --- */

typedef struct {
  ftar_member *m;
  int slot, rc;
  uint64_t from, to, pause_after; /* seqs run; after pause_after, wait for go */
  int contributors[64];           /* per seq */
  float sums[64];
  atomic_int *go;
  atomic_int reached; /* the last seq done (the main thread polls it) */
} thr_range;

/* SUM of (slot + 1) for seq from..to, pausing after pause_after until *go. */
static void *thr_range_run(void *p) {
  thr_range *a = p;
  for (uint64_t seq = a->from; seq <= a->to && !a->rc; seq++) {
    float v[100];
    for (int i = 0; i < 100; i++) v[i] = (float)(a->slot + 1);
    ftar_result r;
    int rc = ftar_allreduce(a->m, v, 100, FTAR_SUM, seq, &r);
    if (rc < 0) a->rc = rc;
    a->contributors[seq] = r.contributors;
    a->sums[seq] = v[99];
    atomic_store(&a->reached, (int)seq);
    while (seq == a->pause_after && !atomic_load(a->go)) usleep(1000);
  }
  return NULL;
}

/* Two members run seqs 1..30; a third registers while they pause after 10,
 * asking to enter at 20: seqs 11..19 run without it (nobody waits for it),
 * 20..30 with it. A joiner asking for a seq the group has passed is told
 * the group's (FTAR_ESEQ) and can enter there. */
static void test_join_at(void) {
  ftar_coord *c = coord_start();
  if (!c) return;
  int port = ftar_coord_port(c);
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = T(20);
  mo.strict_seq = 1;
  atomic_int go = 0;
  thr_range t[3] = {{.slot = 0, .from = 1, .to = 30, .pause_after = 10, .go = &go},
                    {.slot = 1, .from = 1, .to = 30, .pause_after = 10, .go = &go},
                    {.slot = 2, .from = 20, .to = 30, .pause_after = 0, .go = &go}};
  for (int i = 0; i < 2; i++) t[i].m = ftar_member_create("127.0.0.1", port, i, &mo);
  CHECK(t[0].m && t[1].m && ftar_member_wait(t[0].m, 2, T(10)) == 0, "two members: %s", tr_error());
  pthread_t th[3];
  for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, thr_range_run, &t[i]);
  while (atomic_load(&t[0].reached) < 10 || atomic_load(&t[1].reached) < 10) usleep(1000);
  ftar_member_opts jo = mo;
  jo.join_seq = 20;
  t[2].m = ftar_member_create("127.0.0.1", port, 2, &jo);
  CHECK(t[2].m != NULL, "joiner at seq 20: %s", tr_error());
  /* both know the epoch that adds it before they go on (no race with the EPOCH frame) */
  for (int i = 0; i < 2; i++)
    CHECK(!t[2].m || ftar_member_wait(t[i].m, 3, T(10)) == 0, "member %d sees the joiner: %s", i, tr_error());
  pthread_create(&th[2], NULL, thr_range_run, &t[2]);
  atomic_store(&go, 1);
  for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
  int ok = !t[0].rc && !t[1].rc && !t[2].rc;
  for (int i = 0; i < 3; i++)
    for (uint64_t s = i == 2 ? 20 : 1; s <= 30; s++) {
      int want = s < 20 ? 2 : 3;
      ok &= t[i].contributors[s] == want && t[i].sums[s] == (float)(want * (want + 1) / 2);
    }
  CHECK(ok, "entered at 20 exactly: rc %d %d %d; seq 19: %d, seq 20: %d contributors", t[0].rc, t[1].rc, t[2].rc,
        t[0].contributors[19], t[0].contributors[20]);
  /* a seq the group has passed: FTAR_ESEQ with the group's */
  ftar_member_opts lo = mo;
  lo.join_seq = 5;
  ftar_member *late = ftar_member_create("127.0.0.1", port, 3, &lo);
  CHECK(late != NULL, "late joiner: %s", tr_error());
  for (int i = 0; i < 3 && late; i++) /* they know its epoch before they run 31 (else 31 may run without it) */
    CHECK(ftar_member_wait(t[i].m, 4, T(10)) == 0, "member %d sees the late joiner: %s", i, tr_error());
  if (late) {
    thr_range g[3];
    for (int i = 0; i < 3; i++) {
      g[i] = (thr_range){.m = t[i].m, .slot = i, .from = 31, .to = 31, .go = &go};
      pthread_create(&th[i], NULL, thr_range_run, &g[i]);
    }
    float v[100];
    for (int i = 0; i < 100; i++) v[i] = 4.0f;
    ftar_result r;
    int rc = ftar_allreduce(late, v, 100, FTAR_SUM, 5, &r);
    CHECK(rc == FTAR_ESEQ && r.seq == 31, "a passed seq: rc %d, the group's seq %llu", rc,
          (unsigned long long)r.seq);
    rc = ftar_allreduce(late, v, 100, FTAR_SUM, 31, &r);
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    CHECK(rc >= 0 && r.contributors == 4 && v[0] == 10.0f && g[0].sums[31] == 10.0f, "then enters at 31: rc %d %g",
          rc, (double)v[0]);
    ftar_member_free(late);
  }
  for (int i = 0; i < 3; i++) ftar_member_free(t[i].m);
  ftar_coord_free(c);
}

/* A member lost while a joiner waits to enter at seq 20: the survivor
 * goes on at once without it (it must not wait for a joiner still
 * catching up); the joiner is removed and told so, and a new
 * registration can then enter where it asks. */
static void test_join_cancel(void) {
  ftar_coord *c = coord_start();
  if (!c) return;
  int port = ftar_coord_port(c);
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = T(20);
  mo.strict_seq = 1;
  atomic_int go = 0;
  thr_range t[2] = {{.slot = 0, .from = 1, .to = 30, .pause_after = 10, .go = &go},
                    {.slot = 1, .from = 1, .to = 10, .go = &go}};
  for (int i = 0; i < 2; i++) t[i].m = ftar_member_create("127.0.0.1", port, i, &mo);
  CHECK(t[0].m && t[1].m && ftar_member_wait(t[0].m, 2, T(10)) == 0, "two members: %s", tr_error());
  pthread_t th[2];
  for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, thr_range_run, &t[i]);
  pthread_join(th[1], NULL);
  while (atomic_load(&t[0].reached) < 10) usleep(1000);
  ftar_member_opts jo = mo;
  jo.join_seq = 20;
  ftar_member *j = ftar_member_create("127.0.0.1", port, 2, &jo);
  CHECK(j != NULL, "joiner at seq 20: %s", tr_error());
  ftar_member_opts oo = mo;
  oo.join_seq = 25;
  ftar_member *other = ftar_member_create("127.0.0.1", port, 3, &oo);
  CHECK(other == NULL && strstr(tr_error(), "entering at seq 20"), "a second join while one is pending: %s",
        other ? "accepted" : tr_error());
  ftar_member_free(other);
  ftar_member_free(t[1].m); /* lost before seq 20 */
  t[1].m = NULL;
  atomic_store(&go, 1);
  pthread_join(th[0], NULL);
  int ok = !t[0].rc;
  for (uint64_t s = 11; s <= 30; s++) ok &= t[0].contributors[s] == 1 && t[0].sums[s] == 1.0f;
  CHECK(ok, "the survivor ran 11..30 alone: rc %d (%s), seq 11: %d, seq 20: %d contributors", t[0].rc,
        t[0].rc ? tr_error() : "", t[0].contributors[11], t[0].contributors[20]);
  if (j) {
    float v[100] = {0};
    ftar_result r;
    int rc = ftar_allreduce(j, v, 100, FTAR_SUM, 20, &r);
    CHECK(rc == FTAR_EEVICTED && strstr(tr_error(), "before seq 20"), "the joiner was removed: rc %d %s", rc,
          tr_error());
    ftar_member_free(j);
  }
  /* registered again, further ahead: enters there */
  jo.join_seq = 35;
  thr_range a = {.m = t[0].m, .slot = 0, .from = 31, .to = 40, .go = &go};
  thr_range b = {.slot = 2, .from = 35, .to = 40, .go = &go};
  b.m = ftar_member_create("127.0.0.1", port, 2, &jo);
  CHECK(b.m != NULL, "joiner at seq 35: %s", tr_error());
  /* the survivor knows the epoch that adds it before it runs 31.. (alone,
   * those need no coordinator and would outrun the EPOCH frame) */
  CHECK(!b.m || ftar_member_wait(t[0].m, 2, T(10)) == 0, "the survivor sees the joiner: %s", tr_error());
  if (b.m) {
    pthread_create(&th[0], NULL, thr_range_run, &a);
    pthread_create(&th[1], NULL, thr_range_run, &b);
    pthread_join(th[0], NULL);
    pthread_join(th[1], NULL);
    CHECK(!a.rc && !b.rc && a.contributors[34] == 1 && a.contributors[35] == 2 && b.sums[40] == 4.0f,
          "entered at 35: rc %d %d, seq 34: %d, 35: %d contributors", a.rc, b.rc, a.contributors[34],
          a.contributors[35]);
    ftar_member_free(b.m);
  }
  ftar_member_free(t[0].m);
  ftar_coord_free(c);
  /* the only other member lost while a joiner waits: it is the group now,
   * nobody waits for it, and it enters at its seq alone */
  if (!(c = coord_start())) return;
  port = ftar_coord_port(c);
  ftar_member *x = ftar_member_create("127.0.0.1", port, 0, &mo);
  jo.join_seq = 5;
  ftar_member *y = x ? ftar_member_create("127.0.0.1", port, 1, &jo) : NULL;
  CHECK(x && y && ftar_member_wait(x, 2, T(10)) == 0, "a member and a joiner at seq 5: %s", tr_error());
  ftar_member_free(x);
  if (y) {
    float v[100] = {0};
    ftar_result r;
    int rc = ftar_allreduce(y, v, 100, FTAR_SUM, 5, &r);
    CHECK(rc >= 0 && r.contributors == 1 && r.seq == 5, "the joiner left alone enters at 5: rc %d %s", rc,
          rc < 0 ? tr_error() : "");
    ftar_member_free(y);
  }
  ftar_coord_free(c);
}

/* --- buckets reduced while the input is still written (ftar_allreduce_start) --- */

typedef struct {
  ftar_member *m;
  int slot, rc, nm;
  size_t n, bucket; /* bucket 0: plain ftar_allreduce */
  uint64_t seq;
  float *in, *buf; /* the input; where it is produced and reduced */
  ftar_result res;
} thr_bucket;

/* One MEAN collective of in[0..n): plain, or started first and produced
 * from the end a few floats at a time (backward's order), each piece
 * declared final, so buckets are reduced while later ones are written. */
static void *thr_bucketed(void *p) {
  thr_bucket *a = p;
  if (!a->bucket) {
    memcpy(a->buf, a->in, a->n * sizeof(float));
    a->rc = ftar_allreduce(a->m, a->buf, a->n, FTAR_MEAN, a->seq, &a->res);
    return NULL;
  }
  memset(a->buf, 0xff, a->n * sizeof(float)); /* NaN until produced: a bucket read early shows */
  a->rc = ftar_allreduce_start(a->m, a->buf, a->n, FTAR_MEAN, a->seq, a->bucket);
  if (a->rc) return NULL;
  size_t piece = a->bucket / 3 + 1;
  for (size_t hi = a->n; hi > 0;) {
    size_t lo = hi > piece ? hi - piece : 0;
    memcpy(a->buf + lo, a->in + lo, (hi - lo) * sizeof(float));
    ftar_allreduce_ready(a->m, lo);
    hi = lo;
  }
  double comm = -1;
  a->rc = ftar_allreduce_wait(a->m, &a->res, &comm);
  if (a->rc >= 0 && !(comm >= 0)) a->rc = -101;
  return NULL;
}

/* Runs one collective on every member at once; 0 if all succeeded with
 * every member as a contributor. */
static int run_members(thr_bucket *t, int nm) {
  pthread_t th[4];
  for (int i = 0; i < nm; i++) pthread_create(&th[i], NULL, thr_bucketed, &t[i]);
  for (int i = 0; i < nm; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < nm; i++)
    if (t[i].rc < 0 || t[i].res.contributors != nm) return -1;
  return 0;
}

/* Bits of the bucketed result against ftar_allreduce's: equal at 2
 * members for any bucket (a + b == b + a), and at 3 for one bucket; at 3
 * with many buckets every member holds the same bits. */
static void test_buckets(void) {
  ftar_coord *c = coord_start();
  if (!c) return;
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = 30;
  const size_t n = 300007;
  ftar_member *ms[3] = {0};
  thr_bucket t[3];
  float *ref[3];
  uint64_t seq = 1;
  for (int nm = 2; nm <= 3; nm++) {
    ms[nm - 1] = ftar_member_create("127.0.0.1", ftar_coord_port(c), nm - 1, &mo);
    CHECK(ms[nm - 1] != NULL, "bucket test member %d: %s", nm - 1, tr_error());
    if (!ms[nm - 1] || (nm == 2 && !(ms[0] = ftar_member_create("127.0.0.1", ftar_coord_port(c), 0, &mo)))) break;
    CHECK(ftar_member_wait(ms[0], nm, T(10)) == 0, "bucket test: %d members: %s", nm, tr_error());
    rng_t r;
    for (int i = 0; i < nm; i++) {
      t[i] = (thr_bucket){.m = ms[i], .slot = i, .n = n, .nm = nm};
      t[i].in = malloc(n * sizeof(float));
      t[i].buf = malloc(n * sizeof(float));
      ref[i] = malloc(n * sizeof(float));
      rng_seed(&r, 77u + (unsigned)i);
      for (size_t k = 0; k < n; k++) t[i].in[k] = (float)(rng_uniform(&r) * 2 - 1) * (float)(1 + k % 7);
    }
    /* reference: the plain collective */
    for (int i = 0; i < nm; i++) t[i].seq = seq, t[i].bucket = 0;
    seq++;
    CHECK(run_members(t, nm) == 0, "bucket test: plain collective at %d members", nm);
    for (int i = 0; i < nm; i++) memcpy(ref[i], t[i].buf, n * sizeof(float));
    size_t buckets[] = {1000, 65536, 4 * n};
    for (int b = 0; b < 3; b++) {
      for (int i = 0; i < nm; i++) t[i].seq = seq, t[i].bucket = buckets[b];
      seq++;
      int rc = run_members(t, nm);
      CHECK(rc == 0, "bucket test: %d members, bucket %zu: rc %d %d", nm, buckets[b], t[0].rc, t[1].rc);
      if (rc) continue;
      int same_as_plain = memcmp(t[0].buf, ref[0], n * sizeof(float)) == 0, agree = 1;
      for (int i = 1; i < nm; i++) agree &= memcmp(t[0].buf, t[i].buf, n * sizeof(float)) == 0;
      CHECK(agree, "bucket test: %d members, bucket %zu: members hold different bits", nm, buckets[b]);
      if (nm == 2 || buckets[b] >= n)
        CHECK(same_as_plain, "bucket test: %d members, bucket %zu: bits differ from ftar_allreduce", nm, buckets[b]);
      else /* the same values up to the order of the additions */
        for (size_t k = 0; k < n; k += 997)
          CHECK(fabsf(t[0].buf[k] - ref[0][k]) <= 1e-6f * (1 + fabsf(ref[0][k])), "bucket test: [%zu] %g vs %g", k,
                (double)t[0].buf[k], (double)ref[0][k]);
      printf("  buckets: %d members, bucket %zu floats: %s\n", nm, buckets[b],
             same_as_plain ? "bit-identical to ftar_allreduce" : "members agree; differs from ftar_allreduce");
    }
    for (int i = 0; i < nm; i++) {
      free(t[i].in);
      free(t[i].buf);
      free(ref[i]);
    }
  }
  /* an empty buffer (n = 0: no bucket ever becomes ready) completes, as
   * ftar_allreduce of 0 floats does; the communication thread used to wait
   * for a first bucket that cannot exist, and wait never returned */
  if (ms[0] && ms[1] && ms[2]) {
    float none[1];
    for (int i = 0; i < 3; i++) t[i] = (thr_bucket){.m = ms[i], .slot = i, .n = 0, .nm = 3, .bucket = 16,
                                                    .seq = seq, .in = none, .buf = none};
    seq++;
    pthread_t th[3];
    for (int i = 0; i < 3; i++) pthread_create(&th[i], NULL, thr_bucketed, &t[i]);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 20;
    int joined = 0;
    for (int i = 0; i < 3; i++) joined += pthread_timedjoin_np(th[i], NULL, &until) == 0;
    CHECK(joined == 3 && t[0].rc >= 0 && t[1].rc >= 0 && t[2].rc >= 0,
          "bucket test: a bucketed collective of 0 floats completes (%d of 3 returned within 20 s)", joined);
    if (joined < 3) { /* unstick them: a failed member's call ends (in error), then they return */
      for (int i = 0; i < 3; i++) ftar_member_fail(ms[i], FTAR_ECOORD, "test: unstuck");
      for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
      for (int i = 0; i < 3; i++) ftar_member_free(ms[i]), ms[i] = NULL;
    }
  }
  /* misuse: wait without start; a plain call while one is in flight */
  ftar_result res;
  CHECK(ftar_allreduce_wait(ms[0], &res, NULL) == TR_ESTATE, "wait without start refused");
  float v[64] = {0};
  if (ms[0]) {
    CHECK(ftar_allreduce_start(ms[0], v, 64, FTAR_SUM, seq, 16) == 0, "start: %s", tr_error());
    CHECK(ftar_allreduce(ms[0], v, 64, FTAR_SUM, seq, &res) == TR_ESTATE, "a plain call while one is in flight");
    ftar_allreduce_ready(ms[0], 0);
  }
  /* freed with that collective in flight (the others never join it): the
   * communication thread is stopped and joined, nothing hangs */
  double t_free = tr_now();
  for (int i = 0; i < 3; i++) ftar_member_free(ms[i]);
  printf("  buckets: a member freed with a bucketed collective in flight: %.2f s\n", tr_now() - t_free);
  ftar_coord_free(c);
}

/* --- a coordinator on a loop the test drives: stalls, new coordinators --- */

typedef struct {
  struct event_base *base;
  ftar_coord *c;
  _Atomic int quit, stall_ms, release_at; /* release_at: lift the hold at this many registrations */
  _Atomic int stalling;                    /* the loop is in the stall now */
  pthread_t th;
} loop_drv;

static void *drv_main(void *p) {
  loop_drv *d = p;
  while (!d->quit) {
    int st = d->stall_ms;
    if (st) { /* what a long REPL expression does to the operator's loop */
      d->stalling = 1;
      usleep((useconds_t)st * 1000);
      d->stall_ms = 0;
      d->stalling = 0;
    }
    if (d->release_at && ftar_coord_registered(d->c) >= d->release_at) {
      ftar_coord_hold(d->c, 0);
      d->release_at = 0;
    }
    event_base_loop(d->base, EVLOOP_NONBLOCK);
    usleep(1000);
  }
  return NULL;
}

static int drv_start(loop_drv *d, int hold) {
  memset(d, 0, sizeof *d);
  pthread_mutex_lock(&log_mu);
  coord_log_len = 0;
  coord_log[0] = 0;
  memset(changes, 0, sizeof changes);
  pthread_mutex_unlock(&log_mu);
  ftar_coord_opts o;
  ftar_coord_opts_default(&o);
  o.deadline = 1.0;
  o.log = coord_log_fn;
  o.on_change = coord_change_fn;
  d->base = event_base_new();
  d->c = d->base ? ftar_coord_create(d->base, "127.0.0.1", 0, &o) : NULL;
  CHECK(d->c != NULL, "embedded coordinator: %s", tr_error());
  if (!d->c) return -1;
  if (hold) ftar_coord_hold(d->c, 1);
  pthread_create(&d->th, NULL, drv_main, d);
  return 0;
}

static void drv_stop(loop_drv *d) {
  if (d->c) {
    d->quit = 1;
    pthread_join(d->th, NULL);
    ftar_coord_free(d->c);
  }
  if (d->base) event_base_free(d->base);
}

static int changes_of(int kind) {
  pthread_mutex_lock(&log_mu);
  int n = changes[kind];
  pthread_mutex_unlock(&log_mu);
  return n;
}

/* The coordinator's loop stalls 3 s (3 x its deadline, as a long expression
 * typed into `transom attach` would): no healthy member lapses, the group
 * keeps its epoch and goes on. */
static void test_stall(void) {
  loop_drv d;
  if (drv_start(&d, 0)) return;
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = 20;
  ftar_member *a = ftar_member_create("127.0.0.1", ftar_coord_port(d.c), 0, &mo);
  ftar_member *b = a ? ftar_member_create("127.0.0.1", ftar_coord_port(d.c), 1, &mo) : NULL;
  CHECK(a && b, "stall: members: %s", tr_error());
  if (a && b) {
    CHECK(ftar_member_wait(a, 2, 5) == 0, "stall: wait for 2 members: %s", tr_error());
    uint64_t ep0 = ftar_member_epoch(a, NULL);
    d.stall_ms = 3000;
    usleep(3600 * 1000); /* the stall, then a moment of the loop running again */
    usleep(1500 * 1000); /* more than the deadline: a member dropped after the stall would be gone by now */
    CHECK(changes_of(FTAR_CHANGE_LAPSED) == 0, "stall: a healthy member lapsed during a stalled loop");
    CHECK(coord_log_has("stalled"), "stall: the stall is logged");
    CHECK(ftar_member_epoch(a, NULL) == ep0, "stall: the epoch changed (%llu -> %llu)", (unsigned long long)ep0,
          (unsigned long long)ftar_member_epoch(a, NULL));
    thr_arg ta = {.m = a, .slot = 0, .n = 1001}, tb = {.m = b, .slot = 1, .n = 1001};
    ta.buf = malloc(1001 * sizeof(float));
    tb.buf = malloc(1001 * sizeof(float));
    pthread_t t1, t2;
    pthread_create(&t1, NULL, thr_allreduce, &ta);
    pthread_create(&t2, NULL, thr_allreduce, &tb);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    CHECK(ta.rc == 0 && tb.rc == 0, "stall: collectives after the stall: %d %d", ta.rc, tb.rc);
    free(ta.buf);
    free(tb.buf);
  }
  ftar_member_free(a);
  ftar_member_free(b);
  drv_stop(&d);
}

/* The coordinator dies with a collective in flight; members that survive
 * the loss re-register with a new one (held until both are back): the
 * collective is redone there by both, exact, in one epoch above the old. */
static void test_new_coordinator(void) {
  ftar_coord *c1 = coord_start();
  if (!c1) return;
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = 20;
  mo.survive_coord_loss = 1;
  ftar_member *a = ftar_member_create("127.0.0.1", ftar_coord_port(c1), 0, &mo);
  ftar_member *b = a ? ftar_member_create("127.0.0.1", ftar_coord_port(c1), 1, &mo) : NULL;
  CHECK(a && b, "new coordinator: members: %s", tr_error());
  loop_drv d = {0};
  if (a && b && ftar_member_wait(a, 2, 5) == 0) {
    thr_arg ta = {.m = a, .slot = 0, .n = 1001}, tb = {.m = b, .slot = 1, .n = 1001};
    ta.buf = malloc(1001 * sizeof(float));
    tb.buf = malloc(1001 * sizeof(float));
    pthread_t t1, t2;
    pthread_create(&t1, NULL, thr_allreduce, &ta);
    pthread_create(&t2, NULL, thr_allreduce, &tb);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    CHECK(ta.rc == 0 && tb.rc == 0, "new coordinator: before: %d %d", ta.rc, tb.rc);
    free(ta.buf);
    free(tb.buf);
    uint64_t ep_old = ftar_member_epoch(a, NULL);
    /* a is inside its next collective when the coordinator goes; b comes later */
    thr_one oa = {.m = a, .seq = 22, .n = 4097, .slot = 0}, ob = {.m = b, .seq = 22, .n = 4097, .slot = 1};
    oa.buf = calloc(4097, sizeof(float));
    ob.buf = calloc(4097, sizeof(float));
    pthread_t ha, hb;
    pthread_create(&ha, NULL, thr_once, &oa);
    usleep(100 * 1000);
    ftar_coord_free(c1);
    c1 = NULL;
    usleep(300 * 1000);
    pthread_create(&hb, NULL, thr_once, &ob);
    if (drv_start(&d, 1) == 0) {
      d.release_at = 2;
      int port = ftar_coord_port(d.c);
      CHECK(ftar_member_reconnect(a, "127.0.0.1", port, 5) == 0, "reconnect a: %s", tr_error());
      usleep(200 * 1000); /* held: a must not run alone meanwhile */
      CHECK(changes_of(FTAR_CHANGE_JOIN) == 0, "new coordinator: an epoch went out while held");
      CHECK(ftar_member_reconnect(b, "127.0.0.1", port, 5) == 0, "reconnect b: %s", tr_error());
    }
    pthread_join(ha, NULL);
    pthread_join(hb, NULL);
    CHECK(oa.rc >= 0 && ob.rc >= 0, "new coordinator: the collective in flight: %d %d", oa.rc, ob.rc);
    CHECK(oa.res.contributors == 2 && ob.res.contributors == 2 && oa.buf[0] == 2.0f && ob.buf[4096] == 2.0f,
          "new coordinator: redone by both: contributors %d %d, %g %g", oa.res.contributors, ob.res.contributors,
          (double)oa.buf[0], (double)ob.buf[4096]);
    CHECK(oa.res.epoch > ep_old && oa.res.epoch == ob.res.epoch, "new coordinator: epoch %llu after %llu",
          (unsigned long long)oa.res.epoch, (unsigned long long)ep_old);
    CHECK(changes_of(FTAR_CHANGE_JOIN) == 1, "new coordinator: one epoch for both (%d)", changes_of(FTAR_CHANGE_JOIN));
    free(oa.buf);
    free(ob.buf);
  }
  ftar_member_free(a);
  ftar_member_free(b);
  ftar_coord_free(c1);
  drv_stop(&d);
}

/* --- sizes: exact sums at 2, 3, 4 ranks --- */

/* bucket > 0: every rank reduces in buckets of that many floats while it
 * still writes its input (ftar-bench rank --bucket) */
/* --shm-stores for test_sizes' ranks (NULL: their default, auto) */
static const char *sizes_stores;

static void test_sizes(int p, const char *op, int tcp, const char *counts_csv, size_t bucket) {
  double t0 = tr_now();
  ftar_coord *c = coord_start();
  if (!c) return;
  proc ps[MAXP];
  int ncounts = 1;
  for (const char *q = counts_csv; *q; q++) ncounts += *q == ',';
  for (int r = 0; r < p; r++) {
    args a;
    rank_args(&a, ftar_coord_port(c), r);
    verify_args(&a, p, counts_csv, op, bucket);
    if (tcp == 1) arg(&a, "--tcp");
    if (sizes_stores) {
      arg(&a, "--shm-stores");
      arg(&a, "%s", sizes_stores);
    }
    if (tcp == 2) { /* a host each: TCP because nothing is shared, not because --tcp says so */
      arg(&a, "--data-host");
      arg(&a, "127.0.0.%d", r + 1);
    }
    spawn(&ps[r], r, a.v);
  }
  finish(ps, p, T(120));
  int want[MAXP];
  for (int r = 0; r < p; r++) want[r] = r;
  char sl[64];
  slots_expected(sl, sizeof sl, want, p);
  for (int r = 0; r < p; r++) {
    CHECK(exited_ok(&ps[r]), "%d ranks %s: rank %d exit status %d", p, op, r, ps[r].status);
    CHECK(ps[r].nres == ncounts, "%d ranks %s: rank %d reported %d of %d results", p, op, r, ps[r].nres, ncounts);
    int bad = 0;
    for (int i = 0; i < ps[r].nres; i++) {
      result *x = &ps[r].res[i];
      if (!x->ok || x->rc != 0 || x->contrib != p || strcmp(x->slots, sl) || x->redos) {
        if (!bad)
          fprintf(stderr, "  %d ranks: rank %d count %zu: ok %d rc %d contrib %d slots %s redos %d\n", p, r, x->count,
                  x->ok, x->rc, x->contrib, x->slots, x->redos);
        bad++;
      }
    }
    CHECK(bad == 0, "%d ranks %s: rank %d: %d results wrong", p, op, r, bad);
    /* the transport asked for is the one used: two links per member, four
     * in the grid (a host each, an even number >= 4: a pair and a column) */
    int grid = tcp == 2 && p >= 4 && p % 2 == 0;
    CHECK(tcp ? ps[r].shm_links == 0 && ps[r].tcp_links == (grid ? 4 : 2) : ps[r].shm_links == 2 && ps[r].tcp_links == 0,
          "%d ranks %s: rank %d used %ld shm and %ld tcp links", p, tcp ? "tcp" : "shm", r, ps[r].shm_links,
          ps[r].tcp_links);
    if (sizes_stores) /* the kind asked for is the kind used: counts >= 4097 floats are stored non-temporally */
      CHECK(strcmp(sizes_stores, "stream") == 0 ? ps[r].shm_streamed > 0 : ps[r].shm_streamed == 0,
            "%d ranks, stores %s: rank %d stored %ld bytes non-temporally", p, sizes_stores, r, ps[r].shm_streamed);
    CHECK(ps[r].grid_collectives == (grid ? ncounts : 0), "%d ranks %s %s: rank %d ran %ld of %d collectives as a grid",
          p, op, tcp ? "tcp" : "shm", r, ps[r].grid_collectives, ncounts);
  }
  /* finishing ranks leave cleanly: a boundary epoch, not an aborting one */
  CHECK(coord_log_has("leaves after seq") && !coord_log_has("connection closed"),
        "%d ranks: ranks that finished left cleanly", p);
  printf("  sizes: %d ranks, %s, %s%s%s, %d sizes%s: %.1f s\n", p, op, tcp == 2 ? "a host each" : tcp ? "tcp" : "shm",
         sizes_stores ? ", stores " : "", sizes_stores ? sizes_stores : "", ncounts,
         bucket ? ", in buckets while written" : "", tr_now() - t0);
  proc_free(ps, p);
  ftar_coord_free(c);
}

/* Each kind of stores into the shared-memory rings, not only the one the
 * default (learning) settles on on this machine: exact sums through 1 MiB
 * rings, sizes that wrap them, in buckets too. */
static void test_stores_sizes(int small) {
  const char *stores[] = {"stream", "cached"};
  for (int i = 0; i < 2; i++) {
    sizes_stores = stores[i];
    test_sizes(2, "sum", 0, small ? "1,7,4097,65537" : "1,7,4097,65537,1048573,4194301", 0);
    test_sizes(3, "sum", 0, small ? "1,7,4097,65537" : "1,7,4097,65537,1048573,4194301", 10000);
  }
  sizes_stores = NULL;
}

/* --- kill -9 / SIGSTOP mid all-reduce, then optionally a joiner --- */

/* bucket > 0: ranks reduce in buckets of count/8 floats while they still
 * write their input, slowly enough that the victim dies with buckets in
 * flight and others not yet written: the survivors redo all of them.
 * p ranks (2 or 3), the last one the victim: with 2, the fault lands in
 * the two-member exchange (ftar_ring.c) and the survivor redoes alone
 * from its restored input, which --verify checks exactly. */
static void test_fault(int use_stop, int with_join, int tcp, unsigned seed, int bucket, int p, unsigned frames,
                       size_t count_arg) {
  double tstart = tr_now();
  char what[96];
  snprintf(what, sizeof what, "%s (%s%s, %d ranks, frame %u)", use_stop ? "SIGSTOP" : "kill -9",
           tcp == 2 ? "a host each" : tcp ? "tcp" : "shm",
           bucket == 2 ? ", a wave per bucket" : bucket ? ", buckets" : "", p, frames ? frames : 1 + seed % 3);
  ftar_coord *c = coord_start();
  if (!c) return;
  int port = ftar_coord_port(c);
  const int victim = p - 1, joiner = 5, iters = 14;
  char surv_slots[32];
  slots_expected(surv_slots, sizeof surv_slots, (const int[]){0, 1, 2, 3, 4, 5, 6, 7}, p - 1);
  /* 1 MiB / 16 MiB; two members always 16 MiB: in the exchange the victim
   * sends while it receives, and 1 MiB could all reach the survivor before
   * the victim dies (a COMMIT of the full result, not the redo tested) */
  const size_t count = count_arg ? count_arg : with_join || (test_small() && p > 2) ? 262144 : 4194304;
  proc ps[MAXP];
  for (int r = 0; r < p; r++) {
    args a;
    rank_args(&a, port, r);
    arg(&a, "--wait");
    arg(&a, "%d", p);
    arg(&a, "--counts");
    arg(&a, "%zu", count);
    arg(&a, "--verify");
    if (with_join) { /* run until 4 collectives included the joiner */
      arg(&a, "--pattern");
      arg(&a, "static");
      arg(&a, "--iters");
      arg(&a, "1000000");
      arg(&a, "--until-slot");
      arg(&a, "%d", joiner);
      arg(&a, "--tail");
      arg(&a, "4");
      arg(&a, "--max-sec");
      arg(&a, "%.0f", T(60));
    } else {
      arg(&a, "--iters");
      arg(&a, "%d", iters);
    }
    if (tcp == 1) arg(&a, "--tcp");
    if (tcp == 2) {
      arg(&a, "--data-host");
      arg(&a, "127.0.0.%d", r + 1);
      arg(&a, "--chunk"); /* GRID_F_* count frames of at most 256 KiB */
      arg(&a, "262144");
    }
    if (bucket) {
      arg(&a, "--bucket");
      arg(&a, "%zu", count / 8);
      arg(&a, "--produce-us");
      arg(&a, "2000");
    }
    /* the victim signals itself once it has received 1 + seed % 3 data
     * frames of collective 6: mid reduce-scatter every time, so the
     * survivors' abort and redo always run (a signal from outside could
     * land between collectives) */
    char fault[64];
    snprintf(fault, sizeof fault, "%s:6:%u", use_stop ? "stop" : "kill", frames ? frames : 1 + seed % 3);
    if (r == victim) setenv("TRANSOM_TEST_FTAR_FAULT", fault, 1);
    if (bucket == 2) setenv("TRANSOM_FTAR_WAVE_MIN", "1", 1); /* a wave per bucket */
    spawn(&ps[r], r, a.v);
    unsetenv("TRANSOM_TEST_FTAR_FAULT");
    unsetenv("TRANSOM_FTAR_WAVE_MIN");
  }
  int three = 3;
  CHECK(wait_until(ps, p, each_has_results, &three, T(60)), "%s: ranks did not start", what);
  siginfo_t si = {0};
  double end = tr_now() + T(60);
  while (tr_now() < end) { /* until the victim stopped or died (not reaped here) */
    si.si_pid = 0;
    if (waitid(P_PID, (id_t)ps[victim].pid, &si, WEXITED | WSTOPPED | WNOHANG | WNOWAIT) == 0 && si.si_pid) break;
    pump(ps, p, 5);
  }
  CHECK(si.si_pid == ps[victim].pid, "%s: the victim never signalled itself", what);
  double t_sig = tr_now();
  int np = p;
  if (with_join) {
    /* survivors complete two collectives without the victim, then the
     * joiner registers */
    double end = tr_now() + T(30);
    for (;;) {
      int ok = 1;
      for (int r = 0; r < p; r++) {
        if (r == victim) continue;
        int after = 0;
        for (int i = 0; i < ps[r].nres; i++) after += ps[r].res[i].t0 > t_sig && ps[r].res[i].contrib == 2;
        ok &= after >= 2;
      }
      if (ok || tr_now() > end) break;
      pump(ps, p, 20);
    }
    args a;
    rank_args(&a, port, joiner);
    if (tcp) arg(&a, "--tcp");
    if (bucket) {
      arg(&a, "--bucket");
      arg(&a, "%zu", count / 8);
    }
    arg(&a, "--counts");
    arg(&a, "%zu", count);
    arg(&a, "--verify");
    arg(&a, "--pattern");
    arg(&a, "static");
    arg(&a, "--iters");
    arg(&a, "1000000");
    arg(&a, "--until-slot");
    arg(&a, "%d", joiner);
    arg(&a, "--tail");
    arg(&a, "4");
    spawn(&ps[np], joiner, a.v);
    np++;
  }
  /* everyone but the victim finishes on its own */
  proc live[MAXP];
  int nl = 0;
  for (int r = 0; r < np; r++)
    if (r != victim) live[nl++] = ps[r];
  finish(live, nl, T(90));
  if (use_stop) kill(ps[victim].pid, SIGKILL);
  finish(&ps[victim], 1, T(10));
  int k = 0;
  for (int r = 0; r < np; r++)
    if (r != victim) ps[r] = live[k++];

  int redid = 0; /* survivors that redid collective 6 */
  for (int r = 0; r < p; r++) {
    if (r == victim) continue;
    proc *s = &ps[r];
    CHECK(exited_ok(s), "%s: survivor %d exit status %d", what, r, s->status);
    CHECK(s->errors == 0, "%s: survivor %d reported errors", what, r);
    int bad = 0, inflight = -1;
    for (int i = 0; i < s->nres; i++) {
      bad += !s->res[i].ok || s->res[i].rc < 0;
      if (inflight < 0 && s->res[i].seq == 6) inflight = i; /* the collective the victim died in */
    }
    CHECK(bad == 0, "%s: survivor %d: %d wrong results", what, r, bad);
    CHECK(inflight >= 0, "%s: survivor %d: collective 6 never completed", what, r);
    if (inflight < 0) continue;
    result *x = &s->res[inflight];
    double took = x->t1 - t_sig;
    /* No bound on `took`: on a loaded machine a survivor can be descheduled
     * past any bound. That the survivors did not wait for the victim is
     * proven otherwise: it stays stopped (or dead) until they all finished. */
    /* collective 6 ends without the victim: redone by a survivor that was in
     * it when the victim died, or done once by one that entered it only after
     * the new epoch (it was still between collectives); at least one survivor
     * (the victim's upstream, which sent it frames of 6) must have redone it */
    int without = x->seq == 6 && x->contrib == p - 1 && strcmp(x->slots, surv_slots) == 0 && x->rc == FTAR_RESHAPED;
    /* two members: the victim may have sent its whole input before it
     * stopped (its sends do not wait for its receives), so the survivor
     * can hold the full result and the coordinator COMMITs it (with the
     * victim's input, as the ring does when every survivor is full) */
    /* the grid likewise, when the victim dies late in the pair all-gather,
     * its part already sent to its partner */
    char all_slots[32];
    slots_expected(all_slots, sizeof all_slots, (const int[]){0, 1, 2, 3, 4, 5, 6, 7}, p);
    int may_commit = p == 2 || (tcp == 2 && p >= 4 && p % 2 == 0);
    int committed = may_commit && x->seq == 6 && x->contrib == p && strcmp(x->slots, all_slots) == 0 &&
                    x->redos >= 1 && x->rc == FTAR_RESHAPED;
    if (committed) printf("  %s: collective 6 committed with the victim's input (the survivor held it all)\n", what);
    redid += committed;
    CHECK(without || committed, "%s: survivor %d: collective %llu without the victim (contrib %d slots %s redos %d rc %d)", what, r,
          (unsigned long long)x->seq, x->contrib, x->slots, x->redos, x->rc);
    redid += without && x->redos >= 1;
    if (r == 0 && without)
      printf("  %s: collective 6 finished without the victim %.0f ms after its signal (survivor 0: redos %d)\n",
             what, took * 1e3, x->redos);
    for (int i = inflight + 1; i < s->nres; i++) {
      result *y = &s->res[i];
      int ok = with_join ? (y->contrib == 2 || (y->contrib == 3 && strcmp(y->slots, "0,1,5") == 0))
                         : y->contrib == p - 1 && strcmp(y->slots, surv_slots) == 0;
      if (!ok) {
        CHECK(0, "%s: survivor %d seq %llu: contrib %d slots %s", what, r, y->seq, y->contrib, y->slots);
        break;
      }
    }
    if (!with_join) CHECK(s->nres == iters, "%s: survivor %d completed %d of %d collectives", what, r, s->nres, iters);
    /* a host each, an even number >= 4 of members: the grid, before the
     * fault (collectives 1-5) and after it (6, redone, and the rest) */
    if (!with_join && tcp == 2) {
      long want = (p >= 4 && p % 2 == 0 ? 5 : 0) + (p - 1 >= 4 && (p - 1) % 2 == 0 ? iters - 5 : 0);
      CHECK(s->grid_collectives == want, "%s: survivor %d ran %ld collectives as a grid, want %ld", what, r,
            s->grid_collectives, want);
    }
  }
  CHECK(redid >= 1, "%s: no survivor redid the collective the victim died in", what);
  char noticed[64];
  snprintf(noticed, sizeof noticed, "slot %d: %s", victim, use_stop ? "heartbeat lapsed" : "connection closed");
  CHECK(coord_log_has(noticed), "%s: the coordinator noticed", what);
  if (with_join) {
    proc *j = &ps[np - 1];
    CHECK(exited_ok(j) && j->errors == 0, "joiner exit status %d", j->status);
    CHECK(j->nres == 4, "joiner completed %d of 4 collectives", j->nres);
    if (j->nres > 0) {
      result *f = &j->res[0];
      CHECK(f->ok && f->contrib == 3 && strcmp(f->slots, "0,1,5") == 0, "joiner's first: contrib %d slots %s ok %d",
            f->contrib, f->slots, f->ok);
      /* it is the survivors' first collective after the join */
      for (int r = 0; r < 2; r++) {
        int first = -1;
        for (int i = 0; i < ps[r].nres && first < 0; i++)
          if (strstr(ps[r].res[i].slots, "5")) first = i;
        CHECK(first >= 0 && ps[r].res[first].seq == f->seq && ps[r].res[first].epoch == f->epoch,
              "joiner's first collective (seq %llu) is survivor %d's first with it (seq %llu)", f->seq, r,
              first >= 0 ? ps[r].res[first].seq : 0ull);
        if (first > 0)
          CHECK(ps[r].res[first - 1].seq + 1 == f->seq, "survivor %d: no collective between join and entry", r);
      }
      printf("  join: slot 5 entered at seq %llu (epoch %llu)\n", f->seq, f->epoch);
    }
  }
  printf("  %s%s: %.1f s\n", what, with_join ? " + join" : "", tr_now() - tstart);
  (void)end;
  proc_free(ps, np);
  ftar_coord_free(c);
}

static void test_grid_hosts(void);

/* --- the grid: an even number >= 4 of members, a host each (ftar_hier.c) ---
 * Ranks advertise 127.0.0.<slot+1> (tcp = 2 in test_sizes / test_fault):
 * sums at every size, MEAN divided once, 6 members (columns of 3), buckets
 * while written (main's test_sizes(4, .., tcp = 1) on one host keeps the
 * flat ring, and says so); the last member
 * killed in each data pass of 4 (the 3 survivors redo on the flat ring) or
 * stopped in the column pass; one of 5 killed, the 4 survivors redo
 * through the grid. The victim's data frames in one grid attempt of
 * collective 6 (count floats, frames of at most 65408): the pair
 * reduce-scatter's first, the column reduce's, the pair all-gather's. */
static void test_grid(void) {
  int small = test_small();
  const char *counts = small ? "1,2,3,5,7,31,1000,4097,65537" : "1,2,3,5,7,31,1000,4097,65537,1048573,4194301";
  test_sizes(4, "sum", 2, counts, 0);
  test_sizes(4, "mean", 2, small ? "1,3,1000,65537" : "1,3,1000,65537,1048573", 0);
  test_sizes(6, "sum", 2, small ? "1,2,7,1000,65537" : "1,2,7,1000,65537,1048573", 0);
  test_sizes(4, "sum", 2, "1,7,1000,65537,1048573", 10000);
  test_sizes(4, "mean", 2, "1,3,65537,1048573", 4096);
  /* frames: pair reduce-scatter, column reduce-scatter, column all-gather, pair all-gather */
  const unsigned at_big[4] = {GRID_F_BIG}, at_small[4] = {GRID_F_SMALL};
  const unsigned *at = small ? at_small : at_big;
  for (int ph = 0; ph < 4; ph++) test_fault(0, 0, 2, 11u, 0, 4, at[ph], 0);
  test_fault(1, 0, 2, 12u, 0, 4, at[1], 0);
  test_fault(0, 0, 2, 13u, 0, 5, 0, 0);
  /* 65536 floats (small frames): the pair reduce-scatter's frames 1-3, the column reduce-scatter's 4-5 */
  test_fault(0, 0, 2, 14u, 0, 4, 2, 65536);
  test_fault(0, 0, 2, 15u, 0, 4, 5, 65536);
  test_fault(1, 0, 2, 16u, 0, 4, 5, 65536);
  /* buckets of count/8 floats, a wave each (bucket 2: TRANSOM_FTAR_WAVE_MIN=1,
   * not waves of 1 MiB): a member receives 16 data frames
   * a wave at 4194304 floats (pair 5, column 3 + 3, pair 5), 6 at 262144;
   * 56 / 21 land in wave 3's column pass: the done waves' input is put back
   * too, and the survivors' redo runs on the flat ring */
  test_fault(0, 0, 2, 17u, 2, 4, small ? 21 : 56, 0);
  test_fault(1, 0, 2, 18u, 2, 4, small ? 21 : 56, 0);
  test_grid_hosts();
}

/* --- hierarchical: members on fake hosts (loopback addresses) --- */

/* Slot k advertises --data-host 127.0.0.<host[k]>: members with the same
 * address are one host to FTAR (shared-memory links among them, TCP to the
 * others), so the hierarchical plane runs without namespaces. A host's
 * leader is its lowest slot. */
typedef struct {
  int n;
  int host[MAXP];
} layout;

static int hl_count(const layout *L, int k) {
  int c = 0;
  for (int i = 0; i < L->n; i++) c += L->host[i] == L->host[k];
  return c;
}
static int hl_leader(const layout *L, int k) {
  for (int i = 0; i < k; i++)
    if (L->host[i] == L->host[k]) return 0;
  return 1;
}
static int hl_hosts(const layout *L) {
  int h = 0;
  for (int k = 0; k < L->n; k++) h += hl_leader(L, k);
  return h;
}

static void hier_rank_args(args *a, int port, const layout *L, int slot) {
  rank_args(a, port, slot);
  arg(a, "--data-host");
  arg(a, "127.0.0.%d", L->host[slot]);
}

/* The hierarchy ran every collective of p and used the links it should:
 * a member of a shared host two shared-memory links (its local ring), a
 * leader two TCP links more (the leaders' ring), and only leaders send
 * bytes to other hosts. */
static void check_hier_links(const char *what, const layout *L, const proc *p, int k, long want_hier) {
  int leader = hl_leader(L, k), shared = hl_count(L, k) >= 2;
  CHECK(p->hier_collectives == want_hier, "%s: rank %d ran %ld of %ld collectives hierarchically", what, k,
        p->hier_collectives, want_hier);
  long want_shm = shared ? 2 : 0, want_tcp = leader && hl_hosts(L) >= 2 ? 2 : 0;
  CHECK(p->shm_links == want_shm && p->tcp_links == want_tcp, "%s: rank %d used %ld shm and %ld tcp links, want %ld and %ld",
        what, k, p->shm_links, p->tcp_links, want_shm, want_tcp);
  CHECK(leader ? p->cross_bytes > 0 : p->cross_bytes == 0, "%s: rank %d (%s) sent %ld bytes to other hosts", what, k,
        leader ? "leader" : "not a leader", p->cross_bytes);
}

/* Exact sums over every layout member (sum or mean), through the
 * hierarchy (or --flat: the flat ring on the same hosts, none of it
 * hierarchical); bucket > 0: ftar_allreduce_start while written. */
static void test_hier_sizes(const char *name, const layout *L, const char *op, int flat, size_t bucket) {
  double t0 = tr_now();
  char what[96];
  snprintf(what, sizeof what, "hier %s %s%s%s", name, op, flat ? " --flat" : "", bucket ? " buckets" : "");
  ftar_coord *c = coord_start();
  if (!c) return;
  const char *counts = test_small() ? "1,7,1000,65537" : "1,7,1000,65537,1048573";
  int ncounts = test_small() ? 4 : 5, p = L->n;
  proc ps[MAXP];
  for (int r = 0; r < p; r++) {
    args a;
    hier_rank_args(&a, ftar_coord_port(c), L, r);
    verify_args(&a, p, counts, op, bucket);
    if (flat) arg(&a, "--flat");
    spawn(&ps[r], r, a.v);
  }
  finish(ps, p, T(120));
  int want[MAXP] = {0};
  for (int r = 0; r < p; r++) want[r] = r;
  char sl[64];
  slots_expected(sl, sizeof sl, want, p);
  for (int r = 0; r < p; r++) {
    CHECK(exited_ok(&ps[r]), "%s: rank %d exit status %d", what, r, ps[r].status);
    CHECK(ps[r].nres == ncounts, "%s: rank %d reported %d of %d results", what, r, ps[r].nres, ncounts);
    int bad = 0;
    for (int i = 0; i < ps[r].nres; i++) {
      result *x = &ps[r].res[i];
      bad += !x->ok || x->rc != 0 || x->contrib != p || strcmp(x->slots, sl) || x->redos;
    }
    CHECK(bad == 0, "%s: rank %d: %d results wrong (exact sums over slots %s)", what, r, bad, sl);
    /* a host each, an even number >= 4: the grid over TCP */
    int grid = !flat && hl_hosts(L) == p && p >= 4 && p % 2 == 0;
    if (flat)
      CHECK(ps[r].hier_collectives == 0 && ps[r].grid_collectives == 0, "%s: rank %d ran %ld hierarchically, %ld as a grid",
            what, r, ps[r].hier_collectives, ps[r].grid_collectives);
    else if (grid)
      CHECK(ps[r].grid_collectives == ncounts && ps[r].hier_collectives == 0 && ps[r].shm_links == 0 &&
                ps[r].tcp_links == 4,
            "%s: rank %d: %ld grid, %ld hierarchical of %d collectives; %ld shm, %ld tcp links", what, r,
            ps[r].grid_collectives, ps[r].hier_collectives, ncounts, ps[r].shm_links, ps[r].tcp_links);
    else
      check_hier_links(what, L, &ps[r], r, ncounts);
    /* a wave a collective, or with buckets one per 262144 floats of whole
     * buckets (ftar_hier.c's WAVE_MIN: the cross-host part overlaps the producer) */
    long waves = 0, W = bucket ? (262144 + (long)bucket - 1) / (long)bucket * (long)bucket : 0;
    for (const char *q = counts; *q; q = strchr(q, ',') ? strchr(q, ',') + 1 : "") {
      long cnt = atol(q);
      waves += W && W < cnt ? (cnt + W - 1) / W : 1;
    }
    if (!flat)
      CHECK(ps[r].waves == waves, "%s: rank %d ran %ld waves, expected %ld", what, r, ps[r].waves, waves);
  }
  printf("  %s: %d ranks on %d hosts, %d sizes: %.1f s\n", what, p, hl_hosts(L), ncounts, tr_now() - t0);
  proc_free(ps, p);
  ftar_coord_free(c);
}

/* The grid across hosts: 4 fake hosts of one member each (shared memory
 * allowed, nothing to share); --flat keeps the flat ring. */
static void test_grid_hosts(void) {
  static const layout four = {4, {1, 2, 3, 4}};
  test_hier_sizes("4 x 1", &four, "sum", 0, 0);
  test_hier_sizes("4 x 1", &four, "mean", 0, 4096);
  test_hier_sizes("4 x 1", &four, "sum", 1, 0);
}

/* Waits (bounded) until the victim stopped or died; 1 if a signal did it
 * (not a normal exit: its fault point never came). */
static int victim_signalled(proc *ps, int n, int victim) {
  siginfo_t si = {0};
  double end = tr_now() + T(60);
  while (tr_now() < end) {
    si.si_pid = 0;
    if (waitid(P_PID, (id_t)ps[victim].pid, &si, WEXITED | WSTOPPED | WNOHANG | WNOWAIT) == 0 && si.si_pid)
      return si.si_code == CLD_KILLED || si.si_code == CLD_STOPPED;
    pump(ps, n, 5);
  }
  return 0;
}

/* kill -9 / SIGSTOP of one member of layout L at data frame `frames` of
 * collective 6 (counted over the attempt's phases, 1 MiB: a 2-member ring
 * pass is 6 frames, a 3-member one 12, the broadcast 5; so at 2 x 2, 2
 * lands in phase 1, 8 in phase 2 on a leader and in phase 3 on the others;
 * at 3 + 2, 14 in the middle of the 3-member host's chain, whose end can
 * then not be full): the survivors redo it
 * without the victim, exact sums over the right contributors; the witness's
 * log names the phase where the abort landed. commit: the victim is the
 * end of its host's broadcast chain, lost after its host's members got the
 * result: if the other host's broadcast was done too, every survivor is
 * full and the coordinator commits (all 4 contributors, the victim's input
 * included), else they redo it without the victim; either way the same on
 * every survivor, and the next collective runs without it. */
/* floats of test_hier_fault's collectives: 1 MiB, or 65536 (small frames) */
static int hier_fault_count = 262144;

static void test_hier_fault(const layout *Lp, int victim, unsigned frames, int use_stop, int witness,
                            const char *phase_name, int commit, int bucket) {
  double tstart = tr_now();
  const layout L = *Lp;
  char what[128];
  snprintf(what, sizeof what, "hier %s of slot %d of %d (%s) at frame %u%s", use_stop ? "SIGSTOP" : "kill -9", victim,
           L.n, hl_leader(&L, victim) ? "leader" : "not a leader", frames,
           bucket == 2 ? ", a wave per bucket" : bucket ? ", buckets" : "");
  ftar_coord *c = coord_start();
  if (!c) return;
  const int p = L.n, iters = 10;
  proc ps[MAXP];
  for (int r = 0; r < p; r++) {
    args a;
    hier_rank_args(&a, ftar_coord_port(c), &L, r);
    arg(&a, "--wait");
    arg(&a, "%d", p);
    arg(&a, "--counts");
    arg(&a, "%d", hier_fault_count);
    arg(&a, "--chunk"); /* the frame counts above are for frames of at most 256 KiB */
    arg(&a, "262144");
    arg(&a, "--verify");
    arg(&a, "--iters");
    arg(&a, "%d", iters);
    if (bucket) { /* reduced while written, slowly: the victim dies with buckets in flight */
      arg(&a, "--bucket");
      arg(&a, "%d", hier_fault_count / 8);
      arg(&a, "--produce-us");
      arg(&a, "2000");
    }
    char fault[64];
    snprintf(fault, sizeof fault, "%s:6:%u", use_stop ? "stop" : "kill", frames);
    if (r == victim) setenv("TRANSOM_TEST_FTAR_FAULT", fault, 1);
    if (bucket == 2) setenv("TRANSOM_FTAR_WAVE_MIN", "1", 1); /* a wave per bucket */
    spawn(&ps[r], r, a.v);
    unsetenv("TRANSOM_TEST_FTAR_FAULT");
    unsetenv("TRANSOM_FTAR_WAVE_MIN");
  }
  CHECK(victim_signalled(ps, p, victim), "%s: the victim never signalled itself", what);
  proc live[MAXP];
  int nl = 0, surv[MAXP] = {0};
  for (int r = 0; r < p; r++)
    if (r != victim) {
      surv[nl] = r;
      live[nl++] = ps[r];
    }
  finish(live, nl, T(90));
  if (use_stop) kill(ps[victim].pid, SIGKILL);
  finish(&ps[victim], 1, T(10));
  char sl[64], sl6[64];
  slots_expected(sl, sizeof sl, surv, nl);
  const int all[MAXP] = {0, 1, 2, 3, 4, 5, 6, 7};
  slots_expected(sl6, sizeof sl6, commit ? all : surv, commit ? p : nl);
  int redid = 0, committed = -1, shared_after = 0;
  for (int i = 0; i < nl; i++)
    for (int j = 0; j < i; j++) shared_after |= L.host[surv[i]] == L.host[surv[j]];
  for (int i = 0; i < nl; i++) {
    proc *s = &live[i];
    int r = surv[i], bad = 0, at6 = -1;
    CHECK(exited_ok(s) && s->errors == 0, "%s: survivor %d exit status %d, %d errors", what, r, s->status, s->errors);
    for (int k = 0; k < s->nres; k++) {
      bad += !s->res[k].ok || s->res[k].rc < 0;
      if (s->res[k].seq == 6) at6 = k;
      int c6 = s->res[k].seq == 6 && commit && strcmp(s->res[k].slots, sl6) == 0;
      if (s->res[k].seq == 6 && commit) { /* committed or redone: alike on every survivor */
        if (committed < 0) committed = c6;
        bad += committed != c6;
      }
      if (s->res[k].seq >= 6 && !c6 && strcmp(s->res[k].slots, sl)) bad++;
    }
    CHECK(bad == 0, "%s: survivor %d: %d results wrong (exact sums; seq 6 over slots %s%s, then %s)", what, r, bad,
          commit ? "(0,1,2,3 or) " : "", commit ? sl : sl6, sl);
    CHECK(s->nres == iters, "%s: survivor %d completed %d of %d collectives", what, r, s->nres, iters);
    CHECK(at6 >= 0 && s->res[at6].rc == FTAR_RESHAPED, "%s: survivor %d: collective 6 not reshaped", what, r);
    if (at6 >= 0) redid += s->res[at6].redos >= 1;
    /* the redo and what follows ran through the hierarchy too (a commit
     * of a result held at the abort is the one that may not) */
    if (shared_after)
      CHECK(s->hier_collectives >= iters - 1, "%s: survivor %d ran %ld hierarchically", what, r, s->hier_collectives);
    else /* no host keeps 2 members: collectives 1-5 hierarchical, the redo and the rest flat */
      CHECK(s->hier_collectives == 5, "%s: survivor %d ran %ld hierarchically, want 5 (then flat)", what, r,
            s->hier_collectives);
    if (r == witness && phase_name)
      CHECK(s->eb && strstr(s->eb, phase_name), "%s: survivor %d's log does not name '%s'", what, r, phase_name);
  }
  CHECK(redid >= 1, "%s: no survivor aborted collective 6", what);
  if (commit) printf("  %s: collective 6 %s\n", what, committed > 0 ? "committed with the victim's input" : "redone without it");
  char notice[64];
  snprintf(notice, sizeof notice, "slot %d: %s", victim, use_stop ? "heartbeat lapsed" : "connection closed");
  CHECK(coord_log_has(notice), "%s: the coordinator noticed (%s)", what, notice);
  for (int i = 0; i < nl; i++) ps[surv[i]] = live[i];
  printf("  %s: %.1f s\n", what, tr_now() - tstart);
  proc_free(ps, p);
  ftar_coord_free(c);
}

static void churn_log(void *ud, const char *msg) { (void)ud, (void)msg; } /* 3 lines an epoch: not shown */

/* The members' log lines, kept to be shown when a check fails. */
static char member_log[8192];
static size_t member_log_len;
static void member_log_keep(void *ud, const char *msg) {
  pthread_mutex_lock(&log_mu);
  int k = snprintf(member_log + member_log_len, sizeof member_log - member_log_len, "%s: %s\n",
                   ud ? (const char *)ud : "member", msg);
  if (k > 0 && member_log_len + (size_t)k < sizeof member_log) member_log_len += (size_t)k;
  else member_log[member_log_len] = 0; /* full: the line is dropped */
  pthread_mutex_unlock(&log_mu);
}

static void member_log_dump(const char *what) {
  pthread_mutex_lock(&log_mu);
  fprintf(stderr, "  %s: the members' log:\n%s", what, member_log);
  pthread_mutex_unlock(&log_mu);
}

/* Slot 0, which stays, and slot 1, which will leave, on the coordinator
 * at port, their log lines kept for a failed check (leave_logs_dump); the
 * caller frees both. Whether both are in the group. */
static int stay_and_leaver(int port, ftar_member **stay, ftar_member **gone, const char *what) {
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = T(10);
  mo.log = member_log_keep;
  member_log_len = 0;
  mo.log_ud = "slot 0";
  *stay = ftar_member_create("127.0.0.1", port, 0, &mo);
  mo.log_ud = "slot 1 (leaves)";
  *gone = *stay ? ftar_member_create("127.0.0.1", port, 1, &mo) : NULL;
  int ok = *stay && *gone && ftar_member_wait(*stay, 2, T(10)) == 0;
  CHECK(ok, "%s: members: %s", what, tr_error());
  return ok;
}

static void leave_logs_dump(const char *what) {
  coord_log_dump(what);
  member_log_dump(what);
}

/* Open descriptors and shared-memory link maps of this process. */
static int fds_open(void) {
  int n = 0;
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  for (struct dirent *e; (e = readdir(d));) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}
static int shm_maps(void) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return -1;
  char line[512];
  int n = 0;
  while (fgets(line, sizeof line, f)) n += strstr(line, "ftar-link") != NULL;
  fclose(f);
  return n;
}

/* One SUM collective of ones on k in-process members at once: each gets k. */
static int churn_round(ftar_member **ms, int k, uint64_t *seq, float *bufs, int n) {
  thr_one one[4];
  pthread_t th[4];
  for (int i = 0; i < k; i++) {
    one[i] = (thr_one){.m = ms[i], .seq = seq[i], .n = n, .slot = i, .buf = bufs + (size_t)i * n};
    pthread_create(&th[i], NULL, thr_once, &one[i]);
  }
  int bad = 0;
  for (int i = 0; i < k; i++) {
    pthread_join(th[i], NULL);
    bad += one[i].rc < 0 || (n && (one[i].buf[0] != (float)k || one[i].buf[n - 1] != (float)k));
    seq[i] = one[i].res.seq + 1;
  }
  return bad;
}

typedef struct {
  ftar_member *m;
  ftar_op op;
  int rc;
  float buf[1000];
} thr_op;

static void *thr_op_run(void *p) {
  thr_op *a = p;
  for (int i = 0; i < 1000; i++) a->buf[i] = 1.0f;
  a->rc = ftar_allreduce(a->m, a->buf, 1000, a->op, 1, NULL);
  return NULL;
}

/* Callers that disagree on the op (slot 0 MEAN, the others SUM) through
 * the hierarchy (slots 0, 1 on host .1, slot 2 on .2): refused as on the
 * flat ring (every attempt aborts: "callers disagree"), never returned as
 * a mean on one host and a sum on the other. */
static void test_hier_op_mismatch(int hier) {
  double t0 = tr_now();
  ftar_coord *c = coord_start();
  if (!c) return;
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = T(3);
  mo.log = churn_log;
  mo.hier = hier;
  const char *hosts[3] = {"127.0.0.1", "127.0.0.1", "127.0.0.2"};
  thr_op a[3];
  pthread_t th[3];
  int ok = 1;
  for (int i = 0; i < 3; i++) {
    mo.data_host = hosts[i];
    a[i].m = ftar_member_create("127.0.0.1", ftar_coord_port(c), i, &mo);
    a[i].op = i == 0 ? FTAR_MEAN : FTAR_SUM;
    ok &= a[i].m != NULL;
  }
  CHECK(ok && ftar_member_wait(a[0].m, 3, T(10)) == 0, "hier op mismatch: members: %s", tr_error());
  if (ok) {
    for (int i = 0; i < 3; i++) pthread_create(&th[i], NULL, thr_op_run, &a[i]);
    for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 3; i++)
      CHECK(a[i].rc < 0 && a[i].buf[0] == 1.0f, "%s op mismatch: slot %d (%s) returned %d with %g",
            hier ? "hier" : "flat", i, i == 0 ? "mean" : "sum", a[i].rc, (double)a[i].buf[0]);
  }
  printf("  %s op mismatch: refused: %.1f s\n", hier ? "hier" : "flat", tr_now() - t0);
  for (int i = 0; i < 3; i++) ftar_member_free(a[i].m);
  ftar_coord_free(c);
}

/* Collectives back to back until seq *last: the members of a group stop
 * after the same one (a flag read between collectives would let one stop
 * while the other waits in the next for it). */
typedef struct {
  ftar_member *m;
  _Atomic uint64_t *last;
  _Atomic uint64_t seq; /* the last one done */
  _Atomic int rc, done; /* polled by the main thread while it runs */
  char err[300];        /* read after the join */
} thr_spin;

static void *thr_spin_run(void *p) {
  thr_spin *a = p;
  float buf[1000];
  uint64_t seq = 1;
  while (seq <= *a->last) {
    for (int i = 0; i < 1000; i++) buf[i] = 1.0f;
    ftar_result r;
    int rc = ftar_allreduce(a->m, buf, 1000, FTAR_SUM, seq, &r);
    if (rc < 0) {
      snprintf(a->err, sizeof a->err, "%s", tr_error());
      a->rc = rc;
      break;
    }
    a->done++;
    a->seq = r.seq;
    seq = r.seq + 1;
  }
  return NULL;
}

/* A joiner that got its GO and then goes away cleanly. Its first
 * collective (strict_seq, as a worker's) is refused with FTAR_ESEQ: the
 * group is further on, and the GO told the others to run that seq with it
 * while it replays what it missed. If the replay fails (its donor's history
 * no longer reaches back) it exits, and ftar_member_free says LEAVE. That
 * LEAVE is no collective boundary: the others are in that collective,
 * waiting for it. It must call the collective off (an aborting epoch),
 * else the others wait on it, redo, abort again, for ever. */
static void test_joiner_leaves_after_go(void) {
  double t0 = tr_now();
  ftar_coord *c = coord_start();
  if (!c) return;
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = T(10);
  mo.log = churn_log;
  _Atomic uint64_t last = UINT64_MAX;
  thr_spin a[2] = {{.last = &last}, {.last = &last}};
  pthread_t th[2];
  for (int i = 0; i < 2; i++) a[i].m = ftar_member_create("127.0.0.1", ftar_coord_port(c), i, &mo);
  CHECK(a[0].m && a[1].m && ftar_member_wait(a[0].m, 2, T(10)) == 0, "joiner leaves after GO: members: %s",
        tr_error());
  if (a[0].m && a[1].m) {
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, thr_spin_run, &a[i]);
    while (a[0].done < 20 && !a[0].rc && !a[1].rc) usleep(1000);
    mo.strict_seq = 1;
    ftar_member *j = ftar_member_create("127.0.0.1", ftar_coord_port(c), 2, &mo);
    float buf[1000];
    for (int i = 0; i < 1000; i++) buf[i] = 1.0f;
    ftar_result r = {0};
    int rc = j ? ftar_allreduce(j, buf, 1000, FTAR_SUM, 1, &r) : -1;
    CHECK(rc == FTAR_ESEQ && r.seq > 1, "joiner leaves after GO: its first collective returned %d (seq %llu): %s",
          rc, (unsigned long long)r.seq, tr_error());
    int before = a[0].done;
    double t_leave = tr_now();
    ftar_member_free(j); /* its replay failed: it exits */
    while (a[0].done < before + 20 && !a[0].rc && !a[1].rc && tr_now() - t_leave < T(8)) usleep(1000);
    double took = tr_now() - t_leave;
    last = a[0].seq + 10; /* ahead of both: neither is more than one collective ahead of the other */
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 2; i++)
      CHECK(a[i].rc >= 0, "joiner leaves after GO: slot %d failed after %d collectives: %s", i, (int)a[i].done,
            a[i].err);
    CHECK(a[0].done >= before + 20, "joiner leaves after GO: the others did %d collectives in %.1f s after it left",
          (int)a[0].done - before, took);
    int flagged = coord_log_has("slot 2 leaves after seq 0, its collective in flight");
    CHECK(flagged, "joiner leaves after GO: its LEAVE did not call the collective off");
    if (!flagged || a[0].done < before + 20) coord_log_dump("joiner leaves after GO");
    printf("  joiner leaves after GO: the others went on %.0f ms after it left\n", took * 1e3);
  }
  for (int i = 0; i < 2; i++) ftar_member_free(a[i].m);
  printf("  joiner leaves after GO: %.1f s\n", tr_now() - t0);
  ftar_coord_free(c);
}

/* A member leaves with a frame still queued for the coordinator: the
 * control thread's command callback writes it into the bufferevent and
 * sees the quit in the same call, so the loop ends before the write event
 * runs and send_leave finds the frame in the output. Both go out, the
 * LEAVE after it, and the coordinator sees a clean leave. (Before: libevent
 * freezes the start of that output, evbuffer_copyout refused it, and the
 * LEAVE was dropped without a word; the coordinator saw the connection
 * close, a crash, and aborted the others' collective. That is how "leave vs
 * GO" once failed in CI.) The frame is an ABORT for the current epoch
 * before any GO, which the coordinator ignores; it is queued without a
 * wake-up, so the leave's own wake-up hands both to one callback. */
static void test_leave_backlog(void) {
  double t0 = tr_now();
  ftar_coord *c = coord_start();
  if (!c) return;
  ftar_member *stay, *gone;
  if (stay_and_leaver(ftar_coord_port(c), &stay, &gone, "leave with a frame queued")) {
    pthread_mutex_lock(&gone->mu);
    gone->abort_h = (ftar_hdr){.type = FT_ABORT, .epoch = gone->ep, .index = 1};
    gone->q_abort = 1;
    pthread_mutex_unlock(&gone->mu);
    ftar_member_leave(gone, "done");
    int n = 2;
    for (double end = tr_now() + T(5); n != 1 && tr_now() < end; usleep(2000)) ftar_member_epoch(stay, &n);
    int left = coord_log_has("slot 1 leaves after seq"), closed = coord_log_has("slot 1: connection closed");
    CHECK(n == 1 && left && !closed, "leave with a frame queued: %d member(s) left, LEAVE %s, %s", n,
          left ? "read" : "never read", closed ? "a close seen instead" : "no close seen");
    if (!left || closed) leave_logs_dump("leave with a frame queued");
  }
  ftar_member_free(gone);
  ftar_member_free(stay);
  printf("  leave with a frame queued: %.1f s\n", tr_now() - t0);
  ftar_coord_free(c);
}

/* A member whose producer failed after ftar_allreduce_start (its buckets
 * never all come) leaves with ftar_member_leave: the others' collective is
 * redone without it at once, while it still exists (it is freed only
 * after they returned), exact over the two that stayed; m stays usable
 * for stats and free (the control thread is stopped once). Without the
 * leave they would wait on its buckets until their timeout. */
static void test_member_leave(void) {
  double t0 = tr_now();
  ftar_coord *c = coord_start();
  if (!c) return;
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = T(20);
  mo.log = churn_log;
  thr_op a[2];
  pthread_t th[2];
  ftar_member *gone = ftar_member_create("127.0.0.1", ftar_coord_port(c), 2, &mo);
  int ok = gone != NULL;
  for (int i = 0; i < 2; i++) {
    a[i].m = ftar_member_create("127.0.0.1", ftar_coord_port(c), i, &mo);
    a[i].op = FTAR_SUM;
    ok &= a[i].m != NULL;
  }
  CHECK(ok && ftar_member_wait(a[0].m, 3, T(10)) == 0, "member leave: members: %s", tr_error());
  if (ok) {
    static float half_written[1000];
    for (int k = 0; k < 1000; k++) half_written[k] = 1.0f;
    CHECK(ftar_allreduce_start(gone, half_written, 1000, FTAR_SUM, 1, 100) == 0, "member leave: start: %s", tr_error());
    ftar_allreduce_ready(gone, 500); /* half its buckets, then its producer fails */
    for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, thr_op_run, &a[i]);
    usleep(300 * 1000);
    double t_leave = tr_now();
    ftar_member_leave(gone, "compute failed");
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    double took = tr_now() - t_leave;
    for (int i = 0; i < 2; i++)
      CHECK(a[i].rc >= 0 && a[i].buf[0] == 2.0f && a[i].buf[999] == 2.0f, "member leave: slot %d returned %d with %g",
            i, a[i].rc, (double)a[i].buf[0]);
    ftar_stats st;
    ftar_member_stats(gone, &st);
    CHECK(ftar_allreduce(gone, half_written, 1000, FTAR_SUM, 2, NULL) < 0 && strstr(tr_error(), "compute failed"),
          "member leave: a call after it fails with its reason: %s", tr_error());
    CHECK(coord_log_has("leaves after seq"), "member leave: the coordinator saw LEAVE");
    printf("  member leave: the other two done %.0f ms after it\n", took * 1e3);
  }
  ftar_member_free(gone); /* after leave: nothing joined twice */
  for (int i = 0; i < 2; i++) ftar_member_free(a[i].m);
  printf("  member leave: %.1f s\n", tr_now() - t0);
  ftar_coord_free(c);
}

/* The leave races the group's GO: the leaver synced its collective, then
 * (the coordinator's loop stalled meanwhile) the other member synced and
 * the leaver left, so the coordinator reads that SYNC first, sends GO for
 * an epoch with the leaver in it, and only then reads its LEAVE. The other
 * runs that epoch's ring towards a member whose links never formed: its
 * collective must be called off at once (the leave was not at a collective
 * boundary), not wait for the leaver until its timeout or until the
 * leaver's process exits (the leaver is freed only after it returned). */
static void test_member_leave_go(void) {
  double t0 = tr_now();
  loop_drv d;
  if (drv_start(&d, 0)) return;
  thr_op a = {.op = FTAR_SUM};
  ftar_member *gone;
  if (stay_and_leaver(ftar_coord_port(d.c), &a.m, &gone, "leave vs GO")) {
    static float half_written[1000];
    for (int k = 0; k < 1000; k++) half_written[k] = 1.0f;
    CHECK(ftar_allreduce_start(gone, half_written, 1000, FTAR_SUM, 1, 100) == 0, "leave vs GO: start: %s",
          tr_error());
    ftar_allreduce_ready(gone, 900); /* its first bucket: it syncs and waits for GO */
    usleep(300 * 1000);
    d.stall_ms = 1500;
    for (int w = 0; w < 1000 && !d.stalling; w++) usleep(1000);
    CHECK(d.stalling, "leave vs GO: the coordinator's loop did not stall");
    /* the loop stalls: what follows is read in one go, in this order */
    pthread_t th;
    pthread_create(&th, NULL, thr_op_run, &a); /* its SYNC completes the epoch: GO */
    usleep(100 * 1000);
    ftar_member_leave(gone, "compute failed"); /* its LEAVE comes after that SYNC */
    double t_leave = tr_now();
    pthread_join(th, NULL);
    double took = tr_now() - t_leave;
    CHECK(a.rc >= 0 && a.buf[0] == 1.0f && a.buf[999] == 1.0f, "leave vs GO: the other returned %d with %g", a.rc,
          (double)a.buf[0]);
    int seen = coord_log_has("its collective in flight");
    CHECK(seen, "leave vs GO: the coordinator saw a LEAVE mid-collective");
    if (!seen) leave_logs_dump("leave vs GO");
    CHECK(took < T(4), "leave vs GO: the other waited %.1f s for the member that left", took);
    printf("  leave vs GO: the other done %.0f ms after the leave\n", took * 1e3);
  }
  ftar_member_free(gone);
  ftar_member_free(a.m);
  printf("  leave vs GO: %.1f s\n", tr_now() - t0);
  drv_stop(&d);
}

/* Collectives back to back, min_members 3, until one fails: the last seq
 * done, the code, whether the input was back in the buffer, and how often
 * the call waited for quorum. */
typedef struct {
  ftar_member *m;
  int slot;
  _Atomic uint64_t last; /* stop after this seq (0: never) */
  _Atomic uint64_t seq;
  _Atomic int waits, ended;
  int rc, restored;
} thr_wind;

static void on_quorum_wait(void *ud) {
  thr_wind *a = ud;
  a->waits++;
}

static void *thr_wind_run(void *p) {
  thr_wind *a = p;
  float buf[1000];
  uint64_t seq = 1;
  for (;;) {
    for (int i = 0; i < 1000; i++) buf[i] = 1.0f + (float)a->slot;
    ftar_result r;
    int rc = ftar_allreduce(a->m, buf, 1000, FTAR_SUM, seq, &r);
    if (rc < 0) {
      a->rc = rc;
      a->restored = buf[0] == 1.0f + (float)a->slot && buf[999] == buf[0];
      break;
    }
    a->seq = r.seq;
    if (a->last && r.seq >= a->last) break;
    seq = r.seq + 1;
  }
  a->ended = 1;
  return NULL;
}

static thr_wind *wind_member(thr_wind *a, int port, int slot, ftar_member_opts *mo) {
  mo->quorum_ud = a;
  a->slot = slot;
  a->m = ftar_member_create("127.0.0.1", port, slot, mo);
  return a->m ? a : NULL;
}

/* The job stops while the group waits below min_members: one member winds
 * down, and the coordinator winds down the rest (their own stop may never
 * come: the operator's link to them down). Slot 2 of three leaves after
 * seq 10; slots 0 and 1 wait for quorum in seq 11; only slot 0 winds down.
 * Both return FTAR_ECANCELED with their input back and seq 10 done, long
 * before their timeout (before: slot 1 waited for quorum until then, and
 * slot 0 for a decision that needs slot 1's SYNC). A member that registers
 * after it (its first call waits for quorum alone) is wound down too. */
/* Member options for the wind-down tests: quorum min, a 30 s timeout. */
static void wind_opts(ftar_member_opts *mo, int min_members) {
  ftar_member_opts_default(mo);
  mo->timeout = T(30);
  mo->min_members = min_members;
  mo->log = churn_log;
}

static void test_wind_down(void) {
  double t0 = tr_now();
  ftar_coord *c = coord_start();
  if (!c) return;
  int port = ftar_coord_port(c);
  ftar_member_opts mo;
  wind_opts(&mo, 3);
  mo.quorum_wait = on_quorum_wait;
  thr_wind a[3] = {{.last = 0}, {.last = 0}, {.last = 10}}, late = {0};
  pthread_t th[3];
  int ok = 1;
  for (int i = 0; i < 3; i++) ok &= wind_member(&a[i], port, i, &mo) != NULL;
  CHECK(ok && ftar_member_wait(a[0].m, 3, T(10)) == 0, "wind down: members: %s", tr_error());
  if (ok) {
    for (int i = 0; i < 3; i++) pthread_create(&th[i], NULL, thr_wind_run, &a[i]);
    pthread_join(th[2], NULL);
    CHECK(a[2].rc == 0 && a[2].seq == 10, "wind down: slot 2 did seq %llu (%d)", (unsigned long long)a[2].seq,
          a[2].rc);
    ftar_member_free(a[2].m); /* leaves: two stay, below min_members */
    a[2].m = NULL;
    double end = tr_now() + T(10);
    while ((!a[0].waits || !a[1].waits) && tr_now() < end) usleep(2000);
    CHECK(a[0].waits && a[1].waits, "wind down: slots 0 and 1 did not wait for quorum (%d, %d)", (int)a[0].waits,
          (int)a[1].waits);
    double t_wind = tr_now();
    ftar_member_wind_down(a[0].m);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    double took = tr_now() - t_wind;
    for (int i = 0; i < 2; i++)
      CHECK(a[i].rc == FTAR_ECANCELED && a[i].restored && a[i].seq == 10,
            "wind down: slot %d returned %d (input %s) after seq %llu, %.1f s after slot 0 wound down", i, a[i].rc,
            a[i].restored ? "back" : "not back", (unsigned long long)a[i].seq, took);
    int told = coord_log_has("slot 0 winds the group down");
    CHECK(told, "wind down: the coordinator did not hear of it");
    if (!told || a[1].rc != FTAR_ECANCELED) coord_log_dump("wind down");
    printf("  wind down: both called off %.0f ms after one member wound down\n", took * 1e3);
    for (int i = 0; i < 2; i++) {
      ftar_member_free(a[i].m);
      a[i].m = NULL;
    }
    /* a member registering now is wound down with the group */
    if (wind_member(&late, port, 3, &mo)) {
      double t_late = tr_now();
      thr_wind_run(&late);
      CHECK(late.rc == FTAR_ECANCELED && late.restored && late.seq == 0,
            "wind down: a member registered after it returned %d after seq %llu in %.1f s", late.rc,
            (unsigned long long)late.seq, tr_now() - t_late);
    } else {
      CHECK(0, "wind down: a late member: %s", tr_error());
    }
  }
  for (int i = 0; i < 3; i++) ftar_member_free(a[i].m);
  ftar_member_free(late.m);
  printf("  wind down: %.1f s\n", tr_now() - t0);
  ftar_coord_free(c);
}

/* A member winds down between two collectives (after seq 20) while the
 * other already waits in the next for its data (nobody waits for quorum):
 * both stop after seq 20 with their input back, the one that wound down
 * and the one that only heard of it. The coordinator's epoch at the
 * wind-down's boundary makes both sync before their next collective (slot
 * 0's attempt in the old epoch ends when slot 1 leaves it), where it calls
 * that off for both. (A member that called its next collective off on the
 * spot left the other waiting in it for its data until its timeout.) Slot 0
 * runs on a thread, slot 1 here. */
static void test_wind_down_running(void) {
  double t0 = tr_now();
  ftar_coord *c = coord_start();
  if (!c) return;
  int port = ftar_coord_port(c);
  ftar_member_opts mo;
  wind_opts(&mo, 2);
  thr_wind a = {.last = 0};
  ftar_member *m1 = ftar_member_create("127.0.0.1", port, 1, &mo);
  int ok = wind_member(&a, port, 0, &mo) && m1;
  CHECK(ok && ftar_member_wait(m1, 2, T(10)) == 0, "wind down, running: members: %s", tr_error());
  if (ok) {
    pthread_t th;
    pthread_create(&th, NULL, thr_wind_run, &a);
    float buf[1000];
    ftar_result r;
    uint64_t last = 0;
    int rc = 0;
    while (last < 20 && rc >= 0) {
      for (int i = 0; i < 1000; i++) buf[i] = 2.0f;
      if ((rc = ftar_allreduce(m1, buf, 1000, FTAR_SUM, last + 1, &r)) >= 0) last = r.seq;
    }
    CHECK(rc >= 0, "wind down, running: slot 1: %s", tr_error());
    uint64_t ep0 = ftar_member_epoch(m1, NULL), ep = ep0;
    usleep(20 * 1000); /* slot 0 waits in the next collective */
    double t_wind = tr_now(), end = t_wind + T(10);
    ftar_member_wind_down(m1);
    /* the coordinator's epoch at the boundary reaches slot 1 before its next
     * call (on a busy machine the two could otherwise run collectives in the
     * old epoch for a while, both alike, before it comes) */
    while (ep == ep0 && tr_now() < end) {
      usleep(1000);
      ep = ftar_member_epoch(m1, NULL);
    }
    CHECK(ep > ep0, "wind down, running: no epoch came after the wind-down (still %llu)", (unsigned long long)ep);
    while (rc >= 0 && tr_now() < end) { /* (without that epoch: both go on until then) */
      for (int i = 0; i < 1000; i++) buf[i] = 2.0f;
      if ((rc = ftar_allreduce(m1, buf, 1000, FTAR_SUM, last + 1, &r)) >= 0) last = r.seq;
    }
    int restored = buf[0] == 2.0f && buf[999] == 2.0f;
    end = tr_now() + T(10);
    while (!a.ended && tr_now() < end) usleep(2000);
    if (!a.ended) a.last = a.seq + 1; /* between collectives: stop it (the check below fails) */
    pthread_join(th, NULL);
    double took = tr_now() - t_wind;
    CHECK(rc == FTAR_ECANCELED && restored && a.rc == FTAR_ECANCELED && a.restored && a.seq == last && last == 20,
          "wind down, running: slot 1 returned %d (input %s) after seq %llu, slot 0 %d (input %s) after seq %llu, "
          "%.1f s after slot 1 wound down",
          rc, restored ? "back" : "not back", (unsigned long long)last, a.rc, a.restored ? "back" : "not back",
          (unsigned long long)a.seq, took);
    if (a.rc != FTAR_ECANCELED || a.seq != last) coord_log_dump("wind down, running");
    printf("  wind down, running: both stopped after seq %llu, %.0f ms after one wound down\n",
           (unsigned long long)last, took * 1e3);
  }
  ftar_member_free(a.m);
  ftar_member_free(m1);
  printf("  wind down, running: %.1f s\n", tr_now() - t0);
  ftar_coord_free(c);
}

/* Epoch churn through the hierarchy: slots 0, 1 on host .1, slot 2 on .2
 * stay; slot 3 (on .2) joins and leaves, rounds times: every epoch is
 * hierarchical, its links (shared memory within a host, TCP between the
 * leaders) replaced. The descriptors and shared-memory maps of the process
 * are the same after the last round as after the first. */
static void test_hier_churn(int rounds) {
  double t0 = tr_now();
  ftar_coord *c = coord_start();
  if (!c) return;
  int port = ftar_coord_port(c);
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = 20;
  mo.log = churn_log;
  const char *hosts[4] = {"127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"};
  ftar_member *ms[4] = {0};
  for (int i = 0; i < 3; i++) {
    mo.data_host = hosts[i];
    ms[i] = ftar_member_create("127.0.0.1", port, i, &mo);
    CHECK(ms[i] != NULL, "hier churn: member %d: %s", i, tr_error());
  }
  const int n = 5000;
  float *bufs = malloc(4 * n * sizeof(float));
  uint64_t seq[4] = {1, 1, 1, 1};
  int bad = 0, fd1 = -1, map1 = -1, fdN = -1, mapN = -1, done = 0;
  if (!ms[0] || !ms[1] || !ms[2] || !bufs) goto out;
  bad += churn_round(ms, 3, seq, bufs, 0); /* nothing to reduce: every phase passes empty */
  bad += churn_round(ms, 3, seq, bufs, 1);
  mo.data_host = hosts[3];
  for (int r = 0; r < rounds && !bad; r++, done++) {
    ms[3] = ftar_member_create("127.0.0.1", port, 3, &mo);
    if (!ms[3] || ftar_member_wait(ms[0], 4, T(10))) {
      bad++;
      break;
    }
    seq[3] = 1;
    bad += churn_round(ms, 4, seq, bufs, n);
    ftar_member_free(ms[3]);
    ms[3] = NULL;
    bad += churn_round(ms, 3, seq, bufs, n);
    if (r == 0) fd1 = fds_open(), map1 = shm_maps();
  }
  fdN = fds_open(), mapN = shm_maps();
  CHECK(bad == 0, "hier churn: %d wrong results or failed joins in %d rounds", bad, done);
  CHECK(fdN == fd1 && mapN == map1, "hier churn: %d fds, %d link maps after round 1; %d, %d after round %d", fd1, map1,
        fdN, mapN, done);
  ftar_stats st;
  ftar_member_stats(ms[0], &st);
  CHECK(st.hier_collectives == (uint64_t)(2 * done + 2), "hier churn: %llu of %d collectives hierarchical",
        (unsigned long long)st.hier_collectives, 2 * done + 2);
out:
  printf("  hier churn: %d joins and leaves, fds %d -> %d, link maps %d -> %d: %.1f s\n", done, fd1, fdN, map1, mapN,
         tr_now() - t0);
  for (int i = 0; i < 4; i++) ftar_member_free(ms[i]);
  free(bufs);
  ftar_coord_free(c);
}

/* Waves (ftar_hier.c) where the hierarchy keeps a host alone: MEAN
 * divided once per wave; and faults in a later wave (bucket 2:
 * TRANSOM_FTAR_WAVE_MIN=1, a wave per bucket of 32768 floats) that the
 * host alone (slot 0 of 1+2+3, whose first reduce is the leaders' pass)
 * survives: its done waves and its current wave's leaders' pass are put
 * back exactly (exact sums on the redo). Frames a wave: slot 2 (a host
 * of 2, not its leader) 7 (local reduce 4, broadcast 3), so 23 lands in
 * wave 3's local reduce and 27 in its broadcast (slot 0 then between
 * waves 3 and 4, or in wave 4's ready tokens); slot 3 (leader of the
 * host of 3) 8 (local reduce 4, leaders' reduce 4), so 30 lands in wave
 * 3's leaders' reduce, which slot 0 cannot finish. */
static void test_waves(void) {
  const layout two_by_two = {4, {1, 1, 2, 2}}, three = {6, {1, 2, 2, 3, 3, 3}};
  test_hier_sizes("2x2", &two_by_two, "mean", 0, 4096);
  test_hier_sizes("1+2+3", &three, "mean", 0, 4096);
  test_hier_fault(&three, 2, 23, 0, 0, NULL, 0, 2);
  test_hier_fault(&three, 2, 27, 0, 0, NULL, 0, 2);
  test_hier_fault(&three, 3, 30, 0, 0, "phase 2 (leaders' reduce)", 0, 2);
  test_hier_fault(&three, 3, 30, 1, 0, "phase 2 (leaders' reduce)", 0, 2);
  /* 2+1, slot 1 (7 frames a wave) lost in a broadcast: in wave 2's (19)
   * the two leaders hold only waves 0-2, not full: redone (a COMMIT would
   * return a partial sum over 0,1,2); in the last wave's (54) both are
   * full: committed or redone, alike */
  const layout two_one = {3, {1, 1, 2}};
  test_hier_fault(&two_one, 1, 19, 0, 0, NULL, 0, 2);
  test_hier_fault(&two_one, 1, 54, 0, 0, NULL, 1, 2);
}

static void test_hier(void) {
  const layout two_by_two = {4, {1, 1, 2, 2}}, two_by_three_one = {7, {1, 1, 1, 2, 2, 2, 3}},
               three = {6, {1, 2, 2, 3, 3, 3}};
  test_hier_sizes("2x2", &two_by_two, "sum", 0, 0);
  test_hier_sizes("2x2", &two_by_two, "mean", 0, 0);
  test_hier_sizes("2x2", &two_by_two, "sum", 1, 0);
  test_hier_sizes("2x3+1", &two_by_three_one, "sum", 0, 0);
  test_hier_sizes("2x3+1", &two_by_three_one, "mean", 0, 0);
  test_hier_sizes("1+2+3", &three, "sum", 0, 0);
  test_hier_sizes("1+2+3", &three, "sum", 0, 4096);
  const layout three_two = {5, {1, 1, 1, 2, 2}};
  test_hier_fault(&two_by_two, 3, 2, 0, 2, "phase 1 (local reduce)", 0, 0);
  test_hier_fault(&two_by_two, 3, 8, 0, 2, "holding the full result", 1, 0);
  test_hier_fault(&two_by_two, 2, 8, 0, 0, "phase 2 (leaders' reduce)", 0, 0);
  test_hier_fault(&three_two, 1, 14, 0, 2, "phase 3 (local broadcast)", 0, 0);
  test_hier_fault(&two_by_two, 1, 2, 1, 0, "phase 1 (local reduce)", 0, 0);
  test_hier_fault(&two_by_two, 2, 8, 1, 0, "phase 2 (leaders' reduce)", 0, 0);
  test_hier_fault(&two_by_two, 3, 2, 0, 2, "phase 1 (local reduce)", 0, 1);
  /* (bucket 2: TRANSOM_FTAR_WAVE_MIN=1, a wave per bucket, not per 1 MiB)
   * buckets of 32768 floats, a wave each: a leader receives 8 data frames a
   * wave (local reduce 4, leaders' reduce 4), the others 7 (local reduce 4,
   * broadcast 3); so 30 is a leader's wave 3, phase 2, and the other
   * member's wave 4, phase 1: lost in a later wave, the done waves' input
   * is put back too (exact sums on the redo) */
  test_hier_fault(&two_by_two, 2, 30, 0, 0, "phase 2 (leaders' reduce)", 0, 2);
  test_hier_fault(&two_by_two, 2, 30, 1, 0, "phase 2 (leaders' reduce)", 0, 2);
  test_hier_fault(&two_by_two, 3, 30, 0, 2, "phase 1 (local reduce)", 0, 2);
  /* a leader lost at its last frame of phase 2: its host's other member never gets the result */
  test_hier_fault(&two_by_two, 2, 12, 0, 3, "phase 3 (local broadcast)", 0, 0);
  /* the end of a broadcast chain lost at its last frame (full, before the tokens): committed or redone */
  test_hier_fault(&two_by_two, 3, 11, 0, 2, "phase 4 (local commit)", 1, 0);
  /* a host's only other member lost: the redo falls back to the flat ring (no host keeps 2) */
  const layout two_one = {3, {1, 1, 2}};
  test_hier_fault(&two_one, 1, 2, 0, 0, "phase 1 (local reduce)", 0, 0);
  /* ... lost mid broadcast: the survivors are the two leaders, both full: committed */
  test_hier_fault(&two_one, 1, 8, 0, 0, "holding the full result", 1, 0);
  /* small frames (65536 floats: 2 or 3 a pass); the victim's whole part
   * may have left before it dies, so committed or redone, alike everywhere */
  hier_fault_count = 65536;
  test_hier_fault(&two_by_two, 3, 2, 0, 2, NULL, 1, 0);
  test_hier_fault(&two_by_two, 2, 5, 0, 0, NULL, 1, 0);
  test_hier_fault(&two_by_two, 1, 2, 1, 0, NULL, 1, 0);
  test_hier_fault(&two_by_two, 3, 2, 0, 2, NULL, 1, 1);
  hier_fault_count = 262144;
  test_hier_churn(test_small() ? 50 : 200);
  test_waves();
  test_hier_op_mismatch(0);
  test_hier_op_mismatch(-1);
}

/* --- garbage on the data port and the coordinator port --- */

static int tcp_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

static void send_and_close(int port, const void *b, size_t n) {
  int fd = tcp_connect(port);
  if (fd < 0) return;
  ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
  (void)w;
  usleep(20000);
  close(fd);
}

static size_t frame(uint8_t *out, int type, uint64_t epoch, uint32_t index, uint32_t aux, const void *pay,
                    uint32_t len, int corrupt) {
  ftar_hdr h = {.type = (uint16_t)type, .epoch = epoch, .index = index, .aux = aux, .len = len};
  ftar_frame_build(out, &h, pay);
  if (len) memcpy(out + FTAR_HDR, pay, len);
  if (corrupt) out[FTAR_HDR + len - 1] ^= 0x40;
  return FTAR_HDR + len;
}

/* --- the coordinator's epochs, through raw control connections --- */

/* Sends one control frame on fd. */
static void ctl_put(int fd, int type, uint64_t epoch, uint64_t seq, uint16_t flags, uint32_t index, const void *pay,
                    uint32_t len) {
  uint8_t f[FTAR_HDR + FTAR_HELLO_LEN];
  ftar_hdr h = {.type = (uint16_t)type, .epoch = epoch, .seq = seq, .flags = flags, .index = index, .len = len};
  ftar_frame_build(f, &h, pay);
  if (len) memcpy(f + FTAR_HDR, pay, len);
  ssize_t w = send(fd, f, FTAR_HDR + len, MSG_NOSIGNAL);
  (void)w;
}

/* Reads frames from fd until one of `type` (others skipped) within
 * `seconds`: 0 with its header in *h, or -1. */
static int ctl_expect(int fd, int type, ftar_hdr *h, double seconds) {
  double end = tr_now() + seconds;
  uint8_t b[FTAR_HDR + 4 + FTAR_ENTRY_LEN * FTAR_MAX_MEMBERS];
  for (;;) {
    size_t got = 0, want = FTAR_HDR;
    while (got < want) {
      struct pollfd pf = {.fd = fd, .events = POLLIN};
      double left = end - tr_now();
      if (left <= 0 || poll(&pf, 1, (int)(left * 1000) + 1) <= 0) return -1;
      ssize_t r = recv(fd, b + got, want - got, 0);
      if (r <= 0) return -1;
      got += (size_t)r;
      if (got == FTAR_HDR) {
        ftar_hdr_decode(b, h);
        if (h->len > sizeof b - FTAR_HDR) return -1;
        want = FTAR_HDR + h->len;
      }
    }
    if (h->type == type) return 0;
  }
}

/* A raw member of slot `slot`: HELLO, then its WELCOME and first EPOCH.
 * The fd, or -1. */
static int raw_member(int port, int slot) {
  int fd = tcp_connect(port);
  if (fd < 0) return -1;
  uint8_t hello[FTAR_HELLO_LEN] = {0};
  ftw_put32(hello, FTAR_VERSION);
  ftw_put16(hello + 4, (uint16_t)(40000 + slot)); /* a data port nobody dials: no GO to run here */
  ftw_put16(hello + 6, 9);
  memcpy(hello + 8, "127.0.0.1", 9);
  ctl_put(fd, FT_HELLO, 0, 0, 0, (uint32_t)slot, hello, FTAR_HELLO_LEN);
  ftar_hdr h;
  if (ctl_expect(fd, FT_WELCOME, &h, T(5)) || ctl_expect(fd, FT_EPOCH, &h, T(5))) {
    close(fd);
    return -1;
  }
  return fd;
}

/* An ABORT held back by the coordinator's rate limit (aborts in a row)
 * and a join before it is published: the join's epoch aborts the
 * collective in flight (FTF_ABORT_PREV). Before, the join's boundary epoch
 * swallowed the abort (the held-back one found the epoch moved on), and a
 * member still in the failed collective (on the device plane: nothing
 * tells it) waited for it until its deadline. Members are raw control
 * connections: slots 0 and 1 sync, get GO, slot 0 reports an abort, eight
 * times in a row (the limit's gap doubles up to deadline/4), then slot 2
 * registers while the last abort is held back. */
static void test_owed_abort(void) {
  double t0 = tr_now();
  ftar_coord *c = coord_start();
  if (!c) return;
  int port = ftar_coord_port(c);
  int a = raw_member(port, 0), b = a >= 0 ? raw_member(port, 1) : -1;
  CHECK(a >= 0 && b >= 0, "owed abort: raw members did not register");
  ftar_hdr h;
  int ok = a >= 0 && b >= 0, held = 0;
  for (int k = 0; ok && k < 9; k++) {
    uint64_t ep = 0;
    ftar_coord_members(c, &ep, NULL, 0);
    ctl_put(a, FT_SYNC, ep, 1, FTF_FRESH, 0, NULL, 0);
    ctl_put(b, FT_SYNC, ep, 1, FTF_FRESH, 1, NULL, 0);
    ok = ctl_expect(a, FT_GO, &h, T(5)) == 0 && h.epoch == ep && ctl_expect(b, FT_GO, &h, T(5)) == 0;
    CHECK(ok, "owed abort: no GO for epoch %llu", (unsigned long long)ep);
    if (!ok) break;
    ctl_put(a, FT_ABORT, ep, 1, 0, 0, NULL, 0);
    if (k < 8) { /* the aborted epoch, at once or after the gap */
      ok = ctl_expect(a, FT_EPOCH, &h, T(5)) == 0 && h.epoch == ep + 1 && (h.flags & FTF_ABORT_PREV);
      CHECK(ok, "owed abort: abort %d: no aborting epoch %llu", k, (unsigned long long)ep + 1);
      continue;
    }
    /* held back (the gap is now deadline/4): a join comes first */
    usleep(20 * 1000);
    int j = raw_member(port, 2);
    CHECK(j >= 0, "owed abort: slot 2 did not register");
    held = ctl_expect(a, FT_EPOCH, &h, T(5)) == 0;
    CHECK(held && h.epoch == ep + 1 && (h.flags & FTF_ABORT_PREV),
          "owed abort: the join's epoch %llu (after %llu, whose abort was held back) came with flags %u: %s",
          (unsigned long long)h.epoch, (unsigned long long)ep, (unsigned)h.flags,
          held ? "the abort was lost" : "none came");
    if (j >= 0) close(j);
  }
  if (!held) coord_log_dump("owed abort");
  if (a >= 0) close(a);
  if (b >= 0) close(b);
  printf("  owed abort: %.1f s\n", tr_now() - t0);
  ftar_coord_free(c);
}

/* --- closing connections --- */

/* A BYE queued just before the coordinator is freed still reaches the
 * member: it learns that it was evicted, not that the coordinator is gone. */
static void test_evict_then_free(void) {
  ftar_coord *c = coord_start();
  if (!c) return;
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = T(10);
  ftar_member *a = ftar_member_create("127.0.0.1", ftar_coord_port(c), 0, &mo);
  CHECK(a != NULL, "closing: member: %s", tr_error());
  if (!a) {
    ftar_coord_free(c);
    return;
  }
  CHECK(ftar_coord_evict(c, 0) == 0, "closing: evict request");
  ftar_coord_free(c); /* the quit follows the evict in the same command queue */
  float v[3] = {1, 2, 3};
  ftar_result r;
  int rc = 0;
  uint64_t seq = 1;
  double end = tr_now() + T(10);
  while (tr_now() < end && (rc = ftar_allreduce(a, v, 3, FTAR_SUM, seq++, &r)) >= 0) usleep(20000);
  CHECK(rc == FTAR_EEVICTED && strstr(tr_error(), "evicted by the host"),
        "closing: evicted just before the coordinator quit: rc %d (%s), want FTAR_EEVICTED", rc, tr_error());
  ftar_member_free(a);
  /* embedded in a host's loop (the operator's): the loop has ended when
   * the eviction is asked, so only ftar_coord_free can still send its BYE */
  loop_drv d;
  if (drv_start(&d, 0)) return;
  a = ftar_member_create("127.0.0.1", ftar_coord_port(d.c), 0, &mo);
  CHECK(a != NULL, "closing, embedded: member: %s", tr_error());
  d.quit = 1;
  pthread_join(d.th, NULL);
  CHECK(ftar_coord_evict(d.c, 0) == 0, "closing, embedded: evict request");
  ftar_coord_free(d.c);
  event_base_free(d.base);
  rc = 0;
  end = tr_now() + T(10);
  while (a && tr_now() < end && (rc = ftar_allreduce(a, v, 3, FTAR_SUM, seq++, &r)) >= 0) usleep(20000);
  CHECK(rc == FTAR_EEVICTED && strstr(tr_error(), "evicted by the host"),
        "closing, embedded: evicted after the host's loop ended: rc %d (%s), want FTAR_EEVICTED", rc, tr_error());
  ftar_member_free(a);
}

/* A registration refused (slot in use) by a peer that keeps sending after
 * the REJECT: the coordinator closes it by its closing deadline (2 x 1.5 s)
 * all the same. The peer writes every 100 ms, and waits up to ten times
 * the deadline for the EOF (unbounded before: each byte restarted a read
 * timeout). */
static void test_closing_deadline(void) {
  ftar_coord *c = coord_start();
  if (!c) return;
  int port = ftar_coord_port(c);
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = T(10);
  ftar_member *a = ftar_member_create("127.0.0.1", port, 0, &mo);
  CHECK(a != NULL, "closing deadline: member: %s", tr_error());
  int fd = a ? tcp_connect(port) : -1;
  CHECK(!a || fd >= 0, "closing deadline: connect");
  if (fd >= 0) {
    uint8_t hello[FTAR_HELLO_LEN] = {0}, b[FTAR_HDR + FTAR_HELLO_LEN];
    ftw_put32(hello, FTAR_VERSION);
    ftw_put16(hello + 4, 9);
    ftw_put16(hello + 6, 9);
    memcpy(hello + 8, "127.0.0.1", 9);
    size_t n = frame(b, FT_HELLO, 0, 0, 0, hello, FTAR_HELLO_LEN, 0); /* slot 0: a's */
    CHECK(send(fd, b, n, MSG_NOSIGNAL) == (ssize_t)n, "closing deadline: send HELLO");
    /* the coordinator's FIN (after the REJECT) is a half close: it goes on
     * reading what we send until it closes the socket, and then our sends
     * are answered with a reset and fail */
    int got = 0, fin = 0, closed = 0;
    double end = tr_now() + T(10 * 2 * DEADLINE);
    while (!closed && tr_now() < end) {
      usleep(100000);
      uint8_t in[512];
      ssize_t k = 1;
      while (!fin && (k = recv(fd, in, sizeof in, MSG_DONTWAIT)) != 0) {
        if (k < 0) {
          if (errno == EAGAIN || errno == EINTR) break;
          closed = 1; /* reset */
          break;
        }
        got += (int)k;
      }
      if (k == 0) fin = 1;
      if (send(fd, "x", 1, MSG_NOSIGNAL) < 0 && errno != EAGAIN && errno != EINTR) closed = 1;
    }
    CHECK(got >= FTAR_HDR && fin, "closing deadline: the REJECT (%d bytes) and a FIN after it came", got);
    CHECK(closed, "closing deadline: a refused peer that keeps sending was not closed within %.0f s",
          T(10 * 2 * DEADLINE));
    CHECK(coord_log_has("slot 0 is in use"), "closing deadline: the refusal is logged");
    close(fd);
  }
  ftar_member_free(a);
  ftar_coord_free(c);
}

static int seq_at_least(proc *ps, int n, void *arg) {
  unsigned long long want = *(unsigned long long *)arg;
  for (int i = 0; i < n; i++)
    if (ps[i].nres == 0 || ps[i].res[ps[i].nres - 1].seq < want) return 0;
  return 1;
}

static void test_garbage(void) {
  double tstart = tr_now();
  ftar_coord *c = coord_start();
  if (!c) return;
  int port = ftar_coord_port(c);
  const int p = 3, target = 1;
  unsigned long long last_seq = 0;
  proc ps[MAXP];
  for (int r = 0; r < p; r++) {
    args a;
    rank_args(&a, port, r);
    arg(&a, "--wait");
    arg(&a, "%d", p);
    arg(&a, "--counts");
    arg(&a, "65537");
    arg(&a, "--verify");
    arg(&a, "--iters");
    arg(&a, "1000000");
    arg(&a, "--max-sec");
    arg(&a, "%.0f", T(90));
    arg(&a, "--control-stdin");
    spawn(&ps[r], r, a.v);
  }
  unsigned long long s5 = 5;
  CHECK(wait_until(ps, p, seq_at_least, &s5, T(60)), "garbage: ranks did not start");
  uint64_t ep = 0;
  ftar_coord_members(c, &ep, NULL, 0);
  int dport = ps[target].port;
  uint8_t b[4096], pay[64];
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (size_t i = 0; i < sizeof b; i++) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b[i] = (uint8_t)x;
  }
  /* data port */
  send_and_close(dport, b, 1024); /* random bytes */
  ftar_hdr h = {.magic = FTAR_MAGIC, .type = FT_DATA, .epoch = ep, .seq = 1, .len = 0xffffffffu};
  uint8_t f[FTAR_HDR + 64];
  ftar_hdr_encode(f, &h); /* header only: the payload it announces never comes */
  send_and_close(dport, f, FTAR_HDR); /* DATA frame claiming 4 GiB */
  send_and_close(dport, f, 10);       /* truncated header */
  memset(pay, 0, sizeof pay);
  size_t n = frame(f, FT_CONNECT, 0, 0, target, pay, FTAR_CONNECT_LEN, 0);
  send_and_close(dport, f, n); /* stale epoch */
  n = frame(f, FT_CONNECT, ep, 0, target, pay, FTAR_CONNECT_LEN, 1);
  send_and_close(dport, f, n); /* bad checksum */
  n = frame(f, FT_CONNECT, ep, 99, target, pay, FTAR_CONNECT_LEN, 0);
  send_and_close(dport, f, n); /* current epoch, not our upstream */
  send_and_close(dport, f, FTAR_HDR + 3); /* truncated payload */
  ftw_put32(pay + 20, 0xffffffffu);
  n = frame(f, FT_CONNECT, ep, 0, target, pay, FTAR_CONNECT_LEN, 0);
  send_and_close(dport, f, n); /* a ring level that does not exist */
  memset(pay, 0, sizeof pay);
  int idle_d = tcp_connect(dport);        /* says nothing: dropped after the deadline */
  /* coordinator port */
  send_and_close(port, b + 1024, 512);
  n = frame(f, FT_EPOCH, ep, 0, 0, NULL, 0, 0);
  send_and_close(port, f, n); /* a coordinator-only frame from a client */
  h = (ftar_hdr){.magic = FTAR_MAGIC, .type = FT_HELLO, .len = 0xffff0000u};
  ftar_hdr_encode(f, &h);
  send_and_close(port, f, FTAR_HDR); /* oversized HELLO */
  uint8_t hello[FTAR_HELLO_LEN] = {0};
  ftw_put32(hello, FTAR_VERSION);
  ftw_put16(hello + 4, 1);
  ftw_put16(hello + 6, 9);
  memcpy(hello + 8, "127.0.0.1", 9);
  n = frame(f, FT_HELLO, 0, 7, 0, hello, FTAR_HELLO_LEN, 1);
  send_and_close(port, f, n);             /* bad checksum */
  send_and_close(port, f, FTAR_HDR + 20); /* truncated HELLO */
  n = frame(f, FT_HEARTBEAT, ep, 0, 0, NULL, 0, 0);
  send_and_close(port, f, n); /* heartbeat before HELLO */
  /* a well-formed HELLO for a slot in use gets a REJECT */
  n = frame(f, FT_HELLO, 0, target, 0, hello, FTAR_HELLO_LEN, 0);
  int fd = tcp_connect(port);
  int rejected = 0;
  if (fd >= 0) {
    ssize_t w = send(fd, f, n, MSG_NOSIGNAL);
    (void)w;
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    uint8_t rb[FTAR_HDR];
    if (poll(&pf, 1, 2000) > 0 && recv(fd, rb, FTAR_HDR, MSG_WAITALL) == FTAR_HDR) {
      ftar_hdr rh;
      ftar_hdr_decode(rb, &rh);
      rejected = rh.magic == FTAR_MAGIC && rh.type == FT_REJECT;
    }
    close(fd);
  }
  CHECK(rejected, "a HELLO for a slot in use is answered with REJECT");
  int idle_c = tcp_connect(port);
  double idle_end = tr_now() + DEADLINE + T(0.5); /* the idle ones time out meanwhile */
  while (tr_now() < idle_end) pump(ps, p, 20);
  for (int r = 0; r < p; r++)
    if (ps[r].nres && ps[r].res[ps[r].nres - 1].seq > last_seq) last_seq = ps[r].res[ps[r].nres - 1].seq;
  last_seq += 20; /* all ranks are within one collective of each other */
  tell_until(ps, p, last_seq);
  finish(ps, p, T(90));
  if (idle_d >= 0) close(idle_d);
  if (idle_c >= 0) close(idle_c);
  for (int r = 0; r < p; r++) {
    proc *s = &ps[r];
    CHECK(exited_ok(s) && s->errors == 0, "garbage: rank %d exit status %d", r, s->status);
    int bad = 0;
    for (int i = 0; i < s->nres; i++)
      bad += !s->res[i].ok || s->res[i].rc != 0 || s->res[i].contrib != 3 || s->res[i].epoch != ep || s->res[i].redos;
    CHECK(bad == 0, "garbage: rank %d: %d results wrong or reshaped", r, bad);
    CHECK(s->nres > 0 && s->res[s->nres - 1].seq == last_seq, "garbage: rank %d ran to seq %llu", r, last_seq);
  }
  const char *eb = ps[target].eb ? ps[target].eb : "";
  const char *reasons[] = {"bad magic",     "beyond",        "truncated handshake", "stale epoch",
                           "bad checksum",  "not from our upstream", "no valid CONNECT",
                           "CONNECT for ring level 4294967295"};
  for (size_t i = 0; i < sizeof reasons / sizeof reasons[0]; i++)
    CHECK(strstr(eb, reasons[i]) != NULL, "garbage: rank log names '%s'", reasons[i]);
  CHECK(ps[target].rejected >= 8, "garbage: rank counted %ld rejected connections", ps[target].rejected);
  const char *creasons[] = {"bad magic", "unexpected EPOCH", "beyond", "bad checksum", "frame before HELLO",
                            "is in use", "no HELLO within"};
  for (size_t i = 0; i < sizeof creasons / sizeof creasons[0]; i++)
    CHECK(coord_log_has(creasons[i]), "garbage: coordinator log names '%s'", creasons[i]);
  printf("  garbage: %.1f s\n", tr_now() - tstart);
  proc_free(ps, p);
  ftar_coord_free(c);
}

/* --- soak: many small collectives --- */

static void test_soak(void) {
  double tstart = tr_now();
  ftar_coord *c = coord_start();
  if (!c) return;
  proc ps[2];
  for (int r = 0; r < 2; r++) {
    args a;
    rank_args(&a, ftar_coord_port(c), r);
    arg(&a, "--wait");
    arg(&a, "2");
    arg(&a, "--counts");
    arg(&a, "1,7,64,1000");
    arg(&a, "--iters");
    arg(&a, "250");
    arg(&a, "--verify");
    arg(&a, "--quiet");
    spawn(&ps[r], r, a.v);
  }
  finish(ps, 2, T(120));
  for (int r = 0; r < 2; r++) {
    CHECK(exited_ok(&ps[r]) && ps[r].errors == 0 && ps[r].done && ps[r].collectives == 1000,
          "soak: rank %d exit status %d (a LeakSanitizer report exits 23), %ld collectives", r, ps[r].status,
          ps[r].collectives);
    if (!exited_ok(&ps[r]) && ps[r].eb) fprintf(stderr, "%.4000s\n", ps[r].eb);
  }
  printf("  soak: 1000 collectives x 2 ranks: %.1f s\n", tr_now() - tstart);
  proc_free(ps, 2);
  ftar_coord_free(c);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  setvbuf(stdout, NULL, _IOLBF, 0);
  verbose = getenv("FTAR_TEST_VERBOSE") != NULL;
  tscale = test_time_scale();
  const char *bin = getenv("TRANSOM_BIN");
  if (bin) {
    snprintf(transom_bin, sizeof transom_bin, "%s", bin);
  } else {
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    self[n > 0 ? n : 0] = 0;
    char *slash = strrchr(self, '/');
    if (slash) *slash = 0;
    snprintf(transom_bin, sizeof transom_bin, "%s/transom", self);
  }
  if (access(transom_bin, X_OK) != 0) {
    fprintf(stderr, "test_ftar: %s not found (set TRANSOM_BIN)\n", transom_bin);
    return 1;
  }
  int lng = getenv("TRANSOM_LONG") != NULL;
  double t0 = tr_now();
  const char *only = getenv("FTAR_TEST_ONLY");
  if (only && strcmp(only, "leave") == 0) {
    test_leave_backlog();
    test_joiner_leaves_after_go();
    test_member_leave();
    test_member_leave_go();
    test_wind_down();
    test_wind_down_running();
    test_owed_abort();
    return check_report("test_ftar");
  }
  if (only && strcmp(only, "closing") == 0) {
    test_evict_then_free();
    test_closing_deadline();
    return check_report("test_ftar");
  }
  if (only && strcmp(only, "grid") == 0) {
    test_grid();
    printf("  total %.1f s\n", tr_now() - t0);
    return check_report("test_ftar");
  }
  if (only && strcmp(only, "stores") == 0) {
    test_shm_stores();
    test_stores_sizes(test_small());
    printf("  total %.1f s\n", tr_now() - t0);
    return check_report("test_ftar");
  }
  if (only && strcmp(only, "wire") == 0) {
    test_wire();
    test_shm_stores();
    printf("  total %.1f s\n", tr_now() - t0);
    return check_report("test_ftar");
  }
  if (only && strcmp(only, "waves") == 0) {
    test_waves();
    printf("  total %.1f s\n", tr_now() - t0);
    return check_report("test_ftar");
  }
  if (only && strcmp(only, "hier") == 0) {
    test_hier();
    printf("  total %.1f s\n", tr_now() - t0);
    return check_report("test_ftar");
  }
  test_wire();
  test_shm_stores();
  test_api();
  test_evict_then_free();
  test_closing_deadline();
  test_join_at();
  test_join_cancel();
  test_buckets();
  test_stall();
  test_new_coordinator();
  int small = test_small();
  const char *counts = small ? "1,2,3,5,7,31,1000,4097,65537"
                             : "1,2,3,5,7,31,1000,4097,65537,262147,1048573,4194301,16777216";
  for (int tcp = 0; tcp < 2; tcp++) { /* same-host shared-memory rings, then plain TCP links */
    test_sizes(2, "sum", tcp, counts, 0);
    test_sizes(3, "sum", tcp, counts, 0);
    test_sizes(4, "sum", tcp, counts, 0);
    test_sizes(3, "mean", tcp, small ? "1,3,1000,65537" : "1,3,1000,65537,1048573", 0);
    test_sizes(3, "sum", tcp, "1,7,1000,65537,1048573", 10000);
    test_sizes(2, "mean", tcp, "1,3,65537", 4096);
  }
  test_stores_sizes(small);
  test_grid();
  int rounds = lng ? 5 : 1;
  for (int i = 0; i < rounds; i++)
    for (int tcp = 0; tcp < 2; tcp++) {
      test_fault(0, 0, tcp, 1234u + (unsigned)i, 0, 3, 0, 0);
      test_fault(1, 0, tcp, 4321u + (unsigned)i, 0, 3, 0, 0);
      test_fault(0, 0, tcp, 2345u + (unsigned)i, 1, 3, 0, 0);
      test_fault(0, 0, tcp, 3456u + (unsigned)i, 0, 2, 0, 0); /* mid two-member exchange */
      test_fault(1, 0, tcp, 6543u + (unsigned)i, 0, 2, 0, 0);
    }
  test_fault(0, 0, 1, 4567u, 1, 2, 0, 0); /* the exchange, bucketed */
  test_fault(1, 0, 0, 5432u, 1, 3, 0, 0);
  test_fault(0, 1, 0, 99u, 0, 3, 0, 0);
  test_fault(0, 1, 1, 98u, 0, 3, 0, 0);
  test_fault(0, 1, 0, 97u, 1, 3, 0, 0);
  test_hier();
  test_leave_backlog();
  test_joiner_leaves_after_go();
  test_member_leave();
  test_member_leave_go();
  test_wind_down();
  test_wind_down_running();
  test_owed_abort();
  test_garbage();
  test_soak();
  printf("  total %.1f s\n", tr_now() - t0);
  return check_report("test_ftar");
}
