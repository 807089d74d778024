/* ftar_coord.c — the FTAR coordinator: membership epochs on a libevent loop.
 *
 * State: the epoch number and the member list ordered by slot (the ring
 * order). Every change publishes epoch+1 to all members (EPOCH frame):
 *   join                      -> members finish the collective in flight,
 *                                then switch (no FTF_ABORT_PREV); a joiner
 *                                that asked for seq J (its HELLO's seq):
 *                                they switch at J, the EPOCH's seq
 *   clean leave (LEAVE frame) -> the same: the leaver completed its part
 *                                (a LEAVE with FTF_ABORT_PREV, from a member
 *                                whose collective was in flight: as a close)
 *   wind-down (WIND frame)    -> the same, same members (when the epoch's
 *                                GO went out; see Wind-down below)
 *   (any of these while an ABORT of the epoch is held back by the rate
 *   limit: FTF_ABORT_PREV, the abort is not lost)
 *   close / lapse / evict     -> FTF_ABORT_PREV: every member aborts the
 *   / a member's ABORT           collective in flight and resynchronises
 * Before a member runs a collective in a new epoch it sends SYNC (the seq it
 * is in, whether it already holds that collective's full result, whether it
 * never completed one). When every member of the current epoch has synced,
 * the coordinator decides for each (GO frame):
 *   COMMIT  it holds the full result of a collective that some survivor has
 *           already returned, or that every survivor holds: return it as is;
 *   RUN     (re)run the group's collective in this epoch (a fresh joiner
 *           adopts the group's seq);
 *   ESEQ    its seq is not the group's: the caller is out of step;
 *   CANCEL  instead of RUN once the group winds down.
 * Wind-down: a member that stops while the group waits below its quorum
 * (ftar_member_wind_down) sends WIND; from then on the coordinator decides
 * CANCEL where it would decide RUN (every GO flagged FTF_WIND), passes WIND
 * on to every member (and to any that registers later), so members whose
 * own stop has not come stop waiting for quorum too, and publishes an
 * epoch at the next collective boundary, so every member syncs before its
 * next collective: all end on the same step, with no member running a
 * collective the others called off.
 * A join at seq J is pending until that epoch's GO: members keep one
 * epoch, the latest, so nothing else can be published in between without
 * putting the joiner into the group early, where the group would wait for
 * a member still catching up. Meanwhile a new HELLO is refused, any other
 * change (a close, lapse, evict, abort, clean leave) and an old member
 * entering the epoch before J (it aborted in the old one) remove the
 * joiner (BYE: register again) and publish the change without it; a
 * joiner left alone stays (nobody waits for it).
 * Heartbeat lapse: every frame from a member stamps it; a timer (every
 * deadline/4) drops members silent past the deadline. The ages are judged
 * from when the loop last ran: a loop that stalled (a host's long REPL
 * expression, say) gives every member a fresh deadline instead of evicting
 * healthy members whose heartbeats sat unread in their sockets.
 * Adoption: a member of a lost coordinator re-registers with a new one
 * (ftar_member_reconnect), its HELLO carrying the epoch it was in; the new
 * coordinator numbers its epochs above every such epoch, and while the host
 * holds it (ftar_coord_hold) it publishes nothing, so the re-registering
 * members enter one epoch together rather than a series of partial ones.
 * Device data plane (ftar_dev.c): the rank 0 of an epoch (its first member)
 * offers a communicator id (COMMID); the coordinator keeps it for that epoch
 * and sends it to every member, and forgets it when it publishes the next
 * epoch. An id for an older epoch is passed on to the members, not kept:
 * after a join, a clean leave or a wind-down the collective in flight
 * still finishes in the epoch it started in.
 *
 * Not here: the member and its data plane (ftar_member.c and the files it
 * names); any notion of training steps beyond the seq numbers members
 * report. Called by: the standalone driver (ftar_bench.c), later the
 * operator, which embeds it in its own loop.
 * Malformed input (bad magic, oversized length, bad checksum, unexpected
 * frame) closes that connection with a logged reason.
 */
#include <errno.h>
#include <event2/buffer.h>
#include <event2/bufferevent.h>
#include <event2/event.h>
#include <event2/listener.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "auth.h"
#include "ftar.h"
#include "ftar_wire.h"
#include "util.h"

#define CONN_MAX 1024
_Static_assert(FTAR_COMMID_LEN >= FTAR_HELLO_LEN, "conn_read_cb's payload buffer holds every member frame");
#define MAX_SLOT (1 << 30)

enum { CS_NEW = 0, CS_MEMBER = 1, CS_CLOSING = 2 };
enum { CMD_QUIT = 1, CMD_EVICT = 2 };

typedef struct cconn cconn;
struct cconn {
  ftar_coord *c;
  struct bufferevent *bev;
  int state;
  int slot;
  uint64_t uid;
  uint16_t port;
  char host[FTAR_HOST_MAX + 1];
  char peer[64]; /* remote address, for logs */
  int synced;
  uint16_t sync_flags;
  uint64_t sync_seq;
  double seen; /* tr_now() of its last frame */
  uint64_t enter_seq; /* it registered to enter at this seq and has not yet (0: none) */
  int authed;  /* answered our challenge (or none was asked) */
  uint8_t ch[AUTH_CHALLENGE];
  struct event *close_ev; /* closing: drops it at the closing deadline, however busy its peer */
  cconn *prev, *next;
};

struct ftar_coord {
  struct event_base *base;
  int own_base, has_thread;
  pthread_t th;
  struct evconnlistener *lis;
  int port;
  int cmd[2];
  struct event *cmd_ev;
  struct event *lapse_ev; /* the heartbeat check */
  struct event *abort_ev; /* an ABORT's epoch, held back by the rate limit */
  double abort_at, abort_gap; /* the last ABORT epoch (tr_now()); the gap the next one waits */
  uint64_t abort_epoch;       /* the epoch the held-back ABORT was reported in */
  int abort_slot;
  double last_check;      /* tr_now() when it last ran: a larger gap is a stalled loop */
  int held, held_change;  /* ftar_coord_hold; an epoch is owed at the release */
  uint64_t join_from;     /* the join being published takes effect at this seq (0: now) */
  ftar_coord_opts o;
  struct timeval deadline_tv;
  cconn *conns;
  int nconns;
  cconn *mem[FTAR_MAX_MEMBERS]; /* members, ascending slot */
  int n;
  uint64_t epoch, next_uid;
  int go_sent;
  int winding; /* a member wound down (WIND): the group runs no collective from now on */
  int cid_set; /* the current epoch's communicator id, once its rank 0 offered it */
  uint8_t cid[FTAR_COMMID_LEN];
  uint8_t epoch_buf[4 + FTAR_ENTRY_LEN * FTAR_MAX_MEMBERS];
  pthread_mutex_t mu; /* guards the snapshot below (read by any thread) */
  uint64_t snap_epoch;
  int snap_n;
  int snap_slots[FTAR_MAX_MEMBERS];
  auth_secret secret; /* len 0: connections are not challenged */
};

/* --- logging --- */

__attribute__((format(printf, 2, 3))) static void clog_(ftar_coord *c, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (c->o.log) c->o.log(c->o.log_ud, msg);
  else fprintf(stderr, "ftar-coord: %s\n", msg);
}

void ftar_coord_opts_default(ftar_coord_opts *o) {
  memset(o, 0, sizeof *o);
  o->deadline = 3.0;
}

/* --- the ABORT rate limit --- */

/* Aborts in a row (no quiet spell between them) wait for a gap that doubles
 * from ABORT_GAP_MIN up to deadline / 4 before their epoch is published: a
 * member that its peers cannot reach (a wrong address, a one-way link)
 * makes every attempt abort at once, and without the limit the group would
 * spin through thousands of epochs a second. One aborted epoch (a member
 * died) is published at once. */
#define ABORT_GAP_MIN 0.01

static void publish(ftar_coord *c, ftar_change_kind kind, int slot, int clean);

static void abort_publish(ftar_coord *c) {
  double cap = c->o.deadline / 4;
  c->abort_at = tr_now();
  c->abort_gap = c->abort_gap > 0 ? (c->abort_gap * 2 < cap ? c->abort_gap * 2 : cap) : ABORT_GAP_MIN;
  publish(c, FTAR_CHANGE_ABORTED, c->abort_slot, 0);
}

static void abort_cb(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  ftar_coord *c = arg;
  if (c->epoch == c->abort_epoch) abort_publish(c); /* else another change already moved everyone on */
}

static void abort_epoch_limited(ftar_coord *c, int slot) {
  double now = tr_now(), wait = c->abort_at + c->abort_gap - now;
  if (now - c->abort_at > c->o.deadline) c->abort_gap = 0, wait = 0; /* a quiet spell: not in a row */
  c->abort_slot = slot;
  c->abort_epoch = c->epoch;
  if (wait <= 0 || !c->abort_ev) {
    abort_publish(c);
    return;
  }
  struct timeval tv = {(time_t)wait, (suseconds_t)((wait - (double)(time_t)wait) * 1e6)};
  evtimer_add(c->abort_ev, &tv);
}

/* --- connections --- */

static void conn_send(cconn *k, ftar_hdr *h, const void *payload) {
  uint8_t hb[FTAR_HDR];
  ftar_frame_build(hb, h, payload);
  bufferevent_write(k->bev, hb, FTAR_HDR);
  if (h->len) bufferevent_write(k->bev, payload, h->len);
}

static void conn_drop(cconn *k) {
  ftar_coord *c = k->c;
  if (k->prev) k->prev->next = k->next;
  else c->conns = k->next;
  if (k->next) k->next->prev = k->prev;
  c->nconns--;
  if (k->close_ev) event_free(k->close_ev);
  bufferevent_free(k->bev);
  free(k);
}

/* A closing connection's input (heartbeats sent before the peer read our
 * BYE) is read and dropped: a close() that finds bytes unread resets the
 * connection, and the reset discards what of the BYE the kernel has not
 * sent yet (a slow link). */
static void closing_read_cb(struct bufferevent *bev, void *arg) {
  (void)arg;
  struct evbuffer *in = bufferevent_get_input(bev);
  evbuffer_drain(in, evbuffer_get_length(in));
}

static void closing_event_cb(struct bufferevent *bev, short what, void *arg) {
  (void)bev;
  (void)what;
  conn_drop(arg);
}

/* The BYE or REJECT is with the kernel: FIN after it, then wait (reading)
 * for the peer's close, or the closing deadline. */
static void closing_write_cb(struct bufferevent *bev, void *arg) {
  cconn *k = arg;
  shutdown(bufferevent_getfd(bev), SHUT_WR);
  bufferevent_setcb(bev, closing_read_cb, NULL, closing_event_cb, k);
}

static void closing_deadline_cb(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  conn_drop(arg);
}

/* Sends REJECT or BYE with a reason, then closes once it is flushed and
 * the peer closed too, or at the closing deadline (twice the deadline
 * from now: one to flush, one for the peer's close) if the peer does not
 * read or does not close. The deadline is a timer of its own, not a read
 * or write timeout: those restart at every byte, and a peer that keeps
 * sending (heartbeats after our BYE) would keep its connection forever. */
static void conn_close_with(cconn *k, int type, int code, const char *reason) {
  ftar_coord *c = k->c;
  ftar_hdr h = {.type = (uint16_t)type, .index = (uint32_t)code};
  size_t n = strlen(reason);
  h.len = (uint32_t)(n < FTAR_REASON_MAX ? n : FTAR_REASON_MAX);
  conn_send(k, &h, reason);
  k->state = CS_CLOSING;
  bufferevent_setcb(k->bev, closing_read_cb, closing_write_cb, closing_event_cb, k);
  bufferevent_enable(k->bev, EV_READ);
  bufferevent_set_timeouts(k->bev, NULL, NULL);
  if (!k->close_ev) k->close_ev = evtimer_new(c->base, closing_deadline_cb, k);
  if (!k->close_ev) { /* out of memory: no time to say why */
    conn_drop(k);
    return;
  }
  struct timeval tv = {2 * c->deadline_tv.tv_sec + (2 * c->deadline_tv.tv_usec) / 1000000,
                       (2 * c->deadline_tv.tv_usec) % 1000000};
  evtimer_add(k->close_ev, &tv);
}

/* At ftar_coord_free, the loop stopped: what a closing connection still
 * holds (a BYE queued just before a quit) goes to the kernel now, as much
 * as fits without blocking, and its unread input is drained so that the
 * close sends FIN after it rather than a reset that would discard it. */
static void closing_flush_now(cconn *k) {
  evutil_socket_t fd = bufferevent_getfd(k->bev);
  struct evbuffer *out = bufferevent_get_output(k->bev);
  if (fd < 0) return;
  /* read in place: a socket bufferevent's output cannot be drained but by
   * its own writes */
  size_t n = evbuffer_get_length(out);
  const uint8_t *p = n ? evbuffer_pullup(out, -1) : NULL;
  for (size_t off = 0; p && off < n;) {
    ssize_t w = send(fd, p + off, n - off, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w <= 0) break;
    off += (size_t)w;
  }
  shutdown(fd, SHUT_WR);
  char b[4096];
  while (recv(fd, b, sizeof b, MSG_DONTWAIT) > 0) {
  }
}

/* --- epochs --- */

static void snapshot(ftar_coord *c) {
  pthread_mutex_lock(&c->mu);
  c->snap_epoch = c->epoch;
  c->snap_n = c->n;
  for (int i = 0; i < c->n; i++) c->snap_slots[i] = c->mem[i]->slot;
  pthread_mutex_unlock(&c->mu);
}

static const char *change_name(ftar_change_kind k) {
  switch (k) {
  case FTAR_CHANGE_JOIN: return "join";
  case FTAR_CHANGE_CLOSED: return "closed";
  case FTAR_CHANGE_LAPSED: return "lapsed";
  case FTAR_CHANGE_EVICTED: return "evicted";
  case FTAR_CHANGE_ABORTED: return "aborted";
  case FTAR_CHANGE_WOUND_DOWN: return "wound down";
  }
  return "?";
}

/* The member whose join at a chosen seq is pending (NULL: none). */
static cconn *pending_join(ftar_coord *c) {
  for (int i = 0; i < c->n; i++)
    if (c->mem[i]->enter_seq) return c->mem[i];
  return NULL;
}

static void member_remove(cconn *k);

/* Another change came before the pending joiner's seq: it leaves the
 * group (BYE) and registers again; the change is published without it. */
static void cancel_pending_join(ftar_coord *c, const char *change) {
  cconn *k = pending_join(c);
  if (!k || c->n == 1) return; /* alone now: nobody waits for it, it enters whenever it comes */
  char why[160];
  snprintf(why, sizeof why, "the group changed (%s) before seq %llu, where slot %d was to enter: register again",
           change, (unsigned long long)k->enter_seq, k->slot);
  clog_(c, "%s", why);
  member_remove(k);
  conn_close_with(k, FT_BYE, FTAR_EEVICTED, why);
}

/* clean: a CLOSED that was a clean leave (LEAVE frame) */
static void publish(ftar_coord *c, ftar_change_kind kind, int slot, int clean) {
  if (c->held) { /* owed: one epoch with everyone at the release */
    c->held_change = 1;
    return;
  }
  if (!(kind == FTAR_CHANGE_JOIN && c->join_from)) cancel_pending_join(c, clean ? "a clean leave" : change_name(kind));
  /* an ABORT held back by the rate limit is owed for this epoch: this one
   * aborts (else a boundary change would swallow it, abort_cb finding the
   * epoch moved on, and a member still in the failed collective would wait
   * for it until its deadline) */
  int owed_abort = c->abort_ev && evtimer_pending(c->abort_ev, NULL) && c->abort_epoch == c->epoch;
  if (owed_abort) evtimer_del(c->abort_ev);
  c->epoch++;
  c->go_sent = 0;
  c->cid_set = 0;
  uint8_t *p = c->epoch_buf;
  ftw_put32(p, (uint32_t)c->n);
  for (int i = 0; i < c->n; i++) {
    cconn *k = c->mem[i];
    uint8_t *e = p + 4 + (size_t)i * FTAR_ENTRY_LEN;
    memset(e, 0, FTAR_ENTRY_LEN);
    size_t hl = strlen(k->host);
    ftw_put32(e, (uint32_t)k->slot);
    ftw_put16(e + 4, k->port);
    ftw_put16(e + 6, (uint16_t)hl);
    ftw_put64(e + 8, k->uid);
    memcpy(e + 16, k->host, hl);
    k->synced = 0;
  }
  /* a join, a clean leave or a wind-down happens at a collective boundary:
   * members finish the collective in flight first; any other change aborts it */
  int boundary = (kind == FTAR_CHANGE_JOIN || kind == FTAR_CHANGE_WOUND_DOWN || clean) && !owed_abort;
  ftar_hdr h = {.type = FT_EPOCH, .flags = boundary ? 0 : FTF_ABORT_PREV, .epoch = c->epoch,
                .seq = kind == FTAR_CHANGE_JOIN ? c->join_from : 0};
  h.len = (uint32_t)(4 + (size_t)c->n * FTAR_ENTRY_LEN);
  for (int i = 0; i < c->n; i++) conn_send(c->mem[i], &h, p);
  snapshot(c);
  char list[256];
  size_t off = 0;
  list[0] = 0;
  for (int i = 0; i < c->n && off + 16 < sizeof list; i++)
    off += (size_t)snprintf(list + off, sizeof list - off, "%s%d", i ? "," : "", c->mem[i]->slot);
  clog_(c, "epoch %llu: %s%s slot %d -> %d member(s) [%s]", (unsigned long long)c->epoch, change_name(kind),
        clean ? " (clean leave)" : "", slot, c->n, list);
  if (c->o.on_change) {
    int slots[FTAR_MAX_MEMBERS];
    for (int i = 0; i < c->n; i++) slots[i] = c->mem[i]->slot;
    ftar_change ch = {
        .kind = kind, .slot = slot, .epoch = c->epoch, .n_members = c->n, .slots = slots, .clean = clean};
    c->o.on_change(c->o.ud, &ch);
  }
}

static void member_remove(cconn *k) {
  ftar_coord *c = k->c;
  int i = 0;
  while (i < c->n && c->mem[i] != k) i++;
  if (i == c->n) return;
  memmove(c->mem + i, c->mem + i + 1, (size_t)(c->n - i - 1) * sizeof c->mem[0]);
  c->n--;
  k->state = CS_NEW;
}

/* Removes a member for `kind` and publishes; then closes its connection
 * (with a BYE when it may still be listening). clean: it sent LEAVE. */
static void member_drop(cconn *k, ftar_change_kind kind, const char *why, int clean) {
  int slot = k->slot;
  ftar_coord *c = k->c;
  member_remove(k);
  if (kind == FTAR_CHANGE_CLOSED) conn_drop(k);
  else conn_close_with(k, FT_BYE, FTAR_EEVICTED, why);
  publish(c, kind, slot, clean);
}

/* Every member synced: decide COMMIT / RUN (CANCEL once the group winds
 * down) / ESEQ for each (see the file comment) and send GO. "old" members
 * are those that completed a collective before or hold a full result; a
 * fresh joiner adopts the group's seq. */
static void maybe_go(ftar_coord *c) {
  if (c->go_sent || c->n == 0) return;
  for (int i = 0; i < c->n; i++)
    if (!c->mem[i]->synced) return;
  int have_old = 0;
  uint64_t smax = 0;
  for (int i = 0; i < c->n; i++) {
    cconn *k = c->mem[i];
    int old = !(k->sync_flags & FTF_FRESH) || (k->sync_flags & FTF_FULL);
    if (old && (!have_old || k->sync_seq > smax)) smax = k->sync_seq;
    have_old |= old;
  }
  if (!have_old)
    for (int i = 0; i < c->n; i++)
      if (c->mem[i]->sync_seq > smax) smax = c->mem[i]->sync_seq;
  int any = 0, all_full = 1;
  for (int i = 0; i < c->n; i++) {
    cconn *k = c->mem[i];
    int old = !(k->sync_flags & FTF_FRESH) || (k->sync_flags & FTF_FULL);
    if (old && k->sync_seq == smax) {
      any = 1;
      if (!(k->sync_flags & FTF_FULL)) all_full = 0;
    }
  }
  int commit_max = have_old && any && all_full;
  uint64_t run = commit_max ? smax + 1 : smax;
  for (int i = 0; i < c->n; i++) {
    cconn *k = c->mem[i];
    int full = (k->sync_flags & FTF_FULL) != 0;
    int fresh = (k->sync_flags & FTF_FRESH) && !full;
    ftar_hdr h = {.type = FT_GO, .epoch = c->epoch, .flags = c->winding ? FTF_WIND : 0};
    if (full && (k->sync_seq < smax || (k->sync_seq == smax && commit_max))) {
      h.index = FT_GO_COMMIT;
      h.seq = k->sync_seq;
    } else if (fresh || k->sync_seq == run) {
      h.index = c->winding ? FT_GO_CANCEL : FT_GO_RUN;
      h.seq = run;
    } else {
      h.index = FT_GO_ESEQ;
      h.seq = run;
      clog_(c, "slot %d is at seq %llu but the group runs %llu", k->slot, (unsigned long long)k->sync_seq,
            (unsigned long long)run);
    }
    conn_send(k, &h, NULL);
    k->enter_seq = 0; /* a pending joiner is in from this GO on */
  }
  c->go_sent = 1;
}

/* --- frames from a connection --- */

static int find_slot(ftar_coord *c, int slot) {
  for (int i = 0; i < c->n; i++)
    if (c->mem[i]->slot == slot) return i;
  return -1;
}

/* A bad frame or protocol error: log and close (a member leaves the group). */
static void conn_fail(cconn *k, const char *why) {
  if (k->state == CS_MEMBER) {
    clog_(k->c, "closing slot %d (%s): %s", k->slot, k->peer, why);
    member_drop(k, FTAR_CHANGE_CLOSED, why, 0);
  } else {
    clog_(k->c, "closing connection from %s: %s", k->peer, why);
    conn_drop(k);
  }
}

/* Returns 1 if k was closed or is closing. */
static int on_hello(cconn *k, const ftar_hdr *h, const uint8_t *pay) {
  ftar_coord *c = k->c;
  char why[160];
  uint32_t version = ftw_get32(pay);
  uint16_t port = ftw_get16(pay + 4), hl = ftw_get16(pay + 6);
  if (h->len != FTAR_HELLO_LEN || version != FTAR_VERSION || hl == 0 || hl > FTAR_HOST_MAX || port == 0 ||
      h->index >= MAX_SLOT) {
    conn_fail(k, "malformed HELLO");
    return 1;
  }
  int slot = (int)h->index;
  uint64_t at = h->epoch ? 0 : h->seq; /* a join at a chosen seq (not a lost coordinator's member coming back) */
  if (find_slot(c, slot) >= 0) {
    snprintf(why, sizeof why, "slot %d is in use", slot);
    clog_(c, "refusing %s: %s", k->peer, why);
    conn_close_with(k, FT_REJECT, FTAR_ECOORD, why);
    return 1;
  }
  cconn *pj = pending_join(c);
  if (pj || (at && c->held)) {
    if (pj) snprintf(why, sizeof why, "slot %d is entering at seq %llu: register after", pj->slot,
                     (unsigned long long)pj->enter_seq);
    else snprintf(why, sizeof why, "the coordinator holds its epochs: no join at a chosen seq now");
    clog_(c, "refusing %s (slot %d): %s", k->peer, slot, why);
    conn_close_with(k, FT_REJECT, FTAR_ECOORD, why);
    return 1;
  }
  if (c->n >= FTAR_MAX_MEMBERS) {
    clog_(c, "refusing %s: group full", k->peer);
    conn_close_with(k, FT_REJECT, FTAR_ECOORD, "group full");
    return 1;
  }
  k->slot = slot;
  k->port = port;
  memcpy(k->host, pay + 8, hl);
  k->host[hl] = 0;
  k->uid = ++c->next_uid;
  k->enter_seq = at;
  k->state = CS_MEMBER;
  k->seen = tr_now();
  bufferevent_set_timeouts(k->bev, NULL, NULL); /* a member's silence is the lapse timer's */
  if (h->epoch >= c->epoch) { /* a lost coordinator's member: our epochs follow its */
    if (h->epoch) /* (epoch 0: a new member, the first of a new coordinator) */
      clog_(c, "slot %d was in epoch %llu of a previous coordinator", slot, (unsigned long long)h->epoch);
    c->epoch = h->epoch + 1;
  }
  int i = c->n;
  while (i > 0 && c->mem[i - 1]->slot > slot) {
    c->mem[i] = c->mem[i - 1];
    i--;
  }
  c->mem[i] = k;
  c->n++;
  uint8_t w[FTAR_WELCOME_LEN];
  double hb = c->o.heartbeat > 0 ? c->o.heartbeat : c->o.deadline / 6;
  ftw_put64(w, k->uid);
  ftw_put32(w + 8, (uint32_t)(c->o.deadline * 1000 + 0.5));
  ftw_put32(w + 12, (uint32_t)(hb * 1000 + 0.5));
  ftar_hdr wh = {.type = FT_WELCOME, .len = FTAR_WELCOME_LEN, .index = (uint32_t)slot};
  conn_send(k, &wh, w);
  clog_(c, "slot %d registered from %s (data %s:%u)", slot, k->peer, k->host, port);
  if (at) clog_(c, "slot %d enters at seq %llu", slot, (unsigned long long)at);
  c->join_from = at;
  publish(c, FTAR_CHANGE_JOIN, slot, 0);
  c->join_from = 0;
  if (c->winding) { /* it winds down with the group */
    ftar_hdr wh = {.type = FT_WIND, .epoch = c->epoch};
    conn_send(k, &wh, NULL);
  }
  return 0;
}

/* Returns 1 if k was closed (stop reading it). */
static int on_frame(cconn *k, const ftar_hdr *h, const uint8_t *pay) {
  ftar_coord *c = k->c;
  k->seen = tr_now();
  if (h->type == FT_HELLO) {
    if (k->state != CS_NEW) {
      conn_fail(k, "second HELLO");
      return 1;
    }
    return on_hello(k, h, pay);
  }
  if (k->state != CS_MEMBER) {
    conn_fail(k, "frame before HELLO");
    return 1;
  }
  switch (h->type) {
  case FT_HEARTBEAT: break; /* on_frame stamped it */
  case FT_SYNC: {
    cconn *pj = pending_join(c);
    if (h->epoch == c->epoch && !c->go_sent && pj && !k->enter_seq && h->seq < pj->enter_seq) {
      /* it came to the joiner's epoch before seq J (its collective in the
       * old one aborted): the group must not wait for the joiner */
      clog_(c, "slot %d entered epoch %llu at seq %llu, before seq %llu", k->slot, (unsigned long long)h->epoch,
            (unsigned long long)h->seq, (unsigned long long)pj->enter_seq);
      publish(c, FTAR_CHANGE_ABORTED, k->slot, 0);
      break;
    }
    if (h->epoch == c->epoch && !c->go_sent) {
      k->synced = 1;
      k->sync_seq = h->seq;
      k->sync_flags = h->flags;
      maybe_go(c);
    }
    break;
  }
  case FT_COMMID: {
    if (h->len != FTAR_COMMID_LEN) {
      conn_fail(k, "malformed COMMID");
      return 1;
    }
    ftar_hdr ch = {.type = FT_COMMID, .epoch = h->epoch, .len = FTAR_COMMID_LEN};
    if (h->epoch == c->epoch) {
      if (!c->go_sent || c->mem[0] != k) {
        clog_(c, "slot %d offered a communicator id for epoch %llu but is not its rank 0; ignored", k->slot,
              (unsigned long long)h->epoch);
        break;
      }
      if (c->cid_set) break; /* one id per epoch: the first stands */
      c->cid_set = 1;
      memcpy(c->cid, pay, FTAR_COMMID_LEN);
      for (int i = 0; i < c->n; i++) conn_send(c->mem[i], &ch, c->cid);
    } else if (h->epoch < c->epoch) {
      /* a collective that began before a join, a clean leave or a wind-down finishes in
       * its own epoch: pass the id on; members not of that epoch ignore it */
      for (int i = 0; i < c->n; i++) conn_send(c->mem[i], &ch, pay);
    }
    break;
  }
  case FT_LEAVE: {
    /* FTF_ABORT_PREV: it left with a collective in flight (ftar_member_leave),
     * its part of it never to come: no boundary, the epoch aborts it */
    int mid = (h->flags & FTF_ABORT_PREV) != 0;
    clog_(c, "slot %d leaves after seq %llu%s", k->slot, (unsigned long long)h->seq,
          mid ? ", its collective in flight" : "");
    member_drop(k, FTAR_CHANGE_CLOSED, "left", !mid);
    return 1;
  }
  case FT_WIND:
    if (!c->winding) {
      /* WIND first: members waiting for quorum stop waiting and sync. If
       * the current epoch's GO went out, members may run collectives in it:
       * an epoch at the next boundary, so every member syncs before its
       * next collective and takes a decision made knowing it, none running
       * a collective the others call off. Else every member syncs this
       * epoch anyway (a pending joiner stays in) */
      ftar_hdr wh = {.type = FT_WIND, .epoch = c->epoch};
      c->winding = 1;
      clog_(c, "slot %d winds the group down: no collective runs from now on", k->slot);
      for (int i = 0; i < c->n; i++) conn_send(c->mem[i], &wh, NULL);
      if (c->go_sent) publish(c, FTAR_CHANGE_WOUND_DOWN, k->slot, 0);
      return k->state != CS_MEMBER;
    }
    break;
  case FT_ABORT:
    if (h->epoch == c->epoch && c->go_sent && !(c->abort_ev && evtimer_pending(c->abort_ev, NULL))) {
      clog_(c, "slot %d aborted seq %llu in epoch %llu", k->slot, (unsigned long long)h->seq,
            (unsigned long long)h->epoch);
      abort_epoch_limited(c, k->slot);
    }
    break;
  default: conn_fail(k, "unexpected frame type"); return 1;
  }
  return 0;
}

static void conn_read_cb(struct bufferevent *bev, void *arg) {
  cconn *k = arg;
  struct evbuffer *in = bufferevent_get_input(bev);
  if (!k->authed) { /* the answer to our challenge comes before any frame */
    if (evbuffer_get_length(in) < AUTH_MAC) return;
    uint8_t mac[AUTH_MAC];
    evbuffer_remove(in, mac, sizeof mac);
    if (!auth_verify(&k->c->secret, k->ch, mac)) {
      clog_(k->c, "refused a connection from %s: it did not prove the job secret", k->peer);
      conn_drop(k);
      return;
    }
    k->authed = 1;
  }
  for (;;) {
    size_t avail = evbuffer_get_length(in);
    if (avail < FTAR_HDR) return;
    uint8_t hb[FTAR_HDR], pay[FTAR_COMMID_LEN]; /* the longest frame a member sends */
    evbuffer_copyout(in, hb, FTAR_HDR);
    ftar_hdr h;
    ftar_hdr_decode(hb, &h);
    char why[160];
    if (ftar_hdr_check(&h, 0, why, sizeof why)) {
      conn_fail(k, why);
      return;
    }
    if (h.type != FT_HELLO && h.type != FT_HEARTBEAT && h.type != FT_SYNC && h.type != FT_ABORT &&
        h.type != FT_LEAVE && h.type != FT_COMMID && h.type != FT_WIND) {
      snprintf(why, sizeof why, "unexpected %s frame", ftar_type_name(h.type));
      conn_fail(k, why);
      return;
    }
    if (avail < FTAR_HDR + (size_t)h.len) return; /* len <= sizeof pay, checked above */
    evbuffer_drain(in, FTAR_HDR);
    evbuffer_remove(in, pay, h.len);
    if (ftar_frame_crc(hb, pay, h.len) != h.crc) {
      snprintf(why, sizeof why, "bad checksum on %s frame", ftar_type_name(h.type));
      conn_fail(k, why);
      return;
    }
    if (on_frame(k, &h, pay)) return;
  }
}

static void conn_event_cb(struct bufferevent *bev, short what, void *arg) {
  (void)bev;
  cconn *k = arg;
  ftar_coord *c = k->c;
  if (what & BEV_EVENT_TIMEOUT) { /* only a connection that has not said HELLO has a read timeout */
    clog_(c, "closing connection from %s: no HELLO within %.2f s", k->peer, c->o.deadline);
    conn_drop(k);
  } else if (what & (BEV_EVENT_EOF | BEV_EVENT_ERROR)) {
    if (k->state == CS_MEMBER) {
      clog_(c, "slot %d: connection closed", k->slot);
      member_drop(k, FTAR_CHANGE_CLOSED, "closed", 0);
    } else {
      conn_drop(k);
    }
  }
}

static void accept_cb(struct evconnlistener *l, evutil_socket_t fd, struct sockaddr *sa, int socklen, void *arg) {
  (void)l;
  (void)socklen;
  ftar_coord *c = arg;
  if (c->nconns >= CONN_MAX) {
    clog_(c, "too many connections (%d), refusing one", c->nconns);
    evutil_closesocket(fd);
    return;
  }
  cconn *k = calloc(1, sizeof *k);
  struct bufferevent *bev = k ? bufferevent_socket_new(c->base, fd, BEV_OPT_CLOSE_ON_FREE) : NULL;
  if (!bev) {
    clog_(c, "out of memory accepting a connection");
    free(k);
    evutil_closesocket(fd);
    return;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  k->c = c;
  k->bev = bev;
  k->slot = -1;
  if (sa->sa_family == AF_INET) {
    const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &in->sin_addr, ip, sizeof ip);
    snprintf(k->peer, sizeof k->peer, "%s:%u", ip, ntohs(in->sin_port));
  } else {
    snprintf(k->peer, sizeof k->peer, "?");
  }
  k->next = c->conns;
  if (c->conns) c->conns->prev = k;
  c->conns = k;
  c->nconns++;
  k->authed = c->secret.len == 0;
  if (!k->authed) { /* first thing: the challenge; nothing is read before its answer */
    auth_challenge(k->ch);
    evbuffer_add(bufferevent_get_output(bev), k->ch, sizeof k->ch);
  }
  bufferevent_setcb(bev, conn_read_cb, NULL, conn_event_cb, k);
  bufferevent_set_timeouts(bev, &c->deadline_tv, NULL);
  bufferevent_enable(bev, EV_READ | EV_WRITE);
}

static void listen_error_cb(struct evconnlistener *l, void *arg) {
  (void)l;
  ftar_coord *c = arg;
  clog_(c, "accept failed: %s (continuing)", strerror(errno));
}

/* --- heartbeat lapse --- */

/* Every deadline/4: drops the members silent past the deadline, unless the
 * loop itself stalled since the last check (then every member gets a fresh
 * deadline: their frames sat unread, the silence was ours). */
static void lapse_cb(evutil_socket_t fd, short what, void *arg) {
  (void)fd;
  (void)what;
  ftar_coord *c = arg;
  double now = tr_now(), gap = now - c->last_check, period = c->o.deadline / 4;
  c->last_check = now;
  if (gap > period + c->o.deadline / 4) {
    clog_(c, "the event loop stalled for %.2f s: every member gets a fresh deadline", gap - period);
    for (int i = 0; i < c->n; i++) c->mem[i]->seen = now;
    return;
  }
  for (int i = 0; i < c->n;) {
    cconn *k = c->mem[i];
    if (now - k->seen <= c->o.deadline) {
      i++;
      continue;
    }
    clog_(c, "slot %d: heartbeat lapsed (no frame for %.2f s)", k->slot, now - k->seen);
    member_drop(k, FTAR_CHANGE_LAPSED, "heartbeat lapsed", 0); /* removes mem[i] */
  }
}

void ftar_coord_hold(ftar_coord *c, int hold) {
  if (hold) {
    c->held = 1;
    return;
  }
  if (!c->held) return;
  c->held = 0;
  if (c->held_change) {
    c->held_change = 0;
    publish(c, FTAR_CHANGE_JOIN, c->n ? c->mem[0]->slot : -1, 0);
  }
}

int ftar_coord_registered(ftar_coord *c) { return c->n; }

/* --- commands from other threads --- */

static void cmd_cb(evutil_socket_t fd, short what, void *arg) {
  (void)what;
  ftar_coord *c = arg;
  int cmd[2];
  while (read(fd, cmd, sizeof cmd) == (ssize_t)sizeof cmd) {
    if (cmd[0] == CMD_QUIT) {
      event_base_loopbreak(c->base);
    } else if (cmd[0] == CMD_EVICT) {
      int i = find_slot(c, cmd[1]);
      if (i < 0) {
        clog_(c, "evict: slot %d is not a member", cmd[1]);
        continue;
      }
      clog_(c, "evicting slot %d", cmd[1]);
      member_drop(c->mem[i], FTAR_CHANGE_EVICTED, "evicted by the host", 0);
    }
  }
}

static int cmd_send(ftar_coord *c, int op, int arg) {
  int cmd[2] = {op, arg};
  ssize_t w;
  do w = write(c->cmd[1], cmd, sizeof cmd);
  while (w < 0 && errno == EINTR);
  return w == (ssize_t)sizeof cmd ? 0 : tr_fail(TR_EIO, "ftar: coordinator command queue: %s", strerror(errno));
}

/* --- lifecycle --- */

ftar_coord *ftar_coord_create(struct event_base *base, const char *host, int port, const ftar_coord_opts *o) {
  ftar_coord *c = NULL;
  if (!base || !host || port < 0 || port > 65535) {
    tr_fail(TR_EINVAL, "ftar_coord_create: bad arguments");
    return NULL;
  }
  if (o && (o->secret_len > AUTH_KEY_MAX || (o->secret_len > 0 && !o->secret))) { /* never quietly unchallenged */
    tr_fail(TR_EINVAL, "ftar_coord_create: the secret must be 1..%d bytes (or none: NULL/0)", AUTH_KEY_MAX);
    return NULL;
  }
  c = calloc(1, sizeof *c);
  if (!c) {
    tr_fail(TR_ENOMEM, "ftar_coord_create: out of memory");
    return NULL;
  }
  c->cmd[0] = c->cmd[1] = -1;
  pthread_mutex_init(&c->mu, NULL);
  if (o) c->o = *o;
  else ftar_coord_opts_default(&c->o);
  if (o && o->secret && o->secret_len > 0 && o->secret_len <= AUTH_KEY_MAX) {
    memcpy(c->secret.key, o->secret, o->secret_len);
    c->secret.len = o->secret_len;
  }
  c->o.secret = NULL;
  if (!(c->o.deadline > 0)) c->o.deadline = 3.0;
  c->base = base;
  c->deadline_tv.tv_sec = (time_t)c->o.deadline;
  c->deadline_tv.tv_usec = (suseconds_t)((c->o.deadline - (double)c->deadline_tv.tv_sec) * 1e6);
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
    tr_fail(TR_EINVAL, "ftar coordinator: '%s' is not an IPv4 address", host);
    goto error;
  }
  c->lis = evconnlistener_new_bind(base, accept_cb, c, LEV_OPT_CLOSE_ON_FREE | LEV_OPT_CLOSE_ON_EXEC | LEV_OPT_REUSEABLE, 128,
                                   (struct sockaddr *)&sa, sizeof sa);
  if (!c->lis) {
    tr_fail(TR_EIO, "ftar coordinator: cannot listen on %s:%d: %s", host, port, strerror(errno));
    goto error;
  }
  evconnlistener_set_error_cb(c->lis, listen_error_cb);
  struct sockaddr_in bound;
  socklen_t bl = sizeof bound;
  if (getsockname(evconnlistener_get_fd(c->lis), (struct sockaddr *)&bound, &bl) != 0) {
    tr_fail(TR_EIO, "ftar coordinator: getsockname: %s", strerror(errno));
    goto error;
  }
  c->port = ntohs(bound.sin_port);
  if (pipe(c->cmd) != 0) {
    tr_fail(TR_EIO, "ftar coordinator: pipe: %s", strerror(errno));
    goto error;
  }
  fcntl(c->cmd[0], F_SETFL, O_NONBLOCK);
  fcntl(c->cmd[0], F_SETFD, FD_CLOEXEC);
  fcntl(c->cmd[1], F_SETFD, FD_CLOEXEC);
  c->cmd_ev = event_new(base, c->cmd[0], EV_READ | EV_PERSIST, cmd_cb, c);
  if (!c->cmd_ev || event_add(c->cmd_ev, NULL) != 0) {
    tr_fail(TR_ENOMEM, "ftar coordinator: cannot create its command event");
    goto error;
  }
  c->lapse_ev = event_new(base, -1, EV_PERSIST, lapse_cb, c);
  double period = c->o.deadline / 4;
  struct timeval ptv = {(time_t)period, (suseconds_t)((period - (double)(time_t)period) * 1e6)};
  if (!c->lapse_ev || event_add(c->lapse_ev, &ptv) != 0) {
    tr_fail(TR_ENOMEM, "ftar coordinator: cannot create its heartbeat timer");
    goto error;
  }
  c->abort_ev = evtimer_new(base, abort_cb, c); /* NULL: aborts go unlimited */
  c->last_check = tr_now();
  snapshot(c);
  return c;
error:
  ftar_coord_free(c);
  return NULL;
}

static void *coord_thread(void *arg) {
  ftar_coord *c = arg;
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE); /* a peer resetting mid-write must not kill the process */
  pthread_sigmask(SIG_BLOCK, &set, NULL);
  event_base_dispatch(c->base);
  return NULL;
}

ftar_coord *ftar_coord_start(const char *host, int port, const ftar_coord_opts *o) {
  struct event_base *base = event_base_new();
  if (!base) {
    tr_fail(TR_ENOMEM, "ftar coordinator: event_base_new failed");
    return NULL;
  }
  ftar_coord *c = ftar_coord_create(base, host, port, o);
  if (!c) {
    event_base_free(base);
    return NULL;
  }
  c->own_base = 1;
  if (pthread_create(&c->th, NULL, coord_thread, c) != 0) {
    tr_fail(TR_EIO, "ftar coordinator: cannot start its thread");
    ftar_coord_free(c);
    return NULL;
  }
  c->has_thread = 1;
  return c;
}

/* At ftar_coord_free, the loop stopped: an eviction still in the command
 * queue (the host's loop ended before it ran, or it came after the quit)
 * still gets its BYE, flushed with the others. Nothing is published: the
 * group's coordinator is going away. */
static void evictions_left(ftar_coord *c) {
  int cmd[2];
  while (c->cmd[0] >= 0 && read(c->cmd[0], cmd, sizeof cmd) == (ssize_t)sizeof cmd) {
    int i = cmd[0] == CMD_EVICT ? find_slot(c, cmd[1]) : -1;
    if (i < 0) continue;
    clog_(c, "evicting slot %d (the coordinator is closing)", cmd[1]);
    conn_close_with(c->mem[i], FT_BYE, FTAR_EEVICTED, "evicted by the host");
  }
}

void ftar_coord_free(ftar_coord *c) {
  if (!c) return;
  int stopped = 1;
  if (c->has_thread) {
    if (cmd_send(c, CMD_QUIT, 0) == 0) pthread_join(c->th, NULL);
    else pthread_detach(c->th), stopped = 0; /* cannot happen short of a broken pipe; leak rather than hang */
  }
  if (stopped) evictions_left(c);
  for (cconn *k = c->conns; k && stopped; k = k->next)
    if (k->state == CS_CLOSING) closing_flush_now(k);
  while (c->conns) conn_drop(c->conns);
  if (c->lis) evconnlistener_free(c->lis);
  if (c->cmd_ev) event_free(c->cmd_ev);
  if (c->lapse_ev) event_free(c->lapse_ev);
  if (c->abort_ev) event_free(c->abort_ev);
  if (c->cmd[0] >= 0) close(c->cmd[0]);
  if (c->cmd[1] >= 0) close(c->cmd[1]);
  if (c->own_base) event_base_free(c->base);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

int ftar_coord_port(const ftar_coord *c) { return c->port; }

int ftar_coord_members(ftar_coord *c, uint64_t *epoch, int *slots, int max) {
  pthread_mutex_lock(&c->mu);
  int n = c->snap_n;
  if (epoch) *epoch = c->snap_epoch;
  for (int i = 0; i < n && i < max && slots; i++) slots[i] = c->snap_slots[i];
  pthread_mutex_unlock(&c->mu);
  return n;
}

int ftar_coord_evict(ftar_coord *c, int slot) { return cmd_send(c, CMD_EVICT, slot); }
