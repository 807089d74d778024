/* pipeline_link.c — framed messages over TCP between neighbouring pipeline
 * stages, with a reader thread per link (see pipeline_link.h). It knows
 * nothing of graphs or schedules: pipeline_stage.c says what to expect.
 */
#include "pipeline_link.h"

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "proto.h"
#include "util.h"

#define PL_MAGIC 0x50495045u /* "PIPE" */
/* How far the emulated wire may put a message's hand-over time ahead of
 * its arrival (sent_at: when its last byte would have left) beyond the
 * message's own time on the wire. */
#define PL_SENT_AT_SLACK 0.01
#define PL_GRACE_MAX 3600.0 /* the most a PL_WAIT may widen a wait by (s) */

typedef struct msg {
  pl_header h;
  void *payload;
  struct msg *next;
} msg;

struct pl_link {
  int fd;
  char peer[64];
  uint64_t max_bytes; /* the largest payload a message may carry */
  pthread_t reader;
  pthread_mutex_t mu;
  pthread_cond_t cv;   /* a message queued, or the reader stopped (CLOCK_MONOTONIC) */
  pthread_cond_t room; /* the queue has room again, or the link is being freed */
  msg *head, *tail;
  int queued;          /* messages in the queue (at most PL_QUEUE_DEPTH) */
  uint64_t queued_bytes; /* their payload (past the first, at most queue_max) */
  uint64_t queue_max;
  int stopping;        /* pl_link_free: the reader stops waiting for room */
  int closed;       /* the reader stopped: EOF or an error (why) */
  char why[160];
  uint64_t sent, received;
  double rate, delay, busy_until, send_s; /* emulation (pl_link_shape); time in pl_send */
  double send_timeout;                     /* pl_link_send_timeout, for the message */
  double grace_until; /* tr_now() until which the peer said it may be held (PL_WAIT) */
  pthread_mutex_t send_mu; /* pl_send from the stage and its herald (pl_herald) */
};

/* --- the socket --- */

static int write_all(int fd, const void *p, size_t n) {
  const char *c = p;
  while (n > 0) {
    ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    c += w;
    n -= (size_t)w;
  }
  return 0;
}

/* 1 read, 0 end of stream before anything, -1 error or a short read */
static int read_all(int fd, void *p, size_t n) {
  char *c = p;
  size_t got = 0;
  while (got < n) {
    ssize_t r = recv(fd, c + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) return got == 0 ? 0 : -1;
    if (r < 0) return -1;
    got += (size_t)r;
  }
  return 1;
}

/* --- the reader thread --- */

static void reader_stop(pl_link *l, const char *why) {
  pthread_mutex_lock(&l->mu);
  l->closed = 1;
  snprintf(l->why, sizeof l->why, "%s", why);
  pthread_cond_broadcast(&l->cv);
  pthread_mutex_unlock(&l->mu);
}

/* A header off the wire: NULL if it may be taken, else why not. */
static const char *bad_header(const pl_link *l, const pl_header *h, char *why, size_t n) {
  if (h->magic != PL_MAGIC) return "garbage on the link";
  if (h->bytes > l->max_bytes) {
    snprintf(why, n, "a message of %llu bytes, more than the %llu this link carries",
             (unsigned long long)h->bytes, (unsigned long long)l->max_bytes);
    return why;
  }
  if (!isfinite(h->sent_at)) return "a message whose sent_at is not a finite time";
  return NULL;
}

static void *reader_main(void *arg) {
  pl_link *l = arg;
  char why[160];
  for (;;) {
    msg *m = calloc(1, sizeof *m);
    if (!m) return reader_stop(l, "out of memory"), NULL;
    int r = read_all(l->fd, &m->h, sizeof m->h);
    const char *bad = r == 1 ? bad_header(l, &m->h, why, sizeof why) : NULL;
    if (r <= 0 || bad) {
      free(m);
      reader_stop(l, r == 0 ? "the peer closed the link" : r < 0 ? "the link broke" : bad);
      return NULL;
    }
    if (m->h.kind == PL_WAIT && m->h.bytes == 0) { /* not a message for the stage: it widens its waits */
      double v = m->h.value, g = tr_now() + (v > 0 && v < PL_GRACE_MAX ? v : v >= PL_GRACE_MAX ? PL_GRACE_MAX : 0);
      free(m);
      pthread_mutex_lock(&l->mu);
      if (g > l->grace_until) l->grace_until = g;
      l->received += sizeof(pl_header);
      pthread_mutex_unlock(&l->mu);
      continue;
    }
    pthread_mutex_lock(&l->mu); /* a full queue: read no more until the stage takes one */
    while (!l->stopping && (l->queued >= PL_QUEUE_DEPTH ||
                            (l->queued > 0 && l->queued_bytes + m->h.bytes > l->queue_max)))
      pthread_cond_wait(&l->room, &l->mu);
    int stopping = l->stopping;
    pthread_mutex_unlock(&l->mu);
    if (stopping) {
      free(m);
      return reader_stop(l, "the link is closing"), NULL;
    }
    if (m->h.bytes && (!(m->payload = malloc(m->h.bytes)) || read_all(l->fd, m->payload, m->h.bytes) != 1)) {
      free(m->payload);
      free(m);
      reader_stop(l, "the link broke inside a message");
      return NULL;
    }
    pthread_mutex_lock(&l->mu);
    if (l->tail) l->tail->next = m;
    else l->head = m;
    l->tail = m;
    l->queued++;
    l->queued_bytes += m->h.bytes;
    l->received += sizeof m->h + m->h.bytes;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
  }
}

/* --- the link --- */

/* The queue's byte bound for a link whose largest stream message (one
 * that may queue up with others) is stream_bytes. */
static uint64_t queue_bound(uint64_t stream_bytes) {
  if (stream_bytes > UINT64_MAX / PL_QUEUE_MESSAGES) return UINT64_MAX;
  uint64_t b = PL_QUEUE_MESSAGES * stream_bytes;
  return b > PL_QUEUE_BYTES_MIN ? b : PL_QUEUE_BYTES_MIN;
}

pl_link *pl_link_create(int fd, const char *peer_name, uint64_t max_bytes, uint64_t stream_bytes) {
  pl_link *l = calloc(1, sizeof *l);
  if (!l) {
    close(fd);
    tr_fail(TR_ENOMEM, "out of memory");
    return NULL;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  l->fd = fd;
  l->max_bytes = max_bytes;
  l->queue_max = queue_bound(stream_bytes < max_bytes ? stream_bytes : max_bytes);
  snprintf(l->peer, sizeof l->peer, "%s", peer_name);
  pthread_mutex_init(&l->mu, NULL);
  pthread_condattr_t ca; /* pl_recv's deadline: a clock that never jumps */
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&l->cv, &ca);
  pthread_condattr_destroy(&ca);
  pthread_cond_init(&l->room, NULL);
  pthread_mutex_init(&l->send_mu, NULL);
  if (pthread_create(&l->reader, NULL, reader_main, l)) {
    close(fd);
    pthread_mutex_destroy(&l->send_mu);
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cv);
    pthread_cond_destroy(&l->room);
    free(l);
    tr_fail(TR_EIO, "cannot start the link's reader thread");
    return NULL;
  }
  return l;
}

void pl_link_free(pl_link *l) {
  if (!l) return;
  pthread_mutex_lock(&l->mu); /* a reader waiting for room stops waiting */
  l->stopping = 1;
  pthread_cond_broadcast(&l->room);
  pthread_mutex_unlock(&l->mu);
  shutdown(l->fd, SHUT_RDWR); /* a reader in recv sees the end and stops */
  pthread_join(l->reader, NULL);
  close(l->fd);
  for (msg *m = l->head, *n; m; m = n) {
    n = m->next;
    free(m->payload);
    free(m);
  }
  pthread_mutex_destroy(&l->send_mu);
  pthread_mutex_destroy(&l->mu);
  pthread_cond_destroy(&l->cv);
  pthread_cond_destroy(&l->room);
  free(l);
}

/* Sleeps until monotonic time t, at most a bounded d (callers bound t). */
static void sleep_until(double t) {
  double d = t - tr_now();
  if (!(d > 0)) return;
  struct timespec ts = {(time_t)d, (long)((d - (double)(time_t)d) * 1e9)};
  while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
  }
}

void pl_link_shape(pl_link *l, double bytes_per_s, double delay_s) {
  l->rate = bytes_per_s > 0 ? bytes_per_s : 0;
  l->delay = delay_s > 0 ? delay_s : 0;
}

double pl_link_send_seconds(const pl_link *l) { return l->send_s; }

void pl_link_send_timeout(pl_link *l, double timeout_s) {
  struct timeval tv = {0, 0};
  if (timeout_s > 0) {
    tv.tv_sec = (time_t)timeout_s;
    tv.tv_usec = (suseconds_t)((timeout_s - (double)tv.tv_sec) * 1e6);
  }
  setsockopt(l->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  l->send_timeout = timeout_s;
}

static int send_locked(pl_link *l, const pl_header *h, const void *payload) {
  double t0 = tr_now();
  pl_header hh = *h;
  hh.magic = PL_MAGIC;
  hh.sent_at = t0;
  if (l->rate > 0) { /* the emulated wire: this message after the ones still on it */
    l->busy_until = (l->busy_until > t0 ? l->busy_until : t0) + (double)(sizeof hh + hh.bytes) / l->rate;
    hh.sent_at = l->busy_until;
  }
  if (write_all(l->fd, &hh, sizeof hh) || (hh.bytes && write_all(l->fd, payload, hh.bytes))) {
    if (errno == EAGAIN || errno == EWOULDBLOCK)
      return tr_fail(TR_EIO, "sending to %s: it took nothing in %.0f s", l->peer, l->send_timeout);
    return tr_fail(TR_EIO, "sending to %s: %s", l->peer, strerror(errno));
  }
  if (l->rate > 0) sleep_until(l->busy_until);
  l->sent += sizeof hh + hh.bytes;
  l->send_s += tr_now() - t0;
  return TR_OK;
}

int pl_send(pl_link *l, const pl_header *h, const void *payload) {
  pthread_mutex_lock(&l->send_mu);
  int rc = send_locked(l, h, payload);
  pthread_mutex_unlock(&l->send_mu);
  return rc;
}

/* pl_recv and pl_recv_encoded: any_codec says whether the caller decodes. */
static int take(pl_link *l, uint32_t kind, int64_t step, int mb, double timeout_s, int any_codec, pl_header *h,
                void **payload) {
  double t0 = tr_now(), end = t0 + (timeout_s > 0 ? timeout_s : 0); /* tr_now: the condition's clock */
  pthread_mutex_lock(&l->mu);
  for (;;) {
    double e = end > l->grace_until ? end : l->grace_until; /* a grace announced meanwhile counts */
    if (l->head || l->closed || tr_now() >= e) break;
    struct timespec until = {(time_t)e, (long)((e - (double)(time_t)e) * 1e9)};
    pthread_cond_timedwait(&l->cv, &l->mu, &until);
  }
  msg *m = l->head;
  if (m) {
    l->head = m->next;
    if (!l->head) l->tail = NULL;
    l->queued--;
    l->queued_bytes -= m->h.bytes;
    pthread_cond_signal(&l->room);
  }
  char why[160];
  snprintf(why, sizeof why, "%s", l->why);
  int closed = l->closed;
  pthread_mutex_unlock(&l->mu);
  if (!m)
    return closed ? tr_fail(TR_EIO, "waiting for %s: %s", l->peer, why)
                     : tr_fail(TR_EIO, "waiting for %s: nothing in %.0f s", l->peer, tr_now() - t0);
  if (kind && (m->h.kind != kind || m->h.step != step || (mb >= 0 && m->h.mb != mb))) {
    tr_fail(TR_EIO, "from %s: expected message %u (step %lld, micro-batch %d), got %u (step %lld, micro-batch %d)",
            l->peer, kind, (long long)step, mb, m->h.kind, (long long)m->h.step, m->h.mb);
    free(m->payload);
    free(m);
    return TR_EIO;
  }
  if (!any_codec && m->h.codec != 0) { /* only activations and gradients come encoded */
    tr_fail(TR_EIO, "from %s: message %u (step %lld, micro-batch %d) in codec %d, where only raw (codec 0) is "
            "expected", l->peer, m->h.kind, (long long)m->h.step, m->h.mb, m->h.codec);
    free(m->payload);
    free(m);
    return TR_EIO;
  }
  if (l->delay > 0) { /* the emulated latency: from when the message left, as the peer says (finite: the
                         * reader checked), but never later than it could have: now plus its time on the wire */
    double wire = l->rate > 0 ? (double)(sizeof m->h + m->h.bytes) / l->rate : 0;
    double left = m->h.sent_at, latest = tr_now() + wire + PL_SENT_AT_SLACK;
    sleep_until((left < latest ? left : latest) + l->delay);
  }
  *h = m->h;
  *payload = m->payload;
  free(m);
  return TR_OK;
}

int pl_recv(pl_link *l, uint32_t kind, int64_t step, int mb, double timeout_s, pl_header *h, void **payload) {
  return take(l, kind, step, mb, timeout_s, 0, h, payload);
}

int pl_recv_encoded(pl_link *l, uint32_t kind, int64_t step, int mb, double timeout_s, pl_header *h,
                    void **payload) {
  return take(l, kind, step, mb, timeout_s, 1, h, payload);
}

int pl_link_grace(pl_link *l, double seconds) {
  pl_header h = {.kind = PL_WAIT, .value = seconds};
  return pl_send(l, &h, NULL);
}

/* --- the herald --- */

#define HERALD_GRACE 2.0   /* s each notice lasts: a stopped stage's end that soon after its last */
#define HERALD_PERIOD 0.25 /* s between notices */

struct pl_herald {
  pl_link *l[2];
  double cap; /* s a stretch of on lasts at most (pl_herald_start) */
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv; /* CLOCK_MONOTONIC */
  int on, stop;
  double on_since;
};

/* Whether l's peer holds a grace now: it, or a stage beyond it, is held. */
static int grace_live(pl_link *l) {
  if (!l) return 0;
  pthread_mutex_lock(&l->mu);
  int live = l->grace_until > tr_now();
  pthread_mutex_unlock(&l->mu);
  return live;
}

/* A notice on link i when this stage is held (in its collective, within
 * the cap) or the stage beyond its other link is (the notice goes on down
 * the chain, away from where it came: two stages cannot keep each other
 * alive). Only when the link takes it now, and nobody else is sending on
 * it: the herald never waits on a peer that does not read (a stopped one),
 * nor holds the stage's next message back. */
static void herald_tell(pl_herald *h, int held) {
  for (int i = 0; i < 2; i++) {
    pl_link *l = h->l[i];
    if (!l || !(held || grace_live(h->l[1 - i])) || pthread_mutex_trylock(&l->send_mu) != 0) continue;
    struct pollfd p = {.fd = l->fd, .events = POLLOUT};
    if (poll(&p, 1, 0) == 1 && (p.revents & POLLOUT)) {
      pl_header g = {.kind = PL_WAIT, .value = HERALD_GRACE};
      (void)send_locked(l, &g, NULL);
    }
    pthread_mutex_unlock(&l->send_mu);
  }
}

static void *herald_main(void *arg) {
  pl_herald *h = arg;
  pthread_mutex_lock(&h->mu);
  while (!h->stop) {
    double e = tr_now() + HERALD_PERIOD;
    struct timespec ts = {(time_t)e, (long)((e - (double)(time_t)e) * 1e9)};
    pthread_cond_timedwait(&h->cv, &h->mu, &ts);
    if (h->stop) break;
    int held = h->on && tr_now() - h->on_since < h->cap;
    pthread_mutex_unlock(&h->mu);
    herald_tell(h, held);
    pthread_mutex_lock(&h->mu);
  }
  pthread_mutex_unlock(&h->mu);
  return NULL;
}

pl_herald *pl_herald_start(pl_link *a, pl_link *b, double cap_s) {
  pl_herald *h = calloc(1, sizeof *h);
  if (!h) return NULL;
  h->l[0] = a;
  h->l[1] = b;
  h->cap = cap_s;
  pthread_mutex_init(&h->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* tr_now's clock: a wall-clock step stalls nothing */
  pthread_cond_init(&h->cv, &ca);
  pthread_condattr_destroy(&ca);
  if (pthread_create(&h->th, NULL, herald_main, h)) {
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    free(h);
    return NULL;
  }
  return h;
}

void pl_herald_on(pl_herald *h) {
  if (!h) return;
  herald_tell(h, 1); /* the first notice before the caller blocks: not left to the thread's timing */
  pthread_mutex_lock(&h->mu);
  h->on = 1;
  h->on_since = tr_now();
  pthread_mutex_unlock(&h->mu);
}

void pl_herald_off(pl_herald *h) {
  if (!h) return;
  pthread_mutex_lock(&h->mu);
  h->on = 0;
  pthread_mutex_unlock(&h->mu);
}

void pl_herald_stop(pl_herald *h) {
  if (!h) return;
  pthread_mutex_lock(&h->mu);
  h->stop = 1;
  pthread_cond_signal(&h->cv);
  pthread_mutex_unlock(&h->mu);
  pthread_join(h->th, NULL);
  pthread_mutex_destroy(&h->mu);
  pthread_cond_destroy(&h->cv);
  free(h);
}

const char *pl_link_peer(const pl_link *l) { return l->peer; }

void pl_link_bytes(const pl_link *l, uint64_t *sent, uint64_t *received) {
  pthread_mutex_lock((pthread_mutex_t *)&l->send_mu);
  *sent = l->sent;
  pthread_mutex_unlock((pthread_mutex_t *)&l->send_mu);
  pthread_mutex_lock((pthread_mutex_t *)&l->mu);
  *received = l->received;
  pthread_mutex_unlock((pthread_mutex_t *)&l->mu);
}

/* --- connecting --- */

/* The one connect of the fleet (proto.c): bounded by timeout_s even where
 * the peer's SYNs are dropped. */
int pl_connect(const char *host, int port, double timeout_s) { return net_connect(host, port, timeout_s); }

int pl_accept(int lfd, double timeout_s) {
  struct pollfd p = {.fd = lfd, .events = POLLIN};
  double t_end = tr_now() + timeout_s; /* one deadline: a signal does not start the wait again */
  int r;
  do {
    double left = t_end - tr_now();
    r = left > 0 ? poll(&p, 1, (int)(left * 1000) + 1) : 0;
  } while (r < 0 && errno == EINTR);
  if (r <= 0) return tr_fail(TR_EIO, "no stage connected in %.0f s", timeout_s);
  int fd = accept(lfd, NULL, NULL);
  if (fd < 0) return tr_fail(TR_EIO, "accept: %s", strerror(errno));
  return fd;
}
