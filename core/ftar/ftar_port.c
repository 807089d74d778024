/* ftar_port.c — an FTAR member's data port and the links of its ring
 * positions (one pair per ring level: the flat ring, and for the
 * hierarchical plane the host's local ring and the leaders' ring).
 *
 * Anyone may connect to the data port. A connection is a stranger, kept in
 * a small bounded list (PENDING_MAX, the oldest dropped first), until its
 * CONNECT frame is complete and checked (header, type, exact length, CRC,
 * a known ring level); then it is parked until the member runs the epoch
 * it names and has that level's view of it. Then the CONNECT of that
 * level's upstream neighbour becomes the level's upstream link (answered
 * 'S' when we mapped its shared-memory ring, 'T' for TCP); stale epochs,
 * the wrong sender, a second CONNECT, a bad byte or a stranger that
 * overstayed the deadline are closed with a logged reason.
 *
 * Not here: the downstream side of the handshake (ftar_ring.c sends
 * CONNECT), the rings themselves (ftar_shm.c). Called by: ftar_ring.c's
 * poll loop, ftar_member_free.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ftar_member_internal.h"
#include "util.h"

/* --- the links of run_ep --- */

void ftar_links_close_one(ftar_links *L) {
  ftar_close_fd(&L->up_fd);
  ftar_close_fd(&L->down_fd);
  ftar_shm_unmap(&L->up_shm);
  ftar_shm_unmap(&L->down_shm);
  L->down_state = DOWN_NONE;
  L->up_eof = L->down_eof = 0;
  L->rx_head = L->rx_tail = 0;
}

void ftar_links_close(ftar_member *m) {
  for (int i = 0; i < FTAR_LEVELS; i++) ftar_links_close_one(&m->lk[i]);
}

void ftar_links_view(ftar_links *L, uint64_t ep, const peer *mem, int n, int r) {
  if (L->mem != mem) memcpy(L->mem, mem, (size_t)n * sizeof *mem);
  L->n = n;
  L->r = r;
  L->ep = ep;
}

/* --- strangers and CONNECT handshakes --- */

static void pend_remove(ftar_member *m, int i, int close_it) {
  if (close_it) close(m->pend[i].fd);
  memmove(m->pend + i, m->pend + i + 1, (size_t)(m->npend - i - 1) * sizeof m->pend[0]);
  m->npend--;
}

static void pend_reject(ftar_member *m, int i, const char *why) {
  ftar_member_log(m, "data port: closing a connection: %s", why);
  m->st.conns_rejected++;
  pend_remove(m, i, 1);
}

void ftar_port_accept(ftar_member *m) {
  for (;;) {
    int fd = accept(m->lfd, NULL, NULL);
    if (fd < 0) {
      if (errno == EINTR) continue;
      return; /* EAGAIN, or out of descriptors: try again next round */
    }
    ftar_set_nonblock(fd);
    ftar_tune_socket(fd, m->o.sockbuf);
    if (m->npend == PENDING_MAX) pend_reject(m, 0, "too many unidentified connections, dropping the oldest");
    pending *q = &m->pend[m->npend++];
    memset(q, 0, sizeof *q);
    q->fd = fd;
    q->t0 = tr_now();
    q->authed = m->secret.len == 0;
    if (!q->authed) { /* first thing: the challenge (fits an empty socket buffer) */
      auth_challenge(q->ch);
      if (send(fd, q->ch, sizeof q->ch, MSG_DONTWAIT | MSG_NOSIGNAL) != (ssize_t)sizeof q->ch)
        pend_reject(m, m->npend - 1, "cannot send the job-secret challenge");
    }
  }
}

/* Reads what each stranger sent; validates the CONNECT frame as it comes. */
void ftar_port_read(ftar_member *m) {
  char why[200];
  for (int i = 0; i < m->npend; i++) {
    pending *q = &m->pend[i];
    if (q->complete) continue;
    if (!q->authed) { /* its answer comes before any frame byte is read */
      ssize_t k = recv(q->fd, q->mac + q->mgot, sizeof q->mac - q->mgot, MSG_DONTWAIT);
      if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        pend_reject(m, i--, "closed before proving the job secret");
        continue;
      }
      if (k > 0) q->mgot += (size_t)k;
      if (q->mgot < sizeof q->mac) continue;
      if (!auth_verify(&m->secret, q->ch, q->mac)) {
        pend_reject(m, i--, "it did not prove the job secret");
        continue;
      }
      q->authed = 1;
      continue;
    }
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
      q->level = ftw_get32(q->b + FTAR_HDR + 20);
      if (q->level >= FTAR_LEVELS) {
        snprintf(why, sizeof why, "CONNECT for ring level %u (there are %d)", q->level, FTAR_LEVELS);
        pend_reject(m, i--, why);
        continue;
      }
      q->complete = 1;
    }
  }
}

/* Makes q (a CONNECT for run_ep from L's upstream) L's upstream link and
 * answers it. 0, or -1 when the answer could not be sent (q dropped). */
static int adopt_upstream(ftar_member *m, ftar_links *L, pending *q) {
  L->up_fd = q->fd;
  L->up_eof = 0;
  L->rx_head = L->rx_tail = 0;
  char ack = 'T';
  if ((q->h.flags & FTF_SHM) && m->o.shm && ftar_shm_attach(L, q->b + FTAR_HDR) == 0) ack = 'S';
  if (send(L->up_fd, &ack, 1, MSG_NOSIGNAL | MSG_DONTWAIT) != 1) {
    ftar_member_log(m, "data port: cannot answer slot %u's CONNECT: %s", q->h.index, strerror(errno));
    ftar_close_fd(&L->up_fd);
    ftar_shm_unmap(&L->up_shm);
    return -1;
  }
  if (ack == 'S') m->st.links_shm++;
  else m->st.links_tcp++;
  return 0;
}

/* A parked CONNECT for run_ep: 1 if it waits on (its level has no view of
 * run_ep yet), else adopted (0) or rejected with why (-1). */
static int match_one(ftar_member *m, pending *q, char *why, size_t why_len) {
  ftar_links *L = &m->lk[q->level];
  if (L->ep != m->run_ep) return 1;
  const peer *up = L->n > 1 ? &L->mem[(L->r + L->n - 1) % L->n] : NULL;
  if (!up || q->h.aux != (uint32_t)m->slot || q->h.index != (uint32_t)up->slot || q->uid != up->uid) {
    snprintf(why, why_len, "CONNECT from slot %u (uid %llu) to slot %u is not from our upstream (ring level %u)",
             q->h.index, (unsigned long long)q->uid, q->h.aux, q->level);
    return -1;
  }
  if (L->up_fd >= 0) {
    snprintf(why, why_len, "second CONNECT from our upstream in one epoch (ring level %u)", q->level);
    return -1;
  }
  adopt_upstream(m, L, q);
  return 0;
}

/* Adopts parked CONNECTs from each level's upstream for run_ep; drops stale
 * ones and strangers that overstayed. */
void ftar_port_match(ftar_member *m) {
  double now = tr_now();
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
    int r = 1;
    if (q->h.epoch < m->run_ep) {
      snprintf(why, sizeof why, "CONNECT from slot %u for stale epoch %llu (current %llu)", q->h.index,
               (unsigned long long)q->h.epoch, (unsigned long long)m->run_ep);
      r = -1;
    } else if (q->h.epoch == m->run_ep) {
      r = match_one(m, q, why, sizeof why);
    }
    if (r < 0) pend_reject(m, i--, why);
    else if (r == 0) pend_remove(m, i--, 0);
    else if (now - q->t0 > m->o.timeout) pend_reject(m, i--, "CONNECT for a future epoch (or a ring level) that never came");
  }
}

/* Closes every stranger (and parked CONNECT). */
void ftar_port_close(ftar_member *m) {
  while (m->npend) pend_remove(m, m->npend - 1, 1);
}
