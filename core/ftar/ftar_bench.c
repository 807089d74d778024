/* ftar_bench.c — `transom ftar-bench`: the standalone FTAR driver.
 *
 * Modes (on 127.0.0.1; a rank listens on and advertises --data-host (or
 * --host) when given, so ranks in network namespaces reach each other,
 * bench/ftar_hier_bench.sh):
 *   sweep (default)  a coordinator thread + N rank processes (this binary,
 *                    re-executed as `ftar-bench rank`); every rank all-reduces
 *                    each size warmup+iters times; prints time, algbw and
 *                    busbw = algbw * 2(n-1)/n per size (the slowest rank's
 *                    time, nccl-tests' convention).
 *   recovery         N ranks loop over a large all-reduce; one is killed
 *                    (kill -9) or stopped (SIGSTOP) mid-collective; prints the
 *                    time from the signal to the survivors' completed redo.
 *   coord            a coordinator alone; prints "ftar-coord port=P" and runs
 *                    until stdin closes or SIGTERM.
 *   rank             one member; the building block of the others and of
 *                    spec/c/test_ftar.c. Prints machine-readable lines:
 *     ftar-ready  slot=S port=P pid=PID
 *     ftar-result slot=S seq=Q count=N rc=R epoch=E contrib=C redos=D
 *                 slots=a,b ok=1 t0=T t1=T      (t: CLOCK_MONOTONIC seconds)
 *     ftar-time   slot=S count=N iters=K sec=T sent=B streamed=M  (with
 *                 --quiet, per size: bytes sent over the measured
 *                 iterations, of them stored non-temporally into shared
 *                 memory; the sweep's "streamed" column is their share)
 *     ftar-error  slot=S seq=Q rc=R msg=...
 *     ftar-done   slot=S collectives=N redos=R epochs=E rejected=J shm_links=K
 *                 tcp_links=L shm_streamed=M
 *     ftar-hier   slot=S hier_collectives=N grid_collectives=G waves=W
 *                 bytes_sent=B cross_bytes=X (after ftar-done: attempts
 *                 through the hierarchical plane and the grid, their waves,
 *                 bytes sent, of them to members of other hosts)
 *   Inputs are small integers, (slot+1) * (1 + (i + seq) % 5) (or without
 *   seq: --pattern static, for joiners that cannot know the group's seq
 *   before their first collective), so --verify checks exact sums element by
 *   element against the contributors the result reports.
 *
 * Not library code in spirit: it prints and spawns processes, but it still
 * returns exit statuses to main() instead of exiting.
 */
#define _GNU_SOURCE /* sched_setaffinity */
#include "ftar_bench.h"

#include <errno.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ftar.h"
#include "util.h"

extern char **environ;

#define MAX_SIZES 64
#define MAX_RANKS 64

static volatile sig_atomic_t stop_flag;
static void on_term(int sig) {
  (void)sig;
  stop_flag = 1;
}

/* --- argument helpers --- */

static int parse_u64(const char *s, uint64_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (end == s || errno) return -1;
  uint64_t mul = 1;
  if (*end == 'K' || *end == 'k') mul = 1024, end++;
  else if (*end == 'M' || *end == 'm') mul = 1024 * 1024, end++;
  else if (*end == 'G' || *end == 'g') mul = 1024ull * 1024 * 1024, end++;
  if (*end) return -1;
  *out = (uint64_t)v * mul;
  return 0;
}

static int parse_list(const char *s, uint64_t *out, int max) {
  char tmp[1024];
  snprintf(tmp, sizeof tmp, "%s", s);
  int n = 0;
  for (char *save = NULL, *t = strtok_r(tmp, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    if (n == max || parse_u64(t, &out[n])) return -1;
    n++;
  }
  return n;
}

static int parse_double(const char *s, double *out) {
  char *end;
  double v = strtod(s, &end);
  if (end == s || *end || !(v >= 0)) return -1;
  *out = v;
  return 0;
}

static const char *human(uint64_t bytes, char *buf, size_t n) {
  if (bytes >= (1u << 30) && bytes % (1u << 30) == 0) snprintf(buf, n, "%llu GiB", (unsigned long long)(bytes >> 30));
  else if (bytes >= (1u << 20) && bytes % (1u << 20) == 0) snprintf(buf, n, "%llu MiB", (unsigned long long)(bytes >> 20));
  else if (bytes >= 1024 && bytes % 1024 == 0) snprintf(buf, n, "%llu KiB", (unsigned long long)(bytes >> 10));
  else snprintf(buf, n, "%llu B", (unsigned long long)bytes);
  return buf;
}

/* Measured iterations for a size when --iters auto: ~512 MiB of payload. */
static int auto_iters(uint64_t bytes) {
  uint64_t k = ((uint64_t)512 << 20) / (bytes ? bytes : 1);
  return k < 5 ? 5 : k > 1000 ? 1000 : (int)k;
}

/* --- the rank --- */

typedef struct {
  const char *coord;
  int slot, wait, min_members, warmup, iters, verify, quiet, loop, static_pattern, until_contrib, until_slot, tail;
  int control_stdin; /* read "until-seq N" lines from stdin between collectives */
  uint64_t until_seq;
  ftar_op op;
  double timeout, deadline, max_sec;
  uint64_t chunk, seq0, shm_ring;
  int64_t sockbuf;
  int spin_us, bind, no_shm, shm_stores; /* shm_stores: opts.shm_stream */
  int hier;              /* opts.hier: -1 auto, 0 --flat, 1 --hier */
  const char *data_host; /* --data-host: the address to listen on and advertise (NULL: 127.0.0.1) */
  uint64_t bucket;  /* > 0: ftar_allreduce_start in buckets of this many floats, the input produced
                       from its end in half buckets (the way backward produces gradients) */
  uint64_t produce_us; /* a pause after each produced half bucket */
  uint64_t counts[MAX_SIZES];
  int ncounts;
} rank_opts;

/* buf[i] = (slot+1) * (1 + (i + seq) % 5), without a division per element */
static void fill(float *buf, size_t n, int slot, uint64_t seq, int stat) {
  float v[5];
  for (int k = 0; k < 5; k++) v[k] = (float)((slot + 1) * (1 + k));
  unsigned j = stat ? 0 : (unsigned)(seq % 5);
  for (size_t i = 0; i < n; i++) {
    buf[i] = v[j];
    j = j == 4 ? 0 : j + 1;
  }
}

/* Exact check: sum over contributors of (s+1) * f(i), divided once by the
 * contributor count for MEAN (as the owner of each segment does). */
static long verify(const float *buf, size_t n, const ftar_result *r, ftar_op op, int stat, size_t *first_bad,
                   float *got, float *want) {
  long sum_w = 0, bad = 0;
  for (int k = 0; k < r->contributors; k++) sum_w += r->slots[k] + 1;
  float v[5];
  for (int k = 0; k < 5; k++) {
    v[k] = (float)(sum_w * (1 + k));
    if (op == FTAR_MEAN) v[k] = v[k] / (float)r->contributors;
  }
  unsigned j = stat ? 0 : (unsigned)(r->seq % 5);
  for (size_t i = 0; i < n; i++, j = j == 4 ? 0 : j + 1) {
    float e = v[j];
    if (buf[i] != e) {
      if (!bad) {
        *first_bad = i;
        *got = buf[i];
        *want = e;
      }
      bad++;
    }
  }
  return bad;
}

/* Between collectives: a test may tell every rank to stop at one seq. */
static void read_control(rank_opts *ro, char *line, size_t *len, size_t cap) {
  for (;;) {
    struct pollfd p = {.fd = 0, .events = POLLIN};
    if (poll(&p, 1, 0) <= 0) return;
    char got[128];
    ssize_t k = read(0, got, sizeof got);
    if (k <= 0) {
      ro->control_stdin = 0; /* EOF: no more instructions */
      return;
    }
    for (ssize_t i = 0; i < k; i++) { /* byte by byte into the partial line; a line past cap is cut */
      if (got[i] != '\n') {
        if (*len + 1 < cap) line[(*len)++] = got[i];
        continue;
      }
      line[*len] = 0;
      unsigned long long q;
      if (sscanf(line, "until-seq %llu", &q) == 1) ro->until_seq = q;
      *len = 0;
    }
  }
}

/* A rank's running state, from joining to ftar-done. */
typedef struct {
  ftar_member *m;
  float *buf;
  float *src; /* --bucket: the input, copied into buf piece by piece */
  double t_start; /* when it began to join (--max-sec counts from here) */
  uint64_t seq;   /* the next collective's */
  int tail_seen, stop, fail;
  char ctl[256]; /* --control-stdin: a partial line */
  size_t ctl_len;
} rank_state;

static void rank_bind(int slot) { /* like mpirun --bind-to core: one core per rank, round robin */
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET((int)(slot % (cpus > 0 ? cpus : 1)), &set);
  sched_setaffinity(0, sizeof set, &set);
}

/* Creates the member (retrying while the slot is still in use) and prints
 * ftar-ready. 0, or the exit status (printed). */
static int rank_join(rank_opts *ro, rank_state *rs) {
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = ro->timeout;
  mo.deadline = ro->deadline;
  mo.min_members = ro->min_members;
  if (ro->chunk) mo.chunk_bytes = ro->chunk;
  mo.shm_ring_bytes = ro->shm_ring;
  if (ro->sockbuf >= 0) mo.sockbuf = (int)ro->sockbuf;
  mo.spin_us = ro->spin_us;
  if (ro->no_shm) mo.shm = 0;
  mo.shm_stream = ro->shm_stores;
  mo.hier = ro->hier;
  if (ro->data_host) mo.data_host = ro->data_host;
  char host[64];
  int port = 0;
  const char *colon = strrchr(ro->coord, ':');
  if (!colon || (size_t)(colon - ro->coord) >= sizeof host || (port = atoi(colon + 1)) <= 0) {
    fprintf(stderr, "ftar-bench rank: --coord HOST:PORT required\n");
    return 2;
  }
  memcpy(host, ro->coord, (size_t)(colon - ro->coord));
  host[colon - ro->coord] = 0;
  rs->t_start = tr_now();
  while (!rs->m) { /* a replacement may race the coordinator noticing the old one's death */
    rs->m = ftar_member_create(host, port, ro->slot, &mo);
    if (!rs->m) {
      if (strstr(tr_error(), "in use") && tr_now() - rs->t_start < ro->timeout) {
        usleep(20000);
        continue;
      }
      printf("ftar-error slot=%d seq=0 rc=-1 msg=%s\n", ro->slot, tr_error());
      return 1;
    }
  }
  printf("ftar-ready slot=%d port=%d pid=%d\n", ro->slot, ftar_member_data_port(rs->m), (int)getpid());
  return 0;
}

/* Before a collective: 1 if the rank must stop (signal, --max-sec, or the
 * --until-seq a controlling test sent). */
static int rank_should_stop(rank_opts *ro, rank_state *rs) {
  if (stop_flag || (ro->max_sec > 0 && tr_now() - rs->t_start > ro->max_sec)) return 1;
  if (ro->control_stdin) read_control(ro, rs->ctl, &rs->ctl_len, sizeof rs->ctl);
  return ro->until_seq > 0 && rs->seq > ro->until_seq;
}

/* --verify: 1 if buf holds exactly the sum (mean) over the contributors;
 * else prints the first mismatch and marks the rank failed. */
static int rank_verify(const rank_opts *ro, rank_state *rs, size_t n, const ftar_result *res) {
  size_t at = 0;
  float got = 0, want = 0;
  long bad = verify(rs->buf, n, res, ro->op, ro->static_pattern, &at, &got, &want);
  if (!bad) return 1;
  rs->fail = 1;
  fprintf(stderr, "ftar-bench rank %d: seq %llu: %ld of %zu elements wrong, first [%zu] = %g, want %g\n", ro->slot,
          (unsigned long long)res->seq, bad, n, at, (double)got, (double)want);
  return 0;
}

static void print_result(const rank_opts *ro, size_t n, int rc, const ftar_result *res, int ok, double t0, double t1) {
  char sl[FTAR_MAX_MEMBERS * 8];
  size_t off = 0;
  sl[0] = 0;
  for (int k = 0; k < res->contributors && off + 12 < sizeof sl; k++)
    off += (size_t)snprintf(sl + off, sizeof sl - off, "%s%d", k ? "," : "", res->slots[k]);
  printf("ftar-result slot=%d seq=%llu count=%zu rc=%d epoch=%llu contrib=%d redos=%d slots=%s ok=%d "
         "t0=%.6f t1=%.6f\n",
         ro->slot, (unsigned long long)res->seq, n, rc, (unsigned long long)res->epoch, res->contributors, res->redos,
         sl, ok, t0, t1);
}

/* --bucket: the collective started first, then the input written into buf
 * from its end, half a bucket at a time, each piece declared final. */
static int rank_bucketed(rank_opts *ro, rank_state *rs, size_t n, ftar_result *res) {
  int rc = ftar_allreduce_start(rs->m, rs->buf, n, ro->op, rs->seq, (size_t)ro->bucket);
  if (rc) return rc;
  size_t piece = ro->bucket > 1 ? (size_t)ro->bucket / 2 : 1;
  for (size_t hi = n; hi > 0;) {
    size_t lo = hi > piece ? hi - piece : 0;
    memcpy(rs->buf + lo, rs->src + lo, (hi - lo) * sizeof(float));
    ftar_allreduce_ready(rs->m, lo);
    if (ro->produce_us) usleep((useconds_t)ro->produce_us);
    hi = lo;
  }
  return ftar_allreduce_wait(rs->m, res, NULL);
}

/* One all-reduce of n floats, checked and printed. -1 if it failed
 * (printed; the rank stops). */
static int rank_collective(rank_opts *ro, rank_state *rs, size_t n, ftar_result *res, double *t0, double *t1) {
  if (ro->verify) fill(ro->bucket ? rs->src : rs->buf, n, ro->slot, rs->seq, ro->static_pattern);
  *t0 = tr_now();
  int rc = ro->bucket ? rank_bucketed(ro, rs, n, res) : ftar_allreduce(rs->m, rs->buf, n, ro->op, rs->seq, res);
  *t1 = tr_now();
  if (rc < 0) {
    printf("ftar-error slot=%d seq=%llu rc=%d msg=%s\n", ro->slot, (unsigned long long)rs->seq, rc, tr_error());
    rs->fail = 1;
    return -1;
  }
  int ok = ro->verify ? rank_verify(ro, rs, n, res) : 1;
  if (!ro->quiet) print_result(ro, n, rc, res, ok, *t0, *t1);
  return 0;
}

/* After a collective: the next seq, and whether a --until-* goal is met. */
static void rank_advance(const rank_opts *ro, rank_state *rs, const ftar_result *res) {
  rs->seq = res->seq + 1;
  int has_slot = 0;
  for (int k = 0; k < res->contributors; k++) has_slot |= res->slots[k] == ro->until_slot;
  if (ro->until_contrib > 0 && res->contributors >= ro->until_contrib && ++rs->tail_seen >= ro->tail) rs->stop = 1;
  if (ro->until_slot >= 0 && has_slot && ++rs->tail_seen >= ro->tail) rs->stop = 1;
  if (ro->until_seq > 0 && res->seq >= ro->until_seq) rs->stop = 1;
}

/* warmup + iters collectives of n floats; with --quiet, ftar-time. */
static void rank_size(rank_opts *ro, rank_state *rs, size_t n) {
  int iters = ro->iters > 0 ? ro->iters : auto_iters(n * 4);
  int total = ro->warmup + iters;
  double t_first = 0, t_last = 0;
  ftar_stats s0 = {0}, s1;
  if (!ro->verify) fill(ro->bucket ? rs->src : rs->buf, n, ro->slot, rs->seq, ro->static_pattern);
  for (int it = 0; it < total; it++) {
    ftar_result res;
    double t0, t1;
    if (rank_should_stop(ro, rs) || rank_collective(ro, rs, n, &res, &t0, &t1)) {
      rs->stop = 1;
      break;
    }
    if (it == ro->warmup) {
      t_first = t0;
      ftar_member_stats(rs->m, &s0); /* as the measured ones start (the last warm-up's bytes are counted) */
    }
    t_last = t1;
    rank_advance(ro, rs, &res);
    if (rs->stop) break;
  }
  ftar_member_stats(rs->m, &s1);
  if (ro->quiet && t_last > t_first && t_first > 0)
    printf("ftar-time slot=%d count=%zu iters=%d sec=%.9f sent=%llu streamed=%llu\n", ro->slot, n, iters,
           t_last - t_first, (unsigned long long)(s1.bytes_sent - s0.bytes_sent),
           (unsigned long long)(s1.bytes_streamed - s0.bytes_streamed));
}

static int rank_run(rank_opts *ro) {
  if (ro->bind) rank_bind(ro->slot);
  rank_state rs = {.seq = ro->seq0};
  int rc = rank_join(ro, &rs);
  if (rc) return rc;
  uint64_t maxc = 1;
  for (int i = 0; i < ro->ncounts; i++)
    if (ro->counts[i] > maxc) maxc = ro->counts[i];
  if (ro->wait > 1 && (rc = ftar_member_wait(rs.m, ro->wait, ro->timeout))) {
    printf("ftar-error slot=%d seq=0 rc=%d msg=%s\n", ro->slot, rc, tr_error());
    rs.fail = 1;
  } else if (!(rs.buf = malloc(maxc * sizeof(float))) || (ro->bucket && !(rs.src = malloc(maxc * sizeof(float))))) {
    printf("ftar-error slot=%d seq=0 rc=-1 msg=out of memory\n", ro->slot);
    rs.fail = 1;
  } else {
    do {
      for (int ci = 0; ci < ro->ncounts && !rs.stop; ci++) rank_size(ro, &rs, (size_t)ro->counts[ci]);
    } while (!rs.stop && ro->loop);
  }
  ftar_stats st;
  ftar_member_stats(rs.m, &st);
  printf("ftar-done slot=%d collectives=%llu redos=%llu epochs=%llu rejected=%llu shm_links=%llu tcp_links=%llu "
         "shm_streamed=%llu\n",
         ro->slot, (unsigned long long)st.collectives, (unsigned long long)st.redos, (unsigned long long)st.epochs,
         (unsigned long long)st.conns_rejected, (unsigned long long)st.links_shm, (unsigned long long)st.links_tcp,
         (unsigned long long)st.bytes_streamed);
  printf("ftar-hier slot=%d hier_collectives=%llu grid_collectives=%llu waves=%llu bytes_sent=%llu cross_bytes=%llu\n",
         ro->slot, (unsigned long long)st.hier_collectives, (unsigned long long)st.grid_collectives,
         (unsigned long long)st.waves, (unsigned long long)st.bytes_sent, (unsigned long long)st.bytes_cross);
  fflush(stdout);
  free(rs.buf);
  free(rs.src);
  ftar_member_free(rs.m);
  return rs.fail ? 1 : 0;
}

/* --- child processes --- */

typedef struct {
  pid_t pid;
  int fd, slot, eof, exited, status;
  char buf[8192];
  size_t len;
} child;

static int spawn_rank(child *c, char **argv) {
  int p[2];
  if (pipe(p) != 0) return tr_fail(TR_EIO, "pipe: %s", strerror(errno));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, p[1], 1);
  posix_spawn_file_actions_addclose(&fa, p[0]);
  posix_spawn_file_actions_addclose(&fa, p[1]);
  int rc = posix_spawn(&c->pid, "/proc/self/exe", &fa, NULL, argv, environ);
  posix_spawn_file_actions_destroy(&fa);
  close(p[1]);
  if (rc != 0) {
    close(p[0]);
    return tr_fail(TR_EIO, "posix_spawn: %s", strerror(rc));
  }
  c->fd = p[0];
  c->eof = c->exited = 0;
  c->len = 0;
  return 0;
}

/* Waits up to timeout_ms for output; calls on_line for every complete line.
 * Returns the number of children still open. */
static int pump_children(child *cs, int n, int timeout_ms, void (*on_line)(void *, child *, const char *), void *ud) {
  struct pollfd pf[MAX_RANKS + 1];
  int idx[MAX_RANKS + 1], np = 0;
  for (int i = 0; i < n; i++)
    if (!cs[i].eof) {
      pf[np] = (struct pollfd){.fd = cs[i].fd, .events = POLLIN};
      idx[np++] = i;
    }
  if (np == 0) return 0;
  if (poll(pf, (nfds_t)np, timeout_ms) <= 0) return np;
  for (int k = 0; k < np; k++) {
    if (!pf[k].revents) continue;
    child *c = &cs[idx[k]];
    ssize_t r = read(c->fd, c->buf + c->len, sizeof c->buf - 1 - c->len);
    if (r <= 0) {
      c->eof = 1;
      close(c->fd);
      c->fd = -1;
      continue;
    }
    c->len += (size_t)r;
    c->buf[c->len] = 0;
    char *start = c->buf, *nl;
    while ((nl = strchr(start, '\n'))) {
      *nl = 0;
      on_line(ud, c, start);
      start = nl + 1;
    }
    c->len = strlen(start);
    memmove(c->buf, start, c->len + 1);
    if (c->len == sizeof c->buf - 1) c->len = 0; /* an absurd line: drop it */
  }
  int open = 0;
  for (int i = 0; i < n; i++) open += !cs[i].eof;
  return open;
}

static void reap(child *cs, int n) {
  for (int i = 0; i < n; i++) {
    if (cs[i].pid > 0 && !cs[i].exited) {
      waitpid(cs[i].pid, &cs[i].status, 0);
      cs[i].exited = 1;
    }
    if (cs[i].fd >= 0) close(cs[i].fd);
    cs[i].fd = -1;
  }
}

static void common_rank_args(char **argv, int *k, char bufs[][64], int *b, const char *coord, int slot) {
  argv[(*k)++] = "transom";
  argv[(*k)++] = "ftar-bench";
  argv[(*k)++] = "rank";
  argv[(*k)++] = "--coord";
  argv[(*k)++] = (char *)coord;
  argv[(*k)++] = "--slot";
  snprintf(bufs[*b], 64, "%d", slot);
  argv[(*k)++] = bufs[(*b)++];
}

/* --- sweep --- */

typedef struct {
  int nranks, nsizes;
  uint64_t sizes[MAX_SIZES];
  double sec[MAX_SIZES][MAX_RANKS];
  double sent[MAX_SIZES], streamed[MAX_SIZES]; /* bytes, all ranks: the share stored non-temporally */
  int iters[MAX_SIZES];
  int errors;
} sweep_state;

static void sweep_line(void *ud, child *c, const char *line) {
  sweep_state *s = ud;
  int slot, iters;
  size_t count;
  double sec;
  if (sscanf(line, "ftar-time slot=%d count=%zu iters=%d sec=%lf", &slot, &count, &iters, &sec) == 4) {
    for (int i = 0; i < s->nsizes; i++)
      if (s->sizes[i] == count * 4 && slot >= 0 && slot < MAX_RANKS) {
        s->sec[i][slot] = sec;
        s->iters[i] = iters;
        unsigned long long sent, streamed;
        const char *q = strstr(line, " sent=");
        if (q && sscanf(q, " sent=%llu streamed=%llu", &sent, &streamed) == 2) {
          s->sent[i] += (double)sent;
          s->streamed[i] += (double)streamed;
        }
      }
  } else if (strncmp(line, "ftar-error", 10) == 0) {
    fprintf(stderr, "rank %d: %s\n", c->slot, line);
    s->errors++;
  }
}

typedef struct {
  int ranks, warmup, iters, verify;
  ftar_op op;
  double deadline;
  uint64_t chunk, shm_ring;
  int64_t sockbuf;
  int spin_us, bind, no_shm, shm_stores, hier;
  uint64_t sizes[MAX_SIZES];
  int nsizes;
} sweep_opts;

/* The command line of sweep rank r (argv points into bufs). */
static void sweep_rank_argv(const sweep_opts *so, const char *coordaddr, char *sizes, int r, char **argv,
                            char bufs[][64]) {
  int k = 0, b = 0;
  common_rank_args(argv, &k, bufs, &b, coordaddr, r);
  argv[k++] = "--counts";
  argv[k++] = sizes;
  argv[k++] = "--wait";
  snprintf(bufs[b], 64, "%d", so->ranks);
  argv[k++] = bufs[b++];
  argv[k++] = "--warmup";
  snprintf(bufs[b], 64, "%d", so->warmup);
  argv[k++] = bufs[b++];
  argv[k++] = "--iters";
  snprintf(bufs[b], 64, "%d", so->iters);
  argv[k++] = so->iters > 0 ? bufs[b++] : "auto";
  argv[k++] = "--op";
  argv[k++] = so->op == FTAR_MEAN ? "mean" : "sum";
  if (so->chunk) {
    argv[k++] = "--chunk";
    snprintf(bufs[b], 64, "%llu", (unsigned long long)so->chunk);
    argv[k++] = bufs[b++];
  }
  if (so->shm_ring) {
    argv[k++] = "--shm-ring";
    snprintf(bufs[b], 64, "%llu", (unsigned long long)so->shm_ring);
    argv[k++] = bufs[b++];
  }
  if (so->sockbuf >= 0) {
    argv[k++] = "--sockbuf";
    snprintf(bufs[b], 64, "%lld", (long long)so->sockbuf);
    argv[k++] = bufs[b++];
  }
  argv[k++] = "--spin";
  snprintf(bufs[b], 64, "%d", so->spin_us);
  argv[k++] = bufs[b++];
  argv[k++] = "--quiet";
  if (so->verify) argv[k++] = "--verify";
  if (so->bind) argv[k++] = "--bind";
  if (so->shm_stores >= 0) {
    argv[k++] = "--shm-stores";
    argv[k++] = so->shm_stores ? "stream" : "cached";
  }
  if (so->no_shm) { /* TCP as between hosts: each rank a host of its own (127.0.0.r+1) */
    argv[k++] = "--tcp";
    argv[k++] = "--data-host";
    snprintf(bufs[b], 64, "127.0.0.%d", r + 1);
    argv[k++] = bufs[b++];
  }
  if (so->hier >= 0) argv[k++] = so->hier ? "--hier" : "--flat";
  argv[k] = NULL;
}

/* Spawns every rank. 0, or 1 (printed) with the ones started killed and
 * reaped. */
static int sweep_spawn(const sweep_opts *so, const char *coordaddr, char *sizes, child *cs) {
  char bufs[16][64];
  for (int r = 0; r < so->ranks; r++) {
    char *argv[40];
    sweep_rank_argv(so, coordaddr, sizes, r, argv, bufs);
    cs[r].slot = r;
    cs[r].fd = -1;
    if (spawn_rank(&cs[r], argv)) {
      fprintf(stderr, "ftar-bench: %s\n", tr_error());
      for (int i = 0; i < r; i++) kill(cs[i].pid, SIGTERM);
      reap(cs, r);
      return 1;
    }
  }
  return 0;
}

/* The table (and ftar-bw lines): per size, the slowest rank's time. 1 if
 * a size has no time. */
static int sweep_report(const sweep_opts *so, const sweep_state *st) {
  int rc = 0;
  ftar_member_opts def; /* what a rank gets for the options not given */
  ftar_member_opts_default(&def);
  printf("ftar-bench: %d ranks on 127.0.0.1 | op %s | max frame %llu B | shm ring %llu B, %s stores | sockbuf %lld | "
         "deadline %.2f s | %s%s\n",
         so->ranks, so->op == FTAR_MEAN ? "mean" : "sum", (unsigned long long)(so->chunk ? so->chunk : def.chunk_bytes),
         (unsigned long long)(so->shm_ring ? so->shm_ring : (1u << 20)),
         so->shm_stores < 0 ? "auto" : so->shm_stores ? "stream" : "cached",
         (long long)(so->sockbuf >= 0 ? so->sockbuf : def.sockbuf), so->deadline,
         so->bind ? "ranks pinned one per core" : "ranks not pinned", so->verify ? " | verified" : "");
  printf("%12s %12s %7s %12s %12s %12s %9s\n", "size", "count", "iters", "time(us)", "algbw(GB/s)", "busbw(GB/s)",
         "streamed");
  for (int i = 0; i < so->nsizes; i++) {
    double worst = 0;
    for (int r = 0; r < so->ranks; r++)
      if (st->sec[i][r] > worst) worst = st->sec[i][r];
    char h[32];
    if (worst <= 0 || st->iters[i] <= 0) {
      printf("%12s %12llu %7s %12s %12s %12s\n", human(so->sizes[i], h, sizeof h),
             (unsigned long long)(so->sizes[i] / 4), "-", "failed", "-", "-");
      rc = 1;
      continue;
    }
    double t = worst / st->iters[i];
    double alg = (double)so->sizes[i] / t / 1e9, bus = alg * 2.0 * (so->ranks - 1) / so->ranks;
    double share = st->sent[i] > 0 ? st->streamed[i] / st->sent[i] : 0;
    printf("%12s %12llu %7d %12.1f %12.3f %12.3f %8.0f%%\n", human(so->sizes[i], h, sizeof h),
           (unsigned long long)(so->sizes[i] / 4), st->iters[i], t * 1e6, alg, bus, 100 * share);
    printf("ftar-bw ranks=%d bytes=%llu iters=%d us=%.3f algbw=%.4f busbw=%.4f streamed=%.3f\n", so->ranks,
           (unsigned long long)so->sizes[i], st->iters[i], t * 1e6, alg, bus, share);
  }
  fflush(stdout);
  return rc;
}

static int run_sweep(const sweep_opts *so) {
  ftar_coord_opts co;
  ftar_coord_opts_default(&co);
  co.deadline = so->deadline;
  ftar_coord *coord = ftar_coord_start("127.0.0.1", 0, &co);
  if (!coord) {
    fprintf(stderr, "ftar-bench: %s\n", tr_error());
    return 1;
  }
  char coordaddr[64], sizes[1024];
  snprintf(coordaddr, sizeof coordaddr, "127.0.0.1:%d", ftar_coord_port(coord));
  size_t off = 0;
  for (int i = 0; i < so->nsizes; i++)
    off += (size_t)snprintf(sizes + off, sizeof sizes - off, "%s%llu", i ? "," : "",
                            (unsigned long long)(so->sizes[i] / 4));
  static sweep_state st;
  memset(&st, 0, sizeof st);
  st.nranks = so->ranks;
  st.nsizes = so->nsizes;
  memcpy(st.sizes, so->sizes, sizeof st.sizes);
  child cs[MAX_RANKS];
  memset(cs, 0, sizeof cs);
  if (sweep_spawn(so, coordaddr, sizes, cs)) {
    ftar_coord_free(coord);
    return 1;
  }
  while (pump_children(cs, so->ranks, 200, sweep_line, &st) > 0) {
  }
  reap(cs, so->ranks);
  ftar_coord_free(coord);
  int rc = 0;
  for (int r = 0; r < so->ranks; r++)
    if (!WIFEXITED(cs[r].status) || WEXITSTATUS(cs[r].status) != 0) rc = 1;
  if (st.errors) rc = 1;
  if (sweep_report(so, &st)) rc = 1;
  return rc;
}

/* --- recovery --- */

typedef struct {
  int nranks, victim;
  int results[MAX_RANKS];
  double dur_sum;
  int dur_n;
  double t_sig;
  double done_at[MAX_RANKS]; /* t1 of the first collective ending after t_sig without the victim (one it
                                had already done its part of may end after the signal with it) */
  int redos[MAX_RANKS], contrib[MAX_RANKS], bad;
} rec_state;

static void rec_line(void *ud, child *c, const char *line) {
  rec_state *s = ud;
  int slot, rcv, contrib, redos, ok;
  unsigned long long seq, epoch;
  size_t count;
  double t0, t1;
  char slots[1024];
  if (sscanf(line,
             "ftar-result slot=%d seq=%llu count=%zu rc=%d epoch=%llu contrib=%d redos=%d slots=%1023s ok=%d t0=%lf "
             "t1=%lf",
             &slot, &seq, &count, &rcv, &epoch, &contrib, &redos, slots, &ok, &t0, &t1) == 11) {
    if (slot < 0 || slot >= MAX_RANKS) return;
    s->results[slot]++;
    s->dur_sum += t1 - t0;
    s->dur_n++;
    if (!ok) s->bad++;
    if (s->t_sig > 0 && slot != s->victim && t1 > s->t_sig && contrib < s->nranks && s->done_at[slot] == 0) {
      s->done_at[slot] = t1;
      s->redos[slot] = redos;
      s->contrib[slot] = contrib;
    }
  } else if (strncmp(line, "ftar-error", 10) == 0 && c->slot != s->victim) {
    fprintf(stderr, "rank %d: %s\n", c->slot, line);
    s->bad++;
  }
}

typedef struct {
  int ranks, use_stop, trials;
  uint64_t count, chunk, bucket; /* bucket > 0: ranks reduce in buckets while writing (rank --bucket) */
  double deadline;
  int64_t sockbuf;
} rec_opts;

/* Spawns the ranks of one trial; *spawned counts those started. 0, or 1
 * (printed). */
static int rec_spawn(const rec_opts *ro, const char *coordaddr, child *cs, int *spawned) {
  char bufs[16][64];
  for (int r = 0; r < ro->ranks; r++) {
    char *argv[40];
    int k = 0, b = 0;
    common_rank_args(argv, &k, bufs, &b, coordaddr, r);
    argv[k++] = "--counts";
    snprintf(bufs[b], 64, "%llu", (unsigned long long)ro->count);
    argv[k++] = bufs[b++];
    argv[k++] = "--wait";
    snprintf(bufs[b], 64, "%d", ro->ranks);
    argv[k++] = bufs[b++];
    argv[k++] = "--iters";
    argv[k++] = "1000000";
    argv[k++] = "--max-sec";
    argv[k++] = "60";
    argv[k++] = "--verify";
    if (ro->chunk) {
      argv[k++] = "--chunk";
      snprintf(bufs[b], 64, "%llu", (unsigned long long)ro->chunk);
      argv[k++] = bufs[b++];
    }
    if (ro->sockbuf >= 0) {
      argv[k++] = "--sockbuf";
      snprintf(bufs[b], 64, "%lld", (long long)ro->sockbuf);
      argv[k++] = bufs[b++];
    }
    if (ro->bucket) {
      argv[k++] = "--bucket";
      snprintf(bufs[b], 64, "%llu", (unsigned long long)ro->bucket);
      argv[k++] = bufs[b++];
    }
    argv[k] = NULL;
    cs[r].slot = r;
    if (spawn_rank(&cs[r], argv)) {
      fprintf(stderr, "ftar-bench: %s\n", tr_error());
      return 1;
    }
    (*spawned)++;
  }
  return 0;
}

/* Waits (up to 30 s) until every rank has done two collectives. */
static void rec_wait_ready(const rec_opts *ro, child *cs, int spawned, rec_state *st) {
  double t_lim = tr_now() + 30;
  while (tr_now() < t_lim) {
    pump_children(cs, spawned, 100, rec_line, st);
    int ready = 1;
    for (int r = 0; r < ro->ranks; r++) ready &= st->results[r] >= 2;
    if (ready) break;
  }
}

/* Signals the victim at a random point of a collective and waits for the
 * survivors' redo; prints the trial's line. 0 with *ms (the slowest
 * survivor, from the signal), or 1. */
static int rec_strike(const rec_opts *ro, int trial, child *cs, int spawned, rec_state *st, double *ms) {
  const char *sig = ro->use_stop ? "stop" : "kill";
  double avg = st->dur_sum / st->dur_n;
  usleep((useconds_t)(avg * (0.2 + 0.6 * rand() / (double)RAND_MAX) * 1e6));
  st->t_sig = tr_now();
  kill(cs[st->victim].pid, ro->use_stop ? SIGSTOP : SIGKILL);
  double t_lim = st->t_sig + ro->deadline + 10;
  for (;;) {
    pump_children(cs, spawned, 50, rec_line, st);
    int all = 1;
    for (int r = 0; r < ro->ranks; r++)
      if (r != st->victim) all &= st->done_at[r] > 0;
    if (all || tr_now() > t_lim) break;
  }
  double worst = 0;
  int got = 1;
  for (int r = 0; r < ro->ranks; r++)
    if (r != st->victim) {
      if (st->done_at[r] == 0) got = 0;
      else if (st->done_at[r] - st->t_sig > worst) worst = st->done_at[r] - st->t_sig;
    }
  if (!got || st->bad) {
    printf("ftar-recovery trial=%d signal=%s failed (%s)\n", trial + 1, sig, got ? "wrong results" : "no redo in time");
    return 1;
  }
  *ms = worst * 1e3;
  printf("ftar-recovery trial=%d signal=%s ranks=%d bytes=%llu deadline=%.2f ms=%.1f redos=%d contrib=%d\n",
         trial + 1, sig, ro->ranks, (unsigned long long)ro->count * 4, ro->deadline, worst * 1e3, st->redos[0],
         st->contrib[0]);
  return 0;
}

/* One trial: a coordinator, the ranks, the signal, the redo. 0 with *ms,
 * or 1 (printed). */
static int rec_trial(const rec_opts *ro, int trial, double *ms) {
  ftar_coord_opts co;
  ftar_coord_opts_default(&co);
  co.deadline = ro->deadline;
  ftar_coord *coord = ftar_coord_start("127.0.0.1", 0, &co);
  if (!coord) {
    fprintf(stderr, "ftar-bench: %s\n", tr_error());
    return 1;
  }
  char coordaddr[64];
  snprintf(coordaddr, sizeof coordaddr, "127.0.0.1:%d", ftar_coord_port(coord));
  child cs[MAX_RANKS];
  memset(cs, 0, sizeof cs);
  rec_state st;
  memset(&st, 0, sizeof st);
  st.nranks = ro->ranks;
  st.victim = ro->ranks - 1;
  int spawned = 0;
  int rc = rec_spawn(ro, coordaddr, cs, &spawned);
  if (rc == 0) rec_wait_ready(ro, cs, spawned, &st);
  if (rc == 0 && st.dur_n > 0) {
    rc = rec_strike(ro, trial, cs, spawned, &st, ms);
  } else if (rc == 0) {
    printf("ftar-recovery trial=%d failed (ranks did not start)\n", trial + 1);
    rc = 1;
  }
  for (int r = 0; r < spawned; r++) kill(cs[r].pid, SIGKILL);
  reap(cs, spawned);
  ftar_coord_free(coord);
  fflush(stdout);
  return rc;
}

static int run_recovery(const rec_opts *ro) {
  double ms[16];
  int trials = ro->trials > 16 ? 16 : ro->trials;
  srand((unsigned)time(NULL));
  for (int trial = 0; trial < trials; trial++) {
    int rc = rec_trial(ro, trial, &ms[trial]);
    if (rc) return rc;
  }
  /* median */
  for (int i = 1; i < trials; i++)
    for (int j = i; j > 0 && ms[j] < ms[j - 1]; j--) {
      double t = ms[j];
      ms[j] = ms[j - 1];
      ms[j - 1] = t;
    }
  char h[32];
  printf("recovery (%s, %d ranks, %s all-reduce%s, deadline %.2f s): survivors completed the redo %.1f ms after the "
         "signal (median of %d; min %.1f, max %.1f)\n",
         ro->use_stop ? "SIGSTOP" : "kill -9", ro->ranks, human(ro->count * 4, h, sizeof h),
         ro->bucket ? " in buckets" : "", ro->deadline,
         ms[trials / 2], trials, ms[0], ms[trials - 1]);
  return 0;
}

/* --- coordinator alone --- */

static int run_coord(const char *host, int port, double deadline, double heartbeat) {
  ftar_coord_opts co;
  ftar_coord_opts_default(&co);
  co.deadline = deadline;
  co.heartbeat = heartbeat;
  ftar_coord *c = ftar_coord_start(host, port, &co);
  if (!c) {
    fprintf(stderr, "ftar-bench coord: %s\n", tr_error());
    return 1;
  }
  printf("ftar-coord port=%d pid=%d\n", ftar_coord_port(c), (int)getpid());
  fflush(stdout);
  while (!stop_flag) {
    struct pollfd p = {.fd = 0, .events = POLLIN};
    int r = poll(&p, 1, 200);
    if (r > 0) {
      char b[256];
      if (read(0, b, sizeof b) <= 0) break;
    }
  }
  ftar_coord_free(c);
  return 0;
}

/* --- dispatch --- */

static const char usage[] =
    "usage: transom ftar-bench [--ranks N] [--sizes LIST] [--iters N|auto] [--warmup N] [--op sum|mean]\n"
    "                          [--verify] [--deadline SEC] [--chunk BYTES] [--sockbuf BYTES] [--spin US]\n"
    "                          [--shm-ring BYTES] [--shm-stores auto|stream|cached] [--bind | --no-bind]\n"
    "                          [--tcp] [--hier | --flat]\n"
    "       transom ftar-bench recovery [--ranks N] [--count FLOATS] [--signal kill|stop] [--trials N] [--bucket FLOATS]\n"
    "                          [--deadline SEC] [--chunk BYTES] [--sockbuf BYTES]\n"
    "       transom ftar-bench coord [--host H] [--port P] [--deadline SEC] [--heartbeat SEC]\n"
    "       transom ftar-bench rank --coord HOST:PORT --slot S [--counts LIST | --sizes LIST] [--iters N|auto]\n"
    "                          [--warmup N] [--op sum|mean] [--verify] [--pattern seq|static] [--wait N]\n"
    "                          [--min-members N] [--timeout SEC] [--deadline SEC] [--chunk BYTES]\n"
    "                          [--sockbuf BYTES] [--seq0 N] [--loop] [--until-contrib C | --until-slot S]\n"
    "                          [--tail T] [--until-seq Q] [--control-stdin] [--tcp] [--bind] [--spin US]\n"
    "                          [--max-sec SEC] [--quiet] [--bucket FLOATS [--produce-us US]]\n"
    "                          [--shm-ring BYTES] [--shm-stores auto|stream|cached]\n"
    "                          [--data-host ADDR | --host ADDR] [--hier | --flat]\n"
    "\n"
    "FTAR, the fault-tolerant ring all-reduce, on 127.0.0.1: a coordinator and N rank processes.\n"
    "The default mode prints time, algbw and busbw = algbw*2(n-1)/n per size (sizes in bytes with\n"
    "K/M/G suffixes; default 4K,64K,1M,16M,256M; --iters auto = 512 MiB of payload per size, 5..1000).\n"
    "Like mpirun, it pins ranks one per core when they fit (--bind / --no-bind to force).\n"
    "Same-host ranks exchange frames through shared-memory rings; --tcp forces TCP links. --shm-ring\n"
    "sizes each ring (default 1 MiB), --shm-stores how a sender stores into it: non-temporal (stream),\n"
    "plain (cached) or the faster of the two as timed while it runs (auto, the default); the sweep's\n"
    "\"streamed\" column is the share of bytes sent that went non-temporally.\n"
    "recovery kills (or stops) the last rank in the middle of an all-reduce and prints the time until\n"
    "the survivors finished the redo. coord and rank are the building blocks (tests use them); ranks\n"
    "print machine-readable ftar-ready/ftar-result/ftar-time/ftar-error/ftar-done lines; --bucket makes\n"
    "a rank reduce in buckets while it still writes its input (ftar_allreduce_start), as training does.\n"
    "Ranks that advertise the same --data-host form a host: by default (auto) an epoch spanning >= 2\n"
    "hosts with >= 2 ranks on one reduces hierarchically (local ring, one ring across the hosts'\n"
    "leaders, broadcast back); --flat forces the flat ring, --hier the hierarchy whenever a host has\n"
    ">= 2 ranks. A rank also prints ftar-hier slot=S hier_collectives=N grid_collectives=G waves=W\n"
    "bytes_sent=B cross_bytes=X (with --bucket a wave per >= 1 MiB of whole buckets: its cross-host part\n"
    "overlaps with the writing of the next). An even number >= 4 of ranks, each on a host of its own, reduces as a grid (pairs,\n"
    "then columns) in auto mode; --flat forces the flat ring there too. The sweep's --tcp gives each\n"
    "rank a host of its own (--data-host 127.0.0.R+1): TCP as between hosts. Every rank must get the\n"
    "same --hier / --flat.\n";

/* Everything the command line sets, for every mode. */
typedef struct {
  rank_opts ro;
  sweep_opts so;
  const char *host;
  int port, ranks, use_stop, trials;
  double deadline, heartbeat;
  uint64_t count;
} bench_args;

static void args_default(bench_args *a) {
  *a = (bench_args){
      .ro = {.slot = -1, .until_slot = -1, .spin_us = -1, .wait = 1, .min_members = 1, .iters = 1, .timeout = 60,
             .sockbuf = -1, .seq0 = 1, .tail = 1, .hier = -1, .shm_stores = -1},
      .so = {.ranks = 2, .warmup = 2, .iters = 0, .deadline = 3, .sockbuf = -1, .spin_us = -1, .shm_stores = -1,
             .bind = -1, .hier = -1},
      .host = "127.0.0.1",
      .ranks = -1,
      .trials = 3,
      .deadline = -1,
      .count = 4 << 20,
  };
  uint64_t dsizes[] = {4 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20};
  memcpy(a->so.sizes, dsizes, sizeof dsizes);
  a->so.nsizes = 5;
}

/* An option without a value: 1 if name is one (and sets it). */
static int parse_flag(bench_args *a, const char *name) {
  rank_opts *ro = &a->ro;
  sweep_opts *so = &a->so;
  if (strcmp(name, "--verify") == 0) ro->verify = so->verify = 1;
  else if (strcmp(name, "--quiet") == 0) ro->quiet = 1;
  else if (strcmp(name, "--loop") == 0) ro->loop = 1;
  else if (strcmp(name, "--control-stdin") == 0) ro->control_stdin = 1;
  else if (strcmp(name, "--bind") == 0) ro->bind = so->bind = 1;
  else if (strcmp(name, "--no-bind") == 0) ro->bind = so->bind = 0;
  else if (strcmp(name, "--tcp") == 0) ro->no_shm = so->no_shm = 1;
  else if (strcmp(name, "--hier") == 0) ro->hier = so->hier = 1;
  else if (strcmp(name, "--flat") == 0) ro->hier = so->hier = 0;
  else return 0;
  return 1;
}

/* parse_value's second half: the options of rank, coord and recovery. */
static int parse_value_rank(bench_args *a, const char *n, const char *v, int *bad) {
  rank_opts *ro = &a->ro;
  uint64_t u;
  if (strcmp(n, "--slot") == 0) *bad = parse_u64(v, &u) || u >= (1u << 30) || ((ro->slot = (int)u), 0);
  else if (strcmp(n, "--wait") == 0) *bad = parse_u64(v, &u) || u > FTAR_MAX_MEMBERS || ((ro->wait = (int)u), 0);
  else if (strcmp(n, "--min-members") == 0)
    *bad = parse_u64(v, &u) || u > FTAR_MAX_MEMBERS || ((ro->min_members = (int)u), 0);
  else if (strcmp(n, "--seq0") == 0) *bad = parse_u64(v, &ro->seq0);
  else if (strcmp(n, "--bucket") == 0) *bad = parse_u64(v, &ro->bucket);
  else if (strcmp(n, "--produce-us") == 0) *bad = parse_u64(v, &ro->produce_us) || ro->produce_us > 10000000;
  else if (strcmp(n, "--until-contrib") == 0)
    *bad = parse_u64(v, &u) || u > FTAR_MAX_MEMBERS || ((ro->until_contrib = (int)u), 0);
  else if (strcmp(n, "--until-slot") == 0)
    *bad = parse_u64(v, &u) || u >= (1u << 30) || ((ro->until_slot = (int)u), 0);
  else if (strcmp(n, "--until-seq") == 0) *bad = parse_u64(v, &ro->until_seq);
  else if (strcmp(n, "--tail") == 0) *bad = parse_u64(v, &u) || u < 1 || u > 1000000 || ((ro->tail = (int)u), 0);
  else if (strcmp(n, "--host") == 0) a->host = v;
  else if (strcmp(n, "--data-host") == 0) *bad = strlen(v) > FTAR_HOST_MAX || ((a->ro.data_host = v), 0);
  else if (strcmp(n, "--port") == 0) *bad = parse_u64(v, &u) || u > 65535 || ((a->port = (int)u), 0);
  else if (strcmp(n, "--count") == 0) *bad = parse_u64(v, &a->count) || a->count == 0;
  else if (strcmp(n, "--signal") == 0) {
    if (strcmp(v, "kill") == 0) a->use_stop = 0;
    else if (strcmp(v, "stop") == 0) a->use_stop = 1;
    else *bad = 1;
  } else if (strcmp(n, "--trials") == 0) *bad = parse_u64(v, &u) || u < 1 || u > 16 || ((a->trials = (int)u), 0);
  else return 0;
  return 1;
}

/* An option with value v: 0 if name is none, else 1 with *bad set when v
 * is out of range. */
static int parse_value(bench_args *a, const char *name, const char *v, int *bad) {
  rank_opts *ro = &a->ro;
  sweep_opts *so = &a->so;
  const char *n = name;
  uint64_t u;
  if (strcmp(n, "--ranks") == 0) *bad = parse_u64(v, &u) || u < 1 || u > MAX_RANKS || !(a->ranks = (int)u);
  else if (strcmp(n, "--sizes") == 0) {
    int k = parse_list(v, so->sizes, MAX_SIZES);
    *bad = k <= 0;
    for (int i = 0; i < k && !*bad; i++) *bad = so->sizes[i] == 0 || so->sizes[i] % 4 != 0;
    if (!*bad) {
      so->nsizes = k;
      ro->ncounts = k;
      for (int i = 0; i < k; i++) ro->counts[i] = so->sizes[i] / 4;
    }
  } else if (strcmp(n, "--counts") == 0) {
    int k = parse_list(v, ro->counts, MAX_SIZES);
    *bad = k <= 0;
    ro->ncounts = k;
  } else if (strcmp(n, "--iters") == 0) {
    if (strcmp(v, "auto") == 0) ro->iters = so->iters = 0;
    else *bad = parse_u64(v, &u) || u < 1 || u > 100000000 || !(ro->iters = so->iters = (int)u);
  } else if (strcmp(n, "--warmup") == 0) {
    *bad = parse_u64(v, &u) || u > 1000000;
    ro->warmup = so->warmup = (int)u;
  } else if (strcmp(n, "--op") == 0) {
    if (strcmp(v, "sum") == 0) ro->op = so->op = FTAR_SUM;
    else if (strcmp(v, "mean") == 0) ro->op = so->op = FTAR_MEAN;
    else *bad = 1;
  } else if (strcmp(n, "--pattern") == 0) {
    if (strcmp(v, "seq") == 0) ro->static_pattern = 0;
    else if (strcmp(v, "static") == 0) ro->static_pattern = 1;
    else *bad = 1;
  } else if (strcmp(n, "--deadline") == 0) *bad = parse_double(v, &a->deadline);
  else if (strcmp(n, "--heartbeat") == 0) *bad = parse_double(v, &a->heartbeat);
  else if (strcmp(n, "--timeout") == 0) *bad = parse_double(v, &ro->timeout) || ro->timeout <= 0;
  else if (strcmp(n, "--max-sec") == 0) *bad = parse_double(v, &ro->max_sec);
  else if (strcmp(n, "--chunk") == 0) *bad = parse_u64(v, &u) || u < 64 || !(ro->chunk = so->chunk = u);
  else if (strcmp(n, "--shm-stores") == 0) { /* opts.shm_stream */
    if (strcmp(v, "auto") == 0) ro->shm_stores = so->shm_stores = -1;
    else if (strcmp(v, "stream") == 0) ro->shm_stores = so->shm_stores = 1;
    else if (strcmp(v, "cached") == 0) ro->shm_stores = so->shm_stores = 0;
    else *bad = 1;
  } else if (strcmp(n, "--shm-ring") == 0) /* ftar_member_opts.shm_ring_bytes: rounded up to a power of two */
    *bad = parse_u64(v, &u) || u < (1u << 20) || u > (64u << 20) || !(ro->shm_ring = so->shm_ring = u);
  else if (strcmp(n, "--sockbuf") == 0) {
    *bad = parse_u64(v, &u) || u > (1u << 30);
    ro->sockbuf = so->sockbuf = (int64_t)u;
  } else if (strcmp(n, "--coord") == 0) ro->coord = v;
  else if (strcmp(n, "--spin") == 0) {
    long sv = strtol(v, NULL, 10);
    *bad = sv < -1 || sv > 1000000;
    ro->spin_us = so->spin_us = (int)sv;
  } else return parse_value_rank(a, n, v, bad);
  return 1;
}

/* Runs the mode with the options parsed. */
static int run_mode(const char *mode, bench_args *a) {
  if (strcmp(mode, "rank") == 0) {
    if (!a->ro.coord || a->ro.slot < 0 || a->ro.ncounts == 0) {
      fprintf(stderr, "transom ftar-bench rank: --coord, --slot and --counts (or --sizes) are required\n");
      return 2;
    }
    a->ro.deadline = a->deadline > 0 ? a->deadline : 0;
    if (!a->ro.data_host) a->ro.data_host = a->host; /* --host: the same, for a rank */
    return rank_run(&a->ro);
  }
  if (strcmp(mode, "coord") == 0) return run_coord(a->host, a->port, a->deadline > 0 ? a->deadline : 3, a->heartbeat);
  if (strcmp(mode, "recovery") == 0) {
    rec_opts ro = {.ranks = a->ranks > 0 ? a->ranks : 3,
                   .use_stop = a->use_stop,
                   .trials = a->trials,
                   .count = a->count,
                   .chunk = a->so.chunk,
                   .bucket = a->ro.bucket,
                   .deadline = a->deadline > 0 ? a->deadline : 1,
                   .sockbuf = a->so.sockbuf};
    return run_recovery(&ro);
  }
  if (strcmp(mode, "sweep") == 0) {
    sweep_opts *so = &a->so;
    so->ranks = a->ranks > 0 ? a->ranks : 2;
    if (a->deadline > 0) so->deadline = a->deadline;
    if (so->bind < 0) so->bind = so->ranks <= sysconf(_SC_NPROCESSORS_ONLN); /* mpirun's default policy */
    return run_sweep(so);
  }
  fprintf(stderr, "transom ftar-bench: unknown mode '%s' (see --help)\n", mode);
  return 2;
}

int ftar_bench_main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  signal(SIGTERM, on_term);
  setvbuf(stdout, NULL, _IOLBF, 0);
  const char *mode = "sweep";
  int i = 0;
  if (argc > 0 && argv[0][0] != '-') {
    mode = argv[0];
    i = 1;
  }
  bench_args a;
  args_default(&a);
  for (; i < argc; i++) {
    const char *name = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(name, "--help") == 0 || strcmp(name, "-h") == 0) {
      fputs(usage, stdout);
      return 0;
    }
    if (parse_flag(&a, name)) continue;
    int bad = 0;
    bench_args probe = a; /* a last option has no value: is it one at all? */
    if (!parse_value(v ? &a : &probe, name, v ? v : "", &bad)) {
      fprintf(stderr, "transom ftar-bench: unknown option '%s' (see --help)\n", name);
      return 2;
    }
    if (bad || !v) {
      fprintf(stderr, "transom ftar-bench: bad or missing value for %s\n", name);
      return 2;
    }
    i++; /* the value */
  }
  return run_mode(mode, &a);
}
