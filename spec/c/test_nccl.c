/* test_nccl.c — the CUDA backend's NCCL communicators (ext/cuda/comm.cu),
 * through the backend table, as FTAR's device data plane uses them.
 *
 * One GPU, one rank:
 *   - a communicator of 1 rank: all-reduce is the identity (exact), with
 *     scale 0.5 it halves (exact), a 1-float all-reduce (FTAR's commit
 *     round) works, and so does a large one that the watchdog takes in
 *     several chunks (2.5 x 32 MiB: every chunk boundary exact);
 *   - destroyed mid-life with finalize (a clean shutdown) and re-created
 *     from a new id, as for a new epoch: works again; destroyed with abort
 *     right after creation too;
 *   - the creation deadline: a communicator of 2 ranks whose other rank
 *     never comes fails with TR_EIO (not TR_EDEVICE: the device is fine)
 *     within its timeout, and the next communicator still works.
 *   - the overlapped hooks on a communicator of 1 rank: a kernel on the
 *     compute stream doubles the buffer, comm_mark, then on the
 *     communication stream comm_copy of it (FTAR's input copy) and
 *     comm_allreduce_async with scale 0.5 after the mark, comm_wait: the
 *     copy holds the doubled values, the buffer the halved ones (exact);
 *     comm_copy back and comm_wait(NULL) restore it; a 2.5-chunk one too.
 * More GPUs (forked peer ranks, one per further visible device, up to 3;
 * skipped with a note where there is one GPU):
 *   - all ranks: exact sums of 1 M + 3 floats and of the large size;
 *   - a stalled peer (alive, not taking part): the others' all-reduce is
 *     aborted by the watchdog with TR_EIO; a further call on it fails at
 *     once; a fresh communicator of the others works afterwards;
 *   - a killed peer (kill -9 after it joined, before the collective): the
 *     others' all-reduce fails with TR_EIO (a peer's death is not a device
 *     error), and a fresh communicator of the survivors sums exactly.
 * Times are printed, not asserted.
 *
 * Without the plugin or a GPU it prints "test_nccl: SKIP: <why>" and exits
 * 77 (ctest: skipped).
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "check.h"
#include "util.h"

#define N ((size_t)(1 << 20) + 3)
#define BIG ((size_t)(5 << 22) + 7) /* 2.5 chunks of comm.cu's 8 M floats, and a bit */
#define MAXP 3                      /* peer ranks, on the 2nd..4th visible GPU */

static float val(int who, size_t i) { return (float)((long)((i * 131 + (size_t)who * 977) % 2001) - 1000); }

/* Uploads val(who, .), all-reduces with scale, downloads; returns the
 * number of elements that differ from the sum over ranks of `who`s
 * (-1 on an error, with *rc_out the all-reduce's code). */
static long allreduce_check(const tr_backend *be, tr_comm *c, float *d, float *h, size_t n, int who, float scale,
                            const int *ranks, int nranks, double deadline, int *rc_out) {
  for (size_t i = 0; i < n; i++) h[i] = val(who, i);
  if (rc_out) *rc_out = 0;
  if (be->upload(d, h, n * sizeof(float))) return -1;
  int rc = be->comm_allreduce(c, d, n, scale, deadline);
  if (rc_out) *rc_out = rc;
  if (rc) return -1;
  if (be->download(h, d, n * sizeof(float))) return -1;
  long bad = 0;
  for (size_t i = 0; i < n; i++) {
    float want = 0;
    for (int r = 0; r < nranks; r++) want += val(ranks[r], i);
    if (h[i] != want * scale) {
      if (!bad) fprintf(stderr, "  [%zu] = %g, want %g\n", i, (double)h[i], (double)(want * scale));
      bad++;
    }
  }
  return bad;
}

/* --- peer ranks, one GPU each, forked before CUDA starts here --- */

/* A command to a peer. */
typedef struct {
  char op;    /* 'j' join (aborting any previous communicator), 'a' all-reduce, 's' stall, 'q' quit */
  int nranks; /* 'j': of the communicator; 'a': of the sum */
  int rank;   /* 'j': this peer's rank */
  int who[MAXP + 1]; /* 'a': whose values are summed (ids: 0 the parent, 1.. the peers) */
  size_t n;   /* 'a' */
  uint8_t id[TR_COMM_ID_BYTES];
} cmd;

typedef struct {
  pid_t pid;
  int to, from; /* pipes: commands in, status bytes out */
  int gpu;      /* it has one */
} peer;

static peer peers[MAXP];
static int npeers;

/* Peer k (id k+1): says 'g' (a GPU) or 'n' (none), then runs commands,
 * answering each with one byte: 'y' done (exact), 'b' wrong sums, 'e' a
 * failed call, 'c' a failed creation, 'k' stalled. */
static void peer_main(int k, int in, int out) {
  const char *vis = getenv("CUDA_VISIBLE_DEVICES");
  char mine[64];
  if (vis && *vis) { /* entry k+1 of the caller's list */
    const char *p = vis;
    for (int i = 0; i < k + 1 && p; i++) p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL;
    if (p) snprintf(mine, sizeof mine, "%.*s", (int)strcspn(p, ","), p);
    else mine[0] = 0;
  } else {
    snprintf(mine, sizeof mine, "%d", k + 1);
  }
  const tr_backend *be = mine[0] && setenv("CUDA_VISIBLE_DEVICES", mine, 1) == 0 ? backend_get("cuda", 0) : NULL;
  char st = be ? 'g' : 'n';
  ssize_t w = write(out, &st, 1);
  if (!be) _exit(0);
  float *h = malloc(BIG * sizeof(float)), *d = be->alloc(BIG * sizeof(float));
  tr_comm *c = NULL;
  cmd m;
  while (read(in, &m, sizeof m) == (ssize_t)sizeof m) {
    if (m.op == 'q') break;
    if (m.op == 'j') {
      if (c) be->comm_destroy(c, 0);
      c = NULL;
      st = be->comm_create(&c, m.id, m.nranks, m.rank, 30) ? 'c' : 'y';
    } else if (m.op == 'a') {
      long bad = c && h && d ? allreduce_check(be, c, d, h, m.n, k + 1, 1.0f, m.who, m.nranks, 10, NULL) : -1;
      st = bad == 0 ? 'y' : bad < 0 ? 'e' : 'b';
    } else {
      st = 'k'; /* stalled: alive, taking no part */
    }
    w = write(out, &st, 1);
  }
  (void)w;
  if (c) be->comm_destroy(c, 0);
  _exit(0);
}

static void peers_start(void) {
  for (int k = 0; k < MAXP; k++) {
    int to[2], from[2];
    if (pipe(to) || pipe(from)) break;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
      close(to[1]);
      close(from[0]);
      for (int j = 0; j < npeers; j++) close(peers[j].to), close(peers[j].from);
      peer_main(k, to[0], from[1]);
    }
    close(to[0]);
    close(from[1]);
    if (pid < 0) {
      close(to[1]);
      close(from[0]);
      break;
    }
    peers[npeers++] = (peer){pid, to[1], from[0], 0};
  }
}

static char peer_status(const peer *p, double seconds) {
  struct pollfd pf = {.fd = p->from, .events = POLLIN};
  char st = 0;
  if (poll(&pf, 1, (int)(seconds * 1000)) == 1 && read(p->from, &st, 1) == 1) return st;
  return 0;
}

static void peer_send(const peer *p, const cmd *m) {
  ssize_t w = write(p->to, m, sizeof *m);
  (void)w;
}

static void peers_stop(void) {
  cmd q = {.op = 'q'};
  for (int k = 0; k < npeers; k++) {
    if (peers[k].pid <= 0) continue;
    peer_send(&peers[k], &q);
    close(peers[k].to);
    int status = 0;
    for (int i = 0; i < 300 && waitpid(peers[k].pid, &status, WNOHANG) == 0; i++) usleep(100000);
    if (waitpid(peers[k].pid, &status, WNOHANG) == 0) {
      kill(peers[k].pid, SIGKILL);
      waitpid(peers[k].pid, &status, 0);
    }
    close(peers[k].from);
  }
}

/* --- scenarios --- */

static const tr_backend *be;
static float *h, *d;

static void one_rank(void) {
  uint8_t id1[TR_COMM_ID_BYTES], id2[TR_COMM_ID_BYTES];
  tr_comm *c = NULL;
  const int me[1] = {0};
  int rc;
  CHECK(be->comm_id(id1) == 0, "comm_id: %s", be->error());
  double t = tr_now();
  rc = be->comm_create(&c, id1, 1, 0, 30);
  CHECK(rc == 0 && c, "1-rank communicator: %s", be->error());
  printf("  1-rank communicator created (and warmed up) in %.2f s\n", tr_now() - t);
  if (c) {
    long bad = allreduce_check(be, c, d, h, N, 0, 1.0f, me, 1, 10, &rc);
    CHECK(bad == 0, "1 rank, sum: %ld wrong (rc %d: %s)", bad, rc, rc ? be->error() : "");
    bad = allreduce_check(be, c, d, h, N, 0, 0.5f, me, 1, 10, &rc);
    CHECK(bad == 0, "1 rank, scale 0.5: %ld wrong (rc %d: %s)", bad, rc, rc ? be->error() : "");
    t = tr_now();
    bad = allreduce_check(be, c, d, h, BIG, 0, 0.5f, me, 1, 10, &rc);
    CHECK(bad == 0, "1 rank, %zu floats in chunks: %ld wrong (rc %d: %s)", BIG, bad, rc, rc ? be->error() : "");
    printf("  %zu floats (%.0f MiB, 3 chunks): %.3f s\n", BIG, BIG * 4.0 / 1048576, tr_now() - t);
    float *tok = be->alloc(sizeof(float));
    rc = tok ? be->comm_allreduce(c, tok, 1, 1.0f, 10) : -1;
    CHECK(rc == 0, "1-float all-reduce (FTAR's commit round): %s", rc ? be->error() : "");
    be->free(tok);
    t = tr_now();
    be->comm_destroy(c, 1); /* a clean shutdown: finalize + destroy */
    printf("  finalized and destroyed in %.2f s\n", tr_now() - t);
    c = NULL;
  }
  /* the next epoch: a new id, a new communicator */
  CHECK(be->comm_id(id2) == 0 && memcmp(id1, id2, sizeof id1) != 0, "a new id differs from the old one");
  rc = be->comm_create(&c, id2, 1, 0, 30);
  CHECK(rc == 0 && c, "re-created communicator: %s", be->error());
  if (c) {
    long bad = allreduce_check(be, c, d, h, N, 0, 1.0f, me, 1, 10, &rc);
    CHECK(bad == 0, "re-created communicator, sum: %ld wrong (rc %d)", bad, rc);
    be->comm_destroy(c, 0);
    c = NULL;
  }
  /* aborted right after creation */
  CHECK(be->comm_id(id1) == 0 && be->comm_create(&c, id1, 1, 0, 30) == 0, "another communicator: %s", be->error());
  t = tr_now();
  be->comm_destroy(c, 0);
  printf("  aborted in %.2f s\n", tr_now() - t);
  c = NULL;

  /* creation deadline: rank 1 never comes */
  CHECK(be->comm_id(id1) == 0, "comm_id: %s", be->error());
  t = tr_now();
  rc = be->comm_create(&c, id1, 2, 0, 2.0);
  double dt = tr_now() - t;
  CHECK(rc == TR_EIO && c == NULL, "2 ranks, one missing: TR_EIO (rc %d after %.2f s: %s)", rc, dt, be->error());
  printf("  creation with a missing rank failed after %.2f s: %s\n", dt, be->error());
  CHECK(be->comm_id(id1) == 0 && be->comm_create(&c, id1, 1, 0, 30) == 0, "a communicator after a failed one: %s",
        be->error());
  if (c) {
    long bad = allreduce_check(be, c, d, h, 1000, 0, 1.0f, me, 1, 10, &rc);
    CHECK(bad == 0, "after a failed creation, sum: %ld wrong (rc %d)", bad, rc);
    be->comm_destroy(c, 0);
  }
}

/* Elements of dev[0..n) (downloaded into h) that are not mul * val(0, .). */
static long count_bad(const float *dev, size_t n, float mul) {
  if (be->download(h, dev, n * sizeof(float))) return -1;
  long bad = 0;
  for (size_t i = 0; i < n; i++)
    if (h[i] != val(0, i) * mul) {
      if (!bad) fprintf(stderr, "  [%zu] = %g, want %g\n", i, (double)h[i], (double)(val(0, i) * mul));
      bad++;
    }
  return bad;
}

/* The overlapped hooks (see the top of the file) on n floats. */
static void overlap_one(tr_comm *c, float *save, size_t n) {
  for (size_t i = 0; i < n; i++) h[i] = val(0, i);
  CHECK(be->upload(d, h, n * sizeof(float)) == 0, "upload: %s", be->error());
  be->scale(d, (int64_t)n, 2.0f); /* queued on the compute stream */
  tr_mark *mk = NULL;
  int rc = be->comm_mark(&mk);
  CHECK(rc == 0 && mk, "comm_mark: %s", be->error());
  double t = tr_now();
  if (!rc) rc = be->comm_copy(save, d, n * sizeof(float), mk);
  if (!rc) rc = be->comm_allreduce_async(c, d, n, 0.5f, mk, 10);
  if (!rc) rc = be->comm_wait(c, 10);
  CHECK(rc == 0, "overlapped all-reduce of %zu floats: %s", n, rc ? be->error() : "");
  be->comm_mark_free(mk);
  printf("  overlapped all-reduce of %zu floats after a compute-stream mark: %.3f s\n", n, tr_now() - t);
  long bad = count_bad(save, n, 2.0f);
  CHECK(bad == 0, "the input copy on the communication stream follows the mark: %ld wrong", bad);
  bad = count_bad(d, n, 1.0f);
  CHECK(bad == 0, "overlapped all-reduce, scale 0.5 of the doubled input: %ld wrong", bad);
  rc = be->comm_copy(d, save, n * sizeof(float), NULL);
  if (!rc) rc = be->comm_wait(NULL, 10);
  CHECK(rc == 0, "restore through the communication stream: %s", rc ? be->error() : "");
  bad = count_bad(d, n, 2.0f);
  CHECK(bad == 0, "restored: %ld wrong", bad);
}

static void overlap_one_rank(void) {
  CHECK(be->comm_mark && be->comm_mark_free && be->comm_copy && be->comm_allreduce_async && be->comm_wait,
        "the cuda table has the overlapped collectives");
  if (!be->comm_mark) return;
  uint8_t id[TR_COMM_ID_BYTES];
  tr_comm *c = NULL;
  CHECK(be->comm_id(id) == 0 && be->comm_create(&c, id, 1, 0, 30) == 0 && c, "1-rank communicator: %s", be->error());
  float *save = be->alloc(BIG * sizeof(float));
  CHECK(save != NULL, "save buffer: %s", be->error());
  if (c && save) {
    overlap_one(c, save, N);
    overlap_one(c, save, BIG);
  }
  be->free(save);
  if (c) be->comm_destroy(c, 1);
}

/* A communicator of the parent (rank 0) and the peers listed (ranks 1..):
 * NULL when it could not be made. */
static tr_comm *group(const int *ks, int nk) {
  cmd m = {.op = 'j', .nranks = nk + 1};
  if (be->comm_id(m.id)) {
    CHECK(0, "comm_id: %s", be->error());
    return NULL;
  }
  for (int i = 0; i < nk; i++) {
    m.rank = i + 1;
    peer_send(&peers[ks[i]], &m);
  }
  tr_comm *c = NULL;
  int rc = be->comm_create(&c, m.id, nk + 1, 0, 30);
  int ok = rc == 0;
  for (int i = 0; i < nk; i++) ok &= peer_status(&peers[ks[i]], 60) == 'y';
  CHECK(ok, "a communicator of %d ranks: %s", nk + 1, rc ? be->error() : "a peer failed");
  if (!ok && c) {
    be->comm_destroy(c, 0);
    c = NULL;
  }
  return c;
}

/* The parent and peers ks all-reduce n floats: the parent's code (peer
 * answers in st[]). */
static int group_allreduce(tr_comm *c, const int *ks, int nk, size_t n, double deadline, long *bad, char *st) {
  cmd m = {.op = 'a', .nranks = nk + 1, .n = n};
  m.who[0] = 0;
  for (int i = 0; i < nk; i++) m.who[i + 1] = ks[i] + 1;
  for (int i = 0; i < nk; i++) peer_send(&peers[ks[i]], &m);
  int rc = 0;
  *bad = allreduce_check(be, c, d, h, n, 0, 1.0f, m.who, nk + 1, deadline, &rc);
  for (int i = 0; i < nk; i++) st[i] = peer_status(&peers[ks[i]], deadline + 30);
  return rc;
}

static void several_ranks(void) {
  int ks[MAXP], nk = 0;
  char st[MAXP];
  long bad;
  for (int k = 0; k < npeers; k++)
    if (peers[k].gpu) ks[nk++] = k;
  printf("  %d ranks (this process and %d peer%s, a GPU each)\n", nk + 1, nk, nk == 1 ? "" : "s");

  /* exact sums, small and chunked */
  tr_comm *c = group(ks, nk);
  if (!c) return;
  for (int s = 0; s < 2; s++) {
    size_t n = s ? BIG : N;
    double t = tr_now();
    int rc = group_allreduce(c, ks, nk, n, 30, &bad, st);
    int peers_ok = 1;
    for (int i = 0; i < nk; i++) peers_ok &= st[i] == 'y';
    CHECK(rc == 0 && bad == 0 && peers_ok, "%d ranks, %zu floats: rc %d, %ld wrong here, peers ok %d (%s)", nk + 1, n,
          rc, bad, peers_ok, rc ? be->error() : "");
    printf("  %d ranks, %zu floats: %.3f s\n", nk + 1, n, tr_now() - t);
  }

  /* a stalled peer: the last one stays alive and takes no part */
  cmd stall = {.op = 's'};
  peer_send(&peers[ks[nk - 1]], &stall);
  CHECK(peer_status(&peers[ks[nk - 1]], 30) == 'k', "the stalled peer answers");
  double t = tr_now();
  int rc = group_allreduce(c, ks, nk - 1, N, 2.0, &bad, st);
  CHECK(rc == TR_EIO, "a stalled peer: the watchdog aborts with TR_EIO (rc %d: %s)", rc, be->error());
  printf("  stalled peer: aborted after %.2f s: %s\n", tr_now() - t, be->error());
  t = tr_now();
  rc = be->comm_allreduce(c, d, N, 1.0f, 2.0);
  CHECK(rc == TR_EIO, "an aborted communicator fails at once (rc %d, %.3f s)", rc, tr_now() - t);
  be->comm_destroy(c, 0);
  c = group(ks, nk); /* everyone again, the stalled peer included (it joins afresh) */
  if (!c) return;

  /* a killed peer: dies after it joined, before the collective */
  int victim = ks[nk - 1];
  kill(peers[victim].pid, SIGKILL);
  waitpid(peers[victim].pid, NULL, 0);
  peers[victim].pid = -1;
  peers[victim].gpu = 0;
  t = tr_now();
  rc = group_allreduce(c, ks, nk - 1, N, 5.0, &bad, st);
  CHECK(rc == TR_EIO, "a killed peer: the all-reduce fails with TR_EIO, not a device error (rc %d: %s)", rc,
        be->error());
  printf("  killed peer: failed after %.2f s: %s\n", tr_now() - t, be->error());
  be->comm_destroy(c, 0);
  /* the survivors go on with a communicator of their own */
  c = group(ks, nk - 1);
  if (!c) return;
  rc = group_allreduce(c, ks, nk - 1, N, 30, &bad, st);
  int peers_ok = 1;
  for (int i = 0; i < nk - 1; i++) peers_ok &= st[i] == 'y';
  CHECK(rc == 0 && bad == 0 && peers_ok, "the survivors of a kill sum exactly: rc %d, %ld wrong (%s)", rc, bad,
        rc ? be->error() : "");
  be->comm_destroy(c, 0);
}

int main(void) {
  setvbuf(stdout, NULL, _IONBF, 0);
  signal(SIGPIPE, SIG_IGN); /* a peer without a GPU has gone */
  peers_start(); /* before this process touches CUDA */
  be = backend_get("cuda", 0);
  if (!be) {
    printf("test_nccl: SKIP: %s\n", tr_error());
    peers_stop();
    return 77;
  }
  printf("  %s\n", be->describe());
  CHECK(be->comm_id && be->comm_create && be->comm_allreduce && be->comm_destroy,
        "the cuda table has collectives (a plugin built without NCCL has none)");
  h = malloc(BIG * sizeof(float));
  d = be->alloc(BIG * sizeof(float));
  CHECK(h && d, "buffers: %s", be->error());
  if (!h || !d || !be->comm_id) return check_report("test_nccl");

  one_rank();
  overlap_one_rank();
  int gpus = 0;
  for (int k = 0; k < npeers; k++) gpus += peers[k].gpu = peer_status(&peers[k], 60) == 'g';
  if (gpus == 0) printf("  several ranks: skipped (one GPU visible)\n");
  else several_ranks();

  peers_stop();
  be->free(d);
  free(h);
  return check_report("test_nccl");
}
