/* ftar.c — FTAR member: registration, the control thread, and the ring data
 * plane. See ftar.h for the contract and ftar_coord.c for the decisions.
 *
 * Control: a private thread runs a libevent loop on the coordinator
 * connection: it sends heartbeats, receives EPOCH / GO / BYE frames into the
 * shared state (mutex + condition variable) and wakes the data thread
 * through a pipe; the data thread queues SYNC / ABORT frames for it.
 *
 * Data (the caller's thread, inside ftar_allreduce): members of an epoch,
 * ordered by slot, form a ring; each keeps one TCP link to its downstream
 * neighbour (it connects, sends CONNECT) and one from its upstream (accepted,
 * CONNECT checked). Links live for the epoch. A collective:
 *   reduce-scatter, p-1 steps: send segment (r-s), receive (r-s-1) and add;
 *   all-gather,     p-1 steps: send segment (r+1-t), receive (r-t) in place;
 *   commit tokens:  p-1 small frames around the ring; token v from upstream
 *                   means the v members before us hold the full result.
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
 * frames through a shared-memory ring instead of the socket: the TCP link
 * stays for the handshake, 1-byte doorbells when a side sleeps, and EOF when
 * a peer dies, so failure handling is unchanged; frames are read in place
 * and verified with the same header checks and CRC. Before sleeping, the
 * loop polls (yielding the core between rounds) for up to 500 us.
 *
 * The collective's control round (SYNC, GO, redo, result: ftar_collective)
 * is separate from the ring (a data plane, ftar_internal.h), so the device
 * data plane of ftar_dev.c reuses it unchanged; this file also relays the
 * communicator ids that plane needs (COMMID frames).
 *
 * Malformed input never crashes or allocates: headers are checked (magic,
 * type, epoch, seq, frame number, exact length) before any payload is read,
 * the CRC after; a bad frame closes the link with a logged reason and aborts
 * the collective, which is then redone. Strangers on the data port are
 * accepted into a small bounded list and dropped on the first bad byte or
 * after the deadline.
 */
#define _GNU_SOURCE /* memfd_create */
#include <arpa/inet.h>
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "ftar.h"
#include "ftar_internal.h"
#include "ftar_wire.h"
#include "util.h"

#define PENDING_MAX 16
#define RX_CAP (64 * 1024)
#define POLL_MS 50
#define MAX_COUNT ((size_t)1 << 40)

typedef struct {
  int slot;
  uint64_t uid;
  uint16_t port;
  char host[FTAR_HOST_MAX + 1];
} peer;

typedef struct { /* a connection on the data port that has not shown a valid CONNECT yet */
  int fd;
  size_t got;
  double t0;
  int complete; /* valid CONNECT read; parked until its epoch is ours */
  ftar_hdr h;
  uint64_t uid;
  uint8_t b[FTAR_HDR + FTAR_CONNECT_LEN];
} pending;

enum { DOWN_NONE = 0, DOWN_CONNECTING, DOWN_HELLO, DOWN_ACK, DOWN_READY };

/* A same-host link's frames go through this ring: a memfd the sender
 * creates and the receiver maps through /proc/<pid>/fd/<n>. Single producer,
 * single consumer; head/tail count bytes; the *_waiting flags ask the other
 * side for a 1-byte doorbell on the TCP link before sleeping in poll(). */
#define SHM_RING (4u << 20)
#define SHM_DATA 4096
#define SHM_MAGIC 0x4d485346u /* "FSHM" */
typedef struct {
  uint32_t magic, size;
  uint64_t token;
  uint8_t pad0[48];
  _Atomic uint64_t head;
  uint8_t pad1[56];
  _Atomic uint64_t tail;
  uint8_t pad2[56];
  _Atomic uint32_t cons_waiting;
  uint8_t pad3[60];
  _Atomic uint32_t prod_waiting;
  uint8_t pad4[60];
} shm_hdr;

typedef struct {
  shm_hdr *h; /* NULL: not mapped */
  uint8_t *data;
  size_t size;
  uint64_t pos;   /* our side's counter: head for the producer, tail for the consumer */
  int memfd;      /* producer, until the receiver answered */
  int active;     /* frames flow through the ring */
  int armed;      /* we set our *_waiting flag */
} shm_link;

struct ftar_member {
  ftar_member_opts o;
  char data_host[FTAR_HOST_MAX + 1];
  int slot;
  uint64_t uid;
  double deadline, coord_deadline, hb_interval;
  size_t chunk; /* floats per frame */

  /* control thread */
  pthread_t th;
  int th_started;
  struct event_base *base;
  struct bufferevent *bev;
  struct event *hb_ev, *cmd_ev;
  int cmd[2];  /* data thread -> control thread */
  int wake[2]; /* control thread -> data thread */
  uint8_t ctl_buf[4 + FTAR_ENTRY_LEN * FTAR_MAX_MEMBERS];

  /* shared with the control thread, under mu */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t ep; /* latest epoch published */
  int ep_n;
  peer ep_mem[FTAR_MAX_MEMBERS];
  uint64_t abort_ep; /* latest epoch that aborts the collectives of older ones */
  uint64_t go_ep, go_seq;
  int go_dec;
  int sync_n; /* the member list of the epoch we last sent SYNC for */
  peer sync_mem[FTAR_MAX_MEMBERS];
  int failed; /* FTAR_ECOORD / FTAR_EEVICTED once the control link is gone */
  char fail_msg[256];
  int q_sync, q_abort, q_quit, q_commid;
  ftar_hdr sync_h, abort_h, commid_h;
  uint8_t commid_pay[FTAR_COMMID_LEN];
  uint64_t cid_ep; /* latest epoch whose communicator id arrived (COMMID) */
  uint8_t cid[FTAR_COMMID_LEN];
  uint64_t epochs_seen;
  atomic_uint gen; /* bumped on every change above; the data thread polls it */

  /* data plane: the calling thread only */
  int lfd, lport;
  pending pend[PENDING_MAX];
  int npend;
  uint64_t run_ep; /* epoch we were told to run in (GO) */
  int run_aborted; /* a collective failed in run_ep: do not run there again */
  int run_n, run_r;
  peer run_mem[FTAR_MAX_MEMBERS];
  int up_fd, down_fd, down_state;
  int up_eof, down_eof; /* the peer closed; fatal only while that link still has work */
  shm_link up_shm, down_shm;
  uint8_t *rx;
  size_t rx_head, rx_tail;
  float *in_copy, *stage;
  size_t in_cap;
  uint64_t last_seq, last_ep;
  int completed_any;
  ftar_stats st;
  void *dev_state; /* ftar_dev.c's, freed by dev_free */
  void (*dev_free)(void *);
};

/* --- logging and small helpers --- */

__attribute__((format(printf, 2, 3))) static void mlog(ftar_member *m, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (m->o.log) m->o.log(m->o.log_ud, msg);
  else fprintf(stderr, "ftar[slot %d]: %s\n", m->slot, msg);
}

static void set_nonblock(int fd) {
  int fl = fcntl(fd, F_GETFL);
  if (fl >= 0) fcntl(fd, F_SETFL, fl | O_NONBLOCK);
  fcntl(fd, F_SETFD, FD_CLOEXEC);
}

static void tune_socket(int fd, int sockbuf) {
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

static void close_fd(int *fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

static void wake_fd(int fd) {
  char b = 1;
  ssize_t w = write(fd, &b, 1); /* EAGAIN: a wake-up is already pending */
  (void)w;
}

static void drain_fd(int fd) {
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
static void cv_wait(ftar_member *m, double t_end) {
  double t = tr_now() + 0.2;
  struct timespec ts = abs_time(t < t_end ? t : t_end);
  pthread_cond_timedwait(&m->cv, &m->mu, &ts);
}

void ftar_member_opts_default(ftar_member_opts *o) {
  memset(o, 0, sizeof *o);
  o->data_host = "127.0.0.1";
  o->timeout = 60.0;
  o->min_members = 1;
  o->chunk_bytes = 256 * 1024;
  o->sockbuf = 4 << 20;
  o->spin_us = -1;
  o->shm = 1;
}

/* --- control thread (libevent) --- */

static void ctl_fail(ftar_member *m, int code, const char *msg) {
  pthread_mutex_lock(&m->mu);
  if (!m->failed) {
    m->failed = code;
    snprintf(m->fail_msg, sizeof m->fail_msg, "%s", msg);
  }
  atomic_fetch_add(&m->gen, 1);
  pthread_cond_broadcast(&m->cv);
  pthread_mutex_unlock(&m->mu);
  wake_fd(m->wake[1]);
  if (m->bev) {
    bufferevent_free(m->bev);
    m->bev = NULL;
  }
}

static void ctl_send_pay(ftar_member *m, ftar_hdr *h, const void *pay, uint32_t len) {
  uint8_t hb[FTAR_HDR];
  h->len = len;
  ftar_frame_build(hb, h, pay);
  if (!m->bev) return;
  bufferevent_write(m->bev, hb, FTAR_HDR);
  if (len) bufferevent_write(m->bev, pay, len);
}

static void ctl_send(ftar_member *m, ftar_hdr *h) { ctl_send_pay(m, h, NULL, 0); }

static int parse_epoch(ftar_member *m, const ftar_hdr *h, const uint8_t *p) {
  if (h->len < 4) return -1;
  uint32_t n = ftw_get32(p);
  if (n == 0 || n > FTAR_MAX_MEMBERS || h->len != 4 + n * FTAR_ENTRY_LEN) return -1;
  peer tmp[FTAR_MAX_MEMBERS];
  for (uint32_t i = 0; i < n; i++) {
    const uint8_t *e = p + 4 + (size_t)i * FTAR_ENTRY_LEN;
    uint16_t hl = ftw_get16(e + 6);
    if (hl == 0 || hl > FTAR_HOST_MAX) return -1;
    tmp[i].slot = (int)ftw_get32(e);
    tmp[i].port = ftw_get16(e + 4);
    tmp[i].uid = ftw_get64(e + 8);
    memcpy(tmp[i].host, e + 16, hl);
    tmp[i].host[hl] = 0;
  }
  pthread_mutex_lock(&m->mu);
  if (h->epoch > m->ep) {
    m->ep = h->epoch;
    m->ep_n = (int)n;
    memcpy(m->ep_mem, tmp, n * sizeof tmp[0]);
    m->epochs_seen++;
    if ((h->flags & FTF_ABORT_PREV) && h->epoch > m->abort_ep) m->abort_ep = h->epoch;
    atomic_fetch_add(&m->gen, 1);
    pthread_cond_broadcast(&m->cv);
  }
  pthread_mutex_unlock(&m->mu);
  wake_fd(m->wake[1]);
  return 0;
}

static void ctl_read_cb(struct bufferevent *bev, void *arg) {
  ftar_member *m = arg;
  struct evbuffer *in = bufferevent_get_input(bev);
  char why[200], msg[300];
  for (;;) {
    size_t avail = evbuffer_get_length(in);
    if (avail < FTAR_HDR) return;
    uint8_t hb[FTAR_HDR];
    evbuffer_copyout(in, hb, FTAR_HDR);
    ftar_hdr h;
    ftar_hdr_decode(hb, &h);
    int bad = ftar_hdr_check(&h, 0, why, sizeof why) != 0;
    if (!bad && h.type != FT_EPOCH && h.type != FT_GO && h.type != FT_BYE && h.type != FT_REJECT &&
        h.type != FT_COMMID) {
      snprintf(why, sizeof why, "unexpected %s frame", ftar_type_name(h.type));
      bad = 1;
    }
    if (bad) {
      snprintf(msg, sizeof msg, "malformed frame from the coordinator: %s", why);
      mlog(m, "%s", msg);
      ctl_fail(m, FTAR_ECOORD, msg);
      return;
    }
    if (avail < FTAR_HDR + (size_t)h.len) return; /* h.len bounded by ftar_hdr_check */
    evbuffer_drain(in, FTAR_HDR);
    evbuffer_remove(in, m->ctl_buf, h.len);
    if (ftar_frame_crc(hb, m->ctl_buf, h.len) != h.crc) {
      mlog(m, "bad checksum on a %s frame from the coordinator", ftar_type_name(h.type));
      ctl_fail(m, FTAR_ECOORD, "bad checksum from the coordinator");
      return;
    }
    switch (h.type) {
    case FT_EPOCH:
      if (parse_epoch(m, &h, m->ctl_buf)) {
        mlog(m, "malformed EPOCH frame from the coordinator");
        ctl_fail(m, FTAR_ECOORD, "malformed EPOCH frame from the coordinator");
        return;
      }
      break;
    case FT_GO:
      pthread_mutex_lock(&m->mu);
      if (h.epoch >= m->go_ep) {
        m->go_ep = h.epoch;
        m->go_dec = (int)h.index;
        m->go_seq = h.seq;
        atomic_fetch_add(&m->gen, 1);
        pthread_cond_broadcast(&m->cv);
      }
      pthread_mutex_unlock(&m->mu);
      wake_fd(m->wake[1]);
      break;
    case FT_COMMID:
      if (h.len != FTAR_COMMID_LEN) {
        mlog(m, "malformed COMMID frame from the coordinator");
        ctl_fail(m, FTAR_ECOORD, "malformed COMMID frame from the coordinator");
        return;
      }
      pthread_mutex_lock(&m->mu);
      if (h.epoch >= m->cid_ep) {
        m->cid_ep = h.epoch;
        memcpy(m->cid, m->ctl_buf, FTAR_COMMID_LEN);
        atomic_fetch_add(&m->gen, 1);
        pthread_cond_broadcast(&m->cv);
      }
      pthread_mutex_unlock(&m->mu);
      wake_fd(m->wake[1]);
      break;
    default: { /* BYE, REJECT */
      char reason[FTAR_REASON_MAX + 1];
      memcpy(reason, m->ctl_buf, h.len);
      reason[h.len] = 0;
      for (char *c = reason; *c; c++)
        if ((unsigned char)*c < 32) *c = '?';
      snprintf(msg, sizeof msg, "removed by the coordinator: %s", reason);
      mlog(m, "%s", msg);
      ctl_fail(m, FTAR_EEVICTED, msg);
      return;
    }
    }
  }
}

static void ctl_event_cb(struct bufferevent *bev, short what, void *arg) {
  (void)bev;
  ftar_member *m = arg;
  if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR)) {
    mlog(m, "lost the coordinator connection");
    ctl_fail(m, FTAR_ECOORD, "lost the coordinator connection");
  }
}

static void ctl_hb_cb(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  ftar_member *m = arg;
  pthread_mutex_lock(&m->mu);
  ftar_hdr h = {.type = FT_HEARTBEAT, .epoch = m->ep, .index = (uint32_t)m->slot};
  pthread_mutex_unlock(&m->mu);
  ctl_send(m, &h);
}

static void ctl_cmd_cb(evutil_socket_t fd, short what, void *arg) {
  (void)what;
  ftar_member *m = arg;
  drain_fd(fd);
  pthread_mutex_lock(&m->mu);
  int sync = m->q_sync, abrt = m->q_abort, quit = m->q_quit, cid = m->q_commid;
  ftar_hdr sh = m->sync_h, ah = m->abort_h, ch = m->commid_h;
  uint8_t cpay[FTAR_COMMID_LEN];
  memcpy(cpay, m->commid_pay, sizeof cpay);
  m->q_sync = m->q_abort = m->q_commid = 0;
  pthread_mutex_unlock(&m->mu);
  if (abrt) ctl_send(m, &ah);
  if (sync) ctl_send(m, &sh);
  if (cid) ctl_send_pay(m, &ch, cpay, FTAR_COMMID_LEN);
  if (quit) event_base_loopbreak(m->base);
}

static void *ctl_main(void *arg) {
  ftar_member *m = arg;
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &set, NULL);
  event_base_dispatch(m->base);
  return NULL;
}

/* Queues a control frame for the control thread (data thread). */
static void queue_ctl(ftar_member *m, int abort_frame, const ftar_hdr *h) {
  pthread_mutex_lock(&m->mu);
  if (abort_frame) {
    m->abort_h = *h;
    m->q_abort = 1;
  } else {
    m->sync_h = *h;
    m->q_sync = 1;
  }
  pthread_mutex_unlock(&m->mu);
  wake_fd(m->cmd[1]);
}

/* --- blocking handshake with the coordinator (constructor) --- */

static int io_wait(int fd, short ev, double t_end) {
  for (;;) {
    double left = t_end - tr_now();
    if (left <= 0) return -1;
    struct pollfd p = {.fd = fd, .events = ev};
    int r = poll(&p, 1, (int)(left * 1000) + 1);
    if (r > 0) return 0;
    if (r < 0 && errno != EINTR) return -1;
  }
}

static int io_all(int fd, void *buf, size_t n, int writing, double t_end) {
  uint8_t *p = buf;
  while (n > 0) {
    ssize_t k = writing ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= (size_t)k;
    } else if (k == 0 && !writing) {
      return tr_fail(FTAR_ECOORD, "the coordinator closed the connection");
    } else if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      return tr_fail(FTAR_ECOORD, "coordinator connection: %s", strerror(errno));
    } else if (io_wait(fd, writing ? POLLOUT : POLLIN, t_end)) {
      return tr_fail(FTAR_ETIMEOUT, "coordinator did not answer in time");
    }
  }
  return 0;
}

static int connect_to(const char *host, int port, int sockbuf, double t_end, int *out) {
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) return tr_fail(TR_EINVAL, "'%s' is not an IPv4 address", host);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return tr_fail(TR_EIO, "socket: %s", strerror(errno));
  set_nonblock(fd);
  tune_socket(fd, sockbuf);
  if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0 && errno != EINPROGRESS) {
    int e = errno;
    close(fd);
    return tr_fail(FTAR_ECOORD, "connect %s:%d: %s", host, port, strerror(e));
  }
  *out = fd;
  if (t_end <= 0) return 0; /* caller completes the connect */
  if (io_wait(fd, POLLOUT, t_end)) {
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
  return 0;
}

static int handshake(ftar_member *m, int fd, double t_end) {
  uint8_t hb[FTAR_HDR], pay[FTAR_REASON_MAX + 1];
  uint8_t hello[FTAR_HELLO_LEN] = {0};
  size_t hl = strlen(m->data_host);
  ftw_put32(hello, FTAR_VERSION);
  ftw_put16(hello + 4, (uint16_t)m->lport);
  ftw_put16(hello + 6, (uint16_t)hl);
  memcpy(hello + 8, m->data_host, hl);
  ftar_hdr h = {.type = FT_HELLO, .index = (uint32_t)m->slot, .len = FTAR_HELLO_LEN};
  ftar_frame_build(hb, &h, hello);
  int rc;
  if ((rc = io_all(fd, hb, FTAR_HDR, 1, t_end)) || (rc = io_all(fd, hello, sizeof hello, 1, t_end)))
    return rc;
  if ((rc = io_all(fd, hb, FTAR_HDR, 0, t_end))) return rc;
  ftar_hdr_decode(hb, &h);
  char why[200];
  if (ftar_hdr_check(&h, 0, why, sizeof why)) return tr_fail(FTAR_ECOORD, "coordinator handshake: %s", why);
  if (h.type != FT_WELCOME && h.type != FT_REJECT)
    return tr_fail(FTAR_ECOORD, "coordinator handshake: unexpected %s frame", ftar_type_name(h.type));
  if ((rc = io_all(fd, pay, h.len, 0, t_end))) return rc;
  if (ftar_frame_crc(hb, pay, h.len) != h.crc) return tr_fail(FTAR_ECOORD, "coordinator handshake: bad checksum");
  if (h.type == FT_REJECT) {
    pay[h.len] = 0;
    return tr_fail(FTAR_ECOORD, "coordinator refused slot %d: %s", m->slot, (char *)pay);
  }
  if (h.len != FTAR_WELCOME_LEN) return tr_fail(FTAR_ECOORD, "coordinator handshake: malformed WELCOME");
  m->uid = ftw_get64(pay);
  m->coord_deadline = ftw_get32(pay + 8) / 1000.0;
  m->hb_interval = ftw_get32(pay + 12) / 1000.0;
  if (!(m->coord_deadline > 0)) m->coord_deadline = 3.0;
  if (!(m->hb_interval > 0) || m->hb_interval > m->coord_deadline / 2) m->hb_interval = m->coord_deadline / 6;
  return 0;
}

/* --- lifecycle --- */

ftar_member *ftar_member_create(const char *coord_host, int coord_port, int slot, const ftar_member_opts *o) {
  ftar_member *m = NULL;
  int cfd = -1;
  if (!coord_host || coord_port <= 0 || coord_port > 65535 || slot < 0 || slot >= (1 << 30)) {
    tr_fail(TR_EINVAL, "ftar_member_create: bad arguments");
    return NULL;
  }
  m = calloc(1, sizeof *m);
  if (!m) {
    tr_fail(TR_ENOMEM, "ftar_member_create: out of memory");
    return NULL;
  }
  m->cmd[0] = m->cmd[1] = m->wake[0] = m->wake[1] = m->lfd = m->up_fd = m->down_fd = -1;
  m->up_shm.memfd = m->down_shm.memfd = -1;
  pthread_mutex_init(&m->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&m->cv, &ca);
  pthread_condattr_destroy(&ca);
  ftar_member_opts_default(&m->o);
  if (o) m->o = *o;
  if (!m->o.data_host) m->o.data_host = "127.0.0.1";
  if (!(m->o.timeout > 0)) m->o.timeout = 60.0;
  if (m->o.min_members < 1) m->o.min_members = 1;
  if (m->o.chunk_bytes < 64) m->o.chunk_bytes = 256 * 1024;
  if (m->o.chunk_bytes > ((size_t)64 << 20)) m->o.chunk_bytes = (size_t)64 << 20;
  m->chunk = m->o.chunk_bytes / sizeof(float);
  m->slot = slot;
  if (strlen(m->o.data_host) > FTAR_HOST_MAX) {
    tr_fail(TR_EINVAL, "ftar: data host '%s' too long", m->o.data_host);
    goto error;
  }
  snprintf(m->data_host, sizeof m->data_host, "%s", m->o.data_host);
  m->rx = malloc(RX_CAP);
  m->stage = malloc(m->chunk * sizeof(float));
  if (!m->rx || !m->stage) {
    tr_fail(TR_ENOMEM, "ftar: out of memory");
    goto error;
  }
  double t_end = tr_now() + m->o.timeout;

  /* data listener */
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)m->o.data_port)};
  if (inet_pton(AF_INET, m->data_host, &sa.sin_addr) != 1) {
    tr_fail(TR_EINVAL, "ftar: data host '%s' is not an IPv4 address", m->data_host);
    goto error;
  }
  m->lfd = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  if (m->lfd < 0) {
    tr_fail(TR_EIO, "ftar: socket: %s", strerror(errno));
    goto error;
  }
  setsockopt(m->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  tune_socket(m->lfd, m->o.sockbuf);
  set_nonblock(m->lfd);
  if (bind(m->lfd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(m->lfd, 128) != 0) {
    tr_fail(TR_EIO, "ftar: cannot listen on %s:%d: %s", m->data_host, m->o.data_port, strerror(errno));
    goto error;
  }
  socklen_t sl = sizeof sa;
  getsockname(m->lfd, (struct sockaddr *)&sa, &sl);
  m->lport = ntohs(sa.sin_port);

  /* register */
  if (connect_to(coord_host, coord_port, 0, t_end, &cfd)) {
    tr_fail_prefix(FTAR_ECOORD, "ftar: coordinator");
    goto error;
  }
  int rc = handshake(m, cfd, t_end);
  if (rc) {
    tr_fail_prefix(rc, "ftar");
    goto error;
  }
  m->deadline = m->o.deadline > 0 ? m->o.deadline : m->coord_deadline;

  /* control thread */
  if (pipe(m->cmd) != 0 || pipe(m->wake) != 0) {
    tr_fail(TR_EIO, "ftar: pipe: %s", strerror(errno));
    goto error;
  }
  set_nonblock(m->cmd[0]);
  set_nonblock(m->cmd[1]);
  set_nonblock(m->wake[0]);
  set_nonblock(m->wake[1]);
  m->base = event_base_new();
  if (!m->base) {
    tr_fail(TR_ENOMEM, "ftar: event_base_new failed");
    goto error;
  }
  m->bev = bufferevent_socket_new(m->base, cfd, BEV_OPT_CLOSE_ON_FREE);
  if (!m->bev) {
    tr_fail(TR_ENOMEM, "ftar: bufferevent_socket_new failed");
    goto error;
  }
  cfd = -1; /* owned by bev */
  bufferevent_setcb(m->bev, ctl_read_cb, NULL, ctl_event_cb, m);
  bufferevent_enable(m->bev, EV_READ | EV_WRITE);
  m->hb_ev = event_new(m->base, -1, EV_PERSIST, ctl_hb_cb, m);
  m->cmd_ev = event_new(m->base, m->cmd[0], EV_READ | EV_PERSIST, ctl_cmd_cb, m);
  struct timeval tv = {.tv_sec = (time_t)m->hb_interval,
                       .tv_usec = (suseconds_t)((m->hb_interval - (double)(time_t)m->hb_interval) * 1e6)};
  if (!m->hb_ev || !m->cmd_ev || event_add(m->hb_ev, &tv) || event_add(m->cmd_ev, NULL)) {
    tr_fail(TR_ENOMEM, "ftar: cannot create control events");
    goto error;
  }
  if (pthread_create(&m->th, NULL, ctl_main, m) != 0) {
    tr_fail(TR_EIO, "ftar: cannot start the control thread");
    goto error;
  }
  m->th_started = 1;
  return m;
error:
  if (cfd >= 0) close(cfd);
  ftar_member_free(m);
  return NULL;
}

static void shm_unmap(shm_link *L) {
  if (L->h) munmap(L->h, SHM_DATA + L->size);
  if (L->memfd >= 0) close(L->memfd);
  memset(L, 0, sizeof *L);
  L->memfd = -1;
}

static void links_close(ftar_member *m) {
  close_fd(&m->up_fd);
  close_fd(&m->down_fd);
  shm_unmap(&m->up_shm);
  shm_unmap(&m->down_shm);
  m->down_state = DOWN_NONE;
  m->up_eof = m->down_eof = 0;
  m->rx_head = m->rx_tail = 0;
}

static void pend_remove(ftar_member *m, int i, int close_it) {
  if (close_it) close(m->pend[i].fd);
  memmove(m->pend + i, m->pend + i + 1, (size_t)(m->npend - i - 1) * sizeof m->pend[0]);
  m->npend--;
}

/* After the control thread stopped: write out whatever the bufferevent still
 * holds (whole frames), then LEAVE, so the coordinator sees a clean exit.
 * Bounded by a second; the output buffer is copied, not drained (libevent
 * freezes its start). */
static void send_leave(ftar_member *m) {
  uint8_t buf[4096];
  struct evbuffer *out = bufferevent_get_output(m->bev);
  size_t len = evbuffer_get_length(out);
  if (len + FTAR_HDR > sizeof buf) return; /* a backlog this big: the coordinator is not reading anyway */
  if (len && evbuffer_copyout(out, buf, len) != (ssize_t)len) return;
  ftar_hdr h = {.type = FT_LEAVE, .epoch = m->ep, .seq = m->last_seq, .index = (uint32_t)m->slot};
  ftar_frame_build(buf + len, &h, NULL);
  int fd = (int)bufferevent_getfd(m->bev);
  double t_end = tr_now() + 1.0;
  if (io_all(fd, buf, len + FTAR_HDR, 1, t_end) != 0) return;
  /* Read what the coordinator still sends until it closes (it does on
   * LEAVE): closing a socket with unread bytes sends a reset, and a reset
   * can discard the LEAVE before the coordinator reads it. Bounded. */
  shutdown(fd, SHUT_WR);
  for (;;) {
    int ms = (int)((t_end - tr_now()) * 1000);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (ms <= 0 || poll(&p, 1, ms) <= 0) break;
    ssize_t r = recv(fd, buf, sizeof buf, 0);
    if (r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN)) break;
  }
}

void ftar_member_free(ftar_member *m) {
  if (!m) return;
  if (m->dev_free) m->dev_free(m->dev_state); /* the device plane first: its communicator may take a moment */
  m->dev_state = NULL;
  if (m->th_started) {
    pthread_mutex_lock(&m->mu);
    m->q_quit = 1;
    pthread_mutex_unlock(&m->mu);
    wake_fd(m->cmd[1]);
    pthread_join(m->th, NULL);
    if (m->bev) send_leave(m);
  }
  if (m->bev) bufferevent_free(m->bev);
  if (m->hb_ev) event_free(m->hb_ev);
  if (m->cmd_ev) event_free(m->cmd_ev);
  if (m->base) event_base_free(m->base);
  links_close(m);
  while (m->npend) pend_remove(m, m->npend - 1, 1);
  close_fd(&m->lfd);
  for (int i = 0; i < 2; i++) {
    close_fd(&m->cmd[i]);
    close_fd(&m->wake[i]);
  }
  free(m->rx);
  free(m->stage);
  free(m->in_copy);
  pthread_cond_destroy(&m->cv);
  pthread_mutex_destroy(&m->mu);
  free(m);
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
    cv_wait(m, t_end);
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

/* --- same-host shared-memory rings --- */

static int same_host(const ftar_member *m, const peer *p) { return strcmp(p->host, m->data_host) == 0; }

/* Producer: creates and maps the ring offered in CONNECT. */
static int shm_create(ftar_member *m) {
  shm_link *L = &m->down_shm;
  shm_unmap(L);
  int fd = memfd_create("ftar-link", MFD_CLOEXEC);
  if (fd < 0) return -1;
  if (ftruncate(fd, SHM_DATA + SHM_RING) != 0) {
    close(fd);
    return -1;
  }
  void *p = mmap(NULL, SHM_DATA + SHM_RING, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    return -1;
  }
  L->h = p;
  L->data = (uint8_t *)p + SHM_DATA;
  L->size = SHM_RING;
  L->memfd = fd;
  L->h->magic = SHM_MAGIC;
  L->h->size = SHM_RING;
  uint64_t tok = 0;
  if (getrandom(&tok, sizeof tok, GRND_NONBLOCK) != (ssize_t)sizeof tok)
    tok = (uint64_t)(tr_now() * 1e9) ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)p;
  L->h->token = tok;
  return 0;
}

/* Consumer: maps the ring a CONNECT payload describes; checks it is what the
 * sender announced (size, token) before trusting it. */
static int shm_attach(ftar_member *m, const uint8_t *pay) {
  shm_link *L = &m->up_shm;
  shm_unmap(L);
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
    p = mmap(NULL, SHM_DATA + size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return -1;
  shm_hdr *h = p;
  if (h->magic != SHM_MAGIC || h->size != size || h->token != tok) {
    munmap(p, SHM_DATA + size);
    return -1;
  }
  L->h = h;
  L->data = (uint8_t *)p + SHM_DATA;
  L->size = size;
  L->pos = atomic_load(&h->tail);
  L->active = 1;
  return 0;
}

static void doorbell(int fd) {
  char b = 'd';
  ssize_t w = send(fd, &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT); /* EAGAIN: one is pending already */
  (void)w;
}

/* Producer: copies as much of iov as fits. Bytes written, or -1 if the
 * consumer corrupted the counters. */
static ssize_t shm_write(ftar_member *m, const struct iovec *iov, int niov) {
  shm_link *L = &m->down_shm;
  uint64_t tail = atomic_load_explicit(&L->h->tail, memory_order_acquire), head = L->pos;
  if (tail > head || head - tail > L->size) return -1;
  size_t space = L->size - (size_t)(head - tail), done = 0;
  for (int i = 0; i < niov && done < space; i++) {
    size_t n = iov[i].iov_len < space - done ? iov[i].iov_len : space - done;
    size_t off = (size_t)(head + done) & (L->size - 1), first = L->size - off < n ? L->size - off : n;
    memcpy(L->data + off, iov[i].iov_base, first);
    memcpy(L->data, (const uint8_t *)iov[i].iov_base + first, n - first);
    done += n;
  }
  if (done) {
    L->pos = head + done;
    atomic_store(&L->h->head, L->pos);
    uint32_t one = 1;
    if (atomic_load(&L->h->cons_waiting) && atomic_compare_exchange_strong(&L->h->cons_waiting, &one, 0))
      doorbell(m->down_fd);
  }
  return (ssize_t)done;
}

/* Consumer: copies up to cap bytes out. Bytes read, or -1 if corrupt. */
static ssize_t shm_read(ftar_member *m, void *dst, size_t cap) {
  shm_link *L = &m->up_shm;
  uint64_t head = atomic_load_explicit(&L->h->head, memory_order_acquire), tail = L->pos;
  if (head < tail || head - tail > L->size) return -1;
  size_t n = (size_t)(head - tail);
  if (n > cap) n = cap;
  if (n) {
    size_t off = (size_t)tail & (L->size - 1), first = L->size - off < n ? L->size - off : n;
    memcpy(dst, L->data + off, first);
    memcpy((uint8_t *)dst + first, L->data, n - first);
    L->pos = tail + n;
    atomic_store(&L->h->tail, L->pos);
    uint32_t one = 1;
    if (atomic_load(&L->h->prod_waiting) && atomic_compare_exchange_strong(&L->h->prod_waiting, &one, 0))
      doorbell(m->up_fd);
  }
  return (ssize_t)n;
}

/* Consumer, zero-copy: the contiguous bytes readable in place (up to the
 * ring's end), or NULL with *n = 0 if none; *bad set if the counters are
 * corrupt. */
static const uint8_t *shm_peek(ftar_member *m, size_t *n, int *bad) {
  shm_link *L = &m->up_shm;
  uint64_t head = atomic_load_explicit(&L->h->head, memory_order_acquire), tail = L->pos;
  *n = 0;
  if (head < tail || head - tail > L->size) {
    *bad = 1;
    return NULL;
  }
  size_t avail = (size_t)(head - tail), off = (size_t)tail & (L->size - 1);
  *n = avail < L->size - off ? avail : L->size - off;
  return *n ? L->data + off : NULL;
}

static void shm_consume(ftar_member *m, size_t n) {
  shm_link *L = &m->up_shm;
  L->pos += n;
  atomic_store(&L->h->tail, L->pos);
  uint32_t one = 1;
  if (atomic_load(&L->h->prod_waiting) && atomic_compare_exchange_strong(&L->h->prod_waiting, &one, 0))
    doorbell(m->up_fd);
}

/* --- data port: strangers and CONNECT handshakes --- */

static void pend_reject(ftar_member *m, int i, const char *why) {
  mlog(m, "data port: closing a connection: %s", why);
  m->st.conns_rejected++;
  pend_remove(m, i, 1);
}

static void pend_accept(ftar_member *m) {
  for (;;) {
    int fd = accept(m->lfd, NULL, NULL);
    if (fd < 0) {
      if (errno == EINTR) continue;
      return; /* EAGAIN, or out of descriptors: try again next round */
    }
    set_nonblock(fd);
    tune_socket(fd, m->o.sockbuf);
    if (m->npend == PENDING_MAX) pend_reject(m, 0, "too many unidentified connections, dropping the oldest");
    pending *q = &m->pend[m->npend++];
    memset(q, 0, sizeof *q);
    q->fd = fd;
    q->t0 = tr_now();
  }
}

/* Reads what each stranger sent; validates the CONNECT frame as it comes. */
static void pend_read(ftar_member *m) {
  char why[200];
  for (int i = 0; i < m->npend; i++) {
    pending *q = &m->pend[i];
    if (q->complete) continue;
    ssize_t k = recv(q->fd, q->b + q->got, sizeof q->b - q->got, 0);
    if (k == 0) {
      snprintf(why, sizeof why, "truncated handshake (%zu of %zu bytes, then EOF)", q->got, sizeof q->b);
      pend_reject(m, i--, why);
      continue;
    }
    if (k < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        snprintf(why, sizeof why, "handshake: %s", strerror(errno));
        pend_reject(m, i--, why);
      }
      continue;
    }
    size_t before = q->got;
    q->got += (size_t)k;
    if (before < FTAR_HDR && q->got >= FTAR_HDR) {
      ftar_hdr_decode(q->b, &q->h);
      int bad = ftar_hdr_check(&q->h, 0, why, sizeof why) != 0;
      if (!bad && (q->h.type != FT_CONNECT || q->h.len != FTAR_CONNECT_LEN)) {
        snprintf(why, sizeof why, "expected CONNECT, got %s with length %u", ftar_type_name(q->h.type), q->h.len);
        bad = 1;
      }
      if (bad) {
        pend_reject(m, i--, why);
        continue;
      }
    }
    if (q->got == sizeof q->b) {
      if (ftar_frame_crc(q->b, q->b + FTAR_HDR, FTAR_CONNECT_LEN) != q->h.crc) {
        pend_reject(m, i--, "bad checksum on CONNECT");
        continue;
      }
      q->uid = ftw_get64(q->b + FTAR_HDR);
      q->complete = 1;
    }
  }
}

/* Adopts a parked CONNECT from our upstream for run_ep; drops stale ones and
 * strangers that overstayed. */
static void pend_match(ftar_member *m) {
  double now = tr_now();
  const peer *up = m->run_n > 1 ? &m->run_mem[(m->run_r + m->run_n - 1) % m->run_n] : NULL;
  char why[200];
  for (int i = 0; i < m->npend; i++) {
    pending *q = &m->pend[i];
    if (!q->complete) {
      if (now - q->t0 > m->deadline) {
        snprintf(why, sizeof why, "no valid CONNECT within %.2f s (%zu bytes)", m->deadline, q->got);
        pend_reject(m, i--, why);
      }
      continue;
    }
    if (q->h.epoch < m->run_ep) {
      snprintf(why, sizeof why, "CONNECT from slot %u for stale epoch %llu (current %llu)", q->h.index,
               (unsigned long long)q->h.epoch, (unsigned long long)m->run_ep);
      pend_reject(m, i--, why);
    } else if (q->h.epoch == m->run_ep) {
      if (!up || q->h.aux != (uint32_t)m->slot || q->h.index != (uint32_t)up->slot || q->uid != up->uid) {
        snprintf(why, sizeof why, "CONNECT from slot %u (uid %llu) to slot %u is not from our upstream", q->h.index,
                 (unsigned long long)q->uid, q->h.aux);
        pend_reject(m, i--, why);
      } else if (m->up_fd >= 0) {
        pend_reject(m, i--, "second CONNECT from our upstream in one epoch");
      } else {
        m->up_fd = q->fd;
        m->up_eof = 0;
        m->rx_head = m->rx_tail = 0;
        char ack = 'T';
        if ((q->h.flags & FTF_SHM) && m->o.shm && shm_attach(m, q->b + FTAR_HDR) == 0) ack = 'S';
        if (send(m->up_fd, &ack, 1, MSG_NOSIGNAL | MSG_DONTWAIT) != 1) {
          mlog(m, "data port: cannot answer slot %u's CONNECT: %s", q->h.index, strerror(errno));
          close_fd(&m->up_fd);
          shm_unmap(&m->up_shm);
          pend_remove(m, i--, 0);
          continue;
        }
        if (ack == 'S') m->st.links_shm++;
        else m->st.links_tcp++;
        pend_remove(m, i--, 0);
      }
    } else if (now - q->t0 > m->o.timeout) {
      pend_reject(m, i--, "CONNECT for a future epoch that never came");
    }
  }
}

/* --- the ring --- */

enum { R_DONE = 0, R_ABORT = 1, R_FATAL = 2 };

typedef struct {
  ftar_member *m;
  float *buf;
  size_t n, F;
  int p, r, nsteps;
  ftar_op op;
  uint64_t ep, seq;
  /* send cursor: next frame (ss, sj), global frame number sidx */
  int ss;
  size_t sj;
  uint32_t sidx;
  int s_busy, s_token, s_connect;
  uint8_t s_hdr[FTAR_HDR], s_extra[FTAR_CONNECT_LEN];
  const uint8_t *s_pay;
  size_t s_len, s_off;
  /* receive cursor */
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

/* What was overwritten in buf (and saved in in_copy): per segment, a prefix,
 * in the segment geometry of the ring that did it. */
typedef struct {
  int p;
  size_t n;
  size_t copied[FTAR_MAX_MEMBERS];
} undo_log;

static inline int modp(int a, int p) { return ((a % p) + p) % p; }

/* Frame size in floats, the same on every member (it depends only on n, p
 * and chunk). Big frames are whole multiples of FRAME_UNIT: 65408 payload
 * bytes + the 40-byte header fit one 64 KiB loopback TCP segment, so with
 * TCP_NODELAY a frame never leaves a runt segment behind (on 1500/9000-byte
 * MTUs the unit is irrelevant). About 4 frames per segment so the steps
 * pipeline (8 pipelined better on paper but cost more wake-ups than they
 * saved when ranks share cores); small buffers use frames of at least
 * 16 KiB; at most chunk. */
#define FRAME_UNIT 16352
static size_t frame_floats(size_t n, int p, size_t chunk) {
  size_t seg = (n + (size_t)p - 1) / (size_t)p, f = (seg + 3) / 4;
  size_t cap = chunk >= FRAME_UNIT ? chunk / FRAME_UNIT * FRAME_UNIT : (chunk + 15) & ~(size_t)15;
  if (f <= FRAME_UNIT) {
    f = (f + 15) & ~(size_t)15;
    if (f < 4096) f = 4096;
    if (f > FRAME_UNIT) f = FRAME_UNIT;
  } else {
    f = (f + FRAME_UNIT - 1) / FRAME_UNIT * FRAME_UNIT;
  }
  return f < cap ? f : cap;
}

static inline size_t seg_len_p(size_t n, int p, int c) { return n / (size_t)p + ((size_t)c < n % (size_t)p); }
static inline size_t seg_off_p(size_t n, int p, int c) {
  size_t b = n / (size_t)p, rem = n % (size_t)p;
  return (size_t)c * b + ((size_t)c < rem ? (size_t)c : rem);
}
static inline size_t seg_frames(const ring *g, int c) { return (seg_len_p(g->n, g->p, c) + g->F - 1) / g->F; }
static inline int send_seg(const ring *g, int s) {
  return s < g->p - 1 ? modp(g->r - s, g->p) : modp(g->r + 1 - (s - (g->p - 1)), g->p);
}
static inline int recv_seg(const ring *g, int s) {
  return s < g->p - 1 ? modp(g->r - s - 1, g->p) : modp(g->r - (s - (g->p - 1)), g->p);
}

static void skip_send(ring *g) {
  while (g->ss < g->nsteps && g->sj >= seg_frames(g, send_seg(g, g->ss))) {
    g->ss++;
    g->sj = 0;
  }
}
static void skip_recv(ring *g) {
  while (g->rs < g->nsteps && g->rj >= seg_frames(g, recv_seg(g, g->rs))) {
    g->rs++;
    g->rj = 0;
  }
}

static void undo_restore(ftar_member *m, float *buf, undo_log *u) {
  for (int c = 0; c < u->p; c++) {
    if (!u->copied[c]) continue;
    size_t off = seg_off_p(u->n, u->p, c);
    memcpy(buf + off, m->in_copy + off, u->copied[c] * sizeof(float));
    u->copied[c] = 0;
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

static void update_full(ring *g) {
  if (!g->full && g->rs >= g->nsteps && g->ss >= g->nsteps) g->full = 1;
}

static int send_ready(const ring *g) {
  if (g->ss >= g->nsteps) return 0;
  if (g->ss == 0) return 1;
  return g->rs > g->ss - 1 || (g->rs == g->ss - 1 && g->rj > g->sj);
}

static int token_ready(const ring *g) {
  int k = g->tok_sent + 1;
  return g->full && k <= g->p - 1 && g->tok_recv >= k - 1;
}

static void prep_data(ring *g, undo_log *u) {
  int c = send_seg(g, g->ss);
  size_t off = seg_off_p(g->n, g->p, c) + g->sj * g->F;
  size_t len = seg_len_p(g->n, g->p, c) - g->sj * g->F;
  if (len > g->F) len = g->F;
  float *x = g->buf + off;
  uint32_t pcrc;
  if (g->ss == 0) { /* our own segment, overwritten by the all-gather later: save it, same pass */
    pcrc = tr_crc32c_copy(0, g->m->in_copy + off, x, len * sizeof(float));
    u->copied[c] += len;
  } else {
    if (g->ss == g->p - 1 && g->op == FTAR_MEAN) { /* the segment we own: divide once, everyone gets these bits */
      float d = (float)g->p;
      for (size_t k = 0; k < len; k++) x[k] /= d;
    }
    pcrc = tr_crc32c(0, x, len * sizeof(float));
  }
  ftar_hdr h = {.type = FT_DATA,
                .flags = (uint16_t)g->op,
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
  ftar_hdr h = {.type = FT_TOKEN, .epoch = g->ep, .seq = g->seq, .index = (uint32_t)(g->tok_sent + 1)};
  ftar_frame_build(g->s_hdr, &h, NULL);
  g->s_pay = NULL;
  g->s_len = g->s_off = 0;
  g->s_busy = g->s_token = 1;
  g->s_connect = 0;
}

static void prep_connect(ring *g) {
  ftar_member *m = g->m;
  const peer *d = &m->run_mem[(m->run_r + 1) % m->run_n];
  memset(g->s_extra, 0, sizeof g->s_extra);
  ftw_put64(g->s_extra, m->uid);
  uint16_t flags = 0;
  if (m->o.shm && same_host(m, d) && shm_create(m) == 0) {
    flags = FTF_SHM;
    ftw_put32(g->s_extra + 8, (uint32_t)getpid());
    ftw_put32(g->s_extra + 12, (uint32_t)m->down_shm.memfd);
    ftw_put32(g->s_extra + 16, (uint32_t)m->down_shm.size);
    ftw_put64(g->s_extra + 24, m->down_shm.h->token);
  }
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
  const ftar_member *m = g->m;
  if (m->down_state == DOWN_CONNECTING || m->down_state == DOWN_ACK) return 1;
  return g->s_busy || m->down_state == DOWN_HELLO || send_ready(g) || token_ready(g);
}

/* Still something to send in this collective (the downstream must live). */
static int send_pending(const ring *g) { return g->s_busy || g->ss < g->nsteps || g->tok_sent < g->p - 1; }

/* Returns 1 on progress, 0 if blocked, -1 on failure (g->why). */
static int pump_send(ring *g, undo_log *u) {
  ftar_member *m = g->m;
  int progress = 0;
  if (m->down_state == DOWN_CONNECTING || m->down_state == DOWN_ACK) return 0; /* poll reports these */
  for (;;) {
    if (!g->s_busy) {
      if (m->down_state == DOWN_HELLO) prep_connect(g);
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
    if (m->down_shm.active) {
      if ((w = shm_write(m, iov, niov)) < 0)
        return ring_fail(g, "shared-memory ring to slot %d is corrupt", m->run_mem[(m->run_r + 1) % m->run_n].slot);
      if (w == 0) return progress;
    } else {
      struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)niov};
      w = sendmsg(m->down_fd, &mh, MSG_NOSIGNAL);
    }
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return progress;
      return ring_fail(g, "send to slot %d: %s", m->run_mem[(m->run_r + 1) % m->run_n].slot, strerror(errno));
    }
    progress = 1;
    g->s_off += (size_t)w;
    m->st.bytes_sent += (uint64_t)w;
    if (g->s_off == total) {
      g->s_busy = 0;
      if (g->s_token) g->tok_sent++;
      update_full(g);
      if (g->s_connect) { /* nothing more until the receiver answers 'S' or 'T' */
        g->s_connect = 0;
        m->down_state = DOWN_ACK;
        return progress;
      }
    }
  }
}

static int expecting(const ring *g) { return g->rs < g->nsteps || g->tok_recv < g->p - 1; }

/* Where the payload of the next DATA frame goes: stage (reduce-scatter, added
 * after the CRC check) or its place in buf (all-gather). */
static uint8_t *expected_dst(const ring *g) {
  if (g->rs < g->p - 1) return (uint8_t *)g->m->stage;
  int c = recv_seg(g, g->rs);
  return (uint8_t *)(g->buf + seg_off_p(g->n, g->p, c) + g->rj * g->F);
}

/* Payload bytes of the next frame the upstream should send. */
static size_t expected_len(const ring *g) {
  if (g->rs >= g->nsteps) return 0;
  int c = recv_seg(g, g->rs);
  size_t len = seg_len_p(g->n, g->p, c) - g->rj * g->F;
  return (len > g->F ? g->F : len) * sizeof(float);
}


/* Validates the header just read against what the ring expects next. */
static int check_rx_header(ring *g) {
  ftar_member *m = g->m;
  ftar_hdr *h = &g->rh;
  int upslot = m->run_mem[(m->run_r + m->run_n - 1) % m->run_n].slot;
  char why[200];
  if (ftar_hdr_check(h, (uint32_t)(g->F * 4), why, sizeof why))
    return ring_fail(g, "malformed frame from slot %d: %s", upslot, why);
  int want = g->rs < g->nsteps ? FT_DATA : FT_TOKEN;
  if (h->type != want)
    return ring_fail(g, "slot %d sent %s, expected %s", upslot, ftar_type_name(h->type), ftar_type_name((unsigned)want));
  if (h->epoch != g->ep)
    return ring_fail(g, "slot %d sent a frame of epoch %llu in epoch %llu (refused)", upslot,
                     (unsigned long long)h->epoch, (unsigned long long)g->ep);
  if (h->seq != g->seq)
    return ring_fail(g, "slot %d sent a frame of seq %llu while running seq %llu", upslot, (unsigned long long)h->seq,
                     (unsigned long long)g->seq);
  if (want == FT_TOKEN) {
    if (h->index != (uint32_t)(g->tok_recv + 1) || h->len != 0)
      return ring_fail(g, "slot %d sent token %u, expected %d", upslot, h->index, g->tok_recv + 1);
    g->r_dst = NULL;
    return 0;
  }
  int c = recv_seg(g, g->rs);
  size_t off = seg_off_p(g->n, g->p, c) + g->rj * g->F;
  size_t len = seg_len_p(g->n, g->p, c) - g->rj * g->F;
  if (len > g->F) len = g->F;
  if (h->flags != (uint16_t)g->op || h->aux != (uint32_t)g->n)
    return ring_fail(g, "slot %d runs op %u on %u floats, we run op %d on %zu (callers disagree)", upslot, h->flags,
                     h->aux, (int)g->op, g->n);
  if (h->index != g->ridx || h->len != len * 4)
    return ring_fail(g, "slot %d sent frame %u of %u bytes, expected frame %u of %zu bytes", upslot, h->index, h->len,
                     g->ridx, len * 4);
  g->r_dst = g->rs < g->p - 1 ? (uint8_t *)m->stage : (uint8_t *)(g->buf + off);
  return 0;
}

/* recv() on the upstream link into dst. Returns bytes (> 0), 0 if it would
 * block, -1 on EOF or error (g->why). */
static ssize_t up_recv(ring *g, void *dst, size_t cap) {
  ftar_member *m = g->m;
  int upslot = m->run_mem[(m->run_r + m->run_n - 1) % m->run_n].slot;
  if (m->up_shm.active) {
    ssize_t k = shm_read(m, dst, cap);
    if (k < 0) return ring_fail(g, "shared-memory ring from slot %d is corrupt", upslot);
    if (k > 0) m->st.bytes_recv += (uint64_t)k;
    else if (m->up_eof) return ring_fail(g, "slot %d closed the link", upslot);
    return k;
  }
  ssize_t k = recv(m->up_fd, dst, cap, 0);
  if (k > 0) {
    m->st.bytes_recv += (uint64_t)k;
    return k;
  }
  if (k == 0) return ring_fail(g, "slot %d closed the link", upslot);
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
  return ring_fail(g, "receive from slot %d: %s", upslot, strerror(errno));
}

static int pump_recv(ring *g, undo_log *u) {
  ftar_member *m = g->m;
  int progress = 0, shm = m->up_shm.active, bad = 0;
  int upslot = m->run_mem[(m->run_r + m->run_n - 1) % m->run_n].slot;
  while (expecting(g)) {
    size_t have = m->rx_tail - m->rx_head;
    if (!g->r_have) {
      if (shm) { /* headers are copied out (40 bytes, maybe across the wrap) */
        size_t n;
        shm_peek(m, &n, &bad);
        uint64_t avail = bad ? 0 : atomic_load(&m->up_shm.h->head) - m->up_shm.pos;
        if (bad) return ring_fail(g, "shared-memory ring from slot %d is corrupt", upslot);
        if (avail < FTAR_HDR) {
          if (m->up_eof) return ring_fail(g, "slot %d closed the link", upslot);
          return progress;
        }
        if (shm_read(m, g->rhb, FTAR_HDR) != FTAR_HDR) return ring_fail(g, "shared-memory ring from slot %d is corrupt", upslot);
        m->st.bytes_recv += FTAR_HDR;
      } else {
        size_t elen = expected_len(g);
        if (have == 0 && elen >= RX_CAP / 2) {
          /* a big frame is next and rx is empty: header and payload in one
           * recvmsg, the payload straight to where check_rx_header will put it */
          struct iovec iov[2] = {{g->rhb, FTAR_HDR}, {expected_dst(g), elen}};
          struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
          ssize_t k = recvmsg(m->up_fd, &mh, 0);
          if (k == 0) return ring_fail(g, "slot %d closed the link", upslot);
          if (k < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return progress;
            return ring_fail(g, "receive from slot %d: %s", upslot, strerror(errno));
          }
          m->st.bytes_recv += (uint64_t)k;
          progress = 1;
          if (k < FTAR_HDR) { /* a partial header: finish it through rx */
            memcpy(m->rx, g->rhb, (size_t)k);
            m->rx_head = 0;
            m->rx_tail = (size_t)k;
            continue;
          }
          ftar_hdr_decode(g->rhb, &g->rh);
          if (check_rx_header(g)) return -1;
          g->r_have = 1;
          g->r_got = (size_t)k - FTAR_HDR;
          g->r_crc = 0;
          g->started = 1;
          continue;
        }
        if (have < FTAR_HDR) {
          if (m->rx_head > 0) {
            memmove(m->rx, m->rx + m->rx_head, have);
            m->rx_head = 0;
            m->rx_tail = have;
          }
          /* before a big payload read just the header, so the payload goes
           * straight to its place instead of through rx */
          size_t want = RX_CAP - m->rx_tail;
          if (expected_len(g) >= RX_CAP / 2) want = FTAR_HDR - have;
          ssize_t k = up_recv(g, m->rx + m->rx_tail, want);
          if (k < 0) return -1;
          if (k == 0) return progress;
          m->rx_tail += (size_t)k;
          progress = 1;
          continue;
        }
        memcpy(g->rhb, m->rx + m->rx_head, FTAR_HDR);
        m->rx_head += FTAR_HDR;
      }
      ftar_hdr_decode(g->rhb, &g->rh);
      if (check_rx_header(g)) return -1;
      g->r_have = 1;
      g->r_got = 0;
      g->r_crc = 0;
      if (!g->started) g->started = 1;
      progress = 1;
      have = m->rx_tail - m->rx_head;
    }
    int rs_frame = g->rh.type == FT_DATA && g->rs < g->p - 1;
    int c = g->rh.type == FT_DATA ? recv_seg(g, g->rs) : 0;
    size_t off = g->rh.type == FT_DATA ? seg_off_p(g->n, g->p, c) + g->rj * g->F : 0;
    size_t need = g->rh.len - g->r_got;
    if (need > 0 && shm) { /* in place from the ring: verify-and-add or verify-and-copy in one pass */
      size_t k;
      const uint8_t *src = shm_peek(m, &k, &bad);
      if (bad) return ring_fail(g, "shared-memory ring from slot %d is corrupt", upslot);
      if (k > need) k = need;
      k &= ~(size_t)3; /* whole floats; offsets in the ring are multiples of 4 */
      if (k == 0) {
        if (m->up_eof) return ring_fail(g, "slot %d closed the link", upslot);
        return progress;
      }
      if (rs_frame) {
        size_t f0 = off + g->r_got / 4;
        g->r_crc = tr_crc32c_reduce(g->r_crc, g->buf + f0, m->in_copy + f0, (const float *)(const void *)src, k / 4);
        u->copied[c] += k / 4;
      } else {
        g->r_crc = tr_crc32c_copy(g->r_crc, g->r_dst + g->r_got, src, k);
      }
      shm_consume(m, k);
      m->st.bytes_recv += k;
      g->r_got += k;
      progress = 1;
      continue;
    }
    if (need > 0) {
      if (have > 0) {
        size_t k = have < need ? have : need;
        memcpy(g->r_dst + g->r_got, m->rx + m->rx_head, k);
        m->rx_head += k;
        g->r_got += k;
        progress = 1;
        continue;
      }
      m->rx_head = m->rx_tail = 0;
      /* big payloads go straight to their place; small ones through rx so
       * that one recv() brings several frames */
      int direct = need >= RX_CAP / 2;
      ssize_t k = direct ? up_recv(g, g->r_dst + g->r_got, need) : up_recv(g, m->rx, RX_CAP);
      if (k < 0) return -1;
      if (k == 0) return progress;
      if (direct) g->r_got += (size_t)k;
      else m->rx_tail = (size_t)k;
      progress = 1;
      continue;
    }
    /* a whole frame: reduce (TCP: from stage) and verify; a bad frame aborts
     * the collective and the undo log restores what was touched */
    uint32_t pcrc;
    if (shm) {
      pcrc = g->r_crc;
    } else if (rs_frame) {
      size_t len = g->rh.len / 4;
      pcrc = tr_crc32c_reduce(0, g->buf + off, m->in_copy + off, m->stage, len);
      u->copied[c] += len;
    } else {
      pcrc = g->rh.len ? tr_crc32c(0, g->r_dst, g->rh.len) : 0;
    }
    if (ftar_frame_crc_finish(pcrc, g->rhb) != g->rh.crc)
      return ring_fail(g, "bad checksum on %s frame %u from slot %d", ftar_type_name(g->rh.type), g->rh.index, upslot);
    g->r_have = 0;
    if (g->rh.type == FT_TOKEN) {
      g->tok_recv++;
    } else {
      g->ridx++;
      g->rj++;
      skip_recv(g);
    }
    update_full(g);
  }
  return progress;
}

/* Starts the link to our downstream for run_ep. */
static int down_start(ring *g) {
  ftar_member *m = g->m;
  const peer *d = &m->run_mem[(m->run_r + 1) % m->run_n];
  int fd;
  if (connect_to(d->host, d->port, m->o.sockbuf, 0, &fd))
    return ring_fail(g, "connect to slot %d: %s", d->slot, tr_error());
  m->down_fd = fd;
  m->down_state = DOWN_CONNECTING;
  return 0;
}

static int down_finish_connect(ring *g) {
  ftar_member *m = g->m;
  int err = 0;
  socklen_t el = sizeof err;
  getsockopt(m->down_fd, SOL_SOCKET, SO_ERROR, &err, &el);
  if (err) return ring_fail(g, "connect to slot %d: %s", m->run_mem[(m->run_r + 1) % m->run_n].slot, strerror(err));
  m->down_state = DOWN_HELLO;
  return 0;
}

/* The receiver's answer to CONNECT: 'S' use the ring, 'T' use TCP. */
static int down_read_ack(ring *g) {
  ftar_member *m = g->m;
  int slot = m->run_mem[(m->run_r + 1) % m->run_n].slot;
  char a;
  ssize_t k = recv(m->down_fd, &a, 1, MSG_DONTWAIT);
  if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
  if (k <= 0) return ring_fail(g, "slot %d closed the link before answering CONNECT", slot);
  if (a == 'S' && m->down_shm.h) {
    m->down_shm.active = 1;
    close_fd(&m->down_shm.memfd); /* mapped on both sides now */
    m->st.links_shm++;
  } else if (a == 'T') {
    shm_unmap(&m->down_shm);
    m->st.links_tcp++;
  } else {
    return ring_fail(g, "slot %d answered CONNECT with 0x%02x", slot, (unsigned char)a);
  }
  m->down_state = DOWN_READY;
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
  ftar_member *m = g->m;
  int ready = 0;
  shm_link *U = &m->up_shm, *D = &m->down_shm;
  if (U->active && expecting(g)) {
    U->armed = 1;
    atomic_store(&U->h->cons_waiting, 1);
    if (atomic_load(&U->h->head) != U->pos) ready = 1;
  }
  if (D->active && m->down_state == DOWN_READY && (g->s_busy || send_ready(g) || token_ready(g))) {
    D->armed = 1;
    atomic_store(&D->h->prod_waiting, 1);
    if (D->pos - atomic_load(&D->h->tail) < D->size) ready = 1;
  }
  return ready;
}

static void shm_disarm(ftar_member *m) {
  if (m->up_shm.armed) atomic_store(&m->up_shm.h->cons_waiting, 0);
  if (m->down_shm.armed) atomic_store(&m->down_shm.h->prod_waiting, 0);
  m->up_shm.armed = m->down_shm.armed = 0;
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

/* Runs one collective in run_ep. R_DONE, R_ABORT (links closed, g->why,
 * g->full tells whether buf holds the full result), R_FATAL (timeout or
 * control link down). */
static int ring_run(ftar_member *m, ring *g, undo_log *u, float *buf, size_t n, ftar_op op, uint64_t seq,
                    double t_end, int *timed_out) {
  memset(g, 0, sizeof *g);
  g->m = m;
  g->buf = buf;
  g->n = n;
  g->F = frame_floats(n, m->run_n, m->chunk);
  g->p = m->run_n;
  g->r = m->run_r;
  g->nsteps = 2 * (g->p - 1);
  g->op = op;
  g->ep = m->run_ep;
  g->seq = seq;
  skip_send(g);
  skip_recv(g);
  update_full(g);
  u->p = g->p;
  u->n = n;
  memset(u->copied, 0, sizeof u->copied);
  *timed_out = 0;
  unsigned gen_seen = atomic_load(&m->gen) - 1; /* check once at the start */
  g->t_progress = tr_now();
  double spin = spin_seconds(m);
  if (m->down_fd < 0 && down_start(g)) goto abort;
  int stopping = 0;
  for (;;) {
    /* an aborting epoch (or a lost coordinator) stops the collective once
     * the ring is blocked, not at once: what peers already delivered (say
     * the last token of a member that finished and left) is consumed first */
    if (!stopping && ctl_check(g, &gen_seen)) stopping = 1;
    pend_match(m);
    int pr = 0, r;
    if (m->down_state != DOWN_CONNECTING) {
      if ((r = pump_send(g, u)) < 0) goto abort;
      pr |= r;
    }
    if (m->up_fd >= 0) {
      if ((r = pump_recv(g, u)) < 0) goto abort;
      pr |= r;
      if (pr) { /* receiving may have unblocked sends */
        if (m->down_state != DOWN_CONNECTING && (r = pump_send(g, u)) < 0) goto abort;
      }
    }
    double now = tr_now();
    if (pr) g->t_progress = now;
    if (g->full && g->tok_recv == g->p - 1 && g->tok_sent == g->p - 1 && !g->s_busy) return R_DONE;
    if (pr) continue;
    if (stopping) goto abort;
    if (g->started && now - g->t_progress > m->deadline) {
      ring_fail(g, "no progress for %.2f s (peer stalled)", now - g->t_progress);
      goto abort;
    }
    if (now > t_end) {
      ring_fail(g, "timed out after %.1f s waiting for peers", m->o.timeout);
      *timed_out = 1;
      goto abort;
    }
    struct pollfd pf[4 + PENDING_MAX];
    int np = 0, i_up = -1, i_down = -1, i_lis, i_pend0;
    pf[np++] = (struct pollfd){.fd = m->wake[0], .events = POLLIN};
    i_lis = np;
    pf[np++] = (struct pollfd){.fd = m->lfd, .events = POLLIN};
    if (m->up_fd >= 0 && expecting(g) && !m->up_eof) { /* data, or with a ring: doorbells and EOF */
      i_up = np;
      pf[np++] = (struct pollfd){.fd = m->up_fd, .events = POLLIN};
    }
    if (m->down_fd >= 0 && !m->down_eof) {
      short ev = 0;
      if (m->down_state == DOWN_CONNECTING) ev = POLLOUT;
      else if (m->down_state == DOWN_ACK) ev = POLLIN;
      else if (m->down_shm.active) ev = send_pending(g) ? POLLIN : 0;
      else if (want_send(g)) ev = POLLOUT;
      if (ev) {
        i_down = np;
        pf[np++] = (struct pollfd){.fd = m->down_fd, .events = ev};
      }
    }
    i_pend0 = np;
    for (int i = 0; i < m->npend; i++)
      if (!m->pend[i].complete) pf[np++] = (struct pollfd){.fd = m->pend[i].fd, .events = POLLIN};
    int spinning = now - g->t_progress < spin;
    if (!spinning && shm_arm(g)) continue; /* progress became possible while arming */
    int rc = poll(pf, (nfds_t)np, spinning ? 0 : POLL_MS);
    shm_disarm(m);
    if (rc == 0 && spinning) sched_yield(); /* let a runnable peer have the core */
    if (rc < 0 && errno != EINTR) {
      ring_fail(g, "poll: %s", strerror(errno));
      goto abort;
    }
    if (rc <= 0) continue;
    if (pf[0].revents) drain_fd(m->wake[0]);
    if (pf[i_lis].revents) pend_accept(m);
    if (np > i_pend0) pend_read(m);
    if (i_down >= 0 && pf[i_down].revents) {
      if (m->down_state == DOWN_CONNECTING) {
        if (down_finish_connect(g)) goto abort;
      } else if (m->down_state == DOWN_ACK) {
        if (down_read_ack(g)) goto abort;
      } else if (m->down_shm.active) {
        int slot = m->run_mem[(m->run_r + 1) % m->run_n].slot;
        if (doorbell_drain(m->down_fd, &m->down_eof) < 0 || (m->down_eof && send_pending(g))) {
          ring_fail(g, "slot %d closed the link", slot);
          goto abort;
        }
      }
    }
    if (i_up >= 0 && pf[i_up].revents && m->up_shm.active) {
      int slot = m->run_mem[(m->run_r + m->run_n - 1) % m->run_n].slot;
      if (doorbell_drain(m->up_fd, &m->up_eof) < 0) {
        ring_fail(g, "receive from slot %d: %s", slot, strerror(errno));
        goto abort;
      }
      /* on EOF, up_recv fails once the ring is empty: data sent before
       * the close is still delivered */
    }
  }
abort:
  links_close(m);
  return g->fatal || *timed_out ? R_FATAL : R_ABORT;
}

/* --- the collective --- */

static int in_members(const peer *mem, int n, uint64_t uid) {
  for (int i = 0; i < n; i++)
    if (mem[i].uid == uid) return i;
  return -1;
}

/* Sends SYNC for the latest epoch and waits for its GO. Returns 0 with
 * *ep/dec/go_seq set, 1 if a newer epoch came first (sync again), or an
 * error code. */
static int sync_epoch(ftar_member *m, uint64_t cur_seq, int full, int fresh, double t_end, uint64_t *ep_out,
                      int *dec, uint64_t *go_seq) {
  int rc = 0;
  pthread_mutex_lock(&m->mu);
  /* quorum, and our own registration visible */
  for (;;) {
    if (m->failed) {
      rc = tr_fail(m->failed, "ftar: %s", m->fail_msg);
      goto out;
    }
    if (in_members(m->ep_mem, m->ep_n, m->uid) >= 0 && m->ep_n >= m->o.min_members) break;
    if (tr_now() >= t_end) {
      rc = tr_fail(FTAR_ETIMEOUT, "ftar: no quorum: %d member(s), need %d", m->ep_n, m->o.min_members);
      goto out;
    }
    cv_wait(m, t_end);
  }
  uint64_t ep = m->ep;
  m->sync_n = m->ep_n;
  memcpy(m->sync_mem, m->ep_mem, (size_t)m->ep_n * sizeof m->ep_mem[0]);
  ftar_hdr h = {.type = FT_SYNC,
                .epoch = ep,
                .seq = cur_seq,
                .flags = (uint16_t)((full ? FTF_FULL : 0) | (fresh ? FTF_FRESH : 0)),
                .index = (uint32_t)m->slot};
  pthread_mutex_unlock(&m->mu);
  queue_ctl(m, 0, &h);
  pthread_mutex_lock(&m->mu);
  for (;;) {
    if (m->failed) {
      rc = tr_fail(m->failed, "ftar: %s", m->fail_msg);
      goto out;
    }
    /* a GO for our epoch counts even if a newer epoch followed it: the
     * others may already run on it (an aborting epoch stops us at once) */
    if (m->go_ep == ep) {
      *ep_out = ep;
      *dec = m->go_dec;
      *go_seq = m->go_seq;
      m->run_n = m->sync_n;
      memcpy(m->run_mem, m->sync_mem, (size_t)m->sync_n * sizeof m->sync_mem[0]);
      m->run_r = in_members(m->run_mem, m->run_n, m->uid);
      goto out;
    }
    if (m->ep != ep) {
      rc = 1;
      goto out;
    }
    if (tr_now() >= t_end) {
      rc = tr_fail(FTAR_ETIMEOUT, "ftar: no decision from the coordinator for epoch %llu within %.1f s",
                   (unsigned long long)ep, m->o.timeout);
      goto out;
    }
    cv_wait(m, t_end);
  }
out:
  pthread_mutex_unlock(&m->mu);
  return rc;
}

static void fill_result(ftar_result *res, uint64_t ep, uint64_t seq, int redos, const peer *mem, int n) {
  if (!res) return;
  res->epoch = ep;
  res->seq = seq;
  res->redos = redos;
  res->contributors = n;
  for (int i = 0; i < n; i++) res->slots[i] = mem[i].slot;
}

/* The control round of one collective, the data moved by pl: see
 * ftar_internal.h. (buf checks are the caller's.) */
int ftar_collective(ftar_member *m, ftar_plane *pl, size_t n, ftar_op op, uint64_t seq, ftar_result *res) {
  if (!m || !pl || (op != FTAR_SUM && op != FTAR_MEAN) || n > MAX_COUNT)
    return tr_fail(TR_EINVAL, "ftar_allreduce: bad arguments");
  if (m->completed_any && seq <= m->last_seq) {
    if (res) res->seq = m->last_seq + 1;
    return tr_fail(FTAR_ESEQ, "ftar_allreduce: seq %llu does not follow %llu", (unsigned long long)seq,
                   (unsigned long long)m->last_seq);
  }
  if (res) memset(res, 0, sizeof *res);
  double t_end = tr_now() + m->o.timeout;
  int fresh = !m->completed_any, redos = 0, full = 0, rc = 0, full_n = 0;
  uint64_t cur_seq = seq, full_ep = 0, res_ep = 0;
  peer *full_mem = NULL;
  char why[256];
  for (;;) {
    pthread_mutex_lock(&m->mu);
    int failed = m->failed;
    uint64_t latest = m->ep;
    pthread_mutex_unlock(&m->mu);
    if (failed) {
      rc = tr_fail(failed, "ftar: %s", m->fail_msg);
      goto fail;
    }
    if (latest == m->run_ep && m->run_aborted) { /* wait for the epoch that replaces the failed one */
      pthread_mutex_lock(&m->mu);
      while (m->ep == m->run_ep && !m->failed && tr_now() < t_end) cv_wait(m, t_end);
      int stuck = m->ep == m->run_ep && !m->failed;
      pthread_mutex_unlock(&m->mu);
      if (stuck) {
        rc = tr_fail(FTAR_ETIMEOUT, "ftar: no new epoch after an abort within %.1f s", m->o.timeout);
        goto fail;
      }
      continue;
    }
    if (latest != m->run_ep || m->run_ep == 0) {
      uint64_t ep = 0, go_seq = 0;
      int dec = 0;
      /* leaving run_ep at a collective boundary: close its links now, so
       * peers that started a collective there see EOF and move on too */
      pl->leave_epoch(pl, m);
      int s = sync_epoch(m, cur_seq, full, fresh, t_end, &ep, &dec, &go_seq);
      if (s == 1) continue;
      if (s) {
        rc = s;
        goto fail;
      }
      pl->leave_epoch(pl, m);
      m->run_ep = ep;
      m->run_aborted = 0;
      if (dec == FT_GO_COMMIT && full && go_seq == cur_seq) {
        fill_result(res, full_ep, cur_seq, redos, full_mem, full_n);
        res_ep = full_ep;
        goto done;
      }
      if (dec != FT_GO_RUN || ((!fresh || m->o.strict_seq) && go_seq != cur_seq)) {
        if (res) res->seq = go_seq;
        rc = tr_fail(FTAR_ESEQ, "ftar: seq %llu is out of step with the group (%llu)", (unsigned long long)cur_seq,
                     (unsigned long long)go_seq);
        goto fail;
      }
      if (fresh) cur_seq = go_seq;
      pl->restore(pl, m);
      full = 0;
    }
    if (m->run_n == 1) { /* alone: the input is the result */
      fill_result(res, m->run_ep, cur_seq, redos, m->run_mem, 1);
      res_ep = m->run_ep;
      goto done;
    }
    int got_full = 0, fatal_rc = FTAR_ETIMEOUT;
    why[0] = 0;
    int rr = pl->run(pl, m, cur_seq, t_end, &got_full, &fatal_rc, why, sizeof why);
    if (rr < 0) {
      rc = rr;
      goto fail;
    }
    if (rr == FTAR_PLANE_DONE) {
      fill_result(res, m->run_ep, cur_seq, redos, m->run_mem, m->run_n);
      res_ep = m->run_ep;
      goto done;
    }
    if (rr == FTAR_PLANE_FATAL) {
      mlog(m, "seq %llu in epoch %llu: %s", (unsigned long long)cur_seq, (unsigned long long)m->run_ep, why);
      pthread_mutex_lock(&m->mu);
      int f = m->failed;
      pthread_mutex_unlock(&m->mu);
      rc = f ? tr_fail(f, "ftar: %s", m->fail_msg) : tr_fail(fatal_rc, "ftar: %s", why);
      goto fail;
    }
    /* aborted: remember a full result (the coordinator may tell us to keep
     * it), report, and go to the next epoch */
    redos++;
    m->st.redos++;
    m->run_aborted = 1;
    mlog(m, "seq %llu aborted in epoch %llu (%s)%s", (unsigned long long)cur_seq, (unsigned long long)m->run_ep,
         why, got_full ? "; holding the full result" : "");
    if (got_full && !full) {
      full = 1;
      full_ep = m->run_ep;
      full_n = m->run_n;
      if (!full_mem) full_mem = malloc(sizeof(peer) * FTAR_MAX_MEMBERS);
      if (!full_mem) {
        rc = tr_fail(TR_ENOMEM, "ftar_allreduce: out of memory");
        goto fail;
      }
      memcpy(full_mem, m->run_mem, (size_t)m->run_n * sizeof(peer));
    }
    pthread_mutex_lock(&m->mu);
    int known = m->abort_ep > m->run_ep;
    pthread_mutex_unlock(&m->mu);
    if (!known) {
      ftar_hdr h = {.type = FT_ABORT, .epoch = m->run_ep, .seq = cur_seq, .index = (uint32_t)m->slot};
      queue_ctl(m, 1, &h);
    }
  }
done:
  m->completed_any = 1;
  m->last_seq = cur_seq;
  m->st.collectives++;
  rc = (m->st.collectives > 1 && res_ep != m->last_ep) || redos ? FTAR_RESHAPED : FTAR_OK;
  m->last_ep = res_ep;
  free(full_mem);
  return rc;
fail:
  pl->restore(pl, m);
  free(full_mem);
  return rc;
}

/* --- the ring as a data plane --- */

typedef struct {
  ftar_plane base;
  float *buf;
  size_t n;
  ftar_op op;
  undo_log *u;
  ring *g;
} ring_plane;

static int ring_plane_run(ftar_plane *pl, ftar_member *m, uint64_t seq, double t_end, int *full, int *fatal_rc,
                          char *why, size_t why_len) {
  ring_plane *rp = (ring_plane *)pl;
  (void)fatal_rc; /* FTAR_ETIMEOUT, or the control link's failure */
  if (rp->n > m->in_cap) {
    float *nc = realloc(m->in_copy, rp->n * sizeof(float));
    if (!nc) return tr_fail(TR_ENOMEM, "ftar_allreduce: out of memory for the input copy (%zu floats)", rp->n);
    m->in_copy = nc;
    m->in_cap = rp->n;
  }
  int timed_out;
  int rr = ring_run(m, rp->g, rp->u, rp->buf, rp->n, rp->op, seq, t_end, &timed_out);
  *full = rp->g->full;
  snprintf(why, why_len, "%s", rp->g->why);
  return rr == R_DONE ? FTAR_PLANE_DONE : rr == R_FATAL ? FTAR_PLANE_FATAL : FTAR_PLANE_ABORT;
}

static void ring_plane_restore(ftar_plane *pl, ftar_member *m) {
  ring_plane *rp = (ring_plane *)pl;
  undo_restore(m, rp->buf, rp->u);
}

static void ring_plane_leave(ftar_plane *pl, ftar_member *m) {
  (void)pl;
  links_close(m);
}

int ftar_allreduce(ftar_member *m, float *buf, size_t n, ftar_op op, uint64_t seq, ftar_result *res) {
  if (!m || (!buf && n) || (op != FTAR_SUM && op != FTAR_MEAN) || n > MAX_COUNT)
    return tr_fail(TR_EINVAL, "ftar_allreduce: bad arguments");
  ring_plane rp = {.base = {ring_plane_run, ring_plane_restore, ring_plane_leave}, .buf = buf, .n = n, .op = op};
  rp.u = calloc(1, sizeof *rp.u);
  rp.g = calloc(1, sizeof *rp.g);
  int rc;
  if (!rp.u || !rp.g) {
    if (res) memset(res, 0, sizeof *res);
    rc = tr_fail(TR_ENOMEM, "ftar_allreduce: out of memory");
  } else {
    rp.u->p = 1;
    rc = ftar_collective(m, &rp.base, n, op, seq, res);
  }
  free(rp.g);
  free(rp.u);
  return rc;
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

void ftar_member_comm_id_offer(ftar_member *m, uint64_t epoch, const uint8_t id[FTAR_COMMID_LEN]) {
  pthread_mutex_lock(&m->mu);
  m->commid_h = (ftar_hdr){.type = FT_COMMID, .epoch = epoch, .index = (uint32_t)m->slot};
  memcpy(m->commid_pay, id, FTAR_COMMID_LEN);
  m->q_commid = 1;
  pthread_mutex_unlock(&m->mu);
  wake_fd(m->cmd[1]);
}

int ftar_member_comm_id_wait(ftar_member *m, uint64_t epoch, uint8_t id[FTAR_COMMID_LEN], double t_end) {
  int rc = 0;
  pthread_mutex_lock(&m->mu);
  for (;;) {
    if (m->cid_ep == epoch) {
      memcpy(id, m->cid, FTAR_COMMID_LEN);
      break;
    }
    if (m->failed) {
      rc = tr_fail(m->failed, "ftar: %s", m->fail_msg);
      break;
    }
    if (m->abort_ep > epoch || m->cid_ep > epoch) { /* that epoch's collective is over */
      rc = 1;
      break;
    }
    if (tr_now() >= t_end) {
      rc = tr_fail(FTAR_ETIMEOUT, "ftar: no communicator id for epoch %llu from the coordinator",
                   (unsigned long long)epoch);
      break;
    }
    cv_wait(m, t_end);
  }
  pthread_mutex_unlock(&m->mu);
  return rc;
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
  mlog(m, "%s", msg);
}
