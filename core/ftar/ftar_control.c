/* ftar_control.c — an FTAR member's control plane: the blocking
 * registration with the coordinator (HELLO / WELCOME), the control thread,
 * LEAVE on the way out, and the relay of communicator ids (COMMID).
 *
 * A private thread runs a libevent loop on the coordinator connection: it
 * sends heartbeats, receives EPOCH / GO / COMMID / BYE frames into the
 * shared state (mutex + condition variable, ftar_member_internal.h) and
 * wakes the data thread through a pipe; the data thread queues SYNC / ABORT
 * / COMMID frames for it (cmd pipe). Frames from the coordinator are checked
 * (header, type, length, CRC) before they change anything; a bad one, a
 * lost connection or a BYE fails the member (m->failed), which every wait
 * and the ring's control check notice. With opts.survive_coord_loss a lost
 * connection only aborts the collective in flight (abort_ep past the
 * current epoch, as an aborting epoch would) and the member waits for
 * ftar_member_reconnect: a new registration on a fresh connection, which
 * the control thread takes over (q_fd).
 *
 * Not here: what SYNC / GO mean for a collective (ftar_collective.c), the
 * coordinator's side (ftar_coord.c), the data plane (ftar_ring.c).
 * Called by: ftar_member.c (register, start, stop), ftar_collective.c
 * (queue), ftar_dev.c through ftar_internal.h (communicator ids).
 */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "ftar.h"
#include "ftar_internal.h"
#include "ftar_member_internal.h"
#include "ftar_wire.h"
#include "util.h"

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
  ftar_wake_fd(m->wake[1]);
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
    m->ep_from = h->seq;
    m->ep_n = (int)n;
    memcpy(m->ep_mem, tmp, n * sizeof tmp[0]);
    m->epochs_seen++;
    if ((h->flags & FTF_ABORT_PREV) && h->epoch > m->abort_ep) m->abort_ep = h->epoch;
    atomic_fetch_add(&m->gen, 1);
    pthread_cond_broadcast(&m->cv);
  }
  pthread_mutex_unlock(&m->mu);
  ftar_wake_fd(m->wake[1]);
  return 0;
}

static void ctl_on_go(ftar_member *m, const ftar_hdr *h) {
  pthread_mutex_lock(&m->mu);
  if (h->epoch >= m->go_ep) {
    m->go_ep = h->epoch;
    m->go_dec = (int)h->index;
    m->go_wind = (h->flags & FTF_WIND) != 0;
    m->go_seq = h->seq;
    atomic_fetch_add(&m->gen, 1);
    pthread_cond_broadcast(&m->cv);
  }
  pthread_mutex_unlock(&m->mu);
  ftar_wake_fd(m->wake[1]);
}

static int ctl_on_commid(ftar_member *m, const ftar_hdr *h) {
  if (h->len != FTAR_COMMID_LEN) {
    ftar_member_log(m, "malformed COMMID frame from the coordinator");
    ctl_fail(m, FTAR_ECOORD, "malformed COMMID frame from the coordinator");
    return -1;
  }
  pthread_mutex_lock(&m->mu);
  if (h->epoch >= m->cid_ep) {
    m->cid_ep = h->epoch;
    memcpy(m->cid, m->ctl_buf, FTAR_COMMID_LEN);
    atomic_fetch_add(&m->gen, 1);
    pthread_cond_broadcast(&m->cv);
  }
  pthread_mutex_unlock(&m->mu);
  ftar_wake_fd(m->wake[1]);
  return 0;
}

/* BYE or REJECT: the coordinator removed us. */
static void ctl_on_bye(ftar_member *m, const ftar_hdr *h) {
  char reason[FTAR_REASON_MAX + 1], msg[300];
  memcpy(reason, m->ctl_buf, h->len);
  reason[h->len] = 0;
  for (char *c = reason; *c; c++)
    if ((unsigned char)*c < 32) *c = '?';
  snprintf(msg, sizeof msg, "removed by the coordinator: %s", reason);
  ftar_member_log(m, "%s", msg);
  ctl_fail(m, FTAR_EEVICTED, msg);
}

/* WIND: the group winds down (some member's ftar_member_wind_down). */
static void ctl_on_wind(ftar_member *m) {
  pthread_mutex_lock(&m->mu);
  int was = m->winding;
  m->winding = 1;
  atomic_fetch_add(&m->gen, 1);
  pthread_cond_broadcast(&m->cv);
  pthread_mutex_unlock(&m->mu);
  if (!was) ftar_member_log(m, "the group winds down: no collective runs from now on");
  ftar_wake_fd(m->wake[1]);
}

/* A checked frame from the coordinator, payload in ctl_buf. -1 once the
 * member failed (stop reading). */
static int ctl_on_frame(ftar_member *m, const ftar_hdr *h) {
  switch (h->type) {
  case FT_EPOCH:
    if (parse_epoch(m, h, m->ctl_buf)) {
      ftar_member_log(m, "malformed EPOCH frame from the coordinator");
      ctl_fail(m, FTAR_ECOORD, "malformed EPOCH frame from the coordinator");
      return -1;
    }
    return 0;
  case FT_GO:
    ctl_on_go(m, h);
    return 0;
  case FT_COMMID:
    return ctl_on_commid(m, h);
  case FT_WIND:
    ctl_on_wind(m);
    return 0;
  default: /* BYE, REJECT */
    ctl_on_bye(m, h);
    return -1;
  }
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
        h.type != FT_COMMID && h.type != FT_WIND) {
      snprintf(why, sizeof why, "unexpected %s frame", ftar_type_name(h.type));
      bad = 1;
    }
    if (bad) {
      snprintf(msg, sizeof msg, "malformed frame from the coordinator: %s", why);
      ftar_member_log(m, "%s", msg);
      ctl_fail(m, FTAR_ECOORD, msg);
      return;
    }
    if (avail < FTAR_HDR + (size_t)h.len) return; /* h.len bounded by ftar_hdr_check */
    evbuffer_drain(in, FTAR_HDR);
    evbuffer_remove(in, m->ctl_buf, h.len);
    if (ftar_frame_crc(hb, m->ctl_buf, h.len) != h.crc) {
      ftar_member_log(m, "bad checksum on a %s frame from the coordinator", ftar_type_name(h.type));
      ctl_fail(m, FTAR_ECOORD, "bad checksum from the coordinator");
      return;
    }
    if (ctl_on_frame(m, &h)) return;
  }
}

/* survive_coord_loss: the collective in flight aborts (its input kept for
 * the redo) and the member waits for a new coordinator. */
static void ctl_lost(ftar_member *m) {
  pthread_mutex_lock(&m->mu);
  m->coord_lost = 1;
  if (m->abort_ep <= m->ep) m->abort_ep = m->ep + 1;
  atomic_fetch_add(&m->gen, 1);
  pthread_cond_broadcast(&m->cv);
  pthread_mutex_unlock(&m->mu);
  ftar_wake_fd(m->wake[1]);
  if (m->bev) {
    bufferevent_free(m->bev);
    m->bev = NULL;
  }
}

static void ctl_event_cb(struct bufferevent *bev, short what, void *arg) {
  (void)bev;
  ftar_member *m = arg;
  if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR)) {
    ftar_member_log(m, "lost the coordinator connection%s",
                    m->o.survive_coord_loss ? "; waiting for a new coordinator" : "");
    if (m->o.survive_coord_loss) ctl_lost(m);
    else ctl_fail(m, FTAR_ECOORD, "lost the coordinator connection");
  }
}

/* A new coordinator connection from ftar_member_reconnect, registered. */
static void ctl_adopt_fd(ftar_member *m, int fd) {
  if (m->bev) bufferevent_free(m->bev);
  m->bev = bufferevent_socket_new(m->base, fd, BEV_OPT_CLOSE_ON_FREE);
  if (!m->bev) {
    close(fd);
    ctl_fail(m, TR_ENOMEM, "ftar: bufferevent_socket_new failed");
    return;
  }
  bufferevent_setcb(m->bev, ctl_read_cb, NULL, ctl_event_cb, m);
  bufferevent_enable(m->bev, EV_READ | EV_WRITE);
  pthread_mutex_lock(&m->mu);
  m->coord_lost = 0;
  pthread_mutex_unlock(&m->mu);
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
  ftar_drain_fd(fd);
  pthread_mutex_lock(&m->mu);
  int sync = m->q_sync, abrt = m->q_abort, quit = m->q_quit, cid = m->q_commid, nfd = m->q_fd;
  /* a winding member tells a new coordinator too */
  int wind = m->q_wind || (nfd >= 0 && m->winding);
  m->q_fd = -1;
  ftar_hdr sh = m->sync_h, ah = m->abort_h, ch = m->commid_h;
  ftar_hdr wh = {.type = FT_WIND, .epoch = m->ep, .index = (uint32_t)m->slot};
  uint8_t cpay[FTAR_COMMID_LEN];
  memcpy(cpay, m->commid_pay, sizeof cpay);
  m->q_sync = m->q_abort = m->q_commid = m->q_wind = 0;
  pthread_mutex_unlock(&m->mu);
  if (nfd >= 0) ctl_adopt_fd(m, nfd);
  if (abrt) ctl_send(m, &ah);
  if (wind) ctl_send(m, &wh); /* before the SYNC: the coordinator decides knowing it */
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

void ftar_ctl_queue(ftar_member *m, int abort_frame, const ftar_hdr *h) {
  pthread_mutex_lock(&m->mu);
  if (abort_frame) {
    m->abort_h = *h;
    m->q_abort = 1;
  } else {
    m->sync_h = *h;
    m->q_sync = 1;
  }
  pthread_mutex_unlock(&m->mu);
  ftar_wake_fd(m->cmd[1]);
}

/* --- blocking registration with the coordinator (constructor) --- */

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
    } else if (ftar_io_wait(fd, writing ? POLLOUT : POLLIN, t_end)) {
      return tr_fail(FTAR_ETIMEOUT, "coordinator did not answer in time");
    }
  }
  return 0;
}

typedef struct {
  uint64_t uid;
  double deadline, hb_interval;
} welcome;

/* HELLO (with the epoch we are in: 0 for a new member) and the WELCOME. */
static int handshake(ftar_member *m, int fd, uint64_t epoch, double t_end, welcome *w) {
  uint8_t hb[FTAR_HDR], pay[FTAR_REASON_MAX + 1];
  uint8_t hello[FTAR_HELLO_LEN] = {0};
  size_t hl = strlen(m->data_host);
  ftw_put32(hello, FTAR_VERSION);
  ftw_put16(hello + 4, (uint16_t)m->lport);
  ftw_put16(hello + 6, (uint16_t)hl);
  memcpy(hello + 8, m->data_host, hl);
  ftar_hdr h = {.type = FT_HELLO, .epoch = epoch, .seq = m->o.join_seq, .index = (uint32_t)m->slot, .len = FTAR_HELLO_LEN};
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
  w->uid = ftw_get64(pay);
  w->deadline = ftw_get32(pay + 8) / 1000.0;
  w->hb_interval = ftw_get32(pay + 12) / 1000.0;
  if (!(w->deadline > 0)) w->deadline = 3.0;
  if (!(w->hb_interval > 0) || w->hb_interval > w->deadline / 2) w->hb_interval = w->deadline / 6;
  return 0;
}
int ftar_ctl_register(ftar_member *m, const char *coord_host, int coord_port, double t_end, int *cfd) {
  if (ftar_connect_to(coord_host, coord_port, 0, t_end, cfd)) return tr_fail_prefix(FTAR_ECOORD, "ftar: coordinator");
  welcome w;
  int rc = auth_client(*cfd, &m->secret, t_end - tr_now());
  if (!rc) rc = handshake(m, *cfd, 0, t_end, &w);
  if (rc) return tr_fail_prefix(rc, "ftar");
  m->uid = w.uid;
  m->coord_deadline = w.deadline;
  m->hb_interval = w.hb_interval;
  return 0;
}

/* --- a new coordinator (survive_coord_loss) --- */

int ftar_member_reconnect(ftar_member *m, const char *host, int port, double timeout) {
  if (!m || !host || port <= 0 || port > 65535) return tr_fail(TR_EINVAL, "ftar_member_reconnect: bad arguments");
  double t_end = tr_now() + timeout;
  int fd = -1;
  if (ftar_connect_to(host, port, 0, t_end, &fd)) return tr_fail_prefix(FTAR_ECOORD, "ftar: new coordinator");
  pthread_mutex_lock(&m->mu);
  uint64_t ep = m->abort_ep > m->ep ? m->abort_ep : m->ep;
  int failed = m->failed;
  pthread_mutex_unlock(&m->mu);
  if (failed) {
    close(fd);
    return tr_fail(failed, "ftar: %s", m->fail_msg);
  }
  welcome w;
  int rc = auth_client(fd, &m->secret, t_end - tr_now());
  if (!rc) rc = handshake(m, fd, ep, t_end, &w);
  if (rc) {
    close(fd);
    return tr_fail_prefix(rc, "ftar: new coordinator");
  }
  pthread_mutex_lock(&m->mu);
  if ((failed = m->failed)) { /* failed (left) meanwhile: no control thread may take it any more */
    pthread_mutex_unlock(&m->mu);
    close(fd);
    return tr_fail(failed, "ftar: %s", m->fail_msg);
  }
  m->uid = w.uid;
  if (m->q_fd >= 0) close(m->q_fd); /* an earlier one the control thread has not taken: superseded */
  m->q_fd = fd;
  pthread_mutex_unlock(&m->mu);
  ftar_wake_fd(m->cmd[1]);
  ftar_member_log(m, "registered with the coordinator at %s:%d (was in epoch %llu)", host, port,
                  (unsigned long long)ep);
  return 0;
}

void ftar_member_fail(ftar_member *m, int code, const char *why) {
  if (!m) return;
  pthread_mutex_lock(&m->mu);
  if (!m->failed) {
    m->failed = code;
    snprintf(m->fail_msg, sizeof m->fail_msg, "%s", why);
  }
  atomic_fetch_add(&m->gen, 1);
  pthread_cond_broadcast(&m->cv);
  pthread_mutex_unlock(&m->mu);
  ftar_wake_fd(m->wake[1]);
}

void ftar_member_abandon(ftar_member *m, const char *why) { ftar_member_fail(m, FTAR_ECOORD, why); }

void ftar_member_wind_down(ftar_member *m) {
  if (!m) return;
  pthread_mutex_lock(&m->mu);
  if (!m->winding) m->q_wind = 1; /* WIND to the coordinator, which tells the others */
  m->winding = 1;
  pthread_cond_broadcast(&m->cv);
  pthread_mutex_unlock(&m->mu);
  ftar_wake_fd(m->cmd[1]);
  ftar_wake_fd(m->wake[1]);
}

/* --- start and stop --- */

int ftar_ctl_start(ftar_member *m, int *cfd) {
  if (pipe(m->cmd) != 0 || pipe(m->wake) != 0) return tr_fail(TR_EIO, "ftar: pipe: %s", strerror(errno));
  ftar_set_nonblock(m->cmd[0]);
  ftar_set_nonblock(m->cmd[1]);
  ftar_set_nonblock(m->wake[0]);
  ftar_set_nonblock(m->wake[1]);
  m->base = event_base_new();
  if (!m->base) return tr_fail(TR_ENOMEM, "ftar: event_base_new failed");
  m->bev = bufferevent_socket_new(m->base, *cfd, BEV_OPT_CLOSE_ON_FREE);
  if (!m->bev) return tr_fail(TR_ENOMEM, "ftar: bufferevent_socket_new failed");
  *cfd = -1; /* owned by bev */
  bufferevent_setcb(m->bev, ctl_read_cb, NULL, ctl_event_cb, m);
  bufferevent_enable(m->bev, EV_READ | EV_WRITE);
  m->hb_ev = event_new(m->base, -1, EV_PERSIST, ctl_hb_cb, m);
  m->cmd_ev = event_new(m->base, m->cmd[0], EV_READ | EV_PERSIST, ctl_cmd_cb, m);
  struct timeval tv = {.tv_sec = (time_t)m->hb_interval,
                       .tv_usec = (suseconds_t)((m->hb_interval - (double)(time_t)m->hb_interval) * 1e6)};
  if (!m->hb_ev || !m->cmd_ev || event_add(m->hb_ev, &tv) || event_add(m->cmd_ev, NULL))
    return tr_fail(TR_ENOMEM, "ftar: cannot create control events");
  if (pthread_create(&m->th, NULL, ctl_main, m) != 0) return tr_fail(TR_EIO, "ftar: cannot start the control thread");
  m->th_started = 1;
  return 0;
}

/* After the control thread stopped: write out whatever the bufferevent still
 * holds (a frame queued in the callback that also saw the quit: the loop
 * broke before its write event ran), then LEAVE, so the coordinator sees a
 * clean exit. Bounded by a second. libevent freezes the start of a socket
 * bufferevent's output (its write callback alone drains it) and
 * evbuffer_copyout refuses a frozen start: the backlog is copied with the
 * start thawed for the moment, which once made every LEAVE behind a
 * backlog a silent close (the others then saw a crash, not a leave). */
static void send_leave(ftar_member *m) {
  uint8_t buf[4096];
  struct evbuffer *out = bufferevent_get_output(m->bev);
  size_t len = evbuffer_get_length(out);
  if (len + FTAR_HDR > sizeof buf) { /* a backlog this big: the coordinator is not reading anyway */
    ftar_member_log(m, "LEAVE not sent: %zu bytes for the coordinator still unsent", len);
    return;
  }
  evbuffer_unfreeze(out, 1);
  ev_ssize_t got = len ? evbuffer_copyout(out, buf, len) : 0;
  evbuffer_freeze(out, 1);
  if (got != (ev_ssize_t)len) {
    ftar_member_log(m, "LEAVE not sent: the %zu bytes still queued for the coordinator could not be read", len);
    return;
  }
  /* A GO it never ran to the end is no collective boundary either: the
   * others may be in that collective, waiting for it (a joiner refused with
   * FTAR_ESEQ, whose replay then failed, goes away before it ever connected
   * its links: nobody would see an EOF). The control thread is stopped and
   * no collective runs: these fields are still. */
  int owes_go = m->go_ep > 0 && (!m->completed_any || m->last_seq < m->go_seq);
  ftar_hdr h = {.type = FT_LEAVE,
                .flags = m->leave_abort || owes_go ? FTF_ABORT_PREV : 0,
                .epoch = m->ep,
                .seq = m->last_seq,
                .index = (uint32_t)m->slot};
  ftar_frame_build(buf + len, &h, NULL);
  int fd = (int)bufferevent_getfd(m->bev);
  double t_end = tr_now() + 1.0;
  if (io_all(fd, buf, len + FTAR_HDR, 1, t_end) != 0) {
    ftar_member_log(m, "LEAVE not sent: %s", tr_error()); /* the others see a close instead */
    return;
  }
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
void ftar_ctl_stop(ftar_member *m) {
  if (m->th_started) {
    pthread_mutex_lock(&m->mu);
    m->q_quit = 1;
    pthread_mutex_unlock(&m->mu);
    ftar_wake_fd(m->cmd[1]);
    pthread_join(m->th, NULL);
    m->th_started = 0; /* once: ftar_member_leave, then ftar_member_free */
    if (m->bev) send_leave(m);
  }
  if (m->bev) bufferevent_free(m->bev);
  if (m->hb_ev) event_free(m->hb_ev);
  if (m->cmd_ev) event_free(m->cmd_ev);
  /* under mu: ftar_member_reconnect (another thread: the worker's link
   * keeper, while ftar_member_leave runs) swaps q_fd under it too */
  pthread_mutex_lock(&m->mu);
  int qfd = m->q_fd;
  m->q_fd = -1;
  pthread_mutex_unlock(&m->mu);
  if (qfd >= 0) close(qfd);
  if (m->base) event_base_free(m->base);
  m->bev = NULL;
  m->hb_ev = m->cmd_ev = NULL;
  m->base = NULL;
}

/* --- communicator ids for the device data plane (ftar_internal.h) --- */

void ftar_member_comm_id_offer(ftar_member *m, uint64_t epoch, const uint8_t id[FTAR_COMMID_LEN]) {
  pthread_mutex_lock(&m->mu);
  m->commid_h = (ftar_hdr){.type = FT_COMMID, .epoch = epoch, .index = (uint32_t)m->slot};
  memcpy(m->commid_pay, id, FTAR_COMMID_LEN);
  m->q_commid = 1;
  pthread_mutex_unlock(&m->mu);
  ftar_wake_fd(m->cmd[1]);
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
    ftar_cv_wait(m, t_end);
  }
  pthread_mutex_unlock(&m->mu);
  return rc;
}
