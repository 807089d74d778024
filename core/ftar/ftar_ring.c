/* ftar_ring.c — FTAR's ring engine, and the flat ring as a data plane: one
 * attempt of a collective over host memory in the member's run epoch
 * (ftar_internal.h's ftar_plane). The same engine runs the passes of the
 * hierarchical plane (ftar_hier.c, ftar_ring_pass): a pass runs over one
 * ring level's view and links (ftar_links: the flat ring, a host's local
 * ring, the leaders' ring) and is a reduce-scatter + all-gather with or
 * without the commit tokens, a broadcast from rank 0 along the chain, the
 * tokens alone, or one release token along the chain; the pass's phase is
 * in every frame's flags.
 *
 * Members of an epoch, ordered by slot, form a ring; each keeps one TCP
 * link to its downstream neighbour (it connects, sends CONNECT) and one
 * from its upstream (accepted, CONNECT checked: ftar_port.c). Links live for
 * the epoch. A collective:
 *   reduce-scatter, p-1 steps: send segment (r-s), receive (r-s-1) and add;
 *   all-gather,     p-1 steps: send segment (r+1-t), receive (r-t) in place;
 *   commit tokens:  p-1 small frames around the ring; token v from upstream
 *                   means the v members before us hold the full result.
 * Two members on the flat ring skip the two halves: each sends its whole
 * bucket and adds the peer's (one hop, then the token; see "two members").
 * A member returns only after token p-1: then every member holds the full
 * result, which is what lets the coordinator resolve an abort consistently
 * (COMMIT if anyone could have returned, RUN again otherwise).
 * Each segment is cut into frames (frame_floats); frame j of a step may be
 * sent as soon as frame j of the previous step has arrived, so sending and
 * receiving overlap (non-blocking sockets, one poll loop, no extra threads:
 * on a loopback ring the kernel copy is the work, and it runs in the caller).
 * The caller's input is saved frame by frame into in_copy in the same pass
 * that first overwrites it (CRC+copy when sending our own segment,
 * CRC+save+add when reducing), so an abort restores exactly the modified
 * ranges and there is no up-front copy of the whole buffer.
 * Same-host peers (the default when the advertised hosts are equal) move
 * frames through a shared-memory ring instead of the socket (ftar_shm.c);
 * frames are read in place and verified with the same header checks and
 * CRC. Before sleeping, the loop polls (yielding the core between rounds)
 * for up to 500 us.
 *
 * Malformed input never crashes or allocates: headers are checked (magic,
 * type, epoch, seq, frame number, exact length) before any payload is read,
 * the CRC after; a bad frame closes the links with a logged reason and
 * aborts the attempt, which ftar_collective.c then redoes.
 *
 * Not here: SYNC / GO, redo and what the caller gets back
 * (ftar_collective.c), the data port (ftar_port.c), the hierarchy
 * (ftar_hier.c), the device data plane (ftar_dev.c). Called by: ftar_hier.c
 * (its plane runs the flat ring plane when the epoch has no hierarchy, and
 * its passes through ftar_ring_pass).
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "ftar.h"
#include "ftar_internal.h"
#include "ftar_member_internal.h"
#include "ftar_wire.h"
#include "util.h"

#define POLL_MS 50

/* --- a fault at an exact point, for tests ---
 * TRANSOM_TEST_FTAR_FAULT="kill|stop:SEQ:FRAMES[:SLOT[,SLOT...]]": this
 * process raises SIGKILL or SIGSTOP on itself once it has received FRAMES
 * data frames of collective SEQ (FRAMES 0, meant for the flat ring: once
 * it has sent and received all its data, before its first commit token:
 * its peers hold the full result and cannot return), so a fault test lands
 * mid-collective every
 * time (a signal from outside may land between collectives). With SLOTs
 * (0..63), only the members of those slots do (a job's workers all inherit
 * the variable). With TRANSOM_TEST_FTAR_FAULT_ONCE=DIR as well, a slot's
 * fault fires only in the first process that creates DIR/ftar-fault-SLOT
 * (a replacement, which inherits both, redoes that collective unharmed).
 * Read once; unset: nothing. */
static struct {
  int sig;
  uint64_t slots; /* bit s: slot s faults (all ones: every slot) */
  uint64_t seq;
  uint32_t frames;
} test_fault;
static pthread_once_t test_fault_once = PTHREAD_ONCE_INIT;

static void test_fault_read(void) {
  const char *v = getenv("TRANSOM_TEST_FTAR_FAULT");
  char what[8];
  unsigned long long seq;
  unsigned frames;
  int used = 0, k = v ? sscanf(v, "%7[a-z]:%llu:%u%n", what, &seq, &frames, &used) : 0;
  if (k < 3) return;
  uint64_t slots = ~(uint64_t)0;
  if (v[used] == ':') {
    slots = 0;
    const char *p = v + used + 1;
    for (;;) {
      char *end;
      long s = strtol(p, &end, 10);
      if (end == p || s < 0 || s > 63) return; /* malformed (an empty list too): no fault */
      slots |= (uint64_t)1 << s;
      if (*end == 0) break;
      if (*end != ',') return;
      p = end + 1;
    }
  } else if (v[used]) {
    return; /* trailing junk: no fault */
  }
  test_fault.slots = slots;
  test_fault.sig = strcmp(what, "kill") == 0 ? SIGKILL : strcmp(what, "stop") == 0 ? SIGSTOP : 0;
  test_fault.seq = seq;
  test_fault.frames = frames;
}

/* Whether this process is the first to fault as `slot` (no _ONCE: always). */
static int test_fault_first(int slot) {
  const char *dir = getenv("TRANSOM_TEST_FTAR_FAULT_ONCE");
  if (!dir) return 1;
  char path[4096];
  snprintf(path, sizeof path, "%s/ftar-fault-%d", dir, slot);
  int fd = open(path, O_CREAT | O_EXCL | O_WRONLY, 0600);
  if (fd >= 0) {
    close(fd);
    return 1;
  }
  if (errno == EEXIST) return 0;
  fprintf(stderr, "TRANSOM_TEST_FTAR_FAULT_ONCE: cannot create %s (%s): the fault fires anyway\n", path, strerror(errno));
  return 1;
}

static void test_fault_check(int slot, uint64_t seq, uint32_t frames) {
  if (test_fault.sig && slot >= 0 && slot < 64 && (test_fault.slots >> slot & 1) && seq == test_fault.seq &&
      frames == test_fault.frames && test_fault_first(slot))
    raise(test_fault.sig);
}

/* --- ring state, frame geometry --- */

enum { R_DONE = 0, R_ABORT = 1, R_FATAL = 2 };

/* Where buckets and segments lie: buf[0..n) is cut into nb buckets of B
 * floats from the end (bucket 0 is the last B floats: backward produces
 * gradients from the end of the slab first); each bucket is reduced by the
 * ring as a whole collective of its own (p segments, reduce-scatter then
 * all-gather), bucket after bucket, in one attempt. One bucket (B >= n) is
 * the plain ring. */
typedef struct {
  size_t n, B, nb;
  int p;
  int outer_p, outer_c; /* a pass over part outer_c of outer_p of every bucket (ftar_pass) */
} geom;

static void geom_set(geom *G, size_t n, size_t bucket, int p, int outer_p, int outer_c) {
  G->n = n;
  G->B = bucket && bucket < n ? bucket : (n ? n : 1);
  G->nb = (n + G->B - 1) / G->B;
  G->p = p;
  G->outer_p = outer_p > 1 ? outer_p : 1;
  G->outer_c = outer_p > 1 ? outer_c : 0;
}
static inline size_t seg_len_p(size_t n, int p, int c) { return n / (size_t)p + ((size_t)c < n % (size_t)p); }
static inline size_t seg_off_p(size_t n, int p, int c) {
  size_t b = n / (size_t)p, rem = n % (size_t)p;
  return (size_t)c * b + ((size_t)c < rem ? (size_t)c : rem);
}
static inline size_t whole_len(const geom *G, size_t b) {
  size_t hi = G->n - b * G->B;
  return hi > G->B ? G->B : hi;
}
static inline size_t b_len(const geom *G, size_t b) { return seg_len_p(whole_len(G, b), G->outer_p, G->outer_c); }
static inline size_t b_off(const geom *G, size_t b) {
  size_t hi = G->n - b * G->B;
  return (hi > G->B ? hi - G->B : 0) + seg_off_p(whole_len(G, b), G->outer_p, G->outer_c);
}

typedef struct {
  ftar_member *m;
  ftar_links *L; /* the level's view and links */
  int kind;      /* FTAR_PASS_* */
  int exch;      /* two members: the one-hop exchange (see "two members" below) */
  int rsteps;    /* reduce-scatter steps (p-1; 0 for a broadcast) */
  uint16_t flags; /* of every DATA frame: op | phase << 8 (TOKEN: phase << 8) */
  int tok_send_n, tok_recv_n; /* commit tokens this member sends / receives */
  int tok_base_send, tok_base_recv; /* token values: base + 1, base + 2, ... */
  uint32_t frames_before; /* data frames received in earlier passes of the attempt */
  int no_stall;           /* no "peer stalled" limit (ftar_pass) */
  float div;              /* ftar_pass.div */
  float *save;            /* where overwritten input is saved (NULL: nowhere) */
  int save_nt;            /* ... by non-temporal stores (a big collective: see SAVE_NT_MIN) */
  int cross;              /* our downstream is on another host */
  float *buf;
  size_t n, Fmax;
  geom G;
  const ftar_ready *rd; /* NULL: every bucket is ready */
  size_t rd_off;        /* buf's offset in the buffer rd describes (ftar_pass) */
  int p, r, nsteps;
  ftar_op op;
  uint64_t ep, seq;
  /* send cursor: next frame (sb, ss, sj) in frames of sF floats, global frame number sidx */
  size_t sb, sF;
  int ss;
  size_t sj;
  uint32_t sidx;
  int s_busy, s_token, s_connect;
  uint8_t s_hdr[FTAR_HDR], s_extra[FTAR_CONNECT_LEN];
  const uint8_t *s_pay;
  size_t s_len, s_off;
  /* receive cursor (rb, rs, rj) in frames of rF floats */
  size_t rb, rF;
  int rs;
  size_t rj;
  uint32_t ridx;
  int r_have;
  ftar_hdr rh;
  uint8_t rhb[FTAR_HDR];
  uint8_t *r_dst;
  size_t r_got;
  uint32_t r_crc; /* payload CRC so far (shared-memory path) */
  /* commit */
  int full, tok_sent, tok_recv;
  /* progress */
  int started;
  double t_progress;
  double t_local; /* last time the ring waited for a bucket of our own (not a stall) */
  int fatal;
  char why[256];
} ring;

/* Poll without sleeping (yielding the core between rounds) this long after
 * the last progress before sleeping in poll(). A sleep costs a wake-up per
 * ring hop, and on shared-memory links a doorbell syscall; a yielding poller
 * costs neither and still lets a runnable peer have the core, so it pays
 * even with more ranks than cores (OpenMPI polls with sched_yield then). */
static double spin_seconds(const ftar_member *m) {
  if (m->o.spin_us == 0) return 0;
  return (m->o.spin_us < 0 ? 500 : m->o.spin_us) * 1e-6;
}

/* What was overwritten in buf (and saved in save: in_copy): per bucket
 * and segment, a prefix, in the geometry of the ring that did it. Nothing
 * else is written back: a bucket the ring never touched may still be
 * being written by its producer. */
typedef struct {
  geom G;
  float *save;    /* NULL: the pass saved nothing */
  size_t *copied; /* [nb * p] */
  size_t cap;
} undo_log;

static inline int modp(int a, int p) { return ((a % p) + p) % p; }

/* Frame size in floats, the same on every member (it depends only on n, p
 * and chunk). Big frames are whole multiples of FRAME_UNIT: 65408 payload
 * bytes + the 40-byte header fit one 64 KiB loopback TCP segment, so with
 * TCP_NODELAY a frame never leaves a runt segment behind (on 1500/9000-byte
 * MTUs the unit is irrelevant). About 4 frames per segment so the steps
 * pipeline (8 pipelined better on paper but cost more wake-ups than they
 * saved when ranks share cores). A segment of up to 4 units is cut evenly
 * in as few frames of at most a unit as hold it (no runt frame after a full
 * one). Cutting big segments evenly too (no runt frame, but frames off the
 * unit) was slower: 4 ranks, 1 MiB over TCP 1155 vs 1016 us, 2 ranks
 * 256 KiB 84.6 vs 79.5 (A/B, best of 6, load 3). At most chunk: 128 KiB
 * (2 units) by default since bench/ftar_frames.sh put it ahead of 256 KiB
 * over TCP wherever segments are big enough to tell (4 ranks, 4 MiB
 * 1.26x-1.35x, 16 MiB 1.14x-1.20x; 2 ranks 4 MiB 1.05x-1.29x; shared
 * memory within the noise, 0.97x-1.00x): a frame forwarded sooner lets
 * the next hop start sooner, where ranks hand the core over. Small segments
 * were cut in 16 KiB frames until a profile of 64 KiB over TCP (2 ranks)
 * showed what they cost: a syscall and a wake-up each, and below RX_CAP / 2
 * the payload goes through rx, one copy more; one frame per segment: 36.5
 * -> 25.1 us a collective (A/B, best of 6 interleaved runs, load 2). */
#define FRAME_UNIT 16352
static size_t frame_floats(size_t n, int p, size_t chunk) {
  size_t seg = (n + (size_t)p - 1) / (size_t)p, f = (seg + 3) / 4;
  size_t cap = chunk >= FRAME_UNIT ? chunk / FRAME_UNIT * FRAME_UNIT : (chunk + 15) & ~(size_t)15;
  if (f <= FRAME_UNIT) {
    size_t k = seg ? (seg + FRAME_UNIT - 1) / FRAME_UNIT : 1; /* 1..4 frames of at most a unit, cut evenly */
    f = ((seg + k - 1) / k + 15) & ~(size_t)15;
    if (f == 0) f = 16;
  } else {
    f = (f + FRAME_UNIT - 1) / FRAME_UNIT * FRAME_UNIT;
  }
  return f < cap ? f : cap;
}

static inline size_t seg_len(const geom *G, size_t b, int c) { return seg_len_p(b_len(G, b), G->p, c); }
static inline size_t seg_off(const geom *G, size_t b, int c) { return b_off(G, b) + seg_off_p(b_len(G, b), G->p, c); }
static inline size_t *undo_at(undo_log *u, size_t b, int c) { return &u->copied[b * (size_t)u->G.p + (size_t)c]; }
/* The exchange (below) cuts its bucket as the ring cuts a segment, in
 * frames of at most half a shared-memory ring: a frame it holds unread must
 * not keep the peer from finishing the same frame the other way. Up to
 * 64 KiB it sends one frame, not two of 32 KiB: its single hop has no
 * steps to pipeline (A/B, 64 KiB, 2 ranks, best of 10 interleaved, load
 * 7-8: TCP 32.6 vs 35.5 us, median 64 vs 131; shared memory 32.8 vs 41.1;
 * the ring's 4 ranks at 256 KiB, one frame per 64 KiB segment: no better). */
#define EXCH_FRAME_MAX ((size_t)SHM_RING_DEFAULT / 8 / FRAME_UNIT * FRAME_UNIT)
#define EXCH_ONE_FRAME ((size_t)16384)
static size_t ring_frame_floats(const ring *g, size_t len) {
  size_t f = frame_floats(len, g->G.p, g->m->chunk); /* the exchange: G.p = 1, the bucket one segment */
  if (!g->exch) return f;
  if (len <= EXCH_ONE_FRAME && len > f && (len + 15) / 16 * 16 <= g->m->chunk) f = (len + 15) & ~(size_t)15;
  return f > EXCH_FRAME_MAX ? EXCH_FRAME_MAX : f;
}
static inline size_t bucket_F(const ring *g, size_t b) { return b < g->G.nb ? ring_frame_floats(g, b_len(&g->G, b)) : 1; }
static inline size_t seg_frames(const ring *g, size_t b, size_t F, int c) { return (seg_len(&g->G, b, c) + F - 1) / F; }
/* Our own bucket b is final (its producer will not write it again). */
static inline int bucket_ready(const ring *g, size_t b) {
  return !g->rd || g->rd_off + b_off(&g->G, b) >= atomic_load_explicit(&g->rd->from, memory_order_acquire);
}
static inline int send_seg(const ring *g, int s) {
  if (g->kind == FTAR_PASS_BCAST || g->exch) return 0;
  if (g->kind == FTAR_PASS_AG) s += g->p - 1; /* the all-gather's steps alone */
  return s < g->p - 1 ? modp(g->r - s, g->p) : modp(g->r + 1 - (s - (g->p - 1)), g->p);
}
static inline int recv_seg(const ring *g, int s) {
  if (g->kind == FTAR_PASS_BCAST || g->exch) return 0;
  if (g->kind == FTAR_PASS_AG) s += g->p - 1;
  return s < g->p - 1 ? modp(g->r - s - 1, g->p) : modp(g->r - (s - (g->p - 1)), g->p);
}

/* Moves a cursor past empty segments and finished buckets. */
static void skip_cursor(ring *g, size_t *b, int *s, size_t *j, size_t *F, int sending) {
  while (*b < g->G.nb) {
    if (*s >= g->nsteps) {
      (*b)++;
      *s = 0;
      *j = 0;
      *F = bucket_F(g, *b);
      continue;
    }
    if (*j < seg_frames(g, *b, *F, sending ? send_seg(g, *s) : recv_seg(g, *s))) break;
    (*s)++;
    *j = 0;
  }
}
static void skip_send(ring *g) { skip_cursor(g, &g->sb, &g->ss, &g->sj, &g->sF, 1); }
static void skip_recv(ring *g) { skip_cursor(g, &g->rb, &g->rs, &g->rj, &g->rF, 0); }

static void undo_restore(float *buf, undo_log *u) {
  if (!u->copied || !u->save) return;
  for (size_t b = 0; b < u->G.nb; b++)
    for (int c = 0; c < u->G.p; c++) {
      size_t *k = undo_at(u, b, c);
      if (!*k) continue;
      size_t off = seg_off(&u->G, b, c);
      memcpy(buf + off, u->save + off, *k * sizeof(float));
      *k = 0;
    }
}

static int ring_fail(ring *g, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int ring_fail(ring *g, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g->why, sizeof g->why, fmt, ap);
  va_end(ap);
  return -1;
}

/* Our neighbours in run_ep: the upstream sends to us, we send downstream. */
static const peer *up_peer(const ring *g) {
  const ftar_links *L = g->L;
  return &L->mem[(L->r + L->n - 1) % L->n];
}
static const peer *down_peer(const ring *g) {
  const ftar_links *L = g->L;
  return &L->mem[(L->r + 1) % L->n];
}

/* --- sending --- */

static void update_full(ring *g) {
  if (!g->full && g->rb >= g->G.nb && g->sb >= g->G.nb) g->full = 1;
}

/* Frame j of step s of a bucket leaves once frame j of step s-1 of that
 * bucket arrived; step 0 (our own segment) once the bucket is ready. */
static int send_ready(const ring *g) {
  if (g->sb >= g->G.nb) return 0;
  if (g->kind == FTAR_PASS_BCAST) { /* the root sends its buf; the others pass on what arrived */
    if (g->r == 0) return 1;
    return g->rb > g->sb || (g->rb == g->sb && (g->rs > g->ss || (g->rs == g->ss && g->rj > g->sj)));
  }
  if (g->ss == 0) return bucket_ready(g, g->sb);
  if (g->rb != g->sb) return g->rb > g->sb;
  return g->rs > g->ss - 1 || (g->rs == g->ss - 1 && g->rj > g->sj);
}

/* --- two members: the one-hop exchange ---
 * With p = 2 the ring's reduce-scatter and all-gather are two sequential
 * hops of half the bucket each, then the commit token a third. Instead
 * each member sends its whole bucket and adds the peer's into its own
 * (saving what it overwrites in the same pass, as the ring's reduce does;
 * not also as it leaves, as the ring's own segment is, which copied every
 * element twice):
 * the same bytes on each link, one hop instead of two, then the one token.
 * a + b and b + a are the same float, so both hold the same bits (MEAN:
 * both divide the sum by 2, as the ring's owner of a segment does). A
 * received frame is added only once our frame of the same range has left
 * (the kernel or the shared-memory ring holds a copy): until then it waits
 * in the stage (TCP) or in the ring (shared memory). The frames carry
 * FTAR_FLAG_EXCH, so a member running the ring against one exchanging
 * sees "callers disagree", not a wrong sum. Only up to EXCH_MAX: there the
 * hop it saves outweighs the work it adds (adds over the whole bucket, not
 * half, and every received byte through the stage). A/B against the ring
 * (both with the one-frame small segments of frame_floats), 2 ranks, 300
 * collectives, best of 6 interleaved runs, load 2-5: TCP 16 KiB 13.6 vs
 * 19.2 us, 64 KiB 24.9 vs 30.7, 128 KiB 37.1 vs 43.0, 256 KiB 60.2 vs 69.4,
 * 512 KiB 114.4 vs 114.6; shared memory 16 KiB 14.1 vs 19.4, 64 KiB 6.5 vs
 * 11.1, 256 KiB 23.1 vs 31.7; uncapped, 16 MiB over TCP: 8.5 vs 6.7 ms
 * (the ring's pipelined halves win big buffers). TRANSOM_FTAR_EXCHANGE=0 turns
 * it off (the ring's two hops, for A/B benches; every member must agree). */
#define FTAR_FLAG_EXCH 0x10
#define EXCH_MAX ((size_t)128 * 1024) /* floats a bucket (512 KiB): above, the ring's pipelined halves win */
static int exch_on = 1;
static pthread_once_t exch_once = PTHREAD_ONCE_INIT;
static void exch_read(void) {
  const char *v = getenv("TRANSOM_FTAR_EXCHANGE");
  exch_on = !(v && strcmp(v, "0") == 0);
}

/* Data frames that have left whole (the one in flight does not count). */
static inline uint32_t frames_sent(const ring *g) { return g->sidx - (uint32_t)(g->s_busy && !g->s_token && !g->s_connect); }

/* The data frame being received may not be added yet: ours of that range
 * is still being sent. */
static int exch_wait(const ring *g) {
  return g->exch && g->r_have && g->rh.type == FT_DATA && frames_sent(g) <= g->ridx;
}

/* ... and nothing more of it can be read now (TCP reads the payload into
 * the stage meanwhile; shared memory leaves it in the ring). */
static int exch_hold(const ring *g) {
  return exch_wait(g) && (g->L->up_shm.active || g->r_got == g->rh.len);
}

/* Frames of a bucket are added into (reduce-scatter) or written over
 * (all-gather) our own part of buf: not before our producer is done with
 * it. They wait in the link meanwhile. */
static int recv_gated(const ring *g) { return g->rb < g->G.nb && !bucket_ready(g, g->rb); }

/* The ring waits for a bucket of our own, not for a peer. */
static int waiting_local(const ring *g) {
  return (g->sb < g->G.nb && g->ss == 0 && !g->s_busy && !bucket_ready(g, g->sb)) || recv_gated(g);
}

/* Around the ring, token k leaves once token k-1 came; along a chain
 * (FTAR_PASS_RELEASE) ours leaves once the upstream's came. */
static int token_ready(const ring *g) {
  int k = g->tok_sent + 1;
  if (!g->full || k > g->tok_send_n) return 0;
  return g->kind == FTAR_PASS_RELEASE ? g->tok_recv >= g->tok_recv_n : g->tok_recv >= k - 1;
}

static void prep_data(ring *g, undo_log *u) {
  int c = send_seg(g, g->ss);
  size_t off = seg_off(&g->G, g->sb, c) + g->sj * g->sF;
  size_t len = seg_len(&g->G, g->sb, c) - g->sj * g->sF;
  if (len > g->sF) len = g->sF;
  float *x = g->buf + off;
  uint32_t pcrc;
  if (g->ss == 0 && g->rsteps > 0 && g->save && !g->exch) { /* our own segment, overwritten by the all-gather later: save it */
    pcrc = (g->save_nt ? tr_crc32c_copy_nt : tr_crc32c_copy)(0, g->save + off, x, len * sizeof(float));
    *undo_at(u, g->sb, c) += len;
  } else {
    if (g->ss == g->p - 1 && ((g->op == FTAR_MEAN && g->kind == FTAR_PASS_RING) || g->div != 0)) {
      float d = g->div != 0 ? g->div : (float)g->p; /* ours: divide once (flat ring; the grid's columns) */
      for (size_t k = 0; k < len; k++) x[k] /= d;
    }
    pcrc = tr_crc32c(0, x, len * sizeof(float));
  }
  ftar_hdr h = {.type = FT_DATA,
                .flags = g->flags,
                .epoch = g->ep,
                .seq = g->seq,
                .index = g->sidx,
                .len = (uint32_t)(len * 4),
                .aux = (uint32_t)g->n};
  ftar_frame_build_crc(g->s_hdr, &h, pcrc);
  g->s_pay = (const uint8_t *)x;
  g->s_len = len * sizeof(float);
  g->s_off = 0;
  g->s_busy = 1;
  g->s_token = g->s_connect = 0;
  g->sidx++;
  g->sj++;
  skip_send(g);
}

static void prep_token(ring *g) {
  if (g->tok_sent == 0) test_fault_check(g->m->slot, g->seq, 0);
  ftar_hdr h = {.type = FT_TOKEN,
                .flags = (uint16_t)(g->flags & 0xff00),
                .epoch = g->ep,
                .seq = g->seq,
                .index = (uint32_t)(g->tok_base_send + g->tok_sent + 1)};
  ftar_frame_build(g->s_hdr, &h, NULL);
  g->s_pay = NULL;
  g->s_len = g->s_off = 0;
  g->s_busy = g->s_token = 1;
  g->s_connect = 0;
}

static int same_host(const ftar_member *m, const peer *p) { return strcmp(p->host, m->data_host) == 0; }

/* --- the saved input: plain or non-temporal stores ---
 * The input a collective overwrites is saved (save: in_copy) and read back
 * only to undo an aborted attempt. Plain stores keep it in the cache: cheap
 * while everything fits. Once the machine's ranks hold more per collective
 * than its last-level cache, the save evicts the data read next and every
 * save store first reads its line from memory; then non-temporal stores
 * (tr_crc32c_*_nt). What a rank holds: its buffer and the save, 2n floats;
 * over TCP the sockets' buffers about as much again (4n). Ranks: this
 * level's members on this machine (the same advertised host, or both on
 * loopback). Measured before choosing (2 ranks, busbw non-temporal/plain,
 * means of 8-10 interleaved runs, cores sharing a cache): TCP 1 MiB 0.87x,
 * 3 MiB 0.98x, 4 MiB 1.10x-1.16x, 16 MiB 1.11x, 64 MiB 1.06x; shared memory
 * 4 MiB 0.78x, 6 MiB 1.00x, 8 MiB 1.12x, 16 MiB 1.13x, 64 MiB 1.27x; 4 ranks
 * on 2 cores, shared memory: 2 MiB 1.05x, 4 MiB 1.24x, 16 MiB 1.27x. The
 * rule puts the switch at 4 MiB (TCP), 8 MiB (shared memory, 2 ranks) and
 * 4 MiB (4 ranks) with this machine's 32 MiB. TRANSOM_FTAR_SAVE_NT=0 or 1
 * forces either (A/B benches). */
static size_t llc_bytes = 32u << 20; /* when sysfs says nothing */
static int save_nt_env = -1;
static pthread_once_t save_nt_once = PTHREAD_ONCE_INIT;

/* The largest cache of cpu0 from sysfs ("32768K"); glibc's sysconf figure
 * is wrong in some VMs (320 MiB on this one's 32). */
static void save_nt_read(void) {
  const char *v = getenv("TRANSOM_FTAR_SAVE_NT");
  if (v && (strcmp(v, "0") == 0 || strcmp(v, "1") == 0)) save_nt_env = v[0] - '0';
  size_t best = 0;
  for (int i = 0; i < 8; i++) {
    char path[96], txt[32] = "";
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
    FILE *f = fopen(path, "r");
    if (!f) continue;
    if (fgets(txt, sizeof txt, f)) {
      char *end;
      unsigned long long k = strtoull(txt, &end, 10);
      size_t b = (size_t)k * (*end == 'K' ? 1024u : *end == 'M' ? 1024u * 1024u : 1u);
      if (b > best) best = b;
    }
    fclose(f);
  }
  if (best >= ((size_t)1 << 20)) llc_bytes = best;
}

static int loopback(const char *host) { return strncmp(host, "127.", 4) == 0 || strcmp(host, "localhost") == 0; }

static int save_nt_for(const ftar_member *m, const ftar_links *L, size_t n) {
  pthread_once(&save_nt_once, save_nt_read);
  if (save_nt_env >= 0) return save_nt_env;
  size_t local = 0;
  int shm = 0;
  for (int i = 0; i < L->n; i++) {
    const peer *p = &L->mem[i];
    int same = same_host(m, p);
    if (same || (loopback(p->host) && loopback(m->data_host))) local++;
    if (same && i != L->r && m->o.shm) shm = 1;
  }
  size_t held = n * sizeof(float) * (shm ? 2 : 4) * (local ? local : 1);
  return held >= llc_bytes;
}

static void prep_connect(ring *g) {
  ftar_member *m = g->m;
  ftar_links *L = g->L;
  const peer *d = down_peer(g);
  memset(g->s_extra, 0, sizeof g->s_extra);
  ftw_put64(g->s_extra, m->uid);
  uint16_t flags = 0;
  if (m->o.shm && same_host(m, d) && ftar_shm_create(g->L, m->shm_ring, m->o.shm_stream) == 0) {
    flags = FTF_SHM;
    ftw_put32(g->s_extra + 8, (uint32_t)getpid());
    ftw_put32(g->s_extra + 12, (uint32_t)L->down_shm.memfd);
    ftw_put32(g->s_extra + 16, (uint32_t)L->down_shm.size);
    ftw_put64(g->s_extra + 24, L->down_shm.h->token);
  }
  ftw_put32(g->s_extra + 20, (uint32_t)L->level);
  ftar_hdr h = {.type = FT_CONNECT,
                .flags = flags,
                .epoch = g->ep,
                .index = (uint32_t)m->slot,
                .aux = (uint32_t)d->slot,
                .len = FTAR_CONNECT_LEN};
  ftar_frame_build(g->s_hdr, &h, g->s_extra);
  g->s_pay = g->s_extra;
  g->s_len = FTAR_CONNECT_LEN;
  g->s_off = 0;
  g->s_busy = g->s_connect = 1;
  g->s_token = 0;
}

static int want_send(const ring *g) {
  const ftar_links *L = g->L;
  if (L->down_state == DOWN_CONNECTING || L->down_state == DOWN_ACK || L->down_state == DOWN_AUTH) return 1;
  return g->s_busy || L->down_state == DOWN_HELLO || send_ready(g) || token_ready(g);
}

/* Still something to send in this collective (the downstream must live). */
static int send_pending(const ring *g) { return g->s_busy || g->sb < g->G.nb || g->tok_sent < g->tok_send_n; }

/* Returns 1 on progress, 0 if blocked, -1 on failure (g->why). */
static int pump_send(ring *g, undo_log *u) {
  ftar_member *m = g->m;
  ftar_links *L = g->L;
  int progress = 0;
  if (L->down_state == DOWN_CONNECTING || L->down_state == DOWN_ACK || L->down_state == DOWN_AUTH)
    return 0; /* poll reports these */
  for (;;) {
    if (!g->s_busy) {
      if (L->down_state == DOWN_HELLO) prep_connect(g);
      else if (send_ready(g)) prep_data(g, u);
      else if (token_ready(g)) prep_token(g);
      else return progress;
    }
    size_t total = FTAR_HDR + g->s_len;
    struct iovec iov[2];
    int niov = 0;
    if (g->s_off < FTAR_HDR) {
      iov[niov++] = (struct iovec){g->s_hdr + g->s_off, FTAR_HDR - g->s_off};
      if (g->s_len) iov[niov++] = (struct iovec){(void *)g->s_pay, g->s_len};
    } else {
      iov[niov++] = (struct iovec){(void *)(g->s_pay + (g->s_off - FTAR_HDR)), total - g->s_off};
    }
    ssize_t w;
    if (L->down_shm.active) {
      if ((w = ftar_shm_write(g->L, iov, niov, &m->st.bytes_streamed)) < 0)
        return ring_fail(g, "shared-memory ring to slot %d is corrupt", down_peer(g)->slot);
      if (w == 0) return progress;
    } else {
      struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
      w = sendmsg(L->down_fd, &mh, MSG_NOSIGNAL);
    }
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return progress;
      return ring_fail(g, "send to slot %d: %s", down_peer(g)->slot, strerror(errno));
    }
    progress = 1;
    g->s_off += (size_t)w;
    m->st.bytes_sent += (uint64_t)w;
    if (g->cross) m->st.bytes_cross += (uint64_t)w;
    if (g->s_off == total) {
      g->s_busy = 0;
      if (g->s_token) g->tok_sent++;
      update_full(g);
      if (g->s_connect) { /* nothing more until the receiver answers 'S' or 'T' */
        g->s_connect = 0;
        L->down_state = DOWN_ACK;
        return progress;
      }
    }
  }
}

/* --- receiving --- */

static int expecting(const ring *g) { return g->rb < g->G.nb || g->tok_recv < g->tok_recv_n; }

/* Where the payload of the next DATA frame goes: stage (reduce-scatter, added
 * after the CRC check) or its place in buf (all-gather). */
static uint8_t *expected_dst(const ring *g) {
  if (g->rs < g->rsteps) return (uint8_t *)g->m->stage;
  int c = recv_seg(g, g->rs);
  return (uint8_t *)(g->buf + seg_off(&g->G, g->rb, c) + g->rj * g->rF);
}

/* Payload bytes of the next frame the upstream should send. */
static size_t expected_len(const ring *g) {
  if (g->rb >= g->G.nb) return 0;
  int c = recv_seg(g, g->rs);
  size_t len = seg_len(&g->G, g->rb, c) - g->rj * g->rF;
  return (len > g->rF ? g->rF : len) * sizeof(float);
}

/* Validates the header just read against what the ring expects next. */
static int check_rx_header(ring *g) {
  ftar_member *m = g->m;
  ftar_hdr *h = &g->rh;
  int upslot = up_peer(g)->slot;
  char why[200];
  if (ftar_hdr_check(h, (uint32_t)(g->Fmax * 4), why, sizeof why))
    return ring_fail(g, "malformed frame from slot %d: %s", upslot, why);
  int want = g->rb < g->G.nb ? FT_DATA : FT_TOKEN;
  if (h->type != want)
    return ring_fail(g, "slot %d sent %s, expected %s", upslot, ftar_type_name(h->type), ftar_type_name((unsigned)want));
  if (h->epoch != g->ep)
    return ring_fail(g, "slot %d sent a frame of epoch %llu in epoch %llu (refused)", upslot,
                     (unsigned long long)h->epoch, (unsigned long long)g->ep);
  if (h->seq != g->seq)
    return ring_fail(g, "slot %d sent a frame of seq %llu while running seq %llu", upslot, (unsigned long long)h->seq,
                     (unsigned long long)g->seq);
  if (want == FT_TOKEN) {
    int k = g->tok_base_recv + g->tok_recv + 1;
    if (h->index != (uint32_t)k || h->len != 0 || h->flags != (g->flags & 0xff00))
      return ring_fail(g, "slot %d sent token %u (flags 0x%x), expected %d (flags 0x%x)", upslot, h->index, h->flags,
                       k, g->flags & 0xff00);
    g->r_dst = NULL;
    return 0;
  }
  int c = recv_seg(g, g->rs);
  size_t off = seg_off(&g->G, g->rb, c) + g->rj * g->rF;
  size_t len = seg_len(&g->G, g->rb, c) - g->rj * g->rF;
  if (len > g->rF) len = g->rF;
  if (h->flags != g->flags || h->aux != (uint32_t)g->n)
    return ring_fail(g, "slot %d runs op/phase 0x%x on %u floats, we run 0x%x on %zu (callers disagree)", upslot,
                     h->flags, h->aux, g->flags, g->n);
  if (h->index != g->ridx || h->len != len * 4)
    return ring_fail(g, "slot %d sent frame %u of %u bytes, expected frame %u of %zu bytes", upslot, h->index, h->len,
                     g->ridx, len * 4);
  g->r_dst = g->rs < g->rsteps ? (uint8_t *)m->stage : (uint8_t *)(g->buf + off);
  return 0;
}

/* recv() on the upstream link into dst. Returns bytes (> 0), 0 if it would
 * block, -1 on EOF or error (g->why). */
static ssize_t up_recv(ring *g, void *dst, size_t cap) {
  ftar_member *m = g->m;
  ftar_links *L = g->L;
  int upslot = up_peer(g)->slot;
  if (L->up_shm.active) {
    ssize_t k = ftar_shm_read(g->L, dst, cap);
    if (k < 0) return ring_fail(g, "shared-memory ring from slot %d is corrupt", upslot);
    if (k > 0) m->st.bytes_recv += (uint64_t)k;
    else if (L->up_eof) return ring_fail(g, "slot %d closed the link", upslot);
    return k;
  }
  ssize_t k = recv(L->up_fd, dst, cap, 0);
  if (k > 0) {
    m->st.bytes_recv += (uint64_t)k;
    return k;
  }
  if (k == 0) return ring_fail(g, "slot %d closed the link", upslot);
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
  return ring_fail(g, "receive from slot %d: %s", upslot, strerror(errno));
}

/* What one receive phase did (or RX_FAIL = -1, g->why set). */
enum {
  RX_FAIL = -1,
  RX_BLOCKED = 0,  /* nothing more to read now: pump_recv returns */
  RX_PROGRESS = 1, /* bytes moved: go on */
  RX_FRAME = 2,    /* a frame completed: go on (progress was already counted) */
};

/* The header in g->rhb is the next frame's: decode and check it. */
static int accept_header(ring *g) {
  ftar_hdr_decode(g->rhb, &g->rh);
  if (check_rx_header(g)) return RX_FAIL;
  g->r_have = 1;
  g->r_got = 0;
  g->r_crc = 0;
  if (!g->started) g->started = 1;
  return RX_PROGRESS;
}

/* Shared memory: headers are copied out (40 bytes, maybe across the wrap). */
static int recv_header_shm(ring *g) {
  ftar_member *m = g->m;
  ftar_links *L = g->L;
  size_t n;
  int bad = 0;
  ftar_shm_peek(g->L, &n, &bad);
  uint64_t avail = bad ? 0 : atomic_load(&L->up_shm.h->head) - L->up_shm.pos;
  if (bad) return ring_fail(g, "shared-memory ring from slot %d is corrupt", up_peer(g)->slot);
  if (avail < FTAR_HDR) {
    if (L->up_eof) return ring_fail(g, "slot %d closed the link", up_peer(g)->slot);
    return RX_BLOCKED;
  }
  if (ftar_shm_read(g->L, g->rhb, FTAR_HDR) != FTAR_HDR)
    return ring_fail(g, "shared-memory ring from slot %d is corrupt", up_peer(g)->slot);
  m->st.bytes_recv += FTAR_HDR;
  return accept_header(g);
}

/* TCP, a big frame next and rx empty: header and payload in one recvmsg,
 * the payload straight to where check_rx_header will put it. */
static int recv_header_direct(ring *g) {
  ftar_member *m = g->m;
  ftar_links *L = g->L;
  struct iovec iov[2] = {{g->rhb, FTAR_HDR}, {expected_dst(g), expected_len(g)}};
  struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
  ssize_t k = recvmsg(L->up_fd, &mh, 0);
  if (k == 0) return ring_fail(g, "slot %d closed the link", up_peer(g)->slot);
  if (k < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return RX_BLOCKED;
    return ring_fail(g, "receive from slot %d: %s", up_peer(g)->slot, strerror(errno));
  }
  m->st.bytes_recv += (uint64_t)k;
  if (k < FTAR_HDR) { /* a partial header: finish it through rx */
    memcpy(L->rx, g->rhb, (size_t)k);
    L->rx_head = 0;
    L->rx_tail = (size_t)k;
    return RX_PROGRESS;
  }
  if (accept_header(g) == RX_FAIL) return RX_FAIL;
  g->r_got = (size_t)k - FTAR_HDR;
  return RX_PROGRESS;
}

/* TCP, less than a header in rx: read more into rx. */
static int fill_rx(ring *g) {
  ftar_links *L = g->L;
  size_t have = L->rx_tail - L->rx_head;
  if (L->rx_head > 0) {
    memmove(L->rx, L->rx + L->rx_head, have);
    L->rx_head = 0;
    L->rx_tail = have;
  }
  /* before a big payload read just the header, so the payload goes
   * straight to its place instead of through rx */
  size_t want = RX_CAP - L->rx_tail;
  if (expected_len(g) >= RX_CAP / 2) want = FTAR_HDR - have;
  ssize_t k = up_recv(g, L->rx + L->rx_tail, want);
  if (k < 0) return RX_FAIL;
  if (k == 0) return RX_BLOCKED;
  L->rx_tail += (size_t)k;
  return RX_PROGRESS;
}

static int recv_header_tcp(ring *g) {
  ftar_links *L = g->L;
  size_t have = L->rx_tail - L->rx_head;
  if (have == 0 && expected_len(g) >= RX_CAP / 2) return recv_header_direct(g);
  if (have < FTAR_HDR) return fill_rx(g);
  memcpy(g->rhb, L->rx + L->rx_head, FTAR_HDR);
  L->rx_head += FTAR_HDR;
  return accept_header(g);
}

/* dst += src over n floats, dst's old values saved into save (NULL: not
 * saved); returns the CRC of src continued from crc. The same float adds
 * either way. */
static uint32_t reduce_crc(const ring *g, uint32_t crc, float *dst, float *save, const float *src, size_t n) {
  if (save) return (g->save_nt ? tr_crc32c_reduce_nt : tr_crc32c_reduce)(crc, dst, save, src, n);
  crc = tr_crc32c(crc, src, n * sizeof(float));
  for (size_t k = 0; k < n; k++) dst[k] = dst[k] + src[k];
  return crc;
}

/* The frame being received: a reduce-scatter DATA frame (added into buf)? */
static int rx_reducing(const ring *g) { return g->rh.type == FT_DATA && g->rs < g->rsteps; }

/* Its segment (*c) and offset in buf (0 for a token). */
static size_t rx_offset(const ring *g, int *c) {
  *c = g->rh.type == FT_DATA ? recv_seg(g, g->rs) : 0;
  return g->rh.type == FT_DATA ? seg_off(&g->G, g->rb, *c) + g->rj * g->rF : 0;
}

/* Shared memory: the payload in place from the ring, verify-and-add or
 * verify-and-copy in one pass. */
static int recv_payload_shm(ring *g, undo_log *u) {
  ftar_member *m = g->m;
  ftar_links *L = g->L;
  int c, bad = 0;
  size_t off = rx_offset(g, &c), need = g->rh.len - g->r_got, k;
  const uint8_t *src = ftar_shm_peek(g->L, &k, &bad);
  if (bad) return ring_fail(g, "shared-memory ring from slot %d is corrupt", up_peer(g)->slot);
  if (k > need) k = need;
  k &= ~(size_t)3; /* whole floats; offsets in the ring are multiples of 4 */
  if (k == 0) {
    if (L->up_eof) return ring_fail(g, "slot %d closed the link", up_peer(g)->slot);
    return RX_BLOCKED;
  }
  if (rx_reducing(g)) { /* timed for the sender's choice of stores (ftar_shm.c) */
    size_t f0 = off + g->r_got / 4;
    double t0 = k >= SHM_TIMED ? tr_now() : 0;
    g->r_crc = reduce_crc(g, g->r_crc, g->buf + f0, g->save ? g->save + f0 : NULL, (const float *)(const void *)src, k / 4);
    if (t0 > 0) ftar_shm_read_took(g->L, k, tr_now() - t0);
    *undo_at(u, g->rb, c) += k / 4;
  } else {
    g->r_crc = tr_crc32c_copy(g->r_crc, g->r_dst + g->r_got, src, k);
  }
  ftar_shm_consume(g->L, k);
  m->st.bytes_recv += k;
  g->r_got += k;
  return RX_PROGRESS;
}

/* TCP: the payload from rx, or read: big payloads straight to their
 * place, small ones through rx so that one recv() brings several frames. */
static int recv_payload_tcp(ring *g) {
  ftar_links *L = g->L;
  size_t have = L->rx_tail - L->rx_head, need = g->rh.len - g->r_got;
  if (have > 0) {
    size_t k = have < need ? have : need;
    memcpy(g->r_dst + g->r_got, L->rx + L->rx_head, k);
    L->rx_head += k;
    g->r_got += k;
    return RX_PROGRESS;
  }
  L->rx_head = L->rx_tail = 0;
  int direct = need >= RX_CAP / 2;
  ssize_t k = direct ? up_recv(g, g->r_dst + g->r_got, need) : up_recv(g, L->rx, RX_CAP);
  if (k < 0) return RX_FAIL;
  if (k == 0) return RX_BLOCKED;
  if (direct) g->r_got += (size_t)k;
  else L->rx_tail = (size_t)k;
  return RX_PROGRESS;
}

/* A whole frame: reduce (TCP: from stage) and verify; a bad frame aborts
 * the collective and the undo log restores what was touched. */
static int finish_frame(ring *g, undo_log *u) {
  ftar_member *m = g->m;
  ftar_links *L = g->L;
  int c;
  size_t off = rx_offset(g, &c);
  uint32_t pcrc;
  if (L->up_shm.active) {
    pcrc = g->r_crc;
  } else if (rx_reducing(g)) {
    size_t len = g->rh.len / 4;
    pcrc = reduce_crc(g, 0, g->buf + off, g->save ? g->save + off : NULL, m->stage, len);
    *undo_at(u, g->rb, c) += len;
  } else {
    pcrc = g->rh.len ? tr_crc32c(0, g->r_dst, g->rh.len) : 0;
  }
  if (ftar_frame_crc_finish(pcrc, g->rhb) != g->rh.crc)
    return ring_fail(g, "bad checksum on %s frame %u from slot %d", ftar_type_name(g->rh.type), g->rh.index,
                     up_peer(g)->slot);
  if (g->exch && g->op == FTAR_MEAN && g->rh.type == FT_DATA) {
    float *x = g->buf + off;
    for (size_t k = 0; k < g->rh.len / 4; k++) x[k] /= 2.0f;
  }
  g->r_have = 0;
  if (g->rh.type == FT_TOKEN) {
    g->tok_recv++;
  } else {
    g->ridx++;
    g->rj++;
    skip_recv(g);
    test_fault_check(g->m->slot, g->seq, g->frames_before + g->ridx);
  }
  update_full(g);
  return RX_FRAME;
}

/* Receives what the upstream sent, frame by frame: header, payload, check.
 * Returns 1 on progress, 0 if blocked, -1 on failure (g->why). */
static int pump_recv(ring *g, undo_log *u) {
  ftar_links *L = g->L;
  int progress = 0, shm = L->up_shm.active;
  while (expecting(g) && !recv_gated(g)) {
    int r;
    if (!g->r_have) r = shm ? recv_header_shm(g) : recv_header_tcp(g);
    else if (exch_hold(g)) return progress;
    else if (g->r_got < g->rh.len) r = shm ? recv_payload_shm(g, u) : recv_payload_tcp(g);
    else r = finish_frame(g, u);
    if (r == RX_FAIL) return -1;
    if (r == RX_BLOCKED) return progress;
    if (r == RX_PROGRESS) progress = 1;
  }
  return progress;
}

/* --- the downstream link, doorbells, control --- */

/* Starts the link to our downstream for run_ep. */
static int down_start(ring *g) {
  ftar_member *m = g->m;
  ftar_links *L = g->L;
  const peer *d = down_peer(g);
  int fd;
  if (ftar_connect_to(d->host, d->port, m->o.sockbuf, 0, &fd))
    return ring_fail(g, "connect to slot %d: %s", d->slot, tr_error());
  L->down_fd = fd;
  L->down_state = DOWN_CONNECTING;
  return 0;
}

static int down_finish_connect(ring *g) {
  ftar_member *m = g->m;
  ftar_links *L = g->L;
  int err = 0;
  socklen_t el = sizeof err;
  getsockopt(L->down_fd, SOL_SOCKET, SO_ERROR, &err, &el);
  if (err) return ring_fail(g, "connect to slot %d: %s", down_peer(g)->slot, strerror(err));
  L->down_state = m->secret.len ? DOWN_AUTH : DOWN_HELLO;
  L->down_chgot = 0;
  return 0;
}

/* The downstream's challenge (the job secret): read it, answer it, then
 * CONNECT. The answer fits an empty socket buffer: sent whole or failed. */
static int down_read_challenge(ring *g) {
  ftar_member *m = g->m;
  ftar_links *L = g->L;
  int slot = down_peer(g)->slot;
  ssize_t k = recv(L->down_fd, L->down_ch + L->down_chgot, sizeof L->down_ch - L->down_chgot, MSG_DONTWAIT);
  if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
  if (k <= 0) return ring_fail(g, "slot %d closed the link before its challenge", slot);
  L->down_chgot += (size_t)k;
  if (L->down_chgot < sizeof L->down_ch) return 0;
  if (memcmp(L->down_ch, "TRAU", 4) != 0) return ring_fail(g, "slot %d sent no job-secret challenge", slot);
  uint8_t mac[AUTH_MAC];
  auth_answer(&m->secret, L->down_ch, mac);
  if (send(L->down_fd, mac, sizeof mac, MSG_DONTWAIT | MSG_NOSIGNAL) != (ssize_t)sizeof mac)
    return ring_fail(g, "slot %d: cannot answer its challenge: %s", slot, strerror(errno));
  L->down_state = DOWN_HELLO;
  return 0;
}

/* The receiver's answer to CONNECT: 'S' use the ring, 'T' use TCP. */
static int down_read_ack(ring *g) {
  ftar_member *m = g->m;
  ftar_links *L = g->L;
  int slot = down_peer(g)->slot;
  char a;
  ssize_t k = recv(L->down_fd, &a, 1, MSG_DONTWAIT);
  if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
  if (k <= 0) return ring_fail(g, "slot %d closed the link before answering CONNECT", slot);
  if (a == 'S' && L->down_shm.h) {
    L->down_shm.active = 1;
    ftar_close_fd(&L->down_shm.memfd); /* mapped on both sides now */
    m->st.links_shm++;
  } else if (a == 'T') {
    ftar_shm_unmap(&L->down_shm);
    m->st.links_tcp++;
  } else {
    return ring_fail(g, "slot %d answered CONNECT with 0x%02x", slot, (unsigned char)a);
  }
  L->down_state = DOWN_READY;
  return 0;
}

/* Reads and drops doorbell bytes. Sets *eof when the peer closed. -1 on a
 * socket error. */
static int doorbell_drain(int fd, int *eof) {
  char b[256];
  for (;;) {
    ssize_t k = recv(fd, b, sizeof b, MSG_DONTWAIT);
    if (k > 0) continue;
    if (k == 0) {
      *eof = 1;
      return 0;
    }
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
  }
}

/* Before sleeping: ask the ring peers for a doorbell, then look once more
 * (Dekker-style with the seq_cst flag and counter accesses). 1 if there is
 * something to do after all. */
static int shm_arm(ring *g) {
  ftar_links *L = g->L;
  int ready = 0;
  shm_link *U = &L->up_shm, *D = &L->down_shm;
  if (U->active && expecting(g) && !recv_gated(g) && !exch_hold(g)) {
    U->armed = 1;
    atomic_store(&U->h->cons_waiting, 1);
    if (atomic_load(&U->h->head) != U->pos) ready = 1;
  }
  if (D->active && L->down_state == DOWN_READY && (g->s_busy || send_ready(g) || token_ready(g))) {
    D->armed = 1;
    atomic_store(&D->h->prod_waiting, 1);
    if (D->pos - atomic_load(&D->h->tail) < D->size) ready = 1;
  }
  return ready;
}

static void shm_disarm(ftar_links *L) {
  if (L->up_shm.armed) atomic_store(&L->up_shm.h->cons_waiting, 0);
  if (L->down_shm.armed) atomic_store(&L->down_shm.h->prod_waiting, 0);
  L->up_shm.armed = L->down_shm.armed = 0;
}

/* Checks the control state: 1 if this collective must stop. */
static int ctl_check(ring *g, unsigned *gen_seen) {
  ftar_member *m = g->m;
  unsigned gen = atomic_load(&m->gen);
  if (gen == *gen_seen) return 0;
  *gen_seen = gen;
  pthread_mutex_lock(&m->mu);
  int failed = m->failed;
  uint64_t ab = m->abort_ep;
  pthread_mutex_unlock(&m->mu);
  if (failed) {
    g->fatal = 1;
    ring_fail(g, "control link down");
    return 1;
  }
  if (ab > g->ep) {
    ring_fail(g, "epoch %llu aborts epoch %llu", (unsigned long long)ab, (unsigned long long)g->ep);
    return 1;
  }
  return 0;
}

/* --- one attempt --- */

/* Tokens of the pass: around the ring (p-1 each way) for FTAR_PASS_RING
 * and _TOKENS, one along the chain for _RELEASE (rank r receives token r
 * and sends r+1), none otherwise. */
static void tokens_set(ring *g) {
  int p = g->p, r = g->r;
  if (g->kind == FTAR_PASS_RING || g->kind == FTAR_PASS_TOKENS) {
    g->tok_send_n = g->tok_recv_n = p - 1;
  } else if (g->kind == FTAR_PASS_RELEASE) {
    g->tok_send_n = r < p - 1;
    g->tok_recv_n = r > 0;
    g->tok_base_send = r;
    g->tok_base_recv = r - 1;
  }
}

/* A fresh ring for pass a of collective seq in run_ep, and an empty undo
 * log (the last attempt's was restored before this one). -1 when out of
 * memory. */
static int ring_init(ftar_member *m, ring *g, undo_log *u, const ftar_pass *a, uint64_t seq) {
  ftar_links *L = &m->lk[a->level];
  memset(g, 0, sizeof *g);
  g->m = m;
  g->L = L;
  g->kind = a->kind;
  g->buf = a->buf;
  g->n = a->n;
  g->p = L->n;
  g->r = L->r;
  int bcast = a->kind == FTAR_PASS_BCAST;
  pthread_once(&exch_once, exch_read);
  g->exch = exch_on && g->p == 2 && a->kind == FTAR_PASS_RING && /* the flat ring (not the hierarchy's passes) */
            (a->bucket && a->bucket < a->n ? a->bucket : a->n) <= EXCH_MAX;
  geom_set(&g->G, a->n, a->bucket, bcast || g->exch ? 1 : g->p, a->outer_p, a->outer_c);
  g->rd = a->rd;
  g->rd_off = a->rd_off;
  /* buckets come in two lengths, B and the rest (frames of a shorter one may be longer) */
  size_t f0 = ring_frame_floats(g, b_len(&g->G, 0)), f1 = ring_frame_floats(g, b_len(&g->G, g->G.nb ? g->G.nb - 1 : 0));
  g->Fmax = f0 > f1 ? f0 : f1;
  g->rsteps = bcast || a->kind == FTAR_PASS_AG ? 0 : g->exch ? 1 : g->p - 1;
  g->nsteps = bcast || g->exch ? 1 : a->kind == FTAR_PASS_RS || a->kind == FTAR_PASS_AG ? g->p - 1 : 2 * (g->p - 1);
  g->op = a->op;
  g->flags = (uint16_t)((unsigned)a->op | (g->exch ? FTAR_FLAG_EXCH : 0) | ((unsigned)a->phase & 0xff) << 8);
  g->frames_before = a->frames_before;
  g->no_stall = a->no_stall;
  g->div = a->kind == FTAR_PASS_REDUCE ? a->div : 0;
  g->save = a->save;
  g->save_nt = save_nt_for(m, L, a->n);
  g->ep = m->run_ep;
  g->seq = seq;
  g->sF = g->rF = bucket_F(g, 0);
  tokens_set(g);
  g->cross = g->p > 1 && !same_host(m, down_peer(g));
  pthread_once(&test_fault_once, test_fault_read);
  skip_send(g);
  skip_recv(g);
  if (bcast && g->r == g->p - 1) g->sb = g->G.nb; /* the chain's end passes nothing on */
  if (bcast && g->r == 0) g->rb = g->G.nb;         /* its root receives nothing */
  update_full(g);
  size_t need = g->G.nb * (size_t)g->G.p;
  if (need > u->cap) {
    free(u->copied);
    u->cap = 0;
    if (!(u->copied = malloc(need * sizeof(size_t)))) return -1;
    u->cap = need;
  }
  u->G = g->G;
  u->save = a->save;
  if (need) memset(u->copied, 0, need * sizeof(size_t));
  return 0;
}

/* Sends and receives what the links take now: 1 on progress, 0 if
 * blocked, -1 on failure (g->why). */
static int ring_pump(ring *g, undo_log *u) {
  ftar_links *L = g->L;
  int pr = 0, r;
  if (L->down_state != DOWN_CONNECTING) {
    if ((r = pump_send(g, u)) < 0) return -1;
    pr |= r;
  }
  if (L->up_fd >= 0) {
    if ((r = pump_recv(g, u)) < 0) return -1;
    pr |= r;
    if (pr) { /* receiving may have unblocked sends */
      if (L->down_state != DOWN_CONNECTING && (r = pump_send(g, u)) < 0) return -1;
    }
  }
  return pr;
}

/* Every member holds the full result: the last token went around. */
static int ring_done(const ring *g) {
  return g->full && g->tok_recv == g->tok_recv_n && g->tok_sent == g->tok_send_n && !g->s_busy;
}

/* No progress: 1 (g->why set) if a started collective stalled past the
 * deadline or the call's time is up (*timed_out). */
static int ring_expired(ring *g, double now, double t_end, int *timed_out) {
  ftar_member *m = g->m;
  double since = g->t_progress > g->t_local ? g->t_progress : g->t_local;
  if (g->started && !g->no_stall && now - since > m->deadline) {
    ring_fail(g, "no progress for %.2f s (peer stalled)", now - since);
    return 1;
  }
  if (now > t_end) {
    ring_fail(g, "timed out after %.1f s waiting for peers", m->o.timeout);
    *timed_out = 1;
    return 1;
  }
  return 0;
}

/* The descriptors one wait watches, and where each is in pf. */
typedef struct {
  struct pollfd pf[4 + PENDING_MAX];
  int np, i_up, i_down, i_lis, i_pend0;
} ring_pollset;

static void pollset_build(const ring *g, ring_pollset *ps) {
  const ftar_member *m = g->m;
  const ftar_links *L = g->L;
  struct pollfd *pf = ps->pf;
  int np = 0;
  ps->i_up = ps->i_down = -1;
  pf[np++] = (struct pollfd){.fd = m->wake[0], .events = POLLIN};
  ps->i_lis = np;
  pf[np++] = (struct pollfd){.fd = m->lfd, .events = POLLIN};
  if (L->up_fd >= 0 && expecting(g) && !L->up_eof && !recv_gated(g) && !exch_hold(g)) { /* data, or with a ring: doorbells and EOF */
    ps->i_up = np;
    pf[np++] = (struct pollfd){.fd = L->up_fd, .events = POLLIN};
  }
  if (L->down_fd >= 0 && !L->down_eof) {
    short ev = 0;
    if (L->down_state == DOWN_CONNECTING) ev = POLLOUT;
    else if (L->down_state == DOWN_ACK || L->down_state == DOWN_AUTH) ev = POLLIN;
    else if (L->down_shm.active) ev = send_pending(g) ? POLLIN : 0;
    else if (want_send(g)) ev = POLLOUT;
    if (ev) {
      ps->i_down = np;
      pf[np++] = (struct pollfd){.fd = L->down_fd, .events = ev};
    }
  }
  ps->i_pend0 = np;
  for (int i = 0; i < m->npend; i++)
    if (!m->pend[i].complete) pf[np++] = (struct pollfd){.fd = m->pend[i].fd, .events = POLLIN};
  ps->np = np;
}

/* The downstream link is readable or writable: finish the connect, read
 * the answer to CONNECT, or (shared memory) drain doorbells and see EOF. */
static int down_event(ring *g) {
  ftar_links *L = g->L;
  if (L->down_state == DOWN_CONNECTING) return down_finish_connect(g);
  if (L->down_state == DOWN_ACK) return down_read_ack(g);
  if (L->down_state == DOWN_AUTH) return down_read_challenge(g);
  if (L->down_shm.active) {
    int slot = down_peer(g)->slot;
    if (doorbell_drain(L->down_fd, &L->down_eof) < 0 || (L->down_eof && send_pending(g)))
      return ring_fail(g, "slot %d closed the link", slot);
  }
  return 0;
}

/* Handles what poll reported. 0, or -1 (g->why) to abort. */
static int pollset_handle(ring *g, const ring_pollset *ps) {
  ftar_member *m = g->m;
  ftar_links *L = g->L;
  const struct pollfd *pf = ps->pf;
  if (pf[0].revents) ftar_drain_fd(m->wake[0]);
  if (pf[ps->i_lis].revents) ftar_port_accept(m);
  if (ps->np > ps->i_pend0) ftar_port_read(m);
  if (ps->i_down >= 0 && pf[ps->i_down].revents && down_event(g)) return -1;
  if (ps->i_up >= 0 && pf[ps->i_up].revents && L->up_shm.active) {
    int slot = up_peer(g)->slot;
    if (doorbell_drain(L->up_fd, &L->up_eof) < 0)
      return ring_fail(g, "receive from slot %d: %s", slot, strerror(errno));
    /* on EOF, up_recv fails once the ring is empty: data sent before
     * the close is still delivered */
  }
  return 0;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

/* Shared-memory links, spinning: watch the rings' counters (and the
 * control generation, our producer's progress) in memory for up to
 * SHM_WATCH_S before the round of poll() + sched_yield(), which costs a
 * few microseconds of syscalls: a peer's next frame or freed space
 * usually comes sooner (perf, 2 ranks, 16-byte all-reduce: 4.4 us a
 * collective, almost all of it in that round; OpenMPI: 0.17 us). 1 if
 * something moved. */
#define SHM_WATCH_S 10e-6
static long cpus_online = 1;
static pthread_once_t cpus_once = PTHREAD_ONCE_INIT;
static void cpus_read(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  cpus_online = n > 0 ? n : 1;
}

/* Only where a rank that spins cannot be sitting on the core its peer
 * needs: no more members than cores (OpenMPI yields when oversubscribed,
 * too), and not beside a producer (a bucketed call's backward). */
static int shm_watch_worth(const ring *g) {
  pthread_once(&cpus_once, cpus_read);
  return !g->rd && g->p <= cpus_online;
}

static int shm_watch(const ring *g) {
  ftar_member *m = g->m;
  ftar_links *L = g->L; /* the ring's counters, not ours to write */
  shm_link *U = &L->up_shm, *D = &L->down_shm;
  if ((!U->active && !D->active) || !shm_watch_worth(g)) return 0;
  uint64_t head = U->active ? atomic_load(&U->h->head) : 0, tail = D->active ? atomic_load(&D->h->tail) : 0;
  unsigned gen = atomic_load(&m->gen);
  size_t from = g->rd ? atomic_load(&g->rd->from) : 0;
  double t_end = tr_now() + SHM_WATCH_S;
  for (int i = 1;; i++) {
    cpu_relax();
    if ((U->active && atomic_load(&U->h->head) != head) || (D->active && atomic_load(&D->h->tail) != tail) ||
        atomic_load(&m->gen) != gen || (g->rd && atomic_load(&g->rd->from) != from))
      return 1;
    if (i % 64 == 0 && tr_now() > t_end) return 0;
  }
}

/* Nothing moved: poll without sleeping while the last progress is recent
 * (spin), else arm the shared-memory doorbells and sleep up to POLL_MS;
 * then handle what woke us. 0, or -1 (g->why) to abort. */
static int ring_wait(ring *g, double now, double spin) {
  /* blocked on our own next bucket: the producer (backward, on the core
   * we would spin on) wakes us through wake[] when it is final */
  int spinning = now - g->t_progress < spin && !recv_gated(g);
  if (spinning && shm_watch(g)) return 0;
  ring_pollset ps;
  pollset_build(g, &ps);
  if (!spinning && shm_arm(g)) return 0; /* progress became possible while arming */
  int rc = poll(ps.pf, (nfds_t)ps.np, spinning ? 0 : POLL_MS);
  shm_disarm(g->L);
  if (rc == 0 && spinning) sched_yield(); /* let a runnable peer have the core */
  if (rc < 0 && errno != EINTR) return ring_fail(g, "poll: %s", strerror(errno));
  if (rc <= 0) return 0;
  return pollset_handle(g, &ps);
}

/* Runs one pass in run_ep. R_DONE, R_ABORT (links closed, g->why,
 * g->full tells whether buf holds the pass's result), R_FATAL (timeout or
 * control link down). */
static int ring_run(ftar_member *m, ring *g, undo_log *u, const ftar_pass *a, uint64_t seq, double t_end,
                    int *timed_out) {
  *timed_out = 0;
  if (ring_init(m, g, u, a, seq)) {
    ring_fail(g, "out of memory for the undo log");
    g->fatal = 1;
    return R_FATAL;
  }
  unsigned gen_seen = atomic_load(&m->gen) - 1; /* check once at the start */
  g->t_progress = tr_now();
  double spin = spin_seconds(m);
  if (g->L->down_fd < 0 && down_start(g)) goto abort;
  int stopping = 0;
  for (;;) {
    /* an aborting epoch (or a lost coordinator) stops the collective once
     * the ring is blocked, not at once: what peers already delivered (say
     * the last token of a member that finished and left) is consumed first */
    if (!stopping && ctl_check(g, &gen_seen)) stopping = 1;
    ftar_port_match(m);
    int pr = ring_pump(g, u);
    if (pr < 0) goto abort;
    double now = tr_now();
    if (pr) g->t_progress = now;
    if (ring_done(g)) return R_DONE;
    /* our own gradients are late, not a peer: a peer that waits on its
     * own the same way sends nothing meanwhile either */
    if (!pr && waiting_local(g)) g->t_local = now;
    if (pr) continue;
    if (stopping || ring_expired(g, now, t_end, timed_out) || ring_wait(g, now, spin) < 0) goto abort;
  }
abort:
  ftar_links_close(m);
  return g->fatal || *timed_out ? R_FATAL : R_ABORT;
}

/* --- passes for other planes (ftar_hier.c) --- */

struct ftar_ring_run {
  ring g;
  undo_log u;
};

ftar_ring_run *ftar_ring_run_new(void) { return calloc(1, sizeof(ftar_ring_run)); }

void ftar_ring_run_free(ftar_ring_run *rr) {
  if (!rr) return;
  free(rr->u.copied);
  free(rr);
}

void ftar_ring_undo(ftar_ring_run *rr, float *buf) { undo_restore(buf, &rr->u); }

int ftar_in_copy_reserve(ftar_member *m, size_t n) {
  if (n <= m->in_cap) return 0;
  float *nc = realloc(m->in_copy, n * sizeof(float));
  if (!nc) return tr_fail(TR_ENOMEM, "ftar_allreduce: out of memory for the input copy (%zu floats)", n);
  m->in_copy = nc;
  m->in_cap = n;
  return 0;
}

int ftar_ring_pass(ftar_member *m, ftar_ring_run *rr, const ftar_pass *a, uint64_t seq, double t_end, int *full,
                   char *why, size_t why_len, uint32_t *frames) {
  int timed_out;
  int r = ring_run(m, &rr->g, &rr->u, a, seq, t_end, &timed_out);
  *full = rr->g.full;
  *frames = rr->g.ridx;
  snprintf(why, why_len, "%s", rr->g.why);
  return r == R_DONE ? FTAR_PLANE_DONE : r == R_FATAL ? FTAR_PLANE_FATAL : FTAR_PLANE_ABORT;
}

/* --- the ring as a data plane --- */

typedef struct {
  ftar_plane base; /* first: a ftar_plane * is a ring_plane * */
  ftar_pass a;
  undo_log *u;
  ring *g;
} ring_plane;

static int ring_plane_run(ftar_plane *pl, ftar_member *m, uint64_t seq, double t_end, int *full, int *fatal_rc,
                          char *why, size_t why_len) {
  ring_plane *rp = (ring_plane *)pl;
  (void)fatal_rc; /* FTAR_ETIMEOUT, or the control link's failure */
  int rc = ftar_in_copy_reserve(m, rp->a.n);
  if (rc) return rc;
  rp->a.save = m->in_copy;
  ftar_links *L = &m->lk[FTAR_LEVEL_FLAT];
  if (L->ep != m->run_ep) ftar_links_view(L, m->run_ep, m->run_mem, m->run_n, m->run_r); /* the epoch's, once */
  int timed_out;
  int rr = ring_run(m, rp->g, rp->u, &rp->a, seq, t_end, &timed_out);
  *full = rp->g->full;
  snprintf(why, why_len, "%s", rp->g->why);
  return rr == R_DONE ? FTAR_PLANE_DONE : rr == R_FATAL ? FTAR_PLANE_FATAL : FTAR_PLANE_ABORT;
}

static int ring_plane_restore(ftar_plane *pl, ftar_member *m) {
  ring_plane *rp = (ring_plane *)pl;
  (void)m;
  undo_restore(rp->a.buf, rp->u); /* host memory: cannot fail */
  return 0;
}

static void ring_plane_leave(ftar_plane *pl, ftar_member *m) {
  (void)pl;
  ftar_links_close(m);
}

ftar_plane *ftar_ring_plane_new(float *buf, size_t n, ftar_op op, size_t bucket, const ftar_ready *rd) {
  ring_plane *rp = calloc(1, sizeof *rp);
  if (!rp) return NULL;
  *rp = (ring_plane){.base = {ring_plane_run, ring_plane_restore, ring_plane_leave},
                     .a = {.buf = buf,
                           .n = n,
                           .op = op,
                           .bucket = bucket,
                           .rd = rd,
                           .level = FTAR_LEVEL_FLAT,
                           .kind = FTAR_PASS_RING}};
  rp->u = calloc(1, sizeof *rp->u);
  rp->g = calloc(1, sizeof *rp->g);
  if (!rp->u || !rp->g) {
    ftar_ring_plane_free(&rp->base);
    return NULL;
  }
  return &rp->base;
}

void ftar_ring_plane_free(ftar_plane *pl) {
  ring_plane *rp = (ring_plane *)pl;
  if (!rp) return;
  free(rp->g);
  if (rp->u) free(rp->u->copied);
  free(rp->u);
  free(rp);
}
