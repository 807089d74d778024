/* test_nccl.c — the CUDA backend's NCCL communicators (ext/cuda/comm.cu),
 * through the backend table, as FTAR's device data plane uses them.
 *
 * One GPU, one rank:
 *   - a communicator of 1 rank: all-reduce is the identity (exact), with
 *     scale 0.5 it halves (exact), a 1-float all-reduce (FTAR's commit
 *     round) works;
 *   - destroyed mid-life (finalize path) and re-created from a new id, as
 *     for a new epoch: works again; destroyed right after creation too;
 *   - the creation deadline: a communicator of 2 ranks whose other rank
 *     never comes fails with TR_EIO within its timeout + 3 s, and the next
 *     communicator still works.
 * Two GPUs (a forked second rank on the second visible device; skipped
 * with a note where there is one): a 2-rank all-reduce sums exactly; then
 * the second rank stops taking part and the first rank's all-reduce is
 * aborted by the watchdog within deadline + 3 s with TR_EIO; a further call
 * on it fails at once; a fresh 1-rank communicator works afterwards.
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

static float val(int who, size_t i) { return (float)((long)((i * 131 + (size_t)who * 977) % 2001) - 1000); }

/* Uploads val(who, .), all-reduces with scale, downloads; returns the
 * number of elements that differ from want(i) (-1 on an error). */
static long allreduce_check(const tr_backend *be, tr_comm *c, float *d, float *h, size_t n, int who, float scale,
                            int nranks, double deadline, int *rc_out) {
  for (size_t i = 0; i < n; i++) h[i] = val(who, i);
  if (be->upload(d, h, n * sizeof(float))) return -1;
  int rc = be->comm_allreduce(c, d, n, scale, deadline);
  if (rc_out) *rc_out = rc;
  if (rc) return -1;
  if (be->download(h, d, n * sizeof(float))) return -1;
  long bad = 0;
  for (size_t i = 0; i < n; i++) {
    float want = 0;
    for (int r = 0; r < nranks; r++) want += val(r, i);
    if (h[i] != want * scale) {
      if (!bad) fprintf(stderr, "  [%zu] = %g, want %g\n", i, (double)h[i], (double)(want * scale));
      bad++;
    }
  }
  return bad;
}

/* --- the second rank, on the second GPU (forked before CUDA starts here) --- */

static int peer_to[2], peer_from[2]; /* parent -> child: id; child -> parent: status bytes */

/* Says 'g' (a GPU) or 'n' (none), then waits for an id, joins as rank 1
 * of 2, all-reduces once, says 'y' (exact) or 'b', and stops taking part. */
static void peer_main(void) {
  uint8_t id[TR_COMM_ID_BYTES];
  char st = 'x';
  const char *vis = getenv("CUDA_VISIBLE_DEVICES");
  char second[64] = "1";
  if (vis && *vis) { /* the second entry of the caller's list */
    const char *comma = strchr(vis, ',');
    if (!comma) second[0] = 0;
    else snprintf(second, sizeof second, "%.*s", (int)strcspn(comma + 1, ","), comma + 1);
  }
  const tr_backend *be = second[0] && setenv("CUDA_VISIBLE_DEVICES", second, 1) == 0 ? backend_get("cuda", 0) : NULL;
  st = be ? 'g' : 'n'; /* no second GPU: the parent skips */
  ssize_t w = write(peer_from[1], &st, 1);
  if (!be) _exit(0);
  ssize_t got = read(peer_to[0], id, sizeof id);
  if (got != (ssize_t)sizeof id) _exit(0); /* the parent skipped */
  tr_comm *c = NULL;
  if (be->comm_create(&c, id, 2, 1, 30)) {
    st = 'c';
    w = write(peer_from[1], &st, 1);
    _exit(0);
  }
  float *h = malloc(N * sizeof(float)), *d = be->alloc(N * sizeof(float));
  long bad = d && h ? allreduce_check(be, c, d, h, N, 1, 1.0f, 2, 30, NULL) : -1;
  st = bad == 0 ? 'y' : 'b';
  w = write(peer_from[1], &st, 1);
  (void)w;
  /* now stop taking part: wait (bounded) for the parent to say it is done */
  struct pollfd pf = {.fd = peer_to[0], .events = POLLIN};
  poll(&pf, 1, 60000);
  be->comm_destroy(c, 0);
  _exit(0);
}

static char peer_status(double seconds) {
  struct pollfd pf = {.fd = peer_from[0], .events = POLLIN};
  char st = 0;
  if (poll(&pf, 1, (int)(seconds * 1000)) == 1 && read(peer_from[0], &st, 1) == 1) return st;
  return 0;
}

int main(void) {
  setvbuf(stdout, NULL, _IONBF, 0);
  pid_t peer = -1;
  if (pipe(peer_to) == 0 && pipe(peer_from) == 0) {
    peer = fork();
    if (peer == 0) {
      close(peer_to[1]);
      close(peer_from[0]);
      peer_main();
    }
    close(peer_to[0]);
    close(peer_from[1]);
  }
  const tr_backend *be = backend_get("cuda", 0);
  if (!be) {
    printf("test_nccl: SKIP: %s\n", tr_error());
    if (peer > 0) {
      close(peer_to[1]);
      waitpid(peer, NULL, 0);
    }
    return 77;
  }
  printf("  %s\n", be->describe());
  CHECK(be->comm_id && be->comm_create && be->comm_allreduce && be->comm_destroy, "the cuda table has collectives");
  float *h = malloc(N * sizeof(float)), *d = be->alloc(N * sizeof(float)), *tok = be->alloc(sizeof(float));
  CHECK(h && d && tok, "buffers: %s", be->error());
  if (!h || !d || !tok) return check_report("test_nccl");

  /* one rank */
  uint8_t id1[TR_COMM_ID_BYTES], id2[TR_COMM_ID_BYTES];
  tr_comm *c = NULL;
  CHECK(be->comm_id(id1) == 0, "comm_id: %s", be->error());
  double t = tr_now();
  int rc = be->comm_create(&c, id1, 1, 0, 30);
  CHECK(rc == 0 && c, "1-rank communicator: %s", be->error());
  printf("  1-rank communicator created in %.2f s\n", tr_now() - t);
  if (c) {
    long bad = allreduce_check(be, c, d, h, N, 0, 1.0f, 1, 10, &rc);
    CHECK(bad == 0, "1 rank, sum: %ld wrong (rc %d: %s)", bad, rc, rc ? be->error() : "");
    bad = allreduce_check(be, c, d, h, N, 0, 0.5f, 1, 10, &rc);
    CHECK(bad == 0, "1 rank, scale 0.5: %ld wrong (rc %d: %s)", bad, rc, rc ? be->error() : "");
    rc = be->comm_allreduce(c, tok, 1, 1.0f, 10);
    CHECK(rc == 0, "1-float all-reduce (FTAR's commit round): %s", rc ? be->error() : "");
    t = tr_now();
    be->comm_destroy(c, 1); /* mid-life: finalize + destroy */
    printf("  destroyed in %.2f s\n", tr_now() - t);
    c = NULL;
  }
  /* the next epoch: a new id, a new communicator */
  CHECK(be->comm_id(id2) == 0 && memcmp(id1, id2, sizeof id1) != 0, "a new id differs from the old one");
  rc = be->comm_create(&c, id2, 1, 0, 30);
  CHECK(rc == 0 && c, "re-created communicator: %s", be->error());
  if (c) {
    long bad = allreduce_check(be, c, d, h, N, 0, 1.0f, 1, 10, &rc);
    CHECK(bad == 0, "re-created communicator, sum: %ld wrong (rc %d)", bad, rc);
    be->comm_destroy(c, 0);
    c = NULL;
  }
  /* destroyed right after creation */
  CHECK(be->comm_id(id1) == 0 && be->comm_create(&c, id1, 1, 0, 30) == 0, "another communicator: %s", be->error());
  be->comm_destroy(c, 0);
  c = NULL;

  /* creation deadline: rank 1 never comes */
  CHECK(be->comm_id(id1) == 0, "comm_id: %s", be->error());
  t = tr_now();
  rc = be->comm_create(&c, id1, 2, 0, 2.0);
  double dt = tr_now() - t;
  CHECK(rc == TR_EIO && c == NULL && dt < 2.0 + 3.0, "2 ranks, one missing: TR_EIO after %.2f s (rc %d: %s)", dt, rc,
        be->error());
  printf("  creation with a missing rank failed after %.2f s: %s\n", dt, be->error());
  CHECK(be->comm_id(id1) == 0 && be->comm_create(&c, id1, 1, 0, 30) == 0, "a communicator after a failed one: %s",
        be->error());
  if (c) {
    long bad = allreduce_check(be, c, d, h, 1000, 0, 1.0f, 1, 10, &rc);
    CHECK(bad == 0, "after a failed creation, sum: %ld wrong (rc %d)", bad, rc);
    be->comm_destroy(c, 0);
    c = NULL;
  }

  /* two GPUs: the watchdog */
  char st = peer > 0 ? peer_status(60) : 0;
  if (st != 'g') {
    printf("  2-rank watchdog: skipped (no second GPU for a peer rank)\n");
  } else {
    CHECK(be->comm_id(id1) == 0, "comm_id: %s", be->error());
    ssize_t w = write(peer_to[1], id1, sizeof id1);
    (void)w;
    rc = be->comm_create(&c, id1, 2, 0, 30);
    CHECK(rc == 0, "2-rank communicator: %s", be->error());
    {
      long bad = c ? allreduce_check(be, c, d, h, N, 0, 1.0f, 2, 30, &rc) : -1;
      st = peer_status(30);
      CHECK(bad == 0 && st == 'y', "2 ranks, sum: %ld wrong here, peer says '%c'", bad, st ? st : '?');
      if (c) {
        /* the peer no longer takes part: the watchdog aborts after the deadline */
        t = tr_now();
        rc = be->comm_allreduce(c, d, N, 1.0f, 2.0);
        dt = tr_now() - t;
        CHECK(rc == TR_EIO && dt < 2.0 + 3.0, "a stalled peer: TR_EIO after %.2f s (rc %d: %s)", dt, rc, be->error());
        printf("  stalled peer: aborted after %.2f s: %s\n", dt, be->error());
        t = tr_now();
        rc = be->comm_allreduce(c, d, N, 1.0f, 2.0);
        CHECK(rc == TR_EIO && tr_now() - t < 0.1, "an aborted communicator fails at once (rc %d)", rc);
        be->comm_destroy(c, 0);
        c = NULL;
        CHECK(be->comm_id(id2) == 0 && be->comm_create(&c, id2, 1, 0, 30) == 0,
              "a fresh communicator after an abort: %s", be->error());
        if (c) {
          bad = allreduce_check(be, c, d, h, N, 0, 1.0f, 1, 10, &rc);
          CHECK(bad == 0, "after an abort, sum: %ld wrong (rc %d)", bad, rc);
          be->comm_destroy(c, 0);
          c = NULL;
        }
      }
    }
  }
  if (peer > 0) {
    close(peer_to[1]);
    int status = 0;
    for (int i = 0; i < 700 && waitpid(peer, &status, WNOHANG) == 0; i++) usleep(100000);
    if (waitpid(peer, &status, WNOHANG) == 0) {
      kill(peer, SIGKILL);
      waitpid(peer, &status, 0);
    }
  }
  be->free(tok);
  be->free(d);
  free(h);
  return check_report("test_nccl");
}
