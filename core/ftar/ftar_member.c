/* ftar_member.c — an FTAR member's life: create (options, buffers, the data
 * listener, then registration and the control thread from ftar_control.c),
 * free, the queries of ftar.h, the hooks ftar_internal.h lends the device
 * data plane, and the small descriptor / socket / wait helpers the member's
 * files share (ftar_member_internal.h).
 *
 * Not here: what the control thread does (ftar_control.c), how data moves
 * (ftar_ring.c, ftar_shm.c, ftar_port.c; ftar_dev.c), the collective's
 * control round (ftar_collective.c). See ftar.h for the contract.
 *
 * Called by: users of ftar.h (the trainer, ftar_bench.c, tests) and, for the
 * helpers, the other ftar_*.c files of the member.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "ftar.h"
#include "ftar_internal.h"
#include "ftar_member_internal.h"
#include "util.h"

/* --- descriptors, sockets, waiting --- */

void ftar_set_nonblock(int fd) {
  int fl = fcntl(fd, F_GETFL);
  if (fl >= 0) fcntl(fd, F_SETFL, fl | O_NONBLOCK);
  fcntl(fd, F_SETFD, FD_CLOEXEC);
}

void ftar_tune_socket(int fd, int sockbuf) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (sockbuf > 0) {
#ifdef SO_SNDBUFFORCE
    if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &sockbuf, sizeof sockbuf) != 0)
#endif
      setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sockbuf, sizeof sockbuf);
#ifdef SO_RCVBUFFORCE
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &sockbuf, sizeof sockbuf) != 0)
#endif
      setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sockbuf, sizeof sockbuf);
  }
}

void ftar_close_fd(int *fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

void ftar_wake_fd(int fd) {
  char b = 1;
  ssize_t w = write(fd, &b, 1); /* EAGAIN: a wake-up is already pending */
  (void)w;
}

void ftar_drain_fd(int fd) {
  char b[64];
  while (read(fd, b, sizeof b) > 0) {
  }
}

static struct timespec abs_time(double t_end) {
  /* t_end is on tr_now()'s clock (CLOCK_MONOTONIC), the clock of cv */
  struct timespec ts;
  ts.tv_sec = (time_t)t_end;
  ts.tv_nsec = (long)((t_end - (double)ts.tv_sec) * 1e9);
  if (ts.tv_nsec >= 1000000000L) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000L;
  }
  return ts;
}

/* Waits on cv (mu held) until t_end or a short slice, whichever is first. */
void ftar_cv_wait(ftar_member *m, double t_end) {
  double t = tr_now() + 0.2;
  struct timespec ts = abs_time(t < t_end ? t : t_end);
  pthread_cond_timedwait(&m->cv, &m->mu, &ts);
}

int ftar_io_wait(int fd, short ev, double t_end) {
  for (;;) {
    double left = t_end - tr_now();
    if (left <= 0) return -1;
    struct pollfd p = {.fd = fd, .events = ev};
    int r = poll(&p, 1, (int)(left * 1000) + 1);
    if (r > 0) return 0;
    if (r < 0 && errno != EINTR) return -1;
  }
}

int ftar_connect_to(const char *host, int port, int sockbuf, double t_end, int *out) {
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) return tr_fail(TR_EINVAL, "'%s' is not an IPv4 address", host);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return tr_fail(TR_EIO, "socket: %s", strerror(errno));
  ftar_set_nonblock(fd);
  ftar_tune_socket(fd, sockbuf);
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0 && errno != EINPROGRESS) {
    int e = errno;
    close(fd);
    return tr_fail(FTAR_ECOORD, "connect %s:%d: %s", host, port, strerror(e));
  }
  if (t_end <= 0) { /* caller completes the connect */
    *out = fd;
    return 0;
  }
  /* *out is set only on success: a closed number left there would be
   * closed again by the caller, maybe after another thread reused it */
  if (ftar_io_wait(fd, POLLOUT, t_end)) {
    close(fd);
    return tr_fail(FTAR_ETIMEOUT, "connect %s:%d: timed out", host, port);
  }
  int err = 0;
  socklen_t el = sizeof err;
  getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el);
  if (err) {
    close(fd);
    return tr_fail(FTAR_ECOORD, "connect %s:%d: %s", host, port, strerror(err));
  }
  *out = fd;
  return 0;
}

/* --- lifecycle --- */

#define CHUNK_DEFAULT ((size_t)128 * 1024) /* bench/ftar_frames.sh: ahead of 256 KiB over TCP */

void ftar_member_opts_default(ftar_member_opts *o) {
  memset(o, 0, sizeof *o);
  o->data_host = "127.0.0.1";
  o->timeout = 60.0;
  o->min_members = 1;
  o->chunk_bytes = CHUNK_DEFAULT;
  o->sockbuf = 4 << 20;
  o->spin_us = -1;
  o->shm = 1;
  o->shm_stream = -1;
  o->hier = -1;
}

/* The member before any descriptor or thread: options normalized, the
 * mutex and condition variable (on tr_now()'s clock) ready. NULL when out
 * of memory (tr_error() set). */
static ftar_member *member_alloc(int slot, const ftar_member_opts *o) {
  ftar_member *m = calloc(1, sizeof *m);
  if (!m) {
    tr_fail(TR_ENOMEM, "ftar_member_create: out of memory");
    return NULL;
  }
  m->cmd[0] = m->cmd[1] = m->wake[0] = m->wake[1] = m->lfd = m->q_fd = -1;
  for (int i = 0; i < FTAR_LEVELS; i++) {
    ftar_links *L = &m->lk[i];
    L->level = i;
    L->up_fd = L->down_fd = L->up_shm.memfd = L->down_shm.memfd = -1;
  }
  pthread_mutex_init(&m->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&m->cv, &ca);
  pthread_condattr_destroy(&ca);
  ftar_member_opts_default(&m->o);
  if (o) m->o = *o;
  if (o && o->secret && o->secret_len > 0 && o->secret_len <= AUTH_KEY_MAX) {
    memcpy(m->secret.key, o->secret, o->secret_len);
    m->secret.len = o->secret_len;
  }
  m->o.secret = NULL;
  if (!m->o.data_host) m->o.data_host = "127.0.0.1";
  if (!(m->o.timeout > 0)) m->o.timeout = 60.0;
  if (m->o.min_members < 1) m->o.min_members = 1;
  if (m->o.chunk_bytes < 64) m->o.chunk_bytes = CHUNK_DEFAULT;
  if (m->o.chunk_bytes > ((size_t)64 << 20)) m->o.chunk_bytes = (size_t)64 << 20;
  m->chunk = m->o.chunk_bytes / sizeof(float);
  m->shm_ring = SHM_RING_DEFAULT;
  while (m->shm_ring < m->o.shm_ring_bytes && m->shm_ring < SHM_RING_MAX) m->shm_ring *= 2;
  m->slot = slot;
  return m;
}

/* The data host and the data plane's receive and staging buffers. */
static int member_buffers(ftar_member *m) {
  if (strlen(m->o.data_host) > FTAR_HOST_MAX)
    return tr_fail(TR_EINVAL, "ftar: data host '%s' too long", m->o.data_host);
  snprintf(m->data_host, sizeof m->data_host, "%s", m->o.data_host);
  int ok = (m->stage = malloc(m->chunk * sizeof(float))) != NULL;
  for (int i = 0; i < FTAR_LEVELS; i++) ok &= (m->lk[i].rx = malloc(RX_CAP)) != NULL;
  if (!ok) return tr_fail(TR_ENOMEM, "ftar: out of memory");
  return 0;
}

/* The data listener on data_host:data_port; sets lport. */
static int open_listener(ftar_member *m) {
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)m->o.data_port)};
  if (inet_pton(AF_INET, m->data_host, &sa.sin_addr) != 1)
    return tr_fail(TR_EINVAL, "ftar: data host '%s' is not an IPv4 address", m->data_host);
  m->lfd = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  if (m->lfd < 0) return tr_fail(TR_EIO, "ftar: socket: %s", strerror(errno));
  setsockopt(m->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  ftar_tune_socket(m->lfd, m->o.sockbuf);
  ftar_set_nonblock(m->lfd);
  if (bind(m->lfd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(m->lfd, 128) != 0)
    return tr_fail(TR_EIO, "ftar: cannot listen on %s:%d: %s", m->data_host, m->o.data_port, strerror(errno));
  socklen_t sl = sizeof sa;
  getsockname(m->lfd, (struct sockaddr *)&sa, &sl);
  m->lport = ntohs(sa.sin_port);
  return 0;
}

ftar_member *ftar_member_create(const char *coord_host, int coord_port, int slot, const ftar_member_opts *o) {
  int cfd = -1;
  if (!coord_host || coord_port <= 0 || coord_port > 65535 || slot < 0 || slot >= (1 << 30)) {
    tr_fail(TR_EINVAL, "ftar_member_create: bad arguments");
    return NULL;
  }
  if (o && (o->secret_len > AUTH_KEY_MAX || (o->secret_len > 0 && !o->secret))) { /* never quietly unchallenged */
    tr_fail(TR_EINVAL, "ftar_member_create: the secret must be 1..%d bytes (or none: NULL/0)", AUTH_KEY_MAX);
    return NULL;
  }
  ftar_member *m = member_alloc(slot, o);
  if (!m) return NULL;
  if (member_buffers(m)) goto error;
  double t_end = tr_now() + m->o.timeout;
  if (open_listener(m) || ftar_ctl_register(m, coord_host, coord_port, t_end, &cfd)) goto error;
  m->deadline = m->o.deadline > 0 ? m->o.deadline : m->coord_deadline;
  if (ftar_ctl_start(m, &cfd)) goto error;
  return m;
error:
  if (cfd >= 0) close(cfd);
  ftar_member_free(m);
  return NULL;
}

void ftar_member_free(ftar_member *m) {
  if (!m) return;
  ftar_async_free(m); /* a collective in flight on the communication thread fails first */
  if (m->dev_free) m->dev_free(m->dev_state); /* the device plane first: its communicator may take a moment */
  m->dev_state = NULL;
  ftar_ctl_stop(m);
  ftar_links_close(m);
  ftar_port_close(m);
  ftar_close_fd(&m->lfd);
  for (int i = 0; i < 2; i++) {
    ftar_close_fd(&m->cmd[i]);
    ftar_close_fd(&m->wake[i]);
  }
  for (int i = 0; i < FTAR_LEVELS; i++) free(m->lk[i].rx);
  free(m->stage);
  free(m->in_copy);
  pthread_cond_destroy(&m->cv);
  pthread_mutex_destroy(&m->mu);
  free(m);
}

void ftar_member_leave(ftar_member *m, const char *why) {
  if (!m) return;
  char err[1024]; /* the caller's tr_error() (why it leaves), kept: a failed LEAVE send sets its own */
  snprintf(err, sizeof err, "%s", tr_error());
  /* before the failure below ends it: this member's part of that
   * collective will never come, so its LEAVE is no collective boundary and
   * the others' attempt (they may already hold a GO for an epoch with us)
   * is called off, not left to wait for us until their timeout */
  m->leave_abort = ftar_async_inflight(m);
  ftar_member_fail(m, FTAR_ECOORD, why); /* first: a collective in flight fails with our reason */
  ftar_async_free(m);
  ftar_ctl_stop(m); /* LEAVE: the coordinator publishes the group without us */
  ftar_links_close(m);
  ftar_port_close(m); /* and nobody reaches us any more: a connection to us is refused, not parked */
  ftar_close_fd(&m->lfd);
  tr_fail(0, "%s", err);
}

int ftar_member_wait(ftar_member *m, int n, double timeout) {
  double t_end = tr_now() + timeout;
  int rc = 0;
  pthread_mutex_lock(&m->mu);
  for (;;) {
    if (m->failed) {
      rc = tr_fail(m->failed, "ftar: %s", m->fail_msg);
      break;
    }
    int in = 0;
    for (int i = 0; i < m->ep_n; i++) in |= m->ep_mem[i].uid == m->uid;
    if (in && m->ep_n >= n) break;
    if (tr_now() >= t_end) {
      rc = tr_fail(FTAR_ETIMEOUT, "ftar: %d member(s) after %.1f s, waiting for %d", m->ep_n, timeout, n);
      break;
    }
    ftar_cv_wait(m, t_end);
  }
  pthread_mutex_unlock(&m->mu);
  return rc;
}

uint64_t ftar_member_epoch(ftar_member *m, int *n_members) {
  pthread_mutex_lock(&m->mu);
  uint64_t e = m->ep;
  if (n_members) *n_members = m->ep_n;
  pthread_mutex_unlock(&m->mu);
  return e;
}

int ftar_member_data_port(const ftar_member *m) { return m->lport; }

void ftar_member_stats(ftar_member *m, ftar_stats *s) {
  *s = m->st;
  pthread_mutex_lock(&m->mu);
  s->epochs = m->epochs_seen;
  pthread_mutex_unlock(&m->mu);
}

/* --- hooks for the device data plane (ftar_internal.h) --- */

void ftar_member_run_info(ftar_member *m, ftar_run_info *ri) {
  ri->epoch = m->run_ep;
  ri->n = m->run_n;
  ri->rank = m->run_r;
  ri->slot = m->slot;
  ri->deadline = m->deadline;
  ri->timeout = m->o.timeout;
}

void *ftar_member_dev_state(ftar_member *m) { return m->dev_state; }

void ftar_member_set_dev_state(ftar_member *m, void *st, void (*free_fn)(void *st)) {
  m->dev_state = st;
  m->dev_free = free_fn;
}

void ftar_member_log(ftar_member *m, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (m->o.log) m->o.log(m->o.log_ud, msg);
  else fprintf(stderr, "ftar[slot %d]: %s\n", m->slot, msg);
}
