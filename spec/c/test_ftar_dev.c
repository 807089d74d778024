/* test_ftar_dev.c — FTAR's device data plane: communicator ids through the
 * coordinator, the emu shared-memory communicator, and ftar_allreduce_dev
 * across processes, with kill -9 and SIGSTOP.
 *
 * Scenarios:
 *   commid    3 in-process members: every member of an epoch holds the
 *             same id (the one its rank 0 made), a new epoch (a member
 *             left) gets a different one; an offer from a member that is
 *             not the epoch's rank 0 is ignored
 *   emu       the emu communicator between forked processes: exact sums
 *             at 2 and 3 ranks, 1 float .. 4 MiB, sizes around the 1 MiB
 *             slot; every rank gets identical bits; scale
 *   emu-kill  kill -9 (and SIGSTOP) of one of 3 ranks mid all-reduce: the
 *             others fail with TR_EIO within deadline + 1 s, naming the
 *             rank that did not arrive; a fresh communicator (new id)
 *             among the survivors works; a stopped rank, continued, fails
 *             at once
 *   attach    creation that cannot complete (a rank never comes, a foreign
 *             id, a bad rank) fails in bounded time, leaving nothing
 *   dev       ftar_allreduce_dev, 3 forked members, exact sums and means:
 *             on emu (the communicator plane), on emu without collectives
 *             (host buffer + TCP ring) and on cpu (plain ftar_allreduce)
 *   dev-kill  the communicator plane with kill -9 of (1) the epoch's rank 0
 *             while the others wait for it inside a collective, and (2) a
 *             member at any moment of a long series: survivors complete
 *             every seq with identical results, the first one without the
 *             victim RESHAPED with contributors 2, in a new epoch whose
 *             communicator the new rank 0 made; (1) is redone after the
 *             communicator's deadline
 *   dev-samedev  2 members on one emulated device (TRANSOM_EMU_DEVICES=2,
 *             both TRANSOM_LOCAL_RANK=0), as two replicas on one GPU: the
 *             communicator cannot be made (NCCL: "duplicate GPU"), and the
 *             first collective fails on both with TR_EINVAL saying so,
 *             instead of an abort retried epoch after epoch until timeout
 *   dev-restore  as dev-kill (1), but the survivors' device copy that would
 *             put their input back for the redo fails: each fails that
 *             collective (TR_EIO, naming the restore) instead of redoing it
 *             from a buffer that may be half reduced, and its member stays
 *             failed (the next call fails at once)
 *   dev-bucket  ftar_allreduce_dev_start on emu at 2 and 3 members: each
 *             member writes its buffer from the end in pieces that straddle
 *             buckets, marking each ready (ftar_allreduce_ready) with a
 *             pause between pieces, then waits: exact sums and means with
 *             every member as contributor, identical bits everywhere,
 *             comm_s reported
 *   dev-bucket kill -9  (1) slot 0 stops halfway through writing seq 10,
 *             once its bucket 0 holds the sum (buckets in flight), and is
 *             killed there: the survivors abort on the communicator's
 *             deadline, put back the buckets they had reduced and redo seq
 *             10 in a new epoch: exact sums of exactly slots 1 and 2 (a
 *             restore that missed a float would leave slot 0's value in
 *             it), RESHAPED; (2) slot 1 killed at any moment of 60
 *             bucketed collectives: the same; (3) slot 2 stalls as slot 0
 *             did in (1) and slot 0 is killed: slot 2's attempt ends on
 *             the epoch's abort while it waits for its producer (its
 *             abort names that), not on a bucket queued later into the
 *             dead epoch's communicator; the survivors redo seq 10
 *   dev-busy  one member: ftar_allreduce_dev while a collective started
 *             with ftar_allreduce_dev_start was not waited for is refused
 *             (TR_ESTATE) instead of running a second control round on the
 *             member beside the communication thread's
 *   dev-lost  a member's device is lost in the middle of a collective (emu:
 *             an illegal address, sticky like a corrupted CUDA context):
 *             its call fails at once with TR_EDEVICE, not redone (a redo
 *             could only fail again, epoch after epoch, until the timeout);
 *             it leaves, and the survivors redo that collective without it;
 *             the same with buckets (the device lost in a bucket's
 *             overlapped all-reduce)
 * Every scenario checks that /dev/shm holds no segment named after one of
 * its processes afterwards. TRANSOM_TIME_SCALE (check.h) stretches this
 * file's own waits and the slack its latency bounds allow over the
 * deadline; TRANSOM_TEST_SMALL makes dev's largest collective two emu
 * chunks instead of four. Data goes over 127.0.0.1 only; every wait is
 * bounded. Children are forked while this process has no other thread and
 * leave with _exit.
 */
#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend.h"
#include "check.h"
#include "comm_emu.h"
#include "ftar.h"
#include "ftar_internal.h"
#include "ftar_wire.h"
#include "util.h"

#define DEADLINE 1.5
#define MAXK 4
#define SLOT_FLOATS 262144 /* comm_emu.c's chunk */

static int verbose;
static double tscale = 1; /* TRANSOM_TIME_SCALE */

/* seconds of this file's own waiting, stretched for a slow build */
static double T(double seconds) { return seconds * tscale; }

/* --- captured coordinator log --- */

static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static char coord_log[1 << 16];
static size_t coord_log_len;

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

static int coord_log_has(const char *needle) {
  pthread_mutex_lock(&log_mu);
  int r = strstr(coord_log, needle) != NULL;
  pthread_mutex_unlock(&log_mu);
  return r;
}

static ftar_coord *coord_start(void) {
  pthread_mutex_lock(&log_mu);
  coord_log_len = 0;
  coord_log[0] = 0;
  pthread_mutex_unlock(&log_mu);
  ftar_coord_opts o;
  ftar_coord_opts_default(&o);
  o.deadline = DEADLINE;
  o.log = coord_log_fn;
  ftar_coord *c = ftar_coord_start("127.0.0.1", 0, &o);
  CHECK(c != NULL, "coordinator: %s", tr_error());
  return c;
}

static void quiet_log(void *ud, const char *msg) {
  (void)ud;
  if (verbose) fprintf(stderr, "  member: %s\n", msg);
}

/* --- /dev/shm --- */

/* Counts (and prints) /dev/shm entries named after one of pids' comm ids. */
static int shm_leftovers(const pid_t *pids, int n) {
  DIR *d = opendir("/dev/shm");
  if (!d) return 0;
  int found = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    for (int i = 0; i < n; i++) {
      char pre[64];
      snprintf(pre, sizeof pre, "transom-comm-%ld-", (long)pids[i]);
      if (strncmp(e->d_name, pre, strlen(pre)) == 0) {
        fprintf(stderr, "  left in /dev/shm: %s\n", e->d_name);
        found++;
      }
    }
  }
  closedir(d);
  return found;
}

/* --- forked children that report lines through a pipe --- */

typedef struct {
  pid_t pid;
  int fd; /* read end, -1 once closed */
  char buf[8192];
  size_t len;
  char **lines;
  double *t; /* when each line arrived */
  int nlines, cap;
  int status, reaped;
} kid;

/* Runs fn(arg, rank, out_fd) in a child; its return value is the exit code. */
static int kid_start(kid *k, int (*fn)(void *, int, int), void *arg, int rank) {
  memset(k, 0, sizeof *k);
  int p[2];
  if (pipe(p)) return -1;
  fflush(NULL);
  k->pid = fork();
  if (k->pid < 0) {
    close(p[0]);
    close(p[1]);
    CHECK(0, "fork: %s", strerror(errno));
    return -1;
  }
  if (k->pid == 0) {
    close(p[0]);
    int rc = fn(arg, rank, p[1]);
    close(p[1]);
    _exit(rc);
  }
  close(p[1]);
  k->fd = p[0];
  return 0;
}

__attribute__((format(printf, 2, 3))) static void say(int fd, const char *fmt, ...) {
  char b[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(b, sizeof b - 1, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n > sizeof b - 2) n = (int)sizeof b - 2;
  b[n++] = '\n';
  ssize_t w = write(fd, b, (size_t)n); /* < PIPE_BUF: atomic */
  (void)w;
}

static void kid_line(kid *k, const char *s) {
  if (k->nlines == k->cap) {
    k->cap = k->cap ? 2 * k->cap : 64;
    k->lines = realloc(k->lines, (size_t)k->cap * sizeof *k->lines);
    k->t = realloc(k->t, (size_t)k->cap * sizeof *k->t);
  }
  k->t[k->nlines] = tr_now();
  k->lines[k->nlines++] = strdup(s);
  if (verbose) fprintf(stderr, "  [%ld] %s\n", (long)k->pid, s);
}

/* Reads what the children wrote, for up to ms milliseconds. */
static void kids_pump(kid *ks, int n, int ms) {
  struct pollfd pf[MAXK];
  int who[MAXK], np = 0;
  for (int i = 0; i < n; i++)
    if (ks[i].fd >= 0) {
      pf[np] = (struct pollfd){.fd = ks[i].fd, .events = POLLIN};
      who[np++] = i;
    }
  if (!np) {
    usleep((useconds_t)ms * 1000);
    return;
  }
  if (poll(pf, (nfds_t)np, ms) <= 0) return;
  for (int j = 0; j < np; j++) {
    if (!pf[j].revents) continue;
    kid *k = &ks[who[j]];
    ssize_t r = read(k->fd, k->buf + k->len, sizeof k->buf - 1 - k->len);
    if (r <= 0) {
      close(k->fd);
      k->fd = -1;
      continue;
    }
    k->len += (size_t)r;
    k->buf[k->len] = 0;
    char *s = k->buf, *nl;
    while ((nl = strchr(s, '\n'))) {
      *nl = 0;
      kid_line(k, s);
      s = nl + 1;
    }
    k->len = strlen(s);
    memmove(k->buf, s, k->len + 1);
  }
}

/* Index of the first line of k starting with prefix at or after from, or -1. */
static int kid_find(const kid *k, const char *prefix, int from) {
  for (int i = from; i < k->nlines; i++)
    if (strncmp(k->lines[i], prefix, strlen(prefix)) == 0) return i;
  return -1;
}

static int kid_count(const kid *k, const char *prefix) {
  int c = 0;
  for (int i = 0; i < k->nlines; i++) c += strncmp(k->lines[i], prefix, strlen(prefix)) == 0;
  return c;
}

/* Waits for every child to exit (reading its output); SIGKILLs the ones
 * still running after `seconds` (a failure unless allowed). */
static void kids_finish(kid *ks, int n, double seconds) {
  double end = tr_now() + seconds;
  for (;;) {
    int open = 0;
    for (int i = 0; i < n; i++) open += ks[i].fd >= 0;
    if (!open || tr_now() > end) break;
    kids_pump(ks, n, 50);
  }
  for (int i = 0; i < n; i++) {
    if (ks[i].reaped) continue;
    for (;;) {
      pid_t w = waitpid(ks[i].pid, &ks[i].status, WNOHANG);
      if (w == ks[i].pid) break;
      if (tr_now() > end) {
        CHECK(0, "child %d did not exit within %.0f s; killing it", i, seconds);
        kill(ks[i].pid, SIGKILL);
        kill(ks[i].pid, SIGCONT);
        waitpid(ks[i].pid, &ks[i].status, 0);
        break;
      }
      usleep(10000);
    }
    ks[i].reaped = 1;
    if (ks[i].fd >= 0) close(ks[i].fd);
    ks[i].fd = -1;
  }
}

static void kids_free(kid *ks, int n) {
  for (int i = 0; i < n; i++) {
    for (int j = 0; j < ks[i].nlines; j++) free(ks[i].lines[j]);
    free(ks[i].lines);
    free(ks[i].t);
    ks[i].lines = NULL;
    ks[i].t = NULL;
    ks[i].nlines = 0;
  }
}

static int exited_ok(const kid *k) { return WIFEXITED(k->status) && WEXITSTATUS(k->status) == 0; }

/* --- inputs: small integers, so every sum is exact in float --- */

static float val(int who, uint64_t seq, size_t i) {
  return (float)((long)((i * 131 + (size_t)who * 977 + seq * 7919) % 2001) - 1000);
}

/* --- commid: ids through the coordinator, in-process members --- */

typedef struct {
  ftar_member *m;
  const tr_backend *be;
  int slot, rc;
  uint64_t seq;
  ftar_result res;
} dev_thr;

static void *thr_dev_once(void *p) {
  dev_thr *a = p;
  size_t n = 1000;
  float host[1000];
  for (size_t i = 0; i < n; i++) host[i] = (float)(a->slot + 1);
  float *d = a->be->alloc(n * sizeof(float));
  a->be->upload(d, host, n * sizeof(float));
  a->rc = ftar_allreduce_dev(a->m, a->be, d, n, FTAR_SUM, a->seq, &a->res);
  a->be->download(host, d, n * sizeof(float));
  a->be->free(d);
  float want = 0;
  for (int i = 0; i < a->res.contributors; i++) want += (float)(a->res.slots[i] + 1);
  if (a->rc >= 0 && (host[0] != want || host[n - 1] != want)) a->rc = -100;
  return NULL;
}

/* Runs one collective on members ms[0..k) on k threads. */
static int run_threads(ftar_member **ms, const int *slots, int k, const tr_backend *be, uint64_t seq) {
  dev_thr a[MAXK];
  pthread_t th[MAXK];
  for (int i = 0; i < k; i++) {
    a[i] = (dev_thr){.m = ms[i], .be = be, .slot = slots[i], .seq = seq};
    pthread_create(&th[i], NULL, thr_dev_once, &a[i]);
  }
  int bad = 0;
  for (int i = 0; i < k; i++) {
    pthread_join(th[i], NULL);
    if (a[i].rc < 0 || a[i].res.contributors != k) {
      fprintf(stderr, "  slot %d: rc %d contributors %d\n", slots[i], a[i].rc, a[i].res.contributors);
      bad++;
    }
  }
  return bad;
}

static void test_commid(void) {
  double t0 = tr_now();
  ftar_coord *c = coord_start();
  if (!c) return;
  const tr_backend *be = backend_get("emu", 1);
  CHECK(be != NULL, "emu backend: %s", tr_error());
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = 15;
  mo.log = quiet_log;
  int slots[3] = {10, 20, 30};
  ftar_member *ms[3] = {0};
  for (int i = 0; i < 3; i++) {
    ms[i] = ftar_member_create("127.0.0.1", ftar_coord_port(c), slots[i], &mo);
    CHECK(ms[i] != NULL, "member %d: %s", slots[i], tr_error());
  }
  if (!be || !ms[0] || !ms[1] || !ms[2]) goto done;
  CHECK(ftar_member_wait(ms[0], 3, 10) == 0, "3 members: %s", tr_error());
  CHECK(run_threads(ms, slots, 3, be, 1) == 0, "a collective of 3 on the communicator plane");
  uint64_t e1 = ftar_member_epoch(ms[0], NULL);
  uint8_t id[3][FTAR_COMMID_LEN];
  for (int i = 0; i < 3; i++)
    CHECK(ftar_member_comm_id_wait(ms[i], e1, id[i], tr_now() + 2) == 0, "slot %d holds epoch %llu's id: %s",
          slots[i], (unsigned long long)e1, tr_error());
  CHECK(memcmp(id[0], id[1], FTAR_COMMID_LEN) == 0 && memcmp(id[0], id[2], FTAR_COMMID_LEN) == 0,
        "every member of epoch %llu got the same id", (unsigned long long)e1);
  CHECK(strncmp((const char *)id[0] + 4, "/transom-comm-", 14) == 0, "it is an emu id: %.40s",
        (const char *)id[0] + 4);
  /* a member that is not rank 0 cannot replace the id */
  uint8_t fake[FTAR_COMMID_LEN];
  memset(fake, 0x5a, sizeof fake);
  ftar_member_comm_id_offer(ms[1], e1, fake);
  double end = tr_now() + 3;
  while (!coord_log_has("is not its rank 0") && tr_now() < end) usleep(10000);
  CHECK(coord_log_has("is not its rank 0"), "an offer from a member that is not rank 0 is logged and ignored");
  uint8_t again[FTAR_COMMID_LEN];
  CHECK(ftar_member_comm_id_wait(ms[2], e1, again, tr_now() + 1) == 0 &&
            memcmp(again, id[0], FTAR_COMMID_LEN) == 0,
        "the id of epoch %llu still stands", (unsigned long long)e1);
  /* the membership changes: slot 10 (rank 0) leaves; 20 and 30 get a new id from the new rank 0 (slot 20) */
  ftar_member_free(ms[0]);
  ms[0] = NULL;
  CHECK(ftar_member_wait(ms[1], 2, 5) == 0, "2 members");
  end = tr_now() + 5;
  int n_now = 0;
  while (tr_now() < end) {
    ftar_member_epoch(ms[1], &n_now);
    if (n_now == 2) break;
    usleep(10000);
  }
  CHECK(run_threads(ms + 1, slots + 1, 2, be, 2) == 0, "a collective of 2 in the next epoch");
  uint64_t e2 = ftar_member_epoch(ms[1], NULL);
  CHECK(e2 > e1, "a new epoch (%llu after %llu)", (unsigned long long)e2, (unsigned long long)e1);
  uint8_t id2[2][FTAR_COMMID_LEN];
  for (int i = 0; i < 2; i++)
    CHECK(ftar_member_comm_id_wait(ms[1 + i], e2, id2[i], tr_now() + 2) == 0, "slot %d holds epoch %llu's id: %s",
          slots[1 + i], (unsigned long long)e2, tr_error());
  CHECK(memcmp(id2[0], id2[1], FTAR_COMMID_LEN) == 0, "both members of epoch %llu got the same id",
        (unsigned long long)e2);
  CHECK(memcmp(id2[0], id[0], FTAR_COMMID_LEN) != 0, "and it differs from epoch %llu's", (unsigned long long)e1);
  /* waiting for an id the coordinator will never send is bounded */
  double tw = tr_now();
  int w = ftar_member_comm_id_wait(ms[1], e2 + 5, again, tr_now() + 0.3);
  CHECK(w == FTAR_ETIMEOUT, "a missing id times out (%d after %.2f s)", w, tr_now() - tw);
done:
  for (int i = 0; i < 3; i++) ftar_member_free(ms[i]);
  ftar_coord_free(c);
  pid_t me = getpid();
  CHECK(shm_leftovers(&me, 1) == 0, "commid: no segment left in /dev/shm");
  printf("  commid: %.1f s\n", tr_now() - t0);
}

/* --- emu communicator across processes --- */

typedef struct {
  uint8_t id[TR_COMM_ID_BYTES], id2[TR_COMM_ID_BYTES];
  int p;
  const size_t *sizes;
  int nsizes;
  int victim;
} emu_job;

/* Child: attach as rank r of p, all-reduce every size, check exact sums,
 * print "size <n> crc <crc> ok <0|1>". */
static int emu_sizes_child(void *arg, int r, int out) {
  emu_job *j = arg;
  tr_comm *c;
  if (emu_comm_create(&c, j->id, j->p, r, 10)) {
    say(out, "error create: %s", tr_error());
    return 1;
  }
  size_t maxn = 0;
  for (int s = 0; s < j->nsizes; s++)
    if (j->sizes[s] > maxn) maxn = j->sizes[s];
  float *buf = malloc(maxn * sizeof(float));
  int bad = 0;
  for (int s = 0; s < j->nsizes && !bad; s++) {
    size_t n = j->sizes[s];
    float scale = s % 3 == 2 ? 0.5f : 1.0f; /* halving is exact */
    for (size_t i = 0; i < n; i++) buf[i] = val(r, s, i);
    if (emu_comm_allreduce(c, buf, n, scale, 10)) {
      say(out, "error allreduce %zu: %s", n, tr_error());
      bad = 1;
      break;
    }
    int ok = 1;
    for (size_t i = 0; i < n && ok; i++) {
      float want = 0;
      for (int q = 0; q < j->p; q++) want += val(q, s, i);
      if (buf[i] != want * scale) {
        say(out, "error size %zu: [%zu] = %g, want %g", n, i, (double)buf[i], (double)(want * scale));
        ok = 0;
      }
    }
    say(out, "size %zu crc %08x ok %d", n, tr_crc32c(0, buf, n * sizeof(float)), ok);
    bad |= !ok;
  }
  free(buf);
  emu_comm_destroy(c, 0);
  return bad;
}

static void test_emu_sizes(int p) {
  double t0 = tr_now();
  static const size_t sizes[] = {1, 2, 1000, SLOT_FLOATS - 1, SLOT_FLOATS, SLOT_FLOATS + 1, 3 * SLOT_FLOATS + 5,
                                 1 << 20};
  emu_job j = {.p = p, .sizes = sizes, .nsizes = (int)(sizeof sizes / sizeof sizes[0])};
  emu_comm_id(j.id);
  kid ks[MAXK];
  for (int r = 0; r < p; r++) kid_start(&ks[r], emu_sizes_child, &j, r);
  kids_finish(ks, p, T(120));
  for (int r = 0; r < p; r++) {
    CHECK(exited_ok(&ks[r]), "emu %d ranks: rank %d exit status %d", p, r, ks[r].status);
    CHECK(kid_count(&ks[r], "size ") == j.nsizes, "emu %d ranks: rank %d reported %d of %d sizes", p, r,
          kid_count(&ks[r], "size "), j.nsizes);
    CHECK(kid_find(&ks[r], "error", 0) < 0, "emu %d ranks: rank %d: %s", p, r,
          kid_find(&ks[r], "error", 0) >= 0 ? ks[r].lines[kid_find(&ks[r], "error", 0)] : "");
  }
  /* identical bits everywhere */
  int same = 1;
  for (int r = 1; r < p; r++)
    for (int i = 0; i < ks[0].nlines && i < ks[r].nlines; i++) same &= strcmp(ks[0].lines[i], ks[r].lines[i]) == 0;
  CHECK(same, "emu %d ranks: every rank reports the same result checksums", p);
  pid_t pids[MAXK + 1] = {getpid()};
  CHECK(shm_leftovers(pids, 1) == 0, "emu %d ranks: no segment left in /dev/shm", p);
  printf("  emu: %d ranks, %d sizes up to %zu floats: %.1f s\n", p, j.nsizes, sizes[j.nsizes - 1], tr_now() - t0);
  kids_free(ks, p);
}

/* Creation that cannot complete: bounded, TR_EIO, nothing left behind. */
static void test_emu_attach(void) {
  uint8_t id[TR_COMM_ID_BYTES];
  tr_comm *c = NULL;
  emu_comm_id(id);
  double t = tr_now();
  int rc = emu_comm_create(&c, id, 2, 0, 0.3);
  double dt = tr_now() - t;
  CHECK(rc == TR_EIO && !c && dt < 1.3 && strstr(tr_error(), "1 of 2 ranks attached") && strstr(tr_error(), "missing: 1"),
        "rank 1 never comes: rc %d after %.2f s: %s", rc, dt, tr_error());
  emu_comm_id(id);
  t = tr_now();
  rc = emu_comm_create(&c, id, 3, 2, 0.3);
  dt = tr_now() - t;
  CHECK(rc == TR_EIO && !c && dt < 1.3 && strstr(tr_error(), "rank 0 did not create it"),
        "rank 0 never comes: rc %d after %.2f s: %s", rc, dt, tr_error());
  uint8_t bad[TR_COMM_ID_BYTES];
  memset(bad, 0x41, sizeof bad);
  CHECK(emu_comm_create(&c, bad, 2, 0, 0.3) == TR_EINVAL && !c, "a foreign id is refused: %s", tr_error());
  CHECK(emu_comm_create(&c, id, 2, 2, 0.3) == TR_EINVAL && !c, "rank 2 of 2 is refused: %s", tr_error());
  /* one rank: a plain copy through the segment, scaled */
  emu_comm_id(id);
  CHECK(emu_comm_create(&c, id, 1, 0, 1) == 0 && c, "1 rank: %s", tr_error());
  if (c) {
    float v[3] = {1, 2, 3};
    CHECK(emu_comm_allreduce(c, v, 3, 0.5f, 1) == 0 && v[0] == 0.5f && v[2] == 1.5f, "1 rank all-reduce");
    CHECK(emu_comm_allreduce(c, v, 0, 1.0f, 1) == 0, "an empty all-reduce");
    emu_comm_destroy(c, 0);
  }
  pid_t me = getpid();
  CHECK(shm_leftovers(&me, 1) == 0, "failed creations leave no segment in /dev/shm");
}

/* Child: all-reduce 600000 floats (3 chunks) in a loop until a failure,
 * printing "ok <k>" after each; then "fail <rc> <message>"; survivors (not
 * the victim) then create a communicator from id2 and print "fresh ok|bad". */
static int emu_kill_child(void *arg, int r, int out) {
  emu_job *j = arg;
  tr_comm *c;
  if (emu_comm_create(&c, j->id, j->p, r, 10)) {
    say(out, "error create: %s", tr_error());
    return 1;
  }
  size_t n = 600000;
  float *buf = malloc(n * sizeof(float));
  int rc = 0;
  double end = tr_now() + T(60);
  for (int k = 0; tr_now() < end; k++) {
    for (size_t i = 0; i < n; i++) buf[i] = val(r, (uint64_t)k, i);
    rc = emu_comm_allreduce(c, buf, n, 1.0f, DEADLINE);
    if (rc) break;
    say(out, "ok %d", k);
  }
  if (!rc) {
    say(out, "error never failed");
    return 1;
  }
  say(out, "fail %d %s", rc, tr_error());
  /* aborted: every further call fails at once */
  double t = tr_now();
  int rc2 = emu_comm_allreduce(c, buf, 10, 1.0f, DEADLINE);
  say(out, "again %d %.3f", rc2, tr_now() - t);
  emu_comm_destroy(c, 0);
  if (r == j->victim) {
    free(buf);
    return 0;
  }
  int p2 = j->p - 1, r2 = r < j->victim ? r : r - 1;
  if (emu_comm_create(&c, j->id2, p2, r2, 10)) {
    say(out, "fresh bad create: %s", tr_error());
    free(buf);
    return 1;
  }
  int ok = 1;
  for (size_t i = 0; i < n; i++) buf[i] = val(r2, 1, i);
  if (emu_comm_allreduce(c, buf, n, 1.0f, 10)) {
    say(out, "fresh bad allreduce: %s", tr_error());
    ok = 0;
  }
  for (size_t i = 0; i < n && ok; i++) {
    float want = 0;
    for (int q = 0; q < p2; q++) want += val(q, 1, i);
    ok = buf[i] == want;
  }
  emu_comm_destroy(c, 0);
  say(out, "fresh %s", ok ? "ok" : "bad");
  free(buf);
  return ok ? 0 : 1;
}

static int all_have(kid *ks, int n, const char *prefix, int count, double seconds) {
  double end = tr_now() + seconds;
  for (;;) {
    int ok = 1;
    for (int i = 0; i < n; i++) ok &= kid_count(&ks[i], prefix) >= count;
    if (ok) return 1;
    if (tr_now() > end) return 0;
    kids_pump(ks, n, 20);
  }
}

static void test_emu_kill(int use_stop) {
  double t0 = tr_now();
  const char *what = use_stop ? "SIGSTOP" : "kill -9";
  emu_job j = {.p = 3, .victim = 2};
  emu_comm_id(j.id);
  emu_comm_id(j.id2);
  CHECK(memcmp(j.id, j.id2, sizeof j.id) != 0, "two ids differ");
  kid ks[MAXK];
  for (int r = 0; r < 3; r++) kid_start(&ks[r], emu_kill_child, &j, r);
  CHECK(all_have(ks, 3, "ok ", 3, T(30)), "emu %s: all ranks completed 3 collectives", what);
  kill(ks[2].pid, use_stop ? SIGSTOP : SIGKILL);
  double t_kill = tr_now();
  double t_fail[2] = {0, 0};
  double end = t_kill + DEADLINE + T(30);
  while (tr_now() < end && (!t_fail[0] || !t_fail[1])) {
    kids_pump(ks, 2, 10);
    for (int r = 0; r < 2; r++)
      if (!t_fail[r] && kid_find(&ks[r], "fail ", 0) >= 0) t_fail[r] = tr_now();
  }
  int named = 0;
  for (int r = 0; r < 2; r++) {
    int i = kid_find(&ks[r], "fail ", 0);
    CHECK(i >= 0, "emu %s: rank %d failed", what, r);
    if (i < 0) continue;
    /* no bound on how soon: a loaded machine can deschedule a survivor past
     * any bound; that it failed while rank 2 stays stopped (or dead) is the
     * point, and the wait above is bounded */
    double dt = t_fail[r] - t_kill;
    CHECK(strncmp(ks[r].lines[i], "fail -3 ", 8) == 0, "emu %s: rank %d failed with TR_EIO: %s", what, r,
          ks[r].lines[i]);
    named |= strstr(ks[r].lines[i], "rank(s) 2 did not arrive") != NULL;
    if (verbose) fprintf(stderr, "  rank %d after %.2f s: %s\n", r, dt, ks[r].lines[i]);
  }
  CHECK(named, "emu %s: a survivor names rank 2 as the one that did not arrive", what);
  if (use_stop) {
    double t_cont = tr_now();
    kill(ks[2].pid, SIGCONT);
    double tend = t_cont + T(30);
    while (kid_find(&ks[2], "fail ", 0) < 0 && tr_now() < tend) kids_pump(&ks[2], 1, 10);
    int i = kid_find(&ks[2], "fail ", 0);
    CHECK(i >= 0, "emu SIGSTOP: the continued rank fails (after %.2f s): %s", tr_now() - t_cont,
          i >= 0 ? ks[2].lines[i] : "-");
  }
  kids_finish(ks, 3, T(30));
  for (int r = 0; r < 2; r++) {
    int i = kid_find(&ks[r], "again ", 0);
    int rc2 = 0;
    double dt = 99;
    if (i >= 0) sscanf(ks[r].lines[i], "again %d %lf", &rc2, &dt);
    CHECK(i >= 0 && rc2 == TR_EIO, "emu %s: rank %d: a call on the aborted communicator fails (TR_EIO, %.3f s)", what,
          r, dt);
    CHECK(kid_find(&ks[r], "fresh ok", 0) >= 0, "emu %s: rank %d: a fresh communicator among the survivors works",
          what, r);
    CHECK(exited_ok(&ks[r]), "emu %s: rank %d exit status %d", what, r, ks[r].status);
  }
  pid_t pids[1] = {getpid()};
  CHECK(shm_leftovers(pids, 1) == 0, "emu %s: no segment left in /dev/shm", what);
  printf("  emu %s: survivors failed after %.2f / %.2f s, fresh communicator ok: %.1f s\n", what, t_fail[0] - t_kill,
         t_fail[1] - t_kill, tr_now() - t0);
  kids_free(ks, 3);
}

/* --- ftar_allreduce_dev across forked members --- */

enum { DEV_PLAIN = 0, DEV_KILL_WAITED = 1, DEV_KILL_ANYTIME = 2, DEV_LOST = 3, DEV_KILL_PRODUCING = 4 };
enum { BE_EMU = 0, BE_EMU_NOCOMM = 1, BE_CPU = 2 };

typedef struct {
  int port_pipe[MAXK][2]; /* parent -> child: the coordinator's port */
  int nseq;               /* collectives per member */
  int p;
  int stall_slot, stall_seq; /* that slot sleeps 1 s before that seq (the others wait inside it) */
  int lose_slot, lose_seq;   /* that slot's device is lost inside that seq's all-reduce */
  int fail_restore;          /* a device copy into the caller's buffer (a restore) fails */
  int same_device;           /* every member on emulated device 0 of 2 */
  int backend;               /* BE_*: emu's communicator, emu without collectives (host + ring), cpu */
  size_t bucket;             /* > 0: ftar_allreduce_dev_start in buckets of (at most) this many floats,
                                the buffer written and marked ready progressively */
} dev_job;

/* emu whose comm_destroy reports how it was asked to destroy: "destroy
 * <finalize> run" while collectives run, "destroy <finalize> free" from
 * ftar_member_free. */
static tr_backend rec_be;
static const tr_backend *rec_base;
static int rec_out = -1, rec_freeing;

static void rec_destroy(tr_comm *c, int finalize) {
  say(rec_out, "destroy %d %s", finalize, rec_freeing ? "free" : "run");
  rec_base->comm_destroy(c, finalize);
}

/* emu whose copies into fail_dst fail (FTAR's restore of the input) */
static tr_backend restore_be;
static const tr_backend *restore_base;
static void *fail_dst;

static int restore_copy(void *dst, const void *src, size_t bytes) {
  if (dst == fail_dst) return tr_fail(TR_EIO, "injected: the device copy failed");
  return restore_base->copy(dst, src, bytes);
}

/* emu whose device is lost inside the next all-reduce once lose_now is set:
 * a kernel given a host pointer (an illegal address) corrupts it, then the
 * all-reduce runs on the corrupted device, as a GPU's would after an Xid. */
static tr_backend lose_be;
static const tr_backend *lose_base;
static int lose_now;

static int lose_allreduce(tr_comm *c, float *buf, size_t n, float scale, double deadline) {
  if (lose_now) {
    lose_now = 0;
    float host = 1;
    lose_base->scale(&host, 1, 2.0f);
  }
  return lose_base->comm_allreduce(c, buf, n, scale, deadline);
}

/* the same for a bucket's overlapped all-reduce (ftar_allreduce_dev_start) */
static int lose_allreduce_async(tr_comm *c, float *buf, size_t n, float scale, const tr_mark *after,
                                double deadline) {
  if (lose_now) {
    lose_now = 0;
    float host = 1;
    lose_base->scale(&host, 1, 2.0f);
  }
  return lose_base->comm_allreduce_async(c, buf, n, scale, after, deadline);
}

/* A child's member log: the abort lines go to the parent ("log <line>"). */
static int log_out = -1;
static void abort_log(void *ud, const char *msg) {
  quiet_log(ud, msg);
  if (log_out >= 0 && strstr(msg, " aborted in epoch ")) say(log_out, "log %s", msg);
}

/* Bucket 0 of the call in flight holds the sum already: on emu a bucket's
 * overlapped all-reduce ran when it returned, so rec_be counts those (reset
 * by dev_produce before each call). A count, not a look at the device
 * memory the communication thread is writing, which raced with it (a
 * surviving staller failed under TSan). */
static _Atomic int rec_reduced;

static int rec_allreduce_async(tr_comm *c, float *buf, size_t n, float scale, const tr_mark *after,
                               double deadline) {
  int rc = rec_base->comm_allreduce_async(c, buf, n, scale, after, deadline);
  if (!rc) atomic_fetch_add(&rec_reduced, 1);
  return rc;
}

static int bucket0_reduced(void) { return atomic_load(&rec_reduced) > 0; }

/* The producer of a bucketed call: writes buf from its end in pieces that
 * straddle buckets (as backward does), marking each ready, with a pause
 * between pieces; the staller, halfway, waits until bucket 0 was reduced
 * (buckets in flight), says "stalling" and sleeps (it is killed there).
 * Returns ftar_allreduce_wait's code. */
static int dev_produce(ftar_member *m, const tr_backend *be, float *dev, const float *host, size_t n, ftar_op op,
                       uint64_t seq, size_t bucket, int stall, int out, ftar_result *res, double *comm_s) {
  size_t bk = bucket < n ? bucket : n / 3 + 1;
  atomic_store(&rec_reduced, 0); /* the last call is over: its thread is done */
  int rc = ftar_allreduce_dev_start(m, be, dev, n, op, seq, bk);
  if (rc) return rc;
  size_t piece = bk * 2 / 3 + 1, from = n;
  int stalled = 0;
  while (from > 0) {
    size_t len = from < piece ? from : piece;
    from -= len;
    be->upload(dev + from, host + from, len * sizeof(float));
    ftar_allreduce_ready(m, from);
    if (stall && !stalled && from < n / 2) {
      double end = tr_now() + T(20);
      while (!bucket0_reduced() && tr_now() < end) usleep(2000);
      say(out, "stalling %d", bucket0_reduced());
      stalled = 1;
      usleep(3000000);
    }
    usleep(500);
  }
  return ftar_allreduce_wait(m, res, comm_s);
}

/* Child: member of slot r; nseq collectives on emu device buffers; prints
 * "res <seq> <rc> <epoch> <contrib> <redos> <crc> <ok> <slots>" per seq; the
 * slot that loses its device prints "lost <rc> <redos> <message>" and leaves. */
static int dev_child(void *arg, int r, int out) {
  dev_job *j = arg;
  for (int i = 0; i < j->p; i++) {
    if (i != r) close(j->port_pipe[i][0]);
    close(j->port_pipe[i][1]);
  }
  int port = 0;
  ssize_t got = read(j->port_pipe[r][0], &port, sizeof port);
  close(j->port_pipe[r][0]);
  if (got != (ssize_t)sizeof port || port <= 0) return 2;
  if (j->same_device) {
    setenv("TRANSOM_EMU_DEVICES", "2", 1);
    setenv("TRANSOM_LOCAL_RANK", "0", 1);
  }
  const tr_backend *be = backend_get(j->backend == BE_CPU ? "cpu" : "emu", 1);
  if (!be) {
    say(out, "error backend: %s", tr_error());
    return 1;
  }
  static tr_backend nocomm;
  if (j->backend == BE_EMU_NOCOMM) { /* emu with its collectives taken away */
    nocomm = *be;
    nocomm.comm_id = NULL;
    nocomm.comm_create = NULL;
    nocomm.comm_allreduce = NULL;
    nocomm.comm_destroy = NULL;
    be = &nocomm;
  }
  if (j->backend == BE_EMU) {
    rec_base = be;
    rec_be = *be;
    rec_be.comm_destroy = rec_destroy;
    rec_be.comm_allreduce_async = rec_allreduce_async;
    rec_out = out;
    be = &rec_be;
  }
  if (r == j->lose_slot) {
    lose_base = be;
    lose_be = *be;
    lose_be.comm_allreduce = lose_allreduce;
    lose_be.comm_allreduce_async = lose_allreduce_async;
    be = &lose_be;
  }
  int ring = j->backend != BE_EMU; /* the TCP ring divides a mean; the communicator multiplies by 1/p */
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = T(30);
  mo.log = abort_log;
  log_out = out;
  ftar_member *m = ftar_member_create("127.0.0.1", port, r, &mo);
  if (!m) {
    say(out, "error member: %s", tr_error());
    return 1;
  }
  if (ftar_member_wait(m, j->p, 20)) {
    say(out, "error wait: %s", tr_error());
    ftar_member_free(m);
    return 1;
  }
  const size_t sizes[] = {1, 1000, (test_small() ? 1 : 3) * SLOT_FLOATS + 7};
  size_t maxn = sizes[2];
  float *host = malloc(maxn * sizeof(float));
  float *dev = be->alloc(maxn * sizeof(float));
  if (j->fail_restore) {
    restore_base = be;
    restore_be = *be;
    restore_be.copy = restore_copy;
    fail_dst = dev;
    be = &restore_be;
  }
  int bad = 0;
  for (int s = 1; s <= j->nseq && !bad; s++) {
    uint64_t seq = (uint64_t)s;
    size_t n = s <= 6 ? sizes[s % 3] : sizes[2];
    ftar_op op = s % 2 ? FTAR_MEAN : FTAR_SUM;
    for (size_t i = 0; i < n; i++) host[i] = val(r, seq, i);
    int stall = r == j->stall_slot && s == j->stall_seq;
    ftar_result res;
    int rc;
    lose_now = r == j->lose_slot && s == j->lose_seq;
    if (j->bucket) {
      double comm_s = -1;
      rc = dev_produce(m, be, dev, host, n, op, seq, j->bucket, stall, out, &res, &comm_s);
      if (rc >= 0 && !(comm_s >= 0)) say(out, "error seq %d: comm_s %g", s, comm_s);
    } else {
      be->upload(dev, host, n * sizeof(float));
      if (stall) {
        say(out, "stalling");
        usleep(1000000);
      }
      rc = ftar_allreduce_dev(m, be, dev, n, op, seq, &res);
    }
    if (j->fail_restore && rc < 0) {
      char msg[400];
      snprintf(msg, sizeof msg, "%s", tr_error());
      int rc2 = ftar_allreduce_dev(m, be, dev, n, op, seq + 1, &res);
      say(out, "failed %d %d %s", s, rc, msg);
      say(out, "after %d %s", rc2, tr_error());
      break;
    }
    if (r == j->lose_slot && s == j->lose_seq) {
      char msg[400];
      snprintf(msg, sizeof msg, "%s", tr_error());
      for (char *q = msg; *q; q++)
        if (*q == '\n') *q = ' ';
      say(out, "lost %d %d %s", rc, res.redos, msg);
      break; /* as a worker would: exit, to be replaced */
    }
    be->download(host, dev, n * sizeof(float));
    int ok = rc >= 0 && res.seq == seq && res.contributors >= 1;
    for (size_t i = 0; i < n && ok; i++) {
      float sum = 0;
      for (int q = 0; q < res.contributors; q++) sum += val(res.slots[q], seq, i);
      float want = op != FTAR_MEAN ? sum : ring ? sum / (float)res.contributors : sum * (1.0f / (float)res.contributors);
      if (host[i] != want) {
        say(out, "error seq %d [%zu] = %g, want %g", s, i, (double)host[i], (double)want);
        ok = 0;
      }
    }
    char sl[64];
    size_t off = 0;
    sl[0] = 0;
    for (int q = 0; q < res.contributors && off + 8 < sizeof sl; q++)
      off += (size_t)snprintf(sl + off, sizeof sl - off, "%s%d", q ? "," : "", res.slots[q]);
    say(out, "res %d %d %llu %d %d %08x %d %s", s, rc, (unsigned long long)res.epoch, res.contributors, res.redos,
        tr_crc32c(0, host, n * sizeof(float)), ok, sl);
    if (rc < 0) say(out, "error seq %d: rc %d: %s", s, rc, tr_error());
    bad |= !ok;
  }
  rec_freeing = 1;
  ftar_member_free(m); /* frees the device copies: before the backend goes */
  be->free(dev);
  free(host);
  return bad;
}

typedef struct {
  int seq, rc, contrib, redos, ok;
  unsigned long long epoch;
  unsigned crc;
  char slots[64];
} dev_res;

/* Finds seq's result line of k; *t (may be NULL) gets when it arrived. */
static int dev_parse(const kid *k, int seq, dev_res *out, double *t) {
  for (int i = 0; i < k->nlines; i++) {
    dev_res d;
    if (sscanf(k->lines[i], "res %d %d %llu %d %d %x %d %63s", &d.seq, &d.rc, &d.epoch, &d.contrib, &d.redos, &d.crc,
               &d.ok, d.slots) == 8 &&
        d.seq == seq) {
      *out = d;
      if (t) *t = k->t[i];
      return 1;
    }
  }
  return 0;
}

/* Starts p dev_child members of job j and a coordinator for them. */
static ftar_coord *dev_start(dev_job *j, kid *ks) {
  for (int r = 0; r < j->p; r++)
    if (pipe(j->port_pipe[r])) CHECK(0, "pipe");
  for (int r = 0; r < j->p; r++) kid_start(&ks[r], dev_child, j, r);
  for (int r = 0; r < j->p; r++) close(j->port_pipe[r][0]);
  ftar_coord *c = coord_start(); /* the children exist; now this process may start threads */
  int port = c ? ftar_coord_port(c) : -1;
  for (int r = 0; r < j->p; r++) {
    ssize_t w = write(j->port_pipe[r][1], &port, sizeof port);
    (void)w;
    close(j->port_pipe[r][1]);
  }
  return c;
}

/* mode DEV_PLAIN: 3 members, 12 collectives, all with 3 contributors.
 * DEV_KILL_WAITED: slot 0 (the epoch's rank 0) stalls before seq 10 while
 * the others wait inside that collective, and is killed there: they must
 * abort on the communicator's deadline and redo seq 10 in a new epoch
 * whose id slot 1 made. DEV_KILL_ANYTIME: slot 1 is killed at whatever
 * point it is after 8 collectives. */
static void test_dev_p(int mode, int backend, int p, size_t bucket) {
  double t0 = tr_now();
  int victim = mode == DEV_KILL_ANYTIME || mode == DEV_LOST ? 1 : 0;
  int staller = mode == DEV_KILL_PRODUCING ? 2 : 0;
  dev_job j = {.p = p,
               .bucket = bucket,
               .nseq = mode == DEV_LOST ? 16 : mode ? 60 : 12,
               .stall_slot = mode == DEV_KILL_WAITED || mode == DEV_KILL_PRODUCING ? staller : -1,
               .stall_seq = 10,
               .lose_slot = mode == DEV_LOST ? victim : -1,
               .lose_seq = 10,
               .backend = backend};
  kid ks[MAXK];
  ftar_coord *c = dev_start(&j, ks);
  const char *what = mode == DEV_KILL_PRODUCING ? "dev-bucket kill -9 (a survivor still producing)"
                     : mode == DEV_KILL_WAITED  ? (bucket ? "dev-bucket kill -9 (buckets in flight)" : "dev kill -9 (waited for)")
                     : mode == DEV_KILL_ANYTIME ? (bucket ? "dev-bucket kill -9 (any time)" : "dev kill -9 (any time)")
                     : mode == DEV_LOST         ? (bucket ? "dev-bucket lost (device corrupted mid-collective)"
                                                          : "dev lost (device corrupted mid-collective)")
                     : bucket                   ? (p == 2 ? "dev-bucket (2 members)" : "dev-bucket (3 members)")
                     : backend == BE_CPU        ? "dev (cpu: ftar_allreduce)"
                     : backend == BE_EMU_NOCOMM ? "dev (emu without collectives: host + ring)"
                                                : "dev";
  double t_kill = 0;
  if (mode == DEV_KILL_WAITED || mode == DEV_KILL_PRODUCING) {
    double end = tr_now() + T(60);
    while (kid_find(&ks[staller], "stalling", 0) < 0 && tr_now() < end) kids_pump(ks, j.p, 20);
    CHECK(kid_find(&ks[staller], "stalling", 0) >= 0, "%s: slot %d reached seq %d", what, staller, j.stall_seq);
    if (bucket)
      CHECK(kid_find(&ks[staller], "stalling 1", 0) >= 0,
            "%s: slot %d stalls halfway through writing seq %d with bucket 0 already reduced", what, staller,
            j.stall_seq);
    usleep(300000); /* the others are inside seq 10 by now */
    kill(ks[victim].pid, SIGKILL);
    t_kill = tr_now();
  } else if (mode == DEV_KILL_ANYTIME) {
    CHECK(all_have(ks, 3, "res ", 8, T(60)), "%s: every member completed 8 collectives", what);
    kill(ks[victim].pid, SIGKILL);
    t_kill = tr_now();
  }
  kids_finish(ks, j.p, T(180));
  if (mode == DEV_LOST && kid_find(&ks[victim], "lost ", 0) >= 0) t_kill = ks[victim].t[kid_find(&ks[victim], "lost ", 0)];
  int sv[MAXK], ns = 0;
  for (int r = 0; r < j.p; r++)
    if (mode == DEV_PLAIN || r != victim) sv[ns++] = r;
  char want_slots[16];
  snprintf(want_slots, sizeof want_slots, "%d,%d", sv[0], ns > 1 ? sv[1] : -1);
  /* survivors: every seq, identical results */
  int reshaped_seen = 0, bad = 0, reduced_at = 0, redos_at = 0;
  for (int s = 1; s <= j.nseq; s++) {
    dev_res d[MAXK];
    memset(d, 0, sizeof d);
    int have = 1;
    for (int i = 0; i < ns; i++) have &= dev_parse(&ks[sv[i]], s, &d[i], NULL);
    if (!have) {
      if (!bad++) CHECK(0, "%s: seq %d missing from a survivor", what, s);
      continue;
    }
    for (int i = 0; i < ns; i++) {
      if ((!d[i].ok || d[i].rc < 0) && !bad++) CHECK(0, "%s: seq %d on slot %d: ok %d rc %d", what, s, sv[i], d[i].ok, d[i].rc);
      if (i && (d[i].crc != d[0].crc || d[i].epoch != d[0].epoch || d[i].contrib != d[0].contrib ||
                strcmp(d[i].slots, d[0].slots)) && !bad++)
        CHECK(0, "%s: seq %d: slot %d (crc %08x epoch %llu contrib %d) differs from slot %d (%08x %llu %d)", what, s,
              sv[i], d[i].crc, d[i].epoch, d[i].contrib, sv[0], d[0].crc, d[0].epoch, d[0].contrib);
    }
    if (mode == DEV_PLAIN && d[0].contrib != j.p && !bad++)
      CHECK(0, "%s: seq %d had %d contributors", what, s, d[0].contrib);
    if (mode && d[0].contrib == 2 && !reduced_at) {
      reduced_at = s;
      redos_at = d[0].redos;
      reshaped_seen = 1;
      for (int i = 0; i < ns; i++) reshaped_seen &= d[i].rc == FTAR_RESHAPED && strcmp(d[i].slots, want_slots) == 0;
    }
    if (mode && reduced_at && d[0].contrib != 2 && !bad++)
      CHECK(0, "%s: seq %d has %d contributors after the kill", what, s, d[0].contrib);
  }
  CHECK(bad == 0, "%s: %d bad results", what, bad);
  for (int i = 0; i < ns; i++) {
    CHECK(exited_ok(&ks[sv[i]]), "%s: slot %d exit status %d", what, sv[i], ks[sv[i]].status);
    int e = kid_find(&ks[sv[i]], "error", 0);
    CHECK(e < 0, "%s: slot %d: %s", what, sv[i], e >= 0 ? ks[sv[i]].lines[e] : "");
  }
  /* communicators: aborted when an epoch is left, finalized only by the
   * member's free after a completed collective (a clean shutdown) */
  if (backend == BE_EMU)
    for (int i = 0; i < ns; i++) {
      const kid *k = &ks[sv[i]];
      CHECK(kid_count(k, "destroy 1 run") == 0 && kid_count(k, "destroy 1 free") == 1,
            "%s: slot %d: no communicator finalized while collectives run (%d), the last one at the member's free "
            "(%d)",
            what, sv[i], kid_count(k, "destroy 1 run"), kid_count(k, "destroy 1 free"));
      if (mode)
        CHECK(kid_count(k, "destroy 0 run") >= 1, "%s: slot %d: the epoch left after the fault aborted its "
              "communicator", what, sv[i]);
    }
  double recovery = 0;
  if (mode) {
    CHECK(reduced_at > 0, "%s: the survivors went on with 2 contributors", what);
    CHECK(reshaped_seen, "%s: seq %d, the first without slot %d, is RESHAPED on both survivors, slots %s", what,
          reduced_at, victim, want_slots);
    char closed[64];
    if (mode == DEV_LOST) snprintf(closed, sizeof closed, "slot %d leaves", victim); /* freed its member */
    else snprintf(closed, sizeof closed, "slot %d: connection closed", victim);
    CHECK(coord_log_has(closed), "%s: the coordinator saw slot %d go", what, victim);
    dev_res d;
    double t_res = 0;
    if (dev_parse(&ks[sv[0]], reduced_at, &d, &t_res)) recovery = t_res - t_kill;
    /* no bound on `recovery`: that the survivors reduced without the victim
     * (above) shows they did not wait for it; how soon is a load question */
    CHECK(redos_at <= 2, "%s: seq %d redone %d times", what, reduced_at, redos_at);
    if (mode == DEV_KILL_PRODUCING) {
      /* slot 2's communication thread waited for its producer's next
       * bucket when slot 0 died: the epoch's abort ends its attempt there,
       * not a collective queued later into the dead epoch's communicator
       * (which would wait out the deadline for slot 0 first) */
      int i = kid_find(&ks[staller], "log ", 0);
      CHECK(i >= 0 && strstr(ks[staller].lines[i], "waited for the producer"),
            "%s: slot %d's attempt of seq %d ends on the epoch's abort while it waits for its producer: %s", what,
            staller, j.stall_seq, i >= 0 ? ks[staller].lines[i] : "(no abort logged)");
    }
    if (mode == DEV_KILL_WAITED || mode == DEV_KILL_PRODUCING)
      CHECK(reduced_at == j.stall_seq && redos_at >= 1,
            "%s: seq %d (the one the victim was killed in) aborted on the communicator and was redone (seq %d, %d "
            "redos)",
            what, j.stall_seq, reduced_at, redos_at);
    if (mode == DEV_LOST) {
      int i = kid_find(&ks[victim], "lost ", 0), rc = 0, redos = -1;
      if (i >= 0) sscanf(ks[victim].lines[i], "lost %d %d", &rc, &redos);
      CHECK(i >= 0 && rc == TR_EDEVICE && redos == 0 && strstr(ks[victim].lines[i], "illegal address"),
            "%s: the member whose device was lost fails seq %d with TR_EDEVICE, not redone: %s", what, j.lose_seq,
            i >= 0 ? ks[victim].lines[i] : "(no line)");
      CHECK(exited_ok(&ks[victim]), "%s: slot %d exit status %d", what, victim, ks[victim].status);
      CHECK(reduced_at == j.lose_seq, "%s: the survivors redid seq %d without it (first with 2: seq %d)", what,
            j.lose_seq, reduced_at);
    }
  }
  pid_t pids[MAXK + 1];
  for (int r = 0; r < j.p; r++) pids[r] = ks[r].pid;
  pids[j.p] = getpid();
  CHECK(shm_leftovers(pids, j.p + 1) == 0, "%s: no segment left in /dev/shm", what);
  if (mode)
    printf("  %s: 3 members, %d collectives; seq %d, the first without slot %d, done %.2f s after the kill (%d redos): %.1f s\n",
           what, j.nseq, reduced_at, victim, recovery, redos_at, tr_now() - t0);
  else
    printf("  %s: %d members, %d collectives: %.1f s\n", what, j.p, j.nseq, tr_now() - t0);
  kids_free(ks, j.p);
  ftar_coord_free(c);
}

static void test_dev(int mode, int backend) { test_dev_p(mode, backend, 3, 0); }

/* dev-samedev: see the top of the file. */
static void test_dev_same_device(void) {
  dev_job j = {.p = 2, .nseq = 3, .stall_slot = -1, .lose_slot = -1, .same_device = 1, .backend = BE_EMU};
  kid ks[MAXK];
  ftar_coord *c = dev_start(&j, ks);
  kids_finish(ks, j.p, 120);
  for (int r = 0; r < j.p; r++) {
    int e = kid_find(&ks[r], "error seq 1: rc ", 0), rc = 0;
    if (e >= 0) sscanf(ks[r].lines[e], "error seq 1: rc %d", &rc);
    CHECK(e >= 0 && rc == TR_EINVAL && strstr(ks[r].lines[e], "both on emulated device 0"),
          "dev-samedev: slot %d: two members on one device fail the first collective with TR_EINVAL, saying so: %s", r,
          e >= 0 ? ks[r].lines[e] : "(no error)");
  }
  pid_t pids[MAXK + 1];
  for (int r = 0; r < j.p; r++) pids[r] = ks[r].pid;
  pids[j.p] = getpid();
  CHECK(shm_leftovers(pids, j.p + 1) == 0, "dev-samedev: no segment left in /dev/shm");
  printf("  dev-samedev: two members on one device: the communicator is refused, not retried\n");
  kids_free(ks, j.p);
  ftar_coord_free(c);
}

/* dev-restore: see the top of the file. */
static void test_dev_restore(void) {
  dev_job j = {.p = 3, .nseq = 12, .stall_slot = 0, .stall_seq = 10, .lose_slot = -1, .fail_restore = 1,
               .backend = BE_EMU};
  kid ks[MAXK];
  ftar_coord *c = dev_start(&j, ks);
  double end = tr_now() + 60;
  while (kid_find(&ks[0], "stalling", 0) < 0 && tr_now() < end) kids_pump(ks, j.p, 20);
  CHECK(kid_find(&ks[0], "stalling", 0) >= 0, "dev-restore: slot 0 reached seq %d", j.stall_seq);
  usleep(300000); /* the others are inside seq 10 by now */
  kill(ks[0].pid, SIGKILL);
  kids_finish(ks, j.p, 120);
  for (int r = 1; r < j.p; r++) {
    int i = kid_find(&ks[r], "failed ", 0), a = kid_find(&ks[r], "after ", 0), seq = 0, rc = 0, rc2 = 0;
    if (i >= 0) sscanf(ks[r].lines[i], "failed %d %d", &seq, &rc);
    if (a >= 0) sscanf(ks[r].lines[a], "after %d", &rc2);
    CHECK(i >= 0 && seq == j.stall_seq && rc == TR_EIO && strstr(ks[r].lines[i], "restor"),
          "dev-restore: slot %d fails seq %d, whose input it could not put back, instead of redoing it: %s", r,
          j.stall_seq, i >= 0 ? ks[r].lines[i] : "(no failure)");
    CHECK(a >= 0 && rc2 == TR_EIO, "dev-restore: slot %d's member stays failed: %s", r, a >= 0 ? ks[r].lines[a] : "-");
    dev_res d;
    CHECK(!dev_parse(&ks[r], j.stall_seq, &d, NULL) || d.rc < 0, "dev-restore: slot %d returned no result for seq %d",
          r, j.stall_seq);
  }
  pid_t pids[MAXK + 1];
  for (int r = 0; r < j.p; r++) pids[r] = ks[r].pid;
  pids[j.p] = getpid();
  CHECK(shm_leftovers(pids, j.p + 1) == 0, "dev-restore: no segment left in /dev/shm");
  printf("  dev-restore: a failed restore fails the survivors' member instead of a redo\n");
  kids_free(ks, j.p);
  ftar_coord_free(c);
}

/* dev-busy: see the top of the file. */
static void test_dev_busy(void) {
  ftar_coord *c = coord_start();
  const tr_backend *be = backend_get("emu", 1);
  ftar_member_opts mo;
  ftar_member_opts_default(&mo);
  mo.timeout = T(15);
  mo.log = quiet_log;
  ftar_member *m = c && be ? ftar_member_create("127.0.0.1", ftar_coord_port(c), 5, &mo) : NULL;
  CHECK(m != NULL, "dev-busy: a member: %s", tr_error());
  size_t n = 3000;
  float *d = be ? be->alloc(n * sizeof(float)) : NULL;
  if (m && d && ftar_member_wait(m, 1, 10) == 0) {
    ftar_result res;
    int rc = ftar_allreduce_dev_start(m, be, d, n, FTAR_SUM, 1, 1000);
    CHECK(rc == 0, "dev-busy: start: %s", tr_error());
    int rc2 = ftar_allreduce_dev(m, be, d, n, FTAR_SUM, 2, &res);
    CHECK(rc2 == TR_ESTATE, "dev-busy: ftar_allreduce_dev with a started collective not waited for is refused "
          "(TR_ESTATE), not run beside it on the communication thread's member: %d", rc2);
    rc = ftar_allreduce_wait(m, &res, NULL);
    CHECK(rc >= 0 && res.seq == 1 && res.contributors == 1, "dev-busy: the started collective completes: %d seq %llu: %s",
          rc, (unsigned long long)res.seq, rc < 0 ? tr_error() : "");
    rc = ftar_allreduce_dev(m, be, d, n, FTAR_SUM, 2, &res);
    CHECK(rc >= 0 && res.seq == 2, "dev-busy: after the wait, ftar_allreduce_dev runs: %d", rc);
  }
  ftar_member_free(m);
  if (d) be->free(d);
  ftar_coord_free(c);
  printf("  dev-busy: ftar_allreduce_dev refused while a started collective runs\n");
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  verbose = getenv("TRANSOM_VERBOSE") != NULL;
  tscale = test_time_scale();
  test_emu_sizes(2);
  test_emu_sizes(3);
  test_emu_kill(0);
  test_emu_kill(1);
  test_emu_attach();
  test_dev(DEV_PLAIN, BE_EMU);
  test_dev(DEV_PLAIN, BE_EMU_NOCOMM);
  test_dev(DEV_PLAIN, BE_CPU);
  test_dev(DEV_KILL_WAITED, BE_EMU);
  test_dev(DEV_KILL_ANYTIME, BE_EMU);
  test_dev(DEV_LOST, BE_EMU);
  test_dev_p(DEV_PLAIN, BE_EMU, 2, 70000);
  test_dev_p(DEV_PLAIN, BE_EMU, 3, 70000);
  test_dev_p(DEV_KILL_WAITED, BE_EMU, 3, 70000);
  test_dev_p(DEV_KILL_ANYTIME, BE_EMU, 3, 70000);
  test_dev_p(DEV_KILL_PRODUCING, BE_EMU, 3, 70000);
  test_dev_p(DEV_LOST, BE_EMU, 3, 70000);
  test_dev_restore();
  test_dev_same_device();
  test_commid(); /* last (with dev-busy): they start threads, and the others fork */
  test_dev_busy();
  return check_report("test_ftar_dev");
}
