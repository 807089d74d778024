/* ftar_shm.c — same-host shared-memory rings between FTAR ring neighbours.
 *
 * A same-host link's frames go through a ring the sender (producer) creates
 * as a memfd and offers in its CONNECT frame (pid, fd number, size, a random
 * token); the receiver (consumer) maps it through /proc/<pid>/fd/<n> and
 * checks size and token before trusting it. Single producer, single
 * consumer; head/tail count bytes. The TCP link stays for the handshake,
 * 1-byte doorbells when a side sleeps (the *_waiting flags, set by the
 * ring's poll loop) and EOF when a peer dies, so failure handling is the
 * TCP path's. Each ring level's links (ftar_links) have their own rings.
 * Counters a peer corrupted are reported (-1 / *bad), never
 * followed.
 *
 * Not here: frame headers, CRCs and when to sleep (ftar_ring.c), the
 * CONNECT handshake (ftar_port.c, ftar_ring.c). Called by: ftar_ring.c and
 * ftar_port.c.
 */
#define _GNU_SOURCE /* memfd_create */
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "ftar_member_internal.h"
#include "util.h"

void ftar_shm_unmap(shm_link *S) {
  if (S->h) munmap(S->h, SHM_DATA + S->size);
  if (S->memfd >= 0) close(S->memfd);
  memset(S, 0, sizeof *S);
  S->memfd = -1;
}

/* Producer: creates and maps the ring offered in CONNECT. */
int ftar_shm_create(ftar_links *L, uint32_t size, int stores) {
  shm_link *S = &L->down_shm;
  ftar_shm_unmap(S);
  int fd = memfd_create("ftar-link", MFD_CLOEXEC);
  if (fd < 0) return -1;
  if (ftruncate(fd, SHM_DATA + size) != 0) {
    close(fd);
    return -1;
  }
  void *p = mmap(NULL, SHM_DATA + size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return -1;
  }
  S->h = p;
  S->data = (uint8_t *)p + SHM_DATA;
  S->size = size;
  S->memfd = fd;
#if defined(__x86_64__)
  S->stores = stores < 0 ? -1 : stores > 0;
#else
  S->stores = 0; /* no non-temporal copy here */
  (void)stores;
#endif
  S->stream = S->stores > 0;
  S->h->magic = SHM_MAGIC;
  S->h->size = size;
  uint64_t tok = 0;
  if (getrandom(&tok, sizeof tok, GRND_NONBLOCK) != (ssize_t)sizeof tok)
    tok = (uint64_t)(tr_now() * 1e9) ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)p;
  S->h->token = tok;
  return 0;
}

/* Consumer: maps the ring a CONNECT payload describes; checks it is what the
 * sender announced (size, token) before trusting it. */
int ftar_shm_attach(ftar_links *L, const uint8_t *pay) {
  shm_link *S = &L->up_shm;
  ftar_shm_unmap(S);
  uint32_t pid = ftw_get32(pay + 8), fdn = ftw_get32(pay + 12), size = ftw_get32(pay + 16);
  uint64_t tok = ftw_get64(pay + 24);
  if (size < 65536 || size > (64u << 20) || (size & (size - 1))) return -1;
  char path[64];
  snprintf(path, sizeof path, "/proc/%u/fd/%u", pid, fdn);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return -1;
  struct stat st;
  void *p = MAP_FAILED;
  if (fstat(fd, &st) == 0 && st.st_size == (off_t)(SHM_DATA + size))
    p = mmap(NULL, SHM_DATA + size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return -1;
  shm_hdr *h = p;
  if (h->magic != SHM_MAGIC || h->size != size || h->token != tok) {
    munmap(p, SHM_DATA + size);
    return -1;
  }
  S->h = h;
  S->data = (uint8_t *)p + SHM_DATA;
  S->size = size;
  S->pos = atomic_load(&h->tail);
  S->active = 1;
  return 0;
}

/* How the producer stores frames into the ring. Plain (cached) stores
 * need each line's ownership from the consumer, which read it last; where
 * the two cores share no cache (another CCX or socket; this project's VMs'
 * two vCPUs, minutes at a time) each of those transfers crosses the chip
 * and a copy into the ring ran at 2.4 GB/s, against 24-28 GB/s with
 * non-temporal stores, which take no ownership and go to memory. Where the
 * cores share an L3 the non-temporal stores lose: the consumer then reads
 * memory instead of the L3 (FTAR 2 ranks, 1-4 MiB: 6.7 against 12 GB/s).
 *
 * So, by default, the producer times its copies into the ring and the
 * consumer its reduce pass over them (pieces of STORE_PIECE bytes or more,
 * gathered in samples of STORE_SAMPLE; the ring's blocks are tagged with
 * how they were stored, and the consumer publishes a rate per kind in the
 * ring's header), and the producer keeps the kind that costs the two of
 * them less per byte (the other kind only if it costs STORE_MARGIN of it
 * or less). Without the consumer's rates (it has not published both, or
 * never reduces on this link) the producer's own copies decide, and only
 * by a wide margin, STORE_MARGIN_BLIND: they are not what shows a shared
 * cache (there plain stores ran at 10-45 GB/s against 25-30 non-temporal,
 * and the consumer paid for the latter; with no shared cache 2.4 against
 * 28).
 *
 * The other kind is tried in trials of STORE_TRIAL samples (copies of at
 * most STORE_TRIAL_MAX bytes) every STORE_TRIAL_EVERY seconds, as the
 * cores can move under a running job; the first waits for the consumer's
 * first rate. The choice is made once the consumer has read the trial,
 * never between trials, so a fresh figure is never weighed against a
 * stale one from another workload. Neither side counts the first
 * STORE_SETTLE samples after the kind changed (a lone frame of the other
 * kind measured 5-10x slower than a run of them: its lines meet the wrong
 * caches), its first STORE_WARM, nor any in the ring's first lap (pages
 * fault in, and plain stores into lines the consumer never held ran at
 * 20-30 GB/s where they later ran at 2.4: judged on those, a link kept
 * plain stores in 3 of 10 runs where the cores share no cache). A trial of
 * the worse kind costs about 0.5 ms (1.5 MiB at 2.4 GB/s against 28),
 * 0.2% of the time between trials. Figures: bench/ftar_frames.sh
 * KNOB=shm-stores. */
#define STORE_PIECE ((size_t)SHM_TIMED) /* copies and reads timed: this big or more */
#define STORE_SAMPLE ((size_t)16 << 10) /* a sample: timed pieces of one kind, this many bytes */
#define STORE_TRIAL_MAX ((size_t)128 << 10)
#define STORE_TRIAL 12 /* samples */
#define STORE_TRIAL_EVERY 0.25
#define STORE_SETTLE 3
#define STORE_WARM 8
#define STORE_MARGIN 0.9
#define STORE_MARGIN_BLIND 0.33 /* without the consumer's rates (they are what shows a shared cache) */
#define STORE_BLIND 48          /* copies a first trial waits for the consumer's rates */

#if defined(__x86_64__)
static void copy_stream(uint8_t *d, const uint8_t *s, size_t n) {
  size_t head = (16 - ((uintptr_t)d & 15)) & 15, i;
  if (head > n) head = n;
  memcpy(d, s, head);
  for (i = head; n - i >= 64; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)(s + i)), b = _mm_loadu_si128((const __m128i *)(s + i + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32)), e = _mm_loadu_si128((const __m128i *)(s + i + 48));
    _mm_stream_si128((__m128i *)(d + i), a);
    _mm_stream_si128((__m128i *)(d + i + 16), b);
    _mm_stream_si128((__m128i *)(d + i + 32), c);
    _mm_stream_si128((__m128i *)(d + i + 48), e);
  }
  memcpy(d + i, s + i, n - i); /* ftar_shm_write's sfence orders the streamed lines before head */
}
#endif

/* Bytes stored non-temporally: n or 0. */
static size_t ring_copy(uint8_t *d, const uint8_t *s, size_t n, int stream) {
#if defined(__x86_64__)
  if (stream && n >= 256) {
    copy_stream(d, s, n);
    return n;
  }
#endif
  (void)stream;
  memcpy(d, s, n);
  return 0;
}

static double ewma(double old, double r) { return old > 0 ? 0.5 * old + 0.5 * r : r; }

/* Adds a timed piece of this kind, at ring position pos (bytes since the
 * ring was made). The rate of the sample it completes, if that sample
 * counts (not warming up, not settling after a change of kind), else 0.
 * *done set when it completed one. */
static double stores_sample(store_clock *c, uint64_t pos, uint32_t size, int kind, size_t n, double sec, int *done) {
  *done = 0;
  c->bytes[kind] += n;
  c->sec[kind] += sec;
  if (c->bytes[kind] < STORE_SAMPLE) return 0;
  double r = c->sec[kind] > 0 ? (double)c->bytes[kind] / c->sec[kind] : 0;
  c->bytes[kind] = 0;
  c->sec[kind] = 0;
  *done = 1;
  if (c->warm < STORE_WARM || pos < size) { /* the ring's first lap: lines the other side never held */
    if (c->warm < STORE_WARM) c->warm++;
    return 0;
  }
  if (kind != c->kind) {
    c->kind = kind;
    c->run = 0;
  }
  return ++c->run > STORE_SETTLE ? r : 0;
}

/* A trial waits until the consumer has a rate for the kind in use (or
 * for STORE_BLIND copies: a link whose consumer never reduces). */
static int reader_ready(shm_link *S) {
  if (atomic_load_explicit(&S->h->read_count[S->stream], memory_order_relaxed) > 0) return 1;
  return ++S->blind > STORE_BLIND;
}

/* The kind of stores (1 non-temporal) for a copy of up to *space bytes (a
 * trial copy caps *space); *t0 = tr_now() if the copy is to be timed, else
 * 0. */
static int stores_pick(shm_link *S, size_t *space, double *t0) {
  *t0 = 0;
  if (S->stores >= 0 || *space < STORE_PIECE) return S->stream;
  *t0 = tr_now();
  if (S->trial == 0 && !S->judging && S->rate[S->stream] > 0 && *t0 >= S->next_trial && reader_ready(S)) {
    S->trial = STORE_TRIAL;
    S->next_trial = *t0 + STORE_TRIAL_EVERY;
    S->judge_at = atomic_load_explicit(&S->h->read_count[!S->stream], memory_order_relaxed) + STORE_TRIAL / 2;
  }
  if (S->trial == 0) return S->stream;
  if (*space > STORE_TRIAL_MAX) *space = STORE_TRIAL_MAX;
  return !S->stream;
}

/* The consumer's published rate for bytes stored that way (0: none, or
 * not a sane number: it only steers, and a peer's bytes are not trusted). */
static double read_rate(const shm_link *S, int kind) {
  uint64_t bits = atomic_load_explicit(&S->h->read_rate[kind], memory_order_relaxed);
  double r;
  memcpy(&r, &bits, sizeof r);
  return r > 0 && r < 1e15 ? r : 0;
}

/* Seconds per byte stored that way: our copy, plus the consumer's reduce
 * pass over it where it has timed both kinds (where the cores share a
 * cache, non-temporal stores cost the consumer, not us). */
static double store_cost(const shm_link *S, int kind, int with_reader) {
  return 1.0 / S->rate[kind] + (with_reader ? 1.0 / read_rate(S, kind) : 0);
}

/* Records a timed copy. After a trial, once the consumer has read enough
 * of it (or after STORE_TRIAL more samples), keeps the cheaper kind (the
 * other only by a margin: no flapping between two about equal): both
 * measured within the last few copies, so a change of workload (bigger
 * buffers, another path through the ring) never weighs a fresh figure
 * against a stale one. */
static void stores_learn(shm_link *S, int kind, size_t bytes, double t0) {
  if (t0 == 0 || bytes < STORE_PIECE) return;
  int done;
  double r = stores_sample(&S->clock, S->pos, S->size, kind, bytes, tr_now() - t0, &done);
  if (r > 0) S->rate[kind] = ewma(S->rate[kind], r);
  if (kind != S->stream) {
    if (done && S->trial > 0 && --S->trial == 0) {
      S->judging = 1;
      S->patience = STORE_TRIAL;
    }
    return;
  }
  if (!S->judging || !done) return;
  int other = !kind;
  if (atomic_load_explicit(&S->h->read_count[other], memory_order_relaxed) < S->judge_at && --S->patience > 0) return;
  S->judging = 0;
  if (S->rate[0] > 0 && S->rate[1] > 0) {
    int reader = read_rate(S, 0) > 0 && read_rate(S, 1) > 0;
    double margin = reader ? STORE_MARGIN : STORE_MARGIN_BLIND;
    if (store_cost(S, other, reader) < margin * store_cost(S, kind, reader)) S->stream = other;
  }
}

static unsigned tag_shift(uint32_t size) {
  unsigned sh = 14;
  while ((size >> sh) > SHM_TAGS) sh++;
  return sh;
}

/* Producer: tags the blocks of [pos, pos + n) with the kind of stores. */
static void stores_tag(shm_link *S, uint64_t pos, size_t n, int kind) {
  unsigned sh = tag_shift(S->size);
  uint64_t nb = S->size >> sh, last = (pos + n - 1) >> sh;
  for (uint64_t b = pos >> sh; b <= last; b++) {
    _Atomic uint8_t *t = &S->h->tag[b & (nb - 1)];
    if (atomic_load_explicit(t, memory_order_relaxed) != kind)
      atomic_store_explicit(t, (uint8_t)kind, memory_order_relaxed);
  }
}

/* Consumer: the reduce of the next n bytes took sec. Published per kind of
 * stores (the blocks' tags; skipped where they differ) for the producer. */
void ftar_shm_read_took(ftar_links *L, size_t n, double sec) {
  shm_link *S = &L->up_shm;
  if (n < STORE_PIECE || !(sec > 0)) return;
  unsigned sh = tag_shift(S->size);
  uint64_t nb = S->size >> sh;
  int kind = atomic_load_explicit(&S->h->tag[(S->pos >> sh) & (nb - 1)], memory_order_relaxed), done;
  if (kind > 1 || atomic_load_explicit(&S->h->tag[((S->pos + n - 1) >> sh) & (nb - 1)], memory_order_relaxed) != kind)
    return;
  double r = stores_sample(&S->clock, S->pos, S->size, kind, n, sec, &done);
  if (r == 0) return;
  S->rread[kind] = ewma(S->rread[kind], r);
  uint64_t bits;
  memcpy(&bits, &S->rread[kind], sizeof bits);
  atomic_store_explicit(&S->h->read_rate[kind], bits, memory_order_relaxed);
  atomic_store_explicit(&S->h->read_count[kind], ++S->nread[kind], memory_order_release);
}

static void doorbell(int fd) {
  char b = 'd';
  ssize_t w = send(fd, &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT); /* EAGAIN: one is pending already */
  (void)w;
}

/* Producer: copies as much of iov as fits; adds to *streamed the bytes
 * stored non-temporally. Bytes written, or -1 if the consumer corrupted
 * the counters. */
ssize_t ftar_shm_write(ftar_links *L, const struct iovec *iov, int niov, uint64_t *streamed) {
  shm_link *S = &L->down_shm;
  uint64_t tail = atomic_load_explicit(&S->h->tail, memory_order_acquire), head = S->pos;
  if (tail > head || head - tail > S->size) return -1;
  size_t space = S->size - (size_t)(head - tail), done = 0, want = 0;
  for (int i = 0; i < niov; i++) want += iov[i].iov_len;
  if (space > want) space = want;
  double t0;
  int stream = stores_pick(S, &space, &t0);
  for (int i = 0; i < niov && done < space; i++) {
    size_t n = iov[i].iov_len < space - done ? iov[i].iov_len : space - done;
    size_t off = (size_t)(head + done) & (S->size - 1), first = S->size - off < n ? S->size - off : n;
    *streamed += ring_copy(S->data + off, iov[i].iov_base, first, stream);
    *streamed += ring_copy(S->data, (const uint8_t *)iov[i].iov_base + first, n - first, stream);
    done += n;
  }
  if (done) {
#if defined(__x86_64__)
    if (stream) _mm_sfence(); /* non-temporal stores are weakly ordered: visible before head */
#endif
    if (S->stores < 0) {
      stores_tag(S, head, done, stream);
      stores_learn(S, stream, done, t0);
    }
    S->pos = head + done;
    atomic_store(&S->h->head, S->pos);
    uint32_t one = 1;
    if (atomic_load(&S->h->cons_waiting) && atomic_compare_exchange_strong(&S->h->cons_waiting, &one, 0))
      doorbell(L->down_fd);
  }
  return (ssize_t)done;
}

/* Consumer: copies up to cap bytes out. Bytes read, or -1 if corrupt. */
ssize_t ftar_shm_read(ftar_links *L, void *dst, size_t cap) {
  shm_link *S = &L->up_shm;
  uint64_t head = atomic_load_explicit(&S->h->head, memory_order_acquire), tail = S->pos;
  if (head < tail || head - tail > S->size) return -1;
  size_t n = (size_t)(head - tail);
  if (n > cap) n = cap;
  if (n) {
    size_t off = (size_t)tail & (S->size - 1), first = S->size - off < n ? S->size - off : n;
    memcpy(dst, S->data + off, first);
    memcpy((uint8_t *)dst + first, S->data, n - first);
    S->pos = tail + n;
    atomic_store(&S->h->tail, S->pos);
    uint32_t one = 1;
    if (atomic_load(&S->h->prod_waiting) && atomic_compare_exchange_strong(&S->h->prod_waiting, &one, 0))
      doorbell(L->up_fd);
  }
  return (ssize_t)n;
}

/* Consumer, zero-copy: the contiguous bytes readable in place (up to the
 * ring's end), or NULL with *n = 0 if none; *bad set if the counters are
 * corrupt. */
const uint8_t *ftar_shm_peek(ftar_links *L, size_t *n, int *bad) {
  shm_link *S = &L->up_shm;
  uint64_t head = atomic_load_explicit(&S->h->head, memory_order_acquire), tail = S->pos;
  *n = 0;
  if (head < tail || head - tail > S->size) {
    *bad = 1;
    return NULL;
  }
  size_t avail = (size_t)(head - tail), off = (size_t)tail & (S->size - 1);
  *n = avail < S->size - off ? avail : S->size - off;
  return *n ? S->data + off : NULL;
}

void ftar_shm_consume(ftar_links *L, size_t n) {
  shm_link *S = &L->up_shm;
  S->pos += n;
  atomic_store(&S->h->tail, S->pos);
  uint32_t one = 1;
  if (atomic_load(&S->h->prod_waiting) && atomic_compare_exchange_strong(&S->h->prod_waiting, &one, 0))
    doorbell(L->up_fd);
}
