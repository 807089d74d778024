/* pipeline_link.c — framed messages over TCP between neighbouring pipeline
 * stages, with a reader thread per link (see pipeline_link.h). It knows
 * nothing of graphs or schedules: pipeline_stage.c says what to expect.
 */
#include "pipeline_link.h"

#include <arpa/inet.h>
#include <errno.h>
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

typedef struct msg {
  pl_header h;
  void *payload;
  struct msg *next;
} msg;

struct pl_link {
  int fd;
  char peer[64];
  pthread_t reader;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  msg *head, *tail;
  int closed;       /* the reader stopped: EOF or an error (why) */
  char why[160];
  uint64_t sent, received;
  double rate, delay, busy_until, send_s; /* emulation (pl_link_shape); time in pl_send */
  double send_timeout;                     /* pl_link_send_timeout, for the message */
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

static void *reader_main(void *arg) {
  pl_link *l = arg;
  for (;;) {
    msg *m = calloc(1, sizeof *m);
    if (!m) return reader_stop(l, "out of memory"), NULL;
    int r = read_all(l->fd, &m->h, sizeof m->h);
    if (r <= 0 || m->h.magic != PL_MAGIC || m->h.bytes > ((uint64_t)1 << 36)) {
      free(m);
      reader_stop(l, r == 0 ? "the peer closed the link" : r < 0 ? "the link broke" : "garbage on the link");
      return NULL;
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
    l->received += sizeof m->h + m->h.bytes;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
  }
}

/* --- the link --- */

pl_link *pl_link_create(int fd, const char *peer_name) {
  pl_link *l = calloc(1, sizeof *l);
  if (!l) {
    close(fd);
    tr_fail(TR_ENOMEM, "out of memory");
    return NULL;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  l->fd = fd;
  snprintf(l->peer, sizeof l->peer, "%s", peer_name);
  pthread_mutex_init(&l->mu, NULL);
  pthread_cond_init(&l->cv, NULL);
  if (pthread_create(&l->reader, NULL, reader_main, l)) {
    close(fd);
    free(l);
    tr_fail(TR_EIO, "cannot start the link's reader thread");
    return NULL;
  }
  return l;
}

void pl_link_free(pl_link *l) {
  if (!l) return;
  shutdown(l->fd, SHUT_RDWR); /* the reader sees the end and stops */
  pthread_join(l->reader, NULL);
  close(l->fd);
  for (msg *m = l->head, *n; m; m = n) {
    n = m->next;
    free(m->payload);
    free(m);
  }
  pthread_mutex_destroy(&l->mu);
  pthread_cond_destroy(&l->cv);
  free(l);
}

static void sleep_until(double t) {
  double d = t - tr_now();
  if (d <= 0) return;
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

int pl_send(pl_link *l, const pl_header *h, const void *payload) {
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

int pl_recv(pl_link *l, uint32_t kind, int64_t step, int mb, double timeout_s, pl_header *h, void **payload) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  double end = (double)until.tv_sec + until.tv_nsec * 1e-9 + timeout_s;
  until.tv_sec = (time_t)end;
  until.tv_nsec = (long)((end - (double)until.tv_sec) * 1e9);
  pthread_mutex_lock(&l->mu);
  int rc = 0;
  while (!l->head && !l->closed && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&l->cv, &l->mu, &until);
  msg *m = l->head;
  if (m) {
    l->head = m->next;
    if (!l->head) l->tail = NULL;
  }
  char why[160];
  snprintf(why, sizeof why, "%s", l->why);
  int closed = l->closed;
  pthread_mutex_unlock(&l->mu);
  if (!m)
    return closed ? tr_fail(TR_EIO, "waiting for %s: %s", l->peer, why)
                     : tr_fail(TR_EIO, "waiting for %s: nothing in %.0f s", l->peer, timeout_s);
  if (kind && (m->h.kind != kind || m->h.step != step || (mb >= 0 && m->h.mb != mb))) {
    tr_fail(TR_EIO, "from %s: expected message %u (step %lld, micro-batch %d), got %u (step %lld, micro-batch %d)",
            l->peer, kind, (long long)step, mb, m->h.kind, (long long)m->h.step, m->h.mb);
    free(m->payload);
    free(m);
    return TR_EIO;
  }
  if (l->delay > 0) sleep_until(m->h.sent_at + l->delay); /* the emulated latency */
  *h = m->h;
  *payload = m->payload;
  free(m);
  return TR_OK;
}

void pl_link_bytes(const pl_link *l, uint64_t *sent, uint64_t *received) {
  pthread_mutex_lock((pthread_mutex_t *)&l->mu);
  *sent = l->sent;
  *received = l->received;
  pthread_mutex_unlock((pthread_mutex_t *)&l->mu);
}

/* --- connecting --- */

/* The one connect of the fleet (proto.c): bounded by timeout_s even where
 * the peer's SYNs are dropped. */
int pl_connect(const char *host, int port, double timeout_s) { return net_connect(host, port, timeout_s); }

int pl_accept(int lfd, double timeout_s) {
  struct pollfd p = {.fd = lfd, .events = POLLIN};
  int r;
  do r = poll(&p, 1, (int)(timeout_s * 1000));
  while (r < 0 && errno == EINTR);
  if (r <= 0) return tr_fail(TR_EIO, "no stage connected in %.0f s", timeout_s);
  int fd = accept(lfd, NULL, NULL);
  if (fd < 0) return tr_fail(TR_EIO, "accept: %s", strerror(errno));
  return fd;
}
