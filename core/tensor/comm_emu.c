/* comm_emu.c — the "emu" backend's communicator: an all-reduce between
 * processes on one host through a POSIX shared-memory segment, standing in
 * for NCCL (see comm_emu.h and the collective section of backend.h).
 *
 * Id and segment lifetime:
 *   emu_comm_id creates nothing: the id is a magic and a fresh random name,
 *   "/transom-comm-<pid>-<16 hex>". Rank 0's emu_comm_create creates the
 *   segment under that name (O_EXCL), sizes it and publishes the header;
 *   the other ranks open it (retrying until it exists) and attach. Every
 *   rank unlinks the name as soon as its emu_comm_create returns, success
 *   or failure (ENOENT is fine), so the name lives only while ranks are
 *   attaching: once all n attached nobody needs it, and a rank killed
 *   later leaves nothing in /dev/shm (the memory goes with the last
 *   mapping). A name can only linger if every rank dies during creation.
 *
 * Segment layout (one per communicator):
 *   header          magic, nranks, slot size, attach count, abort word
 *   rank states     one 64-byte line per rank: barrier arrivals, left flag, pid,
 *                   emulated device (duplicate check, see emu_comm_create_on)
 *   slots           nranks x SLOT_BYTES, page aligned: rank r's chunk input
 *
 * An all-reduce, per chunk of at most SLOT_FLOATS: every rank copies its
 * chunk into its slot; barrier; every rank sums the slots in rank order into
 * its buffer (so every rank computes identical bits) and scales; barrier
 * (no slot is overwritten while a peer still reads it). The barrier is a
 * generation count per rank (C11 atomics): a rank announces its arrival at
 * barrier g by storing g in its line and waits until every line holds at
 * least g. A wait spins briefly (yielding the core), then sleeps in growing
 * steps up to 1 ms, and gives up after `deadline` seconds: the communicator
 * is then aborted, in this process and in the segment, so peers fail at
 * once too, and every later call fails immediately. A rank that destroys
 * its communicator marks its line "left": a peer waiting for it fails at
 * once instead of waiting out the deadline.
 *
 * Not here: device memory (emu device pointers are host pointers), more
 * than one host. No process exits, no signals. One thread per communicator.
 * Called by: the emu backend's table (backend.c), i.e. FTAR's device data
 * plane (ftar_dev.c), and tests.
 */
#include "comm_emu.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "util.h"

#define EMU_MAGIC 0x4d454354u /* "TCEM" */
#define EMU_PREFIX "/transom-comm-"
#define EMU_MAX_RANKS 1024
#define SLOT_BYTES ((size_t)1 << 20)
#define SLOT_FLOATS (SLOT_BYTES / sizeof(float))
#define DEFAULT_DEADLINE 30.0

typedef struct {
  _Atomic uint32_t magic; /* stored last by rank 0: the rest of the header is valid */
  uint32_t nranks;
  uint64_t slot_bytes;
  _Atomic uint32_t attached; /* ranks attached so far */
  _Atomic uint32_t aborted;  /* 0, or 1 + the rank that aborted the communicator */
  uint8_t pad[40];
} emu_hdr;

typedef struct {
  _Atomic uint64_t arrived; /* the latest barrier this rank reached */
  _Atomic uint32_t left;    /* the rank destroyed its communicator */
  _Atomic int32_t pid;      /* 0 until the rank attached */
  _Atomic int32_t dev;      /* its emulated device + 1 (0: unchecked); set before it counts as attached */
  uint8_t pad[44];
} emu_rank;

struct tr_comm {
  emu_hdr *h;
  emu_rank *ranks;
  float *slots;
  size_t map_bytes;
  int nranks, rank;
  uint64_t gen;  /* barriers passed by this rank */
  int aborted;   /* this communicator is dead */
  char why[160]; /* why it died, repeated by later calls */
};

_Static_assert(sizeof(emu_hdr) == 64 && sizeof(emu_rank) == 64, "one cache line each");

static size_t ranks_off(void) { return sizeof(emu_hdr); }
static size_t slots_off(int nranks) {
  size_t end = ranks_off() + (size_t)nranks * sizeof(emu_rank);
  return (end + 4095) & ~(size_t)4095;
}
static size_t seg_bytes(int nranks) { return slots_off(nranks) + (size_t)nranks * SLOT_BYTES; }

/* --- ids --- */

int emu_comm_id(uint8_t id[TR_COMM_ID_BYTES]) {
  uint64_t r = 0;
  if (getrandom(&r, sizeof r, GRND_NONBLOCK) != (ssize_t)sizeof r) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    r ^= (uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ull ^ (uint64_t)ts.tv_sec ^ (uint64_t)(uintptr_t)&r;
  }
  memset(id, 0, TR_COMM_ID_BYTES);
  uint32_t magic = EMU_MAGIC;
  memcpy(id, &magic, 4);
  snprintf((char *)id + 4, TR_COMM_ID_BYTES - 4, EMU_PREFIX "%ld-%016llx", (long)getpid(), (unsigned long long)r);
  return TR_OK;
}

/* The segment name inside an id, or NULL if the id is not an emu id. */
static const char *id_name(const uint8_t id[TR_COMM_ID_BYTES]) {
  uint32_t magic;
  memcpy(&magic, id, 4);
  const char *name = (const char *)id + 4;
  if (magic != EMU_MAGIC || !memchr(name, 0, TR_COMM_ID_BYTES - 4)) return NULL;
  if (strncmp(name, EMU_PREFIX, strlen(EMU_PREFIX)) != 0 || strchr(name + 1, '/')) return NULL;
  return name;
}

/* --- bounded waiting --- */

typedef struct {
  double t0;
  long sleep_ns;
  unsigned spins;
} backoff;

static void backoff_init(backoff *b) {
  b->t0 = tr_now();
  b->sleep_ns = 0;
  b->spins = 0;
}

/* One wait step: yield for the first ~50 us, then sleep 20 us doubling to
 * 1 ms. Returns the seconds waited so far. */
static double backoff_step(backoff *b) {
  double waited = tr_now() - b->t0;
  if (waited < 50e-6 || b->spins < 16) {
    b->spins++;
    sched_yield();
  } else {
    b->sleep_ns = b->sleep_ns ? b->sleep_ns * 2 : 20000;
    if (b->sleep_ns > 1000000) b->sleep_ns = 1000000;
    struct timespec ts = {0, b->sleep_ns};
    nanosleep(&ts, NULL);
  }
  return waited;
}

/* --- create / destroy --- */

static void comm_unmap(tr_comm *c) {
  if (c->h) munmap(c->h, c->map_bytes);
  free(c);
}

/* Maps fd (at least `bytes` long) into c. */
static int comm_map(tr_comm *c, int fd, size_t bytes) {
  void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return tr_fail(TR_EIO, "emu communicator: mmap of %zu bytes: %s", bytes, strerror(errno));
  c->h = p;
  c->map_bytes = bytes;
  c->ranks = (emu_rank *)((uint8_t *)p + ranks_off());
  c->slots = (float *)((uint8_t *)p + slots_off(c->nranks));
  return TR_OK;
}

/* Rank 0: creates, sizes and publishes the segment. */
static int create_segment(tr_comm *c, const char *name) {
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0)
    return tr_fail(errno == EEXIST ? TR_EINVAL : TR_EIO, "emu communicator: shm_open %s: %s%s", name,
                   strerror(errno), errno == EEXIST ? " (an id serves one communicator)" : "");
  size_t bytes = seg_bytes(c->nranks);
  int rc = TR_OK;
  if (ftruncate(fd, (off_t)bytes) != 0) {
    rc = tr_fail(TR_EIO, "emu communicator: sizing %s to %zu bytes: %s", name, bytes, strerror(errno));
    goto done;
  }
  if ((rc = comm_map(c, fd, bytes))) goto done;
  c->h->nranks = (uint32_t)c->nranks;
  c->h->slot_bytes = SLOT_BYTES;
  atomic_store_explicit(&c->h->magic, EMU_MAGIC, memory_order_release);
done:
  close(fd);
  return rc;
}

/* Other ranks: opens the segment once rank 0 published it. 0, 1 = not yet
 * (retry), or a negative code. */
static int open_segment(tr_comm *c, const char *name) {
  int fd = shm_open(name, O_RDWR, 0);
  if (fd < 0) {
    if (errno == ENOENT) return 1;
    return tr_fail(TR_EIO, "emu communicator: shm_open %s: %s", name, strerror(errno));
  }
  size_t bytes = seg_bytes(c->nranks);
  struct stat st;
  int rc = 1;
  if (fstat(fd, &st) != 0) {
    rc = tr_fail(TR_EIO, "emu communicator: fstat %s: %s", name, strerror(errno));
  } else if (st.st_size == 0) {
    rc = 1; /* rank 0 has not sized it yet */
  } else if ((size_t)st.st_size != bytes) {
    rc = tr_fail(TR_EINVAL, "emu communicator %s: segment of %lld bytes, %d ranks need %zu (rank count mismatch?)",
                 name, (long long)st.st_size, c->nranks, bytes);
  } else if ((rc = comm_map(c, fd, bytes)) == TR_OK) {
    if (atomic_load_explicit(&c->h->magic, memory_order_acquire) != EMU_MAGIC) {
      munmap(c->h, c->map_bytes);
      c->h = NULL;
      rc = 1; /* sized but not yet published */
    } else if (c->h->nranks != (uint32_t)c->nranks || c->h->slot_bytes != SLOT_BYTES) {
      rc = tr_fail(TR_EINVAL, "emu communicator %s: created for %u ranks, joined as one of %d", name, c->h->nranks,
                   c->nranks);
    }
  }
  close(fd);
  return rc;
}

int emu_comm_create(tr_comm **out, const uint8_t id[TR_COMM_ID_BYTES], int nranks, int rank, double timeout) {
  return emu_comm_create_on(out, id, nranks, rank, timeout, -1);
}

/* After every rank attached: are two ranks on one emulated device? Every
 * rank sees every rank's device then, so all of them fail (TR_EINVAL). */
static int duplicate_device(tr_comm *c, const char *name) {
  for (int a = 0; a < c->nranks; a++) {
    int32_t da = atomic_load(&c->ranks[a].dev);
    for (int b = a + 1; b < c->nranks && da > 0; b++)
      if (atomic_load(&c->ranks[b].dev) == da) {
        atomic_store(&c->ranks[c->rank].left, 1);
        return tr_fail(TR_EINVAL,
                       "emu communicator %s: ranks %d and %d are both on emulated device %d (NCCL refuses two ranks "
                       "on one GPU: one device per replica)",
                       name, a, b, da - 1);
      }
  }
  return TR_OK;
}

int emu_comm_create_on(tr_comm **out, const uint8_t id[TR_COMM_ID_BYTES], int nranks, int rank, double timeout,
                       int dev) {
  *out = NULL;
  const char *name = id_name(id);
  if (!name) return tr_fail(TR_EINVAL, "emu communicator: not an emu communicator id");
  if (nranks < 1 || nranks > EMU_MAX_RANKS || rank < 0 || rank >= nranks)
    return tr_fail(TR_EINVAL, "emu communicator: rank %d of %d", rank, nranks);
  if (!(timeout > 0)) timeout = DEFAULT_DEADLINE;
  tr_comm *c = calloc(1, sizeof *c);
  if (!c) return tr_fail(TR_ENOMEM, "emu communicator: out of memory");
  c->nranks = nranks;
  c->rank = rank;
  int rc;
  backoff b;
  backoff_init(&b);
  if (rank == 0) {
    rc = create_segment(c, name);
  } else {
    while ((rc = open_segment(c, name)) == 1) {
      if (backoff_step(&b) > timeout) {
        rc = tr_fail(TR_EIO, "emu communicator %s: rank 0 did not create it within %.1f s", name, timeout);
        break;
      }
    }
  }
  if (rc) goto error;
  int32_t zero = 0;
  if (!atomic_compare_exchange_strong(&c->ranks[rank].pid, &zero, (int32_t)getpid())) {
    rc = tr_fail(TR_EINVAL, "emu communicator %s: rank %d is already taken (pid %d)", name, rank, (int)zero);
    goto error;
  }
  atomic_store(&c->ranks[rank].dev, dev >= 0 ? dev + 1 : 0);
  atomic_fetch_add(&c->h->attached, 1);
  backoff_init(&b);
  for (;;) {
    uint32_t got = atomic_load(&c->h->attached);
    if (got >= (uint32_t)nranks) break;
    if (atomic_load(&c->h->aborted)) {
      rc = tr_fail(TR_EIO, "emu communicator %s: aborted while attaching", name);
      goto error;
    }
    if (backoff_step(&b) > timeout) {
      char missing[96];
      size_t off = 0;
      missing[0] = 0;
      for (int r = 0; r < nranks && off + 12 < sizeof missing; r++)
        if (!atomic_load(&c->ranks[r].pid)) off += (size_t)snprintf(missing + off, sizeof missing - off, " %d", r);
      /* the ones that came must not wait for the absent ones either */
      uint32_t none = 0;
      atomic_compare_exchange_strong(&c->h->aborted, &none, (uint32_t)rank + 1);
      rc = tr_fail(TR_EIO, "emu communicator %s: %u of %d ranks attached within %.1f s (missing:%s)", name, got, nranks,
                   timeout, missing);
      goto error;
    }
  }
  shm_unlink(name); /* everyone is in: nobody needs the name any more */
  if ((rc = duplicate_device(c, name))) goto error;
  *out = c;
  return TR_OK;
error:
  shm_unlink(name); /* a failed communicator leaves no name behind either */
  comm_unmap(c);
  return rc;
}

void emu_comm_destroy(tr_comm *c, int finalize) {
  (void)finalize; /* a rank that leaves marks its line: peers fail at once, nobody waits */
  if (!c) return;
  if (c->h) atomic_store(&c->ranks[c->rank].left, 1);
  comm_unmap(c);
}

/* --- the all-reduce --- */

__attribute__((format(printf, 2, 3))) static int comm_die(tr_comm *c, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->why, sizeof c->why, fmt, ap);
  va_end(ap);
  c->aborted = 1;
  uint32_t none = 0;
  atomic_compare_exchange_strong(&c->h->aborted, &none, (uint32_t)c->rank + 1);
  return tr_fail(TR_EIO, "%s", c->why);
}

/* Arrives at the next barrier and waits for every rank to reach it. */
static int barrier(tr_comm *c, double deadline) {
  uint64_t g = ++c->gen;
  atomic_store_explicit(&c->ranks[c->rank].arrived, g, memory_order_release);
  backoff b;
  backoff_init(&b);
  int first = 0; /* ranks below this one have arrived */
  for (;;) {
    while (first < c->nranks && atomic_load_explicit(&c->ranks[first].arrived, memory_order_acquire) >= g) first++;
    if (first == c->nranks) return TR_OK;
    uint32_t ab = atomic_load(&c->h->aborted);
    if (ab) return comm_die(c, "emu communicator: aborted by rank %u (rank %d waiting at barrier %llu)", ab - 1,
                            c->rank, (unsigned long long)g);
    if (atomic_load(&c->ranks[first].left))
      return comm_die(c, "emu communicator: rank %d left before barrier %llu (rank %d waiting)", first,
                      (unsigned long long)g, c->rank);
    double waited = backoff_step(&b);
    if (waited > deadline) {
      char missing[96];
      size_t off = 0;
      missing[0] = 0;
      for (int r = first; r < c->nranks && off + 12 < sizeof missing; r++)
        if (atomic_load(&c->ranks[r].arrived) < g) off += (size_t)snprintf(missing + off, sizeof missing - off, " %d", r);
      return comm_die(c, "emu communicator: rank(s)%s did not arrive at barrier %llu within %.2f s (rank %d of %d)",
                      missing, (unsigned long long)g, deadline, c->rank, c->nranks);
    }
  }
}

int emu_comm_allreduce(tr_comm *c, float *buf, size_t n, float scale, double deadline) {
  if (!c || (!buf && n)) return tr_fail(TR_EINVAL, "emu communicator: bad arguments");
  if (c->aborted) return tr_fail(TR_EIO, "emu communicator is aborted: %s", c->why);
  uint32_t ab = atomic_load(&c->h->aborted);
  if (ab) return comm_die(c, "emu communicator: aborted by rank %u", ab - 1);
  if (!(deadline > 0)) deadline = DEFAULT_DEADLINE;
  float *mine = c->slots + (size_t)c->rank * SLOT_FLOATS;
  size_t off = 0;
  int rc;
  do { /* at least one round, so n = 0 is still a collective every rank takes part in */
    size_t len = n - off < SLOT_FLOATS ? n - off : SLOT_FLOATS;
    float *x = buf + off;
    if (len) memcpy(mine, x, len * sizeof(float));
    if ((rc = barrier(c, deadline))) return rc;
    if (len) {
      memcpy(x, c->slots, len * sizeof(float));
      for (int r = 1; r < c->nranks; r++) {
        const float *s = c->slots + (size_t)r * SLOT_FLOATS;
        for (size_t i = 0; i < len; i++) x[i] += s[i];
      }
      if (scale != 1.0f)
        for (size_t i = 0; i < len; i++) x[i] *= scale;
    }
    if ((rc = barrier(c, deadline))) return rc;
    off += len;
  } while (off < n);
  return TR_OK;
}
