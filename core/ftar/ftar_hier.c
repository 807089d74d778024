/* ftar_hier.c — FTAR's hierarchical plane: members on one host reduce
 * through shared memory first, one ring runs across hosts, the result goes
 * back within each host (ftar_internal.h's ftar_plane); and the grid, for
 * an even number of members each on a host of its own (pairs, then
 * columns: see "the grid" below).
 *
 * The epoch's members (ordered by slot) are grouped by the host they
 * advertise; a host's leader is its first (lowest slot) member. One
 * attempt, each phase a pass of the ring engine (ftar_ring.c) over its own
 * ring level's links, the phase number in every frame's flags:
 *   1  local ring (level 1, shared memory): reduce-scatter + all-gather, SUM
 *   7  leaders' tokens around their ring (no frames): every leader is past
 *      phase 1, however long another host's local reduce took
 *   2  leaders' ring (level 2, TCP across hosts): the same over the hosts'
 *      sums; the leader then divides once by the epoch's member count for
 *      MEAN (every leader divides the same bits: all members get them)
 *   3  local broadcast: the leader's result along the chain leader -> 2nd
 *      -> .. -> last (each member passes a frame on once it arrived)
 *   4  local tokens around the ring: the leader learns its host is full
 *   5  leaders' tokens around their ring: every leader learns every host is
 *   6  local release along the chain: the others learn it too
 * Phases 7 and 5 wait, legitimately, on other hosts' local phases (whose
 * length grows with the buffer and the host's member count, and is zero on
 * a host alone): they have no "peer stalled" limit (ftar_pass.no_stall), a
 * lost peer ends them through EOF, the coordinator's abort or the call's
 * timeout; after phase 7 the leaders' ring runs in step and keeps it.
 * So a member returns only when every member of the epoch holds the full
 * result, as after the flat ring's last commit token, and the coordinator
 * resolves an abort the same way (COMMIT if anyone could have returned).
 * A host with one member has no local ring (its member is its leader).
 * Cross-host bytes per leader: 2(H-1)/H * N for H hosts (the flat ring
 * sends 2(p-1)/p * N over every cross-host link).
 *
 * Faults: any pass that fails closes every level's links (so the others'
 * passes fail too) and aborts the attempt; restore puts the input back
 * exactly: the attempt's first reduce (phase 1, or phase 2 on a host
 * alone) saves into in_copy each element it overwrites, as the flat ring
 * does, and the passes after it save nothing (every element was saved once
 * the first reduce completed); ftar_collective redoes the
 * collective in the next epoch, where the hierarchy is recomputed.
 * "full" on an abort: this member holds the final result (the leader after
 * phase 2, the others after phase 3).
 *
 * When: opts.hier -1 (auto): the epoch spans >= 2 hosts and some host has
 * >= 2 members; 1: some host has >= 2 members; 0: never. Otherwise, and per
 * attempt (a redo may find another shape), the flat ring plane runs. Every
 * member must use the same opts.hier. A bucketed call (ftar_allreduce_start)
 * runs phases 1, 7, 2 and 3 once per wave of buckets, from the end of buf
 * as the producer finishes them, then 4-6 once (see "waves"): the
 * cross-host part of a wave overlaps with the producer writing the next.
 *
 * Tried and not kept: the two-member exchange (ftar_ring.c) for the local
 * and the leaders' passes of 2 members on small buckets (one hop instead
 * of two each): across 2 test hosts x 2 at 1 Gbit, hier 64 KiB / 256 KiB /
 * 1 MiB 0.087 / 0.101 / 0.100 GB/s busbw with it, 0.097 / 0.093 / 0.094
 * without (best of 3, one run each, load 1-4): no gain to carry it for.
 *
 * Not here: moving frames (ftar_ring.c), links (ftar_port.c), the control
 * round (ftar_collective.c). Called by: ftar_allreduce (ftar_collective.c)
 * and ftar_async.c through ftar_host_plane_new.
 */
#include <poll.h>
#include <pthread.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ftar.h"
#include "ftar_internal.h"
#include "ftar_member_internal.h"
#include "util.h"

/* --- the epoch's hosts --- */

/* This member's place in the hierarchy of run_ep. */
typedef struct {
  int leader;   /* this member leads its host */
  int nl, rl;   /* members of this host, our rank among them */
  int nh, rh;   /* leaders (= hosts), our rank among them (leaders only) */
  peer local[FTAR_MAX_MEMBERS], leaders[FTAR_MAX_MEMBERS];
} topo;

/* The index of the first member on mem[i]'s host. */
static int host_of(const peer *mem, int i) {
  for (int k = 0; k < i; k++)
    if (strcmp(mem[k].host, mem[i].host) == 0) return k;
  return i;
}

/* first[i]: host_of(run_mem, i); returns the number of hosts, *most the
 * members on the most populated one. */
static int host_shape(const ftar_member *m, int *first, int *most) {
  int n = m->run_n, hosts = 0, count[FTAR_MAX_MEMBERS];
  *most = 0;
  for (int i = 0; i < n; i++) {
    first[i] = host_of(m->run_mem, i);
    count[i] = 0;
    count[first[i]]++;
    hosts += first[i] == i;
  }
  for (int i = 0; i < n; i++)
    if (count[i] > *most) *most = count[i];
  return hosts;
}

static void topo_build(const ftar_member *m, const int *first, topo *t) {
  const peer *mem = m->run_mem;
  int n = m->run_n, me = m->run_r;
  memset(t, 0, offsetof(topo, local));
  int mine = first[me];
  for (int i = 0; i < n; i++) {
    if (first[i] == i) {
      if (i == mine) t->rh = t->nh;
      t->leaders[t->nh++] = mem[i];
    }
    if (first[i] == mine) {
      if (i == me) t->rl = t->nl;
      t->local[t->nl++] = mem[i];
    }
  }
  t->leader = t->rl == 0;
}

static int hier_wanted(const ftar_member *m, int hosts, int most) {
  if (m->o.hier == 0 || most < 2) return 0;
  return m->o.hier > 0 || hosts >= 2;
}

/* --- the plane --- */

typedef struct {
  ftar_plane base; /* first: a ftar_plane * is a host_plane * */
  ftar_plane *flat;
  float *buf;
  size_t n;
  ftar_op op;
  const ftar_ready *rd;
  size_t bucket;
  ftar_ring_run *first; /* the wave's first reduce (its undo log restores buf[wave_off..)) */
  ftar_ring_run *rr;    /* the other passes; NULL until the first hierarchical attempt, as first and t */
  topo *t;
  size_t wave_off;   /* where the wave hp->first's undo log covers starts in buf */
  size_t saved_from; /* buf[saved_from..n) was saved whole into in_copy by the attempt's done waves */
} host_plane;

/* What one attempt carries from phase to phase. */
typedef struct {
  uint64_t seq;
  double t_end;
  int full;         /* buf holds the final result */
  uint32_t frames;  /* data frames received so far */
  size_t off, len;  /* the wave: buf[off..off+len) */
  int last;         /* the attempt's last wave */
  char *why;
  size_t why_len;
} attempt;

/* --- waves ---
 * A bucketed call (ftar_allreduce_start) runs the attempt's reduce phases
 * once per wave of whole buckets, from the end of buf as the producer
 * finishes them: a wave is its buckets' local reduce (bucket by bucket as
 * they become final), the leaders' ready tokens, the leaders' ring and the
 * local broadcast (the grid: pair reduce-scatter, column ready tokens,
 * column reduce, pair all-gather); the commit phases run once after the
 * last wave. So the cross-host part of wave w runs while the producer
 * (backward) still writes wave w+1; with one wave it waited for the last
 * bucket. Across 2 test hosts x 2 at 1 Gbit, 1 MiB buckets, a producer
 * about as slow as the links (bench/ftar_waves_bench.sh, best of 3): the
 * exposed time 2.91x (4 MiB) and 4.47x (16 MiB) smaller than with one
 * wave; the grid on 4 hosts x 1, 2.85x and 4.89x. A wave costs a token
 * round and a pass startup per level: with nothing to overlap, unshaped
 * links and 256 KiB buckets, a wave per bucket made 4 MiB 1.25x slower,
 * so a wave holds at least WAVE_MIN floats (1 MiB): then 0.98x / 1.06x.
 * Every member cuts the same waves (they depend only on n, bucket and
 * WAVE_MIN). Faults: each wave's first reduce saves what it overwrites
 * (hp->first's undo log, reset per wave), a done wave's range was saved
 * whole (hp->saved_from), restore puts both back.
 * TRANSOM_FTAR_WAVE_MIN=F (floats) overrides WAVE_MIN, 0 keeps one wave
 * (A/B benches, tests; every member must agree). */
#define WAVE_MIN ((size_t)1 << 18)
static size_t wave_min = WAVE_MIN;
static pthread_once_t waves_once = PTHREAD_ONCE_INIT;
static void waves_read(void) {
  const char *v = getenv("TRANSOM_FTAR_WAVE_MIN");
  char *end;
  if (v && *v >= '0' && *v <= '9') { /* digits only: anything else keeps WAVE_MIN */
    unsigned long long x = strtoull(v, &end, 10);
    if (!*end) wave_min = (size_t)x;
  }
}

/* Floats a wave: whole buckets, at least wave_min; 0: one wave. */
static size_t wave_floats(const host_plane *hp) {
  pthread_once(&waves_once, waves_read);
  if (!wave_min || !hp->rd || !hp->bucket || hp->bucket >= hp->n) return 0;
  size_t k = (wave_min + hp->bucket - 1) / hp->bucket;
  return k * hp->bucket < hp->n ? k * hp->bucket : 0;
}

static size_t wave_count(const host_plane *hp) {
  size_t W = wave_floats(hp);
  return W ? (hp->n + W - 1) / W : 1;
}

/* Wave w of nw: its buckets from the end of buf (ftar_ring.c's geometry:
 * bucket b is buf[n-(b+1)B, n-bB), the last one short). */
static void wave_set(const host_plane *hp, size_t w, size_t nw, attempt *at) {
  size_t W = wave_floats(hp), hi = hp->n - w * W;
  at->last = w + 1 == nw;
  at->off = W && hi > W ? hi - W : 0;
  at->len = hi - at->off;
}

/* One phase: pass a (level, kind, phase; save, bucket and rd when it is
 * the first reduce) through rr. The caller's op goes into every frame, so
 * members that disagree on it abort as on the flat ring (the passes only
 * add; the leader divides for MEAN). FTAR_PLANE_*, why prefixed. */
static int phase(host_plane *hp, ftar_member *m, attempt *at, ftar_ring_run *rr, ftar_pass a) {
  static const char *names[] = {"",
                                "local reduce",
                                "leaders' reduce",
                                "local broadcast",
                                "local commit",
                                "leaders' commit",
                                "local release",
                                "leaders' ready",
                                "pair reduce-scatter",
                                "column ready",
                                "column reduce",
                                "pair all-gather",
                                "pair commit",
                                "column commit"};
  int ph = a.phase;
  a.buf = hp->buf + at->off;
  a.n = a.kind == FTAR_PASS_TOKENS || a.kind == FTAR_PASS_RELEASE ? 0 : at->len;
  if (a.save) a.save += at->off;
  a.rd_off = at->off;
  a.op = hp->op;
  a.frames_before = at->frames;
  int full = 0;
  uint32_t got = 0;
  char why[256];
  int r = ftar_ring_pass(m, rr, &a, at->seq, at->t_end, &full, why, sizeof why, &got);
  at->frames += got;
  if (r != FTAR_PLANE_DONE) snprintf(at->why, at->why_len, "phase %d (%s): %s", ph, names[ph], why);
  return r;
}

/* A bucketed call on a host alone: the wave final before the leaders'
 * ring (which takes it whole) moves it. */
static int wait_final(ftar_member *m, const ftar_ready *rd, attempt *at) {
  while (rd && atomic_load_explicit(&rd->from, memory_order_acquire) > at->off) {
    pthread_mutex_lock(&m->mu);
    int failed = m->failed, aborted = m->abort_ep > m->run_ep;
    pthread_mutex_unlock(&m->mu);
    if (failed) {
      snprintf(at->why, at->why_len, "control link down");
      return FTAR_PLANE_FATAL;
    }
    if (aborted) {
      snprintf(at->why, at->why_len, "a newer epoch aborts epoch %llu", (unsigned long long)m->run_ep);
      return FTAR_PLANE_ABORT;
    }
    if (tr_now() > at->t_end) {
      snprintf(at->why, at->why_len, "timed out after %.1f s waiting for the buffer", m->o.timeout);
      return FTAR_PLANE_FATAL;
    }
    struct pollfd p = {.fd = m->wake[0], .events = POLLIN};
    if (poll(&p, 1, 50) > 0) ftar_drain_fd(m->wake[0]);
  }
  return FTAR_PLANE_DONE;
}

static void set_views(const host_plane *hp, ftar_member *m) {
  const topo *t = hp->t;
  if (t->nl >= 2) ftar_links_view(&m->lk[FTAR_LEVEL_LOCAL], m->run_ep, t->local, t->nl, t->rl);
  if (t->leader && t->nh >= 2) ftar_links_view(&m->lk[FTAR_LEVEL_LEADERS], m->run_ep, t->leaders, t->nh, t->rh);
}

/* Phases 1-3 over the wave: every member of the host ends with the epoch's
 * result there. The first reduce saves the input it overwrites into
 * in_copy (hp->first's undo log; every element once it completes); the
 * passes after it save nothing. The local reduce takes buckets as the
 * producer finishes them. */
static int reduce_phases(host_plane *hp, ftar_member *m, attempt *at) {
  const topo *t = hp->t;
  int local = t->nl >= 2, across = t->leader && t->nh >= 2, r;
  ftar_pass p1 = {.level = FTAR_LEVEL_LOCAL, .kind = FTAR_PASS_REDUCE, .phase = 1},
            p2 = {.level = FTAR_LEVEL_LEADERS, .kind = FTAR_PASS_REDUCE, .phase = 2};
  if (local) {
    p1.save = m->in_copy;
    p1.bucket = hp->bucket;
    p1.rd = hp->rd;
    hp->wave_off = at->off; /* hp->first's log is this wave's from here on */
    if ((r = phase(hp, m, at, hp->first, p1)) != FTAR_PLANE_DONE) return r;
  } else {
    if ((r = wait_final(m, hp->rd, at)) != FTAR_PLANE_DONE) return r;
    p2.save = m->in_copy;
  }
  if (across) { /* every leader past its local reduce first: the leaders' ring then runs in step */
    ftar_pass p7 = {.level = FTAR_LEVEL_LEADERS, .kind = FTAR_PASS_TOKENS, .phase = 7, .no_stall = 1};
    if ((r = phase(hp, m, at, hp->rr, p7)) != FTAR_PLANE_DONE) return r;
    if (!local) hp->wave_off = at->off; /* hp->first's log is this wave's from here on */
    if ((r = phase(hp, m, at, local ? hp->rr : hp->first, p2)) != FTAR_PLANE_DONE) return r;
  }
  if (t->leader) {
    if (hp->op == FTAR_MEAN) { /* once, on bits every leader holds alike */
      float d = (float)m->run_n, *x = hp->buf + at->off;
      for (size_t i = 0; i < at->len; i++) x[i] /= d;
    }
    at->full = at->last;
  }
  ftar_pass p3 = {.level = FTAR_LEVEL_LOCAL, .kind = FTAR_PASS_BCAST, .phase = 3};
  if (local && (r = phase(hp, m, at, hp->rr, p3)) != FTAR_PLANE_DONE) return r;
  at->full = at->last;
  return FTAR_PLANE_DONE;
}

/* Phases 4-6: return only once every member of the epoch is full. */
static int commit_phases(host_plane *hp, ftar_member *m, attempt *at) {
  const topo *t = hp->t;
  int local = t->nl >= 2, across = t->leader && t->nh >= 2, r;
  ftar_pass p4 = {.level = FTAR_LEVEL_LOCAL, .kind = FTAR_PASS_TOKENS, .phase = 4},
            p5 = {.level = FTAR_LEVEL_LEADERS, .kind = FTAR_PASS_TOKENS, .phase = 5, .no_stall = 1},
            p6 = {.level = FTAR_LEVEL_LOCAL, .kind = FTAR_PASS_RELEASE, .phase = 6};
  if (local && (r = phase(hp, m, at, hp->rr, p4)) != FTAR_PLANE_DONE) return r;
  if (across && (r = phase(hp, m, at, hp->rr, p5)) != FTAR_PLANE_DONE) return r;
  if (local && (r = phase(hp, m, at, hp->rr, p6)) != FTAR_PLANE_DONE) return r;
  return FTAR_PLANE_DONE;
}

/* Every wave of the attempt through one_wave (the hierarchy's or the
 * grid's reduce phases); a done wave's range was saved whole. */
static int run_waves(host_plane *hp, ftar_member *m, attempt *at,
                     int (*one_wave)(host_plane *, ftar_member *, attempt *)) {
  size_t nw = wave_count(hp);
  hp->saved_from = hp->n;
  for (size_t w = 0; w < nw; w++) {
    wave_set(hp, w, nw, at);
    int r = one_wave(hp, m, at);
    if (r != FTAR_PLANE_DONE) return r;
    hp->saved_from = at->off;
  }
  return FTAR_PLANE_DONE;
}

static int hier_attempt(host_plane *hp, ftar_member *m, attempt *at) {
  int r = ftar_in_copy_reserve(m, hp->n);
  if (r) return r;
  set_views(hp, m);
  if ((r = run_waves(hp, m, at, reduce_phases)) != FTAR_PLANE_DONE) return r;
  if ((r = commit_phases(hp, m, at)) != FTAR_PLANE_DONE) return r;
  m->st.hier_collectives++;
  m->st.waves += wave_count(hp);
  return FTAR_PLANE_DONE;
}

/* --- the grid: an even number >= 4 of members, every link TCP ---
 * Pairs (ranks 2i, 2i+1) and columns (the ranks of one parity): a pair
 * reduce-scatter leaves each member the sum of its pair over half of every
 * bucket; a ring over the column (ranks of the same parity, which hold the
 * same half) reduces that half across the pairs and divides it once for
 * MEAN; a pair all-gather hands each member the other half. Then pair
 * tokens and column tokens: a member returns only when every pair is full
 * (each pair has a member in every column). Links: the pair on level 1,
 * the column on level 2, as the hierarchy's. The same bytes per member as
 * the flat ring, 2(p-1)/p * N, in 2 + 2(p/2-1) data steps instead of
 * 2(p-1) (4 ranks: 4 instead of 6), plus 1 + (p/2-1) token hops instead of
 * p-1: on 4 ranks sharing 2 cores, fewer hand-offs of the core (OpenMPI's
 * Rabenseifner all-reduce, recursive halving then doubling, is the same
 * shape at 4 ranks). Faults as the hierarchy: the pair reduce-scatter
 * saves what it overwrites, the later passes save nothing, restore through
 * hp->first. Buckets: phases 8-11 run once per wave (above), the pair
 * reduce-scatter bucket by bucket as the producer finishes them, a column
 * token round (no stall limit) then waits for every pair to be through;
 * 12 and 13 once after the last wave.
 * When: opts.hier -1 (auto), an even number >= 4 of members, each on a
 * host of its own (every link TCP), decided from what every member knows
 * alike (the advertised hosts; not opts.shm, which members may set
 * differently: a member that chose otherwise would leave the others
 * waiting on links it never opens). Where a host's members share memory,
 * the flat ring (or the hierarchy) stays: there a hop costs no syscall,
 * and the grid's passes, each waiting for the last, lost to the flat
 * ring's pipelined steps (4 ranks on 2 cores, 64 KiB: 88 vs 65 us best of 5; 1 and 4 MiB
 * even), while over TCP it won at every size (64 KiB 121 vs 170 us, 1 MiB
 * 675 vs 860, 4 MiB 4331 vs 5222; best of 5 interleaved, load 1).
 * (Measured over loopback TCP, each rank advertising its own 127.0.0.k;
 * bench/ftar_vs_mpi.sh's "TCP grid/flat ring" later: 0.89x-1.31x at
 * 64 KiB, 1.08x-1.23x at 1 MiB, 0.99x-1.15x at 4 MiB, 1.03x at 16 MiB.)
 * Tried and not kept: small buckets as a pair exchange then a column
 * exchange of whole buckets (recursive doubling: 2 data hops instead of 4,
 * twice the bytes a hop): no faster than the halves at 64 KiB (best 102.6
 * vs 103.9 us, median 145.8 vs 108.3) and slower at 512 KiB (383 vs 335);
 * 4 ranks, best of 5 interleaved, load 0-1.
 * opts.hier 0 (the flat ring forced) turns it off; every member must agree
 * on opts.hier. */
static int grid_wanted(const ftar_member *m, int hosts) {
  return m->o.hier < 0 && m->run_n >= 4 && m->run_n % 2 == 0 && hosts == m->run_n;
}

static void grid_views(host_plane *hp, ftar_member *m) {
  topo *t = hp->t;
  int n = m->run_n, me = m->run_r;
  memset(t, 0, offsetof(topo, local));
  t->nl = 2;
  t->rl = me % 2;
  t->nh = n / 2;
  t->rh = me / 2;
  t->local[0] = m->run_mem[me - t->rl];
  t->local[1] = m->run_mem[me - t->rl + 1];
  for (int k = 0; k < t->nh; k++) t->leaders[k] = m->run_mem[2 * k + t->rl];
  ftar_links_view(&m->lk[FTAR_LEVEL_LOCAL], m->run_ep, t->local, 2, t->rl);
  ftar_links_view(&m->lk[FTAR_LEVEL_LEADERS], m->run_ep, t->leaders, t->nh, t->rh);
}

/* Phases 8-11 over the wave: every member ends with the epoch's result
 * there. */
static int grid_wave(host_plane *hp, ftar_member *m, attempt *at) {
  int r, half = (hp->t->rl + 1) % 2; /* what the pair's reduce-scatter leaves us */
  ftar_pass rs = {.level = FTAR_LEVEL_LOCAL, .kind = FTAR_PASS_RS, .phase = 8, .save = m->in_copy,
                  .bucket = hp->bucket, .rd = hp->rd},
            ready = {.level = FTAR_LEVEL_LEADERS, .kind = FTAR_PASS_TOKENS, .phase = 9, .no_stall = 1},
            col = {.level = FTAR_LEVEL_LEADERS, .kind = FTAR_PASS_REDUCE, .phase = 10, .bucket = hp->bucket,
                   .outer_p = 2, .outer_c = half, .div = hp->op == FTAR_MEAN ? (float)m->run_n : 0},
            ag = {.level = FTAR_LEVEL_LOCAL, .kind = FTAR_PASS_AG, .phase = 11, .bucket = hp->bucket};
  hp->wave_off = at->off;
  if ((r = phase(hp, m, at, hp->first, rs)) != FTAR_PLANE_DONE) return r;
  if (hp->rd && (r = phase(hp, m, at, hp->rr, ready)) != FTAR_PLANE_DONE) return r;
  if ((r = phase(hp, m, at, hp->rr, col)) != FTAR_PLANE_DONE) return r;
  if ((r = phase(hp, m, at, hp->rr, ag)) != FTAR_PLANE_DONE) return r;
  at->full = at->last;
  return FTAR_PLANE_DONE;
}

static int grid_attempt(host_plane *hp, ftar_member *m, attempt *at) {
  int r = ftar_in_copy_reserve(m, hp->n);
  if (r) return r;
  grid_views(hp, m);
  if ((r = run_waves(hp, m, at, grid_wave)) != FTAR_PLANE_DONE) return r;
  ftar_pass ptok = {.level = FTAR_LEVEL_LOCAL, .kind = FTAR_PASS_TOKENS, .phase = 12},
            ctok = {.level = FTAR_LEVEL_LEADERS, .kind = FTAR_PASS_TOKENS, .phase = 13};
  if ((r = phase(hp, m, at, hp->rr, ptok)) != FTAR_PLANE_DONE) return r;
  if ((r = phase(hp, m, at, hp->rr, ctok)) != FTAR_PLANE_DONE) return r;
  m->st.grid_collectives++;
  m->st.waves += wave_count(hp);
  return FTAR_PLANE_DONE;
}

/* The multi-level planes' state, once the first such attempt needs it. */
static int host_plane_alloc(host_plane *hp) {
  if (!hp->t && !(hp->t = malloc(sizeof *hp->t)))
    return tr_fail(TR_ENOMEM, "ftar_allreduce: out of memory for the hierarchy");
  if ((!hp->rr && !(hp->rr = ftar_ring_run_new())) || (!hp->first && !(hp->first = ftar_ring_run_new())))
    return tr_fail(TR_ENOMEM, "ftar_allreduce: out of memory for the hierarchy");
  return 0;
}

static int grid_run(host_plane *hp, ftar_member *m, uint64_t seq, double t_end, int *full, char *why,
                    size_t why_len) {
  int r = host_plane_alloc(hp);
  if (r) return r;
  if (m->shape_ep != m->shape_logged) {
    m->shape_logged = m->shape_ep;
    ftar_member_log(m, "epoch %llu: a grid of %d pairs", (unsigned long long)m->run_ep, m->run_n / 2);
  }
  attempt at = {.seq = seq, .t_end = t_end, .why = why, .why_len = why_len};
  r = grid_attempt(hp, m, &at);
  *full = at.full;
  if (r == FTAR_PLANE_ABORT || r == FTAR_PLANE_FATAL) ftar_links_close(m);
  return r;
}

static int host_plane_run(ftar_plane *pl, ftar_member *m, uint64_t seq, double t_end, int *full, int *fatal_rc,
                          char *why, size_t why_len) {
  host_plane *hp = (host_plane *)pl;
  int first[FTAR_MAX_MEMBERS];
  if (m->shape_ep != m->run_ep) { /* once per epoch: a small all-reduce should not pay n^2 compares */
    m->shape_hosts = host_shape(m, first, &m->shape_most);
    m->shape_ep = m->run_ep;
  }
  if (!hier_wanted(m, m->shape_hosts, m->shape_most)) {
    if (grid_wanted(m, m->shape_hosts)) return grid_run(hp, m, seq, t_end, full, why, why_len);
    return hp->flat->run(hp->flat, m, seq, t_end, full, fatal_rc, why, why_len);
  }
  int most, fresh_epoch = m->shape_ep != m->shape_logged;
  host_shape(m, first, &most);
  int r = host_plane_alloc(hp);
  if (r) return r;
  topo_build(m, first, hp->t);
  if (fresh_epoch) { /* once per epoch: the shape the reduction takes */
    m->shape_logged = m->shape_ep;
    ftar_member_log(m, "epoch %llu: hierarchical over %d hosts, %s of %d on %s", (unsigned long long)m->run_ep,
                    m->shape_hosts, hp->t->leader ? "leader" : "member", hp->t->nl, m->data_host);
  }
  attempt at = {.seq = seq, .t_end = t_end, .why = why, .why_len = why_len};
  r = hier_attempt(hp, m, &at);
  *full = at.full;
  if (r == FTAR_PLANE_ABORT || r == FTAR_PLANE_FATAL) ftar_links_close(m);
  return r;
}

static int host_plane_restore(ftar_plane *pl, ftar_member *m) {
  host_plane *hp = (host_plane *)pl;
  if (hp->saved_from < hp->n) /* the last hierarchical attempt's done waves */
    memcpy(hp->buf + hp->saved_from, m->in_copy + hp->saved_from, (hp->n - hp->saved_from) * sizeof(float));
  hp->saved_from = hp->n;
  if (hp->first) ftar_ring_undo(hp->first, hp->buf + hp->wave_off); /* and what its last wave changed */
  return hp->flat->restore(hp->flat, m);
}

static void host_plane_leave(ftar_plane *pl, ftar_member *m) {
  (void)pl;
  ftar_links_close(m);
}

ftar_plane *ftar_host_plane_new(float *buf, size_t n, ftar_op op, size_t bucket, const ftar_ready *rd) {
  host_plane *hp = calloc(1, sizeof *hp);
  if (!hp) return NULL;
  hp->base = (ftar_plane){host_plane_run, host_plane_restore, host_plane_leave};
  hp->buf = buf;
  hp->n = n;
  hp->op = op;
  hp->rd = rd;
  hp->bucket = bucket;
  hp->saved_from = n;
  hp->flat = ftar_ring_plane_new(buf, n, op, bucket, rd);
  if (!hp->flat) {
    ftar_host_plane_free(&hp->base);
    return NULL;
  }
  return &hp->base;
}

void ftar_host_plane_free(ftar_plane *pl) {
  host_plane *hp = (host_plane *)pl;
  if (!hp) return;
  ftar_ring_plane_free(hp->flat);
  ftar_ring_run_free(hp->rr);
  ftar_ring_run_free(hp->first);
  free(hp->t);
  free(hp);
}
