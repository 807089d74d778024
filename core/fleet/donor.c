/* donor.c — state snapshot + gradient history for joining replicas (see
 * donor.h). Two threads: the listener accepts and challenges connections
 * (several at once, bounded, so a silent one never holds the port) and
 * queues those that proved the job secret; the session thread serves the
 * queue one joiner at a time, oldest first. The listener keeps answering
 * while a session runs, so a joiner queued behind another is challenged at
 * once and only waits for its snapshot. A joiner that has caught up makes
 * way for the next one at once but keeps its connection ("parked"): in the
 * ring, its first collective may still find the group a step ahead
 * (FTAR_ESEQ: the survivors held that step's full result when they lost
 * their peers), and the session thread answers such a late request between
 * its other work, from the same history. */
#include "auth.h"
#include "donor.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "proto.h"
#include "util.h"

#define DONOR_QUEUE_MAX 8
#define DONOR_PARKED_MAX 8
#define DONOR_SEND_TIMEOUT_S 60 /* the joiner's own wait for a GRADS reply */

struct donor {
  trainer *t;
  auth_secret secret; /* every joiner proves it first (len 0: none asked) */
  int64_t n; /* parameters */
  int lfd;
  pthread_t th, session_th;
  pthread_mutex_t mu;
  /* connections that proved the secret, oldest first, waiting for the
   * session thread (under mu) */
  int queue[DONOR_QUEUE_MAX];
  int nq;
  pthread_cond_t cv;
  atomic_int stop; /* set under mu (for the waits on cv), read anywhere */
  /* snapshot */
  int snap_req, snap_ready;
  float *snap; /* params | m | v: 3n */
  int64_t snap_step, snap_opt;
  /* history of reduced gradients: ring of cap entries */
  int hist_on, cap;
  float **ring;
  int64_t *ring_step;
  int64_t first, last; /* steps held: first..last (last < first: none) */
  /* a GRADS reply in progress sends ring slots from step pin on, without
   * the lock: donor_record must not overwrite them meanwhile */
  int pin_on;
  int64_t pin;
  /* TRANSOM_TEST_DONOR_OUTRUN: the first reply right after a snapshot is
   * held until the group could overwrite its first slot, and then sends
   * what it recorded meanwhile; once a process */
  int outrun_hook;
  /* caught-up joiners whose session made way for another: their late
   * GRADS requests are answered from the history, which stays on while
   * any is parked (the session thread's alone) */
  struct {
    proto_reader r;
    int64_t next; /* the step its next GRADS would ask from */
  } parked[DONOR_PARKED_MAX];
  int npark;
  int in_session; /* the session thread serves a joiner (its own) */
};

int donor_wants(donor *d, int64_t step) {
  if (!d) return 0;
  pthread_mutex_lock(&d->mu);
  int want = d->hist_on && step == d->last + 1;
  pthread_mutex_unlock(&d->mu);
  return want;
}

void donor_record(donor *d, int64_t step, const float *grads) {
  if (!d) return;
  pthread_mutex_lock(&d->mu);
  if (d->hist_on && step == d->last + 1 && d->pin_on && step - d->cap >= d->pin) {
    /* the group outran a reply in progress: the slot it would overwrite is
     * being sent, so the history stops here instead, and the joiner's next
     * request is answered GONE (a newer snapshot; or, if it entered the
     * ring already, it exits and is replaced) */
    fprintf(stderr, "donor: step %lld would overwrite step %lld while a catch-up reply sends it: history stopped\n",
            (long long)step, (long long)(step - d->cap));
    d->hist_on = 0;
    pthread_cond_broadcast(&d->cv);
  }
  if (d->hist_on && step == d->last + 1) {
    int slot = (int)(step % d->cap);
    if (!d->ring[slot]) d->ring[slot] = malloc(sizeof(float) * (size_t)d->n);
    if (d->ring[slot]) {
      memcpy(d->ring[slot], grads, sizeof(float) * (size_t)d->n);
      d->ring_step[slot] = step;
      d->last = step;
      if (d->last - d->first >= d->cap) d->first = d->last - d->cap + 1;
      pthread_cond_broadcast(&d->cv);
    }
  }
  pthread_mutex_unlock(&d->mu);
}

void donor_boundary(donor *d) {
  if (!d) return;
  pthread_mutex_lock(&d->mu);
  trainer_buffers b;
  if (d->snap_req && !d->snap_ready) {
    if (trainer_buffers_get(d->t, &b) != 0) {
      /* the device's state could not be read: serve nothing stale; the
       * request stays pending for the next boundary */
      fprintf(stderr, "donor: no snapshot at step %lld: %s\n", (long long)b.step, tr_error());
    } else {
      memcpy(d->snap, b.params, sizeof(float) * (size_t)d->n);
      memcpy(d->snap + d->n, b.m, sizeof(float) * (size_t)d->n);
      memcpy(d->snap + 2 * d->n, b.v, sizeof(float) * (size_t)d->n);
      d->snap_step = b.step;
      d->snap_opt = b.opt_steps;
      d->snap_ready = 1;
      /* a history recorded up to here goes on (a parked joiner may still
       * need its first steps); otherwise it starts after the snapshot */
      if (!d->hist_on || d->last != b.step) {
        d->first = b.step + 1;
        d->last = b.step;
      }
      d->hist_on = 1;
      pthread_cond_broadcast(&d->cv);
    }
  }
  pthread_mutex_unlock(&d->mu);
}

/* The history stops once no joiner can ask for it: no session, none parked. */
static void end_session(donor *d) {
  pthread_mutex_lock(&d->mu);
  d->snap_req = d->snap_ready = 0;
  if (d->npark == 0) d->hist_on = 0;
  d->pin_on = 0;
  pthread_mutex_unlock(&d->mu);
}

static int answer_grads(donor *d, int fd, int64_t from, int first_grads, int *caught_up, int64_t *next);

/* Parks a caught-up joiner's connection (its reader holds nothing yet);
 * next: the step its next GRADS would ask from. */
static void park(donor *d, int fd, int64_t next) {
  if (d->npark == DONOR_PARKED_MAX) {
    fprintf(stderr, "donor: %d caught-up joiners parked already: this one's session ends\n", DONOR_PARKED_MAX);
    close(fd);
    return;
  }
  pthread_mutex_lock(&d->mu); /* written under mu: session_main and end_session read it there */
  d->parked[d->npark].r = (proto_reader){.fd = fd};
  d->parked[d->npark].next = next;
  d->npark++;
  pthread_mutex_unlock(&d->mu);
}

static void unpark(donor *d, int i) {
  close(d->parked[i].r.fd);
  pthread_mutex_lock(&d->mu);
  d->parked[i] = d->parked[--d->npark];
  if (d->npark == 0 && !d->in_session) d->hist_on = 0;
  pthread_mutex_unlock(&d->mu);
}

/* One request from parked joiner i, whose bytes are waiting: GRADS is
 * answered, anything else (BYE: it is in the ring) or a closed connection
 * ends it. */
static void parked_request(donor *d, int i) {
  char line[PROTO_LINE_MAX];
  int caught_up;
  int64_t next = d->parked[i].next;
  if (proto_read(&d->parked[i].r, line, sizeof line, 10000) != 1 || !proto_is(line, "GRADS") ||
      answer_grads(d, d->parked[i].r.fd, proto_int(line, "from", -1), 0, &caught_up, &next)) {
    unpark(d, i);
    return;
  }
  d->parked[i].next = next;
}

/* Whether the history can still answer parked joiner i: it is recorded and
 * reaches back to the step the joiner would ask from (else it could only
 * be told GONE, so it is let go, and the history may stop). */
static int parked_servable(donor *d, int i) {
  pthread_mutex_lock(&d->mu);
  int ok = d->hist_on && d->first <= d->parked[i].next;
  pthread_mutex_unlock(&d->mu);
  return ok;
}

/* Waits up to timeout_ms for fd (-1: none) to be readable, answering the
 * parked joiners' requests meanwhile, and letting go of those the history
 * no longer reaches. A parked joiner is silent by design (it waits in its
 * first collective for the group to be whole, however long the other
 * joiners take): no idle limit. 1 when fd is readable, else 0. */
static int wait_readable(donor *d, int fd, int timeout_ms) {
  struct pollfd p[1 + DONOR_PARKED_MAX];
  int np = d->npark, buffered = 0;
  p[0] = (struct pollfd){fd, POLLIN, 0};
  for (int i = 0; i < np; i++) {
    p[1 + i] = (struct pollfd){d->parked[i].r.fd, POLLIN, 0};
    buffered |= d->parked[i].r.len > 0;
  }
  if (poll(p, (nfds_t)(1 + np), buffered ? 0 : timeout_ms) < 0) return 0;
  for (int i = np - 1; i >= 0; i--) { /* from the end: an unpark moves the last entry into i */
    if (p[1 + i].revents || d->parked[i].r.len > 0) parked_request(d, i);
    else if (!parked_servable(d, i)) {
      fprintf(stderr, "donor: the history no longer holds step %lld for a parked joiner: its connection ends\n",
              (long long)d->parked[i].next);
      unpark(d, i);
    }
  }
  return fd >= 0 && p[0].revents != 0;
}

/* The joiner's next request, waiting in short polls (so that donor_stop is
 * seen; parked joiners are answered meanwhile) up to DONOR_IDLE_S between
 * requests: a joiner may load the snapshot into a device, or be paused, for
 * a while before it asks for gradients. A joiner that has caught up (its
 * last reply held at most one step: it is entering the ring) is parked as
 * soon as another joiner waits in the queue, or at DONOR_IDLE_S: below
 * min_replicas the group waits for the other joiners, and the one in the
 * ring asks again only if its first collective finds the group ahead.
 * Returns 1 with a line, 2 to park the connection, 0 when the joiner left
 * or went silent. */
#define DONOR_IDLE_S 120.0
static int next_request(donor *d, proto_reader *r, char *line, size_t n, int caught_up) {
  double idle_end = tr_now() + DONOR_IDLE_S;
  for (;;) {
    if (d->stop) return 0;
    if (tr_now() >= idle_end) return caught_up ? 2 : 0;
    if (r->len == 0 && !wait_readable(d, r->fd, 200)) {
      if (!caught_up) continue;
      pthread_mutex_lock(&d->mu);
      int waiting = d->nq;
      pthread_mutex_unlock(&d->mu);
      if (!waiting) continue;
      fprintf(stderr, "donor: the joiner caught up and another waits: it is parked, its session ends\n");
      return 2;
    }
    return proto_read(r, line, n, 10000) == 1; /* the rest of a started line comes promptly */
  }
}

/* Whether the joiner closed its end (its request still buffered): one that
 * gave up while it waited in the queue gets no snapshot. */
static int peer_gone(int fd) {
  char c;
  return recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
}

/* Under d->mu: one short wait on d->cv (a recorded step, a snapshot, a
 * stop), so the caller re-checks its condition and its deadline. */
static void cv_wait_10ms(donor *d) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_nsec += 10 * 1000000;
  if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
  pthread_cond_timedwait(&d->cv, &d->mu, &ts);
}

/* The test hook, under d->mu: waits (bounded, within the joiner's 60 s
 * read timeout) until the group reaches the step that would overwrite
 * `from`'s slot, or the history stopped. */
static void outrun_wait(donor *d, int64_t from) {
  for (double end = tr_now() + 30; d->hist_on && d->last < from + d->cap && tr_now() < end && !d->stop;)
    cv_wait_10ms(d);
}

/* Answers GRADS from=`from`: the steps recorded from there on, or GONE
 * when the history does not reach back to it. *caught_up: the reply held
 * at most one step; *next: the step the joiner's next request would start
 * at. 0, or nonzero when the connection failed. */
static int answer_grads(donor *d, int fd, int64_t from, int first_grads, int *caught_up, int64_t *next) {
  pthread_mutex_lock(&d->mu);
  /* wait briefly for the step to be recorded: the group may be mid-step */
  double t_end = tr_now() + 0.2;
  while (d->hist_on && from > d->last && tr_now() < t_end && !d->stop) cv_wait_10ms(d);
  int gone = !d->hist_on || from < d->first;
  int64_t first = d->first, last = d->last;
  if (!gone) d->pin_on = 1, d->pin = from;
  if (!gone && first_grads && d->outrun_hook) {
    d->outrun_hook = 0;
    outrun_wait(d, from);
    last = d->last; /* what the group recorded meanwhile: all pinned */
  }
  pthread_mutex_unlock(&d->mu);
  *caught_up = 0;
  if (gone) return proto_send(fd, "GONE first=%lld", (long long)first) != 0;
  int64_t count = from <= last ? last - from + 1 : 0;
  *caught_up = count <= 1;
  *next = from + count;
  int bad = proto_send(fd, "GRADS first=%lld count=%lld", (long long)from, (long long)count) != 0;
  for (int64_t s = from; s <= last && !bad; s++) /* pinned: donor_record leaves these slots alone */
    bad = net_send_all(fd, d->ring[s % d->cap], sizeof(float) * (size_t)d->n) != 0;
  pthread_mutex_lock(&d->mu);
  d->pin_on = 0;
  pthread_mutex_unlock(&d->mu);
  return bad;
}

/* Serves one joiner connection until it leaves (0: close it) or is parked
 * (1: the connection is the parked list's now). */
#define SNAP_WAIT_S 60.0 /* the donor's wait for a step boundary to snapshot at */
/* The joiner's wait for the SNAP reply: the donor's own wait, and a
 * session ahead of ours in its queue (a joiner loading its snapshot). */
#define JOINER_SNAP_WAIT_S (3 * SNAP_WAIT_S)
static int serve(donor *d, int fd) {
  proto_reader r = {.fd = fd};
  char line[PROTO_LINE_MAX];
  int after_snap = 0; /* the next GRADS is the joiner's first after its snapshot */
  int caught_up = 0;  /* the last GRADS reply held at most one step */
  int64_t next = 0;   /* where the joiner's next GRADS would start */
  int got, parked = 0;
  while ((got = next_request(d, &r, line, sizeof line, caught_up)) == 1) {
    int first_grads = after_snap;
    after_snap = 0;
    caught_up = 0;
    if (proto_is(line, "SNAP")) {
      if (r.len == 0 && peer_gone(fd)) {
        fprintf(stderr, "donor: the joiner left before its turn: no snapshot\n");
        break;
      }
      after_snap = 1;
      pthread_mutex_lock(&d->mu);
      d->snap_req = 1;
      d->snap_ready = 0;
      /* a donor whose loop is held longer than this (its operator lost,
       * say) ends the session and frees itself for the next joiner; parked
       * joiners are answered meanwhile (the group may wait for one of them
       * before it reaches the boundary we wait for) */
      for (double end = tr_now() + SNAP_WAIT_S; !d->snap_ready && !d->stop && tr_now() < end;) {
        if (d->npark == 0) {
          cv_wait_10ms(d);
          continue;
        }
        pthread_mutex_unlock(&d->mu);
        wait_readable(d, -1, 10);
        pthread_mutex_lock(&d->mu);
      }
      int ready = d->snap_ready;
      pthread_mutex_unlock(&d->mu);
      if (d->stop) break;
      if (!ready) {
        fprintf(stderr, "donor: no step boundary within %.0f s for a snapshot; ending the session\n", SNAP_WAIT_S);
        break;
      }
      if (proto_send(fd, "SNAP step=%lld opt_steps=%lld n=%lld", (long long)d->snap_step, (long long)d->snap_opt,
                     (long long)d->n) ||
          net_send_all(fd, d->snap, sizeof(float) * 3 * (size_t)d->n))
        break;
    } else if (proto_is(line, "GRADS")) {
      if (answer_grads(d, fd, proto_int(line, "from", -1), first_grads, &caught_up, &next)) break;
    } else if (proto_is(line, "BYE")) {
      break;
    }
  }
  if (got == 2) {
    park(d, fd, next);
    parked = 1;
  }
  end_session(d);
  return parked;
}

/* Connections that have been challenged and not answered yet: several at
 * once, so that silent ones (a port scanner, a stuck client) cannot keep a
 * joiner waiting behind them; each is closed AUTH_WAIT_S after it came, and
 * the oldest makes room when all PENDING_MAX are taken. */
#define PENDING_MAX 8
#define AUTH_WAIT_S 10.0
typedef struct {
  int fd;
  double t_end;
  size_t got;
  uint8_t ch[AUTH_CHALLENGE], mac[AUTH_MAC];
} pending_conn;

static void pending_drop(pending_conn *pc, int *np, int i, const char *why) {
  if (why) fprintf(stderr, "donor: refused a connection: %s\n", why);
  if (pc[i].fd >= 0) close(pc[i].fd);
  pc[i] = pc[--*np];
}

/* Hands a connection that proved the secret to the session thread. */
static void enqueue(donor *d, int fd) {
  pthread_mutex_lock(&d->mu);
  int full = d->nq == DONOR_QUEUE_MAX;
  if (!full) d->queue[d->nq++] = fd;
  pthread_cond_broadcast(&d->cv);
  pthread_mutex_unlock(&d->mu);
  if (full) {
    fprintf(stderr, "donor: refused a connection: %d joiners already wait for a catch-up\n", DONOR_QUEUE_MAX);
    close(fd);
  }
}

/* A new connection: challenged at once (20 bytes fit any fresh socket
 * buffer); with no secret it is queued straight away. */
static void take_conn(donor *d, pending_conn *pc, int *np, int fd) {
  /* a joiner that stops reading (SIGSTOP, a hung host) fails our send
   * after the time it would itself wait for a reply, instead of holding
   * the session thread, the queue and the parked joiners for ever */
  struct timeval tv = {.tv_sec = DONOR_SEND_TIMEOUT_S};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (d->secret.len == 0) {
    enqueue(d, fd);
    return;
  }
  if (*np == PENDING_MAX) pending_drop(pc, np, 0, "too many connections waiting to answer the challenge");
  pending_conn *c = &pc[(*np)++];
  *c = (pending_conn){.fd = fd, .t_end = tr_now() + AUTH_WAIT_S};
  auth_challenge(c->ch);
  if (send(fd, c->ch, AUTH_CHALLENGE, MSG_NOSIGNAL | MSG_DONTWAIT) != AUTH_CHALLENGE)
    pending_drop(pc, np, *np - 1, "could not send the challenge");
}

/* Reads what pending connection i sent; queues it once it proved the secret. */
static void pending_read(donor *d, pending_conn *pc, int *np, int i) {
  pending_conn *c = &pc[i];
  ssize_t k = recv(c->fd, c->mac + c->got, AUTH_MAC - c->got, MSG_DONTWAIT);
  if (k <= 0) {
    if (k < 0 && (errno == EAGAIN || errno == EINTR)) return;
    pending_drop(pc, np, i, "closed before answering the challenge");
    return;
  }
  c->got += (size_t)k;
  if (c->got < AUTH_MAC) return;
  if (!auth_verify(&d->secret, c->ch, c->mac)) {
    pending_drop(pc, np, i, "did not prove the job secret");
    return;
  }
  int fd = c->fd;
  pc[i].fd = -1; /* now the queue's */
  pending_drop(pc, np, i, NULL);
  enqueue(d, fd);
}

/* The listener thread. */
static void *donor_main(void *arg) {
  donor *d = arg;
  pending_conn pc[PENDING_MAX];
  int np = 0;
  while (!d->stop) {
    struct pollfd p[1 + PENDING_MAX] = {{d->lfd, POLLIN, 0}};
    for (int i = 0; i < np; i++) p[1 + i] = (struct pollfd){pc[i].fd, POLLIN, 0};
    if (poll(p, (nfds_t)(1 + np), 200) < 0) continue;
    double now = tr_now();
    for (int i = np - 1; i >= 0; i--) { /* from the end: a drop moves the last entry into i */
      if (p[1 + i].revents) pending_read(d, pc, &np, i);
      else if (now > pc[i].t_end) pending_drop(pc, &np, i, "no answer to the challenge in time");
    }
    if (p[0].revents & POLLIN) {
      int fd = accept(d->lfd, NULL, NULL);
      if (fd >= 0) take_conn(d, pc, &np, fd);
    }
  }
  while (np > 0) pending_drop(pc, &np, 0, NULL);
  return NULL;
}

/* The session thread: serves the queued joiners in the order they proved
 * the secret, one at a time (the snapshot buffer is one session's; the
 * history is shared with the parked joiners), and answers the parked. */
static void *session_main(void *arg) {
  donor *d = arg;
  pthread_mutex_lock(&d->mu);
  while (!d->stop) {
    if (d->nq == 0 && d->npark == 0) {
      pthread_cond_wait(&d->cv, &d->mu);
      continue;
    }
    if (d->nq == 0) { /* only parked joiners: answer them, look at the queue every 200 ms */
      pthread_mutex_unlock(&d->mu);
      wait_readable(d, -1, 200);
      pthread_mutex_lock(&d->mu);
      continue;
    }
    int fd = d->queue[0];
    memmove(d->queue, d->queue + 1, sizeof(int) * (size_t)--d->nq);
    d->in_session = 1;
    pthread_mutex_unlock(&d->mu);
    if (!serve(d, fd)) close(fd);
    pthread_mutex_lock(&d->mu);
    d->in_session = 0;
  }
  pthread_mutex_unlock(&d->mu);
  return NULL;
}

donor *donor_start(const char *host, trainer *t, int history, int *port, const auth_secret *secret) {
  donor *d = calloc(1, sizeof *d);
  if (!d) {
    tr_fail(TR_ENOMEM, "out of memory");
    return NULL;
  }
  d->t = t;
  if (secret) d->secret = *secret;
  d->n = trainer_grads_size(t);
  d->cap = history < 2 ? 2 : history;
  d->outrun_hook = getenv("TRANSOM_TEST_DONOR_OUTRUN") != NULL;
  d->snap = tr_alloc_aligned(sizeof(float) * 3 * (size_t)d->n);
  d->ring = calloc((size_t)d->cap, sizeof(float *));
  d->ring_step = calloc((size_t)d->cap, sizeof(int64_t));
  pthread_mutex_init(&d->mu, NULL);
  pthread_cond_init(&d->cv, NULL);
  d->lfd = -1;
  if (!d->snap || !d->ring || !d->ring_step) {
    tr_fail(TR_ENOMEM, "out of memory for the donor's buffers");
    goto fail;
  }
  d->lfd = net_listen(host, 0, port);
  if (d->lfd < 0) goto fail;
  if (pthread_create(&d->session_th, NULL, session_main, d) != 0) {
    tr_fail(TR_ENOMEM, "cannot start the donor's session thread");
    goto fail;
  }
  if (pthread_create(&d->th, NULL, donor_main, d) != 0) {
    tr_fail(TR_ENOMEM, "cannot start the donor thread");
    pthread_mutex_lock(&d->mu);
    d->stop = 1;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    pthread_join(d->session_th, NULL);
    goto fail;
  }
  return d;
fail:
  if (d->lfd >= 0) close(d->lfd);
  pthread_mutex_destroy(&d->mu);
  pthread_cond_destroy(&d->cv);
  tr_free_aligned(d->snap);
  free(d->ring);
  free(d->ring_step);
  free(d);
  return NULL;
}

void donor_stop(donor *d) {
  if (!d) return;
  pthread_mutex_lock(&d->mu);
  d->stop = 1;
  pthread_cond_broadcast(&d->cv);
  pthread_mutex_unlock(&d->mu);
  pthread_join(d->th, NULL);
  pthread_join(d->session_th, NULL);
  for (int i = 0; i < d->nq; i++) close(d->queue[i]);
  for (int i = 0; i < d->npark; i++) close(d->parked[i].r.fd);
  close(d->lfd);
  for (int i = 0; i < d->cap; i++) free(d->ring[i]);
  free(d->ring);
  free(d->ring_step);
  tr_free_aligned(d->snap);
  pthread_mutex_destroy(&d->mu);
  pthread_cond_destroy(&d->cv);
  free(d);
}

/* --- joiner side --- */

int donor_fetch_snapshot(const char *host, int port, trainer *t, int *fdp, const auth_secret *secret) {
  int fd = *fdp;
  *fdp = -1;
  if (fd < 0) {
    /* the donor listened before the operator named it: a refusal that
     * lasts means it is gone, and the joiner had better fail fast so that
     * the restart policy picks another donor (not 10 s of retries) */
    fd = net_connect(host, port, 1.0);
    if (fd < 0) return fd;
    if (auth_client(fd, secret, 10.0)) {
      close(fd);
      return tr_fail_prefix(TR_EIO, "donor %s:%d", host, port);
    }
  }
  proto_reader r = {.fd = fd};
  char line[PROTO_LINE_MAX];
  trainer_buffers b;
  trainer_buffers_get(t, &b);
  int rc = proto_send(fd, "SNAP");
  if (!rc) {
    /* the donor serves one joiner at a time: this wait may include a
     * session ahead of ours */
    int got = proto_read(&r, line, sizeof line, (int)(JOINER_SNAP_WAIT_S * 1000));
    if (got == 0) rc = tr_fail(TR_EIO, "donor %s:%d closed the connection before sending a snapshot", host, port);
    else if (got < 0) rc = tr_fail_prefix(TR_EIO, "donor %s:%d: no snapshot", host, port);
  }
  if (!rc && (!proto_is(line, "SNAP") || proto_int(line, "n", -1) != b.n))
    rc = tr_fail(TR_EFORMAT, "donor: unexpected reply '%.80s' (model size %lld)", line, (long long)b.n);
  /* the reader may hold the first bytes of the payload */
  size_t bytes = sizeof(float) * 3 * (size_t)b.n, have = rc ? 0 : r.len;
  float *tmp = rc ? NULL : tr_alloc_aligned(bytes);
  if (!rc && !tmp) rc = tr_fail(TR_ENOMEM, "out of memory");
  if (!rc) {
    memcpy(tmp, r.buf, have);
    rc = net_recv_all(fd, (char *)tmp + have, bytes - have);
  }
  if (!rc) {
    memcpy(b.params, tmp, sizeof(float) * (size_t)b.n);
    memcpy(b.m, tmp + b.n, sizeof(float) * (size_t)b.n);
    memcpy(b.v, tmp + 2 * b.n, sizeof(float) * (size_t)b.n);
    rc = trainer_buffers_put(t);
  }
  if (!rc) {
    trainer_set_progress(t, proto_int(line, "step", 0), proto_int(line, "opt_steps", 0));
  }
  tr_free_aligned(tmp);
  if (rc) {
    close(fd);
    return rc;
  }
  *fdp = fd;
  return TR_OK;
}

int donor_catch_up(int fd, trainer *t, int64_t until) {
  int applied = 0;
  const int64_t n = trainer_grads_size(t);
  char line[PROTO_LINE_MAX];
  for (;;) {
    trainer_state b; /* only the step: no state leaves the device for it */
    trainer_get_state(t, &b);
    if (until > 0 && b.step >= until) return applied;
    int rc = proto_send(fd, "GRADS from=%lld", (long long)b.step + 1);
    proto_reader r = {.fd = fd};
    if (!rc) rc = proto_read(&r, line, sizeof line, 60000) == 1 ? 0 : tr_fail(TR_EIO, "donor: no reply");
    if (rc) return rc;
    if (proto_is(line, "GONE")) return tr_fail(TR_ESTATE, "donor: history starts at step %lld, after ours",
                                                (long long)proto_int(line, "first", -1));
    int64_t count = proto_int(line, "count", -1);
    if (!proto_is(line, "GRADS") || count < 0) return tr_fail(TR_EFORMAT, "donor: unexpected reply");
    if (count == 0 && until <= 0) return applied;
    if (count == 0) { /* waiting for the donor to get to `until`: ask again shortly, not in a spin */
      struct timespec ts = {0, 2 * 1000 * 1000};
      nanosleep(&ts, NULL);
    }
    float *g = trainer_grads_host(t);
    if (!g) return TR_EIO;
    size_t have = r.len; /* payload bytes already buffered */
    for (int64_t k = 0; k < count; k++) {
      size_t bytes = sizeof(float) * (size_t)n, take = have < bytes ? have : bytes;
      memcpy(g, r.buf + (r.len - have), take);
      have -= take;
      if ((rc = net_recv_all(fd, (char *)g + take, bytes - take))) return rc;
      step_stats st = {0};
      /* TR_ESTATE means GONE alone (the stream in step: get_state asks for
       * a newer snapshot over it); a replay that fails midway is TR_EIO */
      if ((rc = trainer_grads_put(t, g)) || (rc = trainer_apply_grads(t, &st))) return rc == TR_ESTATE ? TR_EIO : rc;
      applied++;
      if (until > 0 && st.step >= until) {
        /* drain the rest of this reply so the stream stays in step (the
         * reader may hold some of it: small models' gradients) */
        for (int64_t j = k + 1; j < count; j++) {
          take = have < bytes ? have : bytes;
          have -= take;
          if ((rc = net_recv_all(fd, g, bytes - take))) return rc;
        }
        return applied;
      }
    }
    /* within a step of the donor: close enough to enter the ring, where the
     * all-reduce's seq check says exactly which steps are still missing */
    if (until <= 0 && count <= 1) return applied;
  }
}

void donor_close(int fd) {
  if (fd < 0) return;
  proto_send(fd, "BYE");
  close(fd);
}
