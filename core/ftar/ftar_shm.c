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

#include "ftar_member_internal.h"
#include "util.h"

void ftar_shm_unmap(shm_link *S) {
  if (S->h) munmap(S->h, SHM_DATA + S->size);
  if (S->memfd >= 0) close(S->memfd);
  memset(S, 0, sizeof *S);
  S->memfd = -1;
}

/* Producer: creates and maps the ring offered in CONNECT. */
int ftar_shm_create(ftar_links *L) {
  shm_link *S = &L->down_shm;
  ftar_shm_unmap(S);
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
  S->h = p;
  S->data = (uint8_t *)p + SHM_DATA;
  S->size = SHM_RING;
  S->memfd = fd;
  S->h->magic = SHM_MAGIC;
  S->h->size = SHM_RING;
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
    p = mmap(NULL, SHM_DATA + size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
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

static void doorbell(int fd) {
  char b = 'd';
  ssize_t w = send(fd, &b, 1, MSG_NOSIGNAL | MSG_DONTWAIT); /* EAGAIN: one is pending already */
  (void)w;
}

/* Producer: copies as much of iov as fits. Bytes written, or -1 if the
 * consumer corrupted the counters. */
ssize_t ftar_shm_write(ftar_links *L, const struct iovec *iov, int niov) {
  shm_link *S = &L->down_shm;
  uint64_t tail = atomic_load_explicit(&S->h->tail, memory_order_acquire), head = S->pos;
  if (tail > head || head - tail > S->size) return -1;
  size_t space = S->size - (size_t)(head - tail), done = 0;
  for (int i = 0; i < niov && done < space; i++) {
    size_t n = iov[i].iov_len < space - done ? iov[i].iov_len : space - done;
    size_t off = (size_t)(head + done) & (S->size - 1), first = S->size - off < n ? S->size - off : n;
    memcpy(S->data + off, iov[i].iov_base, first);
    memcpy(S->data, (const uint8_t *)iov[i].iov_base + first, n - first);
    done += n;
  }
  if (done) {
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
